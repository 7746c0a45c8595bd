//! `narwhal-bench concurrency`: what a router costs as the number of concurrent streams grows.
//! At each level of `--levels` (default 1,000, 4,000 and 10,000 streams) every target gets
//! that many clients, each on its own HTTP/1.1 connection (opened before the window starts,
//! `load::drive_connected`), or with `--h2-streams N` a router's clients N to each HTTP/2
//! connection, each sending `--per-client` streamed completions of `--tokens`
//! tokens one after another; the engines stream a token every `--tpot-ms` (simulators, so a
//! stream's floor is tokens x TPOT). Targets: the engine itself (`direct`), our router
//! (`ours-agg` or `ours-pd` by `--shape`) and every `--peer` of that shape (peer.rs), measured
//! one after another in a rotating order. Per target and level:
//!
//! ```text
//!  req/s        completed streams per second of the window
//!  TTFT         send to the first body byte (the first token's event): p50 and p99, ms
//!  e2e          send to the last byte (`data: [DONE]`): p50 and p99, seconds
//!  errors       refused, reset, cut short or timed out (the first one is printed)
//!  CPU          user + system time of the router's process tree over the window, per stream
//!  RSS, fds     the peak of the router tree's VmRSS (MiB) and open file descriptors, sampled
//!               every SAMPLE_EVERY during the window
//! ```
//!
//! A router holds two descriptors per stream over HTTP/1.1 (the client's connection and the
//! engine's; over HTTP/2 the engine's and a share of the client's), so a level needs an
//! open-file limit above twice itself (over HTTP/2, about itself); the run raises its soft limit to the
//! hard one (which its children inherit) and says where a level does not fit. Our router is
//! configured with `serving.max_connections` above the top level (its admission seats).
//! Prints one table, and with `--plots DIR` SVG charts against the concurrency (`plots.rs`);
//! asserts nothing about time (architecture.md section 8). Exit status 1 when a request of
//! our router failed, 2 on bad flags.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use narwhal_testkit::{EngineSpec, RouterHandle, start_router, start_sim};
use serde_json::json;

use crate::load::{Shot, drive_connected, quantile};
use crate::peer::{Kind, PeerSpec};
use crate::plots::{Chart, Series, write_svg};
use crate::{
    Engines, MODEL, PeerEngines, Probe, addr_of, first_answer, fleet, pin, procs, spawn_peer,
};

/// How often the peak RSS and descriptor count are sampled during a window.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Descriptors a router holds besides its streams' (listeners, logs, epoll, pools), for the
/// limit check.
const FD_MARGIN: u64 = 256;

