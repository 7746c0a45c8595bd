//! The simulator's `/sim/stats` document, typed for the tests that read it
//! (docs/engine-simulator.md, "Statistics"). The simulator writes it; these types read it and
//! refuse a member they do not know (`deny_unknown_fields`), so a field the simulator adds
//! without adding it here fails the first test that reads the stats.

use serde::Deserialize;

/// `GET /sim/stats`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimStats {
    /// The engine id the simulator reports (vLLM's engine id, SGLang's server id).
    pub engine_id: String,
    /// `vllm` or `sglang`.
    pub dialect: String,
    /// The served model.
    pub model: String,
    /// The simulator's process id.
    pub pid: u32,
    /// Process start, Unix seconds.
    pub started_at: f64,
    /// Requests that arrived, per phase.
    pub requests: SimRequests,
    /// KV transfers.
    pub kv: SimKv,
    /// Requests the client abandoned.
    pub cancelled: u64,
    /// Requests refused for a missing or wrong API key.
    pub unauthorized: u64,
    /// Requests in flight now (a gauge).
    pub in_flight: i64,
    /// Of `in_flight`, those waiting for a place under `--max-num-seqs`.
    pub waiting: i64,
    /// Role switches served (SGLang).
    pub role_switches: u64,
    /// The latest requests, oldest first.
    pub recent: Vec<SimRecent>,
    /// The prefix cache's counters (summed over data-parallel ranks), when it has one.
    #[serde(default)]
    pub prefix_cache: Option<SimCacheCounters>,
}

/// `requests` of [`SimStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimRequests {
    /// Arrived as prefill.
    pub prefill: u64,
    /// Arrived as decode.
    pub decode: u64,
    /// Arrived aggregated.
    pub aggregated: u64,
    /// `POST /tokenize` calls answered.
    pub tokenize: u64,
}

/// `kv` of [`SimStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimKv {
    /// Descriptors or rooms issued by a prefill.
    pub issued: u64,
    /// KV read from this producer.
    pub served: u64,
    /// KV this consumer read.
    pub consumed: u64,
    /// KV reads refused.
    pub rejected: u64,
    /// Decodes that recomputed the prompt instead of reading KV.
    pub recomputed: u64,
    /// Issued KV that expired unread.
    pub expired: u64,
}

/// One entry of `recent`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimRecent {
    /// `x-request-id` (vLLM) or body `rid` (SGLang), else a generated id.
    pub request_id: String,
    /// `prefill`, `decode` or `aggregated`.
    pub phase: String,
    /// `ok`, `error`, `cancelled` or `fault`.
    pub outcome: String,
    /// HTTP status sent (499 when cancelled before the response head).
    pub status: u16,
    /// Generated tokens sent to the client.
    pub tokens: u64,
    /// Consumer: the producer's engine id. Producer: the consumer's address once read.
    pub kv_peer: Option<String>,
    /// SGLang bootstrap room, when the request carried one.
    pub room: Option<u64>,
    /// vLLM block ids issued (producer) or read (consumer).
    pub block_ids: Option<Vec<u64>>,
    /// The request asked for a stream.
    pub stream: bool,
}

/// `prefix_cache` of [`SimStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimCacheCounters {
    /// Blocks held now.
    pub blocks: u64,
    /// Capacity in blocks.
    pub capacity: u64,
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Prompt tokens found cached.
    pub hits: u64,
    /// Blocks stored.
    pub stored: u64,
    /// Blocks evicted to make room.
    pub evictions: u64,
    /// Cache resets.
    pub resets: u64,
}

/// One entry of `GET /sim/faults` (`{"faults": [...]}`), as the simulator lists a queued fault:
/// `count` is the uses left, `skip` the matching requests still to pass untouched
/// (docs/engine-simulator.md, "Faults").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimFault {
    /// `prefill`, `decode`, `aggregated`, `any`, `health`, ...
    pub phase: String,
    /// Uses left.
    pub count: u32,
    /// Matching requests still to pass untouched (absent: 0).
    #[serde(default)]
    pub skip: u32,
    /// `status`, `hang`, `cut`, `drop`, `omit_kv`, `fragment` or `fail_transfer`.
    pub action: String,
    /// For `status`: the status answered.
    #[serde(default)]
    pub status: Option<u16>,
    /// For `status`: the body answered (an open document).
    #[serde(default)]
    pub body: Option<serde_json::Value>,
    /// For `hang`: milliseconds before the first byte.
    #[serde(default)]
    pub ms: Option<u64>,
    /// For `cut`: token chunks sent first.
    #[serde(default)]
    pub after_tokens: Option<u32>,
    /// For `fragment`: bytes per write.
    #[serde(default)]
    pub bytes: Option<usize>,
    /// For `fail_transfer`: `fail` or `recompute`.
    #[serde(default)]
    pub policy: Option<String>,
}

/// `GET /sim/faults`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimFaults {
    /// The faults still queued, in queue order.
    pub faults: Vec<SimFault>,
}
