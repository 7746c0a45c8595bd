//! What the controller reports: its `/narwhal/state` fields (controller.md 13) and its
//! Prometheus families (controller.md 12), both read from the machine under its lock.
//! Every field is live; with the controller off (no profiles) only `controller: "off"` and
//! the admission families are reported, the rest is absent (docs/http-api.md).
//!
//! ```text
//!  Controller (machine, ledger) ──state(now)──► {controller, control, load, thresholds, ...}
//!                               ──metrics(now, unserved)──► text exposition 0.0.4
//! ```

use std::fmt::Write as _;

use narwhal_shared::documents::Ordered;
use narwhal_shared::documents::controller as doc;
use serde_json::Value;

use super::decision::rounded;
use super::evidence::{Evidence, Gate};
use super::machine::Machine;
use super::roles::{RoleChanges, SEEDED};
use super::{Controller, Ledger};
use crate::config::{Role, Serving};

impl Controller {
    /// The machine with the fleet and the newest risk as they are now (a report may come
    /// between passes).
    fn current(&self) -> std::sync::MutexGuard<'_, Machine> {
        let engines = super::driver::engines_view(&self.h.cfg, &self.h.fleet);
        let (risk, events) = {
            let d = self.h.demand.lock();
            (d.risk().map(|(k, at)| (k.to_string(), at)), d.events())
        };
        let mut m = self.lock();
        m.observe(engines, risk, events);
        m
    }
}

/// A fresh evidence capture against the last window demand (or a fresh one).
fn evidence(m: &Machine, now: std::time::Instant) -> Evidence {
    let window = m
        .core
        .last_demand
        .clone()
        .unwrap_or_else(|| m.core.price(now, m.core.p.window_s, m.core.p.window_s));
    m.core.evidence(now, &window)
}

fn pool_loads(m: &Machine, now: std::time::Instant) -> (f64, f64) {
    let s = m.core.snapshot(now);
    (s.prefill_pressure, s.decode_pressure)
}

/// The `control` field: the role machine's settings, decisions and flip counts.
fn control_doc(m: &Machine) -> doc::Control {
    let r = &m.core.roles;
    doc::Control {
        advisory: r.settings().advisory,
        last_decision: m.last_decision.as_ref().map(|d| d.padded()),
        decisions: m
            .decisions
            .iter()
            .map(|((by, res), n)| (format!("{}:{}", by.as_str(), res.as_str()), *n))
            .collect(),
        flips: r.flips.clone(),
        flip_reversals: r.reversals,
        flips_refused: r.refused_total,
        flip_inflight: doc::FlipInflight {
            prefill: r.inflight.0,
            decode: r.inflight.1,
        },
    }
}

/// The `demand_history` field: each demand window's retention and counts.
fn demand_history_doc(m: &Machine) -> Ordered<doc::DemandWindow> {
    m.core
        .demand
        .history()
        .into_iter()
        .map(|(name, w)| {
            let window = doc::DemandWindow {
                bucket_s: w.bucket_s,
                retained_s: w.retained_s,
                cell_limit: w.cell_limit as u64,
                cells: w.cells as u64,
                observations: w.observations,
                overflow_observations: w.overflow_observations,
            };
            (name, window)
        })
        .collect()
}

/// The `demand_evidence` field: evidence capture `ev` and the restored risk.
fn evidence_doc(ev: &Evidence, restored: Option<doc::RestoredRisk>) -> doc::DemandEvidence {
    doc::DemandEvidence {
        span_s: rounded(ev.span_s, 6),
        arrivals: ev.arrivals,
        required_span_s: ev.required_span_s,
        required_arrivals: ev.required_arrivals,
        max_span_s: ev.max_span_s,
        closed: ev.closed,
        risk_kind: ev.risk_kind.clone(),
        risk_age_s: ev.risk_age_s.and_then(|a| rounded(a, 6)),
        risk_events: ev.risk_events.clone(),
        short_decode_engines: rounded(ev.short_decode, 6),
        long_decode_engines: rounded(ev.long_decode, 6),
        trend_ratio: ev.trend_ratio.and_then(|t| rounded(t, 6)),
        envelope_decode_engines: rounded(ev.envelope_decode, 6),
        blocked_gate: ev.gate.as_str().to_string(),
        restored,
    }
}

