//! Minimal SSE reader for OpenAI completion streams: counts token-bearing chunks, reads the
//! engine's own `usage.completion_tokens` (requested with `stream_options.include_usage`),
//! notices `[DONE]` and in-stream error frames (`data: {"error": {...}}`).
//!
//! Text alone is not evidence enough that tokens were generated: an engine's incremental
//! detokenizer holds back a token that ends inside a multi-byte UTF-8 character (vLLM's
//! `IncrementalDetokenizer` emits `""` for it), so a short stream of real tokens can carry no
//! text at all. [`SseTokens::generated`] therefore prefers the engine's usage count.

use serde_json::Value;

#[derive(Debug, Default)]
pub(crate) struct SseTokens {
    buf: Vec<u8>,
    /// Chunks whose `choices[*]` carried text, delta content or token ids.
    pub(crate) tokens: u64,
    /// The engine's `usage.completion_tokens`, from the last chunk that carried a usage object.
    pub(crate) usage_completion_tokens: Option<u64>,
    /// `data: [DONE]` seen.
    pub(crate) done: bool,
    /// First error frame's message.
    pub(crate) error: Option<String>,
}

impl SseTokens {
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
        while let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if let Some(data) = line.strip_prefix("data:") {
                self.data(data.trim_start());
            }
        }
    }

    fn data(&mut self, data: &str) {
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(err) = v.get("error") {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            self.error
                .get_or_insert(format!("engine stream error: {msg}"));
            return;
        }
        if let Some(n) = v
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64)
        {
            self.usage_completion_tokens = Some(n);
        }
        let carries_token = v
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|cs| {
                cs.iter().any(|c| {
                    let text = c
                        .get("text")
                        .and_then(Value::as_str)
                        .is_some_and(|t| !t.is_empty());
                    let delta = c
                        .pointer("/delta/content")
                        .and_then(Value::as_str)
                        .is_some_and(|t| !t.is_empty());
                    let ids = c
                        .get("token_ids")
                        .and_then(Value::as_array)
                        .is_some_and(|a| !a.is_empty());
                    text || delta || ids
                })
            });
        if carries_token {
            self.tokens += 1;
        }
    }

    /// Tokens the engine generated: its own `usage.completion_tokens` when it sent one, else
    /// the count of token-bearing chunks (an engine that ignores `stream_options`).
    pub(crate) fn generated(&self) -> u64 {
        self.usage_completion_tokens
            .map_or(self.tokens, |n| n.max(self.tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_token_chunks_across_split_reads_and_stops_at_done() {
        let mut p = SseTokens::default();
        p.feed(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choi");
        p.feed(b"ces\":[{\"text\":\"\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\r\n\r\ndata: [DONE]\n\n");
        assert_eq!(p.tokens, 2);
        assert!(p.done);
        assert!(p.error.is_none());
    }

    /// Two real tokens that end inside one UTF-8 character: vLLM streams them with empty
    /// text, then its usage chunk counts them.
    #[test]
    fn tokens_without_text_are_counted_from_the_engines_usage() {
        let mut p = SseTokens::default();
        p.feed(b"data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":null}],\"usage\":null}\n\n");
        p.feed(b"data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}],\"usage\":null}\n\n");
        p.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11}}\n\ndata: [DONE]\n\n");
        assert_eq!(p.tokens, 0, "no chunk carried text");
        assert_eq!(p.generated(), 2);
        assert!(p.done);
        let mut q = SseTokens::default();
        q.feed(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n");
        assert_eq!(q.generated(), 1, "without usage, the token-bearing chunks");
    }

    #[test]
    fn an_error_frame_after_200_is_an_error() {
        let mut p = SseTokens::default();
        p.feed(b"data: {\"error\": {\"message\": \"kv blocks unknown\", \"code\": 500}}\n\n");
        assert_eq!(
            p.error.as_deref(),
            Some("engine stream error: kv blocks unknown")
        );
        assert_eq!(p.tokens, 0);
    }
}
