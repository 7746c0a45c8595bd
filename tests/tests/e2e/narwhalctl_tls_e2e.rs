//! `narwhalctl` against a control listener with mutual TLS (`control.tls`; architecture.md section
//! 3): an operator certificate from the fleet CA gets in, drains and readmits; a client without
//! a certificate, or with one from another CA, is refused at the TLS layer and narwhalctl says
//! the router is unavailable (exit 3). Each TLS mistake an operator makes (plain http, no
//! `--ca`, a name the certificate does not carry, no client certificate) is named in its error.

use std::path::{Path, PathBuf};

use narwhal_shared::documents::LifecycleReply;
use narwhal_testkit::certs::{DevCerts, make_dev_certs};
use narwhal_testkit::{
    ById, EngineSpec, Fleet, FleetSpec, ctl, narwhalctl, parse_document, start_router, start_sim,
};
use serde_json::json;

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
    let doc: LifecycleReply = parse_document("drain --json", out.lines().last().unwrap_or(""));
    assert!(doc.document.engines.of("d0").ready_to_stop, "{doc:?}");
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

/// A control-listener CA whose router certificate names only `router-control.internal` (no IP
/// address), and an operator certificate; rcgen, PEM files in `dir`.
fn control_certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf, PathBuf, PathBuf) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    std::fs::create_dir_all(dir).unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name.push(DnType::CommonName, "control CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let leaf = |name: &str, eku: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec![name.to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![eku];
        p.use_authority_key_identifier_extension = true;
        let cert = p.signed_by(&key, &issuer).unwrap();
        let (c, k) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    };
    let ca_path = dir.join("ca.pem");
    std::fs::write(&ca_path, ca_cert.pem()).unwrap();
    let (rc, rk) = leaf(
        "router-control.internal",
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (oc, ok) = leaf("operator", ExtendedKeyUsagePurpose::ClientAuth);
    (ca_path, rc, rk, oc, ok)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narwhalctl_tls_errors_name_tls_the_client_certificate_and_name_mismatches() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (ca, rc, rk, oc, ok) = control_certs(&dir.path().join("control-certs"));
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
    ];
    let spec = FleetSpec::for_sims("vllm", &sims)
        .with(json!({"control": {"tls": {"ca": ca, "cert": rc, "key": rk}}}));
    let router = start_router(dir.path(), "router", &spec, &[]).expect("router");
    let https = router.control.clone();
    assert!(https.starts_with("https://127.0.0.1:"), "{https}");
    let addr = https.trim_start_matches("https://").to_string();
    let (ca, oc, ok) = (
        ca.display().to_string(),
        oc.display().to_string(),
        ok.display().to_string(),
    );

    // Plain http to the TLS listener: names TLS and the https URL (was: "error sending request").
    let r = ctl(&format!("http://{addr}"), &["status"]);
    assert_eq!(r.code, 3, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("speaks TLS") && r.stderr.contains(&format!("https://{addr}")),
        "{}",
        r.stderr
    );
    // No --ca: the router's certificate is not trusted; says which flag.
    let r = ctl(&https, &["status"]);
    assert_eq!(r.code, 3, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("pass --ca"), "{}", r.stderr);
    let trust = ["--ca", ca.as_str()];
    let me = ["--cert", oc.as_str(), "--key", ok.as_str()];
    let name = ["--server-name", "router-control.internal"];
    // Connecting by an address the certificate does not name.
    let r = ctl(&https, &[&trust[..], &me, &["status"]].concat());
    assert_eq!(r.code, 3, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("certificate name mismatch")
            && r.stderr.contains(&addr)
            && r.stderr.contains("router-control.internal"),
        "{}",
        r.stderr
    );
    // Right name, no client certificate: names the client certificate.
    let r = ctl(&https, &[&trust[..], &name, &["status"]].concat());
    assert_eq!(r.code, 3, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("requires a client certificate") && r.stderr.contains("--cert"),
        "{}",
        r.stderr
    );
    // Everything right.
    let r = ctl(&https, &[&trust[..], &me, &name, &["status"]].concat());
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("controls_fleet=active"), "{}", r.stdout);
}
