//! The engine's block prefix cache, after vLLM's V1 `BlockPool` (vLLM 0.32.0): a prompt is cut
//! into full blocks of `--block-size` tokens, each named by a hash chained over (parent hash,
//! the block's token ids); the longest run of cached blocks from the start is a hit, the rest is
//! computed and its full blocks are stored. Capacity is `--kv-cache-blocks`; when full, the
//! least recently used block is evicted. Pure (no clock, no I/O): the caller publishes the
//! [`KvEvent`]s a store or reset returns (docs/engine-simulator.md, "Prefix cache").
//!
//! ```text
//! lookup(prompt)  hit = cached leading blocks, at most (len - 1) / block_size of them (vLLM
//!                 leaves the last prompt token to compute); counts queries (prompt tokens)
//!                 and hits (hit tokens), refreshes the hit blocks
//! store(prompt)   the full blocks after the hit → BlockRemoved per evicted block, then one
//!                 BlockStored for them all
//! reset()         drops every block → AllBlocksCleared
//! ```
//!
//! With `--kv-pool` the capacity is also where running requests live, as in vLLM's one
//! `BlockPool`: [`PrefixCache::admit`] looks the prompt up when the request is scheduled,
//! pins its hit blocks, stores (and pins) its other full prompt blocks at once (vLLM hashes them
//! when it allocates them, before the forward pass) and holds the rest, its partial last block
//! and its output, as blocks no one else can use; it refuses (the request waits) when they do
//! not fit beside what running requests hold, evicting only unpinned cached blocks, least
//! recently freed first. [`PrefixCache::release`] gives them back: the pinned blocks stay cached,
//! evictable, the others are free.
//! ```text
//! admit(prompt, out)  pinned: hit + stored full blocks; private: ⌈(len + out) / B⌉ − full
//!                     fits when new + private ≤ capacity − cached − private held + evictable
//! release(held)       unpin (tail first, as vLLM frees), private held −= private
//! ```

use std::collections::{BTreeMap, HashMap};

use narwhal_testkit::kv_events::{ExtraKey, KvEvent, MEDIUM_GPU};

/// What a request's blocks are keyed by beyond their tokens, as vLLM 0.32 keys them
/// (`kv_cache_utils.generate_block_hash_extra_keys`): the LoRA adapter on every block, each
/// image on the blocks its placeholder tokens fall in, the `cache_salt` on the prompt's first
/// block. (Prompt embeddings, which vLLM keys too, are not simulated.)
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Keys {
    /// The adapter's name (the request's `model` naming one of `--lora-modules`).
    pub(crate) lora: Option<String>,
    /// The request's `cache_salt`.
    pub(crate) salt: Option<String>,
    /// The prompt's images, in prompt order.
    pub(crate) media: Vec<Media>,
}

/// One multimodal item of a prompt: vLLM's `mm_feature` (`identifier`, `mm_position`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Media {
    /// What keys it: vLLM hashes the processed item (or takes the request's
    /// `multi_modal_uuids`); the simulator hashes the image's URL.
    pub(crate) identifier: String,
    /// Its first placeholder token's index in the prompt.
    pub(crate) start: usize,
    /// Its placeholder tokens.
    pub(crate) len: usize,
}

impl Keys {
    /// The images whose placeholders fall in block `i` (of `bs` tokens), with their offset
    /// from the block's start (negative when the image began in an earlier block), as vLLM's
    /// `_gen_mm_extra_hash_keys` keys a block.
    fn media_of(&self, i: usize, bs: usize) -> impl Iterator<Item = (&str, i64)> {
        let (lo, hi) = (i * bs, (i + 1) * bs);
        self.media
            .iter()
            .filter(move |m| m.start < hi && m.start + m.len > lo)
            .map(move |m| (m.identifier.as_str(), m.start as i64 - lo as i64))
    }

