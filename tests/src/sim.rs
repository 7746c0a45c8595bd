//! Starting `narwhal-engine-sim` processes and reaching their test hooks.
//!
//! Every use of the simulator's test hooks (`/sim/stats`, `/sim/faults`, ...) goes through
//! [`SimHandle::admin_url`]: they are served on the simulator's own admin listener
//! (`--admin-listen`, reported as `admin` in its ready file), never on the engine port, which
//! answers 404 for `/sim/*` as a real engine does (docs/engine-simulator.md, "Test hooks").

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::http::Http;
use crate::proc::{ChildProc, ProcError, START_TIMEOUT, bin_path, read_json_file};

/// One engine to simulate.
#[derive(Debug, Clone)]
pub struct EngineSpec {
    /// Instance id in the fleet file (`e0`, `p0`, ...).
    pub iid: String,
    /// `prefill` or `decode`.
    pub role: String,
    /// Extra simulator flags (`--ttft-ms 5`, ...).
    pub sim_args: Vec<String>,
    /// The loopback address its engine port listens on (default `127.0.0.1`): engines of
    /// their own address, as pods have (`EngineSpec::on`).
    pub host: String,
}

impl EngineSpec {
    /// An engine with no extra simulator flags.
    pub fn new(iid: &str, role: &str) -> Self {
        Self {
            iid: iid.to_string(),
            role: role.to_string(),
            sim_args: Vec::new(),
            host: "127.0.0.1".to_string(),
        }
    }

    /// Listens on loopback address `host` (`127.0.0.11`) instead of `127.0.0.1`, across
    /// restarts too.
    #[must_use]
    pub fn on(mut self, host: &str) -> Self {
        self.host = host.to_string();
        self
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
    /// Base URL of the OpenAI listener, `http://127.0.0.1:PORT`.
    pub url: String,
    /// Instance id it plays (for a [`SimHandle::start_raw`] simulator: its label).
    pub iid: String,
    /// `prefill` or `decode` (`""` for a raw simulator).
    pub role: String,
    /// `vllm` or `sglang`.
    pub dialect: String,
    /// The OpenAI listener's port.
    pub port: u16,
    /// vLLM NIXL side-channel port.
    pub kv_port: Option<u16>,
    /// SGLang bootstrap port (prefill-mode servers).
    pub bootstrap_port: Option<u16>,
    /// Base URL of the admin listener (test hooks), `http://127.0.0.1:PORT`.
    pub admin: String,
    /// Engine id of the current process (`remote_engine_id`).
    pub engine_id: String,
    /// Extra flags it was started with.
    pub sim_args: Vec<String>,
    /// The loopback address its engine port listens on ([`EngineSpec::on`]).
    pub host: String,
    /// Its `--ready-file` document (`url`, `admin`, `pid`, `engine_id`, `kv_port`,
    /// `bootstrap_port`).
    pub ready: Value,
    dir: PathBuf,
    http: Http,
}

impl SimHandle {
    /// Base URL of the test hooks: `<admin_url>/stats`, `<admin_url>/faults`,
    /// `<admin_url>/stats/reset`. The only place that knows where they are served: under `/sim`
    /// on the simulator's admin listener.
    pub fn admin_url(&self) -> String {
        format!("{}/sim", self.admin)
    }

    /// The admin listener's port.
    fn admin_port(&self) -> Option<u16> {
        self.admin.rsplit(':').next().and_then(|p| p.parse().ok())
    }

    /// `GET /sim/stats`, typed ([`crate::sim_stats::SimStats`]).
    ///
    /// # Panics
    /// When the simulator does not answer 200 with the stats document.
    pub async fn counters(&self) -> crate::sim_stats::SimStats {
        let r = self.http.get(format!("{}/stats", self.admin_url())).await;
        assert_eq!(r.status, 200, "{}: {}", r.what, r.text());
        serde_json::from_slice(&r.body).unwrap_or_else(|e| {
            panic!("{}: not the /sim/stats document: {e}: {}", r.what, r.text())
        })
    }

    /// `POST /sim/kv_events/churn`: `batches` KV event batches published, each storing and
    /// removing one block no prompt has (docs/engine-simulator.md, "Test hooks").
    ///
    /// # Panics
    /// When the simulator does not answer 200.
    pub async fn kv_churn(&self, batches: u64) {
        let r = self
            .http
            .post(
                format!("{}/kv_events/churn", self.admin_url()),
                &serde_json::json!({ "batches": batches }),
            )
            .await;
        assert_eq!(r.status, 200, "{}: {}", r.what, r.text());
    }

