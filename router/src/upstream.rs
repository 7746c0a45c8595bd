//! Router → engine HTTP: pooled hyper client, the prefill and decode legs, and how a failed leg
//! is classified (behaviour.md 6.2, 7.1–7.3).
//!
//! ```text
//!  leg body ──POST <engine><path>──► engine          x-request-id: a fresh UUID per leg
//!     prefill: JSON answer ──► KV descriptor (vLLM) / () (SGLang)      or LegError
//!              (vLLM: no descriptor because the generation already ended ──► Finished answer)
//!     decode:  SSE ──► LiveStream (held until the first token)          or LegError
//!     whole:   JSON answer (a non-streaming client on an aggregated engine) or LegError
//!  LegError ──class()──► breaker   ──reason()──► failed{reason}   ──transient()──► retry?
//! ```
//!
//! Dropping any future or [`LiveStream`] here drops the hyper request/response, which closes
//! the upstream connection: that is how cancellation reaches the engine.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use narwhal_shared::documents::replies::ErrorDetail;
use serde_json::Value;

use crate::breaker::FailureClass;
use crate::config::{Config, secs};
use crate::placement::Phase;
use narwhal_relay::{
    AnswerFacts, RelayOptions, RelayStep, StreamFailure, assemble_sse, clean_answer, upstream_error,
};

/// Error answers read from an engine are capped at this many bytes.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Router header on every leg: the client-facing request id (`x-request-id` of the answer).
pub(crate) const REQUEST_HEADER: &str = "x-narwhal-request-id";

/// Router header on every leg: which leg of which attempt (`a1-prefill`, `a2-decode`,
/// `a1-whole`; `p3-a1-decode` for prompt 3 of a fanned-out batch).
pub(crate) const LEG_HEADER: &str = "x-narwhal-leg";
/// vLLM's header naming the data-parallel rank a request runs on
/// (`vllm/entrypoints/generate/base/serving.py`, `_get_data_parallel_rank`).
pub(crate) const DP_RANK_HEADER: &str = "X-data-parallel-rank";

/// How one leg is named to its engine: `x-request-id` is a fresh UUID4 (the one form every
/// engine accepts: llama.cpp's server refuses anything else with a bare 400, SGLang takes it
/// as its `rid`), and the router's own headers carry the request and the leg (the
/// reference sends `<rid>-a<n>-<leg>`, docs/deviations.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LegId {
    /// The leg's request id: a UUID4, unique per leg.
    pub(crate) id: String,
    /// The router request id the client sees.
    pub(crate) rid: String,
    /// `[p<k>-]a<attempt>-<leg>`.
    pub(crate) label: String,
    /// The engine's data-parallel rank to run on, sent as vLLM's `X-data-parallel-rank`
    /// (`vllm/entrypoints/openai/completion/serving.py` reads it); `None` sends none.
    pub(crate) dp_rank: Option<u32>,
}

impl LegId {
    /// A new id for leg `leg` (`prefill`, `decode`, `whole`) of attempt `attempt` of request
    /// `rid` (`prompt`: the prompt's index in a fanned-out batch).
    pub(crate) fn new(rid: &str, prompt: Option<usize>, attempt: u32, leg: &str) -> LegId {
        let label = match prompt {
            Some(k) => format!("p{k}-a{attempt}-{leg}"),
            None => format!("a{attempt}-{leg}"),
        };
        LegId {
            id: uuid::Uuid::new_v4().to_string(),
            rid: rid.to_string(),
            label,
            dp_rank: None,
        }
    }

    /// The limit that bounds this leg, for a timeout ([`LegError::Timeout`]).
    pub(crate) fn limit(&self) -> LegLimit {
        if self.label.ends_with("-prefill") {
            LegLimit::Prefill
        } else {
            LegLimit::Whole
        }
    }
}

/// Pooled HTTP/1 client for engines.
#[derive(Clone)]
pub(crate) struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    api_key: Option<String>,
    /// `serving.max_response_bytes`: the bound of a prefill leg's answer, as of every other
    /// answer and stream the router reads (docs/configuration.md, "Size limits").
    max_answer_bytes: usize,
}

