//! Fleet file: schema `narwhal.fleet` version 2 (architecture.md section 6, behaviour.md 8.1).
//!
//! ```text
//!  fleet.json ──read──► serde_json::Value ──Checker (every key, every rule)──► Config
//!                                               └─► ConfigError::Invalid { issues: [..all..] }
//! ```
//!
//! The file is parsed into a JSON value first and then walked by hand so that *every* problem
//! (unknown keys, wrong types, out-of-range values, duplicate iids, ...) is collected and
//! reported in one run, each naming its dotted path (`engines[1].rol: unknown key`). Keys
//! starting with `_` are comments at every level. JSON `NaN`/`Infinity` are not JSON and are
//! refused by the parser.

use std::fmt;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub use crate::profile::Profile;

pub(crate) mod schema;

mod check;
#[cfg(test)]
mod tests;

use check::Checker;

/// Which engine kind serves the fleet; decides the P/D protocol (behaviour.md 7.1, 7.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// vLLM with the NIXL connector: two-stage prefill then decode, KV descriptor handoff.
    Vllm,
    /// SGLang with the Mooncake connector: concurrent legs meeting at a bootstrap rendezvous.
    Sglang,
}

impl Backend {
    /// The lowercase name used in the fleet file, `/narwhal/targets` and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Vllm => "vllm",
            Backend::Sglang => "sglang",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The pool an engine is assigned to (behaviour.md 8.1 `engines[].role`, default decode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Runs prefill legs and produces KV.
    Prefill,
    /// Runs decode legs and streams tokens.
    Decode,
}

impl Role {
    /// `"prefill"` or `"decode"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The role named `name` (`"prefill"` or `"decode"`), `None` for anything else.
    pub fn parse(name: &str) -> Option<Role> {
        match name {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            _ => None,
        }
    }
}

/// Agent endpoint of one engine host (architecture.md section 4); the agent registry
/// (`lifecycle::agents`) builds one mutual-TLS client per distinct endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineAgent {
    /// `https://host:port` of the host's narwhal-agent.
    pub url: String,
    /// TLS server name the agent certificate must carry.
    pub server_name: String,
    /// `ed25519:<base64>` public key that signs this agent's documents.
    pub public_key: String,
    /// The agent's `agent_id`, which every signed payload must carry; defaults to
    /// `server_name`.
    pub agent_id: String,
}

/// One configured engine (`engines[]`).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Instance id, unique in the fleet.
    pub iid: String,
    /// Base URL of the engine's OpenAI server, trailing `/` removed.
    pub url: String,
    /// Configured pool.
    pub role: Role,
    /// Excluded from every role change.
    pub pin: bool,
    /// `engines[].kv_role`: the vLLM KV connector role the engine was launched with. A fixed
    /// producer or consumer is never flipped (vLLM cannot change it in place).
    pub kv_role: KvRole,
    /// Full attestation URL, `""` when none.
    pub attestation_url: String,
    /// Optional agent endpoint.
    pub agent: Option<EngineAgent>,
    /// `engines[].health_path`: the path the health gate and the breaker's probes GET
    /// (default `/health`; `/v1/models` for engines without `/health`, e.g. llama.cpp).
    /// Starts with `/`, no query.
    pub health_path: String,
    /// `engines[].kv_events`: where the engine publishes vLLM's KV cache events; `None`
    /// when it publishes none (its cache is then never credited in placement,
    /// docs/design/kv-aware-placement.md).
    pub kv_events: Option<KvEventsSource>,
}

/// `engines[].kv_role`: vLLM's `kv_transfer_config.kv_role` as the engine was launched.
/// `kv_both` (the default) serves either leg, so the role controller may move the engine between
/// pools in place; `kv_producer` and `kv_consumer` (vLLM 0.32 deprecates `kv_both` in their
/// favour) fix it to one leg, and the controller never moves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvRole {
    /// `kv_both`: produces and consumes KV; flippable.
    #[default]
    Both,
    /// `kv_producer`: a fixed prefill engine.
    Producer,
    /// `kv_consumer`: a fixed decode engine.
    Consumer,
}

