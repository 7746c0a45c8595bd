//! Per-engine health and breaker: the health gate, failure streaks, bounded ejection and
//! readmission (behaviour.md 6.2–6.6; architecture.md section 5; docs/deviations.md, "Engine
//! health and the breaker").
//!
//! ```text
//!  leg outcome ─────────────observe(iid, Observation, now, slots)──► Vec<Transition>
//!  probe result (ticket) ───┘                                           │ applied by Fleet:
//!  monitor tick ──due_probes(now, slots)──► [Ticket]                    │ exclusions, metrics,
//!      driver: GET health_path (+ identity, + generation probe) ──► observe(Probe{..})  journal
//! ```
//!
//! Pure: `now` is passed in, nothing here sleeps or does IO. `slots` (the fleet's placement
//! slots) tells the ejection bound each engine's role and whether the lifecycle holds it.
//!
//! # The rules
//!
//! Each engine is in one of three states:
//! - **awaiting health** (at startup): out of placement until its health path answers 200
//!   ([`Transition::Admitted`]). Probed every monitor tick, even while an earlier probe is
//!   still out, so one slow answer does not hold a healthy engine back.
//! - **serving**: in placement. Probed every tick (one probe at a time, liveness).
//! - **ejected**: out of placement until it is readmitted.
//!
//! Failures and their verdicts:
//! - A failed leg adds one to its class's streak; a successful leg resets every streak that
//!   leg exercises ([`Observation::PrefillOk`], [`Observation::DecodeOk`]). At
//!   `recovery.eject_after` consecutive failures of one class the engine is ejected (cause =
//!   the class), **if the ejection bound allows it**.
//! - An engine that says it is busy (429, 503, 408: [`FailureClass::Overload`]) is not charged:
//!   the streak is neither raised nor used to eject.
//! - A liveness probe that times out is a miss; `recovery.liveness_misses` consecutive misses
//!   eject (cause `liveness`), if the bound allows it. One slow probe changes nothing.
//! - A probe answered with another status, or that cannot connect, means the engine is not
//!   there: ejected at once (cause `health_probe`), unbounded; so is an engine whose process
//!   changed ([`Observation::IdentityChanged`], cause `process_identity`). Both are *absences*:
//!   whatever answers next is a new process ([`Transition::NewProcess`]: nothing learned from
//!   the old one is kept).
//!
//! The ejection bound (one policy for overload and the panic threshold, docs/deviations.md):
//! an ejection for failures (a class streak or liveness misses) is admitted only while the
//! engine's role keeps another live engine *and* the role's failure ejections stay within
//! `max(1, ⌊role size × recovery.max_ejection_percent / 100⌋)` (Envoy's
//! `max_ejection_percent`, and its panic threshold for the last engine). A refused ejection
//! leaves the engine in placement flagged *degraded* ([`Breaker::is_degraded`]) until a
//! success resets its streak; the next failure tries again. Absences are not bounded: an
//! engine that is not there cannot serve, and keeping it only turns a 503 into a 502.
//!
//! Readmission of an ejected engine (one path with or without an agent): its health path must
//! answer 200, then the driver either validates it through its agent (lifecycle, evidence
//! `lifecycle`, [`Observation::Verified`]) or runs a generation probe (evidence `generation`).
//! An absent engine is probed every tick (a restart should be back quickly). An engine ejected
//! for failures waits a hold that doubles on every repeat and every failed readmission, from
//! `readmit_every × monitor_interval_s` up to `recovery.max_readmit_interval_s` (Envoy's
//! `base_ejection_time`/`max_ejection_time`); each base interval of service since the last
//! readmission forgives one repeat. An absent engine that answers health but fails its
//! generation probe becomes a failure ejection (cause `inference_probe`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::placement::{EngineSlot, Exclusion};

