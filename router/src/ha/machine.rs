//! The standby's decisions, sans IO (seed "HA handoff"; reference-notes 2.9; DESIGN.md 9.6):
//! poll the primary, retain its handoff, decide to claim, check what was claimed against what
//! is retained, apply it, re-check identities, and give the lease back when anything fails.
//!
//! ```text
//!  tick ──► Poll ──polled(Good)──► Retain                       (shadowing)
//!                └─polled(Miss) × takeover_after, fresh copy ──► ReadLease
//!       ──► ReadOwnState (no primary: a fenced primary retrying) ──► ReadLease
//!  ReadLease ──lease_read──► Claim(source) | Publish(Blocked(why)) | Wait (someone holds it)
//!  Claim ──claimed(epoch)──► Apply(source) | GiveBack(stale)
//!  Apply ──applied──► ValidateIdentities ──identities_checked──► Commit ──committed──► TookOver
//!                 └─ any failure ──► GiveBack(why)    (the epoch is remembered as ours)
//! ```
//!
//! Pure: `now` (monotonic) and `wall` (Unix seconds) are passed in; the driver
//! (`ha::standby`) performs each [`Step`] and feeds the result back.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use narwhal_shared::handoff::Handoff;

use crate::lease::{LeaseLoss, LeaseRecord};
use crate::phase::HaPhase;

/// What the standby follows and when it gives up on the primary.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Settings {
    /// A primary is polled (`--standby-of`); without one the router only retries the lease
    /// with its own state (a fenced primary started without `--standby-of`).
    pub(crate) primary: bool,
    /// Consecutive missed polls before a takeover is attempted.
    pub(crate) takeover_after: u32,
    /// A retained handoff older than this (by its `at`, wall clock) is not applied.
    pub(crate) max_handoff_age_s: f64,
}

/// What one poll of the primary found.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Poll {
    /// The primary answered and its document matches the live lease record.
    Good(Box<Handoff>),
    /// Anything else, with the reason (logged at debug).
    Miss(String),
}

/// The state a takeover applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The primary's document the standby retained (its epoch must be the claimed one − 1,
    /// or separated from it only by epochs this router claimed and gave back).
    Retained,
    /// This router's own state file, for a router that never controlled the fleet in this
    /// process; written under `epoch` (0: no file).
    OwnFile {
        /// The file's epoch.
        epoch: u64,
    },
    /// This process's memory: a fenced primary that controlled the fleet at `epoch`.
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
    /// Poll the primary's `/ready` and `/narwhal/handoff` and the lease record; feed
    /// [`Standby::polled`].
    Poll,
    /// A good poll: persist the retained document ([`Standby::retained`]) to the state file
    /// and publish `Shadowing`.
    Retain,
    /// Publish this phase (a blocked standby with its reason); end of the tick.
    Publish(HaPhase),
    /// Read the lease record and feed [`Standby::lease_read`] with `own`, the epoch of the
    /// state a claim would apply.
    ReadLease {
        /// The state's epoch.
        own: u64,
    },
    /// Find the own state's epoch (the fenced epoch held in memory, else the state file's;
    /// 0 without one), then read the lease record as for [`Step::ReadLease`].
    ReadOwnState,
    /// Claim the lease (starting its renewal) and feed [`Standby::claimed`].
    Claim(Source),
    /// Apply `source` under the claimed epoch, then feed [`Standby::applied`].
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
    /// The takeover completed: record `gap` (since the last good poll), publish `Active`.
    TookOver {
        /// Monotonic time since the last good poll, if any.
        gap: Option<Duration>,
    },
}

/// The reference's reason for a retained handoff older than the lease (reference-notes 2.9):
/// the document's epoch `doc` and the epoch a claim would get, `claim`.
pub(crate) fn stale_handoff(doc: u64, claim: u64) -> String {
    format!("handoff epoch {doc} cannot precede claimed epoch {claim}")
}

/// The reason a router with outdated state stays out (found by ha_e2e: a fenced primary took
/// the fleet back after the new primary died, with its pre-takeover counters and without the
/// new primary's drain of an engine, which then got traffic again).
pub(crate) fn stale_state(own: u64, newer: u64) -> String {
    format!(
        "stale state: another router controlled the fleet at epoch {newer} after this router's \
         epoch {own}; restart this router with --standby-of the current primary, or with \
         --resume from the newest state file"
    )
}

