//! A non-streaming client served by an engine that streams anyway (a field report):
//! the router asks the leg `"stream": false`, the engine answers `text/event-stream`, and the
//! client still gets one OpenAI answer (text concatenated, `finish_reason`, usage), not a 502.

use narwhal_testkit::{FakeEngine, RouterHandle, router_over_fakes};
use serde_json::json;

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
    assert_eq!(v["object"], "text_completion", "{v}");
    assert_eq!(v["choices"][0]["text"], " t0 t1 t2", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 7, "the engine's usage: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    assert!(v["usage"].get("estimated").is_none(), "{v}");
    assert!(
        e.seen()
            .decode
            .iter()
            .all(|(_, b)| b["stream"] == json!(false)),
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
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": " t0 t1 t2"}),
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
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
    assert_eq!(v["choices"][0]["text"], " t0 t1 t2 t3", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    assert_eq!(v["usage"]["estimated"], true, "{v}");
}
