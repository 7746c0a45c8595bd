//! `narwhal-serve` command line (behaviour.md 8.2; docs/configuration.md): parse, load the fleet,
//! bind, announce, then [`crate::app::run`].
//!
//! ```text
//!  args ──clap──► Args ──Config::load──► Config (exit 2 on any problem, all listed)
//!       ──bind data + control──► (exit 1: "narwhal-serve: bind <addr>: <error>")
//!       ──► run(...): once every engine's health gate was answered (app::run):
//!             ready file {data, control, pid, run} (atomic), then
//!             stdout: "narwhal-serve listening data=http://H:P control=http://H:P"
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use narwhal_shared::{Clock, SystemClock};
use tokio::net::TcpListener;

use crate::app::{AnnounceError, Listeners, RunOptions};
use crate::config::{Config, ConfigError};
use crate::journal::{Journal, run_id};
use crate::lifecycle::AgentsError;
use narwhal_lease::LeaseError;

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Narwhal router: disaggregated prefill/decode serving for vLLM and SGLang fleets.
///
/// Without a subcommand it runs the router; `check-config` checks what a run would use, with
/// the same flags, and exits; `config-keys` prints every fleet-file key.
#[derive(Debug, Parser)]
#[command(name = "narwhal-serve", version, about, subcommand_negates_reqs = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    args: Args,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check everything a run with these flags reads before it serves (fleet file, flags, TLS
    /// files, agent keys, lease settings and files, writable state, journal and lease
    /// directories) without binding or writing anything; exit 0 (one summary line on stdout)
    /// or 2 (every problem on stderr). Takes the same flags as a run.
    CheckConfig(Box<Args>),
    /// Print every fleet-file key this binary accepts, one dotted key per line
    /// (`engines[].agent.url`); docs/configuration.md documents each.
    ConfigKeys,
}

/// The flags of a run (and of `check-config`).
#[derive(Debug, Clone, clap::Args)]
struct Args {
    /// Fleet file (schema narwhal.fleet version 2).
    #[arg(long, env = "NARWHAL_FLEET", required = true)]
    fleet: Option<PathBuf>,
    /// Data listener address (OpenAI routes). Port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// Control listener address (state, targets, metrics). Port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:8001")]
    control_listen: String,
    /// Request journal (JSONL, appended).
    #[arg(long, default_value = "runs/journal.jsonl")]
    journal: PathBuf,
    /// Write {"data","control","pid","run"} here (atomically) once both listeners are bound.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Log level or tracing filter (critical, error, warning, info, debug, trace).
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Admission seats (default serving.max_connections; 1 ..= max_connections).
    #[arg(long)]
    max_concurrent: Option<u64>,
    /// Apply the handoff in recovery.state_path at startup (same as recovery.resume: true):
    /// totals, roles, ejections, suspects and lifecycle holds survive a restart.
    #[arg(long)]
    resume: bool,
    /// Start as a warm standby of the primary whose control listener is at this URL
    /// (requires a lease backend other than none in the fleet file).
    #[arg(long)]
    standby_of: Option<String>,
    /// Seconds between standby polls of the primary.
    #[arg(long, default_value_t = 0.25)]
    standby_probe_interval: f64,
    /// Missed polls of a primary that publishes no handoff beside its lease record (a
    /// reference primary) before the standby reports `no fresh handoff`. The takeover itself
    /// starts when the lease record lapses (docs/ha.md, "Takeover time").
    #[arg(long, default_value_t = 4)]
    standby_takeover_after: u32,
    /// A handoff polled over HTTP older than this many seconds is not applied at takeover (the
    /// handoff published beside the lease record is always the newest and is applied).
    #[arg(long, default_value_t = 30.0)]
    standby_max_handoff_age: f64,
    /// Prefix of this router's lease holder token (default: host name and control port).
    #[arg(long)]
    router_id: Option<String>,
}

impl Args {
    /// The fleet file (clap requires it for a run and for `check-config`).
    fn fleet(&self) -> &Path {
        self.fleet.as_deref().unwrap_or(Path::new(""))
    }
}

