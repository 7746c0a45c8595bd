//! `narwhal-bench shifting`: a workload whose demand shifts (prompt-heavy, then
//! output-heavy, then prompt-heavy again) on two 4-engine simulated fleets with finite
//! per-token costs, one router keeping a fixed 2P2D split (the controller in advisory mode)
//! and one letting the role controller move engines; the same arrivals go to both in one
//! run. Prints, per phase, the share of requests meeting both the TTFT and the TPOT SLO.
//!
//! ```text
//!  profile one engine (narwhal-bench profile) ─► profiles.default of both fleet files
//!  for each phase: open-loop arrivals at rate r of L-token prompts asking O tokens ─► both
//!     client: TTFT = first token chunk, TPOT = (end − first)/(tokens − 1), failures miss
//!  ─► table: phase, shape, fixed split, controller (and its split at the phase's end)
//! ```
//!
//! Engines: `--prefill-slots 1` (prefills queue, as on one accelerator),
//! `--prefill-us-per-token`, `--tpot-ms`, `--tpot-per-running-us` (decode slows as its batch
//! grows). It asserts nothing: a benchmark (architecture.md section 8).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::StreamExt;
use narwhal_shared::documents::State;
use narwhal_testkit::{EngineSpec, FleetSpec, RouterHandle, SimHandle, start_router, start_sim};
use serde_json::{Value, json};

/// `narwhal-bench shifting` flags.
#[derive(Debug, Parser)]
#[command(
    name = "narwhal-bench shifting",
    about = "Fixed split vs role controller under shifting demand"
)]
struct Args {
    /// Seconds per phase.
    #[arg(long, default_value_t = 60.0)]
    phase_s: f64,
    /// Prefill cost per prompt token (microseconds).
    #[arg(long, default_value_t = 500)]
    prefill_us_per_token: u64,
    /// Base gap between streamed tokens (milliseconds).
    #[arg(long, default_value_t = 20)]
    tpot_ms: u64,
    /// Token gap growth per other running request (microseconds).
    #[arg(long, default_value_t = 1000)]
    tpot_per_running_us: u64,
    /// Prompt-heavy phase: `rate x prompt tokens x output tokens`.
    #[arg(long, default_value = "2.4x2000x32")]
    prompt_heavy: String,
    /// Output-heavy phase: `rate x prompt tokens x output tokens`.
    #[arg(long, default_value = "4x100x500")]
    output_heavy: String,
    /// TTFT SLO (seconds).
    #[arg(long, default_value_t = 2.0)]
    ttft_s: f64,
    /// TPOT SLO (seconds).
    #[arg(long, default_value_t = 0.1)]
    tpot_s: f64,
}

/// One phase's load.
#[derive(Debug, Clone, Copy)]
struct Phase {
    name: &'static str,
    rate: f64,
    input: usize,
    output: u32,
}

fn parse_shape(name: &'static str, s: &str) -> Result<Phase, String> {
    let parts: Vec<&str> = s.split('x').collect();
    let bad = || {
        format!(
            "--{}: {s:?} is not rate x prompt x output",
            name.replace(' ', "-")
        )
    };
    if parts.len() != 3 {
        return Err(bad());
    }
    Ok(Phase {
        name,
        rate: parts[0].parse().map_err(|_| bad())?,
        input: parts[1].parse().map_err(|_| bad())?,
        output: parts[2].parse().map_err(|_| bad())?,
    })
}

/// One request's outcome.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    phase: usize,
    ttft: Option<f64>,
    tpot: Option<f64>,
}

fn prompt(n: usize, salt: usize) -> Value {
    Value::from(
        (0..n)
            .map(|i| 100 + ((i + salt) % 900) as u64)
            .collect::<Vec<_>>(),
    )
}

