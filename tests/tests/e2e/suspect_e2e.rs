//! End-to-end test of suspect engines (behaviour.md 6.2, 6.3): decode streams that fail after
//! output record the producer that fed them (`inference_sources`); once the ejected engine answers
//! its health probe, the router validates the running process through the agents, reruns that
//! producer → suspect path, and only then returns it to placement.

use std::time::Duration;

use narwhal_shared::handoff::DrainState;
use narwhal_testkit::{Fleet, eventually};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_decode_streams_make_a_suspect_verified_from_its_producer() {
    let f = Fleet::builder()
        .prefill(1)
        .decode(2)
        .host("h0", &["p0", "d1"])
        .host("h1", &["d0"])
        .fleet(json!({"recovery": {"eject_after": 2}}))
        .start()
        .await;
    let router = f.router();
    // d0's next two decode streams die after two tokens.
    f.sim("d0")
        .fault(json!({"phase": "decode", "action": "cut", "after_tokens": 2, "count": 2}))
        .await;
    let mut cut = 0;
    for i in 0..40 {
        let body = json!({"model": "tiny-sim", "prompt": format!("suspect {i}"),
                          "max_tokens": 6, "stream": true});
        if router
            .post_data_partial("/v1/completions", &body)
            .await
            .text()
            .contains("\"error\"")
        {
            cut += 1;
        }
        if cut == 2 {
            break;
        }
    }
    assert_eq!(cut, 2, "two streams placed on d0 were cut");
    // While suspect and ejected, the producer that fed the failing decodes is recorded.
    let st = router.state().await;
    let sources: Vec<(&str, &Vec<String>)> = st.inference_sources.iter().collect();
    assert_eq!(sources, [("d0", &vec!["p0".to_string()])], "{st:?}");
    // d0 answers health again: validation (with the p0 -> d0 verification) readmits it.
    let lc = eventually(
        "d0 validated and readmitted",
        Duration::from_secs(20),
        || async {
            let lc = router.lifecycle().await;
            let d0 = lc.engine("d0")?;
            (d0.state == DrainState::Active && !d0.checks.is_empty()).then_some(lc.clone())
        },
    )
    .await;
    let d0 = lc.engine("d0").expect("d0 in the lifecycle document");
    assert!(!d0.restart_required, "{lc:?}");
    let checks: Vec<&str> = d0.checks.iter().map(String::as_str).collect();
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
    let st = router.state().await;
    assert!(st.ejected.is_empty(), "{st:?}");
    assert!(
        st.inference_sources.is_empty(),
        "cleared on readmission: {st:?}"
    );
    let m = router.metrics().await;
    assert!(
        m.contains("narwhal_engine_readmissions_total{iid=\"d0\",evidence=\"lifecycle\"} 1"),
        "{m}"
    );
}
