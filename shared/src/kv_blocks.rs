//! An engine's current KV block set, as its own events tell it (pure: no sockets, no clock).
//! The agent next to each engine keeps one, so that a router that joins after the engine's
//! replay buffer moved on (vLLM keeps its last `buffer_steps` batches, 10,000 by default, and
//! never announces a block it still holds again) still learns every block the engine holds:
//! it takes a snapshot and follows the live stream from the sequence number the snapshot is
//! current to (docs/design/kv-aware-placement.md, "Beyond the replay buffer").
//!
//! ```text
//! batch seq ──step──► Next      apply
//!                     Restarted a new process (seq 0 again): drop everything, apply
//!                     Old       already applied (a replay's overlap): ignore
//!                     Gap{from} the driver replays from `from`: applied in order when it
//!                               holds them all, else rebuild (drop, apply; incomplete)
//! snapshot ─► one BlockStored per block, each block's parent before it, and the sequence
//!             number the set is current to (the next batch it expects)
//! ```
//!
//! Blocks are kept per KV cache group (a hybrid model publishes the same hashes in each), as
//! their events carried them (tokens, block size, adapter, salt, extra keys, the group's
//! kind), and only for the GPU tier: a lower tier's events (vLLM's CPU offloading, SGLang's
//! host cache) and unknown event types are skipped. A consumer applies a snapshot as it
//! applies the events it is made of.

use std::collections::HashMap;

use crate::kv_events::{ExtraKey, KvEvent, KvEventBatch, MEDIUM_GPU};

/// What a batch's sequence number means for the set ([`BlockSet::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The next batch (or the first, numbered 0): apply it.
    Next,
    /// Numbered 0 after later ones: a new engine process; drop everything, then apply.
    Restarted,
    /// Already applied.
    Old,
    /// Batches `from..seq` are missing: replay them, then apply.
    Gap {
        /// The first missing sequence number.
        from: u64,
    },
}

/// What batch `seq` of a stream means when `next_seq` is the one expected (`None` before the
/// first): the one rule of the router's index and the agent's block set.
pub fn step_after(next_seq: Option<u64>, seq: u64) -> Step {
    match next_seq {
        None if seq == 0 => Step::Next,
        None => Step::Gap { from: 0 },
        Some(n) if seq == n => Step::Next,
        Some(_) if seq == 0 => Step::Restarted,
        Some(n) if seq < n => Step::Old,
        Some(n) => Step::Gap { from: n },
    }
}

/// One block as its `BlockStored` described it.
#[derive(Debug, Clone, PartialEq)]
struct Block {
    parent: Option<u64>,
    tokens: Vec<u32>,
    block_size: u32,
    lora_name: Option<String>,
    cache_salt: Option<String>,
    extra: Option<Vec<ExtraKey>>,
    group: Option<u32>,
    kind: Option<String>,
}

/// A snapshot of the set: what a late consumer applies before the live stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// The sequence number of the next batch the set expects: it holds what every batch
    /// below it stored and did not remove.
    pub next_seq: u64,
    /// Whether the set was built from the stream's first batch (sequence 0) with no gap left
    /// unfilled: it is every block the engine holds. An incomplete set (its follower joined
    /// after the engine's buffer moved on) misses blocks stored before, never holds one the
    /// engine dropped.
    pub complete: bool,
    /// One `BlockStored` per block, a block's parent before it.
    pub batch: KvEventBatch,
}

/// The block set of one engine (one data-parallel rank).
#[derive(Debug, Clone)]
pub struct BlockSet {
    blocks: HashMap<(u32, u64), Block>,
    next_seq: Option<u64>,
    complete: bool,
    max_blocks: usize,
    /// Stores dropped at the bound.
    overflow: u64,
}

impl BlockSet {
    /// An empty set holding at most `max_blocks` blocks (further stores are dropped and
    /// counted: only an under-count).
    pub fn new(max_blocks: usize) -> Self {
        BlockSet {
            blocks: HashMap::new(),
            next_seq: None,
            complete: false,
            max_blocks,
            overflow: 0,
        }
    }

