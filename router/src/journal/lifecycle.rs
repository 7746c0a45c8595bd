//! Lifecycle events (behaviour.md 4.1 `events`, 7.8): one typed event per transition of
//! the machine, rendered as the journal row and the document entry
//! `{"event": "engine_lifecycle", "action", "at", <fields>}` with the reference's keys in the
//! reference's order.

use serde::{Serialize, Serializer};
use serde_json::Value;

use super::Event;

/// What happened, with the fields of its event row in the reference's order (serialised
/// untagged: the `action` comes from [`LifecycleEvent::action`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub(crate) enum EventKind {
    /// An engine left placement for a drain (`drain_started`).
    DrainStarted {
        /// The engine.
        iid: String,
        /// Its wave, `""` for an individual drain.
        wave_id: String,
    },
    /// A whole-fleet wave drain began (`wave_started`).
    WaveStarted {
        /// Every engine, sorted.
        engines: Vec<String>,
        /// The wave.
        wave_id: String,
    },
    /// A drained engine's process start was recorded (`process_recorded`).
    ProcessRecorded {
        /// The engine.
        iid: String,
        /// Unix seconds.
        process_start: f64,
        /// Its wave, `""` when none.
        wave_id: String,
    },
    /// The process identity could not be recorded (`drain_blocked`).
    DrainBlocked {
        /// The engine.
        iid: String,
        /// Why.
        error: String,
        /// Its wave, `""` when none.
        wave_id: String,
    },
    /// No resident work is left and the identity is recorded (`drain_complete`).
    DrainComplete {
        /// The engine.
        iid: String,
        /// Its wave, `""` when none.
        wave_id: String,
    },
    /// The drain deadline passed with work resident (`drain_deadline_exceeded`).
    DrainDeadlineExceeded {
        /// The engine.
        iid: String,
        /// Requests still resident.
        resident: u32,
        /// Its wave, `""` when none.
        wave_id: String,
    },
    /// Every member of the wave is drained (`wave_ready_to_stop`).
    WaveReadyToStop {
        /// The members.
        engines: Vec<String>,
        /// The wave.
        wave_id: String,
    },
    /// Readmission validation began (`validation_started`).
    ValidationStarted {
        /// The engine.
        iid: String,
        /// Its wave, `""` when none.
        wave_id: String,
    },
    /// Validation failed; the engine is blocked (`validation_failed`).
    ValidationFailed {
        /// The engine.
        iid: String,
        /// Why.
        error: String,
        /// Its wave, `""` when none.
        wave_id: String,
    },
    /// The engine returned to service (`readmitted`).
    Readmitted {
        /// The engine.
        iid: String,
        /// The validated process start.
        process_start: Option<f64>,
        /// Its wave, `""` when none.
        wave_id: String,
    },
    /// The whole wave returned to service (`wave_readmitted`).
    WaveReadmitted {
        /// The members.
        engines: Vec<String>,
        /// The wave.
        wave_id: String,
    },
    /// A breaker-ejected engine's recovery validation began
    /// (`recovery_validation_started`).
    RecoveryValidationStarted {
        /// The engine.
        iid: String,
    },
    /// A cancel of an individual drain began: the drained process is validated without a
    /// restart (`drain_cancel_started`; ours, docs/deviations.md).
    DrainCancelStarted {
        /// The engine.
        iid: String,
    },
    /// The drain was cancelled: the same process passed the checks and is back in service
    /// (`drain_cancelled`; ours).
    DrainCancelled {
        /// The engine.
        iid: String,
        /// The validated process start (the one the drain recorded).
        process_start: Option<f64>,
    },
    /// Every engine is held in a restart-required wave (`restart_required`).
    RestartRequired {
        /// The new wave.
        wave_id: String,
        /// Why.
        reason: String,
    },
    /// The identity check ejected an engine whose process changed or could not be read
    /// (`process_excluded`; journal only).
    ProcessExcluded {
        /// The engine.
        iid: String,
        /// Why.
        reason: String,
        /// The start accepted before, if any.
        previous_process_start: Option<f64>,
        /// The start read now, if it could be read.
        observed_process_start: Option<f64>,
    },
}

/// One lifecycle event at wall time `at` (Unix seconds).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LifecycleEvent {
    /// When, wall-clock Unix seconds.
    pub at: f64,
    /// What.
    pub kind: EventKind,
}

