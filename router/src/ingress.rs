//! Ingress rules for the completion routes (behaviour.md 1.8 stages 3–6, 1.9).
//!
//! ```text
//!  body bytes (already bounded by serving.max_request_bytes) ──validate──► Validated
//!                                                               └────────► IngressError
//!  IngressError ──body()──► (status, {"error": {...}})   exactly as behaviour.md 1.9
//! ```
//!
//! Pure: no IO. The size limit is enforced by the driver while reading (Content-Length is not
//! trusted); everything else is checked here.

use http::StatusCode;
use narwhal_shared::documents::ErrorReply;
use serde_json::{Map, Value};

use crate::config::Backend;

/// Which completion route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

impl Endpoint {
    /// The request path, also used for both upstream legs.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// A request that passed ingress.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Validated {
    /// The client body with `model` set to the configured model.
    pub body: Map<String, Value>,
    /// Client wants SSE.
    pub stream: bool,
    /// Client set `return_token_ids: true`.
    pub return_token_ids: bool,
    /// Client set `stream_options.include_usage: true`.
    pub include_usage: bool,
    /// Estimated input tokens (token-id prompt length, else characters / chars_per_token, ≥ 1).
    pub input_len: u64,
    /// The prompt's tokens from the router's own tokenizer (`engine.tokenizer`), once
    /// predictive admission's sizing computed them, and the microseconds that took: the KV
    /// score reuses them and counts that time as its own.
    pub tokens: std::sync::OnceLock<(Vec<u32>, u64)>,
    /// Prompts in a completions batch (`prompt` a list of two or more strings or token-id
    /// lists); 1 for a single prompt. A batch is served as one request per prompt (see
    /// [`batch_prompts`]).
    pub prompt_count: usize,
    /// The field that asks for prompt logprobs, which only the engine that prefills the
    /// prompt can compute: `prompt_logprobs`, or `echo` with `logprobs` (completions) or
    /// `top_logprobs` (chat), which vLLM turns into prompt logprobs (its
    /// `to_sampling_params`). `None` when the request asks for none.
    pub prompt_logprobs: Option<&'static str>,
    /// The client's generation limit (`max_tokens`, else `max_completion_tokens`), tokens.
    pub max_tokens: Option<u64>,
    /// `n` or `best_of` when it asks for more than one sequence per prompt: an aggregated
    /// placement passes it to the engine, a split refuses it (`IngressError::SamplingWidth`,
    /// see `serve::attempt::shape_plan`). `None` for one sequence.
    pub sampling_width: Option<&'static str>,
    /// Choices per prompt in the answer: the client's `n` (≥ 1, default 1). A batch's prompt
    /// `k` answers choices `k × choices + i`, as vLLM numbers them.
    pub choices: u64,
}

/// Why ingress refused a request. Each maps to one status and error body (1.9).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum IngressError {
    /// Body over `serving.max_request_bytes` → 413 `request_too_large`.
    #[error("request body exceeds serving.max_request_bytes ({limit} bytes)")]
    TooLarge {
        /// The limit in bytes.
        limit: u64,
    },
    /// Not JSON → 400.
    #[error("the request body is not valid JSON")]
    InvalidJson,
    /// A field has the wrong shape → 400 with `param`.
    #[error("{message}")]
    Shape {
        /// Human message naming the field.
        message: String,
        /// The field (`null` for the body itself).
        param: Option<String>,
    },
    /// A field Narwhal sets itself → 400 with `param`.
    #[error("{field} is reserved for Narwhal")]
    Reserved {
        /// Dotted field name.
        field: String,
    },
    /// `model` names another model → 404 `model_not_found`.
    #[error("model '{asked}' is not served here; this router serves '{served}'")]
    ModelNotFound {
        /// The client's model.
        asked: String,
        /// The configured model.
        served: String,
    },
    /// A prompt batch over `serving.max_batch_prompts` → 400 naming `prompt`.
    #[error(
        "'prompt' holds {count} prompts; this router serves at most {limit} per request (serving.max_batch_prompts)"
    )]
    TooManyPrompts {
        /// Prompts in the batch.
        count: usize,
        /// `serving.max_batch_prompts`.
        limit: usize,
    },
    /// A request whose `field` cannot cross this split (SGLang: prompt logprobs are computed
    /// where the prompt is prefilled, and a decode server cannot run a request alone) → 400
    /// naming the field.
    #[error(
        "'{field}' asks for prompt logprobs, which cannot be served across this fleet's prefill/decode split; send the request without it"
    )]
    Unsplittable {
        /// `prompt_logprobs` or `echo`.
        field: &'static str,
    },
    /// `n` or `best_of` > 1 on a prefill/decode split → 400
    /// (router/testdata/reference-error-400-n.json); an aggregated placement serves it.
    #[error(
        "{field} > 1 cannot be served across a split: the prefill leg runs with max_tokens=1 and the two legs would disagree on sampling width"
    )]
    SamplingWidth {
        /// `n` or `best_of`.
        field: &'static str,
    },
}

