//! Router → engine HTTP: pooled hyper client, the prefill and decode legs, and how a failed leg
//! is classified (reference-notes 6.2, 7.1–7.3).
//!
//! ```text
//!  leg body ──POST <engine><path>──► engine
//!     prefill: JSON answer ──► KV descriptor (vLLM) / () (SGLang)      or LegError
//!     decode:  SSE ──► LiveStream (held until the first token)          or LegError
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
use serde_json::{Map, Value};

use crate::breaker::FailureClass;
use crate::config::{Config, secs};
use crate::placement::Phase;
use crate::relay::{RelayOptions, RelayStep, SseData, SseParser, StreamFailure, StreamState};

/// Error answers read from an engine are capped at this many bytes.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Pooled HTTP/1 client for engines.
#[derive(Clone)]
pub(crate) struct Upstream {
    client: Client<HttpConnector, Full<Bytes>>,
    api_key: Option<String>,
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
        }
    }

    async fn post(
        &self,
        url: &str,
        rid_header: &str,
        body: &Value,
    ) -> Result<hyper::Response<Incoming>, LegError> {
        let mut b = Request::builder()
            .method(Method::POST)
            .uri(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("x-request-id", rid_header);
        if let Some(k) = &self.api_key {
            b = b.header(http::header::AUTHORIZATION, format!("Bearer {k}"));
        }
        let req = b
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| LegError::Connect(format!("bad engine URL {url}: {e}")))?;
        self.client.request(req).await.map_err(|e| {
            if e.is_connect() {
                LegError::Connect(format!("connect {url}: {}", error_chain(&e)))
            } else {
                LegError::Connect(format!("request {url}: {}", error_chain(&e)))
            }
        })
    }

    /// GET `url`, returning status and (bounded) body. Used for `/health` and `/server_info`.
    pub(crate) async fn get(
        &self,
        url: &str,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), String> {
        let req = Request::builder()
            .method(Method::GET)
            .uri(url)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| error_chain(&e))?;
            let status = resp.status();
            let body = read_bounded(resp.into_body(), ERROR_BODY_LIMIT)
                .await
                .map_err(|e| e.to_string())?;
            Ok((status, body))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| format!("timed out after {:.3}s", timeout.as_secs_f64()))?
    }

    /// POST `body` as JSON to `url`, returning status and (bounded) body. Used for control
    /// calls: `/tokenize`, SGLang's `/pd_role_switch`.
    pub(crate) async fn post_json(
        &self,
        url: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), String> {
        let fut = async {
            let resp = self
                .post(url, "narwhal-control", body)
                .await
                .map_err(|e| e.detail())?;
            let status = resp.status();
            let body = read_bounded(resp.into_body(), ERROR_BODY_LIMIT)
                .await
                .map_err(|e| e.to_string())?;
            Ok((status, body))
        };
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| format!("timed out after {:.3}s", timeout.as_secs_f64()))?
    }

    /// vLLM prefill leg: POST and extract the KV descriptor (reference-notes 7.1 steps 2–3).
    pub(crate) async fn vllm_prefill(
        &self,
        url: &str,
        rid_header: &str,
        body: &Value,
        limit: Instant,
    ) -> Result<Value, LegError> {
        let answer = self.json_leg(url, rid_header, body, limit).await?;
        extract_descriptor(&answer).map_err(LegError::KvHandoff)
    }

    /// SGLang prefill leg: POST and wait for a 200 (reference-notes 7.2 step 3).
    pub(crate) async fn sglang_prefill(
        &self,
        url: &str,
        body: &Value,
        limit: Instant,
    ) -> Result<(), LegError> {
        let rid = body
            .get("rid")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        self.json_leg(url, &rid, body, limit).await.map(|_| ())
    }

    async fn json_leg(
        &self,
        url: &str,
        rid_header: &str,
        body: &Value,
        limit: Instant,
    ) -> Result<Value, LegError> {
        let fut = async {
            let resp = self.post(url, rid_header, body).await?;
            let status = resp.status();
            let bytes = read_bounded(resp.into_body(), 16 * 1024 * 1024)
                .await
                .map_err(|e| LegError::Connect(format!("reading prefill answer: {e}")))?;
            if status != StatusCode::OK {
                return Err(status_error(status, &bytes));
            }
            serde_json::from_slice::<Value>(&bytes)
                .map_err(|e| LegError::InvalidResponse(format!("prefill answer is not JSON: {e}")))
        };
        match tokio::time::timeout_at(limit.into(), fut).await {
            Ok(r) => r,
            Err(_) => Err(LegError::Timeout(
                "prefill leg exceeded serving.prefill_timeout_s",
            )),
        }
    }

    /// Decode leg: POST and hold the stream until the first token or `first_token_by`.
    pub(crate) async fn decode(
        &self,
        url: &str,
        rid_header: &str,
        body: &Value,
        opts: RelayOptions,
        first_token_by: Instant,
    ) -> Result<LiveStream, LegError> {
        let fut = async {
            let resp = self.post(url, rid_header, body).await?;
            let status = resp.status();
            if status != StatusCode::OK {
                let bytes = read_bounded(resp.into_body(), ERROR_BODY_LIMIT)
                    .await
                    .unwrap_or_default();
                return Err(status_error(status, &bytes));
            }
            let mut live = LiveStream {
                body: resp.into_body(),
                parser: SseParser::new(),
                state: StreamState::new(opts),
                queue: std::collections::VecDeque::new(),
                first: Vec::new(),
                ended: false,
            };
            match live.next(None).await? {
                RelayStep::Output(chunks) => {
                    live.first = chunks;
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

async fn read_bounded(mut body: Incoming, limit: usize) -> Result<Bytes, String> {
    let mut buf = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| error_chain(&e))?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(format!("answer exceeds {limit} bytes"));
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(buf))
}

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
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned());
    let param = err
        .and_then(|e| e.get("param"))
        .cloned()
        .unwrap_or(Value::Null);
    LegError::Status {
        status: status.as_u16(),
        message,
        param,
    }
}

