//! Golden tests of the control-plane documents: each document is rendered from a fixed state
//! (manual clock, fixed wave ids, no agents) and compared byte for byte with its file under
//! `router/testdata/golden/`. They pin what operators scrape: field order, `null` against
//! absent, number formatting (docs/http-api.md). A change to a document changes its file in the
//! same commit, on purpose; `NARWHAL_BLESS_GOLDEN=1` rewrites the files from the code.
//!
//! The files hold the pretty rendering (`serde_json::to_string_pretty`); each test also checks
//! the compact bytes the routes send (`response::json_response`) against the same file, and
//! every file parses back into its type in `narwhal_shared::documents` unchanged (what
//! narwhalctl and the test kit read).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use narwhal_shared::{Clock as _, ManualClock, SystemClock};
use serde::Serialize;
use serde_json::{Value, json};

use crate::breaker::{EjectCause, FailureClass};
use crate::lifecycle::machine::{DrainRequest, DrainState, EngineOutcome, Lifecycle, Now};
use crate::parts::Parts;
use crate::placement::Phase;

/// Compares `doc` with `router/testdata/golden/<name>.json` (or writes it when
/// `NARWHAL_BLESS_GOLDEN` is set).
fn golden<T: Serialize + ?Sized>(name: &str, doc: &T) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/golden")
        .join(format!("{name}.json"));
    let pretty = serde_json::to_string_pretty(doc).expect("document serialises") + "\n";
    if std::env::var_os("NARWHAL_BLESS_GOLDEN").is_some() {
        std::fs::write(&path, &pretty).expect("write golden file");
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (NARWHAL_BLESS_GOLDEN=1 writes it)", path.display()));
    assert!(
        pretty == want,
        "{name}: the rendering differs from {}\n--- rendered\n{pretty}",
        path.display()
    );
    // The routes send the compact form: the same document without whitespace.
    let compact = serde_json::to_string(doc).expect("document serialises");
    let parsed: Value = serde_json::from_str(&want).expect("golden file is JSON");
    assert_eq!(compact, parsed.to_string(), "{name}: compact bytes");
}

/// Two prefill and two decode engines, a breaker that ejects at the second failure.
fn fleet() -> Value {
    json!({
        "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
        "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                    {"iid": "p1", "url": "http://127.0.0.1:3", "role": "prefill"},
                    {"iid": "d0", "url": "http://user:pw@127.0.0.1:2/base/"},
                    {"iid": "d1", "url": "http://127.0.0.1:4", "pin": true}],
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
        "serving": {"request_timeout_s": 10, "prefill_timeout_s": 5},
        "recovery": {"eject_after": 2}
    })
}

fn parts_over(doc: Value) -> (Arc<Parts>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
    (crate::parts::for_test(doc, clock.clone(), "test"), clock)
}

fn drain(engines: &[&str], wave: bool) -> DrainRequest {
    DrainRequest {
        engines: engines.iter().map(|s| s.to_string()).collect(),
        wave,
        deadline_s: 30.0,
        deadline_given: true,
    }
}

/// Runs `f` on the lifecycle machine and commits (holds to placement, events).
fn with_machine(parts: &Parts, f: impl FnOnce(&mut Lifecycle, Now)) {
    let exec = parts.lifecycle.executor();
    let mut lc = exec.lock();
    let now = exec.now();
    f(&mut lc, now);
    exec.commit(&mut lc);
}

/// The individual scenario: p0 drained (process 990 recorded), d1 ejected by its health
/// probe (twice, readmitted in between), three failed attempts, d0 with a stream failure fed by p1 (a suspect), one prefill leg resident on p1,
/// ten seconds on.
fn individual() -> (Arc<Parts>, Arc<ManualClock>, crate::fleet::Resident) {
    let (parts, clock) = parts_over(fleet());
    let resident = parts.fleet.resident(1, Phase::Prefill, 0);
    parts.fleet.eject(3, EjectCause::HealthProbe);
    parts.fleet.verified(3);
    parts.fleet.eject(3, EjectCause::HealthProbe);
    parts
        .fleet
        .observe_leg_failure(2, Phase::Decode, FailureClass::Stream, Some(1));
    parts
        .accounting
        .attempt_failed(Phase::Decode, "engine_timeout");
    parts
        .accounting
        .attempt_failed(Phase::Decode, "engine_timeout");
    parts
        .accounting
        .attempt_failed(Phase::Prefill, "engine_connection");
    with_machine(&parts, |lc, now| {
        let live = ["p0", "p1", "d0"].map(String::from).into_iter().collect();
        lc.begin(now, &drain(&["p0"], false), &live, "wave-unused")
            .expect("drain p0");
        assert!(lc.bind_identity(now, "p0", Ok(990.0), false));
        lc.refresh(now, |_| 0);
        assert_eq!(lc.state("p0"), DrainState::Drained);
    });
    clock.advance(Duration::from_secs(10));
    (parts, clock, resident)
}

