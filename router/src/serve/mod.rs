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
//! The files, top to bottom (each imports only those below it):
//! - this module: the front door (readiness, bounded body, ingress, admission seat, then the
//!   answer: a streaming relay task or one collected object);
//! - `attempt`: one prompt's attempts (placement, the admission price, the retry loop) and
//!   the dispatch of a plan to its leg protocol;
//! - `aggregated`, `vllm_nixl`, `sglang_bootstrap`: one leg protocol each, with the bodies
//!   of its legs;
//! - `relay_io`: the relay's IO loop once output started (the pure rules are `crate::relay`);
//! - `leg`: what a leg produces (a started answer, a failed leg) and the attempt log.
//!
//! Cancellation: the handler future owns every leg and the [`Pending`] guard. When hyper drops
//! it (client gone) the legs' connections close and the guard settles `cancelled`. After the
//! response starts, the relay task owns them and watches the client channel. A graceful
//! shutdown whose budget ran out ([`crate::readiness::Gate::end_requests`]) ends every request
//! still running: before output 503, after output the error frame; settled `failed/shutdown`.

use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming};
use serde_json::{Map, Value};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tracing::Instrument;

use crate::config::secs;
use crate::controller::Track;
use crate::failure::{Expiry, RequestFailure};
use crate::ingress::{self, Endpoint, Validated};
use crate::outcome::{Pending, RequestRecord, SettleSink, Settlement};
use crate::parts::Parts;
use crate::response::{Body, json_bytes_response, json_response};
use narwhal_relay::done_frame;

mod aggregated;
mod attempt;
mod leg;
mod relay_io;
mod sglang_bootstrap;
#[cfg(test)]
mod tests;
mod vllm_nixl;

use attempt::{refused_attempt, start_all};
use leg::{AttemptLog, Output, Started};
use relay_io::{Answer, Relayed, collect_all, finish_frame, finish_record, stream_all};

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

