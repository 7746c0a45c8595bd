//! The relay's unit tests and property tests (the byte-level relay against the `serde_json`
//! value rules).

use serde_json::{Value, json};

use crate::aggregate::*;
use crate::answer::*;
use crate::frames::*;
use crate::sse::*;
use crate::stream::*;
use proptest::prelude::*;

fn opts() -> RelayOptions {
    RelayOptions::new(1 << 20, false)
}

/// A non-streaming client that set `return_token_ids` gets, in the assembled answer, the
/// `token_ids` of every chunk (concatenated per choice) and the `prompt_token_ids`, as
/// vLLM's own non-streaming answer carries them (`token_ids` per choice; completions'
/// `prompt_token_ids` per choice, chat's at the top). They were dropped before.
#[test]
fn assembled_answers_keep_the_token_ids_the_relay_kept() {
    let mut a = Aggregator::new(false);
    a.push(
        &json!({"id": "c", "choices": [{"index": 0, "text": "a", "token_ids": [5],
                    "prompt_token_ids": [1, 2]}]}),
    );
    a.push(
        &json!({"choices": [{"index": 0, "text": "b", "token_ids": [6, 7],
                    "finish_reason": "length"}]}),
    );
    let out = a.finish(json!(null));
    assert_eq!(out["choices"][0]["token_ids"], json!([5, 6, 7]), "{out}");
    assert_eq!(
        out["choices"][0]["prompt_token_ids"],
        json!([1, 2]),
        "{out}"
    );
    let mut a = Aggregator::new(true);
    a.push(&json!({"prompt_token_ids": [3], "choices": [{"index": 0,
                    "delta": {"role": "assistant", "content": "x"}, "token_ids": [9]}]}));
    let out = a.finish(json!(null));
    assert_eq!(out["prompt_token_ids"], json!([3]), "{out}");
    assert_eq!(out["choices"][0]["token_ids"], json!([9]), "{out}");
    // Frames the relay stripped (the client did not ask) assemble without them.
    let mut a = Aggregator::new(false);
    a.push(&json!({"choices": [{"index": 0, "text": "a"}]}));
    let out = a.finish(json!(null));
    assert!(out["choices"][0].get("token_ids").is_none(), "{out}");
    assert!(out.get("prompt_token_ids").is_none(), "{out}");
}

/// Feeds one payload; on `Output`, the frames it released, as JSON values.
fn step(s: &mut StreamState, payload: &str) -> (RelayStep, Vec<Value>) {
    let st = s.on_data(payload.as_bytes());
    let out = if st == RelayStep::Output {
        frames(&s.take_output())
    } else {
        Vec::new()
    };
    (st, out)
}

/// The JSON of each `data:` frame of relayed bytes (each frame is one line).
fn frames(out: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(out).expect("relayed frames are UTF-8");
    assert!(text.is_empty() || text.ends_with("\n\n"), "{text:?}");
    text.split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|f| {
            let json = f.strip_prefix("data: ").expect("a data frame");
            assert!(!json.contains('\n'), "one line per frame: {f:?}");
            serde_json::from_str(json).expect("relayed frames are JSON")
        })
        .collect()
}

/// Relays upstream `bytes` cut at `points` through the parser and the state, as the
/// decode leg does; returns the client's bytes and whether `[DONE]` came.
fn relay_cut(state: &mut StreamState, bytes: &[u8], points: &[usize]) -> (Vec<u8>, bool) {
    let mut parser = SseParser::new();
    let mut out = Vec::new();
    let mut done = false;
    for w in points.windows(2) {
        parser.feed(&bytes[w[0]..w[1]], |d| {
            match state.on_data(d) {
                RelayStep::Output => out.extend_from_slice(&state.take_output()),
                RelayStep::Done => done = true,
                RelayStep::Hold => {}
                RelayStep::Failed(f) => panic!("{f:?}"),
            }
            true
        });
    }
    (out, done)
}

fn chunk(text: &str, ids: &[u64]) -> String {
    json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": text, "finish_reason": null, "token_ids": ids}]})
    .to_string()
}

fn stream_text(eol: &str) -> (String, Vec<String>) {
    let payloads = vec![
        chunk("", &[]),
        chunk(" t0", &[5]),
        chunk(" t1", &[6, 7]),
        json!({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}).to_string(),
        "[DONE]".to_string(),
    ];
    let mut s = format!(": keepalive{eol}{eol}");
    for p in &payloads {
        s.push_str(&format!("data: {p}{eol}{eol}"));
    }
    (s, payloads)
}

#[test]
fn parser_handles_multiline_data_and_comments() {
    let mut p = SseParser::new();
    let ev = p.push(b": hi\ndata: a\ndata:b\nevent: x\n\ndata: c\r\n\r\n");
    assert_eq!(ev, vec![SseData("a\nb".into()), SseData("c".into())]);
    // A bare CR terminates a line too.
    let ev = p.push(b"data: d\r\r");
    assert_eq!(ev, vec![SseData("d".into())]);
}

#[test]
fn an_endless_line_or_event_overflows_instead_of_growing() {
    const MAX_SSE_EVENT_BYTES: usize = 1 << 20;
    let mut p = SseParser::with_limit(MAX_SSE_EVENT_BYTES);
    let chunk = vec![b'x'; 64 * 1024];
    for _ in 0..(MAX_SSE_EVENT_BYTES / chunk.len() + 1) {
        assert!(p.push(&chunk).is_empty());
    }
    assert!(p.overflowed());
    assert!(p.line.len() <= MAX_SSE_EVENT_BYTES);
    let mut q = SseParser::with_limit(MAX_SSE_EVENT_BYTES);
    let line = format!("data: {}\n", "y".repeat(64 * 1024));
    for _ in 0..(MAX_SSE_EVENT_BYTES / line.len() + 2) {
        q.push(line.as_bytes());
    }
    assert!(q.overflowed());
}

#[test]
fn unterminated_event_is_discarded_at_end() {
    let mut p = SseParser::new();
    assert!(p.push(b"data: partial").is_empty());
    p.finish();
    assert!(p.push(b"\n\n").is_empty());
}

/// Where to cut a stream of `len` bytes: at every byte (`one_byte`), else at `cuts`
/// (modulo the length); sorted, with both ends.
fn split_points(len: usize, cuts: Vec<usize>, one_byte: bool) -> Vec<usize> {
    let mut points: Vec<usize> = if one_byte {
        (0..=len).collect()
    } else {
        cuts.into_iter().map(|c| c % (len + 1)).collect()
    };
    points.push(0);
    points.push(len);
    points.sort_unstable();
    points.dedup();
    points
}

