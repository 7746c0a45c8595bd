//! The HA handoff on the router side: the live snapshot (`GET /narwhal/handoff`), the state
//! file writer (`recovery.state_path`), and applying a document (`--resume`, standby takeover)
//! (seed "HA handoff"; reference-notes 2.2, 2.5, 2.7, 2.8; DESIGN.md sections 7 and 9).
//!
//! The document's schema and validation live in `narwhal_shared::handoff`, shared by every
//! reader and writer; this module only maps it to and from the router's state.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use narwhal_shared::handoff::{
    COUNTERS, DemandRisk, Handoff, Loaded, REASON_TERMINALS, load_state_file, write_state_file,
};
use tokio_util::sync::CancellationToken;

use crate::breaker::EjectCause;
use crate::config::Role;
use crate::state::Shared;

/// The newest consolidation-risk event: kind, monotonic time, per-kind counts.
#[derive(Debug, Clone, Default)]
pub(crate) struct Demand {
    since: Option<std::time::Instant>,
    kind: String,
    events: BTreeMap<String, u64>,
    /// The document (`run`, bits of `at`) whose risk was last applied, so applying the same
    /// document twice (`--resume` at startup, then again when a delayed claim succeeds) does
    /// not add its counts twice.
    applied: Option<(String, u64)>,
}

impl Demand {
    /// Records an event of `kind` at `now`: `first_token_timeout` (a decode leg missed its
    /// first-token deadline) or `p_to_d_recovery` (a prefill→decode role move; this router
    /// never moves roles, so only a restored handoff carries that kind).
    pub(crate) fn record(&mut self, kind: &str, now: std::time::Instant) {
        if self.since.is_none_or(|s| now >= s) {
            self.since = Some(now);
            self.kind = kind.to_string();
        }
        *self.events.entry(kind.to_string()).or_default() += 1;
    }

    /// [`Demand::restore`] of the risk carried by the document written by `run` at `at`,
    /// unless that very document was already applied (found by ha_e2e: a primary restarted
    /// with `--resume` inside its lease TTL applied its state file at startup and again at its
    /// claim, doubling the counts). Re-anchoring it again would give the same time anyway.
    pub(crate) fn restore_once(
        &mut self,
        run: &str,
        at: f64,
        risk: &DemandRisk,
        gap_s: f64,
        now: std::time::Instant,
    ) {
        let id = (run.to_string(), at.to_bits());
        if self.applied.as_ref() == Some(&id) {
            return;
        }
        self.applied = Some(id);
        self.restore(risk, gap_s, now);
    }

    /// The handoff shape: `null` before any event (reference-notes 9).
    pub(crate) fn snapshot(&self, now: std::time::Instant) -> Option<DemandRisk> {
        let since = self.since?;
        Some(DemandRisk {
            kind: self.kind.clone(),
            age_s: now.saturating_duration_since(since).as_secs_f64(),
            events: self
                .events
                .iter()
                .filter(|(_, n)| **n > 0)
                .map(|(k, n)| (k.clone(), *n))
                .collect(),
        })
    }

    /// Applies a carried risk: the age is re-anchored to this process's clock, `gap_s`
    /// (seconds between the document's write, its `at`, and this apply, wall clock, clamped at
    /// 0) is added once, so the event keeps ageing through a takeover or a restart instead of
    /// looking `gap_s` younger (reference-notes 11.14: the reference drops the gap), and the
    /// counts are added to ours (reference-notes 9).
    pub(crate) fn restore(&mut self, risk: &DemandRisk, gap_s: f64, now: std::time::Instant) {
        let age = risk.age_s.max(0.0)
            + if gap_s.is_finite() {
                gap_s.max(0.0)
            } else {
                0.0
            };
        let since = Duration::try_from_secs_f64(age)
            .ok()
            .and_then(|a| now.checked_sub(a))
            .unwrap_or(now);
        if self.since.is_none_or(|s| since >= s) {
            self.since = Some(since);
            self.kind = risk.kind.clone();
        }
        for (k, n) in &risk.events {
            *self.events.entry(k.clone()).or_default() += n;
        }
    }
}

