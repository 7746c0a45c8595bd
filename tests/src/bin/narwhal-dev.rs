//! `narwhal-dev`: a whole Narwhal fleet on loopback for trying the product locally.
//!
//! - `narwhal-dev up`: starts simulated engines and a router, each as its own process running
//!   the real binary, prints the URLs and a curl line, writes a ready file naming everything it
//!   started, and runs until interrupted (SIGINT/SIGTERM), then stops every child.
//! - `narwhal-dev demo`: brings a fleet up in a temporary directory for each dialect, sends a
//!   mix of streaming and non-streaming chat and completion requests through the router,
//!   prints a table of outcomes and the simulators' KV statistics, and exits non-zero if any
//!   request failed or any decode recomputed its prefill instead of receiving KV.
//!
//! `up` and `demo` run as two processes (see `session.rs`): the one started by the user
//! supervises a fleet process in its own process group, so a `kill -9` of either leaves no
//! engine, agent or router behind, and a second session in a busy `--dir` is refused.
// A test tool that measures wall time (latencies, deadlines): the clock ban of clippy.toml is
// for product code.
#![allow(clippy::disallowed_methods)]

#[path = "narwhal-dev/session.rs"]
mod session;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use futures_util::StreamExt;
use std::sync::{Arc, Mutex};

use narwhal_shared::documents::State;
use narwhal_shared::handoff::Handoff;
use narwhal_testkit::certs::make_dev_certs;
use narwhal_testkit::dev_ready::{DEV_FLEET_SCHEMA, DevAgent, DevEngine, DevReady, DevRouter};
use narwhal_testkit::sim_stats::SimStats;
use narwhal_testkit::{
    AgentHandle, Answer, DecisionRow, EngineSpec, FleetSpec, RouterHandle, SimHandle, bin_path,
    start_agent, start_router, start_sim,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(
    name = "narwhal-dev",
    version,
    about = "Run a local Narwhal fleet on loopback"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start simulated engines, one agent per simulated host, and a router; run until
    /// interrupted.
    Up(UpArgs),
    /// Start a fleet, send a scripted mix of requests, drain and restart engines, print what
    /// happened.
    Demo(DemoArgs),
    /// Make development certificates (fleet CA, router, standby, ctl, agents) with rcgen.
    Certs(CertsArgs),
    /// Restart one simulated engine of a running `narwhal-dev up` as a new process on the same
    /// port (what a supervisor's restart command does to a real engine).
    Restart(RestartArgs),
}

#[derive(clap::Args, Clone)]
struct UpArgs {
    /// Number of prefill engines.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Number of decode engines.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Engine dialect: vllm (NIXL descriptors) or sglang (bootstrap rendezvous).
    #[arg(long, default_value = "vllm", value_parser = ["vllm", "sglang"])]
    dialect: String,
    /// Simulated GPU hosts, one agent each; engines are spread over them round-robin.
    #[arg(long, default_value_t = 2)]
    hosts: usize,
    /// `recovery.engine_restart_policy` of the router.
    #[arg(long, default_value = "individual", value_parser = ["individual", "whole_wave"])]
    restart_policy: String,
    /// Directory for certificates, fleet file, logs, journal and state (created if missing).
    #[arg(long, default_value = "runs/dev")]
    dir: PathBuf,
    /// Write a JSON document naming every started process here (default DIR/fleet.ready.json).
    /// `narwhal-dev restart --dir DIR` finds the session through DIR/narwhal-dev.json either way.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Extra flags for every simulator, e.g. `--sim-arg=--tpot-ms --sim-arg=5`.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    sim_args: Vec<String>,
    /// Also start a warm standby router (file lease in DIR) that takes over if the primary dies.
    #[arg(long)]
    standby: bool,
    /// Leave the role controller off: no engine profiles in the fleet file, roles stay as
    /// started, and the simulators answer at once (no costs). By default the fleet runs it,
    /// with simulators that cost [`DEV_COSTS`], profiles that describe those costs, and the
    /// fast dev timings.
    #[arg(long)]
    no_controller: bool,
}

/// What every dev simulator costs, as `narwhal-engine-sim` flags: a prefill of `L` prompt
/// tokens it must compute takes 10 ms + 1 ms·L on one slot at a time (as one accelerator
/// computes one prefill after another; tokens found in its prefix cache are free), each
/// streamed token 10 ms. [`narwhal_testkit::fixture_profile`] (prefill
/// `0.001·L + 0.01` s, decode step `1e-6·T + 0.01` s) describes exactly this, so the role
/// controller prices the dev fleet's work as it really costs for prompts that share no prefix
/// (the demo's load sends such prompts). Applied only with the
/// controller on; `--sim-arg` flags come after these and override them (the profile then no
/// longer matches).
const DEV_COSTS: [&str; 8] = [
    "--ttft-ms",
    "10",
    "--prefill-us-per-token",
    "1000",
    "--tpot-ms",
    "10",
    "--prefill-slots",
    "1",
];

/// The fleet-file sections that turn the role controller on in a dev fleet: the kit's fast
/// timings (decisions every second, 12 s of demand evidence before a move, cooldown 2 s) and
/// one profile for every engine describing [`DEV_COSTS`]. Contexts up to 8192 tokens.
fn dev_controller_sections() -> Value {
    narwhal_testkit::fast_controller_sections()
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Dialects to tour, one fleet each.
    #[arg(long, default_value = "vllm,sglang", value_delimiter = ',')]
    dialect: Vec<String>,
    /// Requests to send per dialect (a mix of the four shapes).
    #[arg(long, default_value_t = 24)]
    requests: usize,
    /// Keep the fleet directory instead of a temporary one.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Skip the role-controller tour (a 1 prefill + 3 decode vLLM fleet under prefill
    /// pressure, until the controller flips an engine).
    #[arg(long)]
    no_controller: bool,
}

#[derive(clap::Args)]
struct CertsArgs {
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Agent ids to issue `agent-<id>` certificates for.
    #[arg(long, value_delimiter = ',', default_value = "host0,host1")]
    agents: Vec<String>,
    /// Router certificates (identity `spiffe://narwhal/router/<name>`): may fence agents and
    /// run their checks.
    #[arg(long, value_delimiter = ',', default_value = "router,standby")]
    routers: Vec<String>,
    /// Operator certificates (identity `spiffe://narwhal/operator/<name>`): narwhalctl,
    /// supervisors, Prometheus; may only read agents.
    #[arg(long, value_delimiter = ',', default_value = "ctl")]
    operators: Vec<String>,
}

#[derive(clap::Args)]
struct RestartArgs {
    /// Engine id (`p0`, `d0`, ...).
    iid: String,
    /// The `--dir` of the running `narwhal-dev up`.
    #[arg(long, default_value = "runs/dev")]
    dir: PathBuf,
}

/// Everything `up` started.
struct Fleet {
    // Field order is drop order: routers stop (gracefully, see `Drop`) before the engines.
    router: RouterHandle,
    /// The warm standby router, with `--standby`.
    standby: Option<RouterHandle>,
    sims: Vec<SimHandle>,
    agents: Vec<AgentHandle>,
    /// Agent id serving each engine.
    host_of: Vec<String>,
    dir: PathBuf,
    certs: PathBuf,
    dialect: String,
    /// `http://127.0.0.1:PORT` of this process's restart endpoint, once serving.
    dev_control: String,
    /// The lock on `dir`, held for the fleet's lifetime (dropped last, after every child).
    _lock: session::DirLock,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop_routers();
    }
}

