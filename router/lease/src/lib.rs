//! The router lease: which router drives the fleet, under which fencing epoch, until when
//! (architecture.md section 7; behaviour.md 3; departure 9.9: the file record is fsynced).
//!
//! ```text
//!  LeaseDriver ──(clock: mono `started` before the write, wall `now`)──► LeaseStore
//!     │  owns the pure core `machine::Lease`           ├─ FileLease  flock(<path>.lock) + atomic fsynced record
//!     │  claim / renew loop / release                  ├─ EtcdLease  etcd v3 lease + txn on <key>, <key>/epoch
//!     │                                                 └─ KubeLease  one Lease object, PUT guarded by resourceVersion
//!     │  feeds every read (and its own writes) to the core's `Observer` (monotonic first sight)
//!     └─► control(now): Active | Standby | Fenced; LeaseEvent::Fenced to the router on a lost renewal
//!  publish(handoff) ──► beside the record (<path>.handoff, <key>/handoff), only while it is ours
//! ```
//!
//! The store does the read-decide-write atomically (under the flock, as an etcd
//! compare-and-swap transaction, or as a Kubernetes write guarded by `resourceVersion`); the decision itself is always the pure core's
//! ([`Lease::claim`], [`Lease::renew`], [`Lease::release`]), so both backends share one rule set.

pub mod config;
pub mod driver;
pub mod etcd;
pub mod file;
pub mod kubernetes;
pub mod machine;

use std::future::Future;
use std::time::Instant;

pub use driver::{LeaseDriver, LeaseEvent, LeaseStatus, holder_token};
pub use etcd::EtcdLease;
pub use file::FileLease;
pub use kubernetes::KubeLease;
pub use machine::{
    Claim, Control, Expiry, Freshness, LEASE_SCHEMA, Lease, LeaseLoss, LeaseRecord, LeaseTiming,
    Observer, RecordError, TimingError,
};

