//! One scan of the host for every identity read that is waiting for one.
//!
//! A scan reads the whole host: its listening sockets, then every process's fds. An agent whose
//! engines all restarted (a whole-fleet wave) used to run one such scan per engine, each
//! answering a single port, all at about the same moment. [`SharedScan`] runs one scan that
//! answers every listening port, and hands it to every read that arrived before it started.
//!
//! Freshness is the same as scanning alone: a read never gets a scan that started before the
//! read arrived. A read that arrives while a scan runs waits for the next one, and that one
//! starts as soon as the running one ends, so a read waits at most about two scans. Every
//! answer is then confirmed against `/proc` by
//! [`read_port_identity`](super::read_port_identity) (the fd still holds the socket, the start
//! time is unchanged), as a single scan's answer is.
//!
//! ```text
//!   read A ──┐                     read C ──┐
//!   read B ──┴─► scan 1 (A, B) ──► scan 2 (C, and any read that came during scan 1)
//! ```

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

use narwhal_shared::ProcessIdentity;

use super::ProcessError;
use super::cached_read::{LiveProc, ProcView};
use super::fds::socket_fds;
use super::listeners::listening_sockets;
use super::port_owner::{ResolvedOwner, held_by};
use super::stat::{proc_err, read_stat};

/// Runs `scan` for callers that arrive together: a caller gets the result of a scan that
/// started after it called, and concurrent callers share one.
///
/// Blocking (a condition variable): call from `spawn_blocking` or a plain thread.
#[derive(Debug)]
pub struct Coalesced<T> {
    inner: Mutex<Generations<T>>,
    done: Condvar,
}

#[derive(Debug)]
struct Generations<T> {
    /// Scans started so far (the running one included).
    started: u64,
    /// The newest scan that ended, and its result.
    finished: u64,
    last: Option<Arc<T>>,
    running: bool,
}

impl<T> Default for Coalesced<T> {
    fn default() -> Self {
        Coalesced {
            inner: Mutex::new(Generations {
                started: 0,
                finished: 0,
                last: None,
                running: false,
            }),
            done: Condvar::new(),
        }
    }
}

impl<T> Coalesced<T> {
    /// The result of the first scan to start after this call: this caller runs it unless
    /// another caller already has, or one is running (then the next one, run by whoever
    /// gets there first once it ends).
    pub fn get(&self, scan: impl FnOnce() -> T) -> Arc<T> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        // A scan that started before this call may already miss what the caller looks for.
        let need = g.started + 1;
        let mut scan = Some(scan);
        loop {
            if g.finished >= need
                && let Some(last) = &g.last
            {
                return Arc::clone(last);
            }
            if !g.running
                && let Some(run) = scan.take()
            {
                g.started += 1;
                g.running = true;
                let generation = g.started;
                drop(g);
                let result = Arc::new(run());
                let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
                g.finished = generation;
                g.last = Some(Arc::clone(&result));
                g.running = false;
                self.done.notify_all();
                return result;
            }
            g = self.done.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What one scan of the host found: every listening TCP port's socket inodes, and the owner
/// of each of those sockets (the earliest started process holding it, then the lowest pid:
/// the parent of forked workers, as [`ResolvedOwner`] scans pick).
#[derive(Debug, Default)]
pub struct HostSockets {
    /// Listening port -> its socket inodes (sorted), IPv4 and IPv6 together.
    pub listeners: HashMap<u16, Vec<u64>>,
    /// Listening socket inode -> its owner.
    pub owners: HashMap<u64, ResolvedOwner>,
    /// Set when the listening sockets or `/proc` could not be read.
    pub error: Option<ProcessError>,
}

impl HostSockets {
    /// Reads the listening sockets (`listeners.rs`) and every process's fds now (blocking).
    pub fn read() -> HostSockets {
        let mut host = HostSockets::default();
        let sockets = match listening_sockets() {
            Ok(s) => s,
            Err(e) => {
                host.error = Some(e);
                return host;
            }
        };
        let mut port_of = HashMap::new();
        for (port, inode) in sockets {
            host.listeners.entry(port).or_default().push(inode);
            port_of.insert(inode, port);
        }
        for inodes in host.listeners.values_mut() {
            inodes.sort_unstable();
            inodes.dedup();
        }
        let all = match procfs::process::all_processes() {
            Ok(all) => all,
            Err(e) => {
                host.error = Some(proc_err("/proc", e));
                return host;
            }
        };
        for proc_ in all.flatten() {
            let pid = proc_.pid as u32;
            let Some(fds) = socket_fds(pid) else { continue };
            let mut held: Vec<(u32, u64)> = Vec::new();
            for (fd, ino) in fds {
                if port_of.contains_key(&ino) && !held.iter().any(|(_, i)| *i == ino) {
                    held.push((fd, ino));
                }
            }
            if held.is_empty() {
                continue;
            }
            let Ok(stat) = read_stat(Path::new("/proc"), pid) else {
                continue;
            };
            for (fd, inode) in held {
                let found = ResolvedOwner {
                    pid,
                    start_ticks: stat.start_ticks,
                    fd,
                    inode,
                };
                host.owners
                    .entry(inode)
                    .and_modify(|best| {
                        if found.rank() < best.rank() {
                            *best = found;
                        }
                    })
                    .or_insert(found);
            }
        }
        host
    }

    /// The owner of `port`'s listening socket, as a scan for that port alone would answer:
    /// `hint` (the previous owner) first when it holds one of the sockets now, else the
    /// earliest started holder of any of them.
    ///
    /// # Errors
    /// [`ProcessError::NoListener`], [`ProcessError::NoOwner`], or the error that stopped the
    /// scan.
    pub fn owner(&self, port: u16, hint: Option<u32>) -> Result<ResolvedOwner, ProcessError> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let Some(inodes) = self.listeners.get(&port).filter(|i| !i.is_empty()) else {
            return Err(ProcessError::NoListener { port });
        };
        if let Some(owner) = hint.and_then(|pid| held_by(pid, inodes)) {
            return Ok(owner);
        }
        inodes
            .iter()
            .filter_map(|i| self.owners.get(i))
            .min_by_key(|o| o.rank())
            .copied()
            .ok_or_else(|| ProcessError::NoOwner {
                port,
                inodes: inodes.clone(),
            })
    }
}

/// `/proc` of the agent's host with the scans of concurrent reads shared ([`Coalesced`] over
/// [`HostSockets`]); the re-checks of a cached owner are [`LiveProc`]'s, per engine.
#[derive(Debug, Default)]
pub struct SharedScan {
    scans: Coalesced<HostSockets>,
}

impl ProcView for SharedScan {
    fn socket_inode(&self, pid: u32, fd: u32) -> Option<u64> {
        LiveProc.socket_inode(pid, fd)
    }

