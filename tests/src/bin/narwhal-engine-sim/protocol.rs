//! OpenAI wire shapes as vLLM and SGLang speak them: request parsing and validation, error
//! bodies, non-streaming objects and SSE chunk rendering.
//!
//! ```text
//!  body bytes ──parse_request──► Parsed { prompt ids, max_tokens, stream, kv params, bootstrap }
//!                     └─ ApiError { status, type, message } ──error_json──► {"error": {...}}
//!  Parsed + tokens ──ChunkFormat──► `data: {...}\n\n` frames (one token per frame)
//! ```
//!
//! Shapes follow examples captured from the reference's engine traffic and vLLM's OpenAI server
//! (`kv_transfer_params` at the top level of the response, `token_ids` per streamed choice with
//! `return_token_ids`, vLLM >= 0.10.2).

use std::fmt::Write as _;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::prefix_cache::{Keys, Media};
use crate::tokenizer;

/// Default `max_tokens` when the request gives none (vLLM's completions default).
pub(crate) const DEFAULT_MAX_TOKENS: u64 = 16;

/// Which OpenAI endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `POST /v1/completions`
    Completion,
    /// `POST /v1/chat/completions`
    Chat,
}

/// An error answered as `{"error": {"message", "type", "param": null, "code": status}}`
/// (vLLM's `ErrorResponse` shape).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub(crate) struct ApiError {
    /// HTTP status and `code`.
    pub(crate) status: u16,
    /// `type`, e.g. `BadRequestError`.
    pub(crate) kind: &'static str,
    /// Human-readable message naming the offending field or value.
    pub(crate) message: String,
}

impl ApiError {
    /// 400 `BadRequestError`.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            kind: "BadRequestError",
            message: message.into(),
        }
    }

    /// 500 `InternalServerError` (the shape vLLM uses for failed KV transfers).
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: 500,
            kind: "InternalServerError",
            message: message.into(),
        }
    }

    /// The JSON body.
    pub(crate) fn body(&self) -> Value {
        error_json(self.status, self.kind, &self.message)
    }
}

/// `{"error": {"object": "error", "message", "type", "param": null, "code"}}`.
pub(crate) fn error_json(status: u16, kind: &str, message: &str) -> Value {
    json!({"error": {"object": "error", "message": message, "type": kind, "param": null, "code": status}})
}

/// vLLM NIXL `kv_transfer_params` of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KvParams {
    /// Absent, or neither flag set.
    None,
    /// `do_remote_decode: true`: run the prefill and hand the KV to a remote decode.
    RemoteDecode,
    /// `do_remote_prefill: true` with a usable descriptor.
    RemotePrefill(Descriptor),
    /// `do_remote_prefill: true` but the descriptor is unusable (reason names the field).
    BadRemotePrefill(String),
}

/// The producer's descriptor a decode request carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Descriptor {
    /// `remote_engine_id`.
    pub(crate) engine_id: String,
    /// `remote_block_ids` (flattened if given as a list of lists).
    pub(crate) block_ids: Vec<u64>,
    /// `remote_host`.
    pub(crate) host: String,
    /// `remote_port` (the producer's side channel).
    pub(crate) port: u16,
}

/// SGLang rendezvous fields of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bootstrap {
    /// `bootstrap_host`.
    pub(crate) host: String,
    /// `bootstrap_port`.
    pub(crate) port: u16,
    /// `bootstrap_room`.
    pub(crate) room: u64,
}

/// SGLang's placeholder rendezvous host (`FAKE_BOOTSTRAP_HOST`): a request naming it runs
/// locally on a prefill- or decode-mode server, without a peer.
pub(crate) const FAKE_BOOTSTRAP_HOST: &str = "2.2.2.2";

