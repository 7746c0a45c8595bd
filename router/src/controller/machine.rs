//! The controller machine (controller.md 2): one monitoring pass, one urgent evaluation,
//! the decode-floor restoration and prefill-floor recovery, the prefill-urgency latch, the
//! panic counter, and the record of every decision.
//!
//! ```text
//!  pass(now, engines, risk)   scheduled: decode floor ─► residency sample ─► step ─►
//!                             drains ─► rollover ─► prefill floor edges ─► commands
//!  urgent(now, engines, risk) a latched TTFT breach: step with a recovery ─► commands
//!  note_prefill_risk(id, now) a request about to wait: arm the latch on a projected breach
//! ```
//!
//! Pure: the clock and the fleet's state are passed in; the driver applies the commands.

use crate::journal::Event;
use std::collections::BTreeMap;
use std::time::Instant;

use super::book::Book;
use super::decision::{By, Decision, Outcome};
use super::policy::{Effect, Policy, Recovery};
use super::roles::{self, Ctx, Engine, Flipped, PrefillFloor, Request, RoleChanges};
use super::stage::{Core, Params};
use crate::config::{Backend, Config, Role};
use crate::demand::model::DemandModel;

/// Clock readings for one operation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Now {
    /// Monotonic.
    pub(crate) mono: Instant,
    /// Wall-clock Unix seconds.
    pub(crate) wall: f64,
}

/// What the driver must do after a pass.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Command {
    /// Give engine `iid` router role `to` (an applied flip).
    SetRole {
        /// The engine.
        iid: usize,
        /// The new role.
        to: Role,
    },
    /// Record a consolidation-risk event of this kind.
    Risk(&'static str),
    /// Write this journal event.
    Journal(Event),
}

/// The prefill-urgency latch (controller.md 2.4).
#[derive(Debug, Clone, PartialEq)]
struct Latch {
    signalled_at: Instant,
    initial_s: f64,
    signals: u64,
}

/// The machine (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct Machine {
    /// The shared state of every stage.
    pub(crate) core: Core,
    policy: Policy,
    /// The prefill floor's breach edges.
    pub(crate) floor: PrefillFloor,
    latch: Option<Latch>,
    /// `(by, result)` → decisions.
    pub(crate) decisions: BTreeMap<(By, Outcome), u64>,
    /// The newest decision.
    pub(crate) last_decision: Option<Decision>,
    panic_sustained: u64,
    /// Cooldowns bypassed by the panic rule.
    pub(crate) panic_bypasses: u64,
    last_step: Instant,
    last_rollover: Instant,
}

impl Machine {
    /// A machine for `cfg` built at `started` (router construction); `engines` as the fleet
    /// is now.
    pub(crate) fn new(cfg: &Config, started: Instant, engines: Vec<Engine>) -> Machine {
        let p = Params::from_config(cfg);
        let c = &cfg.controller;
        let profiles: Vec<Option<crate::profile::Profile>> = if cfg.profiles.is_empty() {
            vec![None; cfg.engines.len()]
        } else {
            cfg.profiles.iter().cloned().map(Some).collect()
        };
        let settings = roles::Settings {
            cooldown_s: c.thresholds.cooldown_s,
            dwell_s: c.thresholds.dwell_s,
            guard: c.thresholds.flip_resident_guard,
            advisory: c.advisory,
            min_prefill: c.min_prefill as usize,
            min_decode: c.min_decode as usize,
            history: c.flip_history as usize,
            engine_side: cfg.backend == Backend::Sglang,
            step_s: c.reactive.step_s,
        };
        let configured_prefill = engines.iter().filter(|e| e.role == Role::Prefill).count();
        Machine {
            core: Core {
                names: cfg.engines.iter().map(|e| e.iid.clone()).collect(),
                book: Book::new(profiles.clone(), cfg.slo.tpot_s, &c.reactive),
                demand: DemandModel::new(
                    started,
                    c.reactive.step_s,
                    c.reactive.window_s,
                    c.reactive.evidence_span_s,
                ),
                roles: RoleChanges::new(settings, cfg.engines.len(), started),
                profiles,
                engines,
                risk: None,
                risk_events: BTreeMap::new(),
                last_demand: None,
                last_evidence: None,
                started,
                p,
            },
            policy: Policy::default(),
            floor: PrefillFloor::new(c.min_prefill as usize, configured_prefill),
            latch: None,
            decisions: BTreeMap::new(),
            last_decision: None,
            panic_sustained: 0,
            panic_bypasses: 0,
            last_step: started,
            last_rollover: started,
        }
    }

