//! The KV cache part: the index of the engines' prefix-cache blocks ([`crate::kv_index`])
//! behind its lock, one subscriber task per engine with `kv_events`, the replay of missed
//! batches, and a request's tokens from an engine's own `POST /tokenize` for the KV score
//! (docs/design/kv-aware-placement.md).
//!
//! ```text
//!  engine PUB ──SUB [topic, seq (8 B BE), msgpack batch]──► subscriber ──► KvIndex (lock)
//!  engine ROUTER ◄──DEALER ["", start (8 B BE)]── gap ──► ["", topic, seq, payload]… end
//!  request ──/tokenize (one live engine, short timeout)──► tokens ──► KvScore ──► placement
//! ```
//!
//! The subscribers are thin: every rule (sequence, restart, gap, stale, credit, the
//! approximate credit of a placement) is the pure index's. A subscriber reconnects when the fleet sees a new process behind its engine
//! (`Fleet::incarnation`), whose entries the index then drops. Tokenizing never fails a
//! request: without tokens it is placed by load, and the failure is counted.
//!
//! The subscribers run in every HA phase: a warm standby keeps its index from the same streams
//! (and replay) while it shadows, so placement keeps its affinity across a takeover. They only
//! read the engines' events and the fleet's incarnation counts; a standby scores and places
//! nothing, so its approximate index (engines without events) is cold at a takeover. After a takeover the new primary's identity checks apply as always: a new process
//! behind an engine drops its entries before it is scored again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use narwhal_shared::Clock;
use narwhal_shared::kv_events::KvEventBatch;
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket as _, SocketRecv as _, ZmqMessage};

use crate::config::{Config, KvEventsSource, secs};
use crate::fleet::Fleet;
use crate::kv_index::{
    Credit, EngineView, KvIndex, Mode, Reason, Seq, Settings, check::Verdict, keyed_chain, uncached,
};
use crate::placement::{Aggregate, Balance, KvScore};
use crate::upstream::Upstream;

mod carry;
mod local;
mod ranks;
mod request;
mod sample;
pub(crate) use carry::path_for as carried_path;
use local::LocalTokenizer;
pub(crate) use local::{ShapeView, tokens_of};
use ranks::Ranks;
use request::tokenize_engine;
pub(crate) use request::{keyed_beyond_tokens, prompt_keys, tokenize_body};
use sample::{Sampler, Shape};

/// How long a replay may take before the gap is given up (the engine's entries dropped).
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// How far apart two readings of one process's start may be (the agent reads `/proc`, the
/// engine's `/metrics` reports its own reading; a restarted engine takes longer than this to
/// serve again).
const SAME_PROCESS_S: f64 = 2.0;
/// How often a subscriber checks its engine's process and retries a failed connect.
const RECHECK: Duration = Duration::from_millis(500);
/// How long an engine whose `/tokenize` failed (for a score or the probe) is not asked again
/// for scoring while another live engine can be (a stalled engine would otherwise hold every
/// request for `engine.tokenize_timeout_s` until the breaker or the liveness probe ejects it).
const TOKENIZE_AVOID: Duration = Duration::from_secs(10);
/// The prompt both engines tokenize to check they agree.
const PROBE_PROMPT: &str = "Narwhal tokenizer probe: the quick brown fox jumps over the lazy dog.";

/// Whether the engines' `/tokenize` agree (checked once two engines answer): a mismatch or
/// failure is a degraded mode, shown in `/narwhal/state` `kv_index.tokenizer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TokenizerCheck {
    /// Not checked yet (fewer than two live engines so far).
    Unchecked,
    /// Two engines gave the same tokens for the probe prompt.
    Agree,
    /// They differ: the KV score is off (placement by load), since one tokenizer's blocks
    /// cannot be matched with another's tokens.
    Mismatch(String),
    /// The probe failed (an engine did not answer `/tokenize`); retried on the next request.
    Failed(String),
}

impl TokenizerCheck {
    /// `unchecked`, `agree`, `mismatch`, `failed`.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            TokenizerCheck::Unchecked => "unchecked",
            TokenizerCheck::Agree => "agree",
            TokenizerCheck::Mismatch(_) => "mismatch",
            TokenizerCheck::Failed(_) => "failed",
        }
    }

    /// What failed or differed, if anything.
    pub(crate) fn detail(&self) -> Option<&str> {
        match self {
            TokenizerCheck::Mismatch(d) | TokenizerCheck::Failed(d) => Some(d),
            _ => None,
        }
    }
}

/// Why a request's tokens could not be had (it is placed by load).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TokenizeError {
    /// No live engine to ask.
    #[error("no live engine to tokenize on")]
    NoEngine,
    /// The prompt is neither a string, a token-id list nor chat messages (a batch).
    #[error("prompt shape not tokenized")]
    Shape,
    /// The engine did not answer 200 with `tokens` in time.
    #[error("tokenize on {iid} failed: {detail}")]
    Engine {
        /// The engine asked.
        iid: String,
        /// What failed.
        detail: String,
    },
}

