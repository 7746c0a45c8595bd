//! Placement: pick the prefill and decode engines for one attempt (behaviour.md 7.1 steps 1
//! and 5, 7.2 step 1; architecture.md section 5).
//!
//! ```text
//!  Snapshot { engines: [role, live, resident{prefill,decode}] } + avoid set + rng
//!        │  pick(Phase, producer)            power of two choices on outstanding work, or
//!        │                                   with a KV score: min uncached × (in_flight + 1)
//!        ▼
//!  Option<engine index>
//! ```
//!
//! The KV score (docs/design/kv-aware-placement.md): given each engine's uncached prompt
//! tokens ([`KvScore`]), an aggregated engine or a prefill engine is the candidate of least
//! `uncached_tokens × (outstanding + 1)`, ties by power of two choices among the tied; when the
//! most and least loaded candidates differ by more than `abs` requests **and** more than `rel`
//! times (SGLang router's `balance_abs_threshold` / `balance_rel_threshold` meaning), the cache is
//! ignored and the least loaded wins. The decode leg of a split is placed by load only.
//!
//! Pure: no clock, no IO, the RNG is passed in. An engine is *live* when its exclusion set is
//! empty (reasons `ejected`, `draining`, `awaiting_health` — behaviour.md 6.1); health and
//! admission stay separate as in linkerd's p2c pool.

use std::borrow::Cow;
use std::collections::BTreeSet;

use rand::Rng;

use crate::config::Role;

/// Why an engine is out of placement (behaviour.md 6.1). An engine with no reason is live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Exclusion {
    /// The breaker ejected it; the monitor probes it for readmission.
    Ejected,
    /// A lifecycle hold (drain, wave, validation) keeps it out (`Fleet::set_held`).
    Draining,
    /// Its role is changing: an engine-side switch or the role check runs
    /// (controller.md 9.2 `switching`).
    Switching,
    /// Its health path has not answered 200 since the router started watching it (the
    /// health gate).
    AwaitingHealth,
}

impl Exclusion {}

/// Which leg a placement or residency count is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Phase {
    /// The prefill leg.
    Prefill,
    /// The decode leg (also the single leg of aggregated serving).
    Decode,
}

impl Phase {
    /// `"prefill"` or `"decode"`: the label and error `type` used on the wire.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

/// Placement-relevant state of one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EngineSlot {
    /// Current pool.
    pub role: Role,
    /// Reasons it is out of placement; empty = live.
    pub excluded: BTreeSet<Exclusion>,
    /// Requests resident in the prefill phase on it.
    pub resident_prefill: u32,
    /// Requests resident in the decode phase on it.
    pub resident_decode: u32,
    /// The KV its resident requests hold, tokens: each one's uncached prompt tokens and output
    /// budget as placed ([`Measure::Tokens`]).
    pub kv_tokens: u64,
    /// Requests the engine itself reports running or waiting beyond ours (another router's,
    /// clients' sent to it directly), as of the last reading (`serving.engine_load_poll_s`;
    /// `engine_load`): placement weighs them with ours; drains never wait for them.
    pub foreign: u32,
}

/// What placement weighs an engine's load by: the fleet file's `serving.placement_load`.
pub(crate) use crate::config::PlacementLoad as Measure;

impl EngineSlot {
    /// A live engine with nothing resident.
    pub(crate) fn new(role: Role) -> Self {
        EngineSlot {
            role,
            excluded: BTreeSet::new(),
            resident_prefill: 0,
            resident_decode: 0,
            kv_tokens: 0,
            foreign: 0,
        }
    }

    /// Live = no exclusion reason.
    pub(crate) fn is_live(&self) -> bool {
        self.excluded.is_empty()
    }

    /// Outstanding work on the engine: both phases count (one GPU serves both).
    pub(crate) fn outstanding(&self) -> u32 {
        self.resident_prefill + self.resident_decode
    }

    /// The requests placement weighs: ours resident and the foreign ones the engine reported.
    pub(crate) fn busy(&self) -> u32 {
        self.outstanding().saturating_add(self.foreign)
    }

