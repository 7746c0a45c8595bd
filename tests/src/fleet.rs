//! Starting simulators and routers, and writing the fleet file that connects them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::certs::DevCerts;
use crate::proc::{ChildProc, ProcError, bin_path};

/// How long a child may take to print its first line. Generous: a loaded 2-core CI machine
/// can be slow to exec a freshly linked debug binary.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// One engine to simulate.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// Instance id in the fleet file (`e0`, `p0`, ...).
    pub iid: String,
    /// `prefill` or `decode`.
    pub role: String,
    /// Extra simulator flags (`--ttft-ms 5`, ...).
    pub sim_args: Vec<String>,
}

impl EngineSpec {
    /// An engine with no extra simulator flags.
    pub fn new(iid: &str, role: &str) -> Self {
        Self {
            iid: iid.to_string(),
            role: role.to_string(),
            sim_args: Vec::new(),
        }
    }

    /// Adds simulator flags.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.sim_args.extend(args.iter().map(|s| s.to_string()));
        self
    }
}

/// A running `narwhal-engine-sim`, restartable on the same ports.
#[derive(Debug)]
pub struct SimHandle {
    /// The process (killed on drop).
    pub proc: ChildProc,
    /// Base URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// Instance id it plays.
    pub iid: String,
    /// `prefill` or `decode`.
    pub role: String,
    /// `vllm` or `sglang`.
    pub dialect: String,
    /// The OpenAI listener's port.
    pub port: u16,
    /// vLLM NIXL side-channel port.
    pub kv_port: Option<u16>,
    /// SGLang bootstrap port (prefill-mode servers).
    pub bootstrap_port: Option<u16>,
    /// Engine id of the current process (`remote_engine_id`).
    pub engine_id: String,
    /// Extra flags it was started with.
    pub sim_args: Vec<String>,
    dir: PathBuf,
}

impl SimHandle {
    /// `GET /sim/stats` as JSON.
    pub async fn stats(&self, http: &reqwest::Client) -> reqwest::Result<Value> {
        http.get(format!("{}/sim/stats", self.url))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await
    }

    /// `POST /sim/faults` with one fault object or a list.
    pub async fn fault(&self, http: &reqwest::Client, fault: Value) -> reqwest::Result<()> {
        http.post(format!("{}/sim/faults", self.url))
            .json(&fault)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    /// Stops the process (SIGKILL) and starts a new one on the same ports with the same flags
    /// plus `extra` (later flags win, e.g. `--model other`): a restarted engine, new pid,
    /// new process start, new engine id.
    ///
    /// # Errors
    /// [`ProcError`] when the new process does not start.
    pub fn restart(&mut self, extra: &[&str]) -> Result<(), ProcError> {
        self.proc.kill();
        let mut args = self.sim_args.clone();
        args.extend(extra.iter().map(|s| s.to_string()));
        let spec = EngineSpec {
            iid: self.iid.clone(),
            role: self.role.clone(),
            sim_args: args,
        };
        let fresh = spawn_sim(
            &self.dir,
            &spec,
            &self.dialect,
            Some((self.port, self.kv_port, self.bootstrap_port)),
        )?;
        let keep_args = std::mem::take(&mut self.sim_args);
        *self = fresh;
        self.sim_args = keep_args;
        Ok(())
    }
}

/// Starts one simulator for `spec` speaking `dialect` (`vllm` or `sglang`), logging to `dir`.
///
/// SGLang engines are launched in the disaggregation mode of their role, as real SGLang
/// servers are; vLLM engines take their role per request.
///
/// # Errors
/// [`ProcError`] when the simulator does not start.
pub fn start_sim(dir: &Path, spec: &EngineSpec, dialect: &str) -> Result<SimHandle, ProcError> {
    spawn_sim(dir, spec, dialect, None)
}

fn spawn_sim(
    dir: &Path,
    spec: &EngineSpec,
    dialect: &str,
    ports: Option<(u16, Option<u16>, Option<u16>)>,
) -> Result<SimHandle, ProcError> {
    let ready = dir.join(format!("sim-{}.ready.json", spec.iid));
    let _ = std::fs::remove_file(&ready);
    let mut cmd = Command::new(bin_path("narwhal-engine-sim"));
    cmd.args(["--dialect", dialect, "--model", "tiny-sim"]);
    match ports {
        Some((port, kv, boot)) => {
            cmd.args(["--listen", &format!("127.0.0.1:{port}")]);
            if let Some(k) = kv {
                cmd.args(["--kv-listen", &format!("127.0.0.1:{k}")]);
            }
            if let Some(b) = boot {
                cmd.args(["--bootstrap-port", &b.to_string()]);
            }
        }
        None => {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
    }
    if dialect == "sglang" {
        cmd.args(["--disaggregation-mode", &spec.role]);
    }
    cmd.arg("--ready-file").arg(&ready);
    cmd.args(&spec.sim_args);
    let proc = ChildProc::spawn(cmd, &format!("sim-{}", spec.iid), dir, START_TIMEOUT)?;
    let url = proc
        .url_in_first_line(None)
        .ok_or_else(|| ProcError::BadLine {
            bin: "narwhal-engine-sim".into(),
            line: proc.first_line.clone(),
        })?;
    let doc: Value = std::fs::read(&ready)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let port = url
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let as_port = |v: &Value| v.as_u64().and_then(|p| u16::try_from(p).ok());
    Ok(SimHandle {
        proc,
        url,
        iid: spec.iid.clone(),
        role: spec.role.clone(),
        dialect: dialect.to_string(),
        port,
        kv_port: as_port(&doc["kv_port"]),
        bootstrap_port: as_port(&doc["bootstrap_port"]),
        engine_id: doc["engine_id"].as_str().unwrap_or_default().to_string(),
        sim_args: spec.sim_args.clone(),
        dir: dir.to_path_buf(),
    })
}

/// The fleet file a router is started with.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// Served model name.
    pub model: String,
    /// `vllm` or `sglang`.
    pub backend: String,
    /// `(iid, url, role)` per engine.
    pub engines: Vec<(String, String, String)>,
    /// Sections merged over the defaults (`serving`, `engine`, `recovery`, ...), key by key.
    pub overrides: Value,
    /// `engines[].agent` per engine id.
    pub agents: std::collections::BTreeMap<String, Value>,
}

impl FleetSpec {
    /// A fleet over running simulators.
    pub fn for_sims(backend: &str, sims: &[SimHandle]) -> Self {
        Self {
            model: "tiny-sim".into(),
            backend: backend.into(),
            engines: sims
                .iter()
                .map(|s| (s.iid.clone(), s.url.clone(), s.role.clone()))
                .collect(),
            overrides: json!({}),
            agents: std::collections::BTreeMap::new(),
        }
    }

