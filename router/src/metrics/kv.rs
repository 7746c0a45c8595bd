//! The KV index families (`narwhal_kv_index_*`; docs/monitoring.md, docs/design/kv-aware-placement.md),
//! set from the index's snapshot at each scrape.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Labels;

/// The KV index per engine and the KV score's `/tokenize` calls.
pub(crate) struct KvMetrics {
    /// Per-engine gauges, set at each scrape.
    pub(crate) gauges: KvGauges,
    /// Cumulative counts, raised to their owners' totals at each scrape.
    pub(crate) counters: KvCounters,
    /// The credit check's counts per engine, raised at each scrape.
    pub(crate) credit: KvCreditCounters,
    /// The router's own tokenizer's counts, raised at each scrape.
    pub(crate) router_tokenizer: RouterTokenizerCounters,
}

/// The credit check's counters (docs/design/kv-aware-placement.md, section 6.1).
pub(crate) struct KvCreditCounters {
    /// `narwhal_kv_credit_checked_total{iid}`: requests whose credit was checked against the
    /// engine's own cached-token count.
    pub(crate) checked: Family<Labels, Counter>,
    /// `narwhal_kv_over_credit_tokens_total{iid}`: tokens the engine's events reported held
    /// that it did not have when a request came.
    pub(crate) over: Family<Labels, Counter>,
    /// `narwhal_kv_under_credit_tokens_total{iid}`: tokens the engine had cached beyond the
    /// router's credit.
    pub(crate) under: Family<Labels, Counter>,
}

/// The KV index's per-engine gauges.
pub(crate) struct KvGauges {
    /// `narwhal_kv_index_mode{iid, mode}`: 1 for the engine's mode (`exact`, `approximate`,
    /// `none`, `suspect`), 0 for the others.
    pub(crate) mode: Family<Labels, Gauge>,
    /// `narwhal_kv_index_reason{iid, reason}`: 1 for why the engine is in its mode (`events`,
    /// `no_kv_events`, `waiting`, `stale`, `off`, `tokenizer_mismatch`, `over_credit`), 0 for
    /// the others.
    pub(crate) reason: Family<Labels, Gauge>,
    /// `narwhal_kv_index_lag_seconds{iid}`: seconds since the engine's last batch (no sample
    /// before the first).
    pub(crate) lag: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `narwhal_kv_index_blocks{iid}`: blocks the index holds for the engine from its events.
    pub(crate) blocks: Family<Labels, Gauge>,
    /// `narwhal_kv_index_approx_blocks{iid}`: blocks the approximate index credits the engine
    /// with from placements (not expired).
    pub(crate) approx_blocks: Family<Labels, Gauge>,
}

/// The KV index's counters.
pub(crate) struct KvCounters {
    /// `narwhal_kv_index_gaps_total{iid}`: sequence gaps seen.
    pub(crate) gaps: Family<Labels, Counter>,
    /// `narwhal_kv_index_replays_total{iid}`: gaps filled from the engine's replay socket.
    pub(crate) replays: Family<Labels, Counter>,
    /// `narwhal_kv_index_resets_total{iid}`: times the engine's entries were dropped.
    pub(crate) resets: Family<Labels, Counter>,
    /// `narwhal_kv_index_tokenize_failures_total`: requests placed by load because their
    /// tokens could not be had.
    pub(crate) tokenize_failures: Counter,
    /// `narwhal_kv_index_tokenize_seconds_total`: seconds spent in `/tokenize` for scoring.
    pub(crate) tokenize_seconds: Counter<f64, AtomicU64>,
    /// `narwhal_kv_index_unscored_total`: requests not scored because placement had at most
    /// one engine to choose from and no profiles are configured, or because they carry what
    /// vLLM keys blocks by that the router cannot compute (multimodal parts, prompt
    /// embeddings).
    pub(crate) unscored: Counter,
}

/// The router's own tokenizer's counters (`engine.tokenizer`).
pub(crate) struct RouterTokenizerCounters {
    /// `narwhal_kv_index_router_tokenized_total`: prompts tokenized by the router's own
    /// tokenizer, no engine asked.
    pub(crate) tokenized: Counter,
    /// `narwhal_kv_index_router_tokenize_seconds_total`: seconds the router's tokenizer spent.
    pub(crate) seconds: Counter<f64, AtomicU64>,
    /// `narwhal_kv_index_router_tokenizer_fallbacks_total`: prompts the router's tokenizer
    /// could not render, tokenized by an engine instead.
    pub(crate) fallbacks: Counter,
}