/// Why logging could not be set up ([`init_logging`]; exit status 2).
#[derive(Debug, thiserror::Error)]
enum LoggingError {
    /// `--log-level` is a bare word that is no level.
    #[error(
        "--log-level {given:?}: expected one of critical, error, warning, info, debug, trace, or a tracing filter"
    )]
    UnknownLevel {
        /// The flag as given.
        given: String,
    },
    /// `--log-level` (mapped to tracing's names) is no valid tracing filter.
    #[error("--log-level {level:?}: {source}")]
    Filter {
        /// The filter tried (`warn` for `warning`).
        level: String,
        /// tracing's reason.
        source: tracing_subscriber::filter::ParseError,
    },
    /// The global subscriber could not be installed.
    #[error("logging: {0}")]
    Init(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Installs the stderr subscriber `--log-format` / `--log-level` ask for.
///
/// # Errors
/// [`LoggingError`] naming the flag, or the subscriber's refusal.
fn init_logging(args: &Args) -> Result<(), LoggingError> {
    let level = match args.log_level.as_str() {
        "critical" => "error",
        "warning" => "warn",
        other => other,
    };
    // A bare word must be a level; anything else is a tracing filter (`narwhal_router=debug`).
    const LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];
    if !level.contains(['=', ',']) && !LEVELS.contains(&level) {
        return Err(LoggingError::UnknownLevel {
            given: args.log_level.clone(),
        });
    }
    let filter =
        tracing_subscriber::EnvFilter::try_new(level).map_err(|source| LoggingError::Filter {
            level: level.to_string(),
            source,
        })?;
    let b = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter);
    let r = match args.log_format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
    r.map_err(LoggingError::Init)
}

/// The `--ready-file` document a started router writes: its listeners, pid and run id.
#[derive(serde::Serialize)]
struct ReadyFile<'a> {
    /// The data listener's URL.
    data: &'a str,
    /// The control listener's URL.
    control: &'a str,
    /// The self-drain listener's URL (`control.self_drain`), when configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    self_drain: Option<&'a str>,
    /// The router's process id.
    pid: u32,
    /// The run id (the journal's `run`).
    run: &'a str,
}

/// Writes `value` to `path` through the one atomic write ([`narwhal_shared::write_atomic`]),
/// creating the directory first.
fn write_atomic(
    path: &Path,
    value: &impl serde::Serialize,
) -> Result<(), narwhal_shared::AtomicWriteError> {
    let dir = narwhal_shared::atomic::parent_dir(path);
    std::fs::create_dir_all(dir).map_err(|source| narwhal_shared::AtomicWriteError {
        step: "create",
        path: dir.to_path_buf(),
        source,
    })?;
    // The documents written here are plain strings and numbers, which always serialise.
    let bytes = serde_json::to_vec(value).unwrap_or_default();
    narwhal_shared::write_atomic(path, &bytes)
}

/// What [`preflight`] found: the loaded configuration and the admission seats.
struct Checked {
    cfg: Config,
    max_concurrent: usize,
    /// The model's tokenizer `engine.tokenizer` names, loaded once here for the run.
    tokenizer: Option<std::sync::Arc<narwhal_tokenizer::ModelTokenizer>>,
}

/// Why a run cannot start, found by [`preflight`]; shown one problem per line (exit status 2).
#[derive(Debug, thiserror::Error)]
enum PreflightError {
    /// The fleet file cannot be used (every problem it has, one per line).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// What the flags and the files the fleet file names break, in the order checked.
    #[error("{}", one_per_line(.0))]
    Problems(Vec<Problem>),
}

