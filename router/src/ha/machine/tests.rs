//! Transition-by-transition tests of the standby machine, on a manual clock.

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
    let Step::GiveBack { epoch, why, .. } = s.claimed(Source::OwnFile { epoch: 0 }, Ok(2)) else {
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