    /// Its load as `measure` weighs it: requests (ours and foreign, [`EngineSlot::busy`]) or
    /// tokens.
    pub(crate) fn load(&self, measure: Measure) -> u64 {
        match measure {
            Measure::Requests => u64::from(self.busy()),
            Measure::Tokens => self.kv_tokens,
        }
    }
}

/// How the attempt will be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Prefill on `prefill`, decode on `decode` (two engines: their roles differ).
    Split {
        /// Producer index.
        prefill: usize,
        /// Consumer index.
        decode: usize,
    },
    /// One leg on one engine without KV parameters, because a role has no live engine
    /// (behaviour.md 6.7 "aggregated" mode).
    Aggregated {
        /// The engine index.
        engine: usize,
    },
}

/// Choose among `candidates` by power of two choices on their load as `measure` weighs it:
/// sample two distinct candidates uniformly, keep the less loaded (ties: the first sampled).
fn p2c<R: Rng + ?Sized>(
    slots: &[EngineSlot],
    candidates: &[usize],
    measure: Measure,
    rng: &mut R,
) -> Option<usize> {
    let (a, b) = two_of(candidates.len(), rng)?;
    let Some(b) = b else {
        return Some(candidates[a]);
    };
    let (ia, ib) = (candidates[a], candidates[b]);
    if slots[ib].load(measure) < slots[ia].load(measure) {
        Some(ib)
    } else {
        Some(ia)
    }
}

/// The positions power of two choices samples among `n` candidates: two distinct uniform
/// ones, one when `n` is 1, none when it is 0.
fn two_of<R: Rng + ?Sized>(n: usize, rng: &mut R) -> Option<(usize, Option<usize>)> {
    match n {
        0 => None,
        1 => Some((0, None)),
        n => {
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            Some((a, Some(b)))
        }
    }
}

/// The balance guard of the KV score (`serving.kv_balance_abs_threshold`,
/// `serving.kv_balance_rel_threshold`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Balance {
    /// Requests: the most and least loaded candidate must differ by more than this…
    pub abs: u64,
    /// …and the most loaded carry more than this times the least loaded's work (ratio ≥ 1).
    pub rel: f64,
}

impl Balance {
    /// Whether outstanding work `max` vs `min` is imbalanced (both thresholds exceeded).
    pub(crate) fn imbalanced(self, max: u32, min: u32) -> bool {
        u64::from(max - min) > self.abs && f64::from(max) > self.rel * f64::from(min)
    }
}

/// The KV score's input for one placement: per engine (config order), the prompt tokens it
/// would compute (the prompt's tokens less those its index credits, exact or approximate;
/// the whole prompt for an engine in mode `none`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KvScore {
    /// Uncached prompt tokens per engine, config order.
    pub uncached: Vec<u64>,
    /// The balance guard.
    pub balance: Balance,
}

/// Choose among `candidates` by the KV score (module doc); `None` when there is none.
///
/// Three passes over `candidates` and no allocation: the loads' range, the least cost, then
/// power of two choices among the candidates of that cost (in `candidates` order, as if they
/// were listed).
pub(crate) fn pick_cached<R: Rng + ?Sized>(
    slots: &[EngineSlot],
    candidates: &[usize],
    score: &KvScore,
    measure: Measure,
    rng: &mut R,
) -> Option<usize> {
    let load = |i: usize| slots[i].busy();
    let (min, max) = candidates
        .iter()
        .map(|i| load(*i))
        .fold(None, |acc: Option<(u32, u32)>, l| {
            Some(acc.map_or((l, l), |(lo, hi)| (lo.min(l), hi.max(l))))
        })?;
    let by_load = score.balance.imbalanced(max, min);
    let cost = |i: usize| match (by_load, measure) {
        (true, _) => u128::from(slots[i].load(measure)),
        (false, Measure::Requests) => u128::from(score.uncached[i]) * u128::from(load(i) + 1),
        (false, Measure::Tokens) => u128::from(score.uncached[i]) + u128::from(slots[i].kv_tokens),
    };
    let (best, tied) = candidates.iter().fold((u128::MAX, 0usize), |(best, n), i| {
        let c = cost(*i);
        match c.cmp(&best) {
            std::cmp::Ordering::Less => (c, 1),
            std::cmp::Ordering::Equal => (best, n + 1),
            std::cmp::Ordering::Greater => (best, n),
        }
    });
    let (a, b) = two_of(tied, rng)?;
    let mut at = candidates.iter().copied().filter(|i| cost(*i) == best);
    let Some(b) = b else {
        return at.next();
    };
    // The a-th and b-th of the tied, in order.
    let (first, second) = (a.min(b), a.max(b));
    let x = at.nth(first)?;
    let y = at.nth(second - first - 1)?;
    let (ia, ib) = if a < b { (x, y) } else { (y, x) };
    if slots[ib].load(measure) < slots[ia].load(measure) {
        Some(ib)
    } else {
        Some(ia)
    }
}

