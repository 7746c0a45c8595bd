//! Demand: the arrival windows and the demand model the role controller prices
//! (`window`, `model`; controller.md 3.2–4.1), and the newest consolidation-risk event the
//! handoff carries as `demand_risk` (behaviour.md 9; controller.md section 8), with
//! per-kind counts.
//!
//! ```text
//!  serve: a decode leg missed its first-token deadline ──record("first_token_timeout", now)──►
//!  controller: a move to decode ──record("p_to_d_recovery", now)──►
//!  handoff snapshot ◄──snapshot(now)── Demand ◄──restore_once(doc, gap)── handoff apply
//!  controller evidence gate ◄──risk()── Demand
//! ```
//!
//! [`Demand`] is pure (the monotonic `now` is passed in); [`DemandRisk`] is the router's shared
//! handle to it.

pub(crate) mod model;
pub(crate) mod window;

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use narwhal_shared::handoff::DemandRisk as Carried;

/// The newest consolidation-risk event: kind, monotonic time, per-kind counts.
#[derive(Debug, Clone, Default)]
pub(crate) struct Demand {
    since: Option<Instant>,
    kind: String,
    events: BTreeMap<String, u64>,
    /// The document (`run`, bits of `at`) whose risk was last applied, so applying the same
    /// document twice (`--resume` at startup, then again when a delayed claim succeeds) does
    /// not add its counts twice.
    applied: Option<(String, u64)>,
    /// The last carried risk this router re-anchored: its kind, the age it was given here
    /// (seconds) and when.
    restored: Option<(String, f64, Instant)>,
    /// Counts per kind carried by the newest document applied (replaced, never summed, by a
    /// later one: each document already holds what its writer carried); `events` holds only
    /// the events this process recorded itself.
    carried: BTreeMap<String, u64>,
}

impl Demand {
    /// Records an event of `kind` at `now`: `first_token_timeout` (a decode leg missed its
    /// first-token deadline) or `p_to_d_recovery` (a prefill→decode role move: a reactive
    /// move to decode or a decode-floor restoration).
    pub(crate) fn record(&mut self, kind: &str, now: Instant) {
        if self.since.is_none_or(|s| now >= s) {
            self.since = Some(now);
            self.kind = kind.to_string();
        }
        *self.events.entry(kind.to_string()).or_default() += 1;
    }

    /// [`Demand::restore`] of the risk carried by the document written by `run` at `at`,
    /// unless that very document was already applied (found by ha_e2e: a primary restarted
    /// with `--resume` inside its lease TTL applied its state file at startup and again at its
    /// claim, doubling the counts). Re-anchoring it again would give the same time anyway.
    pub(crate) fn restore_once(
        &mut self,
        run: &str,
        at: f64,
        risk: &Carried,
        gap_s: f64,
        now: Instant,
    ) {
        let id = (run.to_string(), at.to_bits());
        if self.applied.as_ref() == Some(&id) {
            return;
        }
        self.applied = Some(id);
        self.restore(risk, gap_s, now);
    }

    /// The newest event: its kind and monotonic time (`None` before any event).
    pub(crate) fn risk(&self) -> Option<(&str, Instant)> {
        self.since.map(|s| (self.kind.as_str(), s))
    }

    /// The last carried risk re-anchored here (`--resume`, a standby's takeover): its kind,
    /// the age it was given on this router's clock (seconds), and when it was applied.
    pub(crate) fn restored(&self) -> Option<(&str, f64, Instant)> {
        self.restored
            .as_ref()
            .map(|(k, a, at)| (k.as_str(), *a, *at))
    }

    /// Events seen per kind, this process's and the newest applied document's (both kinds
    /// present, 0 until seen).
    pub(crate) fn events(&self) -> BTreeMap<String, u64> {
        let mut e: BTreeMap<String, u64> = ["first_token_timeout", "p_to_d_recovery"]
            .iter()
            .map(|k| ((*k).to_string(), 0))
            .collect();
        for (k, n) in self.counts() {
            *e.entry(k).or_default() += n;
        }
        e
    }

    /// Counts per kind: this process's own events plus those of the newest applied document.
    fn counts(&self) -> BTreeMap<String, u64> {
        let mut c = self.carried.clone();
        for (k, n) in &self.events {
            *c.entry(k.clone()).or_default() += n;
        }
        c
    }

    /// The handoff shape: `null` before any event (behaviour.md 9).
    pub(crate) fn snapshot(&self, now: Instant) -> Option<Carried> {
        let since = self.since?;
        Some(Carried {
            kind: self.kind.clone(),
            age_s: now.saturating_duration_since(since).as_secs_f64(),
            events: self.counts().into_iter().filter(|(_, n)| *n > 0).collect(),
        })
    }

