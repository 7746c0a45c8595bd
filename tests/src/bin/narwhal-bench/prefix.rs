//! `narwhal-bench prefix`: a shared-prefix workload (long group prefixes with short unique
//! questions, and multi-turn sessions whose every turn extends the last) at Poisson arrivals
//! near the fleet's capacity, sent to each target in turn over the same four simulated
//! aggregated vLLM engines whose prefix caches hold less than the working set; one engine is
//! restarted (a new process on the same ports) in the middle of every target's run.
//!
//! ```text
//!  trace (prefix_trace.rs) ─► oracle hit rate ─► rate = --load × 4 / (ttft + µs/token × the
//!                             oracle's mean uncached tokens)
//!  for each target: restart the 4 simulators (cold caches, counters at 0) ─► start the target
//!     ─► send the trace (client: TTFT = first token chunk, TPOT = (end − first)/(chunks − 1))
//!     ─► at --restart-at, restart engine e3 ─► hit rate from the simulators' own counters
//!        (`/sim/stats` prefix_cache: hits ÷ queries, vLLM's prefix_cache_hits/queries)
//!     (--bypass: a share of the trace straight to the engines, by prefix affinity;
//!      --router-restart-at: the target router SIGTERMed and started again, the hit rate of
//!      the 10 s before and the 10 s from it)
//!  standby: ours exact as a primary + a warm standby on a fleet of its own; kill -9 of the
//!     primary; hit rate in the 10 s before and after
//!  ─► markdown table (stdout, --out) and JSON (--json)
//! ```
//!
//! Targets: `ours-exact` (engines' `kv_events` in the fleet file), `ours-approx` (no
//! `kv_events`: the approximate index learned from our own placements), `ours-blind`
//! (`serving.kv_aware_placement: false`: placement by load alone), `round-robin` (the bench itself sends request i to engine
//! i mod 4), and every `--peer`. It asserts nothing: a benchmark (architecture.md section 8).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::StreamExt;
use narwhal_testkit::sim_stats::SimStats;
use narwhal_testkit::{
    EngineSpec, FleetSpec, LeaseBackend, SimHandle, engine_port, start_router, start_sim,
};
use serde_json::{Value, json};

use crate::peer::{Kind as PeerKind, PeerProc, PeerSpec};
use crate::prefix_trace::{self, Kind, Request, Shape};

#[path = "prefix_targets.rs"]
mod targets;
use targets::{Running, Target, TargetDef, restart_router, start_target, target_defs, wait_ready};

/// The model the simulators serve.
const MODEL: &str = "tiny-sim";

/// `narwhal-bench prefix` flags.
#[derive(Debug, Parser)]
#[command(
    name = "narwhal-bench prefix",
    about = "Shared-prefix workload: cache hit rate, oracle, TTFT, SLO attainment per router",
    args_override_self = true
)]
struct Args {
    /// A preset of the trace and the engines: its flags come first, so any flag given after it
    /// wins. One of default, hot-prefix, documents, control, agents, tenants, bypass,
    /// restart.
    #[arg(long, default_value = "default")]
    shape: String,
    /// Seconds of arrivals per target.
    #[arg(long, default_value_t = 60.0)]
    duration_s: f64,
    /// Arrival rate as a share of the capacity derived from the oracle's hit rate.
    #[arg(long, default_value_t = 0.8)]
    load: f64,
    /// Arrivals per second (overrides --load).
    #[arg(long)]
    rate: Option<f64>,
    /// Trace seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Groups sharing a long prefix.
    #[arg(long, default_value_t = 16)]
    groups: usize,
    /// Shortest group prefix (tokens).
    #[arg(long, default_value_t = 2000)]
    prefix_min: usize,
    /// Longest group prefix (tokens).
    #[arg(long, default_value_t = 6000)]
    prefix_max: usize,
    /// Tokens of a question.
    #[arg(long, default_value_t = 40)]
    question_tokens: usize,
    /// Sessions running at once.
    #[arg(long, default_value_t = 24)]
    sessions: usize,
    /// Turns per session.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// Tokens of a session's user message per turn.
    #[arg(long, default_value_t = 60)]
    user_tokens: usize,
    /// Tokens standing for the previous answer in a session's next prompt.
    #[arg(long, default_value_t = 32)]
    answer_tokens: usize,
    /// Share of arrivals that are session turns (0-1).
    #[arg(long, default_value_t = 0.4)]
    session_share: f64,
    /// Zipf exponent of group popularity (0: uniform).
    #[arg(long, default_value_t = 0.8)]
    zipf: f64,
    /// Seconds at least between two turns of a session.
    #[arg(long, default_value_t = 2.0)]
    turn_gap_s: f64,
    /// Agents: every request a streamed chat completion whose group prefix is its `tools`
    /// block (one function, the prefix's words its description), a session's turns a think
    /// time apart (--think-min-s to --think-max-s) instead of --turn-gap-s.
    #[arg(long)]
    agents: bool,
    /// Shortest think time between an agent session's turns (seconds, with --agents).
    #[arg(long, default_value_t = 15.0)]
    think_min_s: f64,
    /// Longest think time (seconds, with --agents).
    #[arg(long, default_value_t = 60.0)]
    think_max_s: f64,
    /// Tenants, each its own `cache_salt` (0: none); a session keeps its tenant.
    #[arg(long, default_value_t = 0)]
    tenants: usize,
    /// Share of requests sent straight to the engines by a second router placing by prefix
    /// affinity (a hash of the request's group prefix and salt picks the engine; 0-1).
    #[arg(long, default_value_t = 0.0)]
    bypass: f64,
    /// When the target router is restarted (SIGTERM, then started again with the same
    /// configuration), as a share of --duration-s (negative: never); the engines' hit rate of
    /// the 10 s before and after is reported.
    #[arg(long, default_value_t = -1.0, allow_hyphen_values = true)]
    router_restart_at: f64,
    /// Output tokens per request (`max_tokens`).
    #[arg(long, default_value_t = 32)]
    output_tokens: u32,
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Each engine's prefix cache, blocks (`--kv-cache-blocks`).
    #[arg(long, default_value_t = 1024)]
    kv_cache_blocks: usize,
    /// Tokens per block (`--block-size`).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Prefill cost per uncached prompt token (microseconds, `--prefill-us-per-token`).
    #[arg(long, default_value_t = 200)]
    prefill_us_per_token: u64,
    /// Fixed prefill cost (milliseconds, `--ttft-ms`).
    #[arg(long, default_value_t = 20)]
    ttft_ms: u64,
    /// Gap between streamed tokens (milliseconds, `--tpot-ms`).
    #[arg(long, default_value_t = 20)]
    tpot_ms: u64,
    /// Token gap growth per other running request (microseconds).
    #[arg(long, default_value_t = 200)]
    tpot_per_running_us: u64,
    /// Prefills computed at once per engine (`--prefill-slots`).
    #[arg(long, default_value_t = 1)]
    prefill_slots: usize,
    /// Engines whose running requests hold their blocks in the prefix cache's capacity, as
    /// vLLM's block pool (the simulators' `--kv-pool`): a crowded engine evicts its cache and
    /// queues.
    #[arg(long)]
    kv_pool: bool,
    /// Token gap growth per KV block running requests hold (microseconds, with --kv-pool).
    #[arg(long, default_value_t = 0.0)]
    tpot_per_kv_block_us: f64,
    /// When engine e3 is restarted, as a share of --duration-s (negative: never).
    #[arg(long, default_value_t = 0.5, allow_hyphen_values = true)]
    restart_at: f64,
    /// TTFT SLO (seconds).
    #[arg(long, default_value_t = 2.0)]
    ttft_slo_s: f64,
    /// TPOT SLO (seconds).
    #[arg(long, default_value_t = 0.1)]
    tpot_slo_s: f64,
    /// Built-in targets to run, comma-separated (ours-exact, ours-approx, ours-blind,
    /// ours-tokens (ours-exact weighing load in KV tokens, `serving.placement_load`),
    /// round-robin).
    #[arg(long, default_value = "ours-exact,ours-approx,ours-blind,round-robin")]
    targets: String,
    /// A peer router, `NAME=COMMAND` (placeholders as the comparison's, plus
    /// {kv_event_sources} and {kv_event_replay_sources}: `URL=tcp://HOST:PORT` per engine,
    /// space-separated). Repeatable.
    #[arg(long = "peer", value_name = "NAME=COMMAND")]
    peers: Vec<String>,
    /// JSON merged over our routers' fleet files (all `ours-*` targets and the standby
    /// figure's), e.g. `{"serving": {"kv_balance_abs_threshold": 32}}`.
    #[arg(long, default_value = "{}")]
    ours_fleet: String,
    /// Seconds of the standby figure's run (0: no standby figure); the primary is killed
    /// 10 s before its end.
    #[arg(long, default_value_t = 30.0)]
    standby_s: f64,
    /// Seconds a target may take to answer its first request.
    #[arg(long, default_value_t = 120.0)]
    start_timeout: f64,
    /// Seconds a request may take before it counts as failed.
    #[arg(long, default_value_t = 120.0)]
    request_timeout: f64,
    /// Seconds from the start of each target's run whose requests are sent but not counted:
    /// the hit rate is the engines' counters from then on, and SLO, TTFT, throughput and failures
    /// count the requests sent from then on (cold caches fill first). The per-10 s SLO line
    /// still shows every window.
    #[arg(long, default_value_t = 0.0)]
    warmup_s: f64,
    /// Keep the run's directory (every process's log, our routers' journals and fleet files)
    /// instead of removing it; its path is printed.
    #[arg(long)]
    keep_dir: bool,
    /// Write the markdown table here too.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One request's outcome as the client saw it.
#[derive(Debug, Clone, Copy, Default)]
struct Outcome {
    /// Seconds from sending to the first token chunk.
    ttft: Option<f64>,
    /// Seconds per token after the first.
    tpot: Option<f64>,
    /// Seconds from the run's start to the end of the answer.
    end_s: f64,
    /// Seconds from the run's start to sending it.
    sent_s: f64,
    /// A whole 200 stream.
    ok: bool,
}

/// Prefix-cache counters summed over engines (tokens), and requests served.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    hits: u64,
    queries: u64,
    requests: u64,
}

