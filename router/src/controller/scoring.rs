//! Pricing a split (controller.md 4.2–4.4): a [`Snapshot`] of the live fleet's loads and
//! the demand, scored for a candidate number of prefill engines; and the FIFO prefill
//! projection behind the urgent path.
//!
//! ```text
//!  Snapshot { P, D, pressures, resident work, demand, profiles } ──score(p, demand)──► Score
//!  project(waiting, engine loads, profile) ──► worst (or focus) projected TTFT
//! ```
//!
//! Pure. A ratio of 1.0 is exactly at the SLO; work is in engine equivalents.

use crate::profile::Profile;

/// The live fleet and its load, captured once per evaluation (controller.md 4.2).
#[derive(Debug, Clone)]
pub(crate) struct Snapshot {
    /// Live engines.
    pub(crate) n: usize,
    /// Live prefill-role engines (P).
    pub(crate) prefill: usize,
    /// Live decode-role engines (D).
    pub(crate) decode: usize,
    /// Every live engine has a profile.
    pub(crate) profiles_complete: bool,
    /// The live engines' profiles.
    pub(crate) profiles: Vec<Profile>,
    /// Prefill pool load.
    pub(crate) prefill_pressure: f64,
    /// Decode pool load.
    pub(crate) decode_pressure: f64,
    /// Resident prefill seconds on live engines plus queued prefill work, seconds.
    pub(crate) resident_prefill_s: f64,
    /// Prefill seconds of the requests waiting for a seat, seconds.
    pub(crate) queued_prefill_s: f64,
    /// Resident decode tokens on live engines.
    pub(crate) decode_tokens: f64,
    /// Resident decode requests on live engines.
    pub(crate) decode_requests: f64,
    /// Live engines with decode residents.
    pub(crate) active_decode: usize,
    /// Requests still to reach a decode engine (in prefill or waiting) and their tokens.
    pub(crate) pending_decode: (u64, f64),
    /// Mean handoff delay over decode engines, seconds.
    pub(crate) handoff_s: f64,
    /// The fleet's decode correction.
    pub(crate) correction: f64,
    /// `slo.ttft_s`.
    pub(crate) ttft_s: f64,
    /// `slo.tpot_s`.
    pub(crate) tpot_s: f64,
    /// `reactive.utilization`.
    pub(crate) utilization: f64,
}

/// One priced split (controller.md 4.3). Ratios are ∞ when the split has no engine of a
/// role; `objective` is the largest.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Score {
    /// Prefill engines of the split.
    pub(crate) p: usize,
    /// Decode engines of the split.
    pub(crate) d: usize,
    /// Projected TTFT pressure.
    pub(crate) ttft: f64,
    /// Projected TPOT pressure.
    pub(crate) tpot: f64,
    /// Projected handoff-queue pressure.
    pub(crate) decode_queue: f64,
    /// `max(ttft, tpot, decode_queue)`.
    pub(crate) objective: f64,
    /// Prefill work priced, engines.
    pub(crate) prefill_work: f64,
    /// Decode work priced, engines.
    pub(crate) decode_work: f64,
    /// Resident decode tokens per decode engine.
    pub(crate) tokens_per_engine: f64,
    /// Resident decode requests per decode engine (at least 1).
    pub(crate) requests_per_engine: f64,
    /// Tokens one engine holds within TPOT at that batch (mean over profiles).
    pub(crate) slo_capacity: f64,
    /// KV capacity per engine (min over profiles), `None` when any is unknown.
    pub(crate) kv_capacity: Option<f64>,
    /// The smallest measured batch limit, requests.
    pub(crate) request_limit: Option<u64>,
    /// The profiles cover the projected decode work.
    pub(crate) covered: bool,
}

impl Score {
    /// `max(tpot, decode_queue)`: the decode side of the objective.
    pub(crate) fn decode_side(&self) -> f64 {
        self.tpot.max(self.decode_queue)
    }
}

fn mean(profiles: &[Profile], f: impl Fn(&Profile) -> f64) -> f64 {
    if profiles.is_empty() {
        return 0.0;
    }
    profiles.iter().map(f).sum::<f64>() / profiles.len() as f64
}

impl Snapshot {
    /// `max(prefill_pressure, resident_prefill_s/(P·ttft))` when something is queued and
    /// P > 0, else the prefill pressure (controller.md 4.2).
    pub(crate) fn prefill_recovery_ratio(&self) -> f64 {
        if self.queued_prefill_s > 0.0 && self.prefill > 0 {
            self.prefill_pressure
                .max(self.resident_prefill_s / (self.prefill as f64 * self.ttft_s))
        } else {
            self.prefill_pressure
        }
    }

