//! A tiny in-process fake engine (axum on `127.0.0.1:0`) that speaks just enough of the vLLM
//! and SGLang protocols for router tests to check what the router sends (bodies, headers,
//! descriptors, rendezvous) and to see cancellations: a dropped connection drops the handler
//! or the response stream, which counts in [`Seen::cancelled`].
//!
//! Where the real simulator (`narwhal-engine-sim`) is about engine behaviour, this is about the
//! router's requests: every request body is kept.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::router::{FleetSpec, RouterHandle, merge};

/// What a fake engine received.
#[derive(Debug, Default)]
pub struct Seen {
    /// Prefill legs: `(x-request-id, body)`.
    pub prefill: Vec<(Option<String>, Value)>,
    /// Decode (or aggregated) legs: `(x-request-id, body)`.
    pub decode: Vec<(Option<String>, Value)>,
    /// Requests whose connection closed before the answer was complete.
    pub cancelled: usize,
}

/// A fake engine's behaviour and what it saw (clones share both).
#[derive(Debug, Clone)]
pub struct FakeEngine {
    seen: Arc<Mutex<Seen>>,
    prefill_status: u16,
    tpot: Duration,
    tokens: usize,
    decode_head_delay: Duration,
    bootstrap_port: u16,
    decode_fail_first: Arc<Mutex<usize>>,
    prefill_delay: Duration,
    prefill_finish: Option<&'static str>,
    token_ids: bool,
    decode_error: Option<(u16, &'static str)>,
    tag_prompt: bool,
    usage: bool,
    always_streams: bool,
}

/// The vLLM descriptor every fake prefill answers with (`kv_transfer_params`), including a
/// field the router must carry verbatim (`extra_field_kept`).
pub fn fake_descriptor() -> Value {
    json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "fake-p0",
           "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 40111,
           "remote_request_id": "x", "tp_size": 1, "extra_field_kept": {"a": 1}})
}

impl FakeEngine {
    /// Decodes stream `tokens` tokens (` t0 t1 ...`) `tpot_ms` apart; prefills answer 200 with
    /// [`fake_descriptor`] after 30 ms; SGLang bootstrap port 8998.
    pub fn new(tpot_ms: u64, tokens: usize) -> FakeEngine {
        FakeEngine {
            seen: Arc::default(),
            prefill_status: 200,
            tpot: Duration::from_millis(tpot_ms),
            tokens,
            decode_head_delay: Duration::ZERO,
            bootstrap_port: 8998,
            decode_fail_first: Arc::new(Mutex::new(0)),
            prefill_delay: Duration::from_millis(30),
            prefill_finish: None,
            token_ids: true,
            decode_error: None,
            tag_prompt: false,
            usage: true,
            always_streams: false,
        }
    }

    /// Never reports `usage` (streams carry no usage chunk, whole answers no `usage`), as
    /// llama.cpp's server streams.
    pub fn without_usage(mut self) -> FakeEngine {
        self.usage = false;
        self
    }

    /// Prefills answer 200 with an empty text, this `finish_reason` and no
    /// `kv_transfer_params`: the generation ended on the prefill's one token (vLLM's NIXL
    /// connector hands off only length-capped prefills).
    pub fn prefill_finishes(mut self, finish_reason: &'static str) -> FakeEngine {
        self.prefill_finish = Some(finish_reason);
        self
    }

    /// Answers every decode or whole leg as an SSE stream (`text/event-stream`), even one
    /// that asked `"stream": false` (engines seen in the field do).
    pub fn always_streams(mut self) -> FakeEngine {
        self.always_streams = true;
        self
    }

    /// Never sends `token_ids`, whatever the request asks (llama.cpp, TGI, older vLLM).
    pub fn without_token_ids(mut self) -> FakeEngine {
        self.token_ids = false;
        self
    }

    /// Decode and whole legs answer `status` with `{"error": {"message": message}}`.
    pub fn decode_error(mut self, status: u16, message: &'static str) -> FakeEngine {
        self.decode_error = Some((status, message));
        self
    }

    /// Each generated token's text starts with the request's prompt (` <prompt>:t<i>`), so a
    /// test can tell which prompt an answer belongs to.
    pub fn tag_prompt(mut self) -> FakeEngine {
        self.tag_prompt = true;
        self
    }

