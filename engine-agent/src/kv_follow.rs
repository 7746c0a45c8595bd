//! Follows one engine's KV events into the block set the agent serves as snapshots
//! (`GET /v1/engines/{iid}/kv/snapshot`; docs/agent.md, "KV block snapshots"). The rules are
//! the pure [`BlockSet`]'s; this is the driver: the engine's PUB socket on loopback, its replay
//! socket for what the SUB missed, and the engine's process read when its stream starts, so a
//! snapshot is bound to the process that stored its blocks.
//!
//! ```text
//! SUB connect ─► replay from the next expected batch (0 at first: the engine's whole buffer)
//!   batch ─► BlockSet::step ─► Next: apply   Restarted: read the process, restart
//!                              Old: skip      Gap: replay, apply in order, else restart
//!                                                  from this batch (incomplete)
//! every 0.5 s while no batch came: replay again (a SUB joins asynchronously)
//! ```

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use narwhal_shared::ProcessIdentity;
use narwhal_shared::kv_blocks::{BlockSet, Step};
use narwhal_shared::kv_events::KvEventBatch;
use narwhal_shared::kv_stream::{parse, replay};
use zeromq::{Socket as _, SocketRecv as _};

use crate::config::KvEvents;

/// Blocks kept per engine at most (as the router's index bounds it: 2^18 blocks, 4 Mi tokens
/// at block size 16); further stores are dropped and counted.
pub(crate) const MAX_BLOCKS: usize = 1 << 18;
/// How long a replay may take.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a follower without a batch asks the replay socket again, and retries a connect.
const RECHECK: Duration = Duration::from_millis(500);

/// One engine's followed state.
#[derive(Debug)]
pub(crate) struct Follow {
    /// The blocks.
    pub(crate) set: BlockSet,
    /// The engine process read when the stream (re)started; `None` before.
    pub(crate) process: Option<ProcessIdentity>,
}

impl Follow {
    pub(crate) fn new() -> Self {
        Follow {
            set: BlockSet::new(MAX_BLOCKS),
            process: None,
        }
    }
}

fn lock(m: &Mutex<Follow>) -> MutexGuard<'_, Follow> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Follows `cfg`'s stream into `state` for as long as the task lives; `identity` reads the
/// engine's process (`None` when it cannot be read: the snapshot is then refused).
pub(crate) async fn run<F, Fut>(iid: String, cfg: KvEvents, state: Arc<Mutex<Follow>>, identity: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<ProcessIdentity>>,
{
    loop {
        let mut sub = zeromq::SubSocket::new();
        if let Err(err) = sub.connect(&cfg.endpoint).await {
            tracing::debug!(engine.iid = %iid, error = %err, "kv events: connect failed; retrying");
            tokio::time::sleep(RECHECK).await;
            continue;
        }
        if let Err(err) = sub.subscribe(&cfg.topic).await {
            tracing::warn!(engine.iid = %iid, error = %err, "kv events: subscribe failed");
            tokio::time::sleep(RECHECK).await;
            continue;
        }
        tracing::info!(engine.iid = %iid, endpoint = %cfg.endpoint, "kv events: followed");
        catch_up(&cfg, &state, &identity).await;
        loop {
            tokio::select! {
                m = sub.recv() => match m {
                    Ok(m) => {
                        let frames = m.into_vec();
                        match parse(&frames) {
                            Some((seq, batch)) => ingest(&cfg, &state, &identity, seq, batch).await,
                            None => {
                                tracing::warn!(engine.iid = %iid, "kv events: malformed message; the block set starts again");
                                lock(&state).set.reset();
                            }
                        }
                    }
                    Err(err) => {
                        tracing::debug!(engine.iid = %iid, error = %err, "kv events: receive failed; reconnecting");
                        break;
                    }
                },
                () = tokio::time::sleep(RECHECK) => {
                    if lock(&state).set.next_seq().is_none() {
                        catch_up(&cfg, &state, &identity).await;
                    }
                }
            }
        }
    }
}

/// Asks the replay socket for what came from the next expected batch on.
async fn catch_up<F, Fut>(cfg: &KvEvents, state: &Mutex<Follow>, identity: &F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<ProcessIdentity>>,
{
    let Some(ep) = &cfg.replay_endpoint else {
        return;
    };
    let from = lock(state).set.next_seq().unwrap_or(0);
    let Some(batches) = replay(ep, from, REPLAY_TIMEOUT).await else {
        return;
    };
    if batches.is_empty() {
        return;
    }
    let starts = lock(state).set.next_seq().is_none();
    let process = if starts { identity().await } else { None };
    let mut f = lock(state);
    absorb(&mut f.set, batches);
    if process.is_some() {
        f.process = process;
    }
}

/// Applies `batches` (ascending) by the sequence rule: in order, the overlap skipped; a
/// batch after a hole (the buffer no longer reaching back) starts the set again from it.
fn absorb(set: &mut BlockSet, batches: Vec<(u64, KvEventBatch)>) {
    for (seq, batch) in batches {
        match set.step(seq) {
            Step::Next => set.apply(seq, &batch),
            Step::Old => {}
            Step::Restarted | Step::Gap { .. } => set.restart(seq, &batch),
        }
    }
}

/// Applies batch `seq` by the set's sequence rule.
async fn ingest<F, Fut>(
    cfg: &KvEvents,
    state: &Mutex<Follow>,
    identity: &F,
    seq: u64,
    batch: KvEventBatch,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<ProcessIdentity>>,
{
    let (step, starts) = {
        let f = lock(state);
        (f.set.step(seq), f.set.next_seq().is_none())
    };
    match step {
        Step::Old => {}
        Step::Next if !starts => lock(state).set.apply(seq, &batch),
        // The stream's first batch, or a new process's: the blocks belong to the process
        // running now.
        Step::Next | Step::Restarted => {
            let process = identity().await;
            let mut f = lock(state);
            f.set.restart(seq, &batch);
            f.process = process;
        }
        Step::Gap { from } => {
            let mut replayed = match &cfg.replay_endpoint {
                Some(ep) => replay(ep, from, REPLAY_TIMEOUT).await.unwrap_or_default(),
                None => Vec::new(),
            };
            replayed.push((seq, batch));
            let process = if starts { identity().await } else { None };
            let mut f = lock(state);
            absorb(&mut f.set, replayed);
            if process.is_some() {
                f.process = process;
            }
        }
    }
}
