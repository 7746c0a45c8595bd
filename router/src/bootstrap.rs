//! What the router reads from an engine's own routes: SGLang bootstrap ports (behaviour.md
//! 7.2 step 2: a prefill engine's `disaggregation_bootstrap_port`, learned from
//! `GET <engine>/server_info` and cached in the fleet; the decode leg's rendezvous names it),
//! and the process facts the breaker compares to notice a new process (module `facts`).
//!
//! ```text
//!  serve (attempt) ──port()──► cached? ──no──► refresh(): GET /server_info ──► Fleet cache
//!  lifecycle (before readmission) ──refresh()──┘
//!  monitor (gate, readmission, liveness sweep) ──read_facts()──► Facts ──► Fleet::learn
//! ```

use http::StatusCode;
use serde_json::Value;

use crate::config::{Backend, Config, secs};
use crate::facts::{self, Facts};
use crate::fleet::Fleet;
pub(crate) use crate::upstream::BootstrapError;
use crate::upstream::{CallFailure, Upstream};

/// The bootstrap port of prefill engine `iid`: cached, else learned now.
///
/// # Errors
/// [`BootstrapError`] when it must be learned and cannot be.
pub(crate) async fn port(
    cfg: &Config,
    fleet: &Fleet,
    upstream: &Upstream,
    iid: usize,
) -> Result<u16, BootstrapError> {
    if let Some(p) = fleet.bootstrap_port(iid) {
        return Ok(p);
    }
    refresh(cfg, fleet, upstream, iid).await
}

/// Fetches and caches `disaggregation_bootstrap_port` from `/server_info` (a number, or a
/// string holding one).
///
/// # Errors
/// [`BootstrapError`]; the cache keeps its previous value then.
pub(crate) async fn refresh(
    cfg: &Config,
    fleet: &Fleet,
    upstream: &Upstream,
    iid: usize,
) -> Result<u16, BootstrapError> {
    let url = format!("{}/server_info", cfg.engines[iid].url);
    let (status, body) = upstream
        .get(&url, secs(cfg.engine.health_timeout_s))
        .await
        .map_err(|e| match e.failure {
            CallFailure::Local(c) => BootstrapError::Local(c),
            _ => BootstrapError::Unreachable(e),
        })?;
    if status != StatusCode::OK {
        return Err(BootstrapError::Status { url, status });
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| BootstrapError::NotJson {
        url: url.clone(),
        reason: e.to_string(),
    })?;
    let port = facts::parse_bootstrap_port(&v).ok_or(BootstrapError::NoPort { url })?;
    fleet.set_bootstrap_port(iid, port);
    Ok(port)
}

/// Reads engine `iid`'s process facts from its own routes, each bounded by
/// `engine.health_timeout_s` (a route that fails leaves its fact unknown): vLLM `/metrics`
/// `process_start_time_seconds`; SGLang `/server_info` `disaggregation_bootstrap_port`; and
/// every engine's `/v1/models` ids.
pub(crate) async fn read_facts(cfg: &Config, upstream: &Upstream, iid: usize) -> Facts {
    let base = &cfg.engines[iid].url;
    let timeout = secs(cfg.engine.health_timeout_s);
    let get = |path: &'static str| {
        let url = format!("{base}{path}");
        async move {
            match upstream.probe_get(&url, timeout).await {
                Ok((StatusCode::OK, body)) => Some(body),
                _ => None,
            }
        }
    };
    let json = |b: Option<bytes::Bytes>| b.and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    let models = get("/v1/models");
    let mut out = Facts::default();
    match cfg.backend {
        Backend::Vllm => {
            let (metrics, models) = futures_util::join!(get("/metrics"), models);
            out.process_start =
                metrics.and_then(|b| facts::parse_process_start(&String::from_utf8_lossy(&b)));
            out.models = json(models).as_ref().and_then(facts::parse_models);
        }
        Backend::Sglang => {
            let (info, models) = futures_util::join!(get("/server_info"), models);
            out.bootstrap_port = json(info).as_ref().and_then(facts::parse_bootstrap_port);
            out.models = json(models).as_ref().and_then(facts::parse_models);
        }
    }
    out
}

