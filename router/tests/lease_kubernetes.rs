//! The `kubernetes` lease backend and the lease driver against a real kube-apiserver (v1.20.2,
//! built from Debian's source package) started on loopback with its own etcd
//! (`narwhal_testkit::k8s`; docs/ha.md, "`kubernetes` backend").
//!
//! The routers authenticate as a service account whose Role grants exactly what the chart's
//! Role grants: `get` and `update` on the one Lease, `create` on leases in the namespace.
//! Without an API server these tests FAIL saying why; they never pass silently.
// Tests measure wall time (lease expiry, deadlines): the clock ban of clippy.toml is for
// product code.
#![allow(clippy::disallowed_methods)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use narwhal_router::config::{KubernetesAccess, LeaseBackend, LeaseSection};
use narwhal_router::lease::kubernetes::object::{
    GZIP_PREFIX, HANDOFF_ANNOTATION, KEEP_EPOCH_FINALIZER, LeaseObject, RECORD_ANNOTATION,
};
use narwhal_router::lease::{
    Claim, Control, KubeLease, Lease, LeaseDriver, LeaseError, LeaseLoss, LeaseStore, LeaseTiming,
};
use narwhal_shared::{Clock, SystemClock};
use narwhal_testkit::k8s::{
    KUBE_NAMESPACE, KUBE_ROUTER_ACCOUNT, KubeApiServer, KubeClient, Signal, router_grant,
};

const NS: &str = KUBE_NAMESPACE;
const ACCOUNT: &str = KUBE_ROUTER_ACCOUNT;
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

/// An API server, the service account's token in a file, and the admin client.
struct Cluster {
    api: KubeApiServer,
    admin: KubeClient,
    token_file: PathBuf,
}

impl Cluster {
    /// Starts the API server and grants the router's Role for Lease `name`.
    async fn start(name: &str) -> Cluster {
        let api = KubeApiServer::start().await;
        let admin = api.admin();
        admin.grant(&router_grant(name)).await;
        let token = admin.token_for(NS, ACCOUNT).await;
        let token_file = api.dir().join("router.token");
        std::fs::write(&token_file, token).unwrap();
        Cluster {
            api,
            admin,
            token_file,
        }
    }

    fn access(&self, name: &str) -> KubernetesAccess {
        KubernetesAccess {
            name: name.into(),
            namespace: Some(NS.into()),
            api_server: Some(self.api.url.clone()),
            token_file: Some(self.token_file.clone()),
            ca_file: Some(self.api.ca.clone()),
        }
    }

    fn store(&self, name: &str, ttl: Duration) -> KubeLease {
        KubeLease::from_access(&self.access(name), ttl, Duration::from_secs(3)).unwrap()
    }

    fn path(name: &str) -> String {
        format!("/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{name}")
    }

    /// The Lease object as the admin reads it; `None` when absent.
    async fn lease(&self, name: &str) -> Option<LeaseObject> {
        match self.admin.get::<LeaseObject>(&Self::path(name)).await {
            Ok(o) => Some(o),
            Err(e) if e.status == 404 => None,
            Err(e) => panic!("reading lease {name}: {e}"),
        }
    }
}

