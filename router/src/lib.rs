//! Narwhal router (`narwhal-serve`): placement, P/D serving for vLLM and SGLang, streaming
//! relay, breaker, outcome accounting, metrics, state and journal (DESIGN.md sections 3, 5, 6).
//!
//! ```text
//!  clients ──► data listener ──► ingress ──► placement ──► prefill leg ─┐
//!                                   │                       decode leg ◄┘ (vLLM: descriptor,
//!                                   ▼                          │         SGLang: rendezvous)
//!                               outcome (one settle) ◄── relay ◄┘
//!                                   ├─► metrics  ├─► journal  └─► /narwhal/state
//!  monitor task ──► breaker probes (GET /health) ──► readmission
//! ```
//!
//! Pure cores (`placement`, `relay`, `breaker`, `ingress`, `outcome`, `config`) take `now` and
//! RNGs as arguments; the drivers (`serve`, `http`, `upstream`, `state`) do the IO.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod breaker;
mod cli;
pub mod config;
mod failure;
mod ha;
mod handoff;
mod http;
pub mod ingress;
pub mod journal;
pub mod lease;
pub mod lifecycle;
mod metrics;
pub mod outcome;
pub mod placement;
pub mod relay;
mod response;
pub mod retry;
mod serve;
mod state;
mod upstream;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

pub use cli::main_from_args;
pub use config::{Backend, Config, ConfigError, ConfigIssue, Role};
pub use ha::StandbyOptions;
pub use journal::Journal;

/// The two bound listeners (DESIGN.md section 3).
#[derive(Debug)]
pub struct Listeners {
    /// OpenAI routes, `/health`, `/ready`.
    pub data: tokio::net::TcpListener,
    /// `/narwhal/*`, `/metrics`, `/health`, `/ready`.
    pub control: tokio::net::TcpListener,
}

/// Runtime options from the command line.
#[derive(Debug)]
pub struct RunOptions {
    /// The opened request journal (its run id names this process).
    pub journal: Journal,
    /// Admission seats (`--max-concurrent`, default `serving.max_connections`).
    pub max_concurrent: usize,
    /// `--resume`: apply the state file's handoff at startup.
    pub resume: bool,
    /// `--standby-of`: start as a warm standby of this primary.
    pub standby: Option<StandbyOptions>,
    /// `--router-id`: prefix of the lease holder token.
    pub router_id: String,
}

/// Errors that end [`run`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The fleet file is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The journal could not be opened.
    #[error(transparent)]
    Journal(#[from] journal::JournalError),
    /// An agent client could not be built (TLS files, public key); names the key.
    #[error("{0}")]
    Agents(String),
    /// The lease backend could not be set up (timings, etcd endpoints); names the key.
    #[error("{0}")]
    Lease(String),
}

/// Serve until `shutdown` resolves, then stop accepting, let open requests finish for up to
/// `serving.graceful_timeout_s`, and return.
///
/// # Errors
/// None today once listeners are bound; the signature leaves room for lease and state-file
/// startup failures.
pub async fn run(
    config: Config,
    listeners: Listeners,
    opts: RunOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let clock: Arc<dyn narwhal_shared::Clock> = Arc::new(narwhal_shared::SystemClock);
    let grace = Duration::from_secs(config.serving.graceful_timeout_s);
    let agents =
        lifecycle::driver::Agents::from_config(&config, clock.clone()).map_err(Error::Agents)?;
    let lease = lease::LeaseDriver::from_config(&config.lease, &opts.router_id, clock.clone())
        .map_err(|e| Error::Lease(e.to_string()))?;
    let shared = state::Shared::new(
        Arc::new(config),
        clock,
        opts.journal,
        opts.max_concurrent.max(1),
        agents,
        Arc::new(lease),
    );
    let stop = tokio_util::sync::CancellationToken::new();
    if let Some(standby) = &opts.standby {
        // A warm standby serves nothing until it takes over (reference-notes 2.9).
        tokio::spawn(ha::standby_loop(
            shared.clone(),
            Some(standby.clone()),
            stop.clone(),
        ));
    } else {
        if (opts.resume || shared.cfg.recovery.resume)
            && let Some(reason) = handoff::resume(&shared)
        {
            lifecycle::driver::resume_refused(&shared, &reason);
        }
        ha::start_primary(shared.clone(), None, stop.clone()).await;
        if shared.ha().controls_fleet && (0..shared.cfg.engines.len()).any(|i| shared.agents.has(i))
        {
            // Catch restarts that happened behind the router's back (reference-notes 4.10).
            // Until every engine's identity was checked through its agent the router answers
            // `/ready` 503 "engine identity validation pending" (reference-notes 1.2).
            ha::hold_until_identities_checked(shared.clone());
        }
    }
    let state_writer = tokio::spawn(handoff::writer(shared.clone(), stop.clone()));
    let monitor = tokio::spawn(http::monitor(shared.clone(), stop.clone()));
    let lifecycle_timer = tokio::spawn(lifecycle::driver::timer(shared.clone(), stop.clone()));
    tokio::spawn(http::warm_bootstrap_ports(shared.clone()));
    let data = tokio::spawn(http::serve(
        listeners.data,
        shared.clone(),
        http::Side::Data,
        stop.clone(),
        grace,
    ));
    let control = tokio::spawn(http::serve(
        listeners.control,
        shared.clone(),
        http::Side::Control,
        stop.clone(),
        grace,
    ));
    shutdown.await;
    let was_controlling = shared.ha().controls_fleet;
    stop.cancel();
    let _ = data.await;
    let _ = control.await;
    let _ = monitor.await;
    let _ = lifecycle_timer.await;
    let _ = state_writer.await;
    if was_controlling {
        match shared.lease.release().await {
            Ok(true) => tracing::info!("lease released"),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "lease release failed; it lapses at expiry"),
        }
    }
    tracing::info!("narwhal-serve stopped");
    Ok(())
}