async fn one(
    http: reqwest::Client,
    url: String,
    p: Phase,
    salt: usize,
) -> (Option<f64>, Option<f64>) {
    let body = json!({"model": "tiny-sim", "prompt": prompt(p.input, salt), "max_tokens": p.output,
                      "stream": true});
    let t0 = Instant::now();
    let Ok(r) = http
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
    else {
        return (None, None);
    };
    if !r.status().is_success() {
        return (None, None);
    }
    let mut first = None;
    let mut chunks = 0usize;
    let mut done = false;
    let mut s = r.bytes_stream();
    while let Some(c) = s.next().await {
        let Ok(c) = c else { return (first, None) };
        let text = String::from_utf8_lossy(&c);
        let n = text.matches("\"text\"").count();
        if n > 0 {
            first.get_or_insert(t0.elapsed().as_secs_f64());
            chunks += n;
        }
        done |= text.contains("[DONE]");
    }
    let end = t0.elapsed().as_secs_f64();
    let tpot = match (first, done, chunks) {
        (Some(f), true, n) if n > 1 => Some((end - f) / (n - 1) as f64),
        (Some(_), true, _) => Some(0.0),
        _ => None,
    };
    (first, tpot)
}

fn sim_flags(a: &Args) -> Vec<String> {
    [
        "--prefill-slots".to_string(),
        "1".into(),
        "--prefill-us-per-token".into(),
        a.prefill_us_per_token.to_string(),
        "--tpot-ms".into(),
        a.tpot_ms.to_string(),
        "--tpot-per-running-us".into(),
        a.tpot_per_running_us.to_string(),
        "--max-model-len".into(),
        "16384".into(),
    ]
    .to_vec()
}

fn fleet(dir: &std::path::Path, label: &str, a: &Args) -> Result<Vec<SimHandle>, String> {
    let flags = sim_flags(a);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    ["prefill", "prefill", "decode", "decode"]
        .iter()
        .enumerate()
        .map(|(i, role)| {
            start_sim(
                dir,
                &EngineSpec::new(&format!("{label}{i}"), role).args(&flags),
                "vllm",
            )
            .map_err(|e| e.to_string())
        })
        .collect()
}

fn router(
    dir: &std::path::Path,
    label: &str,
    sims: &[SimHandle],
    profile: &Value,
    a: &Args,
    advisory: bool,
) -> Result<RouterHandle, String> {
    let spec = FleetSpec::for_sims("vllm", sims).with(json!({
        "slo": {"ttft_s": a.ttft_s, "tpot_s": a.tpot_s},
        "profiles": {"default": profile},
        "serving": {"max_connections": 4096},
        "engine": {"first_token_timeout_s": 60.0, "decode_read_timeout_s": 60.0},
        "controller": {
            "advisory": advisory,
            "monitor_interval_s": 0.25,
            "thresholds": {"cooldown_s": 2},
            "reactive": {"step_s": 1, "window_s": 24, "evidence_span_s": 12,
                          "evidence_max_span_s": 24},
        },
    }));
    start_router(dir, label, &spec, &["--log-level", "warn"]).map_err(|e| e.to_string())
}

fn split(state: &State) -> String {
    format!(
        "{}P{}D",
        state.pools.prefill.len(),
        state.pools.decode.len()
    )
}