impl IngressError {
    /// The error `type` of the body (behaviour.md 1.9): `request_too_large` for an
    /// oversized body, `invalid_request_error` for everything else.
    pub(crate) fn error_type(&self) -> &'static str {
        match self {
            IngressError::TooLarge { .. } => "request_too_large",
            _ => "invalid_request_error",
        }
    }

    /// HTTP status and JSON body (behaviour.md 1.9).
    pub(crate) fn response(&self) -> (StatusCode, ErrorReply) {
        let message = self.to_string();
        match self {
            IngressError::TooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorReply::new(message, self.error_type()),
            ),
            IngressError::InvalidJson => (
                StatusCode::BAD_REQUEST,
                ErrorReply::invalid_request(message, None),
            ),
            IngressError::Shape { param, .. } => (
                StatusCode::BAD_REQUEST,
                ErrorReply::invalid_request(message, param.as_deref()),
            ),
            IngressError::Reserved { field } => (
                StatusCode::BAD_REQUEST,
                ErrorReply::invalid_request(message, Some(field)),
            ),
            IngressError::Unsplittable { field } => (
                StatusCode::BAD_REQUEST,
                ErrorReply::invalid_request(message, Some(field)),
            ),
            IngressError::ModelNotFound { .. } => (
                StatusCode::NOT_FOUND,
                ErrorReply::new(message, "invalid_request_error").with_code("model_not_found"),
            ),
            IngressError::SamplingWidth { .. } => (
                StatusCode::BAD_REQUEST,
                ErrorReply::new(message, "invalid_request_error"),
            ),
            IngressError::TooManyPrompts { .. } => (
                StatusCode::BAD_REQUEST,
                ErrorReply::invalid_request(message, Some("prompt")),
            ),
        }
    }
}

/// `b[k]` unless absent or `null`.
fn present(b: &Map<String, Value>, k: &str) -> Option<Value> {
    b.get(k).filter(|v| !v.is_null()).cloned()
}

/// The types of the members every endpoint reads (`model`, `stream`, the counts, `prompt`,
/// `messages`, `stream_options`).
fn check_shapes(body: &Map<String, Value>) -> Result<(), IngressError> {
    if let Some(m) = present(body, "model")
        && !m.is_string()
    {
        return Err(shape("model", "a string"));
    }
    if let Some(s) = present(body, "stream")
        && !s.is_boolean()
    {
        return Err(shape("stream", "a boolean"));
    }
    for k in ["n", "best_of", "max_tokens", "max_completion_tokens"] {
        if let Some(x) = present(body, k)
            && !(x.is_i64() || x.is_u64())
        {
            return Err(shape(k, "an integer"));
        }
    }
    if let Some(p) = present(body, "prompt")
        && !(p.is_string() || p.is_array())
    {
        return Err(shape("prompt", "a string or an array"));
    }
    if let Some(m) = present(body, "messages")
        && !m.as_array().is_some_and(|a| a.iter().all(Value::is_object))
    {
        return Err(shape("messages", "an array of objects"));
    }
    if let Some(so) = present(body, "stream_options")
        && !so.is_object()
    {
        return Err(shape("stream_options", "an object"));
    }
    Ok(())
}

