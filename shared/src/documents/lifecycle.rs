//! `GET /narwhal/lifecycle`: the lifecycle document, schema `narwhal.lifecycle` version 1
//! (behaviour.md 4.11; handoff-and-lifecycle.md 2.1), and its view in `/narwhal/state`
//! (behaviour.md 1.7). The lifecycle actions answer with it too ([`super::replies`]).
//!
//! ```text
//!  {schema, schema_version,
//!   router {controls_fleet, ready, controller},
//!   wave {id, active, readiness_withdrawn, ready_to_stop},
//!   engines {<iid>: {state, draining, accepts_new, ready_to_stop, resident {prefill, decode},
//!                    deadline_at, restart_required, wave_id, old_process_start,
//!                    new_process_start, checks, error}},
//!   events [...], engine_restart_policy, process_starts {<iid>: s}, error}
//! ```
//!
//! Fields serialise in the order above (the order the router has always written). On parse every
//! field defaults when absent and unknown fields are ignored, so a reader works against a router
//! one version apart.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::handoff::DrainState;

/// `schema` of the lifecycle document.
pub const LIFECYCLE_SCHEMA: &str = "narwhal.lifecycle";
/// The `schema_version` this release writes.
pub const LIFECYCLE_VERSION: u32 = 1;

/// The lifecycle document (behaviour.md 4.11).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Lifecycle {
    /// Always [`LIFECYCLE_SCHEMA`].
    pub schema: String,
    /// [`LIFECYCLE_VERSION`].
    pub schema_version: u32,
    /// This router's control and readiness.
    pub router: RouterView,
    /// The whole-fleet wave, if one is active.
    pub wave: Wave,
    /// Every configured engine, sorted by id (engines without a record are `active`).
    pub engines: BTreeMap<String, Engine>,
    /// The last 200 `engine_lifecycle` events, oldest first, as journaled (behaviour.md 4.12:
    /// `{event, action, at, <the action's fields>}`; kept as JSON).
    pub events: Vec<Value>,
    /// `recovery.engine_restart_policy`: `individual` or `whole_wave`.
    pub engine_restart_policy: String,
    /// Last accepted process start per engine, Unix seconds.
    pub process_starts: BTreeMap<String, f64>,
    /// The rejected action's message, `""` on success (and for `GET`).
    pub error: String,
}

impl Lifecycle {
    /// Whether this is a lifecycle document (its `schema` is [`LIFECYCLE_SCHEMA`]): a reader
    /// that parsed some other JSON body gets an object of defaults, with an empty `schema`.
    pub fn is_lifecycle(&self) -> bool {
        self.schema == LIFECYCLE_SCHEMA
    }

    /// Engine `iid`'s entry.
    pub fn engine(&self, iid: &str) -> Option<&Engine> {
        self.engines.get(iid)
    }

    /// The view `/narwhal/state` embeds: this document without `schema`, `schema_version` and
    /// `error` (behaviour.md 1.7), in [`LifecycleView`]'s order.
    pub fn into_view(self) -> LifecycleView {
        LifecycleView {
            engine_restart_policy: self.engine_restart_policy,
            process_starts: self.process_starts,
            router: self.router,
            wave: self.wave,
            engines: self.engines,
            events: self.events,
        }
    }
}

/// `router`: who controls the fleet, as this router sees it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RouterView {
    /// `active` (this router controls the fleet), `standby` (it shadows a healthy controller)
    /// or `fenced` (it lost control; architecture.md 9.1).
    pub controls_fleet: String,
    /// This router's `/ready` (behaviour.md 1.3).
    pub ready: bool,
    /// The router that controls the fleet, as this one saw it in the lease record; `null` when
    /// unknown or when this router is in control (ha-and-fencing.md).
    pub controller: Option<ControllerRef>,
}

/// A router named by its lease record: `{holder, epoch}`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ControllerRef {
    /// Its lease holder token (`<router-id>:<32 hex>`).
    pub holder: String,
    /// The lease epoch it holds.
    pub epoch: u64,
}

/// `wave` (behaviour.md 4.6).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Wave {
    /// `wave-<12 hex>`, `""` when no wave is active.
    pub id: String,
    /// Whether a wave is active.
    pub active: bool,
    /// A lifecycle hold withdraws `/ready` (ours).
    pub readiness_withdrawn: bool,
    /// Every member is drained with its identity recorded; false without a wave, and on a
    /// router that does not control the fleet.
    pub ready_to_stop: bool,
}

/// `engines.<iid>` (behaviour.md 4.11).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Engine {
    /// The record's state (behaviour.md 4.2); `active` without a record.
    pub state: DrainState,
    /// The record is not `active` (the engine is out of placement).
    pub draining: bool,
    /// The engine is live and its record `active` (false for ejected, awaiting-health or
    /// switching engines too).
    pub accepts_new: bool,
    /// A supervisor may stop the process (drained, identity recorded); false on a router that
    /// does not control the fleet.
    pub ready_to_stop: bool,
    /// Requests resident on it.
    pub resident: Resident,
    /// Drain deadline, wall-clock Unix seconds; `null` without a record.
    pub deadline_at: Option<f64>,
    /// Readmission needs a process started after `old_process_start`.
    pub restart_required: bool,
    /// Its wave, `""` when none.
    pub wave_id: String,
    /// Process start (Unix seconds) recorded at the drain: the process that may be stopped.
    pub old_process_start: Option<f64>,
    /// Process start accepted at readmission.
    pub new_process_start: Option<f64>,
    /// Checks passed in the last validation, in the order they ran.
    pub checks: Vec<String>,
    /// Last error (a failed check, a failed identity capture), `""` when none.
    pub error: String,
}

/// Resident request counts `{prefill, decode}` (requests, not tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Resident {
    /// Prefill legs resident.
    pub prefill: u64,
    /// Decode legs resident.
    pub decode: u64,
}

/// `/narwhal/state.lifecycle`: the lifecycle document minus `schema`, `schema_version` and
/// `error` (behaviour.md 1.7). Its fields come in the order the router has always written
/// them (the removal moved the last fields forward): `engine_restart_policy`,
/// `process_starts`, `router`, `wave`, `engines`, `events`. `router.controller` is present, as
/// in the document.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LifecycleView {
    /// As [`Lifecycle::engine_restart_policy`].
    pub engine_restart_policy: String,
    /// As [`Lifecycle::process_starts`] (Unix seconds).
    pub process_starts: BTreeMap<String, f64>,
    /// As [`Lifecycle::router`].
    pub router: RouterView,
    /// As [`Lifecycle::wave`].
    pub wave: Wave,
    /// As [`Lifecycle::engines`].
    pub engines: BTreeMap<String, Engine>,
    /// As [`Lifecycle::events`].
    pub events: Vec<Value>,
}

/// `GET /narwhal/self-drain` (docs/kubernetes.md, "Self-drain"): the engines of the pod whose
/// token called, as `GET /narwhal/lifecycle` shows them, and whether all may stop. An engine
/// pod's preStop hook polls it until `ready_to_stop`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct SelfDrainStatus {
    /// The calling pod, `<namespace>/<name>`.
    pub pod: String,
    /// Its engines (those whose URL is the pod's IP and one of its container ports), by id.
    pub engines: BTreeMap<String, Engine>,
    /// Every one of them is `ready_to_stop`.
    pub ready_to_stop: bool,
}