impl KvRole {
    /// `"kv_both"`, `"kv_producer"` or `"kv_consumer"`.
    pub fn as_str(self) -> &'static str {
        match self {
            KvRole::Both => "kv_both",
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
        }
    }

    /// The role a fixed producer or consumer is held to; `None` for `kv_both`.
    pub fn fixed_role(self) -> Option<Role> {
        match self {
            KvRole::Both => None,
            KvRole::Producer => Some(Role::Prefill),
            KvRole::Consumer => Some(Role::Decode),
        }
    }
}

/// `engines[].kv_events`: the engine's KV event sockets as the router reaches them (vLLM's
/// `KVEventsConfig`: a PUB on `endpoint`, a replay ROUTER on `replay_endpoint`). The router
/// always connects (vLLM binds an endpoint written with `*`; name here the address to reach).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsSource {
    /// `tcp://HOST:PORT` of the PUB socket.
    pub endpoint: String,
    /// `tcp://HOST:PORT` of the replay socket; `None`: gaps cannot be replayed, so a gap
    /// drops the engine's entries.
    pub replay_endpoint: Option<String>,
    /// The topic the engine publishes under (vLLM's `topic`, default `""`): the SUB's filter.
    pub topic: String,
    /// Data-parallel ranks behind the engine's one API server (vLLM's
    /// `--data-parallel-size`, default 1). Rank `r` publishes on `endpoint`'s and
    /// `replay_endpoint`'s ports plus `r` (vLLM's `ZmqEventPublisher.offset_endpoint_port`);
    /// the router subscribes to each and steers a request to a rank with vLLM's
    /// `X-data-parallel-rank` header (docs/design/kv-aware-placement.md, section 1.3).
    pub data_parallel_size: u32,
}

impl KvEventsSource {
    /// Rank `rank`'s sockets: each port plus `rank`, as vLLM offsets them.
    pub fn rank(&self, rank: u32) -> KvEventsSource {
        KvEventsSource {
            endpoint: offset_port(&self.endpoint, rank),
            replay_endpoint: self
                .replay_endpoint
                .as_deref()
                .map(|e| offset_port(e, rank)),
            topic: self.topic.clone(),
            data_parallel_size: 1,
        }
    }
}

/// `tcp://HOST:PORT` with the port plus `by` (vLLM's `offset_endpoint_port`); an endpoint
/// without a port (never one `check-config` passes) is left as it is.
pub fn offset_port(endpoint: &str, by: u32) -> String {
    match endpoint.rsplit_once(':') {
        Some((host, port)) if by > 0 => match port.parse::<u32>() {
            Ok(p) => format!("{host}:{}", p + by),
            Err(_) => endpoint.to_string(),
        },
        _ => endpoint.to_string(),
    }
}

/// `slo` section: latency budgets in seconds (both required, > 0).
#[derive(Debug, Clone, PartialEq)]
pub struct Slo {
    /// Time to first token budget, seconds.
    pub ttft_s: f64,
    /// Time per output token budget, seconds.
    pub tpot_s: f64,
}

/// `serving.admission` (behaviour.md 7.6; controller.md section 10). Default `open`
/// here (the reference defaults to `predictive`, which needs profiles).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionMode {
    /// Price each request's TTFT from the profiles and refuse (429) what cannot make it.
    Predictive,
    /// Price and journal, never refuse.
    Open,
}

impl AdmissionMode {
    /// `"predictive"` or `"open"`.
    pub fn as_str(self) -> &'static str {
        match self {
            AdmissionMode::Predictive => "predictive",
            AdmissionMode::Open => "open",
        }
    }
}

