//! The router's HA phase: whether it controls the fleet and, when not, why
//! (handoff-and-lifecycle.md, "HA handoff"; behaviour.md 1.2–1.4, 2.9, 3.4;
//! architecture.md 9.1 and 9.6).
//!
//! ```text
//!  primary lease loop / standby ──transitions──► Ha (watch::Sender<HaStatus>) ──► subscribers
//!                                                  │  + lease local validity (LeaseDriver)
//!                                                  ▼
//!           readiness() / health() / controls_label(): /ready, /health, /narwhal/lifecycle,
//!           /narwhal/state.ha, narwhal_router_ready, placement (controls_fleet)
//! ```
//!
//! One [`HaPhase`] value replaces the flags (`controls_fleet`, `standby`, a blocked string) the
//! documents used to combine; the documents and the request path derive everything from it,
//! from the lease's local validity, from the lifecycle's readiness hold and from the live
//! engine count, through the pure functions here.

use std::sync::{Arc, Mutex, OnceLock};

use narwhal_shared::{Clock, Fence};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use narwhal_lease::{Control, LeaseDriver, LeaseLoss};

/// Why `/ready` is 503 between a claim and the end of the identity check (behaviour.md 1.3
/// item 6): the router controls the fleet but serves nothing until every engine's identity
/// was re-checked through its agent (behaviour.md 1.2 `identities_ready`, 2.9).
pub(crate) const IDENTITY_PENDING: &str = "engine identity validation pending";

/// Where the router stands in HA (architecture.md 9.1, 9.6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HaPhase {
    /// Controls the fleet and serves (a held lease, or lease backend `none`).
    Active,
    /// Holds the lease and controls the fleet, but engine identities are being re-checked
    /// through the agents (startup with agents, or a takeover): not ready,
    /// [`IDENTITY_PENDING`].
    ValidatingIdentities,
    /// A warm standby following a healthy primary (`/ready` reason `shadowing`).
    Shadowing,
    /// A standby (or a fenced primary waiting to come back) that cannot take over now:
    /// `reason` is shown in `/ready` (`no fresh handoff`, a stale handoff, the lease
    /// unavailable, a failed takeover, a lease refused at startup).
    Blocked {
        /// The `/ready` reason.
        reason: String,
    },
    /// Lost control (a failed renewal, or an agent that saw a newer epoch) and not yet
    /// waiting as a standby.
    Fenced {
        /// The `/ready` reason (the [`LeaseLoss`] text).
        reason: String,
    },
}

impl HaPhase {
    /// The phase holds control of the fleet (subject to the lease's local validity).
    pub(crate) fn holds_control(&self) -> bool {
        matches!(self, HaPhase::Active | HaPhase::ValidatingIdentities)
    }

    /// The standby loop runs (`/narwhal/state.ha.standby`).
    pub(crate) fn standby(&self) -> bool {
        matches!(self, HaPhase::Shadowing | HaPhase::Blocked { .. })
    }

    /// Why the phase itself withdraws readiness (`/narwhal/state.ha.blocked`), `""` when it
    /// does not.
    pub(crate) fn blocked(&self) -> &str {
        match self {
            HaPhase::ValidatingIdentities => IDENTITY_PENDING,
            HaPhase::Blocked { reason } | HaPhase::Fenced { reason } => reason,
            HaPhase::Active | HaPhase::Shadowing => "",
        }
    }
}

/// The published HA state: the phase and the lease epoch and holder token last published
/// with it (`/ready`, `/narwhal/state.ha`, the handoff, agent calls).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HaStatus {
    /// The phase.
    pub(crate) phase: HaPhase,
    /// The lease epoch held when the phase was published; 0 without one.
    pub(crate) epoch: u64,
    /// This process's holder token; `""` for lease backend `none` or before the first claim.
    pub(crate) holder: String,
    /// Another router seen holding a live lease (a standby's or a fenced router's view, from
    /// the lease record), `None` when unknown or when this router controls the fleet.
    pub(crate) controller: Option<Controller>,
}

/// The router that controls the fleet, as a standby saw it in the lease record
/// (`router.controller` of the lifecycle document).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Controller {
    /// Its lease holder token.
    pub(crate) holder: String,
    /// Its lease epoch.
    pub(crate) epoch: u64,
}

