//! The `narwhal-agent` binary serving over mutual TLS in front of a fake vLLM engine that
//! runs inside this test process (so the engine's process identity is this process).
//! architecture.md section 4.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::routing::{get, post};
use narwhal_shared::agent_protocol::AgentReadyFile;
use narwhal_shared::{
    AgentClient, AgentClientError, AgentEndpoint, AgentTimeouts, Fence, PublicKey, SystemClock,
    TlsFiles,
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};
use serde_json::{Value, json};

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn certs(dir: &Path) -> (TlsFiles, TlsFiles) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name.push(DnType::CommonName, "test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let mut files = Vec::new();
    for name in ["agent-t", "router"] {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec![name.to_string(), "127.0.0.1".into()]).unwrap();
        // Fenced calls need a router identity (docs/security.md, "Identities").
        let role = if name == "router" { "router" } else { "agent" };
        p.subject_alt_names.push(SanType::URI(
            format!("spiffe://narwhal/{role}/{name}")
                .try_into()
                .unwrap(),
        ));
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = p.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
        files.push(TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        });
    }
    let router = files.pop().unwrap();
    let agent = files.pop().unwrap();
    (agent, router)
}

/// A fake vLLM: `/version`, `/v1/models`, `/v1/completions` (non-streaming, 1 token).
async fn fake_vllm() -> u16 {
    let app = axum::Router::new()
        .route(
            "/version",
            get(|| async { Json(json!({"version": "0.0.0-fake"})) }),
        )
        .route(
            "/v1/models",
            get(|| async { Json(json!({"object": "list", "data": [{"id": "fake-model"}]})) }),
        )
        .route(
            "/v1/completions",
            post(|Json(body): Json<ModelOnly>| async move {
                if body.model.as_deref() != Some("fake-model") {
                    return (
                        axum::http::StatusCode::NOT_FOUND,
                        Json(json!({"error": {"message": "no such model"}})),
                    );
                }
                (
                    axum::http::StatusCode::OK,
                    Json(json!({"choices": [{"index": 0, "text": "x"}],
                                "usage": {"completion_tokens": 1}})),
                )
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_attests_and_checks_a_local_engine_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (agent_tls, router_tls) = certs(dir.path());
    let port = fake_vllm().await;
    let key = dir.path().join("k.pk8");
    narwhal_agent::keygen(&key, false).unwrap();
    let cfg = dir.path().join("agent.json");
    std::fs::write(
        &cfg,
        json!({"schema": "narwhal.agent-config", "schema_version": 1, "agent_id": "t",
               "listen": "127.0.0.1:0", "tls": agent_tls, "signing_key": key,
               "state_dir": dir.path().join("state"),
               "engines": [{"iid": "e0", "url": format!("http://127.0.0.1:{port}"),
                            "dialect": "vllm"}]})
        .to_string(),
    )
    .unwrap();
    let ready = dir.path().join("ready.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_narwhal-agent"))
        .args(["run", "--config"])
        .arg(&cfg)
        .arg("--ready-file")
        .arg(&ready)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let child = Killed(child);
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        line
    });
    let line = tokio::time::timeout(Duration::from_secs(30), line)
        .await
        .expect("agent announces itself")
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("narwhal-agent listening on ")
        .expect("first line shape")
        .to_string();
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    let ready: AgentReadyFile = serde_json::from_slice(&std::fs::read(&ready).unwrap()).unwrap();
    assert_eq!(ready.url, url);
    assert_eq!(ready.pid, child.0.id());
    assert_eq!(ready.agent_id, "t");
    let public_key = PublicKey::parse(&ready.public_key).unwrap();

    let client = AgentClient::new(
        AgentEndpoint {
            agent_id: "t".into(),
            url,
            server_name: "agent-t".into(),
            public_key,
        },
        &router_tls,
        AgentTimeouts::default(),
        Arc::new(SystemClock),
    )
    .unwrap();
    let fence = Fence {
        epoch: 3,
        holder: "r".into(),
    };
    let att = client.attestation("e0", &fence, None).await.unwrap();
    // The fake engine runs in this process, so the agent must have found us by the port.
    assert_eq!(att.payload.header.process.pid, std::process::id());
    assert_eq!(att.payload.header.process.listen_port, Some(port));
    assert_eq!(att.payload.engine.version, "0.0.0-fake");
    assert_eq!(att.payload.engine.models, vec!["fake-model".to_string()]);
    assert!(att.payload.contract.is_none());

    let g = client
        .generation_check("e0", &fence, "fake-model")
        .await
        .unwrap();
    assert!(g.payload.result.ok, "{:?}", g.payload.result);
    assert_eq!(g.payload.result.tokens, 1);
    let bad = client
        .generation_check("e0", &fence, "other")
        .await
        .unwrap();
    assert!(!bad.payload.result.ok);
    assert!(
        bad.payload
            .result
            .error
            .as_deref()
            .unwrap_or("")
            .contains("404")
    );

    let stale = Fence {
        epoch: 2,
        holder: "r".into(),
    };
    assert!(matches!(
        client.attestation("e0", &stale, None).await,
        Err(AgentClientError::StaleEpoch {
            highest: Some(3),
            ..
        })
    ));
    let fence_file: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("state/fence.json")).unwrap())
            .unwrap();
    assert_eq!(fence_file, json!({"epoch": 3, "holder": "r"}));
    drop(child);
}

/// The member of a completion request the fake engine checks.
#[derive(Debug, serde::Deserialize)]
struct ModelOnly {
    /// The model asked for.
    model: Option<String>,
}
