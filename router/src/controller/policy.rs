//! The reactive decision (controller.md 5): the health hold, the demand gates, the
//! evidence gate, the steady and departure state, the candidate rows and their admission,
//! the hold reasons in order, and the confirmations; a chosen move goes through the flip
//! guards.
//!
//! ```text
//!  evaluate(core, now, recovery) ─► 5.1 health hold ─► 5.2 demand gates ─► 5.3 evidence
//!     ─► 5.4 steady ─► 5.5 candidates ─► 5.6 short view, departure ─► 5.7 rows ─► 5.8 rule,
//!        admission ─► 5.9 hold reason (none admitted) | 5.10 confirmations ─► flip
//! ```
//!
//! Pure: `now` is passed in; the outcome is a list of effects for the machine to record.

use std::time::Instant;

use super::decision::{By, Decision, Details, Outcome};
use super::evidence::Evidence;
use super::roles::{Ctx, Flipped, Request};
use super::scoring::{Score, Snapshot};
use super::stage::{Core, Params};
use crate::config::Role;
use crate::demand::model::Demand;

/// An urgent TTFT recovery: the worst waiting request's projection breaches the TTFT budget
/// (controller.md 2.4).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Recovery {
    /// The worst waiting request's router id.
    pub(crate) trigger_rid: String,
    /// Its projected TTFT, seconds.
    pub(crate) projected_s: f64,
    /// Waiting requests.
    pub(crate) waiting: usize,
    /// The largest projection when the latch was armed, seconds.
    pub(crate) initial_s: f64,
    /// Signals since the latch was armed.
    pub(crate) signals: u64,
    /// Seconds from the first signal to this evaluation.
    pub(crate) event_to_evaluation_s: f64,
}

/// What an evaluation produced.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Effect {
    /// A decision to record (held, blocked, advisory, applied).
    Decision(Decision),
    /// Engine `iid` now has role `to` (the flip was applied).
    Applied {
        /// The engine.
        iid: usize,
        /// Its new role.
        to: Role,
        /// The caller.
        by: By,
    },
    /// A risk event of this kind.
    Risk(&'static str),
}

/// A departure: the short view left the window demand while the fleet was settled
/// (controller.md 5.6).
#[derive(Debug, Clone, PartialEq)]
struct Departure {
    /// +1 toward prefill, −1 toward decode.
    heading: i8,
    opened: Instant,
    moved: bool,
    leading: bool,
    break_since: Option<Instant>,
    reverses: bool,
}

