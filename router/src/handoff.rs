//! The HA handoff on the router side: the live snapshot (`GET /narwhal/handoff`), the state
//! file writer (`recovery.state_path`), and applying a document (`--resume`, standby takeover)
//! (handoff-and-lifecycle.md, "HA handoff"; behaviour.md 2.2, 2.5, 2.7, 2.8; architecture.md
//! sections 7 and 9).
//!
//! ```text
//!  Fleet + Accounting + Lifecycle + Demand + Ha ──snapshot()──► Handoff ──► GET, state file
//!  Handoff ──apply()──► Lifecycle::restore, Fleet::restore, Accounting::restore, Demand
//! ```
//!
//! The document's schema and validation live in `narwhal_shared::handoff`, shared by every
//! reader and writer; this module only maps it to and from the router's parts.
//!
//! # Publishing (ha-and-fencing.md)
//!
//! ```text
//!  lifecycle change (dirty) ─┐
//!  lease renewal (renewed) ──┼─► publish(): snapshot ──► state file  (recovery.state_path)
//!  timer ────────────────────┤              └─────────► lease store (<lease>.handoff, <key>/handoff),
//!  acknowledge(drain|readmit)┤                          only while the lease record is ours
//!  GET state/handoff/metrics ┘
//! ```
//!
//! The controlling router publishes its handoff beside the lease record, guarded by the
//! record (`LeaseStore::publish`), whenever it changed: on every lifecycle change, every lease
//! renewal, before acknowledging a lifecycle action ([`acknowledge`]: an action is answered
//! 200 only once published) and before answering a document that shows its totals
//! ([`durable_document`]: a client never sees a total a successor would not restore). A
//! router that takes over reads the newest published document from the store
//! (`ha::standby`), so nothing acknowledged or shown is lost.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use narwhal_shared::documents::{ErrorReply, LifecycleReply};
use narwhal_shared::handoff::{
    COUNTERS, Handoff, HandoffError, Loaded, PersistError, REASON_TERMINALS, load_state_file,
    write_state_file,
};
use tokio_util::sync::CancellationToken;

use crate::config::Role;
use crate::ha_phase::EpochScope;
use crate::lifecycle::machine::RestoreError;
use crate::parts::Parts;
use crate::placement::Exclusion;
use narwhal_lease::{Control, LeaseError, LeaseLoss, LeaseRecord};

/// The live handoff document (behaviour.md 2.2).
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
        // A fixed vLLM KV producer or consumer keeps its configured role too.
        if !e.pin && e.kv_role.fixed_role().is_none() {
            roles.insert(i, role);
        }
    }
    Ok(roles)
}

/// Applies a validated handoff to this router (behaviour.md 2.7, with the model compared
/// too). Process-local state (histograms, breaker streaks, attempt accounting, resident
/// tracking) starts fresh, as handoff-and-lifecycle.md lists.
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

/// `--resume` at startup (behaviour.md 2.8, tightened): a valid document for this fleet
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

/// Why the state file was not written ([`write_state`]); the file holds a whole document, the
/// previous one unless only the final directory fsync failed.
#[derive(Debug, thiserror::Error)]
enum StateFileError {
    /// The document failed validation or a file-system step failed.
    #[error("state file: {0}")]
    Write(#[source] PersistError),
    /// The blocking writer task panicked.
    #[error("state file: {0}")]
    Writer(#[source] tokio::task::JoinError),
}

/// Writes `doc` to the state file now (validate, temp file, fsync, rename, fsync directory).
///
/// # Errors
/// [`StateFileError`] (logged and counted here too).
async fn write_state(parts: &Parts, doc: Handoff) -> Result<(), StateFileError> {
    let path = PathBuf::from(&parts.cfg.recovery.state_path);
    let res = tokio::task::spawn_blocking(move || write_state_file(&path, &doc)).await;
    match res {
        Ok(Ok(())) => {
            parts.metrics.durability.state_writes.inc();
            Ok(())
        }
        Ok(Err(e)) => {
            parts.metrics.durability.state_write_failures.inc();
            tracing::warn!(error = %e, "state file write failed; the file holds a whole document, the previous one unless only the directory fsync failed");
            Err(StateFileError::Write(e))
        }
        Err(e) => {
            tracing::warn!(error = %e, "state file writer panicked");
            Err(StateFileError::Writer(e))
        }
    }
}

/// Why a publish did not happen.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum PublishError {
    /// This router does not control the fleet (nothing of its state is the fleet's).
    #[error("this router does not control the fleet")]
    NotInControl,
    /// The lease store refused or failed the write; the router was fenced unless the lease
    /// had only lapsed locally.
    #[error("{0}")]
    Lease(LeaseLoss),
    /// The state file could not be written (lease backend `none`, where it is the only
    /// durable copy).
    #[error("{0}")]
    StateFile(String),
    /// Lease backend `none`: the state file was replaced but its directory's fsync failed,
    /// so the new state is in the file, not known durable.
    #[error("{0}")]
    StateFileUnconfirmed(String),
}

impl PublishError {
    /// Whether the new state was written and not confirmed ([`LeaseLoss::Unconfirmed`],
    /// [`PublishError::StateFileUnconfirmed`]): where a successor reads, it may be there.
    pub(crate) fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            PublishError::Lease(LeaseLoss::Unconfirmed(_)) | PublishError::StateFileUnconfirmed(_)
        )
    }
}

