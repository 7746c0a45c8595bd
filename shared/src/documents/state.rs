//! `GET /narwhal/state`, schema `narwhal.state` version 1 (behaviour.md 1.7; controller.md 13
//! for the controller's fields; docs/http-api.md gives each field).
//!
//! ```text
//!  {schema, schema_version, journal_run, <outcome counters>, token_accounting,
//!   ha {...}, lifecycle <LifecycleView>, admission {...}, outcome_reasons {...},
//!   serving {...}, pools {prefill, decode}, slo {ttft_s, tpot_s}, first_token_timeout_s, kv_transfer_timeout_s,
//!   resident {<iid>: {prefill, decode}}, pinned, min_prefill, min_decode, ejected, draining,
//!   quarantined, holds {timed, inference}, inference_sources, breaker {...}, unserved,
//!   journal_dropped, journal_writes_failing, awaiting_health, degraded,
//!   kv_index {tokenizer, tokenizer_detail, tokenized, tokenize_failures, tokenize_seconds,
//!   unscored, tokenizer_sampled, router_tokenizer {model_dir, shapes, details, tokenized,
//!   seconds, fallbacks, checked}, engines {<iid>: {mode, lag_s, blocks, batches, gaps, replays, resets, overflow}}},
//!   controller, <the controller's fields>}
//! ```
//!
//! Fields serialise in that order (the order the router has always written). Engine lists are
//! sorted engine ids. On parse every field defaults when absent and unknown fields are
//! ignored.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::controller::ControllerReport;
use super::lifecycle::{LifecycleView, Resident};
use super::ordered::Ordered;

/// `schema` of the state document.
pub const STATE_SCHEMA: &str = "narwhal.state";
/// The `schema_version` this release writes.
pub const STATE_VERSION: u32 = 1;

/// The state document (behaviour.md 1.7).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct State {
    /// Always [`STATE_SCHEMA`].
    pub schema: String,
    /// [`STATE_VERSION`].
    pub schema_version: u32,
    /// This process's journal run id (behaviour.md 7.8).
    pub journal_run: String,
    /// Requests served (outcome counters, behaviour.md 7.7a).
    pub served: u64,
    /// Served within the SLO.
    pub slo_met: u64,
    /// Requests offered.
    pub offered: u64,
    /// Offered without a size (no token count).
    pub unsized_offered: u64,
    /// Expired (a deadline).
    pub expired: u64,
    /// Failed.
    pub failed: u64,
    /// Cancelled by the client.
    pub cancelled: u64,
    /// Refused at ingress (400).
    pub invalid_requests: u64,
    /// Rejected (admission, 429/503).
    pub rejected: u64,
    /// Refused by predictive admission.
    pub refused: u64,
    /// Always `"token_ids"`.
    pub token_accounting: String,
    /// Control and the lease.
    pub ha: Ha,
    /// The lifecycle view.
    pub lifecycle: LifecycleView,
    /// Admission seats and the queue.
    pub admission: Admission,
    /// Per terminal, reason → count.
    pub outcome_reasons: OutcomeReasons,
    /// Retry and attempt accounting.
    pub serving: Serving,
    /// Engines by current router role.
    pub pools: Pools,
    /// The configured SLO.
    pub slo: Slo,
    /// `engine.first_token_timeout_s`, seconds.
    pub first_token_timeout_s: f64,
    /// `engine.kv_transfer_timeout_s`, seconds: a split's decode leg waits
    /// `first_token_timeout_s + kv_transfer_timeout_s` for its first token.
    pub kv_transfer_timeout_s: f64,
    /// Resident requests per engine, sorted by id.
    pub resident: BTreeMap<String, Resident>,
    /// Engines with `pin: true` (never moved by the role controller).
    pub pinned: Vec<String>,
    /// `controller.min_prefill`.
    pub min_prefill: u64,
    /// `controller.min_decode`.
    pub min_decode: u64,
    /// Breaker-ejected engines.
    pub ejected: Vec<String>,
    /// Engines a lifecycle hold keeps out of placement.
    pub draining: Vec<String>,
    /// Always empty (no quarantine in this version).
    pub quarantined: Vec<String>,
    /// Holds.
    pub holds: Holds,
    /// Suspect engine → producers whose KV fed its failing decodes (`""` = a local probe),
    /// config order (behaviour.md 6.8).
    pub inference_sources: Ordered<Vec<String>>,
    /// The breaker (behaviour.md 6.2–6.4).
    pub breaker: Breaker,
    /// Placements whose engine alone misses the TTFT SLO, refused ones included.
    pub unserved: u64,
    /// Journal rows dropped, whole: the writer fell behind, or a write failed (a full disk).
    pub journal_dropped: u64,
    /// The journal's last write failed: rows are dropped and counted until one succeeds.
    #[serde(default)]
    pub journal_writes_failing: bool,
    /// Engines whose health path has not answered 200 since the router started (the health
    /// gate; ours).
    pub awaiting_health: Vec<String>,
    /// Engines the ejection bound keeps in placement although a failure streak reached its
    /// threshold (ours, behaviour.md 6.2).
    pub degraded: Vec<String>,
    /// The KV index of KV-aware placement (ours; docs/design/kv-aware-placement.md).
    pub kv_index: KvIndex,
    /// Per engine, the transfer evidence of its latest KV consume check, as its agent signed
    /// it (`source`, `verdict`, `consumed_delta`, `failed_delta`, `recomputed_delta`: the
    /// prompt tokens the decode computed itself, 1 for a prompt received whole, `detail`;
    /// docs/agent.md, "Transfer evidence"); engines never checked are absent (ours).
    #[serde(default)]
    pub kv_evidence: BTreeMap<String, crate::TransferEvidence>,
    /// `controller` and, with the controller on, its fields (controller.md 13).
    #[serde(flatten)]
    pub controller: ControllerReport,
}

