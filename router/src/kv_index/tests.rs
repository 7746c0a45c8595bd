//! The index's rules: store, remove, clear, the hash chain, a restarted sequence, gaps.

use std::time::Duration;

use narwhal_shared::kv_events::{ExtraKey, KvEvent, KvEventBatch};

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
        kv_cache_spec_kind: None,
        session_id: None,
        cache_salt: None,
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
    assert_eq!(ix.view(0, now).blocks, 3);
    assert_eq!(ix.reason(0, now), Reason::Events);
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
    assert_eq!(ix.view(0, now).counters.overflow, 1);
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
    assert_eq!(ix.view(0, now).blocks, 0);
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

/// A batch numbered `u64::MAX` is applied without overflowing the next expected number
/// (it panicked with overflow checks and wrapped to 0 without). Found by the `kv_events`
/// fuzz target (tests/fuzz/regressions/kv_events/seq_u64_max).
#[test]
fn a_batch_numbered_u64_max_does_not_overflow_the_sequence() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    ix.apply(0, u64::MAX, &batch(vec![]), now);
    assert_eq!(ix.next_seq(0), Some(u64::MAX));
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
    assert_eq!(ix.view(0, now).counters.resets, 1);
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
    let c = ix.view(0, now).counters;
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
    assert_eq!(ix.reason(0, now), Reason::Waiting);
    assert_eq!(
        ix.sequence(0, 0, false),
        Seq::Next,
        "the new process numbers from 0"
    );
    assert_eq!(ix.reason(1, now), Reason::NoEvents);
}

#[test]
fn an_engine_that_stops_publishing_goes_stale() {
    let t0 = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    ix.apply(0, 0, &batch(vec![]), t0);
    ix.placed(0, &[], BS, true, t0);
    assert_eq!(ix.reason(0, t0 + Duration::from_secs(4)), Reason::Events);
    assert_eq!(ix.reason(0, t0 + Duration::from_secs(6)), Reason::Stale);
    ix.apply(0, 1, &batch(vec![]), t0 + Duration::from_secs(7));
    assert_eq!(ix.reason(0, t0 + Duration::from_secs(20)), Reason::Events);
    // A request that stores nothing never makes it stale.
    ix.placed(0, &[], BS, false, t0 + Duration::from_secs(20));
    assert_eq!(ix.reason(0, t0 + Duration::from_secs(60)), Reason::Events);
}

#[test]
fn memory_is_bounded_per_engine() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let n = MAX_BLOCKS_PER_ENGINE + 10;
    let hashes: Vec<u64> = (1..=n as u64).collect();
    let tokens: Vec<u32> = (0..(n as u32) * BS).collect();
    ix.apply(0, 0, &batch(vec![stored(&hashes, None, &tokens)]), now);
    let v = ix.view(0, now);
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

// The approximate part and the modes.

fn credit(ix: &KvIndex, e: usize, tokens: &[u32], now: Instant) -> Credit {
    let chain = prompt_chain(tokens, ix.credit_block_size(e));
    ix.credit(e, &chain, tokens.len() as u64, now)
}

fn place(ix: &mut KvIndex, e: usize, tokens: &[u32], now: Instant) {
    let c = credit(ix, e, tokens, now);
    let chain = prompt_chain(tokens, c.block_size);
    ix.placed(e, &chain, c.block_size, c.stores, now);
}

fn settings() -> Settings {
    Settings {
        approx_block_size: BS,
        approx_ttl: Duration::from_secs(120),
        ..Settings::default()
    }
}

