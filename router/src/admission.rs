//! Admission (behaviour.md 1.8 stages 1 and 7, 7.6; controller.md section 10): the
//! retained-request limit (`max_concurrent + queue_capacity`), the admission seats and the
//! FIFO queue for them, with their high-water marks (lock-free: atomics and a semaphore); and
//! the predictive TTFT price and its refusals (pure), which the role controller's intake
//! applies at the queue and at placement.
//!
//! ```text
//!  request ──try_retain()──► Retained guard (429 when full) ──seat (semaphore)──► attempts
//!                                  └─ waiting for a seat: Queued guard (queue depth)
//!  Price { backlog, own prefill, elapsed, handoff } ──judge(budget)──► None | Refusal (429)
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;
use tokio::sync::Semaphore;

use crate::config::Config;
use crate::metrics::Metrics;

/// The admission part (see the module doc).
pub(crate) struct Admission {
    seats: Arc<Semaphore>,
    max_concurrent: usize,
    retained_limit: usize,
    retained: AtomicUsize,
    retained_high_water: AtomicUsize,
    queued: AtomicUsize,
    queue_high_water: AtomicUsize,
}

/// A reading of the admission counters (`/narwhal/state.admission`, `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AdmissionStats {
    /// Requests holding a seat.
    pub(crate) inflight: usize,
    /// Seats (`--max-concurrent`).
    pub(crate) limit: usize,
    /// Requests waiting for a seat.
    pub(crate) queued: usize,
    /// Most requests ever waiting at once.
    pub(crate) queue_high_water: usize,
    /// Requests retained (seated or queued).
    pub(crate) retained: usize,
    /// `max_concurrent + queue_capacity`.
    pub(crate) retained_limit: usize,
    /// Most requests ever retained at once.
    pub(crate) retained_high_water: usize,
}

impl Admission {
    /// `max_concurrent` seats (at least one) and room for `serving.queue_capacity` waiting.
    pub(crate) fn new(cfg: &Config, max_concurrent: usize, metrics: &Metrics) -> Admission {
        let retained_limit = max_concurrent + cfg.serving.queue_capacity as usize;
        metrics
            .capacity
            .http_retained_limit
            .set(retained_limit as i64);
        metrics
            .capacity
            .admission_inflight_limit
            .set(max_concurrent as i64);
        Admission {
            seats: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
            retained_limit,
            retained: AtomicUsize::new(0),
            retained_high_water: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            queue_high_water: AtomicUsize::new(0),
        }
    }

    /// The admission seats.
    pub(crate) fn seats(&self) -> &Arc<Semaphore> {
        &self.seats
    }

    /// Takes a retained-request slot unless `max_concurrent + queue_capacity` are retained.
    pub(crate) fn try_retain(self: &Arc<Self>) -> Option<Retained> {
        let mut cur = self.retained.load(Ordering::Relaxed);
        loop {
            if cur >= self.retained_limit {
                return None;
            }
            match self
                .retained
                .compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.retained_high_water
                        .fetch_max(cur + 1, Ordering::Relaxed);
                    return Some(Retained(self.clone()));
                }
                Err(now) => cur = now,
            }
        }
    }

    /// Counts a request waiting for a seat until the guard drops.
    pub(crate) fn queued(self: &Arc<Self>) -> Queued {
        let now = self.queued.fetch_add(1, Ordering::AcqRel) + 1;
        self.queue_high_water.fetch_max(now, Ordering::Relaxed);
        Queued(self.clone())
    }

    /// A reading of every counter.
    pub(crate) fn stats(&self) -> AdmissionStats {
        AdmissionStats {
            inflight: self.max_concurrent - self.seats.available_permits().min(self.max_concurrent),
            limit: self.max_concurrent,
            queued: self.queued.load(Ordering::Relaxed),
            queue_high_water: self.queue_high_water.load(Ordering::Relaxed),
            retained: self.retained.load(Ordering::Relaxed),
            retained_limit: self.retained_limit,
            retained_high_water: self.retained_high_water.load(Ordering::Relaxed),
        }
    }
}

/// A request waiting for an admission seat; decrements on drop.
pub(crate) struct Queued(Arc<Admission>);

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Retained-request slot (in-flight limit); decrements on drop.
pub(crate) struct Retained(Arc<Admission>);

