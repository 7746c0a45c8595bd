//! Streaming relay, sans-IO (behaviour.md 7.3; architecture.md section 5), byte level
//! (docs/benchmarks.md).
//!
//! ```text
//!  upstream body bytes ──SseParser::feed──► data payloads ──StreamState::on_data──► RelayStep
//!      (any fragmentation, \n \r\n \r)        (comments dropped)   Hold | Output | Done | Failed
//!  StreamState::take_output ──► "data: <the engine's JSON>\n\n" ... (a streaming client's bytes)
//!                           └─► Aggregator::push_frames ──► one text_completion / chat.completion
//! ```
//!
//! Each frame is scanned once ([`crate::rawjson`]) for the few members the router needs
//! (token evidence, `finish_reason`, `usage`, an `error`), and the engine's bytes are
//! forwarded untouched but for the members the client did not ask for (`token_ids`,
//! `prompt_token_ids`) and, for prompt `k` of a fanned-out batch, the choice indexes; no
//! `serde_json::Value` is built per frame.
//!
//! Nothing is sent to the client before the first token-bearing chunk: earlier data chunks are
//! held (at most [`MAX_HELD_FRAMES`] and `max_response_bytes`), so a failure before output can
//! still be answered with an HTTP status and retried. Tokens are counted from the engine's
//! `usage`, else `token_ids` lengths, else one per content-bearing chunk (any
//! OpenAI-compatible engine: llama.cpp, TGI, SGLang chat send no ids); see [`StreamState`].
//! Usage-only chunks are held back for the serving layer, which forwards the engine's, merges
//! a fanned-out batch's or estimates one ([`usage_value`], [`sum_usages`]).

use std::borrow::Cow;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value, json};

use crate::rawjson::{Cursor, Edit, Keep, Member, Repl, ScanError, apply, decode_key};

/// Data frames held before the first token (behaviour.md 7.3).
pub const MAX_HELD_FRAMES: usize = 64;

/// One dispatched SSE event's `data` payload (multi-line data joined by `\n`), as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseData(pub String);

/// Incremental SSE parser (WHATWG event-stream rules): lines end with `\n`, `\r\n` or `\r`; a
/// blank line dispatches the event; `:` lines are comments; only the `data` field is kept.
/// Works on bytes: a line is found with `memchr`, and an event's data is handed out as a
/// slice of a buffer the parser reuses.
#[derive(Debug, Default)]
pub struct SseParser {
    /// The unfinished line carried over from the previous bytes.
    line: Vec<u8>,
    pending_cr: bool,
    data: Vec<u8>,
    has_data: bool,
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

    /// Feeds the next upstream bytes: `on_event` gets each event's data completed by them, in
    /// order, and returns whether to go on. Returns the bytes consumed: all of them, or fewer
    /// when `on_event` stopped the parser (the rest is to be fed again later).
    pub fn feed(&mut self, bytes: &[u8], mut on_event: impl FnMut(&[u8]) -> bool) -> usize {
        let mut i = 0;
        while i < bytes.len() {
            if self.pending_cr {
                self.pending_cr = false;
                if bytes[i] == b'\n' {
                    i += 1;
                    continue;
                }
            }
            let Some(k) = memchr::memchr2(b'\n', b'\r', &bytes[i..]) else {
                self.carry(&bytes[i..]);
                return bytes.len();
            };
            let end = i + k;
            self.pending_cr = bytes[end] == b'\r';
            let go_on = if self.line.is_empty() {
                if k > MAX_SSE_EVENT_BYTES {
                    self.overflowed = true;
                    true
                } else {
                    self.end_line(&bytes[i..end], &mut on_event)
                }
            } else {
                self.carry(&bytes[i..end]);
                let line = std::mem::take(&mut self.line);
                let go_on = self.end_line(&line, &mut on_event);
                self.line = line;
                self.line.clear();
                go_on
            };
            i = end + 1;
            if !go_on {
                return i;
            }
        }
        i
    }

    /// Feeds bytes and collects the events they complete (tests and tools; the relay uses
    /// [`SseParser::feed`]). Invalid UTF-8 is replaced.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseData> {
        let mut out = Vec::new();
        self.feed(bytes, |d| {
            out.push(SseData(String::from_utf8_lossy(d).into_owned()));
            true
        });
        out
    }

    /// Keeps part of an unfinished line, dropping it once the line is over the limit.
    fn carry(&mut self, part: &[u8]) {
        if self.line.len() + part.len() > MAX_SSE_EVENT_BYTES {
            self.overflowed = true;
            self.line.clear();
            return;
        }
        self.line.extend_from_slice(part);
    }

    /// An upstream line or event exceeded [`MAX_SSE_EVENT_BYTES`]; the stream must fail.
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// The upstream ended. An event not terminated by a blank line is discarded (SSE rules).
    pub fn finish(&mut self) {
        self.line.clear();
        self.data.clear();
        self.has_data = false;
    }

    fn end_line(&mut self, line: &[u8], on_event: &mut impl FnMut(&[u8]) -> bool) -> bool {
        if line.is_empty() {
            if !self.has_data {
                return true;
            }
            self.has_data = false;
            let go_on = on_event(&self.data);
            self.data.clear();
            return go_on;
        }
        if line[0] == b':' {
            return true;
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if !self.has_data {
                self.data.clear();
                self.data.extend_from_slice(value);
                self.has_data = true;
            } else if self.data.len() + value.len() >= MAX_SSE_EVENT_BYTES {
                self.overflowed = true;
                self.has_data = false;
                self.data.clear();
            } else {
                self.data.push(b'\n');
                self.data.extend_from_slice(value);
            }
        }
        true
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
    /// Prompt `k` of a fanned-out batch streamed to its client: every choice index is
    /// shifted by `k` and a chunk's `usage` dropped (the router writes one for the batch).
    pub index_base: Option<u64>,
    /// Keep the first chunk's `id`, `created` and `model` ([`StreamState::head`]) for a
    /// usage chunk the router writes itself.
    pub capture_head: bool,
}

impl RelayOptions {
    /// Options for a client that asked nothing special: `token_ids` stripped, no batch.
    pub fn new(max_response_bytes: u64, collect: bool) -> Self {
        RelayOptions {
            return_token_ids: false,
            max_response_bytes,
            collect,
            index_base: None,
            capture_head: false,
        }
    }
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
    /// Frames are ready ([`StreamState::take_output`]; the first `Output` of a stream
    /// includes every held frame).
    Output,
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

/// The first relayed chunk's `id`, `created` and `model`, as the engine wrote them (raw
/// JSON; `null` when absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// `id`.
    pub id: String,
    /// `created`.
    pub created: String,
    /// `model`.
    pub model: String,
}