#[test]
fn an_engine_without_events_is_credited_approximately_from_placements() {
    let t = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::with(&[false, false], settings());
    let long: Vec<u32> = (1..=14).collect();
    let c = credit(&ix, 0, &long, t);
    assert_eq!(
        (c.reason, c.cached, c.stores, c.block_size),
        (Reason::NoEvents, 0, true, BS)
    );
    assert_eq!(c.reason.mode(), Mode::Approximate);
    place(&mut ix, 0, &long, t);
    // Three full blocks credited to engine 0 only; a prompt sharing two of them gets 8.
    let shares: Vec<u32> = (1..=8).chain(100..110).collect();
    assert_eq!(credit(&ix, 0, &shares, t).cached, 8);
    assert_eq!(credit(&ix, 1, &shares, t).cached, 0);
    assert_eq!(credit(&ix, 0, &long, t).cached, 12);
    assert!(!credit(&ix, 0, &long, t).stores);
    assert_eq!(ix.view(0, t).approx.blocks, 3);
    assert_eq!(ix.view(0, t).mode, Mode::Approximate);
    // Gone after the TTL.
    assert_eq!(
        credit(&ix, 0, &long, t + Duration::from_secs(120)).cached,
        0
    );
    // A new process behind the engine holds none of it.
    ix.sync_process(0, 1);
    place(&mut ix, 0, &long, t);
    ix.sync_process(0, 2);
    assert_eq!(credit(&ix, 0, &long, t).cached, 0);
}

#[test]
fn approximate_credit_counts_the_configured_share() {
    let c = Credit {
        reason: Reason::NoEvents,
        cached: 100,
        reported: 0,
        stores: false,
        block_size: BS,
    };
    assert_eq!(uncached(120, &c, 1.0), 20);
    assert_eq!(uncached(120, &c, 0.5), 70);
    let exact = Credit {
        reason: Reason::Events,
        ..c
    };
    assert_eq!(uncached(120, &exact, 0.5), 20, "exact credit counts whole");
    let off = Credit {
        reason: Reason::Off,
        ..c
    };
    assert_eq!(uncached(120, &off, 1.0), 120);
    let suspect = Credit {
        reason: Reason::OverCredit,
        ..c
    };
    assert_eq!(
        uncached(120, &suspect, 1.0),
        120,
        "a suspect engine is placed by load"
    );
}

/// An engine over-credited `SUSPECT_AFTER` times in a row is `suspect` (its credit still
/// computed, with the reported part, for the check); agreement makes it `exact` again; a new
/// process starts it `exact`.
#[test]
fn an_over_credited_engine_is_suspect_until_it_agrees_again() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let p = prompt();
    ix.apply(0, 0, &batch(vec![stored(&[11, 12, 13], None, &p)]), now);
    let chain = prompt_chain(&p, BS);
    let c = ix.credit(0, &chain, 12, now);
    assert_eq!((c.reason, c.cached, c.reported), (Reason::Events, 8, 8));
    for _ in 0..check::SUSPECT_AFTER {
        ix.observe(0, c.reported, c.cached, 0);
    }
    assert_eq!(ix.reason(0, now), Reason::OverCredit);
    assert_eq!(ix.view(0, now).mode, Mode::Suspect);
    let c = ix.credit(0, &chain, 12, now);
    assert_eq!(
        (c.cached, c.reported),
        (8, 8),
        "still computed while suspect"
    );
    for _ in 0..check::AGREE_AFTER {
        ix.observe(0, c.reported, c.cached, 8);
    }
    assert_eq!(ix.reason(0, now), Reason::Events);
    for _ in 0..check::SUSPECT_AFTER {
        ix.observe(0, 8, 8, 0);
    }
    ix.sync_process(0, 1);
    ix.sync_process(0, 2);
    assert_eq!(ix.view(0, now).credit.checked, 9);
    assert!(
        !ix.view(0, now).credit.suspect,
        "a new process is not suspect"
    );
}

