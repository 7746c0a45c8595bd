//! A real single-member etcd on loopback, for the etcd lease backend's tests.
//!
//! The `etcd` binary (Debian `etcd-server`; override with `NARWHAL_ETCD_BIN`) is required:
//! without it [`Etcd::start`] panics with a message saying so, so those tests FAIL instead of
//! passing silently.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::http::Http;

/// A single-member etcd on two free loopback ports, killed on drop.
#[derive(Debug)]
pub struct Etcd {
    child: Child,
    /// Client URL, `http://127.0.0.1:PORT`.
    pub endpoint: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

/// A free loopback port (bound to `:0` and released: a rare collision is possible).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind :0")
        .local_addr()
        .expect("local addr")
        .port()
}

impl Etcd {
    /// Starts etcd with short raft timers (heartbeat 10 ms, election 100 ms, so it grants
    /// 1–2 s leases and expires them promptly) and waits until `/health` says healthy.
    ///
    /// # Panics
    /// When the binary cannot run, or etcd does not become healthy in 3 attempts of 15 s.
    pub async fn start() -> Etcd {
        let bin = std::env::var("NARWHAL_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
        if let Err(e) = Command::new(&bin).arg("--version").output() {
            panic!(
                "cannot run the etcd binary {bin:?} ({e}): these tests need a real etcd. \
                 Install Debian's etcd-server (apt-get install -y etcd-server) or set \
                 NARWHAL_ETCD_BIN to an etcd v3 server binary"
            );
        }
        let http = Http::new(Duration::from_secs(2));
        // Ports are picked by binding :0 and releasing them; a rare collision is retried.
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("tempdir");
            let (client, peer) = (free_port(), free_port());
            let endpoint = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = dir.path().join("etcd.log");
            let out = std::fs::File::create(&log).expect("etcd log");
            let child = Command::new(&bin)
                .args(["--name", "narwhal-test"])
                .arg("--data-dir")
                .arg(dir.path().join("data"))
                .args(["--listen-client-urls", &endpoint])
                .args(["--advertise-client-urls", &endpoint])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("narwhal-test={peer_url}")])
                .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
                .stdin(Stdio::null())
                .stdout(out.try_clone().expect("dup log"))
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("spawning {bin}: {e}"));
            let mut etcd = Etcd {
                child,
                endpoint,
                log,
                _dir: dir,
            };
            if etcd.wait_ready(&http).await {
                return etcd;
            }
        }
        panic!("etcd did not start on loopback after 3 attempts");
    }

    /// Polls `GET /health` until etcd says healthy (deadline 15 s); `false` if it exited
    /// (port taken).
    async fn wait_ready(&mut self, http: &Http) -> bool {
        let t0 = tokio::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                eprintln!("etcd exited with {status}:\n{}", self.log_text());
                return false;
            }
            if let Some(r) = http.try_get(format!("{}/health", self.endpoint)).await
                && r.json_or_null()["health"] == "true"
            {
                return true;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "etcd at {} not healthy after 15 s:\n{}",
                self.endpoint,
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// etcd's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `sig` (SIGSTOP, SIGCONT) to the etcd process.
    ///
    /// # Panics
    /// When the signal cannot be sent.
    pub fn signal(&self, sig: Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("signal etcd");
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