/// Fields Narwhal sets on the legs, at the top level or in `vllm_xargs`.
fn check_reserved(body: &Map<String, Value>) -> Result<(), IngressError> {
    for k in RESERVED_TOP {
        if body.contains_key(*k) {
            return Err(IngressError::Reserved {
                field: (*k).to_string(),
            });
        }
    }
    if let Some(x) = body.get("vllm_xargs") {
        match x {
            Value::Object(xm) => {
                for k in RESERVED_XARGS {
                    if xm.contains_key(*k) {
                        return Err(IngressError::Reserved {
                            field: format!("vllm_xargs.{k}"),
                        });
                    }
                }
            }
            Value::Null => {}
            _ => return Err(shape("vllm_xargs", "an object")),
        }
    }
    Ok(())
}

/// The endpoint's required input (`prompt` or `messages`).
fn check_input(endpoint: Endpoint, body: &Map<String, Value>) -> Result<(), IngressError> {
    // The OpenAI API requires the input; refusing here keeps a request without one from
    // reaching an engine (and counts it `invalid`, not `failed/engine_rejected`).
    let (required, what) = match endpoint {
        Endpoint::Completions => ("prompt", "a string or an array"),
        Endpoint::Chat => ("messages", "an array of objects"),
    };
    if present(body, required).is_none() {
        return Err(IngressError::Shape {
            message: format!("'{required}' is required ({what})"),
            param: Some(required.into()),
        });
    }
    Ok(())
}

/// What a non-streaming request may not ask for (`audio`, other `modalities`, tools of
/// another type).
fn check_non_streaming(body: &Map<String, Value>) -> Result<(), IngressError> {
    if present(body, "audio").is_some() {
        return Err(IngressError::Shape {
            message: "'audio' output is not supported for non-streaming requests".into(),
            param: Some("audio".into()),
        });
    }
    if let Some(m) = present(body, "modalities")
        && !m
            .as_array()
            .is_some_and(|a| a.len() == 1 && a[0].as_str() == Some("text"))
    {
        return Err(IngressError::Shape {
            message: "'modalities' must be [\"text\"] for non-streaming requests".into(),
            param: Some("modalities".into()),
        });
    }
    if let Some(t) = present(body, "tools") {
        let ok = t.as_array().is_some_and(|a| {
            a.iter()
                .all(|x| x.is_object() && x.get("type").and_then(Value::as_str) == Some("function"))
        });
        if !ok {
            return Err(shape("tools", "an array of objects of type 'function'"));
        }
    }
    Ok(())
}

/// The SGLang chat options our relay cannot serve.
fn check_sglang_chat(body: &Map<String, Value>) -> Result<(), IngressError> {
    for k in [
        "return_token_ids",
        "return_prompt_token_ids",
        "return_meta_info",
    ] {
        if body.get(k).is_some_and(truthy) {
            return Err(IngressError::Shape {
                message: format!("'{k}' is not supported on SGLang chat completions"),
                param: Some(k.to_string()),
            });
        }
    }
    Ok(())
}

fn shape(param: &str, what: &str) -> IngressError {
    IngressError::Shape {
        message: format!("'{param}' must be {what}"),
        param: Some(param.to_string()),
    }
}

/// Fields Narwhal sets on the legs; refused in both dialects (docs/http-api.md; behaviour.md 1.8).
const RESERVED_TOP: &[&str] = &[
    "kv_transfer_params",
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
];
const RESERVED_XARGS: &[&str] = &[
    "kv_transfer_params",
    "kv_cache_report_mode",
    "ec_transfer_params",
];

