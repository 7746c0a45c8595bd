//! The router's shared runtime state and the documents rendered from it (`/ready`, `/health`,
//! `/narwhal/state`, `/narwhal/targets`, `/v1/models`; reference-notes 1.3–1.7).
//!
//! ```text
//!  Shared ─┬─ Core (Mutex): engine slots (role, exclusions, resident), breaker, rng,
//!          │                retry credits, attempt accounting, SGLang bootstrap ports
//!          ├─ Tally (Mutex): outcome counters          ◄── settle() is the one writer
//!          ├─ Metrics, Journal, upstream client, admission seats, HA flags
//! ```
//!
//! HA and lifecycle plug in here later: `ha` carries `controls_fleet`, epoch and holder; the
//! exclusion set already knows `draining`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use narwhal_shared::Clock;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use crate::breaker::{Breaker, FailureClass, Transition};
use crate::config::{Config, Role, secs};
use crate::journal::Journal;
use crate::lifecycle::Lifecycle;
use crate::lifecycle::driver::Agents;
use crate::metrics::{Metrics, labels};
use crate::outcome::{RequestRecord, SettleSink, Settlement, Tally, Terminal};
use crate::placement::{EngineSlot, Exclusion, Phase};
use crate::upstream::Upstream;

/// Attempt and retry accounting (`/narwhal/state.serving`).
#[derive(Debug, Default, Clone)]
pub(crate) struct ServingStats {
    pub(crate) prefill_attempts: u64,
    pub(crate) decode_attempts: u64,
    pub(crate) retry_attempts: u64,
    pub(crate) retry_credits_spent: u64,
    pub(crate) retry_denied: u64,
    pub(crate) decode_tokens_observed: u64,
    pub(crate) attempt_failures: BTreeMap<(String, String), u64>,
    pub(crate) upstream_prefill_s: f64,
    pub(crate) upstream_decode_s: f64,
}

/// Mutable scheduling state behind one lock.
pub(crate) struct Core {
    pub(crate) slots: Vec<EngineSlot>,
    pub(crate) breaker: Breaker,
    pub(crate) rng: StdRng,
    pub(crate) stats: ServingStats,
    pub(crate) bootstrap_ports: Vec<Option<u16>>,
    pub(crate) unserved: u64,
    /// Suspect engines: producers whose KV fed this engine's failing decode streams (`""` for
    /// a decode without a producer); verification reruns those paths (issue 4; handoff
    /// `inference_sources`). Cleared when validation readmits the engine.
    pub(crate) sources: Vec<BTreeSet<String>>,
}

/// HA view (no lease yet: always controls the fleet, epoch 0, holder "").
#[derive(Debug, Clone)]
pub(crate) struct Ha {
    pub(crate) controls_fleet: bool,
    pub(crate) standby: bool,
    pub(crate) epoch: u64,
    pub(crate) holder: String,
    pub(crate) failover_blocked: String,
    pub(crate) lifecycle_blocked: String,
    /// Why `--resume` refused the state file (`""` when it did not).
    pub(crate) resume_refused: String,
}

/// Everything request handlers, the monitor and the control routes share.
pub(crate) struct Shared {
    pub(crate) cfg: Arc<Config>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) core: Mutex<Core>,
    pub(crate) tally: Mutex<Tally>,
    pub(crate) ha: Mutex<Ha>,
    pub(crate) metrics: Metrics,
    pub(crate) journal: Journal,
    pub(crate) upstream: Upstream,
    pub(crate) seats: Arc<Semaphore>,
    pub(crate) max_concurrent: usize,
    pub(crate) retained: AtomicUsize,
    pub(crate) retained_high_water: AtomicUsize,
    pub(crate) queued: AtomicUsize,
    pub(crate) queue_high_water: AtomicUsize,
    /// The pure lifecycle manager (always locked before `core`).
    pub(crate) lifecycle: Mutex<Lifecycle>,
    /// Serialises lifecycle actions end to end, agent calls included.
    pub(crate) lifecycle_lock: tokio::sync::Mutex<()>,
    /// Wakes the drain-deadline timer when a drain starts.
    pub(crate) lifecycle_wake: tokio::sync::Notify,
    /// Some engine is held by the lifecycle: resident changes must refresh drain progress.
    pub(crate) any_held: AtomicBool,
    /// The engines' agents (mutual TLS).
    pub(crate) agents: Agents,
    /// The newest consolidation-risk event (handoff `demand_risk`).
    pub(crate) demand: Mutex<crate::handoff::Demand>,
    /// Wakes the state-file writer after a lifecycle or ejection change.
    pub(crate) state_dirty: tokio::sync::Notify,
    /// The router lease (backend `none`: always active, epoch 0).
    pub(crate) lease: Arc<crate::lease::LeaseDriver>,
    /// The router-wide retry budget (`serving.retry_budget`).
    pub(crate) retry_budget: crate::retry::RetryBudget,
    /// Epochs this router claimed and released without serving (failed takeovers).
    pub(crate) released_epochs: Mutex<BTreeSet<u64>>,
}

