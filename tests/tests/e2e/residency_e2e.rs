//! A vLLM request whose prefill is still running already holds its decode engine: draining that
//! decode engine waits for the request (it is resident from placement on), so `ready_to_stop` never
//! turns true under a request that is about to decode there (handoff-and-lifecycle.md, "Draining
//! engines").

use std::time::Duration;

use narwhal_shared::documents::requests::DrainBody;
use narwhal_shared::handoff::DrainState;
use narwhal_testkit::{Answer, Fleet, eventually, parse_row};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_the_decode_engine_waits_for_a_request_still_in_its_prefill() {
    let f = Fleet::builder().prefill(1).decode(1).agents().start().await;
    let router = f.router();
    f.sim("p0")
        .fault(json!({"phase": "prefill", "action": "hang", "ms": 1500}))
        .await;
    let request = tokio::spawn({
        let http = f.http.clone();
        let url = format!("{}/v1/completions", router.data);
        async move {
            let body = json!({"model": "tiny-sim", "prompt": "slow prefill", "max_tokens": 4});
            http.post(url, &body).await.status_json()
        }
    });
    eventually("the prefill is running", Duration::from_secs(5), || async {
        (f.sim("p0").counters().await.in_flight == 1).then_some(())
    })
    .await;
    let (_, drain) = router
        .drain(&DrainBody {
            engines: vec!["d0".to_string()],
            deadline_s: Some(60.0),
            ..DrainBody::default()
        })
        .await;
    let d0 = drain
        .document
        .engine("d0")
        .unwrap_or_else(|| panic!("no d0 in the drain's reply: {drain:?}"));
    assert_eq!(d0.state, DrainState::Draining, "{drain:?}");
    assert_eq!(d0.resident.decode, 1, "the request holds d0: {drain:?}");
    assert!(!d0.ready_to_stop, "{drain:?}");
    let (status, body) = request.await.expect("request task");
    assert_eq!(status, 200, "the committed request completes on d0: {body}");
    assert_eq!(
        parse_row::<Answer>(&body).usage().completion_tokens,
        Some(4),
        "{body}"
    );
    let st = f.sim("d0").counters().await;
    assert_eq!(st.kv.consumed, 1, "{st:?}");
    let drained = narwhal_testkit::wait_until(Duration::from_secs(5), || async {
        let lc = router.lifecycle().await;
        lc.engine("d0")
            .is_some_and(|d0| d0.ready_to_stop)
            .then_some(())
    })
    .await;
    assert!(drained.is_some(), "d0 drains once the request is done");
}
