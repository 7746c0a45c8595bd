//! The controller's driver: the pass loop (every `controller.monitor_interval_s`, or at once
//! when the urgency latch is armed), and the application of the machine's commands: role
//! labels through the fleet, the SGLang engine-side switch (controller.md 9.2), the role
//! check through the lifecycle (ours), risk events, journal events.
//!
//! ```text
//!  tick | wake ──controls the fleet, no lifecycle hold?──► Machine::pass | urgent
//!                └─ otherwise ──► Machine::interrupt (a standby or fenced router decides nothing)
//!  SetRole ──vLLM──► Fleet::set_role ──agent?──► switching ─► role check ─► pass | undo + held
//!          ──SGLang─► Fleet::set_role + switching ─► GET /server_info ─► POST /pd_role_switch
//!                       └─ failure ─► eject(role_switch)      success ─► role check as above
//! ```

use crate::journal::Event;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::machine::{Command, Now};
use super::roles::Engine;
use super::{Controller, Ledger};
use crate::breaker::EjectCause;
use crate::config::{Backend, Config, Role, secs};
use crate::fleet::Fleet;
use crate::ha_phase::EpochScope;
use crate::placement::Exclusion;
use crate::upstream::EngineCallError;

/// How long an engine-side switch keeps retrying while the engine answers `not idle`
/// (controller.md 9.2).
const SWITCH_IDLE_WAIT: Duration = Duration::from_secs(10);
/// Between those retries.
const SWITCH_RETRY: Duration = Duration::from_millis(200);
/// The client timeout of one switch call.
const SWITCH_TIMEOUT: Duration = Duration::from_secs(60);

/// Why an engine-side role switch failed ([`Controller::engine_switch`]); the engine is
/// ejected then.
#[derive(Debug, thiserror::Error)]
enum SwitchError {
    /// `GET /server_info` got no answer (the upstream client's reason).
    #[error("GET /server_info: {0}")]
    ServerInfo(EngineCallError),
    /// `GET /server_info` answered another status than 200.
    #[error("GET /server_info answered {0}")]
    ServerInfoStatus(StatusCode),
    /// `/server_info` answered something that is not JSON.
    #[error("/server_info is not JSON: {0}")]
    ServerInfoJson(#[source] serde_json::Error),
    /// `POST /pd_role_switch` got no answer (the upstream client's reason).
    #[error("POST /pd_role_switch: {0}")]
    Post(EngineCallError),
    /// The engine answered the switch with a failure (after the `not idle` retries).
    #[error("engine refused the switch to {}: {message}", .to.as_str())]
    Refused {
        /// The role asked for.
        to: Role,
        /// The engine's `message`, or its whole answer.
        message: String,
    },
}

/// What woke the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// The monitor interval.
    Scheduled,
    /// The urgency latch.
    Urgent,
    /// An exclusion changed.
    Availability,
}

/// Every configured engine as the fleet has it now.
pub(super) fn engines_view(cfg: &Config, fleet: &Fleet) -> Vec<Engine> {
    fleet.read(|state| {
        cfg.engines
            .iter()
            .zip(state.slots())
            .map(|(e, s)| Engine {
                iid: e.iid.clone(),
                role: s.role,
                live: s.is_live(),
                pinned: e.pin,
                fixed: e.kv_role.fixed_role().map(|_| e.kv_role),
                ejected: s.excluded.contains(&Exclusion::Ejected),
            })
            .collect()
    })
}

impl Controller {
    fn now(&self) -> Now {
        Now {
            mono: self.h.clock.now(),
            wall: self.h.clock.wall().unwrap_or(0.0),
        }
    }

    /// The epoch scope this router decides under: `Some` when it controls the fleet (its HA
    /// phase holds control under a live lease, ha-and-fencing.md) and no whole-wave hold blocks it
    /// (controller.md 2.1); `None` for a standby or fenced router, which decides nothing.
    fn may_decide(&self) -> Option<EpochScope> {
        self.h
            .ha
            .scope()
            .filter(|_| self.h.gate.lifecycle_hold().is_none())
    }

