//! A bounded exhaustive model check of the HA and lifecycle protocol with `stateright`
//! (docs/design/model-check.md): every interleaving, up to the bounds, of two routers, the
//! lease store, two engine agents with their epoch fences, an operator, engines that restart,
//! a network that delays, reorders and drops the agents' calls, and the faults (kill, pause
//! past the TTL, lease store unavailable, a publish that lands with its answer lost, a wall
//! clock that jumps).
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
    /// The lease store applies the next publish and its answer is lost (an etcd transaction
    /// that times out after it committed): the writer sees `LeaseLoss::Unconfirmed`.
    LoseReply,
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
    /// [`Action::LoseReply`] is armed: the next publish lands and its answer is lost.
    lose_reply: bool,
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
            Ok(epoch) if w.lose_reply => {
                // Written, answer lost: the driver fences on any store error.
                w.published = Some(self.document(w, i, epoch));
                w.lose_reply = false;
                let loss = LeaseLoss::Unconfirmed("answer lost".into());
                w.routers[i].lease.fence(loss.clone());
                self.fence(w, i);
                Err(loss)
            }
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

mod checks;
mod explore;
mod search;

use checks::{Fleet, block_on};