/// The `resident_work` field: each engine's resident prefill seconds and decode tokens.
fn resident_work_doc(m: &Machine) -> Ordered<doc::ResidentWork> {
    (0..m.core.names.len())
        .map(|i| {
            let l = m.core.book.load(i);
            let work = doc::ResidentWork {
                prefill_s: rounded(l.prefill_s, 6),
                decode_tokens: l.decode_tokens.is_finite().then_some(l.decode_tokens),
            };
            (m.core.names[i].clone(), work)
        })
        .collect()
}

/// The `monitoring` field: degraded once `limit` controller passes failed in a row.
fn monitoring_doc(ledger: &Ledger, limit: u64) -> doc::Monitoring {
    let degraded = ledger.consecutive >= limit;
    doc::Monitoring {
        degraded,
        reason: degraded.then(|| {
            format!(
                "controller stage failed {} times in a row",
                ledger.consecutive
            )
        }),
        core_consecutive: ledger.consecutive,
        core_failures: ledger.failures,
        stages: doc::Stages {
            controller: doc::StageLedger {
                failures: ledger.failures,
                consecutive: ledger.consecutive,
                last_class: ledger.last_class.clone(),
                last_at: ledger.last_at,
            },
        },
    }
}

impl Controller {
    /// The controller's `/narwhal/state` fields (controller.md 13): `controller` alone when it
    /// is off.
    pub(crate) fn state(&self) -> doc::ControllerReport {
        if !self.enabled {
            return doc::ControllerReport {
                controller: doc::OFF.to_string(),
                fields: None,
            };
        }
        let now = self.h.clock.now();
        let ledger = self.ledger();
        let restored = self
            .h
            .demand
            .lock()
            .restored()
            .map(|(kind, age, at)| doc::RestoredRisk {
                kind: kind.to_string(),
                age_s: rounded(age, 6),
                applied_s_ago: rounded(now.saturating_duration_since(at).as_secs_f64(), 3),
            });
        let m = self.current();
        let r = &m.core.roles;
        let control = control_doc(&m);
        let (lp, ld) = pool_loads(&m, now);
        let th = &self.h.cfg.controller.thresholds;
        let f = &m.floor;
        let live_decode = m.core.live(Role::Decode);
        let demand_history = demand_history_doc(&m);
        let ev = evidence(&m, now);
        let demand_evidence = evidence_doc(&ev, restored);
        let flips_refused = r
            .refusals()
            .map(|x| doc::FlipRefusal {
                at: x.at,
                to: x.to.as_str().to_string(),
                why: x.why.clone(),
            })
            .collect();
        let resident_work = resident_work_doc(&m);
        let switching = self
            .changing()
            .into_iter()
            .map(|i| m.core.names[i].clone())
            .collect();
        let limit = u64::from(self.h.cfg.controller.monitor_failure_limit);
        let monitoring = monitoring_doc(&ledger, limit);
        let fields = doc::ControllerFields {
            control,
            load: doc::PoolLoad {
                prefill: rounded(lp, 4),
                decode: rounded(ld, 4),
            },
            thresholds: doc::Thresholds {
                expand: th.expand,
                shrink: th.shrink,
                cooldown_s: th.cooldown_s,
                sustained_intervals: th.sustained_intervals,
                dwell_s: th.dwell_s,
                panic_ratio: th.panic_ratio,
            },
            panic_bypasses: m.panic_bypasses,
            below_floor: doc::BelowFloor {
                active: f.active(),
                live_prefill: m.core.live(Role::Prefill) as u64,
                since: f.since.map(|(_, w)| w),
                breaches: f.breaches,
                cumulative_s: rounded(f.cumulative(now), 4),
            },
            decode_floor: doc::DecodeFloor {
                min_decode: m.core.p.min_decode as u64,
                live_decode: live_decode as u64,
                below_floor: live_decode < m.core.p.min_decode,
                restoration_moves: r.restoration_moves,
            },
            demand_history,
            demand_evidence,
            flips_refused,
            flips: r.history_doc(&m.core.names),
            resident_work,
            switching,
            monitoring,
        };
        doc::ControllerReport {
            controller: doc::REACTIVE.to_string(),
            fields: Some(fields),
        }
    }

