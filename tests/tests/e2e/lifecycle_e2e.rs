//! End-to-end tests of the engine lifecycle (handoff-and-lifecycle.md): drain, whole-fleet waves,
//! readmission through the agents, breaker recovery and `narwhalctl`, with real processes:
//! `narwhal-serve`, one `narwhal-agent` per simulated host (router → agent over mutual TLS, every
//! answer signed) and `narwhal-engine-sim` engines, all on loopback.
//!
//! What each test proves is asserted three ways where it can be: the lifecycle document (and the
//! exact `error` strings supervisors match on, handoff-and-lifecycle.md "Lifecycle API",
//! behaviour.md 1.10 and 4.3–4.8, architecture.md 9), the router's journal (events appear without
//! anyone reading the document, architecture.md 9.4), and what the engines themselves received
//! (`/sim/stats`).
//!
//! The fleet of every test: `p0` (prefill, agent `h0`) and `d0` (decode, agent `h1`), vLLM
//! dialect. "Restarting" an engine kills its simulator and starts a new process on the same
//! ports (new pid, newer process start), which is what a supervisor does to a real engine.

use std::path::{Path, PathBuf};
use std::time::Duration;

use narwhal_shared::documents::requests::{DrainBody, ReadmitBody};
use narwhal_shared::handoff::DrainState;
use narwhal_testkit::{
    ById, Fleet, RouterHandle, SimHandle, WAIT, bin_path, metric, narwhalctl, wait_until,
};
use serde_json::{Value, json};

/// Starts the fleet under restart `policy` (`individual` or `whole_wave`), with extra
/// simulator flags and fleet-file overrides. The router is returned apart from the fleet, so a
/// test can restart engines while it holds the router.
async fn lab(policy: &str, sim_args: &[&str], overrides: Value) -> (Fleet, RouterHandle) {
    lab_with("vllm", policy, sim_args, overrides).await
}

/// [`lab`] with engines of `dialect` (`vllm` or `sglang`).
async fn lab_with(
    dialect: &str,
    policy: &str,
    sim_args: &[&str],
    overrides: Value,
) -> (Fleet, RouterHandle) {
    lab_sized(dialect, 1, policy, sim_args, overrides).await
}

/// [`lab_with`] with `decode` decode engines (`d0`, `d1`, ...).
async fn lab_sized(
    dialect: &str,
    decode: usize,
    policy: &str,
    sim_args: &[&str],
    overrides: Value,
) -> (Fleet, RouterHandle) {
    let mut f = Fleet::builder()
        .dialect(dialect)
        .prefill(1)
        .decode(decode)
        .agents()
        .sim_args(sim_args)
        .restart_policy(policy)
        .fleet(overrides)
        .start()
        .await;
    let router = f.router.take().expect("router");
    (f, router)
}

/// Requests engine `iid` received in `phase` (`prefill`, `decode`, `aggregated`).
async fn requests(f: &Fleet, iid: &str, phase: &str) -> u64 {
    let r = f.sim(iid).counters().await.requests;
    match phase {
        "prefill" => r.prefill,
        "decode" => r.decode,
        "aggregated" => r.aggregated,
        _ => panic!("no phase {phase:?}"),
    }
}

/// The engine's process start, as the simulator reports it.
async fn started_at(f: &Fleet, iid: &str) -> f64 {
    f.sim(iid).counters().await.started_at
}

/// One completion whose answer does not matter, not even a transport error: it trips the
/// breaker on a dead or stalled decode engine (the request itself may still be served by a
/// retry on p0).
async fn trip_breaker(router: &RouterHandle, prompt: &str) {
    let _ = router
        .http
        .client()
        .post(format!("{}/v1/completions", router.data))
        .json(&json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await;
}

/// One completion through the router reaches every `(iid, phase)` of `legs`: each engine's
/// request counter for that phase grows.
async fn complete_on(f: &Fleet, r: &RouterHandle, prompt: &str, legs: &[(&str, &str)]) {
    let mut before = Vec::new();
    for (iid, phase) in legs {
        before.push(requests(f, iid, phase).await);
    }
    r.complete(prompt).await;
    for ((iid, phase), b) in legs.iter().zip(before) {
        let now = requests(f, iid, phase).await;
        assert!(
            now > b,
            "{prompt:?} did not reach {iid} ({phase}): {b} -> {now}"
        );
    }
}

/// The metrics page `m` counts sample `name` with `labels` at least once (`why` says what that
/// shows).
fn assert_counted(m: &str, name: &str, labels: &[&str], why: &str) {
    assert!(
        metric(m, name, labels).is_some_and(|v| v >= 1.0),
        "{why}: {name}{labels:?}: {m}"
    );
}

/// Warms the fleet up, kills d0's simulator and sends a completion that trips the breaker on
/// it (connection refused).
async fn crash_d0(f: &mut Fleet, r: &RouterHandle, prompt: &str) {
    r.complete("warm up").await;
    f.sim_mut("d0").proc.kill();
    trip_breaker(r, prompt).await;
}

/// The lifecycle actions of engine `iid` in the journal, oldest first.
fn actions_of(r: &RouterHandle, iid: &str) -> Vec<String> {
    r.lifecycle_event_rows()
        .into_iter()
        .filter(|e| e.iid == iid)
        .map(|e| e.action)
        .collect()
}

/// A drain body naming `engines`, without a deadline.
fn drain_of(engines: &[&str]) -> DrainBody {
    DrainBody {
        engines: engines.iter().map(|e| e.to_string()).collect(),
        ..DrainBody::default()
    }
}

/// A whole-fleet wave drain without a deadline: `{"wave": true}`.
fn wave_drain() -> DrainBody {
    DrainBody {
        wave: true,
        ..DrainBody::default()
    }
}

/// A readmission body naming `engines`.
fn readmit_of(engines: &[&str]) -> ReadmitBody {
    ReadmitBody {
        engines: engines.iter().map(|e| e.to_string()).collect(),
        ..ReadmitBody::default()
    }
}

/// The checks a passing individual vLLM readmission of `iid` lists, in the order of
/// handoff-and-lifecycle.md (health, process-bound attestation, configured model, process identity,
/// direct generation, role-compatible KV transfer, final health). `attestation` carries a
/// fingerprint.
fn assert_checks(checks: &[String], expected: &[&str]) {
    assert_eq!(checks.len(), expected.len(), "checks {checks:?}");
    for (c, e) in checks.iter().zip(expected) {
        if *e == "attestation" {
            assert!(
                c.starts_with("attestation ") && c.len() > "attestation ".len(),
                "{c:?} in {checks:?}"
            );
        } else {
            assert_eq!(c, e, "checks {checks:?}");
        }
    }
}

/// The checks of a passing individual readmission of a vLLM engine, in the order of
/// handoff-and-lifecycle.md: `identity` is `new process identity` after a restart, `process
/// identity` for a recovery; `fabric` names the KV transfer with the peer (`fabric consume from p0`
/// for d0, `fabric produce to d0` for p0).
fn vllm_checks(identity: &'static str, fabric: &'static str) -> [&'static str; 7] {
    [
        "health",
        "attestation",
        "model",
        identity,
        "generation",
        fabric,
        "final health",
    ]
}

/// [`vllm_checks`] of `d0`.
fn decode_checks(identity: &'static str) -> [&'static str; 7] {
    vllm_checks(identity, "fabric consume from p0")
}

/// A drain with two streams in flight. Both streams complete; the engine is `draining`, not
/// `ready_to_stop`, until they end; then `drain_complete` reaches the journal with nobody reading
/// the document, and the document shows `drained` and `ready_to_stop`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_with_two_streams_in_flight_completes_them_then_is_ready_to_stop() {
    let (f, r) = lab("individual", &["--tpot-ms", "40"], json!({})).await;
    // Two streams of ~1.2 s each, decoding on d0.
    let s1 = r.open_stream("first stream in flight", 30).await;
    let s2 = r.open_stream("second stream in flight", 30).await;
    r.lifecycle_until("two streams resident on d0", |d| {
        d.engines.of("d0").resident.decode == 2
    })
    .await;
    let (status, doc) = r.drain(&DrainBody::engine("d0", 30.0)).await;
    assert_eq!(status, 200, "{doc:#?}");
    let doc = doc.document;
    assert_eq!(doc.error, "");
    let e = &doc.engines.of("d0");
    assert_eq!(e.state, DrainState::Draining, "{doc:#?}");
    assert!(e.draining);
    assert!(!e.accepts_new);
    assert!(!e.ready_to_stop);
    assert_eq!(e.resident.decode, 2);
    assert!(e.restart_required);
    let d0_start = started_at(&f, "d0").await;
    let old = e.old_process_start.expect("identity recorded");
    assert!((old - d0_start).abs() < 0.05, "old {old} vs sim {d0_start}");
    assert_eq!(doc.engines.of("p0").state, DrainState::Active);
    assert!(!doc.wave.active);
    assert_eq!(
        r.ready().await.0,
        200,
        "an individual drain keeps the router ready"
    );
    // Not readmittable while work is resident.
    let (status, doc) = r.readmit_engine("d0").await;
    assert_eq!(status, 409);
    assert_eq!(doc.document.error, "d0 is draining, expected drained");
    // New work avoids d0 (it is served on p0) while the streams continue.
    let d0_before = requests(&f, "d0", "decode").await;
    r.complete("placed elsewhere during the drain").await;
    assert_eq!(
        requests(&f, "d0", "decode").await,
        d0_before,
        "a draining engine receives no new work"
    );
    assert!(
        !r.has_event("drain_complete", Some("d0")),
        "no drain_complete while streams are resident: {:#?}",
        r.lifecycle_event_rows()
    );
    let t1 = s1.finish().await;
    assert!(
        !r.has_event("drain_complete", Some("d0"))
            || r.lifecycle().await.engines.of("d0").resident.decode == 0,
        "drain_complete only after the last stream"
    );
    let t2 = s2.finish().await;
    assert!(t1.matches("\"text\"").count() >= 30 && t2.matches("\"text\"").count() >= 30);
    // Nobody reads the document from here until the journal shows the drain complete.
    r.journal_event("drain_complete", Some("d0")).await;
    let order = actions_of(&r, "d0");
    assert_eq!(
        order,
        ["drain_started", "process_recorded", "drain_complete"]
    );
    let doc = r.lifecycle().await;
    let e = &doc.engines.of("d0");
    assert_eq!(e.state, DrainState::Drained, "{doc:#?}");
    assert!(e.ready_to_stop);
    assert!(e.draining);
    assert!(!e.accepts_new);
    assert_eq!(e.error, "");
    assert!(!doc.wave.ready_to_stop, "no wave (architecture.md 9.3)");
    let m = r.metrics().await;
    assert_eq!(
        metric(&m, "narwhal_engine_ready_to_stop", &["iid=\"d0\""]),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "narwhal_engine_draining", &["iid=\"d0\""]),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "narwhal_engine_lifecycle_state",
            &["iid=\"d0\"", "state=\"drained\""]
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "narwhal_engine_lifecycle_state",
            &["iid=\"d0\"", "state=\"draining\""]
        ),
        Some(0.0)
    );
}

