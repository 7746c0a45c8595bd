//! Counters behind `GET /sim/stats` and `/metrics`, and the per-request [`Tracker`] that settles
//! each completion request exactly once (ok, error, fault or cancelled).
//!
//! ```text
//!  request arrives ──Tracker::new──► in_flight+1
//!     ├─ finish(outcome, status, tokens) ──► recent ring (last 1000)
//!     └─ dropped unfinished (client went away) ──► cancelled+1, recent "cancelled"
//! ```
//!
//! Counters are atomics; the `recent` ring is a short-held mutex, never held across an await.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::Serialize;

use crate::faults::Phase;

/// How many finished requests `recent` keeps.
pub(crate) const RECENT_CAP: usize = 1000;

/// Status recorded for a request cancelled before any response head was sent (nginx's
/// "client closed request").
pub(crate) const STATUS_CLIENT_CLOSED: u16 = 499;

/// One entry of `/sim/stats` `recent`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Recent {
    /// `x-request-id` (vLLM) or body `rid` (SGLang), else a generated id.
    pub(crate) request_id: String,
    /// `prefill`, `decode` or `aggregated`.
    pub(crate) phase: &'static str,
    /// `ok`, `error`, `cancelled` or `fault`.
    pub(crate) outcome: &'static str,
    /// HTTP status sent (499 when cancelled before the response head).
    pub(crate) status: u16,
    /// Generated tokens sent to the client.
    pub(crate) tokens: u64,
    /// Consumer: the producer's engine id. Producer: the consumer's address once read.
    pub(crate) kv_peer: Option<String>,
    /// SGLang bootstrap room, when the request carried one.
    pub(crate) room: Option<u64>,
    /// vLLM block ids issued (producer) or read (consumer).
    pub(crate) block_ids: Option<Vec<u64>>,
    /// The request asked for a stream (`"stream": true`); `false` for one that did not parse.
    pub(crate) stream: bool,
}

/// All counters of one simulator process.
pub(crate) struct Stats {
    /// Requests that arrived as prefill.
    pub(crate) req_prefill: AtomicU64,
    /// Requests that arrived as decode.
    pub(crate) req_decode: AtomicU64,
    /// Requests that arrived as aggregated (and malformed ones).
    pub(crate) req_aggregated: AtomicU64,
    /// `POST /tokenize` calls answered (any outcome).
    pub(crate) req_tokenize: AtomicU64,
    /// Blocks running requests hold (`--kv-pool`), over every data-parallel rank.
    pub(crate) kv_used: AtomicU64,
    /// Descriptors/rooms produced.
    pub(crate) kv_issued: AtomicU64,
    /// Descriptors/rooms of this producer read by a consumer.
    pub(crate) kv_served: AtomicU64,
    /// Transfers completed as consumer.
    pub(crate) kv_consumed: AtomicU64,
    /// Consumer-side transfer failures.
    pub(crate) kv_rejected: AtomicU64,
    /// Decode-capable requests served without transferred KV.
    pub(crate) kv_recomputed: AtomicU64,
    /// Successful SGLang `/pd_role_switch` calls that changed the mode.
    pub(crate) role_switches: AtomicU64,
    /// Producer KV freed unread after the lease.
    pub(crate) kv_expired: AtomicU64,
    /// Requests whose client went away before they finished.
    pub(crate) cancelled: AtomicU64,
    /// Requests refused 401 by `--api-key` (never reached a handler).
    pub(crate) unauthorized: AtomicU64,
    /// Completion requests in progress (never reset).
    pub(crate) in_flight: AtomicI64,
    /// Requests waiting for a place under `--max-num-seqs` (a gauge; part of `in_flight`).
    pub(crate) waiting: AtomicI64,
    /// Prometheus `prompt_tokens_total` (monotonic, not reset by `/sim/stats/reset`).
    pub(crate) prom_prompt_tokens: AtomicU64,
    /// Prometheus `generation_tokens_total` (monotonic).
    pub(crate) prom_generation_tokens: AtomicU64,
    /// Prometheus `request_success_total` (monotonic).
    pub(crate) prom_success: AtomicU64,
    /// KV transfers completed as consumer, with their durations: vLLM
    /// `vllm:nixl_xfer_time_seconds`, SGLang `sglang:per_stage_req_latency_seconds{stage=
    /// "decode_transferred"}` (monotonic, not reset by `/sim/stats/reset`).
    pub(crate) prom_transfers: Histogram,
    /// Consumer transfers that were attempted and failed: vLLM
    /// `vllm:nixl_num_failed_transfers_total`, SGLang `sglang:num_transfer_failed_reqs_total`.
    pub(crate) prom_transfer_failures: AtomicU64,
    /// SGLang decodes whose bootstrap server could not be reached:
    /// `sglang:num_bootstrap_failed_reqs_total`.
    pub(crate) prom_bootstrap_failures: AtomicU64,
    recent: Mutex<VecDeque<Recent>>,
}

