//! The standby's decisions, sans IO (handoff-and-lifecycle.md, "HA handoff"; behaviour.md 2.9;
//! architecture.md 9.6; ha-and-fencing.md): watch the lease store, follow the router that controls
//! the fleet, take over as soon as its lease lapsed, apply the newest state, re-check identities,
//! and give the lease back when anything fails.
//!
//! ```text
//!  tick ──► Observe (lease record, until when it counts as live, the handoff published beside it)
//!    record live, another holder ──► Retain(its published copy)          (shadowing, names it)
//!                                 └─ no published copy ──► Poll the primary (reference primary)
//!    record ours, live ───────────► Claim(Memory)                        (a fenced router's own epoch)
//!    record lapsed / absent  ─────► Claim(Memory | Stored | Retained | OwnFile) | Publish(Blocked(why))
//!  Claim ──claimed(epoch)──► Apply(source) | GiveBack(stale)
//!  Apply (and publish under the new epoch) ──applied──► ValidateIdentities
//!        ──identities_checked──► Commit ──committed──► TookOver
//!                 └─ any failure ──► GiveBack(why)    (the epoch is remembered as ours)
//! ```
//!
//! The lease decides, not the poll count: a takeover starts at the first observation of a
//! lapsed record (the driver wakes at the instant it lapses), so a primary that stopped
//! answering (`SIGSTOP`) is replaced as fast as one that died (`kill -9`); the reference waited
//! for N missed polls, each as long as the poll timeout when the primary is stopped. The state
//! applied is the newest the fleet had: the last controller's published handoff (ha-and-fencing.md:
//! every acknowledged lifecycle action and every total shown is in it), this router's own
//! memory when nobody held the lease after it, or (a reference primary that publishes
//! nothing) the copy polled over HTTP.
//!
//! Whether the record is live is not decided here from its times: each observation carries
//! the lease core's [`Freshness`] of it (ha-and-fencing.md 2.4: a record of another holder is
//! live until it has stayed unchanged for its own duration on this router's monotonic clock
//! since this router first saw it; with etcd, while it is present), so no wall clock, this
//! router's or the holder's, moves a takeover earlier or later.
//!
//! Pure: `now` (monotonic) and `wall` (Unix seconds, only for the age of a polled copy) are
//! passed in; the driver (`ha::standby`) performs each [`Step`] and feeds the result back.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use narwhal_shared::handoff::Handoff;

use crate::ha_phase::{Controller, HaPhase};
use crate::handoff::{ApplyError, PublishError, ReadPublishedError};
use narwhal_lease::{Freshness, LeaseLoss, LeaseRecord};

/// What the standby follows and when it gives up on the primary.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Settings {
    /// A primary is polled over HTTP (`--standby-of`) when the lease store holds no copy of
    /// its state; without one the router follows the store only (a fenced primary started
    /// without `--standby-of`).
    pub(crate) primary: bool,
    /// Consecutive missed polls before a standby without a fresh copy says so
    /// (`no fresh handoff`).
    pub(crate) takeover_after: u32,
    /// A copy polled over HTTP older than this (by its `at`, wall clock) is not applied.
    pub(crate) max_handoff_age_s: f64,
    /// This process's lease holder token.
    pub(crate) holder: String,
}

/// What one poll of the primary found.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Poll {
    /// The primary answered and its document matches the live lease record.
    Good(Box<Handoff>),
    /// Anything else, with the reason (logged at debug).
    Miss(String),
}

/// What one read of the lease store found (`Err`: shown as `lease unavailable: <error>`).
pub(crate) type Observation = Result<Seen, ReadPublishedError>;

/// One read of the lease store.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Seen {
    /// The lease record.
    pub(crate) record: Option<LeaseRecord>,
    /// Until when the record counts as live for this router (the lease core's observation:
    /// `narwhal_lease::LeaseDriver::freshness`), on its monotonic clock.
    pub(crate) fresh: Freshness,
    /// The handoff published beside it.
    pub(crate) stored: Option<Box<Handoff>>,
}

/// Why applying the state a takeover takes over (and publishing it under the claimed epoch)
/// failed, fed to [`Standby::applied`]; its text is the reason the lease is given back with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum ApplyFailed {
    /// The stored or retained handoff does not apply to this router's fleet.
    #[error("handoff rejected: {0}")]
    Rejected(ApplyError),
    /// No stored or retained copy was at hand.
    #[error("no fresh handoff")]
    NoFreshHandoff,
    /// This router's own state file was refused (`handoff::resume`'s reason, `handoff
    /// rejected: ...`).
    #[error("{0}")]
    OwnFileRefused(String),
    /// The applied state could not be published beside the new lease record.
    #[error("handoff not published under the new epoch: {0}")]
    NotPublished(PublishError),
}

