//! The consolidation evidence gate (controller.md 8; behaviour.md 9): a decode→prefill
//! move needs a closed window of fresh arrival evidence after the newest risk event, and no
//! rising decode demand.
//!
//! ```text
//!  (count, oldest) of sized arrivals after max(now − max_span, risk_since)
//!    closed = span ≥ evidence_span ∧ count ≥ min_arrivals ∨ risk older than max_span
//!  not closed ─► gate risk (a risk was recorded) | evidence
//!  closed ─► gate trend when short-horizon decode demand > long·(1 + τ), else none
//! ```
//!
//! Pure.

use std::collections::BTreeMap;
use std::time::Instant;

/// Which gate blocks consolidation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Nothing: consolidation may proceed.
    None,
    /// A risk event re-armed the window, which has not closed since.
    Risk,
    /// The window has not closed yet.
    Evidence,
    /// Decode demand is rising.
    Trend,
}

impl Gate {
    /// `none`, `risk`, `evidence` or `trend`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Gate::None => "none",
            Gate::Risk => "risk",
            Gate::Evidence => "evidence",
            Gate::Trend => "trend",
        }
    }
}

/// The settings the gate reads (`controller.reactive`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// `evidence_span_s`.
    pub(crate) span_s: f64,
    /// `evidence_max_span_s`.
    pub(crate) max_span_s: f64,
    /// `evidence_min_arrivals`.
    pub(crate) min_arrivals: u64,
    /// `demand_rise_tolerance` τ.
    pub(crate) tolerance: f64,
}

/// What the gate saw (controller.md 13 `demand_evidence`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Evidence {
    /// Seconds of evidence counted.
    pub(crate) span_s: f64,
    /// Arrivals counted.
    pub(crate) arrivals: u64,
    /// `evidence_span_s`.
    pub(crate) required_span_s: f64,
    /// `evidence_min_arrivals`.
    pub(crate) required_arrivals: u64,
    /// `evidence_max_span_s`.
    pub(crate) max_span_s: f64,
    /// The window closed.
    pub(crate) closed: bool,
    /// The newest risk event's kind.
    pub(crate) risk_kind: Option<String>,
    /// Its age, seconds.
    pub(crate) risk_age_s: Option<f64>,
    /// Risk events per kind.
    pub(crate) risk_events: BTreeMap<String, u64>,
    /// Decode demand over `evidence_span_s`, engines.
    pub(crate) short_decode: f64,
    /// Decode demand over the window, engines.
    pub(crate) long_decode: f64,
    /// `short/long` when long > 0.
    pub(crate) trend_ratio: Option<f64>,
    /// `max(short, long)`: the decode demand a consolidation is priced with.
    pub(crate) envelope_decode: f64,
    /// The blocking gate.
    pub(crate) gate: Gate,
}

/// The inputs of one capture.
#[derive(Debug, Clone)]
pub(crate) struct Capture<'a> {
    /// The newest risk event: kind and time.
    pub(crate) risk: Option<(&'a str, Instant)>,
    /// Risk events per kind.
    pub(crate) risk_events: BTreeMap<String, u64>,
    /// `(count, oldest)` of sized arrivals after the cutoff the caller got from
    /// [`cutoff`].
    pub(crate) counted: (u64, Option<Instant>),
    /// Sized arrivals within the last `evidence_span_s`.
    pub(crate) recent_arrivals: u64,
    /// Decode demand over `evidence_span_s`, engines.
    pub(crate) short_decode: f64,
    /// Decode demand over the window (`last_demand`), engines.
    pub(crate) long_decode: f64,
}

/// The evidence cutoff: `max(now − evidence_max_span_s, risk_since)`.
pub(crate) fn cutoff(now: Instant, s: &Settings, risk_since: Option<Instant>) -> Instant {
    let horizon = now
        .checked_sub(std::time::Duration::from_secs_f64(s.max_span_s))
        .unwrap_or(now);
    match risk_since {
        Some(r) => horizon.max(r),
        None => horizon,
    }
}

