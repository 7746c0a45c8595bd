//! Entry points for the fuzz targets (`tests/fuzz`, docs/testing.md "Fuzzing"), compiled only
//! with the `fuzzing` feature so the router's crate-private parsers stay private in every
//! other build.
//!
//! Each function takes the bytes a peer controls, runs them through the router's own parser
//! exactly as the serving path does, and panics when a property beyond "no panic" breaks
//! (each function's doc says which). Nothing here does IO or reads a clock: the KV stream
//! takes its `now`.
//!
//! ```text
//!  client body  ──ingress()────► ingress::validate (both routes, both backends), check_batch
//!  drain/readmit body ─lifecycle_body()─► lifecycle::api::parse_drain / parse_readmit
//!  ZMQ messages ──kv_stream()──► kv_stream::parse ──► KvIndex sequence/apply/restart/fill
//! ```

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::Value;

use crate::config::Backend;
use crate::ingress::{self, Endpoint, IngressError};
use crate::kv_index::{KvIndex, Seq, Settings, keyed_chain};
use crate::lifecycle::api::{parse_drain, parse_readmit};

/// The configured model the fuzzed bodies are validated against.
const MODEL: &str = "fuzz-model";
const SERVED: crate::config::Served<'static> = crate::config::Served {
    model: MODEL,
    adapters: &[],
};

/// Runs one client body through ingress for both routes and both backends.
///
/// # Panics
/// When a rule breaks: an accepted body is not an object or does not carry the configured
/// model, sizes a request below one token, counts batch prompts that
/// `batch_prompts` does not return; a refused body's answer is not a 4xx with
/// `{"error": {"message": <non-empty>, "type": ...}}`; `InvalidJson` disagrees with
/// `serde_json`; the same body validated twice gives two answers.
pub fn ingress(body: &[u8]) {
    let is_json = serde_json::from_slice::<Value>(body).is_ok();
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        for backend in [Backend::Vllm, Backend::Sglang] {
            let got = ingress::validate(endpoint, body, SERVED, backend, 4.0);
            assert_eq!(
                got,
                ingress::validate(endpoint, body, SERVED, backend, 4.0),
                "validate is not deterministic"
            );
            match got {
                Ok(v) => {
                    assert_eq!(v.body.get("model"), Some(&Value::from(MODEL)));
                    assert!(v.input_len >= 1, "input_len {} < 1", v.input_len);
                    assert!(v.prompt_count >= 1);
                    if v.prompt_count > 1 {
                        let prompts = ingress::batch_prompts(&v).expect("a batch has prompts");
                        assert_eq!(prompts.len(), v.prompt_count);
                        for p in prompts {
                            assert!(ingress::size_prompt(p, 4.0) >= 1);
                        }
                    }
                    let limit = 4;
                    assert_eq!(
                        ingress::check_batch(&v, limit).is_err(),
                        v.prompt_count > limit
                    );
                    // The body the router forwards must serialise back to JSON it can read.
                    let text = serde_json::to_vec(&v.body).expect("serialises");
                    assert!(serde_json::from_slice::<Value>(&text).is_ok());
                }
                Err(e) => {
                    assert_eq!(
                        matches!(e, IngressError::InvalidJson),
                        !is_json,
                        "InvalidJson must mean serde_json refuses the body: {e}"
                    );
                    let (status, answer) = e.response();
                    assert!(status.is_client_error(), "{status} for {e}");
                    assert!(!answer.error.message.is_empty(), "no message for {e:?}");
                    assert!(!answer.error.kind.is_empty(), "no type for {e:?}");
                }
            }
        }
    }
}

/// Runs one lifecycle request body through the drain and the readmission parsers.
///
/// # Panics
/// When an accepted drain's `deadline_s` is outside (0, one year], or a refusal's message is
/// empty.
pub fn lifecycle_body(body: &[u8]) {
    let b = Bytes::copy_from_slice(body);
    match parse_drain(&b) {
        Ok(d) => assert!(
            d.deadline_s.is_finite() && d.deadline_s > 0.0 && d.deadline_s <= 31_536_000.0,
            "deadline_s {}",
            d.deadline_s
        ),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    match parse_readmit(&b) {
        Ok(_) => {}
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// Feeds ZMQ messages (each its frames, as a KV event subscriber receives them) of one
/// engine, one second apart from `start`, to a fresh KV index the way the subscriber does:
/// decode, classify the sequence number, apply, restart or fill (with no replay), then score
/// a prompt made of the stored token ids.
///
/// # Panics
/// When a message the index accepted leaves it without a next sequence number, or a credit
/// exceeds the prompt.
pub fn kv_stream(messages: &[Vec<Bytes>], start: Instant) {
    let mut index = KvIndex::with(&[true], Settings::default());
    let mut tokens: Vec<u32> = Vec::new();
    for (i, frames) in messages.iter().enumerate() {
        let now = start + Duration::from_secs(i as u64);
        let Some((seq, batch)) = narwhal_shared::kv_stream::parse(frames) else {
            continue;
        };
        for ev in &batch.events {
            if let narwhal_shared::kv_events::KvEvent::BlockStored { token_ids, .. } = ev {
                tokens.extend(token_ids.iter().take(4096));
            }
        }
        match index.sequence(0, seq, true) {
            Seq::Next => index.apply(0, seq, &batch, now),
            Seq::Restarted => index.restart(0, seq, &batch, now),
            Seq::Gap { from } => {
                index.fill(0, from, None, seq, &batch, now);
            }
            Seq::Old => continue,
        }
        index.note_live(0, seq);
        assert!(index.next_seq(0).is_some(), "no next seq after {seq}");
        let bs = index.credit_block_size(0);
        assert!(bs >= 1);
        let chain = keyed_chain(&tokens, bs, 0);
        let prompt = tokens.len() as u64;
        let credit = index.credit(0, &chain, prompt, now);
        assert!(
            credit.cached <= prompt,
            "credited {} of {prompt}",
            credit.cached
        );
    }
}
