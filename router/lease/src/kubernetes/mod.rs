//! Kubernetes lease backend (`lease.backend = "kubernetes"`; docs/ha.md, "`kubernetes`
//! backend"): the router lease kept in one `coordination.k8s.io/v1` Lease object, for routers
//! that run as pods.
//!
//! ```text
//!  Lease <namespace>/<name>
//!    metadata.annotations["narwhal.dev/router-lease"]  the narwhal.router-lease record (the truth)
//!    metadata.annotations["narwhal.dev/handoff"]       the holder's published handoff document
//!    metadata.finalizers ["narwhal.dev/keep-epoch"]    a delete only marks it: the epoch stays
//!    spec.holderIdentity / renewTime / leaseTransitions  mirrored from the record for kubectl
//! ```
//!
//! Every write is a whole-object `PUT` naming the `resourceVersion` it read (or a `POST` when
//! there was no object): the API server applies it only if nothing changed since, so the
//! read-decide-write is a compare-and-swap and two routers can never both win. The decision is
//! the pure core's ([`Lease::claim`], [`Lease::renew`], [`Lease::may_publish`],
//! [`Lease::release`]), as for the other backends.
//!
//! Fencing as the other backends keep it:
//! - **expiry by the reader's own observation** ([`Expiry::Observed`], as the file backend):
//!   the API server has no TTL, and another host's `renewTime` is never compared with this
//!   router's clock; a record of another holder lapses only after this router saw it unchanged
//!   for its whole duration on its own monotonic clock;
//! - **the epoch never goes back**: it lives in the record, which is never deleted (a release
//!   marks it released at the same epoch); the Lease this backend creates carries
//!   [`KEEP_EPOCH_FINALIZER`], so a `kubectl delete lease` leaves it in place (marked for
//!   deletion, still claimed and renewed, with a warning) until someone removes the finalizer;
//!   and a router that ever saw epoch N never claims at or below N, even on a Lease recreated
//!   from nothing;
//! - **publish only while the lease is ours** is one guarded write: the handoff goes into the
//!   same object as the record, in a `PUT` that names the version whose record was checked.
//!
//! Transport: the router's reqwest + rustls client, the API server's REST paths, serde types
//! for the Lease and `Status` ([`object`]), no Kubernetes client crate: four calls (get,
//! create, replace, and their errors) do not justify `kube` and `k8s-openapi` (about 60
//! packages). The bearer token is read from `token_file` before every call, so a projected
//! token that the kubelet rotates is used as soon as it changes.

pub mod api;
pub mod object;

use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use self::api::{Failure, KubeApi};
use self::object::{
    ANNOTATIONS_LIMIT_BYTES, HANDOFF_ANNOTATION, KEEP_EPOCH_FINALIZER, LeaseObject, LeaseSpec,
    ObjectMeta, RECORD_ANNOTATION, decode_handoff, encode_handoff, micro_time,
};
use crate::config::{KubernetesAccess, SA_NAMESPACE_FILE, kube_name_rule};
use crate::{
    Claim, Expiry, Lease, LeaseError, LeaseLoss, LeaseRecord, LeaseStore, parse_record,
    render_record,
};

/// How many times a claim re-reads and retries after losing a compare-and-swap race.
const CLAIM_ATTEMPTS: usize = 3;

/// The Kubernetes backend: one Lease object on one API server.
pub struct KubeLease {
    namespace: String,
    name: String,
    /// `.../namespaces/<ns>/leases`.
    collection: String,
    /// `.../namespaces/<ns>/leases/<name>`.
    url: String,
    /// `spec.leaseDurationSeconds`: the ttl rounded up to whole seconds (at least 1).
    ttl_s: i32,
    /// The API server's client: its address, the token file, the CA.
    api: KubeApi,
    /// The highest epoch this router read or wrote: a Lease recreated from nothing is claimed
    /// above it. Also serialises the store's operations.
    highest_epoch: Mutex<u64>,
}

impl std::fmt::Debug for KubeLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeLease")
            .field("api_server", &self.api.base())
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("token_file", &self.api.token_file())
            .field("ttl_s", &self.ttl_s)
            .finish_non_exhaustive()
    }
}

fn config_err(msg: impl Into<String>) -> LeaseError {
    LeaseError::Config(msg.into())
}

/// What a write came to.
enum Written {
    /// Applied.
    Yes,
    /// The object changed since it was read (409 on a `PUT`, 409 `AlreadyExists` on a `POST`).
    Lost,
}

