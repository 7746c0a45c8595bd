//! The router's structured logs (docs/logging.md): `narwhal-serve --log-format json` writes one
//! JSON object a line, in the documented schema.

use std::time::Duration;

use narwhal_testkit::{EngineSpec, FleetSpec, start_router, start_sim};
use serde::Deserialize;
use serde_json::{Value, json};

/// One line of `--log-format json` (docs/logging.md): the documented keys, each of the type the
/// schema gives it; a line that lacks one or carries another type does not parse.
#[derive(Debug, Deserialize)]
struct LogLine {
    /// RFC 3339, UTC.
    timestamp: String,
    /// `ERROR` ... `TRACE`.
    level: String,
    /// The module that logged (only parsed: a string).
    #[allow(dead_code)]
    target: String,
    /// The event's fields; `message` always (only parsed).
    #[allow(dead_code)]
    fields: LogFields,
    /// The spans the line was logged in, outermost first (only inside a span).
    #[serde(default)]
    spans: Option<Vec<LogSpan>>,
}

/// `fields` of a log line.
#[derive(Debug, Deserialize)]
struct LogFields {
    /// The message (only parsed: a string).
    #[allow(dead_code)]
    message: String,
}

/// One of a log line's `spans`: its name, and the `request` span's `id` and `route`.
#[derive(Debug, Deserialize)]
struct LogSpan {
    name: String,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    route: Option<String>,
}

/// `docs/logging.md`: every line `narwhal-serve --log-format json` writes is one JSON object with
/// `timestamp`, `level`, `target`, `fields.message`, and `span`/`spans` only inside a span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_json_logs_follow_the_documented_schema() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
    ];
    let mut router = start_router(
        dir.path(),
        "router",
        &FleetSpec::for_sims("vllm", &sims),
        &["--log-format", "json", "--log-level", "debug"],
    )
    .expect("router");
    let http = narwhal_testkit::http_client().build().expect("client");
    let r = http
        .post(format!("{}/v1/completions", router.data))
        .json(&json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 200);
    router.proc.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(router.proc.wait_exit(Duration::from_secs(30)), Some(0));
    let log = std::fs::read_to_string(&router.proc.stderr_log).expect("stderr log");
    let mut lines = 0;
    let mut in_span = 0;
    for line in log.lines() {
        lines += 1;
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let o = v
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {line}"));
        for k in o.keys() {
            assert!(
                ["timestamp", "level", "target", "fields", "span", "spans"].contains(&k.as_str()),
                "undocumented key {k}: {line}"
            );
        }
        // `timestamp`, `level`, `target` and `fields.message` are strings, `spans` a list of
        // named spans: a line where one is not does not parse, and the test fails here.
        let LogLine {
            timestamp,
            level,
            spans,
            ..
        } = serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            timestamp.ends_with('Z') && timestamp.contains('T'),
            "{line}"
        );
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"].contains(&level.as_str()),
            "{line}"
        );
        assert_eq!(o.contains_key("span"), o.contains_key("spans"), "{line}");
        if let Some(spans) = &spans {
            in_span += 1;
            if let Some(req) = spans.iter().find(|s| s.name == "request") {
                assert!(
                    req.id.is_some() && req.route.as_deref() == Some("/v1/completions"),
                    "{line}"
                );
            }
        }
    }
    assert!(lines >= 3, "{log}");
    assert!(in_span > 0, "no line was logged inside a span:\n{log}");
    assert!(
        log.contains("\"message\":\"narwhal-serve started\""),
        "the start-up line: {log}"
    );
}
