//! SGLang plugin: `/server_info`, `/v1/models`, Mooncake bootstrap rendezvous
//! (behaviour.md 5.2, 7.2).
//!
//! Producer: reads `disaggregation_bootstrap_port` from `/server_info`, picks a random 63-bit
//! `bootstrap_room`, and starts the prefill request (`max_tokens: 1`, `stream: false`, the
//! rendezvous fields) in the background, because SGLang's prefill waits for the decode side to
//! join the room. It answers with the rendezvous `{"bootstrap_host", "bootstrap_port",
//! "bootstrap_room"}` unless the prefill fails within [`EARLY_FAILURE_WINDOW`]. Consumer: a
//! streamed completion with the rendezvous fields. Transfer evidence: the disaggregation families
//! of `/metrics` ([`crate::evidence::SGLANG_DISAGGREGATION`]), and the consumer's
//! `/server_info` `disaggregation_mode`: only a `decode`-mode server joins a rendezvous (a `null`-
//! mode server ignores the bootstrap fields and recomputes the prompt, a `prefill`-mode one
//! cannot decode from a peer).

use std::time::Duration;

use narwhal_shared::check_request::{Bootstrap, CheckCompletion};
use narwhal_shared::{EngineFacts, LegResult};
use serde_json::Value;

use super::{
    BoxFuture, Dialect, EngineCtx, EngineError, EnginePlugin, check_prompt, failed, get_json,
    get_text, post_json, served_models, stream_tokens,
};
use crate::evidence::{SGLANG_DISAGGREGATION, TransferCounters, TransferMetrics};

/// How long the producer waits for an early prefill failure before answering.
pub(crate) const EARLY_FAILURE_WINDOW: Duration = Duration::from_millis(250);

/// The SGLang plugin (stateless).
#[derive(Debug, Clone, Copy, Default)]
pub struct SglangPlugin;

/// Checks a rendezvous handed in by the router.
pub(crate) fn rendezvous(kv: &Value) -> Result<(String, u64, u64), String> {
    let host = kv
        .get("bootstrap_host")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or("kv.bootstrap_host missing")?;
    let port = kv
        .get("bootstrap_port")
        .and_then(Value::as_u64)
        .filter(|p| (1..=65535).contains(p))
        .ok_or("kv.bootstrap_port missing or not a port")?;
    let room = kv
        .get("bootstrap_room")
        .and_then(Value::as_u64)
        .filter(|r| *r < (1 << 63))
        .ok_or("kv.bootstrap_room missing or not a 63-bit integer")?;
    Ok((host.to_string(), port, room))
}

/// Why a server in disaggregation `mode` (`/server_info`) cannot receive KV through a
/// rendezvous; `None` for `decode` or an unknown mode (not published: no claim either way).
pub(crate) fn cannot_receive(mode: Option<&str>) -> Option<String> {
    match mode {
        None | Some("decode") => None,
        Some(m) => Some(format!(
            "the consumer's /server_info says disaggregation_mode {m:?}: only a decode-mode \
             SGLang server receives KV through a bootstrap rendezvous (it served the prompt \
             without the transfer)"
        )),
    }
}

impl EnginePlugin for SglangPlugin {
    fn dialect(&self) -> Dialect {
        Dialect::Sglang
    }

