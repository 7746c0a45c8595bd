//! Signed agent answers and their verification (architecture.md section 4).
//!
//! ```text
//!  agent:  payload struct ──serde──► Value ──SigningKey::sign──► SignedDocument ──HTTPS──►
//!  router: SignedDocument ──Verifier::verify::<P>(doc, &Expected, now_wall)──► P  |  VerifyError
//! ```
//!
//! Every payload starts with the same [`Header`] (`schema`, `schema_version`, `agent_id`, `iid`,
//! `nonce`, `epoch`, `holder`, `issued_at`, `process`), flattened into the payload object. The
//! verifier checks, in this order, and stops at the first failure: the key id and signature
//! against the pinned key, the payload shape, `schema` and `schema_version`, `agent_id`,
//! `nonce` (and that it was not accepted before), `epoch`, `holder`, `iid`, freshness of
//! `issued_at` within `max_skew_s`, and optionally that `process` is the expected process
//! (`(boot_id, pid, start_ticks)`).

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::canonical::canonical_json;
use crate::identity::ProcessIdentity;
use crate::signing::{PublicKey, SignedDocument};

/// Version of every agent payload schema below.
pub const SCHEMA_VERSION: u32 = 1;
/// `schema` of an attestation payload.
pub const SCHEMA_ATTESTATION: &str = "narwhal.agent-attestation";
/// `schema` of a direct-generation check result.
pub const SCHEMA_GENERATION: &str = "narwhal.agent-generation-check";
/// `schema` of the producer half of a KV-transfer check.
pub const SCHEMA_KV_PRODUCE: &str = "narwhal.agent-kv-produce";
/// `schema` of the consumer half of a KV-transfer check.
pub const SCHEMA_KV_CONSUME: &str = "narwhal.agent-kv-consume";
/// `schema` of a local probe result.
pub const SCHEMA_PROBE: &str = "narwhal.agent-probe";

/// Fields every signed payload carries (flattened into the payload object).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// One of the `SCHEMA_*` constants.
    pub schema: String,
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The agent's configured id (e.g. `gpu-a`).
    pub agent_id: String,
    /// The engine instance id from the fleet config (e.g. `e0`).
    pub iid: String,
    /// The router's nonce, echoed.
    pub nonce: String,
    /// The router's lease epoch, echoed.
    pub epoch: u64,
    /// The router's lease holder name, echoed.
    pub holder: String,
    /// When the agent signed, wall seconds since the Unix epoch.
    pub issued_at: f64,
    /// The engine process this answer speaks for, read just before signing.
    pub process: ProcessIdentity,
}

/// Access to the common header, so one verifier serves every payload type.
pub trait SignedPayload: DeserializeOwned {
    /// The `schema` value this payload type must carry.
    const SCHEMA: &'static str;
    /// The common header.
    fn header(&self) -> &Header;
}

/// What the engine itself reported, for attestations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineFacts {
    /// Engine kind: `vllm` or `sglang`.
    pub dialect: String,
    /// Engine version string (vLLM `/version`, SGLang `/server_info` `version`).
    pub version: String,
    /// Served model ids (`/v1/models` `data[].id`).
    pub models: Vec<String>,
    /// SGLang's `disaggregation_bootstrap_port` when the engine publishes one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

/// Schema `narwhal.agent-attestation`: header + engine facts + host contract.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttestationPayload {
    /// Common fields.
    #[serde(flatten)]
    pub header: Header,
    /// Version and served models, read from the engine for this answer.
    pub engine: EngineFacts,
    /// Engine contract fields (behaviour.md 5.6) from the host contract document, or `null`
    /// when the engine has no contract document configured.
    pub contract: Option<Map<String, Value>>,
    /// Canonical digest of `{"contract", "launch"}` from the contract document, or `null`.
    pub launch_digest: Option<String>,
}

/// Outcome of one engine request leg made by the agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LegResult {
    /// True when the leg produced what it must (≥ 1 token, or a KV descriptor/rendezvous).
    pub ok: bool,
    /// Tokens generated (completion tokens, or token-bearing SSE chunks for streams).
    pub tokens: u64,
    /// Wall time of the leg, seconds.
    pub latency_s: f64,
    /// Why the leg failed (`null` when `ok`).
    pub error: Option<String>,
}

/// Schema `narwhal.agent-generation-check`: one non-streaming completion on the engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationPayload {
    /// Common fields.
    #[serde(flatten)]
    pub header: Header,
    /// Model asked for.
    pub model: String,
    /// The completion leg.
    pub result: LegResult,
}

