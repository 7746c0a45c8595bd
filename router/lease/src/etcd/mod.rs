//! etcd lease backend (`lease.backend = "etcd"`; architecture.md section 7), for routers on
//! different hosts.
//!
//! Two keys:
//! - `<key>`: the `narwhal.router-lease` record (the same JSON as the file backend), attached
//!   to an etcd v3 lease of TTL `ceil(ttl_s)` (at least 1 s) so it vanishes when the holder
//!   stops keeping it alive;
//! - `<key>/epoch`: the last epoch granted, decimal, with no etcd lease, so the epoch still
//!   advances after `<key>` vanished;
//! - `<key>/handoff`: the holder's published handoff document, with no etcd lease (it must
//!   outlive its writer), written only by a transaction guarded by the record's
//!   `mod_revision` after the record was checked to be the writer's (ha-and-fencing.md).
//!
//! Every write is one transaction that compares the `mod_revision` of both keys (or their
//! absence, `version == 0`) with what was read, so two routers can never both win. A record
//! of another holder counts as live as long as its key is present (unless released): etcd
//! deletes it when the holder's etcd lease expires, on the etcd server's clock
//! ([`Expiry::Store`]); its `expires_at` is never compared with a router's wall clock, so no
//! router's clock skew can hand the lease over (ha-and-fencing.md 2.4). This was already the
//! backend's main rule; the wall-clock `expires_at` check that could cut it short is gone.
//!
//! Renew = one keep-alive on the etcd lease, then a compare-and-swap rewrite of the record
//! with a fresh `expires_at` after checking it still holds our holder and epoch. Release =
//! revoke the etcd lease (the record key goes with it; the epoch key stays).
//!
//! # Transport: etcd's JSON gateway
//!
//! The calls go to etcd's own gRPC-JSON gateway, served by every etcd ≥ 3.4 on its client port
//! (`POST /v3/kv/range`, `/v3/kv/txn`, `/v3/lease/grant`, `/v3/lease/keepalive`,
//! `/v3/lease/revoke`, `/v3/auth/authenticate`; etcd's `api_grpc_gateway` guide), over the
//! reqwest + rustls client the router already uses, rather than gRPC through `etcd-client`:
//!
//! - **build**: no protobuf code generation, so no `protoc` on the build machine (a fresh
//!   machine builds with cargo alone), and tonic, prost and their build scripts leave the
//!   dependency tree;
//! - **fencing fidelity**: the gateway is a translation layer inside the etcd process, in front
//!   of the same KV, Lease and Auth services; the compare-and-swap transactions, lease TTLs and
//!   revision guards are evaluated by the same server code as for a gRPC client;
//! - **TLS**: the project's rustls and ring, with only `lease.tls.ca` trusted (no system roots)
//!   and an optional client certificate for etcd's `--client-cert-auth`;
//! - **auth**: user and password (`/v3/auth/authenticate`; the token goes in the
//!   `Authorization` header, which the gateway passes on as gRPC metadata). etcd's gateway
//!   does **not** map a client certificate's Common Name to an etcd user (etcd's gateway guide
//!   says so): a client certificate authenticates the connection (`--client-cert-auth`), and an
//!   etcd with RBAC enabled needs `lease.auth`.
//!
//! Every JSON field is proto3's canonical JSON: `int64` values travel as decimal strings, bytes
//! as base64, and fields at their default value (0, false, empty) are omitted.

use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::Mutex;

use super::{
    Claim, Expiry, Lease, LeaseError, LeaseLoss, LeaseRecord, LeaseStore, parse_record,
    render_record,
};
use crate::config::{EtcdAccess, EtcdAuth, EtcdTls};

mod connect;
mod gateway;
#[cfg(test)]
mod tests;

use connect::*;
use gateway::*;

/// How many times a claim re-reads and retries after losing a compare-and-swap race.
const CLAIM_ATTEMPTS: usize = 3;

/// gRPC status `UNAVAILABLE` (no leader, member stopping): try the next endpoint.
const GRPC_UNAVAILABLE: i64 = 14;
/// gRPC status `UNAUTHENTICATED` (expired or unknown token).
const GRPC_UNAUTHENTICATED: i64 = 16;

