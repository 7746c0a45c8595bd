//! Journal rows and `/narwhal/state` read as types, for tests that would otherwise read them by
//! key: request rows ([`RequestRow`], docs/http-api.md "Request journal"),
//! engine and controller event rows ([`EventRow`], docs/logging.md "Journal rows"), and the
//! controller's decisions with the detail keys tests read ([`DecisionRow`], controller.md 11.1).
//!
//! ```text
//!  let d: DecisionRow = parse_row(&r.applied("the move", DECIDE).await);
//!  let d = r.decision_that("the floor", DECIDE, |d| d.by == "decode_floor").await;
//!  let ev: Vec<EventRow> = r.events_at_least("below_floor", 1).await.iter().map(parse_row).collect();
//!  let s = r.state_until("a risk", |s| s.unserved > 0).await;
//! ```

use std::time::Duration;

use narwhal_shared::documents::{Decision, DecisionEvent};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::router::RouterHandle;

/// Parses a journal row (or any JSON value) as `T`.
///
/// # Panics
/// When it is not of that shape; the message shows the row.
pub fn parse_row<T: DeserializeOwned>(row: &Value) -> T {
    serde_json::from_value(row.clone())
        .unwrap_or_else(|e| panic!("not a {} row ({e}): {row}", std::any::type_name::<T>()))
}

/// A request row of the journal (docs/http-api.md, "Request journal"), the one type the tests
/// read it through: how it ended, where it went, what it was credited, its attempts and legs.
/// The row has more fields; a field a row does not carry keeps its default (`""`, `0`, empty,
/// `None`, which is also `null`).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct RequestRow {
    /// The router's request id.
    pub rid: String,
    /// The status the client got; `None` when none was sent (a cancelled request).
    pub status: Option<u16>,
    /// Whether the client streamed.
    pub stream: bool,
    /// `completed`, `failed`, `refused`, `rejected`, `expired`, `cancelled` or `invalid`.
    pub terminal: String,
    /// The outcome's reason.
    pub reason: Option<String>,
    /// The error type sent.
    pub error_type: Option<String>,
    /// `true` on a refused request (absent otherwise).
    pub refused: Option<bool>,
    /// What refused it (`queue`, `prompt`).
    pub refused_cause: Option<String>,
    /// Seconds from arrival to settlement.
    pub duration_s: Option<f64>,
    /// Attempts made.
    pub attempts: u64,
    /// The router's size of the prompt, tokens.
    pub input_len: Option<u64>,
    /// Whether the request was sized.
    pub input_sized: Option<bool>,
    /// Output tokens.
    pub output_len: Option<u64>,
    /// The engine's count of the prompt's tokens.
    pub engine_prompt_tokens: Option<u64>,
    /// The prefill engine of a split.
    pub prefill_iid: Option<String>,
    /// The decode (or aggregated) engine.
    pub decode_iid: Option<String>,
    /// Prompt tokens the KV score credited on the computing engine; `None`: not scored.
    pub cached_tokens: Option<u64>,
    /// The engine's own count of prompt tokens served from its prefix cache.
    pub engine_cached_tokens: Option<u64>,
    /// The computing engine's KV index mode at placement.
    pub kv_mode: Option<String>,
    /// The predictive admission price.
    pub admission_price: Option<AdmissionPrice>,
    /// Waits per queue.
    pub queue_waits: Option<QueueWaits>,
    /// The failed attempts.
    pub attempt_failures: Vec<AttemptFailureRow>,
    /// The legs dispatched.
    pub legs: Vec<LegRow>,
}

impl RequestRow {
    /// The decode (or aggregated) engine's id, `""` when none.
    pub fn engine(&self) -> &str {
        self.decode_iid.as_deref().unwrap_or("")
    }
}

/// `admission_price` of a request row.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct AdmissionPrice {
    /// The attempt priced.
    pub attempt: Option<u64>,
    /// Resident and queued prefill ahead of it, seconds.
    pub backlog_s: Option<f64>,
    /// Its own prefill, seconds.
    pub own_prefill_s: Option<f64>,
    /// The TTFT price, seconds.
    pub price_s: Option<f64>,
}

/// One of a request row's `attempt_failures`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct AttemptFailureRow {
    /// The attempt's number.
    pub attempt: u64,
    /// `prefill`, `decode` or `aggregated`.
    pub phase: String,
    /// The engine; `None` for an attempt that was never dispatched.
    pub iid: Option<String>,
    /// The failure class (`engine_aborted`, ...).
    pub reason: String,
    /// What failed, in words.
    pub error: Option<String>,
    /// `false` for an attempt refused before dispatch.
    pub transient: Option<bool>,
    /// Why it was not retried (`not_dispatched`).
    pub retry_reason: Option<String>,
    /// The prompt's index in a batch.
    pub prompt: Option<u64>,
}

/// One of a request row's `legs`.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct LegRow {
    /// The attempt's number.
    pub attempt: u64,
    /// `prefill`, `decode` or `whole`.
    pub leg: String,
    /// The engine.
    pub iid: Option<String>,
    /// The `x-request-id` the engine saw for this leg.
    pub request_id: Option<String>,
    /// The prompt's index in a batch.
    pub prompt: Option<u64>,
}

