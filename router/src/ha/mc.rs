//! A bounded exhaustive model check of the HA and lifecycle protocol with `stateright`
//! (docs/design/model-check.md): every interleaving, up to the bounds, of two routers, the
//! lease store, two engine agents with their epoch fences, an operator, engines that restart,
//! a network that delays, reorders and drops the agents' calls, and the faults (kill, pause
//! past the TTL, lease store unavailable, a wall clock that jumps).
//!
//! The transitions are the product's own pure cores, not copies: the lease core ([`Lease`]:
//! claim, renew, publish guard, validity, observer), the standby machine ([`Standby`]), the
//! epoch-scope rules ([`work_may_run`], [`stale_answer_fences`]), the lifecycle core
//! ([`Lifecycle`]: drain, wave, readmit, cancel, export and restore of the handoff's
//! lifecycle part), the readmission checks ([`validate`], run against the model's engines
//! through the agents' fences) and the agent's fence rule ([`narwhal_agent::decide`]). What
//! the async drivers do around them is mirrored as `ha::model` (the proptest) mirrors it: one
//! driver step per model action.
//!
//! Time is discrete: one tick is one second of both the monotonic clock and every router's
//! wall clock (plus its jump), so the state space is finite. Within a tick the actions of the
//! routers, the agents, the operator and the faults interleave in every order; the tick only
//! advances once every running router has done what is due (a paused router does nothing
//! until its pause ends: what it missed is then overdue and runs in any order).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use narwhal_agent::{Decision, FenceState, decide};
use narwhal_lease::{Claim, Lease, LeaseError, LeaseLoss, LeaseRecord, LeaseTiming};
use narwhal_shared::handoff::Handoff;
use narwhal_shared::{Clock as _, SystemClock};
use stateright::actor::{Envelope, Id, Network};
use stateright::{Checker, Model, Property};

use super::machine::tests::doc_of;
use super::machine::{ApplyFailed, Poll, Seen, Settings, Source, Standby, Step, next_wait_ms};
use crate::ha_phase::{stale_answer_fences, work_may_run};
use crate::handoff::{PublishError, ReadPublishedError};
use crate::lifecycle::check_error::CheckError;
use crate::lifecycle::machine::{DrainRequest, EngineOutcome, Lifecycle, Now, RestartPolicy};
use crate::lifecycle::validation::{Attested, Checks, Identity, Plan, Role, validate};

/// One tick, ms.
const TICK_MS: u64 = 1000;
/// Lease ttl, renew interval and safety margin, ms (`ttl > renew + margin`).
const TTL_MS: u64 = 3000;
const RENEW_MS: u64 = 1000;
const MARGIN_MS: u64 = 500;
/// A pause (`SIGSTOP`) lasts this many ticks: past the TTL.
const PAUSE_TICKS: u8 = 4;
/// The lease store is unavailable for this many ticks.
const STORE_DOWN_TICKS: u8 = 2;
/// A wall clock jump, seconds.
const JUMP_S: f64 = 30.0;
/// The engines: a prefill and a decode, each on its own host with its own agent.
const ENGINES: [&str; 2] = ["p0", "d0"];
const ROUTERS: usize = 2;
/// Agents' network ids (routers are `0..ROUTERS`).
const AGENT_ID: usize = 10;

/// How far the search goes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    /// The last tick at which a fault may start.
    pub fault_until: u8,
    /// Ticks after `fault_until` (plus the longest fault) before the run ends, within which
    /// some router must control the fleet again.
    pub settle: u8,
    /// Faults in a run (kill, pause, store down, clock jump).
    pub faults: u8,
    /// Operator actions in a run.
    pub ops: u8,
    /// The last tick at which the operator acts.
    pub op_until: u8,
    /// Engine restarts in a run.
    pub restarts: u8,
    /// Requests served (totals) in a run.
    pub serves: u8,
    /// Messages the network drops in a run.
    pub drops: u8,
    /// The most ticks a message stays in flight (to a running receiver): the clock does not
    /// pass `sent + delay` before it is delivered or dropped.
    pub delay: u8,
}

impl Bounds {
    /// The last tick.
    fn end(&self) -> u8 {
        self.fault_until + PAUSE_TICKS + self.settle
    }
}

/// Which protocol rules the model applies: all of the product's, or one replaced by its
/// known-wrong variant, so a test can show that the properties catch the mistake. Only the
/// model's mirror of the drivers changes; the product's code paths are the same either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rules {
    /// The product's rules.
    Product,
    /// The agent accepts every epoch (its fence's `stale_epoch` answer removed).
    NoAgentFence,
    /// A lifecycle action is answered 200 before its state is published beside the lease.
    AckBeforePublish,
    /// Readmission validates the process without asking for a newer one (the driver's
    /// `restart_after` left out of the plan).
    NoRestartCheck,
}

/// A message between a router and an agent.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Msg {
    /// A drain's identity capture through engine `engine`'s agent, under `epoch` of the
    /// sender's scope `tenure`.
    Capture {
        epoch: u64,
        tenure: u8,
        engine: u8,
        sent: u8,
    },
    /// The agent's answer: the process start, or `stale_epoch` with its highest epoch.
    Captured {
        sent: u8,
        epoch: u64,
        tenure: u8,
        engine: u8,
        answer: Result<u64, u64>,
    },
}

/// What the operator asks of the controlling router.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Op {
    /// `POST /narwhal/lifecycle/drain` of engine `e`.
    Drain(u8),
    /// `POST /narwhal/lifecycle/readmit` of engine `e` (a newer process required).
    Readmit(u8),
    /// Cancel-drain of engine `e` (validated on the process its drain recorded).
    Cancel(u8),
    /// A whole-wave drain.
    Wave,
    /// The wave's readmission.
    WaveReadmit,
}

/// A model action.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Action {
    /// The clock advances one tick.
    Tick,
    /// Router `i`'s renew loop.
    Renew(usize),
    /// Router `i`'s standby tick.
    Standby(usize),
    /// Router `i`'s takeover identity check ends.
    Validated(usize),
    /// Router `i`'s supervisor sees control ended and starts the standby loop.
    Supervise(usize),
    /// Router `i`'s pending lifecycle action is published and answered.
    Ack(usize),
    /// The operator's request to router `i`.
    Operate(usize, Op),
    /// Router `i` serves a request (its totals grow).
    Serve(usize),
    /// A client reads router `i`'s totals.
    Read(usize),
    /// The network delivers or drops a message.
    Deliver(Envelope<Msg>),
    Drop(Envelope<Msg>),
    /// Router `i` is killed (`kill -9`; only while the other lives).
    Kill(usize),
    /// Router `i` is paused for [`PAUSE_TICKS`].
    Pause(usize),
    /// The lease store is unavailable for [`STORE_DOWN_TICKS`].
    StoreDown,
    /// Router `i`'s wall clock jumps [`JUMP_S`] ahead.
    Jump(usize),
    /// Engine `e` restarts (a new process, a newer start).
    Restart(u8),
}

