//! A real third-party engine behind the router (docs/testing.md): llama.cpp's OpenAI server
//! (llama-cpp-python, `python -m llama_cpp.server`) serving a tiny GGUF this test writes with
//! the `gguf` package (`tests/python/make_tiny_gguf.py`: llama architecture, random weights,
//! 256-token context), as the single aggregated engine of a real `narwhal-serve`, driven by the
//! official `openai` SDK (`tests/python/sdk_driver.py`).
//!
//! Each behaviour is its own test. The yardstick is the engine itself: the same request sent
//! straight to llama.cpp (greedy sampling, so deterministic) gives the text, finish reason, usage
//! and error the router must relay. `engine_alone_*` checks the yardstick (it needs no router
//! fix). The restart and readmission tests rely on the engine's `health_path` (`/v1/models`):
//! llama.cpp has no `GET /health`.
//!
//! Facts about the engine used here, from llama-cpp-python 0.3.x's source (`llama_cpp/server/`):
//! no `GET /health` route (404; `GET /v1/models` answers 200); `x-request-id` is read by
//! starlette-context's `RequestIdPlugin`, which answers 400 to anything but a UUID; a prompt over
//! the context is `400 {"error": {"message": "This model's maximum context length is N tokens…",
//! "code": "context_length_exceeded"}}` for a non-streaming request (a streaming one fails inside
//! the stream); streams carry no `usage` and `stream_options` is ignored; with its default
//! `interrupt_requests=True` a stream is cut short (a bare `[DONE]`, no finish chunk) whenever
//! another request waits for the model lock, which `GET /v1/models` takes, so every engine here
//! runs with `--interrupt_requests false` (an operator probing `/v1/models` must do the same).
//!
//! Needs the Python test venv, built on demand by `tests/python/ensure-venv.sh`; built with
//! `NARWHAL_SKIP_VENV=1` every test here is ignored instead (see `pysdk.rs`; never in CI).

use crate::pysdk;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use narwhal_shared::documents::replies::ErrorDetail;
use narwhal_testkit::{
    FleetSpec, Http, RequestRow, RouterHandle, RouterProbe, start_router, usage_of, wait_until,
};
use serde_json::{Value, json};
use tempfile::TempDir;

