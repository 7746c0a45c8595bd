//! Streaming relay, sans-IO (reference-notes 7.3; DESIGN.md section 5).
//!
//! ```text
//!  upstream body bytes ──SseParser::push──► data payloads ──StreamState::on_data──► RelayStep
//!      (any fragmentation, \n \r\n \r)        (comments dropped)   Hold | Output(chunks) | Done | Failed
//!  chunks ──► streaming client: "data: <compact json>\n\n" ... "data: [DONE]\n\n"
//!         └─► non-streaming client: Aggregator ──► one text_completion / chat.completion
//! ```
//!
//! Nothing is sent to the client before the first token-bearing chunk: earlier data chunks are
//! held (at most [`MAX_HELD_FRAMES`] and `max_response_bytes`), so a failure before output can
//! still be answered with an HTTP status and retried. Tokens are counted from the engine's
//! `usage`, else `token_ids` lengths, else one per content-bearing chunk (any
//! OpenAI-compatible engine: llama.cpp, TGI, SGLang chat send no ids); see [`StreamState`].
//! Usage-only chunks are held back for the serving layer, which forwards the engine's, merges
//! a fanned-out batch's or estimates one ([`usage_value`], [`sum_usages`]).

use bytes::Bytes;
use serde_json::{Map, Value, json};

/// Data frames held before the first token (reference-notes 7.3).
pub const MAX_HELD_FRAMES: usize = 64;

/// One dispatched SSE event's `data` payload (multi-line data joined by `\n`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseData(pub String);

/// Incremental SSE parser (WHATWG event-stream rules): lines end with `\n`, `\r\n` or `\r`; a
/// blank line dispatches the event; `:` lines are comments; only the `data` field is kept.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    pending_cr: bool,
    data: Option<String>,
    overflowed: bool,
}

/// Longest SSE line or event the parser buffers, bytes. An upstream that never ends a line
/// or an event past this is broken; the stream fails instead of growing router memory.
pub const MAX_SSE_EVENT_BYTES: usize = 1 << 20;

impl SseParser {
    /// A parser at the start of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed the next upstream bytes; returns the events completed by them, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseData> {
        let mut out = Vec::new();
        for &b in bytes {
            if self.pending_cr {
                self.pending_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\n' => self.end_line(&mut out),
                b'\r' => {
                    self.end_line(&mut out);
                    self.pending_cr = true;
                }
                _ => {
                    if self.line.len() >= MAX_SSE_EVENT_BYTES {
                        self.overflowed = true;
                        self.line.clear();
                    }
                    self.line.push(b)
                }
            }
        }
        out
    }

    /// An upstream line or event exceeded [`MAX_SSE_EVENT_BYTES`]; the stream must fail.
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// The upstream ended. An event not terminated by a blank line is discarded (SSE rules).
    pub fn finish(&mut self) {
        self.line.clear();
        self.data = None;
    }

    fn end_line(&mut self, out: &mut Vec<SseData>) {
        if self.line.is_empty() {
            if let Some(d) = self.data.take() {
                out.push(SseData(d));
            }
            return;
        }
        let line = String::from_utf8_lossy(&self.line).into_owned();
        self.line.clear();
        if line.starts_with(':') {
            return;
        }
        let (field, value) = match line.find(':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(' ').unwrap_or(v))
            }
            None => (line.as_str(), ""),
        };
        if field == "data" {
            match &mut self.data {
                Some(d) if d.len() + value.len() >= MAX_SSE_EVENT_BYTES => {
                    self.overflowed = true;
                    self.data = None;
                }
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_string()),
            }
        }
    }
}

/// What the client asked for that changes the relayed frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayOptions {
    /// The client itself set `return_token_ids: true`: keep `token_ids`/`prompt_token_ids`.
    pub return_token_ids: bool,
    /// Limit for held bytes before output, and for everything when `collect` is set.
    pub max_response_bytes: u64,
    /// The client is not streaming: every chunk counts toward `max_response_bytes`.
    pub collect: bool,
}

/// Why a decode stream failed (`upstream::LegError` maps it to a breaker class and a failed
/// reason).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamFailure {
    /// An in-stream `{"error": {...}}` frame; status from `error.code` if 400–599 else 500.
    UpstreamError {
        /// Derived HTTP status.
        status: u16,
        /// The engine's message.
        message: String,
    },
    /// The upstream ended without `[DONE]`.
    EndedWithoutDone,
    /// `[DONE]` arrived before any output (no token, no content, no finish reason).
    DoneBeforeToken,
    /// A data frame was not JSON or carried malformed `token_ids`.
    InvalidFrame(String),
    /// Held frames or collected bytes exceeded the limits.
    ResponseLimit,
}

impl StreamFailure {
    /// Detail for logs and the journal.
    pub fn detail(&self) -> String {
        match self {
            StreamFailure::UpstreamError { status, message } => {
                format!("in-stream error {status}: {message}")
            }
            StreamFailure::EndedWithoutDone => "stream ended without [DONE]".into(),
            StreamFailure::DoneBeforeToken => "[DONE] before any output".into(),
            StreamFailure::InvalidFrame(d) => format!("invalid stream frame: {d}"),
            StreamFailure::ResponseLimit => "response exceeds the configured limit".into(),
        }
    }
}

