//! The engine lifecycle core: drain records, whole-fleet waves, `ready_to_stop`, and the
//! readmission bookkeeping around validation (handoff-and-lifecycle.md, "Lifecycle API",
//! behaviour.md 4.1–4.7, 4.9, 4.11, 4.12; departures in architecture.md section 9).
//!
//! Pure: it never reads a clock, sleeps or touches the network. The driver passes [`Now`] and
//! the resident request counts, performs the process-identity captures and the validation checks
//! the core asks for, and feeds the results back. Every transition appends a lifecycle event
//! that the driver takes with [`Lifecycle::take_events`] for the journal.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use narwhal_shared::documents::lifecycle as doc;
use serde_json::Value;

use super::check::CheckError;
use super::events::{EventKind, LifecycleEvent};
pub use crate::config::RestartPolicy;

/// Largest accepted drain deadline, seconds (one year).
pub const MAX_DEADLINE_S: f64 = 365.0 * 24.0 * 3600.0;

/// How many lifecycle events the document keeps (behaviour.md 4.1).
pub const EVENT_HISTORY: usize = 200;

/// A reading of both clocks, taken once by the driver per operation.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    /// Monotonic time, for drain deadlines.
    pub mono: Instant,
    /// Wall-clock Unix seconds, for persisted and displayed times (`requested_at`, `at`).
    pub wall: f64,
}

impl Now {
    /// Both readings moved forward by `by`.
    pub fn after(self, by: Duration) -> Now {
        Now {
            mono: self.mono + by,
            wall: self.wall + by.as_secs_f64(),
        }
    }
}

pub use narwhal_shared::handoff::{DrainRecord, DrainState};

/// What a record holds (or held) its engine for, and so what readmits it: the combinations of
/// the wire record's `restart_required`, `wave_id` and drain deadline that can occur. Kept
/// after readmission (the document still shows `restart_required`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Hold {
    /// A drain of one engine (`restart_required`, no wave): readmission needs a restarted
    /// process. `deadline` is the monotonic drain deadline (`None` for a restored record
    /// that was no longer draining).
    Drain {
        /// Monotonic drain deadline.
        deadline: Option<Instant>,
    },
    /// A member of the active whole wave (a wave drain, or a restart-required wave):
    /// readmitted only with the whole wave, after a restart. `deadline` as for `Drain`
    /// (`None` for a restart-required wave, which never drained).
    Wave {
        /// Monotonic drain deadline.
        deadline: Option<Instant>,
    },
    /// A breaker-ejected engine validated without a restart (behaviour.md 4.9): no
    /// restart required, never in a wave, never draining.
    Recovery,
}

impl Hold {
    /// Readmission requires a process start newer than the recorded one.
    pub fn restart_required(self) -> bool {
        !matches!(self, Hold::Recovery)
    }

    /// A member of the active wave.
    pub fn in_wave(self) -> bool {
        matches!(self, Hold::Wave { .. })
    }

    /// The monotonic drain deadline, if the hold has one.
    pub fn deadline(self) -> Option<Instant> {
        match self {
            Hold::Drain { deadline } | Hold::Wave { deadline } => deadline,
            Hold::Recovery => None,
        }
    }

    /// The same hold outside the wave (the wave was readmitted).
    fn leave_wave(self) -> Hold {
        match self {
            Hold::Wave { deadline } => Hold::Drain { deadline },
            other => other,
        }
    }
}

/// One engine's lifecycle record as the machine keeps it (behaviour.md 4.1); the wire form
/// is [`DrainRecord`]. Times are wall-clock Unix seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Engine id.
    pub iid: String,
    /// Current state.
    pub state: DrainState,
    /// What the engine is (or was) held for.
    pub hold: Hold,
    /// When the hold started.
    pub requested_at: f64,
    /// Drain deadline; equals `requested_at` for holds without a drain.
    pub deadline_at: f64,
    /// Process start (Unix seconds) of the process the supervisor may stop.
    pub old_process_start: Option<f64>,
    /// Process start accepted at readmission.
    pub new_process_start: Option<f64>,
    /// Last error, `""` when none.
    pub error: String,
    /// Checks passed in the last validation, in the order they ran.
    pub checks: Vec<String>,
}

impl Record {
    /// A fresh hold of `iid` from `now` in `state`, bound to `old_process_start`.
    fn new(
        iid: &str,
        now: Now,
        state: DrainState,
        hold: Hold,
        deadline_at: f64,
        old_process_start: Option<f64>,
        error: &str,
    ) -> Record {
        Record {
            iid: iid.to_string(),
            state,
            hold,
            requested_at: now.wall,
            deadline_at,
            old_process_start,
            new_process_start: None,
            error: error.to_string(),
            checks: Vec::new(),
        }
    }

    /// Readmission requires a process start newer than `old_process_start`.
    pub fn restart_required(&self) -> bool {
        self.hold.restart_required()
    }

    /// A member of the active wave.
    pub fn in_wave(&self) -> bool {
        self.hold.in_wave()
    }

    /// The wire form; `wave_id` is the active wave's id.
    fn to_wire(&self, wave_id: &str) -> DrainRecord {
        DrainRecord {
            iid: self.iid.clone(),
            state: self.state,
            requested_at: self.requested_at,
            deadline_at: self.deadline_at,
            restart_required: self.restart_required(),
            wave_id: if self.in_wave() {
                wave_id.to_string()
            } else {
                String::new()
            },
            old_process_start: self.old_process_start,
            new_process_start: self.new_process_start,
            error: self.error.clone(),
            checks: self.checks.clone(),
        }
    }

    /// The machine's form of a carried record with its re-anchored `deadline`: a record in
    /// the wave is a wave member; outside it, `restart_required` tells a drain from a
    /// recovery. (A carried wave member without `restart_required`, which this router never
    /// writes, comes back restart-required.)
    fn from_wire(r: &DrainRecord, deadline: Option<Instant>) -> Record {
        let hold = if !r.wave_id.is_empty() {
            Hold::Wave { deadline }
        } else if r.restart_required {
            Hold::Drain { deadline }
        } else {
            Hold::Recovery
        };
        Record {
            iid: r.iid.clone(),
            state: r.state,
            hold,
            requested_at: r.requested_at,
            deadline_at: r.deadline_at,
            old_process_start: r.old_process_start,
            new_process_start: r.new_process_start,
            error: r.error.clone(),
            checks: r.checks.clone(),
        }
    }
}

/// A drain request (`POST /narwhal/lifecycle/drain`).
#[derive(Debug, Clone, PartialEq)]
pub struct DrainRequest {
    /// Target engine ids; empty with `wave` means every configured engine.
    pub engines: Vec<String>,
    /// Drain the whole fleet as one wave.
    pub wave: bool,
    /// Seconds until the drain is reported `deadline_exceeded` (default 300).
    pub deadline_s: f64,
    /// The request named `deadline_s` itself: a repeat of an accepted drain that names
    /// another deadline is refused ([`LifecycleError::DeadlineConflict`]); one that names
    /// none repeats it as it is.
    pub deadline_given: bool,
}

/// What the driver must do after an accepted drain.
#[derive(Debug, Clone, PartialEq)]
pub struct DrainPlan {
    /// The drain's targets (sorted).
    pub targets: Vec<String>,
    /// Targets whose process identity must be captured (through their agents) and bound
    /// with [`Lifecycle::bind_identity`].
    pub capture: Vec<String>,
    /// True when the request repeated an accepted drain: nothing changed (architecture.md 9.5).
    pub repeated: bool,
}

