//! Unit tests of the completion pipeline's pure pieces (plans, batches, answers).

use serde_json::{Value, json};

use super::aggregated::{decode_body, whole_body};
use super::attempt::shape_plan;
use super::relay_io::{finish_whole, merge_answers};
use super::sglang_bootstrap::{Rendezvous, sglang_bodies, url_host};
use super::vllm_nixl::{extract_descriptor, prefill_aborted, prefill_finished, vllm_prefill_body};
use super::*;
use crate::config::Backend;
use crate::failure::RequestFailure;
use crate::ingress::{self, Endpoint, Validated};
use crate::placement::Plan;
use crate::upstream::LegId;
use narwhal_relay::usage_value;
use serde_json::Map;

fn validated(body: &str) -> Validated {
    ingress::validate(
        Endpoint::Completions,
        body.as_bytes(),
        crate::config::Served {
            model: "m",
            adapters: &[],
        },
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
                assert_eq!(b.error.param, Some(v.prompt_logprobs.unwrap().into()));
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
    let u =
        |p: u64, c: u64| json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
    let merged = merge_answers(
        vec![
            answer("a", u(2, 3)),
            answer("b", u(4, 3)),
            answer("c", usage_value(None, 1, 3)),
        ],
        1,
    );
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
        choices: 1,
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

// The leg protocols' bodies (aggregated, vLLM NIXL, SGLang bootstrap).

#[test]
fn descriptor_is_validated_and_carried_verbatim() {
    let d = json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "e", "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 5, "remote_request_id": "r", "tp_size": 1});
    assert_eq!(
        extract_descriptor(&json!({"kv_transfer_params": d})).unwrap(),
        d
    );
    assert_eq!(
        extract_descriptor(&json!({"choices": [{"kv_transfer_params": d}]})).unwrap(),
        d
    );
    let hybrid = json!({"remote_engine_id": "e", "remote_block_ids": [[1], [2, 3]]});
    assert!(extract_descriptor(&json!({"kv_transfer_params": hybrid})).is_ok());
    for bad in [
        json!({}),
        json!({"kv_transfer_params": {}}),
        json!({"kv_transfer_params": {"remote_engine_id": "", "remote_block_ids": [1]}}),
        json!({"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": [-1]}}),
        json!({"kv_transfer_params": {"remote_engine_id": "e"}}),
    ] {
        assert!(extract_descriptor(&bad).is_err(), "{bad}");
    }
}

#[test]
fn leg_bodies() {
    let client: Map<String, Value> = serde_json::from_value(json!({
        "model": "m", "prompt": "p", "stream": true, "n": 1, "min_tokens": 2,
        "max_completion_tokens": 9, "stream_options": {"include_usage": false}
    }))
    .unwrap();
    let p = vllm_prefill_body(&client);
    assert_eq!(p["max_tokens"], 1);
    assert_eq!(p["stream"], false);
    assert_eq!(p["kv_transfer_params"], json!({"do_remote_decode": true}));
    assert_eq!(
        p["min_tokens"], 1,
        "the prefill may not end the generation early"
    );
    for k in ["stream_options", "n", "best_of", "max_completion_tokens"] {
        assert!(p.get(k).is_none(), "{k}");
    }
    let d = decode_body(&client, Some(&json!({"remote_engine_id": "e"})), true);
    assert_eq!(d["stream"], true);
    assert_eq!(d["return_token_ids"], true);
    assert_eq!(d["stream_options"]["include_usage"], true);
    assert_eq!(d["kv_transfer_params"]["remote_engine_id"], "e");
    let rv = Rendezvous {
        host: "10.0.0.1".into(),
        port: 8998,
        room: 42,
    };
    let (pl, dl) = (
        LegId::new("rid", None, 1, "prefill"),
        LegId::new("rid", None, 1, "decode"),
    );
    let (p, d) = sglang_bodies(&client, &rv, &pl, &dl, false);
    assert_eq!(p["rid"], pl.id.as_str());
    assert_eq!(d["rid"], dl.id.as_str());
    assert!(uuid::Uuid::parse_str(&pl.id).is_ok() && pl.id != dl.id);
    assert_eq!(p["bootstrap_room"], 42);
    assert_eq!(d["bootstrap_port"], 8998);
    assert_eq!(d["max_tokens"], 9);
    assert_eq!(d["return_token_ids"], true);
    let (_, d) = sglang_bodies(&client, &rv, &pl, &dl, true);
    assert!(d.get("return_token_ids").is_none());
}

/// A prefill without a descriptor is a finished answer only when its generation ended
/// (EOS, a stop string; `length` only for a one-token request): vLLM's NIXL connector
/// hands off only length-capped prefills (docs/engine-protocols.md).
#[test]
fn a_prefill_that_ended_the_generation_is_a_finished_answer() {
    let answer = |fr: Value, kv: Value| {
        json!({"choices": [{"index": 0, "text": "", "finish_reason": fr}],
               "kv_transfer_params": kv})
    };
    assert!(prefill_finished(
        &answer(json!("stop"), Value::Null),
        Some(8)
    ));
    assert!(prefill_finished(&answer(json!("stop"), Value::Null), None));
    assert!(!prefill_finished(
        &answer(json!("length"), Value::Null),
        Some(8)
    ));
    assert!(prefill_finished(
        &answer(json!("length"), Value::Null),
        Some(1)
    ));
    assert!(!prefill_finished(
        &answer(json!("abort"), Value::Null),
        Some(8)
    ));
    assert!(!prefill_finished(
        &answer(Value::Null, Value::Null),
        Some(8)
    ));
    assert!(!prefill_finished(
        &answer(json!("stop"), json!({"remote_engine_id": "e"})),
        Some(8)
    ));
    assert!(!prefill_finished(&json!({"choices": []}), Some(8)));
}

/// A prefill that answered 200 with `finish_reason: "abort"` is the engine's abort (retried on
/// another prefill), never a finished answer; any other answer without a descriptor is not.
#[test]
fn a_prefill_answered_abort_is_the_engines_abort() {
    let answer = |fr: Value| json!({"choices": [{"index": 0, "text": "", "finish_reason": fr}]});
    assert!(prefill_aborted(&answer(json!("abort"))));
    assert!(!prefill_finished(&answer(json!("abort")), Some(6)));
    assert!(!prefill_aborted(&answer(json!("stop"))));
    assert!(!prefill_aborted(&answer(json!("length"))));
    assert!(!prefill_aborted(&answer(Value::Null)));
    assert!(!prefill_aborted(&json!({"choices": []})));
    assert!(!prefill_aborted(&json!({"error": {"message": "abort"}})));
    let err = crate::upstream::LegError::Aborted(crate::upstream::EngineAbort::PrefillAborted);
    assert!(err.transient(), "retried on another prefill");
    assert_eq!(err.reason(), "engine_aborted");
    assert_eq!(
        err.class(crate::placement::Phase::Prefill),
        Some(crate::breaker::FailureClass::KvHandoff),
        "charged to the engine as a prefill without a handoff"
    );
}

#[test]
fn whole_leg_body_and_leg_ids() {
    let client: Map<String, Value> = serde_json::from_value(json!({
        "model": "m", "prompt": "p", "stream": false, "stream_options": {"include_usage": true}
    }))
    .unwrap();
    let w = whole_body(&client);
    assert_eq!(w["stream"], false);
    assert!(w.get("stream_options").is_none());
    assert!(w.get("return_token_ids").is_none());
    let a = LegId::new("r", Some(3), 2, "decode");
    assert_eq!(a.label, "p3-a2-decode");
    assert!(uuid::Uuid::parse_str(&a.id).is_ok());
    assert_ne!(a.id, LegId::new("r", Some(3), 2, "decode").id);
}

#[test]
fn the_bootstrap_host_is_the_prefill_urls_host() {
    assert_eq!(url_host("http://127.0.0.1:8000"), Some("127.0.0.1".into()));
}

/// `n` > 1 is the engine's to sample on an aggregated placement and refused across a split,
/// in the split's terms (vLLM serves prompt logprobs unsplit, so there `n` passes too).
#[test]
fn sampling_width_passes_aggregated_and_is_refused_across_a_split() {
    let split = Plan::Split {
        prefill: 0,
        decode: 1,
    };
    let agg = Plan::Aggregated { engine: 1 };
    let v = validated(r#"{"prompt":"a","n":3}"#);
    for backend in [Backend::Vllm, Backend::Sglang] {
        assert_eq!(shape_plan(agg, &v, backend).ok(), Some(agg));
        match shape_plan(split, &v, backend) {
            Err(RequestFailure::Invalid(e)) => {
                assert!(e.to_string().contains("across a split"), "{e}");
                assert_eq!(e.response().0, StatusCode::BAD_REQUEST);
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    }
    let with_logprobs = validated(r#"{"prompt":"a","n":3,"prompt_logprobs":1}"#);
    assert_eq!(
        shape_plan(split, &with_logprobs, Backend::Vllm).ok(),
        Some(agg)
    );
}

/// A fanned-out batch stream's usage chunk is the first prompt's engine chunk with the summed
/// usage: vLLM's `system_fingerprint` (and whatever else the engine wrote there) is kept, as in
/// the same batch streamed by vLLM alone; before, the router wrote a chunk of its own without it.
#[test]
fn a_batch_streams_the_engines_usage_chunk_with_the_sum() {
    let chunk = br#"{"id":"cmpl-1","object":"text_completion","created":5,"model":"tiny","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8},"system_fingerprint":"vllm-0.32.0-x"}"#;
    let sum = json!({"prompt_tokens": 6, "completion_tokens": 10, "total_tokens": 16});
    let frame = super::relay_io::summed_engine_chunk(chunk, &sum).expect("a JSON chunk");
    let text = std::str::from_utf8(&frame).expect("utf-8");
    let body: Value = serde_json::from_str(
        text.strip_prefix("data: ")
            .and_then(|t| t.strip_suffix("\n\n"))
            .expect("an SSE data frame"),
    )
    .expect("JSON");
    assert_eq!(
        body,
        json!({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "tiny",
               "choices": [], "usage": sum, "system_fingerprint": "vllm-0.32.0-x"})
    );
    assert!(super::relay_io::summed_engine_chunk(b"[DONE]", &sum).is_none());
}