    /// Prefills answer `status` with a context-length error body instead (400 by the engine's
    /// reasoning: "maximum context length is 16 tokens").
    pub fn prefill_status(mut self, status: u16) -> FakeEngine {
        self.prefill_status = status;
        self
    }

    /// How long a prefill takes (default 30 ms).
    pub fn prefill_delay(mut self, d: Duration) -> FakeEngine {
        self.prefill_delay = d;
        self
    }

    /// A decode waits this long before its response head (SGLang: lets a failing prefill win).
    pub fn decode_head_delay(mut self, d: Duration) -> FakeEngine {
        self.decode_head_delay = d;
        self
    }

    /// The first `n` decode requests are answered 503.
    pub fn decode_fail_first(self, n: usize) -> FakeEngine {
        *self
            .decode_fail_first
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = n;
        self
    }

    /// What it received so far.
    pub fn seen(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serves on a free loopback port; returns `http://127.0.0.1:PORT`.
    ///
    /// # Panics
    /// When the port cannot be bound.
    pub async fn spawn(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake engine");
        self.serve(listener)
    }

    /// Serves on `addr` (an engine coming back on its old port).
    ///
    /// # Panics
    /// When the port cannot be bound.
    pub async fn spawn_at(&self, addr: SocketAddr) -> String {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind fake engine");
        self.serve(listener)
    }

    fn serve(&self, listener: tokio::net::TcpListener) -> String {
        let bootstrap = self.bootstrap_port;
        let app = Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(completions))
            .route("/health", get(|| async { "" }))
            .route(
                "/server_info",
                get(move || async move {
                    axum::Json(json!({"disaggregation_bootstrap_port": bootstrap}))
                }),
            )
            .with_state(self.clone());
        let addr = listener.local_addr().expect("local addr");
        tokio::spawn(async move {
            axum::serve(listener, app)
                .await
                .expect("fake engine serves");
        });
        format!("http://{addr}")
    }
}

/// Counts a cancellation when dropped before `done`.
struct CancelGuard {
    seen: Arc<Mutex<Seen>>,
    done: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.done {
            self.seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .cancelled += 1;
        }
    }
}

/// What the fake engine reads of the body the router sends it (`None`: absent or `null`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct EngineBody {
    /// Whether the router asked for a stream.
    stream: Option<bool>,
    /// vLLM's `return_token_ids`.
    return_token_ids: Option<bool>,
    /// The prompt: text, token ids, or a batch (an open document).
    prompt: Option<Value>,
}

/// One choice of an answer or chunk, with `token_ids` when `ids` are given.
fn choice_with_ids(mut choice: Value, ids: Option<Value>) -> Value {
    if let Some(ids) = ids {
        merge(&mut choice, json!({ "token_ids": ids }));
    }
    choice
}

