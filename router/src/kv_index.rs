//! The KV block index: which prompt blocks each engine holds in its prefix cache, learned from
//! the engine's own KV events (docs/design/kv-aware-placement.md; vLLM's `BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`, decoded by `narwhal_shared::kv_events`).
//!
//! ```text
//!  (engine, seq, batch) ──sequence()──► Next | Restarted | Gap{from} | Old
//!        │ Next: apply()   Restarted: restart()   Gap: the driver replays, then fill()
//!        ▼
//!  per engine: our hash → refs, engine hash → our hash, next seq, last batch, counters
//!        │ credit(engine, prompt tokens)   longest run of held blocks from the first
//!        ▼
//!  cached prompt tokens: `exact` from the events (and placements they have not told yet);
//!  `approximate` from our own placements
//!  (`approx`: engines without events, waiting or stale); `none` when cache awareness is off
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
//! under-credits the engine. The approximate part has its own bound ([`approx`]).

use std::collections::HashMap;

/// The index's maps: keys are 64-bit hashes, looked up per request for every engine scored,
/// with foldhash (hashbrown's default) instead of SipHash.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;
use std::time::{Duration, Instant};

use narwhal_shared::kv_events::{ExtraKey, KvEvent, KvEventBatch, MEDIUM_GPU};

pub(crate) mod approx;
pub(crate) mod check;

use approx::{Approx, ApproxView};
use check::{CreditCheck, Verdict};

/// The most blocks the index holds per engine: 2^18 blocks (4 Mi tokens at vLLM's block size
/// of 16), about 20 MiB per engine at ~80 bytes per block.
pub(crate) const MAX_BLOCKS_PER_ENGINE: usize = 1 << 18;

/// Our hash of one block: chained over the parent block's our-hash (for a prompt's first
/// block, its [`PromptKeys::seed`]: 0 when keyed by tokens alone) and the block's token ids
/// (splitmix64 over each word; deterministic in every process).
pub(crate) fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix64(parent ^ 0x6b76_5f62_6c6f_636b);
    for t in tokens {
        h = mix64(h ^ u64::from(*t));
    }
    mix64(h ^ tokens.len() as u64)
}

/// Our hashes of a prompt's full blocks of `block_size` tokens, keyed by its tokens alone, in
/// order (a partial last block is never cached, as in vLLM).
#[cfg(test)]
pub(crate) fn prompt_chain(tokens: &[u32], block_size: u32) -> Vec<u64> {
    keyed_chain(tokens, block_size, 0)
}

/// splitmix64's finaliser.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A string's 64-bit hash (FNV-1a over its bytes and length, then [`mix64`]); deterministic in
/// every process.
fn str_hash(tag: u64, s: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ tag;
    for b in s {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h ^ s.len() as u64)
}

/// What vLLM keys a prompt's blocks by beyond their tokens, as far as a request can carry it
/// (vLLM 0.32 `vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`): the LoRA
/// adapter (every block; the chain carries it from the first) and the `cache_salt` (the first
/// block). Multimodal items and prompt embeddings are keyed too, by identifiers a request does
/// not carry in a form the router can compute: such requests are not scored
/// (`kv_cache::keyed_beyond_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PromptKeys<'a> {
    /// The adapter's name (vLLM's `lora_name`: the request's `model` when it names one).
    pub lora: Option<&'a str>,
    /// The request's `cache_salt`.
    pub salt: Option<&'a str>,
}

impl PromptKeys<'_> {
    /// The parent hash the prompt's first block is chained from: 0 for a prompt keyed by its
    /// tokens alone (so such chains are unchanged), otherwise a hash of the adapter and salt.
    pub(crate) fn seed(&self) -> u64 {
        match (self.lora, self.salt) {
            (None, None) => 0,
            (lora, salt) => {
                let l = lora.map_or(0, |l| str_hash(1, l.as_bytes()));
                let s = salt.map_or(0, |s| str_hash(2, s.as_bytes()));
                mix64(l ^ s.rotate_left(32)) | 1
            }
        }
    }
}

/// Our hashes of a prompt's full blocks of `block_size` tokens, in order, its first block
/// chained from `seed` ([`PromptKeys::seed`]; a partial last block is never cached, as in
/// vLLM).
pub(crate) fn keyed_chain(tokens: &[u32], block_size: u32, seed: u64) -> Vec<u64> {
    let bs = block_size.max(1) as usize;
    let mut parent = seed;
    tokens
        .chunks_exact(bs)
        .map(|b| {
            parent = block_hash(parent, b);
            parent
        })
        .collect()
}