/// A validated completion or chat request.
#[derive(Debug, Clone)]
pub(crate) struct Parsed {
    /// Endpoint.
    pub(crate) kind: Kind,
    /// Prompt token ids (chat: after the template).
    pub(crate) prompt: Vec<u32>,
    /// Tokens to generate.
    pub(crate) max_tokens: u64,
    /// `stream`.
    pub(crate) stream: bool,
    /// `stream_options.include_usage`.
    pub(crate) include_usage: bool,
    /// `return_token_ids`.
    pub(crate) return_token_ids: bool,
    /// vLLM `kv_transfer_params`.
    pub(crate) kv: KvParams,
    /// SGLang rendezvous, when all three fields are present.
    pub(crate) bootstrap: Option<Bootstrap>,
    /// `true` when some but not all bootstrap fields are present.
    pub(crate) bootstrap_partial: bool,
    /// `bootstrap_host` is SGLang's placeholder [`FAKE_BOOTSTRAP_HOST`]: served alone.
    pub(crate) fake_bootstrap: bool,
    /// SGLang body `rid`.
    pub(crate) rid: Option<String>,
    /// `n`: choices to generate (at least 1; vLLM's `SamplingParams` refuses less).
    pub(crate) n: u32,
    /// What its blocks are keyed by beyond their tokens (its adapter, its `cache_salt`).
    pub(crate) keys: Keys,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

/// The chat request fields that change a prompt's tokens, as vLLM's chat template and
/// tokenizer take them (`ChatCompletionRequest`, `TokenizeChatRequest`): the `tools` the
/// template renders, `add_generation_prompt` (default true) and `add_special_tokens` (default
/// false for chat: the template writes the BOS itself; true adds the tokenizer's BOS again).
#[derive(Deserialize, Default)]
struct ChatOptions {
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

impl ChatOptions {
    fn template(&self, render_tools: bool) -> tokenizer::Template<'_> {
        tokenizer::Template {
            tools: self.tools.as_ref().filter(|t| render_tools && !t.is_null()),
            generation_prompt: self.add_generation_prompt.unwrap_or(true),
            special_tokens: self.add_special_tokens.unwrap_or(false),
        }
    }
}

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    model: Option<String>,
    #[serde(flatten)]
    chat: ChatOptions,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    return_token_ids: Option<bool>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
    #[serde(default)]
    bootstrap_host: Option<String>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    bootstrap_room: Option<u64>,
    #[serde(default)]
    rid: Option<String>,
    #[serde(default)]
    cache_salt: Option<Value>,
}

/// Limits a request is validated against.
pub(crate) struct Limits<'a> {
    /// The served model name.
    pub(crate) model: &'a str,
    /// The adapters served beside it (`--lora-modules`).
    pub(crate) adapters: &'a [String],
    /// `--max-model-len` (tokens).
    pub(crate) max_model_len: u64,
    /// Whether the chat template renders `tools` (`--template-without-tools`: not).
    pub(crate) render_tools: bool,
}

