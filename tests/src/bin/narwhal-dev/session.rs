//! How a `narwhal-dev up` (or `demo`) session owns its processes and its directory.
//!
//! ```text
//!  shell ── narwhal-dev up (supervisor: the pid the user sees, in the caller's process group)
//!              │  forwards SIGINT/SIGTERM/SIGHUP as SIGTERM; reaps and kills the group if the
//!              │  fleet process dies without stopping its children
//!              └── narwhal-dev up (fleet process: leader of a new process group, parent-death
//!                     │            signal SIGTERM, holds DIR/narwhal-dev.lock)
//!                     ├── narwhal-engine-sim …   (same process group)
//!                     ├── narwhal-agent …
//!                     └── narwhal-serve …
//! ```
//!
//! Why two processes (a `kill -9` of `narwhal-dev up` used to leave every child running): a process
//! killed by SIGKILL runs no code, so something else must notice. The fleet process asks the kernel
//! for SIGTERM when its parent dies (`PR_SET_PDEATHSIG`, set in the fleet process itself through
//! nix's safe wrapper, so no `pre_exec` and no `unsafe`), and SIGTERM stops the fleet the same way
//! Ctrl-C does (routers first, gracefully). If the fleet process itself is killed, the supervisor
//! (a child subreaper, so the orphans become its children) signals the fleet's process group:
//! SIGTERM, then SIGKILL after [`GROUP_GRACE`]. The fleet gets its own process group so that
//! signalling it never reaches the user's shell or script.
//!
//! The directory lock (`DIR/narwhal-dev.lock`, an advisory `flock` released by the kernel when
//! its holder dies, however it dies) makes a second `up` in a busy directory fail at once with
//! the holder's pid instead of overwriting its certificates and ready file.
//!
//! `DIR/narwhal-dev.json` (schema `narwhal.dev-session` v1: `pid`, `supervisor_pid`,
//! `dev_control`, `ready_file`, `dir`) is how `narwhal-dev restart --dir DIR` finds the running
//! session's restart endpoint, wherever `--ready-file` put the ready document.

use std::fs::File;
use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use serde_json::{Value, json};

/// Environment variable naming the supervisor's pid; set only on the fleet process.
pub(crate) const SUPERVISOR_ENV: &str = "NARWHAL_DEV_SUPERVISOR_PID";

/// File name of the directory lock inside `--dir`.
pub(crate) const LOCK_FILE: &str = "narwhal-dev.lock";

/// File name of the session document inside `--dir`.
pub(crate) const SESSION_FILE: &str = "narwhal-dev.json";

/// How long the supervisor waits after SIGTERM to an orphaned fleet before SIGKILL, seconds.
pub(crate) const GROUP_GRACE: Duration = Duration::from_secs(10);

