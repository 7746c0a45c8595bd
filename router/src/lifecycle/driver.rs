//! The lifecycle driver: the HTTP actions (`GET /narwhal/lifecycle`, `POST .../drain`,
//! `POST .../readmit`), readmission validation through the agents, the drain-deadline and
//! resident-change timer, and recovery of breaker-ejected engines (handoff-and-lifecycle.md,
//! "Lifecycle API"; architecture.md 9.2–9.7).
//!
//! ```text
//!  POST drain ──request::parse_drain──► machine.begin ──commit──► capture identities
//!                                        ──► machine.bind_identity ──► commit
//!  POST readmit ──request::parse_readmit──► machine.mark_validating ──► validate (checks)
//!                                        ──► machine.readmitted | validation_failed ──► commit
//!  monitor: probe ok ──recover(i)──► machine.start_recovery_validation ──► validate ──► ...
//!  timer: drain deadline | Fleet::resident_changed ──► Executor::refresh
//! ```
//!
//! One lifecycle action runs at a time (`serial`, held across the agent calls); the pure
//! machine is only touched through the [`Executor`]. Every action runs under the
//! [`EpochScope`] of the epoch it was accepted in (ha-and-fencing.md): its agent calls carry that
//! epoch, it stops when control under it ends, and it never acts under a later one. A router that
//! does not control the fleet shows no actionable lifecycle state (no `ready_to_stop`) and
//! names the router that does, when known.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use narwhal_shared::Clock;
use narwhal_shared::documents::Lifecycle as LifecycleDocument;
use narwhal_shared::documents::{LifecycleReply, lifecycle::ControllerRef};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::agents::Agents;
use super::checks::AgentChecks;
use super::executor::Executor;
use super::identity::{IdentityReader, check_identities};
use super::machine::{EngineView, Lifecycle, RestartPolicy, RestoreError};
use super::request::{RequestError, parse_drain, parse_readmit, refusal_status};
use super::validation::{Plan, Report, validate};
use crate::breaker::EjectCause;
use crate::config::{Backend, Config, Role};
use crate::fleet::Fleet;
use crate::journal::Journal;
use crate::metrics::{Metrics, labels};
use crate::phase::{EpochScope, Ha};
use crate::placement::Exclusion;
use crate::readiness::Gate;
use crate::upstream::Upstream;

const NOT_IN_CONTROL: &str = "this router does not control the fleet";

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