proptest! {
    /// Any split of the upstream bytes (incl. 1-byte fragments and \r\n) yields the same
    /// events as the whole stream at once.
    #[test]
    fn parser_is_fragmentation_invariant(
        cuts in proptest::collection::vec(0usize..2000, 0..40),
        crlf in any::<bool>(),
        one_byte in any::<bool>(),
    ) {
        let (text, payloads) = stream_text(if crlf { "\r\n" } else { "\n" });
        let bytes = text.as_bytes();
        let points = split_points(bytes.len(), cuts, one_byte);
        let mut parser = SseParser::new();
        let mut got = Vec::new();
        for w in points.windows(2) {
            got.extend(parser.push(&bytes[w[0]..w[1]]).into_iter().map(|d| d.0));
        }
        prop_assert_eq!(got, payloads);
    }
}

proptest! {
    /// Multi-byte UTF-8 (accents, CJK, emoji) split at every byte, or at random points
    /// (inside characters too), through the parser and the relay state: the relayed text
    /// is the engine's, byte for byte, with no replacement characters, and the tokens are
    /// counted from the content-bearing chunks.
    #[test]
    fn multibyte_text_survives_any_split(
        cuts in proptest::collection::vec(0usize..4000, 0..60),
        one_byte in any::<bool>(),
    ) {
        let words = ["héllo", " 世界", " 🦀🦀", " naïve", " ∑x²", " ok"];
        let mut text = String::new();
        for (i, w) in words.iter().enumerate() {
            let c = json!({"choices": [{"index": 0, "text": w, "finish_reason": if i + 1 == words.len() { json!("stop") } else { Value::Null }}]});
            text.push_str(&format!("data: {c}\r\n\r\n"));
        }
        text.push_str("data: [DONE]\n\n");
        let bytes = text.as_bytes();
        let points = split_points(bytes.len(), cuts, one_byte);
        let mut state = StreamState::new(opts());
        let (out, done) = relay_cut(&mut state, bytes, &points);
        let got: String = frames(&out)
            .iter()
            .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
            .collect();
        prop_assert!(done);
        prop_assert_eq!(got, words.concat());
        prop_assert_eq!(state.tokens(), words.len() as u64);
    }
}

#[test]
fn holds_until_first_token_then_flushes_and_strips_token_ids() {
    let mut s = StreamState::new(opts());
    assert_eq!(step(&mut s, &chunk("", &[])).0, RelayStep::Hold);
    assert!(!s.started());
    assert!(s.take_output().is_empty(), "held frames stay held");
    let (RelayStep::Output, out) = step(&mut s, &chunk(" t0", &[5])) else {
        panic!()
    };
    assert_eq!(out.len(), 2, "held chunk flushed with the first token");
    assert!(
        out.iter()
            .all(|c| c["choices"][0].get("token_ids").is_none())
    );
    assert!(s.started());
    let (RelayStep::Output, out) = step(&mut s, &chunk(" t1", &[6, 7])) else {
        panic!()
    };
    assert_eq!(out.len(), 1);
    assert_eq!(s.tokens(), 3);
    // usage-only chunk is dropped unless asked for, but its prompt_tokens are kept
    let usage = json!({"choices": [], "usage": {"prompt_tokens": 9}}).to_string();
    assert_eq!(step(&mut s, &usage).0, RelayStep::Hold);
    assert_eq!(s.prompt_tokens(), Some(9));
    assert_eq!(step(&mut s, "[DONE]").0, RelayStep::Done);
    assert_eq!(s.on_end(), RelayStep::Done);
}

#[test]
fn token_ids_kept_when_client_asked_and_the_usage_chunk_is_held_for_the_server() {
    let mut s = StreamState::new(RelayOptions {
        return_token_ids: true,
        ..opts()
    });
    let (RelayStep::Output, out) = step(&mut s, &chunk(" t0", &[5])) else {
        panic!()
    };
    assert_eq!(out[0]["choices"][0]["token_ids"], json!([5]));
    let usage = json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}});
    assert_eq!(step(&mut s, &usage.to_string()).0, RelayStep::Hold);
    let held = s.take_usage_chunk().expect("the usage chunk is held");
    assert_eq!(
        &held[..],
        usage.to_string().as_bytes(),
        "the engine's bytes"
    );
    assert_eq!(chunk_usage(&held), Some(usage["usage"].clone()));
    assert_eq!(
        s.engine_usage(),
        EngineUsage {
            prompt_tokens: Some(9),
            completion_tokens: Some(4)
        }
    );
    assert_eq!(s.tokens(), 1);
    assert_eq!(
        s.output_tokens(),
        4,
        "the engine's count is the better evidence"
    );
    // Usage inside a content chunk only (no usage-only chunk) is the engine's too.
    let mut s = StreamState::new(opts());
    let c = json!({"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 1}});
    assert_eq!(step(&mut s, &c.to_string()).0, RelayStep::Output);
    assert_eq!(s.take_usage_chunk(), None);
    assert_eq!(
        usage_value(s.engine_usage_value().as_ref(), 3, 1),
        json!({"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6})
    );
}

#[test]
fn failures_before_and_after_output() {
    let mut s = StreamState::new(opts());
    assert_eq!(
        step(&mut s, "[DONE]").0,
        RelayStep::Failed(StreamFailure::DoneBeforeToken)
    );
    let mut s = StreamState::new(opts());
    step(&mut s, &chunk(" t0", &[5]));
    assert_eq!(
        s.on_end(),
        RelayStep::Failed(StreamFailure::EndedWithoutDone)
    );
    let mut s = StreamState::new(opts());
    let e = json!({"error": {"message": "boom", "type": "x", "code": 503}}).to_string();
    assert_eq!(
        step(&mut s, &e).0,
        RelayStep::Failed(StreamFailure::UpstreamError {
            status: 503,
            message: "boom".into()
        })
    );
    let e = json!({"error": {"message": "boom", "code": "weird"}}).to_string();
    assert!(matches!(
        step(&mut StreamState::new(opts()), &e).0,
        RelayStep::Failed(StreamFailure::UpstreamError { status: 500, .. })
    ));
    // An error that is null is no error.
    let fine = json!({"error": null, "choices": [{"index": 0, "text": "x"}]}).to_string();
    assert_eq!(
        step(&mut StreamState::new(opts()), &fine).0,
        RelayStep::Output
    );
    for bad in ["not json", "{\"choices\": [", "{\"a\":1} x", "[1]", "\"s\""] {
        assert!(
            matches!(
                step(&mut StreamState::new(opts()), bad).0,
                RelayStep::Failed(StreamFailure::InvalidFrame(_))
            ),
            "{bad}"
        );
    }
    for (bad, why) in [
        (
            json!({"choices": [{"index": 0, "text": "x", "token_ids": [1, -2]}]}),
            "non-negative",
        ),
        (
            json!({"choices": [{"index": 0, "text": "x", "token_ids": [1.5]}]}),
            "non-negative",
        ),
        (
            json!({"choices": [{"index": 0, "text": "x", "token_ids": "1"}]}),
            "an array",
        ),
    ] {
        match step(&mut StreamState::new(opts()), &bad.to_string()).0 {
            RelayStep::Failed(StreamFailure::InvalidFrame(d)) => {
                assert!(d.contains(why), "{d}")
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
}

#[test]
fn held_frame_limit() {
    let mut s = StreamState::new(opts());
    for _ in 0..MAX_HELD_FRAMES {
        assert_eq!(step(&mut s, &chunk("", &[])).0, RelayStep::Hold);
    }
    assert_eq!(
        step(&mut s, &chunk("", &[])).0,
        RelayStep::Failed(StreamFailure::ResponseLimit)
    );
}

#[test]
fn collected_responses_are_capped() {
    let mut s = StreamState::new(RelayOptions::new(300, true));
    assert_eq!(step(&mut s, &chunk(" t0", &[5])).0, RelayStep::Output);
    let mut last = RelayStep::Hold;
    for _ in 0..5 {
        last = step(&mut s, &chunk(" t1", &[6])).0;
    }
    assert_eq!(last, RelayStep::Failed(StreamFailure::ResponseLimit));
}

/// Engines without `token_ids` (llama.cpp, TGI, older vLLM, SGLang chat): every
/// content-bearing delta counts, whatever kind of content it carries, so a stream that
/// carried content is never "empty".
#[test]
fn content_bearing_chunks_count_without_token_ids() {
    let role = json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]});
    let cases = [
        json!({"choices": [{"index": 0, "delta": {"content": "hi"}}]}),
        json!({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}),
        json!({"choices": [{"index": 0, "delta": {"reasoning": "hm"}}]}),
        json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}),
        json!({"choices": [{"index": 0, "text": " t0", "logprobs": null, "finish_reason": null}]}),
    ];
    for c in cases {
        let mut s = StreamState::new(opts());
        assert_eq!(step(&mut s, &role.to_string()).0, RelayStep::Hold);
        let (st, out) = step(&mut s, &c.to_string());
        assert!(st == RelayStep::Output && out.len() == 2, "{c}");
        assert_eq!(s.tokens(), 1, "{c}");
        assert_eq!(step(&mut s, "[DONE]").0, RelayStep::Done, "{c}");
    }
    // `token_ids: []` beside content: the content is the evidence.
    let mut s = StreamState::new(opts());
    let c = json!({"choices": [{"index": 0, "text": "x", "token_ids": []}]});
    assert_eq!(step(&mut s, &c.to_string()).0, RelayStep::Output);
    assert_eq!(s.tokens(), 1);
    // No content, no ids, no finish: still held.
    let mut s = StreamState::new(opts());
    let empty = json!({"choices": [{"index": 0, "text": "", "finish_reason": null}]});
    assert_eq!(step(&mut s, &empty.to_string()).0, RelayStep::Hold);
    assert_eq!(
        step(&mut s, "[DONE]").0,
        RelayStep::Failed(StreamFailure::DoneBeforeToken)
    );
    // A delta decides alone: text beside an empty delta is not content.
    let mut s = StreamState::new(opts());
    let odd = json!({"choices": [{"index": 0, "text": "x", "delta": {"content": ""}}]});
    assert_eq!(step(&mut s, &odd.to_string()).0, RelayStep::Hold);
}

/// A generation that ends on its first step (EOS, a stop string) streams a choice with an
/// empty text and a finish reason: that is an answer, not an empty stream.
#[test]
fn a_finish_reason_starts_output_even_without_text() {
    let mut s = StreamState::new(opts());
    let fin = json!({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]});
    assert_eq!(step(&mut s, &fin.to_string()).0, RelayStep::Output);
    assert_eq!(s.tokens(), 0);
    assert_eq!(step(&mut s, "[DONE]").0, RelayStep::Done);
}