impl KubeLease {
    /// A store for `access`, resolving what it leaves out from the pod's environment:
    /// `namespace` from [`SA_NAMESPACE_FILE`], `api_server` from `KUBERNETES_SERVICE_HOST` and
    /// `KUBERNETES_SERVICE_PORT`, the token and CA from the service account's mount. Lease
    /// durations are `ceil(ttl)` seconds (at least 1); every API call gets `op_timeout`. Reads
    /// the CA and the token now, so a missing one stops the router at startup.
    ///
    /// # Errors
    /// [`LeaseError::Config`] naming the key: `lease.kubernetes.name` / `.namespace` (not a
    /// Kubernetes object name, or the namespace file unreadable), `.api_server` (not
    /// `https://HOST:PORT`, or not set outside a pod), `.ca_file` (unreadable, no certificate),
    /// `.token_file` (unreadable or empty).
    pub fn from_access(
        access: &KubernetesAccess,
        ttl: Duration,
        op_timeout: Duration,
    ) -> Result<Self, LeaseError> {
        Self::resolve(access, ttl, op_timeout, |k| std::env::var(k).ok())
    }

    /// [`KubeLease::from_access`] with the environment given (`env(name)`), for tests.
    ///
    /// # Errors
    /// As [`KubeLease::from_access`].
    pub fn resolve(
        access: &KubernetesAccess,
        ttl: Duration,
        op_timeout: Duration,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, LeaseError> {
        if let Some(rule) = kube_name_rule(&access.name) {
            return Err(config_err(format!(
                "lease.kubernetes.name = {:?}: {rule}",
                access.name
            )));
        }
        let namespace = match &access.namespace {
            Some(ns) => ns.clone(),
            None => std::fs::read_to_string(SA_NAMESPACE_FILE)
                .map(|s| s.trim().to_string())
                .map_err(|e| {
                    config_err(format!(
                        "lease.kubernetes.namespace: not set, and the pod's namespace file \
                         {SA_NAMESPACE_FILE} cannot be read ({e}): set it"
                    ))
                })?,
        };
        if let Some(rule) = kube_name_rule(&namespace) {
            return Err(config_err(format!(
                "lease.kubernetes.namespace = {namespace:?}: {rule}"
            )));
        }
        let api = KubeApi::resolve(
            access.api_server.as_deref(),
            access.token_file.as_deref(),
            access.ca_file.as_deref(),
            op_timeout,
            env,
        )
        .map_err(|e| config_err(format!("lease.kubernetes.{e}")))?;
        let api_server = api.base();
        let collection =
            format!("{api_server}/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases");
        Ok(KubeLease {
            url: format!("{collection}/{}", access.name),
            collection,
            namespace,
            name: access.name.clone(),
            ttl_s: i32::try_from((ttl.as_secs_f64().ceil() as i64).max(1)).unwrap_or(i32::MAX),
            api,
            highest_epoch: Mutex::new(0),
        })
    }

    /// The Lease's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The Lease's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The API server's base URL (`https://HOST:PORT`).
    pub fn api_server(&self) -> &str {
        self.api.base()
    }

    /// `spec.leaseDurationSeconds` as written: the ttl rounded up, whole seconds.
    pub fn ttl_s(&self) -> i32 {
        self.ttl_s
    }

    fn at(&self) -> String {
        format!("lease {}/{}", self.namespace, self.name)
    }

    fn err(&self, op: &'static str, message: impl Into<String>) -> LeaseError {
        LeaseError::Kubernetes {
            op,
            lease: format!("{}/{}", self.namespace, self.name),
            api_server: self.api.base().to_string(),
            message: message.into(),
        }
    }

    /// The error for a failed call, with what to check for the answers an operator can fix.
    fn failure(&self, op: &'static str, f: Failure) -> LeaseError {
        match f {
            Failure::Transport { message, .. } => self.err(op, message),
            Failure::Server {
                status: 401,
                message,
                ..
            } => self.err(
                op,
                format!(
                    "401 {message}: the API server refused the token in {} (expired, or not a \
                     service-account token of this cluster)",
                    self.api.token_file().display()
                ),
            ),
            Failure::Server {
                status: 403,
                message,
                ..
            } => self.err(
                op,
                format!(
                    "403 {message}: the router's identity needs get and update on \
                     leases/{name} and create on leases in namespace {ns} (the chart's Role \
                     grants exactly that)",
                    name = self.name,
                    ns = self.namespace
                ),
            ),
            Failure::Server {
                status,
                reason,
                message,
            } => self.err(op, format!("{status} {reason}: {message}")),
        }
    }

    /// The Lease object, `None` when there is none.
    async fn get(&self) -> Result<Option<LeaseObject>, LeaseError> {
        match self
            .api
            .call(reqwest::Method::GET, &self.url, None::<&()>)
            .await
        {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| self.err("get", format!("the answer is not a Lease: {e}"))),
            Err(Failure::Server { status: 404, .. }) => Ok(None),
            Err(f) => Err(self.failure("get", f)),
        }
    }

