//! The request path against engines that are not the simulator's shape (docs/http-api.md,
//! docs/deviations.md "Serving path"), end to end: a real `narwhal-serve` over in-process fake
//! engines (`FakeEngine`), which record every leg the router sends.
//!
//! - A request the P/D split cannot serve exactly is fanned out (a prompt batch: one prefill,
//!   one descriptor and one decode per prompt, answered as one choice per prompt), served
//!   unsplit (prompt logprobs, vLLM) or refused 400 naming the field (prompt logprobs,
//!   SGLang) — never garbled.
//! - A prefill that already finished the generation (EOS or a stop string: no descriptor) is
//!   the answer, and nobody is charged for it.
//! - Engines without `token_ids` or `usage` are served and counted; usage is the engine's,
//!   marked `estimated` only when the engine gave none; a non-streaming client's request goes
//!   to an aggregated engine non-streaming.
//! - Engine errors keep the engine's status and words, never an empty message.
//! - `GET /v1/models/{model}` answers as OpenAI's does.

use narwhal_shared::documents::replies::ErrorDetail;
use narwhal_shared::documents::{ErrorReply, ModelCard, ModelList};
use narwhal_testkit::readers::ExactUsage;
use narwhal_testkit::{
    Answer, FakeEngine, Reply, RequestRow, RouterHandle, WAIT, eventually, parse_document,
    parse_row, router_over_fakes, sse_data,
};
use serde::Deserialize;
use serde_json::{Value, json};

/// A leg's body as the engine received it: the fields read here (`None`: absent or `null`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct LegBody {
    /// One prompt (a string) or a batch.
    prompt: Option<Value>,
    /// The leg asked for a stream.
    stream: Option<bool>,
    /// vLLM's descriptor.
    kv_transfer_params: Option<Value>,
}

/// A vLLM prefill/decode pair of fakes and a router over them.
async fn pd(backend: &str, p: &FakeEngine, d: &FakeEngine) -> RouterHandle {
    router_over_fakes(
        backend,
        &[("p0", p, "prefill"), ("d0", d, "decode")],
        json!({}),
    )
    .await
}

/// One aggregated engine (role `decode`, no prefill engine) and a router over it.
async fn aggregated(e: &FakeEngine) -> RouterHandle {
    router_over_fakes("vllm", &[("e0", e, "decode")], json!({})).await
}