/// The live engines of each pool, in index order: what placement chooses among before an
/// attempt's avoid set. Kept by the fleet beside its slots and rebuilt whenever a role or an
/// exclusion changes ([`LiveLists::of`]), so a placement walks only the engines it chooses
/// among, not the whole fleet (docs/design/kv-aware-placement.md, "What a request's score
/// costs").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LiveLists {
    /// Live prefill-role engines.
    pub prefill: Vec<usize>,
    /// Live decode-role engines.
    pub decode: Vec<usize>,
    /// Every live engine.
    pub live: Vec<usize>,
}

impl LiveLists {
    /// The lists of `slots`.
    pub(crate) fn of(slots: &[EngineSlot]) -> LiveLists {
        let mut l = LiveLists::default();
        for (i, s) in slots.iter().enumerate().filter(|(_, s)| s.is_live()) {
            match s.role {
                Role::Prefill => l.prefill.push(i),
                Role::Decode => l.decode.push(i),
            }
            l.live.push(i);
        }
        l
    }

    fn of_role(&self, role: Role) -> &[usize] {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }

    /// The engines the KV score would choose among in [`plan_in`] with nothing avoided: the
    /// live prefill engines of a split, else the engines of an aggregated plan. Avoiding
    /// engines only narrows these lists (a role whose candidates are all avoided falls back to
    /// the same list), so no attempt of a request chooses among others: only these are scored,
    /// and with at most one there is nothing for the score to decide
    /// (docs/design/kv-aware-placement.md, "One engine to choose from", "What a request's
    /// score costs").
    pub(crate) fn choices(&self, aggregate: Aggregate) -> &[usize] {
        if !self.prefill.is_empty() && !self.decode.is_empty() {
            &self.prefill
        } else if !self.decode.is_empty() || aggregate == Aggregate::DecodeOnly {
            &self.decode
        } else {
            &self.live
        }
    }
}

/// `list` less the engines in `avoid`, or the whole list when that would leave none
/// (retrying on the same engine beats failing a transient error); borrowed when nothing is
/// avoided.
fn preferring<'a>(list: &'a [usize], avoid: &BTreeSet<usize>) -> Cow<'a, [usize]> {
    if avoid.is_empty() || !list.iter().any(|i| avoid.contains(i)) {
        return Cow::Borrowed(list);
    }
    let kept: Vec<usize> = list
        .iter()
        .copied()
        .filter(|i| !avoid.contains(i))
        .collect();
    if kept.is_empty() {
        Cow::Borrowed(list)
    } else {
        Cow::Owned(kept)
    }
}

/// Which engines may serve an aggregated (single-leg) request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Aggregate {
    /// Any live engine, decode-role engines first (vLLM: every engine is `kv_both`).
    AnyRole,
    /// Only decode-role engines (SGLang: a prefill-mode server cannot serve a whole request).
    DecodeOnly,
}