impl Upstream {
    pub(crate) fn new(cfg: &Config) -> Self {
        let mut conn = HttpConnector::new();
        conn.set_connect_timeout(Some(secs(cfg.engine.connect_timeout_s)));
        conn.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .build(conn);
        Upstream {
            client,
            api_key: cfg.engine.engine_api_key.clone(),
            max_answer_bytes: usize::try_from(cfg.serving.max_response_bytes).unwrap_or(usize::MAX),
        }
    }

    /// POSTs `body` as JSON with the leg's ids for `call` (a leg or a control POST); the
    /// engine's answer, whatever its status.
    async fn post(
        &self,
        url: &str,
        leg: &LegId,
        body: &Value,
        call: EngineCall,
    ) -> Result<hyper::Response<Incoming>, ConnectFailure> {
        let mut b = Request::builder()
            .method(Method::POST)
            .uri(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("x-request-id", leg.id.as_str())
            .header(REQUEST_HEADER, leg.rid.as_str())
            .header(LEG_HEADER, leg.label.as_str());
        if let Some(r) = leg.dp_rank {
            b = b.header(DP_RANK_HEADER, r);
        }
        if let Some(k) = &self.api_key {
            b = b.header(http::header::AUTHORIZATION, format!("Bearer {k}"));
        }
        let req = b
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| ConnectFailure::bad_url(call, url, &e))?;
        self.client.request(req).await.map_err(|e| {
            // The router's own exhaustion is always told as a connect.
            let stage = if e.is_connect() || local_exhaustion(&e).is_some() {
                ConnectStage::Connect
            } else {
                ConnectStage::Request
            };
            ConnectFailure::new(call, stage, url, &e)
        })
    }

    /// POSTs a leg's body ([`Upstream::post`]); an answer other than 200 is the leg's error
    /// ([`status_error`], from at most [`ERROR_BODY_LIMIT`] bytes of it).
    async fn post_leg(
        &self,
        url: &str,
        leg: &LegId,
        body: &Value,
    ) -> Result<hyper::Response<Incoming>, LegError> {
        let resp = self.post(url, leg, body, EngineCall::Leg).await?;
        let status = resp.status();
        if status != StatusCode::OK {
            let bytes = read_bounded(resp.into_body(), ERROR_BODY_LIMIT)
                .await
                .unwrap_or_default();
            return Err(status_error(status, &bytes));
        }
        Ok(resp)
    }

