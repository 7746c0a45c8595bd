//! The lifecycle part of the handoff (behaviour.md 2.1 `lifecycle`, 4.13): what is exported,
//! and how a successor restores it ([`RestoreError`] when it cannot).

use std::collections::BTreeMap;
use std::time::Duration;

use narwhal_shared::handoff::DrainState;

use super::record::Record;
use super::{EVENT_HISTORY, Lifecycle, MAX_DEADLINE_S, Now};

/// Why a handoff's lifecycle part cannot be restored (nothing changes then).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum RestoreError {
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

impl Lifecycle {
    /// The durable part for the handoff (behaviour.md 2.1 `lifecycle`): records sorted by
    /// engine id, the last events, the policy and the accepted process starts.
    pub(crate) fn export(&self) -> narwhal_shared::handoff::LifecycleState {
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
    pub(crate) fn restore(
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
}