impl Shared {
    pub(crate) fn new(
        cfg: Arc<Config>,
        clock: Arc<dyn Clock>,
        journal: Journal,
        max_concurrent: usize,
        agents: Agents,
        lease: Arc<crate::lease::LeaseDriver>,
    ) -> Arc<Self> {
        let n = cfg.engines.len();
        let lifecycle = Lifecycle::new(
            cfg.engines.iter().map(|e| e.iid.clone()).collect(),
            cfg.recovery.engine_restart_policy,
        );
        let probe_interval =
            secs(cfg.controller.monitor_interval_s * f64::from(cfg.recovery.readmit_every));
        let slots = cfg
            .engines
            .iter()
            .map(|e| EngineSlot::new(e.role))
            .collect();
        let metrics = Metrics::new(cfg.slo.ttft_s, cfg.slo.tpot_s);
        let limit = max_concurrent as u64 + cfg.serving.queue_capacity;
        metrics.http_retained_limit.set(limit as i64);
        metrics.admission_inflight_limit.set(max_concurrent as i64);
        metrics.retry_credits.set(cfg.serving.retry_budget as f64);
        let upstream = Upstream::new(&cfg);
        Arc::new(Shared {
            core: Mutex::new(Core {
                slots,
                breaker: Breaker::new(n, cfg.recovery.eject_after, probe_interval),
                rng: StdRng::from_os_rng(),
                stats: ServingStats::default(),
                bootstrap_ports: vec![None; n],
                sources: vec![BTreeSet::new(); n],
                unserved: 0,
            }),
            tally: Mutex::new(Tally::default()),
            ha: Mutex::new(Ha {
                controls_fleet: true,
                standby: false,
                epoch: 0,
                holder: String::new(),
                failover_blocked: String::new(),
                lifecycle_blocked: String::new(),
                resume_refused: String::new(),
            }),
            metrics,
            journal,
            upstream,
            seats: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            retained: AtomicUsize::new(0),
            retained_high_water: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            queue_high_water: AtomicUsize::new(0),
            lifecycle: Mutex::new(lifecycle),
            lifecycle_lock: tokio::sync::Mutex::new(()),
            lifecycle_wake: tokio::sync::Notify::new(),
            any_held: AtomicBool::new(false),
            agents,
            demand: Mutex::new(crate::handoff::Demand::default()),
            state_dirty: tokio::sync::Notify::new(),
            lease,
            released_epochs: Mutex::new(BTreeSet::new()),
            retry_budget: crate::retry::RetryBudget::new(
                cfg.serving.retry_budget,
                cfg.serving.retry_replenish,
            ),
            clock,
            cfg,
        })
    }