#[derive(Debug, Clone, PartialEq)]
enum Mode {
    Active,
    /// A takeover's identity check, ending at tick `until`.
    Validating {
        until: u8,
        epoch: u64,
    },
    Fenced,
    Standby,
}

/// A lifecycle action applied and awaiting its answer: the engines it changed, with their
/// action numbers, and the (epoch, tenure) scope it ran in.
#[derive(Debug, Clone)]
struct Pending {
    engines: Vec<(u8, u8)>,
    scope: (u64, u8),
}

#[derive(Debug, Clone)]
struct Router {
    holder: String,
    alive: bool,
    paused_until: u8,
    wall_jump: f64,
    lease: Lease,
    mode: Mode,
    machine: Option<Standby>,
    primary: bool,
    renewing: bool,
    renew_next: u8,
    standby_next: u8,
    tenure: u8,
    scope_open: bool,
    claimed: u64,
    controlled: u64,
    lifecycle: Lifecycle,
    served: u64,
    /// Per engine: how many lifecycle actions on it this router's state holds (published
    /// with the lifecycle part, so a successor's count says which actions it took over).
    seq: [u8; 2],
    pending: Option<Pending>,
}

/// Ghost state: what the properties look back on.
#[derive(Debug, Clone, Default)]
struct Ghost {
    /// Per engine: the last acknowledged action's number and whether it left the engine held.
    acked: [Option<(u8, bool)>; 2],
    /// The highest total a client was shown.
    read_max: u64,
    /// Property breaches seen on a transition (the state predicates below read them).
    older_epoch: bool,
    acting: bool,
    /// A takeover applied something other than the published state or its own memory.
    unpublished_takeover: bool,
    readmission: bool,
    backwards: bool,
}

/// Everything but the network.
#[derive(Debug, Clone)]
pub(super) struct World {
    t: u8,
    record: Option<LeaseRecord>,
    published: Option<Box<Handoff>>,
    store_down_until: u8,
    routers: Vec<Router>,
    agents: Vec<FenceState>,
    /// Per engine: its process start (seconds); a restart makes it newer.
    starts: [u64; 2],
    faults: u8,
    ops: u8,
    restarts: u8,
    serves: u8,
    drops: u8,
    ghost: Ghost,
}

impl PartialEq for State {
    fn eq(&self, other: &State) -> bool {
        self.net == other.net && format!("{:?}", self.w) == format!("{:?}", other.w)
    }
}

impl Eq for State {}

/// A model state.
#[derive(Debug, Clone)]
pub(super) struct State {
    net: Network<Msg>,
    w: World,
}

/// The cores hold instants and wall seconds (not `Hash`): a state is identified by its
/// rendering, which names every field (instants are the model's base plus whole ticks, so two
/// paths to one state render alike). The network hashes as a multiset.
impl Hash for State {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.net.hash(h);
        format!("{:?}", self.w).hash(h);
    }
}

fn timing() -> LeaseTiming {
    LeaseTiming {
        ttl: Duration::from_millis(TTL_MS),
        renew_interval: Duration::from_millis(RENEW_MS),
        safety_margin: Duration::from_millis(MARGIN_MS),
    }
}

fn agent_id(e: usize) -> Id {
    Id::from(AGENT_ID + e)
}

fn engines() -> Vec<String> {
    ENGINES.iter().map(|s| s.to_string()).collect()
}

/// The model: bounds, rules and the base instant of the monotonic clock.
pub(super) struct Narwhal {
    /// How far the search goes.
    pub bounds: Bounds,
    /// The product's rules, or one swapped (tests only).
    pub rules: Rules,
    base: Instant,
}

impl Narwhal {
    pub(super) fn new(bounds: Bounds, rules: Rules) -> Narwhal {
        Narwhal {
            bounds,
            rules,
            base: SystemClock.now(),
        }
    }

    fn mono(&self, w: &World) -> Instant {
        self.base + Duration::from_millis(u64::from(w.t) * TICK_MS)
    }

    fn wall(&self, w: &World, i: usize) -> f64 {
        1000.0 + f64::from(w.t) * (TICK_MS as f64 / 1000.0) + w.routers[i].wall_jump
    }

    fn now(&self, w: &World, i: usize) -> Now {
        Now {
            mono: self.mono(w),
            wall: self.wall(w, i),
        }
    }

    fn store_up(&self, w: &World) -> bool {
        w.t >= w.store_down_until
    }

    fn running(&self, w: &World, i: usize) -> bool {
        w.routers[i].alive && w.routers[i].paused_until <= w.t
    }

    fn holds(&self, w: &World, i: usize) -> bool {
        matches!(w.routers[i].mode, Mode::Active | Mode::Validating { .. })
    }

    /// `Ha::controls_fleet`: alive, the phase holds control and the lease is locally valid.
    fn controls(&self, w: &World, i: usize) -> bool {
        w.routers[i].alive && self.holds(w, i) && w.routers[i].lease.is_valid(self.mono(w))
    }

    fn held(&self, w: &World, i: usize) -> u64 {
        w.routers[i].lease.epoch().unwrap_or(0)
    }

    /// `Ha::fence` (with `Ha::end_scope`).
    fn fence(&self, w: &mut World, i: usize) {
        let r = &mut w.routers[i];
        if matches!(r.mode, Mode::Active | Mode::Validating { .. }) {
            r.mode = Mode::Fenced;
        }
        r.scope_open = false;
    }

    /// `Ha::scope`: the scope of the epoch controlled now, opened on first use.
    fn scope(&self, w: &mut World, i: usize) -> Option<(u64, u8)> {
        if !self.controls(w, i) {
            return None;
        }
        let epoch = self.held(w, i);
        let r = &mut w.routers[i];
        if !r.scope_open {
            r.tenure += 1;
            r.scope_open = true;
        }
        Some((epoch, r.tenure))
    }

    /// `Ha::live` for work of scope (epoch, tenure).
    fn live(&self, w: &World, i: usize, epoch: u64, tenure: u8) -> bool {
        let r = &w.routers[i];
        r.scope_open
            && r.tenure == tenure
            && work_may_run(
                epoch,
                self.holds(w, i),
                r.lease.is_valid(self.mono(w)),
                self.held(w, i),
            )
    }