/// A Prometheus histogram of durations (seconds) over fixed bucket bounds, lock-free.
pub(crate) struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    /// A histogram with upper bounds `bounds` (ascending; `+Inf` is implied).
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    /// Records one observation of `d`.
    pub(crate) fn observe(&self, d: std::time::Duration) {
        let secs = d.as_secs_f64();
        for (b, c) in self.bounds.iter().zip(&self.buckets) {
            if secs <= *b {
                c.fetch_add(1, Relaxed);
            }
        }
        self.sum_us
            .fetch_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX), Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// Observations so far.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// The `_bucket`, `_count` and `_sum` sample lines of `name` with the label pairs `labels`
    /// (`k="v"` joined by commas, without braces).
    pub(crate) fn render(&self, out: &mut String, name: &str, labels: &str) {
        use std::fmt::Write as _;
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, c) in self.bounds.iter().zip(&self.buckets) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {}",
                c.load(Relaxed)
            );
        }
        let n = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {n}");
        let sum = self.sum_us.load(Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
    }
}

/// vLLM's `vllm:nixl_xfer_time_seconds` bucket bounds (seconds).
pub(crate) const NIXL_XFER_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];

/// Per-phase request counts of `/sim/stats`.
#[derive(Serialize)]
struct Requests {
    prefill: u64,
    decode: u64,
    aggregated: u64,
    tokenize: u64,
}

/// `kv` of `/sim/stats`.
#[derive(Serialize)]
struct Kv {
    issued: u64,
    served: u64,
    consumed: u64,
    rejected: u64,
    recomputed: u64,
    expired: u64,
}

/// The `/sim/stats` document (shape fixed by docs/engine-simulator.md, "Statistics"; other tests
/// depend on it).
#[derive(Serialize)]
pub(crate) struct StatsDoc<'a> {
    engine_id: &'a str,
    dialect: &'a str,
    model: &'a str,
    pid: u32,
    started_at: f64,
    requests: Requests,
    kv: Kv,
    cancelled: u64,
    unauthorized: u64,
    in_flight: i64,
    /// Of `in_flight`, those waiting for a place under `--max-num-seqs`.
    waiting: i64,
    role_switches: u64,
    recent: Vec<Recent>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            req_prefill: AtomicU64::new(0),
            req_decode: AtomicU64::new(0),
            req_aggregated: AtomicU64::new(0),
            req_tokenize: AtomicU64::new(0),
            kv_used: AtomicU64::new(0),
            kv_issued: AtomicU64::new(0),
            kv_served: AtomicU64::new(0),
            kv_consumed: AtomicU64::new(0),
            kv_rejected: AtomicU64::new(0),
            kv_recomputed: AtomicU64::new(0),
            role_switches: AtomicU64::new(0),
            kv_expired: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            unauthorized: AtomicU64::new(0),
            in_flight: AtomicI64::new(0),
            waiting: AtomicI64::new(0),
            prom_prompt_tokens: AtomicU64::new(0),
            prom_generation_tokens: AtomicU64::new(0),
            prom_success: AtomicU64::new(0),
            prom_transfers: Histogram::new(NIXL_XFER_BUCKETS),
            prom_transfer_failures: AtomicU64::new(0),
            prom_bootstrap_failures: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::new()),
        }
    }
}

impl Stats {
    /// Requests in the running set: in flight, less those waiting for a place
    /// (`--max-num-seqs`).
    pub(crate) fn running(&self) -> i64 {
        (self.in_flight.load(Relaxed) - self.waiting.load(Relaxed)).max(0)
    }

    fn recent_lock(&self) -> MutexGuard<'_, VecDeque<Recent>> {
        // A panic while holding this lock cannot leave the ring inconsistent; keep serving.
        self.recent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts one arriving completion/chat request of `phase`.
    pub(crate) fn count_arrival(&self, phase: Phase) {
        match phase {
            Phase::Prefill => &self.req_prefill,
            Phase::Decode => &self.req_decode,
            _ => &self.req_aggregated,
        }
        .fetch_add(1, Relaxed);
    }

    fn push_recent(&self, r: Recent) {
        let mut g = self.recent_lock();
        if g.len() == RECENT_CAP {
            g.pop_front();
        }
        g.push_back(r);
    }

    /// Sets `kv_peer` of the most recent entry for `request_id` (a producer learns its consumer
    /// when the KV is read, after the prefill request already finished).
    pub(crate) fn set_peer(&self, request_id: &str, peer: &str) {
        let mut g = self.recent_lock();
        if let Some(r) = g.iter_mut().rev().find(|r| r.request_id == request_id) {
            r.kv_peer = Some(peer.to_string());
        }
    }

