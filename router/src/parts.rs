//! The router's owned parts, bundled for the layers above them (serve, handoff, documents,
//! HA, HTTP). Each part owns its data and exposes a narrow handle; this bundle owns nothing
//! itself and is built once by `app::run`.

use std::sync::Arc;

use narwhal_shared::Clock;
use tokio::sync::Notify;

use crate::accounting::Accounting;
use crate::admission::Admission;
use crate::config::Config;
use crate::controller::{self, Controller};
use crate::demand::DemandRisk;
use crate::fleet::Fleet;
use crate::ha_phase::{Ha, HaPhase};
use crate::journal::Journal;
use crate::kv_cache::KvCache;
use crate::lifecycle::agents::Agents;
use crate::lifecycle::driver::{Handles, LifecycleDriver};
use crate::metrics::Metrics;
use crate::readiness::Gate;
use crate::upstream::Upstream;
use narwhal_lease::LeaseDriver;

/// Handles to every part (see the module doc and the design note in `lib.rs`).
pub(crate) struct Parts {
    /// The validated fleet file.
    pub(crate) cfg: Arc<Config>,
    /// Monotonic and wall clocks (only drivers read them).
    pub(crate) clock: Arc<dyn Clock>,
    /// Prometheus families.
    pub(crate) metrics: Arc<Metrics>,
    /// The request journal.
    pub(crate) journal: Journal,
    /// The pooled engine client.
    pub(crate) upstream: Upstream,
    /// Engine slots, breaker, suspects, bootstrap ports.
    pub(crate) fleet: Arc<Fleet>,
    /// Request counters and the retry budget.
    pub(crate) accounting: Arc<Accounting>,
    /// Retained-request limit, seats and queue.
    pub(crate) admission: Arc<Admission>,
    /// The HA phase (and the lease).
    pub(crate) ha: Arc<Ha>,
    /// Readiness derived from HA, the lifecycle hold and the live engines.
    pub(crate) gate: Arc<Gate>,
    /// Drains, waves, readmission.
    pub(crate) lifecycle: Arc<LifecycleDriver>,
    /// The newest consolidation-risk event.
    pub(crate) demand: Arc<DemandRisk>,
    /// The role controller and predictive admission.
    pub(crate) controller: Arc<Controller>,
    /// The engines' KV block index and the KV score's tokens (docs/design/kv-aware-placement.md).
    pub(crate) kv: Arc<KvCache>,
    /// Wakes the state-file writer after a lifecycle or ejection change.
    pub(crate) dirty: Arc<Notify>,
    /// `control.self_drain`'s Kubernetes side (TokenReview, pod reads): set once by `app::run`
    /// before the listeners serve, when configured.
    pub(crate) self_drain: std::sync::OnceLock<crate::self_drain::SelfDrain>,
}

impl Parts {
    /// Builds every part for `cfg`: all engines live, no holds, zero counters, the HA phase
    /// starting at `phase`; `max_concurrent` admission seats (at least one).
    pub(crate) fn new(
        cfg: Arc<Config>,
        clock: Arc<dyn Clock>,
        journal: Journal,
        max_concurrent: usize,
        agents: Agents,
        lease: Arc<LeaseDriver>,
        phase: HaPhase,
    ) -> Arc<Parts> {
        let metrics = Arc::new(Metrics::new(cfg.slo.ttft_s, cfg.slo.tpot_s));
        let dirty = Arc::new(Notify::new());
        let upstream = Upstream::new(&cfg);
        let fleet = Arc::new(Fleet::new(
            &cfg,
            clock.clone(),
            metrics.clone(),
            journal.clone(),
            dirty.clone(),
        ));
        let ha = Arc::new(Ha::new(lease, clock.clone(), phase));
        let gate = Arc::new(Gate::new(ha.clone(), fleet.clone()));
        let lifecycle = Arc::new(LifecycleDriver::new(
            Handles {
                cfg: cfg.clone(),
                clock: clock.clone(),
                fleet: fleet.clone(),
                ha: ha.clone(),
                gate: gate.clone(),
                upstream: upstream.clone(),
                metrics: metrics.clone(),
                journal: journal.clone(),
                dirty: dirty.clone(),
            },
            agents,
        ));
        let accounting = Arc::new(Accounting::new(
            cfg.clone(),
            clock.clone(),
            metrics.clone(),
            journal.clone(),
        ));
        let admission = Arc::new(Admission::new(&cfg, max_concurrent.max(1), &metrics));
        let demand = Arc::new(DemandRisk::default());
        let controller = Arc::new(Controller::new(controller::Handles {
            cfg: cfg.clone(),
            clock: clock.clone(),
            fleet: fleet.clone(),
            lifecycle: lifecycle.clone(),
            ha: ha.clone(),
            gate: gate.clone(),
            upstream: upstream.clone(),
            journal: journal.clone(),
            demand: demand.clone(),
        }));
        let kv = Arc::new(KvCache::new(cfg.clone(), clock.clone(), upstream.clone()));
        Arc::new(Parts {
            cfg,
            clock,
            metrics,
            journal,
            upstream,
            fleet,
            accounting,
            admission,
            ha,
            gate,
            lifecycle,
            demand,
            controller,
            kv,
            dirty,
            self_drain: std::sync::OnceLock::new(),
        })
    }

    /// Wall-clock Unix seconds (0 when the clock reads before 1970).
    pub(crate) fn wall(&self) -> f64 {
        self.clock.wall().unwrap_or(0.0)
    }
}

/// Parts over a fleet file given as JSON, a manual clock, no agents and the lease the file
/// configures (holder prefix `router_id`), starting `Active`, every engine past its health
/// gate.
#[cfg(test)]
pub(crate) fn for_test(
    fleet: serde_json::Value,
    clock: Arc<narwhal_shared::ManualClock>,
    router_id: &str,
) -> Arc<Parts> {
    let cfg = Config::from_json_str(&fleet.to_string(), &|_| None).expect("fleet file");
    let n = cfg.engines.len();
    let lease = LeaseDriver::from_config(&cfg.lease, router_id, clock.clone()).expect("lease");
    let parts = Parts::new(
        Arc::new(cfg),
        clock,
        Journal::disabled("1-deadbeef"),
        4,
        Agents::none(n),
        Arc::new(lease),
        HaPhase::Active,
    );
    parts.fleet.admit_all();
    parts
}
