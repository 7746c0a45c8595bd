//! HTTP front end: connection loop (hyper HTTP/1), routing, and the completion pipeline per
//! dialect and phase.
//!
//! ```text
//!  TCP ─► hyper http1 conn (kill switch for "drop" faults) ─► route()
//!    /v1/completions, /v1/chat/completions ─► parse ─► phase ─► Tracker ─► fault ─► serve_phase
//!        prefill:    compute (ttft + per-token) ─► issue blocks / publish room ─► 1 answer
//!        decode:     side channel read / room pull ─► hash check ─► kv_transfer delay ─► tokens
//!        aggregated: compute ─► tokens (kv.recomputed where decode-capable)
//!    /health /v1/models /tokenize /version /metrics /server_info /get_model_info
//!  admin listener (--admin-listen, tests only) ─► /sim/faults /sim/stats /sim/stats/reset
//! ```
//!
//! The engine listener serves only what the impersonated engine serves (`/sim/*` is a 404
//! there, as on a real engine), so product code cannot come to depend on a test hook.
//!
//! The rules come from docs/engine-simulator.md (the simulator's contract) and
//! docs/design/behaviour.md sections 7.1 to 7.3 (what the router sends and expects).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::body::{SimBody, StreamPlan, TokenStream};
use crate::faults::{Action, FaultQueue, Phase, parse_faults};
use crate::kv::{BlockStore, KvPayload, RoomError, RoomState, RoomStore};
use crate::kv_events::Publisher;
use crate::prefix_cache::{CacheCounters, Keys, Lookup, PrefixCache};
use crate::protocol::{
    self, ApiError, ChunkFormat, Kind, KvParams, Limits, Parsed, error_frames, full_response,
};
use crate::stats::{Outcome, Stats, Tracker};
use crate::tokenizer;
use crate::transfer::{self, TransferError};
use narwhal_testkit::kv_events::{KvEvent, MEDIUM_GPU};

/// Largest request body accepted (bytes).
const MAX_BODY: usize = 32 << 20;

/// Longest an SGLang decode waits for its room to be published (bounded further by the lease).
const ROOM_WAIT_MAX: Duration = Duration::from_secs(5);

/// Bound on a vLLM side-channel read reply.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Version reported by vLLM's `GET /version`.
pub(crate) const VLLM_VERSION: &str = "0.11.0-sim";
/// Version reported by SGLang's `GET /server_info`.
pub(crate) const SGLANG_VERSION: &str = "0.5.3-sim";

/// Which engine the simulator impersonates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Dialect {
    /// vLLM OpenAI server with the NIXL connector.
    Vllm,
    /// SGLang server with bootstrap disaggregation.
    Sglang,
}

impl Dialect {
    /// Wire name.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Dialect::Vllm => "vllm",
            Dialect::Sglang => "sglang",
        }
    }
}

/// SGLang `--disaggregation-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// Aggregated serving.
    Null,
    /// Prefill server with a bootstrap server.
    Prefill,
    /// Decode server pulling from prefill bootstrap servers.
    Decode,
}

impl Mode {
    /// Wire name.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Null => "null",
            Mode::Prefill => "prefill",
            Mode::Decode => "decode",
        }
    }
}

/// Behaviour settings of a running simulator (from the CLI; units in the names).
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// `--model`: the served model name.
    pub(crate) model: String,
    /// `--dialect`.
    pub(crate) dialect: Dialect,
    /// `--engine-id` (or a random UUID).
    pub(crate) engine_id: String,
    /// `--seed`.
    pub(crate) seed: u64,
    /// `--ttft-ms`: wait before the first token in every phase.
    pub(crate) ttft: Duration,
    /// `--prefill-us-per-token`: local prefill compute per prompt token.
    pub(crate) prefill_per_token: Duration,
    /// `--tpot-ms`: gap between streamed tokens.
    pub(crate) tpot: Duration,
    /// `--kv-transfer-ms`: consumer-side delay of a successful transfer.
    pub(crate) kv_transfer: Duration,
    /// `--kv-lease-s`: how long a producer holds unread KV.
    pub(crate) kv_lease: Duration,
    /// `--disaggregation-mode` (SGLang).
    pub(crate) mode: Mode,
    /// `--max-running` (0 = unlimited).
    pub(crate) max_running: u64,
    /// `--max-model-len` in tokens.
    pub(crate) max_model_len: u64,
    /// `/metrics` carries the engine's KV-transfer families (off with `--no-kv-metrics`, an
    /// engine or version that publishes none).
    pub(crate) kv_metrics: bool,
    /// `--enable-pd-role-switch` (SGLang): `POST /pd_role_switch` may change the
    /// disaggregation mode at runtime.
    pub(crate) role_switch: bool,
    /// `--prefill-slots` (0 = unlimited): prefills computed at once; the rest wait FIFO, as
    /// on one accelerator.
    pub(crate) prefill_slots: usize,
    /// `--max-num-seqs` (0 = unlimited): requests running at once; the rest wait FIFO, as in
    /// vLLM's scheduler (`max_num_running_reqs`).
    pub(crate) max_num_seqs: usize,
    /// `--tpot-per-running-us`: each token gap grows by this per request running on the
    /// engine (a decode batch's cost).
    pub(crate) tpot_per_running: Duration,
    /// `--tpot-per-kv-block-us`: each token gap grows by this per block running requests
    /// hold (`--kv-pool`).
    pub(crate) tpot_per_kv_block: Duration,
    /// `--kv-pool`: running requests hold their blocks in the prefix cache's capacity.
    pub(crate) kv_pool: bool,
    /// `--block-size`, `--kv-cache-blocks`, `--[no-]enable-prefix-caching`.
    pub(crate) cache: CacheSettings,
    /// `VLLM_SERVER_DEV_MODE=1`: vLLM's development routes (`POST /reset_prefix_cache`).
    pub(crate) dev_mode: bool,
    /// `--api-key`: the bearer token [`unauthorized`] requires on the guarded paths.
    pub(crate) api_key: Option<String>,
    /// `--enable-prompt-tokens-details`: usage carries `prompt_tokens_details`.
    pub(crate) prompt_tokens_details: bool,
    /// `--lora-modules`: the adapters' names.
    pub(crate) adapters: Vec<String>,
    /// Whether the chat template renders `tools` (`--template-without-tools`: not).
    pub(crate) render_tools: bool,
    /// `--data-parallel-size`: ranks, each with its own prefix cache and KV events.
    pub(crate) data_parallel_size: usize,
}

/// The path prefixes vLLM's `--api-key` guards (its `AuthenticationMiddleware`; everything
/// else, `/health`, `/metrics`, `/version`, `/tokenize`, is open).
const GUARDED_PREFIXES: [&str; 4] = ["/v1", "/v2", "/inference", "/cohere"];

/// vLLM's `--api-key` check: a request on a guarded path (any method but OPTIONS) without
/// `Authorization: Bearer <key>` (scheme case-insensitive, the key compared exactly) is
/// answered 401 `{"error": "Unauthorized"}` before routing, so an unknown guarded path is 401
/// too. `None` lets the request through.
fn unauthorized(sim: &Sim, req: &Request<Incoming>) -> Option<Response<SimBody>> {
    let key = sim.cfg.api_key.as_deref()?;
    let path = req.uri().path();
    if req.method() == Method::OPTIONS || !GUARDED_PREFIXES.iter().any(|p| path.starts_with(p)) {
        return None;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ').unwrap_or((v, ""));
            scheme.eq_ignore_ascii_case("bearer").then_some(token)
        });
    if given == Some(key) {
        return None;
    }
    sim.stats.unauthorized.fetch_add(1, Relaxed);
    Some(json_response(401, &json!({"error": "Unauthorized"})))
}

