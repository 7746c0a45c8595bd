//! The fleet: every engine's placement slot (role, exclusions, resident requests), the
//! breaker, suspect producers and SGLang bootstrap ports, behind one lock only this module
//! takes (behaviour.md 6.1–6.4, 7.1; architecture.md section 5).
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

use crate::journal::Event;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use narwhal_shared::Clock;
use tokio::sync::Notify;

use crate::breaker::{
    Breaker, EjectCause, FailureClass, Observation, Policy, ProbeResult, Ticket, Transition,
};
use crate::config::{Config, Role, secs};
use crate::facts::Facts;
use crate::journal::Journal;
use crate::metrics::{Metrics, labels};
use crate::placement::{
    self, Aggregate, EngineSlot, Exclusion, KvScore, LiveLists, Measure, Phase, Plan,
};
use crate::stall::StallWatch;

/// What the fleet lock guards.
pub(crate) struct FleetState {
    slots: Vec<EngineSlot>,
    /// The live engines of each pool, rebuilt from `slots` whenever a role or an exclusion
    /// changes ([`Fleet::recount`]), so a placement does not walk the whole fleet.
    lists: LiveLists,
    /// Bumped with every engine's new process ([`Transition::NewProcess`]): a reader of the
    /// processes ([`Fleet::incarnations_since`]) re-reads them only when it moved.
    process_epoch: u64,
    breaker: Breaker,
    /// Suspect engines: producers whose KV fed this engine's failing decode streams (`""` for
    /// a decode without a producer); verification reruns those paths (handoff
    /// `inference_sources`). Cleared when validation readmits the engine.
    suspects: Vec<BTreeSet<String>>,
    /// What was learned from each engine's current process (process start, models, SGLang
    /// bootstrap port); dropped with the process ([`Transition::NewProcess`]).
    facts: Vec<Facts>,
    /// vLLM `remote_engine_id`s seen in this process's prefill answers.
    engine_ids: Vec<BTreeSet<String>>,
    /// A fresh reading of the engine's facts was asked for (a new engine id, a failed
    /// rendezvous); the monitor reads them with its next liveness probe.
    identity_requested: Vec<bool>,
    /// When the latest reading that confirmed the engine's facts (for a failed decode's
    /// blame) started.
    confirmed: Vec<Option<Instant>>,
    /// Engines new placements avoid while another of their role is available (a donor held
    /// for an engine-side role switch; controller.md 9.2).
    avoided: BTreeSet<usize>,
    /// Legs waiting for their first output, and each engine's latest output: the stall
    /// watch (behaviour.md 6.9, [`crate::stall`]).
    stall: StallWatch,
    /// What placement weighs load by (`serving.placement_load`).
    measure: Measure,
}

impl FleetState {
    /// Placement slots, config order.
    pub(crate) fn slots(&self) -> &[EngineSlot] {
        &self.slots
    }

    /// The breaker (state, streaks, ejection and readmission counts).
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
    settled: Notify,
    blame: Vec<tokio::sync::Mutex<()>>,
    /// Wakes the role controller when an exclusion changed (its prefill-floor edges).
    availability: Notify,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    journal: Journal,
    dirty: Arc<Notify>,
    /// Per engine: bumped when the engine is found stalled, which gives up every leg
    /// waiting on it ([`LegWatch::stalled`]).
    stalled: Vec<tokio::sync::watch::Sender<()>>,
}

/// The breaker settings of a fleet file (`recovery`, `controller.monitor_interval_s`).
pub(crate) fn policy(cfg: &Config) -> Policy {
    Policy {
        eject_after: cfg.recovery.eject_after,
        liveness_misses: cfg.recovery.liveness_misses,
        readmit_base: secs(
            cfg.controller.monitor_interval_s * f64::from(cfg.recovery.readmit_every),
        ),
        readmit_cap: secs(cfg.recovery.max_readmit_interval_s),
        max_ejection_percent: cfg.recovery.max_ejection_percent,
    }
}

