//! Operator tooling end to end: `narwhalctl` against real routers (docs/operate.md) and
//! `narwhal-dev` session hygiene.
//!
//! Every test starts the real binaries on loopback. The narwhalctl fleet is a `narwhal-dev up`
//! (agents, mutual TLS, a standby), because `wave-restart` needs a restart command an operator
//! could type: `narwhal-dev restart {iid} --dir DIR`.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use narwhal_testkit::{EngineSpec, FleetSpec, bin_path, start_router, start_sim};
use serde_json::{Value, json};

/// Generous: the machine is shared by several builds at once.
const UP_TIMEOUT: Duration = Duration::from_secs(120);

/// Output of one command: exit code, stdout, stderr.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(mut cmd: Command) -> Run {
    let out = cmd.output().expect("run command");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `cmd` with stdout and stderr captured; kills it after `within` (code -1).
fn run_within(mut cmd: Command, within: Duration) -> Run {
    let dir = tempfile::tempdir().expect("tempdir");
    let (o, e) = (dir.path().join("out"), dir.path().join("err"));
    cmd.stdout(std::fs::File::create(&o).expect("out"))
        .stderr(std::fs::File::create(&e).expect("err"));
    let mut child = cmd.spawn().expect("spawn");
    let deadline = Instant::now() + within;
    let code = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st.code().unwrap_or(-1);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break -1;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Run {
        code,
        stdout: std::fs::read_to_string(&o).unwrap_or_default(),
        stderr: std::fs::read_to_string(&e).unwrap_or_default(),
    }
}

fn ctl(router: &str, args: &[&str]) -> Run {
    let mut cmd = Command::new(bin_path("narwhalctl"));
    cmd.args(["--router", router, "--request-timeout-s", "30"])
        .args(args);
    run(cmd)
}

/// A `narwhal-dev up` session, killed (SIGKILL to the supervisor) on drop.
struct DevUp {
    child: Option<Child>,
    dir: PathBuf,
    ready: PathBuf,
}

impl DevUp {
    fn start(dir: &Path, ready: Option<&Path>, extra: &[&str]) -> DevUp {
        let log = std::fs::File::create(dir.with_extension("up.log")).expect("log file");
        let mut cmd = Command::new(bin_path("narwhal-dev"));
        cmd.arg("up").arg("--dir").arg(dir).args(extra);
        if let Some(r) = ready {
            cmd.arg("--ready-file").arg(r);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log));
        let child = cmd.spawn().expect("spawn narwhal-dev up");
        let ready = ready.map_or_else(|| dir.join("fleet.ready.json"), Path::to_path_buf);
        let mut up = DevUp {
            child: Some(child),
            dir: dir.to_path_buf(),
            ready,
        };
        let deadline = Instant::now() + UP_TIMEOUT;
        while up.ready_doc().is_none() {
            if let Some(st) = up.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("narwhal-dev up exited with {st}:\n{}", up.log());
            }
            assert!(
                Instant::now() < deadline,
                "narwhal-dev up did not write {} in time:\n{}",
                up.ready.display(),
                up.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        up
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.with_extension("up.log")).unwrap_or_default()
    }

    fn ready_doc(&self) -> Option<Value> {
        let doc: Value = serde_json::from_slice(&std::fs::read(&self.ready).ok()?).ok()?;
        (!doc["dev_control"].as_str().unwrap_or("").is_empty()).then_some(doc)
    }

    fn doc(&self) -> Value {
        self.ready_doc().expect("ready file")
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Every process the session started, and the fleet process itself.
    fn pids(&self) -> Vec<(String, i32)> {
        let d = self.doc();
        let mut v = vec![
            (
                "fleet process".to_string(),
                d["dev_pid"].as_i64().unwrap_or(0) as i32,
            ),
            (
                "router".to_string(),
                d["router"]["pid"].as_i64().unwrap_or(0) as i32,
            ),
        ];
        if d["standby"].is_object() {
            v.push((
                "standby".into(),
                d["standby"]["pid"].as_i64().unwrap_or(0) as i32,
            ));
        }
        for e in d["engines"].as_array().into_iter().flatten() {
            v.push((
                format!("engine {}", e["iid"].as_str().unwrap_or("?")),
                e["pid"].as_i64().unwrap_or(0) as i32,
            ));
        }
        for a in d["agents"].as_array().into_iter().flatten() {
            v.push((
                format!("agent {}", a["id"].as_str().unwrap_or("?")),
                a["pid"].as_i64().unwrap_or(0) as i32,
            ));
        }
        for (name, pid) in &v {
            assert!(*pid > 0, "{name} has no pid in the ready file");
        }
        v
    }
}

