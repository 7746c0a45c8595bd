//! The warm standby's driver (behaviour.md 2.9, with architecture.md 9.6: it never stops for
//! good; ha-and-fencing.md): every interval, and at the moment the controller's lease record
//! lapses (as the lease driver observes it: unchanged for its duration since this router first
//! read it, ha-and-fencing.md 2.4), it asks the pure [`Standby`] machine what to do and
//! performs it — read the lease store, follow the controller's published handoff (or poll a
//! primary that publishes none), persist the retained copy, claim, apply and publish,
//! re-check identities, commit or give the lease back.
//!
//! ```text
//!  min(interval, until it lapses) ──► Standby::tick ──► Step ──StandbyIo──► result
//!        ──► Standby::<event> ──► Step ...   (Live: lease store, HTTP to the primary, handoff, agents)
//! ```
//!
//! Without a primary URL (a fenced primary started without `--standby-of`) it follows the
//! store only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use narwhal_shared::handoff::{Handoff, HandoffError, Loaded, load_state_file, write_state_file};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::StandbyOptions;
use super::machine::{
    ApplyFailed, Observation, Poll, Seen, Settings, Source, Standby, Step, next_wait,
};
use super::primary::{self, Renewal};
use crate::config::Config;
use crate::ha_phase::{Controller, HaPhase};
use crate::parts::Parts;
use narwhal_lease::{Control, LeaseLoss};

/// What the standby's steps do to the world (implemented by [`Live`]; tests fake it).
pub(crate) trait StandbyIo {
    /// Monotonic now.
    fn now(&self) -> Instant;
    /// Wall-clock Unix seconds now.
    fn wall(&self) -> f64;
    /// Publishes the HA phase.
    fn publish(&self, phase: HaPhase);
    /// Records the router seen controlling the fleet.
    fn follow(&self, controller: Option<Controller>);
    /// Reads the lease record (with until when it counts as live, as the lease driver observes
    /// it) and the handoff published beside it.
    fn observe(&self) -> impl Future<Output = Observation> + Send;
    /// Polls the primary (its `/ready`, `/narwhal/handoff` and the lease record).
    fn poll(&self) -> impl Future<Output = Poll> + Send;
    /// Writes the retained handoff to the state file (best effort).
    fn persist(&self, h: &Handoff) -> impl Future<Output = ()> + Send;
    /// The epoch of this router's own state file, 0 without a valid one.
    fn own_file_epoch(&self) -> impl Future<Output = u64> + Send;
    /// Claims the lease and, on success, starts renewing it (pending).
    fn claim(&mut self) -> impl Future<Output = Result<u64, LeaseLoss>> + Send;
    /// Applies `source` (`doc` is the stored or retained handoff it names) and publishes the
    /// result beside the new lease record; `Err` says why not.
    fn apply(
        &self,
        source: Source,
        doc: Option<&Handoff>,
    ) -> impl Future<Output = Result<(), ApplyFailed>> + Send;
    /// The lease is locally valid now.
    fn lease_active(&self) -> bool;
    /// Re-checks every engine's identity through its agent.
    fn check_identities(&self) -> impl Future<Output = ()> + Send;
    /// The router controls the fleet now (not fenced meanwhile).
    fn controls(&self) -> bool;
    /// Commits the pending renewal.
    fn commit(&mut self) -> bool;
    /// Stops the renewal and releases the lease.
    fn give_back(&mut self) -> impl Future<Output = ()> + Send;
    /// The takeover completed after `gap` since the last current copy.
    fn took_over(&mut self, gap: Option<Duration>);
}

/// How a run of steps ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The tick's work is done; wait for the next interval.
    Tick,
    /// The takeover completed.
    TookOver,
}

