//! What the benchmark reads about processes from `/proc` (CPU time, memory, affinity, load),
//! and CPU pinning through util-linux's `taskset`.
//!
//! CPU time is `utime + stime` of `/proc/<pid>/stat` (fields 14 and 15, in clock ticks of
//! `getconf CLK_TCK`, normally 100 per second): all threads of the process, living and exited.
//! A router that forks helpers is measured as its process tree (the process and its
//! descendants alive at the window's ends). Memory is `VmRSS` and `VmHWM` (peak resident set)
//! of `/proc/<pid>/status`, in KiB, summed over the tree.

use std::collections::BTreeSet;
use std::process::Command;

/// Clock ticks per second of `/proc/<pid>/stat` times (`getconf CLK_TCK`; 100 when `getconf`
/// cannot say, the value Linux fixes for user space on every common architecture).
pub(crate) fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|t| *t > 0.0)
        .unwrap_or(100.0)
}

/// `(ppid, utime + stime in ticks)` of one process; `None` when it is gone or a zombie.
fn stat(pid: u32) -> Option<(u32, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: fields resume after the
    // last ')'. Then field 3 (state) is index 0, ppid (4) index 1, utime (14) index 11.
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    if f.first() == Some(&"Z") {
        return None;
    }
    let ppid = f.get(1)?.parse().ok()?;
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some((ppid, utime + stime))
}

/// `pid` and every live descendant of it.
pub(crate) fn tree(pid: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            if let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok())
                && let Some((ppid, _)) = stat(p)
            {
                parent_of.push((p, ppid));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let cur = out[i];
        out.extend(
            parent_of
                .iter()
                .filter(|(_, pp)| *pp == cur)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    out
}

/// CPU ticks consumed so far by each process of `pid`'s tree.
pub(crate) fn tree_ticks(pid: u32) -> Vec<(u32, u64)> {
    tree(pid)
        .into_iter()
        .filter_map(|p| stat(p).map(|(_, t)| (p, t)))
        .collect()
}

/// Ticks used between two [`tree_ticks`] readings: for processes present at both ends, the
/// difference; for processes born in between, all they used.
pub(crate) fn ticks_between(before: &[(u32, u64)], after: &[(u32, u64)]) -> u64 {
    after
        .iter()
        .map(|(p, t)| {
            let was = before
                .iter()
                .find(|(q, _)| q == p)
                .map(|(_, t0)| *t0)
                .unwrap_or(0);
            t.saturating_sub(was)
        })
        .sum()
}

/// `VmRSS` and `VmHWM` (KiB) of one process, from `/proc/<pid>/status`.
pub(crate) fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// `(VmRSS, VmHWM)` in KiB summed over `pid`'s tree.
pub(crate) fn tree_memory_kib(pid: u32) -> (u64, u64) {
    tree(pid)
        .into_iter()
        .filter_map(memory_kib)
        .fold((0, 0), |(r, h), (r1, h1)| (r + r1, h + h1))
}

/// The CPUs the threads of `pid`'s tree may run on (union of every thread's
/// `Cpus_allowed_list`).
pub(crate) fn tree_cpus(pid: u32) -> BTreeSet<usize> {
    let mut cpus = BTreeSet::new();
    for p in tree(pid) {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let path = t.path().join("status");
            if let Some(list) = std::fs::read_to_string(path).ok().and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                    .map(|v| v.trim().to_string())
            }) {
                cpus.extend(parse_cpu_list(&list).unwrap_or_default());
            }
        }
    }
    cpus
}

/// Parses a kernel CPU list (`0-3,8,10-11`).
///
/// # Errors
/// A message naming the piece that is not a CPU number or range.
pub(crate) fn parse_cpu_list(list: &str) -> Result<BTreeSet<usize>, String> {
    let mut out = BTreeSet::new();
    for piece in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || format!("{piece:?} is not a CPU number or range");
        match piece.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (
                    a.trim().parse().map_err(|_| bad())?,
                    b.trim().parse().map_err(|_| bad())?,
                );
                if a > b {
                    return Err(bad());
                }
                out.extend(a..=b);
            }
            None => {
                out.insert(piece.parse().map_err(|_| bad())?);
            }
        }
    }
    Ok(out)
}

/// Formats a CPU set as a kernel CPU list (`0,2-3`).
pub(crate) fn cpu_list(cpus: &BTreeSet<usize>) -> String {
    let mut parts = Vec::new();
    let mut it = cpus.iter().copied().peekable();
    while let Some(a) = it.next() {
        let mut b = a;
        while it.peek() == Some(&(b + 1)) {
            b = it.next().unwrap_or(b);
        }
        parts.push(if a == b {
            a.to_string()
        } else {
            format!("{a}-{b}")
        });
    }
    parts.join(",")
}

/// The CPUs this process may run on (`Cpus_allowed_list` of `/proc/self/status`; empty when
/// unreadable).
pub(crate) fn own_cpus() -> BTreeSet<usize> {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(|list| parse_cpu_list(list.trim()).ok())
        })
        .unwrap_or_default()
}

/// `/proc/loadavg`'s 1, 5 and 15 minute load averages.
pub(crate) fn loadavg() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut it = text
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(f64::NAN));
    [
        it.next().unwrap_or(f64::NAN),
        it.next().unwrap_or(f64::NAN),
        it.next().unwrap_or(f64::NAN),
    ]
}

/// Sets the CPU affinity of task `tid` (a thread id, or a process id with `all_threads`) with
/// `taskset -p [-a] -c LIST TID`.
///
/// # Errors
/// A message when `taskset` is missing or refuses.
pub(crate) fn set_affinity(
    tid: i32,
    cpus: &BTreeSet<usize>,
    all_threads: bool,
) -> Result<(), String> {
    let mut cmd = Command::new("taskset");
    cmd.arg("-p");
    if all_threads {
        cmd.arg("-a");
    }
    let out = cmd
        .arg("-c")
        .arg(cpu_list(cpus))
        .arg(tid.to_string())
        .output()
        .map_err(|e| format!("taskset: {e} (util-linux)"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "taskset -p -c {} {tid}: {}",
            cpu_list(cpus),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `f` on a fresh thread pinned to `cpus`, so that every process `f` spawns starts on
/// them (a child inherits its creating thread's affinity; a runtime that sizes itself from its
/// affinity then sees only those CPUs). `None` runs `f` on a fresh unpinned thread.
///
/// # Errors
/// When the thread cannot be pinned.
pub(crate) fn on_cpus<T: Send>(
    cpus: Option<&BTreeSet<usize>>,
    f: impl FnOnce() -> T + Send,
) -> Result<T, String> {
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(cpus) = cpus {
                set_affinity(nix::unistd::gettid().as_raw(), cpus, false)?;
            }
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err("the pinned spawner thread panicked".into()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_round_trip() {
        let set = parse_cpu_list("0-2,5,7-8").unwrap();
        assert_eq!(set.iter().copied().collect::<Vec<_>>(), [0, 1, 2, 5, 7, 8]);
        assert_eq!(cpu_list(&set), "0-2,5,7-8");
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("x").is_err());
    }

    #[test]
    fn own_process_is_measured() {
        let me = std::process::id();
        assert!(tree(me).contains(&me));
        assert!(!tree_ticks(me).is_empty());
        let (rss, hwm) = tree_memory_kib(me);
        assert!(rss > 0 && hwm >= rss);
        assert!(!own_cpus().is_empty());
    }
}
