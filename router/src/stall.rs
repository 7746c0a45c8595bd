//! Stalled engines (behaviour.md 6.9): an engine admitted healthy that stops answering its
//! legs while its `/health` stays 200 (a wedged GPU worker behind a live API server). Sans IO:
//! the clock is passed in; the fleet holds the watch, the monitor drives the probes.
//!
//! ```text
//!  leg dispatched ──begin(engine, now)──► pending[token] = now
//!  first output (or any answer) ──output(engine, token, now)──► last_output = now
//!  leg ended without one ──abandon(engine, token)
//!  monitor tick ──suspects(now, group)──► engines to probe (state Probing)
//!       an engine is suspect when
//!         its oldest waiting leg is at least a window old (`engine.first_token_timeout_s`),
//!         it gave no leg any output for a window, and
//!         another engine of its group (its role) gave a leg output after that oldest leg
//!         was dispatched
//!  probe (one token, straight to the engine, within the window)
//!       ──probe_passed(engine, now)──► Watching (counts as output: not suspect for a window)
//!       ──probe_failed(engine)──────► Watching; the driver ejects it (cause `stalled`) and
//!                                     fails its waiting legs over
//! ```
//!
//! Why peers and a probe, not a shorter timeout: a split's decode leg waits
//! `first_token_timeout_s + kv_transfer_timeout_s` for slow fabrics, and one long prompt can
//! keep an engine's only leg silent for a while. Silence alone proves nothing; silence while
//! the engine's peers of the same role answer, and then no token for a one-token request sent
//! straight to it, does. When every engine of a role is silent (a fabric or a model problem,
//! not one engine), nobody is suspect and the legs keep their own limits.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One engine's watch.
#[derive(Debug, Default, Clone)]
struct Watch {
    /// Legs waiting for their first output: token → dispatch instant. Tokens grow with time,
    /// so the first entry is the oldest leg.
    pending: BTreeMap<u64, Instant>,
    /// The latest output any leg of this engine got (or a passed stall probe).
    last_output: Option<Instant>,
    /// A stall probe is out.
    probing: bool,
}

/// The stall watch over every engine of the fleet (module doc), indexed like the fleet file.
#[derive(Debug, Clone)]
pub(crate) struct StallWatch {
    window: Duration,
    engines: Vec<Watch>,
    next: u64,
}

impl StallWatch {
    /// A watch over `engines` engines judging silence over `window`
    /// (`engine.first_token_timeout_s`).
    pub(crate) fn new(engines: usize, window: Duration) -> Self {
        StallWatch {
            window,
            engines: vec![Watch::default(); engines],
            next: 0,
        }
    }

    /// A leg was dispatched to `engine` at `now`; the token names it in [`Self::output`] and
    /// [`Self::abandon`].
    pub(crate) fn begin(&mut self, engine: usize, now: Instant) -> u64 {
        self.next += 1;
        self.engines[engine].pending.insert(self.next, now);
        self.next
    }

    /// Leg `token` of `engine` got its first output (or any answer from the engine: an error
    /// status is an answer too) at `now`.
    pub(crate) fn output(&mut self, engine: usize, token: u64, now: Instant) {
        let w = &mut self.engines[engine];
        w.pending.remove(&token);
        w.last_output = Some(w.last_output.map_or(now, |t| t.max(now)));
    }

    /// Leg `token` of `engine` ended without output (its own timeout, a connect error, its
    /// request dropped, or given up as stalled).
    pub(crate) fn abandon(&mut self, engine: usize, token: u64) {
        self.engines[engine].pending.remove(&token);
    }

    /// Legs of `engine` waiting for their first output.
    #[cfg(test)]
    pub(crate) fn waiting(&self, engine: usize) -> usize {
        self.engines[engine].pending.len()
    }

    /// Engines to probe now (module doc), marked as probing so each has at most one probe out.
    /// `group(engine)`: the engine's peer group (its role), `None` for an engine out of
    /// placement (neither judged nor a peer).
    pub(crate) fn suspects(
        &mut self,
        now: Instant,
        group: impl Fn(usize) -> Option<u8>,
    ) -> Vec<usize> {
        let window = self.window;
        let recent = |w: &Watch| {
            w.last_output
                .is_some_and(|t| now.saturating_duration_since(t) < window)
        };
        let groups: Vec<Option<u8>> = (0..self.engines.len()).map(&group).collect();
        let mut out = Vec::new();
        for (i, w) in self.engines.iter().enumerate() {
            let Some(g) = groups[i] else { continue };
            let Some(oldest) = w.pending.values().next().copied() else {
                continue;
            };
            if w.probing || recent(w) || now.saturating_duration_since(oldest) < window {
                continue;
            }
            // A peer answered a leg after this engine's oldest waiting leg was dispatched:
            // legs of that time can be served, so the silence is this engine's.
            let peer_answered = self.engines.iter().enumerate().any(|(j, p)| {
                j != i && groups[j] == Some(g) && p.last_output.is_some_and(|t| t > oldest)
            });
            if peer_answered {
                out.push(i);
            }
        }
        for i in &out {
            self.engines[*i].probing = true;
        }
        out
    }

