//! The router lease core: who controls the fleet, under which epoch, until when
//! (handoff-and-lifecycle.md, "HA handoff"; behaviour.md 3; architecture.md section 7).
//!
//! Pure: the backends (file, etcd) read and write [`LeaseRecord`]s; this core decides what to
//! write and whether the router still holds a valid lease. Validity runs from the monotonic
//! instant taken *before* the write that granted it, minus a safety margin, so a slow write
//! can only shorten what the router believes, never lengthen it.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// `schema` of the lease record.
pub const LEASE_SCHEMA: &str = "narwhal.router-lease";

/// The lease record a backend stores (schema `narwhal.router-lease` version 1;
/// behaviour.md 3.2). Times are wall-clock Unix seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRecord {
    /// Fencing epoch, ≥ 1; advances on every change of holder.
    pub epoch: u64,
    /// When the lease lapses unless renewed.
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

    /// Unexpired at wall time `now_wall`.
    pub fn live(&self, now_wall: f64) -> bool {
        self.expires_at > now_wall
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
    /// Another router holds an unexpired lease.
    HeldBy {
        /// Its holder token.
        holder: String,
        /// Its epoch.
        epoch: u64,
        /// When it lapses (wall seconds).
        expires_at: f64,
    },
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
}

impl Lease {
    /// A lease core for holder token `holder` that owns nothing yet.
    pub fn new(holder: String, timing: LeaseTiming) -> Self {
        Lease {
            holder,
            timing,
            owned: None,
            fenced: None,
        }
    }

