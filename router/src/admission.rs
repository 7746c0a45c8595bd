//! Admission in `open` mode (reference-notes 1.8 stages 1 and 7, 7.6): the retained-request
//! limit (`max_concurrent + queue_capacity`), the admission seats and the FIFO queue for them,
//! with their high-water marks. Lock-free: atomics and a semaphore.
//!
//! ```text
//!  request ──try_retain()──► Retained guard (429 when full) ──seat (semaphore)──► attempts
//!                                  └─ waiting for a seat: Queued guard (queue depth)
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
