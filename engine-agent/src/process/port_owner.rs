//! The process that owns a listening TCP port: socket inodes of the listeners
//! (`listeners.rs`: sock_diag, else `/proc/net/tcp{,6}`), then
//! the process whose fds hold one of them.

use std::path::Path;

use super::ProcessError;
use super::fds::socket_fds;
use super::listeners::listening_sockets;
use super::stat::{proc_err, read_stat};

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

impl ResolvedOwner {
    /// Order among the holders of one socket: the earliest started, then the lowest pid, comes
    /// first (the parent of forked workers).
    pub(super) fn rank(&self) -> (u64, u32) {
        (self.start_ticks, self.pid)
    }
}

/// `pid` as the owner of one of `inodes`, when it holds one now: the first such fd, and the
/// start time read after it was seen.
pub(super) fn held_by(pid: u32, inodes: &[u64]) -> Option<ResolvedOwner> {
    let (fd, inode) = socket_fd_among(pid, inodes)?;
    let stat = read_stat(Path::new("/proc"), pid).ok()?;
    Some(ResolvedOwner {
        pid,
        start_ticks: stat.start_ticks,
        fd,
        inode,
    })
}

/// Inodes of TCP sockets in LISTEN state on `port` (IPv4 and IPv6, the agent's network
/// namespace), sorted.
///
/// # Errors
/// [`ProcessError::Proc`] when no source of the listeners can be read.
pub(super) fn listening_inodes(port: u16) -> Result<Vec<u64>, ProcessError> {
    let mut inodes: Vec<u64> = listening_sockets()?
        .into_iter()
        .filter(|(p, _)| *p == port)
        .map(|(_, inode)| inode)
        .collect();
    inodes.sort_unstable();
    inodes.dedup();
    Ok(inodes)
}

/// The process owning a socket with one of `inodes` (scanning every process's fds), as a
/// [`ResolvedOwner`]; when several processes share it (forked workers) the earliest started
/// (then lowest pid) wins, i.e. the parent.
pub(super) fn owner_of(port: u16, inodes: &[u64]) -> Result<ResolvedOwner, ProcessError> {
    let all = procfs::process::all_processes().map_err(|e| proc_err("/proc", e))?;
    let mut best: Option<ResolvedOwner> = None;
    for proc_ in all.flatten() {
        let Some(found) = held_by(proc_.pid as u32, inodes) else {
            continue;
        };
        if best.is_none_or(|b| found.rank() < b.rank()) {
            best = Some(found);
        }
    }
    best.ok_or_else(|| ProcessError::NoOwner {
        port,
        inodes: inodes.to_vec(),
    })
}

/// The first fd of `pid` that is a socket with one of `inodes`, and that inode.
pub(super) fn socket_fd_among(pid: u32, inodes: &[u64]) -> Option<(u32, u64)> {
    socket_fds(pid)?
        .into_iter()
        .find(|(_, ino)| inodes.contains(ino))
}
