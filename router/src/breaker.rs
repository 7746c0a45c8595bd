//! Per-engine breaker: failure classes, streaks, ejection and readmission probes
//! (reference-notes 6.2–6.4; DESIGN.md section 5).
//!
//! ```text
//!  leg outcome / health answer ──observe(iid, Observation, now)──► Vec<Transition>
//!  monitor tick ──due_probes(now)──► [(iid, ProbeKind)]   (driver GETs /health, feeds back)
//! ```
//!
//! Pure: `now` is passed in, nothing here sleeps or does IO. The verdicts:
//! at `recovery.eject_after` consecutive failures of one class, `connection`,
//! `inference_status`, `kv_handoff` and `stream` eject the engine at once (cause = class name);
//! `timeout` and `overload` request a health probe, which ejects (cause `health_probe`) if it
//! fails. Client-fault answers (engine 4xx other than 408/429) never count. An ejected engine is
//! probed every `probe_interval`; a 200 readmits it (evidence `health`) and clears its streaks
//! (an engine with an agent returns through lifecycle validation instead:
//! [`Observation::Verified`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Leg failure classes (reference-notes 6.2), in the order `/narwhal/state` lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailureClass {
    /// Connect error or connection reset before an answer.
    Connection,
    /// A timeout other than a decode read timeout.
    Timeout,
    /// HTTP 408 or 429 from the engine.
    Overload,
    /// Any other engine error status (including in-stream error frames).
    InferenceStatus,
    /// A 200 prefill answer without a usable KV descriptor / rendezvous.
    KvHandoff,
    /// Decode stream problems: first-token or gap timeout, end without `[DONE]`, `[DONE]`
    /// before any token.
    Stream,
}

impl FailureClass {
    /// All classes, state order.
    pub const ALL: [FailureClass; 6] = [
        FailureClass::Connection,
        FailureClass::Timeout,
        FailureClass::Overload,
        FailureClass::InferenceStatus,
        FailureClass::KvHandoff,
        FailureClass::Stream,
    ];

    /// The reference's name.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureClass::Connection => "connection",
            FailureClass::Timeout => "timeout",
            FailureClass::Overload => "overload",
            FailureClass::InferenceStatus => "inference_status",
            FailureClass::KvHandoff => "kv_handoff",
            FailureClass::Stream => "stream",
        }
    }

    fn idx(self) -> usize {
        self as usize
    }
}

/// What the driver observed about one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// A leg on the engine failed with this class.
    LegFailed(FailureClass),
    /// The engine answered a leg with a client-fault 4xx: transport evidence only.
    ClientFault,
    /// A prefill leg succeeded (clears `connection`, `inference_status`, `kv_handoff`).
    PrefillOk,
    /// A decode leg succeeded (clears `connection`, `inference_status`, `stream`).
    DecodeOk,
    /// `/health` answered 200.
    HealthOk,
    /// `/health` failed (non-200, connect error, timeout).
    HealthFailed,
    /// Readmission validation passed through the agents (lifecycle or recovery evidence):
    /// clears `connection`, `inference_status`, `kv_handoff`, `stream` and un-ejects.
    Verified,
}

/// Why an engine was ejected (`narwhal_engine_ejections_total{cause}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EjectCause {
    /// Streak of a class that ejects directly.
    Class(FailureClass),
    /// A health probe requested by a timeout/overload streak failed.
    HealthProbe,
    /// The engine's process changed behind the router's back (found during validation).
    ProcessIdentity,
    /// Ejected by the router whose handoff this router applied (`--resume`, takeover).
    Restored,
    /// An engine-side role switch failed (controller-notes 9.2).
    RoleSwitch,
}

impl EjectCause {
    /// Label value: the class name or `health_probe`.
    pub fn as_str(self) -> &'static str {
        match self {
            EjectCause::Class(c) => c.as_str(),
            EjectCause::HealthProbe => "health_probe",
            EjectCause::ProcessIdentity => "process_identity",
            EjectCause::Restored => "handoff",
            EjectCause::RoleSwitch => "role_switch",
        }
    }
}

