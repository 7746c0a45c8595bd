//! The lifecycle machine's unit tests: fixtures, drains, waves, readmission, recovery and the
//! document; the handoff round trips in `tests/restore.rs`, cancel-drain in `tests/cancel.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use narwhal_shared::{Clock as _, SystemClock};
use serde_json::Value;

use super::*;
use crate::lifecycle::check_error::CheckError;

mod cancel;
mod restore;

fn t0() -> Now {
    Now {
        mono: SystemClock.now(),
        wall: 1_800_000_000.0,
    }
}

fn agent_err(detail: &str) -> CheckError {
    CheckError::Agent {
        detail: detail.into(),
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn lc(ids: &[&str], policy: RestartPolicy) -> Lifecycle {
    Lifecycle::new(ids.iter().map(|s| s.to_string()).collect(), policy)
}

fn set(ids: &[&str]) -> BTreeSet<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

fn drain(ids: &[&str], wave: bool) -> DrainRequest {
    DrainRequest {
        engines: ids.iter().map(|s| s.to_string()).collect(),
        wave,
        deadline_s: 30.0,
        deadline_given: true,
    }
}

fn actions(l: &Lifecycle) -> Vec<String> {
    l.events()
        .map(|e| e["action"].as_str().unwrap_or_default().to_string())
        .collect()
}

fn ok(start: f64) -> EngineOutcome {
    EngineOutcome {
        checks: vec!["health".into()],
        failures: vec![],
        process_start: Some(start),
    }
}

fn fail(msg: &str) -> EngineOutcome {
    EngineOutcome {
        checks: vec!["health".into()],
        failures: vec![msg.into()],
        process_start: None,
    }
}

/// Drains `iid` of an idle two-engine fleet to `drained` with start 100.
fn drained(l: &mut Lifecycle, now: Now, iid: &str) {
    let plan = l
        .begin(now, &drain(&[iid], false), &set(&["e0", "e1"]), "")
        .unwrap();
    assert_eq!(plan.capture, vec![iid.to_string()]);
    assert!(l.bind_identity(now, iid, Ok(100.0), false));
    l.refresh(now, |_| 0);
    assert_eq!(l.state(iid), DrainState::Drained);
}

#[test]
fn drain_leaves_placement_before_identity_and_completes_when_idle() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    let plan = l
        .begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
        .unwrap();
    assert_eq!(l.held(), set(&["e0"]), "held before any identity capture");
    assert_eq!(plan.capture, vec!["e0".to_string()]);
    assert!(!l.ready_to_stop("e0"));
    l.refresh(now, |_| 0);
    assert_eq!(
        l.state("e0"),
        DrainState::Draining,
        "no identity yet: not drained"
    );
    assert!(l.bind_identity(now, "e0", Ok(100.0), false));
    l.refresh(now, |_| 0);
    assert_eq!(l.state("e0"), DrainState::Drained);
    assert!(l.ready_to_stop("e0"));
    assert_eq!(
        actions(&l),
        ["drain_started", "process_recorded", "drain_complete"]
    );
}

#[test]
fn drain_waits_for_resident_work_then_reports_deadline_then_drains() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
        .unwrap();
    l.bind_identity(now, "e0", Ok(100.0), false);
    l.refresh(now, |_| 2);
    assert_eq!(l.state("e0"), DrainState::Draining);
    assert!(!l.ready_to_stop("e0"));
    assert_eq!(l.next_deadline(), Some(now.mono + secs(30)));
    l.refresh(now.after(secs(31)), |_| 2);
    assert_eq!(l.state("e0"), DrainState::DeadlineExceeded);
    assert_eq!(
        l.record("e0").unwrap().error,
        "2 resident request(s) remain after the drain deadline"
    );
    l.refresh(now.after(secs(32)), |_| 2);
    assert_eq!(
        actions(&l)
            .iter()
            .filter(|a| *a == "drain_deadline_exceeded")
            .count(),
        1,
        "each event once"
    );
    l.refresh(now.after(secs(40)), |_| 0);
    assert_eq!(l.state("e0"), DrainState::Drained);
    assert_eq!(l.record("e0").unwrap().error, "", "no stale deadline error");
}

