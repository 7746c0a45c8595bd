//! The HA handoff on the router side: the live snapshot (`GET /narwhal/handoff`), the state
//! file writer (`recovery.state_path`), and applying a document (`--resume`, standby takeover)
//! (seed "HA handoff"; reference-notes 2.2, 2.5, 2.7, 2.8; DESIGN.md sections 7 and 9).
//!
//! ```text
//!  Fleet + Accounting + Lifecycle + Demand + Ha ──snapshot()──► Handoff ──► GET, state file
//!  Handoff ──apply()──► Lifecycle::restore, Fleet::restore, Accounting::restore, Demand
//! ```
//!
//! The document's schema and validation live in `narwhal_shared::handoff`, shared by every
//! reader and writer; this module only maps it to and from the router's parts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use narwhal_shared::handoff::{
    COUNTERS, Handoff, HandoffError, Loaded, REASON_TERMINALS, load_state_file, write_state_file,
};
use tokio_util::sync::CancellationToken;

use crate::config::Role;
use crate::lifecycle::machine::RestoreError;
use crate::parts::Parts;
use crate::placement::Exclusion;

/// The live handoff document (reference-notes 2.2).
pub(crate) fn snapshot(parts: &Parts) -> Handoff {
    let ha = parts.ha.view().status;
    let lifecycle = parts.lifecycle.export();
    let tally = parts.accounting.tally();
    let names = parts.fleet.names();
    let mut engines: Vec<String> = names.to_vec();
    engines.sort();
    let (roles, ejected, inference_sources) = parts.fleet.read(|fleet| {
        let roles: BTreeMap<String, String> = names
            .iter()
            .zip(fleet.slots())
            .map(|(n, s)| (n.clone(), s.role.as_str().to_string()))
            .collect();
        let mut ejected: Vec<String> = names
            .iter()
            .zip(fleet.slots())
            .filter(|(_, s)| s.excluded.contains(&Exclusion::Ejected))
            .map(|(n, _)| n.clone())
            .collect();
        ejected.sort();
        let sources: BTreeMap<String, Vec<String>> = names
            .iter()
            .zip(fleet.suspects())
            .filter(|(_, s)| !s.is_empty())
            .map(|(n, s)| (n.clone(), s.iter().cloned().collect()))
            .collect();
        (roles, ejected, sources)
    });
    let unserved = parts.accounting.unserved();
    let counters: BTreeMap<String, u64> = COUNTERS
        .iter()
        .map(|c| {
            let v = match *c {
                "offered" => tally.offered,
                "unsized_offered" => tally.unsized_offered,
                "served" => tally.served,
                "slo_met" => tally.slo_met,
                "expired" => tally.expired,
                "invalid_requests" => tally.invalid_requests,
                "failed" => tally.failed,
                "refused" => tally.refused,
                "rejected" => tally.rejected,
                "cancelled" => tally.cancelled,
                _ => unserved,
            };
            (c.to_string(), v)
        })
        .collect();
    let outcome_reasons = REASON_TERMINALS
        .iter()
        .map(|t| {
            let reasons = tally
                .reasons
                .get(t)
                .map(|m| {
                    m.iter()
                        .filter(|(_, n)| **n > 0)
                        .map(|(k, n)| (k.clone(), *n))
                        .collect()
                })
                .unwrap_or_default();
            (t.to_string(), reasons)
        })
        .collect();
    let demand_risk = parts.demand.lock().snapshot(parts.clock.now());
    Handoff {
        schema: narwhal_shared::handoff::HANDOFF_SCHEMA.into(),
        schema_version: narwhal_shared::handoff::HANDOFF_VERSION,
        at: parts.wall(),
        run: parts.journal.run().to_string(),
        model: parts.cfg.model.clone(),
        epoch: ha.epoch,
        holder: ha.holder,
        engines,
        roles,
        ejected,
        inference_sources,
        counters,
        outcome_reasons,
        lifecycle,
        demand_risk,
    }
}