/// A rejected lifecycle action: each maps to HTTP 409 with the message as the document's
/// `error` (behaviour.md 4.3, 4.7, 1.10; the wording is the reference's, byte for byte,
/// because supervisors match on it).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LifecycleError {
    /// Non-wave drain under `whole_wave`.
    #[error("engine_restart_policy requires a whole-wave drain")]
    PolicyRequiresWave,
    /// Ids not in the fleet file.
    #[error("unknown engine(s): {}", .0.join(", "))]
    UnknownEngines(Vec<String>),
    /// `deadline_s` not finite or not positive.
    #[error("deadline_s must be positive")]
    BadDeadline,
    /// `deadline_s` over [`MAX_DEADLINE_S`].
    #[error("deadline_s must be at most 31536000 (one year)")]
    DeadlineTooLong,
    /// A repeated drain names another `deadline_s` than the accepted one: refused rather
    /// than silently keeping the old deadline; repeat it without
    /// `deadline_s` or with the same value.
    #[error(
        "a drain of {iid} is already active with deadline_s {deadline_s}; repeat it without deadline_s or with the same value"
    )]
    DeadlineConflict {
        /// The engine whose drain is active.
        iid: String,
        /// Its accepted deadline, seconds.
        deadline_s: f64,
    },
    /// A wave drain that does not name every engine.
    #[error("a whole-wave drain must name every configured engine")]
    WaveMustNameAll,
    /// A non-wave drain of zero or several engines.
    #[error("a non-wave drain must name exactly one engine")]
    NonWaveExactlyOne,
    /// Another lifecycle action holds these engines.
    #[error("lifecycle action already active for {}", .0.join(", "))]
    AlreadyActive(Vec<String>),
    /// Draining this engine would leave nothing to place on.
    #[error("the last schedulable engine requires a whole-wave drain")]
    LastSchedulable,
    /// A wave readmission that does not name exactly the active wave.
    #[error("whole-wave readmission must name the active wave's complete engine set")]
    WaveReadmitSet,
    /// An individual readmission while a wave is active.
    #[error("an active whole wave must be validated and readmitted as one engine set")]
    WaveActive,
    /// An individual readmission of zero or several engines.
    #[error("readmission must name exactly one engine")]
    ReadmitExactlyOne,
    /// A readmission target that is not drained or blocked.
    #[error("{iid} is {state}, expected drained")]
    NotDrained {
        /// The engine.
        iid: String,
        /// Its state's name.
        state: &'static str,
    },
    /// A planned restart without a recorded pre-restart identity.
    #[error("{0} has no recorded pre-restart process identity")]
    NoPreRestartIdentity(String),
    /// A cancel-drain of zero or several engines, or with `wave` (ours; docs/deviations.md).
    #[error(
        "cancel-drain must name exactly one engine (a whole wave is readmitted as one set after a restart)"
    )]
    CancelExactlyOne,
    /// A cancel-drain of an engine no drain holds.
    #[error(
        "{iid} is {state}: only a draining, drained, deadline_exceeded or blocked drain can be cancelled"
    )]
    CancelNotHeld {
        /// The engine.
        iid: String,
        /// Its state's name.
        state: &'static str,
    },
    /// A cancel-drain of a member of the active whole wave.
    #[error(
        "{0} is held by the active whole wave: a wave is readmitted as one set after a restart (readmit with wave: true)"
    )]
    CancelInWave(String),
    /// A cancel-drain of an engine held by a failed breaker recovery, not a drain.
    #[error("{0} is held by a breaker recovery, not a drain: it returns through its recovery")]
    CancelNotADrain(String),
    /// A cancel-drain of a drain that never recorded the process it holds.
    #[error(
        "{0} has no recorded process identity (the drain could not record one): repeat the drain once its agent answers, or restart it and readmit"
    )]
    CancelNoIdentity(String),
}

/// Why a handoff's lifecycle part cannot be restored (nothing changes then).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RestoreError {
    /// The writer ran another `engine_restart_policy`.
    #[error("handoff engine restart policy mismatch")]
    PolicyMismatch,
    /// A record names an engine this fleet does not have.
    #[error("lifecycle.records[{index}].iid: {iid:?} is not a configured engine")]
    UnknownEngine {
        /// The record's index.
        index: usize,
        /// Its engine id.
        iid: String,
    },
}

/// Result of one engine's validation, as the readmission plan reports it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineOutcome {
    /// Checks passed, in order.
    pub checks: Vec<String>,
    /// Failures, in order (empty when every check passed).
    pub failures: Vec<String>,
    /// Process start (Unix seconds) the checks were bound to, when read.
    pub process_start: Option<f64>,
}

/// What the document needs to know about one engine beyond its record.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineView {
    /// Requests of this engine in their prefill leg.
    pub resident_prefill: u32,
    /// Requests of this engine in their decode leg.
    pub resident_decode: u32,
    /// Eligible for new placement (not held, ejected, quarantined).
    pub accepts_new: bool,
}

/// The lifecycle manager for one fleet.
#[derive(Debug, Clone)]
pub struct Lifecycle {
    engines: Vec<String>,
    policy: RestartPolicy,
    records: BTreeMap<String, Record>,
    wave_id: String,
    wave_ready_emitted: bool,
    blocked_reason: String,
    process_starts: BTreeMap<String, f64>,
    /// The event history as the document shows it (restored histories are kept verbatim:
    /// another router, or the reference, wrote them).
    events: VecDeque<Value>,
    /// Events since the last [`Lifecycle::take_events`], for the journal.
    pending: Vec<LifecycleEvent>,
}

/// The record's wave id: the active wave's for a member, `""` otherwise.
fn wave_str<'a>(rec: &Record, active: &'a str) -> &'a str {
    if rec.in_wave() { active } else { "" }
}

/// [`wave_str`], owned, for an event.
fn wave_of(rec: &Record, active: &str) -> String {
    wave_str(rec, active).to_string()
}

impl Lifecycle {
    /// A manager for the configured engines (config order) under `policy`.
    pub fn new(engines: Vec<String>, policy: RestartPolicy) -> Self {
        Self {
            engines,
            policy,
            records: BTreeMap::new(),
            wave_id: String::new(),
            wave_ready_emitted: false,
            blocked_reason: String::new(),
            process_starts: BTreeMap::new(),
            events: VecDeque::new(),
            pending: Vec::new(),
        }
    }

    /// The configured restart policy.
    pub fn policy(&self) -> RestartPolicy {
        self.policy
    }

    /// An engine's state (`Active` without a record).
    pub fn state(&self, iid: &str) -> DrainState {
        self.records
            .get(iid)
            .map_or(DrainState::Active, |r| r.state)
    }

    /// An engine's record, if it has one.
    pub fn record(&self, iid: &str) -> Option<&Record> {
        self.records.get(iid)
    }

    /// Engines held out of placement by the lifecycle (any non-`active` record).
    pub fn held(&self) -> BTreeSet<String> {
        self.records
            .values()
            .filter(|r| r.state != DrainState::Active)
            .map(|r| r.iid.clone())
            .collect()
    }

    /// The active wave id, `""` when none.
    pub fn wave_id(&self) -> &str {
        &self.wave_id
    }

    /// Why router-wide readiness is withdrawn (`whole-wave drain <id>`, ...), `""` when not.
    pub fn blocked_reason(&self) -> &str {
        &self.blocked_reason
    }

    /// Last accepted process start per engine (Unix seconds).
    pub fn process_starts(&self) -> &BTreeMap<String, f64> {
        &self.process_starts
    }

    /// Accepts `start` as the engine's verified process start (identity check at startup).
    pub fn accept_process_start(&mut self, iid: &str, start: f64) {
        self.process_starts.insert(iid.to_string(), start);
    }

    /// The last [`EVENT_HISTORY`] events, oldest first.
    pub fn events(&self) -> impl Iterator<Item = &Value> {
        self.events.iter()
    }

    /// Events emitted since the last call, for the journal.
    pub fn take_events(&mut self) -> Vec<LifecycleEvent> {
        std::mem::take(&mut self.pending)
    }

