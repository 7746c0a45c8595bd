//! KV-transfer evidence from the engines' own surfaces (docs/agent.md): which Prometheus
//! series each engine kind publishes about its KV transfers, reading them from `/metrics`, and
//! the pure rule that turns two readings around a decode leg into a [`TransferVerdict`].
//!
//! ```text
//!   GET /metrics ──parse──► Exposition ──TransferMetrics::read──► TransferCounters (before)
//!   decode leg with the descriptor / rendezvous ──► LegResult
//!   GET /metrics ... (re-read until a counter moves or EVIDENCE_SETTLE passes) ──► (after)
//!   judge(leg, before, after) ──► Judgement {verdict, deltas, detail} ──► TransferEvidence
//! ```
//!
//! The counters are engine-wide, not per request (vLLM and SGLang publish no per-request
//! transfer record): concurrent traffic on the consumer can move them too. The rule is
//! therefore one-sided where it must be: any failure counter that rose refutes (conservative:
//! another request's failure on the same consumer also fails the check), and a completed
//! transfer only confirms when no failure rose.

use std::time::Duration;

use narwhal_shared::{LegResult, TransferEvidence, TransferVerdict};

/// Longest the agent re-reads `/metrics` after a successful decode leg, waiting for the
/// engine's counters to move (vLLM records connector stats from the scheduler's step output,
/// SGLang from its scheduler process; both normally before the stream ends).
pub(crate) const EVIDENCE_SETTLE: Duration = Duration::from_secs(1);

/// Pause between two reads while settling.
pub(crate) const EVIDENCE_POLL: Duration = Duration::from_millis(50);

/// One Prometheus series family the agent sums: every sample named `sample` (whatever its
/// other labels: engine index, TP rank, model name) that carries `label` when one is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Series {
    /// Family name as in the `# TYPE` line (a counter's may also appear with `_total`).
    pub family: &'static str,
    /// Sample name summed (`<family>_count` of a histogram, `<family>_total` of a counter).
    pub sample: &'static str,
    /// A label the sample must carry, `(name, value)`.
    pub label: Option<(&'static str, &'static str)>,
}

impl Series {
    /// `sample{label="value"}`, for messages.
    pub fn display(&self) -> String {
        match self.label {
            Some((k, v)) => format!("{}{{{k}=\"{v}\"}}", self.sample),
            None => self.sample.to_string(),
        }
    }
}

/// What an engine kind publishes about KV transfers on its `/metrics`, as the consuming
/// (decode) side sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferMetrics {
    /// `transfer.source` when these were read.
    pub source: &'static str,
    /// Counts completed transfers into this engine.
    pub transfers: Series,
    /// Count failed transfers into this engine (summed).
    pub failures: &'static [Series],
    /// Prompt tokens by where their KV came from (`[local_compute, external_kv_transfer]`),
    /// when the engine kind publishes them: the "did not recompute" evidence.
    pub prompt_sources: Option<[Series; 2]>,
}

/// vLLM's `vllm:prompt_tokens_by_source` counter (`vllm/v1/metrics/loggers.py`, fed by
/// `PromptTokenStats.update_from_output` in `vllm/v1/metrics/stats.py`), in prompt tokens, by
/// `source`. vLLM 0.32 sets them when it first schedules the request, from the tokens the
/// connector will load (`vllm/v1/core/sched/scheduler.py`, `prefill_stats.set`): for a request
/// whose whole prompt arrives over the connector `external_kv_transfer` rises by the prompt (less
/// any local prefix-cache hit, which `local_cache_hit` counts) and `local_compute` by 0, though
/// the model still runs the last prompt token (seen on real vLLM 0.32: +309 and +0 for a
/// 309-token prompt); up to 1 is accepted for a release that counts that token as computed. A
/// decode that recomputed the prompt (no connector, or `kv_load_failure_policy: "recompute"`)
/// raises `local_compute` by the prompt instead.
const VLLM_PROMPT_SOURCES: [Series; 2] = [
    Series {
        family: "vllm:prompt_tokens_by_source",
        sample: "vllm:prompt_tokens_by_source_total",
        label: Some(("source", "local_compute")),
    },
    Series {
        family: "vllm:prompt_tokens_by_source",
        sample: "vllm:prompt_tokens_by_source_total",
        label: Some(("source", "external_kv_transfer")),
    },
];