impl KvMetrics {
    /// Registers the families in `r`.
    pub(super) fn register(r: &mut Registry) -> KvMetrics {
        let g = KvGauges {
            mode: Family::default(),
            reason: Family::default(),
            lag: Family::default(),
            blocks: Family::default(),
            approx_blocks: Family::default(),
        };
        let credit = KvCreditCounters {
            checked: Family::default(),
            over: Family::default(),
            under: Family::default(),
        };
        let c = KvCounters {
            gaps: Family::default(),
            replays: Family::default(),
            resets: Family::default(),
            tokenize_failures: Counter::default(),
            unscored: Counter::default(),
            tokenize_seconds: Counter::default(),
        };
        let t = RouterTokenizerCounters {
            tokenized: Counter::default(),
            seconds: Counter::default(),
            fallbacks: Counter::default(),
        };
        r.register(
            "narwhal_kv_index_mode",
            "1 for each engine's KV index mode (exact, approximate, none, suspect), else 0",
            g.mode.clone(),
        );
        r.register(
            "narwhal_kv_index_reason",
            "1 for why each engine's KV index is in its mode (events, no_kv_events, waiting, stale, off, tokenizer_mismatch, over_credit), else 0",
            g.reason.clone(),
        );
        r.register(
            "narwhal_kv_index_lag_seconds",
            "Seconds since the engine's last KV event batch",
            g.lag.clone(),
        );
        r.register(
            "narwhal_kv_index_blocks",
            "Prefix-cache blocks the KV index holds for the engine from its KV events",
            g.blocks.clone(),
        );
        r.register(
            "narwhal_kv_index_approx_blocks",
            "Prompt blocks the approximate KV index credits the engine with from placements",
            g.approx_blocks.clone(),
        );
        r.register(
            "narwhal_kv_index_gaps",
            "KV event sequence gaps seen per engine",
            c.gaps.clone(),
        );
        r.register(
            "narwhal_kv_index_replays",
            "KV event gaps filled from the engine's replay socket",
            c.replays.clone(),
        );
        r.register(
            "narwhal_kv_index_resets",
            "Times an engine's KV index entries were dropped (new process, unfillable gap)",
            c.resets.clone(),
        );
        r.register(
            "narwhal_kv_credit_checked",
            "Requests whose KV credit was checked against the engine's own cached-token count",
            credit.checked.clone(),
        );
        r.register(
            "narwhal_kv_over_credit_tokens",
            "Prompt tokens the engine's KV events reported held that it did not have when a request came",
            credit.over.clone(),
        );
        r.register(
            "narwhal_kv_under_credit_tokens",
            "Prompt tokens the engine had cached beyond the router's KV credit",
            credit.under.clone(),
        );
        r.register(
            "narwhal_kv_index_tokenize_failures",
            "Requests placed by load because /tokenize gave no tokens",
            c.tokenize_failures.clone(),
        );
        r.register(
            "narwhal_kv_index_tokenize_seconds",
            "Seconds spent in /tokenize for the KV score",
            c.tokenize_seconds.clone(),
        );
        r.register(
            "narwhal_kv_index_unscored",
            "Requests not scored (no /tokenize): at most one engine to choose from with no profiles, or keyed by what the router cannot compute (multimodal parts, prompt_embeds)",
            c.unscored.clone(),
        );
        r.register(
            "narwhal_kv_index_router_tokenized",
            "Prompts tokenized by the router's own tokenizer (engine.tokenizer) for the KV score",
            t.tokenized.clone(),
        );
        r.register(
            "narwhal_kv_index_router_tokenize_seconds",
            "Seconds the router's own tokenizer spent rendering and encoding prompts",
            t.seconds.clone(),
        );
        r.register(
            "narwhal_kv_index_router_tokenizer_fallbacks",
            "Prompts the router's tokenizer could not render, tokenized by an engine's /tokenize instead",
            t.fallbacks.clone(),
        );
        KvMetrics {
            gauges: g,
            counters: c,
            credit,
            router_tokenizer: t,
        }
    }
}

/// Raises counter `c` to `total` (a cumulative count read from its owner).
pub(crate) fn raise(c: &Counter, total: u64) {
    let now = c.get();
    if total > now {
        c.inc_by(total - now);
    }
}
