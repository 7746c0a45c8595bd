//! The documents the router renders from its parts' snapshots: `/ready`, `/health`,
//! `/v1/models`, `/narwhal/targets`, `/narwhal/state` and `/metrics` (reference-notes
//! 1.3–1.7, 10). The lifecycle document is the lifecycle's own; the handoff is `handoff`'s.
//!
//! ```text
//!  Gate (HA phase, lifecycle hold, live) ─┐
//!  Fleet (slots, breaker, suspects) ──────┼──► ready / health / state / metrics
//!  Accounting, Admission, Lifecycle ──────┘
//! ```

use serde_json::{Value, json};

use crate::breaker::FailureClass;
use crate::config::{Config, Role};
use crate::lifecycle::DrainState;
use crate::metrics::labels;
use crate::parts::Parts;
use crate::placement::{EngineSlot, Exclusion};

/// `/ready` (reference-notes 1.3): whether ready, and the body.
pub(crate) fn ready(parts: &Parts) -> (bool, Value) {
    let view = parts.gate.view();
    let r = &view.readiness;
    (
        r.ready,
        json!({
            "status": if r.ready { "ready" } else { "not_ready" },
            "control_ready": r.control_ready,
            "epoch": view.ha.status.epoch,
            "holder": view.ha.status.holder,
            "reason": r.reason,
        }),
    )
}

/// `/health` (reference-notes 1.4).
pub(crate) fn health(parts: &Parts) -> Value {
    let view = parts.gate.view();
    json!({
        "status": view.health(),
        "instances": parts.cfg.engines.len(),
        "available_instances": view.live,
    })
}

/// `/v1/models` (reference-notes 1.5).
pub(crate) fn models(cfg: &Config) -> Value {
    json!({"object": "list", "data": [{"id": cfg.model, "object": "model", "owned_by": "narwhal"}]})
}

/// `/narwhal/targets` (reference-notes 1.6): one Prometheus target group per engine, without
/// URL credentials.
pub(crate) fn targets(cfg: &Config) -> Value {
    let groups: Vec<Value> = cfg
        .engines
        .iter()
        .map(|e| {
            let (scheme, rest) = e.url.split_once("://").unwrap_or(("http", e.url.as_str()));
            let (authority, path) = match rest.find('/') {
                Some(i) => (&rest[..i], &rest[i..]),
                None => (rest, ""),
            };
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            json!({
                "targets": [host],
                "labels": {
                    "iid": e.iid,
                    "backend": cfg.backend.as_str(),
                    "__scheme__": scheme,
                    "__metrics_path__": format!("{}/metrics", path.trim_end_matches('/')),
                }
            })
        })
        .collect();
    Value::Array(groups)
}

