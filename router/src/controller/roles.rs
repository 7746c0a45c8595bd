//! Role changes (controller.md 7 and 9.3): the flip guards in their order, the donor
//! choice, what an applied flip records (counters, reversals, in-flight residents, the
//! history and its `drained_s`), the engine-side switch holds, and the prefill floor's breach
//! edges.
//!
//! ```text
//!  flip(request, fleet, residents) ──guards 1–7──► Refused | HeldForSwitch | Advisory | Applied
//!  settle_drains(now)      drained_s once a flip's old-role residents are gone
//!  PrefillFloor::refresh   below_floor / below_floor_recovered edges
//! ```
//!
//! Pure: `now` is passed in. Engines are indexes in config order.

use crate::journal::Event;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use super::book::Book;
use super::decision::{By, Decision, Details, Outcome};
use crate::config::{KvRole, Role};
use crate::placement::Phase;

/// One engine as a pass sees it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Engine {
    /// Instance id.
    pub(crate) iid: String,
    /// Router role.
    pub(crate) role: Role,
    /// Eligible for placement (no exclusion).
    pub(crate) live: bool,
    /// Pinned: never a donor.
    pub(crate) pinned: bool,
    /// Launched as a fixed vLLM KV producer or consumer (`engines[].kv_role`): never a donor,
    /// and refusals say so.
    pub(crate) fixed: Option<KvRole>,
    /// Ejected by the breaker.
    pub(crate) ejected: bool,
}

/// The settings the guards read.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// `thresholds.cooldown_s`.
    pub(crate) cooldown_s: f64,
    /// `thresholds.dwell_s`.
    pub(crate) dwell_s: f64,
    /// `thresholds.flip_resident_guard`.
    pub(crate) guard: u64,
    /// `controller.advisory`.
    pub(crate) advisory: bool,
    /// `controller.min_prefill`.
    pub(crate) min_prefill: usize,
    /// `controller.min_decode`.
    pub(crate) min_decode: usize,
    /// `controller.flip_history`.
    pub(crate) history: usize,
    /// The engine must be idle and switched on its side (SGLang).
    pub(crate) engine_side: bool,
    /// `reactive.step_s` (a switch hold lapses after 3 steps without renewal).
    pub(crate) step_s: f64,
}

/// A move to ask for.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// Target role.
    pub(crate) to: Role,
    /// Caller.
    pub(crate) by: By,
    /// Skip the cooldown (floors, panic).
    pub(crate) bypass_cooldown: bool,
    /// Skip the dwell (prefill-floor recovery).
    pub(crate) bypass_dwell: bool,
    /// The engine to move, chosen by the caller (prefill-floor recovery).
    pub(crate) candidate: Option<usize>,
    /// The reason an applied decision gives.
    pub(crate) reason: String,
    /// Details for an applied or advisory decision.
    pub(crate) details: Details,
}

/// What a flip request came to.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Flipped {
    /// The role of engine `iid` changed.
    Applied {
        /// The engine.
        iid: usize,
        /// The applied decision.
        decision: Decision,
    },
    /// A guard refused it (a refusal was recorded).
    Refused(Decision),
    /// The donor is busy: held out of new placements until idle (SGLang).
    HeldForSwitch {
        /// The held donor.
        iid: usize,
        /// The blocked decision.
        decision: Decision,
    },
    /// Advisory mode: the move was not made.
    Advisory(Decision),
}

impl Flipped {
    /// The decision to record.
    pub(crate) fn decision(&self) -> &Decision {
        match self {
            Flipped::Applied { decision, .. }
            | Flipped::HeldForSwitch { decision, .. }
            | Flipped::Refused(decision)
            | Flipped::Advisory(decision) => decision,
        }
    }
}

/// One applied flip (controller.md 13 `flips`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Flip {
    /// Wall-clock time.
    pub(crate) at: f64,
    /// Monotonic time.
    pub(crate) mono: Instant,
    /// The engine.
    pub(crate) iid: usize,
    /// The role it went to.
    pub(crate) to: Role,
    /// Caller.
    pub(crate) by: By,
    /// Prefill residents at flip time.
    pub(crate) prefill_inflight: u32,
    /// Decode residents at flip time.
    pub(crate) decode_inflight: u32,
    /// Residents of the old role at flip time (router-local ids).
    resident_ids: BTreeSet<u64>,
    /// Seconds until the old-role residents were gone (`None` until then).
    pub(crate) drained_s: Option<f64>,
}