    /// GET `url`, returning status and (bounded) body. Used for `/health` and `/server_info`.
    ///
    /// # Errors
    /// [`EngineCallError`] ([`EngineCall::Get`]): the request could not be built, sent or
    /// read in `timeout`.
    pub(crate) async fn get(
        &self,
        url: &str,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), EngineCallError> {
        let call = EngineCall::Get;
        let failed = |failure| EngineCallError { call, failure };
        let req = Request::builder()
            .method(Method::GET)
            .uri(url)
            .body(Full::new(Bytes::new()))
            .map_err(|e| failed(CallFailure::Connect(ConnectFailure::bad_url(call, url, &e))))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| failed(connect_failure(call, url, &e).into()))?;
            let status = resp.status();
            let body = read_bounded(resp.into_body(), ERROR_BODY_LIMIT)
                .await
                .map_err(|b| failed(CallFailure::Body(b)))?;
            Ok((status, body))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| failed(CallFailure::TimedOut(timeout)))?
    }

    /// POST `body` as JSON to `url`, returning status and (bounded) body. Used for control
    /// calls: `/tokenize`, SGLang's `/pd_role_switch`.
    ///
    /// # Errors
    /// [`EngineCallError`] ([`EngineCall::Post`]): the request could not be sent or read in
    /// `timeout`.
    pub(crate) async fn post_json(
        &self,
        url: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), EngineCallError> {
        let call = EngineCall::Post;
        let failed = |failure| EngineCallError { call, failure };
        let fut = async {
            let resp = self
                .post(
                    url,
                    &LegId::new("narwhal-control", None, 0, "control"),
                    body,
                    call,
                )
                .await
                .map_err(|c| failed(c.into()))?;
            let status = resp.status();
            let body = read_bounded(resp.into_body(), ERROR_BODY_LIMIT)
                .await
                .map_err(|b| failed(CallFailure::Body(b)))?;
            Ok((status, body))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| failed(CallFailure::TimedOut(timeout)))?
    }

    /// A breaker probe: GET `url` with the engine credentials, bounded by `timeout`; the
    /// answer's status and (bounded) body, or how it failed ([`EngineCall::Probe`]):
    /// [`EngineCallError::timed_out`] for the timeout or a connect timeout (maybe busy),
    /// [`EngineCallError::is_local`] for the router's own exhaustion, unreachable for
    /// anything else (refused, reset: nothing is listening).
    pub(crate) async fn probe_get(
        &self,
        url: &str,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), EngineCallError> {
        let call = EngineCall::Probe;
        let failed = |failure| EngineCallError { call, failure };
        let mut b = Request::builder().method(Method::GET).uri(url);
        if let Some(k) = &self.api_key {
            b = b.header(http::header::AUTHORIZATION, format!("Bearer {k}"));
        }
        let req = b
            .body(Full::new(Bytes::new()))
            .map_err(|e| failed(CallFailure::Connect(ConnectFailure::bad_url(call, url, &e))))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| failed(connect_failure(call, url, &e).into()))?;
            let status = resp.status();
            let body = read_bounded(resp.into_body(), PROBE_BODY_LIMIT)
                .await
                .map_err(|b| failed(CallFailure::Body(b)))?;
            Ok((status, body))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| failed(CallFailure::TimedOut(timeout)))?
    }

    /// A whole (non-streaming) leg: a non-streaming client's request on an aggregated
    /// engine, answered as the engine answers it (its usage, its errors), bounded by `limit`
    /// (the request deadline) and `serving.max_response_bytes`. An answer that carries its own
    /// complete usage is cleaned for the client at byte level ([`narwhal_relay::clean_answer`]:
    /// no `Value` parsed and written again; `return_token_ids` is the client's); any other is
    /// parsed. An engine that streams the answer anyway (`text/event-stream` to
    /// `"stream": false`) has it assembled into one answer for a chat (`chat`) or completions
    /// client ([`assemble_sse`]).
    pub(crate) async fn whole_answer(
        &self,
        url: &str,
        leg: &LegId,
        body: &Value,
        limit: Instant,
        chat: bool,
        return_token_ids: bool,
    ) -> Result<WholeAnswer, LegError> {
        let fut = async {
            let (bytes, streamed) = self
                .read_answer(url, leg, body, self.max_answer_bytes)
                .await?;
            if !streamed && let Some((clean, facts)) = clean_answer(&bytes, return_token_ids) {
                return Ok(WholeAnswer::Clean(CleanAnswer {
                    body: Bytes::from(clean),
                    facts,
                }));
            }
            answer_value(&bytes, streamed, Some(chat)).map(WholeAnswer::Value)
        };
        match tokio::time::timeout_at(limit.into(), fut).await {
            Ok(r) => r,
            Err(_) => Err(LegError::Timeout(leg.limit())),
        }
    }

    /// The bound of a prefill leg's answer, bytes (`serving.max_response_bytes`).
    pub(crate) fn max_answer_bytes(&self) -> usize {
        self.max_answer_bytes
    }

    /// POSTs a non-streaming leg and reads its JSON answer. `sse_chat`: a streamed answer is
    /// assembled (for a chat client when `Some(true)`); `None` (prefill legs) refuses it as
    /// not JSON.
    pub(crate) async fn json_leg(
        &self,
        url: &str,
        leg: &LegId,
        body: &Value,
        limit: Instant,
        max_bytes: usize,
        sse_chat: Option<bool>,
    ) -> Result<Value, LegError> {
        let fut = async {
            let (bytes, streamed) = self.read_answer(url, leg, body, max_bytes).await?;
            answer_value(&bytes, streamed, sse_chat)
        };
        match tokio::time::timeout_at(limit.into(), fut).await {
            Ok(r) => r,
            Err(_) => Err(LegError::Timeout(leg.limit())),
        }
    }

    /// POSTs a non-streaming leg and reads its answer's bytes (at most `max_bytes`), and
    /// whether the engine streamed it anyway (`text/event-stream`); an error status is the
    /// leg's error.
    pub(crate) async fn read_answer(
        &self,
        url: &str,
        leg: &LegId,
        body: &Value,
        max_bytes: usize,
    ) -> Result<(Bytes, bool), LegError> {
        let resp = self.post_leg(url, leg, body).await?;
        let streamed = resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.trim_start()
                    .to_ascii_lowercase()
                    .starts_with("text/event-stream")
            });
        match read_bounded(resp.into_body(), max_bytes).await {
            Ok(b) => Ok((b, streamed)),
            Err(BodyFailure::TooLarge) => Err(LegError::Stream(StreamFailure::ResponseLimit)),
            Err(BodyFailure::Cut(c)) => Err(LegError::Cut(c)),
        }
    }

    /// Decode leg: POST and hold the stream until the first token or `first_token_by`.
    pub(crate) async fn decode(
        &self,
        url: &str,
        leg: &LegId,
        body: &Value,
        opts: RelayOptions,
        first_token_by: Instant,
    ) -> Result<LiveStream, LegError> {
        let fut = async {
            let resp = self.post_leg(url, leg, body).await?;
            let mut live = LiveStream::new(resp.into_body(), opts);
            match live.next(None).await? {
                RelayStep::Output => {
                    live.first = live.take_output();
                    Ok(live)
                }
                RelayStep::Done => Err(LegError::Stream(StreamFailure::DoneBeforeToken)),
                RelayStep::Failed(f) => Err(LegError::Stream(f)),
                RelayStep::Hold => Err(LegError::Stream(StreamFailure::EndedWithoutDone)),
            }
        };
        match tokio::time::timeout_at(first_token_by.into(), fut).await {
            Ok(r) => r,
            Err(_) => Err(LegError::FirstTokenTimeout),
        }
    }
}