/// A lifecycle action's answer: status and the lifecycle document with its `error`.
pub(crate) type Reply = (StatusCode, LifecycleReply);

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

    fn ha(&self) -> &Ha {
        &self.reader.ha
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

    fn reply(&self, status: StatusCode, error: &str) -> Reply {
        (status, self.document(error).into())
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

    /// A parsed action and the epoch scope it runs under, or its refusal: 400 for a bad
    /// body, 503 when this router does not control the fleet.
    fn accept<T>(&self, parsed: Result<T, RequestError>) -> Result<(T, EpochScope), Box<Reply>> {
        let req =
            parsed.map_err(|e| Box::new(self.reply(StatusCode::BAD_REQUEST, &e.to_string())))?;
        match self.ha().scope() {
            Some(scope) => Ok((req, scope)),
            None => Err(Box::new(
                self.reply(StatusCode::SERVICE_UNAVAILABLE, NOT_IN_CONTROL),
            )),
        }
    }

    /// `POST /narwhal/lifecycle/drain` (handoff-and-lifecycle.md, "Draining engines"; behaviour.md
    /// 1.10, 4.3–4.4).
    pub(crate) async fn drain(&self, body: Bytes) -> Reply {
        let (req, scope) = match self.accept(parse_drain(&body)) {
            Ok(r) => r,
            Err(reply) => return *reply,
        };
        // An engine without an agent could be held out but never bound to a process identity,
        // so it could never be readmitted: refuse the drain instead of wedging it
        // (architecture.md 9.2).
        let mut agentless: Vec<&str> = self
            .cfg
            .engines
            .iter()
            .enumerate()
            .filter(|(i, e)| {
                (req.engines.contains(&e.iid) || (req.wave && req.engines.is_empty()))
                    && !self.agents().has(*i)
            })
            .map(|(_, e)| e.iid.as_str())
            .collect();
        if !agentless.is_empty() {
            agentless.sort_unstable();
            let error = format!(
                "no agent configured for {} (engines[].agent): process identity cannot be recorded",
                agentless.join(", ")
            );
            return self.reply(StatusCode::CONFLICT, &error);
        }
        let _serial = self.serial.lock().await;
        if !self.ha().live(&scope) {
            return self.reply(StatusCode::SERVICE_UNAVAILABLE, NOT_IN_CONTROL);
        }
        let plan = {
            let live = self.fleet().live_names();
            let mut lc = self.exec.lock();
            match lc.begin(self.exec.now(), &req, &live, &new_wave_id()) {
                Ok(p) => {
                    self.exec.commit(&mut lc);
                    p
                }
                Err(e) => {
                    drop(lc);
                    return self.reply(refusal_status(&e), &e.to_string());
                }
            }
        };
        self.wake.notify_one();
        // Every target is out of placement now; record identities (architecture.md section 4).
        let captured = futures_util::future::join_all(
            plan.capture
                .iter()
                .map(|iid| self.reader.capture(iid, &scope)),
        );
        let captured = tokio::select! {
            c = captured => c,
            () = scope.ended() => Vec::new(),
        };
        if !self.ha().live(&scope) {
            return self.reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "router control was fenced during drain",
            );
        }
        let mut failures = Vec::new();
        {
            let ejected = self.fleet().ejected_names();
            let counts = self.fleet().resident_counts();
            let mut lc = self.exec.lock();
            let t = self.exec.now();
            for (iid, r) in plan.capture.iter().zip(captured) {
                let err = r.as_ref().err().map(ToString::to_string);
                if !lc.bind_identity(t, iid, r, ejected.contains(iid)) {
                    failures.push(format!("{iid}: {}", err.unwrap_or_default()));
                }
            }
            lc.refresh(t, |iid| counts.get(iid).copied().unwrap_or(0));
            self.exec.commit(&mut lc);
        }
        if !self.ha().live(&scope) {
            return self.reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "router control was fenced during drain",
            );
        }
        if !failures.is_empty() {
            failures.sort();
            return self.reply(StatusCode::SERVICE_UNAVAILABLE, &failures.join("; "));
        }
        let mut reply = self.reply(StatusCode::OK, "");
        if !req.wave {
            self.add_drain_warnings(&plan.targets, &mut reply.1);
        }
        reply
    }

    /// The 200 answer of an individual drain of `targets`, as `drain` builds it (golden tests,
    /// `documents::golden`: a drain without agents is refused before it gets there).
    #[cfg(test)]
    pub(crate) fn drain_reply_for_test(&self, targets: &[String]) -> Reply {
        let mut reply = self.reply(StatusCode::OK, "");
        self.add_drain_warnings(targets, &mut reply.1);
        reply
    }

    /// Adds `warnings` to a drain's 200 document: a drained engine that was its role's only
    /// live engine leaves the fleet serving aggregated (or, for SGLang without a decode
    /// engine, not at all) until one returns (docs/operate.md; [`sole_engine_warning`]).
    fn add_drain_warnings(&self, targets: &[String], doc: &mut LifecycleReply) {
        let fleet = self.fleet();
        let warnings: Vec<String> = fleet.read(|state| {
            targets
                .iter()
                .filter_map(|iid| {
                    let i = fleet.index(iid)?;
                    let role = state.slots()[i].role;
                    let others = state
                        .slots()
                        .iter()
                        .enumerate()
                        .any(|(j, s)| j != i && s.role == role && s.is_live());
                    sole_engine_warning(self.cfg.backend, role, iid, others)
                })
                .collect()
        });
        doc.warnings = Some(warnings);
    }

    /// `POST /narwhal/lifecycle/readmit` (handoff-and-lifecycle.md, "Readmitting engines";
    /// behaviour.md 1.10, 4.7–4.8).
    pub(crate) async fn readmit(&self, body: Bytes) -> Reply {
        let (req, scope) = match self.accept(parse_readmit(&body)) {
            Ok(r) => r,
            Err(reply) => return *reply,
        };
        let _serial = self.serial.lock().await;
        if !self.ha().live(&scope) {
            return self.reply(StatusCode::SERVICE_UNAVAILABLE, NOT_IN_CONTROL);
        }
        let targets = {
            let counts = self.fleet().resident_counts();
            let mut lc = self.exec.lock();
            let t = self.exec.now();
            let resident = |iid: &str| counts.get(iid).copied().unwrap_or(0);
            match lc.mark_validating(t, &req.engines, req.wave, resident) {
                Ok(mut targets) => {
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
                }
                Err(e) => {
                    drop(lc);
                    return self.reply(refusal_status(&e), &e.to_string());
                }
            }
        };
        let report = self.run_validation(&targets, req.wave, &scope).await;
        self.finish(&targets, report, "operator", &scope).await
    }

    /// `POST /narwhal/lifecycle/cancel-drain` (ours; docs/deviations.md):
    /// an engine drained by mistake returns to service without a restart. Body
    /// `{"engines": ["e0"]}`. The engine must be held by an individual drain that recorded its
    /// process; it is validated through the readmission checks with no restart required
    /// (`process identity` instead of `new process identity`) and must still be that process.
    /// 200: back in placement (`drain_cancelled` event); 409: a rule, or the checks failed (the
    /// engine stays `blocked`, restart-required: a restart and the readmission of
    /// handoff-and-lifecycle.md, or another cancel, bring it back); 503: not in control.
    pub(crate) async fn cancel_drain(&self, body: Bytes) -> Reply {
        let (req, scope) = match self.accept(parse_readmit(&body)) {
            Ok(r) => r,
            Err(reply) => return *reply,
        };
        let _serial = self.serial.lock().await;
        if !self.ha().live(&scope) {
            return self.reply(StatusCode::SERVICE_UNAVAILABLE, NOT_IN_CONTROL);
        }
        let (iid, recorded) = {
            let mut lc = self.exec.lock();
            match lc.begin_cancel_drain(self.exec.now(), &req.engines, req.wave) {
                Ok(x) => {
                    self.exec.commit(&mut lc);
                    x
                }
                Err(e) => {
                    drop(lc);
                    return self.reply(StatusCode::CONFLICT, &e.to_string());
                }
            }
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
                let t = self.exec.now();
                let mut lc = self.exec.lock();
                lc.abort_validation(t, "router control was fenced during validation");
                self.exec.commit(&mut lc);
                drop(lc);
                record_metric("fenced");
                return self.reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "router control was fenced during validation",
                );
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
            let mut lc = self.exec.lock();
            lc.abort_validation(t, "router control was fenced during validation");
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("fenced");
            return self.reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "router control was fenced during validation",
            );
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
            self.reply(StatusCode::OK, "")
        } else {
            lc.validation_failed(t, &report.engines);
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("failed");
            self.reply(StatusCode::CONFLICT, "drain cancel validation failed")
        }
    }

    /// Every configured engine with its current router role (the role controller may have
    /// moved it from the configured one), config order.
    fn roles(&self) -> Vec<(String, Role)> {
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
        let (status, doc) = self.finish(&targets, report, "role_check", &scope).await;
        let record = self.exec.lock().record(&iid).cloned();
        match (status, record) {
            (StatusCode::OK, Some(r)) => Ok(r.checks),
            (_, Some(r)) if !r.error.is_empty() => Err(RoleCheckError::Failed(r.error)),
            _ => Err(RoleCheckError::Failed(if doc.document.error.is_empty() {
                "role check failed".to_string()
            } else {
                doc.document.error
            })),
        }
    }

    /// Builds the validation plan for `targets` from the records and the live fleet.
    fn plan(&self, targets: &[String], wave: bool) -> Plan {
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
    async fn run_validation(
        &self,
        targets: &[String],
        wave: bool,
        scope: &EpochScope,
    ) -> Option<Report> {
        self.run_plan(&self.plan(targets, wave), scope).await
    }

    /// Runs the checks of `plan` through the agents under `scope` (its fence token); `None`
    /// when control under its epoch ended first.
    async fn run_plan(&self, plan: &Plan, scope: &EpochScope) -> Option<Report> {
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
    /// stale port (found by tests/tests/lifecycle_e2e.rs: refreshing after the release let
    /// the first requests' decodes fail their rendezvous). A failed refresh is logged;
    /// requests refresh the port on demand.
    async fn finish(
        &self,
        targets: &[String],
        report: Option<Report>,
        kind: &'static str,
        scope: &EpochScope,
    ) -> Reply {
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
                let mut lc = self.exec.lock();
                lc.abort_validation(
                    self.exec.now(),
                    "router control was fenced during validation",
                );
                self.exec.commit(&mut lc);
                drop(lc);
                record_metric("fenced");
                return self.reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "router control was fenced during validation",
                );
            }
        };
        if report.passed() {
            for i in bootstrap_refresh(self.cfg.backend, &self.roles(), targets) {
                if let Err(e) =
                    crate::bootstrap::refresh(&self.cfg, self.fleet(), &self.upstream, i).await
                {
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
            let mut lc = self.exec.lock();
            lc.abort_validation(t, "router control was fenced during validation");
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("fenced");
            return self.reply(
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
            let mut lc = self.exec.lock();
            for iid in lc.readmitted(t, &outcome) {
                if let Some(i) = self.fleet().index(&iid) {
                    self.fleet().verified(i);
                }
            }
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("passed");
            self.reply(StatusCode::OK, "")
        } else {
            let mut lc = self.exec.lock();
            lc.validation_failed(t, &report.engines);
            self.exec.commit(&mut lc);
            drop(lc);
            record_metric("failed");
            self.reply(StatusCode::CONFLICT, "readmission validation failed")
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
        // by tests/tests/lifecycle_e2e.rs under load; main dfdfeaa, carried over here).
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
        let (status, _) = self.finish(&targets, report, "recovery", &scope).await;
        status == StatusCode::OK
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
    controller: Option<&crate::phase::Controller>,
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

/// The ejected engine an individual readmission of `target` must validate alongside it
/// ([`Lifecycle::join_recovery`]): when no engine of the opposite role is live, the first
/// ejected one in config order. `None` when a live peer exists (the usual case), for an
/// aggregated fleet (one role), or when no opposite-role engine is ejected.
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

/// What draining `iid`, of role `role`, does to serving when no other engine of that role is
/// live (`others_live` false): placement then serves every request aggregated, as one leg
/// without KV transfer (behaviour.md 6.7; docs/http-api.md "Serving"): on the decode
/// engines when the prefill pool is empty; on the prefill engines when a vLLM decode pool is
/// empty; and not at all (503 `no_schedulable_engines`) when an SGLang decode pool is empty,
/// since SGLang serves aggregated only on decode engines. `None` while another engine of the
/// role is live.
fn sole_engine_warning(
    backend: Backend,
    role: Role,
    iid: &str,
    others_live: bool,
) -> Option<String> {
    if others_live {
        return None;
    }
    let r = role.as_str();
    Some(match (backend, role) {
        (_, Role::Prefill) => format!(
            "{iid} was the only live {r} engine: until a {r} engine returns, requests are served aggregated on the decode engines (one leg, no prefill/decode split)"
        ),
        (Backend::Vllm, Role::Decode) => format!(
            "{iid} was the only live {r} engine: until a {r} engine returns, requests are served aggregated on the prefill engines (one leg, no prefill/decode split)"
        ),
        (Backend::Sglang, Role::Decode) => format!(
            "{iid} was the only live {r} engine: until a {r} engine returns, every request is answered 503 no_schedulable_engines (SGLang serves aggregated only on decode engines)"
        ),
    })
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
    fn draining_a_roles_only_live_engine_says_how_traffic_is_served() {
        assert_eq!(
            sole_engine_warning(Backend::Vllm, Role::Prefill, "p0", true),
            None
        );
        let w = sole_engine_warning(Backend::Vllm, Role::Prefill, "p0", false).unwrap();
        assert!(w.starts_with("p0 was the only live prefill engine"), "{w}");
        assert!(w.contains("aggregated on the decode engines"), "{w}");
        let w = sole_engine_warning(Backend::Vllm, Role::Decode, "d0", false).unwrap();
        assert!(w.contains("aggregated on the prefill engines"), "{w}");
        let w = sole_engine_warning(Backend::Sglang, Role::Decode, "d0", false).unwrap();
        assert!(w.contains("503 no_schedulable_engines"), "{w}");
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
        let c = crate::phase::Controller {
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
        let (parts, _clock) = crate::phase::tests::leased(dir.path());
        assert_eq!(parts.ha.lease().claim().await, Ok(1));
        parts.ha.publish(crate::phase::HaPhase::Active);
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
        let (status, d) = parts
            .lifecycle
            .drain(Bytes::from_static(br#"{"engines": ["d0"]}"#))
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(d.document.error, NOT_IN_CONTROL);
    }
}
