//! `GET /metrics`: the engine's Prometheus text, with the families and labels of the impersonated
//! engine (docs/engine-simulator.md, "Metrics").

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use http::Response;

use crate::body::SimBody;
use crate::server::{Dialect, Sim, text_response};

/// Prompt tokens by where their KV came from (vLLM's `vllm:prompt_tokens_by_source`; tokens).
#[derive(Debug, Default)]
pub(crate) struct PromptSources {
    /// Computed by this engine's prefill.
    pub(crate) local_compute: AtomicU64,
    /// Found in this engine's prefix cache.
    pub(crate) local_cache_hit: AtomicU64,
    /// Received from a producer (P/D decode).
    pub(crate) external_kv_transfer: AtomicU64,
}

impl PromptSources {
    /// Counts one request's prompt of `total` tokens, `hit` found in the prefix cache and
    /// `external` received over the connector, as vLLM 0.32.0's
    /// `PromptTokenStats.update_from_output` (`vllm/v1/metrics/stats.py`) does: when every
    /// token is cached the scheduler still computes the last one (`num_cached_tokens` is one
    /// less), so a transferred prompt counts `local_compute` 1 and `external_kv_transfer`
    /// `external`; `local_cache_hit` is `cached + recomputed - external`.
    pub(crate) fn count(&self, total: usize, hit: usize, external: usize) {
        let cached = (hit + external).min(total.saturating_sub(1));
        let recomputed = usize::from(total > 0 && cached + 1 == total);
        self.local_compute
            .fetch_add((total - cached) as u64, Relaxed);
        self.external_kv_transfer
            .fetch_add(external as u64, Relaxed);
        self.local_cache_hit.fetch_add(
            (cached + recomputed).saturating_sub(external) as u64,
            Relaxed,
        );
    }
}

/// vLLM's prefix cache families (`vllm/v1/metrics/loggers.py`, counters in tokens):
/// `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`,
/// `vllm:prompt_tokens_by_source_total{source}` and `vllm:prompt_tokens_cached_total`.
fn cache_metrics(sim: &Sim, labels: &str, out: &mut String) {
    use std::fmt::Write as _;
    let c = sim.cache_counters();
    let src = &sim.sources;
    let (hit, ext) = (
        src.local_cache_hit.load(Relaxed),
        src.external_kv_transfer.load(Relaxed),
    );
    let _ = write!(
        out,
        "# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.\n\
         # TYPE vllm:prefix_cache_queries counter\n\
         vllm:prefix_cache_queries_total{{{labels}}} {}\n\
         # HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.\n\
         # TYPE vllm:prefix_cache_hits counter\n\
         vllm:prefix_cache_hits_total{{{labels}}} {}\n\
         # HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.\n\
         # TYPE vllm:prompt_tokens_by_source counter\n",
        c.queries, c.hits
    );
    for (source, n) in [
        ("local_compute", src.local_compute.load(Relaxed)),
        ("local_cache_hit", hit),
        ("external_kv_transfer", ext),
    ] {
        let _ = writeln!(
            out,
            "vllm:prompt_tokens_by_source_total{{{labels},source=\"{source}\"}} {n}"
        );
    }
    let _ = write!(
        out,
        "# HELP vllm:prompt_tokens_cached Number of cached prompt tokens (local + external).\n\
         # TYPE vllm:prompt_tokens_cached counter\n\
         vllm:prompt_tokens_cached_total{{{labels}}} {}\n",
        hit + ext
    );
}