/// Readmission without a restart is refused and names why; after a restart it passes every
/// check in the order of handoff-and-lifecycle.md, and traffic reaches the engine again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readmit_requires_a_restart_then_passes_the_checks_in_order_and_serves_again() {
    let (mut f, r) = lab("individual", &[], json!({})).await;
    let doc = r.drain_to_complete("d0").await.document;
    let old = doc
        .engines
        .of("d0")
        .old_process_start
        .expect("identity recorded");

    let (status, doc) = r.readmit_engine("d0").await;
    assert_eq!(status, 409, "{doc:#?}");
    let doc = doc.document;
    assert_eq!(doc.error, "readmission validation failed");
    let e = &doc.engines.of("d0");
    assert_eq!(e.state, DrainState::Blocked);
    assert_eq!(e.error, "engine process did not restart after drain");
    assert_checks(&e.checks, &["health", "attestation", "model"]);
    assert!(!e.accepts_new, "a blocked engine stays out");
    r.journal_event("validation_failed", Some("d0")).await;

    f.sim_mut("d0").restart(&[]).expect("restart d0");
    let new_start = started_at(&f, "d0").await;
    let (status, doc) = r.readmit_engine("d0").await;
    assert_eq!(status, 200, "{doc:#?}");
    let doc = doc.document;
    assert_eq!(doc.error, "");
    let e = &doc.engines.of("d0");
    assert_eq!(e.state, DrainState::Active);
    assert_eq!(e.error, "");
    assert_checks(&e.checks, &decode_checks("new process identity"));
    let (o, nw) = (e.old_process_start.unwrap(), e.new_process_start.unwrap());
    assert_eq!(o, old);
    assert!(nw > o, "new_process_start {nw} newer than old {o}");
    assert!((nw - new_start).abs() < 0.05, "{nw} vs sim {new_start}");
    assert_eq!(doc.process_starts.get("d0").copied(), Some(nw));
    assert!(e.accepts_new);
    r.journal_event("readmitted", Some("d0")).await;

    // Back in placement: P/D traffic decodes on d0 again.
    let before = requests(&f, "d0", "decode").await;
    for i in 0..3 {
        r.complete(&format!("after readmission {i}")).await;
    }
    assert!(
        requests(&f, "d0", "decode").await >= before + 3,
        "traffic reaches the readmitted engine"
    );
    let m = r.metrics().await;
    for result in ["failed", "passed"] {
        assert_eq!(
            metric(
                &m,
                "narwhal_lifecycle_validations_total",
                &[
                    "iid=\"d0\"",
                    "kind=\"operator\"",
                    &format!("result=\"{result}\"")
                ]
            ),
            Some(1.0),
            "{result}: {m}"
        );
    }
    // behaviour.md 6.3: only an un-ejection counts a readmission; a drained engine was not ejected.
    assert_eq!(
        metric(&m, "narwhal_engine_readmissions_total", &["iid=\"d0\""]),
        None,
        "{m}"
    );
}

