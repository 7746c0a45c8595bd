//! The completion pipeline (reference-notes 1.8, 7.1–7.7a): ingress → seat → attempts
//! (placement, prefill leg, decode leg until the first token, retries) → relay → settle.
//!
//! ```text
//!  POST /v1/(chat/)completions
//!    offered+1 ─ retained limit (429) ─ readiness (503) ─ bounded body (413) ─ ingress (400/404)
//!    ─ admission seat (429/504) ─ attempts under the request deadline (504)
//!        plan ─► vLLM: prefill ─► descriptor ─► decode     SGLang: prefill ∥ decode (rendezvous)
//!        failure before output & transient & budget ─► backoff ─► next attempt (avoid failed)
//!    ─ first token ─► streaming: 200 SSE, relay task        non-streaming: collect, one object
//! ```
//!
//! Cancellation: the handler future owns every leg and the [`Pending`] guard. When hyper drops
//! it (client gone) the legs' connections close and the guard settles `cancelled`. After the
//! response starts, the relay task owns them and watches the client channel.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use rand::Rng;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tracing::Instrument;

use crate::breaker::Observation;
use crate::config::{Backend, secs};
use crate::ingress::{self, Endpoint, Validated};
use crate::metrics::labels;
use crate::outcome::{Pending, RequestRecord, SettleSink, Settlement, Terminal};
use crate::placement::{self, Phase, Plan};
use crate::relay::{Aggregator, RelayOptions, RelayStep, data_frame, done_frame, error_frame};
use crate::state::{Queued, Resident, Retained, Shared};
use crate::upstream::{
    LegError, LiveStream, Rendezvous, decode_body, sglang_bodies, url_host, vllm_prefill_body,
};

/// How long a failed SGLang decode waits for its concurrent prefill's verdict.
const PREFILL_VERDICT_WAIT: Duration = Duration::from_secs(1);

/// Response body type for every route.
pub(crate) type Body = BoxBody<Bytes, Infallible>;

/// A full JSON response with `x-request-id`.
pub(crate) fn json_response(status: StatusCode, v: &Value, rid: &str) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(rid) {
        h.insert("x-request-id", v);
    }
    r
}