/// `kv_index`: the KV block index and the KV score's tokens.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KvIndex {
    /// Whether the engines' `/tokenize` agree, on a probe prompt and on sampled real
    /// requests of each shape (completion, chat, chat with tools): `unchecked`, `agree`,
    /// `mismatch` (the KV score is off: placement by load), `failed` (retried).
    pub tokenizer: String,
    /// What differed or failed; null otherwise.
    pub tokenizer_detail: Option<String>,
    /// Prompts tokenized for the KV score.
    pub tokenized: u64,
    /// Prompts placed by load because `/tokenize` gave no tokens.
    pub tokenize_failures: u64,
    /// Seconds spent in `/tokenize` for the score, in total (÷ `tokenized`: the cost per
    /// prompt).
    pub tokenize_seconds: f64,
    /// Requests not scored (nothing tokenized) because placement had at most one engine to
    /// choose from and no profiles are configured (docs/design/kv-aware-placement.md).
    pub unscored: u64,
    /// Real requests whose tokens were checked on a second engine (the sampled tokenizer
    /// check: each engine once per request shape, then one request in 256 of a shape).
    pub tokenizer_sampled: u64,
    /// The router's own tokenizer (`engine.tokenizer`); null when none is configured (every
    /// prompt is then tokenized by an engine's `/tokenize`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router_tokenizer: Option<RouterTokenizer>,
    /// Per engine id, every configured engine.
    pub engines: BTreeMap<String, KvEngine>,
}

/// `kv_index.router_tokenizer`: the model's tokenizer in the router and whether it agrees
/// with the engines' `/tokenize`, per request shape.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RouterTokenizer {
    /// The model directory (`engine.tokenizer`).
    pub model_dir: String,
    /// Per request shape (`completion`, `chat`, `chat with tools`): `unchecked`, `agree`, or
    /// `mismatch` (that shape's requests are tokenized by the engines until a restart).
    pub shapes: BTreeMap<String, String>,
    /// What differed, per mismatched shape.
    pub details: BTreeMap<String, String>,
    /// Prompts tokenized by the router.
    pub tokenized: u64,
    /// Seconds the router spent on them, in total (rendering and encoding).
    pub seconds: f64,
    /// Prompts it could not render (a template error, a chat template in the request),
    /// tokenized by an engine instead.
    pub fallbacks: u64,
    /// Router-tokenized prompts checked against an engine's `/tokenize`.
    pub checked: u64,
}