/// Result of feeding one event.
#[derive(Debug, Clone, PartialEq)]
pub enum RelayStep {
    /// Nothing to send yet.
    Hold,
    /// Send these chunks (the first `Output` of a stream includes every held chunk).
    Output(Vec<Value>),
    /// `[DONE]` after output: the stream completed.
    Done,
    /// The leg failed.
    Failed(StreamFailure),
}

/// The engine's own counts, from the `usage` objects its stream carried (the last one seen
/// wins: vLLM's final usage chunk, or `continuous_usage_stats` on every chunk).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineUsage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
}

/// Per-leg relay state (one per decode attempt).
///
/// Token evidence, best first: the engine's `usage.completion_tokens`, then `token_ids`
/// lengths (vLLM's `return_token_ids`, SGLang completions), then one token per
/// content-bearing choice delta (text, content, reasoning, tool calls), which every
/// OpenAI-compatible engine sends. Output starts at the first chunk that carries a token or
/// content or ends a choice (`finish_reason`): a generation that ended on its first step is an
/// answer, not an empty stream.
#[derive(Debug)]
pub struct StreamState {
    opts: RelayOptions,
    held: Vec<Value>,
    held_bytes: u64,
    collected_bytes: u64,
    started: bool,
    done: bool,
    tokens: u64,
    usage: EngineUsage,
    usage_chunk: Option<Value>,
}

impl StreamState {
    /// Fresh state for one decode leg.
    pub fn new(opts: RelayOptions) -> Self {
        StreamState {
            opts,
            held: Vec::new(),
            held_bytes: 0,
            collected_bytes: 0,
            started: false,
            done: false,
            tokens: 0,
            usage: EngineUsage::default(),
            usage_chunk: None,
        }
    }

    /// Has output (the first token, content or finish reason) started?
    pub fn started(&self) -> bool {
        self.started
    }

    /// Tokens counted from the stream's chunks so far (`token_ids` or content-bearing deltas).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Generated tokens: the engine's `usage.completion_tokens` when it sent one, else the
    /// tokens counted.
    pub fn output_tokens(&self) -> u64 {
        self.usage.completion_tokens.unwrap_or(self.tokens)
    }

    /// The engine's usage counts, if its stream carried any.
    pub fn engine_usage(&self) -> EngineUsage {
        self.usage
    }

    /// The engine's usage as an object, when its stream carried one only inside content
    /// chunks (no usage-only chunk): its counts, for [`usage_value`].
    pub fn engine_usage_value(&self) -> Option<Value> {
        let c = self.usage.completion_tokens?;
        let mut u = Map::new();
        if let Some(p) = self.usage.prompt_tokens {
            u.insert("prompt_tokens".into(), p.into());
        }
        u.insert("completion_tokens".into(), c.into());
        Some(Value::Object(u))
    }

    /// `usage.prompt_tokens` reported by the engine, if any.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.usage.prompt_tokens
    }

    /// The engine's usage-only chunk (`choices: []`), held back from the relayed stream: the
    /// serving layer forwards it, merges it or replaces it (see [`usage_value`]).
    pub fn take_usage_chunk(&mut self) -> Option<Value> {
        self.usage_chunk.take()
    }

    /// Feed one SSE data payload.
    pub fn on_data(&mut self, data: &str) -> RelayStep {
        if self.done {
            return RelayStep::Hold;
        }
        if data.trim() == "[DONE]" {
            if !self.started {
                return RelayStep::Failed(StreamFailure::DoneBeforeToken);
            }
            self.done = true;
            return RelayStep::Done;
        }
        let mut v: Value = match serde_json::from_str(data) {
            Ok(v @ Value::Object(_)) => v,
            Ok(_) => {
                return RelayStep::Failed(StreamFailure::InvalidFrame(
                    "data frame is not a JSON object".into(),
                ));
            }
            Err(e) => {
                return RelayStep::Failed(StreamFailure::InvalidFrame(format!(
                    "data frame is not JSON: {e}"
                )));
            }
        };
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            return RelayStep::Failed(upstream_error(err));
        }
        let obj = v.as_object_mut().expect("checked object above");
        if let Some(u) = obj.get("usage").filter(|u| u.is_object()) {
            let n = |k: &str| u.get(k).and_then(Value::as_u64);
            self.usage.prompt_tokens = n("prompt_tokens").or(self.usage.prompt_tokens);
            self.usage.completion_tokens = n("completion_tokens").or(self.usage.completion_tokens);
        }
        let usage_only = obj
            .get("choices")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty);
        if usage_only {
            if obj.get("usage").is_some_and(Value::is_object) {
                self.usage_chunk = Some(v);
            }
            return RelayStep::Hold;
        }
        let mut new_tokens = 0u64;
        let mut ends_choice = false;
        if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
            for ch in choices.iter_mut() {
                let Some(ch) = ch.as_object_mut() else {
                    continue;
                };
                let ids = match ch.get("token_ids") {
                    Some(Value::Array(ids)) => {
                        if !ids.iter().all(Value::is_u64) {
                            return RelayStep::Failed(StreamFailure::InvalidFrame(
                                "token_ids must be an array of non-negative integers".into(),
                            ));
                        }
                        ids.len() as u64
                    }
                    Some(Value::Null) | None => 0,
                    Some(_) => {
                        return RelayStep::Failed(StreamFailure::InvalidFrame(
                            "token_ids must be an array".into(),
                        ));
                    }
                };
                // A chunk that carried content carried at least one token, whatever its ids say.
                new_tokens += if ids == 0 && content_bearing(ch) {
                    1
                } else {
                    ids
                };
                ends_choice |= ch.get("finish_reason").is_some_and(|f| !f.is_null());
                if !self.opts.return_token_ids {
                    ch.remove("token_ids");
                    ch.remove("prompt_token_ids");
                }
            }
        }
        if !self.opts.return_token_ids {
            obj.remove("prompt_token_ids");
        }
        self.tokens += new_tokens;
        // Sizes matter only while holding or collecting; a live stream is not re-measured.
        let size = if self.opts.collect || !self.started {
            v.to_string().len() as u64
        } else {
            0
        };
        if self.opts.collect {
            self.collected_bytes += size;
            if self.collected_bytes > self.opts.max_response_bytes {
                return RelayStep::Failed(StreamFailure::ResponseLimit);
            }
        }
        if self.started {
            return RelayStep::Output(vec![v]);
        }
        self.held_bytes += size;
        self.held.push(v);
        if new_tokens > 0 || ends_choice {
            self.started = true;
            return RelayStep::Output(std::mem::take(&mut self.held));
        }
        if self.held.len() > MAX_HELD_FRAMES || self.held_bytes > self.opts.max_response_bytes {
            return RelayStep::Failed(StreamFailure::ResponseLimit);
        }
        RelayStep::Hold
    }

    /// The upstream body ended (cleanly at the transport level).
    pub fn on_end(&mut self) -> RelayStep {
        if self.done {
            RelayStep::Done
        } else {
            RelayStep::Failed(StreamFailure::EndedWithoutDone)
        }
    }
}

