//! The controller's request-path bookkeeping (controller.md 1 and 3.1): which requests are
//! resident on which engine in which phase, which wait for a seat, the token gaps and
//! handoff delays each decode engine shows, and the decode correction learnt from them. The
//! only inputs the controller has: it never polls engines.
//!
//! ```text
//!  arrive ─► dispatched(iid, phase) ─► first_token(iid) ─► tokens(total)… ─► finished
//!  waiting / unwait (admission queue)       attempt_ended (a failed attempt's legs)
//!  rollover(now) once per pass: publish gap means, handoff delays, prefill prices; corrections
//! ```
//!
//! Pure: `now` is passed in; requests are keyed by a router-local number.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::config::Reactive;
use crate::placement::Phase;
use crate::profile::Profile;

/// One tracked request.
#[derive(Debug, Clone)]
pub(crate) struct Req {
    /// The router request id (`x-request-id`).
    pub(crate) rid: String,
    /// Arrival (monotonic).
    pub(crate) arrived: Instant,
    /// Sized prompt tokens (0 before sizing): the request's size wherever a size is meant
    /// (the decode's KV, pending decode shapes, learned outputs).
    pub(crate) input: u64,
    /// The engine of the latest placement and the prompt tokens the KV index credits it
    /// with there (controller.md 3.5); `None` before placement or without a KV score.
    cached: Option<(usize, u64)>,
    /// `max_completion_tokens`/`max_tokens` (0 = not given).
    pub(crate) wanted: u64,
    /// Prefill leg's engine while resident there.
    pub(crate) prefill_on: Option<usize>,
    /// Decode leg's engine while resident there.
    pub(crate) decode_on: Option<usize>,
    /// When the decode leg was dispatched.
    decode_at: Option<Instant>,
    /// Last output token (monotonic), once the first arrived.
    last_token: Option<Instant>,
    /// Output tokens relayed.
    pub(crate) delivered: u64,
    /// When the prefill leg started on `prefill_on`.
    prefill_at: Option<Instant>,
    /// The profile price of its prefill on `prefill_on` (of its uncached tokens there),
    /// seconds.
    prefill_price: f64,
}

impl Req {
    /// Prompt tokens engine `iid` computes for this request's prefill (controller.md 3.5):
    /// `input − cached` when the latest placement credited `iid` with `cached` tokens,
    /// never below 0; the whole prompt otherwise.
    pub(crate) fn uncached_on(&self, iid: usize) -> u64 {
        match self.cached {
            Some((e, cached)) if e == iid => self.input.saturating_sub(cached),
            _ => self.input,
        }
    }
}

/// One engine's decode timing over the current interval and the last published one.
#[derive(Debug, Clone, Default)]
struct Timing {
    gap_sum: f64,
    gap_n: u64,
    mixed: bool,
    ratio_sum: f64,
    ratio_n: u64,
    handoff_sum: f64,
    handoff_n: u64,
    /// Time-integral of resident prefill seconds over the interval.
    prefill_area: f64,
    area_from: Option<Instant>,
    published_gap: Option<f64>,
    published_handoff: Option<f64>,
    published_prefill: f64,
    correction: f64,
}

/// A request waiting for an admission seat (FIFO by arrival).
#[derive(Debug, Clone)]
pub(crate) struct Waiting {
    /// Router request id.
    pub(crate) rid: String,
    /// Arrival.
    pub(crate) arrived: Instant,
    /// Sized prompt tokens.
    pub(crate) input: u64,
}

/// The bookkeeping (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct Book {
    reqs: BTreeMap<u64, Req>,
    /// Per-engine aggregates of `reqs`, kept as the requests move (O(1) reads per token).
    loads: Vec<Load>,
    waiting: BTreeMap<u64, Waiting>,
    timing: Vec<Timing>,
    profiles: Vec<Option<Profile>>,
    tpot_s: f64,
    corr_min: f64,
    corr_max: f64,
    corr_alpha: f64,
    corr_min_samples: u64,
}

/// What one engine carries now, for the controller and admission.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Load {
    /// Prefill residents.
    pub(crate) prefill: u32,
    /// Decode residents.
    pub(crate) decode: u32,
    /// Σ profile price of the resident prefills, seconds.
    pub(crate) prefill_s: f64,
    /// Σ resident decode tokens (prompt + delivered).
    pub(crate) decode_tokens: f64,
    /// Decode residents that have their first token.
    pub(crate) streaming: u32,
}