/// The parsed data chunks of an SSE body, `[DONE]` left out.
fn chunks(body: &str) -> Vec<Value> {
    sse_data(body)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// The chunks of a streamed answer that must be a 200 ending with `data: [DONE]`.
fn done_chunks(a: &Reply) -> Vec<Value> {
    assert_eq!(a.status, 200, "{}", a.text());
    assert!(
        a.text().trim_end().ends_with("data: [DONE]"),
        "{}",
        a.text()
    );
    chunks(&a.text())
}

/// Concatenated text per choice index of streamed completion chunks.
fn texts_by_index(chunks: &[Value]) -> std::collections::BTreeMap<u64, String> {
    let mut out = std::collections::BTreeMap::new();
    for c in chunks {
        let c: Answer = parse_row(c);
        for ch in c.choices.iter().flatten() {
            let i = ch.index.expect("choice index");
            let t = ch.text.as_deref().unwrap_or_default();
            out.entry(i).or_insert_with(String::new).push_str(t);
        }
    }
    out
}

/// The request's journal row (waits for it).
async fn journal_row(r: &RouterHandle, rid: &str) -> RequestRow {
    eventually("the request's journal row", WAIT, || async {
        r.request_rows().into_iter().find(|row| row.rid == rid)
    })
    .await
}

/// The `error` of an error answer.
fn error_of(a: &Reply) -> ErrorDetail {
    parse_document::<ErrorReply>(&a.what, &a.text()).error
}

/// Whether the router has ejected nothing.
async fn nothing_ejected(r: &RouterHandle) -> bool {
    r.state().await.ejected.is_empty()
}

/// `prompt: [a, b, c]` (and a list of token-id lists) on a P/D fleet is served as one request per
/// prompt — each its own prefill leg with a single prompt, its own descriptor and decode leg — and
/// answered with one choice per prompt, choice `k` carrying prompt `k`'s answer, streaming or not,
/// with the prompts' usage summed. Before: one prefill leg for the whole batch, one shared
/// descriptor, one merged choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_batch_is_fanned_out_one_descriptor_per_prompt() {
    let (p, d) = (FakeEngine::new(0, 3), FakeEngine::new(0, 3).tag_prompt());
    let r = pd("vllm", &p, &d).await;
    let prompts = ["alpha one", "beta two", "gamma three"];
    let body = json!({"model": "tiny-sim", "prompt": prompts, "max_tokens": 3});
    let a = r.post_data("/v1/completions", &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let v = a.json();
    let answer: Answer = parse_row(&v);
    let choices = answer.choices.as_ref().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    for (k, prompt) in prompts.iter().enumerate() {
        assert_eq!(choices[k].index, Some(k as u64), "{v}");
        assert_eq!(
            choices[k].text.as_deref(),
            Some(format!(" {prompt}:t0 {prompt}:t1 {prompt}:t2").as_str()),
            "choice {k} is prompt {k}'s answer: {v}"
        );
    }
    // wire shape: `usage` has exactly these keys.
    assert_eq!(
        ExactUsage::of(&v),
        ExactUsage::new(21, 9),
        "the prompts' usages summed: {v}"
    );
    // wire shape: the legs as the engines received them (request bodies, not documents).
    {
        let (ps, ds) = (p.seen(), d.seen());
        let mut pre: Vec<String> = ps
            .prefill
            .iter()
            .map(|(_, b)| match parse_row::<LegBody>(b).prompt {
                Some(Value::String(p)) => p,
                other => panic!("one prompt per prefill leg: {other:?}"),
            })
            .collect();
        pre.sort_unstable();
        assert_eq!(pre, prompts, "one prefill leg per prompt");
        assert_eq!(ds.decode.len(), 3, "one decode leg per prompt");
        for (_, b) in &ds.decode {
            let leg: LegBody = parse_row(b);
            assert!(matches!(leg.prompt, Some(Value::String(_))), "{b}");
            assert!(
                matches!(leg.kv_transfer_params, Some(Value::Object(_))),
                "own descriptor: {b}"
            );
        }
        let ids: std::collections::BTreeSet<_> = ps
            .prefill
            .iter()
            .chain(ds.decode.iter())
            .filter_map(|(id, _)| id.clone())
            .collect();
        assert_eq!(ids.len(), 6, "one request id per leg");
    }
    let row = journal_row(&r, a.header("x-request-id")).await;
    assert_eq!(row.terminal, "completed", "{row:?}");
    assert_eq!(row.output_len, Some(9), "{row:?}");
    assert_eq!(row.legs.len(), 6, "{row:?}");

    // Streaming, with usage: each index carries its own prompt's text; one usage chunk.
    let body = json!({"model": "tiny-sim", "prompt": prompts, "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}});
    let a = r.post_data("/v1/completions", &body).await;
    let cs = done_chunks(&a);
    let texts = texts_by_index(&cs);
    assert_eq!(texts.len(), 3, "{}", a.text());
    for (k, prompt) in prompts.iter().enumerate() {
        assert_eq!(
            texts[&(k as u64)],
            format!(" {prompt}:t0 {prompt}:t1 {prompt}:t2"),
            "{}",
            a.text()
        );
    }
    // wire shape: one chunk carries a `usage` key at all.
    let usages: Vec<&Value> = cs.iter().filter(|c| c.get("usage").is_some()).collect();
    assert_eq!(usages.len(), 1, "one usage chunk: {}", a.text());
    let usage_chunk: Answer = parse_row(usages[0]);
    assert_eq!(usage_chunk.usage().completion_tokens, Some(9));
    assert_eq!(usage_chunk.choice_count(), Some(0));

    // A list of token-id lists is a batch too; a list of integers is one prompt.
    let a = r
        .post_data(
            "/v1/completions",
            &json!({"model": "tiny-sim", "prompt": [[11, 12, 13], [21, 22, 23]], "max_tokens": 3}),
        )
        .await;
    assert_eq!(a.status, 200, "{}", a.text());
    assert_eq!(parse_row::<Answer>(&a.json()).choice_count(), Some(2));
    let a = r
        .post_data(
            "/v1/completions",
            &json!({"model": "tiny-sim", "prompt": [11, 12, 13], "max_tokens": 3}),
        )
        .await;
    assert_eq!(parse_row::<Answer>(&a.json()).choice_count(), Some(1));
    // Over serving.max_batch_prompts (64): refused, naming the field.
    let many: Vec<String> = (0..65).map(|i| format!("p{i}")).collect();
    let a = r
        .post_data(
            "/v1/completions",
            &json!({"model": "tiny-sim", "prompt": many, "max_tokens": 1}),
        )
        .await;
    assert_eq!(a.status, 400, "{}", a.text());
    assert_eq!(error_of(&a).param, Some(json!("prompt")));
}

/// Prompt logprobs (`prompt_logprobs`, or `echo` with `logprobs`) are computed where the prompt is
/// prefilled; a vLLM decode engine given them with a KV descriptor fails. vLLM: served unsplit on
/// the decode engine (no prefill leg, no descriptor, the fields kept); SGLang: 400 naming the
/// field. Before: split, the decode leg carried both the fields and the descriptor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_logprobs_never_reach_a_decode_leg_with_a_descriptor() {
    let (p, d) = (FakeEngine::new(0, 3), FakeEngine::new(0, 3));
    let r = pd("vllm", &p, &d).await;
    for (extra, field) in [
        (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
        (json!({"echo": true, "logprobs": 1}), "echo"),
    ] {
        for stream in [false, true] {
            let mut body = json!({"model": "tiny-sim", "prompt": "score this", "max_tokens": 3,
                                  "stream": stream});
            narwhal_testkit::merge(&mut body, extra.clone());
            let a = r.post_data("/v1/completions", &body).await;
            assert_eq!(a.status, 200, "{body}: {}", a.text());
            let ds = d.seen();
            let (_, leg) = ds.decode.last().expect("a decode leg");
            // wire shape: the leg the engine received has no descriptor key.
            assert!(leg.get("kv_transfer_params").is_none(), "unsplit: {leg}");
            assert_eq!(
                leg[field], body[field],
                "the field reaches the engine: {leg}"
            );
        }
    }
    assert!(p.seen().prefill.is_empty(), "no prefill leg for them");
    // wire shape: no leg the engine received has a descriptor key.
    assert!(
        d.seen()
            .decode
            .iter()
            .all(|(_, b)| b.get("kv_transfer_params").is_none())
    );

    let (sp, sd) = (FakeEngine::new(0, 3), FakeEngine::new(0, 3));
    let s = pd("sglang", &sp, &sd).await;
    for (extra, field) in [
        (json!({"prompt_logprobs": 1}), "prompt_logprobs"),
        (json!({"echo": true, "logprobs": 1}), "echo"),
    ] {
        let mut body = json!({"model": "tiny-sim", "prompt": "score this", "max_tokens": 3});
        narwhal_testkit::merge(&mut body, extra);
        let a = s.post_data("/v1/completions", &body).await;
        assert_eq!(a.status, 400, "{body}: {}", a.text());
        assert_eq!(error_of(&a).param, Some(json!(field)), "{}", a.text());
    }
    assert!(sp.seen().prefill.is_empty() && sd.seen().decode.is_empty());
    assert!(nothing_ejected(&s).await);
}

/// A vLLM prefill whose one token ended the generation (`finish_reason: "stop"`, no
/// `kv_transfer_params`: the NIXL connector hands off only length-capped prefills) is a finished
/// answer: 200 with that choice and its usage, streaming or not, no decode leg, no breaker charge,
/// nothing ejected. Before: 502 `prefill`, and the prefill engine ejected after three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_finished_the_generation_is_the_answer() {
    let (p, d) = (
        FakeEngine::new(0, 3).prefill_finishes("stop"),
        FakeEngine::new(0, 3),
    );
    let r = pd("vllm", &p, &d).await;
    for _ in 0..4 {
        let a = r.completion("say nothing", 8).await;
        assert_eq!(a.status, 200, "{}", a.text());
        let v = a.json();
        let choice = parse_row::<Answer>(&v)
            .choice(0)
            .cloned()
            .unwrap_or_default();
        assert_eq!(choice.finish_reason.as_deref(), Some("stop"), "{v}");
        assert_eq!(choice.text.as_deref(), Some(""), "{v}");
        // wire shape: `usage` has exactly these keys, and the answer no descriptor key.
        assert_eq!(
            ExactUsage::of(&v),
            ExactUsage::new(7, 1),
            "the prefill engine's usage: {v}"
        );
        assert!(v.get("kv_transfer_params").is_none(), "{v}");
    }
    let a = r
        .post_data(
            "/v1/chat/completions",
            &json!({"model": "tiny-sim", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    let cs = done_chunks(&a);
    let first: Answer = parse_row(&cs[0]);
    assert_eq!(first.object.as_deref(), Some("chat.completion.chunk"));
    assert_eq!(
        first.choice(0).and_then(|c| c.finish_reason.as_deref()),
        Some("stop")
    );
    let last: Answer = parse_row(cs.last().unwrap());
    assert_eq!(last.usage().completion_tokens, Some(1));
    assert!(d.seen().decode.is_empty(), "no decode leg");
    let st = r.state().await;
    assert!(st.ejected.is_empty(), "{st:?}");
    assert_eq!((st.served, st.failed), (5, 0));
}

/// An engine that sends no `token_ids` (llama.cpp, TGI, older vLLM) is served, streaming or not,
/// and its tokens are counted from the content it streamed; a non-streaming client's request
/// reaches it non-streaming, and the answer's usage is the engine's. Nothing is ejected. Before:
/// `[DONE] before any token`, 502, the engine ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_without_token_ids_is_served_and_counted() {
    let e = FakeEngine::new(0, 4).without_token_ids();
    let r = aggregated(&e).await;
    let mut rids = Vec::new();
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 4, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "tiny-sim", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 4, "stream": true}),
        ),
    ] {
        let a = r.post_data(path, &body).await;
        done_chunks(&a);
        rids.push(a.header("x-request-id").to_string());
    }
    for rid in &rids {
        let row = journal_row(&r, rid).await;
        assert_eq!(row.terminal, "completed", "{row:?}");
        assert_eq!(row.output_len, Some(4), "tokens counted: {row:?}");
    }
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = if path.contains("chat") {
            json!({"model": "tiny-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        } else {
            json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 4})
        };
        let a = r.post_data(path, &body).await;
        assert_eq!(a.status, 200, "{path}: {}", a.text());
        let v = a.json();
        // wire shape: `usage` has exactly these keys (no `estimated`).
        assert_eq!(
            ExactUsage::of(&v),
            ExactUsage::new(7, 4),
            "the engine's usage: {v}"
        );
        let seen = e.seen();
        // wire shape: the leg as the engine received it.
        let (_, leg) = seen.decode.last().expect("a leg");
        assert_eq!(
            parse_row::<LegBody>(leg).stream,
            Some(false),
            "sent non-streaming: {leg}"
        );
        assert!(leg.get("stream_options").is_none(), "{leg}");
    }
    assert!(nothing_ejected(&r).await);
}