/// What a batch's sequence number means for the engine's stream: the block set's rule
/// ([`narwhal_shared::kv_blocks::step_after`]), and on the live stream a number at or below a
/// batch that stream already delivered is a new engine process too (one PUB connection
/// delivers a process's batches in order, so going back there means another process, whose
/// first batches were missed).
pub(crate) use narwhal_shared::kv_blocks::Step as Seq;

/// An engine's index mode (docs/http-api.md `kv_index`; docs/design/kv-aware-placement.md
/// section 3): what its credit is learned from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Never credited: cache awareness is off (`serving.kv_aware_placement: false`), or the
    /// engines' tokenizers disagree.
    None,
    /// Credited from the router's own placements, with a TTL ([`approx`]): a guess.
    Approximate,
    /// Credited from the engine's own KV events, in an unbroken sequence of its process.
    Exact,
    /// Its events say it holds blocks it did not have, request after request ([`check`]):
    /// placed by load, its credit still computed and checked until it agrees again.
    Suspect,
}

impl Mode {
    /// The name in `/narwhal/state` and the `mode` label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Approximate => "approximate",
            Mode::Exact => "exact",
            Mode::Suspect => "suspect",
        }
    }

    /// Every mode, for pre-seeded metric labels.
    pub(crate) const ALL: [Mode; 4] = [Mode::None, Mode::Approximate, Mode::Exact, Mode::Suspect];
}

/// Why an engine is in its [`Mode`] (`/narwhal/state` `kv_index.engines.<iid>.reason`, the
/// `narwhal_kv_index_reason` metric): the finer state behind the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// `none`: `serving.kv_aware_placement` is false (nothing tokenized, nothing credited).
    Off,
    /// `none`: the engines' `/tokenize` disagree on the probe prompt, so the score is off.
    TokenizerMismatch,
    /// `approximate`: the engine has no `kv_events`.
    NoEvents,
    /// `approximate`: `kv_events` configured, no batch yet from this process (at start, or
    /// after its entries were dropped for a new process or an undecodable batch).
    Waiting,
    /// `approximate`: no batch for `serving.kv_events_stale_s` after a request that had to
    /// store blocks was placed on it (its events stopped), until its next batch.
    Stale,
    /// `exact`: batches arrive in order.
    Events,
    /// `suspect`: batches arrive in order, but the engine's own cached-token counts showed
    /// over-credit [`check::SUSPECT_AFTER`] times in a row.
    OverCredit,
}

impl Reason {
    /// The name in `/narwhal/state` and the `reason` label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::Off => "off",
            Reason::TokenizerMismatch => "tokenizer_mismatch",
            Reason::NoEvents => "no_kv_events",
            Reason::Waiting => "waiting",
            Reason::Stale => "stale",
            Reason::Events => "events",
            Reason::OverCredit => "over_credit",
        }
    }

    /// The mode this reason puts the engine in.
    pub(crate) fn mode(self) -> Mode {
        match self {
            Reason::Off | Reason::TokenizerMismatch => Mode::None,
            Reason::NoEvents | Reason::Waiting | Reason::Stale => Mode::Approximate,
            Reason::Events => Mode::Exact,
            Reason::OverCredit => Mode::Suspect,
        }
    }

    /// Every reason, for pre-seeded metric labels.
    pub(crate) const ALL: [Reason; 7] = [
        Reason::Off,
        Reason::TokenizerMismatch,
        Reason::NoEvents,
        Reason::Waiting,
        Reason::Stale,
        Reason::Events,
        Reason::OverCredit,
    ];
}

/// How the index credits: the `serving.kv_*` settings it needs (docs/configuration.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Settings {
    /// `serving.kv_aware_placement`: false turns every engine's mode to `none`.
    pub aware: bool,
    /// `serving.kv_events_stale_s`: silence after a storing placement that makes an engine
    /// with events `stale`.
    pub stale_after: Duration,
    /// `serving.kv_approx_ttl_s`: how long an approximate credit lives after the placement
    /// that last touched it (also how long a stale engine's last reported blocks count).
    pub approx_ttl: Duration,
    /// `serving.kv_approx_block_size`, tokens: the block size approximate credit is cut at
    /// for an engine whose block size its events never told.
    pub approx_block_size: u32,
    /// Blocks the approximate part holds per engine at most.
    pub approx_max_blocks: usize,
    /// `serving.kv_pending_s`: how long a placement's guess counts on an engine whose events
    /// are used (`exact`) while the engine has not reported the blocks itself (at most
    /// `approx_ttl`).
    pub pending: Duration,
}

