//! `narwhalctl`: the operator and supervisor CLI over a router's control API
//! (`/narwhal/lifecycle`, `/narwhal/lifecycle/drain`, `/narwhal/lifecycle/readmit`).
//!
//! `wave-restart` is the reference external supervisor (reference-notes 4.6, seed "Whole-wave
//! restart policy"): drain, wait for `ready_to_stop`, run the operator's restart command per
//! engine, readmit, and print each engine's validation checks. `--rolling` restarts one engine
//! at a time under the `individual` policy, so the fleet keeps serving throughout.
//!
//! Exit codes: 0 success; 1 the router refused or a check failed (409, validation, restart
//! command); 2 usage; 3 the router was unreachable or not in control (503, transport, timeout).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use narwhal_shared::{Clock as _, SystemClock};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(
    name = "narwhalctl",
    version,
    about = "Drain, restart and readmit Narwhal engines"
)]
struct Cli {
    /// Control listener of the active router, e.g. `http://127.0.0.1:8001`.
    #[arg(long, env = "NARWHAL_ROUTER")]
    router: String,
    /// CA bundle (PEM) that signed the router's control certificate (mutual TLS).
    #[arg(long, requires_all = ["cert", "key"])]
    ca: Option<PathBuf>,
    /// Client certificate (PEM) issued by the fleet CA.
    #[arg(long, requires = "ca")]
    cert: Option<PathBuf>,
    /// Client private key (PEM).
    #[arg(long, requires = "ca")]
    key: Option<PathBuf>,
    /// Print machine-readable JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for the router to answer one call.
    #[arg(long, default_value_t = 60.0)]
    request_timeout_s: f64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show every engine's lifecycle state, the wave and the router's control state.
    Status,
    /// Drain one engine (or `--wave`: the whole fleet).
    Drain {
        /// Engine to drain.
        #[arg(required_unless_present = "wave", conflicts_with = "wave")]
        iid: Option<String>,
        /// Drain every engine as one wave (withdraws router readiness).
        #[arg(long)]
        wave: bool,
        /// Seconds after which the drain is reported `deadline_exceeded`.
        #[arg(long, default_value_t = 300.0)]
        deadline_s: f64,
        /// Wait until the engine (or wave) is `ready_to_stop`.
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds.
        #[arg(long, default_value_t = 900.0)]
        timeout_s: f64,
    },
    /// Validate and readmit one engine (or `--wave`: the active wave).
    Readmit {
        /// Engine to readmit.
        #[arg(required_unless_present = "wave", conflicts_with = "wave")]
        iid: Option<String>,
        /// Readmit the active wave as one set.
        #[arg(long)]
        wave: bool,
    },
    /// Drain the fleet, restart each engine with a command, readmit, report every check.
    WaveRestart {
        /// Shell command restarting one engine; `{iid}` is replaced by the engine id.
        #[arg(long)]
        restart_cmd: String,
        /// One engine at a time (individual policy) instead of one whole-fleet wave.
        #[arg(long)]
        rolling: bool,
        /// Drain deadline per drain, seconds.
        #[arg(long, default_value_t = 300.0)]
        deadline_s: f64,
        /// Give up waiting for `ready_to_stop` after this many seconds.
        #[arg(long, default_value_t = 900.0)]
        timeout_s: f64,
    },
}

/// Why a command failed, with the exit code it maps to.
#[derive(Debug)]
enum Failure {
    /// The router refused the action or a check failed (exit 1).
    Refused(String),
    /// The router could not be reached or does not control the fleet (exit 3).
    Unavailable(String),
}

impl Failure {
    fn exit(&self) -> ExitCode {
        match self {
            Failure::Refused(_) => ExitCode::from(1),
            Failure::Unavailable(_) => ExitCode::from(3),
        }
    }
    fn message(&self) -> &str {
        match self {
            Failure::Refused(m) | Failure::Unavailable(m) => m,
        }
    }
}

struct Ctl {
    http: reqwest::Client,
    base: String,
    json: bool,
}

