//! A `narwhal-dev up` session as a test fixture: the local dev fleet (agents, mutual TLS, an
//! optional standby) an operator would start, with its ready file read back.
//!
//! ```text
//!   DevUp::start(dir, ready_file, &["--standby"])   returns once the ready file names the fleet
//!     .doc()       the ready file (`router`, `standby`, `engines[]`, `agents[]`, pids)
//!     .ready()     the same, typed ([`DevReady`])
//!     .urls()      (data, control, standby control or "")
//!     .engine(iid) one engine's entry (`iid`, `url`, `pid`)
//!     .pids()      every process of the session, named
//!   drop           SIGTERM to the supervisor, SIGKILL if it has not stopped within 60 s
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::dev_ready::DevReady;
use crate::proc::bin_path;
use crate::process::{blocking_until, exit_within, signal_pid};

/// `doc` read as a ready file; `None` when it is not one (a member of the wrong type).
fn typed(doc: &Value) -> Option<DevReady> {
    serde_json::from_value(doc.clone()).ok()
}

/// How long `narwhal-dev up` may take to write its ready file. Generous: the machine is shared
/// by several builds at once, and the session starts a whole fleet.
pub const UP_TIMEOUT: Duration = Duration::from_secs(120);

/// A running `narwhal-dev up` session, stopped on drop.
#[derive(Debug)]
pub struct DevUp {
    child: Option<Child>,
    dir: PathBuf,
    ready: PathBuf,
}

impl DevUp {
    /// Runs `narwhal-dev up --dir <dir> [--ready-file <ready>] <extra>` (its output goes to
    /// `<dir>.up.log`) and waits (at most [`UP_TIMEOUT`]) until its ready file names the
    /// session's control endpoint. Without `ready`, the ready file is `<dir>/fleet.ready.json`.
    ///
    /// # Panics
    /// When the session exits or does not become ready in time; the message carries its log.
    pub fn start(dir: &Path, ready: Option<&Path>, extra: &[&str]) -> DevUp {
        let log = std::fs::File::create(dir.with_extension("up.log")).expect("log file");
        let mut cmd = Command::new(bin_path("narwhal-dev"));
        cmd.arg("up").arg("--dir").arg(dir).args(extra);
        if let Some(r) = ready {
            cmd.arg("--ready-file").arg(r);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log));
        let child = cmd.spawn().expect("spawn narwhal-dev up");
        let ready = ready.map_or_else(|| dir.join("fleet.ready.json"), Path::to_path_buf);
        let mut up = DevUp {
            child: Some(child),
            dir: dir.to_path_buf(),
            ready,
        };
        let started = blocking_until(UP_TIMEOUT, || {
            if let Some(st) = up.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                return Some(Err(st));
            }
            up.ready_doc().map(|_| Ok(()))
        });
        match started {
            Some(Ok(())) => up,
            Some(Err(st)) => panic!("narwhal-dev up exited with {st}:\n{}", up.log()),
            None => panic!(
                "narwhal-dev up did not write {} in time:\n{}",
                up.ready.display(),
                up.log()
            ),
        }
    }

    /// What the session printed so far (`<dir>.up.log`).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.with_extension("up.log")).unwrap_or_default()
    }

    /// The ready file, once it names the session's control endpoint (`dev_control`).
    pub fn ready_doc(&self) -> Option<Value> {
        let doc: Value = serde_json::from_slice(&std::fs::read(&self.ready).ok()?).ok()?;
        (!typed(&doc)?.dev_control.is_empty()).then_some(doc)
    }

    /// The ready file as it is now.
    ///
    /// # Panics
    /// When it cannot be read.
    pub fn doc(&self) -> Value {
        self.ready_doc().expect("ready file")
    }

    /// The ready file as it is now, typed.
    ///
    /// # Panics
    /// When it cannot be read, or is not a ready file.
    pub fn ready(&self) -> DevReady {
        let doc = self.doc();
        typed(&doc).unwrap_or_else(|| panic!("not a narwhal-dev ready file: {doc}"))
    }

    /// Engine `iid`'s entry in the ready file (`iid`, `url`, `pid`, ...).
    ///
    /// # Panics
    /// When the session has no such engine.
    pub fn engine(&self, iid: &str) -> Value {
        let ready = self.ready();
        let engine = ready
            .engine(iid)
            .unwrap_or_else(|| panic!("no engine {iid} in the ready file: {ready:?}"));
        serde_json::to_value(engine).expect("an engine entry is JSON")
    }

    /// `(data, control, standby control or "")` of the session's routers.
    pub fn urls(&self) -> (String, String, String) {
        let ready = self.ready();
        (
            ready.router.data,
            ready.router.control,
            ready.standby.map(|s| s.control).unwrap_or_default(),
        )
    }

    /// Process id of the supervisor (the `narwhal-dev up` the test started); 0 once it exited.
    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Waits (at most `within`) for the supervisor to exit by itself; its status, `None` when
    /// it still runs (it is then stopped on drop as usual).
    pub fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let status = exit_within(self.child.as_mut()?, within)?;
        self.child = None;
        Some(status)
    }

    /// Every process the session started, and the fleet process itself, named (`fleet
    /// process`, `router`, `standby`, `engine <iid>`, `agent <id>`).
    ///
    /// # Panics
    /// When one has no pid in the ready file.
    pub fn pids(&self) -> Vec<(String, i32)> {
        let d = self.ready();
        let pid = |p: u32| p as i32;
        let mut v = vec![
            ("fleet process".to_string(), pid(d.dev_pid)),
            ("router".to_string(), pid(d.router.pid)),
        ];
        if let Some(s) = &d.standby {
            v.push(("standby".into(), pid(s.pid)));
        }
        for e in &d.engines {
            v.push((format!("engine {}", e.iid), pid(e.pid)));
        }
        for a in &d.agents {
            v.push((format!("agent {}", a.id), pid(a.pid)));
        }
        for (name, pid) in &v {
            assert!(*pid > 0, "{name} has no pid in the ready file");
        }
        v
    }
}

impl Drop for DevUp {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGTERM: the session stops its children; SIGKILL if it does not within 60 s.
            let _ = signal_pid(c.id() as i32, nix::sys::signal::Signal::SIGTERM);
            if exit_within(&mut c, Duration::from_secs(60)).is_none() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
