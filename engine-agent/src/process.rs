//! Process identity from `/proc` (DESIGN.md section 4; reference-notes 5.3).
//!
//! ```text
//!   ProcessLocator ──find_pid()──► pid ──read_identity()──► ProcessIdentity
//!     listen_port: socket inode in /proc/net/tcp{,6} (LISTEN) ─► owner of that inode in /proc/*/fd
//!     pid_file:    first integer in the file
//!     systemd_unit: `systemctl show --property=MainPID --value UNIT`
//! ```
//!
//! `/proc/<pid>/stat` is parsed after the **last** `)`, so a command name containing `) `,
//! spaces or newlines cannot shift fields. A zombie (`Z`), dead (`X`) or vanished process is an
//! error, never a stale answer. The rest comes from the `procfs` crate (socket tables, fd
//! targets, `btime`, `boot_id`, `CLK_TCK`).

use std::path::{Path, PathBuf};

use narwhal_shared::ProcessIdentity;
use procfs::net::TcpState;
use procfs::process::FDTarget;

/// How the agent finds an engine's process (agent config `engines[].process`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessLocator {
    /// The process that owns the TCP socket listening on this port (IPv4 or IPv6).
    ListenPort(u16),
    /// A pid file written by the engine's launcher.
    PidFile(PathBuf),
    /// The `MainPID` of a systemd unit.
    SystemdUnit(String),
}

/// Why an identity could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProcessError {
    /// No TCP socket is listening on the port.
    #[error("no process listens on TCP port {port}")]
    NoListener {
        /// The port.
        port: u16,
    },
    /// Sockets listen on the port but no visible process owns them (another pid namespace,
    /// or the agent lacks CAP_DAC_READ_SEARCH / CAP_SYS_PTRACE to read other users' fds).
    #[error("TCP port {port} (socket inodes {inodes:?}) has no owner visible in /proc/*/fd")]
    NoOwner {
        /// The port.
        port: u16,
        /// The listening socket inodes.
        inodes: Vec<u64>,
    },
    /// The process no longer exists.
    #[error("process {pid} vanished")]
    Vanished {
        /// The pid.
        pid: u32,
    },
    /// The process is a zombie or dead (`state` from `/proc/<pid>/stat`).
    #[error("process {pid} is not running (state {state})")]
    NotRunning {
        /// The pid.
        pid: u32,
        /// State letter (`Z` or `X`).
        state: char,
    },
    /// The process is exiting: its executable mapping is gone but it is not a zombie yet.
    #[error("process {pid} is exiting")]
    Exiting {
        /// The pid.
        pid: u32,
    },
    /// The process changed while it was being read (pid reused mid-read).
    #[error("process {pid} changed while being read (start_ticks {before} then {after})")]
    ChangedDuringRead {
        /// The pid.
        pid: u32,
        /// start_ticks on the first read.
        before: u64,
        /// start_ticks on the second read.
        after: u64,
    },
    /// `/proc/<pid>/stat` did not have the expected shape.
    #[error("/proc/{pid}/stat: {reason}")]
    StatFormat {
        /// The pid (0 when parsing text without one).
        pid: u32,
        /// What was wrong.
        reason: String,
    },
    /// A pid file could not be used.
    #[error("pid_file {path}: {reason}")]
    PidFile {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// `systemctl` could not give a MainPID.
    #[error("systemd_unit {unit}: {reason}")]
    Systemd {
        /// The unit.
        unit: String,
        /// What was wrong.
        reason: String,
    },
    /// Another `/proc` read failed.
    #[error("{what}: {reason}")]
    Proc {
        /// What was read.
        what: String,
        /// The error.
        reason: String,
    },
}

/// Fields the agent needs from `/proc/<pid>/stat`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatFields {
    /// Field 2, `comm`, without the parentheses (may contain anything, including `)`).
    pub comm: String,
    /// Field 3, state letter (`R`, `S`, `D`, `Z`, `X`, ...).
    pub state: char,
    /// Field 22, `starttime`: clock ticks after boot.
    pub start_ticks: u64,
}