impl Counts {
    fn minus(self, o: Counts) -> Counts {
        Counts {
            hits: self.hits.saturating_sub(o.hits),
            queries: self.queries.saturating_sub(o.queries),
            requests: self.requests.saturating_sub(o.requests),
        }
    }
    fn plus(self, o: Counts) -> Counts {
        Counts {
            hits: self.hits + o.hits,
            queries: self.queries + o.queries,
            requests: self.requests + o.requests,
        }
    }
    fn rate(self) -> f64 {
        self.hits as f64 / self.queries.max(1) as f64
    }
}

/// One target's figures.
#[derive(Debug, Clone)]
struct Row {
    name: String,
    what: String,
    counts: Counts,
    ttft_p50: Option<f64>,
    ttft_p90: Option<f64>,
    slo_met: usize,
    completed: usize,
    requests: usize,
    throughput: f64,
    goodput: f64,
    wall_s: f64,
    /// Per engine, config order (the restarted engine's two processes together).
    engines: Vec<Counts>,
    /// SLO attainment of the requests sent in each 10 s of the run (0-1).
    slo_by_10s: Vec<f64>,
    /// The router-restart figure (`--router-restart-at`).
    restart: Option<Restart>,
}

/// A simulator's prefix-cache counters (`/sim/stats`), tried a few times: a simulator queueing
/// hundreds of prefills may answer slowly, and a lost reading would lose the run.
async fn counts_of(sim: &SimHandle) -> Result<Counts, String> {
    let http = reqwest::Client::new();
    let url = format!("{}/stats", sim.admin_url());
    let mut last = String::new();
    for _ in 0..5 {
        let r = http.get(&url).timeout(Duration::from_secs(20)).send().await;
        match r {
            Ok(r) if r.status().is_success() => match r.json::<SimStats>().await {
                Ok(st) => {
                    let cache = st.prefix_cache.as_ref();
                    return Ok(Counts {
                        hits: cache.map_or(0, |c| c.hits),
                        queries: cache.map_or(0, |c| c.queries),
                        requests: st.requests.aggregated,
                    });
                }
                Err(e) => last = e.to_string(),
            },
            Ok(r) => last = format!("status {}", r.status()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!("{url}: {last}"))
}

async fn counts_all(sims: &[SimHandle]) -> Result<Counts, String> {
    Ok(counts_each(sims)
        .await?
        .into_iter()
        .fold(Counts::default(), Counts::plus))
}

async fn counts_each(sims: &[SimHandle]) -> Result<Vec<Counts>, String> {
    let mut out = Vec::new();
    for s in sims {
        out.push(counts_of(s).await?);
    }
    Ok(out)
}

/// One streamed completion (`body`) to `urls[0]`, trying again while `urls` holds more than
/// one URL (the standby figure: the primary, then the standby; a router restart: the old
/// router, then the new one) until `deadline`.
async fn one(
    http: reqwest::Client,
    urls: Arc<Mutex<Vec<String>>>,
    body: Arc<Value>,
    deadline: Instant,
    start: Instant,
) -> Outcome {
    let chat = body.get("messages").is_some();
    let (path, token_key) = if chat {
        ("chat/completions", "\"content\":\"")
    } else {
        ("completions", "\"text\"")
    };
    let t0 = Instant::now();
    let sent_s = start.elapsed().as_secs_f64();
    let mut fail = Outcome {
        sent_s,
        ..Outcome::default()
    };
    loop {
        let url = urls.lock().unwrap_or_else(|e| e.into_inner())[0].clone();
        let r = http
            .post(format!("{url}/v1/{path}"))
            .json(&*body)
            .send()
            .await;
        let r = match r {
            Ok(r) if r.status().is_success() => r,
            _ => {
                let many = urls.lock().unwrap_or_else(|e| e.into_inner()).len() > 1;
                if many && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                fail.end_s = start.elapsed().as_secs_f64();
                return fail;
            }
        };
        let mut first = None;
        let mut chunks = 0usize;
        let mut done = false;
        let mut s = r.bytes_stream();
        while let Some(c) = s.next().await {
            let Ok(c) = c else { break };
            let t = String::from_utf8_lossy(&c);
            // A chat stream's first chunk names the role with empty content: no token.
            let n = t.matches(token_key).count() - t.matches("\"content\":\"\"").count();
            if n > 0 {
                first.get_or_insert(t0.elapsed().as_secs_f64());
                chunks += n;
            }
            done |= t.contains("[DONE]");
        }
        let end = t0.elapsed().as_secs_f64();
        let tpot = match (first, done, chunks) {
            (Some(f), true, n) if n > 1 => Some((end - f) / (n - 1) as f64),
            (Some(_), true, _) => Some(0.0),
            _ => None,
        };
        return Outcome {
            ttft: first,
            tpot,
            end_s: start.elapsed().as_secs_f64(),
            sent_s,
            ok: done && first.is_some(),
        };
    }
}

fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    Some(v[i])
}

fn sim_flags(a: &Args) -> Vec<String> {
    [
        ("--prefill-slots", a.prefill_slots.to_string()),
        ("--prefill-us-per-token", a.prefill_us_per_token.to_string()),
        ("--ttft-ms", a.ttft_ms.to_string()),
        ("--tpot-ms", a.tpot_ms.to_string()),
        ("--tpot-per-running-us", a.tpot_per_running_us.to_string()),
        ("--kv-cache-blocks", a.kv_cache_blocks.to_string()),
        ("--block-size", a.block_size.to_string()),
        ("--max-model-len", "65536".to_string()),
        ("--threads", "2".to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .chain(
        a.kv_pool
            .then(|| {
                [
                    "--kv-pool".to_string(),
                    "--tpot-per-kv-block-us".to_string(),
                    a.tpot_per_kv_block_us.to_string(),
                ]
            })
            .into_iter()
            .flatten(),
    )
    .collect()
}

/// Where an engine publishes its KV events (as the router and peers connect to them).
#[derive(Debug, Clone)]
struct Events {
    endpoint: String,
    replay: String,
}

fn engines(dir: &std::path::Path, a: &Args) -> Result<(Vec<SimHandle>, Vec<Events>), String> {
    let flags = sim_flags(a);
    let mut sims = Vec::new();
    let mut events = Vec::new();
    for i in 0..a.engines {
        let (p, r) = (engine_port(), engine_port());
        let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": format!("tcp://*:{p}"), "replay_endpoint": format!("tcp://*:{r}")});
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        let cfg = cfg.to_string();
        args.extend(["--kv-events-config", cfg.as_str()]);
        let s = start_sim(
            dir,
            &EngineSpec::new(&format!("e{i}"), "decode").args(&args),
            "vllm",
        )
        .map_err(|e| format!("simulator e{i}: {e}"))?;
        sims.push(s);
        events.push(Events {
            endpoint: format!("tcp://127.0.0.1:{p}"),
            replay: format!("tcp://127.0.0.1:{r}"),
        });
    }
    Ok((sims, events))
}

/// Restarts every simulator (cold caches, counters at 0), on blocking threads.
async fn restart_all(sims: &mut Vec<SimHandle>) -> Result<(), String> {
    let mut handles = Vec::new();
    for mut s in sims.drain(..) {
        handles.push(tokio::task::spawn_blocking(move || {
            s.restart(&[]).map(|()| s).map_err(|e| e.to_string())
        }));
    }
    for h in handles {
        sims.push(h.await.map_err(|e| e.to_string())??);
    }
    Ok(())
}

/// Our router's fleet file over `sims`: `kv` gives each engine's `kv_events`.
fn ours_fleet(sims: &[SimHandle], kv: Option<Vec<Value>>, a: &Args) -> FleetSpec {
    let mut spec = FleetSpec::for_sims("vllm", sims).with(json!({
        "slo": {"ttft_s": a.ttft_slo_s, "tpot_s": a.tpot_slo_s},
        "serving": {"max_connections": 4096},
        "engine": {"first_token_timeout_s": a.request_timeout,
                    "decode_read_timeout_s": a.request_timeout},
    }));
    if let Ok(extra) = serde_json::from_str::<Value>(&a.ours_fleet) {
        spec = spec.with(extra);
    }
    if let Some(kv) = kv {
        for (s, k) in sims.iter().zip(kv) {
            spec = spec.engine_with(&s.iid, json!({"kv_events": k}));
        }
    }
    spec
}

/// The shapes built.
const BUILT: &str = "default, hot-prefix, documents, control, agents, tenants, bypass, restart";

/// The flags a `--shape` preset stands for (`Err`: a shape not built yet, or unknown).
///
/// - `hot-prefix`: 2 groups of 4-6k-token prefixes, 1,024 output tokens, on engines whose
///   running requests hold their KV in the cache's capacity (`--kv-pool`, 1,024 blocks of 16
///   tokens, a token gap that grows with the blocks held): piling the hot prefix on one engine
///   crowds it.
/// - `documents`: 400 documents of 6-8k tokens, weakly skewed, no sessions: about 2.8M tokens
///   of documents against 4 × 6,000 blocks of 16 (384k tokens) of cache; how much of them a run
///   touches grows with its length (the header prints the working set).
/// - `control`: no reuse (every prompt a unique 2,000-token question, no prefix, no
///   sessions): cache awareness must cost nothing here.
/// - `agents`: 8 agent kinds, each a 2-4k-token `tools` block, as chat completions; 256
///   sessions of up to 8 turns whose next turn comes 15-60 s of think time after the last
///   (an arrival whose session is thinking is a one-shot call of its kind instead): a
///   session's context is worth keeping across a long idle gap.
/// - `tenants`: one system prompt of 4-6k tokens shared by 8 tenants, each its own
///   `cache_salt` (so 8 copies in the caches, none shared), sessions keeping their tenant: a
///   router that credits a prefix across tenants places on caches that miss.
/// - `bypass`: the default trace with a quarter of the requests sent straight to the engines by
///   a second router placing by prefix affinity (a hash of the group prefix picks the engine):
///   the engines' KV events show what they stored, our own placements cannot.
/// - `restart`: the default trace, the target router restarted (SIGTERM, then started again)
///   half way through and no engine restarted: the hit rate of the 10 s from the restart
///   against the 10 s before.
fn preset(shape: &str) -> Result<&'static [&'static str], String> {
    Ok(match shape {
        "default" => &[],
        "hot-prefix" => &[
            "--groups",
            "2",
            "--prefix-min",
            "4000",
            "--prefix-max",
            "6000",
            "--output-tokens",
            "1024",
            "--session-share",
            "0",
            "--kv-pool",
            "--tpot-per-kv-block-us",
            "20",
            "--kv-cache-blocks",
            "1024",
            "--block-size",
            "16",
        ],
        "documents" => &[
            "--groups",
            "400",
            "--prefix-min",
            "6000",
            "--prefix-max",
            "8000",
            "--zipf",
            "0.6",
            "--session-share",
            "0",
            "--kv-cache-blocks",
            "6000",
        ],
        "control" => &[
            "--groups",
            "1",
            "--prefix-min",
            "0",
            "--prefix-max",
            "0",
            "--question-tokens",
            "2000",
            "--session-share",
            "0",
        ],
        "tenants" => &[
            "--groups",
            "1",
            "--prefix-min",
            "4000",
            "--prefix-max",
            "6000",
            "--tenants",
            "8",
        ],
        "bypass" => &["--bypass", "0.25"],
        "restart" => &["--restart-at", "-1", "--router-restart-at", "0.5"],
        "agents" => &[
            "--agents",
            "--groups",
            "8",
            "--prefix-min",
            "2000",
            "--prefix-max",
            "4000",
            "--session-share",
            "0.9",
            "--sessions",
            "256",
            "--turns",
            "8",
            "--answer-tokens",
            "120",
        ],
        other => {
            return Err(format!("--shape {other}: unknown ({BUILT})"));
        }
    })
}

/// `argv` with the `--shape` preset's flags inserted before the caller's, so theirs win.
fn with_preset(argv: Vec<String>) -> Result<Vec<String>, String> {
    let shape = argv
        .iter()
        .position(|a| a == "--shape")
        .and_then(|i| argv.get(i + 1).cloned())
        .or_else(|| {
            argv.iter()
                .find_map(|a| a.strip_prefix("--shape=").map(str::to_string))
        })
        .unwrap_or_else(|| "default".into());
    let flags = preset(&shape)?;
    let mut out = argv[..1.min(argv.len())].to_vec();
    out.extend(flags.iter().map(|f| (*f).to_string()));
    out.extend(argv.into_iter().skip(1));
    Ok(out)
}

/// `narwhal-bench prefix ...` (see the module doc).
pub(crate) async fn main(argv: Vec<String>) -> std::process::ExitCode {
    let argv = match with_preset(argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("narwhal-bench prefix: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match run(Args::parse_from(argv)).await {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("narwhal-bench prefix: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn shape(a: &Args) -> Shape {
    Shape {
        groups: a.groups,
        prefix_tokens: (a.prefix_min, a.prefix_max.max(a.prefix_min)),
        question_tokens: a.question_tokens,
        sessions: a.sessions,
        turns: a.turns.max(1),
        user_tokens: a.user_tokens,
        answer_tokens: a.answer_tokens,
        session_share: a.session_share,
        zipf: a.zipf,
        turn_gap_s: a.turn_gap_s,
        tenants: a.tenants,
        bypass: a.bypass,
        agents: a.agents.then_some((a.think_min_s, a.think_max_s)),
    }
}

/// What the trace is sent at and measured against: the rate, the capacities it comes from,
/// and the oracle of the trace sent.
struct Plan {
    oracle: prefix_trace::Oracle,
    rate: f64,
    cap_oracle: f64,
    cap_blind: f64,
}

/// The trace of `shp` at `--rate`, or at `--load` times the capacity at the oracle's hit rate,
/// and its plan.
fn workload(a: &Args, shp: &Shape) -> (Vec<Request>, Plan) {
    // The trace's prompts barely depend on the rate (only a session's minimum turn gap is
    // checked against arrival times), so the rate comes from the oracle of a trace at the
    // cache-blind capacity, and the oracle is then computed again on the trace sent.
    let capacity_blocks = a.engines * a.kv_cache_blocks;
    let slots = a.engines as f64 * a.prefill_slots.max(1) as f64;
    let per_req =
        |uncached: f64| a.ttft_ms as f64 / 1e3 + uncached * a.prefill_us_per_token as f64 / 1e6;
    let blind_trace = prefix_trace::generate(shp, 1.0, a.duration_s, a.seed);
    let cap_blind = slots / per_req(mean_tokens(&blind_trace));
    let probe_trace = prefix_trace::generate(shp, cap_blind, a.duration_s, a.seed);
    let probe = prefix_trace::oracle(&probe_trace, a.block_size, capacity_blocks);
    let cap_oracle =
        (slots / per_req(probe.mean_uncached(probe_trace.len()))).min(decode_capacity(a));
    let rate = a.rate.unwrap_or(a.load * cap_oracle);
    let trace = prefix_trace::generate(shp, rate, a.duration_s, a.seed);
    let oracle = prefix_trace::oracle(&trace, a.block_size, capacity_blocks);
    (
        trace,
        Plan {
            oracle,
            rate,
            cap_oracle,
            cap_blind,
        },
    )
}

/// Requests per second the engines can decode within the TPOT SLO: per engine, the most
/// requests running at once whose token gap (`--tpot-ms`, plus `--tpot-per-running-us` per
/// other one, plus `--tpot-per-kv-block-us` per block held: one group prefix of the mean
/// length, shared, and each request's own question, output and partial block) stays within the
/// SLO, and with `--kv-pool` whose blocks fit in `--kv-cache-blocks` beside that prefix; each
/// runs `--output-tokens` gaps. Unbounded (a prefill-only capacity) when the gap never grows
/// and the pool is off.
fn decode_capacity(a: &Args) -> f64 {
    let bs = a.block_size.max(1) as f64;
    let out = f64::from(a.output_tokens.max(1));
    let prefix = ((a.prefix_min + a.prefix_max.max(a.prefix_min)) as f64 / 2.0 / bs).floor();
    let own = ((out + a.question_tokens as f64) / bs).ceil() + 1.0;
    let gap = |c: f64| {
        a.tpot_ms as f64 / 1e3
            + a.tpot_per_running_us as f64 / 1e6 * (c - 1.0)
            + if a.kv_pool {
                a.tpot_per_kv_block_us / 1e6 * (prefix + own * c)
            } else {
                0.0
            }
    };
    let by_blocks = if a.kv_pool {
        ((a.kv_cache_blocks as f64 - prefix) / own).floor().max(1.0)
    } else {
        f64::INFINITY
    };
    let grows = a.tpot_per_running_us > 0 || (a.kv_pool && a.tpot_per_kv_block_us > 0.0);
    if !grows && by_blocks.is_infinite() {
        return f64::INFINITY;
    }
    // The largest concurrency within both bounds (at least one).
    let mut c = 1.0_f64;
    while c < by_blocks && c < 100_000.0 && gap(c + 1.0) <= a.tpot_slo_s {
        c += 1.0;
    }
    a.engines as f64 * c / (out * gap(c).max(1e-6))
}

/// Mean prompt tokens of a trace.
fn mean_tokens(t: &[Request]) -> f64 {
    t.iter().map(Request::tokens).sum::<usize>() as f64 / t.len().max(1) as f64
}

/// The run's header: the workload, the engines, the capacities and SLO, the oracle.
fn header(a: &Args, trace: &[Request], plan: &Plan) -> String {
    let Plan {
        oracle,
        rate,
        cap_oracle,
        cap_blind,
    } = plan;
    let capacity_blocks = a.engines * a.kv_cache_blocks;
    let mean_tokens = mean_tokens(trace);
    let turns = trace
        .iter()
        .filter(|r| matches!(r.kind, Kind::Turn(_)))
        .count();
    let working: usize = {
        let mut seen = std::collections::HashSet::new();
        for r in trace {
            for s in &r.segments {
                seen.insert((s.tag.clone(), s.len));
            }
        }
        seen.iter().map(|(_, l)| l / a.block_size).sum()
    };
    format!(
        "narwhal-bench prefix: {} requests in {} s at {rate:.2}/s ({} questions, {turns} session turns), mean prompt {mean_tokens:.0} tokens; {} groups, prefixes {}-{} tokens, zipf {}\n\
         engines: {} x (prefill {} us/token + {} ms, {} prefill slot(s), tpot {} ms + {} us/running, {} blocks of {} tokens); working set ~{working} blocks vs {capacity_blocks} in all\n\
         capacity: {cap_oracle:.2}/s at the oracle's hit rate (the least of prefill's and decode's; decode alone {:.2}/s), {cap_blind:.2}/s cache-blind; shape {} ({} tenants, {:.0}% sent straight to the engines, router restart at {}, the first {} s not counted); SLO: TTFT <= {} s and TPOT <= {} s; our fleet files + {}\n\
         oracle (one pooled LRU cache of {capacity_blocks} blocks, arrival order): {:.3}; unbounded cache: {:.3}\n",
        trace.len(),
        a.duration_s,
        trace.len() - turns,
        a.groups,
        a.prefix_min,
        a.prefix_max,
        a.zipf,
        a.engines,
        a.prefill_us_per_token,
        a.ttft_ms,
        a.prefill_slots,
        a.tpot_ms,
        a.tpot_per_running_us,
        a.kv_cache_blocks,
        a.block_size,
        decode_capacity(a),
        a.shape,
        a.tenants,
        100.0 * a.bypass,
        if a.router_restart_at >= 0.0 {
            format!("{} s", a.router_restart_at * a.duration_s)
        } else {
            "none".into()
        },
        a.warmup_s,
        a.ttft_slo_s,
        a.tpot_slo_s,
        a.ours_fleet,
        oracle.hit_rate(),
        oracle.reuse_rate(),
    )
}

async fn run(a: Args) -> Result<bool, String> {
    if a.engines < 2 || a.groups == 0 || a.duration_s <= 0.0 || a.block_size == 0 {
        return Err("--engines must be at least 2, --groups and --block-size at least 1, --duration-s positive".into());
    }
    if !(0.0..a.duration_s).contains(&a.warmup_s)
        || (a.restart_at >= 0.0 && a.warmup_s >= a.restart_at * a.duration_s)
    {
        return Err(format!(
            "--warmup-s {}: at least 0, less than --duration-s and before the engine restart (--restart-at -1 turns it off)",
            a.warmup_s
        ));
    }
    if a.router_restart_at >= 0.0 && a.restart_at >= 0.0 {
        return Err("--router-restart-at and --restart-at: restart the router or an engine in a run, not both (--restart-at -1)".into());
    }
    if !(0.0..=1.0).contains(&a.bypass) {
        return Err(format!("--bypass {}: a share, 0 to 1", a.bypass));
    }
    let defs = target_defs(&a)?;
    serde_json::from_str::<Value>(&a.ours_fleet)
        .ok()
        .filter(Value::is_object)
        .ok_or("--ours-fleet: not a JSON object")?;
    let shp = shape(&a);
    let (trace, plan) = workload(&a, &shp);
    let mut head = header(&a, &trace, &plan);
    print!("{head}");
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let mut dir = tempfile::Builder::new()
        .prefix("narwhal-bench-prefix-")
        .tempdir()
        .map_err(|e| e.to_string())?;
    if a.keep_dir {
        dir.disable_cleanup(true);
        println!(
            "  logs, journals and fleet files stay in {}",
            dir.path().display()
        );
    }
    let (mut sims, events) = engines(dir.path(), &a)?;
    let http = narwhal_testkit::http_client()
        .timeout(Duration::from_secs_f64(a.request_timeout))
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| e.to_string())?;
    let bin_dir = narwhal_testkit::bin_path("narwhal-serve")
        .parent()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let oracle = plan.oracle;
    let trace = Arc::new(trace);
    let mut rows = Vec::new();
    let mut all_ok = true;
    for (ti, def) in defs.iter().enumerate() {
        if ti > 0 {
            restart_all(&mut sims).await?;
        }
        let urls: Vec<String> = sims.iter().map(|s| s.url.clone()).collect();
        let (launch, command) = start_target(&a, def, dir.path(), &sims, &events, &bin_dir)?;
        let (mut running, url) = launch.start()?;
        // Ready: a one-word prompt (no full block: nothing cached, nothing stored).
        let targets: Vec<String> = if url.is_empty() {
            urls.clone()
        } else {
            vec![url.clone()]
        };
        wait_ready(&a, def, &http, &mut running, &targets).await?;
        let target = Target {
            def,
            launch: &launch,
            running: &mut running,
            url: &url,
        };
        let row = drive(&a, &http, target, &mut sims, &trace).await?;
        print_row(&row);
        if let Some(c) = &command {
            head.push_str(&format!("  {}: {c}\n", def.name));
        }
        all_ok &= row.completed > 0;
        rows.push(row);
        if let Some(p) = &a.out {
            // What is measured so far, in case a later target fails the run.
            let partial = table(&rows, oracle, None);
            std::fs::write(p, format!("{head}\n{partial}"))
                .map_err(|e| format!("{}: {e}", p.display()))?;
        }
        if let Running::Ours(r) = &running {
            print_kv_index(r).await;
        }
        let _ = std::io::Write::flush(&mut std::io::stdout());
        drop(running);
    }
    drop(sims);
    let standby = if a.standby_s > 10.0 {
        Some(standby_figure(&a, &shp, plan.rate).await?)
    } else {
        None
    };
    let table = table(&rows, oracle, standby.as_ref());
    println!("\n{table}");
    if let Some(p) = &a.out {
        std::fs::write(p, format!("{head}\n{table}"))
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    if let Some(p) = &a.json {
        let doc = json_doc(&a, &plan, trace.len(), &rows, standby.as_ref());
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(p, text + "\n").map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(all_ok)
}

/// A target's figures as they are measured: hit rate, SLO, TTFT, per engine, SLO per 10 s.
fn print_row(row: &Row) {
    println!(
        "  {}: hit rate {:.3}, SLO {}/{}, TTFT p50 {:.3} s; per engine requests (hit rate): {}",
        row.name,
        row.counts.rate(),
        row.slo_met,
        row.requests,
        row.ttft_p50.unwrap_or(f64::NAN),
        row.engines
            .iter()
            .map(|c| format!("{} ({:.2})", c.requests, c.rate()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(r) = &row.restart {
        println!(
            "    router restart: hit rate {:.3} in the 10 s before, {:.3} in the 10 s from it (x{:.2}); listening and answering again after {:.1} s",
            r.before.rate(),
            r.after.rate(),
            r.after.rate() / r.before.rate().max(1e-9),
            r.down_s
        );
    }
    println!(
        "    SLO met per 10 s of sending: {}",
        row.slo_by_10s
            .iter()
            .map(|x| format!("{:.0}%", 100.0 * x))
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// Our router's own view of the engines at the end (modes, tokenizer), for the record.
async fn print_kv_index(r: &narwhal_testkit::RouterHandle) {
    let kv = r.state().await.kv_index;
    let modes: Vec<String> = kv
        .engines
        .iter()
        .map(|(k, v)| format!("{k}:{}", v.mode))
        .collect();
    let checks: Vec<String> = kv
        .engines
        .iter()
        .map(|(k, v)| {
            let c = &v.credit;
            format!(
                "{k}:{}/{} over ({} tokens over, {} under)",
                c.over_credited, c.checked, c.over_tokens, c.under_tokens
            )
        })
        .collect();
    println!(
        "    credit check (over-credited/checked): {}",
        checks.join(" ")
    );
    println!(
        "    kv_index at the end: modes {}; tokenizer {}, {} prompts tokenized ({:.2} ms each), {} tokenize failures",
        modes.join(" "),
        kv.tokenizer,
        kv.tokenized,
        1e3 * kv.tokenize_seconds / kv.tokenized.max(1) as f64,
        kv.tokenize_failures
    );
}

/// The `--json` document: the configuration, the capacities and oracle, every target's row
/// and the standby figure.
fn json_doc(
    a: &Args,
    plan: &Plan,
    requests: usize,
    rows: &[Row],
    standby: Option<&Standby>,
) -> Value {
    let Plan {
        oracle,
        rate,
        cap_oracle,
        cap_blind,
    } = plan;
    json!({
        "schema": "narwhal.bench.prefix",
        "version": 1,
        "config": {
            "duration_s": a.duration_s, "rate": rate, "load": a.load, "seed": a.seed,
            "groups": a.groups, "prefix_tokens": [a.prefix_min, a.prefix_max],
            "question_tokens": a.question_tokens, "sessions": a.sessions, "turns": a.turns,
            "engines": a.engines, "kv_cache_blocks": a.kv_cache_blocks,
            "block_size": a.block_size, "prefill_us_per_token": a.prefill_us_per_token,
            "ttft_ms": a.ttft_ms, "tpot_ms": a.tpot_ms, "prefill_slots": a.prefill_slots,
            "ttft_slo_s": a.ttft_slo_s, "tpot_slo_s": a.tpot_slo_s,
            "restart_at": a.restart_at, "router_restart_at": a.router_restart_at,
            "warmup_s": a.warmup_s,
            "tenants": a.tenants, "bypass": a.bypass, "shape": a.shape,
            "ours_fleet": serde_json::from_str::<Value>(&a.ours_fleet).unwrap_or_default(),
        },
        "requests": requests,
        "capacity": {"oracle": cap_oracle, "blind": cap_blind},
        "oracle": {"hit_rate": oracle.hit_rate(), "unbounded_hit_rate": oracle.reuse_rate(),
                   "tokens": oracle.tokens, "hits": oracle.hits},
        "targets": rows.iter().map(|r| json!({
            "name": r.name, "what": r.what,
            "hit_rate": r.counts.rate(), "hits": r.counts.hits, "queries": r.counts.queries,
            "ratio_to_oracle": r.counts.rate() / oracle.hit_rate().max(1e-9),
            "ttft_p50_s": r.ttft_p50, "ttft_p90_s": r.ttft_p90,
            "slo_attainment": r.slo_met as f64 / r.requests.max(1) as f64,
            "slo_met": r.slo_met, "completed": r.completed, "requests": r.requests,
            "throughput_rps": r.throughput, "goodput_rps": r.goodput, "wall_s": r.wall_s,
            "slo_by_10s": r.slo_by_10s,
            "router_restart": r.restart.map(|x| json!({
                "hit_rate_before": x.before.rate(), "hit_rate_after": x.after.rate(),
                "ratio": x.after.rate() / x.before.rate().max(1e-9), "down_s": x.down_s,
                "before": {"hits": x.before.hits, "queries": x.before.queries},
                "after": {"hits": x.after.hits, "queries": x.after.queries},
            })),
            "engines": r.engines.iter().map(|c| json!({
                "requests": c.requests, "hits": c.hits, "queries": c.queries,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "standby": standby.map(Standby::to_json),
    })
}

/// The router-restart figure: the engines' counters in the 10 s before the restart and the
/// 10 s from it, and how long the target took to listen again.
#[derive(Debug, Clone, Copy)]
struct Restart {
    before: Counts,
    after: Counts,
    down_s: f64,
}

/// Sends the trace to the target (a request marked direct to the engine its prefix affinity
/// picks instead; round robin: request i to engine i mod N),
/// restarting the last engine at `--restart-at` and the target router at
/// `--router-restart-at`; the row of figures.
async fn drive(
    a: &Args,
    http: &reqwest::Client,
    mut target: Target<'_>,
    sims: &mut Vec<SimHandle>,
    trace: &Arc<Vec<Request>>,
) -> Result<Row, String> {
    let mut before = counts_each(sims).await?;
    let mut warm = a.warmup_s <= 0.0;
    let engine_urls: Vec<String> = sims.iter().map(|s| s.url.clone()).collect();
    let restart_s = (a.restart_at >= 0.0).then_some(a.restart_at * a.duration_s);
    let mut restarted = restart_s.is_none();
    let mut dead = Counts::default();
    // The router restart: counters sampled 10 s before it, at it, and 10 s after.
    let marks_at: Vec<f64> = if a.router_restart_at >= 0.0 && !target.url.is_empty() {
        let at = a.router_restart_at * a.duration_s;
        vec![at - 10.0, at, at + 10.0]
    } else {
        Vec::new()
    };
    let mut marks = Vec::new();
    let mut relaunch = None;
    let routed = Arc::new(Mutex::new(vec![target.url.to_string()]));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut restart_task = None;
    for (i, r) in trace.iter().enumerate() {
        while marks.len() < marks_at.len() && r.at_s >= marks_at[marks.len()] {
            let at = marks_at[marks.len()].max(0.0);
            tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
            marks.push(counts_all(sims).await?);
            if marks.len() == 2 {
                relaunch = Some(restart_router(&mut target, &routed, http));
            }
        }
        if !warm && r.at_s >= a.warmup_s {
            // The counters from here on are the run's (the engine restart comes later).
            let at = start + Duration::from_secs_f64(a.warmup_s);
            tokio::time::sleep_until(at.into()).await;
            before = counts_each(sims).await?;
            warm = true;
        }
        let due = start + Duration::from_secs_f64(r.at_s);
        if !restarted && r.at_s >= restart_s.unwrap_or(f64::MAX) {
            tokio::time::sleep_until(
                (start + Duration::from_secs_f64(restart_s.unwrap_or(0.0))).into(),
            )
            .await;
            // Its counters go with the process: keep what it counted.
            let mut s = sims.pop().ok_or("no engine")?;
            dead = counts_of(&s).await?;
            restart_task = Some(tokio::task::spawn_blocking(move || {
                s.restart(&[]).map(|()| s).map_err(|e| e.to_string())
            }));
            restarted = true;
        }
        tokio::time::sleep_until(due.into()).await;
        let urls = if target.url.is_empty() {
            Arc::new(Mutex::new(vec![engine_urls[i % engine_urls.len()].clone()]))
        } else if r.direct {
            let e = (r.affinity() % engine_urls.len() as u64) as usize;
            Arc::new(Mutex::new(vec![engine_urls[e].clone()]))
        } else {
            routed.clone()
        };
        let (http, body) = (http.clone(), Arc::new(r.body(MODEL, a.output_tokens)));
        let deadline = Instant::now() + Duration::from_secs_f64(a.request_timeout);
        tasks.spawn(async move { one(http, urls, body, deadline, start).await });
    }
    while marks.len() < marks_at.len() {
        let at = marks_at[marks.len()].max(0.0);
        tokio::time::sleep_until((start + Duration::from_secs_f64(at)).into()).await;
        marks.push(counts_all(sims).await?);
    }
    if let Some(t) = restart_task {
        let fresh = t.await.map_err(|e| e.to_string())??;
        sims.push(fresh);
    }
    let mut outcomes = Vec::new();
    while let Some(o) = tasks.join_next().await {
        outcomes.push(o.map_err(|e| e.to_string())?);
    }
    let down_s = match relaunch {
        Some(t) => {
            let (running, down_s) = t.await.map_err(|e| e.to_string())??;
            *target.running = running;
            down_s
        }
        None => 0.0,
    };
    let wall = start.elapsed().as_secs_f64();
    let mut after = counts_each(sims).await?;
    if let Some(last) = after.last_mut() {
        *last = last.plus(dead);
    }
    let each: Vec<Counts> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.minus(*b))
        .collect();
    let mut row = row(
        a,
        target.def,
        each.iter().copied().fold(Counts::default(), Counts::plus),
        &outcomes,
        wall,
    );
    row.engines = each;
    if let [m0, m1, m2] = marks[..] {
        row.restart = Some(Restart {
            before: m1.minus(m0),
            after: m2.minus(m1),
            down_s,
        });
    }
    Ok(row)
}

/// Whether `o` completed within both SLOs.
fn meets(a: &Args, o: &Outcome) -> bool {
    o.ok && o.ttft.is_some_and(|t| t <= a.ttft_slo_s) && o.tpot.is_some_and(|t| t <= a.tpot_slo_s)
}

/// A target's figures from its outcomes: those sent from `--warmup-s` on, but the per-10 s
/// SLO line (every window).
fn row(a: &Args, def: &TargetDef, counts: Counts, all: &[Outcome], wall: f64) -> Row {
    let outcomes: Vec<Outcome> = all
        .iter()
        .filter(|o| o.sent_s >= a.warmup_s)
        .copied()
        .collect();
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let mut ttfts: Vec<f64> = ok.iter().filter_map(|o| o.ttft).collect();
    let met = ok.iter().filter(|o| meets(a, o)).count();
    let last = ok
        .iter()
        .map(|o| o.end_s - a.warmup_s)
        .fold(0.0f64, f64::max);
    Row {
        name: def.name.clone(),
        what: def.what.clone(),
        counts,
        ttft_p50: quantile(&mut ttfts, 0.5),
        ttft_p90: quantile(&mut ttfts, 0.9),
        slo_met: met,
        completed: ok.len(),
        requests: outcomes.len(),
        throughput: ok.len() as f64 / last.max(1e-9),
        goodput: met as f64 / (a.duration_s - a.warmup_s),
        wall_s: wall,
        engines: Vec::new(),
        restart: None,
        slo_by_10s: (0..(a.duration_s / 10.0).ceil() as usize)
            .map(|w| {
                let (lo, hi) = (w as f64 * 10.0, (w + 1) as f64 * 10.0);
                let mine: Vec<&Outcome> = all
                    .iter()
                    .filter(|o| (lo..hi).contains(&o.sent_s))
                    .collect();
                let met = mine.iter().filter(|o| meets(a, o)).count();
                met as f64 / mine.len().max(1) as f64
            })
            .collect(),
    }
}

/// The standby figure.
#[derive(Debug, Clone)]
struct Standby {
    before: Counts,
    after: Counts,
    takeover_s: Option<f64>,
    failed: usize,
    requests: usize,
    /// Failed requests sent in the 10 s before the kill and in the 10 s after it.
    failed_before: usize,
    failed_after: usize,
}

impl Standby {
    fn to_json(&self) -> Value {
        json!({
            "hit_rate_before": self.before.rate(), "hit_rate_after": self.after.rate(),
            "ratio": self.after.rate() / self.before.rate().max(1e-9),
            "before": {"hits": self.before.hits, "queries": self.before.queries},
            "after": {"hits": self.after.hits, "queries": self.after.queries},
            "takeover_s": self.takeover_s, "failed": self.failed, "requests": self.requests,
            "failed_before": self.failed_before, "failed_after": self.failed_after,
        })
    }
}

/// Ours exact as a primary with a warm standby (file lease, one agent per engine) on a fleet
/// of its own; the trace at `rate` for `--standby-s`, `kill -9` of the primary 10 s before the
/// end; the simulators' hit rate in the 10 s before and the 10 s after.
async fn standby_figure(a: &Args, shp: &Shape, rate: f64) -> Result<Standby, String> {
    let flags = sim_flags(a);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let f = narwhal_testkit::Fleet::builder()
        .decode(a.engines)
        .kv_events()
        .sim_args(&flags)
        .agents()
        .lease(LeaseBackend::File)
        .standby()
        .fleet(json!({
            "slo": {"ttft_s": a.ttft_slo_s, "tpot_s": a.tpot_slo_s},
            "serving": {"max_connections": 4096},
            "engine": {"first_token_timeout_s": a.request_timeout,
                        "decode_read_timeout_s": a.request_timeout},
        }))
        .fleet(serde_json::from_str(&a.ours_fleet).unwrap_or_default())
        .start()
        .await;
    let mut f = f;
    let mut primary = f.router.take().ok_or("no primary")?;
    let standby = Arc::new(f.standby.take().ok_or("no standby")?);
    let trace = prefix_trace::generate(shp, rate, a.standby_s, a.seed);
    let kill_s = a.standby_s - 10.0;
    let http = narwhal_testkit::http_client()
        .timeout(Duration::from_secs_f64(a.request_timeout))
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| e.to_string())?;
    let urls = Arc::new(Mutex::new(vec![primary.data.clone()]));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut marks = Vec::new();
    let mut takeover = None;
    let sample_at = [kill_s - 10.0, kill_s];
    let mut next_mark = 0;
    for r in trace.iter() {
        while next_mark < sample_at.len() && r.at_s >= sample_at[next_mark] {
            tokio::time::sleep_until(
                (start + Duration::from_secs_f64(sample_at[next_mark].max(0.0))).into(),
            )
            .await;
            marks.push(counts_all(&f.sims).await?);
            if next_mark == 1 {
                let t_kill = Instant::now();
                primary.proc.kill();
                let s = standby.clone();
                takeover = Some(tokio::spawn(async move {
                    s.wait_ready(t_kill, Duration::from_secs(30)).await
                }));
                let mut u = urls.lock().unwrap_or_else(|e| e.into_inner());
                *u = vec![standby.data.clone(), standby.data.clone()];
            }
            next_mark += 1;
        }
        tokio::time::sleep_until((start + Duration::from_secs_f64(r.at_s)).into()).await;
        let (http, body, urls) = (
            http.clone(),
            Arc::new(r.body(MODEL, a.output_tokens)),
            urls.clone(),
        );
        let deadline = Instant::now() + Duration::from_secs_f64(a.request_timeout);
        tasks.spawn(async move { one(http, urls, body, deadline, start).await });
    }
    let takeover = match takeover {
        Some(t) => t.await.map_err(|e| e.to_string())?.map(|d| d.as_secs_f64()),
        None => None,
    };
    tokio::time::sleep_until((start + Duration::from_secs_f64(a.standby_s)).into()).await;
    marks.push(counts_all(&f.sims).await?);
    let mut outcomes = Vec::new();
    while let Some(o) = tasks.join_next().await {
        outcomes.push(o.map_err(|e| e.to_string())?);
    }
    if marks.len() < 3 {
        return Err("the standby run had too few arrivals to sample".into());
    }
    Ok(Standby {
        before: marks[1].minus(marks[0]),
        after: marks[2].minus(marks[1]),
        takeover_s: takeover,
        failed: outcomes.iter().filter(|o| !o.ok).count(),
        requests: outcomes.len(),
        failed_before: outcomes
            .iter()
            .filter(|o| !o.ok && (kill_s - 10.0..kill_s).contains(&o.sent_s))
            .count(),
        failed_after: outcomes
            .iter()
            .filter(|o| !o.ok && o.sent_s >= kill_s)
            .count(),
    })
}

fn fmt_s(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.3}"))
}

/// The markdown table: one row per target, the oracle, and the standby figure.
fn table(rows: &[Row], oracle: prefix_trace::Oracle, standby: Option<&Standby>) -> String {
    let best_peer_slo = rows
        .iter()
        .filter(|r| !r.name.starts_with("ours-"))
        .map(|r| r.slo_met as f64 / r.requests.max(1) as f64)
        .fold(0.0f64, f64::max);
    let mut t = String::from(
        "| target | hit rate | x oracle | TTFT p50 s | TTFT p90 s | SLO met | x best other | req/s | good req/s | failed |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let slo = r.slo_met as f64 / r.requests.max(1) as f64;
        t.push_str(&format!(
            "| {} | {:.3} | {:.2} | {} | {} | {:.1}% ({}/{}) | {} | {:.2} | {:.2} | {} |\n",
            r.name,
            r.counts.rate(),
            r.counts.rate() / oracle.hit_rate().max(1e-9),
            fmt_s(r.ttft_p50),
            fmt_s(r.ttft_p90),
            100.0 * slo,
            r.slo_met,
            r.requests,
            if best_peer_slo > 0.0 {
                format!("{:.2}", slo / best_peer_slo)
            } else {
                "–".into()
            },
            r.throughput,
            r.goodput,
            r.requests - r.completed,
        ));
    }
    t.push_str(&format!(
        "| oracle (pooled LRU) | {:.3} | 1 | | | | | | | |\n| unbounded cache | {:.3} | {:.2} | | | | | | | |\n",
        oracle.hit_rate(),
        oracle.reuse_rate(),
        oracle.reuse_rate() / oracle.hit_rate().max(1e-9)
    ));
    for r in rows {
        if let Some(x) = &r.restart {
            t.push_str(&format!(
                "\nrouter restart ({}): hit rate {:.3} in the 10 s before, {:.3} in the 10 s from it (x{:.2}); answering again after {:.1} s\n",
                r.name,
                x.before.rate(),
                x.after.rate(),
                x.after.rate() / x.before.rate().max(1e-9),
                x.down_s
            ));
        }
    }
    if let Some(s) = standby {
        t.push_str(&format!(
            "\nstandby (ours exact, kill -9 of the primary): hit rate {:.3} in the 10 s before, {:.3} in the 10 s after (x{:.2}); takeover {} s; {} of {} requests failed ({} sent in the 10 s before the kill, {} after)\n",
            s.before.rate(),
            s.after.rate(),
            s.after.rate() / s.before.rate().max(1e-9),
            fmt_s(s.takeover_s),
            s.failed,
            s.requests,
            s.failed_before,
            s.failed_after
        ));
    }
    t
}