impl Ctl {
    fn new(cli: &Cli) -> Result<Self, String> {
        // Our reqwest build carries no default TLS provider: install ring (harmless if set).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut b = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs_f64(cli.request_timeout_s));
        if let (Some(ca), Some(cert), Some(key)) = (&cli.ca, &cli.cert, &cli.key) {
            let files = narwhal_shared::TlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            };
            let cfg = files.client_config().map_err(|e| e.to_string())?;
            b = b.use_preconfigured_tls(cfg);
        }
        Ok(Ctl {
            http: b.build().map_err(|e| format!("HTTP client: {e}"))?,
            base: cli.router.trim_end_matches('/').to_string(),
            json: cli.json,
        })
    }

    async fn lifecycle(&self) -> Result<Value, Failure> {
        let url = format!("{}/narwhal/lifecycle", self.base);
        let r = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|e| Failure::Unavailable(format!("GET {url}: {e}")))?;
        let status = r.status();
        let doc: Value = r
            .json()
            .await
            .map_err(|e| Failure::Unavailable(format!("GET {url}: {status}: {e}")))?;
        Ok(doc)
    }

    /// POSTs a lifecycle action; 2xx gives the document, 409 and 503 name the router's error.
    async fn post(&self, path: &str, body: Value) -> Result<Value, (Failure, Option<Value>)> {
        let url = format!("{}{path}", self.base);
        let r = match self.http.post(&url).json(&body).send().await {
            Ok(r) => r,
            Err(e) => return Err((Failure::Unavailable(format!("POST {url}: {e}")), None)),
        };
        let status = r.status();
        let doc: Value = match r.json().await {
            Ok(v) => v,
            Err(e) => {
                return Err((
                    Failure::Unavailable(format!("POST {url}: {status}: body is not JSON: {e}")),
                    None,
                ));
            }
        };
        if status.is_success() {
            return Ok(doc);
        }
        let msg = format!(
            "{path}: HTTP {}: {}",
            status.as_u16(),
            doc["error"].as_str().unwrap_or("(no error message)")
        );
        let f = if status.as_u16() == 503 || status.is_server_error() {
            Failure::Unavailable(msg)
        } else {
            Failure::Refused(msg)
        };
        Err((f, Some(doc)))
    }

    fn show(&self, doc: &Value) {
        if self.json {
            println!("{doc}");
            return;
        }
        let router = &doc["router"];
        let wave = &doc["wave"];
        println!(
            "router: controls_fleet={} ready={}  policy={}",
            router["controls_fleet"].as_str().unwrap_or("?"),
            router["ready"],
            doc["engine_restart_policy"].as_str().unwrap_or("?")
        );
        if wave["active"].as_bool().unwrap_or(false) {
            println!(
                "wave {}: ready_to_stop={} readiness_withdrawn={}",
                wave["id"].as_str().unwrap_or(""),
                wave["ready_to_stop"],
                wave["readiness_withdrawn"]
            );
        }
        println!(
            "{:<8} {:<18} {:>6} {:>6} {:>9} {:>16} {:>16}  error",
            "engine", "state", "accept", "stop?", "resident", "old start", "new start"
        );
        if let Some(engines) = doc["engines"].as_object() {
            for (iid, e) in engines {
                let res = format!(
                    "{}p/{}d",
                    e["resident"]["prefill"].as_u64().unwrap_or(0),
                    e["resident"]["decode"].as_u64().unwrap_or(0)
                );
                let start = |v: &Value| v.as_f64().map_or("-".to_string(), |s| format!("{s:.2}"));
                println!(
                    "{:<8} {:<18} {:>6} {:>6} {:>9} {:>16} {:>16}  {}",
                    iid,
                    e["state"].as_str().unwrap_or("?"),
                    yes(&e["accepts_new"]),
                    yes(&e["ready_to_stop"]),
                    res,
                    start(&e["old_process_start"]),
                    start(&e["new_process_start"]),
                    e["error"].as_str().unwrap_or("")
                );
            }
        }
    }

    fn show_checks(&self, doc: &Value, targets: &[String]) {
        if self.json {
            return;
        }
        for iid in targets {
            let e = &doc["engines"][iid];
            let checks: Vec<&str> = e["checks"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            println!("{iid}: checks passed: {}", checks.join(", "));
            if let Some(err) = e["error"].as_str().filter(|s| !s.is_empty()) {
                println!("{iid}: FAILED: {err}");
            }
        }
    }

    /// Polls the lifecycle document until `done(doc)`, printing progress when it changes.
    async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Result<Value, Failure> {
        let clock = SystemClock;
        let deadline = clock.now() + timeout;
        let mut last = String::new();
        loop {
            let doc = self.lifecycle().await?;
            if done(&doc) {
                return Ok(doc);
            }
            let progress = progress_line(&doc);
            if progress != last && !self.json {
                println!("waiting for {what}: {progress}");
                last = progress;
            }
            if clock.now() >= deadline {
                return Err(Failure::Unavailable(format!(
                    "timed out after {:.0} s waiting for {what}",
                    timeout.as_secs_f64()
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn drain(
        &self,
        iid: Option<&str>,
        deadline_s: f64,
        wait: bool,
        timeout: Duration,
    ) -> Result<Value, Failure> {
        let body = match iid {
            Some(i) => json!({"engines": [i], "deadline_s": deadline_s}),
            None => json!({"wave": true, "deadline_s": deadline_s}),
        };
        let doc = self
            .post("/narwhal/lifecycle/drain", body)
            .await
            .map_err(|(f, doc)| {
                if let Some(d) = doc {
                    self.show(&d);
                }
                f
            })?;
        if !wait {
            return Ok(doc);
        }
        match iid {
            Some(i) => {
                let i = i.to_string();
                self.wait(&format!("{i} ready_to_stop"), timeout, move |d| {
                    d["engines"][&i]["ready_to_stop"] == true
                })
                .await
            }
            None => {
                self.wait("wave ready_to_stop", timeout, |d| {
                    d["wave"]["ready_to_stop"] == true
                })
                .await
            }
        }
    }

    async fn readmit(&self, iid: Option<&str>) -> Result<Value, Failure> {
        let body = match iid {
            Some(i) => json!({"engines": [i]}),
            None => json!({"wave": true}),
        };
        match self.post("/narwhal/lifecycle/readmit", body).await {
            Ok(doc) => {
                let targets = targets_of(&doc, iid);
                self.show_checks(&doc, &targets);
                Ok(doc)
            }
            Err((f, Some(doc))) => {
                let targets = targets_of(&doc, iid);
                self.show_checks(&doc, &targets);
                if self.json {
                    println!("{doc}");
                }
                let failed: Vec<String> = targets
                    .iter()
                    .filter(|i| {
                        doc["engines"][i.as_str()]["error"]
                            .as_str()
                            .is_some_and(|e| !e.is_empty())
                    })
                    .cloned()
                    .collect();
                Err(match f {
                    Failure::Refused(m) if !failed.is_empty() => {
                        Failure::Refused(format!("{m} (failed: {})", failed.join(", ")))
                    }
                    other => other,
                })
            }
            Err((f, None)) => Err(f),
        }
    }

    async fn restart(&self, cmd: &str, iid: &str) -> Result<(), Failure> {
        let line = cmd.replace("{iid}", iid);
        if !self.json {
            println!("{iid}: running restart command: {line}");
        }
        let status = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(&line)
            .status()
            .await
            .map_err(|e| Failure::Refused(format!("{iid}: restart command {line:?}: {e}")))?;
        if !status.success() {
            return Err(Failure::Refused(format!(
                "{iid}: restart command {line:?} exited with {status}"
            )));
        }
        Ok(())
    }

    async fn wave_restart(
        &self,
        cmd: &str,
        rolling: bool,
        deadline_s: f64,
        timeout: Duration,
    ) -> Result<(), Failure> {
        let doc = self.lifecycle().await?;
        let engines: Vec<String> = doc["engines"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        if rolling {
            for iid in &engines {
                if !self.json {
                    println!("== {iid}: drain");
                }
                self.drain(Some(iid), deadline_s, true, timeout).await?;
                self.restart(cmd, iid).await?;
                if !self.json {
                    println!("== {iid}: readmit");
                }
                self.readmit(Some(iid)).await?;
            }
        } else {
            if !self.json {
                println!("== wave: drain {}", engines.join(", "));
            }
            self.drain(None, deadline_s, true, timeout).await?;
            for iid in &engines {
                self.restart(cmd, iid).await?;
            }
            if !self.json {
                println!("== wave: readmit");
            }
            self.readmit(None).await?;
        }
        let doc = self.lifecycle().await?;
        self.show(&doc);
        Ok(())
    }
}

fn yes(v: &Value) -> &'static str {
    if v.as_bool().unwrap_or(false) {
        "yes"
    } else {
        "no"
    }
}

/// One line summarising every held engine: `e0 draining 2p/0d, e1 drained`.
fn progress_line(doc: &Value) -> String {
    let Some(engines) = doc["engines"].as_object() else {
        return String::new();
    };
    engines
        .iter()
        .filter(|(_, e)| e["state"] != "active")
        .map(|(iid, e)| {
            let state = e["state"].as_str().unwrap_or("?");
            let (p, d) = (
                e["resident"]["prefill"].as_u64().unwrap_or(0),
                e["resident"]["decode"].as_u64().unwrap_or(0),
            );
            if p + d > 0 {
                format!("{iid} {state} ({p} prefill, {d} decode resident)")
            } else {
                format!("{iid} {state}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The engines an action applied to: the named one, or the wave's members.
fn targets_of(doc: &Value, iid: Option<&str>) -> Vec<String> {
    match iid {
        Some(i) => vec![i.to_string()],
        None => doc["engines"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(_, e)| {
                        e["state"] != "active"
                            || e["checks"].as_array().is_some_and(|c| !c.is_empty())
                    })
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default(),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let ctl = match Ctl::new(&cli) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("narwhalctl: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match &cli.cmd {
        Cmd::Status => ctl.lifecycle().await.map(|d| ctl.show(&d)),
        Cmd::Drain {
            iid,
            wave: _,
            deadline_s,
            wait,
            timeout_s,
        } => ctl
            .drain(
                iid.as_deref(),
                *deadline_s,
                *wait,
                Duration::from_secs_f64(*timeout_s),
            )
            .await
            .map(|d| ctl.show(&d)),
        Cmd::Readmit { iid, wave: _ } => ctl.readmit(iid.as_deref()).await.map(|d| {
            if !ctl.json {
                println!("readmitted");
            }
            let _ = d;
        }),
        Cmd::WaveRestart {
            restart_cmd,
            rolling,
            deadline_s,
            timeout_s,
        } => {
            ctl.wave_restart(
                restart_cmd,
                *rolling,
                *deadline_s,
                Duration::from_secs_f64(*timeout_s),
            )
            .await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("narwhalctl: {}", f.message());
            f.exit()
        }
    }
}
