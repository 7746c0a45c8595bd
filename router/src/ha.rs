//! High availability: the primary's lease claim and renewal with fencing, and the warm
//! standby that polls the primary and takes over only under a valid, fenced lease
//! (seed "HA handoff"; reference-notes 2.9, 3.4; DESIGN.md sections 7 and 9.6).
//!
//! ```text
//!  primary:  claim ─► active ─(renew fails / another holder)─► fenced ─► standby loop
//!  standby:  poll /ready + /narwhal/handoff, match the lease record, retain + persist
//!            ─(N misses and the lease expired)─► claim epoch+1 ─► apply ─► re-check
//!            identities through the agents ─► active (renew loop)
//! ```
//! Every failure on the way leaves the router a standby that tries again (DESIGN.md 9.6).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use narwhal_shared::handoff::{Handoff, HandoffError, Loaded, load_state_file, write_state_file};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::lease::driver::LeaseEvent;
use crate::lease::{Control, LeaseLoss};
use crate::state::Shared;

/// Standby settings (`narwhal-serve --standby-of URL ...`; reference-notes 2.9 defaults).
#[derive(Debug, Clone)]
pub struct StandbyOptions {
    /// The primary's control listener, e.g. `https://10.0.0.5:8001`.
    pub primary: String,
    /// Seconds between polls (default 0.25).
    pub probe_interval: Duration,
    /// Consecutive missed polls before a takeover is attempted (default 4).
    pub takeover_after: u32,
    /// A retained handoff older than this (by its `at`, wall clock) is not applied (default 30 s).
    pub max_handoff_age_s: f64,
}

/// Sets the HA flags: control, standby mode, the reason shown in `/ready`, epoch and holder.
fn set_role(shared: &Shared, active: bool, standby: bool, blocked: &str) {
    let mut ha = shared.ha.lock().unwrap_or_else(|p| p.into_inner());
    ha.controls_fleet = active;
    ha.standby = standby;
    ha.failover_blocked = blocked.to_string();
    ha.epoch = shared.lease.epoch();
    ha.holder = shared.lease.holder();
}

/// Startup of a primary: claim the lease (backend `none`: nothing to claim) and keep it.
/// On failure the router serves nothing and retries as a standby (DESIGN.md 9.6).
pub(crate) async fn start_primary(
    shared: Arc<Shared>,
    standby: Option<StandbyOptions>,
    stop: CancellationToken,
) {
    if !shared.lease.enabled() {
        return;
    }
    match shared.lease.claim().await {
        Ok(epoch) => {
            tracing::info!(epoch, holder = %shared.lease.holder(), "lease claimed; this router controls the fleet");
            set_role(&shared, true, false, "");
            keep(shared, standby, stop);
        }
        Err(loss) => {
            tracing::warn!(reason = %loss, "lease not claimed at startup; waiting as a standby");
            set_role(&shared, false, true, &loss.to_string());
            tokio::spawn(standby_loop(shared, standby, stop));
        }
    }
}

/// Renews the lease; a lost lease fences the router at once, then it goes back to standby.
fn keep(shared: Arc<Shared>, standby: Option<StandbyOptions>, stop: CancellationToken) {
    let phase = Arc::new(AtomicU8::new(COMMITTED));
    keep_from(shared, standby, stop, phase);
}

/// [`Renewal`] phases: a takeover still in progress, a router in control, and a takeover
/// whose lease was lost before it finished.
const PENDING: u8 = 0;
const COMMITTED: u8 = 1;
const LOST_WHILE_PENDING: u8 = 2;

/// The renew loop of a takeover in progress (found by ha_e2e: the lease was not renewed
/// while the takeover re-checked identities, so on a loaded machine a check longer than
/// `ttl_s − safety_margin_s` lost the lease every time and the standby never took over).
struct Renewal {
    /// Stops the renew loop silently (a failed takeover releases the lease itself).
    stop: CancellationToken,
    /// [`PENDING`] until the takeover commits ([`COMMITTED`]); a loss while pending only
    /// fences ([`LOST_WHILE_PENDING`]): the standby loop that runs the takeover carries on.
    phase: Arc<AtomicU8>,
}

