//! Epoch fencing (architecture.md section 3, "Fencing reaches the hosts").
//!
//! ```text
//!   POST {epoch, holder} ──► decide(&stored, epoch, holder) ──► Accept | Raise | Stale | HolderConflict
//!                                     Raise ─► persist {epoch, holder} (temp, fsync, rename, fsync dir)
//! ```
//!
//! The agent keeps the highest epoch it accepted in `<state_dir>/fence.json`
//! (`{"epoch": 7, "holder": "router-a"}`), so the fence survives agent restarts. A lower epoch
//! is `stale_epoch`; the same epoch from a different holder is `holder_conflict` (two routers
//! can never legitimately hold one epoch).
//!
//! A running agent holds an exclusive `flock` on `<state_dir>/agent.lock` ([`StateLock`]), so
//! a second agent on the same state cannot start and `narwhal-agent fence reset` ([`reset`])
//! refuses while the agent runs instead of racing its writes.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// The persisted fence.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FenceState {
    /// Highest accepted epoch (0 = none yet).
    pub epoch: u64,
    /// Holder that presented it.
    pub holder: String,
}

/// What to do with a request's `(epoch, holder)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Same epoch and holder as stored.
    Accept,
    /// Higher epoch: accept after persisting it.
    Raise,
    /// Lower than the stored epoch.
    Stale {
        /// Stored epoch.
        highest: u64,
    },
    /// Same epoch, other holder.
    HolderConflict {
        /// Stored holder.
        holder: String,
    },
}

/// Pure fencing rule.
pub fn decide(stored: &FenceState, epoch: u64, holder: &str) -> Decision {
    if epoch < stored.epoch {
        Decision::Stale {
            highest: stored.epoch,
        }
    } else if epoch > stored.epoch || stored.holder.is_empty() {
        Decision::Raise
    } else if stored.holder == holder {
        Decision::Accept
    } else {
        Decision::HolderConflict {
            holder: stored.holder.clone(),
        }
    }
}

/// Why a request was fenced off, or the fence could not be stored.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// Lower epoch than accepted before (HTTP 409 `stale_epoch`).
    #[error("epoch {got} is lower than the highest accepted epoch {highest}")]
    Stale {
        /// Highest accepted.
        highest: u64,
        /// Presented.
        got: u64,
    },
    /// Same epoch, different holder (HTTP 409 `holder_conflict`).
    #[error("epoch {epoch} is held by {holder:?}, not {got:?}")]
    HolderConflict {
        /// The epoch.
        epoch: u64,
        /// Stored holder.
        holder: String,
        /// Presented holder.
        got: String,
    },
    /// The state file could not be read or written.
    #[error("state_dir {path}: {source}")]
    Io {
        /// File or directory.
        path: PathBuf,
        /// I/O error.
        source: std::io::Error,
    },
    /// Another process (a running agent, or a reset in progress) holds `<state_dir>/agent.lock`.
    #[error(
        "state_dir {path} is in use by a running agent{}; stop it first (systemctl stop narwhal-agent)",
        .pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Locked {
        /// The lock file.
        path: PathBuf,
        /// The pid written into the lock file by its holder, when readable.
        pid: Option<u32>,
    },
    /// The state file is not a fence document.
    #[error("state file {path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Parse error.
        reason: String,
    },
}

/// The fence, persisted under `state_dir`.
#[derive(Debug)]
pub struct EpochStore {
    dir: PathBuf,
    state: Mutex<FenceState>,
}

const FILE: &str = "fence.json";
const LOCK: &str = "agent.lock";

/// The exclusive lock a running agent holds on `<state_dir>/agent.lock` for its lifetime
/// (released by the kernel when the process exits, however it exits).
#[derive(Debug)]
pub struct StateLock {
    _file: nix::fcntl::Flock<std::fs::File>,
}

