//! `narwhal-dev`: a whole Narwhal fleet on loopback for trying the product locally.
//!
//! - `narwhal-dev up`: starts simulated engines and a router, each as its own process running
//!   the real binary, prints the URLs and a curl line, writes a ready file naming everything it
//!   started, and runs until interrupted (SIGINT/SIGTERM), then stops every child.
//! - `narwhal-dev demo`: brings a fleet up in a temporary directory for each dialect, sends a
//!   mix of streaming and non-streaming chat and completion requests through the router,
//!   prints a table of outcomes and the simulators' KV statistics, and exits non-zero if any
//!   request failed or any decode recomputed its prefill instead of receiving KV.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use futures_util::StreamExt;
use narwhal_testkit::{EngineSpec, FleetSpec, RouterHandle, SimHandle, start_router, start_sim};
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
    /// Start simulated engines and a router; run until interrupted.
    Up(UpArgs),
    /// Start a fleet, send a scripted mix of requests, print what happened.
    Demo(DemoArgs),
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
    /// Directory for the fleet file, logs, journal and state (created if missing).
    #[arg(long, default_value = "runs/dev")]
    dir: PathBuf,
    /// Write a JSON document naming every started process here once the fleet serves.
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// Extra flags for every simulator, e.g. `--sim-arg=--tpot-ms --sim-arg=5`.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    sim_args: Vec<String>,
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
}

/// Everything `up` started.
struct Fleet {
    sims: Vec<SimHandle>,
    router: RouterHandle,
    dir: PathBuf,
    dialect: String,
}

impl Fleet {
    fn start(args: &UpArgs) -> Result<Self, String> {
        std::fs::create_dir_all(&args.dir)
            .map_err(|e| format!("create {}: {e}", args.dir.display()))?;
        let dir = args
            .dir
            .canonicalize()
            .map_err(|e| format!("{}: {e}", args.dir.display()))?;
        let extra: Vec<&str> = args.sim_args.iter().map(String::as_str).collect();
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
        let fleet = FleetSpec::for_sims(&args.dialect, &sims);
        let router = start_router(&dir, "router", &fleet, &[]).map_err(|e| e.to_string())?;
        Ok(Fleet {
            sims,
            router,
            dir,
            dialect: args.dialect.clone(),
        })
    }

    fn ready_doc(&self) -> Value {
        json!({
            "schema": "narwhal.dev-fleet",
            "schema_version": 1,
            "dir": self.dir,
            "dialect": self.dialect,
            "router": {
                "data": self.router.data,
                "control": self.router.control,
                "pid": self.router.proc.pid(),
                "fleet": self.router.fleet,
                "journal": self.router.journal,
            },
            "engines": self.sims.iter().map(|s| json!({
                "iid": s.iid, "role": s.role, "url": s.url, "pid": s.proc.pid(),
            })).collect::<Vec<_>>(),
        })
    }
}

fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

