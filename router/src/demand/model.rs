//! The demand model (controller.md 3.2–3.3, 4.1): the five windows fed by the request
//! path and the monitor, the learned output lengths, and the price of the offered load in
//! engine equivalents (engine-seconds of work per second) for each phase.
//!
//! ```text
//!  arrival(input)  ─► arrivals          arrival(input, wanted) ─► expected_decode
//!  placed(input, uncached) ─► cache_credit (a placement's cached prefix, off the prefill price)
//!  settled unsized  ─► unsized            completion(input, wanted, delivered) ─► observed_decode
//!  monitor pass    ─► residency (Σ resident tokens / what one engine holds within TPOT)
//!  price(now, horizon, profiles) ─► Demand { prefill_engines, decode_engines, complete, ... }
//! ```
//!
//! Pure: `now` is passed in.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::window::Window;
use crate::profile::Profile;

/// What the model needs to know about the fleet and the settings to price demand.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PriceInputs<'a> {
    /// The engine profiles to price with (empty: demand is incomplete).
    pub(crate) profiles: &'a [Profile],
    /// `slo.tpot_s`.
    pub(crate) tpot_s: f64,
    /// The fleet's decode correction (median over decode engines, 1.0 without).
    pub(crate) correction: f64,
}

/// The offered load over one horizon (controller.md 4.1).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Demand {
    /// Prefill work, engine equivalents.
    pub(crate) prefill_engines: f64,
    /// Decode work, engine equivalents (at least the measured residency).
    pub(crate) decode_engines: f64,
    /// Every arrival was priced (outputs known, shapes within the profiles).
    pub(crate) complete: bool,
    /// Arrivals (sized and unsized) over `window_s`.
    pub(crate) arrivals: u64,
    /// Sized arrivals over the horizon.
    pub(crate) parsed: u64,
    /// Arrivals settled before sizing over the horizon.
    pub(crate) unsized_offers: u64,
    /// Completions with token accounting retained.
    pub(crate) output_observations: u64,
    /// Arrivals whose decode shape no profile covers (priced 0), over the horizon.
    pub(crate) arrivals_beyond_profile: u64,
    /// The horizon priced, seconds.
    pub(crate) horizon_s: f64,
}

/// Learned output lengths (controller.md 3.3).
#[derive(Debug, Clone, Default, PartialEq)]
struct Learned {
    /// (pow2 input bucket, pow2 wanted bucket) → weighted median of delivered/wanted.
    fraction: BTreeMap<(u32, u32), f64>,
    /// pow2 input bucket → median delivered length.
    median: BTreeMap<u32, f64>,
}

/// Completions a learned estimate needs.
const MIN_LEARN: u64 = 3;

fn pow2_bucket(x: u64) -> u32 {
    64 - x.max(1).leading_zeros()
}

/// The weighted medians of the keys with at least [`MIN_LEARN`] observations.
fn learn<K: Ord>(m: BTreeMap<K, Vec<(f64, u64)>>) -> BTreeMap<K, f64> {
    m.into_iter()
        .filter(|(_, v)| v.iter().map(|(_, w)| *w).sum::<u64>() >= MIN_LEARN)
        .filter_map(|(k, v)| Some((k, weighted_median(v)?)))
        .collect()
}

/// The weighted median of `(value, weight)` pairs.
fn weighted_median(mut v: Vec<(f64, u64)>) -> Option<f64> {
    let total: u64 = v.iter().map(|(_, w)| *w).sum();
    if total == 0 {
        return None;
    }
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut acc = 0;
    for (x, w) in &v {
        acc += w;
        if acc * 2 >= total {
            return Some(*x);
        }
    }
    v.last().map(|(x, _)| *x)
}

/// The demand model (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct DemandModel {
    started: Instant,
    step_s: f64,
    window_s: f64,
    arrivals: Window<u64>,
    /// `(input, uncached)` of placements the KV index credited with a cached prefix.
    credit: Window<(u64, u64)>,
    unsized_w: Window<()>,
    expected: Window<(u64, u64)>,
    observed: Window<(u64, u64, u64)>,
    /// Residency samples in milli-engines.
    residency: Window<u64>,
    learned: Learned,
}

