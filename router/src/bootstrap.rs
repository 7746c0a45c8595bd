//! SGLang bootstrap ports (reference-notes 7.2 step 2): a prefill engine's
//! `disaggregation_bootstrap_port`, learned from `GET <engine>/server_info` and cached in the
//! fleet; the decode leg's rendezvous names it.
//!
//! ```text
//!  serve (attempt) ──port()──► cached? ──no──► refresh(): GET /server_info ──► Fleet cache
//!  monitor (probe ok), lifecycle (before readmission), startup ──refresh()──┘
//! ```

use http::StatusCode;
use serde_json::Value;

use crate::config::{Config, secs};
use crate::fleet::Fleet;
use crate::upstream::Upstream;

/// Why a bootstrap port could not be learned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum BootstrapError {
    /// The engine did not answer (connect error, timeout).
    #[error("{0}")]
    Unreachable(String),
    /// `/server_info` answered another status.
    #[error("{url} answered {status}")]
    Status {
        /// The `/server_info` URL.
        url: String,
        /// Its status.
        status: StatusCode,
    },
    /// The answer is not JSON.
    #[error("{url}: not JSON: {reason}")]
    NotJson {
        /// The `/server_info` URL.
        url: String,
        /// The parser's message.
        reason: String,
    },
    /// The answer has no usable `disaggregation_bootstrap_port`.
    #[error("{url}: no disaggregation_bootstrap_port")]
    NoPort {
        /// The `/server_info` URL.
        url: String,
    },
}

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
        .map_err(BootstrapError::Unreachable)?;
    if status != StatusCode::OK {
        return Err(BootstrapError::Status { url, status });
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| BootstrapError::NotJson {
        url: url.clone(),
        reason: e.to_string(),
    })?;
    let port = v
        .get("disaggregation_bootstrap_port")
        .and_then(|p| {
            p.as_u64()
                .or_else(|| p.as_str().and_then(|s| s.parse().ok()))
        })
        .and_then(|p| u16::try_from(p).ok())
        .ok_or(BootstrapError::NoPort { url })?;
    fleet.set_bootstrap_port(iid, port);
    Ok(port)
}