impl Fleet {
    /// Every configured engine in its configured role, awaiting its first health answer
    /// (the health gate); the breaker's policy from the fleet file ([`policy`]).
    pub(crate) fn new(
        cfg: &Config,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
        journal: Journal,
        dirty: Arc<Notify>,
    ) -> Fleet {
        let n = cfg.engines.len();
        Fleet {
            names: cfg.engines.iter().map(|e| e.iid.clone()).collect(),
            state: Mutex::new(FleetState {
                slots: cfg
                    .engines
                    .iter()
                    .map(|e| {
                        let mut s = EngineSlot::new(e.role);
                        s.excluded.insert(Exclusion::AwaitingHealth);
                        s
                    })
                    .collect(),
                lists: LiveLists::default(),
                process_epoch: 0,
                breaker: Breaker::new(n, policy(cfg)),
                suspects: vec![BTreeSet::new(); n],
                facts: vec![Facts::default(); n],
                engine_ids: vec![BTreeSet::new(); n],
                identity_requested: vec![false; n],
                confirmed: vec![None; n],
                avoided: BTreeSet::new(),
                stall: StallWatch::new(n, cfg.first_token_timeout()),
                measure: cfg.serving.placement_load,
            }),
            live: AtomicUsize::new(0),
            held: AtomicBool::new(false),
            resident_changed: Notify::new(),
            settled: Notify::new(),
            blame: (0..n).map(|_| tokio::sync::Mutex::new(())).collect(),
            availability: Notify::new(),
            clock,
            metrics,
            journal,
            dirty,
            stalled: (0..n).map(|_| tokio::sync::watch::channel(()).0).collect(),
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

    /// Picks the engines of one attempt (behaviour.md 7.1 steps 1 and 5), avoiding
    /// `avoid`; with `kv`, the prefill (or aggregated) engine by the KV score
    /// (docs/design/kv-aware-placement.md). `None` when no engine can serve.
    pub(crate) fn place(
        &self,
        avoid: &BTreeSet<usize>,
        aggregate: Aggregate,
        kv: Option<&KvScore>,
    ) -> Option<Plan> {
        let state = self.lock();
        let (slots, lists, m) = (&state.slots, &state.lists, state.measure);
        if state.avoided.is_empty() {
            return placement::plan_in(slots, lists, avoid, aggregate, kv, m, &mut rand::rng());
        }
        let avoid: BTreeSet<usize> = avoid.union(&state.avoided).copied().collect();
        placement::plan_in(slots, lists, &avoid, aggregate, kv, m, &mut rand::rng())
    }

    /// The engines a KV score would choose among now, config order
    /// ([`LiveLists::choices`]).
    pub(crate) fn choices(&self, aggregate: Aggregate) -> Vec<usize> {
        self.lock().lists.choices(aggregate).to_vec()
    }

    /// Gives engine `iid` router role `role` (a role flip; the role controller decides).
    /// Residents stay where they are; new placements follow the new role.
    pub(crate) fn set_role(&self, iid: usize, role: Role) {
        let mut state = self.lock();
        if state.slots[iid].role != role {
            state.slots[iid].role = role;
            self.recount(&mut state);
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
        self.recount(&mut state);
    }

    /// The engines new placements avoid while others of their role are available.
    pub(crate) fn set_avoided(&self, avoided: BTreeSet<usize>) {
        self.lock().avoided = avoided;
    }

    /// Counts a request resident on `iid` in `phase`, holding `tokens` of its KV there
    /// ([`EngineSlot::kv_tokens`]), until the guard drops.
    pub(crate) fn resident(self: &Arc<Self>, iid: usize, phase: Phase, tokens: u64) -> Resident {
        bump(&mut self.lock().slots[iid], phase, tokens, true);
        Resident {
            fleet: self.clone(),
            iid,
            phase,
            tokens,
        }
    }

    /// Resolves after a resident count changed while some engine is held by the lifecycle
    /// (eager drain progress, architecture.md 9.4).
    pub(crate) async fn resident_changed(&self) {
        self.resident_changed.notified().await;
    }

    /// Engine `iid` reported `reported` requests running or waiting (its `/metrics`): what
    /// exceeds ours resident on it now is foreign load, weighed by placement
    /// ([`EngineSlot::busy`]); `None` (unread) counts none.
    pub(crate) fn set_reported(&self, iid: usize, reported: Option<u64>) {
        let mut state = self.lock();
        let slot = &mut state.slots[iid];
        let ours = u64::from(slot.outstanding());
        slot.foreign = reported.map_or(0, |r| {
            u32::try_from(r.saturating_sub(ours)).unwrap_or(u32::MAX)
        });
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

    /// `(engine, outstanding requests)` of every engine eligible for placement, config order,
    /// read under one lock: what a request's KV score needs, without building name sets (a
    /// per-request cost that grew with the fleet: two sets of every engine's name per request).
    pub(crate) fn live_loads(&self) -> Vec<(usize, u32)> {
        let state = self.lock();
        state
            .lists
            .live
            .iter()
            .map(|i| (*i, state.slots[*i].outstanding()))
            .collect()
    }

    /// The epoch of the engines' processes (bumped with each engine's new process) and, when
    /// it is not `seen`, every engine's incarnation (config order), read under one lock: a
    /// per-request reader binds its state to the processes only after one changed, instead of
    /// walking the fleet every time.
    pub(crate) fn incarnations_since(&self, seen: Option<u64>) -> (u64, Option<Vec<u64>>) {
        let state = self.lock();
        let epoch = state.process_epoch;
        if seen == Some(epoch) {
            return (epoch, None);
        }
        let all = (0..self.names.len())
            .map(|i| state.breaker.incarnation(i))
            .collect();
        (epoch, Some(all))
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
        self.recount(&mut state);
        self.held.store(!held.is_empty(), Ordering::Release);
    }

    /// Feeds one breaker observation and applies its transitions.
    pub(crate) fn observe(&self, iid: usize, obs: Observation) {
        let now = self.clock.now();
        let mut state = self.lock();
        self.observe_locked(&mut state, iid, obs, now);
    }

    fn observe_locked(&self, state: &mut FleetState, iid: usize, obs: Observation, now: Instant) {
        let FleetState { slots, breaker, .. } = state;
        let tr = breaker.observe(iid, obs, now, slots);
        self.apply(state, &tr);
    }

    /// A leg failed with `class`: stream-class failures of a decode leg also record the
    /// producer that fed it (`producer`: the prefill engine, `None` when the decode ran
    /// alone), so verification can rerun that path (behaviour.md 6.2, 6.8).
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
        // The lifecycle read the bootstrap port of the validated process just before.
        let port = state.facts[iid].bootstrap_port;
        self.observe_locked(&mut state, iid, Observation::Verified, now);
        state.facts[iid].bootstrap_port = port;
    }

    /// A probe, an agent or a failed rendezvous saw another process behind `iid`'s URL
    /// (`reason` says what changed): a new engine, out of placement until re-validated.
    pub(crate) fn identity_changed(&self, iid: usize, reason: &str) {
        let now = self.clock.now();
        let wall = self.clock.wall().unwrap_or(0.0);
        tracing::warn!(engine.id = %self.names[iid], %reason, "engine identity changed");
        self.journal.emit(Event::EngineIdentityChanged {
            iid: self.names[iid].clone(),
            reason: reason.to_string(),
            at: wall,
        });
        let mut state = self.lock();
        self.observe_locked(&mut state, iid, Observation::IdentityChanged, now);
    }

    /// Records a reading of `iid`'s facts: when a fact known before differs, the engine is
    /// a new process ([`Fleet::identity_changed`]) and the reading becomes its facts; else
    /// the reading refreshes them. Returns the reason of a change.
    pub(crate) fn learn(&self, iid: usize, reading: Facts) -> Option<String> {
        let reason = {
            let mut state = self.lock();
            state.identity_requested[iid] = false;
            match state.facts[iid].differs(&reading) {
                None => {
                    state.facts[iid].merge(reading);
                    return None;
                }
                Some(reason) => reason,
            }
        };
        self.identity_changed(iid, &reason);
        self.lock().facts[iid] = reading;
        Some(reason)
    }

    /// Serialises the blame checks of producer `iid` (`bootstrap::blame_producer`), so a burst
    /// of failed decodes reads its facts once.
    pub(crate) async fn blame_turn(&self, iid: usize) -> tokio::sync::MutexGuard<'_, ()> {
        self.blame[iid].lock().await
    }

    /// A reading that started at `started` confirmed `iid`'s facts.
    pub(crate) fn confirm(&self, iid: usize, started: Instant) {
        let mut state = self.lock();
        if state.confirmed[iid].is_none_or(|t| t < started) {
            state.confirmed[iid] = Some(started);
        }
    }

    /// Whether a reading that started at or after `since` confirmed `iid`'s facts: a decode
    /// that failed at `since` is then charged without reading them again.
    pub(crate) fn confirmed_since(&self, iid: usize, since: Instant) -> bool {
        self.lock().confirmed[iid].is_some_and(|t| t >= since)
    }

    /// The monotonic clock's now (for the blame checks' timestamps).
    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Forgets every engine's facts (cached bootstrap ports included), to be learned afresh
    /// as the new baseline: a router that (re)gains control of the fleet may hold facts from
    /// before restarts another router drove through its lifecycle.
    pub(crate) fn relearn_all(&self) {
        let mut state = self.lock();
        let n = self.names.len();
        state.facts = vec![Facts::default(); n];
        state.engine_ids = vec![BTreeSet::new(); n];
        state.confirmed = vec![None; n];
    }

    /// A prefill answer of `iid` named vLLM engine id `id`: an id this process has not shown
    /// before asks for a fresh reading of its facts (module `facts`).
    pub(crate) fn note_engine_id(&self, iid: usize, id: &str) {
        let mut state = self.lock();
        let ids = &mut state.engine_ids[iid];
        if ids.contains(id) {
            return;
        }
        let known = !ids.is_empty();
        ids.insert(id.to_string());
        if known {
            state.identity_requested[iid] = true;
        }
    }

    /// Whether a fresh reading of `iid`'s facts was asked for.
    pub(crate) fn identity_requested(&self, iid: usize) -> bool {
        self.lock().identity_requested[iid]
    }

    /// `iid`'s process start (`process_start_time_seconds`, Unix seconds) as its facts last
    /// told it; `None` when not read yet.
    pub(crate) fn process_start(&self, iid: usize) -> Option<f64> {
        self.lock().facts.get(iid).and_then(|f| f.process_start)
    }

    /// How many processes `iid` has had (a decode that fails after its producer's process
    /// changed is charged to that old process, not to the decode).
    pub(crate) fn incarnation(&self, iid: usize) -> u64 {
        self.lock().breaker.incarnation(iid)
    }

    /// Breaker probes due now (behaviour.md 6.4; module `breaker`).
    pub(crate) fn due_probes(&self) -> Vec<Ticket> {
        let now = self.clock.now();
        let mut state = self.lock();
        let FleetState { slots, breaker, .. } = &mut *state;
        breaker.due_probes(now, slots)
    }

    /// A probe ended.
    pub(crate) fn probe_result(&self, ticket: Ticket, result: ProbeResult) {
        self.observe(ticket.iid, Observation::Probe { ticket, result });
        self.settled.notify_waiters();
    }

    /// Waits until every engine is settled (out of the health gate, or its gate probe was
    /// answered) or `deadline` passes: the router announces itself after this at startup.
    pub(crate) async fn wait_settled(&self, deadline: Instant) {
        loop {
            let notified = self.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let all = {
                let state = self.lock();
                (0..self.names.len()).all(|i| state.breaker.settled(i))
            };
            if all {
                return;
            }
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(deadline.into()) => return,
            }
        }
    }

    /// Applies a restored handoff's fleet part (behaviour.md 2.7): roles of unpinned
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
        self.recount(&mut state);
    }