    /// Runs the pass loop until `stop` (nothing when the controller is off).
    pub(crate) async fn run(self: Arc<Self>, stop: CancellationToken) {
        if !self.enabled {
            return;
        }
        // The health gate's first round: an engine whose health path has
        // not answered yet is not missing, so no floor is judged before every engine answered
        // once (or the startup budget of `monitor::startup` ran out).
        let cfg = &self.h.cfg;
        let budget = secs(cfg.engine.health_timeout_s + cfg.controller.monitor_interval_s);
        tokio::select! {
            () = stop.cancelled() => return,
            () = self.h.fleet.wait_settled(self.h.clock.now() + budget) => {}
        }
        let mut tick = tokio::time::interval(secs(self.h.cfg.controller.monitor_interval_s));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            let kind = tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => Pass::Scheduled,
                () = self.wake.notified() => Pass::Urgent,
                () = self.h.fleet.availability_changed() => Pass::Availability,
            };
            self.run_pass(kind).await;
            // A cascade of urgent moves (S11): the latch re-armed by an urgent move.
            while self.lock().latched() && self.may_decide().is_some() && !stop.is_cancelled() {
                self.run_pass(Pass::Urgent).await;
                if !self.lock().latched() {
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
    }

    /// One scheduled pass now (golden tests of `/narwhal/state`, `documents::golden`).
    #[cfg(test)]
    pub(crate) async fn pass_for_test(self: &Arc<Self>) {
        self.run_pass(Pass::Scheduled).await;
    }

    /// One pass (scheduled) or urgent evaluation, inside the failure ledger: a panic in
    /// the pure core is a `monitoring_stage_failure` of stage `controller` and the loop
    /// continues (controller.md 11.1).
    async fn run_pass(self: &Arc<Self>, kind: Pass) {
        let now = self.now();
        let engines = engines_view(&self.h.cfg, &self.h.fleet);
        let (risk, events) = {
            let d = self.h.demand.lock();
            (d.risk().map(|(k, at)| (k.to_string(), at)), d.events())
        };
        let scope = self.may_decide();
        let decide = scope.is_some();
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut m = self.lock();
            m.observe(engines, risk, events);
            if !decide {
                m.interrupt();
                return Vec::new();
            }
            match kind {
                Pass::Scheduled => m.pass(now),
                Pass::Urgent => m.urgent(now),
                Pass::Availability => m.availability(now),
            }
        }));
        match result {
            Ok(commands) => {
                self.ledger_ok();
                if let Some(scope) = scope {
                    self.apply(commands, now, &scope);
                }
            }
            Err(panic) => {
                let class = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into());
                self.ledger_failed(&class, now.wall);
            }
        }
        let held = self.lock().core.roles.held(now.mono);
        self.h.fleet.set_avoided(held);
    }

    fn ledger_ok(&self) {
        self.ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .consecutive = 0;
    }

    fn ledger_failed(&self, class: &str, wall: f64) {
        let mut l = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        *l = Ledger {
            failures: l.failures + 1,
            consecutive: l.consecutive + 1,
            last_class: Some(class.to_string()),
            last_at: Some(wall),
        };
        tracing::error!(stage = "controller", class, "controller pass failed");
        self.h.journal.emit(Event::MonitoringStageFailure {
            stage: "controller",
            class: class.to_string(),
            at: wall,
            consecutive: l.consecutive,
        });
    }

    /// Applies the machine's commands.
    /// Applies the commands of a pass decided under `scope`; none when control under that
    /// epoch ended meanwhile (the machine forgets the pass's pending work, as for a standby).
    fn apply(self: &Arc<Self>, commands: Vec<Command>, now: Now, scope: &EpochScope) {
        if !self.h.ha.live(scope) {
            self.lock().interrupt();
            return;
        }
        for c in commands {
            match c {
                Command::Journal(v) => self.h.journal.emit(v),
                Command::Risk(kind) => self.h.demand.lock().record(kind, now.mono),
                Command::SetRole { iid, to } => self.set_role(iid, to, scope.clone()),
            }
        }
    }

    /// Moves engine `iid` to router role `to`; the engine-side switch and the role check run
    /// under `scope` and stop (without ejecting anything) when control under it ends.
    fn set_role(self: &Arc<Self>, iid: usize, to: Role, scope: EpochScope) {
        let name = &self.h.cfg.engines[iid].iid;
        tracing::info!(engine.id = %name, to = to.as_str(), "role flip");
        self.h.fleet.set_role(iid, to);
        let engine_side = self.h.cfg.backend == Backend::Sglang;
        let agent = self.h.lifecycle.agents().has(iid);
        if !engine_side && !agent {
            return;
        }
        // Out of placement until the new role is established.
        self.h.fleet.set_switching(iid, true);
        self.changing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(iid);
        let me = self.clone();
        tokio::spawn(async move {
            let switched = if engine_side {
                tokio::select! {
                    r = me.engine_switch(iid, to) => Some(r),
                    () = scope.ended() => None,
                }
            } else {
                Some(Ok(()))
            };
            let switched = switched.filter(|_| me.h.ha.live(&scope));
            match switched {
                None => {
                    tracing::info!(engine.id = %me.h.cfg.engines[iid].iid, "router control ended during a role change; the engine-side outcome is left to the router in control");
                }
                Some(Err(why)) => {
                    tracing::warn!(engine.id = %me.h.cfg.engines[iid].iid, error = %why, "engine-side role switch failed");
                    me.h.journal.emit(Event::RoleSwitchFailed {
                        iid: me.h.cfg.engines[iid].iid.clone(),
                        to: to.as_str(),
                        error: why.to_string(),
                        at: me.now().wall,
                    });
                    me.h.fleet.eject(iid, EjectCause::RoleSwitch);
                }
                Some(Ok(())) => {
                    if engine_side && to == Role::Prefill {
                        let _ =
                            crate::bootstrap::refresh(&me.h.cfg, &me.h.fleet, &me.h.upstream, iid)
                                .await;
                    }
                    if agent {
                        me.role_check(iid, to, &scope).await;
                    }
                }
            }
            me.h.fleet.set_switching(iid, false);
            me.changing
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&iid);
        });
    }

    /// Our fifth-check rule (docs/deviations.md): before the engine serves in its new role, the
    /// readmission checks run against it in that role (the KV-transfer check pairs it with
    /// a live engine of the other role). A failure undoes the flip and leaves the engine
    /// held by the lifecycle (blocked, with the error), visible in `/narwhal/lifecycle`.
    /// Runs under `scope`: a check that ends after control under it ended reverses nothing
    /// (the router in control now owns the engine's role).
    async fn role_check(self: &Arc<Self>, iid: usize, to: Role, scope: &EpochScope) {
        let name = self.h.cfg.engines[iid].iid.clone();
        let result = self.h.lifecycle.role_check(iid).await;
        if !self.h.ha.live(scope) {
            tracing::info!(engine.id = %name, "router control ended during a role check; nothing reversed");
            return;
        }
        match result {
            Ok(checks) => {
                self.h.journal.emit(Event::RoleCheckPassed {
                    iid: name,
                    role: to.as_str(),
                    checks,
                    at: self.now().wall,
                });
            }
            Err(e) => {
                let why = e.to_string();
                tracing::warn!(engine.id = %name, error = %why, "role check failed; flip reversed");
                self.h.journal.emit(Event::RoleCheckFailed {
                    iid: name,
                    role: to.as_str(),
                    error: why.clone(),
                    at: self.now().wall,
                });
                let now = self.now();
                let commands = self.lock().role_check_failed(now, iid, &why);
                for c in commands {
                    match c {
                        Command::SetRole { iid, to } => self.h.fleet.set_role(iid, to),
                        Command::Journal(v) => self.h.journal.emit(v),
                        Command::Risk(kind) => self.h.demand.lock().record(kind, now.mono),
                    }
                }
            }
        }
    }

    /// The SGLang role switch (controller.md 9.2): `GET /server_info`; nothing to do when
    /// `internal_states[0].disaggregation_mode` is already `to`; else `POST /pd_role_switch
    /// {"new_role"}` (with `decode_cuda_graph_memory_gb` from `server_info` for decode),
    /// retried every 0.2 s for up to 10 s while the engine answers `not idle`. Shapes from
    /// SGLang's own tests of the route (`test_pd_role_switch.py`, its NPU service test).
    ///
    /// # Errors
    /// [`SwitchError`] naming the call that failed, or the engine's refusal.
    async fn engine_switch(&self, iid: usize, to: Role) -> Result<(), SwitchError> {
        let base = &self.h.cfg.engines[iid].url;
        let (status, body) = self
            .h
            .upstream
            .get(&format!("{base}/server_info"), SWITCH_TIMEOUT)
            .await
            .map_err(SwitchError::ServerInfo)?;
        if status != StatusCode::OK {
            return Err(SwitchError::ServerInfoStatus(status));
        }
        let info: ServerInfo =
            serde_json::from_slice(&body).map_err(SwitchError::ServerInfoJson)?;
        let state = info.internal_states.into_iter().next().unwrap_or_default();
        if state.disaggregation_mode.as_ref().and_then(Value::as_str) == Some(to.as_str()) {
            return Ok(());
        }
        let switch = RoleSwitchRequest {
            new_role: to.as_str(),
            decode_cuda_graph_memory_gb: state
                .decode_cuda_graph_memory_gb
                .as_ref()
                .and_then(Value::as_f64)
                .filter(|g| to == Role::Decode && *g > 0.0),
        };
        // A struct of a string and a finite number always serialises.
        let req = serde_json::to_value(&switch).unwrap_or(Value::Null);
        let give_up = self.h.clock.now() + SWITCH_IDLE_WAIT;
        loop {
            let (status, body) = self
                .h
                .upstream
                .post_json(&format!("{base}/pd_role_switch"), &req, SWITCH_TIMEOUT)
                .await
                .map_err(SwitchError::Post)?;
            let text = String::from_utf8_lossy(&body).to_string();
            let answer: RoleSwitchReply = serde_json::from_slice(&body).unwrap_or_default();
            if status == StatusCode::OK && answer.success == Some(Value::Bool(true)) {
                return Ok(());
            }
            if text.contains("not idle") && self.h.clock.now() < give_up {
                tokio::time::sleep(SWITCH_RETRY).await;
                continue;
            }
            let message = answer
                .message
                .as_ref()
                .and_then(Value::as_str)
                .unwrap_or(text.as_str())
                .to_string();
            return Err(SwitchError::Refused { to, message });
        }
    }

    /// Engines whose role change is running (for `/narwhal/state`).
    pub(crate) fn changing(&self) -> Vec<usize> {
        self.changing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .collect()
    }
}