impl Default for Settings {
    /// The configuration defaults: aware, stale after 5 s, TTL 120 s, block size 16,
    /// [`approx::MAX_APPROX_BLOCKS_PER_ENGINE`], pending 10 s.
    fn default() -> Self {
        Settings {
            aware: true,
            stale_after: Duration::from_secs(5),
            approx_ttl: Duration::from_secs(120),
            approx_block_size: 16,
            approx_max_blocks: approx::MAX_APPROX_BLOCKS_PER_ENGINE,
            pending: Duration::from_secs(10),
        }
    }
}

/// One engine's credit for one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Credit {
    /// Why the engine is credited as it is.
    pub reason: Reason,
    /// Prompt tokens the index credits (exact, or the approximate guess; 0 for `none`).
    pub cached: u64,
    /// Of `cached`, the tokens of blocks the engine's own events reported held (`exact` and
    /// `suspect`; 0 otherwise): what the credit check holds against the engine's count.
    pub reported: u64,
    /// Whether placing the prompt there stores blocks it does not hold (starts the stale
    /// clock of an engine with events).
    pub stores: bool,
    /// The block size the prompt's chain for this engine is cut at, tokens.
    pub block_size: u32,
}

impl Credit {
    /// The credit of an engine the request's placement does not choose among (it is not
    /// scored): nothing cached, mode `none`. `block_size` is the engine's own.
    pub(crate) fn unscored(block_size: u32) -> Credit {
        Credit {
            reason: Reason::Off,
            cached: 0,
            reported: 0,
            stores: false,
            block_size,
        }
    }
}

/// Prompt tokens an engine would compute for a prompt of `prompt_tokens` tokens with credit
/// `c`: `prompt_tokens − cached`, the approximate credit counting `approx_credit` (a ratio in
/// (0, 1], `serving.kv_approx_credit`) of its tokens.
pub(crate) fn uncached(prompt_tokens: u64, c: &Credit, approx_credit: f64) -> u64 {
    let counted = match c.reason.mode() {
        Mode::Exact => c.cached,
        Mode::Approximate => (c.cached as f64 * approx_credit.clamp(0.0, 1.0)).floor() as u64,
        Mode::None | Mode::Suspect => 0,
    };
    prompt_tokens.saturating_sub(counted)
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
    /// Events not applied: another tier than the GPU's (`medium`, e.g. vLLM's CPU offloading),
    /// a store without token ids (a tier update), another KV cache group than the first, or
    /// an event type this router does not know.
    pub skipped: u64,
}

/// One engine's part of the index.
#[derive(Debug, Default)]
struct Engine {
    configured: bool,
    /// Our hash → how many engine hashes name it.
    blocks: Map<u64, u32>,
    /// Engine hash → our hash.
    by_engine: Map<u64, u64>,
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
    /// Its credit held against its own cached-token counts.
    check: CreditCheck,
    /// The KV cache group whose blocks decide a prefix hit ([`Engine::applies`]): learned from
    /// the first store naming a full-attention kind; `None` until then (group 0 is applied).
    decisive_group: Option<u32>,
}

impl Engine {
    /// Drops every entry: what follows is a new process's, or a rebuild, so the credit check
    /// starts again too.
    fn clear(&mut self) {
        self.blocks.clear();
        self.by_engine.clear();
        self.check.restart();
    }

    /// Removes the block the engine names `engine_hash`; its hash is pushed to `told`.
    fn remove(&mut self, engine_hash: u64, told: &mut Told) {
        if let Some(ours) = self.by_engine.remove(&engine_hash)
            && let Some(n) = self.blocks.get_mut(&ours)
        {
            told.hashes.push(ours);
            *n -= 1;
            if *n == 0 {
                self.blocks.remove(&ours);
            }
        }
    }