    /// `POST /sim/faults` with one fault object or a list (docs/engine-simulator.md, "Faults").
    ///
    /// # Panics
    /// When the simulator refuses it.
    pub async fn fault(&self, fault: Value) {
        let r = self
            .http
            .post(format!("{}/faults", self.admin_url()), &fault)
            .await;
        assert_eq!(r.status, 200, "fault {fault} refused: {}", r.text());
    }

    /// `GET /sim/faults`: the faults still queued, in queue order.
    ///
    /// # Panics
    /// When the simulator does not answer 200 with the faults document.
    pub async fn faults(&self) -> Vec<crate::sim_stats::SimFault> {
        let r = self.http.get(format!("{}/faults", self.admin_url())).await;
        assert_eq!(r.status, 200, "{}: {}", r.what, r.text());
        r.json_as::<crate::sim_stats::SimFaults>().faults
    }

    /// `DELETE /sim/faults`.
    ///
    /// # Panics
    /// When the simulator does not answer 200.
    pub async fn clear_faults(&self) {
        let r = self
            .http
            .delete(format!("{}/faults", self.admin_url()))
            .await;
        assert_eq!(r.status, 200, "{}: {}", r.what, r.text());
    }

    /// Stops the process (SIGKILL) and starts a new one on the same ports with the same flags
    /// plus `extra` (later flags win, e.g. `--model other`, `--bootstrap-port 0` for a new
    /// ephemeral bootstrap port): a restarted engine, new pid, new process start, new engine
    /// id. The flags it keeps for the next restart are the original ones, without `extra`.
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
            host: self.host.clone(),
        };
        let ports = Ports {
            listen: self.port,
            admin: self.admin_port(),
            kv: self.kv_port,
            bootstrap: self.bootstrap_port,
        };
        // The same ports again, as a supervisor restarts an engine in place. While it was down
        // another process on this busy machine may have used one as a client connection's
        // ephemeral port (seen in a loaded run: "cannot bind --kv-listen ... Address already
        // in use"): such a holder is transient, so try again until a deadline.
        let deadline = std::time::Instant::now() + crate::WAIT;
        let fresh = loop {
            match spawn_sim(&self.dir, &spec, &self.dialect, Some(ports.clone())) {
                Err(e)
                    if format!("{e:?}").contains("Address already in use")
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => break other?,
            }
        };
        let keep_args = std::mem::take(&mut self.sim_args);
        *self = fresh;
        self.sim_args = keep_args;
        Ok(())
    }

    /// Starts a simulator with `args` (no `--dialect`, `--model` or `--listen` added: the
    /// simulator's defaults apply), for tests of the simulator itself. `--admin-listen
    /// 127.0.0.1:0` goes first (an `--admin-listen` in `args` overrides it), so the hooks are
    /// never on the engine port; a `--ready-file` in `dir` is added unless `args` name one.
    /// `label` names its log and is its `iid`.
    ///
    /// # Errors
    /// [`ProcError`] when the simulator does not start.
    pub fn start_raw(dir: &Path, label: &str, args: &[&str]) -> Result<SimHandle, ProcError> {
        Self::spawn_raw(dir, label, args, true)
    }

    /// [`SimHandle::start_raw`] without `--admin-listen`: the simulator's compatibility mode
    /// for older scripts, where the hooks are also answered on the engine port.
    ///
    /// # Errors
    /// [`ProcError`] when the simulator does not start.
    pub fn start_raw_legacy(
        dir: &Path,
        label: &str,
        args: &[&str],
    ) -> Result<SimHandle, ProcError> {
        Self::spawn_raw(dir, label, args, false)
    }

    fn spawn_raw(
        dir: &Path,
        label: &str,
        args: &[&str],
        admin_listen: bool,
    ) -> Result<SimHandle, ProcError> {
        let mut cmd = Command::new(bin_path("narwhal-engine-sim"));
        if admin_listen {
            cmd.args(["--admin-listen", "127.0.0.1:0"]);
        }
        let ready = match args.iter().position(|a| *a == "--ready-file") {
            Some(i) => PathBuf::from(args.get(i + 1).copied().unwrap_or_default()),
            None => {
                let path = dir.join(format!("{label}.ready.json"));
                cmd.arg("--ready-file").arg(&path);
                path
            }
        };
        let _ = std::fs::remove_file(&ready);
        cmd.args(args);
        let dialect = args
            .iter()
            .position(|a| *a == "--dialect")
            .and_then(|i| args.get(i + 1))
            .unwrap_or(&"vllm");
        let spec = EngineSpec::new(label, "").args(args);
        finish_spawn(cmd, dir, &spec, dialect, &ready, label)
    }
}

