//! Engine profiles: the measured cost curves every controller and admission price goes through
//! (controller.md 3.4; the shape the reference's profiler writes, one per engine).
//!
//! ```text
//!  fleet file profiles.default / profiles.engines.<iid> ──config──► Profile
//!  Profile ──prefill_time(L)──────────────► seconds for one prefill of L prompt tokens
//!          ──token_interval(T, R)─────────► seconds per decode step with T resident tokens, R requests
//!          ──max_tokens(tpot, R)──────────► resident tokens one engine holds within a TPOT budget
//!          ──decode_rps(tpot, ctx, out, c)─► requests/second one engine decodes within the budget
//! ```
//!
//! Pure functions of the profile's fields; units are seconds and tokens. `narwhalctl profile`
//! measures these fields against a running engine.

use serde::{Deserialize, Serialize};

/// One engine's profile (controller.md 3.4, section 14's fixture uses every field).
///
/// Prefill: `prefill_time(L) = max(0, ttft_a·x² + ttft_b·x + ttft_c + ttft_split)` with
/// `x = max(L, prefill_min_tokens)`. Decode: `token_interval(T, R) = max(0, tpot_slope·T +
/// tpot_request_slope·R + tpot_intercept)`, valid for `decode_min_requests ≤ R ≤
/// decode_max_requests` and `T ≤ decode_max_kv_tokens`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Quadratic prefill coefficient, seconds per token².
    pub ttft_a: f64,
    /// Linear prefill coefficient, seconds per token.
    pub ttft_b: f64,
    /// Fixed prefill cost, seconds.
    pub ttft_c: f64,
    /// Shortest prompt the prefill fit is priced at (shorter prompts cost this much), tokens.
    pub prefill_min_tokens: u64,
    /// Extra fixed cost of a disaggregated prefill (descriptor or rendezvous), seconds.
    pub ttft_split: f64,
    /// Decode step cost per resident KV token, seconds.
    pub tpot_slope: f64,
    /// Decode step cost per resident request, seconds.
    pub tpot_request_slope: f64,
    /// Fixed decode step cost, seconds.
    pub tpot_intercept: f64,
    /// Smallest measured decode batch, requests.
    pub decode_min_requests: u64,
    /// Largest measured decode batch (the engine's sequence limit), requests.
    pub decode_max_requests: u64,
    /// Fewest resident tokens measured, tokens.
    pub decode_min_kv_tokens: u64,
    /// Most resident tokens measured, tokens.
    pub decode_max_kv_tokens: u64,
    /// The engine's KV cache capacity, tokens (`None` = unknown).
    pub kv_capacity_tokens: Option<u64>,
}

impl Profile {
    /// Seconds to prefill a prompt of `tokens` tokens.
    pub fn prefill_time(&self, tokens: u64) -> f64 {
        let x = tokens.max(self.prefill_min_tokens) as f64;
        (self.ttft_a * x * x + self.ttft_b * x + self.ttft_c + self.ttft_split).max(0.0)
    }

    /// Seconds per decode step with `tokens` resident KV tokens over `requests` requests.
    pub fn token_interval(&self, tokens: f64, requests: f64) -> f64 {
        (self.tpot_slope * tokens + self.tpot_request_slope * requests + self.tpot_intercept)
            .max(0.0)
    }

    /// The decode step cost with nothing resident (the floor every load ratio is measured
    /// above), seconds.
    pub fn floor_interval(&self) -> f64 {
        self.token_interval(0.0, 0.0)
    }

    /// Resident tokens one engine can hold with `requests` requests and still step within
    /// `tpot` seconds: 0 when `requests` exceeds the measured batch or the fixed cost alone
    /// breaks `tpot`; capped at `decode_max_kv_tokens` (controller.md 3.4).
    pub fn max_tokens(&self, tpot: f64, requests: f64) -> f64 {
        if requests > self.decode_max_requests as f64 {
            return 0.0;
        }
        let fixed = self.tpot_intercept + self.tpot_request_slope * requests;
        if fixed > tpot {
            return 0.0;
        }
        let cap = self.decode_max_kv_tokens as f64;
        if self.tpot_slope <= 0.0 {
            return cap;
        }
        ((tpot - fixed) / self.tpot_slope).min(cap)
    }

    /// `min(kv_capacity_tokens, decode_max_kv_tokens)`, tokens.
    pub fn decode_token_limit(&self) -> u64 {
        match self.kv_capacity_tokens {
            Some(kv) => kv.min(self.decode_max_kv_tokens),
            None => self.decode_max_kv_tokens,
        }
    }

    /// Requests of `ctx` tokens each one engine can hold: the batch limit, and the token
    /// limit over `ctx`.
    pub fn decode_request_limit(&self, ctx: f64) -> u64 {
        let by_tokens = if ctx > 0.0 {
            (self.decode_token_limit() as f64 / ctx).floor() as u64
        } else {
            self.decode_max_requests
        };
        self.decode_max_requests.min(by_tokens)
    }

