//! The lifecycle driver: the HTTP actions (`GET /narwhal/lifecycle`, `POST .../drain`,
//! `POST .../readmit`), identity capture and validation through the agents, eager drain
//! progress, and recovery of breaker-ejected engines (seed "Lifecycle API"; DESIGN.md 9.2–9.7).
//!
//! Locking: the async `lifecycle_lock` serialises lifecycle actions end to end (including the
//! agent calls); the `lifecycle` mutex guards the pure [`Lifecycle`] and is always taken before
//! the core mutex, never after it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use narwhal_shared::{AgentClient, AgentEndpoint, AgentTimeouts, Clock, Fence, ProcessIdentity};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::machine::{DrainRequest, EngineView, Lifecycle, Now};
use super::validation::{Attested, Checks, Identity, Plan, Report, validate};
use crate::breaker::{EjectCause, Observation};
use crate::config::{Config, RestartPolicy, secs};
use crate::metrics::labels;
use crate::placement::Exclusion;
use crate::state::Shared;

/// The mTLS clients of the engines' agents, one per distinct agent, indexed by engine.
pub(crate) struct Agents {
    per_engine: Vec<Option<Arc<AgentClient>>>,
}

impl Agents {
    /// No agents (fleets without `engines[].agent`, and unit tests).
    #[cfg(test)]
    pub(crate) fn none(engines: usize) -> Agents {
        Agents {
            per_engine: vec![None; engines],
        }
    }

    /// Builds one client per distinct agent of the fleet file (engines on one host share it).
    ///
    /// # Errors
    /// A message naming the offending key (`engines[0].agent.public_key`, `tls.cert`, ...).
    pub(crate) fn from_config(cfg: &Config, clock: Arc<dyn Clock>) -> Result<Agents, String> {
        let mut per_engine = Vec::with_capacity(cfg.engines.len());
        let mut built: BTreeMap<(String, String), Arc<AgentClient>> = BTreeMap::new();
        let timeouts = AgentTimeouts {
            connect_s: cfg.agent.timeout_s.min(5.0),
            request_s: cfg.agent.timeout_s,
            check_s: cfg.agent.timeout_s.max(30.0),
            max_skew_s: cfg.agent.max_skew_s,
        };
        for (i, e) in cfg.engines.iter().enumerate() {
            let Some(a) = &e.agent else {
                per_engine.push(None);
                continue;
            };
            let key = (a.url.clone(), a.server_name.clone());
            if let Some(c) = built.get(&key) {
                per_engine.push(Some(c.clone()));
                continue;
            }
            let tls = cfg.tls.as_ref().ok_or_else(|| {
                "tls: required by engines[].agent (mutual TLS to the agents)".to_string()
            })?;
            let public_key = narwhal_shared::PublicKey::parse(&a.public_key)
                .map_err(|err| format!("engines[{i}].agent.public_key: {err}"))?;
            let endpoint = AgentEndpoint {
                agent_id: a.agent_id.clone(),
                url: a.url.clone(),
                server_name: a.server_name.clone(),
                public_key,
            };
            let files = narwhal_shared::TlsFiles {
                ca: tls.ca.clone(),
                cert: tls.cert.clone(),
                key: tls.key.clone(),
            };
            let client = AgentClient::new(endpoint, &files, timeouts, clock.clone())
                .map_err(|err| format!("engines[{i}].agent: {err}"))?;
            let client = Arc::new(client);
            built.insert(key, client.clone());
            per_engine.push(Some(client));
        }
        Ok(Agents { per_engine })
    }

    fn get(&self, i: usize) -> Option<&Arc<AgentClient>> {
        self.per_engine.get(i).and_then(Option::as_ref)
    }

    /// True when engine `i` has an agent.
    pub(crate) fn has(&self, i: usize) -> bool {
        self.get(i).is_some()
    }
}

fn now(shared: &Shared) -> Now {
    Now {
        mono: shared.clock.now(),
        wall: shared.wall(),
    }
}

fn new_wave_id() -> String {
    let u = uuid::Uuid::new_v4().simple().to_string();
    format!("wave-{}", &u[..12])
}

fn index(shared: &Shared, iid: &str) -> Option<usize> {
    shared.cfg.engines.iter().position(|e| e.iid == iid)
}

fn fence(shared: &Shared) -> Fence {
    let ha = shared.ha();
    Fence {
        epoch: ha.epoch,
        holder: ha.holder,
    }
}

