//! Breaker core, transition by transition (behaviour.md 6.2–6.4; docs/deviations.md, "Engine
//! health and the breaker"). Each test names the rule it enforces.

use super::*;
use crate::config::Role;
use narwhal_shared::{Clock as _, SystemClock};

const P: Role = Role::Prefill;
const D: Role = Role::Decode;
const S: Duration = Duration::from_secs(1);

fn policy() -> Policy {
    Policy {
        eject_after: 3,
        liveness_misses: 2,
        readmit_base: 10 * S,
        readmit_cap: 80 * S,
        max_ejection_percent: 50,
    }
}

fn slots(roles: &[Role]) -> Vec<EngineSlot> {
    roles.iter().map(|r| EngineSlot::new(*r)).collect()
}

/// A breaker over `roles` whose engines all passed their health gate at `t0`.
fn serving(roles: &[Role], policy: Policy) -> (Breaker, Vec<EngineSlot>, Instant) {
    let t0 = SystemClock.now();
    let s = slots(roles);
    let mut b = Breaker::new(roles.len(), policy);
    for t in b.due_probes(t0, &s) {
        assert_eq!(t.kind, ProbeKind::Gate);
        let tr = b.observe(t.iid, health(t, HealthAnswer::Ok), t0, &s);
        assert_eq!(tr, vec![Transition::Admitted { iid: t.iid }]);
    }
    (b, s, t0)
}

fn health(ticket: Ticket, a: HealthAnswer) -> Observation {
    Observation::Probe {
        ticket,
        result: ProbeResult::Health(a),
    }
}

fn generation(ticket: Ticket, passed: bool) -> Observation {
    Observation::Probe {
        ticket,
        result: ProbeResult::Generation { passed },
    }
}

fn fail(class: FailureClass) -> Observation {
    Observation::LegFailed(class)
}

const INF: FailureClass = FailureClass::InferenceStatus;

/// The ticket of engine `iid` among the due probes (panics when it is not due).
fn due(b: &mut Breaker, now: Instant, s: &[EngineSlot], iid: usize) -> Ticket {
    b.due_probes(now, s)
        .into_iter()
        .find(|t| t.iid == iid)
        .unwrap_or_else(|| panic!("engine {iid} not due at {now:?}"))
}

fn not_due(b: &mut Breaker, now: Instant, s: &[EngineSlot], iid: usize) {
    assert!(
        b.due_probes(now, s).iter().all(|t| t.iid != iid),
        "engine {iid} due"
    );
}

/// Ejects engine `iid` for inference errors (three in a row) at `now`.
fn eject_inference(b: &mut Breaker, s: &[EngineSlot], iid: usize, now: Instant) {
    let mut tr = Vec::new();
    for _ in 0..3 {
        tr = b.observe(iid, fail(INF), now, s);
    }
    assert_eq!(
        tr,
        vec![Transition::Ejected {
            iid,
            cause: EjectCause::Class(INF)
        }]
    );
}

/// Health gate: no engine is placed before its health path answered 200;
/// a 503 (loading) keeps it out, and counts as settled for the startup wait; a timeout does not.
#[test]
fn every_engine_awaits_its_first_health_200() {
    let t0 = SystemClock.now();
    let s = slots(&[P, D]);
    let mut b = Breaker::new(2, policy());
    assert_eq!(b.status(0), Status::AwaitingHealth);
    assert!(!b.settled(0));
    let ts = b.due_probes(t0, &s);
    assert_eq!(ts.len(), 2);
    assert!(ts.iter().all(|t| t.kind == ProbeKind::Gate));
    assert!(
        b.observe(0, health(ts[0], HealthAnswer::Unhealthy(503)), t0, &s)
            .is_empty()
    );
    assert_eq!(b.status(0), Status::AwaitingHealth);
    assert!(b.settled(0));
    assert!(
        b.observe(1, health(ts[1], HealthAnswer::TimedOut), t0, &s)
            .is_empty()
    );
    assert!(!b.settled(1));
    // Next tick: 200 admits.
    let t = due(&mut b, t0 + S, &s, 0);
    assert_eq!(
        b.observe(0, health(t, HealthAnswer::Ok), t0 + S, &s),
        vec![Transition::Admitted { iid: 0 }]
    );
    assert_eq!(b.status(0), Status::Serving);
    // Legs on an engine that is not serving change nothing.
    for _ in 0..5 {
        assert!(b.observe(1, fail(INF), t0 + S, &s).is_empty());
    }
}