/// The prefix cache's settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheSettings {
    /// Tokens per block.
    pub(crate) block_size: usize,
    /// Capacity in blocks.
    pub(crate) blocks: usize,
    /// Prefix caching on (vLLM V1's default).
    pub(crate) enabled: bool,
    /// Seed of the block hash chain (random per process unless `PYTHONHASHSEED` is set).
    pub(crate) seed: u64,
}

/// Which listener a connection arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Surface {
    /// `--listen`: the engine's own HTTP surface.
    Engine,
    /// `--admin-listen`: the test hooks.
    Admin,
    /// The engine's surface plus the test hooks: only when the simulator was started without
    /// `--admin-listen`, for scripts written before the admin listener existed.
    EngineWithHooks,
}

/// SGLang rooms plus the decode requests waiting for them.
pub(crate) struct Rooms {
    /// Published rooms.
    pub(crate) store: RoomStore,
    /// Wake-ups of decode pulls waiting for a room, by room id.
    pub(crate) waiters: HashMap<u64, Vec<tokio::sync::oneshot::Sender<()>>>,
}

/// Shared state of one simulator process.
pub(crate) struct Sim {
    /// Behaviour settings.
    pub(crate) cfg: Settings,
    /// This process's engine id (`remote_engine_id` of the descriptors it issues).
    pub(crate) engine_id: String,
    /// `http://host:port` of the HTTP listener.
    pub(crate) url: String,
    /// vLLM side channel address (`remote_host`/`remote_port`).
    pub(crate) kv_addr: Option<SocketAddr>,
    /// SGLang bootstrap server address (prefill mode).
    pub(crate) bootstrap_addr: Option<SocketAddr>,
    /// Counters and the recent ring.
    pub(crate) stats: Arc<Stats>,
    /// Process start, Unix seconds (the value `/proc` gives).
    pub(crate) started_at: f64,
    faults: Mutex<FaultQueue>,
    faults_armed: AtomicBool,
    /// The scheduler's live disaggregation mode (SGLang; `cfg.mode` is the launch mode).
    mode: Mutex<Mode>,
    /// `--prefill-slots` permits (`None` = unlimited).
    prefill_gate: Option<Arc<tokio::sync::Semaphore>>,
    /// `--max-num-seqs` permits (`None` = unlimited): a request runs holding one.
    seq_gate: Option<Arc<tokio::sync::Semaphore>>,
    /// `--kv-pool`: each data-parallel rank's waiting queue head (held while a request waits
    /// for blocks, so the others wait behind it, as in vLLM's FCFS queue; one scheduler per
    /// rank) and the wake-up of a release.
    kv_queues: Vec<tokio::sync::Mutex<()>>,
    kv_freed: tokio::sync::Notify,
    /// A failed role switch left the instance unhealthy (SGLang: restart required).
    switch_unhealthy: AtomicBool,
    blocks: Mutex<BlockStore>,
    rooms: Mutex<Rooms>,
    /// The block prefix cache of each data-parallel rank (`--data-parallel-size`; short
    /// critical sections only).
    caches: Vec<Mutex<PrefixCache>>,
    /// `--kv-events-config`: where each rank's cache events go, when on (empty when off).
    events: Vec<Publisher>,
    /// The rank the next request without `X-data-parallel-rank` runs on (round robin, as
    /// vLLM's balancer spreads an idle engine's requests).
    next_rank: AtomicU64,
    /// Prompt tokens by source (`vllm:prompt_tokens_by_source`).
    pub(crate) sources: crate::metrics::PromptSources,
    id_prefix: u64,
    id_counter: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No critical section can leave these structures half-updated; keep serving after a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The blocks a running request holds under `--kv-pool`, given back when it is dropped (the
/// request settled or went away), waking the requests waiting for blocks.
struct KvHold {
    sim: Arc<Sim>,
    rank: usize,
    held: Option<crate::prefix_cache::Held>,
}

impl Drop for KvHold {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            lock(&self.sim.caches[self.rank]).release(held);
            self.sim.note_kv_used();
        }
        self.sim.kv_freed.notify_waiters();
    }
}

impl Sim {
    /// Builds the state; listeners are bound by the caller.
    pub(crate) fn new(
        cfg: Settings,
        url: String,
        kv_addr: Option<SocketAddr>,
        bootstrap_addr: Option<SocketAddr>,
        started_at: f64,
        events: Vec<Publisher>,
    ) -> Self {
        let mode = cfg.mode;
        let c = cfg.cache;
        let ranks = cfg.data_parallel_size.max(1);
        let prefill_gate = (cfg.prefill_slots > 0)
            .then(|| Arc::new(tokio::sync::Semaphore::new(cfg.prefill_slots)));
        let seq_gate =
            (cfg.max_num_seqs > 0).then(|| Arc::new(tokio::sync::Semaphore::new(cfg.max_num_seqs)));
        Sim {
            engine_id: cfg.engine_id.clone(),
            blocks: Mutex::new(BlockStore::new(cfg.kv_lease)),
            rooms: Mutex::new(Rooms {
                store: RoomStore::new(cfg.kv_lease),
                waiters: HashMap::new(),
            }),
            caches: (0..cfg.data_parallel_size.max(1))
                .map(|_| Mutex::new(PrefixCache::new(c.block_size, c.blocks, c.enabled, c.seed)))
                .collect(),
            events,
            next_rank: AtomicU64::new(0),
            sources: Default::default(),
            cfg,
            url,
            kv_addr,
            bootstrap_addr,
            stats: Arc::new(Stats::default()),
            started_at,
            faults: Mutex::new(FaultQueue::default()),
            faults_armed: AtomicBool::new(false),
            mode: Mutex::new(mode),
            prefill_gate,
            seq_gate,
            kv_queues: (0..ranks).map(|_| tokio::sync::Mutex::new(())).collect(),
            kv_freed: tokio::sync::Notify::new(),
            switch_unhealthy: AtomicBool::new(false),
            id_prefix: rand::random::<u64>(),
            id_counter: AtomicU64::new(0),
        }
    }

    /// A place in the running set under `--max-num-seqs`, waited for FIFO (counted in
    /// `waiting` meanwhile, also when the request goes away while it waits); `None` when
    /// unbounded.
    pub(crate) async fn seat(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let gate = self.seq_gate.as_ref()?;
        let _waiting = crate::stats::Waiting::new(&self.stats);
        gate.clone().acquire_owned().await.ok()
    }

    /// Runs `compute` of prefill work, queued FIFO behind `--prefill-slots` prefills.
    pub(crate) async fn prefill(&self, compute: Duration) {
        let _slot = match &self.prefill_gate {
            Some(g) => g.clone().acquire_owned().await.ok(),
            None => None,
        };
        sleep(compute).await;
    }

    /// Looks `prompt` (keyed beyond its tokens by `keys`) up in the prefix cache of
    /// data-parallel rank `rank` (vLLM's `X-data-parallel-rank`; `None` or a rank the engine
    /// does not have: the next rank in turn), counted in its queries and hits.
    pub(crate) fn cache_lookup(&self, prompt: &[u32], keys: &Keys, rank: Option<usize>) -> Lookup {
        let n = self.caches.len();
        let rank = rank
            .filter(|r| *r < n)
            .unwrap_or_else(|| (self.next_rank.fetch_add(1, Relaxed) as usize) % n);
        let mut l = lock(&self.caches[rank]).lookup(prompt, keys);
        l.rank = rank;
        l
    }