/// A refused flip (controller.md 13 `flips_refused`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Refusal {
    /// Wall-clock time.
    pub(crate) at: f64,
    /// The target role.
    pub(crate) to: Role,
    /// Why.
    pub(crate) why: String,
}

/// Why no donor is left for a flip ([`RoleChanges::donor`]); the refusal reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum NoDonor {
    /// Every source candidate left after the pins was launched with a fixed vLLM KV role:
    /// the engines' iids and that role.
    #[error(
        "{iids}: launched as {kv_role} (engines[].kv_role), a fixed role vLLM cannot flip in place"
    )]
    Fixed {
        /// The fixed engines, comma separated.
        iids: String,
        /// `kv_producer` or `kv_consumer`.
        kv_role: &'static str,
    },
    /// Pins, or the nominated engine, exclude every live source engine.
    #[error("pins or nominated engine exclude every source candidate")]
    Excluded,
    /// Every remaining source engine moved less than `dwell_s` ago.
    #[error("source engine dwell has not elapsed")]
    Dwell,
}

/// Refusals kept for `/narwhal/state`.
const REFUSALS_KEPT: usize = 20;

/// The role-change bookkeeping (see the module doc). Process-local: a new process starts
/// fresh (as handoff-and-lifecycle.md lists).
#[derive(Debug, Clone)]
pub(crate) struct RoleChanges {
    settings: Settings,
    last_p2d: Instant,
    last_flip: Vec<Option<(Instant, Role)>>,
    history: VecDeque<Flip>,
    /// `by:to` → flips.
    pub(crate) flips: BTreeMap<String, u64>,
    /// Flips that put an engine back.
    pub(crate) reversals: u64,
    refused: VecDeque<Refusal>,
    /// Refusals in total.
    pub(crate) refused_total: u64,
    /// Residents at flip time, per phase (`prefill`, `decode`).
    pub(crate) inflight: (u64, u64),
    /// Donors held for an engine-side switch, until the given time.
    holds: BTreeMap<usize, Instant>,
    /// Decode-floor restorations.
    pub(crate) restoration_moves: u64,
}

/// The `by:to` series every state starts with (controller.md 12).
pub(crate) const SEEDED: [(By, Role); 4] = [
    (By::DecodeFloor, Role::Decode),
    (By::FloorRecovery, Role::Prefill),
    (By::Reactive, Role::Decode),
    (By::Reactive, Role::Prefill),
];

fn other(role: Role) -> Role {
    match role {
        Role::Prefill => Role::Decode,
        Role::Decode => Role::Prefill,
    }
}

/// The context of one flip: the engines (mutated on apply), the residents, `now`.
pub(crate) struct Ctx<'a> {
    /// Every configured engine.
    pub(crate) engines: &'a mut [Engine],
    /// Request-path bookkeeping.
    pub(crate) book: &'a Book,
    /// Monotonic now.
    pub(crate) now: Instant,
    /// Wall-clock now.
    pub(crate) wall: f64,
    /// The panic condition holds (bypasses the cooldown).
    pub(crate) panic: bool,
}

impl RoleChanges {
    /// Fresh bookkeeping; the prefill→decode cooldown counts from `started` (router
    /// construction, also on a standby that takes over later).
    pub(crate) fn new(settings: Settings, engines: usize, started: Instant) -> RoleChanges {
        RoleChanges {
            settings,
            last_p2d: started,
            last_flip: vec![None; engines],
            history: VecDeque::new(),
            flips: SEEDED
                .iter()
                .map(|(b, r)| (format!("{}:{}", b.as_str(), r.as_str()), 0))
                .collect(),
            reversals: 0,
            refused: VecDeque::new(),
            refused_total: 0,
            inflight: (0, 0),
            holds: BTreeMap::new(),
            restoration_moves: 0,
        }
    }

    /// The settings.
    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The last refusals, oldest first.
    pub(crate) fn refusals(&self) -> impl Iterator<Item = &Refusal> {
        self.refused.iter()
    }

    /// The retained flips, oldest first.
    pub(crate) fn history(&self) -> impl Iterator<Item = &Flip> {
        self.history.iter()
    }

    /// Engines held for an engine-side switch at `now` (lapsed holds dropped).
    pub(crate) fn held(&mut self, now: Instant) -> BTreeSet<usize> {
        self.holds.retain(|_, until| *until > now);
        self.holds.keys().copied().collect()
    }

