//! End-to-end tests of the engine lifecycle (issue 4): drain, whole-fleet waves, readmission
//! through the agents, breaker recovery and `narwhalctl`, with real processes: `narwhal-serve`,
//! one `narwhal-agent` per simulated host (router → agent over mutual TLS, every answer signed)
//! and `narwhal-engine-sim` engines, all on loopback.
//!
//! What each test proves is asserted three ways where it can be: the lifecycle document (and the
//! exact `error` strings supervisors match on, seed "Lifecycle API", reference-notes 1.10 and
//! 4.3–4.8, DESIGN.md 9), the router's journal (events appear without anyone reading the
//! document, DESIGN.md 9.4), and what the engines themselves received (`/sim/stats`).
//!
//! The fleet of every test: `p0` (prefill, agent `h0`) and `d0` (decode, agent `h1`), vLLM
//! dialect. "Restarting" an engine kills its simulator and starts a new process on the same
//! ports (new pid, newer process start), which is what a supervisor does to a real engine.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use narwhal_testkit::certs::{DevCerts, make_dev_certs};
use narwhal_testkit::{
    AgentHandle, ChildProc, EngineSpec, FleetSpec, RouterHandle, SimHandle, bin_path, start_agent,
    start_router, start_sim, wait_until,
};
use serde_json::{Value, json};
use tempfile::TempDir;

/// Upper bound for any condition a test polls for.
const WAIT: Duration = Duration::from_secs(20);

/// A two-engine fleet with one agent per engine host and a router in front.
struct Lab {
    router: RouterHandle,
    p0: SimHandle,
    d0: SimHandle,
    /// Agent of `p0`.
    a0: AgentHandle,
    /// Agent of `d0`.
    a1: AgentHandle,
    http: reqwest::Client,
    _certs: DevCerts,
    dir: TempDir,
}

fn http() -> reqwest::Client {
    narwhal_testkit::http_client()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("HTTP client")
}

/// Starts the fleet under restart `policy` (`individual` or `whole_wave`), with extra
/// simulator flags and fleet-file overrides.
async fn lab(policy: &str, sim_args: &[&str], overrides: Value) -> Lab {
    lab_with("vllm", policy, sim_args, overrides).await
}

/// [`lab`] with engines of `dialect` (`vllm` or `sglang`).
async fn lab_with(dialect: &str, policy: &str, sim_args: &[&str], overrides: Value) -> Lab {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = make_dev_certs(
        &dir.path().join("certs"),
        &["router", "agent-h0", "agent-h1"],
    )
    .expect("dev certificates");
    let p0 = start_sim(
        dir.path(),
        &EngineSpec::new("p0", "prefill").args(sim_args),
        dialect,
    )
    .expect("p0 simulator");
    let d0 = start_sim(
        dir.path(),
        &EngineSpec::new("d0", "decode").args(sim_args),
        dialect,
    )
    .expect("d0 simulator");
    let a0 = start_agent(dir.path(), &certs, "h0", &[&p0]).expect("agent h0");
    let a1 = start_agent(dir.path(), &certs, "h1", &[&d0]).expect("agent h1");
    let sims = [p0, d0];
    let spec = FleetSpec::for_sims(dialect, &sims)
        .tls(&certs, "router")
        .agent("p0", &a0)
        .agent("d0", &a1)
        .with(json!({"recovery": {"engine_restart_policy": policy}}))
        .with(overrides);
    let router = start_router(dir.path(), "router", &spec, &[]).expect("router");
    let [p0, d0] = sims;
    let lab = Lab {
        router,
        p0,
        d0,
        a0,
        a1,
        http: http(),
        _certs: certs,
        dir,
    };
    // The router's startup identity check (reference-notes 4.10) accepts both processes in one
    // step; tests start from there, so it never races what they do to engines and agents.
    lab.doc_until("process identities accepted at startup", |d| {
        d["process_starts"]["p0"].is_number() && d["process_starts"]["d0"].is_number()
    })
    .await;
    lab
}

impl Lab {
    /// `GET /narwhal/lifecycle` (status must be 200).
    async fn doc(&self) -> Value {
        let r = self
            .http
            .get(format!("{}/narwhal/lifecycle", self.router.control))
            .send()
            .await
            .expect("GET lifecycle");
        assert_eq!(r.status(), 200);
        r.json().await.expect("lifecycle JSON")
    }

    /// `POST /narwhal/lifecycle/<action>` with a raw body; `(status, document)`.
    async fn post_raw(&self, action: &str, body: &str) -> (u16, Value) {
        let r = self
            .http
            .post(format!(
                "{}/narwhal/lifecycle/{action}",
                self.router.control
            ))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("POST lifecycle");
        let status = r.status().as_u16();
        let doc: Value = r.json().await.expect("every lifecycle reply is JSON");
        assert_eq!(
            doc["schema"], "narwhal.lifecycle",
            "every reply is the full document: {doc}"
        );
        (status, doc)
    }

    async fn post(&self, action: &str, body: Value) -> (u16, Value) {
        self.post_raw(action, &body.to_string()).await
    }

    /// `GET /ready` on the control listener: `(status, body)`.
    async fn ready(&self) -> (u16, Value) {
        let r = self
            .http
            .get(format!("{}/ready", self.router.control))
            .send()
            .await
            .expect("GET /ready");
        let s = r.status().as_u16();
        (s, r.json().await.unwrap_or_default())
    }

    /// Lifecycle events in the journal, oldest first.
    fn events(&self) -> Vec<Value> {
        self.router
            .journal_rows()
            .into_iter()
            .filter(|r| r["event"] == "engine_lifecycle")
            .collect()
    }

    fn has_event(&self, action: &str, iid: Option<&str>) -> bool {
        self.events()
            .iter()
            .any(|e| e["action"] == action && iid.is_none_or(|i| e["iid"] == i))
    }

    /// Waits for a journal event, reading only the journal file (never the router).
    async fn journal_event(&self, action: &str, iid: Option<&str>) -> Value {
        let found = wait_until(WAIT, || async {
            self.events()
                .into_iter()
                .find(|e| e["action"] == action && iid.is_none_or(|i| e["iid"] == i))
        })
        .await;
        found.unwrap_or_else(|| {
            panic!(
                "no {action} {iid:?} event in the journal; events: {:#?}",
                self.events()
            )
        })
    }

    /// Polls the document until `ok(doc)`.
    async fn doc_until(&self, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
        let got = wait_until(WAIT, || async {
            let d = self.doc().await;
            ok(&d).then_some(d)
        })
        .await;
        match got {
            Some(d) => d,
            None => panic!("timed out waiting for {what}: {:#}", self.doc().await),
        }
    }

    /// One non-streaming completion through the router; asserts 200 with tokens.
    async fn complete(&self, prompt: &str) {
        let r = self
            .http
            .post(format!("{}/v1/completions", self.router.data))
            .json(&json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": 4}))
            .send()
            .await
            .expect("completion");
        let status = r.status();
        let body: Value = r.json().await.unwrap_or_default();
        assert_eq!(status, 200, "completion {prompt:?}: {body}");
        assert!(
            body["usage"]["completion_tokens"].as_u64().unwrap_or(0) > 0,
            "{body}"
        );
    }

    async fn stats(&self, sim: &SimHandle) -> Value {
        sim.stats(&self.http).await.expect("sim stats")
    }

    async fn metrics(&self) -> String {
        self.router.metrics(&self.http).await.expect("metrics")
    }

    /// Restarts an agent on its port; with `key`, signing with that key file instead
    /// (made with `narwhal-agent keygen` if missing).
    fn restart_agent(&mut self, which: usize, key: Option<&Path>) {
        let dir = self.dir.path().to_path_buf();
        let a = if which == 0 {
            &mut self.a0
        } else {
            &mut self.a1
        };
        restart_agent(&dir, a, key);
    }
}

/// Kills `a` and starts `narwhal-agent` again on the same port with the same configuration,
/// or with the signing key `key`.
fn restart_agent(dir: &Path, a: &mut AgentHandle, key: Option<&Path>) {
    a.proc.kill();
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(&a.config).expect("agent config")).expect("JSON");
    let port = a.url.rsplit(':').next().expect("port in agent URL");
    cfg["listen"] = json!(format!("127.0.0.1:{port}"));
    if let Some(key) = key {
        if !key.exists() {
            let out = Command::new(bin_path("narwhal-agent"))
                .args(["keygen", "--out"])
                .arg(key)
                .output()
                .expect("narwhal-agent keygen");
            assert!(out.status.success(), "keygen: {out:?}");
        }
        cfg["signing_key"] = json!(key);
    }
    std::fs::write(&a.config, format!("{cfg:#}\n")).expect("write agent config");
    let ready = dir.join(format!("{}.ready.json", a.server_name));
    let _ = std::fs::remove_file(&ready);
    let mut cmd = Command::new(bin_path("narwhal-agent"));
    cmd.args(["run", "--config"])
        .arg(&a.config)
        .arg("--ready-file")
        .arg(&ready);
    a.proc = ChildProc::spawn(cmd, &a.server_name, dir, Duration::from_secs(30))
        .expect("agent restarts on its port");
    let doc: Value = serde_json::from_slice(&std::fs::read(&ready).expect("agent ready file"))
        .expect("ready JSON");
    a.public_key = doc["public_key"].as_str().unwrap_or_default().to_string();
}

