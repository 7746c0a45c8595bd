//! The documents `narwhal-bench` writes with `--json` (docs/benchmarks.md), typed for the tests
//! that read them: `narwhal.bench.compare` (the comparison) and `narwhal.bench.prefix` (the
//! shared-prefix workload). A figure the bench could not compute is `null` (`None`). They
//! read the members the tests check; the bench writes more.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The `narwhal.bench.compare` document (`--json`, docs/benchmarks.md), the fields these tests
/// check.
#[derive(Debug, Deserialize)]
pub struct CompareDoc {
    /// The schema name.
    pub schema: String,
    /// The schema version.
    pub version: u32,
    /// Failed requests plus P/D targets that did not do P/D.
    pub problems: u64,
    /// The CPU lists of the routers and the load, when pinned.
    pub pinning: Option<Pinning>,
    /// The targets, in run order.
    pub targets: Vec<TargetDoc>,
    /// One per request shape.
    pub sections: Vec<SectionDoc>,
}

/// `pinning`: the CPU lists the routers and the load ran on.
#[derive(Debug, Deserialize)]
pub struct Pinning {
    /// The routers' CPU list.
    pub router_cpus: Option<String>,
}

/// One of the document's `targets`.
#[derive(Debug, Deserialize)]
pub struct TargetDoc {
    /// The target's name.
    pub name: String,
    /// `direct`, `pd` or `agg`.
    pub kind: String,
    /// The router's process id (`None` for `direct`).
    pub pid: Option<u64>,
    /// The CPUs the target's threads ran on.
    pub cpus: Option<String>,
    /// A peer router (not ours).
    pub peer: bool,
    /// A peer's command line (`None` for our targets).
    pub command: Option<String>,
}

/// One of the document's `sections`.
#[derive(Debug, Deserialize)]
pub struct SectionDoc {
    /// `throughput` or `latency`.
    pub mode: String,
    /// Whether the section streamed.
    pub stream: bool,
    /// Requests in flight at once.
    pub concurrency: u64,
    /// Requests sent.
    pub requests: u64,
    /// The targets, in run order.
    pub targets: Vec<RowDoc>,
}

/// One target's row of a section.
#[derive(Debug, Deserialize)]
pub struct RowDoc {
    /// The target's name.
    pub name: String,
    /// A peer router (not ours).
    pub peer: bool,
    /// Requests completed.
    pub completed: u64,
    /// Requests that failed.
    pub errors: u64,
    /// One per round (open documents).
    pub windows: Vec<Value>,
    /// Requests per second.
    pub rps: Option<f64>,
    /// Median latency, milliseconds.
    pub p50_ms: Option<f64>,
    /// 99th percentile latency, milliseconds.
    pub p99_ms: Option<f64>,
    /// Median time to the first byte, milliseconds.
    pub ttfb_p50_ms: Option<f64>,
    /// Throughput over `direct`'s.
    pub ratio_to_direct: Option<f64>,
    /// Throughput over each peer's, by peer name (`null` where not computed).
    pub ratio_to_peers: Map<String, Value>,
    /// Router CPU per request, milliseconds (`None` for `direct`).
    pub cpu_ms_per_request: Option<f64>,
    /// Resident memory at the end, MiB.
    pub rss_mib: Option<f64>,
    /// Peak resident memory, MiB.
    pub peak_rss_mib: Option<f64>,
    /// What the engines counted while the target ran.
    pub engines: EngineCounts,
    /// Why a P/D target did not do P/D, if it did not.
    pub pd_problem: Option<String>,
}

/// A row's and a window's `engines`: what the engines behind a target counted while it ran
/// (deltas of `/sim/stats`). The bench writes it and the tests read it with this one type.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineCounts {
    /// Prefill legs (`requests.prefill` of the prefill engine).
    pub prefill: u64,
    /// Decode legs (`requests.decode` of the decode engine).
    pub decode: u64,
    /// Aggregated requests (`requests.aggregated`, every engine of the target).
    pub aggregated: u64,
    /// KV descriptors or rooms the prefill engine produced (`kv.issued`).
    pub issued: u64,
    /// Transfers the decode engine completed (`kv.consumed`).
    pub consumed: u64,
    /// Decode-capable requests served without transferred KV (`kv.recomputed`).
    pub recomputed: u64,
    /// Failed transfers (`kv.rejected`).
    pub rejected: u64,
}

