//! Readmission bookkeeping around validation (behaviour.md 1.10, 4.7; architecture.md 9.7):
//! accepting a readmission ([`Lifecycle::mark_validating`]), a failed or interrupted validation,
//! and the readmission itself. The checks run outside the machine (`validation`); their result
//! per engine comes back as an [`EngineOutcome`].

use std::collections::BTreeMap;

use narwhal_shared::handoff::DrainState;

use super::record::wave_of;
use super::refusal::LifecycleError;
use super::{Lifecycle, Now};
use crate::journal::lifecycle::EventKind;

/// Result of one engine's validation, as the readmission plan reports it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct EngineOutcome {
    /// Checks passed, in order.
    pub checks: Vec<String>,
    /// Failures, in order (empty when every check passed).
    pub failures: Vec<String>,
    /// Process start (Unix seconds) the checks were bound to, when read.
    pub process_start: Option<f64>,
}

impl Lifecycle {
    /// Accepts a readmission request and moves its targets to `validating`
    /// (behaviour.md 1.10 and 4.7). Returns the sorted targets.
    ///
    /// # Errors
    /// A [`LifecycleError`] (HTTP 409); nothing changes.
    pub(crate) fn mark_validating(
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
    pub(crate) fn validation_failed(
        &mut self,
        now: Now,
        outcome: &BTreeMap<String, EngineOutcome>,
    ) {
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
    pub(crate) fn abort_validation(&mut self, now: Now, error: &str) {
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
    pub(crate) fn readmitted(
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
}
