//! Accounting: the one source of the request counters that `/narwhal/state`, `/metrics` and
//! the handoff all read (behaviour.md 7.7a, 10; architecture.md section 5).
//!
//! ```text
//!  serve ──offered / attempts / retries / upstream time──► Accounting ──► metrics (same call)
//!  Pending ──settle(record, settlement)──────────────────►   │  (SettleSink: tally, metrics,
//!                                                          │   histograms, budget, journal row)
//!  documents / handoff ──tally() / serving() / budget()──►   ▼
//! ```
//!
//! Counters the request path bumps on every attempt are atomics; only the outcome tally (a
//! settlement updates several counters and a reason map together) and the rare per-reason
//! attempt failures take a lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use narwhal_shared::Clock;
use narwhal_shared::handoff::{Handoff, REASON_TERMINALS};

use crate::config::Config;
use crate::journal::Journal;
use crate::metrics::{Metrics, labels};
use crate::outcome::{RequestRecord, RequestRow, SettleSink, Settlement, Tally, Terminal};
use crate::placement::Phase;
use crate::retry::RetryBudget;

/// A lock-free `f64` accumulator (seconds of upstream time).
#[derive(Debug, Default)]
struct Seconds(AtomicU64);

impl Seconds {
    fn add(&self, s: f64) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + s).to_bits())
            });
    }

    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Attempt and retry counters (`/narwhal/state.serving`).