impl StateLock {
    /// Takes the lock without waiting (creating `dir` and the file if needed) and writes this
    /// process's pid into the file.
    ///
    /// # Errors
    /// [`FenceError::Locked`] when another process holds it; [`FenceError::Io`].
    pub fn acquire(dir: &Path) -> Result<StateLock, FenceError> {
        let path = dir.join(LOCK);
        let io = |source| FenceError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|source| FenceError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        let mut locked =
            match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(l) => l,
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                    let pid = std::fs::read_to_string(&path)
                        .ok()
                        .and_then(|t| t.trim().parse().ok());
                    return Err(FenceError::Locked { path, pid });
                }
                Err((_, e)) => return Err(io(std::io::Error::from(e))),
            };
        locked.set_len(0).map_err(io)?;
        locked
            .write_all(format!("{}\n", std::process::id()).as_bytes())
            .map_err(io)?;
        Ok(StateLock { _file: locked })
    }
}

/// Reads `<state_dir>/fence.json` without taking the lock (a missing file is epoch 0).
///
/// # Errors
/// [`FenceError::Io`] or [`FenceError::Corrupt`].
pub fn show(dir: &Path) -> Result<FenceState, FenceError> {
    let path = dir.join(FILE);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| FenceError::Corrupt {
            path,
            reason: e.to_string(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FenceState::default()),
        Err(source) => Err(FenceError::Io { path, source }),
    }
}

/// Sets the fence of a stopped agent to `to` (docs/agent.md): takes the state lock (so it
/// refuses while an agent runs on `dir`), then writes `to` the same way the agent does (temp
/// file, fsync, rename, fsync of the directory). A corrupt or missing `fence.json` is
/// replaced. Returns the previous fence (None when the file was unreadable).
///
/// # Errors
/// [`FenceError::Locked`] while the agent runs; [`FenceError::Io`].
pub fn reset(dir: &Path, to: &FenceState) -> Result<Option<FenceState>, FenceError> {
    // A mistyped directory is an error, not a new empty state the agent never reads.
    if !dir.is_dir() {
        return Err(FenceError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such state directory (give the agent's state_dir, or --config)",
            ),
        });
    }
    let _lock = StateLock::acquire(dir)?;
    let before = show(dir).ok();
    let store = EpochStore {
        dir: dir.to_path_buf(),
        state: Mutex::new(to.clone()),
    };
    store.persist(to)?;
    Ok(before)
}

