//! The index's rules: store, remove, clear, the hash chain, a restarted sequence, gaps.

use std::time::Duration;

use narwhal_shared::kv_events::{KvEvent, KvEventBatch};

use super::*;

const BS: u32 = 4;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: BS,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        session_id: None,
    }
}

fn batch(events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    }
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Some("GPU".into()),
        group_idx: None,
    }
}

/// 12 prompt tokens: three blocks of 4.
fn prompt() -> Vec<u32> {
    (1..=12).collect()
}

fn matched(ix: &KvIndex, e: usize, tokens: &[u32]) -> u64 {
    ix.matched_tokens(e, &prompt_chain(tokens, BS), tokens.len() as u64)
}

const STALE: Duration = Duration::from_secs(5);

#[test]
fn stored_blocks_match_by_our_hash_whatever_the_engine_hashes_are() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true, true]);
    let p = prompt();
    // Two engines with different hash seeds store the same first two blocks.
    ix.apply(0, 0, &batch(vec![stored(&[11, 12], None, &p[..8])]), now);
    ix.apply(1, 0, &batch(vec![stored(&[901, 902], None, &p[..8])]), now);
    assert_eq!(matched(&ix, 0, &p), 8);
    assert_eq!(matched(&ix, 1, &p), 8);
    // The third block chains to the second through the engine's own parent hash.
    ix.apply(0, 1, &batch(vec![stored(&[13], Some(12), &p[8..12])]), now);
    // The last prompt token is always computed: a 12-token prompt hits at most 2 blocks…
    assert_eq!(matched(&ix, 0, &p), 8);
    // …and a longer prompt with that prefix hits all three.
    let longer: Vec<u32> = (1..=14).collect();
    assert_eq!(matched(&ix, 0, &longer), 12);
    assert_eq!(ix.view(0, now, STALE).blocks, 3);
    assert_eq!(ix.mode(0, now, STALE), Mode::Exact);
}

#[test]
fn a_different_prefix_does_not_match_even_with_equal_later_blocks() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let p = prompt();
    ix.apply(0, 0, &batch(vec![stored(&[1, 2, 3], None, &p)]), now);
    let mut other = p.clone();
    other[0] = 99;
    other.extend([50, 51]);
    assert_eq!(
        matched(&ix, 0, &other),
        0,
        "the chain starts at the first block"
    );
    // A block whose parent was never seen is dropped, not credited.
    ix.apply(
        0,
        1,
        &batch(vec![stored(&[7], Some(777), &[5, 6, 7, 8])]),
        now,
    );
    assert_eq!(ix.view(0, now, STALE).counters.overflow, 1);
}

#[test]
fn removed_blocks_and_cleared_engines_lose_their_credit() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let mut p = prompt();
    p.push(13);
    ix.apply(0, 0, &batch(vec![stored(&[1, 2, 3], None, &p[..12])]), now);
    assert_eq!(matched(&ix, 0, &p), 12);
    // vLLM evicts a request's tail first: removing block 2 leaves a 1-block prefix.
    ix.apply(0, 1, &batch(vec![removed(&[2])]), now);
    assert_eq!(matched(&ix, 0, &p), 4);
    ix.apply(0, 2, &batch(vec![KvEvent::AllBlocksCleared]), now);
    assert_eq!(matched(&ix, 0, &p), 0);
    assert_eq!(ix.view(0, now, STALE).blocks, 0);
}

#[test]
fn sequence_rules() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    assert_eq!(ix.sequence(0, 0, false), Seq::Next);
    assert_eq!(
        ix.sequence(0, 3, false),
        Seq::Gap { from: 0 },
        "joined late"
    );
    ix.apply(0, 0, &batch(vec![]), now);
    ix.apply(0, 1, &batch(vec![]), now);
    assert_eq!(ix.sequence(0, 2, false), Seq::Next);
    assert_eq!(ix.sequence(0, 1, false), Seq::Old);
    assert_eq!(ix.sequence(0, 5, false), Seq::Gap { from: 2 });
    assert_eq!(ix.sequence(0, 0, false), Seq::Restarted);
}

#[test]
fn a_restarted_sequence_drops_the_old_process_blocks() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let mut p = prompt();
    p.push(13);
    ix.apply(0, 0, &batch(vec![stored(&[1, 2, 3], None, &p[..12])]), now);
    ix.apply(0, 1, &batch(vec![]), now);
    let fresh = batch(vec![stored(&[70], None, &[40, 41, 42, 43])]);
    assert_eq!(ix.sequence(0, 0, false), Seq::Restarted);
    ix.restart(0, 0, &fresh, now);
    assert_eq!(matched(&ix, 0, &p), 0, "no credit for the old process");
    assert_eq!(matched(&ix, 0, &[40, 41, 42, 43, 44]), 4);
    assert_eq!(ix.view(0, now, STALE).counters.resets, 1);
    assert_eq!(ix.sequence(0, 1, false), Seq::Next);
}