/// Whether work started under epoch `scope` may still act (ha-and-fencing.md: a task carries
/// its epoch and never runs under a later one): the phase holds control, the lease is locally
/// valid, and the epoch held now is the task's. Pure; [`Ha::live`] applies it.
pub(crate) fn work_may_run(scope: u64, phase_holds: bool, lease_valid: bool, held: u64) -> bool {
    phase_holds && lease_valid && held == scope
}

/// Whether an agent's `stale_epoch` answer to a call made under epoch `call` fences this
/// router, which holds epoch `held` (ha-and-fencing.md): only a call of the epoch held now proves
/// that a newer router exists; a late answer to a call of an epoch that already ended says nothing
/// about the current one (found by the fault campaign: such answers fenced a router that had
/// just claimed the next epoch, while its renewals went on).
pub(crate) fn stale_answer_fences(call: u64, phase_holds: bool, held: u64) -> bool {
    phase_holds && call == held
}

/// Work bound to one epoch of control (ha-and-fencing.md, EpochScope): lifecycle actions,
/// validation, the identity check. It carries the epoch its agent calls are fenced with, and is
/// cancelled when control under that epoch ends (a fence, a lapse, the standby loop starting); it
/// never becomes valid again, so the work never runs under a later epoch.
#[derive(Debug, Clone)]
pub(crate) struct EpochScope {
    epoch: u64,
    holder: String,
    token: CancellationToken,
}

impl EpochScope {
    /// The epoch the work runs under.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The fence token its agent calls carry (this epoch, never a later one).
    pub(crate) fn fence(&self) -> Fence {
        Fence {
            epoch: self.epoch,
            holder: self.holder.clone(),
        }
    }

    /// Resolves when control under this epoch ended.
    pub(crate) async fn ended(&self) {
        self.token.cancelled().await;
    }
}

/// Readiness as `/ready` reports it (behaviour.md 1.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Readiness {
    /// `/ready` answers 200.
    pub(crate) ready: bool,
    /// `control_ready`: the router controls the fleet.
    pub(crate) control_ready: bool,
    /// Why not ready, in the reference's order; `""` when ready.
    pub(crate) reason: String,
}

/// Readiness from the phase, `controls` (the phase holds control and the lease is locally
/// valid), the lifecycle's readiness hold (`whole-wave drain <id>`, ...) and the live engine
/// count. Reasons in order: the phase's own, the lifecycle hold, `shadowing`, `lease
/// expired`, `no available engines`.
pub(crate) fn readiness(
    phase: &HaPhase,
    controls: bool,
    hold: Option<&str>,
    live: usize,
) -> Readiness {
    let reason = match (phase.blocked(), hold) {
        (blocked, _) if !blocked.is_empty() => blocked.to_string(),
        (_, Some(hold)) => hold.to_string(),
        _ if *phase == HaPhase::Shadowing => "shadowing".into(),
        _ if !controls => "lease expired".into(),
        _ if live == 0 => "no available engines".into(),
        _ => String::new(),
    };
    Readiness {
        ready: reason.is_empty(),
        control_ready: controls,
        reason,
    }
}

/// `/health` `status` (behaviour.md 1.4 order): `ok` when ready; `fenced` for a phase
/// blocked by anything but the identity check, or a router that lost control outside the
/// standby loop; `maintenance` under a lifecycle hold; `standby`; else `degraded`.
pub(crate) fn health(
    phase: &HaPhase,
    controls: bool,
    hold: Option<&str>,
    ready: bool,
) -> &'static str {
    let blocked = phase.blocked();
    if ready {
        "ok"
    } else if (!blocked.is_empty() && blocked != IDENTITY_PENDING)
        || (!phase.standby() && !controls)
    {
        "fenced"
    } else if hold.is_some() {
        "maintenance"
    } else if phase.standby() {
        "standby"
    } else {
        "degraded"
    }
}

/// `router.controls_fleet` of the lifecycle document (architecture.md 9.1): `active`, `standby`
/// (shadowing a healthy primary) or `fenced`.
pub(crate) fn controls_label(phase: &HaPhase, controls: bool) -> &'static str {
    if controls {
        "active"
    } else if *phase == HaPhase::Shadowing {
        "standby"
    } else {
        "fenced"
    }
}