/// Validate and return the vLLM descriptor verbatim (reference-notes 7.1 step 3):
/// `choices[0].kv_transfer_params`, else top-level `kv_transfer_params`; a non-empty object with
/// a non-empty string `remote_engine_id` and `remote_block_ids` a list of non-negative ints or a
/// list of such lists.
pub(crate) fn extract_descriptor(answer: &Value) -> Result<Value, String> {
    let d = answer
        .pointer("/choices/0/kv_transfer_params")
        .filter(|v| !v.is_null())
        .or_else(|| answer.get("kv_transfer_params").filter(|v| !v.is_null()))
        .ok_or_else(|| {
            "no handoff: the prefill answer carries no kv_transfer_params".to_string()
        })?;
    let obj = d
        .as_object()
        .filter(|o| !o.is_empty())
        .ok_or_else(|| "no handoff: kv_transfer_params is not a non-empty object".to_string())?;
    match obj.get("remote_engine_id") {
        Some(Value::String(s)) if !s.is_empty() => {}
        _ => return Err("no handoff: remote_engine_id must be a non-empty string".into()),
    }
    let ok_ids = |a: &Vec<Value>| a.iter().all(Value::is_u64);
    let blocks_ok = match obj.get("remote_block_ids") {
        Some(Value::Array(a)) => ok_ids(a) || a.iter().all(|x| x.as_array().is_some_and(ok_ids)),
        _ => false,
    };
    if !blocks_ok {
        return Err("no handoff: remote_block_ids must be a list of non-negative integers or a list of such lists".into());
    }
    Ok(d.clone())
}

/// A decode stream that has produced its first token. Dropping it closes the upstream.
pub(crate) struct LiveStream {
    body: Incoming,
    parser: SseParser,
    state: StreamState,
    queue: std::collections::VecDeque<SseData>,
    /// Chunks to send first (held chunks + the first token chunk).
    pub(crate) first: Vec<Value>,
    ended: bool,
}

impl LiveStream {
    /// Tokens counted so far.
    pub(crate) fn tokens(&self) -> u64 {
        self.state.tokens()
    }

    /// Engine-reported prompt tokens.
    pub(crate) fn prompt_tokens(&self) -> Option<u64> {
        self.state.prompt_tokens()
    }

    /// Read until the relay has something to say (`Output`, `Done` or `Failed`); `gap` bounds
    /// the wait for each upstream read (`engine.decode_read_timeout_s`).
    pub(crate) async fn next(&mut self, gap: Option<Duration>) -> Result<RelayStep, LegError> {
        loop {
            while let Some(ev) = self.queue.pop_front() {
                match self.state.on_data(&ev.0) {
                    RelayStep::Hold => continue,
                    step => return Ok(step),
                }
            }
            if self.ended {
                return Ok(self.state.on_end());
            }
            let frame = match gap {
                Some(g) => match tokio::time::timeout(g, self.body.frame()).await {
                    Ok(f) => f,
                    Err(_) => return Err(LegError::ReadTimeout),
                },
                None => self.body.frame().await,
            };
            match frame {
                None => {
                    self.parser.finish();
                    self.ended = true;
                }
                Some(Err(e)) => {
                    return Err(LegError::Cut(error_chain(&e)));
                }
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.queue.extend(self.parser.push(&data));
                        if self.parser.overflowed() {
                            return Ok(RelayStep::Failed(StreamFailure::ResponseLimit));
                        }
                    }
                }
            }
        }
    }
}