    /// Whether `cooldown_s` has passed since the last move to decode (or router start).
    pub(crate) fn cooldown_elapsed(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_p2d).as_secs_f64() >= self.settings.cooldown_s
    }

    /// Whether any donor is held for a switch.
    pub(crate) fn holding(&self) -> bool {
        !self.holds.is_empty()
    }

    fn refuse(&mut self, wall: f64, to: Role, why: &str) {
        self.refused_total += 1;
        self.refused.push_back(Refusal {
            at: wall,
            to,
            why: why.to_string(),
        });
        while self.refused.len() > REFUSALS_KEPT {
            self.refused.pop_front();
        }
    }

    /// Flip-path decision counts over configured engines (controller.md 7.1): the
    /// prefill pool ±1 toward the target.
    fn counts(engines: &[Engine], to: Role) -> (usize, usize) {
        let n = engines.len();
        let pool = engines.iter().filter(|e| e.role == Role::Prefill).count();
        let prefill = match to {
            Role::Prefill => pool + 1,
            Role::Decode => pool.saturating_sub(1),
        };
        (prefill, n.saturating_sub(prefill))
    }

    fn blocked(&mut self, c: &Ctx<'_>, req: &Request, why: String) -> Flipped {
        self.refuse(c.wall, req.to, &why);
        let (prefill, decode) = Self::counts(c.engines, req.to);
        Flipped::Refused(Decision {
            at: c.wall,
            prefill,
            decode,
            by: req.by,
            reason: why,
            result: Outcome::Blocked,
            details: req.details.clone(),
        })
    }

    /// The donor among live, unpinned source engines after the dwell filter: min (0 if it
    /// still holds residents of the target phase else 1, resident work), ties in config
    /// order (controller.md 7.2).
    ///
    /// # Errors
    /// [`NoDonor`]: the refusal reason.
    fn donor(&self, c: &Ctx<'_>, req: &Request) -> Result<Vec<usize>, NoDonor> {
        let source = other(req.to);
        let mut live: Vec<usize> = (0..c.engines.len())
            .filter(|i| c.engines[*i].role == source && c.engines[*i].live)
            .collect();
        if let Some(cand) = req.candidate {
            live.retain(|i| *i == cand);
        }
        let (fixed, unpinned): (Vec<usize>, Vec<usize>) = live
            .into_iter()
            .filter(|i| !c.engines[*i].pinned)
            .partition(|i| c.engines[*i].fixed.is_some());
        if unpinned.is_empty() {
            if let Some(kv_role) = fixed.first().and_then(|i| c.engines[*i].fixed) {
                let iids: Vec<&str> = fixed.iter().map(|i| c.engines[*i].iid.as_str()).collect();
                return Err(NoDonor::Fixed {
                    iids: iids.join(", "),
                    kv_role: kv_role.as_str(),
                });
            }
            return Err(NoDonor::Excluded);
        }
        let dwell = self.settings.dwell_s;
        let ready: Vec<usize> = unpinned
            .into_iter()
            .filter(|i| {
                req.bypass_dwell
                    || dwell <= 0.0
                    || self.last_flip[*i].is_none_or(|(at, _)| {
                        c.now.saturating_duration_since(at).as_secs_f64() >= dwell
                    })
            })
            .collect();
        if ready.is_empty() {
            return Err(NoDonor::Dwell);
        }
        let mut ranked: Vec<(u8, f64, usize)> = ready
            .into_iter()
            .map(|i| {
                let load = c.book.load(i);
                let holds_target = match req.to {
                    Role::Prefill => load.prefill > 0,
                    Role::Decode => load.decode > 0,
                };
                let work = match source {
                    Role::Prefill => load.prefill_s,
                    Role::Decode => load.decode_tokens,
                };
                (u8::from(!holds_target), work, i)
            })
            .collect();
        ranked.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
        Ok(ranked.into_iter().map(|(_, _, i)| i).collect())
    }

    /// Runs the guards of controller.md 7.1 in order and applies the move when they pass
    /// (7.3): counters, reversal, in-flight residents, the role in `c.engines`, holds
    /// cleared, dwell and cooldown clocks, the history entry.
    pub(crate) fn flip(&mut self, c: &mut Ctx<'_>, req: Request) -> Flipped {
        let s = self.settings.clone();
        // 1. Cooldown on moves to decode.
        if req.to == Role::Decode
            && !req.bypass_cooldown
            && !c.panic
            && c.now.saturating_duration_since(self.last_p2d).as_secs_f64() < s.cooldown_s
        {
            return self.blocked(c, &req, "decode cooldown has not elapsed".into());
        }
        let source = other(req.to);
        let live_source = c
            .engines
            .iter()
            .filter(|e| e.role == source && e.live)
            .count();
        // 2. The last live engine of the source role.
        if live_source <= 1 {
            return self.blocked(
                c,
                &req,
                format!("{} floor keeps the last live engine", source.as_str()),
            );
        }
        // 3–4. The source role's floor.
        let (floor, name) = match source {
            Role::Prefill => (s.min_prefill, "min_prefill"),
            Role::Decode => (s.min_decode, "min_decode"),
        };
        if live_source - 1 < floor {
            return self.blocked(
                c,
                &req,
                format!("{name} keeps {floor} live {} engines", source.as_str()),
            );
        }
        // 5. The donor.
        let ranked = match self.donor(c, &req) {
            Ok(r) => r,
            Err(why) => return self.blocked(c, &req, why.to_string()),
        };
        let mut iid = ranked[0];
        if s.engine_side {
            let busy = |i: usize| {
                let l = c.book.load(i);
                l.prefill + l.decode > 0
            };
            let idle: Vec<usize> = ranked.iter().copied().filter(|i| !busy(*i)).collect();
            match idle.first() {
                Some(i) => iid = *i,
                None => {
                    // An already held donor stays chosen.
                    if let Some(h) = ranked.iter().find(|i| self.holds.contains_key(i)) {
                        iid = *h;
                    }
                    let until = c.now + std::time::Duration::from_secs_f64(3.0 * s.step_s.max(0.0));
                    self.holds.insert(iid, until);
                    let why = format!(
                        "holding {} out of new placements until it is idle for an engine-side role switch",
                        c.engines[iid].iid
                    );
                    let Flipped::Refused(decision) = self.blocked(c, &req, why) else {
                        unreachable!("blocked() refuses")
                    };
                    return Flipped::HeldForSwitch { iid, decision };
                }
            }
        }
        let load = c.book.load(iid);
        // 6. The decode-resident guard on decode→prefill donors.
        if req.to == Role::Prefill && s.guard > 0 && u64::from(load.decode) > s.guard {
            return self.blocked(
                c,
                &req,
                format!(
                    "lightest decode donor carries {} residents, above flip_resident_guard {}",
                    load.decode, s.guard
                ),
            );
        }
        let (prefill, decode) = Self::counts(c.engines, req.to);
        // 7. Advisory.
        if s.advisory {
            self.refuse(c.wall, req.to, "advisory mode");
            return Flipped::Advisory(Decision {
                at: c.wall,
                prefill,
                decode,
                by: req.by,
                reason: req.reason,
                result: Outcome::Advisory,
                details: req.details,
            });
        }
        // 7.3 Applied.
        *self
            .flips
            .entry(format!("{}:{}", req.by.as_str(), req.to.as_str()))
            .or_default() += 1;
        if self.last_flip[iid].is_some() {
            self.reversals += 1;
        }
        self.inflight.0 += u64::from(load.prefill);
        self.inflight.1 += u64::from(load.decode);
        c.engines[iid].role = req.to;
        self.holds.clear();
        self.last_flip[iid] = Some((c.now, req.to));
        if req.to == Role::Decode {
            self.last_p2d = c.now;
        }
        let old_phase = match source {
            Role::Prefill => Phase::Prefill,
            Role::Decode => Phase::Decode,
        };
        self.history.push_back(Flip {
            at: c.wall,
            mono: c.now,
            iid,
            to: req.to,
            by: req.by,
            prefill_inflight: load.prefill,
            decode_inflight: load.decode,
            resident_ids: c.book.resident_ids(iid, old_phase).into_iter().collect(),
            drained_s: None,
        });
        while self.history.len() > s.history {
            self.history.pop_front();
        }
        Flipped::Applied {
            iid,
            decision: Decision {
                at: c.wall,
                prefill,
                decode,
                by: req.by,
                reason: req.reason,
                result: Outcome::Applied,
                details: req.details,
            },
        }
    }

    /// Undoes the newest flip of `iid` (its role check failed): the role goes back, recorded
    /// as a flip by `role_check` (a reversal).
    pub(crate) fn undo(&mut self, engines: &mut [Engine], iid: usize, now: Instant, wall: f64) {
        let to = other(engines[iid].role);
        engines[iid].role = to;
        *self
            .flips
            .entry(format!("{}:{}", By::RoleCheck.as_str(), to.as_str()))
            .or_default() += 1;
        self.reversals += 1;
        self.last_flip[iid] = Some((now, to));
        self.history.push_back(Flip {
            at: wall,
            mono: now,
            iid,
            to,
            by: By::RoleCheck,
            prefill_inflight: 0,
            decode_inflight: 0,
            resident_ids: BTreeSet::new(),
            drained_s: None,
        });
        while self.history.len() > self.settings.history {
            self.history.pop_front();
        }
    }

    /// Sets `drained_s` on flips whose old-role residents are all gone (controller.md
    /// 9.3; a flip without residents drains at the next pass).
    pub(crate) fn settle_drains(&mut self, now: Instant, book: &Book) {
        for f in self.history.iter_mut().filter(|f| f.drained_s.is_none()) {
            if now <= f.mono {
                continue;
            }
            let old = match f.to {
                Role::Prefill => Phase::Decode,
                Role::Decode => Phase::Prefill,
            };
            if f.resident_ids
                .iter()
                .all(|id| !book.is_resident(*id, f.iid, old))
            {
                f.drained_s = Some(now.saturating_duration_since(f.mono).as_secs_f64());
            }
        }
    }

    /// `flips` for `/narwhal/state`, oldest first.
    pub(crate) fn history_doc(
        &self,
        names: &[String],
    ) -> Vec<narwhal_shared::documents::controller::Flip> {
        self.history
            .iter()
            .map(|f| narwhal_shared::documents::controller::Flip {
                at: f.at,
                iid: names[f.iid].clone(),
                to: f.to.as_str().to_string(),
                by: f.by.as_str().to_string(),
                prefill_inflight: u64::from(f.prefill_inflight),
                decode_inflight: u64::from(f.decode_inflight),
                drained_s: f.drained_s,
            })
            .collect()
    }
}

