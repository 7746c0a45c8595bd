//! End-to-end tests of the serving path (docs/http-api.md): the real `narwhal-serve` in front of
//! real `narwhal-engine-sim` processes on loopback, asserting on what the client saw, on the
//! router's own accounting, and on what the engines actually received (`/sim/stats`).
// Tests measure wall time (deadlines, takeover gaps): the clock ban of clippy.toml is for
// product code.
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use narwhal_shared::documents::{ErrorReply, Health, ModelList, State};
use narwhal_testkit::sim_stats::{SimRecent, SimStats};
use narwhal_testkit::{
    Answer, ById, Fleet, Reply, WAIT, answer_text, eventually, metric, openai_request,
    parse_document, parse_row, sse_text, usage_of, wait_until,
};
use serde_json::{Value, json};

/// One prefill (`p0`) and one decode (`d0`) simulator of `dialect` behind a router, with fleet
/// overrides.
async fn fleet_with(dialect: &str, overrides: Value) -> Fleet {
    Fleet::pd_pair(dialect, overrides).await
}

async fn fleet(dialect: &str) -> Fleet {
    fleet_with(dialect, json!({})).await
}

/// A vLLM [`fleet`] whose engine `iid` has `fault` queued.
async fn faulted(iid: &str, fault: Value) -> Fleet {
    let f = fleet("vllm").await;
    f.sim(iid).fault(fault).await;
    f
}

/// An OpenAI-shaped error body, parsed ([`ErrorReply`]).
fn error_of(r: &Reply) -> ErrorReply {
    parse_document(&r.what, &r.text())
}

/// A request of at most 6 tokens ([`openai_request`]).
fn body(chat: bool, stream: bool, prompt: &str) -> (&'static str, Value) {
    openai_request(chat, stream, prompt, 6)
}

/// `(prefill stats, decode stats)`.
async fn stats(f: &Fleet) -> (SimStats, SimStats) {
    (f.sim("p0").counters().await, f.sim("d0").counters().await)
}

/// Requests each engine received, every phase.
fn total_requests(s: &SimStats) -> u64 {
    s.requests.prefill + s.requests.decode + s.requests.aggregated
}

