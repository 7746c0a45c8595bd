//! File lease backend: an exclusive `flock` on `<path>.lock` around every read-decide-write,
//! and the `narwhal.router-lease` record replaced atomically and durably (behaviour.md 3.2
//! and 3.3; architecture.md 9.9 adds the fsyncs the reference lacks, 11.16).
//!
//! The lock is `flock(LOCK_EX)` (std's [`std::fs::File::try_lock`]), so a Python reference
//! router on the same file interoperates. It is taken non-blocking and retried for up to
//! `lock_timeout`: a holder stopped by `SIGSTOP` while inside the lock must not hang the other
//! router forever. Blocking file I/O runs in [`tokio::task::spawn_blocking`].

use std::fs::{File, OpenOptions, TryLockError};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{
    Claim, Expiry, Lease, LeaseError, LeaseLoss, LeaseRecord, LeaseStore, parse_record,
    render_record,
};

/// How long to wait for the flock by default, seconds.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(1);

/// The file backend (`lease.backend = "file"`, `lease.path`).
#[derive(Debug, Clone)]
pub struct FileLease {
    path: PathBuf,
    lock_path: PathBuf,
    handoff_path: PathBuf,
    lock_timeout: Duration,
}

impl FileLease {
    /// A lease stored at `path`, locked through `<path>.lock` (the suffix is appended to the
    /// full file name, as the reference does), with the holder's published handoff at
    /// `<path>.handoff`. Nothing is opened yet.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        let suffixed = |suffix: &str| {
            let mut p = path.clone().into_os_string();
            p.push(suffix);
            PathBuf::from(p)
        };
        FileLease {
            lock_path: suffixed(".lock"),
            handoff_path: suffixed(".handoff"),
            path,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
        }
    }

    /// How long an operation waits for the flock before failing with
    /// [`LeaseError::LockBusy`] (default [`DEFAULT_LOCK_TIMEOUT`]).
    #[must_use]
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// The record file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The lock file (`<path>.lock`).
    pub fn lock_path(&self) -> &Path {
        &self.lock_path
    }

    /// The published handoff (`<path>.handoff`).
    pub fn handoff_path(&self) -> &Path {
        &self.handoff_path
    }

    /// Runs `f` under the exclusive flock, on the blocking pool.
    async fn locked<T: Send + 'static>(
        &self,
        f: impl FnOnce(&FileLease) -> Result<T, LeaseError> + Send + 'static,
    ) -> Result<T, LeaseError> {
        let me = self.clone();
        match tokio::task::spawn_blocking(move || {
            let _guard = me.lock()?;
            f(&me)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => Err(LeaseError::Io {
                step: "run blocking task",
                path: self.path.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            }),
        }
    }

    /// Takes the flock, retrying every 5 ms for up to `lock_timeout`. The lock is released
    /// when the returned file is dropped (closing the descriptor).
    fn lock(&self) -> Result<File, LeaseError> {
        let io = |step, source| LeaseError::Io {
            step,
            path: self.lock_path.display().to_string(),
            source,
        };
        if let Some(dir) = self
            .lock_path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir).map_err(|e| io("create directory", e))?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.lock_path)
            .map_err(|e| io("open lock", e))?;
        // Bounded by a count of 5 ms naps rather than a clock reading: the wait only has to
        // end, not be measured precisely.
        let nap = Duration::from_millis(5);
        let tries = (self.lock_timeout.as_millis() / nap.as_millis()).max(1);
        for _ in 0..tries {
            match file.try_lock() {
                Ok(()) => return Ok(file),
                Err(TryLockError::WouldBlock) => std::thread::sleep(nap),
                Err(TryLockError::Error(e)) => return Err(io("lock", e)),
            }
        }
        match file.try_lock() {
            Ok(()) => Ok(file),
            Err(TryLockError::WouldBlock) => Err(LeaseError::LockBusy {
                path: self.lock_path.display().to_string(),
                waited_s: self.lock_timeout.as_secs_f64(),
            }),
            Err(TryLockError::Error(e)) => Err(io("lock", e)),
        }
    }

    /// Reads the record; the caller holds the lock. Absent file = `None`.
    fn read_unlocked(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        match std::fs::read(&self.path) {
            Ok(bytes) => parse_record(&bytes, &self.path.display().to_string()).map(Some),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(LeaseError::Io {
                step: "read",
                path: self.path.display().to_string(),
                source: e,
            }),
        }
    }

    /// Reads the published handoff; the caller holds the lock. Absent file = `None`.
    fn read_handoff_unlocked(&self) -> Result<Option<Vec<u8>>, LeaseError> {
        match std::fs::read(&self.handoff_path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(LeaseError::Io {
                step: "read",
                path: self.handoff_path.display().to_string(),
                source: e,
            }),
        }
    }

    /// Writes `rec` to a temp sibling `.<name>.<pid>.<hex>.tmp`, fsyncs it, renames it over
    /// the record and fsyncs the directory; the caller holds the lock. On failure the old
    /// record is untouched and the temp file removed.
    fn write_unlocked(&self, rec: &LeaseRecord) -> Result<(), LeaseError> {
        self.replace_unlocked(&self.path, &render_record(rec))
    }

    /// Replaces `target` (the record or the handoff beside it) with `bytes` durably: temp
    /// sibling, fsync, rename, fsync of the directory; the caller holds the lock.
    fn replace_unlocked(&self, target: &Path, bytes: &[u8]) -> Result<(), LeaseError> {
        narwhal_shared::write_atomic(target, bytes).map_err(|e| LeaseError::Io {
            step: e.step,
            path: e.path.display().to_string(),
            source: e.source,
        })
    }

    /// Writes `rec` under the lock without any decision: for tests and tools that need to
    /// stage a record (another holder's, an expired one).
    ///
    /// # Errors
    /// [`LeaseError`] from the lock or the write.
    pub async fn overwrite(&self, rec: LeaseRecord) -> Result<(), LeaseError> {
        self.locked(move |me| me.write_unlocked(&rec)).await
    }
}

