//! The primary's lease loop: the claim at startup, the renewal (ahead of expiry, from the
//! claim on) and the fence when a renewal is lost (behaviour.md 3.3, 3.4; architecture.md 9.6).
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

use crate::ha_phase::HaPhase;
use crate::parts::Parts;
use narwhal_lease::LeaseEvent;

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
/// publishes why not (`Err`: the router then waits as a standby, architecture.md 9.6). With
/// `resume`, a handoff published beside the lease record by a router that controlled the
/// fleet after this router's state file was written is applied over it (ha-and-fencing.md: whoever
/// takes over reads the newest state).
pub(crate) async fn claim_at_startup(
    parts: &Arc<Parts>,
    stop: &CancellationToken,
    resume: bool,
) -> Result<Renewal, ()> {
    let lease = parts.ha.lease();
    match lease.claim().await {
        Ok(epoch) => {
            tracing::info!(epoch, holder = %lease.holder(), "lease claimed; this router controls the fleet");
            if resume {
                resume_newer_published(parts, epoch).await;
            }
            // Published under the new epoch before anything is decided under it
            // (ha-and-fencing.md).
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

/// `--resume` after a claim of `epoch`: the handoff published by the last controller (epoch
/// `epoch − 1`) replaces the state file's when it is newer than the file.
async fn resume_newer_published(parts: &Arc<Parts>, epoch: u64) {
    let path = std::path::PathBuf::from(&parts.cfg.recovery.state_path);
    let file_epoch =
        match tokio::task::spawn_blocking(move || narwhal_shared::handoff::load_state_file(&path))
            .await
        {
            Ok(narwhal_shared::handoff::Loaded::Valid(h)) => h.epoch,
            _ => 0,
        };
    let doc = match crate::handoff::read_published(parts).await {
        Ok((_, Some(doc))) if doc.epoch + 1 == epoch && doc.epoch > file_epoch => doc,
        Ok(_) => return,
        Err(e) => {
            tracing::warn!(error = %e, "published handoff unreadable at startup; resuming from the state file");
            return;
        }
    };
    match crate::handoff::apply(parts, &doc) {
        Ok(_) => tracing::info!(
            published = doc.epoch,
            file = file_epoch,
            "resumed from the handoff published beside the lease (newer than the state file)"
        ),
        Err(e) => tracing::warn!(error = %e, "published handoff refused at startup"),
    }
}

/// Startup of a primary with agents: hold readiness (`ValidatingIdentities`) while every
/// engine's identity is checked through its agent (in the background, so the listeners are
/// up meanwhile), then release the hold unless something else replaced it
/// (behaviour.md 1.2, 4.10).
pub(crate) fn hold_until_identities_checked(parts: Arc<Parts>) {
    parts.ha.begin_identity_check();
    tokio::spawn(async move {
        parts.lifecycle.check_identities().await;
        parts.ha.end_identity_check();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ha-and-fencing.md: a primary restarted with `--resume` after another router controlled the
    /// fleet takes that router's published handoff (newer than its own state file); without
    /// `--resume` it starts fresh, as the reference does.
    #[tokio::test]
    async fn resume_takes_a_newer_published_handoff_over_the_state_file() {
        for resume in [true, false] {
            let dir = tempfile::tempdir().expect("tempdir");
            let (parts, clock) = crate::ha_phase::tests::leased(dir.path());
            // Another router held epoch 1, published served 9, and is gone (record expired:
            // this router read it, and it stayed unchanged for its ttl since).
            let mut h = crate::handoff::snapshot(&parts);
            h.epoch = 1;
            h.holder = "other:0".into();
            h.counters.insert("served".into(), 9);
            let lease = dir.path().join("lease.json");
            let other = serde_json::json!({"epoch": 1, "expires_at": 1.0e9 - 1.0,
                "holder": "other:0", "schema": "narwhal.router-lease", "schema_version": 1,
                "updated_at": 1.0e9 - 3.0});
            std::fs::write(&lease, format!("{other}\n")).expect("record");
            let published = serde_json::to_vec(&h).expect("json");
            std::fs::write(dir.path().join("lease.json.handoff"), published).expect("handoff");
            parts.ha.lease().read_record().await.expect("read");
            clock.advance(std::time::Duration::from_secs(2));
            let stop = CancellationToken::new();
            let renewal = claim_at_startup(&parts, &stop, resume).await;
            assert!(renewal.is_ok());
            assert_eq!(parts.ha.lease().epoch(), 2);
            let served = parts.accounting.tally().served;
            assert_eq!(served, if resume { 9 } else { 0 }, "resume {resume}");
            let (_, doc) = crate::handoff::read_published(&parts).await.expect("store");
            let doc = doc.expect("published under epoch 2 at once");
            assert_eq!((doc.epoch, doc.counters["served"]), (2, served));
            stop.cancel();
        }
    }
}
