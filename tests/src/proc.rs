//! Child processes that announce their address on the first stdout line.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a child may take to print its first line. Generous: a loaded 2-core CI machine
/// can be slow to exec a freshly linked debug binary.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a child process could not be started or did not announce itself.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// The binary could not be executed.
    #[error("spawn {bin}: {source}")]
    Spawn {
        /// Path of the binary.
        bin: String,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// The child exited or closed stdout before printing its first line.
    #[error("{bin} exited before announcing its address (status {status}); stderr tail:\n{stderr}")]
    Exited {
        /// Path of the binary.
        bin: String,
        /// Exit status as printed by the OS.
        status: String,
        /// Last lines of the child's stderr log.
        stderr: String,
    },
    /// The child did not print its first line within the deadline.
    #[error("{bin} did not announce its address within {waited_s} s")]
    Timeout {
        /// Path of the binary.
        bin: String,
        /// Seconds waited.
        waited_s: f64,
    },
    /// The first line did not have the expected shape.
    #[error("{bin} printed an unexpected first line: {line:?}")]
    BadLine {
        /// Path of the binary.
        bin: String,
        /// The line it printed.
        line: String,
    },
    /// The ready file lacks a field the kit needs.
    #[error("{bin}: ready file {path} has no {field:?}: {doc}")]
    ReadyFile {
        /// Path of the binary.
        bin: String,
        /// The ready file.
        path: PathBuf,
        /// The missing field.
        field: &'static str,
        /// What the file held.
        doc: String,
    },
}

/// Path of a workspace binary built by cargo, e.g. `bin_path("narwhal-serve")`.
///
/// Resolution order: `$NARWHAL_BIN_DIR/<name>`; then the directory of the running executable
/// (for `narwhal-dev` and friends, which sit beside the other binaries); then its parent (for
/// test executables under `target/<profile>/deps/`). `cargo test --workspace` builds every
/// binary of the workspace before running tests, because each crate has integration tests.
pub fn bin_path(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("NARWHAL_BIN_DIR") {
        return Path::new(&dir).join(name);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if !dir.join(name).exists() && dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(name)
}

/// A running child process, killed (SIGKILL) and reaped on drop.
///
/// Its stdout is drained by a thread (so the child never blocks on a full pipe) and kept in
/// memory; stderr goes to `<log_dir>/<label>.stderr.log`.
#[derive(Debug)]
pub struct ChildProc {
    child: Option<Child>,
    /// The first stdout line the child printed.
    pub first_line: String,
    /// Path of the stderr log.
    pub stderr_log: PathBuf,
    /// Short name used in logs and errors.
    pub label: String,
}

impl ChildProc {
    /// Starts `cmd`, waits up to `timeout` for its first stdout line and returns it.
    ///
    /// # Errors
    /// [`ProcError`] when the child cannot start, exits, or stays silent past `timeout`.
    pub fn spawn(
        mut cmd: Command,
        label: &str,
        log_dir: &Path,
        timeout: Duration,
    ) -> Result<Self, ProcError> {
        let bin = format!("{:?}", cmd.get_program());
        let stderr_log = log_dir.join(format!("{label}.stderr.log"));
        let stderr = std::fs::File::create(&stderr_log).map_err(|source| ProcError::Spawn {
            bin: bin.clone(),
            source,
        })?;
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .stdin(Stdio::null());
        let mut child = cmd.spawn().map_err(|source| ProcError::Spawn {
            bin: bin.clone(),
            source,
        })?;
        let stdout = child.stdout.take().expect("stdout was piped above");
        let (tx, rx) = mpsc::channel::<Option<String>>();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok);
            let _ = tx.send(first);
            // Keep draining so the child never blocks writing to a full pipe.
            for _ in lines {}
        });
        let mut proc = ChildProc {
            child: Some(child),
            first_line: String::new(),
            stderr_log,
            label: label.to_string(),
        };
        match rx.recv_timeout(timeout) {
            Ok(Some(line)) => {
                proc.first_line = line;
                Ok(proc)
            }
            Ok(None) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = proc
                    .child
                    .as_mut()
                    .and_then(|c| c.wait().ok())
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                Err(ProcError::Exited {
                    bin,
                    status,
                    stderr: proc.stderr_tail(40),
                })
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(ProcError::Timeout {
                bin,
                waited_s: timeout.as_secs_f64(),
            }),
        }
    }

    /// Process id of the child.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// Sends SIGKILL and reaps the child.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends a signal (e.g. `SIGTERM`, `SIGSTOP`) without reaping.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        if let Some(c) = &self.child {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), sig);
        }
    }

    /// Waits up to `timeout` for the child to exit by itself; returns its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while self.child.is_some() && Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// The last `n` lines of the child's stderr log, for failure messages.
    pub fn stderr_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.stderr_log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Takes the `http://HOST:PORT` (or https) URL out of the first line: the first
    /// whitespace-separated word that starts with a scheme, or `key=URL` for `key`.
    pub fn url_in_first_line(&self, key: Option<&str>) -> Option<String> {
        self.first_line.split_whitespace().find_map(|w| match key {
            Some(k) => w.strip_prefix(&format!("{k}=")).map(str::to_string),
            None => (w.starts_with("http://") || w.starts_with("https://")).then(|| w.to_string()),
        })
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` every 10 ms until it returns `Some`, or `deadline` passes (then `None`).
/// The one way tests wait for a condition: never a bare sleep.
pub async fn wait_until<T, F, Fut>(deadline: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= end {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`wait_until`] that panics naming `what` when `deadline` passes.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    match wait_until(deadline, f).await {
        Some(v) => v,
        None => panic!("timed out after {deadline:?} waiting for {what}"),
    }
}

/// Polls `f` every 20 ms on this thread until it returns true or `within` passes; then
/// returns `f()` once more. For synchronous tests.
pub fn poll_blocking(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// Writes `text` to `path` (a config or fleet file for a child process).
///
/// # Errors
/// [`ProcError::Spawn`] naming the file.
pub(crate) fn write_file(path: &Path, text: &str) -> Result<(), ProcError> {
    std::fs::write(path, text).map_err(|source| ProcError::Spawn {
        bin: path.display().to_string(),
        source,
    })
}

/// Writes an executable script `path` (mode 0755) with `body`, written by a child `sh`, never
/// opened for writing by this process.
///
/// Why: a file this process holds open for writing is inherited by any child another test
/// thread forks at that moment, until that child's `exec`, and executing the file meanwhile
/// fails with `ETXTBSY` ("Text file busy"). The child shell's descriptor is never shared with
/// this process's forks, so the script can be run as soon as this returns.
///
/// # Panics
/// When `sh` cannot run or the file cannot be written.
pub fn write_executable(path: &Path, body: &str) {
    use std::io::Write as _;
    let mut child = std::process::Command::new("sh")
        .args(["-c", "cat > \"$1\" && chmod 755 \"$1\"", "sh"])
        .arg(path)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("sh (writing {}): {e}", path.display()));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(body.as_bytes())
        .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    let status = child.wait().expect("sh");
    assert!(status.success(), "writing {}: sh {status}", path.display());
}

/// A JSON file (a `--ready-file` document), `Value::Null` when missing or not JSON.
pub fn read_json_file(path: &Path) -> serde_json::Value {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}