/// Starts one simulator for `spec` speaking `dialect` (`vllm` or `sglang`) and serving the
/// model `tiny-sim`, logging to `dir`.
///
/// SGLang engines are launched in the disaggregation mode of their role, as real SGLang
/// servers are; vLLM engines take their role per request.
///
/// # Errors
/// [`ProcError`] when the simulator does not start.
pub fn start_sim(dir: &Path, spec: &EngineSpec, dialect: &str) -> Result<SimHandle, ProcError> {
    spawn_sim(dir, spec, dialect, None)
}

/// The ports a restarted simulator keeps.
#[derive(Clone)]
struct Ports {
    listen: u16,
    admin: Option<u16>,
    kv: Option<u16>,
    bootstrap: Option<u16>,
}

fn spawn_sim(
    dir: &Path,
    spec: &EngineSpec,
    dialect: &str,
    ports: Option<Ports>,
) -> Result<SimHandle, ProcError> {
    let ready = dir.join(format!("sim-{}.ready.json", spec.iid));
    let _ = std::fs::remove_file(&ready);
    let mut cmd = Command::new(bin_path("narwhal-engine-sim"));
    cmd.args(["--dialect", dialect, "--model", "tiny-sim"]);
    match ports {
        Some(p) => {
            cmd.args(["--listen", &format!("{}:{}", spec.host, p.listen)]);
            let admin = p.admin.unwrap_or(0);
            cmd.args(["--admin-listen", &format!("127.0.0.1:{admin}")]);
            if let Some(k) = p.kv {
                cmd.args(["--kv-listen", &format!("127.0.0.1:{k}")]);
            }
            if let Some(b) = p.bootstrap {
                cmd.args(["--bootstrap-port", &b.to_string()]);
            }
        }
        None => {
            cmd.args(["--listen", &format!("{}:0", spec.host)]);
            cmd.args(["--admin-listen", "127.0.0.1:0"]);
        }
    }
    if dialect == "sglang" {
        cmd.args(["--disaggregation-mode", &spec.role]);
    }
    cmd.arg("--ready-file").arg(&ready);
    cmd.args(&spec.sim_args);
    let label = format!("sim-{}", spec.iid);
    finish_spawn(cmd, dir, spec, dialect, &ready, &label)
}

fn finish_spawn(
    cmd: Command,
    dir: &Path,
    spec: &EngineSpec,
    dialect: &str,
    ready: &Path,
    label: &str,
) -> Result<SimHandle, ProcError> {
    let proc = ChildProc::spawn(cmd, label, dir, START_TIMEOUT)?;
    let url = proc
        .url_in_first_line(None)
        .ok_or_else(|| ProcError::BadLine {
            bin: "narwhal-engine-sim".into(),
            line: proc.first_line.clone(),
        })?;
    let doc = read_json_file(ready);
    let port = url
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let as_port = |v: &Value| v.as_u64().and_then(|p| u16::try_from(p).ok());
    let admin = doc["admin"]
        .as_str()
        .ok_or_else(|| ProcError::ReadyFile {
            bin: "narwhal-engine-sim".into(),
            path: ready.to_path_buf(),
            field: "admin",
            doc: doc.to_string(),
        })?
        .to_string();
    Ok(SimHandle {
        proc,
        url,
        iid: spec.iid.clone(),
        role: spec.role.clone(),
        dialect: dialect.to_string(),
        port,
        kv_port: as_port(&doc["kv_port"]),
        bootstrap_port: as_port(&doc["bootstrap_port"]),
        admin,
        engine_id: doc["engine_id"].as_str().unwrap_or_default().to_string(),
        sim_args: spec.sim_args.clone(),
        host: spec.host.clone(),
        ready: doc,
        dir: dir.to_path_buf(),
        http: Http::new(Duration::from_secs(30)),
    })
}

/// One engine of a [`MultiSim`]: its own ports and engine id, in the shared process.
#[derive(Debug, Clone)]
pub struct MultiEngine {
    /// Base URL of its OpenAI listener, `http://127.0.0.1:PORT`.
    pub url: String,
    /// The OpenAI listener's port (the agent's `engines[].process.listen_port`).
    pub port: u16,
    /// Base URL of its admin listener (test hooks), `http://127.0.0.1:PORT`.
    pub admin: String,
    /// vLLM NIXL side-channel port.
    pub kv_port: Option<u16>,
    /// Engine id (`remote_engine_id`) of the current process.
    pub engine_id: String,
}

impl MultiEngine {
    /// Base URL of this engine's test hooks (`<admin_url>/stats`, `<admin_url>/faults`).
    pub fn admin_url(&self) -> String {
        format!("{}/sim", self.admin)
    }
}

