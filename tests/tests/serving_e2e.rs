//! End-to-end tests of the serving path (issue 2): the real `narwhal-serve` in front of real
//! `narwhal-engine-sim` processes on loopback, asserting on what the client saw, on the
//! router's own accounting, and on what the engines actually received (`/sim/stats`).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use narwhal_testkit::{
    EngineSpec, FleetSpec, RouterHandle, SimHandle, start_router, start_sim, wait_until,
};
use serde_json::{Value, json};
use tempfile::TempDir;

struct Fleet {
    _dir: TempDir,
    prefill: SimHandle,
    decode: SimHandle,
    router: RouterHandle,
    http: reqwest::Client,
}

fn http() -> reqwest::Client {
    narwhal_testkit::http_client()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("HTTP client")
}

/// One prefill and one decode simulator of `dialect` behind a router, with fleet overrides.
fn fleet_with(dialect: &str, overrides: Value, sim_args: &[&str]) -> Fleet {
    let dir = tempfile::tempdir().expect("tempdir");
    let sims = vec![
        start_sim(
            dir.path(),
            &EngineSpec::new("p0", "prefill").args(sim_args),
            dialect,
        )
        .expect("prefill sim"),
        start_sim(
            dir.path(),
            &EngineSpec::new("d0", "decode").args(sim_args),
            dialect,
        )
        .expect("decode sim"),
    ];
    let spec = FleetSpec::for_sims(dialect, &sims).with(overrides);
    let router = start_router(dir.path(), "router", &spec, &[]).expect("router");
    let mut it = sims.into_iter();
    let prefill = it.next().expect("prefill");
    let decode = it.next().expect("decode");
    Fleet {
        _dir: dir,
        prefill,
        decode,
        router,
        http: http(),
    }
}

fn fleet(dialect: &str) -> Fleet {
    fleet_with(dialect, json!({}), &[])
}

/// The data frames of an SSE body, without the `data: ` prefix.
fn sse_frames(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|f| f.trim().strip_prefix("data:").map(|d| d.trim().to_string()))
        .collect()
}

/// Generated text of a streamed completion or chat answer (frames before `[DONE]`).
fn streamed_text(frames: &[String]) -> String {
    frames
        .iter()
        .filter(|f| f.as_str() != "[DONE]")
        .filter_map(|f| serde_json::from_str::<Value>(f).ok())
        .filter_map(|v| {
            let c = &v["choices"][0];
            c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str())
                .map(str::to_string)
        })
        .collect()
}

fn nonstream_text(v: &Value) -> String {
    let c = &v["choices"][0];
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn body(chat: bool, stream: bool, prompt: &str) -> (&'static str, Value) {
    if chat {
        (
            "/v1/chat/completions",
            json!({"model": "tiny-sim", "stream": stream, "max_tokens": 6,
                   "messages": [{"role": "user", "content": prompt}]}),
        )
    } else {
        (
            "/v1/completions",
            json!({"model": "tiny-sim", "stream": stream, "max_tokens": 6, "prompt": prompt}),
        )
    }
}

async fn stats(f: &Fleet) -> (Value, Value) {
    (
        f.prefill.stats(&f.http).await.expect("prefill stats"),
        f.decode.stats(&f.http).await.expect("decode stats"),
    )
}

fn n(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("expected a count, got {v}"))
}

