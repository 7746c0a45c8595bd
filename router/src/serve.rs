//! The completion pipeline (behaviour.md 1.8, 7.1–7.7a): ingress → seat → attempts
//! (placement, prefill leg, decode leg until the first token, retries) → relay → settle.
//!
//! ```text
//!  POST /v1/(chat/)completions
//!    offered+1 ─ retained limit (429) ─ readiness (503) ─ bounded body (413, 408) ─ ingress (400/404)
//!    ─ admission seat (429/504) ─ attempts under the request deadline (504)
//!        one sub-request per prompt (a prompt batch is fanned out: its own descriptor each)
//!        plan ─► vLLM: prefill ─► descriptor ─► decode     SGLang: prefill ∥ decode (rendezvous)
//!                        └─► finished in the prefill (EOS, stop) ─► that answer
//!              aggregated: streaming client ─► decode stream; non-streaming ─► whole answer
//!        failure before output & transient & budget ─► backoff ─► next attempt (avoid failed)
//!    ─ first output ─► streaming: 200 SSE, relay task        non-streaming: collect, one object
//! ```
//!
//! Request shapes the split cannot serve exactly are never garbled (docs/http-api.md): a
//! batch of prompts is fanned out (each prompt its own prefill, descriptor and decode,
//! answered as choice `k`); a request for prompt logprobs is served unsplit on the decode
//! engine (vLLM, where every engine is `kv_both`) or refused 400 naming the field (SGLang).
//!
//! Cancellation: the handler future owns every leg and the [`Pending`] guard. When hyper drops
//! it (client gone) the legs' connections close and the guard settles `cancelled`. After the
//! response starts, the relay task owns them and watches the client channel. A graceful
//! shutdown whose budget ran out ([`crate::readiness::Gate::end_requests`]) ends every request
//! still running: before output 503, after output the error frame; settled `failed/shutdown`.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use rand::Rng;
use serde_json::{Map, Value, json};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tracing::Instrument;

use crate::bootstrap;
use crate::breaker::Observation;
use crate::config::{Backend, secs};
use crate::controller::Track;
use crate::failure::{Expiry, RequestFailure};
use crate::fleet::Resident;
use crate::ingress::{self, Endpoint, IngressError, Validated};
use crate::outcome::{Pending, RequestRecord, SettleSink, Settlement};
use crate::parts::Parts;
use crate::placement::{self, Phase, Plan};
use crate::relay::{
    Aggregator, Head, RelayOptions, RelayStep, answer_chunks, data_frame, done_frame, reindex,
    sanitize_answer, sum_usages, usage_value,
};
use crate::response::{Body, json_response};
use crate::retry::{self, Decision, RetryPolicy, Stop};
use crate::upstream::{
    LegError, LegId, LiveStream, Prefilled, Rendezvous, decode_body, sglang_bodies, url_host,
    vllm_prefill_body, whole_body,
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

/// Maps a leg's error to the attempt's failure of `phase` on engine `iid` (`producer`: the
/// attempt's producer, when its decode leg failed).
fn leg_failed(phase: Phase, iid: usize, producer: Option<usize>) -> impl FnOnce(LegError) -> Fail {
    move |err| Fail {
        phase,
        iid,
        err,
        producer,
    }
}

/// What a started attempt produced. One per prompt, moved, never stored in bulk: boxing the
/// stream would only add an allocation per request.
#[allow(clippy::large_enum_variant)]
enum Output {
    /// A decode stream that produced its first output.
    Live(LiveStream),
    /// A whole answer: a non-streaming client's request on an aggregated engine, or a vLLM
    /// prefill that already finished the generation (its one token was EOS or ended a stop
    /// string).
    Whole(Value),
}

/// An attempt that reached its first output.
struct Started {
    out: Output,
    _seat: Option<Resident>,
    _prefill_task: Option<AbortOnDrop>,
    /// The engine whose answer this is.
    served_by: usize,
    /// The breaker hears `DecodeOk` from `served_by` when the answer completes (not for a
    /// prefill's finished answer: it heard `PrefillOk`).
    decode_ok: bool,
    /// The prefill engine whose KV the decode consumes (`None` for an aggregated leg).
    producer: Option<usize>,
    /// When the serving leg was dispatched (for `upstream_seconds.decode`).
    decode_at: Instant,
    /// The role controller's bookkeeping of this request (token gaps).
    track: Track,
}

impl Started {
    /// An answer served by `engine` alone, without a producer: an aggregated leg
    /// (`decode_ok`), or a prefill that finished the generation.
    fn single(
        out: Output,
        seat: Option<Resident>,
        engine: usize,
        decode_ok: bool,
        at: Instant,
        track: Track,
    ) -> Started {
        Started {
            out,
            _seat: seat,
            _prefill_task: None,
            served_by: engine,
            decode_ok,
            producer: None,
            decode_at: at,
            track,
        }
    }
}

/// One prompt of a request: the request itself, or prompt `k` of a fanned-out batch.
struct Sub<'a> {
    /// The prompt's index in the batch (`None`: not a batch).
    k: Option<usize>,
    /// The body its legs are built from.
    body: Cow<'a, Map<String, Value>>,
    /// Its estimated prompt tokens (the usage estimate when the engine gives none).
    input_len: u64,
}

/// What every step of one request needs.
struct Ctx<'a> {
    parts: &'a Arc<Parts>,
    endpoint: Endpoint,
    v: &'a Validated,
    rid: &'a str,
    deadline: Instant,
}

/// The attempts of one request (all its prompts), copied into its record: kept outside the
/// record so a batch's prompts can run their attempts concurrently.
#[derive(Debug, Default)]
struct AttemptLog {
    attempts: u32,
    prefill_iid: Option<String>,
    decode_iid: Option<String>,
    failures: Vec<Value>,
    legs: Vec<Value>,
    /// The latest TTFT price at placement (controller.md 11.2 `admission_price`).
    admission_price: Option<Value>,
}

impl AttemptLog {
    fn lock(log: &Mutex<AttemptLog>) -> std::sync::MutexGuard<'_, AttemptLog> {
        log.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn into_record(self, rec: &mut RequestRecord) {
        rec.attempts = self.attempts;
        rec.prefill_iid = self.prefill_iid;
        rec.decode_iid = self.decode_iid;
        rec.attempt_failures = self.failures;
        rec.legs = self.legs;
        rec.admission_price = self.admission_price;
    }
}