/// `serving` section (behaviour.md 8.1). Times in seconds, sizes in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Serving {
    /// `admission` (default `open` here; see [`AdmissionMode`]).
    pub admission: AdmissionMode,
    /// `admission_margin` ≥ 0.
    pub admission_margin: f64,
    /// `max_connections` ≥ 1 (default 768): default admission seats.
    pub max_connections: u64,
    /// End-to-end deadline from arrival (default 600).
    pub request_timeout_s: f64,
    /// Prefill leg elapsed limit (default 120, ≤ request timeout).
    pub prefill_timeout_s: f64,
    /// Drain time after SIGTERM, whole seconds (default 30).
    pub graceful_timeout_s: u64,
    /// Admission queue capacity (default 0 = no waiting).
    pub queue_capacity: u64,
    /// Admission queue wait limit (default 0; > 0 required when `queue_capacity` > 0).
    pub queue_timeout_s: f64,
    /// Complete prefill→decode attempts per request, 1–3 (default 2).
    pub max_attempts: u32,
    /// Retry backoff base (default 0.1).
    pub retry_base_s: f64,
    /// Retry backoff cap (default 1.0, ≥ base).
    pub retry_cap_s: f64,
    /// Router-wide retry credits (default 10).
    pub retry_budget: u64,
    /// Credits added per completed request (default 0.1, 0–1).
    pub retry_replenish: f64,
    /// Client request body limit (default 4194304).
    pub max_request_bytes: u64,
    /// Response limit: pre-output buffer and non-streaming reassembly (default 16777216).
    pub max_response_bytes: u64,
    /// Time a client has to deliver its whole request body, seconds (default 30, > 0; the
    /// request deadline still bounds it): a client that stalls mid-body gets 408 instead of
    /// holding a slot for `request_timeout_s`.
    pub body_read_timeout_s: f64,
    /// Prompts one completions request may batch (`prompt` a list), 1–4096 (default 64): a
    /// batch is fanned out to one request per prompt; more is refused 400 naming `prompt`.
    pub max_batch_prompts: usize,
    /// `kv_balance_abs_threshold`, requests (default 1000): with the relative threshold, when the
    /// most and least loaded candidates differ by more than this, placement ignores the KV
    /// cache and balances load (SGLang's router `balance_abs_threshold`).
    pub kv_balance_abs_threshold: u64,
    /// `kv_balance_rel_threshold`, ratio ≥ 1 (default 1.5): the most loaded candidate must also
    /// carry more than this times the least loaded's work (SGLang's `balance_rel_threshold`).
    pub kv_balance_rel_threshold: f64,
    /// `kv_events_stale_s`, seconds > 0 (default 5): an engine that stored nothing this long
    /// after a request that must store blocks was placed on it is `stale` (no credit).
    pub kv_events_stale_s: f64,
    /// `kv_aware_placement` (default true): place by the engines' KV caches; false turns
    /// every engine's KV index mode to `none` (no `/tokenize`, no event subscribers, placement
    /// by load only).
    pub kv_aware_placement: bool,
    /// `kv_approx_ttl_s`, seconds > 0 (default 120): how long the approximate index credits
    /// an engine with a prompt's blocks after the last placement that touched them (engines
    /// without `kv_events`, or whose events are waiting or stale).
    pub kv_approx_ttl_s: f64,
    /// `kv_pending_s`, seconds > 0 (default 10): how long a placement's guess counts on an
    /// engine whose events are used, until the engine's own events store or remove those
    /// blocks (the queue wait and prefill of the placed request).
    pub kv_pending_s: f64,
    /// `kv_approx_block_size`, tokens, 1–65536 (default 16, vLLM's GPU default): the block
    /// size approximate credit is counted in for an engine whose events never told its own.
    pub kv_approx_block_size: u32,
    /// `placement_load`: `requests` (default) or `tokens` ([`PlacementLoad`]).
    pub placement_load: PlacementLoad,
    /// `engine_load_poll_s`, seconds ≥ 0 (default 0: off): how often the router reads each
    /// engine's own count of requests running and waiting from its `/metrics`, so placement
    /// weighs the load other routers and clients put on it (docs/design/kv-aware-placement.md
    /// section 5).
    pub engine_load_poll_s: f64,
    /// `kv_approx_credit`, ratio in (0, 1] (default 1): the share of an approximate credit's
    /// tokens the KV score counts (exact credit counts whole).
    pub kv_approx_credit: f64,
    /// `kv_ready_timeout_s`, seconds ≥ 0 (default 5): how long a router that starts waits,
    /// not ready, for the engines with a KV replay socket to have their index rebuilt from
    /// it before it serves (0: it does not wait).
    pub kv_ready_timeout_s: f64,
}

/// `serving.placement_load`: what placement weighs an engine's load by
/// (docs/design/kv-aware-placement.md, section 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlacementLoad {
    /// `requests` (the default): resident requests. Power of two choices on them, and the KV
    /// score's `uncached × (outstanding + 1)`.
    #[default]
    Requests,
    /// `tokens`: the KV its resident requests hold, tokens (each one's uncached prompt tokens
    /// and output budget as placed). Power of two choices on it (a split's decode leg
    /// included), and the KV score's `uncached + held`: the prompt tokens the engine would
    /// compute plus what it already carries, so a hot prefix is computed again on another
    /// engine once its holder carries more than that costs.
    Tokens,
}