/// Every shape through P/D: the descriptor (or bootstrap room) was issued by the prefill
/// engine and consumed by the decode engine exactly once per request, never recomputed, and
/// the text equals what an aggregated run of the same prompt produces.
async fn pd_round_trip(dialect: &str) {
    let f = fleet(dialect);
    let mut rids = Vec::new();
    let mut texts = Vec::new();
    for (i, (chat, stream)) in [(false, false), (false, true), (true, false), (true, true)]
        .into_iter()
        .enumerate()
    {
        let prompt = format!("the quick brown fox {i}");
        let (path, b) = body(chat, stream, &prompt);
        let r = f
            .http
            .post(format!("{}{path}", f.router.data))
            .json(&b)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200, "{dialect} {path} stream={stream}");
        let rid = r.headers()["x-request-id"]
            .to_str()
            .expect("rid")
            .to_string();
        let text = if stream {
            let frames = sse_frames(&r.text().await.expect("body"));
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
            streamed_text(&frames)
        } else {
            let v: Value = r.json().await.expect("json");
            assert_eq!(v["usage"]["completion_tokens"], 6, "{v}");
            assert!(v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 0, "{v}");
            nonstream_text(&v)
        };
        assert!(!text.is_empty(), "{dialect} {path}: empty text");
        rids.push(rid);
        texts.push((chat, prompt, text));
    }
    let (p, d) = stats(&f).await;
    assert_eq!(n(&p["requests"]["prefill"]), 4, "prefill stats {p}");
    assert_eq!(n(&p["kv"]["issued"]), 4, "prefill stats {p}");
    assert_eq!(n(&p["kv"]["served"]), 4, "prefill stats {p}");
    assert_eq!(n(&d["requests"]["decode"]), 4, "decode stats {d}");
    assert_eq!(n(&d["kv"]["consumed"]), 4, "decode stats {d}");
    assert_eq!(n(&d["kv"]["recomputed"]), 0, "decode recomputed: {d}");
    assert_eq!(n(&d["kv"]["rejected"]), 0, "decode stats {d}");
    // Each client request id maps to exactly one prefill and one decode leg on the engines.
    for rid in &rids {
        let legs = |s: &Value, phase: &str| {
            s["recent"]
                .as_array()
                .expect("recent")
                .iter()
                .filter(|r| {
                    r["request_id"]
                        .as_str()
                        .is_some_and(|id| id.starts_with(rid.as_str()))
                        && r["phase"] == phase
                })
                .count()
        };
        assert_eq!(legs(&p, "prefill"), 1, "prefill legs for {rid}: {p}");
        assert_eq!(legs(&d, "decode"), 1, "decode legs for {rid}: {d}");
    }
    // Same text as an aggregated run of the same prompt on the decode engine.
    for (chat, prompt, text) in &texts {
        let (path, b) = body(*chat, false, prompt);
        let v: Value = f
            .http
            .post(format!("{}{path}", f.decode.url))
            .json(&b)
            .send()
            .await
            .expect("direct")
            .json()
            .await
            .expect("json");
        assert_eq!(
            &nonstream_text(&v),
            text,
            "P/D text differs from aggregated for {prompt:?}"
        );
    }
    // The router's accounting and its journal agree.
    let st = f.router.state(&f.http).await.expect("state");
    assert_eq!(st["served"], 4, "{st}");
    assert_eq!(st["failed"], 0, "{st}");
    let metrics = f.router.metrics(&f.http).await.expect("metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("narwhal_served_total") && l.ends_with(" 4")),
        "{metrics}"
    );
    let rows = wait_until(Duration::from_secs(5), || {
        let rows = f.router.journal_rows();
        async move { (rows.iter().filter(|r| r.get("rid").is_some()).count() >= 4).then_some(rows) }
    })
    .await
    .expect("4 journal rows");
    let header = &rows[0]["meta"];
    assert_eq!(header["schema"], "narwhal.journal", "{header}");
    assert!(
        header["run"].is_string(),
        "journal header carries the run id: {header}"
    );
    for rid in &rids {
        let row = rows
            .iter()
            .find(|r| r["rid"] == rid.as_str())
            .unwrap_or_else(|| panic!("no journal row for {rid}"));
        assert_eq!(row["terminal"], "completed", "{row}");
        assert_eq!(row["prefill_iid"], "p0", "{row}");
        assert_eq!(row["decode_iid"], "d0", "{row}");
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
    let f = fleet("vllm");
    let (path, b) = body(false, true, "fragment me please");
    let whole = sse_frames(
        &f.http
            .post(format!("{}{path}", f.router.data))
            .json(&b)
            .send()
            .await
            .expect("send")
            .text()
            .await
            .expect("text"),
    );
    f.decode
        .fault(
            &f.http,
            json!({"phase": "decode", "action": "fragment", "bytes": 1}),
        )
        .await
        .expect("fault");
    let r = f
        .http
        .post(format!("{}{path}", f.router.data))
        .json(&b)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let frag = sse_frames(&r.text().await.expect("text"));
    assert_eq!(frag.last().map(String::as_str), Some("[DONE]"), "{frag:?}");
    assert_eq!(streamed_text(&frag), streamed_text(&whole));
    assert_eq!(frag.len(), whole.len(), "{frag:?} vs {whole:?}");
}