/// Renders `/metrics` for `sim`.
pub(crate) fn metrics(sim: &Sim) -> Response<SimBody> {
    use std::fmt::Write as _;
    let s = &sim.stats;
    let model = sim.cfg.model.replace('\\', "\\\\").replace('"', "\\\"");
    let waiting = s.waiting.load(Relaxed).max(0);
    let running = s.running();
    let prompt = s.prom_prompt_tokens.load(Relaxed);
    let gen_tokens = s.prom_generation_tokens.load(Relaxed);
    let success = s.prom_success.load(Relaxed);
    let mut out = String::with_capacity(2048);
    let (p, running_name, waiting_name, success_line) = match sim.cfg.dialect {
        Dialect::Vllm => (
            "vllm",
            "num_requests_running",
            "num_requests_waiting",
            format!(
                "vllm:request_success_total{{engine=\"0\",finished_reason=\"length\",model_name=\"{model}\"}} {success}\n"
            ),
        ),
        Dialect::Sglang => (
            "sglang",
            "num_running_reqs",
            "num_queue_reqs",
            format!("sglang:num_requests_total{{model_name=\"{model}\"}} {success}\n"),
        ),
    };
    let labels = match sim.cfg.dialect {
        Dialect::Vllm => format!("{{engine=\"0\",model_name=\"{model}\"}}"),
        Dialect::Sglang => format!("{{model_name=\"{model}\"}}"),
    };
    let _ = write!(
        out,
        "# HELP {p}:{running_name} Number of requests running.\n\
         # TYPE {p}:{running_name} gauge\n\
         {p}:{running_name}{labels} {running}\n\
         # HELP {p}:{waiting_name} Number of requests waiting.\n\
         # TYPE {p}:{waiting_name} gauge\n\
         {p}:{waiting_name}{labels} {waiting}\n\
         # HELP {p}:prompt_tokens_total Number of prefill tokens processed.\n\
         # TYPE {p}:prompt_tokens_total counter\n\
         {p}:prompt_tokens_total{labels} {prompt}\n\
         # HELP {p}:generation_tokens_total Number of generation tokens processed.\n\
         # TYPE {p}:generation_tokens_total counter\n\
         {p}:generation_tokens_total{labels} {gen_tokens}\n"
    );
    if sim.cfg.dialect == Dialect::Vllm {
        // vLLM's `BlockPool.get_usage`: blocks running requests hold over the pool (cached
        // blocks no one holds count as free); 0 without `--kv-pool`, where they hold none.
        let used = s.kv_used.load(Relaxed) as f64;
        let pool = sim.cfg.cache.blocks.max(1) * sim.cfg.data_parallel_size.max(1);
        let usage = used / pool as f64;
        let _ = write!(
            out,
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{labels} {usage}\n"
        );
    }
    let success_name = match sim.cfg.dialect {
        Dialect::Vllm => "request_success_total",
        Dialect::Sglang => "num_requests_total",
    };
    let _ = write!(
        out,
        "# HELP {p}:{success_name} Count of successfully processed requests.\n\
         # TYPE {p}:{success_name} counter\n{success_line}"
    );
    // `--no-kv-metrics` is an older vLLM: it predates the prompt-token sources too.
    if sim.cfg.dialect == Dialect::Vllm && sim.cfg.kv_metrics {
        cache_metrics(
            sim,
            &format!("engine=\"0\",model_name=\"{model}\""),
            &mut out,
        );
    }
    if sim.cfg.kv_metrics {
        kv_metrics(sim, &model, &mut out);
    }
    // vLLM (one API server) serves prometheus_client's default registry, whose process
    // collector publishes the start time; SGLang serves the multiprocess registry, which has
    // no process families.
    if sim.cfg.dialect == Dialect::Vllm {
        let _ = write!(
            out,
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n\
             # TYPE process_start_time_seconds gauge\n\
             process_start_time_seconds {}\n",
            sim.started_at
        );
    }
    text_response(200, "text/plain; version=0.0.4; charset=utf-8", out)
}

/// The engine's own KV-transfer families, counted per transfer this simulator really did as the
/// consumer (names and meaning from the engines' source; engine-agent/src/evidence.rs records
/// where each comes from):
/// - vLLM (NIXL connector, per engine, labels `engine`, `model_name`, children created at
///   start): `vllm:nixl_xfer_time_seconds` (histogram, one observation per completed read) and
///   `vllm:nixl_num_failed_transfers_total` (reads attempted that failed).
/// - SGLang (labelled series appear at their first increment, as prometheus_client's do):
///   `sglang:per_stage_req_latency_seconds{stage="decode_transferred"}` (histogram, one
///   observation per decode whose KV arrived), `sglang:num_transfer_failed_reqs_total`,
///   `sglang:num_bootstrap_failed_reqs_total` (bootstrap server unreachable).
fn kv_metrics(sim: &Sim, model: &str, out: &mut String) {
    use std::fmt::Write as _;
    let s = &sim.stats;
    let failed = s.prom_transfer_failures.load(Relaxed);
    match sim.cfg.dialect {
        Dialect::Vllm => {
            let labels = format!("engine=\"0\",model_name=\"{model}\"");
            out.push_str(
                "# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV \
                 Cache transfers.\n# TYPE vllm:nixl_xfer_time_seconds histogram\n",
            );
            s.prom_transfers
                .render(out, "vllm:nixl_xfer_time_seconds", &labels);
            let _ = write!(
                out,
                "# HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache \
                 transfers.\n# TYPE vllm:nixl_num_failed_transfers counter\n\
                 vllm:nixl_num_failed_transfers_total{{{labels}}} {failed}\n"
            );
        }
        Dialect::Sglang => {
            let labels = format!("engine_type=\"unified\",model_name=\"{model}\"");
            out.push_str(
                "# HELP sglang:per_stage_req_latency_seconds The latency of each stage of \
                 requests.\n# TYPE sglang:per_stage_req_latency_seconds histogram\n",
            );
            if s.prom_transfers.count() > 0 {
                s.prom_transfers.render(
                    out,
                    "sglang:per_stage_req_latency_seconds",
                    &format!("{labels},stage=\"decode_transferred\""),
                );
            }
            let bootstrap = s.prom_bootstrap_failures.load(Relaxed);
            for (name, help, n) in [
                (
                    "sglang:num_bootstrap_failed_reqs",
                    "The number of bootstrap failed requests.",
                    bootstrap,
                ),
                (
                    "sglang:num_transfer_failed_reqs",
                    "The number of transfer failed requests.",
                    failed,
                ),
            ] {
                let _ = write!(
                    out,
                    "# HELP {name}_total {help}\n# TYPE {name}_total counter\n"
                );
                if n > 0 {
                    let _ = writeln!(out, "{name}_total{{{labels}}} {n}");
                }
            }
        }
    }
}