/// Leg failure classes (behaviour.md 6.2), in the order `/narwhal/state` lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum FailureClass {
    /// Connect error or connection reset before an answer.
    Connection,
    /// A timeout other than a decode read timeout.
    Timeout,
    /// The engine said it is busy: HTTP 408, 429 or 503. Never charged as a failure.
    Overload,
    /// Any other engine error status (including in-stream error frames).
    InferenceStatus,
    /// A 200 prefill answer without a usable KV descriptor / rendezvous.
    KvHandoff,
    /// Decode stream problems: first-token or gap timeout, end without `[DONE]`, `[DONE]`
    /// before any token.
    Stream,
    /// The engine refused the router itself, not the request: HTTP 401 or 403 (its API key,
    /// e.g. vLLM's `--api-key` answering `{"error": "Unauthorized"}`), 404 (a route or the
    /// served model the router was told it has) or 405 (behaviour.md 6.2). Retried elsewhere
    /// and charged to the engine, never passed to the client as its fault.
    EngineConfig,
}

impl FailureClass {
    /// All classes, state order.
    pub(crate) const ALL: [FailureClass; 7] = [
        FailureClass::Connection,
        FailureClass::Timeout,
        FailureClass::Overload,
        FailureClass::InferenceStatus,
        FailureClass::KvHandoff,
        FailureClass::Stream,
        FailureClass::EngineConfig,
    ];

    /// The reference's name.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FailureClass::Connection => "connection",
            FailureClass::Timeout => "timeout",
            FailureClass::Overload => "overload",
            FailureClass::InferenceStatus => "inference_status",
            FailureClass::KvHandoff => "kv_handoff",
            FailureClass::Stream => "stream",
            FailureClass::EngineConfig => "engine_config",
        }
    }

    fn idx(self) -> usize {
        self as usize
    }
}

/// How one `GET <engine><health_path>` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HealthAnswer {
    /// 200.
    Ok,
    /// Another status (a loading engine's 503, a dead vLLM engine's 500, a 404 when the
    /// engine has no such route).
    Unhealthy(u16),
    /// No connection (refused, reset, unreachable): nothing is listening.
    Unreachable,
    /// No answer within `engine.health_timeout_s` (or the connect timeout): maybe busy.
    TimedOut,
}

impl HealthAnswer {
    /// Metric outcome label: `passed`, `failed` or `timeout`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            HealthAnswer::Ok => "passed",
            HealthAnswer::Unhealthy(_) | HealthAnswer::Unreachable => "failed",
            HealthAnswer::TimedOut => "timeout",
        }
    }
}

/// What a due probe is for (the state the engine was in when it was handed out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum ProbeKind {
    /// Health gate of an engine awaiting its first 200.
    Gate,
    /// Liveness of a serving engine.
    Liveness,
    /// Readmission of an ejected engine: health, then validation or a generation probe.
    Readmission,
}

impl ProbeKind {
    /// Metric `kind` label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ProbeKind::Gate => "gate",
            ProbeKind::Liveness => "liveness",
            ProbeKind::Readmission => "readmission",
        }
    }
}

/// One probe handed to the driver; its result comes back in [`Observation::Probe`]. A result
/// whose engine changed state since the ticket was issued is ignored (stale).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    /// Engine index.
    pub iid: usize,
    /// Per-engine sequence number.
    pub seq: u64,
    /// What it is for.
    pub kind: ProbeKind,
}

/// How a probe ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ProbeResult {
    /// The health answer (gate and liveness probes; a readmission probe whose health step
    /// did not answer 200).
    Health(HealthAnswer),
    /// Readmission: health answered 200 and the generation probe passed or failed.
    Generation {
        /// A token-bearing chunk arrived.
        passed: bool,
    },
    /// Nothing concluded (agent validation busy, or it already decided).
    Inconclusive,
}