/// Parses and validates a completion/chat body the way vLLM does (400 for malformed JSON, wrong
/// types, empty prompt, bad `max_tokens`, `stream_options` without `stream`, too long a
/// prompt; 404 for a model that is not served).
pub(crate) fn parse_request(kind: Kind, bytes: &[u8], limits: &Limits) -> Result<Parsed, ApiError> {
    let body: Body = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    let lora = adapter(body.model.as_deref(), limits)?;
    // vLLM `validate_cache_salt` (entrypoints/generate/base/protocol.py).
    let salt = match &body.cache_salt {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
            ));
        }
    };
    // vLLM `SamplingParams._verify_args`: "n must be at least 1, got {n}." (a 400).
    let n = match body.n {
        None => 1,
        Some(n) if n >= 1 => u32::try_from(n).unwrap_or(u32::MAX).min(MAX_N),
        Some(n) => {
            return Err(ApiError::bad_request(format!(
                "n must be at least 1, got {n}."
            )));
        }
    };
    let stream = body.stream.unwrap_or(false);
    if body.stream_options.is_some() && !stream {
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    let include_usage = body
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let (prompt, media) = match kind {
        Kind::Completion => (completion_prompt(body.prompt.as_ref())?, Vec::new()),
        Kind::Chat => chat_prompt(body.messages.as_deref(), &body.chat, limits.render_tools)?,
    };
    let max = match kind {
        Kind::Completion => body.max_tokens,
        Kind::Chat => body.max_completion_tokens.or(body.max_tokens),
    };
    let max_tokens = match max {
        None => DEFAULT_MAX_TOKENS,
        Some(m) if m < 1 => {
            return Err(ApiError::bad_request(format!(
                "max_tokens must be at least 1, got {m}."
            )));
        }
        Some(m) => m as u64,
    };
    let p = prompt.len() as u64;
    let l = limits.max_model_len;
    if p > l {
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {l} tokens. However, your request has {p} \
             input tokens. Please reduce the length of the input messages."
        )));
    }
    if p + max_tokens > l {
        return Err(ApiError::bad_request(format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's \
             maximum context length is {l} tokens and your request has {p} input tokens \
             ({max_tokens} > {l} - {p})."
        )));
    }
    let kv = kv_params(body.kv_transfer_params.as_ref());
    // SGLang's placeholder host: the request runs alone on a P/D server (its own health
    // generation and warm-up use it: sglang/srt/disaggregation/utils.py FAKE_BOOTSTRAP_HOST).
    let fake_bootstrap = body.bootstrap_host.as_deref() == Some(FAKE_BOOTSTRAP_HOST);
    let present = [
        body.bootstrap_host.is_some(),
        body.bootstrap_port.is_some(),
        body.bootstrap_room.is_some(),
    ];
    let bootstrap = match (
        body.bootstrap_host,
        body.bootstrap_port,
        body.bootstrap_room,
    ) {
        _ if fake_bootstrap => None,
        (Some(host), Some(port), Some(room)) => Some(Bootstrap { host, port, room }),
        _ => None,
    };
    Ok(Parsed {
        kind,
        prompt,
        max_tokens,
        stream,
        include_usage,
        return_token_ids: body.return_token_ids.unwrap_or(false),
        kv,
        bootstrap_partial: bootstrap.is_none() && !fake_bootstrap && present.iter().any(|x| *x),
        fake_bootstrap,
        bootstrap,
        rid: body.rid,
        n,
        keys: Keys { lora, salt, media },
    })
}

/// The adapter a request's `model` names: `None` for the base model (or no `model`), the name
/// for one of `--lora-modules`, a 404 for anything else (vLLM's message).
fn adapter(model: Option<&str>, limits: &Limits) -> Result<Option<String>, ApiError> {
    match model {
        None => Ok(None),
        Some(m) if m == limits.model => Ok(None),
        Some(m) if limits.adapters.iter().any(|a| a == m) => Ok(Some(m.to_string())),
        Some(m) => Err(ApiError {
            status: 404,
            kind: "NotFoundError",
            message: format!("The model `{m}` does not exist."),
        }),
    }
}

/// The most choices one simulated request generates (a bound on the simulator's work, not
/// vLLM's: larger `n` is clamped).
const MAX_N: u32 = 64;

#[derive(Deserialize)]
struct TokenizeBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(flatten)]
    chat: ChatOptions,
}

/// Parses a `POST /tokenize` body (`{"model","prompt"}` or `{"model","messages"}`) into token
/// ids. Errors as [`parse_request`] (404 for another model, 400 otherwise).
pub(crate) fn parse_tokenize(bytes: &[u8], limits: &Limits) -> Result<Vec<u32>, ApiError> {
    let body: TokenizeBody = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    adapter(body.model.as_deref(), limits)?;
    match (body.prompt.as_ref(), body.messages.as_deref()) {
        (Some(Value::String(s)), None) => {
            let mut ids = Vec::new();
            tokenizer::tokenize_into(s, &mut ids);
            Ok(ids)
        }
        (Some(p), None) => completion_prompt(Some(p)),
        (None, Some(m)) => {
            chat_prompt(Some(m), &body.chat, limits.render_tools).map(|(ids, _)| ids)
        }
        _ => Err(ApiError::bad_request(
            "exactly one of `prompt` or `messages` is required",
        )),
    }
}