/// Kills `sim` and starts a new simulator process on its listen (and KV) port serving
/// `model`; for a SGLang prefill engine, `bootstrap` picks the bootstrap port (`Some(0)`: a new
/// ephemeral one), else it keeps its port.
///
/// `SimHandle::restart(&["--model", ..])` cannot do this: the test kit always passes
/// `--model tiny-sim` (and the bootstrap port), and the simulator refuses a repeated flag
/// (reported with issue 4's tests), so the process is started here.
fn respawn(dir: &Path, sim: &mut SimHandle, model: &str, bootstrap: Option<u16>) {
    sim.proc.kill();
    let mut cmd = Command::new(bin_path("narwhal-engine-sim"));
    cmd.args(["--dialect", &sim.dialect, "--model", model])
        .args(["--listen", &format!("127.0.0.1:{}", sim.port)])
        .args(&sim.sim_args);
    if let Some(k) = sim.kv_port {
        cmd.args(["--kv-listen", &format!("127.0.0.1:{k}")]);
    }
    if sim.dialect == "sglang" {
        cmd.args(["--disaggregation-mode", &sim.role]);
        if let Some(b) = bootstrap.or(sim.bootstrap_port) {
            cmd.args(["--bootstrap-port", &b.to_string()]);
        }
    }
    let ready = dir.join(format!("respawn-{}.ready.json", sim.iid));
    let _ = std::fs::remove_file(&ready);
    cmd.arg("--ready-file").arg(&ready);
    sim.proc = ChildProc::spawn(
        cmd,
        &format!("respawn-{}", sim.iid),
        dir,
        Duration::from_secs(30),
    )
    .expect("simulator respawned");
    let doc: Value =
        serde_json::from_slice(&std::fs::read(&ready).expect("ready file")).expect("ready JSON");
    sim.bootstrap_port = doc["bootstrap_port"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok());
}

/// A streaming completion read chunk by chunk.
struct Stream {
    resp: reqwest::Response,
    text: String,
}

impl Stream {
    /// Starts a stream through the router and waits for its first token chunk (so its decode
    /// leg is resident on the decode engine).
    async fn start(lab: &Lab, prompt: &str, max_tokens: u32) -> Stream {
        let resp = lab
            .http
            .post(format!("{}/v1/completions", lab.router.data))
            .json(
                &json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": max_tokens,
                          "stream": true}),
            )
            .send()
            .await
            .expect("stream request");
        assert_eq!(resp.status(), 200, "stream {prompt:?}");
        let mut s = Stream {
            resp,
            text: String::new(),
        };
        while !s.text.contains("\"text\"") {
            let c = s
                .resp
                .chunk()
                .await
                .expect("stream chunk")
                .expect("stream ended before its first token");
            s.text.push_str(&String::from_utf8_lossy(&c));
        }
        s
    }

    /// Reads to the end; asserts a clean finish (`[DONE]`, no error frame).
    async fn finish(mut self) -> String {
        while let Some(c) = self.resp.chunk().await.expect("stream chunk") {
            self.text.push_str(&String::from_utf8_lossy(&c));
        }
        assert!(
            self.text.trim_end().ends_with("data: [DONE]"),
            "stream did not finish cleanly: {}",
            self.text
        );
        assert!(!self.text.contains("\"error\""), "{}", self.text);
        self.text
    }
}

fn n(v: &Value) -> u64 {
    v.as_u64()
        .unwrap_or_else(|| panic!("expected a count, got {v}"))
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("expected a list, got {v}"))
        .iter()
        .map(|s| s.as_str().unwrap_or_default().to_string())
        .collect()
}

/// The checks a passing individual vLLM readmission of `iid` lists, in the seed's order
/// (health, process-bound attestation, configured model, process identity, direct generation,
/// role-compatible KV transfer, final health). `attestation` carries a fingerprint.
fn assert_checks(checks: &[String], expected: &[&str]) {
    assert_eq!(checks.len(), expected.len(), "checks {checks:?}");
    for (c, e) in checks.iter().zip(expected) {
        if *e == "attestation" {
            assert!(
                c.starts_with("attestation ") && c.len() > "attestation ".len(),
                "{c:?} in {checks:?}"
            );
        } else {
            assert_eq!(c, e, "checks {checks:?}");
        }
    }
}

/// A metric sample line with all of `parts` in it, and its value.
fn metric(text: &str, name: &str, parts: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && parts.iter().all(|p| l.contains(p)))
        .find_map(|l| l.rsplit(' ').next().and_then(|v| v.parse().ok()))
}

/// Issue 4, first bullet: a drain with two streams in flight. Both streams complete; the
/// engine is `draining`, not `ready_to_stop`, until they end; then `drain_complete` reaches the
/// journal with nobody reading the document, and the document shows `drained` and
/// `ready_to_stop`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_with_two_streams_in_flight_completes_them_then_is_ready_to_stop() {
    let lab = lab("individual", &["--tpot-ms", "40"], json!({})).await;
    // Two streams of ~1.2 s each, decoding on d0.
    let s1 = Stream::start(&lab, "first stream in flight", 30).await;
    let s2 = Stream::start(&lab, "second stream in flight", 30).await;
    lab.doc_until("two streams resident on d0", |d| {
        d["engines"]["d0"]["resident"]["decode"] == 2
    })
    .await;
    let (status, doc) = lab
        .post("drain", json!({"engines": ["d0"], "deadline_s": 30}))
        .await;
    assert_eq!(status, 200, "{doc:#}");
    assert_eq!(doc["error"], "");
    let e = &doc["engines"]["d0"];
    assert_eq!(e["state"], "draining", "{doc:#}");
    assert_eq!(e["draining"], true);
    assert_eq!(e["accepts_new"], false);
    assert_eq!(e["ready_to_stop"], false);
    assert_eq!(e["resident"]["decode"], 2);
    assert_eq!(e["restart_required"], true);
    let d0_start = lab.stats(&lab.d0).await["started_at"].as_f64().unwrap();
    let old = e["old_process_start"].as_f64().expect("identity recorded");
    assert!((old - d0_start).abs() < 0.05, "old {old} vs sim {d0_start}");
    assert_eq!(doc["engines"]["p0"]["state"], "active");
    assert_eq!(doc["wave"]["active"], false);
    assert_eq!(
        lab.ready().await.0,
        200,
        "an individual drain keeps the router ready"
    );
    // Not readmittable while work is resident.
    let (status, doc) = lab.post("readmit", json!({"engines": ["d0"]})).await;
    assert_eq!(status, 409);
    assert_eq!(doc["error"], "d0 is draining, expected drained");
    // New work avoids d0 (it is served on p0) while the streams continue.
    let d0_before = n(&lab.stats(&lab.d0).await["requests"]["decode"]);
    lab.complete("placed elsewhere during the drain").await;
    assert_eq!(
        n(&lab.stats(&lab.d0).await["requests"]["decode"]),
        d0_before,
        "a draining engine receives no new work"
    );
    assert!(
        !lab.has_event("drain_complete", Some("d0")),
        "no drain_complete while streams are resident: {:#?}",
        lab.events()
    );
    let t1 = s1.finish().await;
    assert!(
        !lab.has_event("drain_complete", Some("d0"))
            || lab.doc().await["engines"]["d0"]["resident"]["decode"] == 0,
        "drain_complete only after the last stream"
    );
    let t2 = s2.finish().await;
    assert!(t1.matches("\"text\"").count() >= 30 && t2.matches("\"text\"").count() >= 30);
    // Nobody reads the document from here until the journal shows the drain complete.
    lab.journal_event("drain_complete", Some("d0")).await;
    let order: Vec<String> = lab
        .events()
        .iter()
        .filter(|e| e["iid"] == "d0")
        .map(|e| e["action"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        order,
        ["drain_started", "process_recorded", "drain_complete"]
    );
    let doc = lab.doc().await;
    let e = &doc["engines"]["d0"];
    assert_eq!(e["state"], "drained", "{doc:#}");
    assert_eq!(e["ready_to_stop"], true);
    assert_eq!(e["draining"], true);
    assert_eq!(e["accepts_new"], false);
    assert_eq!(e["error"], "");
    assert_eq!(
        doc["wave"]["ready_to_stop"], false,
        "no wave (DESIGN.md 9.3)"
    );
    let m = lab.metrics().await;
    assert_eq!(
        metric(&m, "narwhal_engine_ready_to_stop", &["iid=\"d0\""]),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "narwhal_engine_draining", &["iid=\"d0\""]),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "narwhal_engine_lifecycle_state",
            &["iid=\"d0\"", "state=\"drained\""]
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "narwhal_engine_lifecycle_state",
            &["iid=\"d0\"", "state=\"draining\""]
        ),
        Some(0.0)
    );
}