/// The reactive policy's own state (process-local).
#[derive(Debug, Clone, Default)]
pub(crate) struct Policy {
    proposal: Option<((usize, bool, &'static str), u64)>,
    settled_since: Option<Instant>,
    unsettled_since: Option<Instant>,
    balanced_since: Option<Instant>,
    departure: Option<Departure>,
}

/// One candidate row (controller.md 5.7).
#[derive(Debug, Clone)]
struct Row {
    p: usize,
    /// A decode→prefill move (p > P).
    up: bool,
    score: Score,
    improvement: f64,
    capacity_safe: bool,
    floors_safe: bool,
    mixed: bool,
    held_reverse: bool,
    departure: bool,
    rule: &'static str,
    source_safe: bool,
    admitted: bool,
    /// Urgent: (candidate projected TTFT, gain over the trigger).
    urgent: Option<(f64, f64)>,
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.max(b)
}

fn secs_since(now: Instant, t: Instant) -> f64 {
    now.saturating_duration_since(t).as_secs_f64()
}

impl Policy {
    /// Clears `settled_since` and `balanced_since` (a standby, fenced or held router;
    /// controller.md 2.1).
    pub(crate) fn interrupt(&mut self) {
        self.settled_since = None;
        self.unsettled_since = None;
        self.balanced_since = None;
    }

    fn reset_proposal(&mut self) {
        self.proposal = None;
    }

    /// One evaluation at `now` (controller.md 5.1–5.10), with `recovery` for an urgent
    /// one and `panic` when the cooldown may be bypassed.
    pub(crate) fn evaluate(
        &mut self,
        core: &mut Core,
        now: Instant,
        wall: f64,
        recovery: Option<Recovery>,
        panic: bool,
    ) -> Vec<Effect> {
        let p = core.p.clone();
        let urgent = recovery.is_some();
        let snap = core.snapshot(now);
        // 5.1 Health hold, over configured engines.
        if let Some(held) = self.health_hold(core, &snap, wall, urgent) {
            return vec![Effect::Decision(held)];
        }
        // 5.2 Demand gates.
        let demand = core.price(now, p.window_s, p.window_s);
        core.last_demand = Some(demand.clone());
        let prr = snap.prefill_recovery_ratio();
        let base = snap.score(snap.prefill, demand.prefill_engines, demand.decode_engines);
        let pressures = pressure_details(&snap, prr);
        if let Some(reason) = demand_hold_reason(&p, &snap, &demand, urgent, prr) {
            let mut d = demand_details(&demand);
            d.extend(&pressures);
            d.num(
                "recovery_decode_ratio",
                snap.decode_pressure.max(base.decode_queue),
            );
            return vec![Effect::Decision(
                self.demand_hold(reason, d, &snap, wall, urgent),
            )];
        }
        // 5.3 Evidence.
        let ev = core.evidence(now, &demand);
        core.last_evidence = Some(ev.clone());
        let v = View {
            confirmation_s: p.confirmation_s(),
            p,
            now,
            wall,
            cur_p: snap.prefill,
            cur_d: snap.decode,
            n: snap.n,
            configured_n: core.engines.len(),
            snap,
            urgent,
            recovery_mode: !demand.complete,
            recovery,
            demand,
            base,
            prr,
            ev,
            pressures,
        };
        // 5.4 Steady.
        let (steady, steady_work) = self.steady(core, &v);
        // 5.5 Candidates.
        let cands = v.candidates();
        // 5.6 Short view and departure.
        let departing = if !v.urgent && !v.recovery_mode {
            self.short_view_and_departure(core, &v, &cands)
        } else {
            Departing::default()
        };
        // 5.7–5.8 Rows.
        let rows = self.rows(core, &v, &cands, &departing, steady);
        let admitted = lowest(rows.iter().filter(|r| r.admitted));
        let report = Report {
            v: &v,
            steady_work,
            balanced_since: self.balanced_since,
            departure: self.departure.clone(),
        };
        let Some(chosen) = admitted.cloned() else {
            // 5.9 Hold reasons.
            return vec![Effect::Decision(self.hold(core, &report, &rows))];
        };
        // 5.10 Confirmations.
        self.confirm(core, &report, chosen, panic)
    }

    /// 5.1: the held decision while a configured role has no live engine (fleet health is
    /// changing), clearing the proposal and settledness; `None` when both roles are live.
    fn health_hold(
        &mut self,
        core: &Core,
        snap: &Snapshot,
        wall: f64,
        urgent: bool,
    ) -> Option<Decision> {
        let cfg_prefill = core.configured(Role::Prefill) + usize::from(urgent);
        let cfg_decode = core.configured(Role::Decode);
        if (cfg_prefill > 0 && snap.prefill == 0) || (cfg_decode > 0 && snap.decode == 0) {
            self.reset_proposal();
            self.interrupt();
            return Some(Decision {
                at: wall,
                prefill: cfg_prefill,
                decode: cfg_decode,
                by: By::Reactive,
                reason: "fleet health is changing".into(),
                result: Outcome::Held,
                details: Details::default(),
            });
        }
        None
    }

    /// 5.2: the held decision when a demand gate holds, clearing the proposal (and, unless
    /// urgent, settledness).
    fn demand_hold(
        &mut self,
        reason: &'static str,
        details: Details,
        snap: &Snapshot,
        wall: f64,
        urgent: bool,
    ) -> Decision {
        self.reset_proposal();
        if !urgent {
            self.interrupt();
        }
        Decision {
            at: wall,
            prefill: snap.prefill,
            decode: snap.decode,
            by: By::Reactive,
            reason: reason.into(),
            result: Outcome::Held,
            details,
        }
    }

    /// 5.4: tracks since when the window and the confirmation-horizon demand agree; steady
    /// once they have for an evidence span with the evidence closed. Returns whether steady
    /// and the confirmation-horizon demand (neither when urgent or in recovery mode).
    fn steady(&mut self, core: &Core, v: &View) -> (bool, Option<Demand>) {
        if v.urgent || v.recovery_mode {
            return (false, None);
        }
        let p = &v.p;
        let now = v.now;
        let sw = core.price(now, v.confirmation_s, v.confirmation_s);
        let balanced = close(sw.prefill_engines, v.demand.prefill_engines, p.tolerance)
            && close(sw.decode_engines, v.demand.decode_engines, p.tolerance);
        if balanced {
            self.balanced_since.get_or_insert(now);
        } else {
            self.balanced_since = None;
        }
        let steady = v.ev.closed
            && self
                .balanced_since
                .is_some_and(|b| secs_since(now, b) >= p.evidence.span_s);
        (steady, Some(sw))
    }

    /// 5.6: reads the short view, tracks settledness and the departure's life (opening one
    /// when settled long enough), and returns the departure's row and held reverse move.
    fn short_view_and_departure(&mut self, core: &Core, v: &View, cands: &[usize]) -> Departing {
        let window_gain = cands
            .iter()
            .map(|c| v.base.objective - v.score_for(*c, &v.demand, v.ev.envelope_decode).objective)
            .fold(f64::NEG_INFINITY, f64::max);
        let short = short_view(core, v);
        self.track_settledness(v, short.heading, window_gain);
        self.age_departure(v, short.heading, short.shifted);
        if self.departure.is_none() && short.heading != 0 && short.shifted {
            self.open_departure(core, v, short.heading);
        }
        self.departing(v, short.view.as_ref())
    }

    /// 5.6 settledness: unsettled once a move has looked worthwhile for a step, settled
    /// from the first evaluation where none does.
    fn track_settledness(&mut self, v: &View, heading: i8, window_gain: f64) {
        let now = v.now;
        if heading != 0 || window_gain >= v.p.margin {
            let from = *self.unsettled_since.get_or_insert(now);
            if secs_since(now, from) >= v.p.step_s {
                self.settled_since = None;
            }
        } else {
            self.unsettled_since = None;
            self.settled_since.get_or_insert(now);
        }
    }

    /// 5.6 the departure's life: closed when a window old (or, before it moved, when the
    /// short view turns away); after its move, no longer leading once the short view has
    /// broken from it for a step.
    fn age_departure(&mut self, v: &View, heading: i8, shifted: bool) {
        let (now, p) = (v.now, &v.p);
        if let Some(dep) = &mut self.departure {
            let age = secs_since(now, dep.opened);
            if age >= p.window_s || (!dep.moved && heading != dep.heading) {
                self.departure = None;
            } else if dep.moved {
                if heading == -dep.heading || !shifted {
                    let from = *dep.break_since.get_or_insert(now);
                    if secs_since(now, from) >= p.step_s {
                        dep.leading = false;
                    }
                } else {
                    dep.break_since = None;
                }
            }
        }
    }

    /// 5.6: opens a departure along `heading` once the fleet has been settled long enough
    /// (a confirmation horizon less when it reverses the recent flips).
    fn open_departure(&mut self, core: &Core, v: &View, heading: i8) {
        let (now, p) = (v.now, &v.p);
        let reverses = reverses_recent(core, heading, now, p);
        let need = if reverses {
            p.evidence.span_s - v.confirmation_s
        } else {
            p.evidence.span_s
        };
        if self
            .settled_since
            .is_some_and(|s| secs_since(now, s) >= need)
        {
            self.departure = Some(Departure {
                heading,
                opened: now,
                moved: false,
                leading: true,
                break_since: None,
                reverses,
            });
        }
    }

    /// 5.6: the leading departure's row (scored on the short view) and, once it has moved,
    /// the reverse split it holds.
    fn departing(&self, v: &View, short_view: Option<&(Demand, Score)>) -> Departing {
        let mut out = Departing::default();
        if let (Some(dep), Some((short, short_cur))) = (&self.departure, short_view)
            && dep.leading
        {
            let c = (v.cur_p as i64 + i64::from(dep.heading)) as usize;
            let age = secs_since(v.now, dep.opened);
            if (!dep.moved || dep.reverses || age >= v.p.evidence.span_s) && c > 0 && c < v.n {
                let sc = v.score_for(c, short, v.ev.envelope_decode);
                out.row = Some((c, short_cur.clone(), sc));
            }
            if dep.moved {
                out.held_reverse = Some((v.cur_p as i64 - i64::from(dep.heading)) as usize);
            }
        }
        out
    }

    /// 5.7–5.8: one row per candidate, the departure's scored against its short view.
    fn rows(
        &self,
        core: &Core,
        v: &View,
        cands: &[usize],
        departing: &Departing,
        steady: bool,
    ) -> Vec<Row> {
        let mut rows: Vec<Row> = Vec::new();
        for c in cands.iter().copied() {
            let is_departure = departing.row.as_ref().is_some_and(|(dc, _, _)| *dc == c);
            let (base_obj, sc) = match &departing.row {
                Some((dc, short_cur, dsc)) if *dc == c => (short_cur.objective, dsc.clone()),
                _ => (
                    v.base.objective,
                    v.score_for(c, &v.demand, v.ev.envelope_decode),
                ),
            };
            rows.push(self.row(RowInputs {
                core,
                snap: &v.snap,
                base: &v.base,
                base_obj,
                score: sc,
                c,
                cur_p: v.cur_p,
                urgent: v.recovery.as_ref(),
                is_departure,
                held_reverse: departing.held_reverse == Some(c),
                floors_safe: v.floors_safe(c),
                steady,
                evidence: &v.ev,
                prr: v.prr,
                now: v.now,
            }));
        }
        rows
    }

    /// 5.9: the held decision when no row is admitted, with the first hold reason of the
    /// best row; the proposal is cleared unless a switch is holding.
    fn hold(&mut self, core: &Core, r: &Report<'_>, rows: &[Row]) -> Decision {
        let v = r.v;
        let reported = lowest(rows.iter());
        let reason = match reported {
            Some(row) => hold_reason(
                row,
                v.urgent,
                &v.ev,
                v.snap.profiles_complete,
                v.p.margin,
                self.departure.as_ref().map_or(0, |d| d.heading),
            ),
            None if v.urgent => {
                "projected TTFT recovery requires a strict prefill improvement".into()
            }
            None => "projected improvement is below the movement margin".into(),
        };
        if !core.roles.holding() {
            self.reset_proposal();
        }
        let (rp, rd) = reported.map_or((v.cur_p, v.cur_d), |row| (row.p, row.score.d));
        Decision {
            at: v.wall,
            prefill: rp,
            decode: rd,
            by: By::Reactive,
            reason,
            result: Outcome::Held,
            details: r.details(reported),
        }
    }

    /// 5.10: counts the chosen row's confirmations, holding until enough, then flips.
    fn confirm(
        &mut self,
        core: &mut Core,
        r: &Report<'_>,
        chosen: Row,
        panic: bool,
    ) -> Vec<Effect> {
        let (v, p) = (r.v, &r.v.p);
        let dest_ratio = if chosen.p > v.cur_p {
            v.base.ttft
        } else {
            v.base.decode_side()
        };
        let required = if v.urgent
            || chosen.rule == "settled_departure"
            || (!v.recovery_mode && chosen.rule == "source_shrink" && dest_ratio >= p.expand)
        {
            1
        } else {
            p.confirmations
        };
        let key = (chosen.p, v.recovery_mode, chosen.rule);
        let count = match &self.proposal {
            Some((k, c)) if *k == key => c + 1,
            _ => 1,
        };
        self.proposal = Some((key, count));
        let mut d = r.details(Some(&chosen));
        d.set("confirmations", count.min(required))
            .set("required_confirmations", required);
        if count < required {
            return vec![Effect::Decision(Decision {
                at: v.wall,
                prefill: chosen.p,
                decode: chosen.score.d,
                by: By::Reactive,
                reason: "waiting for sustained demand".into(),
                result: Outcome::Held,
                details: d,
            })];
        }
        self.reset_proposal();
        self.settled_since = None;
        self.flip(core, v, &chosen, required, d, panic)
    }

    /// 5.10: asks the role machine for the chosen move and records what it did (the
    /// departure marked moved, or closed by a move along it).
    fn flip(
        &mut self,
        core: &mut Core,
        v: &View,
        chosen: &Row,
        required: u64,
        d: Details,
        panic: bool,
    ) -> Vec<Effect> {
        let to = if chosen.p > v.cur_p {
            Role::Prefill
        } else {
            Role::Decode
        };
        let mut ctx = Ctx {
            engines: &mut core.engines,
            book: &core.book,
            now: v.now,
            wall: v.wall,
            panic,
        };
        let flipped = core.roles.flip(
            &mut ctx,
            Request {
                to,
                by: By::Reactive,
                bypass_cooldown: false,
                bypass_dwell: false,
                candidate: None,
                reason: "post-move objective improved".into(),
                details: d,
            },
        );
        let mut out = vec![Effect::Decision(flipped.decision().clone())];
        match flipped {
            Flipped::Applied { iid, .. } => {
                out.push(Effect::Applied {
                    iid,
                    to,
                    by: By::Reactive,
                });
                if to == Role::Decode {
                    out.push(Effect::Risk("p_to_d_recovery"));
                }
                let dir: i8 = if to == Role::Prefill { 1 } else { -1 };
                if let Some(dep) = &mut self.departure {
                    if chosen.departure {
                        dep.moved = true;
                    } else if dir == dep.heading {
                        self.departure = None;
                    }
                }
            }
            Flipped::HeldForSwitch { .. } => {
                self.proposal = Some(((chosen.p, v.recovery_mode, chosen.rule), required));
            }
            Flipped::Refused(_) | Flipped::Advisory(_) => {}
        }
        out
    }

    fn row(&self, i: RowInputs<'_>) -> Row {
        let p = &i.core.p;
        let sc = i.score;
        let to_prefill = i.c > i.cur_p;
        let source_ratio = if to_prefill {
            sc.decode_side()
        } else {
            sc.ttft
        };
        let improvement = i.base_obj - sc.objective;
        let capacity_safe =
            !to_prefill || sc.kv_capacity.is_none_or(|kv| sc.tokens_per_engine <= kv);
        let urgent = i.urgent.is_some();
        let mixed = !i.is_departure
            && ((to_prefill && sc.decode_side() > p.shrink && (i.prr >= p.expand || urgent))
                || (self.departure.is_none()
                    && !to_prefill
                    && sc.ttft > p.shrink
                    && i.base.decode_side() >= p.expand));
        let rule = if urgent {
            "projected_ttft_recovery"
        } else if mixed {
            "mixed_pressure"
        } else if i.is_departure {
            if self.departure.as_ref().is_some_and(|d| d.moved) {
                "source_shrink"
            } else {
                "settled_departure"
            }
        } else if i.steady && source_ratio > p.shrink && source_ratio <= p.expand {
            "steady_demand"
        } else {
            "source_shrink"
        };
        let urgent_gain = i.urgent.map(|rec| {
            // The worst projection over every live, unpinned decode donor added to prefill.
            let donors: Vec<usize> = (0..i.core.engines.len())
                .filter(|d| {
                    let e = &i.core.engines[*d];
                    e.live && e.role == Role::Decode && !e.pinned && e.fixed.is_none()
                })
                .collect();
            let worst = donors
                .iter()
                .filter_map(|d| i.core.project_worst(i.now, &[*d]).map(|(t, _)| t))
                .fold(f64::NEG_INFINITY, f64::max);
            let cand = if worst.is_finite() {
                worst
            } else {
                rec.projected_s
            };
            (cand, rec.projected_s - cand)
        });
        let source_safe = if urgent {
            mixed || source_ratio <= p.shrink
        } else {
            source_ratio <= p.shrink || mixed || rule == "steady_demand"
        };
        let gate_ok = sc.covered
            && capacity_safe
            && i.floors_safe
            && !i.held_reverse
            && (!to_prefill || i.evidence.allowed());
        let admitted = gate_ok
            && match urgent_gain {
                Some((_, gain)) => {
                    gain > 0.0
                        && ((mixed && improvement > 0.0) || (!mixed && source_ratio <= p.shrink))
                }
                None => {
                    source_safe
                        && improvement >= p.margin
                        && (!mixed || (improvement > 0.0 && i.snap.profiles_complete))
                }
            };
        Row {
            p: i.c,
            up: to_prefill,
            score: sc,
            improvement,
            capacity_safe,
            floors_safe: i.floors_safe,
            mixed,
            held_reverse: i.held_reverse,
            departure: i.is_departure,
            rule,
            source_safe,
            admitted,
            urgent: urgent_gain,
        }
    }
}

/// What one evaluation reads once its demand gates have passed: the settings, the snapshot
/// and split, the window demand and its score at the current split, and the evidence.
struct View {
    p: Params,
    now: Instant,
    wall: f64,
    snap: Snapshot,
    cur_p: usize,
    cur_d: usize,
    n: usize,
    configured_n: usize,
    urgent: bool,
    recovery: Option<Recovery>,
    recovery_mode: bool,
    demand: Demand,
    base: Score,
    prr: f64,
    ev: Evidence,
    confirmation_s: f64,
    pressures: Details,
}

impl View {
    /// Whether split `c` keeps both role floors over the configured engines.
    fn floors_safe(&self, c: usize) -> bool {
        self.p.min_prefill <= c && c + self.p.min_decode <= self.configured_n
    }

    /// Split `c`'s score for demand `d`, a decode→prefill move's decode work at least
    /// `envelope`.
    fn score_for(&self, c: usize, d: &Demand, envelope: f64) -> Score {
        let decode = if c > self.cur_p {
            envelope.max(d.decode_engines)
        } else {
            d.decode_engines
        };
        self.snap.score(c, d.prefill_engines, decode)
    }

    /// 5.5: the adjacent splits (only the prefill one when urgent), in recovery mode only
    /// those toward an expanding phase's pressure.
    fn candidates(&self) -> Vec<usize> {
        let (cur_p, p) = (self.cur_p, &self.p);
        let mut cands: Vec<usize> = if self.urgent {
            vec![cur_p + 1]
        } else {
            vec![cur_p.wrapping_sub(1), cur_p + 1]
        };
        cands.retain(|c| *c > 0 && *c < self.n && *c != usize::MAX);
        if self.recovery_mode {
            cands.retain(|c| {
                if *c > cur_p {
                    self.prr >= p.expand
                } else {
                    self.snap.decode_pressure >= p.expand
                }
            });
        }
        cands
    }

    /// The decision basis reported for a row at split `row_p`.
    fn basis(&self, row_p: usize) -> &'static str {
        if self.urgent {
            "projected_ttft_recovery"
        } else if self.recovery_mode {
            if row_p > self.cur_p {
                "prefill_pressure_recovery"
            } else {
                "decode_pressure_recovery"
            }
        } else {
            "demand_projection"
        }
    }
}

/// The short view over the confirmation horizon (controller.md 5.6).
struct ShortView {
    /// +1 when a prefill move, −1 when a decode move gains the margin on it; 0 otherwise.
    heading: i8,
    /// Whether it differs from the window demand beyond the tolerance.
    shifted: bool,
    /// Its demand and the current split's score on it.
    view: Option<(Demand, Score)>,
}

/// What the departure contributes to the rows (controller.md 5.6).
#[derive(Default)]
struct Departing {
    /// The departure's split, the current split's and its score on the short view.
    row: Option<(usize, Score, Score)>,
    /// The reverse split a moved departure holds.
    held_reverse: Option<usize>,
}

/// What a decision's details are written from (controller.md 11.1).
struct Report<'a> {
    v: &'a View,
    steady_work: Option<Demand>,
    balanced_since: Option<Instant>,
    departure: Option<Departure>,
}