impl LifecycleEvent {
    /// The event's `action` name.
    pub(crate) fn action(&self) -> &'static str {
        match &self.kind {
            EventKind::DrainStarted { .. } => "drain_started",
            EventKind::WaveStarted { .. } => "wave_started",
            EventKind::ProcessRecorded { .. } => "process_recorded",
            EventKind::DrainBlocked { .. } => "drain_blocked",
            EventKind::DrainComplete { .. } => "drain_complete",
            EventKind::DrainDeadlineExceeded { .. } => "drain_deadline_exceeded",
            EventKind::WaveReadyToStop { .. } => "wave_ready_to_stop",
            EventKind::ValidationStarted { .. } => "validation_started",
            EventKind::ValidationFailed { .. } => "validation_failed",
            EventKind::Readmitted { .. } => "readmitted",
            EventKind::WaveReadmitted { .. } => "wave_readmitted",
            EventKind::RecoveryValidationStarted { .. } => "recovery_validation_started",
            EventKind::RestartRequired { .. } => "restart_required",
            EventKind::ProcessExcluded { .. } => "process_excluded",
            EventKind::DrainCancelStarted { .. } => "drain_cancel_started",
            EventKind::DrainCancelled { .. } => "drain_cancelled",
        }
    }

    /// The engine the event is about, if one.
    pub(crate) fn iid(&self) -> Option<&str> {
        match &self.kind {
            EventKind::DrainStarted { iid, .. }
            | EventKind::ProcessRecorded { iid, .. }
            | EventKind::DrainBlocked { iid, .. }
            | EventKind::DrainComplete { iid, .. }
            | EventKind::DrainDeadlineExceeded { iid, .. }
            | EventKind::ValidationStarted { iid, .. }
            | EventKind::ValidationFailed { iid, .. }
            | EventKind::Readmitted { iid, .. }
            | EventKind::RecoveryValidationStarted { iid }
            | EventKind::ProcessExcluded { iid, .. }
            | EventKind::DrainCancelStarted { iid }
            | EventKind::DrainCancelled { iid, .. } => Some(iid),
            EventKind::WaveStarted { .. }
            | EventKind::WaveReadyToStop { .. }
            | EventKind::WaveReadmitted { .. }
            | EventKind::RestartRequired { .. } => None,
        }
    }

    /// The wave the event is about, `""` when none.
    pub(crate) fn wave_id(&self) -> &str {
        match &self.kind {
            EventKind::DrainStarted { wave_id, .. }
            | EventKind::WaveStarted { wave_id, .. }
            | EventKind::ProcessRecorded { wave_id, .. }
            | EventKind::DrainBlocked { wave_id, .. }
            | EventKind::DrainComplete { wave_id, .. }
            | EventKind::DrainDeadlineExceeded { wave_id, .. }
            | EventKind::WaveReadyToStop { wave_id, .. }
            | EventKind::ValidationStarted { wave_id, .. }
            | EventKind::ValidationFailed { wave_id, .. }
            | EventKind::Readmitted { wave_id, .. }
            | EventKind::WaveReadmitted { wave_id, .. }
            | EventKind::RestartRequired { wave_id, .. } => wave_id,
            EventKind::RecoveryValidationStarted { .. }
            | EventKind::ProcessExcluded { .. }
            | EventKind::DrainCancelStarted { .. }
            | EventKind::DrainCancelled { .. } => "",
        }
    }

    /// The event row: `event`, `action`, `at`, then the kind's fields in the reference's
    /// order ([`Event::EngineLifecycle`]).
    pub(crate) fn to_json(&self) -> Value {
        Event::from(self.clone()).to_value()
    }
}

impl Serialize for LifecycleEvent {
    /// `action`, `at`, then the kind's fields; the kinds that name no wave end with
    /// `"wave_id": ""`, as the reference writes them. `event` is the enclosing
    /// [`Event`]'s tag.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        /// The row's members in order.
        #[derive(Serialize)]
        struct Row<'a> {
            action: &'static str,
            at: f64,
            #[serde(flatten)]
            kind: &'a EventKind,
            #[serde(skip_serializing_if = "Option::is_none")]
            wave_id: Option<&'static str>,
        }
        let no_wave = matches!(
            self.kind,
            EventKind::RecoveryValidationStarted { .. }
                | EventKind::DrainCancelStarted { .. }
                | EventKind::DrainCancelled { .. }
        );
        Row {
            action: self.action(),
            at: self.at,
            kind: &self.kind,
            wave_id: no_wave.then_some(""),
        }
        .serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows keep the reference's key order (supervisors and the journal readers see the
    /// same bytes as before the events were typed).
    #[test]
    fn rows_render_in_the_reference_key_order() {
        let ev = LifecycleEvent {
            at: 1.5,
            kind: EventKind::DrainDeadlineExceeded {
                iid: "p0".into(),
                resident: 2,
                wave_id: String::new(),
            },
        };
        assert_eq!(
            ev.to_json().to_string(),
            r#"{"event":"engine_lifecycle","action":"drain_deadline_exceeded","at":1.5,"iid":"p0","resident":2,"wave_id":""}"#
        );
        let ev = LifecycleEvent {
            at: 2.0,
            kind: EventKind::RestartRequired {
                wave_id: "wave-1".into(),
                reason: "r".into(),
            },
        };
        assert_eq!(
            ev.to_json().to_string(),
            r#"{"event":"engine_lifecycle","action":"restart_required","at":2.0,"wave_id":"wave-1","reason":"r"}"#
        );
        assert_eq!((ev.iid(), ev.wave_id()), (None, "wave-1"));
        let ev = LifecycleEvent {
            at: 3.0,
            kind: EventKind::RecoveryValidationStarted { iid: "d0".into() },
        };
        assert_eq!(ev.to_json()["wave_id"], "");
        assert_eq!(ev.iid(), Some("d0"));
    }
}