    /// Block `i`'s extra keys as its hash takes them: tagged with their source, as vLLM's
    /// `hash_block_tokens` does (`("lora", name, path)`, `("mm", identifier, offset)`,
    /// `("cache_salt", salt)`), so a salt equal to an adapter's name is another key.
    fn tagged(&self, i: usize, bs: usize) -> Vec<(&'static str, String)> {
        self.lora
            .iter()
            .map(|l| ("lora", l.clone()))
            .chain(
                self.media_of(i, bs)
                    .map(|(id, off)| ("mm", format!("{id}@{off}"))),
            )
            .chain(
                self.salt
                    .iter()
                    .filter(|_| i == 0)
                    .map(|s| ("cache_salt", s.clone())),
            )
            .collect()
    }

    /// `e` as SGLang 0.5 publishes it (`sglang/srt/mem_cache/events.py`,
    /// `KVCacheEventRecorder.record_store`): no `extra_keys` and no `group_idx`; the salt in
    /// `cache_salt` on every store of a salted prefix (its radix tree keys the whole prefix by
    /// it), the adapter in `lora_name`. Removals and clears are the same events.
    pub(crate) fn as_sglang(&self, e: KvEvent) -> KvEvent {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                ..
            } => KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id: None,
                medium,
                lora_name,
                extra_keys: None,
                group_idx: None,
                kv_cache_spec_kind: None,
                session_id: None,
                cache_salt: self.salt.clone(),
            },
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                ..
            } => KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx: None,
            },
            other => other,
        }
    }

    /// Block `i`'s extra keys as its `BlockStored` publishes them: untagged, in vLLM's order
    /// (adapter, `[identifier, offset]` per image, then salt; `to_event_extra_keys`), `None`
    /// when it has none.
    fn of_block(&self, i: usize, bs: usize) -> Option<Vec<ExtraKey>> {
        let keys: Vec<ExtraKey> = self
            .lora
            .iter()
            .map(|l| ExtraKey::Text(l.clone()))
            .chain(self.media_of(i, bs).map(|(id, offset)| ExtraKey::Media {
                identifier: id.to_string(),
                offset,
            }))
            .chain(
                self.salt
                    .iter()
                    .filter(|_| i == 0)
                    .map(|s| ExtraKey::Text(s.clone())),
            )
            .collect();
        (!keys.is_empty()).then_some(keys)
    }
}

fn mix_str(mut h: u64, s: &str) -> u64 {
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    mix(h, s.len() as u64)
}

/// Counters of one cache, as `/sim/stats` `prefix_cache` shows them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct CacheCounters {
    /// Blocks held now.
    pub(crate) blocks: u64,
    /// Capacity in blocks (`--kv-cache-blocks`).
    pub(crate) capacity: u64,
    /// Prompt tokens looked up (vLLM's `prefix_cache_queries`).
    pub(crate) queries: u64,
    /// Prompt tokens found cached (vLLM's `prefix_cache_hits`).
    pub(crate) hits: u64,
    /// Blocks stored.
    pub(crate) stored: u64,
    /// Blocks evicted to make room.
    pub(crate) evictions: u64,
    /// `POST /reset_prefix_cache` calls that cleared the cache.
    pub(crate) resets: u64,
}

impl CacheCounters {
    /// Another data-parallel rank's counters added to these (an engine's counters are its
    /// ranks' sums; resets count once per call, not per rank).
    pub(crate) fn add(self, o: CacheCounters) -> CacheCounters {
        CacheCounters {
            blocks: self.blocks + o.blocks,
            capacity: self.capacity + o.capacity,
            queries: self.queries + o.queries,
            hits: self.hits + o.hits,
            stored: self.stored + o.stored,
            evictions: self.evictions + o.evictions,
            resets: self.resets.max(o.resets),
        }
    }
}

/// The result of [`PrefixCache::lookup`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Lookup {
    /// Block hashes of the prompt's full blocks, in order.
    pub(crate) hashes: Vec<u64>,
    /// Leading blocks found cached.
    pub(crate) hit_blocks: usize,
    /// What the blocks were keyed by beyond their tokens.
    pub(crate) keys: Keys,
    /// Tokens those blocks hold (`hit_blocks × block_size`).
    pub(crate) hit_tokens: usize,
    /// The data-parallel rank whose cache was looked up (0 with one rank); the store goes
    /// to the same rank.
    pub(crate) rank: usize,
    /// Its blocks were stored when it was admitted ([`PrefixCache::admit`]): nothing is left
    /// to store once it is computed.
    pub(crate) stored: bool,
}

