//! A controller decision (controller.md 11.1 and 13): who decided (`by`), what came of it
//! (`result`), why (`reason`), the split it describes, and its details in insertion order.
//!
//! ```text
//!  policy / flip guards ──Decision──► journal `controller_decision` (present keys only)
//!                                 └─► /narwhal/state control.last_decision (all 74 keys)
//! ```
//!
//! Pure. Token fields are rounded to 3 places, the rest to 6; a non-finite number is `null`.

use crate::journal::Event;
use narwhal_shared::documents::controller as doc;
use serde_json::{Map, Value};

/// Who made a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum By {
    /// The reactive policy.
    Reactive,
    /// Decode-floor restoration.
    DecodeFloor,
    /// Prefill-floor recovery.
    FloorRecovery,
    /// The role check that undid a flip (ours: controller.md has no such caller).
    RoleCheck,
}

impl By {
    /// `reactive`, `decode_floor`, `floor_recovery` or `role_check`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            By::Reactive => "reactive",
            By::DecodeFloor => "decode_floor",
            By::FloorRecovery => "floor_recovery",
            By::RoleCheck => "role_check",
        }
    }
}

/// What came of a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Outcome {
    /// Nothing to do, or not yet.
    Held,
    /// A flip guard refused the move.
    Blocked,
    /// Advisory mode: the move would have been applied.
    Advisory,
    /// The role changed.
    Applied,
}

impl Outcome {
    /// `held`, `blocked`, `advisory` or `applied`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Held => "held",
            Outcome::Blocked => "blocked",
            Outcome::Advisory => "advisory",
            Outcome::Applied => "applied",
        }
    }
}

/// Every detail key of a decision, in the order `/narwhal/state` pads them
/// (controller.md 13: 74 keys with the 7 head keys).
pub(crate) const DETAIL_KEYS: [&str; 67] = [
    "current_prefill",
    "current_decode",
    "prefill_work",
    "decode_work",
    "projected_ttft_ratio",
    "projected_tpot_ratio",
    "projected_decode_wait_ratio",
    "objective",
    "objective_delta",
    "decode_tokens_per_engine",
    "decode_slo_capacity_tokens",
    "decode_kv_capacity_tokens",
    "decode_request_limit",
    "decode_requests_per_engine",
    "pending_decode_requests",
    "pending_decode_tokens",
    "decode_profile_covered",
    "decode_correction",
    "arrivals",
    "output_observations",
    "demand_complete",
    "arrivals_beyond_profile",
    "unsized_offers",
    "decision_basis",
    "observed_prefill_ratio",
    "recovery_prefill_ratio",
    "observed_decode_ratio",
    "recovery_decode_ratio",
    "eligibility_rule",
    "demand_horizon_s",
    "steady_horizon_s",
    "steady_prefill_work",
    "steady_decode_work",
    "steady_demand_s",
    "departure_age_s",
    "departure_reverses",
    "confirmations",
    "required_confirmations",
    "trigger_rid",
    "projected_ttft_s",
    "ttft_slo_s",
    "trigger_projected_ttft_ratio",
    "resident_prefill_s",
    "queued_prefill_s",
    "waiting_prefill",
    "initial_projected_ttft_s",
    "urgent_signals",
    "event_to_evaluation_s",
    "candidate_projected_ttft_s",
    "candidate_projected_ttft_ratio",
    "projected_ttft_improvement_s",
    "decode_capacity_safe",
    "role_floors_safe",
    "source_pressure_safe",
    "evidence_span_s",
    "evidence_arrivals",
    "evidence_required_span_s",
    "evidence_required_arrivals",
    "evidence_max_span_s",
    "evidence_closed",
    "risk_kind",
    "risk_age_s",
    "evidence_short_decode_engines",
    "evidence_long_decode_engines",
    "evidence_trend_ratio",
    "evidence_envelope_decode_engines",
    "evidence_blocked_gate",
];

/// `x` rounded to `places`, `null` when not finite.
pub(crate) fn round(x: f64, places: i32) -> Value {
    rounded(x, places).map_or(Value::Null, Value::from)
}

/// `x` rounded to `places` (never `-0.0`), `None` when not finite: the documents' rounded
/// numbers ([`round`] as JSON).
pub(crate) fn rounded(x: f64, places: i32) -> Option<f64> {
    let f = 10f64.powi(places);
    let r = (x * f).round() / f + 0.0;
    r.is_finite().then_some(r)
}

/// Decision details in insertion order.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Details(Vec<(&'static str, Value)>);