/// `engine` section (behaviour.md 8.1). Times in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSection {
    /// `engine.backend` when given (must agree with top-level `backend`).
    pub backend: Option<Backend>,
    /// KV connector (`""` → `nixl` for vLLM, `mooncake` for SGLang).
    pub connector: String,
    /// API dialect (`""` → backend's).
    pub dialect: String,
    /// Size prompts with `/tokenize` (accepted; this version sizes by characters).
    pub tokenize: bool,
    /// `engine.tokenizer`: the model directory whose `tokenizer.json` and chat template the
    /// router tokenizes requests with for the KV score, as vLLM's `--tokenizer` names one;
    /// `None` (the default): every request is tokenized by an engine's `/tokenize`
    /// (docs/design/kv-aware-placement.md, "The router's tokenizer"). Read at startup: a
    /// directory that cannot be loaded stops the router, naming the key.
    pub tokenizer: Option<String>,
    /// Characters per token for sizing (default 3.8).
    pub chars_per_token: f64,
    /// `/tokenize` timeout (default 2).
    pub tokenize_timeout_s: f64,
    /// Env var naming the engine bearer token (`""` = none).
    pub engine_api_key_env: String,
    /// The resolved bearer token, when `engine_api_key_env` is set.
    pub engine_api_key: Option<String>,
    /// Control pool size (0 → max(4, 2 × engines)).
    pub control_connections: u64,
    /// Local pool wait limit (default 5).
    pub pool_timeout_s: f64,
    /// TCP connect timeout to engines (default 10).
    pub connect_timeout_s: f64,
    /// Health probe timeout (default 5).
    pub health_timeout_s: f64,
    /// Limit on each gap between decode chunks after the first token (default 10, 0 disables).
    pub decode_read_timeout_s: f64,
    /// Limit on decode headers + first token (default 2.5).
    pub first_token_timeout_s: f64,
    /// Budget for the decode's pull of the prefill's KV, added to `first_token_timeout_s` on
    /// the decode leg of a split (default 30, seconds; docs/configuration.md).
    pub kv_transfer_timeout_s: f64,
    /// First-token calibration file (accepted, unused).
    pub first_token_calibration_path: String,
}

/// `engine.engine_restart_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartPolicy {
    /// Engines restart one at a time.
    Individual,
    /// The whole fleet restarts as one wave.
    WholeWave,
}

impl RestartPolicy {
    /// `"individual"` or `"whole_wave"`.
    pub fn as_str(self) -> &'static str {
        match self {
            RestartPolicy::Individual => "individual",
            RestartPolicy::WholeWave => "whole_wave",
        }
    }
}

/// `recovery` section (behaviour.md 8.1, 6.2–6.4).
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// Consecutive failures of one class that trip the breaker (default 3).
    pub eject_after: u32,
    /// First hold of an engine ejected for failures, in monitor intervals: its first
    /// readmission probe comes `readmit_every × controller.monitor_interval_s` after the
    /// ejection (default 10); the hold doubles on every repeat up to `max_readmit_interval_s`.
    pub readmit_every: u32,
    /// Every `liveness_every` monitor intervals the liveness probe also re-reads the engine's
    /// process facts (process start, models, SGLang bootstrap port) (default 10, 0: only on
    /// demand).
    pub liveness_every: u32,
    /// Consecutive liveness probe timeouts that eject an engine (default 2).
    pub liveness_misses: u32,
    /// Longest hold of an engine ejected for failures, seconds (default 300; ≥ the first
    /// hold).
    pub max_readmit_interval_s: f64,
    /// At most this share of a role's engines is ejected for failures at a time (percent,
    /// 1..=100, default 50; at least one engine, never the role's last live one).
    pub max_ejection_percent: u32,
    /// Restart policy.
    pub engine_restart_policy: RestartPolicy,
    /// Timed quarantine after a failed leg (default 0 = disabled; accepted, unused).
    pub failure_quarantine_s: f64,
    /// Handoff state file (default `runs/state.json`).
    pub state_path: String,
    /// Apply the state file at startup (accepted, unused).
    pub resume: bool,
}

