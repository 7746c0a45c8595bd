//! Running commands to completion and watching processes the test did not start itself:
//! what the operator-tooling tests (narwhalctl, narwhal-dev, the packaging scripts) need.
//!
//! ```text
//!   run(cmd) / run_within(cmd, within)    exit code, stdout and stderr of one command
//!   ctl(router, args)                     narwhalctl --router ROUTER --request-timeout-s 30 ARGS
//!   blocking_until(within, f)             wait_until for synchronous tests: poll with a deadline
//!   exit_within(child, within)            a child's exit status, polled with a deadline
//!   alive(pid) / wait_all_dead(pids, ..)  /proc state of processes started by others
//!   json_values(text)                     every JSON document on a stdout
//! ```
//!
//! Like [`crate::wait_until`], nothing here sleeps to synchronise: every wait polls a condition
//! until a deadline (docs/testing.md).

use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::proc::bin_path;

/// How often the synchronous waits of this module poll.
const POLL: Duration = Duration::from_millis(20);

/// What one command did: its exit code (-1 when killed by a signal or by [`run_within`]'s
/// deadline), stdout and stderr.
#[derive(Debug, Clone)]
pub struct CommandOutput {
    /// Exit code; -1 when it has none.
    pub code: i32,
    /// Everything it printed on stdout.
    pub stdout: String,
    /// Everything it printed on stderr.
    pub stderr: String,
}

/// Runs `cmd` to completion with stdout and stderr captured.
///
/// # Panics
/// When the command cannot be started.
pub fn run(mut cmd: Command) -> CommandOutput {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("run {:?}: {e}", cmd.get_program()));
    CommandOutput {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `cmd` with stdout and stderr captured (to files, so a command that leaves children
/// holding the pipes cannot hang the test); kills it when it has not exited within `within`
/// (its code is then -1).
///
/// # Panics
/// When the command cannot be started or its output files cannot be made.
pub fn run_within(mut cmd: Command, within: Duration) -> CommandOutput {
    let dir = tempfile::tempdir().expect("tempdir");
    let (o, e) = (dir.path().join("out"), dir.path().join("err"));
    cmd.stdout(std::fs::File::create(&o).expect("stdout file"))
        .stderr(std::fs::File::create(&e).expect("stderr file"));
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {:?}: {e}", cmd.get_program()));
    let code = match exit_within(&mut child, within) {
        Some(status) => status.code().unwrap_or(-1),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            -1
        }
    };
    CommandOutput {
        code,
        stdout: std::fs::read_to_string(&o).unwrap_or_default(),
        stderr: std::fs::read_to_string(&e).unwrap_or_default(),
    }
}

/// Runs `narwhalctl --router <router> --request-timeout-s 30 <args>` to completion.
///
/// # Panics
/// When the binary cannot be run.
pub fn ctl(router: &str, args: &[&str]) -> CommandOutput {
    let mut cmd = Command::new(bin_path("narwhalctl"));
    cmd.args(["--router", router, "--request-timeout-s", "30"])
        .args(args);
    run(cmd)
}

/// Polls `f` every 20 ms on this thread until it returns `Some`, or `within` passes (then
/// `None`): [`crate::wait_until`] for synchronous tests.
pub fn blocking_until<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(POLL);
    }
}

/// Waits (at most `within`) for `child` to exit; its status, or `None` while it still runs.
/// The child is reaped when it exited; otherwise it is left running.
pub fn exit_within(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    blocking_until(within, || child.try_wait().ok().flatten())
}

/// Whether process `pid` exists and is neither a zombie nor dead (`/proc/<pid>/stat`).
pub fn alive(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
        .unwrap_or("");
    state != "Z" && state != "X"
}

/// Waits (at most `within`) until none of `pids` (`(name, pid)`) is [`alive`]; the ones still
/// alive then, as `name (pid N)` (empty when all died).
pub fn wait_all_dead(pids: &[(String, i32)], within: Duration) -> Vec<String> {
    let left = || -> Vec<String> {
        pids.iter()
            .filter(|(_, p)| alive(*p))
            .map(|(n, p)| format!("{n} (pid {p})"))
            .collect()
    };
    blocking_until(within, || left().is_empty().then_some(())).map_or_else(left, |()| Vec::new())
}

/// Every JSON value in `text` (whitespace-separated documents, as `narwhalctl --json` prints).
///
/// # Panics
/// When `text` holds anything else.
pub fn json_values(text: &str) -> Vec<Value> {
    serde_json::Deserializer::from_str(text)
        .into_iter::<Value>()
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_else(|e| panic!("stdout is not only JSON ({e}):\n{text}"))
}

/// Sends `sig` to process `pid` (one the test did not start, e.g. a child of `narwhal-dev`).
///
/// # Errors
/// The OS error when the signal cannot be sent.
pub fn signal_pid(pid: i32, sig: nix::sys::signal::Signal) -> nix::Result<()> {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig)
}