#[test]
fn an_exact_engine_keeps_a_placements_guess_until_its_own_events_tell_those_blocks() {
    let t = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let s = |x: f64| t + Duration::from_secs_f64(x);
    let mut ix = KvIndex::with(&[true], settings());
    let p = prompt();
    let long: Vec<u32> = (1..=14).collect();
    // Waiting (no batch yet): approximate.
    assert_eq!(credit(&ix, 0, &long, t).reason, Reason::Waiting);
    place(&mut ix, 0, &long, t);
    assert_eq!(credit(&ix, 0, &long, t).cached, 12, "waiting: guessed");
    // Its first batch reports only the first block: exact; the guesses of the two blocks it
    // has not reported stay (their prefill may still be queued), counted as exact.
    ix.apply(0, 0, &batch(vec![stored(&[11], None, &p[..4])]), t);
    let c = credit(&ix, 0, &long, t);
    assert_eq!((c.reason, c.cached), (Reason::Events, 12));
    assert_eq!(
        ix.view(0, t).approx.blocks,
        2,
        "the reported block is settled"
    );
    // A batch about another prompt settles nothing of this one.
    ix.apply(
        0,
        1,
        &batch(vec![stored(&[31], None, &[70, 71, 72, 73])]),
        s(1.0),
    );
    assert_eq!(credit(&ix, 0, &long, s(1.0)).cached, 12);
    // Its own BlockStored of the second block: exact, no longer a guess.
    ix.apply(
        0,
        2,
        &batch(vec![stored(&[12], Some(11), &p[4..8])]),
        s(2.0),
    );
    assert_eq!(ix.view(0, s(2.0)).approx.blocks, 1);
    // A placement of blocks the engine reports held guesses only the rest.
    place(&mut ix, 0, &long, s(2.0));
    assert_eq!(ix.view(0, s(2.0)).approx.blocks, 1);
    // The engine evicts the second block: the credit stops at the first (exact wins).
    ix.apply(0, 3, &batch(vec![removed(&[12])]), s(3.0));
    let c = credit(&ix, 0, &long, s(3.0));
    assert_eq!((c.reason, c.cached), (Reason::Events, 4));
}

#[test]
fn an_exact_engines_guess_lives_kv_pending_s_and_a_gap_or_a_clear_drops_every_guess() {
    let t = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let s = |x: f64| t + Duration::from_secs_f64(x);
    let mut ix = KvIndex::with(&[true], settings());
    let long: Vec<u32> = (1..=14).collect();
    ix.apply(
        0,
        0,
        &batch(vec![stored(&[31], None, &[70, 71, 72, 73])]),
        t,
    );
    place(&mut ix, 0, &long, t);
    // Batches keep coming (the engine is not stale); the prompt's own never does.
    ix.apply(0, 1, &batch(vec![]), s(4.0));
    assert_eq!(credit(&ix, 0, &long, s(9.0)).reason, Reason::Events);
    assert_eq!(credit(&ix, 0, &long, s(9.9)).cached, 12);
    let c = credit(&ix, 0, &long, s(10.0));
    assert_eq!(
        (c.reason, c.cached),
        (Reason::Events, 0),
        "the guess counts serving.kv_pending_s (10 s by default)"
    );
    // An unreplayed gap drops every guess.
    place(&mut ix, 0, &long, s(10.0));
    assert_eq!(credit(&ix, 0, &long, s(10.0)).cached, 12);
    assert!(!ix.fill(0, 2, None, 4, &batch(vec![]), s(10.0)));
    assert_eq!(credit(&ix, 0, &long, s(10.0)).cached, 0);
    assert_eq!(ix.view(0, s(10.0)).approx.blocks, 0);
    // So does AllBlocksCleared.
    place(&mut ix, 0, &long, s(11.0));
    assert_eq!(credit(&ix, 0, &long, s(11.0)).cached, 12);
    ix.apply(0, 5, &batch(vec![KvEvent::AllBlocksCleared]), s(11.0));
    assert_eq!(credit(&ix, 0, &long, s(11.0)).cached, 0);
}