/// `controller` section (behaviour.md 8.1; controller.md section 6 says where each key
/// acts). Times in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Controller {
    /// Monitoring pass period, seconds (default 1.0, > 0).
    pub monitor_interval_s: f64,
    /// Consecutive failed controller passes before monitoring is degraded (default 5).
    pub monitor_failure_limit: u32,
    /// Advisory controller: every guard runs, roles never change (default false).
    pub advisory: bool,
    /// Minimum live prefill engines (default 1).
    pub min_prefill: u32,
    /// Minimum live decode engines (default 1).
    pub min_decode: u32,
    /// Role flips kept in the history (default 1000, ≥ 1).
    pub flip_history: u64,
    /// `controller.thresholds`.
    pub thresholds: Thresholds,
    /// `controller.reactive`.
    pub reactive: Reactive,
}

/// `controller.thresholds` (behaviour.md 8.1; controller.md section 6).
#[derive(Debug, Clone, PartialEq)]
pub struct Thresholds {
    /// `expand` E (default 1.0, > 0): the pressure ratio that calls for more engines.
    pub expand: f64,
    /// `shrink` S (default 0.5, ≥ 0, < expand): the ratio below which a pool may give one up.
    pub shrink: f64,
    /// `cooldown_s` (default 10): between prefill→decode flips, and from router start.
    pub cooldown_s: f64,
    /// `sustained_intervals` (default 3, ≥ 1): confirmations of a non-urgent move.
    pub sustained_intervals: u64,
    /// `dwell_s` (default 0 = off): a flipped engine is no donor for this long.
    pub dwell_s: f64,
    /// `panic_ratio` (default 0 = off, else ≥ 1): decode load that bypasses the cooldown.
    pub panic_ratio: f64,
    /// `flip_resident_guard` (default 0 = off): the most decode residents a decode→prefill
    /// donor may carry.
    pub flip_resident_guard: u64,
}

/// `controller.reactive` (behaviour.md 8.1; controller.md sections 4, 5 and 8).
#[derive(Debug, Clone, PartialEq)]
pub struct Reactive {
    /// `window_s` (default 120): demand horizon and retention.
    pub window_s: f64,
    /// `evidence_span_s` (default 60, ≤ max span): arrival evidence a consolidation needs.
    pub evidence_span_s: f64,
    /// `evidence_max_span_s` (default 120, ≤ window): the evidence horizon.
    pub evidence_max_span_s: f64,
    /// `evidence_min_arrivals` (default 10).
    pub evidence_min_arrivals: u64,
    /// `demand_rise_tolerance` τ (default 0.25): trend gate, balanced and shifted tests.
    pub demand_rise_tolerance: f64,
    /// `confirmations` (default 2, ≥ 1).
    pub confirmations: u64,
    /// `utilization` u (default 0.8, in (0, 1]): divides demand in both ratios.
    pub utilization: f64,
    /// `min_arrivals` (default 10): arrivals a decision needs in the window.
    pub min_arrivals: u64,
    /// `demand_floor` (default 0.5): engine-equivalents of demand a decision needs.
    pub demand_floor: f64,
    /// `movement_margin` m (default 0.05, in [0, 1)): the objective gain a move needs.
    pub movement_margin: f64,
    /// `step_s` (default 5): evaluation period.
    pub step_s: f64,
    /// `decode_correction_min` (default 0.5).
    pub decode_correction_min: f64,
    /// `decode_correction_max` (default 2.0).
    pub decode_correction_max: f64,
    /// `decode_correction_alpha` (default 0.2, in (0, 1]).
    pub decode_correction_alpha: f64,
    /// `decode_correction_min_samples` (default 8, ≥ 1).
    pub decode_correction_min_samples: u64,
}

/// `agent` section (ours): router-to-agent call limits.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSection {
    /// Per-call timeout, seconds (default 10).
    pub timeout_s: f64,
    /// Accepted `issued_at` skew, seconds (default 30).
    pub max_skew_s: f64,
}

pub use narwhal_lease::config::{
    EtcdAccess, EtcdAuth, EtcdTls, KubernetesAccess, LeaseBackend, LeaseSection,
    etcd_endpoint_rule, kube_api_server_rule, kube_name_rule,
};