/// `narwhal-bench concurrency` flags.
#[derive(Debug, Parser)]
#[command(
    name = "narwhal-bench concurrency",
    about = "Router cost as concurrent streams grow: req/s, p99 TTFT and end to end, CPU, peak RSS and descriptors"
)]
struct Args {
    /// Concurrent streams (clients), comma-separated, measured in ascending order.
    #[arg(long, default_value = "1000,4000,10000", value_delimiter = ',')]
    levels: Vec<usize>,
    /// Output tokens per stream (`max_tokens`).
    #[arg(long, default_value_t = 64)]
    tokens: u32,
    /// The engines' delay between streamed tokens (milliseconds).
    #[arg(long, default_value_t = 20)]
    tpot_ms: u64,
    /// Streams each client sends, one after another, per window.
    #[arg(long, default_value_t = 1)]
    per_client: usize,
    /// `agg`: our router over one aggregated engine; `pd`: over a vLLM prefill/decode pair.
    #[arg(long, default_value = "agg", value_parser = ["agg", "pd"])]
    shape: String,
    /// Measured rounds; each round measures every target once per level, order rotating.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// A peer router, `NAME=COMMAND` (placeholders as `narwhal-bench --peer`); peers of the
    /// other shape are left out. Repeatable.
    #[arg(long = "peer", value_name = "NAME=COMMAND")]
    peers: Vec<String>,
    /// The simulators' running set (`narwhal-engine-sim --max-num-seqs`, as vLLM's
    /// `--max-num-seqs`; its OpenAI server defaults to 1024 on large GPUs): past it a stream
    /// waits in the engine's queue. 0: every stream runs at once.
    #[arg(long, default_value_t = 0)]
    max_num_seqs: usize,
    /// With `--max-num-seqs`, where our router's streams wait beyond it: `engine` (every
    /// stream forwarded, waiting in the engine's queue, as the peers do) or `router` (our
    /// router's admission seats `serving.max_connections` set to `--max-num-seqs`, the rest in
    /// its admission queue, `serving.queue_capacity`, so a stream's first-token limit counts
    /// only engine time).
    #[arg(long, default_value = "engine", value_parser = ["engine", "router"])]
    engine_queue: String,
    /// Worker threads of each simulator.
    #[arg(long, default_value_t = 1)]
    sim_threads: usize,
    /// `auto`: routers on the last CPU, simulators and load generator on the others (when
    /// there are two or more); `off`: no pinning.
    #[arg(long, default_value = "auto", value_parser = ["auto", "off"])]
    pin: String,
    /// Seconds a target may take to answer its first request.
    #[arg(long, default_value_t = 120.0)]
    start_timeout: f64,
    /// Seconds a stream may take (connect, head and whole body) before it counts as failed.
    #[arg(long, default_value_t = 300.0)]
    request_timeout: f64,
    /// Clients' streams per HTTP/2 connection to a router (prior knowledge): the clients of
    /// a level share `level / N` connections, as behind a gateway that multiplexes. Left out:
    /// one HTTP/1.1 connection per client. `direct` is always HTTP/1.1, as vLLM's and
    /// SGLang's servers (uvicorn) speak no HTTP/2.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=200))]
    h2_streams: Option<u64>,
    /// Leave out the engine itself (`direct`).
    #[arg(long)]
    no_direct: bool,
    /// Also write the results as SVG line charts against the concurrency into this directory
    /// (created): concurrency-rps.svg, concurrency-ttft-p99.svg, concurrency-e2e-p99.svg,
    /// concurrency-cpu.svg, concurrency-rss.svg, concurrency-fds.svg (with `--h2-streams`:
    /// concurrency-h2-*.svg).
    #[arg(long)]
    plots: Option<PathBuf>,
}

/// One thing the streams are sent to.
struct Target {
    name: String,
    addr: SocketAddr,
    /// The router's process (none for direct).
    pid: Option<u32>,
}

/// One target at one level.
#[derive(Debug, Clone)]
struct Cell {
    level: usize,
    target: String,
    rps: f64,
    ttft_ms: (f64, f64),
    e2e_s: (f64, f64),
    completed: usize,
    errors: usize,
    first_error: Option<String>,
    cpu_ms_per_stream: f64,
    rss_mib: f64,
    fds: u64,
    load: f64,
}

/// Peak VmRSS (KiB) and open descriptors of a process tree, sampled on a thread of its own
/// (so a busy load generator cannot starve it) until dropped.
struct Peaks {
    stop: Arc<AtomicBool>,
    rss_kib: Arc<AtomicU64>,
    fds: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Peaks {
    fn start(pid: u32) -> Peaks {
        let stop = Arc::new(AtomicBool::new(false));
        let rss_kib = Arc::new(AtomicU64::new(0));
        let fds = Arc::new(AtomicU64::new(0));
        let (s, r, f) = (stop.clone(), rss_kib.clone(), fds.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let tree = procs::tree(pid);
                let rss: u64 = tree
                    .iter()
                    .map(|p| procs::memory_kib(*p).map_or(0, |m| m.0))
                    .sum();
                let open: u64 = tree.iter().map(|p| open_fds(*p)).sum();
                r.fetch_max(rss, Ordering::Relaxed);
                f.fetch_max(open, Ordering::Relaxed);
                std::thread::sleep(SAMPLE_EVERY);
            }
        });
        Peaks {
            stop,
            rss_kib,
            fds,
            thread: Some(thread),
        }
    }

    /// Stops sampling: `(peak RSS KiB, peak descriptors)`.
    fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        (
            self.rss_kib.load(Ordering::Relaxed),
            self.fds.load(Ordering::Relaxed),
        )
    }
}

