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
    /// The Kubernetes pod and container the process runs in, read from `/proc/<pid>/cgroup`;
    /// absent (not written) for a process outside a pod, so the document of such a process is
    /// unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodBinding>,
}

/// The pod a process runs in, as its cgroup path names it (both cgroup drivers: `cgroupfs`'s
/// `/kubepods/<qos>/pod<uid>/<container id>` and `systemd`'s
/// `/kubepods.slice/…/kubepods-<qos>-pod<uid with _>.slice/<runtime>-<container id>.scope`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodBinding {
    /// The pod's UID (with `-`, as the API server writes it).
    pub pod_uid: String,
    /// The container's ID (64 hex digits), `""` when the path names only the pod.
    pub container_id: String,
}

impl PodBinding {
    /// The pod of a process whose `/proc/<pid>/cgroup` reads `text` (cgroup v1 or v2); `None`
    /// for a process outside a pod, and when the lines name different pods or containers (a
    /// process moved in one hierarchy only). Only a pod UID shaped as one (32 hex digits in
    /// 8-4-4-4-12 groups) counts. Within a path the outermost pod component is taken, on
    /// purpose: a process can create cgroups below its own, never above. A line that names the
    /// pod without a container is completed by one that names the container.
    pub fn from_cgroup(text: &str) -> Option<PodBinding> {
        let found: Vec<PodBinding> = text
            .lines()
            .filter_map(|line| line.splitn(3, ':').nth(2))
            .filter_map(Self::from_path)
            .collect();
        let first = found.first()?;
        if found.iter().any(|b| b.pod_uid != first.pod_uid) {
            return None;
        }
        let mut ids: Vec<&str> = found
            .iter()
            .map(|b| b.container_id.as_str())
            .filter(|c| !c.is_empty())
            .collect();
        ids.dedup();
        match ids.as_slice() {
            [] => Some(first.clone()),
            [one] => Some(PodBinding {
                pod_uid: first.pod_uid.clone(),
                container_id: (*one).to_string(),
            }),
            _ => None,
        }
    }

    fn from_path(path: &str) -> Option<PodBinding> {
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        let (i, pod_uid) = parts.iter().enumerate().find_map(|(i, part)| {
            // systemd: `kubepods-burstable-pod<uid_with_underscores>.slice`, `kubepods-pod<…>`
            let systemd = part
                .strip_suffix(".slice")
                .and_then(|p| p.rsplit_once("-pod").map(|(_, uid)| uid.replace('_', "-")));
            // cgroupfs: `pod<uid>`
            let cgroupfs = part.strip_prefix("pod").map(str::to_string);
            systemd
                .or(cgroupfs)
                .filter(|uid| is_uid(uid))
                .map(|uid| (i, uid))
        })?;
        let container_id = parts
            .get(i + 1)
            .map(|c| {
                let c = c.strip_suffix(".scope").unwrap_or(c);
                // `cri-containerd-<id>`, `crio-<id>`, `docker-<id>`, or a bare id.
                c.rsplit_once('-').map_or(c, |(_, id)| id).to_string()
            })
            .filter(|id| id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()))
            .unwrap_or_default();
        Some(PodBinding {
            pod_uid,
            container_id,
        })
    }
}

/// A Kubernetes UID: 8-4-4-4-12 hex digits.
fn is_uid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
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
            pod: None,
        }
    }

    const UID: &str = "5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8";
    const CID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn the_pod_is_read_from_either_cgroup_drivers_path() {
        let bound = |container_id: &str| {
            Some(PodBinding {
                pod_uid: UID.into(),
                container_id: container_id.into(),
            })
        };
        let uid_ = UID.replace('-', "_");
        // cgroup v2, systemd driver, containerd.
        let v2 = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/\
             cri-containerd-{CID}.scope\n"
        );
        assert_eq!(PodBinding::from_cgroup(&v2), bound(CID));
        // Guaranteed QoS (no QoS slice), CRI-O.
        let guaranteed = format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/crio-{CID}.scope\n");
        assert_eq!(PodBinding::from_cgroup(&guaranteed), bound(CID));
        // cgroup v1, cgroupfs driver, every controller; the deepest line wins.
        let v1 = format!(
            "12:pids:/kubepods/besteffort/pod{UID}/{CID}\n\
             11:memory:/kubepods/besteffort/pod{UID}\n1:name=systemd:/kubepods/besteffort/pod{UID}/{CID}\n"
        );
        assert_eq!(PodBinding::from_cgroup(&v1), bound(CID));
        // Docker under systemd, v1.
        let docker = format!(
            "4:cpu,cpuacct:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/docker-{CID}.scope\n"
        );
        assert_eq!(PodBinding::from_cgroup(&docker), bound(CID));
        // Lines that disagree name no pod.
        let other = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
        assert_eq!(
            PodBinding::from_cgroup(&format!(
                "2:pids:/kubepods/pod{UID}/{CID}\n1:memory:/kubepods/pod{other}/{CID}\n"
            )),
            None
        );
        // Only the pod named: the container id is empty.
        assert_eq!(
            PodBinding::from_cgroup(&format!("0::/kubepods/pod{UID}\n")),
            bound("")
        );
        // Not a pod: a systemd service, a user session, a pod-like name without a UID.
        for text in [
            "0::/system.slice/vllm.service\n",
            "0::/user.slice/user-0.slice/session-3.scope\n",
            "0::/kubepods/podnotauid/x\n",
            "",
        ] {
            assert_eq!(PodBinding::from_cgroup(text), None, "{text}");
        }
    }

    #[test]
    fn an_identity_outside_a_pod_is_written_as_before() {
        let text = serde_json::to_string(&id(1, 2)).unwrap();
        assert!(!text.contains("pod"), "{text}");
        let mut in_pod = id(1, 2);
        in_pod.pod = PodBinding::from_cgroup(&format!("0::/kubepods/pod{UID}/{CID}\n"));
        let text = serde_json::to_string(&in_pod).unwrap();
        assert!(
            text.ends_with(&format!(
                ",\"pod\":{{\"pod_uid\":\"{UID}\",\"container_id\":\"{CID}\"}}}}"
            )),
            "{text}"
        );
        let back: ProcessIdentity = serde_json::from_str(&text).unwrap();
        assert_eq!(back, in_pod);
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
