//! Producer-side KV bookkeeping, sans IO (time is passed in as `now`).
//!
//! ```text
//!  vLLM prefill ──issue(now, prompt)──► BlockStore ──take(now, engine blocks)──► consumer read (once)
//!  SGLang prefill ──publish(now, room)──► RoomStore ──take(now, room)──► decode pull (once)
//!                                 expire(now) frees unread entries after the lease (`--kv-lease-s`)
//! ```
//!
//! Mirrors the contract of vLLM's NixlConnector (a producer keeps the blocks of a finished
//! remote-decode request until the consumer reads them or `kv_lease_duration` passes) and of
//! SGLang's bootstrap rendezvous (a room's KV is handed to exactly one decode request).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Tokens per KV block (vLLM's default `block_size`).
pub(crate) const BLOCK_TOKENS: usize = 16;

/// What a producer holds for one finished prefill: enough to check the consumer's prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KvPayload {
    /// [`crate::tokenizer::prompt_hash`] of the prefilled prompt.
    pub(crate) prompt_hash: u64,
    /// Number of prompt tokens prefilled.
    pub(crate) prompt_tokens: usize,
    /// Request id of the prefill request (the producer's `remote_request_id`).
    pub(crate) request_id: String,
}

/// Why a consumer's read of blocks failed. Messages name the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TakeError {
    /// No live descriptor owns these blocks: never issued, already consumed or already freed.
    #[error("unknown or already consumed KV blocks {0:?}")]
    Unknown(Vec<u64>),
    /// The descriptor's lease ran out before the read.
    #[error("KV blocks {0:?} expired before they were read")]
    Expired(Vec<u64>),
    /// The block list does not match any descriptor exactly.
    #[error("KV blocks {asked:?} do not match the issued descriptor {issued:?}")]
    Mismatch {
        /// Block ids the consumer asked for.
        asked: Vec<u64>,
        /// Block ids the producer issued starting at the same block.
        issued: Vec<u64>,
    },
    /// An empty `remote_block_ids` list.
    #[error("empty remote_block_ids")]
    Empty,
}

struct Descriptor {
    block_ids: Vec<u64>,
    payload: KvPayload,
    expires_at: Instant,
}

/// vLLM producer blocks: descriptors keyed by their first block id, freed on first read or after
/// the lease.
pub(crate) struct BlockStore {
    lease: Duration,
    next_block: u64,
    live: HashMap<u64, Descriptor>,
    /// (expiry, first block) in issue order; the lease is constant so this is sorted.
    expiry: VecDeque<(Instant, u64)>,
}

impl BlockStore {
    /// A store whose descriptors live for `lease`.
    pub(crate) fn new(lease: Duration) -> Self {
        BlockStore {
            lease,
            next_block: 1,
            live: HashMap::new(),
            expiry: VecDeque::new(),
        }
    }

    /// Allocates `ceil(prompt_tokens / 16)` (at least one) fresh block ids for a finished prefill
    /// and holds them until `now + lease`. Block ids are never reused within a process.
    pub(crate) fn issue(&mut self, now: Instant, payload: KvPayload) -> Vec<u64> {
        let n = payload.prompt_tokens.div_ceil(BLOCK_TOKENS).max(1) as u64;
        let first = self.next_block;
        self.next_block += n;
        let block_ids: Vec<u64> = (first..first + n).collect();
        let expires_at = now + self.lease;
        self.live.insert(
            first,
            Descriptor {
                block_ids: block_ids.clone(),
                payload,
                expires_at,
            },
        );
        self.expiry.push_back((expires_at, first));
        block_ids
    }