/// One problem [`preflight`] found beyond the fleet file itself, naming its flag or key.
#[derive(Debug, thiserror::Error)]
enum Problem {
    /// `--max-concurrent` (or its default) is outside `1..=serving.max_connections`.
    #[error("--max-concurrent {given} must be in 1..={max} (serving.max_connections)")]
    MaxConcurrent {
        /// The seats asked for.
        given: u64,
        /// `serving.max_connections`.
        max: u64,
    },
    /// `--standby-of` with lease backend `none`.
    #[error(
        "--standby-of needs a lease: set lease.backend to file, etcd or kubernetes in the fleet file"
    )]
    StandbyWithoutLease,
    /// The `tls` (`prefix` empty) or `control.tls` (`prefix` `control.`) files cannot be used.
    #[error("{prefix}{source}")]
    Tls {
        /// The section's prefix before `tls.`.
        prefix: &'static str,
        /// What is wrong with the files.
        source: narwhal_shared::TlsError,
    },
    /// An agent client cannot be built.
    #[error(transparent)]
    Agents(#[from] AgentsError),
    /// The lease backend cannot be set up.
    #[error("lease config: {0}")]
    Lease(#[source] LeaseError),
    /// `control.self_drain` cannot reach Kubernetes as configured (names the key).
    #[error("{0}")]
    SelfDrain(String),
    /// `engine.tokenizer` names a model directory that cannot be loaded (names the file).
    #[error("engine.tokenizer: {0}")]
    Tokenizer(#[source] narwhal_tokenizer::LoadError),
}

/// `problems`, one per line.
fn one_per_line(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Everything a run reads before it serves, checked before anything is bound or printed
/// (the checks `check-config` runs): the fleet file, the flags that depend on it, and every file it
/// names (`tls`, `control.tls`, the agents' pinned keys, `lease.tls`, `lease.auth.password_file`,
/// `engine.tokenizer`'s model directory),
/// by building the same TLS configurations, agent clients and lease backend the run builds.
///
/// # Errors
/// [`PreflightError`]: every problem found, shown one per line, each naming its key or flag
/// (exit status 2).
fn preflight(args: &Args) -> Result<Checked, PreflightError> {
    let cfg = Config::load(args.fleet())?;
    let mut problems = Vec::new();
    let max = cfg.serving.max_connections;
    let max_concurrent = args.max_concurrent.unwrap_or(max);
    if max_concurrent < 1 || max_concurrent > max {
        problems.push(Problem::MaxConcurrent {
            given: max_concurrent,
            max,
        });
    }
    if args.standby_of.is_some() && cfg.lease.backend == crate::config::LeaseBackend::None {
        problems.push(Problem::StandbyWithoutLease);
    }
    // The router presents `tls` to the agents; the control listener serves with
    // `control.tls` (a standby also presents it to its primary).
    for (prefix, files, serves) in [("", &cfg.tls, false), ("control.", &cfg.control_tls, true)] {
        let Some(t) = files else { continue };
        let files = narwhal_shared::TlsFiles {
            ca: t.ca.clone(),
            cert: t.cert.clone(),
            key: t.key.clone(),
        };
        let built = if serves {
            files.server_config().map(drop)
        } else {
            files.client_config().map(drop)
        };
        if let Err(source) = built {
            problems.push(Problem::Tls { prefix, source });
        }
    }
    let clock: std::sync::Arc<dyn Clock> = std::sync::Arc::new(SystemClock);
    if problems.is_empty()
        && let Err(e) = crate::lifecycle::agents::Agents::from_config(&cfg, clock.clone())
    {
        problems.push(Problem::Agents(e));
    }
    let router_id = args.router_id.as_deref().unwrap_or("check-config");
    if let Err(e) = narwhal_lease::LeaseDriver::from_config(&cfg.lease, router_id, clock) {
        problems.push(Problem::Lease(e));
    }
    if let Some(section) = &cfg.self_drain
        && let Err(e) = crate::self_drain::SelfDrain::from_config(section)
    {
        problems.push(Problem::SelfDrain(e));
    }
    let tokenizer =
        match cfg.engine.tokenizer.as_deref().map(|dir| {
            narwhal_tokenizer::ModelTokenizer::load(Path::new(dir)).map(std::sync::Arc::new)
        }) {
            Some(Ok(t)) => Some(t),
            Some(Err(e)) => {
                problems.push(Problem::Tokenizer(e));
                None
            }
            None => None,
        };
    if problems.is_empty() {
        Ok(Checked {
            cfg,
            max_concurrent: max_concurrent as usize,
            tokenizer,
        })
    } else {
        Err(PreflightError::Problems(problems))
    }
}

/// The directory `path` is written in, for the writability probe: its parent, or `.`.
fn dir_of(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Whether the process can create files in `dir` (or, when it does not exist yet, in its
/// nearest existing ancestor, where the router would create it), found by creating and
/// removing a probe file: permissions, read-only mounts and systemd's `ProtectSystem=` all
/// show up here the way they would for the run.
///
/// # Errors
/// [`NotWritable`] naming the directory tried.
fn writable(dir: &Path) -> Result<(), NotWritable> {
    let mut d = dir.to_path_buf();
    while !d.exists() {
        match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => d = p.to_path_buf(),
            _ => {
                d = PathBuf::from(".");
                break;
            }
        }
    }
    let probe = d.join(format!(".narwhal-check-config.{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(source) => Err(NotWritable { dir: d, source }),
    }
}

/// The probe file of [`writable`] could not be created.
#[derive(Debug, thiserror::Error)]
#[error("cannot create files in {}: {source}", .dir.display())]
struct NotWritable {
    /// The directory tried (the nearest existing one).
    dir: PathBuf,
    /// Why not.
    source: std::io::Error,
}

/// What `check-config` says of a fleet whose router sends an engine key
/// (`engine.engine_api_key_env`) and whose engines `agent_iids` have agents: each agent must hold
/// the key too (its `engines[].api_key_file` / `api_key_env`, docs/agent.md), which the fleet
/// file cannot show, so it is a note (exit 0), not a problem. `None` without a key or agents.
fn engine_key_note(key_env: &str, agent_iids: &[&str]) -> Option<String> {
    if key_env.is_empty() || agent_iids.is_empty() {
        return None;
    }
    Some(format!(
        "note: engine.engine_api_key_env ({key_env}) gives the router the engines' key; the \
         agents of {} must hold it too (engines[].api_key_file or engines[].api_key_env in \
         their config, docs/agent.md). The fleet file cannot show whether they do: an agent \
         without it fails its engine's model check with HTTP 401",
        agent_iids.join(", ")
    ))
}

/// `narwhal-serve check-config`: [`preflight`] plus the directories a run writes in (the
/// journal, `recovery.state_path`, a `file` lease's directory). Prints one summary line and
/// returns 0, or prints every problem on stderr and returns 2; binds and writes nothing.
fn check_config(args: &Args) -> ExitCode {
    let checked = preflight(args);
    let mut problems: Vec<String> = match &checked {
        Ok(_) => Vec::new(),
        Err(e) => e.to_string().lines().map(str::to_string).collect(),
    };
    if let Ok(c) = &checked {
        let mut dirs = vec![
            ("--journal", dir_of(&args.journal).to_path_buf()),
            (
                "recovery.state_path",
                dir_of(Path::new(&c.cfg.recovery.state_path)).to_path_buf(),
            ),
        ];
        if c.cfg.lease.backend == crate::config::LeaseBackend::File {
            dirs.push((
                "lease.path",
                dir_of(Path::new(&c.cfg.lease.path)).to_path_buf(),
            ));
        }
        for (what, dir) in dirs {
            if let Err(e) = writable(&dir) {
                problems.push(format!(
                    "{what}: {e} (under systemd, a directory outside /var/lib/narwhal needs ReadWritePaths=: docs/operate.md)"
                ));
            }
        }
    }
    match checked {
        Ok(c) if problems.is_empty() => {
            let agents = c.cfg.engines.iter().filter(|e| e.agent.is_some()).count();
            let with_agent: Vec<&str> = c
                .cfg
                .engines
                .iter()
                .filter(|e| e.agent.is_some())
                .map(|e| e.iid.as_str())
                .collect();
            if let Some(note) = engine_key_note(&c.cfg.engine.engine_api_key_env, &with_agent) {
                eprintln!("narwhal-serve: {note}");
            }
            println!(
                "narwhal-serve: {} ok: {} engine(s), {} with an agent, backend {}, lease {}, control.tls {}, {} admission seat(s){}",
                args.fleet().display(),
                c.cfg.engines.len(),
                agents,
                c.cfg.backend,
                match c.cfg.lease.backend {
                    crate::config::LeaseBackend::None => "none",
                    crate::config::LeaseBackend::File => "file",
                    crate::config::LeaseBackend::Etcd => "etcd",
                    crate::config::LeaseBackend::Kubernetes => "kubernetes",
                },
                if c.cfg.control_tls.is_some() {
                    "on"
                } else {
                    "off"
                },
                c.max_concurrent,
                if args.standby_of.is_some() {
                    ", standby"
                } else {
                    ""
                }
            );
            ExitCode::SUCCESS
        }
        _ => {
            for p in problems {
                eprintln!("narwhal-serve: {p}");
            }
            ExitCode::from(2)
        }
    }
}

/// Entry point of the `narwhal-serve` binary. Exit codes: 0 clean shutdown, 1 bind/startup
/// failure, 2 usage or fleet configuration errors, or a file the fleet file names (TLS,
/// keys, lease) that cannot be used: all found before anything is bound or printed on stdout.
pub fn main_from_args() -> ExitCode {
    let cli = Cli::parse();
    let args = match cli.command {
        Some(Command::CheckConfig(args)) => return check_config(&args),
        Some(Command::ConfigKeys) => {
            let mut out = std::io::stdout().lock();
            for k in crate::config::schema::accepted_keys() {
                if writeln!(out, "{k}").is_err() {
                    break;
                }
            }
            return ExitCode::SUCCESS;
        }
        None => cli.args,
    };
    if let Err(e) = init_logging(&args) {
        eprintln!("narwhal-serve: {e}");
        return ExitCode::from(2);
    }
    let checked = match preflight(&args) {
        Ok(c) => c,
        Err(e) => {
            for line in e.to_string().lines() {
                eprintln!("narwhal-serve: {line}");
            }
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("narwhal-serve: tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = rt.block_on(async_main(args, checked));
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    code
}

/// The listen queue of both listeners: connections the kernel completes before the router
/// accepts them. Tokio's default (1024) overflows when thousands of clients connect at once
/// (their SYNs are dropped and retried a second later); the kernel caps this at
/// `net.core.somaxconn` (docs/operate.md, "Many concurrent streams").
pub(crate) const LISTEN_BACKLOG: u32 = 4096;

async fn bind(addr: &str) -> Result<TcpListener, ExitCode> {
    let fail = |e: std::io::Error| {
        eprintln!("narwhal-serve: bind {addr}: {e}");
        ExitCode::from(1)
    };
    let resolved = tokio::net::lookup_host(addr)
        .await
        .map_err(fail)?
        .next()
        .ok_or_else(|| fail(std::io::Error::other("the address resolves to nothing")))?;
    narwhal_shared::net::listen(resolved, LISTEN_BACKLOG).map_err(fail)
}

async fn async_main(args: Args, checked: Checked) -> ExitCode {
    let Checked {
        cfg,
        max_concurrent,
        tokenizer,
    } = checked;
    let data = match bind(&args.listen).await {
        Ok(l) => l,
        Err(c) => return c,
    };
    let control = match bind(&args.control_listen).await {
        Ok(l) => l,
        Err(c) => return c,
    };
    let self_drain = match &cfg.self_drain {
        Some(sd) => match bind(&sd.listen).await {
            Ok(l) => Some(l),
            Err(c) => return c,
        },
        None => None,
    };
    let self_drain_addr = self_drain.as_ref().and_then(|l| l.local_addr().ok());
    let (Ok(data_addr), Ok(control_addr)) = (data.local_addr(), control.local_addr()) else {
        eprintln!("narwhal-serve: cannot read the bound addresses");
        return ExitCode::from(1);
    };
    let shutdown = match shutdown_signal() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("narwhal-serve: installing signal handlers: {e}");
            return ExitCode::from(1);
        }
    };
    let run = run_id(SystemClock.wall().unwrap_or(0.0));
    let admission = (cfg.serving.admission.as_str(), cfg.serving.admission_margin);
    let (journal, _writer) = match Journal::open(
        &args.journal,
        &run,
        admission,
        std::sync::Arc::new(SystemClock),
    ) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("narwhal-serve: {e}");
            return ExitCode::from(1);
        }
    };
    // The state file's directory is made once, here: a later write into a directory that was
    // removed under the router fails and is counted (`narwhal_state_write_failures_total`),
    // never recreates it.
    let state_dir = dir_of(Path::new(&cfg.recovery.state_path));
    if let Err(e) = std::fs::create_dir_all(state_dir) {
        eprintln!(
            "narwhal-serve: recovery.state_path: create {}: {e}",
            state_dir.display()
        );
        return ExitCode::from(1);
    }
    let data_url = format!("http://{data_addr}");
    let control_scheme = if cfg.control_tls.is_some() {
        "https"
    } else {
        "http"
    };
    let control_url = format!("{control_scheme}://{control_addr}");
    // The self-drain listener serves TLS with the control certificate when there is one.
    let self_drain_url = self_drain_addr.map(|a| format!("{control_scheme}://{a}"));
    let standby = args
        .standby_of
        .as_ref()
        .map(|primary| crate::ha::StandbyOptions {
            primary: primary.trim_end_matches('/').to_string(),
            probe_interval: std::time::Duration::from_secs_f64(
                args.standby_probe_interval.max(0.01),
            ),
            takeover_after: args.standby_takeover_after.max(1),
            max_handoff_age_s: args.standby_max_handoff_age,
        });
    let router_id = args.router_id.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "narwhal".into());
        format!("{host}:{}", control_addr.port())
    });
    // Written once the router has looked at its engines (app::run calls it after the
    // startup health round).
    let ready_file = args.ready_file.clone();
    let (data_url2, control_url2, run2) = (data_url.clone(), control_url.clone(), run.clone());
    let self_drain_url2 = self_drain_url.clone();
    let announce = move || -> Result<(), AnnounceError> {
        let (data_url, control_url, run) = (data_url2, control_url2, run2);
        if let Some(path) = &ready_file {
            let doc = ReadyFile {
                data: &data_url,
                control: &control_url,
                self_drain: self_drain_url2.as_deref(),
                pid: std::process::id(),
                run: &run,
            };
            write_atomic(path, &doc).map_err(|source| AnnounceError::ReadyFile {
                path: path.clone(),
                source,
            })?;
        }
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "narwhal-serve listening data={data_url} control={control_url}"
        );
        let _ = out.flush();
        Ok(())
    };
    tracing::info!(data = %data_url, control = %control_url, run = %run, engines = cfg.engines.len(), backend = %cfg.backend, "narwhal-serve started");
    let result = crate::app::run(
        cfg,
        Listeners {
            data,
            control,
            self_drain,
        },
        RunOptions {
            journal,
            max_concurrent,
            resume: args.resume,
            standby,
            router_id,
            announce: Some(Box::new(announce)),
            tokenizer,
        },
        shutdown,
    )
    .await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("narwhal-serve: {e}");
            ExitCode::from(1)
        }
    }
}

