//! `narwhal-dev` session hygiene (docs/operate.md, the local dev fleet): a second session in a
//! busy directory is refused naming the holder, `restart --dir` finds a session whose ready file
//! is elsewhere, and every process of a session dies with it, whether `kill -9` hits the
//! supervisor the user started or the fleet process under it.

use std::process::{Command, Stdio};
use std::time::Duration;

use narwhal_testkit::{DevUp, alive, bin_path, run, run_within, signal_pid, wait_all_dead};

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
    let fleet_pid = up.doc()["dev_pid"].as_i64().unwrap() as i32;
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
