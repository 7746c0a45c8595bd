//! Process identity from `/proc` (architecture.md section 4; behaviour.md 5.3).
//!
//! ```text
//!   ProcessLocator ──find_pid()──► pid ──read_identity()──► ProcessIdentity
//!     listen_port: inode of the LISTEN socket (sock_diag) ─► owner of that inode in /proc/*/fd
//!     pid_file:    first integer in the file
//!     systemd_unit: `systemctl show --property=MainPID --value UNIT`
//! ```
//!
//! Reading an engine by port once costs a dump of the host's listening sockets (sock_diag(7),
//! `listeners.rs`; `/proc/net/tcp{,6}` when netlink is refused, which prints every socket of the
//! host and walks the kernel's whole established table) plus every process's fds. So the
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
//! error, never a stale answer. The rest comes from the `procfs` crate (fd targets, `btime`,
//! `boot_id`, `CLK_TCK`, the `/proc/net` fallback).
//!
//! Reads that need a scan at the same moment (every engine of an agent after a whole-fleet
//! wave restarted them) share one ([`SharedScan`]): one dump of the listeners and one pass over every
//! process's fds answers every port, and a read only gets a scan that started after it came.
//!
//! Files: `stat.rs` parses `/proc/<pid>/stat` and reads one pid's identity, `listeners.rs`
//! lists the listening sockets, `fds.rs` a process's socket fds, `port_owner.rs` finds the owner of a listening port, `locate.rs` resolves a [`ProcessLocator`],
//! `cached_read.rs` re-checks a cached owner before scanning, `shared_scan.rs` shares one scan
//! among concurrent reads; the unit tests are in `tests.rs`.

use std::path::PathBuf;

mod cached_read;
mod fds;
mod listeners;
mod locate;
mod port_owner;
mod shared_scan;
mod stat;

pub use cached_read::{LiveProc, Mismatch, PortRead, ProcView, ReadPath, read_port_identity};
pub use locate::{find_pid, locate, locate_with_hint};
pub use port_owner::ResolvedOwner;
pub use shared_scan::{Coalesced, HostSockets, SharedScan};
pub use stat::{StatFields, parse_stat, read_identity};

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

#[cfg(test)]
// Tests of live /proc poll with wall-clock deadlines: the clock ban is for product code.
#[allow(clippy::disallowed_methods)]
mod tests;
