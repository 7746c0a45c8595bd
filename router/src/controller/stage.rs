//! What every controller stage reads: the settings, the engines as this pass sees them, the
//! profiles, the bookkeeping, the demand model, the role changes, the newest risk; and the
//! captures built from them (snapshot, demand, evidence).
//!
//! Pure: `now` is passed in.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::book::Book;
use super::evidence::{self, Capture, Evidence};
use super::roles::{Engine, RoleChanges};
use super::scoring::Snapshot;
use crate::config::{Config, Role};
use crate::demand::model::{Demand, DemandModel, PriceInputs};
use crate::profile::Profile;

/// The controller's settings, read once from the fleet file (controller.md section 6).
#[derive(Debug, Clone)]
pub(crate) struct Params {
    /// `slo.ttft_s`.
    pub(crate) ttft_s: f64,
    /// `slo.tpot_s`.
    pub(crate) tpot_s: f64,
    /// `reactive.step_s`.
    pub(crate) step_s: f64,
    /// `reactive.window_s`.
    pub(crate) window_s: f64,
    /// `max(reactive.confirmations, thresholds.sustained_intervals)`.
    pub(crate) confirmations: u64,
    /// `thresholds.sustained_intervals`.
    pub(crate) sustained: u64,
    /// `thresholds.expand` E.
    pub(crate) expand: f64,
    /// `thresholds.shrink` S.
    pub(crate) shrink: f64,
    /// `thresholds.panic_ratio`.
    pub(crate) panic_ratio: f64,
    /// `reactive.utilization` u.
    pub(crate) utilization: f64,
    /// `reactive.min_arrivals`.
    pub(crate) min_arrivals: u64,
    /// `reactive.demand_floor`.
    pub(crate) demand_floor: f64,
    /// `reactive.movement_margin` m.
    pub(crate) margin: f64,
    /// `reactive.demand_rise_tolerance` τ.
    pub(crate) tolerance: f64,
    /// The evidence gate's settings.
    pub(crate) evidence: evidence::Settings,
    /// `controller.min_prefill`.
    pub(crate) min_prefill: usize,
    /// `controller.min_decode`.
    pub(crate) min_decode: usize,
}

impl Params {
    /// The settings of `cfg`.
    pub(crate) fn from_config(cfg: &Config) -> Params {
        let c = &cfg.controller;
        let r = &c.reactive;
        Params {
            ttft_s: cfg.slo.ttft_s,
            tpot_s: cfg.slo.tpot_s,
            step_s: r.step_s,
            window_s: r.window_s,
            confirmations: r.confirmations.max(c.thresholds.sustained_intervals),
            sustained: c.thresholds.sustained_intervals,
            expand: c.thresholds.expand,
            shrink: c.thresholds.shrink,
            panic_ratio: c.thresholds.panic_ratio,
            utilization: r.utilization,
            min_arrivals: r.min_arrivals,
            demand_floor: r.demand_floor,
            margin: r.movement_margin,
            tolerance: r.demand_rise_tolerance,
            evidence: evidence::Settings {
                span_s: r.evidence_span_s,
                max_span_s: r.evidence_max_span_s,
                min_arrivals: r.evidence_min_arrivals,
                tolerance: r.demand_rise_tolerance,
            },
            min_prefill: c.min_prefill as usize,
            min_decode: c.min_decode as usize,
        }
    }

    /// `step_s · max(confirmations, sustained_intervals)`, seconds (controller.md 5.3).
    pub(crate) fn confirmation_s(&self) -> f64 {
        self.step_s * self.confirmations as f64
    }
}

/// The shared state of the controller's stages (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct Core {
    /// Settings.
    pub(crate) p: Params,
    /// Engine ids, config order.
    pub(crate) names: Vec<String>,
    /// Profiles per engine (`None` without one).
    pub(crate) profiles: Vec<Option<Profile>>,
    /// Request-path bookkeeping.
    pub(crate) book: Book,
    /// The demand windows.
    pub(crate) demand: DemandModel,
    /// Flips, refusals, holds.
    pub(crate) roles: RoleChanges,
    /// The engines as this pass sees them (roles change on an applied flip).
    pub(crate) engines: Vec<Engine>,
    /// The newest risk event: kind and time.
    pub(crate) risk: Option<(String, Instant)>,
    /// Risk events per kind.
    pub(crate) risk_events: BTreeMap<String, u64>,
    /// The window demand of the last evaluation (`last_demand`).
    pub(crate) last_demand: Option<Demand>,
    /// The evidence of the last evaluation.
    pub(crate) last_evidence: Option<Evidence>,
    /// Router construction.
    pub(crate) started: Instant,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

