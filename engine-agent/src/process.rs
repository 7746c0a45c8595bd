//! Process identity from `/proc` (architecture.md section 4; behaviour.md 5.3).
//!
//! ```text
//!   ProcessLocator ──find_pid()──► pid ──read_identity()──► ProcessIdentity
//!     listen_port: socket inode in /proc/net/tcp{,6} (LISTEN) ─► owner of that inode in /proc/*/fd
//!     pid_file:    first integer in the file
//!     systemd_unit: `systemctl show --property=MainPID --value UNIT`
//! ```
//!
//! Reading an engine by port once costs a scan of every socket on the host (`/proc/net/tcp` is
//! O(sockets): about 10-20 ms with 2-3k sockets) plus, on a miss, every process's fds. So the
//! agent keeps what the scan found per engine ([`ResolvedOwner`]: pid, start ticks, fd, inode)
//! and the next read only re-checks it ([`read_port_identity`]):
//!
//! ```text
//!   cached owner ──► /proc/<pid>/fd/<fd> still socket:[inode]? ──► /proc/<pid>/stat start_ticks
//!        │                     │ no (closed, rebound)                 │ differs (pid reused) /
//!        │                     ▼                                      ▼ zombie / vanished
//!        │                full scan ◄─────────────────────────────────┘
//!        └─ both hold ─► identity (fresh stat, exe, btime, boot_id), path "cached"
//! ```
//! The socket check comes before the stat read, so a matching start time proves the same
//! process held the socket at the check; a scan's answer is confirmed the same way before it
//! is cached or returned, so neither path can pair one process's identity with another's
//! socket.
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
    /// The owner of the port changed between finding it and reading it, twice in a row.
    #[error("the owner of TCP port {port} changed while being read: {reason}")]
    OwnerChanged {
        /// The port.
        port: u16,
        /// What changed.
        reason: String,
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

/// The process owning a socket with one of `inodes` (scanning every process's fds), as a
/// [`ResolvedOwner`]; when several processes share it (forked workers) the earliest started
/// (then lowest pid) wins, i.e. the parent.
fn owner_of(port: u16, inodes: &[u64]) -> Result<ResolvedOwner, ProcessError> {
    let all = procfs::process::all_processes().map_err(|e| proc_err("/proc", e))?;
    let mut best: Option<ResolvedOwner> = None;
    for proc_ in all.flatten() {
        let pid = proc_.pid as u32;
        let Some((fd, inode)) = socket_fd_among(pid, inodes) else {
            continue;
        };
        let Ok(stat) = read_stat(Path::new("/proc"), pid) else {
            continue;
        };
        let found = ResolvedOwner {
            pid,
            start_ticks: stat.start_ticks,
            fd,
            inode,
        };
        if best.is_none_or(|b| (found.start_ticks, found.pid) < (b.start_ticks, b.pid)) {
            best = Some(found);
        }
    }
    best.ok_or_else(|| ProcessError::NoOwner {
        port,
        inodes: inodes.to_vec(),
    })
}

/// The first fd of `pid` that is a socket with one of `inodes`, and that inode.
fn socket_fd_among(pid: u32, inodes: &[u64]) -> Option<(u32, u64)> {
    let fds = procfs::process::Process::new(pid as i32).ok()?.fd().ok()?;
    fds.flatten().find_map(|fd| match fd.target {
        FDTarget::Socket(ino) if inodes.contains(&ino) => Some((fd.fd as u32, ino)),
        _ => None,
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
            Ok((owner_of(*port, &inodes)?.pid, Some(*port)))
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

/// As [`locate`], but for a `listen_port` locator first checks whether `hint` (the pid found
/// last time) still owns the listening socket, which avoids scanning every process's fds (the
/// socket tables are still read). A hint that no longer owns it falls back to the full scan,
/// so the answer is the same. Kept for comparison ([`read_port_identity`] is what the agent
/// uses).
///
/// # Errors
/// As [`locate`].
pub fn locate_with_hint(
    locator: &ProcessLocator,
    hint: Option<u32>,
) -> Result<ProcessIdentity, ProcessError> {
    if let (ProcessLocator::ListenPort(port), Some(_)) = (locator, hint) {
        let owner = LiveProc.scan(*port, hint)?;
        return read_identity(owner.pid, Some(*port));
    }
    locate(locator)
}

/// What a full scan found for a listening port, kept to re-check the next read cheaply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedOwner {
    /// The owning process.
    pub pid: u32,
    /// Its `starttime` (proc(5) field 22), read after its fds were seen holding the socket.
    pub start_ticks: u64,
    /// The fd number that held the socket in that process.
    pub fd: u32,
    /// The listening socket's inode.
    pub inode: u64,
}

/// Which way an identity read went (metric label `path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPath {
    /// The cached owner still held the socket and had the same start time.
    Cached,
    /// The socket tables (and, unless the previous pid still owned it, every process's fds)
    /// were scanned.
    Scan,
    /// A pid file or a systemd unit named the pid; nothing to cache.
    Direct,
}

impl ReadPath {
    /// `cached`, `scan` or `direct`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReadPath::Cached => "cached",
            ReadPath::Scan => "scan",
            ReadPath::Direct => "direct",
        }
    }
}

