//! A chat request's messages and tools as vLLM hands them to the chat template (pure). vLLM
//! 0.32 rebuilds every message before rendering (`vllm/renderers/chat_utils.py`,
//! `_parse_chat_message_content` and `_postprocess_messages`; `vllm/renderers/hf.py`):
//!
//! - content: in the `string` format (the template never loops over a message's content) the
//!   text parts joined with `"\n"`, empty ones dropped, `null` as `""`; in the `openai` format
//!   a list of `{"type": "text", "text": ...}` parts, a string as one part, `null` as `[]`,
//!   except a tool message made only of text parts, joined back into a string;
//! - kept besides `role` and `content`: `name` and `task` (strings), a tool message's
//!   `tool_call_id`, an assistant's `tool_calls` (each `function.arguments` string parsed into
//!   an object, `{}` when it is not one; an empty list dropped) and its `reasoning` (also as
//!   `reasoning_content`; a chat completion renames a client's `reasoning_content` to
//!   `reasoning` first), a developer message's `tools`; every other key dropped;
//! - developer messages become system ones when the template never names `"developer"`, and
//!   system messages are then merged into one first message (contents joined with `"\n\n"`);
//! - tools as vLLM's `ChatCompletionToolsParam.model_dump()`: `type`, and `function` with
//!   `name`, `description` and `parameters` (`null` when absent), `strict` and
//!   `defer_loading` only when set; every other key dropped.

use serde_json::{Map, Value};

use crate::RenderError;

/// How the template reads a message's content (vLLM's `--chat-template-content-format auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// A string.
    String,
    /// A list of OpenAI content parts.
    OpenAi,
}

impl ContentFormat {
    /// vLLM's detection on the template's source: `openai` when a `for` loop iterates over a
    /// message's content (`message['content']`, `message.content`, through filters or a
    /// slice, on a name bound by a loop over `messages`) or over a name `content`; else
    /// `string`. vLLM walks the parsed template; this scans its `{% for %}` tags, which finds
    /// the same loops in the templates models ship (a miss is caught by the agreement check).
    #[must_use]
    pub fn detect(template: &str) -> ContentFormat {
        let loops = for_loops(template);
        // Names bound to the messages: `messages` and what `{% set x = messages[...] %}` binds.
        let mut lists = vec!["messages"];
        lists.extend(set_from(template, "messages"));
        let items: Vec<&str> = loops
            .iter()
            .filter(|(_, iter)| lists.contains(&base_name(iter)) && iter_is_plain(iter))
            .map(|(target, _)| *target)
            .collect();
        for (_, raw) in &loops {
            if raw.trim() == "content" {
                return ContentFormat::OpenAi;
            }
            let iter = strip_filters(raw);
            for m in &items {
                for access in [
                    format!("{m}['content']"),
                    format!("{m}[\"content\"]"),
                    format!("{m}.content"),
                ] {
                    if iter == access || iter.starts_with(&format!("{access}[")) {
                        return ContentFormat::OpenAi;
                    }
                }
            }
        }
        ContentFormat::String
    }
}

/// The statements of every `{% ... %}` tag, whitespace control and blanks trimmed.
fn statements(template: &str) -> impl Iterator<Item = &str> {
    let mut rest = template;
    std::iter::from_fn(move || {
        let start = rest.find("{%")?;
        rest = &rest[start + 2..];
        let end = rest.find("%}")?;
        let tag = rest[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        rest = &rest[end + 2..];
        Some(tag)
    })
}

/// The names `{% set name = source... %}` binds from `source` (a slice or the list itself).
fn set_from<'a>(template: &'a str, source: &str) -> Vec<&'a str> {
    statements(template)
        .filter_map(|tag| tag.strip_prefix("set ")?.split_once('='))
        .filter(|(_, value)| {
            let value = value.trim();
            base_name(value) == source && iter_is_plain(value)
        })
        .map(|(name, _)| name.trim())
        .collect()
}

/// `(target, iterable)` of every `{% for target in iterable %}` tag.
fn for_loops(template: &str) -> Vec<(&str, &str)> {
    statements(template)
        .filter_map(|tag| tag.strip_prefix("for ")?.split_once(" in "))
        .map(|(target, iter)| {
            // `for x in xs if cond` and `recursive`: the iterable ends before them.
            let iter = iter.split(" if ").next().unwrap_or(iter);
            let iter = iter.trim().trim_end_matches("recursive").trim();
            (target.trim(), iter)
        })
        .collect()
}

/// The iterable without trailing filters (`xs | selectattr(...)`) or tests.
fn strip_filters(iter: &str) -> &str {
    iter.split('|').next().unwrap_or(iter).trim()
}

/// The leading name of an iterable (`messages` of `messages[1:]`).
fn base_name(iter: &str) -> &str {
    let iter = strip_filters(iter);
    let end = iter
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(iter.len());
    &iter[..end]
}

/// An iterable that is a name, maybe sliced (`messages`, `messages[1:]`).
fn iter_is_plain(iter: &str) -> bool {
    let iter = strip_filters(iter);
    let name = base_name(iter);
    let rest = &iter[name.len()..];
    rest.is_empty() || (rest.starts_with('[') && rest.contains(':'))
}

