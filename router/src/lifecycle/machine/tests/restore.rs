//! The handoff round trips: export and restore, re-anchored deadlines, held records and the
//! bounded event history (behaviour.md 2.1, 4.13).

use std::collections::BTreeMap;

use super::super::record::Hold;
use super::super::*;
use super::{drain, drained, lc, ok, secs, set, t0};

#[test]
fn export_restore_round_trip_blocks_interrupted_validation() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    l.accept_process_start("e1", 50.0);
    l.mark_validating(now, &["e0".to_string()], false, |_| 0)
        .unwrap();
    let state = l.export();
    assert_eq!(state.engine_restart_policy, "individual");
    let later = now.after(secs(100));
    let mut r = lc(&["e0", "e1"], RestartPolicy::Individual);
    r.restore(later, &state).unwrap();
    let rec = r.record("e0").unwrap();
    assert_eq!(rec.state, DrainState::Blocked);
    assert_eq!(
        rec.error,
        "readmission validation was interrupted by router replacement"
    );
    assert_eq!(rec.old_process_start, Some(100.0));
    assert_eq!(r.held(), set(&["e0"]));
    assert_eq!(r.process_starts()["e1"], 50.0);
    assert_eq!(r.events().count(), l.events().count());
    assert!(
        r.take_events().is_empty(),
        "restored events are not journaled again"
    );
    // The restored blocked record can be readmitted without a new drain.
    r.mark_validating(later, &["e0".to_string()], false, |_| 0)
        .unwrap();
}

#[test]
fn restore_reanchors_drain_deadlines_and_waves() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    l.begin(now, &drain(&[], true), &set(&["e0", "e1"]), "wave-w")
        .unwrap();
    let state = l.export();
    let mut r = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    let later = Now {
        mono: now.mono + secs(5),
        wall: now.wall + 10.0,
    };
    r.restore(later, &state).unwrap();
    assert_eq!(r.wave_id(), "wave-w");
    assert_eq!(r.blocked_reason(), "whole-wave drain wave-w");
    // 30 s deadline, 10 s of wall time gone: 20 s left on the new monotonic clock.
    assert_eq!(r.next_deadline(), Some(later.mono + secs(20)));
    let mut other = lc(&["e0", "e1"], RestartPolicy::Individual);
    assert_eq!(
        other.restore(later, &state).unwrap_err().to_string(),
        "handoff engine restart policy mismatch"
    );
}

#[test]
fn event_history_is_bounded() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    for i in 0..150 {
        l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
            .unwrap();
        l.bind_identity(now, "e0", Ok(f64::from(i)), false);
        l.refresh(now, |_| 0);
        l.mark_validating(now, &["e0".to_string()], false, |_| 0)
            .unwrap();
        l.readmitted(
            now,
            &BTreeMap::from([("e0".to_string(), ok(f64::from(i) + 0.5))]),
        );
    }
    assert_eq!(l.events().count(), EVENT_HISTORY);
    assert_eq!(l.take_events().len(), 150 * 5);
    assert!(l.take_events().is_empty());
}

/// The hold survives the wire form: a wave member, a drain and a recovery each come back
/// as themselves (and a readmitted wave's members as drains, restart still required).
#[test]
fn holds_round_trip_through_the_handoff() {
    let now = t0();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    drained(&mut l, now, "e0");
    let mut rec = lc(&["e0", "e1"], RestartPolicy::Individual);
    rec.accept_process_start("e1", 50.0);
    assert!(rec.start_recovery_validation(now, "e1", "wave-r"));
    for (machine, iid, restart_required) in [(&l, "e0", true), (&rec, "e1", false)] {
        let state = machine.export();
        let wire = state.records.iter().find(|r| r.iid == iid).unwrap();
        assert_eq!(
            (wire.restart_required, wire.wave_id.as_str()),
            (restart_required, "")
        );
        let mut r = lc(&["e0", "e1"], RestartPolicy::Individual);
        r.restore(now, &state).unwrap();
        let back = r.record(iid).unwrap();
        assert_eq!(back.restart_required(), restart_required);
        assert!(!back.in_wave());
    }
    let mut r = lc(&["e0", "e1"], RestartPolicy::Individual);
    r.restore(now, &rec.export()).unwrap();
    assert_eq!(r.record("e1").unwrap().hold, Hold::Recovery);
    assert_eq!(
        r.record("e1").unwrap().state,
        DrainState::Blocked,
        "interrupted"
    );
    let mut w = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    w.require_restart_wave(now, "r", false, "wave-w");
    let state = w.export();
    assert!(
        state
            .records
            .iter()
            .all(|r| r.wave_id == "wave-w" && r.restart_required)
    );
    let mut back = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    back.restore(now, &state).unwrap();
    assert_eq!(
        back.record("e0").unwrap().hold,
        Hold::Wave { deadline: None }
    );
    assert_eq!(back.export(), state, "the wire form round-trips");
}