    /// Zeroes every `/sim/stats` counter and clears `recent` (`in_flight` is a gauge and stays).
    pub(crate) fn reset(&self) {
        for c in [
            &self.req_prefill,
            &self.req_decode,
            &self.req_aggregated,
            &self.kv_issued,
            &self.kv_served,
            &self.kv_consumed,
            &self.kv_rejected,
            &self.kv_recomputed,
            &self.kv_expired,
            &self.cancelled,
            &self.unauthorized,
        ] {
            c.store(0, Relaxed);
        }
        self.recent_lock().clear();
    }

    /// Builds the `/sim/stats` document.
    pub(crate) fn doc<'a>(
        &self,
        engine_id: &'a str,
        dialect: &'a str,
        model: &'a str,
        started_at: f64,
    ) -> StatsDoc<'a> {
        let l = |c: &AtomicU64| c.load(Relaxed);
        StatsDoc {
            engine_id,
            dialect,
            model,
            pid: std::process::id(),
            started_at,
            requests: Requests {
                prefill: l(&self.req_prefill),
                decode: l(&self.req_decode),
                aggregated: l(&self.req_aggregated),
                tokenize: l(&self.req_tokenize),
            },
            kv: Kv {
                issued: l(&self.kv_issued),
                served: l(&self.kv_served),
                consumed: l(&self.kv_consumed),
                rejected: l(&self.kv_rejected),
                recomputed: l(&self.kv_recomputed),
                expired: l(&self.kv_expired),
            },
            cancelled: l(&self.cancelled),
            unauthorized: l(&self.unauthorized),
            in_flight: self.in_flight.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
            role_switches: l(&self.role_switches),
            recent: self.recent_lock().iter().cloned().collect(),
        }
    }
}

/// Outcome of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Served as asked.
    Ok,
    /// Answered with an error (4xx/5xx or an SSE error frame).
    Error,
}

/// Settles one completion request exactly once. Dropping it unfinished records `cancelled`.
pub(crate) struct Tracker {
    stats: Arc<Stats>,
    rec: Option<Recent>,
    fault: bool,
    head_sent: bool,
    /// Its place in the running set (`--max-num-seqs`), released with the tracker.
    seat: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Its KV blocks (`--kv-pool`), given back with the tracker.
    kv: Option<Box<dyn std::any::Any + Send + Sync>>,
}

/// Counts one request in [`Stats::waiting`] while it lives.
pub(crate) struct Waiting<'a>(&'a Stats);

impl<'a> Waiting<'a> {
    pub(crate) fn new(stats: &'a Stats) -> Self {
        stats.waiting.fetch_add(1, Relaxed);
        Waiting(stats)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Relaxed);
    }
}

impl Tracker {
    /// Starts tracking a request (in_flight + 1).
    pub(crate) fn new(stats: Arc<Stats>, request_id: String, phase: Phase) -> Self {
        stats.in_flight.fetch_add(1, Relaxed);
        Tracker {
            stats,
            rec: Some(Recent {
                request_id,
                phase: phase.as_str(),
                outcome: "cancelled",
                status: STATUS_CLIENT_CLOSED,
                tokens: 0,
                kv_peer: None,
                room: None,
                block_ids: None,
                stream: false,
            }),
            fault: false,
            head_sent: false,
            seat: None,
            kv: None,
        }
    }

    /// Holds the request's KV blocks (`--kv-pool`) until it is settled: dropping `hold` gives
    /// them back.
    pub(crate) fn hold_kv(&mut self, hold: Box<dyn std::any::Any + Send + Sync>) {
        self.kv = Some(hold);
    }

    /// Holds the request's place in the running set (`--max-num-seqs`) until it is settled.
    pub(crate) fn hold(&mut self, seat: Option<tokio::sync::OwnedSemaphorePermit>) {
        self.seat = seat;
    }

    /// The request's id.
    pub(crate) fn request_id(&self) -> &str {
        self.rec.as_ref().map_or("", |r| r.request_id.as_str())
    }

    /// Marks that an injected fault applied: a completed request is then recorded as `fault`.
    pub(crate) fn mark_fault(&mut self) {
        self.fault = true;
    }

    /// Marks that a 200 head went out (a later cancellation records status 200).
    pub(crate) fn mark_head_sent(&mut self) {
        self.head_sent = true;
    }

    /// Sets the KV fields of the entry.
    /// Records that the request asked for a stream (`recent[].stream`).
    pub(crate) fn set_stream(&mut self, stream: bool) {
        if let Some(r) = self.rec.as_mut() {
            r.stream = stream;
        }
    }

    pub(crate) fn set_kv(
        &mut self,
        peer: Option<String>,
        room: Option<u64>,
        block_ids: Option<Vec<u64>>,
    ) {
        if let Some(r) = self.rec.as_mut() {
            if peer.is_some() {
                r.kv_peer = peer;
            }
            if room.is_some() {
                r.room = room;
            }
            if block_ids.is_some() {
                r.block_ids = block_ids;
            }
        }
    }