/// What decides whether a document changed since the last publish: everything but the write
/// time and the demand risk's age (both move with the clock alone).
fn content_key(doc: &Handoff) -> String {
    let mut d = doc.clone();
    d.at = 0.0;
    if let Some(r) = d.demand_risk.as_mut() {
        r.age_s = 0.0;
    }
    serde_json::to_string(&d).unwrap_or_default()
}

/// Publishes the handoff (ha-and-fencing.md): the live snapshot under the epoch held now, to the
/// state file and, with a lease backend, beside the lease record in its store (only while the
/// record is ours: `LeaseDriver::publish`). Skipped when nothing changed since the last
/// successful publish. `takeover`: the router claimed the lease and applied the state it
/// takes over but does not serve yet (its phase does not hold control); otherwise the router
/// must control the fleet.
///
/// With a lease backend, success means a successor will read this state (the state file is
/// best effort: its failure is logged and counted); with backend `none` the state file is
/// the durable copy and must be written.
///
/// Returns whether a document was written (`false`: unchanged since the last publish).
///
/// # Errors
/// [`PublishError`]; a store verdict (record not ours) or error also fences the router.
pub(crate) async fn publish(parts: &Parts, takeover: bool) -> Result<bool, PublishError> {
    let mut last = parts.ha.published().lock().await;
    let lease = parts.ha.lease();
    let controls = if takeover {
        lease.control(parts.clock.now()) == Control::Active
    } else {
        parts.ha.controls_fleet()
    };
    if !controls {
        return Err(PublishError::NotInControl);
    }
    let mut doc = snapshot(parts);
    if lease.enabled() {
        // The lease is authoritative: during a takeover the published phase still shows the
        // epoch before the claim.
        doc.epoch = lease.epoch();
        doc.holder = lease.holder();
    }
    let key = content_key(&doc);
    if last.as_deref() == Some(key.as_str()) {
        return Ok(false);
    }
    if !lease.enabled() {
        write_state(parts, doc).await.map_err(|e| match e {
            StateFileError::Write(PersistError::Io {
                step: "fsync directory",
                ..
            }) => PublishError::StateFileUnconfirmed(e.to_string()),
            e => PublishError::StateFile(e.to_string()),
        })?;
        *last = Some(key);
        return Ok(true);
    }
    let bytes = match serde_json::to_vec(&doc) {
        Ok(b) => b,
        Err(e) => return Err(PublishError::StateFile(format!("serialise: {e}"))),
    };
    let (_, stored) = tokio::join!(write_state(parts, doc), lease.publish(bytes));
    match stored {
        Ok(_) => {
            *last = Some(key);
            Ok(true)
        }
        Err(loss) => {
            if lease.control(parts.clock.now()) != Control::Active {
                // The store refused (the record is another router's) or failed: the driver
                // fenced the lease; the phase follows, and the supervisor moves to standby.
                parts.ha.fence(&loss);
            }
            tracing::warn!(reason = %loss, "handoff not published");
            Err(PublishError::Lease(loss))
        }
    }
}