/// Every shape through P/D: the descriptor (or bootstrap room) was issued by the prefill
/// engine and consumed by the decode engine exactly once per request, never recomputed, and
/// the text equals what an aggregated run of the same prompt produces.
async fn pd_round_trip(dialect: &str) {
    let f = fleet(dialect).await;
    let router = f.router();
    let mut rids = Vec::new();
    let mut texts = Vec::new();
    for (i, (chat, stream)) in [(false, false), (false, true), (true, false), (true, true)]
        .into_iter()
        .enumerate()
    {
        let prompt = format!("the quick brown fox {i}");
        let (path, b) = body(chat, stream, &prompt);
        let r = router.post_data(path, &b).await;
        assert_eq!(r.status, 200, "{dialect} {path} stream={stream}");
        let rid = r.header("x-request-id").to_string();
        assert!(!rid.is_empty(), "rid");
        let text = if stream {
            let frames = r.sse();
            assert_eq!(
                frames.last().map(String::as_str),
                Some("[DONE]"),
                "{frames:?}"
            );
            assert!(
                frames.iter().all(|f| !f.contains("\"error\"")),
                "{frames:?}"
            );
            assert!(
                frames.iter().all(|f| !f.contains("token_ids")),
                "token_ids leaked to a client that did not ask: {frames:?}"
            );
            sse_text(&frames)
        } else {
            let v = r.json();
            let usage = usage_of(&v);
            assert_eq!(usage.completion_tokens, Some(6), "{v}");
            assert!(usage.prompt_tokens.unwrap_or(0) > 0, "{v}");
            answer_text(&v)
        };
        assert!(!text.is_empty(), "{dialect} {path}: empty text");
        rids.push((rid, stream));
        texts.push((chat, prompt, text));
    }
    let (p, d) = stats(&f).await;
    assert_eq!(p.requests.prefill, 4, "prefill stats {p:?}");
    assert_eq!(p.kv.issued, 4, "prefill stats {p:?}");
    assert_eq!(p.kv.served, 4, "prefill stats {p:?}");
    assert_eq!(d.requests.decode, 4, "decode stats {d:?}");
    assert_eq!(d.kv.consumed, 4, "decode stats {d:?}");
    assert_eq!(d.kv.recomputed, 0, "decode recomputed: {d:?}");
    assert_eq!(d.kv.rejected, 0, "decode stats {d:?}");
    // Each client request maps to exactly one prefill and one decode leg on the engines: the
    // journal row names each leg's request id (a plain UUID per leg, docs/deviations.md).
    let rows = eventually("every request's journal row", WAIT, || async {
        let rows = router.request_rows();
        rids.iter()
            .all(|(rid, _)| rows.iter().any(|r| r.rid == *rid))
            .then_some(rows)
    })
    .await;
    for (rid, stream) in &rids {
        let row = rows
            .iter()
            .find(|r| r.rid == *rid)
            .unwrap_or_else(|| panic!("journal row for {rid}: {rows:?}"));
        let leg_id = |leg: &str| {
            let ids: Vec<&str> = row
                .legs
                .iter()
                .filter(|l| l.leg == leg)
                .filter_map(|l| l.request_id.as_deref())
                .collect();
            assert_eq!(ids.len(), 1, "one {leg} leg for {rid}: {row:?}");
            ids[0].to_string()
        };
        let legs = |s: &SimStats, phase: &str, id: &str| -> Vec<SimRecent> {
            s.recent
                .iter()
                .filter(|r| r.request_id == id && r.phase == phase)
                .cloned()
                .collect()
        };
        let (pid, did) = (leg_id("prefill"), leg_id("decode"));
        assert!(pid != did && pid != *rid, "{row:?}");
        assert_eq!(
            legs(&p, "prefill", &pid).len(),
            1,
            "prefill legs for {rid}: {p:?}"
        );
        let dlegs = legs(&d, "decode", &did);
        assert_eq!(dlegs.len(), 1, "decode legs for {rid}: {d:?}");
        // The decode leg streams for every client (behaviour.md 7.1 step 6, 7.2 step 4): its
        // first token bounds a stuck decode engine, and the role controller reads its timing.
        assert!(
            dlegs[0].stream,
            "decode leg of {rid} (client stream {stream}): {:?}",
            dlegs[0]
        );
        assert!(!legs(&p, "prefill", &pid)[0].stream, "{p:?}");
    }
    // Same text as an aggregated run of the same prompt on the decode engine.
    for (chat, prompt, text) in &texts {
        let (path, b) = body(*chat, false, prompt);
        let v = f
            .http
            .post(format!("{}{path}", f.sim("d0").url), &b)
            .await
            .json();
        assert_eq!(
            &answer_text(&v),
            text,
            "P/D text differs from aggregated for {prompt:?}"
        );
    }
    // The router's accounting and its journal agree.
    let st = router.state().await;
    assert_eq!(st.served, 4, "{st:?}");
    assert_eq!(st.failed, 0, "{st:?}");
    let metrics = router.metrics().await;
    assert_eq!(
        metric(&metrics, "narwhal_served_total", &[]),
        Some(4.0),
        "{metrics}"
    );
    let rows = eventually("4 journal rows", Duration::from_secs(5), || {
        let rows = router.request_rows();
        async move { (rows.len() >= 4).then_some(rows) }
    })
    .await;
    let header = router.journal_meta();
    assert_eq!(
        header.as_ref().map(|h| h.schema.as_str()),
        Some("narwhal.journal"),
        "{header:?}"
    );
    assert!(
        header.as_ref().is_some_and(|h| h.run.is_some()),
        "journal header carries the run id: {header:?}"
    );
    for (rid, _) in &rids {
        let row = rows
            .iter()
            .find(|r| r.rid == *rid)
            .unwrap_or_else(|| panic!("no journal row for {rid}"));
        assert_eq!(row.terminal, "completed", "{row:?}");
        assert_eq!(row.prefill_iid.as_deref(), Some("p0"), "{row:?}");
        assert_eq!(row.decode_iid.as_deref(), Some("d0"), "{row:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_pd_every_shape_moves_kv_exactly_once() {
    pd_round_trip("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pd_every_shape_moves_kv_exactly_once() {
    pd_round_trip("sglang").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_byte_sse_fragments_arrive_intact() {
    let f = fleet("vllm").await;
    let (path, b) = body(false, true, "fragment me please");
    let whole = f.router().post_data(path, &b).await.sse();
    f.sim("d0")
        .fault(json!({"phase": "decode", "action": "fragment", "bytes": 1}))
        .await;
    let r = f.router().post_data(path, &b).await;
    assert_eq!(r.status, 200);
    let frag = r.sse();
    assert_eq!(frag.last().map(String::as_str), Some("[DONE]"), "{frag:?}");
    assert_eq!(sse_text(&frag), sse_text(&whole));
    assert_eq!(frag.len(), whole.len(), "{frag:?} vs {whole:?}");
}

/// A prompt over the context length is the client's fault: 400 quickly, no decode left
/// waiting (SGLang runs the decode leg concurrently), no ejection, the fleet keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_length_400_is_the_clients_fault() {
    for dialect in ["vllm", "sglang"] {
        let f = fleet(dialect).await;
        let router = f.router();
        let msg = "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens in the messages. Please reduce the length of the messages.";
        let fault = json!({"phase": "prefill", "action": "status", "status": 400, "count": 5,
                           "body": {"error": {"message": msg, "type": "BadRequestError", "param": null, "code": 400}}});
        f.sim("p0").fault(fault).await;
        for _ in 0..4 {
            let t0 = Instant::now();
            let (path, b) = body(true, true, "too long");
            let r = router.post_data(path, &b).await;
            assert_eq!(r.status, 400, "{dialect}");
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "{dialect}: 400 took {:?}",
                t0.elapsed()
            );
            let v = error_of(&r);
            assert_eq!(v.error.kind, "invalid_request_error", "{v:?}");
            assert!(v.error.message.contains("context length"), "{v:?}");
        }
        let idle = wait_until(Duration::from_secs(2), || async {
            let d = f.sim("d0").counters().await;
            (d.in_flight == 0).then_some(d)
        })
        .await;
        assert!(idle.is_some(), "{dialect}: a decode leg was left waiting");
        let (p, d) = stats(&f).await;
        assert_eq!(p.requests.prefill, 4, "{dialect}: not retried: {p:?}");
        assert_eq!(d.kv.consumed, 0, "{d:?}");
        if dialect == "vllm" {
            assert_eq!(d.requests.decode, 0, "vllm decode must not start: {d:?}");
        }
        let st = router.state().await;
        assert_eq!(
            st.ejected,
            Vec::<String>::new(),
            "{dialect}: client errors must not eject: {st:?}"
        );
        assert_eq!(st.invalid_requests + st.failed, 4, "{st:?}");
        // The fleet still serves once the engine stops refusing.
        f.sim("p0").clear_faults().await;
        let (path, b) = body(false, false, "short");
        assert_eq!(
            router.post_data(path, &b).await.status,
            200,
            "{dialect}: fleet stopped serving after client errors"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_without_descriptor_fails_instead_of_recomputing() {
    let f = faulted("p0", json!({"phase": "prefill", "action": "omit_kv"})).await;
    let (path, b) = body(false, false, "where is my kv");
    let r = f.router().post_data(path, &b).await;
    assert_eq!(r.status, 502);
    let v = error_of(&r);
    assert!(!v.error.kind.is_empty(), "{v:?}");
    let (p, d) = stats(&f).await;
    assert_eq!(
        p.requests.prefill, 1,
        "KV handoff failures are not retried: {p:?}"
    );
    assert_eq!(
        d.requests.decode + d.requests.aggregated,
        0,
        "no silent recompute: {d:?}"
    );
    assert_eq!(d.kv.recomputed, 0, "{d:?}");
    let st = f.router().state().await;
    assert_eq!(st.failed, 1, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_dying_after_output_ends_stream_with_one_error_frame() {
    let f = faulted(
        "d0",
        json!({"phase": "decode", "action": "cut", "after_tokens": 3}),
    )
    .await;
    let (path, b) = body(false, true, "die midway");
    let r = f.router().post_data_partial(path, &b).await;
    assert_eq!(
        r.status, 200,
        "output had started: the status is already sent"
    );
    let frames = r.sse();
    let errors: Vec<&String> = frames.iter().filter(|f| f.contains("\"error\"")).collect();
    assert_eq!(errors.len(), 1, "{frames:?}");
    assert_eq!(
        frames.last(),
        Some(errors[0]),
        "the error frame ends the stream: {frames:?}"
    );
    assert!(!frames.iter().any(|f| f == "[DONE]"), "{frames:?}");
    assert_eq!(
        sse_text(&frames).split_whitespace().count(),
        3,
        "{frames:?}"
    );
    let err: ErrorReply = serde_json::from_str(errors[0]).expect("error frame is JSON");
    assert_eq!(err.error.code, Some(json!("failed")), "{err:?}");
    let (p, d) = stats(&f).await;
    assert_eq!(d.requests.decode, 1, "not retried after output: {d:?}");
    assert_eq!(p.requests.prefill, 1, "{p:?}");
    let st = f.router().state().await;
    assert_eq!(st.failed, 1, "{st:?}");
}

/// A client that goes away during a 30 s prefill: the engines see their connections close
/// within a second, and the router settles the request as cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_both_legs() {
    for dialect in ["vllm", "sglang"] {
        let f = fleet(dialect).await;
        f.sim("p0")
            .fault(json!({"phase": "prefill", "action": "hang", "ms": 30000}))
            .await;
        let (path, b) = body(false, true, "slow prefill");
        let url = format!("{}{path}", f.router().data);
        let client = f.http.client().clone();
        let req = tokio::spawn(async move { client.post(url).json(&b).send().await });
        let legs_running = wait_until(Duration::from_secs(5), || async {
            let (p, d) = stats(&f).await;
            let want_decode = if dialect == "sglang" { 1 } else { 0 };
            (p.in_flight == 1 && d.in_flight == want_decode).then_some(())
        })
        .await;
        assert!(legs_running.is_some(), "{dialect}: legs never started");
        req.abort();
        let seen = wait_until(Duration::from_secs(1), || async {
            let (p, d) = stats(&f).await;
            let decode_ok = dialect == "vllm" || (d.cancelled == 1 && d.in_flight == 0);
            (p.cancelled == 1 && p.in_flight == 0 && decode_ok).then_some(())
        })
        .await;
        let (p, d) = stats(&f).await;
        assert!(
            seen.is_some(),
            "{dialect}: engines did not see the cancellation within 1 s: prefill {p:?} decode {d:?}"
        );
        let settled = wait_until(Duration::from_secs(2), || async {
            let st = f.router().state().await;
            (st.cancelled == 1).then_some(st)
        })
        .await;
        assert!(
            settled.is_some(),
            "{dialect}: router did not settle the request as cancelled"
        );
        let st = settled.expect("state");
        assert_eq!(st.resident.get("p0").map(|r| r.prefill), Some(0), "{st:?}");
        assert_eq!(st.resident.get("d0").map(|r| r.decode), Some(0), "{st:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_are_refused_before_any_engine() {
    let f = fleet_with("vllm", json!({"serving": {"max_request_bytes": 1024}})).await;
    let url = format!("{}/v1/chat/completions", f.router().data);
    let cases: [(&str, Option<&str>); 5] = [
        ("{", None),
        ("[]", None),
        ("null", None),
        (r#"{"model":1}"#, Some("model")),
        (r#"{"messages":"x"}"#, Some("messages")),
    ];
    for (raw, param) in cases {
        let r = f.http.post_raw(&url, raw).await;
        assert_eq!(r.status, 400, "body {raw}");
        assert!(r.headers.contains_key("x-request-id"));
        let v: ErrorReply = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("body {raw}: error is not JSON: {e}"));
        assert_eq!(v.error.kind, "invalid_request_error", "body {raw}: {v:?}");
        if let Some(p) = param {
            assert_eq!(v.error.param, Some(json!(p)), "body {raw}: {v:?}");
        }
    }
    let over = format!(r#"{{"model":"tiny-sim","prompt":"{}"}}"#, "x".repeat(1024));
    let r = f.http.post_raw(&url, &over[..1025]).await;
    assert_eq!(r.status, 413);
    let v = error_of(&r);
    assert_eq!(v.error.kind, "request_too_large", "{v:?}");
    let (p, d) = stats(&f).await;
    for s in [&p, &d] {
        assert_eq!(
            total_requests(s),
            0,
            "an invalid request reached an engine: {s:?}"
        );
    }
    let st = f.router().state().await;
    assert_eq!(st.invalid_requests, 6, "{st:?}");
    assert_eq!(st.offered, 6, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_supplied_transfer_fields_are_refused() {
    for dialect in ["vllm", "sglang"] {
        let f = fleet(dialect).await;
        for (field, value) in [
            (
                "kv_transfer_params",
                json!({"do_remote_prefill": true, "remote_engine_id": "evil", "remote_block_ids": [1]}),
            ),
            ("bootstrap_room", json!(42)),
        ] {
            let mut b = json!({"model": "tiny-sim", "prompt": "hi", "max_tokens": 2});
            b[field] = value;
            let r = f.router().post_data("/v1/completions", &b).await;
            assert_eq!(r.status, 400, "{dialect} {field}");
            let v = error_of(&r);
            assert_eq!(v.error.param, Some(json!(field)), "{v:?}");
            assert!(v.error.message.contains("reserved"), "{v:?}");
        }
        let (p, d) = stats(&f).await;
        for s in [&p, &d] {
            assert_eq!(
                total_requests(s),
                0,
                "{dialect}: a refused request reached an engine: {s:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_ready_and_wrong_model() {
    let f = fleet("vllm").await;
    let router = f.router();
    let m = router.get_data("/v1/models").await;
    let m: ModelList = parse_document(&m.what, &m.text());
    assert_eq!(
        m.data.first().map(|c| c.id.as_str()),
        Some("tiny-sim"),
        "{m:?}"
    );
    let h = router.get_data("/health").await;
    let h: Health = parse_document(&h.what, &h.text());
    assert_eq!(h.status, "ok", "{h:?}");
    assert_eq!(h.instances, 2, "{h:?}");
    assert_eq!(router.ready().await.0, 200);
    let r = router
        .post_data("/v1/completions", &json!({"model": "other", "prompt": "x"}))
        .await;
    assert_eq!(r.status, 404);
    let v = error_of(&r);
    assert_eq!(v.error.code, Some(json!("model_not_found")), "{v:?}");
    // Control routes are not served on the data listener.
    assert_eq!(router.get_data("/narwhal/state").await.status, 404);
}

/// An engine that refuses connections is ejected after `recovery.eject_after` failures, the
/// router keeps serving through the aggregated fallback or the other engine, and a healthy
/// engine on the same port is returned to placement by the health probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_decode_engine_is_ejected_and_others_keep_serving() {
    let mut f = Fleet::builder()
        .prefill(1)
        .decode(2)
        .fleet(json!({"recovery": {"eject_after": 2}}))
        .start()
        .await;
    f.sim_mut("d0").proc.kill();
    let router = f.router();
    // Placement picks d0 by chance (two choices among two idle engines), so requests go on
    // until it is ejected (by its failures or its health probe), each served, within a bound.
    let mut st = State::default();
    for i in 0..200 {
        let (path, b) = body(false, false, &format!("keep serving {i}"));
        let r = router.post_data(path, &b).await;
        assert_eq!(r.status, 200, "request {i} failed although d1 is alive");
        st = router.state().await;
        if i >= 11 && st.ejected == ["d0"] {
            break;
        }
    }
    assert_eq!(st.ejected, ["d0"], "{st:?}");
    let metrics = router.metrics().await;
    assert!(
        metrics.contains("narwhal_engine_ejections_total{"),
        "{metrics}"
    );
}

/// What the router itself asks a decode leg for must fit its own limits: a 240,000-token prompt
/// on a vLLM P/D fleet makes the decode's first SSE event (every prompt token id, since the
/// router asks for `return_token_ids`) about 1.4 MB, past the 1 MiB per-event cap the relay
/// once had; bounded by `serving.max_response_bytes` instead, it is served streamed and not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_under_pd_fits_the_relays_event_bound() {
    let f = Fleet::builder()
        .dialect("vllm")
        .prefill(1)
        .decode(1)
        .sim_args(&["--max-model-len", "1000000"])
        .fleet(json!({
            "engine": {"first_token_timeout_s": 30},
            "serving": {"request_timeout_s": 60, "prefill_timeout_s": 60},
        }))
        .start()
        .await;
    let prompt: String = (0..240_000)
        .map(|i| format!("x{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    for stream in [true, false] {
        let body =
            json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": 4, "stream": stream});
        let r = f.router().post_data("/v1/completions", &body).await;
        assert_eq!(
            r.status,
            200,
            "stream={stream}: {}",
            &r.text()[..r.text().len().min(300)]
        );
        if stream {
            assert!(
                r.text().trim_end().ends_with("data: [DONE]"),
                "stream ends with [DONE]"
            );
        } else {
            let usage = usage_of(&r.json());
            assert_eq!(usage.completion_tokens, Some(4), "{usage:?}");
        }
    }
    let state = f.router().state().await;
    assert!(state.ejected.is_empty(), "{:?}", state.ejected);
}

/// The data frames of a streamed answer, parsed (`[DONE]` left out).
fn frames_of(text: &str) -> Vec<Answer> {
    narwhal_testkit::sse_data(text)
        .iter()
        .filter(|f| f.as_str() != "[DONE]")
        .filter_map(|f| serde_json::from_str(f).ok())
        .collect()
}

/// `n` > 1 on an aggregated fleet (two decode engines, no prefill pool) is served as vLLM serves
/// it: `n` choices with their `index`, streamed or not, usage counting the prompt once and every
/// choice's tokens; a batch numbers prompt `k`'s choice `i` as `k × n + i`. Across a P/D split
/// it is refused with a 400 that says why in terms of the split. Before the fix both fleets
/// refused it with the split's message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_are_served_aggregated_and_refused_across_a_split() {
    // wire shape: the answers' and chunks' `choices`, `index` and `usage` as OpenAI gives them.
    let f = Fleet::builder().decode(2).start().await;
    let r = f.router();
    let body = json!({"model": "tiny-sim", "prompt": "many ways", "max_tokens": 4, "n": 3});
    let a = r.post_data("/v1/completions", &body).await;
    let v = a.json_or_null();
    assert_eq!(a.status, 200, "{v}");
    let answer: Answer = parse_row(&v);
    let choices = answer.choices.clone().unwrap_or_default();
    let idx: Vec<u64> = choices.iter().filter_map(|x| x.index).collect();
    assert_eq!(idx, vec![0, 1, 2], "{v}");
    let usage = answer.usage();
    assert_eq!(usage.completion_tokens, Some(12), "{v}");
    let prompt = usage.prompt_tokens.unwrap_or(0);
    assert_eq!(usage.total_tokens, Some(prompt + 12), "{v}");
    let texts: Vec<&str> = choices.iter().filter_map(|x| x.text.as_deref()).collect();
    assert_ne!(texts[0], texts[1], "each choice is its own sample: {v}");

    let chat = json!({"model": "tiny-sim", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "n": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let s = r.post_data("/v1/chat/completions", &chat).await;
    assert_eq!(s.status, 200, "{}", s.text());
    let frames = frames_of(&s.text());
    let mut per_index = std::collections::BTreeMap::<u64, usize>::new();
    for fr in &frames {
        for c in fr.choices.iter().flatten() {
            if c.delta
                .as_ref()
                .and_then(|d| d.content.as_deref())
                .is_some_and(|t| !t.is_empty())
            {
                *per_index.entry(c.index.unwrap_or(99)).or_default() += 1;
            }
        }
    }
    assert_eq!(
        per_index,
        std::collections::BTreeMap::from([(0, 4), (1, 4)]),
        "{frames:?}"
    );
    let usage = frames.iter().rev().find_map(|fr| fr.usage);
    assert_eq!(
        usage.map(|u| u.completion_tokens),
        Some(Some(8)),
        "{frames:?}"
    );

    let batch = json!({"model": "tiny-sim", "prompt": ["one", "two"], "max_tokens": 2, "n": 2});
    let b = r.post_data("/v1/completions", &batch).await;
    let v = b.json_or_null();
    assert_eq!(b.status, 200, "{v}");
    let answer: Answer = parse_row(&v);
    let mut idx: Vec<u64> = answer
        .choices
        .iter()
        .flatten()
        .filter_map(|x| x.index)
        .collect();
    idx.sort_unstable();
    assert_eq!(idx, vec![0, 1, 2, 3], "{v}");
    assert_eq!(answer.usage().completion_tokens, Some(8), "{v}");

    // A P/D split must refuse, naming the split.
    let pd = fleet("vllm").await;
    // The same request, not streamed.
    let chat = json!({"model": "tiny-sim", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4, "n": 2, "stream": false});
    let refused = pd.router().post_data("/v1/chat/completions", &chat).await;
    assert_eq!(refused.status, 400, "{}", refused.text());
    let v = error_of(&refused);
    assert!(
        v.error
            .message
            .contains("n > 1 cannot be served across a split"),
        "{v:?}"
    );
    assert_eq!(pd.sim("d0").counters().await.requests.aggregated, 0);
}

/// A slow KV fabric: the decode's pull of the prefill's KV takes 4 s (the simulator's
/// consumer-side `--kv-transfer-ms 4000`), longer than `engine.first_token_timeout_s` (2.5 s by
/// default). With default settings P/D requests are served, none answered 504 or retried: the
/// decode leg of a split has `engine.kv_transfer_timeout_s` for the pull on top of its
/// first-token limit. Before the fix every such request timed out (504) after its retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_kv_fabric_is_served_within_the_transfer_budget() {
    for dialect in ["vllm", "sglang"] {
        let f = Fleet::builder()
            .dialect(dialect)
            .prefill(1)
            .decode(1)
            .sim_args(&["--kv-transfer-ms", "4000"])
            // The product's default (the kit's fleets wait 10 s for a first token).
            .fleet(json!({"engine": {"first_token_timeout_s": 2.5}}))
            .start()
            .await;
        let r = f.router();
        for i in 0..2 {
            let a = r.completion(&format!("slow fabric {i}"), 4).await;
            assert_eq!(a.status, 200, "{dialect}: {}", a.text());
        }
        let consumed = f.sim("d0").counters().await.kv.consumed;
        assert_eq!(consumed, 2, "{dialect}: both served across the split");
        let rows = r.request_rows();
        let retried: Vec<_> = rows.iter().filter(|row| row.attempts != 1).collect();
        assert!(retried.is_empty(), "{dialect}: {retried:?}");
    }
}

/// The journal's `input_len` is the router's estimate; the engine's own `usage.prompt_tokens` is
/// recorded beside it as `engine_prompt_tokens`, streamed or not, split or aggregated, summed
/// over a batch. Before: only the estimate was written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_records_the_engines_prompt_tokens_beside_the_estimate() {
    let f = fleet("vllm").await;
    let r = f.router();
    let prompt = "a prompt whose tokens the engine counts itself";
    let a = r.completion(prompt, 3).await;
    let v = a.json_or_null();
    assert_eq!(a.status, 200, "{v}");
    let engine = usage_of(&v).prompt_tokens.expect("usage");
    let rid = a.headers["x-request-id"].to_str().unwrap().to_string();
    let row = eventually("the request's journal row", WAIT, || async {
        r.request_rows().into_iter().find(|row| row.rid == rid)
    })
    .await;
    assert_eq!(row.engine_prompt_tokens, Some(engine), "{row:?}");
    assert!(row.input_len.is_some(), "the estimate stays: {row:?}");
    let (path, body) = openai_request(true, true, prompt, 3);
    let s = r.post_data(path, &body).await;
    assert_eq!(s.status, 200);
    let rid = s.headers["x-request-id"].to_str().unwrap().to_string();
    let row = eventually("the streamed request's row", WAIT, || async {
        r.request_rows().into_iter().find(|row| row.rid == rid)
    })
    .await;
    assert!(row.engine_prompt_tokens.is_some_and(|n| n > 0), "{row:?}");
}

/// Sends `body` as a streaming `POST /v1/completions` to the router's data listener over a
/// raw connection and returns the bytes of the first `read` (architecture.md, "Writes on the
/// client connection": what the router wrote in one `writev` arrives in one read on loopback).
async fn first_read(router: &narwhal_testkit::RouterHandle, body: &Value) -> String {
    use std::io::{Read, Write};
    let addr = router
        .data
        .strip_prefix("http://")
        .expect("http data URL")
        .to_string();
    let body = body.to_string();
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        s.set_read_timeout(Some(WAIT)).expect("timeout");
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(head.as_bytes()).expect("send");
        let mut buf = vec![0u8; 1 << 20];
        let n = s.read(&mut buf).expect("read");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    })
    .await
    .expect("reader")
}

/// A stream whose frames all reached the router with its first token (an instant engine) is
/// written to the client at once: the head, every token frame, `[DONE]` and the chunked
/// terminator in the first read. With tokens apart, the head still leaves with the first token
/// instead of alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_ready_reaches_the_client_in_one_write() {
    let instant = Fleet::builder().decode(1).start().await;
    let b = json!({"model": "tiny-sim", "prompt": "one write", "max_tokens": 8, "stream": true});
    let got = first_read(instant.router(), &b).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    assert!(got.contains("data: [DONE]"), "the first read: {got:?}");
    assert!(got.ends_with("0\r\n\r\n"), "the first read: {got:?}");
    let text = sse_text(
        &got.split('\n')
            .filter_map(|l| l.strip_prefix("data: "))
            .map(|l| l.trim_end().to_string())
            .collect::<Vec<_>>(),
    );
    assert_eq!(text.split_whitespace().count(), 8, "{got:?}");

    let spaced = Fleet::builder()
        .decode(1)
        .sim_args(&["--tpot-ms", "200"])
        .start()
        .await;
    let got = first_read(spaced.router(), &b).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    assert!(
        got.contains("data: {"),
        "the head left without the first token: {got:?}"
    );
    assert!(!got.contains("[DONE]"), "{got:?}");
}

/// A vLLM prefill that aborts a request (preempted, out of KV cache, shutting down) answers 200
/// with `finish_reason: "abort"` and no descriptor: nothing was output, so the request is retried
/// on the other prefill engine within its budget and the client gets a whole answer; the abort is
/// counted (`engine_aborted`) and charged to the prefill (`kv_handoff`). Before, the client got a
/// 502 and the idle prefill was never tried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_aborted_is_retried_on_another_prefill() {
    let f = Fleet::builder().prefill(2).decode(1).start().await;
    let router = f.router();
    let aborted = json!({"id": "cmpl-aborted", "object": "text_completion", "created": 0,
        "model": "tiny-sim",
        "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": "abort",
                     "stop_reason": null}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}});
    f.sim("p0")
        .fault(
            json!({"phase": "prefill", "action": "status", "status": 200, "body": aborted,
                      "count": 2}),
        )
        .await;
    let mut sent = 0;
    while !f.sim("p0").faults().await.is_empty() {
        assert!(sent < 40, "p0 never took its faulted requests");
        for stream in [false, true] {
            let (path, b) = body(false, stream, &format!("abort me {sent}"));
            let r = router.post_data(path, &b).await;
            assert_eq!(r.status, 200, "{}", r.text());
            let text = r.text();
            assert!(
                !text.contains("\"abort\""),
                "an aborted answer reached the client: {text}"
            );
            if !stream {
                assert_eq!(usage_of(&r.json()).completion_tokens, Some(6), "{text}");
            }
            sent += 1;
        }
    }
    let rows: Vec<_> = router
        .request_rows()
        .into_iter()
        .filter(|r| {
            r.attempt_failures
                .iter()
                .any(|x| x.reason == "engine_aborted")
        })
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in &rows {
        assert_eq!(r.terminal, "completed", "{r:?}");
        assert_eq!(
            r.prefill_iid.as_deref(),
            Some("p1"),
            "served through the other prefill: {r:?}"
        );
        let first = r.attempt_failures.first();
        assert_eq!(first.and_then(|x| x.iid.as_deref()), Some("p0"), "{r:?}");
        assert_eq!(first.map(|x| x.phase.as_str()), Some("prefill"), "{r:?}");
    }
    let m = router.metrics().await;
    assert_eq!(
        metric(
            &m,
            "narwhal_attempt_failures_total",
            &["phase=\"prefill\"", "reason=\"engine_aborted\""]
        ),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "narwhal_failed_total", &["reason=\"engine_aborted\""]),
        Some(0.0),
        "declared, and nothing failed: {m}"
    );
    let (d0, p1) = (f.sim("d0").counters().await, f.sim("p1").counters().await);
    assert_eq!(d0.kv.recomputed, 0, "{d0:?}");
    assert!(p1.kv.issued >= 2, "{p1:?}");
}

/// A client that leaves after the vLLM prefill handed off its KV and before the (queued) decode
/// read it: the decode leg is kept until its first output, so the decode still reads the
/// producer's staged blocks (vLLM frees them once read; a leg dropped before the decode engine
/// took it would leave them staged until the producer's lease expires), then closed, so nothing
/// is generated for nobody. The request settles `cancelled`, the producer stays resident until
/// the KV left it, and the pickup is counted. Before, both legs were dropped and the blocks
/// stayed pinned until the lease (8 s here; vLLM's `kv_lease_duration`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_after_the_handoff_leaves_no_kv_staged() {
    let f = Fleet::builder()
        .engine_with_args("p0", "prefill", &["--kv-lease-s", "8"])
        .engine("d0", "decode")
        .start()
        .await;
    let router = f.router();
    router.complete("warm up please").await;
    let served_before = f.sim("p0").counters().await.kv.served;
    // The decode takes 3 s to start reading, as a queued vLLM decode does.
    f.sim("d0")
        .fault(json!({"phase": "decode", "action": "hang", "ms": 3000}))
        .await;
    let (path, b) = body(false, true, "leave after the handoff");
    let url = format!("{}{path}", router.data);
    let client = f.http.client().clone();
    let req = tokio::spawn(async move { client.post(url).json(&b).send().await });
    let handed_off = wait_until(Duration::from_secs(5), || async {
        let (p, d) = stats(&f).await;
        (p.kv.issued >= 2 && d.in_flight == 1).then_some(())
    })
    .await;
    assert!(handed_off.is_some(), "the prefill never handed off");
    req.abort();
    let left = Instant::now();
    let collected = wait_until(Duration::from_secs(6), || async {
        let p = f.sim("p0").counters().await;
        (p.kv.served > served_before).then_some(())
    })
    .await;
    let (p, d) = stats(&f).await;
    assert!(
        collected.is_some(),
        "the staged KV was not read within 6 s of the disconnect: prefill {p:?} decode {d:?}"
    );
    assert_eq!(p.kv.expired, 0, "{p:?}");
    // Read, then closed: the decode generates nothing for nobody.
    let idle = wait_until(Duration::from_secs(3), || async {
        (f.sim("d0").counters().await.in_flight == 0).then_some(())
    })
    .await;
    assert!(
        idle.is_some(),
        "the decode kept generating after the pickup"
    );
    let st = eventually("cancelled and nothing resident", WAIT, || async {
        let st = router.state().await;
        (st.cancelled == 1 && st.resident.of("p0").prefill == 0).then_some(st)
    })
    .await;
    assert_eq!(st.resident.of("d0").decode, 0, "{:?}", st.resident);
    let m = router.metrics().await;
    assert_eq!(
        metric(&m, "narwhal_kv_pickups_total", &["outcome=\"collected\""]),
        Some(1.0),
        "{m}"
    );
    eprintln!("collected {:?} after the disconnect", left.elapsed());
}
