//! Agent configuration file (JSON), schema `narwhal.agent-config` version 1.
//!
//! ```text
//!   file ─► strip "_comment" keys ─► serde (deny_unknown_fields, key paths) ─► RawConfig
//!        ─► validate(): every problem collected, each naming its dotted key ─► Config
//! ```
//!
//! Shape (see `packaging/agent.example.json`):
//! ```json
//! {"schema": "narwhal.agent-config", "schema_version": 1, "agent_id": "gpu-a",
//!  "listen": "10.0.0.11:8443",
//!  "tls": {"ca": "/etc/narwhal/ca.pem", "cert": "/etc/narwhal/agent-gpu-a.pem", "key": "..."},
//!  "signing_key": "/etc/narwhal/agent-gpu-a.ed25519.pk8", "state_dir": "/var/lib/narwhal-agent",
//!  "timeouts": {"engine_s": 5, "generation_s": 30, "handshake_s": 10},
//!  "engines": [{"iid": "e0", "url": "http://127.0.0.1:8000", "dialect": "vllm",
//!               "process": {"listen_port": 8000}, "contract_document": "/etc/narwhal/c.json",
//!               "model": "meta-llama/Llama-3.1-8B", "bootstrap_host": "10.0.0.11"}]}
//! ```
//! `process` holds exactly one of `listen_port`, `pid_file`, `systemd_unit`; when omitted the
//! port of `url` is used. `timeouts` and its keys are optional (defaults above). Keys starting
//! with `_` are comments. An engine started with an API key (vLLM `--api-key`) takes
//! `"api_key_file": "/etc/narwhal/e0.key"` or `"api_key_env": "E0_API_KEY"` (at most one): the key
//! itself never is in the config file (docs/agent.md).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use narwhal_shared::TlsFiles;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::engine_key::EngineKey;
use crate::plugin::Dialect;
use crate::process::ProcessLocator;

/// `schema` value of the agent config.
pub const CONFIG_SCHEMA: &str = "narwhal.agent-config";

/// A configuration problem; each names the dotted config key and the offending value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {path}: {source}")]
    Read {
        /// Config file.
        path: PathBuf,
        /// I/O error.
        source: std::io::Error,
    },
    /// JSON syntax error, unknown key or wrong type.
    #[error("config key {key}: {message}")]
    Json {
        /// Dotted key path (`engines[0].process`).
        key: String,
        /// serde's message.
        message: String,
    },
    /// A value is present but unacceptable.
    #[error("config key {key} = {value}: {reason}")]
    Field {
        /// Dotted key path.
        key: String,
        /// The value, as JSON or a path.
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// Several problems, all reported together.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Many(Vec<ConfigError>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    schema: String,
    schema_version: u32,
    agent_id: String,
    listen: String,
    tls: TlsFiles,
    signing_key: PathBuf,
    state_dir: PathBuf,
    #[serde(default)]
    timeouts: Timeouts,
    engines: Vec<RawEngine>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEngine {
    iid: String,
    url: String,
    dialect: String,
    #[serde(default)]
    process: Option<RawProcess>,
    #[serde(default)]
    contract_document: Option<PathBuf>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    bootstrap_host: Option<String>,
    #[serde(default)]
    api_key_file: Option<PathBuf>,
    #[serde(default)]
    api_key_env: Option<String>,
    #[serde(default)]
    kv_events: Option<KvEvents>,
}

/// `engines[].kv_events`: where the engine publishes its KV events (vLLM's or SGLang's
/// `--kv-events-config`, on loopback), for the block set the agent keeps of it
/// (docs/agent.md, "KV block snapshots").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEvents {
    /// `tcp://HOST:PORT` of the engine's PUB socket.
    pub endpoint: String,
    /// `tcp://HOST:PORT` of its replay socket: without one, a gap starts the set again
    /// (incomplete), and an agent that starts after the engine cannot reach back.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// The engine's topic (the SUB's filter; vLLM's default `""`).
    #[serde(default)]
    pub topic: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProcess {
    #[serde(default)]
    listen_port: Option<u16>,
    #[serde(default)]
    pid_file: Option<PathBuf>,
    #[serde(default)]
    systemd_unit: Option<String>,
}

/// Agent timeouts, seconds (config `timeouts`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// Engine reads (version, models, stats), seconds. Default 5.
    pub engine_s: f64,
    /// One generation or KV leg, seconds. Default 30.
    pub generation_s: f64,
    /// TLS handshake of an incoming connection, seconds. Default 10.
    pub handshake_s: f64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            engine_s: 5.0,
            generation_s: 30.0,
            handshake_s: 10.0,
        }
    }
}

