//! The readiness gate: what `/ready`, `/health`, `router.controls_fleet` and the request path
//! derive from the HA phase, the lifecycle's readiness hold and the live engine count
//! (reference-notes 1.2–1.4; DESIGN.md 9.1).
//!
//! ```text
//!  Ha (phase, lease validity) ─┐
//!  lifecycle executor ──set_lifecycle_hold("whole-wave drain <id>")──► Gate ──► readiness()
//!  Fleet (live count, atomic) ─┘                                          └──► view() (documents)
//! ```
//!
//! The lifecycle hold is mirrored here (an atomic flag and the reason) so the request path
//! never takes the lifecycle's lock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::fleet::Fleet;
use crate::phase::{self, Ha, HaView, Readiness};

/// The gate (see the module doc).
pub(crate) struct Gate {
    ha: Arc<Ha>,
    fleet: Arc<Fleet>,
    hold: Mutex<String>,
    held: AtomicBool,
}

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
}

impl GateView {
    /// `/health` `status` (reference-notes 1.4).
    pub(crate) fn health(&self) -> &'static str {
        phase::health(
            &self.ha.status.phase,
            self.ha.controls,
            self.hold.as_deref(),
            self.readiness.ready,
        )
    }

    /// `router.controls_fleet` (DESIGN.md 9.1).
    pub(crate) fn controls_label(&self) -> &'static str {
        phase::controls_label(&self.ha.status.phase, self.ha.controls)
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
        }
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
        self.ha
            .with_phase(|phase, controls| phase::readiness(phase, controls, hold.as_deref(), live))
    }

    /// Everything a document shows, read once.
    pub(crate) fn view(&self) -> GateView {
        let ha = self.ha.view();
        let hold = self.lifecycle_hold();
        let live = self.fleet.live_count();
        let readiness = phase::readiness(&ha.status.phase, ha.controls, hold.as_deref(), live);
        GateView {
            ha,
            hold,
            live,
            readiness,
        }
    }
}
