//! The scripts `packaging/` ships to operators, run for real:
//! `packaging/narwhal-restart-remote` (the restart command `narwhalctl wave-restart` runs over
//! ssh, docs/operate.md) must return only once the old engine process has exited and the new
//! one serves, and name what did not happen when it fails.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use narwhal_testkit::{
    alive, bin_path, engine_port, poll_blocking, run_within, signal_pid, write_executable,
};

/// `packaging/narwhal-restart-remote`, through a fake `ssh` that runs the remote command on
/// this machine: it must return only once the old engine process has exited and the new one
/// answers `/health`, and fail with exit 3 when the new engine never serves.
#[test]
fn restart_remote_wrapper_blocks_until_the_old_pid_exits_and_the_new_engine_serves() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/narwhal-restart-remote");
    let sim = bin_path("narwhal-engine-sim");
    let port = engine_port();
    let write_exec = |name: &str, body: &str| {
        let p = dir.join(name);
        write_executable(&p, body);
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
                let _ = signal_pid(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
    let _engine = KillEngine(dir.join("engine.pid"));
    assert!(Command::new(&launch).status().unwrap().success());
    assert!(
        poll_blocking(Duration::from_secs(60), healthy),
        "the first engine never served"
    );
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

/// vLLM's EngineCore (and its workers) run as children in the API server's process group and can
/// outlive a killed API server, holding the GPU memory the next engine needs: the wrapper must
/// also wait until every process of the old engine's group has exited, not only its main pid.
/// Here the "engine" leads its own group (as under systemd or `setsid`) with a child standing
/// for the EngineCore that exits 2.5 s after the main process. Before: the wrapper returned as
/// soon as the main pid was gone and the new engine served.
#[test]
fn restart_remote_wrapper_waits_for_the_old_engines_process_group() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/narwhal-restart-remote");
    let sim = bin_path("narwhal-engine-sim");
    let port = engine_port();
    let write_exec = |name: &str, body: &str| {
        let p = dir.join(name);
        write_executable(&p, body);
        p
    };
    let ssh = write_exec(
        "ssh",
        "#!/bin/sh\nwhile [ \"${1#-}\" != \"$1\" ]; do case \"$1\" in -o) shift 2;; *) shift;; esac; done\n\
         shift\nexec sh -c \"$*\"\n",
    );
    // The old engine: a group leader (setsid) whose child `sleep` is its EngineCore.
    let launch_old = write_exec(
        "launch-old",
        &format!(
            "#!/bin/sh\nsetsid sh -c 'echo $$ > {d}/engine.pid; sleep 600 & echo $! > {d}/core.pid; wait' </dev/null >/dev/null 2>&1 &\n",
            d = dir.display()
        ),
    );
    // The restart: the main process dies at once, its EngineCore 2.5 s later; the new engine
    // starts at once and serves within a second.
    write_exec(
        "restart",
        &format!(
            "#!/bin/sh\nold=$(cat {d}/engine.pid); core=$(cat {d}/core.pid)\n\
             kill -9 \"$old\"\n\
             (sleep 2.5; kill \"$core\") </dev/null >/dev/null 2>&1 &\n\
             sh -c 'echo $$ > {d}/engine.pid; exec {sim} --listen 127.0.0.1:{port}' </dev/null >/dev/null 2>&1 &\n\
             exit 0\n",
            d = dir.display(),
            sim = sim.display()
        ),
    );
    struct Kill(Vec<PathBuf>);
    impl Drop for Kill {
        fn drop(&mut self) {
            for p in &self.0 {
                if let Some(pid) = std::fs::read_to_string(p)
                    .ok()
                    .and_then(|s| s.trim().parse::<i32>().ok())
                {
                    let _ = signal_pid(pid, nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
    }
    let _kill = Kill(vec![dir.join("engine.pid"), dir.join("core.pid")]);
    assert!(Command::new(&launch_old).status().unwrap().success());
    let read_pid = |name: &str| -> i32 {
        std::fs::read_to_string(dir.join(name))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    };
    assert!(
        poll_blocking(Duration::from_secs(10), || read_pid("core.pid") > 0
            && alive(read_pid("core.pid"))),
        "the old engine never started"
    );
    let core = read_pid("core.pid");
    let mut c = Command::new("bash");
    c.arg(&script)
        .args(["--ssh", &ssh.display().to_string()])
        .args(["--restart", &format!("{}/restart", dir.display())])
        .args(["--pid-cmd", &format!("cat {}/engine.pid", dir.display())])
        .args(["--timeout", "60", "gpu-a.test", "narwhal-engine@x.service"])
        .arg(port.to_string());
    let t0 = Instant::now();
    let r = run_within(c, Duration::from_secs(120));
    let took = t0.elapsed();
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert!(
        !alive(core),
        "the old engine's EngineCore {core} still runs after the wrapper returned ({took:?})"
    );
    assert!(
        took >= Duration::from_millis(2400),
        "returned after {took:?}"
    );
    assert!(
        r.stderr.contains("of the old engine exited"),
        "{}",
        r.stderr
    );
}