    /// The earliest monotonic instant at which [`Lifecycle::refresh`] could change a state
    /// without a resident-count change (a drain deadline), for the driver's timer.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.records
            .values()
            .filter(|r| r.state == DrainState::Draining)
            .filter_map(|r| r.hold.deadline())
            .min()
    }

    fn emit(&mut self, now: Now, kind: EventKind) {
        let ev = LifecycleEvent { at: now.wall, kind };
        self.events.push_back(ev.to_json());
        self.pending.push(ev);
        while self.events.len() > EVENT_HISTORY {
            self.events.pop_front();
        }
    }

    fn unknown(&self, ids: &[String]) -> Vec<String> {
        let mut u: Vec<String> = ids
            .iter()
            .filter(|i| !self.engines.contains(i))
            .cloned()
            .collect();
        u.sort();
        u.dedup();
        u
    }

    fn all_sorted(&self) -> Vec<String> {
        let mut v = self.engines.clone();
        v.sort();
        v
    }

    /// Starts a drain (behaviour.md 4.3, rules checked in that order), with
    /// architecture.md 9.5: repeating an accepted drain is not an error.
    ///
    /// `live` is the set of engines currently eligible for placement; `new_wave_id` names the
    /// wave if one starts. Every target leaves placement (is [`Lifecycle::held`]) on return,
    /// before the driver captures identities.
    ///
    /// # Errors
    /// A [`LifecycleError`] (HTTP 409); nothing changes.
    pub fn begin(
        &mut self,
        now: Now,
        req: &DrainRequest,
        live: &BTreeSet<String>,
        new_wave_id: &str,
    ) -> Result<DrainPlan, LifecycleError> {
        if self.policy == RestartPolicy::WholeWave && !req.wave {
            return Err(LifecycleError::PolicyRequiresWave);
        }
        let mut targets: Vec<String> = if !req.engines.is_empty() {
            req.engines.clone()
        } else if req.wave {
            self.all_sorted()
        } else {
            Vec::new()
        };
        targets.sort();
        targets.dedup();
        let unknown = self.unknown(&targets);
        if !unknown.is_empty() {
            return Err(LifecycleError::UnknownEngines(unknown));
        }
        if !req.deadline_s.is_finite() || req.deadline_s <= 0.0 {
            return Err(LifecycleError::BadDeadline);
        }
        // Bounded (a year) so the monotonic deadline can never overflow.
        if req.deadline_s > MAX_DEADLINE_S {
            return Err(LifecycleError::DeadlineTooLong);
        }
        if req.wave {
            if targets != self.all_sorted() {
                return Err(LifecycleError::WaveMustNameAll);
            }
        } else if targets.len() != 1 {
            return Err(LifecycleError::NonWaveExactlyOne);
        }
        let held: Vec<String> = self.held().into_iter().collect();
        if !held.is_empty() {
            let wave_active = !self.wave_id.is_empty();
            let promotion = req.wave && !wave_active && live.is_empty();
            let same_set = targets == held && req.wave == wave_active;
            if same_set && req.deadline_given {
                let other = held.iter().map(|i| &self.records[i]).find(|r| {
                    matches!(
                        r.state,
                        DrainState::Draining | DrainState::Drained | DrainState::DeadlineExceeded
                    ) && ((r.deadline_at - r.requested_at) - req.deadline_s).abs() > 1e-3
                });
                if let Some(r) = other {
                    return Err(LifecycleError::DeadlineConflict {
                        iid: r.iid.clone(),
                        deadline_s: r.deadline_at - r.requested_at,
                    });
                }
            }
            if promotion {
                // Proceed below as a new wave over everything.
            } else if same_set
                && held
                    .iter()
                    .any(|i| self.records[i].old_process_start.is_none())
            {
                let capture = held
                    .iter()
                    .filter(|i| self.records[*i].old_process_start.is_none())
                    .cloned()
                    .collect();
                return Ok(DrainPlan {
                    targets,
                    capture,
                    repeated: false,
                });
            } else if same_set
                && held.iter().all(|i| {
                    matches!(
                        self.records[i].state,
                        DrainState::Draining | DrainState::Drained | DrainState::DeadlineExceeded
                    )
                })
            {
                return Ok(DrainPlan {
                    targets,
                    capture: Vec::new(),
                    repeated: true,
                });
            } else {
                return Err(LifecycleError::AlreadyActive(held));
            }
        }
        if !req.wave && live.iter().all(|i| targets.contains(i)) {
            return Err(LifecycleError::LastSchedulable);
        }
        let wave_id = if req.wave {
            new_wave_id.to_string()
        } else {
            String::new()
        };
        let deadline = now.mono + Duration::from_secs_f64(req.deadline_s);
        for iid in &targets {
            let kept = self
                .records
                .get(iid)
                .filter(|r| r.restart_required() && r.state != DrainState::Active)
                .and_then(|r| r.old_process_start);
            let hold = if req.wave {
                Hold::Wave {
                    deadline: Some(deadline),
                }
            } else {
                Hold::Drain {
                    deadline: Some(deadline),
                }
            };
            let deadline_at = now.wall + req.deadline_s;
            let rec = Record::new(iid, now, DrainState::Draining, hold, deadline_at, kept, "");
            self.records.insert(iid.clone(), rec);
            self.emit(
                now,
                EventKind::DrainStarted {
                    iid: iid.clone(),
                    wave_id: wave_id.clone(),
                },
            );
        }
        if req.wave {
            self.wave_id = wave_id.clone();
            self.wave_ready_emitted = false;
            self.blocked_reason = format!("whole-wave drain {wave_id}");
            self.emit(
                now,
                EventKind::WaveStarted {
                    engines: targets.clone(),
                    wave_id,
                },
            );
        }
        let capture = targets
            .iter()
            .filter(|i| self.records[*i].old_process_start.is_none())
            .cloned()
            .collect();
        Ok(DrainPlan {
            targets,
            capture,
            repeated: false,
        })
    }

    /// Binds a captured process identity to a drain (behaviour.md 4.4).
    ///
    /// `captured` is the process start (Unix seconds) read through the engine's agent, or the
    /// capture error. A failed capture of an engine the breaker has `ejected` falls back to the
    /// last accepted start (a stopped engine stays bound to the process the router verified).
    /// Returns whether an identity is bound; unbound records go `blocked` with the error, and
    /// the same drain request retries the capture.
    pub fn bind_identity(
        &mut self,
        now: Now,
        iid: &str,
        captured: Result<f64, CheckError>,
        ejected: bool,
    ) -> bool {
        let fallback = self.process_starts.get(iid).copied();
        let Some(rec) = self.records.get_mut(iid) else {
            return false;
        };
        let wave_id = wave_of(rec, &self.wave_id);
        let bound = match captured {
            Ok(start) => Ok(start),
            Err(e) => match fallback {
                Some(start) if ejected => Ok(start),
                _ => Err(e.to_string()),
            },
        };
        match bound {
            Ok(start) => {
                rec.old_process_start = Some(start);
                if rec.state == DrainState::Blocked {
                    // The capture error is resolved; a deadline error (the deadline may pass
                    // while the agent is asked) stays with its `deadline_exceeded` state.
                    rec.state = DrainState::Draining;
                    rec.error.clear();
                }
                self.emit(
                    now,
                    EventKind::ProcessRecorded {
                        iid: iid.to_string(),
                        process_start: start,
                        wave_id,
                    },
                );
                true
            }
            Err(e) => {
                let error = if e.is_empty() {
                    "engine process identity could not be recorded".to_string()
                } else {
                    e
                };
                rec.state = DrainState::Blocked;
                rec.error = error.clone();
                self.emit(
                    now,
                    EventKind::DrainBlocked {
                        iid: iid.to_string(),
                        error,
                        wave_id,
                    },
                );
                false
            }
        }
    }

    /// Evaluates drain progress (behaviour.md 4.5), eagerly: the driver calls it whenever a
    /// resident count changes and at [`Lifecycle::next_deadline`] (architecture.md 9.4). Each
    /// transition emits its event once. `resident(iid)` is the engine's prefill + decode count.
    pub fn refresh(&mut self, now: Now, resident: impl Fn(&str) -> u32) {
        let ids: Vec<String> = self.records.keys().cloned().collect();
        for iid in ids {
            let rec = &self.records[&iid];
            if !matches!(
                rec.state,
                DrainState::Draining | DrainState::DeadlineExceeded
            ) {
                continue;
            }
            let n = resident(&iid);
            let wave_id = wave_of(rec, &self.wave_id);
            if n == 0 && rec.old_process_start.is_some() {
                let rec = self.records.get_mut(&iid).expect("iid from keys");
                rec.state = DrainState::Drained;
                // Unlike the reference (behaviour.md 11.18), a drained record does not keep
                // the stale deadline error.
                rec.error.clear();
                self.emit(now, EventKind::DrainComplete { iid, wave_id });
            } else if rec.state == DrainState::Draining
                && rec.hold.deadline().is_some_and(|d| now.mono > d)
            {
                let rec = self.records.get_mut(&iid).expect("iid from keys");
                rec.state = DrainState::DeadlineExceeded;
                rec.error = format!("{n} resident request(s) remain after the drain deadline");
                self.emit(
                    now,
                    EventKind::DrainDeadlineExceeded {
                        iid,
                        resident: n,
                        wave_id,
                    },
                );
            }
        }
        if !self.wave_ready_emitted && self.wave_ready_to_stop() {
            self.wave_ready_emitted = true;
            let engines = self.wave_members();
            let wave_id = self.wave_id.clone();
            self.emit(now, EventKind::WaveReadyToStop { engines, wave_id });
        }
    }

    fn wave_members(&self) -> Vec<String> {
        self.records
            .values()
            .filter(|r| !self.wave_id.is_empty() && r.in_wave())
            .map(|r| r.iid.clone())
            .collect()
    }

    /// Every member of the active wave is drained. False when no wave is active
    /// (architecture.md 9.3; the reference compares non-wave records, behaviour.md 11.4).
    pub fn wave_ready_to_stop(&self) -> bool {
        let members = self.wave_members();
        !members.is_empty()
            && members
                .iter()
                .all(|i| self.records[i].state == DrainState::Drained)
    }

    /// The external supervisor may stop this engine's process now (behaviour.md 4.6).
    pub fn ready_to_stop(&self, iid: &str) -> bool {
        self.records.get(iid).is_some_and(|r| {
            r.old_process_start.is_some()
                && r.state == DrainState::Drained
                && (!r.in_wave() || self.wave_ready_to_stop())
        })
    }

    /// Accepts a readmission request and moves its targets to `validating`
    /// (behaviour.md 1.10 and 4.7). Returns the sorted targets.
    ///
    /// # Errors
    /// A [`LifecycleError`] (HTTP 409); nothing changes.
    pub fn mark_validating(
        &mut self,
        now: Now,
        engines: &[String],
        wave: bool,
        resident: impl Fn(&str) -> u32,
    ) -> Result<Vec<String>, LifecycleError> {
        let mut targets: Vec<String> = if !engines.is_empty() {
            engines.to_vec()
        } else if wave {
            self.all_sorted()
        } else {
            Vec::new()
        };
        targets.sort();
        targets.dedup();
        let unknown = self.unknown(&targets);
        if !unknown.is_empty() {
            return Err(LifecycleError::UnknownEngines(unknown));
        }
        if wave {
            if self.wave_id.is_empty() || targets != self.wave_members() {
                return Err(LifecycleError::WaveReadmitSet);
            }
        } else if !self.wave_id.is_empty() {
            return Err(LifecycleError::WaveActive);
        } else if targets.len() != 1 {
            return Err(LifecycleError::ReadmitExactlyOne);
        }
        self.refresh(now, &resident);
        for iid in &targets {
            let rec = self.records.get(iid);
            let state = rec.map_or(DrainState::Active, |r| r.state);
            if !matches!(state, DrainState::Drained | DrainState::Blocked) {
                return Err(LifecycleError::NotDrained {
                    iid: iid.clone(),
                    state: state.as_str(),
                });
            }
            if let Some(r) = rec
                && r.restart_required()
                && r.old_process_start.is_none()
            {
                return Err(LifecycleError::NoPreRestartIdentity(iid.clone()));
            }
        }
        for iid in &targets {
            let rec = self.records.get_mut(iid).expect("checked above");
            rec.state = DrainState::Validating;
            rec.error.clear();
            rec.checks.clear();
            let wave_id = wave_of(rec, &self.wave_id);
            self.emit(
                now,
                EventKind::ValidationStarted {
                    iid: iid.clone(),
                    wave_id,
                },
            );
        }
        Ok(targets)
    }

    /// Validation failed: every `validating` record goes `blocked` with its own failures, or,
    /// when it had none, the names of the engines that failed (architecture.md 9.7).
    pub fn validation_failed(&mut self, now: Now, outcome: &BTreeMap<String, EngineOutcome>) {
        let failed: Vec<String> = outcome
            .iter()
            .filter(|(_, o)| !o.failures.is_empty())
            .map(|(i, _)| i.clone())
            .collect();
        let validating: Vec<String> = self
            .records
            .values()
            .filter(|r| r.state == DrainState::Validating)
            .map(|r| r.iid.clone())
            .collect();
        for iid in validating {
            let own = outcome.get(&iid).cloned().unwrap_or_default();
            let rec = self.records.get_mut(&iid).expect("iid from records");
            rec.state = DrainState::Blocked;
            rec.checks = own.checks;
            rec.error = if own.failures.is_empty() {
                let others: Vec<String> = failed
                    .iter()
                    .filter(|f| **f != iid)
                    .map(|f| format!("{f} ({})", outcome[f].failures.join("; ")))
                    .collect();
                if !rec.in_wave() {
                    format!("peer failed validation: {}", others.join(", "))
                } else {
                    format!(
                        "another engine in the wave failed validation: {}",
                        others.join(", ")
                    )
                }
            } else {
                own.failures.join("; ")
            };
            let (error, wave_id) = (rec.error.clone(), wave_of(rec, &self.wave_id));
            self.emit(
                now,
                EventKind::ValidationFailed {
                    iid,
                    error,
                    wave_id,
                },
            );
        }
    }

    /// Fencing or an internal error interrupted validation: every `validating` record goes
    /// `blocked` with `error`.
    pub fn abort_validation(&mut self, now: Now, error: &str) {
        let mut outcome = BTreeMap::new();
        for r in self.records.values() {
            if r.state == DrainState::Validating {
                outcome.insert(
                    r.iid.clone(),
                    EngineOutcome {
                        checks: r.checks.clone(),
                        failures: vec![error.to_string()],
                        process_start: None,
                    },
                );
            }
        }
        self.validation_failed(now, &outcome);
    }

    /// Every target passed: records go `active` with their validated process start and
    /// checks, and a finished wave releases router readiness (behaviour.md 4.7). Returns the
    /// engines to return to placement.
    pub fn readmitted(
        &mut self,
        now: Now,
        outcome: &BTreeMap<String, EngineOutcome>,
    ) -> Vec<String> {
        let mut back = Vec::new();
        for (iid, o) in outcome {
            let Some(rec) = self.records.get_mut(iid) else {
                continue;
            };
            if rec.state != DrainState::Validating {
                continue;
            }
            rec.state = DrainState::Active;
            rec.new_process_start = o.process_start;
            rec.checks = o.checks.clone();
            rec.error.clear();
            let wave_id = wave_of(rec, &self.wave_id);
            if let Some(start) = o.process_start {
                self.process_starts.insert(iid.clone(), start);
            }
            back.push(iid.clone());
            self.emit(
                now,
                EventKind::Readmitted {
                    iid: iid.clone(),
                    process_start: o.process_start,
                    wave_id,
                },
            );
        }
        if !self.wave_id.is_empty() {
            let members = self.wave_members();
            if members
                .iter()
                .all(|i| self.records[i].state == DrainState::Active)
            {
                let wave_id = std::mem::take(&mut self.wave_id);
                self.blocked_reason.clear();
                for i in &members {
                    if let Some(r) = self.records.get_mut(i) {
                        r.hold = r.hold.leave_wave();
                    }
                }
                self.emit(
                    now,
                    EventKind::WaveReadmitted {
                        engines: members,
                        wave_id,
                    },
                );
            }
        }
        back
    }

    /// Starts validation of an engine the breaker ejected, without a restart
    /// (behaviour.md 4.9; handoff-and-lifecycle.md, "Readmitting engines": "transient breaker
    /// ejection"). Returns `false` when it
    /// must not start now: another lifecycle action holds an engine, or under `whole_wave`
    /// (which instead requires a restart wave, see [`Lifecycle::require_restart_wave`]).
    pub fn start_recovery_validation(&mut self, now: Now, iid: &str, new_wave_id: &str) -> bool {
        if !self.engines.iter().any(|e| e == iid) {
            return false;
        }
        if self.policy == RestartPolicy::WholeWave {
            self.require_restart_wave(
                now,
                "engine recovery requires a managed whole-wave restart",
                false,
                new_wave_id,
            );
            return false;
        }
        // A failed recovery (blocked, no restart required, no wave) does not hold up another
        // recovery, nor a retry of itself on the next probe; any other hold does.
        let busy = self.records.values().any(|r| {
            r.state != DrainState::Active
                && !(r.state == DrainState::Blocked && r.hold == Hold::Recovery)
        });
        if busy {
            return false;
        }
        self.start_recovery(now, iid);
        true
    }

    /// Adds a breaker-ejected engine to a running individual readmission as a co-target
    /// validated without a restart requirement, like a recovery (behaviour.md 4.9), when it
    /// is the target's only possible fabric peer. Without this, a one-prefill, one-decode fleet
    /// whose peer was ejected while the target was held could never return to service: the
    /// peer's recovery waits for the target's hold to end, and the target's readmission needs
    /// a live peer (found by tests/tests/lifecycle_e2e.rs; a departure from the reference,
    /// which stays stuck until a whole-wave restart).
    ///
    /// Returns `false` (nothing changes) during a wave, for an unknown engine, or when the
    /// engine has a lifecycle record other than a failed recovery (`blocked`, no restart
    /// required, no wave).
    pub fn join_recovery(&mut self, now: Now, iid: &str) -> bool {
        if !self.wave_id.is_empty() || !self.engines.iter().any(|e| e == iid) {
            return false;
        }
        let free = self.records.get(iid).is_none_or(|r| {
            r.state == DrainState::Active
                || (r.state == DrainState::Blocked && r.hold == Hold::Recovery)
        });
        if !free {
            return false;
        }
        self.start_recovery(now, iid);
        true
    }

    /// Starts a no-restart validation of `iid` (a breaker-ejected engine), bound to its last
    /// accepted process start.
    fn start_recovery(&mut self, now: Now, iid: &str) {
        let old = self.process_starts.get(iid).copied();
        let rec = Record::new(
            iid,
            now,
            DrainState::Validating,
            Hold::Recovery,
            now.wall,
            old,
            "",
        );
        self.records.insert(iid.to_string(), rec);
        self.emit(
            now,
            EventKind::RecoveryValidationStarted {
                iid: iid.to_string(),
            },
        );
    }

    /// Starts cancelling an individual drain (ours; not in the reference,
    /// docs/deviations.md): the engine named in `engines` goes `validating`, to return to
    /// service without a restart once the readmission checks pass on the very process its
    /// drain recorded. The readmission of handoff-and-lifecycle.md (which requires a newer process)
    /// is unchanged.
    /// Returns the engine and that process start (Unix seconds).
    ///
    /// # Errors
    /// A [`LifecycleError`] (HTTP 409); nothing changes.
    pub fn begin_cancel_drain(
        &mut self,
        now: Now,
        engines: &[String],
        wave: bool,
    ) -> Result<(String, f64), LifecycleError> {
        let mut targets = engines.to_vec();
        targets.sort();
        targets.dedup();
        if wave || targets.len() != 1 {
            return Err(LifecycleError::CancelExactlyOne);
        }
        let unknown = self.unknown(&targets);
        if !unknown.is_empty() {
            return Err(LifecycleError::UnknownEngines(unknown));
        }
        let iid = targets.remove(0);
        let Some(rec) = self.records.get(&iid) else {
            return Err(LifecycleError::CancelNotHeld {
                iid,
                state: DrainState::Active.as_str(),
            });
        };
        if !matches!(
            rec.state,
            DrainState::Draining
                | DrainState::Drained
                | DrainState::DeadlineExceeded
                | DrainState::Blocked
        ) {
            return Err(LifecycleError::CancelNotHeld {
                iid,
                state: rec.state.as_str(),
            });
        }
        if rec.in_wave() {
            return Err(LifecycleError::CancelInWave(iid));
        }
        if rec.hold == Hold::Recovery {
            return Err(LifecycleError::CancelNotADrain(iid));
        }
        let Some(start) = rec.old_process_start else {
            return Err(LifecycleError::CancelNoIdentity(iid));
        };
        let rec = self.records.get_mut(&iid).expect("checked above");
        rec.state = DrainState::Validating;
        rec.error.clear();
        rec.checks.clear();
        self.emit(now, EventKind::DrainCancelStarted { iid: iid.clone() });
        Ok((iid, start))
    }

    /// A cancel's checks passed on the process the drain recorded: the engine is `active`
    /// again, its validated start accepted, with its own event (`drain_cancelled`). Returns
    /// whether the record was cancelling (`validating`).
    pub fn drain_cancelled(&mut self, now: Now, iid: &str, outcome: &EngineOutcome) -> bool {
        let Some(rec) = self.records.get_mut(iid) else {
            return false;
        };
        if rec.state != DrainState::Validating {
            return false;
        }
        rec.state = DrainState::Active;
        rec.new_process_start = outcome.process_start;
        rec.checks = outcome.checks.clone();
        rec.error.clear();
        if let Some(start) = outcome.process_start {
            self.process_starts.insert(iid.to_string(), start);
        }
        self.emit(
            now,
            EventKind::DrainCancelled {
                iid: iid.to_string(),
                process_start: outcome.process_start,
            },
        );
        true
    }

    /// Holds every engine in a new restart-required wave (behaviour.md 4.9). A no-op while
    /// a wave is active unless `reset`.
    pub fn require_restart_wave(&mut self, now: Now, reason: &str, reset: bool, new_wave_id: &str) {
        if !self.wave_id.is_empty() && !reset {
            return;
        }
        let wave_id = new_wave_id.to_string();
        for iid in self.engines.clone() {
            let hold = Hold::Wave { deadline: None };
            let rec = Record::new(&iid, now, DrainState::Blocked, hold, now.wall, None, reason);
            self.records.insert(iid, rec);
        }
        self.wave_id = wave_id.clone();
        self.wave_ready_emitted = false;
        self.blocked_reason = format!("whole-wave restart required: {reason}");
        self.emit(
            now,
            EventKind::RestartRequired {
                wave_id,
                reason: reason.to_string(),
            },
        );
    }

    /// The durable part for the handoff (behaviour.md 2.1 `lifecycle`): records sorted by
    /// engine id, the last events, the policy and the accepted process starts.
    pub fn export(&self) -> narwhal_shared::handoff::LifecycleState {
        narwhal_shared::handoff::LifecycleState {
            wave_id: self.wave_id.clone(),
            records: self
                .records
                .values()
                .map(|r| r.to_wire(&self.wave_id))
                .collect(),
            events: self.events.iter().cloned().collect(),
            engine_restart_policy: self.policy.as_str().to_string(),
            process_starts: self.process_starts.clone(),
        }
    }

    /// Restores a handoff's lifecycle part (behaviour.md 4.13): records and process starts
    /// are replaced, a record that was `validating` comes back `blocked` (its validation died
    /// with the old router), a wave withdraws readiness again, drain deadlines are re-anchored
    /// to this process's monotonic clock from the time they had left, and events are kept
    /// (not journaled again). The handoff was validated already (engines, wave membership).
    ///
    /// # Errors
    /// [`RestoreError`] naming the offending record; nothing changes then.
    pub fn restore(
        &mut self,
        now: Now,
        state: &narwhal_shared::handoff::LifecycleState,
    ) -> Result<(), RestoreError> {
        if state.engine_restart_policy != self.policy.as_str() {
            return Err(RestoreError::PolicyMismatch);
        }
        let mut records = BTreeMap::new();
        for (index, r) in state.records.iter().enumerate() {
            if !self.engines.contains(&r.iid) {
                return Err(RestoreError::UnknownEngine {
                    index,
                    iid: r.iid.clone(),
                });
            }
            let deadline = (r.state == DrainState::Draining).then(|| {
                let left = (r.deadline_at - now.wall).clamp(0.0, MAX_DEADLINE_S);
                now.mono
                    .checked_add(Duration::from_secs_f64(left))
                    .unwrap_or(now.mono)
            });
            let mut r = Record::from_wire(r, deadline);
            if r.state == DrainState::Validating {
                r.state = DrainState::Blocked;
                r.error = "readmission validation was interrupted by router replacement".into();
            }
            records.insert(r.iid.clone(), r);
        }
        self.records = records;
        self.process_starts = state.process_starts.clone();
        self.wave_id = state.wave_id.clone();
        self.wave_ready_emitted = false;
        self.blocked_reason = if self.wave_id.is_empty() {
            String::new()
        } else {
            format!("whole-wave drain {}", self.wave_id)
        };
        self.events = state
            .events
            .iter()
            .rev()
            .take(EVENT_HISTORY)
            .rev()
            .cloned()
            .collect();
        self.pending.clear();
        Ok(())
    }

    /// The lifecycle document, schema `narwhal.lifecycle` version 1 (handoff-and-lifecycle.md,
    /// "Lifecycle API", behaviour.md 4.11; `router.controls_fleet` is `"active"`, `"standby"` or
    /// `"fenced"`, architecture.md 9.1). `view(iid)` gives resident counts and placement
    /// eligibility; `error` is the rejected action's message, `""` on success.
    /// `router.controller` is left `None`: the driver names the controller it saw.
    pub fn document(
        &self,
        controls_fleet: &str,
        ready: bool,
        view: impl Fn(&str) -> EngineView,
        error: &str,
    ) -> doc::Lifecycle {
        let engines = self
            .all_sorted()
            .into_iter()
            .map(|iid| {
                let v = view(&iid);
                let rec = self.records.get(&iid);
                let state = rec.map_or(DrainState::Active, |r| r.state);
                let engine = doc::Engine {
                    state,
                    draining: state != DrainState::Active,
                    accepts_new: v.accepts_new && state == DrainState::Active,
                    ready_to_stop: self.ready_to_stop(&iid),
                    resident: doc::Resident {
                        prefill: u64::from(v.resident_prefill),
                        decode: u64::from(v.resident_decode),
                    },
                    deadline_at: rec.map(|r| r.deadline_at),
                    restart_required: rec.is_some_and(Record::restart_required),
                    wave_id: rec.map_or("", |r| wave_str(r, &self.wave_id)).to_string(),
                    old_process_start: rec.and_then(|r| r.old_process_start),
                    new_process_start: rec.and_then(|r| r.new_process_start),
                    checks: rec.map_or_else(Vec::new, |r| r.checks.clone()),
                    error: rec.map_or("", |r| r.error.as_str()).to_string(),
                };
                (iid, engine)
            })
            .collect();
        doc::Lifecycle {
            schema: doc::LIFECYCLE_SCHEMA.to_string(),
            schema_version: doc::LIFECYCLE_VERSION,
            router: doc::RouterView {
                controls_fleet: controls_fleet.to_string(),
                ready,
                controller: None,
            },
            wave: doc::Wave {
                id: self.wave_id.clone(),
                active: !self.wave_id.is_empty(),
                readiness_withdrawn: !self.blocked_reason.is_empty(),
                ready_to_stop: self.wave_ready_to_stop(),
            },
            engines,
            events: self.events.iter().cloned().collect(),
            engine_restart_policy: self.policy.as_str().to_string(),
            process_starts: self.process_starts.clone(),
            error: error.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, SystemClock};

    fn t0() -> Now {
        Now {
            mono: SystemClock.now(),
            wall: 1_800_000_000.0,
        }
    }

    fn agent_err(detail: &str) -> CheckError {
        CheckError::Agent {
            detail: detail.into(),
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn lc(ids: &[&str], policy: RestartPolicy) -> Lifecycle {
        Lifecycle::new(ids.iter().map(|s| s.to_string()).collect(), policy)
    }

    fn set(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn drain(ids: &[&str], wave: bool) -> DrainRequest {
        DrainRequest {
            engines: ids.iter().map(|s| s.to_string()).collect(),
            wave,
            deadline_s: 30.0,
            deadline_given: true,
        }
    }

    fn actions(l: &Lifecycle) -> Vec<String> {
        l.events()
            .map(|e| e["action"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    fn ok(start: f64) -> EngineOutcome {
        EngineOutcome {
            checks: vec!["health".into()],
            failures: vec![],
            process_start: Some(start),
        }
    }

    fn fail(msg: &str) -> EngineOutcome {
        EngineOutcome {
            checks: vec!["health".into()],
            failures: vec![msg.into()],
            process_start: None,
        }
    }

    /// Drains `iid` of an idle two-engine fleet to `drained` with start 100.
    fn drained(l: &mut Lifecycle, now: Now, iid: &str) {
        let plan = l
            .begin(now, &drain(&[iid], false), &set(&["e0", "e1"]), "")
            .unwrap();
        assert_eq!(plan.capture, vec![iid.to_string()]);
        assert!(l.bind_identity(now, iid, Ok(100.0), false));
        l.refresh(now, |_| 0);
        assert_eq!(l.state(iid), DrainState::Drained);
    }

    #[test]
    fn drain_leaves_placement_before_identity_and_completes_when_idle() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        let plan = l
            .begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        assert_eq!(l.held(), set(&["e0"]), "held before any identity capture");
        assert_eq!(plan.capture, vec!["e0".to_string()]);
        assert!(!l.ready_to_stop("e0"));
        l.refresh(now, |_| 0);
        assert_eq!(
            l.state("e0"),
            DrainState::Draining,
            "no identity yet: not drained"
        );
        assert!(l.bind_identity(now, "e0", Ok(100.0), false));
        l.refresh(now, |_| 0);
        assert_eq!(l.state("e0"), DrainState::Drained);
        assert!(l.ready_to_stop("e0"));
        assert_eq!(
            actions(&l),
            ["drain_started", "process_recorded", "drain_complete"]
        );
    }

    #[test]
    fn drain_waits_for_resident_work_then_reports_deadline_then_drains() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        l.bind_identity(now, "e0", Ok(100.0), false);
        l.refresh(now, |_| 2);
        assert_eq!(l.state("e0"), DrainState::Draining);
        assert!(!l.ready_to_stop("e0"));
        assert_eq!(l.next_deadline(), Some(now.mono + secs(30)));
        l.refresh(now.after(secs(31)), |_| 2);
        assert_eq!(l.state("e0"), DrainState::DeadlineExceeded);
        assert_eq!(
            l.record("e0").unwrap().error,
            "2 resident request(s) remain after the drain deadline"
        );
        l.refresh(now.after(secs(32)), |_| 2);
        assert_eq!(
            actions(&l)
                .iter()
                .filter(|a| *a == "drain_deadline_exceeded")
                .count(),
            1,
            "each event once"
        );
        l.refresh(now.after(secs(40)), |_| 0);
        assert_eq!(l.state("e0"), DrainState::Drained);
        assert_eq!(l.record("e0").unwrap().error, "", "no stale deadline error");
    }

    #[test]
    fn drain_rules_are_checked_in_order_and_change_nothing() {
        let now = t0();
        let live = set(&["e0", "e1"]);
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        let err = |l: &mut Lifecycle, r: DrainRequest, live: &BTreeSet<String>| {
            l.begin(now, &r, live, "wave-x").unwrap_err().to_string()
        };
        assert_eq!(
            err(&mut l, drain(&["zz", "e0", "aa"], false), &live),
            "unknown engine(s): aa, zz"
        );
        let mut bad = drain(&["e0"], false);
        bad.deadline_s = 0.0;
        assert_eq!(
            err(&mut l, bad.clone(), &live),
            "deadline_s must be positive"
        );
        bad.deadline_s = f64::NAN;
        assert_eq!(
            err(&mut l, bad.clone(), &live),
            "deadline_s must be positive"
        );
        bad.deadline_s = 1e300;
        assert_eq!(
            err(&mut l, bad, &live),
            "deadline_s must be at most 31536000 (one year)"
        );
        assert_eq!(
            err(&mut l, drain(&["e0", "e1"], false), &live),
            "a non-wave drain must name exactly one engine"
        );
        assert_eq!(
            err(&mut l, drain(&[], false), &live),
            "a non-wave drain must name exactly one engine"
        );
        assert_eq!(
            err(&mut l, drain(&["e0"], true), &live),
            "a whole-wave drain must name every configured engine"
        );
        assert_eq!(
            err(&mut l, drain(&["e0"], false), &set(&["e0"])),
            "the last schedulable engine requires a whole-wave drain"
        );
        assert!(l.held().is_empty());
        assert_eq!(l.events().count(), 0);
        let mut w = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        assert_eq!(
            err(&mut w, drain(&["e0"], false), &live),
            "engine_restart_policy requires a whole-wave drain"
        );
    }

    #[test]
    fn second_engine_drain_while_one_is_held_is_409() {
        let now = t0();
        let mut l = lc(&["e0", "e1", "e2"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        let e = l
            .begin(now, &drain(&["e1"], false), &set(&["e1", "e2"]), "")
            .unwrap_err();
        assert_eq!(e.to_string(), "lifecycle action already active for e0");
    }

    #[test]
    fn repeating_an_accepted_drain_is_idempotent() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        let before = l.record("e0").cloned();
        let n = l.events().count();
        let plan = l
            .begin(now, &drain(&["e0"], false), &set(&["e1"]), "")
            .unwrap();
        assert!(plan.repeated);
        assert!(plan.capture.is_empty());
        assert_eq!(l.record("e0").cloned(), before);
        assert_eq!(l.events().count(), n);
        // Another deadline is refused; none named is a repeat.
        let mut other = drain(&["e0"], false);
        other.deadline_s = 60.0;
        let e = l.begin(now, &other, &set(&["e1"]), "").unwrap_err();
        assert_eq!(
            e,
            LifecycleError::DeadlineConflict {
                iid: "e0".into(),
                deadline_s: 30.0
            }
        );
        other.deadline_given = false;
        assert!(l.begin(now, &other, &set(&["e1"]), "").unwrap().repeated);
        assert_eq!(l.record("e0").cloned(), before, "refusals change nothing");
    }

    #[test]
    fn deadline_passing_while_the_identity_is_captured_keeps_its_error() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        l.refresh(now.after(secs(31)), |_| 1);
        assert_eq!(l.state("e0"), DrainState::DeadlineExceeded);
        assert!(l.bind_identity(now.after(secs(32)), "e0", Ok(100.0), false));
        let r = l.record("e0").unwrap();
        assert_eq!(r.state, DrainState::DeadlineExceeded);
        assert_eq!(
            r.error,
            "1 resident request(s) remain after the drain deadline"
        );
        assert_eq!(r.old_process_start, Some(100.0));
    }

    #[test]
    fn failed_capture_blocks_and_the_same_drain_retries_it() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        assert!(!l.bind_identity(now, "e0", Err(agent_err("e0: agent unreachable")), false));
        assert_eq!(l.state("e0"), DrainState::Blocked);
        assert_eq!(l.held(), set(&["e0"]), "stays out of placement");
        let plan = l
            .begin(now, &drain(&["e0"], false), &set(&["e1"]), "")
            .unwrap();
        assert_eq!(plan.capture, vec!["e0".to_string()]);
        assert!(!plan.repeated);
        assert!(l.bind_identity(now, "e0", Ok(100.0), false));
        assert_eq!(l.state("e0"), DrainState::Draining);
        assert_eq!(l.record("e0").unwrap().error, "");
    }

    #[test]
    fn ejected_engine_binds_to_last_accepted_start() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        l.accept_process_start("e0", 90.0);
        l.begin(now, &drain(&["e0"], false), &set(&["e1", "e0"]), "")
            .unwrap();
        assert!(l.bind_identity(now, "e0", Err(agent_err("connection refused")), true));
        assert_eq!(l.record("e0").unwrap().old_process_start, Some(90.0));
    }

    #[test]
    fn startup_identity_binds_a_crashed_engine_in_a_forced_wave() {
        // Found by tests/tests/lifecycle_e2e.rs: without the starts accepted at startup
        // (identity::check_identities), a crashed engine's forced-wave drain stayed 503 until it
        // was restarted, and then needed a second restart.
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        l.accept_process_start("e0", 90.0);
        l.accept_process_start("e1", 91.0);
        l.require_restart_wave(now, "engine e1 was excluded", false, "wave-a");
        let plan = l
            .begin(now, &drain(&[], true), &set(&[]), "wave-b")
            .unwrap();
        assert_eq!(plan.capture.len(), 2, "identity retry of the forced wave");
        assert!(l.bind_identity(now, "e0", Ok(90.0), false));
        assert!(l.bind_identity(now, "e1", Err(agent_err("agent: engine not running")), true));
        assert_eq!(l.record("e1").unwrap().old_process_start, Some(91.0));
        l.refresh(now, |_| 0);
        assert!(l.wave_ready_to_stop());
    }

    #[test]
    fn an_ejected_peer_joins_a_readmission_and_both_return() {
        let now = t0();
        let mut l = lc(&["p0", "d0"], RestartPolicy::Individual);
        l.accept_process_start("d0", 50.0);
        drained(&mut l, now, "p0");
        assert!(
            !l.start_recovery_validation(now, "d0", "wave-r"),
            "the held target blocks the peer's own recovery"
        );
        let ids = vec!["p0".to_string()];
        l.mark_validating(now, &ids, false, |_| 0).unwrap();
        assert!(l.join_recovery(now, "d0"));
        assert!(!l.join_recovery(now, "d0"), "already validating");
        assert!(!l.join_recovery(now, "zz"));
        let r = l.record("d0").unwrap();
        assert_eq!(
            (r.state, r.restart_required(), r.old_process_start),
            (DrainState::Validating, false, Some(50.0))
        );
        // A failure blocks both; the next readmission takes the failed recovery along again.
        l.validation_failed(
            now,
            &BTreeMap::from([("d0".to_string(), fail("health did not answer 200"))]),
        );
        assert_eq!(l.state("d0"), DrainState::Blocked);
        l.mark_validating(now, &ids, false, |_| 0).unwrap();
        assert!(l.join_recovery(now, "d0"));
        let back = l.readmitted(
            now,
            &BTreeMap::from([("p0".to_string(), ok(200.0)), ("d0".to_string(), ok(60.0))]),
        );
        assert_eq!(back, ["d0", "p0"]);
        assert!(l.held().is_empty());
        assert_eq!(l.process_starts()["d0"], 60.0);
        let mut w = lc(&["p0", "d0"], RestartPolicy::WholeWave);
        w.require_restart_wave(now, "r", false, "wave-w");
        assert!(!w.join_recovery(now, "d0"), "never during a wave");
    }

    #[test]
    fn readmission_rules() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        let e = |l: &mut Lifecycle, ids: &[&str], wave: bool| {
            let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
            l.mark_validating(now, &ids, wave, |_| 0)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(e(&mut l, &["e0"], false), "e0 is active, expected drained");
        assert_eq!(
            e(&mut l, &["e0", "e1"], false),
            "readmission must name exactly one engine"
        );
        assert_eq!(
            e(&mut l, &[], true),
            "whole-wave readmission must name the active wave's complete engine set"
        );
        l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        l.bind_identity(now, "e0", Ok(100.0), false);
        l.refresh(now, |_| 1);
        let ids = vec!["e0".to_string()];
        assert_eq!(
            l.mark_validating(now, &ids, false, |_| 1)
                .unwrap_err()
                .to_string(),
            "e0 is draining, expected drained"
        );
        assert_eq!(l.mark_validating(now, &ids, false, |_| 0).unwrap(), ids);
        assert_eq!(l.state("e0"), DrainState::Validating);
    }

    #[test]
    fn blocked_capture_without_identity_cannot_be_readmitted() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        l.bind_identity(now, "e0", Err(agent_err("unreadable")), false);
        let ids = vec!["e0".to_string()];
        assert_eq!(
            l.mark_validating(now, &ids, false, |_| 0)
                .unwrap_err()
                .to_string(),
            "e0 has no recorded pre-restart process identity"
        );
    }

    #[test]
    fn failed_validation_blocks_and_names_failures_then_passes() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        let ids = vec!["e0".to_string()];
        l.mark_validating(now, &ids, false, |_| 0).unwrap();
        let out = BTreeMap::from([(
            "e0".to_string(),
            fail("engine process did not restart after drain"),
        )]);
        l.validation_failed(now, &out);
        let r = l.record("e0").unwrap();
        assert_eq!(r.state, DrainState::Blocked);
        assert_eq!(r.error, "engine process did not restart after drain");
        assert_eq!(r.checks, vec!["health".to_string()]);
        assert_eq!(l.held(), set(&["e0"]));
        // Blocked keeps the captured identity: readmit again without a re-drain.
        l.mark_validating(now, &ids, false, |_| 0).unwrap();
        let back = l.readmitted(now, &BTreeMap::from([("e0".to_string(), ok(200.0))]));
        assert_eq!(back, ids);
        let r = l.record("e0").unwrap();
        assert_eq!(r.state, DrainState::Active);
        assert_eq!(r.new_process_start, Some(200.0));
        assert_eq!(r.old_process_start, Some(100.0));
        assert_eq!(l.process_starts()["e0"], 200.0);
        assert!(l.held().is_empty());
    }

    #[test]
    fn peer_failure_is_reported_by_name() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        l.mark_validating(now, &["e0".to_string()], false, |_| 0)
            .unwrap();
        let out = BTreeMap::from([
            ("e0".to_string(), ok(200.0)),
            (
                "e1".to_string(),
                fail("peer process changed before readmission"),
            ),
        ]);
        l.validation_failed(now, &out);
        assert_eq!(
            l.record("e0").unwrap().error,
            "peer failed validation: e1 (peer process changed before readmission)"
        );
        assert!(l.record("e1").is_none(), "the peer gets no record");
    }

    #[test]
    fn whole_wave_lifecycle() {
        let now = t0();
        let all = set(&["e0", "e1"]);
        let mut l = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        let plan = l.begin(now, &drain(&[], true), &all, "wave-abc").unwrap();
        assert_eq!(plan.capture.len(), 2);
        assert_eq!(l.wave_id(), "wave-abc");
        assert_eq!(l.blocked_reason(), "whole-wave drain wave-abc");
        assert_eq!(l.held(), all);
        l.bind_identity(now, "e0", Ok(100.0), false);
        l.bind_identity(now, "e1", Ok(101.0), false);
        l.refresh(now, |i| u32::from(i == "e1"));
        assert_eq!(l.state("e0"), DrainState::Drained);
        assert!(
            !l.ready_to_stop("e0"),
            "wave member waits for the whole wave"
        );
        assert!(!l.wave_ready_to_stop());
        l.refresh(now, |_| 0);
        assert!(l.wave_ready_to_stop());
        assert!(l.ready_to_stop("e0") && l.ready_to_stop("e1"));
        l.refresh(now, |_| 0);
        assert_eq!(
            actions(&l)
                .iter()
                .filter(|a| *a == "wave_ready_to_stop")
                .count(),
            1
        );
        let one = vec!["e0".to_string()];
        assert_eq!(
            l.mark_validating(now, &one, false, |_| 0)
                .unwrap_err()
                .to_string(),
            "an active whole wave must be validated and readmitted as one engine set"
        );
        assert_eq!(
            l.mark_validating(now, &one, true, |_| 0)
                .unwrap_err()
                .to_string(),
            "whole-wave readmission must name the active wave's complete engine set"
        );
        let targets = l.mark_validating(now, &[], true, |_| 0).unwrap();
        l.validation_failed(
            now,
            &BTreeMap::from([
                ("e0".to_string(), ok(200.0)),
                (
                    "e1".to_string(),
                    fail("engine process did not restart after drain"),
                ),
            ]),
        );
        assert_eq!(l.state("e0"), DrainState::Blocked);
        assert_eq!(
            l.record("e0").unwrap().error,
            "another engine in the wave failed validation: e1 (engine process did not restart after drain)"
        );
        assert_eq!(l.wave_id(), "wave-abc", "wave stays active");
        l.mark_validating(now, &targets, true, |_| 0).unwrap();
        l.readmitted(
            now,
            &BTreeMap::from([("e0".to_string(), ok(200.0)), ("e1".to_string(), ok(201.0))]),
        );
        assert_eq!(l.wave_id(), "");
        assert_eq!(l.blocked_reason(), "");
        assert!(l.held().is_empty());
        assert!(!l.record("e0").unwrap().in_wave(), "wave_id cleared");
        assert!(actions(&l).contains(&"wave_readmitted".to_string()));
    }

    #[test]
    fn wave_ready_to_stop_is_false_without_a_wave() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        assert!(l.ready_to_stop("e0"));
        assert!(!l.wave_ready_to_stop());
        let doc = l.document("active", true, |_| EngineView::default(), "");
        assert!(!doc.wave.ready_to_stop);
        assert!(!doc.wave.active);
    }

    #[test]
    fn promotion_to_a_wave_when_nothing_is_live() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        let e = l
            .begin(now, &drain(&[], true), &set(&["e1"]), "wave-1")
            .unwrap_err();
        assert_eq!(e.to_string(), "lifecycle action already active for e0");
        let plan = l
            .begin(now, &drain(&[], true), &set(&[]), "wave-1")
            .unwrap();
        assert_eq!(
            plan.capture,
            vec!["e1".to_string()],
            "e0 keeps its captured identity"
        );
        assert_eq!(l.record("e0").unwrap().old_process_start, Some(100.0));
    }

    #[test]
    fn recovery_validation_needs_no_restart_and_respects_other_holds() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        l.accept_process_start("e1", 50.0);
        assert!(l.start_recovery_validation(now, "e1", "wave-r"));
        let r = l.record("e1").unwrap();
        assert_eq!(
            (r.state, r.restart_required()),
            (DrainState::Validating, false)
        );
        assert!(
            !l.start_recovery_validation(now, "e0", "wave-r"),
            "one action at a time"
        );
        l.readmitted(now, &BTreeMap::from([("e1".to_string(), ok(50.0))]));
        assert_eq!(l.state("e1"), DrainState::Active);
        let mut w = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        assert!(!w.start_recovery_validation(now, "e1", "wave-r"));
        assert_eq!(w.held(), set(&["e0", "e1"]));
        assert_eq!(
            w.blocked_reason(),
            "whole-wave restart required: engine recovery requires a managed whole-wave restart"
        );
        // The operator's way out: a wave drain captures identities for the blocked records.
        let plan = w
            .begin(now, &drain(&[], true), &set(&[]), "wave-2")
            .unwrap();
        assert_eq!(plan.capture.len(), 2);
    }

    #[test]
    fn document_shape() {
        let now = t0();
        let mut l = lc(&["e1", "e0"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        let doc = l.document(
            "fenced",
            false,
            |i| EngineView {
                resident_prefill: 0,
                resident_decode: u32::from(i == "e1"),
                accepts_new: i == "e1",
            },
            "boom",
        );
        // The shape on the wire.
        let doc = serde_json::to_value(doc).expect("serialises");
        assert_eq!(doc["schema"], "narwhal.lifecycle");
        assert_eq!(doc["router"]["controls_fleet"], "fenced");
        let keys: Vec<&String> = doc["engines"].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["e0", "e1"], "sorted");
        let e0 = &doc["engines"]["e0"];
        assert_eq!(e0["state"], "drained");
        assert_eq!(e0["draining"], true);
        assert_eq!(e0["accepts_new"], false);
        assert_eq!(e0["ready_to_stop"], true);
        assert_eq!(e0["old_process_start"], 100.0);
        let e1 = &doc["engines"]["e1"];
        assert_eq!(e1["state"], "active");
        assert_eq!(e1["deadline_at"], Value::Null);
        assert_eq!(e1["resident"]["decode"], 1);
        assert_eq!(doc["error"], "boom");
        assert_eq!(doc["events"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn export_restore_round_trip_blocks_interrupted_validation() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        l.accept_process_start("e1", 50.0);
        l.mark_validating(now, &["e0".to_string()], false, |_| 0)
            .unwrap();
        let state = l.export();
        assert_eq!(state.engine_restart_policy, "individual");
        let later = now.after(secs(100));
        let mut r = lc(&["e0", "e1"], RestartPolicy::Individual);
        r.restore(later, &state).unwrap();
        let rec = r.record("e0").unwrap();
        assert_eq!(rec.state, DrainState::Blocked);
        assert_eq!(
            rec.error,
            "readmission validation was interrupted by router replacement"
        );
        assert_eq!(rec.old_process_start, Some(100.0));
        assert_eq!(r.held(), set(&["e0"]));
        assert_eq!(r.process_starts()["e1"], 50.0);
        assert_eq!(r.events().count(), l.events().count());
        assert!(
            r.take_events().is_empty(),
            "restored events are not journaled again"
        );
        // The restored blocked record can be readmitted without a new drain.
        r.mark_validating(later, &["e0".to_string()], false, |_| 0)
            .unwrap();
    }

    #[test]
    fn restore_reanchors_drain_deadlines_and_waves() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        l.begin(now, &drain(&[], true), &set(&["e0", "e1"]), "wave-w")
            .unwrap();
        let state = l.export();
        let mut r = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        let later = Now {
            mono: now.mono + secs(5),
            wall: now.wall + 10.0,
        };
        r.restore(later, &state).unwrap();
        assert_eq!(r.wave_id(), "wave-w");
        assert_eq!(r.blocked_reason(), "whole-wave drain wave-w");
        // 30 s deadline, 10 s of wall time gone: 20 s left on the new monotonic clock.
        assert_eq!(r.next_deadline(), Some(later.mono + secs(20)));
        let mut other = lc(&["e0", "e1"], RestartPolicy::Individual);
        assert_eq!(
            other.restore(later, &state).unwrap_err().to_string(),
            "handoff engine restart policy mismatch"
        );
    }

    #[test]
    fn event_history_is_bounded() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        for i in 0..150 {
            l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
                .unwrap();
            l.bind_identity(now, "e0", Ok(f64::from(i)), false);
            l.refresh(now, |_| 0);
            l.mark_validating(now, &["e0".to_string()], false, |_| 0)
                .unwrap();
            l.readmitted(
                now,
                &BTreeMap::from([("e0".to_string(), ok(f64::from(i) + 0.5))]),
            );
        }
        assert_eq!(l.events().count(), EVENT_HISTORY);
        assert_eq!(l.take_events().len(), 150 * 5);
        assert!(l.take_events().is_empty());
    }

    /// The hold survives the wire form: a wave member, a drain and a recovery each come back
    /// as themselves (and a readmitted wave's members as drains, restart still required).
    #[test]
    fn holds_round_trip_through_the_handoff() {
        let now = t0();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        drained(&mut l, now, "e0");
        let mut rec = lc(&["e0", "e1"], RestartPolicy::Individual);
        rec.accept_process_start("e1", 50.0);
        assert!(rec.start_recovery_validation(now, "e1", "wave-r"));
        for (machine, iid, restart_required) in [(&l, "e0", true), (&rec, "e1", false)] {
            let state = machine.export();
            let wire = state.records.iter().find(|r| r.iid == iid).unwrap();
            assert_eq!(
                (wire.restart_required, wire.wave_id.as_str()),
                (restart_required, "")
            );
            let mut r = lc(&["e0", "e1"], RestartPolicy::Individual);
            r.restore(now, &state).unwrap();
            let back = r.record(iid).unwrap();
            assert_eq!(back.restart_required(), restart_required);
            assert!(!back.in_wave());
        }
        let mut r = lc(&["e0", "e1"], RestartPolicy::Individual);
        r.restore(now, &rec.export()).unwrap();
        assert_eq!(r.record("e1").unwrap().hold, Hold::Recovery);
        assert_eq!(
            r.record("e1").unwrap().state,
            DrainState::Blocked,
            "interrupted"
        );
        let mut w = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        w.require_restart_wave(now, "r", false, "wave-w");
        let state = w.export();
        assert!(
            state
                .records
                .iter()
                .all(|r| r.wave_id == "wave-w" && r.restart_required)
        );
        let mut back = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        back.restore(now, &state).unwrap();
        assert_eq!(
            back.record("e0").unwrap().hold,
            Hold::Wave { deadline: None }
        );
        assert_eq!(back.export(), state, "the wire form round-trips");
    }

    /// Cancel-drain (docs/deviations.md): a drain cancelled without a restart validates the
    /// recorded process and returns it with its own events; the refusals name their rule; a wave, a
    /// recovery and a drain without an identity cannot be cancelled.
    #[test]
    fn a_drain_is_cancelled_on_the_same_process_with_its_own_events() {
        let now = t0();
        let one = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        let err = |l: &mut Lifecycle, ids: &[&str], wave: bool| {
            l.begin_cancel_drain(now, &one(ids), wave)
                .unwrap_err()
                .to_string()
        };
        assert!(err(&mut l, &["e0"], false).starts_with("e0 is active: "));
        assert!(
            err(&mut l, &["e0", "e1"], false).starts_with("cancel-drain must name exactly one")
        );
        assert!(err(&mut l, &[], true).starts_with("cancel-drain must name exactly one"));
        assert_eq!(err(&mut l, &["x"], false), "unknown engine(s): x");
        // Still draining (resident work), not yet drained: a cancel is allowed.
        l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        assert!(l.bind_identity(now, "e0", Ok(100.0), false));
        l.refresh(now, |_| 2);
        assert_eq!(l.state("e0"), DrainState::Draining);
        assert_eq!(
            l.begin_cancel_drain(now, &one(&["e0"]), false).unwrap(),
            ("e0".to_string(), 100.0)
        );
        assert_eq!(l.state("e0"), DrainState::Validating);
        assert!(l.held().contains("e0"), "out of placement while validated");
        assert!(l.drain_cancelled(now, "e0", &ok(100.0)));
        assert_eq!(l.state("e0"), DrainState::Active);
        assert!(l.held().is_empty());
        assert_eq!(l.process_starts()["e0"], 100.0);
        let acts = actions(&l);
        assert_eq!(
            acts[acts.len() - 2..],
            ["drain_cancel_started", "drain_cancelled"],
            "{acts:?}"
        );
        assert!(!acts.contains(&"readmitted".to_string()), "{acts:?}");
        let last = l.take_events().pop().expect("event");
        assert_eq!(
            last.to_json()["process_start"],
            100.0,
            "{:?}",
            last.to_json()
        );
        assert!(!l.drain_cancelled(now, "e0", &ok(100.0)), "only once");
        // A failed cancel blocks like a failed readmission; a readmission still
        // requires a restart afterwards, and a second cancel may be tried.
        drained(&mut l, now, "e1");
        l.begin_cancel_drain(now, &one(&["e1"]), false).unwrap();
        l.validation_failed(
            now,
            &BTreeMap::from([("e1".to_string(), fail("generation failed"))]),
        );
        assert_eq!(l.state("e1"), DrainState::Blocked);
        assert!(l.record("e1").unwrap().restart_required());
        assert!(l.begin_cancel_drain(now, &one(&["e1"]), false).is_ok());
        // A drain whose identity was never recorded cannot be cancelled.
        let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
        l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        l.bind_identity(now, "e0", Err(agent_err("agent down")), false);
        assert!(err(&mut l, &["e0"], false).starts_with("e0 has no recorded process identity"));
        // Wave members and breaker recoveries are not drains one can cancel.
        let mut w = lc(&["e0", "e1"], RestartPolicy::WholeWave);
        w.require_restart_wave(now, "r", false, "wave-w");
        assert!(err(&mut w, &["e0"], false).starts_with("e0 is held by the active whole wave"));
        let mut r = lc(&["e0", "e1"], RestartPolicy::Individual);
        r.accept_process_start("e0", 50.0);
        assert!(r.start_recovery_validation(now, "e0", "w"));
        r.validation_failed(now, &BTreeMap::from([("e0".to_string(), fail("x"))]));
        assert!(err(&mut r, &["e0"], false).starts_with("e0 is held by a breaker recovery"));
    }
}