    /// Stores the blocks; the hashes of those the index holds after it are pushed to `told`.
    fn store(&mut self, stored: Stored<'_>, told: &mut Told) {
        let Stored {
            hashes,
            parent,
            tokens,
            block_size,
            lora,
            salt: event_salt,
            extra,
        } = stored;
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
        for (i, (h, block)) in hashes.iter().zip(tokens.chunks_exact(bs)).enumerate() {
            let keys = extra
                .and_then(|e| e.get(i))
                .and_then(|k| k.as_deref())
                .unwrap_or(&[]);
            let first = parent.is_none() && i == 0;
            let (salt, opaque) = block_keys(keys, lora, first);
            if first {
                let salt = salt.or(event_salt);
                prev = PromptKeys { lora, salt }.seed();
            }
            if opaque != 0 {
                prev = mix64(prev ^ opaque);
            }
            let ours = block_hash(prev, block);
            prev = ours;
            if self.by_engine.contains_key(h) {
                told.hashes.push(ours);
                continue;
            }
            if self.by_engine.len() >= MAX_BLOCKS_PER_ENGINE {
                self.counters.overflow += 1;
                continue;
            }
            told.hashes.push(ours);
            self.by_engine.insert(*h, ours);
            *self.blocks.entry(ours).or_insert(0) += 1;
        }
    }

    /// Applies batch `seq`; what it told of blocks is pushed to `told`. Only what decides a
    /// prefix hit on the GPU is applied ([`applies`]); the rest is counted `skipped`.
    fn apply(&mut self, seq: u64, batch: &KvEventBatch, now: Instant, told: &mut Told) {
        for e in &batch.events {
            if !self.applies(e) {
                self.counters.skipped += 1;
                continue;
            }
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_name,
                    extra_keys,
                    cache_salt,
                    ..
                } => self.store(
                    Stored {
                        hashes: block_hashes,
                        parent: *parent_block_hash,
                        tokens: token_ids,
                        block_size: *block_size,
                        lora: lora_name.as_deref(),
                        salt: cache_salt.as_deref(),
                        extra: extra_keys.as_deref(),
                    },
                    told,
                ),
                KvEvent::BlockRemoved { block_hashes, .. } => {
                    for h in block_hashes {
                        self.remove(*h, told);
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.clear();
                    told.cleared = true;
                }
                KvEvent::Other { .. } => {}
            }
        }
        // Saturating: an engine's batch numbered u64::MAX (never a real vLLM sequence, but
        // any u64 arrives on the wire) must not panic or wrap the stream back to 0.
        self.next_seq = Some(seq.saturating_add(1));
        self.last_batch = Some(now);
        self.awaiting = None;
        self.counters.batches += 1;
    }
}

/// One `BlockStored`, as [`Engine::store`] reads it.
struct Stored<'a> {
    /// The engine's hashes of the blocks.
    hashes: &'a [u64],
    /// The engine's hash of the block before the first (`None`: the prompt's first block).
    parent: Option<u64>,
    /// The blocks' tokens, concatenated.
    tokens: &'a [u32],
    /// Tokens per block.
    block_size: u32,
    /// `lora_name`.
    lora: Option<&'a str>,
    /// SGLang's `cache_salt` (on every event of a salted prefix; vLLM's salt is in
    /// `extra_keys` instead): seeds the chain when the first block is the prompt's first.
    salt: Option<&'a str>,
    /// `extra_keys`, one entry per block.
    extra: Option<&'a [Option<Vec<ExtraKey>>]>,
}

/// A stored block's extra keys as the index keys them: the salt (a string on the prompt's
/// first block, `first`) and a hash of every key a request cannot carry (0 when none:
/// multimodal items, prompt-embedding digests, strings elsewhere, unknown shapes), which
/// makes the block one no scored request matches. The adapter's name, published first on
/// every block of a LoRA request, is skipped: the chain carries it from the first block
/// ([`PromptKeys::seed`]). vLLM publishes the keys untagged (`to_event_extra_keys`), so a
/// string is the adapter only where `lora_name` says so and comes first.
fn block_keys<'k>(keys: &'k [ExtraKey], lora: Option<&str>, first: bool) -> (Option<&'k str>, u64) {
    let rest = match (keys.first(), lora) {
        (Some(ExtraKey::Text(name)), Some(l)) if name == l => &keys[1..],
        _ => keys,
    };
    let mut salt = None;
    let mut opaque = 0u64;
    for (i, k) in rest.iter().enumerate() {
        let h = match k {
            ExtraKey::Text(s) if first && salt.is_none() => {
                salt = Some(s.as_str());
                continue;
            }
            ExtraKey::Text(s) => str_hash(3, s.as_bytes()),
            ExtraKey::Media { identifier, offset } => {
                str_hash(4, identifier.as_bytes()) ^ mix64(*offset as u64)
            }
            ExtraKey::Digest(d) => str_hash(5, d),
            ExtraKey::Other(raw) => str_hash(6, raw),
        };
        opaque = mix64(opaque ^ h ^ i as u64) | 1;
    }
    (salt, opaque)
}

