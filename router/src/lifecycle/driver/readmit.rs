//! The readmission actions: `POST /narwhal/lifecycle/readmit` (handoff-and-lifecycle.md,
//! "Readmitting engines"; behaviour.md 1.10, 4.7–4.8), with the ejected peer an individual
//! readmission validates alongside its target ([`co_target`]), and
//! `POST /narwhal/lifecycle/cancel-drain` (ours; docs/deviations.md).

use std::collections::BTreeSet;

use crate::breaker::EjectCause;
use crate::config::Role;
use crate::ha_phase::EpochScope;
use crate::lifecycle::action::{ActionError, Outcome, ReadmitRequest};
use crate::metrics::labels;

use super::LifecycleDriver;

impl LifecycleDriver {
    /// `POST /narwhal/lifecycle/readmit` (handoff-and-lifecycle.md, "Readmitting engines";
    /// behaviour.md 1.10, 4.7–4.8), run by `api` under the one-action-at-a-time lock with
    /// control under `scope` checked. The targets go `validating`, the six checks run through
    /// the agents, and a pass returns them to placement.
    ///
    /// # Errors
    /// [`ActionError::Refused`] by a readmission rule (nothing changes);
    /// [`ActionError::FencedDuringValidation`] when control under `scope` ended during the
    /// checks; [`ActionError::ValidationFailed`] when a check failed (the targets are `blocked`).
    pub(crate) async fn readmit(
        &self,
        req: ReadmitRequest,
        scope: EpochScope,
    ) -> Result<Outcome, ActionError> {
        let targets = {
            let counts = self.fleet().resident_counts();
            let mut lc = self.exec.lock();
            let t = self.exec.now();
            let resident = |iid: &str| counts.get(iid).copied().unwrap_or(0);
            let mut targets = lc
                .mark_validating(t, &req.engines, req.wave, resident)
                .map_err(ActionError::Refused)?;
            if !req.wave {
                let roles = self.roles();
                let live = self.fleet().live_names();
                let ejected = self.fleet().ejected_names();
                if let Some(peer) = co_target(&roles, &targets[0], &live, &ejected)
                    && lc.join_recovery(t, &peer)
                {
                    targets.push(peer);
                    targets.sort();
                }
            }
            self.exec.commit(&mut lc);
            targets
        };
        let report = self.run_validation(&targets, req.wave, &scope).await;
        self.finish(&targets, report, "operator", &scope).await
    }

