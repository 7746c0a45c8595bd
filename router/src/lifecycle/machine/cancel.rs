//! Cancelling an individual drain without a restart (ours; docs/deviations.md): the engine is
//! validated on the very process its drain recorded.

use narwhal_shared::handoff::DrainState;

use super::readmission::EngineOutcome;
use super::record::Hold;
use super::refusal::LifecycleError;
use super::{Lifecycle, Now};
use crate::journal::lifecycle::EventKind;

impl Lifecycle {
    /// Starts cancelling an individual drain (ours; not in the reference,
    /// docs/deviations.md): the engine named in `engines` goes `validating`, to return to
    /// service without a restart once the readmission checks pass on the very process its
    /// drain recorded. The readmission of handoff-and-lifecycle.md (which requires a newer process)
    /// is unchanged.
    /// Returns the engine and that process start (Unix seconds).
    ///
    /// # Errors
    /// A [`LifecycleError`] (HTTP 409); nothing changes.
    pub(crate) fn begin_cancel_drain(
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
    pub(crate) fn drain_cancelled(&mut self, now: Now, iid: &str, outcome: &EngineOutcome) -> bool {
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
}