    /// This process's holder token.
    pub fn holder(&self) -> &str {
        &self.holder
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

    /// Decides a claim against the `current` record read under the backend's lock
    /// (behaviour.md 3.3): an unexpired record of another holder wins; our own keeps its
    /// epoch; an absent or expired one is taken at epoch + 1.
    pub fn claim(&self, current: Option<&LeaseRecord>, now_wall: f64) -> Claim {
        let epoch = match current {
            Some(r) if r.live(now_wall) && r.holder != self.holder => {
                return Claim::HeldBy {
                    holder: r.holder.clone(),
                    epoch: r.epoch,
                    expires_at: r.expires_at,
                };
            }
            Some(r) if r.live(now_wall) => r.epoch,
            Some(r) => r.epoch + 1,
            None => 1,
        };
        Claim::Write(LeaseRecord::new(
            epoch,
            &self.holder,
            now_wall,
            self.timing.ttl,
        ))
    }

    /// The backend wrote `epoch` for us; `started` is the monotonic instant taken before the
    /// read-decide-write began.
    pub fn granted(&mut self, epoch: u64, started: Instant) {
        let until = started + self.timing.ttl.saturating_sub(self.timing.safety_margin);
        self.owned = Some((epoch, until));
        self.fenced = None;
    }

    /// Decides a renewal against `current`: the record must still be ours at our epoch and
    /// unexpired; otherwise the router is fenced at once.
    ///
    /// # Errors
    /// The [`LeaseLoss`]; the core is fenced when it returns.
    pub fn renew(
        &mut self,
        current: Option<&LeaseRecord>,
        now_wall: f64,
    ) -> Result<LeaseRecord, LeaseLoss> {
        let Some((epoch, _)) = self.owned else {
            return Err(LeaseLoss::Lapsed);
        };
        let loss = match current {
            None => Some(LeaseLoss::Lapsed),
            Some(r) if r.holder != self.holder || r.epoch != epoch => {
                Some(LeaseLoss::HeldByAnother)
            }
            Some(r) if !r.live(now_wall) => Some(LeaseLoss::Lapsed),
            Some(_) => None,
        };
        if let Some(loss) = loss {
            self.fence(loss.clone());
            return Err(loss);
        }
        Ok(LeaseRecord::new(
            epoch,
            &self.holder,
            now_wall,
            self.timing.ttl,
        ))
    }

    /// Decides whether this router may publish its handoff next to `current` (read under the
    /// backend's lock) at `now_wall`: the record must be ours at our epoch and unexpired, as
    /// for a renewal, so a document published under epoch E is always the newest state of E
    /// and can never land after a successor's claim (ha-and-fencing.md: an acknowledged lifecycle
    /// action is durable where the successor reads). Nothing is fenced here: the driver does.
    ///
    /// # Errors
    /// The [`LeaseLoss`]: nothing owned or a lapsed record ([`LeaseLoss::Lapsed`]), another
    /// holder or epoch ([`LeaseLoss::HeldByAnother`]).
    pub fn may_publish(
        &self,
        current: Option<&LeaseRecord>,
        now_wall: f64,
    ) -> Result<u64, LeaseLoss> {
        let Some((epoch, _)) = self.owned else {
            return Err(self.fenced.clone().unwrap_or(LeaseLoss::Lapsed));
        };
        match current {
            None => Err(LeaseLoss::Lapsed),
            Some(r) if r.holder != self.holder || r.epoch != epoch => Err(LeaseLoss::HeldByAnother),
            Some(r) if !r.live(now_wall) => Err(LeaseLoss::Lapsed),
            Some(_) => Ok(epoch),
        }
    }

    /// Gives up control now (failed renewal, backend error past validity).
    pub fn fence(&mut self, why: LeaseLoss) {
        self.owned = None;
        self.fenced = Some(why);
    }

    /// The record to write when releasing at shutdown: ours, expired now, same epoch; `None`
    /// when the record is no longer ours.
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

    #[test]
    fn first_claim_is_epoch_one_and_valid_until_ttl_minus_margin() {
        let t0 = SystemClock.now();
        let mut a = Lease::new("a:1".into(), timing());
        assert_eq!(a.control(t0), Control::Standby);
        let Claim::Write(rec) = a.claim(None, 100.0) else {
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
        let b = Lease::new("b:2".into(), timing());
        let held = LeaseRecord::new(3, "a:1", 100.0, Duration::from_secs(2));
        assert!(matches!(
            b.claim(Some(&held), 101.9),
            Claim::HeldBy { epoch: 3, .. }
        ));
        let Claim::Write(rec) = b.claim(Some(&held), 102.0) else {
            panic!()
        };
        assert_eq!(rec.epoch, 4, "takeover advances the epoch");
        assert_eq!(rec.holder, "b:2");
    }

    #[test]
    fn reclaim_by_the_same_holder_keeps_its_epoch() {
        let a = Lease::new("a:1".into(), timing());
        let mine = LeaseRecord::new(5, "a:1", 100.0, Duration::from_secs(2));
        let Claim::Write(rec) = a.claim(Some(&mine), 101.0) else {
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
        let next = a.renew(Some(&ours), 100.5).unwrap();
        assert_eq!(next.expires_at, 102.5);
        let theirs = LeaseRecord::new(2, "b:2", 100.6, Duration::from_secs(2));
        assert_eq!(a.renew(Some(&theirs), 100.7), Err(LeaseLoss::HeldByAnother));
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
        assert_eq!(b.renew(None, 101.0), Err(LeaseLoss::Lapsed));
        let mut c = Lease::new("c:3".into(), timing());
        c.granted(4, t0);
        let old = LeaseRecord::new(4, "c:3", 90.0, Duration::from_secs(2));
        assert_eq!(c.renew(Some(&old), 101.0), Err(LeaseLoss::Lapsed));
    }

    #[test]
    fn only_the_live_holder_may_publish() {
        let t0 = SystemClock.now();
        let mut a = Lease::new("a:1".into(), timing());
        let ours = LeaseRecord::new(1, "a:1", 100.0, Duration::from_secs(2));
        assert_eq!(
            a.may_publish(Some(&ours), 100.5),
            Err(LeaseLoss::Lapsed),
            "nothing owned"
        );
        a.granted(1, t0);
        assert_eq!(a.may_publish(Some(&ours), 100.5), Ok(1));
        assert_eq!(
            a.may_publish(Some(&ours), 102.0),
            Err(LeaseLoss::Lapsed),
            "expired"
        );
        assert_eq!(
            a.may_publish(None, 100.5),
            Err(LeaseLoss::Lapsed),
            "vanished"
        );
        let theirs = LeaseRecord::new(2, "b:2", 100.0, Duration::from_secs(2));
        assert_eq!(
            a.may_publish(Some(&theirs), 100.5),
            Err(LeaseLoss::HeldByAnother)
        );
        let old_epoch = LeaseRecord::new(2, "a:1", 100.0, Duration::from_secs(2));
        assert_eq!(
            a.may_publish(Some(&old_epoch), 100.5),
            Err(LeaseLoss::HeldByAnother)
        );
        a.fence(LeaseLoss::HeldByAnother);
        assert_eq!(
            a.may_publish(Some(&ours), 100.5),
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
        assert!(!r.live(100.5));
        let mut b = Lease::new("b:2".into(), timing());
        b.granted(1, t0);
        assert!(b.release(Some(&ours), 100.5).is_none());
    }
}