    /// Schedules a request under `--kv-pool` ([`PrefixCache::admit`] on data-parallel rank
    /// `rank`, chosen as [`Sim::cache_lookup`] chooses): waits, first in line, until its prompt
    /// and `output_tokens` fit beside what running requests hold (counted in `waiting`
    /// meanwhile), publishes the events of its store (unless `publish` is false: a
    /// `mute_kv_events` fault), and has `tracker` hold its blocks until it is settled.
    pub(crate) async fn kv_admit(
        self: &Arc<Self>,
        prompt: &[u32],
        keys: &Keys,
        rank: Option<usize>,
        output_tokens: usize,
        publish: bool,
        tracker: &mut crate::stats::Tracker,
    ) -> Result<Lookup, ApiError> {
        let n = self.caches.len();
        let rank = rank
            .filter(|r| *r < n)
            .unwrap_or_else(|| (self.next_rank.fetch_add(1, Relaxed) as usize) % n);
        if !lock(&self.caches[rank]).fits_ever(prompt.len() + output_tokens) {
            return Err(ApiError::bad_request(format!(
                "the prompt's {} tokens and max_tokens {output_tokens} need more KV blocks than the \
                 engine has (--kv-cache-blocks {} of --block-size {})",
                prompt.len(),
                self.cfg.cache.blocks,
                self.cfg.cache.block_size
            )));
        }
        // Counted waiting from here: behind the queue's head too.
        let _waiting = crate::stats::Waiting::new(&self.stats);
        let _head = self.kv_queues[rank].lock().await;
        loop {
            let freed = self.kv_freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let admitted = lock(&self.caches[rank]).admit(prompt, keys, output_tokens);
            if let Some((mut l, mut events, held)) = admitted {
                self.note_kv_used();
                l.rank = rank;
                if self.cfg.dialect == Dialect::Sglang {
                    events = events.into_iter().map(|e| keys.as_sglang(e)).collect();
                }
                if publish
                    && !events.is_empty()
                    && let Some(p) = self.events.get(rank)
                {
                    p.publish(events);
                }
                tracker.hold_kv(Box::new(KvHold {
                    sim: self.clone(),
                    rank,
                    held: Some(held),
                }));
                return Ok(l);
            }
            freed.await;
        }
    }

    /// Records the blocks running requests hold over every rank (`--kv-pool`): the token
    /// gap's and `vllm:kv_cache_usage_perc`'s input.
    fn note_kv_used(&self) {
        let used: usize = self.caches.iter().map(|c| lock(c).used()).sum();
        self.stats.kv_used.store(used as u64, Relaxed);
    }

    /// Stores `prompt`'s computed full blocks and, when `publish` (no `mute_kv_events`
    /// fault), publishes the batch of events it caused (nothing when they were stored when
    /// the request was scheduled, `--kv-pool`).
    pub(crate) fn cache_store(&self, prompt: &[u32], lookup: &Lookup, publish: bool) {
        if lookup.stored {
            return;
        }
        let mut events = lock(&self.caches[lookup.rank]).store(prompt, lookup);
        if self.cfg.dialect == Dialect::Sglang {
            events = events
                .into_iter()
                .map(|e| lookup.keys.as_sglang(e))
                .collect();
        }
        if let Some(p) = self.events.get(lookup.rank).filter(|_| publish) {
            p.publish(events);
        }
    }

    /// A prompt's KV is in place (computed, or `external` tokens of it transferred): counts
    /// its tokens by source and stores its full blocks (their events published when
    /// `publish`).
    pub(crate) fn computed(&self, prompt: &[u32], lookup: &Lookup, external: usize, publish: bool) {
        self.sources
            .count(prompt.len(), lookup.hit_tokens, external);
        self.cache_store(prompt, lookup, publish);
    }

    /// `POST /sim/kv_events/churn`: publishes `n` batches on rank 0's stream, each storing and
    /// then removing one block no prompt has (a busy engine's traffic of other prompts,
    /// without its compute), so a replay buffer moves on past the batches before; the cache
    /// is unchanged. The batches published (0 without KV events).
    pub(crate) fn churn(&self, n: u64) -> u64 {
        let Some(p) = self.events.first() else {
            return 0;
        };
        let bs = self.cfg.cache.block_size;
        for i in 0..n {
            // Far from any prefix hash (a simulator's hashes are 64-bit and seeded).
            let h = 0xc4u64 << 56 | i;
            p.publish(vec![
                KvEvent::BlockStored {
                    block_hashes: vec![h],
                    parent_block_hash: None,
                    token_ids: vec![tokenizer::VOCAB - 1; bs],
                    block_size: bs as u32,
                    lora_id: None,
                    medium: Some(MEDIUM_GPU.to_string()),
                    lora_name: None,
                    extra_keys: Some(vec![None]),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".to_string()),
                    session_id: None,
                    cache_salt: None,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![h],
                    medium: Some(MEDIUM_GPU.to_string()),
                    group_idx: Some(0),
                },
            ]);
        }
        n
    }

    /// Empties the prefix cache (`POST /reset_prefix_cache`) and publishes `AllBlocksCleared`;
    /// `false` (nothing cleared) while running requests hold blocks (`--kv-pool`), as vLLM
    /// refuses then. Without `--kv-pool` no request holds blocks between steps: it succeeds.
    pub(crate) fn reset_prefix_cache(&self) -> bool {
        if self.caches.iter().any(|c| lock(c).refuses_reset()) {
            return false;
        }
        for (rank, cache) in self.caches.iter().enumerate() {
            let ev = lock(cache).reset();
            if let (Some(p), Some(ev)) = (self.events.get(rank), ev) {
                p.publish(vec![ev]);
            }
        }
        true
    }

    /// The prefix cache's counters (`/sim/stats` `prefix_cache`, `/metrics`).
    pub(crate) fn cache_counters(&self) -> CacheCounters {
        self.caches
            .iter()
            .map(|c| lock(c).counters())
            .reduce(CacheCounters::add)
            .unwrap_or_default()
    }

    /// The live disaggregation mode (SGLang).
    pub(crate) fn mode(&self) -> Mode {
        *lock(&self.mode)
    }

    /// The vLLM producer block store (short critical sections only).
    pub(crate) fn blocks_lock(&self) -> MutexGuard<'_, BlockStore> {
        lock(&self.blocks)
    }

    /// The SGLang rooms and their waiters (short critical sections only).
    pub(crate) fn rooms_lock(&self) -> MutexGuard<'_, Rooms> {
        lock(&self.rooms)
    }

    /// A fresh 32-hex-digit id (process-random prefix + counter).
    fn new_id(&self) -> String {
        let n = self.id_counter.fetch_add(1, Relaxed);
        format!("{:016x}{:016x}", self.id_prefix, n)
    }

    fn take_fault(&self, phase: Phase) -> Option<Action> {
        if !self.faults_armed.load(Relaxed) {
            return None;
        }
        let mut q = lock(&self.faults);
        let a = q.take(phase);
        self.faults_armed.store(!q.is_empty(), Relaxed);
        a
    }

    /// Queues faults given as the body of `POST /sim/faults` (`--faults` at startup).
    ///
    /// # Errors
    /// The parser's message.
    pub(crate) fn arm(&self, body: &[u8]) -> Result<(), String> {
        let fs = parse_faults(body).map_err(|e| e.to_string())?;
        let mut q = lock(&self.faults);
        q.push(fs);
        self.faults_armed.store(!q.is_empty(), Relaxed);
        Ok(())
    }

    /// Phase of a parsed request (docs/engine-simulator.md, "Phases").
    fn phase_of(&self, p: &Parsed) -> Phase {
        match self.cfg.dialect {
            Dialect::Vllm => match p.kv {
                KvParams::RemoteDecode => Phase::Prefill,
                KvParams::RemotePrefill(_) | KvParams::BadRemotePrefill(_) => Phase::Decode,
                KvParams::None => Phase::Aggregated,
            },
            Dialect::Sglang => match (self.mode(), &p.bootstrap) {
                (Mode::Prefill, Some(_)) => Phase::Prefill,
                (Mode::Decode, Some(_)) => Phase::Decode,
                _ => Phase::Aggregated,
            },
        }
    }

    /// Frees expired KV; called by the sweeper task.
    pub(crate) fn expire(&self, now: Instant) {
        let n = self.blocks_lock().expire(now);
        let m = self.rooms_lock().store.expire(now);
        if n + m > 0 {
            self.stats.kv_expired.fetch_add(n + m, Relaxed);
        }
    }

    fn publish_room(&self, room: u64, state: RoomState) -> Result<(), RoomError> {
        let mut g = self.rooms_lock();
        g.store.publish(Instant::now(), room, state)?;
        if let Some(ws) = g.waiters.remove(&room) {
            for w in ws {
                let _ = w.send(());
            }
        }
        Ok(())
    }
}