/// Runs the supervisor: re-executes this binary with the same arguments as the fleet process
/// (new process group, parent-death signal) and waits for it. Returns the fleet process's exit
/// code (128 + signal number when it was killed by a signal).
pub(crate) fn supervise() -> ExitCode {
    // Orphans of the fleet process (its engines, agents and routers, when it is killed) are
    // re-parented to us, so we can reap them. Best effort: without it init reaps them.
    let _ = nix::sys::prctl::set_child_subreaper(true);
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("narwhal-dev: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // block_on polls on this (the main) thread, so the fleet process is forked by the main
    // thread: its parent-death signal fires when this process exits, not when a worker
    // thread does.
    rt.block_on(supervise_async())
}

async fn supervise_async() -> ExitCode {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut int, mut term, mut hup) = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(a), Ok(b), Ok(c)) => (a, b, c),
        _ => {
            eprintln!("narwhal-dev: cannot install signal handlers");
            return ExitCode::FAILURE;
        }
    };
    // /proc/self/exe names this very binary even if the file was replaced by a rebuild.
    let mut cmd = tokio::process::Command::new("/proc/self/exe");
    cmd.args(std::env::args_os().skip(1))
        .env(SUPERVISOR_ENV, std::process::id().to_string())
        .stdin(std::process::Stdio::null())
        .process_group(0);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("narwhal-dev: cannot start the fleet process: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Some(fleet_pid) = child.id().map(|p| Pid::from_raw(p as i32)) else {
        eprintln!("narwhal-dev: the fleet process exited at once");
        return ExitCode::FAILURE;
    };
    let mut signals = 0u32;
    let status = loop {
        tokio::select! {
            st = child.wait() => break st,
            _ = int.recv() => signals += 1,
            _ = term.recv() => signals += 1,
            _ = hup.recv() => signals += 1,
        }
        if signals == 1 {
            // The fleet process stops everything gracefully on SIGTERM (routers first).
            let _ = kill(fleet_pid, Signal::SIGTERM);
        } else {
            eprintln!("narwhal-dev: second interrupt, killing the fleet");
            let _ = killpg(fleet_pid, Signal::SIGKILL);
        }
    };
    // Whatever happened to the fleet process, nothing of its group may outlive the session.
    let leftovers = stop_group(fleet_pid, GROUP_GRACE);
    if leftovers > 0 {
        eprintln!(
            "narwhal-dev: the fleet process ended without stopping {leftovers} child process(es); stopped them"
        );
    }
    match status {
        Ok(st) => {
            use std::os::unix::process::ExitStatusExt as _;
            let code = st
                .code()
                .or_else(|| st.signal().map(|s| 128 + s))
                .unwrap_or(1);
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
        Err(e) => {
            eprintln!("narwhal-dev: waiting for the fleet process: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Signals process group `pgid` with SIGTERM, reaps what it can, and SIGKILLs whatever is
/// left after `grace`. Returns how many processes were still in the group at first (0 when
/// the group was already empty).
pub(crate) fn stop_group(pgid: Pid, grace: Duration) -> usize {
    let members = group_members(pgid);
    if members.is_empty() {
        reap_orphans();
        return 0;
    }
    let _ = killpg(pgid, Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        reap_orphans();
        if group_members(pgid).is_empty() {
            return members.len();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = killpg(pgid, Signal::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && !group_members(pgid).is_empty() {
        reap_orphans();
        std::thread::sleep(Duration::from_millis(20));
    }
    members.len()
}

/// Reaps every exited child (adopted orphans included) without blocking.
fn reap_orphans() {
    while let Ok(st) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
        if st == WaitStatus::StillAlive {
            break;
        }
    }
}

/// Live (non-zombie) processes whose process group is `pgid`, from `/proc/<pid>/stat`.
pub(crate) fn group_members(pgid: Pid) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            proc_stat(*pid).is_some_and(|(state, pgrp)| pgrp == pgid.as_raw() && state != 'Z')
        })
        .collect()
}

/// `(state, process group)` of `pid` from `/proc/<pid>/stat`; `None` when it is gone.
pub(crate) fn proc_stat(pid: i32) -> Option<(char, i32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let _ppid = f.next()?;
    let pgrp = f.next()?.parse().ok()?;
    Some((state, pgrp))
}

/// In the fleet process: ask for SIGTERM when the supervisor dies, and check it is still
/// there (it may have died before the request was made). Returns the supervisor's pid.
///
/// # Errors
/// A message when the variable is malformed, the request fails, or the supervisor is gone.
pub(crate) fn bind_to_supervisor(var: &str) -> Result<i32, String> {
    let sup: i32 = var
        .parse()
        .map_err(|_| format!("{SUPERVISOR_ENV}={var:?} is not a process id"))?;
    nix::sys::prctl::set_pdeathsig(Signal::SIGTERM)
        .map_err(|e| format!("cannot request a parent-death signal: {e}"))?;
    if nix::unistd::getppid().as_raw() != sup {
        return Err("the narwhal-dev supervisor exited before the fleet started".into());
    }
    Ok(sup)
}

/// An exclusive advisory lock on `DIR/narwhal-dev.lock`, held for the session's lifetime and
/// released by the kernel when the process ends (also under `kill -9`).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: File,
}

impl DirLock {
    /// Creates `dir` if needed and takes its lock without waiting.
    ///
    /// # Errors
    /// When another process holds it: a message naming the directory, the holder's pid (read
    /// from the lock file) and what to do.
    pub(crate) fn acquire(dir: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let path = dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("open {}: {e}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = holder.trim();
                return Err(format!(
                    "{} is in use by another narwhal-dev session ({}; lock {}): stop it, or pass another --dir",
                    dir.display(),
                    if holder.is_empty() {
                        "pid unknown".to_string()
                    } else {
                        format!("pid {holder}")
                    },
                    path.display()
                ));
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(format!("lock {}: {e}", path.display()));
            }
        }
        file.set_len(0)
            .and_then(|()| file.write_all(format!("{}\n", std::process::id()).as_bytes()))
            .map_err(|e| format!("write {}: {e}", path.display()))?;
        Ok(DirLock { _file: file })
    }

    /// True while some process holds the lock of `dir` (false when the file does not exist).
    pub(crate) fn is_held(dir: &Path) -> bool {
        let Ok(file) = File::open(dir.join(LOCK_FILE)) else {
            return false;
        };
        matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock))
    }
}