    /// The cached SGLang bootstrap port of prefill engine `iid`.
    pub(crate) fn bootstrap_port(&self, iid: usize) -> Option<u16> {
        self.lock().facts[iid].bootstrap_port
    }

    /// Caches the SGLang bootstrap port of prefill engine `iid`.
    pub(crate) fn set_bootstrap_port(&self, iid: usize, port: u16) {
        self.lock().facts[iid].bootstrap_port = Some(port);
    }

    /// After a role or an exclusion changed: rebuilds the live lists and the live count (and
    /// wakes the role controller when the count moved).
    fn recount(&self, state: &mut FleetState) {
        state.lists = LiveLists::of(&state.slots);
        let live = state.lists.live.len();
        if self.live.swap(live, Ordering::AcqRel) != live {
            self.availability.notify_one();
        }
    }

    /// Resolves after the live engine count changed (the role controller's floor edges).
    pub(crate) async fn availability_changed(&self) {
        self.availability.notified().await;
    }

    /// Applies breaker transitions: exclusion set, metrics, journal events, logs; a change of
    /// placement or of what was learned marks the state dirty for the state-file writer.
    fn apply(&self, state: &mut FleetState, transitions: &[Transition]) {
        if transitions.is_empty() {
            return;
        }
        self.dirty.notify_one();
        let wall = self.clock.wall().unwrap_or(0.0);
        for t in transitions {
            match *t {
                Transition::Admitted { iid } => {
                    state.slots[iid].excluded.remove(&Exclusion::AwaitingHealth);
                    tracing::info!(engine.id = %self.names[iid], "engine admitted: health answered 200");
                    self.journal.emit(Event::EngineAdmitted {
                        iid: self.names[iid].clone(),
                        at: wall,
                    });
                }
                Transition::Ejected { iid, cause } => {
                    let slot = &mut state.slots[iid];
                    slot.excluded.insert(Exclusion::Ejected);
                    slot.excluded.remove(&Exclusion::AwaitingHealth);
                    let name = &self.names[iid];
                    self.metrics
                        .engines
                        .ejections
                        .get_or_create(&labels(&[("iid", name), ("cause", cause.as_str())]))
                        .inc();
                    tracing::info!(engine.id = %name, cause = cause.as_str(), "engine ejected");
                    self.journal.emit(Event::EngineEjected {
                        iid: name.clone(),
                        cause: cause.as_str(),
                        at: wall,
                    });
                }
                Transition::Readmitted { iid, evidence } => {
                    let slot = &mut state.slots[iid];
                    slot.excluded.remove(&Exclusion::Ejected);
                    slot.excluded.remove(&Exclusion::AwaitingHealth);
                    let name = &self.names[iid];
                    self.metrics
                        .engines
                        .readmissions
                        .get_or_create(&labels(&[("iid", name), ("evidence", evidence)]))
                        .inc();
                    tracing::info!(engine.id = %name, evidence, "engine readmitted");
                    self.journal.emit(Event::EngineReadmitted {
                        iid: name.clone(),
                        evidence,
                        at: wall,
                    });
                }
                Transition::Degraded { iid, cause } => {
                    let name = &self.names[iid];
                    tracing::warn!(engine.id = %name, cause = cause.as_str(), "engine kept in placement, degraded: ejecting it would exceed the ejection bound of its role");
                    self.journal.emit(Event::EngineDegraded {
                        iid: name.clone(),
                        cause: cause.as_str(),
                        at: wall,
                    });
                }
                Transition::NewProcess { iid } => {
                    state.process_epoch += 1;
                    state.facts[iid] = Facts::default();
                    state.confirmed[iid] = None;
                    state.engine_ids[iid].clear();
                    state.identity_requested[iid] = false;
                    state.suspects[iid].clear();
                    // Paths from its old process are no reason to suspect anyone now.
                    for s in &mut state.suspects {
                        s.remove(&self.names[iid]);
                    }
                }
            }
        }
        self.recount(state);
    }
}

