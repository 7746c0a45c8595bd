//! The model's own tokenizer in the router: a request's prompt tokens computed as vLLM
//! computes them, without asking an engine's `POST /tokenize`
//! (docs/design/kv-aware-placement.md, "The router's tokenizer").
//!
//! ```text
//!  model directory (vLLM's --tokenizer) ──load──► ModelTokenizer
//!    tokenizer.json ──────────────► tokenizers::Tokenizer
//!    chat_template.jinja, else tokenizer_config.json chat_template ──► minijinja template
//!    tokenizer_config.json bos_token, eos_token, ... ──► the template's special-token names
//!
//!  completion body {prompt, add_special_tokens=true} ──encode──────────────────► token ids
//!  chat body {messages, tools, add_generation_prompt=true, continue_final_message,
//!             chat_template_kwargs, documents, reasoning_effort, add_special_tokens=false}
//!        ──messages / tools as vLLM rebuilds them──► render ──encode──────────► token ids
//! ```
//!
//! Everything here follows vLLM 0.32's chat path (`vllm/renderers/`, and transformers'
//! `apply_chat_template`, which vLLM renders with). A request this cannot render as vLLM would
//! (a chat template in the request, content that is not text, a template error) is an error,
//! and the router asks the engine's `/tokenize` instead.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub mod messages;
mod template;

pub use messages::ContentFormat;

/// Why a model directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file is not what it must be (tokenizer.json the tokenizers crate cannot read,
    /// tokenizer_config.json that is not a JSON object, a template with a syntax error).
    #[error("{path}: {detail}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
}