    /// The agent of engine `e` is asked under `epoch` by router `i`: the agent's own rule
    /// ([`decide`]; a raise is persisted as `EpochStore::admit` does). Returns the answer:
    /// `Ok` accepted, `Err(highest)` refused. Records the fleet-level breaches.
    fn admit(&self, w: &mut World, e: usize, i: usize, epoch: u64) -> Result<(), u64> {
        let holder = w.routers[i].holder.clone();
        let stored = w.agents[e].clone();
        let decision = match self.rules {
            Rules::NoAgentFence => Decision::Raise,
            _ => decide(&stored, epoch, &holder),
        };
        match decision {
            Decision::Accept | Decision::Raise => {
                if epoch < stored.epoch {
                    w.ghost.older_epoch = true;
                }
                // Another router that completed its takeover under another epoch controls
                // the fleet: two routers would act on it at once.
                if (0..ROUTERS).any(|k| {
                    k != i
                        && w.routers[k].mode == Mode::Active
                        && self.controls(w, k)
                        && self.held(w, k) != epoch
                }) {
                    w.ghost.acting = true;
                }
                if epoch > stored.epoch || stored.holder.is_empty() {
                    w.agents[e] = FenceState { epoch, holder };
                }
                Ok(())
            }
            Decision::Stale { highest } => Err(highest),
            Decision::HolderConflict { .. } => {
                // Two routers presented one epoch: never legitimate.
                w.ghost.acting = true;
                Err(stored.epoch)
            }
        }
    }

    /// `lifecycle::agents::agent_error` on a `stale_epoch` answer to a call of `epoch`.
    fn stale_answer(&self, w: &mut World, i: usize, epoch: u64) {
        if stale_answer_fences(epoch, self.holds(w, i), self.held(w, i)) {
            w.routers[i].lease.fence(LeaseLoss::HeldByAnother);
            self.fence(w, i);
        }
    }

    /// The handoff document router `i` publishes: its totals, action numbers and lifecycle.
    fn document(&self, w: &World, i: usize, epoch: u64) -> Box<Handoff> {
        let r = &w.routers[i];
        let mut doc = doc_of(epoch, &r.holder, self.wall(w, i));
        doc.counters = BTreeMap::from([
            ("served".to_string(), r.served),
            ("seq_p0".to_string(), u64::from(r.seq[0])),
            ("seq_d0".to_string(), u64::from(r.seq[1])),
        ]);
        doc.lifecycle = r.lifecycle.export();
        doc
    }

    /// `handoff::publish`: the router's state beside the record, only while it is ours.
    fn publish(&self, w: &mut World, i: usize, takeover: bool) -> Result<(), LeaseLoss> {
        let now = self.mono(w);
        let ok = if takeover {
            w.routers[i].lease.is_valid(now)
        } else {
            self.controls(w, i)
        };
        if !ok {
            return Err(LeaseLoss::Lapsed);
        }
        if !self.store_up(w) {
            // The store failed; the lease is still locally valid, so no fence.
            return Err(LeaseLoss::Unavailable("store down".into()));
        }
        match w.routers[i].lease.may_publish(w.record.as_ref(), now) {
            Ok(epoch) => {
                w.published = Some(self.document(w, i, epoch));
                Ok(())
            }
            Err(loss) => {
                w.routers[i].lease.fence(loss.clone());
                self.fence(w, i);
                Err(loss)
            }
        }
    }

    /// `ha::supervise` entering `standby::run`.
    fn enter_standby(&self, w: &mut World, i: usize, held: Option<u64>) {
        let t = w.t;
        let r = &mut w.routers[i];
        r.mode = Mode::Standby;
        r.scope_open = false;
        let settings = Settings {
            primary: r.primary,
            takeover_after: 4,
            max_handoff_age_s: 30.0,
            holder: r.holder.clone(),
        };
        r.machine = Some(Standby::new(settings, held));
        r.standby_next = t;
    }

    /// The renew loop's turn.
    fn renew(&self, w: &mut World, i: usize) {
        let now = self.mono(w);
        let wall = self.wall(w, i);
        w.routers[i].renew_next = w.t + (RENEW_MS / TICK_MS) as u8;
        let lease = &w.routers[i].lease;
        let (Some(epoch), Some(until)) = (lease.epoch(), lease.valid_until()) else {
            w.routers[i].renewing = false;
            return;
        };
        let outcome = if now >= until {
            Err(LeaseLoss::Lapsed)
        } else if !self.store_up(w) {
            Err(LeaseLoss::Unavailable("store down".into()))
        } else {
            let mut core = lease.clone();
            core.renew(w.record.as_ref(), now, wall)
        };
        match outcome {
            Ok(rec) => {
                w.routers[i].lease.granted(epoch, now);
                w.routers[i].lease.wrote(&rec, now);
                w.record = Some(rec);
                // The writer follows renewals.
                let _ = self.publish(w, i, false);
            }
            Err(loss) => {
                w.routers[i].lease.fence(loss);
                w.routers[i].renewing = false;
                self.fence(w, i);
            }
        }
    }

    /// `Step::GiveBack`.
    fn give_back(&self, w: &mut World, i: usize) {
        let wall = self.wall(w, i);
        let up = self.store_up(w);
        let r = &mut w.routers[i];
        r.renewing = false;
        if up {
            if let Some(rec) = r.lease.release(w.record.as_ref(), wall) {
                w.record = Some(rec);
            }
        } else {
            r.lease.fence(LeaseLoss::Unavailable("store down".into()));
        }
        r.mode = Mode::Standby;
        r.scope_open = false;
    }

