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

use crate::bootstrap;
use crate::breaker::Observation;
use crate::config::{Backend, secs};
use crate::controller::Track;
use crate::failure::{Expiry, RequestFailure};
use crate::fleet::Resident;
use crate::ingress::{self, Endpoint, Validated};
use crate::outcome::{Pending, RequestRecord, SettleSink, Settlement};
use crate::parts::Parts;
use crate::placement::{self, Phase, Plan};
use crate::relay::{Aggregator, RelayOptions, RelayStep, data_frame, done_frame};
use crate::response::{Body, json_response};
use crate::retry::{self, Decision, RetryPolicy, Stop};
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
    /// The role controller's bookkeeping of this request (token gaps).
    track: Track,
}

/// What every step of one request needs.
struct Ctx<'a> {
    parts: &'a Arc<Parts>,
    endpoint: Endpoint,
    v: &'a Validated,
    rid: &'a str,
    deadline: Instant,
    /// The role controller's bookkeeping of this request.
    track: &'a Track,
}

/// Serve one completion POST. Never fails: every outcome is a response and one settlement.
pub(crate) async fn completion(
    parts: Arc<Parts>,
    endpoint: Endpoint,
    req: http::Request<Incoming>,
) -> Response<Body> {
    let rid = uuid::Uuid::new_v4().to_string();
    let span = tracing::info_span!("request", id = %rid, route = endpoint.path(), model = %parts.cfg.model);
    completion_inner(parts, endpoint, req, rid)
        .instrument(span)
        .await
}