/// Parses the text of `/proc/<pid>/stat`: `pid (comm) state ppid ... starttime ...`.
///
/// `comm` is everything between the first `(` and the **last** `)`; fields after it are split
/// on whitespace: index 0 is the state (proc(5) field 3), index 19 is `starttime` (field 22).
///
/// # Errors
/// [`ProcessError::StatFormat`] when the parentheses or fields are missing.
pub fn parse_stat(pid: u32, text: &str) -> Result<StatFields, ProcessError> {
    let bad = |reason: &str| ProcessError::StatFormat {
        pid,
        reason: reason.to_string(),
    };
    let open = text.find('(').ok_or_else(|| bad("no '('"))?;
    let close = text.rfind(')').ok_or_else(|| bad("no ')'"))?;
    if close < open {
        return Err(bad("')' before '('"));
    }
    let comm = text[open + 1..close].to_string();
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    let state_field = rest.first().ok_or_else(|| bad("no state field"))?;
    let mut chars = state_field.chars();
    let state = match (chars.next(), chars.next()) {
        (Some(c), None) => c,
        _ => {
            return Err(bad(&format!(
                "state field {state_field:?} is not one letter"
            )));
        }
    };
    let start = rest.get(19).ok_or_else(|| {
        bad(&format!(
            "{} fields after comm, need at least 20",
            rest.len()
        ))
    })?;
    let start_ticks = start
        .parse::<u64>()
        .map_err(|_| bad(&format!("starttime {start:?} is not an integer")))?;
    Ok(StatFields {
        comm,
        state,
        start_ticks,
    })
}

fn proc_err(what: impl Into<String>, e: impl std::fmt::Display) -> ProcessError {
    ProcessError::Proc {
        what: what.into(),
        reason: e.to_string(),
    }
}

fn read_stat(proc_root: &Path, pid: u32) -> Result<StatFields, ProcessError> {
    let path = proc_root.join(pid.to_string()).join("stat");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(nix::errno::Errno::ESRCH as i32) =>
        {
            return Err(ProcessError::Vanished { pid });
        }
        Err(e) => return Err(proc_err(path.display().to_string(), e)),
    };
    let fields = parse_stat(pid, &text)?;
    if matches!(fields.state, 'Z' | 'X' | 'x') {
        return Err(ProcessError::NotRunning {
            pid,
            state: fields.state,
        });
    }
    Ok(fields)
}

/// Reads the identity of `pid` now. `listen_port` is recorded as given.
///
/// `/proc/<pid>/stat` is read before and after the other fields; if `start_ticks` changed in
/// between (the pid was reused mid-read) the read fails rather than mixing two processes.
///
/// # Errors
/// [`ProcessError::Vanished`], [`ProcessError::NotRunning`], [`ProcessError::ChangedDuringRead`],
/// [`ProcessError::StatFormat`], or [`ProcessError::Proc`] for `boot_id`, `btime`, `exe`.
pub fn read_identity(pid: u32, listen_port: Option<u16>) -> Result<ProcessIdentity, ProcessError> {
    let root = Path::new("/proc");
    let first = read_stat(root, pid)?;
    let boot_id = procfs::sys::kernel::random::boot_id()
        .map_err(|e| proc_err("/proc/sys/kernel/random/boot_id", e))?
        .trim()
        .to_string();
    let btime = procfs::boot_time_secs().map_err(|e| proc_err("/proc/stat btime", e))?;
    let clk_tck = procfs::ticks_per_second();
    let exe = match std::fs::read_link(root.join(pid.to_string()).join("exe")) {
        Ok(p) => p.display().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // The process is exiting (its memory map, hence `exe`, is gone): say whether it
            // is already a zombie or gone, else that it is on its way out.
            read_stat(root, pid)?;
            return Err(ProcessError::Exiting { pid });
        }
        Err(e) => return Err(proc_err(format!("/proc/{pid}/exe"), e)),
    };
    let second = read_stat(root, pid)?;
    if second.start_ticks != first.start_ticks {
        return Err(ProcessError::ChangedDuringRead {
            pid,
            before: first.start_ticks,
            after: second.start_ticks,
        });
    }
    Ok(ProcessIdentity {
        pid,
        boot_id,
        start_ticks: first.start_ticks,
        clk_tck,
        btime,
        process_start_time_seconds: ProcessIdentity::start_time_seconds(
            btime,
            first.start_ticks,
            clk_tck,
        ),
        exe,
        listen_port,
    })
}

