//! `narwhal-engine-sim`: an engine simulator speaking the vLLM and SGLang wire protocols,
//! including vLLM's NIXL descriptor handoff and SGLang's bootstrap rendezvous, with fault
//! injection (`/sim/faults`) and counters (`/sim/stats`) for tests (architecture.md sections 1
//! and 8) on a separate admin listener that only tests use.
//!
//! ```text
//!  CLI ──► Settings ──► bind --listen, --admin-listen, --kv-listen (vLLM),
//!                       --bootstrap-port (SGLang prefill)
//!      ──► write --ready-file {url, admin, ...}, print "narwhal-engine-sim listening on http://HOST:PORT"
//!      ──► serve engine HTTP + admin HTTP + side channel + lease sweeper on a small runtime
//! ```
//!
//! With `--engines N` the binding and serving steps run once per engine (each its own ports and
//! [`Sim`]); the ready file lists them under `engines`, one lease sweeper serves them all.
//!
//! The full contract (flags, phases, fault API, stats fields) is in docs/engine-simulator.md.
// A test tool that measures wall time (latencies, deadlines): the clock ban of clippy.toml is
// for product code.
#![allow(clippy::disallowed_methods)]

/// jemalloc, as the router: under `narwhal-bench` the simulators and the load generator share
/// one CPU, and the system allocator was a tenth of a simulator's CPU (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod body;
mod faults;
mod kv;
mod kv_events;
mod metrics;
mod prefix_cache;
mod protocol;
mod server;
mod stats;
mod tokenizer;
mod transfer;

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use tokio::net::TcpListener;

use server::{CacheSettings, Dialect, Mode, Settings, Sim, Surface};