#[cfg(test)]
impl Fleet {
    /// Every engine awaiting health passes its gate probe (unit tests).
    pub(crate) fn admit_all(&self) {
        for t in self.due_probes() {
            self.probe_result(t, ProbeResult::Health(crate::breaker::HealthAnswer::Ok));
        }
    }
}

fn bump(slot: &mut EngineSlot, phase: Phase, tokens: u64, up: bool) {
    let c = match phase {
        Phase::Prefill => &mut slot.resident_prefill,
        Phase::Decode => &mut slot.resident_decode,
    };
    if up {
        *c += 1;
        slot.kv_tokens = slot.kv_tokens.saturating_add(tokens);
    } else {
        *c = c.saturating_sub(1);
        slot.kv_tokens = slot.kv_tokens.saturating_sub(tokens);
    }
}

/// The stall watch's side of the fleet (behaviour.md 6.9): legs register here, the monitor
/// asks for suspects and reports its probes.
impl Fleet {
    /// Registers a leg dispatched to `iid` now, waiting for its first output, until the guard
    /// is answered or dropped.
    pub(crate) fn watch_leg(self: &Arc<Self>, iid: usize) -> LegWatch {
        let now = self.clock.now();
        let token = self.lock().stall.begin(iid, now);
        LegWatch {
            fleet: self.clone(),
            iid,
            token,
            stalled: self.stalled[iid].subscribe(),
            done: false,
        }
    }

