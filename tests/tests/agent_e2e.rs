//! End-to-end tests of the engine agent (issue 3): real `narwhal-agent` processes with real
//! rcgen certificates in front of real `narwhal-engine-sim` processes, driven through the
//! shared `AgentClient` and `Verifier` exactly as the router will drive them.
//!
//! The agent binary is found with `bin_path("narwhal-agent")`; `cargo test --workspace`
//! builds it (for a single-package run: `cargo build -p narwhal-agent` first).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use narwhal_shared::agent_protocol::FencedRequest;
use narwhal_shared::attestation::{Expected, new_nonce};
use narwhal_shared::tls::client_config_without_cert;
use narwhal_shared::{
    AgentClient, AgentClientError, AgentEndpoint, AgentTimeouts, AttestationPayload, Clock, Fence,
    PublicKey, SystemClock, Verifier, VerifyError,
};
use narwhal_testkit::certs::{DevCerts, make_dev_certs};
use narwhal_testkit::{ChildProc, bin_path, wait_until};
use serde_json::{Value, json};
use tempfile::TempDir;

const START: Duration = Duration::from_secs(30);
const SIM: &str = env!("CARGO_BIN_EXE_narwhal-engine-sim");

fn fence(epoch: u64) -> Fence {
    Fence {
        epoch,
        holder: "router-a".into(),
    }
}

fn plain_http() -> reqwest::Client {
    reqwest::Client::builder()
        .use_preconfigured_tls(narwhal_shared::tls::plain_http_client_config().expect("tls config"))
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http client")
}

/// A running simulator; `restart` brings a new process up on the same port.
struct Sim {
    proc: ChildProc,
    url: String,
    port: u16,
    dialect: String,
    mode: Option<String>,
    dir: PathBuf,
    label: String,
}

impl Sim {
    fn start(dir: &Path, label: &str, dialect: &str, mode: Option<&str>, port: u16) -> Sim {
        let mut cmd = Command::new(SIM);
        cmd.args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--dialect",
            dialect,
            "--model",
            "tiny-sim",
        ]);
        if let Some(m) = mode {
            cmd.args(["--disaggregation-mode", m]);
        }
        let proc = ChildProc::spawn(cmd, label, dir, START).expect("simulator starts");
        let url = proc
            .url_in_first_line(None)
            .expect("simulator prints its URL");
        let port = url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port in URL");
        Sim {
            proc,
            url,
            port,
            dialect: dialect.into(),
            mode: mode.map(str::to_string),
            dir: dir.to_path_buf(),
            label: label.into(),
        }
    }

    fn restart(&mut self) {
        self.proc.kill();
        let next = Sim::start(
            &self.dir,
            &format!("{}-2", self.label),
            &self.dialect,
            self.mode.as_deref(),
            self.port,
        );
        *self = next;
    }

    async fn stats(&self) -> Value {
        plain_http()
            .get(format!("{}/sim/stats", self.url))
            .send()
            .await
            .expect("stats")
            .json()
            .await
            .expect("stats json")
    }
}

/// A running agent and a verified mTLS client for it.
struct Agent {
    proc: ChildProc,
    url: String,
    id: String,
    public_key: PublicKey,
    config: PathBuf,
    client: AgentClient,
}

fn keygen(path: &Path) -> PublicKey {
    let out = Command::new(bin_path("narwhal-agent"))
        .args(["keygen", "--out"])
        .arg(path)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "run {:?} (build it: cargo build -p narwhal-agent): {e}",
                bin_path("narwhal-agent")
            )
        });
    assert!(
        out.status.success(),
        "keygen: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PublicKey::parse(String::from_utf8_lossy(&out.stdout).trim())
        .expect("keygen prints ed25519:<base64>")
}

fn write_agent_config(dir: &Path, certs: &DevCerts, id: &str, engines: &[(&str, &Sim)]) -> PathBuf {
    write_agent_config_with(dir, certs, id, engines, None)
}