    /// The stall probe of `engine` got its token at `now`: the engine answers (busy, or its
    /// legs wait on something else); counted as output, so it is not suspect again for a
    /// window.
    pub(crate) fn probe_passed(&mut self, engine: usize, now: Instant) {
        let w = &mut self.engines[engine];
        w.probing = false;
        w.last_output = Some(w.last_output.map_or(now, |t| t.max(now)));
    }

    /// The stall probe of `engine` got no token within the window, or could not be judged:
    /// the engine is watched again (the driver ejects it and fails its legs over when the
    /// probe failed).
    pub(crate) fn probe_ended(&mut self, engine: usize) {
        self.engines[engine].probing = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(2);

    fn t0() -> Instant {
        narwhal_shared::Clock::now(&narwhal_shared::SystemClock)
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    /// Engines 0 and 1 are one role, 2 another.
    fn role(i: usize) -> Option<u8> {
        Some(if i < 2 { 0 } else { 1 })
    }

    #[test]
    fn a_silent_engine_is_suspect_only_once_a_peer_of_its_role_answered_after_its_leg_left() {
        let t = t0();
        let mut s = StallWatch::new(3, W);
        // A peer's answer from before the leg was dispatched proves nothing about now.
        let early = s.begin(1, t - secs(1.0));
        s.output(1, early, t - secs(0.5));
        let a = s.begin(0, t);
        // Nobody answered since: a role-wide silence is nobody's stall.
        assert!(s.suspects(t + secs(3.0), role).is_empty());
        // Engine 2 (another role) answering is no evidence about engine 0.
        let c = s.begin(2, t + secs(2.5));
        s.output(2, c, t + secs(2.6));
        assert!(s.suspects(t + secs(3.0), role).is_empty());
        // Its peer answers: engine 0 is suspect, once; the peer's answer keeps counting
        // after it went idle (a burst whose other requests all finished).
        let b = s.begin(1, t + secs(0.2));
        s.output(1, b, t + secs(0.3));
        assert_eq!(s.suspects(t + secs(3.0), role), vec![0]);
        assert!(s.suspects(t + secs(3.1), role).is_empty(), "one probe out");
        s.probe_ended(0);
        assert_eq!(s.suspects(t + secs(3.2), role), vec![0], "watched again");
        s.abandon(0, a);
        s.probe_ended(0);
        assert!(s.suspects(t + secs(3.3), role).is_empty(), "nothing waits");
    }

    #[test]
    fn a_leg_younger_than_the_window_or_recent_output_is_not_silence() {
        let t = t0();
        let mut s = StallWatch::new(2, W);
        let p = s.begin(1, t);
        s.output(1, p, t + secs(1.0));
        let young = s.begin(0, t + secs(1.5));
        assert!(s.suspects(t + secs(3.0), role).is_empty(), "1.5 s old");
        // Engine 0 answered another leg 1 s ago: it is not silent, only slow on one leg.
        let other = s.begin(0, t + secs(1.6));
        s.output(0, other, t + secs(3.0));
        let p2 = s.begin(1, t + secs(3.5));
        s.output(1, p2, t + secs(3.6));
        assert!(s.suspects(t + secs(4.0), role).is_empty());
        // A window after its last output, with its old leg still waiting: suspect.
        assert_eq!(s.suspects(t + secs(5.0), role), vec![0]);
        s.abandon(0, young);
        assert_eq!(s.waiting(0), 0);
    }

    #[test]
    fn a_passed_probe_counts_as_output_for_a_window() {
        let t = t0();
        let mut s = StallWatch::new(2, W);
        s.begin(0, t);
        let p = s.begin(1, t + secs(2.0));
        s.output(1, p, t + secs(2.1));
        assert_eq!(s.suspects(t + secs(2.5), role), vec![0]);
        s.probe_passed(0, t + secs(3.0));
        let p = s.begin(1, t + secs(4.0));
        s.output(1, p, t + secs(4.1));
        assert!(s.suspects(t + secs(4.5), role).is_empty());
        assert_eq!(s.suspects(t + secs(5.0), role), vec![0], "a window later");
    }

    #[test]
    fn engines_out_of_placement_are_neither_judged_nor_peers() {
        let t = t0();
        let mut s = StallWatch::new(2, W);
        s.begin(0, t);
        let p = s.begin(1, t + secs(2.0));
        s.output(1, p, t + secs(2.1));
        let out_0 = |i: usize| if i == 0 { None } else { role(i) };
        assert!(s.suspects(t + secs(2.5), out_0).is_empty());
        let out_1 = |i: usize| if i == 1 { None } else { role(i) };
        assert!(s.suspects(t + secs(2.5), out_1).is_empty());
        assert_eq!(s.suspects(t + secs(2.5), role), vec![0]);
    }
}