/// Why a cached owner could not be reused (logged; each kind forces a full scan).
#[derive(Debug, Clone, PartialEq)]
pub enum Mismatch {
    /// `/proc/<pid>/fd/<fd>` no longer is the listening socket (closed, rebound, or the pid is
    /// gone).
    SocketGone {
        /// The cached pid.
        pid: u32,
        /// The cached socket inode.
        inode: u64,
    },
    /// The pid holds the socket but is another process now, or the start time moved.
    Restarted {
        /// The pid.
        pid: u32,
        /// Cached start ticks.
        before: u64,
        /// Start ticks now.
        after: u64,
    },
    /// The process could not be read (vanished, zombie, exiting).
    Unreadable(ProcessError),
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mismatch::SocketGone { pid, inode } => {
                write!(f, "pid {pid} no longer holds socket inode {inode}")
            }
            Mismatch::Restarted { pid, before, after } => {
                write!(f, "pid {pid} start_ticks {before} became {after}")
            }
            Mismatch::Unreadable(e) => write!(f, "{e}"),
        }
    }
}

/// The `/proc` reads [`read_port_identity`] needs; [`LiveProc`] is the real one, tests fake it.
pub trait ProcView {
    /// The socket inode `/proc/<pid>/fd/<fd>` points to, if it is a socket (None when the fd
    /// or the process is gone or not a socket).
    fn socket_inode(&self, pid: u32, fd: u32) -> Option<u64>;
    /// A fresh identity of `pid` ([`read_identity`]).
    fn identity(&self, pid: u32, port: u16) -> Result<ProcessIdentity, ProcessError>;
    /// The full scan: listening inodes of `port`, then their owner (`hint` first).
    fn scan(&self, port: u16, hint: Option<u32>) -> Result<ResolvedOwner, ProcessError>;
}

/// `/proc` of the agent's pid and network namespace.
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveProc;

impl ProcView for LiveProc {
    fn socket_inode(&self, pid: u32, fd: u32) -> Option<u64> {
        let link = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()?;
        let text = link.to_str()?;
        text.strip_prefix("socket:[")?
            .strip_suffix(']')?
            .parse()
            .ok()
    }

    fn identity(&self, pid: u32, port: u16) -> Result<ProcessIdentity, ProcessError> {
        read_identity(pid, Some(port))
    }

    fn scan(&self, port: u16, hint: Option<u32>) -> Result<ResolvedOwner, ProcessError> {
        let inodes = listening_inodes(port)?;
        if inodes.is_empty() {
            return Err(ProcessError::NoListener { port });
        }
        if let Some(pid) = hint
            && let Some((fd, inode)) = socket_fd_among(pid, &inodes)
            && let Ok(stat) = read_stat(Path::new("/proc"), pid)
        {
            return Ok(ResolvedOwner {
                pid,
                start_ticks: stat.start_ticks,
                fd,
                inode,
            });
        }
        owner_of(port, &inodes)
    }
}