/// An engine's `{"error": {...}}` object (in a stream, or as a 200 answer): status from
/// `error.code` when it is 400–599, else 500; the message, never empty.
pub fn upstream_error(err: &Value) -> StreamFailure {
    let status = err
        .get("code")
        .and_then(|c| {
            c.as_u64()
                .or_else(|| c.as_str().and_then(|s| s.parse().ok()))
        })
        .filter(|c| (400..=599).contains(c))
        .unwrap_or(500) as u16;
    let message = err
        .get("message")
        .and_then(Value::as_str)
        .filter(|m| !m.trim().is_empty())
        .map(str::to_string)
        .unwrap_or_else(|| match err {
            Value::String(s) if !s.trim().is_empty() => s.clone(),
            _ => format!("the engine reported an error without a message: {err}"),
        });
    StreamFailure::UpstreamError { status, message }
}

/// Whether a choice carries generated content: completions `text`, or a chat `delta` with
/// `content`, `reasoning_content`/`reasoning` (reasoning parsers), `tool_calls` or the legacy
/// `function_call`.
fn content_bearing(choice: &Map<String, Value>) -> bool {
    let nonempty = |v: Option<&Value>| match v {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        _ => false,
    };
    match choice.get("delta") {
        Some(d) => [
            "content",
            "reasoning_content",
            "reasoning",
            "tool_calls",
            "function_call",
        ]
        .iter()
        .any(|k| nonempty(d.get(*k))),
        None => nonempty(choice.get("text")),
    }
}

/// One SSE frame `data: <compact json>\n\n`.
pub fn data_frame(v: &Value) -> Bytes {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(b"data: ");
    // Writing a `Value` into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, v);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The terminating `data: [DONE]\n\n` frame.
pub fn done_frame() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// The single final frame after output started (reference-notes 1.9):
/// `data: {"error":{"message":<public>,"type":<phase>,"code":"failed"|"expired"}}`, no `[DONE]`.
pub fn error_frame(message: &str, phase: &str, code: &str) -> Bytes {
    data_frame(&json!({"error": {"message": message, "type": phase, "code": code}}))
}

/// The `usage` object an answer carries: the engine's own `usage` when it gave one (verbatim,
/// with any details it added; a missing `total_tokens` is filled in, a missing
/// `prompt_tokens` estimated and marked), else the router's estimate — `prompt_tokens` from
/// its sizing, `completion_tokens` from the tokens it counted — marked `"estimated": true`.
pub fn usage_value(engine: Option<&Value>, prompt_estimate: u64, counted: u64) -> Value {
    match engine.filter(|u| u.get("completion_tokens").is_some_and(Value::is_u64)) {
        Some(u) => {
            let mut u = u.clone();
            let c = u["completion_tokens"].as_u64().unwrap_or(0);
            let p = match u.get("prompt_tokens").and_then(Value::as_u64) {
                Some(p) => p,
                None => {
                    u["prompt_tokens"] = prompt_estimate.into();
                    u["estimated"] = true.into();
                    prompt_estimate
                }
            };
            if !u.get("total_tokens").is_some_and(Value::is_u64) {
                u["total_tokens"] = (p + c).into();
            }
            u
        }
        None => json!({
            "prompt_tokens": prompt_estimate,
            "completion_tokens": counted,
            "total_tokens": prompt_estimate + counted,
            "estimated": true,
        }),
    }
}

/// The usage of several answers served as one (a fanned-out prompt batch): counts summed,
/// `estimated` when any part was.
pub fn sum_usages<'a>(parts: impl IntoIterator<Item = &'a Value>) -> Value {
    let (mut p, mut c, mut estimated) = (0u64, 0u64, false);
    for u in parts {
        let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
        p += n("prompt_tokens");
        c += n("completion_tokens");
        estimated |= u.get("estimated") == Some(&Value::Bool(true));
    }
    let mut v = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
    if estimated {
        v["estimated"] = Value::Bool(true);
    }
    v
}