#[test]
fn usage_is_the_engines_or_marked_estimated() {
    let engine = json!({"prompt_tokens": 13, "completion_tokens": 8, "total_tokens": 21,
                        "prompt_tokens_details": null});
    assert_eq!(usage_value(Some(&engine), 3, 7), engine);
    assert_eq!(
        usage_value(None, 3, 7),
        json!({"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10, "estimated": true})
    );
    assert_eq!(
        usage_value(Some(&json!({"prompt_tokens": 2})), 3, 7)["estimated"],
        true,
        "a usage without completion_tokens is no count"
    );
    assert_eq!(
        usage_value(
            Some(&json!({"prompt_tokens": 2, "completion_tokens": 5})),
            3,
            7
        ),
        json!({"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7})
    );
    assert_eq!(
        usage_value(Some(&json!({"completion_tokens": 5})), 3, 7),
        json!({"completion_tokens": 5, "prompt_tokens": 3, "estimated": true, "total_tokens": 8})
    );
    let sum = sum_usages([&engine, &usage_value(None, 3, 7)]);
    assert_eq!(
        sum,
        json!({"prompt_tokens": 16, "completion_tokens": 15, "total_tokens": 31,
               "prompt_tokens_details": null, "estimated": true})
    );
    assert!(sum_usages([&engine, &engine]).get("estimated").is_none());
}

/// A fanned-out batch's usage keeps the engine's details as vLLM writes them for a batch it
/// answers alone: `null` stays `null` (vLLM without `--enable-prompt-tokens-details`), and
/// `cached_tokens` is summed (with it). Dropping them made a routed batch differ from the same
/// batch sent to vLLM.
#[test]
fn a_batch_usage_keeps_the_engines_details() {
    let part = |p: u64, cached: Option<u64>| {
        json!({"prompt_tokens": p, "completion_tokens": 5, "total_tokens": p + 5,
               "prompt_tokens_details": cached.map(|c| json!({"cached_tokens": c,
                                                               "multimodal_tokens": null})),
               "completion_tokens_details": null})
    };
    assert_eq!(
        sum_usages([&part(3, None), &part(4, None)]),
        json!({"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17,
               "prompt_tokens_details": null, "completion_tokens_details": null})
    );
    assert_eq!(
        sum_usages([&part(300, Some(256)), &part(4, Some(0))]),
        json!({"prompt_tokens": 304, "completion_tokens": 10, "total_tokens": 314,
               "prompt_tokens_details": {"cached_tokens": 256, "multimodal_tokens": null},
               "completion_tokens_details": null})
    );
    assert_eq!(
        sum_usages([&json!({"prompt_tokens": 1, "completion_tokens": 1})]),
        json!({"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}),
        "no details key, none added"
    );
}

#[test]
fn whole_answers_are_cleaned_reindexed_and_streamable() {
    let mut a = json!({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": null,
                     "logprobs": null, "token_ids": [2], "kv_transfer_params": null}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "kv_transfer_params": null});
    sanitize_answer(&mut a, false);
    assert!(a.get("kv_transfer_params").is_none());
    assert!(a["choices"][0].get("token_ids").is_none());
    assert!(a["choices"][0].get("kv_transfer_params").is_none());
    let chunks = answer_chunks(&a, false);
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[0]["choices"][0]["text"], "");
    assert_eq!(chunks[0]["object"], "text_completion");
    // Streamed, the chunk is output (it ends a choice).
    let mut s = StreamState::new(opts());
    assert_eq!(step(&mut s, &chunks[0].to_string()).0, RelayStep::Output);
    reindex(&mut a, 2);
    assert_eq!(a["choices"][0]["index"], 2);
    assert!(a.get("usage").is_none());

    let chat = json!({"id": "c", "created": 1, "model": "m", "choices": [{"index": 0,
        "message": {"role": "assistant", "content": "ok",
                    "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        "finish_reason": "tool_calls"}]});
    let chunks = answer_chunks(&chat, true);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "ok");
    assert_eq!(
        chunks[0]["choices"][0]["delta"]["tool_calls"][0]["index"],
        0
    );
    let mut agg = Aggregator::new(true);
    agg.push(&chunks[0]);
    let back = agg.finish(json!({}));
    assert_eq!(
        back["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "f"
    );
    assert_eq!(back["choices"][0]["finish_reason"], "tool_calls");
}

#[test]
fn aggregator_rebuilds_completion_and_chat() {
    let mut a = Aggregator::new(false);
    for (t, fr) in [(" t0", Value::Null), (" t1", json!("length"))] {
        a.push(&json!({"id": "cmpl-1", "created": 5, "model": "m", "choices": [{"index": 0, "text": t, "finish_reason": fr}]}));
    }
    let usage = json!({"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11});
    let v = a.finish(usage.clone());
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], " t0 t1");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"], usage);

    let mut a = Aggregator::new(true);
    a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}));
    a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"reasoning": "hm", "content": " t0"}}]}));
    a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "x", "function": {"name": "f", "arguments": "{\"a\""}}]}}]}));
    a.push(&json!({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}, "finish_reason": "tool_calls"}]}));
    let v = a.finish(json!({}));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], " t0");
    assert_eq!(v["choices"][0]["message"]["reasoning"], "hm");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        "{\"a\":1}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
}