impl Drop for DevUp {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGTERM: the session stops its children; SIGKILL if it does not within 60 s.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Alive and not a zombie.
fn alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
        .unwrap_or("");
    state != "Z" && state != "X"
}

fn wait_all_dead(pids: &[(String, i32)], within: Duration) -> Vec<String> {
    let deadline = Instant::now() + within;
    loop {
        let left: Vec<String> = pids
            .iter()
            .filter(|(_, p)| alive(*p))
            .map(|(n, p)| format!("{n} (pid {p})"))
            .collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every JSON value in `text` (whitespace-separated); panics on anything else.
fn json_values(text: &str) -> Vec<Value> {
    serde_json::Deserializer::from_str(text)
        .into_iter::<Value>()
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_else(|e| panic!("stdout is not only JSON ({e}):\n{text}"))
}

/// `(data, control, standby control or "")` of a session.
fn urls(up: &DevUp) -> (String, String, String) {
    let doc = up.doc();
    let s = |v: &Value| v.as_str().unwrap_or("").to_string();
    (
        s(&doc["router"]["data"]),
        s(&doc["router"]["control"]),
        s(&doc["standby"]["control"]),
    )
}

#[test]
fn narwhalctl_refuses_the_data_listener_ends_quietly_on_a_closed_pipe_and_names_a_503() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = DevUp::start(&tmp.path().join("fleet"), None, &["--standby"]);
    let (data, control, standby) = urls(&up);

    // The data listener is refused with a pointer to the control listener (was: exit 0 and an
    // empty table).
    for args in [&["status"][..], &["drain", "p0"], &["readmit", "p0"]] {
        let r = ctl(&data, args);
        assert_eq!(
            r.code, 2,
            "{args:?} on the data listener: {}{}",
            r.stdout, r.stderr
        );
        assert!(
            r.stderr.contains("data listener") && r.stderr.contains("control listener"),
            "{args:?}: {}",
            r.stderr
        );
        assert!(r.stdout.is_empty(), "{args:?} printed: {}", r.stdout);
    }
    let r = ctl(&control, &["status"]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);

    // A reader that went away ends narwhalctl quietly (was: a panic, exit 101).
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let mut cmd = Command::new(bin_path("narwhalctl"));
    cmd.args(["--router", &control, "status"])
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped());
    let r = run(cmd);
    assert_eq!(r.code, 141, "closed stdout: {}", r.stderr);
    assert!(r.stderr.is_empty(), "closed stdout printed: {}", r.stderr);

    // A readmission refused with 503 (a standby does not control the fleet) says what failed,
    // never an empty "checks passed:" list.
    let r = ctl(&standby, &["readmit", "p0"]);
    assert_eq!(r.code, 3, "{}{}", r.stdout, r.stderr);
    assert!(
        !r.stdout
            .lines()
            .any(|l| l.trim_end().ends_with("checks passed:")),
        "empty checks list: {}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("p0: FAILED: this router does not control the fleet"),
        "{}",
        r.stdout
    );
    drop(up);
}

