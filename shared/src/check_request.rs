//! The completion requests the control plane itself sends to an engine: the agent's generation
//! and KV-transfer checks (readmission checks 4 and 5, behaviour.md 6.5) and the router's
//! generation probe (behaviour.md 6.3). Client traffic is relayed as the client wrote it and
//! never goes through this type.
//!
//! ```text
//!  {"model", "prompt", "max_tokens", "temperature": 0.0, "stream",
//!   ["stream_options": {"include_usage": true}],
//!   ["kv_transfer_params": {...}]                         vLLM NIXL (prefill request, or the
//!                                                          descriptor on the decode leg)
//!   ["bootstrap_host", ["bootstrap_port"], "bootstrap_room"]   SGLang's rendezvous
//!   ["rid"]}                                              SGLang's request id
//! ```

use serde::Serialize;
use serde_json::Value;

/// One `POST /v1/completions` body of a check or probe. Optional members are written only
/// when set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckCompletion {
    /// The served model (or adapter) name.
    pub model: String,
    /// The prompt.
    pub prompt: String,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Always 0.0: a check is deterministic.
    pub temperature: f64,
    /// Streamed (`true`) or one JSON answer.
    pub stream: bool,
    /// `{"include_usage": true}` on a streamed leg that counts its tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// vLLM's KV-transfer parameters: [`KvTransferRequest`] on a prefill, the prefill's
    /// descriptor (opaque, as the engine wrote it) on the decode leg.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<Value>,
    /// SGLang's rendezvous, flattened into the body.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<Bootstrap>,
    /// SGLang's request id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rid: Option<String>,
}

/// `stream_options` of a streamed check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StreamOptions {
    /// Ask for the final usage chunk.
    pub include_usage: bool,
}

/// SGLang's bootstrap rendezvous members of a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Bootstrap {
    /// The prefill engine's bootstrap host.
    pub bootstrap_host: String,
    /// Its bootstrap port (`None` where a fake host makes the server run the request alone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u64>,
    /// The room both legs name.
    pub bootstrap_room: u64,
}

/// vLLM's `kv_transfer_params` of a prefill request that will hand its KV to a decode engine
/// (vLLM's NIXL connector: `do_remote_decode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvTransferRequest {
    /// The KV is read by a remote decode engine.
    pub do_remote_decode: bool,
    /// This request reads KV from a remote prefill (false on a prefill).
    pub do_remote_prefill: bool,
}

impl CheckCompletion {
    /// A deterministic completion of `max_tokens` tokens of `prompt` on `model`, one JSON
    /// answer (no stream).
    pub fn new(model: &str, prompt: impl Into<String>, max_tokens: u32) -> Self {
        CheckCompletion {
            model: model.to_string(),
            prompt: prompt.into(),
            max_tokens,
            temperature: 0.0,
            stream: false,
            stream_options: None,
            kv_transfer_params: None,
            bootstrap: None,
            rid: None,
        }
    }

    /// The same request, streamed; `usage` also asks for the final usage chunk.
    #[must_use]
    pub fn streamed(mut self, usage: bool) -> Self {
        self.stream = true;
        self.stream_options = usage.then_some(StreamOptions {
            include_usage: true,
        });
        self
    }
}

impl KvTransferRequest {
    /// A prefill whose KV a decode engine reads.
    pub const PREFILL: KvTransferRequest = KvTransferRequest {
        do_remote_decode: true,
        do_remote_prefill: false,
    };

    /// As the JSON value of `kv_transfer_params`.
    pub fn to_value(self) -> Value {
        // Two booleans always serialise.
        serde_json::to_value(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optional_members_are_written_only_when_set() {
        let plain = CheckCompletion::new("m", "p", 1);
        assert_eq!(
            serde_json::to_string(&plain).unwrap(),
            r#"{"model":"m","prompt":"p","max_tokens":1,"temperature":0.0,"stream":false}"#
        );
        let mut sg = CheckCompletion::new("m", "p", 2).streamed(true);
        sg.bootstrap = Some(Bootstrap {
            bootstrap_host: "h".into(),
            bootstrap_port: None,
            bootstrap_room: 0,
        });
        sg.rid = Some("r".into());
        assert_eq!(
            serde_json::to_string(&sg).unwrap(),
            r#"{"model":"m","prompt":"p","max_tokens":2,"temperature":0.0,"stream":true,"stream_options":{"include_usage":true},"bootstrap_host":"h","bootstrap_room":0,"rid":"r"}"#
        );
        let mut v = CheckCompletion::new("m", "p", 1);
        v.kv_transfer_params = Some(KvTransferRequest::PREFILL.to_value());
        assert_eq!(
            serde_json::to_value(&v).unwrap()["kv_transfer_params"],
            serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false})
        );
    }
}
