//! The monitor task: every `controller.monitor_interval_s`, whole-wave enforcement and the
//! breaker's due probes (behaviour.md 6.3, 6.4, 6.6, 4.9; docs/deviations.md), and the
//! startup wait for the health gate.
//!
//! ```text
//!  tick ──► Lifecycle::enforce_whole_wave
//!       ──► Fleet::due_probes ──► per ticket, GET <engine><health_path>:
//!             gate:        200 ──► read facts ──► Fleet::learn ──► admitted
//!             liveness:    200 + sweep or asked ──► read facts ──► Fleet::learn (a new process?)
//!             readmission: 200 ──► read facts ──► agent? Lifecycle::recover (validation)
//!                                              └─ else generation probe (1 token)
//!       ──► Fleet::probe_result(ticket, result)
//!  startup ──► Fleet::wait_settled (every gate answered, or health timeout + one interval)
//!  not controlling the fleet (standby, fenced): gate probes only; on (re)gaining control
//!  every engine's facts are learned afresh (Fleet::relearn_all)
//! ```

use crate::journal::Event;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use narwhal_shared::check_request::{Bootstrap, CheckCompletion};
use tracing::Instrument;

use crate::bootstrap;
use crate::breaker::{HealthAnswer, ProbeKind, ProbeResult, Ticket};
use crate::config::{Backend, secs};
use crate::metrics::labels;
use crate::parts::Parts;
use crate::upstream::{EngineCallError, LegError, LegId};
use narwhal_relay::RelayOptions;

/// SGLang's placeholder rendezvous host: a request naming it runs locally on a prefill- or
/// decode-mode server without a peer (SGLang's own `/health` generation uses it:
/// `sglang/srt/disaggregation/utils.py`, `FAKE_BOOTSTRAP_HOST`).
pub(crate) const FAKE_BOOTSTRAP_HOST: &str = "2.2.2.2";

/// Runs the monitor until `stop`.
pub(crate) async fn monitor(parts: Arc<Parts>, stop: tokio_util::sync::CancellationToken) {
    let period = secs(parts.cfg.controller.monitor_interval_s);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let every = u64::from(parts.cfg.recovery.liveness_every);
    let mut n: u64 = 0;
    let mut was_controlling = false;
    // The stall watch is judged more often than the breaker's probes: a quarter of its
    // window (at least 50 ms, at most one monitor interval), so a stalled engine's legs are
    // given up within about a window and a probe of their first-token limit.
    let stall_period = (parts.cfg.first_token_timeout() / 4)
        .max(Duration::from_millis(50))
        .min(period);
    let mut stall_tick = tokio::time::interval(stall_period);
    stall_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = stall_tick.tick() => {
                stall_check(&parts);
                continue;
            }
            _ = tick.tick() => {}
        }
        let controlling = parts.ha.controls_fleet();
        if controlling && !was_controlling {
            // What was learned before may predate restarts another router drove.
            parts.fleet.relearn_all();
        }
        was_controlling = controlling;
        parts.lifecycle.enforce_whole_wave();
        let sweep = every > 0 && n.is_multiple_of(every);
        n += 1;
        for ticket in parts.fleet.due_probes() {
            let span = tracing::debug_span!("probe", engine = %parts.cfg.engines[ticket.iid].iid, kind = ticket.kind.as_str());
            tokio::spawn(probe(parts.clone(), ticket, sweep).instrument(span));
        }
    }
}

/// At startup: waits until every engine's health gate was answered (200 or not), at most
/// `engine.health_timeout_s` plus one monitor interval (an engine whose first probe hangs
/// gets a second one on the next tick).
pub(crate) async fn startup(parts: &Parts) {
    let budget = secs(parts.cfg.engine.health_timeout_s + parts.cfg.controller.monitor_interval_s);
    parts.fleet.wait_settled(parts.clock.now() + budget).await;
}

fn count(parts: &Parts, iid: usize, kind: &str, outcome: &str) {
    parts
        .metrics
        .engines
        .probes
        .get_or_create(&labels(&[
            ("iid", &parts.cfg.engines[iid].iid),
            ("kind", kind),
            ("outcome", outcome),
        ]))
        .inc();
}

