//! The engine lifecycle core: drain records, whole-fleet waves, `ready_to_stop`, and the
//! readmission bookkeeping around validation (handoff-and-lifecycle.md, "Lifecycle API",
//! behaviour.md 4.1–4.7, 4.9, 4.11, 4.12; departures in architecture.md section 9).
//!
//! Pure: it never reads a clock, sleeps or touches the network. The driver passes [`Now`] and
//! the resident request counts, performs the process-identity captures and the validation checks
//! the core asks for, and feeds the results back. Every transition appends a lifecycle event
//! that the driver takes with [`Lifecycle::take_events`] for the journal.
//!
//! The machine is one type, [`Lifecycle`], whose methods are grouped by what they decide:
//!
//! | file | holds |
//! |---|---|
//! | `machine.rs` | [`Now`], the limits, [`Lifecycle`] and its accessors |
//! | `record.rs` | [`Record`] and its [`Hold`], the wire form [`DrainRecord`] |
//! | `refusal.rs` | [`LifecycleError`]: every rule a refused action names |
//! | `drain.rs` | [`DrainRequest`], [`DrainPlan`], drain rules, identity binding, progress |
//! | `wave.rs` | whole waves, `ready_to_stop`, the restart-required wave |
//! | `readmission.rs` | [`EngineOutcome`], accepting a readmission, failed and passed validations |
//! | `recovery.rs` | breaker recovery without a restart, alone or beside a readmission |
//! | `cancel.rs` | cancel-drain (ours; docs/deviations.md) |
//! | `restore.rs` | the handoff's lifecycle part: export, restore, [`RestoreError`] |
//! | `document.rs` | [`EngineView`] and the `narwhal.lifecycle` document |

use std::collections::{BTreeMap, BTreeSet, VecDeque};
#[cfg(test)]
use std::time::Duration;
use std::time::Instant;

use serde_json::Value;

pub(crate) use crate::config::RestartPolicy;
use crate::journal::lifecycle::{EventKind, LifecycleEvent};

mod cancel;
mod document;
mod drain;
mod readmission;
mod record;
mod recovery;
mod refusal;
mod restore;
#[cfg(test)]
mod tests;
mod wave;

pub(crate) use document::EngineView;
pub(crate) use drain::DrainRequest;
pub(crate) use narwhal_shared::handoff::DrainState;
pub(crate) use readmission::EngineOutcome;
pub(crate) use record::Record;
pub(crate) use refusal::LifecycleError;
pub(crate) use restore::RestoreError;

/// Largest accepted drain deadline, seconds (one year; the fleet file's
/// `control.self_drain.deadline_s` is held to it too, so it lives with the config).
pub(crate) const MAX_DEADLINE_S: f64 = crate::config::MAX_DRAIN_DEADLINE_S;

/// How many lifecycle events the document keeps (behaviour.md 4.1).
pub(crate) const EVENT_HISTORY: usize = 200;

/// A reading of both clocks, taken once by the driver per operation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Now {
    /// Monotonic time, for drain deadlines.
    pub mono: Instant,
    /// Wall-clock Unix seconds, for persisted and displayed times (`requested_at`, `at`).
    pub wall: f64,
}

impl Now {
    #[cfg(test)]
    /// Both readings moved forward by `by`.
    pub(crate) fn after(self, by: Duration) -> Now {
        Now {
            mono: self.mono + by,
            wall: self.wall + by.as_secs_f64(),
        }
    }
}

/// The lifecycle manager for one fleet.
#[derive(Debug, Clone)]
pub(crate) struct Lifecycle {
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

impl Lifecycle {
    /// A manager for the configured engines (config order) under `policy`.
    pub(crate) fn new(engines: Vec<String>, policy: RestartPolicy) -> Self {
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

    /// An engine's state (`Active` without a record).
    pub(crate) fn state(&self, iid: &str) -> DrainState {
        self.records
            .get(iid)
            .map_or(DrainState::Active, |r| r.state)
    }

    /// An engine's record, if it has one.
    pub(crate) fn record(&self, iid: &str) -> Option<&Record> {
        self.records.get(iid)
    }

    /// Engines held out of placement by the lifecycle (any non-`active` record).
    pub(crate) fn held(&self) -> BTreeSet<String> {
        self.records
            .values()
            .filter(|r| r.state != DrainState::Active)
            .map(|r| r.iid.clone())
            .collect()
    }

    /// The active wave id, `""` when none.
    pub(crate) fn wave_id(&self) -> &str {
        &self.wave_id
    }

    /// Why router-wide readiness is withdrawn (`whole-wave drain <id>`, ...), `""` when not.
    pub(crate) fn blocked_reason(&self) -> &str {
        &self.blocked_reason
    }

    /// Last accepted process start per engine (Unix seconds).
    pub(crate) fn process_starts(&self) -> &BTreeMap<String, f64> {
        &self.process_starts
    }

    /// Accepts `start` as the engine's verified process start (identity check at startup).
    pub(crate) fn accept_process_start(&mut self, iid: &str, start: f64) {
        self.process_starts.insert(iid.to_string(), start);
    }

    #[cfg(test)]
    /// The last [`EVENT_HISTORY`] events, oldest first.
    pub(crate) fn events(&self) -> impl Iterator<Item = &Value> {
        self.events.iter()
    }

    /// Events emitted since the last call, for the journal.
    pub(crate) fn take_events(&mut self) -> Vec<LifecycleEvent> {
        std::mem::take(&mut self.pending)
    }

    /// The earliest monotonic instant at which [`Lifecycle::refresh`] could change a state
    /// without a resident-count change (a drain deadline), for the driver's timer.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
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
}