/// Shifts every choice index of a chunk or answer by `base` (prompt `base` of a fanned-out
/// batch: its engine answered choice 0) and drops a per-part `usage` (the merged answer
/// carries one usage for the whole batch).
pub fn reindex(v: &mut Value, base: u64) {
    let Some(obj) = v.as_object_mut() else {
        return;
    };
    obj.remove("usage");
    if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
        for ch in choices {
            if let Some(ch) = ch.as_object_mut() {
                let i = ch.get("index").and_then(Value::as_u64).unwrap_or(0);
                ch.insert("index".into(), (base + i).into());
            }
        }
    }
}

/// Cleans a whole (non-streaming) engine answer for the client: the KV descriptor (top level
/// or per choice) is removed, and `token_ids`/`prompt_token_ids` unless the client asked for
/// them.
pub fn sanitize_answer(answer: &mut Value, return_token_ids: bool) {
    let Some(obj) = answer.as_object_mut() else {
        return;
    };
    obj.remove("kv_transfer_params");
    if !return_token_ids {
        obj.remove("prompt_token_ids");
    }
    if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
        for ch in choices.iter_mut().filter_map(Value::as_object_mut) {
            ch.remove("kv_transfer_params");
            if !return_token_ids {
                ch.remove("token_ids");
                ch.remove("prompt_token_ids");
            }
        }
    }
}

/// The SSE chunks a streaming client gets for a whole answer (a prefill that already
/// finished the generation): one chunk per choice carrying its text (completions) or its
/// message as a delta (chat), logprobs and finish reason, with the answer's `id`, `created`
/// and `model`. The answer's `usage` is not included (see [`usage_value`]).
pub fn answer_chunks(answer: &Value, chat: bool) -> Vec<Value> {
    let head = |k: &str| answer.get(k).cloned().unwrap_or(Value::Null);
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let choices = answer
        .get("choices")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    choices
        .iter()
        .map(|ch| {
            let mut c = Map::new();
            c.insert("index".into(), ch.get("index").cloned().unwrap_or(0.into()));
            if chat {
                let mut delta = ch
                    .get("message")
                    .and_then(Value::as_object)
                    .cloned()
                    .unwrap_or_default();
                if let Some(Value::Array(calls)) = delta.get_mut("tool_calls") {
                    for (i, call) in calls.iter_mut().enumerate() {
                        if let Some(o) = call.as_object_mut() {
                            o.entry("index").or_insert(i.into());
                        }
                    }
                }
                c.insert("delta".into(), Value::Object(delta));
            } else {
                c.insert("text".into(), ch.get("text").cloned().unwrap_or("".into()));
            }
            for k in ["logprobs", "finish_reason", "stop_reason", "token_ids"] {
                if let Some(x) = ch.get(k) {
                    c.insert(k.into(), x.clone());
                }
            }
            json!({"id": head("id"), "object": object, "created": head("created"),
                   "model": head("model"), "choices": [c]})
        })
        .collect()
}

/// One choice being reassembled.
#[derive(Debug)]
struct ChoiceAcc {
    index: u64,
    text: String,
    role: Option<String>,
    reasoning_content: String,
    reasoning: String,
    tool_calls: Vec<Value>,
    finish_reason: Value,
    stop_reason: Option<Value>,
    logprobs: Option<Value>,
}

impl ChoiceAcc {
    fn new(index: u64) -> Self {
        ChoiceAcc {
            index,
            text: String::new(),
            role: None,
            reasoning_content: String::new(),
            reasoning: String::new(),
            tool_calls: Vec::new(),
            finish_reason: Value::Null,
            stop_reason: None,
            logprobs: None,
        }
    }
}

/// Reassembles streamed chunks into one non-streaming response object (reference-notes 7.3),
/// one choice per streamed `index`.
#[derive(Debug, Default)]
pub struct Aggregator {
    chat: bool,
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    choices: Vec<ChoiceAcc>,
}

impl Aggregator {
    /// An aggregator for a chat (`chat.completion`) or completions (`text_completion`) response.
    pub fn new(chat: bool) -> Self {
        Aggregator {
            chat,
            ..Default::default()
        }
    }

    /// Merge one relayed chunk.
    pub fn push(&mut self, chunk: &Value) {
        for (k, slot) in [
            ("id", &mut self.id),
            ("created", &mut self.created),
            ("model", &mut self.model),
        ] {
            if slot.is_none() {
                *slot = chunk.get(k).cloned();
            }
        }
        let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
            return;
        };
        for choice in choices {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let pos = match self.choices.iter().position(|c| c.index == index) {
                Some(p) => p,
                None => {
                    self.choices.push(ChoiceAcc::new(index));
                    self.choices.len() - 1
                }
            };
            merge_choice(&mut self.choices[pos], choice, self.chat);
        }
    }

    /// The reassembled object with `usage` as given (see [`usage_value`]); choices in index
    /// order (one empty choice 0 when the stream carried none).
    pub fn finish(mut self, usage: Value) -> Value {
        if self.choices.is_empty() {
            self.choices.push(ChoiceAcc::new(0));
        }
        self.choices.sort_by_key(|c| c.index);
        let chat = self.chat;
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|c| finish_choice(c, chat))
            .collect();
        json!({
            "id": self.id.unwrap_or(Value::Null),
            "created": self.created.unwrap_or(Value::Null),
            "model": self.model.unwrap_or(Value::Null),
            "object": if chat { "chat.completion" } else { "text_completion" },
            "choices": choices,
            "usage": usage,
        })
    }
}