/// A leg asked for non-streaming but answered as SSE is assembled into one answer: text
/// concatenated, finish reason, the engine's usage or the tokens counted; failures as a
/// streamed leg's.
#[test]
fn streamed_whole_answers_are_assembled() {
    let sse = |frames: &[Value], done: bool| {
        let mut s: String = frames
            .iter()
            .map(|f| format!("data: {f}\r\n\r\n"))
            .collect();
        if done {
            s.push_str("data: [DONE]\n\n");
        }
        s
    };
    let c = |t: &str, fr: Value| {
        json!({"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                                          "choices": [{"index": 0, "text": t, "finish_reason": fr, "token_ids": [7]}]})
    };
    let usage = json!({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}});
    let v = assemble_sse(
        sse(
            &[c(" a", Value::Null), c(" b", json!("length")), usage],
            true,
        )
        .as_bytes(),
        false,
    )
    .unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        (v["id"].clone(), v["model"].clone()),
        (json!("cmpl-1"), json!("m"))
    );
    assert_eq!(v["choices"][0]["text"], " a b");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
    assert_eq!(v["usage"]["completion_tokens"], 2);
    // No usage from the engine: the tokens counted (two token_ids), for usage_value.
    let v = assemble_sse(
        sse(&[c(" a", Value::Null), c(" b", json!("stop"))], true).as_bytes(),
        false,
    )
    .unwrap();
    assert_eq!(v["usage"], json!({"completion_tokens": 2}));
    assert_eq!(usage_value(v.get("usage"), 9, 0)["estimated"], true);
    // Chat deltas become one message.
    let d = |delta: Value, fr: Value| json!({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": fr}]});
    let v = assemble_sse(
        sse(
            &[
                d(json!({"role": "assistant", "content": ""}), Value::Null),
                d(json!({"content": "x"}), Value::Null),
                d(json!({"content": "y"}), json!("stop")),
            ],
            true,
        )
        .as_bytes(),
        true,
    )
    .unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "xy"})
    );
    assert_eq!(v["usage"]["completion_tokens"], 2);
    // Failures are a streamed leg's.
    let err = json!({"error": {"message": "boom", "code": 400}});
    assert_eq!(
        assemble_sse(sse(&[c(" a", Value::Null), err], true).as_bytes(), false),
        Err(StreamFailure::UpstreamError {
            status: 400,
            message: "boom".into()
        })
    );
    assert_eq!(
        assemble_sse(sse(&[c(" a", Value::Null)], false).as_bytes(), false),
        Err(StreamFailure::EndedWithoutDone)
    );
    assert_eq!(
        assemble_sse(sse(&[], true).as_bytes(), false),
        Err(StreamFailure::DoneBeforeToken)
    );
    assert!(matches!(
        assemble_sse(b"data: nope\n\n", false),
        Err(StreamFailure::InvalidFrame(_))
    ));
}

/// An engine that serves a batch interleaves its choices by `index`: each becomes its own
/// choice, in index order, never one merged text (docs/http-api.md).
#[test]
fn aggregator_keeps_interleaved_choices_apart() {
    let mut a = Aggregator::new(false);
    for (i, t) in [(1, "b0"), (0, "a0"), (1, "b1"), (0, "a1")] {
        a.push(&json!({"id": "x", "choices": [{"index": i, "text": t, "finish_reason": null}]}));
    }
    a.push(&json!({"id": "x", "choices": [
        {"index": 0, "text": "", "finish_reason": "length"},
        {"index": 1, "text": "", "finish_reason": "stop"}]}));
    let v = a.finish(json!({}));
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    assert_eq!(
        (choices[0]["index"].clone(), choices[0]["text"].clone()),
        (json!(0), json!("a0a1"))
    );
    assert_eq!(
        (choices[1]["index"].clone(), choices[1]["text"].clone()),
        (json!(1), json!("b0b1"))
    );
    assert_eq!(choices[1]["finish_reason"], "stop");
}

