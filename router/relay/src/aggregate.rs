//! One answer from a stream: a non-streaming client's `text_completion` / `chat.completion`
//! built from the relayed chunks ([`Aggregator`]), and an engine's SSE answer to a
//! non-streaming leg assembled into one ([`assemble_sse`]).

use serde_json::{Map, Value, json};

use crate::RelayOptions;
use crate::RelayStep;
use crate::SseParser;
use crate::StreamFailure;
use crate::StreamState;
use crate::chunk_usage;

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
    let mut parser = SseParser::with_limit(bytes.len() + 1);
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
