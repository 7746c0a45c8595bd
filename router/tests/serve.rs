//! `narwhal-serve` as a process: CLI contract (exit codes, listening line, ready file) and the
//! P/D serving path against tiny fake engines on 127.0.0.1:0 (reference-notes 1, 7, 8.2).
//!
//! The fake engines speak just enough of the vLLM / SGLang protocols to check what the router
//! sends them (bodies, headers, descriptors, rendezvous) and to see cancellations (a dropped
//! connection drops the handler or the response stream, which flips a flag).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_narwhal-serve");

// ---------------------------------------------------------------------------------------------
// Router process fixture

struct Serve {
    child: Child,
    data: String,
    control: String,
    ready: Value,
    _dir: tempfile::TempDir,
    journal: PathBuf,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_fleet(dir: &Path, fleet: &Value) -> PathBuf {
    let p = dir.join("fleet.json");
    std::fs::write(&p, serde_json::to_vec_pretty(fleet).unwrap()).unwrap();
    p
}

fn start(fleet: &Value, extra: &[&str]) -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let fleet_path = write_fleet(dir.path(), fleet);
    let journal = dir.path().join("journal.jsonl");
    let ready_file = dir.path().join("ready.json");
    let mut child = Command::new(BIN)
        .arg("--fleet")
        .arg(&fleet_path)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--control-listen",
            "127.0.0.1:0",
            "--log-level",
            "warn",
        ])
        .arg("--journal")
        .arg(&journal)
        .arg("--ready-file")
        .arg(&ready_file)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("listening line within 20 s");
    let line = line.trim_end().to_string();
    let rest = line
        .strip_prefix("narwhal-serve listening data=")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let (data, control) = rest.split_once(" control=").unwrap();
    let ready: Value = serde_json::from_slice(&std::fs::read(&ready_file).unwrap()).unwrap();
    Serve {
        child,
        data: data.to_string(),
        control: control.to_string(),
        ready,
        _dir: dir,
        journal,
    }
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

// ---------------------------------------------------------------------------------------------
// Minimal HTTP client

async fn call(method: &str, url: &str, body: Option<Value>) -> (StatusCode, HeaderMap, Bytes) {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("response within 20 s")
        .unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, bytes)
}

async fn get_json(url: &str) -> (StatusCode, Value) {
    let (st, _, b) = call("GET", url, None).await;
    (st, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

async fn state(s: &Serve) -> Value {
    get_json(&format!("{}/narwhal/state", s.control)).await.1
}

/// Poll `f` until it returns true or 10 s pass.
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for: {what}");
}

fn sse_data(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|f| f.strip_prefix("data: ").map(str::to_string))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Fake engines

#[derive(Default)]
struct Seen {
    prefill: Vec<(Option<String>, Value)>,
    decode: Vec<(Option<String>, Value)>,
    cancelled: usize,
}

#[derive(Clone)]
struct Fake {
    seen: Arc<Mutex<Seen>>,
    /// Prefill answer: 200 with the descriptor, or this status with an error body.
    prefill_status: Arc<Mutex<u16>>,
    /// Delay between decode tokens.
    tpot: Duration,
    tokens: usize,
    /// SGLang: decode waits for this long before the head (lets a failing prefill win).
    decode_head_delay: Duration,
    bootstrap_port: u16,
    /// Answer this many decode requests with 503 first.
    decode_fail_first: Arc<Mutex<usize>>,
    /// How long a prefill takes.
    prefill_delay: Duration,
}

impl Fake {
    fn new(tpot_ms: u64, tokens: usize) -> Self {
        Fake {
            seen: Arc::default(),
            prefill_status: Arc::new(Mutex::new(200)),
            tpot: Duration::from_millis(tpot_ms),
            tokens,
            decode_head_delay: Duration::ZERO,
            bootstrap_port: 8998,
            decode_fail_first: Arc::new(Mutex::new(0)),
            prefill_delay: Duration::from_millis(30),
        }
    }
}

fn descriptor() -> Value {
    json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "fake-p0",
           "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 40111,
           "remote_request_id": "x", "tp_size": 1, "extra_field_kept": {"a": 1}})
}

/// Sets `cancelled` when dropped before `done`.
struct CancelGuard {
    seen: Arc<Mutex<Seen>>,
    done: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.done {
            self.seen.lock().unwrap().cancelled += 1;
        }
    }
}

