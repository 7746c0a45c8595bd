//! The fleet: every engine's placement slot (role, exclusions, resident requests), the
//! breaker, suspect producers and SGLang bootstrap ports, behind one lock only this module
//! takes (reference-notes 6.1–6.4, 7.1; DESIGN.md section 5).
//!
//! ```text
//!  serve ──place / Resident guard / observe(leg outcome)──► Fleet ──► breaker transitions
//!  monitor ──due_probes / observe(health)──────────────────►   │        applied here: exclusions,
//!  lifecycle executor ──set_held(engines)──────────────────►   │        metrics, journal, logs
//!  documents / handoff ──read(|state| ...)─────────────────►   │
//!                                   resident change while held ──► resident_changed (Notify)
//!                                   ejection or readmission    ──► dirty (Notify, state file)
//! ```
//!
//! The fleet tells upper layers what happened only through the two notifications: the
//! lifecycle waits on `resident_changed` to re-evaluate drains, the state-file writer on
//! `dirty`. The live engine count is kept in an atomic, so readiness reads it without the lock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use narwhal_shared::Clock;
use serde_json::json;
use tokio::sync::Notify;

use crate::breaker::{Breaker, EjectCause, FailureClass, Observation, ProbeKind, Transition};
use crate::config::{Config, Role, secs};
use crate::journal::Journal;
use crate::metrics::{Metrics, labels};
use crate::placement::{self, Aggregate, EngineSlot, Exclusion, Phase, Plan};

/// What the fleet lock guards.
pub(crate) struct FleetState {
    slots: Vec<EngineSlot>,
    breaker: Breaker,
    /// Suspect engines: producers whose KV fed this engine's failing decode streams (`""` for
    /// a decode without a producer); verification reruns those paths (handoff
    /// `inference_sources`). Cleared when validation readmits the engine.
    suspects: Vec<BTreeSet<String>>,
    /// SGLang prefill engines' `disaggregation_bootstrap_port`, learned from `/server_info`.
    bootstrap_ports: Vec<Option<u16>>,
    /// Engines new placements avoid while another of their role is available (a donor held
    /// for an engine-side role switch; controller-notes 9.2).
    avoided: BTreeSet<usize>,
}

impl FleetState {
    /// Placement slots, config order.
    pub(crate) fn slots(&self) -> &[EngineSlot] {
        &self.slots
    }

    /// The breaker (streaks, ejection and readmission counts).
    pub(crate) fn breaker(&self) -> &Breaker {
        &self.breaker
    }

    /// Suspect producers per engine, config order.
    pub(crate) fn suspects(&self) -> &[BTreeSet<String>] {
        &self.suspects
    }
}

/// The fleet part (see the module doc).
pub(crate) struct Fleet {
    names: Vec<String>,
    state: Mutex<FleetState>,
    live: AtomicUsize,
    held: AtomicBool,
    resident_changed: Notify,
    /// Wakes the role controller when an exclusion changed (its prefill-floor edges).
    availability: Notify,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    journal: Journal,
    dirty: Arc<Notify>,
}

impl Fleet {
    /// Every configured engine live, in its configured role; the breaker ejects at
    /// `recovery.eject_after` and probes every `monitor_interval_s × readmit_every`.
    pub(crate) fn new(
        cfg: &Config,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
        journal: Journal,
        dirty: Arc<Notify>,
    ) -> Fleet {
        let n = cfg.engines.len();
        let probe_interval =
            secs(cfg.controller.monitor_interval_s * f64::from(cfg.recovery.readmit_every));
        Fleet {
            names: cfg.engines.iter().map(|e| e.iid.clone()).collect(),
            state: Mutex::new(FleetState {
                slots: cfg
                    .engines
                    .iter()
                    .map(|e| EngineSlot::new(e.role))
                    .collect(),
                breaker: Breaker::new(n, cfg.recovery.eject_after, probe_interval),
                suspects: vec![BTreeSet::new(); n],
                bootstrap_ports: vec![None; n],
                avoided: BTreeSet::new(),
            }),
            live: AtomicUsize::new(n),
            held: AtomicBool::new(false),
            resident_changed: Notify::new(),
            availability: Notify::new(),
            clock,
            metrics,
            journal,
            dirty,
        }
    }

    fn lock(&self) -> MutexGuard<'_, FleetState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` over the fleet state under the lock (documents, the handoff snapshot).
    pub(crate) fn read<R>(&self, f: impl FnOnce(&FleetState) -> R) -> R {
        f(&self.lock())
    }

