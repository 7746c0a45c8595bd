//! Readmission of an engine restarted after its drain (`control.self_drain.readmit`, on by
//! default with `control.self_drain`; docs/kubernetes.md, "Self-drain"): on Kubernetes a pod's
//! preStop drains its engine, the kubelet stops it, and the pod (or its replacement at the same
//! address) starts a new process. Nobody runs `narwhalctl readmit` then, so the controlling
//! router does: every second it looks for drained engines that are `ready_to_stop` (outside a
//! wave, which the operator readmits as one set) and whose engine answers its health path, and
//! readmits each through the six checks (handoff-and-lifecycle.md, "Readmission"), exactly as
//! `POST /narwhal/lifecycle/readmit` would. It first asks the engine's agent for the process
//! now behind the engine and goes on only when that process started after the one the drain
//! recorded: the old process answers health for a while after its drain (the preStop returns,
//! then the kubelet stops it), and a readmission of it would be refused and block the record.
//! A refused attempt waits 2, 4, then 8 seconds before the next.
//!
//! Stateless: it decides from the lifecycle document alone, so a standby that takes over
//! mid-restart goes on where the primary stopped.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use narwhal_shared::documents::requests::ReadmitBody;
use tokio_util::sync::CancellationToken;

use crate::breaker::HealthAnswer;
use crate::lifecycle::api::Action;
use crate::parts::Parts;

/// How often the drained engines are looked at.
const EVERY: Duration = Duration::from_secs(1);
/// The longest wait between two refused attempts on one engine.
const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// Runs until `stop`.
pub(crate) async fn run(parts: Arc<Parts>, stop: CancellationToken) {
    // Per engine: when the next attempt may run, and the refusals so far.
    let mut next: BTreeMap<String, (Instant, u32)> = BTreeMap::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(EVERY) => {}
        }
        if !parts.ha.controls_fleet() {
            continue;
        }
        let doc = parts.lifecycle.document("");
        if doc.wave.active {
            continue;
        }
        let now = parts.clock.now();
        for (iid, e) in &doc.engines {
            if !(e.draining && e.ready_to_stop) {
                next.remove(iid);
                continue;
            }
            if next.get(iid).is_some_and(|(at, _)| now < *at) {
                continue;
            }
            let Some(i) = parts.cfg.engines.iter().position(|c| &c.iid == iid) else {
                continue;
            };
            if !restarted(&parts, i, e.old_process_start).await
                || !matches!(
                    crate::monitor::health(&parts, i).await,
                    Ok(HealthAnswer::Ok)
                )
            {
                continue;
            }
            let body = serde_json::to_vec(&ReadmitBody::engine(iid)).unwrap_or_default();
            let (status, reply) =
                crate::handoff::acknowledged_action(&parts, Action::Readmit, body.into()).await;
            if status == StatusCode::OK {
                tracing::info!(engine = %iid, "restarted engine readmitted through the checks");
                next.remove(iid);
            } else {
                let refusals = next.get(iid).map_or(0, |(_, n)| *n) + 1;
                let wait = Duration::from_secs(1 << refusals.min(3)).min(MAX_BACKOFF);
                tracing::info!(
                    engine = %iid,
                    status = status.as_u16(),
                    error = %reply.document.error,
                    retry_in_s = wait.as_secs(),
                    "restarted engine not readmitted yet"
                );
                next.insert(iid.clone(), (parts.clock.now() + wait, refusals));
            }
        }
    }
}

/// Whether engine `i`'s agent shows a process that started after `old_start` (the drained
/// process's start, Unix seconds; more than 1 ms later, as `facts` compares starts). `false`
/// without an agent, without a recorded start, or when the agent does not answer.
async fn restarted(parts: &Parts, i: usize, old_start: Option<f64>) -> bool {
    let (Some(agent), Some(old)) = (parts.lifecycle.agents().get(i), old_start) else {
        return false;
    };
    match agent.process(&parts.cfg.engines[i].iid).await {
        Ok(p) => p.process_start_time_seconds > old + 0.001,
        Err(_) => false,
    }
}