/// A message's text parts, or the refusal for a part the router cannot render (an image, an
/// audio clip: such requests are placed by load before they get here).
fn text_parts(content: &Value) -> Result<Vec<String>, RenderError> {
    match content {
        Value::Null => Ok(Vec::new()),
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p {
                Value::String(s) => Ok(s.clone()),
                Value::Object(o) => {
                    let kind = o.get("type").and_then(Value::as_str).unwrap_or("text");
                    let text = match kind {
                        "text" | "input_text" | "output_text" => o.get("text"),
                        "refusal" => o.get("refusal"),
                        "thinking" => o.get("thinking"),
                        _ => {
                            return Err(RenderError::Unsupported(
                                "a content part that is not text",
                            ));
                        }
                    };
                    text.and_then(Value::as_str)
                        .map(str::to_string)
                        .ok_or(RenderError::Shape("messages[].content[].text"))
                }
                _ => Err(RenderError::Shape("messages[].content[]")),
            })
            .collect(),
        _ => Err(RenderError::Shape("messages[].content")),
    }
}

/// A JSON object of `fields`, in order.
fn object<const N: usize>(fields: [(&str, Value); N]) -> Value {
    Value::Object(
        fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    )
}

/// One message as the template sees it.
fn message(m: &Value, format: ContentFormat) -> Result<Value, RenderError> {
    let m = m.as_object().ok_or(RenderError::Shape("messages[]"))?;
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or(RenderError::Shape("messages[].role"))?;
    let parts = text_parts(m.get("content").unwrap_or(&Value::Null))?;
    let content = match format {
        ContentFormat::String => Value::String(
            parts
                .into_iter()
                .filter(|p| !p.is_empty())
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        ContentFormat::OpenAi if role == "tool" => Value::String(parts.join("\n")),
        ContentFormat::OpenAi => Value::Array(
            parts
                .into_iter()
                .map(|t| {
                    object([
                        ("type", Value::String("text".into())),
                        ("text", Value::String(t)),
                    ])
                })
                .collect(),
        ),
    };
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.into()));
    out.insert("content".into(), content);
    for key in ["name", "task"] {
        if let Some(v @ Value::String(_)) = m.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    match role {
        "tool" => {
            if let Some(id) = m.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
        }
        "assistant" => {
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array)
                && !calls.is_empty()
            {
                out.insert(
                    "tool_calls".into(),
                    Value::Array(calls.iter().map(tool_call).collect::<Result<_, _>>()?),
                );
            }
            let reasoning = m
                .get("reasoning")
                .filter(|v| !v.is_null())
                .or_else(|| m.get("reasoning_content").filter(|v| !v.is_null()));
            if let Some(r) = reasoning {
                out.insert("reasoning".into(), r.clone());
                out.insert("reasoning_content".into(), r.clone());
            }
        }
        "developer" => {
            out.insert(
                "tools".into(),
                m.get("tools").cloned().unwrap_or(Value::Null),
            );
        }
        _ => {}
    }
    Ok(Value::Object(out))
}

/// An assistant's tool call with its `function.arguments` parsed into an object (`{}` when
/// empty, not JSON, or not an object).
fn tool_call(call: &Value) -> Result<Value, RenderError> {
    let mut call = call.clone();
    let kind = call
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("function");
    if kind != "function" {
        return Err(RenderError::Unsupported(
            "a tool call that is not a function",
        ));
    }
    if let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) {
        let parsed = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .ok()
                .filter(Value::is_object)
                .unwrap_or_else(|| Value::Object(Map::new())),
            Some(v @ Value::Object(_)) => v.clone(),
            _ => Value::Object(Map::new()),
        };
        f.insert("arguments".into(), parsed);
    }
    Ok(call)
}

/// The conversation the template renders: every message rebuilt ([`message`]), developer
/// messages turned into system ones and system messages merged when the template does not
/// name the developer role.
///
/// # Errors
/// [`RenderError::Shape`] naming a malformed field; [`RenderError::Unsupported`] for a part
/// that is not text.
pub fn conversation(
    messages: &[Value],
    format: ContentFormat,
    template: &str,
) -> Result<Vec<Value>, RenderError> {
    let mut out = messages
        .iter()
        .map(|m| message(m, format))
        .collect::<Result<Vec<_>, _>>()?;
    let role = |m: &Value| m.get("role").and_then(Value::as_str).map(str::to_string);
    let developer_named = template.contains("\"developer\"") || template.contains("'developer'");
    if developer_named || !out.iter().any(|m| role(m).as_deref() == Some("developer")) {
        return Ok(out);
    }
    for m in &mut out {
        if role(m).as_deref() == Some("developer")
            && let Some(o) = m.as_object_mut()
        {
            o.insert("role".into(), Value::String("system".into()));
            o.remove("tools");
        }
    }
    let mut system = Vec::new();
    let mut rest = Vec::new();
    let mut merge = false;
    for (i, m) in out.into_iter().enumerate() {
        if role(&m).as_deref() != Some("system") {
            rest.push(m);
            continue;
        }
        merge |= i > 0 || !system.is_empty();
        let text = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        if !text.is_empty() {
            system.push(text);
        }
        rest.push(m);
    }
    if !merge {
        return Ok(rest);
    }
    let mut merged = vec![object([
        ("role", Value::String("system".into())),
        ("content", Value::String(system.join("\n\n"))),
    ])];
    merged.extend(
        rest.into_iter()
            .filter(|m| role(m).as_deref() != Some("system")),
    );
    Ok(merged)
}