impl Fleet {
    fn start(args: &UpArgs) -> Result<Self, String> {
        // Before anything is written into the directory: a running session keeps it.
        let lock = session::DirLock::acquire(&args.dir)?;
        let dir = args
            .dir
            .canonicalize()
            .map_err(|e| format!("{}: {e}", args.dir.display()))?;
        let hosts: Vec<String> = (0..args.hosts.max(1)).map(|h| format!("host{h}")).collect();
        let mut names = vec!["router", "standby", "ctl"];
        let agent_names: Vec<String> = hosts.iter().map(|h| format!("agent-{h}")).collect();
        names.extend(agent_names.iter().map(String::as_str));
        let certs_dir = dir.join("certs");
        let certs = make_dev_certs(&certs_dir, &names).map_err(|e| e.to_string())?;
        let mut extra: Vec<&str> = Vec::new();
        if !args.no_controller {
            // What the profiles describe; the controller's load shapes use prompts of hundreds
            // of tokens.
            extra.extend(DEV_COSTS);
            extra.extend(["--max-model-len", "8192"]);
        }
        extra.extend(args.sim_args.iter().map(String::as_str));
        let mut specs = Vec::new();
        for i in 0..args.prefill {
            specs.push(EngineSpec::new(&format!("p{i}"), "prefill").args(&extra));
        }
        for i in 0..args.decode {
            specs.push(EngineSpec::new(&format!("d{i}"), "decode").args(&extra));
        }
        let mut sims = Vec::new();
        for spec in &specs {
            sims.push(start_sim(&dir, spec, &args.dialect).map_err(|e| e.to_string())?);
        }
        let host_of: Vec<String> = (0..sims.len())
            .map(|i| hosts[i % hosts.len()].clone())
            .collect();
        let mut agents = Vec::new();
        for h in &hosts {
            let mine: Vec<&SimHandle> = sims
                .iter()
                .zip(&host_of)
                .filter(|(_, hh)| *hh == h)
                .map(|(s, _)| s)
                .collect();
            if mine.is_empty() {
                continue;
            }
            agents.push(start_agent(&dir, &certs, h, &mine).map_err(|e| e.to_string())?);
        }
        let mut fleet = FleetSpec::for_sims(&args.dialect, &sims)
            .tls(&certs, "router")
            .with(json!({"recovery": {"engine_restart_policy": args.restart_policy}}));
        if !args.no_controller {
            fleet = fleet.with(dev_controller_sections());
        }
        for (s, h) in sims.iter().zip(&host_of) {
            if let Some(a) = agents.iter().find(|a| &a.agent_id == h) {
                fleet = fleet.agent(&s.iid, a);
            }
        }
        let (router, standby) = if args.standby {
            // Two routers, one lease (file backend in DIR), each with its own state file.
            let lease = json!({"lease": {"backend": "file", "path": dir.join("router.lease.json"),
                                         "ttl_s": 2.0, "renew_interval_s": 0.5, "safety_margin_s": 0.5}});
            let primary = fleet
                .clone()
                .with(lease.clone())
                .with(json!({"recovery": {"state_path": dir.join("state-primary.json")}}));
            let router = start_router(&dir, "router", &primary, &["--router-id", "primary"])
                .map_err(|e| e.to_string())?;
            let secondary = fleet
                .with(lease)
                .with(json!({"recovery": {"state_path": dir.join("state-standby.json")}}));
            let standby = start_router(
                &dir,
                "standby",
                &secondary,
                &["--standby-of", &router.control, "--router-id", "standby"],
            )
            .map_err(|e| e.to_string())?;
            (router, Some(standby))
        } else {
            let router = start_router(&dir, "router", &fleet, &[]).map_err(|e| e.to_string())?;
            (router, None)
        };
        Ok(Fleet {
            router,
            standby,
            sims,
            agents,
            host_of,
            dir,
            certs: certs_dir,
            dialect: args.dialect.clone(),
            dev_control: String::new(),
            _lock: lock,
        })
    }