impl DemandModel {
    /// An empty model from `started` (the router's construction): buckets of
    /// `min(1, step_s, evidence_span_s)` s, retention `window_s` (`observed_decode` 4×).
    pub(crate) fn new(
        started: Instant,
        step_s: f64,
        window_s: f64,
        evidence_span_s: f64,
    ) -> DemandModel {
        let bucket = 1f64.min(step_s).min(evidence_span_s);
        DemandModel {
            started,
            step_s,
            window_s,
            arrivals: Window::new(started, bucket, window_s),
            credit: Window::new(started, bucket, window_s),
            unsized_w: Window::new(started, bucket, window_s),
            expected: Window::new(started, bucket, window_s),
            observed: Window::new(started, bucket, 4.0 * window_s),
            residency: Window::new(started, bucket, window_s),
            learned: Learned::default(),
        }
    }

    /// A sized arrival of `input` prompt tokens wanting `wanted` output tokens (0 = not
    /// given).
    pub(crate) fn arrival(&mut self, now: Instant, input: u64, wanted: u64) {
        self.arrivals.observe(now, input, 1);
        self.expected.observe(now, (input, wanted), 1);
    }

    /// A request of `input` prompt tokens was placed (its first attempt) where it computes
    /// only `uncached` of them, the rest being credited as cached by the KV index
    /// (controller.md 3.5): its arrival's prefill price is lowered from `prefill_time(input)`
    /// to `prefill_time(uncached)`. Nothing is recorded when nothing is cached.
    pub(crate) fn placed(&mut self, now: Instant, input: u64, uncached: u64) {
        if uncached < input {
            self.credit.observe(now, (input, uncached), 1);
        }
    }

    /// A request settled before sizing (ingress 429/503, an unread body), `invalid` aside.
    pub(crate) fn settled_unsized(&mut self, now: Instant) {
        self.unsized_w.observe(now, (), 1);
    }

    /// A completion with token accounting: `delivered` output tokens.
    pub(crate) fn completion(&mut self, now: Instant, input: u64, wanted: u64, delivered: u64) {
        self.observed.observe(now, (input, wanted, delivered), 1);
        self.relearn(now);
    }

    /// One residency sample (engine equivalents of resident decode work now).
    pub(crate) fn residency_sample(&mut self, now: Instant, engines: f64) {
        let milli = (engines.max(0.0) * 1000.0).round() as u64;
        self.residency.observe(now, milli, 1);
    }

    fn relearn(&mut self, now: Instant) {
        self.observed.prune(now);
        // An overflow row has no shape: the estimates learnt without overflow stay frozen.
        if self.observed.has_overflow() {
            return;
        }
        let mut by_pair: BTreeMap<(u32, u32), Vec<(f64, u64)>> = BTreeMap::new();
        let mut by_input: BTreeMap<u32, Vec<(f64, u64)>> = BTreeMap::new();
        let since = now
            .checked_sub(Duration::from_secs_f64(self.observed.retention_s()))
            .unwrap_or(self.started);
        for (k, c) in self.observed.rows(since) {
            let Some(&(input, wanted, delivered)) = k else {
                continue;
            };
            let ib = pow2_bucket(input);
            if wanted > 0 {
                by_pair
                    .entry((ib, pow2_bucket(wanted)))
                    .or_default()
                    .push((delivered as f64 / wanted as f64, c.count));
            }
            by_input
                .entry(ib)
                .or_default()
                .push((delivered as f64, c.count));
        }
        self.learned = Learned {
            fraction: learn(by_pair),
            median: learn(by_input),
        };
    }

    /// The output a request of `input` tokens wanting `wanted` (0 = not given) is expected to
    /// produce: the learned fraction of `wanted`, or `wanted`; without `wanted` the learned
    /// median for its input size; 0 when unknown (controller.md 3.3).
    pub(crate) fn expected_output(&self, input: u64, wanted: u64) -> u64 {
        let ib = pow2_bucket(input);
        if wanted > 0 {
            match self.learned.fraction.get(&(ib, pow2_bucket(wanted))) {
                Some(f) => ((wanted as f64 * f).round() as u64).clamp(1, wanted),
                None => wanted,
            }
        } else {
            self.learned
                .median
                .get(&ib)
                .map_or(0, |m| m.round().max(1.0) as u64)
        }
    }

