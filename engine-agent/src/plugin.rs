//! Engine plugins: what depends on the engine kind (architecture.md section 1, "Engine plugins").
//!
//! ```text
//!             ┌────────────── EnginePlugin (one trait) ──────────────┐
//!  sidecar ──►│ facts()     version + served models (+ bootstrap port)│──► loopback HTTP
//!  (generic)  │ generate()  one non-streaming completion              │    to the engine
//!             │ produce()   prefill leg → KV descriptor / rendezvous  │
//!             │ consume()   decode leg with a descriptor / rendezvous │
//!             │ transfer_counters()  KV-transfer counters (/metrics)  │
//!             └─────── VllmPlugin (NIXL descriptors) | SglangPlugin (bootstrap rendezvous)
//! ```
//!
//! Plugins are plain values (no sockets of their own) so tests and the dev fleet can embed
//! them; [`plugin_for`] picks one by [`Dialect`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use narwhal_shared::check_request::CheckCompletion;
use narwhal_shared::{Clock, EngineFacts, LegResult};
use serde_json::Value;

use crate::engine_key::EngineKey;
use crate::evidence::{TransferCounters, TransferMetrics};

mod sglang;
mod sse;
mod vllm;

pub use sglang::SglangPlugin;
pub use vllm::VllmPlugin;

/// A boxed future, so the trait stays object-safe.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Engine kind (agent config `engines[].dialect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// vLLM with the NIXL connector (descriptor handoff, behaviour.md 7.1).
    Vllm,
    /// SGLang with Mooncake (bootstrap rendezvous, behaviour.md 7.2).
    Sglang,
}

impl Dialect {
    /// `vllm` or `sglang`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Vllm => "vllm",
            Dialect::Sglang => "sglang",
        }
    }
}

/// An error talking to the engine.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// Transport failure or timeout.
    #[error("{path}: transport: {reason}")]
    Transport {
        /// Engine path.
        path: String,
        /// reqwest's message.
        reason: String,
    },
    /// Non-2xx status (a 401 or 403 says which agent config keys give the engine's key).
    #[error("{path}: HTTP {status}: {body}{hint}", hint = auth_hint(*status))]
    Status {
        /// Engine path.
        path: String,
        /// Status.
        status: u16,
        /// First 200 characters of the body.
        body: String,
    },
    /// The answer lacked a field or had the wrong type.
    #[error("{path}: {reason}")]
    Shape {
        /// Engine path.
        path: String,
        /// What was missing or wrong.
        reason: String,
    },
}

/// What an engine's 401 / 403 asks of the operator: the engine guards its API (vLLM
/// `--api-key`), so the agent needs the same key.
fn auth_hint(status: u16) -> &'static str {
    match status {
        401 | 403 => {
            " (the engine requires an API key: give the agent the engine's key with \
             engines[].api_key_file or engines[].api_key_env, docs/agent.md)"
        }
        _ => "",
    }
}

/// Everything a plugin needs to reach one engine.
#[derive(Clone)]
pub struct EngineCtx {
    /// Plain-HTTP client for loopback engine calls (shared, pooled).
    pub http: reqwest::Client,
    /// Engine base URL, no trailing slash.
    pub base: String,
    /// Limit for reads (version, models, metrics).
    pub read_timeout: Duration,
    /// Limit for one generation or KV leg.
    pub leg_timeout: Duration,
    /// Host the peer engine uses for this engine's SGLang bootstrap server.
    pub bootstrap_host: String,
    /// Clock for latencies.
    pub clock: Arc<dyn Clock>,
    /// The engine's API key (agent config `engines[].api_key_file` / `api_key_env`), sent as
    /// `Authorization: Bearer <key>` on every call: vLLM with `--api-key` answers 401 on
    /// `/v1/*` without it (its `AuthenticationMiddleware`) and ignores it elsewhere.
    pub api_key: Option<EngineKey>,
}

impl EngineCtx {
    /// `builder` with the engine's bearer token, when it has a key.
    fn authorize(&self, builder: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let value = self
            .api_key
            .as_ref()
            .and_then(|key| reqwest::header::HeaderValue::from_str(&key.bearer()).ok());
        match value {
            Some(mut value) => {
                // Kept out of any debug output of the request.
                value.set_sensitive(true);
                builder.header(reqwest::header::AUTHORIZATION, value)
            }
            None => builder,
        }
    }
}

impl std::fmt::Debug for EngineCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCtx")
            .field("base", &self.base)
            .finish()
    }
}

/// What is specific to one engine kind.
pub trait EnginePlugin: Send + Sync {
    /// The kind.
    fn dialect(&self) -> Dialect;

