//! `narwhal-serve` as a process: CLI contract (exit codes, listening line, ready file) and the
//! P/D serving path against tiny fake engines on 127.0.0.1:0 (behaviour.md 1, 7, 8.2).
//!
//! The fake engines (`narwhal_testkit::FakeEngine`) speak just enough of the vLLM / SGLang
//! protocols to check what the router sends them (bodies, headers, descriptors, rendezvous) and
//! to see cancellations (a dropped connection drops the handler or the response stream, which
//! counts).

// Tests measure wall time (deadlines, latencies): the clock ban of clippy.toml is for product
// code.
#![allow(clippy::disallowed_methods)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use http::StatusCode;
use narwhal_shared::documents::{ErrorReply, ModelList, Ready, State, Targets};
use narwhal_testkit::{Answer, FakeEngine, Reply, RouterHandle, fake_descriptor, merge, raw};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_narwhal-serve");

// ---------------------------------------------------------------------------------------------
// Fixture: a router over fake engines

fn write_fleet(dir: &Path, fleet: &Value) -> PathBuf {
    let p = dir.join("fleet.json");
    std::fs::write(&p, serde_json::to_vec_pretty(fleet).unwrap()).unwrap();
    p
}

fn fleet(backend: &str, engines: Vec<Value>) -> Value {
    json!({
        "schema": "narwhal.fleet", "schema_version": 2, "model": "tiny-sim", "backend": backend,
        "engines": engines,
        "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
        "controller": {"monitor_interval_s": 0.05},
        "recovery": {"readmit_every": 1, "eject_after": 2},
        "serving": {"retry_base_s": 0.01, "retry_cap_s": 0.02},
        "engine": {"first_token_timeout_s": 2.0, "decode_read_timeout_s": 2.0, "connect_timeout_s": 1.0, "health_timeout_s": 1.0}
    })
}

/// `narwhal-serve --log-level warn` over `fleet` in a temporary directory of its own.
fn start(fleet: &Value, extra: &[&str]) -> RouterHandle {
    RouterHandle::standalone(fleet, &[&["--log-level", "warn"], extra].concat())
}

/// Fake engines `p` (prefill `p0`) and `d` (decode `d0`) serving, and a router over them;
/// `edit` adjusts the fleet document first.
async fn pd_with(
    backend: &str,
    p: &FakeEngine,
    d: &FakeEngine,
    edit: impl FnOnce(&mut Value),
    extra: &[&str],
) -> RouterHandle {
    let (pu, du) = (p.spawn().await, d.spawn().await);
    let mut fl = fleet(
        backend,
        vec![
            json!({"iid": "p0", "url": pu, "role": "prefill"}),
            json!({"iid": "d0", "url": du, "role": "decode"}),
        ],
    );
    edit(&mut fl);
    start(&fl, extra)
}

/// [`pd_with`] with the default fleet document.
async fn pd(backend: &str, p: &FakeEngine, d: &FakeEngine) -> RouterHandle {
    pd_with(backend, p, d, |_| {}, &[]).await
}

/// `POST /v1/completions` with `body` on the data listener.
async fn complete(s: &RouterHandle, body: Value) -> Reply {
    s.post_data("/v1/completions", &body).await
}

/// Polls `f` until it holds, for at most 10 s.
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    narwhal_testkit::eventually(what, Duration::from_secs(10), || {
        let holds = f();
        async move { holds.await.then_some(()) }
    })
    .await
}

/// Opens a streaming completion on a raw connection and reads until its first `data:` frame;
/// returns the connection (dropping it disconnects the client) and what was read.
fn open_stream(s: &RouterHandle, body: &Value) -> (std::net::TcpStream, String) {
    let addr = s.data.trim_start_matches("http://");
    let headers = [("content-type", "application/json")];
    let mut sock = raw::send(addr, "POST", "/v1/completions", &headers, &body.to_string());
    let got = raw::read_until(&mut sock, "data: ");
    (sock, got)
}

