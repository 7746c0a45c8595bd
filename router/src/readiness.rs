//! The readiness gate: what `/ready`, `/health`, `router.controls_fleet` and the request path
//! derive from the HA phase, the lifecycle's readiness hold and the live engine count
//! (behaviour.md 1.2–1.4; architecture.md 9.1).
//!
//! ```text
//!  Ha (phase, lease validity) ─┐
//!  lifecycle executor ──set_lifecycle_hold("whole-wave drain <id>")──► Gate ──► readiness()
//!  Fleet (live count, atomic) ─┘                                          └──► view() (documents)
//! ```
//!
//! The lifecycle hold is mirrored here (an atomic flag and the reason) so the request path
//! never takes the lifecycle's lock.
//!
//! The gate also carries the process's graceful shutdown (docs/http-api.md): after SIGTERM
//! `/ready` answers 503 `shutting down` and new completions 503 with `Retry-After`, while the
//! listeners stay open and admitted requests run on; when `serving.graceful_timeout_s` runs
//! out, [`Gate::end_requests`] tells every request still running to end (the error frame, a
//! failed settlement). Shutdown is not an HA phase: the router keeps its lease and control
//! of the fleet until the last request ended, and the lease loop keeps publishing its phase.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::fleet::Fleet;
use crate::ha_phase::{self, Ha, HaView, Readiness};

/// The gate (see the module doc).
pub(crate) struct Gate {
    ha: Arc<Ha>,
    fleet: Arc<Fleet>,
    hold: Mutex<String>,
    held: AtomicBool,
    /// Why the router's KV index is still being rebuilt from the engines' replay buffers at
    /// startup (`""`: it is not), mirrored by `warming`.
    kv_hold: Mutex<String>,
    warming: AtomicBool,
    stopping: AtomicBool,
    end: CancellationToken,
}

/// The `/ready` reason after SIGTERM.
pub(crate) const SHUTTING_DOWN: &str = "shutting down";

/// One consistent reading for a document.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GateView {
    /// The HA state and control.
    pub(crate) ha: HaView,
    /// The lifecycle's readiness hold, if any.
    pub(crate) hold: Option<String>,
    /// Live engines.
    pub(crate) live: usize,
    /// Readiness derived from the above.
    pub(crate) readiness: Readiness,
    /// The router is shutting down (SIGTERM received).
    pub(crate) stopping: bool,
}

impl GateView {
    /// `/health` `status` (behaviour.md 1.4), `stopping` during a graceful shutdown.
    pub(crate) fn health(&self) -> &'static str {
        if self.stopping {
            return "stopping";
        }
        ha_phase::health(
            &self.ha.status.phase,
            self.ha.controls,
            self.hold.as_deref(),
            self.readiness.ready,
        )
    }

    /// `router.controls_fleet` (architecture.md 9.1).
    pub(crate) fn controls_label(&self) -> &'static str {
        ha_phase::controls_label(&self.ha.status.phase, self.ha.controls)
    }
}

impl Gate {
    /// A gate over the HA handle and the fleet, without a lifecycle hold.
    pub(crate) fn new(ha: Arc<Ha>, fleet: Arc<Fleet>) -> Gate {
        Gate {
            ha,
            fleet,
            hold: Mutex::new(String::new()),
            held: AtomicBool::new(false),
            kv_hold: Mutex::new(String::new()),
            warming: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            end: CancellationToken::new(),
        }
    }