/// Each check failing on its own gives 409 naming that check, with the earlier checks passed. One
/// engine (`p0`, peer `d0`) goes through every failure in turn; a blocked engine keeps its recorded
/// identity, so each retry is a plain readmit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_readmission_check_failing_alone_is_a_409_naming_it() {
    let (mut f, r) = lab("individual", &[], json!({})).await;
    r.drain_to_complete("p0").await;
    f.sim_mut("p0").restart(&[]).expect("restart p0");

    async fn refused(f: &Fleet, r: &RouterHandle, what: &str) -> (String, Vec<String>) {
        let (status, doc) = r.readmit_engine("p0").await;
        let doc = doc.document;
        if status != 409 {
            let faults = f.sim("p0").faults().await;
            let recent = f.sim("p0").counters().await.recent;
            panic!(
                "{what}: {status} {:?}; p0 faults {faults:?}; p0 recent {recent:#?}; router log {}",
                doc.error,
                r.proc.stderr_tail(60)
            );
        }
        assert_eq!(doc.error, "readmission validation failed", "{what}");
        let e = &doc.engines.of("p0");
        assert_eq!(e.state, DrainState::Blocked, "{what}");
        assert!(!e.accepts_new, "{what}");
        (e.error.clone(), e.checks.clone())
    }
    // The checks of p0's passing readmission, in order; each failure stops after a prefix.
    let all = vllm_checks("new process identity", "fabric produce to d0");

    // 1. health
    f.sim("p0")
        .fault(json!({"phase": "health", "action": "status", "status": 503}))
        .await;
    let (err, checks) = refused(&f, &r, "health").await;
    assert!(err.starts_with("health did not answer 200"), "{err}");
    assert!(checks.is_empty(), "{checks:?}");

    // 2. attestation: the agent now signs with a key the router does not pin.
    let rogue = f.dir().join("rogue.ed25519.pk8");
    let pinned = f.agent("h0").public_key.clone();
    f.agent_mut("h0")
        .restart(Some(&rogue))
        .expect("agent h0 restarts");
    assert_ne!(f.agent("h0").public_key, pinned);
    let (err, checks) = refused(&f, &r, "attestation").await;
    assert!(err.starts_with("attestation: "), "{err}");
    assert_eq!(checks, ["health"]);
    let original = f.dir().join("agent-h0.ed25519.pk8");
    f.agent_mut("h0")
        .restart(Some(&original))
        .expect("agent h0 restarts");
    assert_eq!(f.agent("h0").public_key, pinned);

    // 3. model
    f.sim_mut("p0")
        .restart(&["--model", "other-model"])
        .expect("p0 serves another model");
    let (err, checks) = refused(&f, &r, "model").await;
    assert_eq!(err, r#"serves ["other-model"], expected tiny-sim"#);
    assert_checks(&checks, &all[..2]);
    f.sim_mut("p0").restart(&[]).expect("restart p0");

    // 4. direct generation
    f.sim("p0")
        .fault(json!({"phase": "aggregated", "action": "status", "status": 500}))
        .await;
    let (err, checks) = refused(&f, &r, "generation").await;
    assert!(err.starts_with("generation failed: "), "{err}");
    assert_checks(&checks, &all[..4]);

    // 5. role-compatible KV transfer: the producer hands over no KV.
    f.sim("p0")
        .fault(json!({"phase": "prefill", "action": "omit_kv"}))
        .await;
    let (err, checks) = refused(&f, &r, "kv").await;
    assert!(err.starts_with("fabric p0->d0: "), "{err}");
    assert_checks(&checks, &all[..5]);
    // The peer is reported by name but holds no record and stays in service.
    let doc = r.lifecycle().await;
    assert_eq!(doc.engines.of("d0").state, DrainState::Active);
    assert!(doc.engines.of("d0").accepts_new);

    // 6. final health: the first /health of the readmission passes, the second fails.
    f.sim("p0")
        .fault(json!({"phase": "health", "action": "status", "status": 503, "skip": 1}))
        .await;
    let (err, checks) = refused(&f, &r, "final health").await;
    assert_eq!(err, "final health failed after fabric validation");
    assert_checks(&checks, &all[..6]);

    // Nothing wrong any more: readmitted.
    let (status, doc) = r.readmit_engine("p0").await;
    assert_eq!(status, 200, "{doc:#?}");
    assert_checks(&doc.document.engines.of("p0").checks, &all);
    let failed = r
        .lifecycle_event_rows()
        .iter()
        .filter(|e| e.action == "validation_failed" && e.iid == "p0")
        .count();
    assert_eq!(failed, 6, "one validation_failed event per failing check");
    complete_on(&f, &r, "p0 prefills again", &[("p0", "prefill")]).await;
}

/// A whole wave under `whole_wave`. `/ready` is 503 during the wave; `wave.ready_to_stop` waits for
/// every member; a wave readmission with one engine not restarted blocks the whole wave naming that
/// engine, and passes once it is restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_wave_drain_and_readmission() {
    let (mut f, r) = lab("whole_wave", &["--tpot-ms", "40"], json!({})).await;
    let (status, doc) = r.drain_engine("p0").await;
    assert_eq!(status, 409);
    assert_eq!(
        doc.document.error,
        "engine_restart_policy requires a whole-wave drain"
    );
    assert_eq!(doc.document.engine_restart_policy, "whole_wave");
    assert_eq!(r.ready().await.0, 200);

    let stream = r.open_stream("resident through the wave drain", 25).await;
    let (status, doc) = r.drain(&DrainBody::wave(30.0)).await;
    assert_eq!(status, 200, "{doc:#?}");
    let doc = doc.document;
    let wave_id = doc.wave.id.clone();
    assert!(
        wave_id.starts_with("wave-") && wave_id.len() == 17,
        "{wave_id}"
    );
    assert!(doc.wave.active);
    assert!(doc.wave.readiness_withdrawn);
    assert!(!doc.wave.ready_to_stop);
    assert!(!doc.router.ready);
    let ready = r.not_ready().await;
    assert_eq!(
        ready.reason,
        format!("whole-wave drain {wave_id}"),
        "{ready:?}"
    );
    // p0 has nothing resident: drained, but not ready_to_stop until the whole wave is.
    let doc = r.engine_state_until("p0", DrainState::Drained).await;
    assert!(!doc.engines.of("p0").ready_to_stop, "{doc:#?}");
    assert_eq!(doc.engines.of("d0").state, DrainState::Draining);
    assert!(!doc.wave.ready_to_stop);
    assert!(!r.has_event("wave_ready_to_stop", None));
    // Readmission shapes during a wave.
    let (status, doc) = r.readmit_engine("p0").await;
    assert_eq!(status, 409);
    assert_eq!(
        doc.document.error,
        "an active whole wave must be validated and readmitted as one engine set"
    );
    let body = ReadmitBody {
        wave: true,
        ..readmit_of(&["p0"])
    };
    let (status, doc) = r.readmit(&body).await;
    assert_eq!(status, 409);
    assert_eq!(
        doc.document.error,
        "whole-wave readmission must name the active wave's complete engine set"
    );

    stream.finish().await;
    let ev = r.journal_event("wave_ready_to_stop", None).await;
    assert_eq!(ev.wave_id, wave_id);
    assert_eq!(ev.engines, ["d0", "p0"]);
    let doc = r.lifecycle().await;
    assert!(doc.wave.ready_to_stop, "{doc:#?}");
    for iid in ["p0", "d0"] {
        assert!(doc.engines[iid].ready_to_stop, "{iid}");
        assert_eq!(doc.engines[iid].wave_id, wave_id);
    }
    assert_eq!(r.ready().await.0, 503);

    // Only p0 is restarted: the wave is refused, naming d0.
    f.sim_mut("p0").restart(&[]).expect("restart p0");
    let (status, doc) = r.readmit(&ReadmitBody::wave()).await;
    assert_eq!(status, 409, "{doc:#?}");
    let doc = doc.document;
    assert_eq!(doc.error, "readmission validation failed");
    assert_eq!(
        doc.engines.of("d0").error,
        "engine process did not restart after drain"
    );
    assert_eq!(
        doc.engines.of("p0").error,
        "another engine in the wave failed validation: d0 (engine process did not restart after drain)"
    );
    for iid in ["p0", "d0"] {
        assert_eq!(doc.engines[iid].state, DrainState::Blocked, "{iid}");
    }
    assert!(doc.wave.active, "the wave stays active");
    assert_eq!(r.ready().await.0, 503);

    f.sim_mut("d0").restart(&[]).expect("restart d0");
    let (status, doc) = r.readmit(&ReadmitBody::wave()).await;
    assert_eq!(status, 200, "{doc:#?}");
    let doc = doc.document;
    assert!(!doc.wave.active);
    assert_eq!(doc.wave.id, "");
    for iid in ["p0", "d0"] {
        let e = &doc.engines[iid];
        assert_eq!(e.state, DrainState::Active, "{iid}");
        assert_eq!(e.wave_id, "", "{iid}");
        assert!(
            e.new_process_start.unwrap() > e.old_process_start.unwrap(),
            "{iid}"
        );
        let checks = &e.checks;
        assert!(
            checks.contains(&"new process identity".to_string())
                && checks.last().map(String::as_str) == Some("final health"),
            "{iid}: {checks:?}"
        );
    }
    let ev = r.journal_event("wave_readmitted", None).await;
    assert_eq!(ev.wave_id, wave_id);
    assert_eq!(r.ready().await.0, 200);
    let legs = [("p0", "prefill"), ("d0", "decode")];
    complete_on(&f, &r, "after the wave", &legs).await;
}