/// Validate one completion body.
///
/// # Errors
/// The first rule broken, in the reference's stage order: JSON, shapes, reserved fields,
/// non-streaming restrictions, model, sampling width.
pub(crate) fn validate(
    endpoint: Endpoint,
    bytes: &[u8],
    served: crate::config::Served<'_>,
    backend: Backend,
    chars_per_token: f64,
) -> Result<Validated, IngressError> {
    let v: Value = serde_json::from_slice(bytes).map_err(|_| IngressError::InvalidJson)?;
    let Value::Object(mut body) = v else {
        return Err(IngressError::Shape {
            message: "the request body must be a JSON object".into(),
            param: None,
        });
    };
    check_shapes(&body)?;
    check_reserved(&body)?;
    check_input(endpoint, &body)?;
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if !stream {
        check_non_streaming(&body)?;
    }
    if backend == Backend::Sglang && endpoint == Endpoint::Chat {
        check_sglang_chat(&body)?;
    }
    if let Some(Value::String(m)) = body.get("model")
        && !served.serves(m)
    {
        return Err(IngressError::ModelNotFound {
            asked: m.clone(),
            served: served.model.to_string(),
        });
    }
    let sampling_width = ["n", "best_of"]
        .into_iter()
        .find(|k| body.get(*k).and_then(Value::as_i64).is_some_and(|x| x > 1));
    let choices = body
        .get("n")
        .and_then(Value::as_u64)
        .filter(|n| *n >= 1)
        .unwrap_or(1);
    // An absent or null `model` is the base model; an adapter named stays named.
    if !body.get("model").is_some_and(Value::is_string) {
        body.insert("model".into(), Value::String(served.model.to_string()));
    }
    let return_token_ids = body
        .get("return_token_ids")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let include_usage = body
        .get("stream_options")
        .and_then(|s| s.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let input_len = size_input(&body, chars_per_token);
    let prompt_count = match endpoint {
        Endpoint::Completions => batch_of(&body).map_or(1, <[Value]>::len),
        Endpoint::Chat => 1,
    };
    let prompt_logprobs = asks_prompt_logprobs(endpoint, &body);
    let max_tokens = ["max_tokens", "max_completion_tokens"]
        .iter()
        .find_map(|k| body.get(*k).and_then(Value::as_u64));
    Ok(Validated {
        body,
        stream,
        return_token_ids,
        include_usage,
        input_len,
        tokens: std::sync::OnceLock::new(),
        prompt_count,
        prompt_logprobs,
        max_tokens,
        sampling_width,
        choices,
    })
}

/// The prompts of a completions batch: `prompt` a list of two or more entries, each a string
/// or a token-id list (a list of integers alone is one tokenized prompt).
fn batch_of(body: &Map<String, Value>) -> Option<&[Value]> {
    match body.get("prompt") {
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(|p| p.is_string() || p.is_array()) => {
            Some(a)
        }
        _ => None,
    }
}

/// The prompts of a batched request, in order (`None` for a single prompt). Each is served
/// as its own request (its own prefill, descriptor and decode) and answered as choice `k`
/// of one response (docs/http-api.md, request shapes the split cannot serve as one request).
pub(crate) fn batch_prompts(v: &Validated) -> Option<&[Value]> {
    if v.prompt_count > 1 {
        batch_of(&v.body)
    } else {
        None
    }
}

/// Refuses a batch over `limit` prompts (`serving.max_batch_prompts`).
///
/// # Errors
/// [`IngressError::TooManyPrompts`].
pub(crate) fn check_batch(v: &Validated, limit: usize) -> Result<(), IngressError> {
    if v.prompt_count > limit {
        return Err(IngressError::TooManyPrompts {
            count: v.prompt_count,
            limit,
        });
    }
    Ok(())
}

/// Which field asks for prompt logprobs (see [`Validated::prompt_logprobs`]).
fn asks_prompt_logprobs(endpoint: Endpoint, body: &Map<String, Value>) -> Option<&'static str> {
    let set = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
    if set("prompt_logprobs") {
        return Some("prompt_logprobs");
    }
    let echo = body.get("echo").is_some_and(truthy);
    let logprobs = match endpoint {
        Endpoint::Completions => set("logprobs"),
        Endpoint::Chat => set("top_logprobs"),
    };
    (echo && logprobs).then_some("echo")
}