/// Schema `narwhal.agent-kv-produce`: the producer half of a KV-transfer check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvProducePayload {
    /// Common fields.
    #[serde(flatten)]
    pub header: Header,
    /// Model asked for.
    pub model: String,
    /// The router's check id, echoed.
    pub check_id: String,
    /// The prefill leg (for SGLang: starting the rendezvous).
    pub result: LegResult,
    /// What the consumer needs: the vLLM NIXL `kv_transfer_params` descriptor, or the SGLang
    /// rendezvous `{"bootstrap_host","bootstrap_port","bootstrap_room"}`; `null` on failure.
    pub kv: Option<Value>,
}

/// Evidence that a consumer really received KV rather than recomputing the prompt, read by the
/// agent from the consuming engine's own surfaces (its Prometheus `/metrics` and, for SGLang,
/// `/server_info`) around the decode leg (docs/agent.md, "Transfer evidence").
///
/// Wire compatibility. `verdict`, `failed_delta` and `detail` were added without a `schema_version`
/// bump: each is optional with a default, and a router built before them ignores them (payloads are
/// not `deny_unknown_fields`; the signature covers the payload as sent). The legacy `transferred`
/// keeps its meaning — `true` only for `confirmed`, `false` for `refuted`, `null` when only the
/// decode outcome is known — so an older router stays as strict as it was (it refuses `inferred`),
/// never laxer. A router reads the verdict through [`TransferEvidence::judged`], which also derives
/// one from an older agent's `transferred`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferEvidence {
    /// Where the counters came from: `vllm_nixl_metrics` (vLLM's `/metrics`, NIXL connector
    /// families), `sglang_disaggregation_metrics` (SGLang's `/metrics`), or `none` (the engine
    /// published none, or no transfer was attempted). Agents older than the three-valued
    /// verdict, which read a test double's own statistics route, also sent `sim_stats`.
    pub source: String,
    /// Increase of the consumer's completed-transfer counter across the decode leg (`null`
    /// when the engine publishes none).
    pub consumed_delta: Option<i64>,
    /// Prompt tokens the consumer computed itself during the decode: the increase of vLLM's
    /// `vllm:prompt_tokens_by_source_total{source="local_compute"}` (1 for a prompt received
    /// whole over the connector, the prompt for a recompute; docs/agent.md). `null` when the
    /// engine publishes no such family (SGLang, older vLLM) or from older agents.
    pub recomputed_delta: Option<i64>,
    /// Legacy: how the consuming engine recorded this very request, from the simulator's
    /// per-request records; `null` from agents with the three-valued verdict (real engines
    /// publish no such record).
    #[serde(default)]
    pub engine_phase: Option<String>,
    /// Legacy two-valued form of `verdict`: `true` = confirmed, `false` = refuted, `null` =
    /// inferred (or no transfer attempted).
    pub transferred: Option<bool>,
    /// The three-valued verdict (`confirmed`, `inferred`, `refuted`); `null` when no transfer
    /// was attempted (a standalone probe) or from an agent older than the verdict.
    #[serde(default)]
    pub verdict: Option<crate::agent_protocol::TransferVerdict>,
    /// Increase of the consumer's failed-transfer counters across the decode leg (`null` when
    /// the engine publishes none).
    #[serde(default)]
    pub failed_delta: Option<i64>,
    /// Why the verdict is what it is, naming the counter that moved or what was missing.
    #[serde(default)]
    pub detail: Option<String>,
}

impl TransferEvidence {
    /// The verdict to act on for a transfer whose decode leg was `leg`: `verdict` when the
    /// agent sent one; from an agent older than the verdict, derived from `transferred` (`true` →
    /// confirmed, `false` → refuted, `null` → inferred when `leg` succeeded with at least one
    /// token, else refuted).
    pub fn judged(&self, leg: &LegResult) -> crate::agent_protocol::TransferVerdict {
        use crate::agent_protocol::TransferVerdict as V;
        if let Some(v) = self.verdict {
            return v;
        }
        match self.transferred {
            Some(true) => V::Confirmed,
            Some(false) => V::Refuted,
            None if leg.ok && leg.tokens > 0 => V::Inferred,
            None => V::Refuted,
        }
    }
}

/// Schema `narwhal.agent-kv-consume`: the consumer half of a KV-transfer check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvConsumePayload {
    /// Common fields.
    #[serde(flatten)]
    pub header: Header,
    /// Model asked for.
    pub model: String,
    /// The router's check id, echoed.
    pub check_id: String,
    /// The decode leg; `tokens` = tokens decoded after the transfer (the engine's streamed
    /// `usage.completion_tokens`, else token-bearing chunks).
    pub result: LegResult,
    /// Transfer evidence read from the consuming engine.
    pub transfer: TransferEvidence,
}