/// A state change the driver must apply (exclusion set, metrics, journal event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Put the engine out of placement.
    Ejected {
        /// Engine index.
        iid: usize,
        /// Cause label.
        cause: EjectCause,
    },
    /// Probe the engine's `/health` soon (timeout/overload streak).
    ProbeRequested {
        /// Engine index.
        iid: usize,
    },
    /// Return the engine to placement.
    Readmitted {
        /// Engine index.
        iid: usize,
        /// `health` (a probe answered) or `lifecycle` (validation passed).
        evidence: &'static str,
    },
}

/// What a due probe is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeKind {
    /// Readmission probe of an ejected engine.
    Readmission,
    /// Verification probe after a timeout/overload streak.
    Verification,
}

#[derive(Debug, Clone, Default)]
struct EngineState {
    streaks: [u32; 6],
    ejected_at: Option<Instant>,
    last_probe: Option<Instant>,
    probe_pending: bool,
    probe_in_flight: bool,
}

/// Breaker for every engine of the fleet (indexed like the fleet config).
#[derive(Debug, Clone)]
pub struct Breaker {
    eject_after: u32,
    probe_interval: Duration,
    engines: Vec<EngineState>,
    ejections: BTreeMap<(usize, EjectCause), u64>,
    readmissions: BTreeMap<usize, u64>,
}

impl Breaker {
    /// A breaker for `engines` engines; `eject_after` = `recovery.eject_after`,
    /// `probe_interval` = `readmit_every × controller.monitor_interval_s`.
    pub fn new(engines: usize, eject_after: u32, probe_interval: Duration) -> Self {
        Breaker {
            eject_after: eject_after.max(1),
            probe_interval,
            engines: vec![EngineState::default(); engines],
            ejections: BTreeMap::new(),
            readmissions: BTreeMap::new(),
        }
    }

    /// Is the engine ejected?
    pub fn is_ejected(&self, iid: usize) -> bool {
        self.engines[iid].ejected_at.is_some()
    }

    /// Current consecutive-failure count of `class` on the engine.
    pub fn streak(&self, iid: usize, class: FailureClass) -> u32 {
        self.engines[iid].streaks[class.idx()]
    }

    /// Ejections so far by (engine, cause).
    pub fn ejections(&self) -> &BTreeMap<(usize, EjectCause), u64> {
        &self.ejections
    }

    /// Readmissions so far by engine.
    pub fn readmissions(&self) -> &BTreeMap<usize, u64> {
        &self.readmissions
    }

    /// Feed one observation; returns the transitions it caused.
    pub fn observe(&mut self, iid: usize, obs: Observation, now: Instant) -> Vec<Transition> {
        let eject_after = self.eject_after;
        let mut out = Vec::new();
        let e = &mut self.engines[iid];
        let clear = |e: &mut EngineState, classes: &[FailureClass]| {
            for c in classes {
                e.streaks[c.idx()] = 0;
            }
        };
        match obs {
            Observation::LegFailed(class) => {
                if e.ejected_at.is_some() {
                    return out;
                }
                e.streaks[class.idx()] += 1;
                if e.streaks[class.idx()] >= eject_after {
                    match class {
                        FailureClass::Timeout | FailureClass::Overload => {
                            if !e.probe_pending {
                                e.probe_pending = true;
                                out.push(Transition::ProbeRequested { iid });
                            }
                        }
                        _ => {
                            self.eject(iid, EjectCause::Class(class), now, &mut out);
                        }
                    }
                }
            }
            Observation::ClientFault => {
                clear(
                    e,
                    &[FailureClass::Connection, FailureClass::InferenceStatus],
                );
            }
            Observation::PrefillOk => clear(
                e,
                &[
                    FailureClass::Connection,
                    FailureClass::InferenceStatus,
                    FailureClass::KvHandoff,
                ],
            ),
            Observation::DecodeOk => clear(
                e,
                &[
                    FailureClass::Connection,
                    FailureClass::InferenceStatus,
                    FailureClass::Stream,
                ],
            ),
            Observation::HealthOk => {
                e.probe_in_flight = false;
                clear(
                    e,
                    &[
                        FailureClass::Connection,
                        FailureClass::Timeout,
                        FailureClass::Overload,
                    ],
                );
                e.probe_pending = false;
                if e.ejected_at.is_some() {
                    e.ejected_at = None;
                    e.streaks = [0; 6];
                    *self.readmissions.entry(iid).or_default() += 1;
                    out.push(Transition::Readmitted {
                        iid,
                        evidence: "health",
                    });
                }
            }
            Observation::Verified => {
                e.probe_in_flight = false;
                e.probe_pending = false;
                clear(
                    e,
                    &[
                        FailureClass::Connection,
                        FailureClass::InferenceStatus,
                        FailureClass::KvHandoff,
                        FailureClass::Stream,
                    ],
                );
                if e.ejected_at.is_some() {
                    e.ejected_at = None;
                    *self.readmissions.entry(iid).or_default() += 1;
                    out.push(Transition::Readmitted {
                        iid,
                        evidence: "lifecycle",
                    });
                }
            }
            Observation::HealthFailed => {
                e.probe_in_flight = false;
                if e.ejected_at.is_none() && e.probe_pending {
                    e.probe_pending = false;
                    self.eject(iid, EjectCause::HealthProbe, now, &mut out);
                }
            }
        }
        out
    }