    /// Takes the fleet's view of the engines and the newest risk before a pass.
    pub(crate) fn observe(
        &mut self,
        engines: Vec<Engine>,
        risk: Option<(String, Instant)>,
        events: BTreeMap<String, u64>,
    ) {
        self.core.engines = engines;
        self.core.risk = risk;
        self.core.risk_events = events;
    }

    /// A standby, fenced or lifecycle-held router decides nothing (controller.md 2.1).
    pub(crate) fn interrupt(&mut self) {
        self.policy.interrupt();
    }

    fn record(&mut self, d: Decision, out: &mut Vec<Command>) {
        *self.decisions.entry((d.by, d.result)).or_default() += 1;
        out.push(Command::Journal(d.event()));
        self.last_decision = Some(d);
    }

    fn apply_effects(&mut self, effects: Vec<Effect>, out: &mut Vec<Command>) {
        for e in effects {
            match e {
                Effect::Decision(d) => self.record(d, out),
                Effect::Applied { iid, to, .. } => out.push(Command::SetRole { iid, to }),
                Effect::Risk(kind) => {
                    self.note_risk(kind);
                    out.push(Command::Risk(kind));
                }
            }
        }
    }

    /// A risk recorded by this machine counts at once in its own view.
    fn note_risk(&mut self, kind: &'static str) {
        *self.core.risk_events.entry(kind.to_string()).or_default() += 1;
    }

    /// One scheduled monitoring pass (controller.md 2.2, the controller's stages).
    pub(crate) fn pass(&mut self, now: Now) -> Vec<Command> {
        let mut out = Vec::new();
        self.run_controller(now, true, &mut out);
        self.core.roles.settle_drains(now.mono, &self.core.book);
        let interval = now
            .mono
            .saturating_duration_since(self.last_rollover)
            .as_secs_f64();
        self.core.book.rollover(now.mono, interval);
        self.last_rollover = now.mono;
        self.refresh_floor(now, &mut out);
        out
    }

    /// An urgent evaluation (a latched TTFT breach; controller.md 2.4).
    pub(crate) fn urgent(&mut self, now: Now) -> Vec<Command> {
        let mut out = Vec::new();
        self.run_controller(now, false, &mut out);
        self.refresh_floor(now, &mut out);
        out
    }

    /// An availability change (an ejection, a hold): only the prefill floor's edges are
    /// re-evaluated (controller.md 7.6: on every availability change).
    pub(crate) fn availability(&mut self, now: Now) -> Vec<Command> {
        let mut out = Vec::new();
        self.refresh_floor(now, &mut out);
        out
    }

    /// Whether the urgency latch is armed (the driver runs [`Machine::urgent`]).
    pub(crate) fn latched(&self) -> bool {
        self.latch.is_some()
    }

    fn refresh_floor(&mut self, now: Now, out: &mut Vec<Command>) {
        if let Some(ev) = self.floor.refresh(now.mono, now.wall, &self.core.engines) {
            out.push(Command::Journal(ev));
        }
    }

    /// `run_controller` (controller.md 2.3).
    fn run_controller(&mut self, now: Now, scheduled: bool, out: &mut Vec<Command>) {
        let below = self.core.live(Role::Decode) < self.core.p.min_decode;
        if below {
            self.restore_decode_floor(now, out);
        }
        if scheduled {
            self.sample_residency(now.mono);
        }
        if !below {
            self.step(now, scheduled, out);
        }
    }

