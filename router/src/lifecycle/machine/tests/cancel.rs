//! Cancel-drain (ours; docs/deviations.md).

use std::collections::BTreeMap;

use super::super::*;
use super::{actions, agent_err, drain, drained, fail, lc, ok, set, t0};

/// Cancel-drain (docs/deviations.md): a drain cancelled without a restart validates the
/// recorded process and returns it with its own events; the refusals name their rule; a wave, a
/// recovery and a drain without an identity cannot be cancelled.
#[test]
fn a_drain_is_cancelled_on_the_same_process_with_its_own_events() {
    let now = t0();
    let one = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    let err = |l: &mut Lifecycle, ids: &[&str], wave: bool| {
        l.begin_cancel_drain(now, &one(ids), wave)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&mut l, &["e0"], false).starts_with("e0 is active: "));
    assert!(err(&mut l, &["e0", "e1"], false).starts_with("cancel-drain must name exactly one"));
    assert!(err(&mut l, &[], true).starts_with("cancel-drain must name exactly one"));
    assert_eq!(err(&mut l, &["x"], false), "unknown engine(s): x");
    // Still draining (resident work), not yet drained: a cancel is allowed.
    l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
        .unwrap();
    assert!(l.bind_identity(now, "e0", Ok(100.0), false));
    l.refresh(now, |_| 2);
    assert_eq!(l.state("e0"), DrainState::Draining);
    assert_eq!(
        l.begin_cancel_drain(now, &one(&["e0"]), false).unwrap(),
        ("e0".to_string(), 100.0)
    );
    assert_eq!(l.state("e0"), DrainState::Validating);
    assert!(l.held().contains("e0"), "out of placement while validated");
    assert!(l.drain_cancelled(now, "e0", &ok(100.0)));
    assert_eq!(l.state("e0"), DrainState::Active);
    assert!(l.held().is_empty());
    assert_eq!(l.process_starts()["e0"], 100.0);
    let acts = actions(&l);
    assert_eq!(
        acts[acts.len() - 2..],
        ["drain_cancel_started", "drain_cancelled"],
        "{acts:?}"
    );
    assert!(!acts.contains(&"readmitted".to_string()), "{acts:?}");
    let last = l.take_events().pop().expect("event");
    assert_eq!(
        last.to_json()["process_start"],
        100.0,
        "{:?}",
        last.to_json()
    );
    assert!(!l.drain_cancelled(now, "e0", &ok(100.0)), "only once");
    // A failed cancel blocks like a failed readmission; a readmission still
    // requires a restart afterwards, and a second cancel may be tried.
    drained(&mut l, now, "e1");
    l.begin_cancel_drain(now, &one(&["e1"]), false).unwrap();
    l.validation_failed(
        now,
        &BTreeMap::from([("e1".to_string(), fail("generation failed"))]),
    );
    assert_eq!(l.state("e1"), DrainState::Blocked);
    assert!(l.record("e1").unwrap().restart_required());
    assert!(l.begin_cancel_drain(now, &one(&["e1"]), false).is_ok());
    // A drain whose identity was never recorded cannot be cancelled.
    let mut l = lc(&["e0", "e1"], RestartPolicy::Individual);
    l.begin(now, &drain(&["e0"], false), &set(&["e0", "e1"]), "")
        .unwrap();
    l.bind_identity(now, "e0", Err(agent_err("agent down")), false);
    assert!(err(&mut l, &["e0"], false).starts_with("e0 has no recorded process identity"));
    // Wave members and breaker recoveries are not drains one can cancel.
    let mut w = lc(&["e0", "e1"], RestartPolicy::WholeWave);
    w.require_restart_wave(now, "r", false, "wave-w");
    assert!(err(&mut w, &["e0"], false).starts_with("e0 is held by the active whole wave"));
    let mut r = lc(&["e0", "e1"], RestartPolicy::Individual);
    r.accept_process_start("e0", 50.0);
    assert!(r.start_recovery_validation(now, "e0", "w"));
    r.validation_failed(now, &BTreeMap::from([("e0".to_string(), fail("x"))]));
    assert!(err(&mut r, &["e0"], false).starts_with("e0 is held by a breaker recovery"));
}