    fn identity(&self, pid: u32, port: u16) -> Result<ProcessIdentity, ProcessError> {
        LiveProc.identity(pid, port)
    }

    fn scan(&self, port: u16, hint: Option<u32>) -> Result<ResolvedOwner, ProcessError> {
        self.scans.get(HostSockets::read).owner(port, hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    #[test]
    fn one_caller_runs_its_own_scan_each_time() {
        let c = Coalesced::default();
        let n = AtomicUsize::new(0);
        let a = c.get(|| n.fetch_add(1, Ordering::SeqCst));
        let b = c.get(|| n.fetch_add(1, Ordering::SeqCst));
        // A call after a scan ended never gets that scan: it may miss what changed since.
        assert_eq!((*a, *b), (0, 1));
    }

    #[test]
    fn callers_during_a_scan_share_the_next_one_not_the_running_one() {
        let c = Arc::new(Coalesced::<usize>::default());
        let runs = Arc::new(AtomicUsize::new(0));
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let (entered_tx, entered_rx) = mpsc::channel::<()>();
        // Scan 1 blocks until released.
        let first = {
            let (c, runs) = (Arc::clone(&c), Arc::clone(&runs));
            std::thread::spawn(move || {
                *c.get(|| {
                    entered_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                    runs.fetch_add(1, Ordering::SeqCst) + 1
                })
            })
        };
        entered_rx.recv().unwrap();
        // Eight callers arrive while scan 1 runs.
        let waiting: Vec<_> = (0..8)
            .map(|_| {
                let (c, runs) = (Arc::clone(&c), Arc::clone(&runs));
                std::thread::spawn(move || *c.get(|| runs.fetch_add(1, Ordering::SeqCst) + 1))
            })
            .collect();
        // Whenever each of them gets to `get`, scan 1 has started, so each needs a later one.
        release_tx.send(()).unwrap();
        assert_eq!(first.join().unwrap(), 1);
        let got: Vec<usize> = waiting.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            got.iter().all(|g| *g >= 2),
            "a late caller got scan 1: {got:?}"
        );
        // Every late caller shares scan 2 unless it arrived after scan 2 had started.
        let total = runs.load(Ordering::SeqCst);
        assert!((2..=9).contains(&total), "{total} scans");
    }

    #[test]
    fn a_live_scan_finds_a_listener_of_this_process() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let me = std::process::id();
        let host = HostSockets::read();
        let owner = host.owner(port, None).unwrap();
        assert_eq!(owner.pid, me);
        // The hint path gives the same owner.
        assert_eq!(host.owner(port, Some(me)).unwrap().pid, me);
        let shared = SharedScan::default();
        let read = super::super::read_port_identity(&shared, port, None);
        assert_eq!(read.result.unwrap().pid, me);
        drop(listener);
        let after = HostSockets::read();
        assert!(matches!(
            after.owner(port, None),
            Err(ProcessError::NoListener { .. })
        ));
    }
}