    pub(crate) fn core(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn tally(&self) -> MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn demand(&self) -> MutexGuard<'_, crate::handoff::Demand> {
        self.demand.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lifecycle(&self) -> MutexGuard<'_, Lifecycle> {
        self.lifecycle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records why `--resume` refused the state file.
    pub(crate) fn set_resume_refused(&self, reason: &str) {
        self.ha
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .resume_refused = reason.to_string();
    }

    /// Mirrors the lifecycle's readiness hold (`whole-wave drain <id>`, ...) into `/ready`.
    pub(crate) fn set_lifecycle_blocked(&self, reason: &str) {
        let mut ha = self.ha.lock().unwrap_or_else(|p| p.into_inner());
        if ha.lifecycle_blocked != reason {
            ha.lifecycle_blocked = reason.to_string();
        }
    }

    /// The HA view. `controls_fleet` is false as soon as the lease's local validity lapses,
    /// even before the renew loop notices (reference-notes 3.4).
    pub(crate) fn ha(&self) -> Ha {
        let mut ha = self.ha.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if ha.controls_fleet
            && self.lease.control(self.clock.now()) != crate::lease::Control::Active
        {
            ha.controls_fleet = false;
        }
        ha
    }

    pub(crate) fn wall(&self) -> f64 {
        self.clock.wall().unwrap_or(0.0)
    }

    pub(crate) fn retained_limit(&self) -> usize {
        self.max_concurrent + self.cfg.serving.queue_capacity as usize
    }

    /// Live engine count (not ejected, not draining).
    pub(crate) fn live_count(&self) -> usize {
        self.core().slots.iter().filter(|s| s.is_live()).count()
    }

    /// Readiness (reference-notes 1.2 without lease/lifecycle/monitoring parts yet):
    /// `(ready, control_ready, reason)`.
    pub(crate) fn readiness(&self) -> (bool, bool, String) {
        let ha = self.ha();
        let control_ready = ha.controls_fleet;
        let live = self.live_count();
        let reason = if !ha.failover_blocked.is_empty() {
            ha.failover_blocked.clone()
        } else if !ha.lifecycle_blocked.is_empty() {
            ha.lifecycle_blocked.clone()
        } else if ha.standby {
            "shadowing".into()
        } else if !ha.controls_fleet {
            "lease expired".into()
        } else if live == 0 {
            "no available engines".into()
        } else {
            String::new()
        };
        (reason.is_empty(), control_ready, reason)
    }

    /// Apply breaker transitions: exclusion set, metrics, journal events, logs.
    pub(crate) fn apply_transitions(&self, core: &mut Core, transitions: &[Transition]) {
        if transitions
            .iter()
            .any(|t| !matches!(t, Transition::ProbeRequested { .. }))
        {
            crate::handoff::mark_dirty(self);
        }
        for t in transitions {
            match *t {
                Transition::Ejected { iid, cause } => {
                    core.slots[iid].excluded.insert(Exclusion::Ejected);
                    let name = &self.cfg.engines[iid].iid;
                    self.metrics
                        .ejections
                        .get_or_create(&labels(&[("iid", name), ("cause", cause.as_str())]))
                        .inc();
                    tracing::info!(engine.id = %name, cause = cause.as_str(), "engine ejected");
                    self.journal.emit(json!({"event": "engine_ejected", "iid": name, "cause": cause.as_str(), "at": self.wall()}));
                }
                Transition::Readmitted { iid, evidence } => {
                    core.slots[iid].excluded.remove(&Exclusion::Ejected);
                    let name = &self.cfg.engines[iid].iid;
                    self.metrics
                        .readmissions
                        .get_or_create(&labels(&[("iid", name), ("evidence", evidence)]))
                        .inc();
                    tracing::info!(engine.id = %name, evidence, "engine readmitted");
                    self.journal.emit(json!({"event": "engine_readmitted", "iid": name, "evidence": evidence, "at": self.wall()}));
                }
                Transition::ProbeRequested { iid } => {
                    tracing::info!(engine.id = %self.cfg.engines[iid].iid, "health verification requested");
                }
            }
        }
    }

    /// A leg failed with `class`: stream-class failures of a decode leg also record the
    /// producer that fed it (`producer`: the prefill engine, `None` when the decode ran alone),
    /// so verification can rerun that path (reference-notes 6.2, 6.8).
    pub(crate) fn observe_leg_failure(
        &self,
        iid: usize,
        phase: Phase,
        class: FailureClass,
        producer: Option<usize>,
    ) {
        if phase == Phase::Decode && class == FailureClass::Stream {
            let name = producer
                .map(|p| self.cfg.engines[p].iid.clone())
                .unwrap_or_default();
            self.core().sources[iid].insert(name);
        }
        self.observe(iid, crate::breaker::Observation::LegFailed(class));
    }

    /// A retry was granted: one budget credit spent (reference-notes 7.5).
    pub(crate) fn count_retry(&self) {
        let mut core = self.core();
        core.stats.retry_credits_spent += 1;
        core.stats.retry_attempts += 1;
        self.metrics.retry_credits_spent.inc();
        self.metrics.retry_attempts.inc();
    }

    /// A retry was denied by the empty budget.
    pub(crate) fn count_retry_denied(&self) {
        self.core().stats.retry_denied += 1;
        self.metrics.retry_denied.inc();
    }

    /// Feed one breaker observation and apply its transitions.
    pub(crate) fn observe(&self, iid: usize, obs: crate::breaker::Observation) {
        let now = self.clock.now();
        let mut core = self.core();
        let tr = core.breaker.observe(iid, obs, now);
        self.apply_transitions(&mut core, &tr);
    }

    /// Refresh scrape-time gauges and render `/metrics`.
    pub(crate) fn render_metrics(&self) -> String {
        let (ready, _, _) = self.readiness();
        let m = &self.metrics;
        m.router_ready.set(i64::from(ready));
        for (iid, state, ready_to_stop) in crate::lifecycle::driver::gauges(self) {
            m.engine_ready_to_stop
                .get_or_create(&labels(&[("iid", &iid)]))
                .set(i64::from(ready_to_stop));
            for st in crate::lifecycle::DrainState::ALL {
                m.engine_lifecycle_state
                    .get_or_create(&labels(&[("iid", &iid), ("state", st.as_str())]))
                    .set(i64::from(st.as_str() == state));
            }
        }
        m.router_lease_epoch.set(self.ha().epoch as i64);
        let retained = self.retained.load(Ordering::Relaxed);
        m.http_retained.set(retained as i64);
        m.http_retained_high_water
            .set(self.retained_high_water.load(Ordering::Relaxed) as i64);
        m.queued.set(self.queued.load(Ordering::Relaxed) as i64);
        m.queue_high_water
            .set(self.queue_high_water.load(Ordering::Relaxed) as i64);
        m.admission_inflight.set(
            (self.max_concurrent - self.seats.available_permits().min(self.max_concurrent)) as i64,
        );
        m.journal_dropped.set(self.journal.dropped() as i64);
        let core = self.core();
        m.retry_credits.set(self.retry_budget.credits());
        let mut ejected = 0;
        let mut pool = [0i64; 2];
        for (i, s) in core.slots.iter().enumerate() {
            let iid = self.cfg.engines[i].iid.as_str();
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
                    .set(i64::from(core.breaker.streak(i, c)));
            }
        }
        m.ejected_instances.set(ejected);
        m.pool_instances
            .get_or_create(&labels(&[("role", "prefill")]))
            .set(pool[0]);
        m.pool_instances
            .get_or_create(&labels(&[("role", "decode")]))
            .set(pool[1]);
        drop(core);
        m.render()
    }

