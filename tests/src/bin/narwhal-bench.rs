//! `narwhal-bench`: router overhead against direct-to-engine traffic, measured in one run.
//!
//! Starts one aggregated simulator (the direct baseline) and a router in front of one prefill
//! and one decode simulator (vLLM NIXL or SGLang bootstrap P/D), drives the same load through
//! both (concurrency C, N requests, streaming or not, T output tokens), and prints requests per
//! second, p50 and p99 latency and time to first byte for each, with router/direct ratios.
//! Absolute numbers on shared machines are not stable; the ratios are the result.
//! It asserts nothing about time: it is a benchmark, not a test (DESIGN.md section 8).
//!
//! Subcommands in their own modules: `narwhal-bench profile` (an engine's profile for the
//! fleet file) and `narwhal-bench shifting` (fixed split vs role controller under shifting
//! demand).
#![forbid(unsafe_code)]
// A test tool that measures wall time (latencies, deadlines): the clock ban of clippy.toml is
// for product code.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use clap::Parser;
use futures_util::StreamExt;

#[path = "narwhal-bench/profile.rs"]
mod profile;
#[path = "narwhal-bench/shifting.rs"]
mod shifting;
use narwhal_testkit::{EngineSpec, FleetSpec, start_router, start_sim};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "narwhal-bench",
    version,
    about = "Router overhead vs direct-to-engine, as ratios"
)]
struct Args {
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Requests per measured run.
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// Output tokens per request (`max_tokens`).
    #[arg(long, default_value_t = 16)]
    tokens: u32,
    /// Stream responses (SSE); `--stream false` for non-streaming.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    stream: bool,
    /// Engine dialect.
    #[arg(long, default_value = "vllm", value_parser = ["vllm", "sglang"])]
    dialect: String,
    /// Worker threads of each simulator.
    #[arg(long, default_value_t = 1)]
    sim_threads: usize,
}

/// Latency figures of one run, in seconds.
struct Run {
    label: String,
    rps: f64,
    p50: f64,
    p99: f64,
    ttfb_p50: f64,
    errors: usize,
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i]
}

async fn drive(label: &str, url: &str, args: &Args, n: usize) -> Run {
    let http = narwhal_testkit::http_client()
        .pool_max_idle_per_host(args.concurrency)
        .build()
        .expect("HTTP client");
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency {
        let http = http.clone();
        let next = next.clone();
        let url = format!("{url}/v1/completions");
        let (stream, tokens) = (args.stream, args.tokens);
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut ttfb = Vec::new();
            let mut errors = 0usize;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let body = json!({"model": "tiny-sim", "prompt": format!("bench prompt number {i} with a few words"),
                                  "max_tokens": tokens, "stream": stream});
                let start = Instant::now();
                let ok = match http.post(&url).json(&body).send().await {
                    Ok(r) if r.status().is_success() => {
                        let mut s = r.bytes_stream();
                        let mut first = true;
                        let mut ok = true;
                        while let Some(c) = s.next().await {
                            if first {
                                ttfb.push(start.elapsed().as_secs_f64());
                                first = false;
                            }
                            if c.is_err() {
                                ok = false;
                            }
                        }
                        ok
                    }
                    _ => false,
                };
                if ok {
                    lat.push(start.elapsed().as_secs_f64());
                } else {
                    errors += 1;
                }
            }
            (lat, ttfb, errors)
        }));
    }
    let (mut lat, mut ttfb, mut errors) = (Vec::new(), Vec::new(), 0);
    for t in tasks {
        let (l, f, e) = t.await.expect("load task");
        lat.extend(l);
        ttfb.extend(f);
        errors += e;
    }
    let wall = t0.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    ttfb.sort_by(f64::total_cmp);
    Run {
        label: label.to_string(),
        rps: lat.len() as f64 / wall,
        p50: pct(&lat, 0.5),
        p99: pct(&lat, 0.99),
        ttfb_p50: pct(&ttfb, 0.5),
        errors,
    }
}

