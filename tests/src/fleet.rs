//! Starting simulators and routers, and writing the fleet file that connects them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

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

/// A running `narwhal-engine-sim`.
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
}

/// Starts one simulator for `spec` speaking `dialect` (`vllm` or `sglang`), logging to `dir`.
///
/// SGLang engines are launched in the disaggregation mode of their role, as real SGLang
/// servers are; vLLM engines take their role per request.
///
/// # Errors
/// [`ProcError`] when the simulator does not start.
pub fn start_sim(dir: &Path, spec: &EngineSpec, dialect: &str) -> Result<SimHandle, ProcError> {
    let mut cmd = Command::new(bin_path("narwhal-engine-sim"));
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--dialect",
        dialect,
        "--model",
        "tiny-sim",
    ]);
    if dialect == "sglang" {
        cmd.args(["--disaggregation-mode", &spec.role]);
    }
    cmd.args(&spec.sim_args);
    let proc = ChildProc::spawn(cmd, &format!("sim-{}", spec.iid), dir, START_TIMEOUT)?;
    let url = proc
        .url_in_first_line(None)
        .ok_or_else(|| ProcError::BadLine {
            bin: "narwhal-engine-sim".into(),
            line: proc.first_line.clone(),
        })?;
    Ok(SimHandle {
        proc,
        url,
        iid: spec.iid.clone(),
        role: spec.role.clone(),
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
        }
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
            "engines": self.engines.iter().map(|(iid, url, role)| json!({
                "iid": iid, "url": url, "role": role,
            })).collect::<Vec<_>>(),
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
    Ok(RouterHandle {
        proc,
        data,
        control,
        journal,
        fleet: fleet_path,
    })
}