/// What the driver observed about one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Observation {
    /// A leg on the engine failed with this class.
    LegFailed(FailureClass),
    /// The engine answered a leg with a client-fault 4xx: it is there and reasoning.
    ClientFault,
    /// A prefill leg succeeded.
    PrefillOk,
    /// A decode leg succeeded.
    DecodeOk,
    /// A probe ended.
    Probe {
        /// The ticket from [`Breaker::due_probes`].
        ticket: Ticket,
        /// Its result.
        result: ProbeResult,
    },
    /// Validation through the agents passed (lifecycle readmission or recovery): the engine
    /// is readmitted (evidence `lifecycle`) or admitted, and what was learned about its
    /// previous process is dropped.
    Verified,
    /// A probe, an agent or a failed rendezvous saw a different process behind the engine's
    /// URL (process start, served models, SGLang bootstrap port).
    IdentityChanged,
}

/// Why an engine was ejected (`narwhal_engine_ejections_total{cause}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum EjectCause {
    /// A class streak reached `recovery.eject_after`.
    Class(FailureClass),
    /// `recovery.liveness_misses` consecutive liveness probes timed out.
    Liveness,
    /// A probe was answered with another status than 200, or could not connect.
    HealthProbe,
    /// An absent engine answered health again but its generation probe failed.
    InferenceProbe,
    /// The engine's process changed behind the router's back.
    ProcessIdentity,
    /// Ejected by the router whose handoff this router applied (`--resume`, takeover).
    Restored,
    /// An engine-side role switch failed (controller.md 9.2).
    RoleSwitch,
    /// Its legs were all silent for a window while a peer of its role answered, and a
    /// one-token probe sent straight to it got no token (behaviour.md 6.9). Unbounded (it
    /// cannot serve, and a peer that can exists), held like a failure ejection, and readmitted
    /// only through validation or a generation probe.
    Stalled,
}

impl EjectCause {
    /// Label value: the class name, `liveness`, `health_probe`, `inference_probe`,
    /// `process_identity` or `handoff`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            EjectCause::Class(c) => c.as_str(),
            EjectCause::Liveness => "liveness",
            EjectCause::HealthProbe => "health_probe",
            EjectCause::InferenceProbe => "inference_probe",
            EjectCause::ProcessIdentity => "process_identity",
            EjectCause::Restored => "handoff",
            EjectCause::RoleSwitch => "role_switch",
            EjectCause::Stalled => "stalled",
        }
    }

    /// An ejection for failures, which the bound limits (class streaks, liveness misses).
    pub(crate) fn bounded(self) -> bool {
        matches!(self, EjectCause::Class(_) | EjectCause::Liveness)
    }

    /// The engine is not there (or is another process): probed every tick, no backoff.
    pub(crate) fn absence(self) -> bool {
        matches!(self, EjectCause::HealthProbe | EjectCause::ProcessIdentity)
    }
}

/// A state change the driver must apply (exclusion set, metrics, journal event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transition {
    /// The engine's health path answered 200: it enters placement (health gate).
    Admitted {
        /// Engine index.
        iid: usize,
    },
    /// Put the engine out of placement.
    Ejected {
        /// Engine index.
        iid: usize,
        /// Cause label.
        cause: EjectCause,
    },
    /// Return the engine to placement.
    Readmitted {
        /// Engine index.
        iid: usize,
        /// `generation` (probe) or `lifecycle` (agent validation).
        evidence: &'static str,
    },
    /// The bound kept a failing engine in placement (flagged degraded).
    Degraded {
        /// Engine index.
        iid: usize,
        /// The ejection that was refused.
        cause: EjectCause,
    },
    /// A new process: forget what was learned from the old one (bootstrap port, process
    /// facts, suspect producers).
    NewProcess {
        /// Engine index.
        iid: usize,
    },
}

/// The breaker's settings (fleet file `recovery` and `controller` sections).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Policy {
    /// `recovery.eject_after`: consecutive failures of one class that eject.
    pub eject_after: u32,
    /// `recovery.liveness_misses`: consecutive liveness timeouts that eject.
    pub liveness_misses: u32,
    /// First hold of a failure ejection: `readmit_every × monitor_interval_s`.
    pub readmit_base: Duration,
    /// Longest hold: `recovery.max_readmit_interval_s`.
    pub readmit_cap: Duration,
    /// `recovery.max_ejection_percent` (1..=100).
    pub max_ejection_percent: u32,
}

