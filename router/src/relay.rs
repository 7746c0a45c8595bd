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
//! still be answered with an HTTP status and retried. Tokens are counted from `token_ids`
//! lengths (or one per content-bearing chunk where the engine cannot return ids: SGLang chat).

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
    /// The client asked `stream_options.include_usage`: forward the usage-only chunk.
    pub include_usage: bool,
    /// Count one token per content-bearing chunk when chunks carry no `token_ids` (SGLang chat).
    pub count_content_chunks: bool,
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
    /// `[DONE]` arrived before any token.
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
            StreamFailure::DoneBeforeToken => "[DONE] before any token".into(),
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
    /// `[DONE]` after at least one token: the stream completed.
    Done,
    /// The leg failed.
    Failed(StreamFailure),
}

/// Per-leg relay state (one per decode attempt).
#[derive(Debug)]
pub struct StreamState {
    opts: RelayOptions,
    held: Vec<Value>,
    held_bytes: u64,
    collected_bytes: u64,
    started: bool,
    done: bool,
    tokens: u64,
    prompt_tokens: Option<u64>,
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
            prompt_tokens: None,
        }
    }

    /// Has output (the first token) started?
    pub fn started(&self) -> bool {
        self.started
    }

    /// Tokens counted so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// `usage.prompt_tokens` reported by the engine, if any.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.prompt_tokens
    }

    /// Feed one SSE data payload.
    pub fn on_data(&mut self, data: &str) -> RelayStep {
        if self.done {
            return RelayStep::Hold;
        }
        if data.trim() == "[DONE]" {
            if self.tokens == 0 {
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
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            return RelayStep::Failed(StreamFailure::UpstreamError { status, message });
        }
        let obj = v.as_object_mut().expect("checked object above");
        let usage_only = obj
            .get("choices")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty);
        if let Some(p) = obj
            .get("usage")
            .and_then(|u| u.get("prompt_tokens"))
            .and_then(Value::as_u64)
        {
            self.prompt_tokens = Some(p);
        }
        let mut new_tokens = 0u64;
        if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
            for ch in choices.iter_mut() {
                let Some(ch) = ch.as_object_mut() else {
                    continue;
                };
                match ch.get("token_ids") {
                    Some(Value::Array(ids)) => {
                        if !ids.iter().all(Value::is_u64) {
                            return RelayStep::Failed(StreamFailure::InvalidFrame(
                                "token_ids must be an array of non-negative integers".into(),
                            ));
                        }
                        new_tokens += ids.len() as u64;
                    }
                    Some(Value::Null) | None => {
                        if self.opts.count_content_chunks && content_bearing(ch) {
                            new_tokens += 1;
                        }
                    }
                    Some(_) => {
                        return RelayStep::Failed(StreamFailure::InvalidFrame(
                            "token_ids must be an array".into(),
                        ));
                    }
                }
                if !self.opts.return_token_ids {
                    ch.remove("token_ids");
                    ch.remove("prompt_token_ids");
                }
            }
        }
        if !self.opts.return_token_ids {
            obj.remove("prompt_token_ids");
        }
        if usage_only && !self.opts.include_usage {
            return RelayStep::Hold;
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
        if self.tokens > 0 {
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

fn content_bearing(choice: &Map<String, Value>) -> bool {
    let nonempty = |v: Option<&Value>| match v {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        _ => false,
    };
    match choice.get("delta") {
        Some(d) => {
            nonempty(d.get("content"))
                || nonempty(d.get("reasoning_content"))
                || nonempty(d.get("tool_calls"))
        }
        None => nonempty(choice.get("text")),
    }
}

/// One SSE frame `data: <compact json>\n\n`.
pub fn data_frame(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
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

/// Reassembles streamed chunks into one non-streaming response object (reference-notes 7.3).
#[derive(Debug, Default)]
pub struct Aggregator {
    chat: bool,
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    text: String,
    role: Option<String>,
    reasoning: String,
    tool_calls: Vec<Value>,
    finish_reason: Value,
    stop_reason: Option<Value>,
    logprobs: Option<Value>,
}

impl Aggregator {
    /// An aggregator for a chat (`chat.completion`) or completions (`text_completion`) response.
    pub fn new(chat: bool) -> Self {
        Aggregator {
            chat,
            finish_reason: Value::Null,
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
        let Some(choice) = chunk
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return;
        };
        if let Some(fr) = choice.get("finish_reason").filter(|f| !f.is_null()) {
            self.finish_reason = fr.clone();
        }
        if let Some(sr) = choice.get("stop_reason").filter(|f| !f.is_null()) {
            self.stop_reason = Some(sr.clone());
        }
        if self.chat {
            if let Some(d) = choice.get("delta") {
                if let Some(r) = d.get("role").and_then(Value::as_str) {
                    self.role = Some(r.to_string());
                }
                if let Some(c) = d.get("content").and_then(Value::as_str) {
                    self.text.push_str(c);
                }
                if let Some(c) = d.get("reasoning_content").and_then(Value::as_str) {
                    self.reasoning.push_str(c);
                }
                if let Some(tcs) = d.get("tool_calls").and_then(Value::as_array) {
                    for tc in tcs {
                        self.merge_tool_call(tc);
                    }
                }
            }
            if let Some(lp) = choice
                .get("logprobs")
                .and_then(|l| l.get("content"))
                .and_then(Value::as_array)
            {
                let acc = self.logprobs.get_or_insert_with(|| json!({"content": []}));
                if let Some(a) = acc.get_mut("content").and_then(Value::as_array_mut) {
                    a.extend(lp.iter().cloned());
                }
            }
        } else {
            if let Some(t) = choice.get("text").and_then(Value::as_str) {
                self.text.push_str(t);
            }
            if let Some(lp) = choice.get("logprobs").and_then(Value::as_object) {
                let acc = self.logprobs.get_or_insert_with(|| json!({}));
                let acc = acc.as_object_mut().expect("object literal");
                for (k, v) in lp {
                    match (acc.get_mut(k), v) {
                        (Some(Value::Array(a)), Value::Array(b)) => a.extend(b.iter().cloned()),
                        (None, v) => {
                            acc.insert(k.clone(), v.clone());
                        }
                        _ => {}
                    }
                }
            }
        }
    }

    fn merge_tool_call(&mut self, tc: &Value) {
        let index = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
        let pos = self
            .tool_calls
            .iter()
            .position(|t| t.get("index").and_then(Value::as_u64).unwrap_or(0) == index);
        match pos {
            None => self.tool_calls.push(tc.clone()),
            Some(p) => {
                let cur = &mut self.tool_calls[p];
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

    /// The reassembled object with `usage` (`prompt_tokens` given by the caller, the engine's
    /// when known; `completion_tokens` = counted tokens).
    pub fn finish(self, prompt_tokens: u64, completion_tokens: u64) -> Value {
        let mut choice = Map::new();
        choice.insert("index".into(), 0.into());
        choice.insert("finish_reason".into(), self.finish_reason);
        if self.chat {
            let mut msg = Map::new();
            msg.insert(
                "role".into(),
                self.role.unwrap_or_else(|| "assistant".into()).into(),
            );
            msg.insert("content".into(), self.text.into());
            if !self.reasoning.is_empty() {
                msg.insert("reasoning_content".into(), self.reasoning.into());
            }
            if !self.tool_calls.is_empty() {
                let calls: Vec<Value> = self
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
            choice.insert("text".into(), self.text.into());
        }
        if let Some(sr) = self.stop_reason {
            choice.insert("stop_reason".into(), sr);
        }
        if let Some(lp) = self.logprobs {
            choice.insert("logprobs".into(), lp);
        }
        json!({
            "id": self.id.unwrap_or(Value::Null),
            "created": self.created.unwrap_or(Value::Null),
            "model": self.model.unwrap_or(Value::Null),
            "object": if self.chat { "chat.completion" } else { "text_completion" },
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts() -> RelayOptions {
        RelayOptions {
            return_token_ids: false,
            include_usage: false,
            count_content_chunks: false,
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
            let mut points: Vec<usize> = if one_byte {
                (0..=bytes.len()).collect()
            } else {
                let mut p: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
                p.push(0);
                p.push(bytes.len());
                p
            };
            points.sort_unstable();
            points.dedup();
            let mut parser = SseParser::new();
            let mut got = Vec::new();
            for w in points.windows(2) {
                got.extend(parser.push(&bytes[w[0]..w[1]]).into_iter().map(|d| d.0));
            }
            prop_assert_eq!(got, payloads);
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
    fn token_ids_and_usage_kept_when_client_asked() {
        let mut s = StreamState::new(RelayOptions {
            return_token_ids: true,
            include_usage: true,
            ..opts()
        });
        let RelayStep::Output(out) = s.on_data(&chunk(" t0", &[5])) else {
            panic!()
        };
        assert_eq!(out[0]["choices"][0]["token_ids"], json!([5]));
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 9}}).to_string();
        assert!(matches!(s.on_data(&usage), RelayStep::Output(_)));
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

    #[test]
    fn sglang_chat_counts_content_chunks() {
        let mut s = StreamState::new(RelayOptions {
            count_content_chunks: true,
            ..opts()
        });
        let role =
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                .to_string();
        assert_eq!(s.on_data(&role), RelayStep::Hold);
        let c = json!({"choices": [{"index": 0, "delta": {"content": "hi"}}]}).to_string();
        assert!(matches!(s.on_data(&c), RelayStep::Output(_)));
        assert_eq!(s.tokens(), 1);
    }

    #[test]
    fn aggregator_rebuilds_completion_and_chat() {
        let mut a = Aggregator::new(false);
        for (t, fr) in [(" t0", Value::Null), (" t1", json!("length"))] {
            a.push(&json!({"id": "cmpl-1", "created": 5, "model": "m", "choices": [{"index": 0, "text": t, "finish_reason": fr}]}));
        }
        let v = a.finish(9, 2);
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " t0 t1");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11})
        );

        let mut a = Aggregator::new(true);
        a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}));
        a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"content": " t0"}}]}));
        a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "x", "function": {"name": "f", "arguments": "{\"a\""}}]}}]}));
        a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}));
        let v = a.finish(3, 3);
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], " t0");
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
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
