//! A prefill's KV handle as an engine writes it (vLLM's `kv_transfer_params` descriptor, or
//! SGLang's bootstrap rendezvous), typed for the tests that read its members: the simulator's
//! wire tests and the agent's KV checks.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A KV handle: vLLM's NIXL descriptor (`do_remote_prefill`, `remote_engine_id`,
/// `remote_block_ids`, `remote_host`, `remote_port`, ...) or SGLang's rendezvous
/// (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`). Every member is optional; the ones
/// not named here are kept in `rest`, so a handle read, changed and written again is the
/// engine's document with that one change.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvHandle {
    /// vLLM: the decode reads its KV from a remote prefill.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub do_remote_prefill: Option<bool>,
    /// vLLM: a remote decode reads this request's KV.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub do_remote_decode: Option<bool>,
    /// vLLM: the producer's engine id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// vLLM: the producer's block ids holding the prompt's KV.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<Vec<u64>>,
    /// vLLM: the producer's KV side-channel host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    /// vLLM: the producer's KV side-channel port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    /// vLLM: the producer's tensor-parallel size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u64>,
    /// SGLang: the prefill's bootstrap port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u64>,
    /// Any other member, as the engine wrote it.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl KvHandle {
    /// `v` read as a KV handle.
    ///
    /// # Panics
    /// When `v` is not an object of this shape.
    pub fn of(v: &Value) -> KvHandle {
        serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("not a KV handle ({e}): {v}"))
    }
}