/// The state a takeover applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The handoff the last controller published beside the lease record (its epoch is the
    /// record's, or separated from the claim only by epochs this router gave back).
    Stored,
    /// The primary's document polled over HTTP (a primary that publishes nothing); its epoch
    /// must be the claimed one − 1, or separated only by epochs this router gave back.
    Retained,
    /// This router's own state file, for a router that never controlled the fleet in this
    /// process; written under `epoch` (0: no file).
    OwnFile {
        /// The file's epoch.
        epoch: u64,
    },
    /// This process's memory: a fenced router that controlled the fleet at `epoch`, and
    /// nobody held the lease after it.
    Memory {
        /// The epoch it controlled.
        epoch: u64,
    },
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Step {
    /// Nothing more this tick.
    Wait,
    /// Read the lease record and the handoff published beside it (and, for a router without
    /// a primary that never controlled the fleet, its own state file's epoch); feed
    /// [`Standby::observed`].
    Observe,
    /// Poll the primary's `/ready` and `/narwhal/handoff`; feed [`Standby::polled`].
    Poll,
    /// A current copy of the controller's state is retained ([`Standby::retained`]): persist
    /// it to the state file and publish `Shadowing`, naming the controller.
    Retain(Controller),
    /// Another router holds a live lease but no copy of its state is at hand: publish
    /// `Shadowing` naming it (a standby, not a fenced router).
    Follow(Controller),
    /// Publish this phase (a blocked standby with its reason); end of the tick.
    Publish(HaPhase),
    /// Claim the lease (starting its renewal) and feed [`Standby::claimed`].
    Claim(Source),
    /// Apply `source` under the claimed epoch and publish it beside the new record, then feed
    /// [`Standby::applied`].
    Apply(Source),
    /// Publish `ValidatingIdentities`, re-check every engine's identity through its agent,
    /// then feed [`Standby::identities_checked`].
    ValidateIdentities,
    /// Mark the renewal committed (it fails if the lease was lost while pending) and feed
    /// [`Standby::committed`].
    Commit,
    /// The takeover failed: (publish `Blocked(why)` first when `announce`,) stop the
    /// renewal, release the lease, and publish `Blocked(why)`. The epoch is already recorded
    /// as given back.
    GiveBack {
        /// The epoch claimed.
        epoch: u64,
        /// Why, shown in `/ready`.
        why: String,
        /// Show the reason before releasing (the lease lapsed during the identity check).
        announce: bool,
    },
    /// The takeover completed: record `gap` (since the last current copy), publish `Active`.
    TookOver {
        /// Monotonic time since the last current copy was retained, if any.
        gap: Option<Duration>,
    },
}

/// The reference's reason for a retained handoff older than the lease (behaviour.md 2.9):
/// the document's epoch `doc` and the epoch a claim would get, `claim`.
pub(crate) fn stale_handoff(doc: u64, claim: u64) -> String {
    format!("handoff epoch {doc} cannot precede claimed epoch {claim}")
}

/// The reason a router with outdated state stays out (found by ha_e2e: a fenced primary took
/// the fleet back after the new primary died, with its pre-takeover counters and without the
/// new primary's drain of an engine, which then got traffic again). Since the handoff is
/// published beside the lease it only applies when the router that held the lease after it
/// published nothing (a reference router): otherwise its published state is taken over.
pub(crate) fn stale_state(own: u64, newer: u64) -> String {
    format!(
        "stale state: another router controlled the fleet at epoch {newer} after this router's \
         epoch {own}; restart this router with --standby-of the current primary, or with \
         --resume from the newest state file"
    )
}

/// How long the standby waits before its next tick: the poll `interval`, or less when the
/// controller's lease record lapses sooner (`lapses_at`, a monotonic instant, from `now`;
/// plus 5 ms so the lapse is seen), so a takeover starts as soon as the lease allows rather
/// than up to one interval later.
pub(crate) fn next_wait(interval: Duration, lapses_at: Option<Instant>, now: Instant) -> Duration {
    let Some(at) = lapses_at else {
        return interval;
    };
    let until = at.saturating_duration_since(now) + Duration::from_millis(5);
    interval.min(until)
}

/// [`next_wait`] in whole milliseconds, rounded up (the fault model's clock).
#[cfg(test)]
pub(crate) fn next_wait_ms(interval_ms: u64, lapses_at: Option<Instant>, now: Instant) -> u64 {
    let d = next_wait(Duration::from_millis(interval_ms), lapses_at, now);
    u64::try_from(d.as_micros().div_ceil(1000))
        .unwrap_or(interval_ms)
        .max(1)
}

/// The standby machine (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct Standby {
    settings: Settings,
    /// The epoch this router last controlled (a fenced primary), `None` if it never did.
    held: Option<u64>,
    /// The newest current copy of the controller's state (published or polled).
    retained: Option<Box<Handoff>>,
    /// The handoff last read from the lease store (a takeover applies it).
    stored: Option<Box<Handoff>>,
    /// The lease record last read.
    record: Option<LeaseRecord>,
    /// Until when it counts as live, as the lease core observed it.
    fresh: Freshness,
    misses: u32,
    last_good: Option<Instant>,
    /// Epochs this router claimed and gave back without serving (failed takeovers).
    given_back: BTreeSet<u64>,
}

impl Standby {
    /// A standby that last controlled the fleet at epoch `held` (`None`: never).
    pub(crate) fn new(settings: Settings, held: Option<u64>) -> Standby {
        Standby {
            settings,
            held,
            retained: None,
            stored: None,
            record: None,
            fresh: Freshness::Free,
            misses: 0,
            last_good: None,
            given_back: BTreeSet::new(),
        }
    }

    /// The retained copy of the controller's state, if any.
    pub(crate) fn retained(&self) -> Option<&Handoff> {
        self.retained.as_deref()
    }

    /// The handoff last read from the lease store, if any.
    pub(crate) fn stored(&self) -> Option<&Handoff> {
        self.stored.as_deref()
    }

    /// The epoch this router last controlled, if it did.
    #[cfg(test)]
    pub(crate) fn held(&self) -> Option<u64> {
        self.held
    }

    /// When the lease record last read lapses (a monotonic instant: the lease core's
    /// observation, never its `expires_at`), if it is another router's and lapses by itself:
    /// the driver wakes then to take over without waiting for a poll interval.
    pub(crate) fn lapses_at(&self) -> Option<Instant> {
        self.record
            .as_ref()
            .filter(|r| r.holder != self.settings.holder)
            .and_then(|_| self.fresh.until())
    }