impl Drop for Retained {
    fn drop(&mut self) {
        self.0.retained.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A TTFT price of one placement (controller.md 10.4): `price = backlog + own prefill +
/// elapsed + handoff`, seconds; `price_s` is ∞ when the placement cannot be priced (an
/// aggregated placement on an engine serving decode work).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub(crate) struct Price {
    /// The attempt priced (1 for the first).
    pub(crate) attempt: u32,
    /// Resident prefill seconds ahead on the chosen engine.
    #[serde(serialize_with = "round6")]
    pub(crate) backlog_s: f64,
    /// This prompt's own prefill on it.
    #[serde(serialize_with = "round6")]
    pub(crate) own_prefill_s: f64,
    /// Seconds since arrival.
    #[serde(serialize_with = "round6")]
    pub(crate) elapsed_s: f64,
    /// The fleet's mean handoff delay.
    #[serde(serialize_with = "round6")]
    pub(crate) handoff_s: f64,
    /// The price.
    #[serde(serialize_with = "round6")]
    pub(crate) price_s: f64,
}

/// Seconds rounded to 6 places (never `-0.0`), `null` when not finite.
fn round6<S: serde::Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    if x.is_finite() {
        s.serialize_f64((x * 1e6).round() / 1e6 + 0.0)
    } else {
        s.serialize_none()
    }
}

impl Price {
    /// The journal's `admission_price` (`price_s` null when ∞).
    pub(crate) fn to_value(&self) -> Value {
        // Numbers (or null) always serialise.
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// A predictive refusal (controller.md 10.6): always 429 `server_overloaded_error`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Refusal {
    /// `queue`, `prompt`, `aggregate_unpriced`, or `decode`'s causes.
    pub(crate) cause: &'static str,
    /// The client message.
    pub(crate) message: String,
    /// `Retry-After` seconds, if any.
    pub(crate) retry_after: Option<u64>,
    /// The price that refused it.
    pub(crate) price: Price,
}

/// The caveat when no prefill engine is live (controller.md 10.6).
const AGGREGATE_CAVEAT: &str =
    ". Aggregate mode uses the prefill curve only on an engine with no resident decode";

/// Judges `price` against `budget_s` (`ttft·(1 + admission_margin)`): `None` when it fits;
/// else the refusal with its cause: `aggregate_unpriced` when unpriceable, `prompt` when the
/// cheapest own prefill alone (`cheapest_own_s`) exceeds the budget, else `queue`
/// (controller.md 10.4, 10.6). `aggregate` = no prefill engine is live.
pub(crate) fn judge(
    price: &Price,
    budget_s: f64,
    cheapest_own_s: f64,
    aggregate: bool,
) -> Option<Refusal> {
    if price.price_s <= budget_s {
        return None;
    }
    let caveat = if aggregate { AGGREGATE_CAVEAT } else { "" };
    let (cause, message, retry_after) = if !price.price_s.is_finite() {
        (
            "aggregate_unpriced",
            "every live engine is serving decode work; aggregate prefill pricing requires an \
             engine with zero resident decode work; retry after decode work drains"
                .to_string(),
            Some(1),
        )
    } else if cheapest_own_s > budget_s {
        (
            "prompt",
            format!(
                "this prompt's own prefill prices TTFT at {cheapest_own_s:.2}s against the \
                 {budget_s:.2}s budget; no queue drains that, so shorten the prompt or raise \
                 the TTFT budget{caveat}"
            ),
            None,
        )
    } else {
        let wait = (price.price_s - price.elapsed_s - budget_s).ceil().max(1.0) as u64;
        (
            "queue",
            format!(
                "cheapest placement prices TTFT at {:.2}s against the {budget_s:.2}s budget; \
                 retry as the priced queue drains{caveat}",
                price.price_s
            ),
            Some(wait),
        )
    };
    Some(Refusal {
        cause,
        message,
        retry_after,
        price: price.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn price(backlog: f64, own: f64) -> Price {
        Price {
            attempt: 1,
            backlog_s: backlog,
            own_prefill_s: own,
            elapsed_s: 0.0,
            handoff_s: 0.0,
            price_s: backlog + own,
        }
    }

    /// controller.md S12: three 1000-token prefills ahead (3.03 s) and a 100-token prompt
    /// (0.11 s) price 3.14 s against 2 s: `queue`, `Retry-After: 2`.
    #[test]
    fn a_backlog_refuses_with_the_queue_cause_and_a_retry_after() {
        let r = judge(&price(3.03, 0.11), 2.0, 0.11, false).expect("refused");
        assert_eq!(r.cause, "queue");
        assert_eq!(r.retry_after, Some(2));
        assert_eq!(
            r.message,
            "cheapest placement prices TTFT at 3.14s against the 2.00s budget; retry as the \
             priced queue drains"
        );
        let priced = r.price.to_value()["price_s"].as_f64().unwrap_or(0.0);
        assert!((priced - (3.03 + 0.11)).abs() < 1e-9, "{priced}");
    }

    /// A prompt whose own prefill breaks the budget: `prompt`, no `Retry-After`.
    #[test]
    fn a_prompt_too_long_for_the_budget_has_no_retry_after() {
        let r = judge(&price(0.0, 3.01), 2.0, 3.01, false).expect("refused");
        assert_eq!((r.cause, r.retry_after), ("prompt", None));
        assert!(
            r.message
                .starts_with("this prompt's own prefill prices TTFT at 3.01s")
        );
        let r = judge(&price(0.0, 3.01), 2.0, 3.01, true).expect("refused");
        assert!(r.message.ends_with("on an engine with no resident decode"));
    }

    #[test]
    fn an_unpriceable_placement_and_a_fitting_one() {
        let mut p = price(0.0, 0.1);
        assert!(judge(&p, 2.0, 0.1, false).is_none());
        p.price_s = f64::INFINITY;
        let r = judge(&p, 2.0, 0.1, true).expect("refused");
        assert_eq!((r.cause, r.retry_after), ("aggregate_unpriced", Some(1)));
        assert_eq!(r.price.to_value()["price_s"], Value::Null);
    }
}