    /// Engines to probe for a stall now (each marked until its probe is reported): live
    /// engines silent for a window while a live peer of their role answered
    /// ([`StallWatch::suspects`]).
    pub(crate) fn stall_suspects(&self) -> Vec<usize> {
        let now = self.clock.now();
        let mut state = self.lock();
        let FleetState { slots, stall, .. } = &mut *state;
        stall.suspects(now, |i| {
            slots[i].is_live().then_some(match slots[i].role {
                Role::Prefill => 0,
                Role::Decode => 1,
            })
        })
    }

    /// The stall probe of `iid` ended: `Some(true)` it got its token (the engine answers),
    /// `Some(false)` it got none within the window, `None` nothing was learned (the router
    /// could not send it, or it no longer controls the fleet). A failed probe ejects the
    /// engine (cause `stalled`, unbounded: it cannot serve, and a peer of its role just
    /// answered) and gives up every leg waiting on it, so their requests are retried
    /// elsewhere ([`crate::upstream::LegError::Stalled`]).
    pub(crate) fn stall_probed(&self, iid: usize, answered: Option<bool>) {
        let now = self.clock.now();
        let mut state = self.lock();
        match answered {
            Some(true) => state.stall.probe_passed(iid, now),
            Some(false) => {
                state.stall.probe_ended(iid);
                let tr = state.breaker.eject_now(iid, EjectCause::Stalled, now);
                self.apply(&mut state, &tr);
                drop(state);
                self.stalled[iid].send_replace(());
            }
            None => state.stall.probe_ended(iid),
        }
    }
}

