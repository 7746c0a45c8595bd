//! The vLLM P/D leg protocol over the NIXL connector (behaviour.md 7.1;
//! docs/design/engine-protocols.md 2): a prefill leg capped at one token with
//! `kv_transfer_params: {"do_remote_decode": true}`, whose answer carries the KV descriptor
//! the decode leg is given verbatim; a prefill whose one token already ended the generation is
//! the answer.

use std::sync::Mutex;
use std::time::Instant;

use serde_json::{Map, Value};
use tracing::Instrument;

use crate::breaker::Observation;
use crate::config::secs;
use crate::controller::Track;
use crate::placement::Phase;
use crate::upstream::{EngineAbort, KvHandoffFailure, LegError, LegId, NoDescriptor, answer_value};
use narwhal_relay::descriptor_span;

use crate::upstream::Upstream;

use super::aggregated::decode_body;
use super::leg::{
    AttemptLog, Fail, Holds, Output, Pickup, Started, engine_url, first_token_limit, leg_failed,
    new_leg, relay_options, watched,
};
use super::{Ctx, Sub};

/// Runs a vLLM P/D attempt: the prefill leg on `prefill`, then the decode leg on `decode`
/// with the descriptor, until the decode's first token.
pub(super) async fn run(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    track: &Track,
    n: u32,
    prefill: usize,
    decode: usize,
    log: &Mutex<AttemptLog>,
) -> Result<Started, Fail> {
    let parts = ctx.parts;
    let opts = relay_options(ctx, sub);
    let now = parts.clock.now();
    // Both engines count as resident from placement on: the decode engine is committed
    // to this request while its prefill runs, and the producer holds the KV until the
    // decode has pulled it. A drain of either waits for this request
    // (handoff-and-lifecycle.md, "Draining engines"; `ready_to_stop` must not turn true
    // under it).
    let held_p = AttemptLog::kv_tokens(log, ctx.v, sub.input_len, Holds::Prompt);
    let held_d = AttemptLog::kv_tokens(log, ctx.v, sub.input_len, Holds::Transferred);
    let seat_p = parts.fleet.resident(prefill, Phase::Prefill, held_p);
    let seat = parts.fleet.resident(decode, Phase::Decode, held_d);
    track.dispatched(prefill, Phase::Prefill);
    parts.accounting.prefill_dispatched();
    let limit = (now + secs(parts.cfg.serving.prefill_timeout_s)).min(ctx.deadline);
    let t0 = parts.clock.now();
    let pleg = new_leg(ctx, sub, n, "prefill", prefill, log);
    let prefilled = watched(
        &parts.fleet,
        prefill,
        self::prefill(
            &parts.upstream,
            &engine_url(ctx, prefill),
            &pleg,
            &vllm_prefill_body(&sub.body),
            limit,
            ctx.v.max_tokens,
        ),
    )
    .instrument(tracing::info_span!("prefill", engine = %parts.cfg.engines[prefill].iid))
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
    let first_by =
        (parts.clock.now() + first_token_limit(parts, decode != prefill)).min(ctx.deadline);
    let dleg = new_leg(ctx, sub, n, "decode", decode, log);
    // From here the request owns the producer's staged KV: the decode leg is kept until it
    // read it even if the request ends first (`Pickup`), with the producer resident until
    // then.
    let (up, fleet, url) = (
        parts.upstream.clone(),
        parts.fleet.clone(),
        engine_url(ctx, decode),
    );
    let span = tracing::info_span!("decode", engine = %parts.cfg.engines[decode].iid);
    let leg = async move {
        watched(
            &fleet,
            decode,
            up.decode(&url, &dleg, &body, opts, first_by),
        )
        .await
    };
    let live = Pickup::new(leg.instrument(span), seat_p, parts.metrics.clone())
        .await
        .map_err(leg_failed(Phase::Decode, decode, Some(prefill)));
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

/// What a vLLM prefill leg produced.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Prefilled {
    /// The KV descriptor for the decode leg.
    Descriptor(Value),
    /// The generation already ended in the prefill: its answer is the request's answer.
    Finished(Value),
}

/// Whether a prefill answer without a descriptor is a finished generation: every choice has
/// a finish reason other than `abort`, and `length` only when the client itself asked for
/// one token. vLLM's NIXL connector returns `kv_transfer_params` only for a request that
/// stopped on its length cap (`request_finished`: `RequestStatus.FINISHED_LENGTH_CAPPED`);
/// one whose sampled token was EOS or completed a stop string has nothing to hand off
/// (docs/http-api.md).
pub(super) fn prefill_finished(answer: &Value, client_max_tokens: Option<u64>) -> bool {
    let absent = |v: Option<&Value>| v.is_none_or(Value::is_null);
    if !absent(answer.get("kv_transfer_params"))
        || !absent(answer.pointer("/choices/0/kv_transfer_params"))
    {
        return false;
    }
    let Some(choices) = answer.get("choices").and_then(Value::as_array) else {
        return false;
    };
    !choices.is_empty()
        && choices
            .iter()
            .all(|c| match c.get("finish_reason").and_then(Value::as_str) {
                Some("length") => client_max_tokens == Some(1),
                Some("abort") | None => false,
                Some(_) => true,
            })
}