/// Why a request's tokens were not computed here (the router then asks `/tokenize`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// The body's field named is missing or of the wrong type.
    #[error("request field `{0}` is missing or malformed")]
    Shape(&'static str),
    /// The request uses what is rendered only by the engine (named).
    #[error("not rendered in the router: {0}")]
    Unsupported(&'static str),
    /// The chat template failed (a `raise_exception`, an unknown filter), as minijinja words it.
    #[error("chat template: {0}")]
    Template(String),
    /// The tokenizer failed on the rendered text.
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// Keyword arguments of transformers' `apply_chat_template` that it consumes itself: the
/// template never sees them (the request's `chat_template_kwargs` naming them change nothing,
/// or, for `chat_template` and `return_assistant_tokens_mask`, make vLLM refuse or render
/// otherwise: [`RenderError::Unsupported`]).
const CONSUMED_KWARGS: [&str; 9] = [
    "conversation",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "tokenizer_kwargs",
    "continue_final_message",
];

/// Special-token names transformers passes to every template (`special_tokens_map`).
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// The tag transformers appends to the final message to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A model's tokenizer and chat templates, loaded once.
pub struct ModelTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    chat: Templates,
    /// The template's special-token variables (`bos_token`, ...).
    special: Map<String, Value>,
}

/// The model's chat templates: its default, and the one transformers picks for a request with
/// tools when the model names one `tool_use`; what did not compile here is left out, named.
struct Templates {
    default: Option<Chat>,
    tool_use: Option<Chat>,
    error: Option<String>,
}

/// The chat template and what vLLM derives from its source.
struct Chat {
    env: minijinja::Environment<'static>,
    source: String,
    format: ContentFormat,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .field("chat_template", &self.chat.default.is_some())
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn invalid(path: &Path, detail: impl std::fmt::Display) -> LoadError {
    LoadError::Invalid {
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// A token in tokenizer_config.json: a string, or an `AddedToken` object's `content`.
fn token_text(v: &Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Value::as_str))
}

impl ModelTokenizer {
    /// Loads `dir` as vLLM loads a model's tokenizer: `tokenizer.json` (required),
    /// `tokenizer_config.json` (its special tokens, and its `chat_template`: a string, or a list
    /// of `{name, template}`: `default`, and `tool_use` for requests with tools), and
    /// `chat_template.jinja` / `additional_chat_templates/tool_use.jinja`, which win over the
    /// config's as in transformers. No template: completions only. A template minijinja cannot
    /// compile is left out and named ([`ModelTokenizer::template_error`]).
    ///
    /// # Errors
    /// [`LoadError`] naming the file.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| invalid(&tok_path, e))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let config: Map<String, Value> = if cfg_path.exists() {
            serde_json::from_str(&read(&cfg_path)?).map_err(|e| invalid(&cfg_path, e))?
        } else {
            Map::new()
        };
        let mut special = Map::new();
        for name in SPECIAL_TOKENS {
            if let Some(t) = config.get(name).and_then(token_text) {
                special.insert(name.into(), Value::String(t.into()));
            }
        }
        if let Some(extra) = config
            .get("extra_special_tokens")
            .and_then(Value::as_object)
        {
            for (name, v) in extra {
                if let Some(t) = token_text(v) {
                    special.insert(name.clone(), Value::String(t.into()));
                }
            }
        }
        // transformers: `chat_template.jinja` and `additional_chat_templates/<name>.jinja` win
        // over tokenizer_config.json's `chat_template` (a string, or named templates).
        let named = |name: &str| -> Option<String> {
            match config.get("chat_template") {
                Some(Value::String(s)) if name == "default" => Some(s.clone()),
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .map(str::to_string),
                _ => None,
            }
        };
        let mut errors = Vec::new();
        let mut load = |file: PathBuf, name: &str| -> Result<Option<Chat>, LoadError> {
            let (source, from) = if file.exists() {
                (Some(read(&file)?), file)
            } else {
                (named(name), cfg_path.clone())
            };
            let Some(source) = source else {
                return Ok(None);
            };
            let source = template::without_generation_tags(&source);
            match template::environment(source.clone()) {
                Ok(env) => Ok(Some(Chat {
                    env,
                    format: ContentFormat::detect(&source),
                    source,
                })),
                Err(e) => {
                    errors.push(format!("{} ({name}): {e}", from.display()));
                    Ok(None)
                }
            }
        };
        let default = load(dir.join("chat_template.jinja"), "default")?;
        let tool_use = load(
            dir.join("additional_chat_templates").join("tool_use.jinja"),
            "tool_use",
        )?;
        let chat = Templates {
            default,
            tool_use,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
        };
        Ok(ModelTokenizer {
            dir: dir.to_path_buf(),
            tokenizer,
            chat,
            special,
        })
    }

    /// The model directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the model has a chat template that compiled here (else chat requests are
    /// refused with [`RenderError`], and the router asks the engine's `/tokenize`).
    #[must_use]
    pub fn has_chat_template(&self) -> bool {
        self.chat.default.is_some()
    }

    /// The content format detected from the default chat template, if any.
    #[must_use]
    pub fn content_format(&self) -> Option<ContentFormat> {
        self.chat.default.as_ref().map(|c| c.format)
    }

    /// A chat template of the model that minijinja could not compile (the file and the
    /// error): such a model's chat requests are tokenized by the engines. Loading does not
    /// fail for it: the engine renders what the router cannot.
    #[must_use]
    pub fn template_error(&self) -> Option<&str> {
        self.chat.error.as_deref()
    }

    /// `text`'s token ids, with the tokenizer's special tokens (its post-processor: a BOS)
    /// when `add_special_tokens`.
    ///
    /// # Errors
    /// [`RenderError::Encode`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, RenderError> {
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| RenderError::Encode(e.to_string()))
    }

    /// The prompt tokens the engine computes for an OpenAI request body: a completion's
    /// string `prompt` (`add_special_tokens`, default true), or a chat request's rendered
    /// messages ([`ModelTokenizer::render_chat`]; `add_special_tokens`, default false).
    ///
    /// # Errors
    /// [`RenderError`]: a body with neither a string `prompt` nor `messages` is
    /// `Shape("prompt")`.
    pub fn tokens(&self, body: &Map<String, Value>) -> Result<Vec<u32>, RenderError> {
        let special = |default: bool| {
            body.get("add_special_tokens")
                .and_then(Value::as_bool)
                .unwrap_or(default)
        };
        match (body.get("prompt"), body.get("messages")) {
            (Some(Value::String(p)), _) => self.encode(p, special(true)),
            (_, Some(Value::Array(_))) => self.encode(&self.render_chat(body)?, special(false)),
            _ => Err(RenderError::Shape("prompt")),
        }
    }

    /// A chat request's prompt text, as vLLM's chat completions render it: messages and
    /// tools rebuilt ([`messages`]), the template given `messages`, `tools`, `documents`,
    /// `add_generation_prompt` (default true), the special tokens, and the request's
    /// `chat_template_kwargs` over them (values `null` or `"auto"` dropped, as vLLM does;
    /// `reasoning_effort` and the `enable_thinking` it implies added as a chat completion
    /// adds them); `continue_final_message` cut at the end of the final message as
    /// transformers cuts it.
    ///
    /// # Errors
    /// [`RenderError`]; a request carrying its own `chat_template` is `Unsupported` (vLLM
    /// refuses it unless trusted, and renders it only then).
    pub fn render_chat(&self, body: &Map<String, Value>) -> Result<String, RenderError> {
        let with_tools = body.get("tools").is_some_and(|t| !t.is_null())
            || body
                .get("chat_template_kwargs")
                .and_then(|k| k.get("tools"))
                .is_some_and(|t| !t.is_null());
        let chat = match (&self.chat.tool_use, &self.chat.default) {
            (Some(t), _) if with_tools => t,
            (_, Some(d)) => d,
            _ => {
                return Err(match &self.chat.error {
                    Some(e) => RenderError::Template(e.clone()),
                    None => RenderError::Unsupported("the model has no chat template"),
                });
            }
        };
        let messages = body
            .get("messages")
            .and_then(Value::as_array)
            .ok_or(RenderError::Shape("messages"))?;
        let mut kwargs = match body.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(o)) => o.clone(),
            Some(_) => return Err(RenderError::Shape("chat_template_kwargs")),
        };
        let present = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
        if present(body.get("chat_template"))
            || present(kwargs.get("chat_template"))
            || present(kwargs.get("return_assistant_tokens_mask"))
        {
            return Err(RenderError::Unsupported("a chat template in the request"));
        }
        // A chat completion's own fields over its kwargs (`ChatCompletionRequest.
        // build_chat_params`: `merge_kwargs(chat_template_kwargs, extra)`, where a null or
        // "auto" field does not override); `enable_thinking` follows `reasoning_effort` unless
        // the kwargs name it, even as null.
        let effort = body.get("reasoning_effort").filter(|v| !v.is_null());
        if let Some(effort) = effort
            && !kwargs.contains_key("enable_thinking")
        {
            kwargs.insert(
                "enable_thinking".into(),
                Value::Bool(effort.as_str() != Some("none")),
            );
        }
        for key in ["documents", "reasoning_effort"] {
            if let Some(v) = body
                .get(key)
                .filter(|v| !v.is_null() && v.as_str() != Some("auto"))
            {
                kwargs.insert(key.into(), v.clone());
            }
        }
        // The merge over the server's defaults drops null and "auto" (`merge_kwargs` in
        // `preprocess_chat`); what transformers consumes itself never reaches the template.
        kwargs.retain(|k, v| {
            !(v.is_null() || v.as_str() == Some("auto") || CONSUMED_KWARGS.contains(&k.as_str()))
        });
        let flag = |k: &str, default: bool| body.get(k).and_then(Value::as_bool).unwrap_or(default);
        let continue_final = flag("continue_final_message", false);
        let generation = flag("add_generation_prompt", true);
        if continue_final && generation {
            // vLLM refuses both (400), as its request validator does.
            return Err(RenderError::Shape("continue_final_message"));
        }
        let tools = match kwargs
            .remove("tools")
            .or_else(|| body.get("tools").cloned())
        {
            None | Some(Value::Null) => Value::Null,
            Some(Value::Array(t)) => Value::Array(messages::tools(&t)?),
            Some(_) => return Err(RenderError::Shape("tools")),
        };
        let documents = kwargs.remove("documents").unwrap_or(Value::Null);
        let mut conversation = messages::conversation(messages, chat.format, &chat.source)?;
        let final_text = if continue_final {
            Some(mark_final(&mut conversation, &chat.source)?)
        } else {
            None
        };
        let mut ctx = self.special.clone();
        ctx.extend(kwargs);
        ctx.insert("messages".into(), Value::Array(conversation));
        ctx.insert("tools".into(), tools);
        ctx.insert("documents".into(), documents);
        ctx.insert("add_generation_prompt".into(), Value::Bool(generation));
        let rendered = chat
            .env
            .get_template(template::CHAT)
            .and_then(|t| t.render(minijinja::Value::from_serialize(&ctx)))
            .map_err(|e| RenderError::Template(error_text(&e)))?;
        match final_text {
            None => Ok(rendered),
            Some(final_text) => cut_at_tag(rendered, &final_text),
        }
    }
}