/// The engines [`LiveLists::choices`] names, as a mask over `slots` (tests and callers that
/// hold no lists).
#[cfg(test)]
pub(crate) fn choice_set(slots: &[EngineSlot], aggregate: Aggregate) -> Vec<bool> {
    let mut mask = vec![false; slots.len()];
    for i in LiveLists::of(slots).choices(aggregate) {
        mask[*i] = true;
    }
    mask
}

#[cfg(test)]
/// Plan one attempt with [`Aggregate::AnyRole`]; see [`plan_in`].
pub(crate) fn plan<R: Rng + ?Sized>(
    slots: &[EngineSlot],
    avoid: &BTreeSet<usize>,
    rng: &mut R,
) -> Option<Plan> {
    plan_with(
        slots,
        avoid,
        Aggregate::AnyRole,
        None,
        Measure::Requests,
        rng,
    )
}

#[cfg(test)]
/// [`plan_in`] with the lists of `slots` built for this one plan.
pub(crate) fn plan_with<R: Rng + ?Sized>(
    slots: &[EngineSlot],
    avoid: &BTreeSet<usize>,
    aggregate: Aggregate,
    kv: Option<&KvScore>,
    measure: Measure,
    rng: &mut R,
) -> Option<Plan> {
    plan_in(
        slots,
        &LiveLists::of(slots),
        avoid,
        aggregate,
        kv,
        measure,
        rng,
    )
}