async fn completions(State(f): State<FakeEngine>, headers: HeaderMap, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).expect("the router sends JSON");
    let b = EngineBody::deserialize(&v).expect("the router sends an OpenAI request body");
    let rid = headers
        .get("x-request-id")
        .map(|h| h.to_str().expect("ASCII request id").to_string());
    let is_prefill = v.pointer("/kv_transfer_params/do_remote_decode") == Some(&json!(true))
        || (v.get("bootstrap_room").is_some() && b.stream == Some(false));
    let mut guard = CancelGuard {
        seen: f.seen.clone(),
        done: false,
    };
    if is_prefill {
        f.seen().prefill.push((rid, v.clone()));
        tokio::time::sleep(f.prefill_delay).await;
        guard.done = true;
        if f.prefill_status != 200 {
            let msg = "This model's maximum context length is 16 tokens. However, your request has 99 input tokens.";
            let status = StatusCode::from_u16(f.prefill_status).expect("status code");
            let body = json!({"error": {"message": msg, "type": "BadRequestError", "param": null,
                                        "code": f.prefill_status}});
            return (status, axum::Json(body)).into_response();
        }
        if let Some(reason) = f.prefill_finish {
            return axum::Json(
                json!({"id": "cmpl-p", "object": "text_completion", "created": 1,
                                      "model": "tiny-sim",
                                      "choices": [{"index": 0, "text": "", "finish_reason": reason,
                                                   "stop_reason": null, "logprobs": null}],
                                      "usage": {"prompt_tokens": 7, "completion_tokens": 1,
                                                "total_tokens": 8},
                                      "kv_transfer_params": null}),
            )
            .into_response();
        }
        return axum::Json(json!({"id": "cmpl-p", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "z"}],
                                  "kv_transfer_params": fake_descriptor()}))
        .into_response();
    }
    f.seen().decode.push((rid, v.clone()));
    {
        let mut fail = f
            .decode_fail_first
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if *fail > 0 {
            *fail -= 1;
            guard.done = true;
            let body = json!({"error": {"message": "busy", "code": 503}});
            return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
        }
    }
    if let Some((status, message)) = f.decode_error {
        guard.done = true;
        let status = StatusCode::from_u16(status).expect("status code");
        let body = json!({"error": {"message": message, "type": "BadRequestError", "param": null,
                                    "code": status.as_u16()}});
        return (status, axum::Json(body)).into_response();
    }
    tokio::time::sleep(f.decode_head_delay).await;
    let chat = v.get("messages").is_some();
    let with_ids = f.token_ids && b.return_token_ids == Some(true);
    let (n, tpot, usage) = (f.tokens, f.tpot, f.usage);
    let tag = match (&b.prompt, f.tag_prompt) {
        (Some(Value::String(p)), true) => format!("{p}:"),
        (Some(p), true) => format!("{p}:"),
        _ => String::new(),
    };
    if b.stream != Some(true) && !f.always_streams {
        // A whole (non-streaming) answer, after the time its tokens take.
        tokio::time::sleep(tpot * n as u32).await;
        guard.done = true;
        let text: String = (0..n).map(|i| format!(" {tag}t{i}")).collect();
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        let ids = with_ids.then(|| json!((0..n).map(|i| 101 + i).collect::<Vec<_>>()));
        let mut answer = json!({"id": "c", "object": if chat { "chat.completion" } else { "text_completion" },
                                "created": 1, "model": "tiny-sim", "choices": [choice_with_ids(choice, ids)],
                                "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                          "total_tokens": 7 + n}});
        if !f.usage {
            answer.as_object_mut().expect("object").remove("usage");
        }
        return axum::Json(answer).into_response();
    }
    let stream = futures_util::stream::unfold((0usize, guard), move |(i, mut guard)| {
        let tag = tag.clone();
        async move {
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
                let choice = if chat {
                    json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                           "finish_reason": null})
                } else {
                    json!({"index": 0, "text": "", "finish_reason": null})
                };
                let choice = choice_with_ids(choice, with_ids.then(|| json!([])));
                let c = json!({"id": "c", "object": "chunk", "created": 1, "model": "tiny-sim",
                               "choices": [choice]});
                format!("data: {c}\n\n")
            } else if i <= n {
                let text = format!(" {tag}t{}", i - 1);
                let finish = if i == n { json!("length") } else { Value::Null };
                let choice = if chat {
                    json!({"index": 0, "delta": {"content": text}, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": text, "finish_reason": finish})
                };
                let choice = choice_with_ids(choice, with_ids.then(|| json!([100 + i])));
                let c = json!({"id": "c", "created": 1, "model": "tiny-sim", "choices": [choice]});
                format!("data: {c}\n\n")
            } else if usage {
                let usage = json!({"id": "c", "choices": [],
                               "usage": {"prompt_tokens": 7, "completion_tokens": n}});
                format!("data: {usage}\n\ndata: [DONE]\n\n")
            } else {
                "data: [DONE]\n\n".to_string()
            };
            Some((
                Ok::<_, std::convert::Infallible>(Bytes::from(frame)),
                (i + 1, guard),
            ))
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .expect("SSE response")
}

/// A router (`narwhal-serve --log-level warn`) over fake engines given as `(iid, engine,
/// role)`, each serving on a free port, in a temporary directory of its own: retries back off
/// 10–20 ms, and `overrides` are merged into the fleet file.
pub async fn router_over_fakes(
    backend: &str,
    engines: &[(&str, &FakeEngine, &str)],
    overrides: Value,
) -> RouterHandle {
    let mut spec = Vec::new();
    for (iid, engine, role) in engines {
        spec.push((iid.to_string(), engine.spawn().await, role.to_string()));
    }
    let fleet = FleetSpec {
        model: "tiny-sim".into(),
        backend: backend.into(),
        engines: spec,
        overrides: json!({"serving": {"retry_base_s": 0.01, "retry_cap_s": 0.02}}),
        agents: Default::default(),
        engine_keys: Default::default(),
        pins: Default::default(),
    }
    .with(overrides);
    RouterHandle::over(&fleet, &["--log-level", "warn"])
}