    /// `/ready` (reference-notes 1.3): status and body.
    pub(crate) fn ready_doc(&self) -> (bool, Value) {
        let (ready, control_ready, reason) = self.readiness();
        let ha = self.ha();
        (
            ready,
            json!({
                "status": if ready { "ready" } else { "not_ready" },
                "control_ready": control_ready,
                "epoch": ha.epoch,
                "holder": ha.holder,
                "reason": reason,
            }),
        )
    }

    /// `/health` (reference-notes 1.4).
    pub(crate) fn health_doc(&self) -> Value {
        let (ready, _, _) = self.readiness();
        let ha = self.ha();
        let status = if ready {
            "ok"
        } else if (!ha.failover_blocked.is_empty()
            && ha.failover_blocked != crate::ha::IDENTITY_PENDING)
            || (!ha.standby && !ha.controls_fleet)
        {
            "fenced"
        } else if !ha.lifecycle_blocked.is_empty() {
            "maintenance"
        } else if ha.standby {
            "standby"
        } else {
            "degraded"
        };
        json!({
            "status": status,
            "instances": self.cfg.engines.len(),
            "available_instances": self.live_count(),
        })
    }

    /// `/v1/models` (reference-notes 1.5).
    pub(crate) fn models_doc(&self) -> Value {
        json!({"object": "list", "data": [{"id": self.cfg.model, "object": "model", "owned_by": "narwhal"}]})
    }

