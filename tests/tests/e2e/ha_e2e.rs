//! End-to-end tests of high availability (docs/ha.md): a primary and a warm standby
//! (`--standby-of`) sharing one lease (`file` or `etcd` backend, and for the `kill -9` and
//! `SIGSTOP` takeovers also `kubernetes`, a Lease on a real kube-apiserver), real agents with
//! mutual TLS and real simulators.
//!
//! Covered, each for both lease backends unless noted:
//! - `kill -9` of the primary during a whole-fleet wave: the standby takes over within the
//!   lease TTL plus N polls, shows the same wave, and readmits it (control listener on mTLS);
//! - `SIGSTOP` of the primary past its lease, then `SIGCONT`: it fences itself, becomes a standby
//!   naming the new primary, refuses lifecycle actions, the agents refuse its epoch, and at no
//!   sampled moment (about 20 Hz) do both routers report `controls_fleet: active`;
//! - a standby that cannot reach the primary over HTTP while the primary keeps renewing its lease
//!   never takes over; it follows the handoff the primary publishes beside its lease record, and
//!   takes over from it once the primary died (ha-and-fencing.md: the fleet is never left without a
//!   controller; the reference, behaviour.md 12 item 7a, stayed out with a stale polled copy);
//! - a retained handoff older than the lease (a third router held epoch N+1 and published nothing)
//!   is refused without claiming, so retrying never churns the epoch (behaviour.md 12 item 7b; file
//!   backend);
//! - a fenced primary takes the fleet back after the router that replaced it died only with
//!   that router's newest published state, never its own stale one (file backend);
//! - a primary fenced by a stalled etcd returns by itself when etcd answers again (etcd);
//! - a foreign lease record fences the primary within a renew interval and stops its state
//!   file writes (behaviour.md 12 item 8; file backend);
//! - a standby whose wall clock runs 10 s ahead (libfaketime) keeps shadowing a primary that
//!   renews, and still takes over within the TTL plus 1 s after `kill -9` (lease-clock-skew;
//!   ha-and-fencing.md 2.4). Debian's `faketime` is required: without it this test FAILS;
//! - a `demand_risk` event survives a takeover with its age re-anchored (file backend: the
//!   re-anchoring does not depend on the backend);
//! - the takeover gap (primary killed → standby `/ready` 200), median of 3 runs per backend,
//!   printed (`--nocapture`).
//!
//! etcd: the `etcd` binary (Debian `etcd-server`; override with `NARWHAL_ETCD_BIN`) is
//! required. Without it the etcd tests FAIL with a message saying so. The kubernetes variants
//! need kube-apiserver (`narwhal_testkit::k8s`, built once per machine when missing).
// Tests measure wall time (deadlines, takeover gaps): the clock ban of clippy.toml is for
// product code.
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use narwhal_shared::agent_protocol::ErrorBody;
use narwhal_shared::documents::lifecycle::ControllerRef;
use narwhal_shared::documents::requests::{DrainBody, ReadmitBody};
use narwhal_shared::documents::state;
use narwhal_shared::handoff::{DrainState, Handoff};
use narwhal_testkit::{
    ById, Fleet, FleetBuilder, Http, LEASE_TTL_S, LeaseBackend, Proxy, RouterHandle,
    STANDBY_PROBE_S, STANDBY_TAKEOVER_AFTER, Sample, Sampler, handoff_file_where, metric,
    wait_until,
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

/// Lease TTL of every test (renewal every 0.5 s, safety margin 0.5 s), seconds.
const TTL_S: f64 = LEASE_TTL_S;
/// Standby poll interval (`--standby-probe-interval`), seconds.
const PROBE_S: f64 = STANDBY_PROBE_S;
/// Missed polls before a takeover attempt (`--standby-takeover-after`).
const TAKEOVER_AFTER: u32 = STANDBY_TAKEOVER_AFTER;
/// Allowance for process scheduling on a loaded 2-core machine, identity checks through the
/// agents and our own polling, on top of TTL + N polls.
const SLACK_S: f64 = 3.0;

/// The bound a takeover must meet: lease TTL plus N polls plus slack.
fn takeover_bound() -> Duration {
    Duration::from_secs_f64(TTL_S + f64::from(TAKEOVER_AFTER) * PROBE_S + SLACK_S)
}

// ---------------------------------------------------------------------------------------------
// The fleet: p0 (prefill) and d0 (decode), one agent each, one shared lease (`file` or `etcd`);
// the test's client presents the operator certificate (accepted by mutual-TLS control
// listeners, and by the agents for reads only).

/// Two tests running `$scenario` with a file lease and with an etcd lease, and a third with a
/// Kubernetes Lease on a real kube-apiserver when named.
macro_rules! per_backend {
    ($scenario:ident: $file:ident, $etcd:ident, $kube:ident) => {
        per_backend!($scenario: $file, $etcd);

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $kube() {
            $scenario(LeaseBackend::Kubernetes).await;
        }
    };
    ($scenario:ident: $file:ident, $etcd:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $file() {
            $scenario(LeaseBackend::File).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $etcd() {
            $scenario(LeaseBackend::Etcd).await;
        }
    };
}

fn ha(backend: LeaseBackend) -> FleetBuilder {
    Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .lease(backend)
}

/// The builder's primary and standby, out of the fleet (so the test can kill them).
fn pair(f: &mut Fleet) -> (RouterHandle, RouterHandle) {
    let p = f.router.take().expect("primary");
    let s = f.standby.take().expect("standby");
    (p, s)
}

fn epoch_of(ha: &state::Ha) -> u64 {
    ha.epoch
}

fn holder_of(ha: &state::Ha) -> String {
    ha.holder.clone()
}

/// `(epoch, holder)` of router `r`'s lease.
async fn lease_of(r: &RouterHandle) -> (u64, String) {
    let ha = r.ha().await;
    (epoch_of(&ha), holder_of(&ha))
}

/// Posts an attestation request to agent `agent` for `iid` with `(epoch, holder)`, as a
/// router would; `(status, body)`.
async fn agent_attest(f: &Fleet, agent: &str, iid: &str, epoch: u64, holder: &str) -> (u16, Value) {
    // Fenced agent calls need a router identity (docs/security.md, "Identities"); the fleet's
    // client presents the operator certificate, which may only read agents.
    let router = Http::with_identity(f.certs(), "router", Duration::from_secs(30));
    let url = format!("{}/v1/engines/{iid}/attestation", f.agent(agent).url);
    let body = json!({"nonce": "ha-e2e-stale", "epoch": epoch, "holder": holder});
    router.post(url, &body).await.status_json()
}

/// The handoff document router `r` serves (`GET /narwhal/handoff`), parsed and validated.
///
/// # Panics
/// When it is not a valid handoff document.
async fn handoff_of(r: &RouterHandle) -> Handoff {
    let doc = r.handoff().await;
    Handoff::from_value(doc.clone()).unwrap_or_else(|e| panic!("not a handoff ({e}): {doc:#}"))
}

/// `served` of router `r`'s `/narwhal/state`, which must answer the state document.
async fn served_of(r: &RouterHandle) -> u64 {
    let st = r.state().await;
    assert!(
        st.is_state(),
        "{}: not a state document: {st:?}",
        r.proc.label
    );
    st.served
}

/// The `narwhal.router-lease` record of a file lease, the fields read here (the lease crate's
/// `LeaseRecord`, which the kit does not depend on).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
struct LeaseRecord {
    /// Fencing epoch.
    epoch: u64,
    /// Holder token.
    holder: String,
}

/// The fleet's file lease record, typed (`None` for etcd, or before the first write).
fn lease_record(f: &Fleet) -> Option<LeaseRecord> {
    let v = f.lease_file()?;
    Some(
        serde_json::from_value(v.clone())
            .unwrap_or_else(|e| panic!("not a lease record: {e}: {v}")),
    )
}

/// A lease record another router (`holder`) wrote for `epoch`, valid for `valid_s` seconds.
fn foreign_lease(epoch: u64, holder: &str, valid_s: f64) -> Value {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("wall clock")
        .as_secs_f64();
    json!({"epoch": epoch, "expires_at": now + valid_s, "holder": holder,
           "schema": "narwhal.router-lease", "schema_version": 1, "updated_at": now})
}

/// A fenced router refuses lifecycle actions with 503.
async fn assert_lifecycle_refused(r: &RouterHandle) {
    let (status, doc) = r.drain(&DrainBody::engine("d0", 30.0)).await;
    assert_eq!(status, 503, "{doc:#?}");
}

// ---------------------------------------------------------------------------------------------
// kill -9 of the primary during a whole-fleet wave

async fn kill_during_wave(backend: LeaseBackend) {
    let mut f = ha(backend)
        .control_tls()
        .restart_policy("whole_wave")
        .standby()
        .start()
        .await;
    let (mut p, s) = pair(&mut f);
    assert!(p.control.starts_with("https://"), "{}", p.control);
    let (epoch, holder) = lease_of(&p).await;
    assert!(epoch >= 1, "{:?}", p.ha().await);

    let (status, doc) = p.drain(&DrainBody::wave(60.0)).await;
    assert_eq!(status, 200, "{doc:#?}");
    let wave_id = doc.document.wave.id.clone();
    // Both engines idle: the wave becomes ready to stop; the standby retains that document
    // (polling a primary whose /ready is 503 for the wave but control_ready).
    let retained = f
        .wait_retained("standby", epoch, &holder, |h| {
            h.lifecycle.records.len() == 2
                && h.lifecycle
                    .records
                    .iter()
                    .all(|r| r.state == DrainState::Drained)
        })
        .await;
    let old_starts: Vec<(String, Option<f64>)> = retained
        .lifecycle
        .records
        .iter()
        .map(|r| (r.iid.clone(), r.old_process_start))
        .collect();
    assert!(
        old_starts.iter().all(|(_, s)| s.is_some()),
        "{old_starts:?}"
    );
    let before = p.lifecycle().await;
    assert!(before.wave.ready_to_stop, "{before:#?}");
    assert_eq!(s.controls().await.as_deref(), Some("standby"));

    let t_kill = Instant::now();
    p.proc.kill();
    // Takeover = the standby controls the fleet (its /ready stays 503 for the wave hold).
    let took = wait_until(takeover_bound() + Duration::from_secs(5), || async {
        (s.controls().await.as_deref() == Some("active")).then(|| t_kill.elapsed())
    })
    .await
    .unwrap_or_else(|| panic!("no takeover:\n{}", s.proc.stderr_tail(30)));
    eprintln!("[ha_e2e] {backend:?}: takeover during a wave after {took:?}");
    assert!(
        took <= takeover_bound(),
        "{backend:?}: takeover took {took:?}, bound {:?}",
        takeover_bound()
    );
    let sha = s.ha().await;
    assert_eq!(epoch_of(&sha), epoch + 1, "claimed epoch+1: {sha:?}");
    assert_ne!(holder_of(&sha), holder);
    if let Some(rec) = lease_record(&f) {
        assert_eq!(rec.holder, sha.holder.as_str(), "{rec:?}");
        assert_eq!(rec.epoch, epoch + 1, "{rec:?}");
    }

    // Same wave state on the new primary.
    let after = s.lifecycle().await;
    assert_eq!(after.router.controls_fleet, "active", "{after:#?}");
    assert_eq!(after.wave.id, wave_id, "{after:#?}");
    assert!(after.wave.active, "{after:#?}");
    assert!(after.wave.ready_to_stop, "{after:#?}");
    for (iid, start) in &old_starts {
        let e = &after.engines[iid];
        assert_eq!(e.state, DrainState::Drained, "{iid}: {after:#?}");
        assert!(!e.accepts_new, "{iid}");
        assert_eq!(e.wave_id, wave_id, "{iid}");
        assert_eq!(e.old_process_start, *start, "{iid}");
    }
    let ready = s.not_ready().await;
    assert_eq!(
        ready.reason,
        format!("whole-wave drain {wave_id}"),
        "{ready:?}"
    );
    assert!(ready.control_ready, "{ready:?}");

    // The supervisor restarts the fleet; readmission completes through the new primary.
    for sim in &mut f.sims {
        sim.restart(&[]).expect("restart simulator");
    }
    let (status, doc) = s.readmit(&ReadmitBody::wave()).await;
    assert_eq!(status, 200, "{doc:#?}");
    let doc = doc.document;
    assert!(!doc.wave.active, "{doc:#?}");
    for (iid, start) in &old_starts {
        let e = &doc.engines[iid];
        assert_eq!(e.state, DrainState::Active, "{iid}: {doc:#?}");
        assert!(e.new_process_start > *start, "{iid}: newer start: {doc:#?}");
    }
    let (status, ready) = s.ready().await;
    assert_eq!(status, 200, "{ready:?}");
    assert_eq!(s.completion("after the wave", 3).await.status, 200);
}

per_backend!(
    kill_during_wave:
    kill_9_during_whole_wave_file_lease,
    kill_9_during_whole_wave_etcd_lease,
    kill_9_during_whole_wave_kubernetes_lease
);

// ---------------------------------------------------------------------------------------------
// SIGSTOP past the lease, then SIGCONT

/// `controls_fleet` of the old and the new primary at one moment.
type Pair = (Option<String>, Option<String>);

/// Samples both routers' `controls_fleet` at about 20 Hz: the old router first, then the
/// new one, so a pair's new answer is never older than its old answer. (Asked concurrently,
/// a request held by the paused old router was answered "standby" after its SIGCONT and
/// paired with the new router's "standby" of before its takeover, under load: a pair that
/// never existed at any one instant.)
fn sampler(p: &RouterHandle, s: &RouterHandle) -> Sampler<Pair> {
    let (old, new) = (p.probe(), s.probe());
    Sampler::start(Duration::from_millis(50), move || {
        let (old, new) = (old.clone(), new.clone());
        async move {
            let o = old.controls().await;
            (o, new.controls().await)
        }
    })
}

/// The pair reads `(old, new)`.
fn is(pair: &Pair, old: &str, new: &str) -> bool {
    pair.0.as_deref() == Some(old) && pair.1.as_deref() == Some(new)
}

async fn sigstop_then_sigcont(backend: LeaseBackend) {
    let mut f = ha(backend).control_tls().standby().start().await;
    let (p, s) = pair(&mut f);
    let (epoch, holder) = lease_of(&p).await;
    // The agents know the primary's epoch (its startup identity check is fenced).
    let (status, body) = agent_attest(&f, "h0", "p0", epoch, &holder).await;
    assert_eq!(
        status, 200,
        "the primary's epoch is accepted before: {body}"
    );
    f.wait_retained("standby", epoch, &holder, |_| true).await;

    let sampling = sampler(&p, &s);
    let before = wait_until(Duration::from_secs(5), || async {
        (sampling.count(|x| is(x, "active", "standby")) >= 5).then_some(())
    })
    .await;
    assert!(before.is_some(), "sampled the healthy pair first");
    f.pause_outside_the_lease_lock(&p).await;
    let t_stop = Instant::now();
    let gap = s
        .wait_ready(t_stop, takeover_bound() + Duration::from_secs(5))
        .await
        .unwrap_or_else(|| panic!("no takeover:\n{}", s.proc.stderr_tail(30)));
    assert!(
        gap <= takeover_bound(),
        "{backend:?}: takeover took {gap:?} after SIGSTOP"
    );
    let stopped_for = t_stop.elapsed();
    assert!(
        stopped_for.as_secs_f64() > TTL_S - 0.5,
        "the standby never takes over inside the primary's lease: {stopped_for:?}"
    );
    let sha = s.ha().await;
    let new_epoch = epoch_of(&sha);
    assert_eq!(new_epoch, epoch + 1, "{sha:?}");
    p.proc.signal(Signal::SIGCONT);

    // The old primary notices at once: it no longer controls the fleet, and as it sees the
    // new primary's live lease it is a standby naming it; /ready 503, lifecycle 503.
    p.wait_controls("standby", Duration::from_secs(5)).await;
    let (status, health) = p.health().await;
    assert_eq!(status, 200, "{health:?}");
    assert_eq!(health.status, "standby", "{health:?}");
    let ready = p.not_ready().await;
    assert_eq!(ready.reason, "shadowing", "{ready:?}");
    assert!(!ready.control_ready, "{ready:?}");
    let (new_holder, old_doc) = (holder_of(&sha), p.lifecycle().await);
    assert_eq!(
        old_doc.router.controller,
        Some(ControllerRef {
            holder: new_holder,
            epoch: new_epoch
        }),
        "{old_doc:#?}"
    );
    for (action, body) in [
        ("drain", json!(DrainBody::engine("d0", 30.0))),
        ("readmit", json!(ReadmitBody::engine("d0"))),
    ] {
        let (status, doc) = p.lifecycle_post(action, &body).await;
        assert_eq!(status, 503, "{action}: {doc:#?}");
        assert_eq!(
            doc.document.error, "this router does not control the fleet",
            "{action}: {doc:#?}"
        );
    }
    assert_eq!(
        p.completion("fenced", 2).await.status,
        503,
        "a fenced router places nothing"
    );
    // The new primary serves; the agents have learnt its epoch and refuse the old one.
    assert_eq!(s.completion("new primary", 2).await.status, 200);
    for (agent, iid) in [("h0", "p0"), ("h1", "d0")] {
        let (status, body) = agent_attest(&f, agent, iid, epoch, &holder).await;
        assert_eq!(status, 409, "{iid}: old epoch refused: {body}");
        let refusal: ErrorBody = serde_json::from_value(body.clone())
            .unwrap_or_else(|e| panic!("{iid}: not an agent error ({e}): {body}"));
        assert_eq!(refusal.error.code, "stale_epoch", "{body}");
        assert_eq!(refusal.error.highest_epoch, Some(new_epoch), "{body}");
    }
    // Keep sampling while the old primary waits as a standby: it must not win. (Two seconds:
    // the takeover no longer waits for missed polls, so the run is shorter than it was, and
    // the samples stopped on the paused primary's timeouts still have to add up to ~20 Hz.)
    let changed = wait_until(Duration::from_secs(2), || async {
        let (old, new) = tokio::join!(p.controls(), s.controls());
        (old.as_deref() != Some("standby") || new.as_deref() != Some("active"))
            .then_some((old, new))
    })
    .await;
    assert_eq!(
        changed, None,
        "the old primary stays a standby, the new one active"
    );
    let samples: Vec<Sample<Pair>> = sampling.stop().await;
    let count = |old: &str, new: &str| samples.iter().filter(|x| is(&x.value, old, new)).count();
    let old_active_new_standby = count("active", "standby");
    let old_fenced_new_active = count("fenced", "active") + count("standby", "active");

    let both: Vec<&Sample<Pair>> = samples
        .iter()
        .filter(|x| is(&x.value, "active", "active"))
        .collect();
    assert!(both.is_empty(), "both routers active at {both:?}");
    let answered_both = samples
        .iter()
        .filter(|x| x.value.0.is_some() && x.value.1.is_some())
        .count();
    eprintln!(
        "[ha_e2e] {backend:?}: {} samples over {:?}, {answered_both} with both answering, \
         {old_active_new_standby} before, {old_fenced_new_active} after the takeover",
        samples.len(),
        samples.last().map(|x| x.at)
    );
    assert!(samples.len() >= 40, "sampled at ~20 Hz: {}", samples.len());
    assert!(old_active_new_standby >= 5, "{samples:?}");
    assert!(old_fenced_new_active >= 10, "{samples:?}");
    // The new primary is never fenced; the old one is a standby only once the new one took
    // over.
    let took = samples
        .iter()
        .position(|x| x.value.1.as_deref() == Some("active"))
        .expect("sampled the takeover");
    assert!(
        !samples
            .iter()
            .any(|x| x.value.1.as_deref() == Some("fenced"))
            && !samples[..took]
                .iter()
                .any(|x| x.value.0.as_deref() == Some("standby")),
        "unexpected states: {samples:?}"
    );
}

per_backend!(
    sigstop_then_sigcont:
    sigstop_past_the_lease_then_sigcont_file_lease,
    sigstop_past_the_lease_then_sigcont_etcd_lease,
    sigstop_past_the_lease_then_sigcont_kubernetes_lease
);

/// After a takeover, the fenced old primary (started without `--standby-of`) waits as a standby of
/// the new one. When the new primary dies too, the old one takes the fleet back (a standby always
/// ends up controlling the fleet), but never with its stale state (counters, lifecycle holds from
/// before the takeover): with the new primary's newest published state, so the engine it drained
/// stays held and its totals are kept. Before the handoff was published beside the lease it stayed
/// out for good ("stale state"), leaving the fleet without a controller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_primary_takes_the_fleet_back_only_with_the_newest_state() {
    let mut f = ha(LeaseBackend::File).standby().start().await;
    let (p, mut s) = pair(&mut f);
    let (epoch, holder) = lease_of(&p).await;
    f.wait_retained("standby", epoch, &holder, |_| true).await;
    f.pause_outside_the_lease_lock(&p).await;
    s.wait_ready(Instant::now(), takeover_bound() + Duration::from_secs(5))
        .await
        .expect("takeover");
    p.proc.signal(Signal::SIGCONT);
    p.wait_controls("standby", Duration::from_secs(5)).await;
    // The new primary changes the fleet's state: traffic, and d0 drained for a restart.
    for i in 0..2 {
        assert_eq!(s.completion(&format!("new {i}"), 2).await.status, 200);
    }
    let (status, doc) = s.drain(&DrainBody::engine("d0", 60.0)).await;
    assert_eq!(status, 200, "{doc:#?}");
    let shown = served_of(&s).await;
    assert!(shown >= 2, "{shown}");
    s.proc.kill();
    let t_kill = Instant::now();
    let retook = wait_until(takeover_bound() + Duration::from_secs(3), || async {
        (p.controls().await.as_deref() == Some("active")).then(|| t_kill.elapsed())
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "the fleet was left without a controller:\n{}",
            p.proc.stderr_tail(30)
        )
    });
    eprintln!("[ha_e2e] File: the old primary took the fleet back {retook:?} after the kill");
    let lc = p.lifecycle().await;
    let served = served_of(&p).await;
    assert!(
        served >= shown,
        "served {} after the takeover, {shown} shown by the new primary",
        served
    );
    let d0 = &lc.engines.of("d0");
    assert!(
        d0.state == DrainState::Draining || d0.state == DrainState::Drained,
        "d0 stays held out of placement: {lc:#?}"
    );
    assert!(!d0.accepts_new, "{lc:#?}");
    if let Some(rec) = lease_record(&f) {
        assert_eq!(rec.epoch, epoch + 2, "one claim, no churn: {rec:?}");
    }
}