/// Two routers through a claim, a refusal, a renewal, a takeover past the observed expiry, the
/// old holder fenced, and releases; what the Lease object holds is checked at each step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_refuse_takeover_fence_and_release() {
    let name = "router-lease";
    let c = Cluster::start(name).await;
    let (sa, sb) = (c.store(name, 2 * S), c.store(name, 2 * S));
    let t0 = SystemClock.now();
    let mut a = Lease::new("a:1".into(), timing(2000, 500, 500));
    let mut b = Lease::new("b:2".into(), timing(2000, 500, 500));
    assert_eq!(sb.read().await.unwrap(), None, "no Lease object: no lease");
    assert!(c.lease(name).await.is_none());

    // A claims epoch 1: the object is created with the record, the mirror and the finalizer.
    let Claim::Write(ra) = sa.claim(&a, t0, 1000.0).await.unwrap() else {
        panic!("A must get the free lease")
    };
    assert_eq!(
        (ra.epoch, ra.holder.as_str(), ra.expires_at),
        (1, "a:1", 1002.0)
    );
    a.granted(ra.epoch, t0);
    assert_eq!(sb.read().await.unwrap(), Some(ra.clone()));
    let obj = c.lease(name).await.expect("the claim created the Lease");
    assert_eq!(
        obj.metadata.finalizers,
        vec![KEEP_EPOCH_FINALIZER.to_string()]
    );
    assert_eq!(obj.spec.holder_identity.as_deref(), Some("a:1"));
    assert_eq!(obj.spec.lease_duration_seconds, Some(2));
    assert_eq!(obj.spec.lease_transitions, Some(1));
    assert_eq!(
        obj.spec.renew_time.as_deref(),
        Some("1970-01-01T00:16:40.000000Z"),
        "renewTime is the record's updated_at"
    );
    let text = &obj.metadata.annotations[RECORD_ANNOTATION];
    assert!(text.starts_with("{\"epoch\":1,"), "{text}");

    // B is refused while A's record is live, and nothing is written.
    let version = obj.metadata.resource_version.clone();
    let held = sb.claim(&b, t0 + S, 1001.0).await.unwrap();
    assert_eq!(
        held,
        Claim::HeldBy {
            holder: "a:1".into(),
            epoch: 1,
            expires_at: 1002.0,
            updated_at: 1000.0,
        }
    );
    let unchanged = c.lease(name).await.unwrap();
    assert_eq!(unchanged.metadata.resource_version, version);

    // A renews: same epoch, later expiry.
    let renewed = sa.renew(&a, t0 + S, 1001.0).await.unwrap().unwrap();
    assert_eq!((renewed.epoch, renewed.expires_at), (1, 1003.0));

    // B saw the renewed record at +1 s; once it stayed unchanged for its 2 s on B's monotonic
    // clock, B takes over at epoch 2.
    b.observe(Some(&renewed), t0 + S);
    assert!(
        matches!(
            sb.claim(&b, t0 + ms(2900), 1002.9).await.unwrap(),
            Claim::HeldBy { .. }
        ),
        "not before the observed expiry"
    );
    let Claim::Write(rb) = sb.claim(&b, t0 + 3 * S, 1003.0).await.unwrap() else {
        panic!("B must take the lapsed lease")
    };
    assert_eq!((rb.epoch, rb.holder.as_str()), (2, "b:2"));
    b.granted(rb.epoch, t0 + 3 * S);
    let obj = c.lease(name).await.unwrap();
    assert_eq!(
        (
            obj.spec.holder_identity.as_deref(),
            obj.spec.lease_transitions
        ),
        (Some("b:2"), Some(2))
    );

    // A's next renewal finds B: fenced, the record untouched.
    assert_eq!(
        sa.renew(&a, t0 + ms(3100), 1003.1).await.unwrap(),
        Err(LeaseLoss::HeldByAnother)
    );
    a.fence(LeaseLoss::HeldByAnother);
    assert_eq!(a.control(t0 + ms(3100)), Control::Fenced);
    assert_eq!(sa.read().await.unwrap(), Some(rb.clone()));

    // A's release does not touch B's record; B's marks it released at the same epoch.
    assert!(!sa.release(&a, 1003.2).await.unwrap());
    assert!(sb.release(&b, 1003.5).await.unwrap());
    let released = sa.read().await.unwrap().unwrap();
    assert_eq!((released.epoch, released.expires_at), (2, 1003.5));
    assert!(released.released());
    assert_eq!(c.lease(name).await.unwrap().spec.holder_identity, None);

    // The next claim, even right away, advances the epoch.
    let Claim::Write(rc) = sa.claim(&a, t0 + ms(3600), 1003.6).await.unwrap() else {
        panic!("a released lease is free")
    };
    assert_eq!(rc.epoch, 3);
}