/// `prompt`: a string, a list of one string, or a list of token ids.
fn completion_prompt(prompt: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::new();
    match prompt {
        None => return Err(ApiError::bad_request("field `prompt` is required")),
        Some(Value::String(s)) => tokenizer::tokenize_into(s, &mut ids),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => tokenizer::tokenize_into(s, &mut ids),
            [] => {}
            [Value::Number(_), ..] => {
                for v in items {
                    match v.as_u64() {
                        Some(t) if t < u64::from(tokenizer::VOCAB) => ids.push(t as u32),
                        _ => {
                            return Err(ApiError::bad_request(format!(
                                "prompt token id {v} is out of vocabulary (0..{})",
                                tokenizer::VOCAB
                            )));
                        }
                    }
                }
            }
            _ => {
                return Err(ApiError::bad_request(
                    "prompt: the engine simulator accepts a string, a list of one string or a \
                     list of token ids (batched prompts are not supported)",
                ));
            }
        },
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "prompt must be a string or a list, got {other}"
            )));
        }
    }
    if ids.is_empty() {
        return Err(ApiError::bad_request("The decoder prompt cannot be empty"));
    }
    Ok(ids)
}

/// Placeholder tokens an image stands for in the prompt (vLLM expands an image to its
/// processor's count; a fixed count here).
pub(crate) const IMAGE_TOKENS: usize = 8;

/// The placeholder word an image is rendered as ([`IMAGE_TOKENS`] of them).
const IMAGE_WORD: &str = "<|image|>";

/// `messages`: content is a string or a list of parts, `{"type": "text", "text": ...}` or
/// `{"type": "image_url", "image_url": {"url": ...}}` (rendered as [`IMAGE_TOKENS`]
/// placeholder tokens, keyed by a hash of the URL: [`Media`]). The prompt's token ids and its
/// images, in prompt order.
fn chat_prompt(
    messages: Option<&[Message]>,
    chat: &ChatOptions,
    render_tools: bool,
) -> Result<(Vec<u32>, Vec<Media>), ApiError> {
    let Some(messages) = messages else {
        return Err(ApiError::bad_request("field `messages` is required"));
    };
    if messages.is_empty() {
        return Err(ApiError::bad_request("field `messages` must not be empty"));
    }
    let mut flat: Vec<(&str, String)> = Vec::with_capacity(messages.len());
    let mut images = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let text = match &m.content {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut t = String::new();
                for p in parts {
                    let url = p
                        .get("image_url")
                        .and_then(|u| u.get("url"))
                        .and_then(Value::as_str);
                    match (p.get("text").and_then(Value::as_str), url) {
                        (Some(s), _) => {
                            t.push(' ');
                            t.push_str(s);
                        }
                        (None, Some(url)) => {
                            images.push(format!(
                                "{:016x}",
                                tokenizer::prompt_hash(
                                    &url.bytes().map(u32::from).collect::<Vec<_>>(),
                                )
                            ));
                            for _ in 0..IMAGE_TOKENS {
                                t.push(' ');
                                t.push_str(IMAGE_WORD);
                            }
                        }
                        (None, None) => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content: only text and image_url parts are \
                                 supported"
                            )));
                        }
                    }
                }
                t
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content must be a string or a list of parts, got {other}"
                )));
            }
        };
        flat.push((m.role.as_str(), text));
    }
    let ids = tokenizer::chat_tokens(
        flat.iter().map(|(r, c)| (*r, c.as_str())),
        &chat.template(render_tools),
    );
    // Each image is the next run of its placeholders (text that spells the placeholder is
    // tokenized alike but is no image: only as many runs as there were image parts count).
    let placeholder = tokenizer::word_id(IMAGE_WORD);
    let mut media = Vec::with_capacity(images.len());
    let mut images = images.into_iter();
    let mut at = 0;
    while at + IMAGE_TOKENS <= ids.len() && media.len() < media.capacity() {
        if ids[at..at + IMAGE_TOKENS].iter().all(|t| *t == placeholder) {
            if let Some(identifier) = images.next() {
                media.push(Media {
                    identifier,
                    start: at,
                    len: IMAGE_TOKENS,
                });
            }
            at += IMAGE_TOKENS;
        } else {
            at += 1;
        }
    }
    Ok((ids, media))
}