    fn eject(&mut self, iid: usize, cause: EjectCause, now: Instant, out: &mut Vec<Transition>) {
        let e = &mut self.engines[iid];
        e.ejected_at = Some(now);
        // First readmission probe one interval after ejection.
        e.last_probe = Some(now);
        e.probe_pending = false;
        *self.ejections.entry((iid, cause)).or_default() += 1;
        out.push(Transition::Ejected { iid, cause });
    }

    /// Probes the monitor should run now: ejected engines whose last probe is at least one
    /// interval old, and pending verification probes. Marks them in flight; the driver must feed
    /// back `HealthOk`/`HealthFailed` for each.
    pub fn due_probes(&mut self, now: Instant) -> Vec<(usize, ProbeKind)> {
        let mut out = Vec::new();
        for (iid, e) in self.engines.iter_mut().enumerate() {
            if e.probe_in_flight {
                continue;
            }
            if e.ejected_at.is_some() {
                let due = e
                    .last_probe
                    .is_none_or(|t| now.saturating_duration_since(t) >= self.probe_interval);
                if due {
                    e.last_probe = Some(now);
                    e.probe_in_flight = true;
                    out.push((iid, ProbeKind::Readmission));
                }
            } else if e.probe_pending {
                e.probe_in_flight = true;
                out.push((iid, ProbeKind::Verification));
            }
        }
        out
    }

    /// Ejects the engine now for `cause` unless it already is (validation found its process
    /// changed).
    pub fn eject_now(&mut self, iid: usize, cause: EjectCause, now: Instant) -> Vec<Transition> {
        let mut out = Vec::new();
        if self.engines[iid].ejected_at.is_none() {
            self.eject(iid, cause, now, &mut out);
        }
        out
    }

    /// Forget an in-flight mark without a verdict (the probe was inconclusive).
    pub fn probe_inconclusive(&mut self, iid: usize) {
        self.engines[iid].probe_in_flight = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, SystemClock};

    fn b() -> (Breaker, Instant) {
        (
            Breaker::new(2, 3, Duration::from_secs(10)),
            SystemClock.now(),
        )
    }

    const CONN: Observation = Observation::LegFailed(FailureClass::Connection);

    #[test]
    fn connection_streak_ejects_at_threshold() {
        let (mut br, t0) = b();
        assert!(br.observe(0, CONN, t0).is_empty());
        assert!(br.observe(0, CONN, t0).is_empty());
        assert_eq!(
            br.observe(0, CONN, t0),
            vec![Transition::Ejected {
                iid: 0,
                cause: EjectCause::Class(FailureClass::Connection)
            }]
        );
        assert!(br.is_ejected(0));
        assert!(!br.is_ejected(1));
        // Further failures of an ejected engine change nothing.
        assert!(br.observe(0, CONN, t0).is_empty());
        assert_eq!(
            br.ejections()
                .get(&(0, EjectCause::Class(FailureClass::Connection))),
            Some(&1)
        );
    }