/// The HA handle: owns the published [`HaStatus`] (a watch channel: anyone may subscribe) and
/// reads the lease's local validity, so a lapsed lease stops control at once even before the
/// renew loop notices (behaviour.md 3.4).
pub(crate) struct Ha {
    status: watch::Sender<HaStatus>,
    lease: Arc<LeaseDriver>,
    clock: Arc<dyn Clock>,
    resume_refused: OnceLock<String>,
    /// The scope of the epoch controlled now, created on first use ([`Ha::scope`]).
    scope: Mutex<Option<EpochScope>>,
    /// Serialises handoff publishes; holds the content key of the last one that succeeded.
    published: tokio::sync::Mutex<Option<String>>,
}

/// One consistent reading of the HA state for a document.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HaView {
    /// The published status.
    pub(crate) status: HaStatus,
    /// The phase holds control and the lease is locally valid now.
    pub(crate) controls: bool,
}

impl Ha {
    /// A handle starting in `phase` (epoch 0, no holder yet) over `lease`.
    pub(crate) fn new(lease: Arc<LeaseDriver>, clock: Arc<dyn Clock>, phase: HaPhase) -> Ha {
        let (status, _) = watch::channel(HaStatus {
            phase,
            epoch: 0,
            holder: String::new(),
            controller: None,
        });
        Ha {
            status,
            lease,
            clock,
            resume_refused: OnceLock::new(),
            scope: Mutex::new(None),
            published: tokio::sync::Mutex::new(None),
        }
    }

    /// The router lease.
    pub(crate) fn lease(&self) -> &Arc<LeaseDriver> {
        &self.lease
    }

    /// The handoff publisher's slot (`crate::handoff::publish`): taken for the whole of one
    /// publish, it holds the content key of the last document published successfully.
    pub(crate) fn published(&self) -> &tokio::sync::Mutex<Option<String>> {
        &self.published
    }

    /// A receiver of every published change: the phase, the epoch and holder, the known
    /// controller. Parts that decide for the fleet (the HA supervisor, a role controller)
    /// watch it and stop deciding when the phase no longer holds control; work they start
    /// runs under an [`EpochScope`] ([`Ha::scope`]).
    pub(crate) fn subscribe(&self) -> watch::Receiver<HaStatus> {
        self.status.subscribe()
    }

    /// The scope of the epoch this router controls the fleet under now, `None` when it does
    /// not control it. Work started with it stops when that epoch ends ([`EpochScope::ended`],
    /// [`Ha::live`]).
    pub(crate) fn scope(&self) -> Option<EpochScope> {
        let (holds, epoch, holder) = {
            let s = self.status.borrow();
            (s.phase.holds_control(), s.epoch, s.holder.clone())
        };
        let held = self.lease.epoch();
        let mut slot = self.scope.lock().unwrap_or_else(|p| p.into_inner());
        if !work_may_run(held, holds, self.lease_active(), held) || epoch != held {
            if let Some(old) = slot.take() {
                old.token.cancel();
            }
            return None;
        }
        match slot.as_ref() {
            Some(sc) if sc.epoch == held && !sc.token.is_cancelled() => Some(sc.clone()),
            _ => {
                if let Some(old) = slot.take() {
                    old.token.cancel();
                }
                let sc = EpochScope {
                    epoch: held,
                    holder,
                    token: CancellationToken::new(),
                };
                *slot = Some(sc.clone());
                Some(sc)
            }
        }
    }

    /// Whether work of `scope` may act now ([`work_may_run`]); when not, the scope is ended
    /// for everyone waiting on it.
    pub(crate) fn live(&self, scope: &EpochScope) -> bool {
        let holds = self.status.borrow().phase.holds_control();
        let ok = !scope.token.is_cancelled()
            && work_may_run(scope.epoch, holds, self.lease_active(), self.lease.epoch());
        if !ok {
            scope.token.cancel();
        }
        ok
    }

    /// Ends the current scope (control under its epoch is over).
    fn end_scope(&self) {
        if let Some(old) = self.scope.lock().unwrap_or_else(|p| p.into_inner()).take() {
            old.token.cancel();
        }
    }

