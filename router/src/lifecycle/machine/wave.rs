//! Whole-fleet waves and `ready_to_stop` (behaviour.md 4.6, 4.9; architecture.md 9.3): who
//! is in the active wave, when the wave and an engine may be stopped, and the restart-required
//! wave that holds every engine.

use narwhal_shared::handoff::DrainState;

use super::record::{Hold, Record};
use super::{Lifecycle, Now};
use crate::journal::lifecycle::EventKind;

impl Lifecycle {
    /// The active wave's members, by engine id; empty when no wave is active.
    pub(super) fn wave_members(&self) -> Vec<String> {
        self.records
            .values()
            .filter(|r| !self.wave_id.is_empty() && r.in_wave())
            .map(|r| r.iid.clone())
            .collect()
    }

    /// Every member of the active wave is drained. False when no wave is active
    /// (architecture.md 9.3; the reference compares non-wave records, behaviour.md 11.4).
    pub(crate) fn wave_ready_to_stop(&self) -> bool {
        let members = self.wave_members();
        !members.is_empty()
            && members
                .iter()
                .all(|i| self.records[i].state == DrainState::Drained)
    }

    /// The external supervisor may stop this engine's process now (behaviour.md 4.6).
    pub(crate) fn ready_to_stop(&self, iid: &str) -> bool {
        self.records.get(iid).is_some_and(|r| {
            r.old_process_start.is_some()
                && r.state == DrainState::Drained
                && (!r.in_wave() || self.wave_ready_to_stop())
        })
    }

    /// Holds every engine in a new restart-required wave (behaviour.md 4.9). A no-op while
    /// a wave is active unless `reset`.
    pub(crate) fn require_restart_wave(
        &mut self,
        now: Now,
        reason: &str,
        reset: bool,
        new_wave_id: &str,
    ) {
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
}
