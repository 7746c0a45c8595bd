//! The engine simulator's toy tokenizer's words and ids, and a model directory that gives the
//! router's own tokenizer (`engine.tokenizer`) the same tokens for a known set of words.
//!
//! ```text
//!  word ──FNV-1a 64 mod VOCAB──► id            (the simulator: every whitespace-split word)
//!  model_dir(words, template) ──► tokenizer.json: WordLevel {word: id}, split on whitespace,
//!                                 the chat template words whole; tokenizer_config.json with
//!                                 the template
//! ```
//!
//! [`SIM_TEMPLATE`] renders chat messages to the words the simulator's fixed template makes
//! (`tests/src/bin/narwhal-engine-sim/tokenizer.rs`, `chat_tokens`), so router and simulator
//! agree on completions and plain chat for prompts made of the given words. Tools are
//! rendered differently on purpose (the simulator pretty-prints the request's tools as they
//! came; a template sees them as vLLM's `model_dump()` gives them), which is what a test of the
//! router's per-shape fallback needs.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

/// Vocabulary size: every token id is `< VOCAB`.
pub const VOCAB: u32 = 32_000;

/// The simulator template's words.
pub const CHAT_BEGIN: &str = "<|begin_of_text|>";
/// Starts a turn.
pub const CHAT_START: &str = "<|start_header|>";
/// Ends a turn.
pub const CHAT_END: &str = "<|eot|>";

/// FNV-1a 64 offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// FNV-1a over bytes, 64-bit, continuing from `h`. Stable across processes and platforms.
#[must_use]
pub fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Token id of one whitespace-separated word: stable hash modulo [`VOCAB`].
#[must_use]
pub fn word_id(word: &str) -> u32 {
    (fnv1a(word.as_bytes(), FNV_OFFSET) % u64::from(VOCAB)) as u32
}

/// A chat template that renders to the simulator's chat words: BOS, per message
/// `<|start_header|> role content <|eot|>`, and the generation prompt; with tools, a `tools`
/// turn of their `tojson(indent=2)` first.
pub const SIM_TEMPLATE: &str = "<|begin_of_text|>{% if tools %} <|start_header|> tools {{ tools | tojson(indent=2) }} <|eot|>{% endif %}{% for m in messages %} <|start_header|> {{ m.role }} {{ m.content }} <|eot|>{% endfor %}{% if add_generation_prompt %} <|start_header|> assistant{% endif %}";

/// Writes a model directory into `dir`: a tokenizer.json giving each of `words` (and the
/// template's words and roles) the simulator's id, and a tokenizer_config.json with
/// `template`. Words the vocabulary lacks become `[UNK]` (id `VOCAB`), so a prompt with
/// other words tokenizes differently from the simulator.
///
/// # Panics
/// When the files cannot be written (a test's temporary directory).
pub fn model_dir(dir: &Path, words: &[&str], template: &str) {
    let fixed = [
        CHAT_BEGIN,
        CHAT_START,
        CHAT_END,
        "system",
        "user",
        "assistant",
        "tool",
        "tools",
    ];
    let mut vocab: BTreeMap<String, u32> = fixed
        .iter()
        .chain(words)
        .map(|w| ((*w).to_string(), word_id(w)))
        .collect();
    vocab.insert("[UNK]".into(), VOCAB);
    let tokenizer = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens: Vec::new(),
        normalizer: None,
        pre_tokenizer: Typed {
            kind: "WhitespaceSplit",
        },
        post_processor: None,
        decoder: None,
        model: WordLevel {
            kind: "WordLevel",
            vocab,
            unk_token: "[UNK]",
        },
    };
    let text = serde_json::to_string(&tokenizer).expect("tokenizer.json");
    std::fs::write(dir.join("tokenizer.json"), text).expect("tokenizer.json");
    let config = serde_json::to_string(&TokenizerConfig {
        chat_template: template,
    })
    .expect("tokenizer_config.json");
    std::fs::write(dir.join("tokenizer_config.json"), config).expect("tokenizer_config.json");
}

/// The `tokenizer.json` [`model_dir`] writes (the `tokenizers` crate's format, the members a
/// word-level tokenizer needs).
#[derive(Serialize)]
struct TokenizerJson {
    version: &'static str,
    truncation: Option<()>,
    padding: Option<()>,
    added_tokens: Vec<()>,
    normalizer: Option<()>,
    pre_tokenizer: Typed,
    post_processor: Option<()>,
    decoder: Option<()>,
    model: WordLevel,
}

/// A component named only by its `type`.
#[derive(Serialize)]
struct Typed {
    #[serde(rename = "type")]
    kind: &'static str,
}

/// A word-level model: each word's id, and the id of any other word.
#[derive(Serialize)]
struct WordLevel {
    #[serde(rename = "type")]
    kind: &'static str,
    vocab: BTreeMap<String, u32>,
    unk_token: &'static str,
}

/// The `tokenizer_config.json` [`model_dir`] writes.
#[derive(Serialize)]
struct TokenizerConfig<'a> {
    chat_template: &'a str,
}