    /// The standby loop's tick: `ha::standby::steps` over the real machine.
    fn standby_tick(&self, w: &mut World, i: usize) {
        let mut m = w.routers[i]
            .machine
            .take()
            .expect("a standby has its machine");
        let mut step = m.tick();
        loop {
            step = match step {
                Step::Wait | Step::Retain(_) | Step::Follow(_) | Step::Publish(_) => break,
                Step::Observe => {
                    let now = self.mono(w);
                    let seen = if self.store_up(w) {
                        let record = w.record.clone();
                        let fresh = w.routers[i].lease.observe(record.as_ref(), now);
                        Ok(Seen {
                            record,
                            fresh,
                            stored: w.published.clone(),
                        })
                    } else {
                        Err(ReadPublishedError::Store(LeaseError::Config(
                            "store down".into(),
                        )))
                    };
                    let own = m.wants_own_file().then_some(0);
                    m.observed(now, self.wall(w, i), seen, own)
                }
                Step::Poll => m.polled(
                    self.mono(w),
                    self.wall(w, i),
                    Poll::Miss("no reference primary".into()),
                ),
                Step::Claim(source) => {
                    let wall = self.wall(w, i);
                    let now = self.mono(w);
                    let up = self.store_up(w);
                    let t = w.t;
                    let r = &mut w.routers[i];
                    let result = if !up {
                        Err(LeaseLoss::Unavailable("store down".into()))
                    } else {
                        match r.lease.claim(w.record.as_ref(), now, wall) {
                            Claim::Write(rec) => {
                                r.lease.granted(rec.epoch, now);
                                r.lease.wrote(&rec, now);
                                r.renewing = true;
                                r.renew_next = t + (RENEW_MS / TICK_MS) as u8;
                                r.claimed = rec.epoch;
                                w.record = Some(rec.clone());
                                Ok(rec.epoch)
                            }
                            held @ Claim::HeldBy { .. } => {
                                r.lease.observe(held.held_record().as_ref(), now);
                                if r.lease.epoch().is_some() {
                                    r.lease.fence(LeaseLoss::HeldByAnother);
                                }
                                Err(LeaseLoss::HeldByAnother)
                            }
                        }
                    };
                    m.claimed(source, result)
                }
                Step::Apply(source) => {
                    let now = self.now(w, i);
                    let restored = match source {
                        Source::Stored => {
                            let doc = m.stored().expect("a stored copy").clone();
                            let r = &mut w.routers[i];
                            r.served = doc.counters.get("served").copied().unwrap_or(0);
                            for (k, name) in ["seq_p0", "seq_d0"].iter().enumerate() {
                                let n = doc.counters.get(*name).copied().unwrap_or(0);
                                r.seq[k] = u8::try_from(n).unwrap_or(u8::MAX);
                            }
                            r.lifecycle
                                .restore(now, &doc.lifecycle)
                                .map_err(|e| ApplyFailed::OwnFileRefused(e.to_string()))
                        }
                        // Never taken here: every controller publishes beside the lease.
                        Source::Retained | Source::OwnFile { .. } => {
                            w.ghost.unpublished_takeover = true;
                            Ok(())
                        }
                        Source::Memory { .. } => Ok(()),
                    };
                    let result = restored.and_then(|()| {
                        self.publish(w, i, true)
                            .map_err(|e| ApplyFailed::NotPublished(PublishError::Lease(e)))
                    });
                    let valid = w.routers[i].lease.is_valid(self.mono(w));
                    m.applied(w.routers[i].claimed, result, valid)
                }
                Step::ValidateIdentities => {
                    let epoch = w.routers[i].claimed;
                    w.routers[i].mode = Mode::Validating { until: w.t, epoch };
                    w.routers[i].machine = Some(m);
                    return; // resumes in `validated`
                }
                Step::Commit => {
                    let r = &w.routers[i];
                    let ok = r.lease.epoch() == Some(r.claimed);
                    m.committed(r.claimed, self.mono(w), ok)
                }
                Step::GiveBack { .. } => {
                    self.give_back(w, i);
                    break;
                }
                Step::TookOver { .. } => {
                    let r = &mut w.routers[i];
                    r.mode = Mode::Active;
                    r.controlled = r.claimed;
                    break;
                }
            };
        }
        let next = next_wait_ms(TICK_MS, m.lapses_at(), self.mono(w)).div_ceil(TICK_MS);
        let r = &mut w.routers[i];
        r.standby_next = w.t + next.max(1) as u8;
        r.machine = Some(m);
    }

    /// The end of a takeover's identity check: a fenced call to every agent under the
    /// claimed epoch, then the machine's verdict.
    fn validated(&self, w: &mut World, i: usize, epoch: u64) {
        if let Some((e, tenure)) = self.scope(w, i) {
            for a in 0..ENGINES.len() {
                if self.live(w, i, e, tenure)
                    && let Err(_highest) = self.admit(w, a, i, e)
                {
                    self.stale_answer(w, i, e);
                }
            }
        }
        let valid = w.routers[i].lease.is_valid(self.mono(w));
        let controls = self.controls(w, i);
        let mut m = w.routers[i].machine.take().expect("machine");
        let mut step = m.identities_checked(epoch, valid, controls);
        if step == Step::Commit {
            let ok = w.routers[i].lease.epoch() == Some(epoch) && self.holds(w, i);
            step = m.committed(epoch, self.mono(w), ok);
        }
        match step {
            Step::TookOver { .. } => {
                let r = &mut w.routers[i];
                r.mode = Mode::Active;
                r.controlled = epoch;
            }
            Step::GiveBack { .. } => {
                self.give_back(w, i);
                w.routers[i].standby_next = w.t + 1;
            }
            other => unreachable!("{other:?}"),
        }
        w.routers[i].machine = Some(m);
    }

    /// `ha::supervise`: control ended; the renewal stops and the standby loop starts.
    fn supervise(&self, w: &mut World, i: usize) {
        let held = Some(w.routers[i].controlled).filter(|e| *e > 0);
        w.routers[i].renewing = false;
        if w.routers[i].lease.epoch().is_some() {
            w.routers[i].lease.fence(LeaseLoss::HeldByAnother);
        }
        self.enter_standby(w, i, held);
    }

    /// The pending action's publish completes: answered 200 only if published under the
    /// scope it was applied in (`handoff::acknowledge`).
    fn ack(&self, w: &mut World, i: usize) {
        let Some(p) = w.routers[i].pending.take() else {
            return;
        };
        let answered = match self.rules {
            Rules::AckBeforePublish => true,
            _ => self.publish(w, i, false).is_ok() && self.live(w, i, p.scope.0, p.scope.1),
        };
        if answered {
            for (e, n) in p.engines {
                let held = w.routers[i]
                    .lifecycle
                    .held()
                    .contains(ENGINES[usize::from(e)]);
                w.ghost.acked[usize::from(e)] = Some((n, held));
            }
        }
    }

    /// The readmission checks of `targets` through the agents under `scope`
    /// (`lifecycle::driver`'s plan, run by the real [`validate`]).
    fn run_checks(
        &self,
        w: &mut World,
        i: usize,
        targets: &[String],
        wave: bool,
        restart: bool,
        scope: (u64, u8),
    ) -> BTreeMap<String, EngineOutcome> {
        let lc = &w.routers[i].lifecycle;
        let held = lc.held();
        let restart_after = targets
            .iter()
            .map(|t| {
                let old = lc
                    .record(t)
                    .filter(|r| restart && r.restart_required())
                    .and_then(|r| r.old_process_start);
                let old = if self.rules == Rules::NoRestartCheck {
                    None
                } else {
                    old
                };
                (t.clone(), old)
            })
            .collect();
        let plan = Plan {
            targets: targets.to_vec(),
            roles: vec![("p0".into(), Role::Prefill), ("d0".into(), Role::Decode)],
            live: engines()
                .into_iter()
                .filter(|e| !held.contains(e))
                .collect(),
            restart_after,
            accepted_starts: lc.process_starts().clone(),
            model: "m".into(),
            wave,
            direct_generation: true,
            verify_sources: BTreeMap::new(),
        };
        let fleet = Fleet {
            model: self,
            world: Mutex::new(&mut *w),
            router: i,
            epoch: scope.0,
            stale: Mutex::new(false),
        };
        let report = block_on(validate(&plan, &fleet, "mc"));
        let stale = fleet.stale.into_inner().expect("no poison");
        if stale {
            self.stale_answer(w, i, scope.0);
        }
        report.engines
    }