/// A leg waiting for its first output on one engine, registered with the stall watch until
/// it is answered or dropped ([`Fleet::watch_leg`]).
pub(crate) struct LegWatch {
    fleet: Arc<Fleet>,
    iid: usize,
    token: u64,
    stalled: tokio::sync::watch::Receiver<()>,
    done: bool,
}

impl LegWatch {
    /// Resolves when the engine is found stalled after this leg was dispatched.
    pub(crate) async fn stalled(&mut self) {
        if self.stalled.changed().await.is_err() {
            // The fleet is gone: never.
            std::future::pending::<()>().await;
        }
    }

    /// The leg got its first output, or any answer from the engine, now.
    pub(crate) fn answered(mut self) {
        let now = self.fleet.clock.now();
        self.fleet.lock().stall.output(self.iid, self.token, now);
        self.done = true;
    }
}

impl Drop for LegWatch {
    fn drop(&mut self) {
        if !self.done {
            self.fleet.lock().stall.abandon(self.iid, self.token);
        }
    }
}

/// A resident request on one engine in one phase; decrements on drop (RAII).
pub(crate) struct Resident {
    fleet: Arc<Fleet>,
    iid: usize,
    phase: Phase,
    tokens: u64,
}

impl Drop for Resident {
    fn drop(&mut self) {
        bump(
            &mut self.fleet.lock().slots[self.iid],
            self.phase,
            self.tokens,
            false,
        );
        // Eager drain progress (architecture.md 9.4): only when something is held.
        if self.fleet.held.load(Ordering::Acquire) {
            self.fleet.resident_changed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::HealthAnswer;
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

    /// The live count read without the lock follows the health gate, every exclusion
    /// change and every hold.
    #[test]
    fn the_live_count_follows_ejections_and_holds() {
        let f = fleet();
        assert_eq!(
            f.live_count(),
            0,
            "nothing is placed before its health answered"
        );
        f.admit_all();
        assert_eq!(f.live_count(), 2);
        f.eject(0, EjectCause::ProcessIdentity);
        assert_eq!(f.live_count(), 1);
        assert_eq!(f.ejected_names(), BTreeSet::from(["p0".to_string()]));
        f.set_held(&BTreeSet::from(["d0".to_string()]));
        assert_eq!(f.live_count(), 0);
        f.set_held(&BTreeSet::new());
        f.verified(0);
        assert_eq!(f.live_count(), 2);
        assert_eq!(f.live_names().len(), 2);
    }

    /// The live loads a KV score reads under one lock are the ones the name sets give:
    /// live engines only, config order, each with its outstanding requests.
    #[test]
    fn live_loads_are_the_live_engines_with_their_outstanding_requests() {
        let f = fleet();
        assert_eq!(
            f.live_loads(),
            [],
            "nothing live before its health answered"
        );
        f.admit_all();
        let _a = f.resident(1, Phase::Decode, 0);
        let _b = f.resident(1, Phase::Prefill, 0);
        let by_names = |f: &Fleet| -> Vec<(usize, u32)> {
            let (live, counts) = (f.live_names(), f.resident_counts());
            (0..f.names().len())
                .filter(|i| live.contains(&f.names()[*i]))
                .map(|i| (i, counts[&f.names()[i]]))
                .collect()
        };
        assert_eq!(f.live_loads(), [(0, 0), (1, 2)]);
        assert_eq!(f.live_loads(), by_names(&f));
        f.eject(0, EjectCause::ProcessIdentity);
        assert_eq!(f.live_loads(), [(1, 2)]);
        assert_eq!(f.live_loads(), by_names(&f));
        let (epoch, all) = f.incarnations_since(None);
        assert_eq!(
            all.as_deref(),
            Some(&[f.incarnation(0), f.incarnation(1)][..])
        );
        assert_eq!(
            f.incarnations_since(Some(epoch)),
            (epoch, None),
            "no new process"
        );
    }

    /// The live lists placement samples from follow every change of a role or an exclusion:
    /// the health gate, an ejection, a hold, a role switch and flip, a restored handoff.
    #[test]
    fn the_live_lists_follow_every_role_and_exclusion_change() {
        let f = fleet();
        let lists = |f: &Fleet| {
            f.read(|s| {
                assert_eq!(s.lists, LiveLists::of(&s.slots), "stale lists");
                (s.lists.prefill.clone(), s.lists.decode.clone())
            })
        };
        assert_eq!(lists(&f), (vec![], vec![]), "both await health");
        f.admit_all();
        assert_eq!(lists(&f), (vec![0], vec![1]));
        f.eject(0, EjectCause::ProcessIdentity);
        assert_eq!(lists(&f), (vec![], vec![1]));
        f.set_held(&BTreeSet::from(["d0".to_string()]));
        assert_eq!(lists(&f), (vec![], vec![]));
        f.set_held(&BTreeSet::new());
        f.set_switching(1, true);
        assert_eq!(lists(&f), (vec![], vec![]));
        f.set_switching(1, false);
        f.set_role(1, Role::Prefill);
        assert_eq!(lists(&f), (vec![1], vec![]));
        f.restore(
            &BTreeMap::from([(1, Role::Decode)]),
            &BTreeSet::new(),
            &BTreeMap::new(),
        );
        assert_eq!(lists(&f), (vec![], vec![1]));
        assert_eq!(f.choices(Aggregate::AnyRole), [1]);
        assert_eq!(
            f.place(&BTreeSet::new(), Aggregate::AnyRole, None),
            Some(Plan::Aggregated { engine: 1 })
        );
    }

    /// Identity (an engine restarted in place): a reading whose known facts differ makes the engine
    /// a new engine: ejected (`process_identity`), its suspects and old facts dropped, the
    /// reading kept as the new process's facts.
    #[test]
    fn a_changed_fact_makes_a_new_engine_and_forgets_the_old_one() {
        let f = fleet();
        f.admit_all();
        let port = |p| Facts {
            bootstrap_port: Some(p),
            ..Facts::default()
        };
        assert_eq!(f.learn(0, port(8998)), None);
        assert_eq!(f.learn(0, Facts::default()), None, "nothing known differs");
        f.observe_leg_failure(1, Phase::Decode, FailureClass::Stream, Some(0));
        f.lock().suspects[0].insert("d1".into());
        assert_eq!(
            f.learn(0, port(9000)).as_deref(),
            Some("bootstrap port 8998 -> 9000")
        );
        assert!(f.is_ejected(0));
        assert_eq!(f.incarnation(0), 1);
        assert_eq!(
            f.incarnations_since(Some(0)),
            (1, Some(vec![1, 0])),
            "a new process moves the epoch"
        );
        assert_eq!(f.bootstrap_port(0), Some(9000));
        f.read(|s| {
            assert!(s.suspects()[0].is_empty(), "its own suspects");
            assert!(s.suspects()[1].is_empty(), "d0 suspected the old p0's path");
        });
    }

    /// A reading that started after a decode failed answers for that failure (one reading
    /// per burst); one that started before does not; a new process forgets them.
    #[test]
    fn a_confirmation_answers_for_failures_before_its_reading_started() {
        let f = fleet();
        f.admit_all();
        let t0 = f.now();
        assert!(!f.confirmed_since(0, t0));
        f.confirm(0, t0);
        assert!(f.confirmed_since(0, t0));
        assert!(!f.confirmed_since(0, t0 + std::time::Duration::from_millis(1)));
        f.eject(0, EjectCause::ProcessIdentity);
        assert!(!f.confirmed_since(0, t0));
    }

    /// A vLLM engine id the process has not shown before asks for a fresh reading (the
    /// first one is simply recorded).
    #[test]
    fn a_new_engine_id_asks_for_a_fresh_reading() {
        let f = fleet();
        f.note_engine_id(0, "gen-A");
        assert!(!f.identity_requested(0));
        f.note_engine_id(0, "gen-A");
        assert!(!f.identity_requested(0));
        f.note_engine_id(0, "gen-B");
        assert!(f.identity_requested(0));
        assert_eq!(f.learn(0, Facts::default()), None);
        assert!(!f.identity_requested(0));
    }

    /// The startup wait ends once every engine's gate probe was answered (a 503 counts),
    /// or at its deadline.
    #[tokio::test(start_paused = true)]
    async fn startup_waits_until_every_engine_is_settled() {
        let f = fleet();
        let now = f.clock.now();
        let ts = f.due_probes();
        f.probe_result(ts[0], ProbeResult::Health(HealthAnswer::Unhealthy(503)));
        let waiter = {
            let f = f.clone();
            tokio::spawn(async move {
                f.wait_settled(now + std::time::Duration::from_secs(3600))
                    .await
            })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        f.probe_result(ts[1], ProbeResult::Health(HealthAnswer::Ok));
        tokio::time::timeout(std::time::Duration::from_secs(1), waiter)
            .await
            .expect("settled")
            .expect("task");
        assert_eq!(f.live_count(), 1);
    }

    /// Resident guards count both phases, and a change while an engine is held wakes the
    /// lifecycle (eager drain progress).
    #[tokio::test]
    async fn a_resident_change_under_a_hold_notifies_the_lifecycle() {
        let f = fleet();
        let a = f.resident(1, Phase::Decode, 0);
        let b = f.resident(1, Phase::Prefill, 0);
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
