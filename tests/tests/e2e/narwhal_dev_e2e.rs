//! `narwhal-dev` session hygiene (docs/operate.md, the local dev fleet): a second session in a
//! busy directory is refused naming the holder, `restart --dir` finds a session whose ready file
//! is elsewhere, and every process of a session dies with it, whether `kill -9` hits the
//! supervisor the user started or the fleet process under it.

use std::process::{Command, Stdio};
use std::time::Duration;

use narwhal_shared::documents::State;
use narwhal_testkit::{
    DevUp, alive, bin_path, parse_document, run, run_within, signal_pid, wait_all_dead,
};
use serde::Deserialize;

/// A `narwhal-dev up` session's ready file (`narwhal.dev-fleet`), the members these tests read.
#[derive(Debug, Deserialize)]
struct DevReady {
    /// The fleet process.
    dev_pid: i64,
    /// The engines, in fleet order.
    engines: Vec<DevEngine>,
}

/// One of [`DevReady`]'s engines.
#[derive(Debug, Deserialize)]
struct DevEngine {
    pid: i64,
}

/// `up`'s ready file, typed.
fn ready_of(up: &DevUp) -> DevReady {
    let doc = up.doc();
    serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("not a narwhal-dev ready file ({e}): {doc}"))
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
    let holder = ready_of(&up).dev_pid;
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
    let old = ready_of(&up).engines[0].pid;
    let mut cmd = Command::new(bin_path("narwhal-dev"));
    cmd.args(["restart", "p0", "--dir"]).arg(&dir);
    let r = run(cmd);
    assert_eq!(r.code, 0, "restart --dir: {}{}", r.stdout, r.stderr);
    let new = ready_of(&up).engines[0].pid;
    assert_ne!(old, new, "p0 has a new process");
    assert!(alive(new as i32));

    // kill -9 of the process the user started: every child goes with it.
    let pids = up.pids();
    signal_pid(up.pid(), nix::sys::signal::Signal::SIGKILL).expect("kill -9");
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
    let fleet_pid = ready_of(&up).dev_pid as i32;
    assert_ne!(fleet_pid, up.pid(), "the fleet runs in its own process");
    signal_pid(fleet_pid, nix::sys::signal::Signal::SIGKILL).expect("kill -9");
    let left = wait_all_dead(&pids, Duration::from_secs(60));
    assert!(
        left.is_empty(),
        "still running after kill -9 of the fleet process: {left:?}"
    );
    // The supervisor reports the kill as its own exit (128 + 9).
    let status = up
        .wait_exit(Duration::from_secs(30))
        .expect("the supervisor did not exit");
    assert_eq!(status.code(), Some(137), "{status}");
    let log = up.log();
    assert!(log.contains("stopped them"), "{log}");
}

/// The README's first command as a newcomer runs it: the demo passes, its role-controller
/// tour prints a flip with the decision's reason and the controller's counters from
/// `/metrics`, and it leaves nothing in the temporary directory it was given.
#[test]
fn the_demo_shows_a_controller_flip_and_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(bin_path("narwhal-dev"));
    cmd.arg("demo")
        .env("TMPDIR", tmp.path())
        .stdin(Stdio::null());
    let r = run_within(cmd, Duration::from_secs(400));
    let out = format!("{}{}", r.stdout, r.stderr);
    assert_eq!(r.code, 0, "narwhal-dev demo failed:\n{out}");
    let applied = out
        .lines()
        .find(|l| l.contains(" applied ") && l.contains("by reactive: "))
        .unwrap_or_else(|| panic!("no applied controller decision printed:\n{out}"));
    let reason = applied.split("by reactive: ").nth(1).unwrap_or("");
    assert!(
        !reason.trim().is_empty(),
        "a decision without its reason: {applied}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("flip: ") && l.contains(" to prefill by reactive")),
        "no flip printed:\n{out}"
    );
    assert!(out.contains("role check of "), "{out}");
    for family in [
        "narwhal_flips_total{",
        "narwhal_controller_decisions_total{",
    ] {
        assert!(
            out.lines().any(|l| l.trim_start().starts_with(family)),
            "no {family} from /metrics printed:\n{out}"
        );
    }
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("read TMPDIR")
        .map(|e| e.expect("entry").path())
        .collect();
    assert!(left.is_empty(), "the demo left {left:?} behind");
}

/// `narwhal-dev up` runs the role controller by default (profiles in its fleet file, the
/// counters on `/metrics`); `--no-controller` leaves it off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dev_fleet_runs_the_role_controller_unless_told_not_to() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (name, extra, want) in [
        ("on", &["--hosts", "1"][..], "reactive"),
        ("off", &["--hosts", "1", "--no-controller"][..], "off"),
    ] {
        let dir = tmp.path().join(name);
        let up = tokio::task::block_in_place(|| DevUp::start(&dir, None, extra));
        let (_, control, _) = up.urls();
        let http = narwhal_testkit::http_client().build().expect("client");
        let (status, state) =
            narwhal_testkit::get_text(&http, format!("{control}/narwhal/state")).await;
        assert_eq!(status, 200);
        let state: State = parse_document("/narwhal/state", &state);
        assert_eq!(state.controller.controller, want, "controller {name}");
        let (status, metrics) =
            narwhal_testkit::get_text(&http, format!("{control}/metrics")).await;
        assert_eq!(status, 200);
        for family in ["narwhal_flips_total", "narwhal_controller_decisions_total"] {
            assert_eq!(
                metrics.contains(&format!("# TYPE {family} counter")),
                want == "reactive",
                "{family} with the controller {name}:\n{metrics}"
            );
        }
        tokio::task::block_in_place(|| drop(up));
    }
}
