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

/// Vocabulary size: every token id is `< VOCAB`.
pub(crate) const VOCAB: u32 = 32_000;

/// Words of the fixed chat template (see [`chat_tokens`]).
const CHAT_BEGIN: &str = "<|begin_of_text|>";
const CHAT_START: &str = "<|start_header|>";
const CHAT_END: &str = "<|eot|>";

/// FNV-1a over bytes, 64-bit. Stable across processes and platforms.
fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// SplitMix64 finaliser: a cheap, well-mixing bijection on u64.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Token id of one whitespace-separated word: stable hash modulo [`VOCAB`].
pub(crate) fn word_id(word: &str) -> u32 {
    (fnv1a(word.as_bytes(), FNV_OFFSET) % u64::from(VOCAB)) as u32
}

/// Tokenizes a completion prompt: whitespace split, one token per word. `""` gives no tokens.
pub(crate) fn tokenize_into(text: &str, out: &mut Vec<u32>) {
    out.extend(text.split_whitespace().map(word_id));
}

/// Tokenizes chat messages `(role, content)` with a fixed template:
/// `<|begin_of_text|>` then, per message, `<|start_header|> <role> <content words...> <|eot|>`,
/// then the generation prompt `<|start_header|> assistant`.
pub(crate) fn chat_tokens<'a>(messages: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<u32> {
    let mut out = vec![word_id(CHAT_BEGIN)];
    for (role, content) in messages {
        out.push(word_id(CHAT_START));
        out.push(word_id(role));
        tokenize_into(content, &mut out);
        out.push(word_id(CHAT_END));
    }
    out.push(word_id(CHAT_START));
    out.push(word_id("assistant"));
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
        let t = chat_tokens([("user", "Say hi")].into_iter());
        // begin + (start, role, 2 words, end) + start + assistant
        assert_eq!(t.len(), 1 + 5 + 2);
        let t2 = chat_tokens([("system", "Say hi")].into_iter());
        assert_ne!(t, t2, "role is part of the prompt");
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