/// SGLang's `GET /server_info`, the member the role switch reads (controller.md 9.2). Its
/// members are read leniently, as the untyped reading did: a member of another JSON type is as
/// good as absent.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ServerInfo {
    /// One entry per scheduler; the first is read.
    internal_states: Vec<SchedulerState>,
}

/// One of [`ServerInfo::internal_states`].
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SchedulerState {
    /// The live role (`prefill`, `decode`, `null`): a string.
    disaggregation_mode: Option<Value>,
    /// The decode CUDA-graph memory to give back on a switch to decode, GB: a number.
    decode_cuda_graph_memory_gb: Option<Value>,
}

/// `POST /pd_role_switch`'s body (SGLang's own tests of the route).
#[derive(Debug, Serialize)]
struct RoleSwitchRequest {
    /// `prefill` or `decode`.
    new_role: &'static str,
    /// For a switch to decode, `decode_cuda_graph_memory_gb` from `/server_info` when positive.
    #[serde(skip_serializing_if = "Option::is_none")]
    decode_cuda_graph_memory_gb: Option<f64>,
}

/// `POST /pd_role_switch`'s answer: `success: true`, else a `message`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RoleSwitchReply {
    /// `true` when switched.
    success: Option<Value>,
    /// Why not.
    message: Option<Value>,
}