impl Core {
    /// Configured engines with `role`.
    pub(crate) fn configured(&self, role: Role) -> usize {
        self.engines.iter().filter(|e| e.role == role).count()
    }

    /// Live engines with `role`.
    pub(crate) fn live(&self, role: Role) -> usize {
        self.engines
            .iter()
            .filter(|e| e.role == role && e.live)
            .count()
    }

    /// The fleet's decode correction: the median over decode-role engines (1.0 without).
    pub(crate) fn correction(&self) -> f64 {
        median(
            (0..self.engines.len())
                .filter(|i| self.engines[*i].role == Role::Decode)
                .map(|i| self.book.correction(i))
                .collect(),
        )
        .unwrap_or(1.0)
    }

    /// Every configured profile (empty when the fleet has none).
    pub(crate) fn all_profiles(&self) -> Vec<Profile> {
        self.profiles.iter().flatten().cloned().collect()
    }

    /// The demand over `horizon_s` (residency over `resident_s`).
    pub(crate) fn price(&self, now: Instant, horizon_s: f64, resident_s: f64) -> Demand {
        let profiles = if self.profiles.iter().all(Option::is_some) {
            self.all_profiles()
        } else {
            Vec::new()
        };
        self.demand.price(
            now,
            horizon_s,
            resident_s,
            PriceInputs {
                profiles: &profiles,
                tpot_s: self.p.tpot_s,
                correction: self.correction(),
            },
        )
    }

    /// The cheapest own prefill of `input` prompt tokens among live prefill engines (all
    /// live engines when none has the role), seconds; `None` without a profiled candidate.
    /// `cached[i]` = the prompt tokens the KV index credits engine `i` with (controller.md
    /// 3.5), so each engine is priced at its uncached tokens; an empty slice (a request not
    /// yet scored, e.g. one waiting for a seat) prices the whole prompt everywhere.
    pub(crate) fn cheapest_prefill(&self, input: u64, cached: &[u64]) -> Option<f64> {
        let pick = |role: Option<Role>| {
            (0..self.engines.len())
                .filter(|i| {
                    self.engines[*i].live && role.is_none_or(|r| self.engines[*i].role == r)
                })
                .filter_map(|i| {
                    let uncached = input.saturating_sub(cached.get(i).copied().unwrap_or(0));
                    Some(self.profiles[i].as_ref()?.prefill_time(uncached))
                })
                .min_by(f64::total_cmp)
        };
        pick(Some(Role::Prefill)).or_else(|| pick(None))
    }

    /// Request `id` was placed on engine `iid` (attempt `attempt`), whose prefix cache the
    /// KV index credits with `cached` of its prompt tokens (`None`: no KV score). Its prefill
    /// is priced from then on at the uncached tokens on `iid` (controller.md 3.5); the first
    /// attempt's placement also takes the cached part off its arrival's demand price.
    pub(crate) fn placed(
        &mut self,
        id: u64,
        iid: usize,
        cached: Option<u64>,
        attempt: u32,
        now: Instant,
    ) {
        self.book.placed(id, iid, cached);
        if attempt == 1
            && let Some(r) = self.book.req(id)
        {
            let (input, uncached) = (r.input, r.uncached_on(iid));
            self.demand.placed(now, input, uncached);
        }
    }