    /// An agent answered `stale_epoch` to a call made under epoch `call`: when that is the
    /// epoch held now ([`stale_answer_fences`]) a newer router exists, so this one is fenced
    /// and gives up the lease locally (the renew loop stops). Returns whether it fenced.
    pub(crate) fn stale_answer(&self, call: u64) -> bool {
        let holds = self.status.borrow().phase.holds_control();
        if !stale_answer_fences(call, holds, self.lease.epoch()) {
            return false;
        }
        self.lease.relinquish(call, LeaseLoss::HeldByAnother);
        self.fence(&LeaseLoss::HeldByAnother);
        true
    }

    /// Records the router seen controlling the fleet (a standby's view of the lease record);
    /// `None` when unknown.
    pub(crate) fn set_controller(&self, controller: Option<Controller>) {
        self.status.send_if_modified(|s| {
            let changed = s.controller != controller;
            s.controller = controller;
            changed
        });
    }

    /// Whether the phase holds control and the lease is locally valid now.
    pub(crate) fn controls_fleet(&self) -> bool {
        self.status.borrow().phase.holds_control() && self.lease_active()
    }

    fn lease_active(&self) -> bool {
        self.lease.control(self.clock.now()) == Control::Active
    }

    /// Runs `f` over the phase and control now, without copying the status (the request
    /// path).
    pub(crate) fn with_phase<R>(&self, f: impl FnOnce(&HaPhase, bool) -> R) -> R {
        let status = self.status.borrow();
        let controls = status.phase.holds_control() && self.lease_active();
        f(&status.phase, controls)
    }

    /// The published status and control now.
    pub(crate) fn view(&self) -> HaView {
        let status = self.status.borrow().clone();
        let controls = status.phase.holds_control() && self.lease_active();
        HaView { status, controls }
    }

    /// The phase now.
    #[cfg(test)]
    pub(crate) fn phase(&self) -> HaPhase {
        self.status.borrow().phase.clone()
    }

    /// Publishes `phase` with the lease's current epoch and holder token. A phase that holds
    /// control clears the known controller (it is this router); one that does not ends the
    /// current [`EpochScope`].
    pub(crate) fn publish(&self, phase: HaPhase) {
        let (epoch, holder) = (self.lease.epoch(), self.lease.holder());
        let holds = phase.holds_control();
        self.status.send_modify(|s| {
            let controller = if holds { None } else { s.controller.take() };
            *s = HaStatus {
                phase,
                epoch,
                holder,
                controller,
            };
        });
        if !holds {
            self.end_scope();
        }
    }

    /// Fences the router: it no longer controls the fleet (`/health` `fenced`, `/ready` 503
    /// with the reason, lifecycle actions 503, no new placements). A standby stays a standby
    /// with the reason; epoch and holder stay as published.
    pub(crate) fn fence(&self, loss: &LeaseLoss) {
        let reason = match loss {
            LeaseLoss::HeldByAnother => "lease held by another router".to_string(),
            LeaseLoss::Lapsed => "lease renewal failed".to_string(),
            LeaseLoss::Unavailable(e) => format!("lease unavailable: {e}"),
            LeaseLoss::Unconfirmed(e) => {
                format!("lease store did not confirm a write, which may have landed: {e}")
            }
        };
        self.status.send_modify(|s| {
            s.phase = if s.phase.standby() {
                HaPhase::Blocked { reason }
            } else {
                HaPhase::Fenced { reason }
            };
        });
        self.end_scope();
    }

    /// Fences the router like [`Ha::fence`] with a reason that is not a lease loss: an agent
    /// that accepted a newer router epoch (`lifecycle::agents::stale_epoch_reason`), so
    /// `/ready`, `/narwhal/state.ha.blocked` and `narwhalctl status` name the cause.
    pub(crate) fn fence_because(&self, reason: String) {
        self.status.send_modify(|s| {
            s.phase = if s.phase.standby() {
                HaPhase::Blocked { reason }
            } else {
                HaPhase::Fenced { reason }
            };
        });
    }