/// Served model name (the engine's `--model_alias` and the fleet's `model`).
const MODEL: &str = "tiny-llama";
/// Context length of the test model and server, tokens: the smallest llama.cpp serves (it pads
/// a context to a multiple of 256).
const CTX: u32 = 256;
/// Tokens per answer; the model never emits EOS, so answers run to this unless stopped.
const MAX_TOKENS: u64 = 8;
/// Per-request timeout of the SDK client.
const SDK_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the engine may take to load and answer `GET /v1/models` (Python imports on a
/// loaded 2-core machine).
const ENGINE_START: Duration = Duration::from_secs(120);

/// A running llama.cpp OpenAI server (killed on drop), restartable on the same port.
struct LlamaServer {
    child: Option<Child>,
    python: PathBuf,
    model: PathBuf,
    log: PathBuf,
    port: u16,
    /// `http://127.0.0.1:PORT`.
    url: String,
}

impl LlamaServer {
    /// Starts a server on a free loopback port: a port is picked by binding `:0` and releasing
    /// it, and another is tried when the server then fails to bind it (someone took it).
    async fn start(python: &Path, model: &Path, dir: &Path, label: &str) -> Self {
        let log = dir.join(format!("{label}.log"));
        let mut last = String::new();
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let mut s = LlamaServer {
                child: None,
                python: python.to_path_buf(),
                model: model.to_path_buf(),
                log: log.clone(),
                port,
                url: format!("http://127.0.0.1:{port}"),
            };
            match s.spawn().await {
                Ok(()) => return s,
                Err(e) if e.contains("address already in use") => last = e,
                Err(e) => panic!("{label}: {e}"),
            }
        }
        panic!("{label}: no free port after 5 tries: {last}");
    }

    /// Starts the process on `self.port` and waits until `GET /v1/models` answers 200.
    async fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("open {}: {e}", self.log.display()))?;
        let mut cmd = Command::new(&self.python);
        cmd.args(["-m", "llama_cpp.server", "--model"])
            .arg(&self.model)
            .args(["--model_alias", MODEL, "--host", "127.0.0.1"])
            .args(["--port", &self.port.to_string()])
            .args(["--n_ctx", &CTX.to_string(), "--n_threads", "1"])
            .args(["--n_threads_batch", "1"])
            // llama-cpp-python ends an in-flight stream (a bare `[DONE]`, no finish chunk) as
            // soon as any other request waits for the model lock, and `GET /v1/models` (our
            // `health_path`) takes that lock: the default `interrupt_requests=True` truncates
            // answers whenever a probe lands mid-stream (`server/app.py`, `get_event_publisher`).
            .args(["--interrupt_requests", "false"])
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy")
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("spawn llama_cpp.server: {e}"))?;
        let http = http();
        let deadline = Instant::now() + ENGINE_START;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "llama_cpp.server exited ({status}) before serving; log tail:\n{}",
                    self.log_tail(30)
                ));
            }
            let up = http
                .get(format!("{}/v1/models", self.url))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            if up {
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "llama_cpp.server did not serve within {ENGINE_START:?}; log tail:\n{}",
                    self.log_tail(30)
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A new process on the same port (the restarted engine).
    async fn restart(&mut self) {
        self.kill();
        if let Err(e) = self.spawn().await {
            panic!("restart on port {}: {e}", self.port);
        }
    }

    fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn http() -> reqwest::Client {
    narwhal_testkit::http_client()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("HTTP client")
}

/// A temp dir with the tiny model written into it, and the venv's interpreter.
struct Lab {
    dir: TempDir,
    python: PathBuf,
    model: PathBuf,
}

impl Lab {
    /// The tiny model written into a new temporary directory (`test` names the test in
    /// failures).
    fn new(test: &str) -> Lab {
        let python = pysdk::python(test);
        let dir = tempfile::tempdir().expect("tempdir");
        let model = dir.path().join("tiny-llama.gguf");
        let out = Command::new(&python)
            .arg(pysdk::python_dir().join("make_tiny_gguf.py"))
            .arg(&model)
            .args(["--ctx", &CTX.to_string(), "--seed", "7"])
            .output()
            .expect("run make_tiny_gguf.py");
        assert!(
            out.status.success(),
            "make_tiny_gguf.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Lab { dir, python, model }
    }

    async fn engine(&self, label: &str) -> LlamaServer {
        LlamaServer::start(&self.python, &self.model, self.dir.path(), label).await
    }

    /// `narwhal-serve` over `engines` (`(iid, server)`), each an aggregated (`decode`-role)
    /// engine of a `vllm`-backend fleet: the role a single engine that runs whole requests has
    /// (docs/configuration.md, `engines[].role`; placement falls back to aggregated serving when
    /// no prefill engine exists).
    ///
    /// llama.cpp has no `GET /health` (404): every engine's `health_path` is `/v1/models`,
    /// which it answers (docs/configuration.md, `engines[].health_path`); without it the
    /// router's health gate would never place it.
    fn router(&self, engines: &[(&str, &LlamaServer)]) -> RouterHandle {
        let mut spec = FleetSpec {
            model: MODEL.into(),
            backend: "vllm".into(),
            engines: engines
                .iter()
                .map(|(iid, s)| (iid.to_string(), s.url.clone(), "decode".to_string()))
                .collect(),
            overrides: json!({}),
            agents: Default::default(),
            pins: Default::default(),
            engine_keys: Default::default(),
        };
        for (iid, _) in engines {
            spec = spec.engine_with(iid, json!({"health_path": "/v1/models"}));
        }
        start_router(self.dir.path(), "router", &spec, &[]).expect("router")
    }

    async fn sdk(&self, base: &str, calls: Value) -> Vec<Value> {
        pysdk::sdk(&self.python, base, &calls, SDK_TIMEOUT).await
    }

    /// [`Lab::new`] with one engine `e0` and a router over it.
    async fn routed(test: &str) -> (Lab, LlamaServer, RouterHandle) {
        let lab = Lab::new(test);
        let engine = lab.engine("e0").await;
        let router = lab.router(&[("e0", &engine)]);
        (lab, engine, router)
    }

    /// `calls` sent straight to `engine` (the yardstick), then through `router`: `(direct,
    /// routed)` results.
    async fn both(
        &self,
        engine: &LlamaServer,
        router: &RouterHandle,
        calls: Value,
    ) -> (Vec<Value>, Vec<Value>) {
        let direct = self.sdk(&engine.url, calls.clone()).await;
        let routed = self.sdk(&router.data, calls).await;
        (direct, routed)
    }
}

/// A greedy request of `api` (`completions` or `chat`) with `extra` params merged in.
fn call(api: &str, prompt: &str, extra: Value) -> Value {
    let mut p = if api == "chat" {
        json!({"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0,
               "messages": [{"role": "user", "content": prompt}]})
    } else {
        json!({"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0, "prompt": prompt})
    };
    for (k, v) in extra.as_object().expect("object") {
        p[k] = v.clone();
    }
    json!({"api": api, "params": p})
}

/// The four basic shapes: (api, stream).
const SHAPES: [(&str, bool); 4] = [
    ("completions", false),
    ("completions", true),
    ("chat", false),
    ("chat", true),
];

fn shape_calls(prompt: &str) -> Value {
    Value::Array(
        SHAPES
            .iter()
            .map(|(api, stream)| call(api, prompt, json!({"stream": stream})))
            .collect(),
    )
}

/// A prompt over the context: `river` is one token of the test model, so this is `CTX + 64`
/// prompt tokens plus BOS.
fn over_long_prompt() -> String {
    vec!["river"; CTX as usize + 64].join(" ")
}

/// What `tests/python/sdk_driver.py` reports for one call, the fields these tests read: on
/// success the answer's `text` and `finish_reason` (its `usage` through
/// [`narwhal_testkit::usage_of`]); on failure the exception's `class`, `status_code` and
/// `message`, and its `body` (the engine's or router's error object; see [`error_body`]).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct SdkResult {
    ok: Option<bool>,
    text: Option<String>,
    finish_reason: Option<String>,
    class: Option<String>,
    status_code: Option<u64>,
    message: Option<String>,
    body: Value,
}

/// `result` (one of [`Lab::sdk`]'s), typed.
fn said(result: &Value) -> SdkResult {
    serde_json::from_value(result.clone())
        .unwrap_or_else(|e| panic!("an SDK driver result ({e}): {result}"))
}

/// The error object the SDK raised with (OpenAI's `error` member); `None` when its `body` is
/// not one.
fn error_body(result: &Value) -> Option<ErrorDetail> {
    serde_json::from_value(said(result).body).ok()
}

/// The yardstick: llama.cpp alone, through the SDK, serves all four shapes (greedy streaming
/// text equals the non-streaming text, usage counted by the engine, `MAX_TOKENS` tokens since
/// the model never ends early), answers an over-long non-streaming prompt with its own 400, has
/// no `/health`, and once restarted on its port serves the same answer. Guards the test model
/// and harness, not the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn engine_alone_serves_the_sdk() {
    let lab = Lab::new("engine_alone_serves_the_sdk");
    let mut engine = lab.engine("e0").await;
    let mut calls = shape_calls("the river and the stone");
    let long = over_long_prompt();
    for api in ["completions", "chat"] {
        calls
            .as_array_mut()
            .expect("array")
            .push(call(api, &long, json!({})));
    }
    let r = lab.sdk(&engine.url, calls).await;
    for (i, (api, stream)) in SHAPES.iter().enumerate() {
        let what = format!("engine alone: {api} stream={stream}");
        let r = pysdk::ok(&r[i], &what);
        let a = said(&r);
        assert!(
            !a.text.as_deref().unwrap_or_default().is_empty(),
            "{what}: {r}"
        );
        assert_eq!(a.finish_reason.as_deref(), Some("length"), "{what}: {r}");
        if !stream {
            let usage = usage_of(&r);
            assert_eq!(usage.completion_tokens, Some(MAX_TOKENS), "{what}: {r}");
            assert!(usage.prompt_tokens > Some(3), "{what}: {r}");
        }
    }
    assert_eq!(
        said(&r[1]).text,
        said(&r[0]).text,
        "greedy completions: stream = non-stream"
    );
    assert_eq!(
        said(&r[3]).text,
        said(&r[2]).text,
        "greedy chat: stream = non-stream"
    );
    for i in [4, 5] {
        let msg = pysdk::api_error(&r[i], "BadRequestError", 400, "over-long prompt");
        assert!(
            msg.contains(&format!("maximum context length is {CTX} tokens")),
            "{msg}"
        );
        assert_eq!(
            error_body(&r[i]).and_then(|b| b.code),
            Some(json!("context_length_exceeded")),
            "{}",
            r[i]
        );
    }
    // What `engines[].health_path` is for: no /health, /v1/models instead.
    let health = http()
        .get(format!("{}/health", engine.url))
        .send()
        .await
        .expect("GET /health");
    assert_eq!(health.status(), 404, "llama.cpp grew a /health route");
    // The harness restarts an engine on its port, and the new process serves the same answer.
    let port = engine.port;
    engine.restart().await;
    assert_eq!(engine.port, port);
    let again = lab
        .sdk(
            &engine.url,
            json!([call("completions", "the river and the stone", json!({}))]),
        )
        .await;
    assert_eq!(
        said(&pysdk::ok(&again[0], "after restart")).text,
        said(&r[0]).text,
        "restarted engine, same greedy answer"
    );
}

/// Non-streaming chat and completions through the router: 200 with the engine's own answer
/// (greedy, so the same text and finish reason the engine gives when asked directly).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn non_streaming_answers_are_the_engines() {
    let (lab, engine, router) = Lab::routed("non_streaming_answers_are_the_engines").await;
    let calls = json!([
        call("completions", "the river and the stone", json!({})),
        call("chat", "the river and the stone", json!({})),
    ]);
    let (direct, routed) = lab.both(&engine, &router, calls).await;
    for (i, api) in ["completions", "chat"].into_iter().enumerate() {
        let d = pysdk::ok(&direct[i], &format!("direct {api}"));
        let r = pysdk::ok(&routed[i], &format!("routed {api}"));
        let (rs, ds) = (said(&r), said(&d));
        assert_eq!(rs.text, ds.text, "{api}: routed {r}\ndirect {d}");
        assert_eq!(rs.finish_reason, ds.finish_reason, "{api}: {r}");
    }
}

/// Streaming chat and completions through the router: the engine's text chunk by chunk, ended
/// properly, and the router counts the tokens the stream carried (llama.cpp sends no
/// `token_ids`): no "[DONE] before any token", no ejection, journal rows `completed` with
/// `output_len` = `MAX_TOKENS`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn streaming_answers_are_the_engines() {
    let (lab, engine, router) = Lab::routed("streaming_answers_are_the_engines").await;
    let calls = json!([
        call(
            "completions",
            "the river and the stone",
            json!({"stream": true})
        ),
        call("chat", "the river and the stone", json!({"stream": true})),
        call(
            "completions",
            "north south east west",
            json!({"stream": true})
        ),
        call("chat", "north south east west", json!({"stream": true})),
    ]);
    let (direct, routed) = lab.both(&engine, &router, calls).await;
    for i in 0..4 {
        let d = pysdk::ok(&direct[i], &format!("direct stream {i}"));
        let r = pysdk::ok(&routed[i], &format!("routed stream {i}"));
        let (rs, ds) = (said(&r), said(&d));
        assert!(!rs.text.as_deref().unwrap_or_default().is_empty(), "{r}");
        assert_eq!(rs.text, ds.text, "stream {i}: routed {r}\ndirect {d}");
        assert_eq!(rs.finish_reason, ds.finish_reason, "stream {i}: {r}");
    }
    let st = router.state().await;
    assert_eq!(st.ejected, Vec::<String>::new(), "nothing ejected: {st:?}");
    assert_eq!(st.served, 4, "{st:?}");
    let rows = wait_until(Duration::from_secs(10), || {
        let rows = router.request_rows();
        async move { (rows.len() >= 4).then_some(rows) }
    })
    .await
    .unwrap_or_else(|| panic!("4 journal rows: {:?}", router.journal_rows()));
    assert_eq!(rows.len(), 4, "{rows:?}");
    for row in &rows {
        assert_eq!(row.terminal, "completed", "{row:?}");
        assert_eq!(row.output_len, Some(MAX_TOKENS), "tokens counted: {row:?}");
    }
}