/// Schema `narwhal.agent-probe`: a local probe of a suspect engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbePayload {
    /// Common fields.
    #[serde(flatten)]
    pub header: Header,
    /// Model asked for.
    pub model: String,
    /// `standalone` (both legs on the suspect) or `from_producer` (KV handed in).
    pub mode: String,
    /// Producer leg when `standalone`, else `null`.
    pub produce: Option<LegResult>,
    /// Consumer leg on the suspect.
    pub consume: LegResult,
    /// Transfer evidence from the suspect.
    pub transfer: TransferEvidence,
    /// Overall verdict: both legs ok and the transfer (when one was attempted) not `refuted`.
    pub ok: bool,
}

macro_rules! signed_payload {
    ($t:ty, $schema:expr) => {
        impl SignedPayload for $t {
            const SCHEMA: &'static str = $schema;
            fn header(&self) -> &Header {
                &self.header
            }
        }
    };
}
signed_payload!(AttestationPayload, SCHEMA_ATTESTATION);
signed_payload!(GenerationPayload, SCHEMA_GENERATION);
signed_payload!(KvProducePayload, SCHEMA_KV_PRODUCE);
signed_payload!(KvConsumePayload, SCHEMA_KV_CONSUME);
signed_payload!(ProbePayload, SCHEMA_PROBE);

/// Every way a signed answer can be refused; each names the field and the values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VerifyError {
    /// `key_id` is not the pinned key's id: signed by a different key.
    #[error("key_id {found:?} is not the pinned agent key {expected:?}")]
    WrongKey {
        /// Pinned key id.
        expected: String,
        /// Document's key id.
        found: String,
    },
    /// The signature does not verify over the canonical payload (tampered payload or
    /// corrupted signature).
    #[error("signature does not verify over the payload (payload altered or signature corrupt)")]
    BadSignature,
    /// The payload does not match the schema of the expected document type.
    #[error("payload field {path}: {message}")]
    Malformed {
        /// Dotted path of the offending field.
        path: String,
        /// serde's message.
        message: String,
    },
    /// `schema` differs.
    #[error("schema is {found:?}, expected {expected:?}")]
    WrongSchema {
        /// Expected schema.
        expected: String,
        /// Found schema.
        found: String,
    },
    /// `schema_version` differs.
    #[error("schema_version is {found}, expected {expected}")]
    SchemaVersion {
        /// Expected version.
        expected: u32,
        /// Found version.
        found: u32,
    },
    /// `agent_id` differs from the agent the router asked.
    #[error("agent_id is {found:?}, expected {expected:?}")]
    AgentMismatch {
        /// Expected agent id.
        expected: String,
        /// Found agent id.
        found: String,
    },
    /// `nonce` is not the one this request sent.
    #[error("nonce is {found:?}, expected {expected:?}")]
    NonceMismatch {
        /// Nonce sent.
        expected: String,
        /// Nonce in the answer.
        found: String,
    },
    /// This nonce was already accepted once: a replayed answer.
    #[error("nonce {nonce:?} was already accepted (replayed answer)")]
    NonceReplayed {
        /// The replayed nonce.
        nonce: String,
    },
    /// `epoch` is not the router's current epoch.
    #[error("epoch is {found}, expected {expected}")]
    EpochMismatch {
        /// Router's epoch.
        expected: u64,
        /// Answer's epoch.
        found: u64,
    },
    /// `holder` is not the router's holder name.
    #[error("holder is {found:?}, expected {expected:?}")]
    HolderMismatch {
        /// Router's holder name.
        expected: String,
        /// Answer's holder.
        found: String,
    },
    /// `iid` is not the engine asked about.
    #[error("iid is {found:?}, expected {expected:?}")]
    IidMismatch {
        /// Engine asked about.
        expected: String,
        /// Engine in the answer.
        found: String,
    },
    /// `issued_at` is older than `now - max_skew_s`.
    #[error("issued_at {issued_at} is stale: now {now}, max_skew_s {max_skew_s}")]
    Stale {
        /// Answer's `issued_at`, wall seconds.
        issued_at: f64,
        /// Verifier's wall clock, seconds.
        now: f64,
        /// Allowed skew, seconds.
        max_skew_s: f64,
    },
    /// `issued_at` is later than `now + max_skew_s`.
    #[error("issued_at {issued_at} is in the future: now {now}, max_skew_s {max_skew_s}")]
    FromFuture {
        /// Answer's `issued_at`, wall seconds.
        issued_at: f64,
        /// Verifier's wall clock, seconds.
        now: f64,
        /// Allowed skew, seconds.
        max_skew_s: f64,
    },
    /// The answer speaks for a different process than expected (restart or pid reuse).
    #[error(
        "process changed: expected pid {expected_pid} start_ticks {expected_start_ticks}, \
         found pid {found_pid} start_ticks {found_start_ticks} (boot {found_boot_id})"
    )]
    ProcessChanged {
        /// Expected pid.
        expected_pid: u32,
        /// Expected start ticks.
        expected_start_ticks: u64,
        /// Found pid.
        found_pid: u32,
        /// Found start ticks.
        found_start_ticks: u64,
        /// Found boot id.
        found_boot_id: String,
    },
    /// A contract field differs from the fleet's declared contract (behaviour.md 5.5 rule 7).
    #[error("contract.{field} is {observed}, expected {expected}")]
    ContractMismatch {
        /// Contract field name.
        field: String,
        /// Attested value (JSON).
        observed: String,
        /// Declared value (JSON).
        expected: String,
    },
}