    fn since(&self, now: Instant, horizon: f64) -> Instant {
        now.checked_sub(Duration::from_secs_f64(horizon.max(0.0)))
            .unwrap_or(self.started)
    }

    /// Prices the demand over `horizon_s` seconds (controller.md 4.1): prefill =
    /// Σ arrival cohorts `prefill_time(input)·count/span` less Σ cache-credit cohorts
    /// `(prefill_time(input) − prefill_time(uncached))·count/span` (controller.md 3.5), never
    /// below 0, each price the mean over the profiles;
    /// decode = Σ `count/(span·decode_rps)` with `decode_rps` at `(in + out/2, out)`; both
    /// scaled by `(parsed + unsized)/parsed`; decode at least the mean residency over
    /// `resident_s`.
    pub(crate) fn price(
        &self,
        now: Instant,
        horizon_s: f64,
        resident_s: f64,
        inp: PriceInputs<'_>,
    ) -> Demand {
        let elapsed = now.saturating_duration_since(self.started).as_secs_f64();
        let span = horizon_s.min(elapsed.max(self.step_s)).max(1e-9);
        let since = self.since(now, horizon_s);
        let parsed = self.arrivals.count_since(since);
        let unsized_n = self.unsized_w.count_since(since);
        let mut complete = !(inp.profiles.is_empty() || (parsed == 0 && unsized_n > 0));
        let n = inp.profiles.len().max(1) as f64;
        let mut prefill = 0.0;
        for (k, c) in self.arrivals.rows(since) {
            // The overflow cohort has no shape: priced at the largest shape seen is not
            // knowable either, so it is priced at the mean of the known cohorts' shapes.
            let input = match k {
                Some(i) => *i,
                None => self.mean_input(since),
            };
            let price: f64 = inp
                .profiles
                .iter()
                .map(|p| p.prefill_time(input))
                .sum::<f64>()
                / n;
            prefill += price * c.count as f64 / span;
        }
        // What placements found cached comes off (an overflow cohort has no shape: no credit,
        // so it stays priced at its whole prompts).
        for (k, c) in self.credit.rows(since) {
            let Some(&(input, uncached)) = k else {
                continue;
            };
            let saved: f64 = inp
                .profiles
                .iter()
                .map(|p| p.prefill_time(input) - p.prefill_time(uncached))
                .sum::<f64>()
                / n;
            prefill -= saved.max(0.0) * c.count as f64 / span;
        }
        let prefill = prefill.max(0.0);
        let mut decode = 0.0;
        let mut beyond = 0;
        for (k, c) in self.expected.rows(since) {
            let (input, out) = match k {
                Some(&(input, wanted)) => (input, self.expected_output(input, wanted)),
                // An overflow cohort uses the full `wanted`: unknown here, so incomplete.
                None => (0, 0),
            };
            if out == 0 {
                complete = false;
                continue;
            }
            let ctx = input as f64 + out as f64 / 2.0;
            let cap: f64 = inp
                .profiles
                .iter()
                .map(|p| p.decode_rps(inp.tpot_s, ctx, out as f64, inp.correction))
                .sum::<f64>()
                / n;
            if cap <= 0.0 {
                complete = false;
                beyond += c.count;
                continue;
            }
            decode += c.count as f64 / (span * cap);
        }
        let scale = if parsed > 0 {
            (parsed + unsized_n) as f64 / parsed as f64
        } else {
            1.0
        };
        let residency = self.mean_residency(now, resident_s);
        let window_since = self.since(now, self.window_s);
        Demand {
            prefill_engines: prefill * scale,
            decode_engines: residency.max(decode * scale),
            complete,
            arrivals: self.arrivals.count_since(window_since)
                + self.unsized_w.count_since(window_since),
            parsed,
            unsized_offers: unsized_n,
            output_observations: self.observed.observations(),
            arrivals_beyond_profile: beyond,
            horizon_s,
        }
    }

    fn mean_input(&self, since: Instant) -> u64 {
        let (sum, n) = self
            .arrivals
            .rows(since)
            .filter_map(|(k, c)| Some((*k? * c.count, c.count)))
            .fold((0, 0), |(s, n), (a, b)| (s + a, n + b));
        sum.checked_div(n).unwrap_or(0)
    }

