//! The router lease core: who controls the fleet, under which epoch, until when
//! (handoff-and-lifecycle.md, "HA handoff"; behaviour.md 3; architecture.md section 7).
//!
//! Pure: the backends (file, etcd) read and write [`LeaseRecord`]s; this core decides what to
//! write and whether the router still holds a valid lease. Validity runs from the monotonic
//! instant taken *before* the write that granted it, minus a safety margin, so a slow write
//! can only shorten what the router believes, never lengthen it.
//!
//! Clocks (ha-and-fencing.md 2.4): a record's `expires_at` and `updated_at` are written from
//! its holder's wall clock and are never compared with another router's wall clock. The
//! holder judges its own tenure by its monotonic local validity only. Another holder's record
//! is judged by what this router observed of it ([`Observer`]), on this router's own monotonic
//! clock: with the file backend it is live until it has stayed unchanged for its own duration
//! (`expires_at − updated_at`, the holder's ttl: a difference of two readings of one clock, so
//! free of skew) since this router first saw that version, as Kubernetes' leader election
//! times a leader by the observed time of record changes; with etcd a present record is live,
//! because etcd deletes a lapsed one itself (its server's lease clock). A record whose
//! `expires_at <= updated_at` was released by its holder and is free at once.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// `schema` of the lease record.
pub const LEASE_SCHEMA: &str = "narwhal.router-lease";

/// The lease record a backend stores (schema `narwhal.router-lease` version 1;
/// behaviour.md 3.2). Times are wall-clock Unix seconds of the holder's clock: only their
/// difference (the holder's ttl) and whether they changed mean anything to another router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRecord {
    /// Fencing epoch, ≥ 1; advances on every change of holder.
    pub epoch: u64,
    /// `updated_at` plus the holder's ttl (the holder's wall clock); `<= updated_at` when the
    /// holder released the lease.
    pub expires_at: f64,
    /// Holder token: `<router-id>:<32 hex>`, unique per process.
    pub holder: String,
    /// Always [`LEASE_SCHEMA`].
    pub schema: String,
    /// Always 1.
    pub schema_version: u32,
    /// Last write.
    pub updated_at: f64,
}

impl LeaseRecord {
    fn new(epoch: u64, holder: &str, now_wall: f64, ttl: Duration) -> Self {
        LeaseRecord {
            epoch,
            expires_at: now_wall + ttl.as_secs_f64(),
            holder: holder.to_string(),
            schema: LEASE_SCHEMA.to_string(),
            schema_version: 1,
            updated_at: now_wall,
        }
    }

    /// Checks the schema fields and value ranges.
    ///
    /// # Errors
    /// [`RecordError`] naming the first field that breaks its rule.
    pub fn validate(&self) -> Result<(), RecordError> {
        if self.schema != LEASE_SCHEMA {
            return Err(RecordError::Schema);
        }
        if self.schema_version != 1 {
            return Err(RecordError::SchemaVersion);
        }
        if self.epoch == 0 {
            return Err(RecordError::Epoch);
        }
        if self.holder.is_empty() {
            return Err(RecordError::Holder);
        }
        if !self.expires_at.is_finite() || !self.updated_at.is_finite() {
            return Err(RecordError::Times);
        }
        Ok(())
    }

    /// Its holder gave it up (`expires_at <= updated_at`, as [`Lease::release`] writes it, or
    /// the etcd backend's view of a vanished record): free to claim at once.
    pub fn released(&self) -> bool {
        self.expires_at <= self.updated_at
    }

    /// How long it lives unchanged: `expires_at − updated_at`, the holder's ttl (two readings
    /// of the holder's one clock, so free of any skew between routers); `None` when released.
    /// A duration too long to represent is [`Duration::MAX`].
    pub fn duration(&self) -> Option<Duration> {
        if self.released() {
            return None;
        }
        Some(
            Duration::try_from_secs_f64(self.expires_at - self.updated_at).unwrap_or(Duration::MAX),
        )
    }

    /// The same version as `other`: same epoch, holder, `updated_at` and `expires_at` (every
    /// write by a holder changes at least one of them, [`Lease::renew`]).
    pub fn same_version(&self, other: &LeaseRecord) -> bool {
        self.epoch == other.epoch
            && self.holder == other.holder
            && self.updated_at == other.updated_at
            && self.expires_at == other.expires_at
    }

    /// This record as a new version of `current`: when a holder's wall clock did not move (or
    /// stepped back onto the same reading) a rewrite would be indistinguishable from the record
    /// it replaces, and an observer would time a renewing holder as one that stopped. Then
    /// `updated_at` moves to the next representable value (and `expires_at` with it).
    fn distinct_from(mut self, current: Option<&LeaseRecord>) -> Self {
        if let Some(c) = current
            && self.same_version(c)
        {
            let ttl = self.expires_at - self.updated_at;
            self.updated_at = self.updated_at.next_up();
            self.expires_at = self.updated_at + ttl;
        }
        self
    }
}