    /// Engine ids, config order.
    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    /// Index of engine `iid`.
    pub(crate) fn index(&self, iid: &str) -> Option<usize> {
        self.names.iter().position(|n| n == iid)
    }

    /// Engines eligible for placement now (no exclusion).
    pub(crate) fn live_count(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// Picks the engines of one attempt (reference-notes 7.1 steps 1 and 5), avoiding
    /// `avoid`; `None` when no engine can serve.
    pub(crate) fn place(&self, avoid: &BTreeSet<usize>, aggregate: Aggregate) -> Option<Plan> {
        let state = self.lock();
        if state.avoided.is_empty() {
            return placement::plan_with(&state.slots, avoid, aggregate, &mut rand::rng());
        }
        let avoid: BTreeSet<usize> = avoid.union(&state.avoided).copied().collect();
        placement::plan_with(&state.slots, &avoid, aggregate, &mut rand::rng())
    }

    /// The router role of engine `iid`.
    pub(crate) fn role(&self, iid: usize) -> Role {
        self.lock().slots[iid].role
    }

    /// Gives engine `iid` router role `role` (a role flip; the role controller decides).
    /// Residents stay where they are; new placements follow the new role.
    pub(crate) fn set_role(&self, iid: usize, role: Role) {
        let mut state = self.lock();
        if state.slots[iid].role != role {
            state.slots[iid].role = role;
            self.dirty.notify_one();
        }
    }

    /// Takes engine `iid` out of placement while its role changes (`switching`), or returns
    /// it.
    pub(crate) fn set_switching(&self, iid: usize, switching: bool) {
        let mut state = self.lock();
        if switching {
            state.slots[iid].excluded.insert(Exclusion::Switching);
        } else {
            state.slots[iid].excluded.remove(&Exclusion::Switching);
        }
        self.recount(&state);
    }

    /// The engines new placements avoid while others of their role are available.
    pub(crate) fn set_avoided(&self, avoided: BTreeSet<usize>) {
        self.lock().avoided = avoided;
    }

    /// Counts a request resident on `iid` in `phase` until the guard drops.
    pub(crate) fn resident(self: &Arc<Self>, iid: usize, phase: Phase) -> Resident {
        bump(&mut self.lock().slots[iid], phase, true);
        Resident {
            fleet: self.clone(),
            iid,
            phase,
        }
    }

    /// Resolves after a resident count changed while some engine is held by the lifecycle
    /// (eager drain progress, DESIGN.md 9.4).
    pub(crate) async fn resident_changed(&self) {
        self.resident_changed.notified().await;
    }

    /// Engine names with their prefill + decode resident counts.
    pub(crate) fn resident_counts(&self) -> BTreeMap<String, u32> {
        let state = self.lock();
        self.names
            .iter()
            .zip(state.slots.iter())
            .map(|(n, s)| (n.clone(), s.outstanding()))
            .collect()
    }

    /// Whether the breaker has engine `iid` ejected.
    pub(crate) fn is_ejected(&self, iid: usize) -> bool {
        self.lock().breaker.is_ejected(iid)
    }

    /// Names of the engines eligible for placement.
    pub(crate) fn live_names(&self) -> BTreeSet<String> {
        self.names_where(EngineSlot::is_live)
    }

    /// Names of the engines the breaker ejected.
    pub(crate) fn ejected_names(&self) -> BTreeSet<String> {
        self.names_where(|s| s.excluded.contains(&Exclusion::Ejected))
    }

    fn names_where(&self, pred: impl Fn(&EngineSlot) -> bool) -> BTreeSet<String> {
        let state = self.lock();
        self.names
            .iter()
            .zip(state.slots.iter())
            .filter(|(_, s)| pred(s))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Holds exactly the engines in `held` out of placement (`draining`), releases the rest.
    pub(crate) fn set_held(&self, held: &BTreeSet<String>) {
        let mut state = self.lock();
        for (name, slot) in self.names.iter().zip(state.slots.iter_mut()) {
            if held.contains(name) {
                slot.excluded.insert(Exclusion::Draining);
            } else {
                slot.excluded.remove(&Exclusion::Draining);
            }
        }
        self.recount(&state);
        self.held.store(!held.is_empty(), Ordering::Release);
    }

    /// Feeds one breaker observation and applies its transitions.
    pub(crate) fn observe(&self, iid: usize, obs: Observation) {
        let now = self.clock.now();
        let mut state = self.lock();
        let tr = state.breaker.observe(iid, obs, now);
        self.apply(&mut state, &tr);
    }

    /// A leg failed with `class`: stream-class failures of a decode leg also record the
    /// producer that fed it (`producer`: the prefill engine, `None` when the decode ran
    /// alone), so verification can rerun that path (reference-notes 6.2, 6.8).
    pub(crate) fn observe_leg_failure(
        &self,
        iid: usize,
        phase: Phase,
        class: FailureClass,
        producer: Option<usize>,
    ) {
        if phase == Phase::Decode && class == FailureClass::Stream {
            let name = producer.map(|p| self.names[p].clone()).unwrap_or_default();
            self.lock().suspects[iid].insert(name);
        }
        self.observe(iid, Observation::LegFailed(class));
    }

    /// Ejects `iid` now with `cause` (process identity changed, a restored handoff).
    pub(crate) fn eject(&self, iid: usize, cause: EjectCause) {
        let now = self.clock.now();
        let mut state = self.lock();
        let tr = state.breaker.eject_now(iid, cause, now);
        self.apply(&mut state, &tr);
    }

    /// Validation through the agents passed: the engine's suspects are cleared and the
    /// breaker readmits it (evidence `lifecycle`).
    pub(crate) fn verified(&self, iid: usize) {
        let now = self.clock.now();
        let mut state = self.lock();
        state.suspects[iid].clear();
        let tr = state.breaker.observe(iid, Observation::Verified, now);
        self.apply(&mut state, &tr);
    }

    /// Breaker probes due now (reference-notes 6.4).
    pub(crate) fn due_probes(&self) -> Vec<(usize, ProbeKind)> {
        let now = self.clock.now();
        self.lock().breaker.due_probes(now)
    }

    /// A readmission probe ended without a verdict (validation could not start); the next
    /// probe retries.
    pub(crate) fn probe_inconclusive(&self, iid: usize) {
        self.lock().breaker.probe_inconclusive(iid);
    }

    /// Applies a restored handoff's fleet part (reference-notes 2.7): roles of unpinned
    /// engines, ejections (cause `handoff`), suspects.
    pub(crate) fn restore(
        &self,
        roles: &BTreeMap<usize, Role>,
        ejected: &BTreeSet<usize>,
        suspects: &BTreeMap<usize, BTreeSet<String>>,
    ) {
        let now = self.clock.now();
        let mut state = self.lock();
        for i in 0..self.names.len() {
            if let Some(role) = roles.get(&i) {
                state.slots[i].role = *role;
            }
            if ejected.contains(&i) {
                let tr = state.breaker.eject_now(i, EjectCause::Restored, now);
                self.apply(&mut state, &tr);
            }
            if let Some(s) = suspects.get(&i) {
                state.suspects[i] = s.clone();
            }
        }
    }

    /// The cached SGLang bootstrap port of prefill engine `iid`.
    pub(crate) fn bootstrap_port(&self, iid: usize) -> Option<u16> {
        self.lock().bootstrap_ports[iid]
    }

    /// Caches the SGLang bootstrap port of prefill engine `iid`.
    pub(crate) fn set_bootstrap_port(&self, iid: usize, port: u16) {
        self.lock().bootstrap_ports[iid] = Some(port);
    }

    fn recount(&self, state: &FleetState) {
        let live = state.slots.iter().filter(|s| s.is_live()).count();
        if self.live.swap(live, Ordering::AcqRel) != live {
            self.availability.notify_one();
        }
    }

    /// Resolves after the live engine count changed (the role controller's floor edges).
    pub(crate) async fn availability_changed(&self) {
        self.availability.notified().await;
    }

    /// Applies breaker transitions: exclusion set, metrics, journal events, logs; an
    /// ejection or readmission marks the state dirty for the state-file writer.
    fn apply(&self, state: &mut FleetState, transitions: &[Transition]) {
        if transitions
            .iter()
            .any(|t| !matches!(t, Transition::ProbeRequested { .. }))
        {
            self.dirty.notify_one();
        }
        let wall = self.clock.wall().unwrap_or(0.0);
        for t in transitions {
            match *t {
                Transition::Ejected { iid, cause } => {
                    state.slots[iid].excluded.insert(Exclusion::Ejected);
                    let name = &self.names[iid];
                    self.metrics
                        .ejections
                        .get_or_create(&labels(&[("iid", name), ("cause", cause.as_str())]))
                        .inc();
                    tracing::info!(engine.id = %name, cause = cause.as_str(), "engine ejected");
                    self.journal.emit(json!({"event": "engine_ejected", "iid": name, "cause": cause.as_str(), "at": wall}));
                }
                Transition::Readmitted { iid, evidence } => {
                    state.slots[iid].excluded.remove(&Exclusion::Ejected);
                    let name = &self.names[iid];
                    self.metrics
                        .readmissions
                        .get_or_create(&labels(&[("iid", name), ("evidence", evidence)]))
                        .inc();
                    tracing::info!(engine.id = %name, evidence, "engine readmitted");
                    self.journal.emit(json!({"event": "engine_readmitted", "iid": name, "evidence": evidence, "at": wall}));
                }
                Transition::ProbeRequested { iid } => {
                    tracing::info!(engine.id = %self.names[iid], "health verification requested");
                }
            }
        }
        self.recount(state);
    }
}

fn bump(slot: &mut EngineSlot, phase: Phase, up: bool) {
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

/// A resident request on one engine in one phase; decrements on drop (RAII).
pub(crate) struct Resident {
    fleet: Arc<Fleet>,
    iid: usize,
    phase: Phase,
}

impl Drop for Resident {
    fn drop(&mut self) {
        bump(&mut self.fleet.lock().slots[self.iid], self.phase, false);
        // Eager drain progress (DESIGN.md 9.4): only when something is held.
        if self.fleet.held.load(Ordering::Acquire) {
            self.fleet.resident_changed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::ManualClock;

    fn fleet() -> Arc<Fleet> {
        let text = serde_json::json!({
            "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
            "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                        {"iid": "d0", "url": "http://127.0.0.1:2"}],
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
            "recovery": {"eject_after": 1}
        })
        .to_string();
        let cfg = Config::from_json_str(&text, &|_| None).expect("fleet");
        let clock = Arc::new(ManualClock::new(
            narwhal_shared::Clock::now(&narwhal_shared::SystemClock),
            1000.0,
        ));
        let metrics = Arc::new(Metrics::new(1.0, 0.1));
        Arc::new(Fleet::new(
            &cfg,
            clock,
            metrics,
            Journal::disabled("1-deadbeef"),
            Arc::new(Notify::new()),
        ))
    }

    /// The live count read without the lock follows every exclusion change.
    #[test]
    fn the_live_count_follows_ejections_and_holds() {
        let f = fleet();
        assert_eq!(f.live_count(), 2);
        f.observe(0, Observation::LegFailed(FailureClass::Connection));
        assert_eq!(f.live_count(), 1);
        assert_eq!(f.ejected_names(), BTreeSet::from(["p0".to_string()]));
        f.set_held(&BTreeSet::from(["d0".to_string()]));
        assert_eq!(f.live_count(), 0);
        f.set_held(&BTreeSet::new());
        f.verified(0);
        assert_eq!(f.live_count(), 2);
        assert_eq!(f.live_names().len(), 2);
    }

    /// Resident guards count both phases, and a change while an engine is held wakes the
    /// lifecycle (eager drain progress).
    #[tokio::test]
    async fn a_resident_change_under_a_hold_notifies_the_lifecycle() {
        let f = fleet();
        let a = f.resident(1, Phase::Decode);
        let b = f.resident(1, Phase::Prefill);
        assert_eq!(f.resident_counts()["d0"], 2);
        drop(a);
        f.set_held(&BTreeSet::from(["d0".to_string()]));
        drop(b);
        assert_eq!(f.resident_counts()["d0"], 0);
        tokio::time::timeout(std::time::Duration::from_secs(1), f.resident_changed())
            .await
            .expect("notified");
    }

    /// A decode stream failure records its producer as a suspect source; verification
    /// clears it.
    #[test]
    fn stream_failures_record_the_producer_until_verified() {
        let f = fleet();
        f.observe_leg_failure(1, Phase::Decode, FailureClass::Stream, Some(0));
        f.read(|s| assert_eq!(s.suspects()[1], BTreeSet::from(["p0".to_string()])));
        f.verified(1);
        f.read(|s| assert!(s.suspects()[1].is_empty()));
    }
}