    /// The controller's and admission's Prometheus families (controller.md 12), text
    /// exposition 0.0.4; `unserved` is the accounting's count.
    pub(crate) fn metrics(&self, unserved: u64) -> String {
        let mut w = Writer::default();
        let serving = &self.h.cfg.serving;
        admission_families(&mut w, serving, unserved);
        if !self.enabled {
            return w.0;
        }
        let now = self.h.clock.now();
        let ledger = self.ledger();
        let m = self.current();
        let limit = u64::from(self.h.cfg.controller.monitor_failure_limit);
        monitoring_families(&mut w, &ledger, limit);
        let r = &m.core.roles;
        flip_families(&mut w, r);
        w.family(
            "narwhal_controller_decisions_total",
            "counter",
            "Controller decisions by caller and result",
        );
        for ((by, res), n) in &m.decisions {
            w.sample(
                "narwhal_controller_decisions_total",
                &[("by", by.as_str()), ("result", res.as_str())],
                &f(*n as f64),
            );
        }
        self.decision_gauges(&mut w, &m);
        floor_families(&mut w, &m, now);
        let ev = evidence(&m, now);
        evidence_families(&mut w, &ev);
        demand_history_families(&mut w, &m);
        let (lp, ld) = pool_loads(&m, now);
        w.family(
            "narwhal_pool_load",
            "gauge",
            "Pool load as a ratio against its own SLO target",
        );
        w.sample("narwhal_pool_load", &[("role", "decode")], &f4(ld));
        w.sample("narwhal_pool_load", &[("role", "prefill")], &f4(lp));
        w.0
    }

