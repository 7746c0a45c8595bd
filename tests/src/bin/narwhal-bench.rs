//! `narwhal-bench`: our router against direct traffic and against peer routers, in one run.
//!
//! It starts the simulators once (one aggregated vLLM engine; one prefill and one decode engine
//! of `--dialect`), our router twice (P/D over the prefill/decode pair; aggregated over the lone
//! engine) and every `--peer NAME=COMMAND` (a P/D or aggregated peer, by the engine
//! placeholders its command names: `peer.rs`), checks that every target answers the same text
//! as the engine itself, then measures them interleaved over `--rounds` rounds (the order
//! rotates each round), streaming and not:
//!
//! - `--compare` (the default): `--concurrency` clients, `--requests` per window: requests per
//!   second, p50/p99 latency, time to first byte, p50 added over direct, router CPU per request
//!   (user + system time of the router's process tree over the window, from `/proc/<pid>/stat`,
//!   divided by the completed requests), RSS and peak RSS (`VmRSS`, `VmHWM`), the throughput
//!   ratio to direct and to each peer (medians of per-round ratios), and for P/D targets what
//!   the engines counted (every decode leg must consume its transferred KV).
//! - `--latency`: the same at concurrency 1 (`--latency-requests` per window), where the column
//!   to read is the p50 added over direct.
//!
//! When the machine has two CPUs or more (`--pin auto`), the routers run on the last one and
//! the simulators and the load generator on the others, so a router's throughput is what one
//! core of it gives. Output: a table per section on stdout, and with `--json PATH` a JSON
//! document (`-`: to stdout, the tables then go to stderr). Exits 1 when a request failed or a
//! P/D target did not transfer KV; 2 on bad arguments. Absolute numbers on a shared machine are
//! not stable; the ratios are the result. It asserts nothing about time (architecture.md section
//! 8); docs/benchmarks.md tells how to run it against vllm-router.
//!
//! Subcommands in their own modules: `narwhal-bench profile` (an engine's profile for the
//! fleet file), `narwhal-bench shifting` (fixed split vs role controller under shifting
//! demand), `narwhal-bench prefix` (a shared-prefix workload: cache hit rate against an
//! offline oracle, TTFT and SLO attainment per router, and the hit rate across a takeover) and
//! `narwhal-bench fleet-scale` (control-plane cost at 4, 64 and 256 engines),
//! `narwhal-bench concurrency` (router cost at 1,000 to 10,000 concurrent streams) and
//! `narwhal-bench tokenizer` (the router's own tokenizer against an engine's `/tokenize`).
// A benchmark measures wall time: the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

/// jemalloc, as the router: under `narwhal-bench` the simulators and the load generator share
/// one CPU, and the system allocator was a tenth of a simulator's CPU (docs/benchmarks.md).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

// The modules live in `narwhal-bench/` beside this file (a crate root resolves `mod` in its own
// directory, hence the paths).
#[path = "narwhal-bench/concurrency.rs"]
mod concurrency;
#[path = "narwhal-bench/fleet_scale.rs"]
mod fleet_scale;
#[path = "narwhal-bench/load.rs"]
mod load;
#[path = "narwhal-bench/peer.rs"]
mod peer;
#[path = "narwhal-bench/plots.rs"]
mod plots;
#[path = "narwhal-bench/procs.rs"]
mod procs;
#[path = "narwhal-bench/report.rs"]
mod report;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
#[path = "narwhal-bench/prefix.rs"]
mod prefix;
#[path = "narwhal-bench/prefix_trace.rs"]
mod prefix_trace;
#[path = "narwhal-bench/profile.rs"]
mod profile;
#[path = "narwhal-bench/shifting.rs"]
mod shifting;
#[path = "narwhal-bench/tokenizer.rs"]
mod tokenizer;
use narwhal_testkit::sim_stats::SimStats;
use narwhal_testkit::{
    EngineSpec, FleetSpec, RouterHandle, SimHandle, engine_port, start_router, start_sim,
};
use serde_json::{Value, json};