/// Resident prefill + decode count per engine name.
fn resident(shared: &Shared) -> BTreeMap<String, u32> {
    let core = shared.core();
    shared
        .cfg
        .engines
        .iter()
        .zip(core.slots.iter())
        .map(|(e, s)| (e.iid.clone(), s.resident_prefill + s.resident_decode))
        .collect()
}

fn live(shared: &Shared) -> BTreeSet<String> {
    let core = shared.core();
    shared
        .cfg
        .engines
        .iter()
        .zip(core.slots.iter())
        .filter(|(_, s)| s.is_live())
        .map(|(e, _)| e.iid.clone())
        .collect()
}

/// Applies the machine's holds to placement and readiness, journals its new events, and asks
/// for the state file to be written. Called with the lifecycle mutex held (lifecycle before
/// core).
pub(crate) fn commit(shared: &Shared, lc: &mut Lifecycle) {
    let held = lc.held();
    {
        let mut core = shared.core();
        for (e, slot) in shared.cfg.engines.iter().zip(core.slots.iter_mut()) {
            if held.contains(&e.iid) {
                slot.excluded.insert(Exclusion::Draining);
            } else {
                slot.excluded.remove(&Exclusion::Draining);
            }
        }
    }
    shared.any_held.store(!held.is_empty(), Ordering::Release);
    shared.set_lifecycle_blocked(lc.blocked_reason());
    let events = lc.take_events();
    if !events.is_empty() {
        crate::handoff::mark_dirty(shared);
    }
    for ev in events {
        tracing::info!(
            action = ev["action"].as_str().unwrap_or(""),
            engine.id = ev["iid"].as_str().unwrap_or(""),
            wave = ev["wave_id"].as_str().unwrap_or(""),
            "lifecycle event"
        );
        shared.journal.emit(ev);
    }
}

/// Re-evaluates drain progress now (DESIGN.md 9.4): called when a held engine's resident count
/// changes and by the deadline timer.
pub(crate) fn refresh(shared: &Shared) {
    let mut lc = shared.lifecycle();
    let counts = resident(shared);
    lc.refresh(now(shared), |iid| counts.get(iid).copied().unwrap_or(0));
    commit(shared, &mut lc);
}

/// Wakes at the next drain deadline (or when a drain starts) and refreshes.
pub(crate) async fn timer(shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let next = shared.lifecycle().next_deadline();
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
            _ = shared.lifecycle_wake.notified() => {}
            _ = wait => {}
        }
        refresh(&shared);
    }
}

/// `router.controls_fleet` (DESIGN.md 9.1).
fn controls(shared: &Shared) -> &'static str {
    let ha = shared.ha();
    if ha.controls_fleet {
        "active"
    } else if ha.standby && ha.failover_blocked.is_empty() {
        "standby"
    } else {
        "fenced"
    }
}

/// The lifecycle document with `error` (`""` on success).
pub(crate) fn document(shared: &Shared, error: &str) -> Value {
    let (ready, _, _) = shared.readiness();
    let controls = controls(shared);
    let lc = shared.lifecycle();
    let views: BTreeMap<String, EngineView> = {
        let core = shared.core();
        shared
            .cfg
            .engines
            .iter()
            .zip(core.slots.iter())
            .map(|(e, s)| {
                (
                    e.iid.clone(),
                    EngineView {
                        resident_prefill: s.resident_prefill,
                        resident_decode: s.resident_decode,
                        accepts_new: s.is_live(),
                    },
                )
            })
            .collect()
    };
    lc.document(
        controls,
        ready,
        |iid| views.get(iid).copied().unwrap_or_default(),
        error,
    )
}

fn reply(shared: &Shared, status: StatusCode, error: &str) -> (StatusCode, Value) {
    (status, document(shared, error))
}

fn parse_body(body: &Bytes) -> Result<serde_json::Map<String, Value>, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("the request body must be a JSON object".into()),
        Err(e) => Err(format!("the request body is not valid JSON: {e}")),
    }
}

fn parse_engines(m: &serde_json::Map<String, Value>) -> Result<Vec<String>, String> {
    match m.get("engines") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| "engines must be a list of engine ids (strings)".to_string())
            })
            .collect(),
        Some(_) => Err("engines must be a list of engine ids (strings)".into()),
    }
}

fn parse_wave(m: &serde_json::Map<String, Value>) -> Result<bool, String> {
    match m.get("wave") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err("wave must be true or false".into()),
    }
}

