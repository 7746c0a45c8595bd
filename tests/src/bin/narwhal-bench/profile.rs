//! `narwhal-bench profile --engine URL`: measures an engine's profile, the shape the fleet
//! file takes under `profiles.default` or `profiles.engines.<iid>` (controller.md 3.4), by
//! timing requests against the engine directly (serve it aggregated: vLLM without a KV role
//! pairing, one engine).
//!
//! ```text
//!  prefill: streaming requests with max_tokens 1 at several prompt lengths L, one at a time
//!           fastest time to the first token ─► least squares a·L² + b·L + c (a ≥ 0)
//!  decode:  B concurrent streams of P-token prompts, N tokens each, fastest of reps
//!           batches: mean token gap at T = B·(P + N/2) resident tokens
//!            ─► least squares slope·T + request_slope·B + c
//!  ─► {"ttft_a","ttft_b","ttft_c","tpot_slope","tpot_request_slope","tpot_intercept",
//!      "decode_min_requests","decode_max_requests","decode_min_kv_tokens",
//!      "decode_max_kv_tokens","kv_capacity_tokens": null}
//! ```
//!
//! The simulator's `--prefill-us-per-token`, `--ttft-ms`, `--tpot-ms` and
//! `--tpot-per-running-us` are known truths to check it against.

use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::StreamExt;
use serde_json::{Value, json};

/// `narwhal-bench profile` flags.
#[derive(Debug, Parser)]
#[command(
    name = "narwhal-bench profile",
    about = "Measure an engine's profile for the fleet file"
)]
pub(crate) struct ProfileArgs {
    /// The engine's base URL (`http://host:port`), served aggregated.
    #[arg(long)]
    pub(crate) engine: String,
    /// The served model.
    #[arg(long, default_value = "tiny-sim")]
    pub(crate) model: String,
    /// Prompt lengths of the prefill fit (tokens, comma-separated).
    #[arg(long, default_value = "128,512,1024,2048", value_delimiter = ',')]
    pub(crate) prefill_lengths: Vec<usize>,
    /// Timed requests per prompt length, and timed batches per decode point (the fastest
    /// counts: interference on a shared machine only ever adds time).
    #[arg(long, default_value_t = 3)]
    pub(crate) reps: usize,
    /// `batch x prompt` points of the decode fit (comma-separated `BxP`).
    #[arg(
        long,
        default_value = "1x64,1x1024,4x64,8x512,16x64,16x256",
        value_delimiter = ','
    )]
    pub(crate) decode_points: Vec<String>,
    /// Output tokens per decode stream.
    #[arg(long, default_value_t = 24)]
    pub(crate) decode_tokens: u32,
    /// Write the profile here too.
    #[arg(long)]
    pub(crate) out: Option<std::path::PathBuf>,
}

/// A prompt of `n` token ids that shares no block with any other this process (or, but for a
/// 1 in 30,000 chance, an earlier run) sent: an engine's prefix cache would otherwise serve a
/// repeated prompt's prefill for free and the fit would price prefill at nothing.
fn prompt(n: usize) -> Value {
    static NEXT: std::sync::OnceLock<std::sync::atomic::AtomicU64> = std::sync::OnceLock::new();
    let k = NEXT
        .get_or_init(|| std::sync::atomic::AtomicU64::new(rand::random::<u64>()))
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    narwhal_testkit::unique_token_prompt(n, k)
}

/// One streaming completion: seconds to the first token chunk and to the end, and the
/// token chunks seen.
async fn timed_stream(
    http: &reqwest::Client,
    url: &str,
    model: &str,
    input: usize,
    max_tokens: u32,
) -> Result<(f64, f64, usize), String> {
    let body = json!({"model": model, "prompt": prompt(input), "max_tokens": max_tokens,
                      "stream": true});
    let t0 = Instant::now();
    let r = http
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("HTTP {}", r.status()));
    }
    let mut first = None;
    let mut chunks = 0;
    let mut s = r.bytes_stream();
    while let Some(c) = s.next().await {
        let c = c.map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&c);
        let n = text.matches("\"text\"").count();
        if n > 0 {
            first.get_or_insert(t0.elapsed().as_secs_f64());
            chunks += n;
        }
    }
    let first = first.ok_or("no token")?;
    Ok((first, t0.elapsed().as_secs_f64(), chunks))
}