/// The wave scenario: every engine in wave `wave-0123456789ab`, p1 still running a prefill
/// leg past the 30 s deadline, the others drained.
fn wave() -> (Arc<Parts>, crate::fleet::Resident) {
    let (parts, clock) = parts_over(fleet());
    let resident = parts.fleet.resident(1, Phase::Prefill, 0);
    with_machine(&parts, |lc, now| {
        let live = ["p0", "p1", "d0", "d1"]
            .map(String::from)
            .into_iter()
            .collect();
        let plan = lc
            .begin(now, &drain(&[], true), &live, "wave-0123456789ab")
            .expect("wave drain");
        for (k, iid) in plan.capture.iter().enumerate() {
            assert!(lc.bind_identity(now, iid, Ok(900.0 + k as f64), false));
        }
        lc.refresh(now, |iid| u32::from(iid == "p1"));
    });
    clock.advance(Duration::from_secs(31));
    parts.lifecycle.executor().refresh();
    assert_eq!(
        parts.lifecycle.executor().lock().state("p1"),
        DrainState::DeadlineExceeded
    );
    (parts, resident)
}

/// A fleet with profiles: the role controller is on.
fn controlled() -> Value {
    json!({
        "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
        "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                    {"iid": "p1", "url": "http://127.0.0.1:3", "role": "prefill"},
                    {"iid": "d0", "url": "http://127.0.0.1:2"}],
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
        "serving": {"admission": "predictive"},
        "profiles": {"default": {"ttft_a": 0, "ttft_b": 0.001, "ttft_c": 0.01,
            "tpot_slope": 1e-6, "tpot_intercept": 0.01, "decode_max_requests": 64,
            "decode_max_kv_tokens": 200000}}
    })
}

#[test]
fn ready_and_health() {
    let (parts, _clock, _resident) = individual();
    let (ready, doc) = super::ready(&parts);
    assert!(ready);
    golden("ready", &doc);
    golden("health", &super::health(&parts));
    for i in 0..4 {
        parts.fleet.eject(i, EjectCause::HealthProbe);
    }
    let (ready, doc) = super::ready(&parts);
    assert!(!ready);
    golden("ready_not_ready", &doc);
    golden("health_not_ready", &super::health(&parts));
}

/// `/narwhal/targets`: userinfo stripped, the URL path kept.
#[test]
fn targets() {
    let (parts, _clock) = parts_over(fleet());
    golden("targets", &super::targets(&parts.cfg));
}

#[test]
fn state_individual() {
    let (parts, _clock, _resident) = individual();
    golden("state", &super::state(&parts));
}

#[test]
fn state_wave() {
    let (parts, _resident) = wave();
    golden("state_wave", &super::state(&parts));
}

#[tokio::test]
async fn state_with_a_controller_decision() {
    let (parts, clock) = parts_over(controlled());
    clock.advance(Duration::from_secs(5));
    parts.controller.pass_for_test().await;
    clock.advance(Duration::from_secs(1));
    golden("state_controller", &super::state(&parts));
}

#[test]
fn lifecycle_individual() {
    let (parts, _clock, _resident) = individual();
    golden("lifecycle", &parts.lifecycle.document(""));
}

/// p0's readmission failed a check after its restart: blocked, with the checks that passed.
#[test]
fn lifecycle_blocked() {
    let (parts, _clock, _resident) = individual();
    with_machine(&parts, |lc, now| {
        let targets = lc
            .mark_validating(now, &["p0".to_string()], false, |_| 0)
            .expect("readmit p0");
        assert_eq!(targets, ["p0"]);
        let outcome = EngineOutcome {
            checks: vec!["health".into(), "attestation".into()],
            failures: vec!["generation: HTTP 500".into()],
            process_start: Some(1009.5),
        };
        lc.validation_failed(now, &[("p0".to_string(), outcome)].into());
        assert_eq!(lc.state("p0"), DrainState::Blocked);
    });
    golden("lifecycle_blocked", &parts.lifecycle.document(""));
    // The 409 of a failed readmission is this document with the driver's error.
    golden(
        "reply_readmit_409",
        &parts.lifecycle.document("readmission validation failed"),
    );
}

#[test]
fn lifecycle_wave() {
    let (parts, _resident) = wave();
    golden("lifecycle_wave", &parts.lifecycle.document(""));
}

