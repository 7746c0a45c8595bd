//! SSE frames and whole answers the router writes itself: `data:` frames, `[DONE]`, the error
//! frame, usage (the engine's or estimated, summed over a batch), choice reindexing, and a whole
//! answer cleaned for the client or cut into the chunks of a stream.

use bytes::Bytes;
use serde_json::{Map, Value, json};

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
/// `estimated` when any part was. The engine's details (`prompt_tokens_details`, e.g. vLLM's
/// `cached_tokens`, and `completion_tokens_details`) are kept as one engine answering the whole
/// batch writes them: absent when no part has the key, `null` when every part that has it has
/// `null`, else an object with each numeric field summed over the parts.
pub fn sum_usages<'a>(parts: impl IntoIterator<Item = &'a Value>) -> Value {
    const DETAILS: [&str; 2] = ["prompt_tokens_details", "completion_tokens_details"];
    let (mut p, mut c, mut estimated) = (0u64, 0u64, false);
    let mut details: [Option<Option<serde_json::Map<String, Value>>>; 2] = [None, None];
    for u in parts {
        let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
        p += n("prompt_tokens");
        c += n("completion_tokens");
        estimated |= u.get("estimated") == Some(&Value::Bool(true));
        for (key, sum) in DETAILS.iter().zip(details.iter_mut()) {
            match u.get(*key) {
                None => {}
                Some(Value::Object(d)) => {
                    let total = sum.get_or_insert(None).get_or_insert_with(Default::default);
                    for (k, v) in d {
                        match v.as_u64() {
                            Some(add) => {
                                let was = total.get(k).and_then(Value::as_u64).unwrap_or(0);
                                total.insert(k.clone(), (was + add).into());
                            }
                            // A field every part leaves `null` stays `null`.
                            None => {
                                total.entry(k.clone()).or_insert(Value::Null);
                            }
                        }
                    }
                }
                Some(_) => {
                    sum.get_or_insert(None);
                }
            }
        }
    }
    let mut v = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
    for (key, sum) in DETAILS.iter().zip(details) {
        if let Some(d) = sum {
            v[*key] = d.map_or(Value::Null, Value::Object);
        }
    }
    if estimated {
        v["estimated"] = Value::Bool(true);
    }
    v
}

/// Shifts every choice index of a chunk or answer by `base` (prompt `base` of a fanned-out
/// batch: its engine answered choice 0) and drops a per-part `usage` (the merged answer
/// carries one usage for the whole batch). The shift saturates: an engine index within
/// `base` of `u64::MAX` becomes `u64::MAX`, never a panic or a wrap onto another prompt's
/// choice.
pub fn reindex(v: &mut Value, base: u64) {
    let Some(obj) = v.as_object_mut() else {
        return;
    };
    obj.remove("usage");
    if let Some(choices) = obj.get_mut("choices").and_then(Value::as_array_mut) {
        for ch in choices {
            if let Some(ch) = ch.as_object_mut() {
                let i = ch.get("index").and_then(Value::as_u64).unwrap_or(0);
                ch.insert("index".into(), base.saturating_add(i).into());
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
/// and `model`. The answer's `usage` is not included (see [`usage_value`](crate::usage_value)).
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
