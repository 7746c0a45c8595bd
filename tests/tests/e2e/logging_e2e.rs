//! The router's structured logs (docs/logging.md): `narwhal-serve --log-format json` writes one
//! JSON object a line, in the documented schema.

use std::time::Duration;

use narwhal_testkit::{EngineSpec, FleetSpec, start_router, start_sim};
use serde_json::{Value, json};

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
        assert!(
            v["timestamp"]
                .as_str()
                .is_some_and(|t| t.ends_with('Z') && t.contains('T')),
            "{line}"
        );
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"]
                .contains(&v["level"].as_str().unwrap_or("")),
            "{line}"
        );
        assert!(v["target"].is_string(), "{line}");
        assert!(v["fields"]["message"].is_string(), "{line}");
        assert_eq!(o.contains_key("span"), o.contains_key("spans"), "{line}");
        if let Some(spans) = v["spans"].as_array() {
            in_span += 1;
            assert!(spans.iter().all(|s| s["name"].is_string()), "{line}");
            if let Some(req) = spans.iter().find(|s| s["name"] == "request") {
                assert!(
                    req["id"].is_string() && req["route"] == "/v1/completions",
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
