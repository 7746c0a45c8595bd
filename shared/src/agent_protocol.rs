//! Request and answer bodies of the agent HTTP API (architecture.md section 4 table).
//!
//! ```text
//!  GET  /v1/engines                          ──► EnginesAnswer
//!  GET  /v1/engines/{iid}/process            ──► ProcessIdentity
//!  GET  /v1/engines/{iid}/kv/snapshot        ──► KvSnapshot (404 when the engine's KV events
//!                                                are not followed, 409 before a batch came)
//!  POST /v1/engines/{iid}/attestation        FencedRequest       ──► SignedDocument(AttestationPayload)
//!  POST /v1/engines/{iid}/checks/generation  ModelRequest        ──► SignedDocument(GenerationPayload)
//!  POST /v1/engines/{iid}/checks/kv/produce  KvProduceRequest    ──► SignedDocument(KvProducePayload)
//!  POST /v1/engines/{iid}/checks/kv/consume  KvConsumeRequest    ──► SignedDocument(KvConsumePayload)
//!  POST /v1/engines/{iid}/probe              ProbeRequest        ──► SignedDocument(ProbePayload)
//!  GET  /health                              ──► {"status":"ok","agent_id":…}
//!  GET  /metrics                             ──► Prometheus text
//!  any error                                 ──► ErrorBody, e.g. 409 {"error":{"code":"stale_epoch",…}},
//!                                                403 {"error":{"code":"forbidden","rule":…}}
//! ```

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::identity::ProcessIdentity;

/// Body of `POST …/attestation`: `{"nonce", "epoch", "holder"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FencedRequest {
    /// Router-chosen nonce, echoed in the signed answer.
    pub nonce: String,
    /// Router lease epoch; lower than the highest the agent accepted → 409 `stale_epoch`.
    pub epoch: u64,
    /// Router lease holder name.
    pub holder: String,
}

/// Body of `POST …/checks/generation`: `{"nonce", "epoch", "holder", "model"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRequest {
    /// Router-chosen nonce.
    pub nonce: String,
    /// Router lease epoch.
    pub epoch: u64,
    /// Router lease holder name.
    pub holder: String,
    /// Model id to generate with.
    pub model: String,
}

/// Body of `POST …/checks/kv/produce`: `{"nonce", "epoch", "holder", "model", "check_id"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvProduceRequest {
    /// Router-chosen nonce.
    pub nonce: String,
    /// Router lease epoch.
    pub epoch: u64,
    /// Router lease holder name.
    pub holder: String,
    /// Model id.
    pub model: String,
    /// Router-chosen id tying the two halves of one check together.
    pub check_id: String,
}

/// Body of `POST …/checks/kv/consume`: the produce body plus `kv`, the producer's handle
/// (the `kv` field of the verified [`crate::KvProducePayload`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvConsumeRequest {
    /// Router-chosen nonce.
    pub nonce: String,
    /// Router lease epoch.
    pub epoch: u64,
    /// Router lease holder name.
    pub holder: String,
    /// Model id.
    pub model: String,
    /// Same check id as the produce half.
    pub check_id: String,
    /// vLLM `kv_transfer_params` descriptor or SGLang rendezvous.
    pub kv: Value,
}

/// What the consuming engine's own surfaces say about one KV transfer (docs/agent.md),
/// carried as `transfer.verdict` in signed KV-consume and probe answers.
///
/// | Verdict | When the agent gives it |
/// |---|---|
/// | `confirmed` | the engine's completed-transfer counter rose across the decode leg and no failure counter did (vLLM: `vllm:nixl_xfer_time_seconds_count`; SGLang: `sglang:per_stage_req_latency_seconds_count{stage="decode_transferred"}`) |
/// | `inferred` | no counter moved or the engine publishes none, but the decode with the descriptor / rendezvous succeeded and produced tokens (vLLM fails such a request under its default `kv_load_failure_policy: "fail"`; SGLang aborts a failed transfer) |
/// | `refuted` | a failure counter rose (vLLM `vllm:nixl_num_failed_transfers_total`; SGLang `sglang:num_transfer_failed_reqs_total`, `sglang:num_bootstrap_failed_reqs_total`), the decode failed, or the consumer cannot receive KV (an SGLang server not in `decode` mode serves the prompt recomputed) |
///
/// A check passes on `confirmed` and `inferred` and fails on `refuted`
/// ([`TransferVerdict::accepted`]). Serialised lower-case; an unknown value from a newer agent
/// does not deserialise, so an older router refuses the answer as malformed rather than guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferVerdict {
    /// A counter of the consuming engine moved as this transfer should move it.
    Confirmed,
    /// No counter evidence either way; the decode with the handle succeeded with tokens.
    Inferred,
    /// A failure counter moved, the decode failed, or the consumer recomputed.
    Refuted,
}

