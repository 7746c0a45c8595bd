//! `narwhal-bench tokenizer`: what a request's tokens cost each way, the router's own tokenizer
//! (`engine.tokenizer`, crate `narwhal-tokenizer`) against an engine's `POST /tokenize`
//! (docs/benchmarks.md, "The router's tokenizer").
//!
//! ```text
//!  for each prompt size (--words, a chat: a system prompt of N words and a short user turn):
//!    router   ModelTokenizer::tokens in this process, --iterations times: median µs per
//!             request (one thread: the router's CPU per request for its tokens)
//!    engine   (with --engine URL) POST /tokenize of the same body, --iterations times, one
//!             at a time: median round trip (the latency a score waited for), and with
//!             --engine-pid the CPU that process spent per call (utime + stime; vLLM's API
//!             server tokenizes, not its EngineCore child, whose idle loop is left out):
//!             what the router's tokenizer takes off the engine, per request, on every
//!             scored request (twice with predictive admission's sizing)
//!    agree    the two token lists equal (exit 1 when not)
//! ```
//!
//! Build it in release (`cargo build --release -p narwhal-testkit --bin narwhal-bench`): the
//! router ships in release. Asserts nothing about time.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use narwhal_tokenizer::ModelTokenizer;
use serde_json::{Value, json};

use crate::procs;

#[derive(Parser, Debug)]
#[command(
    name = "narwhal-bench tokenizer",
    about = "The router's own tokenizer against an engine's /tokenize: time per request, the engine's CPU, agreement"
)]
struct Args {
    /// The model directory (tokenizer.json and the chat template), as `engine.tokenizer`.
    #[arg(long)]
    model_dir: PathBuf,
    /// An engine serving that model (its base URL), for the `/tokenize` side.
    #[arg(long)]
    engine: Option<String>,
    /// The engine's API server PID, for its CPU per `/tokenize` (that process alone).
    #[arg(long)]
    engine_pid: Option<u32>,
    /// The model name the engine serves.
    #[arg(long, default_value = "tiny-llama")]
    model: String,
    /// System prompt sizes, in words.
    #[arg(long, value_delimiter = ',', default_values_t = [100usize, 1000, 6000])]
    words: Vec<usize>,
    /// Requests measured per size and side.
    #[arg(long, default_value_t = 200)]
    iterations: usize,
}

/// Words the prompts are made of (a fixed cycle; a tokenizer splits them as it will).
const WORDS: [&str; 16] = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "narwhal", "routers", "place",
    "requests", "on", "prefill", "decode", "engines",
];

fn chat(words: usize) -> Value {
    let system: Vec<&str> = (0..words)
        .map(|i| WORDS[(i * 7 + i / 16) % WORDS.len()])
        .collect();
    json!({"messages": [{"role": "system", "content": system.join(" ")},
                        {"role": "user", "content": "hello world the quick brown fox"}]})
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Runs the measurement; exit 1 when the router's tokens differ from the engine's.
pub(crate) async fn main(argv: Vec<String>) -> ExitCode {
    let a = match Args::try_parse_from(&argv) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(2);
        }
    };
    let tok = match ModelTokenizer::load(&a.model_dir) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("narwhal-bench tokenizer: --model-dir: {e}");
            return ExitCode::from(2);
        }
    };
    let client = narwhal_testkit::http_client().build().unwrap_or_default();
    let hz = procs::clock_ticks();
    println!(
        "| system prompt, words | tokens | router µs/request | /tokenize round trip µs | engine CPU µs/call | router ÷ round trip |"
    );
    println!("|---|---|---|---|---|---|");
    let mut agree = true;
    for &n in &a.words {
        let body = chat(n);
        let obj = body.as_object().cloned().unwrap_or_default();
        let mut ours = Vec::new();
        let mut times = Vec::with_capacity(a.iterations);
        for _ in 0..a.iterations {
            let t0 = Instant::now();
            ours = match tok.tokens(&obj) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("narwhal-bench tokenizer: the router cannot render it: {e}");
                    return ExitCode::FAILURE;
                }
            };
            times.push(t0.elapsed());
        }
        let local = median(times);
        let (mut remote, mut cpu) = (None, None);
        if let Some(url) = &a.engine {
            let mut req = body.clone();
            req["model"] = json!(a.model);
            let own = |pid: u32| -> Vec<(u32, u64)> {
                procs::tree_ticks(pid)
                    .into_iter()
                    .filter(|(p, _)| *p == pid)
                    .collect()
            };
            let before = a.engine_pid.map(own);
            let mut times = Vec::with_capacity(a.iterations);
            for _ in 0..a.iterations {
                let t0 = Instant::now();
                let answer: Value = match client
                    .post(format!("{url}/tokenize"))
                    .json(&req)
                    .send()
                    .await
                {
                    Ok(r) => r.json().await.unwrap_or(Value::Null),
                    Err(e) => {
                        eprintln!("narwhal-bench tokenizer: POST {url}/tokenize: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                times.push(t0.elapsed());
                let theirs: Vec<u64> = answer["tokens"]
                    .as_array()
                    .map(|t| t.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                if theirs != ours.iter().map(|t| u64::from(*t)).collect::<Vec<_>>() {
                    agree = false;
                }
            }
            remote = Some(median(times));
            if let (Some(pid), Some(before)) = (a.engine_pid, before) {
                let ticks = procs::ticks_between(&before, &own(pid));
                cpu = Some(ticks as f64 / hz / a.iterations as f64);
            }
        }
        let us = |d: Duration| format!("{:.0}", d.as_secs_f64() * 1e6);
        println!(
            "| {n} | {} | {} | {} | {} | {} |",
            ours.len(),
            us(local),
            remote.map_or("-".into(), us),
            cpu.map_or("-".into(), |c| format!("{:.0}", c * 1e6)),
            remote.map_or("-".into(), |r| format!(
                "{:.3}",
                local.as_secs_f64() / r.as_secs_f64()
            )),
        );
    }
    if !agree {
        eprintln!(
            "narwhal-bench tokenizer: the router's tokens differ from the engine's /tokenize"
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