/// Open descriptors of `pid` (entries of `/proc/<pid>/fd`; 0 when it is gone).
fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

/// Raises this process's soft open-file limit to its hard limit (children inherit it);
/// returns the soft limit in force.
fn raise_nofile() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(_) => soft,
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    }
}

/// Runs the concurrency measurement; exit status 1 when a stream of our router failed, 2 on
/// bad flags.
pub(crate) async fn main(argv: Vec<String>) -> std::process::ExitCode {
    let args = match Args::try_parse_from(argv) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return std::process::ExitCode::from(2);
        }
    };
    let mut bad = Vec::new();
    if args.levels.is_empty() || args.levels.contains(&0) {
        bad.push("--levels: every level must be at least 1".to_string());
    }
    if args.tokens == 0 || args.per_client == 0 || args.rounds == 0 || args.sim_threads == 0 {
        bad.push("--tokens, --per-client, --rounds and --sim-threads must be at least 1".into());
    }
    for (name, v) in [
        ("--start-timeout", args.start_timeout),
        ("--request-timeout", args.request_timeout),
    ] {
        if !(v.is_finite() && v > 0.0) {
            bad.push(format!("{name} must be a positive number of seconds"));
        }
    }
    let want = want_kind(&args);
    let mut peers = Vec::new();
    for spec in &args.peers {
        match PeerSpec::parse(spec) {
            Ok(p) if p.kind == want => peers.push(p),
            Ok(p) => eprintln!(
                "narwhal-bench concurrency: --peer {} is {}, not --shape {}: left out",
                p.name,
                p.kind.as_str(),
                args.shape
            ),
            Err(e) => bad.push(e),
        }
    }
    if !bad.is_empty() {
        for b in bad {
            eprintln!("narwhal-bench concurrency: {b}");
        }
        return std::process::ExitCode::from(2);
    }
    match run(&args, &peers).await {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("narwhal-bench concurrency: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args, peers: &[PeerSpec]) -> Result<bool, String> {
    let started = Instant::now();
    let nofile = raise_nofile();
    let mut levels = args.levels.clone();
    levels.sort_unstable();
    levels.dedup();
    let top = *levels.last().unwrap_or(&1);

    // Pinning as the comparison's: this process's threads (and so the simulators it starts)
    // on all CPUs but the last, the routers on the last.
    let pinning = pin(&args.pin, &procs::own_cpus(), "narwhal-bench concurrency");
    let router_cpus = pinning.as_ref().map(|p| &p.router);
    let dir = tempfile::Builder::new()
        .prefix("narwhal-bench-concurrency-")
        .tempdir()
        .map_err(|e| format!("temporary directory: {e}"))?;

    let engines = start_engines(args, dir.path())?;
    let ours_name = format!("ours-{}", args.shape);
    let ours = start_ours(args, &engines, dir.path(), router_cpus, top, &ours_name)?;

    let mut targets = own_targets(args, &engines, &ours_name, &ours)?;
    let mut peer_procs = Vec::new();
    for p in peers {
        let (port, _, proc) = spawn_peer(p, &PeerEngines::of(&engines), dir.path(), router_cpus)?;
        targets.push(Target {
            name: p.name.clone(),
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            pid: Some(proc.pid),
        });
        peer_procs.push((p.name.clone(), proc));
    }

    // Every target answers one stream whole before the first window.
    let timeout = Duration::from_secs_f64(args.request_timeout);
    let start_probe = Probe::starting_now(args.tokens, true, timeout, args.start_timeout);
    for t in &targets {
        let proc = peer_procs
            .iter_mut()
            .find(|(n, _)| *n == t.name)
            .map(|(_, p)| p);
        first_answer(&t.name, t.addr, proc, &start_probe).await?;
    }

    print_header(args, nofile, pinning.as_ref(), &levels);

    let clk = procs::clock_ticks();
    let mut cells = Vec::new();
    let mut next_prompt = 0usize;
    for &level in &levels {
        let shot = Shot {
            concurrency: level,
            requests: level * args.per_client,
            tokens: args.tokens,
            stream: true,
            timeout,
            h2_streams: None,
            rate: None,
        };
        for round in 0..args.rounds {
            for k in 0..targets.len() {
                let t = &targets[(k + round + level) % targets.len()];
                let cell = measure_window(args, t, level, &shot, next_prompt, clk).await;
                next_prompt += shot.requests;
                println!("{}", row(&cell, t.pid.is_some()));
                cells.push(cell);
                // The window's connections close before the next target's (so its
                // descriptors are not counted there).
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    println!("\n{}", table(&cells, &targets));
    println!("{}", goals(&cells, &ours_name, top));
    if let Some(dir) = &args.plots
        && let Err(e) = plot(dir, &cells, &targets, args.h2_streams)
    {
        eprintln!("narwhal-bench concurrency: plots: {e}");
    }
    println!(
        "load average at end {:?}; {:.0} s",
        procs::loadavg(),
        started.elapsed().as_secs_f64()
    );
    drop(peer_procs);
    let ours_failed = cells
        .iter()
        .any(|c| c.target == ours_name && (c.errors > 0 || c.completed == 0));
    Ok(!ours_failed)
}

/// The simulators (one aggregated engine, a prefill/decode pair) on this process's CPUs,
/// streaming a token every `--tpot-ms` with at most `--max-num-seqs` running.
fn start_engines(args: &Args, dir: &std::path::Path) -> Result<Engines, String> {
    let threads = args.sim_threads.to_string();
    let tpot = args.tpot_ms.to_string();
    let seqs = args.max_num_seqs.to_string();
    let sim_args = [
        "--threads",
        threads.as_str(),
        "--tpot-ms",
        tpot.as_str(),
        "--max-num-seqs",
        seqs.as_str(),
    ];
    let start = |iid: &str, role: &str| {
        start_sim(dir, &EngineSpec::new(iid, role).args(&sim_args), "vllm")
            .map_err(|e| format!("simulator {iid}: {e}"))
    };
    Ok(Engines {
        agg: start("e0", "decode")?,
        prefill: start("p0", "prefill")?,
        decode: start("d0", "decode")?,
    })
}

/// Our router `name` of `--shape` on `router_cpus`, with admission seats above the `top`
/// level; with `--engine-queue router`, seats as the engine's running set and the rest in the
/// router's admission queue.
fn start_ours(
    args: &Args,
    engines: &Engines,
    dir: &std::path::Path,
    router_cpus: Option<&std::collections::BTreeSet<usize>>,
    top: usize,
    name: &str,
) -> Result<RouterHandle, String> {
    let seats = (top as u64 + 1024).max(4096);
    let serving = if args.engine_queue == "router" && args.max_num_seqs > 0 {
        json!({"serving": {
            "max_connections": args.max_num_seqs,
            "queue_capacity": seats,
            "queue_timeout_s": args.request_timeout,
        }})
    } else {
        json!({"serving": {"max_connections": seats}})
    };
    let spec = match want_kind(args) {
        Kind::Pd => fleet("vllm", &[&engines.prefill, &engines.decode]),
        _ => fleet("vllm", &[&engines.agg]),
    }
    .with(serving);
    procs::on_cpus(router_cpus, || {
        start_router(dir, name, &spec, &["--log-level", "warn"])
    })?
    .map_err(|e| format!("router {name}: {e}"))
}

/// The targets that are not peers: the engine itself (the decode engine of a P/D shape)
/// unless `--no-direct`, then our router.
fn own_targets(
    args: &Args,
    engines: &Engines,
    ours_name: &str,
    ours: &RouterHandle,
) -> Result<Vec<Target>, String> {
    let mut targets = Vec::new();
    if !args.no_direct {
        let engine = if want_kind(args) == Kind::Pd {
            &engines.decode
        } else {
            &engines.agg
        };
        targets.push(Target {
            name: "direct".into(),
            addr: addr_of(&engine.url)?,
            pid: None,
        });
    }
    targets.push(Target {
        name: ours_name.to_string(),
        addr: addr_of(&ours.data)?,
        pid: Some(ours.proc.pid()),
    });
    Ok(targets)
}

/// The run's first lines: the workload, the pinning and load, and a note per level that needs
/// more descriptors than the open-file limit `nofile` allows.
fn print_header(args: &Args, nofile: u64, pinning: Option<&crate::Pinning>, levels: &[usize]) {
    println!(
        "concurrency: {} shape, {} tokens at {} ms per token (floor {:.2} s per stream), {} stream(s) per client, {} round(s), {}, engines running {}; open-file limit {nofile}; {}; load average {:?}",
        args.shape,
        args.tokens,
        args.tpot_ms,
        f64::from(args.tokens) * args.tpot_ms as f64 / 1000.0,
        args.per_client,
        args.rounds,
        match args.h2_streams {
            Some(n) => format!("routers' clients on HTTP/2 connections of {n} streams each"),
            None => "one HTTP/1.1 connection per client".into(),
        },
        match args.max_num_seqs {
            0 => "every stream at once".to_string(),
            n => format!("at most {n} streams (the rest wait in the engine's queue)"),
        },
        match pinning {
            Some(p) => format!(
                "routers on CPU {}, simulators and load generator on CPU {}",
                procs::cpu_list(&p.router),
                procs::cpu_list(&p.load)
            ),
            None => "no pinning".into(),
        },
        procs::loadavg()
    );
    for l in levels {
        // The engine's descriptor per stream, and the client's: its own, or its share of one
        // HTTP/2 connection.
        let client_fds = match args.h2_streams {
            Some(n) => (*l as u64).div_ceil(n),
            None => *l as u64,
        };
        let need = *l as u64 + client_fds + FD_MARGIN;
        if need > nofile {
            println!(
                "  note: {l} streams need about {need} descriptors in a router ({} per stream); the limit here is {nofile}, so a router runs out before",
                if args.h2_streams.is_some() {
                    "one, and a share of an HTTP/2 connection,"
                } else {
                    "two"
                }
            );
        }
    }
}

/// One window: `shot` (over HTTP/2 for a router with `--h2-streams`) against target `t` from
/// prompt `next_prompt`, with the router tree's CPU time and peaks over it.
async fn measure_window(
    args: &Args,
    t: &Target,
    level: usize,
    shot: &Shot,
    next_prompt: usize,
    clk: f64,
) -> Cell {
    let peaks = t.pid.map(Peaks::start);
    let cpu_before = t.pid.map(procs::tree_ticks);
    let shot = Shot {
        h2_streams: t
            .pid
            .and(args.h2_streams)
            .map(|n| usize::try_from(n).unwrap_or(1)),
        ..shot.clone()
    };
    let sample = drive_connected(t.addr, MODEL, &shot, next_prompt).await;
    let cpu_after = t.pid.map(procs::tree_ticks);
    let (rss_kib, fds) = peaks.map_or((0, 0), Peaks::finish);
    let completed = sample.latency_s.len();
    let cpu_s = match (&cpu_before, &cpu_after) {
        (Some(b), Some(a)) => procs::ticks_between(b, a) as f64 / clk,
        _ => f64::NAN,
    };
    Cell {
        level,
        target: t.name.clone(),
        rps: sample.rps(),
        ttft_ms: (
            quantile(&sample.ttfb_s, 0.5) * 1e3,
            quantile(&sample.ttfb_s, 0.99) * 1e3,
        ),
        e2e_s: (
            quantile(&sample.latency_s, 0.5),
            quantile(&sample.latency_s, 0.99),
        ),
        completed,
        errors: sample.errors,
        first_error: sample.first_error.clone(),
        cpu_ms_per_stream: if completed > 0 {
            cpu_s * 1e3 / completed as f64
        } else {
            f64::NAN
        },
        rss_mib: if t.pid.is_some() {
            rss_kib as f64 / 1024.0
        } else {
            f64::NAN
        },
        fds,
        load: procs::loadavg()[0],
    }
}

/// The shape `--shape` names.
fn want_kind(args: &Args) -> Kind {
    if args.shape == "pd" {
        Kind::Pd
    } else {
        Kind::Agg
    }
}

/// One measured window as a line, printed as it is measured.
fn row(c: &Cell, router: bool) -> String {
    let mut s = format!(
        "{:>6} {:<16} {:>8.1} req/s  TTFT p50 {:>7.1} p99 {:>7.1} ms  e2e p50 {:>6.2} p99 {:>6.2} s  errors {:>4}",
        c.level, c.target, c.rps, c.ttft_ms.0, c.ttft_ms.1, c.e2e_s.0, c.e2e_s.1, c.errors
    );
    if router {
        s.push_str(&format!(
            "  CPU {:>6.3} ms/stream  RSS {:>6.1} MiB  fds {:>6}",
            c.cpu_ms_per_stream, c.rss_mib, c.fds
        ));
    }
    s.push_str(&format!("  load {:.1}", c.load));
    if let Some(e) = &c.first_error {
        s.push_str(&format!(
            "\n         first error: {}",
            e.chars().take(300).collect::<String>()
        ));
    }
    s
}

/// Medians over rounds of `f` for `target` at `level`; NaN when unmeasured.
fn median_of(cells: &[Cell], level: usize, target: &str, f: impl Fn(&Cell) -> f64) -> f64 {
    let v: Vec<f64> = cells
        .iter()
        .filter(|c| c.level == level && c.target == target)
        .map(f)
        .filter(|x| x.is_finite())
        .collect();
    if v.is_empty() {
        f64::NAN
    } else {
        crate::report::median(v)
    }
}

/// The table: one row per level and target, medians over rounds (errors summed).
fn table(cells: &[Cell], targets: &[Target]) -> String {
    let mut levels: Vec<usize> = cells.iter().map(|c| c.level).collect();
    levels.dedup();
    let mut out = String::from(
        "| streams | target | req/s | TTFT p50 ms | TTFT p99 ms | e2e p50 s | e2e p99 s | errors | CPU ms/stream | peak RSS MiB | peak fds |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for &l in &levels {
        for t in targets {
            let m = |f: &dyn Fn(&Cell) -> f64| median_of(cells, l, &t.name, f);
            let errors: usize = cells
                .iter()
                .filter(|c| c.level == l && c.target == t.name)
                .map(|c| c.errors)
                .sum();
            let router = t.pid.is_some();
            let opt = |x: f64, p: usize| {
                if router && x.is_finite() {
                    format!("{x:.p$}")
                } else {
                    "-".into()
                }
            };
            out.push_str(&format!(
                "| {l} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {errors} | {} | {} | {} |\n",
                t.name,
                m(&|c| c.rps),
                m(&|c| c.ttft_ms.0),
                m(&|c| c.ttft_ms.1),
                m(&|c| c.e2e_s.0),
                m(&|c| c.e2e_s.1),
                opt(m(&|c| c.cpu_ms_per_stream), 3),
                opt(m(&|c| c.rss_mib), 1),
                opt(m(&|c| c.fds as f64), 0),
            ));
        }
    }
    out
}

/// The goals at the top level (docs/benchmarks.md): no errors, RSS at most 128 MiB, and p99
/// (TTFT and end to end) no worse than vllm-router's, with the ratios.
fn goals(cells: &[Cell], ours: &str, top: usize) -> String {
    let m = |t: &str, f: &dyn Fn(&Cell) -> f64| median_of(cells, top, t, f);
    let errors: usize = cells
        .iter()
        .filter(|c| c.level == top && c.target == ours)
        .map(|c| c.errors)
        .sum();
    let mut parts = vec![
        format!("{ours} at {top} streams: errors {errors} (goal 0)"),
        format!("peak RSS {:.1} MiB (goal <= 128)", m(ours, &|c| c.rss_mib)),
    ];
    let mut peers: Vec<&str> = cells
        .iter()
        .filter(|c| c.target != ours && c.target != "direct")
        .map(|c| c.target.as_str())
        .collect();
    peers.sort_unstable();
    peers.dedup();
    for p in peers {
        parts.push(format!(
            "vs {p}: req/s {:.2}x, p99 TTFT {:.2}x, p99 e2e {:.2}x (goal <= 1.00x)",
            m(ours, &|c| c.rps) / m(p, &|c| c.rps),
            m(ours, &|c| c.ttft_ms.1) / m(p, &|c| c.ttft_ms.1),
            m(ours, &|c| c.e2e_s.1) / m(p, &|c| c.e2e_s.1),
        ));
    }
    format!("goals: {}", parts.join("; "))
}

/// The charts against the concurrency, one line per target.
///
/// `h2_streams`: the routers' clients were on HTTP/2 connections of that many streams; the
/// files are then `concurrency-h2-*.svg` and the titles say so.
fn plot(
    dir: &std::path::Path,
    cells: &[Cell],
    targets: &[Target],
    h2_streams: Option<u64>,
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut levels: Vec<usize> = cells.iter().map(|c| c.level).collect();
    levels.dedup();
    let series = |routers_only: bool, f: &dyn Fn(&Cell) -> f64| -> Vec<Series> {
        targets
            .iter()
            .filter(|t| !routers_only || t.pid.is_some())
            .map(|t| Series {
                name: t.name.clone(),
                points: levels
                    .iter()
                    .map(|&l| (l as f64, median_of(cells, l, &t.name, f)))
                    .collect(),
            })
            .collect()
    };
    let x = "concurrent streams".to_string();
    let charts = [
        (
            "concurrency-rps.svg",
            "Completed streams per second",
            "req/s",
            series(false, &|c| c.rps),
        ),
        (
            "concurrency-ttft-p99.svg",
            "p99 time to first token",
            "ms",
            series(false, &|c| c.ttft_ms.1),
        ),
        (
            "concurrency-e2e-p99.svg",
            "p99 stream duration, end to end",
            "seconds",
            series(false, &|c| c.e2e_s.1),
        ),
        (
            "concurrency-cpu.svg",
            "Router CPU per stream",
            "ms",
            series(true, &|c| c.cpu_ms_per_stream),
        ),
        (
            "concurrency-rss.svg",
            "Router peak RSS",
            "MiB",
            series(true, &|c| c.rss_mib),
        ),
        (
            "concurrency-fds.svg",
            "Router peak open file descriptors",
            "descriptors",
            series(true, &|c| c.fds as f64),
        ),
    ];
    for (file, title, unit, series) in charts {
        let (file, title) = match h2_streams {
            Some(n) => (
                file.replacen("concurrency-", "concurrency-h2-", 1),
                format!("{title} (routers' clients on HTTP/2, {n} streams a connection)"),
            ),
            None => (file.to_string(), title.to_string()),
        };
        write_svg(
            &dir.join(file),
            &Chart {
                title,
                x_label: x.clone(),
                y_label: unit.into(),
                series,
            },
        )?;
    }
    Ok(())
}