/// An engine's contract document: the reference's `engine-attestation.json` shape; the agent
/// uses its `contract` object and, when present, `launch` (behaviour.md 5.4, 5.6).
#[derive(Debug, Clone, PartialEq)]
pub struct ContractDocument {
    /// The contract fields, as written.
    pub contract: Map<String, Value>,
    /// `sha256_digest({"contract", "launch"})` when the document has `launch`.
    pub launch_digest: Option<String>,
}

/// One validated engine entry.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Instance id, unique within the agent.
    pub iid: String,
    /// Base URL on loopback, no trailing slash (`http://127.0.0.1:8000`).
    pub url: String,
    /// Engine kind.
    pub dialect: Dialect,
    /// How to find the process.
    pub locator: ProcessLocator,
    /// Contract document, read at startup.
    pub contract: Option<ContractDocument>,
    /// Default model for checks when a request omits one (unused when requests name it).
    pub model: Option<String>,
    /// Host other engines use to reach this engine's SGLang bootstrap server (default: the
    /// host of `url`).
    pub bootstrap_host: String,
    /// The engine's API key, read from `api_key_file` or the variable `api_key_env` at load.
    pub api_key: Option<EngineKey>,
    /// Its KV events, followed into the block set the agent serves as snapshots.
    pub kv_events: Option<KvEvents>,
}

/// A validated agent configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Agent id, signed into every payload.
    pub agent_id: String,
    /// HTTPS listen address (port 0 = any).
    pub listen: SocketAddr,
    /// mTLS files.
    pub tls: TlsFiles,
    /// Ed25519 PKCS#8 key file (mode 0600 or stricter).
    pub signing_key: PathBuf,
    /// Directory for the persisted fencing epoch.
    pub state_dir: PathBuf,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Engines, config order.
    pub engines: Vec<EngineConfig>,
}

fn strip_comments(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|k, _| !k.starts_with('_'));
            m.values_mut().for_each(strip_comments);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_comments),
        _ => {}
    }
}

fn field(
    key: impl Into<String>,
    value: impl std::fmt::Display,
    reason: impl Into<String>,
) -> ConfigError {
    ConfigError::Field {
        key: key.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl Config {
    /// Reads and validates a config file; relative paths inside are taken as written.
    ///
    /// # Errors
    /// [`ConfigError::Read`], [`ConfigError::Json`], or [`ConfigError::Many`] with every
    /// problem found.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::parse(&text)
    }

    /// Parses and validates config text.
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut value: Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
            key: "(document)".into(),
            message: e.to_string(),
        })?;
        // serde reads a struct from an array too (its fields in order), and names the root
        // "."; the config is an object, and a refusal says so.
        if !value.is_object() {
            return Err(ConfigError::Json {
                key: "(document)".into(),
                message: "the config must be a JSON object".into(),
            });
        }
        strip_comments(&mut value);
        let raw: RawConfig = serde_path_to_error::deserialize(value).map_err(|e| {
            let message = e.inner().to_string();
            let key = match e.path().to_string() {
                // serde names the root "."; a missing top-level key is named by itself.
                root if root == "." => missing_field(&message).unwrap_or("(document)").to_string(),
                // An unknown top-level key that is the empty string is written as nothing;
                // named as JSON, the refusal still says which key it is.
                empty if empty.is_empty() => "\"\"".to_string(),
                path => path,
            };
            ConfigError::Json { key, message }
        })?;
        raw.validate()
    }
}

/// The key of serde's "missing field `x`" message.
fn missing_field(message: &str) -> Option<&str> {
    message
        .strip_prefix("missing field `")?
        .split('`')
        .next()
        .filter(|k| !k.is_empty())
}