/// The prefill floor's breach edges (controller.md 7.6).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PrefillFloor {
    min_prefill: usize,
    armed: bool,
    /// Below the floor since (monotonic), with the wall-clock time.
    pub(crate) since: Option<(Instant, f64)>,
    /// Breaches so far.
    pub(crate) breaches: u64,
    /// Seconds spent below the floor (ended breaches).
    pub(crate) cumulative_s: f64,
    /// Live prefill engines at the last refresh.
    pub(crate) live_prefill: usize,
}

impl PrefillFloor {
    /// Armed at once when the configured prefill pool meets `min_prefill`.
    pub(crate) fn new(min_prefill: usize, configured_prefill: usize) -> PrefillFloor {
        PrefillFloor {
            min_prefill,
            armed: configured_prefill >= min_prefill,
            since: None,
            breaches: 0,
            cumulative_s: 0.0,
            live_prefill: configured_prefill,
        }
    }

    /// Below the floor now.
    pub(crate) fn active(&self) -> bool {
        self.since.is_some()
    }

    /// Re-evaluates the floor; returns the journal event of an edge.
    pub(crate) fn refresh(&mut self, now: Instant, wall: f64, engines: &[Engine]) -> Option<Event> {
        let live = engines
            .iter()
            .filter(|e| e.role == Role::Prefill && e.live)
            .count();
        self.live_prefill = live;
        let below = live < self.min_prefill;
        if !below {
            self.armed = true;
        }
        match (below, self.since) {
            (true, None) if self.armed => {
                self.since = Some((now, wall));
                self.breaches += 1;
                let mut ejected: Vec<&str> = engines
                    .iter()
                    .filter(|e| e.ejected)
                    .map(|e| e.iid.as_str())
                    .collect();
                ejected.sort_unstable();
                Some(Event::BelowFloor {
                    at: wall,
                    live_prefill: live,
                    min_prefill: self.min_prefill,
                    ejected: ejected.into_iter().map(str::to_string).collect(),
                    quarantined: Vec::new(),
                })
            }
            (false, Some((at, _))) => {
                let duration = now.saturating_duration_since(at).as_secs_f64();
                self.cumulative_s += duration;
                self.since = None;
                Some(Event::BelowFloorRecovered {
                    at: wall,
                    duration_s: duration,
                    live_prefill: live,
                    min_prefill: self.min_prefill,
                })
            }
            _ => None,
        }
    }

    /// Seconds below the floor, the current breach included.
    pub(crate) fn cumulative(&self, now: Instant) -> f64 {
        self.cumulative_s
            + self.since.map_or(0.0, |(at, _)| {
                now.saturating_duration_since(at).as_secs_f64()
            })
    }
}
