//! `narwhal-bench fleet-scale`: what the control plane costs as the fleet grows. For each
//! fleet size (`--engines`, default 4, 64, 256) and engines per agent (`--per-agent`,
//! default 8), it starts a vLLM P/D fleet (half prefill, half decode) with real agents (mutual
//! TLS, signed answers) and one router, and measures:
//!
//! ```text
//!  startup      router start to every process identity accepted (the startup identity check)
//!  requests     router CPU per request: utime + stime of /proc/<router pid>/stat over
//!               --requests non-streamed completions at --concurrency, offered at --rate
//!               per second, divided by them, the median of --rounds such windows (their
//!               spread beside it; every size's windows taken in turn, see below);
//!               also net of idle: less the idle CPU rate (below) times the window's
//!               duration, the background work that runs per engine and per second whether
//!               requests come or not (health probes of every engine, identity reads, the
//!               state file); p50 latency at concurrency 1 (placement and the rest of a
//!               request's work)
//!  idle         router CPU per second with no traffic (health probes, monitors, timers)
//!  documents    size (bytes) and median time of GET /metrics, /narwhal/state,
//!               /narwhal/lifecycle, /narwhal/handoff over --reads reads each
//!  lifecycle    drain POST of p0, its readmission after a restart (synchronous POST), then a
//!               whole-fleet wave: drain POST, restart every engine, the synchronous readmit,
//!               and the CPU seconds the router and the agents used during that readmit
//!  memory       RSS per engine of the simulators, the router's RSS, the agents' mean RSS
//!  peers        each --peer (a P/D router over every prefill and decode engine) over the
//!               same fleet: its CPU per request, p50 at concurrency 1 and RSS, measured as
//!               the router's, between the router's windows and its lifecycle steps
//!  standby      a warm standby started last (file lease of LEASE_TTL_S, polls every
//!               STANDBY_PROBE_S): the primary's and the standby's CPU per second while it
//!               shadows, then the takeover gap: kill -9 of the primary until the standby's
//!               /ready is 200 (its identity re-check of every engine included)
//! ```
//!
//! Engines: `p0` runs in a simulator process of its own, so that it can be restarted alone
//! for the one-engine readmission (a readmission requires a newer process start of that
//! engine); the others share one `narwhal-engine-sim --engines N` process
//! (docs/engine-simulator.md, "Many engines in one process"), which the wave restarts in
//! place. Prints one table (and with `--plots DIR` writes it as SVG charts against the fleet
//! size, `plots.rs`); asserts nothing about time (architecture.md section 8).
//!
//! For each `--per-agent` value every fleet size is started at once and their CPU windows
//! are taken in turn (round 1 of every size, then round 2, ...), so a shared machine's drift
//! reaches every size alike; then each size's other steps run, the smallest first, each fleet
//! stopped when its row is done (the largest runs its lifecycle steps alone). The windows are paced (`--rate`) so that each size serves the
//! same load: a router's CPU per request falls the busier it is (more events per wake-up), and
//! a larger simulated fleet answers slower, so unpaced windows compared the simulators too.
//!
//! Pinning (`--pin auto`), as in the comparison: the routers on the last CPU, born there so
//! that a router runs one Tokio worker, and the load generator and the simulators on the others,
//! so the router's CPU time holds neither cross-worker wake-ups nor the simulators' work on its
//! core (unpinned, windows of one build differed by a third); the agents on every CPU (a
//! whole-fleet wave readmission keeps them all busy).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use clap::Parser;
use narwhal_shared::documents::{Lifecycle, State};
use narwhal_shared::handoff::Handoff;
use narwhal_testkit::certs::{DevCerts, make_dev_certs};
use narwhal_testkit::{
    AgentEngine, AgentHandle, Clients, EngineSpec, FleetSpec, Http, LEASE_TTL_S, MultiSim,
    RouterHandle, STANDBY_PROBE_S, STANDBY_TAKEOVER_AFTER, SimHandle, launch_router,
    start_agent_for, start_sim,
};
use serde_json::{Value, json};

use crate::load::{Shot, drive, quantile};
use crate::peer::{Kind, PeerSpec};
use crate::plots::{Chart, Series, write_svg};
use crate::{MODEL, PeerEngines, Probe, first_answer, pin, procs, spawn_peer};