impl RawConfig {
    fn validate(self) -> Result<Config, ConfigError> {
        let mut errors = Vec::new();
        if self.schema != CONFIG_SCHEMA {
            errors.push(field(
                "schema",
                format!("{:?}", self.schema),
                format!("must be {CONFIG_SCHEMA:?}"),
            ));
        }
        if self.schema_version != 1 {
            errors.push(field("schema_version", self.schema_version, "must be 1"));
        }
        if self.agent_id.trim().is_empty() {
            errors.push(field("agent_id", "\"\"", "must not be empty"));
        }
        let listen = match self.listen.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                errors.push(field(
                    "listen",
                    format!("{:?}", self.listen),
                    "must be IP:PORT",
                ));
                None
            }
        };
        for (key, v) in [
            ("timeouts.engine_s", self.timeouts.engine_s),
            ("timeouts.generation_s", self.timeouts.generation_s),
            ("timeouts.handshake_s", self.timeouts.handshake_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                errors.push(field(key, v, "must be a positive number of seconds"));
            }
        }
        if self.engines.is_empty() {
            errors.push(field("engines", "[]", "at least one engine is required"));
        }
        let mut seen = HashSet::new();
        let mut engines = Vec::new();
        for (i, e) in self.engines.into_iter().enumerate() {
            match validate_engine(i, e, &mut seen) {
                Ok(engine) => engines.push(engine),
                Err(mut errs) => errors.append(&mut errs),
            }
        }
        if !errors.is_empty() {
            return Err(if errors.len() == 1 {
                errors.remove(0)
            } else {
                ConfigError::Many(errors)
            });
        }
        Ok(Config {
            agent_id: self.agent_id,
            // Checked above: errors is empty, so listen parsed.
            listen: listen.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))),
            tls: self.tls,
            signing_key: self.signing_key,
            state_dir: self.state_dir,
            timeouts: self.timeouts,
            engines,
        })
    }
}

fn validate_engine(
    i: usize,
    e: RawEngine,
    seen: &mut HashSet<String>,
) -> Result<EngineConfig, Vec<ConfigError>> {
    let k = |name: &str| format!("engines[{i}].{name}");
    let mut errors = Vec::new();
    check_iid(&k, &e.iid, seen, &mut errors);
    let url = e.url.trim_end_matches('/').to_string();
    let parsed = reqwest::Url::parse(&url).ok();
    let (host, port) = match &parsed {
        Some(u) if u.scheme() == "http" || u.scheme() == "https" => {
            (u.host_str().map(str::to_string), u.port_or_known_default())
        }
        _ => {
            errors.push(field(
                k("url"),
                format!("{:?}", e.url),
                "must be http://HOST:PORT",
            ));
            (None, None)
        }
    };
    let dialect = match e.dialect.as_str() {
        "vllm" => Some(Dialect::Vllm),
        "sglang" => Some(Dialect::Sglang),
        other => {
            errors.push(field(
                k("dialect"),
                format!("{other:?}"),
                "must be \"vllm\" or \"sglang\"",
            ));
            None
        }
    };
    let locator = engine_locator(&k, e.process, port, &mut errors);
    let contract = match e.contract_document {
        None => None,
        Some(path) => match read_contract(&path) {
            Ok(c) => Some(c),
            Err(reason) => {
                errors.push(field(k("contract_document"), path.display(), reason));
                None
            }
        },
    };
    let api_key = engine_api_key(&k, e.api_key_file, e.api_key_env, &mut errors);
    if let Some(kv) = &e.kv_events {
        check_kv_events(&k, kv, &mut errors);
    }
    match (errors.is_empty(), dialect, locator) {
        (true, Some(dialect), Some(locator)) => Ok(EngineConfig {
            iid: e.iid,
            url,
            dialect,
            locator,
            contract,
            model: e.model,
            bootstrap_host: e
                .bootstrap_host
                .or(host.map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string()))
                .unwrap_or_else(|| "127.0.0.1".into()),
            api_key,
            kv_events: e.kv_events,
        }),
        _ => Err(errors),
    }
}

/// `engines[i].iid`: not empty, letters, digits, '-', '_', '.' only, not seen before.
fn check_iid(
    k: &impl Fn(&str) -> String,
    iid: &str,
    seen: &mut HashSet<String>,
    errors: &mut Vec<ConfigError>,
) {
    if iid.trim().is_empty() {
        errors.push(field(k("iid"), "\"\"", "must not be empty"));
    } else if !iid
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        errors.push(field(
            k("iid"),
            format!("{iid:?}"),
            "only letters, digits, '-', '_', '.'",
        ));
    } else if !seen.insert(iid.to_string()) {
        errors.push(field(k("iid"), format!("{iid:?}"), "duplicate engine iid"));
    }
}

