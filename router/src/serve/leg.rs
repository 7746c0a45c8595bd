//! What one leg of an attempt produces and how it is recorded: the started answer (its
//! output, seats and engines), a failed leg charged to its engine, the attempt log copied into
//! the request's journal row, and the leg options every leg protocol shares.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::controller::Track;
use crate::fleet::{Fleet, Resident};
use crate::ingress::Endpoint;
use crate::outcome::{LegRecord, RequestRecord};
use crate::parts::Parts;
use crate::placement::Phase;
use narwhal_relay::RelayOptions;

use super::{Ctx, Sub};
use crate::upstream::{CleanAnswer, LegError, LegId, LiveStream};

/// A failed attempt leg.
#[derive(Debug)]
pub(super) struct Fail {
    pub(super) phase: Phase,
    pub(super) iid: usize,
    pub(super) err: LegError,
    /// The attempt's producer when the decode leg failed (excluded from the retry too).
    pub(super) producer: Option<usize>,
}

/// Maps a leg's error to the attempt's failure of `phase` on engine `iid` (`producer`: the
/// attempt's producer, when its decode leg failed).
pub(super) fn leg_failed(
    phase: Phase,
    iid: usize,
    producer: Option<usize>,
) -> impl FnOnce(LegError) -> Fail {
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
pub(super) enum Output {
    /// A decode stream that produced its first output.
    Live(LiveStream),
    /// A whole answer: a non-streaming client's request on an aggregated engine, or a vLLM
    /// prefill that already finished the generation (its one token was EOS or ended a stop
    /// string).
    Whole(Value),
    /// A non-streaming client's whole answer on an aggregated engine, already cleaned for the
    /// client at byte level (it carried its own complete usage).
    Clean(CleanAnswer),
}

impl Output {
    /// A whole answer's value (a cleaned one parsed back), or the live stream.
    // The stream is moved once per answer, to the relay that owns it from then on.
    #[allow(clippy::result_large_err)]
    pub(super) fn into_whole(self) -> Result<Value, LiveStream> {
        match self {
            Output::Whole(v) => Ok(v),
            Output::Clean(c) => Ok(c.into_value()),
            Output::Live(live) => Err(live),
        }
    }
}

/// An attempt that reached its first output.
pub(super) struct Started {
    pub(super) out: Output,
    pub(super) _seat: Option<Resident>,
    pub(super) _prefill_task: Option<AbortOnDrop>,
    /// The engine whose answer this is.
    pub(super) served_by: usize,
    /// The breaker hears `DecodeOk` from `served_by` when the answer completes (not for a
    /// prefill's finished answer: it heard `PrefillOk`).
    pub(super) decode_ok: bool,
    /// The prefill engine whose KV the decode consumes (`None` for an aggregated leg).
    pub(super) producer: Option<usize>,
    /// When the serving leg was dispatched (for `upstream_seconds.decode`).
    pub(super) decode_at: Instant,
    /// The role controller's bookkeeping of this request (token gaps).
    pub(super) track: Track,
}

impl Started {
    /// An answer served by `engine` alone, without a producer: an aggregated leg
    /// (`decode_ok`), or a prefill that finished the generation.
    pub(super) fn single(
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

/// The attempts of one request (all its prompts), copied into its record: kept outside the
/// record so a batch's prompts can run their attempts concurrently.
#[derive(Debug, Default)]
pub(super) struct AttemptLog {
    pub(super) attempts: u32,
    pub(super) prefill_iid: Option<String>,
    pub(super) decode_iid: Option<String>,
    pub(super) failures: Vec<crate::outcome::AttemptFailure>,
    pub(super) legs: Vec<LegRecord>,
    /// The latest TTFT price at placement (controller.md 11.2 `admission_price`).
    pub(super) admission_price: Option<Value>,
    /// Prompt tokens the KV index credits the computing engine of the latest attempt with
    /// (`None`: not scored).
    pub(super) cached_tokens: Option<u64>,
    /// The prompt's tokens as the KV score counted them (`None`: not scored).
    pub(super) prompt_tokens: Option<u64>,
    /// The computing engine's KV index mode at that placement (`exact`, `approximate`,
    /// `none`; `None`: not scored).
    pub(super) kv_mode: Option<&'static str>,
    /// For the credit check: the engine, its rank and its reported credit, when the latest
    /// attempt's computing engine answers the client itself (aggregated).
    pub(super) kv_check: Option<(usize, Option<u32>, u64)>,
    /// The latest attempt's computing engine and the data-parallel rank the KV score chose
    /// on it: its leg carries vLLM's `X-data-parallel-rank` ([`new_leg`]).
    pub(super) dp_rank: Option<(usize, u32)>,
}

/// Output tokens a request without `max_tokens` is assumed to hold in KV, for placement's
/// `tokens` measure (docs/design/kv-aware-placement.md, section 5).
const ASSUMED_OUTPUT_TOKENS: u64 = 256;

/// Which part of a request a leg's engine holds in KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Holds {
    /// It computes the prompt and decodes (aggregated): its uncached prompt tokens and the
    /// output.
    Everything,
    /// A split's prefill: its uncached prompt tokens, until the decode has read them.
    Prompt,
    /// A split's decode: the whole prompt (transferred) and the output.
    Transferred,
}

impl AttemptLog {
    pub(super) fn lock(log: &Mutex<AttemptLog>) -> std::sync::MutexGuard<'_, AttemptLog> {
        log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The KV tokens a leg of this attempt holds on its engine (placement's `tokens` measure,
    /// [`crate::fleet::Fleet::resident`]): of `prompt` tokens, those the KV score does not
    /// credit the computing engine with ([`AttemptLog::cached_tokens`]; the score's own count
    /// of the prompt when it scored it), and the output budget
    /// (`max_tokens` × the sequences asked for, else [`ASSUMED_OUTPUT_TOKENS`]).
    pub(super) fn kv_tokens(
        log: &Mutex<AttemptLog>,
        v: &crate::ingress::Validated,
        prompt: u64,
        holds: Holds,
    ) -> u64 {
        let (cached, counted) = {
            let l = AttemptLog::lock(log);
            (l.cached_tokens.unwrap_or(0), l.prompt_tokens)
        };
        let prompt = counted.unwrap_or(prompt);
        let uncached = prompt.saturating_sub(cached);
        let width = v
            .sampling_width
            .and_then(|k| v.body.get(k))
            .and_then(Value::as_u64)
            .unwrap_or(1)
            .max(1);
        // A client may ask for any `max_tokens`: saturate rather than wrap.
        let output = v
            .max_tokens
            .unwrap_or(ASSUMED_OUTPUT_TOKENS)
            .saturating_mul(width);
        match holds {
            Holds::Everything => uncached.saturating_add(output),
            Holds::Prompt => uncached,
            Holds::Transferred => prompt.saturating_add(output),
        }
    }

    pub(super) fn into_record(self, rec: &mut RequestRecord) {
        rec.attempts = self.attempts;
        rec.prefill_iid = self.prefill_iid;
        rec.decode_iid = self.decode_iid;
        rec.attempt_failures = self.failures;
        rec.legs = self.legs;
        rec.admission_price = self.admission_price;
        rec.cached_tokens = self.cached_tokens;
        rec.kv_mode = self.kv_mode;
        rec.kv_check = self.kv_check;
    }
}

pub(super) fn relay_options(ctx: &Ctx<'_>, sub: &Sub<'_>) -> RelayOptions {
    RelayOptions {
        return_token_ids: ctx.v.return_token_ids,
        max_response_bytes: ctx.parts.cfg.serving.max_response_bytes,
        collect: !ctx.v.stream,
        // A streaming client gets prompt k's choices as choice k from the relay itself; a
        // non-streaming batch is merged (and reindexed) once every answer is whole.
        index_base: if ctx.v.stream {
            sub.k.map(|k| k as u64 * ctx.v.choices)
        } else {
            None
        },
        capture_head: ctx.v.stream && ctx.v.include_usage,
        // A non-streaming client's answer is built in the scan that reads each frame.
        aggregate: (!ctx.v.stream).then_some(ctx.endpoint == Endpoint::Chat),
    }
}

/// A new leg id for leg `leg` of attempt `n` on engine `iid`, recorded in the journal's
/// `legs`.
pub(super) fn new_leg(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    n: u32,
    leg: &'static str,
    iid: usize,
    log: &Mutex<AttemptLog>,
) -> LegId {
    let mut id = LegId::new(ctx.rid, sub.k, n, leg);
    let mut log = AttemptLog::lock(log);
    id.dp_rank = log.dp_rank.filter(|(e, _)| *e == iid).map(|(_, r)| r);
    log.legs.push(LegRecord {
        attempt: n,
        leg,
        iid: ctx.parts.cfg.engines[iid].iid.clone(),
        request_id: id.id.clone(),
        prompt: sub.k,
    });
    id
}

/// How long a decode leg may take to its first token: `engine.first_token_timeout_s`, plus
/// `engine.kv_transfer_timeout_s` when `pulls_kv` (the decode of a split first pulls the
/// prefill's KV over the fabric — vLLM's NIXL read, SGLang's Mooncake transfer — before it
/// computes anything, and that pull grows with the prompt and the fabric, not the engine's
/// step time; docs/configuration.md). An aggregated leg gets the first-token limit alone.
pub(super) fn first_token_limit(parts: &Parts, pulls_kv: bool) -> Duration {
    if pulls_kv {
        parts.cfg.first_token_timeout() + parts.cfg.kv_transfer_timeout()
    } else {
        parts.cfg.first_token_timeout()
    }
}

/// Runs a leg until its first output (its whole answer, for a whole leg) under engine
/// `iid`'s stall watch (behaviour.md 6.9): when the engine is found stalled while the leg
/// waits, the leg is given up as [`LegError::Stalled`] (retried elsewhere). Any answer from
/// the engine, an error status included, counts as its output for the watch.
pub(super) async fn watched<T>(
    fleet: &Arc<Fleet>,
    iid: usize,
    leg: impl Future<Output = Result<T, LegError>>,
) -> Result<T, LegError> {
    let mut watch = fleet.watch_leg(iid);
    tokio::select! {
        biased;
        r = leg => {
            if r.as_ref().map_or_else(LegError::engine_answered, |_| true) {
                watch.answered();
            }
            r
        }
        () = watch.stalled() => Err(LegError::Stalled),
    }
}

/// The decode leg of a vLLM split, which carries the prefill's KV descriptor, kept until the
/// decode's first output even when its request ends first (its client left, or another prompt
/// of its batch failed): the producer holds the staged KV until a decode reads it (or its own
/// lease expires: vLLM's NIXL connector, `kv_lease_duration`), so a leg dropped before the
/// decode engine took the request would strand those blocks. Dropped while pending, the leg
/// moves to a task that runs it to its first output (the KV has landed, then the connection
/// is closed, which aborts the decode) or to its own failure, bounded by its first-token
/// limit, with the producer still counted resident until then; counted in
/// `narwhal_kv_pickups_total{outcome}` (docs/http-api.md, "Cancellation").
pub(super) struct Pickup {
    leg: Option<PickupLeg>,
    seat: Option<Resident>,
    metrics: Arc<crate::metrics::Metrics>,
}

/// The decode leg a [`Pickup`] keeps.
type PickupLeg = Pin<Box<dyn Future<Output = Result<LiveStream, LegError>> + Send>>;

impl Pickup {
    /// Keeps `leg` (and the producer's `seat`) until its first output.
    pub(super) fn new(
        leg: impl Future<Output = Result<LiveStream, LegError>> + Send + 'static,
        seat: Resident,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Self {
        Pickup {
            leg: Some(Box::pin(leg)),
            seat: Some(seat),
            metrics,
        }
    }
}

impl Future for Pickup {
    type Output = Result<LiveStream, LegError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(leg) = self.leg.as_mut() else {
            return Poll::Pending;
        };
        let out = std::task::ready!(leg.as_mut().poll(cx));
        // The decode answered: the KV left the producer.
        self.leg = None;
        self.seat = None;
        Poll::Ready(out)
    }
}

impl Drop for Pickup {
    fn drop(&mut self) {
        let (Some(leg), Ok(rt)) = (self.leg.take(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        let seat = self.seat.take();
        let metrics = self.metrics.clone();
        rt.spawn(async move {
            let outcome = match leg.await {
                // Dropping the stream closes the connection: the decode is aborted after
                // reading the KV, and nothing is generated for nobody.
                Ok(_live) => "collected",
                Err(_) => "failed",
            };
            drop(seat);
            tracing::info!(
                outcome,
                "decode leg kept after its request ended, to read the staged KV"
            );
            metrics
                .legs
                .kv_pickups
                .get_or_create(&crate::metrics::labels(&[("outcome", outcome)]))
                .inc();
        });
    }
}

/// Aborts a spawned task when dropped (SGLang prefill leg).
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<Result<(), LegError>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The URL of engine `iid` for this request's route (`/v1/completions` or
/// `/v1/chat/completions`).
pub(super) fn engine_url(ctx: &Ctx<'_>, iid: usize) -> String {
    format!("{}{}", ctx.parts.cfg.engines[iid].url, ctx.endpoint.path())
}