/// `narwhal-bench fleet-scale` flags.
#[derive(Debug, Parser)]
#[command(
    name = "narwhal-bench fleet-scale",
    about = "Control-plane cost as the fleet grows: router CPU per request, document sizes and times, lifecycle times, memory"
)]
struct Args {
    /// Fleet sizes (engines, at least 2: one prefill and one decode), comma-separated.
    #[arg(long, default_value = "4,64,256", value_delimiter = ',')]
    engines: Vec<usize>,
    /// Engines per agent, comma-separated; every fleet size runs with each.
    #[arg(long, default_value = "8", value_delimiter = ',')]
    per_agent: Vec<usize>,
    /// Requests of the CPU-per-request window.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Concurrent clients of the CPU-per-request window.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Requests of the concurrency-1 latency window.
    #[arg(long, default_value_t = 200)]
    latency_requests: usize,
    /// Reads of each document.
    #[arg(long, default_value_t = 20)]
    reads: usize,
    /// Seconds of the idle CPU window.
    #[arg(long, default_value_t = 3.0)]
    idle_s: f64,
    /// Requests per second offered in the CPU windows (0: as fast as `--concurrency` clients
    /// go). Paced, every fleet size (and every peer) serves the same load, so CPU per request
    /// is not also a measure of how busy the simulators kept the router: a router batches
    /// more events per wake-up the busier it is, and a larger simulated fleet answers slower.
    #[arg(long, default_value_t = 2000.0)]
    rate: f64,
    /// CPU-per-request windows per fleet size (each `--requests`): the table gives their
    /// median, and the spread of the windows beside it.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// `auto`: the routers (primary, standby, peers) on the last CPU, born there so that each
    /// runs one Tokio worker, and this process (the load generator) and the simulators on the
    /// others, as in the comparison; the agents on every CPU (a whole-fleet wave readmission
    /// keeps them all busy). `off`: nothing pinned.
    #[arg(long, default_value = "auto", value_parser = ["auto", "off"])]
    pin: String,
    /// Also write the results as SVG line charts against the fleet size into this directory
    /// (created): fleet-cpu-per-request.svg, fleet-lifecycle.svg, fleet-documents.svg,
    /// fleet-idle-cpu.svg, fleet-memory.svg.
    #[arg(long)]
    plots: Option<std::path::PathBuf>,
    /// A P/D peer router, `NAME=COMMAND` (placeholders as `narwhal-bench --peer`;
    /// `{prefill_urls}` and `{decode_urls}` list every prefill and decode engine), measured
    /// over the same fleet: CPU per request, p50 at concurrency 1, RSS. Repeatable.
    #[arg(long = "peer", value_name = "NAME=COMMAND")]
    peers: Vec<String>,
    /// Seconds a peer may take to answer its first request.
    #[arg(long, default_value_t = 120.0)]
    start_timeout: f64,
}

/// What a peer router costs over one fleet size.
#[derive(Debug, Clone, Default)]
struct PeerCost {
    name: String,
    cpu_us_per_req: f64,
    p50_c1_ms: f64,
    rss_mib: f64,
}

/// One row of the table.
#[derive(Debug, Default)]
struct Row {
    engines: usize,
    per_agent: usize,
    agents: usize,
    startup_s: f64,
    cpu_us_per_req: f64,
    /// `cpu_us_per_req` less the idle CPU rate over the window (never below 0).
    cpu_net_us_per_req: f64,
    /// The lowest and highest CPU per request of the `--rounds` windows, µs.
    cpu_spread: (f64, f64),
    /// The CPU window's duration, seconds.
    window_s: f64,
    p50_c1_ms: f64,
    idle_cpu_pct: f64,
    /// `(bytes, median ms)` of /metrics, /narwhal/state, /narwhal/lifecycle, /narwhal/handoff.
    docs: [(usize, f64); 4],
    drain_ms: f64,
    readmit_s: f64,
    wave_drain_ms: f64,
    wave_readmit_s: f64,
    /// CPU seconds the router and the agents (all together) used during the wave readmission.
    wave_cpu_s: (f64, f64),
    sim_kib_per_engine: f64,
    router_mib: f64,
    agent_mib: f64,
    /// The primary's CPU while a standby shadows it, percent of one core.
    polled_cpu_pct: f64,
    /// The standby's CPU while it shadows, percent of one core.
    standby_cpu_pct: f64,
    /// `kill -9` of the primary until the standby's `/ready` is 200, seconds.
    takeover_s: f64,
    /// The 1-minute load average when the row was measured.
    load: f64,
    /// Every `--peer` over the same fleet.
    peers: Vec<PeerCost>,
    failures: Vec<String>,
}