impl EpochStore {
    /// Opens (creating `dir` if needed) and loads `fence.json` if present.
    ///
    /// # Errors
    /// [`FenceError::Io`] or [`FenceError::Corrupt`].
    pub fn open(dir: &Path) -> Result<EpochStore, FenceError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| FenceError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let path = dir.join(FILE);
        let state = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| FenceError::Corrupt {
                path: path.clone(),
                reason: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => FenceState::default(),
            Err(e) => return Err(io(&path)(e)),
        };
        Ok(EpochStore {
            dir: dir.to_path_buf(),
            state: Mutex::new(state),
        })
    }

    /// The current fence.
    pub fn current(&self) -> FenceState {
        match self.state.lock() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Admits or refuses `(epoch, holder)`; a higher epoch is persisted before it is accepted.
    ///
    /// # Errors
    /// [`FenceError::Stale`], [`FenceError::HolderConflict`], or [`FenceError::Io`] when the
    /// raised epoch cannot be persisted (then it is not accepted).
    pub fn admit(&self, epoch: u64, holder: &str) -> Result<(), FenceError> {
        let mut state = match self.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        match decide(&state, epoch, holder) {
            Decision::Accept => Ok(()),
            Decision::Stale { highest } => Err(FenceError::Stale {
                highest,
                got: epoch,
            }),
            Decision::HolderConflict { holder: stored } => Err(FenceError::HolderConflict {
                epoch,
                holder: stored,
                got: holder.to_string(),
            }),
            Decision::Raise => {
                let next = FenceState {
                    epoch,
                    holder: holder.to_string(),
                };
                self.persist(&next)?;
                tracing::info!(fence.epoch = epoch, fence.holder = holder, "fence raised");
                *state = next;
                Ok(())
            }
        }
    }

    fn persist(&self, state: &FenceState) -> Result<(), FenceError> {
        let final_path = self.dir.join(FILE);
        let bytes = serde_json::to_vec(state).map_err(|e| FenceError::Corrupt {
            path: final_path.clone(),
            reason: e.to_string(),
        })?;
        narwhal_shared::write_atomic(&final_path, &bytes).map_err(|e| FenceError::Io {
            path: e.path,
            source: e.source,
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(epoch: u64, holder: &str) -> FenceState {
        FenceState {
            epoch,
            holder: holder.into(),
        }
    }

    #[test]
    fn decide_follows_the_fencing_rule() {
        assert_eq!(decide(&FenceState::default(), 0, "a"), Decision::Raise);
        assert_eq!(decide(&st(3, "a"), 3, "a"), Decision::Accept);
        assert_eq!(decide(&st(3, "a"), 4, "b"), Decision::Raise);
        assert_eq!(decide(&st(3, "a"), 2, "a"), Decision::Stale { highest: 3 });
        assert_eq!(
            decide(&st(3, "a"), 3, "b"),
            Decision::HolderConflict { holder: "a".into() }
        );
    }

    #[test]
    fn the_highest_epoch_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let s = EpochStore::open(dir.path()).unwrap();
        s.admit(5, "router-a").unwrap();
        s.admit(5, "router-a").unwrap();
        assert!(matches!(
            s.admit(4, "router-a"),
            Err(FenceError::Stale { highest: 5, got: 4 })
        ));
        drop(s);
        let s = EpochStore::open(dir.path()).unwrap();
        assert_eq!(s.current(), st(5, "router-a"));
        assert!(matches!(
            s.admit(4, "router-a"),
            Err(FenceError::Stale { .. })
        ));
        assert!(matches!(
            s.admit(5, "router-b"),
            Err(FenceError::HolderConflict { .. })
        ));
        s.admit(6, "router-b").unwrap();
        assert_eq!(
            EpochStore::open(dir.path()).unwrap().current(),
            st(6, "router-b")
        );
        assert!(!dir.path().join(".fence.json.tmp").exists());
    }

    #[test]
    fn reset_refuses_while_the_state_is_locked_and_writes_the_fence_once_free() {
        let dir = tempfile::tempdir().unwrap();
        let s = EpochStore::open(dir.path()).unwrap();
        s.admit(9, "router-a").unwrap();
        let running = StateLock::acquire(dir.path()).unwrap();
        match reset(dir.path(), &FenceState::default()) {
            Err(FenceError::Locked { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("expected Locked, got {other:?}"),
        }
        assert!(matches!(
            StateLock::acquire(dir.path()),
            Err(FenceError::Locked { .. })
        ));
        assert_eq!(show(dir.path()).unwrap(), st(9, "router-a"), "untouched");
        drop(running);
        let before = reset(dir.path(), &st(2, "")).unwrap();
        assert_eq!(before, Some(st(9, "router-a")));
        let after = EpochStore::open(dir.path()).unwrap();
        assert_eq!(after.current(), st(2, ""));
        // An empty holder lets the next router at that epoch (or higher) claim it.
        after.admit(2, "router-b").unwrap();
        assert!(matches!(
            after.admit(1, "router-b"),
            Err(FenceError::Stale { .. })
        ));
        // A corrupt file is replaced.
        std::fs::write(dir.path().join(FILE), "nope").unwrap();
        assert_eq!(reset(dir.path(), &st(0, "")).unwrap(), None);
        assert_eq!(show(dir.path()).unwrap(), st(0, ""));
        // A directory that does not exist is not created.
        let typo = dir.path().join("no-such-state");
        assert!(matches!(
            reset(&typo, &st(0, "")),
            Err(FenceError::Io { .. })
        ));
        assert!(!typo.exists());
    }

    #[test]
    fn a_corrupt_state_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), "nope").unwrap();
        let err = EpochStore::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("fence.json"), "{err}");
    }
}
