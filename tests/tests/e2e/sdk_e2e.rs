//! The official `openai` Python SDK against the simulator fleet (docs/testing.md): a P/D
//! fleet (one prefill, one decode simulator) of each dialect behind the real `narwhal-serve`,
//! driven through `tests/python/sdk_driver.py`. Every request shape a user sends must come back
//! as something the SDK parses and that validates strictly against the SDK's own types, and
//! every error must surface as the SDK's typed exception (`BadRequestError`, `NotFoundError`,
//! `RateLimitError`, `InternalServerError`, all `APIStatusError`s) with the router's message.
//!
//! Needs the Python test venv (`tests/python/ensure-venv.sh`); built with `NARWHAL_SKIP_VENV=1`
//! every test here is ignored instead (see `pysdk.rs`; never in CI).

use crate::pysdk;

use std::path::PathBuf;
use std::time::Duration;

use narwhal_shared::documents::replies::ErrorDetail;
use narwhal_testkit::{
    EngineSpec, FleetSpec, RouterHandle, SimHandle, Usage, parse_row, start_router, start_sim,
};
use serde::Deserialize;
use serde_json::{Value, json};
use tempfile::TempDir;

/// Per-request timeout of the SDK client.
const SDK_TIMEOUT: Duration = Duration::from_secs(60);

struct Fleet {
    _dir: TempDir,
    _sims: Vec<SimHandle>,
    router: RouterHandle,
    py: PathBuf,
}

impl Fleet {
    /// Runs one call through the SDK against the router.
    async fn call(&self, api: &str, params: Value) -> Value {
        pysdk::sdk1(
            &self.py,
            &self.router.data,
            json!({"api": api, "params": params}),
            SDK_TIMEOUT,
        )
        .await
    }

    /// Runs several calls through one SDK client (one Python start).
    async fn calls(&self, calls: Value) -> Vec<Value> {
        pysdk::sdk(&self.py, &self.router.data, &calls, SDK_TIMEOUT).await
    }
}

/// One prefill and one decode simulator of `dialect` behind a router started with
/// `router_args`, and the venv's interpreter (`test` names the test in failures).
fn fleet(test: &str, dialect: &str, sim_args: &[&str], router_args: &[&str]) -> Fleet {
    let py = pysdk::python(test);
    let dir = tempfile::tempdir().expect("tempdir");
    let sims = vec![
        start_sim(
            dir.path(),
            &EngineSpec::new("p0", "prefill").args(sim_args),
            dialect,
        )
        .expect("prefill sim"),
        start_sim(
            dir.path(),
            &EngineSpec::new("d0", "decode").args(sim_args),
            dialect,
        )
        .expect("decode sim"),
    ];
    let spec = FleetSpec::for_sims(dialect, &sims);
    let router = start_router(dir.path(), "router", &spec, router_args).expect("router");
    Fleet {
        _dir: dir,
        _sims: sims,
        router,
        py,
    }
}

/// One result of `sdk_driver.py` (its docstring gives the shape), the fields these tests read;
/// `None`: absent or `null`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct SdkResult {
    /// The SDK's `_request_id` (non-streaming answers).
    request_id: Option<String>,
    /// Choice 0's text.
    text: Option<String>,
    /// Choice 0's last finish reason.
    finish_reason: Option<String>,
    /// The answer's usage (streams: the last chunk that carried one).
    usage: Option<Usage>,
    /// The parsed answer, dumped (non-streaming).
    response: Option<SdkResponse>,
    /// The parsed chunks, dumped (streaming).
    chunks: Option<Vec<SdkChunk>>,
    /// A failure's error body: the router's `error` object.
    body: Option<ErrorDetail>,
}

/// `response` of an [`SdkResult`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct SdkResponse {
    object: Option<String>,
    model: Option<String>,
    choices: Vec<SdkChoice>,
}

/// One choice of an [`SdkResponse`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct SdkChoice {
    message: Option<SdkMessage>,
}

/// A chat choice's `message`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct SdkMessage {
    role: Option<String>,
}

/// One of an [`SdkResult`]'s `chunks`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct SdkChunk {
    object: Option<String>,
    choices: Option<Vec<Value>>,
}

fn usage(r: &Value) -> (u64, u64, u64) {
    let u = parse_row::<SdkResult>(r).usage.unwrap_or_default();
    let n = |k: &str, v: Option<u64>| v.unwrap_or_else(|| panic!("usage.{k} missing: {r}"));
    (
        n("prompt_tokens", u.prompt_tokens),
        n("completion_tokens", u.completion_tokens),
        n("total_tokens", u.total_tokens),
    )
}