    /// The mean residency sample over the last `horizon_s` seconds (engine equivalents).
    pub(crate) fn mean_residency(&self, now: Instant, horizon_s: f64) -> f64 {
        let since = self.since(now, horizon_s);
        let (sum, n) = self
            .residency
            .rows(since)
            .filter_map(|(k, c)| Some((*k? as f64 * c.count as f64, c.count)))
            .fold((0.0, 0), |(s, n), (a, b)| (s + a, n + b));
        if n == 0 { 0.0 } else { sum / n as f64 / 1000.0 }
    }

    /// Sized arrivals whose last observation is at or after `since`.
    pub(crate) fn arrivals_since(&self, since: Instant) -> u64 {
        self.arrivals.count_since(since)
    }

    /// Conservative arrival evidence after `cutoff` (controller.md 8).
    pub(crate) fn evidence(&self, cutoff: Instant) -> (u64, Option<Instant>) {
        self.arrivals.evidence(cutoff)
    }

    /// `demand_history` for `/narwhal/state` and the metrics: one entry per window.
    pub(crate) fn history(&self) -> Vec<(&'static str, WindowStats)> {
        vec![
            ("unsized", WindowStats::of(&self.unsized_w)),
            ("arrivals", WindowStats::of(&self.arrivals)),
            ("expected_decode", WindowStats::of(&self.expected)),
            ("observed_decode", WindowStats::of(&self.observed)),
            ("residency", WindowStats::of(&self.residency)),
            ("cache_credit", WindowStats::of(&self.credit)),
        ]
    }
}

/// The size of one demand window (`/narwhal/state.demand_history.<window>`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct WindowStats {
    /// Bucket length, seconds.
    pub(crate) bucket_s: f64,
    /// Retention, seconds.
    pub(crate) retained_s: f64,
    /// The most cohorts it can hold.
    pub(crate) cell_limit: usize,
    /// Cohorts held.
    pub(crate) cells: usize,
    /// Observations held.
    pub(crate) observations: u64,
    /// Observations that landed in overflow cohorts.
    pub(crate) overflow_observations: u64,
}