/// A lease store that stops answering fences the primary at once (no standby involved);
/// when the store answers again, the primary (which still has the fleet's newest state, as
/// nobody else held the lease) returns by itself instead of staying dead (architecture.md 9.6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_fenced_by_a_stalled_etcd_returns_when_etcd_does() {
    let f = ha(LeaseBackend::Etcd).start().await;
    let p = f.router();
    let epoch = epoch_of(&p.ha().await);
    f.etcd().signal(Signal::SIGSTOP);
    let fenced = wait_until(Duration::from_secs(10), || async {
        (p.controls().await.as_deref() == Some("fenced")).then_some(())
    })
    .await;
    f.etcd().signal(Signal::SIGCONT);
    assert!(fenced.is_some(), "{}", p.proc.stderr_tail(20));
    let ready = p.not_ready().await;
    assert_lifecycle_refused(p).await;
    p.wait_controls("active", Duration::from_secs(15)).await;
    p.wait_ready(Instant::now(), Duration::from_secs(5))
        .await
        .unwrap_or_else(|| panic!("not ready again:\n{}", p.proc.stderr_tail(20)));
    let back = epoch_of(&p.ha().await);
    eprintln!(
        "[ha_e2e] Etcd: fenced by a stalled etcd ({}), back at epoch {back} (was {epoch})",
        ready.reason
    );
    assert!(
        back == epoch || back == epoch + 1,
        "epoch {epoch} -> {back}"
    );
    assert_eq!(p.completion("back", 2).await.status, 200);
}