/// Health gate: a gate probe that hangs does not hold the engine back; the next tick sends
/// another, the first 200 admits, and the late timeout of the first is ignored.
#[test]
fn a_slow_gate_probe_does_not_hold_a_healthy_engine_back() {
    let t0 = SystemClock.now();
    let s = slots(&[D]);
    let mut b = Breaker::new(1, policy());
    let slow = due(&mut b, t0, &s, 0);
    let quick = due(&mut b, t0 + S, &s, 0);
    assert_eq!(
        b.observe(0, health(quick, HealthAnswer::Ok), t0 + S, &s),
        vec![Transition::Admitted { iid: 0 }]
    );
    assert!(
        b.observe(0, health(slow, HealthAnswer::TimedOut), t0 + 5 * S, &s)
            .is_empty()
    );
    assert_eq!(b.status(0), Status::Serving);
    assert_eq!(b.misses(0), 0);
}

/// Breaker hygiene: a success resets the streak, so scattered failures
/// between successes never eject.
#[test]
fn a_success_resets_the_streak() {
    let (mut b, s, t0) = serving(&[P, P, D, D], policy());
    for _ in 0..20 {
        for class in [INF, FailureClass::Timeout, FailureClass::Connection] {
            assert!(b.observe(0, fail(class), t0, &s).is_empty());
            assert!(b.observe(0, fail(class), t0, &s).is_empty());
        }
        b.observe(0, Observation::PrefillOk, t0, &s);
        assert_eq!(b.streak(0, INF), 0);
        assert_eq!(b.streak(0, FailureClass::Timeout), 0);
        for _ in 0..2 {
            assert!(b.observe(2, fail(FailureClass::Stream), t0, &s).is_empty());
        }
        b.observe(2, Observation::DecodeOk, t0, &s);
        assert_eq!(b.streak(2, FailureClass::Stream), 0);
    }
    assert!(!b.is_ejected(0) && !b.is_ejected(2));
}

/// A decode success does not clear a prefill-side class (kv_handoff) and vice versa.
#[test]
fn a_success_clears_only_the_classes_its_leg_exercised() {
    let (mut b, s, t0) = serving(&[P, P, D], policy());
    let kv = fail(FailureClass::KvHandoff);
    b.observe(0, kv, t0, &s);
    b.observe(0, kv, t0, &s);
    b.observe(0, Observation::DecodeOk, t0, &s);
    assert_eq!(b.streak(0, FailureClass::KvHandoff), 2);
    assert_eq!(b.observe(0, kv, t0, &s).len(), 1);
}

/// Breaker hygiene: ejection needs `eject_after` consecutive failures of one class.
#[test]
fn ejection_needs_consecutive_failures() {
    let (mut b, s, t0) = serving(&[P, D, D], policy());
    assert!(b.observe(1, fail(INF), t0, &s).is_empty());
    assert!(b.observe(1, fail(INF), t0, &s).is_empty());
    assert_eq!(
        b.observe(1, fail(INF), t0, &s),
        vec![Transition::Ejected {
            iid: 1,
            cause: EjectCause::Class(INF)
        }]
    );
    assert!(b.is_ejected(1));
    // Further failures of an ejected engine change nothing.
    assert!(b.observe(1, fail(INF), t0, &s).is_empty());
    assert_eq!(b.ejections().get(&(1, EjectCause::Class(INF))), Some(&1));
}