impl WindowStats {
    fn of<K: Ord + Clone>(w: &Window<K>) -> WindowStats {
        WindowStats {
            bucket_s: w.bucket_s(),
            retained_s: w.retention_s(),
            cell_limit: w.cell_limit(),
            cells: w.cells(),
            observations: w.observations(),
            overflow_observations: w.overflow_observations(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::fixture;
    use narwhal_shared::{Clock as _, SystemClock};

    fn s(x: f64) -> Duration {
        Duration::from_secs_f64(x)
    }

    /// L1 of controller.md section 14 (2 req/s of 500-token prompts, max_tokens 50) is
    /// about 1.02 prefill engines and 0.068 decode engines.
    #[test]
    fn l1_prices_one_prefill_engine_of_work() {
        let t0 = SystemClock.now();
        let mut m = DemandModel::new(t0, 5.0, 120.0, 60.0);
        for i in 0..120 {
            m.arrival(t0 + s(0.5 * i as f64), 500, 50);
        }
        let now = t0 + s(60.0);
        let profiles = [fixture()];
        let d = m.price(
            now,
            120.0,
            120.0,
            PriceInputs {
                profiles: &profiles,
                tpot_s: 0.1,
                correction: 1.0,
            },
        );
        assert!(d.complete);
        assert_eq!(d.parsed, 120);
        assert!(
            (d.prefill_engines - 1.02).abs() < 1e-9,
            "{}",
            d.prefill_engines
        );
        let rps = fixture().decode_rps(0.1, 525.0, 50.0, 1.0);
        assert!(
            (d.decode_engines - 2.0 / rps).abs() < 1e-9,
            "{}",
            d.decode_engines
        );
    }

    /// L1 served from cache (controller.md 3.5): every placement credited with 496 of its
    /// 500 tokens prices 2 req/s of 4-token prefills, 0.028 prefill engines instead of 1.02;
    /// half of them credited prices the mean; the decode demand keeps the whole prompt.
    #[test]
    fn cached_placements_take_their_prefix_off_the_prefill_price() {
        let t0 = SystemClock.now();
        let profiles = [fixture()];
        let inp = PriceInputs {
            profiles: &profiles,
            tpot_s: 0.1,
            correction: 1.0,
        };
        let run = |credited: &dyn Fn(usize) -> bool| {
            let mut m = DemandModel::new(t0, 5.0, 120.0, 60.0);
            for i in 0..120 {
                let at = t0 + s(0.5 * i as f64);
                m.arrival(at, 500, 50);
                m.placed(at, 500, if credited(i) { 4 } else { 500 });
            }
            m.price(t0 + s(60.0), 120.0, 120.0, inp)
        };
        let all = run(&|_| true);
        assert!(
            (all.prefill_engines - 0.028).abs() < 1e-9,
            "{}",
            all.prefill_engines
        );
        let half = run(&|i| i % 2 == 0);
        assert!(
            (half.prefill_engines - (1.02 + 0.028) / 2.0).abs() < 1e-9,
            "{}",
            half.prefill_engines
        );
        let none = run(&|_| false);
        assert!((none.prefill_engines - 1.02).abs() < 1e-9);
        let rps = fixture().decode_rps(0.1, 525.0, 50.0, 1.0);
        for d in [&all, &half, &none] {
            assert!((d.decode_engines - 2.0 / rps).abs() < 1e-9);
            assert_eq!(d.parsed, 120);
        }
    }

    /// Without max_tokens and before three completions the output is unknown: demand is
    /// incomplete; three completions teach the median (controller.md 3.3, S10).
    #[test]
    fn outputs_are_learnt_from_three_completions() {
        let t0 = SystemClock.now();
        let mut m = DemandModel::new(t0, 5.0, 120.0, 60.0);
        m.arrival(t0 + s(1.0), 100, 0);
        let profiles = [fixture()];
        let inp = PriceInputs {
            profiles: &profiles,
            tpot_s: 0.1,
            correction: 1.0,
        };
        assert!(!m.price(t0 + s(2.0), 120.0, 120.0, inp).complete);
        for out in [16, 16, 20] {
            m.completion(t0 + s(1.5), 100, 0, out);
        }
        assert_eq!(m.expected_output(100, 0), 16);
        assert!(m.price(t0 + s(2.0), 120.0, 120.0, inp).complete);
        // With max_tokens, the learnt fraction of it: half of what was asked.
        for _ in 0..3 {
            m.completion(t0 + s(1.5), 100, 200, 100);
        }
        assert_eq!(m.expected_output(100, 200), 100);
        assert_eq!(m.expected_output(100, 5000), 5000, "another wanted bucket");
    }

    /// Unsized offers scale the priced demand up, and alone make it incomplete.
    #[test]
    fn unsized_offers_scale_the_demand() {
        let t0 = SystemClock.now();
        let mut m = DemandModel::new(t0, 5.0, 120.0, 60.0);
        let profiles = [fixture()];
        let inp = PriceInputs {
            profiles: &profiles,
            tpot_s: 0.1,
            correction: 1.0,
        };
        m.settled_unsized(t0 + s(1.0));
        assert!(!m.price(t0 + s(10.0), 120.0, 120.0, inp).complete);
        m.arrival(t0 + s(1.0), 1000, 10);
        let d = m.price(t0 + s(10.0), 120.0, 120.0, inp);
        assert!((d.prefill_engines - 2.0 * 1.01 / 10.0).abs() < 1e-9);
        assert_eq!(d.unsized_offers, 1);
        assert_eq!(d.arrivals, 2);
    }

    #[test]
    fn residency_is_a_floor_under_decode_demand() {
        let t0 = SystemClock.now();
        let mut m = DemandModel::new(t0, 1.0, 24.0, 12.0);
        m.residency_sample(t0 + s(1.0), 2.0);
        m.residency_sample(t0 + s(2.0), 4.0);
        assert!((m.mean_residency(t0 + s(3.0), 24.0) - 3.0).abs() < 1e-9);
        let profiles = [fixture()];
        let d = m.price(
            t0 + s(3.0),
            24.0,
            24.0,
            PriceInputs {
                profiles: &profiles,
                tpot_s: 0.1,
                correction: 1.0,
            },
        );
        assert!((d.decode_engines - 3.0).abs() < 1e-9);
    }
}