/// How this router decides that another holder's record lapsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// By observation (the `file` backend): a record lapses once it has stayed unchanged for
    /// its own duration ([`LeaseRecord::duration`]) on this router's monotonic clock, from
    /// this router's first sight of that version. Assumes the routers' monotonic clocks run at
    /// about the same rate (the safety margin absorbs the drift); wall clocks may differ by
    /// any amount.
    Observed,
    /// By the store (the `etcd` backend): the store deletes a lapsed record itself (etcd's
    /// server-side lease, timed by the etcd server's clock), so a present record is live
    /// unless released.
    Store,
}

/// How long a record read from the store counts as live for this router ([`Observer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// No record, or one its holder released: free now.
    Free,
    /// Live until this instant of this router's monotonic clock (first sight of this version
    /// plus its duration), lapsed from then on.
    Until(Instant),
    /// Live as long as it is present (the store removes a lapsed record: [`Expiry::Store`]).
    WhilePresent,
}

impl Freshness {
    /// Still live at monotonic `now`.
    pub fn live(self, now: Instant) -> bool {
        match self {
            Freshness::Free => false,
            Freshness::Until(until) => now < until,
            Freshness::WhilePresent => true,
        }
    }

    /// The instant it lapses by itself, if it does (a standby wakes then).
    pub fn until(self) -> Option<Instant> {
        match self {
            Freshness::Until(until) => Some(until),
            Freshness::Free | Freshness::WhilePresent => None,
        }
    }
}

/// What this router saw of the store's record, timed on its own monotonic clock: the version
/// last seen and when it was first seen. Fed by every read of the store the driver does (and
/// by its own writes), so a router that has been polling knows, when it claims, how long the
/// current version has been unchanged. Pure: instants are passed in.
#[derive(Debug, Clone)]
pub struct Observer {
    expiry: Expiry,
    seen: Option<(LeaseRecord, Instant)>,
}

impl Observer {
    /// An observer that saw nothing yet.
    pub fn new(expiry: Expiry) -> Self {
        Observer { expiry, seen: None }
    }

    /// How it decides that a record lapsed.
    pub fn expiry(&self) -> Expiry {
        self.expiry
    }

    /// When the version last seen was first seen, if any.
    pub fn first_seen(&self) -> Option<Instant> {
        self.seen.as_ref().map(|(_, at)| *at)
    }

    /// How `record` stands if read at `now`, recording nothing: a version seen before counts
    /// from its first sight, any other from `now`; a released one is free; with
    /// [`Expiry::Store`] a present one is live while present.
    pub fn judge(&self, record: Option<&LeaseRecord>, now: Instant) -> Freshness {
        let Some(r) = record else {
            return Freshness::Free;
        };
        let Some(duration) = r.duration() else {
            return Freshness::Free;
        };
        match self.expiry {
            Expiry::Store => Freshness::WhilePresent,
            Expiry::Observed => {
                let since = match &self.seen {
                    Some((v, at)) if v.same_version(r) => *at,
                    _ => now,
                };
                since
                    .checked_add(duration)
                    .map_or(Freshness::WhilePresent, Freshness::Until)
            }
        }
    }

    /// The store held `record` at `now` (an instant read *after* the read completed, so the
    /// first sight of a version is never earlier than its write): a new version is first seen
    /// now, a known one keeps its first sight. Returns [`Observer::judge`].
    pub fn observe(&mut self, record: Option<&LeaseRecord>, now: Instant) -> Freshness {
        match record {
            None => self.seen = None,
            Some(r) => {
                if !self.seen.as_ref().is_some_and(|(v, _)| v.same_version(r)) {
                    self.seen = Some((r.clone(), now));
                }
            }
        }
        self.judge(record, now)
    }

    /// This router wrote `record` from `started` (the instant before the write): it has known
    /// that version since then.
    pub fn wrote(&mut self, record: &LeaseRecord, started: Instant) {
        self.seen = Some((record.clone(), started));
    }
}

/// Which schema rule a [`LeaseRecord`] breaks ([`LeaseRecord::validate`]); each names the
/// field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// `schema` is not [`LEASE_SCHEMA`].
    #[error("schema: must be {LEASE_SCHEMA:?}")]
    Schema,
    /// `schema_version` is not 1.
    #[error("schema_version: must be 1")]
    SchemaVersion,
    /// `epoch` is 0.
    #[error("epoch: must be >= 1")]
    Epoch,
    /// `holder` is empty.
    #[error("holder: must not be empty")]
    Holder,
    /// `expires_at` or `updated_at` is NaN or infinite.
    #[error("expires_at/updated_at: must be finite")]
    Times,
}

/// Lease timing (fleet `lease` section).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaseTiming {
    /// Lease duration written into each record.
    pub ttl: Duration,
    /// How often the holder renews.
    pub renew_interval: Duration,
    /// Subtracted from local validity to absorb clock drift and slow writes.
    pub safety_margin: Duration,
}