/// `usage` is the engine's: a non-streaming answer carries exactly the engine's counts (its
/// tokenizer's `prompt_tokens`, not the router's estimate from characters); a streaming client
/// asking `stream_options.include_usage` gets a usage chunk whose `completion_tokens` are the
/// tokens streamed (llama.cpp streams carry no usage of their own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn usage_is_the_engines() {
    let (lab, engine, router) = Lab::routed("usage_is_the_engines").await;
    let prompt = "the quiet river and the bright stone under the early morning light";
    let plain = json!([
        call("completions", prompt, json!({})),
        call("chat", prompt, json!({}))
    ]);
    let (direct, routed) = lab.both(&engine, &router, plain).await;
    for (i, api) in ["completions", "chat"].into_iter().enumerate() {
        let d = pysdk::ok(&direct[i], &format!("direct {api}"));
        let r = pysdk::ok(&routed[i], &format!("routed {api}"));
        // prompt_tokens, completion_tokens and total_tokens, each the engine's.
        assert_eq!(
            usage_of(&r),
            usage_of(&d),
            "{api} usage: routed {r}\ndirect {d}"
        );
    }
    let streamed = lab
        .sdk(
            &router.data,
            json!([
                call(
                    "completions",
                    prompt,
                    json!({"stream": true,
                     "stream_options": {"include_usage": true}})
                ),
                call(
                    "chat",
                    prompt,
                    json!({"stream": true,
                     "stream_options": {"include_usage": true}})
                ),
            ]),
        )
        .await;
    for (i, api) in ["completions", "chat"].into_iter().enumerate() {
        let r = pysdk::ok(&streamed[i], &format!("routed {api} stream with usage"));
        let u = usage_of(&r);
        assert_eq!(u.completion_tokens, Some(MAX_TOKENS), "{api}: {r}");
        let (p, c, t) = (
            u.prompt_tokens.unwrap_or(0),
            u.completion_tokens.unwrap_or(0),
            u.total_tokens.unwrap_or(0),
        );
        assert!(p > 0 && t == p + c, "{api}: {r}");
    }
}

