//! Terminal outcomes and counters (behaviour.md 7.7a; architecture.md section 5).
//!
//! ```text
//!  request pipeline ──Pending::settle(Settlement)──► sink (counters + metrics + journal row)
//!                   └─drop without settle──────────► sink.abandoned()  → cancelled / expired
//! ```
//!
//! Every request settles exactly once: [`Pending`] holds the record in an `Option` and gives it
//! up on the first `settle` (or on drop, which is how a client disconnect is seen). [`Tally`] is
//! the pure counter set that one settlement updates.

use std::collections::BTreeMap;
use std::sync::Arc;

use narwhal_shared::documents::Ordered;
use narwhal_shared::documents::state::OutcomeReasons;
use serde::Serialize;
use serde_json::Value;

/// One failed attempt of a request, an element of the journal's `attempt_failures`:
/// `{attempt, phase, iid, reason, error, [transient, retry_reason,] prompt}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct AttemptFailure {
    /// The attempt, 1-based.
    pub(crate) attempt: u32,
    /// The leg that failed (`prefill`, `decode`, `aggregated`).
    pub(crate) phase: &'static str,
    /// The engine, `null` when the attempt was never dispatched.
    pub(crate) iid: Option<String>,
    /// The failure class (the breaker's or the admission's cause).
    pub(crate) reason: &'static str,
    /// What failed, in words.
    pub(crate) error: String,
    /// Written `false` for an attempt the admission refused before dispatch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) transient: Option<bool>,
    /// Why it was not retried (`not_dispatched`), written with `transient`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) retry_reason: Option<&'static str>,
    /// The prompt's index in a batch, `null` for a single prompt.
    pub(crate) prompt: Option<usize>,
}
#[cfg(test)]
use serde_json::json;

/// The seven terminal outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Terminal {
    /// Stream reached `[DONE]` / non-stream reassembled.
    Completed,
    /// Upstream or internal failure.
    Failed,
    /// Predictive admission refused (not produced in `open` mode).
    Refused,
    /// 429 in-flight limit, 503 not ready.
    Rejected,
    /// Deadline, queue timeout, handoff bound.
    Expired,
    /// Client went away.
    Cancelled,
    /// 400/404/413 before dispatch.
    Invalid,
}

impl Terminal {
    /// The journal `terminal` value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Terminal::Completed => "completed",
            Terminal::Failed => "failed",
            Terminal::Refused => "refused",
            Terminal::Rejected => "rejected",
            Terminal::Expired => "expired",
            Terminal::Cancelled => "cancelled",
            Terminal::Invalid => "invalid",
        }
    }
}

/// Known `failed` reasons, pre-seeded at 0 in state and metrics.
pub(crate) const FAILED_REASONS: &[&str] = &[
    "no_engine",
    "engine_unreachable",
    "engine_connection",
    "engine_timeout",
    "engine_overloaded",
    "engine_rejected",
    "engine_error",
    "engine_aborted",
    "local_pool",
    "invalid_response",
    "response_limit",
    "internal",
    "shutdown",
];
/// Known `rejected` reasons.
pub(crate) const REJECTED_REASONS: &[&str] = &["inflight_limit", "saturated", "not_ready"];
/// Known `expired` reasons.
pub(crate) const EXPIRED_REASONS: &[&str] = &["deadline", "queue_timeout", "handoff"];
/// Known `refused` causes.
pub(crate) const REFUSED_REASONS: &[&str] = &[
    "queue",
    "prompt",
    "aggregate_unpriced",
    "slot_wait",
    "kv_capacity",
    "tpot",
];

/// How one request ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Settlement {
    /// Terminal outcome.
    pub terminal: Terminal,
    /// Reason label (`""` for completed/cancelled/invalid).
    pub reason: String,
    /// HTTP status sent (200 once output started; `None` when cancelled).
    pub status: Option<u16>,
    /// Detailed error (journal only), `None` on success.
    pub error: Option<String>,
    /// Error `type` sent to the client, if any.
    pub error_type: Option<String>,
}