/// behaviour.md 12 item 7b: the primary dies, a third router held the lease at epoch N+1
/// and vanished too. The standby's copy (epoch N) is not the fleet's newest state: it must not
/// apply it, must say why, and (as it keeps retrying, architecture.md 9.6) must not churn the
/// epoch by claiming and releasing over and over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_refuses_a_handoff_older_than_the_lease_and_does_not_churn_the_epoch() {
    let mut f = ha(LeaseBackend::File).standby().start().await;
    let (mut p, s) = pair(&mut f);
    let (epoch, holder) = lease_of(&p).await;
    f.wait_retained("standby", epoch, &holder, |_| true).await;
    p.proc.kill();
    // A third router claims epoch N+1 (written as the file backend does: temp file, rename).
    f.write_lease_file(&foreign_lease(epoch + 1, "third:0", 0.5));
    let why = wait_until(takeover_bound() + Duration::from_secs(3), || async {
        let r = s.ready().await.1.reason;
        r.contains("cannot precede").then_some(r)
    })
    .await;
    let (_, ready) = s.ready().await;
    assert!(
        why.is_some(),
        "no refusal: {ready:?}\n{}",
        s.proc.stderr_tail(20)
    );
    eprintln!(
        "[ha_e2e] File: stale handoff refused: {}",
        why.unwrap_or_default()
    );
    let first = lease_record(&f).expect("lease record");
    // Several more takeover attempts' worth of time.
    let churn = wait_until(Duration::from_secs(2), || async {
        let rec = lease_record(&f)?;
        (rec.epoch != first.epoch || s.controls().await.as_deref() == Some("active")).then_some(rec)
    })
    .await;
    assert_eq!(churn, None, "the epoch moved on from {first:?}");
    assert!(first.epoch <= epoch + 2, "{first:?}");
    assert_eq!(s.ready().await.0, 503);
}