    /// An operator's request to router `i` (`lifecycle::api`, `lifecycle::driver`).
    fn operate(&self, w: &mut World, i: usize, op: Op) {
        let Some(scope) = self.scope(w, i) else {
            return; // 503: not the controller
        };
        let now = self.now(w, i);
        let held = w.routers[i].lifecycle.held();
        let live = engines()
            .into_iter()
            .filter(|e| !held.contains(e))
            .collect();
        let mut changed: Vec<u8> = Vec::new();
        match op {
            Op::Drain(_) | Op::Wave => {
                let wave = op == Op::Wave;
                let req = DrainRequest {
                    engines: if wave {
                        Vec::new()
                    } else {
                        vec![ENGINES[usize::from(e_of(op))].to_string()]
                    },
                    wave,
                    deadline_s: 300.0,
                    deadline_given: false,
                };
                let Ok(plan) = w.routers[i].lifecycle.begin(now, &req, &live, "w1") else {
                    return;
                };
                for iid in &plan.capture {
                    let k = index_of(iid);
                    self.send(
                        w,
                        Envelope {
                            src: Id::from(i),
                            dst: agent_id(usize::from(k)),
                            msg: Msg::Capture {
                                epoch: scope.0,
                                tenure: scope.1,
                                engine: k,
                                sent: w.t,
                            },
                        },
                        i,
                    );
                }
                if !plan.repeated {
                    changed = plan.targets.iter().map(|t| index_of(t)).collect();
                }
            }
            Op::Readmit(_) | Op::WaveReadmit => {
                let wave = op == Op::WaveReadmit;
                let names: Vec<String> = if wave {
                    Vec::new()
                } else {
                    vec![ENGINES[usize::from(e_of(op))].to_string()]
                };
                let Ok(targets) = w.routers[i]
                    .lifecycle
                    .mark_validating(now, &names, wave, |_| 0)
                else {
                    return;
                };
                let outcome = self.run_checks(w, i, &targets, wave, true, scope);
                let passed = targets
                    .iter()
                    .all(|t| outcome.get(t).is_some_and(|o| o.failures.is_empty()));
                let now = self.now(w, i);
                if passed && self.live(w, i, scope.0, scope.1) {
                    self.check_readmission(w, i, &targets, &outcome);
                    w.routers[i].lifecycle.readmitted(now, &outcome);
                } else {
                    w.routers[i].lifecycle.validation_failed(now, &outcome);
                }
                changed = targets.iter().map(|t| index_of(t)).collect();
            }
            Op::Cancel(_) => {
                let name = ENGINES[usize::from(e_of(op))].to_string();
                let Ok((iid, _start)) = w.routers[i].lifecycle.begin_cancel_drain(
                    now,
                    std::slice::from_ref(&name),
                    false,
                ) else {
                    return;
                };
                let outcome =
                    self.run_checks(w, i, std::slice::from_ref(&iid), false, false, scope);
                let now = self.now(w, i);
                let ok = outcome.get(&iid).is_some_and(|o| o.failures.is_empty());
                if ok && self.live(w, i, scope.0, scope.1) {
                    let o = outcome[&iid].clone();
                    w.routers[i].lifecycle.drain_cancelled(now, &iid, &o);
                } else {
                    w.routers[i].lifecycle.validation_failed(now, &outcome);
                }
                changed = vec![index_of(&iid)];
            }
        }
        if changed.is_empty() {
            return;
        }
        let r = &mut w.routers[i];
        let mut engines = Vec::new();
        for e in changed {
            r.seq[usize::from(e)] += 1;
            engines.push((e, r.seq[usize::from(e)]));
        }
        r.pending = Some(Pending { engines, scope });
    }

    /// A readmission about to be accepted: the checks passed on a newer process than the one
    /// the drain recorded (planned restarts), and on the process the engine runs now.
    fn check_readmission(
        &self,
        w: &mut World,
        i: usize,
        targets: &[String],
        outcome: &BTreeMap<String, EngineOutcome>,
    ) {
        for t in targets {
            let rec = w.routers[i].lifecycle.record(t).cloned();
            let o = outcome.get(t);
            let start = o.and_then(|o| o.process_start);
            let now_start = w.starts[usize::from(index_of(t))] as f64;
            let newer = match rec.as_ref().and_then(|r| r.old_process_start) {
                Some(old) if rec.as_ref().is_some_and(|r| r.restart_required()) => {
                    start.is_some_and(|s| s > old)
                }
                _ => true,
            };
            let checked = o.is_some_and(|o| o.failures.is_empty() && !o.checks.is_empty());
            if !(newer && checked && start == Some(now_start)) {
                w.ghost.readmission = true;
            }
        }
    }

    fn send(&self, w: &mut World, env: Envelope<Msg>, i: usize) {
        // A lifecycle call goes out only under the epoch the sender controls.
        if let Msg::Capture { epoch, .. } = env.msg
            && !(self.controls(w, i) && self.held(w, i) == epoch)
        {
            w.ghost.acting = true;
        }
        NET.with(|n| n.borrow_mut().push(env));
    }

    fn deliver(&self, s: &mut State, env: &Envelope<Msg>) {
        let w = &mut s.w;
        match env.msg.clone() {
            Msg::Capture {
                epoch,
                tenure,
                engine,
                ..
            } => {
                let i = usize::from(env.src);
                let answer = self
                    .admit(w, usize::from(engine), i, epoch)
                    .map(|()| w.starts[usize::from(engine)]);
                NET.with(|n| {
                    n.borrow_mut().push(Envelope {
                        src: env.dst,
                        dst: env.src,
                        msg: Msg::Captured {
                            sent: w.t,
                            epoch,
                            tenure,
                            engine,
                            answer,
                        },
                    });
                });
            }
            Msg::Captured {
                epoch,
                tenure,
                engine,
                answer,
                ..
            } => {
                let i = usize::from(env.dst);
                if !w.routers[i].alive {
                    return;
                }
                match answer {
                    Ok(start) if self.live(w, i, epoch, tenure) => {
                        let now = self.now(w, i);
                        let iid = ENGINES[usize::from(engine)];
                        let lc = &mut w.routers[i].lifecycle;
                        lc.bind_identity(now, iid, Ok(start as f64), false);
                        lc.refresh(now, |_| 0);
                    }
                    Ok(_) => {}
                    Err(_) => self.stale_answer(w, i, epoch),
                }
            }
        }
    }

