//! The KV block index: which prompt blocks each engine holds in its prefix cache, learned from
//! the engine's own KV events (docs/design/kv-aware-placement.md; vLLM's `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`, decoded by `narwhal_shared::kv_events`).
//!
//! ```text
//!  (engine, seq, batch) ──sequence()──► Next | Restarted | Gap{from} | Old
//!        │ Next: apply()   Restarted: restart()   Gap: the driver replays, then fill()
//!        ▼
//!  per engine: our hash → refs, engine hash → our hash, next seq, last batch, counters
//!        │ matched_tokens(engine, prompt tokens)   longest run of held blocks from the first
//!        ▼
//!  cached prompt tokens (0 unless the engine's mode is `exact`)
//! ```
//!
//! Pure: no clock, no IO; `now` is passed in. Blocks are named by **our** hash, chained over
//! (parent's our-hash, the block's token ids) from the tokens `BlockStored` carries, so an
//! engine's hash seed (random per vLLM process unless `PYTHONHASHSEED` is set) never matters and
//! a request's tokens hash the same way. Each engine keeps a map from its own hashes to ours, so
//! `BlockRemoved` (which names engine hashes) finds the block.
//!
//! Memory is bounded: at most [`MAX_BLOCKS_PER_ENGINE`] blocks per engine (two hash-map entries
//! each, about 80 bytes); stores beyond it are dropped and counted (`overflow`), which only
//! under-credits the engine.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use narwhal_shared::kv_events::{KvEvent, KvEventBatch};

/// The most blocks the index holds per engine: 2^18 blocks (4 Mi tokens at vLLM's block size
/// of 16), about 20 MiB per engine at ~80 bytes per block.
pub(crate) const MAX_BLOCKS_PER_ENGINE: usize = 1 << 18;

/// Our hash of one block: chained over the parent block's our-hash (0 for a prompt's first
/// block) and the block's token ids (splitmix64 over each word; deterministic in every process).
pub(crate) fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let mut h = mix(parent ^ 0x6b76_5f62_6c6f_636b);
    for t in tokens {
        h = mix(h ^ u64::from(*t));
    }
    mix(h ^ tokens.len() as u64)
}

/// Our hashes of a prompt's full blocks of `block_size` tokens, in order (a partial last
/// block is never cached, as in vLLM).
pub(crate) fn prompt_chain(tokens: &[u32], block_size: u32) -> Vec<u64> {
    let bs = block_size.max(1) as usize;
    let mut parent = 0;
    tokens
        .chunks_exact(bs)
        .map(|b| {
            parent = block_hash(parent, b);
            parent
        })
        .collect()
}

/// What a batch's sequence number means for the engine's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seq {
    /// The expected next batch (or the first batch of a stream, numbered 0).
    Next,
    /// A new engine process (vLLM numbers from 0 per process): numbered 0 after later numbers,
    /// or, on the live stream, numbered at or below a batch that stream already delivered
    /// (one PUB connection delivers a process's batches in order, so going back there means
    /// another process, whose first batches were missed).
    Restarted,
    /// Batches `from..seq` were missed (a first batch numbered above 0 missed `0..seq`).
    Gap {
        /// The first missed sequence number.
        from: u64,
    },
    /// Already seen (a replay overlapping the stream): ignored.
    Old,
}

/// An engine's index mode (docs/http-api.md `kv_index`; docs/design/kv-aware-placement.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// No `kv_events` configured: never credited.
    None,
    /// Configured, no batch yet from this process (at start, or after its entries were
    /// dropped for a new process): nothing to credit.
    Waiting,
    /// Batches arrive in order: its blocks are credited.
    Exact,
    /// No batch for `serving.kv_events_stale_s` after a request that had to store blocks was
    /// placed on it: not credited until the next batch.
    Stale,
}

impl Mode {
    /// The name in `/narwhal/state` and the `mode` label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Waiting => "waiting",
            Mode::Exact => "exact",
            Mode::Stale => "stale",
        }
    }

    /// Every mode, for pre-seeded metric labels.
    pub(crate) const ALL: [Mode; 4] = [Mode::None, Mode::Waiting, Mode::Exact, Mode::Stale];
}

/// Counters of one engine's stream (cumulative for the router's life).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    /// Batches applied.
    pub batches: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Gaps filled from the engine's replay socket.
    pub replays: u64,
    /// Times the engine's entries were dropped (new process, unfillable gap).
    pub resets: u64,
    /// Stored blocks dropped: the index was full, or their parent was unknown.
    pub overflow: u64,
}