    /// Writes `obj`: `PUT` guarded by its `resourceVersion`, or `POST` when `create`. A write
    /// that failed after it was sent may have been applied: [`LeaseError::Unconfirmed`].
    async fn write(&self, obj: &LeaseObject, create: bool) -> Result<Written, LeaseError> {
        let (method, url, op) = if create {
            (reqwest::Method::POST, &self.collection, "create")
        } else {
            (reqwest::Method::PUT, &self.url, "update")
        };
        match self.api.call(method, url, Some(obj)).await {
            Ok(_) => Ok(Written::Yes),
            Err(Failure::Server { status: 409, .. }) => Ok(Written::Lost),
            // The object was deleted (finalizer removed) between the read and the write.
            Err(Failure::Server { status: 404, .. }) if !create => Ok(Written::Lost),
            // Sent and not answered, or answered by a timeout (408, 504, etcd's "request timed
            // out" as 500) or a proxy in front of the API server (502, 503): it may have been
            // applied.
            Err(f @ Failure::Transport { sent: true, .. }) => {
                Err(LeaseError::Unconfirmed(Box::new(self.failure(op, f))))
            }
            Err(f @ Failure::Server { status, .. }) if status == 408 || status >= 500 => {
                Err(LeaseError::Unconfirmed(Box::new(self.failure(op, f))))
            }
            Err(f) => Err(self.failure(op, f)),
        }
    }

    /// The record annotation of `obj`, parsed strictly; `None` when the object or the
    /// annotation is absent (a Lease someone created without it).
    fn record_of(&self, obj: Option<&LeaseObject>) -> Result<Option<LeaseRecord>, LeaseError> {
        match obj.and_then(|o| o.metadata.annotations.get(RECORD_ANNOTATION)) {
            Some(text) => parse_record(
                text.as_bytes(),
                &format!("{} annotation {RECORD_ANNOTATION}", self.at()),
            )
            .map(Some),
            None => Ok(None),
        }
    }

    /// `obj` (or a new Lease) with `rec` written into it: the record annotation and the
    /// mirrored spec; `acquired` when the holder changed or the lease was claimed anew.
    fn with_record(
        &self,
        obj: Option<&LeaseObject>,
        rec: &LeaseRecord,
        acquired: bool,
    ) -> LeaseObject {
        let mut out = obj.cloned().unwrap_or_else(|| LeaseObject {
            api_version: "coordination.k8s.io/v1".into(),
            kind: "Lease".into(),
            metadata: ObjectMeta {
                name: self.name.clone(),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            ..LeaseObject::default()
        });
        // A Lease created by someone else (a manifest, GitOps) gets the finalizer on the first
        // write; one already marked for deletion cannot take a new finalizer.
        if out.metadata.deletion_timestamp.is_none()
            && !out
                .metadata
                .finalizers
                .iter()
                .any(|f| f == KEEP_EPOCH_FINALIZER)
        {
            out.metadata.finalizers.push(KEEP_EPOCH_FINALIZER.into());
        }
        let text = String::from_utf8_lossy(&render_record(rec))
            .trim_end()
            .to_string();
        out.metadata
            .annotations
            .insert(RECORD_ANNOTATION.to_string(), text);
        let spec: &mut LeaseSpec = &mut out.spec;
        if rec.released() {
            spec.holder_identity = None;
        } else {
            spec.holder_identity = Some(rec.holder.clone());
            spec.lease_duration_seconds = Some(self.ttl_s);
            spec.renew_time = micro_time(rec.updated_at);
            if acquired {
                spec.acquire_time = micro_time(rec.updated_at);
            }
        }
        spec.lease_transitions = Some(i32::try_from(rec.epoch).unwrap_or(i32::MAX));
        out
    }

    /// Notes `epoch` as seen; the highest seen so far.
    fn saw(highest: &mut u64, epoch: u64) -> u64 {
        *highest = (*highest).max(epoch);
        *highest
    }

    /// The epoch `obj` shows: its record's, else its `spec.leaseTransitions` (the mirror this
    /// backend writes), so a record annotation someone removed does not reset the epoch.
    fn epoch_of(obj: Option<&LeaseObject>, record: Option<&LeaseRecord>) -> u64 {
        let mirrored = obj
            .and_then(|o| o.spec.lease_transitions)
            .and_then(|t| u64::try_from(t).ok())
            .unwrap_or(0);
        record.map_or(0, |r| r.epoch).max(mirrored)
    }
}

/// The view a claim decides on when the Lease has no record but this router saw epoch `epoch`
/// (a Lease recreated from nothing): free, at that epoch.
fn vanished(epoch: u64) -> LeaseRecord {
    LeaseRecord {
        epoch,
        expires_at: f64::NEG_INFINITY,
        holder: String::new(),
        schema: crate::LEASE_SCHEMA.to_string(),
        schema_version: 1,
        updated_at: f64::NEG_INFINITY,
    }
}

impl LeaseStore for KubeLease {
    fn describe(&self) -> String {
        format!("kubernetes {} at {}", self.at(), self.api.base())
    }