/// One `narwhal-engine-sim --engines N` process serving N engines, each on its own ports
/// with its own state (docs/engine-simulator.md, "Many engines in one process"). The engines
/// share the process identity: a restart restarts all of them, on the same ports.
#[derive(Debug)]
pub struct MultiSim {
    /// The process (killed on drop).
    pub proc: ChildProc,
    /// The engines, in the order of the ready file.
    pub engines: Vec<MultiEngine>,
    /// `vllm` or `sglang`.
    pub dialect: String,
    /// The flags it was started with (besides `--engines`, `--ready-file`, `--ports-from`).
    pub sim_args: Vec<String>,
    dir: PathBuf,
    label: String,
}

impl MultiSim {
    /// Starts `n` engines of `dialect` serving `tiny-sim` in one process labelled `label`
    /// (its log in `dir`), with extra simulator flags `args`.
    ///
    /// # Errors
    /// [`ProcError`] when the simulator does not start or its ready file is malformed.
    pub fn start(
        dir: &Path,
        label: &str,
        dialect: &str,
        n: usize,
        args: &[&str],
    ) -> Result<MultiSim, ProcError> {
        let mut sim_args: Vec<String> = ["--dialect", dialect, "--model", "tiny-sim"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        sim_args.extend(args.iter().map(|s| s.to_string()));
        let (proc, engines) = Self::spawn(dir, label, n, &sim_args, false)?;
        Ok(MultiSim {
            proc,
            engines,
            dialect: dialect.to_string(),
            sim_args,
            dir: dir.to_path_buf(),
            label: label.to_string(),
        })
    }

    fn ready_path(dir: &Path, label: &str) -> PathBuf {
        dir.join(format!("{label}.ready.json"))
    }

    fn spawn(
        dir: &Path,
        label: &str,
        n: usize,
        sim_args: &[String],
        same_ports: bool,
    ) -> Result<(ChildProc, Vec<MultiEngine>), ProcError> {
        let ready = Self::ready_path(dir, label);
        let mut cmd = Command::new(bin_path("narwhal-engine-sim"));
        cmd.args(["--admin-listen", "127.0.0.1:0", "--engines", &n.to_string()]);
        if same_ports {
            cmd.arg("--ports-from").arg(&ready);
        } else {
            let _ = std::fs::remove_file(&ready);
        }
        cmd.arg("--ready-file").arg(&ready);
        cmd.args(sim_args);
        // A restart rewrites the file in place: wait for the new pid's document.
        let proc = ChildProc::spawn(cmd, label, dir, START_TIMEOUT)?;
        let doc = read_json_file(&ready);
        let bad = |field: &'static str| ProcError::ReadyFile {
            bin: "narwhal-engine-sim".into(),
            path: ready.clone(),
            field,
            doc: doc.to_string(),
        };
        if doc["pid"].as_u64() != Some(u64::from(proc.pid())) {
            return Err(bad("pid"));
        }
        // One engine without `--ports-from` is the simulator's one-engine mode: its ready
        // document is that engine's own.
        let list = match doc["engines"].as_array() {
            Some(list) => list.clone(),
            None if n == 1 && !same_ports => vec![doc.clone()],
            None => return Err(bad("engines")),
        };
        let as_port = |v: &Value| v.as_u64().and_then(|p| u16::try_from(p).ok());
        let engines = list
            .iter()
            .map(|e| {
                let url = e["url"].as_str().ok_or_else(|| bad("url"))?.to_string();
                let port = url
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .ok_or_else(|| bad("url"))?;
                Ok(MultiEngine {
                    url,
                    port,
                    admin: e["admin"].as_str().ok_or_else(|| bad("admin"))?.to_string(),
                    kv_port: as_port(&e["kv_port"]),
                    engine_id: e["engine_id"].as_str().unwrap_or_default().to_string(),
                })
            })
            .collect::<Result<Vec<_>, ProcError>>()?;
        Ok((proc, engines))
    }

    /// Stops the process (SIGKILL) and starts a new one serving the same engines on the same
    /// ports (`--ports-from` its ready file): every engine restarted at once, new pid, new
    /// process start, new engine ids.
    ///
    /// # Errors
    /// [`ProcError`] when the new process does not start.
    pub fn restart(&mut self) -> Result<(), ProcError> {
        self.proc.kill();
        let n = self.engines.len();
        // As in [`SimHandle::restart`]: a port may be held for a moment by another process's
        // ephemeral client connection on a busy machine.
        let deadline = std::time::Instant::now() + crate::WAIT;
        let (proc, engines) = loop {
            match Self::spawn(&self.dir, &self.label, n, &self.sim_args, true) {
                Err(e)
                    if format!("{e:?}").contains("Address already in use")
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => break other?,
            }
        };
        self.proc = proc;
        self.engines = engines;
        Ok(())
    }
}