/// Why a lease store could not be read or written. Shown to operators as
/// `lease unavailable: <message>` ([`LeaseLoss::Unavailable`]).
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The fleet file's `lease` section cannot drive a lease (timing rule, empty key).
    #[error("lease config: {0}")]
    Config(String),
    /// The fleet file's lease timings break `ttl > renew_interval + safety_margin` or
    /// `renew_interval > 0`.
    #[error("lease config: {0}")]
    Timing(#[from] TimingError),
    /// A file-system step of the file backend failed.
    #[error("lease file {step} {path}: {source}")]
    Io {
        /// Which step (`open lock`, `lock`, `read`, `create`, `write`, `fsync`, `rename`,
        /// `fsync directory`).
        step: &'static str,
        /// The file or directory.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The exclusive flock on `<path>.lock` stayed taken by another process.
    #[error("lease lock {path} still held by another process after {waited_s} s")]
    LockBusy {
        /// The lock file.
        path: String,
        /// How long this process tried, seconds.
        waited_s: f64,
    },
    /// A stored record (or the etcd epoch key) does not parse or fails the schema rules
    /// (behaviour.md 3.2); names the file or key and the offending field.
    #[error("lease record {at} is malformed: {reason}")]
    Malformed {
        /// The file path or etcd key.
        at: String,
        /// What is wrong, naming the field.
        reason: String,
    },
    /// A write was sent and not confirmed, so it may have landed: an etcd transaction that
    /// failed or timed out after the request left, or a file whose directory fsync failed
    /// after the rename. Becomes [`LeaseLoss::Unconfirmed`].
    #[error("{0}")]
    Unconfirmed(Box<LeaseError>),
    /// An etcd call failed or timed out.
    #[error("etcd {op} on {endpoints}: {message}")]
    Etcd {
        /// The operation (`get`, `txn`, `grant`, `keep-alive`, `revoke`, `authenticate`).
        op: &'static str,
        /// The configured endpoints, comma-separated.
        endpoints: String,
        /// The client's error or `timed out after <n> s`.
        message: String,
    },
    /// A Kubernetes API call failed, timed out, or was refused.
    #[error("kubernetes {op} of lease {lease} at {api_server}: {message}")]
    Kubernetes {
        /// The operation (`get`, `create`, `update`).
        op: &'static str,
        /// `<namespace>/<name>`.
        lease: String,
        /// The API server's base URL.
        api_server: String,
        /// The client's error, or the API server's status, reason and message, with what to
        /// check for 401 and 403.
        message: String,
    },
}

impl From<LeaseError> for LeaseLoss {
    fn from(e: LeaseError) -> Self {
        match e {
            LeaseError::Unconfirmed(e) => LeaseLoss::Unconfirmed(e.to_string()),
            e => LeaseLoss::Unavailable(e.to_string()),
        }
    }
}

/// A place that stores the lease record and makes read-decide-write atomic.
///
/// Every operation reads the current record, lets the pure core (`core`, a copy of the
/// driver's) decide, and writes the decision, all atomically with respect to other routers.
/// `now` is the monotonic instant read by the driver *before* the operation began: a stale
/// value only makes decisions more conservative (another holder's record looks live longer,
/// our local validity ends earlier). `now_wall` (Unix seconds, read then too) is only written
/// into records, never compared with a record's times (ha-and-fencing.md 2.4).
pub trait LeaseStore: Send + Sync + 'static {
    /// Where the lease lives, for logs: `file <path>` or `etcd <key> at <endpoints>`.
    fn describe(&self) -> String;

    /// How a record of another holder lapses in this store: by this router's observation
    /// ([`Expiry::Observed`], the default: the file backend) or by the store deleting it
    /// ([`Expiry::Store`]: etcd's server-side lease). The claim decides with it whatever the
    /// core it is given says.
    fn expiry(&self) -> Expiry {
        Expiry::Observed
    }

    /// The current record, `None` when there is no lease (absent file, vanished etcd key).
    /// The warm standby compares its `epoch`/`holder` with the primary's handoff document.
    ///
    /// # Errors
    /// [`LeaseError`]: I/O, lock, etcd, or a malformed record (never reported as absent).
    fn read(&self) -> impl Future<Output = Result<Option<LeaseRecord>, LeaseError>> + Send;

    /// Claims the lease: [`Lease::claim`] (judging with [`LeaseStore::expiry`]) against the
    /// current record; on [`Claim::Write`] the record has been written (ours at its epoch)
    /// when this returns.
    ///
    /// # Errors
    /// [`LeaseError`]; nothing was granted.
    fn claim(
        &self,
        core: &Lease,
        now: Instant,
        now_wall: f64,
    ) -> impl Future<Output = Result<Claim, LeaseError>> + Send;

    /// Renews: [`Lease::renew`] against the current record; the inner `Ok` record has been
    /// written, the inner `Err` is the core's verdict (another holder, lapsed record).
    ///
    /// # Errors
    /// The outer [`LeaseError`] when the store could not be read or written.
    fn renew(
        &self,
        core: &Lease,
        now: Instant,
        now_wall: f64,
    ) -> impl Future<Output = Result<Result<LeaseRecord, LeaseLoss>, LeaseError>> + Send;

    /// Publishes `doc` (the holder's handoff document, JSON bytes) beside the record, only if
    /// [`Lease::may_publish`] allows it against the current record, atomically with that
    /// check (under the flock, or guarded by the record's etcd `mod_revision`). The inner
    /// `Err` is the core's verdict (not ours, lapsed); nothing was written then. A successor
    /// that claims after this returns finds `doc` ([`LeaseStore::read_all`]); one published
    /// later can never land (ha-and-fencing.md).
    ///
    /// # Errors
    /// The outer [`LeaseError`] when the store could not be read or written.
    fn publish(
        &self,
        core: &Lease,
        now: Instant,
        doc: Vec<u8>,
    ) -> impl Future<Output = Result<Result<(), LeaseLoss>, LeaseError>> + Send;

    /// The record and the last published handoff document, read together (one lock, or one
    /// etcd revision): `None` for either when absent.
    ///
    /// # Errors
    /// [`LeaseError`]: I/O, lock, etcd, or a malformed record.
    fn read_all(
        &self,
    ) -> impl Future<Output = Result<(Option<LeaseRecord>, Option<Vec<u8>>), LeaseError>> + Send;

    /// Releases at shutdown ([`Lease::release`]): marks the record released if it is still
    /// ours.
    /// Returns whether it was ours.
    ///
    /// # Errors
    /// [`LeaseError`]; the lease then simply lapses (one ttl unchanged, as observed).
    fn release(
        &self,
        core: &Lease,
        now_wall: f64,
    ) -> impl Future<Output = Result<bool, LeaseError>> + Send;
}