/// Command line (docs/engine-simulator.md, "Flags").
#[derive(Debug, Parser)]
#[command(
    name = "narwhal-engine-sim",
    version,
    about = "vLLM / SGLang engine simulator",
    // A later flag overrides an earlier one (`--model a ... --model b`), so a restart can
    // change what the engine serves (tests/src/sim.rs `SimHandle::restart`).
    args_override_self = true
)]
struct Cli {
    /// HTTP listen address (the engine's surface).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Admin listen address: the test hooks `/sim/faults`, `/sim/stats`. Given, the hooks are
    /// served only there and the engine port answers them 404 as a real engine does (the test
    /// kit, `narwhal-dev` and `narwhal-bench` always pass it). Left out, an admin listener is
    /// still bound on `127.0.0.1:0`, and the hooks are also answered on the engine port for
    /// older scripts, with a warning on stderr.
    #[arg(long)]
    admin_listen: Option<SocketAddr>,
    /// Leave the engine's KV-transfer families out of `/metrics` (an engine or version that
    /// publishes none, e.g. vLLM before 0.11.1 or SGLang without `--enable-metrics`).
    #[arg(long)]
    no_kv_metrics: bool,
    /// Served model name.
    #[arg(long, default_value = "tiny-sim")]
    model: String,
    /// Wire protocol to speak.
    #[arg(long, value_enum, default_value = "vllm")]
    dialect: Dialect,
    /// Engine id (vLLM `remote_engine_id`); default: a random UUID per process.
    #[arg(long)]
    engine_id: Option<String>,
    /// Generation seed: output is a pure function of (prompt, seed, position).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Delay before the first token / before the prefill answer (milliseconds).
    #[arg(long, default_value_t = 0)]
    ttft_ms: u64,
    /// Extra prefill compute per prompt token (microseconds).
    #[arg(long, default_value_t = 0)]
    prefill_us_per_token: u64,
    /// Delay between streamed tokens (milliseconds).
    #[arg(long, default_value_t = 0)]
    tpot_ms: u64,
    /// Each streamed token's delay grows by this per other request running on the engine
    /// (microseconds): a decode batch's cost, so TPOT degrades with load.
    #[arg(long, default_value_t = 0)]
    tpot_per_running_us: u64,
    /// Each streamed token's delay grows by this per KV block running requests hold
    /// (microseconds; with `--kv-pool`): a decode step's attention over the batch's context,
    /// so TPOT degrades with the tokens in the batch.
    #[arg(long, default_value_t = 0.0)]
    tpot_per_kv_block_us: f64,
    /// Running requests hold their blocks in the prefix cache's capacity
    /// (`--kv-cache-blocks`), as in vLLM's one block pool: a request is scheduled (and its
    /// prefix looked up) only when its prompt and output fit beside them, waiting FIFO
    /// meanwhile; its blocks are stored when it is scheduled and stay cached, evictable,
    /// when it finishes.
    #[arg(long)]
    kv_pool: bool,
    /// Prefills computed at once (0 = unlimited); the rest queue FIFO, as on one
    /// accelerator, so prefill capacity is finite.
    #[arg(long, default_value_t = 0)]
    prefill_slots: usize,
    /// Consumer-side delay of a successful KV transfer (milliseconds).
    #[arg(long, default_value_t = 0)]
    kv_transfer_ms: u64,
    /// How long a producer keeps unread KV blocks / rooms (seconds, fractional allowed).
    #[arg(long, default_value_t = 30.0)]
    kv_lease_s: f64,
    /// vLLM NIXL side-channel listen address (its port is `remote_port`).
    #[arg(long, default_value = "127.0.0.1:0")]
    kv_listen: SocketAddr,
    /// SGLang bootstrap server port (prefill mode); 0 = ephemeral.
    #[arg(long, default_value_t = 0)]
    bootstrap_port: u16,
    /// SGLang disaggregation mode.
    #[arg(long, value_enum, default_value = "null")]
    disaggregation_mode: Mode,
    /// SGLang: allow `POST /pd_role_switch` to change the disaggregation mode at runtime
    /// (SGLang's `--enable-pd-role-switch`). The bootstrap server then runs in either mode, so
    /// a switch to prefill finds it.
    #[arg(long)]
    enable_pd_role_switch: bool,
    /// Concurrent completion requests before answering 429 (0 = unlimited).
    #[arg(long, default_value_t = 0)]
    max_running: u64,
    /// Requests running at once (0 = unlimited), as vLLM's `--max-num-seqs` bounds its
    /// scheduler's running set: the rest wait FIFO in the waiting queue (their time to first
    /// token includes the wait) and are counted in `num_requests_waiting`.
    #[arg(long, default_value_t = 0)]
    max_num_seqs: usize,
    /// Context length in tokens (prompt + max_tokens).
    #[arg(long, default_value_t = 4096)]
    max_model_len: u64,
    /// Write `{"url","admin","pid","engine_id","kv_port","bootstrap_port"}` here once serving
    /// (with `--engines`: `{"pid","engines":[...]}`, one such object per engine, without `pid`).
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Runtime worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Faults armed before the engine port serves (the body of `POST /sim/faults`): an engine
    /// that comes up still loading, e.g. `[{"phase":"health","action":"status","status":503,
    /// "count":1000}]`.
    #[arg(long)]
    faults: Option<String>,
    /// LoRA adapters served beside the base model (vLLM's `--lora-modules name=path ...`; the
    /// path is ignored): a request whose `model` names one runs with that adapter, and its
    /// blocks are keyed by the adapter's name as vLLM keys them.
    #[arg(long, num_args = 1..)]
    lora_modules: Vec<String>,
    /// The engine's chat template renders no `tools` (a model whose template has no tool
    /// support, or another `--chat-template` than its peers'): a chat request with tools is
    /// tokenized, and computed, as if it had none.
    #[arg(long)]
    template_without_tools: bool,
    /// Data-parallel ranks behind this one API server (vLLM's `--data-parallel-size`): each
    /// has its own prefix cache and, with `--kv-events-config`, publishes its events on the
    /// endpoint's and replay endpoint's ports plus its rank (vLLM's `offset_endpoint_port`).
    /// A request runs on the rank its `X-data-parallel-rank` header names, else on the next
    /// rank in turn.
    #[arg(long, default_value_t = 1)]
    data_parallel_size: usize,
    /// Tokens per KV cache block (vLLM's `--block-size`; its GPU default).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Prefix cache capacity in blocks (vLLM sizes it from GPU memory, or
    /// `--num-gpu-blocks-override`, accepted as an alias).
    #[arg(long, alias = "num-gpu-blocks-override", default_value_t = 4096)]
    kv_cache_blocks: usize,
    /// Prefix caching on (vLLM V1's default); see `--no-enable-prefix-caching`.
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    enable_prefix_caching: bool,
    /// Turn prefix caching off: no hits, no stored blocks, no KV events.
    #[arg(long, overrides_with = "enable_prefix_caching")]
    no_enable_prefix_caching: bool,
    /// vLLM's `--enable-prompt-tokens-details`: usage carries `prompt_tokens_details`
    /// (`cached_tokens`: the prompt tokens served from the prefix cache; `created_cache_tokens`
    /// and `multimodal_tokens` null), in a whole answer and in the streamed usage chunk.
    #[arg(long)]
    enable_prompt_tokens_details: bool,
    /// vLLM's `--api-key` (or `VLLM_API_KEY`): every request whose path starts with `/v1`,
    /// `/v2`, `/inference` or `/cohere` (OPTIONS excepted) needs `Authorization: Bearer <key>`,
    /// else 401 `{"error": "Unauthorized"}`; `/health`, `/metrics`, `/version`, `/tokenize`
    /// stay open (vLLM's `AuthenticationMiddleware`). vLLM dialect only.
    #[arg(long, env = "VLLM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// vLLM's KV events config (JSON, `KVEventsConfig` keys), e.g.
    /// `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}`.
    #[arg(long)]
    kv_events_config: Option<String>,
    /// Serve this many engines from this one process, each with its own engine port, admin
    /// listener, side channel (vLLM) or bootstrap server (SGLang prefill), engine id and state,
    /// all on ephemeral ports of the `--listen` / `--admin-listen` / `--kv-listen` IPs. They
    /// share the process, and so its identity (pid, process start) and its restarts. The ready
    /// file then lists them under `engines` (docs/engine-simulator.md, "Many engines in one
    /// process").
    #[arg(long, default_value_t = 1)]
    engines: usize,
    /// Many-engine mode: bind each engine on the ports an earlier ready file of this mode lists
    /// (a restart in place); read before `--ready-file` is written, so it may be the same path.
    #[arg(long)]
    ports_from: Option<PathBuf>,
}