    /// Applies a carried risk: the age is re-anchored to this process's clock, `gap_s`
    /// (seconds between the document's write, its `at`, and this apply, wall clock, clamped at
    /// 0) is added once, so the event keeps ageing through a takeover or a restart instead of
    /// looking `gap_s` younger (behaviour.md 11.14: the reference drops the gap), and the
    /// counts are added to this process's own (behaviour.md 9). The counts of an earlier
    /// applied document are replaced, not added to: found by ha_e2e under load, a primary
    /// restarted with `--resume` applied its state file at startup and, at its delayed claim,
    /// the newer handoff its predecessor had published, whose counts already held the state
    /// file's, and reported them doubled.
    pub(crate) fn restore(&mut self, risk: &Carried, gap_s: f64, now: Instant) {
        let age = risk.age_s.max(0.0)
            + if gap_s.is_finite() {
                gap_s.max(0.0)
            } else {
                0.0
            };
        let since = Duration::try_from_secs_f64(age)
            .ok()
            .and_then(|a| now.checked_sub(a))
            .unwrap_or(now);
        self.restored = Some((risk.kind.clone(), age, now));
        if self.since.is_none_or(|s| since >= s) {
            self.since = Some(since);
            self.kind = risk.kind.clone();
        }
        self.carried = risk.events.clone();
    }
}

/// The router's demand-risk tracker, shared by the request path (which records events) and
/// the handoff (which snapshots and restores it).
#[derive(Debug, Default)]
pub(crate) struct DemandRisk(Mutex<Demand>);

impl DemandRisk {
    /// The tracker, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Demand> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, SystemClock};

    #[test]
    fn demand_risk_is_null_until_an_event_and_reanchors_on_restore() {
        let t0 = SystemClock.now();
        let mut d = Demand::default();
        assert!(d.snapshot(t0).is_none());
        d.record("first_token_timeout", t0);
        d.record("first_token_timeout", t0 + Duration::from_secs(2));
        let snap = d.snapshot(t0 + Duration::from_secs(5)).expect("risk");
        assert_eq!(snap.kind, "first_token_timeout");
        assert!((snap.age_s - 3.0).abs() < 1e-9);
        assert_eq!(snap.events["first_token_timeout"], 2);
        // A receiving router re-anchors the age to its own clock.
        let t1 = t0 + Duration::from_secs(100);
        let mut other = Demand::default();
        other.restore(&snap, 0.0, t1);
        let again = other.snapshot(t1 + Duration::from_secs(1)).expect("risk");
        assert!((again.age_s - 4.0).abs() < 1e-9, "{}", again.age_s);
        assert_eq!(again.events["first_token_timeout"], 2);
    }

    #[test]
    fn the_same_document_is_applied_once() {
        let t1 = SystemClock.now() + Duration::from_secs(1000);
        let carried = Carried {
            kind: "first_token_timeout".into(),
            age_s: 1.0,
            events: BTreeMap::from([("first_token_timeout".to_string(), 1)]),
        };
        let mut d = Demand::default();
        d.restore_once("1-aa", 500.0, &carried, 0.5, t1);
        d.restore_once("1-aa", 500.0, &carried, 2.5, t1 + Duration::from_secs(2));
        let snap = d.snapshot(t1 + Duration::from_secs(2)).expect("risk");
        assert_eq!(snap.events["first_token_timeout"], 1, "not doubled");
        assert!((snap.age_s - 3.5).abs() < 1e-9, "{}", snap.age_s);
        // A later document of the predecessor holds the earlier one's counts: it replaces
        // them, and this process's own events are added once.
        d.record("first_token_timeout", t1 + Duration::from_secs(2));
        let later = Carried {
            events: BTreeMap::from([("first_token_timeout".to_string(), 3)]),
            ..carried.clone()
        };
        d.restore_once("1-aa", 501.0, &later, 0.0, t1 + Duration::from_secs(2));
        let snap = d.snapshot(t1 + Duration::from_secs(2)).expect("risk");
        assert_eq!(snap.events["first_token_timeout"], 4, "3 carried + 1 own");
        d.restore_once("1-aa", 502.0, &later, 0.0, t1 + Duration::from_secs(3));
        let snap = d.snapshot(t1 + Duration::from_secs(3)).expect("risk");
        assert_eq!(
            snap.events["first_token_timeout"], 4,
            "not doubled by a newer write"
        );
    }

    /// Found by ha_e2e: a standby retained a document 10 ms after the event and took over 2 s
    /// later; the new primary reported the risk as 10 ms old. The write→apply gap counts once.
    #[test]
    fn restored_demand_risk_keeps_ageing_through_the_gap() {
        let t1 = SystemClock.now() + Duration::from_secs(1000);
        let carried = Carried {
            kind: "first_token_timeout".into(),
            age_s: 0.01,
            events: BTreeMap::from([("first_token_timeout".to_string(), 1)]),
        };
        let mut d = Demand::default();
        d.restore(&carried, 2.0, t1);
        let snap = d.snapshot(t1 + Duration::from_millis(500)).expect("risk");
        assert!((snap.age_s - 2.51).abs() < 1e-9, "{}", snap.age_s);
        assert_eq!(snap.events["first_token_timeout"], 1);
        // A writer clock ahead of ours (negative gap) or a nonsense gap adds nothing.
        for gap in [-5.0, f64::NAN, f64::INFINITY] {
            let mut d = Demand::default();
            d.restore(&carried, gap, t1);
            let snap = d.snapshot(t1).expect("risk");
            assert!((snap.age_s - 0.01).abs() < 1e-9, "{gap}: {}", snap.age_s);
        }
    }
}