/// Captures the gate at `now` (controller.md 8).
pub(crate) fn capture(now: Instant, s: &Settings, c: Capture<'_>) -> Evidence {
    let (count, oldest) = c.counted;
    let span = oldest.map_or(0.0, |o| now.saturating_duration_since(o).as_secs_f64());
    let risk_age = c
        .risk
        .map(|(_, at)| now.saturating_duration_since(at).as_secs_f64());
    let closed = (span >= s.span_s && count >= s.min_arrivals)
        || span >= s.max_span_s
        || risk_age.is_some_and(|a| a >= s.max_span_s);
    let (short, long) = (c.short_decode, c.long_decode);
    let rising = if long > 0.0 {
        short > long * (1.0 + s.tolerance)
    } else {
        short > 0.0
    };
    let gate = if !closed {
        if c.risk.is_some() {
            Gate::Risk
        } else {
            Gate::Evidence
        }
    } else if c.recent_arrivals >= s.min_arrivals && rising {
        Gate::Trend
    } else {
        Gate::None
    };
    Evidence {
        span_s: span,
        arrivals: count,
        required_span_s: s.span_s,
        required_arrivals: s.min_arrivals,
        max_span_s: s.max_span_s,
        closed,
        risk_kind: c.risk.map(|(k, _)| k.to_string()),
        risk_age_s: risk_age,
        risk_events: c.risk_events,
        short_decode: short,
        long_decode: long,
        trend_ratio: (long > 0.0).then(|| short / long),
        envelope_decode: short.max(long),
        gate,
    }
}

impl Evidence {
    /// Consolidation may proceed.
    pub(crate) fn allowed(&self) -> bool {
        self.gate == Gate::None
    }

    /// The hold reason of the blocking gate (controller.md 8), `None` when open.
    pub(crate) fn reason(&self) -> Option<String> {
        match self.gate {
            Gate::None => None,
            Gate::Evidence => Some("demand evidence is still collecting".into()),
            Gate::Trend => Some("rising decode demand blocks consolidation".into()),
            Gate::Risk => Some(format!(
                "{} {:.1} s ago: re-collecting one evidence window",
                self.risk_kind
                    .as_deref()
                    .unwrap_or("risk")
                    .replace('_', " "),
                self.risk_age_s.unwrap_or(0.0)
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, SystemClock};
    use std::time::Duration;

    const S: Settings = Settings {
        span_s: 60.0,
        max_span_s: 120.0,
        min_arrivals: 10,
        tolerance: 0.25,
    };

    fn cap(counted: (u64, Option<Instant>)) -> Capture<'static> {
        Capture {
            risk: None,
            risk_events: BTreeMap::new(),
            counted,
            recent_arrivals: 0,
            short_decode: 0.0,
            long_decode: 0.0,
        }
    }

    #[test]
    fn the_window_closes_with_span_and_arrivals() {
        let t0 = SystemClock.now() + Duration::from_secs(1000);
        let e = capture(t0, &S, cap((100, Some(t0 - Duration::from_secs(59)))));
        assert_eq!((e.closed, e.gate), (false, Gate::Evidence));
        assert_eq!(
            e.reason().as_deref(),
            Some("demand evidence is still collecting")
        );
        let e = capture(t0, &S, cap((9, Some(t0 - Duration::from_secs(61)))));
        assert!(!e.closed, "too few arrivals");
        let e = capture(t0, &S, cap((10, Some(t0 - Duration::from_secs(60)))));
        assert!(e.closed && e.allowed());
    }

    /// A risk re-arms the window; its reason names the kind and the age to one decimal.
    #[test]
    fn a_risk_event_blocks_until_a_new_window_closes_or_it_ages_out() {
        let t0 = SystemClock.now() + Duration::from_secs(1000);
        let at = t0 - Duration::from_secs(5);
        assert_eq!(cutoff(t0, &S, Some(at)), at);
        let mut c = cap((3, Some(at + Duration::from_secs(1))));
        c.risk = Some(("first_token_timeout", at));
        let e = capture(t0, &S, c.clone());
        assert_eq!(e.gate, Gate::Risk);
        assert_eq!(
            e.reason().as_deref(),
            Some("first token timeout 5.0 s ago: re-collecting one evidence window")
        );
        let e = capture(at + Duration::from_secs(120), &S, c);
        assert!(e.closed, "the risk aged past evidence_max_span_s");
    }

    #[test]
    fn rising_short_demand_is_the_trend_gate() {
        let t0 = SystemClock.now() + Duration::from_secs(1000);
        let mut c = cap((20, Some(t0 - Duration::from_secs(70))));
        c.recent_arrivals = 10;
        c.long_decode = 1.0;
        c.short_decode = 1.3;
        let e = capture(t0, &S, c.clone());
        assert_eq!(e.gate, Gate::Trend);
        assert_eq!(e.trend_ratio, Some(1.3));
        assert_eq!(e.envelope_decode, 1.3);
        c.short_decode = 1.2;
        assert!(capture(t0, &S, c.clone()).allowed(), "within the tolerance");
        c.short_decode = 2.0;
        c.recent_arrivals = 9;
        assert!(
            capture(t0, &S, c).allowed(),
            "too few recent arrivals to judge"
        );
    }
}
