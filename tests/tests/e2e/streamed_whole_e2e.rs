//! A non-streaming client served by an engine that streams anyway (a field report):
//! the router asks the leg `"stream": false`, the engine answers `text/event-stream`, and the
//! client still gets one OpenAI answer (text concatenated, `finish_reason`, usage), not a 502.

use narwhal_testkit::{Answer, FakeEngine, RouterHandle, parse_row, router_over_fakes};
use serde::Deserialize;
use serde_json::json;

/// A leg's body as the engine received it: the one field read here.
#[derive(Debug, Deserialize)]
struct LegBody {
    /// The leg asked for a stream (`None`: absent or `null`).
    #[serde(default)]
    stream: Option<bool>,
}

/// One aggregated fake engine and a router over it.
async fn aggregated(e: &FakeEngine) -> RouterHandle {
    router_over_fakes("vllm", &[("e0", e, "decode")], json!({})).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_to_a_whole_leg_is_assembled() {
    let e = FakeEngine::new(0, 3).always_streams();
    let r = aggregated(&e).await;
    let a = r.completion("hello", 3).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let v = a.json();
    let answer: Answer = parse_row(&v);
    let choice = answer.choice(0).cloned().unwrap_or_default();
    assert_eq!(answer.object.as_deref(), Some("text_completion"), "{v}");
    assert_eq!(choice.text.as_deref(), Some(" t0 t1 t2"), "{v}");
    assert_eq!(choice.finish_reason.as_deref(), Some("length"), "{v}");
    let usage = answer.usage();
    assert_eq!(usage.prompt_tokens, Some(7), "the engine's usage: {v}");
    assert_eq!(usage.completion_tokens, Some(3), "{v}");
    // wire shape: the usage has no `estimated` key.
    assert!(
        v.get("usage").and_then(|u| u.get("estimated")).is_none(),
        "{v}"
    );
    assert!(
        e.seen()
            .decode
            .iter()
            .all(|(_, b)| parse_row::<LegBody>(b).stream == Some(false)),
        "the leg was asked non-streaming"
    );

    let chat = r
        .post_data(
            "/v1/chat/completions",
            &json!({"model": "tiny-sim", "max_tokens": 3,
                    "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(chat.status, 200, "{}", chat.text());
    let v = chat.json();
    let answer: Answer = parse_row(&v);
    let choice = answer.choice(0).cloned().unwrap_or_default();
    assert_eq!(answer.object.as_deref(), Some("chat.completion"), "{v}");
    // wire shape: the message is exactly the role and the text.
    assert_eq!(
        v.get("choices")
            .and_then(|c| c.get(0))
            .and_then(|c| c.get("message")),
        Some(&json!({"role": "assistant", "content": " t0 t1 t2"})),
        "{v}"
    );
    assert_eq!(choice.finish_reason.as_deref(), Some("length"), "{v}");
}

/// Without the engine's usage, the tokens are counted by the relay's rules (one per
/// content-bearing chunk here) and the prompt is the router's estimate, marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_whole_answer_without_usage_is_counted() {
    let e = FakeEngine::new(0, 4)
        .always_streams()
        .without_usage()
        .without_token_ids();
    let r = aggregated(&e).await;
    let a = r.completion("hello", 4).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let v = a.json();
    let answer: Answer = parse_row(&v);
    assert_eq!(
        answer.choice(0).and_then(|c| c.text.as_deref()),
        Some(" t0 t1 t2 t3"),
        "{v}"
    );
    assert_eq!(answer.usage().completion_tokens, Some(4), "{v}");
    assert_eq!(answer.usage().estimated, Some(true), "{v}");
}