/// The live handoff document (reference-notes 2.2).
pub(crate) fn snapshot(shared: &Shared) -> Handoff {
    let ha = shared.ha();
    let lifecycle = {
        let lc = shared.lifecycle();
        lc.export()
    };
    let tally = shared.tally().clone();
    let core = shared.core();
    let names: Vec<&str> = shared.cfg.engines.iter().map(|e| e.iid.as_str()).collect();
    let mut engines: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    engines.sort();
    let roles = names
        .iter()
        .zip(core.slots.iter())
        .map(|(n, s)| (n.to_string(), s.role.as_str().to_string()))
        .collect();
    let mut ejected: Vec<String> = names
        .iter()
        .zip(core.slots.iter())
        .filter(|(_, s)| s.excluded.contains(&crate::placement::Exclusion::Ejected))
        .map(|(n, _)| n.to_string())
        .collect();
    ejected.sort();
    let inference_sources = names
        .iter()
        .zip(core.sources.iter())
        .filter(|(_, s)| !s.is_empty())
        .map(|(n, s)| (n.to_string(), s.iter().cloned().collect()))
        .collect();
    let unserved = core.unserved;
    drop(core);
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
    let demand_risk = shared.demand().snapshot(shared.clock.now());
    Handoff {
        schema: narwhal_shared::handoff::HANDOFF_SCHEMA.into(),
        schema_version: narwhal_shared::handoff::HANDOFF_VERSION,
        at: shared.wall(),
        run: shared.journal.run().to_string(),
        model: shared.cfg.model.clone(),
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

/// What applying a handoff restored, for the log and `/narwhal/state`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Applied {
    /// The writer's run id.
    pub(crate) run: String,
    /// Seconds between the document's `at` and the apply (wall clock; logged only).
    pub(crate) gap_s: f64,
}

/// Applies a validated handoff to this router (reference-notes 2.7, with the model compared
/// too). Process-local state (histograms, breaker streaks, attempt accounting, resident
/// tracking) starts fresh, as the seed lists.
///
/// # Errors
/// A one-line reason when the document describes another fleet, model or policy, or its
/// lifecycle part cannot be restored; nothing is applied then.
pub(crate) fn apply(shared: &Shared, h: &Handoff) -> Result<Applied, String> {
    h.validate().map_err(|e| e.to_string())?;
    let names: Vec<String> = shared.cfg.engines.iter().map(|e| e.iid.clone()).collect();
    h.matches_fleet(
        &shared.cfg.model,
        &names,
        shared.cfg.recovery.engine_restart_policy.as_str(),
    )?;
    let now = crate::lifecycle::Now {
        mono: shared.clock.now(),
        wall: shared.wall(),
    };
    // Lifecycle first: it is the only step that can still refuse.
    {
        let mut lc = shared.lifecycle();
        let mut restored = lc.clone();
        restored.restore(now, &h.lifecycle)?;
        *lc = restored;
        crate::lifecycle::driver::commit(shared, &mut lc);
    }
    {
        let mut core = shared.core();
        let core = &mut *core;
        for (i, e) in shared.cfg.engines.iter().enumerate() {
            if !e.pin
                && let Some(role) = h.roles.get(&e.iid)
            {
                core.slots[i].role = if role == "prefill" {
                    Role::Prefill
                } else {
                    Role::Decode
                };
            }
            if h.ejected.contains(&e.iid) {
                let tr = core.breaker.eject_now(i, EjectCause::Restored, now.mono);
                shared.apply_transitions(core, &tr);
            }
            if let Some(sources) = h.inference_sources.get(&e.iid) {
                core.sources[i] = sources.iter().cloned().collect();
            }
        }
        core.unserved = h.counters.get("unserved").copied().unwrap_or(0);
    }
    {
        let mut t = shared.tally();
        let c = |k: &str| h.counters.get(k).copied().unwrap_or(0);
        t.offered = c("offered");
        t.unsized_offered = c("unsized_offered");
        t.served = c("served");
        t.slo_met = c("slo_met");
        t.expired = c("expired");
        t.invalid_requests = c("invalid_requests");
        t.failed = c("failed");
        t.refused = c("refused");
        t.rejected = c("rejected");
        t.cancelled = c("cancelled");
        for terminal in REASON_TERMINALS {
            let total = c(terminal);
            let carried = h.outcome_reasons.get(terminal).cloned().unwrap_or_default();
            let entry = t.reasons.entry(terminal).or_default();
            for v in entry.values_mut() {
                *v = 0;
            }
            let mut sum = 0;
            for (k, n) in carried {
                sum += n;
                entry.insert(k, n);
            }
            if total > sum {
                *entry.entry("unclassified".into()).or_default() += total - sum;
            }
        }
        shared.metrics.restore_totals(&t, h);
    }
    let applied = Applied {
        run: h.run.clone(),
        gap_s: (now.wall - h.at).max(0.0),
    };
    if let Some(risk) = &h.demand_risk {
        shared
            .demand()
            .restore_once(&h.run, h.at, risk, applied.gap_s, now.mono);
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
pub(crate) fn resume(shared: &Shared) -> Option<String> {
    let path = PathBuf::from(&shared.cfg.recovery.state_path);
    let reason = match load_state_file(&path) {
        Loaded::Absent => {
            tracing::info!(path = %path.display(), "no state file to resume from; starting fresh");
            return None;
        }
        Loaded::Valid(h) => match apply(shared, &h) {
            Ok(_) => return None,
            Err(e) => e,
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
pub(crate) async fn persist(shared: &Arc<Shared>) {
    if !shared.ha().controls_fleet {
        return; // a standby or fenced router never overwrites the fleet's state
    }
    let doc = snapshot(shared);
    let path = PathBuf::from(&shared.cfg.recovery.state_path);
    let res = tokio::task::spawn_blocking(move || write_state_file(&path, &doc)).await;
    match res {
        Ok(Ok(())) => {
            shared.metrics.state_writes.inc();
        }
        Ok(Err(e)) => {
            shared.metrics.state_write_failures.inc();
            tracing::warn!(error = %e, "state file write failed; the previous file is intact");
        }
        Err(e) => tracing::warn!(error = %e, "state file writer panicked"),
    }
}

/// Writes the state file when the lifecycle or ejections change (woken through
/// `state_dirty`) and at least every `controller.monitor_interval_s`.
pub(crate) async fn writer(shared: Arc<Shared>, stop: CancellationToken) {
    let period = crate::config::secs(shared.cfg.controller.monitor_interval_s)
        .max(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                persist(&shared).await;
                return;
            }
            _ = shared.state_dirty.notified() => {}
            _ = tokio::time::sleep(period) => {}
        }
        persist(&shared).await;
    }
}

/// Marks the state as changed so the writer persists it promptly.
pub(crate) fn mark_dirty(shared: &Shared) {
    shared.state_dirty.notify_one();
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, SystemClock};

    #[test]
    fn demand_risk_is_null_until_an_event_and_reanchors_on_restore() {
        let t0 = SystemClock.now();
        let mut d = Demand::default();
        assert!(d.snapshot(t0).is_none());
        d.record("first_token_timeout", t0);
        d.record("first_token_timeout", t0 + Duration::from_secs(2));
        let snap = d.snapshot(t0 + Duration::from_secs(5)).expect("risk");
        assert_eq!(snap.kind, "first_token_timeout");
        assert!((snap.age_s - 3.0).abs() < 1e-9);
        assert_eq!(snap.events["first_token_timeout"], 2);
        // A receiving router re-anchors the age to its own clock.
        let t1 = t0 + Duration::from_secs(100);
        let mut other = Demand::default();
        other.restore(&snap, 0.0, t1);
        let again = other.snapshot(t1 + Duration::from_secs(1)).expect("risk");
        assert!((again.age_s - 4.0).abs() < 1e-9, "{}", again.age_s);
        assert_eq!(again.events["first_token_timeout"], 2);
    }

    #[test]
    fn the_same_document_is_applied_once() {
        let t1 = SystemClock.now() + Duration::from_secs(1000);
        let carried = DemandRisk {
            kind: "first_token_timeout".into(),
            age_s: 1.0,
            events: BTreeMap::from([("first_token_timeout".to_string(), 1)]),
        };
        let mut d = Demand::default();
        d.restore_once("1-aa", 500.0, &carried, 0.5, t1);
        d.restore_once("1-aa", 500.0, &carried, 2.5, t1 + Duration::from_secs(2));
        let snap = d.snapshot(t1 + Duration::from_secs(2)).expect("risk");
        assert_eq!(snap.events["first_token_timeout"], 1, "not doubled");
        assert!((snap.age_s - 3.5).abs() < 1e-9, "{}", snap.age_s);
        // Another document (another writer, or a later write) is another apply.
        d.restore_once("2-bb", 501.0, &carried, 0.0, t1 + Duration::from_secs(2));
        let snap = d.snapshot(t1 + Duration::from_secs(2)).expect("risk");
        assert_eq!(snap.events["first_token_timeout"], 2);
    }

    /// Found by ha_e2e: a standby retained a document 10 ms after the event and took over 2 s
    /// later; the new primary reported the risk as 10 ms old. The write→apply gap counts once.
    #[test]
    fn restored_demand_risk_keeps_ageing_through_the_gap() {
        let t1 = SystemClock.now() + Duration::from_secs(1000);
        let carried = DemandRisk {
            kind: "first_token_timeout".into(),
            age_s: 0.01,
            events: BTreeMap::from([("first_token_timeout".to_string(), 1)]),
        };
        let mut d = Demand::default();
        d.restore(&carried, 2.0, t1);
        let snap = d.snapshot(t1 + Duration::from_millis(500)).expect("risk");
        assert!((snap.age_s - 2.51).abs() < 1e-9, "{}", snap.age_s);
        assert_eq!(snap.events["first_token_timeout"], 1);
        // A writer clock ahead of ours (negative gap) or a nonsense gap adds nothing.
        for gap in [-5.0, f64::NAN, f64::INFINITY] {
            let mut d = Demand::default();
            d.restore(&carried, gap, t1);
            let snap = d.snapshot(t1).expect("risk");
            assert!((snap.age_s - 0.01).abs() < 1e-9, "{gap}: {}", snap.age_s);
        }
    }
}
