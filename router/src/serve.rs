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
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use rand::Rng;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tracing::Instrument;

use crate::breaker::Observation;
use crate::config::{Backend, secs};
use crate::failure::{Expiry, RequestFailure};
use crate::ingress::{self, Endpoint, Validated};
use crate::metrics::labels;
use crate::outcome::{Pending, RequestRecord, SettleSink, Settlement};
use crate::placement::{self, Phase, Plan};
use crate::relay::{Aggregator, RelayOptions, RelayStep, data_frame, done_frame};
use crate::response::{Body, json_response};
use crate::retry::{self, Decision, RetryPolicy, Stop};
use crate::state::{Queued, Resident, Retained, Shared};
use crate::upstream::{
    LegError, LiveStream, Rendezvous, decode_body, sglang_bodies, url_host, vllm_prefill_body,
};

/// How long a failed SGLang decode waits for its concurrent prefill's verdict.
const PREFILL_VERDICT_WAIT: Duration = Duration::from_secs(1);

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
    let fail = |pending: Pending, failure: RequestFailure| {
        pending.settle(failure.settlement());
        failure.response(&rid)
    };

    let Some(retained) = Retained::try_new(&shared) else {
        return fail(pending, RequestFailure::InflightLimit);
    };

    let (ready, control_ready, reason) = shared.readiness();
    if !ready {
        let no_engines =
            control_ready && shared.ha().lifecycle_blocked.is_empty() && shared.live_count() == 0;
        return fail(pending, RequestFailure::NotReady { reason, no_engines });
    }

    let limit = shared.cfg.serving.max_request_bytes;
    let read = tokio::time::timeout_at(deadline.into(), read_body(req.into_body(), limit)).await;
    let bytes = match read {
        // A client that cannot deliver its body within the request deadline.
        Err(_) => return fail(pending, RequestFailure::Expired(Expiry::BodyRead)),
        Ok(Ok(b)) => b,
        Ok(Err(ReadError::TooLarge)) => {
            let e = ingress::IngressError::TooLarge { limit };
            return fail(pending, RequestFailure::Invalid(e));
        }
        Ok(Err(ReadError::Client(detail))) => {
            tracing::debug!(%detail, "client body read failed");
            return fail(pending, RequestFailure::BodyUnreadable);
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
        Err(e) => return fail(pending, RequestFailure::Invalid(e)),
    };
    pending.record().stream = v.stream;
    pending.record().input_len = Some(v.input_len);

    // Admission seat (FIFO queue bounded by queue_timeout_s when queue_capacity > 0).
    let permit: OwnedSemaphorePermit = if shared.cfg.serving.queue_capacity == 0 {
        match shared.seats.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => return fail(pending, RequestFailure::InflightLimit),
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
                let deadline_first = by == deadline;
                return fail(
                    pending,
                    RequestFailure::Expired(Expiry::Queue { deadline_first }),
                );
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
        Err(_) => return fail(pending, RequestFailure::Expired(Expiry::BeforeOutput)),
        Ok(Err(RequestFailure::Leg { err, .. }))
            if err.client_fault().is_none() && shared.clock.now() >= deadline =>
        {
            // A leg limit that coincides with the request deadline is the deadline.
            let detail = err.detail();
            return fail(
                pending,
                RequestFailure::Expired(Expiry::LegAtDeadline { detail }),
            );
        }
        Ok(Err(failure)) => return fail(pending, failure),
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
            async move {
                let _held = (retained, permit);
                let mut client = Stream(tx);
                let end = relay(
                    &task_shared,
                    started,
                    &mut pending,
                    &mut client,
                    deadline,
                    first_token_at,
                )
                .await;
                match end {
                    Relayed::Done { .. } => {
                        client.finish(done_frame()).await;
                        pending.settle(Settlement::completed());
                    }
                    // Client gone (or too slow): `pending` settles on drop.
                    Relayed::ClientGone => {}
                    Relayed::Failed(failure) => {
                        if let Some(frame) = failure.stream_frame() {
                            client.finish(frame).await;
                        }
                        pending.settle(failure.settlement());
                    }
                }
            }
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
        let mut agg = Aggregator::new(endpoint == Endpoint::Chat);
        let end = relay(
            &shared,
            started,
            &mut pending,
            &mut agg,
            deadline,
            first_token_at,
        )
        .await;
        drop(permit);
        drop(retained);
        match end {
            Relayed::Done {
                prompt_tokens,
                tokens,
            } => {
                pending.settle(Settlement::completed());
                let prompt = prompt_tokens.unwrap_or(v.input_len);
                json_response(StatusCode::OK, &agg.finish(prompt, tokens), &rid)
            }
            Relayed::Failed(failure) => fail(pending, failure),
            // An `Aggregator` takes every chunk and never reports its client gone (hyper drops
            // this future instead, and `pending` settles on drop).
            Relayed::ClientGone => unreachable!("a non-streaming relay has no client to lose"),
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

/// Run attempts until one reaches its first token (reference-notes 7.5).
async fn attempts(ctx: &Ctx<'_>, pending: &mut Pending) -> Result<Started, RequestFailure> {
    let shared = ctx.shared;
    let policy = RetryPolicy::from_serving(&shared.cfg.serving);
    let mut avoid: BTreeSet<usize> = BTreeSet::new();
    let mut n = 0u32;
    loop {
        n += 1;
        // A fenced router places nothing, not even a retry (reference-notes 3.4): the body
        // read and earlier attempts may have outlasted the lease.
        if !shared.ha().controls_fleet {
            return Err(RequestFailure::NotInControl);
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
            return Err(RequestFailure::NoEngine);
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
        pending.record().attempt_failures.push(serde_json::json!({
            "attempt": n, "phase": f.phase.as_str(), "iid": engine, "reason": f.err.reason(), "error": f.err.detail(),
        }));
        // Backoff and the router-wide retry budget.
        let u: f64 = rand::rng().random();
        let decision = retry::decide(
            &policy,
            n,
            f.err.transient(),
            u,
            shared.clock.now(),
            ctx.deadline,
            &shared.retry_budget,
        );
        let backoff = match decision {
            Decision::Retry(backoff) => {
                shared.count_retry();
                backoff
            }
            Decision::Stop(why) => {
                if why == Stop::BudgetDenied {
                    shared.count_retry_denied();
                }
                return Err(RequestFailure::Leg {
                    phase: f.phase,
                    err: f.err,
                });
            }
        };
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

/// Where relayed chunks go: a streaming client's channel, or the [`Aggregator`] that builds a
/// non-streaming client's one response object.
trait Sink {
    /// Delivers one chunk; `false` when the client is gone or too slow (it has until
    /// `deadline` to take it).
    fn deliver(&mut self, chunk: &Value, deadline: Instant) -> impl Future<Output = bool> + Send;
    /// Resolves when the client went away (never for a non-streaming client, whose handler
    /// future hyper drops instead).
    fn gone(&self) -> impl Future<Output = ()> + Send;
}

/// A streaming client: SSE frames over the response body's channel.
struct Stream(mpsc::Sender<Bytes>);

impl Sink for Stream {
    async fn deliver(&mut self, chunk: &Value, deadline: Instant) -> bool {
        // A client that stops reading must not hold its seats and the upstream past the
        // deadline.
        matches!(
            tokio::time::timeout_at(deadline.into(), self.0.send(data_frame(chunk))).await,
            Ok(Ok(()))
        )
    }

    async fn gone(&self) {
        self.0.closed().await;
    }
}

impl Stream {
    /// Sends a final frame (`[DONE]` or the error frame), waiting at most
    /// [`FINAL_FRAME_WAIT`] for a slow client.
    async fn finish(&self, frame: Bytes) {
        let _ = tokio::time::timeout(FINAL_FRAME_WAIT, self.0.send(frame)).await;
    }
}

impl Sink for Aggregator {
    async fn deliver(&mut self, chunk: &Value, _deadline: Instant) -> bool {
        self.push(chunk);
        true
    }

    async fn gone(&self) {
        std::future::pending::<()>().await;
    }
}

/// How a relay ended.
enum Relayed {
    /// `[DONE]` after output: the engine's prompt token count, if it gave one, and the
    /// tokens counted.
    Done {
        prompt_tokens: Option<u64>,
        tokens: u64,
    },
    /// The client went away (or stopped reading): `pending` settles on drop.
    ClientGone,
    /// The deadline passed or the stream failed after the first token.
    Failed(RequestFailure),
}

/// How long a final frame (`[DONE]` or the error frame) may wait for a slow client.
const FINAL_FRAME_WAIT: Duration = Duration::from_secs(1);

/// Relays the rest of a started decode stream into `sink` until `[DONE]`, a failure, the
/// request deadline or the client's departure (reference-notes 7.3), feeding the breaker and
/// the request record on the way. The one relay loop of both client kinds.
async fn relay(
    shared: &Shared,
    mut started: Started,
    pending: &mut Pending,
    sink: &mut impl Sink,
    deadline: Instant,
    first_at: Instant,
) -> Relayed {
    let streaming = pending.record_ref().stream;
    let mut clock = TokenClock::new(first_at, started.live.tokens());
    let end = 'relay: {
        for c in std::mem::take(&mut started.live.first) {
            if !sink.deliver(&c, deadline).await {
                break 'relay Relayed::ClientGone;
            }
        }
        let gap = gap(shared);
        loop {
            let step = tokio::select! {
                () = sink.gone() => break 'relay Relayed::ClientGone,
                _ = tokio::time::sleep_until(deadline.into()) => {
                    let expiry = if streaming { Expiry::AfterOutput } else { Expiry::Collecting };
                    break 'relay Relayed::Failed(RequestFailure::Expired(expiry));
                }
                s = started.live.next(gap) => s,
            };
            clock.update(shared.clock.now(), started.live.tokens());
            let err = match step {
                Ok(RelayStep::Output(chunks)) => {
                    for c in &chunks {
                        if !sink.deliver(c, deadline).await {
                            break 'relay Relayed::ClientGone;
                        }
                    }
                    continue;
                }
                Ok(RelayStep::Hold) => continue,
                Ok(RelayStep::Done) => {
                    shared.observe(started.decode_iid, Observation::DecodeOk);
                    break 'relay Relayed::Done {
                        prompt_tokens: started.live.prompt_tokens(),
                        tokens: started.live.tokens(),
                    };
                }
                Ok(RelayStep::Failed(f)) => LegError::Stream(f),
                Err(e) => e,
            };
            if let Some(class) = err.class(Phase::Decode) {
                shared.observe_leg_failure(
                    started.decode_iid,
                    Phase::Decode,
                    class,
                    started.producer,
                );
            }
            tracing::warn!(error = %err.detail(), "decode stream failed after output");
            break 'relay Relayed::Failed(RequestFailure::Decode { err, streaming });
        }
    };
    finish_record(shared, pending, &started, &clock);
    end
}