impl Report<'_> {
    /// The details of a decision on `row` (or, with none, on the current split).
    fn details(&self, row: Option<&Row>) -> Details {
        let v = self.v;
        let (p, cur_p, now, snap, demand) = (&v.p, v.cur_p, v.now, &v.snap, &v.demand);
        let mut d = Details::default();
        let (rp, sc) = match row {
            Some(r) => (r.p, r.score.clone()),
            None => (cur_p, v.base.clone()),
        };
        d.set("current_prefill", cur_p)
            .set("current_decode", v.cur_d)
            .set("decision_basis", v.basis(rp))
            .num("prefill_work", sc.prefill_work)
            .num("decode_work", sc.decode_work)
            .num("projected_ttft_ratio", sc.ttft)
            .num("projected_tpot_ratio", sc.tpot)
            .num("projected_decode_wait_ratio", sc.decode_queue)
            .num("objective", sc.objective)
            .num("objective_delta", row.map_or(0.0, |r| r.improvement))
            .tokens("decode_tokens_per_engine", sc.tokens_per_engine)
            .tokens("decode_slo_capacity_tokens", sc.slo_capacity)
            .set(
                "decode_kv_capacity_tokens",
                sc.kv_capacity
                    .map_or(serde_json::Value::Null, |k| super::decision::round(k, 3)),
            )
            .set("decode_request_limit", sc.request_limit)
            .num("decode_requests_per_engine", sc.requests_per_engine)
            .set("pending_decode_requests", snap.pending_decode.0)
            .tokens("pending_decode_tokens", snap.pending_decode.1)
            .set("decode_profile_covered", sc.covered)
            .num("decode_correction", snap.correction)
            .set("arrivals", demand.arrivals)
            .set("output_observations", demand.output_observations)
            .set("demand_complete", demand.complete)
            .set("arrivals_beyond_profile", demand.arrivals_beyond_profile)
            .set("unsized_offers", demand.unsized_offers);
        if rp > cur_p {
            evidence_details(&mut d, &v.ev);
        }
        let horizon = if row.is_some_and(|r| r.departure) {
            v.confirmation_s
        } else {
            p.window_s
        };
        d.set(
            "eligibility_rule",
            row.map_or(serde_json::Value::Null, |r| r.rule.into()),
        )
        .num("demand_horizon_s", horizon)
        .num("steady_horizon_s", v.confirmation_s)
        .opt(
            "steady_prefill_work",
            self.steady_work.as_ref().map(|s| s.prefill_engines),
        )
        .opt(
            "steady_decode_work",
            self.steady_work.as_ref().map(|s| s.decode_engines),
        )
        .opt(
            "steady_demand_s",
            self.balanced_since.map(|b| secs_since(now, b)),
        );
        if let Some(dep) = &self.departure {
            d.num("departure_age_s", secs_since(now, dep.opened))
                .set("departure_reverses", dep.reverses);
        }
        d.extend(&v.pressures);
        d.set("decode_capacity_safe", row.map(|r| r.capacity_safe))
            .set("role_floors_safe", row.map(|r| r.floors_safe))
            .set("source_pressure_safe", row.map(|r| r.source_safe));
        if let Some(rec) = &v.recovery {
            urgent_details(&mut d, rec, row, v);
        }
        d
    }
}

