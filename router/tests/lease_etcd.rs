//! The etcd lease backend and the lease driver against a real etcd started on loopback ports
//! (issue 5: "the tests start a real etcd on a loopback port").
//!
//! The `etcd` binary (Debian `etcd-server`; override with `NARWHAL_ETCD_BIN`) is required:
//! without it these tests FAIL with a message saying so, they never pass silently.
// Tests measure wall time (deadlines): the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use narwhal_router::config::{LeaseBackend, LeaseSection};
use narwhal_router::lease::{
    Claim, Control, EtcdLease, Lease, LeaseDriver, LeaseError, LeaseEvent, LeaseLoss, LeaseStore,
    LeaseTiming,
};
use narwhal_shared::{Clock, SystemClock};
use narwhal_testkit::{Etcd, free_port};
use tokio_util::sync::CancellationToken;

/// A lease store on `etcd` for `key` (one router's view).
fn store(etcd: &Etcd, key: &str, ttl: Duration) -> EtcdLease {
    EtcdLease::new(
        vec![etcd.endpoint.clone()],
        key,
        ttl,
        Duration::from_secs(2),
    )
    .unwrap()
}

/// A plain etcd client, to look at (and tamper with) the keys directly.
async fn raw(etcd: &Etcd) -> etcd_client::Client {
    etcd_client::Client::connect([&etcd.endpoint], None)
        .await
        .unwrap()
}

fn timing(ttl_ms: u64, renew_ms: u64, margin_ms: u64) -> LeaseTiming {
    LeaseTiming {
        ttl: Duration::from_millis(ttl_ms),
        renew_interval: Duration::from_millis(renew_ms),
        safety_margin: Duration::from_millis(margin_ms),
    }
}

async fn raw_get(c: &mut etcd_client::Client, key: &str) -> Option<String> {
    let r = c.get(key, None).await.unwrap();
    r.kvs()
        .first()
        .map(|kv| kv.value_str().unwrap().to_string())
}