/// One breaker probe (module doc).
async fn probe(parts: Arc<Parts>, ticket: Ticket, sweep: bool) {
    let iid = ticket.iid;
    let controlling = parts.ha.controls_fleet();
    if ticket.kind != ProbeKind::Gate && !controlling {
        // A standby or fenced router judges nothing but its health gate: the primary drives
        // the planned restarts (held there, not here), and the handoff applied on takeover
        // carries its ejections; no generation probes from here either.
        parts.fleet.probe_result(ticket, ProbeResult::Inconclusive);
        return;
    }
    let answer = match health(&parts, iid).await {
        Ok(a) => a,
        Err(local) => {
            // The probe never left the router (no descriptor or memory for its connection):
            // nothing is learned about the engine; it is probed again on the next tick.
            tracing::warn!(error = %local, "health probe not sent: the router is out of connection resources");
            parts.fleet.probe_result(ticket, ProbeResult::Inconclusive);
            return;
        }
    };
    count(&parts, iid, ticket.kind.as_str(), answer.label());
    tracing::debug!(?answer, "health probe answered");
    let fleet = &parts.fleet;
    if answer != HealthAnswer::Ok {
        fleet.probe_result(ticket, ProbeResult::Health(answer));
        return;
    }
    match ticket.kind {
        ProbeKind::Gate => {
            // Learn the process before it takes traffic (an SGLang prefill's bootstrap port);
            // a router that does not control the fleet learns once it does.
            if controlling {
                let reading = bootstrap::read_facts(&parts.cfg, &parts.upstream, iid).await;
                fleet.learn(iid, reading);
            }
            fleet.probe_result(ticket, ProbeResult::Health(answer));
        }
        ProbeKind::Liveness => {
            if (sweep || fleet.identity_requested(iid))
                && fleet
                    .learn(
                        iid,
                        bootstrap::read_facts(&parts.cfg, &parts.upstream, iid).await,
                    )
                    .is_some()
            {
                // A new process: ejected (process_identity); this ticket is stale now.
                fleet.probe_result(ticket, ProbeResult::Inconclusive);
                return;
            }
            fleet.probe_result(ticket, ProbeResult::Health(answer));
        }
        ProbeKind::Readmission => {
            fleet.learn(
                iid,
                bootstrap::read_facts(&parts.cfg, &parts.upstream, iid).await,
            );
            if parts.lifecycle.agents().has(iid) {
                // Through its agent, with the checks of a readmission (behaviour.md 6.4
                // step 8); the lifecycle readmits it (evidence `lifecycle`).
                let back = parts.lifecycle.recover(iid).await;
                count(
                    &parts,
                    iid,
                    "validation",
                    if back { "passed" } else { "failed" },
                );
                fleet.probe_result(ticket, ProbeResult::Inconclusive);
                return;
            }
            let limit = secs(
                parts
                    .cfg
                    .engine
                    .first_token_timeout_s
                    .max(parts.cfg.engine.health_timeout_s),
            );
            let generated = generation(&parts, iid, limit).await;
            if let Err(GenerationFailed(LegError::Local(d))) = &generated {
                // The probe never left the router: nothing is learned; next tick.
                tracing::warn!(error = %d, "generation probe not sent: the router is out of connection resources");
                fleet.probe_result(ticket, ProbeResult::Inconclusive);
                return;
            }
            if let Err(e) = &generated {
                tracing::info!(error = %e, "generation probe failed");
            }
            let passed = generated.is_ok();
            count(
                &parts,
                iid,
                "generation",
                if passed { "passed" } else { "failed" },
            );
            probe_row(&parts, iid, "generation", generated.err());
            fleet.probe_result(ticket, ProbeResult::Generation { passed });
        }
    }
}

/// The journal's `engine_probe` row of a generation or stall probe of `iid`: `passed` without
/// an `error`, else `failed` with it.
fn probe_row(parts: &Parts, iid: usize, kind: &'static str, error: Option<impl std::fmt::Display>) {
    let error = error.map(|e| e.to_string());
    let outcome = if error.is_none() { "passed" } else { "failed" };
    parts.journal.emit(Event::EngineProbe {
        iid: parts.cfg.engines[iid].iid.clone(),
        kind,
        outcome,
        error,
        at: parts.wall(),
    });
}

/// Probes every engine the stall watch suspects (behaviour.md 6.9), while this router
/// controls the fleet (a standby judges nothing).
fn stall_check(parts: &Arc<Parts>) {
    if !parts.ha.controls_fleet() {
        return;
    }
    for iid in parts.fleet.stall_suspects() {
        let span = tracing::info_span!("stall_probe", engine = %parts.cfg.engines[iid].iid);
        tokio::spawn(stall_probe(parts.clone(), iid).instrument(span));
    }
}