/// Whether a prefill answer without a descriptor is an engine's abort: some choice ends with
/// `finish_reason: "abort"`. vLLM finishes a request it gave up (`RequestStatus.FINISHED_ABORTED`
/// in `vllm/v1/request.py`: preempted for a full KV cache, shutting down or paused in abort
/// mode) with `FinishReason.ABORT`, answers it 200 (the completion server raises only for
/// `"error"`), and its NIXL connector hands off nothing for it (`request_finished` stages blocks
/// only for a request that stopped on its length cap or a stop). Nothing was output, so it is
/// the engine's transient failure ([`LegError::Aborted`]), not the request's answer.
pub(super) fn prefill_aborted(answer: &Value) -> bool {
    answer
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.get("finish_reason").and_then(Value::as_str) == Some("abort"))
        })
}

/// Validate and return the vLLM descriptor verbatim (behaviour.md 7.1 step 3):
/// `choices[0].kv_transfer_params`, else top-level `kv_transfer_params`; a non-empty object with
/// a non-empty string `remote_engine_id` and `remote_block_ids` a list of non-negative ints or a
/// list of such lists.
pub(super) fn extract_descriptor(answer: &Value) -> Result<Value, NoDescriptor> {
    let d = answer
        .pointer("/choices/0/kv_transfer_params")
        .filter(|v| !v.is_null())
        .or_else(|| answer.get("kv_transfer_params").filter(|v| !v.is_null()))
        .ok_or(NoDescriptor::Absent)?;
    check_descriptor(d)?;
    Ok(d.clone())
}

/// The rules a descriptor must meet ([`extract_descriptor`]).
fn check_descriptor(d: &Value) -> Result<(), NoDescriptor> {
    let obj = d
        .as_object()
        .filter(|o| !o.is_empty())
        .ok_or(NoDescriptor::NotAnObject)?;
    match obj.get("remote_engine_id") {
        Some(Value::String(s)) if !s.is_empty() => {}
        _ => return Err(NoDescriptor::EngineId),
    }
    let ok_ids = |a: &Vec<Value>| a.iter().all(Value::is_u64);
    let blocks_ok = match obj.get("remote_block_ids") {
        Some(Value::Array(a)) => ok_ids(a) || a.iter().all(|x| x.as_array().is_some_and(ok_ids)),
        _ => false,
    };
    if !blocks_ok {
        return Err(NoDescriptor::BlockIds);
    }
    Ok(())
}

/// Body of a vLLM prefill leg (behaviour.md 7.1 step 2). A client `min_tokens` ≥ 1 becomes
/// `min_tokens: 1` (not removed, as the reference does): the prefill's one token may then
/// not be EOS or end a stop string, so the prefill cannot end a generation the client asked
/// to run longer.
pub(super) fn vllm_prefill_body(client: &Map<String, Value>) -> Value {
    let mut b = client.clone();
    let min_one = b
        .get("min_tokens")
        .and_then(Value::as_u64)
        .is_some_and(|m| m >= 1);
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
    if min_one {
        b.insert("min_tokens".into(), 1.into());
    }
    b.insert("stream".into(), false.into());
    b.insert(
        "kv_transfer_params".into(),
        serde_json::json!({"do_remote_decode": true}),
    );
    Value::Object(b)
}

/// The vLLM prefill leg: POST and extract the KV descriptor (behaviour.md 7.1 steps 2–3).
/// A prefill that answers without a descriptor because its one sampled token already
/// ended the generation is [`Prefilled::Finished`] (see [`prefill_finished`];
/// `client_max_tokens` is the client's own limit).
///
/// # Errors
/// The leg's [`LegError`]; [`LegError::KvHandoff`] for an answer without a usable descriptor.
pub(super) async fn prefill(
    up: &Upstream,
    url: &str,
    leg: &LegId,
    body: &Value,
    limit: Instant,
    client_max_tokens: Option<u64>,
) -> Result<Prefilled, LegError> {
    let fut = async {
        let (bytes, streamed) = up
            .read_answer(url, leg, body, up.max_answer_bytes())
            .await?;
        // The descriptor alone is parsed when one scan finds it where the value path would
        // ([`narwhal_relay::descriptor_span`]); any other answer is read whole, as before.
        if !streamed
            && let Some(span) = descriptor_span(&bytes)
            && let Ok(d) = serde_json::from_slice::<Value>(&bytes[span])
            && check_descriptor(&d).is_ok()
        {
            return Ok(Prefilled::Descriptor(d));
        }
        let answer = answer_value(&bytes, streamed, None)?;
        match extract_descriptor(&answer) {
            Ok(d) => Ok(Prefilled::Descriptor(d)),
            Err(_) if prefill_finished(&answer, client_max_tokens) => {
                Ok(Prefilled::Finished(answer))
            }
            Err(_) if prefill_aborted(&answer) => {
                Err(LegError::Aborted(EngineAbort::PrefillAborted))
            }
            Err(e) => Err(LegError::KvHandoff(KvHandoffFailure::NoDescriptor(e))),
        }
    };
    match tokio::time::timeout_at(limit.into(), fut).await {
        Ok(r) => r,
        Err(_) => Err(LegError::Timeout(leg.limit())),
    }
}