/// A non-streaming leg's answer as a value: JSON, or a stream assembled into one answer for
/// a chat (`Some(true)`) or completions client when `streamed` and `sse_chat` is given; an
/// error member or no choices array fails the leg.
pub(crate) fn answer_value(
    bytes: &[u8],
    streamed: bool,
    sse_chat: Option<bool>,
) -> Result<Value, LegError> {
    let answer = match sse_chat {
        Some(chat) if streamed => assemble_sse(bytes, chat).map_err(LegError::Stream)?,
        _ => serde_json::from_slice::<Value>(bytes).map_err(|e| {
            LegError::InvalidResponse(InvalidAnswer::NotJson {
                parser: e.to_string(),
            })
        })?,
    };
    if let Some(err) = answer.get("error").filter(|e| !e.is_null()) {
        return Err(LegError::Stream(upstream_error(err)));
    }
    if !answer.get("choices").is_some_and(Value::is_array) {
        return Err(LegError::InvalidResponse(InvalidAnswer::NoChoices));
    }
    Ok(answer)
}

/// A whole leg's answer ([`Upstream::whole_answer`]).
#[derive(Debug)]
pub(crate) enum WholeAnswer {
    /// Cleaned at byte level: the client's answer as it is.
    Clean(CleanAnswer),
    /// Parsed: the value path cleans and completes it.
    Value(Value),
}

/// An engine's answer cleaned for its client at byte level, and its usage counts.
#[derive(Debug, Clone)]
pub(crate) struct CleanAnswer {
    /// The JSON object the client gets.
    pub(crate) body: Bytes,
    /// The engine's usage counts.
    pub(crate) facts: AnswerFacts,
}

