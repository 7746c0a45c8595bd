//! Who may call an agent, the agent's `/metrics` and fence reset (docs/agent.md), and the cached
//! engine identity across a restart, against the real `narwhal-agent` and `narwhal-serve`
//! binaries over mutual TLS on loopback.
//!
//! Identities are URI SANs `spiffe://narwhal/<role>/<id>` (docs/security.md, "Identities"):
//! only a router may present an epoch or run checks; an operator may read; a fleet-CA
//! certificate with no recognised identity may do nothing.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use narwhal_shared::agent_protocol::{ErrorBody, ErrorDetail, FenceShown};
use narwhal_shared::attestation::AttestationPayload;
use narwhal_shared::documents::requests::DrainBody;
use narwhal_shared::{ProcessIdentity, SignedDocument};
use narwhal_testkit::certs::{DevCerts, DevRole, make_certs};
use narwhal_testkit::{
    AgentHandle, EngineSpec, FleetSpec, bin_path, client_as, get_text as get, post_json as post,
    start_agent, start_router, start_sim, wait_until,
};
use serde_json::{Value, json};

fn certs(dir: &Path) -> DevCerts {
    make_certs(
        &dir.join("certs"),
        &[
            ("router", DevRole::Router),
            ("ctl", DevRole::Operator),
            ("agent-h0", DevRole::Agent),
            ("agent-h1", DevRole::Agent),
            ("someone", DevRole::Unrecognised),
        ],
    )
    .expect("certs")
}

/// An agent's `GET /v1/engines/<iid>/process` answer, typed.
#[track_caller]
fn identity(body: &Value) -> ProcessIdentity {
    serde_json::from_value(body.clone())
        .unwrap_or_else(|e| panic!("not a process identity ({e}): {body}"))
}