/// What the router expects of one answer.
#[derive(Debug, Clone)]
pub struct Expected<'a> {
    /// The agent asked (checked when `Some`).
    pub agent_id: Option<&'a str>,
    /// The engine asked about.
    pub iid: &'a str,
    /// The nonce sent.
    pub nonce: &'a str,
    /// The router's epoch.
    pub epoch: u64,
    /// The router's holder name.
    pub holder: &'a str,
    /// The process the router bound the engine to, when it has one.
    pub process: Option<&'a ProcessIdentity>,
}

/// Verifies signed answers of one agent against its pinned public key.
///
/// Keeps a bounded ledger of accepted nonces (most recent [`Verifier::LEDGER_CAPACITY`]) so a
/// replayed answer is refused with [`VerifyError::NonceReplayed`].
#[derive(Debug)]
pub struct Verifier {
    key: PublicKey,
    max_skew_s: f64,
    ledger: Mutex<Ledger>,
}

#[derive(Debug, Default)]
struct Ledger {
    seen: HashSet<String>,
    order: VecDeque<String>,
}

impl Verifier {
    /// How many accepted nonces are remembered.
    pub const LEDGER_CAPACITY: usize = 4096;

    /// A verifier for the agent whose key is `key`, accepting `issued_at` within `max_skew_s`
    /// seconds of the verifier's wall clock (fleet `agent.max_skew_s`).
    pub fn new(key: PublicKey, max_skew_s: f64) -> Verifier {
        Verifier {
            key,
            max_skew_s,
            ledger: Mutex::new(Ledger::default()),
        }
    }

    /// The pinned key.
    pub fn key(&self) -> &PublicKey {
        &self.key
    }