#[test]
fn narwhalctl_wave_restart_json_is_one_document_and_a_failed_wave_names_the_command_that_resumes_it()
 {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("fleet");
    let up = DevUp::start(
        &dir,
        None,
        &["--prefill", "1", "--decode", "2", "--hosts", "2"],
    );
    let (_, control, _) = urls(&up);
    let dev = bin_path("narwhal-dev");
    let dir_s = dir.display().to_string();

    // --json: exactly one JSON document on stdout; the restart command's output on stderr.
    let restart_cmd = format!(
        "echo restarting {{iid}} at {{host}} port {{port}} \"$NARWHAL_ENGINE_URL\"; {} restart {{iid}} --dir {dir_s}",
        dev.display()
    );
    let r = ctl(
        &control,
        &[
            "--json",
            "wave-restart",
            "--rolling",
            "--restart-cmd",
            &restart_cmd,
            "--timeout-s",
            "90",
        ],
    );
    assert_eq!(r.code, 0, "rolling wave: {}{}", r.stdout, r.stderr);
    let docs = json_values(&r.stdout);
    assert_eq!(docs.len(), 1, "one document: {}", r.stdout);
    let rep = &docs[0];
    assert_eq!(rep["ok"], true, "{rep}");
    assert_eq!(rep["engines"].as_array().map(Vec::len), Some(3), "{rep}");
    for e in rep["engines"].as_array().unwrap() {
        assert_eq!(e["readmitted"], true, "{e}");
        assert!(
            e["checks"]
                .as_array()
                .is_some_and(|c| c.iter().any(|x| x == "new process identity")),
            "{e}"
        );
    }
    let p0_url = up.doc()["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["iid"] == "p0")
        .and_then(|e| e["url"].as_str())
        .expect("p0 url")
        .to_string();
    let p0_port = p0_url.rsplit(':').next().unwrap();
    assert!(
        r.stderr.contains(&format!(
            "restarting p0 at 127.0.0.1 port {p0_port} {p0_url}"
        )),
        "{{host}}, {{port}} and NARWHAL_ENGINE_URL name the engine: {}",
        r.stderr
    );
    assert!(
        r.stderr.contains("restarting p0") && r.stderr.contains("p0: restarted as pid"),
        "the restart command's output goes to stderr: {}",
        r.stderr
    );

    // A wave that fails half-way names the exact command that continues it, and that
    // command finishes the wave.
    let marker = tmp.path().join("fixed");
    let flaky = format!(
        "if [ {{iid}} = d1 ] && [ ! -f {m} ]; then echo d1 restart failed >&2; exit 7; fi; {dev} restart {{iid}} --dir {dir_s}",
        m = marker.display(),
        dev = dev.display()
    );
    let r = ctl(
        &control,
        &[
            "--json",
            "wave-restart",
            "--restart-cmd",
            &flaky,
            "--timeout-s",
            "90",
        ],
    );
    assert_eq!(r.code, 1, "failed wave: {}{}", r.stdout, r.stderr);
    let docs = json_values(&r.stdout);
    assert_eq!(docs.len(), 1, "one document: {}", r.stdout);
    let rep = &docs[0];
    assert_eq!(rep["ok"], false, "{rep}");
    assert!(
        rep["error"]
            .as_str()
            .unwrap_or("")
            .contains("d1: restart command"),
        "{rep}"
    );
    let next = rep["next_command"]
        .as_str()
        .expect("next_command")
        .to_string();
    assert!(next.contains("--resume --engines d1,p0"), "{next}");
    assert!(
        r.stderr.contains(&next),
        "stderr names the next command: {}",
        r.stderr
    );
    let r = ctl(&control, &["status"]);
    assert!(
        r.stdout.contains("wave "),
        "the wave stays active: {}",
        r.stdout
    );
    std::fs::write(&marker, "").expect("marker");
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(&next);
    let r = run(cmd);
    assert_eq!(r.code, 0, "resumed wave `{next}`: {}{}", r.stdout, r.stderr);
    let docs = json_values(&r.stdout);
    assert_eq!(docs.len(), 1, "{}", r.stdout);
    assert_eq!(docs[0]["ok"], true, "{}", docs[0]);
    assert_eq!(docs[0]["lifecycle"]["wave"]["active"], false, "{}", docs[0]);
    let restarted: Vec<&str> = docs[0]["engines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["restarted"] == true)
        .filter_map(|e| e["iid"].as_str())
        .collect();
    // d0 was restarted before d1 failed; the engines after d1 (p0) were not yet.
    assert_eq!(
        restarted,
        ["d1", "p0"],
        "--resume restarts only what is left: {}",
        docs[0]
    );
    drop(up);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narwhalctl_status_shows_an_ejected_engine_as_ejected_with_its_cause() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = DevUp::start(
        &tmp.path().join("fleet"),
        None,
        &["--prefill", "1", "--decode", "2", "--hosts", "2"],
    );
    let (data, control, _) = urls(&up);
    // Two decode engines, so ejecting one never empties the role (the panic threshold keeps a
    // role's last engine in placement).
    let d1 = up.doc()["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["iid"] == "d1")
        .and_then(|e| e["pid"].as_i64())
        .expect("d1 pid") as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(d1),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill d1");
    let http = narwhal_testkit::http_client().build().expect("client");
    let ejected = narwhal_testkit::wait_until(Duration::from_secs(60), || async {
        let _ = http
            .post(format!("{data}/v1/completions"))
            .json(&json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 2}))
            .send()
            .await;
        let st: Value = http
            .get(format!("{control}/narwhal/state"))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        st["ejected"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i == "d1"))
            .then_some(())
    })
    .await;
    assert!(ejected.is_some(), "d1 was never ejected");
    let r = ctl(&control, &["status"]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let line = r
        .stdout
        .lines()
        .find(|l| l.starts_with("d1 "))
        .unwrap_or_else(|| panic!("no d1 line: {}", r.stdout));
    // A killed engine is seen by a failed leg (`connection`) or, usually first, by its
    // liveness probe that cannot connect (`health_probe`).
    let causes = ["connection", "health_probe"];
    assert!(
        line.contains(" ejected ")
            && causes
                .iter()
                .any(|c| line.contains(&format!("ejected by the breaker: {c}"))),
        "{line}"
    );
    let r = ctl(&control, &["--json", "status"]);
    let docs = json_values(&r.stdout);
    assert_eq!(docs.len(), 1);
    assert!(
        causes
            .iter()
            .any(|c| docs[0]["ejected"]["d1"]["causes"][c].as_u64() >= Some(1)),
        "{}",
        docs[0]
    );
    drop(up);
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
    // Connecting by an address the certificate does not name.
    let r = ctl(
        &https,
        &["--ca", &ca, "--cert", &oc, "--key", &ok, "status"],
    );
    assert_eq!(r.code, 3, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("certificate name mismatch")
            && r.stderr.contains(&addr)
            && r.stderr.contains("router-control.internal"),
        "{}",
        r.stderr
    );
    // Right name, no client certificate: names the client certificate.
    let r = ctl(
        &https,
        &[
            "--ca",
            &ca,
            "--server-name",
            "router-control.internal",
            "status",
        ],
    );
    assert_eq!(r.code, 3, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("requires a client certificate") && r.stderr.contains("--cert"),
        "{}",
        r.stderr
    );
    // Everything right.
    let r = ctl(
        &https,
        &[
            "--ca",
            &ca,
            "--cert",
            &oc,
            "--key",
            &ok,
            "--server-name",
            "router-control.internal",
            "status",
        ],
    );
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("controls_fleet=active"), "{}", r.stdout);
}