/// Performs `step` and every step it leads to.
pub(crate) async fn steps(io: &mut impl StandbyIo, m: &mut Standby, mut step: Step) -> Ended {
    let mut claimed = 0;
    loop {
        step = match step {
            Step::Wait => return Ended::Tick,
            Step::Observe => {
                let seen = io.observe().await;
                let own = if m.wants_own_file() {
                    Some(io.own_file_epoch().await)
                } else {
                    None
                };
                m.observed(io.now(), io.wall(), seen, own)
            }
            Step::Poll => {
                let poll = io.poll().await;
                if let Poll::Miss(why) = &poll {
                    tracing::debug!(%why, "standby poll missed");
                }
                m.polled(io.now(), io.wall(), poll)
            }
            Step::Retain(controller) => {
                if let Some(h) = m.retained() {
                    io.persist(h).await;
                }
                io.follow(Some(controller));
                io.publish(HaPhase::Shadowing);
                return Ended::Tick;
            }
            Step::Follow(controller) => {
                io.follow(Some(controller));
                io.publish(HaPhase::Shadowing);
                return Ended::Tick;
            }
            Step::Publish(phase) => {
                io.follow(None);
                io.publish(phase);
                return Ended::Tick;
            }
            Step::Claim(source) => {
                let claim = io.claim().await;
                match &claim {
                    Ok(epoch) => claimed = *epoch,
                    Err(LeaseLoss::HeldByAnother) => {}
                    Err(e) => {
                        tracing::warn!(why = %e, "takeover failed; staying a standby and retrying");
                    }
                }
                m.claimed(source, claim)
            }
            Step::Apply(source) => {
                let doc = match source {
                    Source::Stored => m.stored(),
                    Source::Retained => m.retained(),
                    Source::OwnFile { .. } | Source::Memory { .. } => None,
                };
                let result = io.apply(source, doc).await;
                m.applied(claimed, result, io.lease_active())
            }
            Step::ValidateIdentities => {
                io.follow(None);
                io.publish(HaPhase::ValidatingIdentities);
                // The agents learn the new epoch from this first fenced call and refuse the
                // old primary's.
                io.check_identities().await;
                m.identities_checked(claimed, io.lease_active(), io.controls())
            }
            Step::Commit => {
                let ok = io.commit();
                m.committed(claimed, io.now(), ok)
            }
            Step::GiveBack { why, announce, .. } => {
                let blocked = || HaPhase::Blocked {
                    reason: why.clone(),
                };
                if announce {
                    io.publish(blocked());
                }
                io.give_back().await;
                tracing::warn!(%why, "takeover failed; staying a standby and retrying");
                io.publish(blocked());
                return Ended::Tick;
            }
            Step::TookOver { gap } => {
                io.took_over(gap);
                return Ended::TookOver;
            }
        }
    }
}

/// Ticks until the takeover completes (`true`) or `stop` (`false`).
pub(crate) async fn drive(
    io: &mut impl StandbyIo,
    m: &mut Standby,
    interval: Duration,
    stop: &CancellationToken,
) -> bool {
    loop {
        let wait = next_wait(interval, m.lapses_at(), io.now());
        tokio::select! {
            () = stop.cancelled() => return false,
            () = tokio::time::sleep(wait) => {}
        }
        let first = m.tick();
        if steps(io, m, first).await == Ended::TookOver {
            return true;
        }
    }
}

/// Runs the standby until it takes over (returning the committed renewal) or `stop`.
/// `held` is the epoch this router last controlled (a fenced primary), `None` if it never
/// did; `opts` names the primary to follow, if any.
pub(crate) async fn run(
    parts: &Arc<Parts>,
    opts: Option<&StandbyOptions>,
    held: Option<u64>,
    stop: &CancellationToken,
) -> Option<Renewal> {
    parts.ha.enter_standby();
    let interval = opts.map_or(parts.ha.lease().timing().renew_interval, |o| {
        o.probe_interval
    });
    let http = match client(&parts.cfg, interval) {
        Ok(c) => c,
        Err(e) => {
            parts.ha.publish(HaPhase::Blocked {
                reason: format!("standby client: {e}"),
            });
            return None;
        }
    };
    let settings = Settings {
        primary: opts.is_some(),
        takeover_after: opts.map_or(1, |o| o.takeover_after),
        max_handoff_age_s: opts.map_or(0.0, |o| o.max_handoff_age_s),
        holder: parts.ha.lease().holder(),
    };
    let mut machine = Standby::new(settings, held);
    let mut io = Live::new(parts, http, opts.map(|o| o.primary.clone()), stop);
    // The first look at the store is immediate: a fenced router names its successor at once.
    if steps(&mut io, &mut machine, Step::Observe).await == Ended::TookOver
        || drive(&mut io, &mut machine, interval, stop).await
    {
        io.renewal.take()
    } else {
        None
    }
}

