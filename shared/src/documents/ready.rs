//! `GET /ready` (behaviour.md 1.3) and `GET /health` (behaviour.md 1.4), on both listeners.
//!
//! ```text
//!  /ready   {status, control_ready, epoch, holder, reason}     200 ready, else 503
//!  /health  {status, instances, available_instances}           always 200
//! ```

use serde::{Deserialize, Serialize};

/// `/ready`'s `status` when ready.
pub const READY: &str = "ready";
/// `/ready`'s `status` when not.
pub const NOT_READY: &str = "not_ready";

/// The `/ready` body (behaviour.md 1.3; keys in this order).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Ready {
    /// [`READY`] or [`NOT_READY`].
    pub status: String,
    /// This router controls the fleet (also while a whole-wave drain withdraws readiness: a
    /// standby judges its primary by it).
    pub control_ready: bool,
    /// The lease epoch this router holds; 0 without a lease and on a standby that has not
    /// taken over.
    pub epoch: u64,
    /// Its lease holder token, `""` when `epoch` is 0.
    pub holder: String,
    /// Why not ready, the first that applies in behaviour.md 1.3's order; `""` when ready.
    pub reason: String,
}

impl Ready {
    /// Whether `status` says ready.
    pub fn is_ready(&self) -> bool {
        self.status == READY
    }
}

/// The `/health` body (behaviour.md 1.4).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Health {
    /// `stopping`, `ok`, `fenced`, `maintenance`, `standby` or `degraded`: the first that
    /// applies (behaviour.md 1.4).
    pub status: String,
    /// Configured engines.
    pub instances: u64,
    /// Live engines (in placement).
    pub available_instances: u64,
}
