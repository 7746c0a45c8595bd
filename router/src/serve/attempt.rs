//! One attempt of one prompt: placement, the admission price, the legs of the plan (each leg
//! protocol in its own module), and the retry loop around attempts (behaviour.md 7.5).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use crate::outcome::AttemptFailure;
use rand::Rng;
use tracing::Instrument;

use crate::bootstrap;
use crate::breaker::Observation;
use crate::config::Backend;
use crate::controller::Track;
use crate::failure::RequestFailure;
use crate::ingress::{IngressError, Validated};
use crate::parts::Parts;
use crate::placement::{self, Phase, Plan};
use crate::retry::{self, Decision, RetryPolicy, Stop};
use crate::upstream::LegError;

use super::leg::{AttemptLog, Fail, Started};
use super::{Ctx, Sub, aggregated, sglang_bootstrap, vllm_nixl};

/// Runs every prompt's attempts until each reached its first output; the first failure ends
/// them all (dropping the others closes their legs).
pub(super) async fn start_all(
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
///
/// `n` / `best_of` > 1 is passed to an aggregated engine, which samples the choices itself, as
/// vLLM does; across a split it is refused with a 400 naming the split: the prefill leg runs
/// with `max_tokens: 1` and one sequence, and a P/D connector hands the decode one sequence's
/// KV, so the legs would disagree on sampling width (router/testdata/reference-error-400-n.json).
pub(super) fn shape_plan(
    plan: Plan,
    v: &Validated,
    backend: Backend,
) -> Result<Plan, RequestFailure> {
    if let (Plan::Split { .. }, Some(field)) = (plan, v.sampling_width)
        && v.prompt_logprobs.is_none()
    {
        return Err(RequestFailure::Invalid(IngressError::SamplingWidth {
            field,
        }));
    }
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

/// The request's KV score ([`crate::kv_cache::KvCache::score`]): the tokens the router's own
/// tokenizer computed for admission's sizing are reused, and counted with the time they took
/// (a batch's prompts were not sized one by one).
async fn score(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    aggregate: placement::Aggregate,
) -> Option<crate::kv_cache::Scored> {
    let known = sub.k.is_none().then(|| ctx.v.tokens.get()).flatten();
    let known = known.map(|(t, micros)| (t.as_slice(), *micros));
    let parts = ctx.parts;
    parts
        .kv
        .score(&parts.fleet, &sub.body, aggregate, known)
        .await
}

/// Run attempts until one reaches its first output (behaviour.md 7.5).
pub(super) async fn attempts(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    track: &Track,
    log: &Mutex<AttemptLog>,
) -> Result<Started, RequestFailure> {
    let parts = ctx.parts;
    let policy = RetryPolicy::from_serving(&parts.cfg.serving);
    let mut avoid: BTreeSet<usize> = BTreeSet::new();
    let mut n = 0u32;
    // The KV score (docs/design/kv-aware-placement.md): the prompt's tokens once, from the
    // router's own tokenizer or an engine's `/tokenize`; `None` places by load.
    let aggregate = match parts.cfg.backend {
        Backend::Vllm => placement::Aggregate::AnyRole,
        Backend::Sglang => placement::Aggregate::DecodeOnly,
    };
    let kv = score(ctx, sub, aggregate).await;
    loop {
        n += 1;
        // A fenced router places nothing, not even a retry (behaviour.md 3.4): the body
        // read and earlier attempts may have outlasted the lease.
        if !parts.ha.controls_fleet() {
            return Err(RequestFailure::NotInControl);
        }
        let plan = parts
            .fleet
            .place(&avoid, aggregate, kv.as_ref().map(|s| &s.score));
        let Some(plan) = plan else {
            return Err(RequestFailure::NoEngine);
        };
        let plan = shape_plan(plan, ctx.v, parts.cfg.backend)?;
        // The TTFT price at placement (controller.md 10.4): journalled, and under
        // predictive admission a first attempt over budget is refused undispatched. Each
        // engine's prefill is priced at the prompt tokens it does not hold (controller.md
        // 3.5): those the KV score counts as cached there, as placement counts them.
        let cached: Vec<u64> = kv.as_ref().map_or_else(Vec::new, |s| {
            s.score
                .uncached
                .iter()
                .map(|u| s.prompt_tokens.saturating_sub(*u))
                .collect()
        });
        match parts.controller.admit(track, plan, n, &cached, || {
            parts.accounting.unserved_placement()
        }) {
            Ok(price) => AttemptLog::lock(log).admission_price = price,
            Err(refusal) => {
                let failure = RequestFailure::Refused(refusal);
                let mut log = AttemptLog::lock(log);
                if let RequestFailure::Refused(r) = &failure {
                    log.admission_price = Some(r.price.to_value());
                }
                refused_attempt(parts, &mut log.failures, &failure, n, sub.k);
                return Err(failure);
            }
        }
        {
            let mut log = AttemptLog::lock(log);
            log.attempts = log.attempts.max(n);
            let name = |i: usize| Some(parts.cfg.engines[i].iid.clone());
            if let Some(s) = &kv {
                let computes = match plan {
                    Plan::Split { prefill, .. } => prefill,
                    Plan::Aggregated { engine } => engine,
                };
                parts.kv.placed(computes, s);
                log.cached_tokens = Some(s.credits[computes].cached);
                log.prompt_tokens = Some(s.prompt_tokens);
                log.kv_mode = Some(s.credits[computes].reason.mode().as_str());
                // A split's usage comes from its decode engine: only an aggregated engine's
                // own count is held against its credit.
                let rank = s.ranks[computes];
                log.kv_check = matches!(plan, Plan::Aggregated { .. }).then_some((
                    computes,
                    rank,
                    s.credits[computes].reported,
                ));
                log.dp_rank = rank.map(|r| (computes, r));
            }
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
            // The router's own descriptors or memory ran out: the engine was never reached,
            // so this is no evidence about it either way.
            None if matches!(f.err, LegError::Local(_)) => {}
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
        AttemptLog::lock(log).failures.push(AttemptFailure {
            attempt: n,
            phase: f.phase.as_str(),
            iid: Some(engine),
            reason: f.err.reason(),
            error: f.err.detail(),
            transient: None,
            retry_reason: None,
            prompt: sub.k,
        });
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
pub(super) fn charge(
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

async fn run_attempt(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    track: &Track,
    n: u32,
    plan: Plan,
    log: &Mutex<AttemptLog>,
) -> Result<Started, Fail> {
    match plan {
        Plan::Aggregated { engine } => aggregated::run(ctx, sub, track, n, engine, log).await,
        Plan::Split { prefill, decode } => match ctx.parts.cfg.backend {
            Backend::Vllm => vllm_nixl::run(ctx, sub, track, n, prefill, decode, log).await,
            Backend::Sglang => {
                sglang_bootstrap::run(ctx, sub, track, n, prefill, decode, log).await
            }
        },
    }
}

/// A predictive refusal counts one failed, undispatched attempt (controller.md 10.7),
/// recorded in `failures` (the journal's `attempt_failures`; `prompt`: its index in a batch).
pub(super) fn refused_attempt(
    parts: &Parts,
    failures: &mut Vec<AttemptFailure>,
    failure: &RequestFailure,
    attempt: u32,
    prompt: Option<usize>,
) {
    if let RequestFailure::Refused(r) = failure {
        parts.accounting.attempt_failed(Phase::Prefill, r.cause);
        failures.push(AttemptFailure {
            attempt,
            phase: "prefill",
            iid: None,
            reason: r.cause,
            error: r.message.clone(),
            transient: Some(false),
            retry_reason: Some("not_dispatched"),
            prompt,
        });
    }
}
