//! KV-aware placement across a takeover (docs/design/kv-aware-placement.md section 6,
//! docs/ha.md): a primary and a warm standby sharing a file lease, two aggregated simulators
//! publishing vLLM's KV events (block size 4, one token per word), one agent each (so the new
//! primary re-checks every engine's process identity through its agent at takeover, and keeps
//! the entries of engines whose process did not change).
//! - `a_standby_keeps_a_warm_kv_index_across_a_takeover`: a long prompt lands on one engine and
//!   requests sharing its prefix follow it; the standby's own index holds that engine's blocks
//!   while it shadows; after `kill -9` of the primary the new primary's `/narwhal/state` shows
//!   the engine `exact` at once, and the first requests sharing the prefix go to it (journal
//!   `cached_tokens`, the simulator's `prefix_cache.hits`): the hit rate after the takeover is
//!   at least 0.9 × the rate before the kill (both printed).

use std::time::{Duration, Instant};

use narwhal_shared::documents::State;
use narwhal_shared::documents::state::KvEngine;
use narwhal_testkit::{
    Fleet, LEASE_TTL_S, LeaseBackend, RequestRow, RouterHandle, STANDBY_PROBE_S,
    STANDBY_TAKEOVER_AFTER, SimHandle, WAIT, eventually,
};
use serde_json::json;

/// Requests compared on each side of the kill.
const N: usize = 6;

/// `n` words starting at word `from`: one simulator token each.
fn words(from: usize, n: usize) -> String {
    (from..from + n)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn complete(router: &RouterHandle, prompt: &str) {
    let body = json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": 2});
    let r = router
        .http
        .post(format!("{}/v1/completions", router.data), &body)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

async fn hits(sim: &SimHandle) -> u64 {
    sim.counters().await.prefix_cache.map_or(0, |c| c.hits)
}

/// Router `r`'s `kv_index.engines.<iid>` once it is exact with at least `blocks` blocks.
async fn kv_engine(r: &RouterHandle, iid: &str, what: &str, blocks: u64) -> KvEngine {
    eventually(what, WAIT, || async {
        let st: State = r.get("/narwhal/state").await.json_as();
        let e = st.kv_index.engines.get(iid)?.clone();
        (e.mode == "exact" && e.blocks >= blocks).then_some(e)
    })
    .await
}

/// Router `r`'s journal rows of completed requests, in order, once there are `n`.
async fn served(r: &RouterHandle, n: usize) -> Vec<RequestRow> {
    eventually(&format!("{n} journal rows"), WAIT, || async {
        let rows = r.served_requests();
        (rows.len() >= n).then_some(rows)
    })
    .await
}

/// Of `rows`, the share placed on `holder` with index credit (`cached_tokens` > 0).
fn hit_rate(rows: &[RequestRow], holder: &str) -> f64 {
    let credited = rows
        .iter()
        .filter(|r| r.decode_iid.as_deref() == Some(holder) && r.cached_tokens.unwrap_or(0) > 0)
        .count();
    credited as f64 / rows.len().max(1) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_keeps_a_warm_kv_index_across_a_takeover() {
    let mut f = Fleet::builder()
        .decode(2)
        .kv_events()
        .sim_args(&["--block-size", "4"])
        .agents()
        .lease(LeaseBackend::File)
        .standby()
        .start()
        .await;
    let mut p = f.router.take().expect("primary");
    let s = f.standby.take().expect("standby");

    // 40 tokens: 10 blocks of 4, on whichever engine the primary picks.
    let prefix = words(0, 40);
    complete(&p, &prefix).await;
    let holder = served(&p, 1).await[0]
        .decode_iid
        .clone()
        .expect("decode_iid");
    kv_engine(&p, &holder, "the holder's blocks on the primary", 10).await;
    for k in 0..N {
        complete(&p, &format!("{prefix} {}", words(100 + 10 * k, 6))).await;
    }
    let rows = served(&p, N + 1).await;
    let before = hit_rate(&rows[1..], &holder);
    // The shadowing standby keeps its own index from the same streams.
    assert_eq!(s.controls().await.as_deref(), Some("standby"));
    kv_engine(&s, &holder, "the holder's blocks on the standby", 10).await;

    let t_kill = Instant::now();
    p.proc.kill();
    let bound = Duration::from_secs_f64(
        LEASE_TTL_S + f64::from(STANDBY_TAKEOVER_AFTER) * STANDBY_PROBE_S + 10.0,
    );
    s.wait_ready(t_kill, bound)
        .await
        .unwrap_or_else(|| panic!("no takeover:\n{}", s.proc.stderr_tail(30)));
    // Right after the takeover: the holder is exact, its blocks still there.
    let st: State = s.get("/narwhal/state").await.json_as();
    let e = st.kv_index.engines.get(&holder);
    assert_eq!(
        e.map(|e| e.mode.as_str()),
        Some("exact"),
        "the index is warm at takeover: {st:?}"
    );
    assert!(e.is_some_and(|e| e.blocks >= 10), "{e:?}");

    let hits0 = hits(f.sim(&holder)).await;
    for k in 0..N {
        complete(&s, &format!("{prefix} {}", words(500 + 10 * k, 6))).await;
    }
    let after_rows = served(&s, N).await;
    let after = hit_rate(&after_rows[..N], &holder);
    println!(
        "hit rate: {before:.2} in the {N} requests before the kill, {after:.2} in the first {N} after the takeover"
    );
    let credited = after_rows[..N]
        .iter()
        .filter(|r| r.decode_iid.as_deref() == Some(holder.as_str()))
        .count() as u64;
    assert!(
        hits(f.sim(&holder)).await - hits0 >= 40 * credited,
        "the holder's own cache hit the prefix for each request placed there"
    );
    assert!(
        after >= 0.9 * before && after > 0.0,
        "after the takeover {after:.2} vs before {before:.2}: {after_rows:#?}"
    );
    let first = &after_rows[0];
    assert_eq!(
        first.decode_iid.as_deref(),
        Some(holder.as_str()),
        "the first request after: {first:?}"
    );
    assert!(
        first.cached_tokens.unwrap_or(0) >= 40,
        "credited on the new primary: {first:?}"
    );
}
