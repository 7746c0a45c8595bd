//! `narwhal-serve` command line (reference-notes 8.2; task brief): parse, load the fleet, bind,
//! announce, then [`crate::app::run`].
//!
//! ```text
//!  args ──clap──► Args ──Config::load──► Config (exit 2 on any problem, all listed)
//!       ──bind data + control──► (exit 1: "narwhal-serve: bind <addr>: <error>")
//!       ──ready file {data, control, pid, run} (atomic, written first)
//!       ──stdout: "narwhal-serve listening data=http://H:P control=http://H:P" ──► run(...)
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use narwhal_shared::{Clock, SystemClock};
use tokio::net::TcpListener;

use crate::app::{Listeners, RunOptions};
use crate::config::Config;
use crate::journal::{Journal, run_id};

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Narwhal router: disaggregated prefill/decode serving for vLLM and SGLang fleets.
#[derive(Debug, Parser)]
#[command(name = "narwhal-serve", version, about)]
struct Args {
    /// Fleet file (schema narwhal.fleet version 2).
    #[arg(long, env = "NARWHAL_FLEET")]
    fleet: PathBuf,
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
    /// Missed polls before the standby tries to take over (it still needs the lease to lapse).
    #[arg(long, default_value_t = 4)]
    standby_takeover_after: u32,
    /// A retained handoff older than this many seconds is not applied at takeover.
    #[arg(long, default_value_t = 30.0)]
    standby_max_handoff_age: f64,
    /// Prefix of this router's lease holder token (default: host name and control port).
    #[arg(long)]
    router_id: Option<String>,
}

fn init_logging(args: &Args) -> Result<(), String> {
    let level = match args.log_level.as_str() {
        "critical" => "error",
        "warning" => "warn",
        other => other,
    };
    // A bare word must be a level; anything else is a tracing filter (`narwhal_router=debug`).
    const LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];
    if !level.contains(['=', ',']) && !LEVELS.contains(&level) {
        return Err(format!(
            "--log-level {:?}: expected one of critical, error, warning, info, debug, trace, or a tracing filter",
            args.log_level
        ));
    }
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .map_err(|e| format!("--log-level {level:?}: {e}"))?;
    let b = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter);
    let r = match args.log_format {
        LogFormat::Text => b.try_init(),
        LogFormat::Json => b.json().try_init(),
    };
    r.map_err(|e| format!("logging: {e}"))
}

/// Write `value` to `path` atomically (temp file in the same directory, then rename).
fn write_atomic(path: &Path, value: &serde_json::Value) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("ready"),
        std::process::id()
    ));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(value.to_string().as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

/// Entry point of the `narwhal-serve` binary. Exit codes: 0 clean shutdown, 1 bind/startup
/// failure, 2 usage or fleet configuration errors.
pub fn main_from_args() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = init_logging(&args) {
        eprintln!("narwhal-serve: {e}");
        return ExitCode::from(2);
    }
    let cfg = match Config::load(&args.fleet) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("narwhal-serve: {e}");
            return ExitCode::from(2);
        }
    };
    let max = cfg.serving.max_connections;
    let max_concurrent = args.max_concurrent.unwrap_or(max);
    if max_concurrent < 1 || max_concurrent > max {
        eprintln!(
            "narwhal-serve: --max-concurrent {max_concurrent} must be in 1..={max} (serving.max_connections)"
        );
        return ExitCode::from(2);
    }
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
    let code = rt.block_on(async_main(args, cfg, max_concurrent as usize));
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    code
}

async fn bind(addr: &str) -> Result<TcpListener, ExitCode> {
    TcpListener::bind(addr).await.map_err(|e| {
        eprintln!("narwhal-serve: bind {addr}: {e}");
        ExitCode::from(1)
    })
}

async fn async_main(args: Args, cfg: Config, max_concurrent: usize) -> ExitCode {
    let data = match bind(&args.listen).await {
        Ok(l) => l,
        Err(c) => return c,
    };
    let control = match bind(&args.control_listen).await {
        Ok(l) => l,
        Err(c) => return c,
    };
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
    let (journal, _writer) = match Journal::open(&args.journal, &run, admission) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("narwhal-serve: {e}");
            return ExitCode::from(1);
        }
    };
    if let Some(t) = &cfg.control_tls {
        let files = narwhal_shared::TlsFiles {
            ca: t.ca.clone(),
            cert: t.cert.clone(),
            key: t.key.clone(),
        };
        if let Err(e) = files.server_config() {
            eprintln!("narwhal-serve: control.{e}");
            return ExitCode::from(2);
        }
    }
    let data_url = format!("http://{data_addr}");
    let control_scheme = if cfg.control_tls.is_some() {
        "https"
    } else {
        "http"
    };
    let control_url = format!("{control_scheme}://{control_addr}");
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
    if standby.is_some() && cfg.lease.backend == crate::config::LeaseBackend::None {
        eprintln!(
            "narwhal-serve: --standby-of needs a lease: set lease.backend to file or etcd in the fleet file"
        );
        return ExitCode::from(2);
    }
    let router_id = args.router_id.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "narwhal".into());
        format!("{host}:{}", control_addr.port())
    });
    if let Some(path) = &args.ready_file {
        let doc = serde_json::json!({"data": data_url, "control": control_url, "pid": std::process::id(), "run": run});
        if let Err(e) = write_atomic(path, &doc) {
            eprintln!("narwhal-serve: ready file {}: {e}", path.display());
            return ExitCode::from(1);
        }
    }
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "narwhal-serve listening data={data_url} control={control_url}"
        );
        let _ = out.flush();
    }
    tracing::info!(data = %data_url, control = %control_url, run = %run, engines = cfg.engines.len(), backend = %cfg.backend, "narwhal-serve started");
    let result = crate::app::run(
        cfg,
        Listeners { data, control },
        RunOptions {
            journal,
            max_concurrent,
            resume: args.resume,
            standby,
            router_id,
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