fn unknown_keys(m: &serde_json::Map<String, Value>, known: &[&str]) -> Result<(), String> {
    match m.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(format!(
            "unknown field {k:?} (expected {})",
            known.join(", ")
        )),
        None => Ok(()),
    }
}

fn parse_drain(body: &Bytes) -> Result<DrainRequest, String> {
    let m = parse_body(body)?;
    unknown_keys(&m, &["engines", "wave", "deadline_s"])?;
    let deadline_s = match m.get("deadline_s") {
        None | Some(Value::Null) => 300.0,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| "deadline_s must be a number of seconds".to_string())?,
    };
    Ok(DrainRequest {
        engines: parse_engines(&m)?,
        wave: parse_wave(&m)?,
        deadline_s,
    })
}

fn parse_readmit(body: &Bytes) -> Result<(Vec<String>, bool), String> {
    let m = parse_body(body)?;
    unknown_keys(&m, &["engines", "wave"])?;
    Ok((parse_engines(&m)?, parse_wave(&m)?))
}

const NOT_IN_CONTROL: &str = "this router does not control the fleet";

/// An agent's error as one line. An agent that saw a newer epoch proves another router took
/// over: this one fences itself at once (DESIGN.md section 3, fencing reaches the hosts).
fn agent_error(shared: &Shared, e: narwhal_shared::AgentClientError) -> String {
    if matches!(e, narwhal_shared::AgentClientError::StaleEpoch { .. }) {
        crate::ha::fence(shared, &crate::lease::LeaseLoss::HeldByAnother);
    }
    e.to_string()
}

/// Reads the engine's process start through its agent, as a signed, verified attestation.
async fn capture(shared: &Shared, iid: &str) -> Result<f64, String> {
    let i = index(shared, iid).ok_or_else(|| format!("{iid} is not configured"))?;
    let agent = shared.agents.get(i).ok_or_else(|| {
        "process identity unreadable: no agent configured for this engine (engines[].agent)"
            .to_string()
    })?;
    let v = agent
        .attestation(iid, &fence(shared), None)
        .await
        .map_err(|e| format!("process identity unreadable: {}", agent_error(shared, e)))?;
    Ok(v.payload.header.process.process_start_time_seconds)
}

/// `POST /narwhal/lifecycle/drain` (seed "Draining engines"; reference-notes 1.10, 4.3–4.4).
pub(crate) async fn drain(shared: Arc<Shared>, body: Bytes) -> (StatusCode, Value) {
    let req = match parse_drain(&body) {
        Ok(r) => r,
        Err(e) => return reply(&shared, StatusCode::BAD_REQUEST, &e),
    };
    if !shared.ha().controls_fleet {
        return reply(&shared, StatusCode::SERVICE_UNAVAILABLE, NOT_IN_CONTROL);
    }
    // An engine without an agent could be held out but never bound to a process identity, so
    // it could never be readmitted: refuse the drain instead of wedging it (DESIGN.md 9.2).
    let mut agentless: Vec<&str> = shared
        .cfg
        .engines
        .iter()
        .enumerate()
        .filter(|(i, e)| {
            (req.engines.contains(&e.iid) || (req.wave && req.engines.is_empty()))
                && !shared.agents.has(*i)
        })
        .map(|(_, e)| e.iid.as_str())
        .collect();
    if !agentless.is_empty() {
        agentless.sort_unstable();
        return reply(
            &shared,
            StatusCode::CONFLICT,
            &format!(
                "no agent configured for {} (engines[].agent): process identity cannot be recorded",
                agentless.join(", ")
            ),
        );
    }
    let _serial = shared.lifecycle_lock.lock().await;
    let plan = {
        let live = live(&shared);
        let mut lc = shared.lifecycle();
        match lc.begin(now(&shared), &req, &live, &new_wave_id()) {
            Ok(p) => {
                commit(&shared, &mut lc);
                p
            }
            Err(e) => {
                drop(lc);
                return reply(&shared, StatusCode::CONFLICT, &e.to_string());
            }
        }
    };
    shared.lifecycle_wake.notify_one();
    // Every target is out of placement now; record identities (DESIGN.md section 4).
    let captured =
        futures_util::future::join_all(plan.capture.iter().map(|iid| capture(&shared, iid))).await;
    let mut failures = Vec::new();
    {
        let ejected: BTreeSet<String> = {
            let core = shared.core();
            shared
                .cfg
                .engines
                .iter()
                .zip(core.slots.iter())
                .filter(|(_, s)| s.excluded.contains(&Exclusion::Ejected))
                .map(|(e, _)| e.iid.clone())
                .collect()
        };
        let counts = resident(&shared);
        let mut lc = shared.lifecycle();
        let t = now(&shared);
        for (iid, r) in plan.capture.iter().zip(captured) {
            let err = r.as_ref().err().cloned();
            if !lc.bind_identity(t, iid, r, ejected.contains(iid)) {
                failures.push(format!("{iid}: {}", err.unwrap_or_default()));
            }
        }
        lc.refresh(t, |iid| counts.get(iid).copied().unwrap_or(0));
        commit(&shared, &mut lc);
    }
    if !shared.ha().controls_fleet {
        return reply(
            &shared,
            StatusCode::SERVICE_UNAVAILABLE,
            "router control was fenced during drain",
        );
    }
    if !failures.is_empty() {
        failures.sort();
        return reply(
            &shared,
            StatusCode::SERVICE_UNAVAILABLE,
            &failures.join("; "),
        );
    }
    reply(&shared, StatusCode::OK, "")
}