/// Whether a reading of a vLLM producer's facts saw its process (the start time its
/// `/metrics` publishes, `process_start_time_seconds`): only such a reading confirms the
/// producer for the failures before it ([`Fleet::confirm`]). One that read nothing (its calls
/// timed out, or the router was out of descriptors) tells nothing about the process, so the
/// next failure reads again instead of being charged on its word.
fn identifies_process(reading: &Facts) -> bool {
    reading.process_start.is_some()
}

/// A decode leg failed at `failed_at` after prefill `p` produced its KV (`used`: `p`'s
/// bootstrap port when the leg failed, SGLang; `process`: `p`'s incarnation when the attempt
/// started): is it the decode's failure (a failure is charged to the engine that
/// caused it)? Not if `p` became a new process meanwhile, or is found to be one now: SGLang, `p`'s
/// `/server_info` names another bootstrap port than `used`; vLLM, `p`'s process facts changed
/// ([`Fleet::learn`] ejects it, `process_identity`). Not either if `p` cannot be reached: that
/// is charged to `p` (`connection`). Otherwise (same process, or no way to tell) it is the
/// decode's: returns `true`. The checks of one producer run one at a time, and a reading that
/// started after this failure answers for it, so a burst of failures reads `p` once.
pub(crate) async fn blame_producer(
    cfg: &Config,
    fleet: &Fleet,
    upstream: &Upstream,
    p: usize,
    used: Option<u16>,
    process: u64,
    failed_at: std::time::Instant,
) -> bool {
    let _turn = fleet.blame_turn(p).await;
    if fleet.incarnation(p) != process {
        return false;
    }
    let same_port = cfg.backend == Backend::Vllm || used == fleet.bootstrap_port(p);
    if same_port && fleet.confirmed_since(p, failed_at) {
        return true;
    }
    let started = fleet.now();
    let unreachable = || {
        fleet.observe_leg_failure(
            p,
            crate::placement::Phase::Prefill,
            crate::breaker::FailureClass::Connection,
            None,
        );
        false
    };
    let timeout = secs(cfg.engine.health_timeout_s);
    if cfg.backend == Backend::Vllm {
        let url = format!("{}{}", cfg.engines[p].url, cfg.engines[p].health_path);
        return match upstream.probe_get(&url, timeout).await {
            // Busy, or the router out of descriptors: nothing against the engine.
            Err(e) if e.timed_out() || e.is_local() => true,
            Err(_) => unreachable(),
            Ok(_) => {
                let reading = read_facts(cfg, upstream, p).await;
                let saw_process = identifies_process(&reading);
                if fleet.incarnation(p) != process || fleet.learn(p, reading).is_some() {
                    return false;
                }
                if saw_process {
                    fleet.confirm(p, started);
                }
                true
            }
        };
    }
    let url = format!("{}/server_info", cfg.engines[p].url);
    let now = match upstream.probe_get(&url, timeout).await {
        Err(e) if e.is_local() => return true,
        Err(_) => return unreachable(),
        Ok((StatusCode::OK, body)) => serde_json::from_slice::<Value>(&body)
            .ok()
            .as_ref()
            .and_then(facts::parse_bootstrap_port),
        Ok(_) => None,
    };
    match (used, now) {
        (Some(a), Some(b)) if a == b => {
            fleet.confirm(p, started);
            true
        }
        (_, Some(b)) => {
            if fleet.incarnation(p) == process {
                // Ejects `p` when its cached port (if any) differs; else refreshes it.
                fleet.learn(
                    p,
                    Facts {
                        bootstrap_port: Some(b),
                        ..Facts::default()
                    },
                );
            }
            false
        }
        (_, None) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reading confirms a vLLM producer only when it saw the process's start: an empty one
    /// (every call failed) or one that saw only the models must leave the next decode failure
    /// to read again.
    #[test]
    fn only_a_reading_that_saw_the_process_confirms_the_producer() {
        assert!(!identifies_process(&Facts::default()));
        let models_only = Facts {
            models: Some(["tiny".to_string()].into()),
            ..Facts::default()
        };
        assert!(!identifies_process(&models_only));
        let seen = Facts {
            process_start: Some(1_796_000_000.5),
            ..Facts::default()
        };
        assert!(identifies_process(&seen));
    }
}