/// A minijinja error with its causes, on one line.
fn error_text(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// transformers' `continue_final_message`: [`CONTINUE_TAG`] appended to the final message's
/// content (its last text part in the `openai` format); the final text returned.
fn mark_final(conversation: &mut [Value], source: &str) -> Result<String, RenderError> {
    if !source.contains("content") {
        return Err(RenderError::Unsupported(
            "continue_final_message with a template that never reads content",
        ));
    }
    let last = conversation
        .last_mut()
        .ok_or(RenderError::Shape("messages"))?;
    match last.get_mut("content") {
        Some(Value::String(s)) => {
            let text = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok(text)
        }
        Some(Value::Array(parts)) => {
            for p in parts.iter_mut().rev() {
                if let Some(Value::String(t)) = p.get_mut("text") {
                    let text = t.clone();
                    t.push_str(CONTINUE_TAG);
                    return Ok(text);
                }
            }
            Err(RenderError::Shape("messages[-1].content"))
        }
        _ => Err(RenderError::Shape("messages[-1].content")),
    }
}

/// The rendered chat cut where the marked final message ends (transformers: at the last
/// tag, and with trailing whitespace removed when the template trimmed the tag's space).
fn cut_at_tag(rendered: String, final_text: &str) -> Result<String, RenderError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_text.trim()) || !rendered.contains(tag) {
        return Err(RenderError::Template(
            "continue_final_message: the template dropped part of the final message".into(),
        ));
    }
    let at = rendered.rfind(tag).unwrap_or(rendered.len());
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_string())
    } else {
        Ok(rendered[..at].trim_end().to_string())
    }
}

#[cfg(test)]
mod tests;
