//! What a request's body tells the KV score, before any engine is asked (pure): the
//! `/tokenize` body that renders its prompt as the engine will, whether the engine keys its
//! blocks by something the router cannot compute, the keys it can (adapter, salt), and which
//! engine to tokenize on (docs/design/kv-aware-placement.md, sections 1.1 and 4).

use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::TokenizeError;
use crate::kv_index::PromptKeys;

/// `(engine, resident requests)` of every live engine, config order.
/// The `/tokenize` body that gives the tokens the engine will compute for a request: vLLM's
/// `TokenizeCompletionRequest` (`prompt`, `add_special_tokens`) or `TokenizeChatRequest`
/// (`vllm/entrypoints/serve/tokenize/protocol.py`: `messages`, `add_generation_prompt`,
/// `continue_final_message`, `add_special_tokens`, `chat_template`, `chat_template_kwargs`,
/// `tools`, `mm_processor_kwargs`, `media_io_kwargs`), every field the request sets that changes
/// the rendered prompt. A chat completion also renders `documents` and `reasoning_effort` (and
/// `enable_thinking` from it, unless the request's kwargs name it) through its template's
/// kwargs (`ChatCompletionRequest.build_chat_params`), which the tokenize form has no fields
/// for: they are passed the same way, as `chat_template_kwargs`.
///
/// # Errors
/// [`TokenizeError::Shape`] for a body with neither a string `prompt` nor a `messages` list.
pub(crate) fn tokenize_body(
    model: &str,
    body: &Map<String, Value>,
) -> Result<Value, TokenizeError> {
    let mut req = json!({"model": model});
    let copy = |req: &mut Value, keys: &[&str]| {
        for k in keys {
            if let Some(v) = body.get(*k).filter(|v| !v.is_null()) {
                req[*k] = v.clone();
            }
        }
    };
    match (body.get("prompt"), body.get("messages")) {
        (Some(p @ Value::String(_)), _) => {
            req["prompt"] = p.clone();
            copy(&mut req, &["add_special_tokens"]);
        }
        (_, Some(Value::Array(ms))) => {
            // A chat completion renames an assistant's `reasoning_content` to `reasoning`
            // (vLLM's `ChatCompletionRequest`) before rendering; `/tokenize` reads only
            // `reasoning`.
            let renamed = ms
                .iter()
                .map(|m| match m {
                    Value::Object(o)
                        if o.contains_key("reasoning_content") && !o.contains_key("reasoning") =>
                    {
                        let mut o = o.clone();
                        if let Some(r) = o.remove("reasoning_content") {
                            o.insert("reasoning".into(), r);
                        }
                        Value::Object(o)
                    }
                    other => other.clone(),
                })
                .collect();
            req["messages"] = Value::Array(renamed);
            // vLLM's chat completions and its `/tokenize` chat form both default to adding the
            // generation prompt; the request's own choice wins.
            req["add_generation_prompt"] = body
                .get("add_generation_prompt")
                .cloned()
                .unwrap_or(Value::Bool(true));
            copy(
                &mut req,
                &[
                    "continue_final_message",
                    "add_special_tokens",
                    "chat_template",
                    "tools",
                    "mm_processor_kwargs",
                    "media_io_kwargs",
                ],
            );
            let mut kwargs = body
                .get("chat_template_kwargs")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            if let Some(d) = body.get("documents").filter(|v| !v.is_null()) {
                kwargs.insert("documents".into(), d.clone());
            }
            if let Some(effort) = body.get("reasoning_effort").filter(|v| !v.is_null()) {
                kwargs.insert("reasoning_effort".into(), effort.clone());
                if !kwargs.contains_key("enable_thinking") {
                    kwargs.insert(
                        "enable_thinking".into(),
                        Value::Bool(effort.as_str() != Some("none")),
                    );
                }
            }
            if !kwargs.is_empty() {
                req["chat_template_kwargs"] = Value::Object(kwargs);
            }
        }
        _ => return Err(TokenizeError::Shape),
    }
    Ok(req)
}