/// Many routers claiming at once: exactly one wins, by the API server's compare-and-swap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_have_exactly_one_winner() {
    let name = "race";
    let c = Cluster::start(name).await;
    let t0 = SystemClock.now();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let store = c.store(name, 5 * S);
        tasks.push(tokio::spawn(async move {
            let core = Lease::new(format!("r{i}:x"), timing(5000, 1000, 1000));
            store.claim(&core, t0, 2000.0).await
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(Claim::Write(rec)) => winners.push(rec),
            Ok(Claim::HeldBy { epoch, .. }) => assert_eq!(epoch, 1),
            // Three lost races in a row is an answer too: nothing granted.
            Err(LeaseError::Kubernetes { message, .. }) => {
                assert!(message.contains("compare-and-swap"), "{message}");
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one winner: {winners:?}");
    let stored = c.store(name, 5 * S).read().await.unwrap().unwrap();
    assert_eq!(stored, winners[0]);
}

/// A deleted Lease keeps its epoch: the finalizer holds it (marked for deletion, still claimed
/// and renewed); and once someone removes the finalizer and the object is gone, a router that
/// saw the epoch claims above it on the recreated object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_lease_keeps_its_epoch() {
    let name = "deleted";
    let c = Cluster::start(name).await;
    let s = c.store(name, 2 * S);
    let t0 = SystemClock.now();
    let mut a = Lease::new("a:1".into(), timing(2000, 500, 500));
    let Claim::Write(r1) = s.claim(&a, t0, 10.0).await.unwrap() else {
        panic!()
    };
    a.granted(r1.epoch, t0);
    assert!(s.release(&a, 10.1).await.unwrap());
    let Claim::Write(r2) = s.claim(&a, t0 + ms(100), 10.2).await.unwrap() else {
        panic!()
    };
    assert_eq!(r2.epoch, 2);
    a.granted(r2.epoch, t0 + ms(100));

    c.admin.delete(&Cluster::path(name)).await.unwrap();
    let marked = c.lease(name).await.expect("the finalizer keeps it");
    assert!(marked.metadata.deletion_timestamp.is_some());
    let renewed = s.renew(&a, t0 + ms(200), 10.3).await.unwrap().unwrap();
    assert_eq!(
        renewed.epoch, 2,
        "renewed on the object marked for deletion"
    );

    // Someone removes the finalizer: the object goes. This router saw epoch 2, so its next
    // claim, on a Lease created anew, is epoch 3, never 1.
    let mut obj = c.lease(name).await.unwrap();
    obj.metadata.finalizers.clear();
    c.admin
        .put::<LeaseObject>(&Cluster::path(name), &obj)
        .await
        .unwrap();
    assert!(c.lease(name).await.is_none());
    let mut again = Lease::new("a:1".into(), timing(2000, 500, 500));
    again.observe(None, t0);
    let Claim::Write(r3) = s.claim(&again, t0 + ms(300), 10.4).await.unwrap() else {
        panic!()
    };
    assert_eq!(r3.epoch, 3);
    let created = c.lease(name).await.unwrap();
    assert_eq!(
        created.metadata.finalizers,
        vec![KEEP_EPOCH_FINALIZER.to_string()]
    );
}

/// A token that rotates: the backend reads the token file before every call. A token the API
/// server refuses is an error naming 401 and the file; the next one is used at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_token_is_read_before_every_call_and_a_refused_one_is_named() {
    let name = "rotate";
    let c = Cluster::start(name).await;
    let s = c.store(name, 5 * S);
    let t0 = SystemClock.now();
    let mut a = Lease::new("a:1".into(), timing(5000, 1000, 1000));
    let Claim::Write(r) = s.claim(&a, t0, 1.0).await.unwrap() else {
        panic!()
    };
    a.granted(r.epoch, t0);

    std::fs::write(&c.token_file, "not-a-token").unwrap();
    let err = s
        .renew(&a, t0 + ms(100), 1.1)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("401"), "{err}");
    assert!(err.contains(&c.token_file.display().to_string()), "{err}");

    let fresh = c.admin.token_for(NS, ACCOUNT).await;
    std::fs::write(&c.token_file, fresh).unwrap();
    let renewed = s.renew(&a, t0 + ms(200), 1.2).await.unwrap().unwrap();
    assert_eq!(renewed.epoch, 1);
}

/// An identity without the Role is refused, and the error says which permissions it needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_identity_is_told_which_permissions_it_needs() {
    let name = "mine";
    let c = Cluster::start(name).await;
    // The router's Role is for `mine` only: reading `other` is forbidden, so is claiming it.
    let other = c.store("other", 5 * S);
    let t0 = SystemClock.now();
    let a = Lease::new("a:1".into(), timing(5000, 1000, 1000));
    let err = other.claim(&a, t0, 1.0).await.unwrap_err().to_string();
    assert!(err.contains("403"), "{err}");
    assert!(
        err.contains("get and update on leases/other and create on leases in namespace narwhal"),
        "{err}"
    );
    assert!(c.lease("other").await.is_none(), "nothing was created");
    // The same identity on its own Lease: granted.
    assert!(matches!(
        c.store(name, 5 * S).claim(&a, t0, 1.0).await.unwrap(),
        Claim::Write(_)
    ));
}