/// Answers a lifecycle action (drain, readmit) only once its result is durable where a
/// successor reads it (ha-and-fencing.md): a 200 is kept after a successful [`publish`], and
/// becomes a 503 naming why otherwise (the change stays in this router's memory, unacknowledged;
/// the operator repeats the request). Other statuses pass unchanged.
///
/// `scope` is the epoch scope the action ran under (taken before it started): a publish made
/// after that scope ended (the router was paused past its lease, lost control and claimed it
/// again, applying a state that may not hold the change) acknowledges nothing. Found by the
/// `ha::model` property.
/// Runs lifecycle `action` on `body` (the request body's bytes) in its own task and answers
/// once it is acknowledged ([`acknowledge`]): the control listener's lifecycle routes, the
/// self-drain, and the readmission of a restarted engine. A client that gives up (a timeout
/// during a long validation) does not cancel the action half-way and leave records
/// `validating`.
pub(crate) async fn acknowledged_action(
    parts: &Arc<Parts>,
    action: crate::lifecycle::api::Action,
    body: bytes::Bytes,
) -> (StatusCode, LifecycleReply) {
    let lifecycle = parts.lifecycle.clone();
    // The epoch scope the action runs under: its acknowledgement needs it still live.
    let scope = parts.ha.scope();
    let run =
        tokio::spawn(async move { crate::lifecycle::api::handle(&lifecycle, action, &body).await });
    match run.await {
        Ok((status, doc)) => Box::pin(acknowledge(parts, status, doc, scope.as_ref())).await,
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            LifecycleReply::from(
                parts
                    .lifecycle
                    .document(&format!("lifecycle action failed: {e}")),
            ),
        ),
    }
}

pub(crate) async fn acknowledge(
    parts: &Parts,
    status: StatusCode,
    doc: LifecycleReply,
    scope: Option<&EpochScope>,
) -> (StatusCode, LifecycleReply) {
    if status != StatusCode::OK {
        return (status, doc);
    }
    match publish(parts, false).await {
        Ok(_) if scope.is_none_or(|s| parts.ha.live(s)) => (status, doc),
        Ok(_) => {
            let epoch = scope.map_or(0, EpochScope::epoch);
            let why = format!(
                "not acknowledged: control under epoch {epoch}, which made the change, ended \
                 before it was durable; repeat the request"
            );
            (
                StatusCode::SERVICE_UNAVAILABLE,
                parts.lifecycle.document(&why).into(),
            )
        }
        Err(e) if e.outcome_unknown() => {
            let why = format!(
                "not acknowledged, outcome unknown: the lifecycle change was written and not \
                 confirmed ({e}); it may be durable, and a successor may apply it: read \
                 /narwhal/lifecycle, and repeat the request if the change is not there"
            );
            (
                StatusCode::SERVICE_UNAVAILABLE,
                parts.lifecycle.document(&why).into(),
            )
        }
        Err(e) => {
            let why = format!(
                "not acknowledged: the lifecycle change could not be made durable ({e}); repeat \
                 the request"
            );
            (
                StatusCode::SERVICE_UNAVAILABLE,
                parts.lifecycle.document(&why).into(),
            )
        }
    }
}

/// A document that shows this router's totals (`/narwhal/state`, `/narwhal/handoff`),
/// rendered and then made durable (ha-and-fencing.md: totals never go backwards at a takeover
/// for a client reading the router that controls the fleet). The snapshot published is taken
/// after rendering, so it holds at least every total the document shows. When the publish fails
/// the document is rendered again; if the router still claims control then, the answer is the
/// 503 body naming why instead of totals a successor might not restore (behaviour.md 1.7).
///
/// # Errors
/// The 503 body ([`ErrorReply`], type `unavailable`) when the totals could not be made durable.
pub(crate) async fn durable_document<T>(
    parts: &Parts,
    render: impl Fn(&Parts) -> T,
) -> Result<T, ErrorReply> {
    let doc = render(parts);
    if !parts.ha.controls_fleet() {
        return Ok(doc);
    }
    match publish(parts, false).await {
        Ok(_) => Ok(doc),
        Err(e) => {
            if !parts.ha.controls_fleet() {
                return Ok(render(parts));
            }
            let message = format!("totals could not be made durable: {e}");
            Err(ErrorReply::new(message, "unavailable"))
        }
    }
}

/// `/metrics` publishes too (best effort: a scrape never fails for it).
pub(crate) async fn publish_for_read(parts: &Parts) {
    if parts.ha.controls_fleet() {
        let _ = publish(parts, false).await;
    }
}

/// One turn of the writer: publish what changed; when nothing did, still rewrite the state
/// file (a fresh `at`, as before publishing existed). Only while controlling the fleet.
async fn write_turn(parts: &Parts) {
    if let Ok(false) = publish(parts, false).await
        && parts.ha.controls_fleet()
    {
        let _ = write_state(parts, snapshot(parts)).await;
    }
}