    /// Records tokens sent so far (used if the request is later cancelled).
    pub(crate) fn set_tokens(&mut self, tokens: u64) {
        if let Some(r) = self.rec.as_mut() {
            r.tokens = tokens;
        }
    }

    /// Settles the request (and gives up its place in the running set). Later calls and the
    /// drop are no-ops.
    pub(crate) fn finish(&mut self, outcome: Outcome, status: u16, tokens: u64) {
        self.seat = None;
        self.kv = None;
        if let Some(mut r) = self.rec.take() {
            r.outcome = if self.fault {
                "fault"
            } else {
                match outcome {
                    Outcome::Ok => "ok",
                    Outcome::Error => "error",
                }
            };
            r.status = status;
            r.tokens = tokens;
            if outcome == Outcome::Ok && !self.fault {
                self.stats.prom_success.fetch_add(1, Relaxed);
            }
            self.stats.push_recent(r);
        }
    }

    /// Settles the request as a fault that ended the connection (drop/cut).
    pub(crate) fn finish_fault(&mut self, status: u16, tokens: u64) {
        self.fault = true;
        self.finish(Outcome::Error, status, tokens);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Relaxed);
        if let Some(mut r) = self.rec.take() {
            self.stats.cancelled.fetch_add(1, Relaxed);
            r.outcome = "cancelled";
            if self.head_sent {
                r.status = 200;
            }
            self.stats.push_recent(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_settles_once_and_drop_counts_cancelled() {
        let stats = Arc::new(Stats::default());
        {
            let mut t = Tracker::new(stats.clone(), "a".into(), Phase::Decode);
            assert_eq!(stats.in_flight.load(Relaxed), 1);
            t.finish(Outcome::Ok, 200, 4);
            t.finish(Outcome::Error, 500, 0);
        }
        {
            let mut t = Tracker::new(stats.clone(), "b".into(), Phase::Prefill);
            t.mark_head_sent();
            t.set_tokens(2);
        }
        {
            let mut t = Tracker::new(stats.clone(), "c".into(), Phase::Aggregated);
            t.mark_fault();
            t.finish(Outcome::Ok, 200, 1);
        }
        let doc = stats.doc("e", "vllm", "m", 1.0);
        assert_eq!(doc.in_flight, 0);
        assert_eq!(doc.cancelled, 1);
        let r: Vec<(&str, &str, u16, u64)> = doc
            .recent
            .iter()
            .map(|r| (r.request_id.as_str(), r.outcome, r.status, r.tokens))
            .collect();
        assert_eq!(
            r,
            vec![
                ("a", "ok", 200, 4),
                ("b", "cancelled", 200, 2),
                ("c", "fault", 200, 1)
            ]
        );
        stats.set_peer("a", "peer-1");
        assert_eq!(
            stats.doc("e", "vllm", "m", 1.0).recent[0]
                .kv_peer
                .as_deref(),
            Some("peer-1")
        );
        stats.reset();
        let doc = stats.doc("e", "vllm", "m", 1.0);
        assert_eq!(doc.cancelled, 0);
        assert!(doc.recent.is_empty());
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_count_every_observation() {
        let h = Histogram::new(NIXL_XFER_BUCKETS);
        h.observe(std::time::Duration::from_millis(3));
        h.observe(std::time::Duration::from_millis(60));
        h.observe(std::time::Duration::from_secs(9));
        let mut out = String::new();
        h.render(&mut out, "x", "engine=\"0\"");
        assert!(
            out.contains("x_bucket{engine=\"0\",le=\"0.005\"} 1\n"),
            "{out}"
        );
        assert!(
            out.contains("x_bucket{engine=\"0\",le=\"0.075\"} 2\n"),
            "{out}"
        );
        assert!(out.contains("x_bucket{engine=\"0\",le=\"5\"} 2\n"), "{out}");
        assert!(
            out.contains("x_bucket{engine=\"0\",le=\"+Inf\"} 3\n"),
            "{out}"
        );
        assert!(out.contains("x_count{engine=\"0\"} 3\n"), "{out}");
        assert!(out.contains("x_sum{engine=\"0\"} 9.063\n"), "{out}");
    }

    #[test]
    fn recent_keeps_the_last_1000() {
        let stats = Arc::new(Stats::default());
        for i in 0..(RECENT_CAP + 5) {
            let mut t = Tracker::new(stats.clone(), i.to_string(), Phase::Aggregated);
            t.finish(Outcome::Ok, 200, 1);
        }
        let doc = stats.doc("e", "vllm", "m", 1.0);
        assert_eq!(doc.recent.len(), RECENT_CAP);
        assert_eq!(doc.recent[0].request_id, "5");
    }
}