/// The stall probe: the generation probe, bounded by the stall window
/// (`engine.first_token_timeout_s`), sent straight to an engine whose legs are all silent while
/// its peers answer. No token: the fleet ejects it (cause `stalled`) and gives up its waiting
/// legs. Counted as probe kind `stall`; a failed one is journalled as `engine_probe`.
async fn stall_probe(parts: Arc<Parts>, iid: usize) {
    let window = parts.cfg.first_token_timeout();
    let waited = parts.clock.now();
    let generated = generation(&parts, iid, window).await;
    if let Err(GenerationFailed(LegError::Local(d))) = &generated {
        tracing::warn!(error = %d, "stall probe not sent: the router is out of connection resources");
        parts.fleet.stall_probed(iid, None);
        return;
    }
    if !parts.ha.controls_fleet() {
        parts.fleet.stall_probed(iid, None);
        return;
    }
    let passed = generated.is_ok();
    count(
        &parts,
        iid,
        "stall",
        if passed { "passed" } else { "failed" },
    );
    let error = generated.err().map(|e| e.to_string());
    if passed {
        // An engine busy with long legs (a non-streaming client's whole answer has no output
        // before its end) passes one of these per window: counted, not journalled.
        tracing::debug!(
            waited_s = (parts.clock.now() - waited).as_secs_f64(),
            "stall probe answered: the engine is slow on its legs, not stalled"
        );
    } else {
        tracing::warn!(error = ?error, "stall probe got no token while the engine's peers answer: ejecting it and failing its waiting legs over");
        probe_row(&parts, iid, "stall", error);
    }
    parts.fleet.stall_probed(iid, Some(passed));
}

/// `GET <engine><health_path>` within `engine.health_timeout_s`.
///
/// # Errors
/// [`EngineCallError`] ([`EngineCallError::is_local`]) when the router could not open the
/// probe's connection (out of descriptors or memory): no answer about the engine.
pub(crate) async fn health(parts: &Parts, iid: usize) -> Result<HealthAnswer, EngineCallError> {
    let e = &parts.cfg.engines[iid];
    let url = format!("{}{}", e.url, e.health_path);
    match parts
        .upstream
        .probe_get(&url, secs(parts.cfg.engine.health_timeout_s))
        .await
    {
        Ok((StatusCode::OK, _)) => Ok(HealthAnswer::Ok),
        Ok((status, _)) => Ok(HealthAnswer::Unhealthy(status.as_u16())),
        Err(local) if local.is_local() => Err(local),
        Err(e) if e.timed_out() => Ok(HealthAnswer::TimedOut),
        Err(_) => Ok(HealthAnswer::Unreachable),
    }
}

/// The generation probe the breaker readmits an engine without an agent with (behaviour.md
/// 6.3, "standalone probe"): a streamed one-token completion of the fleet's model straight to
/// the engine, with a plain UUID request id; it passes when a token-bearing chunk arrives
/// within `limit` (a readmission: `max(engine.first_token_timeout_s,
/// engine.health_timeout_s)`; a stall probe: `engine.first_token_timeout_s`). On SGLang the
/// request names [`FAKE_BOOTSTRAP_HOST`], so a prefill- or decode-mode server runs it alone.
///
/// # Errors
/// [`GenerationFailed`] with the failed leg.
async fn generation(parts: &Parts, iid: usize, limit: Duration) -> Result<(), GenerationFailed> {
    let cfg = &parts.cfg;
    let url = format!("{}/v1/completions", cfg.engines[iid].url);
    let prompt = format!("{} breaker verification", uuid::Uuid::new_v4().simple());
    let mut check = CheckCompletion::new(&cfg.model, prompt, 1).streamed(false);
    if cfg.backend == Backend::Sglang {
        check.bootstrap = Some(Bootstrap {
            bootstrap_host: FAKE_BOOTSTRAP_HOST.to_string(),
            bootstrap_port: None,
            bootstrap_room: 0,
        });
    }
    // Strings, numbers and booleans always serialise.
    let body = serde_json::to_value(&check).unwrap_or_default();
    let opts = RelayOptions::new(cfg.serving.max_response_bytes, false);
    // A leg id every engine accepts (a plain UUID per leg, docs/deviations.md).
    let leg = LegId::new(&uuid::Uuid::new_v4().to_string(), None, 1, "probe");
    parts
        .upstream
        .decode(&url, &leg, &body, opts, parts.clock.now() + limit)
        .await
        .map(drop)
        .map_err(GenerationFailed)
}

/// The generation probe's leg failed; shown as the leg's detail.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.detail())]
struct GenerationFailed(LegError);