/// What applying a handoff restored, for the log.
#[derive(Debug, Clone, Default)]
pub(crate) struct Applied {
    /// The writer's run id.
    pub(crate) run: String,
    /// Seconds between the document's `at` and the apply (wall clock; logged only).
    pub(crate) gap_s: f64,
}

/// Why a handoff was not applied. Every variant names what does not fit.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum ApplyError {
    /// The document fails the schema rules (naming the field).
    #[error(transparent)]
    Invalid(#[from] HandoffError),
    /// The document describes another fleet, model or restart policy.
    #[error("{0}")]
    ForeignFleet(String),
    /// A role other than `prefill` or `decode` (never silently a decode engine).
    #[error("roles.{iid}: must be \"prefill\" or \"decode\", got {role:?}")]
    Role {
        /// The engine.
        iid: String,
        /// The carried role.
        role: String,
    },
    /// The lifecycle part cannot be restored (naming the record).
    #[error(transparent)]
    Lifecycle(#[from] RestoreError),
}

/// The typed roles of the fleet's unpinned engines that `h` carries, by engine index.
///
/// # Errors
/// [`ApplyError::Role`] for a role that is neither `prefill` nor `decode`.
fn carried_roles(parts: &Parts, h: &Handoff) -> Result<BTreeMap<usize, Role>, ApplyError> {
    let mut roles = BTreeMap::new();
    for (i, e) in parts.cfg.engines.iter().enumerate() {
        let Some(name) = h.roles.get(&e.iid) else {
            continue;
        };
        let role = Role::parse(name).ok_or_else(|| ApplyError::Role {
            iid: e.iid.clone(),
            role: name.clone(),
        })?;
        if !e.pin {
            roles.insert(i, role);
        }
    }
    Ok(roles)
}

/// Applies a validated handoff to this router (reference-notes 2.7, with the model compared
/// too). Process-local state (histograms, breaker streaks, attempt accounting, resident
/// tracking) starts fresh, as the seed lists.
///
/// # Errors
/// [`ApplyError`] when the document describes another fleet, model or policy, carries an
/// unknown role, or its lifecycle part cannot be restored; nothing is applied then.
pub(crate) fn apply(parts: &Parts, h: &Handoff) -> Result<Applied, ApplyError> {
    h.validate()?;
    let names = parts.fleet.names();
    h.matches_fleet(
        &parts.cfg.model,
        names,
        parts.cfg.recovery.engine_restart_policy.as_str(),
    )
    .map_err(ApplyError::ForeignFleet)?;
    let roles = carried_roles(parts, h)?;
    // Lifecycle first: it is the only step that can still refuse.
    parts.lifecycle.restore(&h.lifecycle)?;
    let index = |iid: &String| parts.fleet.index(iid);
    let ejected: BTreeSet<usize> = h.ejected.iter().filter_map(index).collect();
    let suspects: BTreeMap<usize, BTreeSet<String>> = h
        .inference_sources
        .iter()
        .filter_map(|(iid, s)| Some((index(iid)?, s.iter().cloned().collect())))
        .collect();
    parts.fleet.restore(&roles, &ejected, &suspects);
    parts.accounting.restore(h);
    let applied = Applied {
        run: h.run.clone(),
        gap_s: (parts.wall() - h.at).max(0.0),
    };
    if let Some(risk) = &h.demand_risk {
        parts
            .demand
            .lock()
            .restore_once(&h.run, h.at, risk, applied.gap_s, parts.clock.now());
    }
    tracing::info!(
        run = %applied.run,
        gap_s = applied.gap_s,
        epoch = h.epoch,
        ejected = ?h.ejected,
        served = h.counters.get("served").copied().unwrap_or(0),
        "handoff applied"
    );
    Ok(applied)
}

/// `--resume` at startup (reference-notes 2.8, tightened): a valid document for this fleet
/// is applied; a missing file starts fresh; a torn, invalid or foreign file is moved aside to
/// `<state_path>.refused` (so the next write cannot destroy the evidence) and reported.
/// Returns the refusal reason, if any.
pub(crate) fn resume(parts: &Parts) -> Option<String> {
    let path = PathBuf::from(&parts.cfg.recovery.state_path);
    let reason = match load_state_file(&path) {
        Loaded::Absent => {
            tracing::info!(path = %path.display(), "no state file to resume from; starting fresh");
            return None;
        }
        Loaded::Valid(h) => match apply(parts, &h) {
            Ok(_) => return None,
            Err(e) => e.to_string(),
        },
        Loaded::Refused(e) => e,
    };
    let aside = PathBuf::from(format!("{}.refused", path.display()));
    if let Err(e) = std::fs::rename(&path, &aside) {
        tracing::warn!(error = %e, "could not move the refused state file aside");
    }
    tracing::error!(%reason, kept = %aside.display(), "--resume refused the state file");
    Some(format!("handoff rejected: {reason}"))
}

/// Writes the state file now (validate, temp file, fsync, rename, fsync directory).
pub(crate) async fn persist(parts: &Parts) {
    if !parts.ha.controls_fleet() {
        return; // a standby or fenced router never overwrites the fleet's state
    }
    let doc = snapshot(parts);
    let path = PathBuf::from(&parts.cfg.recovery.state_path);
    let res = tokio::task::spawn_blocking(move || write_state_file(&path, &doc)).await;
    match res {
        Ok(Ok(())) => {
            parts.metrics.state_writes.inc();
        }
        Ok(Err(e)) => {
            parts.metrics.state_write_failures.inc();
            tracing::warn!(error = %e, "state file write failed; the previous file is intact");
        }
        Err(e) => tracing::warn!(error = %e, "state file writer panicked"),
    }
}

/// Writes the state file when the lifecycle or ejections change (woken through
/// [`Parts::dirty`]) and at least every `controller.monitor_interval_s`.
pub(crate) async fn writer(parts: Arc<Parts>, stop: CancellationToken) {
    let period =
        crate::config::secs(parts.cfg.controller.monitor_interval_s).max(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                persist(&parts).await;
                return;
            }
            _ = parts.dirty.notified() => {}
            _ = tokio::time::sleep(period) => {}
        }
        persist(&parts).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, ManualClock, SystemClock};

    fn parts() -> Arc<Parts> {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        crate::parts::for_test(
            serde_json::json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
                "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                            {"iid": "d0", "url": "http://127.0.0.1:2"},
                            {"iid": "d1", "url": "http://127.0.0.1:3", "pin": true}],
                "slo": {"ttft_s": 1.0, "tpot_s": 0.1}
            }),
            clock,
            "test",
        )
    }

    /// Roles are typed when applied: anything but `prefill` or `decode` is refused naming the
    /// field (it used to become `decode` silently), and a pinned engine keeps its role.
    #[test]
    fn an_unknown_role_is_refused_naming_the_field() {
        let p = parts();
        let mut h = snapshot(&p);
        h.roles.insert("p0".into(), "both".into());
        let e = carried_roles(&p, &h).unwrap_err();
        assert_eq!(
            e.to_string(),
            "roles.p0: must be \"prefill\" or \"decode\", got \"both\""
        );
        let e = apply(&p, &h).unwrap_err().to_string();
        assert!(e.contains("roles.p0"), "{e}");
        h.roles.insert("p0".into(), "decode".into());
        h.roles.insert("d1".into(), "prefill".into());
        assert_eq!(
            carried_roles(&p, &h).unwrap(),
            BTreeMap::from([(0, Role::Decode), (1, Role::Decode)]),
            "d1 is pinned"
        );
        apply(&p, &h).expect("applies");
        let roles = snapshot(&p).roles;
        assert_eq!(
            (roles["p0"].as_str(), roles["d1"].as_str()),
            ("decode", "decode")
        );
    }
}
