//! The primary's lease loop: the claim at startup, the renewal (ahead of expiry, from the
//! claim on) and the fence when a renewal is lost (reference-notes 3.3, 3.4; DESIGN.md 9.6).
//!
//! ```text
//!  startup ──claim──► Active ──renew every renew_interval──► ... ──lost──► fence (at once)
//!                                                                     └─► lost() to `ha`
//!  takeover (standby) ──claim──► renew(pending) ──commit()──► as above
//!                                       └─ lost while pending: fence only; the takeover fails
//! ```
//!
//! The renewal tells `ha` that control was lost through a channel ([`Renewal::lost`]); it
//! never starts the standby itself.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::lease::LeaseEvent;
use crate::parts::Parts;
use crate::phase::HaPhase;

/// Renewal phases: a takeover still in progress, a router in control, and a takeover
/// whose lease was lost before it finished.
const PENDING: u8 = 0;
const COMMITTED: u8 = 1;
const LOST_WHILE_PENDING: u8 = 2;

/// A running renew loop (found by ha_e2e: the lease was not renewed while a takeover
/// re-checked identities, so on a loaded machine a check longer than `ttl_s −
/// safety_margin_s` lost the lease every time and the standby never took over).
pub(crate) struct Renewal {
    /// Stops the renew loop silently (a failed takeover releases the lease itself).
    stop: CancellationToken,
    /// [`PENDING`] until the takeover commits ([`COMMITTED`]); a loss while pending only
    /// fences ([`LOST_WHILE_PENDING`]).
    phase: Arc<AtomicU8>,
    /// The epoch lost after the commit.
    lost: oneshot::Receiver<u64>,
}

impl Renewal {
    /// Marks the takeover done; `false` if the lease was lost before (nobody else will start
    /// the standby then: the caller must fail the takeover and keep looping).
    pub(crate) fn commit(&self) -> bool {
        self.phase
            .compare_exchange(PENDING, COMMITTED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Stops renewing (a takeover that gives the lease back).
    pub(crate) fn stop(&self) {
        self.stop.cancel();
    }

    /// Resolves with the epoch when the lease is lost after the commit; never when the loop
    /// ends otherwise (stopped).
    pub(crate) async fn lost(&mut self) -> u64 {
        match (&mut self.lost).await {
            Ok(epoch) => epoch,
            Err(_) => std::future::pending().await,
        }
    }

    /// The lease was lost while the takeover was pending.
    #[cfg(test)]
    pub(crate) fn lost_while_pending(&self) -> bool {
        self.phase.load(Ordering::SeqCst) == LOST_WHILE_PENDING
    }
}

/// Starts the renew loop of a lease just claimed: `pending` for a takeover in progress
/// (it [`Renewal::commit`]s when done), else committed (startup). A lost renewal fences the
/// router at once; once committed it also reports the epoch through [`Renewal::lost`].
pub(crate) fn renew(parts: &Arc<Parts>, pending: bool, stop: &CancellationToken) -> Renewal {
    let phase = Arc::new(AtomicU8::new(if pending { PENDING } else { COMMITTED }));
    let renew_stop = stop.child_token();
    let (tx, lost) = oneshot::channel();
    let tx = Mutex::new(Some(tx));
    let on_change = {
        let parts = parts.clone();
        let phase = phase.clone();
        move |ev: LeaseEvent| {
            let LeaseEvent::Fenced { epoch, loss } = ev;
            tracing::error!(epoch, reason = %loss, "fenced: no new placements, lifecycle actions refused");
            parts.ha.fence(&loss);
            let was_pending = phase
                .compare_exchange(
                    PENDING,
                    LOST_WHILE_PENDING,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                )
                .is_ok();
            if !was_pending && let Some(tx) = tx.lock().unwrap_or_else(|p| p.into_inner()).take() {
                let _ = tx.send(epoch);
            }
        }
    };
    parts
        .ha
        .lease()
        .clone()
        .spawn_renew(renew_stop.clone(), on_change);
    Renewal {
        stop: renew_stop,
        phase,
        lost,
    }
}

/// Startup of a primary with a lease backend: claims the lease and keeps it (`Ok`), or
/// publishes why not (`Err`: the router then waits as a standby, DESIGN.md 9.6).
pub(crate) async fn claim_at_startup(
    parts: &Arc<Parts>,
    stop: &CancellationToken,
) -> Result<Renewal, ()> {
    let lease = parts.ha.lease();
    match lease.claim().await {
        Ok(epoch) => {
            tracing::info!(epoch, holder = %lease.holder(), "lease claimed; this router controls the fleet");
            // Published under the new epoch before anything is decided under it (issue 13).
            if let Err(e) = crate::handoff::publish(parts, true).await {
                tracing::warn!(error = %e, "handoff not published at startup; the writer retries");
            }
            parts.ha.publish(HaPhase::Active);
            Ok(renew(parts, false, stop))
        }
        Err(loss) => {
            tracing::warn!(reason = %loss, "lease not claimed at startup; waiting as a standby");
            parts.ha.publish(HaPhase::Blocked {
                reason: loss.to_string(),
            });
            Err(())
        }
    }
}

/// Startup of a primary with agents: hold readiness (`ValidatingIdentities`) while every
/// engine's identity is checked through its agent (in the background, so the listeners are
/// up meanwhile), then release the hold unless something else replaced it
/// (reference-notes 1.2, 4.10).
pub(crate) fn hold_until_identities_checked(parts: Arc<Parts>) {
    parts.ha.begin_identity_check();
    tokio::spawn(async move {
        parts.lifecycle.check_identities().await;
        parts.ha.end_identity_check();
    });
}
