//! vLLM plugin: `/version`, `/v1/models`, NIXL descriptor handoff (behaviour.md 5.2, 7.1).
//!
//! Producer: `POST /v1/completions` with `kv_transfer_params: {"do_remote_decode": true}`,
//! `max_tokens: 1`, `stream: false`; the descriptor is `choices[0].kv_transfer_params`, else
//! the top-level `kv_transfer_params`, and must carry a non-empty `remote_engine_id` and a
//! `remote_block_ids` list. Consumer: a streamed completion with that descriptor as its
//! `kv_transfer_params`; a failed fetch shows up as an HTTP error or an in-stream error frame
//! (vLLM's default `kv_load_failure_policy: "fail"`), or only in `vllm:nixl_num_failed_transfers`
//! (policy `"recompute"`). Transfer evidence: the NIXL connector families of `/metrics`
//! ([`crate::evidence::VLLM_NIXL`]).

use narwhal_shared::check_request::{CheckCompletion, KvTransferRequest};
use narwhal_shared::{EngineFacts, LegResult};
use serde_json::Value;

use super::{
    BoxFuture, Dialect, EngineCtx, EngineError, EnginePlugin, check_prompt, failed, get_json,
    post_json, served_models, stream_tokens,
};
use crate::evidence::{TransferMetrics, VLLM_NIXL};

/// The vLLM plugin (stateless).
#[derive(Debug, Clone, Copy, Default)]
pub struct VllmPlugin;

/// Checks a NIXL descriptor as the router does (behaviour.md 7.1 step 3).
pub(crate) fn descriptor(resp: &Value) -> Result<Value, String> {
    let d = resp
        .pointer("/choices/0/kv_transfer_params")
        .filter(|v| v.is_object())
        .or_else(|| resp.get("kv_transfer_params").filter(|v| v.is_object()))
        .ok_or("no kv_transfer_params in the prefill answer")?;
    validate_descriptor(d)
}

/// Checks a KV descriptor (`kv_transfer_params` of a prefill answer) as [`descriptor`] does and
/// returns it.
///
/// # Errors
/// What is missing or malformed, naming the member.
pub(crate) fn validate_descriptor(d: &Value) -> Result<Value, String> {
    if !d.is_object() {
        return Err("no kv_transfer_params in the prefill answer".into());
    }
    let engine_ok = d
        .get("remote_engine_id")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty());
    if !engine_ok {
        return Err("kv_transfer_params.remote_engine_id missing or empty".into());
    }
    let blocks_ok = d
        .get("remote_block_ids")
        .and_then(Value::as_array)
        .is_some_and(|a| {
            a.iter().all(|b| {
                b.as_u64().is_some()
                    || b.as_array()
                        .is_some_and(|inner| inner.iter().all(|x| x.as_u64().is_some()))
            })
        });
    if !blocks_ok {
        return Err("kv_transfer_params.remote_block_ids is not a list of block ids".into());
    }
    Ok(d.clone())
}

impl EnginePlugin for VllmPlugin {
    fn dialect(&self) -> Dialect {
        Dialect::Vllm
    }

    fn transfer_metrics(&self) -> TransferMetrics {
        VLLM_NIXL
    }

    fn facts<'a>(&'a self, ctx: &'a EngineCtx) -> BoxFuture<'a, Result<EngineFacts, EngineError>> {
        Box::pin(async move {
            let v = get_json(ctx, "/version").await?;
            let version = v
                .get("version")
                .and_then(Value::as_str)
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .ok_or_else(|| EngineError::Shape {
                    path: "/version".into(),
                    reason: "no non-empty \"version\" string".into(),
                })?
                .to_string();
            Ok(EngineFacts {
                dialect: "vllm".into(),
                version,
                models: served_models(ctx).await?,
                bootstrap_port: None,
            })
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
            let mut body = CheckCompletion::new(model, check_prompt(check_id), 1);
            body.kv_transfer_params = Some(KvTransferRequest::PREFILL.to_value());
            let out = post_json(ctx, "/v1/completions", &body).await;
            let latency_s = ctx.clock.now().duration_since(started).as_secs_f64();
            match out {
                Err(e) => (failed(latency_s, e.to_string()), None),
                Ok(resp) => match descriptor(&resp) {
                    Err(e) => (failed(latency_s, format!("no handoff: {e}")), None),
                    Ok(d) => {
                        let tokens = resp
                            .pointer("/usage/completion_tokens")
                            .and_then(Value::as_u64)
                            .unwrap_or(1);
                        let leg = LegResult {
                            ok: true,
                            tokens,
                            latency_s,
                            error: None,
                        };
                        (leg, Some(d))
                    }
                },
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
            if let Some(kv) = kv {
                if let Err(e) = validate_descriptor(kv) {
                    return failed(0.0, format!("bad descriptor: {e}"));
                }
                body.kv_transfer_params = Some(kv.clone());
            }
            stream_tokens(ctx, "/v1/completions", &body, Some(request_id)).await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn descriptor_from_choices_or_top_level_and_validated() {
        let d = json!({"do_remote_prefill": true, "remote_engine_id": "abc",
            "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 5600});
        assert_eq!(
            descriptor(&json!({"choices": [{"kv_transfer_params": d}]})).unwrap(),
            d
        );
        assert_eq!(
            descriptor(&json!({"choices": [{}], "kv_transfer_params": d})).unwrap(),
            d
        );
        let hybrid = json!({"remote_engine_id": "x", "remote_block_ids": [[1], [2, 3]]});
        assert!(descriptor(&json!({"kv_transfer_params": hybrid})).is_ok());
        assert!(descriptor(&json!({"choices": []})).is_err());
        assert!(
            descriptor(
                &json!({"kv_transfer_params": {"remote_engine_id": "", "remote_block_ids": []}})
            )
            .is_err()
        );
        assert!(
            descriptor(
                &json!({"kv_transfer_params": {"remote_engine_id": "x", "remote_block_ids": [-1]}})
            )
            .is_err()
        );
    }
}