/// The handoff is published into the Lease only while it is ours, in one guarded write; a
/// document near Kubernetes' annotation limit is published and read back whole, a larger one
/// rides gzipped, and one that does not fit even so is refused naming the limit and leaves the
/// last one in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handoff_rides_in_the_lease_up_to_the_annotation_limit() {
    let name = "handoff";
    let c = Cluster::start(name).await;
    let (sa, sb) = (c.store(name, 2 * S), c.store(name, 2 * S));
    let t0 = SystemClock.now();
    let mut a = Lease::new("a:1".into(), timing(2000, 500, 500));
    assert_eq!(
        sa.publish(&a, t0, b"{}".to_vec()).await.unwrap(),
        Err(LeaseLoss::Lapsed),
        "nothing owned: nothing published"
    );
    let Claim::Write(r) = sa.claim(&a, t0, 5.0).await.unwrap() else {
        panic!()
    };
    a.granted(r.epoch, t0);
    // 250 KiB of JSON: under the 256 KiB of all annotations together, with the record.
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(250 * 1024));
    sa.publish(&a, t0 + ms(100), big.clone().into_bytes())
        .await
        .unwrap()
        .unwrap();
    let (rec, doc) = sb.read_all().await.unwrap();
    assert_eq!(rec.map(|r| r.epoch), Some(1));
    assert_eq!(doc.as_deref(), Some(big.as_bytes()), "read back whole");
    let obj = c.lease(name).await.unwrap();
    assert_eq!(
        obj.metadata.annotations[HANDOFF_ANNOTATION].len(),
        big.len()
    );

    // A document too large as it is rides gzipped (a fleet's handoff shrinks about tenfold).
    let large = format!("{{\"pad\":\"{}\"}}", "y".repeat(600 * 1024));
    sa.publish(&a, t0 + ms(150), large.clone().into_bytes())
        .await
        .unwrap()
        .unwrap();
    let (_, doc) = sb.read_all().await.unwrap();
    assert_eq!(doc.as_deref(), Some(large.as_bytes()), "read back whole");
    let obj = c.lease(name).await.unwrap();
    assert!(obj.metadata.annotations[HANDOFF_ANNOTATION].starts_with(GZIP_PREFIX));
    // One that does not fit even gzipped (400 KiB of random hex) is refused before the call,
    // naming the limit, and the last one stays.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let noise: String = (0..400 * 1024)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from_digit((x % 16) as u32, 16).unwrap()
        })
        .collect();
    let too_big = format!("{{\"pad\":\"{noise}\"}}");
    let err = sa
        .publish(&a, t0 + ms(200), too_big.into_bytes())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("262144-byte limit"), "{err}");
    let (_, doc) = sb.read_all().await.unwrap();
    assert_eq!(doc.as_deref(), Some(large.as_bytes()), "the last one stays");

    // After B's takeover, A's publish is refused and B reads A's last document.
    let mut b = Lease::new("b:2".into(), timing(2000, 500, 500));
    b.observe(sb.read().await.unwrap().as_ref(), t0 + ms(300));
    let Claim::Write(rb) = sb.claim(&b, t0 + ms(2400), 8.0).await.unwrap() else {
        panic!("B takes the lapsed lease")
    };
    assert_eq!(rb.epoch, 2);
    assert_eq!(
        sa.publish(&a, t0 + ms(2500), b"late".to_vec())
            .await
            .unwrap(),
        Err(LeaseLoss::HeldByAnother)
    );
    let (_, doc) = sb.read_all().await.unwrap();
    assert_eq!(doc.as_deref(), Some(large.as_bytes()));
}

/// The driver on a stopped API server: a renewal fails within its call bound and the lease is
/// fenced once its local validity ends; when the server answers again the router claims anew
/// (its own record, lapsed on its observation) at a higher epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_is_fenced_by_a_stopped_api_server_and_claims_again_after() {
    let name = "stopped";
    let c = Cluster::start(name).await;
    let section = LeaseSection {
        backend: LeaseBackend::Kubernetes,
        path: String::new(),
        endpoints: vec![],
        key: String::new(),
        ttl_s: 3.0,
        renew_interval_s: 1.0,
        safety_margin_s: 0.5,
        etcd: Default::default(),
        kubernetes: c.access(name),
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let d = LeaseDriver::from_config(&section, "router-a", clock.clone()).unwrap();
    assert_eq!(d.claim().await, Ok(1));
    assert_eq!(d.renew().await, Ok(1));

    c.api.signal(Signal::SIGSTOP);
    let started = Instant::now();
    let err = d.renew().await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "bounded by the call timeout: {:?}",
        started.elapsed()
    );
    assert!(
        matches!(err, LeaseLoss::Unavailable(_) | LeaseLoss::Unconfirmed(_)),
        "{err:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.control(clock.now()) != Control::Fenced {
        assert!(Instant::now() < deadline, "fenced once its validity ends");
        let _ = d.renew().await;
        tokio::time::sleep(ms(100)).await;
    }
    c.api.signal(Signal::SIGCONT);
    let deadline = Instant::now() + Duration::from_secs(30);
    let epoch = loop {
        match d.claim().await {
            Ok(e) => break e,
            Err(_) => {
                assert!(
                    Instant::now() < deadline,
                    "claims again once the server answers"
                );
                tokio::time::sleep(ms(200)).await;
            }
        }
    };
    // Its own record: kept at epoch 1 while still live on its observation, epoch 2 once lapsed.
    assert!(epoch == 1 || epoch == 2, "{epoch}");
}

