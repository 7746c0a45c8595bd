//! Deterministic toy tokenizer and "model".
//!
//! ```text
//!  prompt text / chat messages ──tokenize──► token ids (u32 < VOCAB) ──prompt_hash──► u64
//!  (prompt_hash, seed, i) ──generated_token──► token id ──token_text──► " w<id>"
//! ```
//!
//! The output of a request is a pure function of its prompt token ids, the simulator seed and the
//! position, so a decode that continues from transferred KV produces exactly the text an
//! aggregated run on any engine with the same `--seed` produces (docs/engine-simulator.md,
//! "Determinism").

use std::fmt::Write as _;

// The words, their ids and the chat template's words live in the testkit, which also writes
// a model directory whose tokenizer.json gives the same ids (for the router's own tokenizer).
use narwhal_testkit::sim_tokenizer::{CHAT_BEGIN, CHAT_END, CHAT_START, FNV_OFFSET, fnv1a};
pub(crate) use narwhal_testkit::sim_tokenizer::{VOCAB, word_id};

/// SplitMix64 finaliser: a cheap, well-mixing bijection on u64.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Tokenizes a completion prompt: whitespace split, one token per word. `""` gives no tokens.
pub(crate) fn tokenize_into(text: &str, out: &mut Vec<u32>) {
    out.extend(text.split_whitespace().map(word_id));
}

/// What a chat template renders beside the messages (vLLM's chat request fields that change
/// the prompt's tokens).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Template<'a> {
    /// The request's `tools` (null or absent: `None`): rendered as a `tools` turn after the
    /// BOS, as tool-calling templates put the tool definitions first.
    pub(crate) tools: Option<&'a serde_json::Value>,
    /// `add_generation_prompt` (vLLM's default true): the closing `<|start_header|> assistant`.
    pub(crate) generation_prompt: bool,
    /// `add_special_tokens` (vLLM's chat default false): the tokenizer's BOS added before the
    /// template's own, as a Llama tokenizer does.
    pub(crate) special_tokens: bool,
}

impl Default for Template<'_> {
    fn default() -> Self {
        Template {
            tools: None,
            generation_prompt: true,
            special_tokens: false,
        }
    }
}

/// Tokenizes chat messages `(role, content)` with a fixed template:
/// `[<|begin_of_text|>]` (when `add_special_tokens`) `<|begin_of_text|>`, then with tools
/// `<|start_header|> tools <the tools' pretty-printed JSON, by words> <|eot|>`, then per message
/// `<|start_header|> <role> <content words...> <|eot|>`, then (with `add_generation_prompt`) the
/// generation prompt `<|start_header|> assistant`.
pub(crate) fn chat_tokens<'a>(
    messages: impl Iterator<Item = (&'a str, &'a str)>,
    template: &Template<'_>,
) -> Vec<u32> {
    let mut out = Vec::new();
    if template.special_tokens {
        out.push(word_id(CHAT_BEGIN));
    }
    out.push(word_id(CHAT_BEGIN));
    if let Some(tools) = template.tools {
        out.push(word_id(CHAT_START));
        out.push(word_id("tools"));
        let text = serde_json::to_string_pretty(tools).unwrap_or_default();
        tokenize_into(&text, &mut out);
        out.push(word_id(CHAT_END));
    }
    for (role, content) in messages {
        out.push(word_id(CHAT_START));
        out.push(word_id(role));
        tokenize_into(content, &mut out);
        out.push(word_id(CHAT_END));
    }
    if template.generation_prompt {
        out.push(word_id(CHAT_START));
        out.push(word_id("assistant"));
    }
    out
}

/// Hash identifying a prompt: what KV blocks and SGLang rooms are keyed by, and the input of
/// generation.
pub(crate) fn prompt_hash(tokens: &[u32]) -> u64 {
    let mut h = FNV_OFFSET;
    for t in tokens {
        h = fnv1a(&t.to_le_bytes(), h);
    }
    // Mix in the length so that prefixes never collide trivially.
    mix(h ^ (tokens.len() as u64))
}

/// The `i`-th generated token (0-based) for a prompt: pure in `(prompt_hash, seed, i)`.
pub(crate) fn generated_token(prompt_hash: u64, seed: u64, i: u64) -> u32 {
    let z = mix(prompt_hash ^ mix(seed ^ mix(i.wrapping_add(0x5eed))));
    (z % u64::from(VOCAB)) as u32
}