impl TransferVerdict {
    /// Whether a check may pass on this verdict: `confirmed` and `inferred` yes, `refuted` no.
    pub fn accepted(self) -> bool {
        !matches!(self, TransferVerdict::Refuted)
    }

    /// `confirmed`, `inferred` or `refuted` (the wire spelling).
    pub fn as_str(self) -> &'static str {
        match self {
            TransferVerdict::Confirmed => "confirmed",
            TransferVerdict::Inferred => "inferred",
            TransferVerdict::Refuted => "refuted",
        }
    }
}

impl std::fmt::Display for TransferVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a probe's KV comes from when it is not produced on the suspect itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum ProbeProducer {
    /// Another engine served by the same agent produces: `{"iid": "e1"}`.
    Iid(String),
    /// A handle produced elsewhere (another agent's produce answer): `{"kv": {...}}`.
    Kv(Value),
}

/// Body of `POST …/probe`: `{"nonce","epoch","holder","model","producer"?,"check_id"?}`; without
/// `producer` both legs run on the suspect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    /// Router-chosen nonce.
    pub nonce: String,
    /// Router lease epoch.
    pub epoch: u64,
    /// Router lease holder name.
    pub holder: String,
    /// Model id.
    pub model: String,
    /// Named producer, or `null` for a standalone probe.
    #[serde(default)]
    pub producer: Option<ProbeProducer>,
    /// Check id the KV was produced under (required with `producer: {"kv": ...}`, since both
    /// legs must use the same prompt); default `probe-<nonce>`.
    #[serde(default)]
    pub check_id: Option<String>,
}

/// One engine in `GET /v1/engines`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineEntry {
    /// Engine instance id.
    pub iid: String,
    /// Loopback URL the agent uses.
    pub url: String,
    /// `vllm` or `sglang`.
    pub dialect: String,
    /// Current identity, or `null` when unreadable (see `error`).
    pub process: Option<ProcessIdentity>,
    /// Why the identity could not be read.
    pub error: Option<String>,
}

/// Answer of `GET /health`: `{"status": "ok", "agent_id", "public_key"}` (the public key as
/// `ed25519:<base64>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentHealth {
    /// Always `ok`.
    pub status: String,
    /// The agent's id.
    pub agent_id: String,
    /// Its attestation key.
    pub public_key: String,
}

/// The `--ready-file` document a started agent writes: `{"url", "pid", "agent_id",
/// "public_key"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentReadyFile {
    /// The agent's `https://` URL.
    pub url: String,
    /// Its process id.
    pub pid: u32,
    /// The agent's id.
    pub agent_id: String,
    /// Its attestation key.
    pub public_key: String,
}

/// What `narwhal-agent fence show` prints, and the agent's fence file: the highest epoch and
/// holder the agent accepted. A reader refuses any other member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FenceShown {
    /// The highest accepted router epoch.
    pub epoch: u64,
    /// The holder that epoch belongs to.
    pub holder: String,
}

/// Answer of `GET /v1/engines`: `{"agent_id", "engines": [EngineEntry…]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnginesAnswer {
    /// The agent's id.
    pub agent_id: String,
    /// Configured engines, in config order.
    pub engines: Vec<EngineEntry>,
}

/// Inner object of an error answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Machine-readable code: `stale_epoch`, `holder_conflict`, `unknown_engine`,
    /// `bad_request`, `forbidden`, `process_unavailable`, `engine_unavailable`, `internal`.
    pub code: String,
    /// Human-readable message naming the field and value.
    pub message: String,
    /// For `stale_epoch`/`holder_conflict`: the highest epoch the agent accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highest_epoch: Option<u64>,
    /// For `forbidden` (403): the access rule the caller's certificate identity failed
    /// (`router_identity_required`, `fleet_identity_required`; docs/security.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

/// Error answer: `{"error": {"code", "message", "highest_epoch"?, "rule"?}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// Answer of `GET /v1/engines/{iid}/kv/snapshot`: the engine's current KV block set as the agent
/// follows it from the engine's own events ([`crate::kv_blocks`]), for a router that joins
/// after the engine's replay buffer moved on (docs/design/kv-aware-placement.md, "Beyond the
/// replay buffer").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvSnapshot {
    /// The engine.
    pub iid: String,
    /// The engine process the blocks belong to (read when its stream started and again when
    /// the snapshot was taken: the agent answers 409 when they differ).
    pub process: ProcessIdentity,
    /// The sequence number of the next batch: the set holds what every batch below it stored
    /// and did not remove; the consumer follows the stream from there.
    pub next_seq: u64,
    /// Whether the set was built from the stream's first batch with no gap left unfilled.
    pub complete: bool,
    /// Blocks held.
    pub blocks: u64,
    /// The blocks as one `KVEventBatch` of `BlockStored` events (vLLM's msgpack encoding,
    /// `kv_events::encode_batch`), each block's parent before it, base64 (standard alphabet).
    pub batch: String,
}