impl Settlement {
    /// A completed request.
    pub(crate) fn completed() -> Self {
        Settlement {
            terminal: Terminal::Completed,
            reason: String::new(),
            status: Some(200),
            error: None,
            error_type: None,
        }
    }

    /// A cancelled request (client disconnect).
    pub(crate) fn cancelled() -> Self {
        Settlement {
            terminal: Terminal::Cancelled,
            reason: String::new(),
            status: None,
            error: Some("client disconnected".into()),
            error_type: None,
        }
    }

    /// Any other outcome.
    pub(crate) fn new(
        terminal: Terminal,
        reason: &str,
        status: u16,
        error: impl Into<String>,
        error_type: &str,
    ) -> Self {
        Settlement {
            terminal,
            reason: reason.to_string(),
            status: Some(status),
            error: Some(error.into()),
            error_type: Some(error_type.to_string()),
        }
    }
}

/// One leg dispatched, as the journal's `legs` lists it (behaviour.md 7.8).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct LegRecord {
    /// The attempt it belongs to (1-based).
    pub attempt: u32,
    /// `prefill`, `decode` or `whole` (an aggregated non-streamed leg).
    pub leg: &'static str,
    /// The engine.
    pub iid: String,
    /// The `x-request-id` (a UUID4) the engine saw.
    pub request_id: String,
    /// The prompt's index in a batch (`null` otherwise).
    pub prompt: Option<usize>,
}

/// Per-request facts for the journal row (behaviour.md 7.8, the fields that apply).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct RequestRecord {
    /// Router request id (UUID4).
    pub rid: String,
    /// `/v1/completions` or `/v1/chat/completions`.
    pub endpoint: String,
    /// Arrival, wall seconds.
    pub arrived: f64,
    /// Client asked for SSE.
    pub stream: bool,
    /// Estimated input tokens (null before sizing): the router's estimate (token-id prompts
    /// counted, text by `engine.chars_per_token`), never the engine's count.
    pub input_len: Option<u64>,
    /// The engine's own `usage.prompt_tokens` (summed over a batch's prompts), when every
    /// answer carried usage; null otherwise (a failed request, an engine without usage).
    pub engine_prompt_tokens: Option<u64>,
    /// The engine's own `usage.prompt_tokens_details.cached_tokens` (summed over a batch's
    /// prompts), when every answer carried it (vLLM with `--enable-prompt-tokens-details`);
    /// null otherwise. The engine's count beside [`Self::cached_tokens`], the router's estimate.
    pub engine_cached_tokens: Option<u64>,
    /// Tokens counted from the decode stream.
    pub output_len: u64,
    /// Arrival → first token, seconds.
    pub ttft_s: Option<f64>,
    /// Mean gap between tokens after the first, seconds.
    pub tpot_s: Option<f64>,
    /// Arrival → settlement, seconds.
    pub duration_s: f64,
    /// Attempts dispatched.
    pub attempts: u32,
    /// Producer of the last attempt.
    pub prefill_iid: Option<String>,
    /// Consumer of the last attempt.
    pub decode_iid: Option<String>,
    /// Whether output (the first token) reached the client.
    pub output_started: bool,
    /// Failures of earlier attempts.
    pub attempt_failures: Vec<AttemptFailure>,
    /// The latest TTFT price (controller.md 11.2 `admission_price`), null when never
    /// priced.
    pub admission_price: Option<Value>,
    /// Prompt tokens the KV index credits the engine that computed the prompt with
    /// (docs/design/kv-aware-placement.md); null when the request was not scored.
    pub cached_tokens: Option<u64>,
    /// The mode of that engine's KV index when the request was placed (`exact`: from its
    /// events; `approximate`: guessed from placements; `none`); null when not scored.
    pub kv_mode: Option<&'static str>,
    /// For the credit check, not journalled: the engine (config index) that computed the
    /// prompt on its own (an aggregated placement, whose usage is its own count), the
    /// data-parallel rank it was sent to (`None`: the engine's one rank, or its own choice)
    /// and the tokens of its credit its events reported (`kv_index::Credit::reported`).
    pub kv_check: Option<(usize, Option<u32>, u64)>,
    /// Seconds waited for an admission seat, once the request reached the seat (0.0 for an
    /// immediate one; controller.md 11.2 `queue_waits.admission`).
    pub admission_wait_s: Option<f64>,
    /// Every leg dispatched, in order: `{attempt, leg, iid, request_id, prompt}` — the
    /// `x-request-id` (a UUID4) the engine saw for it, and the prompt's index in a batch
    /// (`null` otherwise).
    pub legs: Vec<LegRecord>,
}