/// Gate probes of one engine allowed out at once.
const MAX_GATE_PROBES: u32 = 8;

/// The public view of one engine's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// No health 200 yet.
    AwaitingHealth,
    /// In placement.
    Serving,
    /// Out of placement since `at`, for `cause`; next readmission probe at `next_probe`.
    Ejected {
        /// Why.
        cause: EjectCause,
        /// When.
        at: Instant,
        /// Current hold (zero for an absence).
        hold: Duration,
        /// When the next readmission probe is due.
        next_probe: Instant,
    },
}

#[derive(Debug, Clone)]
struct EngineState {
    status: Status,
    streaks: [u32; 7],
    misses: u32,
    strikes: u32,
    serving_since: Option<Instant>,
    incarnation: u64,
    next_seq: u64,
    valid_from: u64,
    outstanding: u32,
    answered: bool,
}

impl EngineState {
    fn new() -> Self {
        EngineState {
            status: Status::AwaitingHealth,
            streaks: [0; 7],
            misses: 0,
            strikes: 0,
            serving_since: None,
            incarnation: 0,
            next_seq: 0,
            valid_from: 0,
            outstanding: 0,
            answered: false,
        }
    }

    fn clear(&mut self, classes: &[FailureClass]) {
        for c in classes {
            self.streaks[c.idx()] = 0;
        }
    }

    /// Every probe handed out so far is stale from now on.
    fn invalidate(&mut self) {
        self.valid_from = self.next_seq;
    }
}

const PREFILL_CLEARS: [FailureClass; 6] = [
    FailureClass::Connection,
    FailureClass::Timeout,
    FailureClass::Overload,
    FailureClass::InferenceStatus,
    FailureClass::KvHandoff,
    FailureClass::EngineConfig,
];
const DECODE_CLEARS: [FailureClass; 6] = [
    FailureClass::Connection,
    FailureClass::Timeout,
    FailureClass::Overload,
    FailureClass::InferenceStatus,
    FailureClass::Stream,
    FailureClass::EngineConfig,
];

/// Breaker for every engine of the fleet (indexed like the fleet config).
#[derive(Debug, Clone)]
pub(crate) struct Breaker {
    policy: Policy,
    engines: Vec<EngineState>,
    ejections: BTreeMap<(usize, EjectCause), u64>,
    readmissions: BTreeMap<(usize, &'static str), u64>,
}

impl Breaker {
    /// A breaker for `engines` engines, every one awaiting its first health 200.
    pub(crate) fn new(engines: usize, policy: Policy) -> Self {
        let policy = Policy {
            eject_after: policy.eject_after.max(1),
            liveness_misses: policy.liveness_misses.max(1),
            readmit_cap: policy.readmit_cap.max(policy.readmit_base),
            max_ejection_percent: policy.max_ejection_percent.clamp(1, 100),
            ..policy
        };
        Breaker {
            policy,
            engines: vec![EngineState::new(); engines],
            ejections: BTreeMap::new(),
            readmissions: BTreeMap::new(),
        }
    }

    #[cfg(test)]
    /// The engine's state.
    pub(crate) fn status(&self, iid: usize) -> Status {
        self.engines[iid].status
    }

    /// Is the engine ejected?
    pub(crate) fn is_ejected(&self, iid: usize) -> bool {
        matches!(self.engines[iid].status, Status::Ejected { .. })
    }

    /// Serving while a streak (or the liveness misses) is at its ejection threshold: the
    /// bound kept it in placement.
    pub(crate) fn is_degraded(&self, iid: usize) -> bool {
        let e = &self.engines[iid];
        e.status == Status::Serving
            && (e.streaks.iter().any(|s| *s >= self.policy.eject_after)
                || e.misses >= self.policy.liveness_misses)
    }