    fn ready_doc(&self) -> DevReady {
        DevReady {
            schema: DEV_FLEET_SCHEMA.into(),
            schema_version: 1,
            dir: self.dir.clone(),
            dialect: self.dialect.clone(),
            certs: self.certs.clone(),
            dev_control: self.dev_control.clone(),
            dev_pid: std::process::id(),
            router: DevRouter {
                data: self.router.data.clone(),
                control: self.router.control.clone(),
                pid: self.router.proc.pid(),
                fleet: self.router.fleet.clone(),
                journal: Some(self.router.journal.clone()),
            },
            standby: self.standby.as_ref().map(|r| DevRouter {
                data: r.data.clone(),
                control: r.control.clone(),
                pid: r.proc.pid(),
                fleet: r.fleet.clone(),
                journal: None,
            }),
            engines: self
                .sims
                .iter()
                .zip(&self.host_of)
                .map(|(s, h)| DevEngine {
                    iid: s.iid.clone(),
                    role: s.role.clone(),
                    url: s.url.clone(),
                    admin: s.admin.clone(),
                    pid: s.proc.pid(),
                    agent: h.clone(),
                })
                .collect(),
            agents: self
                .agents
                .iter()
                .map(|a| DevAgent {
                    id: a.agent_id.clone(),
                    url: a.url.clone(),
                    pid: a.proc.pid(),
                    public_key: a.public_key.clone(),
                })
                .collect(),
        }
    }

    /// Stops the routers gracefully (SIGTERM: open streams finish, the lease is released),
    /// before the engines and agents are killed by their own drops.
    /// Stops every process of the fleet now (routers first, gracefully), so nothing writes
    /// into its directory afterwards.
    fn stop_all(&mut self) {
        self.stop_routers();
        for a in &mut self.agents {
            a.proc.kill();
        }
        for s in &mut self.sims {
            s.proc.kill();
        }
    }

    fn stop_routers(&mut self) {
        for r in std::iter::once(&mut self.router).chain(self.standby.as_mut()) {
            r.proc.signal(nix::sys::signal::Signal::SIGTERM);
        }
        for r in std::iter::once(&mut self.router).chain(self.standby.as_mut()) {
            if r.proc.wait_exit(Duration::from_secs(40)).is_none() {
                r.proc.kill();
            }
        }
    }

    /// Restarts engine `iid` on its ports; returns the new pid.
    fn restart(&mut self, iid: &str) -> Result<u32, String> {
        let sim = self
            .sims
            .iter_mut()
            .find(|s| s.iid == iid)
            .ok_or_else(|| format!("no engine {iid:?} in this fleet"))?;
        sim.restart(&[]).map_err(|e| e.to_string())?;
        Ok(sim.proc.pid())
    }
}

type SharedFleet = Arc<Mutex<Fleet>>;

/// What `POST /restart/{iid}` answers: `{"iid", "pid"}` (200), or `{"error"}`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct RestartAnswer {
    /// The engine restarted.
    #[serde(skip_serializing_if = "Option::is_none")]
    iid: Option<String>,
    /// Its new process id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pid: Option<u32>,
    /// Why it was not restarted.
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl RestartAnswer {
    fn restarted(iid: String, pid: u32) -> Self {
        RestartAnswer {
            iid: Some(iid),
            pid: Some(pid),
            error: None,
        }
    }

    fn failed(error: String) -> Self {
        RestartAnswer {
            error: Some(error),
            ..RestartAnswer::default()
        }
    }
}

/// Serves `POST /restart/{iid}` on loopback for `narwhal-dev restart`.
async fn dev_control(fleet: SharedFleet, ready: PathBuf) -> std::io::Result<String> {
    use axum::extract::{Path as UrlPath, State};
    use axum::routing::post;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    async fn restart(
        State((fleet, ready)): State<(SharedFleet, PathBuf)>,
        UrlPath(iid): UrlPath<String>,
    ) -> (axum::http::StatusCode, axum::Json<RestartAnswer>) {
        let out = tokio::task::spawn_blocking(move || {
            let mut f = fleet.lock().unwrap_or_else(|p| p.into_inner());
            let r = f.restart(&iid);
            if r.is_ok() {
                let _ = write_atomically(&ready, &pretty(&f.ready_doc()));
            }
            r.map(|pid| (iid, pid))
        })
        .await;
        match out {
            Ok(Ok((iid, pid))) => (
                axum::http::StatusCode::OK,
                axum::Json(RestartAnswer::restarted(iid, pid)),
            ),
            Ok(Err(e)) => (
                axum::http::StatusCode::BAD_REQUEST,
                axum::Json(RestartAnswer::failed(e)),
            ),
            Err(e) => (
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(RestartAnswer::failed(e.to_string())),
            ),
        }
    }
    let app = axum::Router::new()
        .route("/restart/{iid}", post(restart))
        .with_state((fleet, ready));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(url)
}

/// Starts a fleet with its restart endpoint and writes the ready file.
async fn bring_up(args: &UpArgs) -> Result<(SharedFleet, PathBuf), String> {
    let a = args.clone();
    let fleet = tokio::task::spawn_blocking(move || Fleet::start(&a))
        .await
        .map_err(|e| e.to_string())??;
    let ready = args
        .ready_file
        .clone()
        .unwrap_or_else(|| fleet.dir.join("fleet.ready.json"));
    let fleet = Arc::new(Mutex::new(fleet));
    let url = dev_control(fleet.clone(), ready.clone())
        .await
        .map_err(|e| format!("dev control listener: {e}"))?;
    let (doc, dir) = {
        let mut f = fleet.lock().unwrap_or_else(|p| p.into_inner());
        f.dev_control = url.clone();
        (f.ready_doc(), f.dir.clone())
    };
    write_atomically(&ready, &pretty(&doc))
        .map_err(|e| format!("write {}: {e}", ready.display()))?;
    let session_path = dir.join(session::SESSION_FILE);
    write_atomically(
        &session_path,
        &format!("{:#}\n", session::session_doc(&dir, &url, &ready)),
    )
    .map_err(|e| format!("write {}: {e}", session_path.display()))?;
    Ok((fleet, ready))
}

