//! `narwhalctl` against a control listener with mutual TLS (`control.tls`; DESIGN.md section
//! 3): an operator certificate from the fleet CA gets in, drains and readmits; a client without
//! a certificate, or with one from another CA, is refused at the TLS layer and narwhalctl says
//! the router is unavailable (exit 3).

use std::process::Command;

use narwhal_testkit::certs::make_dev_certs;
use narwhal_testkit::{EngineSpec, FleetSpec, bin_path, start_agent, start_router, start_sim};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narwhalctl_drains_and_readmits_over_mutual_tls_and_strangers_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = make_dev_certs(
        &dir.path().join("certs"),
        &["router", "ctl", "agent-h0", "agent-h1"],
    )
    .expect("certs");
    let other_ca = make_dev_certs(&dir.path().join("other"), &["ctl"]).expect("foreign CA");
    let mut sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
    ];
    let a0 = start_agent(dir.path(), &certs, "h0", &[&sims[0]]).expect("agent h0");
    let a1 = start_agent(dir.path(), &certs, "h1", &[&sims[1]]).expect("agent h1");
    let spec = FleetSpec::for_sims("vllm", &sims)
        .tls(&certs, "router")
        .agent("p0", &a0)
        .agent("d0", &a1)
        .with(json!({"control": {"tls": {
            "ca": certs.ca, "cert": certs.cert("router"), "key": certs.key("router")
        }}}));
    let router = start_router(dir.path(), "router", &spec, &[]).expect("router");
    assert!(
        router.control.starts_with("https://"),
        "the control listener announces TLS: {}",
        router.control
    );
    let ctl = |creds: Option<&narwhal_testkit::certs::DevCerts>, args: &[&str]| {
        let mut cmd = Command::new(bin_path("narwhalctl"));
        cmd.args(["--router", &router.control]);
        if let Some(c) = creds {
            cmd.arg("--ca")
                .arg(&certs.ca)
                .arg("--cert")
                .arg(c.cert("ctl"))
                .arg("--key")
                .arg(c.key("ctl"));
        }
        cmd.args(["--request-timeout-s", "20"]).args(args);
        let out = cmd.output().expect("run narwhalctl");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // The operator's certificate chains to the fleet CA.
    let (code, out, err) = ctl(Some(&certs), &["status"]);
    assert_eq!(code, 0, "status: {out}{err}");
    assert!(out.contains("controls_fleet=active"), "{out}");
    let (code, out, err) = ctl(
        Some(&certs),
        &["--json", "drain", "d0", "--wait", "--timeout-s", "20"],
    );
    assert_eq!(code, 0, "drain: {out}{err}");
    let doc: Value =
        serde_json::from_str(out.lines().last().unwrap_or("")).expect("--json document");
    assert_eq!(doc["engines"]["d0"]["ready_to_stop"], true, "{doc}");
    sims[1].restart(&[]).expect("restart d0");
    let (code, out, err) = ctl(Some(&certs), &["readmit", "d0"]);
    assert_eq!(code, 0, "readmit: {out}{err}");
    assert!(out.contains("d0: checks passed: health"), "{out}");
    // No client certificate (the client trusts the fleet CA): refused during the handshake.
    let anonymous = reqwest::Client::builder()
        .no_proxy()
        .use_preconfigured_tls(
            narwhal_shared::tls::client_config_without_cert(&certs.ca).expect("client config"),
        )
        .build()
        .expect("client");
    let r = anonymous
        .get(format!("{}/narwhal/lifecycle", router.control))
        .send()
        .await;
    assert!(
        r.is_err(),
        "a client without a certificate got an answer: {r:?}"
    );
    // A certificate from another CA: refused too.
    let (code, out, err) = ctl(Some(&other_ca), &["status"]);
    assert_eq!(code, 3, "foreign CA: {out}{err}");
}