/// The urgent recovery's details of a decision on `row` (controller.md 11.1).
fn urgent_details(d: &mut Details, rec: &Recovery, row: Option<&Row>, v: &View) {
    let p = &v.p;
    d.set("trigger_rid", rec.trigger_rid.clone())
        .num("projected_ttft_s", rec.projected_s)
        .num("ttft_slo_s", p.ttft_s)
        .num("trigger_projected_ttft_ratio", rec.projected_s / p.ttft_s)
        .num("resident_prefill_s", v.snap.resident_prefill_s)
        .num("queued_prefill_s", v.snap.queued_prefill_s)
        .set("waiting_prefill", rec.waiting)
        .num("initial_projected_ttft_s", rec.initial_s)
        .set("urgent_signals", rec.signals)
        .num("event_to_evaluation_s", rec.event_to_evaluation_s);
    if let Some((cand, gain)) = row.and_then(|r| r.urgent) {
        d.num("candidate_projected_ttft_s", cand)
            .num("candidate_projected_ttft_ratio", cand / p.ttft_s)
            .num("projected_ttft_improvement_s", gain);
    }
}

/// The row with the lowest objective (then the fewest prefill engines).
fn lowest<'r>(rows: impl Iterator<Item = &'r Row>) -> Option<&'r Row> {
    rows.min_by(|a, b| {
        a.score
            .objective
            .total_cmp(&b.score.objective)
            .then(a.p.cmp(&b.p))
    })
}