#[test]
fn drain_rules_are_checked_in_order_and_change_nothing() {
    let now = t0();
    let live = set(&["e0", "e1"]);
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    let err = |l: &mut Lifecycle, r: DrainRequest, live: &BTreeSet<String>| {
        l.begin(now, &r, live, "wave-x").unwrap_err().to_string()
    };
    assert_eq!(
        err(&mut l, drain(&["zz", "e0", "aa"], false), &live),
        "unknown engine(s): aa, zz"
    );
    let mut bad = drain(&["e0"], false);
    bad.deadline_s = 0.0;
    assert_eq!(
        err(&mut l, bad.clone(), &live),
        "deadline_s must be positive"
    );
    bad.deadline_s = f64::NAN;
    assert_eq!(
        err(&mut l, bad.clone(), &live),
        "deadline_s must be positive"
    );
    bad.deadline_s = 1e300;
    assert_eq!(
        err(&mut l, bad, &live),
        "deadline_s must be at most 31536000 (one year)"
    );
    assert_eq!(
        err(&mut l, drain(&["e0", "e1"], false), &live),
        "a non-wave drain must name exactly one engine"
    );
    assert_eq!(
        err(&mut l, drain(&[], false), &live),
        "a non-wave drain must name exactly one engine"
    );
    assert_eq!(
        err(&mut l, drain(&["e0"], true), &live),
        "a whole-wave drain must name every configured engine"
    );
    assert_eq!(
        err(&mut l, drain(&["e0"], false), &set(&["e0"])),
        "the last schedulable engine requires a whole-wave drain"
    );
    assert!(l.held().is_empty());
    assert_eq!(l.events().count(), 0);
    let mut w = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    assert_eq!(
        err(&mut w, drain(&["e0"], false), &live),
        "engine_restart_policy requires a whole-wave drain"
    );
}

#[test]
fn second_engine_drain_while_one_is_held_is_409() {
    let now = t0();
    let mut l = lc(&["e0", "e1", "e2"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    let e = l
        .begin(now, &drain(&["e1"], false), &set(&["e1", "e2"]), "")
        .unwrap_err();
    assert_eq!(e.to_string(), "lifecycle action already active for e0");
}

#[test]
fn repeating_an_accepted_drain_is_idempotent() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    let before = l.record("e0").cloned();
    let n = l.events().count();
    let plan = l
        .begin(now, &drain(&["e0"], false), &set(&["e1"]), "")
        .unwrap();
    assert!(plan.repeated);
    assert!(plan.capture.is_empty());
    assert_eq!(l.record("e0").cloned(), before);
    assert_eq!(l.events().count(), n);
    // Another deadline is refused; none named is a repeat.
    let mut other = drain(&["e0"], false);
    other.deadline_s = 60.0;
    let e = l.begin(now, &other, &set(&["e1"]), "").unwrap_err();
    assert_eq!(
        e,
        LifecycleError::DeadlineConflict {
            iid: "e0".into(),
            deadline_s: 30.0
        }
    );
    other.deadline_given = false;
    assert!(l.begin(now, &other, &set(&["e1"]), "").unwrap().repeated);
    assert_eq!(l.record("e0").cloned(), before, "refusals change nothing");
}

#[test]
fn deadline_passing_while_the_identity_is_captured_keeps_its_error() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
        .unwrap();
    l.refresh(now.after(secs(31)), |_| 1);
    assert_eq!(l.state("e0"), DrainState::DeadlineExceeded);
    assert!(l.bind_identity(now.after(secs(32)), "e0", Ok(100.0), false));
    let r = l.record("e0").unwrap();
    assert_eq!(r.state, DrainState::DeadlineExceeded);
    assert_eq!(
        r.error,
        "1 resident request(s) remain after the drain deadline"
    );
    assert_eq!(r.old_process_start, Some(100.0));
}

#[test]
fn failed_capture_blocks_and_the_same_drain_retries_it() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
        .unwrap();
    assert!(!l.bind_identity(now, "e0", Err(agent_err("e0: agent unreachable")), false));
    assert_eq!(l.state("e0"), DrainState::Blocked);
    assert_eq!(l.held(), set(&["e0"]), "stays out of placement");
    let plan = l
        .begin(now, &drain(&["e0"], false), &set(&["e1"]), "")
        .unwrap();
    assert_eq!(plan.capture, vec!["e0".to_string()]);
    assert!(!plan.repeated);
    assert!(l.bind_identity(now, "e0", Ok(100.0), false));
    assert_eq!(l.state("e0"), DrainState::Draining);
    assert_eq!(l.record("e0").unwrap().error, "");
}

