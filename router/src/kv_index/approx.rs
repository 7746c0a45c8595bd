//! The approximate part of the index: which prompt blocks the router **guesses** each engine
//! holds, from its own placements (docs/design/kv-aware-placement.md, "The approximate
//! index"). Used for engines whose events the router cannot use: no `kv_events`, events not
//! yet arrived from this process (`waiting`), or stopped (`stale`).
//!
//! ```text
//!  placed(engine, prompt chain, now) ──► per engine: our hash → (touched at, stamp)
//!                                        stamp → our hash (LRU order, oldest first)
//!  holds(engine, our hash, now): touched less than TTL ago (KvIndex::credit takes the run)
//!  settle(engine, our hashes): the engine's own events told these blocks (stored or removed)
//! ```
//!
//! The blocks are named by the same chained hash as the exact index ([`super::prompt_chain`]),
//! so an engine that goes from approximate to exact (or back) is scored over one key space.
//! A placement touches the prompt's full blocks from the last to the first, so within one
//! prompt the first block is the most recently used: the LRU bound evicts a prompt's tail
//! before its head (vLLM frees a finished request's blocks tail first for the same reason: a
//! prefix outlives its extensions). An entry expires `ttl` after the last placement that
//! touched it (SGLang's router keeps a per-tenant prefix tree, pruned by LRU; this keeps a
//! time bound too, since an engine evicts under load whatever the router remembers).
//!
//! Memory is bounded: at most `max_blocks` blocks per engine (a hash-map entry and a B-tree
//! entry each, about 70 bytes); a placement beyond it evicts the least recently touched
//! blocks first and counts them (`evicted`).
//!
//! Pure: no clock, no IO; `now` is passed in and must not go backwards between calls for one
//! engine (a monotonic clock's readings).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// The default most blocks the approximate index holds per engine: 2^16 blocks (1 Mi tokens
/// at vLLM's block size of 16, above a single GPU's KV cache for most models), about 4.5 MiB
/// per engine at ~70 bytes per block.
pub(crate) const MAX_APPROX_BLOCKS_PER_ENGINE: usize = 1 << 16;

/// One engine's guessed blocks.
#[derive(Debug, Default)]
struct Part {
    /// The block size its chains were cut at (0: nothing credited yet).
    block_size: u32,
    /// Our hash → (last touched, its stamp in `order`).
    blocks: HashMap<u64, (Instant, u64), foldhash::fast::RandomState>,
    /// Stamp → our hash, oldest first.
    order: BTreeMap<u64, u64>,
    next_stamp: u64,
    /// The process (the fleet's incarnation count) these guesses belong to.
    process: Option<u64>,
    /// Blocks evicted by the per-engine bound (cumulative).
    evicted: u64,
}

impl Part {
    fn clear(&mut self) {
        self.blocks.clear();
        self.order.clear();
    }

    fn live(&self, h: u64, now: Instant, ttl: Duration) -> bool {
        self.blocks
            .get(&h)
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) < ttl)
    }

    /// Makes `h` the most recently touched entry, touched at `at`.
    fn touch(&mut self, h: u64, at: Instant) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some((_, old)) = self.blocks.insert(h, (at, stamp)) {
            self.order.remove(&old);
        }
        self.order.insert(stamp, h);
    }

    /// Evicts the least recently touched entries beyond `max`, counting them.
    fn bound(&mut self, max: usize) {
        while self.blocks.len() > max {
            let Some((_, h)) = self.order.pop_first() else {
                break;
            };
            self.blocks.remove(&h);
            self.evicted += 1;
        }
    }

    /// Drops entries touched `ttl` or longer before `now` (the oldest stamps first).
    fn expire(&mut self, now: Instant, ttl: Duration) {
        while let Some((&stamp, &h)) = self.order.first_key_value() {
            match self.blocks.get(&h) {
                Some((t, _)) if now.saturating_duration_since(*t) < ttl => break,
                _ => {
                    self.order.remove(&stamp);
                    self.blocks.remove(&h);
                }
            }
        }
    }
}

/// A snapshot of one engine's approximate part.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ApproxView {
    /// Blocks credited and not expired.
    pub blocks: u64,
    /// Blocks evicted by the per-engine bound (cumulative).
    pub evicted: u64,
}

/// The approximate index over every configured engine (config order).
#[derive(Debug)]
pub(crate) struct Approx {
    ttl: Duration,
    max_blocks: usize,
    engines: Vec<Part>,
}