/// Re-checks `owner`: its fd still holds the socket (read first), then a fresh identity with
/// the same start ticks. Passing proves that process held the socket at the fd read.
fn confirm(
    view: &impl ProcView,
    port: u16,
    owner: &ResolvedOwner,
) -> Result<ProcessIdentity, Mismatch> {
    if view.socket_inode(owner.pid, owner.fd) != Some(owner.inode) {
        return Err(Mismatch::SocketGone {
            pid: owner.pid,
            inode: owner.inode,
        });
    }
    match view.identity(owner.pid, port) {
        Ok(id) if id.start_ticks == owner.start_ticks => Ok(id),
        Ok(id) => Err(Mismatch::Restarted {
            pid: owner.pid,
            before: owner.start_ticks,
            after: id.start_ticks,
        }),
        Err(e) => Err(Mismatch::Unreadable(e)),
    }
}

/// What one [`read_port_identity`] did.
#[derive(Debug)]
pub struct PortRead {
    /// The identity, or why there is none.
    pub result: Result<ProcessIdentity, ProcessError>,
    /// Cached or scan.
    pub path: ReadPath,
    /// Why the cached owner was not reused (None on a hit or with nothing cached).
    pub mismatch: Option<Mismatch>,
    /// What to cache for the next read (None after an error).
    pub owner: Option<ResolvedOwner>,
}