    /// `/narwhal/targets` (reference-notes 1.6).
    pub(crate) fn targets_doc(&self) -> Value {
        let groups: Vec<Value> = self
            .cfg
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
                        "backend": self.cfg.backend.as_str(),
                        "__scheme__": scheme,
                        "__metrics_path__": format!("{}/metrics", path.trim_end_matches('/')),
                    }
                })
            })
            .collect();
        Value::Array(groups)
    }

    /// `/narwhal/state` (reference-notes 1.7): the starred fields, others stubbed or omitted.
    pub(crate) fn state_doc(&self) -> Value {
        let (ready, _, _) = self.readiness();
        // The lifecycle view: the lifecycle document minus its envelope (reference-notes 1.7).
        let mut lifecycle_view = crate::lifecycle::driver::document(self, "");
        if let Some(m) = lifecycle_view.as_object_mut() {
            for k in ["schema", "schema_version", "error"] {
                m.remove(k);
            }
        }
        let ha = self.ha();
        let tally = self.tally().clone();
        let core = self.core();
        let names: Vec<&str> = self.cfg.engines.iter().map(|e| e.iid.as_str()).collect();
        let sorted_by = |pred: &dyn Fn(&EngineSlot) -> bool| {
            let mut v: Vec<&str> = core
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| pred(s))
                .map(|(i, _)| names[i])
                .collect();
            v.sort_unstable();
            v
        };
        let ejected = sorted_by(&|s| s.excluded.contains(&Exclusion::Ejected));
        let mut inference_sources = serde_json::Map::new();
        let mut inference_holds = Vec::new();
        for (i, set) in core.sources.iter().enumerate() {
            if !set.is_empty() {
                let producers: Vec<&String> = set.iter().collect();
                inference_sources.insert(names[i].into(), json!(producers));
                inference_holds.push(json!({"iid": names[i], "recorded_producers": producers}));
            }
        }
        let draining = sorted_by(&|s| s.excluded.contains(&Exclusion::Draining));
        let prefill_pool = sorted_by(&|s| s.role == Role::Prefill);
        let decode_pool = sorted_by(&|s| s.role == Role::Decode);
        let mut resident = serde_json::Map::new();
        let mut failures = serde_json::Map::new();
        let mut order: Vec<usize> = (0..names.len()).collect();
        order.sort_by_key(|i| names[*i]);
        for i in order {
            let s = &core.slots[i];
            resident.insert(
                names[i].into(),
                json!({"prefill": s.resident_prefill, "decode": s.resident_decode}),
            );
            let streaks: serde_json::Map<String, Value> = FailureClass::ALL
                .iter()
                .map(|c| {
                    (
                        c.as_str().to_string(),
                        Value::from(core.breaker.streak(i, *c)),
                    )
                })
                .chain(std::iter::once(("liveness".to_string(), Value::from(0))))
                .collect();
            failures.insert(names[i].into(), Value::Object(streaks));
        }
        let ejections: Vec<Value> = core
            .breaker
            .ejections()
            .iter()
            .map(|((i, cause), n)| json!({"iid": names[*i], "cause": cause.as_str(), "count": n}))
            .collect();
        let readmissions: Vec<Value> = core
            .breaker
            .readmissions()
            .iter()
            .map(|(i, n)| json!({"iid": names[*i], "evidence": "health", "count": n}))
            .collect();
        let st = core.stats.clone();
        let attempt_failures: Vec<Value> = st
            .attempt_failures
            .iter()
            .map(|((phase, reason), n)| json!({"phase": phase, "reason": reason, "count": n}))
            .collect();
        let retry_credits = self.retry_budget.credits();
        let unserved = core.unserved;
        drop(core);
        let mut pinned: Vec<&str> = self
            .cfg
            .engines
            .iter()
            .filter(|e| e.pin)
            .map(|e| e.iid.as_str())
            .collect();
        pinned.sort_unstable();
        let inflight =
            self.max_concurrent - self.seats.available_permits().min(self.max_concurrent);
        json!({
            "schema": "narwhal.state",
            "schema_version": 1,
            "journal_run": self.journal.run(),
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
            "controller": "reactive",
            "token_accounting": "token_ids",
            "monitoring": {"degraded": false, "reason": null, "core_consecutive": 0, "core_failures": 0},
            "ha": {"ready": ready, "standby": ha.standby, "epoch": ha.epoch, "holder": ha.holder, "blocked": ha.failover_blocked, "controls_fleet": ha.controls_fleet, "resume": {"refused": !ha.resume_refused.is_empty(), "reason": ha.resume_refused}},
            "lifecycle": lifecycle_view,
            "admission": {
                "inflight": inflight,
                "queued": self.queued.load(Ordering::Relaxed),
                "queue_capacity": self.cfg.serving.queue_capacity,
                "queue_high_water": self.queue_high_water.load(Ordering::Relaxed),
                "waiting_prefill": 0,
                "waiting_decode": 0,
                "limit": self.max_concurrent,
                "loop_lag_s": 0.0,
                "sizing_delay_s": 0.0,
                "saturation_threshold_s": 0.25 * self.cfg.slo.ttft_s,
                "rejected": tally.rejected,
                "refused": tally.refused,
                "engine_auth": if self.cfg.engine.engine_api_key.is_some() { "bearer" } else { "boundary" },
                "mode": "open",
                "margin": self.cfg.serving.admission_margin,
            },
            "outcome_reasons": tally.reasons_json(),
            "serving": {
                "http_retained": self.retained.load(Ordering::Relaxed),
                "http_retained_limit": self.retained_limit(),
                "http_retained_high_water": self.retained_high_water.load(Ordering::Relaxed),
                "prefill_attempts": st.prefill_attempts,
                "decode_attempts": st.decode_attempts,
                "retry_attempts": st.retry_attempts,
                "retry_credits": retry_credits,
                "retry_credits_spent": st.retry_credits_spent,
                "retry_denied": st.retry_denied,
                "served_after_retry": tally.served_after_retry,
                "attempt_failures": attempt_failures,
                "decode_tokens_observed": st.decode_tokens_observed,
                "upstream_seconds": {"prefill": st.upstream_prefill_s, "decode": st.upstream_decode_s},
            },
            "pools": {"prefill": prefill_pool, "decode": decode_pool},
            "slo": {"ttft_s": self.cfg.slo.ttft_s, "tpot_s": self.cfg.slo.tpot_s},
            "first_token_timeout_s": self.cfg.engine.first_token_timeout_s,
            "resident": resident,
            "pinned": pinned,
            "min_prefill": self.cfg.controller.min_prefill,
            "min_decode": self.cfg.controller.min_decode,
            "ejected": ejected,
            "draining": draining,
            "quarantined": [],
            "holds": {"timed": [], "inference": inference_holds},
            "inference_sources": inference_sources,
            "breaker": {
                "failures": failures,
                "verifying": [],
                "ejections": ejections,
                "hold_starts": [],
                "hold_ends": [],
                "probes": [],
                "readmissions": readmissions,
            },
            "unserved": unserved,
            "journal_dropped": self.journal.dropped(),
        })
    }
}