/// The standby's real effects.
pub(crate) struct Live<'a> {
    parts: &'a Arc<Parts>,
    http: reqwest::Client,
    primary: Option<String>,
    stop: &'a CancellationToken,
    /// The renewal started at the last successful claim.
    pub(crate) renewal: Option<Renewal>,
    /// Epoch and `at` of the copy last written to the state file (an unchanged copy is not
    /// written again: the controller publishes only when its state changed).
    persisted: std::sync::Mutex<Option<(u64, f64)>>,
}

impl<'a> Live<'a> {
    /// Effects on `parts`, polling `primary` (if any) with `http`.
    pub(crate) fn new(
        parts: &'a Arc<Parts>,
        http: reqwest::Client,
        primary: Option<String>,
        stop: &'a CancellationToken,
    ) -> Live<'a> {
        Live {
            parts,
            http,
            primary,
            stop,
            renewal: None,
            persisted: std::sync::Mutex::new(None),
        }
    }
}

impl StandbyIo for Live<'_> {
    fn now(&self) -> Instant {
        self.parts.clock.now()
    }

    fn wall(&self) -> f64 {
        self.parts.wall()
    }

    fn publish(&self, phase: HaPhase) {
        self.parts.ha.publish(phase);
    }

    fn follow(&self, controller: Option<Controller>) {
        self.parts.ha.set_controller(controller);
    }

    async fn observe(&self) -> Observation {
        let (record, doc) = crate::handoff::read_published(self.parts).await?;
        // The read fed the lease core's observer; this is what it makes of the record.
        let fresh = self.parts.ha.lease().freshness(record.as_ref());
        Ok(Seen {
            record,
            fresh,
            stored: doc.map(Box::new),
        })
    }

    async fn poll(&self) -> Poll {
        match &self.primary {
            Some(primary) => poll(self.parts, &self.http, primary).await,
            None => Poll::Miss("no primary to poll".into()),
        }
    }

    async fn persist(&self, h: &Handoff) {
        let id = Some((h.epoch, h.at));
        {
            let mut last = self.persisted.lock().unwrap_or_else(|p| p.into_inner());
            if *last == id {
                return;
            }
            *last = id;
        }
        let path = std::path::PathBuf::from(&self.parts.cfg.recovery.state_path);
        let copy = h.clone();
        let _ = tokio::task::spawn_blocking(move || write_state_file(&path, &copy)).await;
    }

    async fn own_file_epoch(&self) -> u64 {
        let path = std::path::PathBuf::from(&self.parts.cfg.recovery.state_path);
        match tokio::task::spawn_blocking(move || load_state_file(&path)).await {
            Ok(Loaded::Valid(h)) => h.epoch,
            _ => 0,
        }
    }

    async fn claim(&mut self) -> Result<u64, LeaseLoss> {
        let epoch = self.parts.ha.lease().claim().await?;
        self.renewal = Some(primary::renew(self.parts, true, self.stop));
        Ok(epoch)
    }

    async fn apply(&self, source: Source, doc: Option<&Handoff>) -> Result<(), ApplyFailed> {
        match (source, doc) {
            (Source::Stored | Source::Retained, Some(h)) => crate::handoff::apply(self.parts, h)
                .map(|_| ())
                .map_err(ApplyFailed::Rejected)?,
            (Source::Stored | Source::Retained, None) => return Err(ApplyFailed::NoFreshHandoff),
            // Never controlled the fleet in this process: its own state file is the best it
            // has (it was not applied if `--resume` was not given).
            (Source::OwnFile { .. }, _) => {
                if let Some(reason) = crate::handoff::resume(self.parts) {
                    return Err(ApplyFailed::OwnFileRefused(reason));
                }
            }
            // A fenced primary's memory is that epoch's state, fresher than its file.
            (Source::Memory { .. }, _) => {}
        }
        // Published under the new epoch before anything else happens under it: the store's
        // document is always the newest state of the record's epoch (ha-and-fencing.md).
        crate::handoff::publish(self.parts, true)
            .await
            .map(|_| ())
            .map_err(ApplyFailed::NotPublished)
    }

    fn lease_active(&self) -> bool {
        self.parts.ha.lease().control(self.parts.clock.now()) == Control::Active
    }

    async fn check_identities(&self) {
        self.parts.lifecycle.check_identities().await;
    }

    fn controls(&self) -> bool {
        self.parts.ha.controls_fleet()
    }

    fn commit(&mut self) -> bool {
        self.renewal.as_ref().is_some_and(Renewal::commit)
    }

    async fn give_back(&mut self) {
        if let Some(r) = self.renewal.take() {
            r.stop();
        }
        let _ = self.parts.ha.lease().release().await;
    }

    fn took_over(&mut self, gap: Option<Duration>) {
        tracing::info!(
            epoch = self.parts.ha.lease().epoch(),
            gap_s = gap.map(|g| g.as_secs_f64()),
            "took over the fleet"
        );
        if let Some(g) = gap {
            self.parts
                .metrics
                .durability
                .takeover_gap
                .set(g.as_secs_f64());
        }
        // Clear only our own hold: a stale-epoch answer during the check may have fenced us.
        self.parts.ha.end_identity_check();
        self.parts.dirty.notify_one();
    }
}