fn print(r: &Run) {
    println!(
        "{:<8} {:>10.0} {:>10.2} {:>10.2} {:>12.2} {:>7}",
        r.label,
        r.rps,
        r.p50 * 1e3,
        r.p99 * 1e3,
        r.ttfb_p50 * 1e3,
        r.errors
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    match argv.get(1).map(String::as_str) {
        Some("profile") => return profile::main(argv[1..].to_vec()).await,
        Some("shifting") => return shifting::main(argv[1..].to_vec()).await,
        _ => {}
    }
    let args = Args::parse();
    let dir = tempfile::Builder::new()
        .prefix("narwhal-bench-")
        .tempdir()
        .expect("temporary directory");
    let threads = args.sim_threads.to_string();
    let sim_args = ["--threads", threads.as_str()];
    let direct = start_sim(
        dir.path(),
        &EngineSpec::new("direct", "decode").args(&sim_args),
        "vllm",
    );
    let solo = start_sim(
        dir.path(),
        &EngineSpec::new("solo", "decode").args(&sim_args),
        "vllm",
    );
    let p = start_sim(
        dir.path(),
        &EngineSpec::new("p0", "prefill").args(&sim_args),
        &args.dialect,
    );
    let d = start_sim(
        dir.path(),
        &EngineSpec::new("d0", "decode").args(&sim_args),
        &args.dialect,
    );
    let (direct, solo, p, d) = match (direct, solo, p, d) {
        (Ok(a), Ok(s), Ok(b), Ok(c)) => (a, s, b, c),
        (a, s, b, c) => {
            for e in [a.err(), s.err(), b.err(), c.err()].into_iter().flatten() {
                eprintln!("narwhal-bench: {e}");
            }
            return std::process::ExitCode::FAILURE;
        }
    };
    let sims = [p, d];
    let fleet = FleetSpec::for_sims(&args.dialect, &sims).with(json!({
        "serving": {"max_connections": 4096}
    }));
    let router = match start_router(dir.path(), "router", &fleet, &["--log-level", "warn"]) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("narwhal-bench: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // The same router in front of one engine: the aggregated path, one upstream request per
    // client request, which isolates the router's own relay overhead from the P/D legs.
    let solo_fleet = FleetSpec::for_sims("vllm", std::slice::from_ref(&solo)).with(json!({
        "serving": {"max_connections": 4096}
    }));
    let router_agg = match start_router(
        dir.path(),
        "router-agg",
        &solo_fleet,
        &["--log-level", "warn"],
    ) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("narwhal-bench: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!(
        "narwhal-bench: concurrency {} requests {} tokens {} stream {} dialect {} (router P/D: 1 prefill + 1 decode; direct: 1 aggregated engine)",
        args.concurrency, args.requests, args.tokens, args.stream, args.dialect
    );
    // Warm both paths (connection pools, allocator) before measuring.
    let warm = (args.requests / 10).max(args.concurrency);
    drive("warm", &direct.url, &args, warm).await;
    drive("warm", &router.data, &args, warm).await;
    drive("warm", &router_agg.data, &args, warm).await;
    println!(
        "{:<8} {:>10} {:>10} {:>10} {:>12} {:>7}",
        "target", "req/s", "p50 ms", "p99 ms", "ttfb p50 ms", "errors"
    );
    let a = drive("direct", &direct.url, &args, args.requests).await;
    print(&a);
    let b = drive("router", &router.data, &args, args.requests).await;
    print(&b);
    let g = drive("agg", &router_agg.data, &args, args.requests).await;
    print(&g);
    // A second direct run brackets the router runs, so drift on a shared machine shows.
    let c = drive("direct", &direct.url, &args, args.requests).await;
    print(&c);
    let base_rps = (a.rps + c.rps) / 2.0;
    let base_p50 = (a.p50 + c.p50) / 2.0;
    let base_p99 = (a.p99 + c.p99) / 2.0;
    for (name, r) in [
        ("router (P/D, 2 legs + KV transfer)", &b),
        ("router (aggregated, 1 leg)", &g),
    ] {
        println!(
            "ratio {name} / direct: throughput {:.2}x, p50 latency {:.2}x, p99 latency {:.2}x",
            r.rps / base_rps,
            r.p50 / base_p50,
            r.p99 / base_p99
        );
    }
    if a.errors + b.errors + c.errors + g.errors > 0 {
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}