/// Runs the fleet-scale measurement; exit status 1 when a step failed, 2 on bad flags.
pub(crate) async fn main(argv: Vec<String>) -> std::process::ExitCode {
    let args = match Args::try_parse_from(argv) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return std::process::ExitCode::from(2);
        }
    };
    if args.engines.iter().any(|n| *n < 2) || args.per_agent.contains(&0) {
        eprintln!("narwhal-bench fleet-scale: --engines >= 2 and --per-agent >= 1");
        return std::process::ExitCode::from(2);
    }
    let mut peers = Vec::new();
    for spec in &args.peers {
        match PeerSpec::parse(spec) {
            Ok(p) if p.kind == Kind::Pd => peers.push(p),
            Ok(p) => {
                eprintln!(
                    "narwhal-bench fleet-scale: --peer {}: the fleet is P/D; a peer names {{prefill_urls}} and {{decode_urls}}",
                    p.name
                );
                return std::process::ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("narwhal-bench fleet-scale: {e}");
                return std::process::ExitCode::from(2);
            }
        }
    }
    if args.rounds == 0 {
        eprintln!("narwhal-bench fleet-scale: --rounds >= 1");
        return std::process::ExitCode::from(2);
    }
    // The routers on the last CPU, this process and the simulators on the others, the agents
    // on every CPU (a whole-fleet wave readmission keeps them all busy).
    let cpus = procs::own_cpus();
    let pinning = pin(&args.pin, &cpus, "narwhal-bench fleet-scale");
    let router_cpus = pinning.as_ref().map(|p| p.router.clone());
    let agent_cpus = pinning.as_ref().map(|_| cpus.clone());
    println!(
        "fleet-scale: {} x {} requests at concurrency {}, {}, {} at concurrency 1, {} reads per document; routers on CPUs {}; load average {:?}",
        args.rounds,
        args.requests,
        args.concurrency,
        if args.rate > 0.0 {
            format!("offered at {} per second", args.rate)
        } else {
            "unpaced".to_string()
        },
        args.latency_requests,
        args.reads,
        router_cpus
            .as_ref()
            .map_or_else(|| "any (not pinned)".to_string(), procs::cpu_list),
        procs::loadavg()
    );
    let cpus = Cpus {
        router: router_cpus.as_ref(),
        agents: agent_cpus.as_ref(),
    };
    let failed_row = |n: usize, e: usize, err: String| {
        eprintln!("fleet-scale {n} engines, {e} per agent: {err}");
        Row {
            engines: n,
            per_agent: e,
            failures: vec![err],
            ..Row::default()
        }
    };
    let mut rows = Vec::new();
    for &e in &args.per_agent {
        // Every fleet size of this agent count up at once, their CPU windows taken in turn
        // (round r of every size, then round r + 1): drift of a shared machine then reaches
        // every size alike instead of whichever ran in a slow minute.
        let mut ups = Vec::new();
        for &n in &args.engines {
            match start(&args, n, e, cpus).await {
                Ok(up) => ups.push(up),
                Err(err) => rows.push(failed_row(n, e, err)),
            }
        }
        for r in 0..args.rounds {
            for up in &mut ups {
                if let Err(err) = cpu_window(&args, up, r).await {
                    up.row.failures.push(err);
                }
            }
        }
        // The rest one size at a time, the smallest first: each fleet is stopped when its row
        // is done, so the largest, whose lifecycle steps cost the most, runs alone.
        ups.sort_by_key(|u| u.row.engines);
        for up in ups {
            let (n, e) = (up.row.engines, up.row.per_agent);
            match finish(&args, &peers, up, cpus.router).await {
                Ok(r) => rows.push(r),
                Err(err) => rows.push(failed_row(n, e, err)),
            }
        }
    }
    rows.sort_by_key(|r| (r.per_agent, r.engines));
    for (i, row) in rows.iter().enumerate() {
        print_row(row, i == 0);
    }
    if !peers.is_empty() {
        print_peers(&rows);
    }
    let mut failed: Vec<String> = rows.iter().flat_map(|r| r.failures.clone()).collect();
    if let Some(dir) = &args.plots {
        match write_plots(dir, &rows, &args.per_agent) {
            Ok(paths) => println!("plots: {}", paths.join(", ")),
            Err(e) => failed.push(format!("plots: {e}")),
        }
    }
    for f in &failed {
        eprintln!("fleet-scale: {f}");
    }
    if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

fn print_row(r: &Row, header: bool) {
    if header {
        println!(
            "| engines | per agent | agents | startup s | CPU µs/req | windows min-max | net of idle | p50 c=1 ms | idle CPU % | /metrics B, ms | state B, ms | lifecycle B, ms | handoff B, ms | drain POST ms | readmit s | wave drain ms | wave readmit s | wave CPU s router, agents | sim KiB/engine | router MiB | agent MiB | polled CPU % | standby CPU % | takeover s | load |"
        );
        println!("|{}", "---|".repeat(25));
    }
    let d = |(b, ms): (usize, f64)| format!("{b}, {ms:.2}");
    println!(
        "| {} | {} | {} | {:.2} | {:.0} | {:.0}-{:.0} | {:.0} | {:.2} | {:.1} | {} | {} | {} | {} | {:.1} | {:.3} | {:.1} | {:.2} | {:.2}, {:.2} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} |",
        r.engines,
        r.per_agent,
        r.agents,
        r.startup_s,
        r.cpu_us_per_req,
        r.cpu_spread.0,
        r.cpu_spread.1,
        r.cpu_net_us_per_req,
        r.p50_c1_ms,
        r.idle_cpu_pct,
        d(r.docs[0]),
        d(r.docs[1]),
        d(r.docs[2]),
        d(r.docs[3]),
        r.drain_ms,
        r.readmit_s,
        r.wave_drain_ms,
        r.wave_readmit_s,
        r.wave_cpu_s.0,
        r.wave_cpu_s.1,
        r.sim_kib_per_engine,
        r.router_mib,
        r.agent_mib,
        r.polled_cpu_pct,
        r.standby_cpu_pct,
        r.takeover_s,
        r.load,
    );
}