    fn decision_gauges(&self, w: &mut Writer, m: &Machine) {
        let families = [
            (
                "narwhal_controller_proposed_engines",
                "Engine count in the most recent controller decision",
            ),
            (
                "narwhal_controller_last_decision",
                "1 for the most recent controller decision and its result",
            ),
            (
                "narwhal_controller_projected_slo_ratio",
                "Projected SLO ratio after the most recent proposal",
            ),
            (
                "narwhal_controller_phase_work_engines",
                "Measured phase work in engine equivalents",
            ),
            (
                "narwhal_controller_objective",
                "Candidate pressure and improvement over the current split",
            ),
            (
                "narwhal_controller_decode_tokens_per_engine",
                "Projected decode tokens per engine and profiled SLO capacity",
            ),
            (
                "narwhal_controller_decode_requests_per_engine",
                "Projected active decode requests per engine",
            ),
            (
                "narwhal_controller_decode_model",
                "Live decode correction and measured-domain coverage",
            ),
        ];
        let d = m.last_decision.as_ref();
        let num = |k: &str| d.and_then(|d| d.details.get(k)).and_then(Value::as_f64);
        for (name, help) in families {
            w.family(name, "gauge", help);
            let Some(d) = d else { continue };
            match name {
                "narwhal_controller_proposed_engines" => {
                    w.sample(name, &[("role", "prefill")], &f(d.prefill as f64));
                    w.sample(name, &[("role", "decode")], &f(d.decode as f64));
                }
                "narwhal_controller_last_decision" => w.sample(
                    name,
                    &[
                        ("by", d.by.as_str()),
                        ("reason", &d.reason),
                        ("result", d.result.as_str()),
                    ],
                    "1.0",
                ),
                "narwhal_controller_projected_slo_ratio" => {
                    if let (Some(t), Some(p)) =
                        (num("projected_ttft_ratio"), num("projected_tpot_ratio"))
                    {
                        w.sample(name, &[("phase", "prefill")], &f(t));
                        w.sample(name, &[("phase", "decode")], &f(p));
                    }
                }
                "narwhal_controller_phase_work_engines" => {
                    for (phase, k) in [("prefill", "prefill_work"), ("decode", "decode_work")] {
                        if let Some(x) = num(k) {
                            w.sample(name, &[("phase", phase)], &f(x));
                        }
                    }
                }
                "narwhal_controller_objective" => {
                    for (v, k) in [
                        ("candidate", "objective"),
                        ("improvement", "objective_delta"),
                    ] {
                        if let Some(x) = num(k) {
                            w.sample(name, &[("value", v)], &f(x));
                        }
                    }
                }
                "narwhal_controller_decode_tokens_per_engine" => {
                    for (v, k) in [
                        ("projected", "decode_tokens_per_engine"),
                        ("slo_capacity", "decode_slo_capacity_tokens"),
                        ("kv_capacity", "decode_kv_capacity_tokens"),
                    ] {
                        if let Some(x) = num(k) {
                            w.sample(name, &[("value", v)], &f(x));
                        }
                    }
                }
                "narwhal_controller_decode_requests_per_engine" => {
                    if let Some(x) = num("decode_requests_per_engine") {
                        w.sample(name, &[], &f(x));
                    }
                }
                _ => {
                    if let Some(x) = num("decode_correction") {
                        w.sample(name, &[("value", "correction")], &f(x));
                    }
                    if let Some(c) = d
                        .details
                        .get("decode_profile_covered")
                        .and_then(Value::as_bool)
                    {
                        w.sample(
                            name,
                            &[("value", "profile_covered")],
                            if c { "1.0" } else { "0.0" },
                        );
                    }
                }
            }
        }
    }
}

fn evidence_families(w: &mut Writer, ev: &Evidence) {
    for (name, help, v) in [
        (
            "narwhal_demand_evidence_span_seconds",
            "Elapsed span of arrival evidence retained for decode consolidation",
            f(ev.span_s),
        ),
        (
            "narwhal_demand_evidence_arrivals",
            "Arrival samples retained for decode consolidation",
            ev.arrivals.to_string(),
        ),
        (
            "narwhal_demand_evidence_closed",
            "1 while the consolidation evidence window has closed",
            u8::from(ev.closed).to_string(),
        ),
        (
            "narwhal_demand_evidence_risk_age_seconds",
            "Age of the newest decode risk event (0 while none is recorded)",
            f(ev.risk_age_s.unwrap_or(0.0)),
        ),
        (
            "narwhal_demand_evidence_short_decode_engines",
            "Short-horizon decode demand estimate behind the rising-demand gate",
            f(ev.short_decode),
        ),
        (
            "narwhal_demand_evidence_envelope_decode_engines",
            "Conservative decode demand envelope priced into consolidation candidates",
            f(ev.envelope_decode),
        ),
    ] {
        w.family(name, "gauge", help);
        w.sample(name, &[], &v);
    }
    w.family(
        "narwhal_demand_evidence_trend_ratio",
        "gauge",
        "Short over long decode demand behind the rising-demand gate",
    );
    if let Some(t) = ev.trend_ratio {
        w.sample("narwhal_demand_evidence_trend_ratio", &[], &f(t));
    }
    w.family(
        "narwhal_demand_evidence_refused",
        "gauge",
        "1 on the gate currently refusing decode consolidation (risk, evidence, or trend)",
    );
    for (gate, label) in [
        (Gate::Risk, "risk"),
        (Gate::Evidence, "evidence"),
        (Gate::Trend, "trend"),
    ] {
        w.sample(
            "narwhal_demand_evidence_refused",
            &[("gate", label)],
            if ev.gate == gate { "1" } else { "0" },
        );
    }
    w.family(
        "narwhal_demand_evidence_risk_events_total",
        "counter",
        "Decode risk events that re-armed the consolidation evidence window, by kind",
    );
    for (kind, n) in &ev.risk_events {
        if *n > 0 {
            w.sample(
                "narwhal_demand_evidence_risk_events_total",
                &[("kind", kind)],
                &n.to_string(),
            );
        }
    }
}