/// `POST /narwhal/lifecycle/readmit` (seed "Readmitting engines"; reference-notes 1.10,
/// 4.7–4.8).
pub(crate) async fn readmit(shared: Arc<Shared>, body: Bytes) -> (StatusCode, Value) {
    let (engines, wave) = match parse_readmit(&body) {
        Ok(r) => r,
        Err(e) => return reply(&shared, StatusCode::BAD_REQUEST, &e),
    };
    if !shared.ha().controls_fleet {
        return reply(&shared, StatusCode::SERVICE_UNAVAILABLE, NOT_IN_CONTROL);
    }
    let _serial = shared.lifecycle_lock.lock().await;
    let targets = {
        let counts = resident(&shared);
        let mut lc = shared.lifecycle();
        let t = now(&shared);
        match lc.mark_validating(t, &engines, wave, |iid| {
            counts.get(iid).copied().unwrap_or(0)
        }) {
            Ok(mut targets) => {
                if !wave {
                    let roles: Vec<(String, crate::config::Role)> = shared
                        .cfg
                        .engines
                        .iter()
                        .map(|e| (e.iid.clone(), e.role))
                        .collect();
                    let ejected = ejected(&shared);
                    if let Some(peer) = co_target(&roles, &targets[0], &live(&shared), &ejected)
                        && lc.join_recovery(t, &peer)
                    {
                        targets.push(peer);
                        targets.sort();
                    }
                }
                commit(&shared, &mut lc);
                targets
            }
            Err(e) => {
                drop(lc);
                return reply(&shared, StatusCode::CONFLICT, &e.to_string());
            }
        }
    };
    let report = run_validation(&shared, &targets, wave).await;
    finish(&shared, &targets, report, "operator").await
}

/// Engines the breaker has ejected.
fn ejected(shared: &Shared) -> BTreeSet<String> {
    let core = shared.core();
    shared
        .cfg
        .engines
        .iter()
        .zip(core.slots.iter())
        .filter(|(_, s)| s.excluded.contains(&Exclusion::Ejected))
        .map(|(e, _)| e.iid.clone())
        .collect()
}