/// Field by field.
impl std::ops::Add for EngineCounts {
    type Output = EngineCounts;

    fn add(self, o: EngineCounts) -> EngineCounts {
        EngineCounts {
            prefill: self.prefill + o.prefill,
            decode: self.decode + o.decode,
            aggregated: self.aggregated + o.aggregated,
            issued: self.issued + o.issued,
            consumed: self.consumed + o.consumed,
            recomputed: self.recomputed + o.recomputed,
            rejected: self.rejected + o.rejected,
        }
    }
}

/// The `narwhal.bench.prefix` document (`--json`, docs/benchmarks.md), the fields this test
/// checks; a figure the bench could not compute is `null` (`None`).
#[derive(Debug, Deserialize)]
pub struct PrefixDoc {
    /// The schema name.
    pub schema: String,
    /// Requests sent.
    pub requests: u64,
    /// The pooled-LRU oracle.
    pub oracle: Oracle,
    /// The targets, in run order.
    pub targets: Vec<PrefixTarget>,
    /// The standby takeover's hit rates (`null` with `--standby-s 0`).
    pub standby: Option<Standby>,
}

/// `oracle`: the hit rate of a pooled LRU cache, bounded and not.
#[derive(Debug, Deserialize)]
pub struct Oracle {
    /// Prefix-cache hit rate, 0 to 1.
    pub hit_rate: f64,
    /// Its hit rate with unbounded caches.
    pub unbounded_hit_rate: f64,
}

/// One of `targets`.
#[derive(Debug, Deserialize)]
pub struct PrefixTarget {
    /// The target's name.
    pub name: String,
    /// Requests sent.
    pub requests: Option<u64>,
    /// Requests completed.
    pub completed: Option<u64>,
    /// Median TTFT, seconds.
    pub ttft_p50_s: Option<f64>,
    /// 90th percentile TTFT, seconds.
    pub ttft_p90_s: Option<f64>,
    /// Share of requests within the SLO, 0 to 1.
    pub slo_attainment: Option<f64>,
    /// Requests per second.
    pub throughput_rps: Option<f64>,
    /// Prefix-cache hit rate, 0 to 1.
    pub hit_rate: Option<f64>,
    /// Prompt tokens looked up.
    pub queries: Option<u64>,
    /// The router-restart figure (`--router-restart-at`), `null` without one.
    pub router_restart: Option<RouterRestart>,
}

/// `targets[].router_restart`: the hit rate of the 10 s before the target router's restart and
/// of the 10 s from it.
#[derive(Debug, Deserialize)]
pub struct RouterRestart {
    /// Hit rate in the 10 s before the SIGTERM, 0 to 1.
    pub hit_rate_before: f64,
    /// Hit rate in the 10 s from it.
    pub hit_rate_after: f64,
    /// Seconds from the SIGTERM until the new router answered.
    pub down_s: f64,
    /// The window before.
    pub before: Queries,
    /// The window from the restart.
    pub after: Queries,
}

/// `standby`: the hit rate before and after the standby took over.
#[derive(Debug, Deserialize)]
pub struct Standby {
    /// Hit rate before the takeover.
    pub hit_rate_before: Option<f64>,
    /// Hit rate after the takeover.
    pub hit_rate_after: Option<f64>,
    /// After over before.
    pub ratio: Option<f64>,
    /// The window before the takeover.
    pub before: Queries,
    /// The window after the takeover.
    pub after: Queries,
}

/// `standby.before` / `standby.after`.
#[derive(Debug, Deserialize)]
pub struct Queries {
    /// Prompt tokens looked up.
    pub queries: Option<u64>,
}