/// The admission families: the mode, the margin and the unserved placements.
fn admission_families(w: &mut Writer, serving: &Serving, unserved: u64) {
    w.family(
        "narwhal_admission_info",
        "gauge",
        "Admission mode set by serving.admission",
    );
    w.sample(
        "narwhal_admission_info",
        &[("mode", serving.admission.as_str())],
        "1",
    );
    w.family(
        "narwhal_admission_margin",
        "gauge",
        "Fraction serving.admission_margin adds to the TTFT budget",
    );
    w.sample(
        "narwhal_admission_margin",
        &[],
        &f(serving.admission_margin),
    );
    w.family(
        "narwhal_unserved_total",
        "counter",
        "Phase placements whose cheapest engine missed its own SLO",
    );
    w.sample("narwhal_unserved_total", &[], &unserved.to_string());
}

/// The monitoring families: degraded once `limit` passes failed in a row, the stage's failures.
fn monitoring_families(w: &mut Writer, ledger: &Ledger, limit: u64) {
    w.family(
        "narwhal_monitoring_degraded",
        "gauge",
        "1 while the controller stage failed monitor_failure_limit passes in a row",
    );
    w.sample(
        "narwhal_monitoring_degraded",
        &[],
        if ledger.consecutive >= limit {
            "1"
        } else {
            "0"
        },
    );
    w.family(
        "narwhal_monitoring_stage_failures_total",
        "counter",
        "Failed monitoring passes by stage",
    );
    w.sample(
        "narwhal_monitoring_stage_failures_total",
        &[("stage", "controller")],
        &ledger.failures.to_string(),
    );
    w.family(
        "narwhal_monitoring_stage_consecutive_failures",
        "gauge",
        "Consecutive failed monitoring passes by stage",
    );
    w.sample(
        "narwhal_monitoring_stage_consecutive_failures",
        &[("stage", "controller")],
        &ledger.consecutive.to_string(),
    );
}

/// The role-change families: flips by target and caller (seeded ones always), reversals,
/// refusals, in-flight requests, advisory mode.
fn flip_families(w: &mut Writer, r: &RoleChanges) {
    w.family(
        "narwhal_flips_total",
        "counter",
        "Role changes by target pool and caller",
    );
    let mut seeded: Vec<(String, String)> = SEEDED
        .iter()
        .map(|(b, t)| (b.as_str().to_string(), t.as_str().to_string()))
        .collect();
    for k in r.flips.keys() {
        if let Some((b, t)) = k.split_once(':')
            && !seeded.iter().any(|(sb, st)| sb == b && st == t)
        {
            seeded.push((b.to_string(), t.to_string()));
        }
    }
    for (b, t) in &seeded {
        let n = r.flips.get(&format!("{b}:{t}")).copied().unwrap_or(0);
        w.sample(
            "narwhal_flips_total",
            &[("to", t), ("by", b)],
            &n.to_string(),
        );
    }
    w.family(
        "narwhal_flip_reversals_total",
        "counter",
        "Role changes that put an instance back where it came from",
    );
    w.sample(
        "narwhal_flip_reversals_total",
        &[],
        &r.reversals.to_string(),
    );
    w.family(
        "narwhal_flips_refused_total",
        "counter",
        "Role-change attempts declined by timing, availability, pins, floors, or advisory mode",
    );
    w.sample(
        "narwhal_flips_refused_total",
        &[],
        &r.refused_total.to_string(),
    );
    w.family(
        "narwhal_flip_inflight_total",
        "counter",
        "Requests resident on an instance at the moment it was flipped",
    );
    w.sample(
        "narwhal_flip_inflight_total",
        &[("phase", "prefill")],
        &r.inflight.0.to_string(),
    );
    w.sample(
        "narwhal_flip_inflight_total",
        &[("phase", "decode")],
        &r.inflight.1.to_string(),
    );
    w.family(
        "narwhal_controller_advisory",
        "gauge",
        "1 while controller decisions are recorded without changing roles",
    );
    w.sample(
        "narwhal_controller_advisory",
        &[],
        if r.settings().advisory { "1.0" } else { "0.0" },
    );
}

