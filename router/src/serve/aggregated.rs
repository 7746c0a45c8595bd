//! The aggregated leg protocol: one engine prefills and decodes. A streaming client gets the
//! engine's decode stream; a non-streaming client's request goes to the engine whole
//! (`stream: false`), so the answer, its usage and its errors are the engine's. The bodies of
//! both legs (the decode body is also the vLLM decode leg's, with the descriptor).

use std::sync::Mutex;

use serde_json::{Map, Value};
use tracing::Instrument;

use crate::config::Backend;
use crate::controller::Track;
use crate::ingress::Endpoint;
use crate::placement::Phase;
use crate::upstream::WholeAnswer;

use super::leg::{
    AttemptLog, Fail, Holds, Output, Started, engine_url, first_token_limit, leg_failed, new_leg,
    relay_options, watched,
};
use super::{Ctx, Sub};

/// Runs an aggregated attempt on `engine` until its first output (a whole answer for a
/// non-streaming client).
pub(super) async fn run(
    ctx: &Ctx<'_>,
    sub: &Sub<'_>,
    track: &Track,
    n: u32,
    engine: usize,
    log: &Mutex<AttemptLog>,
) -> Result<Started, Fail> {
    let parts = ctx.parts;
    let opts = relay_options(ctx, sub);
    let now = parts.clock.now();
    let sglang = parts.cfg.backend == Backend::Sglang;
    let chat = ctx.endpoint == Endpoint::Chat;
    // A non-streaming client's request goes to the engine non-streaming (a whole leg):
    // the answer, its usage and its errors are the engine's (docs/deviations.md).
    let whole = !ctx.v.stream;
    let held = AttemptLog::kv_tokens(log, ctx.v, sub.input_len, Holds::Everything);
    let seat = parts.fleet.resident(engine, Phase::Decode, held);
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
    let span = tracing::info_span!("decode", engine = %parts.cfg.engines[engine].iid, whole);
    let failed = leg_failed(Phase::Decode, engine, None);
    let engine_url = engine_url(ctx, engine);
    let out = if whole {
        let rti = ctx.v.return_token_ids;
        let answer = parts
            .upstream
            .whole_answer(&engine_url, &leg, &body, ctx.deadline, chat, rti);
        let answer = watched(&parts.fleet, engine, answer)
            .instrument(span)
            .await
            .map_err(failed)?;
        track.first_token();
        match answer {
            WholeAnswer::Clean(clean) => Output::Clean(clean),
            WholeAnswer::Value(v) => Output::Whole(v),
        }
    } else {
        let first_by = (now + first_token_limit(parts, false)).min(ctx.deadline);
        let live = parts
            .upstream
            .decode(&engine_url, &leg, &body, opts, first_by);
        let live = watched(&parts.fleet, engine, live)
            .instrument(span)
            .await
            .map_err(failed)?;
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

/// Body of a whole leg (a non-streaming client on an aggregated engine): the client body as
/// sent, `stream: false`, without `stream_options` (vLLM refuses them on a non-streaming
/// request) and without any KV parameters.
pub(super) fn whole_body(client: &Map<String, Value>) -> Value {
    let mut b = client.clone();
    b.remove("kv_transfer_params");
    b.remove("stream_options");
    b.insert("stream".into(), false.into());
    Value::Object(b)
}

/// Body of a decode leg (vLLM or aggregated): streaming with usage and token ids, plus the
/// descriptor when given (behaviour.md 7.1 step 6).
pub(super) fn decode_body(
    client: &Map<String, Value>,
    descriptor: Option<&Value>,
    token_ids: bool,
) -> Value {
    let mut b = client.clone();
    b.remove("kv_transfer_params");
    b.insert("stream".into(), true.into());
    if token_ids {
        b.insert("return_token_ids".into(), true.into());
    }
    let mut so = b
        .get("stream_options")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    so.insert("include_usage".into(), true.into());
    b.insert("stream_options".into(), Value::Object(so));
    if let Some(d) = descriptor {
        b.insert("kv_transfer_params".into(), d.clone());
    }
    Value::Object(b)
}