impl Book {
    /// Empty bookkeeping for engines with `profiles` (config order; `None` = unprofiled).
    pub(crate) fn new(profiles: Vec<Option<Profile>>, tpot_s: f64, r: &Reactive) -> Book {
        let timing = profiles
            .iter()
            .map(|_| Timing {
                correction: 1.0,
                ..Timing::default()
            })
            .collect();
        Book {
            loads: vec![Load::default(); profiles.len()],
            reqs: BTreeMap::new(),
            waiting: BTreeMap::new(),
            timing,
            profiles,
            tpot_s,
            corr_min: r.decode_correction_min,
            corr_max: r.decode_correction_max,
            corr_alpha: r.decode_correction_alpha,
            corr_min_samples: r.decode_correction_min_samples,
        }
    }

    /// A request arrived (not yet sized).
    pub(crate) fn arrive(&mut self, id: u64, rid: &str, now: Instant) {
        self.reqs.insert(
            id,
            Req {
                rid: rid.to_string(),
                arrived: now,
                input: 0,
                cached: None,
                wanted: 0,
                prefill_on: None,
                decode_on: None,
                decode_at: None,
                last_token: None,
                delivered: 0,
                prefill_at: None,
                prefill_price: 0.0,
            },
        );
    }

    /// Takes request `id` off its prefill engine's aggregate.
    fn leave_prefill(&mut self, id: u64) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if let Some(p) = r.prefill_on.take() {
            let l = &mut self.loads[p];
            l.prefill = l.prefill.saturating_sub(1);
            l.prefill_s = (l.prefill_s - r.prefill_price).max(0.0);
            if l.prefill == 0 {
                l.prefill_s = 0.0;
            }
        }
    }

    /// Takes request `id` off its decode engine's aggregate.
    fn leave_decode(&mut self, id: u64) {
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        if let Some(d) = r.decode_on.take() {
            let l = &mut self.loads[d];
            l.decode = l.decode.saturating_sub(1);
            l.decode_tokens = (l.decode_tokens - (r.input + r.delivered) as f64).max(0.0);
            if r.last_token.is_some() {
                l.streaming = l.streaming.saturating_sub(1);
            }
            if l.decode == 0 {
                l.decode_tokens = 0.0;
            }
        }
    }

    /// The request is sized.
    pub(crate) fn sized(&mut self, id: u64, input: u64, wanted: u64) {
        if let Some(r) = self.reqs.get_mut(&id) {
            r.input = input;
            r.wanted = wanted;
        }
    }

    /// The request was placed on engine `iid`, whose prefix cache the KV index credits with
    /// `cached` of its prompt tokens (`None`: no KV score, the whole prompt is computed).
    /// Replaces an earlier attempt's placement; its prefill there is priced by
    /// [`Req::uncached_on`] from its dispatch on.
    pub(crate) fn placed(&mut self, id: u64, iid: usize, cached: Option<u64>) {
        if let Some(r) = self.reqs.get_mut(&id) {
            r.cached = cached.map(|c| (iid, c));
        }
    }

    /// The tracked request `id`.
    pub(crate) fn req(&self, id: u64) -> Option<&Req> {
        self.reqs.get(&id)
    }

    /// The request waits for an admission seat.
    pub(crate) fn wait(&mut self, id: u64) {
        if let Some(r) = self.reqs.get(&id) {
            self.waiting.insert(
                id,
                Waiting {
                    rid: r.rid.clone(),
                    arrived: r.arrived,
                    input: r.input,
                },
            );
        }
    }

    /// The request stopped waiting (seated, refused or gone).
    pub(crate) fn unwait(&mut self, id: u64) {
        self.waiting.remove(&id);
    }

    /// Requests waiting for a seat, by arrival.
    pub(crate) fn waiting(&self) -> Vec<Waiting> {
        let mut w: Vec<Waiting> = self.waiting.values().cloned().collect();
        w.sort_by_key(|x| x.arrived);
        w
    }

    fn settle_area(&mut self, iid: usize, now: Instant) {
        let load = self.load(iid).prefill_s;
        let t = &mut self.timing[iid];
        if let Some(from) = t.area_from {
            t.prefill_area += load * now.saturating_duration_since(from).as_secs_f64();
        }
        t.area_from = Some(now);
    }

    /// A leg of `id` was dispatched to engine `iid`.
    pub(crate) fn dispatched(&mut self, id: u64, iid: usize, phase: Phase, now: Instant) {
        if iid >= self.timing.len() {
            return;
        }
        if phase == Phase::Prefill {
            self.settle_area(iid, now);
        }
        if !self.reqs.contains_key(&id) {
            return;
        }
        match phase {
            Phase::Prefill => {
                self.leave_prefill(id);
                let price = self
                    .profiles
                    .get(iid)
                    .and_then(Option::as_ref)
                    .map_or(0.0, |p| p.prefill_time(self.reqs[&id].uncached_on(iid)));
                let r = self.reqs.get_mut(&id).expect("present above");
                r.prefill_on = Some(iid);
                r.prefill_at = Some(now);
                r.prefill_price = price;
                self.loads[iid].prefill += 1;
                self.loads[iid].prefill_s += price;
            }
            Phase::Decode => {
                self.leave_decode(id);
                let r = self.reqs.get_mut(&id).expect("present above");
                r.decode_on = Some(iid);
                r.decode_at = Some(now);
                let l = &mut self.loads[iid];
                l.decode += 1;
                l.decode_tokens += (r.input + r.delivered) as f64;
                if r.last_token.is_some() {
                    l.streaming += 1;
                }
            }
        }
    }

    /// The decode leg on `iid` produced its first token: the prefill resident leaves and the
    /// handoff delay (decode dispatch → first token) is recorded on the decode engine.
    pub(crate) fn first_token(&mut self, id: u64, now: Instant) {
        let Some(r) = self.reqs.get(&id) else { return };
        if let Some(p) = r.prefill_on {
            self.settle_area(p, now);
        }
        self.leave_prefill(id);
        let r = self.reqs.get_mut(&id).expect("present above");
        let first = r.last_token.is_none();
        r.last_token = Some(now);
        if let Some(d) = r.decode_on
            && first
        {
            self.loads[d].streaming += 1;
        }
        if let (Some(d), Some(at)) = (r.decode_on, r.decode_at)
            && let Some(t) = self.timing.get_mut(d)
        {
            t.handoff_sum += now.saturating_duration_since(at).as_secs_f64();
            t.handoff_n += 1;
        }
    }

    /// The decode stream of `id` has relayed `total` output tokens by `now`: each new token
    /// is one gap of `elapsed/k` (k tokens in one chunk), recorded on the decode engine with
    /// its ratio to the profile's interval for the engine's resident batch.
    pub(crate) fn tokens(&mut self, id: u64, total: u64, now: Instant) {
        let Some(r) = self.reqs.get(&id) else { return };
        let (Some(d), Some(last)) = (r.decode_on, r.last_token) else {
            return;
        };
        if total <= r.delivered {
            return;
        }
        let k = total - r.delivered;
        let gap = now.saturating_duration_since(last).as_secs_f64() / k as f64;
        let load = self.load(d);
        let expected = self
            .profiles
            .get(d)
            .and_then(Option::as_ref)
            .map(|p| p.token_interval(load.decode_tokens, f64::from(load.decode.max(1))));
        let r = self.reqs.get_mut(&id).expect("present above");
        // The first chunk's count was set at the first token: only the growth is a gap.
        if r.delivered > 0 {
            let t = &mut self.timing[d];
            t.gap_sum += gap * k as f64;
            t.gap_n += k;
            if load.prefill > 0 {
                t.mixed = true;
            }
            if let Some(e) = expected.filter(|e| *e > 0.0) {
                t.ratio_sum += gap / e * k as f64;
                t.ratio_n += k;
            }
        }
        r.delivered = total;
        r.last_token = Some(now);
        self.loads[d].decode_tokens += k as f64;
    }

    /// A failed attempt's legs ended: the request is resident nowhere.
    pub(crate) fn attempt_ended(&mut self, id: u64, now: Instant) {
        if let Some(p) = self.reqs.get(&id).and_then(|r| r.prefill_on) {
            self.settle_area(p, now);
        }
        self.leave_prefill(id);
        self.leave_decode(id);
        if let Some(r) = self.reqs.get_mut(&id) {
            r.decode_at = None;
            r.last_token = None;
            r.delivered = 0;
        }
    }

    /// The request ended; returns it.
    pub(crate) fn finished(&mut self, id: u64, now: Instant) -> Option<Req> {
        if let Some(p) = self.reqs.get(&id).and_then(|r| r.prefill_on) {
            self.settle_area(p, now);
        }
        self.leave_prefill(id);
        self.leave_decode(id);
        self.waiting.remove(&id);
        self.reqs.remove(&id)
    }

    /// What engine `iid` carries now.
    pub(crate) fn load(&self, iid: usize) -> Load {
        self.loads.get(iid).cloned().unwrap_or_default()
    }

    /// Router-local ids of the requests resident on `iid` in `phase`.
    pub(crate) fn resident_ids(&self, iid: usize, phase: Phase) -> Vec<u64> {
        self.reqs
            .iter()
            .filter(|(_, r)| match phase {
                Phase::Prefill => r.prefill_on == Some(iid),
                Phase::Decode => r.decode_on == Some(iid),
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// Whether request `id` is still resident on `iid` in `phase`.
    pub(crate) fn is_resident(&self, id: u64, iid: usize, phase: Phase) -> bool {
        self.reqs.get(&id).is_some_and(|r| match phase {
            Phase::Prefill => r.prefill_on == Some(iid),
            Phase::Decode => r.decode_on == Some(iid),
        })
    }

    /// Requests in their prefill leg (pending decode shapes) and the tokens they will bring.
    pub(crate) fn pending_decode(&self) -> (u64, f64) {
        let mut n = 0;
        let mut tokens = 0.0;
        for r in self.reqs.values() {
            if r.prefill_on.is_some() && r.decode_on.is_none() {
                n += 1;
                tokens += r.input as f64;
            }
        }
        for w in self.waiting.values() {
            n += 1;
            tokens += w.input as f64;
        }
        (n, tokens)
    }

    /// Prefill load of `iid` (controller.md 3.1): the larger of the resident prefill
    /// seconds and last interval's time average, over `ttft`.
    pub(crate) fn prefill_load(&self, iid: usize, ttft: f64) -> f64 {
        let now_s = self.load(iid).prefill_s;
        now_s.max(self.timing[iid].published_prefill) / ttft
    }

    /// Decode load of `iid` (controller.md 3.1): 0 without decode residents; else the
    /// published mean gap (or the longest open gap while the interval has none) above the
    /// profile's floor, over the TPOT budget above it.
    pub(crate) fn decode_load(&self, iid: usize, now: Instant) -> f64 {
        let load = self.load(iid);
        if load.decode == 0 {
            return 0.0;
        }
        let t = &self.timing[iid];
        let mut obs = t.published_gap.unwrap_or(0.0);
        if t.gap_n == 0 {
            let open = self
                .reqs
                .values()
                .filter(|r| r.decode_on == Some(iid))
                .filter_map(|r| r.last_token)
                .map(|l| now.saturating_duration_since(l).as_secs_f64())
                .fold(0.0, f64::max);
            obs = obs.max(open);
        }
        let floor = self
            .profiles
            .get(iid)
            .and_then(Option::as_ref)
            .map_or(0.0, |p| p.floor_interval() * t.correction);
        if floor >= self.tpot_s {
            obs / self.tpot_s
        } else {
            (obs - floor).max(0.0) / (self.tpot_s - floor)
        }
    }

    /// The last published mean handoff delay of `iid` (0 without samples), seconds.
    pub(crate) fn handoff_s(&self, iid: usize) -> f64 {
        self.timing[iid].published_handoff.unwrap_or(0.0)
    }

    /// The decode correction of `iid`.
    pub(crate) fn correction(&self, iid: usize) -> f64 {
        self.timing[iid].correction
    }

    /// Ends the interval at `now` (controller.md 2.2 `rollover`): gap means, handoff
    /// delays and time-averaged prefill prices are published; each engine's correction moves
    /// by `alpha` toward the clamped mean ratio when the interval was not mixed and had
    /// enough samples (controller.md 3.1).
    pub(crate) fn rollover(&mut self, now: Instant, interval_s: f64) {
        for i in 0..self.timing.len() {
            self.settle_area(i, now);
            let (min, max, alpha, need) = (
                self.corr_min,
                self.corr_max,
                self.corr_alpha,
                self.corr_min_samples,
            );
            let t = &mut self.timing[i];
            if t.gap_n > 0 {
                t.published_gap = Some(t.gap_sum / t.gap_n as f64);
            }
            t.published_handoff = (t.handoff_n > 0).then(|| t.handoff_sum / t.handoff_n as f64);
            t.published_prefill = if interval_s > 0.0 {
                t.prefill_area / interval_s
            } else {
                0.0
            };
            if !t.mixed && t.ratio_n >= need {
                let mean = (t.ratio_sum / t.ratio_n as f64).clamp(min, max);
                t.correction += alpha * (mean - t.correction);
            }
            t.gap_sum = 0.0;
            t.gap_n = 0;
            t.mixed = false;
            t.ratio_sum = 0.0;
            t.ratio_n = 0;
            t.handoff_sum = 0.0;
            t.handoff_n = 0;
            t.prefill_area = 0.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::fixture;
    use narwhal_shared::{Clock as _, SystemClock};
    use std::time::Duration;

    fn reactive() -> Reactive {
        crate::config::Config::from_json_str(
            &serde_json::json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m",
                "engines": [{"iid": "e0", "url": "http://127.0.0.1:1"}],
                "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
                "controller": {"reactive": {"decode_correction_min_samples": 2}}
            })
            .to_string(),
            &|_| None,
        )
        .expect("fleet")
        .controller
        .reactive
    }

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    #[test]
    fn residents_follow_the_legs_of_a_request() {
        let t0 = SystemClock.now();
        let mut b = Book::new(vec![Some(fixture()), Some(fixture())], 0.1, &reactive());
        b.arrive(1, "r1", t0);
        b.sized(1, 1000, 50);
        b.dispatched(1, 0, Phase::Prefill, t0);
        assert_eq!(b.load(0).prefill, 1);
        assert!((b.load(0).prefill_s - 1.01).abs() < 1e-9);
        assert_eq!(b.pending_decode(), (1, 1000.0));
        b.dispatched(1, 1, Phase::Decode, t0 + ms(100));
        b.first_token(1, t0 + ms(300));
        assert_eq!(b.load(0), Load::default(), "the prefill resident left");
        assert_eq!(b.load(1).decode, 1);
        b.tokens(1, 1, t0 + ms(300));
        b.tokens(1, 3, t0 + ms(500));
        assert_eq!(b.load(1).decode_tokens, 1003.0);
        b.rollover(t0 + ms(520), 1.0);
        assert!((b.handoff_s(1) - 0.2).abs() < 1e-9);
        // Two gaps of 0.1 s, the TPOT budget, whatever the floor: load 1.
        assert!((b.decode_load(1, t0 + ms(520)) - 1.0).abs() < 1e-6);
        // With no gap yet in the new interval, the open gap counts once it is longer.
        let later = b.decode_load(1, t0 + ms(1000));
        assert!(later > 5.0, "{later}");
        let done = b.finished(1, t0 + ms(1100)).expect("tracked");
        assert_eq!(done.delivered, 3);
        assert_eq!(b.load(1), Load::default());
    }

    /// Two requests of the same prompt length are priced by what their engines compute
    /// (controller.md 3.5): one placed where its whole prompt but the last block is cached
    /// costs the profile price of those uncached tokens, the other its whole prompt; the
    /// resident prefill seconds and the prefill load fall accordingly.
    #[test]
    fn a_cached_prefix_is_priced_at_its_uncached_tokens() {
        let t0 = SystemClock.now();
        let mut b = Book::new(vec![Some(fixture()), Some(fixture())], 0.1, &reactive());
        for id in [1, 2] {
            b.arrive(id, &format!("r{id}"), t0);
            b.sized(id, 1000, 50);
        }
        // r1: 992 of its 1000 tokens cached on e0 (vLLM computes at least the last block).
        b.placed(1, 0, Some(992));
        b.dispatched(1, 0, Phase::Prefill, t0);
        // r2: placed on e1 with nothing cached there.
        b.placed(2, 1, Some(0));
        b.dispatched(2, 1, Phase::Prefill, t0);
        let (cached, cold) = (b.load(0).prefill_s, b.load(1).prefill_s);
        assert!(
            (cached - fixture().prefill_time(8)).abs() < 1e-9,
            "{cached}"
        );
        assert!((cached - 0.018).abs() < 1e-9, "{cached}");
        assert!((cold - 1.01).abs() < 1e-9, "{cold}");
        assert!((b.prefill_load(0, 2.0) - 0.009).abs() < 1e-9);
        assert!((b.prefill_load(1, 2.0) - 0.505).abs() < 1e-9);
        // The decode still holds the whole prompt: its size is the prompt length.
        assert_eq!(b.pending_decode(), (2, 2000.0));
        b.dispatched(1, 1, Phase::Decode, t0);
        assert_eq!(b.load(1).decode_tokens, 1000.0);
        // The time average published at rollover follows the uncached price too.
        b.rollover(t0 + ms(1000), 1.0);
        assert!((b.prefill_load(0, 2.0) - 0.009).abs() < 1e-6);
        // A credit names its engine: a retry dispatched elsewhere computes the whole prompt,
        // and a credit larger than the sized prompt (a character estimate) prices 0 tokens.
        b.attempt_ended(1, t0 + ms(1000));
        b.dispatched(1, 1, Phase::Prefill, t0 + ms(1000));
        assert!((b.load(1).prefill_s - 2.02).abs() < 1e-9);
        assert_eq!(b.req(1).map(|r| r.uncached_on(0)), Some(8));
        b.placed(1, 0, Some(5000));
        assert_eq!(b.req(1).map(|r| r.uncached_on(0)), Some(0));
        b.placed(1, 0, None);
        assert_eq!(b.req(1).map(|r| r.uncached_on(0)), Some(1000));
    }

    /// The correction moves toward the mean measured/profiled ratio once enough unmixed
    /// samples arrived (controller.md 3.1).
    #[test]
    fn corrections_learn_from_unmixed_intervals() {
        let t0 = SystemClock.now();
        let mut b = Book::new(vec![Some(fixture())], 0.1, &reactive());
        b.arrive(1, "r1", t0);
        b.sized(1, 0, 10);
        b.dispatched(1, 0, Phase::Decode, t0);
        b.first_token(1, t0);
        b.tokens(1, 1, t0);
        // Profile interval at 1 token, 1 request: ~0.01 s; measured 0.02 s → ratio ~2.
        b.tokens(1, 2, t0 + ms(20));
        b.tokens(1, 3, t0 + ms(40));
        b.rollover(t0 + ms(50), 1.0);
        assert!((b.correction(0) - 1.2).abs() < 0.01, "{}", b.correction(0));
    }

    #[test]
    fn the_waiting_list_is_fifo_by_arrival() {
        let t0 = SystemClock.now();
        let mut b = Book::new(vec![Some(fixture())], 0.1, &reactive());
        for (id, dt) in [(2, 5), (1, 1)] {
            b.arrive(id, &format!("r{id}"), t0 + ms(dt));
            b.sized(id, 100, 0);
            b.wait(id);
        }
        let w: Vec<String> = b.waiting().into_iter().map(|w| w.rid).collect();
        assert_eq!(w, ["r1", "r2"]);
        b.unwait(1);
        assert_eq!(b.waiting().len(), 1);
    }

    /// The per-engine aggregates stay equal to a recount of the requests through any order
    /// of legs, retries and endings (they are kept incrementally for the per-token path).
    #[test]
    fn aggregates_match_a_recount_through_any_sequence() {
        use rand::{Rng, SeedableRng};
        let t0 = SystemClock.now();
        let mut b = Book::new(vec![Some(fixture()); 3], 0.1, &reactive());
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut live: Vec<u64> = Vec::new();
        for step in 0..3000u64 {
            let now = t0 + ms(step);
            match rng.random_range(0..7) {
                0 => {
                    b.arrive(step, "r", now);
                    b.sized(step, rng.random_range(1..4000), 16);
                    live.push(step);
                }
                k if !live.is_empty() => {
                    let id = live[rng.random_range(0..live.len())];
                    let e = rng.random_range(0..3);
                    match k {
                        1 => {
                            let cached = rng.random_range(0..5000);
                            b.placed(id, e, rng.random_bool(0.7).then_some(cached));
                            b.dispatched(id, e, Phase::Prefill, now);
                        }
                        2 => b.dispatched(id, e, Phase::Decode, now),
                        3 => b.first_token(id, now),
                        4 => {
                            let d = b.req(id).map_or(0, |r| r.delivered);
                            b.tokens(id, d + rng.random_range(1..5), now);
                        }
                        5 => b.attempt_ended(id, now),
                        _ => {
                            b.finished(id, now);
                            live.retain(|x| *x != id);
                        }
                    }
                }
                _ => {}
            }
            for e in 0..3 {
                let mut want = Load::default();
                for r in b.reqs.values() {
                    if r.prefill_on == Some(e) {
                        want.prefill += 1;
                        want.prefill_s += fixture().prefill_time(r.uncached_on(e));
                    }
                    if r.decode_on == Some(e) {
                        want.decode += 1;
                        want.decode_tokens += (r.input + r.delivered) as f64;
                        want.streaming += u32::from(r.last_token.is_some());
                    }
                }
                let got = b.load(e);
                assert_eq!(
                    (got.prefill, got.decode, got.streaming),
                    (want.prefill, want.decode, want.streaming),
                    "step {step}"
                );
                assert!((got.prefill_s - want.prefill_s).abs() < 1e-6, "step {step}");
                assert!(
                    (got.decode_tokens - want.decode_tokens).abs() < 1e-6,
                    "step {step}"
                );
            }
        }
    }
}