/// Usage is the engine's in every answer, and marked `estimated` only when the engine gave none: a
/// streaming client asking `include_usage` of an engine that streams no usage gets a usage chunk
/// with the tokens streamed, marked; one whose engine sends usage gets the engine's chunk unmarked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_the_engines_or_marked_estimated() {
    let body = json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 5, "stream": true,
                      "stream_options": {"include_usage": true}});
    let silent = FakeEngine::new(0, 5).without_token_ids().without_usage();
    let r = aggregated(&silent).await;
    let a = r.post_data("/v1/completions", &body).await;
    assert_eq!(a.status, 200, "{}", a.text());
    let cs = chunks(&a.text());
    let u = parse_row::<Answer>(cs.last().expect("chunks")).usage();
    assert_eq!(u.completion_tokens, Some(5), "{}", a.text());
    assert_eq!(u.estimated, Some(true), "{}", a.text());
    assert_eq!(u.total_tokens, Some(u.prompt_tokens.unwrap() + 5));
    let a = r.completion("hello", 5).await;
    assert_eq!(
        parse_row::<Answer>(&a.json()).usage().estimated,
        Some(true),
        "{}",
        a.text()
    );

    let talking = FakeEngine::new(0, 5);
    let r = aggregated(&talking).await;
    let a = r.post_data("/v1/completions", &body).await;
    let cs = chunks(&a.text());
    let last = cs.last().expect("chunks");
    assert_eq!(
        parse_row::<Answer>(last).usage().prompt_tokens,
        Some(7),
        "{}",
        a.text()
    );
    // wire shape: no `estimated` key in the usage, no `token_ids` key in any choice.
    assert!(
        last.get("usage").and_then(|u| u.get("estimated")).is_none(),
        "{}",
        a.text()
    );
    assert!(
        cs.iter().all(|c| c
            .get("choices")
            .and_then(|cs| cs.get(0))
            .and_then(|c| c.get("token_ids"))
            .is_none()),
        "token ids stripped (not asked for)"
    );
}

