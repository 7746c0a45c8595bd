//! The role controller in the documents: its `/narwhal/state` fields (controller.md 13) and
//! its decisions, as `control.last_decision` and as the journal's `controller_decision` rows
//! (controller.md 11.1).
//!
//! ```text
//!  /narwhal/state  ... controller: "off" | "reactive"
//!                      [control {advisory, last_decision, decisions, flips, ...}, load,
//!                       thresholds, panic_bypasses, below_floor, decode_floor, demand_history,
//!                       demand_evidence, flips_refused, flips, resident_work, switching,
//!                       monitoring]                              (all present, or all absent)
//!  journal         {event: "controller_decision", at, prefill, decode, by, reason, result,
//!                   applied, <the details present>}
//! ```
//!
//! Numbers the controller rounds (loads to 4 places, seconds and engine counts to 6) are
//! `null` when not finite, hence the `Option<f64>`s.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::ordered::Ordered;

/// `controller` when every engine has a profile.
pub const REACTIVE: &str = "reactive";
/// `controller` without profiles: roles stay as configured, no other controller field.
pub const OFF: &str = "off";

/// The controller's part of `/narwhal/state` (controller.md 13), flattened into it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ControllerReport {
    /// [`REACTIVE`] or [`OFF`].
    pub controller: String,
    /// The live fields; `None` (absent) with the controller off.
    #[serde(flatten)]
    pub fields: Option<ControllerFields>,
}

/// Every controller field of `/narwhal/state` but `controller` (controller.md 13), in order.
/// `control` is required on parse: a document without it has no controller fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControllerFields {
    /// Decisions and flips.
    pub control: Control,
    /// Pool loads (1.0 = at SLO).
    #[serde(default)]
    pub load: PoolLoad,
    /// `controller.thresholds` as configured (no `flip_resident_guard`).
    #[serde(default)]
    pub thresholds: Thresholds,
    /// Cooldowns bypassed by the panic rule.
    #[serde(default)]
    pub panic_bypasses: u64,
    /// The prefill floor (controller.md 7.6).
    #[serde(default)]
    pub below_floor: BelowFloor,
    /// The decode floor (controller.md 7.4).
    #[serde(default)]
    pub decode_floor: DecodeFloor,
    /// The demand windows by name (`unsized`, `arrivals`, `expected_decode`,
    /// `observed_decode`, `residency`, `cache_credit`), in that order.
    #[serde(default)]
    pub demand_history: Ordered<DemandWindow>,
    /// The consolidation evidence gate now (controller.md 8).
    #[serde(default)]
    pub demand_evidence: DemandEvidence,
    /// The last 20 refused flips.
    #[serde(default)]
    pub flips_refused: Vec<FlipRefusal>,
    /// Every retained flip (up to `flip_history`), oldest first.
    #[serde(default)]
    pub flips: Vec<Flip>,
    /// The controller's view of each engine's resident work, config order (ours).
    #[serde(default)]
    pub resident_work: Ordered<ResidentWork>,
    /// Engines whose role change runs (SGLang engine-side switch, role check; ours).
    #[serde(default)]
    pub switching: Vec<String>,
    /// The controller pass's failure ledger.
    #[serde(default)]
    pub monitoring: Monitoring,
}

/// `control`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Control {
    /// `controller.advisory`: decisions are made and reported, never applied.
    pub advisory: bool,
    /// The newest decision, every one of its 74 keys (null where absent); `null` until the
    /// first decision.
    pub last_decision: Option<Decision>,
    /// Decisions so far by `"<by>:<result>"`.
    pub decisions: Ordered<u64>,
    /// Flips so far by `"<by>:<to>"`, sorted (the four seeded series first appear at 0).
    pub flips: BTreeMap<String, u64>,
    /// Flips that reversed an earlier one.
    pub flip_reversals: u64,
    /// Flips refused in total.
    pub flips_refused: u64,
    /// Flips in progress by target role.
    pub flip_inflight: FlipInflight,
}