/// The value of the sample whose line starts with `prefix` (name and labels).
fn sample(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The five fenced routes of engine `iid`, with bodies carrying `epoch`.
fn fenced_calls(base: &str, iid: &str, epoch: u64) -> Vec<(String, Value)> {
    let f = json!({"nonce": "authz-e2e", "epoch": epoch, "holder": "not-a-router"});
    let with = |extra: Value| {
        let mut b = f.clone();
        if let (Value::Object(b), Value::Object(e)) = (&mut b, extra) {
            b.extend(e);
        }
        b
    };
    vec![
        (format!("{base}/v1/engines/{iid}/attestation"), f.clone()),
        (
            format!("{base}/v1/engines/{iid}/checks/generation"),
            with(json!({"model": "tiny-sim"})),
        ),
        (
            format!("{base}/v1/engines/{iid}/checks/kv/produce"),
            with(json!({"model": "tiny-sim", "check_id": "c1"})),
        ),
        (
            format!("{base}/v1/engines/{iid}/checks/kv/consume"),
            with(json!({"model": "tiny-sim", "check_id": "c1", "kv": {}})),
        ),
        (
            format!("{base}/v1/engines/{iid}/probe"),
            with(json!({"model": "tiny-sim"})),
        ),
    ]
}

/// An operator certificate presenting a higher epoch is refused 403 on every fenced route, the
/// agent's fence does not move, and the router keeps controlling the fleet (a drain, which goes
/// through the agent, still succeeds). A router certificate is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_certificate_cannot_fence_the_routers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = certs(dir.path());
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
    ];
    let a0 = start_agent(dir.path(), &certs, "h0", &[&sims[0]]).expect("agent h0");
    let a1 = start_agent(dir.path(), &certs, "h1", &[&sims[1]]).expect("agent h1");
    let spec = FleetSpec::for_sims("vllm", &sims)
        .tls(&certs, "router")
        .agent("p0", &a0)
        .agent("d0", &a1)
        .with(
            json!({"lease": {"backend": "file", "path": dir.path().join("router.lease"),
                               "ttl_s": 10, "renew_interval_s": 1, "safety_margin_s": 1}}),
        );
    // The router presents its router certificate to the agents (fleet `tls.cert`); its startup
    // identity check is fenced, so the agents know its epoch and holder once it is up.
    let router =
        start_router(dir.path(), "router", &spec, &["--router-id", "router-a"]).expect("router");
    let before = fence(&a0);
    assert!(before.holder.starts_with("router-a"), "{before:?}");
    let router_epoch = before.epoch;
    assert!(router_epoch >= 1, "{before:?}");

    let operator = client_as(&certs, "ctl");
    for (url, body) in fenced_calls(&a0.url, "p0", router_epoch + 100) {
        let (status, answer) = post(&operator, url.clone(), body).await;
        assert_eq!(status, 403, "{url}: {answer}");
        let error = agent_error(&answer);
        assert_eq!(error.code, "forbidden", "{answer}");
        assert_eq!(
            error.rule.as_deref(),
            Some("router_identity_required"),
            "{answer}"
        );
        let message = error.message.as_str();
        assert!(
            message.contains("spiffe://narwhal/operator/ctl"),
            "names the caller: {message}"
        );
    }
    assert_eq!(fence(&a0), before, "the operator moved the fence");
    // The operator may read: its own view of the fence says the same.
    let (status, metrics) = get(&operator, format!("{}/metrics", a0.url)).await;
    assert_eq!(status, 200, "{metrics}");
    assert_eq!(
        sample(&metrics, "narwhal_agent_fence_epoch "),
        Some(router_epoch as f64),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "narwhal_agent_forbidden_total{rule=\"router_identity_required\",role=\"operator\"}"
        ),
        Some(5.0),
        "{metrics}"
    );

    // The router is not fenced: it is ready and a drain (an agent call with its epoch) works.
    let http = client_as(&certs, "router");
    let (status, ready) = get(&http, format!("{}/ready", router.control)).await;
    assert_eq!(status, 200, "{ready}");
    let (status, drained) = router.drain(&DrainBody::engine("p0", 30.0)).await;
    assert_eq!(
        status, 200,
        "drain after the operator's attempt: {drained:#?}"
    );
    assert_eq!(fence(&a0), before);

    // Control: the same call with the router's certificate and a higher epoch is accepted and
    // raises the fence (on the other agent, so this router's own agent stays untouched above).
    let (status, att) = a1
        .attest(
            &http,
            "d0",
            "authz-e2e-router",
            router_epoch + 100,
            "router-z",
        )
        .await;
    assert_eq!(status, 200, "{att}");
    let signed: SignedDocument = serde_json::from_value(att.clone())
        .unwrap_or_else(|e| panic!("not a signed document ({e}): {att}"));
    let payload: AttestationPayload = serde_json::from_value(signed.payload)
        .unwrap_or_else(|e| panic!("not an attestation ({e}): {att}"));
    assert_eq!(payload.header.epoch, router_epoch + 100, "{att}");
    assert_eq!(fence(&a1).epoch, router_epoch + 100);
}

/// Reads take a router or operator identity; a fleet-CA certificate with no recognised identity
/// (or an agent's own certificate) is refused everything, with the rule named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_need_a_router_or_operator_identity_and_unrecognised_certificates_get_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = certs(dir.path());
    let sim = start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0");
    let agent = start_agent(dir.path(), &certs, "h0", &[&sim]).expect("agent");
    let reads = [
        format!("{}/health", agent.url),
        format!("{}/v1/engines", agent.url),
        format!("{}/v1/engines/p0/process", agent.url),
        format!("{}/metrics", agent.url),
    ];
    for who in ["router", "ctl"] {
        let c = client_as(&certs, who);
        for url in &reads {
            let (status, body) = get(&c, url.clone()).await;
            assert_eq!(status, 200, "{who} {url}: {body}");
        }
    }
    for who in ["someone", "agent-h1"] {
        let c = client_as(&certs, who);
        for url in &reads {
            let (status, body) = get(&c, url.clone()).await;
            assert_eq!(status, 403, "{who} {url}: {body}");
            let body: ErrorBody = serde_json::from_str(&body).expect("the agent's error body");
            assert_eq!(
                body.error.rule.as_deref(),
                Some("fleet_identity_required"),
                "{body:?}"
            );
        }
        for (url, body) in fenced_calls(&agent.url, "p0", 1) {
            let (status, answer) = post(&c, url.clone(), body).await;
            assert_eq!(status, 403, "{who} {url}: {answer}");
            assert_eq!(
                agent_error(&answer).rule.as_deref(),
                Some("router_identity_required")
            );
        }
    }
    // Nothing above touched the fence; the router's first call raises it.
    assert!(!agent.state_dir().join("fence.json").exists());
    let router = client_as(&certs, "router");
    let (status, att) = agent.attest(&router, "p0", "n1", 1, "router").await;
    assert_eq!(status, 200, "{att}");
    let (_, metrics) = get(&router, format!("{}/metrics", agent.url)).await;
    for (prefix, want) in [
        (
            "narwhal_agent_forbidden_total{rule=\"fleet_identity_required\",role=\"none\"}",
            4.0,
        ),
        (
            "narwhal_agent_forbidden_total{rule=\"router_identity_required\",role=\"agent\"}",
            5.0,
        ),
        (
            "narwhal_agent_checks_total{kind=\"attestation\",outcome=\"ok\"}",
            1.0,
        ),
        (
            "narwhal_agent_checks_total{kind=\"attestation\",outcome=\"forbidden\"}",
            2.0,
        ),
        ("narwhal_agent_fence_epoch ", 1.0),
    ] {
        assert_eq!(sample(&metrics, prefix), Some(want), "{prefix}\n{metrics}");
    }
    let serving = sample(
        &metrics,
        "narwhal_agent_certificate_expiry_seconds{cert=\"serving\"}",
    )
    .expect("serving cert expiry");
    assert!(serving > 86_400.0, "{serving}");
    assert!(
        sample(
            &metrics,
            "narwhal_agent_certificate_expiry_seconds{cert=\"ca\"}"
        )
        .is_some()
    );
    assert!(
        metrics.contains("narwhal_agent_build_info{version=\""),
        "{metrics}"
    );
}