/// One engine's part of the index.
#[derive(Debug, Default)]
struct Engine {
    configured: bool,
    /// Our hash → how many engine hashes name it.
    blocks: HashMap<u64, u32>,
    /// Engine hash → our hash.
    by_engine: HashMap<u64, u64>,
    block_size: Option<u32>,
    next_seq: Option<u64>,
    /// The highest sequence number the live stream (not a replay) delivered.
    last_live: Option<u64>,
    last_batch: Option<Instant>,
    /// A request that must store blocks was placed here at this time, and no batch came since.
    awaiting: Option<Instant>,
    /// The process (the fleet's incarnation) these entries belong to.
    process: Option<u64>,
    counters: Counters,
}

impl Engine {
    fn clear(&mut self) {
        self.blocks.clear();
        self.by_engine.clear();
    }

    fn remove(&mut self, engine_hash: u64) {
        if let Some(ours) = self.by_engine.remove(&engine_hash)
            && let Some(n) = self.blocks.get_mut(&ours)
        {
            *n -= 1;
            if *n == 0 {
                self.blocks.remove(&ours);
            }
        }
    }

    fn store(&mut self, hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) {
        let bs = block_size.max(1) as usize;
        let mut prev = match parent {
            None => 0,
            Some(p) => match self.by_engine.get(&p) {
                Some(ours) => *ours,
                None => {
                    // A parent we never saw stored: these blocks cannot be a prefix we know.
                    self.counters.overflow += hashes.len() as u64;
                    return;
                }
            },
        };
        self.block_size = Some(block_size);
        for (h, block) in hashes.iter().zip(tokens.chunks_exact(bs)) {
            let ours = block_hash(prev, block);
            prev = ours;
            if self.by_engine.contains_key(h) {
                continue;
            }
            if self.by_engine.len() >= MAX_BLOCKS_PER_ENGINE {
                self.counters.overflow += 1;
                continue;
            }
            self.by_engine.insert(*h, ours);
            *self.blocks.entry(ours).or_insert(0) += 1;
        }
    }

    fn apply(&mut self, seq: u64, batch: &KvEventBatch, now: Instant) {
        for e in &batch.events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    ..
                } => self.store(block_hashes, *parent_block_hash, token_ids, *block_size),
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for h in block_hashes {
                        self.remove(*h);
                    }
                }
                KvEvent::AllBlocksCleared => self.clear(),
            }
        }
        self.next_seq = Some(seq + 1);
        self.last_batch = Some(now);
        self.awaiting = None;
        self.counters.batches += 1;
    }
}

/// A snapshot of one engine for `/narwhal/state` and `/metrics`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EngineView {
    /// Its mode now.
    pub mode: Mode,
    /// Seconds since its last batch; `None` before the first.
    pub lag_s: Option<f64>,
    /// Blocks held.
    pub blocks: u64,
    /// Its stream's counters.
    pub counters: Counters,
}

/// The index over every configured engine (config order).
#[derive(Debug)]
pub(crate) struct KvIndex {
    engines: Vec<Engine>,
}

impl KvIndex {
    /// One slot per engine; `configured[i]`: engine `i` has `kv_events`.
    pub(crate) fn new(configured: &[bool]) -> Self {
        KvIndex {
            engines: configured
                .iter()
                .map(|c| Engine {
                    configured: *c,
                    ..Engine::default()
                })
                .collect(),
        }
    }

    /// What sequence number `seq` means for engine `e`'s stream; `live`: it came on the live
    /// stream (a replayed batch below the expected one is only an overlap).
    pub(crate) fn sequence(&self, e: usize, seq: u64, live: bool) -> Seq {
        let en = &self.engines[e];
        if live && en.last_live.is_some_and(|l| seq <= l) {
            return Seq::Restarted;
        }
        match en.next_seq {
            None if seq == 0 => Seq::Next,
            None => Seq::Gap { from: 0 },
            Some(n) if seq == n => Seq::Next,
            Some(_) if seq == 0 => Seq::Restarted,
            Some(n) if seq < n => Seq::Old,
            Some(n) => Seq::Gap { from: n },
        }
    }

    /// Applies the expected batch `seq` of engine `e`.
    pub(crate) fn apply(&mut self, e: usize, seq: u64, batch: &KvEventBatch, now: Instant) {
        self.engines[e].apply(seq, batch, now);
    }

    /// Records that the live stream delivered batch `seq` of engine `e` (after it was handled).
    pub(crate) fn note_live(&mut self, e: usize, seq: u64) {
        self.engines[e].last_live = Some(seq);
    }

    /// A new process's first batch seen (`seq` back to 0, or back on the live stream): its
    /// entries are dropped, then the batch applied (a new process's batches before it that were
    /// missed only under-credit the engine).
    pub(crate) fn restart(&mut self, e: usize, seq: u64, batch: &KvEventBatch, now: Instant) {
        let en = &mut self.engines[e];
        en.clear();
        en.counters.resets += 1;
        en.apply(seq, batch, now);
    }

