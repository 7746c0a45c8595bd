//! Starting `narwhal-agent` processes (one per simulated GPU host) with dev certificates.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::certs::DevCerts;
use crate::proc::{ChildProc, ProcError, START_TIMEOUT, bin_path, read_json_file, write_file};
use crate::router::merge;
use crate::sim::SimHandle;

/// A running `narwhal-agent` serving some simulated engines.
#[derive(Debug)]
pub struct AgentHandle {
    /// The process (killed on drop).
    pub proc: ChildProc,
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// The agent's id.
    pub agent_id: String,
    /// Name in its certificate (`agent-<id>`), the router's `server_name`.
    pub server_name: String,
    /// `ed25519:<base64>` signing key to pin in the fleet file.
    pub public_key: String,
    /// Its config file.
    pub config: PathBuf,
    /// Its `--ready-file` document (`url`, `pid`, `agent_id`, `public_key`).
    pub ready: Value,
    dir: PathBuf,
}

/// Runs `narwhal-agent keygen --out path` and returns the public key it prints
/// (`ed25519:<base64>`).
///
/// # Errors
/// [`ProcError`] when the binary cannot run or fails.
pub fn keygen(path: &Path) -> Result<String, ProcError> {
    let bin = "narwhal-agent keygen";
    let out = Command::new(bin_path("narwhal-agent"))
        .args(["keygen", "--out"])
        .arg(path)
        .output()
        .map_err(|source| ProcError::Spawn {
            bin: format!("{} (build it: cargo build -p narwhal-agent)", bin),
            source,
        })?;
    if !out.status.success() {
        return Err(ProcError::Exited {
            bin: bin.into(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Starts `narwhal-agent` with id `agent_id` for `engines`, using the dev certificate
/// `agent-<agent_id>` from `certs` and a signing key made with `narwhal-agent keygen` (kept in
/// `dir` and reused by a later agent of the same id).
///
/// # Errors
/// [`ProcError`] when keygen or the agent fails.
pub fn start_agent(
    dir: &Path,
    certs: &DevCerts,
    agent_id: &str,
    engines: &[&SimHandle],
) -> Result<AgentHandle, ProcError> {
    start_agent_with(dir, certs, agent_id, engines, None)
}

/// [`start_agent`] where every engine's config also names a host contract document
/// (`engines[].contract_document`, attested with its launch digest).
///
/// # Errors
/// [`ProcError`] when keygen or the agent fails.
pub fn start_agent_with(
    dir: &Path,
    certs: &DevCerts,
    agent_id: &str,
    engines: &[&SimHandle],
    contract_document: Option<&Path>,
) -> Result<AgentHandle, ProcError> {
    start_agent_keyed(dir, certs, agent_id, engines, contract_document, None)
}

/// [`start_agent_with`] where every engine's config also names `api_key_file`: the file
/// holding the engines' API key (engines started with `--api-key`, docs/agent.md).
///
/// # Errors
/// [`ProcError`] when keygen or the agent fails.
pub fn start_agent_keyed(
    dir: &Path,
    certs: &DevCerts,
    agent_id: &str,
    engines: &[&SimHandle],
    contract_document: Option<&Path>,
    api_key_file: Option<&Path>,
) -> Result<AgentHandle, ProcError> {
    let engines: Vec<AgentEngine> = engines
        .iter()
        .map(|s| {
            AgentEngine {
                iid: s.iid.clone(),
                url: s.url.clone(),
                dialect: s.dialect.clone(),
                port: s.port,
                // A simulator publishing KV events (its ready file names the sockets): the agent
                // follows them (every topic).
                kv_events: kv_events_of(s),
            }
        })
        .collect();
    start_agent_for(
        dir,
        certs,
        agent_id,
        &engines,
        contract_document,
        api_key_file,
        json!({"engine_s": 5, "generation_s": 20}),
    )
}

/// One engine an agent serves: any OpenAI server on loopback (a simulator, a real vLLM), bound
/// to the process that listens on `port`.
#[derive(Debug, Clone)]
pub struct AgentEngine {
    /// Instance id.
    pub iid: String,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// `vllm` or `sglang`.
    pub dialect: String,
    /// The port its process listens on (`engines[].process.listen_port`).
    pub port: u16,
    /// `engines[].kv_events` (`{"endpoint", "replay_endpoint"}`): the agent follows the
    /// engine's KV events; `None` leaves it out.
    pub kv_events: Option<Value>,
}

/// [`start_agent_keyed`] for any engines, with the agent's `timeouts` section (`engine_s`,
/// `generation_s`: a real engine on a loaded machine needs more than a simulator).
///
/// # Errors
/// [`ProcError`] when keygen or the agent fails.
pub fn start_agent_for(
    dir: &Path,
    certs: &DevCerts,
    agent_id: &str,
    engines: &[AgentEngine],
    contract_document: Option<&Path>,
    api_key_file: Option<&Path>,
    timeouts: Value,
) -> Result<AgentHandle, ProcError> {
    let name = format!("agent-{agent_id}");
    let key = dir.join(format!("{name}.ed25519.pk8"));
    if !key.exists() {
        keygen(&key)?;
    }
    let engines: Vec<EngineConfig> = engines
        .iter()
        .map(|s| EngineConfig {
            iid: &s.iid,
            url: &s.url,
            dialect: &s.dialect,
            process: ProcessConfig {
                listen_port: s.port,
            },
            contract_document,
            api_key_file,
            kv_events: s.kv_events.as_ref(),
        })
        .collect();
    let doc = json!({
        "schema": "narwhal.agent-config", "schema_version": 1, "agent_id": agent_id,
        "listen": "127.0.0.1:0",
        "tls": {"ca": certs.ca, "cert": certs.cert(&name), "key": certs.key(&name)},
        "signing_key": key, "state_dir": dir.join(format!("{name}-state")),
        "timeouts": timeouts,
        "engines": engines,
    });
    let config = dir.join(format!("{name}.json"));
    write_config(&config, &doc)?;
    let mut agent = AgentHandle {
        proc: spawn_agent(dir, &name, &config)?.0,
        url: String::new(),
        agent_id: agent_id.to_string(),
        server_name: name,
        public_key: String::new(),
        config,
        ready: Value::Null,
        dir: dir.to_path_buf(),
    };
    agent.read_ready()?;
    Ok(agent)
}

/// What the kit reads of a simulator's ready file: the KV event sockets it publishes on, when
/// it publishes KV events.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SimKvSockets {
    /// The publisher's endpoint.
    kv_events_endpoint: Option<String>,
    /// Its replay endpoint.
    kv_events_replay_endpoint: Option<String>,
}

/// `engines[].kv_events` for simulator `s`: the sockets its ready file names, `None` when it
/// publishes no KV events.
fn kv_events_of(s: &SimHandle) -> Option<Value> {
    let ready = SimKvSockets::deserialize(&s.ready).unwrap_or_default();
    let replay = ready.kv_events_replay_endpoint;
    ready
        .kv_events_endpoint
        .map(|ep| json!({"endpoint": ep, "replay_endpoint": replay}))
}

/// One of an agent config's `engines` (docs/agent.md).
#[derive(Debug, Serialize)]
struct EngineConfig<'a> {
    iid: &'a str,
    url: &'a str,
    dialect: &'a str,
    process: ProcessConfig,
    #[serde(skip_serializing_if = "Option::is_none")]
    contract_document: Option<&'a Path>,
    #[serde(skip_serializing_if = "Option::is_none")]
    api_key_file: Option<&'a Path>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_events: Option<&'a Value>,
}

/// `engines[].process`: the process bound to the engine.
#[derive(Debug, Serialize)]
struct ProcessConfig {
    listen_port: u16,
}

/// What the kit reads of an agent's `--ready-file` document.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct AgentReady {
    /// `ed25519:<base64>`.
    public_key: Option<String>,
}

fn write_config(path: &Path, doc: &Value) -> Result<(), ProcError> {
    write_file(path, &format!("{doc:#}\n"))
}

fn ready_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.ready.json"))
}

fn spawn_agent(dir: &Path, name: &str, config: &Path) -> Result<(ChildProc, PathBuf), ProcError> {
    let ready = ready_path(dir, name);
    let _ = std::fs::remove_file(&ready);
    let mut cmd = Command::new(bin_path("narwhal-agent"));
    cmd.args(["run", "--config"])
        .arg(config)
        .arg("--ready-file")
        .arg(&ready);
    Ok((ChildProc::spawn(cmd, name, dir, START_TIMEOUT)?, ready))
}

impl AgentHandle {
    fn read_ready(&mut self) -> Result<(), ProcError> {
        self.url = self
            .proc
            .url_in_first_line(None)
            .ok_or_else(|| ProcError::BadLine {
                bin: "narwhal-agent".into(),
                line: self.proc.first_line.clone(),
            })?;
        let path = ready_path(&self.dir, &self.server_name);
        self.ready = read_json_file(&path);
        self.public_key = match AgentReady::deserialize(&self.ready)
            .unwrap_or_default()
            .public_key
        {
            Some(k) => k,
            None => {
                return Err(ProcError::BadLine {
                    bin: "narwhal-agent".into(),
                    line: format!("ready file {} without public_key", path.display()),
                });
            }
        };
        Ok(())
    }

    /// Kills the agent and starts it again on the same port with the same configuration; with
    /// `key`, signing with that key file instead (made with `narwhal-agent keygen` if missing).
    /// [`AgentHandle::public_key`] is the key it signs with afterwards.
    ///
    /// # Errors
    /// [`ProcError`] when keygen or the new process fails.
    pub fn restart(&mut self, key: Option<&Path>) -> Result<(), ProcError> {
        self.proc.kill();
        let mut cfg = read_json_file(&self.config);
        let port = self.url.rsplit(':').next().unwrap_or("0").to_string();
        merge(&mut cfg, json!({"listen": format!("127.0.0.1:{port}")}));
        if let Some(key) = key {
            if !key.exists() {
                keygen(key)?;
            }
            merge(&mut cfg, json!({"signing_key": key}));
        }
        write_config(&self.config, &cfg)?;
        self.proc = spawn_agent(&self.dir, &self.server_name, &self.config)?.0;
        self.read_ready()
    }
}