fn with_retry_after(mut r: Response<Body>) -> Response<Body> {
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// Body fed by a channel: the relay task sends SSE frames; dropping the body (client gone)
/// closes the channel, which the task notices.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// Aborts a spawned task when dropped (SGLang prefill leg).
struct AbortOnDrop(tokio::task::JoinHandle<Result<(), LegError>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A failed attempt leg.
#[derive(Debug)]
struct Fail {
    phase: Phase,
    iid: usize,
    err: LegError,
    /// The attempt's producer when the decode leg failed (excluded from the retry too).
    producer: Option<usize>,
}

enum AttemptsError {
    NoEngine,
    /// The router lost control of the fleet (lease) before this attempt was placed.
    NotInControl,
    Leg(Fail),
}

/// An attempt that reached its first token.
struct Started {
    live: LiveStream,
    _seat: Resident,
    _prefill_task: Option<AbortOnDrop>,
    decode_iid: usize,
    /// The prefill engine whose KV the decode consumes (`None` for an aggregated leg).
    producer: Option<usize>,
    /// When the decode leg was dispatched (for `upstream_seconds.decode`).
    decode_at: Instant,
}

/// What every step of one request needs.
struct Ctx<'a> {
    shared: &'a Arc<Shared>,
    endpoint: Endpoint,
    v: &'a Validated,
    rid: &'a str,
    deadline: Instant,
}

/// Serve one completion POST. Never fails: every outcome is a response and one settlement.
pub(crate) async fn completion(
    shared: Arc<Shared>,
    endpoint: Endpoint,
    req: http::Request<Incoming>,
) -> Response<Body> {
    let rid = uuid::Uuid::new_v4().to_string();
    let span = tracing::info_span!("request", id = %rid, route = endpoint.path(), model = %shared.cfg.model);
    completion_inner(shared, endpoint, req, rid)
        .instrument(span)
        .await
}

async fn completion_inner(
    shared: Arc<Shared>,
    endpoint: Endpoint,
    req: http::Request<Incoming>,
    rid: String,
) -> Response<Body> {
    let arrived = shared.clock.now();
    let deadline = arrived + secs(shared.cfg.serving.request_timeout_s);
    shared.tally().offered += 1;
    shared.metrics.offered.inc();
    let sink: Arc<dyn SettleSink> = shared.clone();
    let mut pending = Pending::new(
        sink,
        RequestRecord {
            rid: rid.clone(),
            endpoint: endpoint.path().to_string(),
            arrived: shared.wall(),
            ..Default::default()
        },
    );
    let err_body = |message: &str, ty: &str| json!({"error": {"message": message, "type": ty}});

    let Some(retained) = Retained::try_new(&shared) else {
        pending.settle(Settlement::new(
            Terminal::Rejected,
            "inflight_limit",
            429,
            "router in-flight limit reached",
            "server_overloaded_error",
        ));
        return with_retry_after(json_response(
            StatusCode::TOO_MANY_REQUESTS,
            &err_body("router in-flight limit reached", "server_overloaded_error"),
            &rid,
        ));
    };

    let (ready, control_ready, reason) = shared.readiness();
    if !ready {
        let ha = shared.ha();
        let ty = if control_ready && ha.lifecycle_blocked.is_empty() && shared.live_count() == 0 {
            ("No engines are available", "backend_unavailable")
        } else {
            ("Router is not ready", "standby")
        };
        pending.settle(Settlement::new(
            Terminal::Rejected,
            "not_ready",
            503,
            format!("not ready: {reason}"),
            ty.1,
        ));
        return with_retry_after(json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"error": {"message": ty.0, "type": ty.1, "code": ty.1}}),
            &rid,
        ));
    }

    let limit = shared.cfg.serving.max_request_bytes;
    let read = tokio::time::timeout_at(deadline.into(), read_body(req.into_body(), limit)).await;
    let Ok(read) = read else {
        // A client that cannot deliver its body within the request deadline.
        pending.settle(Settlement::new(
            Terminal::Expired,
            "deadline",
            504,
            "request body not received before the deadline",
            "request_expired",
        ));
        return json_response(
            StatusCode::GATEWAY_TIMEOUT,
            &err_body("original request deadline expired", "request_expired"),
            &rid,
        );
    };
    let bytes = match read {
        Ok(b) => b,
        Err(ReadError::TooLarge) => {
            let e = ingress::IngressError::TooLarge { limit };
            let (st, body) = e.response();
            pending.settle(Settlement::new(
                Terminal::Invalid,
                "",
                st.as_u16(),
                e.to_string(),
                "request_too_large",
            ));
            return json_response(st, &body, &rid);
        }
        Err(ReadError::Client(detail)) => {
            tracing::debug!(%detail, "client body read failed");
            pending.settle(Settlement::cancelled());
            return json_response(
                StatusCode::BAD_REQUEST,
                &err_body("request body read failed", "invalid_request_error"),
                &rid,
            );
        }
    };
    let v = match ingress::validate(
        endpoint,
        &bytes,
        &shared.cfg.model,
        shared.cfg.backend,
        shared.cfg.engine.chars_per_token,
    ) {
        Ok(v) => v,
        Err(e) => {
            let (st, body) = e.response();
            let ty = body["error"]["type"]
                .as_str()
                .unwrap_or("invalid_request_error")
                .to_string();
            pending.settle(Settlement::new(
                Terminal::Invalid,
                "",
                st.as_u16(),
                e.to_string(),
                &ty,
            ));
            return json_response(st, &body, &rid);
        }
    };
    pending.record().stream = v.stream;
    pending.record().input_len = Some(v.input_len);

    // Admission seat (FIFO queue bounded by queue_timeout_s when queue_capacity > 0).
    let permit: OwnedSemaphorePermit = if shared.cfg.serving.queue_capacity == 0 {
        match shared.seats.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                pending.settle(Settlement::new(
                    Terminal::Rejected,
                    "inflight_limit",
                    429,
                    "router in-flight limit reached",
                    "server_overloaded_error",
                ));
                return with_retry_after(json_response(
                    StatusCode::TOO_MANY_REQUESTS,
                    &err_body("router in-flight limit reached", "server_overloaded_error"),
                    &rid,
                ));
            }
        }
    } else {
        let queue_by = arrived + secs(shared.cfg.serving.queue_timeout_s);
        let by = queue_by.min(deadline);
        let waiting = Queued::new(&shared);
        let acquired =
            tokio::time::timeout_at(by.into(), shared.seats.clone().acquire_owned()).await;
        drop(waiting);
        match acquired {
            Ok(Ok(p)) => p,
            _ => {
                let (reason, ty, msg) = if by == deadline {
                    (
                        "deadline",
                        "request_expired",
                        "original request deadline expired",
                    )
                } else {
                    ("queue_timeout", "queue_expired", "queue deadline expired")
                };
                pending.settle(Settlement::new(Terminal::Expired, reason, 504, msg, ty));
                return json_response(StatusCode::GATEWAY_TIMEOUT, &err_body(msg, ty), &rid);
            }
        }
    };

    let ctx = Ctx {
        shared: &shared,
        endpoint,
        v: &v,
        rid: &rid,
        deadline,
    };
    let outcome = tokio::time::timeout_at(deadline.into(), attempts(&ctx, &mut pending)).await;
    let started = match outcome {
        Err(_) => {
            pending.settle(Settlement::new(
                Terminal::Expired,
                "deadline",
                504,
                "request deadline expired before output",
                "request_expired",
            ));
            return json_response(
                StatusCode::GATEWAY_TIMEOUT,
                &err_body("original request deadline expired", "request_expired"),
                &rid,
            );
        }
        Ok(Err(AttemptsError::NotInControl)) => {
            pending.settle(Settlement::new(
                Terminal::Rejected,
                "not_ready",
                503,
                "the router lost control of the fleet before placing the request",
                "standby",
            ));
            return with_retry_after(json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"error": {"message": "Router is not ready", "type": "standby", "code": "standby"}}),
                &rid,
            ));
        }
        Ok(Err(AttemptsError::NoEngine)) => {
            let ty = "no_schedulable_engines";
            pending.settle(Settlement::new(
                Terminal::Failed,
                "no_engine",
                503,
                "no schedulable engine for this attempt",
                ty,
            ));
            return with_retry_after(json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"error": {"message": "Engine capacity is unavailable", "type": ty, "code": ty}}),
                &rid,
            ));
        }
        Ok(Err(AttemptsError::Leg(f)))
            if f.err.client_fault().is_none() && shared.clock.now() >= deadline =>
        {
            // A leg limit that coincides with the request deadline is the deadline.
            pending.settle(Settlement::new(
                Terminal::Expired,
                "deadline",
                504,
                format!(
                    "request deadline expired before output ({})",
                    f.err.detail()
                ),
                "request_expired",
            ));
            return json_response(
                StatusCode::GATEWAY_TIMEOUT,
                &err_body("original request deadline expired", "request_expired"),
                &rid,
            );
        }
        Ok(Err(AttemptsError::Leg(f))) => return failure_response(pending, &f, &rid),
        Ok(Ok(s)) => s,
    };
    let first_token_at = shared.clock.now();
    {
        let rec = pending.record();
        rec.ttft_s = Some((first_token_at - arrived).as_secs_f64());
        rec.output_started = v.stream;
        rec.decode_iid = Some(shared.cfg.engines[started.decode_iid].iid.clone());
    }
    if v.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let task_shared = shared.clone();
        let span = tracing::Span::current();
        tokio::spawn(
            relay_stream(
                task_shared,
                started,
                pending,
                tx,
                deadline,
                first_token_at,
                retained,
                permit,
            )
            .instrument(span),
        );
        let mut r = Response::new(BodyExt::boxed(ChannelBody(rx)));
        let h = r.headers_mut();
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(
            http::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
        if let Ok(v) = HeaderValue::from_str(&rid) {
            h.insert("x-request-id", v);
        }
        r
    } else {
        let r = collect(
            &shared,
            started,
            &mut pending,
            deadline,
            first_token_at,
            endpoint,
            v.input_len,
        )
        .await;
        drop(permit);
        drop(retained);
        match r {
            Ok(body) => {
                pending.settle(Settlement::completed());
                json_response(StatusCode::OK, &body, &rid)
            }
            Err((settlement, status, body)) => {
                pending.settle(settlement);
                json_response(status, &body, &rid)
            }
        }
    }
}