/// The backend chosen by the fleet file's `lease.backend` (`file`, `etcd` or `kubernetes`;
/// `none` has no
/// store at all, see [`LeaseDriver::from_config`]).
#[derive(Debug)]
pub enum AnyStore {
    /// `lease.backend = "file"`.
    File(FileLease),
    /// `lease.backend = "etcd"` (boxed: keeps the enum small).
    Etcd(Box<EtcdLease>),
    /// `lease.backend = "kubernetes"` (boxed: keeps the enum small).
    Kubernetes(Box<KubeLease>),
}

impl LeaseStore for AnyStore {
    fn describe(&self) -> String {
        match self {
            AnyStore::File(s) => s.describe(),
            AnyStore::Etcd(s) => s.describe(),
            AnyStore::Kubernetes(s) => s.describe(),
        }
    }

    fn expiry(&self) -> Expiry {
        match self {
            AnyStore::File(s) => s.expiry(),
            AnyStore::Etcd(s) => s.expiry(),
            AnyStore::Kubernetes(s) => s.expiry(),
        }
    }

    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        match self {
            AnyStore::File(s) => s.read().await,
            AnyStore::Etcd(s) => s.read().await,
            AnyStore::Kubernetes(s) => s.read().await,
        }
    }

    async fn claim(&self, core: &Lease, now: Instant, now_wall: f64) -> Result<Claim, LeaseError> {
        match self {
            AnyStore::File(s) => s.claim(core, now, now_wall).await,
            AnyStore::Etcd(s) => s.claim(core, now, now_wall).await,
            AnyStore::Kubernetes(s) => s.claim(core, now, now_wall).await,
        }
    }

    async fn renew(
        &self,
        core: &Lease,
        now: Instant,
        now_wall: f64,
    ) -> Result<Result<LeaseRecord, LeaseLoss>, LeaseError> {
        match self {
            AnyStore::File(s) => s.renew(core, now, now_wall).await,
            AnyStore::Etcd(s) => s.renew(core, now, now_wall).await,
            AnyStore::Kubernetes(s) => s.renew(core, now, now_wall).await,
        }
    }

    async fn release(&self, core: &Lease, now_wall: f64) -> Result<bool, LeaseError> {
        match self {
            AnyStore::File(s) => s.release(core, now_wall).await,
            AnyStore::Etcd(s) => s.release(core, now_wall).await,
            AnyStore::Kubernetes(s) => s.release(core, now_wall).await,
        }
    }

    async fn publish(
        &self,
        core: &Lease,
        now: Instant,
        doc: Vec<u8>,
    ) -> Result<Result<(), LeaseLoss>, LeaseError> {
        match self {
            AnyStore::File(s) => s.publish(core, now, doc).await,
            AnyStore::Etcd(s) => s.publish(core, now, doc).await,
            AnyStore::Kubernetes(s) => s.publish(core, now, doc).await,
        }
    }

    async fn read_all(&self) -> Result<(Option<LeaseRecord>, Option<Vec<u8>>), LeaseError> {
        match self {
            AnyStore::File(s) => s.read_all().await,
            AnyStore::Etcd(s) => s.read_all().await,
            AnyStore::Kubernetes(s) => s.read_all().await,
        }
    }
}