    /// The standby loop starts: a fenced router keeps its reason as a blocked standby, any
    /// other phase becomes `Shadowing`.
    pub(crate) fn enter_standby(&self) {
        self.status.send_modify(|s| {
            s.phase = match std::mem::replace(&mut s.phase, HaPhase::Shadowing) {
                HaPhase::Fenced { reason } | HaPhase::Blocked { reason } => {
                    HaPhase::Blocked { reason }
                }
                HaPhase::Active | HaPhase::ValidatingIdentities | HaPhase::Shadowing => {
                    HaPhase::Shadowing
                }
            };
        });
        self.end_scope();
    }

    /// An active router starts its identity check ([`IDENTITY_PENDING`]); any other phase
    /// is left as it is.
    pub(crate) fn begin_identity_check(&self) {
        self.status.send_if_modified(|s| {
            let starts = s.phase == HaPhase::Active;
            if starts {
                s.phase = HaPhase::ValidatingIdentities;
            }
            starts
        });
    }

    /// The identity check finished: a router still validating becomes `Active` (one fenced
    /// meanwhile keeps its reason).
    pub(crate) fn end_identity_check(&self) {
        self.status.send_if_modified(|s| {
            let ends = s.phase == HaPhase::ValidatingIdentities;
            if ends {
                s.phase = HaPhase::Active;
            }
            ends
        });
    }

    /// Records why `--resume` refused the state file (`/narwhal/state.ha.resume`).
    pub(crate) fn set_resume_refused(&self, reason: &str) {
        let _ = self.resume_refused.set(reason.to_string());
    }

    /// Why `--resume` refused the state file, if it did.
    pub(crate) fn resume_refused(&self) -> Option<&str> {
        self.resume_refused.get().map(String::as_str)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn blocked(reason: &str) -> HaPhase {
        HaPhase::Blocked {
            reason: reason.into(),
        }
    }

    fn fenced(reason: &str) -> HaPhase {
        HaPhase::Fenced {
            reason: reason.into(),
        }
    }

    /// `/ready` reasons in the reference's order (behaviour.md 1.3), and `control_ready`
    /// following control, not readiness.
    #[test]
    fn readiness_reasons_follow_the_reference_order() {
        let r = |p: &HaPhase, controls, hold, live| readiness(p, controls, hold, live);
        assert_eq!(r(&HaPhase::Active, true, None, 1).reason, "");
        assert!(r(&HaPhase::Active, true, None, 1).ready);
        assert_eq!(
            r(&HaPhase::Active, true, None, 0).reason,
            "no available engines"
        );
        assert!(r(&HaPhase::Active, true, None, 0).control_ready);
        assert_eq!(r(&HaPhase::Active, false, None, 1).reason, "lease expired");
        assert_eq!(r(&HaPhase::Shadowing, false, None, 1).reason, "shadowing");
        let wave = Some("whole-wave drain wave-1");
        assert_eq!(
            r(&HaPhase::Shadowing, false, wave, 1).reason,
            "whole-wave drain wave-1",
            "a lifecycle hold comes before shadowing"
        );
        let v = r(&HaPhase::ValidatingIdentities, true, wave, 1);
        assert_eq!(
            (v.ready, v.control_ready, v.reason.as_str()),
            (false, true, IDENTITY_PENDING)
        );
        assert_eq!(
            r(&fenced("lease renewal failed"), false, wave, 1).reason,
            "lease renewal failed"
        );
        assert_eq!(
            r(&blocked("no fresh handoff"), false, None, 1).reason,
            "no fresh handoff"
        );
    }

    /// `/health` status per phase (behaviour.md 1.4): an identity check is `degraded`, not
    /// `fenced`; a blocked standby is `fenced`; a shadowing one `standby`.
    #[test]
    fn health_follows_the_phase() {
        let h = |p: &HaPhase, controls, hold: Option<&str>| {
            let ready = readiness(p, controls, hold, 1).ready;
            health(p, controls, hold, ready)
        };
        assert_eq!(h(&HaPhase::Active, true, None), "ok");
        assert_eq!(h(&HaPhase::ValidatingIdentities, true, None), "degraded");
        assert_eq!(h(&HaPhase::ValidatingIdentities, false, None), "fenced");
        assert_eq!(h(&HaPhase::Active, false, None), "fenced", "lease lapsed");
        assert_eq!(
            h(&HaPhase::Active, true, Some("whole-wave drain w")),
            "maintenance"
        );
        assert_eq!(h(&HaPhase::Shadowing, false, None), "standby");
        assert_eq!(h(&blocked("no fresh handoff"), false, None), "fenced");
        assert_eq!(
            h(&fenced("lease held by another router"), false, None),
            "fenced"
        );
        assert_eq!(
            controls_label(&HaPhase::ValidatingIdentities, true),
            "active"
        );
        assert_eq!(controls_label(&HaPhase::Shadowing, false), "standby");
        assert_eq!(controls_label(&blocked("x"), false), "fenced");
        assert_eq!(controls_label(&HaPhase::Active, false), "fenced");
    }

    fn handle() -> Ha {
        let clock: Arc<dyn Clock> = Arc::new(narwhal_shared::SystemClock);
        let fleet = serde_json::json!({
            "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
            "engines": [{"iid": "d0", "url": "http://127.0.0.1:2"}],
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1}
        });
        let cfg = crate::config::Config::from_json_str(&fleet.to_string(), &|_| None)
            .expect("fleet without a lease section");
        let lease = narwhal_lease::LeaseDriver::from_config(&cfg.lease, "test", clock.clone())
            .expect("lease none");
        Ha::new(Arc::new(lease), clock, HaPhase::Active)
    }