impl Renewal {
    /// Marks the takeover done; `false` if the lease was lost before (nobody else will start
    /// the standby loop then: the caller must fail the takeover and keep looping).
    fn commit(&self) -> bool {
        self.phase
            .compare_exchange(PENDING, COMMITTED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
}

/// Starts the renew loop. A loss fences the router at once; once `phase` is [`COMMITTED`] it
/// also starts the standby loop (before that, the takeover in progress notices and goes on).
fn keep_from(
    shared: Arc<Shared>,
    standby: Option<StandbyOptions>,
    stop: CancellationToken,
    phase: Arc<AtomicU8>,
) -> Renewal {
    let renew_stop = stop.child_token();
    let on_change = {
        let shared = shared.clone();
        let phase = phase.clone();
        move |ev: LeaseEvent| {
            let LeaseEvent::Fenced { epoch, loss } = ev;
            tracing::error!(epoch, reason = %loss, "fenced: no new placements, lifecycle actions refused");
            fence(&shared, &loss);
            let pending = phase
                .compare_exchange(
                    PENDING,
                    LOST_WHILE_PENDING,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok();
            if !pending {
                tokio::spawn(standby_loop_after(
                    shared.clone(),
                    standby.clone(),
                    stop.clone(),
                    Some(epoch),
                ));
            }
        }
    };
    shared
        .lease
        .clone()
        .spawn_renew(renew_stop.clone(), on_change);
    Renewal {
        stop: renew_stop,
        phase,
    }
}

/// Fences the router: it no longer controls the fleet (`/health` `fenced`, `/ready` 503 with
/// the reason, lifecycle actions 503, no new prefill placements).
pub(crate) fn fence(shared: &Shared, loss: &LeaseLoss) {
    let reason = match loss {
        LeaseLoss::HeldByAnother => "lease held by another router".to_string(),
        LeaseLoss::Lapsed => "lease renewal failed".to_string(),
        LeaseLoss::Unavailable(e) => format!("lease unavailable: {e}"),
    };
    let mut ha = shared.ha.lock().unwrap_or_else(|p| p.into_inner());
    ha.controls_fleet = false;
    ha.failover_blocked = reason;
}

/// What one poll of the primary found.
enum Poll {
    /// The primary answered and its document matches the lease record.
    Good(Box<Handoff>),
    /// Anything else; the reason is logged at debug.
    Miss(String),
}

async fn poll(shared: &Shared, http: &reqwest::Client, primary: &str) -> Poll {
    let ready = match http.get(format!("{primary}/ready")).send().await {
        Ok(r) => {
            let ok = r.status().is_success();
            let body: Value = r.json().await.unwrap_or_default();
            // A 503 with control_ready (e.g. a whole-wave drain) is a healthy primary.
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
            // The reference stops here for good (reference-notes 11.8); we keep polling.
            return Poll::Miss(format!("primary speaks another handoff contract: {e}"));
        }
        Err(e) => return Poll::Miss(format!("invalid handoff: {e}")),
    };
    let record = match shared.lease.read_record().await {
        Ok(Some(r)) => r,
        Ok(None) => return Poll::Miss("no lease record".into()),
        Err(e) => return Poll::Miss(format!("lease unreadable: {e}")),
    };
    let now = shared.wall();
    if record.holder != h.holder || record.epoch != h.epoch || !record.live(now) {
        return Poll::Miss(format!(
            "handoff epoch {} / holder {:?} does not match the live lease (epoch {}, holder {:?})",
            h.epoch, h.holder, record.epoch, record.holder
        ));
    }
    Poll::Good(Box::new(h))
}

fn client(shared: &Shared) -> Result<reqwest::Client, String> {
    let timeout = Duration::from_millis(800);
    let mut b = reqwest::Client::builder()
        .no_proxy()
        .timeout(timeout)
        .connect_timeout(timeout);
    if let Some(tls) = &shared.cfg.control_tls {
        let files = narwhal_shared::TlsFiles {
            ca: tls.ca.clone(),
            cert: tls.cert.clone(),
            key: tls.key.clone(),
        };
        b = b.use_preconfigured_tls(files.client_config().map_err(|e| e.to_string())?);
    } else {
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
    b.build().map_err(|e| e.to_string())
}

/// The warm standby (reference-notes 2.9, with DESIGN.md 9.6: never stops for good). Without
/// a primary URL (a fenced primary started without `--standby-of`) it only retries the lease,
/// and takes the fleet back only while its own state is still the fleet's newest (see
/// [`own_state`]).
pub(crate) async fn standby_loop(
    shared: Arc<Shared>,
    opts: Option<StandbyOptions>,
    stop: CancellationToken,
) {
    standby_loop_after(shared, opts, stop, None).await;
}

/// [`standby_loop`] for a router that last controlled the fleet at epoch `held` (a fenced
/// primary: its memory is the state of that epoch); `None` for one that never did.
async fn standby_loop_after(
    shared: Arc<Shared>,
    opts: Option<StandbyOptions>,
    stop: CancellationToken,
    held: Option<u64>,
) {
    {
        let mut ha = shared.ha.lock().unwrap_or_else(|p| p.into_inner());
        ha.standby = true;
        ha.controls_fleet = false;
    }
    let interval = opts
        .as_ref()
        .map_or(shared.lease.timing().renew_interval, |o| o.probe_interval);
    let http = match client(&shared) {
        Ok(c) => c,
        Err(e) => {
            set_role(&shared, false, true, &format!("standby client: {e}"));
            return;
        }
    };
    let mut retained: Option<Box<Handoff>> = None;
    let mut misses: u32 = 0;
    let mut last_good: Option<Instant> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        if let Some(o) = &opts {
            match poll(&shared, &http, &o.primary).await {
                Poll::Good(h) => {
                    misses = 0;
                    last_good = Some(shared.clock.now());
                    let path = std::path::PathBuf::from(&shared.cfg.recovery.state_path);
                    let copy = (*h).clone();
                    let _ =
                        tokio::task::spawn_blocking(move || write_state_file(&path, &copy)).await;
                    retained = Some(h);
                    set_role(&shared, false, true, "");
                    continue;
                }
                Poll::Miss(why) => {
                    misses += 1;
                    tracing::debug!(misses, %why, "standby poll missed");
                    if misses < o.takeover_after {
                        continue;
                    }
                }
            }
            let fresh = retained
                .as_ref()
                .is_some_and(|h| shared.wall() - h.at <= o.max_handoff_age_s);
            if !fresh {
                set_role(&shared, false, true, "no fresh handoff");
                continue;
            }
        }
        let source = match (&opts, retained.as_deref()) {
            // Checked before claiming: a copy older than the lease is never applied, and a
            // claim that would be released at once is not made (no epoch churn while retrying).
            (Some(_), Some(h)) => {
                match judge_own(h.epoch, shared.lease.read_record().await, shared.wall()) {
                    Own::Current(_) => Source::Retained(h),
                    Own::Held => continue,
                    Own::Newer { own, newer } => {
                        set_role(&shared, false, true, &stale_handoff(own, newer + 1));
                        continue;
                    }
                    Own::Unavailable(why) => {
                        set_role(&shared, false, true, &why);
                        continue;
                    }
                }
            }
            (Some(_), None) => continue, // unreachable: a fresh handoff was required above
            (None, _) => match own_state(&shared, held).await {
                Own::Current(epoch) => match held {
                    Some(_) => Source::Memory { epoch },
                    None => Source::OwnFile { epoch },
                },
                Own::Held => continue,
                Own::Newer { own, newer } => {
                    set_role(&shared, false, true, &stale_state(own, newer));
                    continue;
                }
                Own::Unavailable(why) => {
                    set_role(&shared, false, true, &why);
                    continue;
                }
            },
        };
        match take_over(&shared, source, last_good, &opts, &stop).await {
            // The renew loop already runs (started at the claim).
            Ok(()) => return,
            Err(Takeover::HeldByAnother) => {}
            Err(Takeover::Failed(why)) => {
                tracing::warn!(%why, "takeover failed; staying a standby and retrying");
                set_role(&shared, false, true, &why);
            }
        }
    }
}

enum Takeover {
    /// The primary's lease is still valid: never take over then.
    HeldByAnother,
    /// Claimed but could not serve; the lease was released.
    Failed(String),
}

/// What a takeover applies.
enum Source<'a> {
    /// The primary's document a warm standby retained (its epoch must be the claimed one − 1).
    Retained(&'a Handoff),
    /// This router's own state file, for a router that never controlled the fleet in this
    /// process; written under `epoch` (0: no file).
    OwnFile { epoch: u64 },
    /// This process's memory: a fenced primary that controlled the fleet at `epoch`.
    Memory { epoch: u64 },
}

/// Whether state of a given epoch (a retained handoff, or a router's own) may be applied by
/// claiming the lease now.
enum Own {
    /// Nobody held the lease after `epoch`, the epoch of the state.
    Current(u64),
    /// Another router holds a live lease: nothing to do (the reason shown stays).
    Held,
    /// Another router held epoch `newer` after the state's epoch `own`: the state is stale.
    Newer {
        /// The state's epoch.
        own: u64,
        /// The lease record's epoch.
        newer: u64,
    },
    /// The lease record is unreadable: the reason, for `/ready`.
    Unavailable(String),
}

/// The reference's reason for a retained handoff older than the lease (reference-notes 2.9):
/// the document's epoch `doc` and the epoch a claim would get, `claim`.
fn stale_handoff(doc: u64, claim: u64) -> String {
    format!("handoff epoch {doc} cannot precede claimed epoch {claim}")
}

/// The reason a router with outdated state stays out (found by ha_e2e: a fenced primary took
/// the fleet back after the new primary died, with its pre-takeover counters and without the
/// new primary's drain of an engine, which then got traffic again).
fn stale_state(own: u64, newer: u64) -> String {
    format!(
        "stale state: another router controlled the fleet at epoch {newer} after this router's \
         epoch {own}; restart this router with --standby-of the current primary, or with \
         --resume from the newest state file"
    )
}

/// The state a router without a peer holds is the fleet's newest only if no other router held
/// the lease since: the lease record's epoch (which survives expiry and release) must not
/// exceed the epoch of that state, `held` or else the own state file's (0 without one).
async fn own_state(shared: &Shared, held: Option<u64>) -> Own {
    let own = match held {
        Some(e) => e,
        None => {
            let path = std::path::PathBuf::from(&shared.cfg.recovery.state_path);
            match tokio::task::spawn_blocking(move || load_state_file(&path)).await {
                Ok(Loaded::Valid(h)) => h.epoch,
                _ => 0,
            }
        }
    };
    judge_own(own, shared.lease.read_record().await, shared.wall())
}

/// The pure part of [`own_state`]: `record` as read from the lease store at `now_wall`.
fn judge_own(
    own: u64,
    record: Result<Option<crate::lease::LeaseRecord>, crate::lease::LeaseError>,
    now_wall: f64,
) -> Own {
    match record {
        Ok(Some(r)) if r.live(now_wall) && r.epoch > own => Own::Held,
        Ok(Some(r)) if r.epoch > own => Own::Newer {
            own,
            newer: r.epoch,
        },
        Ok(_) => Own::Current(own),
        Err(e) => Own::Unavailable(format!("lease unavailable: {e}")),
    }
}

/// Why `/ready` is 503 between the claim and the end of the identity check (reference-notes
/// 1.3 item 6): the router controls the fleet but serves nothing until every engine's identity
/// was re-checked through its agent (reference-notes 1.2 `identities_ready`, 2.9).
pub(crate) const IDENTITY_PENDING: &str = "engine identity validation pending";

/// Startup of a primary with agents: hold readiness with [`IDENTITY_PENDING`] while every
/// engine's identity is checked through its agent (in the background, so the listeners are
/// up meanwhile), then release the hold unless something else replaced it.
pub(crate) fn hold_until_identities_checked(shared: Arc<Shared>) {
    {
        let mut ha = shared.ha.lock().unwrap_or_else(|p| p.into_inner());
        if ha.failover_blocked.is_empty() {
            ha.failover_blocked = IDENTITY_PENDING.to_string();
        }
    }
    tokio::spawn(async move {
        crate::lifecycle::driver::check_identities(&shared).await;
        let mut ha = shared.ha.lock().unwrap_or_else(|p| p.into_inner());
        if ha.failover_blocked == IDENTITY_PENDING {
            ha.failover_blocked.clear();
        }
    });
}

/// Claims the lease, applies `retained` (or the own state file), re-checks identities, then
/// records the takeover gap (monotonic time since `last_good`, the last good poll) and only
/// then clears the readiness hold, so `/ready` 200 means the takeover is complete.
/// The lease is renewed from the claim on (`opts` and `stop` are for the renew loop, which
/// starts the standby loop again if the lease is lost after the takeover).
async fn take_over(
    shared: &Arc<Shared>,
    source: Source<'_>,
    last_good: Option<Instant>,
    opts: &Option<StandbyOptions>,
    stop: &CancellationToken,
) -> Result<(), Takeover> {
    let epoch = match shared.lease.claim().await {
        Ok(e) => e,
        Err(LeaseLoss::HeldByAnother) => return Err(Takeover::HeldByAnother),
        Err(e) => return Err(Takeover::Failed(e.to_string())),
    };
    let renewal = keep_from(
        shared.clone(),
        opts.clone(),
        stop.clone(),
        Arc::new(AtomicU8::new(PENDING)),
    );
    let renewing = renewal.stop.clone();
    let release = |why: String| async move {
        renewing.cancel();
        // Remember the epoch: it was ours and nobody served under it, so it does not make the
        // retained handoff stale on the next attempt (etcd advances the epoch on every claim).
        shared
            .released_epochs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(epoch);
        let _ = shared.lease.release().await;
        Err(Takeover::Failed(why))
    };
    match source {
        Source::Retained(h) => {
            let only_ours_between = {
                let ours = shared
                    .released_epochs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                (h.epoch + 1..epoch).all(|e| ours.contains(&e))
            };
            if h.epoch != 0 && h.epoch + 1 != epoch && !only_ours_between {
                return release(stale_handoff(h.epoch, epoch)).await;
            }
            if let Err(why) = crate::handoff::apply(shared, h) {
                return release(format!("handoff rejected: {why}")).await;
            }
        }
        // Another router claimed in between the check and our claim. Getting our own epoch
        // back (our record was still live: a renewal failed transiently) is no change of
        // holder: the claim keeps the epoch only for this process's own holder token.
        Source::OwnFile { epoch: own } | Source::Memory { epoch: own }
            if own + 1 != epoch && !(own > 0 && own == epoch) =>
        {
            return release(stale_state(own, epoch - 1)).await;
        }
        Source::OwnFile { .. } => {
            // Never controlled the fleet in this process: its own state file is the best it
            // has (it was not applied if `--resume` was not given).
            if let Some(reason) = crate::handoff::resume(shared) {
                return release(reason).await;
            }
        }
        // A fenced primary's memory is that epoch's state, fresher than its file.
        Source::Memory { .. } => {}
    }
    if shared.lease.control(shared.clock.now()) != Control::Active {
        return release("lease expired while applying handoff".into()).await;
    }
    // Controls the fleet (the identity check runs only then) but is not ready yet: no
    // placement on an engine whose process was not re-checked (found by ha_e2e: `/ready`
    // answered 200 before the agents had been asked).
    set_role(shared, true, false, IDENTITY_PENDING);
    // The agents learn the new epoch from this first fenced call and refuse the old primary's.
    crate::lifecycle::driver::check_identities(shared).await;
    if shared.lease.control(shared.clock.now()) != Control::Active {
        set_role(
            shared,
            false,
            true,
            "lease expired during identity validation",
        );
        return release("lease expired during identity validation".into()).await;
    }
    if !shared.ha().controls_fleet {
        // An agent answered stale_epoch: a newer router exists; `fence` set the reason.
        return release("fenced by an agent during identity validation".into()).await;
    }
    if !renewal.commit() {
        return release("lease lost during the takeover".into()).await;
    }
    let gap = last_good.map(|t| shared.clock.now().saturating_duration_since(t));
    tracing::info!(
        epoch = shared.lease.epoch(),
        gap_s = gap.map(|g| g.as_secs_f64()),
        "took over the fleet"
    );
    if let Some(g) = gap {
        shared.metrics.takeover_gap.set(g.as_secs_f64());
    }
    {
        // Clear only our own hold: a stale-epoch answer during the check may have fenced us.
        let mut ha = shared.ha.lock().unwrap_or_else(|p| p.into_inner());
        if ha.failover_blocked == IDENTITY_PENDING {
            ha.failover_blocked.clear();
        }
    }
    crate::handoff::mark_dirty(shared);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::journal::Journal;
    use narwhal_shared::{Clock, ManualClock, SystemClock};

    fn shared(dir: &std::path::Path, clock: Arc<ManualClock>) -> Arc<Shared> {
        let text = serde_json::json!({
            "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
            "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                        {"iid": "d0", "url": "http://127.0.0.1:2"}],
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
            "recovery": {"state_path": dir.join("state.json")},
            "lease": {"backend": "file", "path": dir.join("lease.json"), "ttl_s": 2,
                      "renew_interval_s": 0.5, "safety_margin_s": 0.5}
        })
        .to_string();
        let cfg = Config::from_json_str(&text, &|_| None).expect("fleet");
        let n = cfg.engines.len();
        let lease = Arc::new(
            crate::lease::LeaseDriver::from_config(&cfg.lease, "standby", clock.clone())
                .expect("file lease"),
        );
        Shared::new(
            Arc::new(cfg),
            clock,
            Journal::disabled("1-deadbeef"),
            4,
            crate::lifecycle::driver::Agents::none(n),
            lease,
        )
    }

    /// Found by ha_e2e: `/ready` answered 200 as soon as the lease was claimed, before the
    /// identity check through the agents, and before the takeover gap was recorded. While the
    /// check runs the router controls the fleet but is not ready; afterwards it is ready and
    /// the gap (since the last good poll) is in the metric.
    #[tokio::test]
    async fn takeover_is_ready_only_after_the_identity_check_and_records_the_gap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1.0e9));
        let sh = shared(dir.path(), clock.clone());
        assert_eq!(sh.lease.claim().await.ok(), Some(1));
        set_role(&sh, true, false, IDENTITY_PENDING);
        let (ready, control_ready, reason) = sh.readiness();
        assert!(!ready);
        assert!(
            control_ready,
            "the identity check needs control of the fleet"
        );
        assert_eq!(reason, IDENTITY_PENDING);
        // Not fenced: it holds the lease (reference-notes 1.4 order gives `degraded`).
        assert_eq!(sh.health_doc()["status"], "degraded");
        assert_eq!(sh.lease.release().await.ok(), Some(true));
        set_role(&sh, false, true, "");

        let last_good = clock.now();
        clock.advance(Duration::from_millis(2500));
        let source = Source::OwnFile { epoch: 1 };
        let stop = CancellationToken::new();
        assert!(
            take_over(&sh, source, Some(last_good), &None, &stop)
                .await
                .is_ok()
        );
        let (ready, _, reason) = sh.readiness();
        assert!(ready, "{reason}");
        assert_eq!(sh.ha().epoch, 2, "the released epoch 1 is followed by 2");
        let m = sh.render_metrics();
        assert!(
            m.lines()
                .any(|l| l == "narwhal_standby_takeover_gap_seconds 2.5"),
            "{m}"
        );
    }

