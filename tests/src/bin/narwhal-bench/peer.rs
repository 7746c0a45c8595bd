//! Peer routers: `--peer 'NAME=COMMAND'` specs, their placeholders, and the peer processes.
//!
//! A peer's command is a shell command line (run as `sh -c 'exec COMMAND'`, so the router is the
//! process the benchmark measures) with placeholders the benchmark fills in:
//!
//! | placeholder | value |
//! |---|---|
//! | `{port}` | the loopback port the peer must serve OpenAI routes on |
//! | `{aux_port}` | a second free loopback port (a metrics listener, ...) |
//! | `{host}` | `127.0.0.1` |
//! | `{model}` | the served model name (`tiny-sim`) |
//! | `{dir}` | a scratch directory of the peer's own |
//! | `{bin_dir}` | the directory of the workspace binaries (`narwhal-serve`, ...) |
//! | `{prefill_url}`, `{decode_url}` | the P/D engines (one prefill, one decode) |
//! | `{prefill_urls}`, `{decode_urls}` | the same, as space-separated lists |
//! | `{bootstrap_port}` | the SGLang prefill engine's bootstrap port (`none` for vLLM) |
//! | `{engine_url}`, `{engine_urls}` | the aggregated engine |
//!
//! A command that names P/D engines is a P/D peer (compared with ours over P/D); one that
//! names `{engine_url(s)}` is an aggregated peer. Any other `{word}` is an error, so a typo
//! never reaches the peer; other braces (JSON in an argument) are left as they are.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Which of our paths a target is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Straight to the engine: the limit.
    Direct,
    /// One prefill leg, KV transfer, one decode leg.
    Pd,
    /// One engine, one upstream request per client request.
    Agg,
}

impl Kind {
    /// `direct`, `pd` or `agg`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Direct => "direct",
            Kind::Pd => "pd",
            Kind::Agg => "agg",
        }
    }
}

/// Names a peer may not take: the built-in targets.
pub(crate) const RESERVED: [&str; 3] = ["direct", "ours-pd", "ours-agg"];

/// One `--peer NAME=COMMAND`.
#[derive(Debug, Clone)]
pub(crate) struct PeerSpec {
    /// Its name in the tables (`[A-Za-z0-9._-]+`).
    pub name: String,
    /// The command template.
    pub command: String,
    /// P/D or aggregated, from the placeholders it names.
    pub kind: Kind,
}

const PD_KEYS: [&str; 5] = [
    "prefill_url",
    "decode_url",
    "prefill_urls",
    "decode_urls",
    "bootstrap_port",
];
const AGG_KEYS: [&str; 2] = ["engine_url", "engine_urls"];
const OTHER_KEYS: [&str; 8] = [
    "port",
    "aux_port",
    "host",
    "model",
    "dir",
    "bin_dir",
    // `narwhal-bench prefix` only: `URL=tcp://HOST:PORT` per engine, space-separated.
    "kv_event_sources",
    "kv_event_replay_sources",
];

/// The `{word}` placeholders of `template`, in order: `(start, end, word)` byte ranges.
fn placeholders(template: &str) -> Vec<(usize, usize, &str)> {
    let b = template.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'{' {
            let mut j = i + 1;
            while j < b.len() && (b[j].is_ascii_lowercase() || b[j] == b'_') {
                j += 1;
            }
            if j > i + 1 && j < b.len() && b[j] == b'}' {
                out.push((i, j + 1, &template[i + 1..j]));
                i = j + 1;
                continue;
            }
        }
        i += 1;
    }
    out
}