    /// Scores the split with `p` prefill engines against `prefill_work` and `decode_work`
    /// (engines of demand; the envelope for p > P) (controller.md 4.3).
    pub(crate) fn score(&self, p: usize, prefill_work: f64, decode_work: f64) -> Score {
        let d = self.n.saturating_sub(p);
        let u = self.utilization;
        let inf = f64::INFINITY;
        let spread = d.max(if self.active_decode > 0 {
            self.active_decode
        } else {
            self.decode
        });
        let spread = spread.max(1) as f64;
        let tokens_per_engine = (self.decode_tokens / spread).ceil();
        let requests_per_engine = (self.decode_requests / spread).max(1.0);
        let corr = self.correction;
        let slo_capacity = mean(&self.profiles, |pr| {
            pr.max_tokens(self.tpot_s / corr, requests_per_engine)
        });
        let kv_capacity = self
            .profiles
            .iter()
            .map(|pr| {
                pr.kv_capacity_tokens
                    .map(|kv| kv.min(pr.decode_max_kv_tokens) as f64)
            })
            .try_fold(f64::INFINITY, |m, kv| kv.map(|kv| m.min(kv)))
            .filter(|kv| kv.is_finite());
        let request_limit = self.profiles.iter().map(|pr| pr.decode_max_requests).min();
        let covered = !self.profiles.is_empty()
            && self
                .profiles
                .iter()
                .all(|pr| pr.covers_decode(tokens_per_engine, requests_per_engine));
        let (ttft, tpot, decode_queue) = if p == 0 || d == 0 {
            (inf, inf, inf)
        } else {
            let (pf, df) = (p as f64, d as f64);
            let ttft = (prefill_work / (pf * u))
                .max(self.prefill_pressure * self.prefill as f64 / pf)
                .max(self.resident_prefill_s / (pf * self.ttft_s));
            let tpot = if covered {
                let ival = mean(&self.profiles, |pr| {
                    pr.token_interval(tokens_per_engine, requests_per_engine)
                }) * corr;
                let floor = mean(&self.profiles, Profile::floor_interval) * corr;
                let latency = if floor >= self.tpot_s {
                    ival / self.tpot_s
                } else {
                    (ival - floor).max(0.0) / (self.tpot_s - floor)
                };
                (decode_work / (df * u))
                    .max(self.decode_pressure * self.decode as f64 / df)
                    .max(latency)
            } else {
                inf
            };
            let queue = self.handoff_s * self.decode as f64 / self.ttft_s / df;
            (ttft, tpot, queue)
        };
        Score {
            p,
            d,
            ttft,
            tpot,
            decode_queue,
            objective: ttft.max(tpot).max(decode_queue),
            prefill_work,
            decode_work,
            tokens_per_engine,
            requests_per_engine,
            slo_capacity,
            kv_capacity,
            request_limit,
            covered,
        }
    }
}

/// The FIFO prefill projection (controller.md 4.4): every engine starts at its resident
/// prefill seconds; waiting requests, in arrival order, go to the engine that finishes them
/// first. Returns each waiting request's projected TTFT (`waited + completion`), in the order
/// given; empty when there is no engine.
pub(crate) fn project(engine_loads: &[f64], waiting: &[(f64, f64)]) -> Vec<f64> {
    if engine_loads.is_empty() {
        return Vec::new();
    }
    let mut loads = engine_loads.to_vec();
    waiting
        .iter()
        .map(|(waited, price)| {
            let (i, _) = loads
                .iter()
                .enumerate()
                .min_by(|a, b| (a.1 + price).total_cmp(&(b.1 + price)))
                .expect("non-empty");
            loads[i] += price;
            waited + loads[i]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::fixture;

    /// S1's fixture at 1P3D: 2 req/s of 500-token prompts.
    fn s1() -> Snapshot {
        Snapshot {
            n: 4,
            prefill: 1,
            decode: 3,
            profiles_complete: true,
            profiles: vec![fixture(); 4],
            prefill_pressure: 0.0,
            decode_pressure: 0.0,
            resident_prefill_s: 0.0,
            queued_prefill_s: 0.0,
            decode_tokens: 0.0,
            decode_requests: 0.0,
            active_decode: 0,
            pending_decode: (0, 0.0),
            handoff_s: 0.0,
            correction: 1.0,
            ttft_s: 2.0,
            tpot_s: 0.1,
            utilization: 0.8,
        }
    }

    /// controller.md S1: candidate objective 0.6375 against the current 1.275.
    #[test]
    fn s1_scores_the_current_split_and_its_neighbour() {
        let s = s1();
        let decode = 2.0 / fixture().decode_rps(0.1, 525.0, 50.0, 1.0);
        let cur = s.score(1, 1.02, decode);
        assert!((cur.objective - 1.275).abs() < 1e-9, "{cur:?}");
        let cand = s.score(2, 1.02, decode);
        assert!((cand.objective - 0.6375).abs() < 1e-9, "{cand:?}");
        assert!(cand.tpot < 0.5 && cand.covered);
        assert_eq!(cand.kv_capacity, Some(200_000.0));
        let none = s.score(4, 1.02, decode);
        assert!(none.objective.is_infinite(), "no decode engine");
    }

    #[test]
    fn pressures_and_queued_work_raise_the_ttft_ratio() {
        let mut s = s1();
        s.resident_prefill_s = 7.07;
        s.queued_prefill_s = 2.02;
        assert!((s.prefill_recovery_ratio() - 3.535).abs() < 1e-9);
        assert!((s.score(2, 0.0, 0.0).ttft - 7.07 / 4.0).abs() < 1e-9);
        s.handoff_s = 0.5;
        let sc = s.score(1, 0.0, 0.0);
        assert!((sc.decode_queue - 0.5 * 3.0 / 2.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn a_resident_batch_beyond_the_profile_makes_tpot_infinite() {
        let mut s = s1();
        s.decode_tokens = 3.0 * 250_000.0;
        s.decode_requests = 3.0;
        s.active_decode = 3;
        let sc = s.score(1, 0.0, 0.0);
        assert!(!sc.covered && sc.tpot.is_infinite());
    }

    /// S11: six 1000-token prompts queue behind one prefill engine: the sixth projects
    /// about 6.06 s; with a donor, about 3.03 s.
    #[test]
    fn the_fifo_projection_spreads_waiting_requests() {
        let w: Vec<(f64, f64)> = (0..6).map(|_| (0.0, 1.01)).collect();
        let one = project(&[0.0], &w);
        assert!((one[5] - 6.06).abs() < 1e-9);
        let two = project(&[0.0, 0.0], &w);
        assert!((two[5] - 3.03).abs() < 1e-9);
        assert!(project(&[], &w).is_empty());
    }
}
