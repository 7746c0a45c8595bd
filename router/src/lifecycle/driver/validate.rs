//! Running the readmission checks for the driver's actions and applying their report: the
//! validation plan built from the records and the live fleet, the checks run through the agents
//! under the action's epoch scope, and the readmission or the blocks that follow
//! (behaviour.md 4.7; architecture.md 9.7).

use std::collections::BTreeMap;

use crate::breaker::EjectCause;
use crate::config::{Backend, Role};
use crate::ha_phase::EpochScope;
use crate::lifecycle::action::{ActionError, Outcome};
use crate::lifecycle::agent_checks::AgentChecks;
use crate::lifecycle::validation::{Plan, Report, validate};
use crate::metrics::labels;

use super::LifecycleDriver;

impl LifecycleDriver {
    /// Every configured engine with its current router role (the role controller may have
    /// moved it from the configured one), config order.
    pub(super) fn roles(&self) -> Vec<(String, Role)> {
        let fleet = self.fleet();
        fleet.read(|state| {
            fleet
                .names()
                .iter()
                .zip(state.slots())
                .map(|(iid, s)| (iid.clone(), s.role))
                .collect()
        })
    }

    /// Control under the action's epoch ended while its checks ran: the validating records
    /// go back to where they were, nothing of the report is applied, and the action answers
    /// [`ActionError::FencedDuringValidation`] (503).
    pub(super) fn abort_fenced(&self, at: super::super::machine::Now) -> ActionError {
        let err = ActionError::FencedDuringValidation;
        let mut lc = self.exec.lock();
        lc.abort_validation(at, &err.to_string());
        self.exec.commit(&mut lc);
        err
    }

    /// Builds the validation plan for `targets` from the records and the live fleet.
    pub(super) fn plan(&self, targets: &[String], wave: bool) -> Plan {
        let lc = self.exec.lock();
        let restart_after = targets
            .iter()
            .map(|t| {
                let old = lc
                    .record(t)
                    .filter(|r| r.restart_required())
                    .and_then(|r| r.old_process_start);
                (t.clone(), old)
            })
            .collect();
        let accepted_starts = lc.process_starts().clone();
        drop(lc);
        let fleet = self.fleet();
        let verify_sources = fleet.read(|state| {
            targets
                .iter()
                .filter_map(|t| {
                    let s = &state.suspects()[fleet.index(t)?];
                    (!s.is_empty()).then(|| (t.clone(), s.iter().cloned().collect()))
                })
                .collect()
        });
        Plan {
            targets: targets.to_vec(),
            roles: self.roles(),
            live: fleet.live_names(),
            restart_after,
            accepted_starts,
            model: self.cfg.model.clone(),
            wave,
            direct_generation: self.cfg.backend != Backend::Sglang,
            verify_sources,
        }
    }

    /// Runs the checks under `scope`; `None` when control under its epoch ended first (the
    /// checks in flight are dropped, and none starts afterwards).
    pub(super) async fn run_validation(
        &self,
        targets: &[String],
        wave: bool,
        scope: &EpochScope,
    ) -> Option<Report> {
        self.run_plan(&self.plan(targets, wave), scope).await
    }

    /// Runs the checks of `plan` through the agents under `scope` (its fence token); `None`
    /// when control under its epoch ended first.
    pub(super) async fn run_plan(&self, plan: &Plan, scope: &EpochScope) -> Option<Report> {
        let checks = AgentChecks {
            cfg: &self.cfg,
            agents: self.agents(),
            ha: self.ha(),
            upstream: &self.upstream,
            scope,
            fence: scope.fence(),
        };
        let check_id = uuid::Uuid::new_v4().simple().to_string();
        tokio::select! {
            report = validate(plan, &checks, &check_id) => Some(report),
            () = scope.ended() => None,
        }
    }