    fn record(epoch: u64, expires_at: f64) -> crate::lease::LeaseRecord {
        crate::lease::LeaseRecord {
            epoch,
            expires_at,
            holder: "other:0".into(),
            schema: crate::lease::LEASE_SCHEMA.into(),
            schema_version: 1,
            updated_at: expires_at - 2.0,
        }
    }

    /// Found by ha_e2e: a fenced primary without `--standby-of` took the fleet back with its
    /// pre-takeover state once the router that replaced it died. It may only when nobody held
    /// the lease after its own epoch.
    #[test]
    fn a_router_without_a_peer_takes_back_only_its_own_latest_epoch() {
        let now = 1000.0;
        // Its own lease lapsed, nobody else claimed: it may claim epoch 8.
        assert!(matches!(
            judge_own(7, Ok(Some(record(7, now - 1.0))), now),
            Own::Current(7)
        ));
        // No record at all (fresh fleet, nothing written yet).
        assert!(matches!(judge_own(0, Ok(None), now), Own::Current(0)));
        // Another router holds a live lease: wait, keeping the fence reason.
        assert!(matches!(
            judge_own(7, Ok(Some(record(8, now + 1.0))), now),
            Own::Held
        ));
        // Another router held epoch 8 and is gone: this state is stale.
        assert!(matches!(
            judge_own(7, Ok(Some(record(8, now - 1.0))), now),
            Own::Newer { own: 7, newer: 8 }
        ));
        let why = stale_state(7, 8);
        assert!(why.starts_with("stale state:"), "{why}");
        assert!(why.contains("epoch 8 after this router's epoch 7"), "{why}");
        assert_eq!(
            stale_handoff(7, 9),
            "handoff epoch 7 cannot precede claimed epoch 9"
        );
        let Own::Unavailable(why) =
            judge_own(7, Err(crate::lease::LeaseError::Config("test".into())), now)
        else {
            panic!("an unreadable lease refuses");
        };
        assert!(why.starts_with("lease unavailable:"), "{why}");
    }