/// Reads the identity of the process listening on `port`, re-checking `cached` (the owner the last
/// read found) before scanning (architecture.md section 4).
///
/// A cached owner is used only if its fd still holds the same socket inode and its pid still
/// has the same start ticks; anything else (socket closed or replaced, pid reused, zombie,
/// vanished) forces the full scan, whose answer is confirmed the same way (one rescan if the
/// owner changed in between). So a restarted engine is never reported with the old identity.
///
/// Blocking: call from `spawn_blocking`.
pub fn read_port_identity(
    view: &impl ProcView,
    port: u16,
    cached: Option<ResolvedOwner>,
) -> PortRead {
    let mut mismatch = None;
    if let Some(owner) = cached {
        match confirm(view, port, &owner) {
            Ok(id) => {
                return PortRead {
                    result: Ok(id),
                    path: ReadPath::Cached,
                    mismatch: None,
                    owner: Some(owner),
                };
            }
            Err(m) => mismatch = Some(m),
        }
    }
    let hint = cached.map(|o| o.pid);
    let mut last = None;
    for _ in 0..2 {
        let found = match view.scan(port, hint) {
            Ok(o) => o,
            Err(e) => {
                return PortRead {
                    result: Err(e),
                    path: ReadPath::Scan,
                    mismatch,
                    owner: None,
                };
            }
        };
        match confirm(view, port, &found) {
            Ok(id) => {
                return PortRead {
                    result: Ok(id),
                    path: ReadPath::Scan,
                    mismatch,
                    owner: Some(found),
                };
            }
            Err(m) => last = Some(m),
        }
    }
    let error = match last {
        // The owner the scan found is dying (zombie, exiting, vanished): say so.
        Some(Mismatch::Unreadable(e)) => e,
        other => ProcessError::OwnerChanged {
            port,
            reason: other.map_or_else(String::new, |m| m.to_string()),
        },
    };
    PortRead {
        result: Err(error),
        path: ReadPath::Scan,
        mismatch,
        owner: None,
    }
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
// Tests of live /proc poll with wall-clock deadlines: the clock ban is for product code.
#[allow(clippy::disallowed_methods)]
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
        assert_port_left(locate(&ProcessLocator::ListenPort(port)), port);
    }

    /// After our listener closed, the port is never attributed to us. Usually nothing listens
    /// there (`NoListener`); on a busy machine another process may already have bound the
    /// freed ephemeral port (seen under a loaded test run: `NoOwner`, its socket's owner not
    /// yet visible, or that process itself).
    fn assert_port_left(found: Result<ProcessIdentity, ProcessError>, port: u16) {
        match found {
            Err(ProcessError::NoListener { port: p })
            | Err(ProcessError::NoOwner { port: p, .. }) => {
                assert_eq!(p, port)
            }
            Ok(id) => assert_ne!(id.pid, std::process::id(), "a closed socket is still ours"),
            Err(e) => panic!("port {port}: {e:?}"),
        }
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
        assert_port_left(locate_with_hint(&loc, Some(me)), port);
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

    // ---- the cached owner: a fake /proc for every mismatch kind ----

    use std::cell::RefCell;
    use std::collections::HashMap;

    /// A scripted `/proc`: processes (pid -> start_ticks, or an error), their socket fds, and
    /// the answers of successive scans. Counts scans so a test can see which path ran.
    #[derive(Default)]
    struct FakeProc {
        procs: HashMap<u32, Result<u64, ProcessError>>,
        fds: HashMap<(u32, u32), u64>,
        scans: RefCell<Vec<Result<ResolvedOwner, ProcessError>>>,
        scanned: RefCell<usize>,
    }

    impl FakeProc {
        fn process(mut self, pid: u32, start: u64, fd: u32, inode: u64) -> Self {
            self.procs.insert(pid, Ok(start));
            self.fds.insert((pid, fd), inode);
            self
        }
        fn scan_finds(self, r: Result<ResolvedOwner, ProcessError>) -> Self {
            self.scans.borrow_mut().push(r);
            self
        }
        fn scans(&self) -> usize {
            *self.scanned.borrow()
        }
    }

    impl ProcView for FakeProc {
        fn socket_inode(&self, pid: u32, fd: u32) -> Option<u64> {
            self.fds.get(&(pid, fd)).copied()
        }
        fn identity(&self, pid: u32, port: u16) -> Result<ProcessIdentity, ProcessError> {
            let start = self
                .procs
                .get(&pid)
                .cloned()
                .unwrap_or(Err(ProcessError::Vanished { pid }))?;
            Ok(ProcessIdentity {
                pid,
                boot_id: "boot".into(),
                start_ticks: start,
                clk_tck: 100,
                btime: 1,
                process_start_time_seconds: ProcessIdentity::start_time_seconds(1, start, 100),
                exe: "/bin/engine".into(),
                listen_port: Some(port),
            })
        }
        fn scan(&self, port: u16, _hint: Option<u32>) -> Result<ResolvedOwner, ProcessError> {
            *self.scanned.borrow_mut() += 1;
            let mut scans = self.scans.borrow_mut();
            if scans.is_empty() {
                return Err(ProcessError::NoListener { port });
            }
            scans.remove(0)
        }
    }

    fn owner(pid: u32, start_ticks: u64, fd: u32, inode: u64) -> ResolvedOwner {
        ResolvedOwner {
            pid,
            start_ticks,
            fd,
            inode,
        }
    }

    #[test]
    fn a_confirmed_cached_owner_is_answered_without_a_scan() {
        let view = FakeProc::default().process(10, 500, 7, 9001);
        let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
        assert_eq!(read.path, ReadPath::Cached);
        assert_eq!(read.mismatch, None);
        assert_eq!(read.result.unwrap().start_ticks, 500);
        assert_eq!(read.owner, Some(owner(10, 500, 7, 9001)));
        assert_eq!(view.scans(), 0);
    }

    #[test]
    fn nothing_cached_scans_and_caches_the_confirmed_owner() {
        let view = FakeProc::default()
            .process(10, 500, 7, 9001)
            .scan_finds(Ok(owner(10, 500, 7, 9001)));
        let read = read_port_identity(&view, 8000, None);
        assert_eq!(read.path, ReadPath::Scan);
        assert_eq!(read.result.unwrap().pid, 10);
        assert_eq!(read.owner, Some(owner(10, 500, 7, 9001)));
        assert_eq!(view.scans(), 1);
    }

    #[test]
    fn a_restarted_engine_under_a_new_pid_is_found_by_the_scan() {
        // The old process (pid 10) is gone; pid 11 listens now.
        let view = FakeProc::default()
            .process(11, 900, 5, 9002)
            .scan_finds(Ok(owner(11, 900, 5, 9002)));
        let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
        assert_eq!(read.path, ReadPath::Scan);
        assert_eq!(
            read.mismatch,
            Some(Mismatch::SocketGone {
                pid: 10,
                inode: 9001
            })
        );
        let id = read.result.unwrap();
        assert_eq!((id.pid, id.start_ticks), (11, 900));
        assert_eq!(read.owner, Some(owner(11, 900, 5, 9002)));
    }

    #[test]
    fn a_reused_pid_with_another_start_time_is_never_the_old_identity() {
        // Same pid, same fd number and inode number (as unlikely as it gets), new start time:
        // the start time alone must force the scan, and the answer is the new process.
        let view = FakeProc::default()
            .process(10, 777, 7, 9001)
            .scan_finds(Ok(owner(10, 777, 7, 9001)));
        let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
        assert_eq!(
            read.mismatch,
            Some(Mismatch::Restarted {
                pid: 10,
                before: 500,
                after: 777
            })
        );
        assert_eq!(read.path, ReadPath::Scan);
        assert_eq!(read.result.unwrap().start_ticks, 777);
        assert_eq!(read.owner.unwrap().start_ticks, 777);
    }

    #[test]
    fn a_process_that_stopped_listening_is_an_error_not_its_old_identity() {
        // Pid 10 is alive with the same start time, but its fd 7 is something else now, and
        // nobody listens on the port.
        let mut view = FakeProc::default().process(10, 500, 7, 4444);
        view.scans.borrow_mut().clear();
        let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
        assert!(matches!(read.mismatch, Some(Mismatch::SocketGone { .. })));
        assert_eq!(read.result, Err(ProcessError::NoListener { port: 8000 }));
        assert_eq!(read.owner, None, "the cache is dropped");
        view.fds.clear();
        let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
        assert_eq!(read.result, Err(ProcessError::NoListener { port: 8000 }));
    }

    #[test]
    fn a_zombie_or_vanished_owner_is_an_error() {
        // The cached owner still "holds" the fd in our fake but reads as a zombie; the scan
        // finds it again (it has not released the socket yet), and it is still a zombie.
        let zombie = Err(ProcessError::NotRunning {
            pid: 10,
            state: 'Z',
        });
        let mut view = FakeProc::default()
            .process(10, 500, 7, 9001)
            .scan_finds(Ok(owner(10, 500, 7, 9001)))
            .scan_finds(Ok(owner(10, 500, 7, 9001)));
        view.procs.insert(10, zombie.clone());
        let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
        assert_eq!(
            read.mismatch,
            Some(Mismatch::Unreadable(ProcessError::NotRunning {
                pid: 10,
                state: 'Z'
            }))
        );
        assert_eq!(read.result.map(|_| ()), zombie.map(|_: u64| ()));
        assert_eq!(read.owner, None);
        // Vanished: no process, no fds; the scan finds no listener.
        let view = FakeProc::default();
        let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
        assert_eq!(read.result, Err(ProcessError::NoListener { port: 8000 }));
    }

    #[test]
    fn an_owner_that_changes_between_scan_and_read_is_rescanned_once_then_an_error() {
        // First scan names pid 10 with start 500, but pid 10 is now start 600 (it died and the
        // pid was reused between the scan and the read); the second scan names pid 12.
        let view = FakeProc::default()
            .process(10, 600, 7, 9001)
            .process(12, 800, 3, 9003)
            .scan_finds(Ok(owner(10, 500, 7, 9001)))
            .scan_finds(Ok(owner(12, 800, 3, 9003)));
        let read = read_port_identity(&view, 8000, None);
        assert_eq!(read.result.unwrap().pid, 12);
        assert_eq!(view.scans(), 2);
        // Twice unstable: an error naming the port, nothing cached.
        let view = FakeProc::default()
            .process(10, 600, 7, 9001)
            .scan_finds(Ok(owner(10, 500, 7, 9001)))
            .scan_finds(Ok(owner(10, 501, 7, 9001)));
        let read = read_port_identity(&view, 8000, None);
        assert!(
            matches!(
                read.result,
                Err(ProcessError::OwnerChanged { port: 8000, .. })
            ),
            "{:?}",
            read.result
        );
        assert_eq!(read.owner, None);
    }

    // ---- the same rules against the real /proc ----

    /// Lets `fd` survive exec so a child inherits it (std sets close-on-exec on sockets).
    fn inheritable(fd: std::os::fd::BorrowedFd<'_>) {
        use nix::fcntl::{F_GETFD, F_SETFD, FdFlag, fcntl};
        let flags = FdFlag::from_bits_truncate(fcntl(fd, F_GETFD).unwrap());
        fcntl(fd, F_SETFD(flags - FdFlag::FD_CLOEXEC)).unwrap();
    }

    #[test]
    fn live_a_closed_listener_is_never_answered_from_the_cache() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let first = read_port_identity(&LiveProc, port, None);
        assert_eq!(first.path, ReadPath::Scan);
        assert_eq!(first.result.as_ref().unwrap().pid, std::process::id());
        let cached = first.owner.expect("an owner to cache");
        let again = read_port_identity(&LiveProc, port, Some(cached));
        assert_eq!(again.path, ReadPath::Cached);
        assert!(
            again
                .result
                .unwrap()
                .same_process(first.result.as_ref().unwrap())
        );
        // Same process, still alive, same start time, but it closed the socket: never the
        // cached answer. (A child forked by a concurrent test can hold a copy of the socket
        // until its exec closes it, so poll until nobody listens.)
        drop(listener);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let after = read_port_identity(&LiveProc, port, Some(cached));
            assert_eq!(after.path, ReadPath::Scan, "{after:?}");
            assert!(
                matches!(after.mismatch, Some(Mismatch::SocketGone { .. })),
                "{after:?}"
            );
            assert!(
                after.result.as_ref().map(|i| i.pid) != Ok(std::process::id()),
                "answered for a process that closed its listener: {after:?}"
            );
            if after.result == Err(ProcessError::NoListener { port }) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{after:?}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn live_the_port_handed_to_a_new_process_is_read_as_that_process_then_its_zombie_is_not() {
        use std::os::fd::AsFd as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mine = read_port_identity(&LiveProc, port, None);
        let cached = mine.owner.expect("owner");
        assert_eq!(cached.pid, std::process::id());
        // A "restarted engine": a new process holding the same listening socket.
        inheritable(listener.as_fd());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        drop(listener);
        let child_pid = child.id();
        // Poll: the child holds the inherited socket from exec on.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let moved = loop {
            let r = read_port_identity(&LiveProc, port, Some(cached));
            if r.result.as_ref().map(|i| i.pid) == Ok(child_pid) {
                break r;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "child never seen: {r:?}"
            );
            std::thread::yield_now();
        };
        assert_eq!(moved.path, ReadPath::Scan);
        assert!(matches!(moved.mismatch, Some(Mismatch::SocketGone { .. })));
        let child_owner = moved.owner.expect("child cached");
        assert_eq!(
            read_port_identity(&LiveProc, port, Some(child_owner)).path,
            ReadPath::Cached
        );
        // The child dies and is not reaped. While it is dying it may still be answered (it
        // holds the socket until its files are released); once it is a zombie it never is,
        // and the port has no listener.
        child.kill().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !matches!(
            read_stat(Path::new("/proc"), child_pid),
            Err(ProcessError::NotRunning { state: 'Z', .. })
        ) {
            assert!(std::time::Instant::now() < deadline, "child never a zombie");
            std::thread::yield_now();
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let r = read_port_identity(&LiveProc, port, Some(child_owner));
            assert!(
                r.result.as_ref().map(|i| i.pid) != Ok(child_pid),
                "a zombie answered with its old identity: {r:?}"
            );
            if r.result == Err(ProcessError::NoListener { port }) {
                assert_eq!(r.owner, None);
                break;
            }
            // Only a process spawned by a concurrent test in the instant the socket was
            // inheritable could still hold it; it exits at once.
            assert!(
                std::time::Instant::now() < deadline,
                "still listening: {r:?}"
            );
            std::thread::yield_now();
        }
        child.wait().unwrap();
    }
}
