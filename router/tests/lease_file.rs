//! The file lease backend across processes: another process holding `flock` on
//! `<path>.lock` (here util-linux `flock(1)`, as a second router or the Python reference would)
//! keeps this router out until it lets go; and two drivers in this process share one record.
// Tests measure wall time (bounded waits): the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use narwhal_router::config::{LeaseBackend, LeaseSection};
use narwhal_router::lease::{Control, LeaseDriver, LeaseError, LeaseLoss};
use narwhal_shared::{Clock, SystemClock};

/// A child process holding the flock; killed on drop.
struct Holder(Child);

impl Holder {
    /// Starts `flock --no-fork <lock> sh -c 'echo locked; exec sleep 30'` and waits for its line.
    fn start(lock: &std::path::Path) -> Holder {
        // `--no-fork`: flock execs the command, so killing the child releases the lock.
        let mut child = Command::new("flock")
            .arg("--no-fork")
            .arg(lock)
            .args(["sh", "-c", "echo locked; exec sleep 30"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("this test needs util-linux flock(1): {e}"));
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "locked");
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn section(path: &std::path::Path) -> LeaseSection {
    LeaseSection {
        backend: LeaseBackend::File,
        path: path.display().to_string(),
        endpoints: vec![],
        key: "/narwhal/router-lease".into(),
        ttl_s: 1.0,
        renew_interval_s: 0.2,
        safety_margin_s: 0.2,
        etcd: Default::default(),
        kubernetes: Default::default(),
    }
}

#[tokio::test]
async fn another_process_holding_the_flock_keeps_the_router_out_until_it_lets_go() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("narwhal.router-lease");
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let a = LeaseDriver::from_config(&section(&path), "router-a", clock.clone()).unwrap();
    let holder = Holder::start(&dir.path().join("narwhal.router-lease.lock"));
    let t0 = tokio::time::Instant::now();
    let err = a.claim().await.unwrap_err();
    let LeaseLoss::Unavailable(msg) = &err else {
        panic!("{err:?}")
    };
    assert!(
        msg.contains("still held by another process after 0.25 s"),
        "{msg}"
    );
    assert!(t0.elapsed() < Duration::from_secs(2), "bounded wait");
    assert_eq!(a.control(clock.now()), Control::Standby);
    assert!(matches!(
        a.read_record().await,
        Err(LeaseError::LockBusy { .. })
    ));
    drop(holder);
    assert_eq!(a.claim().await, Ok(1));
    assert_eq!(a.control(clock.now()), Control::Active);
    let b = LeaseDriver::from_config(&section(&path), "router-b", clock.clone()).unwrap();
    assert_eq!(b.claim().await, Err(LeaseLoss::HeldByAnother));
    let rec = b.read_record().await.unwrap().unwrap();
    assert_eq!((rec.epoch, rec.holder), (1, a.holder()));
    assert!(a.release().await.unwrap());
    assert_eq!(b.claim().await, Ok(2));
}