/// Inodes of TCP sockets in LISTEN state on `port` (IPv4 and IPv6 tables of the agent's
/// network namespace).
///
/// # Errors
/// [`ProcessError::Proc`] when neither table can be read.
pub(crate) fn listening_inodes(port: u16) -> Result<Vec<u64>, ProcessError> {
    let mut inodes = Vec::new();
    let v4 = procfs::net::tcp();
    let v6 = procfs::net::tcp6();
    if let (Err(e), Err(_)) = (&v4, &v6) {
        return Err(proc_err("/proc/net/tcp", e));
    }
    for entry in v4.into_iter().flatten().chain(v6.into_iter().flatten()) {
        if entry.state == TcpState::Listen && entry.local_address.port() == port && entry.inode != 0
        {
            inodes.push(entry.inode);
        }
    }
    inodes.sort_unstable();
    inodes.dedup();
    Ok(inodes)
}

/// Finds the process owning a socket with one of `inodes`; when several processes share it
/// (forked workers) the earliest started (then lowest pid) wins, i.e. the parent.
fn owner_of(port: u16, inodes: &[u64]) -> Result<u32, ProcessError> {
    let all = procfs::process::all_processes().map_err(|e| proc_err("/proc", e))?;
    let mut best: Option<(u64, u32)> = None;
    for proc_ in all.flatten() {
        let Ok(fds) = proc_.fd() else { continue };
        let owns = fds
            .flatten()
            .any(|fd| matches!(fd.target, FDTarget::Socket(ino) if inodes.contains(&ino)));
        if !owns {
            continue;
        }
        let pid = proc_.pid as u32;
        let Ok(stat) = read_stat(Path::new("/proc"), pid) else {
            continue;
        };
        let key = (stat.start_ticks, pid);
        if best.is_none_or(|b| key < b) {
            best = Some(key);
        }
    }
    best.map(|(_, pid)| pid)
        .ok_or_else(|| ProcessError::NoOwner {
            port,
            inodes: inodes.to_vec(),
        })
}