/// `kv_index.engines.<iid>`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KvEngine {
    /// `exact` (credited from its KV events), `approximate` (credited from the router's own
    /// placements, with a TTL), `none` (never credited).
    pub mode: String,
    /// Why: `events` (exact); `no_kv_events`, `waiting` (no batch from this process yet),
    /// `stale` (its events stopped) (approximate); `off` (`serving.kv_aware_placement`
    /// false), `tokenizer_mismatch` (none).
    pub reason: String,
    /// Seconds since its last batch; null before the first.
    pub lag_s: Option<f64>,
    /// Blocks the index holds for it from its events.
    pub blocks: u64,
    /// Blocks the approximate index credits it with from placements (not expired).
    pub approx_blocks: u64,
    /// Approximate blocks evicted by the per-engine bound (cumulative).
    pub approx_evicted: u64,
    /// Batches applied.
    pub batches: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Gaps filled from its replay socket.
    pub replays: u64,
    /// Times its entries were dropped (new process, unfillable gap, undecodable batch).
    pub resets: u64,
    /// Stored blocks not indexed (index full, or unknown parent).
    pub overflow: u64,
    /// Events not applied: another tier than the GPU's (`medium`), a store without token ids,
    /// another KV cache group than the first, or an unknown event type (skipped, never a
    /// reset).
    pub skipped: u64,
    /// The credit check (docs/design/kv-aware-placement.md, section 6.1): the router's
    /// credit held against the engine's own cached-token counts.
    pub credit: KvCreditCheck,
}

/// `kv_index.engines.<iid>.credit`: requests whose prompt the engine computed, with its own
/// `usage.prompt_tokens_details.cached_tokens`, checked against the router's credit.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KvCreditCheck {
    /// Requests checked.
    pub checked: u64,
    /// Of those, the ones over-credited: the engine had fewer tokens cached than its own
    /// events had reported held.
    pub over_credited: u64,
    /// Tokens over-credited, summed.
    pub over_tokens: u64,
    /// Tokens under-credited (the engine had more than the router credited), summed.
    pub under_tokens: u64,
}

/// `ha`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Ha {
    /// `/ready` is 200.
    pub ready: bool,
    /// The standby loop runs.
    pub standby: bool,
    /// As `/ready`'s `epoch`.
    pub epoch: u64,
    /// As `/ready`'s `holder`.
    pub holder: String,
    /// The HA phase's own `/ready` reason, `""` when none.
    pub blocked: String,
    /// As `/ready`'s `control_ready`.
    pub controls_fleet: bool,
    /// Why `--resume` refused the state file (behaviour.md 2.8).
    pub resume: Resume,
}

/// `ha.resume`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Resume {
    /// `--resume` refused the state file.
    pub refused: bool,
    /// Why, `""` when it did not.
    pub reason: String,
}

/// `admission`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Admission {
    /// Requests holding a seat.
    pub inflight: u64,
    /// Requests waiting for a seat.
    pub queued: u64,
    /// `serving.queue_capacity`.
    pub queue_capacity: u64,
    /// Most requests ever waiting at once.
    pub queue_high_water: u64,
    /// Requests waiting for an admission seat now.
    pub waiting_prefill: u64,
    /// Seats (`--max-concurrent`).
    pub limit: u64,
    /// Always 0.0, seconds.
    pub loop_lag_s: f64,
    /// Always 0.0, seconds.
    pub sizing_delay_s: f64,
    /// `0.25 · slo.ttft_s`, seconds.
    pub saturation_threshold_s: f64,
    /// As the top-level `rejected`.
    pub rejected: u64,
    /// As the top-level `refused`.
    pub refused: u64,
    /// `bearer` with an engine API key, else `boundary`.
    pub engine_auth: String,
    /// `serving.admission`: `open` or `predictive`.
    pub mode: String,
    /// `serving.admission_margin`.
    pub margin: f64,
}

/// `outcome_reasons`: per terminal, every known reason (at 0 until seen) in its documented
/// order, then `unclassified` or extra reasons once seen.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct OutcomeReasons {
    /// Failed requests by reason.
    pub failed: Ordered<u64>,
    /// Rejected requests by reason.
    pub rejected: Ordered<u64>,
    /// Expired requests by reason.
    pub expired: Ordered<u64>,
    /// Refused requests by reason.
    pub refused: Ordered<u64>,
}

/// `serving`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Serving {
    /// Requests retained (seated or queued).
    pub http_retained: u64,
    /// `max_concurrent + queue_capacity`.
    pub http_retained_limit: u64,
    /// Most requests ever retained at once.
    pub http_retained_high_water: u64,
    /// Prefill legs dispatched.
    pub prefill_attempts: u64,
    /// Decode legs dispatched.
    pub decode_attempts: u64,
    /// Retries dispatched.
    pub retry_attempts: u64,
    /// Retry budget credits left.
    pub retry_credits: f64,
    /// Credits spent on retries.
    pub retry_credits_spent: u64,
    /// Retries the budget denied.
    pub retry_denied: u64,
    /// Requests served after a retry.
    pub served_after_retry: u64,
    /// Failed attempts by phase and reason, sorted.
    pub attempt_failures: Vec<AttemptFailure>,
    /// Decode tokens the engines reported, tokens.
    pub decode_tokens_observed: u64,
    /// Seconds spent upstream per phase.
    pub upstream_seconds: UpstreamSeconds,
}