    /// Found by ha_e2e (etcd, loaded machine): after one failed takeover attempt every retry
    /// claimed the next epoch and refused the retained handoff as stale, forever. Epochs this
    /// router claimed and released itself do not make the handoff stale; anyone else's do.
    #[tokio::test]
    async fn own_released_epochs_do_not_make_the_retained_handoff_stale() {
        for ours in [true, false] {
            let dir = tempfile::tempdir().expect("tempdir");
            let clock = Arc::new(ManualClock::new(SystemClock.now(), 1.0e9));
            let sh = shared(dir.path(), clock.clone());
            // The primary served under epoch 1; its handoff is retained.
            assert_eq!(sh.lease.claim().await.ok(), Some(1));
            let mut h = crate::handoff::snapshot(&sh);
            h.epoch = 1;
            assert_eq!(sh.lease.release().await.ok(), Some(true));
            // Epoch 2: a takeover attempt that failed (ours) or another router (not ours).
            assert_eq!(sh.lease.claim().await.ok(), Some(2));
            assert_eq!(sh.lease.release().await.ok(), Some(true));
            if ours {
                sh.released_epochs.lock().unwrap().insert(2);
            }
            let r = take_over(
                &sh,
                Source::Retained(&h),
                None,
                &None,
                &CancellationToken::new(),
            )
            .await;
            if ours {
                assert!(r.is_ok(), "our own failed attempt is no other holder");
                assert_eq!(sh.lease.epoch(), 3);
            } else {
                let Err(Takeover::Failed(why)) = r else {
                    panic!("another holder's epoch makes the handoff stale");
                };
                assert_eq!(why, "handoff epoch 1 cannot precede claimed epoch 3");
            }
        }
    }