/// The decode and prefill floor families.
fn floor_families(w: &mut Writer, m: &Machine, now: std::time::Instant) {
    let r = &m.core.roles;
    let live_decode = m.core.live(Role::Decode);
    w.family(
        "narwhal_decode_floor",
        "gauge",
        "Configured minimum live decode engines",
    );
    w.sample("narwhal_decode_floor", &[], &f(m.core.p.min_decode as f64));
    w.family(
        "narwhal_decode_below_floor",
        "gauge",
        "1 while live decode engines are below min_decode",
    );
    w.sample(
        "narwhal_decode_below_floor",
        &[],
        &f(f64::from(u8::from(live_decode < m.core.p.min_decode))),
    );
    w.family(
        "narwhal_decode_floor_restorations_total",
        "counter",
        "Prefill engines moved to decode to restore min_decode",
    );
    w.sample(
        "narwhal_decode_floor_restorations_total",
        &[],
        &f(r.restoration_moves as f64),
    );
    w.family(
        "narwhal_prefill_below_floor",
        "gauge",
        "1 while the live prefill pool is below min_prefill",
    );
    w.sample(
        "narwhal_prefill_below_floor",
        &[],
        if m.floor.active() { "1" } else { "0" },
    );
    w.family(
        "narwhal_prefill_below_floor_events_total",
        "counter",
        "Prefill floor breaches",
    );
    w.sample(
        "narwhal_prefill_below_floor_events_total",
        &[],
        &m.floor.breaches.to_string(),
    );
    w.family(
        "narwhal_prefill_below_floor_seconds_total",
        "counter",
        "Seconds spent below the prefill floor",
    );
    w.sample(
        "narwhal_prefill_below_floor_seconds_total",
        &[],
        &f(((m.floor.cumulative(now)) * 1e4).round() / 1e4),
    );
}

/// The demand history families, one sample per demand window.
fn demand_history_families(w: &mut Writer, m: &Machine) {
    let hist = m.core.demand.history();
    for (family, help, pick) in [
        (
            "narwhal_demand_history_cells",
            "Retained demand history cohorts",
            0,
        ),
        (
            "narwhal_demand_history_cell_limit",
            "Maximum retained demand history cohorts",
            1,
        ),
        (
            "narwhal_demand_history_observations",
            "Original observations counted in demand history",
            2,
        ),
        (
            "narwhal_demand_history_overflow_observations",
            "Observations coalesced after shape cardinality overflow",
            3,
        ),
    ] {
        w.family(family, "gauge", help);
        for (name, s) in &hist {
            let v = match pick {
                0 => s.cells as u64,
                1 => s.cell_limit as u64,
                2 => s.observations,
                _ => s.overflow_observations,
            };
            w.sample(family, &[("window", name)], &v.to_string());
        }
    }
}

/// A float as Python's `str()` prints it (`3.0`, `0.6375`), `NaN`/`+Inf` as Prometheus.
fn f(x: f64) -> String {
    if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if x.fract() == 0.0 && x.abs() < 1e16 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

fn f4(x: f64) -> String {
    f((x * 1e4).round() / 1e4)
}

/// Prometheus text exposition 0.0.4.
#[derive(Default)]
struct Writer(String);

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Writer {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: &str) {
        if labels.is_empty() {
            let _ = writeln!(self.0, "{name} {value}");
        } else {
            let l: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = writeln!(self.0, "{name}{{{}}} {value}", l.join(","));
        }
    }
}
