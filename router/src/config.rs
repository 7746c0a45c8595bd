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

use serde_json::{Map, Value};

pub use crate::profile::Profile;

pub(crate) mod schema;

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
    /// Full attestation URL, `""` when none.
    pub attestation_url: String,
    /// Optional agent endpoint.
    pub agent: Option<EngineAgent>,
    /// `engines[].health_path`: the path the health gate and the breaker's probes GET
    /// (default `/health`; `/v1/models` for engines without `/health`, e.g. llama.cpp).
    /// Starts with `/`, no query.
    pub health_path: String,
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
    EtcdAccess, EtcdAuth, EtcdTls, LeaseBackend, LeaseSection, etcd_endpoint_rule,
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

/// A validated fleet file.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The single served model id.
    pub model: String,
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
    /// `engine_contract` as given (validated for key names and types).
    pub engine_contract: Option<Value>,
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

const TOP_KEYS: &[&str] = &[
    "schema",
    "schema_version",
    "model",
    "backend",
    "engines",
    "slo",
    "controller",
    "serving",
    "engine",
    "recovery",
    "profiles",
    "engine_contract",
    "hardware",
    "agent",
    "lease",
    "tls",
    "control",
];

struct Checker<'e> {
    issues: Vec<ConfigIssue>,
    env: &'e dyn Fn(&str) -> Option<String>,
    /// Every object checked, with the keys it accepts (`schema::accepted_keys`).
    objects: Vec<(String, Vec<String>)>,
}

fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        format!("{}…", &s[..s.floor_char_boundary(77)])
    } else {
        s
    }
}

fn join(parent: &str, key: &str) -> String {
    if parent.is_empty() {
        key.to_string()
    } else {
        format!("{parent}.{key}")
    }
}

/// A checked object: remembers its dotted path.
struct Obj<'v> {
    path: String,
    map: Option<&'v Map<String, Value>>,
}

impl<'v> Obj<'v> {
    fn get(&self, key: &str) -> Option<&'v Value> {
        self.map.and_then(|m| m.get(key)).filter(|v| !v.is_null())
    }
    fn p(&self, key: &str) -> String {
        join(&self.path, key)
    }
}