/// 5.2: the reason the demand gates hold, if one does: too little (or, in recovery mode,
/// unpressured) demand, or an urgent recovery without fleet profiles.
fn demand_hold_reason(
    p: &Params,
    snap: &Snapshot,
    demand: &Demand,
    urgent: bool,
    prr: f64,
) -> Option<&'static str> {
    let recovery_mode = !demand.complete;
    let recovery_ready = prr.max(snap.decode_pressure) >= p.expand && snap.profiles_complete;
    let urgent_ready = urgent && snap.profiles_complete;
    if urgent && !snap.profiles_complete {
        Some("projected TTFT recovery requires fleet profiles")
    } else if !urgent_ready
        && (demand.arrivals < p.min_arrivals
            || (!recovery_mode && demand.prefill_engines + demand.decode_engines < p.demand_floor)
            || (recovery_mode && !recovery_ready))
    {
        Some(if recovery_mode {
            "incomplete demand requires observed phase pressure and fleet profiles"
        } else {
            "insufficient demand history"
        })
    } else {
        None
    }
}

/// 5.2: the window demand's details of a demand-gate hold.
fn demand_details(demand: &Demand) -> Details {
    let mut d = Details::default();
    d.num("prefill_work", demand.prefill_engines)
        .num("decode_work", demand.decode_engines)
        .set("arrivals", demand.arrivals)
        .set("output_observations", demand.output_observations)
        .set("demand_complete", demand.complete)
        .set("arrivals_beyond_profile", demand.arrivals_beyond_profile)
        .set("unsized_offers", demand.unsized_offers);
    d
}