#[test]
fn ejected_engine_binds_to_last_accepted_start() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    l.accept_process_start("e0", 90.0);
    l.begin(now, &drain(&["e0"], false), &set(&["e1", "e0"]), "")
        .unwrap();
    assert!(l.bind_identity(now, "e0", Err(agent_err("connection refused")), true));
    assert_eq!(l.record("e0").unwrap().old_process_start, Some(90.0));
}

#[test]
fn startup_identity_binds_a_crashed_engine_in_a_forced_wave() {
    // Found by tests/tests/e2e/lifecycle_e2e.rs: without the starts accepted at startup
    // (identity::check_identities), a crashed engine's forced-wave drain stayed 503 until it
    // was restarted, and then needed a second restart.
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    l.accept_process_start("e0", 90.0);
    l.accept_process_start("e1", 91.0);
    l.require_restart_wave(now, "engine e1 was excluded", false, "wave-a");
    let plan = l
        .begin(now, &drain(&[], true), &set(&[]), "wave-b")
        .unwrap();
    assert_eq!(plan.capture.len(), 2, "identity retry of the forced wave");
    assert!(l.bind_identity(now, "e0", Ok(90.0), false));
    assert!(l.bind_identity(now, "e1", Err(agent_err("agent: engine not running")), true));
    assert_eq!(l.record("e1").unwrap().old_process_start, Some(91.0));
    l.refresh(now, |_| 0);
    assert!(l.wave_ready_to_stop());
}

#[test]
fn an_ejected_peer_joins_a_readmission_and_both_return() {
    let now = t0();
    let mut l = lc(&["p0", "d0"], RestartPolicy::Individual);
    l.accept_process_start("d0", 50.0);
    drained(&mut l, now, "p0");
    assert!(
        !l.start_recovery_validation(now, "d0", "wave-r"),
        "the held target blocks the peer's own recovery"
    );
    let ids = vec!["p0".to_string()];
    l.mark_validating(now, &ids, false, |_| 0).unwrap();
    assert!(l.join_recovery(now, "d0"));
    assert!(!l.join_recovery(now, "d0"), "already validating");
    assert!(!l.join_recovery(now, "zz"));
    let r = l.record("d0").unwrap();
    assert_eq!(
        (r.state, r.restart_required(), r.old_process_start),
        (DrainState::Validating, false, Some(50.0))
    );
    // A failure blocks both; the next readmission takes the failed recovery along again.
    l.validation_failed(
        now,
        &BTreeMap::from([("d0".to_string(), fail("health did not answer 200"))]),
    );
    assert_eq!(l.state("d0"), DrainState::Blocked);
    l.mark_validating(now, &ids, false, |_| 0).unwrap();
    assert!(l.join_recovery(now, "d0"));
    let back = l.readmitted(
        now,
        &BTreeMap::from([("p0".to_string(), ok(200.0)), ("d0".to_string(), ok(60.0))]),
    );
    assert_eq!(back, ["d0", "p0"]);
    assert!(l.held().is_empty());
    assert_eq!(l.process_starts()["d0"], 60.0);
    let mut w = lc(&["p0", "d0"], RestartPolicy::WholeWave);
    w.require_restart_wave(now, "r", false, "wave-w");
    assert!(!w.join_recovery(now, "d0"), "never during a wave");
}

#[test]
fn readmission_rules() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    let e = |l: &mut Lifecycle, ids: &[&str], wave: bool| {
        let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
        l.mark_validating(now, &ids, wave, |_| 0)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(e(&mut l, &["e0"], false), "e0 is active, expected drained");
    assert_eq!(
        e(&mut l, &["e0", "e1"], false),
        "readmission must name exactly one engine"
    );
    assert_eq!(
        e(&mut l, &[], true),
        "whole-wave readmission must name the active wave's complete engine set"
    );
    l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
        .unwrap();
    l.bind_identity(now, "e0", Ok(100.0), false);
    l.refresh(now, |_| 1);
    let ids = vec!["e0".to_string()];
    assert_eq!(
        l.mark_validating(now, &ids, false, |_| 1)
            .unwrap_err()
            .to_string(),
        "e0 is draining, expected drained"
    );
    assert_eq!(l.mark_validating(now, &ids, false, |_| 0).unwrap(), ids);
    assert_eq!(l.state("e0"), DrainState::Validating);
}