/// The ejected engine an individual readmission of `target` must validate alongside it
/// ([`Lifecycle::join_recovery`]): when no engine of the opposite role is live, the first
/// ejected one in config order. `None` when a live peer exists (the usual case), for an
/// aggregated fleet (one role), or when no opposite-role engine is ejected.
fn co_target(
    roles: &[(String, crate::config::Role)],
    target: &str,
    live: &BTreeSet<String>,
    ejected: &BTreeSet<String>,
) -> Option<String> {
    use crate::config::Role;
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

/// Builds the validation plan for `targets` from the records and the live fleet.
fn plan(shared: &Shared, targets: &[String], wave: bool) -> Plan {
    let lc = shared.lifecycle();
    let restart_after = targets
        .iter()
        .map(|t| {
            let old = lc
                .record(t)
                .filter(|r| r.restart_required)
                .and_then(|r| r.old_process_start);
            (t.clone(), old)
        })
        .collect();
    let accepted_starts = lc.process_starts().clone();
    drop(lc);
    let verify_sources = {
        let core = shared.core();
        targets
            .iter()
            .filter_map(|t| {
                let i = index(shared, t)?;
                let s = &core.sources[i];
                (!s.is_empty()).then(|| (t.clone(), s.iter().cloned().collect()))
            })
            .collect()
    };
    Plan {
        targets: targets.to_vec(),
        roles: shared
            .cfg
            .engines
            .iter()
            .map(|e| (e.iid.clone(), e.role))
            .collect(),
        live: live(shared),
        restart_after,
        accepted_starts,
        model: shared.cfg.model.clone(),
        wave,
        direct_generation: shared.cfg.backend != crate::config::Backend::Sglang,
        verify_sources,
    }
}

async fn run_validation(shared: &Arc<Shared>, targets: &[String], wave: bool) -> Report {
    let plan = plan(shared, targets, wave);
    let checks = AgentChecks {
        shared: shared.clone(),
        fence: fence(shared),
    };
    let check_id = uuid::Uuid::new_v4().simple().to_string();
    validate(&plan, &checks, &check_id).await
}

/// The engines (indexes) among `targets` whose SGLang bootstrap port must be learnt again
/// before they take traffic: prefill engines of an SGLang fleet (a restarted prefill server may
/// serve its bootstrap rendezvous on a new port). Empty for vLLM.
fn bootstrap_refresh(
    backend: crate::config::Backend,
    engines: &[(String, crate::config::Role)],
    targets: &[String],
) -> Vec<usize> {
    if backend != crate::config::Backend::Sglang {
        return Vec::new();
    }
    engines
        .iter()
        .enumerate()
        .filter(|(_, (iid, role))| *role == crate::config::Role::Prefill && targets.contains(iid))
        .map(|(i, _)| i)
        .collect()
}

/// Applies a validation report: readmit on success, block every candidate on failure, eject
/// peers whose process changed (reference-notes 4.7; DESIGN.md 9.7).
///
/// Before a passing SGLang prefill engine returns to placement, its bootstrap port is read
/// again (`/server_info`) while it is still held, so no request is placed with a stale port
/// (found by tests/tests/lifecycle_e2e.rs: refreshing after the release let the first
/// requests' decodes fail their rendezvous). A failed refresh is logged; requests refresh the
/// port on demand.
async fn finish(
    shared: &Arc<Shared>,
    targets: &[String],
    report: Report,
    kind: &'static str,
) -> (StatusCode, Value) {
    if report.passed() {
        let engines: Vec<(String, crate::config::Role)> = shared
            .cfg
            .engines
            .iter()
            .map(|e| (e.iid.clone(), e.role))
            .collect();
        for i in bootstrap_refresh(shared.cfg.backend, &engines, targets) {
            if let Err(e) = crate::serve::refresh_bootstrap_port(shared, i).await {
                tracing::warn!(engine.id = %engines[i].0, error = %e, "bootstrap port refresh before readmission failed");
            }
        }
    }
    let t = now(shared);
    if !report.changed_peers.is_empty() {
        let mut core = shared.core();
        for peer in &report.changed_peers {
            if let Some(i) = index(shared, peer) {
                let tr = core
                    .breaker
                    .eject_now(i, EjectCause::ProcessIdentity, t.mono);
                shared.apply_transitions(&mut core, &tr);
            }
        }
    }
    let passed = report.passed()
        && targets.iter().all(|iid| {
            report
                .engines
                .get(iid)
                .is_some_and(|o| o.process_start.is_some())
        });
    let record_metric = |result: &str| {
        for iid in targets {
            shared
                .metrics
                .lifecycle_validations
                .get_or_create(&labels(&[("iid", iid), ("kind", kind), ("result", result)]))
                .inc();
        }
    };
    if !shared.ha().controls_fleet {
        let mut lc = shared.lifecycle();
        lc.abort_validation(t, "router control was fenced during validation");
        commit(shared, &mut lc);
        drop(lc);
        record_metric("fenced");
        return reply(
            shared,
            StatusCode::SERVICE_UNAVAILABLE,
            "router control was fenced during validation",
        );
    }
    if passed {
        let outcome: BTreeMap<_, _> = report
            .engines
            .into_iter()
            .filter(|(iid, _)| targets.contains(iid))
            .collect();
        let mut lc = shared.lifecycle();
        let back = lc.readmitted(t, &outcome);
        {
            let mut core = shared.core();
            for iid in &back {
                if let Some(i) = index(shared, iid) {
                    core.sources[i].clear();
                    let tr = core.breaker.observe(i, Observation::Verified, t.mono);
                    shared.apply_transitions(&mut core, &tr);
                }
            }
        }
        commit(shared, &mut lc);
        drop(lc);
        record_metric("passed");
        reply(shared, StatusCode::OK, "")
    } else {
        let mut lc = shared.lifecycle();
        lc.validation_failed(t, &report.engines);
        commit(shared, &mut lc);
        drop(lc);
        record_metric("failed");
        reply(
            shared,
            StatusCode::CONFLICT,
            "readmission validation failed",
        )
    }
}

/// Recovery of a breaker-ejected engine whose health probe passed: validate the running
/// process through the same checks (no restart required) and readmit it; under `whole_wave`
/// an ejection instead requires a whole-wave restart (reference-notes 4.9). Returns whether
/// the engine is back in placement.
pub(crate) async fn recover(shared: Arc<Shared>, i: usize) -> bool {
    let Ok(_serial) = shared.lifecycle_lock.try_lock() else {
        return false; // another lifecycle action runs; the next probe retries
    };
    // A probe sent while the engine was ejected can answer after a readmission (which holds
    // the serial lock) returned it to placement: there is nothing left to recover, and under
    // `whole_wave` starting a recovery would hold the whole fleet again (found by
    // tests/tests/lifecycle_e2e.rs under load).
    if !shared.core().breaker.is_ejected(i) {
        return true;
    }
    let iid = shared.cfg.engines[i].iid.clone();
    let started = {
        let mut lc = shared.lifecycle();
        let ok = lc.start_recovery_validation(now(&shared), &iid, &new_wave_id());
        commit(&shared, &mut lc);
        ok
    };
    if !started {
        return false;
    }
    let targets = vec![iid];
    let report = run_validation(&shared, &targets, false).await;
    let (status, _) = finish(&shared, &targets, report, "recovery").await;
    status == StatusCode::OK
}

/// Under `whole_wave`, an ejection requires a whole-wave restart (reference-notes 4.9).
pub(crate) fn enforce_whole_wave(shared: &Shared) {
    if shared.cfg.recovery.engine_restart_policy != RestartPolicy::WholeWave
        || !shared.ha().controls_fleet
    {
        return;
    }
    // The lifecycle lock is taken first and held while the exclusions are read (the order
    // `finish` uses): a readmission that un-ejects an engine and ends its wave in between
    // would otherwise be followed by a new wave for an ejection that no longer exists.
    let mut lc = shared.lifecycle();
    let ejected: Vec<String> = {
        let core = shared.core();
        shared
            .cfg
            .engines
            .iter()
            .zip(core.slots.iter())
            .filter(|(_, s)| s.excluded.contains(&Exclusion::Ejected))
            .map(|(e, _)| e.iid.clone())
            .collect()
    };
    let Some(first) = ejected.first() else { return };
    if !lc.wave_id().is_empty() {
        return;
    }
    lc.require_restart_wave(
        now(shared),
        &format!("engine {first} was excluded"),
        false,
        &new_wave_id(),
    );
    commit(shared, &mut lc);
}

/// `--resume` refused the state file. With an agent on every engine the fleet's processes can
/// be re-verified, so (as the reference does with a contract, reference-notes 2.8) every engine
/// is held in a restart-required wave: the operator drains the wave, restarts, readmits.
/// Without agents the router serves with fresh state and reports the reason in
/// `/narwhal/state.ha.resume`.
pub(crate) fn resume_refused(shared: &Shared, reason: &str) {
    shared.set_resume_refused(reason);
    let all_agents = (0..shared.cfg.engines.len()).all(|i| shared.agents.has(i));
    if !all_agents {
        return;
    }
    let mut lc = shared.lifecycle();
    lc.require_restart_wave(now(shared), reason, true, &new_wave_id());
    commit(shared, &mut lc);
}

/// Checks every engine's process identity through its agent (reference-notes 4.10): at
/// startup and after a takeover. An engine whose process start differs from the one last
/// accepted restarted behind the router's back: it is ejected (cause `process_identity`) and
/// comes back only through validation. Engines held by the lifecycle are left alone. The
/// first fenced agent call also teaches each agent this router's epoch.
pub(crate) async fn check_identities(shared: &Arc<Shared>) {
    let candidates: Vec<(usize, String, Option<f64>)> = {
        let lc = shared.lifecycle();
        let core = shared.core();
        shared
            .cfg
            .engines
            .iter()
            .enumerate()
            .filter(|(i, _)| shared.agents.has(*i))
            .filter(|(i, _)| {
                !core.slots[*i].excluded.contains(&Exclusion::Draining)
                    && !core.slots[*i].excluded.contains(&Exclusion::Ejected)
            })
            .map(|(i, e)| (i, e.iid.clone(), lc.process_starts().get(&e.iid).copied()))
            .collect()
    };
    // Engines left out of the check (held, ejected) still get one fenced call, in the
    // background, so every agent learns this router's epoch and refuses an older primary's
    // (DESIGN.md section 3) without delaying readiness.
    let others: Vec<String> = shared
        .cfg
        .engines
        .iter()
        .enumerate()
        .filter(|(i, e)| shared.agents.has(*i) && !candidates.iter().any(|(_, c, _)| *c == e.iid))
        .map(|(_, e)| e.iid.clone())
        .collect();
    if !others.is_empty() {
        let shared = shared.clone();
        tokio::spawn(async move {
            futures_util::future::join_all(others.iter().map(|iid| capture(&shared, iid))).await;
        });
    }
    let reads =
        futures_util::future::join_all(candidates.iter().map(|(_, iid, _)| capture(shared, iid)))
            .await;
    let t = now(shared);
    let mut lc = shared.lifecycle();
    for ((i, iid, before), r) in candidates.into_iter().zip(reads) {
        let previous = lc.process_starts().get(&iid).copied();
        let held = lc.state(&iid) != super::machine::DrainState::Active;
        match identity_verdict(held, before, previous, &r) {
            IdentityVerdict::Skip => {}
            IdentityVerdict::Accept(start) => lc.accept_process_start(&iid, start),
            IdentityVerdict::Exclude(reason) => {
                tracing::warn!(engine.id = %iid, %reason, ?previous, "engine excluded by the identity check");
                shared.journal.emit(serde_json::json!({
                    "event": "engine_lifecycle", "action": "process_excluded", "at": t.wall,
                    "iid": iid, "reason": reason, "previous_process_start": previous,
                    "observed_process_start": r.ok(),
                }));
                let mut core = shared.core();
                let tr = core
                    .breaker
                    .eject_now(i, EjectCause::ProcessIdentity, t.mono);
                shared.apply_transitions(&mut core, &tr);
            }
        }
    }
    commit(shared, &mut lc);
}

/// What the identity check does with one engine's reading (reference-notes 4.10).
#[derive(Debug, Clone, PartialEq)]
enum IdentityVerdict {
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
/// process start read through the agent. Found by tests/tests/lifecycle_e2e.rs: applying a
/// reading taken before a drain began ejected engines in the middle of a planned restart.
fn identity_verdict(
    held: bool,
    before: Option<f64>,
    now: Option<f64>,
    read: &Result<f64, String>,
) -> IdentityVerdict {
    if held || before != now {
        return IdentityVerdict::Skip;
    }
    match read {
        Ok(start) if now.is_none_or(|p| p == *start) => IdentityVerdict::Accept(*start),
        Ok(_) => IdentityVerdict::Exclude("engine process changed behind the router".into()),
        Err(e) => IdentityVerdict::Exclude(e.clone()),
    }
}

/// Lifecycle gauges for `/metrics`: `(iid, state, ready_to_stop)` per engine.
pub(crate) fn gauges(shared: &Shared) -> Vec<(String, &'static str, bool)> {
    let lc = shared.lifecycle();
    shared
        .cfg
        .engines
        .iter()
        .map(|e| {
            (
                e.iid.clone(),
                lc.state(&e.iid).as_str(),
                lc.ready_to_stop(&e.iid),
            )
        })
        .collect()
}

/// [`Checks`] through the router's engine client (health) and the agents (everything signed).
struct AgentChecks {
    shared: Arc<Shared>,
    fence: Fence,
}

fn identity(p: &ProcessIdentity) -> Identity {
    Identity {
        key: format!("{}:{}:{}", p.boot_id, p.pid, p.start_ticks),
        start: p.process_start_time_seconds,
    }
}

impl AgentChecks {
    fn agent(&self, iid: &str) -> Result<(usize, Arc<AgentClient>), String> {
        let i = index(&self.shared, iid).ok_or_else(|| format!("{iid} is not configured"))?;
        let a =
            self.shared.agents.get(i).ok_or_else(|| {
                "no agent configured for this engine (engines[].agent)".to_string()
            })?;
        Ok((i, a.clone()))
    }
}

impl Checks for AgentChecks {
    async fn health(&self, iid: &str) -> Result<(), String> {
        let i = index(&self.shared, iid).ok_or_else(|| format!("{iid} is not configured"))?;
        let url = format!("{}/health", self.shared.cfg.engines[i].url);
        match self
            .shared
            .upstream
            .get(&url, secs(self.shared.cfg.engine.health_timeout_s))
            .await
        {
            Ok((StatusCode::OK, _)) => Ok(()),
            Ok((s, _)) => Err(format!("HTTP {}", s.as_u16())),
            Err(e) => Err(e),
        }
    }

    async fn attest(&self, iid: &str) -> Result<Attested, String> {
        let (_, a) = self.agent(iid)?;
        let v = a
            .attestation(iid, &self.fence, None)
            .await
            .map_err(|e| agent_error(&self.shared, e))?;
        Ok(Attested {
            identity: identity(&v.payload.header.process),
            models: v.payload.engine.models.clone(),
            fingerprint: v.document.key_id.clone(),
        })
    }

    async fn generation(&self, iid: &str) -> Result<Identity, String> {
        let (_, a) = self.agent(iid)?;
        let model = self.shared.cfg.model.clone();
        let v = a
            .generation_check(iid, &self.fence, &model)
            .await
            .map_err(|e| agent_error(&self.shared, e))?;
        let r = &v.payload.result;
        if !r.ok || r.tokens == 0 {
            return Err(r
                .error
                .clone()
                .unwrap_or_else(|| "no tokens generated".into()));
        }
        Ok(identity(&v.payload.header.process))
    }

    async fn kv_produce(&self, iid: &str, check_id: &str) -> Result<(Value, Identity), String> {
        let (_, a) = self.agent(iid)?;
        let model = self.shared.cfg.model.clone();
        let v = a
            .kv_produce(iid, &self.fence, &model, check_id)
            .await
            .map_err(|e| agent_error(&self.shared, e))?;
        let p = &v.payload;
        if !p.result.ok {
            return Err(p
                .result
                .error
                .clone()
                .unwrap_or_else(|| "prefill failed".into()));
        }
        let kv = p
            .kv
            .clone()
            .ok_or_else(|| "the producer returned no KV descriptor or rendezvous".to_string())?;
        Ok((kv, identity(&p.header.process)))
    }

    async fn kv_consume(&self, iid: &str, check_id: &str, kv: Value) -> Result<Identity, String> {
        let (_, a) = self.agent(iid)?;
        let model = self.shared.cfg.model.clone();
        let v = a
            .kv_consume(iid, &self.fence, &model, check_id, kv)
            .await
            .map_err(|e| agent_error(&self.shared, e))?;
        let p = &v.payload;
        if !p.result.ok {
            return Err(p
                .result
                .error
                .clone()
                .unwrap_or_else(|| "decode failed".into()));
        }
        if p.result.tokens == 0 {
            return Err("no tokens decoded after the transfer".into());
        }
        let t = &p.transfer;
        let transferred = t.transferred.unwrap_or(false)
            || (t.consumed_delta.unwrap_or(0) >= 1 && t.recomputed_delta.unwrap_or(0) == 0);
        if !transferred {
            return Err(format!(
                "no KV transfer observed ({}): the consumer recomputed the prefill",
                t.source
            ));
        }
        Ok(identity(&p.header.process))
    }

    async fn probe(
        &self,
        iid: &str,
        check_id: &str,
        kv: Option<Value>,
    ) -> Result<Identity, String> {
        let (_, a) = self.agent(iid)?;
        let model = self.shared.cfg.model.clone();
        let producer = kv.map(narwhal_shared::agent_protocol::ProbeProducer::Kv);
        let v = a
            .probe(iid, &self.fence, &model, producer, Some(check_id))
            .await
            .map_err(|e| agent_error(&self.shared, e))?;
        let p = &v.payload;
        if !p.ok {
            let why = p
                .consume
                .error
                .clone()
                .or_else(|| p.produce.as_ref().and_then(|l| l.error.clone()))
                .unwrap_or_else(|| format!("probe failed ({})", p.transfer.source));
            return Err(why);
        }
        Ok(identity(&p.header.process))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Backend, Role};

    #[test]
    fn identity_check_leaves_engines_the_lifecycle_took_over_meanwhile() {
        let err: Result<f64, String> = Err("process identity unreadable: HTTP 503".into());
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