/// Our router's CPU per request, p50 at concurrency 1 and RSS beside every peer's, per fleet
/// size, with the ratio to ours.
fn print_peers(rows: &[Row]) {
    println!();
    println!(
        "| engines | per agent | router | CPU µs/req | x ours | CPU/req x its 1st size | p50 c=1 ms | RSS MiB |"
    );
    println!("|{}", "---|".repeat(8));
    let first = rows.first();
    for r in rows {
        let ours = PeerCost {
            name: "narwhal".into(),
            cpu_us_per_req: r.cpu_us_per_req,
            p50_c1_ms: r.p50_c1_ms,
            rss_mib: r.router_mib,
        };
        let base = |name: &str| -> f64 {
            first.map_or(f64::NAN, |f| {
                if name == "narwhal" {
                    f.cpu_us_per_req
                } else {
                    f.peers
                        .iter()
                        .find(|p| p.name == name)
                        .map_or(f64::NAN, |p| p.cpu_us_per_req)
                }
            })
        };
        for p in std::iter::once(&ours).chain(&r.peers) {
            println!(
                "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.1} |",
                r.engines,
                r.per_agent,
                p.name,
                p.cpu_us_per_req,
                p.cpu_us_per_req / ours.cpu_us_per_req,
                p.cpu_us_per_req / base(&p.name),
                p.p50_c1_ms,
                p.rss_mib,
            );
        }
    }
}

/// Starts peer `p` over the fleet (`prefill` and `decode` URLs), waits for its first answer,
/// and measures it as the router is measured: CPU per request over `--requests` at
/// `--concurrency` (after 200 warm-up requests), p50 at concurrency 1, RSS after both.
///
/// # Errors
/// A placeholder it cannot fill, a peer that cannot start or never answers.
async fn peer_cost(
    args: &Args,
    p: &PeerSpec,
    prefill: &[String],
    decode: &[String],
    dir: &std::path::Path,
    router_cpus: Option<&BTreeSet<usize>>,
) -> Result<PeerCost, String> {
    let engines = PeerEngines {
        prefill: prefill.to_vec(),
        decode: decode.to_vec(),
        bootstrap_port: None,
        agg: Vec::new(),
    };
    let (port, _, mut proc) = spawn_peer(p, &engines, dir, router_cpus)?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let probe = Probe::starting_now(8, false, Duration::from_secs(30), args.start_timeout);
    first_answer(&p.name, addr, Some(&mut proc), &probe).await?;
    let name = &p.name;
    let warm = drive(addr, MODEL, &shot(args.concurrency, 200), 0).await;
    if warm.errors > 0 {
        return Err(format!(
            "peer {name} warm-up: {} errors: {:?}",
            warm.errors, warm.first_error
        ));
    }
    let hz = procs::clock_ticks();
    let before = ticks(proc.pid);
    let s = drive(addr, MODEL, &window(args), 1000).await;
    let used = ticks(proc.pid).saturating_sub(before) as f64 / hz;
    if s.errors > 0 {
        return Err(format!(
            "peer {name} window: {} errors: {:?}",
            s.errors, s.first_error
        ));
    }
    let c1 = drive(addr, MODEL, &shot(1, args.latency_requests), 1_000_000).await;
    Ok(PeerCost {
        name: name.clone(),
        cpu_us_per_req: used / args.requests as f64 * 1e6,
        p50_c1_ms: quantile(&c1.latency_s, 0.5) * 1e3,
        rss_mib: rss_kib(proc.pid) / 1024.0,
    })
}

/// Where the processes of one fleet are started (`--pin`): `None` inherits this process's CPUs.
#[derive(Debug, Clone, Copy)]
struct Cpus<'a> {
    /// The primary, the standby and the peers.
    router: Option<&'a BTreeSet<usize>>,
    /// The agents.
    agents: Option<&'a BTreeSet<usize>>,
}

/// A CPU window: `--requests` completions ([`shot`]) at `--concurrency`, offered at `--rate`
/// per second when it is above 0.
fn window(args: &Args) -> Shot {
    Shot {
        rate: (args.rate > 0.0).then_some(args.rate),
        ..shot(args.concurrency, args.requests)
    }
}

/// A window of `requests` non-streamed 8-token completions at `concurrency`.
fn shot(concurrency: usize, requests: usize) -> Shot {
    Shot {
        concurrency,
        requests,
        tokens: 8,
        stream: false,
        timeout: Duration::from_secs(30),
        h2_streams: None,
        rate: None,
    }
}

fn addr_of(url: &str) -> Result<SocketAddr, String> {
    url.trim_start_matches("http://")
        .parse()
        .map_err(|e| format!("{url}: {e}"))
}

fn ticks(pid: u32) -> u64 {
    procs::tree_ticks(pid)
        .into_iter()
        .filter(|(p, _)| *p == pid)
        .map(|(_, t)| t)
        .sum()
}

fn rss_kib(pid: u32) -> f64 {
    procs::tree_memory_kib(pid).0 as f64
}

/// A POST of the control API, timed: `(status, seconds, body)`.
async fn post(http: &Http, url: String, body: &Value) -> (u16, f64, Value) {
    let t0 = Instant::now();
    let r = http.post(url, body).await;
    (
        r.status.as_u16(),
        t0.elapsed().as_secs_f64(),
        r.json_or_null(),
    )
}