impl CleanAnswer {
    /// The answer as a value (a batch's answers are merged as values). The bytes are JSON
    /// ([`narwhal_relay::clean_answer`] validated them while it cleaned them).
    pub(crate) fn into_value(self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// Probe answers (`/health`, `/metrics`, `/v1/models`, `/server_info`) are capped at this many
/// bytes.
const PROBE_BODY_LIMIT: usize = 4 * 1024 * 1024;

/// Whether an error's source chain holds an I/O error of the router's own resources: `EMFILE`
/// (its descriptor limit, `LimitNOFILE`), `ENFILE` (the system's), `ENOBUFS` or `ENOMEM`
/// (kernel memory for a socket), `EADDRNOTAVAIL` (no local port left for the connection). Such a connect never reached the engine, so it is not the
/// engine's failure: no breaker evidence, no ejection (behaviour.md 6.2, the `local_pool`
/// reason).
fn local_exhaustion(e: &(dyn std::error::Error + 'static)) -> Option<LocalResource> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(inner) = src {
        let resource = inner
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
            .and_then(|n| match n {
                libc::EMFILE | libc::ENFILE => Some(LocalResource::Descriptors),
                libc::ENOBUFS | libc::ENOMEM => Some(LocalResource::Memory),
                libc::EADDRNOTAVAIL => Some(LocalResource::Ports),
                _ => None,
            });
        if resource.is_some() {
            return resource;
        }
        src = inner.source();
    }
    None
}

/// A failed request of `call` to `url` (hyper-util's error `e`): at the connect when
/// hyper-util says so ([`ConnectStage::Connect`]), else on the open connection.
fn connect_failure(
    call: EngineCall,
    url: &str,
    e: &hyper_util::client::legacy::Error,
) -> ConnectFailure {
    let stage = if e.is_connect() {
        ConnectStage::Connect
    } else {
        ConnectStage::Request
    };
    ConnectFailure::new(call, stage, url, e)
}

/// Whether an error's source chain holds an I/O timeout.
fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(inner) = src {
        if inner
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        src = inner.source();
    }
    false
}

/// An error and its sources, `outer: inner: ...`: the words the journal keeps.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// Reads `body` whole, at most `limit` bytes.
///
/// # Errors
/// [`BodyFailure::TooLarge`] over `limit`, [`BodyFailure::Cut`] when the body fails.
async fn read_bounded(mut body: Incoming, limit: usize) -> Result<Bytes, BodyFailure> {
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyFailure::Cut(CutFailure::new(CutDuring::Answer, &e)))?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(BodyFailure::TooLarge);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(buf))
}