/// How a leg failed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum LegError {
    /// Connect error, reset, or protocol error before an answer.
    Connect(String),
    /// A leg-level timeout (prefill elapsed limit).
    Timeout(&'static str),
    /// No first token within `engine.first_token_timeout_s`.
    FirstTokenTimeout,
    /// Silence between chunks over `engine.decode_read_timeout_s`.
    ReadTimeout,
    /// The stream was cut mid-body.
    Cut(String),
    /// The engine answered with an error status.
    Status {
        /// HTTP status.
        status: u16,
        /// The engine's message.
        message: String,
        /// The engine's `param` (or null).
        param: Value,
    },
    /// A 200 prefill without a usable KV descriptor / rendezvous.
    KvHandoff(String),
    /// A non-JSON or malformed answer.
    InvalidResponse(String),
    /// A relay-level stream failure.
    Stream(StreamFailure),
}

impl LegError {
    /// The engine status if it's a client fault (4xx other than 408/429, or a 500 that says the
    /// prompt is too long): relay it as 400-class `invalid_request_error`, no retry, no breaker.
    pub(crate) fn client_fault(&self) -> Option<(u16, &str, &Value)> {
        match self {
            LegError::Status {
                status,
                message,
                param,
            } => {
                if (400..500).contains(status) && *status != 408 && *status != 429 {
                    Some((*status, message, param))
                } else if *status == 500 && mentions_context_length(message) {
                    Some((400, message, param))
                } else {
                    None
                }
            }
            _ => None,
        }
    }