    fn sample_residency(&mut self, now: Instant) {
        let corr = self.core.correction();
        let tpot = self.core.p.tpot_s;
        let mut total = 0.0;
        for i in 0..self.core.engines.len() {
            let load = self.core.book.load(i);
            if load.decode == 0 {
                continue;
            }
            if let Some(p) = &self.core.profiles[i] {
                let cap = p.max_tokens(tpot / corr, f64::from(load.decode));
                total += if cap > 0.0 {
                    load.decode_tokens / cap
                } else {
                    1.0
                };
            }
        }
        self.core.demand.residency_sample(now, total);
    }

    /// Decode-floor restoration (controller.md 7.4).
    fn restore_decode_floor(&mut self, now: Now, out: &mut Vec<Command>) {
        let flipped = self.flip(
            now,
            Request {
                to: Role::Decode,
                by: By::DecodeFloor,
                bypass_cooldown: true,
                bypass_dwell: false,
                candidate: None,
                reason: "restore min_decode".into(),
                details: Default::default(),
            },
        );
        let applied = match &flipped {
            Flipped::Applied { iid, .. } => Some(*iid),
            _ => None,
        };
        self.record(flipped.decision().clone(), out);
        if let Some(iid) = applied {
            self.core.roles.restoration_moves += 1;
            out.push(Command::SetRole {
                iid,
                to: Role::Decode,
            });
            out.push(Command::Journal(Event::DecodeFloorRestored {
                at: now.wall,
                iid: self.core.names[iid].clone(),
                live_decode: self.core.live(Role::Decode),
                min_decode: self.core.p.min_decode,
            }));
            self.note_risk("p_to_d_recovery");
            out.push(Command::Risk("p_to_d_recovery"));
            self.refresh_floor(now, out);
        }
    }

    fn flip(&mut self, now: Now, req: Request) -> Flipped {
        let panic = self.panic_active();
        let core = &mut self.core;
        let mut ctx = Ctx {
            engines: &mut core.engines,
            book: &core.book,
            now: now.mono,
            wall: now.wall,
            panic,
        };
        core.roles.flip(&mut ctx, req)
    }

    /// Prefill-floor recovery at the start of every step (controller.md 7.5); whether it
    /// moved an engine.
    fn restore_prefill_floor(&mut self, now: Now, out: &mut Vec<Command>) -> bool {
        let p = &self.core.p;
        let live_prefill = self.core.live(Role::Prefill);
        let live_decode = self.core.live(Role::Decode);
        if live_prefill >= p.min_prefill || live_decode <= p.min_decode {
            return false;
        }
        let candidate = (0..self.core.engines.len())
            .filter(|i| {
                let e = &self.core.engines[*i];
                e.live && e.role == Role::Decode && !e.pinned && e.fixed.is_none()
            })
            .min_by_key(|i| {
                let l = self.core.book.load(*i);
                (l.prefill + l.decode, *i)
            });
        let Some(candidate) = candidate else {
            return false;
        };
        let flipped = self.flip(
            now,
            Request {
                to: Role::Prefill,
                by: By::FloorRecovery,
                bypass_cooldown: true,
                bypass_dwell: true,
                candidate: Some(candidate),
                reason: "restore min_prefill".into(),
                details: Default::default(),
            },
        );
        let applied = match &flipped {
            Flipped::Applied { iid, .. } => Some(*iid),
            _ => None,
        };
        self.record(flipped.decision().clone(), out);
        if let Some(iid) = applied {
            out.push(Command::SetRole {
                iid,
                to: Role::Prefill,
            });
            self.refresh_floor(now, out);
            return true;
        }
        false
    }

    fn panic_active(&self) -> bool {
        let p = &self.core.p;
        p.panic_ratio > 0.0 && self.panic_sustained >= p.sustained
    }

    /// `observe_control_load` (controller.md 2.5 (2), section 6 `panic_ratio`).
    fn observe_panic(&mut self, now: Instant) {
        let p = &self.core.p;
        if p.panic_ratio <= 0.0 {
            return;
        }
        let snap = self.core.snapshot(now);
        if snap.decode_pressure >= p.panic_ratio * p.expand && snap.prefill_pressure <= p.shrink {
            self.panic_sustained += 1;
        } else {
            self.panic_sustained = 0;
        }
    }

