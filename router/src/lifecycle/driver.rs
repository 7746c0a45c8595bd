//! The lifecycle part: the pure machine behind its [`Executor`], the agents, and the
//! one-action-at-a-time lock; the lifecycle document, the drain-deadline and resident-change
//! timer, recovery of breaker-ejected engines and the role check of a flipped engine
//! (handoff-and-lifecycle.md, "Lifecycle API"; architecture.md 9.2–9.7). The HTTP actions
//! are in `drain` and `readmit` (typed requests in, [`Outcome`](super::action::Outcome) or
//! [`ActionError`](super::action::ActionError) out; `api` parses, locks and answers), and the
//! checks they run in `validate`.
//!
//! ```text
//!  POST drain ──api──► drain: machine.begin ──commit──► capture identities
//!                                        ──► machine.bind_identity ──► commit
//!  POST readmit ──api──► readmit: machine.mark_validating ──► validate (checks)
//!                                        ──► machine.readmitted | validation_failed ──► commit
//!  monitor: probe ok ──recover(i)──► machine.start_recovery_validation ──► validate ──► ...
//!  timer: drain deadline | Fleet::resident_changed ──► Executor::refresh
//! ```
//!
//! One lifecycle action runs at a time (`serial`, held across the agent calls); the pure
//! machine is only touched through the [`Executor`]. Every action runs under the
//! [`EpochScope`](crate::ha_phase::EpochScope) of the epoch it was accepted in
//! (ha-and-fencing.md): its agent calls carry that epoch, it stops when control under it ends,
//! and it never acts under a later one. A router that does not control the fleet shows no
//! actionable lifecycle state (no `ready_to_stop`) and names the router that does, when known.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use narwhal_shared::Clock;
use narwhal_shared::documents::Lifecycle as LifecycleDocument;
use narwhal_shared::documents::lifecycle::ControllerRef;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::action::NOT_IN_CONTROL;
use super::agents::Agents;
use super::executor::Executor;
use super::identity::{IdentityReader, check_identities};
use super::machine::{EngineView, Lifecycle, RestartPolicy, RestoreError};
use crate::config::Config;
use crate::fleet::Fleet;
use crate::ha_phase::Ha;
use crate::journal::Journal;
use crate::metrics::Metrics;
use crate::placement::Exclusion;
use crate::readiness::Gate;
use crate::upstream::Upstream;

mod drain;
mod readmit;
mod validate;

/// Why a flipped engine's role check did not pass ([`LifecycleDriver::role_check`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RoleCheckError {
    /// This router does not control the fleet (nothing was checked).
    #[error("{}", NOT_IN_CONTROL)]
    NotInControl,
    /// Another lifecycle action holds the engine (nothing was checked).
    #[error("a lifecycle action holds {iid}")]
    Held {
        /// The engine.
        iid: String,
    },
    /// A check failed, or the check could not finish: the engine's record error, or the
    /// answer's (`role check failed` when it names none).
    #[error("{0}")]
    Failed(String),
}

/// The lifecycle part (see the module doc).
pub(crate) struct LifecycleDriver {
    exec: Executor,
    reader: IdentityReader,
    /// Serialises lifecycle actions end to end, agent calls included.
    serial: tokio::sync::Mutex<()>,
    /// Wakes the timer when a drain starts (a new deadline).
    wake: Notify,
    cfg: Arc<Config>,
    gate: Arc<Gate>,
    upstream: Upstream,
    metrics: Arc<Metrics>,
}

/// What the lifecycle part is built over.
pub(crate) struct Handles {
    pub(crate) cfg: Arc<Config>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) fleet: Arc<Fleet>,
    pub(crate) ha: Arc<Ha>,
    pub(crate) gate: Arc<Gate>,
    pub(crate) upstream: Upstream,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) journal: Journal,
    pub(crate) dirty: Arc<Notify>,
}

fn new_wave_id() -> String {
    let u = uuid::Uuid::new_v4().simple().to_string();
    format!("wave-{}", &u[..12])
}

impl LifecycleDriver {
    /// A lifecycle with no holds over the configured engines and `agents`.
    pub(crate) fn new(h: Handles, agents: Agents) -> LifecycleDriver {
        let machine = Lifecycle::new(
            h.cfg.engines.iter().map(|e| e.iid.clone()).collect(),
            h.cfg.recovery.engine_restart_policy,
        );
        LifecycleDriver {
            exec: Executor::new(
                machine,
                h.fleet.clone(),
                h.gate.clone(),
                h.journal,
                h.dirty,
                h.clock,
                h.ha.clone(),
            ),
            reader: IdentityReader {
                agents: Arc::new(agents),
                ha: h.ha,
                fleet: h.fleet,
            },
            serial: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            cfg: h.cfg,
            gate: h.gate,
            upstream: h.upstream,
            metrics: h.metrics,
        }
    }