    /// Current consecutive-failure count of `class` on the engine.
    pub(crate) fn streak(&self, iid: usize, class: FailureClass) -> u32 {
        self.engines[iid].streaks[class.idx()]
    }

    /// Consecutive liveness probes that timed out.
    pub(crate) fn misses(&self, iid: usize) -> u32 {
        self.engines[iid].misses
    }

    /// How many processes the engine has had since the router started (bumped by every
    /// [`Transition::NewProcess`]).
    pub(crate) fn incarnation(&self, iid: usize) -> u64 {
        self.engines[iid].incarnation
    }

    /// Whether a gate probe of this engine was answered (any answer but a timeout) or it
    /// left the gate: the router's startup waits for every engine to be settled.
    pub(crate) fn settled(&self, iid: usize) -> bool {
        let e = &self.engines[iid];
        e.status != Status::AwaitingHealth || e.answered
    }

    /// Ejections so far by (engine, cause).
    pub(crate) fn ejections(&self) -> &BTreeMap<(usize, EjectCause), u64> {
        &self.ejections
    }

    /// Readmissions so far by (engine, evidence).
    pub(crate) fn readmissions(&self) -> &BTreeMap<(usize, &'static str), u64> {
        &self.readmissions
    }

    /// Feed one observation; returns the transitions it caused.
    pub(crate) fn observe(
        &mut self,
        iid: usize,
        obs: Observation,
        now: Instant,
        slots: &[EngineSlot],
    ) -> Vec<Transition> {
        let mut out = Vec::new();
        match obs {
            Observation::LegFailed(class) => self.leg_failed(iid, class, now, slots, &mut out),
            Observation::ClientFault => {
                // It judged the request, so it let the router in.
                self.engines[iid].clear(&[
                    FailureClass::Connection,
                    FailureClass::InferenceStatus,
                    FailureClass::EngineConfig,
                ]);
            }
            Observation::PrefillOk => self.engines[iid].clear(&PREFILL_CLEARS),
            Observation::DecodeOk => self.engines[iid].clear(&DECODE_CLEARS),
            Observation::Probe { ticket, result } => {
                self.probe_result(ticket, result, now, slots, &mut out);
            }
            Observation::Verified => {
                self.engines[iid].clear(&[
                    FailureClass::Connection,
                    FailureClass::InferenceStatus,
                    FailureClass::KvHandoff,
                    FailureClass::Stream,
                    FailureClass::EngineConfig,
                ]);
                match self.engines[iid].status {
                    Status::Ejected { .. } => self.readmit(iid, "lifecycle", now, &mut out),
                    Status::AwaitingHealth => {
                        self.serve(iid, now);
                        out.push(Transition::Admitted { iid });
                    }
                    Status::Serving => {}
                }
                self.new_process(iid, &mut out);
            }
            Observation::IdentityChanged => match self.engines[iid].status {
                Status::Ejected { .. } => self.new_process(iid, &mut out),
                _ => self.eject(iid, EjectCause::ProcessIdentity, now, &mut out),
            },
        }
        out
    }

    fn leg_failed(
        &mut self,
        iid: usize,
        class: FailureClass,
        now: Instant,
        slots: &[EngineSlot],
        out: &mut Vec<Transition>,
    ) {
        let e = &mut self.engines[iid];
        if e.status != Status::Serving {
            return;
        }
        if class == FailureClass::Overload {
            // It answered: the connection is fine; busy is not a failure.
            e.clear(&[FailureClass::Connection]);
            return;
        }
        e.streaks[class.idx()] += 1;
        let streak = e.streaks[class.idx()];
        if streak >= self.policy.eject_after {
            self.bounded_eject(iid, EjectCause::Class(class), streak, now, slots, out);
        }
    }