/// How the answer is built once output started.
struct Answering {
    chat: bool,
    include_usage: bool,
    return_token_ids: bool,
    chars_per_token: f64,
    /// Per prompt: the estimated prompt tokens.
    estimates: Vec<u64>,
    /// Choices per prompt (the client's `n`): a batch's prompt `k` answers choices
    /// `k × choices ..`, as vLLM numbers them.
    choices: u64,
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

/// Reads the request body within `serving.body_read_timeout_s` (and the request deadline)
/// and `serving.max_request_bytes`.
///
/// # Errors
/// The failure to answer: the deadline or the body timeout passed, the body is too large, or
/// the client's stream broke.
async fn request_body(
    parts: &Parts,
    req: http::Request<Incoming>,
    arrived: Instant,
    deadline: Instant,
) -> Result<Bytes, RequestFailure> {
    let limit = parts.cfg.serving.max_request_bytes;
    let body_by = (arrived + secs(parts.cfg.serving.body_read_timeout_s)).min(deadline);
    let read = tokio::time::timeout_at(body_by.into(), read_body(req.into_body(), limit)).await;
    match read {
        // A client that cannot deliver its body within the request deadline.
        Err(_) if body_by == deadline => Err(RequestFailure::Expired(Expiry::BodyRead)),
        // A client that stalls mid-body: bounded on its own, well before the deadline.
        Err(_) => {
            let limit_s = parts.cfg.serving.body_read_timeout_s;
            Err(RequestFailure::BodyTimeout { limit_s })
        }
        Ok(Ok(b)) => Ok(b),
        Ok(Err(ReadError::TooLarge)) => {
            Err(RequestFailure::Invalid(ingress::IngressError::TooLarge {
                limit,
            }))
        }
        Ok(Err(ReadError::Client(detail))) => {
            tracing::debug!(%detail, "client body read failed");
            Err(RequestFailure::BodyUnreadable)
        }
    }
}

/// The body validated for `endpoint` (ingress rules, then the batch bound).
///
/// # Errors
/// The first rule broken ([`ingress::IngressError`]).
fn validated(
    parts: &Parts,
    endpoint: Endpoint,
    bytes: &[u8],
) -> Result<Validated, ingress::IngressError> {
    let v = ingress::validate(
        endpoint,
        bytes,
        parts.cfg.served(),
        parts.cfg.backend,
        parts.cfg.engine.chars_per_token,
    )?;
    ingress::check_batch(&v, parts.cfg.serving.max_batch_prompts)?;
    Ok(v)
}

/// What the placement's attempts came to by the request deadline: the started legs, or the
/// failure to answer (a leg limit that coincides with the deadline is the deadline).
fn started_by_deadline(
    parts: &Parts,
    outcome: Result<Result<Vec<Started>, RequestFailure>, tokio::time::error::Elapsed>,
    deadline: Instant,
) -> Result<Vec<Started>, RequestFailure> {
    match outcome {
        Err(_) => Err(RequestFailure::Expired(Expiry::BeforeOutput)),
        Ok(Err(RequestFailure::Leg { err, .. }))
            if err.client_fault().is_none() && parts.clock.now() >= deadline =>
        {
            let detail = err.detail();
            Err(RequestFailure::Expired(Expiry::LegAtDeadline { detail }))
        }
        Ok(other) => other,
    }
}

/// Queues what a single stream has ready on `tx` (a new channel: its first frame always has
/// room) and says whether the stream's end is already known.
async fn first_frames(started: &mut [Started], tx: &mpsc::Sender<Bytes>) -> bool {
    let [one] = started else {
        return false;
    };
    match &mut one.out {
        Output::Live(live) => {
            live.gather_ready().await;
            let first = std::mem::take(&mut live.first);
            if !first.is_empty() {
                let _ = tx.try_send(first);
            }
            live.end_known()
        }
        Output::Whole(_) | Output::Clean(_) => true,
    }
}

/// The streamed answer's head: `text/event-stream`, `no-cache` and the request id, the body
/// fed from `rx`.
fn sse_response(rx: mpsc::Receiver<Bytes>, rid: &str) -> Response<Body> {
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
    if let Ok(v) = HeaderValue::from_str(rid) {
        h.insert("x-request-id", v);
    }
    r
}

/// The refusal of a router that is not ready (`no_engines`: in control, not held by the
/// lifecycle, and no engine live), or `None` when it is.
fn not_ready(parts: &Parts) -> Option<RequestFailure> {
    let readiness = parts.gate.readiness();
    if readiness.ready {
        return None;
    }
    let no_engines = readiness.control_ready
        && parts.gate.lifecycle_hold().is_none()
        && parts.fleet.live_count() == 0;
    let reason = readiness.reason;
    Some(RequestFailure::NotReady { reason, no_engines })
}

/// An admission seat (FIFO queue bounded by `queue_timeout_s` when `queue_capacity` > 0;
/// queued requests are re-priced under predictive admission: controller.md 10.1); the wait
/// goes to `record`.
///
/// # Errors
/// The refusal, counted in `record` as one failed, undispatched attempt.
async fn seat(
    parts: &Parts,
    track: &Track,
    deadline: Instant,
    record: &mut RequestRecord,
) -> Result<OwnedSemaphorePermit, RequestFailure> {
    match parts
        .controller
        .seat(&parts.admission, track, deadline)
        .await
    {
        Ok((p, waited)) => {
            record.admission_wait_s = Some(waited);
            Ok(p)
        }
        Err(failure) => {
            refused_attempt(parts, &mut record.attempt_failures, &failure, 1, None);
            Err(failure)
        }
    }
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

    if let Some(not_ready) = not_ready(&parts) {
        return closing(fail(pending, not_ready));
    }

    let bytes = match request_body(&parts, req, arrived, deadline).await {
        Ok(b) => b,
        // The body was not read to its end: the connection cannot carry another request.
        Err(failure) => return closing(fail(pending, failure)),
    };
    let v = match validated(&parts, endpoint, &bytes) {
        Ok(v) => v,
        Err(e) => return fail(pending, RequestFailure::Invalid(e)),
    };
    pending.record().stream = v.stream;
    let input_len = parts.controller.size(&track, &v).await;
    pending.record().input_len = Some(input_len);

    // Admission seat (FIFO queue bounded by queue_timeout_s when queue_capacity > 0; queued
    // requests are re-priced under predictive admission: controller.md 10.1).
    let permit = match seat(&parts, &track, deadline, pending.record()).await {
        Ok(p) => p,
        Err(failure) => return fail(pending, failure),
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
        choices: v.choices,
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
        o = tokio::time::timeout_at(deadline.into(), Box::pin(start_all(&ctx, &subs, &tracks, &log))) => Some(o),
        () = parts.gate.requests_ended() => None,
    };
    std::mem::take(&mut *AttemptLog::lock(&log)).into_record(pending.record());
    let Some(outcome) = outcome else {
        return fail(pending, RequestFailure::ShutDown { streaming: false });
    };
    let started = match started_by_deadline(&parts, outcome, deadline) {
        Ok(s) => s,
        Err(failure) => return fail(pending, failure),
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
        let mut started = started;
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        // What is ready goes with the response head, in one write (architecture.md, "Writes
        // on the client connection"); a stream whose end is already known is finished here,
        // so its head, frames, `[DONE]` and the chunked end leave in one write too.
        let complete = first_frames(&mut started, &tx).await;
        let task_parts = parts.clone();
        // Boxed: the handler's own future must not grow by the relay's size, since a request
        // waiting for an admission seat holds that future (docs/benchmarks.md, "10,000 streams").
        let relay = Box::pin(async move {
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
            finish_record(&mut pending, &end.stats, &task_parts.kv);
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
        });
        if complete {
            // Nothing left to wait for from the engine, and at most three frames for a
            // channel of 64 that nobody reads yet: this never waits.
            relay.await;
        } else {
            tokio::spawn(relay.instrument(tracing::Span::current()));
        }
        sse_response(rx, &rid)
    } else {
        let end = Box::pin(collect_all(
            &parts,
            started,
            deadline,
            first_token_at,
            &answering,
        ))
        .await;
        drop(permit);
        drop(retained);
        finish_record(&mut pending, &end.stats, &parts.kv);
        match end.answer {
            Ok(Answer::Value(answer)) => {
                pending.settle(Settlement::completed());
                json_response(StatusCode::OK, &answer, &rid)
            }
            Ok(Answer::Clean(answer)) => {
                pending.settle(Settlement::completed());
                json_bytes_response(StatusCode::OK, answer.body, &rid)
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