/// How the answer is built once output started.
struct Answering {
    chat: bool,
    include_usage: bool,
    return_token_ids: bool,
    chars_per_token: f64,
    /// Per prompt: the estimated prompt tokens.
    estimates: Vec<u64>,
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

/// Marks an answer sent before the request body was read to its end: the connection cannot
/// carry another request (its unread body would be read as one), so the client is told to
/// open a new one instead of finding it closed.
fn closing(mut r: Response<Body>) -> Response<Body> {
    r.headers_mut()
        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    r
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
        return closing(fail(pending, RequestFailure::InflightLimit));
    };

    let readiness = parts.gate.readiness();
    if !readiness.ready {
        let no_engines = readiness.control_ready
            && parts.gate.lifecycle_hold().is_none()
            && parts.fleet.live_count() == 0;
        let reason = readiness.reason;
        return closing(fail(
            pending,
            RequestFailure::NotReady { reason, no_engines },
        ));
    }

    let limit = parts.cfg.serving.max_request_bytes;
    let body_by = (arrived + secs(parts.cfg.serving.body_read_timeout_s)).min(deadline);
    let read = tokio::time::timeout_at(body_by.into(), read_body(req.into_body(), limit)).await;
    let bytes = match read {
        // A client that cannot deliver its body within the request deadline.
        Err(_) if body_by == deadline => {
            return closing(fail(pending, RequestFailure::Expired(Expiry::BodyRead)));
        }
        // A client that stalls mid-body: bounded on its own, well before the deadline.
        Err(_) => {
            let limit_s = parts.cfg.serving.body_read_timeout_s;
            return closing(fail(pending, RequestFailure::BodyTimeout { limit_s }));
        }
        Ok(Ok(b)) => b,
        Ok(Err(ReadError::TooLarge)) => {
            let e = ingress::IngressError::TooLarge { limit };
            return closing(fail(pending, RequestFailure::Invalid(e)));
        }
        Ok(Err(ReadError::Client(detail))) => {
            tracing::debug!(%detail, "client body read failed");
            return closing(fail(pending, RequestFailure::BodyUnreadable));
        }
    };
    let v = match ingress::validate(
        endpoint,
        &bytes,
        &parts.cfg.model,
        parts.cfg.backend,
        parts.cfg.engine.chars_per_token,
    )
    .and_then(|v| {
        ingress::check_batch(&v, parts.cfg.serving.max_batch_prompts)?;
        Ok(v)
    }) {
        Ok(v) => v,
        Err(e) => return fail(pending, RequestFailure::Invalid(e)),
    };
    pending.record().stream = v.stream;
    let input_len = parts.controller.size(&track, &v).await;
    pending.record().input_len = Some(input_len);