/// A settled request's journal row (behaviour.md 7.8), serialised on the journal writer's
/// thread, without building a map on the request path: every member of the record and its
/// settlement, in the order the journal always wrote them (`rid` first, `queue_waits` last,
/// then `refused` and `refused_cause` for a refused request).
pub(crate) struct RequestRow {
    /// The request's facts.
    pub record: RequestRecord,
    /// How it ended.
    pub settlement: Settlement,
}

impl serde::Serialize for RequestRow {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let (r, s) = (&self.record, &self.settlement);
        let refused = s.terminal == Terminal::Refused;
        let mut m = ser.serialize_map(Some(if refused { 29 } else { 27 }))?;
        m.serialize_entry("rid", &r.rid)?;
        m.serialize_entry("arrived", &r.arrived)?;
        m.serialize_entry("input_len", &r.input_len)?;
        m.serialize_entry("engine_prompt_tokens", &r.engine_prompt_tokens)?;
        m.serialize_entry("output_len", &r.output_len)?;
        m.serialize_entry("ttft_s", &r.ttft_s)?;
        m.serialize_entry("tpot_s", &r.tpot_s)?;
        m.serialize_entry("duration_s", &r.duration_s)?;
        m.serialize_entry("attempts", &r.attempts)?;
        m.serialize_entry("attempt_failures", &r.attempt_failures)?;
        m.serialize_entry("legs", &r.legs)?;
        m.serialize_entry("prefill_iid", &r.prefill_iid)?;
        m.serialize_entry("decode_iid", &r.decode_iid)?;
        m.serialize_entry("status", &s.status)?;
        m.serialize_entry("error", &s.error)?;
        m.serialize_entry("error_type", &s.error_type)?;
        m.serialize_entry("reason", &(!s.reason.is_empty()).then_some(&s.reason))?;
        m.serialize_entry("terminal", s.terminal.as_str())?;
        m.serialize_entry("stream", &r.stream)?;
        m.serialize_entry("endpoint", &r.endpoint)?;
        m.serialize_entry("admission_price", &r.admission_price)?;
        m.serialize_entry("cached_tokens", &r.cached_tokens)?;
        m.serialize_entry("engine_cached_tokens", &r.engine_cached_tokens)?;
        m.serialize_entry("kv_mode", &r.kv_mode)?;
        m.serialize_entry("input_sized", &r.input_len.is_some())?;
        m.serialize_entry("queue_wait_s", &r.admission_wait_s)?;
        m.serialize_entry(
            "queue_waits",
            &QueueWaits {
                admission: r.admission_wait_s,
            },
        )?;
        if refused {
            m.serialize_entry("refused", &true)?;
            m.serialize_entry("refused_cause", &s.reason)?;
        }
        m.end()
    }
}

/// A request row's `queue_waits`: only the admission seat is waited for (`prefill` and
/// `decode` are always null).
struct QueueWaits {
    admission: Option<f64>,
}

impl serde::Serialize for QueueWaits {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = ser.serialize_map(Some(3))?;
        m.serialize_entry("admission", &self.admission)?;
        m.serialize_entry("prefill", &None::<f64>)?;
        m.serialize_entry("decode", &None::<f64>)?;
        m.end()
    }
}