/// An engine the breaker ejected (connection refused) that answers `/health` again is validated
/// through the agents and readmitted with `restart_required: false`. While it is out, draining the
/// only other engine is refused (behaviour.md 4.3 rule 6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_ejected_engine_is_validated_and_readmitted_without_restart_requirement() {
    let (mut f, r) = lab("individual", &[], json!({"recovery": {"eject_after": 1}})).await;
    crash_d0(&mut f, &r, "d0 is gone").await;
    let doc = r
        .lifecycle_until("d0 out of placement", |d| !d.engines.of("d0").accepts_new)
        .await;
    assert_eq!(
        doc.engines.of("d0").state,
        DrainState::Active,
        "ejection is not a lifecycle hold"
    );
    let (status, doc) = r.drain_engine("p0").await;
    assert_eq!(status, 409, "{doc:#?}");
    assert_eq!(
        doc.document.error,
        "the last schedulable engine requires a whole-wave drain"
    );
    assert_eq!(
        doc.document.engines.of("p0").state,
        DrainState::Active,
        "nothing changed"
    );

    // The engine answers again (same port): recovery validation readmits it.
    f.sim_mut("d0").restart(&[]).expect("d0 back");
    r.journal_event("recovery_validation_started", Some("d0"))
        .await;
    let ev = r.journal_event("readmitted", Some("d0")).await;
    let start = started_at(&f, "d0").await;
    assert!((ev.process_start.unwrap() - start).abs() < 0.05);
    let doc = r
        .lifecycle_until("d0 back in placement", |d| d.engines.of("d0").accepts_new)
        .await;
    let e = &doc.engines.of("d0");
    assert_eq!(e.state, DrainState::Active, "{doc:#?}");
    assert!(!e.restart_required);
    assert_eq!(e.error, "");
    assert_checks(&e.checks, &decode_checks("process identity"));
    let m = r.metrics().await;
    assert_eq!(
        metric(
            &m,
            "narwhal_lifecycle_validations_total",
            &["iid=\"d0\"", "kind=\"recovery\"", "result=\"passed\""]
        ),
        Some(1.0),
        "{m}"
    );
    assert_counted(
        &m,
        "narwhal_engine_readmissions_total",
        &["iid=\"d0\"", "evidence=\"lifecycle\""],
        "the un-ejection counts as a lifecycle readmission",
    );
    complete_on(&f, &r, "d0 decodes again", &[("d0", "decode")]).await;
}