/// The observed phase pressures' details (every reactive decision past the health hold).
fn pressure_details(snap: &Snapshot, prr: f64) -> Details {
    let mut d = Details::default();
    d.num("observed_prefill_ratio", snap.prefill_pressure)
        .num("recovery_prefill_ratio", prr)
        .num("queued_prefill_s", snap.queued_prefill_s)
        .num("observed_decode_ratio", snap.decode_pressure);
    d
}

/// 5.6: the short view (when enough arrivals fell within the confirmation horizon): its
/// heading, whether it shifted from the window demand, its demand and current score.
fn short_view(core: &Core, v: &View) -> ShortView {
    let (p, now, cur_p, snap) = (&v.p, v.now, v.cur_p, &v.snap);
    let since = now
        .checked_sub(std::time::Duration::from_secs_f64(v.confirmation_s))
        .unwrap_or(core.started);
    let mut out = ShortView {
        heading: 0,
        shifted: false,
        view: None,
    };
    if core.demand.arrivals_since(since) >= p.min_arrivals {
        let short = core.price(now, v.confirmation_s, p.step_s);
        let short_cur = snap.score(cur_p, short.prefill_engines, short.decode_engines);
        let mut best: Option<(f64, usize)> = None;
        for c in [cur_p.wrapping_sub(1), cur_p + 1] {
            if c == 0 || c >= v.n || c == usize::MAX || !v.floors_safe(c) {
                continue;
            }
            let sc = snap.score(c, short.prefill_engines, short.decode_engines);
            let gain = short_cur.objective - sc.objective;
            if gain >= p.margin && best.is_none_or(|(o, _)| sc.objective < o) {
                best = Some((sc.objective, c));
            }
        }
        if let Some((_, c)) = best {
            out.heading = if c > cur_p { 1 } else { -1 };
        }
        out.shifted = !close(short.prefill_engines, v.demand.prefill_engines, p.tolerance)
            || !close(short.decode_engines, v.demand.decode_engines, p.tolerance);
        out.view = Some((short, short_cur));
    }
    out
}