impl Checker<'_> {
    fn rule(&mut self, path: String, v: &Value, rule: impl Into<String>) {
        self.issues.push(ConfigIssue::Rule {
            path,
            value: show(v),
            rule: rule.into(),
        });
    }

    fn ty(&mut self, path: String, v: &Value, expected: &'static str) {
        self.issues.push(ConfigIssue::Type {
            path,
            expected,
            value: show(v),
        });
    }

    /// Check `v` is an object with only `known` keys (plus `_comments`).
    fn obj<'v>(&mut self, path: &str, v: Option<&'v Value>, known: &[&str]) -> Obj<'v> {
        self.objects.push((
            path.to_string(),
            known.iter().map(|k| (*k).to_string()).collect(),
        ));
        let map = match v {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => {
                for k in m.keys() {
                    if !k.starts_with('_') && !known.contains(&k.as_str()) {
                        self.issues.push(ConfigIssue::UnknownKey {
                            path: join(path, k),
                        });
                    }
                }
                Some(m)
            }
            Some(other) => {
                self.ty(path.to_string(), other, "an object");
                None
            }
        };
        Obj {
            path: path.to_string(),
            map,
        }
    }

    fn num(
        &mut self,
        o: &Obj<'_>,
        key: &str,
        default: f64,
        check: fn(f64) -> Option<&'static str>,
    ) -> f64 {
        let Some(v) = o.get(key) else { return default };
        match v.as_f64() {
            Some(x) if v.is_number() => {
                if let Some(rule) = check(x) {
                    self.rule(o.p(key), v, rule);
                }
                x
            }
            _ => {
                self.ty(o.p(key), v, "a number");
                default
            }
        }
    }

    fn int(&mut self, o: &Obj<'_>, key: &str, default: u64, min: u64, max: u64) -> u64 {
        let Some(v) = o.get(key) else { return default };
        match v.as_u64() {
            Some(x) => {
                if x < min || x > max {
                    let rule = if max == u64::MAX {
                        format!("must be an integer ≥ {min}")
                    } else {
                        format!("must be an integer in {min}..={max}")
                    };
                    self.rule(o.p(key), v, rule);
                }
                x
            }
            None if v.is_i64() => {
                self.rule(o.p(key), v, format!("must be an integer ≥ {min}"));
                default
            }
            None => {
                self.ty(o.p(key), v, "an integer");
                default
            }
        }
    }

    fn boolean(&mut self, o: &Obj<'_>, key: &str, default: bool) -> bool {
        let Some(v) = o.get(key) else { return default };
        match v.as_bool() {
            Some(b) => b,
            None => {
                self.ty(o.p(key), v, "a boolean");
                default
            }
        }
    }

    fn string(&mut self, o: &Obj<'_>, key: &str, default: &str) -> String {
        let Some(v) = o.get(key) else {
            return default.to_string();
        };
        match v.as_str() {
            Some(s) => s.to_string(),
            None => {
                self.ty(o.p(key), v, "a string");
                default.to_string()
            }
        }
    }

    fn choice(
        &mut self,
        o: &Obj<'_>,
        key: &str,
        default: &'static str,
        allowed: &[&'static str],
    ) -> &'static str {
        let Some(v) = o.get(key) else { return default };
        match v.as_str() {
            Some(s) => match allowed.iter().find(|a| **a == s) {
                Some(a) => a,
                None => {
                    self.rule(
                        o.p(key),
                        v,
                        format!("must be one of {}", allowed.join(", ")),
                    );
                    default
                }
            },
            None => {
                self.ty(o.p(key), v, "a string");
                default
            }
        }
    }

    /// Validate the keys and primitive types of a section this version does not act on.
    fn passive(&mut self, o: &Obj<'_>, keys: &[(&str, Kind)]) {
        for (k, kind) in keys {
            let Some(v) = o.get(k) else { continue };
            let ok = match kind {
                Kind::NonNegNum => v.as_f64().is_some_and(|x| x >= 0.0),
                Kind::PosNum => v.as_f64().is_some_and(|x| x > 0.0),
                Kind::Int => v.is_u64(),
                Kind::BoolOrNull => v.is_boolean(),
                Kind::Str => v.is_string(),
            };
            if !ok {
                let expected = match kind {
                    Kind::NonNegNum => "a number ≥ 0",
                    Kind::PosNum => "a number > 0",
                    Kind::Int => "an integer ≥ 0",
                    Kind::BoolOrNull => "a boolean",
                    Kind::Str => "a string",
                };
                self.ty(o.p(k), v, expected);
            }
        }
    }

    fn env_ref(&mut self, path: String, raw: String) -> String {
        if let Some(name) = raw.strip_prefix("${").and_then(|r| r.strip_suffix('}')) {
            if name.is_empty() || name.contains('$') || name.contains('{') || name.contains('}') {
                self.rule(
                    path,
                    &Value::String(raw.clone()),
                    "malformed ${VAR} reference",
                );
                return raw;
            }
            match (self.env)(name) {
                Some(val) if !val.is_empty() && !val.contains("${") => return val,
                Some(val) if val.contains("${") => {
                    self.rule(
                        path,
                        &Value::String(raw.clone()),
                        format!("environment variable {name} contains another reference"),
                    );
                }
                _ => {
                    self.rule(
                        path,
                        &Value::String(raw.clone()),
                        format!("environment variable {name} is unset or empty"),
                    );
                }
            }
            raw
        } else if raw.contains("${") {
            self.rule(
                path,
                &Value::String(raw.clone()),
                "a ${VAR} reference must be the whole value",
            );
            raw
        } else {
            raw
        }
    }

    fn fleet(&mut self, root: &Value) -> Option<Config> {
        let top = self.obj("", Some(root), TOP_KEYS);
        if top.map.is_none() {
            if !root.is_object() {
                // obj() already reported the type problem with an empty path; name it.
                self.issues.clear();
                self.ty("(fleet file)".into(), root, "an object");
            }
            return None;
        }
        match top.get("schema") {
            Some(Value::String(s)) if s == "narwhal.fleet" => {}
            Some(v) => self.rule("schema".into(), v, "must be \"narwhal.fleet\""),
            None => self.issues.push(ConfigIssue::Missing {
                path: "schema".into(),
            }),
        }
        match top.get("schema_version") {
            Some(v) if v.as_u64() == Some(2) => {}
            Some(v) => self.rule("schema_version".into(), v, "must be 2"),
            None => self.issues.push(ConfigIssue::Missing {
                path: "schema_version".into(),
            }),
        }
        let model = match top.get("model") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(v) => {
                self.ty("model".into(), v, "a non-empty string");
                String::new()
            }
            None => {
                self.issues.push(ConfigIssue::Missing {
                    path: "model".into(),
                });
                String::new()
            }
        };
        let top_backend = top
            .get("backend")
            .is_some()
            .then(|| self.choice(&top, "backend", "vllm", &["vllm", "sglang"]));

        let engines = self.engines(top.get("engines"));

        // slo (required)
        let slo_obj = self.obj("slo", top.get("slo"), &["ttft_s", "tpot_s"]);
        if top.get("slo").is_none() {
            self.issues
                .push(ConfigIssue::Missing { path: "slo".into() });
        }
        for k in ["ttft_s", "tpot_s"] {
            if slo_obj.map.is_some() && slo_obj.get(k).is_none() {
                self.issues
                    .push(ConfigIssue::Missing { path: slo_obj.p(k) });
            }
        }
        let slo = Slo {
            ttft_s: self.num(&slo_obj, "ttft_s", 1.0, positive),
            tpot_s: self.num(&slo_obj, "tpot_s", 0.1, positive),
        };

        let controller = self.controller(top.get("controller"), engines.len());
        let serving = self.serving(top.get("serving"));
        let engine = self.engine(top.get("engine"), &serving, engines.len());
        let recovery = self.recovery(top.get("recovery"));
        let (default_profile, engine_profiles) = self.profiles(top.get("profiles"));
        self.hardware(top.get("hardware"));
        let engine_contract = self.contract(top.get("engine_contract"));
        let agent_obj = self.obj("agent", top.get("agent"), &["timeout_s", "max_skew_s"]);
        let agent = AgentSection {
            timeout_s: self.num(&agent_obj, "timeout_s", 10.0, positive),
            max_skew_s: self.num(&agent_obj, "max_skew_s", 30.0, non_negative),
        };
        let lease = self.lease(top.get("lease"));
        let tls = self.tls("tls", top.get("tls"));
        let control = self.obj("control", top.get("control"), &["tls"]);
        let control_tls = self.tls("control.tls", control.get("tls"));

        let backend = match (top_backend, engine.backend) {
            (Some(t), Some(e)) if t != e.as_str() => {
                self.issues.push(ConfigIssue::BackendMismatch {
                    top: t.to_string(),
                    engine: e.as_str().to_string(),
                });
                Backend::Vllm
            }
            (Some("sglang"), _) => Backend::Sglang,
            (Some(_), _) => Backend::Vllm,
            (None, Some(e)) => e,
            (None, None) => Backend::Vllm,
        };
        if !engine.dialect.is_empty() && engine.dialect != backend.as_str() {
            self.rule(
                "engine.dialect".into(),
                &Value::String(engine.dialect.clone()),
                format!("must equal the backend ({backend})"),
            );
        }
        let default_connector = match backend {
            Backend::Vllm => "nixl",
            Backend::Sglang => "mooncake",
        };
        if !engine.connector.is_empty() && engine.connector != default_connector {
            self.rule(
                "engine.connector".into(),
                &Value::String(engine.connector.clone()),
                format!("backend {backend} supports only connector \"{default_connector}\""),
            );
        }
        if top.get("engines").is_some()
            && engines.is_empty()
            && top.get("engines").is_some_and(Value::is_array)
        {
            self.issues.push(ConfigIssue::NoEngines);
        }
        if top.get("engines").is_none() {
            self.issues.push(ConfigIssue::Missing {
                path: "engines".into(),
            });
        }
        let n = engines.len() as u32;
        if n > 0
            && !(n == 1 && controller.min_prefill == 1 && controller.min_decode == 1)
            && controller.min_prefill + controller.min_decode > n
        {
            self.rule(
                "controller.min_prefill".into(),
                &Value::from(controller.min_prefill),
                format!(
                    "min_prefill + min_decode ({}) exceeds the engine count ({n})",
                    controller.min_prefill + controller.min_decode
                ),
            );
        }
        // architecture.md 9.2: process identity comes from the agents, so whole-wave restarts need
        // an agent on every engine rather than an engine_contract.
        if recovery.engine_restart_policy == RestartPolicy::WholeWave
            && engines.iter().any(|e| e.agent.is_none())
        {
            self.rule(
                "recovery.engine_restart_policy".into(),
                &Value::from("whole_wave"),
                "whole_wave requires engines[].agent on every engine",
            );
        }
        if tls.is_none() && engines.iter().any(|e| e.agent.is_some()) {
            self.issues.push(ConfigIssue::Missing {
                path:
                    "tls (required by engines[].agent: the router talks to agents over mutual TLS)"
                        .into(),
            });
        }
        let profiles = self.resolve_profiles(&engines, default_profile, engine_profiles);
        if serving.admission == AdmissionMode::Predictive && profiles.is_empty() && n > 0 {
            self.rule(
                "serving.admission".into(),
                &Value::from("predictive"),
                "predictive admission prices every request with the engine profiles: \
                 set profiles.default or profiles.engines.<iid>",
            );
        }
        Some(Config {
            model,
            backend,
            profiles,
            engines,
            slo,
            controller,
            serving,
            engine,
            recovery,
            agent,
            lease,
            tls,
            control_tls,
            engine_contract,
        })
    }

    /// One profile per engine in config order, or none at all (controller.md 3.4: every
    /// price goes through a profile, so a partial set is an error naming the engines left
    /// out); a profile for an unknown engine is an error too.
    fn resolve_profiles(
        &mut self,
        engines: &[EngineConfig],
        default: Option<Profile>,
        named: Vec<(String, Profile)>,
    ) -> Vec<Profile> {
        for (iid, _) in &named {
            if !engines.iter().any(|e| &e.iid == iid) {
                self.rule(
                    format!("profiles.engines.{iid}"),
                    &Value::from(iid.as_str()),
                    "names no configured engine",
                );
            }
        }
        if default.is_none() && named.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut missing = Vec::new();
        for e in engines {
            match named.iter().find(|(i, _)| *i == e.iid).map(|(_, p)| p) {
                Some(p) => out.push(p.clone()),
                None => match &default {
                    Some(d) => out.push(d.clone()),
                    None => missing.push(e.iid.clone()),
                },
            }
        }
        if !missing.is_empty() {
            self.rule(
                "profiles.engines".into(),
                &Value::from(missing.join(", ")),
                "these engines have no profile (give every engine one, or set profiles.default)",
            );
            return Vec::new();
        }
        out
    }

    fn engines(&mut self, v: Option<&Value>) -> Vec<EngineConfig> {
        let Some(v) = v else { return Vec::new() };
        let Some(items) = v.as_array() else {
            self.ty("engines".into(), v, "an array");
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut seen: Vec<(String, usize)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let path = format!("engines[{i}]");
            let o = self.obj(
                &path,
                Some(item),
                &[
                    "iid",
                    "url",
                    "role",
                    "pin",
                    "attestation_url",
                    "shared_device",
                    "agent",
                    "health_path",
                ],
            );
            if o.map.is_none() {
                continue;
            }
            let iid = match o.get("iid") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                Some(v) => {
                    self.ty(o.p("iid"), v, "a non-empty string");
                    String::new()
                }
                None => {
                    self.issues.push(ConfigIssue::Missing { path: o.p("iid") });
                    String::new()
                }
            };
            let url = match o.get("url") {
                Some(Value::String(s)) if !s.is_empty() => {
                    let s = self.env_ref(o.p("url"), s.clone());
                    if !(s.starts_with("http://")
                        || s.starts_with("https://")
                        || s.starts_with("${"))
                    {
                        self.rule(
                            o.p("url"),
                            &Value::String(s.clone()),
                            "must be an http:// or https:// URL",
                        );
                    }
                    s.trim_end_matches('/').to_string()
                }
                Some(v) => {
                    self.ty(o.p("url"), v, "a non-empty string");
                    String::new()
                }
                None => {
                    self.issues.push(ConfigIssue::Missing { path: o.p("url") });
                    String::new()
                }
            };
            let role = match self.choice(&o, "role", "decode", &["prefill", "decode"]) {
                "prefill" => Role::Prefill,
                _ => Role::Decode,
            };
            let pin = self.boolean(&o, "pin", false);
            let raw_att = self.string(&o, "attestation_url", "");
            let attestation_url = self.env_ref(o.p("attestation_url"), raw_att);
            let sd = self.obj(
                &o.p("shared_device"),
                o.get("shared_device"),
                &[
                    "group",
                    "gpu_uuid",
                    "device_allowance",
                    "gpu_memory_utilization",
                ],
            );
            self.passive(
                &sd,
                &[
                    ("group", Kind::Str),
                    ("gpu_uuid", Kind::Str),
                    ("device_allowance", Kind::NonNegNum),
                    ("gpu_memory_utilization", Kind::PosNum),
                ],
            );
            let agent = match o.get("agent") {
                None => None,
                Some(av) => {
                    let a = self.obj(
                        &o.p("agent"),
                        Some(av),
                        &["url", "server_name", "public_key", "agent_id"],
                    );
                    if a.map.is_none() {
                        None
                    } else {
                        let req = |c: &mut Self, k: &str| match a.get(k) {
                            Some(Value::String(s)) if !s.is_empty() => s.clone(),
                            Some(v) => {
                                c.ty(a.p(k), v, "a non-empty string");
                                String::new()
                            }
                            None => {
                                c.issues.push(ConfigIssue::Missing { path: a.p(k) });
                                String::new()
                            }
                        };
                        let url = req(self, "url");
                        let server_name = req(self, "server_name");
                        let public_key = req(self, "public_key");
                        if !public_key.is_empty() && !public_key.starts_with("ed25519:") {
                            self.rule(
                                a.p("public_key"),
                                &Value::String(public_key.clone()),
                                "must start with \"ed25519:\"",
                            );
                        }
                        let agent_id = match a.get("agent_id") {
                            None => server_name.clone(),
                            Some(Value::String(s)) if !s.is_empty() => s.clone(),
                            Some(v) => {
                                self.ty(a.p("agent_id"), v, "a non-empty string");
                                String::new()
                            }
                        };
                        Some(EngineAgent {
                            url: url.trim_end_matches('/').to_string(),
                            server_name,
                            public_key,
                            agent_id,
                        })
                    }
                }
            };
            if !iid.is_empty() {
                if let Some((_, first)) = seen.iter().find(|(s, _)| *s == iid) {
                    self.issues.push(ConfigIssue::DuplicateIid {
                        iid: iid.clone(),
                        first: *first,
                        second: i,
                    });
                } else {
                    seen.push((iid.clone(), i));
                }
            }
            let health_path = self.string(&o, "health_path", "/health");
            if !health_path.starts_with('/') || health_path.contains(['?', '#', ' ']) {
                self.rule(
                    o.p("health_path"),
                    &Value::String(health_path.clone()),
                    "must be a path starting with / (no query, e.g. \"/health\" or \"/v1/models\")",
                );
            }
            out.push(EngineConfig {
                iid,
                url,
                role,
                pin,
                attestation_url,
                agent,
                health_path,
            });
        }
        out
    }

    fn controller(&mut self, v: Option<&Value>, _engines: usize) -> Controller {
        let o = self.obj(
            "controller",
            v,
            &[
                "monitor_interval_s",
                "monitor_failure_limit",
                "advisory",
                "min_prefill",
                "min_decode",
                "flip_history",
                "thresholds",
                "reactive",
            ],
        );
        let monitor_interval_s = self.num(&o, "monitor_interval_s", 1.0, positive);
        let monitor_failure_limit =
            self.int(&o, "monitor_failure_limit", 5, 1, u32::MAX as u64) as u32;
        let advisory = self.boolean(&o, "advisory", false);
        let min_prefill = self.int(&o, "min_prefill", 1, 1, u32::MAX as u64) as u32;
        let min_decode = self.int(&o, "min_decode", 1, 1, u32::MAX as u64) as u32;
        let flip_history = self.int(&o, "flip_history", 1000, 1, u64::MAX);
        let th = self.obj(
            "controller.thresholds",
            o.get("thresholds"),
            &[
                "expand",
                "shrink",
                "cooldown_s",
                "sustained_intervals",
                "dwell_s",
                "panic_ratio",
                "flip_resident_guard",
            ],
        );
        let expand = self.num(&th, "expand", 1.0, positive);
        let shrink = self.num(&th, "shrink", 0.5, non_negative);
        if shrink >= expand {
            self.rule(
                th.p("shrink"),
                &Value::from(shrink),
                format!("must be < thresholds.expand ({expand})"),
            );
        }
        let thresholds = Thresholds {
            expand,
            shrink,
            cooldown_s: self.num(&th, "cooldown_s", 10.0, non_negative),
            sustained_intervals: self.int(&th, "sustained_intervals", 3, 1, u64::MAX),
            dwell_s: self.num(&th, "dwell_s", 0.0, non_negative),
            panic_ratio: self.num(&th, "panic_ratio", 0.0, |x| {
                (x != 0.0 && x < 1.0).then_some("must be 0 or ≥ 1")
            }),
            flip_resident_guard: self.int(&th, "flip_resident_guard", 0, 0, u64::MAX),
        };
        let re = self.obj(
            "controller.reactive",
            o.get("reactive"),
            &[
                "window_s",
                "evidence_span_s",
                "evidence_max_span_s",
                "evidence_min_arrivals",
                "demand_rise_tolerance",
                "confirmations",
                "utilization",
                "min_arrivals",
                "demand_floor",
                "movement_margin",
                "step_s",
                "decode_correction_min",
                "decode_correction_max",
                "decode_correction_alpha",
                "decode_correction_min_samples",
            ],
        );
        let window = self.num(&re, "window_s", 120.0, positive);
        let span = self.num(&re, "evidence_span_s", 60.0, positive);
        let max_span = self.num(&re, "evidence_max_span_s", 120.0, positive);
        if span > max_span {
            self.rule(
                re.p("evidence_span_s"),
                &Value::from(span),
                format!("must be ≤ evidence_max_span_s ({max_span})"),
            );
        }
        if max_span > window {
            self.rule(
                re.p("evidence_max_span_s"),
                &Value::from(max_span),
                format!("must be ≤ window_s ({window})"),
            );
        }
        let reactive = Reactive {
            window_s: window,
            evidence_span_s: span,
            evidence_max_span_s: max_span,
            evidence_min_arrivals: self.int(&re, "evidence_min_arrivals", 10, 0, u64::MAX),
            demand_rise_tolerance: self.num(&re, "demand_rise_tolerance", 0.25, non_negative),
            confirmations: self.int(&re, "confirmations", 2, 1, u64::MAX),
            utilization: self.num(&re, "utilization", 0.8, |x| {
                (x <= 0.0 || x > 1.0).then_some("must be in (0, 1]")
            }),
            min_arrivals: self.int(&re, "min_arrivals", 10, 0, u64::MAX),
            demand_floor: self.num(&re, "demand_floor", 0.5, non_negative),
            movement_margin: self.num(&re, "movement_margin", 0.05, |x| {
                (!(0.0..1.0).contains(&x)).then_some("must be in [0, 1)")
            }),
            step_s: self.num(&re, "step_s", 5.0, positive),
            decode_correction_min: self.num(&re, "decode_correction_min", 0.5, positive),
            decode_correction_max: self.num(&re, "decode_correction_max", 2.0, positive),
            decode_correction_alpha: self.num(&re, "decode_correction_alpha", 0.2, |x| {
                (x <= 0.0 || x > 1.0).then_some("must be in (0, 1]")
            }),
            decode_correction_min_samples: self.int(
                &re,
                "decode_correction_min_samples",
                8,
                1,
                u64::MAX,
            ),
        };
        if reactive.decode_correction_max < reactive.decode_correction_min {
            self.rule(
                re.p("decode_correction_max"),
                &Value::from(reactive.decode_correction_max),
                format!(
                    "must be ≥ decode_correction_min ({})",
                    reactive.decode_correction_min
                ),
            );
        }
        Controller {
            monitor_interval_s,
            monitor_failure_limit,
            advisory,
            min_prefill,
            min_decode,
            flip_history,
            thresholds,
            reactive,
        }
    }

    fn serving(&mut self, v: Option<&Value>) -> Serving {
        let o = self.obj(
            "serving",
            v,
            &[
                "admission",
                "admission_margin",
                "max_connections",
                "request_timeout_s",
                "prefill_timeout_s",
                "graceful_timeout_s",
                "queue_capacity",
                "queue_timeout_s",
                "max_attempts",
                "retry_base_s",
                "retry_cap_s",
                "retry_budget",
                "retry_replenish",
                "max_request_bytes",
                "max_response_bytes",
                "body_read_timeout_s",
                "max_batch_prompts",
            ],
        );
        let admission = match self.choice(&o, "admission", "open", &["predictive", "open"]) {
            "predictive" => AdmissionMode::Predictive,
            _ => AdmissionMode::Open,
        };
        let s = Serving {
            admission,
            admission_margin: self.num(&o, "admission_margin", 0.0, non_negative),
            max_connections: self.int(&o, "max_connections", 768, 1, u64::MAX),
            request_timeout_s: self.num(&o, "request_timeout_s", 600.0, positive),
            prefill_timeout_s: self.num(&o, "prefill_timeout_s", 120.0, positive),
            graceful_timeout_s: self.int(&o, "graceful_timeout_s", 30, 0, u64::MAX),
            queue_capacity: self.int(&o, "queue_capacity", 0, 0, u64::MAX),
            queue_timeout_s: self.num(&o, "queue_timeout_s", 0.0, non_negative),
            max_attempts: self.int(&o, "max_attempts", 2, 1, 3) as u32,
            retry_base_s: self.num(&o, "retry_base_s", 0.1, positive),
            retry_cap_s: self.num(&o, "retry_cap_s", 1.0, positive),
            retry_budget: self.int(&o, "retry_budget", 10, 0, u64::MAX),
            retry_replenish: self.num(&o, "retry_replenish", 0.1, |x| {
                (!(0.0..=1.0).contains(&x)).then_some("must be in [0, 1]")
            }),
            max_request_bytes: self.int(&o, "max_request_bytes", 4_194_304, 1, u64::MAX),
            max_response_bytes: self.int(&o, "max_response_bytes", 16_777_216, 1, u64::MAX),
            body_read_timeout_s: self.num(&o, "body_read_timeout_s", 30.0, positive),
            max_batch_prompts: self.int(&o, "max_batch_prompts", 64, 1, 4096) as usize,
        };
        if s.prefill_timeout_s > s.request_timeout_s {
            self.rule(
                "serving.prefill_timeout_s".into(),
                &Value::from(s.prefill_timeout_s),
                format!(
                    "must be ≤ serving.request_timeout_s ({})",
                    s.request_timeout_s
                ),
            );
        }
        if s.queue_capacity > 0 && s.queue_timeout_s <= 0.0 {
            self.rule(
                "serving.queue_timeout_s".into(),
                &Value::from(s.queue_timeout_s),
                "must be > 0 when serving.queue_capacity > 0",
            );
        }
        if s.retry_cap_s < s.retry_base_s {
            self.rule(
                "serving.retry_cap_s".into(),
                &Value::from(s.retry_cap_s),
                format!("must be ≥ serving.retry_base_s ({})", s.retry_base_s),
            );
        }
        s
    }

    fn engine(&mut self, v: Option<&Value>, serving: &Serving, _n: usize) -> EngineSection {
        let o = self.obj(
            "engine",
            v,
            &[
                "backend",
                "connector",
                "dialect",
                "tokenize",
                "chars_per_token",
                "tokenize_timeout_s",
                "engine_api_key_env",
                "control_connections",
                "pool_timeout_s",
                "connect_timeout_s",
                "health_timeout_s",
                "decode_read_timeout_s",
                "first_token_timeout_s",
                "first_token_calibration_path",
            ],
        );
        let backend = o.get("backend").is_some().then(|| {
            match self.choice(&o, "backend", "vllm", &["vllm", "sglang"]) {
                "sglang" => Backend::Sglang,
                _ => Backend::Vllm,
            }
        });
        let engine_api_key_env = self.string(&o, "engine_api_key_env", "");
        let engine_api_key = if engine_api_key_env.is_empty() {
            None
        } else {
            let val = (self.env)(&engine_api_key_env).filter(|s| !s.is_empty());
            if val.is_none() {
                self.rule(
                    "engine.engine_api_key_env".into(),
                    &Value::String(engine_api_key_env.clone()),
                    "names an environment variable that is unset or empty",
                );
            }
            val
        };
        let e = EngineSection {
            backend,
            connector: self.string(&o, "connector", ""),
            dialect: self.string(&o, "dialect", ""),
            tokenize: self.boolean(&o, "tokenize", true),
            chars_per_token: self.num(&o, "chars_per_token", 3.8, positive),
            tokenize_timeout_s: self.num(&o, "tokenize_timeout_s", 2.0, positive),
            engine_api_key_env,
            engine_api_key,
            control_connections: self.int(&o, "control_connections", 0, 0, u64::MAX),
            pool_timeout_s: self.num(&o, "pool_timeout_s", 5.0, positive),
            connect_timeout_s: self.num(&o, "connect_timeout_s", 10.0, positive),
            health_timeout_s: self.num(&o, "health_timeout_s", 5.0, positive),
            decode_read_timeout_s: self.num(&o, "decode_read_timeout_s", 10.0, non_negative),
            first_token_timeout_s: self.num(&o, "first_token_timeout_s", 2.5, positive),
            first_token_calibration_path: self.string(&o, "first_token_calibration_path", ""),
        };
        if e.first_token_timeout_s > serving.request_timeout_s {
            self.rule(
                "engine.first_token_timeout_s".into(),
                &Value::from(e.first_token_timeout_s),
                format!(
                    "must be ≤ serving.request_timeout_s ({})",
                    serving.request_timeout_s
                ),
            );
        }
        e
    }

    fn recovery(&mut self, v: Option<&Value>) -> Recovery {
        let o = self.obj(
            "recovery",
            v,
            &[
                "eject_after",
                "readmit_every",
                "liveness_every",
                "liveness_misses",
                "engine_restart_policy",
                "failure_quarantine_s",
                "state_path",
                "resume",
                "health",
                "max_readmit_interval_s",
                "max_ejection_percent",
            ],
        );
        let policy = match self.choice(
            &o,
            "engine_restart_policy",
            "individual",
            &["individual", "whole_wave"],
        ) {
            "whole_wave" => RestartPolicy::WholeWave,
            _ => RestartPolicy::Individual,
        };
        let r = Recovery {
            eject_after: self.int(&o, "eject_after", 3, 1, u32::MAX as u64) as u32,
            readmit_every: self.int(&o, "readmit_every", 10, 1, u32::MAX as u64) as u32,
            liveness_every: self.int(&o, "liveness_every", 10, 0, u32::MAX as u64) as u32,
            liveness_misses: self.int(&o, "liveness_misses", 2, 1, u32::MAX as u64) as u32,
            engine_restart_policy: policy,
            failure_quarantine_s: self.num(&o, "failure_quarantine_s", 0.0, non_negative),
            state_path: self.string(&o, "state_path", "runs/state.json"),
            resume: self.boolean(&o, "resume", false),
            max_readmit_interval_s: self.num(&o, "max_readmit_interval_s", 300.0, positive),
            max_ejection_percent: self.int(&o, "max_ejection_percent", 50, 1, 100) as u32,
        };
        if policy == RestartPolicy::WholeWave && r.liveness_every == 0 {
            self.rule(
                "recovery.liveness_every".into(),
                &Value::from(0),
                "must be > 0 for whole_wave",
            );
        }
        let h = self.obj(
            "recovery.health",
            o.get("health"),
            &[
                "window_s",
                "drift_band",
                "min_samples",
                "probation_windows",
                "evict_windows",
                "recovery_windows",
                "probation_penalty_s",
                "relative_band",
            ],
        );
        self.num(&h, "window_s", 30.0, positive);
        self.num(&h, "drift_band", 2.0, |x| {
            (x <= 1.0).then_some("must be > 1")
        });
        self.int(&h, "min_samples", 3, 1, u64::MAX);
        let prob = self.int(&h, "probation_windows", 3, 1, u64::MAX);
        let evict = self.int(&h, "evict_windows", 5, 1, u64::MAX);
        if evict < prob {
            self.rule(
                h.p("evict_windows"),
                &Value::from(evict),
                format!("must be ≥ probation_windows ({prob})"),
            );
        }
        self.int(&h, "recovery_windows", 3, 1, u64::MAX);
        self.num(&h, "probation_penalty_s", 1.5, non_negative);
        self.num(&h, "relative_band", 1.5, positive);
        r
    }

    /// `profiles`: `default` (every engine without its own) and `engines.<iid>`, each the
    /// profile shape of [`Profile`]; `path` and the fit limits are accepted for reference
    /// files and unused. Returns `(default, per engine)`.
    fn profiles(&mut self, v: Option<&Value>) -> (Option<Profile>, Vec<(String, Profile)>) {
        let o = self.obj(
            "profiles",
            v,
            &[
                "path",
                "max_decode_fit_mape",
                "max_decode_cv_mape",
                "default",
                "engines",
            ],
        );
        self.passive(
            &o,
            &[
                ("path", Kind::Str),
                ("max_decode_fit_mape", Kind::NonNegNum),
                ("max_decode_cv_mape", Kind::NonNegNum),
            ],
        );
        let default = o
            .get("default")
            .and_then(|d| self.profile(&o.p("default"), d));
        let mut engines = Vec::new();
        match o.get("engines") {
            None => {}
            Some(Value::Object(m)) => {
                for (iid, p) in m {
                    if iid.starts_with('_') {
                        continue;
                    }
                    if let Some(p) = self.profile(&format!("{}.{iid}", o.p("engines")), p) {
                        engines.push((iid.clone(), p));
                    }
                }
            }
            Some(other) => self.ty(o.p("engines"), other, "an object of iid → profile"),
        }
        (default, engines)
    }

    /// One profile object at `path` (controller.md 3.4).
    fn profile(&mut self, path: &str, v: &Value) -> Option<Profile> {
        const KEYS: &[&str] = &[
            "ttft_a",
            "ttft_b",
            "ttft_c",
            "prefill_min_tokens",
            "ttft_split",
            "tpot_slope",
            "tpot_request_slope",
            "tpot_intercept",
            "decode_min_requests",
            "decode_max_requests",
            "decode_min_kv_tokens",
            "decode_max_kv_tokens",
            "kv_capacity_tokens",
        ];
        let o = self.obj(path, Some(v), KEYS);
        o.map?;
        let before = self.issues.len();
        for k in [
            "ttft_a",
            "ttft_b",
            "ttft_c",
            "tpot_slope",
            "tpot_intercept",
            "decode_max_requests",
            "decode_max_kv_tokens",
        ] {
            if o.get(k).is_none() {
                self.issues.push(ConfigIssue::Missing { path: o.p(k) });
            }
        }
        let p = Profile {
            ttft_a: self.num(&o, "ttft_a", 0.0, non_negative),
            ttft_b: self.num(&o, "ttft_b", 0.0, non_negative),
            ttft_c: self.num(&o, "ttft_c", 0.0, |x| {
                (!x.is_finite()).then_some("must be a finite number")
            }),
            prefill_min_tokens: self.int(&o, "prefill_min_tokens", 0, 0, u64::MAX),
            ttft_split: self.num(&o, "ttft_split", 0.0, non_negative),
            tpot_slope: self.num(&o, "tpot_slope", 0.0, non_negative),
            tpot_request_slope: self.num(&o, "tpot_request_slope", 0.0, non_negative),
            tpot_intercept: self.num(&o, "tpot_intercept", 0.0, non_negative),
            decode_min_requests: self.int(&o, "decode_min_requests", 1, 1, u64::MAX),
            decode_max_requests: self.int(&o, "decode_max_requests", 1, 1, u64::MAX),
            decode_min_kv_tokens: self.int(&o, "decode_min_kv_tokens", 0, 0, u64::MAX),
            decode_max_kv_tokens: self.int(&o, "decode_max_kv_tokens", 1, 1, u64::MAX),
            kv_capacity_tokens: o
                .get("kv_capacity_tokens")
                .map(|_| self.int(&o, "kv_capacity_tokens", 1, 1, u64::MAX)),
        };
        if p.decode_max_requests < p.decode_min_requests {
            self.rule(
                o.p("decode_max_requests"),
                &Value::from(p.decode_max_requests),
                format!("must be ≥ decode_min_requests ({})", p.decode_min_requests),
            );
        }
        if p.decode_max_kv_tokens < p.decode_min_kv_tokens {
            self.rule(
                o.p("decode_max_kv_tokens"),
                &Value::from(p.decode_max_kv_tokens),
                format!(
                    "must be ≥ decode_min_kv_tokens ({})",
                    p.decode_min_kv_tokens
                ),
            );
        }
        (self.issues.len() == before).then_some(p)
    }

    fn hardware(&mut self, v: Option<&Value>) {
        let o = self.obj(
            "hardware",
            v,
            &["accelerator", "accelerators_per_engine", "tensor_parallel"],
        );
        if o.map.is_none() {
            return;
        }
        let acc = self.string(&o, "accelerator", "");
        if acc.is_empty() {
            self.issues.push(ConfigIssue::Missing {
                path: o.p("accelerator"),
            });
        }
        let per = self.int(&o, "accelerators_per_engine", 1, 1, u64::MAX);
        let tp = self.int(&o, "tensor_parallel", 1, 1, u64::MAX);
        if tp > per {
            self.rule(
                o.p("tensor_parallel"),
                &Value::from(tp),
                format!("must be ≤ accelerators_per_engine ({per})"),
            );
        }
    }

    fn contract(&mut self, v: Option<&Value>) -> Option<Value> {
        let v = v?;
        let o = self.obj(
            "engine_contract",
            Some(v),
            &[
                "engine_version",
                "image_digest",
                "transfer_version",
                "connector_version",
                "model_architecture",
                "model_dtype",
                "kv_heads",
                "head_size",
                "hidden_layers",
                "attention_backend",
                "kv_cache_dtype",
                "cross_layers_blocks",
                "hybrid_kv_cache_manager",
                "connector",
                "kv_role",
                "transfer_mode",
                "speculative_config",
                "enforce_handshake_compat",
            ],
        );
        o.map?;
        self.passive(
            &o,
            &[
                ("engine_version", Kind::Str),
                ("image_digest", Kind::Str),
                ("transfer_version", Kind::Str),
                ("connector_version", Kind::Int),
                ("model_architecture", Kind::Str),
                ("model_dtype", Kind::Str),
                ("kv_heads", Kind::Int),
                ("head_size", Kind::Int),
                ("hidden_layers", Kind::Int),
                ("attention_backend", Kind::Str),
                ("kv_cache_dtype", Kind::Str),
                ("cross_layers_blocks", Kind::BoolOrNull),
                ("hybrid_kv_cache_manager", Kind::BoolOrNull),
                ("connector", Kind::Str),
                ("kv_role", Kind::Str),
                ("transfer_mode", Kind::Str),
                ("speculative_config", Kind::Str),
                ("enforce_handshake_compat", Kind::BoolOrNull),
            ],
        );
        for k in ["engine_version", "connector"] {
            if o.get(k).and_then(Value::as_str).is_none_or(str::is_empty) {
                self.issues.push(ConfigIssue::Missing { path: o.p(k) });
            }
        }
        if let Some(d) = o.get("image_digest").and_then(Value::as_str)
            && !d.is_empty()
            && !(d.len() == 71
                && d.starts_with("sha256:")
                && d[7..]
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
        {
            self.rule(
                o.p("image_digest"),
                &Value::String(d.to_string()),
                "must be \"\" or sha256:<64 lowercase hex>",
            );
        }
        Some(v.clone())
    }

    fn lease(&mut self, v: Option<&Value>) -> LeaseSection {
        let o = self.obj(
            "lease",
            v,
            &[
                "backend",
                "path",
                "endpoints",
                "key",
                "ttl_s",
                "renew_interval_s",
                "safety_margin_s",
                "tls",
                "auth",
            ],
        );
        let backend = match self.choice(&o, "backend", "none", &["none", "file", "etcd"]) {
            "file" => LeaseBackend::File,
            "etcd" => LeaseBackend::Etcd,
            _ => LeaseBackend::None,
        };
        let path = self.string(&o, "path", "");
        let mut endpoints = Vec::new();
        if let Some(ev) = o.get("endpoints") {
            match ev.as_array() {
                Some(a) => {
                    for (i, e) in a.iter().enumerate() {
                        match e.as_str() {
                            Some(s) if !s.is_empty() => endpoints.push(s.to_string()),
                            _ => self.ty(format!("lease.endpoints[{i}]"), e, "a non-empty string"),
                        }
                    }
                }
                None => self.ty("lease.endpoints".into(), ev, "an array of strings"),
            }
        }
        let etcd = self.etcd_access(&o, backend);
        if backend == LeaseBackend::Etcd {
            for (i, e) in endpoints.iter().enumerate() {
                if let Some(rule) = etcd_endpoint_rule(e, etcd.tls.is_some()) {
                    self.rule(
                        format!("lease.endpoints[{i}]"),
                        &Value::from(e.as_str()),
                        rule,
                    );
                }
            }
        }
        let l = LeaseSection {
            backend,
            path,
            endpoints,
            key: self.string(&o, "key", "/narwhal/router-lease"),
            ttl_s: self.num(&o, "ttl_s", 5.0, positive),
            renew_interval_s: self.num(&o, "renew_interval_s", 1.0, positive),
            safety_margin_s: self.num(&o, "safety_margin_s", 1.0, non_negative),
            etcd,
        };
        if backend == LeaseBackend::File && l.path.is_empty() {
            self.issues.push(ConfigIssue::Missing {
                path: "lease.path".into(),
            });
        }
        if backend == LeaseBackend::Etcd && l.endpoints.is_empty() {
            self.issues.push(ConfigIssue::Missing {
                path: "lease.endpoints".into(),
            });
        }
        let min = l.renew_interval_s + l.safety_margin_s;
        if o.map.is_some() && l.ttl_s <= min {
            self.rule(
                "lease.ttl_s".into(),
                &Value::from(l.ttl_s),
                format!("must exceed renew_interval_s + safety_margin_s ({min})"),
            );
        }
        l
    }

    /// `lease.tls` and `lease.auth` (docs/ha.md, "etcd TLS and authentication").
    fn etcd_access(&mut self, lease: &Obj<'_>, backend: LeaseBackend) -> EtcdAccess {
        for k in ["tls", "auth"] {
            if lease.get(k).is_some() && backend != LeaseBackend::Etcd {
                self.issues.push(ConfigIssue::Rule {
                    path: lease.p(k),
                    // `auth` may hold a misplaced password: never echoed.
                    value: "{…}".into(),
                    rule: "only used by lease.backend = \"etcd\"".into(),
                });
            }
        }
        let path = |c: &mut Self, o: &Obj<'_>, k: &str, required: bool| match o.get(k) {
            Some(Value::String(s)) if !s.is_empty() => Some(PathBuf::from(s)),
            Some(v) => {
                c.ty(o.p(k), v, "a non-empty path string");
                None
            }
            None => {
                if required {
                    c.issues.push(ConfigIssue::Missing { path: o.p(k) });
                }
                None
            }
        };
        let t = self.obj("lease.tls", lease.get("tls"), &["ca", "cert", "key"]);
        let tls = t.map.map(|_| {
            let ca = path(self, &t, "ca", false);
            let cert = path(self, &t, "cert", false);
            let key = path(self, &t, "key", false);
            match (&cert, &key) {
                (Some(_), None) if t.get("key").is_none() => {
                    self.issues.push(ConfigIssue::Rule {
                        path: t.p("key"),
                        value: "(absent)".into(),
                        rule: "required with lease.tls.cert (the client certificate's key)".into(),
                    });
                }
                (None, Some(_)) if t.get("cert").is_none() => {
                    self.issues.push(ConfigIssue::Rule {
                        path: t.p("cert"),
                        value: "(absent)".into(),
                        rule: "required with lease.tls.key (the client certificate)".into(),
                    });
                }
                _ => {}
            }
            EtcdTls { ca, cert, key }
        });
        let a = self.obj(
            "lease.auth",
            lease.get("auth"),
            &["user", "password_file", "password"],
        );
        if a.get("password").is_some() {
            // Never echo the value: it is a secret.
            self.issues.push(ConfigIssue::Rule {
                path: a.p("password"),
                value: "(not shown)".into(),
                rule: "a password is never written in the fleet file: put it in a file only \
                       the router can read and name that file in lease.auth.password_file"
                    .into(),
            });
        }
        let auth = a.map.map(|_| {
            let user = match a.get("user") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                Some(v) => {
                    self.ty(a.p("user"), v, "a non-empty string");
                    String::new()
                }
                None => {
                    self.issues.push(ConfigIssue::Missing { path: a.p("user") });
                    String::new()
                }
            };
            let password_file = path(self, &a, "password_file", true).unwrap_or_default();
            EtcdAuth {
                user,
                password_file,
            }
        });
        EtcdAccess { tls, auth }
    }

    fn tls(&mut self, path: &str, v: Option<&Value>) -> Option<TlsFiles> {
        let o = self.obj(path, v, &["ca", "cert", "key"]);
        o.map?;
        let f = |c: &mut Self, k: &str| match o.get(k) {
            Some(Value::String(s)) if !s.is_empty() => PathBuf::from(s),
            Some(v) => {
                c.ty(o.p(k), v, "a non-empty path string");
                PathBuf::new()
            }
            None => {
                c.issues.push(ConfigIssue::Missing { path: o.p(k) });
                PathBuf::new()
            }
        };
        Some(TlsFiles {
            ca: f(self, "ca"),
            cert: f(self, "cert"),
            key: f(self, "key"),
        })
    }
}