/// Serves HTTP/1 on `listener` (the engine's or the admin `surface`) until the process exits.
pub(crate) async fn serve_http(listener: TcpListener, sim: Arc<Sim>, surface: Surface) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let sim = sim.clone();
        tokio::spawn(async move {
            let kill = CancellationToken::new();
            let k2 = kill.clone();
            let svc = service_fn(move |req| {
                let sim = sim.clone();
                let kill = k2.clone();
                async move {
                    Ok::<_, Infallible>(match surface {
                        Surface::Engine => route(sim, kill, req).await,
                        Surface::Admin => route_admin(sim, req).await,
                        Surface::EngineWithHooks if req.uri().path().starts_with("/sim/") => {
                            route_admin(sim, req).await
                        }
                        Surface::EngineWithHooks => route(sim, kill, req).await,
                    })
                }
            });
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .serve_connection(TokioIo::new(stream), svc);
            tokio::select! {
                _ = conn => {}
                _ = kill.cancelled() => {}
            }
        });
    }
}

fn json_response(status: u16, v: &Value) -> Response<SimBody> {
    json_bytes(status, serde_json::to_vec(v).unwrap_or_default(), None)
}

fn json_bytes(status: u16, bytes: Vec<u8>, fragment: Option<usize>) -> Response<SimBody> {
    let mut r = Response::new(SimBody::fragmented(bytes, fragment));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

pub(crate) fn text_response(status: u16, ctype: &'static str, body: String) -> Response<SimBody> {
    let mut r = Response::new(SimBody::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    r
}

fn sse_response(body: SimBody) -> Response<SimBody> {
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

fn api_error(e: &ApiError) -> Response<SimBody> {
    json_response(e.status, &e.body())
}

fn detail(status: u16, msg: &str) -> Response<SimBody> {
    json_response(status, &json!({ "detail": msg }))
}

async fn read_body(body: Incoming) -> Result<Bytes, ApiError> {
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) => Err(ApiError::bad_request(format!(
            "could not read the request body (limit {MAX_BODY} bytes): {e}"
        ))),
    }
}

async fn route(
    sim: Arc<Sim>,
    kill: CancellationToken,
    req: Request<Incoming>,
) -> Response<SimBody> {
    let vllm = sim.cfg.dialect == Dialect::Vllm;
    if let Some(refused) = unauthorized(&sim, &req) {
        return refused;
    }
    let path = req.uri().path().to_string();
    let m = req.method().clone();
    match (path.as_str(), &m) {
        ("/v1/completions", &Method::POST) => completion(&sim, &kill, Kind::Completion, req).await,
        ("/v1/chat/completions", &Method::POST) => completion(&sim, &kill, Kind::Chat, req).await,
        ("/health", &Method::GET) => health(&sim).await,
        ("/v1/models", &Method::GET) => models(&sim),
        ("/tokenize", &Method::POST) => tokenize(&sim, req).await,
        ("/version", &Method::GET) if vllm => json_response(200, &json!({"version": VLLM_VERSION})),
        ("/metrics", &Method::GET) => crate::metrics::metrics(&sim),
        ("/reset_prefix_cache", &Method::POST) if vllm && sim.cfg.dev_mode => {
            json_response(200, &json!({"success": sim.reset_prefix_cache()}))
        }
        ("/server_info" | "/get_server_info", &Method::GET) if !vllm => server_info(&sim),
        ("/pd_role_switch", &Method::POST) if !vllm => pd_role_switch(&sim, req).await,
        ("/get_model_info", &Method::GET) if !vllm => json_response(
            200,
            &json!({"model_path": sim.cfg.model, "tokenizer_path": sim.cfg.model,
                    "is_generation": true}),
        ),
        (
            "/v1/completions"
            | "/v1/chat/completions"
            | "/health"
            | "/v1/models"
            | "/tokenize"
            | "/metrics",
            _,
        ) => detail(405, "Method Not Allowed"),
        _ => detail(404, "Not Found"),
    }
}

/// The admin listener: fault injection and statistics (docs/engine-simulator.md, "Test
/// hooks"). Nothing else is served here.
async fn route_admin(sim: Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let path = req.uri().path().to_string();
    let m = req.method().clone();
    match (path.as_str(), &m) {
        ("/sim/faults", &Method::GET) => {
            let list = lock(&sim.faults).list();
            json_response(200, &json!({ "faults": list }))
        }
        ("/sim/faults", &Method::POST) => match read_body(req.into_body()).await {
            Err(e) => api_error(&e),
            Ok(b) => match parse_faults(&b) {
                Err(e) => json_response(400, &json!({"error": e.to_string()})),
                Ok(fs)
                    if sim.cfg.dialect == Dialect::Sglang
                        && fs
                            .iter()
                            .any(|(_, a)| *a == Action::FailTransfer { recompute: true }) =>
                {
                    json_response(
                        400,
                        &json!({"error": "fault field \"policy\" = \"recompute\" is vLLM's \
                            kv_load_failure_policy; SGLang aborts a failed transfer (use \
                            \"fail\")"}),
                    )
                }
                Ok(fs) => {
                    let n = fs.len();
                    let mut q = lock(&sim.faults);
                    q.push(fs);
                    sim.faults_armed.store(!q.is_empty(), Relaxed);
                    json_response(200, &json!({"queued": n, "faults": q.list()}))
                }
            },
        },
        ("/sim/faults", &Method::DELETE) => {
            let mut q = lock(&sim.faults);
            let n = q.list().len();
            q.clear();
            sim.faults_armed.store(false, Relaxed);
            json_response(200, &json!({ "cleared": n }))
        }
        ("/sim/stats", &Method::GET) => {
            let doc = sim.stats.doc(
                &sim.engine_id,
                sim.cfg.dialect.as_str(),
                &sim.cfg.model,
                sim.started_at,
            );
            let mut doc = serde_json::to_value(&doc).unwrap_or_default();
            doc["prefix_cache"] = serde_json::to_value(sim.cache_counters()).unwrap_or_default();
            json_bytes(200, serde_json::to_vec(&doc).unwrap_or_default(), None)
        }
        ("/sim/stats/reset", &Method::POST) => {
            sim.stats.reset();
            json_response(200, &json!({ "reset": true }))
        }
        ("/sim/kv_events/churn", &Method::POST) => match read_body(req.into_body()).await {
            Err(e) => api_error(&e),
            Ok(b) => match serde_json::from_slice::<Value>(&b)
                .ok()
                .and_then(|v| v["batches"].as_u64())
            {
                Some(n) => json_response(200, &json!({ "published": sim.churn(n) })),
                None => json_response(400, &json!({"error": "body must be {\"batches\": N}"})),
            },
        },
        ("/sim/faults" | "/sim/stats" | "/sim/stats/reset" | "/sim/kv_events/churn", _) => {
            detail(405, "Method Not Allowed")
        }
        _ => detail(404, "Not Found"),
    }
}

async fn health(sim: &Sim) -> Response<SimBody> {
    match sim.take_fault(Phase::Health) {
        Some(Action::Status { status, body }) => match body {
            Some(b) => json_response(status, &b),
            None => text_response(status, "text/plain", String::new()),
        },
        Some(Action::Hang { ms: Some(ms) }) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Response::new(SimBody::empty())
        }
        Some(Action::Hang { ms: None }) => std::future::pending().await,
        _ => Response::new(SimBody::empty()),
    }
}