async fn completions(State(f): State<Fake>, headers: HeaderMap, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap();
    let rid = headers
        .get("x-request-id")
        .map(|h| h.to_str().unwrap().to_string());
    let is_prefill = v.pointer("/kv_transfer_params/do_remote_decode") == Some(&json!(true))
        || (v.get("bootstrap_room").is_some() && v["stream"] == json!(false));
    let mut guard = CancelGuard {
        seen: f.seen.clone(),
        done: false,
    };
    if is_prefill {
        f.seen.lock().unwrap().prefill.push((rid, v.clone()));
        tokio::time::sleep(f.prefill_delay).await;
        let status = *f.prefill_status.lock().unwrap();
        guard.done = true;
        if status != 200 {
            let msg = "This model's maximum context length is 16 tokens. However, your request has 99 input tokens.";
            return (
                StatusCode::from_u16(status).unwrap(),
                axum::Json(json!({"error": {"message": msg, "type": "BadRequestError", "param": null, "code": status}})),
            )
                .into_response();
        }
        return axum::Json(json!({"id": "cmpl-p", "object": "text_completion", "choices": [{"index": 0, "text": "z"}],
                                  "kv_transfer_params": descriptor()}))
        .into_response();
    }
    f.seen.lock().unwrap().decode.push((rid, v.clone()));
    {
        let mut fail = f.decode_fail_first.lock().unwrap();
        if *fail > 0 {
            *fail -= 1;
            guard.done = true;
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(json!({"error": {"message": "busy", "code": 503}})),
            )
                .into_response();
        }
    }
    tokio::time::sleep(f.decode_head_delay).await;
    let chat = v.get("messages").is_some();
    let with_ids = v["return_token_ids"] == json!(true);
    let n = f.tokens;
    let tpot = f.tpot;
    let stream = futures_util::stream::unfold((0usize, guard), move |(i, mut guard)| async move {
        if i > n + 1 {
            return None;
        }
        if i == n + 1 {
            guard.done = true;
        }
        if i > 0 && i <= n {
            tokio::time::sleep(tpot).await;
        }
        let frame = if i == 0 {
            let mut c = json!({"id": "c", "object": "chunk", "created": 1, "model": "tiny-sim",
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]});
            if !chat {
                c["choices"][0] = json!({"index": 0, "text": "", "finish_reason": null});
            }
            if with_ids {
                c["choices"][0]["token_ids"] = json!([]);
            }
            format!("data: {c}\n\n")
        } else if i <= n {
            let text = format!(" t{}", i - 1);
            let mut c = if chat {
                json!({"id": "c", "created": 1, "model": "tiny-sim", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": if i == n { json!("length") } else { Value::Null }}]})
            } else {
                json!({"id": "c", "created": 1, "model": "tiny-sim", "choices": [{"index": 0, "text": text, "finish_reason": if i == n { json!("length") } else { Value::Null }}]})
            };
            if with_ids {
                c["choices"][0]["token_ids"] = json!([100 + i]);
            }
            format!("data: {c}\n\n")
        } else {
            let usage = json!({"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}});
            format!("data: {usage}\n\ndata: [DONE]\n\n")
        };
        Some((
            Ok::<_, std::convert::Infallible>(Bytes::from(frame)),
            (i + 1, guard),
        ))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

async fn spawn_fake(f: Fake) -> String {
    let bootstrap = f.bootstrap_port;
    let app =
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(completions))
            .route("/health", get(|| async { "" }))
            .route(
                "/server_info",
                get(move || async move {
                    axum::Json(json!({"disaggregation_bootstrap_port": bootstrap}))
                }),
            )
            .with_state(f);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    format!("http://{addr}")
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
    f["serving"]["max_attempts"] = json!(7);
    f["slo"]["tpot_s"] = json!("fast");
    f["engine"]["bogus_key"] = json!(1);
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
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "e0", "url": "http://127.0.0.1:18100/", "role": "prefill"}),
                json!({"iid": "e1", "url": "http://user:pw@127.0.0.1:18101/v1x"}),
            ],
        ),
        &[],
    );
    assert_eq!(s.ready["data"], json!(s.data));
    assert_eq!(s.ready["control"], json!(s.control));
    assert!(s.ready["pid"].as_u64().is_some());
    let run = s.ready["run"].as_str().unwrap().to_string();
    assert!(run.contains('-'));

    let (st, ready) = get_json(&format!("{}/ready", s.data)).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        ready,
        json!({"status": "ready", "control_ready": true, "epoch": 0, "holder": "", "reason": ""})
    );
    let (_, health) = get_json(&format!("{}/health", s.control)).await;
    assert_eq!(
        health,
        json!({"status": "ok", "instances": 2, "available_instances": 2})
    );
    let (_, models) = get_json(&format!("{}/v1/models", s.data)).await;
    assert_eq!(
        models,
        json!({"object": "list", "data": [{"id": "tiny-sim", "object": "model", "owned_by": "narwhal"}]})
    );
    let (_, targets) = get_json(&format!("{}/narwhal/targets", s.control)).await;
    assert_eq!(targets[1]["targets"], json!(["127.0.0.1:18101"]));
    assert_eq!(targets[1]["labels"]["__metrics_path__"], "/v1x/metrics");
    assert_eq!(
        targets[0]["labels"],
        json!({"iid": "e0", "backend": "vllm", "__scheme__": "http", "__metrics_path__": "/metrics"})
    );
    let st = state(&s).await;
    assert_eq!(st["schema"], "narwhal.state");
    assert_eq!(st["journal_run"], json!(run));
    assert_eq!(st["pools"], json!({"prefill": ["e0"], "decode": ["e1"]}));
    assert_eq!(st["outcome_reasons"]["failed"]["no_engine"], 0);
    // Control routes never on the data listener, completions never on control.
    let (st, _, _) = call("GET", &format!("{}/narwhal/state", s.data), None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, _, _) = call(
        "POST",
        &format!("{}/v1/completions", s.control),
        Some(json!({})),
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, h, body) = call("GET", &format!("{}/metrics", s.control), None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        h["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("narwhal_router_ready 1"), "{text}");
    assert!(
        text.contains("narwhal_instance_role{iid=\"e0\",role=\"prefill\"} 1"),
        "{text}"
    );
    // Journal header carries the run id.
    let first = std::fs::read_to_string(&s.journal).unwrap();
    let header: Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    assert_eq!(header["meta"]["run"], json!(run));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingress_rules_answer_before_any_engine_is_called() {
    let f = Fake::new(0, 2);
    let url = spawn_fake(f.clone()).await;
    let mut fl = fleet("vllm", vec![json!({"iid": "d0", "url": url})]);
    fl["serving"]["max_request_bytes"] = json!(64);
    let s = start(&fl, &[]);
    let post = |body: &'static str| {
        let u = format!("{}/v1/completions", s.data);
        async move {
            let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
            let req = http::Request::post(u)
                .body(Full::new(Bytes::from_static(body.as_bytes())))
                .unwrap();
            let resp = client.request(req).await.unwrap();
            let st = resp.status();
            let rid = resp
                .headers()
                .get("x-request-id")
                .map(|h| h.to_str().unwrap().to_string());
            let b = resp.into_body().collect().await.unwrap().to_bytes();
            (st, rid, serde_json::from_slice::<Value>(&b).unwrap())
        }
    };
    let (st, rid, b) = post("{").await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(uuid_like(rid.as_deref().unwrap()));
    assert_eq!(b["error"]["message"], "the request body is not valid JSON");
    let (st, _, b) = post(r#"{"model":1}"#).await;
    assert_eq!(
        (st, b["error"]["param"].clone()),
        (StatusCode::BAD_REQUEST, json!("model"))
    );
    let (st, _, b) = post(r#"{"model":"nope","prompt":"x"}"#).await;
    assert_eq!(
        (st, b["error"]["code"].clone()),
        (StatusCode::NOT_FOUND, json!("model_not_found"))
    );
    let (st, _, b) = post(r#"{"prompt":"x","kv_transfer_params":{}}"#).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_eq!(
        b["error"]["message"],
        "kv_transfer_params is reserved for Narwhal"
    );
    let (st, _, b) = post(r#"{"prompt":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}"#).await;
    assert_eq!(
        (st, b["error"]["type"].clone()),
        (StatusCode::PAYLOAD_TOO_LARGE, json!("request_too_large"))
    );
    let st = state(&s).await;
    assert_eq!(st["invalid_requests"], 5);
    assert_eq!(st["offered"], 5);
    let seen = f.seen.lock().unwrap();
    assert!(seen.prefill.is_empty() && seen.decode.is_empty());
}

fn uuid_like(s: &str) -> bool {
    s.len() == 36 && s.chars().filter(|c| *c == '-').count() == 4
}

// ---------------------------------------------------------------------------------------------
// P/D serving

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_two_stage_carries_the_descriptor_verbatim() {
    let p = Fake::new(0, 3);
    let d = Fake::new(0, 3);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &[],
    );
    // Non-streaming completion.
    let (st, h, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 3, "min_tokens": 1})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let rid = h["x-request-id"].to_str().unwrap().to_string();
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], " t0 t1 t2");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})
    );
    {
        let ps = p.seen.lock().unwrap();
        let (prid, pbody) = &ps.prefill[0];
        assert_eq!(prid.as_deref(), Some(format!("{rid}-a1-prefill").as_str()));
        assert_eq!(pbody["max_tokens"], 1);
        assert_eq!(pbody["stream"], false);
        assert_eq!(
            pbody["kv_transfer_params"],
            json!({"do_remote_decode": true})
        );
        assert!(pbody.get("min_tokens").is_none());
        let ds = d.seen.lock().unwrap();
        let (drid, dbody) = &ds.decode[0];
        assert_eq!(drid.as_deref(), Some(format!("{rid}-a1-decode").as_str()));
        assert_eq!(
            dbody["kv_transfer_params"],
            descriptor(),
            "descriptor carried verbatim"
        );
        assert_eq!(dbody["stream"], true);
        assert_eq!(dbody["return_token_ids"], true);
        assert_eq!(dbody["stream_options"]["include_usage"], true);
        assert_eq!(dbody["min_tokens"], 1);
    }
    // Streaming chat: token ids and the usage chunk stripped (client asked for neither).
    let (st, h, body) = call("POST", &format!("{}/v1/chat/completions", s.data),
        Some(json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true}))).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(h["content-type"], "text/event-stream");
    let frames = sse_data(&body);
    assert_eq!(frames.last().unwrap(), "[DONE]");
    assert_eq!(
        frames.len(),
        5,
        "role chunk + 3 tokens + [DONE]: {frames:?}"
    );
    for f in &frames[..4] {
        let c: Value = serde_json::from_str(f).unwrap();
        assert!(c["choices"][0].get("token_ids").is_none());
    }
    // Journal rows and counters.
    eventually("two served", || async { state(&s).await["served"] == 2 }).await;
    let text = std::fs::read_to_string(&s.journal).unwrap();
    let rows: Vec<Value> = text
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let row = rows.iter().find(|r| r["rid"] == json!(rid)).unwrap();
    assert_eq!(row["terminal"], "completed");
    assert_eq!(row["prefill_iid"], "p0");
    assert_eq!(row["decode_iid"], "d0");
    assert_eq!(row["output_len"], 3);
    assert_eq!(row["stream"], false);
    assert_eq!(row["run"], s.ready["run"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_context_length_400_is_relayed_without_retry_or_ejection() {
    let p = Fake::new(0, 3);
    *p.prefill_status.lock().unwrap() = 400;
    let d = Fake::new(0, 3);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &[],
    );
    for _ in 0..3 {
        let (st, _, body) = call(
            "POST",
            &format!("{}/v1/completions", s.data),
            Some(json!({"prompt": "long", "max_tokens": 3})),
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("maximum context length")
        );
    }
    assert_eq!(
        p.seen.lock().unwrap().prefill.len(),
        3,
        "one prefill per request: no retry"
    );
    assert!(d.seen.lock().unwrap().decode.is_empty());
    let st = state(&s).await;
    assert_eq!(st["ejected"], json!([]));
    assert_eq!(st["outcome_reasons"]["failed"]["engine_rejected"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_cancels_the_decode_and_settles_cancelled() {
    let p = Fake::new(0, 1);
    let d = Fake::new(50, 1000);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &[],
    );
    let addr = s.data.trim_start_matches("http://").to_string();
    let body = json!({"prompt": "x", "max_tokens": 1000, "stream": true}).to_string();
    let mut sock = std::net::TcpStream::connect(&addr).unwrap();
    write!(sock, "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = sock.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
    drop(sock);
    eventually("engine saw the decode connection close", || async {
        d.seen.lock().unwrap().cancelled == 1
    })
    .await;
    eventually("settled cancelled", || async {
        state(&s).await["cancelled"] == 1
    })
    .await;
    let st = state(&s).await;
    assert_eq!(st["resident"]["d0"], json!({"prefill": 0, "decode": 0}));
    assert_eq!(st["served"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_failure_cancels_the_waiting_decode() {
    let p = Fake::new(0, 1);
    *p.prefill_status.lock().unwrap() = 400;
    let mut d = Fake::new(0, 3);
    d.decode_head_delay = Duration::from_secs(30);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "sglang",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &[],
    );
    let started = Instant::now();
    let (st, _, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x", "max_tokens": 3})),
    )
    .await;
    assert_eq!(
        st,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered quickly"
    );
    eventually("decode leg cancelled", || async {
        d.seen.lock().unwrap().cancelled == 1
    })
    .await;
    let ps = p.seen.lock().unwrap();
    let ds = d.seen.lock().unwrap();
    let (_, pb) = &ps.prefill[0];
    let (_, db) = &ds.decode[0];
    assert_eq!(pb["bootstrap_port"], 8998);
    assert_eq!(pb["bootstrap_host"], "127.0.0.1");
    assert_eq!(pb["bootstrap_room"], db["bootstrap_room"]);
    assert!(pb["bootstrap_room"].as_u64().unwrap() < (1u64 << 63));
    assert!(pb["rid"].as_str().unwrap().ends_with("-a1-prefill"));
    assert!(db["rid"].as_str().unwrap().ends_with("-a1-decode"));
    assert_eq!(pb["max_tokens"], 1);
    assert_eq!(db["stream"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_chat_streams_and_counts_content_chunks() {
    let p = Fake::new(0, 1);
    let d = Fake::new(0, 4);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "sglang",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &[],
    );
    let (st, _, body) = call(
        "POST",
        &format!("{}/v1/chat/completions", s.data),
        Some(json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], " t0 t1 t2 t3");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let ds = d.seen.lock().unwrap();
    let (_, db) = &ds.decode[0];
    assert!(
        db.get("return_token_ids").is_none(),
        "no token ids asked on SGLang chat"
    );
    assert_eq!(
        db["max_tokens"], 4,
        "max_completion_tokens renamed for SGLang decode"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_decode_engine_is_ejected_then_readmitted_and_serving_falls_back() {
    let p = Fake::new(0, 2);
    let pu = spawn_fake(p.clone()).await;
    // A port with nothing listening.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
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
    // eject_after = 2, max_attempts = 2: the first request fails twice on d0 and trips it.
    let (st, _, _) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x", "max_tokens": 2})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_GATEWAY);
    eventually("d0 ejected", || async {
        state(&s).await["ejected"] == json!(["d0"])
    })
    .await;
    // With no live decode engine, serving falls back to aggregated on p0.
    let (st, _, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x", "max_tokens": 2})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert!(
        p.seen.lock().unwrap().decode[0]
            .1
            .get("kv_transfer_params")
            .is_none()
    );
    // Bring d0 back on the same port: the monitor's /health probe readmits it.
    let d = Fake::new(0, 2);
    let app = Router::new()
        .route("/health", get(|| async { "" }))
        .with_state(d);
    let listener = tokio::net::TcpListener::bind(dead_addr).await.unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    eventually("d0 readmitted", || async {
        state(&s).await["ejected"] == json!([])
    })
    .await;
    let (_, _, metrics) = call("GET", &format!("{}/metrics", s.control), None).await;
    let text = String::from_utf8_lossy(&metrics);
    assert!(
        text.contains("narwhal_engine_ejections_total{iid=\"d0\",cause=\"connection\"} 1"),
        "{text}"
    );
    let journal = std::fs::read_to_string(&s.journal).unwrap();
    assert!(journal.contains("\"event\":\"engine_ejected\""));
    assert!(journal.contains("\"event\":\"engine_readmitted\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_live_engine_answers_503_backend_unavailable() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_addr = dead.local_addr().unwrap();
    drop(dead);
    let mut fl = fleet(
        "vllm",
        vec![json!({"iid": "d0", "url": format!("http://{dead_addr}")})],
    );
    fl["recovery"]["readmit_every"] = json!(100000);
    let s = start(&fl, &[]);
    let _ = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x"})),
    )
    .await;
    eventually("d0 ejected", || async {
        state(&s).await["ejected"] == json!(["d0"])
    })
    .await;
    let (st, h, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x"})),
    )
    .await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h["retry-after"], "1");
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v,
        json!({"error": {"message": "No engines are available", "type": "backend_unavailable", "code": "backend_unavailable"}})
    );
    let (st, ready) = get_json(&format!("{}/ready", s.data)).await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready["reason"], "no available engines");
    assert_eq!(
        state(&s).await["outcome_reasons"]["rejected"]["not_ready"],
        1
    );
}

async fn open_stream(s: &Serve, body: Value) -> std::net::TcpStream {
    let addr = s.data.trim_start_matches("http://").to_string();
    let body = body.to_string();
    let mut sock = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        sock,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = sock.read(&mut buf).unwrap();
        assert!(n > 0, "stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    sock
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_decode_failure_is_retried_once() {
    let p = Fake::new(0, 1);
    let d = Fake::new(0, 2);
    *d.decode_fail_first.lock().unwrap() = 1;
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &[],
    );
    let (st, h, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x", "max_tokens": 2})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let rid = h["x-request-id"].to_str().unwrap().to_string();
    {
        let ds = d.seen.lock().unwrap();
        assert_eq!(ds.decode.len(), 2);
        assert_eq!(
            ds.decode[1].0.as_deref(),
            Some(format!("{rid}-a2-decode").as_str())
        );
    }
    let st = state(&s).await;
    assert_eq!(st["serving"]["retry_attempts"], 1);
    assert_eq!(st["serving"]["served_after_retry"], 1);
    assert_eq!(st["served"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inflight_limit_answers_429_with_retry_after() {
    let p = Fake::new(0, 1);
    let d = Fake::new(50, 1000);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &["--max-concurrent", "1"],
    );
    let sock = open_stream(
        &s,
        json!({"prompt": "x", "max_tokens": 1000, "stream": true}),
    )
    .await;
    let (st, h, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x"})),
    )
    .await;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(h["retry-after"], "1");
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v,
        json!({"error": {"message": "router in-flight limit reached", "type": "server_overloaded_error"}})
    );
    assert_eq!(
        state(&s).await["outcome_reasons"]["rejected"]["inflight_limit"],
        1
    );
    drop(sock);
    eventually("slot released", || async {
        state(&s).await["serving"]["http_retained"] == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_before_output_is_504_request_expired() {
    let p = Fake::new(0, 1);
    let mut d = Fake::new(0, 2);
    d.decode_head_delay = Duration::from_secs(30);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let mut fl = fleet(
        "vllm",
        vec![
            json!({"iid": "p0", "url": pu, "role": "prefill"}),
            json!({"iid": "d0", "url": du, "role": "decode"}),
        ],
    );
    fl["serving"]["request_timeout_s"] = json!(0.5);
    fl["serving"]["prefill_timeout_s"] = json!(0.5);
    fl["engine"]["first_token_timeout_s"] = json!(0.5);
    let s = start(&fl, &[]);
    let (st, _, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x"})),
    )
    .await;
    assert_eq!(
        st,
        StatusCode::GATEWAY_TIMEOUT,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "request_expired");
    eventually("decode cancelled", || async {
        d.seen.lock().unwrap().cancelled == 1
    })
    .await;
    assert_eq!(state(&s).await["outcome_reasons"]["expired"]["deadline"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_after_output_ends_the_stream_with_an_expired_frame() {
    let p = Fake::new(0, 1);
    let d = Fake::new(100, 1000);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let mut fl = fleet(
        "vllm",
        vec![
            json!({"iid": "p0", "url": pu, "role": "prefill"}),
            json!({"iid": "d0", "url": du, "role": "decode"}),
        ],
    );
    fl["serving"]["request_timeout_s"] = json!(0.6);
    fl["serving"]["prefill_timeout_s"] = json!(0.6);
    fl["engine"]["first_token_timeout_s"] = json!(0.6);
    let s = start(&fl, &[]);
    let (st, _, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x", "max_tokens": 1000, "stream": true})),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let frames = sse_data(&body);
    assert!(frames.len() >= 2, "{frames:?}");
    assert_eq!(
        frames.last().unwrap(),
        &json!({"error": {"message": "Request deadline expired", "type": "decode", "code": "expired"}}).to_string()
    );
    assert!(!frames.iter().any(|f| f == "[DONE]"));
    eventually("settled expired", || async {
        state(&s).await["expired"] == 1
    })
    .await;
    eventually("decode cancelled", || async {
        d.seen.lock().unwrap().cancelled == 1
    })
    .await;
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
    let pid = s.child.id().to_string();
    let st = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(code) = s.child.try_wait().unwrap() {
            assert_eq!(code.code(), Some(0));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still running 10 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_error_wins_over_a_decode_that_failed_first() {
    let p = Fake::new(0, 1);
    *p.prefill_status.lock().unwrap() = 400;
    let d = Fake::new(0, 3);
    *d.decode_fail_first.lock().unwrap() = 1;
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "sglang",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &[],
    );
    let (st, _, body) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "x", "max_tokens": 3})),
    )
    .await;
    assert_eq!(
        st,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(p.seen.lock().unwrap().prefill.len(), 1, "not retried");
    assert_eq!(d.seen.lock().unwrap().decode.len(), 1, "not retried");
    assert_eq!(
        state(&s).await["outcome_reasons"]["failed"]["engine_rejected"],
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_client_gone_while_prefill_waits_cancels_the_leg() {
    let mut p = Fake::new(0, 1);
    p.prefill_delay = Duration::from_secs(30);
    let d = Fake::new(0, 3);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let s = start(
        &fleet(
            "vllm",
            vec![
                json!({"iid": "p0", "url": pu, "role": "prefill"}),
                json!({"iid": "d0", "url": du, "role": "decode"}),
            ],
        ),
        &[],
    );
    let addr = s.data.trim_start_matches("http://").to_string();
    let body = json!({"prompt": "x", "max_tokens": 3}).to_string();
    let mut sock = std::net::TcpStream::connect(&addr).unwrap();
    write!(
        sock,
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    eventually("prefill leg started", || async {
        p.seen.lock().unwrap().prefill.len() == 1
    })
    .await;
    eventually("resident prefill counted", || async {
        state(&s).await["resident"]["p0"]["prefill"] == 1
    })
    .await;
    drop(sock);
    eventually("engine saw the prefill connection close", || async {
        p.seen.lock().unwrap().cancelled == 1
    })
    .await;
    eventually("settled cancelled", || async {
        state(&s).await["cancelled"] == 1
    })
    .await;
    let st = state(&s).await;
    assert_eq!(st["resident"]["p0"], json!({"prefill": 0, "decode": 0}));
    assert!(d.seen.lock().unwrap().decode.is_empty());
    let journal = std::fs::read_to_string(&s.journal).unwrap();
    assert!(journal.contains("\"terminal\":\"cancelled\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_queue_waits_then_expires_and_caps_retained_requests() {
    let p = Fake::new(0, 1);
    let d = Fake::new(50, 1000);
    let pu = spawn_fake(p.clone()).await;
    let du = spawn_fake(d.clone()).await;
    let mut fl = fleet(
        "vllm",
        vec![
            json!({"iid": "p0", "url": pu, "role": "prefill"}),
            json!({"iid": "d0", "url": du, "role": "decode"}),
        ],
    );
    fl["serving"]["queue_capacity"] = json!(1);
    fl["serving"]["queue_timeout_s"] = json!(0.5);
    let s = start(&fl, &["--max-concurrent", "1"]);
    let sock = open_stream(
        &s,
        json!({"prompt": "x", "max_tokens": 1000, "stream": true}),
    )
    .await;
    // Second request queues for a seat; a third meanwhile exceeds max_concurrent + queue_capacity.
    let url = format!("{}/v1/completions", s.data);
    let queued =
        tokio::spawn(async move { call("POST", &url, Some(json!({"prompt": "y"}))).await });
    eventually("second request retained", || async {
        state(&s).await["serving"]["http_retained"] == 2
    })
    .await;
    let (st, _, _) = call(
        "POST",
        &format!("{}/v1/completions", s.data),
        Some(json!({"prompt": "z"})),
    )
    .await;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS);
    let (st, _, body) = queued.await.unwrap();
    assert_eq!(st, StatusCode::GATEWAY_TIMEOUT);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v,
        json!({"error": {"message": "queue deadline expired", "type": "queue_expired"}})
    );
    let st = state(&s).await;
    assert_eq!(st["admission"]["queue_high_water"], 1);
    assert_eq!(st["admission"]["queued"], 0);
    assert_eq!(st["outcome_reasons"]["expired"]["queue_timeout"], 1);
    assert_eq!(st["outcome_reasons"]["rejected"]["inflight_limit"], 1);
    drop(sock);
}