    /// Whether router `i` has work due now.
    fn due(&self, w: &World, i: usize) -> Vec<Action> {
        let mut v = Vec::new();
        if !self.running(w, i) {
            return v;
        }
        let r = &w.routers[i];
        if r.renewing && r.renew_next <= w.t {
            v.push(Action::Renew(i));
        }
        match r.mode {
            Mode::Standby if r.standby_next <= w.t => v.push(Action::Standby(i)),
            Mode::Validating { until, .. } if until <= w.t => v.push(Action::Validated(i)),
            Mode::Fenced => v.push(Action::Supervise(i)),
            _ => {}
        }
        if r.pending.is_some() {
            v.push(Action::Ack(i));
        }
        v
    }

    /// Some living router controls the fleet.
    fn someone_controls(&self, w: &World) -> bool {
        (0..ROUTERS).any(|i| self.controls(w, i))
    }
}

fn e_of(op: Op) -> u8 {
    match op {
        Op::Drain(e) | Op::Readmit(e) | Op::Cancel(e) => e,
        Op::Wave | Op::WaveReadmit => 0,
    }
}

fn index_of(iid: &str) -> u8 {
    ENGINES.iter().position(|e| *e == iid).expect("an engine") as u8
}

thread_local! {
    /// Messages sent during one transition, added to the network after it.
    static NET: std::cell::RefCell<Vec<Envelope<Msg>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The model's engines and agents behind the readmission checks: every engine answers
/// health, serves model `m`, and is attested through its agent under the router's epoch.
struct Fleet<'a> {
    model: &'a Narwhal,
    world: Mutex<&'a mut World>,
    router: usize,
    epoch: u64,
    stale: Mutex<bool>,
}

impl Fleet<'_> {
    fn identity(&self, iid: &str) -> Result<Identity, CheckError> {
        let mut w = self.world.lock().expect("no poison");
        let e = usize::from(index_of(iid));
        if let Err(highest) = self.model.admit(&mut w, e, self.router, self.epoch) {
            *self.stale.lock().expect("no poison") = true;
            return Err(CheckError::Agent {
                detail: format!("stale_epoch: highest {highest}"),
            });
        }
        let start = w.starts[e];
        Ok(Identity {
            key: format!("{iid}@{start}"),
            start: start as f64,
        })
    }
}

impl Checks for Fleet<'_> {
    async fn health(&self, _iid: &str) -> Result<(), CheckError> {
        Ok(())
    }
    async fn attest(&self, iid: &str) -> Result<Attested, CheckError> {
        Ok(Attested {
            identity: self.identity(iid)?,
            models: vec!["m".into()],
            fingerprint: "fp".into(),
        })
    }
    async fn generation(&self, iid: &str) -> Result<Identity, CheckError> {
        self.identity(iid)
    }
    async fn kv_produce(
        &self,
        iid: &str,
        _: &str,
    ) -> Result<(serde_json::Value, Identity), CheckError> {
        Ok((serde_json::json!({"from": iid}), self.identity(iid)?))
    }
    async fn kv_consume(
        &self,
        iid: &str,
        _: &str,
        _kv: serde_json::Value,
    ) -> Result<Identity, CheckError> {
        self.identity(iid)
    }
    async fn probe(
        &self,
        iid: &str,
        _: &str,
        _kv: Option<serde_json::Value>,
    ) -> Result<Identity, CheckError> {
        self.identity(iid)
    }
}