/// The KV score of one placement and what the journal needs of it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Scored {
    /// The placement input.
    pub score: KvScore,
    /// Per engine (config order): its credit (reason, cached prompt tokens as the index
    /// credits them, undiscounted, whether placing there stores, the block size). An engine
    /// the score did not walk (not among those placement chooses) has reason `off`, nothing
    /// cached and block size 0 (not read).
    pub credits: Vec<Credit>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// The prompt's full-block chains, one per block size the engines are credited in.
    chains: Vec<(u32, Vec<u64>)>,
    /// Per engine (config order): the data-parallel rank its credit is from, when it has
    /// several and the best of them holds some of the prompt (the request is sent there with
    /// vLLM's `X-data-parallel-rank`); `None` leaves the rank to the engine.
    pub ranks: Vec<Option<u32>>,
}

impl Scored {
    /// The prompt's chain at block size `bs` (empty if no engine is credited in it).
    fn chain(&self, bs: u32) -> &[u64] {
        self.chains
            .iter()
            .find(|(b, _)| *b == bs)
            .map(|(_, c)| c.as_slice())
            .unwrap_or(&[])
    }
}

/// Tokenize counters (cumulative).
#[derive(Debug, Default)]
struct Counts {
    tokenized: AtomicU64,
    failures: AtomicU64,
    micros: AtomicU64,
    /// Requests not scored: one engine to choose from, no profiles.
    unscored: AtomicU64,
    /// Requests sampled by the tokenizer check.
    sampled: AtomicU64,
}

/// The KV score's counts, cumulative since the router started (`/narwhal/state.kv_index`,
/// `narwhal_kv_index_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TokenizeCounts {
    /// Requests whose prompt was tokenized for a score.
    pub(crate) tokenized: u64,
    /// Requests placed by load because `/tokenize` gave no tokens.
    pub(crate) failures: u64,
    /// Seconds spent in `/tokenize` for scores.
    pub(crate) seconds: f64,
    /// Requests not scored because placement had at most one engine to choose from and no
    /// profiles are configured (docs/design/kv-aware-placement.md, "One engine to choose
    /// from").
    pub(crate) unscored: u64,
    /// Real requests whose tokens were checked on a second engine (the sampled tokenizer
    /// check, [`sample`]).
    pub(crate) sampled: u64,
    /// Requests tokenized by the router's own tokenizer (`engine.tokenizer`).
    pub(crate) local: u64,
    /// Seconds the router's tokenizer spent on them (rendering and encoding).
    pub(crate) local_seconds: f64,
    /// Requests it could not render, asked of an engine's `/tokenize` instead.
    pub(crate) local_fallbacks: u64,
    /// Router-tokenized requests checked against an engine's `/tokenize`.
    pub(crate) local_checked: u64,
}

/// The KV cache part (module doc).
pub(crate) struct KvCache {
    cfg: Arc<Config>,
    clock: Arc<dyn Clock>,
    upstream: Upstream,
    index: Mutex<KvIndex>,
    tokenizer: Mutex<TokenizerCheck>,
    counts: Counts,
    /// Per engine (config order): when its `/tokenize` for a score last failed.
    tokenize_failed: Mutex<Vec<Option<Instant>>>,
    /// Per index slot: its index was rebuilt since this router started (its replay socket
    /// answered, or its live stream delivered in order); what `/ready` waits for at startup
    /// ([`KvCache::replay_pending`]).
    replayed: Vec<std::sync::atomic::AtomicBool>,
    /// The index's slots: one per engine, and one per further data-parallel rank ([`ranks`]).
    ranks: Ranks,
    /// Which real requests the tokenizer check samples ([`sample`]).
    sampler: Mutex<Sampler>,
    /// The router's own tokenizer, set at startup when `engine.tokenizer` names a model
    /// directory ([`local`]).
    local: std::sync::OnceLock<Mutex<LocalTokenizer>>,
    /// Per index slot: approximate guesses a router before this one carried over its
    /// restart, until the engine's process is confirmed ([`carry`]).
    carry: Mutex<BTreeMap<usize, carry::Pending>>,
}