impl SettleSink for Shared {
    /// The one place outcomes are counted: tally, metrics, histograms, retry credits, journal.
    fn settle(&self, mut record: RequestRecord, s: Settlement) {
        record.duration_s = (self.wall() - record.arrived).max(0.0);
        let slo_met = s.terminal == Terminal::Completed
            && record.ttft_s.is_some_and(|t| t <= self.cfg.slo.ttft_s)
            && record.tpot_s.is_none_or(|t| t <= self.cfg.slo.tpot_s);
        let sized = record.input_len.is_some();
        self.tally().apply(&s, slo_met, sized, record.attempts > 1);
        let m = &self.metrics;
        if !sized {
            m.unsized_offered.inc();
        }
        match s.terminal {
            Terminal::Completed => {
                m.served.inc();
                if slo_met {
                    m.slo_met.inc();
                }
                if record.attempts > 1 {
                    m.served_after_retry.inc();
                }
                self.retry_budget.replenish();
            }
            Terminal::Failed => {
                m.failed
                    .get_or_create(&labels(&[("reason", reason_or(&s))]))
                    .inc();
            }
            Terminal::Refused => {
                m.refused
                    .get_or_create(&labels(&[("cause", reason_or(&s))]))
                    .inc();
            }
            Terminal::Rejected => {
                m.rejected
                    .get_or_create(&labels(&[("reason", reason_or(&s))]))
                    .inc();
            }
            Terminal::Expired => {
                m.expired
                    .get_or_create(&labels(&[("reason", reason_or(&s))]))
                    .inc();
            }
            Terminal::Cancelled => {
                m.cancelled.inc();
            }
            Terminal::Invalid => {
                m.invalid_requests.inc();
            }
        }
        if let Some(t) = record.ttft_s {
            m.observe_ttft(t);
        }
        if let Some(t) = record.tpot_s {
            m.observe_tpot(t);
        }
        if s.terminal == Terminal::Completed {
            tracing::debug!(rid = %record.rid, attempts = record.attempts, output_len = record.output_len, "request completed");
        } else {
            tracing::info!(
                rid = %record.rid,
                terminal = s.terminal.as_str(),
                reason = %s.reason,
                status = ?s.status,
                attempts = record.attempts,
                error = s.error.as_deref().unwrap_or(""),
                "request settled"
            );
        }
        self.journal.emit(record.row(&s));
    }

