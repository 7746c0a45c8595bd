//! The monitor task: every `controller.monitor_interval_s`, whole-wave enforcement and the
//! breaker's due probes (`GET <engine>/health`; reference-notes 6.4, 4.9), and at startup
//! the SGLang bootstrap ports.
//!
//! ```text
//!  tick ──► Lifecycle::enforce_whole_wave
//!       ──► Fleet::due_probes ──► GET /health ──► probe metric
//!              ok + SGLang prefill ──► bootstrap::refresh
//!              readmission probe ok + agent ──► Lifecycle::recover (validation)
//!              otherwise ──► Fleet::observe(HealthOk | HealthFailed)
//! ```

use std::sync::Arc;

use http::StatusCode;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::bootstrap;
use crate::breaker::{Observation, ProbeKind};
use crate::config::{Backend, Role, secs};
use crate::metrics::labels;
use crate::parts::Parts;

/// Runs the monitor until `stop`.
pub(crate) async fn monitor(parts: Arc<Parts>, stop: CancellationToken) {
    let period = secs(parts.cfg.controller.monitor_interval_s);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        parts.lifecycle.enforce_whole_wave();
        for (iid, kind) in parts.fleet.due_probes() {
            let span = tracing::info_span!("probe", engine = %parts.cfg.engines[iid].iid);
            tokio::spawn(probe(parts.clone(), iid, kind).instrument(span));
        }
    }
}

/// One breaker probe of engine `iid`.
async fn probe(parts: Arc<Parts>, iid: usize, kind: ProbeKind) {
    let engine = &parts.cfg.engines[iid];
    let url = format!("{}/health", engine.url);
    let res = parts
        .upstream
        .get(&url, secs(parts.cfg.engine.health_timeout_s))
        .await;
    let ok = matches!(res, Ok((StatusCode::OK, _)));
    let kind_label = match kind {
        ProbeKind::Readmission => "readmission",
        ProbeKind::Verification => "health",
    };
    parts
        .metrics
        .probes
        .get_or_create(&labels(&[
            ("iid", &engine.iid),
            ("kind", kind_label),
            ("outcome", if ok { "passed" } else { "failed" }),
        ]))
        .inc();
    if ok
        && parts.cfg.backend == Backend::Sglang
        && parts.fleet.role(iid) == Role::Prefill
        && let Err(e) = bootstrap::refresh(&parts.cfg, &parts.fleet, &parts.upstream, iid).await
    {
        tracing::warn!(error = %e, "bootstrap port refresh failed");
    }
    tracing::debug!(ok, "probe finished");
    if ok && kind == ProbeKind::Readmission && parts.lifecycle.agents().has(iid) {
        // An engine with an agent comes back only through validation of its running process
        // (transient breaker ejection), not on a bare health answer.
        if !parts.lifecycle.recover(iid).await {
            parts.fleet.probe_inconclusive(iid);
        }
        return;
    }
    parts.fleet.observe(
        iid,
        if ok {
            Observation::HealthOk
        } else {
            Observation::HealthFailed
        },
    );
}

/// SGLang: learn every prefill engine's bootstrap port at startup (best effort).
pub(crate) async fn warm_bootstrap_ports(parts: Arc<Parts>) {
    if parts.cfg.backend != Backend::Sglang {
        return;
    }
    for (iid, e) in parts.cfg.engines.iter().enumerate() {
        if parts.fleet.role(iid) == Role::Prefill
            && let Err(err) =
                bootstrap::refresh(&parts.cfg, &parts.fleet, &parts.upstream, iid).await
        {
            tracing::warn!(engine.id = %e.iid, error = %err, "bootstrap port unknown at startup; will retry per request");
        }
    }
}