impl KvCache {
    /// An empty index over the configured engines.
    pub(crate) fn new(cfg: Arc<Config>, clock: Arc<dyn Clock>, upstream: Upstream) -> Self {
        let configured: Vec<bool> = cfg.engines.iter().map(|e| e.kv_events.is_some()).collect();
        let sizes: Vec<u32> = cfg
            .engines
            .iter()
            .map(|e| e.kv_events.as_ref().map_or(1, |k| k.data_parallel_size))
            .collect();
        let ranks = Ranks::new(&sizes);
        let slots = ranks.expand(&configured);
        let settings = Settings {
            aware: cfg.serving.kv_aware_placement,
            stale_after: secs(cfg.serving.kv_events_stale_s),
            approx_ttl: secs(cfg.serving.kv_approx_ttl_s),
            approx_block_size: cfg.serving.kv_approx_block_size,
            approx_max_blocks: crate::kv_index::approx::MAX_APPROX_BLOCKS_PER_ENGINE,
            pending: secs(cfg.serving.kv_pending_s),
        };
        KvCache {
            replayed: slots
                .iter()
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            tokenize_failed: Mutex::new(vec![None; configured.len()]),
            sampler: Mutex::new(Sampler::new(configured.len())),
            index: Mutex::new(KvIndex::with(&slots, settings)),
            ranks,
            cfg,
            clock,
            upstream,
            tokenizer: Mutex::new(TokenizerCheck::Unchecked),
            counts: Counts::default(),
            local: std::sync::OnceLock::new(),
            carry: Mutex::new(BTreeMap::new()),
        }
    }

    /// Uses `model` to tokenize requests for the KV score from now on ([`local`]); set once,
    /// at startup.
    pub(crate) fn use_tokenizer(&self, model: Arc<narwhal_tokenizer::ModelTokenizer>) {
        let _ = self.local.set(Mutex::new(LocalTokenizer::new(
            model,
            self.cfg.engines.len(),
        )));
    }

