//! Retries before output (behaviour.md 7.5): whether a failed attempt is followed by
//! another, how long to back off first, and the router-wide retry budget.
//!
//! ```text
//!  failed attempt n ──decide(policy, n, transient, u, now, deadline, budget)──► Retry(backoff)
//!                                                                           └─► Stop(why)
//!  completed request ──budget.replenish()
//! ```
//!
//! Pure: `now`, the deadline and the uniform random `u` are passed in, nothing sleeps or reads a
//! clock. The budget is a lock-free cell (credits as `f64` bits in an `AtomicU64`), so the
//! request path spends and replenishes it without a lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::{Serving, secs};

/// Backoff and attempt limits (`serving.max_attempts`, `serving.retry_base_s`,
/// `serving.retry_cap_s`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RetryPolicy {
    /// Attempts per request, the first included (`serving.max_attempts`).
    pub max_attempts: u32,
    /// Backoff base, seconds: attempt `n` waits up to `base × 2^(n-1)`.
    pub base_s: f64,
    /// Backoff cap, seconds.
    pub cap_s: f64,
}

impl RetryPolicy {
    /// The policy of the fleet file's `serving` section.
    pub(crate) fn from_serving(s: &Serving) -> Self {
        RetryPolicy {
            max_attempts: s.max_attempts,
            base_s: s.retry_base_s,
            cap_s: s.retry_cap_s,
        }
    }

    /// Full-jitter backoff after failed attempt `n` (1-based): `u × min(cap, base × 2^(n-1))`,
    /// `u` uniform in `[0, 1)`.
    pub(crate) fn backoff(&self, n: u32, u: f64) -> Duration {
        let base = self.base_s * 2f64.powi(n.saturating_sub(1) as i32);
        let cap = self.cap_s.min(base);
        secs(u * cap)
    }
}

/// Why no further attempt is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The failure is not retry-eligible (a client fault, a KV descriptor failure, ...).
    NotTransient,
    /// `serving.max_attempts` attempts ran.
    AttemptsExhausted,
    /// The backoff would end at or after the request deadline.
    DeadlineTooClose,
    /// The router-wide retry budget has no credit left (counted as `retry_denied`).
    BudgetDenied,
}

/// What follows failed attempt `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Back off this long, then run attempt `n + 1` (one budget credit was spent).
    Retry(Duration),
    /// Give up with the last attempt's failure.
    Stop(Stop),
}

/// Decides what follows failed attempt `n` (behaviour.md 7.5, in its order: eligibility,
/// attempt limit, backoff against the deadline, then one budget credit). Only a `Retry`
/// spends a credit.
pub(crate) fn decide(
    policy: &RetryPolicy,
    n: u32,
    transient: bool,
    u: f64,
    now: Instant,
    deadline: Instant,
    budget: &RetryBudget,
) -> Decision {
    if !transient {
        return Decision::Stop(Stop::NotTransient);
    }
    if n >= policy.max_attempts {
        return Decision::Stop(Stop::AttemptsExhausted);
    }
    let backoff = policy.backoff(n, u);
    if now + backoff >= deadline {
        return Decision::Stop(Stop::DeadlineTooClose);
    }
    if !budget.try_spend() {
        return Decision::Stop(Stop::BudgetDenied);
    }
    Decision::Retry(backoff)
}

/// The router-wide retry budget (`serving.retry_budget` credits, each retry spends one, each
/// completed request adds `serving.retry_replenish`, never above the budget).
#[derive(Debug)]
pub(crate) struct RetryBudget {
    /// Credits as `f64` bits.
    credits: AtomicU64,
    cap: f64,
    replenish: f64,
}

impl RetryBudget {
    /// A full budget of `cap` credits that gains `replenish` per completed request.
    pub(crate) fn new(cap: u64, replenish: f64) -> Self {
        let cap = cap as f64;
        RetryBudget {
            credits: AtomicU64::new(cap.to_bits()),
            cap,
            replenish,
        }
    }

    /// Credits left.
    pub(crate) fn credits(&self) -> f64 {
        f64::from_bits(self.credits.load(Ordering::Relaxed))
    }

    /// Spends one credit if at least one is left.
    pub(crate) fn try_spend(&self) -> bool {
        self.credits
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |bits| {
                let c = f64::from_bits(bits);
                (c >= 1.0).then(|| (c - 1.0).to_bits())
            })
            .is_ok()
    }

    /// Adds the per-request replenishment, capped at the budget.
    pub(crate) fn replenish(&self) {
        let _ = self
            .credits
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |bits| {
                Some(
                    (f64::from_bits(bits) + self.replenish)
                        .min(self.cap)
                        .to_bits(),
                )
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, SystemClock};

    const POLICY: RetryPolicy = RetryPolicy {
        max_attempts: 3,
        base_s: 0.1,
        cap_s: 0.3,
    };

    #[test]
    fn backoff_doubles_per_attempt_up_to_the_cap_with_full_jitter() {
        assert_eq!(POLICY.backoff(1, 0.5), Duration::from_millis(50));
        assert_eq!(POLICY.backoff(2, 0.5), Duration::from_millis(100));
        assert_eq!(POLICY.backoff(3, 0.5), Duration::from_millis(150), "capped");
        assert_eq!(POLICY.backoff(9, 0.0), Duration::ZERO);
        assert!(POLICY.backoff(1, 0.999_999) < Duration::from_millis(100));
    }

    #[test]
    fn decisions_follow_the_reference_order_and_only_a_retry_spends() {
        let now = SystemClock.now();
        let far = now + Duration::from_secs(60);
        let budget = RetryBudget::new(1, 0.5);
        let d = |n, transient, deadline| decide(&POLICY, n, transient, 0.5, now, deadline, &budget);
        assert_eq!(d(1, false, far), Decision::Stop(Stop::NotTransient));
        assert_eq!(d(3, true, far), Decision::Stop(Stop::AttemptsExhausted));
        let near = now + Duration::from_millis(50);
        assert_eq!(d(1, true, near), Decision::Stop(Stop::DeadlineTooClose));
        assert_eq!(budget.credits(), 1.0, "no credit spent on a stop");
        assert_eq!(d(1, true, far), Decision::Retry(Duration::from_millis(50)));
        assert_eq!(budget.credits(), 0.0);
        assert_eq!(d(2, true, far), Decision::Stop(Stop::BudgetDenied));
    }

    #[test]
    fn the_budget_replenishes_per_completion_up_to_its_size() {
        let b = RetryBudget::new(2, 0.4);
        assert!(b.try_spend() && b.try_spend());
        assert!(!b.try_spend(), "empty");
        b.replenish();
        b.replenish();
        assert!((b.credits() - 0.8).abs() < 1e-9);
        assert!(!b.try_spend(), "0.8 is less than one credit");
        for _ in 0..10 {
            b.replenish();
        }
        assert_eq!(b.credits(), 2.0, "capped at retry_budget");
    }
}