/// `/narwhal/state` (reference-notes 1.7): the starred fields, others stubbed or omitted.
pub(crate) fn state(parts: &Parts) -> Value {
    let gate = parts.gate.view();
    let ready = gate.readiness.ready;
    // The lifecycle view: the lifecycle document minus its envelope (reference-notes 1.7).
    let mut lifecycle_view = parts.lifecycle.document("");
    if let Some(m) = lifecycle_view.as_object_mut() {
        for k in ["schema", "schema_version", "error"] {
            m.remove(k);
        }
    }
    let ha = &gate.ha.status;
    let tally = parts.accounting.tally();
    let cfg = &parts.cfg;
    let names: Vec<&str> = cfg.engines.iter().map(|e| e.iid.as_str()).collect();
    let fleet = parts.fleet.read(|fleet| {
        let sorted_by = |pred: &dyn Fn(&EngineSlot) -> bool| {
            let mut v: Vec<&str> = fleet
                .slots()
                .iter()
                .enumerate()
                .filter(|(_, s)| pred(s))
                .map(|(i, _)| names[i])
                .collect();
            v.sort_unstable();
            v
        };
        let mut inference_sources = serde_json::Map::new();
        let mut inference_holds = Vec::new();
        for (i, set) in fleet.suspects().iter().enumerate() {
            if !set.is_empty() {
                let producers: Vec<&String> = set.iter().collect();
                inference_sources.insert(names[i].into(), json!(producers));
                inference_holds.push(json!({"iid": names[i], "recorded_producers": producers}));
            }
        }
        let mut resident = serde_json::Map::new();
        let mut failures = serde_json::Map::new();
        let mut order: Vec<usize> = (0..names.len()).collect();
        order.sort_by_key(|i| names[*i]);
        for i in order {
            let s = &fleet.slots()[i];
            resident.insert(
                names[i].into(),
                json!({"prefill": s.resident_prefill, "decode": s.resident_decode}),
            );
            let streaks: serde_json::Map<String, Value> = FailureClass::ALL
                .iter()
                .map(|c| {
                    (
                        c.as_str().to_string(),
                        Value::from(fleet.breaker().streak(i, *c)),
                    )
                })
                .chain(std::iter::once(("liveness".to_string(), Value::from(0))))
                .collect();
            failures.insert(names[i].into(), Value::Object(streaks));
        }
        let ejections: Vec<Value> = fleet
            .breaker()
            .ejections()
            .iter()
            .map(|((i, cause), n)| json!({"iid": names[*i], "cause": cause.as_str(), "count": n}))
            .collect();
        let readmissions: Vec<Value> = fleet
            .breaker()
            .readmissions()
            .iter()
            .map(|(i, n)| json!({"iid": names[*i], "evidence": "health", "count": n}))
            .collect();
        json!({
            "ejected": sorted_by(&|s| s.excluded.contains(&Exclusion::Ejected)),
            "draining": sorted_by(&|s| s.excluded.contains(&Exclusion::Draining)),
            "prefill": sorted_by(&|s| s.role == Role::Prefill),
            "decode": sorted_by(&|s| s.role == Role::Decode),
            "inference_sources": inference_sources,
            "inference_holds": inference_holds,
            "resident": resident,
            "failures": failures,
            "ejections": ejections,
            "readmissions": readmissions,
        })
    });
    let st = parts.accounting.serving();
    let attempt_failures: Vec<Value> = st
        .attempt_failures
        .iter()
        .map(|((phase, reason), n)| json!({"phase": phase, "reason": reason, "count": n}))
        .collect();
    let mut pinned: Vec<&str> = cfg
        .engines
        .iter()
        .filter(|e| e.pin)
        .map(|e| e.iid.as_str())
        .collect();
    pinned.sort_unstable();
    let adm = parts.admission.stats();
    let resume = parts.ha.resume_refused();
    let mut doc = json!({
        "schema": "narwhal.state",
        "schema_version": 1,
        "journal_run": parts.journal.run(),
        "served": tally.served,
        "slo_met": tally.slo_met,
        "offered": tally.offered,
        "unsized_offered": tally.unsized_offered,
        "expired": tally.expired,
        "failed": tally.failed,
        "cancelled": tally.cancelled,
        "invalid_requests": tally.invalid_requests,
        "rejected": tally.rejected,
        "refused": tally.refused,
        "token_accounting": "token_ids",
        "ha": {
            "ready": ready,
            "standby": ha.phase.standby(),
            "epoch": ha.epoch,
            "holder": ha.holder,
            "blocked": ha.phase.blocked(),
            "controls_fleet": gate.ha.controls,
            "resume": {"refused": resume.is_some(), "reason": resume.unwrap_or("")},
        },
        "lifecycle": lifecycle_view,
        "admission": {
            "inflight": adm.inflight,
            "queued": adm.queued,
            "queue_capacity": cfg.serving.queue_capacity,
            "queue_high_water": adm.queue_high_water,
            "waiting_prefill": parts.controller.waiting_prefill().unwrap_or(adm.queued),
            "limit": adm.limit,
            "loop_lag_s": 0.0,
            "sizing_delay_s": 0.0,
            "saturation_threshold_s": 0.25 * cfg.slo.ttft_s,
            "rejected": tally.rejected,
            "refused": tally.refused,
            "engine_auth": if cfg.engine.engine_api_key.is_some() { "bearer" } else { "boundary" },
            "mode": cfg.serving.admission.as_str(),
            "margin": cfg.serving.admission_margin,
        },
        "outcome_reasons": tally.reasons_json(),
        "serving": {
            "http_retained": adm.retained,
            "http_retained_limit": adm.retained_limit,
            "http_retained_high_water": adm.retained_high_water,
            "prefill_attempts": st.prefill_attempts,
            "decode_attempts": st.decode_attempts,
            "retry_attempts": st.retry_attempts,
            "retry_credits": parts.accounting.budget().credits(),
            "retry_credits_spent": st.retry_credits_spent,
            "retry_denied": st.retry_denied,
            "served_after_retry": tally.served_after_retry,
            "attempt_failures": attempt_failures,
            "decode_tokens_observed": st.decode_tokens_observed,
            "upstream_seconds": {"prefill": st.upstream_prefill_s, "decode": st.upstream_decode_s},
        },
        "pools": {"prefill": fleet["prefill"], "decode": fleet["decode"]},
        "slo": {"ttft_s": cfg.slo.ttft_s, "tpot_s": cfg.slo.tpot_s},
        "first_token_timeout_s": cfg.engine.first_token_timeout_s,
        "resident": fleet["resident"],
        "pinned": pinned,
        "min_prefill": cfg.controller.min_prefill,
        "min_decode": cfg.controller.min_decode,
        "ejected": fleet["ejected"],
        "draining": fleet["draining"],
        "quarantined": [],
        "holds": {"timed": [], "inference": fleet["inference_holds"]},
        "inference_sources": fleet["inference_sources"],
        "breaker": {
            "failures": fleet["failures"],
            "verifying": [],
            "ejections": fleet["ejections"],
            "hold_starts": [],
            "hold_ends": [],
            "probes": [],
            "readmissions": fleet["readmissions"],
        },
        "unserved": parts.accounting.unserved(),
        "journal_dropped": parts.journal.dropped(),
    });
    // The role controller's fields (controller-notes 13), live, or absent when it is off.
    if let Some(m) = doc.as_object_mut() {
        m.extend(parts.controller.state());
    }
    doc
}