    /// Ejects for failures if the bound allows it, else flags the engine degraded (once per
    /// streak, when it first reaches the threshold).
    fn bounded_eject(
        &mut self,
        iid: usize,
        cause: EjectCause,
        count: u32,
        now: Instant,
        slots: &[EngineSlot],
        out: &mut Vec<Transition>,
    ) {
        if self.may_eject(iid, slots) {
            self.eject(iid, cause, now, out);
        } else {
            let threshold = match cause {
                EjectCause::Liveness => self.policy.liveness_misses,
                _ => self.policy.eject_after,
            };
            if count == threshold {
                out.push(Transition::Degraded { iid, cause });
            }
        }
    }

    /// The ejection bound (module doc).
    pub(crate) fn may_eject(&self, iid: usize, slots: &[EngineSlot]) -> bool {
        let Some(role) = slots.get(iid).map(|s| s.role) else {
            return false;
        };
        let members: Vec<usize> = (0..self.engines.len().min(slots.len()))
            .filter(|j| slots[*j].role == role)
            .collect();
        let live_others = members
            .iter()
            .filter(|j| {
                **j != iid && self.engines[**j].status == Status::Serving && !held(&slots[**j])
            })
            .count();
        if live_others == 0 {
            return false;
        }
        let failed = members
            .iter()
            .filter(|j| {
                matches!(self.engines[**j].status, Status::Ejected { cause, .. } if cause.bounded())
            })
            .count();
        let cap = (members.len() * self.policy.max_ejection_percent as usize / 100).max(1);
        failed < cap
    }

    fn probe_result(
        &mut self,
        ticket: Ticket,
        result: ProbeResult,
        now: Instant,
        slots: &[EngineSlot],
        out: &mut Vec<Transition>,
    ) {
        let iid = ticket.iid;
        let e = &mut self.engines[iid];
        e.outstanding = e.outstanding.saturating_sub(1);
        if ticket.seq < e.valid_from {
            return; // the engine changed state since this probe left
        }
        match (e.status, ticket.kind, result) {
            (Status::AwaitingHealth, ProbeKind::Gate, ProbeResult::Health(a)) => {
                if a != HealthAnswer::TimedOut {
                    e.answered = true;
                }
                if a == HealthAnswer::Ok {
                    self.serve(iid, now);
                    out.push(Transition::Admitted { iid });
                }
            }
            (Status::Serving, ProbeKind::Liveness, ProbeResult::Health(a)) => match a {
                HealthAnswer::Ok => {
                    e.misses = 0;
                    e.clear(&[FailureClass::Connection, FailureClass::Timeout]);
                }
                HealthAnswer::TimedOut => {
                    e.misses += 1;
                    let misses = e.misses;
                    if misses >= self.policy.liveness_misses {
                        self.bounded_eject(iid, EjectCause::Liveness, misses, now, slots, out);
                    }
                }
                HealthAnswer::Unhealthy(_) | HealthAnswer::Unreachable => {
                    self.eject(iid, EjectCause::HealthProbe, now, out);
                }
            },
            (
                Status::Ejected {
                    cause, at, hold, ..
                },
                ProbeKind::Readmission,
                result,
            ) => {
                let again = |hold: Duration, next_probe: Instant| Status::Ejected {
                    cause,
                    at,
                    hold,
                    next_probe,
                };
                match result {
                    ProbeResult::Generation { passed: true } => {
                        self.readmit(iid, "generation", now, out);
                    }
                    ProbeResult::Generation { passed: false } if cause.absence() => {
                        // It is back but cannot generate: a failure ejection from now on.
                        self.eject(iid, EjectCause::InferenceProbe, now, out);
                    }
                    ProbeResult::Generation { passed: false } | ProbeResult::Health(_)
                        if !cause.absence() =>
                    {
                        let hold = (hold * 2).min(self.policy.readmit_cap);
                        e.status = again(hold, now + hold);
                    }
                    // An absent engine still away, or nothing concluded: next tick.
                    _ => e.status = again(hold, now),
                }
            }
            _ => {} // a result for a state the engine has left
        }
    }

