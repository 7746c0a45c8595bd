//! The SGLang P/D leg protocol with a bootstrap rendezvous (behaviour.md 7.2;
//! docs/design/engine-protocols.md 3): both engines are reserved, the prefill engine's bootstrap
//! port is learned, and the prefill and decode legs run concurrently with the same
//! `bootstrap_host`, `bootstrap_port` and `bootstrap_room`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::Rng;
use serde_json::{Map, Value};
use tracing::Instrument;

use crate::bootstrap;
use crate::breaker::Observation;
use crate::config::secs;
use crate::controller::Track;
use crate::ingress::Endpoint;
use crate::placement::Phase;
use crate::upstream::{ConnectFailure, KvHandoffFailure, LegError, LegId};

use super::aggregated::decode_body;
use super::leg::{
    AbortOnDrop, AttemptLog, Fail, Holds, Output, Started, engine_url, first_token_limit,
    leg_failed, new_leg, relay_options, watched,
};
use super::{Ctx, Sub};
use crate::upstream::Upstream;

/// How long a failed SGLang decode waits for its concurrent prefill's verdict.
pub(super) const PREFILL_VERDICT_WAIT: Duration = Duration::from_secs(1);

/// Runs an SGLang P/D attempt: the prefill leg on `prefill` and the decode leg on `decode`
/// concurrently, until the decode's first token or the first failure.
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
    let chat = ctx.endpoint == Endpoint::Chat;
    // SGLang: reserve both before either leg starts (behaviour.md 7.2 step 1).
    let held_p = AttemptLog::kv_tokens(log, ctx.v, sub.input_len, Holds::Prompt);
    let held_d = AttemptLog::kv_tokens(log, ctx.v, sub.input_len, Holds::Transferred);
    let seat_p = parts.fleet.resident(prefill, Phase::Prefill, held_p);
    let seat_d = parts.fleet.resident(decode, Phase::Decode, held_d);
    let fail_p = |err| leg_failed(Phase::Prefill, prefill, None)(err);
    let port = bootstrap::port(&parts.cfg, &parts.fleet, &parts.upstream, prefill)
        .await
        .map_err(|e| {
            fail_p(match e {
                bootstrap::BootstrapError::Local(c) => LegError::Local(c),
                e => LegError::KvHandoff(KvHandoffFailure::BootstrapPort(e)),
            })
        })?;
    let host = url_host(&parts.cfg.engines[prefill].url)
        .ok_or_else(|| fail_p(LegError::KvHandoff(KvHandoffFailure::NoHost)))?;
    let room: u64 = rand::rng().random::<u64>() >> 1;
    let rv = Rendezvous { host, port, room };
    let pleg = new_leg(ctx, sub, n, "prefill", prefill, log);
    let dleg = new_leg(ctx, sub, n, "decode", decode, log);
    let (pbody, dbody) = sglang_bodies(&sub.body, &rv, &pleg, &dleg, chat);
    let up = parts.upstream.clone();
    let purl = engine_url(ctx, prefill);
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
            let leg = self::prefill(&up, &purl, &pleg, &pbody, limit);
            let r = watched(&task_parts.fleet, prefill, leg).await;
            if r.is_ok() {
                let prefill_s = (task_parts.clock.now() - t0).as_secs_f64();
                task_parts.accounting.prefill_time(prefill_s);
                task_parts.fleet.observe(prefill, Observation::PrefillOk);
            }
            r
        }
        .instrument(pspan),
    ));
    // The decode waits for the prefill's KV (the rendezvous and the transfer) before its first
    // token: the first-token limit (at most 30 s) plus the transfer budget.
    let first_by = (now
        + first_token_limit(parts, false).min(Duration::from_secs(30))
        + parts.cfg.kv_transfer_timeout())
    .min(ctx.deadline);
    let durl = engine_url(ctx, decode);
    let dfut = watched(
        &parts.fleet,
        decode,
        parts.upstream.decode(&durl, &dleg, &dbody, opts, first_by),
    )
    .instrument(tracing::info_span!("decode", engine = %parts.cfg.engines[decode].iid));
    tokio::pin!(dfut);
    let mut prefill_done = false;
    loop {
        tokio::select! {
            r = &mut ptask.0, if !prefill_done => {
                prefill_done = true;
                let r = r.unwrap_or_else(|e| Err(LegError::Connect(ConnectFailure::task_ended(&e))));
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

/// SGLang rendezvous fields.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Rendezvous {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) room: u64,
}

/// Bodies of the two SGLang legs (behaviour.md 7.2 steps 3–4); each leg's `rid` is its
/// leg id (a UUID4).
pub(super) fn sglang_bodies(
    client: &Map<String, Value>,
    rv: &Rendezvous,
    prefill: &LegId,
    decode: &LegId,
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
    let rdv = |m: &mut Map<String, Value>, leg: &LegId| {
        m.insert("bootstrap_host".into(), rv.host.clone().into());
        m.insert("bootstrap_port".into(), rv.port.into());
        m.insert("bootstrap_room".into(), rv.room.into());
        m.insert("rid".into(), leg.id.clone().into());
    };
    rdv(&mut p, prefill);
    let mut d = client.clone();
    if let Some(mct) = d.remove("max_completion_tokens")
        && !d.contains_key("max_tokens")
    {
        d.insert("max_tokens".into(), mct);
    }
    let Value::Object(mut d) = decode_body(&d, None, !chat) else {
        unreachable!("decode_body returns an object")
    };
    rdv(&mut d, decode);
    (Value::Object(p), Value::Object(d))
}

/// Bootstrap host = host of the prefill engine's URL.
pub(super) fn url_host(url: &str) -> Option<String> {
    url.parse::<http::Uri>()
        .ok()?
        .host()
        .map(|h| h.trim_matches(['[', ']']).to_string())
}

/// The SGLang prefill leg: POST and wait for a 200 (behaviour.md 7.2 step 3).
///
/// # Errors
/// The leg's [`LegError`].
pub(super) async fn prefill(
    up: &Upstream,
    url: &str,
    leg: &LegId,
    body: &Value,
    limit: Instant,
) -> Result<(), LegError> {
    up.json_leg(url, leg, body, limit, up.max_answer_bytes(), None)
        .await
        .map(|_| ())
}