    /// Whether the router needs its own state file's epoch for [`Standby::observed`]: it
    /// follows no primary and never controlled the fleet in this process.
    pub(crate) fn wants_own_file(&self) -> bool {
        !self.settings.primary && self.held.is_none()
    }

    /// Epochs claimed and given back by this router.
    #[cfg(test)]
    pub(crate) fn given_back(&self) -> &BTreeSet<u64> {
        &self.given_back
    }

    /// Records an epoch this router claimed and gave back itself (a test starting from a
    /// failed attempt).
    #[cfg(test)]
    pub(crate) fn gave_back(&mut self, epoch: u64) {
        self.given_back.insert(epoch);
    }

    /// One poll interval passed (or the observed record's expiry came).
    pub(crate) fn tick(&self) -> Step {
        Step::Observe
    }

    /// `doc` (epoch `doc`) may be applied under the epoch a claim would get after `record`
    /// epoch `last`: nobody but this router held the lease after the document was written.
    fn chain_holds(&self, doc: u64, last: u64) -> bool {
        doc >= last || (doc + 1..=last).all(|e| self.given_back.contains(&e))
    }

    fn retain(&mut self, now: Instant, h: Box<Handoff>) {
        self.misses = 0;
        self.last_good = Some(now);
        self.retained = Some(h);
    }

    /// What the lease store held at `now` / `now_wall` (the record live while `now` is before
    /// its [`Seen::fresh`]); `own_file` is this router's own state file's epoch when
    /// [`Standby::wants_own_file`] (0 without a valid file).
    pub(crate) fn observed(
        &mut self,
        now: Instant,
        now_wall: f64,
        seen: Observation,
        own_file: Option<u64>,
    ) -> Step {
        let Seen {
            record,
            fresh,
            stored,
        } = match seen {
            Ok(x) => x,
            Err(e) => {
                return Step::Publish(HaPhase::Blocked {
                    reason: format!("lease unavailable: {e}"),
                });
            }
        };
        self.record = record.clone();
        self.fresh = fresh;
        self.stored = stored;
        let live = fresh.live(now);
        match record {
            Some(r) if live && r.holder != self.settings.holder => {
                let controller = Controller {
                    holder: r.holder.clone(),
                    epoch: r.epoch,
                };
                let current = self
                    .stored
                    .as_ref()
                    .filter(|h| h.epoch == r.epoch && h.holder == r.holder)
                    .cloned();
                match current {
                    Some(h) => {
                        self.retain(now, h);
                        Step::Retain(controller)
                    }
                    None if self.settings.primary => Step::Poll,
                    None => Step::Follow(controller),
                }
            }
            // Our own record, still live: a fenced router whose renewal failed while the
            // record held (a store hiccup). Getting its own epoch back is no change of holder.
            Some(r) if live => match self.held {
                Some(e) if e == r.epoch => Step::Claim(Source::Memory { epoch: e }),
                _ => Step::Wait,
            },
            lapsed => self.candidate(now_wall, lapsed.as_ref(), own_file),
        }
    }

    /// The lease lapsed (or never existed): which state to take over with, or why not.
    fn candidate(
        &mut self,
        now_wall: f64,
        record: Option<&LeaseRecord>,
        own_file: Option<u64>,
    ) -> Step {
        let last = record.map_or(0, |r| r.epoch);
        if let Some(e) = self.held
            && e == last
        {
            return Step::Claim(Source::Memory { epoch: e });
        }
        if let Some(h) = &self.stored
            && h.epoch > 0
            && self.chain_holds(h.epoch, last)
        {
            return Step::Claim(Source::Stored);
        }
        if self.settings.primary {
            let newest = self
                .stored
                .iter()
                .chain(self.retained.iter())
                .map(|h| h.epoch)
                .max();
            return match &self.retained {
                Some(h) if now_wall - h.at > self.settings.max_handoff_age_s => {
                    self.blocked("no fresh handoff")
                }
                Some(h) if self.chain_holds(h.epoch, last) => Step::Claim(Source::Retained),
                _ => match newest {
                    Some(doc) => Step::Publish(HaPhase::Blocked {
                        reason: stale_handoff(doc, last + 1),
                    }),
                    None => self.blocked("no fresh handoff"),
                },
            };
        }
        let own = match (self.held, own_file) {
            (Some(e), _) => e,
            (None, Some(e)) => e,
            (None, None) => 0,
        };
        if self.held.is_none() && self.chain_holds(own, last) {
            return Step::Claim(Source::OwnFile { epoch: own });
        }
        Step::Publish(HaPhase::Blocked {
            reason: stale_state(own, last),
        })
    }

    fn blocked(&self, reason: &str) -> Step {
        Step::Publish(HaPhase::Blocked {
            reason: reason.into(),
        })
    }

    /// The HTTP poll's result at `now` / `now_wall` (the record is live and another
    /// router's, and it published nothing beside it).
    pub(crate) fn polled(&mut self, now: Instant, now_wall: f64, poll: Poll) -> Step {
        match poll {
            Poll::Good(h) => {
                let controller = Controller {
                    holder: h.holder.clone(),
                    epoch: h.epoch,
                };
                self.retain(now, h);
                Step::Retain(controller)
            }
            Poll::Miss(_) => {
                self.misses = self.misses.saturating_add(1);
                let fresh = self
                    .retained
                    .as_ref()
                    .is_some_and(|h| now_wall - h.at <= self.settings.max_handoff_age_s);
                if self.misses < self.settings.takeover_after || fresh {
                    return Step::Wait;
                }
                self.blocked("no fresh handoff")
            }
        }
    }

