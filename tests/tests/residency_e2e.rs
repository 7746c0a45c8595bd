//! A vLLM request whose prefill is still running already holds its decode engine: draining that
//! decode engine waits for the request (it is resident from placement on), so `ready_to_stop`
//! never turns true under a request that is about to decode there (seed "Draining engines").

use std::time::Duration;

use narwhal_testkit::certs::make_dev_certs;
use narwhal_testkit::{EngineSpec, FleetSpec, start_agent, start_router, start_sim, wait_until};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_the_decode_engine_waits_for_a_request_still_in_its_prefill() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = make_dev_certs(
        &dir.path().join("certs"),
        &["router", "agent-h0", "agent-h1"],
    )
    .expect("certs");
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
    ];
    let a0 = start_agent(dir.path(), &certs, "h0", &[&sims[0]]).expect("agent h0");
    let a1 = start_agent(dir.path(), &certs, "h1", &[&sims[1]]).expect("agent h1");
    let spec = FleetSpec::for_sims("vllm", &sims)
        .tls(&certs, "router")
        .agent("p0", &a0)
        .agent("d0", &a1);
    let router = start_router(dir.path(), "router", &spec, &[]).expect("router");
    let http = narwhal_testkit::http_client()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    sims[0]
        .fault(
            &http,
            json!({"phase": "prefill", "action": "hang", "ms": 1500}),
        )
        .await
        .expect("fault");
    let url = format!("{}/v1/completions", router.data);
    let client = http.clone();
    let request = tokio::spawn(async move {
        let r = client
            .post(url)
            .json(&json!({"model": "tiny-sim", "prompt": "slow prefill", "max_tokens": 4}))
            .send()
            .await
            .expect("send");
        (
            r.status().as_u16(),
            r.json::<Value>().await.unwrap_or_default(),
        )
    });
    wait_until(Duration::from_secs(5), || async {
        let st = sims[0].stats(&http).await.ok()?;
        (st["in_flight"] == 1).then_some(())
    })
    .await
    .expect("the prefill is running");
    let drain: Value = http
        .post(format!("{}/narwhal/lifecycle/drain", router.control))
        .json(&json!({"engines": ["d0"], "deadline_s": 60}))
        .send()
        .await
        .expect("drain")
        .json()
        .await
        .expect("json");
    let d0 = &drain["engines"]["d0"];
    assert_eq!(d0["state"], "draining", "{drain}");
    assert_eq!(d0["resident"]["decode"], 1, "the request holds d0: {drain}");
    assert_eq!(d0["ready_to_stop"], false, "{drain}");
    let (status, body) = request.await.expect("request task");
    assert_eq!(status, 200, "the committed request completes on d0: {body}");
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    let st = sims[1].stats(&http).await.expect("d0 stats");
    assert_eq!(st["kv"]["consumed"], 1, "{st}");
    let drained = wait_until(Duration::from_secs(5), || async {
        let lc: Value = http
            .get(format!("{}/narwhal/lifecycle", router.control))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        (lc["engines"]["d0"]["ready_to_stop"] == true).then_some(())
    })
    .await;
    assert!(drained.is_some(), "d0 drains once the request is done");
}