    #[test]
    fn success_evidence_breaks_the_streak() {
        let (mut br, t0) = b();
        br.observe(0, CONN, t0);
        br.observe(0, CONN, t0);
        br.observe(0, Observation::PrefillOk, t0);
        assert_eq!(br.streak(0, FailureClass::Connection), 0);
        assert!(br.observe(0, CONN, t0).is_empty());
        assert!(!br.is_ejected(0));
    }

    #[test]
    fn decode_success_does_not_clear_kv_handoff() {
        let (mut br, t0) = b();
        let kv = Observation::LegFailed(FailureClass::KvHandoff);
        br.observe(0, kv, t0);
        br.observe(0, kv, t0);
        br.observe(0, Observation::DecodeOk, t0);
        assert_eq!(br.streak(0, FailureClass::KvHandoff), 2);
        assert_eq!(br.observe(0, kv, t0).len(), 1);
    }

    #[test]
    fn client_faults_never_count() {
        let (mut br, t0) = b();
        for _ in 0..10 {
            assert!(br.observe(0, Observation::ClientFault, t0).is_empty());
        }
        assert!(!br.is_ejected(0));
    }

    #[test]
    fn timeout_streak_requests_a_probe_that_ejects_on_failure() {
        let (mut br, t0) = b();
        let to = Observation::LegFailed(FailureClass::Timeout);
        br.observe(1, to, t0);
        br.observe(1, to, t0);
        assert_eq!(
            br.observe(1, to, t0),
            vec![Transition::ProbeRequested { iid: 1 }]
        );
        assert!(!br.is_ejected(1));
        assert_eq!(br.due_probes(t0), vec![(1, ProbeKind::Verification)]);
        // In flight: not handed out twice.
        assert!(br.due_probes(t0).is_empty());
        assert_eq!(
            br.observe(1, Observation::HealthFailed, t0),
            vec![Transition::Ejected {
                iid: 1,
                cause: EjectCause::HealthProbe
            }]
        );
    }

    #[test]
    fn overload_probe_that_passes_clears_the_streak() {
        let (mut br, t0) = b();
        let ov = Observation::LegFailed(FailureClass::Overload);
        for _ in 0..3 {
            br.observe(0, ov, t0);
        }
        assert_eq!(br.due_probes(t0), vec![(0, ProbeKind::Verification)]);
        assert!(br.observe(0, Observation::HealthOk, t0).is_empty());
        assert_eq!(br.streak(0, FailureClass::Overload), 0);
        assert!(br.due_probes(t0).is_empty());
    }

    #[test]
    fn ejected_engine_is_probed_every_interval_and_readmitted_on_200() {
        let (mut br, t0) = b();
        for _ in 0..3 {
            br.observe(0, Observation::LegFailed(FailureClass::Stream), t0);
        }
        assert!(br.is_ejected(0));
        assert!(br.due_probes(t0 + Duration::from_secs(9)).is_empty());
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(br.due_probes(t1), vec![(0, ProbeKind::Readmission)]);
        assert!(br.observe(0, Observation::HealthFailed, t1).is_empty());
        assert!(br.is_ejected(0));
        assert!(br.due_probes(t1 + Duration::from_secs(5)).is_empty());
        let t2 = t1 + Duration::from_secs(10);
        assert_eq!(br.due_probes(t2), vec![(0, ProbeKind::Readmission)]);
        assert_eq!(
            br.observe(0, Observation::HealthOk, t2),
            vec![Transition::Readmitted {
                iid: 0,
                evidence: "health"
            }]
        );
        assert!(!br.is_ejected(0));
        assert_eq!(br.streak(0, FailureClass::Stream), 0);
        assert_eq!(br.readmissions().get(&0), Some(&1));
    }

    proptest::proptest! {
        /// Below the threshold nothing is ejected, whatever the interleaving of classes.
        #[test]
        fn no_ejection_without_a_full_streak(seq in proptest::collection::vec(0usize..6, 0..40)) {
            let mut br = Breaker::new(1, 1000, Duration::from_secs(1));
            let t0 = SystemClock.now();
            for c in seq {
                let tr = br.observe(0, Observation::LegFailed(FailureClass::ALL[c]), t0);
                proptest::prop_assert!(tr.is_empty());
            }
            proptest::prop_assert!(!br.is_ejected(0));
        }
    }
}
