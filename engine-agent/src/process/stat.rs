//! `/proc/<pid>/stat` parsing and reading one pid's identity (start time, boot, executable).

use std::path::Path;

use narwhal_shared::ProcessIdentity;

use super::ProcessError;

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

pub(super) fn proc_err(what: impl Into<String>, e: impl std::fmt::Display) -> ProcessError {
    ProcessError::Proc {
        what: what.into(),
        reason: e.to_string(),
    }
}

pub(super) fn read_stat(proc_root: &Path, pid: u32) -> Result<StatFields, ProcessError> {
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
    // Read between the two stat reads, so a pid reused in between cannot lend its pod.
    let pod = std::fs::read_to_string(root.join(pid.to_string()).join("cgroup"))
        .ok()
        .as_deref()
        .and_then(narwhal_shared::PodBinding::from_cgroup);
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
        // A process outside a pod, or whose cgroup file cannot be read, names no pod.
        pod,
    })
}