use crate::load::Shot;
use crate::peer::{Kind, PeerProc, PeerSpec};
use crate::report::{EngineCounts, Section, TargetRun, Window};

/// The model every simulator serves and every request names.
const MODEL: &str = "tiny-sim";

#[derive(Parser, Debug)]
#[command(
    name = "narwhal-bench",
    version,
    about = "Our router against direct traffic and peer routers: throughput, latency, CPU and memory, as ratios",
    after_help = "Modes (each has its own --help: narwhal-bench MODE --help):\n  \
        (none)        the comparison above: --compare (default) and --latency\n  \
        prefix        a shared-prefix workload: cache hit rate, TTFT and SLO attainment per router\n  \
        fleet-scale   control-plane cost at 4, 64 and 256 engines\n  \
        concurrency   router cost at 1,000 to 10,000 concurrent streams\n  \
        shifting      fixed prefill/decode split against the role controller under shifting demand\n  \
        profile       an engine's profile for the fleet file\n  \
        tokenizer     the router's own tokenizer against an engine's /tokenize\n\n\
        docs/benchmarks.md says how each is run and what it measured."
)]
struct Args {
    /// Throughput comparison at --concurrency (the default when neither mode is given).
    #[arg(long)]
    compare: bool,
    /// Latency comparison at concurrency 1: p50 added over direct.
    #[arg(long)]
    latency: bool,
    /// Concurrent clients of the throughput comparison.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Requests per measured window of the throughput comparison.
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// Requests per measured window of the latency comparison.
    #[arg(long, default_value_t = 1000)]
    latency_requests: usize,
    /// Warm-up requests per target before a section's first round (default: a tenth of the
    /// window, at least the concurrency).
    #[arg(long)]
    warmup: Option<usize>,
    /// Output tokens per request (`max_tokens`).
    #[arg(long, default_value_t = 16)]
    tokens: u32,
    /// Streamed requests (`true`), JSON answers (`false`), or a section of each (`both`).
    #[arg(long, default_value = "both", value_parser = ["true", "false", "both"])]
    stream: String,
    /// Measured rounds; each round measures every target once, in a rotating order.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Dialect of the P/D engine pair (the aggregated engine is always vLLM).
    #[arg(long, default_value = "vllm", value_parser = ["vllm", "sglang"])]
    dialect: String,
    /// Worker threads of each simulator.
    #[arg(long, default_value_t = 1)]
    sim_threads: usize,
    /// A peer router, `NAME=COMMAND` with placeholders ({port}, {prefill_url}, {decode_url},
    /// {engine_url}, ...: docs/benchmarks.md). Repeatable.
    #[arg(long = "peer", value_name = "NAME=COMMAND")]
    peers: Vec<String>,
    /// `auto`: routers on the last CPU, simulators and load generator on the others (when
    /// there are two or more); `off`: no pinning.
    #[arg(long, default_value = "auto", value_parser = ["auto", "off"])]
    pin: String,
    /// Seconds a target (a peer above all) may take to answer its first request.
    #[arg(long, default_value_t = 120.0)]
    start_timeout: f64,
    /// Seconds a request may take before it counts as failed.
    #[arg(long, default_value_t = 30.0)]
    request_timeout: f64,
    /// Also write the results as JSON to this file (`-`: stdout; the tables go to stderr).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Where the routers and the rest run.
#[derive(Debug, Clone)]
struct Pinning {
    router: BTreeSet<usize>,
    load: BTreeSet<usize>,
}

/// One thing the load is sent to.
struct Target {
    name: String,
    kind: Kind,
    peer: bool,
    addr: SocketAddr,
    /// The router's process (none for direct).
    pid: Option<u32>,
    /// The peer's rendered command.
    command: Option<String>,
}

fn addr_of(url: &str) -> Result<SocketAddr, String> {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .map_err(|e| format!("{url}: not http://IP:PORT ({e})"))
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if let Some(code) = subcommand(&argv) {
        return code;
    }
    let args = Args::parse();
    let mut bad = Vec::new();
    for (name, v) in [
        ("--concurrency", args.concurrency),
        ("--requests", args.requests),
        ("--latency-requests", args.latency_requests),
        ("--rounds", args.rounds),
        ("--sim-threads", args.sim_threads),
    ] {
        if v == 0 {
            bad.push(format!("{name} must be at least 1"));
        }
    }
    if args.tokens == 0 {
        bad.push("--tokens must be at least 1".into());
    }
    for (name, v) in [
        ("--start-timeout", args.start_timeout),
        ("--request-timeout", args.request_timeout),
    ] {
        if !(v.is_finite() && v > 0.0) {
            bad.push(format!("{name} must be a positive number of seconds"));
        }
    }
    let mut peers = Vec::new();
    for spec in &args.peers {
        match PeerSpec::parse(spec) {
            Ok(p) if peers.iter().any(|q: &PeerSpec| q.name == p.name) => {
                bad.push(format!("--peer {}: the name is given twice", p.name));
            }
            Ok(p) => peers.push(p),
            Err(e) => bad.push(e),
        }
    }
    if !bad.is_empty() {
        for b in bad {
            eprintln!("narwhal-bench: {b}");
        }
        return ExitCode::from(2);
    }

    // Pin this process (and so the simulators it starts) before any thread exists.
    let cpus = procs::own_cpus();
    let pinning = pin(&args.pin, &cpus, "narwhal-bench");
    let rt = match &pinning {
        Some(p) if p.load.len() == 1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        _ => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build(),
    };
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("narwhal-bench: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&args, &peers, cpus.len(), pinning)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("narwhal-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The simulators every target is served by.
struct Engines {
    agg: SimHandle,
    prefill: SimHandle,
    decode: SimHandle,
}

impl Engines {
    /// `/sim/stats` of the engines behind a target of `kind`, in order.
    async fn stats(&self, kind: Kind) -> Vec<SimStats> {
        match kind {
            Kind::Pd => vec![self.prefill.counters().await, self.decode.counters().await],
            Kind::Agg | Kind::Direct => vec![self.agg.counters().await],
        }
    }
}

/// What the engines of a `kind` target counted between two [`Engines::stats`] readings.
fn engine_counts(kind: Kind, before: &[SimStats], after: &[SimStats]) -> EngineCounts {
    let d = |i: usize, count: fn(&SimStats) -> u64| {
        let get = |v: &[SimStats]| v.get(i).map_or(0, count);
        get(after).saturating_sub(get(before))
    };
    let sum = |count: fn(&SimStats) -> u64| (0..after.len()).map(|i| d(i, count)).sum::<u64>();
    match kind {
        Kind::Pd => EngineCounts {
            prefill: d(0, |s| s.requests.prefill),
            decode: d(1, |s| s.requests.decode),
            aggregated: sum(|s| s.requests.aggregated),
            issued: d(0, |s| s.kv.issued),
            consumed: d(1, |s| s.kv.consumed),
            recomputed: sum(|s| s.kv.recomputed),
            rejected: sum(|s| s.kv.rejected),
        },
        Kind::Agg | Kind::Direct => EngineCounts {
            aggregated: sum(|s| s.requests.aggregated),
            recomputed: sum(|s| s.kv.recomputed),
            rejected: sum(|s| s.kv.rejected),
            ..Default::default()
        },
    }
}

/// Where the human tables go: stdout, or stderr when the JSON goes to stdout.
fn say(json_to_stdout: bool, text: &str) {
    if json_to_stdout {
        eprint!("{text}");
    } else {
        print!("{text}");
        let _ = std::io::stdout().flush();
    }
}

/// `narwhal-bench profile ...`, `shifting ...` and `prefix ...` (their own modules) on a
/// two-worker runtime; `None` for anything else (the comparison).
fn subcommand(argv: &[String]) -> Option<ExitCode> {
    let which = argv.get(1).map(String::as_str)?;
    if !matches!(
        which,
        "profile" | "shifting" | "prefix" | "fleet-scale" | "concurrency" | "tokenizer"
    ) {
        return None;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build();
    let rt = match rt {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("narwhal-bench: cannot start the runtime: {e}");
            return Some(ExitCode::FAILURE);
        }
    };
    let rest = argv[1..].to_vec();
    Some(rt.block_on(async move {
        match which {
            "profile" => profile::main(rest).await,
            "prefix" => prefix::main(rest).await,
            "fleet-scale" => fleet_scale::main(rest).await,
            "concurrency" => concurrency::main(rest).await,
            "tokenizer" => tokenizer::main(rest).await,
            _ => shifting::main(rest).await,
        }
    }))
}

/// Starts everything, measures, prints; `Ok(false)` when a request failed or a P/D target did
/// not transfer KV. `cpus`: how many CPUs this process could use before pinning.
async fn run(
    args: &Args,
    peers: &[PeerSpec],
    cpus: usize,
    pinning: Option<Pinning>,
) -> Result<bool, String> {
    let json_stdout = args.json.as_deref() == Some(std::path::Path::new("-"));
    let loadavg_start = procs::loadavg();
    let started = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("narwhal-bench-")
        .tempdir()
        .map_err(|e| format!("temporary directory: {e}"))?;
    let router_cpus = pinning.as_ref().map(|p| &p.router);

    // The engines, on this process's CPUs.
    let engines = start_engines(args, dir.path())?;

    // Our router twice, on the router CPUs.
    let pd_fleet = fleet(&args.dialect, &[&engines.prefill, &engines.decode]);
    let agg_fleet = fleet("vllm", &[&engines.agg]);
    let launch = |label: &str, fleet: &FleetSpec| {
        procs::on_cpus(router_cpus, || {
            start_router(dir.path(), label, fleet, &["--log-level", "warn"])
        })?
        .map_err(|e| format!("router {label}: {e}"))
    };
    let ours_pd: RouterHandle = launch("ours-pd", &pd_fleet)?;
    let ours_agg: RouterHandle = launch("ours-agg", &agg_fleet)?;
    let mut targets = own_targets(&engines, &ours_pd, &ours_agg)?;

    // The peers, on the router CPUs.
    let mut peer_procs = start_peers(peers, &engines, dir.path(), router_cpus, &mut targets)?;

    // Every target answers, and answers what the engine itself answers.
    let timeout = Duration::from_secs_f64(args.request_timeout);
    check_answers(args, &targets, &mut peer_procs, timeout).await?;

    // Header.
    let (head, target_json) = header(
        args,
        cpus,
        pinning.as_ref(),
        loadavg_start,
        &engines,
        &targets,
    );
    say(json_stdout, &head);

    // The sections.
    let plan = section_plan(args);
    let clk = procs::clock_ticks();
    let mut next_prompt = 0usize;
    let mut sections = Vec::new();
    for planned in plan {
        let section = measure_section(
            args,
            &targets,
            &engines,
            planned,
            timeout,
            clk,
            &mut next_prompt,
        )
        .await;
        say(json_stdout, &section.table());
        sections.push(section);
    }
    let loadavg_end = procs::loadavg();
    say(
        json_stdout,
        &format!(
            "{}\nload average at end {:.2} {:.2} {:.2}; {:.0} s\n",
            report::goals(&sections),
            loadavg_end[0],
            loadavg_end[1],
            loadavg_end[2],
            started.elapsed().as_secs_f64()
        ),
    );
    let problems: usize = sections.iter().map(Section::problems).sum();
    if let Some(path) = &args.json {
        let doc = json!({
            "schema": "narwhal.bench.compare",
            "version": 1,
            "config": {
                "concurrency": args.concurrency, "requests": args.requests,
                "latency_requests": args.latency_requests, "tokens": args.tokens,
                "rounds": args.rounds, "dialect": args.dialect, "sim_threads": args.sim_threads,
                "stream": args.stream,
            },
            "pinning": pinning.as_ref().map(|p| json!({
                "router_cpus": procs::cpu_list(&p.router), "load_cpus": procs::cpu_list(&p.load),
            })),
            "clock_ticks_per_s": clk,
            "loadavg": {"start": loadavg_start, "end": loadavg_end},
            "targets": target_json,
            "sections": sections.iter().map(Section::to_json).collect::<Vec<_>>(),
            "problems": problems,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        if json_stdout {
            println!("{text}");
        } else {
            std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    drop(peer_procs);
    Ok(problems == 0)
}

/// The comparison's simulators, on this process's CPUs: the aggregated vLLM engine and the
/// prefill/decode pair of `--dialect`.
fn start_engines(args: &Args, dir: &std::path::Path) -> Result<Engines, String> {
    let threads = args.sim_threads.to_string();
    let sim_args = ["--threads", threads.as_str()];
    let start = |iid: &str, role: &str, dialect: &str| {
        start_sim(dir, &EngineSpec::new(iid, role).args(&sim_args), dialect)
            .map_err(|e| format!("simulator {iid}: {e}"))
    };
    Ok(Engines {
        agg: start("e0", "decode", "vllm")?,
        prefill: start("p0", "prefill", &args.dialect)?,
        decode: start("d0", "decode", &args.dialect)?,
    })
}

/// The targets that are not peers: the aggregated engine itself, then our two routers.
fn own_targets(
    engines: &Engines,
    ours_pd: &RouterHandle,
    ours_agg: &RouterHandle,
) -> Result<Vec<Target>, String> {
    Ok(vec![
        Target {
            name: "direct".into(),
            kind: Kind::Direct,
            peer: false,
            addr: addr_of(&engines.agg.url)?,
            pid: None,
            command: None,
        },
        Target {
            name: "ours-pd".into(),
            kind: Kind::Pd,
            peer: false,
            addr: addr_of(&ours_pd.data)?,
            pid: Some(ours_pd.proc.pid()),
            command: None,
        },
        Target {
            name: "ours-agg".into(),
            kind: Kind::Agg,
            peer: false,
            addr: addr_of(&ours_agg.data)?,
            pid: Some(ours_agg.proc.pid()),
            command: None,
        },
    ])
}

/// Starts every peer on `router_cpus` and appends it to `targets`: the processes, by name.
fn start_peers(
    peers: &[PeerSpec],
    engines: &Engines,
    dir: &std::path::Path,
    router_cpus: Option<&BTreeSet<usize>>,
    targets: &mut Vec<Target>,
) -> Result<Vec<(String, PeerProc)>, String> {
    let mut peer_procs = Vec::new();
    for p in peers {
        let (port, command, proc) = spawn_peer(p, &PeerEngines::of(engines), dir, router_cpus)?;
        targets.push(Target {
            name: p.name.clone(),
            kind: p.kind,
            peer: true,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            pid: Some(proc.pid),
            command: Some(command),
        });
        peer_procs.push((p.name.clone(), proc));
    }
    Ok(peer_procs)
}

/// Waits until every target answers, then checks that each answers (streamed and not) the
/// text the first target (the engine itself) answers.
async fn check_answers(
    args: &Args,
    targets: &[Target],
    peer_procs: &mut [(String, PeerProc)],
    timeout: Duration,
) -> Result<(), String> {
    let probe = |stream: bool| load::body(MODEL, usize::MAX, args.tokens, stream);
    let start_probe = Probe::starting_now(args.tokens, false, timeout, args.start_timeout);
    for t in targets {
        let proc = peer_procs
            .iter_mut()
            .find(|(n, _)| *n == t.name)
            .map(|(_, p)| p);
        first_answer(&t.name, t.addr, proc, &start_probe).await?;
    }
    let mut reference = BTreeMap::new();
    for t in targets {
        for stream in [false, true] {
            let (status, body) = load::once(t.addr, probe(stream), timeout)
                .await
                .map_err(|e| format!("{} probe: {e}", t.name))?;
            let text = if status == 200 {
                load::answer_text(stream, &body)
            } else {
                Err(format!("status {status}"))
            };
            let text = text.map_err(|e| {
                format!(
                    "{} probe (stream {stream}): {e}: {}",
                    t.name,
                    String::from_utf8_lossy(&body[..body.len().min(500)])
                )
            })?;
            match reference.get(&stream) {
                None => {
                    reference.insert(stream, text);
                }
                Some(want) if *want == text => {}
                Some(want) => {
                    return Err(format!(
                        "{} (stream {stream}) answered {text:?}, the engine itself {want:?}",
                        t.name
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The header the run prints (CPUs, pinning, load, engines, every target) and the targets as
/// the JSON document lists them.
fn header(
    args: &Args,
    cpus: usize,
    pinning: Option<&Pinning>,
    loadavg_start: [f64; 3],
    engines: &Engines,
    targets: &[Target],
) -> (String, Vec<Value>) {
    let mut head = format!(
        "narwhal-bench: {} CPUs, {}; load average at start {:.2} {:.2} {:.2}\n",
        cpus,
        match pinning {
            Some(p) => format!(
                "routers pinned to CPU {}, simulators and load generator to CPU {}",
                procs::cpu_list(&p.router),
                procs::cpu_list(&p.load)
            ),
            None => "no pinning".into(),
        },
        loadavg_start[0],
        loadavg_start[1],
        loadavg_start[2],
    );
    head.push_str(&format!(
        "engines: aggregated vllm {} (direct, ours-agg and aggregated peers); P/D {} prefill {} + decode {}\n",
        engines.agg.url, args.dialect, engines.prefill.url, engines.decode.url
    ));
    let mut target_json = Vec::new();
    for t in targets {
        let cpus = t.pid.map(|p| procs::cpu_list(&procs::tree_cpus(p)));
        head.push_str(&format!(
            "  {}: {} at http://{}{}{}\n",
            t.name,
            t.kind.as_str(),
            t.addr,
            t.pid
                .map(|p| format!(" pid {p} on CPU {}", cpus.clone().unwrap_or_default()))
                .unwrap_or_default(),
            t.command
                .as_ref()
                .map(|c| format!("\n      {c}"))
                .unwrap_or_default()
        ));
        target_json.push(json!({
            "name": t.name, "kind": t.kind.as_str(), "peer": t.peer,
            "url": format!("http://{}", t.addr), "pid": t.pid, "cpus": cpus,
            "command": t.command,
        }));
    }
    (head, target_json)
}

/// One section to measure: its mode, streamed or not, concurrency and requests per window.
type Planned = (&'static str, bool, usize, usize);

/// The sections `args` asks for, in order: per stream setting, throughput then latency.
fn section_plan(args: &Args) -> Vec<Planned> {
    let streams: Vec<bool> = match args.stream.as_str() {
        "true" => vec![true],
        "false" => vec![false],
        _ => vec![true, false],
    };
    let throughput = args.compare || !args.latency;
    let mut plan = Vec::new();
    for &stream in &streams {
        if throughput {
            plan.push(("throughput", stream, args.concurrency, args.requests));
        }
        if args.latency {
            plan.push(("latency", stream, 1, args.latency_requests));
        }
    }
    plan
}

/// Warms every target up, then measures them over `--rounds` rotating rounds: one section.
/// `next_prompt`: the first prompt not yet sent, advanced past every request sent here.
async fn measure_section(
    args: &Args,
    targets: &[Target],
    engines: &Engines,
    (mode, stream, concurrency, requests): Planned,
    timeout: Duration,
    clk: f64,
    next_prompt: &mut usize,
) -> Section {
    let shot = Shot {
        concurrency,
        requests,
        tokens: args.tokens,
        stream,
        timeout,
        h2_streams: None,
        rate: None,
    };
    let warm = Shot {
        requests: args
            .warmup
            .unwrap_or_else(|| (requests / 10).max(concurrency)),
        ..shot.clone()
    };
    for t in targets {
        if warm.requests > 0 {
            load::drive(t.addr, MODEL, &warm, *next_prompt).await;
            *next_prompt += warm.requests;
        }
    }
    let mut runs: Vec<TargetRun> = targets
        .iter()
        .map(|t| TargetRun {
            name: t.name.clone(),
            kind: t.kind,
            peer: t.peer,
            windows: Vec::new(),
        })
        .collect();
    for round in 0..args.rounds {
        for k in 0..targets.len() {
            let i = (k + round) % targets.len();
            let t = &targets[i];
            let stats_before = engines.stats(t.kind).await;
            let cpu_before = t.pid.map(procs::tree_ticks);
            let sample = load::drive(t.addr, MODEL, &shot, *next_prompt).await;
            let cpu_after = t.pid.map(procs::tree_ticks);
            *next_prompt += requests;
            let rss = t.pid.map(procs::tree_memory_kib);
            let stats_after = engines.stats(t.kind).await;
            let cpu_s = match (&cpu_before, &cpu_after) {
                (Some(b), Some(a)) => Some(procs::ticks_between(b, a) as f64 / clk),
                _ => None,
            };
            runs[i].windows.push(Window::new(
                round,
                &sample,
                cpu_s,
                rss,
                engine_counts(t.kind, &stats_before, &stats_after),
                procs::loadavg(),
            ));
        }
    }
    Section {
        mode,
        stream,
        concurrency,
        requests,
        tokens: args.tokens,
        targets: runs,
    }
}

/// `--pin auto`: this process (and so the simulators it starts) on every CPU of `cpus` but
/// the last, the routers on the last; `None` (no pinning) with `off`, one CPU, or when the
/// affinity cannot be set (said on stderr as `who`).
fn pin(mode: &str, cpus: &BTreeSet<usize>, who: &str) -> Option<Pinning> {
    let last = cpus.iter().next_back().copied()?;
    if mode != "auto" || cpus.len() < 2 {
        return None;
    }
    let router: BTreeSet<usize> = [last].into();
    let load: BTreeSet<usize> = cpus.iter().copied().filter(|c| *c != last).collect();
    match procs::set_affinity(std::process::id() as i32, &load, true) {
        Ok(()) => Some(Pinning { router, load }),
        Err(e) => {
            eprintln!("{who}: not pinning: {e}");
            None
        }
    }
}

/// The engines a peer's command names (docs/benchmarks.md, "Peers"): every prefill and decode
/// engine of a P/D fleet, the SGLang prefill's bootstrap port, the aggregated engines.
struct PeerEngines {
    prefill: Vec<String>,
    decode: Vec<String>,
    bootstrap_port: Option<u16>,
    agg: Vec<String>,
}

impl PeerEngines {
    /// The comparison's engines: one of each.
    fn of(engines: &Engines) -> PeerEngines {
        PeerEngines {
            prefill: vec![engines.prefill.url.clone()],
            decode: vec![engines.decode.url.clone()],
            bootstrap_port: engines.prefill.bootstrap_port,
            agg: vec![engines.agg.url.clone()],
        }
    }
}

/// Starts peer `p` over `engines` on `router_cpus`, its logs and directory under `dir`:
/// `(its port, its rendered command, the process)`.
///
/// # Errors
/// A bad placeholder, a directory that cannot be made, or a peer that cannot be started.
fn spawn_peer(
    p: &PeerSpec,
    engines: &PeerEngines,
    dir: &std::path::Path,
    router_cpus: Option<&BTreeSet<usize>>,
) -> Result<(u16, String, PeerProc), String> {
    let bin_dir = narwhal_testkit::bin_path("narwhal-serve")
        .parent()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let port = engine_port();
    let pdir = dir.join(format!("peer-{}", p.name));
    std::fs::create_dir_all(&pdir).map_err(|e| format!("{}: {e}", pdir.display()))?;
    let command = p.render(&peer_values(engines, port, &pdir, &bin_dir))?;
    let proc = procs::on_cpus(router_cpus, || PeerProc::spawn(&p.name, &command, dir))??;
    Ok((port, command, proc))
}

/// How [`first_answer`] probes a target: a completion of `tokens` (streamed or not), each
/// try within `timeout`, until `deadline` (`start_timeout_s` after the first target's start,
/// for the message).
#[derive(Debug, Clone, Copy)]
struct Probe {
    tokens: u32,
    stream: bool,
    timeout: Duration,
    deadline: Instant,
    start_timeout_s: f64,
}

impl Probe {
    /// A probe whose deadline is `start_timeout_s` from now.
    fn starting_now(tokens: u32, stream: bool, timeout: Duration, start_timeout_s: f64) -> Probe {
        Probe {
            tokens,
            stream,
            timeout,
            deadline: Instant::now() + Duration::from_secs_f64(start_timeout_s),
            start_timeout_s,
        }
    }
}

/// Waits until target `name` at `addr` answers `probe`'s completion whole, polling every
/// 100 ms.
///
/// # Errors
/// When its peer process (`peer`) exits first, or nothing whole came by the deadline: the
/// last answer and the peer's log tail.
async fn first_answer(
    name: &str,
    addr: SocketAddr,
    mut peer: Option<&mut PeerProc>,
    probe: &Probe,
) -> Result<(), String> {
    let Probe {
        tokens,
        stream,
        timeout,
        deadline,
        start_timeout_s,
    } = *probe;
    loop {
        if let Some(status) = peer.as_mut().and_then(|p| p.exited()) {
            let tail = peer.as_ref().map(|p| p.log_tail(20)).unwrap_or_default();
            return Err(format!(
                "peer {name} exited ({status}) before answering; {tail}"
            ));
        }
        let body = load::body(MODEL, usize::MAX, tokens, stream);
        match load::once(addr, body, timeout).await {
            Ok((200, body)) if load::answer_text(stream, &body).is_ok() => return Ok(()),
            outcome if Instant::now() >= deadline => {
                let tail = peer.as_ref().map(|p| p.log_tail(20)).unwrap_or_default();
                return Err(format!(
                    "{name} did not answer a {} within {start_timeout_s} s (last: {}); {tail}",
                    if stream { "stream" } else { "completion" },
                    match outcome {
                        Ok((s, b)) => format!("{s} {}", String::from_utf8_lossy(&b)),
                        Err(e) => e,
                    }
                ));
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The placeholder values of a peer's command (docs/benchmarks.md, "Peers"): its `port` and
/// `aux_port`, its directory, our binaries' directory, and the engines' URLs (a kind of
/// engine the fleet has none of has no value, so a command naming it is refused).
fn peer_values(
    engines: &PeerEngines,
    port: u16,
    dir: &std::path::Path,
    bin_dir: &str,
) -> BTreeMap<&'static str, String> {
    let mut values: BTreeMap<&str, String> = BTreeMap::new();
    values.insert("port", port.to_string());
    values.insert("aux_port", engine_port().to_string());
    values.insert("host", "127.0.0.1".into());
    values.insert("model", MODEL.into());
    values.insert("dir", dir.display().to_string());
    values.insert("bin_dir", bin_dir.to_string());
    for (one, list, urls) in [
        ("prefill_url", "prefill_urls", &engines.prefill),
        ("decode_url", "decode_urls", &engines.decode),
        ("engine_url", "engine_urls", &engines.agg),
    ] {
        if let Some(first) = urls.first() {
            values.insert(one, first.clone());
            values.insert(list, urls.join(" "));
        }
    }
    values.insert(
        "bootstrap_port",
        engines
            .bootstrap_port
            .map_or_else(|| "none".into(), |b| b.to_string()),
    );
    values
}

/// The fleet file of our router over `sims` (as [`FleetSpec::for_sims`], which needs owned
/// handles), with room for every benchmark connection.
fn fleet(backend: &str, sims: &[&SimHandle]) -> FleetSpec {
    FleetSpec {
        model: MODEL.into(),
        backend: backend.into(),
        engines: sims
            .iter()
            .map(|s| (s.iid.clone(), s.url.clone(), s.role.clone()))
            .collect(),
        overrides: json!({}),
        agents: BTreeMap::new(),
        engine_keys: BTreeMap::new(),
        pins: Default::default(),
    }
    .with(json!({"serving": {"max_connections": 4096}}))
}