/// Prompt tokens vLLM computes locally for a prompt received whole over the connector: the
/// last one (see [`VLLM_PROMPT_SOURCES`]).
const ALWAYS_COMPUTED: i64 = 1;

/// vLLM's NIXL connector metrics (`NixlPromMetrics`, registered per engine with labels
/// `model_name`, `engine`), as in `vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`
/// of vllm-project/vllm at commit 002a1057 (NIXL connector version 2; first exposed to
/// Prometheus by vLLM PR #26811, vLLM 0.11.1):
/// - `vllm:nixl_xfer_time_seconds` — histogram, one observation per completed NIXL read on the
///   decode side (`NixlKVConnectorStats.record_transfer`), so its `_count` is the number of
///   completed transfers. It only moves when NIXL telemetry is available (NIXL ≥ 0.7.1);
///   otherwise the family is registered but stays at 0, which reads as "no evidence".
/// - `vllm:nixl_num_failed_transfers` — counter (`_total` sample), incremented when a transfer's
///   setup, posting or completion fails (`record_failed_transfer`). Under vLLM's default
///   `kv_load_failure_policy: "fail"` (`vllm/config/kv_transfer.py`) the request also fails;
///   under `"recompute"` it is recomputed and this counter is the only trace.
pub const VLLM_NIXL: TransferMetrics = TransferMetrics {
    source: "vllm_nixl_metrics",
    transfers: Series {
        family: "vllm:nixl_xfer_time_seconds",
        sample: "vllm:nixl_xfer_time_seconds_count",
        label: None,
    },
    failures: &[Series {
        family: "vllm:nixl_num_failed_transfers",
        sample: "vllm:nixl_num_failed_transfers_total",
        label: None,
    }],
    prompt_sources: Some(VLLM_PROMPT_SOURCES),
};

/// SGLang's disaggregation metrics (`SchedulerMetricsCollector` in
/// `python/sglang/srt/metrics/collector.py` of sgl-project/sglang at commit 00ae9c15; served with
/// `--enable-metrics`):
/// - `sglang:per_stage_req_latency_seconds{stage="decode_transferred"}` — histogram observed once
///   per request when its KV has arrived on the decode side (`RequestStage.DECODE_TRANSFERRED`,
///   `metrics_is_observed`, added as a per-stage latency histogram by SGLang PR #8710); its
///   `_count` is the number of completed transfers. The labelled series only appears after the
///   first observation, so a declared family without that series reads as 0.
/// - `sglang:num_transfer_failed_reqs_total`, `sglang:num_bootstrap_failed_reqs_total` —
///   counters incremented when a decode's transfer or bootstrap (rendezvous) fails
///   (`increment_transfer_failed_reqs`, `increment_bootstrap_failed_reqs`, wired in by SGLang
///   PR #7317); SGLang then aborts the request with a 500.
pub const SGLANG_DISAGGREGATION: TransferMetrics = TransferMetrics {
    source: "sglang_disaggregation_metrics",
    transfers: Series {
        family: "sglang:per_stage_req_latency_seconds",
        sample: "sglang:per_stage_req_latency_seconds_count",
        label: Some(("stage", "decode_transferred")),
    },
    failures: &[
        Series {
            family: "sglang:num_transfer_failed_reqs",
            sample: "sglang:num_transfer_failed_reqs_total",
            label: None,
        },
        Series {
            family: "sglang:num_bootstrap_failed_reqs",
            sample: "sglang:num_bootstrap_failed_reqs_total",
            label: None,
        },
    ],
    prompt_sources: None,
};