impl crate::journal::TypedRow for RequestRow {
    fn write_object(&self, out: &mut Vec<u8>) {
        // Every member serialises (strings, numbers, `Value`s).
        let _ = serde_json::to_writer(out, self);
    }
}

impl RequestRecord {
    /// The journal row as a `Value` (without `schema`, `schema_version`, `run`, which the
    /// journal adds): what [`RequestRow`] writes.
    #[cfg(test)]
    pub(crate) fn row(&self, s: &Settlement) -> Value {
        let mut row = json!({
            "rid": self.rid,
            "arrived": self.arrived,
            "input_len": self.input_len,
            "engine_prompt_tokens": self.engine_prompt_tokens,
            "output_len": self.output_len,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "duration_s": self.duration_s,
            "attempts": self.attempts,
            "attempt_failures": self.attempt_failures,
            "legs": self.legs,
            "prefill_iid": self.prefill_iid,
            "decode_iid": self.decode_iid,
            "status": s.status,
            "error": s.error,
            "error_type": s.error_type,
            "reason": if s.reason.is_empty() { Value::Null } else { Value::String(s.reason.clone()) },
            "terminal": s.terminal.as_str(),
            "stream": self.stream,
            "endpoint": self.endpoint,
            "admission_price": self.admission_price,
            "cached_tokens": self.cached_tokens,
            "engine_cached_tokens": self.engine_cached_tokens,
            "kv_mode": self.kv_mode,
            "input_sized": self.input_len.is_some(),
            "queue_wait_s": self.admission_wait_s,
            "queue_waits": {"admission": self.admission_wait_s, "prefill": null, "decode": null},
        });
        if s.terminal == Terminal::Refused {
            row["refused"] = json!(true);
            row["refused_cause"] = json!(s.reason);
        }
        row
    }
}

/// Request counters updated by settlements (plus `offered`, counted at ingress).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tally {
    /// Every completion POST seen.
    pub offered: u64,
    /// Settled before sizing.
    pub unsized_offered: u64,
    /// Completed.
    pub served: u64,
    /// Completed within TTFT and TPOT SLOs.
    pub slo_met: u64,
    /// Failed.
    pub failed: u64,
    /// Refused.
    pub refused: u64,
    /// Rejected.
    pub rejected: u64,
    /// Expired.
    pub expired: u64,
    /// Cancelled.
    pub cancelled: u64,
    /// Invalid.
    pub invalid_requests: u64,
    /// Completed after a retry.
    pub served_after_retry: u64,
    /// Reason counts per terminal (failed/rejected/expired/refused), known reasons pre-seeded.
    pub reasons: BTreeMap<&'static str, BTreeMap<String, u64>>,
}

impl Default for Tally {
    fn default() -> Self {
        let mut reasons = BTreeMap::new();
        for (t, list) in [
            ("failed", FAILED_REASONS),
            ("rejected", REJECTED_REASONS),
            ("expired", EXPIRED_REASONS),
            ("refused", REFUSED_REASONS),
        ] {
            reasons.insert(t, list.iter().map(|r| ((*r).to_string(), 0)).collect());
        }
        Tally {
            offered: 0,
            unsized_offered: 0,
            served: 0,
            slo_met: 0,
            failed: 0,
            refused: 0,
            rejected: 0,
            expired: 0,
            cancelled: 0,
            invalid_requests: 0,
            served_after_retry: 0,
            reasons,
        }
    }
}