impl PeerSpec {
    /// Parses `NAME=COMMAND`.
    ///
    /// # Errors
    /// A message naming the peer and what is wrong: no `=`, a bad or reserved name, an unknown
    /// placeholder, or a command that names no engines or both kinds.
    pub(crate) fn parse(spec: &str) -> Result<PeerSpec, String> {
        let (name, command) = spec
            .split_once('=')
            .ok_or_else(|| format!("--peer {spec:?}: expected NAME=COMMAND"))?;
        let (name, command) = (name.trim(), command.trim());
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return Err(format!(
                "--peer {name:?}: a name is letters, digits, '.', '_' and '-'"
            ));
        }
        if RESERVED.contains(&name) {
            return Err(format!("--peer {name:?}: the name of a built-in target"));
        }
        if command.is_empty() {
            return Err(format!("--peer {name}: empty command"));
        }
        let mut pd = false;
        let mut agg = false;
        for (_, _, word) in placeholders(command) {
            if PD_KEYS.contains(&word) {
                pd = true;
            } else if AGG_KEYS.contains(&word) {
                agg = true;
            } else if !OTHER_KEYS.contains(&word) {
                return Err(format!(
                    "--peer {name}: unknown placeholder {{{word}}} (known: {})",
                    PD_KEYS
                        .iter()
                        .chain(AGG_KEYS.iter())
                        .chain(OTHER_KEYS.iter())
                        .map(|k| format!("{{{k}}}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                ));
            }
        }
        let kind = match (pd, agg) {
            (true, false) => Kind::Pd,
            (false, true) => Kind::Agg,
            (false, false) => {
                return Err(format!(
                    "--peer {name}: the command names no engines ({{prefill_url}} and \
                     {{decode_url}} for a P/D router, {{engine_url}} for an aggregated one)"
                ));
            }
            (true, true) => {
                return Err(format!(
                    "--peer {name}: the command names both P/D engines and {{engine_url}}; \
                     a peer is either P/D or aggregated"
                ));
            }
        };
        Ok(PeerSpec {
            name: name.to_string(),
            command: command.to_string(),
            kind,
        })
    }

    /// The command with every placeholder replaced by its value in `values`.
    ///
    /// # Errors
    /// A placeholder with no value (say `{bootstrap_port}` with no SGLang prefill).
    pub(crate) fn render(&self, values: &BTreeMap<&str, String>) -> Result<String, String> {
        let mut out = String::with_capacity(self.command.len() + 64);
        let mut last = 0;
        for (start, end, word) in placeholders(&self.command) {
            out.push_str(&self.command[last..start]);
            let v = values
                .get(word)
                .ok_or_else(|| format!("--peer {}: {{{word}}} has no value here", self.name))?;
            out.push_str(v);
            last = end;
        }
        out.push_str(&self.command[last..]);
        Ok(out)
    }
}

/// A running peer router: `sh -c 'exec COMMAND'` in a process group of its own, killed
/// (SIGKILL to the group) and reaped on drop. Its stdout and stderr go to
/// `<dir>/peer-<name>.{stdout,stderr}.log`.
#[derive(Debug)]
pub(crate) struct PeerProc {
    child: Option<Child>,
    /// The peer's process id (the router itself once `exec` ran).
    pub pid: u32,
    /// Its stderr log.
    pub stderr_log: PathBuf,
    /// Its stdout log.
    pub stdout_log: PathBuf,
}

impl PeerProc {
    /// Starts `command` (already rendered) for peer `name`, logging into `dir`.
    ///
    /// # Errors
    /// When the logs cannot be created or `sh` cannot be started.
    pub(crate) fn spawn(name: &str, command: &str, dir: &Path) -> Result<PeerProc, String> {
        let stdout_log = dir.join(format!("peer-{name}.stdout.log"));
        let stderr_log = dir.join(format!("peer-{name}.stderr.log"));
        let out = std::fs::File::create(&stdout_log)
            .map_err(|e| format!("{}: {e}", stdout_log.display()))?;
        let err = std::fs::File::create(&stderr_log)
            .map_err(|e| format!("{}: {e}", stderr_log.display()))?;
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec {command}"))
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .process_group(0)
            .spawn()
            .map_err(|e| format!("peer {name}: sh: {e}"))?;
        Ok(PeerProc {
            pid: child.id(),
            child: Some(child),
            stderr_log,
            stdout_log,
        })
    }

    /// `Some(status)` once the peer has exited.
    pub(crate) fn exited(&mut self) -> Option<String> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
            .map(|s| s.to_string())
    }

    /// The last `n` lines of its stderr and stdout logs, for failure messages.
    pub(crate) fn log_tail(&self, n: usize) -> String {
        let tail = |p: &Path| {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        };
        format!(
            "stderr ({}):\n{}\nstdout ({}):\n{}",
            self.stderr_log.display(),
            tail(&self.stderr_log),
            self.stdout_log.display(),
            tail(&self.stdout_log)
        )
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let group = nix::unistd::Pid::from_raw(-(c.id() as i32));
            let _ = nix::sys::signal::kill(group, nix::sys::signal::Signal::SIGKILL);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_from_placeholders() {
        let p = PeerSpec::parse(
            "vr=router --port {port} --prefill {prefill_url} --decode {decode_url}",
        )
        .unwrap();
        assert_eq!(p.kind, Kind::Pd);
        let a = PeerSpec::parse("rr = router --port {port} --worker-urls {engine_urls}").unwrap();
        assert_eq!((a.name.as_str(), a.kind), ("rr", Kind::Agg));
        assert!(
            PeerSpec::parse("x=router --port {port}")
                .unwrap_err()
                .contains("no engines")
        );
        assert!(
            PeerSpec::parse("x=r {engine_url} {decode_url}")
                .unwrap_err()
                .contains("both")
        );
        assert!(
            PeerSpec::parse("x=r {engine_url} {prot}")
                .unwrap_err()
                .contains("{prot}")
        );
        assert!(PeerSpec::parse("ours-pd=r {engine_url}").is_err());
        assert!(PeerSpec::parse("a b=r {engine_url}").is_err());
        assert!(PeerSpec::parse("noequals").is_err());
    }

    #[test]
    fn render_leaves_other_braces() {
        let p =
            PeerSpec::parse(r#"x=r --port {port} --cfg '{"a":{"b":1}}' {engine_urls} {}"#).unwrap();
        let mut v = BTreeMap::new();
        v.insert("port", "9".to_string());
        v.insert("engine_urls", "http://a http://b".to_string());
        assert_eq!(
            p.render(&v).unwrap(),
            r#"r --port 9 --cfg '{"a":{"b":1}}' http://a http://b {}"#
        );
        v.remove("port");
        assert!(p.render(&v).unwrap_err().contains("{port}"));
    }
}