#[derive(Clone, Copy)]
enum Kind {
    NonNegNum,
    PosNum,
    Int,
    BoolOrNull,
    Str,
}

fn positive(x: f64) -> Option<&'static str> {
    (x <= 0.0).then_some("must be > 0")
}

fn non_negative(x: f64) -> Option<&'static str> {
    (x < 0.0).then_some("must be ≥ 0")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn base() -> Value {
        serde_json::json!({
            "schema": "narwhal.fleet", "schema_version": 2,
            "_about": "comment",
            "model": "tiny-sim",
            "backend": "vllm",
            "engines": [
                {"iid": "p0", "url": "http://127.0.0.1:1/", "role": "prefill"},
                {"iid": "d0", "url": "http://127.0.0.1:2"}
            ],
            "slo": {"ttft_s": 2.0, "tpot_s": 0.05}
        })
    }

    fn issues(v: Value) -> Vec<ConfigIssue> {
        match Config::from_json_str(&v.to_string(), &no_env) {
            Ok(_) => panic!("expected issues"),
            Err(ParseError::Invalid(i)) => i,
            Err(e) => panic!("unexpected {e}"),
        }
    }

    fn messages(v: Value) -> Vec<String> {
        issues(v).iter().map(ToString::to_string).collect()
    }

    #[test]
    fn minimal_fleet_gets_reference_defaults() {
        let c = Config::from_json_str(&base().to_string(), &no_env).unwrap();
        assert_eq!(c.engines[0].url, "http://127.0.0.1:1");
        assert_eq!(c.engines[0].role, Role::Prefill);
        assert_eq!(c.engines[1].role, Role::Decode);
        assert_eq!(c.serving.max_connections, 768);
        assert_eq!(c.serving.max_attempts, 2);
        assert_eq!(c.serving.max_request_bytes, 4_194_304);
        assert_eq!(c.engine.first_token_timeout_s, 2.5);
        assert_eq!(c.engine.decode_read_timeout_s, 10.0);
        assert_eq!(c.recovery.eject_after, 3);
        assert_eq!(c.controller.monitor_interval_s, 1.0);
        assert_eq!(c.lease.backend, LeaseBackend::None);
        assert_eq!(c.backend, Backend::Vllm);
    }

    /// The engine-health keys (docs/configuration.md): defaults, and a bad
    /// value named by its dotted path.
    #[test]
    fn health_keys_have_defaults_and_name_their_path() {
        let c = Config::from_json_str(&base().to_string(), &no_env).unwrap();
        assert_eq!(c.engines[0].health_path, "/health");
        assert_eq!(c.recovery.max_ejection_percent, 50);
        assert_eq!(c.recovery.max_readmit_interval_s, 300.0);
        assert_eq!(c.recovery.liveness_misses, 2);
        let mut v = base();
        v["engines"][1]["health_path"] = "/v1/models".into();
        let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
        assert_eq!(c.engines[1].health_path, "/v1/models");
        let mut v = base();
        v["engines"][0]["health_path"] = "health".into();
        v["engines"][1]["health_path"] = "/health?full=1".into();
        v["recovery"] = serde_json::json!({"max_ejection_percent": 0,
                                          "max_readmit_interval_s": -1});
        let m = messages(v);
        assert!(
            m.iter()
                .any(|x| x.starts_with("engines[0].health_path = \"health\": must be a path")),
            "{m:?}"
        );
        assert!(
            m.iter().any(|x| x.starts_with("engines[1].health_path = ")),
            "{m:?}"
        );
        assert!(
            m.contains(
                &"recovery.max_ejection_percent = 0: must be an integer in 1..=100".to_string()
            ),
            "{m:?}"
        );
        assert!(
            m.contains(&"recovery.max_readmit_interval_s = -1: must be > 0".to_string()),
            "{m:?}"
        );
        assert_eq!(m.len(), 4, "{m:?}");
    }

    #[test]
    fn example_fleet_file_parses() {
        let text = include_str!("../testdata/reference-fleet.example.json");
        let c = Config::from_json_str(text, &no_env).unwrap();
        assert_eq!(c.engines.len(), 4);
        assert_eq!(c.lease.backend, LeaseBackend::Etcd);
        assert!(c.control_tls.is_some());
    }

    #[test]
    fn unknown_keys_name_their_dotted_path_and_all_are_reported() {
        let mut v = base();
        v["engines"][1]["rol"] = "decode".into();
        v["serving"] = serde_json::json!({"max_atempts": 2, "_note": "ok"});
        v["bogus"] = 1.into();
        let m = messages(v);
        assert!(
            m.contains(&"engines[1].rol: unknown key".to_string()),
            "{m:?}"
        );
        assert!(
            m.contains(&"serving.max_atempts: unknown key".to_string()),
            "{m:?}"
        );
        assert!(m.contains(&"bogus: unknown key".to_string()), "{m:?}");
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn type_errors_name_key_and_value() {
        let mut v = base();
        v["serving"] = serde_json::json!({"max_attempts": true, "request_timeout_s": "600"});
        v["engines"][0]["pin"] = "yes".into();
        let m = messages(v);
        assert!(
            m.contains(&"serving.max_attempts must be an integer, got true".to_string()),
            "{m:?}"
        );
        assert!(
            m.contains(&"serving.request_timeout_s must be a number, got \"600\"".to_string()),
            "{m:?}"
        );
        assert!(
            m.contains(&"engines[0].pin must be a boolean, got \"yes\"".to_string()),
            "{m:?}"
        );
    }

    #[test]
    fn range_errors_name_key_value_and_rule() {
        let mut v = base();
        v["serving"] = serde_json::json!({"max_attempts": 4, "retry_base_s": 2.0});
        v["slo"]["ttft_s"] = 0.into();
        v["engines"][0]["role"] = "both".into();
        let m = messages(v);
        assert!(
            m.contains(&"serving.max_attempts = 4: must be an integer in 1..=3".to_string()),
            "{m:?}"
        );
        assert!(
            m.contains(&"slo.ttft_s = 0: must be > 0".to_string()),
            "{m:?}"
        );
        assert!(
            m.iter()
                .any(|s| s.starts_with("serving.retry_cap_s = 1.0: must be ≥")),
            "{m:?}"
        );
        assert!(
            m.contains(&"engines[0].role = \"both\": must be one of prefill, decode".to_string()),
            "{m:?}"
        );
    }

    /// The request-path keys `serving.body_read_timeout_s` and `serving.max_batch_prompts`:
    /// defaults, and range errors naming the dotted path.
    #[test]
    fn body_read_timeout_and_batch_limit_are_validated() {
        let c = Config::from_json_str(&base().to_string(), &no_env).unwrap();
        assert_eq!(c.serving.body_read_timeout_s, 30.0);
        assert_eq!(c.serving.max_batch_prompts, 64);
        let mut v = base();
        v["serving"] = serde_json::json!({"body_read_timeout_s": 0, "max_batch_prompts": 0});
        let m = messages(v);
        assert!(
            m.contains(&"serving.body_read_timeout_s = 0: must be > 0".to_string()),
            "{m:?}"
        );
        assert!(
            m.iter()
                .any(|s| s
                    .starts_with("serving.max_batch_prompts = 0: must be an integer in 1..=4096")),
            "{m:?}"
        );
        let mut v = base();
        v["serving"] = serde_json::json!({"body_read_timeout_s": 2.5, "max_batch_prompts": 8});
        let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
        assert_eq!(
            (c.serving.body_read_timeout_s, c.serving.max_batch_prompts),
            (2.5, 8)
        );
    }

    #[test]
    fn float_for_integer_is_refused() {
        let mut v = base();
        v["serving"] = serde_json::json!({"max_connections": 5.0});
        assert_eq!(
            messages(v),
            vec!["serving.max_connections must be an integer, got 5.0".to_string()]
        );
    }

    #[test]
    fn duplicate_iid_and_no_engines() {
        let mut v = base();
        v["engines"][1]["iid"] = "p0".into();
        assert_eq!(
            issues(v),
            vec![ConfigIssue::DuplicateIid {
                iid: "p0".into(),
                first: 0,
                second: 1
            }]
        );
        let mut v = base();
        v["engines"] = serde_json::json!([]);
        assert!(issues(v).contains(&ConfigIssue::NoEngines));
    }

    #[test]
    fn missing_required_keys() {
        let v = serde_json::json!({"schema": "narwhal.fleet", "schema_version": 2});
        let m = messages(v);
        for want in [
            "model: required key is missing",
            "engines: required key is missing",
            "slo: required key is missing",
        ] {
            assert!(m.contains(&want.to_string()), "{m:?}");
        }
    }

    #[test]
    fn wrong_schema_version() {
        let mut v = base();
        v["schema_version"] = 1.into();
        assert_eq!(
            messages(v),
            vec!["schema_version = 1: must be 2".to_string()]
        );
    }

    #[test]
    fn nan_and_infinity_are_not_json() {
        let text = base().to_string().replace("2.0", "NaN");
        assert!(matches!(
            Config::from_json_str(&text, &no_env),
            Err(ParseError::Json(_))
        ));
        let text = base().to_string().replace("2.0", "Infinity");
        assert!(matches!(
            Config::from_json_str(&text, &no_env),
            Err(ParseError::Json(_))
        ));
    }

    #[test]
    fn backend_sources_must_agree() {
        let mut v = base();
        v["engine"] = serde_json::json!({"backend": "sglang"});
        assert_eq!(
            issues(v),
            vec![ConfigIssue::BackendMismatch {
                top: "vllm".into(),
                engine: "sglang".into()
            }]
        );
        let mut v = base();
        v.as_object_mut().unwrap().remove("backend");
        v["engine"] = serde_json::json!({"backend": "sglang"});
        let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
        assert_eq!(c.backend, Backend::Sglang);
    }

    #[test]
    fn env_references_resolve_whole_values_only() {
        let mut v = base();
        v["engines"][0]["url"] = "${P0_URL}".into();
        let env = |k: &str| (k == "P0_URL").then(|| "http://10.0.0.1:9/".to_string());
        let c = Config::from_json_str(&v.to_string(), &env).unwrap();
        assert_eq!(c.engines[0].url, "http://10.0.0.1:9");
        let m = messages(v.clone());
        assert!(
            m.iter()
                .any(|s| s
                    .starts_with("engines[0].url = \"${P0_URL}\": environment variable P0_URL")),
            "{m:?}"
        );
        v["engines"][0]["url"] = "http://${HOST}:9".into();
        let m = messages(v);
        assert!(
            m.iter().any(|s| s.contains("must be the whole value")),
            "{m:?}"
        );
    }

    #[test]
    fn lease_timing_rule() {
        let mut v = base();
        v["lease"] = serde_json::json!({"backend": "file", "path": "/tmp/l", "ttl_s": 1.0});
        let m = messages(v);
        assert_eq!(
            m,
            vec![
                "lease.ttl_s = 1.0: must exceed renew_interval_s + safety_margin_s (2)".to_string()
            ]
        );
    }

    #[test]
    fn lease_etcd_tls_and_auth_parse_into_the_section() {
        let mut v = base();
        v["lease"] = serde_json::json!({"backend": "etcd",
            "endpoints": ["etcd-a:2379", "https://etcd-b:2379"],
            "tls": {"ca": "/etc/narwhal/etcd-ca.pem", "cert": "/etc/narwhal/etcd.pem",
                    "key": "/etc/narwhal/etcd.key"},
            "auth": {"user": "narwhal", "password_file": "/etc/narwhal/etcd.password"}});
        let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
        assert_eq!(
            c.lease.etcd,
            EtcdAccess {
                tls: Some(EtcdTls {
                    ca: Some("/etc/narwhal/etcd-ca.pem".into()),
                    cert: Some("/etc/narwhal/etcd.pem".into()),
                    key: Some("/etc/narwhal/etcd.key".into()),
                }),
                auth: Some(EtcdAuth {
                    user: "narwhal".into(),
                    password_file: "/etc/narwhal/etcd.password".into(),
                }),
            }
        );
        // Both are optional: https:// alone is verified against the system's trust store.
        v["lease"] = serde_json::json!({"backend": "etcd", "endpoints": ["https://e:2379"]});
        let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
        assert_eq!(c.lease.etcd, EtcdAccess::default());
    }

    #[test]
    fn lease_etcd_tls_and_auth_errors_name_the_key_and_never_show_a_password() {
        let mut v = base();
        v["lease"] = serde_json::json!({"backend": "etcd",
            "endpoints": ["http://etcd-a:2379", "etcd://b", "https://c:1/v3"],
            "tls": {"cert": "/c.pem", "cacert": "/ca.pem"},
            "auth": {"password": "hunter2", "password_file": ""}});
        let m = messages(v.clone());
        assert!(!m.iter().any(|x| x.contains("hunter2")), "{m:?}");
        for want in [
            "lease.tls.cacert: unknown key",
            "lease.tls.key = (absent): required with lease.tls.cert (the client certificate's key)",
            "lease.auth.password = (not shown): a password is never written in the fleet file: \
             put it in a file only the router can read and name that file in \
             lease.auth.password_file",
            "lease.auth.user: required key is missing",
            "lease.auth.password_file must be a non-empty path string, got \"\"",
            "lease.endpoints[0] = \"http://etcd-a:2379\": a plain http:// endpoint while \
             lease.tls is set: use https://",
            "lease.endpoints[1] = \"etcd://b\": must be http://HOST:PORT, https://HOST:PORT or \
             HOST:PORT",
            "lease.endpoints[2] = \"https://c:1/v3\": must be http://HOST:PORT, \
             https://HOST:PORT or HOST:PORT (no path)",
        ] {
            assert!(m.contains(&want.to_string()), "missing {want:?} in {m:#?}");
        }
        assert_eq!(m.len(), 8, "{m:#?}");

        // Only the etcd backend reads them.
        v["lease"] = serde_json::json!({"backend": "file", "path": "/tmp/l",
            "tls": {"ca": "/ca.pem"}, "auth": {"user": "u", "password": "hunter2"}});
        let m = messages(v);
        assert_eq!(
            m,
            vec![
                "lease.tls = {…}: only used by lease.backend = \"etcd\"",
                "lease.auth = {…}: only used by lease.backend = \"etcd\"",
                "lease.auth.password = (not shown): a password is never written in the fleet \
                 file: put it in a file only the router can read and name that file in \
                 lease.auth.password_file",
                "lease.auth.password_file: required key is missing",
            ]
        );
    }

    #[test]
    fn comments_are_ignored_everywhere() {
        let mut v = base();
        v["engines"][0]["_why"] = "prefill host".into();
        v["serving"] = serde_json::json!({"_x": {"anything": 1}});
        assert!(Config::from_json_str(&v.to_string(), &no_env).is_ok());
    }
}
