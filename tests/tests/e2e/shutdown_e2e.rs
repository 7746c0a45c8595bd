//! Graceful shutdown of `narwhal-serve` (docs/http-api.md), end to end: SIGTERM with streams
//! in flight, against the real binary over fake engines.
//!
//! On SIGTERM both listeners stay open while admitted requests run: `/ready` answers 503
//! `shutting down` at once, `/health` 200 (`stopping`), new completions 503 with
//! `Retry-After`; streams in flight finish; the router exits when none is left. Streams still
//! running at `serving.graceful_timeout_s` end with the documented error frame (`code:
//! failed`) and are settled `failed/shutdown`, never as client cancels.

use std::time::{Duration, Instant};

use narwhal_testkit::{FakeEngine, RouterHandle, router_over_fakes};
use nix::sys::signal::Signal;
use serde_json::json;

/// A vLLM P/D pair of fakes whose decodes stream a token every `tpot_ms`, and a router over
/// them with `serving.graceful_timeout_s` = `grace_s`.
async fn lab(tpot_ms: u64, tokens: usize, grace_s: u64) -> (FakeEngine, RouterHandle) {
    let (p, d) = (FakeEngine::new(0, 1), FakeEngine::new(tpot_ms, tokens));
    let r = router_over_fakes(
        "vllm",
        &[("p0", &p, "prefill"), ("d0", &d, "decode")],
        json!({"serving": {"graceful_timeout_s": grace_s}}),
    )
    .await;
    (d, r)
}

/// Waits (up to `within`) for the router process to exit; its exit code.
async fn exit_code(r: &mut RouterHandle, within: Duration) -> Option<i32> {
    let proc = &mut r.proc;
    tokio::task::block_in_place(|| proc.wait_exit(within))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_keeps_the_listeners_open_and_lets_streams_finish() {
    // Streams of 30 tokens 100 ms apart (~3 s), a 30 s budget.
    let (_d, mut r) = lab(100, 30, 30).await;
    let s1 = r.open_stream("first stream", 30).await;
    let s2 = r.open_stream("second stream", 30).await;
    let t0 = Instant::now();
    r.proc.signal(Signal::SIGTERM);
    // Readiness drops at once on both listeners; liveness stays.
    let ready = narwhal_testkit::eventually(
        "/ready 503 after SIGTERM",
        Duration::from_secs(5),
        || async {
            let (status, body) = r.ready().await;
            (status == 503).then_some(body)
        },
    )
    .await;
    assert_eq!(ready.reason, "shutting down", "{ready:?}");
    let data_ready = r.get_data("/ready").await;
    assert_eq!(data_ready.status, 503, "{}", data_ready.text());
    assert_eq!(data_ready.header("retry-after"), "1");
    let (status, health) = r.health().await;
    assert_eq!(
        (status, health.status.as_str()),
        (200, "stopping"),
        "{health:?}"
    );
    let data_health = r.get_data("/health").await;
    assert_eq!(data_health.status, 200);
    // A new request is refused cleanly: 503, Retry-After, and the connection closed.
    let a = r.completion("arrives during the drain", 2).await;
    assert_eq!(a.status, 503, "{}", a.text());
    assert_eq!(a.header("retry-after"), "1");
    assert_eq!(a.header("connection"), "close");
    // The streams in flight run to their end.
    let (t1, t2) = (s1.finish().await, s2.finish().await);
    for t in [&t1, &t2] {
        assert_eq!(t.matches("\"text\"").count(), 30 + 1, "every token: {t}");
    }
    // Then the router exits on its own, well before its budget.
    let code = exit_code(&mut r, Duration::from_secs(15)).await;
    assert_eq!(code, Some(0), "{}", r.proc.stderr_tail(20));
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "exited when the streams ended, not at the budget: {:?}",
        t0.elapsed()
    );
    let rows = r.request_rows();
    let streams: Vec<_> = rows.iter().filter(|x| x.stream).collect();
    assert_eq!(streams.len(), 2, "{rows:?}");
    assert!(
        streams.iter().all(|x| x.terminal == "completed"),
        "{rows:?}"
    );
    assert!(
        rows.iter()
            .any(|x| x.terminal == "rejected" && x.reason.as_deref() == Some("not_ready")),
        "the refused request is counted rejected/not_ready: {rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_budget_streams_end_with_the_error_frame_and_are_failed_not_cancelled() {
    // A stream of 200 tokens 100 ms apart (20 s), a 1 s budget.
    let (d, mut r) = lab(100, 200, 1).await;
    let s = r.open_stream("outlives the budget", 200).await;
    let t0 = Instant::now();
    r.proc.signal(Signal::SIGTERM);
    let text = s.drain().await;
    let cut_after = t0.elapsed();
    assert!(
        text.trim_end().ends_with(
            "data: {\"error\":{\"message\":\"Router is shutting down\",\"type\":\"decode\",\"code\":\"failed\"}}"
        ),
        "the documented error frame ends the stream: {text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");
    assert!(
        cut_after >= Duration::from_millis(900) && cut_after < Duration::from_secs(10),
        "cut at the budget: {cut_after:?}"
    );
    let code = exit_code(&mut r, Duration::from_secs(15)).await;
    assert_eq!(code, Some(0), "{}", r.proc.stderr_tail(20));
    let rows = r.request_rows();
    let row = rows
        .iter()
        .find(|x| x.stream)
        .unwrap_or_else(|| panic!("{rows:?}"));
    assert_eq!(row.terminal, "failed", "{row:?}");
    assert_eq!(row.reason.as_deref(), Some("shutdown"), "{row:?}");
    assert_eq!(row.status, Some(200), "{row:?}");
    assert_eq!(d.seen().cancelled, 1, "the decode leg was closed");
}