/// Settings that cannot work refuse to start, naming the key.
#[test]
fn bad_settings_name_the_key() {
    let ca = Path::new("/nonexistent/ca.crt");
    let base = KubernetesAccess {
        name: "ok".into(),
        namespace: Some("narwhal".into()),
        api_server: Some("https://127.0.0.1:6443".into()),
        token_file: Some("/nonexistent/token".into()),
        ca_file: Some(ca.into()),
    };
    let err = |a: &KubernetesAccess, env: &[(&str, &str)]| {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
        KubeLease::resolve(a, S, S, |k| {
            env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
        .unwrap_err()
        .to_string()
    };
    let mut a = base.clone();
    a.name = "Not_A_Name".into();
    assert!(err(&a, &[]).contains("lease.kubernetes.name = \"Not_A_Name\""));
    let mut a = base.clone();
    a.api_server = Some("http://127.0.0.1:6443".into());
    assert!(err(&a, &[]).contains("lease.kubernetes.api_server"));
    let mut a = base.clone();
    a.api_server = None;
    assert!(err(&a, &[]).contains("KUBERNETES_SERVICE_HOST"));
    // With the pod's environment, the address is taken from it; then the token is missing.
    assert!(
        err(
            &a,
            &[
                ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
                ("KUBERNETES_SERVICE_PORT", "443")
            ]
        )
        .contains("lease.kubernetes.token_file: /nonexistent/token")
    );
    assert!(err(&base, &[]).contains("lease.kubernetes.token_file"));
}

/// Others write the Lease too (a label from a policy controller, a manifest that created it):
/// a renewal and a publish read again and go on; a Lease created without the finalizer gets it
/// on the first write; and a standby that only polled (`read_all`) claims a recreated Lease
/// above the epoch it saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_writes_do_not_fence_and_a_polling_standby_keeps_the_epoch() {
    let name = "shared";
    let c = Cluster::start(name).await;
    // A Lease made by a manifest: no record, no finalizer.
    c.admin
        .post::<LeaseObject>(
            &format!("/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"),
            &serde_json::json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": NS}, "spec": {}}),
        )
        .await
        .unwrap();
    let (sa, sb) = (c.store(name, 2 * S), c.store(name, 2 * S));
    let t0 = SystemClock.now();
    let mut a = Lease::new("a:1".into(), timing(2000, 500, 500));
    let Claim::Write(r1) = sa.claim(&a, t0, 50.0).await.unwrap() else {
        panic!()
    };
    a.granted(r1.epoch, t0);
    let obj = c.lease(name).await.unwrap();
    assert_eq!(
        obj.metadata.finalizers,
        vec![KEEP_EPOCH_FINALIZER.to_string()]
    );

    // A label written between the primary's read and write costs it nothing.
    let mut labelled = c.lease(name).await.unwrap();
    labelled
        .metadata
        .rest
        .insert("labels".into(), serde_json::json!({"team": "inference"}));
    c.admin
        .put::<LeaseObject>(&Cluster::path(name), &labelled)
        .await
        .unwrap();
    assert_eq!(
        sa.renew(&a, t0 + ms(100), 50.1)
            .await
            .unwrap()
            .unwrap()
            .epoch,
        1
    );
    sa.publish(&a, t0 + ms(200), b"{\"doc\":1}".to_vec())
        .await
        .unwrap()
        .unwrap();
    let kept = c.lease(name).await.unwrap();
    assert!(kept.metadata.rest.contains_key("labels"), "{kept:?}");

    // The standby only polled; the Lease is then deleted for good (finalizer removed).
    let (rec, _) = sb.read_all().await.unwrap();
    assert_eq!(rec.map(|r| r.epoch), Some(1));
    let mut gone = c.lease(name).await.unwrap();
    gone.metadata.finalizers.clear();
    c.admin
        .put::<LeaseObject>(&Cluster::path(name), &gone)
        .await
        .unwrap();
    c.admin.delete(&Cluster::path(name)).await.unwrap();
    assert!(c.lease(name).await.is_none());
    let b = Lease::new("b:2".into(), timing(2000, 500, 500));
    let Claim::Write(rb) = sb.claim(&b, t0 + ms(300), 50.3).await.unwrap() else {
        panic!()
    };
    assert_eq!(rb.epoch, 2, "above the epoch the standby saw");
}
