//! KV-aware placement end to end (docs/design/kv-aware-placement.md): simulators publishing
//! vLLM's KV events (`FleetBuilder::kv_events`, block size 4, one token per word), the router
//! subscribed to each.
//! - `requests_sharing_a_prefix_follow_the_engine_that_holds_it`: after a long prompt landed on
//!   one of two aggregated engines, requests sharing its prefix go to that engine (its own
//!   `/sim/stats` `prefix_cache.hits`, the journal's `cached_tokens`); `/narwhal/state` and
//!   `/metrics` show both engines `exact`, and the `/tokenize` cost per prompt is printed.
//! - `an_engine_restarted_in_place_gets_no_credit_for_its_old_blocks`: an engine restarted on
//!   its ports (a new process, its sequence back to 0) is not chosen for the prefix its old
//!   process held; it is `exact` again once its new process publishes.
//! - `without_kv_events_requests_sharing_a_prefix_stick_to_one_engine`: two engines that publish
//!   no events are `approximate` (`no_kv_events`); requests sharing a long prefix follow the
//!   engine the first was placed on, with the journal's `cached_tokens` the approximate
//!   index's estimate (`kv_mode: "approximate"`), confirmed by the engine's own prefix hits.
//! - `cache_awareness_turned_off_is_shown_none`: `serving.kv_aware_placement: false` shows
//!   every engine `none` (`off`) and tokenizes and subscribes nothing.
//! - `one_engine_to_choose_from_is_not_scored`: a prefill/decode pair without profiles (one
//!   prefill engine to choose from) tokenizes nothing; each request is counted
//!   `unscored` in `/narwhal/state` and `/metrics`, and the events stream is still read.
//! - `an_engine_whose_events_stop_is_shown_approximate_then_exact_again`: a request that
//!   stores new blocks is placed on an engine whose events are muted (the simulator's
//!   `mute_kv_events` fault); with `serving.kv_events_stale_s` 1 it is `approximate` (reason
//!   `stale`) in `/narwhal/state` and `/metrics` within a few seconds, a request sharing the
//!   muted prompt's prefix follows it there on the approximate credit, and it is `exact`
//!   again once it publishes.

use std::time::{Duration, Instant};

use narwhal_shared::documents::State;
use narwhal_shared::documents::state::KvEngine;
use narwhal_testkit::{Fleet, RequestRow, RouterHandle, SimHandle, WAIT, eventually};
use serde_json::{Value, json};

/// `n` words starting at word `from`: one simulator token each.
fn words(from: usize, n: usize) -> String {
    (from..from + n)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn kv_fleet() -> Fleet {
    Fleet::builder()
        .decode(2)
        .kv_events()
        .sim_args(&["--block-size", "4"])
        .start()
        .await
}

async fn complete(router: &RouterHandle, prompt: &str) {
    let body = json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": 2});
    let r = router
        .http
        .post(format!("{}/v1/completions", router.data), &body)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

async fn complete_on(sim: &SimHandle, prompt: &str) {
    let body = json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": 2});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", sim.url))
        .json(&body)
        .send()
        .await
        .expect("completion");
    assert!(r.status().is_success(), "{}", r.status());
}

/// An engine's chat answer, the count read here: `usage.prompt_tokens_details.cached_tokens`
/// (required: an answer without it does not parse).
#[derive(Debug, serde::Deserialize)]
struct CachedUsageAnswer {
    usage: CachedUsage,
}