/// `doc` as indented JSON and a newline, as the session's files are written.
fn pretty(doc: &impl Serialize) -> String {
    let text = serde_json::to_string_pretty(doc).expect("a document serialises");
    format!("{text}\n")
}

fn write_atomically(path: &Path, text: &str) -> Result<(), narwhal_shared::AtomicWriteError> {
    narwhal_shared::write_atomic(path, text.as_bytes())
}

fn certs(args: CertsArgs) -> ExitCode {
    use narwhal_testkit::certs::{DevRole, make_certs};
    let mut specs: Vec<(String, DevRole)> = Vec::new();
    specs.extend(args.routers.iter().map(|n| (n.clone(), DevRole::Router)));
    specs.extend(
        args.operators
            .iter()
            .map(|n| (n.clone(), DevRole::Operator)),
    );
    specs.extend(
        args.agents
            .iter()
            .map(|a| (format!("agent-{a}"), DevRole::Agent)),
    );
    let refs: Vec<(&str, DevRole)> = specs.iter().map(|(n, r)| (n.as_str(), *r)).collect();
    match make_certs(&args.out, &refs) {
        Ok(c) => {
            println!("fleet CA: {}", c.ca.display());
            for (n, role) in &refs {
                let identity = role.identity(n).map(|i| i.uri()).unwrap_or_default();
                println!(
                    "{n}: {} {} {identity}",
                    c.cert(n).display(),
                    c.key(n).display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("narwhal-dev certs: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn restart(args: RestartArgs) -> ExitCode {
    let control = match session::dev_control_of(&args.dir) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("narwhal-dev restart: {e}");
            return ExitCode::FAILURE;
        }
    };
    let http = narwhal_testkit::http_client()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("HTTP client");
    match http
        .post(format!("{control}/restart/{}", args.iid))
        .send()
        .await
    {
        Ok(r) => {
            let ok = r.status().is_success();
            let body: RestartAnswer = r.json().await.unwrap_or_default();
            if ok {
                let pid = body.pid.map_or_else(|| "?".to_string(), |p| p.to_string());
                println!("{}: restarted as pid {pid}", args.iid);
                ExitCode::SUCCESS
            } else {
                let error = body.error.as_deref().unwrap_or("no reason given");
                eprintln!("narwhal-dev restart: {error}");
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            let hint = if session::DirLock::is_held(&args.dir) {
                String::new()
            } else {
                format!(
                    " (no `narwhal-dev up --dir {}` is running any more)",
                    args.dir.display()
                )
            };
            eprintln!("narwhal-dev restart: {control}: {e}{hint}");
            ExitCode::FAILURE
        }
    }
}

async fn up(args: UpArgs) -> ExitCode {
    // Registered before anything starts: a SIGTERM during start-up (Ctrl-C forwarded by the
    // supervisor, or its death) is kept and stops the fleet once it is up, instead of killing
    // this process with its children half-started.
    let stop = match StopSignals::install() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("narwhal-dev up: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (fleet, ready) = match bring_up(&args).await {
        Ok(x) => x,
        Err(e) => {
            eprintln!("narwhal-dev up: {e}");
            return ExitCode::FAILURE;
        }
    };
    {
        let f = fleet.lock().unwrap_or_else(|p| p.into_inner());
        println!(
            "narwhal-dev up: router data={} control={}",
            f.router.data, f.router.control
        );
        for (s, h) in f.sims.iter().zip(&f.host_of) {
            println!(
                "  engine {:<4} {:<8} {}  pid {}  agent {h}",
                s.iid,
                s.role,
                s.url,
                s.proc.pid()
            );
        }
        for a in &f.agents {
            println!("  agent  {:<6} {}  pid {}", a.agent_id, a.url, a.proc.pid());
        }
        if let Some(s) = &f.standby {
            println!(
                "  standby router data={} control={}  pid {} (takes over if the primary dies)",
                s.data,
                s.control,
                s.proc.pid()
            );
        }
        if args.no_controller {
            println!("  role controller off (--no-controller)");
        } else {
            println!(
                "  role controller on: profiles describe the simulators' costs (prefill 10 ms + 1 ms per token, 10 ms per output token); decisions in the journal, /narwhal/state and /metrics"
            );
        }
        println!("  certificates in {}", f.certs.display());
        println!("  logs, journal and fleet file in {}", f.dir.display());
        println!("  ready file {}", ready.display());
        println!(
            "try:\n  curl -s {}/v1/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"tiny-sim\",\"prompt\":\"hello world\",\"max_tokens\":8}}'",
            f.router.data
        );
        println!("  curl -s {}/narwhal/lifecycle", f.router.control);
        println!(
            "  narwhalctl --router {} wave-restart --rolling --restart-cmd 'narwhal-dev restart {{iid}} --dir {}'",
            f.router.control,
            f.dir.display()
        );
        println!("Ctrl-C stops the fleet.");
    }
    stop.wait().await;
    println!("narwhal-dev up: stopping");
    drop(fleet);
    ExitCode::SUCCESS
}

/// SIGINT, SIGTERM and SIGHUP, registered at once so none is lost while the fleet starts.
struct StopSignals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> Result<Self, String> {
        use tokio::signal::unix::{SignalKind, signal};
        let mk = |k: SignalKind| signal(k).map_err(|e| format!("install signal handler: {e}"));
        Ok(StopSignals {
            int: mk(SignalKind::interrupt())?,
            term: mk(SignalKind::terminate())?,
            hup: mk(SignalKind::hangup())?,
        })
    }

    /// Resolves at the first of the three (also one that arrived since `install`).
    async fn wait(mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
            _ = self.hup.recv() => {}
        }
    }
}

/// One demo request's outcome.
struct Outcome {
    shape: &'static str,
    status: u16,
    tokens: usize,
    ok: bool,
    latency: Duration,
    note: String,
}

async fn send(http: &reqwest::Client, data: &str, i: usize) -> Outcome {
    let shapes = [
        ("completion", false),
        ("completion", true),
        ("chat", false),
        ("chat", true),
    ];
    let (kind, stream) = shapes[i % shapes.len()];
    let shape: &'static str = match (kind, stream) {
        ("completion", false) => "completion",
        ("completion", true) => "completion+sse",
        ("chat", false) => "chat",
        _ => "chat+sse",
    };
    let prompt = format!("demo request {i}: tell me about disaggregated serving");
    let (path, body) = narwhal_testkit::openai_request(kind == "chat", stream, &prompt, 8);
    let t0 = Instant::now();
    let resp = match http.post(format!("{data}{path}")).json(&body).send().await {
        Ok(r) => r,
        Err(e) => {
            return Outcome {
                shape,
                status: 0,
                tokens: 0,
                ok: false,
                latency: t0.elapsed(),
                note: e.to_string(),
            };
        }
    };
    let status = resp.status().as_u16();
    let (tokens, ok, note) = if !stream {
        let answer = resp.bytes().await.map_err(|e| e.to_string()).and_then(|b| {
            let a = serde_json::from_slice::<Answer>(&b).map_err(|e| e.to_string())?;
            Ok((a, String::from_utf8_lossy(&b).into_owned()))
        });
        match answer {
            Ok((a, text)) => {
                let n = a.usage().completion_tokens.unwrap_or(0) as usize;
                let ok = status == 200 && n > 0;
                (n, ok, if ok { String::new() } else { text })
            }
            Err(e) => (0, false, e),
        }
    } else {
        let mut body = resp.bytes_stream();
        let mut text = Vec::new();
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) => text.extend_from_slice(&c),
                Err(e) => {
                    return Outcome {
                        shape,
                        status,
                        tokens: 0,
                        ok: false,
                        latency: t0.elapsed(),
                        note: e.to_string(),
                    };
                }
            }
        }
        let text = String::from_utf8_lossy(&text);
        let frames: Vec<&str> = text
            .split("\n\n")
            .filter_map(|f| f.trim().strip_prefix("data: "))
            .collect();
        let done = frames.last() == Some(&"[DONE]");
        let errors = frames.iter().filter(|f| f.contains("\"error\"")).count();
        let n = frames
            .iter()
            .filter_map(|f| serde_json::from_str::<Answer>(f).ok())
            .filter(|a| {
                let Some(c) = a.choice(0) else {
                    return false;
                };
                let text = c
                    .text
                    .as_deref()
                    .or_else(|| c.delta.as_ref().and_then(|d| d.content.as_deref()));
                text.is_some_and(|t| !t.is_empty())
            })
            .count();
        let ok = status == 200 && done && errors == 0 && n > 0;
        (
            n,
            ok,
            if ok {
                String::new()
            } else {
                text.chars().take(300).collect()
            },
        )
    };
    Outcome {
        shape,
        status,
        tokens,
        ok,
        latency: t0.elapsed(),
        note,
    }
}