async fn completion_inner(
    parts: Arc<Parts>,
    endpoint: Endpoint,
    req: http::Request<Incoming>,
    rid: String,
) -> Response<Body> {
    let arrived = parts.clock.now();
    let deadline = arrived + secs(parts.cfg.serving.request_timeout_s);
    parts.accounting.offered();
    let sink: Arc<dyn SettleSink> = parts.accounting.clone();
    let mut pending = Pending::new(
        sink,
        RequestRecord {
            rid: rid.clone(),
            endpoint: endpoint.path().to_string(),
            arrived: parts.wall(),
            ..Default::default()
        },
    );
    let track = parts.controller.track(&rid);
    let fail = |pending: Pending, failure: RequestFailure| {
        if matches!(failure, RequestFailure::Invalid(_)) {
            track.invalid();
        }
        pending.settle(failure.settlement());
        failure.response(&rid)
    };

    let Some(retained) = parts.admission.try_retain() else {
        return fail(pending, RequestFailure::InflightLimit);
    };

    let readiness = parts.gate.readiness();
    if !readiness.ready {
        let no_engines = readiness.control_ready
            && parts.gate.lifecycle_hold().is_none()
            && parts.fleet.live_count() == 0;
        let reason = readiness.reason;
        return fail(pending, RequestFailure::NotReady { reason, no_engines });
    }

    let limit = parts.cfg.serving.max_request_bytes;
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
        &parts.cfg.model,
        parts.cfg.backend,
        parts.cfg.engine.chars_per_token,
    ) {
        Ok(v) => v,
        Err(e) => return fail(pending, RequestFailure::Invalid(e)),
    };
    pending.record().stream = v.stream;
    let input_len = parts.controller.size(&track, &v).await;
    pending.record().input_len = Some(input_len);

    // Admission seat (FIFO queue bounded by queue_timeout_s when queue_capacity > 0; queued
    // requests are re-priced under predictive admission: controller-notes 10.1).
    let permit: OwnedSemaphorePermit = match parts
        .controller
        .seat(&parts.admission, &track, deadline)
        .await
    {
        Ok((p, waited)) => {
            pending.record().admission_wait_s = Some(waited);
            p
        }
        Err(failure) => {
            refused_attempt(&parts, &mut pending, &failure, 1);
            return fail(pending, failure);
        }
    };

    let ctx = Ctx {
        parts: &parts,
        endpoint,
        v: &v,
        rid: &rid,
        deadline,
        track: &track,
    };
    let outcome = tokio::time::timeout_at(deadline.into(), attempts(&ctx, &mut pending)).await;
    let started = match outcome {
        Err(_) => return fail(pending, RequestFailure::Expired(Expiry::BeforeOutput)),
        Ok(Err(RequestFailure::Leg { err, .. }))
            if err.client_fault().is_none() && parts.clock.now() >= deadline =>
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
    let first_token_at = parts.clock.now();
    {
        let rec = pending.record();
        rec.ttft_s = Some((first_token_at - arrived).as_secs_f64());
        rec.output_started = v.stream;
        rec.decode_iid = Some(parts.cfg.engines[started.decode_iid].iid.clone());
    }
    if v.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let task_parts = parts.clone();
        let span = tracing::Span::current();
        tokio::spawn(
            async move {
                let _held = (retained, permit, track);
                let mut client = Stream(tx);
                let end = relay(
                    &task_parts,
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
                        _held.2.completed();
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
            &parts,
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
                track.completed();
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
    let parts = ctx.parts;
    let policy = RetryPolicy::from_serving(&parts.cfg.serving);
    let mut avoid: BTreeSet<usize> = BTreeSet::new();
    let mut n = 0u32;
    loop {
        n += 1;
        // A fenced router places nothing, not even a retry (reference-notes 3.4): the body
        // read and earlier attempts may have outlasted the lease.
        if !parts.ha.controls_fleet() {
            return Err(RequestFailure::NotInControl);
        }
        let aggregate = match parts.cfg.backend {
            Backend::Vllm => placement::Aggregate::AnyRole,
            Backend::Sglang => placement::Aggregate::DecodeOnly,
        };
        let plan = parts.fleet.place(&avoid, aggregate);
        let Some(plan) = plan else {
            return Err(RequestFailure::NoEngine);
        };
        // The TTFT price at placement (controller-notes 10.4): journalled, and under
        // predictive admission a first attempt over budget is refused undispatched.
        match parts
            .controller
            .admit(ctx.track, plan, n, || parts.accounting.unserved_placement())
        {
            Ok(price) => pending.record().admission_price = price,
            Err(refusal) => {
                pending.record().admission_price = Some(refusal.price.json());
                let failure = RequestFailure::Refused(refusal);
                refused_attempt(parts, pending, &failure, n);
                return Err(failure);
            }
        }
        {
            let rec = pending.record();
            rec.attempts = n;
            let name = |i: usize| Some(parts.cfg.engines[i].iid.clone());
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
        ctx.track.attempt_ended();
        // Breaker and accounting for the failed leg.
        match f.err.class(f.phase) {
            Some(class) => parts
                .fleet
                .observe_leg_failure(f.iid, f.phase, class, producer),
            None => parts.fleet.observe(f.iid, Observation::ClientFault),
        }
        if f.phase == Phase::Decode && matches!(f.err, LegError::FirstTokenTimeout) {
            // A consolidation-risk event (reference-notes 9), carried in the handoff.
            parts
                .demand
                .lock()
                .record("first_token_timeout", parts.clock.now());
        }
        parts.accounting.attempt_failed(f.phase, f.err.reason());
        let engine = parts.cfg.engines[f.iid].iid.clone();
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
            parts.clock.now(),
            ctx.deadline,
            parts.accounting.budget(),
        );
        let backoff = match decision {
            Decision::Retry(backoff) => {
                parts.accounting.retry_granted();
                backoff
            }
            Decision::Stop(why) => {
                if why == Stop::BudgetDenied {
                    parts.accounting.retry_denied();
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
        count_content_chunks: ctx.parts.cfg.backend == Backend::Sglang
            && ctx.endpoint == Endpoint::Chat,
        max_response_bytes: ctx.parts.cfg.serving.max_response_bytes,
        collect: !ctx.v.stream,
    }
}

async fn run_attempt(ctx: &Ctx<'_>, n: u32, plan: Plan) -> Result<Started, Fail> {
    let parts = ctx.parts;
    let path = ctx.endpoint.path();
    let url = |i: usize| format!("{}{}", parts.cfg.engines[i].url, path);
    let base = format!("{}-a{n}", ctx.rid);
    let opts = relay_options(ctx);
    let now = parts.clock.now();
    let sglang = parts.cfg.backend == Backend::Sglang;
    let chat = ctx.endpoint == Endpoint::Chat;
    match plan {
        Plan::Aggregated { engine } => {
            let seat = parts.fleet.resident(engine, Phase::Decode);
            ctx.track.dispatched(engine, Phase::Decode);
            let mut body = decode_body(&ctx.v.body, None, !(sglang && chat));
            if sglang {
                body["rid"] = Value::String(format!("{base}-decode"));
            }
            parts.accounting.decode_dispatched();
            let first_by = (now + first_token_limit(parts)).min(ctx.deadline);
            let live = parts
                .upstream
                .decode(
                    &url(engine),
                    &format!("{base}-decode"),
                    &body,
                    opts,
                    first_by,
                )
                .instrument(tracing::info_span!("decode", engine = %parts.cfg.engines[engine].iid))
                .await
                .map_err(|err| Fail {
                    phase: Phase::Decode,
                    iid: engine,
                    err,
                    producer: None,
                })?;
            ctx.track.first_token();
            Ok(Started {
                live,
                _seat: seat,
                _prefill_task: None,
                decode_iid: engine,
                producer: None,
                decode_at: now,
                track: ctx.track.clone(),
            })
        }
        Plan::Split { prefill, decode } if !sglang => {
            // Both engines count as resident from placement on: the decode engine is committed
            // to this request while its prefill runs, and the producer holds the KV until the
            // decode has pulled it. A drain of either waits for this request (seed
            // "Draining engines"; `ready_to_stop` must not turn true under it).
            let seat_p = parts.fleet.resident(prefill, Phase::Prefill);
            let seat = parts.fleet.resident(decode, Phase::Decode);
            ctx.track.dispatched(prefill, Phase::Prefill);
            parts.accounting.prefill_dispatched();
            let limit = (now + secs(parts.cfg.serving.prefill_timeout_s)).min(ctx.deadline);
            let t0 = parts.clock.now();
            let desc = parts
                .upstream
                .vllm_prefill(
                    &url(prefill),
                    &format!("{base}-prefill"),
                    &vllm_prefill_body(&ctx.v.body),
                    limit,
                )
                .instrument(
                    tracing::info_span!("prefill", engine = %parts.cfg.engines[prefill].iid),
                )
                .await
                .map_err(|err| Fail {
                    phase: Phase::Prefill,
                    iid: prefill,
                    err,
                    producer: None,
                })?;
            parts
                .accounting
                .prefill_time((parts.clock.now() - t0).as_secs_f64());
            parts.fleet.observe(prefill, Observation::PrefillOk);
            let decode_at = parts.clock.now();
            ctx.track.dispatched(decode, Phase::Decode);
            parts.accounting.decode_dispatched();
            let body = decode_body(&ctx.v.body, (decode != prefill).then_some(&desc), true);
            let first_by = (parts.clock.now() + first_token_limit(parts)).min(ctx.deadline);
            let live = parts
                .upstream
                .decode(
                    &url(decode),
                    &format!("{base}-decode"),
                    &body,
                    opts,
                    first_by,
                )
                .instrument(tracing::info_span!("decode", engine = %parts.cfg.engines[decode].iid))
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
            ctx.track.first_token();
            Ok(Started {
                live,
                _seat: seat,
                _prefill_task: None,
                decode_iid: decode,
                producer: Some(prefill),
                decode_at,
                track: ctx.track.clone(),
            })
        }
        Plan::Split { prefill, decode } => {
            // SGLang: reserve both before either leg starts (reference-notes 7.2 step 1).
            let seat_p = parts.fleet.resident(prefill, Phase::Prefill);
            let seat_d = parts.fleet.resident(decode, Phase::Decode);
            let fail_p = |err| Fail {
                phase: Phase::Prefill,
                iid: prefill,
                err,
                producer: None,
            };
            let port = bootstrap::port(&parts.cfg, &parts.fleet, &parts.upstream, prefill)
                .await
                .map_err(|e| fail_p(LegError::KvHandoff(e.to_string())))?;
            let host = url_host(&parts.cfg.engines[prefill].url).ok_or_else(|| {
                fail_p(LegError::KvHandoff("prefill engine URL has no host".into()))
            })?;
            let room: u64 = rand::rng().random::<u64>() >> 1;
            let rv = Rendezvous { host, port, room };
            let (pbody, dbody) = sglang_bodies(&ctx.v.body, &rv, &base, chat);
            let up = parts.upstream.clone();
            let purl = url(prefill);
            let limit = (now + secs(parts.cfg.serving.prefill_timeout_s)).min(ctx.deadline);
            let task_parts = parts.clone();
            ctx.track.dispatched(prefill, Phase::Prefill);
            ctx.track.dispatched(decode, Phase::Decode);
            parts.accounting.prefill_dispatched();
            parts.accounting.decode_dispatched();
            let pspan = tracing::info_span!("prefill", engine = %parts.cfg.engines[prefill].iid);
            let mut ptask = AbortOnDrop(tokio::spawn(
                async move {
                    let _seat = seat_p;
                    let t0 = task_parts.clock.now();
                    let r = up.sglang_prefill(&purl, &pbody, limit).await;
                    if r.is_ok() {
                        let prefill_s = (task_parts.clock.now() - t0).as_secs_f64();
                        task_parts.accounting.prefill_time(prefill_s);
                        task_parts.fleet.observe(prefill, Observation::PrefillOk);
                    }
                    r
                }
                .instrument(pspan),
            ));
            let first_by =
                (now + first_token_limit(parts).min(Duration::from_secs(30))).min(ctx.deadline);
            let durl = url(decode);
            let drid = format!("{base}-decode");
            let dfut = parts
                .upstream
                .decode(&durl, &drid, &dbody, opts, first_by)
                .instrument(tracing::info_span!("decode", engine = %parts.cfg.engines[decode].iid));
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
                            Ok(live) => {
                                ctx.track.first_token();
                                Ok(Started { live, _seat: seat_d, _prefill_task: Some(ptask), decode_iid: decode, producer: Some(prefill), decode_at: now, track: ctx.track.clone() })
                            }
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

/// A predictive refusal counts one failed, undispatched attempt (controller-notes 10.7).
fn refused_attempt(parts: &Parts, pending: &mut Pending, failure: &RequestFailure, attempt: u32) {
    if let RequestFailure::Refused(r) = failure {
        parts.accounting.attempt_failed(Phase::Prefill, r.cause);
        pending.record().attempt_failures.push(serde_json::json!({
            "attempt": attempt, "phase": "prefill", "iid": null, "reason": r.cause,
            "error": r.message, "transient": false, "retry_reason": "not_dispatched",
        }));
    }
}

fn first_token_limit(parts: &Parts) -> Duration {
    parts.cfg.first_token_timeout()
}

fn gap(parts: &Parts) -> Option<Duration> {
    let g = parts.cfg.engine.decode_read_timeout_s;
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

fn finish_record(parts: &Parts, pending: &mut Pending, started: &Started, clock: &TokenClock) {
    let live = &started.live;
    let rec = pending.record();
    rec.output_len = live.tokens();
    rec.tpot_s = clock.tpot();
    let decode_s = (parts.clock.now() - started.decode_at).as_secs_f64();
    parts.accounting.decode_finished(decode_s, live.tokens());
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
    parts: &Parts,
    mut started: Started,
    pending: &mut Pending,
    sink: &mut impl Sink,
    deadline: Instant,
    first_at: Instant,
) -> Relayed {
    let streaming = pending.record_ref().stream;
    let mut clock = TokenClock::new(first_at, started.live.tokens());
    started.track.tokens(started.live.tokens());
    let end = 'relay: {
        for c in std::mem::take(&mut started.live.first) {
            if !sink.deliver(&c, deadline).await {
                break 'relay Relayed::ClientGone;
            }
        }
        let gap = gap(parts);
        loop {
            let step = tokio::select! {
                () = sink.gone() => break 'relay Relayed::ClientGone,
                _ = tokio::time::sleep_until(deadline.into()) => {
                    let expiry = if streaming { Expiry::AfterOutput } else { Expiry::Collecting };
                    break 'relay Relayed::Failed(RequestFailure::Expired(expiry));
                }
                s = started.live.next(gap) => s,
            };
            clock.update(parts.clock.now(), started.live.tokens());
            started.track.tokens(started.live.tokens());
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
                    parts
                        .fleet
                        .observe(started.decode_iid, Observation::DecodeOk);
                    break 'relay Relayed::Done {
                        prompt_tokens: started.live.prompt_tokens(),
                        tokens: started.live.tokens(),
                    };
                }
                Ok(RelayStep::Failed(f)) => LegError::Stream(f),
                Err(e) => e,
            };
            if let Some(class) = err.class(Phase::Decode) {
                parts.fleet.observe_leg_failure(
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
    finish_record(parts, pending, &started, &clock);
    end
}