#[test]
fn blocked_capture_without_identity_cannot_be_readmitted() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
        .unwrap();
    l.bind_identity(now, "e0", Err(agent_err("unreadable")), false);
    let ids = vec!["e0".to_string()];
    assert_eq!(
        l.mark_validating(now, &ids, false, |_| 0)
            .unwrap_err()
            .to_string(),
        "e0 has no recorded pre-restart process identity"
    );
}

#[test]
fn failed_validation_blocks_and_names_failures_then_passes() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    let ids = vec!["e0".to_string()];
    l.mark_validating(now, &ids, false, |_| 0).unwrap();
    let out = BTreeMap::from([(
        "e0".to_string(),
        fail("engine process did not restart after drain"),
    )]);
    l.validation_failed(now, &out);
    let r = l.record("e0").unwrap();
    assert_eq!(r.state, DrainState::Blocked);
    assert_eq!(r.error, "engine process did not restart after drain");
    assert_eq!(r.checks, vec!["health".to_string()]);
    assert_eq!(l.held(), set(&["e0"]));
    // Blocked keeps the captured identity: readmit again without a re-drain.
    l.mark_validating(now, &ids, false, |_| 0).unwrap();
    let back = l.readmitted(now, &BTreeMap::from([("e0".to_string(), ok(200.0))]));
    assert_eq!(back, ids);
    let r = l.record("e0").unwrap();
    assert_eq!(r.state, DrainState::Active);
    assert_eq!(r.new_process_start, Some(200.0));
    assert_eq!(r.old_process_start, Some(100.0));
    assert_eq!(l.process_starts()["e0"], 200.0);
    assert!(l.held().is_empty());
}

#[test]
fn peer_failure_is_reported_by_name() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    l.mark_validating(now, &["e0".to_string()], false, |_| 0)
        .unwrap();
    let out = BTreeMap::from([
        ("e0".to_string(), ok(200.0)),
        (
            "e1".to_string(),
            fail("peer process changed before readmission"),
        ),
    ]);
    l.validation_failed(now, &out);
    assert_eq!(
        l.record("e0").unwrap().error,
        "peer failed validation: e1 (peer process changed before readmission)"
    );
    assert!(l.record("e1").is_none(), "the peer gets no record");
}

#[test]
fn whole_wave_lifecycle() {
    let now = t0();
    let all = set(&["e0", "e1"]);
    let mut l = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    let plan = l.begin(now, &drain(&[], true), &all, "wave-abc").unwrap();
    assert_eq!(plan.capture.len(), 2);
    assert_eq!(l.wave_id(), "wave-abc");
    assert_eq!(l.blocked_reason(), "whole-wave drain wave-abc");
    assert_eq!(l.held(), all);
    l.bind_identity(now, "e0", Ok(100.0), false);
    l.bind_identity(now, "e1", Ok(101.0), false);
    l.refresh(now, |i| u32::from(i == "e1"));
    assert_eq!(l.state("e0"), DrainState::Drained);
    assert!(
        !l.ready_to_stop("e0"),
        "wave member waits for the whole wave"
    );
    assert!(!l.wave_ready_to_stop());
    l.refresh(now, |_| 0);
    assert!(l.wave_ready_to_stop());
    assert!(l.ready_to_stop("e0") && l.ready_to_stop("e1"));
    l.refresh(now, |_| 0);
    assert_eq!(
        actions(&l)
            .iter()
            .filter(|a| *a == "wave_ready_to_stop")
            .count(),
        1
    );
    let one = vec!["e0".to_string()];
    assert_eq!(
        l.mark_validating(now, &one, false, |_| 0)
            .unwrap_err()
            .to_string(),
        "an active whole wave must be validated and readmitted as one engine set"
    );
    assert_eq!(
        l.mark_validating(now, &one, true, |_| 0)
            .unwrap_err()
            .to_string(),
        "whole-wave readmission must name the active wave's complete engine set"
    );
    let targets = l.mark_validating(now, &[], true, |_| 0).unwrap();
    l.validation_failed(
        now,
        &BTreeMap::from([
            ("e0".to_string(), ok(200.0)),
            (
                "e1".to_string(),
                fail("engine process did not restart after drain"),
            ),
        ]),
    );
    assert_eq!(l.state("e0"), DrainState::Blocked);
    assert_eq!(
        l.record("e0").unwrap().error,
        "another engine in the wave failed validation: e1 (engine process did not restart after drain)"
    );
    assert_eq!(l.wave_id(), "wave-abc", "wave stays active");
    l.mark_validating(now, &targets, true, |_| 0).unwrap();
    l.readmitted(
        now,
        &BTreeMap::from([("e0".to_string(), ok(200.0)), ("e1".to_string(), ok(201.0))]),
    );
    assert_eq!(l.wave_id(), "");
    assert_eq!(l.blocked_reason(), "");
    assert!(l.held().is_empty());
    assert!(!l.record("e0").unwrap().in_wave(), "wave_id cleared");
    assert!(actions(&l).contains(&"wave_readmitted".to_string()));
}