    /// The API server keeps no TTL: a record of another holder lapses by this router's own
    /// observation, as with the file backend.
    fn expiry(&self) -> Expiry {
        Expiry::Observed
    }

    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        let mut highest = self.highest_epoch.lock().await;
        let obj = self.get().await?;
        let rec = self.record_of(obj.as_ref())?;
        Self::saw(&mut highest, Self::epoch_of(obj.as_ref(), rec.as_ref()));
        Ok(rec)
    }

    async fn claim(&self, core: &Lease, now: Instant, now_wall: f64) -> Result<Claim, LeaseError> {
        let core = core.clone().with_expiry(self.expiry());
        let mut highest = self.highest_epoch.lock().await;
        for _ in 0..CLAIM_ATTEMPTS {
            let obj = self.get().await?;
            let current = self.record_of(obj.as_ref())?;
            let stored = Self::epoch_of(obj.as_ref(), current.as_ref());
            let seen = Self::saw(&mut highest, stored);
            if let Some(when) = obj
                .as_ref()
                .and_then(|o| o.metadata.deletion_timestamp.as_ref())
            {
                tracing::warn!(
                    lease = %self.at(),
                    deleted_at = %when,
                    "the Lease is marked for deletion; its finalizer {KEEP_EPOCH_FINALIZER} keeps \
                     it (and its epoch) while a router uses it: stop both routers before removing \
                     the finalizer"
                );
            }
            let view = match &current {
                Some(r) => Some(r.clone()),
                None if seen > 0 => Some(vanished(seen)),
                None => None,
            };
            let mut rec = match core.claim(view.as_ref(), now, now_wall) {
                Claim::Write(rec) => rec,
                held @ Claim::HeldBy { .. } => return Ok(held),
            };
            let reclaim = current
                .as_ref()
                .is_some_and(|r| r.holder == rec.holder && r.epoch == rec.epoch);
            if !reclaim {
                rec.epoch = rec.epoch.max(seen + 1);
            }
            let acquired = !reclaim;
            let next = self.with_record(obj.as_ref(), &rec, acquired);
            match self.write(&next, obj.is_none()).await? {
                Written::Yes => {
                    Self::saw(&mut highest, rec.epoch);
                    return Ok(Claim::Write(rec));
                }
                Written::Lost => continue,
            }
        }
        Err(self.err(
            "update",
            format!("claim lost the compare-and-swap {CLAIM_ATTEMPTS} times in a row"),
        ))
    }

