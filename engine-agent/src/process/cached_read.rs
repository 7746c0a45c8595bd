//! Re-checking the owner the last read found (its fd still holds the socket, its start time
//! is unchanged) before falling back to the full scan.

use narwhal_shared::ProcessIdentity;

use super::ProcessError;
use super::port_owner::{ResolvedOwner, held_by, listening_inodes, owner_of};
use super::stat::read_identity;

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
        super::fds::socket_inode_of(link.to_str()?)
    }

    fn identity(&self, pid: u32, port: u16) -> Result<ProcessIdentity, ProcessError> {
        read_identity(pid, Some(port))
    }

    fn scan(&self, port: u16, hint: Option<u32>) -> Result<ResolvedOwner, ProcessError> {
        let inodes = listening_inodes(port)?;
        if inodes.is_empty() {
            return Err(ProcessError::NoListener { port });
        }
        if let Some(owner) = hint.and_then(|pid| held_by(pid, &inodes)) {
            return Ok(owner);
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