/// vLLM's `KVCacheSpecKind` values of `FullAttentionSpec` and its subclasses: the groups a
/// hybrid model's prefix hit is decided by (`HybridKVCacheCoordinator.find_longest_cache_hit`
/// looks full attention up first, "always first if it exists", then shortens the hit by the
/// other groups).
const FULL_ATTENTION_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

impl Engine {
    /// Whether an event speaks of the blocks a request's prefix hit is decided by: the GPU
    /// tier (`medium` `"GPU"`, or none named) of the decisive KV cache group, a store that
    /// carries its tokens, or a clear. vLLM's CPU offloading publishes `BlockStored` for the
    /// lower tier with another block size and no token ids, and its removals there leave the
    /// GPU copy in place; a hybrid model publishes its events per KV cache group
    /// (`group_idx`), each store naming its group's kind (`kv_cache_spec_kind`). Applying
    /// those would flip the block size the engine is credited at, and wipe its credit. The
    /// decisive group is the first one a store names a full-attention kind for
    /// ([`FULL_ATTENTION_KINDS`]); a store naming another kind is skipped; an engine that
    /// names no kinds is credited by group 0.
    /// How the other groups (sliding windows, Mamba) shorten the hit is not modelled
    /// (docs/design/kv-aware-placement.md, "not done yet"). Unknown event types
    /// ([`KvEvent::Other`]) are skipped too, never a reset.
    fn applies(&mut self, e: &KvEvent) -> bool {
        let gpu = |m: &Option<String>| m.as_deref().is_none_or(|m| m == MEDIUM_GPU);
        match e {
            KvEvent::BlockStored {
                medium,
                group_idx,
                token_ids,
                kv_cache_spec_kind,
                ..
            } => {
                let group = group_idx.unwrap_or(0);
                match kv_cache_spec_kind.as_deref() {
                    Some(k) if FULL_ATTENTION_KINDS.contains(&k) => {
                        self.decisive_group.get_or_insert(group);
                    }
                    // A group of another kind never decides the hit.
                    Some(_) => return false,
                    None => {}
                }
                gpu(medium) && group == self.decisive_group.unwrap_or(0) && !token_ids.is_empty()
            }
            KvEvent::BlockRemoved {
                medium, group_idx, ..
            } => gpu(medium) && group_idx.unwrap_or(0) == self.decisive_group.unwrap_or(0),
            KvEvent::AllBlocksCleared => true,
            KvEvent::Other { .. } => false,
        }
    }
}

/// What an engine's batches told of blocks: the approximate guesses they settle.
#[derive(Debug, Default)]
struct Told {
    /// Our hashes of the blocks stored (held after the batch) or removed.
    hashes: Vec<u64>,
    /// An `AllBlocksCleared` came: every guess goes.
    cleared: bool,
}

/// A snapshot of one engine for `/narwhal/state` and `/metrics`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EngineView {
    /// Its mode now.
    pub mode: Mode,
    /// Why (the finer state).
    pub reason: Reason,
    /// Seconds since its last batch; `None` before the first.
    pub lag_s: Option<f64>,
    /// Blocks held from its events.
    pub blocks: u64,
    /// The approximate part: blocks credited from placements (not expired), LRU evictions.
    pub approx: ApproxView,
    /// Its stream's counters.
    pub counters: Counters,
    /// Its credit held against its own cached-token counts.
    pub credit: CreditCheck,
}

impl EngineView {
    /// Adds another data-parallel rank's counts to this one's (blocks, the approximate part,
    /// the stream's counters, the credit check; suspect when either is).
    pub(crate) fn merge(&mut self, r: &EngineView) {
        self.blocks += r.blocks;
        self.approx.blocks += r.approx.blocks;
        self.approx.evicted += r.approx.evicted;
        let (c, o) = (&mut self.counters, &r.counters);
        c.batches += o.batches;
        c.gaps += o.gaps;
        c.replays += o.replays;
        c.resets += o.resets;
        c.overflow += o.overflow;
        c.skipped += o.skipped;
        let (k, o) = (&mut self.credit, &r.credit);
        k.checked += o.checked;
        k.over_credited += o.over_credited;
        k.over_tokens += o.over_tokens;
        k.under_tokens += o.under_tokens;
        k.suspect |= o.suspect;
    }
}