/// The engine's bytes go through untouched: as they came when the client asked for
/// `token_ids`, and minus exactly the `token_ids`/`prompt_token_ids` members otherwise.
#[test]
fn frames_are_the_engines_bytes() {
    let frame = r#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" t\u00e9","logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[5],"prompt_token_ids":[1,2]}],"prompt_token_ids":[1,2]}"#;
    let mut keep = StreamState::new(RelayOptions {
        return_token_ids: true,
        ..opts()
    });
    assert_eq!(keep.on_data(frame.as_bytes()), RelayStep::Output);
    assert_eq!(
        &keep.take_output()[..],
        format!("data: {frame}\n\n").as_bytes()
    );
    let mut strip = StreamState::new(opts());
    assert_eq!(strip.on_data(frame.as_bytes()), RelayStep::Output);
    assert_eq!(
        std::str::from_utf8(&strip.take_output()).unwrap(),
        "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" t\\u00e9\",\"logprobs\":null,\"finish_reason\":null,\"stop_reason\":null}]}\n\n"
    );
    // Whitespace line breaks (a multi-line `data:` event) become spaces: one line each.
    let pretty = serde_json::to_string_pretty(
        &json!({"choices": [{"index": 0, "text": "a\nb", "token_ids": [1]}]}),
    )
    .unwrap();
    let mut s = StreamState::new(opts());
    let mut p = SseParser::new();
    let sse: String = pretty
        .lines()
        .map(|l| format!("data: {l}\n"))
        .collect::<String>()
        + "\n";
    p.feed(sse.as_bytes(), |d| {
        assert_eq!(s.on_data(d), RelayStep::Output);
        true
    });
    let out = s.take_output();
    assert_eq!(
        frames(&out),
        vec![json!({"choices": [{"index": 0, "text": "a\nb"}]})]
    );
    // Invalid UTF-8 from an engine is replaced, never forwarded.
    let mut s = StreamState::new(opts());
    let bad = b"{\"choices\":[{\"index\":0,\"text\":\"a\xffb\"}]}";
    assert_eq!(s.on_data(bad), RelayStep::Output);
    assert_eq!(
        frames(&s.take_output())[0]["choices"][0]["text"],
        "a\u{fffd}b"
    );
}

/// An engine choice index within the batch prompt's index of `u64::MAX` saturates, in the
/// byte-level relay and in `reindex` alike: it overflowed (a panic with overflow checks, a
/// wrap onto another prompt's choice without). Found writing the `relay` fuzz target's
/// property (tests/fuzz/regressions/relay/batch_index_overflow).
#[test]
fn a_batch_index_near_u64_max_saturates() {
    let mut s = StreamState::new(RelayOptions {
        index_base: Some(3),
        ..opts()
    });
    let (st, out) = step(
        &mut s,
        r#"{"choices":[{"index":18446744073709551615,"text":"a"}]}"#,
    );
    assert_eq!(st, RelayStep::Output);
    assert_eq!(
        out,
        vec![json!({"choices": [{"index": u64::MAX, "text": "a"}]})]
    );
    let mut v = json!({"choices": [{"index": u64::MAX - 1}]});
    reindex(&mut v, 3);
    assert_eq!(v, json!({"choices": [{"index": u64::MAX}]}));
}

/// Prompt `k` of a fanned-out batch: its choices become choice `k` (an index added when
/// the engine sent none), a chunk's usage is dropped, and the first chunk's head is kept.
#[test]
fn batch_prompts_are_reindexed_and_keep_their_head() {
    let mut s = StreamState::new(RelayOptions {
        index_base: Some(3),
        capture_head: true,
        ..opts()
    });
    let c = json!({"id": "cmpl-7", "created": 5, "model": "m", "choices": [
        {"index": 0, "text": "a", "token_ids": [1]}, {"text": "b"}, {"token_ids": [2]}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2}});
    let (st, out) = step(&mut s, &c.to_string());
    assert_eq!(st, RelayStep::Output);
    assert_eq!(
        out,
        vec![
            json!({"id": "cmpl-7", "created": 5, "model": "m", "choices": [
            {"index": 3, "text": "a"}, {"index": 3, "text": "b"}, {"index": 3}]})
        ]
    );
    assert_eq!(s.tokens(), 3);
    assert_eq!(s.engine_usage().completion_tokens, Some(2));
    assert_eq!(
        s.head(),
        Some(&Head {
            id: "\"cmpl-7\"".into(),
            created: "5".into(),
            model: "\"m\"".into()
        })
    );
}

/// The parser can stop after any event and go on from where it stopped.
#[test]
fn the_parser_stops_and_resumes() {
    let (text, payloads) = stream_text("\r\n");
    let bytes = text.as_bytes();
    let mut p = SseParser::new();
    let mut got = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let used = p.feed(&bytes[at..], |d| {
            got.push(String::from_utf8(d.to_vec()).unwrap());
            false
        });
        assert!(used > 0);
        at += used;
    }
    assert_eq!(got, payloads);
}

/// The rules of the `Value`-based relay this one replaced, for one frame: the failure,
/// or (tokens, ends a choice, usage counts, usage-only, the frame the client gets).
#[allow(clippy::type_complexity)]
fn reference(
    data: &str,
    o: RelayOptions,
) -> Result<(u64, bool, Option<(Option<u64>, Option<u64>)>, bool, Value), &'static str> {
    let mut v: Value = serde_json::from_str(data).map_err(|_| "not JSON")?;
    if !v.is_object() {
        return Err("not an object");
    }
    if v.get("error").is_some_and(|e| !e.is_null()) {
        return Err("error");
    }
    let usage = v.get("usage").filter(|u| u.is_object()).map(|u| {
        let n = |k: &str| u.get(k).and_then(Value::as_u64);
        (n("prompt_tokens"), n("completion_tokens"))
    });
    let obj = v.as_object_mut().unwrap();
    if obj
        .get("choices")
        .and_then(Value::as_array)
        .is_none_or(Vec::is_empty)
    {
        return Ok((0, false, usage, true, Value::Null));
    }
    let nonempty = |v: Option<&Value>| match v {
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        _ => false,
    };
    let (mut tokens, mut ends) = (0, false);
    for ch in obj["choices"].as_array_mut().unwrap() {
        let Some(ch) = ch.as_object_mut() else {
            continue;
        };
        let ids = match ch.get("token_ids") {
            Some(Value::Array(ids)) if ids.iter().all(Value::is_u64) => ids.len() as u64,
            Some(Value::Array(_)) => return Err("bad ids"),
            Some(Value::Null) | None => 0,
            Some(_) => return Err("ids not an array"),
        };
        let content = match ch.get("delta") {
            Some(d) => [
                "content",
                "reasoning_content",
                "reasoning",
                "tool_calls",
                "function_call",
            ]
            .iter()
            .any(|k| nonempty(d.get(*k))),
            None => nonempty(ch.get("text")),
        };
        tokens += if ids == 0 && content { 1 } else { ids };
        ends |= ch.get("finish_reason").is_some_and(|f| !f.is_null());
        if !o.return_token_ids {
            ch.remove("token_ids");
            ch.remove("prompt_token_ids");
        }
    }
    if !o.return_token_ids {
        obj.remove("prompt_token_ids");
    }
    if let Some(base) = o.index_base {
        reindex(&mut v, base);
    }
    Ok((tokens, ends, usage, false, v))
}

fn arb_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!("")),
        Just(json!("x\u{e9}\"y")),
        Just(json!([])),
        Just(json!([1, 2])),
        Just(json!({})),
        Just(json!({"k": 1})),
        Just(json!(0)),
        Just(json!(true)),
    ]
}

fn arb_ids() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!([])),
        proptest::collection::vec(0u64..100_000, 1..4).prop_map(|v| json!(v)),
        Just(json!([1, -1])),
        Just(json!([2.5])),
        Just(json!("1")),
        Just(Value::Null),
    ]
}