    /// Reads (and frees) the descriptor owning exactly `block_ids`. A second read of the same
    /// blocks fails with [`TakeError::Unknown`]; a read at or after the lease end fails with
    /// [`TakeError::Expired`] (the entry is then freed and counted by the next [`Self::expire`]
    /// as well as returned here — callers count it once, see `expired_on_take`).
    pub(crate) fn take(&mut self, now: Instant, block_ids: &[u64]) -> Result<KvPayload, TakeError> {
        let Some(first) = block_ids.first() else {
            return Err(TakeError::Empty);
        };
        let Some(d) = self.live.get(first) else {
            return Err(TakeError::Unknown(block_ids.to_vec()));
        };
        if d.block_ids != block_ids {
            return Err(TakeError::Mismatch {
                asked: block_ids.to_vec(),
                issued: d.block_ids.clone(),
            });
        }
        if now >= d.expires_at {
            // Leave it for expire() so that it is counted exactly once as expired.
            return Err(TakeError::Expired(block_ids.to_vec()));
        }
        // Checked above that the key exists.
        let d = self.live.remove(first).ok_or(TakeError::Empty)?;
        Ok(d.payload)
    }

    /// Frees every descriptor whose lease ended at or before `now`; returns how many were freed
    /// unread (the `kv.expired` counter).
    pub(crate) fn expire(&mut self, now: Instant) -> u64 {
        let mut n = 0;
        while let Some((at, first)) = self.expiry.front().copied() {
            if at > now {
                break;
            }
            self.expiry.pop_front();
            if self.live.get(&first).is_some_and(|d| d.expires_at == at) {
                self.live.remove(&first);
                n += 1;
            }
        }
        n
    }

    /// Number of descriptors currently held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }
}

/// State of one SGLang bootstrap room on the producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RoomState {
    /// Prefill finished; KV ready to be pulled once.
    Ready(KvPayload),
    /// Prefill failed; the decode should fail fast with this reason.
    Failed(String),
}

/// Why publishing a room failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RoomError {
    /// The room id is already in use by a live room.
    #[error("bootstrap_room {0} is already published on this prefill server")]
    Duplicate(u64),
}

/// Result of a decode's pull of a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Pull {
    /// The KV, now removed from the store.
    Ready(KvPayload),
    /// The prefill for this room failed.
    Failed(String),
    /// Not published (yet); the caller may wait and retry.
    Pending,
}

/// SGLang producer rooms: published by prefill requests, pulled once by a decode, freed after
/// the lease.
pub(crate) struct RoomStore {
    lease: Duration,
    live: HashMap<u64, (RoomState, Instant)>,
    expiry: VecDeque<(Instant, u64)>,
}

impl RoomStore {
    /// A store whose rooms live for `lease`.
    pub(crate) fn new(lease: Duration) -> Self {
        RoomStore {
            lease,
            live: HashMap::new(),
            expiry: VecDeque::new(),
        }
    }

    /// Publishes `state` for `room` until `now + lease`.
    pub(crate) fn publish(
        &mut self,
        now: Instant,
        room: u64,
        state: RoomState,
    ) -> Result<(), RoomError> {
        if self.live.contains_key(&room) {
            return Err(RoomError::Duplicate(room));
        }
        let at = now + self.lease;
        self.live.insert(room, (state, at));
        self.expiry.push_back((at, room));
        Ok(())
    }

    /// Pulls `room`: a ready room is removed (consumed once), a failed one is removed too.
    pub(crate) fn take(&mut self, now: Instant, room: u64) -> Pull {
        match self.live.get(&room) {
            None => Pull::Pending,
            Some((_, at)) if now >= *at => Pull::Pending,
            Some(_) => match self.live.remove(&room) {
                Some((RoomState::Ready(p), _)) => Pull::Ready(p),
                Some((RoomState::Failed(e), _)) => Pull::Failed(e),
                None => Pull::Pending,
            },
        }
    }