fn merge_choice(acc: &mut ChoiceAcc, choice: &Value, chat: bool) {
    if let Some(fr) = choice.get("finish_reason").filter(|f| !f.is_null()) {
        acc.finish_reason = fr.clone();
    }
    if let Some(sr) = choice.get("stop_reason").filter(|f| !f.is_null()) {
        acc.stop_reason = Some(sr.clone());
    }
    if chat {
        if let Some(d) = choice.get("delta") {
            if let Some(r) = d.get("role").and_then(Value::as_str) {
                acc.role = Some(r.to_string());
            }
            if let Some(c) = d.get("content").and_then(Value::as_str) {
                acc.text.push_str(c);
            }
            if let Some(c) = d.get("reasoning_content").and_then(Value::as_str) {
                acc.reasoning_content.push_str(c);
            }
            if let Some(c) = d.get("reasoning").and_then(Value::as_str) {
                acc.reasoning.push_str(c);
            }
            if let Some(tcs) = d.get("tool_calls").and_then(Value::as_array) {
                for tc in tcs {
                    merge_tool_call(&mut acc.tool_calls, tc);
                }
            }
        }
        if let Some(lp) = choice
            .get("logprobs")
            .and_then(|l| l.get("content"))
            .and_then(Value::as_array)
        {
            let slot = acc.logprobs.get_or_insert_with(|| json!({"content": []}));
            if let Some(a) = slot.get_mut("content").and_then(Value::as_array_mut) {
                a.extend(lp.iter().cloned());
            }
        }
    } else {
        if let Some(t) = choice.get("text").and_then(Value::as_str) {
            acc.text.push_str(t);
        }
        if let Some(lp) = choice.get("logprobs").and_then(Value::as_object) {
            let slot = acc.logprobs.get_or_insert_with(|| json!({}));
            let slot = slot.as_object_mut().expect("object literal");
            for (k, v) in lp {
                match (slot.get_mut(k), v) {
                    (Some(Value::Array(a)), Value::Array(b)) => a.extend(b.iter().cloned()),
                    (None, v) => {
                        slot.insert(k.clone(), v.clone());
                    }
                    _ => {}
                }
            }
        }
    }
}

fn merge_tool_call(calls: &mut Vec<Value>, tc: &Value) {
    let index = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
    let pos = calls
        .iter()
        .position(|t| t.get("index").and_then(Value::as_u64).unwrap_or(0) == index);
    match pos {
        None => calls.push(tc.clone()),
        Some(p) => {
            let cur = &mut calls[p];
            if let Some(args) = tc.pointer("/function/arguments").and_then(Value::as_str)
                && let Some(Value::String(s)) = cur.pointer_mut("/function/arguments")
            {
                s.push_str(args);
            }
            for k in ["id", "type"] {
                if cur.get(k).is_none_or(Value::is_null)
                    && let Some(v) = tc.get(k)
                {
                    cur[k] = v.clone();
                }
            }
        }
    }
}