async fn demo(args: DemoArgs) -> ExitCode {
    let mut all_ok = true;
    let tmp = tempfile::Builder::new().prefix("narwhal-demo-").tempdir();
    let base = match (&args.dir, &tmp) {
        (Some(d), _) => d.clone(),
        (None, Ok(t)) => t.path().to_path_buf(),
        (None, Err(e)) => {
            eprintln!("narwhal-dev demo: temporary directory: {e}");
            return ExitCode::FAILURE;
        }
    };
    let http = narwhal_testkit::http_client().build().expect("HTTP client");
    for dialect in &args.dialect {
        match demo_dialect(&http, &args, &base, dialect).await {
            Ok(ok) => all_ok &= ok,
            Err(e) => {
                eprintln!("narwhal-dev demo: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if !args.no_controller {
        if args.dialect.iter().any(|d| d == "vllm") {
            all_ok &= controller_tour(&http, &base.join("controller")).await;
        } else {
            println!("\n(the role-controller tour runs on a vLLM fleet: add vllm to --dialect)");
        }
    }
    if all_ok {
        println!("\ndemo: every request served");
        if let Ok(t) = tmp {
            let path = t.path().to_path_buf();
            if let Err(e) = t.close() {
                eprintln!("narwhal-dev demo: removing {}: {e}", path.display());
            }
        }
        ExitCode::SUCCESS
    } else {
        println!(
            "\ndemo: some requests failed (logs under {})",
            base.display()
        );
        if let Ok(t) = tmp {
            let kept = t.keep();
            println!("kept {}", kept.display());
        }
        ExitCode::FAILURE
    }
}

/// The demo's tour of one `dialect` under `base`: a 1 prefill + 1 decode fleet with a
/// standby, its requests and KV statistics, the restarts, the failover. `Ok(false)` when
/// something failed (said on stdout); `Err` when the fleet did not come up.
async fn demo_dialect(
    http: &reqwest::Client,
    args: &DemoArgs,
    base: &Path,
    dialect: &str,
) -> Result<bool, String> {
    println!("\n=== {dialect}: 1 prefill + 1 decode engine, router in front ===");
    let up = UpArgs {
        prefill: 1,
        decode: 1,
        dialect: dialect.to_string(),
        hosts: 2,
        restart_policy: "individual".into(),
        dir: base.join(dialect),
        ready_file: None,
        sim_args: Vec::new(),
        standby: true,
        no_controller: false,
    };
    let (fleet, _ready) = bring_up(&up).await?;
    let (data, control, dir, engines) = {
        let f = fleet.lock().unwrap_or_else(|p| p.into_inner());
        let engines: Vec<(String, String, String)> = f
            .sims
            .iter()
            .map(|s| (s.iid.clone(), s.role.clone(), s.admin_url()))
            .collect();
        (
            f.router.data.clone(),
            f.router.control.clone(),
            f.dir.clone(),
            engines,
        )
    };
    println!("router data={data} control={control}; one agent per engine host, mutual TLS");
    let mut all_ok = demo_requests(http, &data, args.requests).await;
    all_ok &= demo_engine_stats(http, &engines, args.requests).await;
    if let Some(state) = router_state(http, &control).await {
        println!(
            "router /narwhal/state: offered={} served={} failed={} cancelled={} invalid={}",
            state.offered, state.served, state.failed, state.cancelled, state.invalid_requests
        );
    }
    all_ok &= demo_restarts(http, dialect, &data, &control, &dir).await;
    all_ok &= demo_failover(http, dialect, &fleet, &control, &dir).await;
    // The restart endpoint holds another handle on the fleet: stop its processes here,
    // before the demo's directory is removed, so no last state write races the removal.
    fleet.lock().unwrap_or_else(|p| p.into_inner()).stop_all();
    drop(fleet);
    Ok(all_ok)
}

/// The router's `/narwhal/state` on `control`; `None` when it answered no state document.
async fn router_state(http: &reqwest::Client, control: &str) -> Option<State> {
    let state = http
        .get(format!("{control}/narwhal/state"))
        .send()
        .await
        .ok()?
        .json::<State>()
        .await
        .ok()?;
    state.is_state().then_some(state)
}

/// Sends `requests` requests of every shape to `data` at once and prints a line per shape
/// and per failure; false when one failed.
async fn demo_requests(http: &reqwest::Client, data: &str, requests: usize) -> bool {
    let mut all_ok = true;
    let futs = (0..requests).map(|i| send(http, data, i));
    let outcomes = futures_util::future::join_all(futs).await;
    println!(
        "{:<16} {:>5} {:>7} {:>8} {:>10}",
        "shape", "sent", "served", "tokens", "p50 ms"
    );
    for shape in ["completion", "completion+sse", "chat", "chat+sse"] {
        let mine: Vec<&Outcome> = outcomes.iter().filter(|o| o.shape == shape).collect();
        let mut lat: Vec<f64> = mine.iter().map(|o| o.latency.as_secs_f64() * 1e3).collect();
        lat.sort_by(f64::total_cmp);
        let p50 = lat.get(lat.len() / 2).copied().unwrap_or(0.0);
        println!(
            "{:<16} {:>5} {:>7} {:>8} {:>10.1}",
            shape,
            mine.len(),
            mine.iter().filter(|o| o.ok).count(),
            mine.iter().map(|o| o.tokens).sum::<usize>(),
            p50
        );
    }
    for o in outcomes.iter().filter(|o| !o.ok) {
        all_ok = false;
        println!("FAILED {} status {}: {}", o.shape, o.status, o.note);
    }
    all_ok
}

/// Prints each engine's KV statistics (`(iid, role, admin URL)`); false when one is
/// unavailable or not every one of the `requests` decodes received its KV.
async fn demo_engine_stats(
    http: &reqwest::Client,
    engines: &[(String, String, String)],
    requests: usize,
) -> bool {
    let mut all_ok = true;
    println!("engine KV statistics (from each simulator's /sim/stats, on its admin listener):");
    println!(
        "{:<5} {:<8} {:>8} {:>7} {:>7} {:>9} {:>9} {:>11}",
        "iid", "role", "requests", "issued", "served", "consumed", "rejected", "recomputed"
    );
    let mut consumed = 0;
    let mut recomputed = 0;
    for (iid, role, admin) in engines {
        let stats = async {
            http.get(format!("{admin}/stats"))
                .send()
                .await?
                .json::<SimStats>()
                .await
        };
        match stats.await {
            Ok(st) => {
                let req = st.requests;
                let total = req.prefill + req.decode + req.aggregated;
                let kv = st.kv;
                consumed += kv.consumed;
                recomputed += kv.recomputed;
                println!(
                    "{:<5} {:<8} {:>8} {:>7} {:>7} {:>9} {:>9} {:>11}",
                    iid, role, total, kv.issued, kv.served, kv.consumed, kv.rejected, kv.recomputed
                );
            }
            Err(e) => {
                all_ok = false;
                println!("{iid:<5} stats unavailable: {e}");
            }
        }
    }
    if recomputed > 0 || consumed < requests as u64 {
        all_ok = false;
        println!(
            "FAILED: expected every decode to receive KV ({consumed} consumed, {recomputed} recomputed)"
        );
    }
    all_ok
}

/// Lifecycle tour through narwhalctl, the reference external supervisor: a rolling restart
/// (one engine at a time, the fleet keeps serving), then a whole-fleet wave, then requests to
/// `data`; false when a restart or a request failed.
async fn demo_restarts(
    http: &reqwest::Client,
    dialect: &str,
    data: &str,
    control: &str,
    dir: &Path,
) -> bool {
    let mut all_ok = true;
    // The binary beside this one (not current_exe(), which names a "(deleted)" file when
    // the binary was rebuilt while the demo runs).
    let dev = bin_path("narwhal-dev");
    let restart_cmd = format!("{} restart {{iid}} --dir {}", dev.display(), dir.display());
    for (title, extra) in [
        ("rolling restart, one engine at a time", vec!["--rolling"]),
        ("whole-fleet wave restart", vec![]),
    ] {
        println!("\n--- {dialect}: {title} (narwhalctl wave-restart) ---");
        let mut cmd = tokio::process::Command::new(bin_path("narwhalctl"));
        cmd.args(["--router", control, "wave-restart"])
            .args(&extra)
            .args(["--restart-cmd", &restart_cmd, "--timeout-s", "60"]);
        match cmd.status().await {
            Ok(st) if st.success() => {}
            Ok(st) => {
                all_ok = false;
                println!("FAILED: narwhalctl wave-restart exited with {st}");
            }
            Err(e) => {
                all_ok = false;
                println!("FAILED: cannot run narwhalctl: {e}");
            }
        }
    }
    let futs = (0..8).map(|i| send(http, data, i));
    let after = futures_util::future::join_all(futs).await;
    let served = after.iter().filter(|o| o.ok).count();
    println!(
        "after the restarts: {served}/{} requests served",
        after.len()
    );
    if served != after.len() {
        all_ok = false;
    }
    all_ok
}

/// Failover: SIGKILL the primary; the warm standby takes over once the lease lapses, and
/// serves. False when it did not take over or a request through it failed.
async fn demo_failover(
    http: &reqwest::Client,
    dialect: &str,
    fleet: &SharedFleet,
    control: &str,
    dir: &Path,
) -> bool {
    let mut all_ok = true;
    println!("\n--- {dialect}: failover (kill -9 the primary router) ---");
    // The standby applies the last handoff it retained: let it catch up with the primary
    // first (it writes what it retained to its own state file).
    let primary_served = router_state(http, control).await.map(|st| st.served);
    let retained = dir.join("state-standby.json");
    let in_sync = narwhal_testkit::wait_until(Duration::from_secs(10), || async {
        let doc = Handoff::parse(&std::fs::read_to_string(&retained).ok()?).ok()?;
        (doc.counters.get("served").copied() == primary_served && doc.lifecycle.wave_id.is_empty())
            .then_some(())
    })
    .await;
    if in_sync.is_none() {
        println!("note: the standby's retained handoff lags the primary");
    }
    let (standby_data, standby_control) = {
        let mut f = fleet.lock().unwrap_or_else(|p| p.into_inner());
        f.router.proc.kill();
        let s = f.standby.as_ref().expect("demo runs a standby");
        (s.data.clone(), s.control.clone())
    };
    let killed = Instant::now();
    let took_over = narwhal_testkit::wait_until(Duration::from_secs(20), || async {
        let r = http
            .get(format!("{standby_control}/ready"))
            .send()
            .await
            .ok()?;
        r.status().is_success().then_some(())
    })
    .await;
    match took_over {
        Some(()) => println!(
            "standby took over {:.2} s after the primary died (lease TTL 2 s)",
            killed.elapsed().as_secs_f64()
        ),
        None => {
            all_ok = false;
            println!("FAILED: the standby did not take over within 20 s");
        }
    }
    if let Some(st) = router_state(http, &standby_control).await {
        println!(
            "standby /narwhal/state: epoch={} served={} (continued from the primary's handoff)",
            st.ha.epoch, st.served
        );
    }
    let futs = (0..8).map(|i| send(http, &standby_data, i));
    let after = futures_util::future::join_all(futs).await;
    let served = after.iter().filter(|o| o.ok).count();
    println!(
        "through the new primary: {served}/{} requests served",
        after.len()
    );
    if served != after.len() {
        all_ok = false;
        for o in after.iter().filter(|o| !o.ok) {
            println!("FAILED {} status {}: {}", o.shape, o.status, o.note);
        }
    }
    all_ok
}

/// How long the controller tour waits for a flip and its role check (the fast timings decide
/// within about 15 s; a loaded two-core machine is slower).
const FLIP_WITHIN: Duration = Duration::from_secs(90);

/// The role-controller tour: a 1 prefill + 3 decode vLLM fleet (agents, mutual TLS) under a
/// demand shift to long prompts that one prefill engine cannot keep up with, until the
/// controller flips a decode engine to prefill and the flip's role check (the readmission
/// checks in the new role, through the lifecycle) passes. Prints each decision as it changes,
/// the flip, and the controller's counters from `/metrics`; false when no flip came or a
/// request failed.
async fn controller_tour(http: &reqwest::Client, dir: &Path) -> bool {
    println!("\n=== role controller: 1 prefill + 3 decode engines (vllm) ===");
    let up = UpArgs {
        prefill: 1,
        decode: 3,
        dialect: "vllm".into(),
        hosts: 2,
        restart_policy: "individual".into(),
        dir: dir.to_path_buf(),
        ready_file: None,
        sim_args: Vec::new(),
        standby: false,
        no_controller: false,
    };
    let (fleet, _ready) = match bring_up(&up).await {
        Ok(f) => f,
        Err(e) => {
            println!("FAILED: {e}");
            return false;
        }
    };
    let lock = || fleet.lock().unwrap_or_else(|p| p.into_inner());
    let control = lock().router.control.clone();
    let shape = narwhal_testkit::L1;
    println!(
        "profiles: prefill 10 ms + 1 ms per prompt token, 10 ms per output token (the simulators' own costs)"
    );
    println!(
        "demand shift: {} req/s of {}-token prompts, {} tokens each: about 1.02 engines of prefill work",
        shape.rate,
        shape.input,
        shape.max_tokens.unwrap_or(0)
    );
    let load = narwhal_testkit::Load::start(&lock().router, shape);
    let (flipped, checked) = watch_flip(&fleet).await;
    let stats = load.stop().await;
    let (sent, ok, failed) = (
        stats.sent.load(std::sync::atomic::Ordering::Relaxed),
        stats.ok.load(std::sync::atomic::Ordering::Relaxed),
        stats.failed.load(std::sync::atomic::Ordering::Relaxed),
    );
    println!("load: {sent} sent, {ok} served, {failed} failed (the rest were still running)");
    let mut good = failed == 0;
    if flipped.is_none() {
        println!("FAILED: the controller flipped no engine within {FLIP_WITHIN:?}");
        good = false;
    } else if !checked {
        println!("FAILED: the flipped engine's role check did not pass within {FLIP_WITHIN:?}");
        good = false;
    }
    good &= print_controller_state(http, &control).await;
    lock().stop_all();
    drop(fleet);
    good
}

/// Watches the router's decisions for up to [`FLIP_WITHIN`], printing each as it changes,
/// until a flip is applied and its role check passes: `(the applied decision, whether its
/// role check passed)`.
async fn watch_flip(fleet: &SharedFleet) -> (Option<DecisionRow>, bool) {
    let lock = || fleet.lock().unwrap_or_else(|p| p.into_inner());
    let t0 = Instant::now();
    let mut seen = 0;
    let mut last: (String, String) = Default::default();
    let mut flipped: Option<DecisionRow> = None;
    let mut checked = false;
    while t0.elapsed() < FLIP_WITHIN && !checked {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let (decisions, passed) = {
            let f = lock();
            (
                f.router.decision_rows(),
                f.router.event_rows("role_check_passed"),
            )
        };
        for d in decisions.iter().skip(seen) {
            let key = (d.result.clone(), d.reason.clone());
            let applied = d.result == "applied";
            if key != last || applied {
                println!(
                    "{:>5.1} s  {:<8} {}P/{}D  by {}: {}",
                    t0.elapsed().as_secs_f64(),
                    key.0,
                    d.prefill,
                    d.decode,
                    d.by,
                    key.1
                );
                if applied {
                    let decode_work = d.details.get("decode_work").and_then(Value::as_f64);
                    println!(
                        "         rule {}, prefill work {:.2} engines, decode work {:.2} engines, {:.1} s of demand evidence",
                        d.detail.eligibility_rule.as_deref().unwrap_or("?"),
                        d.detail.prefill_work.unwrap_or(f64::NAN),
                        decode_work.unwrap_or(f64::NAN),
                        d.detail.evidence_span_s.unwrap_or(f64::NAN)
                    );
                }
                last = key;
            }
            if applied && flipped.is_none() {
                flipped = Some(d.clone());
            }
        }
        seen = decisions.len();
        if let Some(p) = passed.first().filter(|_| flipped.is_some()) {
            println!(
                "{:>5.1} s  role check of {} passed in its new role (readmission checks through its agent)",
                t0.elapsed().as_secs_f64(),
                p.iid.as_deref().unwrap_or("?")
            );
            checked = true;
        }
    }
    (flipped, checked)
}

/// Prints the router's flips and pools (`/narwhal/state`) and the controller's counters
/// (`/metrics`); false when a counter family has no sample above 0.
async fn print_controller_state(http: &reqwest::Client, control: &str) -> bool {
    let mut good = true;
    if let Some(st) = router_state(http, control).await {
        let fields = st.controller.fields.as_ref();
        for f in fields.map(|c| c.flips.as_slice()).unwrap_or_default() {
            println!(
                "flip: {} to {} by {} ({} decode streams resident, kept on it to the end)",
                f.iid, f.to, f.by, f.decode_inflight
            );
        }
        let load = fields.map(|c| c.load).unwrap_or_default();
        println!(
            "pools now: prefill {} decode {}; load prefill {} decode {} (1.0 = at the SLO)",
            json!(st.pools.prefill),
            json!(st.pools.decode),
            json!(load.prefill),
            json!(load.decode)
        );
    }
    let metrics = async {
        http.get(format!("{control}/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()
    }
    .await
    .unwrap_or_default();
    println!("router /metrics:");
    for family in ["narwhal_flips_total", "narwhal_controller_decisions_total"] {
        let lines: Vec<&str> = metrics
            .lines()
            .filter(|l| l.starts_with(family) && !l.ends_with(" 0"))
            .collect();
        if lines.is_empty() {
            println!("FAILED: /metrics has no {family} sample above 0");
            good = false;
        }
        for l in lines {
            println!("  {l}");
        }
    }
    good
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::Up(_) | Cmd::Demo(_)) {
        match std::env::var(session::SUPERVISOR_ENV) {
            // The process the user started: supervise a fleet process running these arguments.
            Err(_) => return session::supervise(),
            Ok(sup) => {
                if let Err(e) = session::bind_to_supervisor(&sup) {
                    eprintln!("narwhal-dev: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(run(cli)),
        Err(e) => {
            eprintln!("narwhal-dev: tokio runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> ExitCode {
    match cli.cmd {
        Cmd::Up(a) => up(a).await,
        Cmd::Demo(a) => {
            let stop = match StopSignals::install() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("narwhal-dev demo: {e}");
                    return ExitCode::FAILURE;
                }
            };
            // Interrupted: dropping the demo drops its fleets, which stop their children.
            tokio::select! {
                code = demo(a) => code,
                () = stop.wait() => {
                    eprintln!("narwhal-dev demo: interrupted");
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::Certs(a) => certs(a),
        Cmd::Restart(a) => restart(a).await,
    }
}