    /// Pins engine `iid` to `agent` (its URL, certificate name and signing key).
    pub fn agent(mut self, iid: &str, agent: &AgentHandle) -> Self {
        self.agents.insert(
            iid.to_string(),
            json!({
                "url": agent.url,
                "server_name": agent.server_name,
                "public_key": agent.public_key,
                "agent_id": agent.agent_id,
            }),
        );
        self
    }

    /// Router-to-agent mutual TLS with the dev certificate `name` (`router`, `standby`).
    pub fn tls(self, certs: &DevCerts, name: &str) -> Self {
        self.with(
            json!({"tls": {"ca": certs.ca, "cert": certs.cert(name), "key": certs.key(name)}}),
        )
    }

    /// Merges `section` into the overrides (one level deep: `{"serving": {...}}`).
    pub fn with(mut self, section: Value) -> Self {
        merge(&mut self.overrides, section);
        self
    }

    /// The fleet document, schema `narwhal.fleet` version 2.
    pub fn to_json(&self, state_dir: &Path) -> Value {
        let mut doc = json!({
            "schema": "narwhal.fleet",
            "schema_version": 2,
            "model": self.model,
            "backend": self.backend,
            "engines": self.engines.iter().map(|(iid, url, role)| {
                let mut e = json!({"iid": iid, "url": url, "role": role});
                if let Some(a) = self.agents.get(iid) {
                    e["agent"] = a.clone();
                }
                e
            }).collect::<Vec<_>>(),
            "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
            "engine": {"first_token_timeout_s": 10.0, "decode_read_timeout_s": 10.0},
            "controller": {"monitor_interval_s": 0.2},
            "recovery": {"state_path": state_dir.join("state.json"), "readmit_every": 1},
        });
        merge(&mut doc, self.overrides.clone());
        doc
    }
}

fn merge(into: &mut Value, from: Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(&k) {
                    Some(slot) if slot.is_object() && v.is_object() => merge(slot, v),
                    _ => {
                        a.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

/// A running `narwhal-serve`.
#[derive(Debug)]
pub struct RouterHandle {
    /// The process (killed on drop).
    pub proc: ChildProc,
    /// Data listener base URL (`/v1/...`).
    pub data: String,
    /// Control listener base URL (`/narwhal/...`, `/metrics`).
    pub control: String,
    /// Request journal path.
    pub journal: PathBuf,
    /// Fleet file path.
    pub fleet: PathBuf,
}

impl RouterHandle {
    /// Journal rows parsed as JSON (header included).
    pub fn journal_rows(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.journal)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// `GET <control>/narwhal/state`.
    pub async fn state(&self, http: &reqwest::Client) -> reqwest::Result<Value> {
        http.get(format!("{}/narwhal/state", self.control))
            .send()
            .await?
            .json()
            .await
    }

    /// `GET <control>/metrics` as text.
    pub async fn metrics(&self, http: &reqwest::Client) -> reqwest::Result<String> {
        http.get(format!("{}/metrics", self.control))
            .send()
            .await?
            .text()
            .await
    }
}

/// Writes `fleet` into `dir` and starts `narwhal-serve` on loopback ports with `extra_args`.
///
/// # Errors
/// [`ProcError`] when the router does not start (its stderr tail is in the error).
pub fn start_router(
    dir: &Path,
    label: &str,
    fleet: &FleetSpec,
    extra_args: &[&str],
) -> Result<RouterHandle, ProcError> {
    let fleet_path = dir.join(format!("{label}.fleet.json"));
    let journal = dir.join(format!("{label}.journal.jsonl"));
    let doc = serde_json::to_string_pretty(&fleet.to_json(dir)).expect("fleet JSON serialises");
    std::fs::write(&fleet_path, doc).map_err(|source| ProcError::Spawn {
        bin: fleet_path.display().to_string(),
        source,
    })?;
    let mut cmd = Command::new(bin_path("narwhal-serve"));
    cmd.arg("--fleet")
        .arg(&fleet_path)
        .args(["--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"])
        .arg("--journal")
        .arg(&journal)
        .args(extra_args);
    let proc = ChildProc::spawn(cmd, label, dir, START_TIMEOUT)?;
    let bad = || ProcError::BadLine {
        bin: "narwhal-serve".into(),
        line: proc.first_line.clone(),
    };
    let data = proc.url_in_first_line(Some("data")).ok_or_else(bad)?;
    let control = proc.url_in_first_line(Some("control")).ok_or_else(bad)?;
    wait_identity_check(&data);
    Ok(RouterHandle {
        proc,
        data,
        control,
        journal,
        fleet: fleet_path,
    })
}

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
}

/// Starts `narwhal-agent` with id `agent_id` for `engines`, using the dev certificate
/// `agent-<agent_id>` from `certs` and a fresh signing key (made with `narwhal-agent keygen`).
///
/// # Errors
/// [`ProcError`] when keygen or the agent fails.
pub fn start_agent(
    dir: &Path,
    certs: &DevCerts,
    agent_id: &str,
    engines: &[&SimHandle],
) -> Result<AgentHandle, ProcError> {
    let name = format!("agent-{agent_id}");
    let key = dir.join(format!("{name}.ed25519.pk8"));
    if !key.exists() {
        let out = Command::new(bin_path("narwhal-agent"))
            .args(["keygen", "--out"])
            .arg(&key)
            .output()
            .map_err(|source| ProcError::Spawn {
                bin: "narwhal-agent keygen".into(),
                source,
            })?;
        if !out.status.success() {
            return Err(ProcError::Exited {
                bin: "narwhal-agent keygen".into(),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
    }
    let engines: Vec<Value> = engines
        .iter()
        .map(|s| {
            json!({"iid": s.iid, "url": s.url, "dialect": s.dialect,
                   "process": {"listen_port": s.port}})
        })
        .collect();
    let doc = json!({
        "schema": "narwhal.agent-config", "schema_version": 1, "agent_id": agent_id,
        "listen": "127.0.0.1:0",
        "tls": {"ca": certs.ca, "cert": certs.cert(&name), "key": certs.key(&name)},
        "signing_key": key, "state_dir": dir.join(format!("{name}-state")),
        "timeouts": {"engine_s": 5, "generation_s": 20},
        "engines": engines,
    });
    let config = dir.join(format!("{name}.json"));
    std::fs::write(&config, format!("{doc:#}\n")).map_err(|source| ProcError::Spawn {
        bin: config.display().to_string(),
        source,
    })?;
    let ready = dir.join(format!("{name}.ready.json"));
    let _ = std::fs::remove_file(&ready);
    let mut cmd = Command::new(bin_path("narwhal-agent"));
    cmd.args(["run", "--config"])
        .arg(&config)
        .arg("--ready-file")
        .arg(&ready);
    let proc = ChildProc::spawn(cmd, &name, dir, START_TIMEOUT)?;
    let url = proc
        .url_in_first_line(None)
        .ok_or_else(|| ProcError::BadLine {
            bin: "narwhal-agent".into(),
            line: proc.first_line.clone(),
        })?;
    let ready: Value = std::fs::read(&ready)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    Ok(AgentHandle {
        proc,
        url,
        agent_id: agent_id.to_string(),
        server_name: name,
        public_key: ready["public_key"].as_str().unwrap_or_default().to_string(),
        config,
    })
}

/// Waits (bounded) until a router with agents has finished its startup identity check: its
/// `/ready` reason is no longer "engine identity validation pending". Whatever readiness it
/// then has (ready, standby, held) is the test's to assert.
fn wait_identity_check(data: &str) {
    use std::io::{Read, Write};
    let Some(addr) = data.strip_prefix("http://") else {
        return;
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        let answer = std::net::TcpStream::connect(addr).and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(
                format!("GET /ready HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )?;
            let mut text = String::new();
            s.read_to_string(&mut text)?;
            Ok(text)
        });
        match answer {
            Ok(text) if !text.contains("engine identity validation pending") => return,
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