/// Startup failures, each naming the flag or resource.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("--kv-lease-s must be a positive finite number of seconds, got {0}")]
    Lease(f64),
    #[error("--threads must be at least 1")]
    Threads,
    #[error("cannot build the tokio runtime: {0}")]
    Runtime(std::io::Error),
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("--faults: {0}")]
    Faults(String),
    #[error("--block-size must be at least 1 token")]
    BlockSize,
    #[error("--kv-cache-blocks must be at least 1 block")]
    CacheBlocks,
    #[error("{0}")]
    KvEvents(String),
    #[error("--data-parallel-size must be at least 1")]
    DataParallel,
    #[error("--api-key is vLLM's (its guarded paths and 401 body); the sglang dialect has none")]
    ApiKeyDialect,
    #[error("--api-key must not be empty")]
    ApiKeyEmpty,
    #[error("--engines must be at least 1")]
    Engines,
    #[error("--engines {0}: {1}")]
    Many(usize, String),
    #[error("--ports-from {path}: {reason}")]
    PortsFrom { path: PathBuf, reason: String },
    #[error("cannot write --ready-file {path}: {source}")]
    ReadyFile {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("narwhal-engine-sim: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<(), StartError> {
    if !(cli.kv_lease_s.is_finite() && cli.kv_lease_s > 0.0) {
        return Err(StartError::Lease(cli.kv_lease_s));
    }
    if cli.threads == 0 {
        return Err(StartError::Threads);
    }
    if cli.data_parallel_size == 0 {
        return Err(StartError::DataParallel);
    }
    if cli.block_size == 0 {
        return Err(StartError::BlockSize);
    }
    if cli.kv_cache_blocks == 0 {
        return Err(StartError::CacheBlocks);
    }
    if cli.engines == 0 {
        return Err(StartError::Engines);
    }
    let many = cli.engines > 1 || cli.ports_from.is_some();
    if many {
        let fixed = |a: &SocketAddr| a.port() != 0;
        let why = if cli.kv_events_config.is_some() {
            Some("--kv-events-config names one endpoint; it is for one engine per process")
        } else if fixed(&cli.listen) || cli.admin_listen.as_ref().is_some_and(fixed) {
            Some("--listen and --admin-listen take port 0 here (each engine binds its own port)")
        } else if fixed(&cli.kv_listen) || cli.bootstrap_port != 0 {
            Some("--kv-listen and --bootstrap-port take port 0 here (each engine binds its own)")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(StartError::Many(cli.engines, why.to_string()));
        }
    }
    if let Some(key) = &cli.api_key {
        if key.is_empty() {
            return Err(StartError::ApiKeyEmpty);
        }
        if cli.dialect != Dialect::Vllm {
            return Err(StartError::ApiKeyDialect);
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.threads)
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    rt.block_on(serve(cli))
}

/// The listen queue of every listener: uvicorn's default `backlog` (2048), which vLLM's and
/// SGLang's API servers run under. Tokio's own default (1024) would make the simulator drop
/// connections of a burst that a real engine accepts.
const LISTEN_BACKLOG: u32 = 2048;

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    narwhal_shared::net::listen(addr, LISTEN_BACKLOG).map_err(|source| StartError::Bind {
        what,
        addr,
        source,
    })
}

/// The ports one engine binds (its listeners' addresses; port 0 = ephemeral).
#[derive(Debug, Clone, Copy)]
struct EnginePorts {
    listen: SocketAddr,
    admin: SocketAddr,
    kv: SocketAddr,
    bootstrap: u16,
}

/// One engine serving: its [`Sim`] and what its ready file says about it.
struct Serving {
    sim: Arc<Sim>,
    /// The engine's ready document (without `pid`).
    doc: serde_json::Value,
    url: String,
    admin_url: String,
    server: tokio::task::JoinHandle<()>,
}

async fn serve(cli: Cli) -> Result<(), StartError> {
    let many = cli.engines > 1 || cli.ports_from.is_some();
    let admin_ip = cli
        .admin_listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let ports: Vec<EnginePorts> = match &cli.ports_from {
        Some(path) => ports_from(path, cli.engines)?,
        None => (0..cli.engines)
            .map(|_| EnginePorts {
                listen: cli.listen,
                admin: admin_ip,
                kv: cli.kv_listen,
                bootstrap: cli.bootstrap_port,
            })
            .collect(),
    };
    let surface = if cli.admin_listen.is_some() || many {
        Surface::Engine
    } else {
        Surface::EngineWithHooks
    };
    let mut engines = Vec::with_capacity(ports.len());
    let started_at = process_start_time();
    for (k, p) in ports.iter().enumerate() {
        let engine_id = match (&cli.engine_id, many) {
            (Some(id), false) => id.clone(),
            (Some(id), true) => format!("{id}-{k}"),
            (None, _) => uuid::Uuid::new_v4().to_string(),
        };
        engines.push(start_engine(&cli, *p, engine_id, surface, started_at).await?);
    }
    if surface == Surface::EngineWithHooks {
        eprintln!(
            "narwhal-engine-sim: no --admin-listen: the test hooks /sim/* are also served on the \
             engine port (legacy); pass --admin-listen to serve them only on {}",
            engines[0].admin_url
        );
    }
    // One lease sweeper for every engine of the process.
    let sims: Vec<Arc<Sim>> = engines.iter().map(|e| e.sim.clone()).collect();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = Instant::now();
            for s in &sims {
                s.expire(now);
            }
        }
    });
    if let Some(path) = &cli.ready_file {
        let pid = std::process::id();
        let doc = if many {
            let list: Vec<serde_json::Value> = engines.iter().map(|e| e.doc.clone()).collect();
            serde_json::json!({"pid": pid, "engines": list})
        } else {
            let mut doc = engines[0].doc.clone();
            doc["pid"] = pid.into();
            doc
        };
        write_atomic(path, &doc.to_string()).map_err(|source| StartError::ReadyFile {
            path: path.clone(),
            source,
        })?;
    }
    // The ready file goes first so that a reader of the stdout line can rely on it too. With
    // many engines the line names the first; the ready file names them all.
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "narwhal-engine-sim listening on {}", engines[0].url);
        let _ = out.flush();
    }
    for e in &engines {
        tracing::info!(url = %e.url, admin = %e.admin_url, engine.id = %e.sim.engine_id, "serving");
    }
    let servers: Vec<_> = engines.into_iter().map(|e| e.server).collect();
    for s in servers {
        let _ = s.await;
    }
    Ok(())
}