/// One reading of an engine's transfer counters.
#[derive(Debug, Clone, PartialEq)]
pub struct TransferCounters {
    /// Which families were read (`transfer.source`).
    pub metrics: TransferMetrics,
    /// Completed transfers so far; `None` when the engine does not publish the family.
    pub transfers: Option<f64>,
    /// Failed transfers so far (all failure families summed); `None` when it publishes none.
    pub failures: Option<f64>,
    /// Prompt tokens computed locally and received over the connector so far
    /// ([`TransferMetrics::prompt_sources`]); `None` when the engine does not publish them.
    pub prompt_sources: Option<(f64, f64)>,
    /// Why this engine cannot receive KV at all, when its own surface says so (an SGLang server
    /// whose `/server_info` `disaggregation_mode` is not `decode`).
    pub cannot_receive: Option<String>,
}

impl TransferCounters {
    /// Reads `metrics` out of a `/metrics` page.
    pub fn from_page(metrics: TransferMetrics, page: &str) -> TransferCounters {
        let x = Exposition::parse(page);
        let failures = metrics
            .failures
            .iter()
            .filter_map(|s| x.sum(s))
            .fold(None, |acc: Option<f64>, v| Some(acc.unwrap_or(0.0) + v));
        let prompt_sources = metrics
            .prompt_sources
            .and_then(|[local, external]| Some((x.sum(&local)?, x.sum(&external)?)));
        TransferCounters {
            metrics,
            transfers: x.sum(&metrics.transfers),
            failures,
            prompt_sources,
            cannot_receive: None,
        }
    }

    /// Whether the engine publishes anything this reading can compare.
    pub fn published(&self) -> bool {
        self.transfers.is_some() || self.failures.is_some()
    }

    /// Whether a counter moved since `before`.
    pub fn moved_since(&self, before: &TransferCounters) -> bool {
        let up = |a: Option<f64>, b: Option<f64>| matches!((a, b), (Some(a), Some(b)) if a > b);
        up(self.transfers, before.transfers)
            || up(self.failures, before.failures)
            || up(
                self.prompt_sources.map(|s| s.1),
                before.prompt_sources.map(|s| s.1),
            )
    }
}

/// A parsed Prometheus text exposition (format 0.0.4, and the OpenMetrics subset engines emit):
/// declared families and samples. Malformed lines are skipped.
#[derive(Debug, Default)]
pub(crate) struct Exposition {
    declared: Vec<String>,
    samples: Vec<Sample>,
}

#[derive(Debug)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

impl Exposition {
    /// Parses `page`. Hand-written because the text-format parser crates either reject the
    /// colon in `vllm:`/`sglang:` names (prometheus-parse 0.2: `\w+`) or are LGPL.
    pub(crate) fn parse(page: &str) -> Exposition {
        let mut x = Exposition::default();
        for line in page.lines() {
            let line = line.trim();
            if let Some(rest) = line.strip_prefix('#') {
                let mut words = rest.split_whitespace();
                if words.next() == Some("TYPE")
                    && let Some(name) = words.next()
                {
                    x.declared.push(name.to_string());
                }
                continue;
            }
            if let Some(s) = parse_sample(line) {
                x.samples.push(s);
            }
        }
        x
    }

    /// The sum of `series` over its label sets: `None` when the family is neither declared nor
    /// sampled (the engine does not publish it), `Some(0.0)` when declared without samples.
    pub(crate) fn sum(&self, series: &Series) -> Option<f64> {
        let counter_total = format!("{}_total", series.family);
        let mut found = self
            .declared
            .iter()
            .any(|d| d == series.family || *d == counter_total);
        let mut total = 0.0;
        for s in self.samples.iter().filter(|s| s.name == series.sample) {
            found = true;
            let wanted = series
                .label
                .is_none_or(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v));
            if wanted && s.value.is_finite() {
                total += s.value;
            }
        }
        found.then_some(total)
    }
}

