//! Bucketed demand windows (controller.md 3.2): each bucket keeps one cohort per distinct
//! shape (up to `max_shapes`, then one merged overflow cohort), with the count and the first
//! and last observation of the shape in that bucket.
//!
//! ```text
//!  observe(now, shape, n) ──► bucket floor((now − origin)/bucket_s) ──► cohort[shape] += n
//!  rows(since)      cohorts whose last observation is ≥ since
//!  evidence(since)  conservative count and oldest time after a cutoff
//! ```
//!
//! Pure: `now` is passed in.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// One shape's observations in one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Cohort {
    /// Observations.
    pub(crate) count: u64,
    /// First observation.
    pub(crate) first: Instant,
    /// Last observation.
    pub(crate) last: Instant,
}

impl Cohort {
    fn new(at: Instant, n: u64) -> Cohort {
        Cohort {
            count: n,
            first: at,
            last: at,
        }
    }

    fn add(&mut self, at: Instant, n: u64) {
        self.count += n;
        self.first = self.first.min(at);
        self.last = self.last.max(at);
    }
}

#[derive(Debug, Clone)]
struct Bucket<K> {
    index: u64,
    cells: BTreeMap<K, Cohort>,
    overflow: Option<Cohort>,
}

/// A row of a window: a shape (`None` for the bucket's overflow cohort) and its cohort.
pub(crate) type Row<'a, K> = (Option<&'a K>, Cohort);

/// A demand window (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct Window<K> {
    origin: Instant,
    bucket_s: f64,
    retention_s: f64,
    max_shapes: usize,
    buckets: VecDeque<Bucket<K>>,
    overflow_observations: u64,
}

/// Distinct shapes kept per bucket before they merge into the overflow cohort.
pub(crate) const MAX_SHAPES: usize = 128;

impl<K: Ord + Clone> Window<K> {
    /// An empty window with buckets of `bucket_s` seconds from `origin`, keeping
    /// `retention_s` seconds.
    pub(crate) fn new(origin: Instant, bucket_s: f64, retention_s: f64) -> Window<K> {
        Window {
            origin,
            bucket_s: bucket_s.max(1e-3),
            retention_s,
            max_shapes: MAX_SHAPES,
            buckets: VecDeque::new(),
            overflow_observations: 0,
        }
    }

    fn index(&self, at: Instant) -> u64 {
        (at.saturating_duration_since(self.origin).as_secs_f64() / self.bucket_s).floor() as u64
    }

    /// Records `n` observations of `shape` at `now`.
    pub(crate) fn observe(&mut self, now: Instant, shape: K, n: u64) {
        self.prune(now);
        let index = self.index(now);
        if self.buckets.back().is_none_or(|b| b.index < index) {
            self.buckets.push_back(Bucket {
                index,
                cells: BTreeMap::new(),
                overflow: None,
            });
        }
        // A late observation (its bucket already passed) joins the newest bucket.
        let max_shapes = self.max_shapes;
        let bucket = self.buckets.back_mut().expect("pushed above");
        if let Some(c) = bucket.cells.get_mut(&shape) {
            c.add(now, n);
        } else if bucket.cells.len() < max_shapes {
            bucket.cells.insert(shape, Cohort::new(now, n));
        } else {
            self.overflow_observations += n;
            match &mut bucket.overflow {
                Some(c) => c.add(now, n),
                None => bucket.overflow = Some(Cohort::new(now, n)),
            }
        }
    }

    /// Drops buckets that ended more than `retention_s` before `now`.
    pub(crate) fn prune(&mut self, now: Instant) {
        let keep_from = now.checked_sub(Duration::from_secs_f64(self.retention_s.max(0.0)));
        let Some(keep_from) = keep_from else { return };
        let first_kept = self.index(keep_from);
        while self.buckets.front().is_some_and(|b| b.index < first_kept) {
            self.buckets.pop_front();
        }
    }