/// behaviour.md 12 item 8: another holder overwrites the lease record while the primary runs.
/// Within about one renew interval the primary is fenced and, as the record names a live holder, a
/// standby naming it (`/health` `standby`, `/ready` 503, completions 503, lifecycle 503), and its
/// state file stops changing: a router that does not control the fleet never overwrites the fleet's
/// state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_lease_record_fences_the_primary_and_stops_its_state_writes() {
    let f = ha(LeaseBackend::File).start().await;
    let p = f.router();
    let epoch = epoch_of(&p.ha().await);
    let state = f.state_path("primary");
    let first = handoff_file_where(&state, Duration::from_secs(5), |_| true)
        .await
        .at;
    // While in control it rewrites it periodically (a new `at` each time).
    handoff_file_where(&state, Duration::from_secs(5), |h| h.at > first).await;
    f.write_lease_file(&foreign_lease(epoch + 1, "other:0", 60.0));
    let t0 = Instant::now();
    // Fenced at the next renewal, then a standby of the router whose lease it sees.
    p.wait_controls("standby", Duration::from_secs(3)).await;
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(1500), "fenced after {took:?}");
    let (_, health) = p.health().await;
    assert_eq!(health.status, "standby", "{health:?}");
    let ready = p.not_ready().await;
    assert_eq!(ready.reason, "shadowing", "{ready:?}");
    assert!(!ready.control_ready, "{ready:?}");
    let lc = p.lifecycle().await;
    assert_eq!(
        lc.router.controller,
        Some(ControllerRef {
            holder: "other:0".into(),
            epoch: epoch + 1
        }),
        "{lc:#?}"
    );
    assert_eq!(p.completion("fenced", 2).await.status, 503);
    assert_lifecycle_refused(p).await;
    // The writer runs every controller.monitor_interval_s (0.2 s) while in control: five
    // periods without a change show it stopped.
    let frozen = std::fs::read_to_string(&state).expect("state file");
    let changed = wait_until(Duration::from_secs(1), || async {
        let now = std::fs::read_to_string(&state).ok()?;
        (now != frozen).then_some(now)
    })
    .await;
    assert_eq!(changed, None, "a fenced router rewrote the state file");
    let rec = lease_record(&f).expect("lease");
    assert_eq!(
        rec.holder, "other:0",
        "the foreign record is left alone: {rec:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The primary's HTTP is unreachable while it keeps renewing: no takeover

async fn unreachable_primary_keeps_its_lease(backend: LeaseBackend) {
    let mut f = ha(backend).start().await;
    let p = f.router.take().expect("primary");
    let proxy = Proxy::start(&p.control).await;
    let s = f.standby_of("standby", &proxy.url, &["--standby-max-handoff-age", "3"]);
    let (epoch, holder) = lease_of(&p).await;
    f.wait_retained("standby", epoch, &holder, |_| true).await;
    let (_, ready) = s.ready().await;
    assert_eq!(ready.reason, "shadowing", "{ready:?}");

    proxy.cut();
    let t_cut = Instant::now();
    // Watch for longer than TTL + N polls and than the HTTP copy's maximum age: the standby
    // never claims while the primary renews, and stays a standby that follows the handoff
    // the primary publishes beside its lease record (ha-and-fencing.md), not a blocked one.
    let samples = AtomicUsize::new(0);
    let watched = wait_until(Duration::from_secs(10), || async {
        samples.fetch_add(1, Ordering::Relaxed);
        let sha = s.ha().await;
        let pha = p.ha().await;
        assert!(!sha.controls_fleet, "standby took over: {sha:?}");
        assert!(sha.standby, "{sha:?}");
        assert!(pha.controls_fleet, "primary lost control: {pha:?}");
        assert_eq!(epoch_of(&pha), epoch, "{pha:?}");
        assert_eq!(holder_of(&pha), holder, "{pha:?}");
        (t_cut.elapsed()
            > Duration::from_secs_f64(TTL_S + f64::from(TAKEOVER_AFTER) * PROBE_S + 4.0))
        .then_some(())
    })
    .await;
    assert!(watched.is_some());
    eprintln!(
        "[ha_e2e] {backend:?}: standby stayed standby for {:?} ({} checks)",
        t_cut.elapsed(),
        samples.load(Ordering::Relaxed)
    );
    let ready = s.not_ready().await;
    assert_eq!(ready.reason, "shadowing", "{ready:?}");
    let lc = s.lifecycle().await;
    assert_eq!(lc.router.controls_fleet, "standby", "{lc:#?}");
    assert_eq!(
        lc.router.controller,
        Some(ControllerRef {
            holder: holder.clone(),
            epoch
        }),
        "{lc:#?}"
    );
    assert_eq!(p.controls().await.as_deref(), Some("active"));
    if let Some(rec) = lease_record(&f) {
        assert_eq!(rec.holder, holder.as_str(), "not claimed: {rec:?}");
        assert_eq!(rec.epoch, epoch, "{rec:?}");
    }
    // The primary still serves.
    assert_eq!(p.completion("still here", 2).await.status, 200);
    let shown = served_of(&p).await;
    // The primary now dies. Its HTTP copy is older than --standby-max-handoff-age (the
    // reference stayed out then, behaviour.md 12 item 7a); its published handoff is
    // current, so the standby takes over with it.
    let mut p = p;
    p.proc.kill();
    let t_kill = Instant::now();
    let took = wait_until(takeover_bound(), || async {
        (s.controls().await.as_deref() == Some("active")).then(|| t_kill.elapsed())
    })
    .await
    .unwrap_or_else(|| panic!("no takeover:\n{}", s.proc.stderr_tail(30)));
    eprintln!("[ha_e2e] {backend:?}: took over from the published handoff after {took:?}");
    let sha = s.ha().await;
    assert_eq!(epoch_of(&sha), epoch + 1, "{sha:?}");
    let served = served_of(&s).await;
    assert!(
        served >= shown,
        "served {} after the takeover, {shown} shown before",
        served
    );
}

per_backend!(
    unreachable_primary_keeps_its_lease:
    unreachable_primary_that_renews_is_never_replaced_file_lease,
    unreachable_primary_that_renews_is_never_replaced_etcd_lease
);

// ---------------------------------------------------------------------------------------------
// A standby whose wall clock is 10 s ahead (lease-clock-skew)

/// How soon after `kill -9` a standby must control the fleet: the file lease's TTL plus 1 s
/// (its first sight of the last record is at most one probe after the write); etcd deletes a
/// lapsed record itself, up to its lease sweep (0.5 s) after the `ceil(ttl_s)` etcd lease ran
/// out, so half a second more.
fn skewed_takeover_bound(backend: LeaseBackend) -> Duration {
    let sweep = match backend {
        // Expiry by observation, as for the file lease.
        LeaseBackend::File | LeaseBackend::Kubernetes => 0.0,
        LeaseBackend::Etcd => TTL_S.ceil() - TTL_S + 0.5,
    };
    Duration::from_secs_f64(TTL_S + 1.0 + sweep)
}

/// lease-clock-skew: a warm standby on a host whose wall clock runs 10 s ahead (libfaketime on
/// the standby only; its monotonic clock untouched) keeps shadowing a primary that renews:
/// sampled for 5 s, the primary's `/ready` is 200 and it keeps its epoch and holder, the
/// standby's `/ready` is 503 `shadowing`, and the lease record stays the primary's. It used to
/// take epoch 2 within 0.1 s (the record's `expires_at`, written from the primary's clock,
/// judged against the standby's) and fence the healthy primary. After `kill -9` of the primary
/// it still takes over, within the TTL plus 1 s. Fails (never skips) without libfaketime.
async fn standby_with_its_wall_clock_ahead(backend: LeaseBackend) {
    let ahead = narwhal_testkit::faketime::wall_shifted(10);
    let mut f = ha(backend).start().await;
    let mut p = f.router.take().expect("primary");
    let (epoch, holder) = lease_of(&p).await;
    let s = f.standby_of_env("standby", &p.control, &[], &ahead);
    // The standby's wall clock is the shifted one: its own handoff document's `at`.
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("wall clock")
        .as_secs_f64();
    let at = handoff_of(&s).await.at;
    assert!(
        at > real + 8.0 && at < real + 12.0,
        "the standby's wall clock is not 10 s ahead: at {at}, real {real}"
    );

    let t0 = Instant::now();
    let mut seen = Vec::new();
    let mut wrong = Vec::new();
    while t0.elapsed() < Duration::from_secs(5) {
        let (p_status, p_ready) = p.ready().await;
        let (s_status, s_ready) = s.ready().await;
        let (pha, sha) = (p.ha().await, s.ha().await);
        let at = t0.elapsed();
        let primary_ok =
            p_status == 200 && pha.controls_fleet && pha.epoch == epoch && pha.holder == holder;
        // The standby's first look at the store is right after its start; allow it a second.
        let standby_ok =
            s_status == 503 && s_ready.reason == "shadowing" && !sha.controls_fleet && sha.standby;
        if !primary_ok || (!standby_ok && at > Duration::from_secs(1)) || sha.epoch != 0 {
            wrong.push(format!(
                "{at:?}: primary /ready {p_status} {p_ready:?} ha {pha:?}; standby /ready \
                 {s_status} {s_ready:?} ha {sha:?}"
            ));
        }
        seen.push(standby_ok);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        wrong.is_empty(),
        "{backend:?}: a standby 10 s ahead must keep shadowing a renewing primary; {} of {} \
         samples wrong, first: {:#?}\nstandby log:\n{}",
        wrong.len(),
        seen.len(),
        &wrong[..wrong.len().min(3)],
        s.proc.stderr_tail(20)
    );
    assert!(seen.len() >= 20, "sampled: {}", seen.len());
    if let Some(rec) = lease_record(&f) {
        assert_eq!(rec.holder, holder.as_str(), "not claimed: {rec:?}");
        assert_eq!(rec.epoch, epoch, "{rec:?}");
    }
    let lc = s.lifecycle().await;
    assert_eq!(
        lc.router.controller,
        Some(ControllerRef {
            holder: holder.clone(),
            epoch
        }),
        "{lc:#?}"
    );

    // The primary dies: the skewed standby takes over, one TTL after it first saw the
    // primary's last record.
    let t_kill = Instant::now();
    p.proc.kill();
    let bound = skewed_takeover_bound(backend);
    let took = wait_until(bound + Duration::from_secs(5), || async {
        (s.controls().await.as_deref() == Some("active")).then(|| t_kill.elapsed())
    })
    .await
    .unwrap_or_else(|| panic!("no takeover:\n{}", s.proc.stderr_tail(30)));
    eprintln!("[ha_e2e] {backend:?}: a standby 10 s ahead took over {took:?} after kill -9");
    assert!(
        took <= bound,
        "{backend:?}: takeover took {took:?}, bound {bound:?}"
    );
    let sha = s.ha().await;
    assert_eq!(epoch_of(&sha), epoch + 1, "{sha:?}");
    s.wait_ready(Instant::now(), Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("not ready after the takeover:\n{}", s.proc.stderr_tail(30)));
    assert_eq!(s.completion("after the takeover", 2).await.status, 200);
}

per_backend!(
    standby_with_its_wall_clock_ahead:
    a_standby_ten_seconds_ahead_keeps_shadowing_a_renewing_primary_file_lease,
    a_standby_ten_seconds_ahead_keeps_shadowing_a_renewing_primary_etcd_lease
);

// ---------------------------------------------------------------------------------------------
// demand_risk across a takeover

/// A fleet whose decode engine's next decode leg hangs 3 s past a 0.5 s first-token deadline,
/// so a completion records a `first_token_timeout` demand risk.
async fn slow_first_token(standby: bool) -> Fleet {
    let mut b = ha(LeaseBackend::File)
        .fleet(json!({"engine": {"first_token_timeout_s": 0.5, "kv_transfer_timeout_s": 0.1}}));
    if standby {
        b = b.standby();
    }
    let f = b.start().await;
    f.sim("d0")
        .fault(json!({"phase": "decode", "action": "hang", "ms": 3000, "count": 1}))
        .await;
    f
}

/// A decode leg that misses its first-token deadline on the primary records a
/// `first_token_timeout` risk; after `kill -9` the new primary reports the same kind and
/// counts, with an age that kept growing through the takeover: ≈ the age read on the old
/// primary plus the time elapsed since that read (not reset, not the gap added twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demand_risk_survives_a_takeover_with_its_age_reanchored() {
    let mut f = slow_first_token(true).await;
    let (mut p, s) = pair(&mut f);
    let _ = p.completion("slow first token", 2).await;
    let doc = handoff_of(&p).await;
    let t_read = Instant::now();
    let risk = doc.demand_risk.clone().expect("demand_risk");
    assert_eq!(risk.kind, "first_token_timeout", "{doc:#?}");
    let events = risk.events.clone();
    assert!(
        events.get("first_token_timeout").copied() >= Some(1),
        "{risk:?}"
    );
    let age0 = risk.age_s;
    let (epoch, holder) = lease_of(&p).await;
    f.wait_retained("standby", epoch, &holder, |h| h.demand_risk.is_some())
        .await;

    p.proc.kill();
    s.wait_controls("active", takeover_bound() + Duration::from_secs(5))
        .await;
    let doc = handoff_of(&s).await;
    let elapsed = t_read.elapsed().as_secs_f64();
    let risk = doc.demand_risk.as_ref().expect("demand_risk");
    assert_eq!(risk.kind, "first_token_timeout", "{doc:#?}");
    assert_eq!(risk.events, events, "counts carried, not doubled: {risk:?}");
    let age1 = risk.age_s;
    let want = age0 + elapsed;
    eprintln!("[ha_e2e] demand risk age {age0:.3} s before, {age1:.3} s after (want {want:.3})");
    assert!(
        (age1 - want).abs() < 0.5,
        "age after takeover {age1:.3} s, expected ≈ {want:.3} s (age {age0:.3} s + {elapsed:.3} s since)"
    );
}