#[test]
fn an_engine_whose_events_stop_is_approximate_with_what_it_reported_and_was_placed() {
    let t = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::with(&[true], settings());
    let p = prompt();
    // It reported blocks 1..4 and 5..8, and one block of another prompt.
    ix.apply(
        0,
        0,
        &batch(vec![
            stored(&[11, 12], None, &p[..8]),
            stored(&[21], None, &[50, 51, 52, 53]),
        ]),
        t,
    );
    // A prompt extending them is placed: it must store the third block.
    let long: Vec<u32> = (1..=14).collect();
    place(&mut ix, 0, &long, t);
    let later = t + Duration::from_secs(6);
    let c = credit(&ix, 0, &long, later);
    assert_eq!(
        c.reason,
        Reason::Stale,
        "no batch 5 s after a storing placement"
    );
    assert_eq!(c.reason.mode(), Mode::Approximate);
    assert_eq!(c.cached, 12, "the reported two blocks and the placed third");
    // A prompt of what it reported and no placement touched is credited too (its reports
    // count for the TTL after its last batch).
    let other: Vec<u32> = (50..=53).chain(200..206).collect();
    assert_eq!(credit(&ix, 0, &other, later).cached, 4);
    assert_eq!(
        credit(&ix, 0, &other, t + Duration::from_secs(121)).cached,
        0,
        "what it reported counts for the TTL after its last batch"
    );
    // Its events resume: exact again, every guess dropped (what it stored while its events
    // were stopped and never reported is not credited: under-credit, never over-credit).
    ix.apply(0, 1, &batch(vec![]), later);
    let c = credit(&ix, 0, &long, later);
    assert_eq!((c.reason, c.cached), (Reason::Events, 8));
    assert_eq!(ix.view(0, later).approx.blocks, 0);
}

#[test]
fn cache_awareness_off_is_none_and_credits_nothing() {
    let t = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::with(
        &[true, false],
        Settings {
            aware: false,
            ..settings()
        },
    );
    let long: Vec<u32> = (1..=14).collect();
    for e in 0..2 {
        place(&mut ix, e, &long, t);
        let c = credit(&ix, e, &long, t);
        assert_eq!(
            (c.reason, c.reason.mode(), c.cached),
            (Reason::Off, Mode::None, 0)
        );
        assert_eq!(ix.view(e, t).approx.blocks, 0);
    }
}

/// Only the GPU tier of the first KV cache group is credited: a store from vLLM's CPU
/// offloading (another medium, another block size, no token ids), a removal there, another
/// group's events and an event type this router does not know are skipped and counted; the
/// block size the engine is credited at and its blocks stay as the GPU events made them.
#[test]
fn lower_tiers_other_groups_and_unknown_events_are_skipped_and_counted() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let p = prompt();
    ix.apply(0, 0, &batch(vec![stored(&[11, 12, 13], None, &p)]), now);
    let cpu_store = KvEvent::BlockStored {
        block_hashes: vec![11, 12, 13],
        parent_block_hash: None,
        token_ids: Vec::new(),
        block_size: 256,
        lora_id: None,
        medium: Some("CPU".into()),
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        kv_cache_spec_kind: None,
        session_id: None,
        cache_salt: None,
    };
    let cpu_removed = KvEvent::BlockRemoved {
        block_hashes: vec![11, 12, 13],
        medium: Some("CPU".into()),
        group_idx: None,
    };
    let mut other_group = stored(&[21], None, &p[..4]);
    if let KvEvent::BlockStored {
        group_idx,
        block_size,
        ..
    } = &mut other_group
    {
        *group_idx = Some(1);
        *block_size = 2;
    }
    let other_group_removed = KvEvent::BlockRemoved {
        block_hashes: vec![11],
        medium: Some("GPU".into()),
        group_idx: Some(1),
    };
    let unknown = KvEvent::Other {
        kind: "BlockPromoted".into(),
    };
    ix.apply(
        0,
        1,
        &batch(vec![
            cpu_store,
            cpu_removed,
            other_group,
            other_group_removed,
            unknown,
        ]),
        now,
    );
    assert_eq!(ix.credit_block_size(0), BS, "the GPU block size stays");
    assert_eq!(
        matched(&ix, 0, &p),
        8,
        "every GPU block still held (the last token is computed)"
    );
    let v = ix.view(0, now);
    assert_eq!(v.counters.skipped, 5, "{v:?}");
    assert_eq!(v.counters.resets, 0, "never a reset");
    assert_eq!(v.reason, Reason::Events, "still exact");
}