async fn up(args: UpArgs) -> ExitCode {
    let fleet = match Fleet::start(&args) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("narwhal-dev up: {e}");
            return ExitCode::FAILURE;
        }
    };
    let doc = fleet.ready_doc();
    let ready = args
        .ready_file
        .clone()
        .unwrap_or_else(|| fleet.dir.join("fleet.ready.json"));
    if let Err(e) = write_atomically(&ready, &format!("{doc:#}\n")) {
        eprintln!("narwhal-dev up: write {}: {e}", ready.display());
        return ExitCode::FAILURE;
    }
    println!(
        "narwhal-dev up: router data={} control={}",
        fleet.router.data, fleet.router.control
    );
    for s in &fleet.sims {
        println!(
            "  engine {:<4} {:<8} {}  pid {}",
            s.iid,
            s.role,
            s.url,
            s.proc.pid()
        );
    }
    println!("  logs, journal and fleet file in {}", fleet.dir.display());
    println!("  ready file {}", ready.display());
    println!(
        "try:\n  curl -s {}/v1/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"tiny-sim\",\"prompt\":\"hello world\",\"max_tokens\":8}}'",
        fleet.router.data
    );
    println!("  curl -s {}/narwhal/state | head", fleet.router.control);
    println!("Ctrl-C stops the fleet.");
    wait_for_signal().await;
    println!("narwhal-dev up: stopping");
    drop(fleet);
    ExitCode::SUCCESS
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
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
    let (path, body) = if kind == "chat" {
        (
            "/v1/chat/completions",
            json!({"model": "tiny-sim", "stream": stream, "max_tokens": 8,
                   "messages": [{"role": "user", "content": prompt}]}),
        )
    } else {
        (
            "/v1/completions",
            json!({"model": "tiny-sim", "stream": stream, "max_tokens": 8, "prompt": prompt}),
        )
    };
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
        match resp.json::<Value>().await {
            Ok(v) => {
                let n = v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
                let ok = status == 200 && n > 0;
                (n, ok, if ok { String::new() } else { v.to_string() })
            }
            Err(e) => (0, false, e.to_string()),
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
            .filter_map(|f| serde_json::from_str::<Value>(f).ok())
            .filter(|v| {
                let c = &v["choices"][0];
                let text = c["text"]
                    .as_str()
                    .or_else(|| c["delta"]["content"].as_str());
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
        println!("\n=== {dialect}: 1 prefill + 1 decode engine, router in front ===");
        let up = UpArgs {
            prefill: 1,
            decode: 1,
            dialect: dialect.clone(),
            dir: base.join(dialect),
            ready_file: None,
            sim_args: vec!["--tpot-ms".into(), "1".into()],
        };
        let fleet = match Fleet::start(&up) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("narwhal-dev demo: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!(
            "router data={} control={}",
            fleet.router.data, fleet.router.control
        );
        let futs = (0..args.requests).map(|i| send(&http, &fleet.router.data, i));
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
        println!("engine KV statistics (from each simulator's /sim/stats):");
        println!(
            "{:<5} {:<8} {:>8} {:>7} {:>7} {:>9} {:>9} {:>11}",
            "iid", "role", "requests", "issued", "served", "consumed", "rejected", "recomputed"
        );
        let mut consumed = 0;
        let mut recomputed = 0;
        for s in &fleet.sims {
            match s.stats(&http).await {
                Ok(st) => {
                    let req = &st["requests"];
                    let total = ["prefill", "decode", "aggregated"]
                        .iter()
                        .map(|k| req[*k].as_u64().unwrap_or(0))
                        .sum::<u64>();
                    let kv = |k: &str| st["kv"][k].as_u64().unwrap_or(0);
                    consumed += kv("consumed");
                    recomputed += kv("recomputed");
                    println!(
                        "{:<5} {:<8} {:>8} {:>7} {:>7} {:>9} {:>9} {:>11}",
                        s.iid,
                        s.role,
                        total,
                        kv("issued"),
                        kv("served"),
                        kv("consumed"),
                        kv("rejected"),
                        kv("recomputed")
                    );
                }
                Err(e) => {
                    all_ok = false;
                    println!("{:<5} stats unavailable: {e}", s.iid);
                }
            }
        }
        if recomputed > 0 || consumed < args.requests as u64 {
            all_ok = false;
            println!(
                "FAILED: expected every decode to receive KV ({consumed} consumed, {recomputed} recomputed)"
            );
        }
        if let Ok(state) = fleet.router.state(&http).await {
            println!(
                "router /narwhal/state: offered={} served={} failed={} cancelled={} invalid={}",
                state["offered"],
                state["served"],
                state["failed"],
                state["cancelled"],
                state["invalid_requests"]
            );
        }
        drop(fleet);
    }
    if all_ok {
        println!("\ndemo: every request served");
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Up(a) => up(a).await,
        Cmd::Demo(a) => demo(a).await,
    }
}
