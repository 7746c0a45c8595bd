//! The `serving` and `recovery` sections: admission, limits and timeouts on the request
//! path, and the state file and readmission policy.

use serde_json::Value;

use super::{Checker, non_negative, positive};
use crate::config::{AdmissionMode, PlacementLoad, Recovery, RestartPolicy, Serving};

impl Checker<'_> {
    pub(super) fn serving(&mut self, v: Option<&Value>) -> Serving {
        let o = self.obj(
            "serving",
            v,
            &[
                "admission",
                "admission_margin",
                "max_connections",
                "request_timeout_s",
                "prefill_timeout_s",
                "graceful_timeout_s",
                "queue_capacity",
                "queue_timeout_s",
                "max_attempts",
                "retry_base_s",
                "retry_cap_s",
                "retry_budget",
                "retry_replenish",
                "max_request_bytes",
                "max_response_bytes",
                "body_read_timeout_s",
                "max_batch_prompts",
                "kv_balance_abs_threshold",
                "kv_balance_rel_threshold",
                "kv_events_stale_s",
                "kv_aware_placement",
                "kv_approx_ttl_s",
                "kv_pending_s",
                "kv_approx_block_size",
                "kv_approx_credit",
                "kv_ready_timeout_s",
                "placement_load",
                "engine_load_poll_s",
            ],
        );
        let admission = match self.choice(&o, "admission", "open", &["predictive", "open"]) {
            "predictive" => AdmissionMode::Predictive,
            _ => AdmissionMode::Open,
        };
        let s = Serving {
            admission,
            admission_margin: self.num(&o, "admission_margin", 0.0, non_negative),
            max_connections: self.int(&o, "max_connections", 768, 1, u64::MAX),
            request_timeout_s: self.num(&o, "request_timeout_s", 600.0, positive),
            prefill_timeout_s: self.num(&o, "prefill_timeout_s", 120.0, positive),
            graceful_timeout_s: self.int(&o, "graceful_timeout_s", 30, 0, u64::MAX),
            queue_capacity: self.int(&o, "queue_capacity", 0, 0, u64::MAX),
            queue_timeout_s: self.num(&o, "queue_timeout_s", 0.0, non_negative),
            max_attempts: self.int(&o, "max_attempts", 2, 1, 3) as u32,
            retry_base_s: self.num(&o, "retry_base_s", 0.1, positive),
            retry_cap_s: self.num(&o, "retry_cap_s", 1.0, positive),
            retry_budget: self.int(&o, "retry_budget", 10, 0, u64::MAX),
            retry_replenish: self.num(&o, "retry_replenish", 0.1, |x| {
                (!(0.0..=1.0).contains(&x)).then_some("must be in [0, 1]")
            }),
            max_request_bytes: self.int(&o, "max_request_bytes", 4_194_304, 1, u64::MAX),
            max_response_bytes: self.int(&o, "max_response_bytes", 16_777_216, 1, u64::MAX),
            body_read_timeout_s: self.num(&o, "body_read_timeout_s", 30.0, positive),
            max_batch_prompts: self.int(&o, "max_batch_prompts", 64, 1, 4096) as usize,
            kv_balance_abs_threshold: self.int(&o, "kv_balance_abs_threshold", 1000, 0, u64::MAX),
            kv_balance_rel_threshold: self.num(&o, "kv_balance_rel_threshold", 1.5, |x| {
                (x < 1.0).then_some("must be ≥ 1")
            }),
            kv_events_stale_s: self.num(&o, "kv_events_stale_s", 5.0, positive),
            kv_aware_placement: self.boolean(&o, "kv_aware_placement", true),
            kv_approx_ttl_s: self.num(&o, "kv_approx_ttl_s", 120.0, positive),
            kv_pending_s: self.num(&o, "kv_pending_s", 10.0, positive),
            kv_approx_block_size: self.int(&o, "kv_approx_block_size", 16, 1, 65_536) as u32,
            kv_approx_credit: self.num(&o, "kv_approx_credit", 1.0, |x| {
                (!(x > 0.0 && x <= 1.0)).then_some("must be in (0, 1]")
            }),
            kv_ready_timeout_s: self.num(&o, "kv_ready_timeout_s", 5.0, non_negative),
            engine_load_poll_s: self.num(&o, "engine_load_poll_s", 0.0, |x| {
                (x != 0.0 && !(0.05..=60.0).contains(&x))
                    .then_some("must be 0 (off) or in [0.05, 60]")
            }),
            placement_load: match self.choice(
                &o,
                "placement_load",
                "requests",
                &["requests", "tokens"],
            ) {
                "tokens" => PlacementLoad::Tokens,
                _ => PlacementLoad::Requests,
            },
        };
        if s.prefill_timeout_s > s.request_timeout_s {
            self.rule(
                "serving.prefill_timeout_s".into(),
                &Value::from(s.prefill_timeout_s),
                format!(
                    "must be ≤ serving.request_timeout_s ({})",
                    s.request_timeout_s
                ),
            );
        }
        if s.queue_capacity > 0 && s.queue_timeout_s <= 0.0 {
            self.rule(
                "serving.queue_timeout_s".into(),
                &Value::from(s.queue_timeout_s),
                "must be > 0 when serving.queue_capacity > 0",
            );
        }
        if s.retry_cap_s < s.retry_base_s {
            self.rule(
                "serving.retry_cap_s".into(),
                &Value::from(s.retry_cap_s),
                format!("must be ≥ serving.retry_base_s ({})", s.retry_base_s),
            );
        }
        s
    }

    pub(super) fn recovery(&mut self, v: Option<&Value>) -> Recovery {
        let o = self.obj(
            "recovery",
            v,
            &[
                "eject_after",
                "readmit_every",
                "liveness_every",
                "liveness_misses",
                "engine_restart_policy",
                "failure_quarantine_s",
                "state_path",
                "resume",
                "health",
                "max_readmit_interval_s",
                "max_ejection_percent",
            ],
        );
        let policy = match self.choice(
            &o,
            "engine_restart_policy",
            "individual",
            &["individual", "whole_wave"],
        ) {
            "whole_wave" => RestartPolicy::WholeWave,
            _ => RestartPolicy::Individual,
        };
        let r = Recovery {
            eject_after: self.int(&o, "eject_after", 3, 1, u32::MAX as u64) as u32,
            readmit_every: self.int(&o, "readmit_every", 10, 1, u32::MAX as u64) as u32,
            liveness_every: self.int(&o, "liveness_every", 10, 0, u32::MAX as u64) as u32,
            liveness_misses: self.int(&o, "liveness_misses", 2, 1, u32::MAX as u64) as u32,
            engine_restart_policy: policy,
            failure_quarantine_s: self.num(&o, "failure_quarantine_s", 0.0, non_negative),
            state_path: self.string(&o, "state_path", "runs/state.json"),
            resume: self.boolean(&o, "resume", false),
            max_readmit_interval_s: self.num(&o, "max_readmit_interval_s", 300.0, positive),
            max_ejection_percent: self.int(&o, "max_ejection_percent", 50, 1, 100) as u32,
        };
        if policy == RestartPolicy::WholeWave && r.liveness_every == 0 {
            self.rule(
                "recovery.liveness_every".into(),
                &Value::from(0),
                "must be > 0 for whole_wave",
            );
        }
        let h = self.obj(
            "recovery.health",
            o.get("health"),
            &[
                "window_s",
                "drift_band",
                "min_samples",
                "probation_windows",
                "evict_windows",
                "recovery_windows",
                "probation_penalty_s",
                "relative_band",
            ],
        );
        self.num(&h, "window_s", 30.0, positive);
        self.num(&h, "drift_band", 2.0, |x| {
            (x <= 1.0).then_some("must be > 1")
        });
        self.int(&h, "min_samples", 3, 1, u64::MAX);
        let prob = self.int(&h, "probation_windows", 3, 1, u64::MAX);
        let evict = self.int(&h, "evict_windows", 5, 1, u64::MAX);
        if evict < prob {
            self.rule(
                h.p("evict_windows"),
                &Value::from(evict),
                format!("must be ≥ probation_windows ({prob})"),
            );
        }
        self.int(&h, "recovery_windows", 3, 1, u64::MAX);
        self.num(&h, "probation_penalty_s", 1.5, non_negative);
        self.num(&h, "relative_band", 1.5, positive);
        r
    }
}
