//! One decode stream's relay state, sans IO: each data frame scanned once for token evidence,
//! `finish_reason`, `usage` and an `error`, output held until the first token (at most
//! [`MAX_HELD_FRAMES`] frames), the engine's bytes forwarded but for the members the client did
//! not ask for.

use std::borrow::Cow;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

use crate::Aggregator;
use crate::aggregate::{ChoiceView, ChunkView, Str};
use crate::rawjson::{Cursor, Edit, Keep, Member, Repl, ScanError, apply, decode_key, edited_len};

/// Data frames held before the first token (behaviour.md 7.3).
pub const MAX_HELD_FRAMES: usize = 64;

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
    /// `Some(chat)`: a non-streaming client's answer is built from each frame in the scan
    /// that reads the frame's facts (an [`Aggregator`] for a `chat.completion` when `chat`,
    /// else a `text_completion`), instead of written as SSE and scanned again:
    /// [`StreamState::take_output`] stays empty and [`StreamState::take_aggregator`] gives
    /// the answer. The answer is the one an [`Aggregator`] builds from the relayed frames.
    pub aggregate: Option<bool>,
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
            aggregate: None,
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
    /// The answer being built ([`RelayOptions::aggregate`]); boxed, so that a streaming
    /// client's state does not carry it.
    collecting: Option<Box<Collecting>>,
    /// Frames merged into the answer since the last [`StreamState::take_output`] (output
    /// started).
    merged: bool,
}

/// A non-streaming client's answer as the relay builds it.
#[derive(Debug)]
struct Collecting {
    agg: Aggregator,
    /// What the last scan found for `agg` (its choices' storage reused between frames).
    view: ChunkView,
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
            collecting: opts.aggregate.map(|chat| {
                Box::new(Collecting {
                    agg: Aggregator::new(chat),
                    view: ChunkView::default(),
                })
            }),
            merged: false,
        }
    }

    /// Has output (the first token, content or finish reason) started?
    pub fn started(&self) -> bool {
        self.started
    }

    /// Whether output started and frames wait in [`StreamState::take_output`] (with
    /// [`RelayOptions::aggregate`]: frames were merged since the last call).
    pub fn has_output(&self) -> bool {
        self.started && (self.merged || !self.out.is_empty())
    }

    /// The frames relayed since the last call, as SSE (`data: <json>\n\n` each); empty before
    /// output started (held frames stay held), and always with [`RelayOptions::aggregate`].
    pub fn take_output(&mut self) -> Bytes {
        if !self.started {
            return Bytes::new();
        }
        self.merged = false;
        self.out.split().freeze()
    }

    /// The answer built from every content frame so far, held ones included (with
    /// [`RelayOptions::aggregate`]; `None` without, or once taken): finish it with
    /// [`Aggregator::finish`] after `Done`.
    pub fn take_aggregator(&mut self) -> Option<Aggregator> {
        self.collecting.take().map(|c| c.agg)
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
    /// chunks (no usage-only chunk): its counts, for [`usage_value`](crate::usage_value).
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
    /// replaces it (see [`usage_value`](crate::usage_value), [`chunk_usage`]).
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
        let size = match self.collecting.as_deref_mut() {
            Some(Collecting { agg, view }) => {
                agg.push_view(&text, view);
                self.merged = true;
                let lead = text.len() - text.trim_ascii_start().len();
                edited_len(lead..lead + text.trim_ascii().len(), &edits)
            }
            None => self.emit(&text, &edits),
        };
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
        let aggregate = self.collecting.is_some();
        let mut view = self.collecting.as_deref_mut().map(|c| {
            let mut v = std::mem::take(&mut c.view);
            v.clear();
            v
        });
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
                    if let Some(v) = &mut view {
                        v.choices.clear();
                    }
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
                            if let Some(v) = &mut view {
                                // What `Value::get` reads of a choice that is not an object.
                                v.choices.push(ChoiceView::default());
                            }
                            return Ok(());
                        }
                        let choice = view.as_mut().map(|v| {
                            v.choices.push(ChoiceView::default());
                            v.choices.last_mut().expect("just pushed")
                        });
                        let ch = scan_choice(c, strip, base, choice)?;
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
                    let r = c.value()?;
                    if strip {
                        return Ok(Keep::Drop);
                    }
                    if let Some(v) = &mut view {
                        v.prompt_token_ids = Some(r);
                    }
                }
                k @ (b"id" | b"created" | b"model") if head || aggregate => {
                    let slot = match k {
                        b"id" => 0,
                        b"created" => 1,
                        _ => 2,
                    };
                    let r = c.value()?;
                    if let Some(v) = &mut view {
                        *[&mut v.id, &mut v.created, &mut v.model][slot] = Some(r.clone());
                    }
                    if head {
                        f.head[slot] = Some(r);
                    }
                }
                _ => {
                    c.value()?;
                }
            }
            Ok(Keep::Yes)
        });
        if let (Some(v), Some(c)) = (view, self.collecting.as_deref_mut()) {
            c.view = v;
        }
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