/// The exact 409 shapes of behaviour.md 4.3 and 1.10 that still apply after architecture.md 9 (a
/// repeated identical drain is 200, departure 9.5), plus 400 for malformed bodies. Every reply is
/// the full document with the message in `error`. Narwhal departs from the reference here: a
/// `deadline_s` out of range is a bad body (400, before anything else), an unknown engine id a 404
/// naming it, and a drain repeated with another `deadline_s` a 409 (docs/deviations.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_refusals_have_the_reference_shapes() {
    let (_f, r) = lab("individual", &[], json!({})).await;
    let refused = |action: &'static str, body: Value, status: u16, msg: &'static str| {
        let r = &r;
        async move {
            let (got, doc) = r.lifecycle_post(action, &body).await;
            assert_eq!(got, status, "{action} {body}: {doc:#?}");
            assert_eq!(doc.document.error, msg, "{action} {body}");
        }
    };
    let conflict = |body: DrainBody, msg: &'static str| refused("drain", json!(body), 409, msg);
    // Rules in order: the body's deadline first (400, the bodies as written: `0`, `-1`), then
    // unknown ids (404), then the count.
    refused(
        "drain",
        json!({"engines": ["zz", "p0", "aa"], "deadline_s": 0}),
        400,
        "deadline_s must be > 0 and at most 31536000 seconds (one year), got 0",
    )
    .await;
    refused(
        "drain",
        json!({"engines": ["p0", "d0"], "deadline_s": -1}),
        400,
        "deadline_s must be > 0 and at most 31536000 seconds (one year), got -1",
    )
    .await;
    refused(
        "drain",
        json!(drain_of(&["zz", "p0", "aa"])),
        404,
        "unknown engine(s): aa, zz",
    )
    .await;
    conflict(
        drain_of(&["p0", "d0"]),
        "a non-wave drain must name exactly one engine",
    )
    .await;
    conflict(
        DrainBody::default(),
        "a non-wave drain must name exactly one engine",
    )
    .await;
    conflict(
        DrainBody {
            wave: true,
            ..drain_of(&["p0"])
        },
        "a whole-wave drain must name every configured engine",
    )
    .await;
    let doc = r.lifecycle().await;
    assert!(
        doc.engines
            .values()
            .all(|e| e.state == DrainState::Active && e.accepts_new),
        "refusals change nothing: {doc:#?}"
    );
    assert!(r.lifecycle_event_rows().is_empty());

    for (body, msg) in [
        (readmit_of(&["d0"]), "d0 is active, expected drained"),
        (
            readmit_of(&["p0", "d0"]),
            "readmission must name exactly one engine",
        ),
        (
            ReadmitBody::wave(),
            "whole-wave readmission must name the active wave's complete engine set",
        ),
    ] {
        refused("readmit", json!(body), 409, msg).await;
    }
    refused(
        "readmit",
        json!(readmit_of(&["zz"])),
        404,
        "unknown engine(s): zz",
    )
    .await;

    r.drain_to_complete("p0").await;
    let before = r.lifecycle().await;
    // architecture.md 9.5: the same drain again is idempotent.
    let (status, again) = r.drain_engine("p0").await;
    assert_eq!(status, 200, "{again:#?}");
    let again = again.document;
    assert_eq!(again.error, "");
    assert_eq!(again.engines.of("p0"), before.engines.of("p0"));
    assert_eq!(
        again.events.len(),
        before.events.len(),
        "a repeated drain emits nothing"
    );
    // The same drain with another deadline is refused, never answered 200 while the old
    // deadline silently stays; the same deadline named again is a repeat.
    conflict(
        DrainBody::engine("p0", 60.0),
        "a drain of p0 is already active with deadline_s 300; repeat it without deadline_s or with the same value",
    )
    .await;
    let (status, again) = r.drain(&DrainBody::engine("p0", 300.0)).await;
    assert_eq!(status, 200, "{again:#?}");
    conflict(drain_of(&["d0"]), "lifecycle action already active for p0").await;
    conflict(wave_drain(), "lifecycle action already active for p0").await;

    for (body, needle) in [
        ("[1]", "the request body must be a JSON object"),
        ("{not json", "the request body is not valid JSON"),
        (
            r#"{"engines": "p0"}"#,
            "engines must be a list of engine ids",
        ),
        (
            r#"{"engines": ["p0"], "bogus": 1}"#,
            "unknown field \"bogus\"",
        ),
        (r#"{"deadline_s": "soon"}"#, "deadline_s must be a number"),
        (r#"{"wave": "yes"}"#, "wave must be true or false"),
    ] {
        let (status, doc) = r.lifecycle_post_raw("drain", body).await;
        assert_eq!(status, 400, "{body}: {doc:#?}");
        let error = &doc.document.error;
        assert!(error.contains(needle), "{body}: {error}");
    }
    let (status, doc) = r
        .lifecycle_post_raw("readmit", r#"{"deadline_s": 5}"#)
        .await;
    assert_eq!(status, 400, "readmit takes no deadline: {doc:#?}");
}

/// A drain whose identity capture fails (agent down) is 503 naming the engine; the engine stays out
/// of placement (`blocked`, no traffic reaches it); readmission is refused for want of an identity;
/// the same drain, repeated once the agent is back, records the identity and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_with_agent_down_is_503_holds_the_engine_and_the_retry_succeeds() {
    let (mut f, r) = lab("individual", &[], json!({"agent": {"timeout_s": 2}})).await;
    f.agent_mut("h0").proc.kill();
    let (status, doc) = r.drain_engine("p0").await;
    assert_eq!(status, 503, "{doc:#?}");
    let doc = doc.document;
    let err = &doc.error;
    assert!(
        err.starts_with("p0: process identity unreadable: "),
        "{err}"
    );
    let e = &doc.engines.of("p0");
    assert_eq!(e.state, DrainState::Blocked);
    assert!(e.draining);
    assert!(!e.accepts_new);
    assert_eq!(e.old_process_start, None);
    assert!(e.error.starts_with("process identity unreadable"));
    r.journal_event("drain_blocked", Some("p0")).await;

    let before = requests(&f, "p0", "prefill").await + requests(&f, "p0", "aggregated").await;
    r.complete("p0 is held out").await;
    let after = requests(&f, "p0", "prefill").await + requests(&f, "p0", "aggregated").await;
    assert_eq!(after, before, "a blocked engine receives no traffic");

    let (status, doc) = r.readmit_engine("p0").await;
    assert_eq!(status, 409);
    assert_eq!(
        doc.document.error,
        "p0 has no recorded pre-restart process identity"
    );

    f.agent_mut("h0").restart(None).expect("agent h0 restarts");
    let (status, doc) = r.drain_engine("p0").await;
    assert_eq!(status, 200, "{doc:#?}");
    assert_eq!(doc.document.error, "");
    let start = started_at(&f, "p0").await;
    let old = doc.document.engines.of("p0").old_process_start.unwrap();
    assert!((old - start).abs() < 0.05);
    r.journal_event("drain_complete", Some("p0")).await;
    let doc = r.lifecycle().await;
    assert_eq!(doc.engines.of("p0").state, DrainState::Drained);
    assert_eq!(doc.engines.of("p0").error, "");
    assert!(doc.engines.of("p0").ready_to_stop);
    let actions = actions_of(&r, "p0");
    assert_eq!(
        actions,
        [
            "drain_started",
            "drain_blocked",
            "process_recorded",
            "drain_complete"
        ]
    );
}

/// Pids of engines started by a restart script, killed when the test ends.
struct PidFiles(Vec<PathBuf>);

impl Drop for PidFiles {
    fn drop(&mut self) {
        for f in &self.0 {
            if let Some(pid) = std::fs::read_to_string(f)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// Writes `restart.sh IID`: kills the engine's current process (pid from `IID.pid`), waits
/// until it is gone, starts the simulator again on the same ports and waits for its ready file.
fn restart_script(dir: &Path, sims: &[&SimHandle]) -> PathBuf {
    let mut cases = String::new();
    for s in sims {
        std::fs::write(dir.join(format!("{}.pid", s.iid)), s.proc.pid().to_string())
            .expect("pid file");
        let kv = s
            .kv_port
            .map(|p| format!(" --kv-listen 127.0.0.1:{p}"))
            .unwrap_or_default();
        cases.push_str(&format!(
            "  {iid}) args=\"--listen 127.0.0.1:{port}{kv}\" ;;\n",
            iid = s.iid,
            port = s.port
        ));
    }
    let script = format!(
        r#"#!/bin/sh
set -e
iid="$1"
d="{dir}"
case "$iid" in
{cases}  *) echo "unknown engine $iid" >&2; exit 2 ;;
esac
old=$(cat "$d/$iid.pid")
kill -9 "$old" 2>/dev/null || true
# Gone or a zombie: its sockets are closed.
while [ -e "/proc/$old/status" ] && ! grep -q '^State:.*Z' "/proc/$old/status"; do sleep 0.02; done
rm -f "$d/$iid.script-ready.json"
"{sim}" --dialect vllm --model tiny-sim $args --ready-file "$d/$iid.script-ready.json" \
  >/dev/null 2>>"$d/$iid.script.stderr.log" &
echo $! > "$d/$iid.pid"
n=0
while [ ! -s "$d/$iid.script-ready.json" ]; do
  n=$((n+1)); [ $n -lt 1500 ] || exit 1
  sleep 0.02
done
"#,
        dir = dir.display(),
        sim = bin_path("narwhal-engine-sim").display(),
    );
    let path = dir.join("restart.sh");
    std::fs::write(&path, script).expect("restart script");
    path
}

/// `narwhalctl wave-restart [--rolling] --restart-cmd <cmd> --timeout-s 30`, run off the
/// async runtime; it must succeed.
async fn wave_restart(control: &str, cmd: &str, rolling: bool) -> std::process::Output {
    let mut args = vec!["wave-restart".to_string()];
    if rolling {
        args.push("--rolling".into());
    }
    args.extend(["--restart-cmd", cmd, "--timeout-s", "30"].map(String::from));
    let control = control.to_string();
    let out = tokio::task::spawn_blocking(move || narwhalctl(&control, &args))
        .await
        .expect("narwhalctl task");
    assert!(
        out.status.success(),
        "{}: {out:?}\n{}",
        if rolling { "rolling" } else { "wave-restart" },
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

/// `narwhalctl wave-restart` drives a whole-wave restart and then a rolling one through a
/// restart command (a shell script that kills the engine and starts the simulator again on its
/// ports); every engine comes back with a newer process start and serves. Also the exit codes:
/// 1 for a refused action, 3 for an unreachable router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narwhalctl_wave_restart_and_rolling_restart() {
    let (f, r) = lab("individual", &[], json!({})).await;
    let script = restart_script(f.dir(), &[f.sim("p0"), f.sim("d0")]);
    let _reap = PidFiles(vec![f.dir().join("p0.pid"), f.dir().join("d0.pid")]);
    let pid = |iid: &str| std::fs::read_to_string(f.dir().join(format!("{iid}.pid")));
    let cmd = format!("sh {} {{iid}}", script.display());
    let control = r.control.clone();

    let pids0 = (pid("p0").unwrap(), pid("d0").unwrap());
    wave_restart(&control, &cmd, false).await;
    let pids1 = (pid("p0").unwrap(), pid("d0").unwrap());
    assert!(
        pids1.0 != pids0.0 && pids1.1 != pids0.1,
        "both engines restarted"
    );
    let doc = r.lifecycle().await;
    assert!(!doc.wave.active, "{doc:#?}");
    for iid in ["p0", "d0"] {
        let e = &doc.engines[iid];
        assert_eq!(e.state, DrainState::Active, "{iid}: {doc:#?}");
        assert!(e.new_process_start > e.old_process_start);
    }
    assert!(r.has_event("wave_readmitted", None));
    r.complete("after the wave restart").await;

    wave_restart(&control, &cmd, true).await;
    let pids2 = (pid("p0").unwrap(), pid("d0").unwrap());
    assert!(pids2.0 != pids1.0 && pids2.1 != pids1.1);
    let doc = r.lifecycle().await;
    for iid in ["p0", "d0"] {
        let e = &doc.engines[iid];
        assert_eq!(e.state, DrainState::Active, "{iid}: {doc:#?}");
        assert_eq!(e.wave_id, "", "{iid}: rolling restarts are individual");
        assert!(e.checks.contains(&"new process identity".to_string()));
    }
    r.complete("after the rolling restart").await;

    let out = narwhalctl(&control, &["readmit", "p0"]);
    assert_eq!(out.status.code(), Some(1), "refused: {out:?}");
    let out = narwhalctl(&control, &["status"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = narwhalctl("http://127.0.0.1:1", &["status"]);
    assert_eq!(out.status.code(), Some(3), "unreachable: {out:?}");
}

/// A drain deadline that passes with a stream still resident is reported (never cancels the
/// work): `drain_deadline_exceeded` reaches the journal from the router's timer with nobody
/// reading the document, the stream still completes, and the engine then drains with no stale
/// error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_deadline_is_reported_by_the_timer_and_never_cancels_work() {
    let (_f, r) = lab("individual", &["--tpot-ms", "40"], json!({})).await;
    let s = r.open_stream("outlives the drain deadline", 30).await;
    let (status, doc) = r.drain(&DrainBody::engine("d0", 0.2)).await;
    assert_eq!(status, 200, "{doc:#?}");
    let ev = r.journal_event("drain_deadline_exceeded", Some("d0")).await;
    assert_eq!(ev.resident, Some(1), "{ev:?}");
    assert!(!r.has_event("drain_complete", Some("d0")));
    let doc = r.lifecycle().await;
    let e = &doc.engines.of("d0");
    assert_eq!(e.state, DrainState::DeadlineExceeded, "{doc:#?}");
    assert_eq!(
        e.error,
        "1 resident request(s) remain after the drain deadline"
    );
    assert!(!e.ready_to_stop);
    let (status, doc) = r.readmit_engine("d0").await;
    assert_eq!(status, 409);
    assert_eq!(
        doc.document.error,
        "d0 is deadline_exceeded, expected drained"
    );
    let text = s.finish().await;
    assert!(
        text.matches("\"text\"").count() >= 30,
        "the stream ran to its end"
    );
    r.journal_event("drain_complete", Some("d0")).await;
    let doc = r.lifecycle().await;
    let e = &doc.engines.of("d0");
    assert_eq!(e.state, DrainState::Drained, "{doc:#?}");
    assert_eq!(e.error, "", "no stale deadline error");
    assert!(e.ready_to_stop);
}

/// Under `whole_wave`, a breaker ejection puts every engine in a restart-required wave
/// (behaviour.md 4.9): `/ready` 503 naming it, every engine `blocked` with no recorded
/// identity (so a readmit is refused), the operator's wave drain captures identities, and after
/// every engine restarts the wave readmission returns the fleet to service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_wave_ejection_requires_a_restart_wave_that_the_operator_completes() {
    let (mut f, r) = lab("whole_wave", &[], json!({"recovery": {"eject_after": 1}})).await;
    crash_d0(&mut f, &r, "d0 is gone").await;
    let ev = r.journal_event("restart_required", None).await;
    assert_eq!(ev.reason, "engine d0 was excluded", "{ev:?}");
    let wave_id = ev.wave_id.clone();
    let ready = r.not_ready().await;
    assert_eq!(
        ready.reason,
        "whole-wave restart required: engine d0 was excluded"
    );
    let doc = r.lifecycle().await;
    assert_eq!(doc.wave.id, wave_id, "{doc:#?}");
    for iid in ["p0", "d0"] {
        let e = &doc.engines[iid];
        assert_eq!(e.state, DrainState::Blocked, "{iid}");
        assert!(e.restart_required, "{iid}");
        assert_eq!(e.old_process_start, None, "{iid}");
        assert_eq!(e.error, "engine d0 was excluded", "{iid}");
    }
    // The engine answers again; automatic recovery must not readmit it under whole_wave.
    f.sim_mut("d0").restart(&[]).expect("d0 back");
    let (status, doc) = r.readmit(&ReadmitBody::wave()).await;
    assert_eq!(status, 409, "{doc:#?}");
    assert_eq!(
        doc.document.error,
        "d0 has no recorded pre-restart process identity"
    );
    // Drain the wave: identities are captured for the held records (no new wave).
    let (status, doc) = r.drain(&wave_drain()).await;
    assert_eq!(status, 200, "{doc:#?}");
    assert_eq!(doc.document.wave.id, wave_id, "same wave");
    r.journal_event("wave_ready_to_stop", None).await;
    assert!(
        !r.has_event("recovery_validation_started", Some("d0")),
        "no automatic recovery under whole_wave"
    );
    f.sim_mut("p0").restart(&[]).expect("restart p0");
    f.sim_mut("d0").restart(&[]).expect("restart d0");
    let (status, doc) = r.readmit(&ReadmitBody::wave()).await;
    assert_eq!(status, 200, "{doc:#?}");
    assert!(!doc.document.wave.active);
    let doc = r
        .lifecycle_until("both engines in placement", |d| {
            d.engines.of("p0").accepts_new && d.engines.of("d0").accepts_new
        })
        .await;
    assert!(doc.router.ready, "{doc:#?}");
    assert_eq!(r.ready().await.0, 200);
    complete_on(&f, &r, "after the forced wave", &[("d0", "decode")]).await;
}

/// A recovery validation that fails (the engine came back serving the wrong model) leaves the
/// engine out, `blocked` without a restart requirement; the next probe retries, and once the
/// engine is right it is readmitted automatically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_recovery_validation_keeps_the_engine_out_and_is_retried() {
    let (mut f, r) = lab("individual", &[], json!({"recovery": {"eject_after": 1}})).await;
    crash_d0(&mut f, &r, "d0 is gone").await;
    r.lifecycle_until("d0 ejected", |d| !d.engines.of("d0").accepts_new)
        .await;
    f.sim_mut("d0")
        .restart(&["--model", "other-model"])
        .expect("d0 serves another model");
    let ev = r.journal_event("validation_failed", Some("d0")).await;
    assert_eq!(
        ev.error.as_deref(),
        Some(r#"serves ["other-model"], expected tiny-sim"#),
        "{ev:?}"
    );
    let doc = r.lifecycle().await;
    let e = &doc.engines.of("d0");
    assert!(!e.accepts_new, "{doc:#?}");
    assert!(!e.restart_required);
    assert!(
        f.sim("d0").counters().await.requests.decode == 0,
        "no traffic reaches an engine that failed validation"
    );
    f.sim_mut("d0").restart(&[]).expect("d0 right again");
    r.journal_event("readmitted", Some("d0")).await;
    r.lifecycle_until("d0 back", |d| {
        d.engines.of("d0").accepts_new && d.engines.of("d0").state == DrainState::Active
    })
    .await;
    complete_on(&f, &r, "d0 decodes again", &[("d0", "decode")]).await;
}

/// SGLang: readmission has no direct-generation check (the KV rendezvous is the generation
/// evidence), and a prefill engine restarted on a new bootstrap port serves P/D traffic right
/// after its readmission answers 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_readmitted_on_a_new_bootstrap_port_serves_at_once() {
    let (mut f, r) = lab_with("sglang", "individual", &[], json!({})).await;
    r.complete("warm up").await;
    r.drain_to_complete("p0").await;
    let old_port = f.sim("p0").bootstrap_port;
    f.sim_mut("p0")
        .restart(&["--bootstrap-port", "0"])
        .expect("p0 back on a new bootstrap port");
    assert_ne!(f.sim("p0").bootstrap_port, old_port, "a new bootstrap port");
    let rejected_before = f.sim("d0").counters().await.kv.rejected;
    // Traffic runs through the readmission: the first P/D requests placed on p0 after it is
    // back must already use its new bootstrap port.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hammer = {
        let (http, data, stop) = (r.http.client().clone(), r.data.clone(), stop.clone());
        tokio::spawn(async move {
            let mut bad = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let r = http
                    .post(format!("{data}/v1/completions"))
                    .json(
                        &json!({"model": "tiny-sim", "prompt": format!("hammer {i}"),
                                  "max_tokens": 2}),
                    )
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status() == 200 => {}
                    Ok(r) => bad.push(format!(
                        "{}: {}",
                        r.status(),
                        r.text().await.unwrap_or_default()
                    )),
                    Err(e) => bad.push(e.to_string()),
                }
            }
            (i, bad)
        })
    };
    let (status, doc) = r.readmit_engine("p0").await;
    assert_eq!(status, 200, "{doc:#?}");
    // SGLang: the vLLM checks without direct generation.
    let sglang: Vec<&str> = vllm_checks("new process identity", "fabric produce to d0")
        .into_iter()
        .filter(|c| *c != "generation")
        .collect();
    assert_checks(&doc.document.engines.of("p0").checks, &sglang);
    let p_now = requests(&f, "p0", "prefill").await;
    wait_until(WAIT, || async {
        (requests(&f, "p0", "prefill").await >= p_now + 5).then_some(())
    })
    .await
    .expect("P/D traffic on p0 after readmission");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, bad) = hammer.await.unwrap();
    assert!(bad.is_empty(), "{} of {sent} failed: {bad:?}", bad.len());
    assert_eq!(
        f.sim("d0").counters().await.kv.rejected,
        rejected_before,
        "no decode used a stale bootstrap port"
    );
    let (p, d) = (
        f.sim("p0").counters().await.requests.prefill,
        f.sim("d0").counters().await.kv,
    );
    for i in 0..3 {
        r.complete(&format!("right after readmission {i}")).await;
    }
    let d2 = f.sim("d0").counters().await.kv;
    assert!(requests(&f, "p0", "prefill").await >= p + 3);
    assert_eq!(d2.rejected, d.rejected, "no rendezvous failed: {d2:?}");
    assert!(d2.consumed >= d.consumed + 3, "{d2:?}");
}

