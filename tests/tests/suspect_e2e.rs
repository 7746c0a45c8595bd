//! End-to-end test of suspect engines (issue 4): decode streams that fail after output record
//! the producer that fed them (`inference_sources`); once the ejected engine answers its health
//! probe, the router validates the running process through the agents, reruns that producer →
//! suspect path, and only then returns it to placement.

use std::time::Duration;

use futures_util::StreamExt;
use narwhal_testkit::certs::make_dev_certs;
use narwhal_testkit::{EngineSpec, FleetSpec, start_agent, start_router, start_sim, wait_until};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_decode_streams_make_a_suspect_verified_from_its_producer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = make_dev_certs(
        &dir.path().join("certs"),
        &["router", "agent-h0", "agent-h1"],
    )
    .expect("certs");
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
        start_sim(dir.path(), &EngineSpec::new("d1", "decode"), "vllm").expect("d1"),
    ];
    let a0 = start_agent(dir.path(), &certs, "h0", &[&sims[0], &sims[2]]).expect("agent h0");
    let a1 = start_agent(dir.path(), &certs, "h1", &[&sims[1]]).expect("agent h1");
    let spec = FleetSpec::for_sims("vllm", &sims)
        .tls(&certs, "router")
        .agent("p0", &a0)
        .agent("d1", &a0)
        .agent("d0", &a1)
        .with(json!({"recovery": {"eject_after": 2}}));
    let router = start_router(dir.path(), "router", &spec, &[]).expect("router");
    let http = narwhal_testkit::http_client()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    // d0's next two decode streams die after two tokens.
    sims[1]
        .fault(
            &http,
            json!({"phase": "decode", "action": "cut", "after_tokens": 2, "count": 2}),
        )
        .await
        .expect("fault");
    let mut cut = 0;
    for i in 0..40 {
        let r = http
            .post(format!("{}/v1/completions", router.data))
            .json(&json!({"model": "tiny-sim", "prompt": format!("suspect {i}"), "max_tokens": 6, "stream": true}))
            .send()
            .await
            .expect("send");
        let mut body = Vec::new();
        let mut s = r.bytes_stream();
        while let Some(Ok(c)) = s.next().await {
            body.extend_from_slice(&c);
        }
        if String::from_utf8_lossy(&body).contains("\"error\"") {
            cut += 1;
        }
        if cut == 2 {
            break;
        }
    }
    assert_eq!(cut, 2, "two streams placed on d0 were cut");
    // While suspect and ejected, the producer that fed the failing decodes is recorded.
    let st: Value = router.state(&http).await.expect("state");
    assert_eq!(st["inference_sources"], json!({"d0": ["p0"]}), "{st}");
    // d0 answers health again: validation (with the p0 -> d0 verification) readmits it.
    let lc = wait_until(Duration::from_secs(20), || async {
        let lc: Value = http
            .get(format!("{}/narwhal/lifecycle", router.control))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        let d0 = &lc["engines"]["d0"];
        (d0["state"] == "active" && d0["checks"].as_array().is_some_and(|c| !c.is_empty()))
            .then_some(lc)
    })
    .await
    .expect("d0 validated and readmitted");
    let d0 = &lc["engines"]["d0"];
    assert_eq!(d0["restart_required"], false, "{lc}");
    let checks: Vec<&str> = d0["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let at = |name: &str| {
        checks
            .iter()
            .position(|c| *c == name)
            .unwrap_or_else(|| panic!("{name} missing from {checks:?}"))
    };
    assert!(at("health") < at("model"));
    assert!(
        at("fabric consume from p0") < at("verification from p0"),
        "{checks:?}"
    );
    assert!(
        at("verification from p0") < at("final health"),
        "{checks:?}"
    );
    let st: Value = router.state(&http).await.expect("state");
    assert_eq!(st["ejected"], json!([]), "{st}");
    assert_eq!(
        st["inference_sources"],
        json!({}),
        "cleared on readmission: {st}"
    );
    let m = router.metrics(&http).await.expect("metrics");
    assert!(
        m.contains("narwhal_engine_readmissions_total{iid=\"d0\",evidence=\"lifecycle\"} 1"),
        "{m}"
    );
}