/// The index over every configured engine (config order).
#[derive(Debug)]
pub(crate) struct KvIndex {
    engines: Vec<Engine>,
    approx: Approx,
    settings: Settings,
    /// The fleet's process epoch at the last [`KvIndex::sync_processes`] (`None`: never).
    processes_seen: Option<u64>,
}

impl KvIndex {
    /// One slot per engine with the default [`Settings`]; `configured[i]`: engine `i` has
    /// `kv_events`.
    #[cfg(test)]
    pub(crate) fn new(configured: &[bool]) -> Self {
        Self::with(configured, Settings::default())
    }

    /// One slot per engine; `configured[i]`: engine `i` has `kv_events`.
    pub(crate) fn with(configured: &[bool], settings: Settings) -> Self {
        KvIndex {
            engines: configured
                .iter()
                .map(|c| Engine {
                    configured: *c,
                    ..Engine::default()
                })
                .collect(),
            approx: Approx::new(
                configured.len(),
                settings.approx_ttl,
                settings.approx_max_blocks,
            ),
            settings,
            processes_seen: None,
        }
    }

    /// The fleet's process epoch the entries were last bound at ([`KvIndex::sync_processes`];
    /// `None` before the first binding).
    pub(crate) fn processes_seen(&self) -> Option<u64> {
        self.processes_seen
    }

    /// Binds every engine to its process ([`KvIndex::sync_process`]; `incarnations` in config
    /// order, as the fleet read them at process epoch `epoch`).
    pub(crate) fn sync_processes(&mut self, epoch: u64, incarnations: &[u64]) {
        for (e, inc) in incarnations.iter().enumerate().take(self.engines.len()) {
            self.sync_process(e, *inc);
        }
        self.processes_seen = Some(epoch);
    }

    /// What sequence number `seq` means for engine `e`'s stream; `live`: it came on the live
    /// stream (a replayed batch below the expected one is only an overlap).
    pub(crate) fn sequence(&self, e: usize, seq: u64, live: bool) -> Seq {
        let en = &self.engines[e];
        if live && en.last_live.is_some_and(|l| seq <= l) {
            return Seq::Restarted;
        }
        narwhal_shared::kv_blocks::step_after(en.next_seq, seq)
    }

    /// Applies the expected batch `seq` of engine `e`.
    /// A batch is the engine's truth for the blocks it names: the approximate guesses of the
    /// blocks it stored or removed are dropped (the exact entry wins); the others stay, since
    /// under a backlog a placement's prefill ends seconds after batches about other prompts.
    /// A batch that ends a `stale` spell drops every guess: blocks placed while its events
    /// were stopped may never be reported.
    pub(crate) fn apply(&mut self, e: usize, seq: u64, batch: &KvEventBatch, now: Instant) {
        let mut told = Told {
            cleared: self.reason(e, now) == Reason::Stale,
            ..Told::default()
        };
        self.engines[e].apply(seq, batch, now, &mut told);
        self.settle(e, &told);
    }

    fn settle(&mut self, e: usize, told: &Told) {
        if told.cleared {
            self.approx.drop_engine(e);
        } else {
            self.approx.settle(e, &told.hashes);
        }
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
        en.decisive_group = None;
        en.counters.resets += 1;
        en.apply(seq, batch, now, &mut Told::default());
        self.approx.drop_engine(e);
    }

