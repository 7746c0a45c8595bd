//! Clocks, injected into every state machine.
//!
//! Two readings are kept apart on purpose (architecture.md section 9, departure 8): a monotonic
//! [`Instant`] for deadlines and timeouts, and wall-clock Unix seconds for anything persisted or
//! shown to operators (`at`, `issued_at`, `expires_at`). Only drivers read a [`Clock`]; pure
//! cores take `now` as an argument.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The wall clock could not be read as Unix seconds.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("wall clock is before the Unix epoch by {behind_s} s")]
pub struct ClockError {
    /// How far before 1970-01-01T00:00:00Z the system clock reads, in seconds.
    pub behind_s: f64,
}

/// A source of monotonic and wall-clock time.
pub trait Clock: Send + Sync + 'static {
    /// Monotonic time, for deadlines. Never goes backwards.
    fn now(&self) -> Instant;
    /// Wall-clock time as Unix seconds (fractional), for persisted and displayed times.
    ///
    /// # Errors
    /// [`ClockError`] when the system clock reads before the Unix epoch.
    fn wall(&self) -> Result<f64, ClockError>;
}

/// The operating system's clocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)] // the one place the real clocks are read
    fn now(&self) -> Instant {
        Instant::now()
    }

    #[allow(clippy::disallowed_methods)] // the one place the real clocks are read
    fn wall(&self) -> Result<f64, ClockError> {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => Ok(d.as_secs_f64()),
            Err(e) => Err(ClockError {
                behind_s: e.duration().as_secs_f64(),
            }),
        }
    }
}

/// A clock moved by hand, for tests of state machines and drivers.
#[derive(Debug)]
pub struct ManualClock {
    inner: Mutex<(Instant, f64)>,
}

impl ManualClock {
    /// A clock whose monotonic reading starts at `origin` and wall reading at `wall_s`
    /// (Unix seconds).
    pub fn new(origin: Instant, wall_s: f64) -> Self {
        Self {
            inner: Mutex::new((origin, wall_s)),
        }
    }

    /// Moves both readings forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0 += by;
        g.1 += by.as_secs_f64();
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    fn wall(&self) -> Result<f64, ClockError> {
        Ok(self.inner.lock().unwrap_or_else(|p| p.into_inner()).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_advances_both_readings_together() {
        let t0 = SystemClock.now();
        let c = ManualClock::new(t0, 1000.0);
        c.advance(Duration::from_millis(1500));
        assert_eq!(c.now(), t0 + Duration::from_millis(1500));
        assert_eq!(c.wall(), Ok(1001.5));
    }
}