impl Approx {
    /// `engines` empty parts; entries live `ttl` after their last placement (`serving.
    /// kv_approx_ttl_s`), at most `max_blocks` per engine (≥ 1).
    pub(crate) fn new(engines: usize, ttl: Duration, max_blocks: usize) -> Self {
        Approx {
            ttl,
            max_blocks: max_blocks.max(1),
            engines: (0..engines).map(|_| Part::default()).collect(),
        }
    }

    /// A request whose prompt's full-block chain at `block_size` is `chain` was placed on
    /// engine `e` at `now`: its blocks are credited to `e` (touched again when already held).
    /// A chain at another block size than the engine's earlier ones replaces them (the two
    /// cannot be matched together). Expired entries are dropped first, then the least recently
    /// touched beyond the bound.
    pub(crate) fn placed(&mut self, e: usize, chain: &[u64], block_size: u32, now: Instant) {
        let ttl = self.ttl;
        let max = self.max_blocks;
        let p = &mut self.engines[e];
        if p.block_size != block_size {
            p.clear();
            p.block_size = block_size;
        }
        p.expire(now, ttl);
        // Last block first: the prompt's head ends up most recently used.
        for h in chain.iter().rev() {
            p.touch(*h, now);
        }
        p.bound(max);
    }

    /// The block size engine `e`'s guesses were cut at (`None` before its first credit).
    pub(crate) fn block_size(&self, e: usize) -> Option<u32> {
        Some(self.engines[e].block_size).filter(|b| *b > 0)
    }

    /// Whether our hash `h` is credited to engine `e` at `now` (touched less than `ttl` ago).
    pub(crate) fn holds(&self, e: usize, h: u64, now: Instant) -> bool {
        self.engines[e].live(h, now, self.ttl)
    }

    /// Whether our hash `h` is credited to engine `e` at `now` by a placement less than
    /// `within` ago (and less than the TTL): a guess still waiting for the engine's own report.
    pub(crate) fn holds_within(&self, e: usize, h: u64, now: Instant, within: Duration) -> bool {
        self.engines[e].live(h, now, self.ttl.min(within))
    }

    /// Drops engine `e`'s guesses of the blocks `hashes` (our hashes): its own events told
    /// them, stored or removed, and exact wins over the guess.
    pub(crate) fn settle(&mut self, e: usize, hashes: &[u64]) {
        let p = &mut self.engines[e];
        for h in hashes {
            if let Some((_, stamp)) = p.blocks.remove(h) {
                p.order.remove(&stamp);
            }
        }
    }

    /// Drops engine `e`'s guesses (a gap reset, or it is another process).
    pub(crate) fn drop_engine(&mut self, e: usize) {
        self.engines[e].clear();
    }

    /// Binds engine `e`'s guesses to process `process` (the fleet's incarnation count): a
    /// new process holds none of them, so they are dropped.
    pub(crate) fn sync_process(&mut self, e: usize, process: u64) {
        let p = &mut self.engines[e];
        if p.process.is_some_and(|old| old != process) {
            p.clear();
        }
        p.process = Some(process);
    }

    /// Engine `e`'s snapshot at `now` (expired entries not counted).
    pub(crate) fn view(&self, e: usize, now: Instant) -> ApproxView {
        let p = &self.engines[e];
        ApproxView {
            blocks: p
                .blocks
                .values()
                .filter(|(t, _)| now.saturating_duration_since(*t) < self.ttl)
                .count() as u64,
            evicted: p.evicted,
        }
    }

    /// Engine `e`'s guesses live at `now`, least recently touched first, each as (our hash,
    /// its age at `now`), and the block size they were cut at; `None` before its first
    /// credit. What a router shutting down carries to the router started after it
    /// (`kv_cache::carry`).
    pub(crate) fn export(&self, e: usize, now: Instant) -> Option<(u32, Vec<(u64, Duration)>)> {
        let p = &self.engines[e];
        if p.block_size == 0 {
            return None;
        }
        let live = p
            .order
            .values()
            .filter_map(|h| {
                let (t, _) = p.blocks.get(h)?;
                let age = now.saturating_duration_since(*t);
                (age < self.ttl).then_some((*h, age))
            })
            .collect();
        Some((p.block_size, live))
    }