    /// Whether the decode fit was measured for a batch of `requests` requests holding
    /// `tokens` tokens in all (at most the measured batch and token range; a batch below the
    /// smallest measured one is priced at it).
    pub fn covers_decode(&self, tokens: f64, requests: f64) -> bool {
        requests <= self.decode_max_requests as f64 && tokens <= self.decode_max_kv_tokens as f64
    }

    /// Requests per second one engine decodes within `tpot` when each holds `ctx` tokens on
    /// average and produces `out` tokens, with the fleet's decode correction `corr`: the
    /// largest batch `B ≤ decode_request_limit(ctx)` with `token_interval(B·ctx, B)·corr ≤
    /// tpot` gives `B / (out·interval·corr)`; 0 when nothing fits or the shape is outside the
    /// measured range (controller.md 3.4).
    pub fn decode_rps(&self, tpot: f64, ctx: f64, out: f64, corr: f64) -> f64 {
        if out <= 0.0 || ctx <= 0.0 || !self.covers_decode(ctx, 1.0) {
            return 0.0;
        }
        let corr = if corr > 0.0 { corr } else { 1.0 };
        let limit = self.decode_request_limit(ctx);
        if limit == 0 {
            return 0.0;
        }
        let per_request = self.tpot_slope * ctx + self.tpot_request_slope;
        let budget = tpot / corr - self.tpot_intercept;
        if budget < per_request {
            return 0.0;
        }
        let b = if per_request <= 0.0 {
            limit
        } else {
            ((budget / per_request + 1e-9).floor() as u64).min(limit)
        };
        if b == 0 {
            return 0.0;
        }
        let interval = self.token_interval(b as f64 * ctx, b as f64) * corr;
        if interval <= 0.0 {
            return 0.0;
        }
        b as f64 / (out * interval)
    }
}

/// The fixture of controller.md section 14.
#[cfg(test)]
pub(crate) fn fixture() -> Profile {
    Profile {
        ttft_a: 0.0,
        ttft_b: 0.001,
        ttft_c: 0.01,
        prefill_min_tokens: 0,
        ttft_split: 0.0,
        tpot_slope: 1e-6,
        tpot_request_slope: 0.0,
        tpot_intercept: 0.01,
        decode_min_requests: 1,
        decode_max_requests: 64,
        decode_min_kv_tokens: 16,
        decode_max_kv_tokens: 200_000,
        kv_capacity_tokens: Some(200_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_of_1000_tokens_costs_about_a_second() {
        let p = fixture();
        assert!((p.prefill_time(1000) - 1.01).abs() < 1e-12);
        assert!((p.prefill_time(500) - 0.51).abs() < 1e-12);
        let floored = Profile {
            prefill_min_tokens: 100,
            ..fixture()
        };
        assert_eq!(floored.prefill_time(10), floored.prefill_time(100));
    }

    /// S1's decode side: 525-token contexts, 50 outputs: the batch limit (64) binds, giving
    /// about 29.4 requests per second per engine.
    #[test]
    fn decode_rps_takes_the_largest_batch_within_tpot() {
        let p = fixture();
        let rps = p.decode_rps(0.1, 525.0, 50.0, 1.0);
        let interval = 1e-6 * 64.0 * 525.0 + 0.01;
        assert!((rps - 64.0 / (50.0 * interval)).abs() < 1e-9, "{rps}");
        // S2's long outputs: 2100-token contexts fit 42 per engine within 0.1 s.
        let rps = p.decode_rps(0.1, 2100.0, 4000.0, 1.0);
        let interval = 1e-6 * 42.0 * 2100.0 + 0.01;
        assert!((rps - 42.0 / (4000.0 * interval)).abs() < 1e-12, "{rps}");
        // Outside the measured range or without outputs: nothing.
        assert_eq!(p.decode_rps(0.1, 300_000.0, 10.0, 1.0), 0.0);
        assert_eq!(p.decode_rps(0.1, 100.0, 0.0, 1.0), 0.0);
        // A correction above 1 shrinks the batch.
        assert!(p.decode_rps(0.1, 2100.0, 4000.0, 2.0) < rps);
    }

    #[test]
    fn max_tokens_is_bounded_by_the_batch_and_the_kv_range() {
        let p = fixture();
        assert!((p.max_tokens(0.1, 1.0) - 90_000.0).abs() < 1e-6);
        assert_eq!(p.max_tokens(0.1, 65.0), 0.0, "beyond the measured batch");
        assert_eq!(
            p.max_tokens(0.005, 1.0),
            0.0,
            "the fixed cost alone breaks tpot"
        );
        assert_eq!(
            p.max_tokens(1.0, 1.0),
            200_000.0,
            "capped at the measured range"
        );
        assert_eq!(p.decode_token_limit(), 200_000);
        assert_eq!(p.decode_request_limit(5000.0), 40);
    }
}