#[test]
fn narwhal_dev_refuses_a_busy_dir_restarts_by_dir_and_its_children_die_with_kill_9() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("fleet");
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let ready = elsewhere.join("ready.json");
    let up = DevUp::start(&dir, Some(&ready), &["--hosts", "1"]);

    // A second session in the same directory is refused at once, naming the holder.
    let mut second = Command::new(bin_path("narwhal-dev"));
    second
        .args(["up", "--hosts", "1", "--dir"])
        .arg(&dir)
        .stdin(Stdio::null());
    let r = run_within(second, Duration::from_secs(60));
    assert!(
        r.code > 0,
        "a second up in a busy dir must exit with an error at once (code {}): {}{}",
        r.code,
        r.stdout,
        r.stderr
    );
    let holder = up.doc()["dev_pid"].as_i64().unwrap();
    assert!(
        r.stderr.contains("in use by another narwhal-dev session")
            && r.stderr.contains(&format!("pid {holder}")),
        "{}",
        r.stderr
    );
    assert!(
        !dir.join("fleet.ready.json").exists(),
        "the second up wrote into the busy dir"
    );

    // restart --dir finds the session although the ready file is elsewhere.
    let old = up.doc()["engines"][0]["pid"].as_i64().unwrap();
    let mut cmd = Command::new(bin_path("narwhal-dev"));
    cmd.args(["restart", "p0", "--dir"]).arg(&dir);
    let r = run(cmd);
    assert_eq!(r.code, 0, "restart --dir: {}{}", r.stdout, r.stderr);
    let new = up.doc()["engines"][0]["pid"].as_i64().unwrap();
    assert_ne!(old, new, "p0 has a new process");
    assert!(alive(new as i32));

    // kill -9 of the process the user started: every child goes with it.
    let pids = up.pids();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(up.pid()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    let left = wait_all_dead(&pids, Duration::from_secs(60));
    assert!(
        left.is_empty(),
        "still running after kill -9 of narwhal-dev up: {left:?}"
    );
    let mut cmd = Command::new(bin_path("narwhal-dev"));
    cmd.args(["restart", "p0", "--dir"]).arg(&dir);
    let r = run(cmd);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("is running"), "{}", r.stderr);
    drop(up);
}