/// The etcd backend: endpoints (`http://host:port` or `https://host:port`), the record key,
/// the lease TTL, a per-call timeout, and optionally TLS and an etcd user
/// ([`EtcdAccess`]). Stateless HTTP: each call tries the endpoints in order, starting with the
/// last one that answered.
pub struct EtcdLease {
    /// Base URLs, `scheme://host:port` without a trailing slash.
    endpoints: Vec<String>,
    key: String,
    epoch_key: String,
    handoff_key: String,
    ttl_s: i64,
    op_timeout: Duration,
    /// The bound of one `/v3/auth/authenticate` call: `max(op_timeout, ttl)`.
    auth_timeout: Duration,
    http: reqwest::Client,
    tls: Option<EtcdTls>,
    auth: Option<EtcdAuth>,
    state: Mutex<State>,
}

impl std::fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLease")
            .field("endpoints", &self.endpoints)
            .field("key", &self.key)
            .field("ttl_s", &self.ttl_s)
            .field("op_timeout", &self.op_timeout)
            .field("auth_timeout", &self.auth_timeout)
            .field("tls", &self.tls)
            .field("user", &self.auth.as_ref().map(|a| &a.user))
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    /// The etcd lease id this router attached its record to.
    held: Option<i64>,
    /// The auth token from `/v3/auth/authenticate` (only with `lease.auth`).
    token: Option<String>,
    /// etcd answered "authentication is not enabled": send no token.
    auth_off: bool,
    /// Index of the endpoint that answered last.
    preferred: usize,
}

/// What one consistent read of both keys saw.
struct Snapshot {
    record: Option<(LeaseRecord, i64)>,
    epoch: Option<(u64, i64)>,
}

/// One call's failure before it is turned into a [`LeaseError`].
enum Failure {
    /// No endpoint answered (connection, TLS, timeout); one line per endpoint tried.
    Transport(String),
    /// etcd answered with an error: gRPC status code and etcd's message.
    Server { code: i64, message: String },
}

fn config_err(msg: impl Into<String>) -> LeaseError {
    LeaseError::Config(msg.into())
}

impl EtcdLease {
    /// A store on plain-HTTP `endpoints` under `key`, granting etcd leases of `ceil(ttl)`
    /// seconds (at least 1) and giving every etcd call `op_timeout`: [`EtcdLease::with_access`]
    /// with no TLS and no etcd user.
    ///
    /// # Errors
    /// As [`EtcdLease::with_access`].
    pub fn new(
        endpoints: Vec<String>,
        key: impl Into<String>,
        ttl: Duration,
        op_timeout: Duration,
    ) -> Result<Self, LeaseError> {
        Self::with_access(endpoints, key, ttl, op_timeout, &EtcdAccess::default())
    }