    /// Verifies `doc` as a `P`, with `now_wall` = the verifier's wall clock in seconds.
    /// On success the nonce is recorded as used.
    ///
    /// # Errors
    /// The first failed rule, as a [`VerifyError`] (order in the module docs).
    pub fn verify<P: SignedPayload>(
        &self,
        doc: &SignedDocument,
        expected: &Expected<'_>,
        now_wall: f64,
    ) -> Result<P, VerifyError> {
        let pinned = self.key.key_id();
        if doc.key_id != pinned {
            return Err(VerifyError::WrongKey {
                expected: pinned,
                found: doc.key_id.clone(),
            });
        }
        if !self
            .key
            .verify_bytes(&canonical_json(&doc.payload), &doc.signature)
        {
            return Err(VerifyError::BadSignature);
        }
        // Check the schema name before the full shape, so a wrong document type says so.
        if let Some(found) = doc.payload.get("schema").and_then(Value::as_str)
            && found != P::SCHEMA
        {
            return Err(VerifyError::WrongSchema {
                expected: P::SCHEMA.to_string(),
                found: found.to_string(),
            });
        }
        let payload: P = serde_path_to_error::deserialize(doc.payload.clone()).map_err(|e| {
            // `#[serde(flatten)]` hides the path of header fields; ask the header alone.
            let e = match serde_path_to_error::deserialize::<_, Header>(doc.payload.clone()) {
                Err(h) => h,
                Ok(_) => e,
            };
            VerifyError::Malformed {
                path: e.path().to_string(),
                message: e.inner().to_string(),
            }
        })?;
        let h = payload.header();
        if h.schema != P::SCHEMA {
            return Err(VerifyError::WrongSchema {
                expected: P::SCHEMA.to_string(),
                found: h.schema.clone(),
            });
        }
        if h.schema_version != SCHEMA_VERSION {
            return Err(VerifyError::SchemaVersion {
                expected: SCHEMA_VERSION,
                found: h.schema_version,
            });
        }
        if let Some(agent) = expected.agent_id
            && h.agent_id != agent
        {
            return Err(VerifyError::AgentMismatch {
                expected: agent.to_string(),
                found: h.agent_id.clone(),
            });
        }
        if h.nonce != expected.nonce {
            return Err(VerifyError::NonceMismatch {
                expected: expected.nonce.to_string(),
                found: h.nonce.clone(),
            });
        }
        if self.seen(&h.nonce) {
            return Err(VerifyError::NonceReplayed {
                nonce: h.nonce.clone(),
            });
        }
        if h.epoch != expected.epoch {
            return Err(VerifyError::EpochMismatch {
                expected: expected.epoch,
                found: h.epoch,
            });
        }
        if h.holder != expected.holder {
            return Err(VerifyError::HolderMismatch {
                expected: expected.holder.to_string(),
                found: h.holder.clone(),
            });
        }
        if h.iid != expected.iid {
            return Err(VerifyError::IidMismatch {
                expected: expected.iid.to_string(),
                found: h.iid.clone(),
            });
        }
        if !h.issued_at.is_finite() || h.issued_at < now_wall - self.max_skew_s {
            return Err(VerifyError::Stale {
                issued_at: h.issued_at,
                now: now_wall,
                max_skew_s: self.max_skew_s,
            });
        }
        if h.issued_at > now_wall + self.max_skew_s {
            return Err(VerifyError::FromFuture {
                issued_at: h.issued_at,
                now: now_wall,
                max_skew_s: self.max_skew_s,
            });
        }
        if let Some(want) = expected.process
            && !want.same_process(&h.process)
        {
            return Err(VerifyError::ProcessChanged {
                expected_pid: want.pid,
                expected_start_ticks: want.start_ticks,
                found_pid: h.process.pid,
                found_start_ticks: h.process.start_ticks,
                found_boot_id: h.process.boot_id.clone(),
            });
        }
        self.remember(&h.nonce);
        Ok(payload)
    }

    fn seen(&self, nonce: &str) -> bool {
        match self.ledger.lock() {
            Ok(l) => l.seen.contains(nonce),
            Err(p) => p.into_inner().seen.contains(nonce),
        }
    }

    fn remember(&self, nonce: &str) {
        let mut l = match self.ledger.lock() {
            Ok(l) => l,
            Err(p) => p.into_inner(),
        };
        if l.seen.insert(nonce.to_string()) {
            l.order.push_back(nonce.to_string());
            while l.order.len() > Self::LEDGER_CAPACITY {
                if let Some(old) = l.order.pop_front() {
                    l.seen.remove(&old);
                }
            }
        }
    }
}

/// Compares an attested contract with the fleet's declared contract, field by field
/// (behaviour.md 5.5 rule 7): every declared field must be present and equal.
///
/// # Errors
/// [`VerifyError::ContractMismatch`] for the first differing field (declared order).
pub fn check_contract(
    attested: Option<&Map<String, Value>>,
    declared: &Map<String, Value>,
) -> Result<(), VerifyError> {
    for (field, want) in declared {
        let got = attested.and_then(|c| c.get(field)).unwrap_or(&Value::Null);
        if got != want {
            return Err(VerifyError::ContractMismatch {
                field: field.clone(),
                observed: got.to_string(),
                expected: want.to_string(),
            });
        }
    }
    Ok(())
}

/// Checks an attestation's contract for the router: the host contract document's
/// `engine_version` (when it has one) must be the version the live engine reported
/// (behaviour.md 5.7: the reference sidecar refuses to run otherwise), then every declared
/// field must match ([`check_contract`]).
///
/// # Errors
/// [`VerifyError::ContractMismatch`] naming the first differing field.
pub fn check_attestation_contract(
    payload: &AttestationPayload,
    declared: &Map<String, Value>,
) -> Result<(), VerifyError> {
    if let Some(v) = payload
        .contract
        .as_ref()
        .and_then(|c| c.get("engine_version"))
        && v.as_str() != Some(payload.engine.version.as_str())
    {
        return Err(VerifyError::ContractMismatch {
            field: "engine_version".into(),
            observed: v.to_string(),
            expected: Value::String(payload.engine.version.clone()).to_string(),
        });
    }
    check_contract(payload.contract.as_ref(), declared)
}

/// A fresh random nonce: 32 lowercase hex digits (128 bits from the system random source).
pub fn new_nonce() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

#[cfg(test)]
mod tests;