/// A store of KV cache group `group` whose kind is `kind`, as vLLM 0.32 publishes a hybrid
/// model's events (`KVCacheManager.take_events` names each store's group kind).
fn group_store(hashes: &[u64], tokens: &[u32], group: u32, kind: &str) -> KvEvent {
    let mut e = stored(hashes, None, tokens);
    if let KvEvent::BlockStored {
        group_idx,
        kv_cache_spec_kind,
        ..
    } = &mut e
    {
        *group_idx = Some(group);
        *kv_cache_spec_kind = Some(kind.to_string());
    }
    e
}

/// A hybrid model (a sliding-window group 0, the full-attention group 1, as vLLM numbers
/// groups by layer order; vLLM publishes the same block hashes in every group) is credited by
/// its full-attention group, which decides a prefix hit
/// in vLLM's `HybridKVCacheCoordinator`: the sliding-window group's stores and removals are
/// skipped, the full-attention group's applied, its removals too. Before, group 0 was
/// credited whatever its kind: a sliding window, which drops all but its last blocks.
#[test]
fn a_hybrid_model_is_credited_by_its_full_attention_group() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let mut ix = KvIndex::new(&[true]);
    let p = prompt();
    ix.apply(
        0,
        0,
        &batch(vec![
            group_store(&[11, 12, 13], &p, 0, "sliding_window"),
            group_store(&[11, 12, 13], &p, 1, "full_attention"),
        ]),
        now,
    );
    assert_eq!(matched(&ix, 0, &p), 8);
    assert_eq!(ix.view(0, now).blocks, 3);
    // The sliding window drops its early blocks: nothing changes for the hit.
    let window_removed = KvEvent::BlockRemoved {
        block_hashes: vec![11, 12],
        medium: Some("GPU".into()),
        group_idx: Some(0),
    };
    ix.apply(0, 1, &batch(vec![window_removed]), now);
    assert_eq!(matched(&ix, 0, &p), 8);
    // The full-attention group's removal is the hit's.
    let full_removed = KvEvent::BlockRemoved {
        block_hashes: vec![12],
        medium: Some("GPU".into()),
        group_idx: Some(1),
    };
    ix.apply(0, 2, &batch(vec![full_removed]), now);
    assert_eq!(matched(&ix, 0, &p), 4);
    let v = ix.view(0, now);
    assert_eq!(v.counters.skipped, 2, "{v:?}");
    // An engine that names no kinds (older vLLM, one group) is credited by group 0.
    let mut ix = KvIndex::new(&[true]);
    ix.apply(0, 0, &batch(vec![stored(&[1, 2, 3], None, &p)]), now);
    assert_eq!(matched(&ix, 0, &p), 8);
}

/// A `BlockStored` of a keyed request: `lora` in `lora_name` and first on every block, the
/// salt on the first block, as vLLM 0.32 publishes them (`to_event_extra_keys`).
fn keyed_store(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    lora: Option<&str>,
    salt: Option<&str>,
) -> KvEvent {
    let first = parent.is_none();
    let keys = (0..hashes.len())
        .map(|i| {
            let ks: Vec<ExtraKey> = lora
                .iter()
                .chain(salt.iter().filter(|_| first && i == 0))
                .map(|s| ExtraKey::Text((*s).to_string()))
                .collect();
            (!ks.is_empty()).then_some(ks)
        })
        .collect();
    let mut e = stored(hashes, parent, tokens);
    if let KvEvent::BlockStored {
        lora_name,
        extra_keys,
        ..
    } = &mut e
    {
        *lora_name = lora.map(str::to_string);
        *extra_keys = Some(keys);
    }
    e
}

/// [`keyed_store`] as SGLang 0.5 publishes it: no `extra_keys`, the salt in `cache_salt` on
/// every event of the salted prefix (its radix tree keys whole prefixes by it).
fn sglang_store(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    lora: Option<&str>,
    salt: Option<&str>,
) -> KvEvent {
    let mut e = stored(hashes, parent, tokens);
    if let KvEvent::BlockStored {
        lora_name,
        cache_salt,
        ..
    } = &mut e
    {
        *lora_name = lora.map(str::to_string);
        *cache_salt = salt.map(str::to_string);
    }
    e
}