/// Under `whole_wave`, an engine that crashed (ejected, still down) is bound to the last process
/// the router verified when the operator drains the forced wave (behaviour.md 4.4 binding,
/// 4.10 identities accepted at startup), so the supervisor restarts it once: the drain is 200
/// while it is down, and the restarted process passes the wave readmission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_engine_is_bound_to_its_verified_process_when_the_wave_drains() {
    let (mut f, r) = lab("whole_wave", &[], json!({"recovery": {"eject_after": 1}})).await;
    let d0_start = started_at(&f, "d0").await;
    r.lifecycle_until("identities accepted at startup", |d| {
        d.process_starts.contains_key("d0") && d.process_starts.contains_key("p0")
    })
    .await;
    crash_d0(&mut f, &r, "d0 crashed").await;
    r.journal_event("restart_required", None).await;
    let (status, doc) = r.drain(&wave_drain()).await;
    assert_eq!(status, 200, "{doc:#?}");
    let old = doc.document.engines.of("d0").old_process_start;
    assert_eq!(
        old,
        Some(d0_start),
        "bound to the verified process: {doc:#?}"
    );
    r.journal_event("wave_ready_to_stop", None).await;
    f.sim_mut("p0").restart(&[]).expect("restart p0");
    f.sim_mut("d0").restart(&[]).expect("restart d0");
    let (status, doc) = r.readmit(&ReadmitBody::wave()).await;
    assert_eq!(status, 200, "{doc:#?}");
    r.lifecycle_until("d0 back", |d| d.engines.of("d0").accepts_new)
        .await;
    r.complete("after the crash wave").await;
}

