//! The `controller` section and the engine profiles it prices with (`profiles`,
//! `engines[].profile`).

use serde_json::Value;

use super::{Checker, Kind, non_negative, positive};
use crate::config::{ConfigIssue, Controller, Profile, Reactive, Thresholds};

impl Checker<'_> {
    pub(super) fn controller(&mut self, v: Option<&Value>, _engines: usize) -> Controller {
        let o = self.obj(
            "controller",
            v,
            &[
                "monitor_interval_s",
                "monitor_failure_limit",
                "advisory",
                "min_prefill",
                "min_decode",
                "flip_history",
                "thresholds",
                "reactive",
            ],
        );
        let monitor_interval_s = self.num(&o, "monitor_interval_s", 1.0, positive);
        let monitor_failure_limit =
            self.int(&o, "monitor_failure_limit", 5, 1, u32::MAX as u64) as u32;
        let advisory = self.boolean(&o, "advisory", false);
        let min_prefill = self.int(&o, "min_prefill", 1, 1, u32::MAX as u64) as u32;
        let min_decode = self.int(&o, "min_decode", 1, 1, u32::MAX as u64) as u32;
        let flip_history = self.int(&o, "flip_history", 1000, 1, u64::MAX);
        let th = self.obj(
            "controller.thresholds",
            o.get("thresholds"),
            &[
                "expand",
                "shrink",
                "cooldown_s",
                "sustained_intervals",
                "dwell_s",
                "panic_ratio",
                "flip_resident_guard",
            ],
        );
        let expand = self.num(&th, "expand", 1.0, positive);
        let shrink = self.num(&th, "shrink", 0.5, non_negative);
        if shrink >= expand {
            self.rule(
                th.p("shrink"),
                &Value::from(shrink),
                format!("must be < thresholds.expand ({expand})"),
            );
        }
        let thresholds = Thresholds {
            expand,
            shrink,
            cooldown_s: self.num(&th, "cooldown_s", 10.0, non_negative),
            sustained_intervals: self.int(&th, "sustained_intervals", 3, 1, u64::MAX),
            dwell_s: self.num(&th, "dwell_s", 0.0, non_negative),
            panic_ratio: self.num(&th, "panic_ratio", 0.0, |x| {
                (x != 0.0 && x < 1.0).then_some("must be 0 or ≥ 1")
            }),
            flip_resident_guard: self.int(&th, "flip_resident_guard", 0, 0, u64::MAX),
        };
        let re = self.obj(
            "controller.reactive",
            o.get("reactive"),
            &[
                "window_s",
                "evidence_span_s",
                "evidence_max_span_s",
                "evidence_min_arrivals",
                "demand_rise_tolerance",
                "confirmations",
                "utilization",
                "min_arrivals",
                "demand_floor",
                "movement_margin",
                "step_s",
                "decode_correction_min",
                "decode_correction_max",
                "decode_correction_alpha",
                "decode_correction_min_samples",
            ],
        );
        let window = self.num(&re, "window_s", 120.0, positive);
        let span = self.num(&re, "evidence_span_s", 60.0, positive);
        let max_span = self.num(&re, "evidence_max_span_s", 120.0, positive);
        if span > max_span {
            self.rule(
                re.p("evidence_span_s"),
                &Value::from(span),
                format!("must be ≤ evidence_max_span_s ({max_span})"),
            );
        }
        if max_span > window {
            self.rule(
                re.p("evidence_max_span_s"),
                &Value::from(max_span),
                format!("must be ≤ window_s ({window})"),
            );
        }
        let reactive = Reactive {
            window_s: window,
            evidence_span_s: span,
            evidence_max_span_s: max_span,
            evidence_min_arrivals: self.int(&re, "evidence_min_arrivals", 10, 0, u64::MAX),
            demand_rise_tolerance: self.num(&re, "demand_rise_tolerance", 0.25, non_negative),
            confirmations: self.int(&re, "confirmations", 2, 1, u64::MAX),
            utilization: self.num(&re, "utilization", 0.8, |x| {
                (x <= 0.0 || x > 1.0).then_some("must be in (0, 1]")
            }),
            min_arrivals: self.int(&re, "min_arrivals", 10, 0, u64::MAX),
            demand_floor: self.num(&re, "demand_floor", 0.5, non_negative),
            movement_margin: self.num(&re, "movement_margin", 0.05, |x| {
                (!(0.0..1.0).contains(&x)).then_some("must be in [0, 1)")
            }),
            step_s: self.num(&re, "step_s", 5.0, positive),
            decode_correction_min: self.num(&re, "decode_correction_min", 0.5, positive),
            decode_correction_max: self.num(&re, "decode_correction_max", 2.0, positive),
            decode_correction_alpha: self.num(&re, "decode_correction_alpha", 0.2, |x| {
                (x <= 0.0 || x > 1.0).then_some("must be in (0, 1]")
            }),
            decode_correction_min_samples: self.int(
                &re,
                "decode_correction_min_samples",
                8,
                1,
                u64::MAX,
            ),
        };
        if reactive.decode_correction_max < reactive.decode_correction_min {
            self.rule(
                re.p("decode_correction_max"),
                &Value::from(reactive.decode_correction_max),
                format!(
                    "must be ≥ decode_correction_min ({})",
                    reactive.decode_correction_min
                ),
            );
        }
        Controller {
            monitor_interval_s,
            monitor_failure_limit,
            advisory,
            min_prefill,
            min_decode,
            flip_history,
            thresholds,
            reactive,
        }
    }

    /// `profiles`: `default` (every engine without its own) and `engines.<iid>`, each the
    /// profile shape of [`Profile`]; `path` and the fit limits are accepted for reference
    /// files and unused. Returns `(default, per engine)`.
    pub(super) fn profiles(
        &mut self,
        v: Option<&Value>,
    ) -> (Option<Profile>, Vec<(String, Profile)>) {
        let o = self.obj(
            "profiles",
            v,
            &[
                "path",
                "max_decode_fit_mape",
                "max_decode_cv_mape",
                "default",
                "engines",
            ],
        );
        self.passive(
            &o,
            &[
                ("path", Kind::Str),
                ("max_decode_fit_mape", Kind::NonNegNum),
                ("max_decode_cv_mape", Kind::NonNegNum),
            ],
        );
        let default = o
            .get("default")
            .and_then(|d| self.profile(&o.p("default"), d));
        let mut engines = Vec::new();
        match o.get("engines") {
            None => {}
            Some(Value::Object(m)) => {
                for (iid, p) in m {
                    if iid.starts_with('_') {
                        continue;
                    }
                    if let Some(p) = self.profile(&format!("{}.{iid}", o.p("engines")), p) {
                        engines.push((iid.clone(), p));
                    }
                }
            }
            Some(other) => self.ty(o.p("engines"), other, "an object of iid → profile"),
        }
        (default, engines)
    }

    /// One profile object at `path` (controller.md 3.4).
    pub(super) fn profile(&mut self, path: &str, v: &Value) -> Option<Profile> {
        const KEYS: &[&str] = &[
            "ttft_a",
            "ttft_b",
            "ttft_c",
            "prefill_min_tokens",
            "ttft_split",
            "tpot_slope",
            "tpot_request_slope",
            "tpot_intercept",
            "decode_min_requests",
            "decode_max_requests",
            "decode_min_kv_tokens",
            "decode_max_kv_tokens",
            "kv_capacity_tokens",
        ];
        let o = self.obj(path, Some(v), KEYS);
        o.map?;
        let before = self.issues.len();
        for k in [
            "ttft_a",
            "ttft_b",
            "ttft_c",
            "tpot_slope",
            "tpot_intercept",
            "decode_max_requests",
            "decode_max_kv_tokens",
        ] {
            if o.get(k).is_none() {
                self.issues.push(ConfigIssue::Missing { path: o.p(k) });
            }
        }
        let p = Profile {
            ttft_a: self.num(&o, "ttft_a", 0.0, non_negative),
            ttft_b: self.num(&o, "ttft_b", 0.0, non_negative),
            ttft_c: self.num(&o, "ttft_c", 0.0, |x| {
                (!x.is_finite()).then_some("must be a finite number")
            }),
            prefill_min_tokens: self.int(&o, "prefill_min_tokens", 0, 0, u64::MAX),
            ttft_split: self.num(&o, "ttft_split", 0.0, non_negative),
            tpot_slope: self.num(&o, "tpot_slope", 0.0, non_negative),
            tpot_request_slope: self.num(&o, "tpot_request_slope", 0.0, non_negative),
            tpot_intercept: self.num(&o, "tpot_intercept", 0.0, non_negative),
            decode_min_requests: self.int(&o, "decode_min_requests", 1, 1, u64::MAX),
            decode_max_requests: self.int(&o, "decode_max_requests", 1, 1, u64::MAX),
            decode_min_kv_tokens: self.int(&o, "decode_min_kv_tokens", 0, 0, u64::MAX),
            decode_max_kv_tokens: self.int(&o, "decode_max_kv_tokens", 1, 1, u64::MAX),
            kv_capacity_tokens: o
                .get("kv_capacity_tokens")
                .map(|_| self.int(&o, "kv_capacity_tokens", 1, 1, u64::MAX)),
        };
        if p.decode_max_requests < p.decode_min_requests {
            self.rule(
                o.p("decode_max_requests"),
                &Value::from(p.decode_max_requests),
                format!("must be ≥ decode_min_requests ({})", p.decode_min_requests),
            );
        }
        if p.decode_max_kv_tokens < p.decode_min_kv_tokens {
            self.rule(
                o.p("decode_max_kv_tokens"),
                &Value::from(p.decode_max_kv_tokens),
                format!(
                    "must be ≥ decode_min_kv_tokens ({})",
                    p.decode_min_kv_tokens
                ),
            );
        }
        (self.issues.len() == before).then_some(p)
    }
}