fn write_agent_config_with(
    dir: &Path,
    certs: &DevCerts,
    id: &str,
    engines: &[(&str, &Sim)],
    contract_document: Option<&Path>,
) -> PathBuf {
    let name = format!("agent-{id}");
    let key = dir.join(format!("{name}.ed25519.pk8"));
    if !key.exists() {
        keygen(&key);
    }
    let engines: Vec<Value> = engines
        .iter()
        .map(|(iid, sim)| {
            let mut e = json!({"iid": iid, "url": sim.url, "dialect": sim.dialect,
                   "process": {"listen_port": sim.port}});
            if let Some(doc) = contract_document {
                e["contract_document"] = json!(doc);
            }
            e
        })
        .collect();
    let doc = json!({
        "schema": "narwhal.agent-config", "schema_version": 1, "agent_id": id,
        "listen": "127.0.0.1:0",
        "tls": {"ca": certs.ca, "cert": certs.cert(&name), "key": certs.key(&name)},
        "signing_key": key, "state_dir": dir.join(format!("{name}-state")),
        "timeouts": {"engine_s": 5, "generation_s": 20},
        "engines": engines,
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(&doc).expect("json")).expect("write config");
    path
}

fn client_for(certs: &DevCerts, id: &str, url: &str, public_key: PublicKey) -> AgentClient {
    AgentClient::new(
        AgentEndpoint {
            agent_id: id.into(),
            url: url.into(),
            server_name: format!("agent-{id}"),
            public_key,
        },
        &certs.tls_files("router"),
        AgentTimeouts::default(),
        Arc::new(SystemClock),
    )
    .expect("agent client")
}

impl Agent {
    fn start(dir: &Path, certs: &DevCerts, id: &str, config: PathBuf) -> Agent {
        let ready = dir.join(format!("agent-{id}.ready.json"));
        let _ = std::fs::remove_file(&ready);
        let mut cmd = Command::new(bin_path("narwhal-agent"));
        cmd.args(["run", "--config"])
            .arg(&config)
            .arg("--ready-file")
            .arg(&ready);
        let proc = ChildProc::spawn(cmd, &format!("agent-{id}"), dir, START).expect("agent starts");
        assert!(
            proc.first_line
                .starts_with("narwhal-agent listening on https://127.0.0.1:"),
            "first line {:?}",
            proc.first_line
        );
        let url = proc.url_in_first_line(None).expect("agent URL");
        let ready: Value = serde_json::from_slice(&std::fs::read(&ready).expect("ready file"))
            .expect("ready json");
        assert_eq!(ready["url"], url.as_str());
        assert_eq!(ready["pid"], proc.pid());
        assert_eq!(ready["agent_id"], id);
        let public_key =
            PublicKey::parse(ready["public_key"].as_str().expect("public_key")).expect("key");
        let client = client_for(certs, id, &url, public_key);
        Agent {
            proc,
            url,
            id: id.into(),
            public_key,
            config,
            client,
        }
    }
}

struct World {
    dir: TempDir,
    certs: DevCerts,
}

fn world() -> World {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = make_dev_certs(
        &dir.path().join("certs"),
        &["router", "standby", "ctl", "agent-a", "agent-b"],
    )
    .expect("dev certs");
    World { dir, certs }
}

fn now() -> f64 {
    SystemClock.wall().expect("wall clock")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attestation_for_a_running_simulator_verifies() {
    let w = world();
    let sim = Sim::start(w.dir.path(), "sim-e0", "vllm", None, 0);
    let contract_doc = w.dir.path().join("engine-attestation.json");
    std::fs::write(
        &contract_doc,
        json!({"schema": "narwhal.attestation", "schema_version": 1,
               "contract": {"engine_version": "sim", "connector": "NixlConnector", "kv_heads": 8},
               "launch": {"args": ["--model", "tiny-sim"]}})
        .to_string(),
    )
    .expect("contract document");
    let cfg = write_agent_config_with(
        w.dir.path(),
        &w.certs,
        "a",
        &[("e0", &sim)],
        Some(&contract_doc),
    );
    let agent = Agent::start(w.dir.path(), &w.certs, "a", cfg);

    let health = agent.client.health().await.expect("health");
    assert_eq!(health["agent_id"], "a");
    let engines = agent.client.engines().await.expect("engines");
    assert_eq!(engines.engines.len(), 1);
    let listed = engines.engines[0].process.clone().expect("identity listed");
    assert_eq!(listed.pid, sim.proc.pid());

    let att = agent
        .client
        .attestation("e0", &fence(1), None)
        .await
        .expect("attestation verifies");
    let p = &att.payload;
    assert_eq!(p.header.iid, "e0");
    assert_eq!(p.header.agent_id, "a");
    assert_eq!(p.header.epoch, 1);
    assert_eq!(p.process_pid(), sim.proc.pid());
    assert_eq!(p.header.process.listen_port, Some(sim.port));
    assert!(
        p.header.process.exe.ends_with("narwhal-engine-sim"),
        "{}",
        p.header.process.exe
    );
    assert!(p.header.process.start_ticks > 0);
    assert!((p.header.process.process_start_time_seconds - now()).abs() < 600.0);
    assert_eq!(p.engine.dialect, "vllm");
    assert!(!p.engine.version.is_empty());
    assert!(
        p.engine.models.iter().any(|m| m == "tiny-sim"),
        "{:?}",
        p.engine.models
    );
    assert!(p.header.process.same_process(&listed));
    // The host contract document is attested, with its launch digest.
    let attested = p.contract.as_ref().expect("contract attested");
    assert_eq!(attested["connector"], "NixlConnector");
    assert!(
        p.launch_digest
            .as_deref()
            .is_some_and(|d| d.starts_with("sha256:"))
    );
    let declared = json!({"connector": "NixlConnector", "kv_heads": 8});
    narwhal_shared::attestation::check_contract(
        p.contract.as_ref(),
        declared.as_object().expect("object"),
    )
    .expect("contract matches");
    let other = json!({"kv_heads": 4});
    assert!(matches!(
        narwhal_shared::attestation::check_contract(
            p.contract.as_ref(),
            other.as_object().expect("object")
        ),
        Err(VerifyError::ContractMismatch { .. })
    ));

    // The unsigned process route agrees, and an unknown engine is a 404 naming it.
    let process = agent.client.process("e0").await.expect("process");
    assert!(process.same_process(&p.header.process));
    match agent.client.attestation("nope", &fence(1), None).await {
        Err(AgentClientError::Status {
            status: 404, code, ..
        }) => assert_eq!(code, "unknown_engine"),
        other => panic!("expected 404 unknown_engine, got {other:?}"),
    }

    // A malformed body is a 400 naming the field; nothing is signed for it.
    let bad_body = json!({"nonce": "n", "epoch": 1, "holder": "router-a", "model": 7});
    match agent
        .client
        .post_raw("/v1/engines/e0/checks/generation", &bad_body, 1)
        .await
    {
        Err(AgentClientError::Status {
            status: 400,
            code,
            message,
            ..
        }) => {
            assert_eq!(code, "bad_request");
            assert!(message.contains("model"), "{message}");
        }
        other => panic!("expected 400 bad_request, got {other:?}"),
    }

    // Generation check: at least one token, signed.
    let g = agent
        .client
        .generation_check("e0", &fence(1), "tiny-sim")
        .await
        .expect("generation");
    assert!(g.payload.result.ok, "{:?}", g.payload.result);
    assert!(g.payload.result.tokens >= 1);
    let bad = agent
        .client
        .generation_check("e0", &fence(1), "no-such-model")
        .await
        .expect("signed failure");
    assert!(!bad.payload.result.ok);
    assert!(bad.payload.result.error.is_some());
    let _ = &agent.url;
    let _ = &agent.config;

    // SIGTERM (systemd stop) ends the agent cleanly.
    let mut agent = agent;
    agent.proc.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(agent.proc.wait_exit(Duration::from_secs(10)), Some(0));
}

trait Pid {
    fn process_pid(&self) -> u32;
}
impl Pid for AttestationPayload {
    fn process_pid(&self) -> u32 {
        self.header.process.pid
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_the_simulator_changes_the_identity_and_the_old_attestation_no_longer_matches() {
    let w = world();
    let mut sim = Sim::start(w.dir.path(), "sim-e0", "vllm", None, 0);
    let cfg = write_agent_config(w.dir.path(), &w.certs, "a", &[("e0", &sim)]);
    let agent = Agent::start(w.dir.path(), &w.certs, "a", cfg);
    let before = agent
        .client
        .attestation("e0", &fence(1), None)
        .await
        .expect("attestation");
    let old = before.payload.header.process.clone();
    // Bound to the same process: still verifies.
    agent
        .client
        .attestation("e0", &fence(1), Some(&old))
        .await
        .expect("same process");

    let old_pid = sim.proc.pid();
    sim.restart();
    assert_ne!(sim.proc.pid(), old_pid);
    match agent.client.attestation("e0", &fence(1), Some(&old)).await {
        Err(AgentClientError::Verify {
            source:
                VerifyError::ProcessChanged {
                    expected_pid,
                    found_pid,
                    ..
                },
            ..
        }) => {
            assert_eq!(expected_pid, old_pid);
            assert_eq!(found_pid, sim.proc.pid());
        }
        other => panic!("expected ProcessChanged, got {other:?}"),
    }
    let after = agent
        .client
        .attestation("e0", &fence(1), None)
        .await
        .expect("new attestation");
    assert!(!after.payload.header.process.same_process(&old));
    assert_eq!(after.payload.header.process.pid, sim.proc.pid());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_wrong_key_replayed_stale_and_lower_epoch_answers_are_each_rejected() {
    let w = world();
    let sim = Sim::start(w.dir.path(), "sim-e0", "vllm", None, 0);
    let cfg = write_agent_config(w.dir.path(), &w.certs, "a", &[("e0", &sim)]);
    let agent = Agent::start(w.dir.path(), &w.certs, "a", cfg.clone());

    let nonce = new_nonce();
    let req = FencedRequest {
        nonce: nonce.clone(),
        epoch: 5,
        holder: "router-a".into(),
    };
    let doc = agent
        .client
        .post_raw("/v1/engines/e0/attestation", &req, 5)
        .await
        .expect("raw attestation");
    let expected = Expected {
        agent_id: Some("a"),
        iid: "e0",
        nonce: &nonce,
        epoch: 5,
        holder: "router-a",
        process: None,
    };
    let t = now();

    // Tampered payload: the signature no longer covers it.
    let mut tampered = doc.clone();
    tampered.payload["engine"]["version"] = json!("9.9.9-evil");
    let v = Verifier::new(agent.public_key, 30.0);
    assert_eq!(
        v.verify::<AttestationPayload>(&tampered, &expected, t)
            .unwrap_err(),
        VerifyError::BadSignature
    );
    // Wrong key: a verifier pinned to another agent's key.
    let other_key = keygen(&w.dir.path().join("other.pk8"));
    let wrong = Verifier::new(other_key, 30.0);
    assert!(matches!(
        wrong.verify::<AttestationPayload>(&doc, &expected, t),
        Err(VerifyError::WrongKey { .. })
    ));
    // Stale issued_at: the same answer checked past the freshness window.
    let issued_at = doc.payload["issued_at"].as_f64().expect("issued_at");
    assert!(matches!(
        v.verify::<AttestationPayload>(&doc, &expected, issued_at + 31.0),
        Err(VerifyError::Stale { .. })
    ));
    // Genuine and fresh: accepted once ...
    v.verify::<AttestationPayload>(&doc, &expected, t)
        .expect("genuine answer verifies");
    // ... and a replay of it is refused, whether the router reuses the nonce or not.
    assert_eq!(
        v.verify::<AttestationPayload>(&doc, &expected, t)
            .unwrap_err(),
        VerifyError::NonceReplayed {
            nonce: nonce.clone()
        }
    );
    let fresh = new_nonce();
    let expected_fresh = Expected {
        nonce: &fresh,
        ..expected.clone()
    };
    assert!(matches!(
        v.verify::<AttestationPayload>(&doc, &expected_fresh, t),
        Err(VerifyError::NonceMismatch { .. })
    ));

    // Lower epoch: 409 stale_epoch from the agent, and the fence survives an agent restart.
    agent
        .client
        .attestation("e0", &fence(5), None)
        .await
        .expect("epoch 5");
    match agent.client.attestation("e0", &fence(4), None).await {
        Err(AgentClientError::StaleEpoch {
            sent: 4,
            highest: Some(5),
            ..
        }) => {}
        other => panic!("expected stale_epoch, got {other:?}"),
    }
    let Agent { mut proc, .. } = agent;
    proc.kill();
    let agent = Agent::start(w.dir.path(), &w.certs, "a", cfg);
    match agent
        .client
        .generation_check("e0", &fence(4), "tiny-sim")
        .await
    {
        Err(AgentClientError::StaleEpoch {
            highest: Some(5), ..
        }) => {}
        other => panic!("expected stale_epoch after restart, got {other:?}"),
    }
    // Same epoch from another holder is refused too; a higher epoch is accepted.
    let other = Fence {
        epoch: 5,
        holder: "router-b".into(),
    };
    match agent.client.attestation("e0", &other, None).await {
        Err(AgentClientError::Status {
            status: 409, code, ..
        }) => assert_eq!(code, "holder_conflict"),
        other => panic!("expected holder_conflict, got {other:?}"),
    }
    agent
        .client
        .attestation(
            "e0",
            &Fence {
                epoch: 6,
                holder: "router-b".into(),
            },
            None,
        )
        .await
        .expect("higher epoch accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_from_another_ca_or_without_a_certificate_are_refused_at_the_tls_layer() {
    let w = world();
    let other = make_dev_certs(&w.dir.path().join("other-ca"), &["router"]).expect("other CA");
    let sim = Sim::start(w.dir.path(), "sim-e0", "vllm", None, 0);
    let cfg = write_agent_config(w.dir.path(), &w.certs, "a", &[("e0", &sim)]);
    let agent = Agent::start(w.dir.path(), &w.certs, "a", cfg);
    let endpoint = AgentEndpoint {
        agent_id: "a".into(),
        url: agent.url.clone(),
        server_name: "agent-a".into(),
        public_key: agent.public_key,
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);

    // Foreign CA: trusts our CA for the server, presents a certificate from another CA.
    let foreign = narwhal_shared::TlsFiles {
        ca: w.certs.ca.clone(),
        cert: other.cert("router"),
        key: other.key("router"),
    };
    let c = AgentClient::with_tls_config(
        endpoint.clone(),
        foreign.client_config().expect("cfg"),
        AgentTimeouts::default(),
        clock.clone(),
    )
    .expect("client");
    assert!(matches!(
        c.health().await,
        Err(AgentClientError::Transport { .. })
    ));
    // No client certificate at all.
    let none = AgentClient::with_tls_config(
        endpoint.clone(),
        client_config_without_cert(&w.certs.ca).expect("cfg"),
        AgentTimeouts::default(),
        clock.clone(),
    )
    .expect("client");
    assert!(matches!(
        none.engines().await,
        Err(AgentClientError::Transport { .. })
    ));
    // The agent logged both as refused handshakes (not as HTTP errors).
    let log = agent.proc.stderr_log.clone();
    let refused = wait_until(Duration::from_secs(10), || {
        let log = log.clone();
        async move {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            (text.matches("TLS handshake refused").count() >= 2).then_some(())
        }
    })
    .await;
    assert!(
        refused.is_some(),
        "agent log:\n{}",
        agent.proc.stderr_tail(20)
    );
    // The router checks the agent's name: agent-a's certificate is not valid for agent-b.
    let misnamed = AgentClient::new(
        AgentEndpoint {
            server_name: "agent-b".into(),
            ..endpoint
        },
        &w.certs.tls_files("router"),
        AgentTimeouts::default(),
        clock,
    )
    .expect("client");
    assert!(matches!(
        misnamed.health().await,
        Err(AgentClientError::Transport { .. })
    ));
    // Plain HTTP to the agent port gets no HTTP answer.
    let plain = plain_http()
        .get(agent.url.replace("https://", "http://") + "/health")
        .send()
        .await;
    assert!(plain.is_err() || !plain.expect("response").status().is_success());
    // And the properly configured router client still works.
    agent.client.health().await.expect("router client accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_kv_check_between_two_simulators_through_two_agents_passes_and_fails_after_a_producer_restart()
 {
    let w = world();
    let mut p = Sim::start(w.dir.path(), "sim-p0", "vllm", None, 0);
    let d = Sim::start(w.dir.path(), "sim-d0", "vllm", None, 0);
    let cfg_a = write_agent_config(w.dir.path(), &w.certs, "a", &[("p0", &p)]);
    let cfg_b = write_agent_config(w.dir.path(), &w.certs, "b", &[("d0", &d)]);
    let a = Agent::start(w.dir.path(), &w.certs, "a", cfg_a);
    let b = Agent::start(w.dir.path(), &w.certs, "b", cfg_b);

    let before = d.stats().await;
    let produced = a
        .client
        .kv_produce("p0", &fence(1), "tiny-sim", "chk-1")
        .await
        .expect("produce");
    assert!(produced.payload.result.ok, "{:?}", produced.payload.result);
    let kv = produced.payload.kv.clone().expect("descriptor");
    assert_eq!(kv["do_remote_prefill"], true);
    assert!(
        kv["remote_engine_id"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );
    let consumed = b
        .client
        .kv_consume("d0", &fence(1), "tiny-sim", "chk-1", kv)
        .await
        .expect("consume");
    let r = &consumed.payload;
    assert!(r.result.ok, "{:?}", r.result);
    assert!(r.result.tokens >= 1);
    assert_eq!(r.transfer.source, "sim_stats");
    assert_eq!(r.transfer.transferred, Some(true), "{:?}", r.transfer);
    assert_eq!(
        r.transfer.engine_phase.as_deref(),
        Some("decode"),
        "{:?}",
        r.transfer
    );
    let after = d.stats().await;
    assert!(after["kv"]["consumed"].as_i64() > before["kv"]["consumed"].as_i64());
    assert_eq!(after["kv"]["recomputed"], before["kv"]["recomputed"]);

    // Producer restarts between the two halves: the consumer half fails, signed.
    let produced = a
        .client
        .kv_produce("p0", &fence(1), "tiny-sim", "chk-2")
        .await
        .expect("produce");
    let kv = produced.payload.kv.clone().expect("descriptor");
    p.restart();
    let consumed = b
        .client
        .kv_consume("d0", &fence(1), "tiny-sim", "chk-2", kv)
        .await
        .expect("signed consume result");
    assert!(!consumed.payload.result.ok, "{:?}", consumed.payload.result);
    assert!(consumed.payload.result.error.is_some());
    assert_ne!(consumed.payload.transfer.transferred, Some(true));
    // The restarted producer is a different engine to the agent as well.
    let att = a
        .client
        .attestation("p0", &fence(1), Some(&produced.payload.header.process))
        .await;
    assert!(matches!(
        att,
        Err(AgentClientError::Verify {
            source: VerifyError::ProcessChanged { .. },
            ..
        })
    ));

    // A probe of the consumer from a handed-in producer handle, and a standalone probe.
    let fresh = a
        .client
        .kv_produce("p0", &fence(1), "tiny-sim", "chk-3")
        .await
        .expect("produce");
    let probe = b
        .client
        .probe(
            "d0",
            &fence(1),
            "tiny-sim",
            Some(narwhal_shared::agent_protocol::ProbeProducer::Kv(
                fresh.payload.kv.clone().expect("kv"),
            )),
            Some("chk-3"),
        )
        .await
        .expect("probe");
    assert!(probe.payload.ok, "{:?}", probe.payload);
    assert_eq!(probe.payload.transfer.transferred, Some(true));
    let alone = b
        .client
        .probe("d0", &fence(1), "tiny-sim", None, None)
        .await
        .expect("standalone probe");
    assert!(alone.payload.ok, "{:?}", alone.payload);
    assert_eq!(alone.payload.mode, "standalone");
    let _ = (&a.id, &b.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_kv_check_through_two_agents_uses_the_bootstrap_rendezvous() {
    let w = world();
    let p = Sim::start(w.dir.path(), "sim-p0", "sglang", Some("prefill"), 0);
    let d = Sim::start(w.dir.path(), "sim-d0", "sglang", Some("decode"), 0);
    let a = Agent::start(
        w.dir.path(),
        &w.certs,
        "a",
        write_agent_config(w.dir.path(), &w.certs, "a", &[("p0", &p)]),
    );
    let b = Agent::start(
        w.dir.path(),
        &w.certs,
        "b",
        write_agent_config(w.dir.path(), &w.certs, "b", &[("d0", &d)]),
    );

    let att = a
        .client
        .attestation("p0", &fence(1), None)
        .await
        .expect("attestation");
    assert_eq!(att.payload.engine.dialect, "sglang");
    assert!(att.payload.engine.bootstrap_port.is_some());
    let before = d.stats().await;
    let produced = a
        .client
        .kv_produce("p0", &fence(1), "tiny-sim", "s-1")
        .await
        .expect("produce");
    assert!(produced.payload.result.ok, "{:?}", produced.payload.result);
    let kv = produced.payload.kv.clone().expect("rendezvous");
    assert_eq!(
        kv["bootstrap_port"].as_u64(),
        att.payload.engine.bootstrap_port.map(u64::from)
    );
    let consumed = b
        .client
        .kv_consume("d0", &fence(1), "tiny-sim", "s-1", kv)
        .await
        .expect("consume");
    assert!(consumed.payload.result.ok, "{:?}", consumed.payload.result);
    assert_eq!(consumed.payload.transfer.transferred, Some(true));
    assert_eq!(
        consumed.payload.transfer.engine_phase.as_deref(),
        Some("decode")
    );
    let after = d.stats().await;
    assert!(after["kv"]["consumed"].as_i64() > before["kv"]["consumed"].as_i64());
    assert_eq!(after["kv"]["recomputed"], before["kv"]["recomputed"]);

    // Standalone probe on SGLang: no rendezvous, a local decode only.
    let alone = b
        .client
        .probe("d0", &fence(1), "tiny-sim", None, None)
        .await
        .expect("probe");
    assert!(alone.payload.ok, "{:?}", alone.payload);
    assert!(alone.payload.produce.is_none());
    // A probe of the decoder fed by the prefill engine's rendezvous, produced by agent a.
    let fresh = a
        .client
        .kv_produce("p0", &fence(1), "tiny-sim", "s-2")
        .await
        .expect("produce");
    let fed = b
        .client
        .probe(
            "d0",
            &fence(1),
            "tiny-sim",
            Some(narwhal_shared::agent_protocol::ProbeProducer::Kv(
                fresh.payload.kv.clone().expect("kv"),
            )),
            Some("s-2"),
        )
        .await
        .expect("probe");
    assert!(fed.payload.ok, "{:?}", fed.payload);
    assert_eq!(fed.payload.transfer.transferred, Some(true));
}

fn vm_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("VmRSS")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_resident_memory_with_eight_engines_is_small() {
    let w = world();
    let sims: Vec<Sim> = (0..8)
        .map(|i| Sim::start(w.dir.path(), &format!("sim-e{i}"), "vllm", None, 0))
        .collect();
    let iids: Vec<String> = (0..8).map(|i| format!("e{i}")).collect();
    let engines: Vec<(&str, &Sim)> = iids.iter().map(String::as_str).zip(sims.iter()).collect();
    let cfg = write_agent_config(w.dir.path(), &w.certs, "a", &engines);
    let agent = Agent::start(w.dir.path(), &w.certs, "a", cfg);
    let listed = agent.client.engines().await.expect("engines");
    assert_eq!(listed.engines.len(), 8);
    assert!(
        listed.engines.iter().all(|e| e.process.is_some()),
        "{listed:?}"
    );
    for iid in &iids {
        agent
            .client
            .attestation(iid, &fence(1), None)
            .await
            .expect("attestation");
    }
    let rss = vm_rss_kib(agent.proc.pid());
    println!(
        "narwhal-agent idle VmRSS with 8 engines: {rss} KiB ({:.1} MiB)",
        rss as f64 / 1024.0
    );
    // Target is 15 MiB (issue 3); debug builds carry more, so the gate here is looser.
    assert!(rss < 40 * 1024, "VmRSS {rss} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_of_a_suspect_can_decode_from_a_named_local_producer() {
    let w = world();
    let p = Sim::start(w.dir.path(), "sim-p0", "vllm", None, 0);
    let d = Sim::start(w.dir.path(), "sim-d0", "vllm", None, 0);
    let cfg = write_agent_config(w.dir.path(), &w.certs, "a", &[("p0", &p), ("d0", &d)]);
    let agent = Agent::start(w.dir.path(), &w.certs, "a", cfg);
    let before = d.stats().await;
    let probe = agent
        .client
        .probe(
            "d0",
            &fence(1),
            "tiny-sim",
            Some(narwhal_shared::agent_protocol::ProbeProducer::Iid(
                "p0".into(),
            )),
            None,
        )
        .await
        .expect("probe");
    assert!(probe.payload.ok, "{:?}", probe.payload);
    assert_eq!(probe.payload.mode, "from_producer");
    assert!(probe.payload.produce.as_ref().is_some_and(|l| l.ok));
    assert_eq!(probe.payload.transfer.transferred, Some(true));
    let after = d.stats().await;
    assert!(after["kv"]["consumed"].as_i64() > before["kv"]["consumed"].as_i64());
    // An unknown producer is a 404 naming it.
    match agent
        .client
        .probe(
            "d0",
            &fence(1),
            "tiny-sim",
            Some(narwhal_shared::agent_protocol::ProbeProducer::Iid(
                "zz".into(),
            )),
            None,
        )
        .await
    {
        Err(AgentClientError::Status {
            status: 404,
            message,
            ..
        }) => assert!(message.contains("zz"), "{message}"),
        other => panic!("expected 404, got {other:?}"),
    }
}