impl Tally {
    /// Count one settlement; `slo_met` when the request met both SLOs; `sized` when it got
    /// past sizing; `retried` when more than one attempt ran.
    pub(crate) fn apply(&mut self, s: &Settlement, slo_met: bool, sized: bool, retried: bool) {
        if !sized {
            self.unsized_offered += 1;
        }
        let bucket = match s.terminal {
            Terminal::Completed => {
                self.served += 1;
                if slo_met {
                    self.slo_met += 1;
                }
                if retried {
                    self.served_after_retry += 1;
                }
                None
            }
            Terminal::Failed => {
                self.failed += 1;
                Some("failed")
            }
            Terminal::Refused => {
                self.refused += 1;
                Some("refused")
            }
            Terminal::Rejected => {
                self.rejected += 1;
                Some("rejected")
            }
            Terminal::Expired => {
                self.expired += 1;
                Some("expired")
            }
            Terminal::Cancelled => {
                self.cancelled += 1;
                None
            }
            Terminal::Invalid => {
                self.invalid_requests += 1;
                None
            }
        };
        if let Some(b) = bucket {
            let reason = if s.reason.is_empty() {
                "unclassified"
            } else {
                s.reason.as_str()
            };
            *self
                .reasons
                .entry(b)
                .or_default()
                .entry(reason.to_string())
                .or_default() += 1;
        }
    }

    /// `outcome_reasons` for `/narwhal/state` (behaviour.md 1.7): per terminal, every known
    /// reason in its documented order (0 until seen), then the others as seen (sorted).
    pub(crate) fn reasons(&self) -> OutcomeReasons {
        let of = |t: &str, known: &[&str]| -> Ordered<u64> {
            let seen = &self.reasons[t];
            let mut ordered: Ordered<u64> = known
                .iter()
                .map(|k| (*k, seen.get(*k).copied().unwrap_or(0)))
                .collect();
            for (k, v) in seen {
                if !ordered.contains_key(k) {
                    ordered.insert(k.clone(), *v);
                }
            }
            ordered
        };
        OutcomeReasons {
            failed: of("failed", FAILED_REASONS),
            rejected: of("rejected", REJECTED_REASONS),
            expired: of("expired", EXPIRED_REASONS),
            refused: of("refused", REFUSED_REASONS),
        }
    }
}

/// Where settlements go: the router's one accounting place.
pub(crate) trait SettleSink: Send + Sync {
    /// Record the final outcome of `record`.
    fn settle(&self, record: RequestRecord, settlement: Settlement);
    /// The settlement for a request dropped without one (cancelled, or expired when its deadline
    /// already passed; the sink reads the clock).
    fn abandoned(&self, record: &RequestRecord) -> Settlement;
}

/// Exactly-once settlement guard for one request.
pub(crate) struct Pending {
    sink: Arc<dyn SettleSink>,
    record: Option<RequestRecord>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("record", &self.record)
            .finish()
    }
}

impl Pending {
    /// Guard a new request record.
    pub(crate) fn new(sink: Arc<dyn SettleSink>, record: RequestRecord) -> Self {
        Pending {
            sink,
            record: Some(record),
        }
    }

    /// Mutable access to the record while the request runs.
    pub(crate) fn record(&mut self) -> &mut RequestRecord {
        self.record
            .as_mut()
            .expect("a Pending holds its record until settled")
    }