/// One of `serving.attempt_failures`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct AttemptFailure {
    /// `prefill` or `decode`.
    pub phase: String,
    /// The failure reason (`engine_timeout`, ...).
    pub reason: String,
    /// Attempts that failed so.
    pub count: u64,
}

/// `serving.upstream_seconds`: seconds spent in upstream legs.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct UpstreamSeconds {
    /// Prefill legs, seconds.
    pub prefill: f64,
    /// Decode legs, seconds.
    pub decode: f64,
}

/// `pools`: engines by current router role (the controller moves engines), sorted, live or
/// not.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Pools {
    /// Prefill engines.
    pub prefill: Vec<String>,
    /// Decode engines.
    pub decode: Vec<String>,
}

impl Pools {
    /// `prefill` or `decode`: the role of `iid`, if it is in a pool.
    pub fn role_of(&self, iid: &str) -> Option<&'static str> {
        if self.prefill.iter().any(|i| i == iid) {
            Some("prefill")
        } else if self.decode.iter().any(|i| i == iid) {
            Some("decode")
        } else {
            None
        }
    }
}

/// `slo`: the configured SLO, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Slo {
    /// Time to first token, seconds.
    pub ttft_s: f64,
    /// Time per output token, seconds.
    pub tpot_s: f64,
}

/// `holds`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Holds {
    /// Always empty (no timed holds in this version).
    pub timed: Vec<Value>,
    /// Suspect engines with the producers recorded for them, config order.
    pub inference: Vec<InferenceHold>,
}

/// One of `holds.inference`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct InferenceHold {
    /// The suspect engine.
    pub iid: String,
    /// Producers whose KV fed its failing decodes (`""` = a local probe).
    pub recorded_producers: Vec<String>,
}

/// `breaker` (behaviour.md 6.2–6.4). `verifying`, `hold_starts`, `hold_ends` and `probes` are
/// always empty in this version.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Breaker {
    /// Failure streaks per engine, sorted by id.
    pub failures: BTreeMap<String, Streaks>,
    /// Always empty.
    pub verifying: Vec<Value>,
    /// Ejections by engine and cause.
    pub ejections: Vec<Ejection>,
    /// Always empty.
    pub hold_starts: Vec<Value>,
    /// Always empty.
    pub hold_ends: Vec<Value>,
    /// Always empty.
    pub probes: Vec<Value>,
    /// Readmissions by engine and evidence.
    pub readmissions: Vec<Readmission>,
}

/// One engine's consecutive failures per class (behaviour.md 6.2), in the breaker's class
/// order, then `liveness`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Streaks {
    /// Connection failures in a row.
    pub connection: u64,
    /// Timeouts in a row.
    pub timeout: u64,
    /// Always 0 (busy answers are not counted).
    pub overload: u64,
    /// Inference status failures in a row.
    pub inference_status: u64,
    /// KV handoff failures in a row.
    pub kv_handoff: u64,
    /// Stream failures in a row.
    pub stream: u64,
    /// The engine refused the router itself (401, 403, 404, 405: its key or its routes), in a
    /// row (behaviour.md 6.2).
    pub engine_config: u64,
    /// Consecutive liveness probes that timed out.
    pub liveness: u64,
}

/// One of `breaker.ejections`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Ejection {
    /// The engine.
    pub iid: String,
    /// Why (`health_probe`, `process_identity`, a failure class, ...).
    pub cause: String,
    /// Ejections so.
    pub count: u64,
}

/// One of `breaker.readmissions`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Readmission {
    /// The engine.
    pub iid: String,
    /// `generation` or `lifecycle`.
    pub evidence: String,
    /// Readmissions so.
    pub count: u64,
}

impl State {
    /// Whether this is a state document (its `schema` is [`STATE_SCHEMA`]).
    pub fn is_state(&self) -> bool {
        self.schema == STATE_SCHEMA
    }
}