#[derive(Debug, Default)]
struct Attempts {
    prefill: AtomicU64,
    decode: AtomicU64,
    retries: AtomicU64,
    credits_spent: AtomicU64,
    denied: AtomicU64,
    /// `(phase, reason)` → count; failures only.
    failures: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

/// Upstream time and decoded tokens (`/narwhal/state.serving`).
#[derive(Debug, Default)]
struct Upstream {
    prefill_s: Seconds,
    decode_s: Seconds,
    decode_tokens: AtomicU64,
}

/// A reading of the serving counters (`/narwhal/state.serving`).
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct ServingStats {
    pub(crate) prefill_attempts: u64,
    pub(crate) decode_attempts: u64,
    pub(crate) retry_attempts: u64,
    pub(crate) retry_credits_spent: u64,
    pub(crate) retry_denied: u64,
    pub(crate) decode_tokens_observed: u64,
    /// `(phase, reason)` → failed attempts.
    pub(crate) attempt_failures: BTreeMap<(&'static str, &'static str), u64>,
    pub(crate) upstream_prefill_s: f64,
    pub(crate) upstream_decode_s: f64,
}

/// The accounting part (see the module doc).
pub(crate) struct Accounting {
    tally: Mutex<Tally>,
    attempts: Attempts,
    upstream: Upstream,
    budget: RetryBudget,
    /// Placements whose cheapest engine missed its own SLO (`unserved`, controller.md
    /// 10.7), carried through handoffs.
    unserved: AtomicU64,
    cfg: Arc<Config>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    journal: Journal,
}

impl Accounting {
    /// Zero counters and a full retry budget.
    pub(crate) fn new(
        cfg: Arc<Config>,
        clock: Arc<dyn Clock>,
        metrics: Arc<Metrics>,
        journal: Journal,
    ) -> Accounting {
        let budget = RetryBudget::new(cfg.serving.retry_budget, cfg.serving.retry_replenish);
        metrics.retries.retry_credits.set(budget.credits());
        Accounting {
            tally: Mutex::new(Tally::default()),
            attempts: Attempts::default(),
            upstream: Upstream::default(),
            budget,
            unserved: AtomicU64::new(0),
            cfg,
            clock,
            metrics,
            journal,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wall(&self) -> f64 {
        self.clock.wall().unwrap_or(0.0)
    }

    /// A copy of the outcome counters.
    pub(crate) fn tally(&self) -> Tally {
        self.lock().clone()
    }

    /// The retry budget (serve spends, settlement replenishes).
    pub(crate) fn budget(&self) -> &RetryBudget {
        &self.budget
    }

    /// `unserved` (carried through handoffs).
    pub(crate) fn unserved(&self) -> u64 {
        self.unserved.load(Ordering::Relaxed)
    }

    /// A placement whose cheapest engine misses its own SLO, served or refused
    /// (controller.md 10.7 `unserved`).
    pub(crate) fn unserved_placement(&self) {
        self.unserved.fetch_add(1, Ordering::Relaxed);
    }

    /// A completion POST arrived (`offered`).
    pub(crate) fn offered(&self) {
        self.lock().offered += 1;
        self.metrics.intake.offered.inc();
    }

    /// A prefill leg was dispatched.
    pub(crate) fn prefill_dispatched(&self) {
        self.attempts.prefill.fetch_add(1, Ordering::Relaxed);
        self.metrics.legs.prefill_attempts.inc();
    }

    /// A decode leg was dispatched.
    pub(crate) fn decode_dispatched(&self) {
        self.attempts.decode.fetch_add(1, Ordering::Relaxed);
        self.metrics.legs.decode_attempts.inc();
    }

    /// An attempt failed in `phase` with failed-reason `reason`.
    pub(crate) fn attempt_failed(&self, phase: Phase, reason: &'static str) {
        *self
            .attempts
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((phase.as_str(), reason))
            .or_default() += 1;
        self.metrics
            .legs
            .attempt_failures
            .get_or_create(&labels(&[("phase", phase.as_str()), ("reason", reason)]))
            .inc();
    }

    /// A retry was granted: one budget credit spent (behaviour.md 7.5).
    pub(crate) fn retry_granted(&self) {
        self.attempts.credits_spent.fetch_add(1, Ordering::Relaxed);
        self.attempts.retries.fetch_add(1, Ordering::Relaxed);
        self.metrics.retries.retry_credits_spent.inc();
        self.metrics.retries.retry_attempts.inc();
    }

    /// A retry was denied by the empty budget.
    pub(crate) fn retry_denied(&self) {
        self.attempts.denied.fetch_add(1, Ordering::Relaxed);
        self.metrics.retries.retry_denied.inc();
    }

    /// A prefill leg answered after `s` seconds.
    pub(crate) fn prefill_time(&self, s: f64) {
        self.upstream.prefill_s.add(s);
        self.metrics
            .legs
            .upstream_seconds
            .get_or_create(&labels(&[("phase", "prefill")]))
            .inc_by(s);
    }

    /// A decode leg ended after `s` seconds with `tokens` counted.
    pub(crate) fn decode_finished(&self, s: f64, tokens: u64) {
        self.upstream
            .decode_tokens
            .fetch_add(tokens, Ordering::Relaxed);
        self.upstream.decode_s.add(s);
        self.metrics.legs.decode_tokens_observed.inc_by(tokens);
        self.metrics
            .legs
            .upstream_seconds
            .get_or_create(&labels(&[("phase", "decode")]))
            .inc_by(s);
    }

    /// A reading of the serving counters.
    pub(crate) fn serving(&self) -> ServingStats {
        let a = &self.attempts;
        ServingStats {
            prefill_attempts: a.prefill.load(Ordering::Relaxed),
            decode_attempts: a.decode.load(Ordering::Relaxed),
            retry_attempts: a.retries.load(Ordering::Relaxed),
            retry_credits_spent: a.credits_spent.load(Ordering::Relaxed),
            retry_denied: a.denied.load(Ordering::Relaxed),
            decode_tokens_observed: self.upstream.decode_tokens.load(Ordering::Relaxed),
            attempt_failures: a.failures.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            upstream_prefill_s: self.upstream.prefill_s.get(),
            upstream_decode_s: self.upstream.decode_s.get(),
        }
    }

    /// Starts the totals at a restored handoff's (`--resume`, takeover; behaviour.md 2.7):
    /// counters replaced, reasons replaced (a carried total above its reasons' sum counts
    /// the rest as `unclassified`), and `/metrics` continued from them.
    pub(crate) fn restore(&self, h: &Handoff) {
        let c = |k: &str| h.counters.get(k).copied().unwrap_or(0);
        self.unserved.store(c("unserved"), Ordering::Relaxed);
        let mut t = self.lock();
        t.offered = c("offered");
        t.unsized_offered = c("unsized_offered");
        t.served = c("served");
        t.slo_met = c("slo_met");
        t.expired = c("expired");
        t.invalid_requests = c("invalid_requests");
        t.failed = c("failed");
        t.refused = c("refused");
        t.rejected = c("rejected");
        t.cancelled = c("cancelled");
        for terminal in REASON_TERMINALS {
            let total = c(terminal);
            let carried = h.outcome_reasons.get(terminal).cloned().unwrap_or_default();
            let entry = t.reasons.entry(terminal).or_default();
            for v in entry.values_mut() {
                *v = 0;
            }
            let mut sum = 0;
            for (k, n) in carried {
                sum += n;
                entry.insert(k, n);
            }
            if total > sum {
                *entry.entry("unclassified".into()).or_default() += total - sum;
            }
        }
        self.metrics.restore_totals(&t, h);
    }
}

impl SettleSink for Accounting {
    /// The one place outcomes are counted: tally, metrics, histograms, retry credits, journal.
    fn settle(&self, mut record: RequestRecord, s: Settlement) {
        record.duration_s = (self.wall() - record.arrived).max(0.0);
        let slo = &self.cfg.slo;
        let slo_met = s.terminal == Terminal::Completed
            && record.ttft_s.is_some_and(|t| t <= slo.ttft_s)
            && record.tpot_s.is_none_or(|t| t <= slo.tpot_s);
        let sized = record.input_len.is_some();
        self.lock().apply(&s, slo_met, sized, record.attempts > 1);
        let m = &self.metrics;
        if !sized {
            m.intake.unsized_offered.inc();
        }
        match s.terminal {
            Terminal::Completed => {
                m.settled.served.inc();
                if slo_met {
                    m.settled.slo_met.inc();
                }
                if record.attempts > 1 {
                    m.retries.served_after_retry.inc();
                }
                self.budget.replenish();
            }
            Terminal::Failed | Terminal::Refused | Terminal::Rejected | Terminal::Expired => {
                let (family, label) = match s.terminal {
                    Terminal::Failed => (&m.settled.failed, "reason"),
                    Terminal::Refused => (&m.intake.refused, "cause"),
                    Terminal::Rejected => (&m.intake.rejected, "reason"),
                    _ => (&m.settled.expired, "reason"),
                };
                family
                    .get_or_create(&labels(&[(label, reason_or(&s))]))
                    .inc();
            }
            Terminal::Cancelled => {
                m.settled.cancelled.inc();
            }
            Terminal::Invalid => {
                m.intake.invalid_requests.inc();
            }
        }
        if let Some(t) = record.ttft_s {
            m.observe_ttft(t);
        }
        if let Some(t) = record.tpot_s {
            m.observe_tpot(t);
        }
        if s.terminal == Terminal::Completed {
            tracing::debug!(rid = %record.rid, attempts = record.attempts, output_len = record.output_len, "request completed");
        } else {
            tracing::info!(
                rid = %record.rid,
                terminal = s.terminal.as_str(),
                reason = %s.reason,
                status = ?s.status,
                attempts = record.attempts,
                error = s.error.as_deref().unwrap_or(""),
                "request settled"
            );
        }
        self.journal.emit_typed(Box::new(RequestRow {
            record,
            settlement: s,
        }));
    }

    fn abandoned(&self, record: &RequestRecord) -> Settlement {
        let elapsed = self.wall() - record.arrived;
        if elapsed >= self.cfg.serving.request_timeout_s {
            Settlement::new(
                Terminal::Expired,
                "deadline",
                504,
                "deadline passed before the client went away",
                "request_expired",
            )
        } else {
            Settlement::cancelled()
        }
    }
}

fn reason_or(s: &Settlement) -> &str {
    if s.reason.is_empty() {
        "unclassified"
    } else {
        &s.reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::Pending;
    use narwhal_shared::{ManualClock, SystemClock};
    use std::time::Duration;

    fn accounting(clock: Arc<ManualClock>) -> (Arc<Accounting>, Arc<Metrics>) {
        let text = serde_json::json!({
            "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
            "engines": [{"iid": "d0", "url": "http://127.0.0.1:2"}],
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
            "serving": {"request_timeout_s": 10, "prefill_timeout_s": 5, "retry_budget": 2,
                        "retry_replenish": 0.5}
        })
        .to_string();
        let cfg = Config::from_json_str(&text, &|_| None).expect("fleet");
        let metrics = Arc::new(Metrics::new(1.0, 0.1));
        let a = Accounting::new(
            Arc::new(cfg),
            clock,
            metrics.clone(),
            Journal::disabled("1-deadbeef"),
        );
        (Arc::new(a), metrics)
    }

    fn rec(rid: &str) -> RequestRecord {
        RequestRecord {
            rid: rid.into(),
            arrived: 1000.0,
            input_len: Some(3),
            ..Default::default()
        }
    }

    #[test]
    fn abandoned_request_is_cancelled_before_the_deadline_and_expired_after() {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        let (a, metrics) = accounting(clock.clone());
        drop(Pending::new(a.clone(), rec("a")));
        clock.advance(Duration::from_secs(11));
        drop(Pending::new(a.clone(), rec("b")));
        let t = a.tally();
        assert_eq!((t.cancelled, t.expired), (1, 1));
        assert_eq!(t.reasons["expired"]["deadline"], 1);
        assert!(metrics.render().contains("narwhal_cancelled_total 1"));
    }

    /// A completion replenishes the budget a retry spent; state and metrics agree.
    #[test]
    fn retries_spend_the_budget_and_completions_replenish_it() {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        let (a, metrics) = accounting(clock);
        assert!(a.budget().try_spend());
        a.retry_granted();
        assert!(a.budget().try_spend());
        a.retry_granted();
        assert!(!a.budget().try_spend());
        a.retry_denied();
        let mut r = rec("c");
        r.attempts = 3;
        a.settle(r, Settlement::completed());
        assert_eq!(a.budget().credits(), 0.5);
        let s = a.serving();
        assert_eq!(
            (s.retry_attempts, s.retry_credits_spent, s.retry_denied),
            (2, 2, 1)
        );
        assert_eq!(a.tally().served_after_retry, 1);
        let text = metrics.render();
        assert!(text.contains("narwhal_retry_denied_total 1"), "{text}");
        assert!(
            text.contains("narwhal_served_after_retry_total 1"),
            "{text}"
        );
    }
}