/// Issue 4, second bullet: readmission without a restart is refused and names why; after a
/// restart it passes every check in the seed's order, and traffic reaches the engine again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readmit_requires_a_restart_then_passes_the_checks_in_order_and_serves_again() {
    let mut lab = lab("individual", &[], json!({})).await;
    let (status, doc) = lab.post("drain", json!({"engines": ["d0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    lab.journal_event("drain_complete", Some("d0")).await;
    let old = doc["engines"]["d0"]["old_process_start"]
        .as_f64()
        .expect("identity recorded");

    let (status, doc) = lab.post("readmit", json!({"engines": ["d0"]})).await;
    assert_eq!(status, 409, "{doc:#}");
    assert_eq!(doc["error"], "readmission validation failed");
    let e = &doc["engines"]["d0"];
    assert_eq!(e["state"], "blocked");
    assert_eq!(e["error"], "engine process did not restart after drain");
    assert_checks(&strs(&e["checks"]), &["health", "attestation", "model"]);
    assert_eq!(e["accepts_new"], false, "a blocked engine stays out");
    lab.journal_event("validation_failed", Some("d0")).await;

    lab.d0.restart(&[]).expect("restart d0");
    let new_start = lab.stats(&lab.d0).await["started_at"].as_f64().unwrap();
    let (status, doc) = lab.post("readmit", json!({"engines": ["d0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert_eq!(doc["error"], "");
    let e = &doc["engines"]["d0"];
    assert_eq!(e["state"], "active");
    assert_eq!(e["error"], "");
    assert_checks(
        &strs(&e["checks"]),
        &[
            "health",
            "attestation",
            "model",
            "new process identity",
            "generation",
            "fabric consume from p0",
            "final health",
        ],
    );
    let (o, nw) = (
        e["old_process_start"].as_f64().unwrap(),
        e["new_process_start"].as_f64().unwrap(),
    );
    assert_eq!(o, old);
    assert!(nw > o, "new_process_start {nw} newer than old {o}");
    assert!((nw - new_start).abs() < 0.05, "{nw} vs sim {new_start}");
    assert_eq!(doc["process_starts"]["d0"].as_f64(), Some(nw));
    assert_eq!(e["accepts_new"], true);
    lab.journal_event("readmitted", Some("d0")).await;

    // Back in placement: P/D traffic decodes on d0 again.
    let before = n(&lab.stats(&lab.d0).await["requests"]["decode"]);
    for i in 0..3 {
        lab.complete(&format!("after readmission {i}")).await;
    }
    assert!(
        n(&lab.stats(&lab.d0).await["requests"]["decode"]) >= before + 3,
        "traffic reaches the readmitted engine"
    );
    let m = lab.metrics().await;
    for result in ["failed", "passed"] {
        assert_eq!(
            metric(
                &m,
                "narwhal_lifecycle_validations_total",
                &[
                    "iid=\"d0\"",
                    "kind=\"operator\"",
                    &format!("result=\"{result}\"")
                ]
            ),
            Some(1.0),
            "{result}: {m}"
        );
    }
    // Reference-notes 6.3: only an un-ejection counts a readmission; a drained engine was not
    // ejected.
    assert_eq!(
        metric(&m, "narwhal_engine_readmissions_total", &["iid=\"d0\""]),
        None,
        "{m}"
    );
}

/// Issue 4, third bullet: each check failing on its own gives 409 naming that check, with the
/// earlier checks passed. One engine (`p0`, peer `d0`) goes through every failure in turn; a
/// blocked engine keeps its recorded identity, so each retry is a plain readmit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_readmission_check_failing_alone_is_a_409_naming_it() {
    let mut lab = lab("individual", &[], json!({})).await;
    let (status, doc) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    lab.journal_event("drain_complete", Some("p0")).await;
    lab.p0.restart(&[]).expect("restart p0");

    async fn refused(lab: &Lab, what: &str) -> (String, Vec<String>) {
        let (status, doc) = lab.post("readmit", json!({"engines": ["p0"]})).await;
        if status != 409 {
            let faults: Value = lab
                .http
                .get(format!("{}/sim/faults", lab.p0.url))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let recent = lab.stats(&lab.p0).await["recent"].clone();
            panic!(
                "{what}: {status} {}; p0 faults {faults}; p0 recent {recent:#}; router log {}",
                doc["error"],
                lab.router.proc.stderr_tail(60)
            );
        }
        assert_eq!(doc["error"], "readmission validation failed", "{what}");
        let e = &doc["engines"]["p0"];
        assert_eq!(e["state"], "blocked", "{what}");
        assert_eq!(e["accepts_new"], false, "{what}");
        (
            e["error"].as_str().unwrap_or_default().to_string(),
            strs(&e["checks"]),
        )
    }

    // 1. health
    lab.p0
        .fault(
            &lab.http,
            json!({"phase": "health", "action": "status", "status": 503}),
        )
        .await
        .unwrap();
    let (err, checks) = refused(&lab, "health").await;
    assert!(err.starts_with("health did not answer 200"), "{err}");
    assert!(checks.is_empty(), "{checks:?}");

    // 2. attestation: the agent now signs with a key the router does not pin.
    let rogue = lab.dir.path().join("rogue.ed25519.pk8");
    let pinned = lab.a0.public_key.clone();
    lab.restart_agent(0, Some(&rogue));
    assert_ne!(lab.a0.public_key, pinned);
    let (err, checks) = refused(&lab, "attestation").await;
    assert!(err.starts_with("attestation: "), "{err}");
    assert_eq!(checks, ["health"]);
    let original = lab.dir.path().join("agent-h0.ed25519.pk8");
    lab.restart_agent(0, Some(&original));
    assert_eq!(lab.a0.public_key, pinned);

    // 3. model
    respawn(lab.dir.path(), &mut lab.p0, "other-model", None);
    let (err, checks) = refused(&lab, "model").await;
    assert_eq!(err, r#"serves ["other-model"], expected tiny-sim"#);
    assert_checks(&checks, &["health", "attestation"]);
    lab.p0.restart(&[]).expect("restart p0");

    // 4. direct generation
    lab.p0
        .fault(
            &lab.http,
            json!({"phase": "aggregated", "action": "status", "status": 500}),
        )
        .await
        .unwrap();
    let (err, checks) = refused(&lab, "generation").await;
    assert!(err.starts_with("generation failed: "), "{err}");
    assert_checks(
        &checks,
        &["health", "attestation", "model", "new process identity"],
    );

    // 5. role-compatible KV transfer: the producer hands over no KV.
    lab.p0
        .fault(&lab.http, json!({"phase": "prefill", "action": "omit_kv"}))
        .await
        .unwrap();
    let (err, checks) = refused(&lab, "kv").await;
    assert!(err.starts_with("fabric p0->d0: "), "{err}");
    assert_checks(
        &checks,
        &[
            "health",
            "attestation",
            "model",
            "new process identity",
            "generation",
        ],
    );
    // The peer is reported by name but holds no record and stays in service.
    let doc = lab.doc().await;
    assert_eq!(doc["engines"]["d0"]["state"], "active");
    assert_eq!(doc["engines"]["d0"]["accepts_new"], true);

    // 6. final health: the first /health of the readmission passes, the second fails.
    lab.p0
        .fault(
            &lab.http,
            json!({"phase": "health", "action": "status", "status": 503, "skip": 1}),
        )
        .await
        .unwrap();
    let (err, checks) = refused(&lab, "final health").await;
    assert_eq!(err, "final health failed after fabric validation");
    assert_checks(
        &checks,
        &[
            "health",
            "attestation",
            "model",
            "new process identity",
            "generation",
            "fabric produce to d0",
        ],
    );

    // Nothing wrong any more: readmitted.
    let (status, doc) = lab.post("readmit", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert_checks(
        &strs(&doc["engines"]["p0"]["checks"]),
        &[
            "health",
            "attestation",
            "model",
            "new process identity",
            "generation",
            "fabric produce to d0",
            "final health",
        ],
    );
    let failed = lab
        .events()
        .iter()
        .filter(|e| e["action"] == "validation_failed" && e["iid"] == "p0")
        .count();
    assert_eq!(failed, 6, "one validation_failed event per failing check");
    let before = n(&lab.stats(&lab.p0).await["requests"]["prefill"]);
    lab.complete("p0 prefills again").await;
    assert!(n(&lab.stats(&lab.p0).await["requests"]["prefill"]) > before);
}

/// Issue 4, fourth bullet: a whole wave under `whole_wave`. `/ready` is 503 during the wave;
/// `wave.ready_to_stop` waits for every member; a wave readmission with one engine not restarted
/// blocks the whole wave naming that engine, and passes once it is restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_wave_drain_and_readmission() {
    let mut lab = lab("whole_wave", &["--tpot-ms", "40"], json!({})).await;
    let (status, doc) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 409);
    assert_eq!(
        doc["error"],
        "engine_restart_policy requires a whole-wave drain"
    );
    assert_eq!(doc["engine_restart_policy"], "whole_wave");
    assert_eq!(lab.ready().await.0, 200);

    let stream = Stream::start(&lab, "resident through the wave drain", 25).await;
    let (status, doc) = lab
        .post("drain", json!({"wave": true, "deadline_s": 30}))
        .await;
    assert_eq!(status, 200, "{doc:#}");
    let wave_id = doc["wave"]["id"].as_str().unwrap().to_string();
    assert!(
        wave_id.starts_with("wave-") && wave_id.len() == 17,
        "{wave_id}"
    );
    assert_eq!(doc["wave"]["active"], true);
    assert_eq!(doc["wave"]["readiness_withdrawn"], true);
    assert_eq!(doc["wave"]["ready_to_stop"], false);
    assert_eq!(doc["router"]["ready"], false);
    let (status, ready) = lab.ready().await;
    assert_eq!(status, 503, "{ready}");
    assert_eq!(
        ready["reason"],
        format!("whole-wave drain {wave_id}"),
        "{ready}"
    );
    // p0 has nothing resident: drained, but not ready_to_stop until the whole wave is.
    let doc = lab
        .doc_until("p0 drained", |d| d["engines"]["p0"]["state"] == "drained")
        .await;
    assert_eq!(doc["engines"]["p0"]["ready_to_stop"], false, "{doc:#}");
    assert_eq!(doc["engines"]["d0"]["state"], "draining");
    assert_eq!(doc["wave"]["ready_to_stop"], false);
    assert!(!lab.has_event("wave_ready_to_stop", None));
    // Readmission shapes during a wave.
    let (status, doc) = lab.post("readmit", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 409);
    assert_eq!(
        doc["error"],
        "an active whole wave must be validated and readmitted as one engine set"
    );
    let (status, doc) = lab
        .post("readmit", json!({"engines": ["p0"], "wave": true}))
        .await;
    assert_eq!(status, 409);
    assert_eq!(
        doc["error"],
        "whole-wave readmission must name the active wave's complete engine set"
    );

    stream.finish().await;
    let ev = lab.journal_event("wave_ready_to_stop", None).await;
    assert_eq!(ev["wave_id"], wave_id.as_str());
    assert_eq!(strs(&ev["engines"]), ["d0", "p0"]);
    let doc = lab.doc().await;
    assert_eq!(doc["wave"]["ready_to_stop"], true, "{doc:#}");
    for iid in ["p0", "d0"] {
        assert_eq!(doc["engines"][iid]["ready_to_stop"], true, "{iid}");
        assert_eq!(doc["engines"][iid]["wave_id"], wave_id.as_str());
    }
    assert_eq!(lab.ready().await.0, 503);

    // Only p0 is restarted: the wave is refused, naming d0.
    lab.p0.restart(&[]).expect("restart p0");
    let (status, doc) = lab.post("readmit", json!({"wave": true})).await;
    assert_eq!(status, 409, "{doc:#}");
    assert_eq!(doc["error"], "readmission validation failed");
    assert_eq!(
        doc["engines"]["d0"]["error"],
        "engine process did not restart after drain"
    );
    assert_eq!(
        doc["engines"]["p0"]["error"],
        "another engine in the wave failed validation: d0 (engine process did not restart after drain)"
    );
    for iid in ["p0", "d0"] {
        assert_eq!(doc["engines"][iid]["state"], "blocked", "{iid}");
    }
    assert_eq!(doc["wave"]["active"], true, "the wave stays active");
    assert_eq!(lab.ready().await.0, 503);

    lab.d0.restart(&[]).expect("restart d0");
    let (status, doc) = lab.post("readmit", json!({"wave": true})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert_eq!(doc["wave"]["active"], false);
    assert_eq!(doc["wave"]["id"], "");
    for iid in ["p0", "d0"] {
        let e = &doc["engines"][iid];
        assert_eq!(e["state"], "active", "{iid}");
        assert_eq!(e["wave_id"], "", "{iid}");
        assert!(
            e["new_process_start"].as_f64().unwrap() > e["old_process_start"].as_f64().unwrap(),
            "{iid}"
        );
        let checks = strs(&e["checks"]);
        assert!(
            checks.contains(&"new process identity".to_string())
                && checks.last().map(String::as_str) == Some("final health"),
            "{iid}: {checks:?}"
        );
    }
    let ev = lab.journal_event("wave_readmitted", None).await;
    assert_eq!(ev["wave_id"], wave_id.as_str());
    assert_eq!(lab.ready().await.0, 200);
    let (p_before, d_before) = (
        n(&lab.stats(&lab.p0).await["requests"]["prefill"]),
        n(&lab.stats(&lab.d0).await["requests"]["decode"]),
    );
    lab.complete("after the wave").await;
    assert!(n(&lab.stats(&lab.p0).await["requests"]["prefill"]) > p_before);
    assert!(n(&lab.stats(&lab.d0).await["requests"]["decode"]) > d_before);
}

/// Issue 4, fifth bullet: an engine the breaker ejected (connection refused) that answers
/// `/health` again is validated through the agents and readmitted with
/// `restart_required: false`. While it is out, draining the only other engine is refused
/// (reference-notes 4.3 rule 6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_ejected_engine_is_validated_and_readmitted_without_restart_requirement() {
    let mut lab = lab("individual", &[], json!({"recovery": {"eject_after": 1}})).await;
    lab.complete("warm up").await;
    lab.d0.proc.kill();
    // Connection refused on d0's decode legs: the breaker ejects it (requests may still be
    // served by a retry on p0).
    let _ = lab
        .http
        .post(format!("{}/v1/completions", lab.router.data))
        .json(&json!({"model": "tiny-sim", "prompt": "d0 is gone", "max_tokens": 2}))
        .send()
        .await;
    let doc = lab
        .doc_until("d0 out of placement", |d| {
            d["engines"]["d0"]["accepts_new"] == false
        })
        .await;
    assert_eq!(
        doc["engines"]["d0"]["state"], "active",
        "ejection is not a lifecycle hold"
    );
    let (status, doc) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 409, "{doc:#}");
    assert_eq!(
        doc["error"],
        "the last schedulable engine requires a whole-wave drain"
    );
    assert_eq!(doc["engines"]["p0"]["state"], "active", "nothing changed");

    // The engine answers again (same port): recovery validation readmits it.
    lab.d0.restart(&[]).expect("d0 back");
    lab.journal_event("recovery_validation_started", Some("d0"))
        .await;
    let ev = lab.journal_event("readmitted", Some("d0")).await;
    let start = lab.stats(&lab.d0).await["started_at"].as_f64().unwrap();
    assert!((ev["process_start"].as_f64().unwrap() - start).abs() < 0.05);
    let doc = lab
        .doc_until("d0 back in placement", |d| {
            d["engines"]["d0"]["accepts_new"] == true
        })
        .await;
    let e = &doc["engines"]["d0"];
    assert_eq!(e["state"], "active", "{doc:#}");
    assert_eq!(e["restart_required"], false);
    assert_eq!(e["error"], "");
    assert_checks(
        &strs(&e["checks"]),
        &[
            "health",
            "attestation",
            "model",
            "process identity",
            "generation",
            "fabric consume from p0",
            "final health",
        ],
    );
    let m = lab.metrics().await;
    assert_eq!(
        metric(
            &m,
            "narwhal_lifecycle_validations_total",
            &["iid=\"d0\"", "kind=\"recovery\"", "result=\"passed\""]
        ),
        Some(1.0),
        "{m}"
    );
    assert!(
        metric(
            &m,
            "narwhal_engine_readmissions_total",
            &["iid=\"d0\"", "evidence=\"lifecycle\""]
        )
        .is_some_and(|v| v >= 1.0),
        "the un-ejection counts as a lifecycle readmission: {m}"
    );
    let before = n(&lab.stats(&lab.d0).await["requests"]["decode"]);
    lab.complete("d0 decodes again").await;
    assert!(n(&lab.stats(&lab.d0).await["requests"]["decode"]) > before);
}

/// Issue 4, sixth bullet: the exact 409 shapes of reference-notes 4.3 and 1.10 that still
/// apply after DESIGN.md 9 (a repeated identical drain is 200, departure 9.5), plus 400 for
/// malformed bodies. Every reply is the full document with the message in `error`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_refusals_have_the_reference_shapes() {
    let lab = lab("individual", &[], json!({})).await;
    let conflict = |body: Value, msg: &'static str| {
        let lab = &lab;
        async move {
            let (status, doc) = lab.post("drain", body.clone()).await;
            assert_eq!(status, 409, "drain {body}: {doc:#}");
            assert_eq!(doc["error"], msg, "drain {body}");
        }
    };
    // Rules in order: unknown ids before the deadline, the deadline before the count.
    conflict(
        json!({"engines": ["zz", "p0", "aa"], "deadline_s": 0}),
        "unknown engine(s): aa, zz",
    )
    .await;
    conflict(
        json!({"engines": ["p0", "d0"], "deadline_s": -1}),
        "deadline_s must be positive",
    )
    .await;
    conflict(
        json!({"engines": ["p0", "d0"]}),
        "a non-wave drain must name exactly one engine",
    )
    .await;
    conflict(json!({}), "a non-wave drain must name exactly one engine").await;
    conflict(
        json!({"engines": ["p0"], "wave": true}),
        "a whole-wave drain must name every configured engine",
    )
    .await;
    let doc = lab.doc().await;
    assert!(
        doc["engines"]
            .as_object()
            .unwrap()
            .values()
            .all(|e| e["state"] == "active" && e["accepts_new"] == true),
        "refusals change nothing: {doc:#}"
    );
    assert!(lab.events().is_empty());

    for (body, msg) in [
        (json!({"engines": ["d0"]}), "d0 is active, expected drained"),
        (
            json!({"engines": ["p0", "d0"]}),
            "readmission must name exactly one engine",
        ),
        (
            json!({"wave": true}),
            "whole-wave readmission must name the active wave's complete engine set",
        ),
        (json!({"engines": ["zz"]}), "unknown engine(s): zz"),
    ] {
        let (status, doc) = lab.post("readmit", body.clone()).await;
        assert_eq!(status, 409, "readmit {body}: {doc:#}");
        assert_eq!(doc["error"], msg, "readmit {body}");
    }

    let (status, first) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{first:#}");
    lab.journal_event("drain_complete", Some("p0")).await;
    let before = lab.doc().await;
    // DESIGN.md 9.5: the same drain again is idempotent.
    let (status, again) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{again:#}");
    assert_eq!(again["error"], "");
    assert_eq!(again["engines"]["p0"], before["engines"]["p0"]);
    assert_eq!(
        again["events"].as_array().unwrap().len(),
        before["events"].as_array().unwrap().len(),
        "a repeated drain emits nothing"
    );
    conflict(
        json!({"engines": ["d0"]}),
        "lifecycle action already active for p0",
    )
    .await;
    conflict(
        json!({"wave": true}),
        "lifecycle action already active for p0",
    )
    .await;

    for (body, needle) in [
        ("[1]", "the request body must be a JSON object"),
        ("{not json", "the request body is not valid JSON"),
        (
            r#"{"engines": "p0"}"#,
            "engines must be a list of engine ids",
        ),
        (
            r#"{"engines": ["p0"], "bogus": 1}"#,
            "unknown field \"bogus\"",
        ),
        (r#"{"deadline_s": "soon"}"#, "deadline_s must be a number"),
        (r#"{"wave": "yes"}"#, "wave must be true or false"),
    ] {
        let (status, doc) = lab.post_raw("drain", body).await;
        assert_eq!(status, 400, "{body}: {doc:#}");
        assert!(
            doc["error"].as_str().unwrap().contains(needle),
            "{body}: {}",
            doc["error"]
        );
    }
    let (status, doc) = lab.post_raw("readmit", r#"{"deadline_s": 5}"#).await;
    assert_eq!(status, 400, "readmit takes no deadline: {doc:#}");
}

/// Issue 4, "plus": a drain whose identity capture fails (agent down) is 503 naming the engine;
/// the engine stays out of placement (`blocked`, no traffic reaches it); readmission is refused
/// for want of an identity; the same drain, repeated once the agent is back, records the
/// identity and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_with_agent_down_is_503_holds_the_engine_and_the_retry_succeeds() {
    let mut lab = lab("individual", &[], json!({"agent": {"timeout_s": 2}})).await;
    lab.a0.proc.kill();
    let (status, doc) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 503, "{doc:#}");
    let err = doc["error"].as_str().unwrap();
    assert!(
        err.starts_with("p0: process identity unreadable: "),
        "{err}"
    );
    let e = &doc["engines"]["p0"];
    assert_eq!(e["state"], "blocked");
    assert_eq!(e["draining"], true);
    assert_eq!(e["accepts_new"], false);
    assert_eq!(e["old_process_start"], Value::Null);
    assert!(
        e["error"]
            .as_str()
            .unwrap()
            .starts_with("process identity unreadable")
    );
    lab.journal_event("drain_blocked", Some("p0")).await;

    let before = n(&lab.stats(&lab.p0).await["requests"]["prefill"])
        + n(&lab.stats(&lab.p0).await["requests"]["aggregated"]);
    lab.complete("p0 is held out").await;
    let after = n(&lab.stats(&lab.p0).await["requests"]["prefill"])
        + n(&lab.stats(&lab.p0).await["requests"]["aggregated"]);
    assert_eq!(after, before, "a blocked engine receives no traffic");

    let (status, doc) = lab.post("readmit", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 409);
    assert_eq!(
        doc["error"],
        "p0 has no recorded pre-restart process identity"
    );

    lab.restart_agent(0, None);
    let (status, doc) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert_eq!(doc["error"], "");
    let start = lab.stats(&lab.p0).await["started_at"].as_f64().unwrap();
    let old = doc["engines"]["p0"]["old_process_start"].as_f64().unwrap();
    assert!((old - start).abs() < 0.05);
    lab.journal_event("drain_complete", Some("p0")).await;
    let doc = lab.doc().await;
    assert_eq!(doc["engines"]["p0"]["state"], "drained");
    assert_eq!(doc["engines"]["p0"]["error"], "");
    assert_eq!(doc["engines"]["p0"]["ready_to_stop"], true);
    let actions: Vec<String> = lab
        .events()
        .iter()
        .filter(|e| e["iid"] == "p0")
        .map(|e| e["action"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        actions,
        [
            "drain_started",
            "drain_blocked",
            "process_recorded",
            "drain_complete"
        ]
    );
}

/// Pids of engines started by a restart script, killed when the test ends.
struct PidFiles(Vec<PathBuf>);

impl Drop for PidFiles {
    fn drop(&mut self) {
        for f in &self.0 {
            if let Some(pid) = std::fs::read_to_string(f)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// Writes `restart.sh IID`: kills the engine's current process (pid from `IID.pid`), waits
/// until it is gone, starts the simulator again on the same ports and waits for its ready file.
fn restart_script(dir: &Path, sims: &[&SimHandle]) -> PathBuf {
    let mut cases = String::new();
    for s in sims {
        std::fs::write(dir.join(format!("{}.pid", s.iid)), s.proc.pid().to_string())
            .expect("pid file");
        let kv = s
            .kv_port
            .map(|p| format!(" --kv-listen 127.0.0.1:{p}"))
            .unwrap_or_default();
        cases.push_str(&format!(
            "  {iid}) args=\"--listen 127.0.0.1:{port}{kv}\" ;;\n",
            iid = s.iid,
            port = s.port
        ));
    }
    let script = format!(
        r#"#!/bin/sh
set -e
iid="$1"
d="{dir}"
case "$iid" in
{cases}  *) echo "unknown engine $iid" >&2; exit 2 ;;
esac
old=$(cat "$d/$iid.pid")
kill -9 "$old" 2>/dev/null || true
# Gone or a zombie: its sockets are closed.
while [ -e "/proc/$old/status" ] && ! grep -q '^State:.*Z' "/proc/$old/status"; do sleep 0.02; done
rm -f "$d/$iid.script-ready.json"
"{sim}" --dialect vllm --model tiny-sim $args --ready-file "$d/$iid.script-ready.json" \
  >/dev/null 2>>"$d/$iid.script.stderr.log" &
echo $! > "$d/$iid.pid"
n=0
while [ ! -s "$d/$iid.script-ready.json" ]; do
  n=$((n+1)); [ $n -lt 1500 ] || exit 1
  sleep 0.02
done
"#,
        dir = dir.display(),
        sim = bin_path("narwhal-engine-sim").display(),
    );
    let path = dir.join("restart.sh");
    std::fs::write(&path, script).expect("restart script");
    path
}

fn ctl(control: &str, args: &[&str]) -> std::process::Output {
    Command::new(bin_path("narwhalctl"))
        .args(["--router", control])
        .args(args)
        .output()
        .expect("run narwhalctl")
}

/// `narwhalctl wave-restart` drives a whole-wave restart and then a rolling one through a
/// restart command (a shell script that kills the engine and starts the simulator again on its
/// ports); every engine comes back with a newer process start and serves. Also the exit codes:
/// 1 for a refused action, 3 for an unreachable router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narwhalctl_wave_restart_and_rolling_restart() {
    let lab = lab("individual", &[], json!({})).await;
    let script = restart_script(lab.dir.path(), &[&lab.p0, &lab.d0]);
    let _reap = PidFiles(vec![
        lab.dir.path().join("p0.pid"),
        lab.dir.path().join("d0.pid"),
    ]);
    let pid = |iid: &str| std::fs::read_to_string(lab.dir.path().join(format!("{iid}.pid")));
    let cmd = format!("sh {} {{iid}}", script.display());
    let control = lab.router.control.clone();

    let pids0 = (pid("p0").unwrap(), pid("d0").unwrap());
    let out = tokio::task::spawn_blocking({
        let (control, cmd) = (control.clone(), cmd.clone());
        move || {
            ctl(
                &control,
                &["wave-restart", "--restart-cmd", &cmd, "--timeout-s", "30"],
            )
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "wave-restart: {out:?}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let pids1 = (pid("p0").unwrap(), pid("d0").unwrap());
    assert!(
        pids1.0 != pids0.0 && pids1.1 != pids0.1,
        "both engines restarted"
    );
    let doc = lab.doc().await;
    assert_eq!(doc["wave"]["active"], false, "{doc:#}");
    for iid in ["p0", "d0"] {
        let e = &doc["engines"][iid];
        assert_eq!(e["state"], "active", "{iid}: {doc:#}");
        assert!(e["new_process_start"].as_f64() > e["old_process_start"].as_f64());
    }
    assert!(lab.has_event("wave_readmitted", None));
    lab.complete("after the wave restart").await;

    let out = tokio::task::spawn_blocking({
        let (control, cmd) = (control.clone(), cmd.clone());
        move || {
            ctl(
                &control,
                &[
                    "wave-restart",
                    "--rolling",
                    "--restart-cmd",
                    &cmd,
                    "--timeout-s",
                    "30",
                ],
            )
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "rolling: {out:?}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let pids2 = (pid("p0").unwrap(), pid("d0").unwrap());
    assert!(pids2.0 != pids1.0 && pids2.1 != pids1.1);
    let doc = lab.doc().await;
    for iid in ["p0", "d0"] {
        let e = &doc["engines"][iid];
        assert_eq!(e["state"], "active", "{iid}: {doc:#}");
        assert_eq!(e["wave_id"], "", "{iid}: rolling restarts are individual");
        assert!(strs(&e["checks"]).contains(&"new process identity".to_string()));
    }
    lab.complete("after the rolling restart").await;

    let out = ctl(&control, &["readmit", "p0"]);
    assert_eq!(out.status.code(), Some(1), "refused: {out:?}");
    let out = ctl(&control, &["status"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let out = ctl("http://127.0.0.1:1", &["status"]);
    assert_eq!(out.status.code(), Some(3), "unreachable: {out:?}");
}

/// A drain deadline that passes with a stream still resident is reported (never cancels the
/// work): `drain_deadline_exceeded` reaches the journal from the router's timer with nobody
/// reading the document, the stream still completes, and the engine then drains with no stale
/// error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_deadline_is_reported_by_the_timer_and_never_cancels_work() {
    let lab = lab("individual", &["--tpot-ms", "40"], json!({})).await;
    let s = Stream::start(&lab, "outlives the drain deadline", 30).await;
    let (status, doc) = lab
        .post("drain", json!({"engines": ["d0"], "deadline_s": 0.2}))
        .await;
    assert_eq!(status, 200, "{doc:#}");
    let ev = lab
        .journal_event("drain_deadline_exceeded", Some("d0"))
        .await;
    assert_eq!(ev["resident"], 1, "{ev}");
    assert!(!lab.has_event("drain_complete", Some("d0")));
    let doc = lab.doc().await;
    let e = &doc["engines"]["d0"];
    assert_eq!(e["state"], "deadline_exceeded", "{doc:#}");
    assert_eq!(
        e["error"],
        "1 resident request(s) remain after the drain deadline"
    );
    assert_eq!(e["ready_to_stop"], false);
    let (status, doc) = lab.post("readmit", json!({"engines": ["d0"]})).await;
    assert_eq!(status, 409);
    assert_eq!(doc["error"], "d0 is deadline_exceeded, expected drained");
    let text = s.finish().await;
    assert!(
        text.matches("\"text\"").count() >= 30,
        "the stream ran to its end"
    );
    lab.journal_event("drain_complete", Some("d0")).await;
    let doc = lab.doc().await;
    let e = &doc["engines"]["d0"];
    assert_eq!(e["state"], "drained", "{doc:#}");
    assert_eq!(e["error"], "", "no stale deadline error");
    assert_eq!(e["ready_to_stop"], true);
}

/// Under `whole_wave`, a breaker ejection puts every engine in a restart-required wave
/// (reference-notes 4.9): `/ready` 503 naming it, every engine `blocked` with no recorded
/// identity (so a readmit is refused), the operator's wave drain captures identities, and after
/// every engine restarts the wave readmission returns the fleet to service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_wave_ejection_requires_a_restart_wave_that_the_operator_completes() {
    let mut lab = lab("whole_wave", &[], json!({"recovery": {"eject_after": 1}})).await;
    lab.complete("warm up").await;
    lab.d0.proc.kill();
    let _ = lab
        .http
        .post(format!("{}/v1/completions", lab.router.data))
        .json(&json!({"model": "tiny-sim", "prompt": "d0 is gone", "max_tokens": 2}))
        .send()
        .await;
    let ev = lab.journal_event("restart_required", None).await;
    assert_eq!(ev["reason"], "engine d0 was excluded", "{ev}");
    let wave_id = ev["wave_id"].as_str().unwrap().to_string();
    let (status, ready) = lab.ready().await;
    assert_eq!(status, 503);
    assert_eq!(
        ready["reason"],
        "whole-wave restart required: engine d0 was excluded"
    );
    let doc = lab.doc().await;
    assert_eq!(doc["wave"]["id"], wave_id.as_str(), "{doc:#}");
    for iid in ["p0", "d0"] {
        let e = &doc["engines"][iid];
        assert_eq!(e["state"], "blocked", "{iid}");
        assert_eq!(e["restart_required"], true, "{iid}");
        assert_eq!(e["old_process_start"], Value::Null, "{iid}");
        assert_eq!(e["error"], "engine d0 was excluded", "{iid}");
    }
    // The engine answers again; automatic recovery must not readmit it under whole_wave.
    lab.d0.restart(&[]).expect("d0 back");
    let (status, doc) = lab.post("readmit", json!({"wave": true})).await;
    assert_eq!(status, 409, "{doc:#}");
    assert_eq!(
        doc["error"],
        "d0 has no recorded pre-restart process identity"
    );
    // Drain the wave: identities are captured for the held records (no new wave).
    let (status, doc) = lab.post("drain", json!({"wave": true})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert_eq!(doc["wave"]["id"], wave_id.as_str(), "same wave");
    lab.journal_event("wave_ready_to_stop", None).await;
    assert!(
        !lab.has_event("recovery_validation_started", Some("d0")),
        "no automatic recovery under whole_wave"
    );
    lab.p0.restart(&[]).expect("restart p0");
    lab.d0.restart(&[]).expect("restart d0");
    let (status, doc) = lab.post("readmit", json!({"wave": true})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert_eq!(doc["wave"]["active"], false);
    let doc = lab
        .doc_until("both engines in placement", |d| {
            d["engines"]["p0"]["accepts_new"] == true && d["engines"]["d0"]["accepts_new"] == true
        })
        .await;
    assert_eq!(doc["router"]["ready"], true, "{doc:#}");
    assert_eq!(lab.ready().await.0, 200);
    let before = n(&lab.stats(&lab.d0).await["requests"]["decode"]);
    lab.complete("after the forced wave").await;
    assert!(n(&lab.stats(&lab.d0).await["requests"]["decode"]) > before);
}

/// A recovery validation that fails (the engine came back serving the wrong model) leaves the
/// engine out, `blocked` without a restart requirement; the next probe retries, and once the
/// engine is right it is readmitted automatically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_recovery_validation_keeps_the_engine_out_and_is_retried() {
    let mut lab = lab("individual", &[], json!({"recovery": {"eject_after": 1}})).await;
    lab.complete("warm up").await;
    lab.d0.proc.kill();
    let _ = lab
        .http
        .post(format!("{}/v1/completions", lab.router.data))
        .json(&json!({"model": "tiny-sim", "prompt": "d0 is gone", "max_tokens": 2}))
        .send()
        .await;
    lab.doc_until("d0 ejected", |d| d["engines"]["d0"]["accepts_new"] == false)
        .await;
    respawn(lab.dir.path(), &mut lab.d0, "other-model", None);
    let ev = lab.journal_event("validation_failed", Some("d0")).await;
    assert_eq!(
        ev["error"], r#"serves ["other-model"], expected tiny-sim"#,
        "{ev}"
    );
    let doc = lab.doc().await;
    let e = &doc["engines"]["d0"];
    assert_eq!(e["accepts_new"], false, "{doc:#}");
    assert_eq!(e["restart_required"], false);
    assert!(
        lab.stats(&lab.d0).await["requests"]["decode"] == 0,
        "no traffic reaches an engine that failed validation"
    );
    lab.d0.restart(&[]).expect("d0 right again");
    lab.journal_event("readmitted", Some("d0")).await;
    lab.doc_until("d0 back", |d| {
        d["engines"]["d0"]["accepts_new"] == true && d["engines"]["d0"]["state"] == "active"
    })
    .await;
    let before = n(&lab.stats(&lab.d0).await["requests"]["decode"]);
    lab.complete("d0 decodes again").await;
    assert!(n(&lab.stats(&lab.d0).await["requests"]["decode"]) > before);
}

/// SGLang: readmission has no direct-generation check (the KV rendezvous is the generation
/// evidence), and a prefill engine restarted on a new bootstrap port serves P/D traffic right
/// after its readmission answers 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_prefill_readmitted_on_a_new_bootstrap_port_serves_at_once() {
    let mut lab = lab_with("sglang", "individual", &[], json!({})).await;
    lab.complete("warm up").await;
    let (status, doc) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    lab.journal_event("drain_complete", Some("p0")).await;
    let old_port = lab.p0.bootstrap_port;
    respawn(lab.dir.path(), &mut lab.p0, "tiny-sim", Some(0));
    assert_ne!(lab.p0.bootstrap_port, old_port, "a new bootstrap port");
    let rejected_before = lab.stats(&lab.d0).await["kv"]["rejected"].clone();
    // Traffic runs through the readmission: the first P/D requests placed on p0 after it is
    // back must already use its new bootstrap port.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hammer = {
        let (http, data, stop) = (lab.http.clone(), lab.router.data.clone(), stop.clone());
        tokio::spawn(async move {
            let mut bad = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let r = http
                    .post(format!("{data}/v1/completions"))
                    .json(
                        &json!({"model": "tiny-sim", "prompt": format!("hammer {i}"),
                                  "max_tokens": 2}),
                    )
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status() == 200 => {}
                    Ok(r) => bad.push(format!(
                        "{}: {}",
                        r.status(),
                        r.text().await.unwrap_or_default()
                    )),
                    Err(e) => bad.push(e.to_string()),
                }
            }
            (i, bad)
        })
    };
    let (status, doc) = lab.post("readmit", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert_checks(
        &strs(&doc["engines"]["p0"]["checks"]),
        &[
            "health",
            "attestation",
            "model",
            "new process identity",
            "fabric produce to d0",
            "final health",
        ],
    );
    let p_now = n(&lab.stats(&lab.p0).await["requests"]["prefill"]);
    wait_until(WAIT, || async {
        (n(&lab.stats(&lab.p0).await["requests"]["prefill"]) >= p_now + 5).then_some(())
    })
    .await
    .expect("P/D traffic on p0 after readmission");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (sent, bad) = hammer.await.unwrap();
    assert!(bad.is_empty(), "{} of {sent} failed: {bad:?}", bad.len());
    assert_eq!(
        lab.stats(&lab.d0).await["kv"]["rejected"],
        rejected_before,
        "no decode used a stale bootstrap port"
    );
    let (p, d) = (
        lab.stats(&lab.p0).await["requests"]["prefill"].clone(),
        lab.stats(&lab.d0).await["kv"].clone(),
    );
    for i in 0..3 {
        lab.complete(&format!("right after readmission {i}")).await;
    }
    let d2 = lab.stats(&lab.d0).await["kv"].clone();
    assert!(n(&lab.stats(&lab.p0).await["requests"]["prefill"]) >= n(&p) + 3);
    assert_eq!(d2["rejected"], d["rejected"], "no rendezvous failed: {d2}");
    assert!(n(&d2["consumed"]) >= n(&d["consumed"]) + 3, "{d2}");
}

/// Under `whole_wave`, an engine that crashed (ejected, still down) is bound to the last process
/// the router verified when the operator drains the forced wave (reference-notes 4.4 binding,
/// 4.10 identities accepted at startup), so the supervisor restarts it once: the drain is 200
/// while it is down, and the restarted process passes the wave readmission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_engine_is_bound_to_its_verified_process_when_the_wave_drains() {
    let mut lab = lab("whole_wave", &[], json!({"recovery": {"eject_after": 1}})).await;
    let d0_start = lab.stats(&lab.d0).await["started_at"].as_f64().unwrap();
    lab.doc_until("identities accepted at startup", |d| {
        d["process_starts"]["d0"].as_f64().is_some() && d["process_starts"]["p0"].as_f64().is_some()
    })
    .await;
    lab.complete("warm up").await;
    lab.d0.proc.kill();
    let _ = lab
        .http
        .post(format!("{}/v1/completions", lab.router.data))
        .json(&json!({"model": "tiny-sim", "prompt": "d0 crashed", "max_tokens": 2}))
        .send()
        .await;
    lab.journal_event("restart_required", None).await;
    let (status, doc) = lab.post("drain", json!({"wave": true})).await;
    assert_eq!(status, 200, "{doc:#}");
    let old = doc["engines"]["d0"]["old_process_start"].as_f64();
    assert_eq!(
        old,
        Some(d0_start),
        "bound to the verified process: {doc:#}"
    );
    lab.journal_event("wave_ready_to_stop", None).await;
    lab.p0.restart(&[]).expect("restart p0");
    lab.d0.restart(&[]).expect("restart d0");
    let (status, doc) = lab.post("readmit", json!({"wave": true})).await;
    assert_eq!(status, 200, "{doc:#}");
    lab.doc_until("d0 back", |d| d["engines"]["d0"]["accepts_new"] == true)
        .await;
    lab.complete("after the crash wave").await;
}

/// DESIGN.md 9.7: a peer whose process changed behind the router's back fails an individual
/// readmission by name and is ejected (`process_identity`).
///
/// In a one-prefill, one-decode fleet that leaves nothing live: the breaker's recovery of the
/// peer waits for the target's hold to end (reference-notes 4.9), and the target has no live
/// peer. The next readmission of the target takes the ejected peer along as a co-target
/// validated without a restart requirement, and both return (the reference stays stuck until a
/// whole-wave restart; this was found here and fixed in `Lifecycle::join_recovery`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_restarted_behind_the_routers_back_fails_readmission_by_name() {
    let mut lab = lab("individual", &[], json!({})).await;
    lab.doc_until("identities accepted at startup", |d| {
        d["process_starts"]["d0"].as_f64().is_some()
    })
    .await;
    let (status, doc) = lab.post("drain", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    lab.journal_event("drain_complete", Some("p0")).await;
    lab.p0.restart(&[]).expect("restart p0");
    lab.d0
        .restart(&[])
        .expect("d0 restarted without the router knowing");
    let (status, doc) = lab.post("readmit", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 409, "{doc:#}");
    assert_eq!(
        doc["engines"]["p0"]["error"],
        "peer failed validation: d0 (peer process changed before readmission)"
    );
    assert_eq!(doc["engines"]["p0"]["state"], "blocked");
    assert_eq!(doc["engines"]["d0"]["accepts_new"], false, "d0 ejected");
    assert_eq!(doc["engines"]["d0"]["state"], "active", "no record for d0");
    let m = lab.metrics().await;
    assert!(
        metric(
            &m,
            "narwhal_engine_ejections_total",
            &["iid=\"d0\"", "cause=\"process_identity\""]
        )
        .is_some_and(|v| v >= 1.0),
        "{m}"
    );
    assert_eq!(lab.ready().await.0, 503, "nothing live");
    assert!(!lab.has_event("recovery_validation_started", Some("d0")));
    let (status, doc) = lab.post("readmit", json!({"engines": ["p0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    let d0 = &doc["engines"]["d0"];
    assert_eq!(d0["state"], "active", "{doc:#}");
    assert_eq!(d0["restart_required"], false);
    assert_checks(
        &strs(&d0["checks"]),
        &[
            "health",
            "attestation",
            "model",
            "process identity",
            "generation",
            "fabric consume from p0",
            "final health",
        ],
    );
    let d0_start = lab.stats(&lab.d0).await["started_at"].as_f64().unwrap();
    assert_eq!(doc["process_starts"]["d0"].as_f64(), Some(d0_start));
    assert_eq!(doc["engines"]["p0"]["state"], "active");
    lab.journal_event("recovery_validation_started", Some("d0"))
        .await;
    lab.doc_until("both back", |d| {
        d["engines"]["d0"]["accepts_new"] == true && d["engines"]["p0"]["accepts_new"] == true
    })
    .await;
    assert_eq!(lab.ready().await.0, 200);
    let before = n(&lab.stats(&lab.d0).await["requests"]["decode"]);
    lab.complete("both back").await;
    assert!(n(&lab.stats(&lab.d0).await["requests"]["decode"]) > before);
}

/// An engine that crashes while draining: its stream fails, it is ejected, its drain completes
/// (nothing resident, identity recorded) so the supervisor may restart it, automatic recovery
/// leaves the drain alone, and the operator's readmission returns it to placement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_crashing_while_draining_is_readmitted_by_the_operator() {
    let mut lab = lab(
        "individual",
        &["--tpot-ms", "40"],
        json!({"recovery": {"eject_after": 1}}),
    )
    .await;
    let s = Stream::start(&lab, "its decode engine will crash", 30).await;
    let (status, doc) = lab.post("drain", json!({"engines": ["d0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert_eq!(doc["engines"]["d0"]["state"], "draining");
    lab.d0.proc.kill();
    let mut resp = s.resp;
    while let Ok(Some(_)) = resp.chunk().await {}
    lab.journal_event("drain_complete", Some("d0")).await;
    let doc = lab.doc().await;
    assert_eq!(doc["engines"]["d0"]["ready_to_stop"], true, "{doc:#}");
    lab.d0.restart(&[]).expect("supervisor restarts d0");
    // Health answers again, but the drain hold stands until the operator readmits.
    let doc = lab.doc().await;
    assert_eq!(doc["engines"]["d0"]["state"], "drained", "{doc:#}");
    let (status, doc) = lab.post("readmit", json!({"engines": ["d0"]})).await;
    assert_eq!(status, 200, "{doc:#}");
    assert!(!lab.has_event("recovery_validation_started", Some("d0")));
    lab.doc_until("d0 back", |d| d["engines"]["d0"]["accepts_new"] == true)
        .await;
    let before = n(&lab.stats(&lab.d0).await["requests"]["decode"]);
    lab.complete("d0 decodes again").await;
    assert!(n(&lab.stats(&lab.d0).await["requests"]["decode"]) > before);
}

/// The seed's "transient breaker ejection": the engine's process stalls (SIGSTOP), its decode
/// leg misses the first-token deadline (class `stream`) and the breaker ejects it; when it resumes
/// (SIGCONT) the same process is validated through the agents (`process identity`, the start
/// the router accepted at startup) and readmitted without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_engine_is_readmitted_as_the_same_process_after_it_resumes() {
    use nix::sys::signal::Signal;
    let lab = lab(
        "individual",
        &[],
        json!({"recovery": {"eject_after": 1},
               "engine": {"first_token_timeout_s": 0.3, "health_timeout_s": 0.3}}),
    )
    .await;
    let accepted = lab.doc().await["process_starts"]["d0"].as_f64().unwrap();
    lab.d0.proc.signal(Signal::SIGSTOP);
    let _ = lab
        .http
        .post(format!("{}/v1/completions", lab.router.data))
        .json(&json!({"model": "tiny-sim", "prompt": "d0 stalls", "max_tokens": 2}))
        .send()
        .await;
    lab.doc_until("d0 ejected", |d| d["engines"]["d0"]["accepts_new"] == false)
        .await;
    lab.d0.proc.signal(Signal::SIGCONT);
    let ev = lab.journal_event("readmitted", Some("d0")).await;
    assert_eq!(ev["process_start"].as_f64(), Some(accepted), "same process");
    let doc = lab
        .doc_until("d0 back", |d| d["engines"]["d0"]["accepts_new"] == true)
        .await;
    let e = &doc["engines"]["d0"];
    assert_eq!(e["restart_required"], false, "{doc:#}");
    assert!(strs(&e["checks"]).contains(&"process identity".to_string()));
    let m = lab.metrics().await;
    assert!(
        metric(
            &m,
            "narwhal_engine_ejections_total",
            &["iid=\"d0\"", "cause=\"stream\""]
        )
        .is_some_and(|v| v >= 1.0),
        "{m}"
    );
    let before = n(&lab.stats(&lab.d0).await["requests"]["decode"]);
    lab.complete("d0 decodes again").await;
    assert!(n(&lab.stats(&lab.d0).await["requests"]["decode"]) > before);
}
