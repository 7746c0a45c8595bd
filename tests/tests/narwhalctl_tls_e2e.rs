//! `narwhalctl` against a control listener with mutual TLS (`control.tls`; architecture.md section
//! 3): an operator certificate from the fleet CA gets in, drains and readmits; a client without
//! a certificate, or with one from another CA, is refused at the TLS layer and narwhalctl says
//! the router is unavailable (exit 3).

use narwhal_testkit::certs::{DevCerts, make_dev_certs};
use narwhal_testkit::{Fleet, narwhalctl};
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narwhalctl_drains_and_readmits_over_mutual_tls_and_strangers_are_refused() {
    let mut f = Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .certs(&["ctl"])
        .control_tls()
        .start()
        .await;
    let other_ca = make_dev_certs(&f.dir().join("other"), &["ctl"]).expect("foreign CA");
    let certs = f.certs().clone();
    let control = f.router().control.clone();
    assert!(
        control.starts_with("https://"),
        "the control listener announces TLS: {control}"
    );
    let ctl = |creds: Option<&DevCerts>, args: &[&str]| {
        let mut all: Vec<std::ffi::OsString> = Vec::new();
        if let Some(c) = creds {
            all.extend(["--ca".into(), certs.ca.clone().into_os_string()]);
            all.extend(["--cert".into(), c.cert("ctl").into_os_string()]);
            all.extend(["--key".into(), c.key("ctl").into_os_string()]);
        }
        all.extend(["--request-timeout-s", "20"].map(Into::into));
        all.extend(args.iter().map(Into::into));
        let out = narwhalctl(&control, &all);
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
    f.sim_mut("d0").restart(&[]).expect("restart d0");
    let (code, out, err) = ctl(Some(&certs), &["readmit", "d0"]);
    assert_eq!(code, 0, "readmit: {out}{err}");
    assert!(out.contains("d0: checks passed: health"), "{out}");
    // No client certificate (the client trusts the fleet CA): refused during the handshake.
    let anonymous = reqwest::Client::builder()
        .no_proxy()
        .use_preconfigured_tls(
            narwhal_shared::tls::build_client_config(
                narwhal_shared::tls::ServerTrust::Ca(&certs.ca),
                None,
                &[],
            )
            .expect("client config"),
        )
        .build()
        .expect("client");
    let r = anonymous
        .get(format!("{control}/narwhal/lifecycle"))
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
