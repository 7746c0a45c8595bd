//! Wiring: builds the parts, starts the tasks (HA, state-file writer, monitor, lifecycle
//! timer, listeners), and stops them in order (DESIGN.md section 3; STYLE.md section 1:
//! `run(config, listeners, shutdown)`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Config, ConfigError};
use crate::ha::{self, StandbyOptions};
use crate::handoff;
use crate::http::{self, Side};
use crate::journal::{self, Journal};
use crate::lease::LeaseDriver;
use crate::lifecycle::agents::Agents;
use crate::monitor;
use crate::parts::Parts;
use crate::phase::HaPhase;

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
/// [`Error::Agents`] or [`Error::Lease`] when the agent clients or the lease backend cannot
/// be built; nothing fails once listeners are serving.
pub async fn run(
    config: Config,
    listeners: Listeners,
    opts: RunOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let clock: Arc<dyn narwhal_shared::Clock> = Arc::new(narwhal_shared::SystemClock);
    let grace = Duration::from_secs(config.serving.graceful_timeout_s);
    let agents = Agents::from_config(&config, clock.clone()).map_err(Error::Agents)?;
    let lease = LeaseDriver::from_config(&config.lease, &opts.router_id, clock.clone())
        .map_err(|e| Error::Lease(e.to_string()))?;
    // A warm standby serves nothing until it takes over (reference-notes 2.9).
    let phase = if opts.standby.is_some() {
        HaPhase::Shadowing
    } else {
        HaPhase::Active
    };
    let parts = Parts::new(
        Arc::new(config),
        clock,
        opts.journal,
        opts.max_concurrent,
        agents,
        Arc::new(lease),
        phase,
    );
    let stop = tokio_util::sync::CancellationToken::new();
    if let Some(standby) = opts.standby {
        ha::start_standby(&parts, standby, &stop);
    } else {
        if (opts.resume || parts.cfg.recovery.resume)
            && let Some(reason) = handoff::resume(&parts)
        {
            parts.lifecycle.resume_refused(&reason);
        }
        ha::start_primary(&parts, &stop).await;
        if parts.ha.controls_fleet() && parts.lifecycle.agents().any() {
            // Catch restarts that happened behind the router's back (reference-notes 4.10).
            // Until every engine's identity was checked through its agent the router answers
            // `/ready` 503 "engine identity validation pending" (reference-notes 1.2).
            ha::hold_until_identities_checked(parts.clone());
        }
    }
    let state_writer = tokio::spawn(handoff::writer(parts.clone(), stop.clone()));
    let monitor = tokio::spawn(monitor::monitor(parts.clone(), stop.clone()));
    let controller = tokio::spawn(parts.controller.clone().run(stop.clone()));
    let lifecycle_timer = {
        let parts = parts.clone();
        let stop = stop.clone();
        tokio::spawn(async move { parts.lifecycle.run_timer(stop).await })
    };
    tokio::spawn(monitor::warm_bootstrap_ports(parts.clone()));
    let data = tokio::spawn(http::serve(
        listeners.data,
        parts.clone(),
        Side::Data,
        stop.clone(),
        grace,
    ));
    let control = tokio::spawn(http::serve(
        listeners.control,
        parts.clone(),
        Side::Control,
        stop.clone(),
        grace,
    ));
    shutdown.await;
    let was_controlling = parts.ha.controls_fleet();
    stop.cancel();
    let _ = data.await;
    let _ = control.await;
    let _ = monitor.await;
    let _ = controller.await;
    let _ = lifecycle_timer.await;
    let _ = state_writer.await;
    if was_controlling {
        match parts.ha.lease().release().await {
            Ok(true) => tracing::info!("lease released"),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "lease release failed; it lapses at expiry"),
        }
    }
    tracing::info!("narwhal-serve stopped");
    Ok(())
}