    fn give_back(&mut self, epoch: u64, why: String, announce: bool) -> Step {
        // Remember the epoch: it was ours and nobody served under it, so it does not make
        // the state to apply stale on the next attempt (etcd advances the epoch on every
        // claim).
        self.given_back.insert(epoch);
        Step::GiveBack {
            epoch,
            why,
            announce,
        }
    }

    /// The claim's result for `source`.
    pub(crate) fn claimed(&mut self, source: Source, claim: Result<u64, LeaseLoss>) -> Step {
        let epoch = match claim {
            Ok(e) => e,
            // Another router's lease is live: never take over then.
            Err(LeaseLoss::HeldByAnother) => return Step::Wait,
            Err(e) => {
                return Step::Publish(HaPhase::Blocked {
                    reason: e.to_string(),
                });
            }
        };
        let doc = match source {
            Source::Stored => self.stored.as_ref().map(|h| h.epoch),
            Source::Retained => self.retained.as_ref().map(|h| h.epoch),
            // Another router claimed in between the check and our claim. Getting our own
            // epoch back (our record was still live: a renewal failed transiently) is no
            // change of holder: the claim keeps the epoch only for this process's own holder
            // token.
            Source::OwnFile { epoch: own } | Source::Memory { epoch: own } => {
                if own + 1 != epoch && !(own > 0 && own == epoch) {
                    return self.give_back(epoch, stale_state(own, epoch - 1), false);
                }
                return Step::Apply(source);
            }
        };
        let Some(doc) = doc else {
            return self.give_back(epoch, "no fresh handoff".into(), false);
        };
        if doc != 0 && !self.chain_holds(doc, epoch - 1) {
            return self.give_back(epoch, stale_handoff(doc, epoch), false);
        }
        Step::Apply(source)
    }

    /// Applying the source under `epoch` (and publishing it there) finished (`Err`: why it
    /// was refused, the reason given back); `lease_active` is the lease's local validity now.
    pub(crate) fn applied(
        &mut self,
        epoch: u64,
        result: Result<(), ApplyFailed>,
        lease_active: bool,
    ) -> Step {
        match result {
            Err(why) => self.give_back(epoch, why.to_string(), false),
            Ok(()) if !lease_active => {
                self.give_back(epoch, "lease expired while applying handoff".into(), false)
            }
            // Controls the fleet (the identity check runs only then) but is not ready yet:
            // no placement on an engine whose process was not re-checked (found by ha_e2e:
            // `/ready` answered 200 before the agents had been asked).
            Ok(()) => Step::ValidateIdentities,
        }
    }

    /// The identity check finished: `lease_active` is the lease's local validity, `controls`
    /// whether the router still controls the fleet (an agent that answered `stale_epoch`
    /// fenced it).
    pub(crate) fn identities_checked(
        &mut self,
        epoch: u64,
        lease_active: bool,
        controls: bool,
    ) -> Step {
        if !lease_active {
            let why = "lease expired during identity validation".to_string();
            return self.give_back(epoch, why, true);
        }
        if !controls {
            // An agent answered stale_epoch: a newer router exists; the fence set the reason.
            let why = "fenced by an agent during identity validation".to_string();
            return self.give_back(epoch, why, false);
        }
        Step::Commit
    }