#[tokio::test]
async fn claim_refuse_takeover_fence_and_release() {
    let etcd = Etcd::start().await;
    let key = "/narwhal/t1/router-lease";
    // Two stores, two clients: two routers.
    let sa = store(&etcd, key, Duration::from_secs(2));
    let sb = store(&etcd, key, Duration::from_secs(2));
    let mut raw = raw(&etcd).await;
    let t0 = SystemClock.now();
    let mut a = Lease::new("a:1".into(), timing(2000, 500, 500));
    let mut b = Lease::new("b:2".into(), timing(2000, 500, 500));
    assert_eq!(sb.read().await.unwrap(), None);

    // A claims epoch 1; the record and the epoch key are written together.
    let Claim::Write(ra) = sa.claim(&a, 1000.0).await.unwrap() else {
        panic!("A must get the free lease")
    };
    assert_eq!(
        (ra.epoch, ra.holder.as_str(), ra.expires_at),
        (1, "a:1", 1002.0)
    );
    a.granted(ra.epoch, t0);
    assert_eq!(sb.read().await.unwrap(), Some(ra.clone()));
    assert_eq!(
        raw_get(&mut raw, "/narwhal/t1/router-lease/epoch").await,
        Some("1".into())
    );
    let kv = raw.get(key, None).await.unwrap();
    assert_ne!(kv.kvs()[0].lease(), 0, "the record hangs on an etcd lease");

    // B is refused while A's record is live.
    assert_eq!(
        sb.claim(&b, 1001.0).await.unwrap(),
        Claim::HeldBy {
            holder: "a:1".into(),
            epoch: 1,
            expires_at: 1002.0
        }
    );

    // A renews: keep-alive plus a rewrite with a later expiry.
    let renewed = sa.renew(&a, 1001.0).await.unwrap().unwrap();
    assert_eq!((renewed.epoch, renewed.expires_at), (1, 1003.0));
    assert_eq!(sb.read().await.unwrap(), Some(renewed));

    // Past the record's expiry B takes over at epoch 2 (A's etcd lease is still alive).
    let Claim::Write(rb) = sb.claim(&b, 1003.5).await.unwrap() else {
        panic!("B must take the expired lease")
    };
    assert_eq!((rb.epoch, rb.holder.as_str()), (2, "b:2"));
    b.granted(rb.epoch, t0);

    // A's next renewal finds B: the verdict fences A.
    assert_eq!(
        sa.renew(&a, 1003.6).await.unwrap(),
        Err(LeaseLoss::HeldByAnother)
    );
    a.fence(LeaseLoss::HeldByAnother);
    // A's release revokes only its own etcd lease: B's record survives.
    assert!(!sa.release(&a, 1003.7).await.unwrap());
    assert_eq!(sb.read().await.unwrap(), Some(rb));

    // B's release removes the record; the epoch key remembers 2.
    assert!(sb.release(&b, 1004.0).await.unwrap());
    assert_eq!(sa.read().await.unwrap(), None);
    assert_eq!(
        raw_get(&mut raw, "/narwhal/t1/router-lease/epoch").await,
        Some("2".into())
    );
    let a2 = Lease::new("a:3".into(), timing(2000, 500, 500));
    let Claim::Write(rc) = sa.claim(&a2, 1004.1).await.unwrap() else {
        panic!("a released lease is free")
    };
    assert_eq!(rc.epoch, 3, "the epoch advances across a vanished record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_have_exactly_one_winner() {
    let etcd = Etcd::start().await;
    let key = "/narwhal/t6/router-lease";
    let mut tasks = Vec::new();
    for i in 0..6 {
        let s = store(&etcd, key, Duration::from_secs(2));
        tasks.push(tokio::spawn(async move {
            let core = Lease::new(format!("r{i}:x"), timing(2000, 500, 500));
            s.claim(&core, 1000.0).await.unwrap()
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
    let etcd = Etcd::start().await;
    let key = "/narwhal/t2/router-lease";
    let sa = store(&etcd, key, Duration::from_millis(800));
    assert_eq!(sa.ttl_s(), 1, "TTL is rounded up to whole seconds");
    let sb = store(&etcd, key, Duration::from_millis(800));
    let t0 = SystemClock.now();
    let wall = SystemClock.wall().unwrap();
    let mut a = Lease::new("a:1".into(), timing(800, 200, 200));
    let Claim::Write(ra) = sa.claim(&a, wall).await.unwrap() else {
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
        sa.renew(&a, SystemClock.wall().unwrap()).await.unwrap(),
        Err(LeaseLoss::Lapsed)
    );
    let b = Lease::new("b:2".into(), timing(800, 200, 200));
    let Claim::Write(rb) = sb.claim(&b, SystemClock.wall().unwrap()).await.unwrap() else {
        panic!("the lapsed lease is free")
    };
    assert_eq!(rb.epoch, 2);
}

#[tokio::test]
async fn a_malformed_record_in_etcd_is_an_error_and_is_not_overwritten() {
    let etcd = Etcd::start().await;
    let key = "/narwhal/t3/router-lease";
    let mut raw = raw(&etcd).await;
    raw.put(key, "{\"epoch\": 1, \"expires", None)
        .await
        .unwrap();
    let s = store(&etcd, key, Duration::from_secs(2));
    let err = s.read().await.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("lease record /narwhal/t3/router-lease is malformed: "),
        "{err}"
    );
    let a = Lease::new("a:1".into(), timing(2000, 500, 500));
    assert!(matches!(
        s.claim(&a, 1000.0).await.unwrap_err(),
        LeaseError::Malformed { .. }
    ));
    assert_eq!(
        raw_get(&mut raw, key).await.as_deref(),
        Some("{\"epoch\": 1, \"expires")
    );
    raw.put("/narwhal/t3/router-lease/epoch", "two", None)
        .await
        .unwrap();
    raw.delete(key, None).await.unwrap();
    let err = s.claim(&a, 1000.0).await.unwrap_err().to_string();
    assert_eq!(
        err,
        "lease record /narwhal/t3/router-lease/epoch is malformed: epoch: \"two\" is not a non-negative integer"
    );
}

#[tokio::test]
async fn the_driver_keeps_the_lease_past_its_ttl_and_fences_on_a_takeover() {
    let etcd = Etcd::start().await;
    let section = LeaseSection {
        backend: LeaseBackend::Etcd,
        path: String::new(),
        endpoints: vec![etcd.endpoint.clone()],
        key: "/narwhal/t4/router-lease".into(),
        ttl_s: 1.5,
        renew_interval_s: 0.3,
        safety_margin_s: 0.3,
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let a = Arc::new(LeaseDriver::from_config(&section, "router-a", clock.clone()).unwrap());
    assert_eq!(a.control(clock.now()), Control::Standby);
    assert_eq!(a.claim().await, Ok(1));
    assert!(a.holder().starts_with("router-a:"));
    let events = Arc::new(Mutex::new(Vec::new()));
    let ev = events.clone();
    let stop = CancellationToken::new();
    let task = a.clone().spawn_renew(stop.clone(), move |e| {
        ev.lock().unwrap().push(e);
    });
    // Renewals carry the record well past the 2 s etcd lease and its 1.5 s expiry.
    let first = a.read_record().await.unwrap().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    loop {
        let now = a.read_record().await.unwrap().expect("kept alive");
        assert_eq!((now.epoch, &now.holder), (1, &first.holder));
        if now.expires_at > first.expires_at + 2.5 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "record not renewed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(a.control(clock.now()), Control::Active);
    assert!(events.lock().unwrap().is_empty());

    // Router B, whose wall clock runs 10 s ahead, sees A's record expired and takes over.
    let sb = store(&etcd, "/narwhal/t4/router-lease", Duration::from_secs(2));
    let b = Lease::new("router-b:1".into(), timing(1500, 300, 300));
    let Claim::Write(rb) = sb.claim(&b, clock.wall().unwrap() + 10.0).await.unwrap() else {
        panic!("B's skewed clock must see the record expired")
    };
    assert_eq!(rb.epoch, 2);
    // A's renew loop fences A at its next renewal.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while events.lock().unwrap().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "A never fenced");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        events.lock().unwrap().clone(),
        vec![LeaseEvent::Fenced {
            epoch: 1,
            loss: LeaseLoss::HeldByAnother
        }]
    );
    let st = a.status(clock.now());
    assert_eq!((st.control, st.epoch), (Control::Fenced, 0));
    assert_eq!(st.reason.as_deref(), Some("lease held by another router"));
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("the loop exits after fencing")
        .unwrap();
    stop.cancel();
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
    let err = s.claim(&a, 1000.0).await.unwrap_err();
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