    fn fleet(&self) -> &Fleet {
        self.exec.fleet()
    }

    /// The executor (tests drive the machine through it).
    #[cfg(test)]
    pub(crate) fn executor(&self) -> &Executor {
        &self.exec
    }

    /// The HA handle: the epoch scope an action runs under, and whether control under it
    /// is still live.
    pub(crate) fn ha(&self) -> &Ha {
        &self.reader.ha
    }

    /// The one-action-at-a-time lock, held by an action end to end (its agent calls
    /// included), and by recovery and role checks.
    pub(crate) fn serial(&self) -> &tokio::sync::Mutex<()> {
        &self.serial
    }

    /// The engines' agents.
    pub(crate) fn agents(&self) -> &Agents {
        &self.reader.agents
    }

    /// Wakes at the next drain deadline, when a drain starts, and when a held engine's
    /// resident count changes, and re-evaluates drain progress (architecture.md 9.4).
    pub(crate) async fn run_timer(&self, stop: CancellationToken) {
        loop {
            if !self.ha().controls_fleet() {
                // Drain progress is the controlling router's to decide (ha-and-fencing.md): wait
                // for a change of HA phase (or a second, for a lapse the phase did not show yet).
                let mut phase = self.ha().subscribe();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = phase.changed() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                continue;
            }
            let next = self.exec.lock().next_deadline();
            let wait = async {
                match next {
                    Some(d) => {
                        tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await;
                        // The deadline is strict (now > deadline): step past it.
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = self.fleet().resident_changed() => {}
                _ = wait => {}
            }
            self.exec.refresh();
        }
    }

    /// The lifecycle document, schema `narwhal.lifecycle` (handoff-and-lifecycle.md, "Lifecycle
    /// API"), with `error` (`""` on success).
    pub(crate) fn document(&self, error: &str) -> LifecycleDocument {
        let gate = self.gate.view();
        let lc = self.exec.lock();
        let fleet = self.fleet();
        let views: BTreeMap<String, EngineView> = fleet.read(|state| {
            fleet
                .names()
                .iter()
                .zip(state.slots())
                .map(|(iid, s)| {
                    let view = EngineView {
                        resident_prefill: s.resident_prefill,
                        resident_decode: s.resident_decode,
                        accepts_new: s.is_live(),
                    };
                    (iid.clone(), view)
                })
                .collect()
        });
        let mut doc = lc.document(
            gate.controls_label(),
            gate.readiness.ready,
            |iid| views.get(iid).copied().unwrap_or_default(),
            error,
        );
        drop(lc);
        not_in_control(
            &mut doc,
            gate.ha.controls,
            gate.ha.status.controller.as_ref(),
        );
        doc
    }

    /// Lifecycle gauges for `/metrics`: `(iid, state, ready_to_stop)` per engine
    /// (`ready_to_stop` only from the router that controls the fleet).
    pub(crate) fn gauges(&self) -> Vec<(String, &'static str, bool)> {
        let controls = self.ha().controls_fleet();
        let lc = self.exec.lock();
        self.fleet()
            .names()
            .iter()
            .map(|iid| {
                let stop = controls && lc.ready_to_stop(iid);
                (iid.clone(), lc.state(iid).as_str(), stop)
            })
            .collect()
    }

    /// The durable part for the handoff (behaviour.md 2.1 `lifecycle`).
    pub(crate) fn export(&self) -> narwhal_shared::handoff::LifecycleState {
        self.exec.lock().export()
    }

    /// Restores a handoff's lifecycle part and applies its holds (behaviour.md 4.13).
    ///
    /// # Errors
    /// [`RestoreError`] naming the offending record; nothing changes then.
    pub(crate) fn restore(
        &self,
        state: &narwhal_shared::handoff::LifecycleState,
    ) -> Result<(), RestoreError> {
        let now = self.exec.now();
        let mut lc = self.exec.lock();
        let mut restored = lc.clone();
        restored.restore(now, state)?;
        *lc = restored;
        self.exec.commit(&mut lc);
        Ok(())
    }

    /// The role check of a flipped engine (ours; docs/deviations.md): the readmission checks,
    /// without a restart, against engine `i` in its new router role, so the KV-transfer check pairs
    /// it with a live engine of the other role. The engine is held (a recovery record,
    /// `validating`) while they run; a failure leaves it held, `blocked` with the error.
    /// Returns the checks passed.
    ///
    /// # Errors
    /// [`RoleCheckError`]: not in control, the engine held by another action, or the failed
    /// check's error.
    pub(crate) async fn role_check(&self, i: usize) -> Result<Vec<String>, RoleCheckError> {
        let _serial = self.serial.lock().await;
        // Only the router that controls the fleet checks, under its epoch's scope.
        let Some(scope) = self.ha().scope() else {
            return Err(RoleCheckError::NotInControl);
        };
        let iid = self.cfg.engines[i].iid.clone();
        let started = {
            let mut lc = self.exec.lock();
            let ok = lc.join_recovery(self.exec.now(), &iid);
            self.exec.commit(&mut lc);
            ok
        };
        if !started {
            return Err(RoleCheckError::Held { iid });
        }
        let targets = vec![iid.clone()];
        let report = self.run_validation(&targets, false, &scope).await;
        let finished = self.finish(&targets, report, "role_check", &scope).await;
        let record = self.exec.lock().record(&iid).cloned();
        match (finished, record) {
            (Ok(_), Some(r)) => Ok(r.checks),
            (_, Some(r)) if !r.error.is_empty() => Err(RoleCheckError::Failed(r.error)),
            // The answer's `error`: the refusal's message (`role check failed` when it names
            // none).
            (finished, _) => Err(RoleCheckError::Failed(
                finished
                    .err()
                    .map(|e| e.to_string())
                    .filter(|m| !m.is_empty())
                    .unwrap_or_else(|| "role check failed".to_string()),
            )),
        }
    }

    /// Recovery of a breaker-ejected engine whose health probe passed: validate the running
    /// process through the same checks (no restart required) and readmit it; under
    /// `whole_wave` an ejection instead requires a whole-wave restart (behaviour.md 4.9).
    /// Returns whether the engine is back in placement.
    pub(crate) async fn recover(&self, i: usize) -> bool {
        let Ok(_serial) = self.serial.try_lock() else {
            return false; // another lifecycle action runs; the next probe retries
        };
        // A probe sent while the engine was ejected can answer after a readmission (which
        // holds the serial lock) returned it to placement: there is nothing left to recover,
        // and under `whole_wave` starting a recovery would hold the whole fleet again (found
        // by tests/tests/e2e/lifecycle_e2e.rs under load; main dfdfeaa, carried over here).
        if !self.fleet().is_ejected(i) {
            return true;
        }
        let Some(scope) = self.ha().scope() else {
            return false; // only the router that controls the fleet recovers engines
        };
        let iid = self.cfg.engines[i].iid.clone();
        let started = {
            let mut lc = self.exec.lock();
            let ok = lc.start_recovery_validation(self.exec.now(), &iid, &new_wave_id());
            self.exec.commit(&mut lc);
            ok
        };
        if !started {
            return false;
        }
        let targets = vec![iid];
        let report = self.run_validation(&targets, false, &scope).await;
        self.finish(&targets, report, "recovery", &scope)
            .await
            .is_ok()
    }

    /// Under `whole_wave`, an ejection requires a whole-wave restart (behaviour.md 4.9).
    pub(crate) fn enforce_whole_wave(&self) {
        if self.cfg.recovery.engine_restart_policy != RestartPolicy::WholeWave
            || !self.ha().controls_fleet()
        {
            return;
        }
        // The machine's lock is taken first and held while the exclusions are read (the
        // order `finish` uses): a readmission that un-ejects an engine and ends its wave in
        // between would otherwise be followed by a new wave for an ejection that no longer
        // exists (main dfdfeaa).
        let mut lc = self.exec.lock();
        let fleet = self.fleet();
        let first = fleet.read(|state| {
            fleet
                .names()
                .iter()
                .zip(state.slots())
                .find(|(_, s)| s.excluded.contains(&Exclusion::Ejected))
                .map(|(iid, _)| iid.clone())
        });
        let Some(first) = first else { return };
        if !lc.wave_id().is_empty() {
            return;
        }
        lc.require_restart_wave(
            self.exec.now(),
            &format!("engine {first} was excluded"),
            false,
            &new_wave_id(),
        );
        self.exec.commit(&mut lc);
    }

    /// `--resume` refused the state file. With an agent on every engine the fleet's
    /// processes can be re-verified, so (as the reference does with a contract,
    /// behaviour.md 2.8) every engine is held in a restart-required wave: the operator
    /// drains the wave, restarts, readmits. Without agents the router serves with fresh state
    /// and reports the reason in `/narwhal/state.ha.resume`.
    pub(crate) fn resume_refused(&self, reason: &str) {
        self.ha().set_resume_refused(reason);
        if !self.agents().all() {
            return;
        }
        let mut lc = self.exec.lock();
        lc.require_restart_wave(self.exec.now(), reason, true, &new_wave_id());
        self.exec.commit(&mut lc);
    }

    /// Checks every engine's process identity through its agent (behaviour.md 4.10): at
    /// startup and after a takeover ([`check_identities`]).
    pub(crate) async fn check_identities(&self) {
        let Some(scope) = self.ha().scope() else {
            return; // control ended before the check began: nothing to check for
        };
        check_identities(&self.exec, &self.reader, &scope).await;
    }
}

/// The lifecycle document of a router that does not control the fleet (ha-and-fencing.md): nothing
/// in it is actionable (every `ready_to_stop` false, engine and wave), and `router.controller`
/// names the router that controls the fleet when this one saw its lease record (`null`
/// otherwise; the router itself when it controls).
fn not_in_control(
    doc: &mut LifecycleDocument,
    controls: bool,
    controller: Option<&crate::ha_phase::Controller>,
) {
    doc.router.controller = match controller {
        Some(c) if !controls => Some(ControllerRef {
            holder: c.holder.clone(),
            epoch: c.epoch,
        }),
        _ => None,
    };
    if controls {
        return;
    }
    doc.wave.ready_to_stop = false;
    for e in doc.engines.values_mut() {
        e.ready_to_stop = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ha-and-fencing.md: a router that does not control the fleet shows nothing actionable (no
    /// `ready_to_stop`, engine or wave) and names the controller it saw; the controlling one
    /// keeps its document as it is, with `controller` null.
    #[test]
    fn a_router_out_of_control_shows_nothing_actionable_and_names_the_controller() {
        let doc = || {
            let mut d = LifecycleDocument::default();
            d.router.controls_fleet = "fenced".into();
            d.wave.id = "wave-1".into();
            d.wave.ready_to_stop = true;
            let p0 = narwhal_shared::documents::lifecycle::Engine {
                state: super::super::DrainState::Drained,
                ready_to_stop: true,
                ..Default::default()
            };
            d.engines.insert("p0".into(), p0);
            d.engines.insert("d0".into(), Default::default());
            d
        };
        let c = crate::ha_phase::Controller {
            holder: "standby:9".into(),
            epoch: 4,
        };
        let mut d = doc();
        not_in_control(&mut d, false, Some(&c));
        assert!(!d.wave.ready_to_stop);
        assert!(!d.engines["p0"].ready_to_stop);
        assert_eq!(
            d.engines["p0"].state,
            super::super::DrainState::Drained,
            "the record is still shown"
        );
        assert_eq!(
            d.router.controller,
            Some(ControllerRef {
                holder: "standby:9".into(),
                epoch: 4
            })
        );
        let mut d = doc();
        not_in_control(&mut d, false, None);
        assert_eq!(d.router.controller, None, "unknown");
        assert!(!d.engines["p0"].ready_to_stop);
        let mut d = doc();
        not_in_control(&mut d, true, Some(&c));
        assert!(d.engines["p0"].ready_to_stop, "in control: unchanged");
        assert!(d.wave.ready_to_stop);
        assert_eq!(d.router.controller, None);
    }

    /// ha-and-fencing.md: a fenced router's lifecycle document and gauges say nothing may be
    /// stopped, and its lifecycle actions are refused.
    #[tokio::test]
    async fn a_fenced_router_never_reports_ready_to_stop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (parts, _clock) = crate::ha_phase::tests::leased(dir.path());
        assert_eq!(parts.ha.lease().claim().await, Ok(1));
        parts.ha.publish(crate::ha_phase::HaPhase::Active);
        // p0 drained with a recorded identity (as a drain with an agent leaves it).
        {
            let mut lc = parts.lifecycle.exec.lock();
            let req = super::super::machine::DrainRequest {
                engines: vec!["p0".into()],
                wave: false,
                deadline_s: 30.0,
                deadline_given: true,
            };
            let now = parts.lifecycle.exec.now();
            let live = parts.fleet.live_names();
            lc.begin(now, &req, &live, "wave-x").expect("drain");
            assert!(lc.bind_identity(now, "p0", Ok(1.0e9 - 5.0), false));
            lc.refresh(now, |_| 0);
            parts.lifecycle.exec.commit(&mut lc);
        }
        let d = parts.lifecycle.document("");
        assert!(d.engines["p0"].ready_to_stop, "{d:#?}");
        assert!(
            parts
                .lifecycle
                .gauges()
                .iter()
                .any(|(i, _, stop)| i == "p0" && *stop)
        );
        parts.ha.fence(&narwhal_lease::LeaseLoss::HeldByAnother);
        let d = parts.lifecycle.document("");
        assert_eq!(d.router.controls_fleet, "fenced");
        assert!(!d.engines["p0"].ready_to_stop, "{d:#?}");
        assert_eq!(d.engines["p0"].state, super::super::DrainState::Drained);
        assert!(parts.lifecycle.gauges().iter().all(|(_, _, stop)| !stop));
        let (status, d) = crate::lifecycle::api::handle(
            &parts.lifecycle,
            crate::lifecycle::api::Action::Drain,
            &bytes::Bytes::from_static(br#"{"engines": ["d0"]}"#),
        )
        .await;
        assert_eq!(status, http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(d.document.error, NOT_IN_CONTROL);
    }
}