/// The request's `tools` as vLLM's `model_dump()` gives them to the template.
///
/// # Errors
/// [`RenderError::Shape`] naming a tool without a function name.
pub fn tools(tools: &[Value]) -> Result<Vec<Value>, RenderError> {
    tools
        .iter()
        .map(|t| {
            let f = t
                .get("function")
                .and_then(Value::as_object)
                .ok_or(RenderError::Shape("tools[].function"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or(RenderError::Shape("tools[].function.name"))?;
            let defer = t.get("defer_loading").filter(|v| !v.is_null());
            let mut func = Map::new();
            func.insert("name".into(), Value::String(name.into()));
            for k in ["description", "parameters"] {
                func.insert(k.into(), f.get(k).cloned().unwrap_or(Value::Null));
            }
            if let Some(s) = f.get("strict").filter(|v| !v.is_null()) {
                func.insert("strict".into(), s.clone());
            }
            if let Some(d) = f.get("defer_loading").filter(|v| !v.is_null()).or(defer) {
                func.insert("defer_loading".into(), d.clone());
            }
            let mut tool = Map::new();
            tool.insert("type".into(), Value::String("function".into()));
            tool.insert("function".into(), Value::Object(func));
            if let Some(d) = defer {
                tool.insert("defer_loading".into(), d.clone());
            }
            Ok(Value::Object(tool))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_content_format_is_openai_only_when_a_loop_walks_a_messages_content() {
        let string = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
        assert_eq!(ContentFormat::detect(string), ContentFormat::String);
        // A filtered `content` is not the bare name vLLM's fallback looks for.
        assert_eq!(
            ContentFormat::detect("{% for c in content | list %}{% endfor %}"),
            ContentFormat::String
        );
        for openai in [
            "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
            "{%- set loop_messages = messages[1:] %}{% for message in loop_messages %}{% for b in message['content'] %}{% endfor %}{% endfor %}",
            "{%- for message in messages[1:] -%}{%- for c in message.content | selectattr('type') -%}{%- endfor -%}{%- endfor -%}",
            "{% for item in content %}{{ item }}{% endfor %}",
        ] {
            assert_eq!(
                ContentFormat::detect(openai),
                ContentFormat::OpenAi,
                "{openai}"
            );
        }
    }

    #[test]
    fn messages_are_rebuilt_as_vllm_rebuilds_them() {
        let msgs = vec![
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}], "extra": 1}),
            json!({"role": "assistant", "content": null, "reasoning_content": "think",
                   "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
                                  {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}),
            json!({"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}),
        ];
        let out = conversation(&msgs, ContentFormat::String, "").expect("ok");
        assert_eq!(out[0], json!({"role": "user", "content": "a\nb"}));
        assert_eq!(out[1]["content"], json!(""));
        assert_eq!(out[1]["reasoning"], json!("think"));
        assert_eq!(out[1]["reasoning_content"], json!("think"));
        assert_eq!(
            out[1]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(out[1]["tool_calls"][1]["function"]["arguments"], json!({}));
        assert_eq!(
            out[2],
            json!({"role": "tool", "content": "42", "name": "f", "tool_call_id": "c1"})
        );
        let openai = conversation(&msgs[..1], ContentFormat::OpenAi, "").expect("ok");
        assert_eq!(openai[0]["content"].as_array().map(Vec::len), Some(3));
        let image =
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]});
        assert!(matches!(
            conversation(&[image], ContentFormat::String, ""),
            Err(RenderError::Unsupported(_))
        ));
    }

    #[test]
    fn developer_messages_become_one_leading_system_message_unless_the_template_names_them() {
        let msgs = vec![
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": "u"}),
            json!({"role": "developer", "content": "d", "tools": []}),
        ];
        let out = conversation(&msgs, ContentFormat::String, "plain").expect("ok");
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], json!({"role": "system", "content": "s\n\nd"}));
        let kept =
            conversation(&msgs, ContentFormat::String, "{% if r == 'developer' %}").expect("ok");
        assert_eq!(kept[2]["role"], json!("developer"));
        assert_eq!(kept[2]["tools"], json!([]));
    }

    #[test]
    fn tools_are_what_model_dump_gives() {
        let t = tools(&[json!({"type": "function", "function": {"name": "f", "x": 1}, "y": 2})])
            .expect("ok");
        assert_eq!(
            t[0],
            json!({"type": "function", "function": {"name": "f", "description": null, "parameters": null}})
        );
        assert!(tools(&[json!({"type": "function"})]).is_err());
    }
}