impl LeaseStore for FileLease {
    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }

    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        self.locked(|me| me.read_unlocked()).await
    }

    /// A record written by another router is live until it has stayed unchanged for its own
    /// duration since this router first saw it (the file holds no clock of its own).
    fn expiry(&self) -> Expiry {
        Expiry::Observed
    }

    async fn claim(&self, core: &Lease, now: Instant, now_wall: f64) -> Result<Claim, LeaseError> {
        let core = core.clone().with_expiry(self.expiry());
        self.locked(move |me| {
            let current = me.read_unlocked()?;
            let decision = core.claim(current.as_ref(), now, now_wall);
            if let Claim::Write(rec) = &decision {
                me.write_unlocked(rec)?;
            }
            Ok(decision)
        })
        .await
    }

    async fn renew(
        &self,
        core: &Lease,
        now: Instant,
        now_wall: f64,
    ) -> Result<Result<LeaseRecord, LeaseLoss>, LeaseError> {
        let mut core = core.clone();
        self.locked(move |me| {
            let current = me.read_unlocked()?;
            match core.renew(current.as_ref(), now, now_wall) {
                Ok(rec) => {
                    me.write_unlocked(&rec)?;
                    Ok(Ok(rec))
                }
                Err(loss) => Ok(Err(loss)),
            }
        })
        .await
    }

    async fn release(&self, core: &Lease, now_wall: f64) -> Result<bool, LeaseError> {
        let mut core = core.clone();
        self.locked(move |me| {
            let current = me.read_unlocked()?;
            match core.release(current.as_ref(), now_wall) {
                Some(rec) => me.write_unlocked(&rec).map(|()| true),
                None => Ok(false),
            }
        })
        .await
    }

    async fn publish(
        &self,
        core: &Lease,
        now: Instant,
        doc: Vec<u8>,
    ) -> Result<Result<(), LeaseLoss>, LeaseError> {
        let core = core.clone();
        self.locked(move |me| {
            let current = me.read_unlocked()?;
            match core.may_publish(current.as_ref(), now) {
                Ok(_) => me
                    .replace_unlocked(&me.handoff_path, &doc)
                    .map(Ok)
                    .map_err(|e| match e {
                        // After the rename: the new document is in place, not known durable.
                        LeaseError::Io {
                            step: "fsync directory",
                            ..
                        } => LeaseError::Unconfirmed(Box::new(e)),
                        e => e,
                    }),
                Err(loss) => Ok(Err(loss)),
            }
        })
        .await
    }

    async fn read_all(&self) -> Result<(Option<LeaseRecord>, Option<Vec<u8>>), LeaseError> {
        self.locked(|me| Ok((me.read_unlocked()?, me.read_handoff_unlocked()?)))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Control, LeaseTiming};
    use narwhal_shared::{Clock as _, SystemClock};

    fn timing() -> LeaseTiming {
        LeaseTiming {
            ttl: Duration::from_secs(2),
            renew_interval: Duration::from_millis(500),
            safety_margin: Duration::from_millis(500),
        }
    }

    const S: Duration = Duration::from_secs(1);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn setup() -> (tempfile::TempDir, FileLease) {
        let dir = tempfile::tempdir().unwrap();
        let store = FileLease::new(dir.path().join("narwhal.router-lease"));
        (dir, store)
    }

    #[test]
    fn lock_file_is_the_full_name_plus_dot_lock() {
        let s = FileLease::new("/var/lib/narwhal/router.lease");
        assert_eq!(
            s.lock_path(),
            Path::new("/var/lib/narwhal/router.lease.lock")
        );
        assert_eq!(s.describe(), "file /var/lib/narwhal/router.lease");
    }

    #[tokio::test]
    async fn claim_refuse_takeover_fence_and_release() {
        let (_dir, store) = setup();
        let t0 = SystemClock.now();
        assert_eq!(store.read().await.unwrap(), None, "absent file is no lease");

        // A claims epoch 1.
        let mut a = Lease::new("a:1".into(), timing());
        let Claim::Write(rec) = store.claim(&a, t0, 100.0).await.unwrap() else {
            panic!("A must get the free lease")
        };
        assert_eq!(
            (rec.epoch, rec.holder.as_str(), rec.expires_at),
            (1, "a:1", 102.0)
        );
        a.granted(rec.epoch, t0);
        assert_eq!(store.read().await.unwrap(), Some(rec.clone()));
        let text = std::fs::read_to_string(store.path()).unwrap();
        assert!(
            text.ends_with("}\n") && text.starts_with("{\"epoch\":1,"),
            "{text}"
        );

        // B is refused while A's record is live, and nothing is written.
        let mut b = Lease::new("b:2".into(), timing());
        let held = store.claim(&b, t0 + S, 101.0).await.unwrap();
        assert_eq!(
            held,
            Claim::HeldBy {
                holder: "a:1".into(),
                epoch: 1,
                expires_at: 102.0,
                updated_at: 100.0,
            }
        );
        assert_eq!(store.read().await.unwrap(), Some(rec));

        // A renews: same epoch, later expiry.
        let renewed = store.renew(&a, t0 + S, 101.0).await.unwrap().unwrap();
        assert_eq!((renewed.epoch, renewed.expires_at), (1, 103.0));

        // After expiry B takes over at epoch 2: B saw the renewed record at +1 s, and it stayed
        // unchanged for its 2 s on B's monotonic clock.
        b.observe(Some(&renewed), t0 + S);
        let Claim::Write(rb) = store.claim(&b, t0 + 3 * S, 103.0).await.unwrap() else {
            panic!("B must take the expired lease")
        };
        assert_eq!((rb.epoch, rb.holder.as_str()), (2, "b:2"));
        b.granted(rb.epoch, t0);

        // A's next renewal finds B: fenced at once, record untouched.
        assert_eq!(
            store.renew(&a, t0 + ms(3100), 103.1).await.unwrap(),
            Err(LeaseLoss::HeldByAnother)
        );
        a.fence(LeaseLoss::HeldByAnother);
        assert_eq!(a.control(t0), Control::Fenced);
        assert_eq!(store.read().await.unwrap(), Some(rb.clone()));

        // A's release does not touch B's record; B's release expires it at the same epoch.
        assert!(!store.release(&a, 103.2).await.unwrap());
        assert_eq!(store.read().await.unwrap(), Some(rb));
        assert!(store.release(&b, 103.5).await.unwrap());
        let released = store.read().await.unwrap().unwrap();
        assert_eq!((released.epoch, released.expires_at), (2, 103.5));
        assert!(released.released());

        // The next claim, even right away, advances the epoch.
        let Claim::Write(rc) = store.claim(&a, t0 + ms(3600), 103.6).await.unwrap() else {
            panic!("released lease is free")
        };
        assert_eq!(rc.epoch, 3);
        let leftovers: Vec<_> = std::fs::read_dir(_dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");
    }

    /// ha-and-fencing.md: only the live holder publishes its handoff beside the record; a
    /// successor's claim makes every later publish of the old holder fail, and the successor reads
    /// what was published before its claim.
    #[tokio::test]
    async fn only_the_live_holder_publishes_and_a_successor_reads_it() {
        let (_dir, store) = setup();
        let t0 = SystemClock.now();
        assert_eq!(store.read_all().await.unwrap(), (None, None));
        let mut a = Lease::new("a:1".into(), timing());
        assert_eq!(
            store.publish(&a, t0, b"{}".to_vec()).await.unwrap(),
            Err(LeaseLoss::Lapsed),
            "nothing owned: nothing published"
        );
        let Claim::Write(rec) = store.claim(&a, t0, 100.0).await.unwrap() else {
            panic!()
        };
        a.granted(rec.epoch, t0);
        assert_eq!(
            store
                .publish(&a, t0 + ms(500), b"doc-1".to_vec())
                .await
                .unwrap(),
            Ok(())
        );
        assert_eq!(
            store.read_all().await.unwrap(),
            (Some(rec.clone()), Some(b"doc-1".to_vec()))
        );
        // B takes over after expiry (it saw A's record at t0, unchanged for 2 s since); A's late
        // publish is refused and changes nothing.
        let mut b = Lease::new("b:2".into(), timing());
        b.observe(Some(&rec), t0);
        let Claim::Write(rb) = store.claim(&b, t0 + 3 * S, 103.0).await.unwrap() else {
            panic!()
        };
        b.granted(rb.epoch, t0 + 3 * S);
        assert_eq!(
            store
                .publish(&a, t0 + ms(3100), b"late".to_vec())
                .await
                .unwrap(),
            Err(LeaseLoss::HeldByAnother)
        );
        let (r, doc) = store.read_all().await.unwrap();
        assert_eq!((r, doc.as_deref()), (Some(rb), Some(&b"doc-1"[..])));
        assert_eq!(
            store
                .publish(&b, t0 + ms(3200), b"doc-2".to_vec())
                .await
                .unwrap(),
            Ok(())
        );
        assert_eq!(
            std::fs::read(store.handoff_path()).unwrap(),
            b"doc-2",
            "{}",
            store.handoff_path().display()
        );
        assert!(
            store
                .handoff_path()
                .to_string_lossy()
                .ends_with("narwhal.router-lease.handoff")
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_claims_have_exactly_one_winner() {
        let (_dir, store) = setup();
        let t0 = SystemClock.now();
        let mut tasks = Vec::new();
        for i in 0..8 {
            // Separate stores: every operation opens its own lock file description.
            let s = FileLease::new(store.path());
            tasks.push(tokio::spawn(async move {
                let core = Lease::new(format!("r{i}:x"), timing());
                s.claim(&core, t0, 100.0).await.unwrap()
            }));
        }
        let mut winners = Vec::new();
        for t in tasks {
            if let Claim::Write(rec) = t.await.unwrap() {
                winners.push(rec);
            }
        }
        assert_eq!(winners.len(), 1, "{winners:?}");
        assert_eq!(winners[0].epoch, 1);
        assert_eq!(store.read().await.unwrap(), Some(winners.remove(0)));
    }

    #[tokio::test]
    async fn a_torn_record_is_an_error_not_an_absent_lease() {
        let (_dir, store) = setup();
        std::fs::write(store.path(), b"{\"epoch\": 1, \"expires_at\": 10").unwrap();
        let err = store.read().await.unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "lease record {} is malformed",
                store.path().display()
            )),
            "{err}"
        );
        let a = Lease::new("a:1".into(), timing());
        let err = store.claim(&a, SystemClock.now(), 100.0).await.unwrap_err();
        assert!(matches!(err, LeaseError::Malformed { .. }), "{err}");
        // Never overwritten by a claim.
        assert_eq!(
            std::fs::read(store.path()).unwrap(),
            b"{\"epoch\": 1, \"expires_at\": 10"
        );
        let loss: LeaseLoss = err.into();
        assert!(
            loss.to_string()
                .starts_with("lease unavailable: lease record ")
        );
    }

    #[tokio::test]
    async fn a_renewal_of_a_lapsed_or_vanished_record_is_refused() {
        let (_dir, store) = setup();
        let t0 = SystemClock.now();
        let mut a = Lease::new("a:1".into(), timing());
        let Claim::Write(rec) = store.claim(&a, t0, 100.0).await.unwrap() else {
            panic!()
        };
        a.granted(rec.epoch, t0);
        // Lapsed: past its local validity (ttl − margin after the claim).
        assert_eq!(
            store.renew(&a, t0 + ms(2500), 102.5).await.unwrap(),
            Err(LeaseLoss::Lapsed)
        );
        std::fs::remove_file(store.path()).unwrap();
        assert_eq!(
            store.renew(&a, t0 + ms(500), 100.5).await.unwrap(),
            Err(LeaseLoss::Lapsed)
        );
    }

    #[tokio::test]
    async fn a_lock_held_elsewhere_times_out_with_a_named_error() {
        let (_dir, store) = setup();
        let store = store.with_lock_timeout(Duration::from_millis(50));
        // Hold the lock through a second, independent open file description.
        let other = File::create(store.lock_path()).unwrap();
        other.lock().unwrap();
        let err = store.read().await.unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "lease lock {} still held by another process after 0.",
                store.lock_path().display()
            )),
            "{err}"
        );
        other.unlock().unwrap();
        assert_eq!(store.read().await.unwrap(), None);
    }

    #[tokio::test]
    async fn an_unwritable_directory_is_an_io_error_naming_the_step() {
        let (dir, _) = setup();
        // A regular file where the directory should be.
        let blocker = dir.path().join("not-a-dir");
        std::fs::write(&blocker, b"x").unwrap();
        let store = FileLease::new(blocker.join("lease"));
        let a = Lease::new("a:1".into(), timing());
        let err = store
            .claim(&a, SystemClock.now(), 1.0)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("lease file create directory"), "{err}");
    }
}