/// After the first read the agent re-checks the cached process instead of scanning; a restarted
/// engine on the same port is read as the new process, never the old identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_never_answered_from_the_identity_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = certs(dir.path());
    let mut sim = start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0");
    let agent = start_agent(dir.path(), &certs, "h0", &[&sim]).expect("agent");
    let c = client_as(&certs, "router");
    let process = format!("{}/v1/engines/p0/process", agent.url);
    let read = |c: reqwest::Client, url: String| async move {
        let (status, body) = get(&c, url).await;
        (
            status,
            serde_json::from_str::<Value>(&body).unwrap_or(Value::Null),
        )
    };
    let (status, first) = read(c.clone(), process.clone()).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(identity(&first).pid, sim.proc.pid());
    for _ in 0..3 {
        let (status, again) = read(c.clone(), process.clone()).await;
        assert_eq!((status, &again), (200, &first));
    }
    let (_, metrics) = get(&c, format!("{}/metrics", agent.url)).await;
    assert_eq!(
        sample(
            &metrics,
            "narwhal_agent_identity_reads_total{path=\"scan\",outcome=\"ok\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(
            &metrics,
            "narwhal_agent_identity_reads_total{path=\"cached\",outcome=\"ok\"}"
        ),
        Some(3.0),
        "{metrics}"
    );

    let old_pid = sim.proc.pid();
    sim.restart(&[]).expect("restart p0 on its port");
    assert_ne!(sim.proc.pid(), old_pid);
    // Every answer from now on names the new process (the old one is gone); poll until the
    // new one listens.
    let new = wait_until(Duration::from_secs(20), || {
        let (c, process) = (c.clone(), process.clone());
        async move {
            let (status, body) = read(c, process).await;
            if status == 200 {
                assert_ne!(
                    identity(&body).pid,
                    old_pid,
                    "old identity after restart: {body}"
                );
                return Some(body);
            }
            None
        }
    })
    .await
    .expect("the restarted engine is read");
    // Typed: `start_ticks` is read as a number (never null).
    let new = identity(&new);
    assert_eq!(new.pid, sim.proc.pid());
    assert!(new.start_ticks > 0, "{new:?}");
    let (_, metrics) = get(&c, format!("{}/metrics", agent.url)).await;
    assert!(
        sample(
            &metrics,
            "narwhal_agent_identity_reads_total{path=\"scan\",outcome=\"ok\"}"
        ) >= Some(2.0),
        "{metrics}"
    );
}

