//! Minimal SSE reader for OpenAI completion streams: counts token-bearing chunks, notices
//! `[DONE]` and in-stream error frames (`data: {"error": {...}}`).

use serde_json::Value;

#[derive(Debug, Default)]
pub(crate) struct SseTokens {
    buf: Vec<u8>,
    /// Chunks whose `choices[*]` carried text, delta content or token ids.
    pub(crate) tokens: u64,
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