/// The simulator generates exactly `max_tokens` tokens, one per stream chunk.
const MAX_TOKENS: u64 = 6;

/// Non-streaming, streaming, and streaming with `stream_options.include_usage`, for `api`:
/// each parses and validates; the three texts are the same (the simulator is deterministic per
/// prompt); usage is present exactly where it was asked for and counts `MAX_TOKENS`.
async fn every_shape_parses(test: &str, dialect: &str, api: &str) {
    let f = fleet(test, dialect, &[], &[]);
    let base = if api == "chat" {
        json!({"model": "tiny-sim", "max_tokens": MAX_TOKENS,
               "messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "the quick brown fox"}]})
    } else {
        json!({"model": "tiny-sim", "max_tokens": MAX_TOKENS, "prompt": "the quick brown fox"})
    };
    let with = |extra: Value| {
        let mut p = base.clone();
        for (k, v) in extra.as_object().expect("object") {
            p[k] = v.clone();
        }
        json!({"api": api, "params": p})
    };
    let results = f
        .calls(json!([
            with(json!({})),
            with(json!({"stream": true})),
            with(json!({"stream": true, "stream_options": {"include_usage": true}})),
        ]))
        .await;
    let what = |i: usize| format!("{dialect} {api} call {i}");
    let plain = pysdk::ok(&results[0], &what(0));
    let streamed = pysdk::ok(&results[1], &what(1));
    let counted = pysdk::ok(&results[2], &what(2));
    let (plain_t, streamed_t, counted_t): (SdkResult, SdkResult, SdkResult) =
        (parse_row(&plain), parse_row(&streamed), parse_row(&counted));

    let object = if api == "chat" {
        "chat.completion"
    } else {
        "text_completion"
    };
    let response = plain_t.response.clone().unwrap_or_default();
    assert_eq!(response.object.as_deref(), Some(object), "{plain}");
    assert_eq!(response.model.as_deref(), Some("tiny-sim"), "{plain}");
    // The SDK's `_request_id` is the router's `x-request-id`: one UUID4 per client request.
    let rid = plain_t.request_id.as_deref().unwrap_or_default();
    assert!(
        uuid::Uuid::parse_str(rid).is_ok_and(|u| u.get_version_num() == 4),
        "{}: request id {rid:?}",
        what(0)
    );
    if api == "chat" {
        let role = response
            .choices
            .first()
            .and_then(|c| c.message.as_ref())
            .and_then(|m| m.role.as_deref());
        assert_eq!(role, Some("assistant"), "{plain}");
    }
    let text = plain_t.text.as_deref().unwrap_or_default();
    assert!(!text.is_empty(), "{}: empty text: {plain}", what(0));
    assert_eq!(plain_t.finish_reason.as_deref(), Some("length"), "{plain}");
    let (p, c, t) = usage(&plain);
    assert!(p > 0, "{}: prompt_tokens: {plain}", what(0));
    assert_eq!(c, MAX_TOKENS, "{}: completion_tokens: {plain}", what(0));
    assert_eq!(t, p + c, "{}: total_tokens: {plain}", what(0));

    for (i, s, st) in [(1, &streamed, &streamed_t), (2, &counted, &counted_t)] {
        assert_eq!(
            st.text.as_deref(),
            Some(text),
            "{}: streamed text differs: {s}",
            what(i)
        );
        assert_eq!(
            st.finish_reason.as_deref(),
            Some("length"),
            "{}: {s}",
            what(i)
        );
        let chunk_object = if api == "chat" {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        for chunk in st.chunks.as_ref().expect("chunks") {
            assert_eq!(
                chunk.object.as_deref(),
                Some(chunk_object),
                "{}: {chunk:?}",
                what(i)
            );
        }
    }
    assert!(
        streamed_t.usage.is_none(),
        "{}: usage chunk sent to a client that did not ask for it: {streamed}",
        what(1)
    );
    assert!(
        streamed_t
            .chunks
            .as_ref()
            .expect("chunks")
            .iter()
            .all(|c| c.choices.as_ref().is_some_and(|v| !v.is_empty())),
        "{}: a chunk without choices: {streamed}",
        what(1)
    );
    // include_usage: the last chunk carries usage and no choices (OpenAI's shape), and it is the
    // same accounting as the non-streaming answer.
    let last = counted_t
        .chunks
        .as_ref()
        .and_then(|c| c.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        last.choices,
        Some(vec![]),
        "{}: usage chunk: {last:?}",
        what(2)
    );
    assert_eq!(
        usage(&counted),
        (p, c, t),
        "{}: streamed usage differs from the non-streaming answer's",
        what(2)
    );
}

/// `logprobs`, `top_logprobs`, `stop`, `seed`, `temperature`, `user`, `max_completion_tokens`
/// (chat), a token-id prompt (completions) and explicit `n: 1`: all accepted and parsed. The
/// simulator ignores sampling options, so only shape is asserted, plus that a `stop` list does
/// not break the answer (`finish_reason` is `stop` or `length`).
async fn options_parse(test: &str, dialect: &str) {
    let f = fleet(test, dialect, &[], &[]);
    let msgs = json!([{"role": "user", "content": "hello there"}]);
    let results = f
        .calls(json!([
            {"api": "completions", "params": {"model": "tiny-sim", "prompt": "hello there",
                "max_tokens": 4, "logprobs": 1, "stop": ["\n\n", "zzz"], "seed": 7,
                "temperature": 0.0, "user": "sdk-test", "n": 1}},
            {"api": "completions", "params": {"model": "tiny-sim", "prompt": "hello there",
                "max_tokens": 4, "logprobs": 1, "stop": "zzz", "stream": true}},
            {"api": "completions", "params": {"model": "tiny-sim", "prompt": [101, 2023, 2003],
                "max_tokens": 4}},
            {"api": "chat", "params": {"model": "tiny-sim", "messages": msgs,
                "max_completion_tokens": 4, "logprobs": true, "top_logprobs": 2,
                "stop": ["zzz"], "seed": 7, "temperature": 0.0, "n": 1}},
            {"api": "chat", "params": {"model": "tiny-sim", "messages": msgs,
                "max_completion_tokens": 4, "logprobs": true, "top_logprobs": 2,
                "stop": "zzz", "stream": true}},
            {"api": "chat", "params": {"model": "tiny-sim",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
                "max_tokens": 4}},
        ]))
        .await;
    for (i, r) in results.iter().enumerate() {
        let r = pysdk::ok(r, &format!("{dialect} options call {i}"));
        let t: SdkResult = parse_row(&r);
        assert!(
            !t.text.as_deref().unwrap_or_default().is_empty(),
            "{dialect} options call {i}: empty text: {r}"
        );
        assert!(
            matches!(t.finish_reason.as_deref(), Some("stop" | "length")),
            "{dialect} options call {i}: {r}"
        );
    }
    let (_, c, _) = usage(&results[3]);
    assert_eq!(c, 4, "max_completion_tokens is honoured: {}", results[3]);
}

/// A chat request with `tools` and `tool_choice: "auto"`: accepted and parsed, streaming and not.
/// The simulator never calls tools, so the answer is plain content.
async fn tools_parse(test: &str, dialect: &str) {
    let f = fleet(test, dialect, &[], &[]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]);
    let params = |stream: bool| {
        json!({"api": "chat", "params": {"model": "tiny-sim", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": "weather in Paris?"}],
            "tools": tools, "tool_choice": "auto"}})
    };
    let results = f.calls(json!([params(false), params(true)])).await;
    for (i, r) in results.iter().enumerate() {
        let r = pysdk::ok(r, &format!("{dialect} tools call {i}"));
        let t: SdkResult = parse_row(&r);
        assert!(
            !t.text.as_deref().unwrap_or_default().is_empty(),
            "{dialect} tools call {i}: {r}"
        );
    }
}

/// Client errors come back as the SDK's typed exceptions with the router's message:
/// a field of the wrong type is a `BadRequestError` (400) naming the field (message and
/// `param`); an unknown model is a `NotFoundError` (404) naming it; `n: 2` on a split fleet is a
/// `BadRequestError` explaining that `n` cannot be served. Streaming requests fail the same way
/// (the status comes before any stream).
async fn client_errors_are_typed(test: &str, dialect: &str) {
    let f = fleet(test, dialect, &[], &[]);
    let results = f
        .calls(json!([
            {"api": "completions", "params": {"model": "tiny-sim", "prompt": "hi",
                "max_tokens": "six"}},
            {"api": "chat", "params": {"model": "tiny-sim", "stream": true, "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}], "stream_options": "yes"}},
            {"api": "completions", "params": {"model": "gpt-nope", "prompt": "hi",
                "max_tokens": 3}},
            {"api": "chat", "params": {"model": "gpt-nope", "stream": true, "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}},
            {"api": "completions", "params": {"model": "tiny-sim", "prompt": "hi",
                "max_tokens": 3, "n": 2}},
        ]))
        .await;
    for (i, field) in [(0, "max_tokens"), (1, "stream_options")] {
        let msg = pysdk::api_error(&results[i], "BadRequestError", 400, &format!("call {i}"));
        assert!(
            msg.contains(&format!("'{field}'")),
            "{dialect} call {i}: the message names {field}: {msg}"
        );
        let body = parse_row::<SdkResult>(&results[i]).body.unwrap_or_default();
        assert_eq!(
            body.param,
            Some(json!(field)),
            "{dialect} call {i}: param names the field: {}",
            results[i]
        );
        assert_eq!(body.kind, "invalid_request_error", "{}", results[i]);
    }
    for i in [2, 3] {
        let msg = pysdk::api_error(&results[i], "NotFoundError", 404, &format!("call {i}"));
        assert!(
            msg.contains("gpt-nope") && msg.contains("tiny-sim"),
            "{dialect} call {i}: names the model asked for and the one served: {msg}"
        );
        let body = parse_row::<SdkResult>(&results[i]).body.unwrap_or_default();
        assert_eq!(body.code, Some(json!("model_not_found")), "{}", results[i]);
    }
    let msg = pysdk::api_error(&results[4], "BadRequestError", 400, "n=2");
    assert!(msg.contains("n > 1"), "{dialect}: n=2 explained: {msg}");
}

/// The router's in-flight limit (`--max-concurrent 1`, no queue) answers 429: the SDK raises
/// `RateLimitError` with the router's message. A slow stream holds the one seat meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn full_router_is_a_rate_limit_error() {
    let f = fleet(
        "full_router_is_a_rate_limit_error",
        "vllm",
        &["--tpot-ms", "100"],
        &["--max-concurrent", "1"],
    );
    let http = narwhal_testkit::http_client()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("HTTP client");
    // Headers arrive with the first token: from then on the seat is held until the body ends.
    let held = http
        .post(format!("{}/v1/completions", f.router.data))
        .json(
            &json!({"model": "tiny-sim", "prompt": "hold the seat", "max_tokens": 100,
                      "stream": true}),
        )
        .send()
        .await
        .expect("held stream");
    assert_eq!(held.status(), 200);
    let r = f
        .call(
            "completions",
            json!({"model": "tiny-sim", "prompt": "one more", "max_tokens": 3}),
        )
        .await;
    let msg = pysdk::api_error(&r, "RateLimitError", 429, "second request");
    assert!(msg.contains("in-flight limit"), "{msg}");
    drop(held);
}

/// No engine can serve (an SGLang fleet with only a prefill engine has nowhere to decode): 503,
/// which the SDK raises as `InternalServerError` (an `APIStatusError` with status 503) carrying
/// the router's message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn no_schedulable_engine_is_a_503_error() {
    let test = "no_schedulable_engine_is_a_503_error";
    let py = pysdk::python(test);
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "sglang").expect("sim");
    let spec = FleetSpec::for_sims("sglang", std::slice::from_ref(&sim));
    let router = start_router(dir.path(), "router", &spec, &[]).expect("router");
    let calls = json!([
        {"api": "completions", "params": {"model": "tiny-sim", "max_tokens": 3, "prompt": "hi"}},
        {"api": "chat", "params": {"model": "tiny-sim", "max_tokens": 3, "stream": true,
                                   "messages": [{"role": "user", "content": "hi"}]}},
    ]);
    let results = pysdk::sdk(&py, &router.data, &calls, SDK_TIMEOUT).await;
    for (r, api) in results.iter().zip(["completions", "chat stream"]) {
        let msg = pysdk::api_error(r, "InternalServerError", 503, api);
        assert!(!msg.is_empty(), "{api}: a message: {r}");
        let body = parse_row::<SdkResult>(r).body.unwrap_or_default();
        assert_eq!(
            body.code,
            Some(json!("no_schedulable_engines")),
            "{api}: {r}"
        );
    }
}

/// One test `$name` of dialect module `$dialect`: `super::$body(<its name>, <dialect>, $args)`.
macro_rules! dialect_test {
    ($dialect:ident, $name:ident, $body:ident $(, $arg:expr)*) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
        async fn $name() {
            let test = concat!(stringify!($dialect), "::", stringify!($name));
            super::$body(test, stringify!($dialect) $(, $arg)*).await;
        }
    };
}

macro_rules! dialect_tests {
    ($dialect:ident) => {
        mod $dialect {
            dialect_test!(
                $dialect,
                completions_every_shape_parses,
                every_shape_parses,
                "completions"
            );
            dialect_test!(
                $dialect,
                chat_every_shape_parses,
                every_shape_parses,
                "chat"
            );
            dialect_test!($dialect, sampling_options_parse, options_parse);
            dialect_test!($dialect, tools_parse, tools_parse);
            dialect_test!(
                $dialect,
                client_errors_are_typed_exceptions,
                client_errors_are_typed
            );
        }
    };
}

dialect_tests!(vllm);
dialect_tests!(sglang);