/// `engines[i].process`: how the engine's process is found (by default its URL's port).
fn engine_locator(
    k: &impl Fn(&str) -> String,
    process: Option<RawProcess>,
    port: Option<u16>,
    errors: &mut Vec<ConfigError>,
) -> Option<ProcessLocator> {
    match process {
        None => port.map(ProcessLocator::ListenPort),
        Some(p) => match (p.listen_port, p.pid_file, p.systemd_unit) {
            (Some(port), None, None) => Some(ProcessLocator::ListenPort(port)),
            (None, Some(path), None) => Some(ProcessLocator::PidFile(path)),
            (None, None, Some(unit)) if !unit.trim().is_empty() => {
                Some(ProcessLocator::SystemdUnit(unit))
            }
            _ => {
                errors.push(field(
                    k("process"),
                    "{...}",
                    "must hold exactly one of listen_port, pid_file, systemd_unit",
                ));
                None
            }
        },
    }
}

/// `engines[i].api_key_file` or `api_key_env`: the engine's key, read and checked as a bearer
/// token.
fn engine_api_key(
    k: &impl Fn(&str) -> String,
    api_key_file: Option<PathBuf>,
    api_key_env: Option<String>,
    errors: &mut Vec<ConfigError>,
) -> Option<EngineKey> {
    let key_field = match (&api_key_file, &api_key_env) {
        (None, Some(_)) => "api_key_env",
        _ => "api_key_file",
    };
    let api_key = match (api_key_file, api_key_env) {
        (None, None) => None,
        (Some(_), Some(_)) => {
            errors.push(field(
                k("api_key_file"),
                "{...}",
                "give api_key_file or api_key_env, not both",
            ));
            None
        }
        (Some(path), None) => match std::fs::read_to_string(&path) {
            Ok(text) if !text.trim().is_empty() => Some(EngineKey::new(text.trim())),
            Ok(_) => {
                errors.push(field(
                    k("api_key_file"),
                    path.display(),
                    "the file is empty",
                ));
                None
            }
            Err(err) => {
                errors.push(field(k("api_key_file"), path.display(), err.to_string()));
                None
            }
        },
        (None, Some(var)) => match std::env::var(&var) {
            Ok(v) if !v.trim().is_empty() => Some(EngineKey::new(v.trim())),
            _ => {
                errors.push(field(
                    k("api_key_env"),
                    format!("{var:?}"),
                    "the environment variable is unset or empty",
                ));
                None
            }
        },
    };
    // A bearer token is one header value: visible ASCII, no spaces (the key itself is never
    // named in the error).
    api_key.filter(|key| {
        let ok = key.is_token();
        if !ok {
            errors.push(field(
                k(key_field),
                "(the key)",
                "the engine key must be visible ASCII without spaces (an HTTP bearer token)",
            ));
        }
        ok
    })
}

/// `engines[i].kv_events`: each endpoint a `tcp://HOST:PORT` the agent connects to.
fn check_kv_events(k: &impl Fn(&str) -> String, kv: &KvEvents, errors: &mut Vec<ConfigError>) {
    let tcp = |ep: &str| {
        ep.strip_prefix("tcp://")
            .and_then(|rest| rest.rsplit_once(':'))
            .is_some_and(|(h, p)| {
                !h.is_empty() && !h.contains('*') && p.parse::<u16>().is_ok_and(|p| p > 0)
            })
    };
    for (key, ep) in [
        ("endpoint", Some(&kv.endpoint)),
        ("replay_endpoint", kv.replay_endpoint.as_ref()),
    ] {
        if let Some(ep) = ep.filter(|ep| !tcp(ep)) {
            errors.push(field(
                k(&format!("kv_events.{key}")),
                ep,
                "must be tcp://HOST:PORT the agent connects to (not a `*` bind address)",
            ));
        }
    }
}