    /// Version, served models and (SGLang) bootstrap port, read from the engine now.
    fn facts<'a>(&'a self, ctx: &'a EngineCtx) -> BoxFuture<'a, Result<EngineFacts, EngineError>>;

    /// One non-streaming completion of at least one token with `model`
    /// (`POST /v1/completions`, `max_tokens: 1`, `temperature: 0`), bounded by `leg_timeout`.
    fn generate<'a>(&'a self, ctx: &'a EngineCtx, model: &'a str) -> BoxFuture<'a, LegResult> {
        Box::pin(async move {
            let started = ctx.clock.now();
            let body = CheckCompletion::new(model, "narwhal agent generation check", 1);
            let out = post_json(ctx, "/v1/completions", &body).await;
            let latency_s = ctx.clock.now().duration_since(started).as_secs_f64();
            match out {
                Ok(v) => {
                    let choices = v
                        .get("choices")
                        .and_then(Value::as_array)
                        .map_or(0, Vec::len);
                    let tokens = v
                        .pointer("/usage/completion_tokens")
                        .and_then(Value::as_u64)
                        .unwrap_or(choices as u64);
                    if choices == 0 || tokens == 0 {
                        LegResult {
                            ok: false,
                            tokens,
                            latency_s,
                            error: Some("completion returned no choices or no tokens".into()),
                        }
                    } else {
                        LegResult {
                            ok: true,
                            tokens,
                            latency_s,
                            error: None,
                        }
                    }
                }
                Err(e) => failed(latency_s, e.to_string()),
            }
        })
    }

    /// Producer half of a KV check: returns the leg and the handle the consumer needs.
    fn produce<'a>(
        &'a self,
        ctx: &'a EngineCtx,
        model: &'a str,
        check_id: &'a str,
    ) -> BoxFuture<'a, (LegResult, Option<Value>)>;

    /// Consumer half: a streamed decode using `kv` (`None`: a local decode without transfer),
    /// tagged with `request_id` (vLLM `x-request-id`, SGLang `rid`); `tokens` counts
    /// the generated tokens (the engine's streamed usage, else token-bearing SSE chunks).
    fn consume<'a>(
        &'a self,
        ctx: &'a EngineCtx,
        model: &'a str,
        check_id: &'a str,
        kv: Option<&'a Value>,
        request_id: &'a str,
    ) -> BoxFuture<'a, LegResult>;

    /// Whether a standalone probe runs a producer leg before the local decode: true for vLLM
    /// (prefill leg with `do_remote_decode`, then a local decode, as the reference's standalone
    /// probe), false for SGLang (a rendezvous needs a second server; the probe decodes
    /// locally, which needs a `null`-mode server, or use a named producer).
    fn standalone_prefill(&self) -> bool {
        true
    }

    /// The Prometheus families this engine kind publishes about KV transfers into it
    /// (crate::evidence, where each name's source is recorded).
    fn transfer_metrics(&self) -> TransferMetrics;

    /// The engine's KV-transfer counters now, from its own `GET /metrics`; `None` when the page
    /// cannot be read (a reading without the families is `Some` with `None` counters).
    fn transfer_counters<'a>(
        &'a self,
        ctx: &'a EngineCtx,
    ) -> BoxFuture<'a, Option<TransferCounters>> {
        Box::pin(async move {
            match get_text(ctx, "/metrics").await {
                Ok(page) => Some(TransferCounters::from_page(self.transfer_metrics(), &page)),
                Err(e) => {
                    tracing::debug!(error = %e, "engine metrics unreadable: no transfer counters");
                    None
                }
            }
        })
    }
}

/// The plugin for a dialect.
pub fn plugin_for(dialect: Dialect) -> Arc<dyn EnginePlugin> {
    match dialect {
        Dialect::Vllm => Arc::new(VllmPlugin),
        Dialect::Sglang => Arc::new(SglangPlugin),
    }
}

/// The prompt both halves of check `check_id` use (the consumer must see the same prompt).
pub(crate) fn check_prompt(check_id: &str) -> String {
    format!("narwhal agent kv transfer check {check_id}")
}

pub(crate) fn failed(latency_s: f64, error: String) -> LegResult {
    LegResult {
        ok: false,
        tokens: 0,
        latency_s,
        error: Some(error),
    }
}

fn transport(path: &str, e: reqwest::Error) -> EngineError {
    EngineError::Transport {
        path: path.to_string(),
        reason: if e.is_timeout() {
            "timed out".to_string()
        } else {
            e.to_string()
        },
    }
}