fn models(sim: &Sim) -> Response<SimBody> {
    let owner = sim.cfg.dialect.as_str();
    // vLLM's and SGLang's ModelCard default `created` to the time of the request, so it says
    // nothing about the process (the router must not read one from it).
    let created = unix_now() as u64;
    let mut data = vec![json!({
        "id": sim.cfg.model, "object": "model", "created": created, "owned_by": owner,
        "root": sim.cfg.model, "parent": null, "max_model_len": sim.cfg.max_model_len,
    })];
    // vLLM's `OpenAIServingModels.show_available_models`: one card per adapter, its parent the
    // base model.
    data.extend(sim.cfg.adapters.iter().map(|a| {
        json!({"id": a, "object": "model", "created": created, "owned_by": owner,
               "root": a, "parent": sim.cfg.model, "max_model_len": null})
    }));
    json_response(200, &json!({"object": "list", "data": data}))
}

async fn tokenize(sim: &Sim, req: Request<Incoming>) -> Response<SimBody> {
    sim.stats.req_tokenize.fetch_add(1, Relaxed);
    let b = match read_body(req.into_body()).await {
        Ok(b) => b,
        Err(e) => return api_error(&e),
    };
    let limits = Limits {
        model: &sim.cfg.model,
        adapters: &sim.cfg.adapters,
        max_model_len: sim.cfg.max_model_len,
        render_tools: sim.cfg.render_tools,
    };
    match protocol::parse_tokenize(&b, &limits) {
        Ok(ids) => json_response(
            200,
            &json!({"count": ids.len(), "max_model_len": sim.cfg.max_model_len, "tokens": ids}),
        ),
        Err(e) => api_error(&e),
    }
}

fn server_info(sim: &Sim) -> Response<SimBody> {
    let (host, port) = match sim
        .url
        .strip_prefix("http://")
        .and_then(|a| a.rsplit_once(':'))
    {
        Some((h, p)) => (h.to_string(), p.parse::<u16>().unwrap_or(0)),
        None => (String::new(), 0),
    };
    json_response(
        200,
        &json!({
            "model_path": sim.cfg.model,
            "tokenizer_path": sim.cfg.model,
            "served_model_name": sim.cfg.model,
            "host": host,
            "port": port,
            "tp_size": 1,
            "context_length": sim.cfg.max_model_len,
            "max_running_requests": sim.cfg.max_running,
            "disaggregation_mode": sim.cfg.mode.as_str(),
            "disaggregation_bootstrap_port": sim.bootstrap_addr.map(|a| a.port()),
            "disaggregation_transfer_backend": "mooncake",
            "enable_pd_role_switch": sim.cfg.role_switch,
            "random_seed": sim.cfg.seed,
            "version": SGLANG_VERSION,
            // The scheduler's live state: its role can differ from the launch argument above
            // after a runtime switch.
            "internal_states": [scheduler_state(sim)],
        }),
    )
}

/// One scheduler's `internal_states` entry (SGLang with the role switch: the live
/// `disaggregation_mode`, the decode CUDA-graph batch sizes and memory a router feeds back
/// into a switch to decode).
fn scheduler_state(sim: &Sim) -> Value {
    let mode = sim.mode();
    let decode = mode == Mode::Decode;
    json!({
        "disaggregation_mode": mode.as_str(),
        "decode_cuda_graph_bs": if decode { json!([1, 2, 4, 8]) } else { json!([]) },
        "decode_cuda_graph_memory_gb": if decode { 0.5 } else { 0.0 },
        "last_gen_throughput": 0.0,
    })
}

/// SGLang `POST /pd_role_switch {"new_role", "decode_cuda_graph_bs"?,
/// "decode_cuda_graph_memory_gb"?}` (`Scheduler.handle_pd_role_switch`): the preconditions in
/// SGLang's order (the flag, a previous failed switch, the role name, PD mode), then the same
/// role (success, "already in target role"), then idleness; a switch answers 200
/// `{"success": true, "message": "ok", "old_role", "new_role"}`, a refusal 400 with
/// `success: false` and the reason. A `role_switch` fault answers its status and body instead
/// (a failed rebuild also leaves the instance unhealthy).
async fn pd_role_switch(sim: &Sim, req: Request<Incoming>) -> Response<SimBody> {
    let old = sim.mode();
    let body = match read_body(req.into_body()).await {
        Ok(b) => b,
        Err(e) => return api_error(&e),
    };
    let asked: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let new_role = asked["new_role"].as_str().unwrap_or("").to_lowercase();
    let answer = |status: u16, success: bool, message: &str| {
        json_response(
            status,
            &json!({"success": success, "message": message, "old_role": old.as_str(),
                    "new_role": new_role}),
        )
    };
    let reject = if !sim.cfg.role_switch {
        Some("--enable-pd-role-switch is not set on this instance".to_string())
    } else if sim.switch_unhealthy.load(Relaxed) {
        Some("instance is unhealthy after a failed role switch; restart required".into())
    } else if !matches!(new_role.as_str(), "prefill" | "decode") {
        Some(format!("invalid new_role={new_role:?}"))
    } else if old == Mode::Null {
        Some("instance is not running in PD disaggregation mode".into())
    } else {
        None
    };
    if let Some(msg) = reject {
        return answer(400, false, &msg);
    }
    if new_role == old.as_str() {
        return answer(200, true, "already in target role");
    }
    if sim.stats.in_flight.load(Relaxed) > 0 {
        return answer(
            400,
            false,
            "instance is not idle; drain all requests before switching",
        );
    }
    match sim.take_fault(Phase::RoleSwitch) {
        Some(Action::Status { status, body }) => {
            sim.switch_unhealthy.store(true, Relaxed);
            let body = body.unwrap_or_else(|| {
                json!({"success": false, "old_role": old.as_str(), "new_role": new_role,
                       "message": "rebuild failed; instance unhealthy, restart required: injected fault"})
            });
            return json_response(status, &body);
        }
        Some(Action::Hang { ms }) => sleep(Duration::from_millis(ms.unwrap_or(0))).await,
        _ => {}
    }
    let new = if new_role == "prefill" {
        Mode::Prefill
    } else {
        Mode::Decode
    };
    *lock(&sim.mode) = new;
    sim.stats.role_switches.fetch_add(1, Relaxed);
    answer(200, true, "ok")
}

/// Answers a request that failed inside serving: an SSE error frame on a 200 stream when the
/// client asked to stream (vLLM has already sent its head), else the JSON error with its status.
fn fail(tracker: &mut Tracker, stream: bool, e: &ApiError) -> Response<SimBody> {
    if stream {
        tracker.mark_head_sent();
        tracker.finish(Outcome::Error, 200, 0);
        sse_response(SimBody::full(error_frames(e)))
    } else {
        tracker.finish(Outcome::Error, e.status, 0);
        api_error(e)
    }
}