/// One poll of the primary: `/ready` must show control (a 503 with `control_ready`, e.g. a
/// whole-wave drain, is a healthy primary), `/narwhal/handoff` must validate, and its epoch
/// and holder must match the live lease record.
async fn poll(parts: &Parts, http: &reqwest::Client, primary: &str) -> Poll {
    let ready = match http.get(format!("{primary}/ready")).send().await {
        Ok(r) => {
            let ok = r.status().is_success();
            let body: Value = r.json().await.unwrap_or_default();
            ok || body["control_ready"] == true
        }
        Err(e) => return Poll::Miss(format!("/ready: {e}")),
    };
    if !ready {
        return Poll::Miss("primary does not control the fleet".into());
    }
    let doc = match http.get(format!("{primary}/narwhal/handoff")).send().await {
        Ok(r) if r.status().is_success() => match r.json::<Value>().await {
            Ok(v) => v,
            Err(e) => return Poll::Miss(format!("/narwhal/handoff: {e}")),
        },
        Ok(r) => return Poll::Miss(format!("/narwhal/handoff: HTTP {}", r.status())),
        Err(e) => return Poll::Miss(format!("/narwhal/handoff: {e}")),
    };
    let h = match Handoff::from_value(doc) {
        Ok(h) => h,
        Err(e @ HandoffError::ContractVersion { .. }) => {
            // The reference stops here for good (behaviour.md 11.8); we keep polling.
            return Poll::Miss(format!("primary speaks another handoff contract: {e}"));
        }
        Err(e) => return Poll::Miss(format!("invalid handoff: {e}")),
    };
    let lease = parts.ha.lease();
    let record = match lease.read_record().await {
        Ok(Some(r)) => r,
        Ok(None) => return Poll::Miss("no lease record".into()),
        Err(e) => return Poll::Miss(format!("lease unreadable: {e}")),
    };
    let live = lease.freshness(Some(&record)).live(parts.clock.now());
    if record.holder != h.holder || record.epoch != h.epoch || !live {
        return Poll::Miss(format!(
            "handoff epoch {} / holder {:?} does not match the live lease (epoch {}, holder {:?})",
            h.epoch, h.holder, record.epoch, record.holder
        ));
    }
    Poll::Good(Box::new(h))
}

/// The HTTP client for the primary's control listener (its `control.tls` when set). Its
/// timeout follows the poll interval (twice it, within 0.25–0.8 s): a stopped primary must
/// not hold the standby's loop for long (the lease record decides the takeover anyway).
///
/// # Errors
/// [`ClientError`]: the `control.tls` files, or the client itself.
fn client(cfg: &Config, interval: Duration) -> Result<reqwest::Client, ClientError> {
    let timeout = (interval * 2).clamp(Duration::from_millis(250), Duration::from_millis(800));
    let mut b = reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout)
        .connect_timeout(timeout);
    if let Some(tls) = &cfg.control_tls {
        let files = narwhal_shared::TlsFiles {
            ca: tls.ca.clone(),
            cert: tls.cert.clone(),
            key: tls.key.clone(),
        };
        b = b.use_preconfigured_tls(files.client_config()?);
    } else {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    b.build().map_err(ClientError::Build)
}

