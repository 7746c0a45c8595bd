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
pub(crate) mod tests;