pub(crate) async fn get_json(ctx: &EngineCtx, path: &str) -> Result<Value, EngineError> {
    let resp = ctx
        .authorize(ctx.http.get(format!("{}{}", ctx.base, path)))
        .timeout(ctx.read_timeout)
        .send()
        .await
        .map_err(|e| transport(path, e))?;
    read_json(path, resp).await
}

/// `GET path` as text (a Prometheus page), bounded by `read_timeout`.
pub(crate) async fn get_text(ctx: &EngineCtx, path: &str) -> Result<String, EngineError> {
    let resp = ctx
        .authorize(ctx.http.get(format!("{}{}", ctx.base, path)))
        .timeout(ctx.read_timeout)
        .send()
        .await
        .map_err(|e| transport(path, e))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| transport(path, e))?;
    if !status.is_success() {
        return Err(EngineError::Status {
            path: path.to_string(),
            status: status.as_u16(),
            body: text.chars().take(200).collect(),
        });
    }
    Ok(text)
}

pub(crate) async fn post_json(
    ctx: &EngineCtx,
    path: &str,
    body: &impl serde::Serialize,
) -> Result<Value, EngineError> {
    let resp = ctx
        .authorize(ctx.http.post(format!("{}{}", ctx.base, path)))
        .timeout(ctx.leg_timeout)
        .json(body)
        .send()
        .await
        .map_err(|e| transport(path, e))?;
    read_json(path, resp).await
}

async fn read_json(path: &str, resp: reqwest::Response) -> Result<Value, EngineError> {
    let status = resp.status();
    let bytes = resp.bytes().await.map_err(|e| transport(path, e))?;
    if !status.is_success() {
        return Err(EngineError::Status {
            path: path.to_string(),
            status: status.as_u16(),
            body: String::from_utf8_lossy(&bytes).chars().take(200).collect(),
        });
    }
    serde_json::from_slice(&bytes).map_err(|e| EngineError::Shape {
        path: path.to_string(),
        reason: format!("not JSON: {e}"),
    })
}

/// `GET /v1/models` → `data[].id`.
pub(crate) async fn served_models(ctx: &EngineCtx) -> Result<Vec<String>, EngineError> {
    let v = get_json(ctx, "/v1/models").await?;
    let data = v
        .get("data")
        .and_then(Value::as_array)
        .ok_or_else(|| EngineError::Shape {
            path: "/v1/models".into(),
            reason: "no data array".into(),
        })?;
    Ok(data
        .iter()
        .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string))
        .collect())
}

/// Streams `POST path` with `body` and counts the generated tokens until `[DONE]`: the engine's
/// `usage.completion_tokens` when `body` asked for it (`stream_options.include_usage`, which
/// every consume leg does), else token-bearing SSE chunks ([`sse::SseTokens::generated`]). An
/// in-stream `{"error": ...}` frame (vLLM reports transfer failures after a 200) fails the leg,
/// and so does a stream that generated nothing.
pub(crate) async fn stream_tokens(
    ctx: &EngineCtx,
    path: &str,
    body: &impl serde::Serialize,
    request_id: Option<&str>,
) -> LegResult {
    use futures_util::StreamExt as _;
    let started = ctx.clock.now();
    let elapsed = |ctx: &EngineCtx| ctx.clock.now().duration_since(started).as_secs_f64();
    let mut req = ctx
        .authorize(ctx.http.post(format!("{}{}", ctx.base, path)))
        .timeout(ctx.leg_timeout)
        .json(body);
    if let Some(rid) = request_id {
        req = req.header("x-request-id", rid);
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => return failed(elapsed(ctx), transport(path, e).to_string()),
    };
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return failed(
            elapsed(ctx),
            EngineError::Status {
                path: path.to_string(),
                status: status.as_u16(),
                body: body.chars().take(200).collect(),
            }
            .to_string(),
        );
    }
    let mut parser = sse::SseTokens::default();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) => parser.feed(&bytes),
            Err(e) => {
                parser
                    .error
                    .get_or_insert_with(|| transport(path, e).to_string());
                break;
            }
        }
        if parser.done || parser.error.is_some() {
            break;
        }
    }
    let latency_s = elapsed(ctx);
    let generated = parser.generated();
    if let Some(error) = parser.error {
        return LegResult {
            ok: false,
            tokens: generated,
            latency_s,
            error: Some(error),
        };
    }
    let tokens = generated;
    if tokens == 0 {
        return failed(
            latency_s,
            "stream ended without a generated token (no token-bearing chunk, no \
             usage.completion_tokens)"
                .into(),
        );
    }
    LegResult {
        ok: true,
        tokens,
        latency_s,
        error: None,
    }
}