/// Why the standby's client for the primary could not be built ([`client`]).
#[derive(Debug, thiserror::Error)]
enum ClientError {
    /// The `control.tls` files cannot be used.
    #[error(transparent)]
    Tls(#[from] narwhal_shared::TlsError),
    /// reqwest refused the configuration.
    #[error(transparent)]
    Build(reqwest::Error),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ha::machine::tests::{doc, record_of, seen};
    use crate::ha_phase::IDENTITY_PENDING;
    use narwhal_lease::{Freshness, LeaseRecord};
    use narwhal_shared::{Clock as _, ManualClock, SystemClock};
    use std::sync::Mutex;

    /// A router with a file lease in a temporary directory, on a manual clock; its stop
    /// token is cancelled on drop.
    struct World {
        dir: tempfile::TempDir,
        clock: Arc<ManualClock>,
        sh: Arc<Parts>,
        stop: CancellationToken,
    }

    impl World {
        fn new() -> World {
            let dir = tempfile::tempdir().expect("tempdir");
            let clock = Arc::new(ManualClock::new(SystemClock.now(), 1.0e9));
            let sh = crate::parts::for_test(
                serde_json::json!({
                    "schema": "narwhal.fleet", "schema_version": 2, "model": "m",
                    "backend": "vllm",
                    "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                                {"iid": "d0", "url": "http://127.0.0.1:2"}],
                    "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                    "recovery": {"state_path": dir.path().join("state.json")},
                    "lease": {"backend": "file", "path": dir.path().join("lease.json"),
                              "ttl_s": 2, "renew_interval_s": 0.5, "safety_margin_s": 0.5}
                }),
                clock.clone(),
                "standby",
            );
            World {
                dir,
                clock,
                sh,
                stop: CancellationToken::new(),
            }
        }

        /// The lease record in the store now.
        async fn record(&self) -> LeaseRecord {
            let rec = self.sh.ha.lease().read_record().await.expect("read");
            rec.expect("a lease record")
        }

        /// The standby's real effects on this router (no primary to poll).
        fn io(&self) -> Live<'_> {
            let http = client(&self.sh.cfg, Duration::from_millis(250)).expect("client");
            Live::new(&self.sh, http, None, &self.stop)
        }

        fn settings(&self, primary: bool) -> Settings {
            Settings {
                primary,
                takeover_after: 4,
                max_handoff_age_s: 30.0,
                holder: self.sh.ha.lease().holder(),
            }
        }
    }

    impl Drop for World {
        fn drop(&mut self) {
            self.stop.cancel();
        }
    }

    fn blocked_reason(p: &Parts) -> String {
        match p.ha.phase() {
            HaPhase::Blocked { reason } => reason,
            other => panic!("not blocked: {other:?}"),
        }
    }