/// An engine's error keeps its status and its words (a context-length 400 stays a 400 with the
/// engine's message, streaming or not), and an engine error without a message is never relayed with
/// an empty one. Client faults eject nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_errors_keep_their_status_and_words() {
    const CTX: &str =
        "This model's maximum context length is 16 tokens. However, you requested 99 tokens.";
    let e = FakeEngine::new(0, 3).decode_error(400, CTX);
    let r = aggregated(&e).await;
    for stream in [false, true] {
        let a = r
            .post_data(
                "/v1/completions",
                &json!({"model": "tiny-sim", "prompt": "long", "max_tokens": 3, "stream": stream}),
            )
            .await;
        assert_eq!(a.status, 400, "stream={stream}: {}", a.text());
        assert_eq!(error_of(&a).message, CTX, "stream={stream}");
    }
    let bare = FakeEngine::new(0, 3).decode_error(422, "");
    let r2 = aggregated(&bare).await;
    let a = r2.completion("x", 3).await;
    assert_eq!(a.status, 422, "{}", a.text());
    assert_eq!(
        error_of(&a).message,
        "the engine answered 422 Unprocessable Entity without a message"
    );
    assert!(nothing_ejected(&r).await);
    assert!(nothing_ejected(&r2).await);
}

/// `GET /v1/models/{model}` answers as OpenAI's does: the model object (`id`, `object`, `created`,
/// `owned_by`) for the served model, a 404 `model_not_found` naming any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_retrieve_answers_as_openai() {
    let e = FakeEngine::new(0, 1);
    let r = aggregated(&e).await;
    let a = r.get_data("/v1/models/tiny-sim").await;
    assert_eq!(a.status, 200, "{}", a.text());
    // A card parses only with `created` an integer and `owned_by` a string.
    let m: ModelCard = parse_document(&a.what, &a.text());
    assert_eq!(m.id, "tiny-sim");
    assert_eq!(m.object, "model");
    let a = r.get_data("/v1/models/org%2Fother").await;
    assert_eq!(a.status, 404, "{}", a.text());
    let err = error_of(&a);
    assert_eq!(err.code, Some(json!("model_not_found")));
    assert_eq!(err.message, "The model 'org/other' does not exist");
    let a = r.get_data("/v1/models").await;
    let list: ModelList = parse_document(&a.what, &a.text());
    assert!(!list.data.is_empty(), "{list:?}");
}