/// `stop` ends the answer where the engine ends it: the same truncated text and
/// `finish_reason: "stop"` as the engine gives directly, streaming and not. The stop string is
/// a word from the middle of the unstopped greedy answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn stop_sequences_end_the_answer() {
    let (lab, engine, router) = Lab::routed("stop_sequences_end_the_answer").await;
    let prompt = "the river and the stone";
    let free = lab
        .sdk(
            &engine.url,
            json!([
                call("completions", prompt, json!({})),
                call("chat", prompt, json!({}))
            ]),
        )
        .await;
    for (i, api) in ["completions", "chat"].into_iter().enumerate() {
        let full = said(&pysdk::ok(&free[i], &format!("unstopped {api}")))
            .text
            .unwrap_or_default();
        // The third word of the answer, found after its start, so the cut keeps some text.
        let stop = full
            .split_whitespace()
            .nth(2)
            .unwrap_or_else(|| panic!("{api}: answer {full:?} has fewer than 3 words"))
            .to_string();
        let cut = full.find(&stop).expect("stop word is in the text");
        assert!(cut > 0, "{api}: {full:?}");
        let calls = json!([
            call(api, prompt, json!({"stop": [stop.clone()]})),
            call(api, prompt, json!({"stop": [stop.clone()], "stream": true})),
        ]);
        let (direct, routed) = lab.both(&engine, &router, calls).await;
        for j in 0..2 {
            let d = pysdk::ok(&direct[j], &format!("direct {api} stop {j}"));
            let ds = said(&d);
            assert_eq!(
                ds.finish_reason.as_deref(),
                Some("stop"),
                "{api}: engine stops: {d}"
            );
            assert_eq!(ds.text.as_deref(), Some(&full[..cut]), "{api}: {d}");
            let r = pysdk::ok(&routed[j], &format!("routed {api} stop {j}"));
            let rs = said(&r);
            assert_eq!(rs.text, ds.text, "{api} stop {j}: routed {r}");
            assert_eq!(
                rs.finish_reason.as_deref(),
                Some("stop"),
                "{api} stop {j}: {r}"
            );
        }
    }
}