/// Overload is not failure: busy answers never raise a streak or eject,
/// and they reset the connection streak (the engine answered).
#[test]
fn busy_answers_are_never_charged() {
    let (mut b, s, t0) = serving(&[P, P, D, D], policy());
    b.observe(0, fail(FailureClass::Connection), t0, &s);
    for _ in 0..100 {
        assert!(
            b.observe(0, fail(FailureClass::Overload), t0, &s)
                .is_empty()
        );
    }
    assert_eq!(b.streak(0, FailureClass::Overload), 0);
    assert_eq!(b.streak(0, FailureClass::Connection), 0);
    assert_eq!(b.status(0), Status::Serving);
}

/// One probe timeout neither ejects nor degrades a serving engine;
/// `liveness_misses` consecutive timeouts do.
#[test]
fn one_liveness_timeout_changes_nothing() {
    let (mut b, s, t0) = serving(&[D, D], policy());
    for k in 0..10u32 {
        let now = t0 + k * S;
        let t = due(&mut b, now, &s, 0);
        assert_eq!(t.kind, ProbeKind::Liveness);
        // While it is out, no second liveness probe of the same engine.
        not_due(&mut b, now, &s, 0);
        let answer = if k % 2 == 0 {
            HealthAnswer::TimedOut
        } else {
            HealthAnswer::Ok
        };
        assert!(b.observe(0, health(t, answer), now, &s).is_empty());
        assert!(!b.is_degraded(0));
    }
    let t = due(&mut b, t0 + 20 * S, &s, 0);
    b.observe(0, health(t, HealthAnswer::TimedOut), t0 + 20 * S, &s);
    let t = due(&mut b, t0 + 21 * S, &s, 0);
    assert_eq!(
        b.observe(0, health(t, HealthAnswer::TimedOut), t0 + 21 * S, &s),
        vec![Transition::Ejected {
            iid: 0,
            cause: EjectCause::Liveness
        }]
    );
}

/// Identity: an engine whose probe cannot connect or is answered non-200
/// is not there: ejected at once, unbounded (even the last engine), as a new process.
#[test]
fn an_absent_engine_is_ejected_at_once_as_a_new_process() {
    let (mut b, s, t0) = serving(&[P, D], policy());
    let ts = b.due_probes(t0, &s);
    assert_eq!(
        b.observe(1, health(ts[1], HealthAnswer::Unreachable), t0, &s),
        vec![
            Transition::Ejected {
                iid: 1,
                cause: EjectCause::HealthProbe
            },
            Transition::NewProcess { iid: 1 },
        ]
    );
    assert_eq!(b.incarnation(1), 1);
    assert_eq!(
        b.observe(0, health(ts[0], HealthAnswer::Unhealthy(500)), t0, &s)[0],
        Transition::Ejected {
            iid: 0,
            cause: EjectCause::HealthProbe
        }
    );
}

/// Panic threshold: a role's last live engine is never ejected for
/// failures; it stays in placement flagged degraded (one transition), and a success clears it.
#[test]
fn the_last_live_engine_of_a_role_stays_degraded() {
    let (mut b, s, t0) = serving(&[P, D], policy());
    let mut seen = Vec::new();
    for _ in 0..10 {
        seen.extend(b.observe(1, fail(INF), t0, &s));
    }
    assert_eq!(
        seen,
        vec![Transition::Degraded {
            iid: 1,
            cause: EjectCause::Class(INF)
        }]
    );
    assert!(b.is_degraded(1) && !b.is_ejected(1));
    assert_eq!(b.streak(1, INF), 10);
    b.observe(1, Observation::DecodeOk, t0, &s);
    assert!(!b.is_degraded(1));
    // The same for liveness timeouts.
    for k in 0..4u32 {
        let t = due(&mut b, t0 + k * S, &s, 0);
        b.observe(0, health(t, HealthAnswer::TimedOut), t0 + k * S, &s);
    }
    assert!(b.is_degraded(0) && !b.is_ejected(0));
}