fn keyed_matched(ix: &KvIndex, e: usize, tokens: &[u32], keys: PromptKeys<'_>) -> u64 {
    ix.matched_tokens(
        e,
        &keyed_chain(tokens, BS, keys.seed()),
        tokens.len() as u64,
    )
}

/// Blocks are credited only to requests with the keys they were stored under: a salted
/// tenant's blocks to the same salt, an adapter's blocks to the same adapter, and a plain
/// prompt's blocks to neither (vLLM keys the salt on the first block and the adapter on every
/// block, so each is its own chain). A salt equal to an adapter's name is still another key:
/// the event says which is which (`lora_name`).
#[test]
fn blocks_are_credited_only_under_the_keys_they_were_stored_with() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let p = prompt();
    let plain = PromptKeys::default();
    let salt_a = PromptKeys {
        salt: Some("tenant-a"),
        ..plain
    };
    let salt_b = PromptKeys {
        salt: Some("tenant-b"),
        ..plain
    };
    let lora = PromptKeys {
        lora: Some("tenant-a"),
        ..plain
    };
    let lora_salted = PromptKeys {
        lora: Some("tenant-a"),
        salt: Some("tenant-a"),
    };
    let all = [plain, salt_a, salt_b, lora, lora_salted];
    type Store = fn(&[u64], Option<u64>, &[u32], Option<&str>, Option<&str>) -> KvEvent;
    let engines: [(&str, Store); 2] = [("vllm", keyed_store), ("sglang", sglang_store)];
    for ((engine, store), stored_as) in engines
        .into_iter()
        .flat_map(|e| all.into_iter().map(move |k| (e, k)))
    {
        let mut ix = KvIndex::new(&[true]);
        // Stored in two batches: the second continues the first by its parent, as vLLM
        // stores a prompt whose first blocks were already cached.
        ix.apply(
            0,
            0,
            &batch(vec![store(
                &[11],
                None,
                &p[..4],
                stored_as.lora,
                stored_as.salt,
            )]),
            now,
        );
        ix.apply(
            0,
            1,
            &batch(vec![store(
                &[12, 13],
                Some(11),
                &p[4..],
                stored_as.lora,
                stored_as.salt,
            )]),
            now,
        );
        for asked in all {
            // Two of the three blocks: the prompt's last token is always computed.
            let want = if asked == stored_as { 8 } else { 0 };
            assert_eq!(
                keyed_matched(&ix, 0, &p, asked),
                want,
                "{engine}: stored as {stored_as:?}, asked as {asked:?}"
            );
        }
    }
}

/// A block keyed by what no request carries to the router (a multimodal item, a
/// prompt-embeddings digest, a key of a shape no engine sent before) is held, and removable by
/// its engine hash, but never credited to a text request of the same tokens; the blocks chained
/// after it neither.
#[test]
fn blocks_keyed_by_images_or_embeddings_are_never_credited_to_text() {
    let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock);
    let p = prompt();
    let shapes = [
        ExtraKey::Media {
            identifier: "img-0".into(),
            offset: 1,
        },
        ExtraKey::Digest(vec![1, 2, 3]),
        ExtraKey::Other(vec![0x90]),
    ];
    for key in shapes {
        let mut ix = KvIndex::new(&[true]);
        let mut e = stored(&[21, 22, 23], None, &p);
        if let KvEvent::BlockStored { extra_keys, .. } = &mut e {
            *extra_keys = Some(vec![None, Some(vec![key.clone()]), None]);
        }
        ix.apply(0, 0, &batch(vec![e]), now);
        // The first block had no extra key: it is the text prompt's; the rest are not.
        assert_eq!(matched(&ix, 0, &p), 4, "{key:?}");
        assert_eq!(ix.view(0, now).blocks, 3, "{key:?}");
        ix.apply(0, 1, &batch(vec![removed(&[22, 23])]), now);
        assert_eq!(ix.view(0, now).blocks, 1, "{key:?}");
    }
}