/// `usage` of a [`CachedUsageAnswer`].
#[derive(Debug, serde::Deserialize)]
struct CachedUsage {
    prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details` of a [`CachedUsageAnswer`].
#[derive(Debug, serde::Deserialize)]
struct PromptTokensDetails {
    cached_tokens: u64,
}

async fn hits(sim: &SimHandle) -> u64 {
    sim.counters().await.prefix_cache.map_or(0, |c| c.hits)
}

/// The router's `kv_index.engines.<iid>` once `ok` holds for it (an engine the document
/// does not list is checked as all defaults).
async fn kv_engine(
    router: &RouterHandle,
    iid: &str,
    what: &str,
    ok: impl Fn(&KvEngine) -> bool,
) -> KvEngine {
    eventually(what, WAIT, || async {
        let st = router.state().await;
        let e = st.kv_index.engines.get(iid).cloned().unwrap_or_default();
        ok(&e).then_some(e)
    })
    .await
}

/// The journal rows of completed requests, in order.
/// POSTs `body` to the router's data `path` (answered 200) and returns the journal row of the
/// `n`-th request it served (1-based), once written (a row is written after its answer).
async fn served_row(router: &RouterHandle, path: &str, body: &Value, n: usize) -> RequestRow {
    let r = router
        .http
        .post(format!("{}{path}", router.data), body)
        .await;
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    let rows = eventually("the request's row", WAIT, || async {
        let r = served(router);
        (r.len() >= n).then_some(r)
    })
    .await;
    rows[n - 1].clone()
}

fn served(router: &RouterHandle) -> Vec<RequestRow> {
    router.served_requests()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_sharing_a_prefix_follow_the_engine_that_holds_it() {
    let f = kv_fleet().await;
    let router = f.router();
    // 40 tokens: 10 blocks of 4.
    let prefix = words(0, 40);
    complete(router, &prefix).await;
    let rows = eventually("the first request's journal row", WAIT, || async {
        let r = served(router);
        (!r.is_empty()).then_some(r)
    })
    .await;
    let holder = rows[0].engine().to_string();
    let other = if holder == "d0" { "d1" } else { "d0" };
    kv_engine(router, &holder, "the holder's blocks in the index", |e| {
        e.mode == "exact" && e.blocks >= 10
    })
    .await;
    let before = (hits(f.sim(&holder)).await, hits(f.sim(other)).await);
    for k in 0..4 {
        complete(router, &format!("{prefix} {}", words(100 + 10 * k, 6))).await;
    }
    let rows = eventually("five journal rows", WAIT, || async {
        let r = served(router);
        (r.len() >= 5).then_some(r)
    })
    .await;
    for r in &rows[1..] {
        assert_eq!(
            r.engine(),
            holder,
            "a shared prefix follows its blocks: {r:?}"
        );
        assert_eq!(
            r.cached_tokens,
            Some(40),
            "the index credits the 10 blocks: {r:?}"
        );
        assert!(
            r.engine_cached_tokens.is_none(),
            "an engine without --enable-prompt-tokens-details reports no count: {r:?}"
        );
    }
    assert_eq!(
        hits(f.sim(&holder)).await - before.0,
        4 * 40,
        "each hit the 40-token prefix"
    );
    assert_eq!(
        hits(f.sim(other)).await,
        before.1,
        "the other engine computed nothing of it"
    );
    let kv = router.state().await.kv_index;
    assert_eq!(
        kv.engines.get(&holder).map(|e| e.mode.as_str()),
        Some("exact"),
        "{kv:?}"
    );
    assert_eq!(kv.tokenizer, "agree", "{kv:?}");
    let n = kv.tokenized;
    let spent = kv.tokenize_seconds;
    println!(
        "tokenize cost: {n} prompts, {:.3} ms per prompt on average (loaded test machine)",
        spent * 1000.0 / n.max(1) as f64
    );
    let metrics = router.metrics().await;
    let line = format!("narwhal_kv_index_mode{{iid=\"{holder}\",mode=\"exact\"}} 1");
    assert!(metrics.contains(&line), "{line} in /metrics:\n{metrics}");
    assert!(metrics.contains("narwhal_kv_index_blocks{"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_in_place_gets_no_credit_for_its_old_blocks() {
    let mut f = kv_fleet().await;
    // d0 holds the whole 40-token prompt, d1 only its first 20 tokens (sent to each directly).
    let prompt = words(0, 40);
    complete_on(f.sim("d0"), &prompt).await;
    complete_on(f.sim("d1"), &format!("{} {}", words(0, 20), words(500, 20))).await;
    kv_engine(f.router(), "d0", "d0's blocks", |e| {
        e.mode == "exact" && e.blocks >= 10
    })
    .await;
    kv_engine(f.router(), "d1", "d1's blocks", |e| {
        e.mode == "exact" && e.blocks >= 10
    })
    .await;
    f.sim_mut("d0").restart(&[]).expect("d0 restarts in place");
    let router = f.router();
    // The router learns the new process (its monitor), drops d0's entries, and readmits it.
    kv_engine(router, "d0", "d0's entries dropped", |e| e.resets >= 1).await;
    eventually("d0 back in placement", WAIT, || async {
        let st = router.state().await;
        (st.ejected.is_empty() && st.awaiting_health.is_empty()).then_some(())
    })
    .await;
    complete(router, &prompt).await;
    let rows = eventually("the request's journal row", WAIT, || async {
        let r = served(router);
        (!r.is_empty()).then_some(r)
    })
    .await;
    let row = rows.last().expect("row");
    assert_eq!(
        row.engine(),
        "d1",
        "no credit for the old process's blocks: {row:?}"
    );
    assert_eq!(row.cached_tokens, Some(20), "{row:?}");
    // d0's new process publishes from sequence 0: exact again.
    complete_on(f.sim("d0"), &words(900, 12)).await;
    kv_engine(router, "d0", "d0 exact again", |e| {
        e.mode == "exact" && e.blocks >= 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kv_events_requests_sharing_a_prefix_stick_to_one_engine() {
    let f = Fleet::builder()
        .decode(2)
        .sim_args(&["--block-size", "4"])
        .fleet(json!({"serving": {"kv_approx_block_size": 4}}))
        .start()
        .await;
    let router = f.router();
    let prefix = words(0, 40);
    complete(router, &prefix).await;
    let rows = eventually("the first request's journal row", WAIT, || async {
        let r = served(router);
        (!r.is_empty()).then_some(r)
    })
    .await;
    assert_eq!(
        rows[0].kv_mode.as_deref(),
        Some("approximate"),
        "{:?}",
        rows[0]
    );
    assert_eq!(
        rows[0].cached_tokens,
        Some(0),
        "nothing placed yet: {:?}",
        rows[0]
    );
    let holder = rows[0].engine().to_string();
    let other = if holder == "d0" { "d1" } else { "d0" };
    let before = (hits(f.sim(&holder)).await, hits(f.sim(other)).await);
    for k in 0..4 {
        complete(router, &format!("{prefix} {}", words(100 + 10 * k, 6))).await;
    }
    let rows = eventually("five journal rows", WAIT, || async {
        let r = served(router);
        (r.len() >= 5).then_some(r)
    })
    .await;
    for r in &rows[1..] {
        assert_eq!(
            r.engine(),
            holder,
            "a shared prefix follows our own placements: {r:?}"
        );
        assert_eq!(
            r.cached_tokens,
            Some(40),
            "the approximate index credits the prefix's 10 blocks: {r:?}"
        );
        assert_eq!(r.kv_mode.as_deref(), Some("approximate"), "{r:?}");
    }
    assert_eq!(
        hits(f.sim(&holder)).await - before.0,
        4 * 40,
        "the guess was right: each hit the 40-token prefix on the engine"
    );
    assert_eq!(hits(f.sim(other)).await, before.1);
    let kv = router.state().await.kv_index;
    for e in ["d0", "d1"] {
        let v = kv.engines.get(e);
        assert_eq!(v.map(|v| v.mode.as_str()), Some("approximate"), "{kv:?}");
        assert_eq!(v.map(|v| v.reason.as_str()), Some("no_kv_events"), "{kv:?}");
    }
    assert!(
        kv.engines.get(&holder).map_or(0, |e| e.approx_blocks) >= 10,
        "{kv:?}"
    );
    let metrics = router.metrics().await;
    for line in [
        format!("narwhal_kv_index_mode{{iid=\"{holder}\",mode=\"approximate\"}} 1"),
        format!("narwhal_kv_index_reason{{iid=\"{holder}\",reason=\"no_kv_events\"}} 1"),
    ] {
        assert!(metrics.contains(&line), "{line} in /metrics:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_awareness_turned_off_is_shown_none() {
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        .sim_args(&["--block-size", "4"])
        .fleet(json!({"serving": {"kv_aware_placement": false}}))
        .start()
        .await;
    let router = f.router();
    complete(router, &words(0, 12)).await;
    let rows = eventually("the request's journal row", WAIT, || async {
        let r = served(router);
        (!r.is_empty()).then_some(r)
    })
    .await;
    assert_eq!(rows[0].cached_tokens, None, "not scored: {:?}", rows[0]);
    let kv = router.state().await.kv_index;
    for e in ["d0", "d1"] {
        let v = kv.engines.get(e);
        assert_eq!(
            v.map(|v| (v.mode.as_str(), v.reason.as_str())),
            Some(("none", "off")),
            "{kv:?}"
        );
        assert_eq!(
            v.map(|v| v.batches),
            Some(0),
            "no stream subscribed: {kv:?}"
        );
    }
    assert_eq!(kv.tokenized, 0, "nothing tokenized: {kv:?}");
    let metrics = router.metrics().await;
    assert!(
        metrics.contains("narwhal_kv_index_mode{iid=\"d0\",mode=\"none\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_engine_to_choose_from_is_not_scored() {
    let f = Fleet::builder()
        .prefill(1)
        .decode(1)
        .kv_events()
        .sim_args(&["--block-size", "4"])
        .start()
        .await;
    let router = f.router();
    for i in 0..3 {
        complete(router, &words(i * 100, 12)).await;
    }
    let kv = router.state().await.kv_index;
    assert_eq!((kv.tokenized, kv.unscored), (0, 3), "{kv:?}");
    assert_eq!(
        kv.tokenizer, "agree",
        "the tokenizer check still runs: {kv:?}"
    );
    // Still subscribed: the index stays warm for when the fleet grows.
    let p0 = kv_engine(router, "p0", "p0's events read", |e| e.batches > 0).await;
    assert_eq!(p0.mode, "exact", "{p0:?}");
    let metrics = router.metrics().await;
    assert!(
        metrics.contains("narwhal_kv_index_unscored_total 3"),
        "{metrics}"
    );
    let rows = eventually("the three journal rows", WAIT, || async {
        let r = served(router);
        (r.len() == 3).then_some(r)
    })
    .await;
    assert!(
        rows.iter().all(|r| r.cached_tokens.is_none()),
        "not scored: {rows:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_events_stop_is_shown_approximate_then_exact_again() {
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        .sim_args(&["--block-size", "4"])
        .fleet(json!({"serving": {"kv_events_stale_s": 1}}))
        .start()
        .await;
    let router = f.router();
    // Both engines publish once: exact.
    for (k, iid) in ["d0", "d1"].into_iter().enumerate() {
        complete_on(f.sim(iid), &words(1000 * (k + 1), 12)).await;
        kv_engine(router, iid, "exact after its first batch", |e| {
            e.mode == "exact"
        })
        .await;
    }
    // Whichever engine the router picks publishes nothing for the request it stores.
    for iid in ["d0", "d1"] {
        f.sim(iid)
            .fault(json!({"phase": "aggregated", "action": "mute_kv_events"}))
            .await;
    }
    complete(router, &words(0, 40)).await;
    let rows = eventually("the request's journal row", WAIT, || async {
        let r = served(router);
        (!r.is_empty()).then_some(r)
    })
    .await;
    let placed = Instant::now();
    let muted = rows[0].engine().to_string();
    let other = if muted == "d0" { "d1" } else { "d0" };
    f.sim(other).clear_faults().await;
    kv_engine(
        router,
        &muted,
        "approximate after serving.kv_events_stale_s",
        |e| e.mode == "approximate" && e.reason == "stale",
    )
    .await;
    let took = placed.elapsed();
    println!("approximate {took:?} after the request was placed (kv_events_stale_s 1)");
    assert!(
        took < Duration::from_secs(6),
        "approximate within a few seconds: {took:?}"
    );
    let kv = router.state().await.kv_index;
    assert_eq!(
        kv.engines.get(other).map(|e| e.mode.as_str()),
        Some("exact"),
        "{kv:?}"
    );
    let metrics = router.metrics().await;
    for line in [
        format!("narwhal_kv_index_mode{{iid=\"{muted}\",mode=\"approximate\"}} 1"),
        format!("narwhal_kv_index_reason{{iid=\"{muted}\",reason=\"stale\"}} 1"),
    ] {
        assert!(metrics.contains(&line), "{line} in /metrics:\n{metrics}");
    }
    // While its events are stopped, what was placed on it is credited approximately: a
    // request sharing the muted prompt's prefix follows it there.
    let before = hits(f.sim(&muted)).await;
    complete(router, &format!("{} {}", words(0, 40), words(7000, 6))).await;
    let rows = eventually("the second request's journal row", WAIT, || async {
        let r = served(router);
        (r.len() >= 2).then_some(r)
    })
    .await;
    let row = &rows[1];
    assert_eq!(row.engine(), muted.as_str(), "{row:?}");
    assert_eq!(row.kv_mode.as_deref(), Some("approximate"), "{row:?}");
    assert_eq!(row.cached_tokens, Some(40), "{row:?}");
    assert_eq!(
        hits(f.sim(&muted)).await - before,
        40,
        "the guess was right"
    );
    // Its events resume (the fault was used up): that request's new blocks make it exact
    // again, and the guesses are dropped.
    let e = kv_engine(router, &muted, "exact again once events resume", |e| {
        e.mode == "exact" && e.reason == "events"
    })
    .await;
    assert_eq!(e.approx_blocks, 0, "{e:?}");
    let metrics = router.metrics().await;
    let line = format!("narwhal_kv_index_mode{{iid=\"{muted}\",mode=\"exact\"}} 1");
    assert!(metrics.contains(&line), "{line} in /metrics:\n{metrics}");
}

/// The journal's `engine_cached_tokens` is the engine's own count of prefix-cache hit tokens
/// (`usage.prompt_tokens_details.cached_tokens`, written by vLLM under
/// `--enable-prompt-tokens-details`), beside the router's estimate `cached_tokens`: 0 for a
/// prompt's first request, then the prefix's 40 tokens on the engine that holds it, for a
/// whole answer and for a stream whose usage chunk carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_records_the_engines_cached_tokens_beside_the_estimate() {
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        .sim_args(&["--block-size", "4", "--enable-prompt-tokens-details"])
        .start()
        .await;
    let router = f.router();
    let prefix = words(0, 40);
    complete(router, &prefix).await;
    let first = eventually("the first request's journal row", WAIT, || async {
        served(router).into_iter().next()
    })
    .await;
    assert_eq!(
        first.engine_cached_tokens,
        Some(0),
        "nothing cached yet: {first:?}"
    );
    let holder = first.engine().to_string();
    kv_engine(router, &holder, "the holder's blocks in the index", |e| {
        e.mode == "exact" && e.blocks >= 10
    })
    .await;
    complete(router, &format!("{prefix} {}", words(100, 6))).await;
    let body = json!({"model": "tiny-sim", "prompt": format!("{prefix} {}", words(200, 6)),
                      "max_tokens": 2, "stream": true,
                      "stream_options": {"include_usage": true}});
    let r = router
        .http
        .post(format!("{}/v1/completions", router.data), &body)
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let rows = eventually("three journal rows", WAIT, || async {
        let r = served(router);
        (r.len() >= 3).then_some(r)
    })
    .await;
    for r in &rows[1..] {
        assert_eq!(r.engine(), holder, "{r:?}");
        assert_eq!(r.cached_tokens, Some(40), "the router's estimate: {r:?}");
        assert_eq!(
            r.engine_cached_tokens,
            Some(40),
            "the engine's own count: {r:?}"
        );
    }
    assert!(rows[2].stream, "{:?}", rows[2]);
}

/// A router that starts over engines that already hold prefixes is not ready before it rebuilt
/// its index from their replay buffers: at its first requests every engine is `exact`, and each
/// request for a prefix an engine holds goes there, credited. Before, a restarted router was
/// ready while every engine was still `waiting` and placed those requests by load, the
/// cache-miss storm of an index that starts empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_is_exact_from_its_first_request() {
    let f = kv_fleet().await;
    let first = f.router();
    let prefix = |g: usize| words(1000 * (g + 1), 40);
    let holders: Vec<String> = HOLDERS.map(String::from).to_vec();
    for (g, iid) in holders.iter().enumerate() {
        complete_on(f.sim(iid), &prefix(g)).await;
    }
    for iid in ["d0", "d1"] {
        kv_engine(first, iid, "the first router indexed its blocks", |e| {
            e.mode == "exact" && e.blocks >= 20
        })
        .await;
    }
    // A second router over the same engines: ready only once the replay rebuilt its index.
    second_router_places_by_what_is_held(&f, &prefix, &holders).await;
}

/// A router restarted gracefully keeps its approximate index (engines without KV events): the
/// first router, stopping, carries its guesses beside its state file; the second takes each
/// engine's once it has read that engine's process start and found the process they were
/// learned from. A prefix the first router placed on `d0` is credited on `d0` by the second
/// from its first request; the guesses for an engine restarted between the two are dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_restarted_gracefully_keeps_its_approximate_index_for_the_same_processes() {
    let mut f = Fleet::builder()
        .decode(2)
        .sim_args(&["--block-size", "4", "--tpot-ms", "20"])
        .fleet(json!({"serving": {"kv_approx_block_size": 4}}))
        .start()
        .await;
    let prefix = |g: usize| words(1000 * (g + 1), 40);
    let mut first = f.router.take().expect("the fleet's router");
    // Prefix 0 streams on one engine while prefix 1 is placed: by load, on the other.
    let stream = first.open_stream(&prefix(0), 100).await;
    complete(&first, &format!("{} {}", prefix(1), words(0, 6))).await;
    stream.finish().await;
    let rows = eventually("both first rows", WAIT, || async {
        let r = served(&first);
        (r.len() >= 2).then_some(r)
    })
    .await;
    // The rows come as the answers end (the stream's last); prompt 1 is 46 tokens.
    let holder = |tokens: u64| {
        rows.iter()
            .find(|r| r.engine_prompt_tokens == Some(tokens))
            .map(|r| r.engine().to_string())
            .unwrap_or_default()
    };
    let (h0, h1) = (holder(40), holder(46));
    assert!(!h0.is_empty() && !h1.is_empty() && h0 != h1, "{rows:?}");
    first.proc.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(
        first.proc.wait_exit(WAIT),
        Some(0),
        "the first router stops"
    );
    let carried = f.dir().join("state.json.kv-approx");
    assert!(
        carried.exists(),
        "the guesses are carried beside the state file"
    );
    // The engine holding prefix 1 restarts between the two routers: a new process.
    f.sim_mut(&h1).restart(&[]).expect("restart the engine");
    let second = f.start_router("second", &[]);
    for g in 0..2 {
        complete(&second, &format!("{} {}", prefix(g), words(100, 6))).await;
    }
    let rows = eventually("the second router's rows", WAIT, || async {
        let r = served(&second);
        (r.len() >= 2).then_some(r)
    })
    .await;
    assert_eq!(
        rows[0].engine(),
        h0,
        "prefix 0 goes where it was placed: {rows:?}"
    );
    assert_eq!(rows[0].kv_mode.as_deref(), Some("approximate"), "{rows:?}");
    assert_eq!(
        rows[0].cached_tokens,
        Some(40),
        "credited from the carried guesses at once: {rows:?}"
    );
    assert_eq!(
        rows[1].cached_tokens,
        Some(0),
        "the restarted engine's guesses were dropped: {rows:?}"
    );
    assert!(!carried.exists(), "the file is read once");
}

/// With `serving.engine_load_poll_s`, placement weighs the requests an engine reports running
/// or waiting beyond the router's own (another router's, clients' sent to it directly): with
/// four streams sent straight to `d0`, every request the router places goes to `d1`, and
/// `narwhal_engine_foreign_requests` shows the four; once they end, both engines serve again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_the_engines_report_beyond_the_routers_own_is_weighed_in_placement() {
    let f = Fleet::builder()
        .decode(2)
        .sim_args(&["--tpot-ms", "20"])
        .fleet(json!({"serving": {"engine_load_poll_s": 0.1, "kv_aware_placement": false}}))
        .start()
        .await;
    let router = f.router();
    let http = reqwest::Client::new();
    let mut streams = Vec::new();
    for k in 0..4 {
        let body = json!({"model": "tiny-sim", "prompt": words(500 + k, 4), "max_tokens": 400,
                          "stream": true});
        let r = http
            .post(format!("{}/v1/completions", f.sim("d0").url))
            .json(&body)
            .send()
            .await
            .expect("a stream straight to d0");
        assert!(r.status().is_success());
        streams.push(r);
    }
    let line = "narwhal_engine_foreign_requests{iid=\"d0\"} 4";
    eventually(
        "the router reads d0's four foreign requests",
        WAIT,
        || async { router.metrics().await.contains(line).then_some(()) },
    )
    .await;
    for k in 0..6 {
        complete(router, &words(100 * k, 5)).await;
    }
    let rows = eventually("six rows", WAIT, || async {
        let r = served(router);
        (r.len() >= 6).then_some(r)
    })
    .await;
    for r in &rows {
        assert_eq!(r.engine(), "d1", "d0 is busy with foreign requests: {r:?}");
    }
    drop(streams);
    let idle = "narwhal_engine_foreign_requests{iid=\"d0\"} 0";
    eventually("d0's foreign requests end", WAIT, || async {
        router.metrics().await.contains(idle).then_some(())
    })
    .await;
}

/// Four 40-token prefixes (10 blocks of 4), `holders[g]` holding prefix `g` (sent to it
/// directly: placed by load, all four could land on one engine, and the other would have
/// nothing to replay).
const HOLDERS: [&str; 4] = ["d0", "d0", "d1", "d1"];

/// Starts a second router over `f`'s engines (`d0`, `d1`) and waits for it to be ready: then
/// every engine is `exact` holding its two prefixes, and a request for prefix `g` goes to
/// `holders[g]`, credited its 40 tokens at once. The seconds it took to be ready.
async fn second_router_places_by_what_is_held(
    f: &Fleet,
    prefix: &dyn Fn(usize) -> String,
    holders: &[String],
) -> f64 {
    let t0 = Instant::now();
    let second = f.start_router("second", &[]);
    let ready = eventually("the second router ready", WAIT, || async {
        let (status, doc) = second.ready().await;
        (status == 200).then_some(doc)
    })
    .await;
    let ready_s = t0.elapsed().as_secs_f64();
    let kv = second.state().await.kv_index;
    for iid in ["d0", "d1"] {
        let e = &kv.engines[iid];
        assert_eq!(e.mode, "exact", "{iid} at readiness ({ready:?}): {kv:?}");
        assert!(e.blocks >= 20, "{iid} holds its two prefixes: {kv:?}");
    }
    for g in 0..holders.len() {
        complete(&second, &format!("{} {}", prefix(g), words(10 * g, 6))).await;
    }
    let rows = eventually("the second router's rows", WAIT, || async {
        let r = served(&second);
        (r.len() >= holders.len()).then_some(r)
    })
    .await;
    for (g, r) in rows.iter().enumerate() {
        assert_eq!(
            r.engine(),
            holders[g],
            "prefix {g} goes where it is held: {r:?}"
        );
        assert_eq!(r.kv_mode.as_deref(), Some("exact"), "{r:?}");
        assert_eq!(r.cached_tokens, Some(40), "credited at once: {r:?}");
    }
    ready_s
}

/// A router that starts after each engine published 20,000 batches more than its prefixes'
/// (vLLM's replay buffer keeps the last 10,000, and vLLM never announces a block it still
/// holds again) is `exact` at readiness with every prefix the engines hold: the agent next to
/// each engine followed its events and hands the router a snapshot, current to a batch the
/// buffer still holds, and the router follows the stream from there. Before, the prefixes
/// stored before the buffer's start were invisible until evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_started_after_the_replay_buffer_moved_on_is_exact_from_the_agents_snapshot() {
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        .agents()
        .sim_args(&["--block-size", "4"])
        .start()
        .await;
    let first = f.router();
    let prefix = |g: usize| words(3000 * (g + 1), 40);
    let holders: Vec<String> = HOLDERS.map(String::from).to_vec();
    for (g, iid) in holders.iter().enumerate() {
        complete_on(f.sim(iid), &prefix(g)).await;
    }
    const CHURN: u64 = 20_000;
    for iid in ["d0", "d1"] {
        f.sim(iid).kv_churn(CHURN).await;
    }
    // Both engines' streams went on 20,000 batches past the prefixes (the first router, which
    // followed them all along, has seen them).
    for iid in ["d0", "d1"] {
        kv_engine(first, iid, "the churn published", |e| {
            e.batches > CHURN && e.blocks >= 20
        })
        .await;
    }
    let ready_s = second_router_places_by_what_is_held(&f, &prefix, &holders).await;
    eprintln!(
        "kv_placement_e2e: a router started after {CHURN} batches per engine ready in {ready_s:.2} s"
    );
    assert!(ready_s < 15.0, "ready in {ready_s:.2} s");
}

/// Requests keyed beyond their tokens (a tenant's `cache_salt`, a LoRA adapter named in
/// `model`, both) are credited only with blocks stored under the same keys, as vLLM keys them
/// (the salt on the first block, the adapter on every block): each keyed variant of one
/// 40-token prefix is credited nothing on its first request though the plain prefix is held,
/// and its whole prefix on its second, placed where it is held; on every request the router's
/// credit (`cached_tokens`) never exceeds the engine's own count (`engine_cached_tokens`).
/// Before, a salted request was credited with the plain prefix's blocks (the index keyed by
/// tokens alone), and a request naming an adapter was refused by the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_requests_are_credited_only_with_blocks_stored_under_their_keys() {
    keyed_credit("vllm").await;
}

/// The same on SGLang's KV events (its own encoding: signed hashes, the salt in `cache_salt`
/// on every store, optional fields left out), which before failed to decode batch after
/// batch, so SGLang engines were placed by the approximate index only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_keyed_requests_are_credited_only_with_blocks_stored_under_their_keys() {
    keyed_credit("sglang").await;
}

async fn keyed_credit(dialect: &str) {
    let f = Fleet::builder()
        .dialect(dialect)
        .decode(2)
        .kv_events()
        .sim_args(&[
            "--block-size",
            "4",
            "--enable-prompt-tokens-details",
            "--lora-modules",
            "tenant-a=/adapters/a",
        ])
        .fleet(json!({"adapters": ["tenant-a"]}))
        .start()
        .await;
    let router = f.router();
    let prefix = words(5000, 40);
    let send = |extra: Value, tail: usize| {
        let mut body = json!({"model": "tiny-sim", "prompt": format!("{prefix} {}", words(tail, 6)),
                              "max_tokens": 2});
        narwhal_testkit::merge(&mut body, extra);
        async move {
            let r = router
                .http
                .post(format!("{}/v1/completions", router.data), &body)
                .await;
            assert_eq!(r.status, 200, "{body}: {}", r.text());
        }
    };
    let blocks = |st: &State, iid: &str| st.kv_index.engines.get(iid).map(|e| e.blocks);
    let variants = [
        json!({}),
        json!({"cache_salt": "tenant-a"}),
        json!({"cache_salt": "tenant-b"}),
        json!({"model": "tenant-a"}),
        json!({"model": "tenant-a", "cache_salt": "tenant-a"}),
    ];
    let mut seen = 0;
    for (v, keys) in variants.iter().enumerate() {
        for round in 0..2 {
            let before = router.state().await;
            send(keys.clone(), 100 * v + 10 * round).await;
            seen += 1;
            let rows = eventually("the request's row", WAIT, || async {
                let r = served(router);
                (r.len() >= seen).then_some(r)
            })
            .await;
            let r = &rows[seen - 1];
            let iid = r.engine().to_string();
            if round == 1 {
                assert_eq!(r.kv_mode.as_deref(), Some("exact"), "{keys}: {r:?}");
            }
            let (want_credit, want_engine) = if round == 0 { (0, 0) } else { (40, 40) };
            assert_eq!(
                r.cached_tokens,
                Some(want_credit),
                "{keys} round {round}: {r:?}"
            );
            assert_eq!(
                r.engine_cached_tokens,
                Some(want_engine),
                "{keys} round {round}: {r:?}"
            );
            if round == 0 {
                // Its 11 new blocks (prefix and tail) are in the index before the repeat.
                let had = blocks(&before, &iid).unwrap_or(0);
                kv_engine(
                    router,
                    &iid,
                    "the keyed prefix's blocks in the index",
                    |e| e.blocks >= had + 11,
                )
                .await;
            }
        }
    }
    for r in served(router) {
        let credit = r.cached_tokens.expect("scored");
        let engine = r.engine_cached_tokens.expect("engine count");
        assert!(credit <= engine, "over-credited: {r:?}");
    }
}

/// Chat requests whose template renders more than their messages (`tools`, a second BOS from
/// `add_special_tokens`, no generation prompt) are credited with exactly what the engine had:
/// the router sends those fields to `/tokenize`, so its chain is the one the engine hashed.
/// Each variant of one long system prompt is credited on every request the engine's own
/// cached-token count, never more: on its first, what it renders alike with the variants before
/// it; on its second (another user turn), the system prompt too. Before, tools
/// and `add_special_tokens` were dropped on the way to `/tokenize`: the chain differed from
/// block 0 and a repeated tool-calling prefix was never credited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_are_credited_as_their_template_renders_them() {
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        .sim_args(&["--block-size", "4", "--enable-prompt-tokens-details"])
        .start()
        .await;
    let router = f.router();
    let system = words(7000, 40);
    let tool = |name: &str| {
        json!([{"type": "function", "function": {"name": name,
            "description": "looks a thing up", "parameters": {"type": "object",
            "properties": {"q": {"type": "string"}}}}}])
    };
    let variants = [
        json!({"tools": tool("search")}),
        json!({"tools": tool("lookup")}),
        json!({"tools": tool("search"), "add_special_tokens": true}),
        json!({"add_generation_prompt": false}),
    ];
    let mut seen = 0;
    for (v, extra) in variants.iter().enumerate() {
        for round in 0..2 {
            let mut body = json!({"model": "tiny-sim", "max_tokens": 2, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": words(9000 + 100 * v + 10 * round, 6)}]});
            narwhal_testkit::merge(&mut body, extra.clone());
            seen += 1;
            let r = &served_row(router, "/v1/chat/completions", &body, seen).await;
            let prompt_tokens = r.engine_prompt_tokens.expect("the engine's prompt tokens");
            let credit = r.cached_tokens.expect("scored");
            let engine = r.engine_cached_tokens.expect("engine count");
            if round == 0 {
                // A variant shares with the earlier ones only what its template renders
                // alike (the BOS, the start of a tool definition): credited that, no more.
                assert_eq!(credit, engine, "{extra} first: {r:?}");
                assert!(engine < 40 || v > 0, "{extra} first: {r:?}");
                let iid = r.engine().to_string();
                let blocks = prompt_tokens / 4;
                kv_engine(router, &iid, "the variant's blocks in the index", |e| {
                    e.blocks >= blocks
                })
                .await;
            } else {
                assert_eq!(r.kv_mode.as_deref(), Some("exact"), "{extra}: {r:?}");
                assert!(engine >= 40, "{extra}: the system prompt was cached: {r:?}");
                assert_eq!(
                    credit, engine,
                    "{extra}: credited as the engine hashed: {r:?}"
                );
            }
        }
    }
}

/// A chat request with an image is placed by load (the router cannot compute the image's
/// key: its journal row has no credit), and the blocks it stores, keyed by the image as vLLM
/// keys them, are never credited to a text request whose tokens are the same (the image's
/// placeholder spelled out as text): that one is credited exactly the blocks before the image,
/// what the engine itself hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_stored_for_an_image_are_never_credited_to_text() {
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        .sim_args(&["--block-size", "4", "--enable-prompt-tokens-details"])
        .start()
        .await;
    let router = f.router();
    let system = words(11000, 40);
    let placeholder = ["<|image|>"; 8].join(" ");
    let image = json!({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}});
    let spelled = json!({"type": "text", "text": placeholder});
    let mut seen = 0;
    let mut send = |part: Value, tail: usize| {
        seen += 1;
        let n = seen;
        let body = json!({"model": "tiny-sim", "max_tokens": 2, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text", "text": "look at"}, part,
                                         {"type": "text", "text": words(tail, 6)}]}]});
        async move { served_row(router, "/v1/chat/completions", &body, n).await }
    };
    let first = send(image.clone(), 12000).await;
    assert!(first.cached_tokens.is_none(), "unscored: {first:?}");
    let iid = first.engine().to_string();
    kv_engine(router, &iid, "the image request's blocks", |e| {
        e.blocks >= 14
    })
    .await;
    let text = send(spelled, 12200).await;
    let credit = text.cached_tokens.expect("a text request is scored");
    let engine = text.engine_cached_tokens.expect("engine count");
    assert_eq!(text.kv_mode.as_deref(), Some("exact"), "{text:?}");
    assert_eq!(
        text.engine(),
        iid,
        "placed where its prefix is held: {text:?}"
    );
    assert!(credit >= 40, "the system prompt is credited: {text:?}");
    assert_eq!(
        credit, engine,
        "credited the blocks before the image, no more: {text:?}"
    );
    // The engine itself does hit the image's blocks for the same image (sent to it directly:
    // the router places an image request by load).
    let body = json!({"model": "tiny-sim", "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "text", "text": "look at"}, image,
                                     {"type": "text", "text": words(12100, 6)}]}]});
    let r: CachedUsageAnswer = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", f.sim(&iid).url))
        .json(&body)
        .send()
        .await
        .expect("the engine answers")
        .json()
        .await
        .expect("JSON");
    let image_hit = r.usage.prompt_tokens_details.cached_tokens;
    assert!(
        image_hit > engine,
        "the image's own blocks hit for the image ({image_hit}), not for text ({engine})"
    );
}

/// Two engines that tokenize the probe prompt and plain chat alike but render `tools`
/// differently (one's chat template drops them) are caught by the sampled tokenizer check on
/// the first tool-calling request: the state says `mismatch`, naming both engines and the
/// request shape, and scoring stops (a request is then placed by load, with no credit).
/// Before, the check compared one completion probe once: both engines stayed `exact`
/// while every tool-calling prefix was hashed two ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_that_render_tools_differently_are_caught_on_a_sampled_request() {
    let f = Fleet::builder()
        .engine("d0", "decode")
        .engine_with_args("d1", "decode", &["--template-without-tools"])
        .kv_events()
        .sim_args(&["--block-size", "4"])
        .start()
        .await;
    let router = f.router();
    let chat = |tools: bool, i: usize| {
        let messages = json!([
            {"role": "system", "content": words(13000, 20)},
            {"role": "user", "content": words(13100 + 10 * i, 4)}]);
        let body = if tools {
            json!({"model": "tiny-sim", "max_tokens": 2, "messages": messages,
                   "tools": [{"type": "function", "function": {"name": "search"}}]})
        } else {
            json!({"model": "tiny-sim", "max_tokens": 2, "messages": messages})
        };
        async move {
            let r = router
                .http
                .post(format!("{}/v1/chat/completions", router.data), &body)
                .await;
            assert_eq!(r.status, 200, "{body}: {}", r.text());
        }
    };
    chat(false, 0).await;
    chat(false, 1).await;
    let sampled = eventually("a plain chat request sampled", WAIT, || async {
        let k = router.state().await.kv_index;
        (k.tokenizer_sampled >= 1).then_some(k)
    })
    .await;
    assert_eq!(sampled.tokenizer, "agree", "{sampled:?}");
    chat(true, 2).await;
    let k = eventually("the tool-calling request's mismatch", WAIT, || async {
        let k = router.state().await.kv_index;
        (k.tokenizer == "mismatch").then_some(k)
    })
    .await;
    let detail = k.tokenizer_detail.unwrap_or_default();
    assert!(
        detail.contains("chat with tools") && detail.contains("d0") && detail.contains("d1"),
        "{detail}"
    );
    chat(true, 3).await;
    let rows = eventually("the last request's row", WAIT, || async {
        let r = served(router);
        (r.len() >= 4).then_some(r)
    })
    .await;
    assert!(
        rows[3].cached_tokens.is_none(),
        "placed by load: {:?}",
        rows[3]
    );
}

/// An engine with several data-parallel ranks (vLLM's `--data-parallel-size`: one API server,
/// a KV cache and an event stream per rank, rank `r` on the ports plus `r`) has each rank's
/// stream followed, and a request whose prefix one rank holds is credited with that rank's
/// blocks and sent there (`X-data-parallel-rank`): every repeat of a prefix is credited
/// exactly what the engine then hits. Before, only rank 0's port was subscribed, and a
/// request was left to the engine's own choice of rank, which missed the prefix on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_parallel_engine_is_credited_and_served_by_the_rank_holding_the_prefix() {
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        .data_parallel(2)
        .sim_args(&["--block-size", "4", "--enable-prompt-tokens-details"])
        .start()
        .await;
    let router = f.router();
    let mut seen = 0;
    let mut send = |prefix: usize, tail: usize| {
        seen += 1;
        let n = seen;
        let body = json!({"model": "tiny-sim", "max_tokens": 2,
            "prompt": format!("{} {}", words(20000 + 1000 * prefix, 40), words(tail, 6))});
        async move { served_row(router, "/v1/completions", &body, n).await }
    };
    // Four prefixes, each left to the engine's own choice of rank (nothing is held yet): the
    // simulator takes its ranks in turn, so both ranks of an engine hold some.
    let mut held = 0;
    for p in 0..4 {
        let r = send(p, 30000 + p).await;
        assert_eq!(r.cached_tokens, Some(0), "{r:?}");
        held += 11;
        let want = held;
        eventually("both engines' ranks' blocks in the index", WAIT, || async {
            let st = router.state().await;
            let blocks: u64 = st.kv_index.engines.values().map(|e| e.blocks).sum();
            (blocks >= want).then_some(())
        })
        .await;
    }
    for round in 1..3 {
        for p in 0..4 {
            let r = send(p, 30000 + 100 * round + p).await;
            assert_eq!(r.kv_mode.as_deref(), Some("exact"), "{r:?}");
            assert_eq!(r.cached_tokens, Some(40), "prefix {p} round {round}: {r:?}");
            assert_eq!(
                r.engine_cached_tokens,
                Some(40),
                "prefix {p} round {round}: sent to the rank that holds it: {r:?}"
            );
        }
    }
    // Each engine's credit was checked against its own counts, rank by rank: never over.
    let st = router.state().await;
    let checked: u64 = st.kv_index.engines.values().map(|e| e.credit.checked).sum();
    assert!(checked >= 8, "{:?}", st.kv_index.engines);
    assert!(
        st.kv_index
            .engines
            .values()
            .all(|e| e.credit.over_tokens == 0),
        "{:?}",
        st.kv_index.engines
    );
}

/// An engine whose cache loses blocks its events never take back (here: another prompt stored
/// with its events muted evicts the held prefix, as a lost `BlockRemoved` would) is
/// over-credited on each request for that prefix; the third in a row makes it `suspect`
/// (`/narwhal/state`, `/metrics`): its credit is still computed and journalled but it is placed
/// by load, and once its own cached-token counts agree again it is `exact`. The check holds the
/// router's credit against the engine's own `engine_cached_tokens`, per engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_over_credited_request_after_request_is_suspect_until_it_agrees() {
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        // 11 blocks: one prompt of 46 tokens fills the cache, the next evicts it.
        .sim_args(&[
            "--block-size",
            "4",
            "--enable-prompt-tokens-details",
            "--kv-cache-blocks",
            "11",
        ])
        .start()
        .await;
    let router = f.router();
    let prefix = words(7000, 40);
    complete(router, &format!("{prefix} {}", words(0, 6))).await;
    let holder = eventually("the first row", WAIT, || async {
        served(router).first().and_then(|r| r.decode_iid.clone())
    })
    .await;
    kv_engine(router, &holder, "the prefix in the index", |e| {
        e.mode == "exact" && e.blocks >= 11
    })
    .await;
    for round in 1..=3 {
        // Evicted behind the router's back: the evicting store's events are muted.
        f.sim(&holder)
            .fault(json!({"phase": "any", "action": "mute_kv_events", "count": 1}))
            .await;
        complete_on(f.sim(&holder), &words(9000 + 100 * round, 46)).await;
        complete(router, &format!("{prefix} {}", words(10 * round, 6))).await;
        let rows = eventually("the round's row", WAIT, || async {
            let r = served(router);
            (r.len() > round).then_some(r)
        })
        .await;
        let r = &rows[round];
        assert_eq!(r.engine(), holder.as_str(), "round {round}: {r:?}");
        assert_eq!(r.cached_tokens, Some(40), "round {round}: credited: {r:?}");
        assert_eq!(
            r.engine_cached_tokens,
            Some(0),
            "round {round}: evicted: {r:?}"
        );
    }
    let e = kv_engine(router, &holder, "suspect after three", |e| {
        e.mode == "suspect"
    })
    .await;
    assert_eq!(e.reason, "over_credit", "{e:?}");
    assert_eq!(e.credit.over_credited, 3, "{e:?}");
    assert_eq!(e.credit.over_tokens, 120, "{e:?}");
    let m = router.metrics().await;
    let with = |name: &str, extra: &str| {
        narwhal_testkit::metric(&m, name, &[&format!("iid=\"{holder}\""), extra])
    };
    assert_eq!(
        with("narwhal_kv_index_mode", "mode=\"suspect\""),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        with("narwhal_kv_over_credit_tokens_total", ""),
        Some(120.0),
        "{m}"
    );
    // Placed by load while suspect: the prefix now goes to the other engine (which holds it
    // after its first request there), and fresh prompts are spread by load. Requests that
    // reach the suspect engine find what its events say, so it agrees again and is `exact`.
    let mut sent = 0;
    let holder = holder.as_str();
    let prefix = prefix.as_str();
    let back = eventually("exact again", WAIT, || {
        sent += 1;
        let n = sent;
        async move {
            futures_util::future::join_all((0..4).map(|k| async move {
                let b = if k == 0 {
                    format!("{prefix} {}", words(1000 + 10 * n, 6))
                } else {
                    words(20_000 + 100 * n + 1000 * k, 46)
                };
                complete(router, &b).await
            }))
            .await;
            let st = router.state().await;
            let e = st.kv_index.engines.get(holder).cloned().unwrap_or_default();
            (e.mode == "exact").then_some(e)
        }
    })
    .await;
    assert_eq!(back.reason, "events", "{back:?}");
    let suspect_rows: Vec<RequestRow> = served(router)
        .into_iter()
        .filter(|r| r.kv_mode.as_deref() == Some("suspect"))
        .collect();
    assert!(
        !suspect_rows.is_empty(),
        "requests scored while it was suspect are journalled so"
    );
}

/// With the router's own tokenizer (`engine.tokenizer`: a model directory whose tokenizer and
/// chat template give the simulators' tokens for the words used), scored requests cost the
/// engines no `/tokenize` beyond the sampled checks, and are credited exactly what the engine
/// then hits. A shape the router renders differently from the engines (tools: the template
/// sees vLLM's `model_dump()` of them, the simulator prints them as they came) is caught by its
/// first sampled request and tokenized by the engines from then on, while the other shapes stay
/// with the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_own_tokenizer_spares_the_engines_and_falls_back_per_shape() {
    use narwhal_testkit::sim_tokenizer::{SIM_TEMPLATE, model_dir};
    let dir = tempfile::tempdir().expect("tempdir");
    let vocab: Vec<String> = (14000..14400).map(|i| format!("w{i}")).collect();
    let vocab: Vec<&str> = vocab.iter().map(String::as_str).collect();
    model_dir(dir.path(), &vocab, SIM_TEMPLATE);
    let f = Fleet::builder()
        .decode(2)
        .kv_events()
        .sim_args(&["--block-size", "4", "--enable-prompt-tokens-details"])
        .fleet(json!({"engine": {"tokenizer": dir.path()}}))
        .start()
        .await;
    let router = f.router();
    let engine_tokenizes = || async {
        let mut n = 0;
        for iid in ["d0", "d1"] {
            n += f.sim(iid).counters().await.requests.tokenize;
        }
        n
    };
    let before = engine_tokenizes().await;
    let prefix = words(14000, 40);
    let mut seen = 0;
    for i in 0..6 {
        seen += 1;
        let body = json!({"model": "tiny-sim", "max_tokens": 2,
            "prompt": format!("{prefix} {}", words(14100 + 5 * i, 4))});
        let r = served_row(router, "/v1/completions", &body, seen).await;
        let credit = r.cached_tokens.expect("scored");
        assert_eq!(
            Some(credit),
            r.engine_cached_tokens,
            "credited what the engine hit: {r:?}"
        );
        if i > 0 {
            assert!(credit >= 40, "the shared prefix followed: {r:?}");
        }
    }
    for i in 0..4 {
        seen += 1;
        let body = json!({"model": "tiny-sim", "max_tokens": 2, "messages": [
            {"role": "system", "content": words(14200, 40)},
            {"role": "user", "content": words(14300 + 5 * i, 4)}]});
        let r = served_row(router, "/v1/chat/completions", &body, seen).await;
        assert_eq!(r.cached_tokens, r.engine_cached_tokens, "{r:?}");
    }
    let k = eventually(
        "completion and chat checked against the engines",
        WAIT,
        || async {
            let k = router.state().await.kv_index;
            let t = k.router_tokenizer.clone().expect("router_tokenizer shown");
            let agree = |s: &str| t.shapes.get(s).map(String::as_str) == Some("agree");
            (agree("completion") && agree("chat") && t.checked >= 2).then_some(k)
        },
    )
    .await;
    let t = k.router_tokenizer.expect("router_tokenizer");
    assert_eq!(t.tokenized, 10, "{t:?}");
    assert_eq!(t.fallbacks, 0, "{t:?}");
    assert_eq!(t.model_dir, dir.path().display().to_string());
    // Beside the sampled checks, the engines' agreement probe: one prompt on each engine,
    // made at the first scored request.
    let spent = engine_tokenizes().await - before;
    assert_eq!(
        spent,
        t.checked + 2,
        "the engines tokenized only the sampled checks and the probe ({t:?})"
    );
    let tools = json!([{"type": "function", "function": {"name": "w14399"}}]);
    let tool_chat = |i: usize| {
        json!({"model": "tiny-sim", "max_tokens": 2, "tools": tools, "messages": [
            {"role": "user", "content": words(14350 + 5 * i, 4)}]})
    };
    seen += 1;
    served_row(router, "/v1/chat/completions", &tool_chat(0), seen).await;
    let t = eventually("the tool-calling shape's mismatch", WAIT, || async {
        let t = router.state().await.kv_index.router_tokenizer?;
        (t.shapes.get("chat with tools").map(String::as_str) == Some("mismatch")).then_some(t)
    })
    .await;
    let detail = t
        .details
        .get("chat with tools")
        .cloned()
        .unwrap_or_default();
    assert!(detail.contains("the router and d"), "{detail}");
    assert_eq!(t.shapes.get("chat").map(String::as_str), Some("agree"));
    let engine_before = engine_tokenizes().await;
    seen += 1;
    let r = served_row(router, "/v1/chat/completions", &tool_chat(1), seen).await;
    assert_eq!(
        r.cached_tokens, r.engine_cached_tokens,
        "the engines' tokens, credited right: {r:?}"
    );
    assert!(
        engine_tokenizes().await > engine_before,
        "asked of /tokenize"
    );
    let after = router
        .state()
        .await
        .kv_index
        .router_tokenizer
        .expect("shown");
    assert_eq!(
        after.tokenized, 11,
        "the router did not tokenize it: {after:?}"
    );
    let metrics = router.metrics().await;
    assert!(
        metrics.contains("narwhal_kv_index_router_tokenized_total 11"),
        "{metrics}"
    );
}
