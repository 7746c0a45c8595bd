//! One engine's lifecycle record and what it is held for: [`Hold`] (a drain, a wave member, a
//! breaker recovery) and [`Record`] with its wire form [`DrainRecord`] (behaviour.md 4.1), and
//! the wave id a record shows.

use std::time::Instant;

use narwhal_shared::handoff::{DrainRecord, DrainState};

use super::Now;

/// What a record holds (or held) its engine for, and so what readmits it: the combinations of
/// the wire record's `restart_required`, `wave_id` and drain deadline that can occur. Kept
/// after readmission (the document still shows `restart_required`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Hold {
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
    pub(crate) fn restart_required(self) -> bool {
        !matches!(self, Hold::Recovery)
    }

    /// A member of the active wave.
    pub(crate) fn in_wave(self) -> bool {
        matches!(self, Hold::Wave { .. })
    }

    /// The monotonic drain deadline, if the hold has one.
    pub(crate) fn deadline(self) -> Option<Instant> {
        match self {
            Hold::Drain { deadline } | Hold::Wave { deadline } => deadline,
            Hold::Recovery => None,
        }
    }

    /// The same hold outside the wave (the wave was readmitted).
    pub(super) fn leave_wave(self) -> Hold {
        match self {
            Hold::Wave { deadline } => Hold::Drain { deadline },
            other => other,
        }
    }
}

/// One engine's lifecycle record as the machine keeps it (behaviour.md 4.1); the wire form
/// is [`DrainRecord`]. Times are wall-clock Unix seconds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Record {
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
    pub(super) fn new(
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
    pub(crate) fn restart_required(&self) -> bool {
        self.hold.restart_required()
    }

    /// A member of the active wave.
    pub(crate) fn in_wave(&self) -> bool {
        self.hold.in_wave()
    }

    /// The wire form; `wave_id` is the active wave's id.
    pub(super) fn to_wire(&self, wave_id: &str) -> DrainRecord {
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
    pub(super) fn from_wire(r: &DrainRecord, deadline: Option<Instant>) -> Record {
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

/// The record's wave id: the active wave's for a member, `""` otherwise.
pub(super) fn wave_str<'a>(rec: &Record, active: &'a str) -> &'a str {
    if rec.in_wave() { active } else { "" }
}

/// [`wave_str`], owned, for an event.
pub(super) fn wave_of(rec: &Record, active: &str) -> String {
    wave_str(rec, active).to_string()
}