impl Head {
    /// The head of a chunk given as a `Value`.
    pub fn of(chunk: &Value) -> Head {
        let raw = |k: &str| chunk.get(k).unwrap_or(&Value::Null).to_string();
        Head {
            id: raw("id"),
            created: raw("created"),
            model: raw("model"),
        }
    }
}

/// What one scan of a content frame found (the old `Value` rules, gathered in one pass).
#[derive(Debug, Default)]
struct Facts {
    /// A non-null top-level `error`.
    error: Option<Range<usize>>,
    /// A `usage` object: its prompt and completion counts.
    usage: Option<(Option<u64>, Option<u64>)>,
    /// Elements of a `choices` array (`None`: no array).
    choices: Option<usize>,
    new_tokens: u64,
    ends_choice: bool,
    /// The first malformed `token_ids` of a choice.
    bad_ids: Option<&'static str>,
    head: [Option<Range<usize>>; 3],
}

/// What one choice of a frame carried.
#[derive(Debug, Default)]
struct ChoiceFacts {
    /// `token_ids`: its length, or why it is malformed (`None`: absent or null).
    ids: Option<Result<u64, &'static str>>,
    text: bool,
    /// `delta` present: which of its content members carry something (bit per
    /// [`DELTA_CONTENT`] entry).
    delta: Option<u8>,
    finish: bool,
    has_index: bool,
    kept: usize,
}

/// The members of a chat `delta` that carry generated content: `content`,
/// `reasoning_content`/`reasoning` (reasoning parsers), `tool_calls`, the legacy
/// `function_call`.
const DELTA_CONTENT: [&[u8]; 5] = [
    b"content",
    b"reasoning_content",
    b"reasoning",
    b"tool_calls",
    b"function_call",
];

/// A member's key as bytes: its raw text, decoded when it has escapes.
fn key_of<'b>(c: &Cursor<'b>, m: &Member) -> Cow<'b, [u8]> {
    if m.escaped {
        Cow::Owned(decode_key(c.bytes(), m).unwrap_or_default().into_bytes())
    } else {
        Cow::Borrowed(&c.bytes()[m.key.clone()])
    }
}

/// Per-leg relay state (one per decode attempt).
///
/// Token evidence, best first: the engine's `usage.completion_tokens`, then `token_ids`
/// lengths (vLLM's `return_token_ids`, SGLang completions), then one token per
/// content-bearing choice delta (text, content, reasoning, tool calls), which every
/// OpenAI-compatible engine sends. Output starts at the first chunk that carries a token or
/// content or ends a choice (`finish_reason`): a generation that ended on its first step is an
/// answer, not an empty stream. Relayed frames are the engine's bytes, minus `token_ids` and
/// `prompt_token_ids` unless the client asked for them (whitespace line breaks inside a
/// frame become spaces, so every frame is one `data:` line).
#[derive(Debug)]
pub struct StreamState {
    opts: RelayOptions,
    /// Frames ready for the client (held ones until output starts).
    out: BytesMut,
    held_frames: usize,
    held_bytes: u64,
    collected_bytes: u64,
    started: bool,
    done: bool,
    tokens: u64,
    usage: EngineUsage,
    usage_chunk: Option<Bytes>,
    head: Option<Head>,
    /// Reused between frames.
    edits: Vec<Edit>,
}

impl StreamState {
    /// Fresh state for one decode leg.
    pub fn new(opts: RelayOptions) -> Self {
        StreamState {
            opts,
            out: BytesMut::new(),
            held_frames: 0,
            held_bytes: 0,
            collected_bytes: 0,
            started: false,
            done: false,
            tokens: 0,
            usage: EngineUsage::default(),
            usage_chunk: None,
            head: None,
            edits: Vec::new(),
        }
    }

    /// Has output (the first token, content or finish reason) started?
    pub fn started(&self) -> bool {
        self.started
    }

    /// Whether output started and frames wait in [`StreamState::take_output`].
    pub fn has_output(&self) -> bool {
        self.started && !self.out.is_empty()
    }

    /// The frames relayed since the last call, as SSE (`data: <json>\n\n` each); empty before
    /// output started (held frames stay held).
    pub fn take_output(&mut self) -> Bytes {
        if !self.started {
            return Bytes::new();
        }
        self.out.split().freeze()
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

    /// The engine's usage-only chunk (`choices: []`), held back from the relayed stream, as
    /// the engine wrote it (the JSON payload): the serving layer forwards it, merges it or
    /// replaces it (see [`usage_value`], [`chunk_usage`]).
    pub fn take_usage_chunk(&mut self) -> Option<Bytes> {
        self.usage_chunk.take()
    }

    /// The first relayed chunk's `id`, `created`, `model` (with
    /// [`RelayOptions::capture_head`]).
    pub fn head(&self) -> Option<&Head> {
        self.head.as_ref()
    }

    /// Feed one SSE data payload.
    pub fn on_data(&mut self, payload: &[u8]) -> RelayStep {
        if self.done {
            return RelayStep::Hold;
        }
        // An engine's invalid UTF-8 is replaced, as a text decoder would.
        let text: Cow<'_, [u8]> = match std::str::from_utf8(payload) {
            Ok(_) => Cow::Borrowed(payload),
            Err(_) => Cow::Owned(String::from_utf8_lossy(payload).into_owned().into_bytes()),
        };
        if text.trim_ascii() == b"[DONE]" {
            if !self.started {
                return RelayStep::Failed(StreamFailure::DoneBeforeToken);
            }
            self.done = true;
            return RelayStep::Done;
        }
        let (facts, edits) = match self.scan(&text) {
            Ok(f) => f,
            Err(failure) => return RelayStep::Failed(failure),
        };
        if let Some(err) = facts.error {
            self.edits = edits;
            let v: Value = serde_json::from_slice(&text[err]).unwrap_or(Value::Null);
            return RelayStep::Failed(upstream_error(&v));
        }
        if let Some((p, c)) = facts.usage {
            self.usage.prompt_tokens = p.or(self.usage.prompt_tokens);
            self.usage.completion_tokens = c.or(self.usage.completion_tokens);
        }
        if facts.choices.is_none_or(|n| n == 0) {
            if facts.usage.is_some() {
                self.usage_chunk = Some(Bytes::copy_from_slice(text.trim_ascii()));
            }
            self.edits = edits;
            return RelayStep::Hold;
        }
        if let Some(msg) = facts.bad_ids {
            self.edits = edits;
            return RelayStep::Failed(StreamFailure::InvalidFrame(msg.into()));
        }
        self.tokens += facts.new_tokens;
        if self.opts.capture_head && self.head.is_none() {
            let raw = |r: &Option<Range<usize>>| {
                r.clone().map_or_else(
                    || "null".to_string(),
                    |r| String::from_utf8_lossy(&text[r]).into_owned(),
                )
            };
            self.head = Some(Head {
                id: raw(&facts.head[0]),
                created: raw(&facts.head[1]),
                model: raw(&facts.head[2]),
            });
        }
        let size = self.emit(&text, &edits);
        self.edits = edits;
        if self.opts.collect {
            self.collected_bytes += size;
            if self.collected_bytes > self.opts.max_response_bytes {
                return RelayStep::Failed(StreamFailure::ResponseLimit);
            }
        }
        if self.started {
            return RelayStep::Output;
        }
        self.held_bytes += size;
        self.held_frames += 1;
        if facts.new_tokens > 0 || facts.ends_choice {
            self.started = true;
            return RelayStep::Output;
        }
        if self.held_frames > MAX_HELD_FRAMES || self.held_bytes > self.opts.max_response_bytes {
            return RelayStep::Failed(StreamFailure::ResponseLimit);
        }
        RelayStep::Hold
    }

