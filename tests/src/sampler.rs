//! Sampling something at a fixed rate in the background (both routers' `controls_fleet` at
//! 20 Hz during an HA fault, for example), to assert on what was seen at every moment.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

/// One sample: when (since the sampler started) and what.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<T> {
    /// Time since the sampler started.
    pub at: Duration,
    /// What the probe returned.
    pub value: T,
}

/// A background task calling a probe every period (missed ticks are skipped, so a slow
/// probe lowers the rate instead of bunching samples) until [`Sampler::stop`].
#[derive(Debug)]
pub struct Sampler<T> {
    samples: Arc<Mutex<Vec<Sample<T>>>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl<T: Clone + Send + 'static> Sampler<T> {
    /// Starts sampling `probe` every `period`.
    pub fn start<F, Fut>(period: Duration, mut probe: F) -> Sampler<T>
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = T> + Send,
    {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let (out, cancel) = (samples.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let t0 = Instant::now();
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            while !cancel.is_cancelled() {
                tick.tick().await;
                let value = probe().await;
                lock(&out).push(Sample {
                    at: t0.elapsed(),
                    value,
                });
            }
        });
        Sampler {
            samples,
            stop,
            task,
        }
    }

    /// How many samples so far satisfy `pred`.
    pub fn count(&self, pred: impl Fn(&T) -> bool) -> usize {
        lock(&self.samples)
            .iter()
            .filter(|s| pred(&s.value))
            .count()
    }

    /// Stops sampling (after the probe in progress) and returns every sample.
    ///
    /// # Panics
    /// When the sampling task panicked.
    pub async fn stop(self) -> Vec<Sample<T>> {
        self.stop.cancel();
        self.task.await.expect("sampler task");
        lock(&self.samples).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