impl LeaseTiming {
    /// `ttl > renew_interval + safety_margin`, `renew_interval > 0`.
    ///
    /// # Errors
    /// [`TimingError`] naming the keys, as the config loader reports it.
    pub fn validate(&self) -> Result<(), TimingError> {
        if self.renew_interval.is_zero() {
            return Err(TimingError::ZeroRenewInterval);
        }
        let min = self.renew_interval + self.safety_margin;
        if self.ttl <= min {
            return Err(TimingError::TtlTooShort { ttl: self.ttl, min });
        }
        Ok(())
    }
}

/// Which timing rule a [`LeaseTiming`] breaks ([`LeaseTiming::validate`]); each names the
/// fleet-file keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    /// `renew_interval` is zero.
    #[error("lease.renew_interval_s must be > 0")]
    ZeroRenewInterval,
    /// `ttl` does not exceed `renew_interval + safety_margin`.
    #[error(
        "lease.ttl_s ({}) must exceed renew_interval_s + safety_margin_s ({})",
        .ttl.as_secs_f64(),
        .min.as_secs_f64()
    )]
    TtlTooShort {
        /// The lease duration.
        ttl: Duration,
        /// `renew_interval + safety_margin`.
        min: Duration,
    },
}

/// What a claim attempt decided after reading the current record.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// Write this record: the lease is ours at its epoch.
    Write(LeaseRecord),
    /// Another router holds a live lease (as this router observes it: [`Observer`]).
    HeldBy {
        /// Its holder token.
        holder: String,
        /// Its epoch.
        epoch: u64,
        /// Its `expires_at` (the holder's wall seconds: for logs, never compared here).
        expires_at: f64,
        /// Its `updated_at` (the holder's wall seconds), so the driver can record the version
        /// it read.
        updated_at: f64,
    },
}

impl Claim {
    /// The record a [`Claim::HeldBy`] was decided on (its version, for the [`Observer`]).
    pub fn held_record(&self) -> Option<LeaseRecord> {
        match self {
            Claim::Write(_) => None,
            Claim::HeldBy {
                holder,
                epoch,
                expires_at,
                updated_at,
            } => Some(LeaseRecord {
                epoch: *epoch,
                expires_at: *expires_at,
                holder: holder.clone(),
                schema: LEASE_SCHEMA.to_string(),
                schema_version: 1,
                updated_at: *updated_at,
            }),
        }
    }
}

/// Why the router lost (or never had) control; shown in `/ready.reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseLoss {
    /// The record shows another holder or epoch.
    #[error("lease held by another router")]
    HeldByAnother,
    /// The record is gone or expired.
    #[error("lease renewal failed")]
    Lapsed,
    /// The backend could not be read or written.
    #[error("lease unavailable: {0}")]
    Unavailable(String),
    /// A write this router sent was not confirmed (the answer timed out or the connection
    /// broke after the request left; a file's directory fsync failed after the rename): the
    /// store may hold it. A lifecycle action whose publish ends so is answered 503 saying its
    /// outcome is unknown (docs/ha.md, "An acknowledged lifecycle action survives failover").
    #[error("lease store did not confirm the write, which may have landed: {0}")]
    Unconfirmed(String),
}

/// Whether this router drives the fleet (`router.controls_fleet`, architecture.md 9.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Holds a valid lease (or runs without fencing).
    Active,
    /// A warm standby that never held the lease in this role.
    Standby,
    /// Lost the lease; retrying to return as a standby.
    Fenced,
}

impl Control {
    /// The document spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Control::Active => "active",
            Control::Standby => "standby",
            Control::Fenced => "fenced",
        }
    }
}

/// The lease as this router sees it.
#[derive(Debug, Clone)]
pub struct Lease {
    holder: String,
    timing: LeaseTiming,
    owned: Option<(u64, Instant)>,
    fenced: Option<LeaseLoss>,
    observer: Observer,
}

impl Lease {
    /// A lease core for holder token `holder` that owns nothing yet, judging other holders'
    /// records by observation ([`Expiry::Observed`]; [`Lease::with_expiry`] changes it).
    pub fn new(holder: String, timing: LeaseTiming) -> Self {
        Lease {
            holder,
            timing,
            owned: None,
            fenced: None,
            observer: Observer::new(Expiry::Observed),
        }
    }

    /// The same core judging records by `expiry` (keeps what was observed).
    #[must_use]
    pub fn with_expiry(mut self, expiry: Expiry) -> Self {
        self.observer.expiry = expiry;
        self
    }

    /// This process's holder token.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// What this router observed of the store's record.
    pub fn observer(&self) -> &Observer {
        &self.observer
    }

    /// The store held `record` at `now` (read after the read completed): recorded in the
    /// [`Observer`]; returns how it stands.
    pub fn observe(&mut self, record: Option<&LeaseRecord>, now: Instant) -> Freshness {
        self.observer.observe(record, now)
    }