    /// The transitions the lease loop and the standby make, as subscribers see them.
    #[test]
    fn transitions_are_published_on_the_watch_channel() {
        let ha = handle();
        let mut rx = ha.subscribe();
        assert!(ha.controls_fleet(), "backend none: always locally valid");
        ha.begin_identity_check();
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().phase, HaPhase::ValidatingIdentities);
        assert!(ha.controls_fleet(), "the check needs control");
        ha.fence(&LeaseLoss::Lapsed);
        assert_eq!(ha.phase(), fenced("lease renewal failed"));
        assert!(!ha.controls_fleet());
        ha.end_identity_check();
        assert_eq!(
            ha.phase(),
            fenced("lease renewal failed"),
            "a fence during the check is kept"
        );
        ha.enter_standby();
        assert_eq!(ha.phase(), blocked("lease renewal failed"));
        ha.fence(&LeaseLoss::Unavailable("etcd down".into()));
        assert_eq!(
            ha.phase(),
            blocked("lease unavailable: etcd down"),
            "a standby stays a standby"
        );
        ha.publish(HaPhase::Shadowing);
        ha.begin_identity_check();
        assert_eq!(
            ha.phase(),
            HaPhase::Shadowing,
            "only an active router checks"
        );
        ha.publish(HaPhase::Active);
        ha.enter_standby();
        assert_eq!(ha.phase(), HaPhase::Shadowing);
        let s = rx.borrow_and_update().clone();
        assert_eq!((s.epoch, s.holder.as_str()), (0, ""));
    }

    /// A router with a 2 s file lease in `dir`, on a manual clock, starting as a standby.
    pub(crate) fn leased(
        dir: &std::path::Path,
    ) -> (
        std::sync::Arc<crate::parts::Parts>,
        std::sync::Arc<narwhal_shared::ManualClock>,
    ) {
        use narwhal_shared::Clock as _;
        let clock = Arc::new(narwhal_shared::ManualClock::new(
            narwhal_shared::SystemClock.now(),
            1.0e9,
        ));
        let parts = crate::parts::for_test(
            serde_json::json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m",
                "backend": "vllm",
                "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                            {"iid": "d0", "url": "http://127.0.0.1:2"}],
                "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                "recovery": {"state_path": dir.join("state.json")},
                "lease": {"backend": "file", "path": dir.join("lease.json"),
                          "ttl_s": 2, "renew_interval_s": 0.5, "safety_margin_s": 0.5}
            }),
            clock.clone(),
            "router",
        );
        parts.ha.publish(HaPhase::Shadowing);
        (parts, clock)
    }

    /// ha-and-fencing.md: work carries the epoch it started in and ends with it: a fence, a lapse
    /// of the lease, or the standby loop ends its scope for good, and a later tenure (even of the
    /// same epoch, a reclaimed own lease) never revives it.
    #[tokio::test]
    async fn an_epoch_scope_ends_with_its_epoch_and_never_revives() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (parts, clock) = leased(dir.path());
        let ha = &parts.ha;
        assert!(ha.scope().is_none(), "a standby has no scope");
        assert_eq!(ha.lease().claim().await, Ok(1));
        ha.publish(HaPhase::Active);
        let first = ha.scope().expect("controls under epoch 1");
        assert_eq!(first.epoch(), 1);
        assert_eq!(first.fence().epoch, 1);
        assert!(ha.live(&first));
        let again = ha.scope().expect("the same tenure");
        ha.fence(&LeaseLoss::Lapsed);
        assert!(first.token.is_cancelled(), "ended with the fence");
        assert!(again.token.is_cancelled(), "one scope per tenure");
        assert!(!ha.live(&first));
        assert!(ha.scope().is_none());
        // The same epoch reclaimed (its own live record): a new tenure, the old work stays dead.
        assert_eq!(ha.lease().claim().await, Ok(1));
        ha.publish(HaPhase::Active);
        let second = ha.scope().expect("controls again");
        assert!(!second.token.is_cancelled(), "a new tenure");
        assert!(!ha.live(&first), "never revived");
        assert!(ha.live(&second));
        // A lapse of local validity (no renewal for ttl - margin) ends it as well.
        clock.advance(std::time::Duration::from_millis(1500));
        assert!(!ha.live(&second));
        assert!(second.token.is_cancelled());
        tokio::time::timeout(std::time::Duration::from_millis(100), second.ended())
            .await
            .expect("ended() resolves");
        // The standby loop ends a scope too.
        clock.advance(std::time::Duration::from_secs(5));
        assert_eq!(ha.lease().claim().await, Ok(2));
        ha.publish(HaPhase::Active);
        let third = ha.scope().expect("epoch 2");
        ha.enter_standby();
        assert!(!ha.live(&third));
    }

    /// ha-and-fencing.md: only a `stale_epoch` answer to a call of the epoch held now fences; a
    /// late answer to a call of an earlier epoch (work of a tenure that ended) does not. The fence
    /// also gives the lease up locally, so the renew loop stops.
    #[tokio::test]
    async fn only_a_stale_answer_for_the_epoch_held_fences() {
        assert!(stale_answer_fences(3, true, 3));
        assert!(
            !stale_answer_fences(2, true, 3),
            "a call of an earlier epoch"
        );
        assert!(!stale_answer_fences(3, false, 3), "not in control anyway");
        assert!(work_may_run(3, true, true, 3));
        assert!(!work_may_run(2, true, true, 3), "never under a later epoch");
        assert!(!work_may_run(3, true, false, 3), "lease lapsed");
        assert!(
            !work_may_run(3, false, true, 3),
            "phase does not hold control"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let (parts, _clock) = leased(dir.path());
        let ha = &parts.ha;
        assert_eq!(ha.lease().claim().await, Ok(1));
        assert_eq!(ha.lease().release().await.ok(), Some(true));
        assert_eq!(ha.lease().claim().await, Ok(2));
        ha.publish(HaPhase::Active);
        assert!(!ha.stale_answer(1), "epoch 1's late answer");
        assert!(ha.controls_fleet());
        assert_eq!(ha.lease().epoch(), 2);
        assert!(ha.stale_answer(2));
        assert!(!ha.controls_fleet());
        assert_eq!(ha.phase(), fenced("lease held by another router"));
        assert_eq!(
            ha.lease().epoch(),
            0,
            "the lease is given up: no more renewals"
        );
        assert_eq!(ha.lease().renew().await, Err(LeaseLoss::HeldByAnother));
    }

    /// A standby names the router it saw controlling; taking control clears it.
    #[test]
    fn the_controller_seen_is_published_until_this_router_controls() {
        let ha = handle();
        let mut rx = ha.subscribe();
        ha.publish(HaPhase::Shadowing);
        let c = Controller {
            holder: "primary:1".into(),
            epoch: 4,
        };
        ha.set_controller(Some(c.clone()));
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().controller, Some(c.clone()));
        ha.set_controller(Some(c));
        assert!(!rx.has_changed().unwrap(), "unchanged: nothing sent");
        ha.publish(HaPhase::Shadowing);
        assert!(
            ha.view().status.controller.is_some(),
            "kept while a standby"
        );
        ha.publish(HaPhase::Active);
        assert_eq!(ha.view().status.controller, None);
    }
}