/// Reads `kv_transfer_params` like vLLM's NixlConnector: `do_remote_decode` wins, then
/// `do_remote_prefill` with `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`.
fn kv_params(v: Option<&Value>) -> KvParams {
    let Some(Value::Object(o)) = v else {
        return KvParams::None;
    };
    let flag = |k: &str| o.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("do_remote_decode") {
        return KvParams::RemoteDecode;
    }
    if !flag("do_remote_prefill") {
        return KvParams::None;
    }
    let engine_id = match o.get("remote_engine_id").and_then(Value::as_str) {
        Some(s) if !s.is_empty() => s.to_string(),
        _ => return KvParams::BadRemotePrefill("remote_engine_id missing or empty".into()),
    };
    let mut block_ids = Vec::new();
    match o.get("remote_block_ids") {
        Some(Value::Array(items)) => {
            for it in items {
                match it {
                    Value::Array(inner) => {
                        for x in inner {
                            match x.as_u64() {
                                Some(b) => block_ids.push(b),
                                None => {
                                    return KvParams::BadRemotePrefill(format!(
                                        "remote_block_ids entry {x} is not a block id"
                                    ));
                                }
                            }
                        }
                    }
                    x => match x.as_u64() {
                        Some(b) => block_ids.push(b),
                        None => {
                            return KvParams::BadRemotePrefill(format!(
                                "remote_block_ids entry {x} is not a block id"
                            ));
                        }
                    },
                }
            }
        }
        _ => return KvParams::BadRemotePrefill("remote_block_ids missing or not a list".into()),
    }
    let host = match o.get("remote_host").and_then(Value::as_str) {
        Some(s) if !s.is_empty() => s.to_string(),
        _ => return KvParams::BadRemotePrefill("remote_host missing or empty".into()),
    };
    let port = match o.get("remote_port").and_then(Value::as_u64) {
        Some(p) if p > 0 && p <= u64::from(u16::MAX) => p as u16,
        _ => return KvParams::BadRemotePrefill("remote_port missing or not a port".into()),
    };
    KvParams::RemotePrefill(Descriptor {
        engine_id,
        block_ids,
        host,
        port,
    })
}

/// Per-request constant parts of every chunk, pre-escaped once.
pub(crate) struct ChunkFormat {
    kind: Kind,
    /// `data: {"id":..,"object":..,"created":..,"model":..,"choices":[`
    head: String,
    /// Same without `"choices":[` (for the usage chunk).
    head_no_choices: String,
    return_token_ids: bool,
    /// The choice the next chunk is for (`n` > 1 streams interleave their choices).
    index: u32,
    /// Prompt ids for the first chunk (`return_token_ids`), taken once.
    prompt_ids: Option<Vec<u32>>,
    first_sent: bool,
}

impl ChunkFormat {
    /// Prepares the constant parts of the chunks of one response.
    pub(crate) fn new(
        kind: Kind,
        id: &str,
        model: &str,
        created: u64,
        return_token_ids: bool,
        prompt: &[u32],
    ) -> Self {
        let object = match kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        // Serialising a &str cannot fail.
        let id = serde_json::to_string(id).unwrap_or_default();
        let model = serde_json::to_string(model).unwrap_or_default();
        let head_no_choices = format!(
            "data: {{\"id\":{id},\"object\":\"{object}\",\"created\":{created},\"model\":{model}"
        );
        let head = format!("{head_no_choices},\"choices\":[");
        ChunkFormat {
            kind,
            head,
            head_no_choices,
            return_token_ids,
            index: 0,
            prompt_ids: return_token_ids.then(|| prompt.to_vec()),
            first_sent: false,
        }
    }

    /// Chunks written next are for choice `index` (vLLM streams each choice's chunks with its
    /// `index`, interleaved as they are generated).
    pub(crate) fn set_index(&mut self, index: u32) {
        self.index = index;
    }