    /// A fenced primary whose renewal failed while its record was still live reclaims its own
    /// epoch: that is no change of holder, so it takes the fleet back.
    #[tokio::test]
    async fn a_fenced_primary_reclaims_its_own_live_epoch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1.0e9));
        let sh = shared(dir.path(), clock.clone());
        assert_eq!(sh.lease.claim().await.ok(), Some(1));
        assert!(matches!(own_state(&sh, Some(1)).await, Own::Current(1)));
        assert!(
            take_over(
                &sh,
                Source::Memory { epoch: 1 },
                None,
                &None,
                &CancellationToken::new()
            )
            .await
            .is_ok()
        );
        assert_eq!(sh.ha().epoch, 1);
        assert!(sh.readiness().0);
    }

    /// The claim races another router: the epoch claimed is not the next one after ours.
    #[tokio::test]
    async fn a_claim_after_someone_else_held_the_fleet_is_released() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1.0e9));
        let sh = shared(dir.path(), clock.clone());
        assert_eq!(sh.lease.claim().await.ok(), Some(1));
        assert_eq!(sh.lease.release().await.ok(), Some(true));
        // We last held epoch 0 (never), the store is at 1: claiming gives 2.
        let Err(Takeover::Failed(why)) = take_over(
            &sh,
            Source::Memory { epoch: 0 },
            None,
            &None,
            &CancellationToken::new(),
        )
        .await
        else {
            panic!("must refuse");
        };
        assert!(why.starts_with("stale state:"), "{why}");
        let rec = sh.lease.read_record().await.expect("read").expect("record");
        assert_eq!(rec.epoch, 2);
        assert!(!rec.live(sh.wall()), "released: {rec:?}");
        assert!(!sh.ha().controls_fleet);
    }

    /// Found by ha_e2e: the lease was not renewed during the takeover's identity check. Now
    /// the renew loop runs from the claim; a loss before the takeover commits only fences
    /// (the takeover fails and its standby loop goes on), so no second standby loop starts.
    #[tokio::test]
    async fn the_lease_is_renewed_during_a_takeover_and_a_loss_then_fails_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1.0e9));
        let sh = shared(dir.path(), clock.clone());
        assert_eq!(sh.lease.claim().await.ok(), Some(1));
        set_role(&sh, true, false, IDENTITY_PENDING);
        let stop = CancellationToken::new();
        let phase = Arc::new(AtomicU8::new(PENDING));
        let renewal = keep_from(sh.clone(), None, stop.clone(), phase.clone());
        // Renewals move expires_at with the (manual) wall clock.
        clock.advance(Duration::from_millis(400));
        let renewed = async {
            for _ in 0..300 {
                let rec = sh.lease.read_record().await.expect("read").expect("record");
                if rec.expires_at > 1.0e9 + 2.0 {
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
        std::fs::write(dir.path().join("lease.json"), format!("{other}\n")).expect("write");
        let mut lost = false;
        for _ in 0..300 {
            if phase.load(Ordering::SeqCst) == LOST_WHILE_PENDING {
                lost = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(lost, "the loss is recorded as during the takeover");
        assert!(!sh.ha().controls_fleet, "fenced at once");
        assert!(!renewal.commit(), "the takeover cannot commit");
        stop.cancel();
    }
}