/// Bounded ejection: at most `max(1, ⌊n × max_ejection_percent / 100⌋)`
/// engines of a role are out for failures; the rest stay degraded.
#[test]
fn ejections_are_bounded_per_role() {
    let (mut b, s, t0) = serving(&[P, D, D, D, D], policy());
    for iid in 1..=4 {
        for _ in 0..3 {
            b.observe(iid, fail(INF), t0, &s);
        }
    }
    let out: Vec<usize> = (1..=4).filter(|i| b.is_ejected(*i)).collect();
    assert_eq!(out, vec![1, 2], "50% of four");
    assert!(b.is_degraded(3) && b.is_degraded(4));
    // 25%: one of four.
    let (mut b, s, t0) = serving(
        &[P, D, D, D, D],
        Policy {
            max_ejection_percent: 25,
            ..policy()
        },
    );
    for iid in 1..=4 {
        for _ in 0..3 {
            b.observe(iid, fail(INF), t0, &s);
        }
    }
    assert_eq!((1..=4).filter(|i| b.is_ejected(*i)).count(), 1);
    // Engines held by the lifecycle are not live: they do not count as the role's others.
    let (mut b, mut s, t0) = serving(&[P, D, D], policy());
    s[2].excluded.insert(Exclusion::Draining);
    for _ in 0..3 {
        b.observe(1, fail(INF), t0, &s);
    }
    assert!(b.is_degraded(1) && !b.is_ejected(1));
}

/// Readmission: an engine ejected for failed inference is probed after
/// its hold, and returns only once health answers 200 *and* a generation probe passes; every
/// failed readmission doubles the hold.
#[test]
fn readmission_needs_a_generation_probe() {
    let (mut b, s, t0) = serving(&[P, D, D], policy());
    eject_inference(&mut b, &s, 1, t0);
    not_due(&mut b, t0 + 9 * S, &s, 1);
    let t1 = t0 + 10 * S;
    let t = due(&mut b, t1, &s, 1);
    assert_eq!(t.kind, ProbeKind::Readmission);
    assert!(
        b.observe(1, health(t, HealthAnswer::Unhealthy(503)), t1, &s)
            .is_empty()
    );
    not_due(&mut b, t1 + 19 * S, &s, 1);
    let t2 = t1 + 20 * S;
    let t = due(&mut b, t2, &s, 1);
    // /health said 200 but generation failed: still out, hold doubled again.
    assert!(b.observe(1, generation(t, false), t2, &s).is_empty());
    assert!(b.is_ejected(1));
    not_due(&mut b, t2 + 39 * S, &s, 1);
    let t3 = t2 + 40 * S;
    let t = due(&mut b, t3, &s, 1);
    assert_eq!(
        b.observe(1, generation(t, true), t3, &s),
        vec![Transition::Readmitted {
            iid: 1,
            evidence: "generation"
        }]
    );
    assert_eq!(b.status(1), Status::Serving);
    assert_eq!(b.streak(1, INF), 0);
    assert_eq!(b.readmissions().get(&(1, "generation")), Some(&1));
}

fn hold(b: &Breaker, iid: usize) -> Duration {
    match b.status(iid) {
        Status::Ejected { hold, .. } => hold,
        other => panic!("{other:?}"),
    }
}

/// Backoff: the ejection time grows on each repeat, capped at
/// `max_readmit_interval_s`, and sustained service forgives the repeats.
#[test]
fn ejection_time_grows_on_each_repeat_and_sustained_health_resets_it() {
    let (mut b, s, t0) = serving(&[P, D, D], policy());
    let mut now = t0;
    let mut holds = Vec::new();
    for _ in 0..5 {
        eject_inference(&mut b, &s, 1, now);
        holds.push(hold(&b, 1).as_secs());
        now += hold(&b, 1);
        let t = due(&mut b, now, &s, 1);
        b.observe(1, generation(t, true), now, &s);
    }
    assert_eq!(holds, vec![10, 20, 40, 80, 80]);
    // Five strikes; five base intervals of service forgive them all.
    now += 50 * S;
    eject_inference(&mut b, &s, 1, now);
    assert_eq!(hold(&b, 1), 10 * S);
}