    /// Adds `carried` (our hash, when last touched; least recently touched first) to engine
    /// `e`'s guesses at `block_size`, bound to process `process`, as older than every guess it
    /// already holds (the router's own placements since it started win: a hash already held
    /// keeps its entry). Carried guesses at another block size than the engine's own are not
    /// taken. The per-engine bound then evicts the least recently touched. Returns the guesses
    /// taken.
    pub(crate) fn import(
        &mut self,
        e: usize,
        block_size: u32,
        carried: &[(u64, Instant)],
        process: u64,
    ) -> usize {
        let max = self.max_blocks;
        let p = &mut self.engines[e];
        if p.block_size != 0 && p.block_size != block_size {
            return 0;
        }
        if p.process.is_some_and(|old| old != process) {
            p.clear();
        }
        p.process = Some(process);
        p.block_size = block_size;
        let own: Vec<(u64, Instant)> = p
            .order
            .values()
            .filter_map(|h| p.blocks.get(h).map(|(t, _)| (*h, *t)))
            .collect();
        p.clear();
        p.next_stamp = 0;
        let mine: std::collections::HashSet<u64> = own.iter().map(|(h, _)| *h).collect();
        let fresh: Vec<(u64, Instant)> = carried
            .iter()
            .filter(|(h, _)| !mine.contains(h))
            .copied()
            .collect();
        for (h, t) in fresh.iter().chain(own.iter()) {
            p.touch(*h, *t);
        }
        p.bound(max);
        fresh
            .iter()
            .filter(|(h, _)| p.blocks.contains_key(h))
            .count()
    }

