//! `narwhal-agent`: parse, load config, bind, run.
//!
//! ```text
//! narwhal-agent run --config PATH [--listen IP:PORT] [--ready-file PATH]
//!   stdout line 1: "narwhal-agent listening on https://HOST:PORT"
//!   ready file:    {"url", "pid", "agent_id", "public_key"} (written before line 1)
//!   exit 2: bad config, key, TLS or state_dir (message names the config key); 1: bind failure
//! narwhal-agent keygen --out PATH [--force]
//!   writes a PKCS#8 Ed25519 key (mode 0600), prints "ed25519:<base64>"
//! narwhal-agent check-config --config PATH
//!   validates config, key, TLS and state_dir, prints the public key
//! narwhal-agent fence show  (--state-dir DIR | --config PATH)
//!   prints the persisted fence {"epoch","holder"}
//! narwhal-agent fence reset (--state-dir DIR | --config PATH) [--to-epoch N] [--holder NAME]
//!   rewrites it; exit 1 while an agent runs on that state_dir (its lock), 2 on bad input
//! ```

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use narwhal_agent::{Config, prepare};
use narwhal_shared::SystemClock;
use narwhal_shared::agent_protocol::AgentReadyFile;

#[derive(Parser)]
#[command(name = "narwhal-agent", version, about = "Narwhal engine agent")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the agent API over mutual TLS.
    Run {
        /// Agent config file (JSON, schema narwhal.agent-config).
        #[arg(long, env = "NARWHAL_AGENT_CONFIG")]
        config: PathBuf,
        /// Override the config's `listen` address.
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Write {"url","pid","agent_id","public_key"} here once listening.
        #[arg(long)]
        ready_file: Option<PathBuf>,
    },
    /// Generate an Ed25519 signing key (PKCS#8, mode 0600) and print its public key.
    Keygen {
        /// Key file to create.
        #[arg(long)]
        out: PathBuf,
        /// Overwrite an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Validate a config (including key, TLS files and state_dir) and exit.
    CheckConfig {
        /// Agent config file.
        #[arg(long)]
        config: PathBuf,
    },
    /// Show or reset the persisted fence (highest router epoch) of a stopped agent.
    Fence {
        #[command(subcommand)]
        action: FenceAction,
    },
}

/// Which state directory: given, or the `state_dir` of a config file.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct StateArgs {
    /// The agent's state directory (holds fence.json and agent.lock).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Read `state_dir` from this agent config file.
    #[arg(long)]
    config: Option<PathBuf>,
}

#[derive(Subcommand)]
enum FenceAction {
    /// Print the persisted fence as JSON: {"epoch": N, "holder": "..."}.
    Show {
        #[command(flatten)]
        state: StateArgs,
    },
    /// Rewrite the fence so a router with a lower epoch is accepted again. Refused (exit 1)
    /// while an agent runs on the state directory.
    Reset {
        #[command(flatten)]
        state: StateArgs,
        /// The epoch to keep (default 0: any router epoch is accepted again).
        #[arg(long, default_value_t = 0)]
        to_epoch: u64,
        /// The holder of that epoch (default none: the first router to present `--to-epoch`
        /// or higher takes it).
        #[arg(long, default_value = "")]
        holder: String,
    },
}

fn state_dir(args: StateArgs) -> Result<PathBuf, String> {
    match (args.state_dir, args.config) {
        (Some(dir), _) => Ok(dir),
        (None, Some(config)) => Config::load(&config)
            .map(|c| c.state_dir)
            .map_err(|e| e.to_string()),
        (None, None) => Err("give --state-dir or --config".into()),
    }
}