    /// Breaker class (reference-notes 6.2); `None` for client faults.
    pub(crate) fn class(&self, phase: Phase) -> Option<FailureClass> {
        if self.client_fault().is_some() {
            return None;
        }
        Some(match self {
            LegError::Connect(_) => FailureClass::Connection,
            LegError::Timeout(_) => FailureClass::Timeout,
            LegError::FirstTokenTimeout | LegError::ReadTimeout | LegError::Cut(_) => {
                FailureClass::Stream
            }
            LegError::Status {
                status: 408 | 429, ..
            } => FailureClass::Overload,
            LegError::Status { .. } => FailureClass::InferenceStatus,
            LegError::KvHandoff(_) => FailureClass::KvHandoff,
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

    /// Failed-reason label (reference-notes 7.7a).
    pub(crate) fn reason(&self) -> &'static str {
        if self.client_fault().is_some() {
            return "engine_rejected";
        }
        match self {
            LegError::Connect(_) | LegError::Cut(_) => "engine_connection",
            LegError::Timeout(_) | LegError::FirstTokenTimeout | LegError::ReadTimeout => {
                "engine_timeout"
            }
            LegError::Status {
                status: 408 | 429, ..
            } => "engine_overloaded",
            LegError::Status { .. } | LegError::KvHandoff(_) => "engine_error",
            LegError::Stream(StreamFailure::UpstreamError { .. }) => "engine_error",
            LegError::Stream(StreamFailure::ResponseLimit) => "response_limit",
            LegError::InvalidResponse(_) | LegError::Stream(_) => "invalid_response",
        }
    }

    /// Retry-eligible before output (reference-notes 7.5): statuses 408/429/500/502/503/504,
    /// network, timeout or protocol errors. KV descriptor failures are not retried.
    pub(crate) fn transient(&self) -> bool {
        if self.client_fault().is_some() {
            return false;
        }
        match self {
            LegError::Connect(_)
            | LegError::Timeout(_)
            | LegError::FirstTokenTimeout
            | LegError::ReadTimeout
            | LegError::Cut(_) => true,
            LegError::Status { status, .. } => matches!(status, 408 | 429 | 500 | 502 | 503 | 504),
            LegError::Stream(StreamFailure::UpstreamError { status, .. }) => {
                matches!(status, 408 | 429 | 500 | 502 | 503 | 504)
            }
            LegError::Stream(StreamFailure::EndedWithoutDone | StreamFailure::DoneBeforeToken) => {
                true
            }
            LegError::KvHandoff(_) | LegError::InvalidResponse(_) | LegError::Stream(_) => false,
        }
    }

    /// HTTP status for the client before output (502, or 504 for timeouts).
    pub(crate) fn http_status(&self) -> u16 {
        match self {
            LegError::Timeout(_) | LegError::FirstTokenTimeout | LegError::ReadTimeout => 504,
            _ => 502,
        }
    }

    /// Public message (reference-notes 1.9); details go to the journal only.
    pub(crate) fn public_message(&self) -> &'static str {
        match self {
            LegError::Stream(StreamFailure::ResponseLimit) => {
                "Response exceeds the configured limit"
            }
            _ => "Upstream request failed",
        }
    }

    /// Detail for logs and the journal.
    pub(crate) fn detail(&self) -> String {
        match self {
            LegError::Connect(s)
            | LegError::Cut(s)
            | LegError::KvHandoff(s)
            | LegError::InvalidResponse(s) => s.clone(),
            LegError::Timeout(s) => (*s).to_string(),
            LegError::FirstTokenTimeout => {
                "no first token within engine.first_token_timeout_s".into()
            }
            LegError::ReadTimeout => {
                "decode stream silent beyond engine.decode_read_timeout_s".into()
            }
            LegError::Status {
                status, message, ..
            } => format!("engine answered {status}: {message}"),
            LegError::Stream(f) => f.detail(),
        }
    }
}

fn mentions_context_length(msg: &str) -> bool {
    let m = msg.to_ascii_lowercase();
    m.contains("too long")
        || m.contains("context length")
        || m.contains("maximum context")
        || m.contains("context window")
        || (m.contains("exceeds") && m.contains("length"))
}

/// Body of a vLLM prefill leg (reference-notes 7.1 step 2).
pub(crate) fn vllm_prefill_body(client: &Map<String, Value>) -> Value {
    let mut b = client.clone();
    for k in [
        "stream_options",
        "min_tokens",
        "n",
        "best_of",
        "max_completion_tokens",
        "kv_transfer_params",
    ] {
        b.remove(k);
    }
    b.insert("max_tokens".into(), 1.into());
    b.insert("stream".into(), false.into());
    b.insert(
        "kv_transfer_params".into(),
        serde_json::json!({"do_remote_decode": true}),
    );
    Value::Object(b)
}

/// Body of a decode leg (vLLM or aggregated): streaming with usage and token ids, plus the
/// descriptor when given (reference-notes 7.1 step 6).
pub(crate) fn decode_body(
    client: &Map<String, Value>,
    descriptor: Option<&Value>,
    token_ids: bool,
) -> Value {
    let mut b = client.clone();
    b.remove("kv_transfer_params");
    b.insert("stream".into(), true.into());
    if token_ids {
        b.insert("return_token_ids".into(), true.into());
    }
    let mut so = b
        .get("stream_options")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    so.insert("include_usage".into(), true.into());
    b.insert("stream_options".into(), Value::Object(so));
    if let Some(d) = descriptor {
        b.insert("kv_transfer_params".into(), d.clone());
    }
    Value::Object(b)
}

/// SGLang rendezvous fields.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rendezvous {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) room: u64,
}

/// Bodies of the two SGLang legs (reference-notes 7.2 steps 3–4).
pub(crate) fn sglang_bodies(
    client: &Map<String, Value>,
    rv: &Rendezvous,
    rid_base: &str,
    chat: bool,
) -> (Value, Value) {
    let mut p = client.clone();
    for k in [
        "stream_options",
        "min_tokens",
        "n",
        "best_of",
        "max_completion_tokens",
    ] {
        p.remove(k);
    }
    p.insert("max_tokens".into(), 1.into());
    p.insert("stream".into(), false.into());
    let rdv = |m: &mut Map<String, Value>, suffix: &str| {
        m.insert("bootstrap_host".into(), rv.host.clone().into());
        m.insert("bootstrap_port".into(), rv.port.into());
        m.insert("bootstrap_room".into(), rv.room.into());
        m.insert("rid".into(), format!("{rid_base}-{suffix}").into());
    };
    rdv(&mut p, "prefill");
    let mut d = client.clone();
    if let Some(mct) = d.remove("max_completion_tokens")
        && !d.contains_key("max_tokens")
    {
        d.insert("max_tokens".into(), mct);
    }
    let Value::Object(mut d) = decode_body(&d, None, !chat) else {
        unreachable!("decode_body returns an object")
    };
    rdv(&mut d, "decode");
    (Value::Object(p), Value::Object(d))
}