/// Install the SIGTERM/SIGINT handlers now (before the listening line, so a supervisor that
/// signals right after it gets a graceful shutdown) and return the future that waits for one.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use clap::CommandFactory;

    use super::*;
    use crate::config::schema::docs;

    /// Flags (`--fleet`) and subcommands (`check-config`) of a clap command, without clap's
    /// own `--help` / `--version` / `help`.
    fn clap_surface(cmd: &clap::Command) -> (BTreeSet<String>, BTreeSet<String>) {
        let flags = cmd
            .get_arguments()
            .filter_map(|a| a.get_long())
            .filter(|l| !matches!(*l, "help" | "version"))
            .map(|l| format!("--{l}"))
            .collect();
        let subs = cmd
            .get_subcommands()
            .map(|s| s.get_name().to_string())
            .filter(|n| n != "help")
            .collect();
        (flags, subs)
    }

    /// The command-line table of docs/configuration.md names exactly the
    /// flags and subcommands `narwhal-serve` has. Fails naming each one and what to do.
    #[test]
    fn configuration_md_documents_exactly_the_command_line() {
        let text = docs::read("configuration.md");
        let section = docs::section(&text, "configuration.md", "serve-cli");
        let (mut doc_flags, mut doc_subs) = (BTreeSet::new(), BTreeSet::new());
        for (_, first, _) in docs::rows(section) {
            for span in docs::code_spans(&first) {
                let mut words = span.split_whitespace().peekable();
                if words.peek() == Some(&"narwhal-serve") {
                    words.next();
                    if let Some(w) = words.next().filter(|w| !w.starts_with(['[', '-'])) {
                        doc_subs.insert(w.to_string());
                    }
                }
                doc_flags.extend(words.filter(|w| w.starts_with("--")).map(str::to_string));
            }
        }
        let cli = Cli::command();
        let (flags, subs) = clap_surface(&cli);
        let mut problems = Vec::new();
        for f in flags.difference(&doc_flags) {
            problems.push(format!(
                "narwhal-serve has flag {f} but docs/configuration.md does not describe it: add a row `| \\`{f} VALUE\\` | default | what |` to the table between the serve-cli markers"
            ));
        }
        for f in doc_flags.difference(&flags) {
            problems.push(format!(
                "docs/configuration.md describes flag {f} but narwhal-serve has no such flag: fix or remove its row (serve-cli table)"
            ));
        }
        for s in subs.difference(&doc_subs) {
            problems.push(format!(
                "narwhal-serve has subcommand `{s}` but docs/configuration.md does not describe it: add a row `| \\`narwhal-serve {s} ...\\` | | what |` to the serve-cli table"
            ));
        }
        for s in doc_subs.difference(&subs) {
            problems.push(format!(
                "docs/configuration.md describes subcommand `{s}` but narwhal-serve has none: fix or remove its row (serve-cli table)"
            ));
        }
        // Every subcommand's flags are run flags (check-config takes the same ones).
        for sub in cli.get_subcommands() {
            let (sub_flags, _) = clap_surface(sub);
            for f in sub_flags.difference(&flags) {
                problems.push(format!(
                    "narwhal-serve {} has flag {f}, which a run does not have: document it in the serve-cli table",
                    sub.get_name()
                ));
            }
        }
        assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
    }

    #[test]
    fn check_config_takes_the_run_flags_and_needs_no_fleet_flag_at_the_top() {
        let c = Cli::try_parse_from(["narwhal-serve", "check-config", "--fleet", "f.json"])
            .expect("check-config parses");
        match c.command {
            Some(Command::CheckConfig(a)) => assert_eq!(a.fleet(), Path::new("f.json")),
            other => panic!("{other:?}"),
        }
        let c = Cli::try_parse_from(["narwhal-serve", "config-keys"]).expect("config-keys");
        assert!(matches!(c.command, Some(Command::ConfigKeys)));
        assert!(
            Cli::try_parse_from(["narwhal-serve", "check-config"]).is_err()
                || std::env::var_os("NARWHAL_FLEET").is_some(),
            "check-config without --fleet is a usage error"
        );
    }

    /// The problems read as the operator docs and the end-to-end tests quote them, one per line.
    #[test]
    fn an_engine_key_with_agents_is_noted_for_the_agents() {
        assert_eq!(engine_key_note("", &["e0"]), None);
        assert_eq!(engine_key_note("ENGINE_KEY", &[]), None);
        let note = engine_key_note("ENGINE_KEY", &["e0", "e1"]).expect("a note");
        assert!(
            note.contains("ENGINE_KEY")
                && note.contains("agents of e0, e1")
                && note.contains("engines[].api_key_file"),
            "{note}"
        );
    }

    #[test]
    fn preflight_problems_are_shown_one_per_line() {
        let e = PreflightError::Problems(vec![
            Problem::MaxConcurrent { given: 0, max: 64 },
            Problem::StandbyWithoutLease,
            Problem::Agents(AgentsError::NoTls),
        ]);
        assert_eq!(
            e.to_string(),
            "--max-concurrent 0 must be in 1..=64 (serving.max_connections)\n\
             --standby-of needs a lease: set lease.backend to file, etcd or kubernetes in the fleet file\n\
             tls: required by engines[].agent (mutual TLS to the agents)"
        );
    }

    #[test]
    fn writable_finds_the_nearest_existing_directory_and_names_a_read_only_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        writable(&dir.path().join("not/yet/there")).expect("writable");
        // /proc takes no new files, even from root: the probe names the directory it tried.
        let e = writable(Path::new("/proc/narwhal-check/lease"))
            .expect_err("/proc")
            .to_string();
        assert!(e.starts_with("cannot create files in /proc:"), "{e}");
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("ls").count(),
            0,
            "no probe file left behind"
        );
    }
}