/// Appends the text of a generated token (`" w<id>"`) to `out`.
pub(crate) fn push_token_text(out: &mut String, id: u32) {
    // Writing to a String cannot fail.
    let _ = write!(out, " w{id}");
}

/// Text of `n` generated tokens concatenated (what a non-streaming answer carries).
pub(crate) fn generated_text(prompt_hash: u64, seed: u64, n: u64) -> (String, Vec<u32>) {
    let mut text = String::with_capacity(n as usize * 7);
    let mut ids = Vec::with_capacity(n as usize);
    for i in 0..n {
        let id = generated_token(prompt_hash, seed, i);
        push_token_text(&mut text, id);
        ids.push(id);
    }
    (text, ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whitespace_tokenizer_is_stable_and_bounded() {
        let mut a = Vec::new();
        tokenize_into("The quick  brown\tfox\n", &mut a);
        assert_eq!(a.len(), 4);
        assert!(a.iter().all(|t| *t < VOCAB));
        let mut b = Vec::new();
        tokenize_into("The quick brown fox", &mut b);
        assert_eq!(a, b, "whitespace runs do not change tokens");
        // Pinned value: a change would silently break cross-version determinism.
        assert_eq!(word_id("The"), word_id("The"));
        assert_ne!(word_id("The"), word_id("the"));
        let mut empty = Vec::new();
        tokenize_into("   ", &mut empty);
        assert!(empty.is_empty());
    }

    #[test]
    fn chat_template_wraps_messages() {
        let plain = Template::default();
        let t = chat_tokens([("user", "Say hi")].into_iter(), &plain);
        // begin + (start, role, 2 words, end) + start + assistant
        assert_eq!(t.len(), 1 + 5 + 2);
        let t2 = chat_tokens([("system", "Say hi")].into_iter(), &plain);
        assert_ne!(t, t2, "role is part of the prompt");
        // Tools come first, after the BOS: every token from there on differs.
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let with_tools = Template {
            tools: Some(&tools),
            ..plain
        };
        let t3 = chat_tokens([("user", "Say hi")].into_iter(), &with_tools);
        assert_eq!(t3[0], t[0]);
        assert_eq!(t3[1..3], [word_id(CHAT_START), word_id("tools")]);
        assert!(t3.len() > t.len() + 3);
        // add_special_tokens: a second BOS; no generation prompt: the last two go.
        let special = Template {
            special_tokens: true,
            ..plain
        };
        let t4 = chat_tokens([("user", "Say hi")].into_iter(), &special);
        assert_eq!(t4[..2], [word_id(CHAT_BEGIN), word_id(CHAT_BEGIN)]);
        assert_eq!(t4[1..], t[..]);
        let bare = Template {
            generation_prompt: false,
            ..plain
        };
        let t5 = chat_tokens([("user", "Say hi")].into_iter(), &bare);
        assert_eq!(t5[..], t[..t.len() - 2]);
    }

    #[test]
    fn generation_is_pure_in_prompt_seed_and_position() {
        let p = prompt_hash(&[1, 2, 3]);
        let (text1, ids1) = generated_text(p, 0, 8);
        let (text2, ids2) = generated_text(p, 0, 8);
        assert_eq!(text1, text2);
        assert_eq!(ids1, ids2);
        assert_eq!(ids1[0], generated_token(p, 0, 0));
        assert!(text1.starts_with(&format!(" w{}", ids1[0])));
        let (other_seed, _) = generated_text(p, 1, 8);
        assert_ne!(text1, other_seed);
        let (other_prompt, _) = generated_text(prompt_hash(&[1, 2, 4]), 0, 8);
        assert_ne!(text1, other_prompt);
        // A longer generation extends the shorter one (decode continues the same sequence).
        let (longer, _) = generated_text(p, 0, 12);
        assert!(longer.starts_with(&text1));
    }

    #[test]
    fn prompt_hash_distinguishes_order_and_length() {
        assert_ne!(prompt_hash(&[1, 2]), prompt_hash(&[2, 1]));
        assert_ne!(prompt_hash(&[]), prompt_hash(&[0]));
        assert_eq!(prompt_hash(&[5, 6, 7]), prompt_hash(&[5, 6, 7]));
    }
}