/// What one row is evaluated with.
struct RowInputs<'a> {
    core: &'a Core,
    snap: &'a Snapshot,
    base: &'a Score,
    base_obj: f64,
    score: Score,
    c: usize,
    cur_p: usize,
    urgent: Option<&'a Recovery>,
    is_departure: bool,
    held_reverse: bool,
    floors_safe: bool,
    steady: bool,
    evidence: &'a Evidence,
    prr: f64,
    now: Instant,
}

/// Whether a departure along `heading` reverses all recent reactive flips: those within
/// `window_s + evidence_span_s` all went the other way, the latest at least
/// `evidence_span_s` old (controller.md 5.6).
fn reverses_recent(core: &Core, heading: i8, now: Instant, p: &super::stage::Params) -> bool {
    let horizon = p.window_s + p.evidence.span_s;
    let recent: Vec<_> = core
        .roles
        .history()
        .filter(|f| f.by == By::Reactive && secs_since(now, f.mono) <= horizon)
        .collect();
    let Some(latest) = recent.last() else {
        return false;
    };
    let against = |to: Role| {
        let dir: i8 = if to == Role::Prefill { 1 } else { -1 };
        dir == -heading
    };
    recent.iter().all(|f| against(f.to)) && secs_since(now, latest.mono) >= p.evidence.span_s
}