#[test]
fn narwhal_dev_children_die_when_its_fleet_process_is_killed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("fleet");
    let mut up = DevUp::start(&dir, None, &["--hosts", "1"]);
    let pids = up.pids();
    let fleet_pid = up.doc()["dev_pid"].as_i64().unwrap() as i32;
    assert_ne!(fleet_pid, up.pid(), "the fleet runs in its own process");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(fleet_pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    let left = wait_all_dead(&pids, Duration::from_secs(60));
    assert!(
        left.is_empty(),
        "still running after kill -9 of the fleet process: {left:?}"
    );
    // The supervisor reports the kill as its own exit (128 + 9).
    let mut child = up.child.take().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the supervisor did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(137), "{status}");
    let mut log = String::new();
    let _ =
        std::fs::File::open(dir.with_extension("up.log")).map(|mut f| f.read_to_string(&mut log));
    assert!(log.contains("stopped them"), "{log}");
}

/// `packaging/narwhal-restart-remote`, through a fake `ssh` that runs the remote command on
/// this machine: it must return only once the old engine process has exited and the new one
/// answers `/health`, and fail with exit 3 when the new engine never serves.
#[test]
fn restart_remote_wrapper_blocks_until_the_old_pid_exits_and_the_new_engine_serves() {
    use std::os::unix::fs::PermissionsExt as _;
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/narwhal-restart-remote");
    let sim = bin_path("narwhal-engine-sim");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let write_exec = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    };
    // ssh HOST COMMAND...: records the host, runs the command here (as sshd would, through a
    // shell, with the script on stdin).
    let ssh = write_exec(
        "ssh",
        &format!(
            "#!/bin/sh\nwhile [ \"${{1#-}}\" != \"$1\" ]; do case \"$1\" in -o) shift 2;; *) shift;; esac; done\n\
             echo \"$1\" > {d}/ssh.host\nshift\nexec sh -c \"$*\"\n",
            d = dir.display()
        ),
    );
    // Starts the engine detached (so this test is not its parent) and records its pid.
    let launch = write_exec(
        "launch",
        &format!(
            "#!/bin/sh\nsh -c 'echo $$ > {d}/engine.pid; exec {sim} --listen 127.0.0.1:{port} --ready-file {d}/sim.ready.json' </dev/null >/dev/null 2>&1 &\n",
            d = dir.display(),
            sim = sim.display()
        ),
    );
    // A restart that returns at once: the old engine stops 1.5 s later (a slow stop), the new
    // one starts 1 s after the old released the port. `NEW=no` starts none.
    write_exec(
        "restart",
        &format!(
            "#!/bin/sh\nold=$(cat {d}/engine.pid)\n(\n  sleep 1.5; kill \"$old\"\n  while kill -0 \"$old\" 2>/dev/null; do sleep 0.05; done\n  sleep 1\n  [ \"${{NEW:-yes}}\" = yes ] && {launch}\n) </dev/null >/dev/null 2>&1 &\nexit 0\n",
            d = dir.display(),
            launch = launch.display()
        ),
    );
    let pid_of = || -> i32 {
        std::fs::read_to_string(dir.join("engine.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    let healthy = || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok_and(|mut s| {
            use std::io::Write as _;
            let _ = s.write_all(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n");
            let mut buf = String::new();
            let _ = s.read_to_string(&mut buf);
            buf.starts_with("HTTP/1.0 200") || buf.starts_with("HTTP/1.1 200")
        })
    };
    let restart = |new: &str| format!("NEW={new} {}/restart", dir.display());
    let cmd = |restart: &str, timeout: &str| {
        let mut c = Command::new("bash");
        c.arg(&script)
            .args(["--ssh", &format!("{} -o BatchMode=yes", ssh.display())])
            .args(["--restart", restart])
            .args(["--pid-cmd", &format!("cat {}/engine.pid", dir.display())])
            .args([
                "--timeout",
                timeout,
                "gpu-a.test",
                "narwhal-engine@x.service",
            ])
            .arg(port.to_string());
        c
    };
    /// Kills whatever engine the pid file names when the test ends, passed or not.
    struct KillEngine(PathBuf);
    impl Drop for KillEngine {
        fn drop(&mut self) {
            if let Some(pid) = std::fs::read_to_string(&self.0)
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
    let _engine = KillEngine(dir.join("engine.pid"));
    assert!(Command::new(&launch).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !healthy() {
        assert!(Instant::now() < deadline, "the first engine never served");
        std::thread::sleep(Duration::from_millis(50));
    }
    let old = pid_of();
    assert!(alive(old));

    let t0 = Instant::now();
    let r = run_within(cmd(&restart("yes"), "120"), Duration::from_secs(180));
    let took = t0.elapsed();
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert_eq!(
        std::fs::read_to_string(dir.join("ssh.host"))
            .unwrap()
            .trim(),
        "gpu-a.test",
        "ssh was asked for the engine's host"
    );
    assert!(
        took >= Duration::from_millis(2500),
        "returned after {took:?}, before the old engine exited and the new one started"
    );
    assert!(
        !alive(old),
        "old pid {old} still runs after the wrapper returned"
    );
    let new = pid_of();
    assert!(new != old && alive(new), "new pid {new}");
    assert!(
        healthy(),
        "the new engine does not serve /health right after the wrapper returned"
    );
    assert!(
        r.stderr.contains(&format!("old pid {old} exited")) && r.stderr.contains("serves /health"),
        "{}",
        r.stderr
    );

    // No new engine: exit 3 after the timeout, naming what did not happen.
    let r = run_within(cmd(&restart("no"), "4"), Duration::from_secs(60));
    assert_eq!(r.code, 3, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("no new engine process answered /health"),
        "{}",
        r.stderr
    );
    assert!(!alive(new), "the restart stopped the engine");
    // A failing restart command: exit 1.
    let r = run_within(cmd("false", "10"), Duration::from_secs(60));
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(r.stderr.contains("restart command failed"), "{}", r.stderr);
}

/// The families a Prometheus text exposition declares (`# TYPE`) or has samples of, with the
/// `_bucket`/`_sum`/`_count` series of its histograms.
fn exposed_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut live = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut w = rest.split_whitespace();
            let (name, kind) = (w.next().unwrap_or(""), w.next().unwrap_or(""));
            live.insert(name.to_string());
            if kind == "histogram" {
                for s in ["_bucket", "_sum", "_count"] {
                    live.insert(format!("{name}{s}"));
                }
            }
        } else if !line.starts_with('#') {
            let name: String = line
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            live.insert(name);
        }
    }
    live
}