/// Publishes the handoff when the lifecycle or ejections change (woken through
/// [`Parts::dirty`]), after every lease renewal, and at least every
/// `controller.monitor_interval_s`; once more at shutdown. A router that does not control
/// the fleet writes nothing (it never overwrites the fleet's state).
pub(crate) async fn writer(parts: Arc<Parts>, stop: CancellationToken) {
    let period =
        crate::config::secs(parts.cfg.controller.monitor_interval_s).max(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = stop.cancelled() => {
                write_turn(&parts).await;
                return;
            }
            _ = parts.dirty.notified() => {}
            () = parts.ha.lease().renewed() => {}
            _ = tokio::time::sleep(period) => {}
        }
        write_turn(&parts).await;
    }
}

/// Why the lease store's record and published handoff could not be read
/// ([`read_published`]).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadPublishedError {
    /// The lease store could not be read.
    #[error(transparent)]
    Store(#[from] LeaseError),
    /// The published document does not parse or fails the schema rules (never applied).
    #[error("published handoff: {0}")]
    Document(#[source] HandoffError),
}

/// The newest handoff published in the lease store, with the lease record read with it
/// (`None` for either when absent; a published document that does not parse is reported,
/// never applied).
///
/// # Errors
/// [`ReadPublishedError`]: the store's error, or the document's.
pub(crate) async fn read_published(
    parts: &Parts,
) -> Result<(Option<LeaseRecord>, Option<Handoff>), ReadPublishedError> {
    let (record, bytes) = parts.ha.lease().read_all().await?;
    let doc = match bytes {
        None => None,
        Some(b) => {
            let text = String::from_utf8_lossy(&b);
            Some(Handoff::parse(&text).map_err(ReadPublishedError::Document)?)
        }
    };
    Ok((record, doc))
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

    /// A handoff does not move an engine launched with a fixed vLLM KV role
    /// (`engines[].kv_role`): its configured role stands, as a pinned engine's does.
    #[test]
    fn a_fixed_kv_role_keeps_its_configured_role() {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        let p = crate::parts::for_test(
            serde_json::json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
                "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill",
                             "kv_role": "kv_producer"},
                            {"iid": "d0", "url": "http://127.0.0.1:2"},
                            {"iid": "d1", "url": "http://127.0.0.1:3", "kv_role": "kv_consumer"}],
                "slo": {"ttft_s": 1.0, "tpot_s": 0.1}
            }),
            clock,
            "test",
        );
        let mut h = snapshot(&p);
        h.roles.insert("p0".into(), "decode".into());
        h.roles.insert("d0".into(), "prefill".into());
        h.roles.insert("d1".into(), "prefill".into());
        assert_eq!(
            carried_roles(&p, &h).unwrap(),
            BTreeMap::from([(1, Role::Prefill)]),
            "only d0 (kv_both) takes the carried role"
        );
    }

    /// A router in control of a 2 s file lease (epoch 1) in `dir`.
    async fn in_control(dir: &std::path::Path) -> (Arc<Parts>, Arc<ManualClock>) {
        let (parts, clock) = crate::ha_phase::tests::leased(dir);
        assert_eq!(parts.ha.lease().claim().await, Ok(1));
        parts.ha.publish(crate::ha_phase::HaPhase::Active);
        (parts, clock)
    }

    /// A lifecycle action's answer as the driver gives it (its body does not matter here).
    fn ok() -> LifecycleReply {
        LifecycleReply::default()
    }

    fn served(parts: &Parts, n: u64) {
        let mut h = snapshot(parts);
        h.counters.insert("served".into(), n);
        parts.accounting.restore(&h);
    }

    /// ha-and-fencing.md: the controlling router publishes its handoff beside the lease record (and
    /// to its state file) whenever it changed; nothing is written when nothing changed, or by a
    /// router that does not control the fleet; a refused publish fences.
    #[tokio::test]
    async fn the_handoff_is_published_beside_the_lease_while_in_control() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (parts, _clock) = in_control(dir.path()).await;
        served(&parts, 3);
        assert_eq!(publish(&parts, false).await, Ok(true));
        let (rec, doc) = read_published(&parts).await.expect("store");
        let doc = doc.expect("published");
        assert_eq!((doc.epoch, rec.map(|r| r.epoch)), (1, Some(1)));
        assert_eq!(doc.holder, parts.ha.lease().holder());
        assert_eq!(doc.counters["served"], 3);
        let file = load_state_file(&dir.path().join("state.json"));
        assert!(matches!(file, Loaded::Valid(h) if h.counters["served"] == 3));
        assert_eq!(
            publish(&parts, false).await,
            Ok(false),
            "unchanged: nothing written"
        );
        served(&parts, 4);
        assert_eq!(publish(&parts, false).await, Ok(true));
        // Another router's record: the publish is refused and the router fenced.
        let other = serde_json::json!({"epoch": 2, "expires_at": 1.0e9 + 60.0,
            "holder": "other:0", "schema": "narwhal.router-lease", "schema_version": 1,
            "updated_at": 1.0e9});
        std::fs::write(dir.path().join("lease.json"), format!("{other}\n")).expect("write");
        served(&parts, 5);
        assert_eq!(
            publish(&parts, false).await,
            Err(PublishError::Lease(LeaseLoss::HeldByAnother))
        );
        assert!(!parts.ha.controls_fleet());
        let (_, doc) = read_published(&parts).await.expect("store");
        assert_eq!(
            doc.expect("kept").counters["served"],
            4,
            "the store kept the last one"
        );
        assert_eq!(
            publish(&parts, false).await,
            Err(PublishError::NotInControl)
        );
    }

    /// Found by the `ha::model` property: an action made under one epoch is not acknowledged
    /// by a publish made after that epoch ended (a pause past the TTL, then the same router
    /// claiming the fleet again under a new epoch), since the state it then holds may not
    /// hold the change; an action of the new epoch is.
    #[tokio::test]
    async fn an_action_is_not_acknowledged_once_its_epoch_ended() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (parts, clock) = in_control(dir.path()).await;
        let scope = parts.ha.scope().expect("in control");
        parts.ha.fence(&LeaseLoss::Lapsed);
        clock.advance(Duration::from_secs(60));
        assert_eq!(parts.ha.lease().claim().await, Ok(2));
        parts.ha.publish(crate::ha_phase::HaPhase::Active);
        let (status, doc) = acknowledge(&parts, StatusCode::OK, ok(), Some(&scope)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{doc:?}");
        let error = &doc.document.error;
        assert!(
            error.starts_with("not acknowledged: control under epoch 1"),
            "{error}"
        );
        let now = parts.ha.scope().expect("in control again");
        assert_eq!(now.epoch(), 2);
        let (status, _) = acknowledge(&parts, StatusCode::OK, ok(), Some(&now)).await;
        assert_eq!(status, StatusCode::OK);
    }

    /// ha-and-fencing.md: a lifecycle action is answered 200 only once published; when the change
    /// cannot be made durable the answer is a 503 that says so. A document showing totals is
    /// published before it is answered, and refused (503) when it cannot be while the router
    /// still claims control.
    #[tokio::test]
    async fn acknowledgements_and_totals_wait_for_the_publish() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (parts, _clock) = in_control(dir.path()).await;
        served(&parts, 7);
        let doc = durable_document(&parts, crate::documents::state).await;
        assert_eq!(doc.map(|d| d.served), Ok(7));
        let (_, stored) = read_published(&parts).await.expect("store");
        assert_eq!(stored.expect("published").counters["served"], 7);
        served(&parts, 8);
        let scope = parts.ha.scope().expect("in control");
        let (status, _) = acknowledge(&parts, StatusCode::OK, ok(), Some(&scope)).await;
        assert_eq!(status, StatusCode::OK);
        let (_, stored) = read_published(&parts).await.expect("store");
        assert_eq!(stored.expect("published").counters["served"], 8);
        let (status, _) = acknowledge(&parts, StatusCode::CONFLICT, ok(), None).await;
        assert_eq!(status, StatusCode::CONFLICT, "refusals pass as they are");
        // The record becomes another router's: nothing more is acknowledged.
        let other = serde_json::json!({"epoch": 2, "expires_at": 1.0e9 + 60.0,
            "holder": "other:0", "schema": "narwhal.router-lease", "schema_version": 1,
            "updated_at": 1.0e9});
        std::fs::write(dir.path().join("lease.json"), format!("{other}\n")).expect("write");
        served(&parts, 9);
        let (status, doc) = acknowledge(&parts, StatusCode::OK, ok(), Some(&scope)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let error = &doc.document.error;
        assert!(error.starts_with("not acknowledged: "), "{error}");
        assert!(error.contains("lease held by another router"), "{error}");
        // The fenced router shows its totals as a router that does not control the fleet.
        let doc = durable_document(&parts, crate::documents::state)
            .await
            .expect("not in control: nothing to make durable");
        assert!(!doc.ha.controls_fleet, "{doc:?}");
    }
}