/// The evidence details of a D→P row (controller.md 11.1, group 2).
fn evidence_details(d: &mut Details, ev: &Evidence) {
    d.num("evidence_span_s", ev.span_s)
        .set("evidence_arrivals", ev.arrivals)
        .num("evidence_required_span_s", ev.required_span_s)
        .set("evidence_required_arrivals", ev.required_arrivals)
        .num("evidence_max_span_s", ev.max_span_s)
        .set("evidence_closed", ev.closed)
        .set("risk_kind", ev.risk_kind.clone())
        .opt("risk_age_s", ev.risk_age_s)
        .num("evidence_short_decode_engines", ev.short_decode)
        .num("evidence_long_decode_engines", ev.long_decode)
        .opt("evidence_trend_ratio", ev.trend_ratio)
        .num("evidence_envelope_decode_engines", ev.envelope_decode)
        .set("evidence_blocked_gate", ev.gate.as_str());
}

/// The first hold reason that applies to the reported row (controller.md 5.9).
fn hold_reason(
    r: &Row,
    urgent: bool,
    ev: &Evidence,
    profiles_complete: bool,
    margin: f64,
    departure_heading: i8,
) -> String {
    let to_prefill = r.up;
    if !r.floors_safe {
        return if to_prefill {
            "min_decode blocks the adjacent split".into()
        } else {
            "min_prefill blocks the adjacent split".into()
        };
    }
    if r.held_reverse {
        return if departure_heading < 0 {
            "departure toward decode holds the reverse move".into()
        } else {
            "departure toward prefill holds the reverse move".into()
        };
    }
    if to_prefill && let Some(reason) = ev.reason() {
        return reason;
    }
    if r.mixed && !profiles_complete {
        return "mixed pressure requires fleet profiles".into();
    }
    if urgent && r.urgent.is_none_or(|(_, gain)| gain <= 0.0) {
        return "projected TTFT recovery requires a strict prefill improvement".into();
    }
    if !r.score.covered {
        return "decode profile does not cover proposed work".into();
    }
    if !r.capacity_safe {
        return "projected decode work exceeds KV capacity".into();
    }
    if urgent && r.mixed && r.improvement <= 0.0 {
        return "mixed pressure requires a lower projected objective".into();
    }
    if !r.source_safe {
        return if to_prefill {
            "projected decode pressure blocks consolidation".into()
        } else {
            "projected prefill pressure blocks consolidation".into()
        };
    }
    if r.improvement < margin || (r.mixed && r.improvement <= 0.0) {
        return "projected improvement is below the movement margin".into();
    }
    "operator constraints leave no adjacent split".into()
}