/// What in a request body vLLM adds to its blocks' keys besides their tokens
/// (`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`) that the index cannot
/// key a request by: multimodal inputs (vLLM's content hash of each processed item, on the
/// blocks their placeholder tokens fill) and prompt embeddings (a digest of each block's
/// tensor). `None` for a request keyed by its tokens, adapter and salt alone ([`prompt_keys`]).
/// A request named here is placed by load (docs/design/kv-aware-placement.md, "not done
/// yet"); the blocks such requests store carry those keys in their events, so no other request
/// is ever credited with them.
pub(crate) fn keyed_beyond_tokens(body: &Map<String, Value>) -> Option<&'static str> {
    let present = |k: &str| body.get(k).is_some_and(|v| !v.is_null());
    if present("prompt_embeds") {
        return Some("prompt_embeds");
    }
    let multimodal = body
        .get("messages")
        .and_then(Value::as_array)
        .is_some_and(|ms| {
            ms.iter().any(|m| {
                m.get("content")
                    .and_then(Value::as_array)
                    .is_some_and(|parts| {
                        parts.iter().any(|p| {
                            p.get("type")
                                .and_then(Value::as_str)
                                .is_some_and(|t| t != "text")
                        })
                    })
            })
        });
    multimodal.then_some("multimodal")
}

/// What a request's blocks are keyed by beyond its tokens that the index keys too
/// ([`PromptKeys`]): its adapter (`model` naming anything but `served`, the configured model:
/// vLLM serves an adapter under the name a client puts in `model`, and keys its blocks by
/// that name) and its `cache_salt` (a non-empty string; vLLM refuses any other with a 400).
pub(crate) fn prompt_keys<'a>(served: &str, body: &'a Map<String, Value>) -> PromptKeys<'a> {
    let text = |k: &str| body.get(k).and_then(Value::as_str);
    PromptKeys {
        lora: text("model").filter(|m| *m != served),
        salt: text("cache_salt").filter(|s| !s.is_empty()),
    }
}