    /// Writes `data: <text with edits>\n\n` to the output; returns the JSON's length.
    fn emit(&mut self, text: &[u8], edits: &[Edit]) -> u64 {
        let lead = text.len() - text.trim_ascii_start().len();
        let end = lead + text.trim_ascii().len();
        self.out.extend_from_slice(b"data: ");
        let start = self.out.len();
        apply(text, lead..end, edits, &mut self.out);
        let len = self.out.len() - start;
        // Line breaks can only be whitespace between tokens of valid JSON: spaces keep the
        // frame one `data:` line.
        if memchr::memchr2(b'\n', b'\r', &self.out[start..]).is_some() {
            for b in &mut self.out[start..] {
                if matches!(*b, b'\n' | b'\r') {
                    *b = b' ';
                }
            }
        }
        self.out.extend_from_slice(b"\n\n");
        len as u64
    }

    /// One pass over a content frame: its facts, and the edits the client's options ask for.
    fn scan(&mut self, text: &[u8]) -> Result<(Facts, Vec<Edit>), StreamFailure> {
        let invalid =
            |e: ScanError| StreamFailure::InvalidFrame(format!("data frame is not JSON: {e}"));
        let mut c = Cursor::new(text, std::mem::take(&mut self.edits));
        if c.peek() != Some(b'{') {
            return Err(match c.value().and_then(|_| c.end()) {
                Ok(()) => StreamFailure::InvalidFrame("data frame is not a JSON object".into()),
                Err(e) => invalid(e),
            });
        }
        let strip = !self.opts.return_token_ids;
        let base = self.opts.index_base;
        let head = self.opts.capture_head && self.head.is_none();
        let mut f = Facts::default();
        let walked = c.object(|c, m| {
            let key = key_of(c, m);
            match &*key {
                b"error" => {
                    f.error = if c.null()? { None } else { Some(c.value()?) };
                }
                b"usage" => {
                    f.usage = if c.peek() == Some(b'{') {
                        let (mut p, mut n) = (None, None);
                        c.object(|c, m| {
                            match &*key_of(c, m) {
                                b"prompt_tokens" => p = c.uint()?.1,
                                b"completion_tokens" => n = c.uint()?.1,
                                _ => {
                                    c.value()?;
                                }
                            }
                            Ok(Keep::Yes)
                        })?;
                        Some((p, n))
                    } else {
                        c.value()?;
                        None
                    };
                    if base.is_some() {
                        return Ok(Keep::Drop);
                    }
                }
                b"choices" => {
                    if c.peek() != Some(b'[') {
                        c.value()?;
                        f.choices = None;
                        return Ok(Keep::Yes);
                    }
                    // A repeated `choices`: the last one is the frame's (serde_json's rule).
                    f.new_tokens = 0;
                    f.ends_choice = false;
                    f.bad_ids = None;
                    let mut n = 0;
                    c.array(|c, _| {
                        n += 1;
                        if c.peek() != Some(b'{') {
                            c.value()?;
                            return Ok(());
                        }
                        let ch = scan_choice(c, strip, base)?;
                        let ids = match ch.ids {
                            Some(Ok(n)) => n,
                            Some(Err(msg)) => {
                                f.bad_ids.get_or_insert(msg);
                                0
                            }
                            None => 0,
                        };
                        // A chunk that carried content carried at least one token, whatever its
                        // ids say.
                        let content = match ch.delta {
                            Some(bits) => bits != 0,
                            None => ch.text,
                        };
                        f.new_tokens += if ids == 0 && content { 1 } else { ids };
                        f.ends_choice |= ch.finish;
                        Ok(())
                    })?;
                    f.choices = Some(n);
                }
                b"prompt_token_ids" => {
                    c.value()?;
                    if strip {
                        return Ok(Keep::Drop);
                    }
                }
                k @ (b"id" | b"created" | b"model") if head => {
                    let slot = match k {
                        b"id" => 0,
                        b"created" => 1,
                        _ => 2,
                    };
                    f.head[slot] = Some(c.value()?);
                }
                _ => {
                    c.value()?;
                }
            }
            Ok(Keep::Yes)
        });
        if let Err(e) = walked.and_then(|_| c.end()) {
            self.edits = c.edits;
            return Err(invalid(e));
        }
        Ok((f, c.edits))
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

/// Scans one choice object: its token evidence, and its edits (`token_ids` and
/// `prompt_token_ids` dropped when `strip`; with `base`, its index shifted, or added when it
/// has none).
fn scan_choice(
    c: &mut Cursor<'_>,
    strip: bool,
    base: Option<u64>,
) -> Result<ChoiceFacts, ScanError> {
    let mut ch = ChoiceFacts::default();
    let open = c.pos();
    let at = c.edits.len();
    c.object(|c, m| {
        let key = key_of(c, m);
        let keep = match &*key {
            b"token_ids" => {
                ch.ids = if c.null()? {
                    None
                } else if c.peek() == Some(b'[') {
                    let mut n = 0u64;
                    let mut ok = true;
                    c.array(|c, _| {
                        n += 1;
                        ok &= c.uint()?.1.is_some();
                        Ok(())
                    })?;
                    Some(if ok {
                        Ok(n)
                    } else {
                        Err("token_ids must be an array of non-negative integers")
                    })
                } else {
                    c.value()?;
                    Some(Err("token_ids must be an array"))
                };
                if strip { Keep::Drop } else { Keep::Yes }
            }
            b"prompt_token_ids" => {
                c.value()?;
                if strip { Keep::Drop } else { Keep::Yes }
            }
            b"finish_reason" => {
                ch.finish = !c.null()?;
                if ch.finish {
                    c.value()?;
                }
                Keep::Yes
            }
            b"text" => {
                ch.text = c.nonempty()?;
                Keep::Yes
            }
            b"delta" => {
                let mut bits = 0u8;
                if c.peek() == Some(b'{') {
                    c.object(|c, m| {
                        let key = key_of(c, m);
                        match DELTA_CONTENT.iter().position(|k| *k == &*key) {
                            Some(i) => {
                                if c.nonempty()? {
                                    bits |= 1 << i;
                                } else {
                                    bits &= !(1 << i);
                                }
                            }
                            None => {
                                c.value()?;
                            }
                        }
                        Ok(Keep::Yes)
                    })?;
                } else {
                    c.value()?;
                }
                ch.delta = Some(bits);
                Keep::Yes
            }
            b"index" if base.is_some() => {
                let (r, i) = c.uint()?;
                c.edit(r, Repl::Uint(base.unwrap_or(0) + i.unwrap_or(0)));
                ch.has_index = true;
                Keep::Yes
            }
            _ => {
                c.value()?;
                Keep::Yes
            }
        };
        if keep == Keep::Yes {
            ch.kept += 1;
        }
        Ok(keep)
    })?;
    if let Some(b) = base
        && !ch.has_index
    {
        let comma = ch.kept > 0;
        c.edits.insert(
            at,
            Edit {
                range: open + 1..open + 1,
                with: Repl::Member {
                    key: "index",
                    n: b,
                    comma,
                },
            },
        );
    }
    Ok(ch)
}

/// The `usage` object of a usage chunk as the engine wrote it ([`StreamState::take_usage_chunk`]).
pub fn chunk_usage(chunk: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(chunk).ok()?;
    match v {
        Value::Object(mut m) => m.remove("usage"),
        _ => None,
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

/// The single final frame after output started (behaviour.md 1.9):
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

/// A whole answer from an engine that streamed a leg the router asked for non-streaming
/// (`"stream": false` answered with `text/event-stream` anyway): the SSE body `bytes` read in
/// full, assembled into one OpenAI answer as [`Aggregator`] assembles a relayed stream (text
/// or message content concatenated per choice, `finish_reason`, logprobs, tool calls), for a
/// chat (`chat.completion`) or completions (`text_completion`) client. `usage` is the
/// engine's (its usage-only chunk, or counts its content chunks carried); an engine that sent
/// none gets `{"completion_tokens": <tokens counted by the relay's rules>}`, which
/// [`usage_value`] completes with an estimated prompt.
///
/// # Errors
/// What a streamed leg fails with: an in-stream error frame, a frame that is not JSON,
/// `[DONE]` before any output, or a body that ended without `[DONE]`.
pub fn assemble_sse(bytes: &[u8], chat: bool) -> Result<Value, StreamFailure> {
    // The body is bounded by the caller: the relay's own limits do not apply again.
    let mut state = StreamState::new(RelayOptions::new(u64::MAX, false));
    let mut agg = Aggregator::new(chat);
    let mut end: Option<Result<(), StreamFailure>> = None;
    let mut parser = SseParser::new();
    parser.feed(bytes, |payload| match state.on_data(payload) {
        RelayStep::Hold => true,
        RelayStep::Output => {
            agg.push_frames(&state.take_output());
            true
        }
        RelayStep::Done => {
            end = Some(Ok(()));
            false
        }
        RelayStep::Failed(f) => {
            end = Some(Err(f));
            false
        }
    });
    if parser.overflowed() {
        return Err(StreamFailure::ResponseLimit);
    }
    match end {
        Some(Ok(())) => {}
        Some(Err(f)) => return Err(f),
        None => {
            return Err(match state.on_end() {
                RelayStep::Failed(f) => f,
                _ => StreamFailure::EndedWithoutDone,
            });
        }
    }
    let usage = match state.take_usage_chunk().as_deref().and_then(chunk_usage) {
        Some(u) => u,
        None => state
            .engine_usage_value()
            .unwrap_or_else(|| json!({"completion_tokens": state.tokens()})),
    };
    Ok(agg.finish(usage))
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
    /// The choice's `token_ids`, concatenated over its chunks (present only when the relay
    /// kept them: the client set `return_token_ids`).
    token_ids: Option<Vec<Value>>,
    /// The choice's `prompt_token_ids` (vLLM completions), as first seen.
    prompt_token_ids: Option<Value>,
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
            token_ids: None,
            prompt_token_ids: None,
        }
    }
}

/// Reassembles streamed chunks into one non-streaming response object (behaviour.md 7.3),
/// one choice per streamed `index`.
#[derive(Debug, Default)]
pub struct Aggregator {
    chat: bool,
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    /// Top-level `prompt_token_ids` (vLLM chat), as first seen.
    prompt_token_ids: Option<Value>,
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

    /// Merges relayed SSE frames (`data: <json>\n\n` each, as [`StreamState::take_output`]
    /// writes them).
    pub fn push_frames(&mut self, frames: &[u8]) {
        for line in frames.split(|&b| b == b'\n') {
            if let Some(json) = line.strip_prefix(b"data: ")
                && let Ok(v) = serde_json::from_slice::<Value>(json)
            {
                self.push(&v);
            }
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
        if self.prompt_token_ids.is_none() {
            self.prompt_token_ids = chunk
                .get("prompt_token_ids")
                .filter(|v| !v.is_null())
                .cloned();
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
        let mut answer = json!({
            "id": self.id.unwrap_or(Value::Null),
            "created": self.created.unwrap_or(Value::Null),
            "model": self.model.unwrap_or(Value::Null),
            "object": if chat { "chat.completion" } else { "text_completion" },
            "choices": choices,
            "usage": usage,
        });
        if let (Some(ids), Some(o)) = (self.prompt_token_ids, answer.as_object_mut()) {
            o.insert("prompt_token_ids".into(), ids);
        }
        answer
    }
}

fn merge_choice(acc: &mut ChoiceAcc, choice: &Value, chat: bool) {
    if let Some(ids) = choice.get("token_ids").and_then(Value::as_array) {
        acc.token_ids
            .get_or_insert_with(Vec::new)
            .extend(ids.iter().cloned());
    }
    if acc.prompt_token_ids.is_none() {
        acc.prompt_token_ids = choice
            .get("prompt_token_ids")
            .filter(|v| !v.is_null())
            .cloned();
    }
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
    if let Some(ids) = c.token_ids {
        choice.insert("token_ids".into(), ids.into());
    }
    if let Some(ids) = c.prompt_token_ids {
        choice.insert("prompt_token_ids".into(), ids);
    }
    Value::Object(choice)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts() -> RelayOptions {
        RelayOptions::new(1 << 20, false)
    }

    /// A non-streaming client that set `return_token_ids` gets, in the assembled answer, the
    /// `token_ids` of every chunk (concatenated per choice) and the `prompt_token_ids`, as
    /// vLLM's own non-streaming answer carries them (`token_ids` per choice; completions'
    /// `prompt_token_ids` per choice, chat's at the top). They were dropped before.
    #[test]
    fn assembled_answers_keep_the_token_ids_the_relay_kept() {
        let mut a = Aggregator::new(false);
        a.push(
            &json!({"id": "c", "choices": [{"index": 0, "text": "a", "token_ids": [5],
                        "prompt_token_ids": [1, 2]}]}),
        );
        a.push(
            &json!({"choices": [{"index": 0, "text": "b", "token_ids": [6, 7],
                        "finish_reason": "length"}]}),
        );
        let out = a.finish(json!(null));
        assert_eq!(out["choices"][0]["token_ids"], json!([5, 6, 7]), "{out}");
        assert_eq!(
            out["choices"][0]["prompt_token_ids"],
            json!([1, 2]),
            "{out}"
        );
        let mut a = Aggregator::new(true);
        a.push(&json!({"prompt_token_ids": [3], "choices": [{"index": 0,
                        "delta": {"role": "assistant", "content": "x"}, "token_ids": [9]}]}));
        let out = a.finish(json!(null));
        assert_eq!(out["prompt_token_ids"], json!([3]), "{out}");
        assert_eq!(out["choices"][0]["token_ids"], json!([9]), "{out}");
        // Frames the relay stripped (the client did not ask) assemble without them.
        let mut a = Aggregator::new(false);
        a.push(&json!({"choices": [{"index": 0, "text": "a"}]}));
        let out = a.finish(json!(null));
        assert!(out["choices"][0].get("token_ids").is_none(), "{out}");
        assert!(out.get("prompt_token_ids").is_none(), "{out}");
    }

    /// Feeds one payload; on `Output`, the frames it released, as JSON values.
    fn step(s: &mut StreamState, payload: &str) -> (RelayStep, Vec<Value>) {
        let st = s.on_data(payload.as_bytes());
        let out = if st == RelayStep::Output {
            frames(&s.take_output())
        } else {
            Vec::new()
        };
        (st, out)
    }

    /// The JSON of each `data:` frame of relayed bytes (each frame is one line).
    fn frames(out: &[u8]) -> Vec<Value> {
        let text = std::str::from_utf8(out).expect("relayed frames are UTF-8");
        assert!(text.is_empty() || text.ends_with("\n\n"), "{text:?}");
        text.split("\n\n")
            .filter(|f| !f.is_empty())
            .map(|f| {
                let json = f.strip_prefix("data: ").expect("a data frame");
                assert!(!json.contains('\n'), "one line per frame: {f:?}");
                serde_json::from_str(json).expect("relayed frames are JSON")
            })
            .collect()
    }

    /// Relays upstream `bytes` cut at `points` through the parser and the state, as the
    /// decode leg does; returns the client's bytes and whether `[DONE]` came.
    fn relay_cut(state: &mut StreamState, bytes: &[u8], points: &[usize]) -> (Vec<u8>, bool) {
        let mut parser = SseParser::new();
        let mut out = Vec::new();
        let mut done = false;
        for w in points.windows(2) {
            parser.feed(&bytes[w[0]..w[1]], |d| {
                match state.on_data(d) {
                    RelayStep::Output => out.extend_from_slice(&state.take_output()),
                    RelayStep::Done => done = true,
                    RelayStep::Hold => {}
                    RelayStep::Failed(f) => panic!("{f:?}"),
                }
                true
            });
        }
        (out, done)
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
            let mut state = StreamState::new(opts());
            let (out, done) = relay_cut(&mut state, bytes, &points);
            let got: String = frames(&out)
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
                .collect();
            prop_assert!(done);
            prop_assert_eq!(got, words.concat());
            prop_assert_eq!(state.tokens(), words.len() as u64);
        }
    }

    #[test]
    fn holds_until_first_token_then_flushes_and_strips_token_ids() {
        let mut s = StreamState::new(opts());
        assert_eq!(step(&mut s, &chunk("", &[])).0, RelayStep::Hold);
        assert!(!s.started());
        assert!(s.take_output().is_empty(), "held frames stay held");
        let (RelayStep::Output, out) = step(&mut s, &chunk(" t0", &[5])) else {
            panic!()
        };
        assert_eq!(out.len(), 2, "held chunk flushed with the first token");
        assert!(
            out.iter()
                .all(|c| c["choices"][0].get("token_ids").is_none())
        );
        assert!(s.started());
        let (RelayStep::Output, out) = step(&mut s, &chunk(" t1", &[6, 7])) else {
            panic!()
        };
        assert_eq!(out.len(), 1);
        assert_eq!(s.tokens(), 3);
        // usage-only chunk is dropped unless asked for, but its prompt_tokens are kept
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 9}}).to_string();
        assert_eq!(step(&mut s, &usage).0, RelayStep::Hold);
        assert_eq!(s.prompt_tokens(), Some(9));
        assert_eq!(step(&mut s, "[DONE]").0, RelayStep::Done);
        assert_eq!(s.on_end(), RelayStep::Done);
    }