/// Resolves a locator to a pid and the listen port to record.
///
/// # Errors
/// [`ProcessError::NoListener`], [`ProcessError::NoOwner`], [`ProcessError::PidFile`] or
/// [`ProcessError::Systemd`].
pub fn find_pid(locator: &ProcessLocator) -> Result<(u32, Option<u16>), ProcessError> {
    match locator {
        ProcessLocator::ListenPort(port) => {
            let inodes = listening_inodes(*port)?;
            if inodes.is_empty() {
                return Err(ProcessError::NoListener { port: *port });
            }
            Ok((owner_of(*port, &inodes)?, Some(*port)))
        }
        ProcessLocator::PidFile(path) => {
            let bad = |reason: String| ProcessError::PidFile {
                path: path.clone(),
                reason,
            };
            let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
            let pid = text
                .split_whitespace()
                .next()
                .and_then(|t| t.parse::<u32>().ok())
                .filter(|p| *p > 0)
                .ok_or_else(|| bad(format!("{:?} does not start with a pid", text.trim())))?;
            Ok((pid, None))
        }
        ProcessLocator::SystemdUnit(unit) => {
            let bad = |reason: String| ProcessError::Systemd {
                unit: unit.clone(),
                reason,
            };
            let out = std::process::Command::new("systemctl")
                .args(["show", "--property=MainPID", "--value", "--", unit])
                .output()
                .map_err(|e| bad(format!("cannot run systemctl: {e}")))?;
            if !out.status.success() {
                return Err(bad(format!(
                    "systemctl exited {}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            let text = String::from_utf8_lossy(&out.stdout);
            match text.trim().parse::<u32>() {
                Ok(0) => Err(bad("unit has no running main process (MainPID=0)".into())),
                Ok(pid) => Ok((pid, None)),
                Err(_) => Err(bad(format!("MainPID {:?} is not a number", text.trim()))),
            }
        }
    }
}

fn owns_any(pid: u32, inodes: &[u64]) -> bool {
    let Ok(proc_) = procfs::process::Process::new(pid as i32) else {
        return false;
    };
    let Ok(fds) = proc_.fd() else {
        return false;
    };
    fds.flatten()
        .any(|fd| matches!(fd.target, FDTarget::Socket(ino) if inodes.contains(&ino)))
}

/// As [`locate`], but for a `listen_port` locator first checks whether `hint` (the pid found
/// last time) still owns the listening socket, which avoids scanning every process's fds. A
/// hint that no longer owns it falls back to the full scan, so the answer is the same.
///
/// # Errors
/// As [`locate`].
pub fn locate_with_hint(
    locator: &ProcessLocator,
    hint: Option<u32>,
) -> Result<ProcessIdentity, ProcessError> {
    if let (ProcessLocator::ListenPort(port), Some(pid)) = (locator, hint) {
        let inodes = listening_inodes(*port)?;
        if inodes.is_empty() {
            return Err(ProcessError::NoListener { port: *port });
        }
        if owns_any(pid, &inodes) {
            return read_identity(pid, Some(*port));
        }
        return read_identity(owner_of(*port, &inodes)?, Some(*port));
    }
    locate(locator)
}

/// Finds and reads the engine's identity now (blocking: call from `spawn_blocking`).
///
/// # Errors
/// Any [`ProcessError`] from [`find_pid`] and [`read_identity`].
pub fn locate(locator: &ProcessLocator) -> Result<ProcessIdentity, ProcessError> {
    let (pid, port) = find_pid(locator)?;
    read_identity(pid, port)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat_line(comm: &str, state: char, start: u64) -> String {
        // 52 fields as on Linux 5.x+; starttime is field 22.
        let mut fields: Vec<String> = vec![state.to_string()];
        for i in 4..=52 {
            fields.push(if i == 22 {
                start.to_string()
            } else {
                (i * 3).to_string()
            });
        }
        format!("4242 ({comm}) {}\n", fields.join(" "))
    }

    #[test]
    fn plain_command_name() {
        let f = parse_stat(4242, &stat_line("vllm", 'S', 987_654)).unwrap();
        assert_eq!(f.comm, "vllm");
        assert_eq!(f.state, 'S');
        assert_eq!(f.start_ticks, 987_654);
    }

    #[test]
    fn command_names_with_spaces_parens_and_newlines_do_not_shift_fields() {
        for comm in [
            "python3 -m vllm",
            "evil) S 1 2 3",
            ") R 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 (",
            "multi\nline\n) Z",
            "((()))",
            "",
        ] {
            let f = parse_stat(4242, &stat_line(comm, 'R', 123_456)).unwrap();
            assert_eq!(f.comm, comm, "comm {comm:?}");
            assert_eq!(f.state, 'R', "comm {comm:?}");
            assert_eq!(f.start_ticks, 123_456, "comm {comm:?}");
        }
    }

    #[test]
    fn truncated_or_malformed_stat_is_an_error() {
        assert!(matches!(
            parse_stat(1, "1 (x) S 1 2"),
            Err(ProcessError::StatFormat { .. })
        ));
        assert!(matches!(
            parse_stat(1, "1 x S"),
            Err(ProcessError::StatFormat { .. })
        ));
        let bad_start = stat_line("x", 'S', 777).replace(" 777 ", " nope ");
        match parse_stat(1, &bad_start) {
            Err(ProcessError::StatFormat { reason, .. }) => assert!(reason.contains("nope")),
            other => panic!("expected StatFormat, got {other:?}"),
        }
        let mut line = stat_line("x", 'S', 5);
        line = line.replacen(" S ", " SS ", 1);
        assert!(matches!(
            parse_stat(1, &line),
            Err(ProcessError::StatFormat { .. })
        ));
    }

    #[test]
    fn a_reused_pid_is_a_different_process() {
        // Same pid, same boot, new start_ticks: identity equality must say "different".
        let a = parse_stat(4242, &stat_line("engine", 'S', 1000)).unwrap();
        let b = parse_stat(4242, &stat_line("engine", 'S', 2000)).unwrap();
        let ident = |t: u64| ProcessIdentity {
            pid: 4242,
            boot_id: "boot".into(),
            start_ticks: t,
            clk_tck: 100,
            btime: 1,
            process_start_time_seconds: ProcessIdentity::start_time_seconds(1, t, 100),
            exe: "/bin/engine".into(),
            listen_port: None,
        };
        assert!(!ident(a.start_ticks).same_process(&ident(b.start_ticks)));
        assert!(ident(a.start_ticks).same_process(&ident(a.start_ticks)));
    }

    #[test]
    fn own_process_identity_is_readable_and_stable() {
        let me = std::process::id();
        let a = read_identity(me, None).unwrap();
        let b = read_identity(me, None).unwrap();
        assert!(a.same_process(&b));
        assert_eq!(a.pid, me);
        assert!(a.process_start_time_seconds > a.btime as f64 - 1.0);
        assert!(!a.boot_id.is_empty());
        assert!(!a.exe.is_empty());
    }

    #[test]
    fn a_zombie_is_an_error_and_a_reaped_process_has_vanished() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Poll (no sleep-as-synchronisation): the unreaped child becomes a zombie.
        let deadline = std::time::Duration::from_secs(10);
        let mut waited = std::time::Duration::ZERO;
        loop {
            match read_identity(pid, None) {
                Err(ProcessError::NotRunning { state: 'Z', .. }) => break,
                // Still running, or caught between exit and zombie: poll again.
                Ok(_)
                | Err(ProcessError::ChangedDuringRead { .. })
                | Err(ProcessError::Exiting { .. }) => {}
                Err(e) => panic!("unexpected {e}"),
            }
            assert!(waited < deadline, "child {pid} never became a zombie");
            std::thread::yield_now();
            std::thread::sleep(std::time::Duration::from_millis(5));
            waited += std::time::Duration::from_millis(5);
        }
        child.wait().unwrap();
        assert!(matches!(
            read_identity(pid, None),
            Err(ProcessError::Vanished { .. }) | Err(ProcessError::NotRunning { .. })
        ));
    }

    #[test]
    fn the_owner_of_a_listening_socket_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let id = locate(&ProcessLocator::ListenPort(port)).unwrap();
        assert_eq!(id.pid, std::process::id());
        assert_eq!(id.listen_port, Some(port));
        drop(listener);
        assert_eq!(
            locate(&ProcessLocator::ListenPort(port)),
            Err(ProcessError::NoListener { port })
        );
    }

    #[test]
    fn an_unknown_systemd_unit_is_a_named_error() {
        // Whether or not systemd runs here, an unknown unit has no MainPID.
        let unit = "narwhal-no-such-unit-for-tests.service";
        match locate(&ProcessLocator::SystemdUnit(unit.into())) {
            Err(ProcessError::Systemd { unit: u, .. }) => assert_eq!(u, unit),
            other => panic!("expected a Systemd error, got {other:?}"),
        }
    }

    #[test]
    fn a_stale_hint_falls_back_to_the_scan() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let loc = ProcessLocator::ListenPort(port);
        let me = std::process::id();
        assert_eq!(locate_with_hint(&loc, Some(me)).unwrap().pid, me);
        // pid 1 does not own our socket: the scan still finds us.
        assert_eq!(locate_with_hint(&loc, Some(1)).unwrap().pid, me);
        drop(listener);
        assert_eq!(
            locate_with_hint(&loc, Some(me)),
            Err(ProcessError::NoListener { port })
        );
    }

    #[test]
    fn pid_files_are_read_and_bad_ones_named() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("engine.pid");
        std::fs::write(&good, format!("{}\n", std::process::id())).unwrap();
        assert_eq!(
            locate(&ProcessLocator::PidFile(good)).unwrap().pid,
            std::process::id()
        );
        let bad = dir.path().join("bad.pid");
        std::fs::write(&bad, "nope").unwrap();
        assert!(matches!(
            locate(&ProcessLocator::PidFile(bad)),
            Err(ProcessError::PidFile { .. })
        ));
    }
}