/// Refreshes the scrape-time gauges and renders `/metrics` (reference-notes 10).
pub(crate) fn metrics(parts: &Parts) -> String {
    let m = &parts.metrics;
    let view = parts.gate.view();
    m.router_ready.set(i64::from(view.readiness.ready));
    for (iid, state, ready_to_stop) in parts.lifecycle.gauges() {
        m.engine_ready_to_stop
            .get_or_create(&labels(&[("iid", &iid)]))
            .set(i64::from(ready_to_stop));
        for st in DrainState::ALL {
            m.engine_lifecycle_state
                .get_or_create(&labels(&[("iid", &iid), ("state", st.as_str())]))
                .set(i64::from(st.as_str() == state));
        }
    }
    m.router_lease_epoch.set(view.ha.status.epoch as i64);
    let adm = parts.admission.stats();
    m.http_retained.set(adm.retained as i64);
    m.http_retained_high_water
        .set(adm.retained_high_water as i64);
    m.queued.set(adm.queued as i64);
    m.queue_high_water.set(adm.queue_high_water as i64);
    m.admission_inflight.set(adm.inflight as i64);
    m.journal_dropped.set(parts.journal.dropped() as i64);
    m.retry_credits.set(parts.accounting.budget().credits());
    let names = parts.fleet.names();
    parts.fleet.read(|fleet| {
        let mut ejected = 0;
        let mut pool = [0i64; 2];
        for (i, s) in fleet.slots().iter().enumerate() {
            let iid = names[i].as_str();
            let is_ej = s.excluded.contains(&Exclusion::Ejected);
            ejected += i64::from(is_ej);
            m.ejected
                .get_or_create(&labels(&[("iid", iid)]))
                .set(i64::from(is_ej));
            m.engine_draining
                .get_or_create(&labels(&[("iid", iid)]))
                .set(i64::from(s.excluded.contains(&Exclusion::Draining)));
            for role in [Role::Prefill, Role::Decode] {
                m.instance_role
                    .get_or_create(&labels(&[("iid", iid), ("role", role.as_str())]))
                    .set(i64::from(s.role == role));
            }
            pool[usize::from(s.role == Role::Decode)] += 1;
            m.resident
                .get_or_create(&labels(&[("iid", iid), ("phase", "prefill")]))
                .set(i64::from(s.resident_prefill));
            m.resident
                .get_or_create(&labels(&[("iid", iid), ("phase", "decode")]))
                .set(i64::from(s.resident_decode));
            for c in FailureClass::ALL {
                m.breaker_streak
                    .get_or_create(&labels(&[("iid", iid), ("class", c.as_str())]))
                    .set(i64::from(fleet.breaker().streak(i, c)));
            }
        }
        m.ejected_instances.set(ejected);
        m.pool_instances
            .get_or_create(&labels(&[("role", "prefill")]))
            .set(pool[0]);
        m.pool_instances
            .get_or_create(&labels(&[("role", "decode")]))
            .set(pool[1]);
    });
    let mut text = m.render();
    text.push_str(&parts.controller.metrics(parts.accounting.unserved()));
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::Observation;
    use narwhal_shared::{Clock as _, ManualClock, SystemClock};
    use std::sync::Arc;

    fn parts() -> Arc<Parts> {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        crate::parts::for_test(
            json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
                "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                            {"iid": "d0", "url": "http://127.0.0.1:2"}],
                "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                "serving": {"request_timeout_s": 10, "prefill_timeout_s": 5},
                "recovery": {"eject_after": 1}
            }),
            clock,
            "test",
        )
    }

    #[test]
    fn readiness_follows_live_engines() {
        let p = parts();
        assert_eq!(ready(&p).1["status"], "ready");
        p.fleet
            .observe(0, Observation::LegFailed(FailureClass::Connection));
        assert_eq!(health(&p)["available_instances"], 1);
        assert_eq!(state(&p)["ejected"], json!(["p0"]));
        p.fleet
            .observe(1, Observation::LegFailed(FailureClass::Stream));
        let (ready, doc) = ready(&p);
        assert!(!ready);
        assert_eq!(doc["reason"], "no available engines");
        assert_eq!(doc["control_ready"], true);
        assert_eq!(health(&p)["status"], "degraded");
        let m = metrics(&p);
        assert!(m.contains("narwhal_router_ready 0"), "{m}");
        assert!(m.contains("narwhal_ejected{iid=\"d0\"} 1"), "{m}");
        assert!(
            m.contains("narwhal_engine_ejections_total{iid=\"d0\",cause=\"stream\"} 1"),
            "{m}"
        );
    }

    /// Issue 12: every controller field is live or absent, never a constant that looks live.
    #[test]
    fn controller_fields_are_live_or_absent() {
        let off = state(&parts());
        assert_eq!(
            off["controller"], "off",
            "no profiles: the controller is off"
        );
        for k in ["control", "monitoring", "demand_evidence", "flips", "load"] {
            assert!(
                off.get(k).is_none(),
                "{k} is absent with the controller off"
            );
        }
        assert!(
            off["admission"].get("waiting_decode").is_none(),
            "no decode queue exists"
        );
        assert_eq!(off["admission"]["waiting_prefill"], 0);
        assert_eq!(off["admission"]["mode"], "open");
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        let p = crate::parts::for_test(
            json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
                "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                            {"iid": "d0", "url": "http://127.0.0.1:2"}],
                "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                "serving": {"admission": "predictive"},
                "profiles": {"default": {"ttft_a": 0, "ttft_b": 0.001, "ttft_c": 0.01,
                    "tpot_slope": 1e-6, "tpot_intercept": 0.01, "decode_max_requests": 64,
                    "decode_max_kv_tokens": 200000}}
            }),
            clock,
            "test",
        );
        let on = state(&p);
        assert_eq!(on["controller"], "reactive");
        assert_eq!(
            on["control"]["last_decision"],
            Value::Null,
            "null until the first decision"
        );
        assert_eq!(
            on["control"]["flips"]["reactive:prefill"], 0,
            "the seeded series"
        );
        assert_eq!(on["monitoring"]["stages"]["controller"]["failures"], 0);
        assert_eq!(on["demand_evidence"]["blocked_gate"], "evidence");
        assert_eq!(on["admission"]["mode"], "predictive");
        assert_eq!(on["decode_floor"]["live_decode"], 1);
        let m = metrics(&p);
        for want in [
            "narwhal_admission_info{mode=\"predictive\"} 1",
            "narwhal_unserved_total 0",
            "narwhal_flips_total{to=\"prefill\",by=\"reactive\"} 0",
            "narwhal_demand_evidence_refused{gate=\"evidence\"} 1",
            "# TYPE narwhal_controller_last_decision gauge",
        ] {
            assert!(m.contains(want), "missing {want}");
        }
        assert!(
            !m.contains("narwhal_controller_last_decision{"),
            "no decision yet"
        );
    }

    #[test]
    fn targets_strip_userinfo_and_keep_the_path() {
        let p = parts();
        let t = targets(&p.cfg);
        assert_eq!(t[0]["targets"], json!(["127.0.0.1:1"]));
        assert_eq!(t[1]["labels"]["iid"], "d0");
    }
}