/// PEM file paths for a TLS identity (`tls`, `control.tls`).
#[derive(Debug, Clone, PartialEq)]
pub struct TlsFiles {
    /// Fleet CA certificate.
    pub ca: PathBuf,
    /// Certificate chain.
    pub cert: PathBuf,
    /// Private key.
    pub key: PathBuf,
}

/// The models a router serves (config `model` and `adapters`): a client's `model` must name
/// one of them.
#[derive(Debug, Clone, Copy)]
pub struct Served<'a> {
    /// The base model.
    pub model: &'a str,
    /// Its LoRA adapters.
    pub adapters: &'a [String],
}

impl Served<'_> {
    /// Whether `m` names the base model or one of its adapters.
    pub fn serves(&self, m: &str) -> bool {
        m == self.model || self.adapters.iter().any(|a| a == m)
    }
}

/// A validated fleet file.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The single served base model id.
    pub model: String,
    /// LoRA adapters the engines serve beside `model` (`adapters`; empty by default): a
    /// client's `model` may name one.
    pub adapters: Vec<String>,
    /// Engine kind.
    pub backend: Backend,
    /// Engines in file order (iids unique, at least one).
    pub engines: Vec<EngineConfig>,
    /// Engine profiles in engine order (`profiles.default`, `profiles.engines.<iid>`); empty
    /// when the file gives none, and then the role controller is off.
    pub profiles: Vec<Profile>,
    /// Latency budgets.
    pub slo: Slo,
    /// Controller settings.
    pub controller: Controller,
    /// Serving settings.
    pub serving: Serving,
    /// Engine transport settings.
    pub engine: EngineSection,
    /// Breaker and recovery settings.
    pub recovery: Recovery,
    /// Agent call limits.
    pub agent: AgentSection,
    /// Router lease.
    pub lease: LeaseSection,
    /// Router-to-agent mTLS identity.
    pub tls: Option<TlsFiles>,
    /// Control listener mTLS identity.
    pub control_tls: Option<TlsFiles>,
    /// `control.self_drain`: the listener on which engine pods drain themselves.
    pub self_drain: Option<SelfDrainSection>,
    /// `engine_contract` as given (validated for key names and types).
    pub engine_contract: Option<Value>,
}

/// Largest accepted drain deadline, seconds (one year): a lifecycle drain's and
/// `control.self_drain.deadline_s`.
pub(crate) const MAX_DRAIN_DEADLINE_S: f64 = 365.0 * 24.0 * 3600.0;

/// `control.self_drain` (ours; docs/kubernetes.md, "Self-drain"): a listener on which an
/// engine pod's preStop hook drains that pod's own engine, authenticated by the pod's bound
/// service-account token (Kubernetes TokenReview), never by a client certificate.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfDrainSection {
    /// `listen`: the address to bind (`0.0.0.0:8002`; port 0 picks one). TLS with the
    /// `control.tls` certificate when that is set (no client certificate asked), else plain.
    pub listen: String,
    /// `audience` (default `narwhal-self-drain`): the audience a token must be minted for; a
    /// token for any other audience (the API server's own included) is refused.
    pub audience: String,
    /// `deadline_s` (default 300, 1 s to a year): the deadline of the drain a pod starts.
    pub deadline_s: f64,
    /// `readmit` (default true): the controlling router readmits a drained engine through the
    /// six checks once a restarted process answers at its address (`restart_readmit`).
    pub readmit: bool,
    /// `api_server`; `None`: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
    pub api_server: Option<String>,
    /// `token_file`: the router's own token for TokenReview and pod reads; `None`: the pod's
    /// service-account token.
    pub token_file: Option<PathBuf>,
    /// `ca_file`: the cluster CA; `None`: the pod's.
    pub ca_file: Option<PathBuf>,
}