/// Scans one choice object: its token evidence, what the aggregator merges of it (into
/// `view`, when given), and its edits (`token_ids` and `prompt_token_ids` dropped when
/// `strip`; with `base`, its index shifted, or added when it has none).
fn scan_choice(
    c: &mut Cursor<'_>,
    strip: bool,
    base: Option<u64>,
    mut view: Option<&mut ChoiceView>,
) -> Result<ChoiceFacts, ScanError> {
    let mut ch = ChoiceFacts::default();
    if let Some(v) = &mut view {
        v.index = base.unwrap_or(0);
    }
    let open = c.pos();
    let at = c.edits.len();
    c.object(|c, m| {
        let key = key_of(c, m);
        let start = c.pos();
        let keep = match &*key {
            b"token_ids" => {
                ch.ids = token_ids_at(c)?;
                if strip {
                    Keep::Drop
                } else {
                    if let Some(v) = &mut view {
                        v.token_ids = Some(start..c.pos());
                    }
                    Keep::Yes
                }
            }
            b"prompt_token_ids" => {
                let r = c.value()?;
                if strip {
                    Keep::Drop
                } else {
                    if let Some(v) = &mut view {
                        v.prompt_token_ids = Some(r);
                    }
                    Keep::Yes
                }
            }
            b"finish_reason" => {
                ch.finish = !c.null()?;
                if ch.finish {
                    c.value()?;
                }
                if let Some(v) = &mut view {
                    v.finish_reason = Some(start..c.pos());
                }
                Keep::Yes
            }
            b"stop_reason" if view.is_some() => {
                let r = c.value()?;
                if let Some(v) = &mut view {
                    v.stop_reason = Some(r);
                }
                Keep::Yes
            }
            b"logprobs" if view.is_some() => {
                let r = c.value()?;
                if let Some(v) = &mut view {
                    v.logprobs = Some(r);
                }
                Keep::Yes
            }
            b"text" => {
                let (carries, text) = text_at(c)?;
                ch.text = carries;
                if let Some(v) = &mut view {
                    v.text = text;
                }
                Keep::Yes
            }
            b"delta" => {
                ch.delta = Some(delta_at(c, &mut view)?);
                Keep::Yes
            }
            b"index" if base.is_some() || view.is_some() => {
                let (r, i) = c.uint()?;
                let mut n = i.unwrap_or(0);
                if let Some(b) = base {
                    // Saturating, as [`crate::reindex`]: an engine index near `u64::MAX` must
                    // neither panic nor wrap onto another prompt's choice.
                    n = b.saturating_add(n);
                    c.edit(r, Repl::Uint(n));
                    ch.has_index = true;
                }
                if let Some(v) = &mut view {
                    v.index = n;
                }
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
        insert_index(c, at, open, b, ch.kept > 0);
    }
    Ok(ch)
}

/// A choice's `token_ids`: its length, or why it is malformed (`None`: null).
fn token_ids_at(c: &mut Cursor<'_>) -> Result<Option<Result<u64, &'static str>>, ScanError> {
    Ok(if c.null()? {
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
    })
}

/// A choice's `delta`: which of its content members carry something (bit per
/// [`DELTA_CONTENT`] member), merging its role and content into `view` when given.
fn delta_at(c: &mut Cursor<'_>, view: &mut Option<&mut ChoiceView>) -> Result<u8, ScanError> {
    let mut bits = 0u8;
    if let Some(v) = view.as_deref_mut() {
        v.forget_delta();
    }
    if c.peek() == Some(b'{') {
        c.object(|c, m| {
            let key = key_of(c, m);
            if &*key == b"role"
                && let Some(v) = view.as_deref_mut()
            {
                v.role = text_at(c)?.1;
                return Ok(Keep::Yes);
            }
            let Some(i) = DELTA_CONTENT.iter().position(|k| *k == &*key) else {
                c.value()?;
                return Ok(Keep::Yes);
            };
            let start = c.pos();
            let (carries, text) = text_at(c)?;
            if let Some(v) = view.as_deref_mut() {
                match i {
                    0 => v.content = text,
                    1 => v.reasoning_content = text,
                    2 => v.reasoning = text,
                    3 => v.tool_calls = Some(start..c.pos()),
                    _ => {}
                }
            }
            if carries {
                bits |= 1 << i;
            } else {
                bits &= !(1 << i);
            }
            Ok(Keep::Yes)
        })?;
    } else {
        c.value()?;
    }
    Ok(bits)
}

/// Inserts `"index": n` as the first member of the choice object opened at `open`, at edit
/// position `at` (`comma`: members follow it).
fn insert_index(c: &mut Cursor<'_>, at: usize, open: usize, n: u64, comma: bool) {
    c.edits.insert(
        at,
        Edit {
            range: open + 1..open + 1,
            with: Repl::Member {
                key: "index",
                n,
                comma,
            },
        },
    );
}

/// A member that may be a string: whether it carries something (a non-empty string, array
/// or object; see [`Cursor::nonempty`]) and, when it is a string, its raw content for the
/// aggregator.
fn text_at(c: &mut Cursor<'_>) -> Result<(bool, Option<Str>), ScanError> {
    if c.peek() == Some(b'"') {
        let (r, escaped) = c.string_escaped()?;
        Ok((!r.is_empty(), Some(Str(r, escaped))))
    } else {
        Ok((c.nonempty()?, None))
    }
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