    /// Batch `seq` arrived after a gap from `from`: `replayed` is what the engine's replay
    /// socket gave (`None`: no replay socket, or it failed). When it holds every batch
    /// `from..seq` they are applied in order, then `batch`; otherwise the engine's entries are
    /// dropped (a missed `BlockRemoved` would credit blocks it no longer holds) and `batch`
    /// starts the rebuild. Returns whether the gap was filled.
    pub(crate) fn fill(
        &mut self,
        e: usize,
        from: u64,
        replayed: Option<&[(u64, KvEventBatch)]>,
        seq: u64,
        batch: &KvEventBatch,
        now: Instant,
    ) -> bool {
        let en = &mut self.engines[e];
        en.counters.gaps += 1;
        let wanted: Option<Vec<&(u64, KvEventBatch)>> =
            replayed.map(|r| r.iter().filter(|(s, _)| (from..seq).contains(s)).collect());
        let complete = wanted.as_ref().is_some_and(|w| {
            w.len() as u64 == seq - from && w.iter().zip(from..).all(|((s, _), want)| *s == want)
        });
        if complete {
            en.counters.replays += 1;
            for (s, b) in wanted.unwrap_or_default() {
                en.apply(*s, b, now);
            }
        } else if en.next_seq.is_some() {
            en.clear();
            en.counters.resets += 1;
        }
        en.apply(seq, batch, now);
        complete
    }

    /// Binds engine `e`'s entries to process `process` (the fleet's incarnation count): when it
    /// differs from the one they were learned under, they are dropped and the stream starts
    /// again (the engine is `waiting` until its new process publishes).
    pub(crate) fn sync_process(&mut self, e: usize, process: u64) {
        let en = &mut self.engines[e];
        if en.process.is_some_and(|p| p != process) {
            en.clear();
            en.counters.resets += 1;
            en.next_seq = None;
            en.last_batch = None;
            en.awaiting = None;
        }
        en.process = Some(process);
    }

    /// Drops engine `e`'s entries and restarts its stream (a batch that could not be decoded:
    /// what it held is unknown).
    pub(crate) fn reset(&mut self, e: usize) {
        let en = &mut self.engines[e];
        en.clear();
        en.counters.resets += 1;
        en.next_seq = None;
        en.last_batch = None;
        en.awaiting = None;
    }

    /// A request was placed on `e`; `stores` when its prompt has full blocks `e` does not hold
    /// (the engine must publish a `BlockStored`), which starts the stale clock.
    pub(crate) fn placed(&mut self, e: usize, stores: bool, now: Instant) {
        let en = &mut self.engines[e];
        if stores && en.configured && en.awaiting.is_none() {
            en.awaiting = Some(now);
        }
    }

    /// Engine `e`'s mode at `now` (stale after `stale_after` without a batch while awaited).
    pub(crate) fn mode(&self, e: usize, now: Instant, stale_after: Duration) -> Mode {
        let en = &self.engines[e];
        if !en.configured {
            Mode::None
        } else if en.last_batch.is_none() {
            Mode::Waiting
        } else if en
            .awaiting
            .is_some_and(|t| now.saturating_duration_since(t) > stale_after)
        {
            Mode::Stale
        } else {
            Mode::Exact
        }
    }

    /// The sequence number engine `e`'s stream expects next (`None` before its first batch).
    pub(crate) fn next_seq(&self, e: usize) -> Option<u64> {
        self.engines[e].next_seq
    }

    /// Engine `e`'s block size, once it stored a block.
    pub(crate) fn block_size(&self, e: usize) -> Option<u32> {
        self.engines[e].block_size
    }

    /// Prompt tokens engine `e` holds for a prompt whose full-block chain at its block size is
    /// `chain`: the longest run of held blocks from the first, at most `(prompt_tokens − 1) /
    /// block_size` blocks (vLLM always computes the last prompt token), times the block size.
    pub(crate) fn matched_tokens(&self, e: usize, chain: &[u64], prompt_tokens: u64) -> u64 {
        let en = &self.engines[e];
        let Some(bs) = en.block_size else { return 0 };
        let cap = (prompt_tokens.saturating_sub(1) / u64::from(bs.max(1))) as usize;
        let run = chain
            .iter()
            .take(cap)
            .take_while(|h| en.blocks.contains_key(h))
            .count();
        run as u64 * u64::from(bs)
    }

    /// A snapshot of engine `e`.
    pub(crate) fn view(&self, e: usize, now: Instant, stale_after: Duration) -> EngineView {
        let en = &self.engines[e];
        EngineView {
            mode: self.mode(e, now, stale_after),
            lag_s: en
                .last_batch
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
            blocks: en.blocks.len() as u64,
            counters: en.counters,
        }
    }

    /// Engines in the index.
    pub(crate) fn len(&self) -> usize {
        self.engines.len()
    }
}

#[cfg(test)]
mod tests;