/// Least squares for `y ≈ X·β` with 3 unknowns (normal equations, Gaussian elimination);
/// `None` when singular.
fn least_squares(rows: &[([f64; 3], f64)], use_cols: [bool; 3]) -> Option<[f64; 3]> {
    let cols: Vec<usize> = (0..3).filter(|c| use_cols[*c]).collect();
    let k = cols.len();
    let mut a = vec![vec![0.0; k + 1]; k];
    for (x, y) in rows {
        for (i, ci) in cols.iter().enumerate() {
            for (j, cj) in cols.iter().enumerate() {
                a[i][j] += x[*ci] * x[*cj];
            }
            a[i][k] += x[*ci] * y;
        }
    }
    for i in 0..k {
        let p = (i..k).max_by(|r, s| a[*r][i].abs().total_cmp(&a[*s][i].abs()))?;
        a.swap(i, p);
        if a[i][i].abs() < 1e-18 {
            return None;
        }
        let pivot = a[i].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != i {
                let f = row[i] / pivot[i];
                for (x, p) in row.iter_mut().zip(&pivot).skip(i) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut beta = [0.0; 3];
    for (i, ci) in cols.iter().enumerate() {
        beta[*ci] = a[i][k] / a[i][i];
    }
    Some(beta)
}

/// Fits with every column, then drops columns whose coefficient came out negative (a cost
/// never falls with more work) and refits.
fn fit_nonnegative(rows: &[([f64; 3], f64)]) -> [f64; 3] {
    let mut use_cols = [true; 3];
    for _ in 0..3 {
        let Some(b) = least_squares(rows, use_cols) else {
            break;
        };
        let negative: Vec<usize> = (0..3).filter(|c| use_cols[*c] && b[*c] < 0.0).collect();
        if negative.is_empty() {
            return b;
        }
        for c in negative {
            use_cols[c] = false;
        }
    }
    least_squares(rows, use_cols).unwrap_or([0.0; 3])
}

/// Measures the profile of the engine at `a.engine` (see the module doc).
///
/// # Errors
/// The first request that failed, named.
pub(crate) async fn measure(a: &ProfileArgs) -> Result<Value, String> {
    let http = narwhal_testkit::http_client()
        .timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| e.to_string())?;
    let mut prefill_rows = Vec::new();
    for &l in &a.prefill_lengths {
        let mut t = Vec::new();
        for _ in 0..a.reps.max(1) {
            let (first, _, _) = timed_stream(&http, &a.engine, &a.model, l, 1)
                .await
                .map_err(|e| format!("prefill of {l} tokens: {e}"))?;
            t.push(first);
        }
        let x = l as f64;
        let fastest = t.into_iter().fold(f64::INFINITY, f64::min);
        prefill_rows.push(([x * x, x, 1.0], fastest));
    }
    let [ttft_a, ttft_b, ttft_c] = fit_nonnegative(&prefill_rows);
    let mut decode_rows = Vec::new();
    let (mut min_b, mut max_b, mut min_t, mut max_t) = (u64::MAX, 0u64, f64::INFINITY, 0.0f64);
    for point in &a.decode_points {
        let (b, p) = point
            .split_once('x')
            .and_then(|(b, p)| Some((b.parse::<usize>().ok()?, p.parse::<usize>().ok()?)))
            .ok_or_else(|| format!("--decode-points: {point:?} is not BxP"))?;
        let n = a.decode_tokens.max(2);
        // The fastest of `reps` batches counts, as for prefill: a shared machine's
        // interference only adds time, and more to a larger batch (more work per step), so
        // one batch per point inflated the per-request slope twofold under load.
        let mut gap = f64::INFINITY;
        for _ in 0..a.reps.max(1) {
            let runs = futures_util::future::join_all(
                (0..b).map(|_| timed_stream(&http, &a.engine, &a.model, p, n)),
            )
            .await;
            let mut gaps = Vec::new();
            for r in runs {
                let (first, end, chunks) = r.map_err(|e| format!("decode {point}: {e}"))?;
                if chunks > 1 {
                    gaps.push((end - first) / (chunks - 1) as f64);
                }
            }
            if gaps.is_empty() {
                return Err(format!("decode {point}: no token gaps measured"));
            }
            gap = gap.min(gaps.iter().sum::<f64>() / gaps.len() as f64);
        }
        let tokens = b as f64 * (p as f64 + f64::from(n) / 2.0);
        decode_rows.push(([tokens, b as f64, 1.0], gap));
        min_b = min_b.min(b as u64);
        max_b = max_b.max(b as u64);
        min_t = min_t.min(tokens);
        max_t = max_t.max(tokens);
    }
    let [tpot_slope, tpot_request_slope, tpot_intercept] = fit_nonnegative(&decode_rows);
    let round = |x: f64| (x * 1e9).round() / 1e9;
    Ok(json!({
        "ttft_a": round(ttft_a),
        "ttft_b": round(ttft_b),
        "ttft_c": round(ttft_c.max(0.0)),
        "tpot_slope": round(tpot_slope),
        "tpot_request_slope": round(tpot_request_slope),
        "tpot_intercept": round(tpot_intercept),
        "decode_min_requests": min_b,
        "decode_max_requests": max_b,
        "decode_min_kv_tokens": min_t.floor() as u64,
        "decode_max_kv_tokens": max_t.ceil() as u64,
        "kv_capacity_tokens": null,
    }))
}

/// `narwhal-bench profile ...`: prints the profile (and writes `--out`).
pub(crate) async fn main(argv: Vec<String>) -> std::process::ExitCode {
    let a = ProfileArgs::parse_from(argv);
    match measure(&a).await {
        Ok(p) => {
            let text = serde_json::to_string_pretty(&p).unwrap_or_default();
            println!("{text}");
            if let Some(path) = &a.out
                && let Err(e) = std::fs::write(path, format!("{text}\n"))
            {
                eprintln!("narwhal-bench profile: --out {}: {e}", path.display());
                return std::process::ExitCode::FAILURE;
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("narwhal-bench profile: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_squares_recovers_a_linear_cost_and_drops_negative_terms() {
        let rows: Vec<([f64; 3], f64)> = [100.0, 500.0, 1000.0, 2000.0]
            .iter()
            .map(|x| ([x * x, *x, 1.0], 0.0005 * x + 0.01))
            .collect();
        let [a, b, c] = fit_nonnegative(&rows);
        assert!(
            a.abs() < 1e-12 && (b - 0.0005).abs() < 1e-9 && (c - 0.01).abs() < 1e-9,
            "{a} {b} {c}"
        );
        let rows = vec![
            ([64.0, 1.0, 1.0], 0.021),
            ([1024.0, 1.0, 1.0], 0.021),
            ([512.0, 4.0, 1.0], 0.024),
            ([1024.0, 16.0, 1.0], 0.036),
        ];
        let [s, r, i] = fit_nonnegative(&rows);
        assert!(
            s.abs() < 1e-6 && (r - 0.001).abs() < 1e-4 && (i - 0.02).abs() < 1e-3,
            "{s} {r} {i}"
        );
    }
}