    /// Batch `seq` arrived after a gap from `from`: `replayed` is what the engine's replay
    /// socket gave (`None`: no replay socket, or it failed). When it holds every batch
    /// `from..seq` they are applied in order, then `batch`; otherwise the engine's entries are
    /// dropped (a missed `BlockRemoved` would credit blocks it no longer holds) and `batch`
    /// starts the rebuild, and every approximate guess goes (a replayed gap settles only the
    /// blocks it names, as [`Self::apply`]). Returns whether the gap was filled.
    pub(crate) fn fill(
        &mut self,
        e: usize,
        from: u64,
        replayed: Option<&[(u64, KvEventBatch)]>,
        seq: u64,
        batch: &KvEventBatch,
        now: Instant,
    ) -> bool {
        let stale = self.reason(e, now) == Reason::Stale;
        let en = &mut self.engines[e];
        en.counters.gaps += 1;
        let wanted: Option<Vec<&(u64, KvEventBatch)>> =
            replayed.map(|r| r.iter().filter(|(s, _)| (from..seq).contains(s)).collect());
        let complete = wanted.as_ref().is_some_and(|w| {
            w.len() as u64 == seq - from && w.iter().zip(from..).all(|((s, _), want)| *s == want)
        });
        let mut told = Told {
            cleared: stale,
            ..Told::default()
        };
        if complete {
            en.counters.replays += 1;
            for (s, b) in wanted.unwrap_or_default() {
                en.apply(*s, b, now, &mut told);
            }
        } else {
            if en.next_seq.is_some() {
                en.clear();
                en.counters.resets += 1;
            }
            told.cleared = true;
        }
        en.apply(seq, batch, now, &mut told);
        self.settle(e, &told);
        complete
    }

    /// Binds engine `e`'s entries, exact and approximate, to process `process` (the fleet's
    /// incarnation count): when it differs from the one they were learned under, they are
    /// dropped and the stream starts again (the engine is `waiting` until its new process
    /// publishes).
    pub(crate) fn sync_process(&mut self, e: usize, process: u64) {
        self.approx.sync_process(e, process);
        let en = &mut self.engines[e];
        if en.process.is_some_and(|p| p != process) {
            en.clear();
            en.decisive_group = None;
            en.counters.resets += 1;
            en.next_seq = None;
            en.last_batch = None;
            en.awaiting = None;
        }
        en.process = Some(process);
    }

    /// Engine `e`'s approximate guesses live at `now` for a router started after this one,
    /// when `e` publishes no KV events (`engines[].kv_events` unset: the engine's own replay
    /// rebuilds the rest): ([`approx::Approx::export`]).
    pub(crate) fn approx_export(
        &self,
        e: usize,
        now: Instant,
    ) -> Option<(u32, Vec<(u64, Duration)>)> {
        if self.engines[e].configured || !self.settings.aware {
            return None;
        }
        self.approx.export(e, now).filter(|(_, b)| !b.is_empty())
    }