/// ha-and-fencing.md: a fenced router shows nothing actionable, and names the router it saw
/// take control.
#[tokio::test]
async fn lifecycle_fenced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (parts, _clock) = crate::ha_phase::tests::leased(dir.path());
    assert_eq!(parts.ha.lease().claim().await, Ok(1));
    parts.ha.publish(crate::ha_phase::HaPhase::Active);
    with_machine(&parts, |lc, now| {
        let live = ["p0", "d0"].map(String::from).into_iter().collect();
        lc.begin(now, &drain(&["p0"], false), &live, "wave-unused")
            .expect("drain");
        assert!(lc.bind_identity(now, "p0", Ok(1.0e9 - 5.0), false));
        lc.refresh(now, |_| 0);
    });
    parts.ha.fence(&narwhal_lease::LeaseLoss::HeldByAnother);
    parts.ha.set_controller(Some(crate::ha_phase::Controller {
        holder: "standby:9".into(),
        epoch: 2,
    }));
    golden("lifecycle_fenced", &parts.lifecycle.document(""));
}

/// The lifecycle actions' refusals through the driver: a drain without an agent (409), a
/// malformed body (400), a readmission and a drain cancel of an engine that is not held (409).
/// No engine is contacted.
#[tokio::test]
async fn lifecycle_replies() {
    let (parts, _clock, _resident) = individual();
    let (status, doc) = crate::lifecycle::api::handle(
        &parts.lifecycle,
        crate::lifecycle::api::Action::Drain,
        &Bytes::from_static(br#"{"engines": ["p1"]}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    golden("reply_drain_409", &doc);
    let (status, doc) = crate::lifecycle::api::handle(
        &parts.lifecycle,
        crate::lifecycle::api::Action::Drain,
        &Bytes::from_static(br#"{"engines": "p1"}"#),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    golden("reply_drain_400", &doc);
    let (status, doc) = crate::lifecycle::api::handle(
        &parts.lifecycle,
        crate::lifecycle::api::Action::Readmit,
        &Bytes::from_static(br#"{"engines": ["p1"]}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    golden("reply_readmit_409_refused", &doc);
    let (status, doc) = crate::lifecycle::api::handle(
        &parts.lifecycle,
        crate::lifecycle::api::Action::CancelDrain,
        &Bytes::from_static(br#"{"engines": ["p1"]}"#),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    golden("reply_cancel_drain_409", &doc);
}

/// An individual drain's 200: the document with `warnings` (d0 was the only live decode
/// engine, d1 being ejected).
#[test]
fn drain_reply_with_warnings() {
    let (parts, _clock) = parts_over(fleet());
    parts.fleet.eject(3, EjectCause::HealthProbe);
    with_machine(&parts, |lc, now| {
        let live = ["p0", "p1", "d0"].map(String::from).into_iter().collect();
        lc.begin(now, &drain(&["d0"], false), &live, "wave-unused")
            .expect("drain d0");
        assert!(lc.bind_identity(now, "d0", Ok(1005.25), false));
    });
    let (status, doc) = parts.lifecycle.drain_reply_for_test(&["d0".to_string()]);
    assert_eq!(status, StatusCode::OK);
    golden("reply_drain_200", &doc);
}

/// What narwhalctl and the test kit read: every golden file parses into its type in
/// `narwhal_shared::documents` and serialises back to the same bytes (nothing is lost on the
/// way through a reader, `--json` output included).
#[test]
fn the_golden_files_parse_back_into_their_types() {
    use narwhal_shared::documents::{Health, Lifecycle, LifecycleReply, Ready, State};
    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(name: &str) {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/golden")
            .join(format!("{name}.json"));
        let text = std::fs::read_to_string(&path).expect("golden file");
        let doc: T = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let back = serde_json::to_string_pretty(&doc).expect("serialises") + "\n";
        assert!(back == text, "{name}: not the same after a parse\n{back}");
    }
    for name in ["ready", "ready_not_ready"] {
        round_trip::<Ready>(name);
    }
    round_trip::<narwhal_shared::documents::Targets>("targets");
    for name in ["health", "health_not_ready"] {
        round_trip::<Health>(name);
    }
    for name in ["state", "state_wave", "state_controller"] {
        round_trip::<State>(name);
    }
    for name in [
        "lifecycle",
        "lifecycle_blocked",
        "lifecycle_wave",
        "lifecycle_fenced",
    ] {
        round_trip::<Lifecycle>(name);
    }
    for name in [
        "reply_drain_200",
        "reply_drain_400",
        "reply_drain_409",
        "reply_readmit_409",
        "reply_readmit_409_refused",
        "reply_cancel_drain_409",
    ] {
        round_trip::<LifecycleReply>(name);
    }
}