enum ReadError {
    TooLarge,
    Client(String),
}

async fn read_body(mut body: Incoming, limit: u64) -> Result<Bytes, ReadError> {
    use http_body::Body as _;
    if body.size_hint().lower() > limit {
        return Err(ReadError::TooLarge);
    }
    let mut buf: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| ReadError::Client(e.to_string()))?;
        if let Ok(d) = frame.into_data() {
            if (buf.len() + d.len()) as u64 > limit {
                return Err(ReadError::TooLarge);
            }
            buf.extend_from_slice(&d);
        }
    }
    Ok(Bytes::from(buf))
}

/// Answer a failed request before output and settle it.
fn failure_response(pending: Pending, f: &Fail, rid: &str) -> Response<Body> {
    if let Some((status, message, param)) = f.err.client_fault() {
        let st = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
        pending.settle(Settlement::new(
            Terminal::Failed,
            "engine_rejected",
            st.as_u16(),
            f.err.detail(),
            "invalid_request_error",
        ));
        return json_response(
            st,
            &json!({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": null}}),
            rid,
        );
    }
    let phase = f.phase.as_str();
    let status = f.err.http_status();
    pending.settle(Settlement::new(
        Terminal::Failed,
        f.err.reason(),
        status,
        format!("{phase}: {}", f.err.detail()),
        phase,
    ));
    json_response(
        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
        &json!({"error": {"message": f.err.public_message(), "type": phase, "code": phase}}),
        rid,
    )
}

/// Run attempts until one reaches its first token (reference-notes 7.5).
async fn attempts(ctx: &Ctx<'_>, pending: &mut Pending) -> Result<Started, AttemptsError> {
    let shared = ctx.shared;
    let max = shared.cfg.serving.max_attempts;
    let mut avoid: BTreeSet<usize> = BTreeSet::new();
    let mut n = 0u32;
    loop {
        n += 1;
        // A fenced router places nothing, not even a retry (reference-notes 3.4): the body
        // read and earlier attempts may have outlasted the lease.
        if !shared.ha().controls_fleet {
            return Err(AttemptsError::NotInControl);
        }
        let plan = {
            let mut core = shared.core();
            let core = &mut *core;
            let aggregate = match shared.cfg.backend {
                Backend::Vllm => placement::Aggregate::AnyRole,
                Backend::Sglang => placement::Aggregate::DecodeOnly,
            };
            placement::plan_with(&core.slots, &avoid, aggregate, &mut core.rng)
        };
        let Some(plan) = plan else {
            return Err(AttemptsError::NoEngine);
        };
        {
            let rec = pending.record();
            rec.attempts = n;
            let name = |i: usize| Some(shared.cfg.engines[i].iid.clone());
            match plan {
                Plan::Split { prefill, decode } => {
                    rec.prefill_iid = name(prefill);
                    rec.decode_iid = name(decode);
                }
                Plan::Aggregated { engine } => {
                    rec.prefill_iid = None;
                    rec.decode_iid = name(engine);
                }
            }
        }
        let producer = match plan {
            Plan::Split { prefill, .. } => Some(prefill),
            Plan::Aggregated { .. } => None,
        };
        let attempt_span = tracing::debug_span!("attempt", n);
        let result = run_attempt(ctx, n, plan).instrument(attempt_span).await;
        let f = match result {
            Ok(s) => return Ok(s),
            Err(f) => f,
        };
        // Breaker and accounting for the failed leg.
        match f.err.class(f.phase) {
            Some(class) => shared.observe_leg_failure(f.iid, f.phase, class, producer),
            None => shared.observe(f.iid, Observation::ClientFault),
        }
        if f.phase == Phase::Decode && matches!(f.err, LegError::FirstTokenTimeout) {
            // A consolidation-risk event (reference-notes 9), carried in the handoff.
            shared
                .demand()
                .record("first_token_timeout", shared.clock.now());
        }
        {
            let mut core = shared.core();
            *core
                .stats
                .attempt_failures
                .entry((f.phase.as_str().to_string(), f.err.reason().to_string()))
                .or_default() += 1;
        }
        shared
            .metrics
            .attempt_failures
            .get_or_create(&labels(&[
                ("phase", f.phase.as_str()),
                ("reason", f.err.reason()),
            ]))
            .inc();
        let engine = shared.cfg.engines[f.iid].iid.clone();
        tracing::warn!(engine.id = %engine, phase = f.phase.as_str(), error = %f.err.detail(), attempt = n, "attempt failed");
        pending.record().attempt_failures.push(json!({
            "attempt": n, "phase": f.phase.as_str(), "iid": engine, "reason": f.err.reason(), "error": f.err.detail(),
        }));
        if !f.err.transient() || n >= max {
            return Err(AttemptsError::Leg(f));
        }
        // Backoff and the router-wide retry budget.
        let backoff = {
            let base = shared.cfg.serving.retry_base_s * 2f64.powi(n as i32 - 1);
            let cap = shared.cfg.serving.retry_cap_s.min(base);
            let mut core = shared.core();
            let u: f64 = core.rng.random();
            secs(u * cap)
        };
        if shared.clock.now() + backoff >= ctx.deadline {
            return Err(AttemptsError::Leg(f));
        }
        {
            let mut core = shared.core();
            if core.retry_credits >= 1.0 {
                core.retry_credits -= 1.0;
                core.stats.retry_credits_spent += 1;
                core.stats.retry_attempts += 1;
                shared.metrics.retry_credits_spent.inc();
                shared.metrics.retry_attempts.inc();
            } else {
                core.stats.retry_denied += 1;
                shared.metrics.retry_denied.inc();
                drop(core);
                return Err(AttemptsError::Leg(f));
            }
        }
        avoid.insert(f.iid);
        if let Some(p) = f.producer {
            avoid.insert(p);
        }
        tokio::time::sleep(backoff).await;
    }
}

fn relay_options(ctx: &Ctx<'_>) -> RelayOptions {
    RelayOptions {
        return_token_ids: ctx.v.return_token_ids,
        include_usage: ctx.v.stream && ctx.v.include_usage,
        count_content_chunks: ctx.shared.cfg.backend == Backend::Sglang
            && ctx.endpoint == Endpoint::Chat,
        max_response_bytes: ctx.shared.cfg.serving.max_response_bytes,
        collect: !ctx.v.stream,
    }
}

async fn run_attempt(ctx: &Ctx<'_>, n: u32, plan: Plan) -> Result<Started, Fail> {
    let shared = ctx.shared;
    let path = ctx.endpoint.path();
    let url = |i: usize| format!("{}{}", shared.cfg.engines[i].url, path);
    let base = format!("{}-a{n}", ctx.rid);
    let opts = relay_options(ctx);
    let now = shared.clock.now();
    let sglang = shared.cfg.backend == Backend::Sglang;
    let chat = ctx.endpoint == Endpoint::Chat;
    match plan {
        Plan::Aggregated { engine } => {
            let seat = Resident::new(shared, engine, Phase::Decode);
            let mut body = decode_body(&ctx.v.body, None, !(sglang && chat));
            if sglang {
                body["rid"] = Value::String(format!("{base}-decode"));
            }
            count_decode(shared);
            let first_by = (now + first_token_limit(shared)).min(ctx.deadline);
            let live = shared
                .upstream
                .decode(
                    &url(engine),
                    &format!("{base}-decode"),
                    &body,
                    opts,
                    first_by,
                )
                .instrument(tracing::info_span!("decode", engine = %shared.cfg.engines[engine].iid))
                .await
                .map_err(|err| Fail {
                    phase: Phase::Decode,
                    iid: engine,
                    err,
                    producer: None,
                })?;
            Ok(Started {
                live,
                _seat: seat,
                _prefill_task: None,
                decode_iid: engine,
                producer: None,
                decode_at: now,
            })
        }
        Plan::Split { prefill, decode } if !sglang => {
            // Both engines count as resident from placement on: the decode engine is committed
            // to this request while its prefill runs, and the producer holds the KV until the
            // decode has pulled it. A drain of either waits for this request (seed
            // "Draining engines"; `ready_to_stop` must not turn true under it).
            let seat_p = Resident::new(shared, prefill, Phase::Prefill);
            let seat = Resident::new(shared, decode, Phase::Decode);
            count_prefill(shared);
            let limit = (now + secs(shared.cfg.serving.prefill_timeout_s)).min(ctx.deadline);
            let t0 = shared.clock.now();
            let desc = shared
                .upstream
                .vllm_prefill(
                    &url(prefill),
                    &format!("{base}-prefill"),
                    &vllm_prefill_body(&ctx.v.body),
                    limit,
                )
                .instrument(
                    tracing::info_span!("prefill", engine = %shared.cfg.engines[prefill].iid),
                )
                .await
                .map_err(|err| Fail {
                    phase: Phase::Prefill,
                    iid: prefill,
                    err,
                    producer: None,
                })?;
            let prefill_s = (shared.clock.now() - t0).as_secs_f64();
            shared.core().stats.upstream_prefill_s += prefill_s;
            shared
                .metrics
                .upstream_seconds
                .get_or_create(&labels(&[("phase", "prefill")]))
                .inc_by(prefill_s);
            shared.observe(prefill, Observation::PrefillOk);
            let decode_at = shared.clock.now();
            count_decode(shared);
            let body = decode_body(&ctx.v.body, (decode != prefill).then_some(&desc), true);
            let first_by = (shared.clock.now() + first_token_limit(shared)).min(ctx.deadline);
            let live = shared
                .upstream
                .decode(
                    &url(decode),
                    &format!("{base}-decode"),
                    &body,
                    opts,
                    first_by,
                )
                .instrument(tracing::info_span!("decode", engine = %shared.cfg.engines[decode].iid))
                .await
                .map_err(|err| Fail {
                    phase: Phase::Decode,
                    iid: decode,
                    err,
                    producer: Some(prefill),
                });
            // The decode has its first token: the KV left the producer.
            drop(seat_p);
            let live = live?;
            Ok(Started {
                live,
                _seat: seat,
                _prefill_task: None,
                decode_iid: decode,
                producer: Some(prefill),
                decode_at,
            })
        }
        Plan::Split { prefill, decode } => {
            // SGLang: reserve both before either leg starts (reference-notes 7.2 step 1).
            let seat_p = Resident::new(shared, prefill, Phase::Prefill);
            let seat_d = Resident::new(shared, decode, Phase::Decode);
            let fail_p = |err| Fail {
                phase: Phase::Prefill,
                iid: prefill,
                err,
                producer: None,
            };
            let port = bootstrap_port(shared, prefill)
                .await
                .map_err(|e| fail_p(LegError::KvHandoff(e)))?;
            let host = url_host(&shared.cfg.engines[prefill].url).ok_or_else(|| {
                fail_p(LegError::KvHandoff("prefill engine URL has no host".into()))
            })?;
            let room: u64 = shared.core().rng.random::<u64>() >> 1;
            let rv = Rendezvous { host, port, room };
            let (pbody, dbody) = sglang_bodies(&ctx.v.body, &rv, &base, chat);
            let up = shared.upstream.clone();
            let purl = url(prefill);
            let limit = (now + secs(shared.cfg.serving.prefill_timeout_s)).min(ctx.deadline);
            let task_shared = shared.clone();
            count_prefill(shared);
            count_decode(shared);
            let pspan = tracing::info_span!("prefill", engine = %shared.cfg.engines[prefill].iid);
            let mut ptask = AbortOnDrop(tokio::spawn(
                async move {
                    let _seat = seat_p;
                    let t0 = task_shared.clock.now();
                    let r = up.sglang_prefill(&purl, &pbody, limit).await;
                    if r.is_ok() {
                        let prefill_s = (task_shared.clock.now() - t0).as_secs_f64();
                        task_shared.core().stats.upstream_prefill_s += prefill_s;
                        task_shared
                            .metrics
                            .upstream_seconds
                            .get_or_create(&labels(&[("phase", "prefill")]))
                            .inc_by(prefill_s);
                        task_shared.observe(prefill, Observation::PrefillOk);
                    }
                    r
                }
                .instrument(pspan),
            ));
            let first_by =
                (now + first_token_limit(shared).min(Duration::from_secs(30))).min(ctx.deadline);
            let durl = url(decode);
            let drid = format!("{base}-decode");
            let dfut = shared
                .upstream
                .decode(&durl, &drid, &dbody, opts, first_by)
                .instrument(
                    tracing::info_span!("decode", engine = %shared.cfg.engines[decode].iid),
                );
            tokio::pin!(dfut);
            let mut prefill_done = false;
            loop {
                tokio::select! {
                    r = &mut ptask.0, if !prefill_done => {
                        prefill_done = true;
                        let r = r.unwrap_or_else(|e| Err(LegError::Connect(format!("prefill task ended: {e}"))));
                        if let Err(err) = r {
                            // Dropping `dfut` on return closes the decode connection at once.
                            return Err(fail_p(err));
                        }
                    }
                    d = &mut dfut => {
                        return match d {
                            Ok(live) => Ok(Started { live, _seat: seat_d, _prefill_task: Some(ptask), decode_iid: decode, producer: Some(prefill), decode_at: now }),
                            Err(err) => {
                                // A failed prefill usually fails the waiting decode too, and the
                                // two answers race: give the prefill a moment so its error (often
                                // the client's fault, e.g. 400 context length) is the one reported
                                // (reference-notes 7.2 step 4).
                                if !prefill_done
                                    && let Ok(Ok(Err(perr))) =
                                        tokio::time::timeout(PREFILL_VERDICT_WAIT, &mut ptask.0).await
                                {
                                    return Err(fail_p(perr));
                                }
                                Err(Fail { phase: Phase::Decode, iid: decode, err, producer: Some(prefill) })
                            }
                        };
                    }
                }
            }
        }
    }
}

fn first_token_limit(shared: &Shared) -> Duration {
    shared.cfg.first_token_timeout()
}

fn count_prefill(shared: &Shared) {
    shared.core().stats.prefill_attempts += 1;
    shared.metrics.prefill_attempts.inc();
}

fn count_decode(shared: &Shared) {
    shared.core().stats.decode_attempts += 1;
    shared.metrics.decode_attempts.inc();
}

/// The SGLang bootstrap port of a prefill engine: cached, else `GET <engine>/server_info`.
pub(crate) async fn bootstrap_port(shared: &Shared, iid: usize) -> Result<u16, String> {
    if let Some(p) = shared.core().bootstrap_ports[iid] {
        return Ok(p);
    }
    refresh_bootstrap_port(shared, iid).await
}

/// Fetch and cache `disaggregation_bootstrap_port` from `/server_info`.
pub(crate) async fn refresh_bootstrap_port(shared: &Shared, iid: usize) -> Result<u16, String> {
    let url = format!("{}/server_info", shared.cfg.engines[iid].url);
    let (status, body) = shared
        .upstream
        .get(&url, secs(shared.cfg.engine.health_timeout_s))
        .await?;
    if status != StatusCode::OK {
        return Err(format!("{url} answered {status}"));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| format!("{url}: not JSON: {e}"))?;
    let port = v
        .get("disaggregation_bootstrap_port")
        .and_then(|p| {
            p.as_u64()
                .or_else(|| p.as_str().and_then(|s| s.parse().ok()))
        })
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| format!("{url}: no disaggregation_bootstrap_port"))?;
    shared.core().bootstrap_ports[iid] = Some(port);
    Ok(port)
}

fn gap(shared: &Shared) -> Option<Duration> {
    let g = shared.cfg.engine.decode_read_timeout_s;
    (g > 0.0).then(|| secs(g))
}

struct TokenClock {
    first_at: Instant,
    first_tokens: u64,
    last_at: Instant,
    tokens: u64,
}

impl TokenClock {
    fn new(at: Instant, tokens: u64) -> Self {
        TokenClock {
            first_at: at,
            first_tokens: tokens,
            last_at: at,
            tokens,
        }
    }
    fn update(&mut self, at: Instant, tokens: u64) {
        if tokens > self.tokens {
            self.tokens = tokens;
            self.last_at = at;
        }
    }
    fn tpot(&self) -> Option<f64> {
        let extra = self.tokens.saturating_sub(self.first_tokens);
        (extra > 0).then(|| (self.last_at - self.first_at).as_secs_f64() / extra as f64)
    }
}

fn finish_record(shared: &Shared, pending: &mut Pending, started: &Started, clock: &TokenClock) {
    let live = &started.live;
    let rec = pending.record();
    rec.output_len = live.tokens();
    rec.tpot_s = clock.tpot();
    let decode_s = (shared.clock.now() - started.decode_at).as_secs_f64();
    let mut core = shared.core();
    core.stats.decode_tokens_observed += live.tokens();
    core.stats.upstream_decode_s += decode_s;
    drop(core);
    shared.metrics.decode_tokens_observed.inc_by(live.tokens());
    shared
        .metrics
        .upstream_seconds
        .get_or_create(&labels(&[("phase", "decode")]))
        .inc_by(decode_s);
}

/// Sends one frame to the client unless it is gone or the request deadline passes first (a
/// client that stops reading must not hold its seats and the upstream past the deadline).
async fn send_by(tx: &mpsc::Sender<Bytes>, frame: Bytes, deadline: Instant) -> bool {
    matches!(
        tokio::time::timeout_at(deadline.into(), tx.send(frame)).await,
        Ok(Ok(()))
    )
}

/// How long a final frame (`[DONE]` or the error frame) may wait for a slow client.
const FINAL_FRAME_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Relay the rest of a stream to a streaming client (runs as its own task).
#[allow(clippy::too_many_arguments)]
async fn relay_stream(
    shared: Arc<Shared>,
    mut started: Started,
    mut pending: Pending,
    tx: mpsc::Sender<Bytes>,
    deadline: Instant,
    first_at: Instant,
    _retained: Retained,
    _permit: OwnedSemaphorePermit,
) {
    let mut clock = TokenClock::new(first_at, started.live.tokens());
    for c in std::mem::take(&mut started.live.first) {
        if !send_by(&tx, data_frame(&c), deadline).await {
            finish_record(&shared, &mut pending, &started, &clock);
            return; // client gone (or too slow): `pending` settles on drop
        }
    }
    let gap = gap(&shared);
    let decode_iid = started.decode_iid;
    loop {
        let step = tokio::select! {
            _ = tx.closed() => {
                finish_record(&shared, &mut pending, &started, &clock);
                return;
            }
            _ = tokio::time::sleep_until(deadline.into()) => {
                let _ = tokio::time::timeout(FINAL_FRAME_WAIT, tx.send(error_frame("Request deadline expired", "decode", "expired"))).await;
                finish_record(&shared, &mut pending, &started, &clock);
                pending.settle(Settlement::new(Terminal::Expired, "deadline", 200, "request deadline expired after output", "decode"));
                return;
            }
            s = started.live.next(gap) => s,
        };
        clock.update(shared.clock.now(), started.live.tokens());
        match step {
            Ok(RelayStep::Output(chunks)) => {
                for c in chunks {
                    if !send_by(&tx, data_frame(&c), deadline).await {
                        finish_record(&shared, &mut pending, &started, &clock);
                        return;
                    }
                }
            }
            Ok(RelayStep::Hold) => {}
            Ok(RelayStep::Done) => {
                let _ = tokio::time::timeout(FINAL_FRAME_WAIT, tx.send(done_frame())).await;
                shared.observe(decode_iid, Observation::DecodeOk);
                finish_record(&shared, &mut pending, &started, &clock);
                pending.settle(Settlement::completed());
                return;
            }
            Ok(RelayStep::Failed(f)) => {
                let s = stream_failed(
                    &shared,
                    &mut pending,
                    &started,
                    &clock,
                    &tx,
                    LegError::Stream(f),
                )
                .await;
                pending.settle(s);
                return;
            }
            Err(e) => {
                let s = stream_failed(&shared, &mut pending, &started, &clock, &tx, e).await;
                pending.settle(s);
                return;
            }
        }
    }
}

async fn stream_failed(
    shared: &Shared,
    pending: &mut Pending,
    started: &Started,
    clock: &TokenClock,
    tx: &mpsc::Sender<Bytes>,
    err: LegError,
) -> Settlement {
    let _ = tokio::time::timeout(
        FINAL_FRAME_WAIT,
        tx.send(error_frame(err.public_message(), "decode", "failed")),
    )
    .await;
    if let Some(class) = err.class(Phase::Decode) {
        shared.observe_leg_failure(started.decode_iid, Phase::Decode, class, started.producer);
    }
    tracing::warn!(error = %err.detail(), "decode stream failed after output");
    finish_record(shared, pending, started, clock);
    Settlement::new(
        Terminal::Failed,
        err.reason(),
        200,
        format!("decode: {}", err.detail()),
        "decode",
    )
}

/// Collect a stream into one response object for a non-streaming client.
async fn collect(
    shared: &Shared,
    mut started: Started,
    pending: &mut Pending,
    deadline: Instant,
    first_at: Instant,
    endpoint: Endpoint,
    input_len: u64,
) -> Result<Value, (Settlement, StatusCode, Value)> {
    let mut agg = Aggregator::new(endpoint == Endpoint::Chat);
    let mut clock = TokenClock::new(first_at, started.live.tokens());
    for c in std::mem::take(&mut started.live.first) {
        agg.push(&c);
    }
    let gap = gap(shared);
    loop {
        let step = tokio::select! {
            _ = tokio::time::sleep_until(deadline.into()) => {
                finish_record(shared, pending, &started, &clock);
                return Err((
                    Settlement::new(Terminal::Expired, "deadline", 504, "request deadline expired while collecting", "request_expired"),
                    StatusCode::GATEWAY_TIMEOUT,
                    json!({"error": {"message": "original request deadline expired", "type": "request_expired"}}),
                ));
            }
            s = started.live.next(gap) => s,
        };
        clock.update(shared.clock.now(), started.live.tokens());
        pending.record().output_len = started.live.tokens();
        let err = match step {
            Ok(RelayStep::Output(chunks)) => {
                for c in &chunks {
                    agg.push(c);
                }
                continue;
            }
            Ok(RelayStep::Hold) => continue,
            Ok(RelayStep::Done) => {
                shared.observe(started.decode_iid, Observation::DecodeOk);
                finish_record(shared, pending, &started, &clock);
                let prompt = started.live.prompt_tokens().unwrap_or(input_len);
                return Ok(agg.finish(prompt, started.live.tokens()));
            }
            Ok(RelayStep::Failed(f)) => LegError::Stream(f),
            Err(e) => e,
        };
        if let Some(class) = err.class(Phase::Decode) {
            shared.observe_leg_failure(started.decode_iid, Phase::Decode, class, started.producer);
        }
        finish_record(shared, pending, &started, &clock);
        let status = err.http_status();
        let msg = match err {
            LegError::Stream(crate::relay::StreamFailure::ResponseLimit) => {
                "Response exceeds the configured limit"
            }
            _ => "Invalid non-streaming upstream response",
        };
        return Err((
            Settlement::new(
                Terminal::Failed,
                err.reason(),
                status,
                format!("decode: {}", err.detail()),
                "decode",
            ),
            StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
            json!({"error": {"message": msg, "type": "decode", "code": "decode"}}),
        ));
    }
}