    /// Applies a validation report: readmit on success, block every candidate on failure,
    /// eject peers whose process changed (behaviour.md 4.7; architecture.md 9.7).
    ///
    /// Before a passing SGLang prefill engine returns to placement, its bootstrap port is
    /// read again (`/server_info`) while it is still held, so no request is placed with a
    /// stale port (found by tests/tests/e2e/lifecycle_e2e.rs: refreshing after the release let
    /// the first requests' decodes fail their rendezvous). A failed refresh is logged;
    /// requests refresh the port on demand.
    ///
    /// # Errors
    /// [`ActionError::FencedDuringValidation`] when `report` is `None` or control under `scope`
    /// ended (the records stay held, `blocked`); [`ActionError::ValidationFailed`] when a check
    /// failed or a target's process start was not read (every candidate `blocked`).
    pub(super) async fn finish(
        &self,
        targets: &[String],
        report: Option<Report>,
        kind: &'static str,
        scope: &EpochScope,
    ) -> Result<Outcome, ActionError> {
        let record_metric = |result: &str| {
            for iid in targets {
                self.metrics
                    .roles
                    .lifecycle_validations
                    .get_or_create(&labels(&[("iid", iid), ("kind", kind), ("result", result)]))
                    .inc();
            }
        };
        let report = match report {
            Some(r) if self.ha().live(scope) => r,
            // Control under the validation's epoch ended: nothing of it is applied (no
            // readmission, no ejection); the records stay held (`blocked`, in this router's
            // memory only: its events are not written, and a successor restores `validating`
            // records as blocked).
            _ => {
                let fenced = self.abort_fenced(self.exec.now());
                record_metric("fenced");
                return Err(fenced);
            }
        };
        if report.passed() {
            // Every prefill target's port at once (a wave of SGLang engines is not read one
            // engine after another); each refresh touches only its own engine.
            let refresh = bootstrap_refresh(self.cfg.backend, &self.roles(), targets);
            let results =
                futures_util::future::join_all(refresh.iter().map(|&i| {
                    crate::bootstrap::refresh(&self.cfg, self.fleet(), &self.upstream, i)
                }))
                .await;
            for (&i, r) in refresh.iter().zip(results) {
                if let Err(e) = r {
                    tracing::warn!(engine.id = %self.cfg.engines[i].iid, error = %e, "bootstrap port refresh before readmission failed");
                }
            }
        }
        let t = self.exec.now();
        let passed = report.passed()
            && targets.iter().all(|iid| {
                report
                    .engines
                    .get(iid)
                    .is_some_and(|o| o.process_start.is_some())
            });
        // Nothing of the report is applied once control under its epoch ended (not even the
        // peers' ejections).
        let live = self.ha().live(scope);
        if live {
            for peer in &report.changed_peers {
                if let Some(i) = self.fleet().index(peer) {
                    self.fleet().eject(i, EjectCause::ProcessIdentity);
                }
            }
        }
        if !live {
            let fenced = self.abort_fenced(t);
            record_metric("fenced");
            return Err(fenced);
        }
        if passed {
            let outcome: BTreeMap<_, _> = report
                .engines
                .into_iter()
                .filter(|(iid, _)| targets.contains(iid))
                .collect();
            let mut lc = self.exec.lock();
            for iid in lc.readmitted(t, &outcome) {
                if let Some(i) = self.fleet().index(&iid) {
                    self.fleet().verified(i);
                }
            }
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("passed");
            Ok(Outcome::default())
        } else {
            let mut lc = self.exec.lock();
            lc.validation_failed(t, &report.engines);
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("failed");
            Err(ActionError::ValidationFailed)
        }
    }
}

/// The engines (indexes) among `targets` whose SGLang bootstrap port must be learnt again
/// before they take traffic: prefill engines of an SGLang fleet (a restarted prefill server
/// may serve its bootstrap rendezvous on a new port). Empty for vLLM.
fn bootstrap_refresh(
    backend: Backend,
    engines: &[(String, Role)],
    targets: &[String],
) -> Vec<usize> {
    if backend != Backend::Sglang {
        return Vec::new();
    }
    engines
        .iter()
        .enumerate()
        .filter(|(_, (iid, role))| *role == Role::Prefill && targets.contains(iid))
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglang_prefill_targets_refresh_their_bootstrap_port_before_release() {
        let engines = vec![
            ("p0".to_string(), Role::Prefill),
            ("d0".to_string(), Role::Decode),
            ("p1".to_string(), Role::Prefill),
        ];
        let all = ["p0".to_string(), "d0".to_string(), "p1".to_string()];
        assert_eq!(bootstrap_refresh(Backend::Sglang, &engines, &all), [0, 2]);
        assert_eq!(
            bootstrap_refresh(Backend::Sglang, &engines, &["d0".to_string()]),
            Vec::<usize>::new(),
            "decode engines have no bootstrap server"
        );
        assert_eq!(
            bootstrap_refresh(Backend::Vllm, &engines, &all),
            Vec::<usize>::new(),
            "vLLM has no rendezvous"
        );
    }
}