/// What `restart` reads of the session document or the ready file (both name it).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct NamesDevControl {
    /// The session's restart endpoint, `http://127.0.0.1:PORT`.
    dev_control: Option<String>,
}

/// The session document written into `dir` once the fleet is up.
pub(crate) fn session_doc(dir: &Path, dev_control: &str, ready_file: &Path) -> Value {
    json!({
        "schema": "narwhal.dev-session",
        "schema_version": 1,
        "pid": std::process::id(),
        "supervisor_pid": std::env::var(SUPERVISOR_ENV).ok().and_then(|v| v.parse::<u32>().ok()),
        "dir": dir,
        "dev_control": dev_control,
        "ready_file": ready_file,
    })
}

/// Reads the running session's restart endpoint (`dev_control`) for `dir`: from
/// `DIR/narwhal-dev.json`, else (a session started by an older `narwhal-dev`) from
/// `DIR/fleet.ready.json`.
///
/// # Errors
/// A message saying whether no session runs in `dir` (its lock is free) or its documents are
/// unreadable.
pub(crate) fn dev_control_of(dir: &Path) -> Result<String, String> {
    let mut problems = Vec::new();
    for name in [SESSION_FILE, "fleet.ready.json"] {
        let path = dir.join(name);
        let doc: Result<NamesDevControl, String> = std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()));
        match doc {
            Ok(d) => match d.dev_control.filter(|s| !s.is_empty()) {
                Some(url) => return Ok(url),
                None => problems.push(format!("{} names no dev_control endpoint", path.display())),
            },
            Err(e) => problems.push(format!("{}: {e}", path.display())),
        }
    }
    if !DirLock::is_held(dir) {
        return Err(format!(
            "no `narwhal-dev up --dir {}` is running (its lock {} is not held)",
            dir.display(),
            dir.join(LOCK_FILE).display()
        ));
    }
    Err(format!(
        "the session in {} is running but its restart endpoint is unknown (still starting?): {}",
        dir.display(),
        problems.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_a_busy_dir_names_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = DirLock::acquire(dir.path()).unwrap();
        assert!(DirLock::is_held(dir.path()));
        // flock locks belong to the open file description: a second open in this process
        // conflicts just as another process would.
        let err = DirLock::acquire(dir.path()).unwrap_err();
        assert!(
            err.contains("in use by another narwhal-dev session"),
            "{err}"
        );
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        assert!(!DirLock::is_held(dir.path()));
        DirLock::acquire(dir.path()).unwrap();
    }

    #[test]
    fn proc_stat_reads_state_and_group_even_with_odd_names() {
        let me = std::process::id() as i32;
        let (state, pgrp) = proc_stat(me).unwrap();
        assert!(matches!(state, 'R' | 'S'), "{state}");
        assert_eq!(pgrp, nix::unistd::getpgrp().as_raw());
        assert!(proc_stat(i32::MAX).is_none());
    }

    #[test]
    fn dev_control_of_a_dir_without_a_session_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let err = dev_control_of(dir.path()).unwrap_err();
        assert!(err.contains("is running"), "{err}");
        std::fs::write(
            dir.path().join(SESSION_FILE),
            session_doc(
                dir.path(),
                "http://127.0.0.1:9",
                Path::new("/elsewhere/ready.json"),
            )
            .to_string(),
        )
        .unwrap();
        assert_eq!(dev_control_of(dir.path()).unwrap(), "http://127.0.0.1:9");
    }
}