/// Binds and starts one engine on `p`: its engine port, admin listener, side channel or
/// bootstrap server, with its own [`Sim`] (state, counters, faults, prefix cache).
async fn start_engine(
    cli: &Cli,
    p: EnginePorts,
    engine_id: String,
    engine_surface: Surface,
    started_at: f64,
) -> Result<Serving, StartError> {
    let settings = Settings {
        model: cli.model.clone(),
        dialect: cli.dialect,
        engine_id,
        seed: cli.seed,
        ttft: Duration::from_millis(cli.ttft_ms),
        prefill_per_token: Duration::from_micros(cli.prefill_us_per_token),
        tpot: Duration::from_millis(cli.tpot_ms),
        kv_transfer: Duration::from_millis(cli.kv_transfer_ms),
        kv_lease: Duration::from_secs_f64(cli.kv_lease_s),
        mode: cli.disaggregation_mode,
        max_running: cli.max_running,
        max_model_len: cli.max_model_len,
        kv_metrics: !cli.no_kv_metrics,
        role_switch: cli.enable_pd_role_switch,
        prefill_slots: cli.prefill_slots,
        max_num_seqs: cli.max_num_seqs,
        tpot_per_running: Duration::from_micros(cli.tpot_per_running_us),
        tpot_per_kv_block: Duration::from_secs_f64(cli.tpot_per_kv_block_us.max(0.0) / 1e6),
        kv_pool: cli.kv_pool,
        cache: CacheSettings {
            block_size: cli.block_size,
            blocks: cli.kv_cache_blocks,
            enabled: !cli.no_enable_prefix_caching,
            seed: hash_seed(),
        },
        dev_mode: std::env::var("VLLM_SERVER_DEV_MODE").is_ok_and(|v| v == "1"),
        api_key: cli.api_key.clone(),
        prompt_tokens_details: cli.enable_prompt_tokens_details,
        render_tools: !cli.template_without_tools,
        data_parallel_size: cli.data_parallel_size,
        adapters: cli
            .lora_modules
            .iter()
            .map(|m| {
                m.split_once('=')
                    .map_or(m.as_str(), |(name, _)| name)
                    .to_string()
            })
            .collect(),
    };
    let events_cfg = match &cli.kv_events_config {
        Some(text) => kv_events::KvEventsConfig::parse(text).map_err(StartError::KvEvents)?,
        None => None,
    };
    let mut events = Vec::new();
    if let Some(c) = events_cfg.as_ref().filter(|_| settings.cache.enabled) {
        for rank in 0..settings.data_parallel_size {
            let c = c.rank(rank).map_err(StartError::KvEvents)?;
            let encoding = match settings.dialect {
                Dialect::Vllm => kv_events::Encoding::Vllm,
                Dialect::Sglang => kv_events::Encoding::Sglang,
            };
            events.push(
                kv_events::Publisher::start(&c, p.listen.ip(), encoding)
                    .await
                    .map_err(StartError::KvEvents)?,
            );
        }
    }
    let events_endpoints = events
        .first()
        .map(|p| (p.endpoint.clone(), p.replay_endpoint.clone()));
    let http = bind("--listen", p.listen).await?;
    let http_addr = local(&http, p.listen);
    let admin = bind("--admin-listen", p.admin).await?;
    let admin_url = format!("http://{}", local(&admin, p.admin));
    let kv = match cli.dialect {
        Dialect::Vllm => Some(bind("--kv-listen", p.kv).await?),
        Dialect::Sglang => None,
    };
    let bootstrap = match (cli.dialect, cli.disaggregation_mode) {
        (Dialect::Sglang, Mode::Prefill) | (Dialect::Sglang, Mode::Decode)
            if cli.disaggregation_mode == Mode::Prefill || cli.enable_pd_role_switch =>
        {
            let addr = SocketAddr::new(p.listen.ip(), p.bootstrap);
            Some(bind("--bootstrap-port", addr).await?)
        }
        _ => None,
    };
    let kv_addr = kv.as_ref().map(|l| local(l, p.kv));
    let bootstrap_addr = bootstrap.as_ref().map(|l| local(l, p.listen));
    let url = format!("http://{http_addr}");
    let sim = Arc::new(Sim::new(
        settings,
        url.clone(),
        kv_addr,
        bootstrap_addr,
        started_at,
        events,
    ));
    if let Some(text) = &cli.faults {
        sim.arm(text.as_bytes()).map_err(StartError::Faults)?;
    }
    if let Some(l) = kv {
        tokio::spawn(transfer::serve(l, sim.clone()));
    }
    if let Some(l) = bootstrap {
        tokio::spawn(transfer::serve(l, sim.clone()));
    }
    tokio::spawn(server::serve_http(admin, sim.clone(), Surface::Admin));
    let server = tokio::spawn(server::serve_http(http, sim.clone(), engine_surface));
    let doc = serde_json::json!({
        "url": url,
        "admin": admin_url,
        "engine_id": sim.engine_id,
        "kv_port": kv_addr.map(|a| a.port()),
        "bootstrap_port": bootstrap_addr.map(|a| a.port()),
        "kv_events_endpoint": events_endpoints.as_ref().map(|e| e.0.clone()),
        "kv_events_replay_endpoint": events_endpoints.as_ref().and_then(|e| e.1.clone()),
    });
    Ok(Serving {
        sim,
        doc,
        url,
        admin_url,
        server,
    })
}

