//! Draining (behaviour.md 4.3–4.5; architecture.md 9.4, 9.5): the request and its plan, the
//! drain rules ([`Lifecycle::begin`]), binding the captured process identity
//! ([`Lifecycle::bind_identity`]) and drain progress ([`Lifecycle::refresh`]).

use std::collections::BTreeSet;
use std::time::Duration;

use narwhal_shared::handoff::DrainState;

use super::record::{Hold, Record, wave_of};
use super::refusal::LifecycleError;
use super::{Lifecycle, MAX_DEADLINE_S, Now, RestartPolicy};
use crate::journal::lifecycle::EventKind;
use crate::lifecycle::check_error::CheckError;

/// A drain request (`POST /narwhal/lifecycle/drain`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DrainRequest {
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
pub(crate) struct DrainPlan {
    /// The drain's targets (sorted).
    pub targets: Vec<String>,
    /// Targets whose process identity must be captured (through their agents) and bound
    /// with [`Lifecycle::bind_identity`].
    pub capture: Vec<String>,
    /// True when the request repeated an accepted drain: nothing changed (architecture.md 9.5).
    pub repeated: bool,
}

impl Lifecycle {
    /// Starts a drain (behaviour.md 4.3, rules checked in that order), with
    /// architecture.md 9.5: repeating an accepted drain is not an error.
    ///
    /// `live` is the set of engines currently eligible for placement; `new_wave_id` names the
    /// wave if one starts. Every target leaves placement (is [`Lifecycle::held`]) on return,
    /// before the driver captures identities.
    ///
    /// # Errors
    /// A [`LifecycleError`] (HTTP 409); nothing changes.
    pub(crate) fn begin(
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
    pub(crate) fn bind_identity(
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
    pub(crate) fn refresh(&mut self, now: Now, resident: impl Fn(&str) -> u32) {
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
}