/// Parses a stored record strictly (behaviour.md 3.2): a JSON object with exactly the six
/// keys, the right types (`epoch` a non-negative integer, not a bool or float), then
/// [`LeaseRecord::validate`]. `at` names the file or key in the error.
///
/// # Errors
/// [`LeaseError::Malformed`] naming the field.
pub fn parse_record(bytes: &[u8], at: &str) -> Result<LeaseRecord, LeaseError> {
    let malformed = |reason: String| LeaseError::Malformed {
        at: at.to_string(),
        reason,
    };
    // Through a `Value` first: serde would also accept a JSON array as a struct.
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| malformed(e.to_string()))?;
    if !value.is_object() {
        return Err(malformed(format!("must be a JSON object, not {value}")));
    }
    let rec: LeaseRecord = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            malformed(e.inner().to_string())
        } else {
            malformed(format!("{path}: {}", e.inner()))
        }
    })?;
    rec.validate().map_err(|e| malformed(e.to_string()))?;
    Ok(rec)
}

/// The stored form of a record: JSON with sorted keys (the struct's field order) and a
/// trailing newline, as the reference writes it.
pub fn render_record(rec: &LeaseRecord) -> Vec<u8> {
    // A struct of strings and numbers always serialises.
    let mut out = serde_json::to_vec(rec).unwrap_or_default();
    out.push(b'\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok_json() -> serde_json::Value {
        serde_json::json!({"epoch": 3, "expires_at": 105.5, "holder": "r1:abc",
            "schema": LEASE_SCHEMA, "schema_version": 1, "updated_at": 100.5})
    }

    #[test]
    fn a_rendered_record_parses_back_with_sorted_keys_and_a_newline() {
        let rec = parse_record(ok_json().to_string().as_bytes(), "f").unwrap();
        let text = String::from_utf8(render_record(&rec)).unwrap();
        assert_eq!(
            text,
            "{\"epoch\":3,\"expires_at\":105.5,\"holder\":\"r1:abc\",\"schema\":\"narwhal.router-lease\",\"schema_version\":1,\"updated_at\":100.5}\n"
        );
        assert_eq!(parse_record(text.as_bytes(), "f").unwrap(), rec);
    }

    #[test]
    fn reading_is_strict_and_names_the_field() {
        let cases: Vec<(serde_json::Value, &str)> = vec![
            (serde_json::json!({"extra": 1}), "unknown field `extra`"),
            (
                serde_json::json!({"epoch": true}),
                "epoch: invalid type: boolean",
            ),
            (
                serde_json::json!({"epoch": 1.5}),
                "epoch: invalid type: floating point",
            ),
            (serde_json::json!({"epoch": 0}), "epoch: must be >= 1"),
            (
                serde_json::json!({"holder": ""}),
                "holder: must not be empty",
            ),
            (serde_json::json!({"schema": "x"}), "schema: must be"),
            (
                serde_json::json!({"schema_version": 2}),
                "schema_version: must be 1",
            ),
            (
                serde_json::json!({"expires_at": "5"}),
                "expires_at: invalid type: string",
            ),
        ];
        for (patch, want) in cases {
            let mut v = ok_json();
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
            let err = parse_record(v.to_string().as_bytes(), "/x/lease").unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.starts_with("lease record /x/lease is malformed: "),
                "{msg}"
            );
            assert!(msg.contains(want), "{msg} should contain {want}");
        }
        let mut v = ok_json();
        v.as_object_mut().unwrap().remove("updated_at");
        let msg = parse_record(v.to_string().as_bytes(), "f")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("missing field `updated_at`"), "{msg}");
        let torn = &ok_json().to_string().into_bytes()[..20];
        let msg = parse_record(torn, "f").unwrap_err().to_string();
        assert!(msg.contains("EOF"), "{msg}");
        let as_array = br#"[3, 105.5, "r1:abc", "narwhal.router-lease", 1, 100.5]"#;
        let msg = parse_record(as_array, "f").unwrap_err().to_string();
        assert!(msg.contains("must be a JSON object"), "{msg}");
    }
}