    /// Entries engine `e` holds, expired or not (memory, for tests).
    #[cfg(test)]
    pub(crate) fn entries(&self, e: usize) -> usize {
        debug_assert_eq!(self.engines[e].blocks.len(), self.engines[e].order.len());
        self.engines[e].blocks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(120);

    fn t0() -> Instant {
        narwhal_shared::Clock::now(&narwhal_shared::SystemClock)
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_placement_credits_its_blocks_to_that_engine_only() {
        let t = t0();
        let mut a = Approx::new(2, TTL, 100);
        assert_eq!(a.block_size(0), None);
        a.placed(0, &[1, 2, 3], 16, t);
        assert!([1, 2, 3].iter().all(|h| a.holds(0, *h, t)));
        assert!(!a.holds(0, 4, t));
        assert!(!a.holds(1, 1, t), "another engine holds nothing");
        assert_eq!(a.block_size(0), Some(16));
        assert_eq!(
            a.view(0, t),
            ApproxView {
                blocks: 3,
                evicted: 0
            }
        );
        // The same blocks again: touched, not duplicated.
        a.placed(0, &[1, 2], 16, t + secs(1));
        assert_eq!(a.entries(0), 3);
    }

    #[test]
    fn credit_expires_ttl_after_the_last_placement_that_touched_it() {
        let t = t0();
        let mut a = Approx::new(1, TTL, 100);
        a.placed(0, &[1, 2, 3], 16, t);
        // Block 1 and 2 are touched again at 100 s; block 3 is not.
        a.placed(0, &[1, 2], 16, t + secs(100));
        assert!(a.holds(0, 3, t + secs(119)));
        assert!(!a.holds(0, 3, t + secs(120)), "expired at exactly the TTL");
        assert!(a.holds(0, 1, t + secs(219)));
        assert!(!a.holds(0, 1, t + secs(220)));
        assert_eq!(a.view(0, t + secs(150)).blocks, 2);
        // Memory: expired entries are dropped by the next placement on the engine.
        assert_eq!(a.entries(0), 3);
        a.placed(0, &[2], 16, t + secs(150));
        assert_eq!(a.entries(0), 2, "block 3 expired at 120 s");
        a.placed(0, &[9], 16, t + secs(300));
        assert_eq!(a.entries(0), 1);
    }

    #[test]
    fn the_bound_evicts_the_least_recently_touched_and_a_prompts_tail_first() {
        let t = t0();
        let mut a = Approx::new(1, TTL, 4);
        a.placed(0, &[1, 2, 3], 16, t);
        // A second prompt of 3 blocks: 2 must go; the first prompt's tail (3, then 2) is the
        // least recently touched, its head 1 stays.
        a.placed(0, &[7, 8, 9], 16, t + secs(1));
        assert_eq!(a.entries(0), 4);
        assert!(a.holds(0, 1, t + secs(1)));
        assert!(!a.holds(0, 2, t + secs(1)) && !a.holds(0, 3, t + secs(1)));
        assert!([7, 8, 9].iter().all(|h| a.holds(0, *h, t + secs(1))));
        assert_eq!(a.view(0, t + secs(1)).evicted, 2);
        // Touching 9 again makes it the most recent: the next evictions take 1, then 8
        // (touched before 7 within its prompt), never 9.
        a.placed(0, &[9], 16, t + secs(2));
        a.placed(0, &[5], 16, t + secs(3));
        assert!(
            !a.holds(0, 1, t + secs(3)),
            "the least recently touched went"
        );
        a.placed(0, &[6], 16, t + secs(4));
        assert!(!a.holds(0, 8, t + secs(4)));
        assert!([9, 7, 5, 6].iter().all(|h| a.holds(0, *h, t + secs(4))));
        assert_eq!(a.entries(0), 4);
        assert_eq!(a.view(0, t + secs(4)).evicted, 4);
    }

    #[test]
    fn a_new_process_or_the_engines_own_events_drop_the_guesses() {
        let t = t0();
        let mut a = Approx::new(2, TTL, 100);
        a.sync_process(0, 1);
        a.sync_process(1, 1);
        a.placed(0, &[1, 2], 16, t);
        a.placed(1, &[1, 2], 16, t);
        a.sync_process(0, 1);
        assert!(a.holds(0, 1, t), "the same process keeps them");
        a.sync_process(0, 2);
        assert!(!a.holds(0, 1, t), "a new process holds none of them");
        assert_eq!(a.entries(0), 0);
        assert!(a.holds(1, 1, t), "other engines keep theirs");
        a.drop_engine(1);
        assert_eq!(a.entries(1), 0);
    }

    #[test]
    fn settled_blocks_are_no_longer_guessed_and_a_recent_guess_is_held_within_a_bound() {
        let t = t0();
        let mut a = Approx::new(2, TTL, 100);
        a.placed(0, &[1, 2, 3], 16, t);
        a.placed(1, &[1, 2, 3], 16, t);
        assert!(a.holds_within(0, 1, t + secs(9), secs(10)));
        assert!(!a.holds_within(0, 1, t + secs(10), secs(10)), "the bound");
        assert!(a.holds(0, 1, t + secs(10)), "the TTL still holds it");
        assert!(
            !a.holds_within(0, 1, t + secs(120), secs(1000)),
            "never beyond the TTL"
        );
        a.settle(0, &[1, 3, 99]);
        assert!(!a.holds(0, 1, t) && !a.holds(0, 3, t));
        assert!(a.holds(0, 2, t));
        assert_eq!(a.entries(0), 1);
        assert!(a.holds(1, 1, t), "another engine keeps its guesses");
    }

    #[test]
    fn carried_guesses_keep_their_ages_and_order_and_come_before_the_engines_own() {
        let t = t0() + secs(1000);
        let mut a = Approx::new(2, TTL, 4);
        a.placed(0, &[1, 2, 3], 16, t);
        a.placed(0, &[4], 16, t + secs(100));
        // At 150 s: 1-3 are 150 s old (expired), 4 is 50 s old.
        let (bs, live) = a.export(0, t + secs(150)).unwrap();
        assert_eq!((bs, live), (16, vec![(4, secs(50))]));
        let (_, all) = a.export(0, t + secs(110)).unwrap();
        assert_eq!(
            all.iter().map(|(h, _)| *h).collect::<Vec<_>>(),
            [3, 2, 1, 4],
            "least recently touched first (a prompt's tail before its head)"
        );
        assert_eq!(a.export(1, t), None, "nothing credited yet");

        // Engine 1 of a new router: its own placement at `now`, then the carried guesses.
        let now = t + secs(200);
        a.sync_process(1, 7);
        a.placed(1, &[9, 3], 16, now);
        let carried: Vec<(u64, Instant)> = all.iter().map(|(h, age)| (*h, now - *age)).collect();
        assert_eq!(
            a.import(1, 16, &carried, 7),
            2,
            "3 is its own already; 2 goes by the bound"
        );
        assert_eq!(a.entries(1), 4);
        assert!(a.holds(1, 9, now) && a.holds(1, 3, now) && a.holds(1, 4, now));
        assert!(
            a.holds(1, 1, now) && !a.holds(1, 2, now),
            "the least recently touched went"
        );
        // The carried ages hold: 1 was 110 s old at the export, so it expires 10 s later.
        assert!(a.holds(1, 1, now + secs(9)) && !a.holds(1, 1, now + secs(10)));
        assert!(
            a.holds(1, 3, now + secs(119)),
            "the new placement's time, not the carried one"
        );
        // Another block size is not taken; another process drops what the engine held.
        assert_eq!(a.import(1, 32, &carried, 7), 0);
        assert_eq!(a.import(1, 16, &carried[..1], 8), 1);
        assert_eq!(a.entries(1), 1);
    }

    #[test]
    fn another_block_size_replaces_the_earlier_guesses() {
        let t = t0();
        let mut a = Approx::new(1, TTL, 100);
        a.placed(0, &[1, 2], 16, t);
        a.placed(0, &[5], 4, t);
        assert_eq!(a.block_size(0), Some(4));
        assert!(!a.holds(0, 1, t));
        assert_eq!(a.entries(0), 1);
    }
}