/// Identity: an absent engine is probed every tick (no backoff) and
/// returns through the generation probe; if it answers health but cannot generate, it becomes
/// a failure ejection (`inference_probe`) with a hold.
#[test]
fn an_absent_engine_returns_through_the_generation_probe() {
    let (mut b, s, t0) = serving(&[P, D], policy());
    let t = due(&mut b, t0, &s, 0);
    b.observe(0, health(t, HealthAnswer::Unreachable), t0, &s);
    let t = due(&mut b, t0, &s, 0);
    assert_eq!(t.kind, ProbeKind::Readmission);
    assert!(
        b.observe(0, health(t, HealthAnswer::Unreachable), t0, &s)
            .is_empty()
    );
    let t = due(&mut b, t0 + S, &s, 0);
    assert_eq!(
        b.observe(0, generation(t, false), t0 + S, &s),
        vec![Transition::Ejected {
            iid: 0,
            cause: EjectCause::InferenceProbe
        }]
    );
    assert_eq!(hold(&b, 0), 10 * S);
    not_due(&mut b, t0 + 2 * S, &s, 0);
    let t = due(&mut b, t0 + 11 * S, &s, 0);
    assert_eq!(
        b.observe(0, generation(t, true), t0 + 11 * S, &s),
        vec![Transition::Readmitted {
            iid: 0,
            evidence: "generation"
        }]
    );
}

/// Identity: a changed identity makes the engine a new engine: out of
/// placement (unbounded) and forgotten; if it already is out, only forgotten.
#[test]
fn a_changed_identity_ejects_and_forgets() {
    let (mut b, s, t0) = serving(&[P, D], policy());
    assert_eq!(
        b.observe(0, Observation::IdentityChanged, t0, &s),
        vec![
            Transition::Ejected {
                iid: 0,
                cause: EjectCause::ProcessIdentity
            },
            Transition::NewProcess { iid: 0 },
        ]
    );
    assert_eq!(
        b.observe(0, Observation::IdentityChanged, t0, &s),
        vec![Transition::NewProcess { iid: 0 }]
    );
    assert_eq!(b.incarnation(0), 2);
    // Agent validation readmits with evidence `lifecycle` and starts a fresh process record.
    assert_eq!(
        b.observe(0, Observation::Verified, t0, &s),
        vec![
            Transition::Readmitted {
                iid: 0,
                evidence: "lifecycle"
            },
            Transition::NewProcess { iid: 0 },
        ]
    );
}

/// The health of engines the lifecycle holds is its business (a planned restart is not an
/// absence): no liveness probes; an ejected engine is still probed for readmission (a failed
/// recovery validation is retried).
#[test]
fn held_engines_get_no_liveness_probe_but_ejected_ones_are_retried() {
    let (mut b, mut s, t0) = serving(&[P, D, D], policy());
    s[1].excluded.insert(Exclusion::Draining);
    let ts = b.due_probes(t0, &s);
    assert_eq!(ts.iter().map(|t| t.iid).collect::<Vec<_>>(), vec![0, 2]);
    b.eject_now(1, EjectCause::ProcessIdentity, t0);
    let t = due(&mut b, t0, &s, 1);
    assert_eq!(t.kind, ProbeKind::Readmission);
}

/// A probe result for a state the engine has left is ignored.
#[test]
fn stale_probe_results_are_ignored() {
    let (mut b, s, t0) = serving(&[P, D, D], policy());
    let t = due(&mut b, t0, &s, 1);
    eject_inference(&mut b, &s, 1, t0);
    assert!(
        b.observe(1, health(t, HealthAnswer::Unreachable), t0, &s)
            .is_empty()
    );
    assert_eq!(
        b.status(1),
        Status::Ejected {
            cause: EjectCause::Class(INF),
            at: t0,
            hold: 10 * S,
            next_probe: t0 + 10 * S
        }
    );
}