/// Bootstrap host = host of the prefill engine's URL.
pub(crate) fn url_host(url: &str) -> Option<String> {
    url.parse::<http::Uri>()
        .ok()?
        .host()
        .map(|h| h.trim_matches(['[', ']']).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn descriptor_is_validated_and_carried_verbatim() {
        let d = json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "e", "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 5, "remote_request_id": "r", "tp_size": 1});
        assert_eq!(
            extract_descriptor(&json!({"kv_transfer_params": d})).unwrap(),
            d
        );
        assert_eq!(
            extract_descriptor(&json!({"choices": [{"kv_transfer_params": d}]})).unwrap(),
            d
        );
        let hybrid = json!({"remote_engine_id": "e", "remote_block_ids": [[1], [2, 3]]});
        assert!(extract_descriptor(&json!({"kv_transfer_params": hybrid})).is_ok());
        for bad in [
            json!({}),
            json!({"kv_transfer_params": {}}),
            json!({"kv_transfer_params": {"remote_engine_id": "", "remote_block_ids": [1]}}),
            json!({"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [-1]}}),
            json!({"kv_transfer_params": {"remote_engine_id": "e"}}),
        ] {
            assert!(extract_descriptor(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn leg_bodies() {
        let client: Map<String, Value> = serde_json::from_value(json!({
            "model": "m", "prompt": "p", "stream": true, "n": 1, "min_tokens": 2,
            "max_completion_tokens": 9, "stream_options": {"include_usage": false}
        }))
        .unwrap();
        let p = vllm_prefill_body(&client);
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert_eq!(p["kv_transfer_params"], json!({"do_remote_decode": true}));
        for k in [
            "stream_options",
            "min_tokens",
            "n",
            "best_of",
            "max_completion_tokens",
        ] {
            assert!(p.get(k).is_none(), "{k}");
        }
        let d = decode_body(&client, Some(&json!({"remote_engine_id": "e"})), true);
        assert_eq!(d["stream"], true);
        assert_eq!(d["return_token_ids"], true);
        assert_eq!(d["stream_options"]["include_usage"], true);
        assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "e");
        let rv = Rendezvous {
            host: "10.0.0.1".into(),
            port: 8998,
            room: 42,
        };
        let (p, d) = sglang_bodies(&client, &rv, "rid-a1", false);
        assert_eq!(p["rid"], "rid-a1-prefill");
        assert_eq!(d["rid"], "rid-a1-decode");
        assert_eq!(p["bootstrap_room"], 42);
        assert_eq!(d["bootstrap_port"], 8998);
        assert_eq!(d["max_tokens"], 9);
        assert_eq!(d["return_token_ids"], true);
        let (_, d) = sglang_bodies(&client, &rv, "rid-a1", true);
        assert!(d.get("return_token_ids").is_none());
    }

    #[test]
    fn classification() {
        let ctx = LegError::Status {
            status: 500,
            message: "prompt is too long for the model's context length".into(),
            param: Value::Null,
        };
        assert_eq!(ctx.client_fault().map(|c| c.0), Some(400));
        assert!(!ctx.transient());
        assert_eq!(ctx.class(Phase::Prefill), None);
        let b = LegError::Status {
            status: 400,
            message: "bad".into(),
            param: Value::Null,
        };
        assert_eq!(b.reason(), "engine_rejected");
        let s = LegError::Status {
            status: 503,
            message: "busy".into(),
            param: Value::Null,
        };
        assert!(s.transient());
        assert_eq!(s.class(Phase::Decode), Some(FailureClass::InferenceStatus));
        let o = LegError::Status {
            status: 429,
            message: "slow".into(),
            param: Value::Null,
        };
        assert_eq!(o.class(Phase::Decode), Some(FailureClass::Overload));
        assert!(!LegError::KvHandoff("x".into()).transient());
        assert_eq!(
            LegError::KvHandoff("x".into()).class(Phase::Prefill),
            Some(FailureClass::KvHandoff)
        );
        assert_eq!(
            LegError::Connect("x".into()).class(Phase::Prefill),
            Some(FailureClass::Connection)
        );
        assert_eq!(LegError::FirstTokenTimeout.http_status(), 504);
        assert_eq!(url_host("http://127.0.0.1:8000"), Some("127.0.0.1".into()));
    }
}