/// The engine to ask `/tokenize` for a score: the least loaded of `live` (`(engine, resident
/// requests)`; ties by config order) whose last `/tokenize` did not fail less than `avoid`
/// before `now` (`failed`, per engine in config order); `None` when every live engine failed
/// that recently (the request is then placed by load at once, not after another timeout).
pub(super) fn tokenize_engine(
    live: &[(usize, u32)],
    failed: &[Option<Instant>],
    now: Instant,
    avoid: Duration,
) -> Option<usize> {
    live.iter()
        .filter(|(e, _)| {
            failed
                .get(*e)
                .copied()
                .flatten()
                .is_none_or(|t| now.saturating_duration_since(t) >= avoid)
        })
        .min_by_key(|(e, load)| (*load, *e))
        .map(|(e, _)| *e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field that changes the rendered prompt reaches `/tokenize`: a chat request's
    /// tools, special tokens, template and its kwargs (with `documents` and `reasoning_effort`,
    /// which the tokenize form takes only as kwargs), a completion's `add_special_tokens`;
    /// before, tools were dropped and block 0 never matched what the engine hashed.
    #[test]
    fn the_tokenize_body_carries_what_renders_the_prompt() {
        let body = |v: Value| v.as_object().expect("object").clone();
        let tools = serde_json::json!([{"type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let chat = body(
            serde_json::json!({"model": "m", "messages": [{"role": "user",
            "content": "hi"}], "tools": tools, "add_special_tokens": true,
            "chat_template_kwargs": {"x": 1}, "documents": [{"title": "t", "text": "d"}],
            "reasoning_effort": "low", "max_tokens": 5, "stream": true}),
        );
        let r = tokenize_body("served", &chat).expect("chat");
        assert_eq!(r["model"], "served");
        let thought = body(serde_json::json!({"messages": [
            {"role": "assistant", "content": "a", "reasoning_content": "r"}]}));
        let t = tokenize_body("m", &thought).expect("chat");
        assert_eq!(
            t["messages"][0]["reasoning"], "r",
            "renamed as a chat completion renames it"
        );
        assert_eq!(r["tools"], tools);
        assert_eq!(r["add_special_tokens"], true);
        assert_eq!(r["add_generation_prompt"], true);
        assert_eq!(
            r["chat_template_kwargs"],
            serde_json::json!({"x": 1, "documents": [{"title": "t", "text": "d"}],
                               "reasoning_effort": "low", "enable_thinking": true})
        );
        assert!(
            r.get("max_tokens").is_none() && r.get("stream").is_none(),
            "{r}"
        );
        let plain = body(serde_json::json!({"messages": [], "add_generation_prompt": false}));
        let r = tokenize_body("m", &plain).expect("chat");
        assert_eq!(r["add_generation_prompt"], false);
        assert!(
            r.get("chat_template_kwargs").is_none() && r.get("tools").is_none(),
            "{r}"
        );
        let completion = body(serde_json::json!({"prompt": "p", "add_special_tokens": false}));
        let r = tokenize_body("m", &completion).expect("completion");
        assert_eq!(
            r,
            serde_json::json!({"model": "m", "prompt": "p", "add_special_tokens": false})
        );
        assert!(tokenize_body("m", &body(serde_json::json!({"prompt": 3}))).is_err());
    }

    /// `cache_salt`, prompt embeddings and any non-text content part key a request's blocks
    /// beyond its tokens; plain text (as a string or text parts) does not.
    #[test]
    fn requests_keyed_beyond_their_tokens_are_named() {
        let k = |v: Value| keyed_beyond_tokens(v.as_object().expect("object"));
        assert_eq!(
            k(serde_json::json!({"prompt": "p", "cache_salt": "t"})),
            None,
            "a salt is keyed (prompt_keys)"
        );
        assert_eq!(
            k(serde_json::json!({"prompt_embeds": "AAAA"})),
            Some("prompt_embeds")
        );
        let image = serde_json::json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]});
        assert_eq!(k(image), Some("multimodal"));
        let text = serde_json::json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "hello"}]}, {"role": "assistant", "content": "hi"}]});
        assert_eq!(k(text), None);
        assert_eq!(k(serde_json::json!({"prompt": "p"})), None);
    }

    /// A request's adapter is its `model` when that is not the served model, its salt a
    /// non-empty `cache_salt`; each changes the chain's seed, both together differ from
    /// either, and a plain request's seed is 0 (its chain as before keys existed).
    #[test]
    fn a_requests_adapter_and_salt_seed_its_chain() {
        let keys = |v: Value| {
            let m = v.as_object().expect("object").clone();
            prompt_keys("base", &m).seed()
        };
        let plain = keys(serde_json::json!({"model": "base", "prompt": "p"}));
        assert_eq!(plain, 0);
        assert_eq!(keys(serde_json::json!({"prompt": "p"})), 0);
        assert_eq!(
            keys(serde_json::json!({"prompt": "p", "cache_salt": ""})),
            0
        );
        let salted = keys(serde_json::json!({"prompt": "p", "cache_salt": "t1"}));
        let other = keys(serde_json::json!({"prompt": "p", "cache_salt": "t2"}));
        let adapter = keys(serde_json::json!({"model": "t1", "prompt": "p"}));
        let both = keys(serde_json::json!({"model": "t1", "prompt": "p", "cache_salt": "t1"}));
        let all = [plain, salted, other, adapter, both];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b, "{all:?}");
            }
        }
    }

    #[test]
    fn a_score_tokenizes_on_the_least_loaded_engine_whose_tokenize_did_not_just_fail() {
        let t = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
        let avoid = Duration::from_secs(10);
        let live = [(0, 0), (1, 0), (2, 3)];
        let mut failed = vec![None; 3];
        assert_eq!(tokenize_engine(&live, &failed, t, avoid), Some(0));
        // Engine 0's /tokenize timed out (a stalled engine): the next least loaded is asked.
        failed[0] = Some(t);
        assert_eq!(tokenize_engine(&live, &failed, t, avoid), Some(1));
        assert_eq!(
            tokenize_engine(&live, &failed, t + Duration::from_secs(9), avoid),
            Some(1)
        );
        assert_eq!(
            tokenize_engine(&live, &failed, t + avoid, avoid),
            Some(0),
            "asked again after the avoid time"
        );
        // Every live engine failed just now: none (placed by load at once).
        failed = vec![Some(t); 3];
        assert_eq!(tokenize_engine(&live, &failed, t, avoid), None);
        assert_eq!(tokenize_engine(&[], &failed, t, avoid), None);
    }
}