    /// Takes guesses a router before this one carried for engine `e`, whose current process
    /// (`process`, the fleet's incarnation count) is the one they were learned from
    /// ([`approx::Approx::import`]); the guesses taken.
    pub(crate) fn approx_import(
        &mut self,
        e: usize,
        block_size: u32,
        carried: &[(u64, Instant)],
        process: u64,
    ) -> usize {
        self.approx.import(e, block_size, carried, process)
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

    /// A request was placed on `e` at `now`: `chain` is its prompt's full-block chain at the
    /// block size of `e`'s credit (`Credit::block_size`), `stores` whether it has full blocks
    /// `e` does not hold. The chain is credited to `e`'s approximate part, less the leading
    /// blocks `e`'s events report held. Also while `e` is exact: its credit counts the guess
    /// for `serving.kv_pending_s` or until `e`'s own events store or remove those blocks (so
    /// requests sharing a new prefix follow it before its prefill ends), and if its events
    /// stop, what was placed since is what it must hold. `stores` starts the stale clock of an
    /// engine with events. Nothing is credited when cache awareness is off.
    pub(crate) fn placed(
        &mut self,
        e: usize,
        chain: &[u64],
        block_size: u32,
        stores: bool,
        now: Instant,
    ) {
        if !self.settings.aware {
            return;
        }
        let en = &self.engines[e];
        let held = if en.block_size == Some(block_size) {
            chain
                .iter()
                .take_while(|h| en.blocks.contains_key(*h))
                .count()
        } else {
            0
        };
        self.approx.placed(e, &chain[held..], block_size, now);
        let en = &mut self.engines[e];
        if stores && en.configured && en.awaiting.is_none() {
            en.awaiting = Some(now);
        }
    }

    /// Why engine `e` is in its mode at `now` (module doc; [`Reason`]).
    pub(crate) fn reason(&self, e: usize, now: Instant) -> Reason {
        let en = &self.engines[e];
        if !self.settings.aware {
            Reason::Off
        } else if !en.configured {
            Reason::NoEvents
        } else if en.last_batch.is_none() {
            Reason::Waiting
        } else if en
            .awaiting
            .is_some_and(|t| now.saturating_duration_since(t) > self.settings.stale_after)
        {
            Reason::Stale
        } else if en.check.suspect {
            Reason::OverCredit
        } else {
            Reason::Events
        }
    }

    /// A request whose prompt engine `e` computed, credited `credited` tokens (`reported` of
    /// them from blocks its events reported), was served `engine` tokens from its prefix cache
    /// by its own count ([`check`]). Returns the verdict and whether the engine's `suspect`
    /// state changed.
    pub(crate) fn observe(
        &mut self,
        e: usize,
        reported: u64,
        credited: u64,
        engine: u64,
    ) -> (Verdict, bool) {
        self.engines[e].check.observe(reported, credited, engine)
    }

    /// The block size engine `e`'s credit is counted in: the one its events told, else its
    /// approximate part's, else `serving.kv_approx_block_size`.
    pub(crate) fn credit_block_size(&self, e: usize) -> u32 {
        self.engines[e]
            .block_size
            .or_else(|| self.approx.block_size(e))
            .unwrap_or(self.settings.approx_block_size)
            .max(1)
    }

    /// Engine `e`'s credit at `now` for a prompt of `prompt_tokens` tokens whose full-block
    /// chain at [`Self::credit_block_size`] is `chain`:
    /// - `exact`: the longest run of blocks its events reported held, or placed on it less than
    ///   `pending` ago and not yet stored or removed by its events (counted as exact: the
    ///   engine is computing them);
    /// - `approximate`: the longest run of blocks credited by placements less than
    ///   `approx_ttl` ago, or, for a stale engine whose last batch came less than `approx_ttl`
    ///   ago, reported by its events (what it last said it held, and what was placed since);
    /// - `none`: nothing.
    ///
    /// At most `(prompt_tokens − 1) / block_size` blocks: vLLM always computes the last
    /// prompt token.
    pub(crate) fn credit(
        &self,
        e: usize,
        chain: &[u64],
        prompt_tokens: u64,
        now: Instant,
    ) -> Credit {
        let reason = self.reason(e, now);
        let en = &self.engines[e];
        let bs = self.credit_block_size(e);
        let full = chain.len() as u64 * u64::from(bs);
        let mut reported_run = 0;
        let cached = match reason.mode() {
            Mode::None => 0,
            Mode::Exact | Mode::Suspect => {
                let cap = (prompt_tokens.saturating_sub(1) / u64::from(bs)) as usize;
                let pending = self.settings.pending;
                let mut all_reported = true;
                let run = chain
                    .iter()
                    .take(cap)
                    .take_while(|h| {
                        let held = en.blocks.contains_key(*h);
                        all_reported &= held;
                        if all_reported {
                            reported_run += 1;
                        }
                        held || self.approx.holds_within(e, **h, now, pending)
                    })
                    .count();
                run as u64 * u64::from(bs)
            }
            Mode::Approximate => {
                let reported = reason == Reason::Stale
                    && en.last_batch.is_some_and(|t| {
                        now.saturating_duration_since(t) < self.settings.approx_ttl
                    });
                let cap = (prompt_tokens.saturating_sub(1) / u64::from(bs)) as usize;
                let run = chain
                    .iter()
                    .take(cap)
                    .take_while(|h| {
                        self.approx.holds(e, **h, now) || (reported && en.blocks.contains_key(*h))
                    })
                    .count();
                run as u64 * u64::from(bs)
            }
        };
        Credit {
            reason,
            cached,
            reported: reported_run * u64::from(bs),
            stores: full > cached,
            block_size: bs,
        }
    }

    /// The sequence number engine `e`'s stream expects next (`None` before its first batch).
    pub(crate) fn next_seq(&self, e: usize) -> Option<u64> {
        self.engines[e].next_seq
    }

    /// Prompt tokens engine `e` holds for a prompt whose full-block chain at its block size is
    /// `chain`: the longest run of held blocks from the first, at most `(prompt_tokens − 1) /
    /// block_size` blocks (vLLM always computes the last prompt token), times the block size.
    #[cfg(test)]
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
    pub(crate) fn view(&self, e: usize, now: Instant) -> EngineView {
        let en = &self.engines[e];
        let reason = self.reason(e, now);
        EngineView {
            mode: reason.mode(),
            reason,
            lag_s: en
                .last_batch
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
            blocks: en.blocks.len() as u64,
            approx: self.approx.view(e, now),
            counters: en.counters,
            credit: en.check,
        }
    }
}

#[cfg(test)]
mod tests;