    fn facts<'a>(&'a self, ctx: &'a EngineCtx) -> BoxFuture<'a, Result<EngineFacts, EngineError>> {
        Box::pin(async move {
            // /server_info also carries API keys on real SGLang: read only what we need.
            let info = get_json(ctx, "/server_info").await?;
            let version = info
                .get("version")
                .and_then(Value::as_str)
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .ok_or_else(|| EngineError::Shape {
                    path: "/server_info".into(),
                    reason: "no non-empty \"version\" string".into(),
                })?
                .to_string();
            let bootstrap_port = info
                .get("disaggregation_bootstrap_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok());
            Ok(EngineFacts {
                dialect: "sglang".into(),
                version,
                models: served_models(ctx).await?,
                bootstrap_port,
            })
        })
    }

    fn standalone_prefill(&self) -> bool {
        false
    }

    fn transfer_metrics(&self) -> TransferMetrics {
        SGLANG_DISAGGREGATION
    }

    fn transfer_counters<'a>(
        &'a self,
        ctx: &'a EngineCtx,
    ) -> BoxFuture<'a, Option<TransferCounters>> {
        Box::pin(async move {
            let mode = match get_json(ctx, "/server_info").await {
                Ok(info) => info
                    .get("disaggregation_mode")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                Err(e) => {
                    tracing::debug!(error = %e, "server_info unreadable: mode not checked");
                    None
                }
            };
            let mut counters = match get_text(ctx, "/metrics").await {
                Ok(page) => TransferCounters::from_page(SGLANG_DISAGGREGATION, &page),
                Err(e) => {
                    tracing::debug!(error = %e, "engine metrics unreadable: no transfer counters");
                    TransferCounters {
                        metrics: SGLANG_DISAGGREGATION,
                        transfers: None,
                        failures: None,
                        prompt_sources: None,
                        cannot_receive: None,
                    }
                }
            };
            counters.cannot_receive = cannot_receive(mode.as_deref());
            Some(counters)
        })
    }

    fn produce<'a>(
        &'a self,
        ctx: &'a EngineCtx,
        model: &'a str,
        check_id: &'a str,
    ) -> BoxFuture<'a, (LegResult, Option<Value>)> {
        Box::pin(async move {
            let started = ctx.clock.now();
            let elapsed = || ctx.clock.now().duration_since(started).as_secs_f64();
            let port = match get_json(ctx, "/server_info").await {
                Ok(info) => info
                    .get("disaggregation_bootstrap_port")
                    .and_then(Value::as_u64),
                Err(e) => return (failed(elapsed(), e.to_string()), None),
            };
            let Some(port) = port else {
                return (
                    failed(
                        elapsed(),
                        "/server_info has no disaggregation_bootstrap_port".into(),
                    ),
                    None,
                );
            };
            let room: u64 = rand::random::<u64>() >> 1;
            let rendezvous = Bootstrap {
                bootstrap_host: ctx.bootstrap_host.clone(),
                bootstrap_port: Some(port),
                bootstrap_room: room,
            };
            // A host, a port and a room always serialise.
            let kv = serde_json::to_value(&rendezvous).unwrap_or_default();
            let mut body = CheckCompletion::new(model, check_prompt(check_id), 1);
            body.bootstrap = Some(rendezvous);
            body.rid = Some(format!("narwhal-check-{check_id}-prefill"));
            let task_ctx = ctx.clone();
            let check = check_id.to_string();
            let mut prefill = tokio::spawn(async move {
                let out = post_json(&task_ctx, "/v1/completions", &body).await;
                if let Err(e) = &out {
                    tracing::warn!(check.id = %check, error = %e, "sglang prefill leg failed");
                }
                out
            });
            match tokio::time::timeout(EARLY_FAILURE_WINDOW, &mut prefill).await {
                Ok(Ok(Err(e))) => (failed(elapsed(), e.to_string()), None),
                Ok(Err(join)) => (failed(elapsed(), format!("prefill task: {join}")), None),
                // Finished fine, or still waiting for the decode side: the room is open.
                Ok(Ok(Ok(_))) | Err(_) => {
                    let leg = LegResult {
                        ok: true,
                        tokens: 0,
                        latency_s: elapsed(),
                        error: None,
                    };
                    (leg, Some(kv))
                }
            }
        })
    }

    fn consume<'a>(
        &'a self,
        ctx: &'a EngineCtx,
        model: &'a str,
        check_id: &'a str,
        kv: Option<&'a Value>,
        request_id: &'a str,
    ) -> BoxFuture<'a, LegResult> {
        Box::pin(async move {
            let mut body = CheckCompletion::new(model, check_prompt(check_id), 2).streamed(true);
            body.rid = Some(request_id.to_string());
            if let Some(kv) = kv {
                let (host, port, room) = match rendezvous(kv) {
                    Ok(r) => r,
                    Err(e) => return failed(0.0, format!("bad rendezvous: {e}")),
                };
                body.bootstrap = Some(Bootstrap {
                    bootstrap_host: host,
                    bootstrap_port: Some(port),
                    bootstrap_room: room,
                });
            }
            stream_tokens(ctx, "/v1/completions", &body, None).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_a_decode_mode_server_can_receive() {
        assert_eq!(cannot_receive(Some("decode")), None);
        assert_eq!(cannot_receive(None), None);
        let why = cannot_receive(Some("null")).expect("null mode cannot receive");
        assert!(why.contains("disaggregation_mode \"null\""), "{why}");
        assert!(cannot_receive(Some("prefill")).is_some());
    }

    #[test]
    fn rendezvous_fields_are_checked() {
        let ok =
            json!({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 5});
        assert_eq!(rendezvous(&ok).unwrap(), ("127.0.0.1".into(), 8998, 5));
        assert!(
            rendezvous(&json!({"bootstrap_host": "h", "bootstrap_port": 0, "bootstrap_room": 1}))
                .is_err()
        );
        assert!(
            rendezvous(
                &json!({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": u64::MAX})
            )
            .is_err()
        );
        assert!(rendezvous(&json!({"bootstrap_port": 1, "bootstrap_room": 1})).is_err());
    }
}