    fn serve(&mut self, iid: usize, now: Instant) {
        let e = &mut self.engines[iid];
        e.status = Status::Serving;
        e.streaks = [0; 7];
        e.misses = 0;
        e.serving_since = Some(now);
        e.invalidate();
    }

    fn readmit(
        &mut self,
        iid: usize,
        evidence: &'static str,
        now: Instant,
        out: &mut Vec<Transition>,
    ) {
        self.serve(iid, now);
        *self.readmissions.entry((iid, evidence)).or_default() += 1;
        out.push(Transition::Readmitted { iid, evidence });
    }

    fn new_process(&mut self, iid: usize, out: &mut Vec<Transition>) {
        let e = &mut self.engines[iid];
        e.incarnation += 1;
        e.streaks = [0; 7];
        e.misses = 0;
        out.push(Transition::NewProcess { iid });
    }

    fn eject(&mut self, iid: usize, cause: EjectCause, now: Instant, out: &mut Vec<Transition>) {
        let base = self.policy.readmit_base;
        let cap = self.policy.readmit_cap;
        let e = &mut self.engines[iid];
        let hold = if cause.absence() {
            Duration::ZERO
        } else if cause == EjectCause::Restored {
            base
        } else {
            // Each base interval of service since the last readmission forgives one repeat.
            let served = e.serving_since.map_or(0, |t| {
                let s = now.saturating_duration_since(t).as_secs_f64();
                (s / base.as_secs_f64().max(1e-9)) as u32
            });
            e.strikes = e.strikes.saturating_sub(served) + 1;
            let factor = 2u32.saturating_pow(e.strikes - 1);
            base.saturating_mul(factor).min(cap)
        };
        e.status = Status::Ejected {
            cause,
            at: now,
            hold,
            next_probe: now + hold,
        };
        e.serving_since = None;
        e.invalidate();
        *self.ejections.entry((iid, cause)).or_default() += 1;
        out.push(Transition::Ejected { iid, cause });
        if cause.absence() {
            self.new_process(iid, out);
        }
    }

    /// Probes the monitor should run now (module doc): every engine awaiting health, every
    /// serving engine without a probe out, every ejected engine whose next probe is due. The
    /// health of engines the lifecycle holds (draining, validating) is left to it (a planned
    /// restart is not an absence); an ejected engine is probed even when held, so a failed
    /// recovery validation is retried (docs/deviations.md).
    pub(crate) fn due_probes(&mut self, now: Instant, slots: &[EngineSlot]) -> Vec<Ticket> {
        let mut out = Vec::new();
        for (iid, e) in self.engines.iter_mut().enumerate() {
            let held = slots.get(iid).is_some_and(held);
            let kind = match e.status {
                Status::AwaitingHealth if !held && e.outstanding < MAX_GATE_PROBES => {
                    ProbeKind::Gate
                }
                Status::Serving if !held && e.outstanding == 0 => ProbeKind::Liveness,
                Status::Ejected { next_probe, .. } if e.outstanding == 0 && now >= next_probe => {
                    ProbeKind::Readmission
                }
                _ => continue,
            };
            let seq = e.next_seq;
            e.next_seq += 1;
            e.outstanding += 1;
            out.push(Ticket { iid, seq, kind });
        }
        out
    }

    /// Ejects the engine now for an unbounded `cause` (process identity changed, a restored
    /// handoff) unless it already is ejected.
    pub(crate) fn eject_now(
        &mut self,
        iid: usize,
        cause: EjectCause,
        now: Instant,
    ) -> Vec<Transition> {
        let mut out = Vec::new();
        if !self.is_ejected(iid) {
            self.eject(iid, cause, now, &mut out);
        }
        out
    }
}

/// The lifecycle (or anything else but the breaker) holds the engine out of placement.
fn held(slot: &EngineSlot) -> bool {
    slot.excluded
        .iter()
        .any(|x| !matches!(x, Exclusion::Ejected | Exclusion::AwaitingHealth))
}

#[cfg(test)]
mod tests;