/// The client hangs up (`sock` dropped): the fake `engine` then sees its `leg` connection
/// close, and the router settles the request as cancelled.
async fn hang_up(s: &RouterHandle, sock: std::net::TcpStream, engine: &FakeEngine, leg: &str) {
    drop(sock);
    let closed = format!("engine saw the {leg} connection close");
    eventually(&closed, || async { engine.seen().cancelled == 1 }).await;
    eventually("settled cancelled", || async {
        s.state().await.cancelled == 1
    })
    .await;
}

/// The requests resident on `iid` as `(prefill, decode)`, `None` when the state lists no such
/// engine.
fn resident(st: &State, iid: &str) -> Option<(u64, u64)> {
    st.resident.get(iid).map(|r| (r.prefill, r.decode))
}

/// The `--ready-file` document a started router writes: its listeners, pid and run id.
#[derive(Debug, Deserialize)]
struct ReadyFile {
    data: String,
    control: String,
    pid: u64,
    run: String,
}

/// `s`'s ready file, typed.
fn ready_file(s: &RouterHandle) -> ReadyFile {
    typed("the ready file", &s.ready_doc)
}

/// A body the router sent a fake engine, the fields these tests read (`None`: absent or
/// `null`); the fake keeps bodies whole ([`narwhal_testkit::Seen`]).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct EngineBody {
    max_tokens: Option<u64>,
    min_tokens: Option<u64>,
    stream: Option<bool>,
    return_token_ids: Option<bool>,
    stream_options: Option<StreamOptions>,
    /// vLLM's descriptor (an open document, compared whole).
    kv_transfer_params: Option<Value>,
    /// SGLang's rendezvous.
    bootstrap_host: Option<String>,
    bootstrap_port: Option<u64>,
    bootstrap_room: Option<u64>,
    /// SGLang's request id.
    rid: Option<String>,
}

/// `stream_options` of an [`EngineBody`].
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// A request row of the journal, the fields read here: `legs` whole, as written, and the run.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct JournalRequest {
    rid: String,
    run: Option<String>,
    terminal: String,
    prefill_iid: Option<String>,
    decode_iid: Option<String>,
    output_len: Option<u64>,
    stream: Option<bool>,
    legs: Value,
}

/// An answer's `usage`, whole as sent.
#[derive(Debug, Deserialize)]
struct UsageDoc {
    usage: Value,
}

/// A stream chunk's choices with their keys as sent, for what a chunk must not carry.
#[derive(Debug, Deserialize)]
struct ChunkKeys {
    choices: Vec<Map<String, Value>>,
}

/// `v` as the document `T` (`what` and `v` in the message when it is not one).
fn typed<T: DeserializeOwned>(what: &str, v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{what} ({e}): {v}"))
}

/// A body the router sent a fake engine, typed.
fn sent(body: &Value) -> EngineBody {
    typed("a body sent to an engine", body)
}

/// A loopback address nothing listens on (bound and released).
fn dead_addr() -> std::net::SocketAddr {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    dead.local_addr().unwrap()
}

// ---------------------------------------------------------------------------------------------
// CLI contract

#[test]
fn bad_fleet_exits_2_and_names_every_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = fleet(
        "vllm",
        vec![json!({"iid": "p0", "url": "http://127.0.0.1:1", "rol": "prefill"})],
    );
    merge(
        &mut f,
        json!({"serving": {"max_attempts": 7}, "slo": {"tpot_s": "fast"},
               "engine": {"bogus_key": 1}}),
    );
    let path = write_fleet(dir.path(), &f);
    let out = Command::new(BIN)
        .arg("--fleet")
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for want in [
        "engines[0].rol: unknown key",
        "serving.max_attempts = 7",
        "slo.tpot_s must be a number, got \"fast\"",
        "engine.bogus_key: unknown key",
    ] {
        assert!(err.contains(want), "stderr lacks {want:?}:\n{err}");
    }
    assert!(out.stdout.is_empty(), "nothing on stdout for a bad fleet");
}