/// Estimated tokens of one prompt (a string or a token-id list), as [`Validated::input_len`]
/// sizes a whole request.
pub(crate) fn size_prompt(prompt: &Value, chars_per_token: f64) -> u64 {
    let mut m = Map::new();
    m.insert("prompt".into(), prompt.clone());
    size_input(&m, chars_per_token)
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|x| x != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Minimal sizing (behaviour.md 7.9 fallback): a token-id prompt counts its ids; text counts
/// characters / `chars_per_token`, at least 1.
fn size_input(body: &Map<String, Value>, chars_per_token: f64) -> u64 {
    if let Some(Value::Array(a)) = body.get("prompt")
        && !a.is_empty()
        && a.iter().all(Value::is_u64)
    {
        return a.len() as u64;
    }
    let mut chars = 0usize;
    match body.get("prompt") {
        Some(Value::String(s)) => chars += s.chars().count(),
        Some(Value::Array(a)) => {
            chars += a
                .iter()
                .filter_map(Value::as_str)
                .map(|s| s.chars().count())
                .sum::<usize>()
        }
        _ => {}
    }
    if let Some(Value::Array(msgs)) = body.get("messages") {
        for m in msgs {
            match m.get("content") {
                Some(Value::String(s)) => chars += s.chars().count(),
                Some(Value::Array(parts)) => {
                    chars += parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .map(|s| s.chars().count())
                        .sum::<usize>()
                }
                _ => {}
            }
        }
    }
    ((chars as f64 / chars_per_token.max(0.1)).ceil() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The status and the body as the client reads it.
    fn wire((status, body): (StatusCode, ErrorReply)) -> (StatusCode, Value) {
        (
            status,
            serde_json::to_value(body).expect("an error body serialises"),
        )
    }

    /// A router serving `model` with one adapter, `adapter-a`.
    fn served(model: &'static str) -> crate::config::Served<'static> {
        static ADAPTERS: std::sync::LazyLock<Vec<String>> =
            std::sync::LazyLock::new(|| vec!["adapter-a".to_string()]);
        crate::config::Served {
            model,
            adapters: &ADAPTERS,
        }
    }

    /// A client's `model` may name the base model or one of its adapters; anything else is a
    /// 404 naming the base model.
    #[test]
    fn model_names_the_base_model_or_an_adapter() {
        assert!(check(r#"{"prompt":"x","model":"tiny-sim"}"#).is_ok());
        assert!(check(r#"{"prompt":"x","model":"adapter-a"}"#).is_ok());
        let e = check(r#"{"prompt":"x","model":"adapter-b"}"#).unwrap_err();
        assert!(matches!(e, IngressError::ModelNotFound { .. }), "{e:?}");
        assert!(e.to_string().contains("'tiny-sim'"), "{e}");
    }

    fn check(body: &str) -> Result<Validated, IngressError> {
        validate(
            Endpoint::Completions,
            body.as_bytes(),
            served("tiny-sim"),
            Backend::Vllm,
            3.8,
        )
    }

    #[test]
    fn malformed_bodies_get_400_with_the_reference_messages() {
        for b in ["{", "", "nul"] {
            let e = check(b).unwrap_err();
            assert_eq!(e, IngressError::InvalidJson);
            let (st, body) = wire(e.response());
            assert_eq!(st, StatusCode::BAD_REQUEST);
            assert_eq!(
                body,
                json!({"error": {"message": "the request body is not valid JSON", "type": "invalid_request_error", "param": null, "code": null}})
            );
        }
        for b in ["[]", "null", "1", "\"x\""] {
            let (st, body) = wire(check(b).unwrap_err().response());
            assert_eq!(st, StatusCode::BAD_REQUEST);
            assert_eq!(body["error"]["param"], Value::Null);
            assert_eq!(
                body["error"]["message"],
                "the request body must be a JSON object"
            );
        }
    }

    #[test]
    fn field_shapes_name_the_param() {
        let cases = [
            (r#"{"model":1}"#, "model"),
            (r#"{"stream":"yes"}"#, "stream"),
            (r#"{"max_tokens":true}"#, "max_tokens"),
            (r#"{"n":1.5}"#, "n"),
            (r#"{"prompt":5}"#, "prompt"),
            (r#"{"messages":"x"}"#, "messages"),
            (r#"{"messages":[1]}"#, "messages"),
        ];
        for (b, param) in cases {
            let (st, body) = wire(check(b).unwrap_err().response());
            assert_eq!(st, StatusCode::BAD_REQUEST, "{b}");
            assert_eq!(body["error"]["param"], param, "{b}");
            assert_eq!(body["error"]["type"], "invalid_request_error");
            assert_eq!(body["error"]["code"], Value::Null);
        }
    }

    #[test]
    fn the_input_is_required_and_named() {
        let e = check(r#"{"model":"tiny-sim","max_tokens":3}"#).unwrap_err();
        let (st, body) = wire(e.response());
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["param"], "prompt", "{body}");
        let chat = validate(
            Endpoint::Chat,
            br#"{"model":"tiny-sim","prompt":"not for chat"}"#,
            served("tiny-sim"),
            Backend::Vllm,
            3.8,
        )
        .unwrap_err();
        assert_eq!(wire(chat.response()).1["error"]["param"], "messages");
    }

    #[test]
    fn reserved_fields_are_refused_in_both_dialects() {
        for (b, field) in [
            (r#"{"kv_transfer_params":{}}"#, "kv_transfer_params"),
            (
                r#"{"vllm_xargs":{"kv_transfer_params":{}}}"#,
                "vllm_xargs.kv_transfer_params",
            ),
            (
                r#"{"vllm_xargs":{"kv_cache_report_mode":1}}"#,
                "vllm_xargs.kv_cache_report_mode",
            ),
            (
                r#"{"vllm_xargs":{"ec_transfer_params":1}}"#,
                "vllm_xargs.ec_transfer_params",
            ),
            (r#"{"rid":"x"}"#, "rid"),
            (r#"{"bootstrap_host":"h"}"#, "bootstrap_host"),
            (r#"{"bootstrap_port":1}"#, "bootstrap_port"),
            (r#"{"bootstrap_room":1}"#, "bootstrap_room"),
        ] {
            for backend in [Backend::Vllm, Backend::Sglang] {
                let e = validate(
                    Endpoint::Completions,
                    b.as_bytes(),
                    served("m"),
                    backend,
                    3.8,
                )
                .unwrap_err();
                let (st, body) = wire(e.response());
                assert_eq!(st, StatusCode::BAD_REQUEST);
                assert_eq!(
                    body["error"]["message"],
                    format!("{field} is reserved for Narwhal")
                );
                assert_eq!(body["error"]["param"], field);
            }
        }
    }

    #[test]
    fn wrong_model_is_404() {
        let (st, body) = wire(
            check(r#"{"model":"nope","prompt":"x"}"#)
                .unwrap_err()
                .response(),
        );
        assert_eq!(st, StatusCode::NOT_FOUND);
        assert_eq!(
            body,
            json!({"error": {"message": "model 'nope' is not served here; this router serves 'tiny-sim'", "type": "invalid_request_error", "code": "model_not_found"}})
        );
    }

    /// `n` / `best_of` > 1 passes ingress, marked for the placement: a split refuses it
    /// with the reference's 400, an aggregated engine serves it.
    #[test]
    fn sampling_width_over_one_is_marked_and_refused_across_a_split_like_the_reference() {
        let v = check(r#"{"prompt":"x","n":2}"#).unwrap();
        assert_eq!((v.sampling_width, v.choices), (Some("n"), 2));
        let (st, body) = wire(IngressError::SamplingWidth { field: "n" }.response());
        assert_eq!(st, StatusCode::BAD_REQUEST);
        let want: Value =
            serde_json::from_str(include_str!("../testdata/reference-error-400-n.json")).unwrap();
        assert_eq!(body, want["body"]);
        let v = check(r#"{"prompt":"x","best_of":3}"#).unwrap();
        assert_eq!((v.sampling_width, v.choices), (Some("best_of"), 1));
        let v = check(r#"{"prompt":"x","n":1}"#).unwrap();
        assert_eq!((v.sampling_width, v.choices), (None, 1));
    }

    /// Batches are recognised (strings or token-id lists, two or more), limited, and
    /// prompt-logprob requests are named by the field that asks (docs/http-api.md).
    #[test]
    fn batches_and_prompt_logprobs_are_recognised() {
        let v = check(r#"{"prompt":["a","b","c"]}"#).unwrap();
        assert_eq!(v.prompt_count, 3);
        assert_eq!(batch_prompts(&v).unwrap().len(), 3);
        let v = check(r#"{"prompt":[[1,2],[3,4]]}"#).unwrap();
        assert_eq!(v.prompt_count, 2);
        for single in [
            r#"{"prompt":[1,2,3]}"#,
            r#"{"prompt":["a"]}"#,
            r#"{"prompt":"a"}"#,
        ] {
            let v = check(single).unwrap();
            assert_eq!(v.prompt_count, 1, "{single}");
            assert!(batch_prompts(&v).is_none());
        }
        let v = check(r#"{"prompt":["a","b","c"]}"#).unwrap();
        let (st, body) = wire(check_batch(&v, 2).unwrap_err().response());
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["param"], "prompt");
        assert!(check_batch(&v, 3).is_ok());
        let asks = |b: &str| check(b).unwrap().prompt_logprobs;
        assert_eq!(
            asks(r#"{"prompt":"a","prompt_logprobs":1}"#),
            Some("prompt_logprobs")
        );
        assert_eq!(
            asks(r#"{"prompt":"a","echo":true,"logprobs":1}"#),
            Some("echo")
        );
        assert_eq!(asks(r#"{"prompt":"a","echo":true}"#), None);
        assert_eq!(
            asks(r#"{"prompt":"a","logprobs":1,"prompt_logprobs":null}"#),
            None
        );
        let chat = |b: &str| {
            validate(
                Endpoint::Chat,
                b.as_bytes(),
                served("tiny-sim"),
                Backend::Vllm,
                3.8,
            )
            .unwrap()
            .prompt_logprobs
        };
        assert_eq!(
            chat(r#"{"messages":[],"echo":true,"logprobs":true,"top_logprobs":2}"#),
            Some("echo")
        );
        assert_eq!(chat(r#"{"messages":[],"echo":true,"logprobs":true}"#), None);
        let (st, body) = wire(IngressError::Unsplittable { field: "echo" }.response());
        assert_eq!(st, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["param"], "echo");
        assert_eq!(
            check(r#"{"prompt":"a","max_completion_tokens":1}"#)
                .unwrap()
                .max_tokens,
            Some(1)
        );
    }

    #[test]
    fn too_large_body_shape() {
        let (st, body) = wire(IngressError::TooLarge { limit: 10 }.response());
        assert_eq!(st, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(body["error"]["type"], "request_too_large");
    }

    #[test]
    fn valid_request_gets_model_and_flags() {
        let v = check(r#"{"prompt":[1,2,3],"stream":true,"return_token_ids":true,"stream_options":{"include_usage":true}}"#).unwrap();
        assert_eq!(v.body["model"], "tiny-sim");
        assert!(v.stream && v.return_token_ids && v.include_usage);
        assert_eq!(v.input_len, 3);
        let v = check(r#"{"prompt":"abcdefgh"}"#).unwrap();
        assert_eq!(v.input_len, 3);
        assert!(!v.stream);
    }

    #[test]
    fn non_streaming_restrictions_and_sglang_chat_flags() {
        assert!(check(r#"{"prompt":"x","audio":{}}"#).is_err());
        assert!(check(r#"{"prompt":"x","modalities":["text"]}"#).is_ok());
        assert!(check(r#"{"prompt":"x","tools":[{"type":"other"}]}"#).is_err());
        let e = validate(
            Endpoint::Chat,
            br#"{"messages":[],"return_token_ids":true}"#,
            served("m"),
            Backend::Sglang,
            3.8,
        );
        assert!(e.is_err());
        let ok = validate(
            Endpoint::Chat,
            br#"{"messages":[],"return_token_ids":true}"#,
            served("m"),
            Backend::Vllm,
            3.8,
        );
        assert!(ok.is_ok());
    }
}