/// The engines' ports from an earlier many-engine ready file (`engines[]`: `url`, `admin`,
/// `kv_port`, `bootstrap_port`); it must list exactly `n` engines.
fn ports_from(path: &Path, n: usize) -> Result<Vec<EnginePorts>, StartError> {
    let bad = |reason: String| StartError::PortsFrom {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let doc: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    // A one-engine process's ready file is that engine's own document.
    let one = [doc.clone()];
    let list = match doc["engines"].as_array() {
        Some(list) => list.as_slice(),
        None if n == 1 && doc["url"].is_string() => &one[..],
        None => {
            return Err(bad(
                "no `engines` list (not a many-engine ready file)".into()
            ));
        }
    };
    if list.len() != n {
        return Err(bad(format!(
            "lists {} engines, --engines is {n}",
            list.len()
        )));
    }
    let addr = |v: &serde_json::Value, key: &str| -> Result<SocketAddr, StartError> {
        v[key]
            .as_str()
            .and_then(|u| u.strip_prefix("http://"))
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| bad(format!("`{key}` is not http://IP:PORT: {}", v[key])))
    };
    list.iter()
        .map(|e| {
            let listen = addr(e, "url")?;
            let port = |key: &str| e[key].as_u64().and_then(|p| u16::try_from(p).ok());
            Ok(EnginePorts {
                listen,
                admin: addr(e, "admin")?,
                kv: SocketAddr::new(listen.ip(), port("kv_port").unwrap_or(0)),
                bootstrap: port("bootstrap_port").unwrap_or(0),
            })
        })
        .collect()
}