/// `narwhal-bench shifting ...` (see the module doc).
pub(crate) async fn main(argv: Vec<String>) -> std::process::ExitCode {
    match run(Args::parse_from(argv)).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("narwhal-bench shifting: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(a: Args) -> Result<(), String> {
    let heavy_prompt = parse_shape("prompt heavy", &a.prompt_heavy)?;
    let heavy_output = parse_shape("output heavy", &a.output_heavy)?;
    let phases = [heavy_prompt, heavy_output, heavy_prompt];
    let dir = tempfile::Builder::new()
        .prefix("narwhal-bench-shifting-")
        .tempdir()
        .map_err(|e| e.to_string())?;
    // Measure the engines' profile with the profiling tool, against an engine like theirs.
    let probe = start_sim(
        dir.path(),
        &EngineSpec::new("probe", "decode")
            .args(&sim_flags(&a).iter().map(String::as_str).collect::<Vec<_>>()),
        "vllm",
    )
    .map_err(|e| e.to_string())?;
    let profile = super::profile::measure(&super::profile::ProfileArgs {
        engine: probe.url.clone(),
        model: "tiny-sim".into(),
        prefill_lengths: vec![128, 512, 1024, 2048],
        reps: 3,
        decode_points: ["1x64", "1x1024", "4x64", "8x512", "16x64", "32x128"]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        decode_tokens: 24,
        out: None,
    })
    .await?;
    drop(probe);
    let mut profile = profile;
    // Sized for the whole batch range a fleet can see, not only the points measured.
    narwhal_testkit::merge(
        &mut profile,
        json!({"decode_max_requests": 256, "decode_max_kv_tokens": 4_000_000}),
    );
    println!("measured profile: {profile}");
    let fixed_sims = fleet(dir.path(), "f", &a)?;
    let ctl_sims = fleet(dir.path(), "c", &a)?;
    let fixed = router(dir.path(), "fixed", &fixed_sims, &profile, &a, true)?;
    let ctl = router(dir.path(), "controller", &ctl_sims, &profile, &a, false)?;
    println!(
        "narwhal-bench shifting: {} s per phase; prefill {} us/token (one at a time), tpot {} ms + {} us per running request; SLO ttft {} s, tpot {} s",
        a.phase_s, a.prefill_us_per_token, a.tpot_ms, a.tpot_per_running_us, a.ttft_s, a.tpot_s
    );
    let http = narwhal_testkit::http_client()
        .timeout(Duration::from_secs(600))
        .pool_max_idle_per_host(512)
        .build()
        .map_err(|e| e.to_string())?;
    let outcomes: [Arc<Mutex<Vec<Outcome>>>; 2] = Default::default();
    let mut splits: Vec<String> = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    let mut salt = 0usize;
    for (pi, p) in phases.iter().enumerate() {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / p.rate));
        let end = Instant::now() + Duration::from_secs_f64(a.phase_s);
        while Instant::now() < end {
            tick.tick().await;
            salt += 1;
            for (k, url) in [fixed.data.clone(), ctl.data.clone()]
                .into_iter()
                .enumerate()
            {
                let (http, out, p) = (http.clone(), outcomes[k].clone(), *p);
                tasks.spawn(async move {
                    let (ttft, tpot) = one(http, url, p, salt).await;
                    out.lock().unwrap_or_else(|e| e.into_inner()).push(Outcome {
                        phase: pi,
                        ttft,
                        tpot,
                    });
                });
            }
            while tasks.try_join_next().is_some() {}
        }
        splits.push(split(&ctl.state().await));
    }
    // Let the last requests finish.
    let drain = tokio::time::timeout(Duration::from_secs(120), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drain.is_err() {
        tasks.abort_all();
    }
    let st = ctl.state().await;
    println!();
    println!(
        "{:<14} {:<22} {:>18} {:>18}  controller split at the phase's end",
        "phase", "load", "fixed 2P2D", "controller"
    );
    for (pi, p) in phases.iter().enumerate() {
        let share = |k: usize| {
            let all = outcomes[k].lock().unwrap_or_else(|e| e.into_inner());
            let mine: Vec<&Outcome> = all.iter().filter(|o| o.phase == pi).collect();
            let met = mine
                .iter()
                .filter(|o| {
                    o.ttft.is_some_and(|t| t <= a.ttft_s) && o.tpot.is_some_and(|t| t <= a.tpot_s)
                })
                .count();
            (met, mine.len())
        };
        let (fm, fn_) = share(0);
        let (cm, cn) = share(1);
        let pct = |m: usize, n: usize| {
            if n == 0 {
                0.0
            } else {
                100.0 * m as f64 / n as f64
            }
        };
        println!(
            "{:<14} {:<22} {:>9.1}% ({:>4}/{:<4}) {:>6.1}% ({:>4}/{:<4})  {}",
            format!("{} {}", pi + 1, p.name),
            format!("{}/s {}->{} tokens", p.rate, p.input, p.output),
            pct(fm, fn_),
            fm,
            fn_,
            pct(cm, cn),
            cm,
            cn,
            splits[pi]
        );
    }
    let flips: Vec<String> = st
        .controller
        .fields
        .iter()
        .flat_map(|f| &f.flips)
        .map(|f| format!("{}->{}", f.iid, f.to))
        .collect();
    println!("controller flips: {}", flips.join(", "));
    Ok(())
}
