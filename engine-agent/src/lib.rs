//! `narwhal-agent`: the per-host engine agent (architecture.md sections 1, 3, 4).
//!
//! ```text
//!   router ──mTLS──► http (axum) ──► Agent ──► fence (state_dir/fence.json)
//!                                      ├─► process (/proc identity of each engine)
//!                                      ├─► plugin (vLLM | SGLang, loopback HTTP to engines)
//!                                      └─► SigningKey (Ed25519) ──► SignedDocument
//! ```
//! The crate is a library with a thin `main`: [`Config::load`], [`Agent::new`], [`run`].
//! Embedders (tests, the dev fleet) can use the plugins directly via [`plugin_for`].

mod agent;
mod authz;
mod config;
mod engine_key;
mod error;
mod evidence;
mod fence;
mod http;
mod keys;
mod kv_follow;
mod metrics;
mod plugin;
mod process;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use agent::{Agent, RequestError, engine_http_client};
pub use authz::{Access, Caller, Forbidden, RULE_FLEET, RULE_ROUTER, authorize};
pub use config::{CONFIG_SCHEMA, Config, ConfigError, ContractDocument, EngineConfig, Timeouts};
pub use error::Error;
pub use evidence::{SGLANG_DISAGGREGATION, Series, TransferCounters, TransferMetrics, VLLM_NIXL};
pub use fence::{Decision, EpochStore, FenceError, FenceState, StateLock, decide};
pub use http::{router, status_of};
pub use keys::{KeyFileError, keygen, load as load_signing_key};
pub use metrics::{CHECK_KINDS, Metrics};
pub use plugin::{
    BoxFuture, Dialect, EngineCtx, EngineError, EnginePlugin, SglangPlugin, VllmPlugin, plugin_for,
};
pub use process::{
    Coalesced, HostSockets, LiveProc, Mismatch, PortRead, ProcView, ProcessError, ProcessLocator,
    ReadPath, ResolvedOwner, SharedScan, StatFields, find_pid, locate, locate_with_hint,
    parse_stat, read_identity, read_port_identity,
};

/// `narwhal-agent fence show|reset` (docs/agent.md): the fence of a stopped agent.
pub mod fence_admin {
    pub use crate::fence::{reset, show};
}

/// Everything checked before binding: key, TLS, fence. Build it, then bind, then [`run`].
pub struct Prepared {
    /// The agent core.
    pub agent: Arc<Agent>,
    /// The TLS acceptor (client certificates required).
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// The TLS handshake limit.
    pub handshake: Duration,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("agent", &self.agent)
            .finish()
    }
}

/// Loads key, TLS and fence for `config`.
///
/// # Errors
/// [`Error`] naming the config key.
pub fn prepare(config: &Config, clock: Arc<dyn narwhal_shared::Clock>) -> Result<Prepared, Error> {
    let agent = Arc::new(Agent::new(config, clock)?);
    let tls = config.tls.server_config()?;
    Ok(Prepared {
        agent,
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
        handshake: Duration::from_secs_f64(config.timeouts.handshake_s),
    })
}

/// Serves the agent on `listener` until `shutdown` resolves.
pub async fn run(
    prepared: Prepared,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()>,
) {
    prepared.agent.follow_kv_events();
    let app = router(prepared.agent.clone());
    http::serve(
        listener,
        prepared.acceptor,
        app,
        prepared.handshake,
        shutdown,
    )
    .await;
}