    /// Settle now; consumes the guard so a second settlement cannot compile.
    pub(crate) fn settle(mut self, settlement: Settlement) {
        if let Some(r) = self.record.take() {
            self.sink.settle(r, settlement);
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(r) = self.record.take() {
            let s = self.sink.abandoned(&r);
            self.sink.settle(r, s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::TypedRow;
    use std::sync::Mutex;

    /// The row the journal writer serialises is, byte for byte, the `Value` row: every member,
    /// in order, nulls and non-finite numbers as `null`, the refused members last.
    #[test]
    fn the_typed_row_writes_exactly_the_value_row() {
        let full = RequestRecord {
            rid: "r\"1".into(),
            endpoint: "/v1/chat/completions".into(),
            arrived: 1_764_000_000.125,
            stream: true,
            input_len: Some(12),
            engine_prompt_tokens: Some(11),
            engine_cached_tokens: Some(8),
            output_len: 16,
            ttft_s: Some(0.0123),
            tpot_s: Some(f64::NAN),
            duration_s: 0.5,
            attempts: 2,
            prefill_iid: Some("p0".into()),
            decode_iid: Some("d0".into()),
            output_started: true,
            attempt_failures: vec![AttemptFailure {
                attempt: 1,
                phase: "prefill",
                iid: Some("p1".into()),
                reason: "connect",
                error: "refused".into(),
                transient: None,
                retry_reason: None,
                prompt: None,
            }],
            admission_price: Some(json!({"ttft_s": 0.2})),
            cached_tokens: Some(8),
            kv_mode: Some("exact"),
            kv_check: Some((0, None, 8)),
            admission_wait_s: Some(0.001),
            legs: vec![LegRecord {
                attempt: 1,
                leg: "prefill",
                iid: "p1".into(),
                request_id: "u-1".into(),
                prompt: None,
            }],
        };
        let settlements = [
            Settlement::completed(),
            Settlement::cancelled(),
            Settlement::new(Terminal::Refused, "no_engine", 503, "none live", "x"),
            Settlement::new(Terminal::Failed, "", 502, "e", "upstream_error"),
        ];
        for record in [full, RequestRecord::default()] {
            for s in &settlements {
                let row = RequestRow {
                    record: record.clone(),
                    settlement: s.clone(),
                };
                let mut out = Vec::new();
                row.write_object(&mut out);
                assert_eq!(
                    String::from_utf8(out).unwrap(),
                    record.row(s).to_string(),
                    "{s:?}"
                );
            }
        }
    }

    #[derive(Default)]
    struct Sink(Mutex<Vec<(String, Terminal)>>);
    impl SettleSink for Sink {
        fn settle(&self, r: RequestRecord, s: Settlement) {
            self.0.lock().unwrap().push((r.rid, s.terminal));
        }
        fn abandoned(&self, _: &RequestRecord) -> Settlement {
            Settlement::cancelled()
        }
    }

    fn rec(rid: &str) -> RequestRecord {
        RequestRecord {
            rid: rid.into(),
            ..Default::default()
        }
    }

    #[test]
    fn settle_then_drop_counts_once() {
        let sink = Arc::new(Sink::default());
        let p = Pending::new(sink.clone(), rec("a"));
        p.settle(Settlement::completed());
        assert_eq!(
            *sink.0.lock().unwrap(),
            vec![("a".to_string(), Terminal::Completed)]
        );
    }

    #[test]
    fn dropping_an_unsettled_request_settles_cancelled_once() {
        let sink = Arc::new(Sink::default());
        {
            let mut p = Pending::new(sink.clone(), rec("b"));
            p.record().attempts = 1;
        }
        assert_eq!(
            *sink.0.lock().unwrap(),
            vec![("b".to_string(), Terminal::Cancelled)]
        );
    }

    #[test]
    fn tally_counts_reasons_and_seeds_known_ones() {
        let mut t = Tally::default();
        t.apply(
            &Settlement::new(Terminal::Failed, "engine_error", 502, "x", "decode"),
            false,
            true,
            false,
        );
        t.apply(
            &Settlement::new(Terminal::Rejected, "", 400, "x", "y"),
            false,
            false,
            false,
        );
        t.apply(&Settlement::completed(), true, true, true);
        t.apply(&Settlement::cancelled(), false, true, false);
        assert_eq!(
            (t.failed, t.rejected, t.served, t.slo_met, t.cancelled),
            (1, 1, 1, 1, 1)
        );
        assert_eq!(t.served_after_retry, 1);
        assert_eq!(t.unsized_offered, 1);
        let j = t.reasons();
        assert_eq!(j.failed["engine_error"], 1);
        assert_eq!(j.failed["no_engine"], 0);
        assert_eq!(j.rejected["unclassified"], 1);
        assert_eq!(j.expired["handoff"], 0);
        assert_eq!(j.failed.keys().next(), Some("no_engine"));
    }
}