/// `control.flip_inflight`: flips in progress to each role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FlipInflight {
    /// To prefill.
    pub prefill: u64,
    /// To decode.
    pub decode: u64,
}

/// One controller decision (controller.md 11.1): the head keys, then its details in order
/// (`/narwhal/state` pads every documented detail key with null; the journal row carries the
/// present ones).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Decision {
    /// When, wall-clock Unix seconds.
    pub at: f64,
    /// Prefill engines of the split it describes.
    pub prefill: u64,
    /// Decode engines of the split it describes.
    pub decode: u64,
    /// `reactive`, `decode_floor`, `floor_recovery` or `role_check` (ours).
    pub by: String,
    /// Why (a hold reason, or what the move does).
    pub reason: String,
    /// `held`, `blocked`, `advisory` or `applied`.
    pub result: String,
    /// `result == "applied"`.
    pub applied: bool,
    /// The detail keys of controller.md 11.1 (`prefill_work`, `decision_basis`, ...), then
    /// ours, in the order written: numbers, strings, booleans or null.
    #[serde(flatten)]
    pub details: Map<String, Value>,
}

/// The journal row of a decision: `{"event": "controller_decision", <the decision>}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionEvent {
    /// Always [`DECISION_EVENT`].
    pub event: String,
    /// The decision.
    #[serde(flatten)]
    pub decision: Decision,
}

/// `event` of a decision's journal row.
pub const DECISION_EVENT: &str = "controller_decision";

impl From<Decision> for DecisionEvent {
    fn from(decision: Decision) -> Self {
        DecisionEvent {
            event: DECISION_EVENT.to_string(),
            decision,
        }
    }
}

/// `load`: pool loads, 1.0 = at SLO, 4 places (null when not finite).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolLoad {
    /// The prefill pool.
    pub prefill: Option<f64>,
    /// The decode pool.
    pub decode: Option<f64>,
}

/// `thresholds` (`controller.thresholds`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Thresholds {
    /// Load above which a pool expands.
    pub expand: f64,
    /// Load below which a pool may give an engine.
    pub shrink: f64,
    /// Seconds between moves.
    pub cooldown_s: f64,
    /// Passes a condition must hold.
    pub sustained_intervals: u64,
    /// Seconds an engine stays in a role before it moves again.
    pub dwell_s: f64,
    /// Load ratio that bypasses the cooldown.
    pub panic_ratio: f64,
}

/// `below_floor`: the prefill floor (controller.md 7.6).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct BelowFloor {
    /// Below `min_prefill` now.
    pub active: bool,
    /// Live prefill engines.
    pub live_prefill: u64,
    /// When the current breach began, wall-clock Unix seconds; `null` when none.
    pub since: Option<f64>,
    /// Breaches so far.
    pub breaches: u64,
    /// Seconds below the floor, the current breach included (4 places).
    pub cumulative_s: Option<f64>,
}

/// `decode_floor` (controller.md 7.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DecodeFloor {
    /// `controller.min_decode`.
    pub min_decode: u64,
    /// Live decode engines.
    pub live_decode: u64,
    /// `live_decode < min_decode`.
    pub below_floor: bool,
    /// Moves that restored the floor.
    pub restoration_moves: u64,
}

/// One demand window of `demand_history` (controller.md 3.2).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DemandWindow {
    /// Bucket length, seconds.
    pub bucket_s: f64,
    /// Retention, seconds.
    pub retained_s: f64,
    /// The most cohorts it can hold: `(ceil(retained/bucket)+1)·(max_shapes+1)`.
    pub cell_limit: u64,
    /// Cohorts held.
    pub cells: u64,
    /// Observations held.
    pub observations: u64,
    /// Observations that landed in overflow cohorts.
    pub overflow_observations: u64,
}