/// One problem in a fleet file. Every variant names the dotted key (and value when there is
/// one).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigIssue {
    /// A key the schema does not know (a typo would silently fall back to the default).
    #[error("{path}: unknown key")]
    UnknownKey {
        /// Dotted path of the key.
        path: String,
    },
    /// A required key is absent.
    #[error("{path}: required key is missing")]
    Missing {
        /// Dotted path of the key.
        path: String,
    },
    /// The value has the wrong JSON type.
    #[error("{path} must be {expected}, got {value}")]
    Type {
        /// Dotted path.
        path: String,
        /// What was expected (`a number`, `an integer`, ...).
        expected: &'static str,
        /// The offending value as JSON.
        value: String,
    },
    /// The value breaks a range or enumeration rule.
    #[error("{path} = {value}: {rule}")]
    Rule {
        /// Dotted path.
        path: String,
        /// The offending value as JSON.
        value: String,
        /// The rule, e.g. `must be > 0`.
        rule: String,
    },
    /// Two engines share an iid.
    #[error("engines[{second}].iid = \"{iid}\": repeats the instance id of engines[{first}]")]
    DuplicateIid {
        /// The repeated iid.
        iid: String,
        /// Index of the first engine with it.
        first: usize,
        /// Index of the repeat.
        second: usize,
    },
    /// `engines` is empty.
    #[error("engines: the fleet declares no engines")]
    NoEngines,
    /// Top-level `backend` and `engine.backend` disagree.
    #[error("backend = \"{top}\" disagrees with engine.backend = \"{engine}\"")]
    BackendMismatch {
        /// Top-level value.
        top: String,
        /// `engine.backend` value.
        engine: String,
    },
}

/// Loading a fleet file failed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: cannot read fleet file: {source}")]
    Read {
        /// The fleet file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not JSON (NaN and Infinity are not JSON).
    #[error("{path}: not valid JSON: {source}")]
    Json {
        /// The fleet file.
        path: PathBuf,
        /// The parser error with line and column.
        source: serde_json::Error,
    },
    /// The JSON breaks the schema; every problem is listed.
    #[error("{path}: {} problem(s):\n{}", issues.len(), render_issues(issues))]
    Invalid {
        /// The fleet file.
        path: PathBuf,
        /// All problems found, in file order.
        issues: Vec<ConfigIssue>,
    },
}

fn render_issues(issues: &[ConfigIssue]) -> String {
    issues
        .iter()
        .map(|i| format!("  {i}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Config {
    /// The models served: `model` and its `adapters`.
    pub(crate) fn served(&self) -> Served<'_> {
        Served {
            model: &self.model,
            adapters: &self.adapters,
        }
    }

    /// Read and validate a fleet file.
    ///
    /// # Errors
    /// [`ConfigError::Read`] / [`ConfigError::Json`] when the file cannot be read or parsed;
    /// [`ConfigError::Invalid`] with every schema problem otherwise.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, &|k| std::env::var(k).ok()).map_err(|e| match e {
            ParseError::Json(source) => ConfigError::Json {
                path: path.to_path_buf(),
                source,
            },
            ParseError::Invalid(issues) => ConfigError::Invalid {
                path: path.to_path_buf(),
                issues,
            },
        })
    }

    /// Validate fleet JSON text; `env` resolves `${VAR}` references in engine URLs.
    ///
    /// # Errors
    /// [`ParseError::Json`] for unparsable text, [`ParseError::Invalid`] with every issue.
    pub fn from_json_str(
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ParseError> {
        let value: Value = serde_json::from_str(text).map_err(ParseError::Json)?;
        let mut c = Checker {
            issues: Vec::new(),
            env,
            objects: Vec::new(),
        };
        let cfg = c.fleet(&value);
        match cfg {
            Some(cfg) if c.issues.is_empty() => Ok(cfg),
            _ => Err(ParseError::Invalid(c.issues)),
        }
    }

    /// The default TTFT/TPOT-free first-token limit for a decode leg, as a `Duration`.
    pub(crate) fn first_token_timeout(&self) -> std::time::Duration {
        secs(self.engine.first_token_timeout_s)
    }

    /// The KV-pull budget a split's decode leg gets on top of its first-token limit
    /// (`engine.kv_transfer_timeout_s`), as a `Duration`.
    pub(crate) fn kv_transfer_timeout(&self) -> std::time::Duration {
        secs(self.engine.kv_transfer_timeout_s)
    }
}

/// Errors of [`Config::from_json_str`].
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// Not JSON.
    #[error("not valid JSON: {0}")]
    Json(serde_json::Error),
    /// Schema issues.
    #[error("{} problem(s): {}", .0.len(), render_issues(.0))]
    Invalid(Vec<ConfigIssue>),
}

pub(crate) fn secs(s: f64) -> std::time::Duration {
    std::time::Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(std::time::Duration::MAX)
}