/// A prompt over the context length, non-streaming: the client gets the engine's own 400 (the
/// SDK's `BadRequestError`) with the engine's message, not a 502; the engine is not ejected and
/// serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn over_long_prompt_is_the_engines_400() {
    let (lab, engine, router) = Lab::routed("over_long_prompt_is_the_engines_400").await;
    let long = over_long_prompt();
    let calls = json!([
        call("completions", &long, json!({})),
        call("chat", &long, json!({}))
    ]);
    let (direct, routed) = lab.both(&engine, &router, calls).await;
    for (i, api) in ["completions", "chat"].into_iter().enumerate() {
        let want = pysdk::api_error(&direct[i], "BadRequestError", 400, &format!("direct {api}"));
        let got = pysdk::api_error(&routed[i], "BadRequestError", 400, &format!("routed {api}"));
        assert_eq!(got, want, "{api}: the engine's message reaches the client");
    }
    let after = lab
        .sdk(
            &router.data,
            json!([call("completions", "the river", json!({}))]),
        )
        .await;
    pysdk::ok(&after[0], "a normal request after the 400s");
    let st = router.state().await;
    assert_eq!(
        st.ejected,
        Vec::<String>::new(),
        "client faults eject nothing: {st:?}"
    );
}

/// Two engines; one is killed: clients keep being served by the other (retries avoid the dead
/// one), the router ejects it; restarted on the same port, it is readmitted without an agent or
/// an operator (llama.cpp has no `/health`: the probe must use what the engine has), and serves
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn killed_engine_is_ejected_then_readmitted() {
    let lab = Lab::new("killed_engine_is_ejected_then_readmitted");
    let e0 = lab.engine("e0").await;
    let mut e1 = lab.engine("e1").await;
    let router = lab.router(&[("e0", &e0), ("e1", &e1)]);
    let warm = lab.sdk(&router.data, shape_calls("the river")).await;
    for (i, r) in warm.iter().enumerate() {
        pysdk::ok(r, &format!("warm-up {i}"));
    }

    e1.kill();
    // Every request is still served (by e0) while e1's failures pile up to an ejection.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let burst = lab.sdk(&router.data, shape_calls("the stone")).await;
        for (i, r) in burst.iter().enumerate() {
            pysdk::ok(r, &format!("served while e1 is down ({i})"));
        }
        let st = router.state().await;
        if st.ejected == ["e1"] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "e1 not ejected within 60 s: {st:?}"
        );
    }

    e1.restart().await;
    let probe = RouterProbe {
        control: router.control.clone(),
        fast: Http::new(Duration::from_secs(30)),
    };
    let readmitted = wait_until(Duration::from_secs(60), || async {
        let st = probe.state().await?;
        st.ejected.is_empty().then_some(st)
    })
    .await;
    assert!(
        readmitted.is_some(),
        "e1 restarted but not readmitted within 60 s; journal: {:?}",
        router.journal_rows()
    );
    assert!(
        !router.events_of("engine_readmitted", "e1").is_empty(),
        "a readmission event for e1: {:?}",
        router.journal_rows()
    );
    // And e1 takes traffic again.
    let served_by_e1 = |rows: &[RequestRow]| {
        rows.iter()
            .filter(|r| r.decode_iid.as_deref() == Some("e1") && r.terminal == "completed")
            .count()
    };
    let before = served_by_e1(&router.request_rows());
    let deadline = Instant::now() + Duration::from_secs(60);
    while served_by_e1(&router.request_rows()) == before {
        let burst = lab.sdk(&router.data, shape_calls("the light")).await;
        for (i, r) in burst.iter().enumerate() {
            pysdk::ok(r, &format!("after readmission ({i})"));
        }
        assert!(
            Instant::now() < deadline,
            "readmitted e1 served nothing within 60 s"
        );
    }
}