/// `narwhal_*` string literals of the Rust sources under `dir` (registered family names; a
/// counter also as `<name>_total`): a family appears in `/metrics` only once it has a sample.
fn registered_names(dir: &Path) -> std::collections::BTreeSet<String> {
    let mut registered = std::collections::BTreeSet::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("source dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let src = std::fs::read_to_string(&p).unwrap_or_default();
                for lit in src.split('"').skip(1).step_by(2) {
                    if lit.starts_with("narwhal_")
                        && lit.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    {
                        registered.insert(lit.to_string());
                        registered.insert(format!("{lit}_total"));
                    }
                }
            }
        }
    }
    registered
}

/// Every `narwhal_*` name in the Grafana dashboard and the alert rules (and their tests) is one
/// a live router or a live agent exports (or their sources register), and the operator
/// families the alerts rely on have samples on a router with a lease, agents and control TLS
/// (docs/monitoring.md: the router's control, lease and certificate gauges; the dashboard's
/// agent names reconciled with the agent's real `/metrics`). Before, the rules used
/// fallbacks and assumed agent names listed in `metrics-not-yet-exported.txt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitoring_files_use_the_metric_names_router_and_agents_export() {
    let f = narwhal_testkit::Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .control_tls()
        .lease(narwhal_testkit::LeaseBackend::File)
        .start()
        .await;
    let text = f.router().metrics().await;
    let agent_text = f
        .http
        .get(format!("{}/metrics", f.agents[0].url))
        .await
        .text();
    let metric = |t: &str, name: &str, labels: &[&str]| {
        narwhal_testkit::metric(t, name, labels)
            .unwrap_or_else(|| panic!("no sample of {name} {labels:?} in:\n{t}"))
    };
    assert_eq!(metric(&text, "narwhal_router_controls_fleet", &[]), 1.0);
    assert_eq!(
        metric(
            &text,
            "narwhal_router_lease_info",
            &["state=\"active\"", "holder=\"primary:"]
        ),
        1.0
    );
    assert_eq!(metric(&text, "narwhal_router_lease_ttl_seconds", &[]), 2.0);
    assert_eq!(
        metric(&text, "narwhal_router_lease_renew_interval_seconds", &[]),
        0.5
    );
    let left = metric(&text, "narwhal_router_lease_expires_in_seconds", &[]);
    assert!(left > 0.0 && left <= 1.5, "ttl − margin bounds it: {left}");
    for cert in ["tls.cert", "tls.ca", "control.tls.cert", "control.tls.ca"] {
        let label = format!("cert=\"{cert}\"");
        let days = metric(
            &text,
            "narwhal_router_certificate_expiry_seconds",
            &[&label],
        ) / 86400.0;
        assert!(days > 1.0, "{cert}: {days} days");
    }
    assert!(
        metric(
            &agent_text,
            "narwhal_agent_certificate_expiry_seconds",
            &["cert=\"serving\""]
        ) > 86400.0
    );
    assert!(metric(&agent_text, "narwhal_agent_fence_epoch", &[]) >= 1.0);

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut live = exposed_names(&text);
    live.extend(exposed_names(&agent_text));
    let registered = registered_names(&root.join("router/src"));
    assert!(
        registered.contains("narwhal_engine_ejections_total"),
        "router/src no longer registers narwhal_engine_ejections: {registered:?}"
    );
    live.extend(registered);
    live.extend(registered_names(&root.join("engine-agent/src")));
    assert!(
        !root
            .join("packaging/prometheus/metrics-not-yet-exported.txt")
            .exists(),
        "every metric the monitoring files use is exported: no list of missing ones"
    );
    for file in [
        "grafana/narwhal-dashboard.json",
        "prometheus/narwhal-alerts.yml",
        "prometheus/narwhal-alerts.test.yml",
    ] {
        // A __name__ regex over both components names both metrics.
        let text = std::fs::read_to_string(root.join("packaging").join(file))
            .unwrap()
            .replace(
                "narwhal_(router|agent)_certificate_expiry_seconds",
                "narwhal_router_certificate_expiry_seconds narwhal_agent_certificate_expiry_seconds",
            );
        let mut unknown = std::collections::BTreeSet::new();
        let mut seen = 0;
        let mut rest = text.as_str();
        while let Some(i) = rest.find("narwhal_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // Not part of a longer word (e.g. a label value such as `xnarwhal_`).
            let standalone = rest[..i]
                .chars()
                .last()
                .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
            if standalone {
                seen += 1;
                if !live.contains(&name) {
                    unknown.insert(name.clone());
                }
            }
            rest = &rest[i + name.len().max(1)..];
        }
        assert!(seen > 5, "{file}: no metric names found");
        assert!(
            unknown.is_empty(),
            "{file} uses metric names neither narwhal-serve nor narwhal-agent exports: {unknown:?}"
        );
    }
}

