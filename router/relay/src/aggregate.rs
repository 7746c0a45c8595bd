//! One answer from a stream: a non-streaming client's `text_completion` / `chat.completion`
//! built from the relayed chunks ([`Aggregator`]), and an engine's SSE answer to a
//! non-streaming leg assembled into one ([`assemble_sse`]).

use std::ops::Range;

use serde_json::{Map, Value, json};

use crate::RelayOptions;
use crate::RelayStep;
use crate::SseParser;
use crate::StreamFailure;
use crate::StreamState;
use crate::chunk_usage;
use crate::rawjson::{Cursor, Keep, ScanError};

/// A whole answer from an engine that streamed a leg the router asked for non-streaming
/// (`"stream": false` answered with `text/event-stream` anyway): the SSE body `bytes` read in
/// full, assembled into one OpenAI answer as [`Aggregator`] assembles a relayed stream (text
/// or message content concatenated per choice, `finish_reason`, logprobs, tool calls), for a
/// chat (`chat.completion`) or completions (`text_completion`) client. `usage` is the
/// engine's (its usage-only chunk, or counts its content chunks carried); an engine that sent
/// none gets `{"completion_tokens": <tokens counted by the relay's rules>}`, which
/// [`usage_value`](crate::usage_value) completes with an estimated prompt.
///
/// # Errors
/// What a streamed leg fails with: an in-stream error frame, a frame that is not JSON,
/// `[DONE]` before any output, or a body that ended without `[DONE]`.
pub fn assemble_sse(bytes: &[u8], chat: bool) -> Result<Value, StreamFailure> {
    // The body is bounded by the caller: the relay's own limits do not apply again. The
    // answer is built in the relay's scan of each frame.
    let mut state = StreamState::new(RelayOptions {
        aggregate: Some(chat),
        ..RelayOptions::new(u64::MAX, false)
    });
    let mut end: Option<Result<(), StreamFailure>> = None;
    let mut parser = SseParser::with_limit(bytes.len() + 1);
    parser.feed(bytes, |payload| match state.on_data(payload) {
        RelayStep::Hold | RelayStep::Output => true,
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
    let agg = state
        .take_aggregator()
        .unwrap_or_else(|| Aggregator::new(chat));
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
            let Some(json) = line.strip_prefix(b"data: ") else {
                continue;
            };
            // One scan finds the fields merged, without building the chunk; a chunk it
            // cannot read (a key with an escape) is merged from its whole value.
            match ChunkView::scan(json) {
                Some(view) => self.push_view(json, &view),
                None => {
                    if let Ok(v) = serde_json::from_slice::<Value>(json) {
                        self.push(&v);
                    }
                }
            }
        }
    }

    /// Merges one chunk from its [`ChunkView`] over `json`, as [`Aggregator::push`] merges
    /// its value.
    pub(crate) fn push_view(&mut self, json: &[u8], chunk: &ChunkView) {
        for (span, slot) in [
            (&chunk.id, &mut self.id),
            (&chunk.created, &mut self.created),
            (&chunk.model, &mut self.model),
        ] {
            if slot.is_none() {
                *slot = span.as_ref().map(|r| owned(json, r));
            }
        }
        if self.prompt_token_ids.is_none() {
            self.prompt_token_ids = chunk
                .prompt_token_ids
                .as_ref()
                .map(|r| owned(json, r))
                .filter(|v| !v.is_null());
        }
        for choice in &chunk.choices {
            let pos = match self.choices.iter().position(|c| c.index == choice.index) {
                Some(p) => p,
                None => {
                    self.choices.push(ChoiceAcc::new(choice.index));
                    self.choices.len() - 1
                }
            };
            merge_view(&mut self.choices[pos], json, choice, self.chat);
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

    /// The reassembled object with `usage` as given (see [`usage_value`](crate::usage_value)); choices in index
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

/// Where a relayed chunk's merged fields lie in its text (spans of whole values), found by
/// one scan: keys absent are `None`, a repeated key keeps its last value (as a parsed value
/// does).
#[derive(Debug, Default)]
pub(crate) struct ChunkView {
    pub(crate) id: Option<Range<usize>>,
    pub(crate) created: Option<Range<usize>>,
    pub(crate) model: Option<Range<usize>>,
    pub(crate) prompt_token_ids: Option<Range<usize>>,
    /// The `choices` list's elements (none when `choices` is not a list).
    pub(crate) choices: Vec<ChoiceView>,
}

/// One choice of a [`ChunkView`] (a non-object element reads as an empty choice 0).
#[derive(Debug, Default)]
pub(crate) struct ChoiceView {
    /// `index` as `Value::as_u64` reads it, 0 otherwise.
    pub(crate) index: u64,
    pub(crate) token_ids: Option<Range<usize>>,
    pub(crate) prompt_token_ids: Option<Range<usize>>,
    pub(crate) finish_reason: Option<Range<usize>>,
    pub(crate) stop_reason: Option<Range<usize>>,
    pub(crate) logprobs: Option<Range<usize>>,
    /// Completions: `text`.
    pub(crate) text: Option<Str>,
    /// Chat: the `delta` members merged (when `delta` is an object).
    pub(crate) role: Option<Str>,
    pub(crate) content: Option<Str>,
    pub(crate) reasoning_content: Option<Str>,
    pub(crate) reasoning: Option<Str>,
    pub(crate) tool_calls: Option<Range<usize>>,
}

/// A string value's raw content (between its quotes) and whether it holds an escape.
#[derive(Debug, Clone)]
pub(crate) struct Str(pub(crate) Range<usize>, pub(crate) bool);

/// A scan gives up on a key with an escape: the chunk is merged from its value instead.
const GIVE_UP: ScanError = ScanError {
    at: 0,
    what: "a key with an escape",
};

/// Walks the object at the cursor: `f` reads each member's value (and must consume it), given
/// its key; a key with an escape gives the scan up.
fn members<'a>(
    c: &mut Cursor<'a>,
    mut f: impl FnMut(&mut Cursor<'a>, &'a [u8]) -> Result<(), ScanError>,
) -> Result<(), ScanError> {
    c.object(|c, m| {
        if m.escaped {
            return Err(GIVE_UP);
        }
        let key = &c.bytes()[m.key.clone()];
        f(c, key)?;
        Ok(Keep::Yes)
    })
    .map(|_| ())
}

/// A string member: its content, or `None` (consumed) when the value is not a string.
fn string_at(c: &mut Cursor<'_>) -> Result<Option<Str>, ScanError> {
    if c.peek() == Some(b'"') {
        let (r, escaped) = c.string_escaped()?;
        Ok(Some(Str(r, escaped)))
    } else {
        c.value()?;
        Ok(None)
    }
}

impl ChunkView {
    /// Forgets what the last scan found, keeping the choices' storage.
    pub(crate) fn clear(&mut self) {
        (self.id, self.created, self.model, self.prompt_token_ids) = (None, None, None, None);
        self.choices.clear();
    }

    /// Scans one chunk; `None` when the text is not an object the scan can read.
    fn scan(json: &[u8]) -> Option<ChunkView> {
        let mut view = ChunkView::default();
        let mut c = Cursor::new(json, Vec::new());
        let scanned = members(&mut c, |c, key| {
            match key {
                b"id" => view.id = Some(c.value()?),
                b"created" => view.created = Some(c.value()?),
                b"model" => view.model = Some(c.value()?),
                b"prompt_token_ids" => view.prompt_token_ids = Some(c.value()?),
                b"choices" => {
                    view.choices.clear();
                    if c.peek() == Some(b'[') {
                        c.array(|c, _| {
                            let choice = ChoiceView::scan(c)?;
                            view.choices.push(choice);
                            Ok(())
                        })?;
                    } else {
                        c.value()?;
                    }
                }
                _ => {
                    c.value()?;
                }
            }
            Ok(())
        });
        if scanned.is_err() || c.end().is_err() {
            return None;
        }
        Some(view)
    }
}

impl ChoiceView {
    /// Forgets the members of an earlier `delta` (a repeated `delta` replaces the first, as
    /// in a parsed value).
    pub(crate) fn forget_delta(&mut self) {
        (
            self.role,
            self.content,
            self.reasoning_content,
            self.reasoning,
            self.tool_calls,
        ) = (None, None, None, None, None);
    }

    fn scan(c: &mut Cursor<'_>) -> Result<ChoiceView, ScanError> {
        let mut v = ChoiceView::default();
        if c.peek() != Some(b'{') {
            c.value()?;
            return Ok(v);
        }
        members(c, |c, key| {
            match key {
                b"index" => v.index = c.uint()?.1.unwrap_or(0),
                b"token_ids" => v.token_ids = Some(c.value()?),
                b"prompt_token_ids" => v.prompt_token_ids = Some(c.value()?),
                b"finish_reason" => v.finish_reason = Some(c.value()?),
                b"stop_reason" => v.stop_reason = Some(c.value()?),
                b"logprobs" => v.logprobs = Some(c.value()?),
                b"text" => v.text = string_at(c)?,
                b"delta" => {
                    v.forget_delta();
                    if c.peek() == Some(b'{') {
                        members(c, |c, key| {
                            match key {
                                b"role" => v.role = string_at(c)?,
                                b"content" => v.content = string_at(c)?,
                                b"reasoning_content" => v.reasoning_content = string_at(c)?,
                                b"reasoning" => v.reasoning = string_at(c)?,
                                b"tool_calls" => v.tool_calls = Some(c.value()?),
                                _ => {
                                    c.value()?;
                                }
                            }
                            Ok(())
                        })?;
                    } else {
                        c.value()?;
                    }
                }
                _ => {
                    c.value()?;
                }
            }
            Ok(())
        })?;
        Ok(v)
    }
}

/// The value at `span` of `json`, parsed (the scan validated it).
fn owned(json: &[u8], span: &Range<usize>) -> Value {
    serde_json::from_slice(&json[span.clone()]).unwrap_or(Value::Null)
}

/// Appends a string's content to `dst`, its escapes decoded.
fn push_str(dst: &mut String, json: &[u8], s: Option<&Str>) {
    let Some(Str(r, escaped)) = s else { return };
    if *escaped {
        if let Ok(text) = serde_json::from_slice::<String>(&json[r.start - 1..r.end + 1]) {
            dst.push_str(&text);
        }
    } else if let Ok(text) = std::str::from_utf8(&json[r.clone()]) {
        dst.push_str(text);
    }
}

/// `merge_choice` over a scanned choice: fields that are rare or nested (logprobs, tool
/// calls, token ids) are parsed as values and merged by the same code.
fn merge_view(acc: &mut ChoiceAcc, json: &[u8], choice: &ChoiceView, chat: bool) {
    // Most chunks carry `null` finish and stop reasons and logprobs: not parsed.
    let parsed = |span: &Option<Range<usize>>| {
        span.as_ref()
            .filter(|r| json[(*r).clone()] != *b"null")
            .map(|r| owned(json, r))
            .filter(|v| !v.is_null())
    };
    if let Some(Value::Array(ids)) = parsed(&choice.token_ids) {
        acc.token_ids.get_or_insert_with(Vec::new).extend(ids);
    }
    if acc.prompt_token_ids.is_none() {
        acc.prompt_token_ids = parsed(&choice.prompt_token_ids);
    }
    if let Some(fr) = parsed(&choice.finish_reason) {
        acc.finish_reason = fr;
    }
    if let Some(sr) = parsed(&choice.stop_reason) {
        acc.stop_reason = Some(sr);
    }
    if chat {
        if let Some(role) = &choice.role {
            let mut r = String::new();
            push_str(&mut r, json, Some(role));
            acc.role = Some(r);
        }
        push_str(&mut acc.text, json, choice.content.as_ref());
        push_str(
            &mut acc.reasoning_content,
            json,
            choice.reasoning_content.as_ref(),
        );
        push_str(&mut acc.reasoning, json, choice.reasoning.as_ref());
        if let Some(Value::Array(tcs)) = parsed(&choice.tool_calls) {
            for tc in &tcs {
                merge_tool_call(&mut acc.tool_calls, tc);
            }
        }
    } else {
        push_str(&mut acc.text, json, choice.text.as_ref());
    }
    if let Some(lp) = parsed(&choice.logprobs) {
        // The merge of logprobs is `merge_choice`'s own, on that one field.
        let mut alone = ChoiceAcc::new(acc.index);
        alone.logprobs = acc.logprobs.take();
        merge_choice(&mut alone, &json!({ "logprobs": lp }), chat);
        acc.logprobs = alone.logprobs;
    }
}
