//! Relay micro benchmark (docs/benchmarks.md): SSE frames per second per core through the router's
//! relay alone (upstream bytes in, client SSE bytes out), for a typical vLLM stream.
//!
//! Run: `cargo bench -p narwhal-router --bench relay` (release profile). Each case feeds a
//! whole streamed answer (16 token chunks with `token_ids`, the usage chunk, `[DONE]`) in
//! reads of a given size and counts the frames relayed. As a yardstick that does not change
//! with the router, the same frames are also parsed into a `serde_json::Value` and written
//! back (what a relay that decodes every frame pays at least); `x yardstick` is the relay's
//! speed over the yardstick's, so figures from different machines compare.

use std::hint::black_box;
use std::time::Duration;

use narwhal_relay::{RelayOptions, RelayStep, SseParser, StreamState};
use narwhal_shared::{Clock, SystemClock};

/// A vLLM `/v1/completions` stream as the router's decode leg gets it: `return_token_ids`
/// and `include_usage` set by the router.
fn completion_stream(tokens: usize) -> Vec<u8> {
    let mut s = String::new();
    let head = r#"{"id":"cmpl-9f1c2d7e5b3a4c1e8d6f0a2b4c6e8f01","object":"text_completion","created":1764500000,"model":"tiny-sim","choices":["#;
    for i in 0..tokens {
        let fin = if i + 1 == tokens {
            "\"length\""
        } else {
            "null"
        };
        s.push_str("data: ");
        s.push_str(head);
        s.push_str(&format!(
            r#"{{"index":0,"text":" tok{i}","logprobs":null,"finish_reason":{fin},"stop_reason":null,"token_ids":[{}]}}]}}"#,
            1000 + i
        ));
        s.push_str("\n\n");
    }
    s.push_str(r#"data: {"id":"cmpl-9f1c2d7e5b3a4c1e8d6f0a2b4c6e8f01","object":"text_completion","created":1764500000,"model":"tiny-sim","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":16,"total_tokens":25}}"#);
    s.push_str("\n\ndata: [DONE]\n\n");
    s.into_bytes()
}

/// A vLLM `/v1/chat/completions` stream: the role chunk, content deltas, usage, `[DONE]`.
fn chat_stream(tokens: usize) -> Vec<u8> {
    let mut s = String::new();
    let head = r#"{"id":"chatcmpl-9f1c2d7e5b3a4c1e8d6f0a2b4c6e8f01","object":"chat.completion.chunk","created":1764500000,"model":"tiny-sim","choices":["#;
    s.push_str("data: ");
    s.push_str(head);
    s.push_str(r#"{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null,"token_ids":[]}]}"#);
    s.push_str("\n\n");
    for i in 0..tokens {
        let fin = if i + 1 == tokens {
            "\"length\""
        } else {
            "null"
        };
        s.push_str("data: ");
        s.push_str(head);
        s.push_str(&format!(
            r#"{{"index":0,"delta":{{"content":" tok{i}"}},"logprobs":null,"finish_reason":{fin},"token_ids":[{}]}}]}}"#,
            1000 + i
        ));
        s.push_str("\n\n");
    }
    s.push_str(r#"data: {"id":"chatcmpl-9f1c2d7e5b3a4c1e8d6f0a2b4c6e8f01","object":"chat.completion.chunk","created":1764500000,"model":"tiny-sim","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":16,"total_tokens":25}}"#);
    s.push_str("\n\ndata: [DONE]\n\n");
    s.into_bytes()
}

/// Relays one stream read `read` bytes at a time; returns the frames relayed and the client
/// bytes produced.
fn relay_once(stream: &[u8], read: usize) -> (usize, usize) {
    let mut parser = SseParser::new();
    let mut state = StreamState::new(RelayOptions::new(1 << 24, false));
    let (mut frames, mut bytes) = (0, 0);
    for piece in stream.chunks(read) {
        parser.feed(piece, |payload| {
            frames += 1;
            match state.on_data(payload) {
                RelayStep::Output => bytes += state.take_output().len(),
                RelayStep::Hold | RelayStep::Done => {}
                RelayStep::Failed(f) => panic!("relay failed: {f:?}"),
            }
            true
        });
    }
    assert_eq!(state.tokens(), 16);
    (frames, bytes)
}

/// The yardstick: every frame's payload decoded into a `Value` and written back.
fn yardstick_once(stream: &[u8]) -> (usize, usize) {
    let (mut frames, mut bytes) = (0, 0);
    for ev in stream.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let payload = &ev[6..];
        frames += 1;
        if payload == b"[DONE]" {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(payload).expect("JSON");
        bytes += serde_json::to_vec(&v).expect("writes").len();
    }
    (frames, bytes)
}

/// Frames per second of `f` over about `budget` of wall time (one core).
fn rate(budget: Duration, mut f: impl FnMut() -> (usize, usize)) -> f64 {
    let clock = SystemClock;
    let mut frames = 0usize;
    for _ in 0..200 {
        black_box(f());
    }
    let start = clock.now();
    loop {
        for _ in 0..200 {
            frames += black_box(f()).0;
        }
        let spent = clock.now() - start;
        if spent >= budget {
            return frames as f64 / spent.as_secs_f64();
        }
    }
}

fn main() {
    let budget = Duration::from_millis(
        std::env::var("RELAY_BENCH_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1500),
    );
    println!(
        "{:<34} {:>14} {:>14} {:>12}",
        "case", "frames/s", "yardstick/s", "x yardstick"
    );
    for (name, stream) in [
        ("completions", completion_stream(16)),
        ("chat", chat_stream(16)),
    ] {
        let yard = rate(budget, || yardstick_once(&stream));
        let frame = stream.len() / 18;
        for (label, read) in [
            ("whole stream per read", stream.len()),
            ("one frame per read", frame),
            ("64-byte reads", 64),
        ] {
            let r = rate(budget, || relay_once(&stream, read));
            println!(
                "{:<34} {:>14.0} {:>14.0} {:>12.2}",
                format!("{name}, {label}"),
                r,
                yard,
                r / yard
            );
        }
    }
}
