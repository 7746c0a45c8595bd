//! Process identity through the agents: reading an engine's process start (a signed,
//! verified attestation) and the identity check at startup and after a takeover
//! (behaviour.md 4.10; architecture.md section 4).
//!
//! ```text
//!  check_identities ──capture(iid) per engine with an agent──► identity_verdict(...)
//!      Accept(start) ──► machine.accept_process_start     Exclude(reason) ──► Fleet::eject
//!      Skip (the lifecycle took the engine over meanwhile)
//! ```

use std::sync::Arc;

use super::agents::{Agents, agent_error, ended};
use super::check_error::CheckError;
use super::executor::Executor;
use super::machine::DrainState;
use crate::breaker::EjectCause;
use crate::fleet::Fleet;
use crate::ha_phase::{EpochScope, Ha};
use crate::journal::lifecycle::{EventKind, LifecycleEvent};
use crate::placement::Exclusion;

/// Reads process identities through the agents (cheap to clone: handles only).
#[derive(Clone)]
pub(crate) struct IdentityReader {
    pub(crate) agents: Arc<Agents>,
    pub(crate) ha: Arc<Ha>,
    pub(crate) fleet: Arc<Fleet>,
}

impl IdentityReader {
    /// Reads the engine's process start (Unix seconds) through its agent, as a signed,
    /// verified attestation fenced with `scope`'s epoch (never a later one: ha-and-fencing.md).
    ///
    /// # Errors
    /// [`CheckError::Unconfigured`], or [`CheckError::IdentityUnreadable`] (no agent, control
    /// under the scope's epoch ended, or the agent call failed; a stale-epoch answer to a call
    /// of the epoch held now also fences this router).
    pub(crate) async fn capture(&self, iid: &str, scope: &EpochScope) -> Result<f64, CheckError> {
        let i = self
            .fleet
            .index(iid)
            .ok_or_else(|| CheckError::Unconfigured {
                iid: iid.to_string(),
            })?;
        let unreadable = |e| CheckError::IdentityUnreadable(Box::new(e));
        let agent = self
            .agents
            .get(i)
            .ok_or_else(|| unreadable(CheckError::NoAgent))?;
        if let Some(detail) = ended(&self.ha, scope) {
            return Err(unreadable(CheckError::Agent { detail }));
        }
        let v = agent
            .attestation(iid, &scope.fence(), None)
            .await
            .map_err(|e| {
                unreadable(CheckError::Agent {
                    detail: agent_error(&self.ha, scope.epoch(), e),
                })
            })?;
        Ok(v.payload.header.process.process_start_time_seconds)
    }
}

/// Checks every engine's process identity through its agent (behaviour.md 4.10): at
/// startup and after a takeover. An engine whose process start differs from the one last
/// accepted restarted behind the router's back: it is ejected (cause `process_identity`) and
/// comes back only through validation. Engines held by the lifecycle are left alone. The
/// first fenced agent call also teaches each agent this router's epoch. The check runs under
/// `scope` (the epoch it started in): when control under it ends, nothing is applied.
pub(crate) async fn check_identities(exec: &Executor, reader: &IdentityReader, scope: &EpochScope) {
    let fleet = exec.fleet();
    let candidates: Vec<(usize, String, Option<f64>)> = {
        let lc = exec.lock();
        fleet.read(|state| {
            fleet
                .names()
                .iter()
                .zip(state.slots())
                .enumerate()
                .filter(|(i, _)| reader.agents.has(*i))
                .filter(|(_, (_, slot))| {
                    !slot.excluded.contains(&Exclusion::Draining)
                        && !slot.excluded.contains(&Exclusion::Ejected)
                })
                .map(|(i, (iid, _))| (i, iid.clone(), lc.process_starts().get(iid).copied()))
                .collect()
        })
    };
    // Engines left out of the check (held, ejected) still get one fenced call, in the
    // background, so every agent learns this router's epoch and refuses an older primary's
    // (architecture.md section 3) without delaying readiness.
    let others: Vec<String> = fleet
        .names()
        .iter()
        .enumerate()
        .filter(|(i, iid)| reader.agents.has(*i) && !candidates.iter().any(|(_, c, _)| c == *iid))
        .map(|(_, iid)| iid.clone())
        .collect();
    if !others.is_empty() {
        let reader = reader.clone();
        let scope = scope.clone();
        tokio::spawn(async move {
            let calls = futures_util::future::join_all(
                others.iter().map(|iid| reader.capture(iid, &scope)),
            );
            tokio::select! {
                _ = calls => {}
                () = scope.ended() => {}
            }
        });
    }
    let calls = futures_util::future::join_all(
        candidates
            .iter()
            .map(|(_, iid, _)| reader.capture(iid, scope)),
    );
    let reads = tokio::select! {
        r = calls => r,
        () = scope.ended() => return,
    };
    if !reader.ha.live(scope) {
        return;
    }
    let t = exec.now();
    let mut lc = exec.lock();
    for ((i, iid, before), r) in candidates.into_iter().zip(reads) {
        let previous = lc.process_starts().get(&iid).copied();
        let held = lc.state(&iid) != DrainState::Active;
        match identity_verdict(held, before, previous, &r) {
            IdentityVerdict::Skip => {}
            IdentityVerdict::Accept(start) => lc.accept_process_start(&iid, start),
            IdentityVerdict::Exclude(reason) => {
                tracing::warn!(engine.id = %iid, %reason, ?previous, "engine excluded by the identity check");
                let event = LifecycleEvent {
                    at: t.wall,
                    kind: EventKind::ProcessExcluded {
                        iid: iid.clone(),
                        reason,
                        previous_process_start: previous,
                        observed_process_start: r.ok(),
                    },
                };
                exec.journal().emit(event);
                fleet.eject(i, EjectCause::ProcessIdentity);
            }
        }
    }
    exec.commit(&mut lc);
}