/// Runs a future that never pends (the model's checks answer at once).
fn block_on<F: Future>(f: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

impl Model for Narwhal {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let router = |name: &str, primary: bool| Router {
            holder: format!("{name}:0"),
            alive: true,
            paused_until: 0,
            wall_jump: 0.0,
            lease: Lease::new(format!("{name}:0"), timing()),
            mode: Mode::Standby,
            machine: None,
            primary,
            renewing: false,
            renew_next: 0,
            standby_next: 0,
            tenure: 0,
            scope_open: false,
            claimed: 0,
            controlled: 0,
            lifecycle: Lifecycle::new(engines(), RestartPolicy::Individual),
            served: 0,
            seq: [0; 2],
            pending: None,
        };
        let mut w = World {
            t: 0,
            record: None,
            published: None,
            store_down_until: 0,
            routers: vec![router("r0", false), router("r1", true)],
            agents: vec![FenceState::default(); ENGINES.len()],
            starts: [100, 200],
            faults: self.bounds.faults,
            ops: self.bounds.ops,
            restarts: self.bounds.restarts,
            serves: self.bounds.serves,
            drops: self.bounds.drops,
            ghost: Ghost::default(),
        };
        // r0 starts as the primary: it claims epoch 1, publishes, checks the engines'
        // identities through their agents, and controls.
        let now = self.mono(&w);
        let wall = self.wall(&w, 0);
        let Claim::Write(rec) = w.routers[0].lease.claim(None, now, wall) else {
            unreachable!("a free lease")
        };
        w.routers[0].lease.granted(rec.epoch, now);
        w.routers[0].lease.wrote(&rec, now);
        w.record = Some(rec);
        {
            let r = &mut w.routers[0];
            r.mode = Mode::Active;
            r.claimed = 1;
            r.controlled = 1;
            r.renewing = true;
            r.renew_next = 1;
            for (k, iid) in ENGINES.iter().enumerate() {
                r.lifecycle.accept_process_start(iid, w.starts[k] as f64);
            }
        }
        for a in 0..ENGINES.len() {
            let _ = self.admit(&mut w, a, 0, 1);
        }
        self.publish(&mut w, 0, true).expect("the first publish");
        // r1 is a warm standby of it.
        self.enter_standby(&mut w, 1, None);
        vec![State {
            net: Network::new_unordered_nonduplicating([]),
            w,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let w = &s.w;
        let b = &self.bounds;
        let mut due = Vec::new();
        for i in 0..ROUTERS {
            due.extend(self.due(w, i));
        }
        // A message to a running receiver is delivered or dropped within `delay` ticks.
        let overdue = s.net.iter_deliverable().any(|env| {
            let sent = match env.msg {
                Msg::Capture { sent, .. } | Msg::Captured { sent, .. } => *sent,
            };
            let to = usize::from(env.dst);
            let waits = to < ROUTERS && w.routers[to].alive && !self.running(w, to);
            !waits && sent + b.delay <= w.t
        });
        let quiet = due.is_empty() && !overdue;
        actions.extend(due);
        if w.t < b.end() && quiet {
            actions.push(Action::Tick);
        }
        for env in s.net.iter_deliverable() {
            let to_router = usize::from(env.dst) < ROUTERS;
            if !to_router
                || self.running(w, usize::from(env.dst))
                || !w.routers[usize::from(env.dst)].alive
            {
                actions.push(Action::Deliver(env.to_cloned_msg()));
            }
            if w.drops > 0 {
                actions.push(Action::Drop(env.to_cloned_msg()));
            }
        }
        if w.t >= b.end() {
            return;
        }
        for i in 0..ROUTERS {
            if !self.running(w, i) || !self.controls(w, i) {
                continue;
            }
            if w.ops > 0 && w.t <= self.bounds.op_until && w.routers[i].pending.is_none() {
                // Requests the lifecycle core would refuse at once change nothing: only
                // those it may accept are tried (the core still decides).
                let lc = &w.routers[i].lifecycle;
                let held = lc.held();
                let wave = !lc.wave_id().is_empty();
                // The operator works on d0 (p0 is its live peer; a wave takes both).
                for (e, iid) in ENGINES.iter().enumerate().skip(1) {
                    let e = e as u8;
                    if held.is_empty() {
                        actions.push(Action::Operate(i, Op::Drain(e)));
                    } else if held.contains(*iid) && !wave {
                        actions.push(Action::Operate(i, Op::Readmit(e)));
                        actions.push(Action::Operate(i, Op::Cancel(e)));
                    }
                }
                if held.is_empty() {
                    actions.push(Action::Operate(i, Op::Wave));
                } else if wave {
                    actions.push(Action::Operate(i, Op::WaveReadmit));
                }
            }
            if w.serves > 0 {
                actions.push(Action::Serve(i));
            }
            // A read showing what was shown before changes nothing.
            if w.routers[i].served != w.ghost.read_max {
                actions.push(Action::Read(i));
            }
        }
        if w.restarts > 0 && w.t <= b.op_until + 1 {
            for e in 0..ENGINES.len() as u8 {
                actions.push(Action::Restart(e));
            }
        }
        if w.faults > 0 && w.t <= b.fault_until {
            let living = w.routers.iter().filter(|r| r.alive).count();
            for i in 0..ROUTERS {
                if !self.running(w, i) {
                    continue;
                }
                if living > 1 {
                    actions.push(Action::Kill(i));
                }
                actions.push(Action::Pause(i));
                if w.routers[i].wall_jump == 0.0 {
                    actions.push(Action::Jump(i));
                }
            }
            if self.store_up(w) {
                actions.push(Action::StoreDown);
            }
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        NET.with(|q| q.borrow_mut().clear());
        let w = &mut n.w;
        match action {
            Action::Tick => w.t += 1,
            Action::Renew(i) => self.renew(w, i),
            Action::Standby(i) => self.standby_tick(w, i),
            Action::Validated(i) => {
                let Mode::Validating { epoch, .. } = w.routers[i].mode else {
                    return None;
                };
                self.validated(w, i, epoch);
            }
            Action::Supervise(i) => self.supervise(w, i),
            Action::Ack(i) => self.ack(w, i),
            Action::Operate(i, op) => {
                w.ops -= 1;
                self.operate(w, i, op);
            }
            Action::Serve(i) => {
                w.serves -= 1;
                w.routers[i].served += 1;
            }
            Action::Read(i) => {
                let shown = w.routers[i].served;
                if self.publish(w, i, false).is_ok() {
                    if shown < w.ghost.read_max {
                        w.ghost.backwards = true;
                    }
                    w.ghost.read_max = w.ghost.read_max.max(shown);
                }
            }
            Action::Deliver(env) => {
                remove(&mut n.net, &env);
                self.deliver(&mut n, &env);
            }
            Action::Drop(env) => {
                remove(&mut n.net, &env);
                n.w.drops -= 1;
            }
            Action::Kill(i) => {
                w.faults -= 1;
                w.routers[i].alive = false;
            }
            Action::Pause(i) => {
                w.faults -= 1;
                w.routers[i].paused_until = w.t + PAUSE_TICKS;
            }
            Action::StoreDown => {
                w.faults -= 1;
                w.store_down_until = w.t + STORE_DOWN_TICKS;
            }
            Action::Jump(i) => {
                w.faults -= 1;
                w.routers[i].wall_jump = JUMP_S;
            }
            Action::Restart(e) => {
                w.restarts -= 1;
                w.starts[usize::from(e)] += 1;
            }
        }
        let sent: Vec<Envelope<Msg>> = NET.with(|q| std::mem::take(&mut *q.borrow_mut()));
        if !sent.is_empty()
            && let Network::UnorderedNonDuplicating(m) = &mut n.net
        {
            for env in sent {
                *m.entry(env).or_insert(0) += 1;
            }
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("one controller at a time", |m: &Narwhal, s: &State| {
                (0..ROUTERS).filter(|i| m.controls(&s.w, *i)).count() <= 1
            }),
            Property::always(
                "agents act only for the live epoch",
                |_: &Narwhal, s: &State| !s.w.ghost.acting,
            ),
            Property::always(
                "an agent never accepts an older epoch",
                |_: &Narwhal, s: &State| !s.w.ghost.older_epoch,
            ),
            Property::always(
                "an acknowledged action is never lost",
                |m: &Narwhal, s: &State| acked_kept(m, &s.w),
            ),
            Property::always(
                "readmission only after the checks on a newer process",
                |_: &Narwhal, s: &State| !s.w.ghost.readmission,
            ),
            Property::always("totals never go backwards", |_: &Narwhal, s: &State| {
                !s.w.ghost.backwards
            }),
            Property::always(
                "some router controls the fleet once faults stop",
                |m: &Narwhal, s: &State| {
                    let w = &s.w;
                    let quiet = (0..ROUTERS).all(|i| m.due(w, i).is_empty());
                    w.t < m.bounds.end() || !quiet || m.someone_controls(w)
                },
            ),
            Property::sometimes("a takeover happens", |m: &Narwhal, s: &State| {
                (0..ROUTERS).any(|i| m.controls(&s.w, i) && m.held(&s.w, i) > 1)
            }),
            Property::sometimes("a readmission is acknowledged", |_: &Narwhal, s: &State| {
                s.w.ghost
                    .acked
                    .iter()
                    .any(|a| matches!(a, Some((n, false)) if *n >= 2))
            }),
        ]
    }
}

/// Whoever controls holds every acknowledged action: the engine's action count is at least
/// the acknowledged one, and when equal the engine is held exactly as acknowledged.
fn acked_kept(m: &Narwhal, w: &World) -> bool {
    !w.ghost.unpublished_takeover
        && (0..ROUTERS).filter(|i| m.controls(w, *i)).all(|i| {
            let r = &w.routers[i];
            w.ghost.acked.iter().enumerate().all(|(e, a)| match a {
                None => true,
                Some((n, held)) => {
                    r.seq[e] > *n
                        || (r.seq[e] == *n && r.lifecycle.held().contains(ENGINES[e]) == *held)
                }
            })
        })
}

fn remove(net: &mut Network<Msg>, env: &Envelope<Msg>) {
    if let Network::UnorderedNonDuplicating(m) = net
        && let Some(c) = m.get_mut(env)
    {
        *c -= 1;
        if *c == 0 {
            m.remove(env);
        }
    }
}

/// CI bounds for failover: a fault (kill, pause past the TTL, store down or a clock jump)
/// at tick 0 or 1 around one operator action at tick 0.
pub(super) const FAILOVER: Bounds = Bounds {
    fault_until: 1,
    settle: 4,
    faults: 1,
    ops: 1,
    op_until: 0,
    restarts: 0,
    serves: 0,
    drops: 0,
    delay: 1,
};

/// CI bounds for the totals: a fault at tick 0 or 1 around two served requests, and a
/// dropped message.
pub(super) const TOTALS: Bounds = Bounds {
    fault_until: 1,
    settle: 4,
    faults: 1,
    ops: 0,
    op_until: 0,
    restarts: 0,
    serves: 2,
    drops: 1,
    delay: 1,
};

/// CI bounds for the lifecycle: two operator actions (drain or wave, then readmit or cancel)
/// and an engine restart at any point, no router fault.
pub(super) const LIFECYCLE: Bounds = Bounds {
    fault_until: 0,
    settle: 3,
    faults: 0,
    ops: 2,
    op_until: 1,
    restarts: 1,
    serves: 0,
    drops: 0,
    delay: 1,
};

/// The safety properties (every `always` one).
pub(super) const SAFETY: [&str; 7] = [
    "one controller at a time",
    "agents act only for the live epoch",
    "an agent never accepts an older epoch",
    "an acknowledged action is never lost",
    "readmission only after the checks on a newer process",
    "totals never go backwards",
    "some router controls the fleet once faults stop",
];

/// Runs a BFS of `model` to the end (or, with `stop_at`, to the first discovery of one of
/// those properties) and returns the joined checker. `NARWHAL_MC_MAX_STATES` caps it.
pub(super) fn check(
    model: Narwhal,
    threads: usize,
    stop_at: Vec<&'static str>,
) -> impl Checker<Narwhal> {
    let mut b = model.checker().threads(threads);
    if !stop_at.is_empty() {
        b = b.finish_when(stateright::HasDiscoveries::AnyOf(
            stop_at.into_iter().collect(),
        ));
    }
    if let Some(n) = std::env::var("NARWHAL_MC_MAX_STATES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        b = b.target_state_count(n);
    }
    b.spawn_bfs().join()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `NARWHAL_MC_BOUNDS=fault_until,settle,faults,ops,op_until,restarts,serves,drops,delay`
    /// replaces the bounds (the deep search by hand, docs/design/model-check.md).
    fn bounds(default: Bounds) -> Bounds {
        let Ok(v) = std::env::var("NARWHAL_MC_BOUNDS") else {
            return default;
        };
        let n: Vec<u8> = v
            .split(',')
            .map(|x| x.trim().parse().expect("a number"))
            .collect();
        Bounds {
            fault_until: n[0],
            settle: n[1],
            faults: n[2],
            ops: n[3],
            op_until: n[4],
            restarts: n[5],
            serves: n[6],
            drops: n[7],
            delay: n[8],
        }
    }

    /// Every safety property holds over the whole bounded space, the search explored at
    /// least `floor` states, and each of `reached` was reached (so the bounds exercise it).
    fn holds(b: Bounds, floor: usize, reached: &[&'static str]) {
        let started = SystemClock.now();
        let c = check(Narwhal::new(b, Rules::Product), 1, Vec::new());
        eprintln!(
            "model check {b:?}: {} states ({} unique), depth {}, {:?}",
            c.state_count(),
            c.unique_state_count(),
            c.max_depth(),
            SystemClock.now().saturating_duration_since(started)
        );
        for p in SAFETY {
            c.assert_no_discovery(p);
        }
        for p in reached {
            assert!(c.discovery(p).is_some(), "never reached: {p}");
        }
        assert!(
            c.unique_state_count() >= floor,
            "the model explored only {} states",
            c.unique_state_count()
        );
    }

    #[test]
    fn no_interleaving_of_faults_and_failover_breaks_a_property() {
        holds(bounds(FAILOVER), 30_000, &["a takeover happens"]);
    }

    #[test]
    fn no_interleaving_of_faults_and_served_requests_breaks_a_property() {
        holds(bounds(TOTALS), 20_000, &["a takeover happens"]);
    }

    #[test]
    fn no_interleaving_of_lifecycle_actions_and_restarts_breaks_a_property() {
        holds(
            bounds(LIFECYCLE),
            30_000,
            &["a readmission is acknowledged"],
        );
    }

    /// With `rules` the checker finds a counterexample to `property`; it is printed.
    fn caught(b: Bounds, rules: Rules, property: &'static str) {
        let c = check(Narwhal::new(b, rules), 1, vec![property]);
        let path = c.discovery(property);
        assert!(
            path.is_some(),
            "{rules:?}: no counterexample to {property:?} in {} states",
            c.unique_state_count()
        );
        let actions = path.expect("checked").into_actions();
        eprintln!("{rules:?} breaks {property:?}: {actions:?}");
    }

    /// The agent's epoch check removed: a capture the old primary sent before its pause
    /// reaches an agent after the standby took over, and is accepted.
    #[test]
    fn the_check_catches_an_agent_without_its_epoch_fence() {
        let b = Bounds {
            delay: 6,
            ..FAILOVER
        };
        caught(
            b,
            Rules::NoAgentFence,
            "an agent never accepts an older epoch",
        );
    }

    /// Answered before published: the primary dies after answering a drain it never
    /// published, and the standby takes over without it.
    #[test]
    fn the_check_catches_an_acknowledgement_before_the_publish() {
        caught(
            FAILOVER,
            Rules::AckBeforePublish,
            "an acknowledged action is never lost",
        );
    }

    /// Readmission without the newer-process rule: a drained engine that never restarted is
    /// readmitted.
    #[test]
    fn the_check_catches_a_readmission_without_a_restart() {
        caught(
            LIFECYCLE,
            Rules::NoRestartCheck,
            "readmission only after the checks on a newer process",
        );
    }
}