/// `narwhal-agent fence reset` refuses while the agent runs (it holds the state lock) and rewrites
/// the fence once it stopped; a second agent on the same state directory refuses to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_is_reset_only_while_the_agent_is_stopped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = certs(dir.path());
    let sim = start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0");
    let mut agent = start_agent(dir.path(), &certs, "h0", &[&sim]).expect("agent");
    let router = client_as(&certs, "router");
    let (status, att) = agent.attest(&router, "p0", "n1", 9, "router-a").await;
    assert_eq!(status, 200, "{att}");
    let fence = |args: &[&str]| {
        let out = Command::new(bin_path("narwhal-agent"))
            .arg("fence")
            .args(args)
            .arg("--config")
            .arg(&agent.config)
            .output()
            .expect("narwhal-agent fence");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, _) = fence(&["show"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        serde_json::from_str::<Value>(&out).expect("JSON"),
        json!({"epoch": 9, "holder": "router-a"})
    );
    let (code, _, err) = fence(&["reset"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("running agent"), "{err}");
    assert!(
        err.contains(&agent.proc.pid().to_string()),
        "names the pid: {err}"
    );
    assert_eq!(
        agent.fence_file(),
        json!({"epoch": 9, "holder": "router-a"})
    );
    // A second agent on the same state refuses to start (exit 2), naming the lock.
    let second = Command::new(bin_path("narwhal-agent"))
        .args(["run", "--config"])
        .arg(&agent.config)
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .expect("second agent");
    assert_eq!(second.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("in use by a running agent"),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );

    agent.proc.kill();
    let (code, out, err) = fence(&["reset", "--to-epoch", "2"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("epoch 9") && out.contains("epoch 2"), "{out}");
    assert_eq!(agent.fence_file(), json!({"epoch": 2, "holder": ""}));
    // The restarted agent accepts a router at epoch 2 again, and refuses 1.
    let agent = start_agent(dir.path(), &certs, "h0", &[&sim]).expect("agent again");
    let (status, att) = agent.attest(&router, "p0", "n2", 2, "router-b").await;
    assert_eq!(status, 200, "{att}");
    let (status, stale) = agent.attest(&router, "p0", "n3", 1, "router-b").await;
    assert_eq!(status, 409, "{stale}");
    assert_eq!(agent_error(&stale).code, "stale_epoch");
}

/// The agent serves HEAD wherever it serves GET (RFC 9110 sections 9.1 and 9.3.2): the same
/// status and content type, no body; a GET route's 405 lists HEAD in `Allow`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_answers_head_wherever_it_answers_get() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = certs(dir.path());
    let sim = start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0");
    let agent = start_agent(dir.path(), &certs, "h0", &[&sim]).expect("agent");
    let c = client_as(&certs, "ctl");
    for path in [
        "/health",
        "/v1/engines",
        "/v1/engines/p0/process",
        "/metrics",
    ] {
        let url = format!("{}{path}", agent.url);
        let get = c.get(&url).send().await.expect("GET");
        let head = c.head(&url).send().await.expect("HEAD");
        assert_eq!(head.status(), get.status(), "HEAD {path}");
        assert_eq!(
            head.headers().get("content-type"),
            get.headers().get("content-type"),
            "HEAD {path}"
        );
        assert!(
            head.bytes().await.expect("HEAD body").is_empty(),
            "HEAD {path}"
        );
    }
    // A router may POST (an operator is refused 403 before the method is looked at).
    let r = client_as(&certs, "router")
        .post(format!("{}/health", agent.url))
        .send()
        .await
        .expect("POST");
    assert_eq!(r.status().as_u16(), 405);
    let allow = r
        .headers()
        .get("allow")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_uppercase();
    assert!(
        allow.contains("GET") && allow.contains("HEAD"),
        "allow: {allow}"
    );
}

/// The `error` of an agent's refusal.
///
/// # Panics
/// When `answer` is not the agent's error body.
fn agent_error(answer: &Value) -> ErrorDetail {
    serde_json::from_value::<ErrorBody>(answer.clone())
        .unwrap_or_else(|e| panic!("not the agent's error body ({e}): {answer}"))
        .error
}

/// The agent's fence file: the highest epoch and holder it accepted.
///
/// # Panics
/// When the file is not `{"epoch", "holder"}`.
fn fence(agent: &AgentHandle) -> FenceShown {
    let file = agent.fence_file();
    serde_json::from_value(file.clone())
        .unwrap_or_else(|e| panic!("not a fence file ({e}): {file}"))
}