    /// The renewal's commit at `now`: `false` when the lease was lost while the takeover
    /// was pending (nobody else starts the standby loop then).
    pub(crate) fn committed(&mut self, epoch: u64, now: Instant, ok: bool) -> Step {
        if !ok {
            return self.give_back(epoch, "lease lost during the takeover".into(), false);
        }
        self.held = Some(epoch);
        Step::TookOver {
            gap: self.last_good.map(|t| now.saturating_duration_since(t)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use narwhal_lease::{Expiry, LEASE_SCHEMA, Observer};
    use narwhal_shared::{Clock as _, SystemClock};
    use std::collections::BTreeMap;

    pub(crate) const ME: &str = "me:0";

    pub(crate) fn settings(primary: bool) -> Settings {
        Settings {
            primary,
            takeover_after: 3,
            max_handoff_age_s: 30.0,
            holder: ME.into(),
        }
    }

    pub(crate) fn doc(epoch: u64, at: f64) -> Box<Handoff> {
        doc_of(epoch, "primary:0", at)
    }

    pub(crate) fn doc_of(epoch: u64, holder: &str, at: f64) -> Box<Handoff> {
        Box::new(Handoff {
            schema: narwhal_shared::handoff::HANDOFF_SCHEMA.into(),
            schema_version: narwhal_shared::handoff::HANDOFF_VERSION,
            at,
            run: "1-aa".into(),
            model: "m".into(),
            epoch,
            holder: holder.into(),
            engines: vec!["d0".into()],
            roles: BTreeMap::from([("d0".into(), "decode".into())]),
            ejected: vec![],
            inference_sources: BTreeMap::new(),
            counters: BTreeMap::new(),
            outcome_reasons: BTreeMap::new(),
            lifecycle: narwhal_shared::handoff::LifecycleState {
                wave_id: String::new(),
                records: vec![],
                events: vec![],
                engine_restart_policy: "individual".into(),
                process_starts: BTreeMap::new(),
            },
            demand_risk: None,
        })
    }

    pub(crate) fn record_of(epoch: u64, holder: &str, expires_at: f64) -> LeaseRecord {
        LeaseRecord {
            epoch,
            expires_at,
            holder: holder.into(),
            schema: narwhal_lease::LEASE_SCHEMA.into(),
            schema_version: 1,
            updated_at: expires_at - 2.0,
        }
    }

    fn record(epoch: u64, expires_at: f64) -> LeaseRecord {
        record_of(epoch, "primary:0", expires_at)
    }

    /// One read of the store: `rec` counting as live until `fresh` (the lease core's
    /// observation), and `stored`.
    pub(crate) fn seen(
        rec: Option<LeaseRecord>,
        fresh: Freshness,
        stored: Option<Box<Handoff>>,
    ) -> Observation {
        Ok(Seen {
            record: rec,
            fresh,
            stored,
        })
    }

    /// A record first seen at `t0` that lives 2 s unchanged: live before `t0 + 2 s`, lapsed from
    /// then on.
    fn two_s_from(t0: Instant) -> Freshness {
        Freshness::Until(t0 + Duration::from_secs(2))
    }

    /// A record that lapsed at `t` (it was unchanged for its duration by then).
    fn lapsed_at(t: Instant) -> Freshness {
        Freshness::Until(t)
    }

    fn etcd_timed_out() -> ReadPublishedError {
        ReadPublishedError::Store(narwhal_lease::LeaseError::Etcd {
            op: "get",
            endpoints: "127.0.0.1:2379".into(),
            message: "timed out after 1 s".into(),
        })
    }

    fn miss() -> Poll {
        Poll::Miss("connection refused".into())
    }

    fn controller(epoch: u64) -> Controller {
        Controller {
            holder: "primary:0".into(),
            epoch,
        }
    }

    /// A warm standby, step by step: it follows the primary through the handoff the primary
    /// publishes beside its lease record, takes over at the first observation of a lapsed
    /// record (no missed polls needed), applies the published copy, re-checks identities,
    /// commits, and reports the gap since the last current copy.
    #[test]
    fn a_standby_follows_the_store_and_takes_over_when_the_record_lapses() {
        let t0 = SystemClock.now();
        let mut s = Standby::new(settings(true), None);
        assert_eq!(s.tick(), Step::Observe);
        let live = Some(record(4, 1002.0));
        let fresh = two_s_from(t0);
        assert_eq!(
            s.observed(
                t0,
                1000.0,
                seen(live.clone(), fresh, Some(doc(4, 999.9))),
                None
            ),
            Step::Retain(controller(4))
        );
        assert_eq!(s.retained().map(|h| h.epoch), Some(4));
        assert_eq!(
            s.lapses_at(),
            Some(t0 + Duration::from_secs(2)),
            "the driver wakes when it lapses"
        );
        // A copy of another epoch or holder than the record's is not current: poll.
        assert_eq!(
            s.observed(
                t0,
                1000.1,
                seen(live.clone(), fresh, Some(doc(3, 999.0))),
                None
            ),
            Step::Poll
        );
        let later = t0 + Duration::from_millis(2500);
        assert_eq!(
            s.observed(
                later,
                1002.0,
                seen(Some(record(4, 1002.0)), fresh, Some(doc(4, 1001.5))),
                None
            ),
            Step::Claim(Source::Stored),
            "lapsed: unchanged for its 2 s since it was first seen"
        );
        assert_eq!(
            s.stored().map(|h| h.at),
            Some(1001.5),
            "the newest published copy"
        );
        assert_eq!(
            s.claimed(Source::Stored, Ok(5)),
            Step::Apply(Source::Stored)
        );
        assert_eq!(s.applied(5, Ok(()), true), Step::ValidateIdentities);
        assert_eq!(s.identities_checked(5, true, true), Step::Commit);
        assert_eq!(
            s.committed(5, later, true),
            Step::TookOver {
                gap: Some(Duration::from_millis(2500))
            }
        );
        assert_eq!(s.held(), Some(5));
    }

    /// A primary that publishes nothing (the Python reference) is polled over HTTP: misses
    /// while its lease is live never take over; `no fresh handoff` is said after N misses
    /// without a fresh copy; a lapsed lease is taken over with the polled copy.
    #[test]
    fn a_primary_that_publishes_nothing_is_polled() {
        let t0 = SystemClock.now();
        let mut s = Standby::new(settings(true), None);
        let fresh = two_s_from(t0);
        let live = || seen(Some(record(4, 1002.0)), fresh, None);
        assert_eq!(s.observed(t0, 1000.0, live(), None), Step::Poll);
        assert_eq!(s.polled(t0, 1000.0, miss()), Step::Wait);
        assert_eq!(s.polled(t0, 1000.0, miss()), Step::Wait);
        assert_eq!(
            s.polled(t0, 1000.0, miss()),
            Step::Publish(HaPhase::Blocked {
                reason: "no fresh handoff".into()
            }),
            "nothing retained after 3 misses"
        );
        assert_eq!(
            s.polled(t0, 1000.0, Poll::Good(doc(4, 1000.0))),
            Step::Retain(controller(4))
        );
        for _ in 0..5 {
            assert_eq!(
                s.polled(t0, 1000.5, miss()),
                Step::Wait,
                "a fresh copy is kept"
            );
        }
        assert_eq!(
            s.polled(t0, 1031.0, miss()),
            Step::Publish(HaPhase::Blocked {
                reason: "no fresh handoff".into()
            }),
            "31 s old"
        );
        let t31 = t0 + Duration::from_secs(31);
        assert_eq!(
            s.observed(
                t31,
                1031.0,
                seen(Some(record(4, 1002.0)), fresh, None),
                None
            ),
            Step::Publish(HaPhase::Blocked {
                reason: "no fresh handoff".into()
            }),
            "a stale polled copy is never applied"
        );
        let mut s = Standby::new(settings(true), None);
        s.polled(t0, 1000.0, Poll::Good(doc(4, 1000.0)));
        let t3 = t0 + Duration::from_secs(3);
        assert_eq!(
            s.observed(t3, 1003.0, seen(Some(record(4, 1002.0)), fresh, None), None),
            Step::Claim(Source::Retained)
        );
        assert_eq!(
            s.claimed(Source::Retained, Ok(5)),
            Step::Apply(Source::Retained)
        );
    }

    /// The lease decides: a live record of another holder means follow; a newer epoch than
    /// every copy at hand means the copy is stale; an unreadable store is shown.
    #[test]
    fn the_lease_record_gates_the_claim() {
        let t0 = SystemClock.now();
        let mut s = Standby::new(settings(true), None);
        s.polled(t0, 1000.0, Poll::Good(doc(4, 1000.0)));
        assert_eq!(
            s.observed(
                t0,
                1001.0,
                seen(Some(record(5, 1000.5)), lapsed_at(t0), None),
                None
            ),
            Step::Publish(HaPhase::Blocked {
                reason: stale_handoff(4, 6)
            }),
            "a third router held epoch 5 and published nothing"
        );
        assert_eq!(
            s.observed(t0, 1001.0, Err(etcd_timed_out()), None),
            Step::Publish(HaPhase::Blocked {
                reason: "lease unavailable: etcd get on 127.0.0.1:2379: timed out after 1 s".into()
            })
        );
        let mut fresh = Standby::new(settings(true), None);
        assert_eq!(
            fresh.observed(t0, 1001.0, seen(None, Freshness::Free, None), None),
            Step::Publish(HaPhase::Blocked {
                reason: "no fresh handoff".into()
            }),
            "no primary ever ran: nothing to take over"
        );
    }

    /// ha-and-fencing.md: a fenced primary that sees another router's live lease is a standby that
    /// names the controller (it follows the published copy, or just the record); when that
    /// router dies it takes the fleet over with the newer router's published state, never
    /// its own stale memory.
    #[test]
    fn a_fenced_router_follows_the_new_controller_and_takes_over_its_state() {
        let t0 = SystemClock.now();
        let mut s = Standby::new(settings(false), Some(7));
        let newer = || record_of(8, "new:1", 1002.0);
        let fresh = two_s_from(t0);
        let t3 = t0 + Duration::from_secs(3);
        assert_eq!(
            s.observed(t0, 1000.0, seen(Some(newer()), fresh, None), None),
            Step::Follow(Controller {
                holder: "new:1".into(),
                epoch: 8
            }),
            "no copy yet, still a standby"
        );
        assert_eq!(
            s.observed(
                t0,
                1000.0,
                seen(Some(newer()), fresh, Some(doc_of(8, "new:1", 999.0))),
                None
            ),
            Step::Retain(Controller {
                holder: "new:1".into(),
                epoch: 8
            })
        );
        assert_eq!(
            s.observed(
                t3,
                1003.0,
                seen(Some(newer()), fresh, Some(doc_of(8, "new:1", 1001.0))),
                None
            ),
            Step::Claim(Source::Stored)
        );
        assert_eq!(
            s.claimed(Source::Stored, Ok(9)),
            Step::Apply(Source::Stored)
        );
        // The newer router published nothing (a reference router): its state is unknown.
        let mut s = Standby::new(settings(false), Some(7));
        assert_eq!(
            s.observed(
                t3,
                1003.0,
                seen(Some(newer()), fresh, Some(doc_of(7, ME, 990.0))),
                None
            ),
            Step::Publish(HaPhase::Blocked {
                reason: stale_state(7, 8)
            })
        );
    }

    /// A fenced router whose own lease lapsed with nobody after it takes the fleet back
    /// from memory; its own live record (a transient renewal failure) keeps its epoch; a
    /// router that never controlled takes its own state file only when it is current.
    #[test]
    fn a_router_without_a_peer_takes_back_only_its_own_latest_epoch() {
        let t0 = SystemClock.now();
        let now = 1000.0;
        let mut fenced = Standby::new(settings(false), Some(7));
        assert!(!fenced.wants_own_file());
        assert_eq!(
            fenced.observed(
                t0,
                now,
                seen(
                    Some(record_of(7, ME, now - 1.0)),
                    lapsed_at(t0),
                    Some(doc_of(7, ME, 990.0))
                ),
                None
            ),
            Step::Claim(Source::Memory { epoch: 7 }),
            "memory is newer than its own published copy"
        );
        let own_live = seen(
            Some(record_of(7, ME, now + 1.0)),
            Freshness::Until(t0 + Duration::from_secs(1)),
            None,
        );
        assert_eq!(
            fenced.observed(t0, now, own_live, None),
            Step::Claim(Source::Memory { epoch: 7 }),
            "its own live record"
        );
        assert_eq!(
            fenced.claimed(Source::Memory { epoch: 7 }, Ok(7)),
            Step::Apply(Source::Memory { epoch: 7 })
        );
        let mut fresh = Standby::new(settings(false), None);
        assert!(fresh.wants_own_file());
        assert_eq!(
            fresh.observed(t0, now, seen(None, Freshness::Free, None), Some(0)),
            Step::Claim(Source::OwnFile { epoch: 0 })
        );
        let gone = |epoch| seen(Some(record(epoch, now - 1.0)), lapsed_at(t0), None);
        assert_eq!(
            fresh.observed(t0, now, gone(7), Some(7)),
            Step::Claim(Source::OwnFile { epoch: 7 })
        );
        assert_eq!(
            fresh.observed(t0, now, gone(8), Some(7)),
            Step::Publish(HaPhase::Blocked {
                reason: stale_state(7, 8)
            })
        );
        let why = stale_state(7, 8);
        assert!(why.starts_with("stale state:"), "{why}");
        assert!(why.contains("epoch 8 after this router's epoch 7"), "{why}");
        assert_eq!(
            stale_handoff(7, 9),
            "handoff epoch 7 cannot precede claimed epoch 9"
        );
    }

    /// Found by ha_e2e (etcd, loaded machine): after one failed takeover attempt every retry
    /// claimed the next epoch and refused the retained handoff as stale, forever. Epochs this
    /// router claimed and gave back itself do not make the handoff stale; anyone else's do.
    #[test]
    fn own_given_back_epochs_do_not_make_the_retained_handoff_stale() {
        let t0 = SystemClock.now();
        for ours in [true, false] {
            let mut s = Standby::new(settings(true), None);
            s.polled(t0, 1000.0, Poll::Good(doc(1, 1000.0)));
            if ours {
                s.gave_back(2);
            }
            let step = s.claimed(Source::Retained, Ok(3));
            if ours {
                assert_eq!(step, Step::Apply(Source::Retained), "our own attempt");
            } else {
                assert_eq!(
                    step,
                    Step::GiveBack {
                        epoch: 3,
                        why: "handoff epoch 1 cannot precede claimed epoch 3".into(),
                        announce: false,
                    }
                );
                assert!(s.given_back().contains(&3), "remembered as ours");
            }
        }
    }

    /// A claim must follow the state it applies; a refused claim waits; a store error shows.
    #[test]
    fn a_claim_must_follow_the_state_it_applies() {
        let mut s = Standby::new(settings(false), Some(1));
        assert_eq!(
            s.claimed(Source::Memory { epoch: 1 }, Ok(1)),
            Step::Apply(Source::Memory { epoch: 1 })
        );
        assert_eq!(
            s.claimed(Source::Memory { epoch: 1 }, Ok(2)),
            Step::Apply(Source::Memory { epoch: 1 })
        );
        let Step::GiveBack { epoch, why, .. } = s.claimed(Source::OwnFile { epoch: 0 }, Ok(2))
        else {
            panic!("must give back");
        };
        assert_eq!(epoch, 2);
        assert!(why.starts_with("stale state:"), "{why}");
        assert!(why.contains("epoch 1 after this router's epoch 0"), "{why}");
        assert_eq!(
            s.claimed(Source::Retained, Err(LeaseLoss::HeldByAnother)),
            Step::Wait
        );
        assert_eq!(
            s.claimed(Source::Retained, Err(LeaseLoss::Unavailable("io".into()))),
            Step::Publish(HaPhase::Blocked {
                reason: "lease unavailable: io".into()
            })
        );
        // Another router claimed (and maybe published) between our read and our claim.
        let t0 = SystemClock.now();
        let mut s = Standby::new(settings(true), None);
        s.observed(
            t0,
            1003.0,
            seen(Some(record(4, 1002.0)), lapsed_at(t0), Some(doc(4, 1001.0))),
            None,
        );
        let Step::GiveBack { why, .. } = s.claimed(Source::Stored, Ok(6)) else {
            panic!("epoch 5 was someone else's");
        };
        assert_eq!(why, stale_handoff(4, 6));
    }

    /// Every failure after the claim gives the epoch back with its reason; only a lapsed
    /// lease during the identity check is announced before the release.
    #[test]
    fn failures_after_the_claim_give_the_lease_back() {
        let mut s = Standby::new(settings(true), None);
        let back = |why: &str, announce| Step::GiveBack {
            epoch: 5,
            why: why.into(),
            announce,
        };
        assert_eq!(
            s.applied(
                5,
                Err(ApplyFailed::Rejected(ApplyError::ForeignFleet(
                    "model".into()
                ))),
                true
            ),
            back("handoff rejected: model", false)
        );
        assert_eq!(
            s.applied(5, Ok(()), false),
            back("lease expired while applying handoff", false)
        );
        assert_eq!(
            s.identities_checked(5, false, true),
            back("lease expired during identity validation", true)
        );
        assert_eq!(
            s.identities_checked(5, true, false),
            back("fenced by an agent during identity validation", false)
        );
        assert_eq!(
            s.committed(5, SystemClock.now(), false),
            back("lease lost during the takeover", false)
        );
        assert_eq!(s.given_back(), &BTreeSet::from([5]));
        assert_eq!(s.held(), None, "never took over");
    }

    /// A primary renewing its record every 500 ms (ttl 2 s) from its own wall clock, and a
    /// standby reading the store every 250 ms through the lease core's [`Observer`] (as
    /// `ha::standby` does through the lease driver), with its own wall clock; simulated
    /// monotonic time, the same rate for both.
    struct Watch {
        t0: Instant,
        observer: Observer,
        standby: Standby,
        record: LeaseRecord,
        published: Box<Handoff>,
    }

    impl Watch {
        fn new(expiry: Expiry) -> Watch {
            let mut w = Watch {
                t0: SystemClock.now(),
                observer: Observer::new(expiry),
                standby: Standby::new(settings(true), None),
                record: record(4, 1002.0),
                published: doc(4, 1000.0),
            };
            w.renew(1000.0);
            w
        }

        /// The primary renews (and publishes) with its wall clock reading `wall`.
        fn renew(&mut self, wall: f64) {
            self.record = LeaseRecord {
                epoch: 4,
                expires_at: wall + 2.0,
                holder: "primary:0".into(),
                schema: LEASE_SCHEMA.into(),
                schema_version: 1,
                updated_at: wall,
            };
            self.published = doc(4, wall);
        }

        /// The standby reads the store `ms` after t0, its wall clock reading `wall`.
        fn look(&mut self, ms: u64, wall: f64) -> Step {
            let now = self.t0 + Duration::from_millis(ms);
            let fresh = self.observer.observe(Some(&self.record), now);
            let read = seen(
                Some(self.record.clone()),
                fresh,
                Some(self.published.clone()),
            );
            self.standby.observed(now, wall, read, None)
        }
    }

    /// lease-clock-skew: a standby whose wall clock is 10 s ahead of the primary's (or behind)
    /// keeps shadowing a primary that renews, at every read for 10 s: the record's
    /// `expires_at` (long past, or far ahead, on the standby's wall clock) is never looked at,
    /// and the standby wakes one ttl after its first sight of each version, never earlier.
    #[test]
    fn a_standby_whose_wall_clock_is_ahead_or_behind_keeps_shadowing_a_renewing_primary() {
        for skew in [10.0, -10.0] {
            let mut w = Watch::new(Expiry::Observed);
            for ms in (0..=10_000u64).step_by(250) {
                let primary_wall = 1000.0 + ms as f64 / 1000.0;
                if ms % 500 == 0 {
                    w.renew(primary_wall);
                }
                assert_eq!(
                    w.look(ms, primary_wall + skew),
                    Step::Retain(controller(4)),
                    "skew {skew} at {ms} ms"
                );
                let now = w.t0 + Duration::from_millis(ms);
                let wake = w.standby.lapses_at().expect("a lapse to wake at");
                assert!(wake > now, "skew {skew} at {ms} ms: wakes in the past");
            }
        }
    }

    /// The primary's own wall clock jumping forward or back by far more than the ttl changes
    /// nothing for the standby while the primary renews (each renewal is a new version).
    #[test]
    fn a_primary_whose_wall_clock_jumps_keeps_its_standby_shadowing() {
        let mut w = Watch::new(Expiry::Observed);
        let mut wall = 1000.0;
        for ms in (0..=8_000u64).step_by(250) {
            if ms % 500 == 0 {
                wall += match ms {
                    2000 => 600.0,
                    4000 => -1800.0,
                    _ => 0.5,
                };
                w.renew(wall);
            }
            assert_eq!(
                w.look(ms, 1000.0 + ms as f64 / 1000.0),
                Step::Retain(controller(4))
            );
        }
    }

    /// A primary that stops renewing is taken over one ttl after the standby first saw its last
    /// record: not at that record's `expires_at` on the standby's clock (10 s ahead here, so
    /// long past), and the standby wakes exactly then (plus 5 ms).
    #[test]
    fn a_primary_that_stops_renewing_is_taken_over_one_ttl_after_its_last_record_was_first_seen() {
        let mut w = Watch::new(Expiry::Observed);
        let skew = 10.0;
        w.renew(1001.0);
        // The primary renewed at 1000 ms and died; the standby first sees that record at 1100.
        assert_eq!(w.look(1100, 1011.1), Step::Retain(controller(4)));
        let wake = w.t0 + Duration::from_millis(3100);
        assert_eq!(w.standby.lapses_at(), Some(wake));
        assert_eq!(
            next_wait(
                Duration::from_millis(250),
                w.standby.lapses_at(),
                wake - Duration::from_millis(200)
            ),
            Duration::from_millis(205)
        );
        for ms in [1350, 2000, 3000, 3099] {
            let step = w.look(ms, 1000.0 + ms as f64 / 1000.0 + skew);
            assert_eq!(step, Step::Retain(controller(4)), "at {ms} ms");
        }
        assert_eq!(
            w.look(3100, 1013.1 + skew),
            Step::Claim(Source::Stored),
            "one ttl after the first sight of the last record"
        );
        assert_eq!(w.standby.stored().map(|h| h.at), Some(1001.0));
    }

    /// A released record (the primary gave the lease up: a planned handover) is taken at the
    /// first observation, even by a standby that never saw it before.
    #[test]
    fn a_released_record_is_taken_at_once() {
        let mut w = Watch::new(Expiry::Observed);
        w.record.expires_at = w.record.updated_at;
        assert_eq!(w.look(0, 990.0), Step::Claim(Source::Stored));
        assert_eq!(w.standby.lapses_at(), None);
    }

    /// etcd: a present record is live whatever its age (etcd deletes a lapsed one), so the
    /// standby polls at its interval (nothing to wake at) and takes over once it is gone.
    #[test]
    fn with_etcd_a_present_record_is_followed_until_it_vanishes() {
        let mut w = Watch::new(Expiry::Store);
        for ms in [0, 5_000, 60_000] {
            assert_eq!(
                w.look(ms, 5000.0),
                Step::Retain(controller(4)),
                "at {ms} ms"
            );
            assert_eq!(w.standby.lapses_at(), None);
        }
        let now = w.t0 + Duration::from_secs(61);
        let fresh = w.observer.observe(None, now);
        assert_eq!(
            w.standby
                .observed(now, 0.0, seen(None, fresh, Some(w.published.clone())), None),
            Step::Claim(Source::Stored)
        );
    }
}