/// One engine process's prefix cache.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    block_size: usize,
    capacity: usize,
    enabled: bool,
    seed: u64,
    /// Block hash → its recency tick (a key of `lru`).
    blocks: HashMap<u64, u64>,
    /// Recency tick → block hash; the smallest tick is evicted first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    counters: CacheCounters,
    /// Cached blocks running requests hold (`--kv-pool`), by how many hold each: never
    /// evicted.
    pins: HashMap<u64, u32>,
    /// Blocks running requests hold outside the cache: partial prompt blocks and output.
    private: usize,
}

/// What a running request holds of the pool ([`PrefixCache::admit`]), given back with
/// [`PrefixCache::release`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Held {
    /// Its cached prompt blocks, in prompt order.
    pinned: Vec<u64>,
    /// Its other blocks.
    private: usize,
}

const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn mix(mut h: u64, v: u64) -> u64 {
    for b in v.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// SplitMix64's finaliser: spreads the FNV state over all 64 bits.
fn finish(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl PrefixCache {
    /// A cache of `capacity` blocks of `block_size` tokens; `seed` starts every hash chain
    /// (vLLM's `NONE_HASH`). Disabled (`--no-enable-prefix-caching`), it never hits or stores.
    pub(crate) fn new(block_size: usize, capacity: usize, enabled: bool, seed: u64) -> Self {
        PrefixCache {
            block_size: block_size.max(1),
            capacity,
            enabled,
            seed,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            counters: CacheCounters {
                capacity: capacity as u64,
                ..CacheCounters::default()
            },
            pins: HashMap::new(),
            private: 0,
        }
    }

    /// The hash chain of `prompt`'s full blocks, each block's extra `keys` hashed with its
    /// tokens as vLLM's `hash_block_tokens` does.
    pub(crate) fn hashes(&self, prompt: &[u32], keys: &Keys) -> Vec<u64> {
        let mut parent = self.seed;
        prompt
            .chunks_exact(self.block_size)
            .enumerate()
            .map(|(i, block)| {
                let mut h = mix(0xcbf2_9ce4_8422_2325, parent);
                for t in block {
                    h = mix(h, u64::from(*t));
                }
                for (tag, k) in keys.tagged(i, self.block_size) {
                    h = mix_str(mix_str(h, tag), &k);
                }
                parent = finish(h);
                parent
            })
            .collect()
    }

    fn touch(&mut self, hash: u64) {
        if let Some(old) = self.blocks.get(&hash) {
            self.lru.remove(old);
        }
        self.tick += 1;
        self.blocks.insert(hash, self.tick);
        self.lru.insert(self.tick, hash);
    }

    /// Refreshes `hashes` so that the first is used most recently: vLLM frees a request's
    /// blocks tail first, so its last blocks are evicted before its prefix.
    fn touch_all(&mut self, hashes: &[u64]) {
        for h in hashes.iter().rev() {
            self.touch(*h);
        }
    }

    /// Looks `prompt`, keyed beyond its tokens by `keys`, up: counts it and refreshes the
    /// blocks it hits.
    pub(crate) fn lookup(&mut self, prompt: &[u32], keys: &Keys) -> Lookup {
        let l = self.peek(prompt, keys);
        self.record(prompt, &l);
        l
    }

    /// Counts a lookup (queries, hits) and refreshes the blocks it hit: vLLM records a
    /// request's lookup once, when it is admitted.
    fn record(&mut self, prompt: &[u32], l: &Lookup) {
        if !self.enabled {
            return;
        }
        self.touch_all(&l.hashes[..l.hit_blocks]);
        self.counters.queries += prompt.len() as u64;
        self.counters.hits += l.hit_tokens as u64;
    }

    /// The lookup of `prompt` without counting it or refreshing anything.
    fn peek(&self, prompt: &[u32], keys: &Keys) -> Lookup {
        let hashes = self.hashes(prompt, keys);
        if !self.enabled {
            return Lookup {
                rank: 0,
                hashes,
                hit_blocks: 0,
                hit_tokens: 0,
                keys: keys.clone(),
                stored: false,
            };
        }
        let max_blocks = prompt.len().saturating_sub(1) / self.block_size;
        let hit_blocks = hashes
            .iter()
            .take(max_blocks)
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        Lookup {
            rank: 0,
            hashes,
            hit_blocks,
            hit_tokens: hit_blocks * self.block_size,
            keys: keys.clone(),
            stored: false,
        }
    }

    /// Stores the full blocks of `prompt` after `lookup`'s hit, evicting least recently used
    /// blocks of other prompts when the cache is full. Returns the events in vLLM's order:
    /// one `BlockRemoved` per evicted block, then one `BlockStored` for the new blocks (none
    /// when there were none, or the cache is disabled).
    pub(crate) fn store(&mut self, prompt: &[u32], lookup: &Lookup) -> Vec<KvEvent> {
        let mut events = Vec::new();
        if !self.enabled || self.capacity == 0 {
            return events;
        }
        let mine: std::collections::HashSet<u64> = lookup.hashes.iter().copied().collect();
        let mut stored = Vec::new();
        for h in &lookup.hashes[lookup.hit_blocks..] {
            if !self.blocks.contains_key(h) && self.blocks.len() + self.private >= self.capacity {
                let Some(removed) = self.evict_one(&mine) else {
                    break; // the prompt alone fills the cache
                };
                events.push(removed);
            }
            self.touch(*h);
            stored.push(*h);
        }
        self.touch_all(&lookup.hashes[..lookup.hit_blocks + stored.len()]);
        if !stored.is_empty() {
            let bs = self.block_size;
            let first = lookup.hit_blocks;
            self.counters.stored += stored.len() as u64;
            events.push(KvEvent::BlockStored {
                parent_block_hash: first.checked_sub(1).map(|i| lookup.hashes[i]),
                token_ids: prompt[first * bs..(first + stored.len()) * bs].to_vec(),
                // vLLM publishes one entry per block, untagged (`to_event_extra_keys`).
                extra_keys: Some(
                    (first..first + stored.len())
                        .map(|i| lookup.keys.of_block(i, bs))
                        .collect(),
                ),
                block_hashes: stored,
                block_size: bs as u32,
                lora_id: None,
                medium: Some(MEDIUM_GPU.to_string()),
                lora_name: lookup.keys.lora.clone(),
                group_idx: Some(0),
                // vLLM's `KVCacheManager.take_events` names every store's group kind.
                kv_cache_spec_kind: Some("full_attention".to_string()),
                session_id: None,
                cache_salt: None,
            });
        }
        events
    }

    /// Evicts the least recently used cached block that no running request pins and that is
    /// not in `mine`: its `BlockRemoved`, or `None` when there is none.
    fn evict_one(&mut self, mine: &std::collections::HashSet<u64>) -> Option<KvEvent> {
        let (tick, victim) = self
            .lru
            .iter()
            .find(|(_, v)| !mine.contains(v) && !self.pins.contains_key(v))
            .map(|(t, v)| (*t, *v))?;
        self.lru.remove(&tick);
        self.blocks.remove(&victim);
        self.counters.evictions += 1;
        Some(KvEvent::BlockRemoved {
            block_hashes: vec![victim],
            medium: Some(MEDIUM_GPU.to_string()),
            group_idx: Some(0),
        })
    }

    /// Cached blocks no running request pins (what an admission may evict).
    fn evictable(&self) -> usize {
        self.blocks.len() - self.pins.len()
    }

    /// Whether a reset is refused because running requests hold blocks (`--kv-pool`).
    pub(crate) fn refuses_reset(&self) -> bool {
        self.enabled && self.used() > 0
    }

    /// Whether a request of `tokens` (prompt and output) can ever fit the pool: vLLM refuses to
    /// start with a `max_model_len` its KV cache cannot hold.
    pub(crate) fn fits_ever(&self, tokens: usize) -> bool {
        tokens.div_ceil(self.block_size) <= self.capacity
    }

    /// Blocks running requests hold: pinned cached blocks and private ones (vLLM's
    /// `kv_cache_usage_perc` × capacity: cached blocks nobody holds count as free).
    pub(crate) fn used(&self) -> usize {
        self.pins.len() + self.private
    }

    /// Schedules a request (`--kv-pool`): looks `prompt` up now, and when its blocks fit beside
    /// what running requests hold, counts the lookup, pins the hit, stores and pins its other
    /// full prompt blocks, and holds `⌈(len + output_tokens) / B⌉ − full blocks` more. Returns
    /// the lookup (marked stored), the events to publish (evictions, then the store) and what
    /// it holds; `None` when it does not fit yet (nothing changed: it waits, and looks up
    /// again when it is tried again, as vLLM's waiting queue does).
    pub(crate) fn admit(
        &mut self,
        prompt: &[u32],
        keys: &Keys,
        output_tokens: usize,
    ) -> Option<(Lookup, Vec<KvEvent>, Held)> {
        let mut l = self.peek(prompt, keys);
        let bs = self.block_size;
        let full = if self.enabled { l.hashes.len() } else { 0 };
        let total = (prompt.len() + output_tokens).div_ceil(bs);
        let private = total.saturating_sub(full);
        let new_cached = full - l.hit_blocks;
        let free = self
            .capacity
            .saturating_sub(self.blocks.len() + self.private);
        let hit_unpinned = l.hashes[..l.hit_blocks]
            .iter()
            .filter(|h| !self.pins.contains_key(h))
            .count();
        if new_cached + private > free + self.evictable() - hit_unpinned {
            return None;
        }
        self.record(prompt, &l);
        // Full blocks after the hit that are cached already (the hit stops one token short of
        // the prompt): vLLM computes them into blocks of this request's own, so they are held
        // beside the cached copies, which stay evictable.
        let duplicates: std::collections::HashSet<u64> = l.hashes[l.hit_blocks..full]
            .iter()
            .copied()
            .filter(|h| self.blocks.contains_key(h))
            .collect();
        let mut events = Vec::new();
        let mut pinned = Vec::new();
        if self.enabled {
            events = self.store(prompt, &l);
            pinned = l.hashes[..full]
                .iter()
                .copied()
                .filter(|h| self.blocks.contains_key(h) && !duplicates.contains(h))
                .collect();
            for h in &pinned {
                *self.pins.entry(*h).or_insert(0) += 1;
            }
        }
        // The duplicates, and a full block the store could not keep, are held outside the
        // cache. Room for them is made from blocks no one pins, its own copies included.
        let private = private + (full - pinned.len());
        let none = std::collections::HashSet::new();
        while self.capacity < self.blocks.len() + self.private + private {
            match self.evict_one(&none) {
                Some(e) => events.insert(events.len().saturating_sub(1), e),
                None => break,
            }
        }
        self.private += private;
        l.stored = true;
        let held = Held { pinned, private };
        Some((l, events, held))
    }

    /// A running request finished (or went away): its cached blocks are unpinned, stay
    /// cached and become evictable (its last blocks before its first, as vLLM frees them), its
    /// other blocks free.
    pub(crate) fn release(&mut self, held: Held) {
        for h in &held.pinned {
            if let Some(n) = self.pins.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.pins.remove(h);
                }
            }
        }
        let cached: Vec<u64> = held
            .pinned
            .iter()
            .copied()
            .filter(|h| self.blocks.contains_key(h))
            .collect();
        self.touch_all(&cached);
        self.private = self.private.saturating_sub(held.private);
    }

    /// Drops every block (vLLM's `reset_prefix_cache`): `AllBlocksCleared`, or nothing when
    /// the cache is disabled or running requests hold blocks (`--kv-pool`; [`PrefixCache::
    /// refuses_reset`] tells the two apart).
    pub(crate) fn reset(&mut self) -> Option<KvEvent> {
        // vLLM refuses while running requests hold blocks ("Failed to reset prefix cache
        // because some blocks are not freed yet").
        if !self.enabled || self.used() > 0 {
            return None;
        }
        self.blocks.clear();
        self.lru.clear();
        self.counters.resets += 1;
        Some(KvEvent::AllBlocksCleared)
    }

    /// The counters, with `blocks` as held now.
    pub(crate) fn counters(&self) -> CacheCounters {
        CacheCounters {
            blocks: self.blocks.len() as u64,
            ..self.counters
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored_hashes(events: &[KvEvent]) -> Vec<u64> {
        events
            .iter()
            .flat_map(|e| match e {
                KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
                _ => vec![],
            })
            .collect()
    }

    /// `--kv-pool`: running requests hold their blocks in the cache's capacity. A request
    /// whose prompt and output do not fit beside them waits (nothing changes, not even the
    /// counters); a hot prefix shared by running requests is pinned, held once; what a
    /// finished request held stays cached and evictable; eviction never takes a pinned block.
    #[test]
    fn running_requests_hold_their_blocks_in_the_pool() {
        let k = Keys::default();
        // 10 blocks of 4 tokens.
        let mut c = PrefixCache::new(4, 10, true, 1);
        let a: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tokens
        // 2 cached + ⌈(10 + 6) / 4⌉ − 2 = 2 private.
        let (la, ev, ha) = c.admit(&a, &k, 6).expect("fits");
        assert!(la.stored && la.hit_blocks == 0);
        assert_eq!(stored_hashes(&ev), la.hashes);
        assert_eq!(c.used(), 4);
        // The same prefix again: its 2 blocks are hits, pinned twice, held once.
        let (lb, _, hb) = c.admit(&a, &k, 6).expect("fits");
        assert_eq!(lb.hit_blocks, 2);
        assert_eq!(c.used(), 6);
        let before = c.counters();
        // 8 more blocks do not fit beside the 6 held: it waits, nothing counted.
        let big: Vec<u32> = (100..132).collect();
        assert!(c.admit(&big, &k, 0).is_none());
        assert_eq!(c.counters(), before);
        c.release(ha);
        assert!(c.admit(&big, &k, 0).is_none(), "b still pins the prefix");
        c.release(hb);
        assert_eq!(c.used(), 0);
        assert_eq!(c.counters().blocks, 2, "the prefix stays cached, evictable");
        let (_, ev, hbig) = c
            .admit(&big, &k, 0)
            .expect("fits once the prefix is evictable");
        assert_eq!(
            ev.iter()
                .filter(|e| matches!(e, KvEvent::BlockRemoved { .. }))
                .count(),
            0,
            "8 new blocks fit in the 8 free: nothing evicted"
        );
        assert_eq!(c.used(), 8);
        // Another 3 blocks: the free 0 and the evictable prefix 2 are not enough.
        assert!(c.admit(&(200..212).collect::<Vec<u32>>(), &k, 0).is_none());
        // 2 blocks: the prefix is evicted to make room.
        let (_, ev, _) = c
            .admit(&(300..308).collect::<Vec<u32>>(), &k, 0)
            .expect("fits");
        assert_eq!(
            ev.iter()
                .filter(|e| matches!(e, KvEvent::BlockRemoved { .. }))
                .count(),
            2
        );
        assert!(c.reset().is_none(), "no reset while blocks are held");
        c.release(hbig);
    }

    /// A prompt run again while its blocks are cached but unpinned: its last full block is
    /// recomputed into a block of its own (the hit stops one token short), and the cached
    /// copy may be evicted to make room, as vLLM's pool does.
    #[test]
    fn a_recomputed_block_of_a_cached_prompt_fits_by_evicting_its_copy() {
        let k = Keys::default();
        let mut c = PrefixCache::new(4, 3, true, 1);
        let a: Vec<u32> = (0..8).collect(); // 2 full blocks
        let (_, _, h) = c.admit(&a, &k, 4).expect("3 blocks fit");
        assert_eq!(c.used(), 3);
        c.release(h);
        let (l, ev, h) = c.admit(&a, &k, 4).expect("fits again");
        assert_eq!(l.hit_blocks, 1);
        assert_eq!(
            c.used(),
            3,
            "1 pinned hit + a recomputed block + the output"
        );
        assert!(
            c.used() <= 3 && c.counters().blocks + 2 <= 3,
            "{:?}",
            c.counters()
        );
        assert!(ev.iter().any(|e| matches!(e, KvEvent::BlockRemoved { .. })));
        c.release(h);
        assert!(!c.fits_ever(13) && c.fits_ever(12));
    }

    #[test]
    fn a_repeated_prompt_hits_its_full_blocks_and_stores_nothing_new() {
        let mut c = PrefixCache::new(4, 100, true, 1);
        let prompt: Vec<u32> = (0..10).collect(); // two full blocks and two tokens
        let l = c.lookup(&prompt, &Keys::default());
        assert_eq!((l.hit_blocks, l.hashes.len()), (0, 2));
        let ev = c.store(&prompt, &l);
        assert_eq!(stored_hashes(&ev), l.hashes);
        match &ev[0] {
            KvEvent::BlockStored {
                parent_block_hash,
                token_ids,
                ..
            } => {
                assert_eq!(*parent_block_hash, None);
                assert_eq!(token_ids, &(0..8).collect::<Vec<u32>>());
            }
            e => panic!("{e:?}"),
        }
        let again = c.lookup(&prompt, &Keys::default());
        assert_eq!(again.hit_tokens, 8);
        assert!(c.store(&prompt, &again).is_empty());
        let k = c.counters();
        assert_eq!((k.queries, k.hits, k.blocks, k.stored), (20, 8, 2, 2));
    }

    #[test]
    fn a_longer_prompt_stores_only_its_new_blocks_with_the_parent() {
        let mut c = PrefixCache::new(4, 100, true, 1);
        let short: Vec<u32> = (0..9).collect();
        let l = c.lookup(&short, &Keys::default());
        c.store(&short, &l);
        let long: Vec<u32> = (0..13).collect();
        let l2 = c.lookup(&long, &Keys::default());
        assert_eq!(l2.hit_blocks, 2);
        let ev = c.store(&long, &l2);
        match &ev[..] {
            [
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    ..
                },
            ] => {
                assert_eq!(block_hashes, &vec![l2.hashes[2]]);
                assert_eq!(*parent_block_hash, Some(l2.hashes[1]));
                assert_eq!(token_ids, &vec![8, 9, 10, 11]);
            }
            e => panic!("{e:?}"),
        }
    }

    /// vLLM's keys: a salt changes the first block's hash (and so the chain), an adapter
    /// every block's; a salt equal to an adapter's name is another key; the store publishes
    /// them untagged per block with `lora_name`.
    #[test]
    fn salts_and_adapters_key_the_chain_as_vllm_does() {
        let c = PrefixCache::new(4, 64, true, 7);
        let p: Vec<u32> = (0..12).collect();
        let key = |lora: Option<&str>, salt: Option<&str>| Keys {
            lora: lora.map(str::to_string),
            salt: salt.map(str::to_string),
            ..Keys::default()
        };
        let plain = c.hashes(&p, &Keys::default());
        let salted = c.hashes(&p, &key(None, Some("t")));
        let adapter = c.hashes(&p, &key(Some("t"), None));
        for (i, h) in plain.iter().enumerate() {
            assert_ne!(*h, salted[i]);
            assert_ne!(*h, adapter[i]);
            assert_ne!(salted[i], adapter[i]);
        }
        let mut c = PrefixCache::new(4, 64, true, 7);
        let k = key(Some("t"), Some("s"));
        let l = c.lookup(&p, &k);
        match c.store(&p, &l).as_slice() {
            [
                KvEvent::BlockStored {
                    lora_name,
                    extra_keys,
                    ..
                },
            ] => {
                assert_eq!(lora_name.as_deref(), Some("t"));
                let t = |s: &str| ExtraKey::Text(s.into());
                assert_eq!(
                    extra_keys.as_deref(),
                    Some(
                        &[
                            Some(vec![t("t"), t("s")]),
                            Some(vec![t("t")]),
                            Some(vec![t("t")])
                        ][..]
                    )
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.lookup(&p, &k).hit_blocks, 2);
        assert_eq!(c.lookup(&p, &key(Some("t"), None)).hit_blocks, 0);
    }

    #[test]
    fn the_last_prompt_token_is_always_computed() {
        let mut c = PrefixCache::new(4, 100, true, 1);
        let aligned: Vec<u32> = (0..8).collect();
        let l = c.lookup(&aligned, &Keys::default());
        c.store(&aligned, &l);
        let again = c.lookup(&aligned, &Keys::default());
        assert_eq!(again.hit_blocks, 1, "at most (8 - 1) / 4 blocks hit");
        // vLLM recomputes the last block and reports it stored again.
        assert_eq!(stored_hashes(&c.store(&aligned, &again)), vec![l.hashes[1]]);
    }

    #[test]
    fn full_cache_evicts_the_least_recently_used_tail_first() {
        let mut c = PrefixCache::new(2, 3, true, 1);
        let a: Vec<u32> = vec![1, 2, 3, 4, 0];
        let la = c.lookup(&a, &Keys::default());
        c.store(&a, &la);
        let b: Vec<u32> = vec![9, 9, 8, 8, 0];
        let lb = c.lookup(&b, &Keys::default());
        let ev = c.store(&b, &lb);
        // One free slot for b's first block; its second evicts a's tail block.
        assert_eq!(
            ev[0],
            KvEvent::BlockRemoved {
                block_hashes: vec![la.hashes[1]],
                medium: Some("GPU".into()),
                group_idx: Some(0)
            }
        );
        assert_eq!(c.counters().blocks, 3);
        assert_eq!(c.counters().evictions, 1);
        assert_eq!(c.lookup(&a, &Keys::default()).hit_blocks, 1);
    }

    #[test]
    fn seeds_name_blocks_differently_and_disabled_never_hits() {
        let p: Vec<u32> = (0..8).collect();
        assert_ne!(
            PrefixCache::new(4, 9, true, 1).hashes(&p, &Keys::default()),
            PrefixCache::new(4, 9, true, 2).hashes(&p, &Keys::default())
        );
        let mut off = PrefixCache::new(4, 9, false, 1);
        let l = off.lookup(&p, &Keys::default());
        assert!(off.store(&p, &l).is_empty());
        assert_eq!(off.lookup(&p, &Keys::default()).hit_blocks, 0);
        assert_eq!(off.reset(), None);
    }

    /// An image keys the blocks its placeholders fall in, by its identifier and its offset
    /// from each block's start, and so every block after them; the blocks before it are the
    /// text prompt's. Its events carry `[identifier, offset]` pairs, as vLLM's do.
    #[test]
    fn images_key_the_blocks_they_fall_in() {
        let mut c = PrefixCache::new(4, 64, true, 7);
        let p: Vec<u32> = (1..=16).collect();
        let image = |id: &str| Keys {
            media: vec![Media {
                identifier: id.into(),
                start: 6,
                len: 4,
            }],
            ..Keys::default()
        };
        let text = c.hashes(&p, &Keys::default());
        let a = c.hashes(&p, &image("a"));
        let b = c.hashes(&p, &image("b"));
        assert_eq!(a[0], text[0]);
        assert!((1..4).all(|i| a[i] != text[i] && a[i] != b[i]));
        let lookup = c.lookup(&p, &image("a"));
        let events = c.store(&p, &lookup);
        let Some(KvEvent::BlockStored { extra_keys, .. }) = events.last() else {
            panic!("a store: {events:?}");
        };
        let media = |offset| {
            Some(vec![ExtraKey::Media {
                identifier: "a".into(),
                offset,
            }])
        };
        assert_eq!(
            extra_keys.as_deref(),
            Some(&[None, media(2), media(-2), None][..])
        );
    }
}