/// A `choices` member: a list of up to two elements, each `choice` or (1 in `element + 1`) an
/// odd leaf, or (1 in `list + 1`) an odd leaf instead of the list.
fn arb_choices(choice: BoxedStrategy<Value>, list: u32, element: u32) -> BoxedStrategy<Value> {
    prop_oneof![
        list => proptest::collection::vec(prop_oneof![element => choice, 1 => arb_leaf().boxed()], 0..3)
            .prop_map(Value::Array),
        1 => arb_leaf(),
    ]
    .boxed()
}

/// An answer's `error` member: mostly `null`, sometimes an engine's error object.
fn arb_error() -> BoxedStrategy<Value> {
    prop_oneof![4 => Just(Value::Null), 1 => Just(json!({"message": "x"}))].boxed()
}

/// Members in a shuffled order, some left out.
fn arb_object(members: Vec<(&'static str, BoxedStrategy<Value>)>) -> impl Strategy<Value = Value> {
    let parts: Vec<_> = members
        .into_iter()
        .map(|(k, s)| proptest::option::weighted(0.6, s).prop_map(move |v| (k, v)))
        .collect();
    parts.prop_shuffle().prop_map(|kv| {
        Value::Object(
            kv.into_iter()
                .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
                .collect(),
        )
    })
}

fn arb_frame() -> impl Strategy<Value = Value> {
    let delta = arb_object(vec![
        ("role", Just(json!("assistant")).boxed()),
        ("content", arb_leaf().boxed()),
        ("reasoning_content", arb_leaf().boxed()),
        ("reasoning", arb_leaf().boxed()),
        ("tool_calls", arb_leaf().boxed()),
        ("function_call", arb_leaf().boxed()),
    ]);
    let choice = arb_object(vec![
        (
            "index",
            prop_oneof![(0u64..4).prop_map(Value::from), Just(json!("x"))].boxed(),
        ),
        ("text", arb_leaf().boxed()),
        (
            "delta",
            prop_oneof![delta.boxed(), Just(Value::Null).boxed()].boxed(),
        ),
        (
            "logprobs",
            prop_oneof![
                arb_leaf(),
                Just(json!({"content": [{"token": "a", "logprob": -0.5}]})),
                Just(json!({"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": null})),
            ]
            .boxed(),
        ),
        (
            "stop_reason",
            prop_oneof![Just(Value::Null), Just(json!("x")), Just(json!(7))].boxed(),
        ),
        (
            "finish_reason",
            prop_oneof![Just(Value::Null), Just(json!("stop"))].boxed(),
        ),
        ("token_ids", arb_ids().boxed()),
        ("prompt_token_ids", arb_ids().boxed()),
    ]);
    let usage = arb_object(vec![
        (
            "prompt_tokens",
            prop_oneof![(0u64..50).prop_map(Value::from), Just(json!(-1))].boxed(),
        ),
        (
            "completion_tokens",
            (0u64..50).prop_map(Value::from).boxed(),
        ),
        ("total_tokens", (0u64..50).prop_map(Value::from).boxed()),
    ]);
    arb_object(vec![
        ("id", Just(json!("cmpl-1")).boxed()),
        ("object", Just(json!("text_completion")).boxed()),
        ("created", Just(json!(7)).boxed()),
        ("model", Just(json!("m")).boxed()),
        ("choices", arb_choices(choice.boxed(), 4, 5)),
        (
            "usage",
            prop_oneof![usage.boxed(), arb_leaf().boxed()].boxed(),
        ),
        ("prompt_token_ids", arb_ids().boxed()),
        ("error", Just(Value::Null).boxed()),
    ])
}

proptest! {
    /// Every token-evidence rule, stripping and reindexing agree with the `Value`-based
    /// rules on any frame (members in any order, compact or pretty, batch or not).
    #[test]
    fn byte_relay_agrees_with_the_value_rules(
        frame in arb_frame(),
        pretty in any::<bool>(),
        keep_ids in any::<bool>(),
        base in proptest::option::of(0u64..3),
    ) {
        let text = if pretty { serde_json::to_string_pretty(&frame) } else { serde_json::to_string(&frame) }.unwrap();
        let o = RelayOptions { return_token_ids: keep_ids, index_base: base, ..opts() };
        let fresh = StreamState::new(o).on_data(text.as_bytes());
        let mut warm = StreamState::new(o);
        prop_assert_eq!(warm.on_data(br#"{"choices":[{"index":0,"text":"w"}]}"#), RelayStep::Output);
        warm.take_output();
        let before = warm.tokens();
        let step = warm.on_data(text.as_bytes());
        match reference(&text, o) {
            Err(why) => prop_assert!(
                matches!(step, RelayStep::Failed(StreamFailure::InvalidFrame(_))),
                "{} {:?}", why, step
            ),
            Ok((tokens, ends, usage, usage_only, want)) => {
                prop_assert_eq!(warm.engine_usage(), EngineUsage {
                    prompt_tokens: usage.and_then(|u| u.0),
                    completion_tokens: usage.and_then(|u| u.1),
                });
                if usage_only {
                    prop_assert_eq!(&step, &RelayStep::Hold);
                    prop_assert_eq!(warm.take_usage_chunk().is_some(), usage.is_some());
                } else {
                    prop_assert_eq!(&step, &RelayStep::Output);
                    prop_assert_eq!(warm.tokens() - before, tokens);
                    prop_assert_eq!(frames(&warm.take_output()), vec![want]);
                    let starts = tokens > 0 || ends;
                    prop_assert_eq!(fresh == RelayStep::Output, starts);
                }
            }
        }
    }
}

#[test]
fn error_frame_shape() {
    let f = error_frame("Upstream request failed", "decode", "failed");
    assert_eq!(
        &f[..],
        b"data: {\"error\":{\"message\":\"Upstream request failed\",\"type\":\"decode\",\"code\":\"failed\"}}\n\n"
    );
}

proptest! {
    /// The aggregator's borrowed view of a frame merges what the whole value merges, for
    /// any frames (members in any order, fields of any type, escapes, batches).
    #[test]
    fn aggregator_view_agrees_with_the_value_merge(
        frames in proptest::collection::vec(arb_frame(), 1..5),
        chat in any::<bool>(),
        pretty in any::<bool>(),
    ) {
        let mut by_view = Aggregator::new(chat);
        let mut by_value = Aggregator::new(chat);
        for f in &frames {
            let text = if pretty { serde_json::to_string_pretty(f) } else { serde_json::to_string(f) }.unwrap();
            // An SSE data line holds one line of JSON.
            let text = text.replace('\n', " ");
            by_view.push_frames(format!("data: {text}\n\n").as_bytes());
            by_value.push(f);
        }
        prop_assert_eq!(by_view.finish(json!(null)), by_value.finish(json!(null)));
    }
}

/// A frame with a duplicate key, an escaped key (merged from its value) or odd fields merges
/// as its value does.
#[test]
fn aggregator_view_merges_odd_frames_as_the_value() {
    let frames = [
        r#"{"id":"a","id":"b","choices":[{"index":0,"text":"x"}]}"#,
        r#"{"choices":[{"index":0,"te\u0078t":"q","delta":{"c\u006fntent":"r"}}]}"#,
        r#"{"choices":[{"index":0,"text":"a\"b\u00e9","delta":{"content":"\n"}}]}"#,
        r#"{"choices":[{"index":"1","text":"y"}]}"#,
        r#"{"choices":[{"index":0,"delta":"z","text":"\u00e9"}]}"#,
    ];
    for chat in [false, true] {
        let mut by_view = Aggregator::new(chat);
        let mut by_value = Aggregator::new(chat);
        for f in frames {
            by_view.push_frames(format!("data: {f}\n\n").as_bytes());
            by_value.push(&serde_json::from_str::<Value>(f).unwrap());
        }
        assert_eq!(by_view.finish(json!(null)), by_value.finish(json!(null)));
    }
}

/// Feeds `frames` to two relays, one that writes SSE for an [`Aggregator`] and one that
/// aggregates in its own scan; both must take the same steps, count the same tokens and the
/// same collected bytes, and (once output started) build the same answer.
fn aggregate_both_ways(
    frames: &[String],
    chat: bool,
    keep_ids: bool,
    base: Option<u64>,
    limit: u64,
) -> Result<(), TestCaseError> {
    let o = RelayOptions {
        return_token_ids: keep_ids,
        index_base: base,
        ..RelayOptions::new(limit, true)
    };
    let mut written = StreamState::new(o);
    let mut by_frames = Aggregator::new(chat);
    let mut scanned = StreamState::new(RelayOptions {
        aggregate: Some(chat),
        ..o
    });
    for f in frames {
        let want = written.on_data(f.as_bytes());
        let got = scanned.on_data(f.as_bytes());
        prop_assert_eq!(&got, &want, "{}", f);
        prop_assert_eq!(scanned.tokens(), written.tokens());
        prop_assert_eq!(scanned.has_output(), written.has_output());
        by_frames.push_frames(&written.take_output());
        prop_assert!(scanned.take_output().is_empty());
        if matches!(want, RelayStep::Failed(_) | RelayStep::Done) {
            break;
        }
    }
    prop_assert_eq!(scanned.engine_usage(), written.engine_usage());
    let agg = scanned.take_aggregator().expect("an aggregating relay");
    if written.started() {
        prop_assert_eq!(agg.finish(json!(null)), by_frames.finish(json!(null)));
    }
    Ok(())
}

proptest! {
    /// A non-streaming answer built in the relay's own scan is the answer built from the
    /// frames it would have written (any frames, token ids kept or not, a batch or not).
    #[test]
    fn an_answer_aggregated_in_the_scan_is_the_relayed_frames_answer(
        frames in proptest::collection::vec(arb_frame(), 1..6),
        chat in any::<bool>(),
        pretty in any::<bool>(),
        keep_ids in any::<bool>(),
        base in proptest::option::of(0u64..3),
        limit in prop_oneof![Just(1u64 << 20), 100u64..600],
    ) {
        let texts: Vec<String> = frames
            .iter()
            .map(|f| if pretty { serde_json::to_string_pretty(f) } else { serde_json::to_string(f) }.unwrap())
            .collect();
        aggregate_both_ways(&texts, chat, keep_ids, base, limit)?;
    }
}

/// The same with keys that have escapes, duplicate members, a frame that is not JSON and
/// `[DONE]`.
#[test]
fn odd_frames_aggregate_in_the_scan_as_from_the_relayed_frames() {
    let frames = [
        r#"{"id":"a","id":"b","choices":[{"index":0,"delta":{"role":"developer"}}]}"#,
        r#"{"choices":[{"index":0,"te\u0078t":"q","delta":{"c\u006fntent":"r"},"token_ids":[4]}]}"#,
        r#"{"choices":[{"index":0,"text":"a\"b\u00e9","delta":{"content":"\n","tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}"#,
        r#"{"choices":[{"index":"1","text":"y","prompt_token_ids":[1],"token_ids":[5]}],"prompt_token_ids":[1]}"#,
        r#"{"choices":[{"index":0,"delta":"z","text":"\u00e9","finish_reason":"stop","stop_reason":7}]}"#,
        r#"{"choices":[7,{"index":1,"finish_reason":null,"logprobs":{"tokens":["y"]}}]}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}"#,
        "[DONE]",
    ]
    .map(String::from);
    for chat in [false, true] {
        for keep_ids in [false, true] {
            for base in [None, Some(2)] {
                aggregate_both_ways(&frames, chat, keep_ids, base, 1 << 20).unwrap();
            }
        }
        aggregate_both_ways(&[frames[0].clone(), "{".into()], chat, false, None, 1 << 20).unwrap();
    }
}

/// A whole answer as an engine may write it: the frame's members plus the KV parameters of a
/// split and usage details, some members of odd types.
fn arb_answer() -> impl Strategy<Value = Value> {
    let kv = prop_oneof![
        Just(Value::Null),
        Just(json!({"remote_engine_id": "e", "remote_block_ids": [1, 2]})),
        arb_leaf(),
    ];
    let choice = arb_object(vec![
        ("index", (0u64..4).prop_map(Value::from).boxed()),
        ("text", arb_leaf().boxed()),
        (
            "message",
            prop_oneof![
                Just(json!({"role": "assistant", "content": "hi"})),
                arb_leaf()
            ]
            .boxed(),
        ),
        ("logprobs", arb_leaf().boxed()),
        (
            "finish_reason",
            prop_oneof![Just(Value::Null), Just(json!("length"))].boxed(),
        ),
        ("token_ids", arb_ids().boxed()),
        ("prompt_token_ids", arb_ids().boxed()),
        ("kv_transfer_params", kv.clone().boxed()),
    ]);
    let details = prop_oneof![
        Just(Value::Null),
        (0u64..9).prop_map(|n| json!({"cached_tokens": n})),
        Just(json!({"cached_tokens": null})),
        Just(json!({"cached_tokens": 1.5, "other": [1]})),
    ];
    let usage = arb_object(vec![
        (
            "prompt_tokens",
            prop_oneof![
                6 => (0u64..50).prop_map(Value::from),
                1 => Just(json!(-1)),
                1 => Just(json!(2.0)),
            ]
            .boxed(),
        ),
        (
            "completion_tokens",
            prop_oneof![5 => (0u64..50).prop_map(Value::from), 1 => Just(json!("3"))].boxed(),
        ),
        ("total_tokens", (0u64..50).prop_map(Value::from).boxed()),
        ("prompt_tokens_details", details.boxed()),
    ]);
    arb_object(vec![
        ("id", Just(json!("cmpl-1")).boxed()),
        ("object", Just(json!("text_completion")).boxed()),
        ("created", Just(json!(7)).boxed()),
        ("model", Just(json!("m")).boxed()),
        ("choices", arb_choices(choice.boxed(), 6, 6)),
        (
            "usage",
            prop_oneof![6 => usage.boxed(), 1 => arb_leaf().boxed()].boxed(),
        ),
        ("prompt_token_ids", arb_ids().boxed()),
        ("kv_transfer_params", kv.boxed()),
        ("error", arb_error()),
    ])
}

/// What the value path makes of a whole answer for the client (`upstream::json_leg`'s checks,
/// then `finish_whole`): `None` where it fails the leg (an error member, no choices array).
fn value_path(answer: &Value, return_token_ids: bool) -> Option<Value> {
    if answer.get("error").is_some_and(|e| !e.is_null())
        || !answer.get("choices").is_some_and(Value::is_array)
    {
        return None;
    }
    let mut a = answer.clone();
    sanitize_answer(&mut a, return_token_ids);
    let usage = usage_value(a.get("usage"), 999, 888);
    a["usage"] = usage;
    Some(a)
}

proptest! {
    /// Whenever the byte scan cleans an answer, its bytes parse to the value the value path
    /// builds, and its counts are that value's usage (members in any order, compact or
    /// pretty, any types).
    #[test]
    fn a_cleaned_answer_is_the_value_paths_answer(
        answer in arb_answer(),
        pretty in any::<bool>(),
        return_token_ids in any::<bool>(),
    ) {
        let text = if pretty { serde_json::to_string_pretty(&answer) } else { serde_json::to_string(&answer) }.unwrap();
        // The generated answers have no escaped or repeated keys: every one the value path
        // serves with the engine's complete usage takes the byte path.
        let u = &answer["usage"];
        let complete = u["prompt_tokens"].is_u64() && u["completion_tokens"].is_u64() && u["total_tokens"].is_u64();
        let served = value_path(&answer, return_token_ids).is_some();
        prop_assert_eq!(clean_answer(text.as_bytes(), return_token_ids).is_some(), served && complete, "{}", text);
        if let Some((bytes, facts)) = clean_answer(text.as_bytes(), return_token_ids) {
            let cleaned: Value = serde_json::from_slice(&bytes).expect("cleaned bytes are JSON");
            let want = value_path(&answer, return_token_ids);
            prop_assert_eq!(Some(&cleaned), want.as_ref(), "{}", text);
            let u = &cleaned["usage"];
            prop_assert_eq!(Some(facts.prompt_tokens), u["prompt_tokens"].as_u64());
            prop_assert_eq!(Some(facts.completion_tokens), u["completion_tokens"].as_u64());
            prop_assert_eq!(facts.cached_tokens, u["prompt_tokens_details"]["cached_tokens"].as_u64());
        }
    }
}

/// A vLLM answer with its usage takes the byte path: KV parameters and unrequested token ids
/// go, the rest is the engine's bytes; answers the value path must handle do not.
#[test]
fn a_vllm_answer_is_cleaned_in_one_scan_and_odd_ones_are_left_to_the_value_path() {
    let answer = r#"{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":" a b","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":[5,6],"prompt_logprobs":null,"prompt_token_ids":[1,2,3],"kv_transfer_params":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":2}},"prompt_logprobs":null,"prompt_token_ids":null,"kv_transfer_params":{"do_remote_prefill":true}}"#;
    let (bytes, facts) = clean_answer(answer.as_bytes(), false).expect("the byte path");
    assert_eq!(
        std::str::from_utf8(&bytes).unwrap(),
        r#"{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":" a b","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":2}},"prompt_logprobs":null}"#
    );
    assert_eq!(
        facts,
        AnswerFacts {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: Some(2)
        }
    );
    let (kept, _) = clean_answer(answer.as_bytes(), true).expect("the byte path");
    assert!(
        std::str::from_utf8(&kept)
            .unwrap()
            .contains(r#""token_ids":[5,6]"#)
    );
    for odd in [
        // No usage, or one to complete: the value path estimates.
        r#"{"choices":[{"text":"a"}]}"#,
        r#"{"choices":[],"usage":{"completion_tokens":1,"total_tokens":1}}"#,
        // An error member, or no choices array: the value path fails the leg.
        r#"{"error":{"message":"x"},"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
        r#"{"choices":{},"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
        // An escaped key, a watched member twice, not JSON.
        r#"{"ch\u006fices":[],"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
        r#"{"choices":[],"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}"#,
    ] {
        assert!(clean_answer(odd.as_bytes(), false).is_none(), "{odd}");
    }
}

/// A vLLM prefill answer: the descriptor in the first choice, at the top, both, neither, null
/// or not an object, in a choice list of any shape.
fn arb_prefill_answer() -> impl Strategy<Value = Value> {
    let desc = prop_oneof![
        4 => (0u64..9).prop_map(|n| json!({"remote_engine_id": format!("e{n}"), "remote_block_ids": [n, n + 1],
                                           "remote_host": "h", "remote_port": 5600})),
        1 => Just(Value::Null),
        1 => Just(json!({})),
        1 => arb_leaf(),
    ];
    let choice = arb_object(vec![
        ("index", Just(json!(0)).boxed()),
        ("text", arb_leaf().boxed()),
        (
            "finish_reason",
            prop_oneof![Just(json!("length")), Just(json!("stop"))].boxed(),
        ),
        ("kv_transfer_params", desc.clone().boxed()),
    ]);
    arb_object(vec![
        ("id", Just(json!("cmpl-1")).boxed()),
        ("choices", arb_choices(choice.boxed(), 6, 6)),
        (
            "usage",
            Just(json!({"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})).boxed(),
        ),
        ("kv_transfer_params", desc.boxed()),
        ("error", arb_error()),
    ])
}

proptest! {
    /// The span the byte scan finds is the descriptor the value path reads
    /// (`choices[0].kv_transfer_params`, else the top level's), and it finds one whenever the
    /// value path would read an object from an answer without an error and with a choices
    /// list (the generated answers have no escaped or repeated keys).
    #[test]
    fn the_descriptor_span_is_the_value_paths_descriptor(
        answer in arb_prefill_answer(),
        pretty in any::<bool>(),
    ) {
        let text = if pretty { serde_json::to_string_pretty(&answer) } else { serde_json::to_string(&answer) }.unwrap();
        let by_value = (answer.get("error").is_none_or(Value::is_null)
            && answer.get("choices").is_some_and(Value::is_array))
            .then(|| {
                answer
                    .pointer("/choices/0/kv_transfer_params")
                    .filter(|v| !v.is_null())
                    .or_else(|| answer.get("kv_transfer_params").filter(|v| !v.is_null()))
            })
            .flatten()
            .filter(|d| d.is_object());
        let by_span = descriptor_span(text.as_bytes())
            .map(|r| serde_json::from_str::<Value>(&text[r]).expect("the span is JSON"));
        prop_assert_eq!(by_span.as_ref(), by_value, "{}", text);
    }
}
