//! The handoff published beside the lease record in etcd (ha-and-fencing.md): only the live
//! holder's publish lands (a transaction guarded by the record it checked), a successor reads
//! the last one together with the record, and an old holder's publish after the successor's
//! claim is refused. Against a real etcd on loopback ports (`narwhal_testkit::etcd`; without an
//! etcd binary this test FAILS saying so).
// Tests measure wall time: the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

use std::time::Duration;

use narwhal_router::lease::{Claim, EtcdLease, Lease, LeaseLoss, LeaseStore, LeaseTiming};
use narwhal_shared::{Clock, SystemClock};
use narwhal_testkit::etcd::{EtcdOptions, EtcdServer};

fn store(etcd: &EtcdServer) -> EtcdLease {
    EtcdLease::new(
        vec![etcd.endpoint.clone()],
        "/narwhal/test/handoff-lease",
        Duration::from_secs(2),
        Duration::from_secs(2),
    )
    .expect("store")
}

const S: Duration = Duration::from_secs(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn timing() -> LeaseTiming {
    LeaseTiming {
        ttl: Duration::from_secs(2),
        renew_interval: Duration::from_millis(500),
        safety_margin: Duration::from_millis(500),
    }
}

#[tokio::test]
async fn only_the_live_holder_publishes_and_a_successor_reads_it_in_etcd() {
    let etcd = EtcdServer::start(EtcdOptions::default()).await;
    let (sa, sb) = (store(&etcd), store(&etcd));
    assert_eq!(sa.handoff_key(), "/narwhal/test/handoff-lease/handoff");
    let t0 = SystemClock.now();
    let mut a = Lease::new("a:1".into(), timing());
    assert_eq!(sb.read_all().await.unwrap(), (None, None));
    assert_eq!(
        sa.publish(&a, t0, b"early".to_vec()).await.unwrap(),
        Err(LeaseLoss::Lapsed),
        "nothing held: nothing published"
    );
    let Claim::Write(ra) = sa.claim(&a, t0, 1000.0).await.unwrap() else {
        panic!("A must get the free lease")
    };
    a.granted(ra.epoch, t0);
    assert_eq!(
        sa.publish(&a, t0 + ms(500), b"doc-1".to_vec())
            .await
            .unwrap(),
        Ok(())
    );
    let (rec, doc) = sb.read_all().await.unwrap();
    assert_eq!(
        (rec, doc.as_deref()),
        (Some(ra.clone()), Some(&b"doc-1"[..]))
    );
    // B takes over once A's record expired: etcd deletes it when A's etcd lease runs out
    // (deleted here, while A still believes it holds). A's late publish is refused and changes
    // nothing; B reads what A published before the claim.
    etcd.gateway().delete("/narwhal/test/handoff-lease").await;
    let mut b = Lease::new("b:2".into(), timing());
    let Claim::Write(rb) = sb.claim(&b, t0 + 3 * S, 1003.0).await.unwrap() else {
        panic!("B must take the expired lease")
    };
    b.granted(rb.epoch, t0 + 3 * S);
    assert_eq!(rb.epoch, 2);
    assert_eq!(
        sa.publish(&a, t0 + ms(900), b"late".to_vec())
            .await
            .unwrap(),
        Err(LeaseLoss::HeldByAnother)
    );
    let (_, doc) = sb.read_all().await.unwrap();
    assert_eq!(doc.as_deref(), Some(&b"doc-1"[..]));
    assert_eq!(
        sb.publish(&b, t0 + ms(3100), b"doc-2".to_vec())
            .await
            .unwrap(),
        Ok(())
    );
    // The document outlives its writer's etcd lease: released, the record goes, it stays.
    assert!(sb.release(&b, 1003.2).await.unwrap());
    let (rec, doc) = sa.read_all().await.unwrap();
    assert_eq!((rec, doc.as_deref()), (None, Some(&b"doc-2"[..])));
}