    /// The live fleet and its load now (controller.md 4.2).
    pub(crate) fn snapshot(&self, now: Instant) -> Snapshot {
        let live: Vec<usize> = (0..self.engines.len())
            .filter(|i| self.engines[*i].live)
            .collect();
        let role_of = |i: usize| self.engines[i].role;
        let loads: Vec<_> = live.iter().map(|i| (*i, self.book.load(*i))).collect();
        let pool_mean = |vals: Vec<f64>| {
            if vals.is_empty() {
                0.0
            } else {
                vals.iter().sum::<f64>() / vals.len() as f64
            }
        };
        let prefill_pressure = pool_mean(
            loads
                .iter()
                .filter(|(i, l)| role_of(*i) == Role::Prefill || l.prefill > 0)
                .map(|(i, _)| self.book.prefill_load(*i, self.p.ttft_s))
                .collect(),
        );
        let decode_pressure = pool_mean(
            loads
                .iter()
                .filter(|(i, l)| role_of(*i) == Role::Decode || l.decode > 0)
                .map(|(i, _)| self.book.decode_load(*i, now))
                .collect(),
        );
        let queued_prefill_s: f64 = self
            .book
            .waiting()
            .iter()
            .filter_map(|w| self.cheapest_prefill(w.input, &[]))
            .sum();
        let decode_roles: Vec<usize> = live
            .iter()
            .copied()
            .filter(|i| role_of(*i) == Role::Decode)
            .collect();
        let handoff_s = pool_mean(
            decode_roles
                .iter()
                .map(|i| self.book.handoff_s(*i))
                .collect(),
        );
        Snapshot {
            n: live.len(),
            prefill: live
                .iter()
                .filter(|i| role_of(**i) == Role::Prefill)
                .count(),
            decode: decode_roles.len(),
            profiles_complete: live.iter().all(|i| self.profiles[*i].is_some()),
            profiles: live
                .iter()
                .filter_map(|i| self.profiles[*i].clone())
                .collect(),
            prefill_pressure,
            decode_pressure,
            resident_prefill_s: loads.iter().map(|(_, l)| l.prefill_s).sum::<f64>()
                + queued_prefill_s,
            queued_prefill_s,
            decode_tokens: loads.iter().map(|(_, l)| l.decode_tokens).sum(),
            decode_requests: loads.iter().map(|(_, l)| f64::from(l.decode)).sum(),
            active_decode: loads.iter().filter(|(_, l)| l.decode > 0).count(),
            pending_decode: self.book.pending_decode(),
            handoff_s,
            correction: self.correction(),
            ttft_s: self.p.ttft_s,
            tpot_s: self.p.tpot_s,
            utilization: self.p.utilization,
        }
    }

    /// Captures the evidence gate with `window` as the long-horizon demand
    /// (controller.md 8).
    pub(crate) fn evidence(&self, now: Instant, window: &Demand) -> Evidence {
        let s = &self.p.evidence;
        let since = self.risk.as_ref().map(|(_, at)| *at);
        let cutoff = evidence::cutoff(now, s, since);
        let span_since = now
            .checked_sub(Duration::from_secs_f64(s.span_s))
            .unwrap_or(self.started);
        let short = self.price(now, s.span_s, s.span_s);
        evidence::capture(
            now,
            s,
            Capture {
                risk: self.risk.as_ref().map(|(k, at)| (k.as_str(), *at)),
                risk_events: self.risk_events.clone(),
                counted: self.demand.evidence(cutoff),
                recent_arrivals: self.demand.arrivals_since(span_since),
                short_decode: short.decode_engines,
                long_decode: window.decode_engines,
            },
        )
    }

    /// The worst projected TTFT of the waiting requests on the live prefill engines, plus
    /// `extra` engines (donors), with the rid of that request; `None` without waiting
    /// requests or when a pool engine has no profile (controller.md 4.4).
    pub(crate) fn project_worst(&self, now: Instant, extra: &[usize]) -> Option<(f64, String)> {
        let pool: Vec<usize> = (0..self.engines.len())
            .filter(|i| self.engines[*i].live && self.engines[*i].role == Role::Prefill)
            .chain(extra.iter().copied())
            .collect();
        if pool.is_empty() || pool.iter().any(|i| self.profiles[*i].is_none()) {
            return None;
        }
        let loads: Vec<f64> = pool.iter().map(|i| self.book.load(*i).prefill_s).collect();
        let waiting = self.book.waiting();
        if waiting.is_empty() {
            return None;
        }
        let priced: Vec<(f64, f64)> = waiting
            .iter()
            .map(|w| {
                let price = pool
                    .iter()
                    .filter_map(|i| self.profiles[*i].as_ref())
                    .map(|p| p.prefill_time(w.input))
                    .fold(f64::INFINITY, f64::min);
                (
                    now.saturating_duration_since(w.arrived).as_secs_f64(),
                    price,
                )
            })
            .collect();
        let projected = super::scoring::project(&loads, &priced);
        projected
            .iter()
            .zip(&waiting)
            .max_by(|a, b| a.0.total_cmp(b.0))
            .map(|(t, w)| (*t, w.rid.clone()))
    }
}
