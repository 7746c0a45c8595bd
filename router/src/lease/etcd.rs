//! etcd lease backend (`lease.backend = "etcd"`; DESIGN.md section 7), for routers on
//! different hosts.
//!
//! Two keys:
//! - `<key>`: the `narwhal.router-lease` record (the same JSON as the file backend), attached
//!   to an etcd v3 lease of TTL `ceil(ttl_s)` (at least 1 s) so it vanishes when the holder
//!   stops keeping it alive;
//! - `<key>/epoch`: the last epoch granted, decimal, with no etcd lease, so the epoch still
//!   advances after `<key>` vanished.
//!
//! Every write is one transaction that compares the `mod_revision` of both keys (or their
//! absence, `version == 0`) with what was read, so two routers can never both win. A record
//! counts as expired when its key vanished *or* its wall-clock `expires_at` has passed,
//! whichever comes first (the pure core decides on the latter).
//!
//! Renew = one keep-alive on the etcd lease, then a compare-and-swap rewrite of the record
//! with a fresh `expires_at` after checking it still holds our holder and epoch. Release =
//! revoke the etcd lease (the record key goes with it; the epoch key stays).

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, KeyValue, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, TxnOpResponse,
};
use tokio::sync::Mutex;

use super::{
    Claim, Lease, LeaseError, LeaseLoss, LeaseRecord, LeaseStore, parse_record, render_record,
};

/// How many times a claim re-reads and retries after losing a compare-and-swap race.
const CLAIM_ATTEMPTS: usize = 3;

/// The etcd backend: endpoints (`http://host:port`), the record key, the lease TTL and a
/// per-call timeout. Connects lazily; the gRPC channel reconnects by itself.
pub struct EtcdLease {
    endpoints: Vec<String>,
    key: String,
    epoch_key: String,
    ttl_s: i64,
    op_timeout: Duration,
    state: Mutex<State>,
}

impl std::fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLease")
            .field("endpoints", &self.endpoints)
            .field("key", &self.key)
            .field("ttl_s", &self.ttl_s)
            .field("op_timeout", &self.op_timeout)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    client: Option<Client>,
    held: Option<Held>,
}

/// The etcd lease this router attached its record to.
struct Held {
    id: i64,
    keep_alive: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
}

/// What one consistent read of both keys saw.
struct Snapshot {
    record: Option<(LeaseRecord, i64)>,
    epoch: Option<(u64, i64)>,
}

impl EtcdLease {
    /// A store on `endpoints` under `key`, granting etcd leases of `ceil(ttl)` seconds (at
    /// least 1) and giving every etcd call `op_timeout`.
    ///
    /// # Errors
    /// [`LeaseError::Config`] for no endpoints or an empty key.
    pub fn new(
        endpoints: Vec<String>,
        key: impl Into<String>,
        ttl: Duration,
        op_timeout: Duration,
    ) -> Result<Self, LeaseError> {
        let key = key.into();
        if endpoints.is_empty() {
            return Err(LeaseError::Config(
                "lease.endpoints: must not be empty".into(),
            ));
        }
        if key.is_empty() {
            return Err(LeaseError::Config("lease.key: must not be empty".into()));
        }
        let ttl_s = (ttl.as_secs_f64().ceil() as i64).max(1);
        Ok(EtcdLease {
            epoch_key: format!("{key}/epoch"),
            endpoints,
            key,
            ttl_s,
            op_timeout,
            state: Mutex::new(State::default()),
        })
    }

    /// The record key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The epoch key (`<key>/epoch`).
    pub fn epoch_key(&self) -> &str {
        &self.epoch_key
    }

    /// The etcd lease TTL granted, whole seconds.
    pub fn ttl_s(&self) -> i64 {
        self.ttl_s
    }

    fn err(&self, op: &'static str, message: impl ToString) -> LeaseError {
        LeaseError::Etcd {
            op,
            endpoints: self.endpoints.join(","),
            message: message.to_string(),
        }
    }