/// `name{k="v",...} value [timestamp]` → a sample; `None` for anything else.
fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Parses `k="v",k2="v2"}` (after the `{`), with `\\`, `\"` and `\n` escapes in values; returns
/// the labels and what follows the `}`.
fn parse_labels(s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    let mut rest = s.trim_start();
    loop {
        if let Some(tail) = rest.strip_prefix('}') {
            return Some((labels, tail));
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim().to_string();
        rest = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((key, value));
        rest = rest[end + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
}

/// The verdict on one transfer and what it rests on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Judgement {
    /// The verdict.
    pub(crate) verdict: TransferVerdict,
    /// Completed-transfer counter increase, when both readings had it.
    pub(crate) consumed_delta: Option<i64>,
    /// Failure counters' increase, when both readings had them.
    pub(crate) failed_delta: Option<i64>,
    /// Prompt tokens the decode computed locally (`local_compute`'s increase), when both
    /// readings had `vllm:prompt_tokens_by_source`.
    pub(crate) recomputed_delta: Option<i64>,
    /// Which counters were read (`none` when none).
    pub(crate) source: &'static str,
    /// Why, naming the counter or what was missing.
    pub(crate) detail: String,
}

impl Judgement {
    /// The signed `transfer` object of this judgement.
    pub(crate) fn evidence(&self) -> TransferEvidence {
        TransferEvidence {
            source: self.source.to_string(),
            consumed_delta: self.consumed_delta,
            recomputed_delta: self.recomputed_delta,
            engine_phase: None,
            transferred: match self.verdict {
                TransferVerdict::Confirmed => Some(true),
                TransferVerdict::Refuted => Some(false),
                TransferVerdict::Inferred => None,
            },
            verdict: Some(self.verdict),
            failed_delta: self.failed_delta,
            detail: Some(self.detail.clone()),
        }
    }
}

/// The `transfer` object when no transfer was attempted (a standalone probe's local decode, or
/// a leg that never ran): no verdict.
pub(crate) fn no_transfer(why: &str) -> TransferEvidence {
    TransferEvidence {
        source: "none".into(),
        consumed_delta: None,
        recomputed_delta: None,
        engine_phase: None,
        transferred: None,
        verdict: None,
        failed_delta: None,
        detail: Some(why.to_string()),
    }
}

fn delta(after: Option<f64>, before: Option<f64>) -> Option<i64> {
    Some((after? - before?).round() as i64)
}

/// The verdict on a decode leg `leg` that ran with a KV descriptor / rendezvous, from the
/// consumer's counters read `before` and `after` it (`None`: unreadable), after waiting
/// `settled` for them to move (docs/agent.md, "Transfer evidence"):
///
/// 1. The leg failed or decoded no token → `refuted`.
/// 2. The consumer says it cannot receive KV → `refuted`.
/// 3. Both readings publish failure counters and they rose → `refuted`.
/// 4. Both readings publish vLLM's prompt tokens by source, `external_kv_transfer` did not
///    rise and `local_compute` rose by more than the one token vLLM always computes →
///    `refuted` (the decode recomputed the prompt). The counters are the whole engine's, and
///    the consumer may serve other requests meanwhile: their prompts can only add to either
///    source, so only an `external_kv_transfer` that stayed put proves that this decode's
///    prompt did not come over the connector.
/// 5. Both readings publish the completed-transfer counter and it rose → `confirmed`.
/// 6. Both readings publish the prompt tokens by source, `external_kv_transfer` rose and
///    `local_compute` by at most one → `confirmed` (the KV came over the connector, and
///    nothing else ran a prefill there meanwhile).
/// 7. Otherwise (no counters, none moved, or other requests' prompts muddled the sources) →
///    `inferred`: the decode succeeded with the handle. A missing family is unknown evidence,
///    never a confirmation.
pub(crate) fn judge(
    leg: &LegResult,
    before: Option<&TransferCounters>,
    after: Option<&TransferCounters>,
    settled: Duration,
) -> Judgement {
    let both = match (before, after) {
        (Some(b), Some(a)) if b.published() && a.published() => Some((b, a)),
        _ => None,
    };
    let source = both.map_or("none", |(_, a)| a.metrics.source);
    let consumed_delta = both.and_then(|(b, a)| delta(a.transfers, b.transfers));
    let failed_delta = both.and_then(|(b, a)| delta(a.failures, b.failures));
    let sources = both.and_then(|(b, a)| {
        let (bl, be) = b.prompt_sources?;
        let (al, ae) = a.prompt_sources?;
        Some((delta(Some(al), Some(bl))?, delta(Some(ae), Some(be))?))
    });
    let recomputed_delta = sources.map(|(local, _)| local);
    let by_source = |(local, external): (i64, i64)| {
        format!(
            "vllm:prompt_tokens_by_source_total{{source=\"external_kv_transfer\"}} rose by \
             {external}, {{source=\"local_compute\"}} by {local}"
        )
    };
    let failed_names = || {
        after.map_or_else(String::new, |a| {
            a.metrics
                .failures
                .iter()
                .map(Series::display)
                .collect::<Vec<_>>()
                .join(" + ")
        })
    };
    let judgement = |verdict, detail: String| Judgement {
        verdict,
        consumed_delta,
        failed_delta,
        recomputed_delta,
        source,
        detail,
    };
    let failures_rose = failed_delta.is_some_and(|d| d > 0);
    let rose = |what: String| match failed_delta {
        Some(d) if d > 0 => format!("{what}; {} rose by {d}", failed_names()),
        _ => what,
    };
    if !leg.ok {
        let why = leg.error.as_deref().unwrap_or("no reason given");
        return judgement(
            TransferVerdict::Refuted,
            rose(format!("the decode with the KV handle failed: {why}")),
        );
    }
    if leg.tokens == 0 {
        return judgement(
            TransferVerdict::Refuted,
            rose("the decode with the KV handle produced no token".into()),
        );
    }
    if let Some(why) = after.and_then(|a| a.cannot_receive.as_deref()) {
        return judgement(TransferVerdict::Refuted, why.to_string());
    }
    if failures_rose {
        return judgement(
            TransferVerdict::Refuted,
            format!(
                "{} rose by {} during the decode (a failed KV transfer; the decode's {} tokens \
                 were computed without it)",
                failed_names(),
                failed_delta.unwrap_or(0),
                leg.tokens
            ),
        );
    }
    if let Some(s @ (local, external)) = sources
        && local > ALWAYS_COMPUTED
        && external <= 0
    {
        return judgement(
            TransferVerdict::Refuted,
            format!(
                "the decode recomputed the prompt: {} (a transferred prompt computes only its \
                 last token)",
                by_source(s)
            ),
        );
    }
    let also = sources.map_or_else(String::new, |s| format!("; {}", by_source(s)));
    match (both, consumed_delta) {
        (Some((_, a)), Some(d)) if d >= 1 => judgement(
            TransferVerdict::Confirmed,
            format!("{} rose by {d}{also}", a.metrics.transfers.display()),
        ),
        (Some(_), _)
            if sources
                .is_some_and(|(local, external)| external >= 1 && local <= ALWAYS_COMPUTED) =>
        {
            judgement(
                TransferVerdict::Confirmed,
                format!(
                    "{} (the KV arrived over the connector, the prompt was not recomputed)",
                    sources.map(by_source).unwrap_or_default()
                ),
            )
        }
        (Some(_), _) if sources.is_some_and(|(_, external)| external >= 1) => judgement(
            TransferVerdict::Inferred,
            format!(
                "{} while other requests ran on the consumer (its counters are the whole \
                 engine's); the decode with the KV handle produced {} tokens",
                sources.map(by_source).unwrap_or_default(),
                leg.tokens
            ),
        ),
        (Some((_, a)), Some(_)) => judgement(
            TransferVerdict::Inferred,
            format!(
                "{} did not move within {:.1} s (the engine may record no transfer telemetry); \
                 the decode with the KV handle produced {} tokens",
                a.metrics.transfers.display(),
                settled.as_secs_f64(),
                leg.tokens
            ),
        ),
        (Some((_, a)), None) => judgement(
            TransferVerdict::Inferred,
            format!(
                "the engine publishes no {}; the decode with the KV handle produced {} tokens",
                a.metrics.transfers.display(),
                leg.tokens
            ),
        ),
        (None, _) => judgement(
            TransferVerdict::Inferred,
            format!(
                "the engine publishes no KV-transfer counters on /metrics; the decode with the \
                 KV handle produced {} tokens",
                leg.tokens
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape vLLM's prometheus_client exposition has (labels `engine`, `model_name`;
    /// `_created` siblings; other families around).
    fn vllm_page(count: u64, failed: u64) -> String {
        format!(
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
             # TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 0.0\n\
             # HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration for NIXL KV Cache transfers.\n\
             # TYPE vllm:nixl_xfer_time_seconds histogram\n\
             vllm:nixl_xfer_time_seconds_bucket{{engine=\"0\",le=\"0.005\",model_name=\"m\"}} {count}.0\n\
             vllm:nixl_xfer_time_seconds_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"m\"}} {count}.0\n\
             vllm:nixl_xfer_time_seconds_count{{engine=\"0\",model_name=\"m\"}} {count}.0\n\
             vllm:nixl_xfer_time_seconds_sum{{engine=\"0\",model_name=\"m\"}} 0.002\n\
             vllm:nixl_xfer_time_seconds_created{{engine=\"0\",model_name=\"m\"}} 1.7e9\n\
             # HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache transfers.\n\
             # TYPE vllm:nixl_num_failed_transfers counter\n\
             vllm:nixl_num_failed_transfers_total{{engine=\"0\",model_name=\"m\"}} {failed}.0\n\
             vllm:nixl_num_failed_transfers_created{{engine=\"0\",model_name=\"m\"}} 1.7e9\n"
        )
    }

    fn leg(ok: bool, tokens: u64) -> LegResult {
        LegResult {
            ok,
            tokens,
            latency_s: 0.01,
            error: (!ok).then(|| "engine stream error: KV transfer failed".into()),
        }
    }

    fn vllm(count: u64, failed: u64) -> TransferCounters {
        TransferCounters::from_page(VLLM_NIXL, &vllm_page(count, failed))
    }

    const S: Duration = EVIDENCE_SETTLE;

    /// [`vllm`] with vLLM's prompt tokens by source (`local_compute`, `external_kv_transfer`).
    fn vllm_sources(count: u64, failed: u64, local: u64, external: u64) -> TransferCounters {
        let page = format!(
            "{}# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.\n\
             # TYPE vllm:prompt_tokens_by_source counter\n\
             vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"local_compute\"}} {local}.0\n\
             vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"local_cache_hit\"}} 0.0\n\
             vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"external_kv_transfer\"}} {external}.0\n",
            vllm_page(count, failed)
        );
        TransferCounters::from_page(VLLM_NIXL, &page)
    }

    /// vLLM's prompt tokens by source are the "did not recompute" evidence: a transferred
    /// prompt raises `external_kv_transfer` and computes one token; more local compute
    /// refutes; a missing family is unknown, never a confirmation.
    #[test]
    fn prompt_tokens_by_source_confirm_a_transfer_and_refute_a_recompute() {
        // NIXL telemetry did not move (NIXL < 0.7.1), the sources did: confirmed.
        let j = judge(
            &leg(true, 2),
            Some(&vllm_sources(3, 0, 100, 40)),
            Some(&vllm_sources(3, 0, 101, 52)),
            S,
        );
        assert_eq!(j.verdict, TransferVerdict::Confirmed, "{}", j.detail);
        assert_eq!(j.recomputed_delta, Some(1));
        assert!(j.detail.contains("rose by 12"), "{}", j.detail);
        assert_eq!(j.evidence().recomputed_delta, Some(1));
        // Both moved: confirmed by the transfer counter, the sources in the detail.
        let j = judge(
            &leg(true, 2),
            Some(&vllm_sources(3, 0, 100, 40)),
            Some(&vllm_sources(4, 0, 101, 52)),
            S,
        );
        assert_eq!(j.verdict, TransferVerdict::Confirmed);
        assert!(j.detail.contains("external_kv_transfer"), "{}", j.detail);
        // The decode computed the prompt itself (no connector): refuted, whatever else moved.
        let j = judge(
            &leg(true, 2),
            Some(&vllm_sources(3, 0, 100, 40)),
            Some(&vllm_sources(4, 0, 112, 40)),
            S,
        );
        assert_eq!(j.verdict, TransferVerdict::Refuted, "{}", j.detail);
        assert_eq!(j.recomputed_delta, Some(12));
        assert!(j.detail.contains("recomputed"), "{}", j.detail);
        // No sources family (an older vLLM): unknown, the old rules decide.
        let j = judge(&leg(true, 2), Some(&vllm(3, 0)), Some(&vllm(3, 0)), S);
        assert_eq!(j.verdict, TransferVerdict::Inferred);
        assert_eq!(j.recomputed_delta, None);
        // Other requests ran on the consumer meanwhile (its counters are the whole engine's):
        // the connector delivered prompt tokens and something else computed some. That
        // refutes nothing; it confirms only with the transfer counter.
        let j = judge(
            &leg(true, 2),
            Some(&vllm_sources(3, 0, 100, 40)),
            Some(&vllm_sources(3, 0, 102, 48)),
            S,
        );
        assert_eq!(j.verdict, TransferVerdict::Inferred, "{}", j.detail);
        assert!(j.detail.contains("other requests"), "{}", j.detail);
        let j = judge(
            &leg(true, 2),
            Some(&vllm_sources(3, 0, 100, 40)),
            Some(&vllm_sources(4, 0, 102, 48)),
            S,
        );
        assert_eq!(j.verdict, TransferVerdict::Confirmed, "{}", j.detail);
        // Sources that did not move confirm nothing.
        let j = judge(
            &leg(true, 2),
            Some(&vllm_sources(3, 0, 100, 40)),
            Some(&vllm_sources(3, 0, 100, 40)),
            S,
        );
        assert_eq!(j.verdict, TransferVerdict::Inferred);
    }

    #[test]
    fn reads_vllm_nixl_families_summed_over_engines() {
        let two_engines = vllm_page(3, 1)
            + "vllm:nixl_xfer_time_seconds_count{engine=\"1\",model_name=\"m\"} 4\n\
               vllm:nixl_num_failed_transfers_total{engine=\"1\",model_name=\"m\"} 2\n";
        let c = TransferCounters::from_page(VLLM_NIXL, &two_engines);
        assert_eq!(c.transfers, Some(7.0));
        assert_eq!(c.failures, Some(3.0));
        let none = TransferCounters::from_page(VLLM_NIXL, "vllm:num_requests_running 0\n");
        assert_eq!((none.transfers, none.failures), (None, None));
        assert!(!none.published());
    }

    #[test]
    fn reads_sglang_stage_histogram_by_label_and_declared_but_empty_families_as_zero() {
        let fresh = "# HELP sglang:per_stage_req_latency_seconds The latency of each stage of requests.\n\
             # TYPE sglang:per_stage_req_latency_seconds histogram\n\
             # HELP sglang:num_transfer_failed_reqs_total The number of transfer failed requests.\n\
             # TYPE sglang:num_transfer_failed_reqs_total counter\n\
             # TYPE sglang:num_bootstrap_failed_reqs counter\n";
        let c = TransferCounters::from_page(SGLANG_DISAGGREGATION, fresh);
        assert_eq!((c.transfers, c.failures), (Some(0.0), Some(0.0)));
        let later = format!(
            "{fresh}sglang:per_stage_req_latency_seconds_count{{engine_type=\"unified\",model_name=\"m\",stage=\"decode_transferred\",tp_rank=\"0\"}} 2.0\n\
             sglang:per_stage_req_latency_seconds_count{{engine_type=\"unified\",model_name=\"m\",stage=\"decode_waiting\",tp_rank=\"0\"}} 9.0\n\
             sglang:num_transfer_failed_reqs_total{{engine_type=\"unified\",model_name=\"m\"}} 1.0\n"
        );
        let c = TransferCounters::from_page(SGLANG_DISAGGREGATION, &later);
        assert_eq!((c.transfers, c.failures), (Some(2.0), Some(1.0)));
    }

    #[test]
    fn label_values_with_escapes_commas_and_braces_parse() {
        let x = Exposition::parse(
            "a:b_total{model_name=\"we,ird} \\\"name\\\"\",stage=\"decode_transferred\"} 5 1700000000\n\
             bad line here\n{not a sample} 1\n",
        );
        let s = Series {
            family: "a:b",
            sample: "a:b_total",
            label: Some(("stage", "decode_transferred")),
        };
        assert_eq!(x.sum(&s), Some(5.0));
        assert_eq!(x.samples[0].labels[0].1, "we,ird} \"name\"");
    }

    #[test]
    fn a_rising_transfer_counter_confirms() {
        let j = judge(&leg(true, 2), Some(&vllm(3, 0)), Some(&vllm(4, 0)), S);
        assert_eq!(j.verdict, TransferVerdict::Confirmed);
        assert_eq!((j.consumed_delta, j.failed_delta), (Some(1), Some(0)));
        assert_eq!(j.source, "vllm_nixl_metrics");
        assert!(
            j.detail
                .contains("vllm:nixl_xfer_time_seconds_count rose by 1")
        );
        let ev = j.evidence();
        assert_eq!(ev.transferred, Some(true));
        assert_eq!(ev.verdict, Some(TransferVerdict::Confirmed));
    }

    #[test]
    fn a_rising_failure_counter_refutes_even_a_successful_decode_and_a_moved_transfer_count() {
        // vLLM kv_load_failure_policy "recompute": the decode succeeds, recomputed.
        let j = judge(&leg(true, 2), Some(&vllm(3, 0)), Some(&vllm(4, 1)), S);
        assert_eq!(j.verdict, TransferVerdict::Refuted);
        assert!(
            j.detail
                .contains("vllm:nixl_num_failed_transfers_total rose by 1"),
            "{}",
            j.detail
        );
        assert_eq!(j.evidence().transferred, Some(false));
    }

    #[test]
    fn a_failed_decode_refutes_whatever_the_counters_say() {
        let j = judge(&leg(false, 0), Some(&vllm(3, 0)), Some(&vllm(3, 1)), S);
        assert_eq!(j.verdict, TransferVerdict::Refuted);
        assert!(j.detail.starts_with("the decode with the KV handle failed"));
        assert!(j.detail.contains("rose by 1"), "{}", j.detail);
        let j = judge(&leg(true, 0), None, None, S);
        assert_eq!(j.verdict, TransferVerdict::Refuted);
    }

    #[test]
    fn without_counters_or_without_movement_a_successful_decode_is_inferred() {
        let j = judge(&leg(true, 2), None, None, S);
        assert_eq!(j.verdict, TransferVerdict::Inferred);
        assert_eq!(j.source, "none");
        assert_eq!(j.evidence().transferred, None);
        // Metrics page without the families (an older vLLM, or no connector metrics).
        let bare = TransferCounters::from_page(VLLM_NIXL, "vllm:num_requests_running 0\n");
        let j = judge(&leg(true, 2), Some(&bare), Some(&bare), S);
        assert_eq!(j.verdict, TransferVerdict::Inferred);
        assert_eq!(j.source, "none");
        // Families registered but NIXL telemetry off: nothing moves.
        let j = judge(&leg(true, 2), Some(&vllm(3, 0)), Some(&vllm(3, 0)), S);
        assert_eq!(j.verdict, TransferVerdict::Inferred);
        assert!(
            j.detail.contains("did not move within 1.0 s"),
            "{}",
            j.detail
        );
        assert_eq!((j.consumed_delta, j.failed_delta), (Some(0), Some(0)));
        // Only one reading: no baseline, no delta.
        let j = judge(&leg(true, 2), None, Some(&vllm(4, 0)), S);
        assert_eq!(j.verdict, TransferVerdict::Inferred);
    }

    #[test]
    fn a_consumer_that_cannot_receive_refutes() {
        let mut after = TransferCounters::from_page(SGLANG_DISAGGREGATION, "");
        after.cannot_receive = Some("disaggregation_mode is null".into());
        let j = judge(&leg(true, 2), None, Some(&after), S);
        assert_eq!(j.verdict, TransferVerdict::Refuted);
        assert_eq!(j.detail, "disaggregation_mode is null");
    }

    #[test]
    fn moved_since_sees_either_counter() {
        assert!(vllm(4, 0).moved_since(&vllm(3, 0)));
        assert!(vllm(3, 1).moved_since(&vllm(3, 0)));
        assert!(!vllm(3, 0).moved_since(&vllm(3, 0)));
    }
}