    /// Found by ha_e2e: `/ready` answered 200 as soon as the lease was claimed, before the
    /// identity check through the agents, and before the takeover gap was recorded. While the
    /// check runs the router controls the fleet but is not ready; afterwards it is ready and
    /// the gap (since the last current copy) is in the metric.
    #[tokio::test]
    async fn takeover_is_ready_only_after_the_identity_check_and_records_the_gap() {
        let w = World::new();
        let (sh, clock) = (&w.sh, &w.clock);
        assert_eq!(sh.ha.lease().claim().await.ok(), Some(1));
        sh.ha.publish(HaPhase::ValidatingIdentities);
        let r = sh.gate.readiness();
        assert!(!r.ready);
        assert!(
            r.control_ready,
            "the identity check needs control of the fleet"
        );
        assert_eq!(r.reason, IDENTITY_PENDING);
        // Not fenced: it holds the lease (behaviour.md 1.4 order gives `degraded`).
        assert_eq!(crate::documents::health(sh).status, "degraded");
        assert_eq!(sh.ha.lease().release().await.ok(), Some(true));
        sh.ha.publish(HaPhase::Shadowing);

        let mut m = Standby::new(w.settings(false), None);
        let live = Some(record_of(1, "other:0", 1.0e9 + 1.0));
        let copy = crate::ha::machine::tests::doc_of(1, "other:0", 1.0e9);
        let fresh = Freshness::Until(clock.now() + Duration::from_secs(1));
        let step = m.observed(clock.now(), 1.0e9, seen(live, fresh, Some(copy)), None);
        assert!(matches!(step, Step::Retain(_)), "{step:?}");
        clock.advance(Duration::from_millis(2500));
        let mut io = w.io();
        assert_eq!(
            steps(&mut io, &mut m, Step::Claim(Source::OwnFile { epoch: 1 })).await,
            Ended::TookOver
        );
        let r = sh.gate.readiness();
        assert!(r.ready, "{}", r.reason);
        assert_eq!(
            sh.ha.view().status.epoch,
            2,
            "the released epoch 1 is followed by 2"
        );
        let (rec, published) = crate::handoff::read_published(sh).await.expect("store");
        let published = published.expect("published under the new epoch before serving");
        assert_eq!((published.epoch, rec.map(|r| r.epoch)), (2, Some(2)));
        assert_eq!(published.holder, sh.ha.lease().holder());
        let m = crate::documents::metrics(sh);
        assert!(
            m.lines()
                .any(|l| l == "narwhal_standby_takeover_gap_seconds 2.5"),
            "{m}"
        );
    }

    /// ha-and-fencing.md: the standby takes over from the handoff the primary published beside its
    /// lease record, the newest one; an epoch claimed by another router between the
    /// published copy and the claim makes it stale, one this router gave back does not.
    #[tokio::test]
    async fn a_takeover_applies_the_newest_published_handoff() {
        for ours in [true, false] {
            let w = World::new();
            let (sh, clock) = (&w.sh, &w.clock);
            // The primary served under epoch 1 and published its state (served 7).
            assert_eq!(sh.ha.lease().claim().await.ok(), Some(1));
            let mut h = crate::handoff::snapshot(sh);
            h.epoch = 1;
            h.holder = sh.ha.lease().holder();
            h.counters.insert("served".into(), 7);
            let bytes = serde_json::to_vec(&h).expect("json");
            assert_eq!(sh.ha.lease().publish(bytes).await, Ok(1));
            assert_eq!(sh.ha.lease().release().await.ok(), Some(true));
            // Epoch 2: a takeover attempt that failed (ours) or another router (not ours).
            assert_eq!(sh.ha.lease().claim().await.ok(), Some(2));
            assert_eq!(sh.ha.lease().release().await.ok(), Some(true));
            let mut m = Standby::new(w.settings(true), None);
            if ours {
                m.gave_back(2);
            }
            let mut io = w.io();
            let ended = steps(&mut io, &mut m, Step::Observe).await;
            if ours {
                assert_eq!(ended, Ended::TookOver, "{:?}", sh.ha.phase());
                assert_eq!(sh.ha.lease().epoch(), 3);
                assert_eq!(sh.accounting.tally().served, 7, "the published totals");
            } else {
                assert_eq!(ended, Ended::Tick);
                assert_eq!(
                    blocked_reason(sh),
                    "handoff epoch 1 cannot precede claimed epoch 3"
                );
                assert_eq!(sh.ha.lease().epoch(), 0, "nothing claimed");
            }
            let _ = clock;
        }
    }

    /// A fenced primary whose renewal failed while its record was still live reclaims its own
    /// epoch: that is no change of holder, so it takes the fleet back.
    #[tokio::test]
    async fn a_fenced_primary_reclaims_its_own_live_epoch() {
        let w = World::new();
        let sh = &w.sh;
        assert_eq!(sh.ha.lease().claim().await.ok(), Some(1));
        sh.ha.fence(&LeaseLoss::Lapsed);
        let mut m = Standby::new(w.settings(false), Some(1));
        let mut io = w.io();
        let first = m.tick();
        assert_eq!(first, Step::Observe);
        assert_eq!(steps(&mut io, &mut m, first).await, Ended::TookOver);
        assert_eq!(sh.ha.view().status.epoch, 1);
        assert!(sh.gate.readiness().ready);
    }