    fn push_ids(out: &mut String, key: &str, ids: &[u32]) {
        out.push_str(",\"");
        out.push_str(key);
        out.push_str("\":[");
        for (i, t) in ids.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            // Writing to a String cannot fail.
            let _ = write!(out, "{t}");
        }
        out.push(']');
    }

    /// Chat only: the first chunk carrying `delta.role` (and, with `return_token_ids`,
    /// `token_ids: []` and the top-level `prompt_token_ids`).
    pub(crate) fn role_chunk(&mut self, out: &mut String) {
        out.push_str(&self.head);
        let _ = write!(
            out,
            "{{\"index\":{},\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null",
            self.index
        );
        if self.return_token_ids {
            Self::push_ids(out, "token_ids", &[]);
        }
        out.push_str("}]");
        if let Some(p) = self.prompt_ids.take() {
            Self::push_ids(out, "prompt_token_ids", &p);
        }
        out.push_str("}\n\n");
        self.first_sent = true;
    }

    /// One token chunk. `finish` marks the last (`finish_reason: "length"`); `extra` is a
    /// top-level JSON member fragment (e.g. `"kv_transfer_params":{...}`) for the last chunk.
    pub(crate) fn token_chunk(&mut self, out: &mut String, id: u32, finish: bool, extra: &str) {
        out.push_str(&self.head);
        let reason = if finish { "\"length\"" } else { "null" };
        match self.kind {
            Kind::Completion => {
                let _ = write!(out, "{{\"index\":{},\"text\":\"", self.index);
                tokenizer::push_token_text(out, id);
                out.push_str("\",\"logprobs\":null,\"finish_reason\":");
                out.push_str(reason);
                out.push_str(",\"stop_reason\":null");
                if self.return_token_ids {
                    Self::push_ids(out, "token_ids", &[id]);
                    if let Some(p) = self.prompt_ids.take() {
                        Self::push_ids(out, "prompt_token_ids", &p);
                    }
                }
                out.push_str("}]");
            }
            Kind::Chat => {
                let _ = write!(out, "{{\"index\":{},\"delta\":{{\"content\":\"", self.index);
                tokenizer::push_token_text(out, id);
                out.push_str("\"},\"logprobs\":null,\"finish_reason\":");
                out.push_str(reason);
                if self.return_token_ids {
                    Self::push_ids(out, "token_ids", &[id]);
                }
                out.push_str("}]");
            }
        }
        if !extra.is_empty() {
            out.push(',');
            out.push_str(extra);
        }
        out.push_str("}\n\n");
        self.first_sent = true;
    }

    /// The final usage chunk (`choices: []`), sent when `stream_options.include_usage`;
    /// with `cached` (`--enable-prompt-tokens-details`), its `prompt_tokens_details`.
    pub(crate) fn usage_chunk(
        &self,
        out: &mut String,
        prompt: u64,
        completion: u64,
        cached: Option<u64>,
    ) {
        out.push_str(&self.head_no_choices);
        let _ = write!(
            out,
            ",\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{}",
            prompt + completion
        );
        if let Some(c) = cached {
            let _ = write!(
                out,
                ",\"prompt_tokens_details\":{}",
                prompt_tokens_details(c)
            );
        }
        out.push_str("}}\n\n");
    }
}

/// vLLM's `PromptTokenUsageInfo` as it serializes it: `cached_tokens`, and the two fields it
/// leaves null for a text prompt.
fn prompt_tokens_details(cached: u64) -> Value {
    json!({"cached_tokens": cached, "created_cache_tokens": null, "multimodal_tokens": null})
}

/// Stream terminator.
pub(crate) const DONE: &str = "data: [DONE]\n\n";

/// One SSE error frame followed by `[DONE]` (what vLLM emits when a stream fails after the
/// 200 head went out).
pub(crate) fn error_frames(err: &ApiError) -> String {
    format!("data: {}\n\n{DONE}", err.body())
}