/// Restored ejections (handoff) wait one base interval and return like any failure ejection.
#[test]
fn restored_ejections_wait_one_interval() {
    let (mut b, s, t0) = serving(&[P, D], policy());
    assert_eq!(
        b.eject_now(1, EjectCause::Restored, t0),
        vec![Transition::Ejected {
            iid: 1,
            cause: EjectCause::Restored
        }]
    );
    assert!(b.eject_now(1, EjectCause::Restored, t0).is_empty());
    not_due(&mut b, t0 + 9 * S, &s, 1);
    let t = due(&mut b, t0 + 10 * S, &s, 1);
    assert_eq!(b.observe(1, generation(t, true), t0 + 10 * S, &s).len(), 1);
}

fn arb_obs() -> impl proptest::strategy::Strategy<Value = (usize, u8, u8)> {
    (0usize..6, 0u8..12, 0u8..4)
}

proptest::proptest! {
    /// Below the threshold nothing is ejected, whatever the interleaving of classes.
    #[test]
    fn no_ejection_without_a_full_streak(seq in proptest::collection::vec(0usize..7, 0..40)) {
        let (mut b, s, t0) = serving(&[P, D, D], Policy { eject_after: 1000, ..policy() });
        for c in seq {
            let tr = b.observe(1, fail(FailureClass::ALL[c]), t0, &s);
            proptest::prop_assert!(tr.is_empty());
        }
        proptest::prop_assert!(!b.is_ejected(1));
    }

    /// Whatever happens, a role never has all its engines out for failures, and its failure
    /// ejections stay within the bound.
    #[test]
    fn the_bound_holds_whatever_happens(
        roles in proptest::collection::vec(proptest::bool::ANY, 1..7),
        pct in 1u32..=100,
        steps in proptest::collection::vec(arb_obs(), 0..200),
    ) {
        let roles: Vec<Role> = roles.iter().map(|p| if *p { P } else { D }).collect();
        let n = roles.len();
        let (mut b, s, t0) = serving(&roles, Policy { max_ejection_percent: pct, ..policy() });
        let mut now = t0;
        let mut tickets: Vec<Ticket> = Vec::new();
        for (iid, what, arg) in steps {
            let iid = iid % n;
            now += Duration::from_millis(700);
            tickets.extend(b.due_probes(now, &s));
            let obs = match what {
                0..=4 => fail(FailureClass::ALL[usize::from(arg) % 7]),
                5 => Observation::PrefillOk,
                6 => Observation::DecodeOk,
                7..=9 => {
                    let Some(pos) = tickets.iter().position(|t| t.iid == iid) else { continue };
                    let t = tickets.remove(pos);
                    let result = match arg {
                        0 => ProbeResult::Health(HealthAnswer::TimedOut),
                        1 => ProbeResult::Health(HealthAnswer::Ok),
                        2 => ProbeResult::Generation { passed: what == 7 },
                        _ => ProbeResult::Health(HealthAnswer::Unreachable),
                    };
                    Observation::Probe { ticket: t, result }
                }
                10 => Observation::IdentityChanged,
                _ => Observation::Verified,
            };
            b.observe(iid, obs, now, &s);
            for role in [P, D] {
                let members: Vec<usize> = (0..n).filter(|j| roles[*j] == role).collect();
                if members.is_empty() {
                    continue;
                }
                let failed = members
                    .iter()
                    .filter(|j| matches!(b.status(**j), Status::Ejected { cause, .. } if cause.bounded()))
                    .count();
                let cap = (members.len() * pct as usize / 100).max(1);
                proptest::prop_assert!(failed <= cap, "{role:?}: {failed} > {cap}");
                let all_failed = members.iter().all(|j| {
                    matches!(b.status(*j), Status::Ejected { cause, .. } if cause.bounded())
                });
                proptest::prop_assert!(!all_failed, "{role:?} emptied by failure ejections");
            }
        }
    }
}