/// architecture.md 9.7: a peer whose process changed behind the router's back fails an individual
/// readmission by name and is ejected (`process_identity`).
///
/// In a one-prefill, one-decode fleet that leaves nothing live: the breaker's recovery of the
/// peer waits for the target's hold to end (behaviour.md 4.9), and the target has no live
/// peer. The next readmission of the target takes the ejected peer along as a co-target
/// validated without a restart requirement, and both return (the reference stays stuck until a
/// whole-wave restart; this was found here and fixed in `Lifecycle::join_recovery`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_restarted_behind_the_routers_back_fails_readmission_by_name() {
    let (mut f, r) = lab("individual", &[], json!({})).await;
    r.lifecycle_until("identities accepted at startup", |d| {
        d.process_starts.contains_key("d0")
    })
    .await;
    r.drain_to_complete("p0").await;
    f.sim_mut("p0").restart(&[]).expect("restart p0");
    f.sim_mut("d0")
        .restart(&[])
        .expect("d0 restarted without the router knowing");
    let (status, doc) = r.readmit_engine("p0").await;
    let doc = doc.document;
    if status == 200 {
        // On a loaded machine the monitor can see d0's restart first (its health path down
        // for a moment: an absent engine is a new engine) and re-validate it, through its
        // agent, before p0's readmission arrives; then nothing is behind the router's back,
        // and the rule holds if d0 was validated as its new process (seen in a loaded run).
        let d0 = &doc.engines.of("d0");
        assert_ne!(d0.old_process_start, d0.new_process_start, "{doc:#?}");
        assert!(
            d0.checks.iter().any(|x| x == "process identity"),
            "d0 passed only as its new, validated process: {doc:#?}"
        );
        eprintln!("[lifecycle_e2e] the monitor re-validated d0 before p0's readmission");
        return;
    }
    assert_eq!(status, 409, "{doc:#?}");
    assert_eq!(
        doc.engines.of("p0").error,
        "peer failed validation: d0 (peer process changed before readmission)"
    );
    assert_eq!(doc.engines.of("p0").state, DrainState::Blocked);
    assert!(!doc.engines.of("d0").accepts_new, "d0 ejected");
    assert_eq!(
        doc.engines.of("d0").state,
        DrainState::Active,
        "no record for d0"
    );
    let m = r.metrics().await;
    assert_counted(
        &m,
        "narwhal_engine_ejections_total",
        &["iid=\"d0\"", "cause=\"process_identity\""],
        "d0 ejected: its process changed",
    );
    assert_eq!(r.ready().await.0, 503, "nothing live");
    assert!(!r.has_event("recovery_validation_started", Some("d0")));
    let (status, doc) = r.readmit_engine("p0").await;
    assert_eq!(status, 200, "{doc:#?}");
    let doc = doc.document;
    let d0 = &doc.engines.of("d0");
    assert_eq!(d0.state, DrainState::Active, "{doc:#?}");
    assert!(!d0.restart_required);
    assert_checks(&d0.checks, &decode_checks("process identity"));
    let d0_start = started_at(&f, "d0").await;
    assert_eq!(doc.process_starts.get("d0").copied(), Some(d0_start));
    assert_eq!(doc.engines.of("p0").state, DrainState::Active);
    r.journal_event("recovery_validation_started", Some("d0"))
        .await;
    r.lifecycle_until("both back", |d| {
        d.engines.of("d0").accepts_new && d.engines.of("p0").accepts_new
    })
    .await;
    assert_eq!(r.ready().await.0, 200);
    complete_on(&f, &r, "both back", &[("d0", "decode")]).await;
}