    fn local(&self) -> Option<MutexGuard<'_, LocalTokenizer>> {
        self.local
            .get()
            .map(|l| l.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The router's tokenizer: its model directory and each shape's agreement with the
    /// engines; `None` when `engine.tokenizer` is not set.
    pub(crate) fn local_tokenizer(&self) -> Option<(String, Vec<ShapeView>)> {
        self.local()
            .map(|l| (l.model.dir().display().to_string(), l.views()))
    }

    fn lock(&self) -> MutexGuard<'_, KvIndex> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether cache awareness is on (`serving.kv_aware_placement`; else nothing here runs,
    /// no request tokenizes and every engine's mode is `none`).
    pub(crate) fn enabled(&self) -> bool {
        self.cfg.serving.kv_aware_placement && !self.cfg.engines.is_empty()
    }

    /// Starts one subscriber per engine with `kv_events` and per further data-parallel rank
    /// of it (its sockets the ports plus the rank), whatever the HA phase (a standby keeps a
    /// warm index; module doc); they end with `stop`. None when cache awareness is off.
    ///
    /// `snapshots` (per engine, config order): the agent that keeps the engine's block set
    /// (`GET /v1/engines/{iid}/kv/snapshot`), asked when the engine's replay buffer no longer
    /// reaches back to its stream's start ([`KvCache::catch_up`]).
    pub(crate) fn spawn(
        self: &Arc<Self>,
        fleet: Arc<Fleet>,
        snapshots: Vec<Option<Arc<narwhal_shared::AgentClient>>>,
        stop: CancellationToken,
    ) {
        if !self.enabled() {
            return;
        }
        for s in 0..self.ranks.len() {
            let e = self.ranks.engine(s);
            if let Some(src) = self.cfg.engines[e].kv_events.as_ref() {
                let src = src.rank(self.ranks.rank(s));
                // The agent follows the engine's one stream (rank 0).
                let agent = snapshots
                    .get(e)
                    .cloned()
                    .flatten()
                    .filter(|_| self.ranks.rank(s) == 0);
                let me = self.clone();
                let fleet = fleet.clone();
                let stop = stop.clone();
                tokio::spawn(async move { me.subscribe(s, src, agent, fleet, stop).await });
            }
        }
    }

    /// The engine id of index slot `s`, with its rank when the engine has several
    /// (`d0/rank1`), for logs.
    fn slot_name(&self, s: usize) -> String {
        let e = self.ranks.engine(s);
        let iid = &self.cfg.engines[e].iid;
        if self.ranks.several(e) {
            format!("{iid}/rank{}", self.ranks.rank(s))
        } else {
            iid.clone()
        }
    }

    /// Follows index slot `s`'s stream (an engine, or one of its data-parallel ranks).
    async fn subscribe(
        self: Arc<Self>,
        s: usize,
        src: KvEventsSource,
        agent: Option<Arc<narwhal_shared::AgentClient>>,
        fleet: Arc<Fleet>,
        stop: CancellationToken,
    ) {
        let (e, iid) = (self.ranks.engine(s), self.slot_name(s));
        loop {
            let process = fleet.incarnation(e);
            self.lock().sync_process(s, process);
            let mut sub = zeromq::SubSocket::new();
            let connected = tokio::select! {
                r = sub.connect(&src.endpoint) => r,
                () = stop.cancelled() => return,
            };
            if let Err(err) = connected {
                tracing::debug!(engine.id = %iid, error = %err, "kv events: connect failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(RECHECK) => continue,
                    () = stop.cancelled() => return,
                }
            }
            if let Err(err) = sub.subscribe(&src.topic).await {
                tracing::warn!(engine.id = %iid, error = %err, "kv events: subscribe failed");
                continue;
            }
            tracing::info!(engine.id = %iid, endpoint = %src.endpoint, "kv events: subscribed");
            // Rebuild from the engine's replay buffer at once, not at the first recheck: a
            // router that starts is not ready before it did (`replay_pending`).
            self.catch_up(s, &src, agent.as_deref(), &fleet).await;
            loop {
                tokio::select! {
                    m = sub.recv() => match m {
                        Ok(m) => self.on_message(s, &src, m).await,
                        Err(err) => {
                            tracing::debug!(engine.id = %iid, error = %err, "kv events: receive failed; reconnecting");
                            break;
                        }
                    },
                    () = tokio::time::sleep(RECHECK) => {
                        if fleet.incarnation(e) != process {
                            tracing::info!(engine.id = %iid, "kv events: new engine process; its blocks are dropped");
                            break;
                        }
                        self.catch_up(s, &src, agent.as_deref(), &fleet).await;
                    }
                    () = stop.cancelled() => return,
                }
            }
        }
    }

    /// While engine `e` is `waiting` or `stale`, asks its replay socket for what it published
    /// from the next expected batch on: batches sent before the SUB's subscription reached
    /// the engine (ZMQ drops those), or after the SUB silently lost its connection.
    async fn catch_up(
        &self,
        e: usize,
        src: &KvEventsSource,
        agent: Option<&narwhal_shared::AgentClient>,
        fleet: &Fleet,
    ) {
        let Some(ep) = &src.replay_endpoint else {
            return;
        };
        let (reason, from) = {
            let ix = self.lock();
            (ix.reason(e, self.clock.now()), ix.next_seq(e))
        };
        if !matches!(reason, Reason::Waiting | Reason::Stale) {
            self.mark_replayed(e);
            return;
        }
        let Some(mut batches) = replay(ep, from.unwrap_or(0)).await else {
            return;
        };
        // The buffer no longer reaches back to where this index is (its stream's start, for a
        // router that just started): what was stored before it is only in the agent's block
        // set, which is current to some batch of the buffer or later.
        let first = batches.first().map_or(0, |(s, _)| *s);
        if first > from.unwrap_or(0)
            && let Some(agent) = agent
        {
            let known = fleet.process_start(self.ranks.engine(e));
            if let Some(next) = self.take_snapshot(e, agent, known, first).await {
                batches.retain(|(s, _)| *s >= next);
            }
        }
        for (seq, batch) in batches {
            self.ingest(e, seq, batch, false, None).await;
        }
        // The buffer answered (perhaps empty: the engine published nothing yet): the index
        // holds what the engine can still tell.
        self.mark_replayed(e);
    }

    /// Rebuilds slot `e` (an engine's rank 0) from its agent's block set
    /// (docs/design/kv-aware-placement.md, "Beyond the replay buffer"): the snapshot's blocks
    /// applied as the batch before its `next_seq`, which the stream then continues from. Only
    /// a snapshot of the process the router knows behind the engine is used: the agent's
    /// process start (from `/proc`) within [`SAME_PROCESS_S`] of `known`, the engine's own
    /// `process_start_time_seconds` as the router last read it (when it did), and current to
    /// at least `first`, the replay buffer's first batch (else a gap would remain). The
    /// sequence number the stream continues from; `None` when there is no usable snapshot
    /// (logged).
    async fn take_snapshot(
        &self,
        e: usize,
        agent: &narwhal_shared::AgentClient,
        known: Option<f64>,
        first: u64,
    ) -> Option<u64> {
        use base64::Engine as _;
        let iid = self.slot_name(e);
        let snap = match agent.kv_snapshot(&iid).await {
            Ok(s) => s,
            Err(err) => {
                tracing::info!(engine.id = %iid, error = %err, "kv events: no snapshot from the agent; the replay buffer's batches only");
                return None;
            }
        };
        // An agent behind the buffer's start would leave a gap the buffer cannot fill.
        if snap.next_seq < first {
            tracing::info!(engine.id = %iid, next_seq = snap.next_seq, buffer_from = first,
                "kv events: the agent's snapshot is older than the replay buffer; not used");
            return None;
        }
        let start = snap.process.process_start_time_seconds;
        if known.is_some_and(|k| (k - start).abs() > SAME_PROCESS_S) {
            tracing::info!(engine.id = %iid, agent_start = start, engine_start = ?known,
                "kv events: the agent's snapshot is of another process; not used");
            return None;
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(snap.batch.as_bytes())
            .ok()?;
        let batch = match narwhal_shared::kv_events::decode_batch(&bytes) {
            Ok(b) => b,
            Err(err) => {
                tracing::warn!(engine.id = %iid, error = %err, "kv events: the agent's snapshot does not decode");
                return None;
            }
        };
        let now = self.clock.now();
        self.lock()
            .restart(e, snap.next_seq.saturating_sub(1), &batch, now);
        tracing::info!(engine.id = %iid, blocks = snap.blocks, next_seq = snap.next_seq, complete = snap.complete,
            "kv events: index rebuilt from the agent's snapshot (the engine's replay buffer no longer reaches back)");
        Some(snap.next_seq)
    }

    fn mark_replayed(&self, e: usize) {
        self.replayed[e].store(true, std::sync::atomic::Ordering::Release);
    }

    /// Engines with a replay socket whose index was not rebuilt yet since this router
    /// started: `/ready` waits for them, at most `serving.kv_ready_timeout_s`
    /// (docs/design/kv-aware-placement.md, "Exact from the first request"). Empty when cache
    /// awareness is off.
    pub(crate) fn replay_pending(&self) -> Vec<usize> {
        if !self.enabled() {
            return Vec::new();
        }
        self.cfg
            .engines
            .iter()
            .enumerate()
            .filter(|(e, engine)| {
                engine
                    .kv_events
                    .as_ref()
                    .is_some_and(|k| k.replay_endpoint.is_some())
                    && self
                        .ranks
                        .of(*e)
                        .any(|s| !self.replayed[s].load(std::sync::atomic::Ordering::Acquire))
            })
            .map(|(e, _)| e)
            .collect()
    }

    async fn on_message(&self, e: usize, src: &KvEventsSource, m: ZmqMessage) {
        let frames: Vec<Bytes> = m.into_vec();
        let Some((seq, batch)) = narwhal_shared::kv_stream::parse(&frames[..]) else {
            tracing::warn!(engine.id = %self.slot_name(e), "kv events: malformed message; the engine's blocks are dropped");
            self.lock().reset(e);
            return;
        };
        self.ingest(e, seq, batch, true, src.replay_endpoint.as_deref())
            .await;
        let settled = self.replayed[e].load(std::sync::atomic::Ordering::Acquire);
        let exact = {
            let mut ix = self.lock();
            ix.note_live(e, seq);
            // Only until the engine's index was rebuilt once (`replay_pending`).
            !settled
                && matches!(
                    ix.reason(e, self.clock.now()),
                    Reason::Events | Reason::OverCredit
                )
        };
        if exact {
            self.mark_replayed(e);
        }
    }

    /// Applies batch `seq` of engine `e` by the index's sequence rule (`live`: it came on the
    /// live stream, not from a catch-up replay); a gap is replayed from `replay_ep` when given.
    async fn ingest(
        &self,
        e: usize,
        seq: u64,
        batch: KvEventBatch,
        live: bool,
        replay_ep: Option<&str>,
    ) {
        let verdict = self.lock().sequence(e, seq, live);
        let now = self.clock.now();
        match verdict {
            Seq::Next => self.lock().apply(e, seq, &batch, now),
            Seq::Restarted => self.lock().restart(e, seq, &batch, now),
            Seq::Old => {}
            Seq::Gap { from } => {
                let replayed = match replay_ep {
                    Some(ep) => replay(ep, from).await,
                    None => None,
                };
                let now = self.clock.now();
                let filled = self
                    .lock()
                    .fill(e, from, replayed.as_deref(), seq, &batch, now);
                tracing::info!(engine.id = %self.slot_name(e), from, seq, filled, "kv events: sequence gap");
            }
        }
    }

    /// A request's prompt tokens: a token-id prompt as it is; the router's own tokenizer's
    /// (`known` when it already computed them for admission's sizing) unless its shape was
    /// found to differ; else `/tokenize` on the least loaded live engine, with
    /// `engine.tokenize_timeout_s`.
    ///
    /// # Errors
    /// [`TokenizeError`]; counted, and the request is placed by load.
    async fn tokens(
        self: &Arc<Self>,
        fleet: &Fleet,
        body: &Map<String, Value>,
        known: Option<(&[u32], u64)>,
    ) -> Result<(Vec<u32>, Option<usize>), TokenizeError> {
        if let Some(Value::Array(ids)) = body.get("prompt") {
            return ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .map(|t| (t, None))
                .ok_or(TokenizeError::Shape);
        }
        if let Some(tokens) = self.tokens_here(fleet, body, known).await {
            return Ok((tokens, None));
        }
        let req = tokenize_body(&self.cfg.model, body)?;
        let e = {
            let failed = self
                .tokenize_failed
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            tokenize_engine(
                &live_loads(fleet),
                &failed,
                self.clock.now(),
                TOKENIZE_AVOID,
            )
        }
        .ok_or(TokenizeError::NoEngine)?;
        let r = self.tokenize_on(e, &req).await;
        let mut failed = self
            .tokenize_failed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        failed[e] = r.is_err().then(|| self.clock.now());
        r.map(|t| (t, Some(e)))
    }

    /// The sampled tokenizer check ([`sample`]): when the sampler picks another live engine
    /// for this request's shape, the same `/tokenize` body is sent to it off the request
    /// path and its tokens held against `tokens` (what engine `on` gave). A difference is a
    /// mismatch naming both engines and the shape: the score is off for every engine, as after
    /// a probe that differs (one engine's blocks cannot be matched with another's tokens). A
    /// check that cannot be made is made by a later request.
    fn sample_tokenizer(
        self: &Arc<Self>,
        fleet: &Fleet,
        body: &Map<String, Value>,
        on: usize,
        tokens: &[u32],
    ) {
        let Some(shape) = Shape::of(body) else {
            return;
        };
        let live = || live_loads(fleet).into_iter().map(|(e, _)| e).collect();
        let Some(other) = self
            .sampler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pick(shape, on, live)
        else {
            return;
        };
        let Ok(req) = tokenize_body(&self.cfg.model, body) else {
            return;
        };
        let me = self.clone();
        let want = tokens.to_vec();
        tokio::spawn(async move {
            let theirs = match me.tokenize_on(other, &req).await {
                Ok(t) => t,
                Err(err) => {
                    tracing::debug!(error = %err, shape = shape.as_str(), "kv score: sampled tokenizer check not made; a later request makes it");
                    me.sampler
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .failed(shape, other);
                    return;
                }
            };
            me.counts.sampled.fetch_add(1, Ordering::Relaxed);
            if theirs == want {
                return;
            }
            let (a, b) = (&me.cfg.engines[on].iid, &me.cfg.engines[other].iid);
            let detail = format!(
                "{a} and {b} tokenize a {} request differently ({} and {} tokens)",
                shape.as_str(),
                want.len(),
                theirs.len()
            );
            tracing::warn!(detail = %detail, "kv score: the engines' tokenizers disagree on a real request; placing by load only");
            *me.tokenizer_check() = TokenizerCheck::Mismatch(detail);
        });
    }

    async fn tokenize_on(&self, e: usize, req: &Value) -> Result<Vec<u32>, TokenizeError> {
        let engine = &self.cfg.engines[e];
        let fail = |detail: String| TokenizeError::Engine {
            iid: engine.iid.clone(),
            detail,
        };
        let url = format!("{}/tokenize", engine.url);
        let timeout = secs(self.cfg.engine.tokenize_timeout_s);
        let (status, bytes) = self
            .upstream
            .post_json(&url, req, timeout)
            .await
            .map_err(|err| fail(err.to_string()))?;
        if !status.is_success() {
            return Err(fail(format!("status {status}")));
        }
        let doc: Value =
            serde_json::from_slice(&bytes).map_err(|err| fail(format!("answer: {err}")))?;
        doc["tokens"]
            .as_array()
            .and_then(|t| {
                t.iter()
                    .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| fail("answer has no `tokens` list".into()))
    }

    /// The KV score of a request whose body (one prompt) is `body`, to be placed with
    /// `aggregate`: `None` when cache awareness is off, the tokenizers disagree, the tokens
    /// could not be had (counted), placement has at most one engine to choose from while
    /// no profiles are configured (counted `unscored`: the score could change neither the
    /// engine nor a price, and `/tokenize` would cost the request an engine round trip), or
    /// the request carries what vLLM keys its blocks by beyond their tokens
    /// ([`keyed_beyond_tokens`], counted `unscored`): the index keys by tokens only, so its
    /// credit would be wrong.
    pub(crate) async fn score(
        self: &Arc<Self>,
        fleet: &Fleet,
        body: &Map<String, Value>,
        aggregate: Aggregate,
        known: Option<(&[u32], u64)>,
    ) -> Option<Scored> {
        if !self.enabled() {
            return None;
        }
        if let Some(key) = keyed_beyond_tokens(body) {
            self.counts.unscored.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                key,
                "kv score: the engines key this request's blocks by more than its tokens; placing by load"
            );
            return None;
        }
        self.check_tokenizers(fleet).await;
        if matches!(*self.tokenizer_check(), TokenizerCheck::Mismatch(_)) {
            return None;
        }
        // Nothing prices requests without profiles (no role controller, no admission price:
        // controller.md 3.5 and 10.4 count cached tokens), so with one candidate the score
        // would decide nothing.
        let chosen = fleet.choices(aggregate);
        if self.cfg.profiles.is_empty() && chosen.len() <= 1 {
            self.counts.unscored.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let t0 = self.clock.now();
        let tokens = match self.tokens(fleet, body, known).await {
            Ok((t, on)) => {
                if let Some(on) = on {
                    self.sample_tokenizer(fleet, body, on, &t);
                }
                t
            }
            Err(err) => {
                self.counts.failures.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %err, "kv score: no tokens; placing by load");
                return None;
            }
        };
        let spent = self.clock.now().saturating_duration_since(t0);
        self.counts.tokenized.fetch_add(1, Ordering::Relaxed);
        self.counts
            .micros
            .fetch_add(spent.as_micros() as u64, Ordering::Relaxed);
        let now = self.clock.now();
        let n = tokens.len() as u64;
        let seed = prompt_keys(&self.cfg.model, body).seed();
        let mut ix = self.lock();
        // Every engine's entries are bound to its process, re-read only after some engine's
        // process changed.
        if let (epoch, Some(all)) = fleet.incarnations_since(ix.processes_seen()) {
            ix.sync_processes(epoch, &self.ranks.expand(&all));
        }
        self.adopt_carried(fleet, &mut ix, now);
        let mut chains: Vec<(u32, Vec<u64>)> = Vec::new();
        // Engines placement does not choose among (a decode engine of a split, an engine out
        // of placement) get no credit and no expiry walk: only the chosen are scored.
        // Their block size is left unknown (0) until one is placed ([`KvCache::placed`]).
        let engines = self.cfg.engines.len();
        let mut credits = vec![Credit::unscored(0); engines];
        let mut ranks = vec![None; engines];
        let approx_credit = self.cfg.serving.kv_approx_credit;
        let mut uncached_tokens = vec![n; engines];
        // No expiry walk here: a credit never counts an expired entry, and an engine's
        // expired entries are dropped when a request is placed on it (memory is bounded per
        // engine either way).
        for &e in chosen.iter().filter(|e| **e < engines) {
            // An engine with several data-parallel ranks is credited with its best rank
            // (the lowest of equals), where the request is then sent.
            for slot in self.ranks.of(e) {
                let bs = ix.credit_block_size(slot);
                if !chains.iter().any(|(b, _)| *b == bs) {
                    chains.push((bs, keyed_chain(&tokens, bs, seed)));
                }
                let chain = chains
                    .iter()
                    .find(|(b, _)| *b == bs)
                    .map(|(_, c)| c.as_slice())
                    .unwrap_or(&[]);
                let c = ix.credit(slot, chain, n, now);
                if slot == e || c.cached > credits[e].cached {
                    credits[e] = c;
                    ranks[e] = Some(self.ranks.rank(slot));
                }
            }
            if !self.ranks.several(e) || credits[e].cached == 0 {
                ranks[e] = None;
            }
            uncached_tokens[e] = uncached(n, &credits[e], approx_credit);
        }
        Some(Scored {
            score: KvScore {
                uncached: uncached_tokens,
                balance: Balance {
                    abs: self.cfg.serving.kv_balance_abs_threshold,
                    rel: self.cfg.serving.kv_balance_rel_threshold,
                },
            },
            credits,
            prompt_tokens: n,
            chains,
            ranks,
        })
    }

    /// A request engine `e` computed and answered was credited `credited` prompt tokens
    /// (`reported` of them from blocks its events reported held) and served `engine` tokens
    /// from its prefix cache by its own count: held against each other
    /// (docs/design/kv-aware-placement.md, section 6.1). An engine over-credited
    /// [`crate::kv_index::check::SUSPECT_AFTER`] times in a row is `suspect`, placed by load
    /// until it agrees again; each change is logged.
    /// `rank`: the data-parallel rank the request was sent to ([`Scored::ranks`]); a request
    /// left to an engine with several ranks is not checked (which rank ran it is unknown).
    pub(crate) fn check_credit(
        &self,
        e: usize,
        rank: Option<u32>,
        reported: u64,
        credited: u64,
        engine: u64,
    ) {
        let Some(slot) = self.slot_of(e, rank) else {
            return;
        };
        let (verdict, changed) = self.lock().observe(slot, reported, credited, engine);
        if changed {
            let iid = &self.cfg.engines[e].iid;
            match verdict {
                Verdict::Over(tokens) => tracing::warn!(
                    engine.id = %iid,
                    reported,
                    engine_cached = engine,
                    over = tokens,
                    "kv credit: the engine's own cached-token counts fell short of its KV events request after request; placing it by load (suspect) until they agree again"
                ),
                Verdict::Agree | Verdict::Under(_) => tracing::info!(
                    engine.id = %iid,
                    "kv credit: the engine's cached-token counts agree with its KV events again; its credit is used (exact)"
                ),
            }
        }
    }

    /// The request scored `s` was placed on engine `e`: its prompt's blocks are credited to
    /// `e`'s approximate part, and the stale clock starts when it must store blocks.
    pub(crate) fn placed(&self, e: usize, s: &Scored) {
        let now = self.clock.now();
        let c = s.credits[e];
        // A request left to an engine's own choice of rank: which rank computes it is
        // unknown, so no rank is credited (its events will tell).
        let Some(e) = self.slot_of(e, s.ranks.get(e).copied().flatten()) else {
            return;
        };
        let mut ix = self.lock();
        // An engine the score did not walk: its credit's block size is read now.
        let bs = if c.block_size == 0 {
            ix.credit_block_size(e)
        } else {
            c.block_size
        };
        ix.placed(e, s.chain(bs), bs, c.stores, now);
    }

    /// The index slot of engine `e`'s rank `rank`: the engine's own slot when it has one
    /// rank; `None` for an engine with several when no rank was chosen.
    fn slot_of(&self, e: usize, rank: Option<u32>) -> Option<usize> {
        match rank {
            Some(r) => self.ranks.slot(e, r),
            None if self.ranks.several(e) => None,
            None => Some(e),
        }
    }

    fn tokenizer_check(&self) -> MutexGuard<'_, TokenizerCheck> {
        self.tokenizer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks once (again after a failure) that two live engines tokenize the probe prompt
    /// alike; a mismatch or failure is logged and shown in `/narwhal/state`.
    async fn check_tokenizers(&self, fleet: &Fleet) {
        if matches!(
            *self.tokenizer_check(),
            TokenizerCheck::Agree | TokenizerCheck::Mismatch(_)
        ) {
            return;
        }
        // Live engines whose /tokenize did not just fail: a stalled engine is not probed
        // again on every request (each probe would wait `engine.tokenize_timeout_s`).
        let live: Vec<usize> = {
            let failed = self
                .tokenize_failed
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let now = self.clock.now();
            live_loads(fleet)
                .into_iter()
                .map(|(e, _)| e)
                .filter(|e| {
                    failed[*e].is_none_or(|t| now.saturating_duration_since(t) >= TOKENIZE_AVOID)
                })
                .collect()
        };
        let [a, b, ..] = live[..] else { return };
        let req = json!({"model": self.cfg.model, "prompt": PROBE_PROMPT});
        let (ra, rb) = tokio::join!(self.tokenize_on(a, &req), self.tokenize_on(b, &req));
        {
            let mut failed = self
                .tokenize_failed
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let now = self.clock.now();
            failed[a] = ra.is_err().then_some(now);
            failed[b] = rb.is_err().then_some(now);
        }
        let names = fleet.names();
        let verdict = match (ra, rb) {
            (Ok(x), Ok(y)) if x == y => TokenizerCheck::Agree,
            (Ok(_), Ok(_)) => TokenizerCheck::Mismatch(format!(
                "{} and {} tokenize the probe prompt differently",
                names[a], names[b]
            )),
            (Err(err), _) | (_, Err(err)) => TokenizerCheck::Failed(err.to_string()),
        };
        match &verdict {
            TokenizerCheck::Agree => {}
            TokenizerCheck::Mismatch(d) => {
                tracing::warn!(detail = %d, "kv score: the engines' tokenizers disagree; placing by load only");
            }
            other => {
                tracing::warn!(detail = ?other.detail(), "kv score: tokenizer check failed; retried on the next request")
            }
        }
        *self.tokenizer_check() = verdict;
    }

    /// Per engine (config order), a snapshot for `/narwhal/state` and `/metrics`; every
    /// engine is `none` (`tokenizer_mismatch`) while the tokenizers disagree, since nothing is
    /// scored then.
    pub(crate) fn views(&self) -> Vec<EngineView> {
        let now = self.clock.now();
        let mismatch = matches!(*self.tokenizer_check(), TokenizerCheck::Mismatch(_));
        let ix = self.lock();
        (0..self.cfg.engines.len())
            .map(|e| {
                let mut v = ix.view(e, now);
                // An engine with several ranks: the first rank that is not `exact` shows its
                // mode (one rank's stale stream is the engine's), the counts are summed.
                for s in self.ranks.of(e).skip(1) {
                    let r = ix.view(s, now);
                    if v.mode == Mode::Exact && r.mode != Mode::Exact {
                        (v.mode, v.reason) = (r.mode, r.reason);
                    }
                    v.lag_s = match (v.lag_s, r.lag_s) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    };
                    v.merge(&r);
                }
                if mismatch && v.reason != Reason::Off {
                    v.reason = Reason::TokenizerMismatch;
                    v.mode = Mode::None;
                }
                v
            })
            .collect()
    }

    /// The tokenizer check's state.
    pub(crate) fn tokenizer(&self) -> TokenizerCheck {
        self.tokenizer_check().clone()
    }

    /// The KV score's counts so far.
    pub(crate) fn tokenize_counts(&self) -> TokenizeCounts {
        let local = self.local().map(|l| l.counts).unwrap_or_default();
        TokenizeCounts {
            tokenized: self.counts.tokenized.load(Ordering::Relaxed),
            failures: self.counts.failures.load(Ordering::Relaxed),
            seconds: self.counts.micros.load(Ordering::Relaxed) as f64 / 1e6,
            unscored: self.counts.unscored.load(Ordering::Relaxed),
            sampled: self.counts.sampled.load(Ordering::Relaxed),
            local: local.tokenized,
            local_seconds: local.micros as f64 / 1e6,
            local_fallbacks: local.fallbacks,
            local_checked: local.checked,
        }
    }
}

fn live_loads(fleet: &Fleet) -> Vec<(usize, u32)> {
    fleet.live_loads()
}

/// vLLM's replay ([`narwhal_shared::kv_stream::replay`]) with [`REPLAY_TIMEOUT`].
async fn replay(endpoint: &str, from: u64) -> Option<Vec<(u64, KvEventBatch)>> {
    narwhal_shared::kv_stream::replay(endpoint, from, REPLAY_TIMEOUT).await
}