    /// What batch `seq` means (see [`Step`]).
    pub fn step(&self, seq: u64) -> Step {
        step_after(self.next_seq, seq)
    }

    /// Applies batch `seq` as the next one (a set that had none yet is complete when `seq` is
    /// 0: the stream's first batch).
    pub fn apply(&mut self, seq: u64, batch: &KvEventBatch) {
        if self.next_seq.is_none() {
            self.complete = seq == 0;
        }
        for e in &batch.events {
            self.event(e);
        }
        self.next_seq = Some(seq.saturating_add(1));
    }

    /// Batch `seq` of a new process (or the first a rebuild starts from): everything held is
    /// dropped first. Complete when `seq` is 0.
    pub fn restart(&mut self, seq: u64, batch: &KvEventBatch) {
        self.blocks.clear();
        self.next_seq = None;
        self.apply(seq, batch);
    }

    /// Forgets everything (the engine's process changed): the next batch starts the set again.
    pub fn reset(&mut self) {
        self.blocks.clear();
        self.next_seq = None;
        self.complete = false;
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Stores dropped at the bound, cumulative.
    pub fn overflow(&self) -> u64 {
        self.overflow
    }

    /// The next batch expected; `None` before the first.
    pub fn next_seq(&self) -> Option<u64> {
        self.next_seq
    }

    fn event(&mut self, e: &KvEvent) {
        let gpu = |m: &Option<String>| m.as_deref().is_none_or(|m| m == MEDIUM_GPU);
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
                cache_salt,
                ..
            } if gpu(medium) && !token_ids.is_empty() => {
                let bs = (*block_size).max(1) as usize;
                let mut parent = *parent_block_hash;
                for (i, (h, tokens)) in block_hashes
                    .iter()
                    .zip(token_ids.chunks_exact(bs))
                    .enumerate()
                {
                    let key = (group_idx.unwrap_or(0), *h);
                    if !self.blocks.contains_key(&key) && self.blocks.len() >= self.max_blocks {
                        self.overflow += 1;
                    } else {
                        self.blocks.insert(
                            key,
                            Block {
                                parent,
                                tokens: tokens.to_vec(),
                                block_size: *block_size,
                                lora_name: lora_name.clone(),
                                cache_salt: cache_salt.clone(),
                                extra: extra_keys
                                    .as_ref()
                                    .and_then(|k| k.get(i).cloned())
                                    .flatten(),
                                group: *group_idx,
                                kind: kv_cache_spec_kind.clone(),
                            },
                        );
                    }
                    parent = Some(*h);
                }
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } if gpu(medium) => {
                for h in block_hashes {
                    self.blocks.remove(&(group_idx.unwrap_or(0), *h));
                }
            }
            KvEvent::AllBlocksCleared => self.blocks.clear(),
            _ => {}
        }
    }

    /// The set as one batch of `BlockStored` events (each block's parent before it, groups in
    /// order), `ts` its timestamp; `None` before the first batch.
    pub fn snapshot(&self, ts: f64) -> Option<Snapshot> {
        let next_seq = self.next_seq?;
        // A block's depth: how many of its ancestors the set holds (a block whose parent is
        // gone is a root here; a consumer that never saw its parent skips it).
        let mut depth: HashMap<(u32, u64), u32> = HashMap::with_capacity(self.blocks.len());
        for key in self.blocks.keys() {
            let mut chain = vec![*key];
            let mut d = loop {
                let k = *chain.last().unwrap_or(key);
                if let Some(d) = depth.get(&k) {
                    chain.pop();
                    break *d;
                }
                match self.blocks.get(&k).and_then(|b| b.parent) {
                    Some(p)
                        if self.blocks.contains_key(&(k.0, p))
                            && chain.len() <= self.blocks.len() =>
                    {
                        chain.push((k.0, p));
                    }
                    _ => {
                        depth.insert(k, 0);
                        chain.pop();
                        break 0;
                    }
                }
            };
            while let Some(k) = chain.pop() {
                d += 1;
                depth.insert(k, d);
            }
        }
        let mut order: Vec<(&(u32, u64), &Block)> = self.blocks.iter().collect();
        order.sort_by_key(|(k, _)| (k.0, depth.get(k).copied().unwrap_or(0), k.1));
        let events = order
            .into_iter()
            .map(|((_, h), b)| KvEvent::BlockStored {
                block_hashes: vec![*h],
                parent_block_hash: b.parent,
                token_ids: b.tokens.clone(),
                block_size: b.block_size,
                lora_id: None,
                medium: Some(MEDIUM_GPU.to_string()),
                lora_name: b.lora_name.clone(),
                extra_keys: b.extra.clone().map(|k| vec![Some(k)]),
                group_idx: b.group,
                kv_cache_spec_kind: b.kind.clone(),
                session_id: None,
                cache_salt: b.cache_salt.clone(),
            })
            .collect();
        Some(Snapshot {
            next_seq,
            complete: self.complete,
            batch: KvEventBatch {
                ts,
                events,
                data_parallel_rank: None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, first_token: u32) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: (first_token..first_token + 4 * hashes.len() as u32).collect(),
            block_size: 4,
            lora_id: None,
            medium: Some(MEDIUM_GPU.into()),
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            session_id: None,
            cache_salt: None,
        }
    }

    fn batch(events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        }
    }

    /// The sequence rules, transition by transition.
    #[test]
    fn sequence_numbers_say_next_old_gap_or_a_new_process() {
        let mut s = BlockSet::new(100);
        assert_eq!(s.step(0), Step::Next);
        assert_eq!(s.step(5), Step::Gap { from: 0 });
        s.apply(0, &batch(vec![]));
        assert_eq!(s.step(1), Step::Next);
        assert_eq!(s.step(3), Step::Gap { from: 1 });
        s.apply(1, &batch(vec![]));
        assert_eq!(s.step(1), Step::Old);
        assert_eq!(s.step(0), Step::Restarted);
    }

    /// A snapshot holds what was stored and not removed, parents first, as events a consumer
    /// applies; a block stored again is one block; a lower tier, another medium's removal and
    /// a clear are applied as the engine meant them; complete only from sequence 0.
    #[test]
    fn a_snapshot_is_the_held_blocks_parents_first() {
        let mut s = BlockSet::new(100);
        s.apply(
            0,
            &batch(vec![
                stored(&[40], Some(31), 16),
                stored(&[30, 31], Some(20), 8),
                stored(&[20], None, 0),
            ]),
        );
        let cpu = KvEvent::BlockRemoved {
            block_hashes: vec![30],
            medium: Some("CPU".into()),
            group_idx: None,
        };
        s.apply(1, &batch(vec![stored(&[20], None, 0), cpu]));
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![31],
            medium: Some(MEDIUM_GPU.into()),
            group_idx: None,
        };
        s.apply(2, &batch(vec![removed]));
        let snap = s.snapshot(1.0).expect("a snapshot");
        assert_eq!(snap.next_seq, 3);
        assert!(snap.complete);
        let order: Vec<(u64, Option<u64>)> = snap
            .batch
            .events
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    ..
                } => (block_hashes[0], *parent_block_hash),
                other => panic!("{other:?}"),
            })
            .collect();
        // 31 is gone (removed): 40 is a root here, after its own ancestors' depth order.
        assert_eq!(order, [(20, None), (40, Some(31)), (30, Some(20))]);
        // A new process: everything goes.
        s.restart(0, &batch(vec![stored(&[7], None, 0)]));
        assert_eq!(s.len(), 1);
        s.apply(1, &batch(vec![KvEvent::AllBlocksCleared]));
        assert!(s.is_empty());
        // Joined late: incomplete, and a bound drops (and counts) what does not fit.
        let mut late = BlockSet::new(1);
        late.apply(9, &batch(vec![stored(&[1, 2], None, 0)]));
        let snap = late.snapshot(0.0).expect("a snapshot");
        assert!(!snap.complete);
        assert_eq!((late.len(), late.overflow()), (1, 1));
        assert!(BlockSet::new(1).snapshot(0.0).is_none());
    }
}