/// Plan one attempt over `slots`, whose live engines are `lists` ([`LiveLists::of`] of the
/// same slots).
///
/// * Split when both roles have a live engine: prefill by p2c over live prefill engines;
///   decode by p2c over live decode engines (behaviour.md 7.1 step 5: never the producer,
///   which is of the other role).
/// * `avoid` (engines that failed earlier attempts of this request, behaviour.md 7.5) is
///   honoured per role while it leaves a candidate; when it would empty a role, that role
///   ignores it (retrying on the same engine beats failing a transient error, and keeps the
///   request disaggregated).
/// * Otherwise aggregated (behaviour.md 6.7): p2c over live decode-role engines, then, with
///   [`Aggregate::AnyRole`], over any live engine (avoid honoured the same way).
/// * With `kv`, the prefill engine of a split and the engine of an aggregated plan are
///   chosen by the KV score ([`pick_cached`]) instead of p2c; the decode leg stays p2c.
/// * `measure` weighs each engine's load: resident requests, or the KV tokens they hold (a
///   split's decode leg then goes where the least KV is held).
/// * `None` when no engine may serve.
///
/// Cost: with nothing avoided and no KV score, constant in the fleet size; with a score,
/// linear in the engines chosen among (each one's score is read).
pub(crate) fn plan_in<R: Rng + ?Sized>(
    slots: &[EngineSlot],
    lists: &LiveLists,
    avoid: &BTreeSet<usize>,
    aggregate: Aggregate,
    kv: Option<&KvScore>,
    measure: Measure,
    rng: &mut R,
) -> Option<Plan> {
    debug_assert_eq!(
        *lists,
        LiveLists::of(slots),
        "the fleet's live lists are stale"
    );
    let first = |c: &[usize], rng: &mut R| match kv {
        Some(score) => pick_cached(slots, c, score, measure, rng),
        None => p2c(slots, c, measure, rng),
    };
    let pre = preferring(lists.of_role(Role::Prefill), avoid);
    let dec = preferring(lists.of_role(Role::Decode), avoid);
    if !pre.is_empty() && !dec.is_empty() {
        let prefill = first(&pre, rng)?;
        let decode = p2c(slots, &dec, measure, rng)?;
        return Some(Plan::Split { prefill, decode });
    }
    let single = if !dec.is_empty() || aggregate == Aggregate::DecodeOnly {
        dec
    } else {
        preferring(&lists.live, avoid)
    };
    first(&single, rng).map(|engine| Plan::Aggregated { engine })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn fleet(roles: &[Role]) -> Vec<EngineSlot> {
        roles.iter().map(|r| EngineSlot::new(*r)).collect()
    }

    const P: Role = Role::Prefill;
    const D: Role = Role::Decode;

    fn choice_width(slots: &[EngineSlot], aggregate: Aggregate) -> usize {
        choice_set(slots, aggregate).iter().filter(|c| **c).count()
    }

    #[test]
    fn the_choice_set_is_what_the_kv_score_would_choose_among() {
        let any = Aggregate::AnyRole;
        // Which engines, not only how many.
        assert_eq!(
            choice_set(&fleet(&[P, D, P, D]), any),
            [true, false, true, false]
        );
        assert_eq!(choice_set(&fleet(&[D, D]), any), [true, true]);
        let mut slots = fleet(&[P, D, D]);
        slots[0].excluded.insert(Exclusion::Ejected);
        assert_eq!(
            choice_set(&slots, any),
            [false, true, true],
            "aggregated on the decode engines"
        );
        // Every first pick of a plan is in the set.
        let mut rng = StdRng::seed_from_u64(3);
        for roles in [&[P, D, D][..], &[P, P, D], &[D, D, D], &[P, P]] {
            let slots = fleet(roles);
            let set = choice_set(&slots, any);
            for _ in 0..50 {
                let computes = match plan(&slots, &BTreeSet::new(), &mut rng) {
                    Some(Plan::Split { prefill, .. }) => prefill,
                    Some(Plan::Aggregated { engine }) => engine,
                    None => unreachable!("a live fleet"),
                };
                assert!(set[computes], "{roles:?}: {computes}");
            }
        }
        // A split chooses its prefill engine; the decode leg is p2c, never scored.
        assert_eq!(choice_width(&fleet(&[P, D]), any), 1);
        assert_eq!(choice_width(&fleet(&[P, D, D, D]), any), 1);
        assert_eq!(choice_width(&fleet(&[P, P, D]), any), 2);
        // Aggregated: the decode engines, else (vLLM) any live engine.
        assert_eq!(choice_width(&fleet(&[D]), any), 1);
        assert_eq!(choice_width(&fleet(&[D, D]), any), 2);
        assert_eq!(choice_width(&fleet(&[P, P]), any), 2);
        assert_eq!(choice_width(&fleet(&[P, P]), Aggregate::DecodeOnly), 0);
        // Engines out of placement do not count.
        let mut slots = fleet(&[P, P, D]);
        slots[1].excluded.insert(Exclusion::Ejected);
        assert_eq!(choice_width(&slots, any), 1);
        slots[0].excluded.insert(Exclusion::Ejected);
        assert_eq!(
            choice_width(&slots, any),
            1,
            "aggregated on the decode engine"
        );
    }

    #[test]
    fn split_uses_one_engine_of_each_role() {
        let slots = fleet(&[P, D]);
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            plan(&slots, &BTreeSet::new(), &mut rng),
            Some(Plan::Split {
                prefill: 0,
                decode: 1
            })
        );
    }

    #[test]
    fn ejected_and_draining_engines_are_never_chosen() {
        let mut slots = fleet(&[P, P, D, D]);
        slots[0].excluded.insert(Exclusion::Ejected);
        slots[3].excluded.insert(Exclusion::Draining);
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..200 {
            assert_eq!(
                plan(&slots, &BTreeSet::new(), &mut rng),
                Some(Plan::Split {
                    prefill: 1,
                    decode: 2
                })
            );
        }
    }

    #[test]
    fn two_choices_prefer_the_less_loaded() {
        let mut slots = fleet(&[P, P, D]);
        slots[0].resident_prefill = 5;
        let mut rng = StdRng::seed_from_u64(3);
        // With two prefill candidates both are always sampled, so the idle one wins every time.
        for _ in 0..100 {
            assert_eq!(
                plan(&slots, &BTreeSet::new(), &mut rng),
                Some(Plan::Split {
                    prefill: 1,
                    decode: 2
                })
            );
        }
    }

    #[test]
    fn decode_avoids_the_producer_unless_it_is_the_only_candidate() {
        // Roles are exclusive, so the producer is never a decode candidate here; the rule
        // matters once roles move (role flips). Check the decode is always another engine.
        let slots = fleet(&[P, D, D]);
        let mut rng = StdRng::seed_from_u64(9);
        for _ in 0..50 {
            match plan(&slots, &BTreeSet::new(), &mut rng) {
                Some(Plan::Split { prefill, decode }) => {
                    assert_eq!(prefill, 0);
                    assert_ne!(decode, prefill);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn missing_role_falls_back_to_aggregated() {
        let mut slots = fleet(&[P, D]);
        slots[0].excluded.insert(Exclusion::Ejected);
        let mut rng = StdRng::seed_from_u64(2);
        assert_eq!(
            plan(&slots, &BTreeSet::new(), &mut rng),
            Some(Plan::Aggregated { engine: 1 })
        );
        slots[1].excluded.insert(Exclusion::Ejected);
        assert_eq!(plan(&slots, &BTreeSet::new(), &mut rng), None);
    }

    #[test]
    fn sglang_aggregates_only_on_decode_engines() {
        let mut slots = fleet(&[P, D]);
        let mut rng = StdRng::seed_from_u64(4);
        slots[1].excluded.insert(Exclusion::Ejected);
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::DecodeOnly,
                None,
                Measure::Requests,
                &mut rng
            ),
            None
        );
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                None,
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Aggregated { engine: 0 })
        );
        slots[1].excluded.clear();
        slots[0].excluded.insert(Exclusion::Draining);
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::DecodeOnly,
                None,
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Aggregated { engine: 1 })
        );
    }

    #[test]
    fn retry_avoid_set_is_honoured() {
        let slots = fleet(&[P, P, D, D]);
        let avoid: BTreeSet<usize> = [0, 2].into();
        let mut rng = StdRng::seed_from_u64(5);
        assert_eq!(
            plan(&slots, &avoid, &mut rng),
            Some(Plan::Split {
                prefill: 1,
                decode: 3
            })
        );
    }

    #[test]
    fn avoid_set_that_empties_a_role_is_ignored_for_that_role() {
        let slots = fleet(&[P, P, D]);
        let avoid: BTreeSet<usize> = [0, 2].into();
        let mut rng = StdRng::seed_from_u64(5);
        assert_eq!(
            plan(&slots, &avoid, &mut rng),
            Some(Plan::Split {
                prefill: 1,
                decode: 2
            })
        );
    }

    fn score(uncached: &[u64]) -> KvScore {
        KvScore {
            uncached: uncached.to_vec(),
            balance: Balance { abs: 4, rel: 1.5 },
        }
    }

    #[test]
    fn kv_score_prefers_the_engine_holding_the_prefix() {
        let slots = fleet(&[D, D, D]);
        let mut rng = StdRng::seed_from_u64(11);
        // 100-token prompt: engine 2 holds 96 of them.
        let s = score(&[100, 100, 4]);
        for _ in 0..50 {
            assert_eq!(
                plan_with(
                    &slots,
                    &BTreeSet::new(),
                    Aggregate::AnyRole,
                    Some(&s),
                    Measure::Requests,
                    &mut rng
                ),
                Some(Plan::Aggregated { engine: 2 })
            );
        }
    }

    /// `placement_load: tokens`: an engine's cost is the prompt tokens it would compute plus
    /// the KV its residents hold, so a hot prefix's holder keeps it until what it carries
    /// outweighs computing the prefix elsewhere; the decode leg of a split goes where the least
    /// KV is held, whatever the request counts.
    #[test]
    fn tokens_weigh_what_an_engine_would_compute_against_what_it_carries() {
        let mut slots = fleet(&[D, D]);
        let mut rng = StdRng::seed_from_u64(21);
        // A 5,000-token prefix held by engine 0: 40 uncached there, 5,040 on engine 1 (the
        // balance guard out of the way, as by default).
        let s = KvScore {
            balance: Balance {
                abs: 1000,
                rel: 1.5,
            },
            ..score(&[40, 5040])
        };
        let place = |slots: &[EngineSlot], rng: &mut StdRng| {
            plan_with(
                slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Tokens,
                rng,
            )
        };
        slots[0].resident_decode = 4;
        slots[0].kv_tokens = 4 * 1064;
        assert_eq!(
            place(&slots, &mut rng),
            Some(Plan::Aggregated { engine: 0 })
        );
        slots[0].resident_decode = 5;
        slots[0].kv_tokens = 5 * 1064;
        assert_eq!(
            place(&slots, &mut rng),
            Some(Plan::Aggregated { engine: 1 }),
            "40 + 5,320 held outweighs computing the prefix on the idle engine"
        );
        // By requests the holder keeps it: 40 × 6 < 5,040 × 1.
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Aggregated { engine: 0 })
        );
        // A split's decode leg: engine 2 runs more requests but holds less KV.
        let mut pd = fleet(&[P, D, D]);
        pd[1].resident_decode = 1;
        pd[1].kv_tokens = 9000;
        pd[2].resident_decode = 3;
        pd[2].kv_tokens = 600;
        for _ in 0..20 {
            assert_eq!(
                plan_with(
                    &pd,
                    &BTreeSet::new(),
                    Aggregate::AnyRole,
                    None,
                    Measure::Tokens,
                    &mut rng
                ),
                Some(Plan::Split {
                    prefill: 0,
                    decode: 2
                })
            );
        }
    }

    #[test]
    fn kv_score_weighs_uncached_tokens_by_load() {
        let mut slots = fleet(&[D, D]);
        let mut rng = StdRng::seed_from_u64(12);
        // Engine 0 holds half the prompt but runs 3 requests: 50 × 4 = 200 > 100 × 1.
        slots[0].resident_decode = 3;
        let s = score(&[50, 100]);
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Aggregated { engine: 1 })
        );
        // Holding 90 %: 10 × 4 = 40 < 100.
        let s = score(&[10, 100]);
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Aggregated { engine: 0 })
        );
    }

    #[test]
    fn kv_balance_guard_falls_back_to_load_when_both_thresholds_are_exceeded() {
        let mut slots = fleet(&[D, D]);
        let mut rng = StdRng::seed_from_u64(13);
        let s = score(&[1, 1000]);
        // Loads 6 vs 1: differ by 5 > 4 and 6 > 1.5 × 1: imbalanced, load wins.
        slots[0].resident_decode = 6;
        slots[1].resident_decode = 1;
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Aggregated { engine: 1 })
        );
        // 20 vs 15: differ by 5 but 20 < 1.5 × 15: balanced, the cache wins.
        slots[0].resident_decode = 20;
        slots[1].resident_decode = 15;
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Aggregated { engine: 0 })
        );
        // 4 vs 0: 4 is not more than 4: balanced.
        slots[0].resident_decode = 4;
        slots[1].resident_decode = 0;
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Aggregated { engine: 0 })
        );
    }

    #[test]
    fn kv_score_places_the_prefill_and_leaves_the_decode_to_load() {
        let mut slots = fleet(&[P, P, D, D]);
        let mut rng = StdRng::seed_from_u64(14);
        slots[3].resident_decode = 2;
        // Engine 1 holds the prompt; decode 3 "holds" it too but decode ignores the cache.
        let s = score(&[100, 0, 100, 0]);
        for _ in 0..20 {
            assert_eq!(
                plan_with(
                    &slots,
                    &BTreeSet::new(),
                    Aggregate::AnyRole,
                    Some(&s),
                    Measure::Requests,
                    &mut rng
                ),
                Some(Plan::Split {
                    prefill: 1,
                    decode: 2
                })
            );
        }
        // Excluded engines are not candidates, whatever they hold.
        slots[1].excluded.insert(Exclusion::Draining);
        assert_eq!(
            plan_with(
                &slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Requests,
                &mut rng
            ),
            Some(Plan::Split {
                prefill: 0,
                decode: 2
            })
        );
    }

    #[test]
    fn approximate_credit_places_like_exact_credit_unless_discounted() {
        use crate::kv_index::{Credit, Reason, uncached};
        let mut slots = fleet(&[D, D, D]);
        let mut rng = StdRng::seed_from_u64(15);
        // A 1,000-token prompt: engine 0 is guessed to hold 960 tokens and runs 3 requests;
        // engine 1 holds 960 by its events and runs 3 too; engine 2 is idle and holds nothing.
        slots[0].resident_decode = 3;
        slots[1].resident_decode = 3;
        let credit = |reason, cached| Credit {
            reason,
            cached,
            reported: cached,
            stores: true,
            block_size: 16,
        };
        let credits = [
            credit(Reason::NoEvents, 960),
            credit(Reason::Events, 960),
            credit(Reason::NoEvents, 0),
        ];
        let pick = |share: f64, slots: &[EngineSlot], rng: &mut StdRng| {
            let s = score(&credits.map(|c| uncached(1000, &c, share)));
            plan_with(
                slots,
                &BTreeSet::new(),
                Aggregate::AnyRole,
                Some(&s),
                Measure::Requests,
                rng,
            )
        };
        // Counted whole, the guess ties the exact credit: 40 × 4 = 160 < 1,000 × 1.
        let mut seen = BTreeSet::new();
        for _ in 0..50 {
            match pick(1.0, &slots, &mut rng) {
                Some(Plan::Aggregated { engine }) => seen.insert(engine),
                other => panic!("{other:?}"),
            };
        }
        assert_eq!(
            seen,
            [0, 1].into(),
            "a tie between the guess and the events"
        );
        // Discounted, the exact engine wins the tie…
        assert_eq!(
            pick(0.9, &slots, &mut rng),
            Some(Plan::Aggregated { engine: 1 })
        );
        // …and a half-counted guess loses to load: 520 × 4 = 2,080 > 1,000.
        slots[1].excluded.insert(Exclusion::Draining);
        assert_eq!(
            pick(0.5, &slots, &mut rng),
            Some(Plan::Aggregated { engine: 2 })
        );
        // A drained engine gets no credit, whatever it holds.
        assert_eq!(
            pick(1.0, &slots, &mut rng),
            Some(Plan::Aggregated { engine: 0 })
        );
    }

    proptest::proptest! {
        #[test]
        fn plan_returns_live_engines_and_honours_avoid_when_possible(
            roles in proptest::collection::vec(proptest::bool::ANY, 1..8),
            dead in proptest::collection::vec(proptest::bool::ANY, 8),
            avoid_bits in proptest::collection::vec(proptest::bool::ANY, 8),
            load in proptest::collection::vec(0u32..5, 8),
            seed in 0u64..1000,
        ) {
            let mut slots: Vec<EngineSlot> = roles.iter().map(|p| EngineSlot::new(if *p { P } else { D })).collect();
            for (i, s) in slots.iter_mut().enumerate() {
                if dead[i] { s.excluded.insert(Exclusion::Ejected); }
                s.resident_decode = load[i];
            }
            let avoid: BTreeSet<usize> = (0..slots.len()).filter(|i| avoid_bits[*i]).collect();
            let mut rng = StdRng::seed_from_u64(seed);
            // Chosen engines are live; an avoided one is chosen only if its role had no other.
            let ok = |i: usize, role: Option<Role>| {
                slots[i].is_live()
                    && (!avoid.contains(&i)
                        || (0..slots.len()).all(|j| !slots[j].is_live() || avoid.contains(&j) || role.is_some_and(|r| slots[j].role != r)))
            };
            match plan(&slots, &avoid, &mut rng) {
                Some(Plan::Split { prefill, decode }) => {
                    proptest::prop_assert!(ok(prefill, Some(P)) && ok(decode, Some(D)));
                    proptest::prop_assert_eq!(slots[prefill].role, P);
                    proptest::prop_assert_eq!(slots[decode].role, D);
                }
                Some(Plan::Aggregated { engine }) => proptest::prop_assert!(ok(engine, None)),
                None => proptest::prop_assert!((0..slots.len()).all(|i| !slots[i].is_live())),
            }
        }
    }
}
