//! The identity of the operating-system process behind an engine (architecture.md section 4).
//!
//! The agent reads it from `/proc`; the router compares it. Equality that matters is
//! [`ProcessIdentity::same_process`]: `(boot_id, pid, start_ticks)`. A restarted engine, or a
//! new process that reuses the old pid, has a different `start_ticks` (or boot) and is
//! therefore a different engine.

use serde::{Deserialize, Serialize};

/// What the agent read about one engine process.
///
/// JSON shape (field names are the wire format):
/// `{"pid":1234,"boot_id":"3f0c…","start_ticks":123456,"clk_tck":100,"btime":1764460000,
///   "process_start_time_seconds":1764461234.56,"exe":"/usr/bin/python3","listen_port":8000}`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    /// Process id in the agent's pid namespace.
    pub pid: u32,
    /// `/proc/sys/kernel/random/boot_id` (a UUID, new on every boot).
    pub boot_id: String,
    /// proc(5) `/proc/<pid>/stat` field 22, `starttime`: clock ticks after boot.
    pub start_ticks: u64,
    /// `sysconf(_SC_CLK_TCK)`: ticks per second, usually 100.
    pub clk_tck: u64,
    /// `btime` line of `/proc/stat`: boot time, wall seconds since the Unix epoch.
    pub btime: u64,
    /// `btime + start_ticks / clk_tck`, wall seconds since the Unix epoch (float).
    pub process_start_time_seconds: f64,
    /// Target of `/proc/<pid>/exe`.
    pub exe: String,
    /// The engine's TCP listening port when the process was found by its socket, else `null`.
    pub listen_port: Option<u16>,
}

impl ProcessIdentity {
    /// True when both describe the same process: equal `(boot_id, pid, start_ticks)`.
    pub fn same_process(&self, other: &ProcessIdentity) -> bool {
        self.boot_id == other.boot_id
            && self.pid == other.pid
            && self.start_ticks == other.start_ticks
    }

    /// Computes `process_start_time_seconds` from its parts (`btime + start_ticks / clk_tck`);
    /// a zero `clk_tck` is treated as 100, the Linux value.
    pub fn start_time_seconds(btime: u64, start_ticks: u64, clk_tck: u64) -> f64 {
        let tck = if clk_tck == 0 { 100 } else { clk_tck };
        btime as f64 + start_ticks as f64 / tck as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(pid: u32, start_ticks: u64) -> ProcessIdentity {
        ProcessIdentity {
            pid,
            boot_id: "b".into(),
            start_ticks,
            clk_tck: 100,
            btime: 1000,
            process_start_time_seconds: ProcessIdentity::start_time_seconds(1000, start_ticks, 100),
            exe: "/bin/engine".into(),
            listen_port: Some(8000),
        }
    }

    #[test]
    fn reused_pid_with_new_start_ticks_is_a_different_process() {
        assert!(id(42, 500).same_process(&id(42, 500)));
        assert!(!id(42, 500).same_process(&id(42, 501)));
        assert!(!id(42, 500).same_process(&id(43, 500)));
        let mut other_boot = id(42, 500);
        other_boot.boot_id = "c".into();
        assert!(!id(42, 500).same_process(&other_boot));
    }

    #[test]
    fn start_time_is_btime_plus_ticks_over_hz() {
        assert_eq!(ProcessIdentity::start_time_seconds(1000, 250, 100), 1002.5);
        assert_eq!(ProcessIdentity::start_time_seconds(1000, 250, 0), 1002.5);
    }
}