/// An engine's error answer: its status, and its message (`error.message`, `message`,
/// `detail`, else the body text), never empty: a bare status gets a sentence naming it.
fn status_error(status: StatusCode, bytes: &[u8]) -> LegError {
    let parsed: Option<Value> = serde_json::from_slice(bytes).ok();
    let err = parsed.as_ref().and_then(|v| v.get("error"));
    let message = err
        .and_then(|e| e.get("message").and_then(Value::as_str).map(str::to_string))
        .or_else(|| {
            parsed
                .as_ref()
                .and_then(|v| v.get("message"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .or_else(|| {
            parsed
                .as_ref()
                .and_then(|v| v.get("detail"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .filter(|m| !m.trim().is_empty())
        .unwrap_or_else(|| match &parsed {
            // A JSON error without words: nothing of it reads as a message.
            Some(_) => String::new(),
            None => String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned(),
        });
    let message = if message.trim().is_empty() {
        format!(
            "the engine answered {} {} without a message",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        )
        .trim_end()
        .to_string()
    } else {
        message
    };
    let param = err
        .and_then(|e| e.get("param"))
        .cloned()
        .unwrap_or(Value::Null);
    let refusal = LegError::Status {
        status: status.as_u16(),
        message,
        param,
    };
    // A client fault whose error object has its words and a string `code` (OpenAI's
    // `context_length_exceeded`, ...) keeps them (the engine's status and
    // message): OpenAI's shape, the engine's message, param and code.
    let code = err
        .and_then(|e| e.get("code"))
        .filter(|c| c.is_string())
        .cloned();
    let fault = refusal.client_fault().map(|(status, ..)| status);
    match (refusal, fault, code) {
        (LegError::Status { message, param, .. }, Some(status), Some(code)) => LegError::Refused {
            status,
            error: Box::new(ErrorDetail {
                message,
                kind: "invalid_request_error".into(),
                param: Some(param),
                code: Some(code),
                ..ErrorDetail::default()
            }),
        },
        (refusal, ..) => refusal,
    }
}

/// `null`, for a refusal without a `param`.
static NO_PARAM: Value = Value::Null;

/// How a leg failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum LegError {
    /// Connect error, reset, or protocol error before an answer (also a bad engine URL, and
    /// the SGLang prefill leg's task ending without its result): where and what, typed.
    Connect(ConnectFailure),
    /// The router could not open a connection to the engine for lack of its own resources
    /// (descriptors or memory, [`local_exhaustion`]): not the engine's failure, so no breaker
    /// evidence and no retry (another engine needs a descriptor too); the client gets 503
    /// with `Retry-After`, counted `failed/local_pool`. The failure's kind is
    /// [`causes::TransportKind::Local`], naming the resource.
    Local(ConnectFailure),
    /// A leg-level timeout: the leg's elapsed limit (a prefill's, a whole leg's) passed.
    Timeout(LegLimit),
    /// No first token within `engine.first_token_timeout_s`.
    FirstTokenTimeout,
    /// Silence between chunks over `engine.decode_read_timeout_s`.
    ReadTimeout,
    /// The answer's body (a whole answer, or a decode stream) was cut mid-way.
    Cut(CutFailure),
    /// The engine answered with an error status.
    Status {
        /// HTTP status.
        status: u16,
        /// The engine's message.
        message: String,
        /// The engine's `param` (or null).
        param: Value,
    },
    /// The engine refused the request as the client's fault (a 4xx other than 408/429, or a
    /// 500 naming the context length) and named the error with a string `code`: the client
    /// gets OpenAI's error shape with the engine's message, `param` and `code`.
    Refused {
        /// HTTP status (a context-length 500 is 400).
        status: u16,
        /// `{"message", "type": "invalid_request_error", "param", "code"}`, the engine's words.
        error: Box<ErrorDetail>,
    },
    /// A 200 prefill without a usable KV descriptor / rendezvous: which, and why.
    KvHandoff(KvHandoffFailure),
    /// A 200 prefill whose choices end with `finish_reason: "abort"` and carry no descriptor:
    /// the engine gave the request up (vLLM's `RequestStatus.FINISHED_ABORTED`: preempted,
    /// out of KV cache, shutting down or paused in abort mode; vLLM's `_raise_if_error`
    /// raises only for `"error"`, so the answer is a 200). Nothing was output: retried on
    /// another prefill engine, charged as `kv_handoff`, counted `engine_aborted`.
    Aborted(EngineAbort),
    /// The engine sent nothing on this leg while its peers of the same role answered, and a
    /// direct generation probe of its own got no token either ([`crate::stall`]): the router
    /// ejected it (cause `stalled`) and gave up its waiting legs, which are retried elsewhere.
    Stalled,
    /// A non-JSON or malformed answer: what is wrong with it.
    InvalidResponse(InvalidAnswer),
    /// A relay-level stream failure.
    Stream(StreamFailure),
}

impl From<ConnectFailure> for LegError {
    /// [`LegError::Local`] for the router's own exhaustion, else [`LegError::Connect`].
    fn from(c: ConnectFailure) -> LegError {
        if c.is_local() {
            LegError::Local(c)
        } else {
            LegError::Connect(c)
        }
    }
}

impl LegError {
    /// The engine status if it's a client fault (4xx other than 408/429 and the engine's own
    /// refusals 401/403/404/405 ([`engine_config`]), or a 500 that says the prompt is too long):
    /// relay it as 400-class `invalid_request_error` with the engine's message, no retry, no
    /// breaker. An in-stream error before any output (llama.cpp reports
    /// an over-long streamed prompt inside its stream) is judged the same way.
    pub(crate) fn client_fault(&self) -> Option<(u16, &str, &Value)> {
        let (status, message, param) = match self {
            LegError::Status {
                status,
                message,
                param,
            } => (*status, message.as_str(), param),
            LegError::Stream(StreamFailure::UpstreamError { status, message }) => {
                (*status, message.as_str(), &NO_PARAM)
            }
            LegError::Refused { status, error } => (
                *status,
                error.message.as_str(),
                error.param.as_ref().unwrap_or(&NO_PARAM),
            ),
            _ => return None,
        };
        if (400..500).contains(&status) && status != 408 && status != 429 && !engine_config(status)
        {
            Some((status, message, param))
        } else if status == 500 && mentions_context_length(message) {
            Some((400, message, param))
        } else {
            None
        }
    }

    /// Whether the engine answered the leg (an error status, a bad or cut answer, an abort):
    /// it is not silent, whatever the answer was (the stall watch, behaviour.md 6.9).
    pub(crate) fn engine_answered(&self) -> bool {
        matches!(
            self,
            LegError::Status { .. }
                | LegError::Refused { .. }
                | LegError::KvHandoff(_)
                | LegError::Aborted(_)
                | LegError::InvalidResponse(_)
                | LegError::Cut(_)
                | LegError::Stream(_)
        )
    }

    /// Breaker class (behaviour.md 6.2); `None` for client faults.
    pub(crate) fn class(&self, phase: Phase) -> Option<FailureClass> {
        if self.client_fault().is_some() {
            return None;
        }
        Some(match self {
            LegError::Local(_) => return None,
            LegError::Connect(_) => FailureClass::Connection,
            LegError::Timeout(_) => FailureClass::Timeout,
            LegError::FirstTokenTimeout | LegError::ReadTimeout | LegError::Cut(_) => {
                FailureClass::Stream
            }
            // 408/429/503: the engine says it is busy (overload), not failed.
            LegError::Status {
                status: 408 | 429 | 503,
                ..
            }
            | LegError::Stream(StreamFailure::UpstreamError {
                status: 408 | 429 | 503,
                ..
            }) => FailureClass::Overload,
            LegError::Status { status, .. }
            | LegError::Stream(StreamFailure::UpstreamError { status, .. })
                if engine_config(*status) =>
            {
                FailureClass::EngineConfig
            }
            LegError::Status { .. } | LegError::Refused { .. } => FailureClass::InferenceStatus,
            LegError::KvHandoff(_) | LegError::Aborted(_) => FailureClass::KvHandoff,
            LegError::Stalled => FailureClass::Stream,
            LegError::InvalidResponse(_) => FailureClass::InferenceStatus,
            LegError::Stream(StreamFailure::UpstreamError { .. }) => FailureClass::InferenceStatus,
            LegError::Stream(_) => {
                if phase == Phase::Prefill {
                    FailureClass::InferenceStatus
                } else {
                    FailureClass::Stream
                }
            }
        })
    }

    /// Failed-reason label (behaviour.md 7.7a).
    pub(crate) fn reason(&self) -> &'static str {
        if self.client_fault().is_some() {
            return "engine_rejected";
        }
        match self {
            LegError::Local(_) => "local_pool",
            LegError::Connect(_) | LegError::Cut(_) => "engine_connection",
            LegError::Timeout(_)
            | LegError::FirstTokenTimeout
            | LegError::ReadTimeout
            | LegError::Stalled => "engine_timeout",
            LegError::Aborted(_) => "engine_aborted",
            LegError::Status {
                status: 408 | 429 | 503,
                ..
            } => "engine_overloaded",
            LegError::Status { status, .. }
            | LegError::Stream(StreamFailure::UpstreamError { status, .. })
                if engine_config(*status) =>
            {
                "engine_config"
            }
            LegError::Status { .. } | LegError::Refused { .. } | LegError::KvHandoff(_) => {
                "engine_error"
            }
            LegError::Stream(StreamFailure::UpstreamError { .. }) => "engine_error",
            LegError::Stream(StreamFailure::ResponseLimit) => "response_limit",
            LegError::InvalidResponse(_) | LegError::Stream(_) => "invalid_response",
        }
    }

    /// Retry-eligible before output (behaviour.md 7.5): statuses 401/403/404/405 (the engine
    /// refused the router, [`engine_config`]), 408/429/500/502/503/504, network, timeout or
    /// protocol errors, an engine's abort and a stalled engine. KV descriptor failures are not
    /// retried.
    pub(crate) fn transient(&self) -> bool {
        if self.client_fault().is_some() {
            return false;
        }
        match self {
            LegError::Connect(_)
            | LegError::Timeout(_)
            | LegError::FirstTokenTimeout
            | LegError::ReadTimeout
            | LegError::Cut(_)
            | LegError::Aborted(_)
            | LegError::Stalled => true,
            LegError::Status { status, .. } | LegError::Refused { status, .. } => {
                matches!(status, 408 | 429 | 500 | 502 | 503 | 504) || engine_config(*status)
            }
            LegError::Stream(StreamFailure::UpstreamError { status, .. }) => {
                matches!(status, 408 | 429 | 500 | 502 | 503 | 504) || engine_config(*status)
            }
            LegError::Stream(StreamFailure::EndedWithoutDone | StreamFailure::DoneBeforeToken) => {
                true
            }
            LegError::Local(_)
            | LegError::KvHandoff(_)
            | LegError::InvalidResponse(_)
            | LegError::Stream(_) => false,
        }
    }

    /// HTTP status for the client before output (502, 504 for timeouts, 503 when the router
    /// is out of connection resources).
    pub(crate) fn http_status(&self) -> u16 {
        match self {
            LegError::Timeout(_)
            | LegError::FirstTokenTimeout
            | LegError::ReadTimeout
            | LegError::Stalled => 504,
            LegError::Local(_) => 503,
            _ => 502,
        }
    }

    /// The engine's own error object, when it refused the request as the client's fault and
    /// said why ([`LegError::Refused`]): the client gets it as it is.
    pub(crate) fn engine_error(&self) -> Option<&ErrorDetail> {
        match self {
            LegError::Refused { error, .. } => Some(error.as_ref()),
            _ => None,
        }
    }

    /// Public message (behaviour.md 1.9); details go to the journal only.
    pub(crate) fn public_message(&self) -> &'static str {
        match self {
            LegError::Stream(StreamFailure::ResponseLimit) => {
                "Response exceeds the configured limit"
            }
            LegError::Local(_) => "Router is out of connection resources; retry later",
            _ => "Upstream request failed",
        }
    }

    /// Detail for logs and the journal.
    pub(crate) fn detail(&self) -> String {
        match self {
            LegError::Connect(c) | LegError::Local(c) => c.to_string(),
            LegError::Cut(c) => c.to_string(),
            LegError::KvHandoff(k) => k.to_string(),
            LegError::Aborted(a) => a.to_string(),
            LegError::InvalidResponse(i) => i.to_string(),
            LegError::Stalled => {
                "engine stalled: nothing sent while its peers answered, and its own generation probe got no token".into()
            }
            LegError::Timeout(l) => l.to_string(),
            LegError::FirstTokenTimeout => {
                "no first token within engine.first_token_timeout_s".into()
            }
            LegError::ReadTimeout => {
                "decode stream silent beyond engine.decode_read_timeout_s".into()
            }
            LegError::Status {
                status, message, ..
            } => format!("engine answered {status}: {message}"),
            LegError::Refused { status, error } => {
                format!("engine answered {status}: {}", error.message)
            }
            LegError::Stream(f) => f.detail(),
        }
    }
}

/// An engine status that refuses the router rather than the request (behaviour.md 6.2): 401
/// and 403 (the engine wants another key: vLLM started with `--api-key` answers 401
/// `{"error": "Unauthorized"}` on every `/v1` route without the right bearer token), 404 (the
/// router was told this engine serves the model and has the route; ingress already refused a
/// model the fleet does not serve) and 405 (the route exists with another method: another
/// engine kind or version than declared). The engine's fault: retried elsewhere, charged as
/// [`FailureClass::EngineConfig`], never relayed to the client as its own.
pub(crate) fn engine_config(status: u16) -> bool {
    matches!(status, 401 | 403 | 404 | 405)
}

fn mentions_context_length(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    m.contains("too long")
        || m.contains("context length")
        || m.contains("maximum context")
        || m.contains("context window")
        || (m.contains("exceeds") && m.contains("length"))
}

mod causes;
mod live;
#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) use causes::TransportKind;
pub(crate) use causes::{
    BodyFailure, BootstrapError, CallFailure, ConnectFailure, ConnectStage, CutDuring, CutFailure,
    EngineAbort, EngineCall, EngineCallError, InvalidAnswer, KvHandoffFailure, LegLimit,
    LocalResource, NoDescriptor,
};
pub(crate) use live::LiveStream;