fn finish_choice(c: ChoiceAcc, chat: bool) -> Value {
    let mut choice = Map::new();
    choice.insert("index".into(), c.index.into());
    choice.insert("finish_reason".into(), c.finish_reason);
    if chat {
        let mut msg = Map::new();
        msg.insert(
            "role".into(),
            c.role.unwrap_or_else(|| "assistant".into()).into(),
        );
        msg.insert("content".into(), c.text.into());
        if !c.reasoning_content.is_empty() {
            msg.insert("reasoning_content".into(), c.reasoning_content.into());
        }
        if !c.reasoning.is_empty() {
            msg.insert("reasoning".into(), c.reasoning.into());
        }
        if !c.tool_calls.is_empty() {
            let calls: Vec<Value> = c
                .tool_calls
                .into_iter()
                .map(|mut t| {
                    if let Some(o) = t.as_object_mut() {
                        o.remove("index");
                    }
                    t
                })
                .collect();
            msg.insert("tool_calls".into(), calls.into());
        }
        choice.insert("message".into(), msg.into());
    } else {
        choice.insert("text".into(), c.text.into());
    }
    if let Some(sr) = c.stop_reason {
        choice.insert("stop_reason".into(), sr);
    }
    if let Some(lp) = c.logprobs {
        choice.insert("logprobs".into(), lp);
    }
    Value::Object(choice)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts() -> RelayOptions {
        RelayOptions {
            return_token_ids: false,
            max_response_bytes: 1 << 20,
            collect: false,
        }
    }

    fn chunk(text: &str, ids: &[u64]) -> String {
        json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "text": text, "finish_reason": null, "token_ids": ids}]})
        .to_string()
    }

    fn stream_text(eol: &str) -> (String, Vec<String>) {
        let payloads = vec![
            chunk("", &[]),
            chunk(" t0", &[5]),
            chunk(" t1", &[6, 7]),
            json!({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}).to_string(),
            "[DONE]".to_string(),
        ];
        let mut s = format!(": keepalive{eol}{eol}");
        for p in &payloads {
            s.push_str(&format!("data: {p}{eol}{eol}"));
        }
        (s, payloads)
    }

    #[test]
    fn parser_handles_multiline_data_and_comments() {
        let mut p = SseParser::new();
        let ev = p.push(b": hi\ndata: a\ndata:b\nevent: x\n\ndata: c\r\n\r\n");
        assert_eq!(ev, vec![SseData("a\nb".into()), SseData("c".into())]);
        // A bare CR terminates a line too.
        let ev = p.push(b"data: d\r\r");
        assert_eq!(ev, vec![SseData("d".into())]);
    }

    #[test]
    fn an_endless_line_or_event_overflows_instead_of_growing() {
        let mut p = SseParser::new();
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..(MAX_SSE_EVENT_BYTES / chunk.len() + 1) {
            assert!(p.push(&chunk).is_empty());
        }
        assert!(p.overflowed());
        assert!(p.line.len() <= MAX_SSE_EVENT_BYTES);
        let mut q = SseParser::new();
        let line = format!("data: {}\n", "y".repeat(64 * 1024));
        for _ in 0..(MAX_SSE_EVENT_BYTES / line.len() + 2) {
            q.push(line.as_bytes());
        }
        assert!(q.overflowed());
    }

    #[test]
    fn unterminated_event_is_discarded_at_end() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: partial").is_empty());
        p.finish();
        assert!(p.push(b"\n\n").is_empty());
    }

    /// Where to cut a stream of `len` bytes: at every byte (`one_byte`), else at `cuts`
    /// (modulo the length); sorted, with both ends.
    fn split_points(len: usize, cuts: Vec<usize>, one_byte: bool) -> Vec<usize> {
        let mut points: Vec<usize> = if one_byte {
            (0..=len).collect()
        } else {
            cuts.into_iter().map(|c| c % (len + 1)).collect()
        };
        points.push(0);
        points.push(len);
        points.sort_unstable();
        points.dedup();
        points
    }

    proptest! {
        /// Any split of the upstream bytes (incl. 1-byte fragments and \r\n) yields the same
        /// events as the whole stream at once.
        #[test]
        fn parser_is_fragmentation_invariant(
            cuts in proptest::collection::vec(0usize..2000, 0..40),
            crlf in any::<bool>(),
            one_byte in any::<bool>(),
        ) {
            let (text, payloads) = stream_text(if crlf { "\r\n" } else { "\n" });
            let bytes = text.as_bytes();
            let points = split_points(bytes.len(), cuts, one_byte);
            let mut parser = SseParser::new();
            let mut got = Vec::new();
            for w in points.windows(2) {
                got.extend(parser.push(&bytes[w[0]..w[1]]).into_iter().map(|d| d.0));
            }
            prop_assert_eq!(got, payloads);
        }
    }

    proptest! {
        /// Multi-byte UTF-8 (accents, CJK, emoji) split at every byte, or at random points
        /// (inside characters too), through the parser and the relay state: the relayed text
        /// is the engine's, byte for byte, with no replacement characters, and the tokens are
        /// counted from the content-bearing chunks.
        #[test]
        fn multibyte_text_survives_any_split(
            cuts in proptest::collection::vec(0usize..4000, 0..60),
            one_byte in any::<bool>(),
        ) {
            let words = ["héllo", " 世界", " 🦀🦀", " naïve", " ∑x²", " ok"];
            let mut text = String::new();
            for (i, w) in words.iter().enumerate() {
                let c = json!({"choices": [{"index": 0, "text": w, "finish_reason": if i + 1 == words.len() { json!("stop") } else { Value::Null }}]});
                text.push_str(&format!("data: {c}\r\n\r\n"));
            }
            text.push_str("data: [DONE]\n\n");
            let bytes = text.as_bytes();
            let points = split_points(bytes.len(), cuts, one_byte);
            let mut parser = SseParser::new();
            let mut state = StreamState::new(opts());
            let mut got = String::new();
            let mut done = false;
            for w in points.windows(2) {
                for ev in parser.push(&bytes[w[0]..w[1]]) {
                    match state.on_data(&ev.0) {
                        RelayStep::Output(chunks) => {
                            for c in chunks {
                                got.push_str(c["choices"][0]["text"].as_str().unwrap());
                            }
                        }
                        RelayStep::Done => done = true,
                        other => prop_assert_eq!(other, RelayStep::Hold),
                    }
                }
            }
            prop_assert!(done);
            prop_assert_eq!(got, words.concat());
            prop_assert_eq!(state.tokens(), words.len() as u64);
        }
    }

    #[test]
    fn holds_until_first_token_then_flushes_and_strips_token_ids() {
        let mut s = StreamState::new(opts());
        assert_eq!(s.on_data(&chunk("", &[])), RelayStep::Hold);
        assert!(!s.started());
        let RelayStep::Output(out) = s.on_data(&chunk(" t0", &[5])) else {
            panic!()
        };
        assert_eq!(out.len(), 2, "held chunk flushed with the first token");
        assert!(
            out.iter()
                .all(|c| c["choices"][0].get("token_ids").is_none())
        );
        assert!(s.started());
        let RelayStep::Output(out) = s.on_data(&chunk(" t1", &[6, 7])) else {
            panic!()
        };
        assert_eq!(out.len(), 1);
        assert_eq!(s.tokens(), 3);
        // usage-only chunk is dropped unless asked for, but its prompt_tokens are kept
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 9}}).to_string();
        assert_eq!(s.on_data(&usage), RelayStep::Hold);
        assert_eq!(s.prompt_tokens(), Some(9));
        assert_eq!(s.on_data("[DONE]"), RelayStep::Done);
        assert_eq!(s.on_end(), RelayStep::Done);
    }

    #[test]
    fn token_ids_kept_when_client_asked_and_the_usage_chunk_is_held_for_the_server() {
        let mut s = StreamState::new(RelayOptions {
            return_token_ids: true,
            ..opts()
        });
        let RelayStep::Output(out) = s.on_data(&chunk(" t0", &[5])) else {
            panic!()
        };
        assert_eq!(out[0]["choices"][0]["token_ids"], json!([5]));
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}});
        assert_eq!(s.on_data(&usage.to_string()), RelayStep::Hold);
        assert_eq!(s.take_usage_chunk(), Some(usage));
        assert_eq!(
            s.engine_usage(),
            EngineUsage {
                prompt_tokens: Some(9),
                completion_tokens: Some(4)
            }
        );
        assert_eq!(s.tokens(), 1);
        assert_eq!(
            s.output_tokens(),
            4,
            "the engine's count is the better evidence"
        );
        // Usage inside a content chunk only (no usage-only chunk) is the engine's too.
        let mut s = StreamState::new(opts());
        let c = json!({"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 1}});
        assert!(matches!(s.on_data(&c.to_string()), RelayStep::Output(_)));
        assert_eq!(s.take_usage_chunk(), None);
        assert_eq!(
            usage_value(s.engine_usage_value().as_ref(), 3, 1),
            json!({"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6})
        );
    }

    #[test]
    fn failures_before_and_after_output() {
        let mut s = StreamState::new(opts());
        assert_eq!(
            s.on_data("[DONE]"),
            RelayStep::Failed(StreamFailure::DoneBeforeToken)
        );
        let mut s = StreamState::new(opts());
        s.on_data(&chunk(" t0", &[5]));
        assert_eq!(
            s.on_end(),
            RelayStep::Failed(StreamFailure::EndedWithoutDone)
        );
        let mut s = StreamState::new(opts());
        let e = json!({"error": {"message": "boom", "type": "x", "code": 503}}).to_string();
        assert_eq!(
            s.on_data(&e),
            RelayStep::Failed(StreamFailure::UpstreamError {
                status: 503,
                message: "boom".into()
            })
        );
        let e = json!({"error": {"message": "boom", "code": "weird"}}).to_string();
        assert!(matches!(
            StreamState::new(opts()).on_data(&e),
            RelayStep::Failed(StreamFailure::UpstreamError { status: 500, .. })
        ));
        assert!(matches!(
            StreamState::new(opts()).on_data("not json"),
            RelayStep::Failed(StreamFailure::InvalidFrame(_))
        ));
    }

    #[test]
    fn held_frame_limit() {
        let mut s = StreamState::new(opts());
        for _ in 0..MAX_HELD_FRAMES {
            assert_eq!(s.on_data(&chunk("", &[])), RelayStep::Hold);
        }
        assert_eq!(
            s.on_data(&chunk("", &[])),
            RelayStep::Failed(StreamFailure::ResponseLimit)
        );
    }

    #[test]
    fn collected_responses_are_capped() {
        let mut s = StreamState::new(RelayOptions {
            collect: true,
            max_response_bytes: 300,
            ..opts()
        });
        assert!(matches!(
            s.on_data(&chunk(" t0", &[5])),
            RelayStep::Output(_)
        ));
        let mut last = RelayStep::Hold;
        for _ in 0..5 {
            last = s.on_data(&chunk(" t1", &[6]));
        }
        assert_eq!(last, RelayStep::Failed(StreamFailure::ResponseLimit));
    }

    /// Engines without `token_ids` (llama.cpp, TGI, older vLLM, SGLang chat): every
    /// content-bearing delta counts, whatever kind of content it carries, so a stream that
    /// carried content is never "empty" (issue 10 section 2).
    #[test]
    fn content_bearing_chunks_count_without_token_ids() {
        let role =
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]});
        let cases = [
            json!({"choices": [{"index": 0, "delta": {"content": "hi"}}]}),
            json!({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}),
            json!({"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}),
            json!({"choices": [{"index": 0, "text": " t0", "logprobs": null, "finish_reason": null}]}),
        ];
        for c in cases {
            let mut s = StreamState::new(opts());
            assert_eq!(s.on_data(&role.to_string()), RelayStep::Hold);
            assert!(
                matches!(s.on_data(&c.to_string()), RelayStep::Output(ref o) if o.len() == 2),
                "{c}"
            );
            assert_eq!(s.tokens(), 1, "{c}");
            assert_eq!(s.on_data("[DONE]"), RelayStep::Done, "{c}");
        }
        // `token_ids: []` beside content: the content is the evidence.
        let mut s = StreamState::new(opts());
        let c = json!({"choices": [{"index": 0, "text": "x", "token_ids": []}]});
        assert!(matches!(s.on_data(&c.to_string()), RelayStep::Output(_)));
        assert_eq!(s.tokens(), 1);
        // No content, no ids, no finish: still held.
        let mut s = StreamState::new(opts());
        let empty = json!({"choices": [{"index": 0, "text": "", "finish_reason": null}]});
        assert_eq!(s.on_data(&empty.to_string()), RelayStep::Hold);
        assert_eq!(
            s.on_data("[DONE]"),
            RelayStep::Failed(StreamFailure::DoneBeforeToken)
        );
    }

    /// A generation that ends on its first step (EOS, a stop string) streams a choice with an
    /// empty text and a finish reason: that is an answer, not an empty stream.
    #[test]
    fn a_finish_reason_starts_output_even_without_text() {
        let mut s = StreamState::new(opts());
        let fin = json!({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]});
        assert!(matches!(s.on_data(&fin.to_string()), RelayStep::Output(_)));
        assert_eq!(s.tokens(), 0);
        assert_eq!(s.on_data("[DONE]"), RelayStep::Done);
    }

    #[test]
    fn usage_is_the_engines_or_marked_estimated() {
        let engine = json!({"prompt_tokens": 13, "completion_tokens": 8, "total_tokens": 21,
                            "prompt_tokens_details": null});
        assert_eq!(usage_value(Some(&engine), 3, 7), engine);
        assert_eq!(
            usage_value(None, 3, 7),
            json!({"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10, "estimated": true})
        );
        assert_eq!(
            usage_value(Some(&json!({"prompt_tokens": 2})), 3, 7)["estimated"],
            true,
            "a usage without completion_tokens is no count"
        );
        assert_eq!(
            usage_value(
                Some(&json!({"prompt_tokens": 2, "completion_tokens": 5})),
                3,
                7
            ),
            json!({"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7})
        );
        assert_eq!(
            usage_value(Some(&json!({"completion_tokens": 5})), 3, 7),
            json!({"completion_tokens": 5, "prompt_tokens": 3, "estimated": true, "total_tokens": 8})
        );
        let sum = sum_usages([&engine, &usage_value(None, 3, 7)]);
        assert_eq!(
            sum,
            json!({"prompt_tokens": 16, "completion_tokens": 15, "total_tokens": 31, "estimated": true})
        );
        assert!(sum_usages([&engine, &engine]).get("estimated").is_none());
    }

    #[test]
    fn whole_answers_are_cleaned_reindexed_and_streamable() {
        let mut a = json!({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
            "choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": null,
                         "logprobs": null, "token_ids": [2], "kv_transfer_params": null}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "kv_transfer_params": null});
        sanitize_answer(&mut a, false);
        assert!(a.get("kv_transfer_params").is_none());
        assert!(a["choices"][0].get("token_ids").is_none());
        assert!(a["choices"][0].get("kv_transfer_params").is_none());
        let chunks = answer_chunks(&a, false);
        assert_eq!(chunks.len(), 1);
        assert_eq!(chunks[0]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[0]["choices"][0]["text"], "");
        assert_eq!(chunks[0]["object"], "text_completion");
        // Streamed, the chunk is output (it ends a choice).
        let mut s = StreamState::new(opts());
        assert!(matches!(
            s.on_data(&chunks[0].to_string()),
            RelayStep::Output(_)
        ));
        reindex(&mut a, 2);
        assert_eq!(a["choices"][0]["index"], 2);
        assert!(a.get("usage").is_none());

        let chat = json!({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "ok",
                        "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            "finish_reason": "tool_calls"}]});
        let chunks = answer_chunks(&chat, true);
        assert_eq!(chunks[0]["object"], "chat.completion.chunk");
        assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "ok");
        assert_eq!(
            chunks[0]["choices"][0]["delta"]["tool_calls"][0]["index"],
            0
        );
        let mut agg = Aggregator::new(true);
        agg.push(&chunks[0]);
        let back = agg.finish(json!({}));
        assert_eq!(
            back["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "f"
        );
        assert_eq!(back["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn aggregator_rebuilds_completion_and_chat() {
        let mut a = Aggregator::new(false);
        for (t, fr) in [(" t0", Value::Null), (" t1", json!("length"))] {
            a.push(&json!({"id": "cmpl-1", "created": 5, "model": "m", "choices": [{"index": 0, "text": t, "finish_reason": fr}]}));
        }
        let usage = json!({"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11});
        let v = a.finish(usage.clone());
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " t0 t1");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"], usage);

        let mut a = Aggregator::new(true);
        a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}));
        a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"reasoning": "hm", "content": " t0"}}]}));
        a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "x", "function": {"name": "f", "arguments": "{\"a\""}}]}}]}));
        a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}));
        let v = a.finish(json!({}));
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], " t0");
        assert_eq!(v["choices"][0]["message"]["reasoning"], "hm");
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    }

    /// An engine that serves a batch interleaves its choices by `index`: each becomes its own
    /// choice, in index order, never one merged text (issue 9 section 6).
    #[test]
    fn aggregator_keeps_interleaved_choices_apart() {
        let mut a = Aggregator::new(false);
        for (i, t) in [(1, "b0"), (0, "a0"), (1, "b1"), (0, "a1")] {
            a.push(
                &json!({"id": "x", "choices": [{"index": i, "text": t, "finish_reason": null}]}),
            );
        }
        a.push(&json!({"id": "x", "choices": [
            {"index": 0, "text": "", "finish_reason": "length"},
            {"index": 1, "text": "", "finish_reason": "stop"}]}));
        let v = a.finish(json!({}));
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2);
        assert_eq!(
            (choices[0]["index"].clone(), choices[0]["text"].clone()),
            (json!(0), json!("a0a1"))
        );
        assert_eq!(
            (choices[1]["index"].clone(), choices[1]["text"].clone()),
            (json!(1), json!("b0b1"))
        );
        assert_eq!(choices[1]["finish_reason"], "stop");
    }

    #[test]
    fn error_frame_shape() {
        let f = error_frame("Upstream request failed", "decode", "failed");
        assert_eq!(
            &f[..],
            b"data: {\"error\":{\"message\":\"Upstream request failed\",\"type\":\"decode\",\"code\":\"failed\"}}\n\n"
        );
    }
}