    async fn renew(
        &self,
        core: &Lease,
        now: Instant,
        now_wall: f64,
    ) -> Result<Result<LeaseRecord, LeaseLoss>, LeaseError> {
        let mut core = core.clone();
        let mut highest = self.highest_epoch.lock().await;
        // A write by someone else in between (a label, an annotation, a delete that only marks
        // the Lease) is no reason to give up a lease that is still ours: read again and retry.
        for _ in 0..CLAIM_ATTEMPTS {
            let obj = self.get().await?;
            let current = self.record_of(obj.as_ref())?;
            Self::saw(&mut highest, Self::epoch_of(obj.as_ref(), current.as_ref()));
            let rec = match core.renew(current.as_ref(), now, now_wall) {
                Ok(rec) => rec,
                Err(loss) => return Ok(Err(loss)),
            };
            let Some(obj) = obj else {
                // `renew` only succeeds on our own record, so the object exists.
                return Err(self.err("update", "the Lease vanished during the renewal"));
            };
            match self
                .write(&self.with_record(Some(&obj), &rec, false), false)
                .await?
            {
                Written::Yes => return Ok(Ok(rec)),
                Written::Lost => {}
            }
        }
        Err(self.err(
            "update",
            format!("renewal lost the compare-and-swap {CLAIM_ATTEMPTS} times in a row"),
        ))
    }

    async fn publish(
        &self,
        core: &Lease,
        now: Instant,
        doc: Vec<u8>,
    ) -> Result<Result<(), LeaseLoss>, LeaseError> {
        let mut highest = self.highest_epoch.lock().await;
        let doc = String::from_utf8(doc)
            .map_err(|e| self.err("update", format!("the handoff document is not UTF-8: {e}")))?;
        // As for a renewal: another writer's change in between is read again, not a loss.
        for _ in 0..CLAIM_ATTEMPTS {
            let obj = self.get().await?;
            let current = self.record_of(obj.as_ref())?;
            Self::saw(&mut highest, Self::epoch_of(obj.as_ref(), current.as_ref()));
            if let Err(loss) = core.may_publish(current.as_ref(), now) {
                return Ok(Err(loss));
            }
            let Some(mut next) = obj else {
                return Err(self.err("update", "the Lease vanished before the publish"));
            };
            next.metadata.annotations.remove(HANDOFF_ANNOTATION);
            let others: usize = next
                .metadata
                .annotations
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
                + HANDOFF_ANNOTATION.len();
            let value = encode_handoff(&doc, ANNOTATIONS_LIMIT_BYTES.saturating_sub(others));
            let total = others + value.len();
            if total > ANNOTATIONS_LIMIT_BYTES {
                // Refused before the call: the API server would answer 422 Invalid.
                return Err(self.err(
                    "update",
                    format!(
                        "the handoff document ({} bytes, {} gzipped in base64) does not fit \
                         the Lease: its annotations would be {total} bytes, over Kubernetes' \
                         {ANNOTATIONS_LIMIT_BYTES}-byte limit",
                        doc.len(),
                        value.len()
                    ),
                ));
            }
            next.metadata
                .annotations
                .insert(HANDOFF_ANNOTATION.to_string(), value);
            match self.write(&next, false).await? {
                Written::Yes => return Ok(Ok(())),
                Written::Lost => {}
            }
        }
        Err(self.err(
            "update",
            format!("publish lost the compare-and-swap {CLAIM_ATTEMPTS} times in a row"),
        ))
    }

    async fn read_all(&self) -> Result<(Option<LeaseRecord>, Option<Vec<u8>>), LeaseError> {
        let mut highest = self.highest_epoch.lock().await;
        let obj = self.get().await?;
        let record = self.record_of(obj.as_ref())?;
        // A standby polls here: what it saw floors the epoch of a claim on a recreated Lease.
        Self::saw(&mut highest, Self::epoch_of(obj.as_ref(), record.as_ref()));
        let doc = match obj.and_then(|mut o| o.metadata.annotations.remove(HANDOFF_ANNOTATION)) {
            Some(value) => {
                Some(
                    decode_handoff(&value).map_err(|reason| LeaseError::Malformed {
                        at: format!("{} annotation {HANDOFF_ANNOTATION}", self.at()),
                        reason,
                    })?,
                )
            }
            None => None,
        };
        Ok((record, doc))
    }

    async fn release(&self, core: &Lease, now_wall: f64) -> Result<bool, LeaseError> {
        let mut core = core.clone();
        let _serial = self.highest_epoch.lock().await;
        let obj = self.get().await?;
        let current = self.record_of(obj.as_ref())?;
        let Some(rec) = core.release(current.as_ref(), now_wall) else {
            return Ok(false);
        };
        match self
            .write(&self.with_record(obj.as_ref(), &rec, false), false)
            .await?
        {
            Written::Yes => Ok(true),
            // Someone else wrote first: it is no longer ours to release.
            Written::Lost => Ok(false),
        }
    }
}