    /// The claim races another router: the epoch claimed is not the next one after ours.
    #[tokio::test]
    async fn a_claim_after_someone_else_held_the_fleet_is_released() {
        let w = World::new();
        let sh = &w.sh;
        assert_eq!(sh.ha.lease().claim().await.ok(), Some(1));
        assert_eq!(sh.ha.lease().release().await.ok(), Some(true));
        sh.ha.publish(HaPhase::Shadowing);
        // We last held epoch 0 (never), the store is at 1: claiming gives 2.
        let mut m = Standby::new(w.settings(false), Some(0));
        let mut io = w.io();
        let source = Source::Memory { epoch: 0 };
        assert_eq!(
            steps(&mut io, &mut m, Step::Claim(source)).await,
            Ended::Tick
        );
        let why = blocked_reason(sh);
        assert!(why.starts_with("stale state:"), "{why}");
        let rec = w.record().await;
        assert_eq!(rec.epoch, 2);
        assert!(rec.released(), "released: {rec:?}");
        assert!(!sh.ha.controls_fleet());
    }

    /// Found by ha_e2e: the lease was not renewed during the takeover's identity check. Now
    /// the renew loop runs from the claim; a loss before the takeover commits only fences
    /// (the takeover fails and its standby loop goes on), so no second standby loop starts.
    #[tokio::test]
    async fn the_lease_is_renewed_during_a_takeover_and_a_loss_then_fails_it() {
        let w = World::new();
        let (sh, clock) = (&w.sh, &w.clock);
        assert_eq!(sh.ha.lease().claim().await.ok(), Some(1));
        sh.ha.publish(HaPhase::ValidatingIdentities);
        let mut renewal = primary::renew(sh, true, &w.stop);
        // Renewals move expires_at with the (manual) wall clock.
        clock.advance(Duration::from_millis(400));
        let renewed = async {
            for _ in 0..300 {
                if w.record().await.expires_at > 1.0e9 + 2.0 {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            false
        };
        assert!(renewed.await, "renewed while the takeover is pending");
        // Another holder takes the record: the next renewal fails while still pending.
        let other = serde_json::json!({"epoch": 2, "expires_at": 1.0e9 + 60.0,
            "holder": "other:0", "schema": "narwhal.router-lease", "schema_version": 1,
            "updated_at": 1.0e9});
        std::fs::write(w.dir.path().join("lease.json"), format!("{other}\n")).expect("write");
        let mut lost = false;
        for _ in 0..300 {
            if renewal.lost_while_pending() {
                lost = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(lost, "the loss is recorded as during the takeover");
        assert!(!sh.ha.controls_fleet(), "fenced at once");
        assert!(!renewal.commit(), "the takeover cannot commit");
        let reported = tokio::time::timeout(Duration::from_millis(50), renewal.lost()).await;
        assert!(
            reported.is_err(),
            "a loss while pending is not reported as a lost control"
        );
    }

    /// The wait before the next look at the store: the interval, or the time left until the
    /// controller's record lapses (plus 5 ms) when that is sooner.
    #[test]
    fn the_standby_wakes_when_the_record_lapses() {
        let i = Duration::from_millis(250);
        let earlier = SystemClock.now();
        let t = earlier + Duration::from_secs(1);
        assert_eq!(next_wait(i, None, t), i);
        assert_eq!(next_wait(i, Some(t + Duration::from_secs(2)), t), i);
        let w = next_wait(i, Some(t + Duration::from_millis(100)), t);
        assert!(
            w > Duration::from_millis(104) && w < Duration::from_millis(106),
            "{w:?}"
        );
        assert_eq!(next_wait(i, Some(earlier), t), Duration::from_millis(5));
    }

    /// A fake world for the driver: a primary at epoch 4 whose record lapses 0.9 s after the
    /// start (as the lease driver observes it; it published up to wall 1000.9), published
    /// copies, a claim of epoch 5, an identity check that takes 100 ms; everything it is asked
    /// is recorded.
    struct Fake {
        t0: tokio::time::Instant,
        published: Mutex<Vec<HaPhase>>,
        followed: Mutex<Vec<Option<Controller>>>,
        claimed_at: Option<Duration>,
        applied_at: Option<f64>,
        gap: Option<Duration>,
    }

    impl Fake {
        fn elapsed(&self) -> Duration {
            tokio::time::Instant::now() - self.t0
        }
    }

    impl StandbyIo for Fake {
        fn now(&self) -> Instant {
            tokio::time::Instant::now().into_std()
        }
        fn wall(&self) -> f64 {
            1000.0 + self.elapsed().as_secs_f64()
        }
        fn publish(&self, phase: HaPhase) {
            self.published.lock().unwrap().push(phase);
        }
        fn follow(&self, controller: Option<Controller>) {
            self.followed.lock().unwrap().push(controller);
        }
        async fn observe(&self) -> Observation {
            let wall = self.wall();
            let rec = record_of(4, "primary:0", 1000.9);
            let fresh = Freshness::Until(self.t0.into_std() + Duration::from_millis(900));
            seen(Some(rec), fresh, Some(doc(4, wall.min(1000.9))))
        }
        async fn poll(&self) -> Poll {
            panic!("a primary that publishes is never polled over HTTP");
        }
        async fn persist(&self, _: &Handoff) {}
        async fn own_file_epoch(&self) -> u64 {
            0
        }
        async fn claim(&mut self) -> Result<u64, LeaseLoss> {
            self.claimed_at = Some(self.elapsed());
            Ok(5)
        }
        async fn apply(&self, source: Source, doc: Option<&Handoff>) -> Result<(), ApplyFailed> {
            assert_eq!(source, Source::Stored);
            assert_eq!(doc.map(|h| h.epoch), Some(4));
            let at = doc.map(|h| h.at);
            assert!(at.is_some_and(|a| a > 1000.85), "the newest copy: {at:?}");
            Ok(())
        }
        fn lease_active(&self) -> bool {
            true
        }
        async fn check_identities(&self) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        fn controls(&self) -> bool {
            true
        }
        fn commit(&mut self) -> bool {
            true
        }
        async fn give_back(&mut self) {
            panic!("nothing fails in this scenario");
        }
        fn took_over(&mut self, gap: Option<Duration>) {
            self.gap = gap;
            self.applied_at = Some(self.wall());
        }
    }

    /// The driver on tokio's paused clock: it follows the published copy every 250 ms, wakes
    /// when the record lapses (0.905 s, not the next 250 ms tick) and claims there, without
    /// waiting for missed polls; the gap since the last current copy (0.75 s) runs to the
    /// commit after the 100 ms identity check.
    #[tokio::test(start_paused = true)]
    async fn the_standby_claims_when_the_record_lapses_on_paused_time() {
        let mut fake = Fake {
            t0: tokio::time::Instant::now(),
            published: Mutex::new(Vec::new()),
            followed: Mutex::new(Vec::new()),
            claimed_at: None,
            applied_at: None,
            gap: None,
        };
        let w = World::new();
        let mut m = Standby::new(w.settings(true), None);
        let stop = CancellationToken::new();
        let took_over = drive(&mut fake, &mut m, Duration::from_millis(250), &stop).await;
        assert!(took_over);
        let claimed = fake.claimed_at.expect("claimed");
        assert!(
            claimed >= Duration::from_millis(900) && claimed <= Duration::from_millis(910),
            "{claimed:?}"
        );
        let gap = fake.gap.expect("gap");
        assert!(
            gap >= Duration::from_millis(250) && gap <= Duration::from_millis(260),
            "{gap:?}"
        );
        let primary = Controller {
            holder: "primary:0".into(),
            epoch: 4,
        };
        assert_eq!(
            *fake.published.lock().unwrap(),
            [
                HaPhase::Shadowing,
                HaPhase::Shadowing,
                HaPhase::Shadowing,
                HaPhase::ValidatingIdentities
            ]
        );
        assert_eq!(
            *fake.followed.lock().unwrap(),
            [
                Some(primary.clone()),
                Some(primary.clone()),
                Some(primary),
                None
            ]
        );
        // Stopped before the first interval ends: nothing happens.
        let stop = CancellationToken::new();
        stop.cancel();
        let mut m = Standby::new(w.settings(true), None);
        assert!(!drive(&mut fake, &mut m, Duration::from_millis(250), &stop).await);
    }
}
