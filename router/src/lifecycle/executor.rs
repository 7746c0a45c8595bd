//! The lifecycle executor: owns the pure [`Lifecycle`] machine and applies what it decided
//! (architecture.md 9.2–9.4).
//!
//! ```text
//!  driver / identity check ──lock(), a machine call, commit()──► Executor
//!     commit: held engines ──► Fleet::set_held (out of placement, `draining`)
//!             readiness hold ──► Gate::set_lifecycle_hold (`whole-wave drain <id>`, ...)
//!             new events ──► journal + log, and `dirty` (the state-file writer persists),
//!                            only while this router controls the fleet (ha-and-fencing.md)
//! ```
//!
//! Lock order is the module order: the machine's lock is held while the fleet is asked or
//! told something; the fleet never calls back up, so it can never wait for this lock.

use std::sync::{Arc, Mutex, MutexGuard};

use narwhal_shared::Clock;
use tokio::sync::Notify;

use super::machine::{Lifecycle, Now};
use crate::fleet::Fleet;
use crate::ha_phase::Ha;
use crate::journal::Journal;
use crate::readiness::Gate;

/// The executor (see the module doc).
pub(crate) struct Executor {
    machine: Mutex<Lifecycle>,
    fleet: Arc<Fleet>,
    gate: Arc<Gate>,
    journal: Journal,
    dirty: Arc<Notify>,
    clock: Arc<dyn Clock>,
    ha: Arc<Ha>,
}

impl Executor {
    /// An executor of `machine` over the fleet and the readiness gate; `ha` says whether this
    /// router controls the fleet (only then are events journaled).
    pub(crate) fn new(
        machine: Lifecycle,
        fleet: Arc<Fleet>,
        gate: Arc<Gate>,
        journal: Journal,
        dirty: Arc<Notify>,
        clock: Arc<dyn Clock>,
        ha: Arc<Ha>,
    ) -> Executor {
        Executor {
            machine: Mutex::new(machine),
            fleet,
            gate,
            journal,
            dirty,
            clock,
            ha,
        }
    }

    /// The machine, locked. Call [`Executor::commit`] before releasing it after a change.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Lifecycle> {
        self.machine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Both clocks, read once for one operation.
    pub(crate) fn now(&self) -> Now {
        Now {
            mono: self.clock.now(),
            wall: self.clock.wall().unwrap_or(0.0),
        }
    }

    /// The fleet the holds apply to.
    pub(crate) fn fleet(&self) -> &Arc<Fleet> {
        &self.fleet
    }

    /// The request journal.
    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Applies the machine's holds to placement and readiness, journals its new events, and
    /// asks for the handoff to be published. Called with the machine locked. A router that
    /// does not control the fleet writes no lifecycle events (ha-and-fencing.md: a fenced router
    /// wrote drain-complete events 6 ms after it logged its fence); its holds still apply to its
    /// own placement (a takeover restores them before it controls).
    pub(crate) fn commit(&self, lc: &mut Lifecycle) {
        self.fleet.set_held(&lc.held());
        self.gate.set_lifecycle_hold(lc.blocked_reason());
        let events = lc.take_events();
        if events.is_empty() {
            return;
        }
        if !self.ha.controls_fleet() {
            tracing::info!(
                dropped = events.len(),
                "lifecycle events not written: this router does not control the fleet"
            );
            return;
        }
        self.dirty.notify_one();
        for ev in events {
            tracing::info!(
                action = ev.action(),
                engine.id = ev.iid().unwrap_or(""),
                wave = ev.wave_id(),
                "lifecycle event"
            );
            self.journal.emit(ev.clone());
        }
    }

    /// Re-evaluates drain progress now (architecture.md 9.4): on a resident change of a held
    /// engine and at a drain deadline.
    pub(crate) fn refresh(&self) {
        if !self.ha.controls_fleet() {
            return; // drain progress is the controlling router's to decide
        }
        let mut lc = self.lock();
        let counts = self.fleet.resident_counts();
        lc.refresh(self.now(), |iid| counts.get(iid).copied().unwrap_or(0));
        self.commit(&mut lc);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use narwhal_shared::{Clock as _, ManualClock, SystemClock};

    use crate::config::Config;
    use crate::ha_phase::HaPhase;
    use crate::journal::Journal;
    use crate::lifecycle::agents::Agents;
    use crate::lifecycle::machine::DrainRequest;
    use crate::parts::Parts;
    use narwhal_lease::{LeaseDriver, LeaseLoss};

    /// ha-and-fencing.md: a router that does not control the fleet writes no lifecycle events
    /// (the fault campaign saw a fenced router write drain-complete events 6 ms after its fence),
    /// while its holds still apply to its own placement.
    #[tokio::test]
    async fn a_router_that_does_not_control_the_fleet_writes_no_lifecycle_events() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fleet = serde_json::json!({
            "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
            "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                        {"iid": "p1", "url": "http://127.0.0.1:3", "role": "prefill"},
                        {"iid": "d0", "url": "http://127.0.0.1:2"}],
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1}
        });
        let cfg = Config::from_json_str(&fleet.to_string(), &|_| None).expect("fleet");
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1.0e9));
        let path = dir.path().join("journal.jsonl");
        let (journal, writer) =
            Journal::open(&path, "1-ab", ("open", 0.0), Arc::new(SystemClock)).expect("journal");
        let lease = LeaseDriver::from_config(&cfg.lease, "t", clock.clone()).expect("lease");
        let parts = Parts::new(
            Arc::new(cfg),
            clock,
            journal,
            4,
            Agents::none(2),
            Arc::new(lease),
            HaPhase::Active,
        );
        // In control: p0's drain starts and its process is recorded (journaled).
        let exec = parts.lifecycle.executor();
        {
            let mut lc = exec.lock();
            let req = DrainRequest {
                engines: vec!["p0".into()],
                wave: false,
                deadline_s: 30.0,
                deadline_given: true,
            };
            let now = exec.now();
            // Every engine schedulable (the health gate has not run in this test).
            let live = ["p0", "p1", "d0"].map(String::from).into_iter().collect();
            lc.begin(now, &req, &live, "wave-x").expect("drain");
            assert!(lc.bind_identity(now, "p0", Ok(1.0e9 - 5.0), false));
            exec.commit(&mut lc);
        }
        // Fenced: the drain completes in its memory, but nothing is written; the timer's
        // refresh does not even run.
        parts.ha.fence(&LeaseLoss::HeldByAnother);
        exec.refresh();
        assert_eq!(
            exec.lock().state("p0"),
            crate::lifecycle::DrainState::Draining,
            "drain progress is the controlling router's to decide"
        );
        {
            let mut lc = exec.lock();
            lc.refresh(exec.now(), |_| 0);
            assert_eq!(lc.state("p0"), crate::lifecycle::DrainState::Drained);
            exec.commit(&mut lc);
        }
        let p0 = parts.fleet.index("p0").expect("p0");
        assert!(
            parts.fleet.read(|f| f.slots()[p0]
                .excluded
                .contains(&crate::placement::Exclusion::Draining)),
            "the hold applies to this router's own placement"
        );
        drop(parts);
        writer.await.expect("journal writer");
        let text = std::fs::read_to_string(&path).expect("journal");
        assert!(text.contains("\"drain_started\""), "{text}");
        assert!(text.contains("\"process_recorded\""), "{text}");
        assert!(
            !text.contains("\"drain_complete\""),
            "a fenced router wrote a lifecycle event:\n{text}"
        );
    }
}