    #[test]
    fn token_ids_kept_when_client_asked_and_the_usage_chunk_is_held_for_the_server() {
        let mut s = StreamState::new(RelayOptions {
            return_token_ids: true,
            ..opts()
        });
        let (RelayStep::Output, out) = step(&mut s, &chunk(" t0", &[5])) else {
            panic!()
        };
        assert_eq!(out[0]["choices"][0]["token_ids"], json!([5]));
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}});
        assert_eq!(step(&mut s, &usage.to_string()).0, RelayStep::Hold);
        let held = s.take_usage_chunk().expect("the usage chunk is held");
        assert_eq!(
            &held[..],
            usage.to_string().as_bytes(),
            "the engine's bytes"
        );
        assert_eq!(chunk_usage(&held), Some(usage["usage"].clone()));
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
        assert_eq!(step(&mut s, &c.to_string()).0, RelayStep::Output);
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
            step(&mut s, "[DONE]").0,
            RelayStep::Failed(StreamFailure::DoneBeforeToken)
        );
        let mut s = StreamState::new(opts());
        step(&mut s, &chunk(" t0", &[5]));
        assert_eq!(
            s.on_end(),
            RelayStep::Failed(StreamFailure::EndedWithoutDone)
        );
        let mut s = StreamState::new(opts());
        let e = json!({"error": {"message": "boom", "type": "x", "code": 503}}).to_string();
        assert_eq!(
            step(&mut s, &e).0,
            RelayStep::Failed(StreamFailure::UpstreamError {
                status: 503,
                message: "boom".into()
            })
        );
        let e = json!({"error": {"message": "boom", "code": "weird"}}).to_string();
        assert!(matches!(
            step(&mut StreamState::new(opts()), &e).0,
            RelayStep::Failed(StreamFailure::UpstreamError { status: 500, .. })
        ));
        // An error that is null is no error.
        let fine = json!({"error": null, "choices": [{"index": 0, "text": "x"}]}).to_string();
        assert_eq!(
            step(&mut StreamState::new(opts()), &fine).0,
            RelayStep::Output
        );
        for bad in ["not json", "{\"choices\": [", "{\"a\":1} x", "[1]", "\"s\""] {
            assert!(
                matches!(
                    step(&mut StreamState::new(opts()), bad).0,
                    RelayStep::Failed(StreamFailure::InvalidFrame(_))
                ),
                "{bad}"
            );
        }
        for (bad, why) in [
            (
                json!({"choices": [{"index": 0, "text": "x", "token_ids": [1, -2]}]}),
                "non-negative",
            ),
            (
                json!({"choices": [{"index": 0, "text": "x", "token_ids": [1.5]}]}),
                "non-negative",
            ),
            (
                json!({"choices": [{"index": 0, "text": "x", "token_ids": "1"}]}),
                "an array",
            ),
        ] {
            match step(&mut StreamState::new(opts()), &bad.to_string()).0 {
                RelayStep::Failed(StreamFailure::InvalidFrame(d)) => {
                    assert!(d.contains(why), "{d}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn held_frame_limit() {
        let mut s = StreamState::new(opts());
        for _ in 0..MAX_HELD_FRAMES {
            assert_eq!(step(&mut s, &chunk("", &[])).0, RelayStep::Hold);
        }
        assert_eq!(
            step(&mut s, &chunk("", &[])).0,
            RelayStep::Failed(StreamFailure::ResponseLimit)
        );
    }

    #[test]
    fn collected_responses_are_capped() {
        let mut s = StreamState::new(RelayOptions::new(300, true));
        assert_eq!(step(&mut s, &chunk(" t0", &[5])).0, RelayStep::Output);
        let mut last = RelayStep::Hold;
        for _ in 0..5 {
            last = step(&mut s, &chunk(" t1", &[6])).0;
        }
        assert_eq!(last, RelayStep::Failed(StreamFailure::ResponseLimit));
    }

    /// Engines without `token_ids` (llama.cpp, TGI, older vLLM, SGLang chat): every
    /// content-bearing delta counts, whatever kind of content it carries, so a stream that
    /// carried content is never "empty".
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
            assert_eq!(step(&mut s, &role.to_string()).0, RelayStep::Hold);
            let (st, out) = step(&mut s, &c.to_string());
            assert!(st == RelayStep::Output && out.len() == 2, "{c}");
            assert_eq!(s.tokens(), 1, "{c}");
            assert_eq!(step(&mut s, "[DONE]").0, RelayStep::Done, "{c}");
        }
        // `token_ids: []` beside content: the content is the evidence.
        let mut s = StreamState::new(opts());
        let c = json!({"choices": [{"index": 0, "text": "x", "token_ids": []}]});
        assert_eq!(step(&mut s, &c.to_string()).0, RelayStep::Output);
        assert_eq!(s.tokens(), 1);
        // No content, no ids, no finish: still held.
        let mut s = StreamState::new(opts());
        let empty = json!({"choices": [{"index": 0, "text": "", "finish_reason": null}]});
        assert_eq!(step(&mut s, &empty.to_string()).0, RelayStep::Hold);
        assert_eq!(
            step(&mut s, "[DONE]").0,
            RelayStep::Failed(StreamFailure::DoneBeforeToken)
        );
        // A delta decides alone: text beside an empty delta is not content.
        let mut s = StreamState::new(opts());
        let odd = json!({"choices": [{"index": 0, "text": "x", "delta": {"content": ""}}]});
        assert_eq!(step(&mut s, &odd.to_string()).0, RelayStep::Hold);
    }

    /// A generation that ends on its first step (EOS, a stop string) streams a choice with an
    /// empty text and a finish reason: that is an answer, not an empty stream.
    #[test]
    fn a_finish_reason_starts_output_even_without_text() {
        let mut s = StreamState::new(opts());
        let fin = json!({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]});
        assert_eq!(step(&mut s, &fin.to_string()).0, RelayStep::Output);
        assert_eq!(s.tokens(), 0);
        assert_eq!(step(&mut s, "[DONE]").0, RelayStep::Done);
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
        assert_eq!(step(&mut s, &chunks[0].to_string()).0, RelayStep::Output);
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

    /// A leg asked for non-streaming but answered as SSE is assembled into one answer: text
    /// concatenated, finish reason, the engine's usage or the tokens counted; failures as a
    /// streamed leg's.
    #[test]
    fn streamed_whole_answers_are_assembled() {
        let sse = |frames: &[Value], done: bool| {
            let mut s: String = frames
                .iter()
                .map(|f| format!("data: {f}\r\n\r\n"))
                .collect();
            if done {
                s.push_str("data: [DONE]\n\n");
            }
            s
        };
        let c = |t: &str, fr: Value| {
            json!({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                                              "choices": [{"index": 0, "text": t, "finish_reason": fr, "token_ids": [7]}]})
        };
        let usage = json!({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}});
        let v = assemble_sse(
            sse(
                &[c(" a", Value::Null), c(" b", json!("length")), usage],
                true,
            )
            .as_bytes(),
            false,
        )
        .unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(
            (v["id"].clone(), v["model"].clone()),
            (json!("cmpl-1"), json!("m"))
        );
        assert_eq!(v["choices"][0]["text"], " a b");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["prompt_tokens"], 4);
        assert_eq!(v["usage"]["completion_tokens"], 2);
        // No usage from the engine: the tokens counted (two token_ids), for usage_value.
        let v = assemble_sse(
            sse(&[c(" a", Value::Null), c(" b", json!("stop"))], true).as_bytes(),
            false,
        )
        .unwrap();
        assert_eq!(v["usage"], json!({"completion_tokens": 2}));
        assert_eq!(usage_value(v.get("usage"), 9, 0)["estimated"], true);
        // Chat deltas become one message.
        let d = |delta: Value, fr: Value| json!({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": fr}]});
        let v = assemble_sse(
            sse(
                &[
                    d(json!({"role": "assistant", "content": ""}), Value::Null),
                    d(json!({"content": "x"}), Value::Null),
                    d(json!({"content": "y"}), json!("stop")),
                ],
                true,
            )
            .as_bytes(),
            true,
        )
        .unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(
            v["choices"][0]["message"],
            json!({"role": "assistant", "content": "xy"})
        );
        assert_eq!(v["usage"]["completion_tokens"], 2);
        // Failures are a streamed leg's.
        let err = json!({"error": {"message": "boom", "code": 400}});
        assert_eq!(
            assemble_sse(sse(&[c(" a", Value::Null), err], true).as_bytes(), false),
            Err(StreamFailure::UpstreamError {
                status: 400,
                message: "boom".into()
            })
        );
        assert_eq!(
            assemble_sse(sse(&[c(" a", Value::Null)], false).as_bytes(), false),
            Err(StreamFailure::EndedWithoutDone)
        );
        assert_eq!(
            assemble_sse(sse(&[], true).as_bytes(), false),
            Err(StreamFailure::DoneBeforeToken)
        );
        assert!(matches!(
            assemble_sse(b"data: nope\n\n", false),
            Err(StreamFailure::InvalidFrame(_))
        ));
    }

    /// An engine that serves a batch interleaves its choices by `index`: each becomes its own
    /// choice, in index order, never one merged text (docs/http-api.md).
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

    /// The engine's bytes go through untouched: as they came when the client asked for
    /// `token_ids`, and minus exactly the `token_ids`/`prompt_token_ids` members otherwise.
    #[test]
    fn frames_are_the_engines_bytes() {
        let frame = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" t\u00e9","logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[5],"prompt_token_ids":[1,2]}],"prompt_token_ids":[1,2]}"#;
        let mut keep = StreamState::new(RelayOptions {
            return_token_ids: true,
            ..opts()
        });
        assert_eq!(keep.on_data(frame.as_bytes()), RelayStep::Output);
        assert_eq!(
            &keep.take_output()[..],
            format!("data: {frame}\n\n").as_bytes()
        );
        let mut strip = StreamState::new(opts());
        assert_eq!(strip.on_data(frame.as_bytes()), RelayStep::Output);
        assert_eq!(
            std::str::from_utf8(&strip.take_output()).unwrap(),
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" t\\u00e9\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}]}\n\n"
        );
        // Whitespace line breaks (a multi-line `data:` event) become spaces: one line each.
        let pretty = serde_json::to_string_pretty(
            &json!({"choices": [{"index": 0, "text": "a\nb", "token_ids": [1]}]}),
        )
        .unwrap();
        let mut s = StreamState::new(opts());
        let mut p = SseParser::new();
        let sse: String = pretty
            .lines()
            .map(|l| format!("data: {l}\n"))
            .collect::<String>()
            + "\n";
        p.feed(sse.as_bytes(), |d| {
            assert_eq!(s.on_data(d), RelayStep::Output);
            true
        });
        let out = s.take_output();
        assert_eq!(
            frames(&out),
            vec![json!({"choices": [{"index": 0, "text": "a\nb"}]})]
        );
        // Invalid UTF-8 from an engine is replaced, never forwarded.
        let mut s = StreamState::new(opts());
        let bad = b"{\"choices\":[{\"index\":0,\"text\":\"a\xffb\"}]}";
        assert_eq!(s.on_data(bad), RelayStep::Output);
        assert_eq!(
            frames(&s.take_output())[0]["choices"][0]["text"],
            "a\u{fffd}b"
        );
    }

    /// Prompt `k` of a fanned-out batch: its choices become choice `k` (an index added when
    /// the engine sent none), a chunk's usage is dropped, and the first chunk's head is kept.
    #[test]
    fn batch_prompts_are_reindexed_and_keep_their_head() {
        let mut s = StreamState::new(RelayOptions {
            index_base: Some(3),
            capture_head: true,
            ..opts()
        });
        let c = json!({"id": "cmpl-7", "created": 5, "model": "m", "choices": [
            {"index": 0, "text": "a", "token_ids": [1]}, {"text": "b"}, {"token_ids": [2]}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2}});
        let (st, out) = step(&mut s, &c.to_string());
        assert_eq!(st, RelayStep::Output);
        assert_eq!(
            out,
            vec![
                json!({"id": "cmpl-7", "created": 5, "model": "m", "choices": [
                {"index": 3, "text": "a"}, {"index": 3, "text": "b"}, {"index": 3}]})
            ]
        );
        assert_eq!(s.tokens(), 3);
        assert_eq!(s.engine_usage().completion_tokens, Some(2));
        assert_eq!(
            s.head(),
            Some(&Head {
                id: "\"cmpl-7\"".into(),
                created: "5".into(),
                model: "\"m\"".into()
            })
        );
    }

    /// The parser can stop after any event and go on from where it stopped.
    #[test]
    fn the_parser_stops_and_resumes() {
        let (text, payloads) = stream_text("\r\n");
        let bytes = text.as_bytes();
        let mut p = SseParser::new();
        let mut got = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let used = p.feed(&bytes[at..], |d| {
                got.push(String::from_utf8(d.to_vec()).unwrap());
                false
            });
            assert!(used > 0);
            at += used;
        }
        assert_eq!(got, payloads);
    }

    /// The rules of the `Value`-based relay this one replaced, for one frame: the failure,
    /// or (tokens, ends a choice, usage counts, usage-only, the frame the client gets).
    #[allow(clippy::type_complexity)]
    fn reference(
        data: &str,
        o: RelayOptions,
    ) -> Result<(u64, bool, Option<(Option<u64>, Option<u64>)>, bool, Value), &'static str> {
        let mut v: Value = serde_json::from_str(data).map_err(|_| "not JSON")?;
        if !v.is_object() {
            return Err("not an object");
        }
        if v.get("error").is_some_and(|e| !e.is_null()) {
            return Err("error");
        }
        let usage = v.get("usage").filter(|u| u.is_object()).map(|u| {
            let n = |k: &str| u.get(k).and_then(Value::as_u64);
            (n("prompt_tokens"), n("completion_tokens"))
        });
        let obj = v.as_object_mut().unwrap();
        if obj
            .get("choices")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty)
        {
            return Ok((0, false, usage, true, Value::Null));
        }
        let nonempty = |v: Option<&Value>| match v {
            Some(Value::String(s)) => !s.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
            _ => false,
        };
        let (mut tokens, mut ends) = (0, false);
        for ch in obj["choices"].as_array_mut().unwrap() {
            let Some(ch) = ch.as_object_mut() else {
                continue;
            };
            let ids = match ch.get("token_ids") {
                Some(Value::Array(ids)) if ids.iter().all(Value::is_u64) => ids.len() as u64,
                Some(Value::Array(_)) => return Err("bad ids"),
                Some(Value::Null) | None => 0,
                Some(_) => return Err("ids not an array"),
            };
            let content = match ch.get("delta") {
                Some(d) => [
                    "content",
                    "reasoning_content",
                    "reasoning",
                    "tool_calls",
                    "function_call",
                ]
                .iter()
                .any(|k| nonempty(d.get(*k))),
                None => nonempty(ch.get("text")),
            };
            tokens += if ids == 0 && content { 1 } else { ids };
            ends |= ch.get("finish_reason").is_some_and(|f| !f.is_null());
            if !o.return_token_ids {
                ch.remove("token_ids");
                ch.remove("prompt_token_ids");
            }
        }
        if !o.return_token_ids {
            obj.remove("prompt_token_ids");
        }
        if let Some(base) = o.index_base {
            reindex(&mut v, base);
        }
        Ok((tokens, ends, usage, false, v))
    }

    fn arb_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            Just(json!("")),
            Just(json!("x\u{e9}\"y")),
            Just(json!([])),
            Just(json!([1, 2])),
            Just(json!({})),
            Just(json!({"k": 1})),
            Just(json!(0)),
            Just(json!(true)),
        ]
    }

    fn arb_ids() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(json!([])),
            proptest::collection::vec(0u64..100_000, 1..4).prop_map(|v| json!(v)),
            Just(json!([1, -1])),
            Just(json!([2.5])),
            Just(json!("1")),
            Just(Value::Null),
        ]
    }

    /// Members in a shuffled order, some left out.
    fn arb_object(
        members: Vec<(&'static str, BoxedStrategy<Value>)>,
    ) -> impl Strategy<Value = Value> {
        let parts: Vec<_> = members
            .into_iter()
            .map(|(k, s)| proptest::option::weighted(0.6, s).prop_map(move |v| (k, v)))
            .collect();
        parts.prop_shuffle().prop_map(|kv| {
            Value::Object(
                kv.into_iter()
                    .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
                    .collect(),
            )
        })
    }

    fn arb_frame() -> impl Strategy<Value = Value> {
        let delta = arb_object(vec![
            ("role", Just(json!("assistant")).boxed()),
            ("content", arb_leaf().boxed()),
            ("reasoning_content", arb_leaf().boxed()),
            ("reasoning", arb_leaf().boxed()),
            ("tool_calls", arb_leaf().boxed()),
            ("function_call", arb_leaf().boxed()),
        ]);
        let choice = arb_object(vec![
            (
                "index",
                prop_oneof![(0u64..4).prop_map(Value::from), Just(json!("x"))].boxed(),
            ),
            ("text", arb_leaf().boxed()),
            (
                "delta",
                prop_oneof![delta.boxed(), Just(Value::Null).boxed()].boxed(),
            ),
            ("logprobs", arb_leaf().boxed()),
            (
                "finish_reason",
                prop_oneof![Just(Value::Null), Just(json!("stop"))].boxed(),
            ),
            ("token_ids", arb_ids().boxed()),
            ("prompt_token_ids", arb_ids().boxed()),
        ]);
        let usage = arb_object(vec![
            (
                "prompt_tokens",
                prop_oneof![(0u64..50).prop_map(Value::from), Just(json!(-1))].boxed(),
            ),
            (
                "completion_tokens",
                (0u64..50).prop_map(Value::from).boxed(),
            ),
            ("total_tokens", (0u64..50).prop_map(Value::from).boxed()),
        ]);
        arb_object(vec![
            ("id", Just(json!("cmpl-1")).boxed()),
            ("object", Just(json!("text_completion")).boxed()),
            ("created", Just(json!(7)).boxed()),
            ("model", Just(json!("m")).boxed()),
            (
                "choices",
                prop_oneof![
                    4 => proptest::collection::vec(prop_oneof![5 => choice.boxed(), 1 => arb_leaf().boxed()], 0..3)
                        .prop_map(Value::Array).boxed(),
                    1 => arb_leaf().boxed(),
                ]
                .boxed(),
            ),
            ("usage", prop_oneof![usage.boxed(), arb_leaf().boxed()].boxed()),
            ("prompt_token_ids", arb_ids().boxed()),
            ("error", Just(Value::Null).boxed()),
        ])
    }

    proptest! {
        /// Every token-evidence rule, stripping and reindexing agree with the `Value`-based
        /// rules on any frame (members in any order, compact or pretty, batch or not).
        #[test]
        fn byte_relay_agrees_with_the_value_rules(
            frame in arb_frame(),
            pretty in any::<bool>(),
            keep_ids in any::<bool>(),
            base in proptest::option::of(0u64..3),
        ) {
            let text = if pretty { serde_json::to_string_pretty(&frame) } else { serde_json::to_string(&frame) }.unwrap();
            let o = RelayOptions { return_token_ids: keep_ids, index_base: base, ..opts() };
            let fresh = StreamState::new(o).on_data(text.as_bytes());
            let mut warm = StreamState::new(o);
            prop_assert_eq!(warm.on_data(br#"{"choices":[{"index":0,"text":"w"}]}"#), RelayStep::Output);
            warm.take_output();
            let before = warm.tokens();
            let step = warm.on_data(text.as_bytes());
            match reference(&text, o) {
                Err(why) => prop_assert!(
                    matches!(step, RelayStep::Failed(StreamFailure::InvalidFrame(_))),
                    "{} {:?}", why, step
                ),
                Ok((tokens, ends, usage, usage_only, want)) => {
                    prop_assert_eq!(warm.engine_usage(), EngineUsage {
                        prompt_tokens: usage.and_then(|u| u.0),
                        completion_tokens: usage.and_then(|u| u.1),
                    });
                    if usage_only {
                        prop_assert_eq!(&step, &RelayStep::Hold);
                        prop_assert_eq!(warm.take_usage_chunk().is_some(), usage.is_some());
                    } else {
                        prop_assert_eq!(&step, &RelayStep::Output);
                        prop_assert_eq!(warm.tokens() - before, tokens);
                        prop_assert_eq!(frames(&warm.take_output()), vec![want]);
                        let starts = tokens > 0 || ends;
                        prop_assert_eq!(fresh == RelayStep::Output, starts);
                    }
                }
            }
        }
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