/// `demand_evidence`: the consolidation evidence gate (controller.md 8).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DemandEvidence {
    /// Seconds of demand evidence held (6 places).
    pub span_s: Option<f64>,
    /// Arrivals in it.
    pub arrivals: u64,
    /// Seconds required.
    pub required_span_s: f64,
    /// Arrivals required.
    pub required_arrivals: u64,
    /// The longest span looked at, seconds.
    pub max_span_s: f64,
    /// The window is closed (a risk event re-armed it).
    pub closed: bool,
    /// The newest risk: `first_token_timeout` or `p_to_d_recovery`; `null` when none.
    pub risk_kind: Option<String>,
    /// Its age, seconds (6 places); `null` when none.
    pub risk_age_s: Option<f64>,
    /// Risk events seen per kind.
    pub risk_events: BTreeMap<String, u64>,
    /// Decode engines the short view needs (6 places).
    pub short_decode_engines: Option<f64>,
    /// Decode engines the long view needs (6 places).
    pub long_decode_engines: Option<f64>,
    /// Short over long demand (6 places); `null` when undefined.
    pub trend_ratio: Option<f64>,
    /// Decode engines the envelope needs (6 places).
    pub envelope_decode_engines: Option<f64>,
    /// The gate that blocks consolidation (`evidence`, ...; `none` when open).
    pub blocked_gate: String,
    /// The carried risk this router re-anchored (`--resume`, a takeover; ours); `null`
    /// otherwise.
    pub restored: Option<RestoredRisk>,
}

/// `demand_evidence.restored`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RestoredRisk {
    /// The risk kind.
    pub kind: String,
    /// Its age when carried, seconds (6 places).
    pub age_s: Option<f64>,
    /// Seconds since this router applied it (3 places).
    pub applied_s_ago: Option<f64>,
}

/// One of `flips_refused`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct FlipRefusal {
    /// When, wall-clock Unix seconds.
    pub at: f64,
    /// The role the flip was to: `prefill` or `decode`.
    pub to: String,
    /// The guard that refused it (controller.md 7.1).
    pub why: String,
}

/// One of `flips`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Flip {
    /// When, wall-clock Unix seconds.
    pub at: f64,
    /// The engine.
    pub iid: String,
    /// Its new role: `prefill` or `decode`.
    pub to: String,
    /// Who moved it (as [`Decision::by`]).
    pub by: String,
    /// Prefill legs resident on it at the flip.
    pub prefill_inflight: u64,
    /// Decode legs resident on it at the flip.
    pub decode_inflight: u64,
    /// Seconds until its old-role work drained; `null` until it has.
    pub drained_s: Option<f64>,
}

/// One engine of `resident_work` (6 places).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ResidentWork {
    /// Σ profile price of its resident prefills, seconds.
    pub prefill_s: Option<f64>,
    /// Σ resident decode tokens (prompt + delivered), tokens.
    pub decode_tokens: Option<f64>,
}

/// `monitoring`: the controller pass's failure ledger (controller.md 11.1
/// `monitoring_stage_failure`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Monitoring {
    /// `controller.monitor_failure_limit` passes failed in a row.
    pub degraded: bool,
    /// Why degraded; `null` when not.
    pub reason: Option<String>,
    /// Failed passes in a row.
    pub core_consecutive: u64,
    /// Failed passes in total.
    pub core_failures: u64,
    /// Per stage (only `controller`).
    pub stages: Stages,
}

/// `monitoring.stages`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Stages {
    /// The controller pass.
    pub controller: StageLedger,
}

/// One stage's ledger.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct StageLedger {
    /// Failures in total.
    pub failures: u64,
    /// Failures in a row.
    pub consecutive: u64,
    /// The last failure's class; `null` before the first.
    pub last_class: Option<String>,
    /// When it happened, wall-clock Unix seconds; `null` before the first.
    pub last_at: Option<f64>,
}