/// `docs/logging.md`: every line `narwhal-serve --log-format json` writes is one JSON object with
/// `timestamp`, `level`, `target`, `fields.message`, and `span`/`spans` only inside a span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_json_logs_follow_the_documented_schema() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
    ];
    let mut router = start_router(
        dir.path(),
        "router",
        &FleetSpec::for_sims("vllm", &sims),
        &["--log-format", "json", "--log-level", "debug"],
    )
    .expect("router");
    let http = narwhal_testkit::http_client().build().expect("client");
    let r = http
        .post(format!("{}/v1/completions", router.data))
        .json(&json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 200);
    router.proc.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(router.proc.wait_exit(Duration::from_secs(30)), Some(0));
    let log = std::fs::read_to_string(&router.proc.stderr_log).expect("stderr log");
    let mut lines = 0;
    let mut in_span = 0;
    for line in log.lines() {
        lines += 1;
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        let o = v
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {line}"));
        for k in o.keys() {
            assert!(
                ["timestamp", "level", "target", "fields", "span", "spans"].contains(&k.as_str()),
                "undocumented key {k}: {line}"
            );
        }
        assert!(
            v["timestamp"]
                .as_str()
                .is_some_and(|t| t.ends_with('Z') && t.contains('T')),
            "{line}"
        );
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"]
                .contains(&v["level"].as_str().unwrap_or("")),
            "{line}"
        );
        assert!(v["target"].is_string(), "{line}");
        assert!(v["fields"]["message"].is_string(), "{line}");
        assert_eq!(o.contains_key("span"), o.contains_key("spans"), "{line}");
        if let Some(spans) = v["spans"].as_array() {
            in_span += 1;
            assert!(spans.iter().all(|s| s["name"].is_string()), "{line}");
            if let Some(req) = spans.iter().find(|s| s["name"] == "request") {
                assert!(
                    req["id"].is_string() && req["route"] == "/v1/completions",
                    "{line}"
                );
            }
        }
    }
    assert!(lines >= 3, "{log}");
    assert!(in_span > 0, "no line was logged inside a span:\n{log}");
    assert!(
        log.contains("\"message\":\"narwhal-serve started\""),
        "the start-up line: {log}"
    );
}
