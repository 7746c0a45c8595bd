//! End-to-end tests of the HA handoff document and `--resume` (handoff-and-lifecycle.md): real
//! routers, agents and simulators with mutual TLS; the router is killed with SIGKILL and a new one
//! resumes from `recovery.state_path`.

use std::collections::BTreeMap;
use std::time::Duration;

use narwhal_shared::documents::requests::{DrainBody, ReadmitBody};
use narwhal_shared::handoff::{DrainRecord, DrainState, Handoff, LifecycleState};
use narwhal_testkit::{ById, Fleet, RouterHandle, handoff_file_where, merge, metric};
use serde_json::json;

/// p0 (prefill) and d0 (decode), each on its own simulated host with an agent; the test starts
/// the routers (all sharing `state.json`).
async fn fleet() -> Fleet {
    Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .no_router()
        .start()
        .await
}

async fn serve_some(router: &RouterHandle, n: usize) {
    for i in 0..n {
        assert_eq!(
            router.completion(&format!("resume me {i}"), 3).await.status,
            200
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_validates_round_trips_and_resume_restores_totals_and_holds() {
    let mut f = fleet().await;
    let mut a = f.start_router("router-a", &[]);
    // Ready only after every engine's identity was checked through its agent.
    assert_eq!(a.get_data("/ready").await.status, 200);
    let lc = a.lifecycle().await;
    for iid in ["p0", "d0"] {
        assert!(
            lc.process_starts.contains_key(iid),
            "{iid}'s start accepted before ready: {lc:#?}"
        );
    }
    serve_some(&a, 5).await;
    // Drain d0 (restart required) so the handoff carries a lifecycle hold.
    let (s, doc) = a.drain(&DrainBody::engine("d0", 60.0)).await;
    assert_eq!(s, 200, "{doc:#?}");
    let live = a.handoff().await;
    let h = Handoff::from_value(live.clone()).expect("the live handoff validates");
    assert_eq!(h.schema, "narwhal.handoff");
    assert_eq!(h.schema_version, 1);
    assert_eq!(h.engines, ["d0", "p0"], "sorted");
    assert_eq!((h.epoch, h.holder.as_str()), (0, ""));
    for c in [
        "served",
        "failed",
        "unserved",
        "refused",
        "rejected",
        "cancelled",
        "offered",
        "expired",
        "invalid_requests",
        "slo_met",
        "unsized_offered",
    ] {
        assert!(h.counters.contains_key(c), "counter {c} missing: {live}");
    }
    assert_eq!(h.counters.get("served"), Some(&5), "{live}");
    assert!(h.demand_risk.is_none());
    assert_eq!(
        serde_json::to_value(&h).expect("serialise"),
        live,
        "round trip"
    );
    let saved = handoff_file_where(&f.state_path("router-a"), Duration::from_secs(10), |h| {
        h.counters.get("served") == Some(&5)
            && h.lifecycle
                .records
                .iter()
                .any(|r| r.iid == "d0" && r.old_process_start.is_some())
    })
    .await;
    let old_start = saved.lifecycle.records[0].old_process_start;
    // kill -9: no graceful shutdown, no final write.
    a.proc.kill();
    let b = f.start_router("router-b", &["--resume"]);
    let st = b.state().await;
    assert_eq!(st.served, 5, "totals restored: {st:#?}");
    assert_eq!(st.offered, 5, "{st:#?}");
    assert!(!st.ha.resume.refused, "{st:#?}");
    let lc = b.lifecycle().await;
    let d0 = &lc.engines.of("d0");
    assert_eq!(d0.state, DrainState::Drained, "the hold survives: {lc:#?}");
    assert!(!d0.accepts_new, "{lc:#?}");
    assert_eq!(d0.old_process_start, old_start, "{lc:#?}");
    assert_eq!(
        d0.resident.decode, 0,
        "resident tracking starts fresh: {lc:#?}"
    );
    let m = b.metrics().await;
    assert_eq!(
        metric(&m, "narwhal_served_total", &[]),
        Some(5.0),
        "metrics continue from the restored totals: {m}"
    );
    // The restored hold is a real hold: readmission needs the restart, then succeeds.
    let readmit_d0 = ReadmitBody::engine("d0");
    let (s, doc) = b.readmit(&readmit_d0).await;
    assert_eq!(s, 409, "{doc:#?}");
    f.sim_mut("d0").restart(&[]).expect("restart d0");
    let (s, doc) = b.readmit(&readmit_d0).await;
    assert_eq!(s, 200, "{doc:#?}");
    serve_some(&b, 2).await;
    let st = b.state().await;
    assert_eq!(st.served, 7, "{st:#?}");
}

/// A torn file, a document with a bad field and a document for another fleet are each refused
/// with a reason naming what is wrong; the file is moved aside (never overwritten), and with
/// an agent on every engine the router holds the fleet in a restart-required wave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_refuses_torn_invalid_and_foreign_documents() {
    let f = fleet().await;
    let a = f.start_router("router-a", &[]);
    serve_some(&a, 1).await;
    let good = a.handoff().await;
    drop(a);
    let text = serde_json::to_string(&good).expect("json");
    let h = Handoff::from_value(good.clone()).expect("the live handoff validates");
    // A negative epoch has no typed form: the document itself, with that one field replaced.
    let mut bad_epoch = good.clone();
    merge(&mut bad_epoch, json!({"epoch": -1}));
    let foreign = Handoff {
        engines: vec!["e0".into(), "e9".into()],
        roles: BTreeMap::new(),
        lifecycle: LifecycleState {
            process_starts: BTreeMap::new(),
            ..h.lifecycle.clone()
        },
        ..h.clone()
    };
    let other_model = Handoff {
        model: "another-model".into(),
        ..h.clone()
    };
    let json = |h: &Handoff| serde_json::to_string(h).expect("json");
    let cases: [(&str, String, &str); 4] = [
        ("torn", text[..text.len() / 2].to_string(), "not JSON"),
        ("bad field", bad_epoch.to_string(), "epoch"),
        ("foreign fleet", json(&foreign), "handoff names"),
        ("foreign model", json(&other_model), "model"),
    ];
    for (i, (name, content, want)) in cases.into_iter().enumerate() {
        let label = format!("router-{i}");
        std::fs::write(f.state_path(&label), &content).expect("write state file");
        let r = f.start_router(&label, &["--resume"]);
        let st = r.state().await;
        let reason = &st.ha.resume.reason;
        assert!(st.ha.resume.refused, "{name}: {st:#?}");
        assert!(
            reason.contains(want),
            "{name}: reason {reason:?} lacks {want:?}"
        );
        assert_eq!(st.served, 0, "{name}: nothing applied: {st:#?}");
        let aside = f.dir().join("state.json.refused");
        assert_eq!(
            std::fs::read_to_string(&aside).expect("refused file kept"),
            content,
            "{name}: the refused file is kept intact"
        );
        let (status, body) = r.ready().await;
        assert_eq!(status, 503, "{name}");
        assert!(
            body.reason
                .starts_with("whole-wave restart required: handoff rejected:"),
            "{name}: {body:?}"
        );
        let lc = r.lifecycle().await;
        assert_eq!(
            lc.engines.of("p0").state,
            DrainState::Blocked,
            "{name}: {lc:#?}"
        );
        assert!(lc.wave.active, "{name}: {lc:#?}");
        std::fs::remove_file(&aside).ok();
    }
}

/// A record that was `validating` when the router died comes back `blocked` with the
/// reference's error, out of placement, and can be readmitted without a new drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_validation_is_restored_as_blocked() {
    let f = fleet().await;
    let a = f.start_router("router-a", &[]);
    let mut doc = Handoff::from_value(a.handoff().await).expect("the live handoff validates");
    drop(a);
    doc.lifecycle.records = vec![DrainRecord {
        iid: "d0".into(),
        state: DrainState::Validating,
        requested_at: 1.0e9,
        deadline_at: 1.0e9,
        restart_required: true,
        wave_id: String::new(),
        old_process_start: Some(1.0),
        new_process_start: None,
        error: String::new(),
        checks: vec![],
    }];
    let text = serde_json::to_string(&doc).expect("json");
    std::fs::write(f.state_path("router-b"), text).expect("write");
    let b = f.start_router("router-b", &["--resume"]);
    let lc = b.lifecycle().await;
    let d0 = &lc.engines.of("d0");
    assert_eq!(d0.state, DrainState::Blocked, "{lc:#?}");
    assert_eq!(
        d0.error,
        "readmission validation was interrupted by router replacement"
    );
    assert!(!d0.accepts_new);
    // The running d0 started after `old_process_start` (1.0): readmission passes.
    let (s, doc) = b.readmit_engine("d0").await;
    assert_eq!(s, 200, "{doc:?}");
    assert_eq!(
        doc.document.engine("d0").map(|e| e.state),
        Some(DrainState::Active)
    );
}

/// The state file's directory is made once, at start: one removed under a running router is
/// not made again by a later write (nothing is left behind where an operator or a test removed
/// it); each failed write is counted and the router keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_directory_removed_under_the_router_is_counted_never_made_again() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let state_dir = scratch.path().join("state");
    let f = Fleet::builder()
        .prefill(1)
        .decode(1)
        .fleet(json!({"recovery": {"state_path": state_dir.join("state.json")}}))
        .start()
        .await;
    let r = f.router();
    assert!(state_dir.is_dir(), "made at start");
    serve_some(r, 1).await;
    std::fs::remove_dir_all(&state_dir).expect("remove the state directory");
    let failing = narwhal_testkit::wait_until(Duration::from_secs(30), || async {
        serve_some(r, 1).await;
        let m = r.metrics().await;
        (metric(&m, "narwhal_state_write_failures_total", &[]).unwrap_or(0.0) >= 2.0).then_some(())
    })
    .await;
    assert!(failing.is_some(), "no failed state write was counted");
    assert!(
        !state_dir.exists(),
        "a write made the removed directory again"
    );
    serve_some(r, 2).await;
}