/// Builds a non-streaming `text_completion` / `chat.completion` object with one choice per
/// `(text, token_ids)` of `choices` (`index` = its position), as vLLM answers `n`: usage counts
/// the prompt once and sums the completion tokens of every choice. `kv_transfer_params` goes
/// at the top level, as vLLM's `CompletionResponse`/`ChatCompletionResponse` carry it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn full_response(
    kind: Kind,
    id: &str,
    model: &str,
    created: u64,
    choices: &[(String, Vec<u32>)],
    prompt: &[u32],
    return_token_ids: bool,
    kv_transfer_params: Option<Value>,
    cached_tokens: Option<u64>,
) -> Value {
    let completion: usize = choices.iter().map(|(_, ids)| ids.len()).sum();
    let mut usage = json!({
        "prompt_tokens": prompt.len(),
        "completion_tokens": completion,
        "total_tokens": prompt.len() + completion,
    });
    if let Some(c) = cached_tokens {
        usage["prompt_tokens_details"] = prompt_tokens_details(c);
    }
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, (text, token_ids))| {
            let mut choice = match kind {
                Kind::Completion => json!({
                    "index": index, "text": text, "logprobs": null,
                    "finish_reason": "length", "stop_reason": null,
                }),
                Kind::Chat => json!({
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": null, "finish_reason": "length", "stop_reason": null,
                }),
            };
            if return_token_ids {
                choice["token_ids"] = json!(token_ids);
                if kind == Kind::Completion {
                    choice["prompt_token_ids"] = json!(prompt);
                }
            }
            choice
        })
        .collect();
    let object = match kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    let mut out = json!({
        "id": id, "object": object, "created": created, "model": model,
        "choices": choices, "usage": usage,
    });
    if return_token_ids && kind == Kind::Chat {
        out["prompt_token_ids"] = json!(prompt);
    }
    if let Some(kv) = kv_transfer_params {
        out["kv_transfer_params"] = kv;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIM: Limits = Limits {
        model: "tiny-sim",
        adapters: &[],
        max_model_len: 64,
        render_tools: true,
    };

    fn parse(kind: Kind, s: &str) -> Result<Parsed, ApiError> {
        parse_request(kind, s.as_bytes(), &LIM)
    }

    #[test]
    fn validation_matches_vllm_statuses_and_messages() {
        let e = parse(Kind::Completion, r#"{"model":"x","prompt":"a"}"#).unwrap_err();
        assert_eq!((e.status, e.kind), (404, "NotFoundError"));
        assert_eq!(e.message, "The model `x` does not exist.");
        assert_eq!(parse(Kind::Completion, "{").unwrap_err().status, 400);
        let e = parse(Kind::Completion, r#"{"prompt":"a","max_tokens":"x"}"#).unwrap_err();
        assert!(e.message.contains("max_tokens") || e.message.contains("invalid type"));
        let e = parse(Kind::Completion, r#"{"prompt":""}"#).unwrap_err();
        assert!(e.message.contains("empty"));
        let e = parse(Kind::Completion, r#"{"prompt":"a","stream_options":{}}"#).unwrap_err();
        assert!(e.message.contains("stream=True"));
        let long = vec!["w"; 65].join(" ");
        let e = parse(Kind::Completion, &format!(r#"{{"prompt":"{long}"}}"#)).unwrap_err();
        assert!(e.message.contains("maximum context length is 64"), "{e}");
        let e = parse(Kind::Completion, r#"{"prompt":"a b","max_tokens":63}"#).unwrap_err();
        assert!(e.message.contains("(63 > 64 - 2)"), "{e}");
        let e = parse(Kind::Completion, r#"{"prompt":"a","max_tokens":0}"#).unwrap_err();
        assert!(e.message.contains("at least 1"));
        assert_eq!(
            parse(Kind::Chat, r#"{"messages":[]}"#).unwrap_err().status,
            400
        );
    }

    #[test]
    fn defaults_and_chat_max_completion_tokens() {
        let p = parse(Kind::Completion, r#"{"prompt":"a b c"}"#).unwrap();
        assert_eq!((p.prompt.len(), p.max_tokens, p.stream), (3, 16, false));
        let p = parse(
            Kind::Chat,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":3,"max_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(p.max_tokens, 3);
        let p = parse(Kind::Completion, r#"{"prompt":[5,6,7]}"#).unwrap();
        assert_eq!(p.prompt, vec![5, 6, 7]);
    }

    #[test]
    fn kv_transfer_params_are_read_like_nixl() {
        let p = parse(
            Kind::Completion,
            r#"{"prompt":"a","kv_transfer_params":{"do_remote_decode":true}}"#,
        )
        .unwrap();
        assert_eq!(p.kv, KvParams::RemoteDecode);
        let p = parse(
            Kind::Completion,
            r#"{"prompt":"a","kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1,2],[3]],"remote_host":"127.0.0.1","remote_port":9}}"#,
        )
        .unwrap();
        assert_eq!(
            p.kv,
            KvParams::RemotePrefill(Descriptor {
                engine_id: "e".into(),
                block_ids: vec![1, 2, 3],
                host: "127.0.0.1".into(),
                port: 9
            })
        );
        let p = parse(
            Kind::Completion,
            r#"{"prompt":"a","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1]}}"#,
        )
        .unwrap();
        assert!(matches!(p.kv, KvParams::BadRemotePrefill(m) if m.contains("remote_engine_id")));
    }

    #[test]
    fn bootstrap_fields_need_all_three() {
        let p = parse(
            Kind::Completion,
            r#"{"prompt":"a","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7,"rid":"r1"}"#,
        )
        .unwrap();
        assert_eq!(p.bootstrap.as_ref().map(|b| b.room), Some(7));
        assert_eq!(p.rid.as_deref(), Some("r1"));
        let p = parse(Kind::Completion, r#"{"prompt":"a","bootstrap_room":7}"#).unwrap();
        assert!(p.bootstrap.is_none() && p.bootstrap_partial);
        // SGLang's placeholder host (as its /health sends it: host and room, no port) asks
        // for a local run, not a rendezvous.
        let p = parse(
            Kind::Completion,
            r#"{"prompt":"a","bootstrap_host":"2.2.2.2","bootstrap_room":0}"#,
        )
        .unwrap();
        assert!(p.fake_bootstrap && p.bootstrap.is_none() && !p.bootstrap_partial);
    }

    #[test]
    fn chunks_are_valid_json_with_token_ids() {
        let mut f = ChunkFormat::new(Kind::Chat, "chatcmpl-1", "m\"x", 5, true, &[1, 2]);
        let mut s = String::new();
        f.role_chunk(&mut s);
        f.token_chunk(&mut s, 42, true, "");
        f.usage_chunk(&mut s, 2, 1, None);
        f.usage_chunk(&mut s, 2, 1, Some(16));
        let frames: Vec<Value> = s
            .split("\n\n")
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_str(l.strip_prefix("data: ").unwrap()).unwrap())
            .collect();
        assert_eq!(frames[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(frames[0]["prompt_token_ids"], json!([1, 2]));
        assert_eq!(frames[0]["model"], "m\"x");
        assert_eq!(frames[1]["choices"][0]["delta"]["content"], " w42");
        assert_eq!(frames[1]["choices"][0]["token_ids"], json!([42]));
        assert_eq!(frames[1]["choices"][0]["finish_reason"], "length");
        assert_eq!(frames[2]["choices"], json!([]));
        assert_eq!(frames[2]["usage"]["total_tokens"], 3);
        assert!(frames[2]["usage"].get("prompt_tokens_details").is_none());
        assert_eq!(
            frames[3]["usage"]["prompt_tokens_details"],
            json!({"cached_tokens": 16, "created_cache_tokens": null, "multimodal_tokens": null})
        );
        assert_eq!(frames[3]["usage"]["total_tokens"], 3);

        let mut f = ChunkFormat::new(Kind::Completion, "cmpl-1", "m", 5, true, &[9]);
        let mut s = String::new();
        f.token_chunk(&mut s, 7, false, "\"kv_transfer_params\":{\"a\":1}");
        let v: Value = serde_json::from_str(s.trim().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(v["choices"][0]["text"], " w7");
        assert_eq!(v["choices"][0]["prompt_token_ids"], json!([9]));
        assert_eq!(v["kv_transfer_params"]["a"], 1);
        let e = error_frames(&ApiError::internal("boom"));
        assert!(e.starts_with("data: {\"error\":{\"object\":\"error\",\"message\":\"boom\""));
        assert!(e.ends_with("data: [DONE]\n\n"));
    }
}
