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

use std::path::Path;

use serde_json::{Map, Value, json};

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
    let mut vocab = Map::new();
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
    for w in fixed.iter().chain(words) {
        vocab.insert((*w).to_string(), json!(word_id(w)));
    }
    vocab.insert("[UNK]".into(), json!(VOCAB));
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": Value::Object(vocab), "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("tokenizer.json");
    let config = json!({"chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string())
        .expect("tokenizer_config.json");
}
