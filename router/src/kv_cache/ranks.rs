//! Where each engine's data-parallel ranks sit in the KV index (pure). An engine with
//! `kv_events.data_parallel_size` N runs N ranks behind one API server, each with its own KV
//! cache and its own event stream (vLLM publishes rank `r` on the configured ports plus `r`).
//! The index keeps one slot per rank; placement credits the engine with its best rank and
//! sends the request there (docs/design/kv-aware-placement.md, section 1.3).
//!
//! ```text
//! engines  e0 (1 rank)  e1 (3 ranks)  e2 (1 rank)
//! slots    0            1  3  4       2
//!          rank 0 of engine e is slot e; further ranks follow the engines, in config order
//! ```

use std::ops::Range;

/// The slots of every engine's ranks.
#[derive(Debug, Clone)]
pub(crate) struct Ranks {
    /// Per slot: (engine, rank).
    slots: Vec<(usize, u32)>,
    /// Per engine: its slots beyond rank 0 (ranks 1.., in order).
    more: Vec<Range<usize>>,
}

impl Ranks {
    /// Slots for engines with `sizes[e]` ranks each (0 counts as 1).
    pub(crate) fn new(sizes: &[u32]) -> Self {
        let mut slots: Vec<(usize, u32)> = (0..sizes.len()).map(|e| (e, 0)).collect();
        let mut more = Vec::with_capacity(sizes.len());
        for (e, n) in sizes.iter().enumerate() {
            let start = slots.len();
            slots.extend((1..(*n).max(1)).map(|r| (e, r)));
            more.push(start..slots.len());
        }
        Ranks { slots, more }
    }

    /// Slots in all.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// The engine slot `s` belongs to.
    pub(crate) fn engine(&self, s: usize) -> usize {
        self.slots[s].0
    }

    /// The rank slot `s` is.
    pub(crate) fn rank(&self, s: usize) -> u32 {
        self.slots[s].1
    }

    /// Engine `e`'s slots, rank 0 first.
    pub(crate) fn of(&self, e: usize) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(e).chain(self.more[e].clone())
    }

    /// Whether engine `e` has more than one rank.
    pub(crate) fn several(&self, e: usize) -> bool {
        !self.more[e].is_empty()
    }

    /// The slot of engine `e`'s rank `rank`, if it has one.
    pub(crate) fn slot(&self, e: usize, rank: u32) -> Option<usize> {
        match rank {
            0 => Some(e).filter(|e| *e < self.more.len()),
            r => self.more.get(e).and_then(|m| {
                let s = m.start + r as usize - 1;
                (s < m.end).then_some(s)
            }),
        }
    }

    /// A per-engine list (config order) as a per-slot one: each rank gets its engine's value.
    pub(crate) fn expand<T: Copy>(&self, per_engine: &[T]) -> Vec<T> {
        self.slots
            .iter()
            .filter_map(|(e, _)| per_engine.get(*e).copied())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_zero_is_the_engines_own_slot_and_further_ranks_follow() {
        let r = Ranks::new(&[1, 3, 0]);
        assert_eq!(r.len(), 5);
        assert_eq!(r.of(0).collect::<Vec<_>>(), [0]);
        assert_eq!(r.of(1).collect::<Vec<_>>(), [1, 3, 4]);
        assert_eq!(r.of(2).collect::<Vec<_>>(), [2]);
        assert_eq!((r.engine(4), r.rank(4)), (1, 2));
        assert_eq!((r.engine(2), r.rank(2)), (2, 0));
        assert_eq!(r.slot(1, 2), Some(4));
        assert_eq!(r.slot(1, 3), None);
        assert_eq!(r.slot(0, 1), None);
        assert_eq!(r.slot(9, 0), None);
        assert!(r.several(1) && !r.several(0) && !r.several(2));
        assert_eq!(r.expand(&[10, 11, 12]), [10, 11, 12, 11, 11]);
    }
}