/// Polls `GET /narwhal/lifecycle` until `ok` holds, for at most `within`.
async fn lifecycle_until(
    http: &Http,
    control: &str,
    within: Duration,
    ok: impl Fn(&Lifecycle) -> bool,
) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        let r = http.get(format!("{control}/narwhal/lifecycle")).await;
        let doc: Lifecycle = serde_json::from_slice(&r.body).unwrap_or_default();
        if doc.is_lifecycle() && ok(&doc) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "lifecycle not as expected within {within:?}: {}",
                r.text()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One fleet size up and serving: its simulators, agents and primary router, and its row so
/// far (startup, failures).
struct Up {
    row: Row,
    /// CPU µs per request and seconds of each window run so far.
    windows: Vec<(f64, f64)>,
    /// Every engine's URL and port, `p0` first.
    engines: Vec<(String, u16)>,
    p0: SimHandle,
    multi: MultiSim,
    agents: Vec<AgentHandle>,
    router: RouterHandle,
    spec: FleetSpec,
    certs: DevCerts,
    lease: Value,
    clients: Clients,
    /// Holds every file of the fleet; removed last.
    dir: tempfile::TempDir,
}

/// Router `label`'s fleet: `spec` with its TLS identity, the shared file `lease` and a state
/// file of its own in `dir`.
fn spec_for(
    spec: &FleetSpec,
    certs: &DevCerts,
    lease: &Value,
    dir: &Path,
    label: &str,
) -> FleetSpec {
    spec.clone().tls(certs, label).with(json!({
        "lease": lease,
        "recovery": {"state_path": dir.join(format!("{label}.state.json"))},
    }))
}