/// An engine that crashes while draining: its stream fails, it is ejected, its drain completes
/// (nothing resident, identity recorded) so the supervisor may restart it, automatic recovery
/// leaves the drain alone, and the operator's readmission returns it to placement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_crashing_while_draining_is_readmitted_by_the_operator() {
    let (mut f, r) = lab(
        "individual",
        &["--tpot-ms", "40"],
        json!({"recovery": {"eject_after": 1}}),
    )
    .await;
    let s = r.open_stream("its decode engine will crash", 30).await;
    let (status, doc) = r.drain_engine("d0").await;
    assert_eq!(status, 200, "{doc:#?}");
    assert_eq!(doc.document.engines.of("d0").state, DrainState::Draining);
    f.sim_mut("d0").proc.kill();
    s.drain().await;
    r.journal_event("drain_complete", Some("d0")).await;
    let doc = r.lifecycle().await;
    assert!(doc.engines.of("d0").ready_to_stop, "{doc:#?}");
    f.sim_mut("d0")
        .restart(&[])
        .expect("supervisor restarts d0");
    // Health answers again, but the drain hold stands until the operator readmits.
    let doc = r.lifecycle().await;
    assert_eq!(doc.engines.of("d0").state, DrainState::Drained, "{doc:#?}");
    let (status, doc) = r.readmit_engine("d0").await;
    assert_eq!(status, 200, "{doc:#?}");
    assert!(!r.has_event("recovery_validation_started", Some("d0")));
    r.lifecycle_until("d0 back", |d| d.engines.of("d0").accepts_new)
        .await;
    complete_on(&f, &r, "d0 decodes again", &[("d0", "decode")]).await;
}

/// The "transient breaker ejection" of handoff-and-lifecycle.md: the engine's process stalls
/// (SIGSTOP), its decode leg misses the first-token deadline (class `stream`) and the breaker
/// ejects it; when it resumes (SIGCONT) the same process is validated through the agents (`process
/// identity`, the start the router accepted at startup) and readmitted without a restart. A second
/// decode engine (`d1`) keeps the decode role live: the role's last live engine is never ejected
/// for failures (docs/deviations.md, "Ejection bound").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_engine_is_readmitted_as_the_same_process_after_it_resumes() {
    use nix::sys::signal::Signal;
    let (f, r) = lab_sized(
        "vllm",
        2,
        "individual",
        &[],
        // The KV score asks an engine's /tokenize first: bounded like the other calls here,
        // so the stalled engine's first request stalls its stream, not the tokenize call.
        json!({"recovery": {"eject_after": 1},
               "engine": {"first_token_timeout_s": 0.3, "kv_transfer_timeout_s": 0.1,
                          "health_timeout_s": 0.3, "tokenize_timeout_s": 0.2}}),
    )
    .await;
    let accepted = *r
        .lifecycle()
        .await
        .process_starts
        .get("d0")
        .expect("d0's process start accepted");
    f.sim("d0").proc.signal(Signal::SIGSTOP);
    // Placement picks d0 or d1: send until a request stalled on d0 ejected it.
    for i in 0..20 {
        trip_breaker(&r, &format!("d0 stalls {i}")).await;
        if !r.lifecycle().await.engines.of("d0").accepts_new {
            break;
        }
    }
    r.lifecycle_until("d0 ejected", |d| !d.engines.of("d0").accepts_new)
        .await;
    f.sim("d0").proc.signal(Signal::SIGCONT);
    let ev = r.journal_event("readmitted", Some("d0")).await;
    assert_eq!(ev.process_start, Some(accepted), "same process");
    let doc = r
        .lifecycle_until("d0 back", |d| d.engines.of("d0").accepts_new)
        .await;
    let e = &doc.engines.of("d0");
    assert!(!e.restart_required, "{doc:#?}");
    assert!(e.checks.contains(&"process identity".to_string()));
    let m = r.metrics().await;
    assert_counted(
        &m,
        "narwhal_engine_ejections_total",
        &["iid=\"d0\"", "cause=\"stream\""],
        "d0 ejected: its stream stalled",
    );
    // d0 takes decode legs again (placement picks between d0 and d1).
    let before = requests(&f, "d0", "decode").await;
    for i in 0..20 {
        r.complete(&format!("d0 decodes again {i}")).await;
        if requests(&f, "d0", "decode").await > before {
            return;
        }
    }
    panic!("readmitted d0 took no decode leg in 20 requests");
}

/// A readmission probe of the ejected engine that is still in flight when the operator's wave
/// readmission returns the engine to placement must not start a recovery afterwards: under
/// `whole_wave` that recovery used to hold the whole fleet in a new restart wave ("engine
/// recovery requires a managed whole-wave restart") right after the readmission answered 200,
/// which is how `crashed_engine_is_bound_to_its_verified_process_when_the_wave_drains` timed
/// out waiting for d0 on a loaded machine. Here every `/health` answer of d0 takes 1 s and the
/// monitor ticks every 50 ms, so the router's probes of the ejected d0 (one at a time) are in
/// flight about 95% of the time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_probe_answering_after_a_wave_readmission_does_not_hold_the_fleet_again() {
    let fast_probes = json!({"recovery": {"eject_after": 1},
                             "controller": {"monitor_interval_s": 0.05}});
    let (mut f, r) = lab("whole_wave", &[], fast_probes).await;
    crash_d0(&mut f, &r, "d0 crashed").await;
    r.journal_event("restart_required", None).await;
    let (status, doc) = r.drain(&wave_drain()).await;
    assert_eq!(status, 200, "{doc:#?}");
    r.journal_event("wave_ready_to_stop", None).await;
    f.sim_mut("p0").restart(&[]).expect("restart p0");
    f.sim_mut("d0").restart(&[]).expect("restart d0");
    f.sim("d0")
        .fault(json!({"phase": "health", "action": "hang", "ms": 1000, "count": 1000}))
        .await;
    let (status, doc) = r.readmit(&ReadmitBody::wave()).await;
    assert_eq!(status, 200, "{doc:#?}");
    r.journal_event("wave_readmitted", None).await;
    // Longer than a probe in flight takes to answer (1 s) and the next monitor tick.
    let again = wait_until(Duration::from_secs(3), || async {
        let events = r.lifecycle_event_rows();
        let done = events.iter().position(|e| e.action == "wave_readmitted")?;
        events[done..]
            .iter()
            .find(|e| e.action == "restart_required")
            .cloned()
    })
    .await;
    assert_eq!(
        again, None,
        "the fleet was held again after its readmission"
    );
    let doc = r
        .lifecycle_until("both engines in placement", |d| {
            d.engines.of("p0").accepts_new && d.engines.of("d0").accepts_new
        })
        .await;
    assert!(!doc.wave.active, "{doc:#?}");
    r.complete("after the wave").await;
}