/// Everything the answer of one request needs besides the tracker.
struct Answer<'a> {
    parsed: &'a Parsed,
    id: String,
    created: u64,
    prompt_hash: u64,
    kv_params: Option<Value>,
    fragment: Option<usize>,
    cut: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens` (with `--enable-prompt-tokens-details`):
    /// this engine's prefix-cache hit tokens. (vLLM's P/D decode reports the prefill's count,
    /// `remote_prefill_cached_tokens`; the simulator reports its own lookup there too.)
    cached_tokens: Option<u64>,
}

fn respond(sim: &Sim, mut tracker: Tracker, a: Answer<'_>) -> Response<SimBody> {
    let p = a.parsed;
    if p.stream {
        let fmt = ChunkFormat::new(
            p.kind,
            &a.id,
            &sim.cfg.model,
            a.created,
            p.return_token_ids,
            &p.prompt,
        );
        let final_extra = a
            .kv_params
            .map(|kv| format!("\"kv_transfer_params\":{kv}"))
            .unwrap_or_default();
        let plan = StreamPlan {
            fmt,
            prompt_hash: a.prompt_hash,
            prompt_tokens: p.prompt.len() as u64,
            seed: sim.cfg.seed,
            max_tokens: p.max_tokens,
            role_chunk: p.kind == Kind::Chat,
            include_usage: p.include_usage,
            tpot: sim.cfg.tpot,
            tpot_per_running: sim.cfg.tpot_per_running,
            tpot_per_kv_block: sim.cfg.tpot_per_kv_block,
            cut_after: a.cut.map(u64::from),
            fragment: a.fragment,
            final_extra,
            n: p.n,
            cached_tokens: a.cached_tokens,
        };
        let stream = TokenStream::new(plan, tracker, sim.stats.clone());
        return sse_response(SimBody::Stream(Box::new(stream)));
    }
    let choices: Vec<(String, Vec<u32>)> = (0..p.n.max(1))
        .map(|i| {
            tokenizer::generated_text(
                a.prompt_hash,
                sim.cfg.seed.wrapping_add(u64::from(i)),
                p.max_tokens,
            )
        })
        .collect();
    let generated: u64 = choices.iter().map(|(_, ids)| ids.len() as u64).sum();
    sim.stats
        .prom_generation_tokens
        .fetch_add(generated, Relaxed);
    let v = full_response(
        p.kind,
        &a.id,
        &sim.cfg.model,
        a.created,
        &choices,
        &p.prompt,
        p.return_token_ids,
        a.kv_params,
        a.cached_tokens,
    );
    tracker.finish(Outcome::Ok, 200, generated);
    json_bytes(200, serde_json::to_vec(&v).unwrap_or_default(), a.fragment)
}

async fn completion(
    sim: &Arc<Sim>,
    kill: &CancellationToken,
    kind: Kind,
    req: Request<Incoming>,
) -> Response<SimBody> {
    let header_rid = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // vLLM's `_get_data_parallel_rank`: the rank a router chose (an int; anything else is
    // vLLM's 400, here: no rank).
    let dp_rank = req
        .headers()
        .get("x-data-parallel-rank")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<usize>().ok());
    let created = unix_now() as u64;
    let limits = Limits {
        model: &sim.cfg.model,
        adapters: &sim.cfg.adapters,
        max_model_len: sim.cfg.max_model_len,
        render_tools: sim.cfg.render_tools,
    };
    let parsed = match read_body(req.into_body()).await {
        Ok(b) => protocol::parse_request(kind, &b, &limits),
        Err(e) => Err(e),
    };
    let parsed = match parsed {
        Ok(p) => p,
        Err(e) => return refuse_unparsed(sim, header_rid, &e),
    };
    let phase = sim.phase_of(&parsed);
    let request_id = match sim.cfg.dialect {
        Dialect::Vllm => header_rid,
        Dialect::Sglang => parsed.rid.clone(),
    }
    .unwrap_or_else(|| sim.new_id());
    sim.stats.count_arrival(phase);
    let mut tracker = Tracker::new(sim.stats.clone(), request_id, phase);
    tracker.set_stream(parsed.stream);
    if let Some(b) = &parsed.bootstrap {
        tracker.set_kv(None, Some(b.room), None);
    }
    if let Err(refused) = admit(sim, &parsed, phase, &mut tracker).await {
        return refused;
    }
    let fx = match apply_fault(sim, kill, phase, &parsed, &mut tracker).await {
        Ok(fx) => fx,
        Err(answered) => return answered,
    };
    let prompt_hash = tokenizer::prompt_hash(&parsed.prompt);
    let n_prompt = parsed.prompt.len();
    sim.stats
        .prom_prompt_tokens
        .fetch_add(n_prompt as u64, Relaxed);
    let rid = tracker.request_id().to_string();
    let id = match (sim.cfg.dialect, kind) {
        (Dialect::Vllm, Kind::Completion) => format!("cmpl-{rid}"),
        (Dialect::Vllm, Kind::Chat) => format!("chatcmpl-{rid}"),
        (Dialect::Sglang, _) => rid.clone(),
    };
    // Only the tokens missing from the prefix cache are computed (and priced). Under
    // `--kv-pool` the prefix is looked up when the request is scheduled, once its blocks fit.
    let lookup = if sim.cfg.kv_pool {
        let output = parsed.max_tokens as usize * parsed.n.max(1) as usize;
        let (prompt, keys) = (&parsed.prompt, &parsed.keys);
        let admitted = sim
            .kv_admit(
                prompt,
                keys,
                dp_rank,
                output,
                !fx.mute_kv_events,
                &mut tracker,
            )
            .await;
        match admitted {
            Ok(l) => l,
            Err(e) => return fail(&mut tracker, parsed.stream, &e),
        }
    } else {
        sim.cache_lookup(&parsed.prompt, &parsed.keys, dp_rank)
    };
    let uncached = n_prompt - lookup.hit_tokens;
    let compute = sim.cfg.ttft + sim.cfg.prefill_per_token * uncached as u32;
    let answer = Answer {
        parsed: &parsed,
        id,
        created,
        prompt_hash,
        kv_params: None,
        fragment: fx.fragment,
        cut: fx.cut,
        cached_tokens: sim
            .cfg
            .prompt_tokens_details
            .then_some(lookup.hit_tokens as u64),
    };
    match (sim.cfg.dialect, phase) {
        (Dialect::Vllm, Phase::Prefill) => {
            vllm_prefill(sim, tracker, answer, &lookup, compute, &fx).await
        }
        (Dialect::Vllm, Phase::Decode) => {
            vllm_decode(sim, tracker, answer, &lookup, uncached, &fx).await
        }
        (Dialect::Sglang, Phase::Prefill) => {
            sglang_prefill(sim, tracker, answer, &lookup, compute, &fx).await
        }
        (Dialect::Sglang, Phase::Decode) => {
            sglang_decode(sim, tracker, answer, &lookup, uncached, &fx).await
        }
        (_, _) => {
            sim.prefill(compute).await;
            sim.computed(&parsed.prompt, &lookup, 0, !fx.mute_kv_events);
            let decode_capable = match sim.cfg.dialect {
                Dialect::Vllm => true,
                Dialect::Sglang => sim.mode() == Mode::Decode,
            };
            if decode_capable {
                sim.stats.kv_recomputed.fetch_add(1, Relaxed);
            }
            respond(sim, tracker, answer)
        }
    }
}

/// Answers a completion whose body did not parse: counted as an aggregated arrival that
/// failed with the error's status (under the `x-request-id` of a vLLM request).
fn refuse_unparsed(sim: &Sim, header_rid: Option<String>, e: &ApiError) -> Response<SimBody> {
    sim.stats.count_arrival(Phase::Aggregated);
    let rid = match sim.cfg.dialect {
        Dialect::Vllm => header_rid,
        Dialect::Sglang => None,
    };
    let mut t = Tracker::new(
        sim.stats.clone(),
        rid.unwrap_or_else(|| sim.new_id()),
        Phase::Aggregated,
    );
    t.finish(Outcome::Error, e.status, 0);
    api_error(e)
}

/// Admission: refuses a request over `--max-running`, waits for a seat in the running set
/// (held by the tracker), then refuses what this engine's mode or phase cannot serve.
async fn admit(
    sim: &Arc<Sim>,
    parsed: &Parsed,
    phase: Phase,
    tracker: &mut Tracker,
) -> Result<(), Response<SimBody>> {
    if sim.cfg.max_running > 0 && sim.stats.in_flight.load(Relaxed) > sim.cfg.max_running as i64 {
        let e = ApiError {
            status: 429,
            kind: "TooManyRequestsError",
            message: format!(
                "the engine is at its limit of {} running requests (--max-running)",
                sim.cfg.max_running
            ),
        };
        tracker.finish(Outcome::Error, 429, 0);
        return Err(api_error(&e));
    }
    // vLLM's scheduler: beyond `max_num_seqs` running, a request waits its turn; its place
    // is held until it is settled (the tracker drops it).
    tracker.hold(sim.seat().await);
    // SGLang P/D servers need the whole rendezvous (checked before faults are consumed).
    if phase == Phase::Aggregated
        && sim.cfg.dialect == Dialect::Sglang
        && sim.mode() != Mode::Null
        && !parsed.fake_bootstrap
        && (parsed.bootstrap_partial || sim.mode() == Mode::Prefill)
    {
        let e = ApiError::bad_request(format!(
            "a {}-mode server requires bootstrap_host, bootstrap_port and \
             bootstrap_room",
            sim.mode().as_str()
        ));
        tracker.finish(Outcome::Error, 400, 0);
        return Err(api_error(&e));
    }
    // The simulator generates `n` choices only for a request computed end to end (a real
    // engine's P/D connectors move one sequence's KV; Narwhal never splits `n` > 1).
    if parsed.n > 1 && phase != Phase::Aggregated {
        let e = ApiError::bad_request(format!(
            "n = {}: the engine simulator serves n > 1 only on a request without a KV transfer \
             (kv_transfer_params / bootstrap fields)",
            parsed.n
        ));
        tracker.finish(Outcome::Error, 400, 0);
        return Err(api_error(&e));
    }
    Ok(())
}

/// What an injected fault leaves for the rest of the request to do (none: a plain request).
#[derive(Debug, Default)]
struct FaultEffects {
    /// Write the body in writes of this many bytes.
    fragment: Option<usize>,
    /// Stream this many token chunks, then drop the connection.
    cut: Option<u32>,
    /// A prefill publishes no KV.
    omit_kv: bool,
    /// No KV event for this request.
    mute_kv_events: bool,
    /// The decode's transfer fails; `true`: then recompute.
    fail_transfer: Option<bool>,
}

/// Takes the next fault queued for `phase` and applies it: `Err` with the response of a fault
/// that answers at once (a status, a dropped connection), otherwise what it leaves to do.
async fn apply_fault(
    sim: &Arc<Sim>,
    kill: &CancellationToken,
    phase: Phase,
    parsed: &Parsed,
    tracker: &mut Tracker,
) -> Result<FaultEffects, Response<SimBody>> {
    let fault = sim.take_fault(phase);
    let mut fx = FaultEffects::default();
    if let Some(f) = &fault {
        tracker.mark_fault();
        let sglang_room = match (phase, &parsed.bootstrap) {
            (Phase::Prefill, Some(b)) if sim.cfg.dialect == Dialect::Sglang => Some(b.room),
            _ => None,
        };
        match f {
            Action::Status { status, body } => {
                // A 5xx models a failure inside the engine, which SGLang propagates to the
                // waiting decode (it fails at once). A 4xx models a request refused before it
                // reached the scheduler: nothing is published and the decode keeps waiting
                // (bounded) until its own client gives up, as with real SGLang.
                if let Some(room) = sglang_room.filter(|_| *status >= 500) {
                    let _ = sim.publish_room(
                        room,
                        RoomState::Failed(format!("prefill answered injected status {status}")),
                    );
                }
                tracker.finish(Outcome::Error, *status, 0);
                let body = body.clone().unwrap_or_else(|| {
                    protocol::error_json(*status, "InjectedFault", "injected fault (status)")
                });
                return Err(json_response(*status, &body));
            }
            Action::Drop => return Err(drop_connection(sim, tracker, kill, sglang_room).await),
            Action::Cut { .. } if !parsed.stream => {
                return Err(drop_connection(sim, tracker, kill, sglang_room).await);
            }
            Action::Cut { after_tokens } => fx.cut = Some(*after_tokens),
            Action::Hang { ms } => {
                tokio::time::sleep(Duration::from_millis(ms.unwrap_or(0))).await;
            }
            Action::OmitKv => fx.omit_kv = true,
            Action::MuteKvEvents => fx.mute_kv_events = true,
            Action::Fragment { bytes } => fx.fragment = Some(*bytes),
            Action::FailTransfer { recompute } => fx.fail_transfer = Some(*recompute),
        }
    }
    Ok(fx)
}

/// The KV a prefill hands over for `answer`'s prompt, under request id `rid`.
fn kv_payload(answer: &Answer<'_>, rid: &str) -> KvPayload {
    KvPayload {
        prompt_hash: answer.prompt_hash,
        prompt_tokens: answer.parsed.prompt.len(),
        request_id: rid.to_string(),
    }
}

/// A vLLM prefill: computes the prompt, stores its blocks and answers their descriptor in
/// `kv_transfer_params` (none with an `omit_kv` fault).
async fn vllm_prefill(
    sim: &Sim,
    mut tracker: Tracker,
    mut answer: Answer<'_>,
    lookup: &Lookup,
    compute: Duration,
    fx: &FaultEffects,
) -> Response<SimBody> {
    let parsed = answer.parsed;
    let rid = tracker.request_id().to_string();
    sim.prefill(compute).await;
    sim.computed(&parsed.prompt, lookup, 0, !fx.mute_kv_events);
    if !fx.omit_kv {
        let block_ids = sim
            .blocks_lock()
            .issue(Instant::now(), kv_payload(&answer, &rid));
        sim.stats.kv_issued.fetch_add(1, Relaxed);
        let (host, port) = match sim.kv_addr {
            Some(a) if a.ip().is_unspecified() => ("127.0.0.1".to_string(), a.port()),
            Some(a) => (a.ip().to_string(), a.port()),
            None => ("127.0.0.1".to_string(), 0),
        };
        answer.kv_params = Some(json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": sim.engine_id,
            "remote_block_ids": block_ids,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": answer.id,
            "tp_size": 1,
        }));
        tracker.set_kv(None, None, Some(block_ids));
    }
    respond(sim, tracker, answer)
}

/// A vLLM decode: reads the prefill's blocks named in `kv_transfer_params` from its engine,
/// then generates; a failed read fails the request.
async fn vllm_decode(
    sim: &Sim,
    mut tracker: Tracker,
    answer: Answer<'_>,
    lookup: &Lookup,
    uncached: usize,
    fx: &FaultEffects,
) -> Response<SimBody> {
    let parsed = answer.parsed;
    let rid = tracker.request_id().to_string();
    sleep(sim.cfg.ttft).await;
    let d = match &parsed.kv {
        KvParams::RemotePrefill(d) => d,
        KvParams::BadRemotePrefill(m) => {
            sim.stats.kv_rejected.fetch_add(1, Relaxed);
            let e = ApiError::internal(format!("invalid kv_transfer_params: {m}"));
            return fail(&mut tracker, parsed.stream, &e);
        }
        _ => unreachable_phase(),
    };
    tracker.set_kv(Some(d.engine_id.clone()), None, Some(d.block_ids.clone()));
    let peer = format!("engine {}", d.engine_id);
    if let Some(recompute) = fx.fail_transfer {
        let cause = FailedTransfer::Transfer;
        return injected_transfer_failure(sim, tracker, answer, recompute, cause, &peer).await;
    }
    let req = transfer::Request::ReadBlocks {
        engine_id: d.engine_id.clone(),
        block_ids: d.block_ids.clone(),
        consumer: sim.url.clone(),
    };
    let started = Instant::now();
    let res = transfer::call(&d.host, d.port, &req, READ_TIMEOUT).await;
    match check_transfer(res, answer.prompt_hash) {
        Ok(_) => {
            sim.stats.kv_consumed.fetch_add(1, Relaxed);
            sleep(sim.cfg.kv_transfer).await;
            sim.stats.prom_transfers.observe(started.elapsed());
            // vLLM caches the blocks a decode received (`cache_blocks` once the
            // remote KV arrived): they count as transferred, not computed.
            sim.computed(&parsed.prompt, lookup, uncached, !fx.mute_kv_events);
            respond(sim, tracker, answer)
        }
        Err((msg, _)) => {
            sim.stats.kv_rejected.fetch_add(1, Relaxed);
            sim.stats.prom_transfer_failures.fetch_add(1, Relaxed);
            let e = ApiError::internal(format!(
                "KV transfer for request {rid} from engine {} failed: {msg}",
                d.engine_id
            ));
            fail(&mut tracker, parsed.stream, &e)
        }
    }
}

/// An SGLang prefill: computes the prompt and publishes its KV in the bootstrap room (none
/// with an `omit_kv` fault).
async fn sglang_prefill(
    sim: &Sim,
    mut tracker: Tracker,
    answer: Answer<'_>,
    lookup: &Lookup,
    compute: Duration,
    fx: &FaultEffects,
) -> Response<SimBody> {
    let parsed = answer.parsed;
    let rid = tracker.request_id().to_string();
    let Some(b) = &parsed.bootstrap else {
        unreachable_phase()
    };
    sim.prefill(compute).await;
    sim.computed(&parsed.prompt, lookup, 0, !fx.mute_kv_events);
    if !fx.omit_kv {
        if let Err(e) = sim.publish_room(b.room, RoomState::Ready(kv_payload(&answer, &rid))) {
            let e = ApiError::bad_request(e.to_string());
            tracker.finish(Outcome::Error, 400, 0);
            return api_error(&e);
        }
        sim.stats.kv_issued.fetch_add(1, Relaxed);
    }
    respond(sim, tracker, answer)
}

/// An SGLang decode: pulls the prefill's KV from its bootstrap room, then generates; a failed
/// rendezvous or transfer fails the request.
async fn sglang_decode(
    sim: &Sim,
    mut tracker: Tracker,
    answer: Answer<'_>,
    lookup: &Lookup,
    uncached: usize,
    fx: &FaultEffects,
) -> Response<SimBody> {
    let parsed = answer.parsed;
    let rid = tracker.request_id().to_string();
    let Some(b) = &parsed.bootstrap else {
        unreachable_phase()
    };
    sleep(sim.cfg.ttft).await;
    if let Some(recompute) = fx.fail_transfer {
        let peer = format!("bootstrap room {}", b.room);
        let cause = FailedTransfer::Transfer;
        return injected_transfer_failure(sim, tracker, answer, recompute, cause, &peer).await;
    }
    let wait = ROOM_WAIT_MAX.min(sim.cfg.kv_lease);
    let req = transfer::Request::PullRoom {
        room: b.room,
        wait_ms: wait.as_millis() as u64,
        consumer: sim.url.clone(),
    };
    let started = Instant::now();
    let res = transfer::call(&b.host, b.port, &req, wait + Duration::from_secs(2)).await;
    if let Ok(r) = &res {
        tracker.set_kv(Some(r.engine_id.clone()), None, None);
    }
    match check_transfer(res, answer.prompt_hash) {
        Ok(_) => {
            sim.stats.kv_consumed.fetch_add(1, Relaxed);
            sleep(sim.cfg.kv_transfer).await;
            sim.stats.prom_transfers.observe(started.elapsed());
            sim.computed(&parsed.prompt, lookup, uncached, !fx.mute_kv_events);
            respond(sim, tracker, answer)
        }
        Err((msg, cause)) => {
            sim.stats.kv_rejected.fetch_add(1, Relaxed);
            match cause {
                FailedTransfer::Bootstrap => &sim.stats.prom_bootstrap_failures,
                FailedTransfer::Transfer => &sim.stats.prom_transfer_failures,
            }
            .fetch_add(1, Relaxed);
            let e = ApiError::internal(format!(
                "KV transfer for rid {rid} (bootstrap room {}) failed: {msg}",
                b.room
            ));
            fail(&mut tracker, parsed.stream, &e)
        }
    }
}

#[track_caller]
fn unreachable_phase() -> ! {
    // phase_of() only yields Decode/Prefill when the matching fields were parsed.
    unreachable!("phase without its KV fields")
}

async fn sleep(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// Which engine failure counter a failed consumer transfer moves (SGLang tells a rendezvous that
/// never reached the bootstrap server from a transfer that failed; vLLM counts both as failed
/// NIXL transfers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailedTransfer {
    /// The producer's bootstrap server / side channel could not be reached.
    Bootstrap,
    /// Anything after that: refused, expired, wrong prompt, broken channel.
    Transfer,
}

/// Checks a side-channel reply against this request's prompt.
fn check_transfer(
    res: Result<transfer::Reply, TransferError>,
    prompt_hash: u64,
) -> Result<transfer::Reply, (String, FailedTransfer)> {
    let r = res.map_err(|e| {
        let cause = match e {
            TransferError::Unreachable { .. } => FailedTransfer::Bootstrap,
            _ => FailedTransfer::Transfer,
        };
        (e.to_string(), cause)
    })?;
    if r.prompt_hash != prompt_hash {
        return Err((
            format!(
                "the transferred KV belongs to a different prompt (producer request {}, prompt \
                 hash {:016x}, this request {:016x})",
                r.request_id, r.prompt_hash, prompt_hash
            ),
            FailedTransfer::Transfer,
        ));
    }
    Ok(r)
}

/// A decode whose transfer a `fail_transfer` fault failed: counted as a failed transfer
/// (`kv.rejected` and the engine's failure metric), then failed like a real failed transfer, or
/// with `recompute` (vLLM `kv_load_failure_policy: "recompute"`) served from a local prefill
/// (`kv.recomputed`).
async fn injected_transfer_failure(
    sim: &Sim,
    mut tracker: Tracker,
    answer: Answer<'_>,
    recompute: bool,
    cause: FailedTransfer,
    peer: &str,
) -> Response<SimBody> {
    sim.stats.kv_rejected.fetch_add(1, Relaxed);
    match cause {
        FailedTransfer::Bootstrap => &sim.stats.prom_bootstrap_failures,
        FailedTransfer::Transfer => &sim.stats.prom_transfer_failures,
    }
    .fetch_add(1, Relaxed);
    if recompute {
        sim.stats.kv_recomputed.fetch_add(1, Relaxed);
        let p = answer.parsed;
        sleep(sim.cfg.prefill_per_token * p.prompt.len() as u32).await;
        // Recomputed here: the whole prompt counts as local compute.
        sim.sources.count(p.prompt.len(), 0, 0);
        return respond(sim, tracker, answer);
    }
    let e = ApiError::internal(format!(
        "KV transfer for request {} from {peer} failed: injected transfer failure (fault \
         fail_transfer)",
        tracker.request_id()
    ));
    let stream = answer.parsed.stream;
    fail(&mut tracker, stream, &e)
}

/// Closes the connection without a response ("drop" fault, or "cut" on a non-streaming request).
async fn drop_connection(
    sim: &Sim,
    tracker: &mut Tracker,
    kill: &CancellationToken,
    sglang_room: Option<u64>,
) -> Response<SimBody> {
    if let Some(room) = sglang_room {
        let _ = sim.publish_room(
            room,
            RoomState::Failed("prefill connection dropped (injected fault)".into()),
        );
    }
    tracker.finish_fault(0, 0);
    kill.cancel();
    std::future::pending().await
}