fn fence(action: FenceAction) -> ExitCode {
    use narwhal_agent::{FenceError, FenceState, fence_admin};
    use narwhal_shared::agent_protocol::FenceShown;
    match action {
        FenceAction::Show { state } => {
            let shown =
                state_dir(state).and_then(|d| fence_admin::show(&d).map_err(|e| e.to_string()));
            match shown {
                Ok(f) => {
                    println!(
                        "{}",
                        serde_json::to_string(&FenceShown {
                            epoch: f.epoch,
                            holder: f.holder,
                        })
                        .unwrap_or_default()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("narwhal-agent: {e}");
                    ExitCode::from(2)
                }
            }
        }
        FenceAction::Reset {
            state,
            to_epoch,
            holder,
        } => {
            let dir = match state_dir(state) {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("narwhal-agent: {e}");
                    return ExitCode::from(2);
                }
            };
            let to = FenceState {
                epoch: to_epoch,
                holder,
            };
            match fence_admin::reset(&dir, &to) {
                Ok(before) => {
                    let was = before.map_or_else(
                        || "unreadable".to_string(),
                        |b| format!("epoch {} holder {:?}", b.epoch, b.holder),
                    );
                    println!(
                        "fence of {} reset: {was} -> epoch {} holder {:?}",
                        dir.display(),
                        to.epoch,
                        to.holder
                    );
                    ExitCode::SUCCESS
                }
                Err(e @ FenceError::Locked { .. }) => {
                    eprintln!("narwhal-agent: refusing to reset the fence: {e}");
                    ExitCode::from(1)
                }
                Err(e) => {
                    eprintln!("narwhal-agent: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

fn write_ready(path: &Path, doc: &AgentReadyFile) -> Result<(), narwhal_shared::AtomicWriteError> {
    // Strings and a number always serialise.
    narwhal_shared::write_atomic(path, &serde_json::to_vec(doc).unwrap_or_default())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NARWHAL_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match cli.command {
        Command::Keygen { out, force } => match narwhal_agent::keygen(&out, force) {
            Ok(pk) => {
                println!("{pk}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("narwhal-agent: {e}");
                ExitCode::from(2)
            }
        },
        Command::CheckConfig { config } => {
            let checked = Config::load(&config)
                .map_err(narwhal_agent::Error::from)
                .and_then(|c| prepare(&c, Arc::new(SystemClock)));
            match checked {
                Ok(p) => {
                    println!("{}", p.agent.public_key());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("narwhal-agent: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Fence { action } => fence(action),
        Command::Run {
            config,
            listen,
            ready_file,
        } => run(&config, listen, ready_file.as_deref()),
    }
}

fn run(config: &Path, listen: Option<std::net::SocketAddr>, ready_file: Option<&Path>) -> ExitCode {
    // The state lock is taken before the fence is read and held until the process exits: no
    // second agent, and no `fence reset`, on this state meanwhile.
    let prepared = Config::load(config)
        .map_err(narwhal_agent::Error::from)
        .and_then(|c| {
            let lock = narwhal_agent::StateLock::acquire(&c.state_dir)?;
            prepare(&c, Arc::new(SystemClock)).map(|p| (c, p, lock))
        });
    let (cfg, prepared, _state_lock) = match prepared {
        Ok(x) => x,
        Err(e) => {
            eprintln!("narwhal-agent: refusing to start: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(8)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("narwhal-agent: tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async move {
        let addr = listen.unwrap_or(cfg.listen);
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("narwhal-agent: listen {addr}: {e}");
                return ExitCode::from(1);
            }
        };
        let bound = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => {
                eprintln!("narwhal-agent: listen {addr}: {e}");
                return ExitCode::from(1);
            }
        };
        let url = format!("https://{bound}");
        if let Some(path) = ready_file {
            let doc = AgentReadyFile {
                url: url.clone(),
                pid: std::process::id(),
                agent_id: cfg.agent_id.clone(),
                public_key: prepared.agent.public_key().to_string(),
            };
            if let Err(e) = write_ready(path, &doc) {
                eprintln!("narwhal-agent: ready file {}: {e}", path.display());
                return ExitCode::from(1);
            }
        }
        // After the ready file, so whoever reads this line can rely on the file too.
        println!("narwhal-agent listening on {url}");
        let _ = std::io::stdout().flush();
        tracing::info!(agent.id = %cfg.agent_id, url = %url, engines = cfg.engines.len(), "agent listening");
        let shutdown = async {
            let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending::<()>().await,
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        narwhal_agent::run(prepared, listener, shutdown).await;
        tracing::info!("agent stopped");
        ExitCode::SUCCESS
    })
}
