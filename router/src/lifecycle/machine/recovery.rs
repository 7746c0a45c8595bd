//! Recovery of a breaker-ejected engine without a restart (behaviour.md 4.9;
//! handoff-and-lifecycle.md, "Readmitting engines"): on its own, or as the co-target of an
//! individual readmission.

use narwhal_shared::handoff::DrainState;

use super::record::{Hold, Record};
use super::{Lifecycle, Now, RestartPolicy};
use crate::journal::lifecycle::EventKind;

impl Lifecycle {
    /// Starts validation of an engine the breaker ejected, without a restart
    /// (behaviour.md 4.9; handoff-and-lifecycle.md, "Readmitting engines": "transient breaker
    /// ejection"). Returns `false` when it
    /// must not start now: another lifecycle action holds an engine, or under `whole_wave`
    /// (which instead requires a restart wave, see [`Lifecycle::require_restart_wave`]).
    pub(crate) fn start_recovery_validation(
        &mut self,
        now: Now,
        iid: &str,
        new_wave_id: &str,
    ) -> bool {
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
    /// a live peer (found by tests/tests/e2e/lifecycle_e2e.rs; a departure from the reference,
    /// which stays stuck until a whole-wave restart).
    ///
    /// Returns `false` (nothing changes) during a wave, for an unknown engine, or when the
    /// engine has a lifecycle record other than a failed recovery (`blocked`, no restart
    /// required, no wave).
    pub(crate) fn join_recovery(&mut self, now: Now, iid: &str) -> bool {
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
}