    /// A store on `endpoints` under `key`, reaching etcd with `access`: TLS (`lease.tls`:
    /// trusted CA, optional client certificate) and an etcd user (`lease.auth`). Leases are
    /// granted for `ceil(ttl)` seconds (at least 1); every etcd call gets `op_timeout`, except
    /// the password check (`/v3/auth/authenticate`), which gets `max(op_timeout, ttl)`: etcd
    /// checks a password with bcrypt, which on a loaded etcd host outlasts a renew interval,
    /// and a check cut short is never answered however often it is retried. Nothing waits
    /// longer for it than it may: a renewal is bounded by the lease's local validity in the
    /// driver, so a slow password check costs the lease, never its safety. Reads
    /// every file now, so a missing or unreadable one stops the router at startup; the
    /// password file is read again at each (re-)authentication.
    ///
    /// # Errors
    /// [`LeaseError::Config`] naming the key: `lease.endpoints` (empty), `lease.endpoints[i]`
    /// (not `http://HOST:PORT`, `https://HOST:PORT` or `HOST:PORT`, or a scheme that does not
    /// match `lease.tls`), `lease.key` (empty), `lease.tls.ca` / `lease.tls.cert` /
    /// `lease.tls.key` (unreadable, no PEM item, key not matching the certificate),
    /// `lease.auth.user` (empty), `lease.auth.password_file` (unreadable or empty).
    pub fn with_access(
        endpoints: Vec<String>,
        key: impl Into<String>,
        ttl: Duration,
        op_timeout: Duration,
        access: &EtcdAccess,
    ) -> Result<Self, LeaseError> {
        let key = key.into();
        if endpoints.is_empty() {
            return Err(config_err("lease.endpoints: must not be empty"));
        }
        if key.is_empty() {
            return Err(config_err("lease.key: must not be empty"));
        }
        let ttl_s = (ttl.as_secs_f64().ceil() as i64).max(1);
        let (endpoints, http) = prepare(&endpoints, access, op_timeout)?;
        Ok(EtcdLease {
            epoch_key: format!("{key}/epoch"),
            handoff_key: format!("{key}/handoff"),
            endpoints,
            key,
            ttl_s,
            op_timeout,
            auth_timeout: op_timeout.max(ttl),
            http,
            tls: access.tls.clone(),
            auth: access.auth.clone(),
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

    /// The published handoff's key (`<key>/handoff`).
    pub fn handoff_key(&self) -> &str {
        &self.handoff_key
    }

    /// The etcd lease TTL granted, whole seconds.
    pub fn ttl_s(&self) -> i64 {
        self.ttl_s
    }

    /// The base URLs called, in order (`scheme://host:port`).
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    fn err(&self, op: &'static str, message: impl ToString) -> LeaseError {
        LeaseError::Etcd {
            op,
            endpoints: self.endpoints.join(","),
            message: message.to_string(),
        }
    }

    /// One gateway call `POST <endpoint><path>` with `body`, bounded by the per-call timeout:
    /// authenticates first when `lease.auth` is set and no token is held, and once more when
    /// etcd refuses the token (expired, or the auth store changed, e.g. a new password).
    async fn rpc(
        &self,
        st: &mut State,
        op: &'static str,
        path: &str,
        body: &(impl Serialize + Sync),
    ) -> Result<Value, LeaseError> {
        let work = async {
            let mut fresh_token = false;
            loop {
                if self.auth.is_some() && st.token.is_none() && !st.auth_off {
                    self.authenticate(st).await?;
                    fresh_token = true;
                }
                let token = st.token.clone();
                match self.post(st, path, body, token.as_deref()).await {
                    Ok(v) => return Ok(v),
                    Err(Failure::Server { code, message })
                        if self.auth.is_some() && token_refused(code, &message) =>
                    {
                        st.token = None;
                        st.auth_off = false;
                        if fresh_token {
                            return Err(self.err(op, message));
                        }
                    }
                    Err(Failure::Server { message, .. })
                        if self.auth.is_none() && auth_required(&message) =>
                    {
                        return Err(self.err(
                            op,
                            format!(
                                "{message}: etcd has authentication enabled; set lease.auth \
                                 (user and password_file)"
                            ),
                        ));
                    }
                    Err(Failure::Server { message, .. } | Failure::Transport(message)) => {
                        return Err(self.err(op, message));
                    }
                }
            }
        };
        // A backstop over the per-request bounds: with `lease.auth`, a refused token costs a
        // call, a password check and the call again.
        let bound = if self.auth.is_some() {
            self.op_timeout * 2 + self.auth_timeout
        } else {
            self.op_timeout
        };
        match tokio::time::timeout(bound, work).await {
            Ok(r) => r,
            Err(_) => Err(self.err(op, format!("timed out after {} s", bound.as_secs_f64()))),
        }
    }

    /// `POST /v3/auth/authenticate` with `lease.auth`; keeps the token in `st`.
    async fn authenticate(&self, st: &mut State) -> Result<(), LeaseError> {
        let Some(auth) = &self.auth else {
            return Ok(());
        };
        let password = read_password(&auth.password_file)?;
        let body = AuthenticateRequest {
            name: &auth.user,
            password: &password,
        };
        match self
            .post_within(
                st,
                "/v3/auth/authenticate",
                &body,
                None,
                Some(self.auth_timeout),
            )
            .await
        {
            Ok(v) => match v.get("token").and_then(Value::as_str) {
                Some(t) if !t.is_empty() => {
                    st.token = Some(t.to_string());
                    Ok(())
                }
                _ => Err(self.err("authenticate", format!("no token in etcd's answer {v}"))),
            },
            Err(Failure::Server { message, .. }) if message.contains("not enabled") => {
                // etcd without RBAC: nothing to present. Said once, then calls go tokenless.
                tracing::warn!(
                    user = %auth.user,
                    "lease.auth is set but etcd has authentication disabled; calling without a token"
                );
                st.auth_off = true;
                Ok(())
            }
            Err(Failure::Server { message, .. }) if message.contains("authentication failed") => {
                Err(self.err(
                    "authenticate",
                    format!(
                        "etcd refused user {:?}: {message} (check lease.auth.user and the \
                         password in lease.auth.password_file {})",
                        auth.user,
                        auth.password_file.display()
                    ),
                ))
            }
            Err(Failure::Server { message, .. }) => Err(self.err(
                "authenticate",
                format!("authenticating user {:?}: {message}", auth.user),
            )),
            Err(Failure::Transport(message)) => Err(self.err("authenticate", message)),
        }
    }

    /// Tries each endpoint once, from the last one that answered. Transport failures and
    /// `UNAVAILABLE` move on to the next endpoint; any other etcd error is final.
    async fn post(
        &self,
        st: &mut State,
        path: &str,
        body: &(impl Serialize + Sync),
        token: Option<&str>,
    ) -> Result<Value, Failure> {
        self.post_within(st, path, body, token, None).await
    }

    /// [`Self::post`], with each endpoint's request bounded by its share of `bound` instead of
    /// the client's per-call share of `op_timeout` when `bound` is given.
    async fn post_within(
        &self,
        st: &mut State,
        path: &str,
        body: &(impl Serialize + Sync),
        token: Option<&str>,
        bound: Option<Duration>,
    ) -> Result<Value, Failure> {
        let n = self.endpoints.len();
        let mut failures = Vec::new();
        let mut last_server = None;
        for i in 0..n {
            let idx = (st.preferred + i) % n;
            let base = &self.endpoints[idx];
            let mut req = self.http.post(format!("{base}{path}")).json(body);
            if let Some(b) = bound {
                req = req.timeout(b / u32::try_from(n).unwrap_or(1).max(1));
            }
            if let Some(t) = token {
                req = req.header(http::header::AUTHORIZATION, t);
            }
            let answer = match req.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    resp.bytes().await.map(|b| (status, b))
                }
                Err(e) => Err(e),
            };
            let (status, bytes) = match answer {
                Ok(a) => a,
                Err(e) => {
                    failures.push((base.clone(), self.describe_transport(&e)));
                    continue;
                }
            };
            match parse_answer(status, &bytes) {
                Ok(v) => {
                    st.preferred = idx;
                    return Ok(v);
                }
                Err((code, message)) if code == GRPC_UNAVAILABLE => {
                    failures.push((base.clone(), message.clone()));
                    last_server = Some(Failure::Server { code, message });
                }
                Err((code, message)) => {
                    return Err(Failure::Server {
                        code,
                        message: explain(message),
                    });
                }
            }
        }
        if failures.len() == 1
            && let Some(server) = last_server
        {
            return Err(server);
        }
        Err(Failure::Transport(if n == 1 {
            failures.pop().map(|(_, m)| m).unwrap_or_default()
        } else {
            failures
                .iter()
                .map(|(base, m)| format!("{base}: {m}"))
                .collect::<Vec<_>>()
                .join("; ")
        }))
    }

    /// A transport error with its causes, and what to check when TLS refused the connection.
    fn describe_transport(&self, e: &reqwest::Error) -> String {
        let mut parts: Vec<String> = Vec::new();
        let mut tls_problem: Option<String> = None;
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = cur {
            let text = err.to_string();
            if !parts.iter().any(|p| p.contains(&text)) {
                parts.push(text);
            }
            if let Some(r) = find_rustls(err) {
                tls_problem = Some(self.tls_hint(r));
            }
            cur = err.source();
        }
        if e.is_timeout() {
            parts.push("timed out".into());
        }
        let chain = parts.join(": ");
        match tls_problem {
            Some(hint) => format!("TLS handshake failed: {hint} ({chain})"),
            None => chain,
        }
    }

    fn tls_hint(&self, e: &rustls::Error) -> String {
        use rustls::AlertDescription as A;
        let roots = match self.tls.as_ref().and_then(|t| t.ca.as_ref()) {
            Some(ca) => format!("lease.tls.ca ({})", ca.display()),
            None => "the system's trust store (lease.tls.ca is not set)".to_string(),
        };
        match e {
            rustls::Error::InvalidCertificate(_) => format!(
                "etcd's certificate is not trusted: it must chain to {roots} and name the \
                 endpoint's host"
            ),
            rustls::Error::AlertReceived(
                A::BadCertificate
                | A::CertificateRequired
                | A::UnknownCA
                | A::CertificateUnknown
                | A::AccessDenied
                | A::HandshakeFailure,
            ) => match self.tls.as_ref().and_then(|t| t.cert.as_ref()) {
                Some(cert) => format!(
                    "etcd refused our client certificate lease.tls.cert ({}): it must chain to \
                     etcd's --trusted-ca-file",
                    cert.display()
                ),
                None => "etcd requires a client certificate: set lease.tls.cert and \
                         lease.tls.key"
                    .into(),
            },
            _ => format!("is the endpoint serving TLS with a certificate from {roots}?"),
        }
    }

    /// Reads the record's key and `other` in one transaction (one revision): each key's value
    /// and `mod_revision`, `None` when absent.
    async fn read_with(
        &self,
        st: &mut State,
        other: &str,
    ) -> Result<[Option<(Vec<u8>, i64)>; 2], LeaseError> {
        let body = TxnRequest {
            compare: Vec::new(),
            success: vec![
                RequestOp::RequestRange(RangeRequest::of(&self.key)),
                RequestOp::RequestRange(RangeRequest::of(other)),
            ],
        };
        let resp = self.rpc(st, "txn", "/v3/kv/txn", &body).await?;
        let mut out = [None, None];
        let responses = resp.get("responses").and_then(Value::as_array);
        for (slot, r) in out.iter_mut().zip(responses.into_iter().flatten()) {
            if let Some(kv) = first_kv(r.get("response_range")) {
                *slot = Some((self.kv_value(kv)?, int(kv.get("mod_revision"))));
            }
        }
        Ok(out)
    }

    /// Reads the record and the epoch key in one transaction (one revision).
    async fn snapshot(&self, st: &mut State) -> Result<Snapshot, LeaseError> {
        let [record, epoch] = self.read_with(st, &self.epoch_key).await?;
        let record = match record {
            Some((value, rev)) => Some((parse_record(&value, &self.key)?, rev)),
            None => None,
        };
        let epoch = match epoch {
            Some((value, rev)) => {
                let text = String::from_utf8_lossy(&value);
                let e = text
                    .trim()
                    .parse::<u64>()
                    .map_err(|_| LeaseError::Malformed {
                        at: self.epoch_key.clone(),
                        reason: format!("epoch: {text:?} is not a non-negative integer"),
                    })?;
                Some((e, rev))
            }
            None => None,
        };
        Ok(Snapshot { record, epoch })
    }

    fn kv_value(&self, kv: &Value) -> Result<Vec<u8>, LeaseError> {
        let text = kv.get("value").and_then(Value::as_str).unwrap_or("");
        B64.decode(text)
            .map_err(|e| self.err("range", format!("value is not base64: {e}")))
    }

    async fn get_record(&self, st: &mut State) -> Result<Option<(LeaseRecord, i64)>, LeaseError> {
        let body = RangeRequest::of(&self.key);
        let resp = self.rpc(st, "get", "/v3/kv/range", &body).await?;
        match first_kv(Some(&resp)) {
            None => Ok(None),
            Some(kv) => Ok(Some((
                parse_record(&self.kv_value(kv)?, &self.key)?,
                int(kv.get("mod_revision")),
            ))),
        }
    }

    /// `mod_revision == rev` when the key was seen, else "absent" (`version == 0`).
    fn unchanged(key: &str, seen: Option<i64>) -> Compare {
        Compare::unchanged(key, seen)
    }

    fn put(key: &str, value: &[u8], lease: Option<i64>) -> RequestOp {
        RequestOp::RequestPut(PutRequest {
            key: b64(key),
            value: B64.encode(value),
            lease: lease.map(|id| id.to_string()),
        })
    }

    /// One guarded transaction; whether its compares held.
    async fn txn(
        &self,
        st: &mut State,
        compare: Vec<Compare>,
        puts: Vec<RequestOp>,
    ) -> Result<bool, LeaseError> {
        let body = TxnRequest {
            compare,
            success: puts,
        };
        let resp = self.rpc(st, "txn", "/v3/kv/txn", &body).await?;
        Ok(resp
            .get("succeeded")
            .and_then(Value::as_bool)
            .unwrap_or(false))
    }

    async fn grant(&self, st: &mut State) -> Result<i64, LeaseError> {
        let body = LeaseGrantRequest {
            ttl: self.ttl_s.to_string(),
        };
        let resp = self.rpc(st, "grant", "/v3/lease/grant", &body).await?;
        match int(resp.get("ID")) {
            0 => Err(self.err("grant", format!("no lease ID in etcd's answer {resp}"))),
            id => Ok(id),
        }
    }

    async fn revoke(&self, st: &mut State, id: i64) -> Result<(), LeaseError> {
        let body = LeaseIdRequest { id: id.to_string() };
        match self.rpc(st, "revoke", "/v3/lease/revoke", &body).await {
            Ok(_) => Ok(()),
            // Already expired: nothing to revoke.
            Err(LeaseError::Etcd { message, .. }) if message.contains("not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// One keep-alive round trip; `Ok(false)` when etcd says the lease is gone (TTL ≤ 0).
    async fn keep_alive(&self, st: &mut State, id: i64) -> Result<bool, LeaseError> {
        let body = LeaseIdRequest { id: id.to_string() };
        match self
            .rpc(st, "keep-alive", "/v3/lease/keepalive", &body)
            .await
        {
            // A streaming call: the gateway wraps each message in `result`.
            Ok(resp) => Ok(int(resp.get("result").unwrap_or(&resp).get("TTL")) > 0),
            Err(LeaseError::Etcd { message, .. }) if message.contains("lease not found") => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }
}

impl LeaseStore for EtcdLease {
    fn describe(&self) -> String {
        format!("etcd {} at {}", self.key, self.endpoints.join(","))
    }

    async fn read(&self) -> Result<Option<LeaseRecord>, LeaseError> {
        let mut st = self.state.lock().await;
        Ok(self.get_record(&mut st).await?.map(|(r, _)| r))
    }

    /// etcd deletes a record whose etcd lease expired: a present one is live.
    fn expiry(&self) -> Expiry {
        Expiry::Store
    }

    async fn claim(&self, core: &Lease, now: Instant, now_wall: f64) -> Result<Claim, LeaseError> {
        let core = core.clone().with_expiry(self.expiry());
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        let mut fresh: Option<i64> = None;
        for _ in 0..CLAIM_ATTEMPTS {
            let snap = self.snapshot(st).await?;
            let stored_epoch = snap.epoch.map_or(0, |(e, _)| e);
            let view = match &snap.record {
                Some((r, _)) => Some(r.clone()),
                None if stored_epoch > 0 => Some(vanished(stored_epoch)),
                None => None,
            };
            let mut rec = match core.claim(view.as_ref(), now, now_wall) {
                Claim::Write(rec) => rec,
                held @ Claim::HeldBy { .. } => {
                    if let Some(id) = fresh {
                        let _ = self.revoke(st, id).await;
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
                    let id = self.grant(st).await?;
                    fresh = Some(id);
                    id
                }
            };
            let won = self
                .txn(
                    st,
                    vec![
                        Self::unchanged(&self.key, snap.record.as_ref().map(|(_, rev)| *rev)),
                        Self::unchanged(&self.epoch_key, snap.epoch.map(|(_, rev)| rev)),
                    ],
                    vec![
                        Self::put(&self.key, &render_record(&rec), Some(id)),
                        Self::put(&self.epoch_key, rec.epoch.to_string().as_bytes(), None),
                    ],
                )
                .await?;
            if won {
                let old = st.held.replace(id);
                if let Some(old) = old.filter(|o| *o != id) {
                    // The record now hangs on the new lease; the old one only holds nothing.
                    let _ = self.revoke(st, old).await;
                }
                return Ok(Claim::Write(rec));
            }
        }
        if let Some(id) = fresh {
            let _ = self.revoke(st, id).await;
        }
        Err(self.err(
            "txn",
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
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        let Some(id) = st.held else {
            // Never attached a record to an etcd lease: nothing of ours can be there.
            return Ok(core.renew(None, now, now_wall));
        };
        let alive = self.keep_alive(st, id).await?;
        let current = if alive {
            self.get_record(st).await?
        } else {
            None
        };
        let rec = match core.renew(current.as_ref().map(|(r, _)| r), now, now_wall) {
            Ok(rec) => rec,
            Err(loss) => return Ok(Err(loss)),
        };
        let rev = current.as_ref().map(|(_, rev)| *rev);
        let won = self
            .txn(
                st,
                vec![Self::unchanged(&self.key, rev)],
                vec![Self::put(&self.key, &render_record(&rec), Some(id))],
            )
            .await?;
        if won {
            return Ok(Ok(rec));
        }
        // Someone wrote the key between our read and our write: decide on what is there now.
        let after = self.get_record(st).await?;
        match core.renew(after.as_ref().map(|(r, _)| r), now, now_wall) {
            Err(loss) => Ok(Err(loss)),
            Ok(_) => Err(self.err("txn", "renewal lost the compare-and-swap")),
        }
    }

    async fn publish(
        &self,
        core: &Lease,
        now: Instant,
        doc: Vec<u8>,
    ) -> Result<Result<(), LeaseLoss>, LeaseError> {
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        let current = self.get_record(st).await?;
        if let Err(loss) = core.may_publish(current.as_ref().map(|(r, _)| r), now) {
            return Ok(Err(loss));
        }
        let rev = current.as_ref().map(|(_, rev)| *rev);
        // A transaction that fails once sent may still have been applied (etcd's own "request
        // timed out" says only that the proposal did not commit in time).
        let won = self
            .txn(
                st,
                vec![Self::unchanged(&self.key, rev)],
                vec![Self::put(&self.handoff_key, &doc, None)],
            )
            .await
            .map_err(|e| LeaseError::Unconfirmed(Box::new(e)))?;
        if won {
            return Ok(Ok(()));
        }
        // The record changed between the check and the write: decide on what is there now.
        let after = self.get_record(st).await?;
        match core.may_publish(after.as_ref().map(|(r, _)| r), now) {
            Err(loss) => Ok(Err(loss)),
            Ok(_) => Err(self.err("txn", "publish lost the compare-and-swap")),
        }
    }

    async fn read_all(&self) -> Result<(Option<LeaseRecord>, Option<Vec<u8>>), LeaseError> {
        let mut guard = self.state.lock().await;
        let [record, doc] = self.read_with(&mut guard, &self.handoff_key).await?;
        let record = match record {
            Some((value, _)) => Some(parse_record(&value, &self.key)?),
            None => None,
        };
        Ok((record, doc.map(|(value, _)| value)))
    }

    async fn release(&self, core: &Lease, now_wall: f64) -> Result<bool, LeaseError> {
        let mut core = core.clone();
        let mut guard = self.state.lock().await;
        let st = &mut *guard;
        let current = self.get_record(st).await?;
        let ours = core
            .release(current.as_ref().map(|(r, _)| r), now_wall)
            .is_some();
        if let Some(id) = st.held.take() {
            // Revoking deletes only keys attached to *our* etcd lease: a successor's record
            // hangs on its own lease and survives.
            self.revoke(st, id).await?;
        }
        Ok(ours)
    }
}
