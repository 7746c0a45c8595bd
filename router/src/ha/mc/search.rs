//! The bounded searches: the CI bounds of each search, [`check`], and the tests that run
//! them (and the rules-off tests that require a counterexample).

use super::*;

/// CI bounds for failover: a fault (kill, pause past the TTL, store down or a clock jump)
/// at tick 0 or 1 around one operator action at tick 0.
pub(in crate::ha) const FAILOVER: Bounds = Bounds {
    fault_until: 1,
    settle: 4,
    faults: 1,
    ops: 1,
    op_until: 0,
    restarts: 0,
    serves: 0,
    drops: 0,
    delay: 1,
};

/// CI bounds for the totals: a fault at tick 0 or 1 around two served requests, and a
/// dropped message.
pub(in crate::ha) const TOTALS: Bounds = Bounds {
    fault_until: 1,
    settle: 4,
    faults: 1,
    ops: 0,
    op_until: 0,
    restarts: 0,
    serves: 2,
    drops: 1,
    delay: 1,
};

/// CI bounds for the lifecycle: two operator actions (drain or wave, then readmit or cancel)
/// and an engine restart at any point, no router fault.
pub(in crate::ha) const LIFECYCLE: Bounds = Bounds {
    fault_until: 0,
    settle: 3,
    faults: 0,
    ops: 2,
    op_until: 1,
    restarts: 1,
    serves: 0,
    drops: 0,
    delay: 1,
};

/// The safety properties (every `always` one).
pub(in crate::ha) const SAFETY: [&str; 7] = [
    "one controller at a time",
    "agents act only for the live epoch",
    "an agent never accepts an older epoch",
    "an acknowledged action is never lost",
    "readmission only after the checks on a newer process",
    "totals never go backwards",
    "some router controls the fleet once faults stop",
];

/// Runs a BFS of `model` to the end (or, with `stop_at`, to the first discovery of one of
/// those properties) and returns the joined checker. `NARWHAL_MC_MAX_STATES` caps it.
pub(in crate::ha) fn check(
    model: Narwhal,
    threads: usize,
    stop_at: Vec<&'static str>,
) -> impl Checker<Narwhal> {
    let mut b = model.checker().threads(threads);
    if !stop_at.is_empty() {
        b = b.finish_when(stateright::HasDiscoveries::AnyOf(
            stop_at.into_iter().collect(),
        ));
    }
    if let Some(n) = std::env::var("NARWHAL_MC_MAX_STATES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        b = b.target_state_count(n);
    }
    b.spawn_bfs().join()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `NARWHAL_MC_BOUNDS=fault_until,settle,faults,ops,op_until,restarts,serves,drops,delay`
    /// replaces the bounds (the deep search by hand, docs/design/model-check.md).
    fn bounds(default: Bounds) -> Bounds {
        let Ok(v) = std::env::var("NARWHAL_MC_BOUNDS") else {
            return default;
        };
        let n: Vec<u8> = v
            .split(',')
            .map(|x| x.trim().parse().expect("a number"))
            .collect();
        Bounds {
            fault_until: n[0],
            settle: n[1],
            faults: n[2],
            ops: n[3],
            op_until: n[4],
            restarts: n[5],
            serves: n[6],
            drops: n[7],
            delay: n[8],
        }
    }

    /// Every safety property holds over the whole bounded space, the search explored at
    /// least `floor` states, and each of `reached` was reached (so the bounds exercise it).
    fn holds(b: Bounds, floor: usize, reached: &[&'static str]) {
        let started = SystemClock.now();
        let c = check(Narwhal::new(b, Rules::Product), 1, Vec::new());
        eprintln!(
            "model check {b:?}: {} states ({} unique), depth {}, {:?}",
            c.state_count(),
            c.unique_state_count(),
            c.max_depth(),
            SystemClock.now().saturating_duration_since(started)
        );
        for p in SAFETY {
            c.assert_no_discovery(p);
        }
        for p in reached {
            assert!(c.discovery(p).is_some(), "never reached: {p}");
        }
        assert!(
            c.unique_state_count() >= floor,
            "the model explored only {} states",
            c.unique_state_count()
        );
    }

    #[test]
    fn no_interleaving_of_faults_and_failover_breaks_a_property() {
        holds(bounds(FAILOVER), 30_000, &["a takeover happens"]);
    }

    #[test]
    fn no_interleaving_of_faults_and_served_requests_breaks_a_property() {
        holds(bounds(TOTALS), 20_000, &["a takeover happens"]);
    }

    #[test]
    fn no_interleaving_of_lifecycle_actions_and_restarts_breaks_a_property() {
        holds(
            bounds(LIFECYCLE),
            30_000,
            &["a readmission is acknowledged"],
        );
    }

    /// With `rules` the checker finds a counterexample to `property`; it is printed.
    fn caught(b: Bounds, rules: Rules, property: &'static str) {
        let c = check(Narwhal::new(b, rules), 1, vec![property]);
        let path = c.discovery(property);
        assert!(
            path.is_some(),
            "{rules:?}: no counterexample to {property:?} in {} states",
            c.unique_state_count()
        );
        let actions = path.expect("checked").into_actions();
        eprintln!("{rules:?} breaks {property:?}: {actions:?}");
    }

    /// The agent's epoch check removed: a capture the old primary sent before its pause
    /// reaches an agent after the standby took over, and is accepted.
    #[test]
    fn the_check_catches_an_agent_without_its_epoch_fence() {
        let b = Bounds {
            delay: 6,
            ..FAILOVER
        };
        caught(
            b,
            Rules::NoAgentFence,
            "an agent never accepts an older epoch",
        );
    }

    /// Answered before published: the primary dies after answering a drain it never
    /// published, and the standby takes over without it.
    #[test]
    fn the_check_catches_an_acknowledgement_before_the_publish() {
        caught(
            FAILOVER,
            Rules::AckBeforePublish,
            "an acknowledged action is never lost",
        );
    }

    /// Readmission without the newer-process rule: a drained engine that never restarted is
    /// readmitted.
    #[test]
    fn the_check_catches_a_readmission_without_a_restart() {
        caught(
            LIFECYCLE,
            Rules::NoRestartCheck,
            "readmission only after the checks on a newer process",
        );
    }
}