/// What the identity check does with one engine's reading (behaviour.md 4.10).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum IdentityVerdict {
    /// The lifecycle took the engine over while the agent was being asked (a drain began, or a
    /// readmission accepted a newer start): its process is the lifecycle's business now.
    Skip,
    /// The same process as last accepted (or the first one seen): accept its start.
    Accept(f64),
    /// Changed or unreadable: eject (cause `process_identity`) with this reason.
    Exclude(String),
}

/// Decides on one reading. `held` is whether the engine has a non-`active` lifecycle record
/// now; `before`/`now` are its accepted start when the check began and now; `read` is the
/// process start read through the agent. Found by tests/tests/e2e/lifecycle_e2e.rs: applying a
/// reading taken before a drain began ejected engines in the middle of a planned restart.
pub(crate) fn identity_verdict(
    held: bool,
    before: Option<f64>,
    now: Option<f64>,
    read: &Result<f64, CheckError>,
) -> IdentityVerdict {
    if held || before != now {
        return IdentityVerdict::Skip;
    }
    match read {
        Ok(start) if now.is_none_or(|p| p == *start) => IdentityVerdict::Accept(*start),
        Ok(_) => IdentityVerdict::Exclude("engine process changed behind the router".into()),
        Err(e) => IdentityVerdict::Exclude(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_check_leaves_engines_the_lifecycle_took_over_meanwhile() {
        let err: Result<f64, CheckError> = Err(CheckError::IdentityUnreadable(Box::new(
            CheckError::HealthStatus { status: 503 },
        )));
        assert_eq!(
            identity_verdict(true, Some(1.0), Some(1.0), &err),
            IdentityVerdict::Skip,
            "a drain began while the agent was asked"
        );
        assert_eq!(
            identity_verdict(false, Some(1.0), Some(2.0), &Ok(1.0)),
            IdentityVerdict::Skip,
            "a readmission accepted a newer start meanwhile"
        );
        assert_eq!(
            identity_verdict(false, None, None, &Ok(5.0)),
            IdentityVerdict::Accept(5.0)
        );
        assert_eq!(
            identity_verdict(false, Some(5.0), Some(5.0), &Ok(5.0)),
            IdentityVerdict::Accept(5.0)
        );
        assert_eq!(
            identity_verdict(false, Some(5.0), Some(5.0), &Ok(6.0)),
            IdentityVerdict::Exclude("engine process changed behind the router".into())
        );
        assert_eq!(
            identity_verdict(false, Some(5.0), Some(5.0), &err),
            IdentityVerdict::Exclude("process identity unreadable: HTTP 503".into())
        );
    }
}