#[test]
fn unreadable_or_non_json_fleet_exits_2() {
    let out = Command::new(BIN)
        .args(["--fleet", "/nonexistent/fleet.json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f.json");
    std::fs::write(&p, "{\"slo\": {\"ttft_s\": NaN}}").unwrap();
    let out = Command::new(BIN).arg("--fleet").arg(&p).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid JSON"));
}

#[test]
fn bind_failure_exits_1_naming_the_address() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let path = write_fleet(
        dir.path(),
        &fleet(
            "vllm",
            vec![json!({"iid": "d0", "url": "http://127.0.0.1:1"})],
        ),
    );
    let out = Command::new(BIN)
        .arg("--fleet")
        .arg(&path)
        .args(["--listen", &addr, "--control-listen", "127.0.0.1:0"])
        .arg("--journal")
        .arg(dir.path().join("j.jsonl"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("narwhal-serve: bind {addr}:")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn good_fleet_announces_and_serves_the_documents() {
    // e0 answers its health; e1 does not exist (its URL only exercises the targets
    // document), so it is never placed: the health gate (docs/http-api.md, "Breaker").
    let e0 = FakeEngine::new(0, 1).spawn().await;
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "e0", "url": format!("{e0}/"), "role": "prefill"}),
                json!({"iid": "e1", "url": "http://user:pw@127.0.0.1:18101/v1x"}),
            ],
        ),
        &[],
    );
    // `pid` is a number, `run` a string: the ready file parses.
    let ready_file = ready_file(&s);
    assert_eq!(ready_file.data, s.data);
    assert_eq!(ready_file.control, s.control);
    assert_eq!(
        ready_file.pid,
        u64::from(s.proc.pid()),
        "the router's own pid"
    );
    let run = ready_file.run;
    assert!(run.contains('-'));

    let (st, ready) = s.get_data("/ready").await.status_json();
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        ready,
        json!({"status": "ready", "control_ready": true, "epoch": 0, "holder": "", "reason": ""})
    );
    // The whole body, as sent.
    let (_, health) = s.get("/health").await.status_json();
    assert_eq!(
        health,
        json!({"status": "ok", "instances": 2, "available_instances": 1})
    );
    // OpenAI's model object has `created`, a number: the list parses as a `ModelList`.
    let models = s.get_data("/v1/models").await;
    let created = models
        .json_as::<ModelList>()
        .data
        .first()
        .unwrap_or_else(|| panic!("a model card: {}", models.text()))
        .created;
    assert_eq!(
        models.json_or_null(),
        json!({"object": "list", "data": [{"id": "tiny-sim", "object": "model", "created": created, "owned_by": "narwhal"}]})
    );
    let targets_reply = s.get("/narwhal/targets").await;
    let targets: Targets = targets_reply.json_as();
    assert_eq!(
        serde_json::to_value(&targets).unwrap(),
        targets_reply.json_or_null(),
        "the targets document has nothing beyond its type"
    );
    assert_eq!(targets[1].targets, ["127.0.0.1:18101"]);
    assert_eq!(targets[1].labels.metrics_path, "/v1x/metrics");
    let e0 = &targets[0].labels;
    assert_eq!(
        (
            e0.iid.as_str(),
            e0.backend.as_str(),
            e0.scheme.as_str(),
            e0.metrics_path.as_str()
        ),
        ("e0", "vllm", "http", "/metrics")
    );
    let st = s.state().await;
    assert_eq!(st.schema, "narwhal.state");
    assert_eq!(st.journal_run, run);
    assert_eq!(
        (st.pools.prefill, st.pools.decode),
        (vec!["e0".to_string()], vec!["e1".to_string()])
    );
    assert_eq!(st.awaiting_health, ["e1"]);
    assert_eq!(st.outcome_reasons.failed.get("no_engine"), Some(&0));
    // Control routes never on the data listener, completions never on control.
    assert_eq!(
        s.get_data("/narwhal/state").await.status,
        StatusCode::NOT_FOUND
    );
    let on_control = s
        .http
        .post(format!("{}/v1/completions", s.control), &json!({}))
        .await;
    assert_eq!(on_control.status, StatusCode::NOT_FOUND);
    let m = s.get("/metrics").await;
    assert_eq!(m.status, StatusCode::OK);
    assert_eq!(
        m.headers["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = m.text();
    assert!(text.contains("narwhal_router_ready 1"), "{text}");
    assert!(
        text.contains("narwhal_instance_role{iid=\"e0\",role=\"prefill\"} 1"),
        "{text}"
    );
    // Journal header carries the run id.
    let meta = s.journal_meta().expect("the journal's header row");
    assert_eq!(meta.run, Some(run));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_rules_answer_before_any_engine_is_called() {
    let f = FakeEngine::new(0, 2);
    let url = f.spawn().await;
    let mut fl = fleet("vllm", vec![json!({"iid": "d0", "url": url})]);
    merge(&mut fl, json!({"serving": {"max_request_bytes": 64}}));
    let s = start(&fl, &[]);
    // Bodies sent as they are, without a content-type.
    let post = |body: &'static str| {
        let (http, u) = (s.http.clone(), format!("{}/v1/completions", s.data));
        async move {
            let resp = http.client().post(&u).body(body).send().await.unwrap();
            let r = Reply::read(resp, format!("POST {u}")).await.unwrap();
            let error: ErrorReply = serde_json::from_slice(&r.body).expect("an error body");
            (r.status, r.header("x-request-id").to_string(), error.error)
        }
    };
    let (st, rid, b) = post("{").await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(uuid_like(&rid));
    assert_eq!(b.message, "the request body is not valid JSON");
    let (st, _, b) = post(r#"{"model":1}"#).await;
    assert_eq!(
        (st, b.param),
        (StatusCode::BAD_REQUEST, Some(json!("model")))
    );
    let (st, _, b) = post(r#"{"model":"nope","prompt":"x"}"#).await;
    assert_eq!(
        (st, b.code),
        (StatusCode::NOT_FOUND, Some(json!("model_not_found")))
    );
    let (st, _, b) = post(r#"{"prompt":"x","kv_transfer_params":{}}"#).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(b.message, "kv_transfer_params is reserved for Narwhal");
    let (st, _, b) = post(r#"{"prompt":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}"#).await;
    assert_eq!(
        (st, b.kind),
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large".to_string()
        )
    );
    let st = s.state().await;
    assert_eq!(st.invalid_requests, 5);
    assert_eq!(st.offered, 5);
    let seen = f.seen();
    assert!(seen.prefill.is_empty() && seen.decode.is_empty());
}

fn uuid_like(s: &str) -> bool {
    s.len() == 36 && s.chars().filter(|c| *c == '-').count() == 4
}

// ---------------------------------------------------------------------------------------------
// P/D serving

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_two_stage_carries_the_descriptor_verbatim() {
    let (p, d) = (FakeEngine::new(0, 3), FakeEngine::new(0, 3));
    let s = pd("vllm", &p, &d).await;
    // Non-streaming completion.
    let r = complete(
        &s,
        json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 3, "min_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let rid = r.header("x-request-id").to_string();
    let v: Answer = r.json_as();
    assert_eq!(v.object.as_deref(), Some("text_completion"));
    assert_eq!(
        v.choice(0).and_then(|c| c.text.as_deref()),
        Some(" t0 t1 t2")
    );
    assert_eq!(
        r.json_as::<UsageDoc>().usage,
        json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})
    );
    // Each leg has its own plain UUID request id (the form every engine accepts; see
    // docs/deviations.md), recorded in the journal row's `legs`.
    let (prid, drid) = {
        let ps = p.seen();
        let (prid, pbody) = &ps.prefill[0];
        let prid = prid.clone().expect("prefill x-request-id");
        assert!(uuid_like(&prid) && prid != rid, "{prid}");
        let pbody = sent(pbody);
        assert_eq!(pbody.max_tokens, Some(1));
        assert_eq!(pbody.stream, Some(false));
        assert_eq!(
            pbody.kv_transfer_params,
            Some(json!({"do_remote_decode": true}))
        );
        assert_eq!(
            pbody.min_tokens,
            Some(1),
            "the prefill may not end early (client min_tokens)"
        );
        let ds = d.seen();
        let (drid, dbody) = &ds.decode[0];
        let drid = drid.clone().expect("decode x-request-id");
        assert!(uuid_like(&drid) && drid != rid && drid != prid, "{drid}");
        let dbody = sent(dbody);
        assert_eq!(
            dbody.kv_transfer_params,
            Some(fake_descriptor()),
            "descriptor carried verbatim"
        );
        assert_eq!(dbody.stream, Some(true));
        assert_eq!(dbody.return_token_ids, Some(true));
        assert_eq!(
            dbody.stream_options.and_then(|o| o.include_usage),
            Some(true)
        );
        assert_eq!(dbody.min_tokens, Some(1));
        (prid, drid)
    };
    // Streaming chat: token ids and the usage chunk stripped (client asked for neither).
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                      "stream": true});
    let r = s.post_data("/v1/chat/completions", &chat).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["content-type"], "text/event-stream");
    let frames = r.sse();
    assert_eq!(frames.last().unwrap(), "[DONE]");
    assert_eq!(
        frames.len(),
        5,
        "role chunk + 3 tokens + [DONE]: {frames:?}"
    );
    for f in &frames[..4] {
        let c: ChunkKeys = serde_json::from_str(f).unwrap();
        assert!(!c.choices[0].contains_key("token_ids"), "{f}");
    }
    // Journal rows and counters.
    eventually("two served", || async { s.state().await.served == 2 }).await;
    let text = std::fs::read_to_string(&s.journal).unwrap();
    let rows: Vec<JournalRequest> = text
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let row = rows.iter().find(|r| r.rid == rid).unwrap();
    assert_eq!(row.terminal, "completed");
    assert_eq!(row.prefill_iid.as_deref(), Some("p0"));
    assert_eq!(row.decode_iid.as_deref(), Some("d0"));
    assert_eq!(row.output_len, Some(3));
    assert_eq!(row.stream, Some(false));
    assert_eq!(
        row.legs,
        json!([
            {"attempt": 1, "leg": "prefill", "iid": "p0", "request_id": prid, "prompt": null},
            {"attempt": 1, "leg": "decode", "iid": "d0", "request_id": drid, "prompt": null},
        ]),
        "{row:?}"
    );
    assert_eq!(row.run, Some(ready_file(&s).run));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_context_length_400_is_relayed_without_retry_or_ejection() {
    let (p, d) = (
        FakeEngine::new(0, 3).prefill_status(400),
        FakeEngine::new(0, 3),
    );
    let s = pd("vllm", &p, &d).await;
    for _ in 0..3 {
        let r = complete(&s, json!({"prompt": "long", "max_tokens": 3})).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        let v = r.json_as::<ErrorReply>().error;
        assert_eq!(v.kind, "invalid_request_error");
        assert!(v.message.contains("maximum context length"), "{v:?}");
    }
    assert_eq!(
        p.seen().prefill.len(),
        3,
        "one prefill per request: no retry"
    );
    assert!(d.seen().decode.is_empty());
    let st = s.state().await;
    assert!(st.ejected.is_empty());
    assert_eq!(st.outcome_reasons.failed.get("engine_rejected"), Some(&3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_cancels_the_decode_and_settles_cancelled() {
    let (p, d) = (FakeEngine::new(0, 1), FakeEngine::new(50, 1000));
    let s = pd("vllm", &p, &d).await;
    let (sock, got) = open_stream(
        &s,
        &json!({"prompt": "x", "max_tokens": 1000, "stream": true}),
    );
    assert!(got.starts_with("HTTP/1.1 200"));
    hang_up(&s, sock, &d, "decode").await;
    let st = s.state().await;
    assert_eq!(resident(&st, "d0"), Some((0, 0)));
    assert_eq!(st.served, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_failure_cancels_the_waiting_decode() {
    let p = FakeEngine::new(0, 1).prefill_status(400);
    let d = FakeEngine::new(0, 3).decode_head_delay(Duration::from_secs(30));
    let s = pd("sglang", &p, &d).await;
    let started = Instant::now();
    let r = complete(&s, json!({"prompt": "x", "max_tokens": 3})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered quickly"
    );
    eventually("decode leg cancelled", || async { d.seen().cancelled == 1 }).await;
    let ps = p.seen();
    let ds = d.seen();
    let (pb, db) = (sent(&ps.prefill[0].1), sent(&ds.decode[0].1));
    assert_eq!(pb.bootstrap_port, Some(8998));
    assert_eq!(pb.bootstrap_host.as_deref(), Some("127.0.0.1"));
    assert_eq!(pb.bootstrap_room, db.bootstrap_room);
    assert!(pb.bootstrap_room.unwrap() < (1u64 << 63));
    // Each SGLang leg's `rid` is its own UUID (docs/deviations.md, "One plain UUID per leg").
    let (prid, drid) = (pb.rid.as_deref().unwrap(), db.rid.as_deref().unwrap());
    assert!(
        uuid_like(prid) && uuid_like(drid) && prid != drid,
        "{prid} {drid}"
    );
    assert_eq!(pb.max_tokens, Some(1));
    assert_eq!(db.stream, Some(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_chat_streams_and_counts_content_chunks() {
    let (p, d) = (FakeEngine::new(0, 1), FakeEngine::new(0, 4));
    let s = pd("sglang", &p, &d).await;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4});
    let r = s.post_data("/v1/chat/completions", &chat).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let v: Answer = r.json_as();
    assert_eq!(v.object.as_deref(), Some("chat.completion"));
    assert_eq!(
        v.choice(0)
            .and_then(|c| c.message.as_ref())
            .and_then(|m| m.content.as_deref()),
        Some(" t0 t1 t2 t3")
    );
    assert_eq!(v.usage().completion_tokens, Some(4));
    let ds = d.seen();
    let (_, db) = &ds.decode[0];
    assert!(
        db.get("return_token_ids").is_none(),
        "no token ids asked on SGLang chat"
    );
    assert_eq!(
        sent(db).max_tokens,
        Some(4),
        "max_completion_tokens renamed for SGLang decode"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// A decode engine that does not answer is never placed (the health gate):
/// serving falls back to aggregated on p0 at once (the old router first failed requests on it
/// until the breaker ejected it); brought up on its port, it is admitted on its first health
/// 200 and serves P/D again. No ejection: it never was in placement.
async fn dead_decode_engine_is_never_placed_and_serving_falls_back_until_it_answers() {
    let p = FakeEngine::new(0, 2);
    let pu = p.spawn().await;
    // A port with nothing listening.
    let dead_addr = dead_addr();
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": format!("http://{dead_addr}"), "role": "decode"}),
            ],
        ),
        &[],
    );
    assert_eq!(s.state().await.awaiting_health, ["d0"]);
    // With no live decode engine, serving falls back to aggregated on p0.
    let r = complete(&s, json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert!(p.seen().decode[0].1.get("kv_transfer_params").is_none());
    // Bring d0 up on its port: its first health 200 admits it.
    let d = FakeEngine::new(0, 2);
    d.spawn_at(dead_addr).await;
    eventually("d0 admitted", || async {
        s.state().await.awaiting_health.is_empty()
    })
    .await;
    let r = complete(&s, json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    assert_eq!(d.seen().decode.len(), 1, "P/D again: d0 decodes");
    assert!(d.seen().decode[0].1.get("kv_transfer_params").is_some());
    let text = s.metrics().await;
    assert!(!text.contains("narwhal_engine_ejections_total{"), "{text}");
    let journal = std::fs::read_to_string(&s.journal).unwrap();
    assert!(journal.contains("\"event\":\"engine_admitted\",\"iid\":\"d0\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_live_engine_answers_503_backend_unavailable() {
    let mut fl = fleet(
        "vllm",
        vec![json!({"iid": "d0", "url": format!("http://{}", dead_addr())})],
    );
    merge(&mut fl, json!({"recovery": {"readmit_every": 100000}}));
    let s = start(&fl, &[]);
    // d0 never answered its health: it is not placed (the health gate).
    assert_eq!(s.state().await.awaiting_health, ["d0"]);
    let r = complete(&s, json!({"prompt": "x"})).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(
        r.json(),
        json!({"error": {"message": "No engines are available", "type": "backend_unavailable", "code": "backend_unavailable"}})
    );
    let ready = s.get_data("/ready").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready.json_as::<Ready>().reason, "no available engines");
    assert_eq!(
        s.state().await.outcome_reasons.rejected.get("not_ready"),
        Some(&1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_decode_failure_is_retried_once() {
    let (p, d) = (
        FakeEngine::new(0, 1),
        FakeEngine::new(0, 2).decode_fail_first(1),
    );
    let s = pd("vllm", &p, &d).await;
    let r = complete(&s, json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let rid = r.header("x-request-id").to_string();
    let second = {
        let ds = d.seen();
        assert_eq!(ds.decode.len(), 2);
        let ids: Vec<String> = ds.decode.iter().filter_map(|(id, _)| id.clone()).collect();
        assert!(
            ids.len() == 2 && ids.iter().all(|i| uuid_like(i)) && ids[0] != ids[1],
            "one UUID per leg: {ids:?}"
        );
        ids[1].clone()
    };
    // The journal names the retry's leg by its attempt.
    eventually("the request's journal row", || async {
        s.request_rows().iter().any(|r| {
            r.rid == rid
                && r.legs.iter().any(|l| {
                    l.attempt == 2
                        && l.leg == "decode"
                        && l.request_id.as_deref() == Some(second.as_str())
                })
        })
    })
    .await;
    let st = s.state().await;
    assert_eq!(st.serving.retry_attempts, 1);
    assert_eq!(st.serving.served_after_retry, 1);
    assert_eq!(st.served, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inflight_limit_answers_429_with_retry_after() {
    let (p, d) = (FakeEngine::new(0, 1), FakeEngine::new(50, 1000));
    let s = pd_with("vllm", &p, &d, |_| {}, &["--max-concurrent", "1"]).await;
    let (sock, _) = open_stream(
        &s,
        &json!({"prompt": "x", "max_tokens": 1000, "stream": true}),
    );
    let r = complete(&s, json!({"prompt": "x"})).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(
        r.json(),
        json!({"error": {"message": "router in-flight limit reached", "type": "server_overloaded_error"}})
    );
    assert_eq!(
        s.state()
            .await
            .outcome_reasons
            .rejected
            .get("inflight_limit"),
        Some(&1)
    );
    drop(sock);
    eventually("slot released", || async {
        s.state().await.serving.http_retained == 0
    })
    .await;
}

/// Sets every deadline of a request (`request_timeout_s`, `prefill_timeout_s`,
/// `first_token_timeout_s`) to `s` seconds.
fn deadlines(s: f64) -> impl FnOnce(&mut Value) {
    move |fl: &mut Value| {
        merge(
            fl,
            json!({"serving": {"request_timeout_s": s, "prefill_timeout_s": s},
                   "engine": {"first_token_timeout_s": s}}),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_before_output_is_504_request_expired() {
    let p = FakeEngine::new(0, 1);
    let d = FakeEngine::new(0, 2).decode_head_delay(Duration::from_secs(30));
    let s = pd_with("vllm", &p, &d, deadlines(0.5), &[]).await;
    let r = complete(&s, json!({"prompt": "x"})).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", r.text());
    assert_eq!(r.json_as::<ErrorReply>().error.kind, "request_expired");
    eventually("decode cancelled", || async { d.seen().cancelled == 1 }).await;
    assert_eq!(
        s.state().await.outcome_reasons.expired.get("deadline"),
        Some(&1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_after_output_ends_the_stream_with_an_expired_frame() {
    let (p, d) = (FakeEngine::new(0, 1), FakeEngine::new(100, 1000));
    let s = pd_with("vllm", &p, &d, deadlines(0.6), &[]).await;
    let r = complete(
        &s,
        json!({"prompt": "x", "max_tokens": 1000, "stream": true}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let frames = r.sse();
    assert!(frames.len() >= 2, "{frames:?}");
    assert_eq!(
        frames.last().unwrap(),
        &json!({"error": {"message": "Request deadline expired", "type": "decode", "code": "expired"}}).to_string()
    );
    assert!(!frames.iter().any(|f| f == "[DONE]"));
    eventually("settled expired", || async { s.state().await.expired == 1 }).await;
    eventually("decode cancelled", || async { d.seen().cancelled == 1 }).await;
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let mut s = start(
        &fleet(
            "vllm",
            vec![json!({"iid": "d0", "url": "http://127.0.0.1:1"})],
        ),
        &[],
    );
    let pid = s.proc.pid().to_string();
    let st = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(st.success());
    assert_eq!(
        s.proc.wait_exit(Duration::from_secs(10)),
        Some(0),
        "not exited with 0 within 10 s of SIGTERM"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_error_wins_over_a_decode_that_failed_first() {
    let p = FakeEngine::new(0, 1).prefill_status(400);
    let d = FakeEngine::new(0, 3).decode_fail_first(1);
    let s = pd("sglang", &p, &d).await;
    let r = complete(&s, json!({"prompt": "x", "max_tokens": 3})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.text());
    assert_eq!(p.seen().prefill.len(), 1, "not retried");
    assert_eq!(d.seen().decode.len(), 1, "not retried");
    assert_eq!(
        s.state()
            .await
            .outcome_reasons
            .failed
            .get("engine_rejected"),
        Some(&1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_client_gone_while_prefill_waits_cancels_the_leg() {
    let p = FakeEngine::new(0, 1).prefill_delay(Duration::from_secs(30));
    let d = FakeEngine::new(0, 3);
    let s = pd("vllm", &p, &d).await;
    let addr = s.data.trim_start_matches("http://");
    let body = json!({"prompt": "x", "max_tokens": 3}).to_string();
    let headers = [("content-type", "application/json")];
    let sock = raw::send(addr, "POST", "/v1/completions", &headers, &body);
    eventually("prefill leg started", || async {
        p.seen().prefill.len() == 1
    })
    .await;
    eventually("resident prefill counted", || async {
        resident(&s.state().await, "p0").is_some_and(|(prefill, _)| prefill == 1)
    })
    .await;
    hang_up(&s, sock, &p, "prefill").await;
    let st = s.state().await;
    assert_eq!(resident(&st, "p0"), Some((0, 0)));
    assert!(d.seen().decode.is_empty());
    let journal = std::fs::read_to_string(&s.journal).unwrap();
    assert!(journal.contains("\"terminal\":\"cancelled\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_queue_waits_then_expires_and_caps_retained_requests() {
    let (p, d) = (FakeEngine::new(0, 1), FakeEngine::new(50, 1000));
    let queue = |fl: &mut Value| {
        merge(
            fl,
            json!({"serving": {"queue_capacity": 1, "queue_timeout_s": 0.5}}),
        );
    };
    let s = pd_with("vllm", &p, &d, queue, &["--max-concurrent", "1"]).await;
    let (sock, _) = open_stream(
        &s,
        &json!({"prompt": "x", "max_tokens": 1000, "stream": true}),
    );
    // Second request queues for a seat; a third meanwhile exceeds max_concurrent + queue_capacity.
    let (http, url) = (s.http.clone(), format!("{}/v1/completions", s.data));
    let queued = tokio::spawn(async move { http.post(url, &json!({"prompt": "y"})).await });
    eventually("second request retained", || async {
        s.state().await.serving.http_retained == 2
    })
    .await;
    let r = complete(&s, json!({"prompt": "z"})).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let r = queued.await.unwrap();
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(
        r.json(),
        json!({"error": {"message": "queue deadline expired", "type": "queue_expired"}})
    );
    let st = s.state().await;
    assert_eq!(st.admission.queue_high_water, 1);
    assert_eq!(st.admission.queued, 0);
    assert_eq!(st.outcome_reasons.expired.get("queue_timeout"), Some(&1));
    assert_eq!(st.outcome_reasons.rejected.get("inflight_limit"), Some(&1));
    drop(sock);
}