    /// This router wrote `record` from `started` (the instant taken before the write).
    pub fn wrote(&mut self, record: &LeaseRecord, started: Instant) {
        self.observer.wrote(record, started);
    }

    /// How `record` stands for this router at `now` ([`Observer::judge`]).
    pub fn freshness(&self, record: Option<&LeaseRecord>, now: Instant) -> Freshness {
        self.observer.judge(record, now)
    }

    /// The epoch held, if any.
    pub fn epoch(&self) -> Option<u64> {
        self.owned.map(|(e, _)| e)
    }

    /// Owned and still locally valid at `now`.
    pub fn is_valid(&self, now: Instant) -> bool {
        self.owned.is_some_and(|(_, until)| now < until)
    }

    /// When local validity lapses, for the renew driver's deadline.
    pub fn valid_until(&self) -> Option<Instant> {
        self.owned.map(|(_, until)| until)
    }

    /// Why control was lost, if it was.
    pub fn loss(&self) -> Option<&LeaseLoss> {
        self.fenced.as_ref()
    }

    /// `Active` while valid; `Fenced` once a held lease lapsed or was lost; else `Standby`.
    pub fn control(&self, now: Instant) -> Control {
        if self.is_valid(now) {
            Control::Active
        } else if self.fenced.is_some() || self.owned.is_some() {
            Control::Fenced
        } else {
            Control::Standby
        }
    }

    /// Decides a claim against the `current` record read under the backend's lock at
    /// monotonic `now` (the instant taken before the claim began) and wall `now_wall` (only
    /// written into the record; behaviour.md 3.3): another holder's record that is live as
    /// this router observes it ([`Lease::freshness`]) wins; our own live record keeps its
    /// epoch; an absent, released or lapsed one is taken at epoch + 1.
    pub fn claim(&self, current: Option<&LeaseRecord>, now: Instant, now_wall: f64) -> Claim {
        let live = self.freshness(current, now).live(now);
        let epoch = match current {
            Some(r) if live && r.holder != self.holder => {
                return Claim::HeldBy {
                    holder: r.holder.clone(),
                    epoch: r.epoch,
                    expires_at: r.expires_at,
                    updated_at: r.updated_at,
                };
            }
            Some(r) if live => r.epoch,
            Some(r) => r.epoch + 1,
            None => 1,
        };
        Claim::Write(
            LeaseRecord::new(epoch, &self.holder, now_wall, self.timing.ttl).distinct_from(current),
        )
    }

    /// The backend wrote `epoch` for us; `started` is the monotonic instant taken before the
    /// read-decide-write began.
    pub fn granted(&mut self, epoch: u64, started: Instant) {
        let until = started + self.timing.ttl.saturating_sub(self.timing.safety_margin);
        self.owned = Some((epoch, until));
        self.fenced = None;
    }

    /// Decides a renewal against `current` at monotonic `now` (the instant taken before the
    /// renewal began): the record must still be ours at our epoch (not released) and our
    /// local validity must not have lapsed; otherwise the router is fenced at once. The
    /// record's own times are never compared with a clock, so a step of this router's wall
    /// clock (forward or back, past the ttl) changes nothing; `now_wall` is only written. The
    /// new record always differs from `current` ([`LeaseRecord::same_version`]).
    ///
    /// # Errors
    /// The [`LeaseLoss`]; the core is fenced when it returns.
    pub fn renew(
        &mut self,
        current: Option<&LeaseRecord>,
        now: Instant,
        now_wall: f64,
    ) -> Result<LeaseRecord, LeaseLoss> {
        let Some((epoch, until)) = self.owned else {
            return Err(LeaseLoss::Lapsed);
        };
        let loss = match current {
            None => Some(LeaseLoss::Lapsed),
            Some(r) if r.holder != self.holder || r.epoch != epoch => {
                Some(LeaseLoss::HeldByAnother)
            }
            Some(r) if r.released() || now >= until => Some(LeaseLoss::Lapsed),
            Some(_) => None,
        };
        if let Some(loss) = loss {
            self.fence(loss.clone());
            return Err(loss);
        }
        Ok(LeaseRecord::new(epoch, &self.holder, now_wall, self.timing.ttl).distinct_from(current))
    }

    /// Decides whether this router may publish its handoff next to `current` (read under the
    /// backend's lock) at monotonic `now`: the record must be ours at our epoch (not released)
    /// and our local validity must hold, as for a renewal, so a document published under epoch
    /// E is always the newest state of E and can never land after a successor's claim
    /// (ha-and-fencing.md 5: an acknowledged lifecycle action is durable where the successor
    /// reads). Nothing is fenced here: the driver does.
    ///
    /// # Errors
    /// The [`LeaseLoss`]: nothing owned, a lapsed validity or a released record
    /// ([`LeaseLoss::Lapsed`]), another holder or epoch ([`LeaseLoss::HeldByAnother`]).
    pub fn may_publish(
        &self,
        current: Option<&LeaseRecord>,
        now: Instant,
    ) -> Result<u64, LeaseLoss> {
        let Some((epoch, until)) = self.owned else {
            return Err(self.fenced.clone().unwrap_or(LeaseLoss::Lapsed));
        };
        match current {
            None => Err(LeaseLoss::Lapsed),
            Some(r) if r.holder != self.holder || r.epoch != epoch => Err(LeaseLoss::HeldByAnother),
            Some(r) if r.released() || now >= until => Err(LeaseLoss::Lapsed),
            Some(_) => Ok(epoch),
        }
    }