    /// `ReactivePolicy.step` with the controller's latch (controller.md 2.4–2.5).
    fn step(&mut self, now: Now, scheduled: bool, out: &mut Vec<Command>) {
        if self.restore_prefill_floor(now, out) {
            self.last_step = now.mono;
            return;
        }
        self.observe_panic(now.mono);
        let mut recovery = None;
        // The latch is consumed by any call when armed (controller.md 2.4).
        if let Some(latch) = self.latch.take()
            && let Some((worst, rid)) = self.core.project_worst(now.mono, &[])
            && worst > self.core.p.ttft_s
        {
            recovery = Some(Recovery {
                trigger_rid: rid,
                projected_s: worst,
                waiting: self.core.book.waiting().len(),
                initial_s: latch.initial_s,
                signals: latch.signals,
                event_to_evaluation_s: now
                    .mono
                    .saturating_duration_since(latch.signalled_at)
                    .as_secs_f64(),
            });
        }

        let due = now
            .mono
            .saturating_duration_since(self.last_step)
            .as_secs_f64()
            >= self.core.p.step_s - 1e-9;
        if !due && recovery.is_none() {
            return;
        }
        if scheduled {
            self.last_step = now.mono;
        }
        let with_recovery = recovery.is_some();
        let panic = self.panic_active();
        let cooling = !self.core.roles.cooldown_elapsed(now.mono);
        let effects = self
            .policy
            .evaluate(&mut self.core, now.mono, now.wall, recovery, panic);
        if panic
            && cooling
            && effects.iter().any(|e| {
                matches!(
                    e,
                    Effect::Applied {
                        to: Role::Decode,
                        by: By::Reactive,
                        ..
                    }
                )
            })
        {
            self.panic_bypasses += 1;
        }
        let moved_to_prefill = effects.iter().any(|e| {
            matches!(
                e,
                Effect::Applied {
                    to: Role::Prefill,
                    ..
                }
            )
        });
        self.apply_effects(effects, out);
        // An urgent move to prefill re-arms the latch while the queue still breaches, so
        // moves can cascade (S11).
        if with_recovery
            && moved_to_prefill
            && let Some((worst, _)) = self.core.project_worst(now.mono, &[])
            && worst > self.core.p.ttft_s
        {
            self.latch = Some(Latch {
                signalled_at: now.mono,
                initial_s: worst,
                signals: 1,
            });
        }
    }

    /// A request about to wait for a seat (controller.md 2.4): projects the waiting
    /// requests FIFO over the live prefill engines; a breach of `slo.ttft_s` arms the latch.
    /// Returns whether the latch was armed or renewed (the driver then runs an urgent pass).
    pub(crate) fn note_prefill_risk(&mut self, now: Instant) -> bool {
        let Some((worst, _)) = self.core.project_worst(now, &[]) else {
            return false;
        };
        if worst <= self.core.p.ttft_s {
            return false;
        }
        match &mut self.latch {
            Some(l) => {
                l.signals += 1;
                l.initial_s = l.initial_s.max(worst);
            }
            None => {
                self.latch = Some(Latch {
                    signalled_at: now,
                    initial_s: worst,
                    signals: 1,
                });
            }
        }
        true
    }

    /// A role check of engine `iid` failed after its flip: its role goes back (a reversal by
    /// `role_check`) and a blocked decision records why.
    pub(crate) fn role_check_failed(&mut self, now: Now, iid: usize, why: &str) -> Vec<Command> {
        let mut out = Vec::new();
        let core = &mut self.core;
        core.roles.undo(&mut core.engines, iid, now.mono, now.wall);
        let to = core.engines[iid].role;
        out.push(Command::SetRole { iid, to });
        let prefill = core.configured(Role::Prefill);
        let decision = Decision {
            at: now.wall,
            prefill,
            decode: core.engines.len() - prefill,
            by: By::RoleCheck,
            reason: format!(
                "role check of {} failed: {why}; flip reversed and the engine held",
                core.names[iid]
            ),
            result: Outcome::Blocked,
            details: Default::default(),
        };
        self.record(decision, &mut out);
        self.refresh_floor(now, &mut out);
        out
    }
}