    fn abandoned(&self, record: &RequestRecord) -> Settlement {
        let elapsed = self.wall() - record.arrived;
        if elapsed >= self.cfg.serving.request_timeout_s {
            Settlement::new(
                Terminal::Expired,
                "deadline",
                504,
                "deadline passed before the client went away",
                "request_expired",
            )
        } else {
            Settlement::cancelled()
        }
    }
}

fn reason_or(s: &Settlement) -> &str {
    if s.reason.is_empty() {
        "unclassified"
    } else {
        &s.reason
    }
}

/// A resident request on one engine in one phase; decrements on drop (RAII).
pub(crate) struct Resident {
    shared: Arc<Shared>,
    iid: usize,
    phase: Phase,
}

impl Resident {
    /// Count a request resident on `iid` (caller holds no core lock).
    pub(crate) fn new(shared: &Arc<Shared>, iid: usize, phase: Phase) -> Self {
        {
            let mut core = shared.core();
            Self::bump(&mut core, iid, phase, true);
        }
        Resident {
            shared: shared.clone(),
            iid,
            phase,
        }
    }

    fn bump(core: &mut Core, iid: usize, phase: Phase, up: bool) {
        let slot = &mut core.slots[iid];
        let c = match phase {
            Phase::Prefill => &mut slot.resident_prefill,
            Phase::Decode => &mut slot.resident_decode,
        };
        if up {
            *c += 1;
        } else {
            *c = c.saturating_sub(1);
        }
    }
}

impl Drop for Resident {
    fn drop(&mut self) {
        {
            let mut core = self.shared.core();
            Self::bump(&mut core, self.iid, self.phase, false);
        }
        // Eager drain progress (DESIGN.md 9.4): only when something is held.
        if self.shared.any_held.load(Ordering::Acquire) {
            crate::lifecycle::driver::refresh(&self.shared);
        }
    }
}

/// A request waiting for an admission seat; decrements on drop.
pub(crate) struct Queued(Arc<Shared>);