    /// Runs one etcd call with the per-call timeout.
    async fn call<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, LeaseError> {
        match tokio::time::timeout(self.op_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.err(op, e)),
            Err(_) => Err(self.err(
                op,
                format!("timed out after {} s", self.op_timeout.as_secs_f64()),
            )),
        }
    }

    async fn client(&self, st: &mut State) -> Result<Client, LeaseError> {
        if let Some(c) = &st.client {
            return Ok(c.clone());
        }
        let opts = ConnectOptions::new()
            .with_connect_timeout(self.op_timeout)
            .with_timeout(self.op_timeout);
        let c = self
            .call("connect", Client::connect(&self.endpoints, Some(opts)))
            .await?;
        st.client = Some(c.clone());
        Ok(c)
    }

    fn parse_kv(&self, kv: &KeyValue) -> Result<(LeaseRecord, i64), LeaseError> {
        Ok((parse_record(kv.value(), &self.key)?, kv.mod_revision()))
    }

    /// Reads both keys in one transaction (one revision).
    async fn snapshot(&self, client: &mut Client) -> Result<Snapshot, LeaseError> {
        let txn = Txn::new().and_then(vec![
            TxnOp::get(self.key.as_str(), None),
            TxnOp::get(self.epoch_key.as_str(), None),
        ]);
        let resp = self.call("txn", client.txn(txn)).await?;
        let mut record = None;
        let mut epoch = None;
        for (i, r) in resp.op_responses().into_iter().enumerate() {
            let TxnOpResponse::Get(g) = r else { continue };
            let Some(kv) = g.kvs().first() else { continue };
            if i == 0 {
                record = Some(self.parse_kv(kv)?);
            } else {
                let text = std::str::from_utf8(kv.value()).unwrap_or("");
                let e = text
                    .trim()
                    .parse::<u64>()
                    .map_err(|_| LeaseError::Malformed {
                        at: self.epoch_key.clone(),
                        reason: format!("epoch: {text:?} is not a non-negative integer"),
                    })?;
                epoch = Some((e, kv.mod_revision()));
            }
        }
        Ok(Snapshot { record, epoch })
    }

    async fn get_record(
        &self,
        client: &mut Client,
    ) -> Result<Option<(LeaseRecord, i64)>, LeaseError> {
        let resp = self
            .call("get", client.get(self.key.as_str(), None))
            .await?;
        resp.kvs().first().map(|kv| self.parse_kv(kv)).transpose()
    }

    /// `mod_revision == rev` when the key was seen, else "absent" (`version == 0`).
    fn unchanged(key: &str, seen: Option<i64>) -> Compare {
        match seen {
            Some(rev) => Compare::mod_revision(key, CompareOp::Equal, rev),
            None => Compare::version(key, CompareOp::Equal, 0),
        }
    }

    async fn revoke(&self, client: &mut Client, id: i64) -> Result<(), LeaseError> {
        match self.call("revoke", client.lease_revoke(id)).await {
            Ok(_) => Ok(()),
            // Already expired: nothing to revoke.
            Err(LeaseError::Etcd { message, .. }) if message.contains("not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// One keep-alive round trip; `Ok(false)` when etcd says the lease is gone (TTL ≤ 0).
    async fn keep_alive(&self, client: &mut Client, held: &mut Held) -> Result<bool, LeaseError> {
        if held.keep_alive.is_none() {
            match self
                .call("keep-alive", client.lease_keep_alive(held.id))
                .await
            {
                Ok(pair) => held.keep_alive = Some(pair),
                // etcd already expired (or someone revoked) the lease.
                Err(LeaseError::Etcd { message, .. }) if message.contains("lease not found") => {
                    return Ok(false);
                }
                Err(e) => return Err(e),
            }
        }
        let Some((keeper, stream)) = held.keep_alive.as_mut() else {
            return Err(self.err("keep-alive", "no stream"));
        };
        let sent = self.call("keep-alive", keeper.keep_alive()).await;
        let answer = match sent {
            Ok(()) => self.call("keep-alive", stream.message()).await,
            Err(e) => Err(e),
        };
        match answer {
            Ok(Some(resp)) => Ok(resp.ttl() > 0),
            Ok(None) => {
                held.keep_alive = None;
                Err(self.err("keep-alive", "stream closed by the server"))
            }
            Err(LeaseError::Etcd { message, .. }) if message.contains("lease not found") => {
                held.keep_alive = None;
                Ok(false)
            }
            Err(e) => {
                held.keep_alive = None;
                Err(e)
            }
        }
    }
}

/// The view the pure core decides on when `<key>` has vanished but `<key>/epoch` remembers
/// epoch `e`: an expired record at `e`, so a claim takes `e + 1`.
fn vanished(epoch: u64) -> LeaseRecord {
    LeaseRecord {
        epoch,
        expires_at: f64::NEG_INFINITY,
        holder: String::new(),
        schema: super::LEASE_SCHEMA.to_string(),
        schema_version: 1,
        updated_at: f64::NEG_INFINITY,
    }
}

impl LeaseStore for EtcdLease {
    fn describe(&self) -> String {
        format!("etcd {} at {}", self.key, self.endpoints.join(","))
    }

    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        let mut st = self.state.lock().await;
        let mut client = self.client(&mut st).await?;
        Ok(self.get_record(&mut client).await?.map(|(r, _)| r))
    }

    async fn claim(&self, core: &Lease, now_wall: f64) -> Result<Claim, LeaseError> {
        let mut st = self.state.lock().await;
        let mut client = self.client(&mut st).await?;
        let mut fresh: Option<i64> = None;
        for _ in 0..CLAIM_ATTEMPTS {
            let snap = self.snapshot(&mut client).await?;
            let stored_epoch = snap.epoch.map_or(0, |(e, _)| e);
            let view = match &snap.record {
                Some((r, _)) => Some(r.clone()),
                None if stored_epoch > 0 => Some(vanished(stored_epoch)),
                None => None,
            };
            let mut rec = match core.claim(view.as_ref(), now_wall) {
                Claim::Write(rec) => rec,
                held @ Claim::HeldBy { .. } => {
                    if let Some(id) = fresh {
                        let _ = self.revoke(&mut client, id).await;
                    }
                    return Ok(held);
                }
            };
            let reclaim = snap
                .record
                .as_ref()
                .is_some_and(|(r, _)| r.holder == rec.holder && r.epoch == rec.epoch);
            if !reclaim {
                rec.epoch = rec.epoch.max(stored_epoch + 1);
            }
            let id = match fresh {
                Some(id) => id,
                None => {
                    let g = self
                        .call("grant", client.lease_grant(self.ttl_s, None))
                        .await?;
                    fresh = Some(g.id());
                    g.id()
                }
            };
            let txn = Txn::new()
                .when(vec![
                    Self::unchanged(&self.key, snap.record.as_ref().map(|(_, rev)| *rev)),
                    Self::unchanged(&self.epoch_key, snap.epoch.map(|(_, rev)| rev)),
                ])
                .and_then(vec![
                    TxnOp::put(
                        self.key.as_str(),
                        render_record(&rec),
                        Some(PutOptions::new().with_lease(id)),
                    ),
                    TxnOp::put(self.epoch_key.as_str(), rec.epoch.to_string(), None),
                ]);
            let resp = self.call("txn", client.txn(txn)).await?;
            if resp.succeeded() {
                let old = st.held.replace(Held {
                    id,
                    keep_alive: None,
                });
                if let Some(old) = old.filter(|o| o.id != id) {
                    // The record now hangs on the new lease; the old one only holds nothing.
                    let _ = self.revoke(&mut client, old.id).await;
                }
                return Ok(Claim::Write(rec));
            }
        }
        if let Some(id) = fresh {
            let _ = self.revoke(&mut client, id).await;
        }
        Err(self.err(
            "txn",
            format!("claim lost the compare-and-swap {CLAIM_ATTEMPTS} times in a row"),
        ))
    }

    async fn renew(
        &self,
        core: &Lease,
        now_wall: f64,
    ) -> Result<Result<LeaseRecord, LeaseLoss>, LeaseError> {
        let mut core = core.clone();
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        let mut client = self.client(st).await?;
        let Some(held) = st.held.as_mut() else {
            // Never attached a record to an etcd lease: nothing of ours can be there.
            return Ok(core.renew(None, now_wall));
        };
        let alive = self.keep_alive(&mut client, held).await?;
        let current = if alive {
            self.get_record(&mut client).await?
        } else {
            None
        };
        let rec = match core.renew(current.as_ref().map(|(r, _)| r), now_wall) {
            Ok(rec) => rec,
            Err(loss) => return Ok(Err(loss)),
        };
        let id = held.id;
        let rev = current.as_ref().map(|(_, rev)| *rev);
        let txn = Txn::new()
            .when(vec![Self::unchanged(&self.key, rev)])
            .and_then(vec![TxnOp::put(
                self.key.as_str(),
                render_record(&rec),
                Some(PutOptions::new().with_lease(id)),
            )]);
        let resp = self.call("txn", client.txn(txn)).await?;
        if resp.succeeded() {
            return Ok(Ok(rec));
        }
        // Someone wrote the key between our read and our write: decide on what is there now.
        let now = self.get_record(&mut client).await?;
        match core.renew(now.as_ref().map(|(r, _)| r), now_wall) {
            Err(loss) => Ok(Err(loss)),
            Ok(_) => Err(self.err("txn", "renewal lost the compare-and-swap")),
        }
    }

    async fn release(&self, core: &Lease, now_wall: f64) -> Result<bool, LeaseError> {
        let mut core = core.clone();
        let mut st = self.state.lock().await;
        let mut client = self.client(&mut st).await?;
        let current = self.get_record(&mut client).await?;
        let ours = core
            .release(current.as_ref().map(|(r, _)| r), now_wall)
            .is_some();
        if let Some(held) = st.held.take() {
            // Revoking deletes only keys attached to *our* etcd lease: a successor's record
            // hangs on its own lease and survives.
            self.revoke(&mut client, held.id).await?;
        }
        Ok(ours)
    }
}
