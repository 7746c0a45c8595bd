//! Wiring: builds the parts, starts the tasks (HA, state-file writer, monitor, lifecycle
//! timer, listeners), and stops them in order (architecture.md section 3), all behind one
//! entry point, `run(config, listeners, shutdown)`.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{Config, ConfigError};
use crate::ha::{self, StandbyOptions};
use crate::ha_phase::HaPhase;
use crate::handoff;
use crate::http::{self, Side};
use crate::journal::{self, Journal};
use crate::lifecycle::AgentsError;
use crate::lifecycle::agents::Agents;
use crate::monitor;
use crate::parts::Parts;
use narwhal_lease::{LeaseDriver, LeaseError};

/// At startup, holds readiness (the gate's KV hold: `/ready` 503 naming the engines) while
/// engines with a KV replay socket have not had their index rebuilt from it, at most
/// `serving.kv_ready_timeout_s` (0: no wait), so the first requests are placed by what the
/// engines hold, not by load (docs/design/kv-aware-placement.md, "Exact from the first
/// request"). Engines still pending at the end are logged, and credited approximately until
/// their events arrive.
async fn kv_warmup(parts: &Parts) {
    let budget = crate::config::secs(parts.cfg.serving.kv_ready_timeout_s);
    if budget.is_zero() {
        return;
    }
    let until = parts.clock.now() + budget;
    let names = |pending: &[usize]| -> Vec<&str> {
        pending
            .iter()
            .map(|e| parts.cfg.engines[*e].iid.as_str())
            .collect()
    };
    loop {
        let pending = parts.kv.replay_pending();
        if pending.is_empty() {
            parts.gate.set_kv_hold("");
            return;
        }
        if parts.clock.now() >= until {
            parts.gate.set_kv_hold("");
            tracing::warn!(engines = ?names(&pending), "KV index replay still pending after serving.kv_ready_timeout_s: ready without it (those engines are credited approximately until their events arrive)");
            return;
        }
        parts.gate.set_kv_hold(&format!(
            "KV index replay pending: {}",
            names(&pending).join(", ")
        ));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The two bound listeners (architecture.md section 3).
#[derive(Debug)]
pub struct Listeners {
    /// OpenAI routes, `/health`, `/ready`.
    pub data: tokio::net::TcpListener,
    /// `/narwhal/*`, `/metrics`, `/health`, `/ready`.
    pub control: tokio::net::TcpListener,
    /// `/narwhal/self-drain` (`control.self_drain.listen`), when configured.
    pub self_drain: Option<tokio::net::TcpListener>,
}

/// Runtime options from the command line.
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
    /// Called once the listeners serve and every engine's health gate was answered (or the
    /// startup wait ran out, `monitor::startup`): the command line writes its ready file and
    /// prints its listening line here, so nothing that waits for them sees a router that has
    /// not looked at its engines yet (the health gate). An error stops the router.
    pub announce: Option<Box<dyn FnOnce() -> Result<(), AnnounceError> + Send>>,
    /// The model's tokenizer `engine.tokenizer` names, when the caller already loaded it;
    /// `None`: [`run`] loads it itself when the key is set.
    pub tokenizer: Option<Arc<narwhal_tokenizer::ModelTokenizer>>,
}

/// Why the startup announcement ([`RunOptions::announce`]) failed.
#[derive(Debug, thiserror::Error)]
pub enum AnnounceError {
    /// The ready file could not be written.
    #[error("ready file {}: {source}", .path.display())]
    ReadyFile {
        /// The ready file (`--ready-file`).
        path: PathBuf,
        /// The failed step of the atomic write.
        source: narwhal_shared::AtomicWriteError,
    },
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("journal", &self.journal)
            .field("max_concurrent", &self.max_concurrent)
            .field("resume", &self.resume)
            .field("standby", &self.standby)
            .field("router_id", &self.router_id)
            .field("announce", &self.announce.is_some())
            .finish()
    }
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
    #[error(transparent)]
    Agents(#[from] AgentsError),
    /// The lease backend could not be set up (timings, etcd endpoints); names the key.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// `control.self_drain` cannot reach Kubernetes as configured; names the key.
    #[error("{0}")]
    SelfDrain(String),
    /// `engine.tokenizer` names a model directory that cannot be loaded; names the key and
    /// the file.
    #[error("engine.tokenizer: {0}")]
    Tokenizer(#[from] narwhal_tokenizer::LoadError),
    /// The startup announcement failed (the ready file could not be written).
    #[error(transparent)]
    Announce(#[from] AnnounceError),
}

/// Serve until `shutdown` resolves, then shut down gracefully ([`drain_requests`]): the
/// listeners stay open while admitted requests finish, for up to
/// `serving.graceful_timeout_s`; then the listeners close and `run` returns.
///
/// # Errors
/// [`Error::Agents`] or [`Error::Lease`] when the agent clients or the lease backend cannot
/// be built; [`Error::Announce`] when the announcement failed (the router stops then);
/// nothing else fails once listeners are serving.
pub async fn run(
    config: Config,
    listeners: Listeners,
    opts: RunOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), Error> {
    let mut shutdown = std::pin::pin!(shutdown);
    let clock: Arc<dyn narwhal_shared::Clock> = Arc::new(narwhal_shared::SystemClock);
    let grace = Duration::from_secs(config.serving.graceful_timeout_s);
    let agents = Agents::from_config(&config, clock.clone())?;
    let lease = LeaseDriver::from_config(&config.lease, &opts.router_id, clock.clone())?;
    let self_drain = match (&config.self_drain, &listeners.self_drain) {
        (Some(section), Some(_)) => {
            Some(crate::self_drain::SelfDrain::from_config(section).map_err(Error::SelfDrain)?)
        }
        _ => None,
    };
    let tokenizer = match (opts.tokenizer, &config.engine.tokenizer) {
        (Some(t), _) => Some(t),
        (None, Some(dir)) => Some(Arc::new(narwhal_tokenizer::ModelTokenizer::load(
            std::path::Path::new(dir),
        )?)),
        (None, None) => None,
    };
    // A warm standby serves nothing until it takes over (behaviour.md 2.9).
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
    if let Some(sd) = self_drain {
        let _ = parts.self_drain.set(sd);
    }
    if let Some(t) = tokenizer {
        if let Some(e) = t.template_error() {
            tracing::warn!(error = %e, "engine.tokenizer: a chat template does not compile in the router; the requests it renders are tokenized by the engines' /tokenize");
        }
        parts.controller.use_tokenizer(t.clone());
        parts.kv.use_tokenizer(t);
    }
    let stop = tokio_util::sync::CancellationToken::new();
    let carried = crate::kv_cache::carried_path(&parts.cfg.recovery.state_path);
    if opts.standby.is_none() {
        // A primary takes the approximate KV guesses its predecessor on this state file
        // carried over a graceful restart (docs/design/kv-aware-placement.md).
        parts
            .kv
            .load_carried(&carried, parts.clock.wall().unwrap_or(0.0));
    }
    if let Some(standby) = opts.standby {
        ha::start_standby(&parts, standby, &stop);
    } else {
        let resume = opts.resume || parts.cfg.recovery.resume;
        if resume && let Some(reason) = handoff::resume(&parts) {
            parts.lifecycle.resume_refused(&reason);
        }
        ha::start_primary(&parts, &stop, resume).await;
        if parts.ha.controls_fleet() && parts.lifecycle.agents().any() {
            // Catch restarts that happened behind the router's back (behaviour.md 4.10).
            // Until every engine's identity was checked through its agent the router answers
            // `/ready` 503 "engine identity validation pending" (behaviour.md 1.2).
            ha::hold_until_identities_checked(parts.clone());
        }
    }
    let state_writer = tokio::spawn(handoff::writer(parts.clone(), stop.clone()));
    let monitor = tokio::spawn(monitor::monitor(parts.clone(), stop.clone()));
    // In every HA phase: a shadowing standby keeps its own KV index from the same event streams
    // (it only reads them; it places nothing), so at takeover its engines are already `exact`
    // (docs/design/kv-aware-placement.md section 6). Not gated on `controls_fleet`.
    let agents = parts.lifecycle.agents();
    let snapshots = (0..parts.cfg.engines.len())
        .map(|i| agents.get(i).cloned())
        .collect();
    parts.kv.spawn(parts.fleet.clone(), snapshots, stop.clone());
    let controller = tokio::spawn(parts.controller.clone().run(stop.clone()));
    let engine_load = tokio::spawn(crate::engine_load::run(parts.clone(), stop.clone()));
    let lifecycle_timer = {
        let parts = parts.clone();
        let stop = stop.clone();
        tokio::spawn(async move { parts.lifecycle.run_timer(stop).await })
    };
    let data = tokio::spawn(http::serve(
        listeners.data,
        parts.clone(),
        Side::Data,
        stop.clone(),
        CLOSE_WAIT,
    ));
    let control = tokio::spawn(http::serve(
        listeners.control,
        parts.clone(),
        Side::Control,
        stop.clone(),
        CLOSE_WAIT,
    ));
    let readmit = parts
        .cfg
        .self_drain
        .as_ref()
        .filter(|s| s.readmit && parts.self_drain.get().is_some())
        .map(|_| tokio::spawn(crate::restart_readmit::run(parts.clone(), stop.clone())));
    let self_drain = listeners.self_drain.map(|l| {
        tokio::spawn(http::serve(
            l,
            parts.clone(),
            Side::SelfDrain,
            stop.clone(),
            CLOSE_WAIT,
        ))
    });
    // Announce once every engine's health gate was answered and the KV index was rebuilt from
    // the engines' replay buffers (each bounded; a shutdown meanwhile wins).
    let mut stopped = false;
    let started = async { tokio::join!(monitor::startup(&parts), kv_warmup(&parts)) };
    let announced = tokio::select! {
        _ = started => opts.announce.map_or(Ok(()), |f| f()),
        () = &mut shutdown => {
            stopped = true;
            Ok(())
        }
    };
    if announced.is_ok() && !stopped {
        shutdown.await;
    }
    let was_controlling = parts.ha.controls_fleet();
    drain_requests(&parts, grace).await;
    if was_controlling {
        parts
            .kv
            .save_carried(&parts.fleet, &carried, parts.clock.wall().unwrap_or(0.0));
    }
    stop.cancel();
    let _ = data.await;
    let _ = control.await;
    if let Some(t) = self_drain {
        let _ = t.await;
    }
    if let Some(t) = readmit {
        let _ = t.await;
    }
    let _ = monitor.await;
    let _ = controller.await;
    let _ = engine_load.await;
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
    announced.map_err(Error::Announce)
}

/// How long the listeners' connections get to finish writing once every request ended (the
/// last frames to a slow client, idle keep-alive connections closing).
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// How long requests ended by the budget get to write their error frame and settle.
const END_WAIT: Duration = Duration::from_secs(3);

/// How often the drain looks at the in-flight count.
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// Graceful shutdown of the request path (docs/http-api.md; kserve, Envoy and Kubernetes
/// drain the same way): readiness is withdrawn at once (`/ready` 503 `shutting down`, new
/// completions 503 with `Retry-After`, `/health` 200 `stopping`) while both listeners stay
/// open, so load balancers and clients back off instead of meeting refused connections;
/// admitted requests run on until none is left or `grace` (`serving.graceful_timeout_s`) ran
/// out; then every request still running is ended — a stream with the documented error frame
/// (`code: failed`), settled `failed/shutdown`, never as a client cancel — and given
/// [`END_WAIT`] to settle.
async fn drain_requests(parts: &Parts, grace: Duration) {
    parts.gate.begin_shutdown();
    let inflight = || parts.admission.stats().retained;
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        inflight = inflight(),
        "shutting down: readiness withdrawn, admitted requests run on"
    );
    let idle = || async {
        while inflight() > 0 {
            tokio::time::sleep(DRAIN_POLL).await;
        }
    };
    if tokio::time::timeout(grace, idle()).await.is_ok() {
        return;
    }
    tracing::warn!(
        grace_s = grace.as_secs_f64(),
        inflight = inflight(),
        "serving.graceful_timeout_s ran out: ending the requests still running"
    );
    parts.gate.end_requests();
    if tokio::time::timeout(END_WAIT, idle()).await.is_err() {
        tracing::warn!(
            inflight = inflight(),
            "requests still running after they were told to end"
        );
    }
}
