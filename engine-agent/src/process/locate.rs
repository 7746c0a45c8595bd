//! Resolving a [`ProcessLocator`] (listening port, pid file, systemd unit) to a pid and reading
//! its identity.

use narwhal_shared::ProcessIdentity;

use super::cached_read::{LiveProc, ProcView as _};
use super::port_owner::{listening_inodes, owner_of};
use super::stat::read_identity;
use super::{ProcessError, ProcessLocator};

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
/// so the answer is the same. Kept for comparison
/// ([`read_port_identity`](super::read_port_identity) is what the agent uses).
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

/// Finds and reads the engine's identity now (blocking: call from `spawn_blocking`).
///
/// # Errors
/// Any [`ProcessError`] from [`find_pid`] and [`read_identity`].
pub fn locate(locator: &ProcessLocator) -> Result<ProcessIdentity, ProcessError> {
    let (pid, port) = find_pid(locator)?;
    read_identity(pid, port)
}