/// Starts fleet size `n` with `per_agent` engines per agent: simulators, agents, the primary
/// router (on `cpus.router`); waits for every process identity and for placement to hold
/// every engine, then warms it up.
async fn start(args: &Args, n: usize, per_agent: usize, cpus: Cpus<'_>) -> Result<Up, String> {
    let router_cpus = cpus.router;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let dirp = dir.path();
    let prefill = n / 2;
    let iids: Vec<(String, &str)> = (0..n)
        .map(|i| {
            if i < prefill {
                (format!("p{i}"), "prefill")
            } else {
                (format!("d{}", i - prefill), "decode")
            }
        })
        .collect();
    let hosts = n.div_ceil(per_agent);
    let mut names: Vec<String> = vec!["router".into(), "standby".into(), "operator".into()];
    names.extend((0..hosts).map(|h| format!("agent-h{h}")));
    let names_ref: Vec<&str> = names.iter().map(String::as_str).collect();
    let certs = make_dev_certs(&dirp.join("certs"), &names_ref).map_err(|e| e.to_string())?;
    // p0 alone (restarted alone), the others in one process.
    let p0: SimHandle = start_sim(dirp, &EngineSpec::new("p0", "prefill"), "vllm")
        .map_err(|e| format!("simulator p0: {e}"))?;
    let multi = MultiSim::start(dirp, "sims", "vllm", n - 1, &[])
        .map_err(|e| format!("simulators: {e}"))?;
    let urls = |p0: &SimHandle, multi: &MultiSim| -> Vec<(String, u16)> {
        std::iter::once((p0.url.clone(), p0.port))
            .chain(multi.engines.iter().map(|e| (e.url.clone(), e.port)))
            .collect()
    };
    let engines = urls(&p0, &multi);
    let mut agents: Vec<AgentHandle> = Vec::new();
    for h in 0..hosts {
        let mine: Vec<AgentEngine> = (h * per_agent..((h + 1) * per_agent).min(n))
            .map(|i| AgentEngine {
                iid: iids[i].0.clone(),
                url: engines[i].0.clone(),
                dialect: "vllm".into(),
                port: engines[i].1,
                kv_events: None,
            })
            .collect();
        let agent = procs::on_cpus(cpus.agents, || {
            start_agent_for(
                dirp,
                &certs,
                &format!("h{h}"),
                &mine,
                None,
                None,
                json!({"engine_s": 10, "generation_s": 30}),
            )
        })?;
        agents.push(agent.map_err(|e| format!("agent h{h}: {e}"))?);
    }
    let fleet_engines = iids
        .iter()
        .zip(&engines)
        .map(|((iid, role), (url, _))| (iid.clone(), url.clone(), role.to_string()))
        .collect();
    let mut spec = FleetSpec::new("vllm", fleet_engines);
    for (i, (iid, _)) in iids.iter().enumerate() {
        spec = spec.agent(iid, &agents[i / per_agent]);
    }
    // A file lease shared with the standby started last; each router its own state file.
    let lease = json!({"backend": "file", "path": dirp.join("router.lease"), "ttl_s": LEASE_TTL_S,
                       "renew_interval_s": 0.5, "safety_margin_s": 0.5});
    let spec_of = |label: &str| spec_for(&spec, &certs, &lease, dirp, label);
    let clients = Clients::identity(&certs, "operator");
    let http = clients.http.clone();
    let t0 = Instant::now();
    let router_spec = spec_of("router").to_json(dirp);
    let router: RouterHandle = procs::on_cpus(router_cpus, || {
        launch_router(
            dirp,
            "router",
            &router_spec,
            &["--router-id", "router"],
            clients.clone(),
        )
    })?
    .map_err(|e| format!("router: {e}"))?;
    let control = router.control.clone();
    let all: Vec<String> = iids.iter().map(|(i, _)| i.clone()).collect();
    lifecycle_until(&http, &control, Duration::from_secs(120), |d| {
        all.iter().all(|i| d.process_starts.contains_key(i))
    })
    .await?;
    let startup_s = t0.elapsed().as_secs_f64();
    let mut row = Row {
        engines: n,
        per_agent,
        agents: hosts,
        startup_s,
        ..Row::default()
    };
    let data = addr_of(&router.data)?;
    // Wait until placement has every engine (the health gate) before the windows.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s: Option<State> =
            serde_json::from_slice(&http.get(format!("{control}/narwhal/state")).await.body)
                .ok()
                .filter(State::is_state);
        let ready = s
            .as_ref()
            .is_some_and(|s| s.awaiting_health.is_empty() && s.ejected.is_empty());
        if ready || Instant::now() > deadline {
            if !ready {
                let (awaiting, ejected) = s
                    .map(|s| (json!(s.awaiting_health), json!(s.ejected)))
                    .unwrap_or_default();
                row.failures.push(format!(
                    "{n} engines: not all in placement: awaiting_health {awaiting}, ejected {ejected}"
                ));
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let warm = drive(data, "tiny-sim", &shot(args.concurrency, 200), 0).await;
    if warm.errors > 0 {
        row.failures.push(format!(
            "warm-up: {} errors: {:?}",
            warm.errors, warm.first_error
        ));
    }
    Ok(Up {
        row,
        windows: Vec::new(),
        engines,
        p0,
        multi,
        agents,
        router,
        spec,
        certs,
        lease,
        clients,
        dir,
    })
}

/// One CPU-per-request window of `--requests` on `up`'s router (`round` from 0): adds its
/// CPU per request and duration to `up.windows`, and its errors to the row's failures.
async fn cpu_window(args: &Args, up: &mut Up, round: usize) -> Result<(), String> {
    let pid = up.router.proc.pid();
    let data = addr_of(&up.router.data)?;
    let hz = procs::clock_ticks();
    let before = ticks(pid);
    let t_window = Instant::now();
    let s = drive(
        data,
        "tiny-sim",
        &window(args),
        1000 + round * args.requests,
    )
    .await;
    let window_s = t_window.elapsed().as_secs_f64();
    let used = ticks(pid).saturating_sub(before) as f64 / hz;
    up.windows
        .push((used / args.requests as f64 * 1e6, window_s));
    if s.errors > 0 {
        up.row.failures.push(format!(
            "window {}: {} errors: {:?}",
            round + 1,
            s.errors,
            s.first_error
        ));
    }
    Ok(())
}

/// The rest of a fleet's row once its CPU windows ran: their median, the latency at
/// concurrency 1, the peers, the idle CPU, the documents, memory, the lifecycle steps and the
/// standby's takeover; stops the fleet.
async fn finish(
    args: &Args,
    peers: &[PeerSpec],
    mut up: Up,
    router_cpus: Option<&BTreeSet<usize>>,
) -> Result<Row, String> {
    let n = up.row.engines;
    let hosts = up.row.agents;
    let mut windows = std::mem::take(&mut up.windows);
    let Up {
        mut row,
        engines,
        mut p0,
        mut multi,
        agents,
        mut router,
        spec,
        certs,
        lease,
        clients,
        dir,
        ..
    } = up;
    let dirp = dir.path();
    let http = clients.http.clone();
    let control = router.control.clone();
    let pid = router.proc.pid();
    let data = addr_of(&router.data)?;
    let hz = procs::clock_ticks();
    let spec_of = |label: &str| spec_for(&spec, &certs, &lease, dirp, label);
    if !windows.is_empty() {
        windows.sort_by(|a, b| a.0.total_cmp(&b.0));
        (row.cpu_us_per_req, row.window_s) = windows[windows.len() / 2];
        row.cpu_spread = (windows[0].0, windows[windows.len() - 1].0);
    }
    let c1 = drive(data, "tiny-sim", &shot(1, args.latency_requests), 1_000_000).await;
    row.p50_c1_ms = quantile(&c1.latency_s, 0.5) * 1e3;
    if !peers.is_empty() {
        let prefill: Vec<String> = engines[..n / 2].iter().map(|(u, _)| u.clone()).collect();
        let decode: Vec<String> = engines[n / 2..].iter().map(|(u, _)| u.clone()).collect();
        for p in peers {
            match peer_cost(args, p, &prefill, &decode, dirp, router_cpus).await {
                Ok(c) => row.peers.push(c),
                Err(e) => row.failures.push(format!("{n} engines: {e}")),
            }
        }
    }
    let before = ticks(pid);
    let t_idle = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(args.idle_s)).await;
    let used = ticks(pid).saturating_sub(before) as f64 / hz;
    row.idle_cpu_pct = used / t_idle.elapsed().as_secs_f64() * 100.0;
    let background_us = row.idle_cpu_pct / 100.0 * row.window_s * 1e6;
    row.cpu_net_us_per_req = (row.cpu_us_per_req - background_us / args.requests as f64).max(0.0);
    for (k, path) in [
        "/metrics",
        "/narwhal/state",
        "/narwhal/lifecycle",
        "/narwhal/handoff",
    ]
    .iter()
    .enumerate()
    {
        let mut times = Vec::new();
        let mut bytes = 0;
        for _ in 0..args.reads.max(1) {
            let t = Instant::now();
            let r = http.get(format!("{control}{path}")).await;
            times.push(t.elapsed().as_secs_f64());
            if r.status != 200 {
                row.failures.push(format!("GET {path}: {}", r.status));
            }
            bytes = r.body.len();
        }
        times.sort_by(f64::total_cmp);
        row.docs[k] = (bytes, quantile(&times, 0.5) * 1e3);
    }
    row.sim_kib_per_engine = (rss_kib(p0.proc.pid()) + rss_kib(multi.proc.pid())) / n as f64;
    row.router_mib = rss_kib(pid) / 1024.0;
    row.agent_mib =
        agents.iter().map(|a| rss_kib(a.proc.pid())).sum::<f64>() / 1024.0 / hosts as f64;

    // One engine: drain, restart, readmit.
    let lc = |a: &str| format!("{control}/narwhal/lifecycle/{a}");
    let (code, t, body) = post(
        &http,
        lc("drain"),
        &json!({"engines": ["p0"], "deadline_s": 30}),
    )
    .await;
    row.drain_ms = t * 1e3;
    if code != 200 {
        row.failures.push(format!("drain p0: {code} {body}"));
    }
    lifecycle_until(&http, &control, Duration::from_secs(60), |d| {
        d.engine("p0").is_some_and(|e| e.ready_to_stop)
    })
    .await?;
    p0.restart(&[]).map_err(|e| format!("restart p0: {e}"))?;
    let (code, t, body) = post(&http, lc("readmit"), &json!({"engines": ["p0"]})).await;
    row.readmit_s = t;
    if code != 200 {
        row.failures.push(format!("readmit p0: {code} {body}"));
    }
    // The whole fleet: wave drain, restart every engine, readmit the wave.
    let (code, t, body) = post(&http, lc("drain"), &json!({"wave": true, "deadline_s": 60})).await;
    row.wave_drain_ms = t * 1e3;
    if code != 200 {
        row.failures.push(format!("wave drain: {code} {body}"));
    }
    lifecycle_until(&http, &control, Duration::from_secs(120), |d| {
        d.wave.ready_to_stop
    })
    .await?;
    p0.restart(&[]).map_err(|e| format!("restart p0: {e}"))?;
    multi
        .restart()
        .map_err(|e| format!("restart the simulators: {e}"))?;
    let agent_ticks =
        |agents: &[AgentHandle]| -> u64 { agents.iter().map(|a| ticks(a.proc.pid())).sum() };
    let (router0, agents0) = (ticks(pid), agent_ticks(&agents));
    let (code, t, body) = post(&http, lc("readmit"), &json!({"wave": true})).await;
    row.wave_readmit_s = t;
    row.wave_cpu_s = (
        ticks(pid).saturating_sub(router0) as f64 / hz,
        agent_ticks(&agents).saturating_sub(agents0) as f64 / hz,
    );
    if code != 200 {
        let short: String = body.to_string().chars().take(400).collect();
        row.failures.push(format!("wave readmit: {code} {short}"));
    }
    standby_takeover(
        &mut row,
        dirp,
        &spec_of("standby"),
        &mut router,
        clients,
        args.idle_s,
        router_cpus,
    )
    .await?;
    row.load = procs::loadavg()[0];
    drop(router);
    drop(agents);
    Ok(row)
}

/// Starts a warm standby of `primary`, measures what its shadowing costs both routers over
/// `idle_s` seconds, then kills the primary (`SIGKILL`) and times the takeover: until the
/// standby's `/ready` is 200, which it answers once it holds the lease and has re-checked
/// every engine's process identity through the agents (docs/ha.md).
async fn standby_takeover(
    row: &mut Row,
    dir: &std::path::Path,
    spec: &FleetSpec,
    primary: &mut RouterHandle,
    clients: Clients,
    idle_s: f64,
    router_cpus: Option<&BTreeSet<usize>>,
) -> Result<(), String> {
    let probe = STANDBY_PROBE_S.to_string();
    let after = STANDBY_TAKEOVER_AFTER.to_string();
    let args = [
        "--router-id",
        "standby",
        "--standby-of",
        &primary.control,
        "--standby-probe-interval",
        &probe,
        "--standby-takeover-after",
        &after,
    ];
    let standby_spec = spec.to_json(dir);
    let standby = procs::on_cpus(router_cpus, || {
        launch_router(dir, "standby", &standby_spec, &args, clients)
    })?
    .map_err(|e| format!("standby: {e}"))?;
    // The standby has retained the primary's current handoff (its own state file).
    let ha = primary.ha().await;
    let state = dir.join("standby.state.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let doc = std::fs::read_to_string(&state)
            .ok()
            .and_then(|text| Handoff::parse(&text).ok());
        if doc.is_some_and(|h| h.epoch == ha.epoch && h.holder == ha.holder) {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the standby retained no handoff of epoch {} within 60 s:\n{}",
                ha.epoch,
                standby.proc.stderr_tail(20)
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let hz = procs::clock_ticks();
    let (p, s) = (primary.proc.pid(), standby.proc.pid());
    let (p0, s0, t0) = (ticks(p), ticks(s), Instant::now());
    tokio::time::sleep(Duration::from_secs_f64(idle_s)).await;
    let secs = t0.elapsed().as_secs_f64();
    row.polled_cpu_pct = ticks(p).saturating_sub(p0) as f64 / hz / secs * 100.0;
    row.standby_cpu_pct = ticks(s).saturating_sub(s0) as f64 / hz / secs * 100.0;
    let t_kill = Instant::now();
    primary.proc.kill();
    let within = Duration::from_secs_f64(LEASE_TTL_S + 60.0);
    match standby.wait_ready(t_kill, within).await {
        Some(gap) => row.takeover_s = gap.as_secs_f64(),
        None => {
            return Err(format!(
                "no takeover within {within:?}:\n{}",
                standby.proc.stderr_tail(20)
            ));
        }
    }
    Ok(())
}

/// The charts of `rows` against the fleet size, one line per metric and engines-per-agent
/// setting (a failed row is left out); the paths written.
fn write_plots(
    dir: &std::path::Path,
    rows: &[Row],
    per_agent: &[usize],
) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    type Metric = (&'static str, fn(&Row) -> f64);
    let lines = |metrics: &[Metric]| -> Vec<Series> {
        let mut out = Vec::new();
        for &e in per_agent {
            for (name, f) in metrics {
                let points = rows
                    .iter()
                    .filter(|r| r.per_agent == e)
                    .map(|r| {
                        let y = if r.failures.is_empty() {
                            f(r)
                        } else {
                            f64::NAN
                        };
                        (r.engines as f64, y)
                    })
                    .collect();
                let name = if per_agent.len() > 1 {
                    format!("{name}, {e} per agent")
                } else {
                    (*name).to_string()
                };
                out.push(Series { name, points });
            }
        }
        out
    };
    let chart = |title: &str, y: &str, metrics: &[Metric]| Chart {
        title: title.to_string(),
        x_label: "engines".to_string(),
        y_label: y.to_string(),
        series: lines(metrics),
    };
    let mut charts = [
        (
            "fleet-cpu-per-request.svg",
            chart(
                "Router CPU per request",
                "CPU µs per request",
                &[
                    ("narwhal (utime + stime / requests)", |r| r.cpu_us_per_req),
                    ("narwhal, net of idle CPU", |r| r.cpu_net_us_per_req),
                ],
            ),
        ),
        (
            "fleet-lifecycle.svg",
            chart(
                "Lifecycle and takeover times",
                "seconds",
                &[
                    ("startup identity check", |r| r.startup_s),
                    ("whole-fleet wave readmission", |r| r.wave_readmit_s),
                    ("takeover gap (lease TTL 2 s)", |r| r.takeover_s),
                ],
            ),
        ),
        (
            "fleet-documents.svg",
            chart(
                "Document read times (median)",
                "ms",
                &[
                    ("/metrics", |r| r.docs[0].1),
                    ("/narwhal/state", |r| r.docs[1].1),
                    ("/narwhal/lifecycle", |r| r.docs[2].1),
                    ("/narwhal/handoff", |r| r.docs[3].1),
                ],
            ),
        ),
        (
            "fleet-idle-cpu.svg",
            chart(
                "Router CPU with no traffic",
                "% of one core",
                &[
                    ("router, idle", |r| r.idle_cpu_pct),
                    ("primary polled by a standby", |r| r.polled_cpu_pct),
                    ("the standby", |r| r.standby_cpu_pct),
                ],
            ),
        ),
        (
            "fleet-memory.svg",
            chart(
                "Memory",
                "MiB (RSS)",
                &[
                    ("narwhal router", |r| r.router_mib),
                    ("one agent (mean)", |r| r.agent_mib),
                ],
            ),
        ),
    ];
    // Each peer's line on the CPU and memory charts (one per --per-agent value: the peer
    // itself does not use the agents).
    let mut names: Vec<&str> = Vec::new();
    for p in rows.iter().flat_map(|r| &r.peers) {
        if !names.contains(&p.name.as_str()) {
            names.push(&p.name);
        }
    }
    for name in names {
        for &e in per_agent {
            let of = |f: fn(&PeerCost) -> f64| -> Vec<(f64, f64)> {
                rows.iter()
                    .filter(|r| r.per_agent == e)
                    .map(|r| {
                        let y = r.peers.iter().find(|p| p.name == name).map_or(f64::NAN, f);
                        (r.engines as f64, y)
                    })
                    .collect()
            };
            let label = if per_agent.len() > 1 {
                format!("{name}, {e} per agent")
            } else {
                name.to_string()
            };
            charts[0].1.series.push(Series {
                name: label.clone(),
                points: of(|p| p.cpu_us_per_req),
            });
            charts[4].1.series.push(Series {
                name: label,
                points: of(|p| p.rss_mib),
            });
        }
    }
    let mut written = Vec::new();
    for (file, c) in &charts {
        let path = dir.join(file);
        write_svg(&path, c)?;
        written.push(path.display().to_string());
    }
    Ok(written)
}