impl Details {
    /// Sets `key` (replacing an earlier value in place).
    pub(crate) fn set(&mut self, key: &'static str, v: impl Into<Value>) -> &mut Self {
        let v = v.into();
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = v,
            None => self.0.push((key, v)),
        }
        self
    }

    /// Sets a number rounded to 6 places (`null` when not finite).
    pub(crate) fn num(&mut self, key: &'static str, x: f64) -> &mut Self {
        self.set(key, round(x, 6))
    }

    /// Sets a token quantity rounded to 3 places (`null` when not finite).
    pub(crate) fn tokens(&mut self, key: &'static str, x: f64) -> &mut Self {
        self.set(key, round(x, 3))
    }

    /// Sets an optional number rounded to 6 places.
    pub(crate) fn opt(&mut self, key: &'static str, x: Option<f64>) -> &mut Self {
        self.set(key, x.map_or(Value::Null, |x| round(x, 6)))
    }

    /// The value of `key`.
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.0.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// Appends every pair of `other`.
    pub(crate) fn extend(&mut self, other: &Details) {
        for (k, v) in &other.0 {
            self.set(k, v.clone());
        }
    }
}

/// One decision (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Decision {
    /// Wall-clock Unix seconds.
    pub(crate) at: f64,
    /// Prefill engines of the split it describes.
    pub(crate) prefill: usize,
    /// Decode engines of the split it describes.
    pub(crate) decode: usize,
    /// Who decided.
    pub(crate) by: By,
    /// Why.
    pub(crate) reason: String,
    /// What came of it.
    pub(crate) result: Outcome,
    /// The details (controller.md 11.1).
    pub(crate) details: Details,
}

/// The keys a decision always carries, before its details (a detail of the same name would
/// be one key twice: none is one).
const HEAD_KEYS: [&str; 8] = [
    "event", "at", "prefill", "decode", "by", "reason", "result", "applied",
];

impl Decision {
    /// The decision as the documents carry it: the head keys, then `details`.
    fn document(&self, details: Map<String, Value>) -> doc::Decision {
        doc::Decision {
            at: self.at,
            prefill: self.prefill as u64,
            decode: self.decode as u64,
            by: self.by.as_str().to_string(),
            reason: self.reason.clone(),
            result: self.result.as_str().to_string(),
            applied: self.result == Outcome::Applied,
            details,
        }
    }

    /// The details present, in insertion order.
    fn present(&self) -> impl Iterator<Item = (String, Value)> + '_ {
        self.details
            .0
            .iter()
            .filter(|(k, _)| !HEAD_KEYS.contains(k))
            .map(|(k, v)| ((*k).to_string(), v.clone()))
    }

    /// The journal event `controller_decision` ([`doc::DecisionEvent`]): the head keys, then
    /// the present details.
    pub(crate) fn event(&self) -> Event {
        Event::ControllerDecision(Box::new(self.document(self.present().collect())))
    }

    /// `/narwhal/state control.last_decision`: every one of the 74 keys, `null` where the
    /// decision has no value (controller.md 13).
    pub(crate) fn padded(&self) -> doc::Decision {
        let mut details: Map<String, Value> = DETAIL_KEYS
            .iter()
            .map(|k| {
                let v = self.details.get(k).cloned().unwrap_or(Value::Null);
                ((*k).to_string(), v)
            })
            .collect();
        // Details outside the documented set (ours) follow.
        for (k, v) in self.present() {
            if !details.contains_key(&k) {
                details.insert(k, v);
            }
        }
        self.document(details)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn journal_rows_carry_present_keys_and_state_pads_all_74() {
        let mut d = Details::default();
        d.num("prefill_work", 1.0200000001)
            .tokens("decode_tokens_per_engine", 12.34567)
            .num("objective", f64::INFINITY)
            .set("eligibility_rule", "source_shrink");
        let dec = Decision {
            at: 1000.0,
            prefill: 2,
            decode: 2,
            by: By::Reactive,
            reason: "demand evidence is still collecting".into(),
            result: Outcome::Held,
            details: d,
        };
        let ev = dec.event().to_value();
        assert_eq!(ev["event"], "controller_decision");
        assert_eq!(ev["prefill_work"], json!(1.02));
        assert_eq!(ev["decode_tokens_per_engine"], json!(12.346));
        assert_eq!(ev["objective"], Value::Null);
        assert!(
            ev.get("trigger_rid").is_none(),
            "absent keys are not written"
        );
        let keys: Vec<&String> = ev.as_object().expect("object").keys().collect();
        assert_eq!(
            keys[..8],
            [
                "event", "at", "prefill", "decode", "by", "reason", "result", "applied"
            ]
        );
        let padded = serde_json::to_value(dec.padded()).expect("serialises");
        assert_eq!(padded.as_object().expect("object").len(), 74);
        assert_eq!(padded["trigger_rid"], Value::Null);
        assert_eq!(padded["applied"], false);
    }
}