    /// Frees rooms whose lease ended at or before `now`; returns how many *ready* rooms were
    /// freed unread (`kv.expired`).
    pub(crate) fn expire(&mut self, now: Instant) -> u64 {
        let mut n = 0;
        while let Some((at, room)) = self.expiry.front().copied() {
            if at > now {
                break;
            }
            self.expiry.pop_front();
            if self.live.get(&room).is_some_and(|(_, a)| *a == at)
                && let Some((state, _)) = self.live.remove(&room)
                && matches!(state, RoomState::Ready(_))
            {
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(hash: u64, tokens: usize) -> KvPayload {
        KvPayload {
            prompt_hash: hash,
            prompt_tokens: tokens,
            request_id: format!("r{hash}"),
        }
    }

    #[test]
    fn blocks_are_one_per_16_tokens_and_unique() {
        let t0 = Instant::now();
        let mut s = BlockStore::new(Duration::from_secs(30));
        let a = s.issue(t0, payload(1, 1));
        let b = s.issue(t0, payload(2, 33));
        let c = s.issue(t0, payload(3, 0));
        assert_eq!(a.len(), 1);
        assert_eq!(b.len(), 3);
        assert_eq!(c.len(), 1);
        let mut all: Vec<u64> = a.iter().chain(&b).chain(&c).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 5, "block ids are unique across requests");
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn blocks_are_consumed_once() {
        let t0 = Instant::now();
        let mut s = BlockStore::new(Duration::from_secs(30));
        let ids = s.issue(t0, payload(7, 20));
        assert_eq!(s.take(t0, &ids), Ok(payload(7, 20)));
        assert_eq!(s.take(t0, &ids), Err(TakeError::Unknown(ids.clone())));
        assert_eq!(s.len(), 0);
        assert_eq!(
            s.expire(t0 + Duration::from_secs(60)),
            0,
            "consumed is not expired"
        );
    }

    #[test]
    fn partial_or_unknown_block_lists_are_rejected() {
        let t0 = Instant::now();
        let mut s = BlockStore::new(Duration::from_secs(30));
        let ids = s.issue(t0, payload(7, 40));
        assert!(matches!(
            s.take(t0, &ids[..1]),
            Err(TakeError::Mismatch { .. })
        ));
        assert_eq!(s.take(t0, &[999]), Err(TakeError::Unknown(vec![999])));
        assert_eq!(s.take(t0, &[]), Err(TakeError::Empty));
        // The failed reads did not free the descriptor.
        assert!(s.take(t0, &ids).is_ok());
    }

    #[test]
    fn lease_expiry_frees_unread_blocks_with_injected_clock() {
        let t0 = Instant::now();
        let lease = Duration::from_secs(30);
        let mut s = BlockStore::new(lease);
        let a = s.issue(t0, payload(1, 16));
        let b = s.issue(t0 + Duration::from_secs(10), payload(2, 16));
        assert_eq!(s.expire(t0 + Duration::from_secs(29)), 0);
        // Exactly at the lease end the read fails and the entry counts as expired once.
        assert_eq!(s.take(t0 + lease, &a), Err(TakeError::Expired(a.clone())));
        assert_eq!(s.expire(t0 + lease), 1);
        assert_eq!(s.take(t0 + lease, &a), Err(TakeError::Unknown(a.clone())));
        assert!(s.take(t0 + Duration::from_secs(39), &b).is_ok());
        assert_eq!(s.expire(t0 + Duration::from_secs(100)), 0);
    }

    #[test]
    fn rooms_publish_pull_once_and_expire() {
        let t0 = Instant::now();
        let mut r = RoomStore::new(Duration::from_secs(5));
        assert_eq!(r.take(t0, 42), Pull::Pending);
        r.publish(t0, 42, RoomState::Ready(payload(9, 3))).unwrap();
        assert_eq!(
            r.publish(t0, 42, RoomState::Ready(payload(9, 3))),
            Err(RoomError::Duplicate(42))
        );
        assert_eq!(r.take(t0, 42), Pull::Ready(payload(9, 3)));
        assert_eq!(r.take(t0, 42), Pull::Pending, "consumed once");
        r.publish(t0, 43, RoomState::Failed("boom".into())).unwrap();
        assert_eq!(r.take(t0, 43), Pull::Failed("boom".into()));
        r.publish(t0, 44, RoomState::Ready(payload(1, 1))).unwrap();
        r.publish(t0, 45, RoomState::Failed("x".into())).unwrap();
        assert_eq!(r.take(t0 + Duration::from_secs(5), 44), Pull::Pending);
        assert_eq!(
            r.expire(t0 + Duration::from_secs(5)),
            1,
            "only ready rooms count"
        );
    }
}
