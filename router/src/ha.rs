//! High availability: the primary's lease loop and the warm standby, supervised as one task
//! that moves the router between them (handoff-and-lifecycle.md, "HA handoff"; behaviour.md
//! 2.9, 3.4; architecture.md sections 7 and 9.6).
//!
//! ```text
//!  supervise: Active(renewal) ──renewal.lost() | the phase leaves control──► Standby{held: epoch}
//!             Standby ──standby::run: observe, follow, claim, apply, re-check──► Active(renewal)
//!  primary:   claim at startup ──► Active | Blocked(reason) ──► Standby{held: none}
//! ```
//! Every failure on the way leaves the router a standby that tries again (architecture.md 9.6).
//! Whatever ends control (a lost renewal, an agent that saw a newer epoch, a refused handoff
//! publish) ends the renewal with it: a router that is not active never renews
//! (ha-and-fencing.md).
//! `primary` is the lease loop, `standby` the standby's driver over the pure `machine`; the
//! phase they publish lives in `crate::ha_phase`.

mod machine;
#[cfg(test)]
mod mc;
#[cfg(test)]
mod model;
mod primary;
mod standby;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::parts::Parts;
use narwhal_lease::LeaseLoss;
use primary::Renewal;

/// Standby settings (`narwhal-serve --standby-of URL ...`; behaviour.md 2.9 defaults).
#[derive(Debug, Clone)]
pub struct StandbyOptions {
    /// The primary's control listener, e.g. `https://10.0.0.5:8001`.
    pub primary: String,
    /// Seconds between polls (default 0.25).
    pub probe_interval: Duration,
    /// Consecutive missed polls before a takeover is attempted (default 4).
    pub takeover_after: u32,
    /// A retained handoff older than this (by its `at`, wall clock) is not applied (default 30 s).
    pub max_handoff_age_s: f64,
}

/// Where the supervisor goes next.
enum Next {
    /// In control: wait for the renewal to report a loss.
    Active(Renewal),
    /// Run the standby; `held` is the epoch last controlled, if any.
    Standby { held: Option<u64> },
}

/// Startup of a primary: claim the lease (backend `none`: nothing to claim, always active)
/// and keep it; on failure the router serves nothing and retries as a standby
/// (architecture.md 9.6). The claim completes before this returns. `resume`: `--resume` was
/// asked (a newer handoff published beside the lease record is then applied).
pub(crate) async fn start_primary(parts: &Arc<Parts>, stop: &CancellationToken, resume: bool) {
    if !parts.ha.lease().enabled() {
        return;
    }
    let next = match primary::claim_at_startup(parts, stop, resume).await {
        Ok(renewal) => Next::Active(renewal),
        Err(()) => Next::Standby { held: None },
    };
    tokio::spawn(supervise(parts.clone(), None, stop.clone(), next));
}

/// Startup of a warm standby of `opts.primary` (behaviour.md 2.9): it serves nothing until
/// it takes over.
pub(crate) fn start_standby(parts: &Arc<Parts>, opts: StandbyOptions, stop: &CancellationToken) {
    let next = Next::Standby { held: None };
    tokio::spawn(supervise(parts.clone(), Some(opts), stop.clone(), next));
}

/// Startup of a primary with agents: readiness waits for the identity check through the
/// agents (behaviour.md 1.2, 4.10).
pub(crate) fn hold_until_identities_checked(parts: Arc<Parts>) {
    primary::hold_until_identities_checked(parts);
}

/// Moves the router between control and standby until `stop`.
async fn supervise(
    parts: Arc<Parts>,
    opts: Option<StandbyOptions>,
    stop: CancellationToken,
    mut next: Next,
) {
    loop {
        next = match next {
            Next::Active(mut renewal) => {
                let mut status = parts.ha.subscribe();
                tokio::select! {
                    () = stop.cancelled() => return,
                    epoch = renewal.lost() => Next::Standby { held: Some(epoch) },
                    left = status.wait_for(|s| !s.phase.holds_control()) => {
                        let epoch = left.map(|s| s.epoch).unwrap_or_else(|_| parts.ha.lease().epoch());
                        // Control ended outside the renew loop: stop renewing now.
                        renewal.stop();
                        parts.ha.lease().relinquish(epoch, LeaseLoss::HeldByAnother);
                        tracing::warn!(epoch, "control ended; renewal stopped, returning as a standby");
                        Next::Standby { held: Some(epoch) }
                    }
                }
            }
            Next::Standby { held } => {
                match standby::run(&parts, opts.as_ref(), held, &stop).await {
                    Some(renewal) => Next::Active(renewal),
                    None => return,
                }
            }
        };
    }
}