    /// SIGTERM: from now on `/ready` is 503 [`SHUTTING_DOWN`] and new completions are
    /// refused 503 with `Retry-After`; admitted requests run on.
    pub(crate) fn begin_shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Whether a graceful shutdown began.
    pub(crate) fn shutting_down(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// `serving.graceful_timeout_s` ran out: every request still running ends now.
    pub(crate) fn end_requests(&self) {
        self.end.cancel();
    }

    /// Resolves when [`Gate::end_requests`] was called (at once if it was already).
    pub(crate) async fn requests_ended(&self) {
        self.end.cancelled().await;
    }

    /// Mirrors the lifecycle's readiness hold (`whole-wave drain <id>`, ...; `""` for none).
    pub(crate) fn set_lifecycle_hold(&self, reason: &str) {
        let mut hold = self.hold.lock().unwrap_or_else(|p| p.into_inner());
        if *hold != reason {
            *hold = reason.to_string();
        }
        self.held.store(!reason.is_empty(), Ordering::Release);
    }

    /// The lifecycle's readiness hold, if any.
    pub(crate) fn lifecycle_hold(&self) -> Option<String> {
        if !self.held.load(Ordering::Acquire) {
            return None;
        }
        let hold = self.hold.lock().unwrap_or_else(|p| p.into_inner());
        (!hold.is_empty()).then(|| hold.clone())
    }

    /// Readiness now (the request path: no allocation when ready).
    pub(crate) fn readiness(&self) -> Readiness {
        let hold = self.lifecycle_hold();
        let live = self.fleet.live_count();
        let r = self.ha.with_phase(|phase, controls| {
            ha_phase::readiness(phase, controls, hold.as_deref(), live)
        });
        self.unless_stopping(r)
    }

    /// While the KV index is rebuilt from the engines' replay buffers at startup
    /// (docs/design/kv-aware-placement.md, "Exact from the first request"), `/ready` is 503
    /// with `reason` and completions are refused as not ready; `""` ends it.
    pub(crate) fn set_kv_hold(&self, reason: &str) {
        let mut hold = self.kv_hold.lock().unwrap_or_else(|p| p.into_inner());
        if *hold != reason {
            *hold = reason.to_string();
        }
        self.warming.store(!reason.is_empty(), Ordering::Release);
    }

    /// A shutdown withdraws readiness before any other reason; the KV index's replay holds a
    /// router that is otherwise ready.
    fn unless_stopping(&self, r: Readiness) -> Readiness {
        if self.shutting_down() {
            Readiness {
                ready: false,
                control_ready: r.control_ready,
                reason: SHUTTING_DOWN.to_string(),
            }
        } else if r.ready && self.warming.load(Ordering::Acquire) {
            let reason = self
                .kv_hold
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            Readiness {
                ready: reason.is_empty(),
                control_ready: r.control_ready,
                reason,
            }
        } else {
            r
        }
    }

    /// Everything a document shows, read once.
    pub(crate) fn view(&self) -> GateView {
        let ha = self.ha.view();
        let hold = self.lifecycle_hold();
        let live = self.fleet.live_count();
        let readiness = self.unless_stopping(ha_phase::readiness(
            &ha.status.phase,
            ha.controls,
            hold.as_deref(),
            live,
        ));
        GateView {
            ha,
            hold,
            live,
            readiness,
            stopping: self.shutting_down(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After SIGTERM `/ready` is 503 `shutting down` ahead of any other reason, `/health`
    /// says `stopping`, and control is kept (admitted requests still place their retries).
    /// The parts of a one-engine router without a lease (ready once its engine is live).
    fn one_engine() -> Arc<crate::parts::Parts> {
        let clock = Arc::new(narwhal_shared::ManualClock::new(
            narwhal_shared::Clock::now(&narwhal_shared::SystemClock),
            1.0e9,
        ));
        crate::parts::for_test(
            serde_json::json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
                "engines": [{"iid": "d0", "url": "http://127.0.0.1:2"}],
                "slo": {"ttft_s": 1.0, "tpot_s": 0.1}
            }),
            clock,
            "test",
        )
    }

    /// The KV replay hold withdraws readiness from a router that is otherwise ready (and
    /// only then: another reason comes first), and its end restores it; a shutdown still wins.
    #[tokio::test]
    async fn the_kv_replay_hold_withdraws_readiness_until_it_ends() {
        let parts = one_engine();
        let gate = &parts.gate;
        gate.set_kv_hold("KV index replay pending: d0");
        let r = gate.readiness();
        assert_eq!(
            (r.ready, r.control_ready, r.reason.as_str()),
            (false, true, "KV index replay pending: d0")
        );
        assert_eq!(gate.view().readiness, r);
        gate.set_lifecycle_hold("whole-wave drain w");
        assert_eq!(
            gate.readiness().reason,
            "whole-wave drain w",
            "another reason first"
        );
        gate.set_lifecycle_hold("");
        gate.set_kv_hold("");
        assert!(gate.readiness().ready);
        gate.set_kv_hold("KV index replay pending: d0");
        gate.begin_shutdown();
        assert_eq!(gate.readiness().reason, SHUTTING_DOWN);
    }

    #[tokio::test]
    async fn a_shutdown_withdraws_readiness_first_and_keeps_control() {
        let parts = one_engine();
        let gate = &parts.gate;
        assert!(gate.readiness().ready);
        gate.begin_shutdown();
        let r = gate.readiness();
        assert_eq!(
            (r.ready, r.control_ready, r.reason.as_str()),
            (false, true, SHUTTING_DOWN)
        );
        gate.set_lifecycle_hold("whole-wave drain w");
        let v = gate.view();
        assert_eq!(v.readiness.reason, SHUTTING_DOWN);
        assert_eq!(v.health(), "stopping");
        assert!(parts.ha.controls_fleet());
        let ended =
            tokio::time::timeout(std::time::Duration::from_millis(20), gate.requests_ended());
        assert!(ended.await.is_err(), "not ended before the budget");
        gate.end_requests();
        gate.requests_ended().await;
    }
}