/// `queue_waits` of a request row.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct QueueWaits {
    /// The wait for an admission seat, seconds.
    pub admission: Option<f64>,
}

/// An engine or controller event row of the journal (docs/logging.md, "Journal rows"): the
/// fields of the events tests read; `None` where a row has no such field (or `null`).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct EventRow {
    /// The event's name.
    pub event: String,
    /// When, wall-clock Unix seconds.
    pub at: Option<f64>,
    /// The engine.
    pub iid: Option<String>,
    /// Why (`engine_ejected`, `engine_degraded`).
    pub cause: Option<String>,
    /// The role (`role_check_passed`, `role_check_failed`).
    pub role: Option<String>,
    /// The error (`role_switch_failed`, `role_check_failed`, `engine_probe`).
    pub error: Option<String>,
    /// Checks passed (`role_check_passed`).
    pub checks: Option<Vec<String>>,
    /// Live decode engines (`decode_floor_restored`).
    pub live_decode: Option<u64>,
    /// `controller.min_decode` (`decode_floor_restored`).
    pub min_decode: Option<u64>,
    /// Live prefill engines (`below_floor`, `below_floor_recovered`).
    pub live_prefill: Option<u64>,
    /// `controller.min_prefill` (`below_floor`, `below_floor_recovered`).
    pub min_prefill: Option<u64>,
    /// Ejected engines (`below_floor`).
    pub ejected: Option<Vec<String>>,
    /// Quarantined engines (`below_floor`).
    pub quarantined: Option<Vec<String>>,
    /// Seconds below the floor (`below_floor_recovered`).
    pub duration_s: Option<f64>,
}

/// A `controller_decision` journal row: the [`Decision`] (its head keys typed, its details as
/// JSON; it derefs to it) and the detail keys tests read, typed (`None`: absent or `null`).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(try_from = "Value")]
pub struct DecisionRow {
    /// The decision.
    pub decision: Decision,
    /// Its details, typed.
    pub detail: DecisionDetails,
}

/// The detail keys of a decision tests read (controller.md 11.1).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct DecisionDetails {
    /// The rule that made the engine eligible.
    pub eligibility_rule: Option<String>,
    /// Confirmations so far.
    pub confirmations: Option<u64>,
    /// Confirmations required.
    pub required_confirmations: Option<u64>,
    /// Seconds of demand evidence.
    pub evidence_span_s: Option<f64>,
    /// The gate that blocks consolidation.
    pub evidence_blocked_gate: Option<String>,
    /// Short over long decode demand.
    pub evidence_trend_ratio: Option<f64>,
    /// Engines of prefill work.
    pub prefill_work: Option<f64>,
    /// What the decision was based on.
    pub decision_basis: Option<String>,
    /// Resident prefill over the TTFT budget.
    pub recovery_prefill_ratio: Option<f64>,
    /// The projected TTFT, seconds.
    pub projected_ttft_s: Option<f64>,
    /// The candidate split's projected TTFT, seconds.
    pub candidate_projected_ttft_s: Option<f64>,
    /// The request that triggered an urgent move.
    pub trigger_rid: Option<String>,
    /// Whether every output length is known.
    pub demand_complete: Option<bool>,
}

impl TryFrom<Value> for DecisionRow {
    type Error = serde_json::Error;

    fn try_from(row: Value) -> Result<Self, Self::Error> {
        let detail = DecisionDetails::deserialize(&row)?;
        let event = DecisionEvent::deserialize(row)?;
        Ok(DecisionRow {
            decision: event.decision,
            detail,
        })
    }
}

impl std::ops::Deref for DecisionRow {
    type Target = Decision;

    fn deref(&self) -> &Decision {
        &self.decision
    }
}

impl DecisionRow {
    /// Whether it has `result` and a reason starting with `reason` (as [`crate::decided`]).
    pub fn is(&self, result: &str, reason: &str) -> bool {
        self.result == result && self.reason.starts_with(reason)
    }
}

impl RouterHandle {
    /// The controller's decisions (journal `controller_decision`), oldest first, typed.
    pub fn decision_rows(&self) -> Vec<DecisionRow> {
        self.decisions().iter().map(parse_row).collect()
    }

    /// [`RouterHandle::decision_where`] with a typed predicate and answer.
    ///
    /// # Panics
    /// When none comes; the message lists the last decisions.
    pub async fn decision_that(
        &self,
        what: &str,
        within: Duration,
        pred: impl Fn(&DecisionRow) -> bool,
    ) -> DecisionRow {
        let row = self
            .decision_where(what, within, |d| pred(&parse_row(d)))
            .await;
        parse_row(&row)
    }

    /// Journal events named `event`, oldest first, typed.
    pub fn event_rows(&self, event: &str) -> Vec<EventRow> {
        self.events(event).iter().map(parse_row).collect()
    }
}