    /// Gives up control now (failed renewal, backend error past validity).
    pub fn fence(&mut self, why: LeaseLoss) {
        self.owned = None;
        self.fenced = Some(why);
    }

    /// The record to write when releasing at shutdown: ours, released now (`expires_at =
    /// updated_at`), same epoch; `None` when the record is no longer ours.
    pub fn release(&mut self, current: Option<&LeaseRecord>, now_wall: f64) -> Option<LeaseRecord> {
        let (epoch, _) = self.owned.take()?;
        let r = current?;
        if r.holder != self.holder || r.epoch != epoch {
            return None;
        }
        let mut out = LeaseRecord::new(epoch, &self.holder, now_wall, Duration::ZERO);
        out.expires_at = now_wall;
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use narwhal_shared::{Clock as _, SystemClock};

    fn timing() -> LeaseTiming {
        LeaseTiming {
            ttl: Duration::from_secs(2),
            renew_interval: Duration::from_millis(500),
            safety_margin: Duration::from_millis(500),
        }
    }

    #[test]
    fn timing_rule_names_the_keys() {
        let mut t = timing();
        assert!(t.validate().is_ok());
        t.ttl = Duration::from_secs(1);
        assert_eq!(
            t.validate().unwrap_err().to_string(),
            "lease.ttl_s (1) must exceed renew_interval_s + safety_margin_s (1)"
        );
        t.renew_interval = Duration::ZERO;
        assert_eq!(
            t.validate().unwrap_err().to_string(),
            "lease.renew_interval_s must be > 0"
        );
    }

    #[test]
    fn record_rules_name_the_field() {
        assert_eq!(
            RecordError::Schema.to_string(),
            "schema: must be \"narwhal.router-lease\""
        );
        assert_eq!(
            RecordError::Times.to_string(),
            "expires_at/updated_at: must be finite"
        );
    }

    const S: Duration = Duration::from_secs(1);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn first_claim_is_epoch_one_and_valid_until_ttl_minus_margin() {
        let t0 = SystemClock.now();
        let mut a = Lease::new("a:1".into(), timing());
        assert_eq!(a.control(t0), Control::Standby);
        let Claim::Write(rec) = a.claim(None, t0, 100.0) else {
            panic!()
        };
        assert_eq!(
            (rec.epoch, rec.expires_at, rec.updated_at),
            (1, 102.0, 100.0)
        );
        assert!(rec.validate().is_ok());
        a.granted(rec.epoch, t0);
        assert!(a.is_valid(t0 + Duration::from_millis(1499)));
        assert!(!a.is_valid(t0 + Duration::from_millis(1500)));
        assert_eq!(a.control(t0), Control::Active);
        assert_eq!(a.control(t0 + Duration::from_secs(2)), Control::Fenced);
    }

    #[test]
    fn unexpired_lease_of_another_holder_is_never_taken() {
        let t0 = SystemClock.now();
        let mut b = Lease::new("b:2".into(), timing());
        let held = LeaseRecord::new(3, "a:1", 100.0, Duration::from_secs(2));
        // B first sees A's record at t0; it lapses once unchanged for its 2 s since then.
        b.observe(Some(&held), t0);
        assert!(matches!(
            b.claim(Some(&held), t0 + ms(1900), 101.9),
            Claim::HeldBy { epoch: 3, .. }
        ));
        let Claim::Write(rec) = b.claim(Some(&held), t0 + 2 * S, 102.0) else {
            panic!()
        };
        assert_eq!(rec.epoch, 4, "takeover advances the epoch");
        assert_eq!(rec.holder, "b:2");
    }

    #[test]
    fn reclaim_by_the_same_holder_keeps_its_epoch() {
        let a = Lease::new("a:1".into(), timing());
        let mine = LeaseRecord::new(5, "a:1", 100.0, Duration::from_secs(2));
        let Claim::Write(rec) = a.claim(Some(&mine), SystemClock.now(), 101.0) else {
            panic!()
        };
        assert_eq!(rec.epoch, 5);
    }

    #[test]
    fn renewal_fences_on_another_holder_or_a_lapsed_record() {
        let t0 = SystemClock.now();
        let mut a = Lease::new("a:1".into(), timing());
        a.granted(1, t0);
        let ours = LeaseRecord::new(1, "a:1", 100.0, Duration::from_secs(2));
        let next = a.renew(Some(&ours), t0, 100.5).unwrap();
        assert_eq!(next.expires_at, 102.5);
        let theirs = LeaseRecord::new(2, "b:2", 100.6, Duration::from_secs(2));
        assert_eq!(
            a.renew(Some(&theirs), t0, 100.7),
            Err(LeaseLoss::HeldByAnother)
        );
        assert_eq!(a.control(t0), Control::Fenced);
        assert_eq!(
            a.loss().unwrap().to_string(),
            "lease held by another router"
        );
        // A fenced router that claims again (as a standby would) becomes active again.
        a.granted(3, t0);
        assert_eq!(a.control(t0), Control::Active);
        let mut b = Lease::new("b:2".into(), timing());
        b.granted(2, t0);
        assert_eq!(b.renew(None, t0, 101.0), Err(LeaseLoss::Lapsed));
        let mut c = Lease::new("c:3".into(), timing());
        c.granted(4, t0);
        let old = LeaseRecord::new(4, "c:3", 90.0, Duration::from_secs(2));
        // Lapsed: its local validity (ttl − margin from the grant) is over.
        assert_eq!(
            c.renew(Some(&old), t0 + ms(1500), 101.0),
            Err(LeaseLoss::Lapsed)
        );
    }

    #[test]
    fn only_the_live_holder_may_publish() {
        let t0 = SystemClock.now();
        let mut a = Lease::new("a:1".into(), timing());
        let ours = LeaseRecord::new(1, "a:1", 100.0, Duration::from_secs(2));
        assert_eq!(
            a.may_publish(Some(&ours), t0),
            Err(LeaseLoss::Lapsed),
            "nothing owned"
        );
        a.granted(1, t0);
        assert_eq!(a.may_publish(Some(&ours), t0), Ok(1));
        assert_eq!(
            a.may_publish(Some(&ours), t0 + ms(1500)),
            Err(LeaseLoss::Lapsed),
            "expired"
        );
        assert_eq!(a.may_publish(None, t0), Err(LeaseLoss::Lapsed), "vanished");
        let theirs = LeaseRecord::new(2, "b:2", 100.0, Duration::from_secs(2));
        assert_eq!(
            a.may_publish(Some(&theirs), t0),
            Err(LeaseLoss::HeldByAnother)
        );
        let old_epoch = LeaseRecord::new(2, "a:1", 100.0, Duration::from_secs(2));
        assert_eq!(
            a.may_publish(Some(&old_epoch), t0),
            Err(LeaseLoss::HeldByAnother)
        );
        a.fence(LeaseLoss::HeldByAnother);
        assert_eq!(
            a.may_publish(Some(&ours), t0),
            Err(LeaseLoss::HeldByAnother),
            "fenced"
        );
    }

    #[test]
    fn release_expires_only_our_own_record() {
        let t0 = SystemClock.now();
        let mut a = Lease::new("a:1".into(), timing());
        a.granted(1, t0);
        let ours = LeaseRecord::new(1, "a:1", 100.0, Duration::from_secs(2));
        let r = a.release(Some(&ours), 100.5).unwrap();
        assert_eq!((r.epoch, r.expires_at), (1, 100.5));
        assert!(r.released());
        let mut b = Lease::new("b:2".into(), timing());
        b.granted(1, t0);
        assert!(b.release(Some(&ours), 100.5).is_none());
    }

    /// Two routers on one store, step by step on a simulated monotonic clock shared by both
    /// (the same rate), each with its own wall clock: `a` holds and renews every 0.5 s, `b`
    /// observes every 0.25 s and tries to claim at every observation.
    struct Pair {
        t0: Instant,
        a: Lease,
        b: Lease,
        record: LeaseRecord,
    }

    impl Pair {
        /// `a` claims the free lease at t0 (wall 1000), `b` has seen nothing yet.
        fn new() -> Pair {
            let t0 = SystemClock.now();
            let mut a = Lease::new("a:1".into(), timing());
            let Claim::Write(record) = a.claim(None, t0, 1000.0) else {
                panic!("a free lease")
            };
            a.granted(record.epoch, t0);
            a.wrote(&record, t0);
            Pair {
                t0,
                a,
                b: Lease::new("b:2".into(), timing()),
                record,
            }
        }

        /// `a` renews at `t` (ms after t0) with its wall clock reading `wall`.
        fn renew(&mut self, t: u64, wall: f64) -> Result<(), LeaseLoss> {
            let now = self.t0 + ms(t);
            let rec = self.a.renew(Some(&self.record), now, wall)?;
            self.a.granted(rec.epoch, now);
            self.a.wrote(&rec, now);
            self.record = rec;
            Ok(())
        }

        /// `b` reads the store and claims at `t` with its wall clock reading `wall`.
        fn b_claims(&mut self, t: u64, wall: f64) -> Claim {
            let now = self.t0 + ms(t);
            self.b.observe(Some(&self.record), now);
            self.b.claim(Some(&self.record), now, wall)
        }
    }

    /// lease-clock-skew: a claimant whose wall clock is 10 s ahead of the holder's (NTP lost, a
    /// VM resumed) or 10 s behind never takes a renewing holder's lease, and the holder keeps
    /// control (renewals and publishes) all along. Its wall clock is only ever written.
    #[test]
    fn a_claimant_whose_wall_clock_is_ahead_or_behind_never_takes_a_renewing_holders_lease() {
        for skew in [10.0, -10.0, 3600.0] {
            let mut p = Pair::new();
            for t in (250..=10_000).step_by(250) {
                let wall_a = 1000.0 + t as f64 / 1000.0;
                if t % 500 == 0 {
                    assert_eq!(p.renew(t, wall_a), Ok(()), "skew {skew}, t {t}");
                }
                let seen = p.b_claims(t, wall_a + skew);
                assert!(
                    matches!(seen, Claim::HeldBy { epoch: 1, .. }),
                    "skew {skew}, t {t}: {seen:?}"
                );
                let now = p.t0 + ms(t);
                assert_eq!(p.a.control(now), Control::Active, "skew {skew}, t {t}");
                assert_eq!(p.a.may_publish(Some(&p.record), now), Ok(1));
            }
        }
    }

    /// A holder whose wall clock jumps forward or back by more than the ttl keeps control while
    /// it renews: its own record's times are never compared with its clock, and a claimant
    /// sees a new version at every renewal.
    #[test]
    fn a_holder_whose_wall_clock_jumps_forward_or_back_keeps_control_while_it_renews() {
        let mut p = Pair::new();
        let mut wall = 1000.0;
        for t in (500..=8000).step_by(500) {
            wall += match t {
                2000 => 300.0,  // a step forward, far past the ttl
                4000 => -900.0, // a step back, far past the ttl
                6000 => 0.0,    // the same reading as the record it replaces
                _ => 0.5,
            };
            assert_eq!(p.renew(t, wall), Ok(()), "t {t}, wall {wall}");
            let now = p.t0 + ms(t);
            assert_eq!(p.a.control(now + ms(1499)), Control::Active, "t {t}");
            assert_eq!(p.a.may_publish(Some(&p.record), now + ms(1499)), Ok(1));
            for k in [0, 250] {
                let seen = p.b_claims(t + k, 1000.0 + (t + k) as f64 / 1000.0);
                assert!(matches!(seen, Claim::HeldBy { .. }), "t {t}: {seen:?}");
            }
        }
    }

    /// A holder that stops renewing is taken over one ttl (its own record's duration) after the
    /// claimant first saw its last record, whatever either wall clock says: not earlier, even
    /// when the record's `expires_at` is long past on the claimant's wall clock, and not later
    /// when it is far in the future.
    #[test]
    fn a_holder_that_stops_renewing_is_taken_over_one_ttl_after_the_claimant_first_saw_it() {
        for skew in [0.0, 10.0, -10.0] {
            let mut p = Pair::new();
            assert_eq!(p.renew(500, 1000.5), Ok(()));
            // The holder stops after its renewal at 500 ms; b first sees that version at 700.
            let wall = |t: u64| 1000.0 + t as f64 / 1000.0 + skew;
            assert!(matches!(p.b_claims(700, wall(700)), Claim::HeldBy { .. }));
            assert!(matches!(p.b_claims(1500, wall(1500)), Claim::HeldBy { .. }));
            assert!(
                matches!(p.b_claims(2699, wall(2699)), Claim::HeldBy { .. }),
                "skew {skew}: one ttl after its first sight, not after the write"
            );
            let Claim::Write(rec) = p.b_claims(2700, wall(2700)) else {
                panic!("skew {skew}: taken one ttl after b first saw the last record")
            };
            assert_eq!((rec.epoch, rec.holder.as_str()), (2, "b:2"));
            // The old holder's local validity (ttl − margin from its last renewal) ended first.
            assert_eq!(p.a.control(p.t0 + ms(2000)), Control::Fenced);
        }
        // A claimant that starts after the holder died (the record's `expires_at` an hour in
        // the past on its wall clock) still waits one ttl from its own first read.
        let t0 = SystemClock.now();
        let dead = LeaseRecord::new(7, "a:1", 1000.0, Duration::from_secs(2));
        let mut c = Lease::new("c:3".into(), timing());
        assert_eq!(c.observe(Some(&dead), t0), Freshness::Until(t0 + 2 * S));
        assert!(matches!(
            c.claim(Some(&dead), t0 + ms(1999), 4600.0),
            Claim::HeldBy { epoch: 7, .. }
        ));
        let Claim::Write(rec) = c.claim(Some(&dead), t0 + 2 * S, 4600.0) else {
            panic!("lapsed one ttl after the first read")
        };
        assert_eq!(rec.epoch, 8);
        // The duration is the holder's (its record's), not the claimant's own ttl.
        let long = LeaseRecord::new(8, "d:4", 1000.0, Duration::from_secs(5));
        let mut e = Lease::new("e:5".into(), timing());
        e.observe(Some(&long), t0);
        assert!(matches!(
            e.claim(Some(&long), t0 + ms(4999), 0.0),
            Claim::HeldBy { .. }
        ));
        assert!(matches!(
            e.claim(Some(&long), t0 + 5 * S, 0.0),
            Claim::Write(_)
        ));
    }

    /// A released record (`expires_at <= updated_at`: the holder gave the lease up, a planned
    /// handover) is taken at once, by a claimant that never saw it before, whatever its clock.
    #[test]
    fn a_released_record_is_taken_at_once() {
        let mut p = Pair::new();
        assert_eq!(p.renew(500, 1000.5), Ok(()));
        assert!(matches!(p.b_claims(600, 990.0), Claim::HeldBy { .. }));
        let released = p.a.release(Some(&p.record), 1000.7).expect("ours");
        assert!(released.released());
        p.record = released;
        let Claim::Write(rec) = p.b_claims(700, 990.0) else {
            panic!("a released record is free at once")
        };
        assert_eq!(rec.epoch, 2, "a change of holder advances the epoch");
        let fresh = Lease::new("c:3".into(), timing());
        assert_eq!(
            fresh.freshness(Some(&p.record), p.t0),
            Freshness::Free,
            "never seen before: free"
        );
    }

    /// The etcd backend's expiry: etcd deletes a lapsed record itself, so a present record of
    /// another holder is live however long it stays unchanged (unless released); an absent one
    /// is free.
    #[test]
    fn with_store_expiry_a_present_record_is_live_until_the_store_removes_it() {
        let t0 = SystemClock.now();
        let mut b = Lease::new("b:2".into(), timing()).with_expiry(Expiry::Store);
        let held = LeaseRecord::new(3, "a:1", 100.0, Duration::from_secs(2));
        assert_eq!(b.observe(Some(&held), t0), Freshness::WhilePresent);
        assert!(matches!(
            b.claim(Some(&held), t0 + 3600 * S, 1e9),
            Claim::HeldBy { epoch: 3, .. }
        ));
        let mut released = held.clone();
        released.expires_at = released.updated_at;
        assert!(matches!(b.claim(Some(&released), t0, 0.0), Claim::Write(r) if r.epoch == 4));
        assert_eq!(b.observe(None, t0), Freshness::Free);
        assert!(matches!(b.claim(None, t0, 0.0), Claim::Write(r) if r.epoch == 1));
    }

    /// The observer, transition by transition: a new version is first seen when read, a known
    /// one keeps its first sight, an absent record clears it, a write by this router counts from
    /// the instant before the write; a rewrite with an unchanged wall clock is a new version.
    #[test]
    fn the_observer_times_each_version_from_its_first_sight() {
        let t0 = SystemClock.now();
        let mut o = Observer::new(Expiry::Observed);
        let v1 = LeaseRecord::new(1, "a:1", 100.0, Duration::from_secs(2));
        assert_eq!(o.judge(Some(&v1), t0), Freshness::Until(t0 + 2 * S));
        assert_eq!(o.first_seen(), None, "judging records nothing");
        assert_eq!(o.observe(Some(&v1), t0 + S), Freshness::Until(t0 + 3 * S));
        assert_eq!(
            o.observe(Some(&v1), t0 + 2 * S),
            Freshness::Until(t0 + 3 * S)
        );
        assert!(!o.judge(Some(&v1), t0 + 3 * S).live(t0 + 3 * S));
        let v2 = LeaseRecord::new(1, "a:1", 100.5, Duration::from_secs(2));
        assert_eq!(
            o.observe(Some(&v2), t0 + 2 * S),
            Freshness::Until(t0 + 4 * S)
        );
        assert_eq!(o.observe(None, t0 + 2 * S), Freshness::Free);
        assert_eq!(o.first_seen(), None);
        o.wrote(&v1, t0);
        assert_eq!(o.observe(Some(&v1), t0 + S), Freshness::Until(t0 + 2 * S));
        assert_eq!(Freshness::Until(t0).until(), Some(t0));
        assert_eq!(Freshness::WhilePresent.until(), None);
        // A holder whose wall clock did not move between two writes still writes a new version.
        let mut a = Lease::new("a:1".into(), timing());
        a.granted(1, t0);
        let next = a.renew(Some(&v1), t0, 100.0).unwrap();
        assert!(!next.same_version(&v1), "{next:?}");
        assert!(next.updated_at > v1.updated_at);
        assert_eq!(o.observe(Some(&next), t0 + S), Freshness::Until(t0 + 3 * S));
        let Claim::Write(again) = a.claim(Some(&v1), t0, 100.0) else {
            panic!("our own record")
        };
        assert!(!again.same_version(&v1));
    }
}