    // Admission seat (FIFO queue bounded by queue_timeout_s when queue_capacity > 0; queued
    // requests are re-priced under predictive admission: controller.md 10.1).
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
            refused_attempt(
                &parts,
                &mut pending.record().attempt_failures,
                &failure,
                1,
                None,
            );
            return fail(pending, failure);
        }
    };

    let subs = subs_of(&v, parts.cfg.engine.chars_per_token);
    // The controller's bookkeeping per prompt: the request's own, or one per batch prompt.
    let tracks: Vec<Track> = match subs.as_slice() {
        [one] if one.k.is_none() => vec![track.clone()],
        _ => subs.iter().map(|s| track.prompt(s.input_len)).collect(),
    };
    let answering = Answering {
        chat: endpoint == Endpoint::Chat,
        include_usage: v.include_usage,
        return_token_ids: v.return_token_ids,
        chars_per_token: parts.cfg.engine.chars_per_token,
        estimates: subs.iter().map(|s| s.input_len).collect(),
    };
    let ctx = Ctx {
        parts: &parts,
        endpoint,
        v: &v,
        rid: &rid,
        deadline,
    };
    let log = Mutex::new(AttemptLog::default());
    let outcome = tokio::select! {
        o = tokio::time::timeout_at(deadline.into(), start_all(&ctx, &subs, &tracks, &log)) => Some(o),
        () = parts.gate.requests_ended() => None,
    };
    std::mem::take(&mut *AttemptLog::lock(&log)).into_record(pending.record());
    let Some(outcome) = outcome else {
        return fail(pending, RequestFailure::ShutDown { streaming: false });
    };
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
    drop(subs);
    drop(tracks);
    let first_token_at = parts.clock.now();
    {
        let rec = pending.record();
        rec.ttft_s = Some((first_token_at - arrived).as_secs_f64());
        rec.output_started = v.stream;
    }
    if v.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let task_parts = parts.clone();
        let span = tracing::Span::current();
        tokio::spawn(
            async move {
                let _held = (retained, permit, track);
                let end = stream_all(
                    &task_parts,
                    started,
                    &tx,
                    deadline,
                    first_token_at,
                    &answering,
                )
                .await;
                finish_record(&mut pending, &end.stats);
                match end.relayed {
                    Relayed::Done => {
                        if let Some(chunk) = end.usage_chunk {
                            finish_frame(&tx, chunk).await;
                        }
                        finish_frame(&tx, done_frame()).await;
                        pending.settle(Settlement::completed());
                    }
                    // Client gone (or too slow): `pending` settles on drop.
                    Relayed::ClientGone => {}
                    Relayed::Failed(failure) => {
                        if let Some(frame) = failure.stream_frame() {
                            finish_frame(&tx, frame).await;
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
        let end = collect_all(&parts, started, deadline, first_token_at, &answering).await;
        drop(permit);
        drop(retained);
        finish_record(&mut pending, &end.stats);
        match end.answer {
            Ok(answer) => {
                pending.settle(Settlement::completed());
                json_response(StatusCode::OK, &answer, &rid)
            }
            Err(failure) => fail(pending, failure),
        }
    }
}

/// The request's prompts: one per prompt of a batch (each with `prompt` set to it), else the
/// request itself.
fn subs_of(v: &Validated, chars_per_token: f64) -> Vec<Sub<'_>> {
    match ingress::batch_prompts(v) {
        Some(prompts) => prompts
            .iter()
            .enumerate()
            .map(|(k, p)| {
                let mut body = v.body.clone();
                body.insert("prompt".into(), p.clone());
                Sub {
                    k: Some(k),
                    body: Cow::Owned(body),
                    input_len: ingress::size_prompt(p, chars_per_token),
                }
            })
            .collect(),
        None => vec![Sub {
            k: None,
            body: Cow::Borrowed(&v.body),
            input_len: v.input_len,
        }],
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

/// Runs every prompt's attempts until each reached its first output; the first failure ends
/// them all (dropping the others closes their legs).
async fn start_all(
    ctx: &Ctx<'_>,
    subs: &[Sub<'_>],
    tracks: &[Track],
    log: &Mutex<AttemptLog>,
) -> Result<Vec<Started>, RequestFailure> {
    if let ([one], [track]) = (subs, tracks) {
        return attempts(ctx, one, track, log).await.map(|s| vec![s]);
    }
    let each = subs
        .iter()
        .zip(tracks)
        .map(|(s, t)| attempts(ctx, s, t, log));
    futures_util::future::try_join_all(each).await
}

/// The plan an attempt runs. A request for prompt logprobs is never split (docs/http-api.md):
/// only the engine that prefills the prompt can compute them (vLLM marks such a
/// request `skip_reading_prefix_cache` in `SamplingParams`, so it recomputes the whole prompt
/// instead of reading cached KV), and a vLLM decode engine given a KV descriptor with
/// `prompt_logprobs` (or `echo` with logprobs, which `to_sampling_params` turns into prompt
/// logprobs) fails. vLLM
/// serves it unsplit on the planned decode engine (every vLLM engine is `kv_both`); an SGLang
/// decode server cannot run a request alone, so SGLang refuses it with a 400 naming the
/// field.
fn shape_plan(plan: Plan, v: &Validated, backend: Backend) -> Result<Plan, RequestFailure> {
    match (plan, v.prompt_logprobs) {
        (Plan::Split { decode, .. }, Some(_)) if backend == Backend::Vllm => {
            Ok(Plan::Aggregated { engine: decode })
        }
        (Plan::Split { .. }, Some(field)) => {
            Err(RequestFailure::Invalid(IngressError::Unsplittable {
                field,
            }))
        }
        (plan, _) => Ok(plan),
    }
}

/// Run attempts until one reaches its first output (behaviour.md 7.5).
async fn attempts(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    track: &Track,
    log: &Mutex<AttemptLog>,
) -> Result<Started, RequestFailure> {
    let parts = ctx.parts;
    let policy = RetryPolicy::from_serving(&parts.cfg.serving);
    let mut avoid: BTreeSet<usize> = BTreeSet::new();
    let mut n = 0u32;
    loop {
        n += 1;
        // A fenced router places nothing, not even a retry (behaviour.md 3.4): the body
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
        let plan = shape_plan(plan, ctx.v, parts.cfg.backend)?;
        // The TTFT price at placement (controller.md 10.4): journalled, and under
        // predictive admission a first attempt over budget is refused undispatched.
        match parts
            .controller
            .admit(track, plan, n, || parts.accounting.unserved_placement())
        {
            Ok(price) => AttemptLog::lock(log).admission_price = price,
            Err(refusal) => {
                let failure = RequestFailure::Refused(refusal);
                let mut log = AttemptLog::lock(log);
                if let RequestFailure::Refused(r) = &failure {
                    log.admission_price = Some(r.price.json());
                }
                refused_attempt(parts, &mut log.failures, &failure, n, sub.k);
                return Err(failure);
            }
        }
        {
            let mut log = AttemptLog::lock(log);
            log.attempts = log.attempts.max(n);
            let name = |i: usize| Some(parts.cfg.engines[i].iid.clone());
            match plan {
                Plan::Split { prefill, decode } => {
                    log.prefill_iid = name(prefill);
                    log.decode_iid = name(decode);
                }
                Plan::Aggregated { engine } => {
                    log.prefill_iid = None;
                    log.decode_iid = name(engine);
                }
            }
        }
        let producer = match plan {
            Plan::Split { prefill, .. } => Some(prefill),
            Plan::Aggregated { .. } => None,
        };
        let attempt_span = tracing::debug_span!("attempt", n);
        let producer_process = producer.map(|p| parts.fleet.incarnation(p));
        let result = run_attempt(ctx, sub, track, n, plan, log)
            .instrument(attempt_span)
            .await;
        let f = match result {
            Ok(s) => return Ok(s),
            Err(f) => f,
        };
        track.attempt_ended();
        // Breaker and accounting for the failed leg, charged to the engine that caused it.
        match f.err.class(f.phase) {
            Some(class) => charge(parts, &f, class, producer, producer_process),
            None => parts.fleet.observe(f.iid, Observation::ClientFault),
        }
        if f.phase == Phase::Decode && matches!(f.err, LegError::FirstTokenTimeout) {
            // A consolidation-risk event (behaviour.md 9), carried in the handoff.
            parts
                .demand
                .lock()
                .record("first_token_timeout", parts.clock.now());
        }
        parts.accounting.attempt_failed(f.phase, f.err.reason());
        let engine = parts.cfg.engines[f.iid].iid.clone();
        tracing::warn!(engine.id = %engine, phase = f.phase.as_str(), error = %f.err.detail(), attempt = n, "attempt failed");
        AttemptLog::lock(log).failures.push(json!({
            "attempt": n, "phase": f.phase.as_str(), "iid": engine, "reason": f.err.reason(),
            "error": f.err.detail(), "prompt": sub.k,
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

/// Charges a failed leg to the engine that caused it: a decode that failed
/// after its producer's process changed (a restart seen meanwhile) is the old producer's
/// failure, not the decode's; a decode that failed in a way a lost transfer explains
/// (`inference_status`, `stream`) is checked against its producer first
/// (`bootstrap::blame_producer`: another SGLang bootstrap port, other process facts, or an
/// unreachable producer), off the request path.
fn charge(
    parts: &Arc<Parts>,
    f: &Fail,
    class: crate::breaker::FailureClass,
    producer: Option<usize>,
    producer_process: Option<u64>,
) {
    use crate::breaker::FailureClass as C;
    let decode_with_producer = (f.phase == Phase::Decode)
        .then_some(producer.zip(producer_process))
        .flatten();
    match decode_with_producer {
        Some((p, process)) if parts.fleet.incarnation(p) != process => {
            tracing::info!(producer = %parts.cfg.engines[p].iid, "decode failure charged to the producer's previous process, not to the decode");
        }
        Some((p, process)) if matches!(class, C::InferenceStatus | C::Stream) => {
            let parts = parts.clone();
            let decode = f.iid;
            let used = parts.fleet.bootstrap_port(p);
            let at = parts.clock.now();
            tokio::spawn(async move {
                let (cfg, fleet, up) = (&parts.cfg, &parts.fleet, &parts.upstream);
                if bootstrap::blame_producer(cfg, fleet, up, p, used, process, at).await {
                    fleet.observe_leg_failure(decode, Phase::Decode, class, Some(p));
                }
            });
        }
        _ => parts
            .fleet
            .observe_leg_failure(f.iid, f.phase, class, producer),
    }
}

fn relay_options(ctx: &Ctx<'_>, sub: &Sub<'_>) -> RelayOptions {
    RelayOptions {
        return_token_ids: ctx.v.return_token_ids,
        max_response_bytes: ctx.parts.cfg.serving.max_response_bytes,
        collect: !ctx.v.stream,
        // A streaming client gets prompt k's choices as choice k from the relay itself; a
        // non-streaming batch is merged (and reindexed) once every answer is whole.
        index_base: if ctx.v.stream {
            sub.k.map(|k| k as u64)
        } else {
            None
        },
        capture_head: ctx.v.stream && ctx.v.include_usage,
    }
}

/// A new leg id for leg `leg` of attempt `n` on engine `iid`, recorded in the journal's
/// `legs`.
fn new_leg(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    n: u32,
    leg: &str,
    iid: usize,
    log: &Mutex<AttemptLog>,
) -> LegId {
    let id = LegId::new(ctx.rid, sub.k, n, leg);
    AttemptLog::lock(log).legs.push(json!({
        "attempt": n, "leg": leg, "iid": ctx.parts.cfg.engines[iid].iid,
        "request_id": id.id, "prompt": sub.k,
    }));
    id
}

async fn run_attempt(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    track: &Track,
    n: u32,
    plan: Plan,
    log: &Mutex<AttemptLog>,
) -> Result<Started, Fail> {
    let parts = ctx.parts;
    let path = ctx.endpoint.path();
    let url = |i: usize| format!("{}{}", parts.cfg.engines[i].url, path);
    let opts = relay_options(ctx, sub);
    let now = parts.clock.now();
    let sglang = parts.cfg.backend == Backend::Sglang;
    let chat = ctx.endpoint == Endpoint::Chat;
    match plan {
        Plan::Aggregated { engine } => {
            // A non-streaming client's request goes to the engine non-streaming (a whole leg):
            // the answer, its usage and its errors are the engine's (docs/deviations.md).
            let whole = !ctx.v.stream;
            let seat = parts.fleet.resident(engine, Phase::Decode);
            let leg = new_leg(
                ctx,
                sub,
                n,
                if whole { "whole" } else { "decode" },
                engine,
                log,
            );
            track.dispatched(engine, Phase::Decode);
            let mut body = if whole {
                whole_body(&sub.body)
            } else {
                decode_body(&sub.body, None, !(sglang && chat))
            };
            if sglang {
                body["rid"] = Value::String(leg.id.clone());
            }
            parts.accounting.decode_dispatched();
            let span =
                tracing::info_span!("decode", engine = %parts.cfg.engines[engine].iid, whole);
            let failed = leg_failed(Phase::Decode, engine, None);
            let engine_url = url(engine);
            let out = if whole {
                let limit = parts.cfg.serving.max_response_bytes;
                let answer =
                    parts
                        .upstream
                        .whole(&engine_url, &leg, &body, ctx.deadline, limit, chat);
                let answer = answer.instrument(span).await.map_err(failed)?;
                track.first_token();
                Output::Whole(answer)
            } else {
                let first_by = (now + first_token_limit(parts)).min(ctx.deadline);
                let live = parts
                    .upstream
                    .decode(&engine_url, &leg, &body, opts, first_by);
                let live = live.instrument(span).await.map_err(failed)?;
                track.first_token();
                Output::Live(live)
            };
            Ok(Started::single(
                out,
                Some(seat),
                engine,
                true,
                now,
                track.clone(),
            ))
        }
        Plan::Split { prefill, decode } if !sglang => {
            // Both engines count as resident from placement on: the decode engine is committed
            // to this request while its prefill runs, and the producer holds the KV until the
            // decode has pulled it. A drain of either waits for this request
            // (handoff-and-lifecycle.md, "Draining engines"; `ready_to_stop` must not turn true
            // under it).
            let seat_p = parts.fleet.resident(prefill, Phase::Prefill);
            let seat = parts.fleet.resident(decode, Phase::Decode);
            track.dispatched(prefill, Phase::Prefill);
            parts.accounting.prefill_dispatched();
            let limit = (now + secs(parts.cfg.serving.prefill_timeout_s)).min(ctx.deadline);
            let t0 = parts.clock.now();
            let pleg = new_leg(ctx, sub, n, "prefill", prefill, log);
            let prefilled = parts
                .upstream
                .vllm_prefill(
                    &url(prefill),
                    &pleg,
                    &vllm_prefill_body(&sub.body),
                    limit,
                    ctx.v.max_tokens,
                )
                .instrument(
                    tracing::info_span!("prefill", engine = %parts.cfg.engines[prefill].iid),
                )
                .await
                .map_err(leg_failed(Phase::Prefill, prefill, None))?;
            parts
                .accounting
                .prefill_time((parts.clock.now() - t0).as_secs_f64());
            parts.fleet.observe(prefill, Observation::PrefillOk);
            let desc = match prefilled {
                Prefilled::Descriptor(d) => d,
                Prefilled::Finished(answer) => {
                    // The generation ended in the prefill (EOS or a stop string): that answer
                    // is the request's, and no decode leg runs (docs/http-api.md).
                    AttemptLog::lock(log).decode_iid = None;
                    track.first_token();
                    return Ok(Started::single(
                        Output::Whole(answer),
                        None,
                        prefill,
                        false,
                        t0,
                        track.clone(),
                    ));
                }
            };
            if let Some(id) = desc.get("remote_engine_id").and_then(Value::as_str) {
                parts.fleet.note_engine_id(prefill, id);
            }
            let decode_at = parts.clock.now();
            track.dispatched(decode, Phase::Decode);
            parts.accounting.decode_dispatched();
            let body = decode_body(&sub.body, (decode != prefill).then_some(&desc), true);
            let first_by = (parts.clock.now() + first_token_limit(parts)).min(ctx.deadline);
            let dleg = new_leg(ctx, sub, n, "decode", decode, log);
            let live = parts
                .upstream
                .decode(&url(decode), &dleg, &body, opts, first_by)
                .instrument(tracing::info_span!("decode", engine = %parts.cfg.engines[decode].iid))
                .await
                .map_err(leg_failed(Phase::Decode, decode, Some(prefill)));
            // The decode has its first token: the KV left the producer.
            drop(seat_p);
            let live = live?;
            track.first_token();
            Ok(Started {
                out: Output::Live(live),
                _seat: Some(seat),
                _prefill_task: None,
                served_by: decode,
                decode_ok: true,
                producer: Some(prefill),
                decode_at,
                track: track.clone(),
            })
        }
        Plan::Split { prefill, decode } => {
            // SGLang: reserve both before either leg starts (behaviour.md 7.2 step 1).
            let seat_p = parts.fleet.resident(prefill, Phase::Prefill);
            let seat_d = parts.fleet.resident(decode, Phase::Decode);
            let fail_p = |err| leg_failed(Phase::Prefill, prefill, None)(err);
            let port = bootstrap::port(&parts.cfg, &parts.fleet, &parts.upstream, prefill)
                .await
                .map_err(|e| fail_p(LegError::KvHandoff(e.to_string())))?;
            let host = url_host(&parts.cfg.engines[prefill].url).ok_or_else(|| {
                fail_p(LegError::KvHandoff("prefill engine URL has no host".into()))
            })?;
            let room: u64 = rand::rng().random::<u64>() >> 1;
            let rv = Rendezvous { host, port, room };
            let pleg = new_leg(ctx, sub, n, "prefill", prefill, log);
            let dleg = new_leg(ctx, sub, n, "decode", decode, log);
            let (pbody, dbody) = sglang_bodies(&sub.body, &rv, &pleg, &dleg, chat);
            let up = parts.upstream.clone();
            let purl = url(prefill);
            let limit = (now + secs(parts.cfg.serving.prefill_timeout_s)).min(ctx.deadline);
            let task_parts = parts.clone();
            track.dispatched(prefill, Phase::Prefill);
            track.dispatched(decode, Phase::Decode);
            parts.accounting.prefill_dispatched();
            parts.accounting.decode_dispatched();
            let pspan = tracing::info_span!("prefill", engine = %parts.cfg.engines[prefill].iid);
            let mut ptask = AbortOnDrop(tokio::spawn(
                async move {
                    let _seat = seat_p;
                    let t0 = task_parts.clock.now();
                    let r = up.sglang_prefill(&purl, &pleg, &pbody, limit).await;
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
            let dfut = parts
                .upstream
                .decode(&durl, &dleg, &dbody, opts, first_by)
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
                                track.first_token();
                                Ok(Started { out: Output::Live(live), _seat: Some(seat_d), _prefill_task: Some(ptask), served_by: decode, decode_ok: true, producer: Some(prefill), decode_at: now, track: track.clone() })
                            }
                            Err(err) => {
                                // A failed prefill usually fails the waiting decode too, and the
                                // two answers race: give the prefill a moment so its error (often
                                // the client's fault, e.g. 400 context length) is the one reported
                                // (behaviour.md 7.2 step 4).
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

/// A predictive refusal counts one failed, undispatched attempt (controller.md 10.7),
/// recorded in `failures` (the journal's `attempt_failures`; `prompt`: its index in a batch).
fn refused_attempt(
    parts: &Parts,
    failures: &mut Vec<Value>,
    failure: &RequestFailure,
    attempt: u32,
    prompt: Option<usize>,
) {
    if let RequestFailure::Refused(r) = failure {
        parts.accounting.attempt_failed(Phase::Prefill, r.cause);
        failures.push(json!({
            "attempt": attempt, "phase": "prefill", "iid": null, "reason": r.cause,
            "error": r.message, "transient": false, "retry_reason": "not_dispatched",
            "prompt": prompt,
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

/// What one prompt's answer contributes to the request's record.
#[derive(Debug, Clone, Copy, Default)]
struct SubStats {
    /// Generated tokens (the engine's count when it gave one).
    tokens: u64,
    /// Mean gap between streamed tokens after the first, seconds.
    tpot: Option<f64>,
}

fn finish_record(pending: &mut Pending, stats: &[SubStats]) {
    let rec = pending.record();
    rec.output_len = stats.iter().map(|s| s.tokens).sum();
    let tpots: Vec<f64> = stats.iter().filter_map(|s| s.tpot).collect();
    rec.tpot_s = (!tpots.is_empty()).then(|| tpots.iter().sum::<f64>() / tpots.len() as f64);
}

/// Where relayed chunks go: a streaming client's channel, or the [`Aggregator`] that builds a
/// non-streaming client's one response object.
trait Sink {
    /// Delivers relayed SSE frames; `false` when the client is gone or too slow (it has
    /// until `deadline` to take them).
    fn deliver(&mut self, frames: Bytes, deadline: Instant) -> impl Future<Output = bool> + Send;
    /// Resolves when the client went away (never for a non-streaming client, whose handler
    /// future hyper drops instead).
    fn gone(&self) -> impl Future<Output = ()> + Send;
}

/// A streaming client: SSE frames over the response body's channel. For a whole answer
/// (a prefill that finished the generation), `base` shifts choice indexes for prompt `base`
/// of a fanned-out batch and `head` keeps its `id`, `created` and `model` for a usage chunk
/// the router writes itself (a live stream's relay does both itself).
struct Stream {
    tx: mpsc::Sender<Bytes>,
    base: Option<u64>,
    head: Option<Head>,
}

impl Stream {
    fn new(tx: &mpsc::Sender<Bytes>, base: Option<u64>) -> Stream {
        Stream {
            tx: tx.clone(),
            base,
            head: None,
        }
    }
}

impl Stream {
    /// Delivers a whole answer as the SSE chunks of a stream ([`answer_chunks`]).
    async fn deliver_whole(&mut self, answer: &Value, chat: bool, deadline: Instant) -> bool {
        let mut frames = Vec::new();
        for mut chunk in answer_chunks(answer, chat) {
            if let Some(base) = self.base {
                reindex(&mut chunk, base);
            }
            if self.head.is_none() {
                self.head = Some(Head::of(&chunk));
            }
            frames.extend_from_slice(&data_frame(&chunk));
        }
        self.deliver(Bytes::from(frames), deadline).await
    }
}

impl Sink for Stream {
    async fn deliver(&mut self, frames: Bytes, deadline: Instant) -> bool {
        // A client that stops reading must not hold its seats and the upstream past the
        // deadline.
        matches!(
            tokio::time::timeout_at(deadline.into(), self.tx.send(frames)).await,
            Ok(Ok(()))
        )
    }

    async fn gone(&self) {
        self.tx.closed().await;
    }
}

/// Sends a final frame (the usage chunk, `[DONE]` or the error frame), waiting at most
/// [`FINAL_FRAME_WAIT`] for a slow client.
async fn finish_frame(tx: &mpsc::Sender<Bytes>, frame: Bytes) {
    let _ = tokio::time::timeout(FINAL_FRAME_WAIT, tx.send(frame)).await;
}

impl Sink for Aggregator {
    async fn deliver(&mut self, frames: Bytes, _deadline: Instant) -> bool {
        self.push_frames(&frames);
        true
    }

    async fn gone(&self) {
        std::future::pending::<()>().await;
    }
}

/// How a relay ended.
enum Relayed {
    /// `[DONE]` after output.
    Done,
    /// The client went away (or stopped reading): `pending` settles on drop.
    ClientGone,
    /// The deadline passed, the stream failed after the first output, or the shutdown
    /// budget ran out.
    Failed(RequestFailure),
}

/// How long a final frame (`[DONE]` or the error frame) may wait for a slow client.
const FINAL_FRAME_WAIT: Duration = Duration::from_secs(1);

/// The engines and timing of one started answer, without its output.
struct Served {
    served_by: usize,
    decode_ok: bool,
    producer: Option<usize>,
    decode_at: Instant,
    /// The role controller's bookkeeping of this prompt (token gaps, completion).
    track: Track,
}

/// Splits a started answer into its output, what the relay needs to know, and the guards
/// (seat, SGLang prefill task) that must live until the answer ends.
fn split(s: Started) -> (Output, Served, Guards) {
    let served = Served {
        served_by: s.served_by,
        decode_ok: s.decode_ok,
        producer: s.producer,
        decode_at: s.decode_at,
        track: s.track,
    };
    (s.out, served, (s._seat, s._prefill_task))
}

/// The seat and SGLang prefill task of an answer being relayed.
type Guards = (Option<Resident>, Option<AbortOnDrop>);

/// Relays the rest of a started decode stream into `sink` until `[DONE]`, a failure, the
/// request deadline, the shutdown budget or the client's departure (behaviour.md 7.3),
/// feeding the breaker on the way. The one relay loop of both client kinds.
async fn relay(
    parts: &Parts,
    live: &mut LiveStream,
    served: &Served,
    sink: &mut impl Sink,
    deadline: Instant,
    first_at: Instant,
    streaming: bool,
) -> (Relayed, TokenClock) {
    let mut clock = TokenClock::new(first_at, live.tokens());
    served.track.tokens(live.tokens());
    let end = 'relay: {
        let first = std::mem::take(&mut live.first);
        if !first.is_empty() && !sink.deliver(first, deadline).await {
            break 'relay Relayed::ClientGone;
        }
        let gap = gap(parts);
        loop {
            let step = tokio::select! {
                () = sink.gone() => break 'relay Relayed::ClientGone,
                _ = tokio::time::sleep_until(deadline.into()) => {
                    let expiry = if streaming { Expiry::AfterOutput } else { Expiry::Collecting };
                    break 'relay Relayed::Failed(RequestFailure::Expired(expiry));
                }
                () = parts.gate.requests_ended() => {
                    break 'relay Relayed::Failed(RequestFailure::ShutDown { streaming });
                }
                s = live.next(gap) => s,
            };
            clock.update(parts.clock.now(), live.tokens());
            served.track.tokens(live.tokens());
            let err = match step {
                Ok(RelayStep::Output) => {
                    if !sink.deliver(live.take_output(), deadline).await {
                        break 'relay Relayed::ClientGone;
                    }
                    continue;
                }
                Ok(RelayStep::Hold) => continue,
                Ok(RelayStep::Done) => {
                    if served.decode_ok {
                        parts.fleet.observe(served.served_by, Observation::DecodeOk);
                    }
                    break 'relay Relayed::Done;
                }
                Ok(RelayStep::Failed(f)) => LegError::Stream(f),
                Err(e) => e,
            };
            if let Some(class) = err.class(Phase::Decode) {
                parts.fleet.observe_leg_failure(
                    served.served_by,
                    Phase::Decode,
                    class,
                    served.producer,
                );
            }
            tracing::warn!(error = %err.detail(), "decode stream failed after output");
            break 'relay Relayed::Failed(RequestFailure::Decode { err, streaming });
        }
    };
    (end, clock)
}

/// Tokens of a whole answer without usage, estimated from its text like a prompt.
fn estimate_tokens(answer: &Value, chars_per_token: f64) -> u64 {
    let chars: usize = answer
        .get("choices")
        .and_then(Value::as_array)
        .map(|choices| {
            choices
                .iter()
                .map(|c| {
                    c.get("text")
                        .or_else(|| c.pointer("/message/content"))
                        .and_then(Value::as_str)
                        .map_or(0, |t| t.chars().count())
                })
                .sum()
        })
        .unwrap_or(0);
    (chars as f64 / chars_per_token.max(0.1)).ceil() as u64
}

/// Prepares a whole answer for the client: cleaned ([`sanitize_answer`]), with the engine's
/// usage or an estimated one. Returns its generated tokens.
fn finish_whole(answer: &mut Value, a: &Answering, estimate: u64) -> u64 {
    sanitize_answer(answer, a.return_token_ids);
    let counted = estimate_tokens(answer, a.chars_per_token);
    let usage = usage_value(answer.get("usage"), estimate, counted);
    let tokens = usage
        .get("completion_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(counted);
    answer["usage"] = usage;
    tokens
}

/// One prompt's answer to a streaming client.
struct StreamOne {
    relayed: Relayed,
    stats: SubStats,
    /// This prompt's usage (the engine's, or estimated).
    usage: Value,
    /// The engine's usage-only chunk (its JSON), when it sent one.
    engine_chunk: Option<Bytes>,
    /// `id`, `created`, `model` of the first chunk sent.
    head: Option<Head>,
}

async fn stream_one(
    parts: &Parts,
    s: Started,
    mut sink: Stream,
    deadline: Instant,
    first_at: Instant,
    a: &Answering,
    estimate: u64,
) -> StreamOne {
    let (out, served, guards) = split(s);
    let one = match out {
        Output::Whole(mut answer) => {
            let tokens = finish_whole(&mut answer, a, estimate);
            served.track.tokens(tokens);
            let relayed = if sink.deliver_whole(&answer, a.chat, deadline).await {
                Relayed::Done
            } else {
                Relayed::ClientGone
            };
            if matches!(relayed, Relayed::Done) && served.decode_ok {
                parts.fleet.observe(served.served_by, Observation::DecodeOk);
            }
            StreamOne {
                relayed,
                stats: SubStats { tokens, tpot: None },
                usage: answer["usage"].take(),
                engine_chunk: None,
                head: sink.head.take(),
            }
        }
        Output::Live(mut live) => {
            let (relayed, clock) = relay(
                parts, &mut live, &served, &mut sink, deadline, first_at, true,
            )
            .await;
            let engine_chunk = live.take_usage_chunk();
            // Only a client that asked for usage gets one (the engine's, or the router's).
            let usage = if a.include_usage {
                usage_value(
                    live.engine_usage(engine_chunk.as_deref()).as_ref(),
                    estimate,
                    live.tokens(),
                )
            } else {
                Value::Null
            };
            StreamOne {
                relayed,
                stats: SubStats {
                    tokens: live.output_tokens(),
                    tpot: clock.tpot(),
                },
                usage,
                engine_chunk,
                head: sink.head.take().or_else(|| live.head().cloned()),
            }
        }
    };
    if matches!(one.relayed, Relayed::Done) {
        served.track.completed();
    }
    let decode_s = (parts.clock.now() - served.decode_at).as_secs_f64();
    parts.accounting.decode_finished(decode_s, one.stats.tokens);
    drop(guards);
    one
}

/// How a streaming answer ended.
struct StreamEnd {
    relayed: Relayed,
    /// The usage chunk's frame to send before `[DONE]` (only when the client asked for
    /// usage).
    usage_chunk: Option<Bytes>,
    stats: Vec<SubStats>,
}

/// The frame of a usage-only chunk the router writes (an engine that sent none, or a
/// fanned-out batch): the first chunk's `id`, `created` and `model` as the engine wrote them.
fn usage_chunk(head: Option<Head>, usage: &Value, chat: bool) -> Bytes {
    let head = head.unwrap_or(Head {
        id: "null".into(),
        created: "null".into(),
        model: "null".into(),
    });
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    Bytes::from(format!(
        "data: {{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[],\"usage\":{usage}}}\n\n",
        head.id, head.created, head.model
    ))
}

/// The SSE frame of an engine's own chunk (its JSON as it wrote it).
fn engine_frame(chunk: &[u8]) -> Bytes {
    let mut f = Vec::with_capacity(chunk.len() + 8);
    f.extend_from_slice(b"data: ");
    f.extend_from_slice(chunk);
    f.extend_from_slice(b"\n\n");
    Bytes::from(f)
}

/// Streams every prompt's answer to the client (one prompt: its own stream; a batch: the
/// prompts' streams interleaved, choice `k` for prompt `k`, the first failure ending all).
async fn stream_all(
    parts: &Parts,
    started: Vec<Started>,
    tx: &mpsc::Sender<Bytes>,
    deadline: Instant,
    first_at: Instant,
    a: &Answering,
) -> StreamEnd {
    if started.len() == 1 {
        let s = started.into_iter().next().expect("one started answer");
        let one = stream_one(
            parts,
            s,
            Stream::new(tx, None),
            deadline,
            first_at,
            a,
            a.estimates[0],
        )
        .await;
        let usage_chunk = (matches!(one.relayed, Relayed::Done) && a.include_usage).then(|| {
            match one.engine_chunk {
                Some(chunk) => engine_frame(&chunk),
                None => usage_chunk(one.head, &one.usage, a.chat),
            }
        });
        return StreamEnd {
            relayed: one.relayed,
            usage_chunk,
            stats: vec![one.stats],
        };
    }
    let n = started.len();
    let mut running: FuturesUnordered<_> = started
        .into_iter()
        .enumerate()
        .map(|(k, s)| {
            let sink = Stream::new(tx, Some(k as u64));
            async move {
                let one = stream_one(parts, s, sink, deadline, first_at, a, a.estimates[k]).await;
                (k, one)
            }
        })
        .collect();
    let mut done: Vec<Option<StreamOne>> = (0..n).map(|_| None).collect();
    while let Some((k, one)) = running.next().await {
        if !matches!(one.relayed, Relayed::Done) {
            // Dropping the others closes their decode legs.
            drop(running);
            let mut stats: Vec<SubStats> = done.iter().flatten().map(|o| o.stats).collect();
            stats.push(one.stats);
            return StreamEnd {
                relayed: one.relayed,
                usage_chunk: None,
                stats,
            };
        }
        done[k] = Some(one);
    }
    let done: Vec<StreamOne> = done.into_iter().flatten().collect();
    let usage_chunk = a.include_usage.then(|| {
        let usage = sum_usages(done.iter().map(|o| &o.usage));
        usage_chunk(done[0].head.clone(), &usage, a.chat)
    });
    StreamEnd {
        relayed: Relayed::Done,
        usage_chunk,
        stats: done.iter().map(|o| o.stats).collect(),
    }
}

/// How a non-streaming answer ended.
struct CollectEnd {
    answer: Result<Value, RequestFailure>,
    stats: Vec<SubStats>,
}

async fn collect_one(
    parts: &Parts,
    s: Started,
    deadline: Instant,
    first_at: Instant,
    a: &Answering,
    estimate: u64,
) -> (Result<Value, RequestFailure>, SubStats) {
    let (out, served, guards) = split(s);
    let (answer, stats) = match out {
        Output::Whole(mut answer) => {
            let tokens = finish_whole(&mut answer, a, estimate);
            served.track.tokens(tokens);
            if served.decode_ok {
                parts.fleet.observe(served.served_by, Observation::DecodeOk);
            }
            (Ok(answer), SubStats { tokens, tpot: None })
        }
        Output::Live(mut live) => {
            let mut agg = Aggregator::new(a.chat);
            let (relayed, clock) = relay(
                parts, &mut live, &served, &mut agg, deadline, first_at, false,
            )
            .await;
            let stats = SubStats {
                tokens: live.output_tokens(),
                tpot: clock.tpot(),
            };
            let answer = match relayed {
                Relayed::Done => {
                    let engine_chunk = live.take_usage_chunk();
                    let usage = usage_value(
                        live.engine_usage(engine_chunk.as_deref()).as_ref(),
                        estimate,
                        live.tokens(),
                    );
                    Ok(agg.finish(usage))
                }
                Relayed::Failed(failure) => Err(failure),
                // An `Aggregator` takes every chunk and never reports its client gone (hyper
                // drops this future instead, and `pending` settles on drop).
                Relayed::ClientGone => unreachable!("a non-streaming relay has no client to lose"),
            };
            (answer, stats)
        }
    };
    if answer.is_ok() {
        served.track.completed();
    }
    let decode_s = (parts.clock.now() - served.decode_at).as_secs_f64();
    parts.accounting.decode_finished(decode_s, stats.tokens);
    drop(guards);
    (answer, stats)
}

/// Collects every prompt's answer into one response object (a batch: choice `k` for prompt
/// `k`, usage summed; the first failure ends all).
async fn collect_all(
    parts: &Parts,
    started: Vec<Started>,
    deadline: Instant,
    first_at: Instant,
    a: &Answering,
) -> CollectEnd {
    if started.len() == 1 {
        let s = started.into_iter().next().expect("one started answer");
        let (answer, stats) = collect_one(parts, s, deadline, first_at, a, a.estimates[0]).await;
        return CollectEnd {
            answer,
            stats: vec![stats],
        };
    }
    let n = started.len();
    let mut running: FuturesUnordered<_> = started
        .into_iter()
        .enumerate()
        .map(|(k, s)| async move {
            let r = collect_one(parts, s, deadline, first_at, a, a.estimates[k]).await;
            (k, r)
        })
        .collect();
    let mut answers: Vec<Option<Value>> = (0..n).map(|_| None).collect();
    let mut stats = Vec::with_capacity(n);
    while let Some((k, (answer, st))) = running.next().await {
        stats.push(st);
        match answer {
            Ok(v) => answers[k] = Some(v),
            Err(failure) => {
                return CollectEnd {
                    answer: Err(failure),
                    stats,
                };
            }
        }
    }
    let answers: Vec<Value> = answers.into_iter().flatten().collect();
    CollectEnd {
        answer: Ok(merge_answers(answers)),
        stats,
    }
}

/// One response object for a fanned-out batch: the first answer's `id`, `object`, `created`
/// and `model`, every answer's choices with prompt `k`'s as index `k`, the usages summed.
fn merge_answers(answers: Vec<Value>) -> Value {
    let usage = sum_usages(answers.iter().filter_map(|a| a.get("usage")));
    let mut merged: Option<Value> = None;
    let mut choices = Vec::new();
    for (k, mut a) in answers.into_iter().enumerate() {
        reindex(&mut a, k as u64);
        if let Some(Value::Array(c)) = a.get_mut("choices").map(Value::take) {
            choices.extend(c);
        }
        merged.get_or_insert(a);
    }
    let mut merged = merged.unwrap_or_else(|| json!({}));
    merged["choices"] = Value::Array(choices);
    merged["usage"] = usage;
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validated(body: &str) -> Validated {
        ingress::validate(
            Endpoint::Completions,
            body.as_bytes(),
            "m",
            Backend::Vllm,
            4.0,
        )
        .expect("valid")
    }

    /// Prompt logprobs never cross a split: vLLM serves the request unsplit on the planned
    /// decode engine, SGLang refuses it naming the field; other requests keep their plan
    /// (docs/http-api.md).
    #[test]
    fn prompt_logprob_requests_are_served_unsplit_or_refused() {
        let split = Plan::Split {
            prefill: 0,
            decode: 1,
        };
        for body in [
            r#"{"prompt":"a","prompt_logprobs":1}"#,
            r#"{"prompt":"a","echo":true,"logprobs":1}"#,
        ] {
            let v = validated(body);
            assert_eq!(
                shape_plan(split, &v, Backend::Vllm).ok(),
                Some(Plan::Aggregated { engine: 1 }),
                "{body}"
            );
            match shape_plan(split, &v, Backend::Sglang) {
                Err(RequestFailure::Invalid(e)) => {
                    let (status, b) = e.response();
                    assert_eq!(status, StatusCode::BAD_REQUEST);
                    assert_eq!(b["error"]["param"], v.prompt_logprobs.unwrap());
                }
                other => panic!("{body}: {:?}", other.map(|_| ())),
            }
            let agg = Plan::Aggregated { engine: 0 };
            assert_eq!(shape_plan(agg, &v, Backend::Sglang).ok(), Some(agg));
        }
        let plain = validated(r#"{"prompt":"a","logprobs":1}"#);
        assert_eq!(shape_plan(split, &plain, Backend::Vllm).ok(), Some(split));
    }

    /// A batch is one request per prompt, each with its own prompt and its own estimate.
    #[test]
    fn a_batch_is_fanned_out_one_prompt_per_request() {
        let v = validated(r#"{"prompt":["alpha one","b",[1,2,3]],"max_tokens":3}"#);
        let subs = subs_of(&v, 4.0);
        assert_eq!(subs.len(), 3);
        assert_eq!(subs[0].body["prompt"], "alpha one");
        assert_eq!(subs[2].body["prompt"], json!([1, 2, 3]));
        assert_eq!(subs[2].body["max_tokens"], 3);
        assert_eq!(
            subs.iter().map(|s| (s.k, s.input_len)).collect::<Vec<_>>(),
            vec![(Some(0), 3), (Some(1), 1), (Some(2), 3)]
        );
        let single = validated(r#"{"prompt":"x"}"#);
        let subs = subs_of(&single, 4.0);
        assert_eq!(subs.len(), 1);
        assert!(subs[0].k.is_none() && matches!(subs[0].body, Cow::Borrowed(_)));
    }

    #[test]
    fn a_batch_answer_has_one_choice_per_prompt_and_summed_usage() {
        let answer = |text: &str, usage: Value| {
            json!({"id": "x", "object": "text_completion", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                   "usage": usage})
        };
        let u = |p: u64, c: u64| json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
        let merged = merge_answers(vec![
            answer("a", u(2, 3)),
            answer("b", u(4, 3)),
            answer("c", usage_value(None, 1, 3)),
        ]);
        let choices = merged["choices"].as_array().unwrap();
        assert_eq!(
            choices
                .iter()
                .map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap()))
                .collect::<Vec<_>>(),
            vec![(0, "a"), (1, "b"), (2, "c")]
        );
        assert_eq!(merged["usage"]["prompt_tokens"], 7);
        assert_eq!(merged["usage"]["completion_tokens"], 9);
        assert_eq!(merged["usage"]["estimated"], true);
        assert_eq!(merged["id"], "x");
    }

    #[test]
    fn whole_answers_keep_the_engines_usage_or_estimate_one() {
        let a = Answering {
            chat: false,
            include_usage: false,
            return_token_ids: false,
            chars_per_token: 4.0,
            estimates: vec![3],
        };
        let mut with = json!({"choices": [{"index": 0, "text": "abcdefgh", "token_ids": [1]}],
                              "usage": {"prompt_tokens": 13, "completion_tokens": 8, "total_tokens": 21}});
        assert_eq!(finish_whole(&mut with, &a, 3), 8);
        assert_eq!(with["usage"]["prompt_tokens"], 13);
        assert!(with["choices"][0].get("token_ids").is_none());
        let mut without = json!({"choices": [{"index": 0, "text": "abcdefgh"}]});
        assert_eq!(finish_whole(&mut without, &a, 3), 2);
        assert_eq!(
            without["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "estimated": true})
        );
    }
}