/// Whether state of epoch `own` may be applied by claiming the lease now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Own {
    /// Nobody held the lease after `own`.
    Current(u64),
    /// Another router holds a live lease: nothing to do (the reason shown stays).
    Held,
    /// Another router held epoch `newer` after the state's epoch `own`: the state is stale.
    Newer {
        /// The state's epoch.
        own: u64,
        /// The lease record's epoch.
        newer: u64,
    },
    /// The lease record is unreadable: the reason, for `/ready`.
    Unavailable(String),
}

/// Judges the lease `record` read at `now_wall` against state of epoch `own`: the record's
/// epoch (which survives expiry and release) must not exceed it.
pub(crate) fn judge_own(
    own: u64,
    record: Result<Option<LeaseRecord>, String>,
    now_wall: f64,
) -> Own {
    match record {
        Ok(Some(r)) if r.live(now_wall) && r.epoch > own => Own::Held,
        Ok(Some(r)) if r.epoch > own => Own::Newer {
            own,
            newer: r.epoch,
        },
        Ok(_) => Own::Current(own),
        Err(e) => Own::Unavailable(format!("lease unavailable: {e}")),
    }
}

/// The standby machine (see the module doc).
#[derive(Debug, Clone)]
pub(crate) struct Standby {
    settings: Settings,
    /// The epoch this router last controlled (a fenced primary), `None` if it never did.
    held: Option<u64>,
    retained: Option<Box<Handoff>>,
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
            misses: 0,
            last_good: None,
            given_back: BTreeSet::new(),
        }
    }

    /// The retained handoff, if any.
    pub(crate) fn retained(&self) -> Option<&Handoff> {
        self.retained.as_deref()
    }

    /// The epoch this router last controlled, if it did.
    pub(crate) fn held(&self) -> Option<u64> {
        self.held
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

    /// One poll interval passed.
    pub(crate) fn tick(&self) -> Step {
        if self.settings.primary {
            Step::Poll
        } else {
            Step::ReadOwnState
        }
    }

    /// The poll's result at `now` / `now_wall`.
    pub(crate) fn polled(&mut self, now: Instant, now_wall: f64, poll: Poll) -> Step {
        match poll {
            Poll::Good(h) => {
                self.misses = 0;
                self.last_good = Some(now);
                self.retained = Some(h);
                Step::Retain
            }
            Poll::Miss(_) => {
                self.misses += 1;
                if self.misses < self.settings.takeover_after {
                    return Step::Wait;
                }
                match &self.retained {
                    Some(h) if now_wall - h.at <= self.settings.max_handoff_age_s => {
                        Step::ReadLease { own: h.epoch }
                    }
                    _ => Step::Publish(HaPhase::Blocked {
                        reason: "no fresh handoff".into(),
                    }),
                }
            }
        }
    }

    /// The lease record, read at `now_wall`, judged against state of epoch `own`. Checked
    /// before claiming: a copy older than the lease is never applied, and a claim that would
    /// be given back at once is not made (no epoch churn while retrying).
    pub(crate) fn lease_read(
        &mut self,
        own: u64,
        record: Result<Option<LeaseRecord>, String>,
        now_wall: f64,
    ) -> Step {
        let blocked = |reason| Step::Publish(HaPhase::Blocked { reason });
        match judge_own(own, record, now_wall) {
            Own::Current(epoch) => Step::Claim(if self.settings.primary {
                Source::Retained
            } else if self.held.is_some() {
                Source::Memory { epoch }
            } else {
                Source::OwnFile { epoch }
            }),
            Own::Held => Step::Wait,
            Own::Newer { own, newer } if self.settings.primary => {
                blocked(stale_handoff(own, newer + 1))
            }
            Own::Newer { own, newer } => blocked(stale_state(own, newer)),
            Own::Unavailable(why) => blocked(why),
        }
    }

    fn give_back(&mut self, epoch: u64, why: String, announce: bool) -> Step {
        // Remember the epoch: it was ours and nobody served under it, so it does not make
        // the retained handoff stale on the next attempt (etcd advances the epoch on every
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
            // The primary's lease is still valid: never take over then.
            Err(LeaseLoss::HeldByAnother) => return Step::Wait,
            Err(e) => {
                return Step::Publish(HaPhase::Blocked {
                    reason: e.to_string(),
                });
            }
        };
        match source {
            Source::Retained => {
                let Some(doc) = self.retained.as_ref().map(|h| h.epoch) else {
                    return self.give_back(epoch, "no fresh handoff".into(), false);
                };
                let only_ours_between = (doc + 1..epoch).all(|e| self.given_back.contains(&e));
                if doc != 0 && doc + 1 != epoch && !only_ours_between {
                    return self.give_back(epoch, stale_handoff(doc, epoch), false);
                }
            }
            // Another router claimed in between the check and our claim. Getting our own
            // epoch back (our record was still live: a renewal failed transiently) is no
            // change of holder: the claim keeps the epoch only for this process's own holder
            // token.
            Source::OwnFile { epoch: own } | Source::Memory { epoch: own }
                if own + 1 != epoch && !(own > 0 && own == epoch) =>
            {
                return self.give_back(epoch, stale_state(own, epoch - 1), false);
            }
            Source::OwnFile { .. } | Source::Memory { .. } => {}
        }
        Step::Apply(source)
    }

    /// Applying the source under `epoch` finished (`Err`: the reason it was refused);
    /// `lease_active` is the lease's local validity now.
    pub(crate) fn applied(
        &mut self,
        epoch: u64,
        result: Result<(), String>,
        lease_active: bool,
    ) -> Step {
        match result {
            Err(why) => self.give_back(epoch, why, false),
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
    use narwhal_shared::{Clock as _, SystemClock};
    use std::collections::BTreeMap;

    fn settings(primary: bool) -> Settings {
        Settings {
            primary,
            takeover_after: 3,
            max_handoff_age_s: 30.0,
        }
    }

    pub(crate) fn doc(epoch: u64, at: f64) -> Box<Handoff> {
        Box::new(Handoff {
            schema: narwhal_shared::handoff::HANDOFF_SCHEMA.into(),
            schema_version: narwhal_shared::handoff::HANDOFF_VERSION,
            at,
            run: "1-aa".into(),
            model: "m".into(),
            epoch,
            holder: "primary:0".into(),
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

    fn record(epoch: u64, expires_at: f64) -> LeaseRecord {
        LeaseRecord {
            epoch,
            expires_at,
            holder: "other:0".into(),
            schema: crate::lease::LEASE_SCHEMA.into(),
            schema_version: 1,
            updated_at: expires_at - 2.0,
        }
    }

    fn miss() -> Poll {
        Poll::Miss("connection refused".into())
    }

    /// A warm standby, step by step: it shadows while the primary answers, claims only
    /// after `takeover_after` misses with a fresh copy and a lapsed lease, applies the copy,
    /// re-checks identities, commits, and reports the gap since the last good poll.
    #[test]
    fn a_warm_standby_takes_over_after_consecutive_misses() {
        let t0 = SystemClock.now();
        let mut s = Standby::new(settings(true), None);
        assert_eq!(s.tick(), Step::Poll);
        assert_eq!(
            s.polled(t0, 1000.0, Poll::Good(doc(4, 1000.0))),
            Step::Retain
        );
        assert_eq!(s.retained().map(|h| h.epoch), Some(4));
        assert_eq!(s.polled(t0, 1000.5, miss()), Step::Wait);
        assert_eq!(s.polled(t0, 1000.75, miss()), Step::Wait);
        assert_eq!(
            s.polled(t0, 1001.0, miss()),
            Step::ReadLease { own: 4 },
            "the third consecutive miss"
        );
        assert_eq!(
            s.lease_read(4, Ok(Some(record(4, 1002.0))), 1001.0),
            Step::Claim(Source::Retained),
            "our primary's own record is not someone newer"
        );
        assert_eq!(
            s.claimed(Source::Retained, Ok(5)),
            Step::Apply(Source::Retained)
        );
        assert_eq!(s.applied(5, Ok(()), true), Step::ValidateIdentities);
        assert_eq!(s.identities_checked(5, true, true), Step::Commit);
        let later = t0 + Duration::from_millis(2500);
        assert_eq!(
            s.committed(5, later, true),
            Step::TookOver {
                gap: Some(Duration::from_millis(2500))
            }
        );
        assert_eq!(s.held(), Some(5));
    }

    /// A good poll resets the miss count; a stale copy is never claimed.
    #[test]
    fn misses_must_be_consecutive_and_the_copy_fresh() {
        let t0 = SystemClock.now();
        let mut s = Standby::new(settings(true), None);
        assert_eq!(s.polled(t0, 1000.0, miss()), Step::Wait);
        assert_eq!(s.polled(t0, 1000.0, miss()), Step::Wait);
        assert_eq!(
            s.polled(t0, 1000.0, miss()),
            Step::Publish(HaPhase::Blocked {
                reason: "no fresh handoff".into()
            }),
            "nothing retained"
        );
        assert_eq!(
            s.polled(t0, 1000.0, Poll::Good(doc(1, 1000.0))),
            Step::Retain
        );
        assert_eq!(s.polled(t0, 1000.0, miss()), Step::Wait, "count restarted");
        assert_eq!(s.polled(t0, 1000.0, miss()), Step::Wait);
        assert_eq!(
            s.polled(t0, 1031.0, miss()),
            Step::Publish(HaPhase::Blocked {
                reason: "no fresh handoff".into()
            }),
            "31 s old"
        );
    }

    /// The lease decides: a live holder means wait, a newer epoch means the copy is stale,
    /// an unreadable store is shown.
    #[test]
    fn the_lease_record_gates_the_claim() {
        let mut s = Standby::new(settings(true), None);
        assert_eq!(
            s.lease_read(4, Ok(Some(record(5, 1002.0))), 1001.0),
            Step::Wait
        );
        assert_eq!(
            s.lease_read(4, Ok(Some(record(5, 1000.0))), 1001.0),
            Step::Publish(HaPhase::Blocked {
                reason: stale_handoff(4, 6)
            })
        );
        assert_eq!(
            s.lease_read(4, Err("etcd get timed out".into()), 1001.0),
            Step::Publish(HaPhase::Blocked {
                reason: "lease unavailable: etcd get timed out".into()
            })
        );
        assert_eq!(
            s.lease_read(0, Ok(None), 1001.0),
            Step::Claim(Source::Retained),
            "no record at all"
        );
    }

    /// Found by ha_e2e: a fenced primary without `--standby-of` took the fleet back with its
    /// pre-takeover state once the router that replaced it died. It may only when nobody held
    /// the lease after its own epoch.
    #[test]
    fn a_router_without_a_peer_takes_back_only_its_own_latest_epoch() {
        let now = 1000.0;
        // Its own lease lapsed, nobody else claimed: it may claim epoch 8.
        assert_eq!(
            judge_own(7, Ok(Some(record(7, now - 1.0))), now),
            Own::Current(7)
        );
        // No record at all (fresh fleet, nothing written yet).
        assert_eq!(judge_own(0, Ok(None), now), Own::Current(0));
        // Another router holds a live lease: wait, keeping the fence reason.
        assert_eq!(judge_own(7, Ok(Some(record(8, now + 1.0))), now), Own::Held);
        // Another router held epoch 8 and is gone: this state is stale.
        assert_eq!(
            judge_own(7, Ok(Some(record(8, now - 1.0))), now),
            Own::Newer { own: 7, newer: 8 }
        );
        let why = stale_state(7, 8);
        assert!(why.starts_with("stale state:"), "{why}");
        assert!(why.contains("epoch 8 after this router's epoch 7"), "{why}");
        assert_eq!(
            stale_handoff(7, 9),
            "handoff epoch 7 cannot precede claimed epoch 9"
        );
        let Own::Unavailable(why) = judge_own(7, Err("lease config: test".into()), now) else {
            panic!("an unreadable lease refuses");
        };
        assert!(why.starts_with("lease unavailable:"), "{why}");
        // The machine: a fenced primary claims from memory, a fresh one from its file.
        let mut fenced = Standby::new(settings(false), Some(7));
        assert_eq!(fenced.tick(), Step::ReadOwnState);
        assert_eq!(
            fenced.lease_read(7, Ok(Some(record(7, now - 1.0))), now),
            Step::Claim(Source::Memory { epoch: 7 })
        );
        let mut fresh = Standby::new(settings(false), None);
        assert_eq!(
            fresh.lease_read(0, Ok(None), now),
            Step::Claim(Source::OwnFile { epoch: 0 })
        );
        assert_eq!(
            fresh.lease_read(7, Ok(Some(record(8, now - 1.0))), now),
            Step::Publish(HaPhase::Blocked {
                reason: stale_state(7, 8)
            })
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

    /// A fenced primary whose renewal failed while its record was still live gets its own
    /// epoch back: no change of holder. Claiming after someone else held the fleet is
    /// given back.
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
            s.applied(5, Err("handoff rejected: model".into()), true),
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
}