    /// `POST /narwhal/lifecycle/cancel-drain` (ours; docs/deviations.md), run by `api` under
    /// the one-action-at-a-time lock with control under `scope` checked: an engine drained by
    /// mistake returns to service without a restart. Body `{"engines": ["e0"]}`. The engine
    /// must be held by an individual drain that recorded its process; it is validated through
    /// the readmission checks with no restart required (`process identity` instead of `new
    /// process identity`) and must still be that process. Success: back in placement
    /// (`drain_cancelled` event).
    ///
    /// # Errors
    /// [`ActionError::CancelRefused`] by a rule (nothing changes);
    /// [`ActionError::CancelValidationFailed`] when the checks failed or the process was
    /// restarted (the engine stays `blocked`, restart-required: a restart and the readmission
    /// of handoff-and-lifecycle.md, or another cancel, bring it back);
    /// [`ActionError::FencedDuringValidation`] when control under `scope` ended meanwhile.
    pub(crate) async fn cancel_drain(
        &self,
        req: ReadmitRequest,
        scope: EpochScope,
    ) -> Result<Outcome, ActionError> {
        let (iid, recorded) = {
            let mut lc = self.exec.lock();
            let x = lc
                .begin_cancel_drain(self.exec.now(), &req.engines, req.wave)
                .map_err(ActionError::CancelRefused)?;
            self.exec.commit(&mut lc);
            x
        };
        let targets = vec![iid.clone()];
        let mut plan = self.plan(&targets, false);
        plan.restart_after.insert(iid.clone(), None);
        let report = self.run_plan(&plan, &scope).await;
        let record_metric = |result: &str| {
            self.metrics
                .roles
                .lifecycle_validations
                .get_or_create(&labels(&[
                    ("iid", &iid),
                    ("kind", "cancel_drain"),
                    ("result", result),
                ]))
                .inc();
        };
        // Control under the action's epoch ended: nothing of the report is applied.
        let mut report = match report {
            Some(r) if self.ha().live(&scope) => r,
            _ => {
                let fenced = self.abort_fenced(self.exec.now());
                record_metric("fenced");
                return Err(fenced);
            }
        };
        for peer in &report.changed_peers {
            if let Some(i) = self.fleet().index(peer) {
                self.fleet().eject(i, EjectCause::ProcessIdentity);
            }
        }
        // The cancel is for the process the drain recorded; a restarted one is readmitted.
        let validated = report.engines.get(&iid).and_then(|o| o.process_start);
        if report.passed() && validated != Some(recorded) {
            let found = validated.map_or_else(|| "unknown".to_string(), |s| format!("{s:.3}"));
            report.engines.entry(iid.clone()).or_default().failures.push(format!(
                "engine process restarted since the drain (process start {found}, recorded {recorded:.3}): readmit it instead"
            ));
        }
        let t = self.exec.now();
        if !self.ha().live(&scope) {
            let fenced = self.abort_fenced(t);
            record_metric("fenced");
            return Err(fenced);
        }
        let mut lc = self.exec.lock();
        if report.passed() {
            let outcome = report.engines.get(&iid).cloned().unwrap_or_default();
            if lc.drain_cancelled(t, &iid, &outcome)
                && let Some(i) = self.fleet().index(&iid)
            {
                self.fleet().verified(i);
            }
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("passed");
            Ok(Outcome::default())
        } else {
            lc.validation_failed(t, &report.engines);
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("failed");
            Err(ActionError::CancelValidationFailed)
        }
    }
}

/// The ejected engine an individual readmission of `target` must validate alongside it
/// ([`Lifecycle::join_recovery`](crate::lifecycle::Lifecycle::join_recovery)): when no engine
/// of the opposite role is live, the first ejected one in config order. `None` when a live
/// peer exists (the usual case), for an aggregated fleet (one role), or when no opposite-role
/// engine is ejected.
fn co_target(
    roles: &[(String, Role)],
    target: &str,
    live: &BTreeSet<String>,
    ejected: &BTreeSet<String>,
) -> Option<String> {
    let role = roles.iter().find(|(i, _)| i == target)?.1;
    let opposite = match role {
        Role::Prefill => Role::Decode,
        Role::Decode => Role::Prefill,
    };
    let mut others = roles
        .iter()
        .filter(|(i, r)| *r == opposite && i != target)
        .peekable();
    others.peek()?;
    let others: Vec<&String> = others.map(|(i, _)| i).collect();
    if others.iter().any(|i| live.contains(*i)) {
        return None;
    }
    others.into_iter().find(|i| ejected.contains(*i)).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ejected_peer_is_a_co_target_only_when_no_peer_is_live() {
        let roles = vec![
            ("p0".to_string(), Role::Prefill),
            ("d0".to_string(), Role::Decode),
            ("d1".to_string(), Role::Decode),
        ];
        let set = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        assert_eq!(
            co_target(&roles, "p0", &set(&["d1"]), &set(&["d0"])),
            None,
            "d1 is a live peer"
        );
        assert_eq!(
            co_target(&roles, "p0", &set(&[]), &set(&["d1", "d0"])),
            Some("d0".to_string()),
            "first ejected peer in config order"
        );
        assert_eq!(
            co_target(&roles, "d0", &set(&[]), &set(&["d1"])),
            None,
            "d1 has the target's own role; p0 is held, not ejected"
        );
        let aggregated = vec![
            ("e0".to_string(), Role::Decode),
            ("e1".to_string(), Role::Decode),
        ];
        assert_eq!(co_target(&aggregated, "e0", &set(&[]), &set(&["e1"])), None);
    }
}