impl Queued {
    pub(crate) fn new(shared: &Arc<Shared>) -> Self {
        let now = shared.queued.fetch_add(1, Ordering::AcqRel) + 1;
        shared.queue_high_water.fetch_max(now, Ordering::Relaxed);
        Queued(shared.clone())
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Retained-request slot (in-flight limit); decrements on drop.
pub(crate) struct Retained(Arc<Shared>);

impl Retained {
    /// Take a slot unless `max_concurrent + queue_capacity` are retained.
    pub(crate) fn try_new(shared: &Arc<Shared>) -> Option<Self> {
        let limit = shared.retained_limit();
        let mut cur = shared.retained.load(Ordering::Relaxed);
        loop {
            if cur >= limit {
                return None;
            }
            match shared.retained.compare_exchange(
                cur,
                cur + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    shared
                        .retained_high_water
                        .fetch_max(cur + 1, Ordering::Relaxed);
                    return Some(Retained(shared.clone()));
                }
                Err(now) => cur = now,
            }
        }
    }
}

impl Drop for Retained {
    fn drop(&mut self) {
        self.0.retained.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::{FailureClass, Observation};
    use crate::outcome::Pending;
    use narwhal_shared::{ManualClock, SystemClock};
    use std::time::Duration;

    fn shared(clock: Arc<ManualClock>) -> Arc<Shared> {
        let text = serde_json::json!({
            "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
            "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                        {"iid": "d0", "url": "http://127.0.0.1:2"}],
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
            "serving": {"request_timeout_s": 10, "prefill_timeout_s": 5},
            "recovery": {"eject_after": 1}
        })
        .to_string();
        let cfg = Config::from_json_str(&text, &|_| None).unwrap();
        let n = cfg.engines.len();
        let lease = Arc::new(
            crate::lease::LeaseDriver::from_config(&cfg.lease, "test", clock.clone())
                .expect("lease none"),
        );
        Shared::new(
            Arc::new(cfg),
            clock,
            Journal::disabled("1-deadbeef"),
            4,
            Agents::none(n),
            lease,
        )
    }

    #[test]
    fn abandoned_request_is_cancelled_before_the_deadline_and_expired_after() {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        let sh = shared(clock.clone());
        let rec = |rid: &str| RequestRecord {
            rid: rid.into(),
            arrived: 1000.0,
            input_len: Some(3),
            ..Default::default()
        };
        drop(Pending::new(sh.clone(), rec("a")));
        clock.advance(Duration::from_secs(11));
        drop(Pending::new(sh.clone(), rec("b")));
        let t = sh.tally().clone();
        assert_eq!((t.cancelled, t.expired), (1, 1));
        assert_eq!(t.reasons["expired"]["deadline"], 1);
        assert!(sh.render_metrics().contains("narwhal_cancelled_total 1"));
    }

    #[test]
    fn readiness_follows_live_engines() {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        let sh = shared(clock);
        assert_eq!(sh.ready_doc().1["status"], "ready");
        sh.observe(0, Observation::LegFailed(FailureClass::Connection));
        assert_eq!(sh.health_doc()["available_instances"], 1);
        assert_eq!(sh.state_doc()["ejected"], serde_json::json!(["p0"]));
        sh.observe(1, Observation::LegFailed(FailureClass::Stream));
        let (ready, doc) = sh.ready_doc();
        assert!(!ready);
        assert_eq!(doc["reason"], "no available engines");
        assert_eq!(doc["control_ready"], true);
        assert_eq!(sh.health_doc()["status"], "degraded");
        let m = sh.render_metrics();
        assert!(m.contains("narwhal_router_ready 0"), "{m}");
        assert!(m.contains("narwhal_ejected{iid=\"d0\"} 1"), "{m}");
        assert!(
            m.contains("narwhal_engine_ejections_total{iid=\"d0\",cause=\"stream\"} 1"),
            "{m}"
        );
    }

    #[test]
    fn targets_strip_userinfo_and_keep_the_path() {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        let sh = shared(clock);
        let t = sh.targets_doc();
        assert_eq!(t[0]["targets"], serde_json::json!(["127.0.0.1:1"]));
        assert_eq!(t[1]["labels"]["iid"], "d0");
    }
}