/// The only engine is killed: clients get a clear 5xx through the SDK (`InternalServerError`,
/// 502 or 503, with a message), never a hang; restarted on the same port, it serves again
/// within a minute with no operator action (whether the router ejected it and readmitted it,
/// or kept it in placement as the last live engine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn only_engine_killed_then_restarted_serves_again() {
    let (lab, mut engine, router) =
        Lab::routed("only_engine_killed_then_restarted_serves_again").await;
    let warm = lab.sdk(&router.data, shape_calls("the river")).await;
    for (i, r) in warm.iter().enumerate() {
        pysdk::ok(r, &format!("warm-up {i}"));
    }

    engine.kill();
    let down = lab.sdk(&router.data, shape_calls("the stone")).await;
    for (i, r) in down.iter().enumerate() {
        let a = said(r);
        assert_eq!(a.ok, Some(false), "served with the engine down? {r}");
        assert_eq!(
            a.class.as_deref(),
            Some("InternalServerError"),
            "engine down ({i}): {r}"
        );
        let status = a.status_code.unwrap_or(0);
        assert!(status == 502 || status == 503, "engine down ({i}): {r}");
        assert!(
            !a.message.as_deref().unwrap_or_default().is_empty(),
            "a message: {r}"
        );
    }

    engine.restart().await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = lab
            .sdk(
                &router.data,
                json!([call("completions", "the light", json!({}))]),
            )
            .await;
        if said(&r[0]).ok == Some(true) {
            pysdk::ok(&r[0], "after restart");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "restarted engine not served within 60 s: {r:?}; state: {:?}",
            router.state().await
        );
    }
}