/// A primary killed with `kill -9` and restarted with `--resume` inside its lease TTL (a
/// supervisor's quick restart, no standby): the new process cannot claim at once, waits as a
/// standby, and takes over when the old lease lapses, with the resumed state applied once
/// (demand-risk counts not doubled, served total kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_restarted_with_resume_inside_its_ttl_takes_over_once_the_lease_lapses() {
    let mut f = slow_first_token(false).await;
    let mut p = f.router.take().expect("primary");
    for i in 0..2 {
        let _ = p.completion(&format!("r {i}"), 2).await;
    }
    let before = handoff_of(&p).await;
    let events = before
        .demand_risk
        .as_ref()
        .map(|r| r.events.clone())
        .unwrap_or_default();
    assert!(
        events.get("first_token_timeout").copied() >= Some(1),
        "{before:#?}"
    );
    let served = before.counters.get("served").copied();
    handoff_file_where(&f.state_path("primary"), Duration::from_secs(5), |h| {
        h.demand_risk.is_some() && h.counters.get("served").copied() == served
    })
    .await;
    p.proc.kill();
    // Same label: same fleet file and state file.
    let p2 = f.start_router("primary", &["--router-id", "primary", "--resume"]);
    p2.wait_controls("active", takeover_bound() + Duration::from_secs(3))
        .await;
    let after = handoff_of(&p2).await;
    assert_eq!(after.counters.get("served").copied(), served, "{after:#?}");
    assert_eq!(
        after.demand_risk.as_ref().map(|r| &r.events),
        Some(&events),
        "applied once, not once at startup and again at the claim: {after:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Takeover gap: primary killed → standby /ready 200

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

async fn takeover_gap(backend: LeaseBackend) {
    const RUNS: usize = 3;
    let f = ha(backend).no_router().start().await;
    // Run k: the current primary is killed and standby k takes over; it is the next primary.
    let mut current = f.primary("router-0").await;
    let mut gaps = Vec::new();
    for k in 1..=RUNS {
        let label = format!("router-{k}");
        let s = f.standby_of(&label, &current.control, &[]);
        let (epoch, holder) = lease_of(&current).await;
        f.wait_retained(&label, epoch, &holder, |_| true).await;
        let t_kill = Instant::now();
        current.proc.kill();
        let gap = s
            .wait_ready(t_kill, takeover_bound() + Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("run {k}: no takeover:\n{}", s.proc.stderr_tail(30)));
        let gap_s = gap.as_secs_f64();
        assert!(
            gap <= takeover_bound(),
            "{backend:?} run {k}: gap {gap_s:.3} s over the bound {:?}",
            takeover_bound()
        );
        let sha = s.ha().await;
        assert_eq!(epoch_of(&sha), epoch + 1, "run {k}: {sha:?}");
        let m = s.metrics().await;
        let reported = metric(&m, "narwhal_standby_takeover_gap_seconds", &[])
            .unwrap_or_else(|| panic!("no takeover gap metric:\n{m}"));
        // The router measures from its last good poll, which precedes the kill.
        assert!(
            reported > 0.0 && reported <= gap_s + 2.0 * PROBE_S + 0.5,
            "run {k}: metric {reported} vs measured {gap_s}"
        );
        eprintln!(
            "[ha_e2e] {backend:?} run {k}: takeover gap {gap_s:.3} s (router metric {reported:.3} s)"
        );
        gaps.push(gap_s);
        current = s;
    }
    let med = median(&mut gaps);
    eprintln!(
        "[ha_e2e] {backend:?} lease: takeover gap median {med:.3} s over {RUNS} runs ({gaps:?}); \
         TTL {TTL_S} s, {TAKEOVER_AFTER} polls of {PROBE_S} s"
    );
    println!("takeover gap {backend:?}: median {med:.3} s over {RUNS} runs: {gaps:?}");
}

per_backend!(
    takeover_gap:
    takeover_gap_file_lease,
    takeover_gap_etcd_lease
);

#[test]
fn median_and_metric_helpers() {
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    let page = "# HELP x\nnarwhal_standby_takeover_gap_seconds 2.5\nnarwhal_standby_takeover_gap_seconds_x 9\n";
    assert_eq!(
        metric(page, "narwhal_standby_takeover_gap_seconds", &[]),
        Some(2.5)
    );
    assert_eq!(metric(page, "narwhal_missing", &[]), None);
}
