//! `narwhalctl` against a `narwhal-dev up` fleet (docs/operate.md): what it prints and how it
//! exits. The data listener is refused with a pointer to the control listener, a closed stdout
//! ends it quietly, a standby's 503 is named; `wave-restart --json` is one document and a failed
//! wave names the command that resumes it; `status` shows an ejected engine with its cause.
//!
//! The fleet is a `narwhal-dev up` (agents, mutual TLS, a standby; the kit's [`DevUp`]) because
//! `wave-restart` needs a restart command an operator could type: `narwhal-dev restart {iid}
//! --dir DIR`.

use std::process::{Command, Stdio};
use std::time::Duration;

use narwhal_shared::documents::Lifecycle;
use narwhal_testkit::readers::{StatusReport, WaveReport};
use narwhal_testkit::{
    CommandOutput, DevUp, Http, RouterProbe, bin_path, ctl, json_values, run, signal_pid, whole,
};
use serde::Deserialize;
use serde_json::{Value, json};

/// An engine of `narwhal-dev up`'s ready file ([`DevUp::engine`]), the fields read here.
#[derive(Debug, Deserialize)]
struct DevEngine {
    url: String,
    pid: i32,
}

/// Engine `iid` of the session's ready file, typed.
fn dev_engine(up: &DevUp, iid: &str) -> DevEngine {
    let e = up.engine(iid);
    serde_json::from_value(e.clone()).unwrap_or_else(|err| panic!("{iid}: {err}: {e}"))
}

/// The one [`WaveReport`] a `wave-restart --json` printed, with its text for messages.
fn wave_report(r: &CommandOutput) -> (WaveReport, Value) {
    let doc = one_document(r);
    let rep = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("not a wave-restart report: {e}: {doc}"));
    (rep, doc)
}

/// `narwhalctl --json wave-restart <args> --timeout-s 90` against `control`.
fn wave_restart(control: &str, args: &[&str]) -> CommandOutput {
    ctl(
        control,
        &[&["--json", "wave-restart"], args, &["--timeout-s", "90"]].concat(),
    )
}

/// The one JSON document a `--json` command printed.
///
/// # Panics
/// When stdout is not exactly one JSON document.
fn one_document(r: &CommandOutput) -> Value {
    let docs = json_values(&r.stdout);
    assert_eq!(docs.len(), 1, "one document: {}", r.stdout);
    docs[0].clone()
}

#[test]
fn narwhalctl_refuses_the_data_listener_ends_quietly_on_a_closed_pipe_and_names_a_503() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let up = DevUp::start(&tmp.path().join("fleet"), None, &["--standby"]);
    let (data, control, standby) = up.urls();

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
    let (_, control, _) = up.urls();
    let dev = bin_path("narwhal-dev");
    let dir_s = dir.display().to_string();

    // --json: exactly one JSON document on stdout; the restart command's output on stderr.
    let restart_cmd = format!(
        "echo restarting {{iid}} at {{host}} port {{port}} \"$NARWHAL_ENGINE_URL\"; {} restart {{iid}} --dir {dir_s}",
        dev.display()
    );
    let r = wave_restart(&control, &["--rolling", "--restart-cmd", &restart_cmd]);
    assert_eq!(r.code, 0, "rolling wave: {}{}", r.stdout, r.stderr);
    let (rep, doc) = wave_report(&r);
    assert!(rep.ok, "{doc}");
    assert_eq!(rep.engines.len(), 3, "{doc}");
    for e in &rep.engines {
        assert!(e.readmitted, "{e:?}");
        assert!(
            e.checks.iter().any(|x| x == "new process identity"),
            "{e:?}"
        );
    }
    let p0_url = dev_engine(&up, "p0").url;
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
    let r = wave_restart(&control, &["--restart-cmd", &flaky]);
    assert_eq!(r.code, 1, "failed wave: {}{}", r.stdout, r.stderr);
    let (rep, doc) = wave_report(&r);
    assert!(!rep.ok, "{doc}");
    assert!(
        rep.error
            .as_deref()
            .unwrap_or("")
            .contains("d1: restart command"),
        "{doc}"
    );
    let next = rep.next_command.expect("next_command");
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
    let (rep, doc) = wave_report(&r);
    assert!(rep.ok, "{doc}");
    let lifecycle: Lifecycle = whole(
        "the report's lifecycle",
        rep.lifecycle
            .as_ref()
            .expect("the report carries the lifecycle"),
    );
    assert!(lifecycle.is_lifecycle(), "{doc}");
    assert!(!lifecycle.wave.active, "{doc}");
    let restarted: Vec<&str> = rep
        .engines
        .iter()
        .filter(|e| e.restarted)
        .map(|e| e.iid.as_str())
        .collect();
    // d0 was restarted before d1 failed; the engines after d1 (p0) were not yet.
    assert_eq!(
        restarted,
        ["d1", "p0"],
        "--resume restarts only what is left: {}",
        doc
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
    let (data, control, _) = up.urls();
    // Two decode engines, so ejecting one never empties the role (the panic threshold keeps a
    // role's last engine in placement).
    let d1 = dev_engine(&up, "d1").pid;
    signal_pid(d1, nix::sys::signal::Signal::SIGKILL).expect("kill d1");
    let probe = RouterProbe {
        control: control.clone(),
        fast: Http::new(Duration::from_secs(30)),
    };
    let ejected = narwhal_testkit::wait_until(Duration::from_secs(60), || async {
        let _ = probe
            .fast
            .client()
            .post(format!("{data}/v1/completions"))
            .json(&json!({"model": "tiny-sim", "prompt": "hello", "max_tokens": 2}))
            .send()
            .await;
        let st = probe.state().await?;
        st.ejected.iter().any(|i| i == "d1").then_some(())
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
    let doc = one_document(&r);
    let status: StatusReport = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("not a status report: {e}: {doc}"));
    let d1_causes = status.ejected.get("d1").map(|e| &e.causes);
    assert!(
        causes
            .iter()
            .any(|c| d1_causes.and_then(|m| m.get(*c)).copied() >= Some(1)),
        "{doc}"
    );
    drop(up);
}