/// Reads a contract document: a JSON object with an object `contract` and optional `launch`.
fn read_contract(path: &Path) -> Result<ContractDocument, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?;
    let contract = doc
        .get("contract")
        .and_then(Value::as_object)
        .cloned()
        .ok_or("has no \"contract\" object")?;
    let launch_digest = doc.get("launch").map(|launch| {
        let mut m = Map::new();
        m.insert("contract".into(), Value::Object(contract.clone()));
        m.insert("launch".into(), launch.clone());
        narwhal_shared::sha256_digest(&Value::Object(m))
    });
    Ok(ContractDocument {
        contract,
        launch_digest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "schema": "narwhal.agent-config", "schema_version": 1,
            "_about": "comment",
            "agent_id": "gpu-a", "listen": "127.0.0.1:0",
            "tls": {"ca": "ca.pem", "cert": "a.pem", "key": "a.key"},
            "signing_key": "k.pk8", "state_dir": "/tmp/s",
            "engines": [
                {"iid": "e0", "url": "http://127.0.0.1:8000/", "dialect": "vllm"},
                {"iid": "e1", "url": "http://127.0.0.1:8001", "dialect": "sglang",
                 "process": {"pid_file": "/run/e1.pid"}, "_note": "x"}
            ]
        })
    }

    /// `engines[].kv_events` names the sockets the agent connects to: kept as given (topic
    /// `""` by default); a bind address or a non-tcp endpoint is refused naming the key; an
    /// unknown key in it too.
    #[test]
    fn kv_events_name_sockets_to_connect_to() {
        let mut v = base();
        v["engines"][0]["kv_events"] = serde_json::json!({"endpoint": "tcp://127.0.0.1:5557",
            "replay_endpoint": "tcp://127.0.0.1:5558"});
        let c = Config::parse(&v.to_string()).unwrap();
        let k = c.engines[0].kv_events.clone().expect("kv_events");
        assert_eq!(
            (
                k.endpoint.as_str(),
                k.replay_endpoint.as_deref(),
                k.topic.as_str()
            ),
            ("tcp://127.0.0.1:5557", Some("tcp://127.0.0.1:5558"), "")
        );
        assert_eq!(c.engines[1].kv_events, None);
        v["engines"][0]["kv_events"]["replay_endpoint"] = serde_json::json!("tcp://*:5558");
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(
            err.contains("engines[0].kv_events.replay_endpoint"),
            "{err}"
        );
        v["engines"][0]["kv_events"] = serde_json::json!({"endpoint": "ipc:///x"});
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("engines[0].kv_events.endpoint"), "{err}");
        v["engines"][0]["kv_events"] = serde_json::json!({"endpoint": "tcp://h:1", "buffer": 1});
        assert!(Config::parse(&v.to_string()).is_err());
    }

    /// The engine key comes from a file or a variable, never the config text, and no `Debug`
    /// (logs, errors) shows it.
    #[test]
    fn an_engine_key_is_read_from_its_file_and_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("e0.key");
        std::fs::write(&key, "sk-engine-secret\n").unwrap();
        let mut v = base();
        v["engines"][0]["api_key_file"] = serde_json::json!(key);
        let c = Config::parse(&v.to_string()).unwrap();
        let k = c.engines[0].api_key.clone().expect("a key");
        assert_eq!(k.bearer(), "Bearer sk-engine-secret");
        assert!(!format!("{c:?}").contains("sk-engine-secret"));
        assert_eq!(c.engines[1].api_key, None);
        std::fs::write(&key, "two words\n").unwrap();
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(
            err.contains("visible ASCII") && !err.contains("two words"),
            "{err}"
        );
        std::fs::write(&key, "  \n").unwrap();
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(
            err.contains("engines[0].api_key_file") && err.contains("empty"),
            "{err}"
        );
        v["engines"][0]["api_key_env"] = serde_json::json!("NARWHAL_TEST_NO_SUCH_VAR");
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("not both"), "{err}");
        v["engines"][0]
            .as_object_mut()
            .unwrap()
            .remove("api_key_file");
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(
            err.contains("engines[0].api_key_env") && err.contains("NARWHAL_TEST_NO_SUCH_VAR"),
            "{err}"
        );
        v["engines"][0]["api_key"] = serde_json::json!("inline");
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(
            err.contains("api_key"),
            "a key in the file itself is refused: {err}"
        );
    }

    #[test]
    fn the_example_shape_parses_with_defaults() {
        let c = Config::parse(&base().to_string()).unwrap();
        assert_eq!(c.agent_id, "gpu-a");
        assert_eq!(c.engines[0].url, "http://127.0.0.1:8000");
        assert_eq!(c.engines[0].locator, ProcessLocator::ListenPort(8000));
        assert_eq!(
            c.engines[1].locator,
            ProcessLocator::PidFile("/run/e1.pid".into())
        );
        assert_eq!(c.engines[1].dialect, Dialect::Sglang);
        assert_eq!(c.engines[1].bootstrap_host, "127.0.0.1");
        assert_eq!(c.timeouts, Timeouts::default());
    }

    #[test]
    fn the_shipped_example_config_parses() {
        let text = include_str!("../../packaging/agent.example.json");
        let c = Config::parse(text).unwrap();
        assert_eq!(c.engines.len(), 2);
    }

    #[test]
    fn unknown_keys_name_their_path() {
        let mut v = base();
        v["engines"][1]["process"]["pid"] = serde_json::json!(3);
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("engines[1].process"), "{err}");
        assert!(err.contains("pid"), "{err}");
    }

    /// A config that is not an object is refused naming the document: serde named the root
    /// "." (and would read an array of the fields in order as a config). Found by the
    /// `agent_config` fuzz target's rule that a refusal names its key
    /// (tests/fuzz/regressions/agent_config/root_not_object).
    #[test]
    fn a_config_that_is_not_an_object_is_refused_naming_the_document() {
        for text in ["[]", "1", "\"x\"", "null"] {
            match Config::parse(text) {
                Err(ConfigError::Json { key, .. }) => assert_eq!(key, "(document)", "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    /// An unknown top-level key `""` is named as JSON: serde's path writes it as nothing.
    /// Found by the `agent_config` fuzz target (tests/fuzz/regressions/agent_config/empty_key).
    #[test]
    fn an_unknown_empty_top_level_key_is_named_as_json() {
        let mut v = base();
        v[""] = serde_json::json!(1);
        match Config::parse(&v.to_string()) {
            Err(ConfigError::Json { key, message }) => {
                assert_eq!(key, "\"\"", "{message}");
                assert!(message.contains("unknown field"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// A missing top-level key is named by itself, not serde's root ".". Found by the
    /// `agent_config` fuzz target (tests/fuzz/regressions/agent_config/missing_top_level_key).
    #[test]
    fn a_missing_top_level_key_is_named() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("agent_id");
        match Config::parse(&v.to_string()) {
            Err(ConfigError::Json { key, .. }) => assert_eq!(key, "agent_id"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_problem_is_reported_together() {
        let mut v = base();
        v["schema_version"] = serde_json::json!(2);
        v["listen"] = serde_json::json!("nowhere");
        v["engines"][1]["iid"] = serde_json::json!("e0");
        v["engines"][0]["dialect"] = serde_json::json!("trt");
        v["engines"][1]["process"] = serde_json::json!({"listen_port": 1, "pid_file": "/x"});
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        for needle in [
            "schema_version",
            "listen",
            "engines[1].iid",
            "engines[0].dialect",
            "engines[1].process",
        ] {
            assert!(err.contains(needle), "missing {needle} in {err}");
        }
    }

    #[test]
    fn a_contract_document_is_read_and_its_launch_digested() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.json");
        std::fs::write(
            &p,
            r#"{"contract": {"engine_version": "1"}, "launch": {"args": []}}"#,
        )
        .unwrap();
        let mut v = base();
        v["engines"][0]["contract_document"] = serde_json::json!(p);
        let c = Config::parse(&v.to_string()).unwrap();
        let doc = c.engines[0].contract.as_ref().unwrap();
        assert_eq!(doc.contract["engine_version"], "1");
        assert!(doc.launch_digest.as_ref().unwrap().starts_with("sha256:"));
        let mut v = base();
        v["engines"][0]["contract_document"] = serde_json::json!(dir.path().join("missing.json"));
        let err = Config::parse(&v.to_string()).unwrap_err().to_string();
        assert!(err.contains("engines[0].contract_document"), "{err}");
    }
}