#[test]
fn a_gap_is_filled_from_the_replay_or_the_engine_is_rebuilt() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true, true]);
    let mut p = prompt();
    p.push(13);
    for e in 0..2 {
        ix.apply(e, 0, &batch(vec![stored(&[1, 2, 3], None, &p[..12])]), now);
    }
    // Batch 1 (an eviction of block 3) was missed; batch 2 arrives.
    let missed = (1u64, batch(vec![removed(&[3])]));
    let b2 = batch(vec![]);
    assert_eq!(ix.sequence(0, 2, false), Seq::Gap { from: 1 });
    // Engine 0: the replay holds batch 1 (and the current one, which is skipped).
    let replayed = vec![missed.clone(), (2, b2.clone())];
    assert!(ix.fill(0, 1, Some(&replayed), 2, &b2, now));
    assert_eq!(matched(&ix, 0, &p), 8, "the replayed eviction applied");
    // Engine 1: no replay: its entries are dropped, then rebuilt from batch 2 on.
    assert!(!ix.fill(1, 1, None, 2, &b2, now));
    assert_eq!(matched(&ix, 1, &p), 0);
    // A replay that lost the batch (its buffer moved on) rebuilds too.
    ix.apply(0, 3, &batch(vec![]), now);
    assert!(!ix.fill(0, 4, Some(&[(5, batch(vec![]))]), 6, &b2, now));
    let c = ix.view(0, now, STALE).counters;
    assert_eq!((c.gaps, c.replays, c.resets), (2, 1, 1));
    assert_eq!(ix.sequence(0, 7, false), Seq::Next);
}

#[test]
fn a_new_process_seen_by_the_fleet_drops_entries_and_waits() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true, false]);
    let mut p = prompt();
    p.push(13);
    ix.sync_process(0, 1);
    ix.apply(0, 0, &batch(vec![stored(&[1, 2, 3], None, &p[..12])]), now);
    ix.sync_process(0, 1);
    assert_eq!(matched(&ix, 0, &p), 12);
    ix.sync_process(0, 2);
    assert_eq!(matched(&ix, 0, &p), 0);
    assert_eq!(ix.mode(0, now, STALE), Mode::Waiting);
    assert_eq!(
        ix.sequence(0, 0, false),
        Seq::Next,
        "the new process numbers from 0"
    );
    assert_eq!(ix.mode(1, now, STALE), Mode::None);
}

#[test]
fn an_engine_that_stops_publishing_goes_stale() {
    let t0 = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    ix.apply(0, 0, &batch(vec![]), t0);
    ix.placed(0, true, t0);
    assert_eq!(ix.mode(0, t0 + Duration::from_secs(4), STALE), Mode::Exact);
    assert_eq!(ix.mode(0, t0 + Duration::from_secs(6), STALE), Mode::Stale);
    ix.apply(0, 1, &batch(vec![]), t0 + Duration::from_secs(7));
    assert_eq!(ix.mode(0, t0 + Duration::from_secs(20), STALE), Mode::Exact);
    // A request that stores nothing never makes it stale.
    ix.placed(0, false, t0 + Duration::from_secs(20));
    assert_eq!(ix.mode(0, t0 + Duration::from_secs(60), STALE), Mode::Exact);
}

#[test]
fn memory_is_bounded_per_engine() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let n = MAX_BLOCKS_PER_ENGINE + 10;
    let hashes: Vec<u64> = (1..=n as u64).collect();
    let tokens: Vec<u32> = (0..(n as u32) * BS).collect();
    ix.apply(0, 0, &batch(vec![stored(&hashes, None, &tokens)]), now);
    let v = ix.view(0, now, STALE);
    assert_eq!(v.blocks, MAX_BLOCKS_PER_ENGINE as u64);
    assert_eq!(v.counters.overflow, 10);
}

/// On the live stream a sequence number at or below one it already delivered is another
/// process whose first batches were missed (its numbers are still below the old process's):
/// the old process's blocks are dropped, never credited. A replayed batch below the expected
/// one is only an overlap.
#[test]
fn a_live_stream_that_goes_back_is_a_new_process_even_above_zero() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let mut p = prompt();
    p.push(13);
    ix.apply(0, 0, &batch(vec![stored(&[1, 2, 3], None, &p[..12])]), now);
    ix.note_live(0, 0);
    for seq in 1..10 {
        ix.apply(0, seq, &batch(vec![]), now);
        ix.note_live(0, seq);
    }
    assert_eq!(ix.sequence(0, 4, false), Seq::Old, "a replay overlap");
    assert_eq!(
        ix.sequence(0, 4, true),
        Seq::Restarted,
        "the live stream went back"
    );
    let fresh = batch(vec![stored(&[70], None, &[40, 41, 42, 43])]);
    ix.restart(0, 4, &fresh, now);
    ix.note_live(0, 4);
    assert_eq!(matched(&ix, 0, &p), 0, "no credit for the old process");
    assert_eq!(matched(&ix, 0, &[40, 41, 42, 43, 44]), 4);
    assert_eq!(ix.sequence(0, 5, true), Seq::Next);
}