#[test]
fn wave_ready_to_stop_is_false_without_a_wave() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    assert!(l.ready_to_stop("e0"));
    assert!(!l.wave_ready_to_stop());
    let doc = l.document("active", true, |_| EngineView::default(), "");
    assert!(!doc.wave.ready_to_stop);
    assert!(!doc.wave.active);
}

#[test]
fn promotion_to_a_wave_when_nothing_is_live() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    let e = l
        .begin(now, &drain(&[], true), &set(&["e1"]), "wave-1")
        .unwrap_err();
    assert_eq!(e.to_string(), "lifecycle action already active for e0");
    let plan = l
        .begin(now, &drain(&[], true), &set(&[]), "wave-1")
        .unwrap();
    assert_eq!(
        plan.capture,
        vec!["e1".to_string()],
        "e0 keeps its captured identity"
    );
    assert_eq!(l.record("e0").unwrap().old_process_start, Some(100.0));
}

#[test]
fn recovery_validation_needs_no_restart_and_respects_other_holds() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    l.accept_process_start("e1", 50.0);
    assert!(l.start_recovery_validation(now, "e1", "wave-r"));
    let r = l.record("e1").unwrap();
    assert_eq!(
        (r.state, r.restart_required()),
        (DrainState::Validating, false)
    );
    assert!(
        !l.start_recovery_validation(now, "e0", "wave-r"),
        "one action at a time"
    );
    l.readmitted(now, &BTreeMap::from([("e1".to_string(), ok(50.0))]));
    assert_eq!(l.state("e1"), DrainState::Active);
    let mut w = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    assert!(!w.start_recovery_validation(now, "e1", "wave-r"));
    assert_eq!(w.held(), set(&["e0", "e1"]));
    assert_eq!(
        w.blocked_reason(),
        "whole-wave restart required: engine recovery requires a managed whole-wave restart"
    );
    // The operator's way out: a wave drain captures identities for the blocked records.
    let plan = w
        .begin(now, &drain(&[], true), &set(&[]), "wave-2")
        .unwrap();
    assert_eq!(plan.capture.len(), 2);
}

#[test]
fn document_shape() {
    let now = t0();
    let mut l = lc(&["e1", "e0"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    let doc = l.document(
        "fenced",
        false,
        |i| EngineView {
            resident_prefill: 0,
            resident_decode: u32::from(i == "e1"),
            accepts_new: i == "e1",
        },
        "boom",
    );
    // The shape on the wire.
    let doc = serde_json::to_value(doc).expect("serialises");
    assert_eq!(doc["schema"], "narwhal.lifecycle");
    assert_eq!(doc["router"]["controls_fleet"], "fenced");
    let keys: Vec<&String> = doc["engines"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["e0", "e1"], "sorted");
    let e0 = &doc["engines"]["e0"];
    assert_eq!(e0["state"], "drained");
    assert_eq!(e0["draining"], true);
    assert_eq!(e0["accepts_new"], false);
    assert_eq!(e0["ready_to_stop"], true);
    assert_eq!(e0["old_process_start"], 100.0);
    let e1 = &doc["engines"]["e1"];
    assert_eq!(e1["state"], "active");
    assert_eq!(e1["deadline_at"], Value::Null);
    assert_eq!(e1["resident"]["decode"], 1);
    assert_eq!(doc["error"], "boom");
    assert_eq!(doc["events"].as_array().unwrap().len(), 3);
}