/// A prompt over the context length is the client's fault: 400 quickly, no decode left
/// waiting (SGLang runs the decode leg concurrently), no ejection, the fleet keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_length_400_is_the_clients_fault() {
    for dialect in ["vllm", "sglang"] {
        let f = fleet(dialect);
        let msg = "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens in the messages. Please reduce the length of the messages.";
        let fault = json!({"phase": "prefill", "action": "status", "status": 400, "count": 5,
                           "body": {"error": {"message": msg, "type": "BadRequestError", "param": null, "code": 400}}});
        f.prefill.fault(&f.http, fault).await.expect("fault");
        for _ in 0..4 {
            let t0 = Instant::now();
            let (path, b) = body(true, true, "too long");
            let r = f
                .http
                .post(format!("{}{path}", f.router.data))
                .json(&b)
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 400, "{dialect}");
            assert!(
                t0.elapsed() < Duration::from_secs(2),
                "{dialect}: 400 took {:?}",
                t0.elapsed()
            );
            let v: Value = r.json().await.expect("json");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("context length"),
                "{v}"
            );
        }
        let idle = wait_until(Duration::from_secs(2), || async {
            let d = f.decode.stats(&f.http).await.ok()?;
            (d["in_flight"] == 0).then_some(d)
        })
        .await;
        assert!(idle.is_some(), "{dialect}: a decode leg was left waiting");
        let (p, d) = stats(&f).await;
        assert_eq!(
            n(&p["requests"]["prefill"]),
            4,
            "{dialect}: not retried: {p}"
        );
        assert_eq!(n(&d["kv"]["consumed"]), 0, "{d}");
        if dialect == "vllm" {
            assert_eq!(
                n(&d["requests"]["decode"]),
                0,
                "vllm decode must not start: {d}"
            );
        }
        let st = f.router.state(&f.http).await.expect("state");
        assert_eq!(
            st["ejected"],
            json!([]),
            "{dialect}: client errors must not eject: {st}"
        );
        assert_eq!(
            st["invalid_requests"].as_u64().unwrap_or(0) + st["failed"].as_u64().unwrap_or(0),
            4,
            "{st}"
        );
        // The fleet still serves once the engine stops refusing.
        f.http
            .delete(format!("{}/sim/faults", f.prefill.url))
            .send()
            .await
            .expect("clear faults");
        let (path, b) = body(false, false, "short");
        let r = f
            .http
            .post(format!("{}{path}", f.router.data))
            .json(&b)
            .send()
            .await
            .expect("send");
        assert_eq!(
            r.status(),
            200,
            "{dialect}: fleet stopped serving after client errors"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_without_descriptor_fails_instead_of_recomputing() {
    let f = fleet("vllm");
    f.prefill
        .fault(&f.http, json!({"phase": "prefill", "action": "omit_kv"}))
        .await
        .expect("fault");
    let (path, b) = body(false, false, "where is my kv");
    let r = f
        .http
        .post(format!("{}{path}", f.router.data))
        .json(&b)
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.expect("json");
    assert!(v["error"]["type"].is_string(), "{v}");
    let (p, d) = stats(&f).await;
    assert_eq!(
        n(&p["requests"]["prefill"]),
        1,
        "KV handoff failures are not retried: {p}"
    );
    assert_eq!(
        n(&d["requests"]["decode"]) + n(&d["requests"]["aggregated"]),
        0,
        "no silent recompute: {d}"
    );
    assert_eq!(n(&d["kv"]["recomputed"]), 0, "{d}");
    let st = f.router.state(&f.http).await.expect("state");
    assert_eq!(st["failed"], 1, "{st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_dying_after_output_ends_stream_with_one_error_frame() {
    let f = fleet("vllm");
    f.decode
        .fault(
            &f.http,
            json!({"phase": "decode", "action": "cut", "after_tokens": 3}),
        )
        .await
        .expect("fault");
    let (path, b) = body(false, true, "die midway");
    let r = f
        .http
        .post(format!("{}{path}", f.router.data))
        .json(&b)
        .send()
        .await
        .expect("send");
    assert_eq!(
        r.status(),
        200,
        "output had started: the status is already sent"
    );
    let mut raw = Vec::new();
    let mut s = r.bytes_stream();
    while let Some(Ok(c)) = s.next().await {
        raw.extend_from_slice(&c);
    }
    let frames = sse_frames(&String::from_utf8_lossy(&raw));
    let errors: Vec<&String> = frames.iter().filter(|f| f.contains("\"error\"")).collect();
    assert_eq!(errors.len(), 1, "{frames:?}");
    assert_eq!(
        frames.last(),
        Some(errors[0]),
        "the error frame ends the stream: {frames:?}"
    );
    assert!(!frames.iter().any(|f| f == "[DONE]"), "{frames:?}");
    assert_eq!(
        streamed_text(&frames).split_whitespace().count(),
        3,
        "{frames:?}"
    );
    let err: Value = serde_json::from_str(errors[0]).expect("error frame is JSON");
    assert_eq!(err["error"]["code"], "failed", "{err}");
    let (p, d) = stats(&f).await;
    assert_eq!(
        n(&d["requests"]["decode"]),
        1,
        "not retried after output: {d}"
    );
    assert_eq!(n(&p["requests"]["prefill"]), 1, "{p}");
    let st = f.router.state(&f.http).await.expect("state");
    assert_eq!(st["failed"], 1, "{st}");
}

/// A client that goes away during a 30 s prefill: the engines see their connections close
/// within a second, and the router settles the request as cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_both_legs() {
    for dialect in ["vllm", "sglang"] {
        let f = fleet(dialect);
        f.prefill
            .fault(
                &f.http,
                json!({"phase": "prefill", "action": "hang", "ms": 30000}),
            )
            .await
            .expect("fault");
        let (path, b) = body(false, true, "slow prefill");
        let url = format!("{}{path}", f.router.data);
        let client = f.http.clone();
        let req = tokio::spawn(async move { client.post(url).json(&b).send().await });
        let legs_running = wait_until(Duration::from_secs(5), || async {
            let (p, d) = stats(&f).await;
            let want_decode = if dialect == "sglang" { 1 } else { 0 };
            (p["in_flight"] == 1 && d["in_flight"] == want_decode).then_some(())
        })
        .await;
        assert!(legs_running.is_some(), "{dialect}: legs never started");
        req.abort();
        let seen = wait_until(Duration::from_secs(1), || async {
            let (p, d) = stats(&f).await;
            let decode_ok = dialect == "vllm" || (d["cancelled"] == 1 && d["in_flight"] == 0);
            (p["cancelled"] == 1 && p["in_flight"] == 0 && decode_ok).then_some(())
        })
        .await;
        let (p, d) = stats(&f).await;
        assert!(
            seen.is_some(),
            "{dialect}: engines did not see the cancellation within 1 s: prefill {p} decode {d}"
        );
        let settled = wait_until(Duration::from_secs(2), || async {
            let st = f.router.state(&f.http).await.ok()?;
            (st["cancelled"] == 1).then_some(st)
        })
        .await;
        assert!(
            settled.is_some(),
            "{dialect}: router did not settle the request as cancelled"
        );
        let st = settled.expect("state");
        assert_eq!(st["resident"]["p0"]["prefill"], 0, "{st}");
        assert_eq!(st["resident"]["d0"]["decode"], 0, "{st}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_are_refused_before_any_engine() {
    let f = fleet_with("vllm", json!({"serving": {"max_request_bytes": 1024}}), &[]);
    let url = format!("{}/v1/chat/completions", f.router.data);
    let cases: [(&str, Option<&str>); 5] = [
        ("{", None),
        ("[]", None),
        ("null", None),
        (r#"{"model":1}"#, Some("model")),
        (r#"{"messages":"x"}"#, Some("messages")),
    ];
    for (raw, param) in cases {
        let r = f
            .http
            .post(&url)
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 400, "body {raw}");
        assert!(r.headers().contains_key("x-request-id"));
        let v: Value = r
            .json()
            .await
            .unwrap_or_else(|e| panic!("body {raw}: error is not JSON: {e}"));
        assert_eq!(
            v["error"]["type"], "invalid_request_error",
            "body {raw}: {v}"
        );
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "body {raw}: {v}");
        }
    }
    let over = format!(r#"{{"model":"tiny-sim","prompt":"{}"}}"#, "x".repeat(1024));
    let over = &over[..1025];
    let r = f
        .http
        .post(&url)
        .header("content-type", "application/json")
        .body(over.to_string())
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.expect("413 is JSON");
    assert_eq!(v["error"]["type"], "request_too_large", "{v}");
    let (p, d) = stats(&f).await;
    for s in [&p, &d] {
        let total: u64 = ["prefill", "decode", "aggregated"]
            .iter()
            .map(|k| n(&s["requests"][*k]))
            .sum();
        assert_eq!(total, 0, "an invalid request reached an engine: {s}");
    }
    let st = f.router.state(&f.http).await.expect("state");
    assert_eq!(st["invalid_requests"], 6, "{st}");
    assert_eq!(st["offered"], 6, "{st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_supplied_transfer_fields_are_refused() {
    for dialect in ["vllm", "sglang"] {
        let f = fleet(dialect);
        for (field, value) in [
            (
                "kv_transfer_params",
                json!({"do_remote_prefill": true, "remote_engine_id": "evil", "remote_block_ids": [1]}),
            ),
            ("bootstrap_room", json!(42)),
        ] {
            let mut b = json!({"model": "tiny-sim", "prompt": "hi", "max_tokens": 2});
            b[field] = value;
            let r = f
                .http
                .post(format!("{}/v1/completions", f.router.data))
                .json(&b)
                .send()
                .await
                .expect("send");
            assert_eq!(r.status(), 400, "{dialect} {field}");
            let v: Value = r.json().await.expect("json");
            assert_eq!(v["error"]["param"], field, "{v}");
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("reserved"),
                "{v}"
            );
        }
        let (p, d) = stats(&f).await;
        for s in [&p, &d] {
            let total: u64 = ["prefill", "decode", "aggregated"]
                .iter()
                .map(|k| n(&s["requests"][*k]))
                .sum();
            assert_eq!(
                total, 0,
                "{dialect}: a refused request reached an engine: {s}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_ready_and_wrong_model() {
    let f = fleet("vllm");
    let m: Value = f
        .http
        .get(format!("{}/v1/models", f.router.data))
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    assert_eq!(m["data"][0]["id"], "tiny-sim", "{m}");
    let h: Value = f
        .http
        .get(format!("{}/health", f.router.data))
        .send()
        .await
        .expect("health")
        .json()
        .await
        .expect("json");
    assert_eq!(h["status"], "ok", "{h}");
    assert_eq!(h["instances"], 2, "{h}");
    let r = f
        .http
        .get(format!("{}/ready", f.router.control))
        .send()
        .await
        .expect("ready");
    assert_eq!(r.status(), 200);
    let r = f
        .http
        .post(format!("{}/v1/completions", f.router.data))
        .json(&json!({"model": "other", "prompt": "x"}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    // Control routes are not served on the data listener.
    let r = f
        .http
        .get(format!("{}/narwhal/state", f.router.data))
        .send()
        .await
        .expect("state on data");
    assert_eq!(r.status(), 404);
}

/// An engine that refuses connections is ejected after `recovery.eject_after` failures, the
/// router keeps serving through the aggregated fallback or the other engine, and a healthy
/// engine on the same port is returned to placement by the health probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_decode_engine_is_ejected_and_others_keep_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
        start_sim(dir.path(), &EngineSpec::new("d1", "decode"), "vllm").expect("d1"),
    ];
    let spec = FleetSpec::for_sims("vllm", &sims).with(json!({"recovery": {"eject_after": 2}}));
    let router = start_router(dir.path(), "router", &spec, &[]).expect("router");
    let http = http();
    let mut sims = sims;
    sims[1].proc.kill();
    for i in 0..12 {
        let (path, b) = body(false, false, &format!("keep serving {i}"));
        let r = http
            .post(format!("{}{path}", router.data))
            .json(&b)
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200, "request {i} failed although d1 is alive");
    }
    let st = router.state(&http).await.expect("state");
    assert_eq!(st["ejected"], json!(["d0"]), "{st}");
    let metrics = router.metrics(&http).await.expect("metrics");
    assert!(
        metrics.contains("narwhal_engine_ejections_total{"),
        "{metrics}"
    );
}