    /// Every cohort whose last observation is at or after `since`, oldest bucket first.
    pub(crate) fn rows(&self, since: Instant) -> impl Iterator<Item = Row<'_, K>> {
        self.buckets.iter().flat_map(move |b| {
            b.cells
                .iter()
                .map(|(k, c)| (Some(k), *c))
                .chain(b.overflow.map(|c| (None, c)))
                .filter(move |(_, c)| c.last >= since)
        })
    }

    /// Observations with the last at or after `since`.
    pub(crate) fn count_since(&self, since: Instant) -> u64 {
        self.rows(since).map(|(_, c)| c.count).sum()
    }

    /// Conservative evidence after `cutoff` (controller.md 3.2): a cohort wholly after it
    /// counts in full, a straddling one counts 1; with the oldest counted observation (the
    /// cohort's first, or its last when it straddles).
    pub(crate) fn evidence(&self, cutoff: Instant) -> (u64, Option<Instant>) {
        let mut count = 0;
        let mut oldest: Option<Instant> = None;
        for (_, c) in self.rows(cutoff) {
            let (n, at) = if c.first >= cutoff {
                (c.count, c.first)
            } else {
                (1, c.last)
            };
            count += n;
            oldest = Some(oldest.map_or(at, |o| o.min(at)));
        }
        (count, oldest)
    }

    /// Bucket length, seconds.
    pub(crate) fn bucket_s(&self) -> f64 {
        self.bucket_s
    }

    /// Retention, seconds.
    pub(crate) fn retention_s(&self) -> f64 {
        self.retention_s
    }

    /// Cohorts held (overflow cohorts included).
    pub(crate) fn cells(&self) -> usize {
        self.buckets
            .iter()
            .map(|b| b.cells.len() + usize::from(b.overflow.is_some()))
            .sum()
    }

    /// The most cohorts the window can hold: `(ceil(retention/bucket) + 1)·(max_shapes + 1)`.
    pub(crate) fn cell_limit(&self) -> usize {
        ((self.retention_s / self.bucket_s).ceil() as usize + 1) * (self.max_shapes + 1)
    }

    /// Observations held.
    pub(crate) fn observations(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| {
                b.cells.values().map(|c| c.count).sum::<u64>() + b.overflow.map_or(0, |c| c.count)
            })
            .sum()
    }

    /// Observations that ever landed in an overflow cohort.
    pub(crate) fn overflow_observations(&self) -> u64 {
        self.overflow_observations
    }

    /// Whether an overflow cohort is held now (the learned estimates freeze then).
    pub(crate) fn has_overflow(&self) -> bool {
        self.buckets.iter().any(|b| b.overflow.is_some())
    }

    #[cfg(test)]
    fn with_max_shapes(mut self, n: usize) -> Self {
        self.max_shapes = n;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, SystemClock};

    fn s(x: f64) -> Duration {
        Duration::from_secs_f64(x)
    }

    #[test]
    fn cohorts_merge_per_bucket_and_expire_after_retention() {
        let t0 = SystemClock.now();
        let mut w: Window<u64> = Window::new(t0, 1.0, 10.0);
        w.observe(t0 + s(0.1), 500, 1);
        w.observe(t0 + s(0.6), 500, 1);
        w.observe(t0 + s(0.7), 100, 1);
        w.observe(t0 + s(1.2), 500, 1);
        assert_eq!(w.cells(), 3);
        assert_eq!(w.observations(), 4);
        assert_eq!(w.count_since(t0), 4);
        assert_eq!(
            w.count_since(t0 + s(0.55)),
            4,
            "a cohort counts whole by its last"
        );
        assert_eq!(
            w.count_since(t0 + s(0.65)),
            2,
            "the first 500 cohort ended at 0.6"
        );
        assert_eq!(w.count_since(t0 + s(1.0)), 1);
        w.prune(t0 + s(12.5));
        assert_eq!(
            w.observations(),
            0,
            "every bucket ended before now − retention"
        );
        assert_eq!(w.cell_limit(), 11 * 129);
    }

    /// Evidence is conservative: a cohort that straddles the cutoff counts once, at its last.
    #[test]
    fn evidence_counts_straddling_cohorts_once() {
        let t0 = SystemClock.now();
        let mut w: Window<u64> = Window::new(t0, 1.0, 100.0);
        for i in 0..10 {
            w.observe(t0 + s(i as f64 * 0.1), 1, 1);
        }
        w.observe(t0 + s(5.0), 1, 1);
        let (n, oldest) = w.evidence(t0 + s(0.5));
        assert_eq!(
            n, 2,
            "the straddling first bucket counts 1, the later one 1"
        );
        assert_eq!(oldest, Some(t0 + s(0.9)));
        let (n, oldest) = w.evidence(t0);
        assert_eq!((n, oldest), (11, Some(t0)));
        assert_eq!(w.evidence(t0 + s(6.0)), (0, None));
    }

    #[test]
    fn shapes_beyond_the_limit_merge_into_one_overflow_cohort() {
        let t0 = SystemClock.now();
        let mut w: Window<u64> = Window::new(t0, 1.0, 10.0).with_max_shapes(2);
        for shape in 0..5 {
            w.observe(t0, shape, 1);
        }
        assert_eq!(w.cells(), 3);
        assert_eq!(w.overflow_observations(), 3);
        assert!(w.has_overflow());
        let rows: Vec<_> = w.rows(t0).collect();
        assert_eq!(
            rows.last().map(|(k, c)| (k.is_none(), c.count)),
            Some((true, 3))
        );
    }
}