/// The block hash chain's seed: from `PYTHONHASHSEED` when set (vLLM derives its `NONE_HASH`
/// from it, so engines sharing it name blocks alike), else random per process.
fn hash_seed() -> u64 {
    match std::env::var("PYTHONHASHSEED") {
        Ok(v) => v.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        }),
        Err(_) => rand::random(),
    }
}

fn local(l: &TcpListener, fallback: SocketAddr) -> SocketAddr {
    l.local_addr().unwrap_or(fallback)
}

/// Writes `text` to `path` through a temporary file in the same directory and a rename.
fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(text.as_bytes())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// This process's start time in Unix seconds, computed as the agent and Prometheus' process
/// collector do: `btime + starttime / CLK_TCK` (proc(5) `/proc/self/stat` field 22, `/proc/stat`
/// `btime`). Falls back to the current time when `/proc` is unreadable.
fn process_start_time() -> f64 {
    let from_proc = || -> Option<f64> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let after = &stat[stat.rfind(')')? + 1..];
        // Fields after the command: state is field 3, starttime is field 22 → index 19.
        let ticks: f64 = after.split_whitespace().nth(19)?.parse().ok()?;
        let sys = std::fs::read_to_string("/proc/stat").ok()?;
        let btime: f64 = sys
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .filter(|h| *h > 0)
            .unwrap_or(100) as f64;
        Some(btime + ticks / hz)
    };
    from_proc().unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    })
}
