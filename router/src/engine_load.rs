//! The engines' own count of the requests they run and queue (`serving.engine_load_poll_s`;
//! docs/design/kv-aware-placement.md section 5, "Load the router does not see"). The router
//! counts the requests it placed exactly and at once; what it cannot count is the load others
//! put on the same engines: a second router, clients sent to an engine directly, an operator's
//! test. Every `engine_load_poll_s` this reads each engine's `/metrics` and gives the fleet the
//! engine's own count; what exceeds the router's residents on it at that moment is foreign load,
//! which placement weighs with its own ([`crate::placement::EngineSlot::busy`]) and drains never
//! wait for.
//!
//! ```text
//!  every poll_s, each engine: GET /metrics ──parse_reported──► running + waiting
//!        ──Fleet::set_reported──► foreign = max(0, reported − ours resident now)
//! ```
//!
//! The families read, from each engine's own source: vLLM's `vllm:num_requests_running` and
//! `vllm:num_requests_waiting` (gauges with `engine` and `model_name` labels, one series per
//! engine core: summed); SGLang's `sglang:num_running_reqs` and `sglang:num_queue_reqs`. An
//! engine that publishes neither, or does not answer within `engine.health_timeout_s`, counts
//! no foreign load (placement falls back to what the router itself placed). A request the
//! router sent that the engine has not queued yet, or finished but is still streaming to the
//! client, makes the reading low, never high: foreign load is under-counted, not invented.

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use tokio_util::sync::CancellationToken;

use crate::config::secs;
use crate::parts::Parts;

/// The gauge families whose sum is an engine's running and waiting requests.
const FAMILIES: [&str; 4] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
];

/// The requests an engine's Prometheus text says it runs and queues: the sum of every series
/// of [`FAMILIES`] (exact family names: `vllm:num_requests_waiting_by_reason` is another
/// family). `None` when none of them is there, or a value is not a finite number ≥ 0.
pub(crate) fn parse_reported(text: &str) -> Option<u64> {
    let mut sum = 0.0;
    let mut seen = false;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if !FAMILIES.contains(&&line[..name_end]) {
            continue;
        }
        let value: f64 = line.rsplit(' ').next()?.parse().ok()?;
        if !value.is_finite() || value < 0.0 {
            return None;
        }
        sum += value;
        seen = true;
    }
    seen.then_some(sum.round() as u64)
}

/// Reads every engine's count every `serving.engine_load_poll_s` until `stop` (not started
/// when the key is 0). Runs in every HA phase: a standby's placement is idle, but one that
/// takes over has a fresh reading at once.
pub(crate) async fn run(parts: Arc<Parts>, stop: CancellationToken) {
    let every = parts.cfg.serving.engine_load_poll_s;
    if every <= 0.0 {
        return;
    }
    let every = Duration::from_secs_f64(every);
    let timeout = secs(parts.cfg.engine.health_timeout_s).min(every.max(Duration::from_millis(50)));
    loop {
        let reads = (0..parts.cfg.engines.len()).map(|i| {
            let parts = parts.clone();
            async move {
                let url = format!("{}/metrics", parts.cfg.engines[i].url);
                let reported = match parts.upstream.probe_get(&url, timeout).await {
                    Ok((StatusCode::OK, body)) => parse_reported(&String::from_utf8_lossy(&body)),
                    _ => None,
                };
                parts.fleet.set_reported(i, reported);
            }
        });
        tokio::select! {
            () = stop.cancelled() => return,
            _ = futures_util::future::join_all(reads) => {}
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_and_waiting_series_are_summed_and_other_families_ignored() {
        let vllm = "# HELP vllm:num_requests_running Number of requests running.\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
                    vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
                    vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 4.0\n\
                    vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 9.0\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n";
        assert_eq!(parse_reported(vllm), Some(9));
        let sglang = "sglang:num_running_reqs{model_name=\"m\"} 1\nsglang:num_queue_reqs{model_name=\"m\"} 6\n";
        assert_eq!(parse_reported(sglang), Some(7));
        assert_eq!(parse_reported("process_start_time_seconds 1.7e9\n"), None);
        assert_eq!(parse_reported("vllm:num_requests_running NaN\n"), None);
        assert_eq!(parse_reported("vllm:num_requests_running 0\n"), Some(0));
    }
}
