//! End-to-end tests of the engines' health and the breaker (docs/deviations.md, "Engine health and
//! the breaker"): the health gate, busy engines, one slow probe, readmission through a generation
//! probe with backoff, the ejection bound, `engines[].health_path`, and a process restarted in
//! place. Each test names the rule it enforces; each failed before the fix.

use std::time::{Duration, Instant};

use narwhal_shared::documents::{ErrorReply, State};
use narwhal_testkit::{
    Fleet, Reply, RequestRow, RouterHandle, SimHandle, eventually, metric, parse_document,
};
use serde_json::{Value, json};

/// Faults of an engine that is still loading: `/health` 503 and completions that hang.
fn loading() -> Value {
    json!([{"phase": "health", "action": "status", "status": 503, "count": 100000},
           {"phase": "any", "action": "hang", "ms": 60000, "count": 100000}])
}

/// Requests a simulator received in every phase.
async fn requests(sim: &SimHandle) -> u64 {
    let r = sim.counters().await.requests;
    r.prefill + r.decode + r.aggregated
}

/// `n` completions one after another; the status of each and the slowest time.
async fn send(router: &RouterHandle, n: usize, tag: &str) -> (Vec<u16>, Duration) {
    let mut codes = Vec::new();
    let mut slowest = Duration::ZERO;
    for i in 0..n {
        let t0 = Instant::now();
        codes.push(
            router
                .completion(&format!("{tag} {i}"), 4)
                .await
                .status
                .as_u16(),
        );
        slowest = slowest.max(t0.elapsed());
    }
    (codes, slowest)
}

/// A 500 with `message` for `count` requests of any phase: an engine that cannot generate.
fn failing(count: u64, message: &str) -> Value {
    json!({"phase": "any", "action": "status", "status": 500, "count": count,
           "body": {"error": {"message": message}}})
}

/// One monitor tick at startup and none during the test, ejection at the first failure: only
/// what a request meets can tell the router an engine changed.
fn no_monitor() -> Value {
    json!({"controller": {"monitor_interval_s": 30},
           "recovery": {"eject_after": 1, "liveness_every": 0}})
}

/// After `p0` restarted in place: the router ejects it as a new process (its identity change
/// names `why`) and charges neither decode engine; the state once it did.
async fn the_restart_is_the_prefills(router: &RouterHandle, why: &str) -> State {
    let st = router
        .state_until("p0 ejected as a new process", |st| st.ejected == ["p0"])
        .await;
    let changed = router.event_rows_of("engine_identity_changed", "p0");
    assert!(changed[0].reason.starts_with(why), "{changed:?}");
    for d in ["d0", "d1"] {
        assert!(
            router.event_rows_of("engine_ejected", d).is_empty(),
            "{d} charged for the prefill's restart: {st:?}"
        );
    }
    st
}

/// `GET /narwhal/state`, which must answer the state document.
async fn state_of(router: &RouterHandle) -> State {
    let st = router.state().await;
    assert!(st.is_state(), "not a state document: {st:?}");
    st
}

/// The `error.type` of the router's error answer `r`.
///
/// # Panics
/// When the body is not JSON.
fn error_type(r: &Reply) -> String {
    parse_document::<ErrorReply>(&r.what, &r.text()).error.kind
}

/// Engine `iid`'s `inference_status` failure streak in `st`'s breaker; `None` when the breaker
/// lists no streaks for it.
fn inference_status(st: &State, iid: &str) -> Option<u64> {
    st.breaker.failures.get(iid).map(|f| f.inference_status)
}

/// Health gate (at startup): engines whose `/health` answers 503 while their completions hang are
/// never given a request; clients are served by the ready ones at once; the loading engines are
/// listed in `awaiting_health` and enter placement when their health answers 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loading_engine_is_never_placed_until_its_health_answers_200() {
    let mut f = Fleet::sims_only("vllm", 2, 2).await;
    for e in ["p1", "d1"] {
        f.sim(e).fault(loading()).await;
    }
    let router = f.start_router("router", &[]);
    let (codes, slowest) = send(&router, 8, "gate").await;
    assert_eq!(codes, vec![200; 8]);
    assert!(
        slowest < Duration::from_secs(2),
        "a client waited {slowest:?}"
    );
    assert_eq!(requests(f.sim("p1")).await + requests(f.sim("d1")).await, 0);
    let st = state_of(&router).await;
    assert_eq!(st.awaiting_health, ["d1", "p1"], "{st:?}");
    assert_eq!(router.ready().await.0, 200);
    // p1 finishes loading: admitted, and it takes traffic.
    f.sim_mut("p1").clear_faults().await;
    eventually("p1 admitted", Duration::from_secs(20), || async {
        (router.state().await.awaiting_health == ["d1"]).then_some(())
    })
    .await;
    assert_eq!(router.events_of("engine_admitted", "p1").len(), 1);
    let (codes, _) = send(&router, 8, "after").await;
    assert_eq!(codes, vec![200; 8]);
    assert!(requests(f.sim("p1")).await > 0, "p1 serves once admitted");
    assert_eq!(requests(f.sim("d1")).await, 0);
}

/// Health gate after an outage: an engine restarted in place that comes back still loading is out
/// of placement (its health answered 503: absent, a new process) until its health answers 200 and a
/// generation probe passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_back_from_an_outage_waits_for_its_health_again() {
    let mut f = Fleet::builder().prefill(1).decode(2).start().await;
    let faults = loading().to_string();
    f.sim_mut("d1")
        .restart(&["--faults", &faults])
        .expect("d1 restarts loading");
    let router = f.router();
    router.wait_ejected("d1").await;
    let (codes, slowest) = send(router, 10, "outage").await;
    assert_eq!(codes, vec![200; 10]);
    assert!(
        slowest < Duration::from_secs(2),
        "a client waited {slowest:?}"
    );
    assert_eq!(
        requests(f.sim("d1")).await,
        0,
        "nothing placed on a loading d1"
    );
    let ejected = router.event_rows_of("engine_ejected", "d1");
    assert!(
        ejected.iter().all(|e| e.cause == "health_probe"),
        "{ejected:?}"
    );
    f.sim_mut("d1").clear_faults().await;
    let router = f.router();
    let back = &router.first_event_typed("engine_readmitted", "d1").await;
    assert_eq!(back.evidence, "generation", "{back:?}");
}

/// Overload is not failure: while every prefill engine answers 503 (then 429), nothing is ejected
/// and clients get 503 (429) with `Retry-After`, never a 502; as soon as the engines serve again,
/// so does the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_engines_are_not_failed_and_clients_get_retry_after() {
    let f = Fleet::builder()
        .prefill(2)
        .decode(2)
        .fleet(json!({"recovery": {"eject_after": 1}}))
        .start()
        .await;
    let router = f.router();
    for status in [503u16, 429] {
        for p in ["p0", "p1"] {
            f.sim(p)
                .fault(
                    json!({"phase": "prefill", "action": "status", "status": status,
                              "count": 100000, "body": {"object": "error",
                              "message": "server busy", "type": "ServiceUnavailableError",
                              "code": status}}),
                )
                .await;
        }
        for i in 0..6 {
            let r = router.completion(&format!("busy {status} {i}"), 4).await;
            assert_eq!(r.status, status, "{}", r.text());
            assert_eq!(r.header("retry-after"), "1");
            assert_eq!(error_type(&r), "server_overloaded_error");
        }
        let st = state_of(router).await;
        assert!(st.ejected.is_empty(), "{st:?}");
        assert!(st.breaker.ejections.is_empty(), "{st:?}");
        for p in ["p0", "p1"] {
            f.sim(p).clear_faults().await;
        }
        let (codes, _) = send(router, 6, "served again").await;
        assert_eq!(codes, vec![200; 6]);
    }
}

/// Breaker hygiene: an engine serving everything whose `/health` times out once in three probes,
/// and that answers an occasional 429, stays admitted and the router stays ready throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_health_probe_neither_ejects_nor_unreadies() {
    let f = Fleet::builder()
        .engine("e0", "decode")
        .fleet(json!({"engine": {"health_timeout_s": 0.3}}))
        .start()
        .await;
    let e0 = f.sim("e0");
    let slow = json!({"phase": "health", "action": "hang", "ms": 1000, "count": 1, "skip": 2});
    e0.fault(Value::Array(vec![slow; 6])).await;
    let busy = json!({"phase": "any", "action": "status", "status": 429, "count": 1, "skip": 3});
    e0.fault(Value::Array(vec![busy; 3])).await;
    let router = f.router();
    let started = Instant::now();
    let mut not_ready = 0;
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(5) {
        if router.ready().await.0 != 200 {
            not_ready += 1;
        }
        if i < 16 {
            let r = router.completion(&format!("slow probe {i}"), 4).await;
            assert_eq!(r.status, 200, "{}", r.text());
            i += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(not_ready, 0, "/ready answered 503 {not_ready} times");
    let st = state_of(router).await;
    assert!(st.breaker.ejections.is_empty(), "{st:?}");
    let m = router.metrics().await;
    let timeouts = metric(
        &m,
        "narwhal_engine_probes_total",
        &["iid=\"e0\"", "kind=\"liveness\"", "outcome=\"timeout\""],
    );
    assert!(timeouts.unwrap_or(0.0) >= 1.0, "slow probes happened: {m}");
}

/// Readmission: without agents, an engine whose completions all fail while its `/health` answers
/// 200 is ejected once and stays out (generation probes fail, at growing intervals); clients are
/// served by its healthy peer; once it generates again it is readmitted (evidence `generation`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_cannot_generate_stays_out_with_a_growing_hold() {
    let f = Fleet::builder()
        .prefill(1)
        .decode(2)
        // Holds of 0.4 s, 0.8 s, 1.6 s (the monitor ticks every 0.2 s).
        .fleet(json!({"recovery": {"readmit_every": 2, "max_readmit_interval_s": 3.2}}))
        .start()
        .await;
    let router = f.router();
    f.sim("d0")
        .fault(failing(1000000, "CUDA error: an illegal memory access"))
        .await;
    let (codes, _) = send(router, 40, "flap").await;
    let failed = codes.iter().filter(|c| **c != 200).count();
    assert!(
        failed <= 3,
        "{failed} of 40 failed with a healthy peer: {codes:?}"
    );
    eventually(
        "three generation probes",
        Duration::from_secs(20),
        || async { (router.events_of("engine_probe", "d0").len() >= 3).then_some(()) },
    )
    .await;
    assert_eq!(router.events_of("engine_ejected", "d0").len(), 1);
    assert!(router.events_of("engine_readmitted", "d0").is_empty());
    let probes = router.event_rows_of("engine_probe", "d0");
    assert!(probes.iter().all(|p| p.outcome == "failed"), "{probes:?}");
    let at: Vec<f64> = probes.iter().map(|p| p.at).collect();
    let first_gap = at[1] - at[0];
    let second_gap = at[2] - at[1];
    // After each failed probe the hold doubles: never sooner than 0.8 s, then 1.6 s (probes
    // start on a monitor tick, so a gap can be a tick longer).
    assert!(
        first_gap > 0.7 && second_gap > 1.5 && second_gap > first_gap * 1.3,
        "the hold grows: gaps {first_gap:.2}s then {second_gap:.2}s"
    );
    f.sim("d0").clear_faults().await;
    let back = &router.first_event_typed("engine_readmitted", "d0").await;
    assert_eq!(back.evidence, "generation", "{back:?}");
}

/// The panic threshold: a role's last live engine is never ejected for inference errors; it stays
/// in placement flagged degraded, its failures visible in `/narwhal/state` and `/metrics`, and
/// serves again as soon as it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_engine_of_a_role_stays_in_placement_degraded() {
    let f = Fleet::builder().prefill(1).decode(1).start().await;
    let router = f.router();
    f.sim("d0").fault(failing(8, "CUDA error")).await;
    for i in 0..4 {
        let r = router.completion(&format!("panic {i}"), 4).await;
        assert_eq!(r.status, 502, "{}", r.text());
    }
    // Decode failures are charged once the producer is known to be the same process: all
    // eight attempts (two per request).
    let st = eventually("d0's failures charged", Duration::from_secs(10), || async {
        let st = router.state().await;
        (st.is_state() && inference_status(&st, "d0") == Some(8)).then_some(st)
    })
    .await;
    assert!(st.ejected.is_empty(), "{st:?}");
    assert_eq!(st.degraded, ["d0"], "{st:?}");
    let m = router.metrics().await;
    assert_eq!(
        metric(&m, "narwhal_engine_degraded", &["iid=\"d0\""]),
        Some(1.0),
        "{m}"
    );
    f.sim("d0").clear_faults().await;
    router.complete("recovered").await;
    assert!(state_of(router).await.degraded.is_empty());
}

/// `engines[].health_path`: an engine without `/health` (it answers 404, as llama.cpp does) is
/// placed when its health path is `/v1/models`, and never with the default; and it returns through
/// the same generation probe after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_without_health_is_probed_on_its_health_path() {
    let mut f = Fleet::builder()
        .engine("e0", "decode")
        .engine("e1", "decode")
        .no_router()
        .start()
        .await;
    let no_health = json!({"phase": "health", "action": "status", "status": 404,
                           "count": 1000000});
    for e in ["e0", "e1"] {
        f.sim(e).fault(no_health.clone()).await;
    }
    let plain = f.start_router("plain", &[]);
    let r = plain.completion("no health", 4).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(state_of(&plain).await.awaiting_health, ["e0", "e1"]);
    drop(plain);
    let spec = f
        .spec("models", "router")
        .engine_with("e0", json!({"health_path": "/v1/models"}))
        .engine_with("e1", json!({"health_path": "/v1/models"}));
    let router = narwhal_testkit::start_router(f.dir(), "models", &spec, &[]).expect("router");
    router.complete("models path").await;
    assert!(state_of(&router).await.awaiting_health.is_empty());
    // e1 killed and restarted (still without /health): out, then back through its health
    // path and a generation probe.
    let faults = no_health.to_string();
    f.sim_mut("e1").proc.kill();
    router.wait_ejected("e1").await;
    f.sim_mut("e1")
        .restart(&["--faults", &faults])
        .expect("e1 restarts");
    router
        .state_until("e1 readmitted", |st| st.ejected.is_empty())
        .await;
    let back = &router.event_rows_of("engine_readmitted", "e1")[0];
    assert_eq!(back.evidence, "generation", "{back:?}");
}

/// Identity: an SGLang prefill restarted in place on a new bootstrap port while the router saw no
/// outage is a new engine, found by the failed rendezvous: the failure is charged to the prefill
/// (ejected, `process_identity`), never to the healthy decode engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rendezvous_with_a_restarted_prefill_is_the_prefills() {
    let mut f = Fleet::builder()
        .dialect("sglang")
        .prefill(1)
        .decode(2)
        // One monitor tick at startup, none during the test: only the rendezvous can tell.
        .fleet(no_monitor())
        .start()
        .await;
    let router = f.router();
    router.complete("before").await;
    f.sim_mut("p0")
        .restart(&["--bootstrap-port", "0"])
        .expect("p0 restarts on another bootstrap port");
    let router = f.router();
    for i in 0..3 {
        let _ = router.completion(&format!("after {i}"), 4).await;
    }
    let st = the_restart_is_the_prefills(router, "bootstrap port").await;
    let ejected = router.event_rows_of("engine_ejected", "p0");
    assert_eq!(ejected[0].cause, "process_identity", "{ejected:?}");
    for d in ["d0", "d1"] {
        assert_eq!(inference_status(&st, d), Some(0), "{st:?}");
    }
}

/// Identity, vLLM: a prefill restarted in place between its prefill leg and the decode (the
/// descriptor names the old process) is a new engine: the decode's failure is the prefill's
/// (ejected, `process_identity`), never the healthy decode's, although the router saw no outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_failing_because_its_producer_restarted_is_the_producers() {
    let mut f = Fleet::builder()
        .prefill(1)
        .decode(2)
        // One monitor tick at startup, none during the test: only the failed decode can tell.
        .fleet(no_monitor())
        .start()
        .await;
    for d in ["d0", "d1"] {
        f.sim(d)
            .fault(json!({"phase": "decode", "action": "hang", "ms": 4000, "count": 1}))
            .await;
    }
    let before = f.sim("p0").counters().await.requests.prefill;
    let (http, data) = (f.router().http.clone(), f.router().data.clone());
    let request = tokio::spawn(async move {
        let body = json!({"model": "tiny-sim", "prompt": "in flight", "max_tokens": 4});
        http.post(format!("{data}/v1/completions"), &body)
            .await
            .status
    });
    eventually("the prefill leg ran", Duration::from_secs(10), || async {
        (f.sim("p0").counters().await.requests.prefill > before).then_some(())
    })
    .await;
    f.sim_mut("p0").restart(&[]).expect("p0 restarts in place");
    let _ = request.await;
    let router = f.router();
    the_restart_is_the_prefills(router, "process start").await;
}

/// A standby judges nothing but its health gate (with HA): a restart the primary drives through its
/// lifecycle (drain, restart, readmit) changes the engine's process behind the standby's back,
/// which must not make the standby eject it; after a takeover it learns every engine afresh and
/// serves at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_does_not_eject_engines_the_primary_restarted() {
    let mut f = Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .lease(narwhal_testkit::LeaseBackend::File)
        // Re-read process facts on every tick, so a standby that compared them would see
        // the restart at once.
        .fleet(json!({"recovery": {"liveness_every": 1}}))
        .standby()
        .start()
        .await;
    f.router().drain_to_complete("d0").await;
    f.sim_mut("d0").restart(&[]).expect("d0 restarts");
    let (status, doc) = f.router().readmit_engine("d0").await;
    assert_eq!(status, 200, "{doc:?}");
    // Let the standby tick over the new process for a while (a rule about something that
    // must not happen: nothing to poll for).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let standby = f.standby.take().expect("standby");
    assert!(
        standby.events_of("engine_ejected", "d0").is_empty(),
        "the standby ejected d0: {:?}",
        standby.journal_rows()
    );
    f.router_mut().proc.kill();
    standby
        .wait_controls("active", Duration::from_secs(15))
        .await;
    let ready = eventually("the new primary ready", Duration::from_secs(10), || async {
        (standby.ready().await.0 == 200).then_some(())
    });
    ready.await;
    let (codes, _) = send(&standby, 8, "after takeover").await;
    assert_eq!(codes, vec![200; 8]);
    assert!(
        standby.events_of("engine_ejected", "d0").is_empty(),
        "{:?}",
        standby.journal_rows()
    );
}

/// An engine that refuses the router itself (vLLM started with `--api-key`, the router sending
/// no key: 401 `{"error": "Unauthorized"}` on every `/v1` route while `/health` stays open) is
/// the engine's failure, never the client's (behaviour.md 6.2, class `engine_config`): every
/// request is retried on and served by its peer, and the engine is ejected with that cause in
/// `/narwhal/state`, the journal and `/metrics`. Before the fix most requests failed 401
/// `invalid_request_error` and nothing was ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_refuses_the_routers_credentials_is_ejected_and_its_peer_serves() {
    let f = Fleet::builder()
        .engine_with_args("d0", "decode", &["--api-key", "engine-secret"])
        .engine("d1", "decode")
        .start()
        .await;
    let router = f.router();
    let (codes, _) = send(router, 20, "keyed").await;
    assert!(codes.iter().all(|c| *c == 200), "{codes:?}");
    let st = router.wait_ejected("d0").await;
    assert!(
        st.breaker
            .ejections
            .iter()
            .any(|e| e.iid == "d0" && e.cause == "engine_config"),
        "{st:?}"
    );
    let ejected = router.first_event_typed("engine_ejected", "d0").await;
    assert_eq!(ejected.cause, "engine_config", "{ejected:?}");
    let refused = f.sim("d0").counters().await.unauthorized;
    assert!(refused >= 1, "d0 was never tried");
    assert_eq!(requests(f.sim("d1")).await, 20, "d1 served every request");
    let m = router.metrics().await;
    assert_eq!(
        metric(
            &m,
            "narwhal_engine_ejections_total",
            &["iid=\"d0\"", "cause=\"engine_config\""]
        ),
        Some(1.0),
        "{m}"
    );
    // Attempts on d0 are counted with their reason; no request failed.
    let requests_rows = router.request_rows();
    assert_eq!(requests_rows.len(), 20, "{:?}", router.journal_rows());
    assert!(
        requests_rows.iter().all(|r| r.status == Some(200)),
        "{requests_rows:?}"
    );
    assert!(
        requests_rows.iter().any(|r| r
            .attempt_failures
            .iter()
            .any(|x| x.reason == "engine_config")),
        "{requests_rows:?}"
    );

    // With no engine that lets the router in, the client gets a 5xx naming the phase, never
    // the engine's 401 as its own fault.
    let alone = Fleet::builder()
        .engine_with_args("d0", "decode", &["--api-key", "engine-secret"])
        .start()
        .await;
    let a = alone.router().completion("nobody lets me in", 4).await;
    let v = a.json_or_null();
    assert_eq!(a.status, 502, "{v}");
    let kind = error_type(&a);
    assert_eq!(kind, "decode", "{v}");
    assert_ne!(kind, "invalid_request_error", "{v}");
}

/// A router out of file descriptors is not its engines' failure: when its own descriptor limit
/// (`LimitNOFILE`) stops it opening engine connections, those requests are answered 503 with
/// `Retry-After` and counted `failed/local_pool`, its health probes conclude nothing, and no
/// engine is ejected (before the fix the failed connects and probes ejected a healthy engine,
/// cause `health_probe`, and the ejection bound kept the other in placement only as degraded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_out_of_descriptors_ejects_no_engine() {
    let f = Fleet::builder()
        .engine("e0", "decode")
        .engine("e1", "decode")
        .sim_args(&["--tpot-ms", "20"])
        .fleet(json!({"recovery": {"eject_after": 1}}))
        .start()
        .await;
    let router = f.router();
    router.complete("warm").await;
    let pid = router.proc.pid();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the router's descriptors")
        .count();
    let limit = open + 24;
    let set = std::process::Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={limit}:{limit}"))
        .status()
        .expect("prlimit (util-linux)");
    assert!(set.success(), "prlimit failed: {set}");
    // One connection per request, as many clients make: an idle keep-alive connection would
    // hold one of the router's descriptors for as long as the client keeps it.
    let client = narwhal_testkit::http_client()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let url = format!("{}/v1/completions", router.data);
    let replies = futures_util::future::join_all((0..80).map(|i| {
        let body =
            json!({"model": "tiny-sim", "prompt": format!("descriptors {i}"), "max_tokens": 16});
        let req = client.post(&url).json(&body).send();
        async move {
            let resp = req
                .await
                .expect("an answer, maybe after the accept backlog");
            narwhal_testkit::Reply::read(resp, "POST /v1/completions".into())
                .await
                .expect("a whole answer")
        }
    }))
    .await;
    let mut codes = std::collections::BTreeMap::new();
    for r in &replies {
        if r.status == 503 {
            assert_eq!(r.header("retry-after"), "1", "503 without Retry-After");
            assert_eq!(error_type(r), "server_overloaded_error");
        }
        *codes.entry(r.status.as_u16()).or_insert(0) += 1;
    }
    let m = router.metrics().await;
    let local = metric(&m, "narwhal_failed_total", &["reason=\"local_pool\""]).unwrap_or(0.0);
    assert!(
        local >= 1.0,
        "the limit was reached: some connects failed for descriptors ({codes:?})"
    );
    assert_eq!(
        metric(
            &m,
            "narwhal_failed_total",
            &["reason=\"engine_connection\""]
        )
        .unwrap_or(0.0),
        0.0,
        "no descriptor failure is the engine's connection failure: {codes:?}"
    );
    let ejected: Vec<_> = router
        .engine_event_rows()
        .into_iter()
        .filter(|r| r.event == "engine_ejected" || r.event == "engine_degraded")
        .collect();
    assert!(ejected.is_empty(), "{ejected:?} ({codes:?})");
    let st = state_of(router).await;
    assert!(st.breaker.ejections.is_empty(), "{st:?}");
    // Descriptors free again: served as before.
    eventually("a 200 after the burst", Duration::from_secs(10), || async {
        (router.completion("after", 4).await.status == 200).then_some(())
    })
    .await;
}

/// Where the wedged engine sits in [`a_wedged_engine_is_out_within_seconds_and_its_requests_served`].
#[derive(Debug, Clone, Copy)]
enum Wedged {
    /// `d0` of two prefill and two decode engines (vLLM split).
    Decode,
    /// `d0` as in `Decode`, every engine with an agent: its readmission goes through its agent.
    DecodeWithAgents,
    /// `p0` of two prefill and two decode engines.
    Prefill,
    /// `e0` of two aggregated engines.
    Aggregated,
}

/// One burst: `n` streaming completions at concurrency `c`, each with a 20 s client timeout;
/// the status and the time of each.
async fn burst(router: &RouterHandle, n: usize, c: usize, tag: &str) -> Vec<(u16, Duration)> {
    let client = narwhal_testkit::http_client()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client");
    let url = format!("{}/v1/completions", router.data);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let worker = || async {
        let mut out = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if i >= n {
                return out;
            }
            let body = json!({"model": "tiny-sim", "prompt": format!("{tag} {i}"),
                              "max_tokens": 4, "stream": true});
            let t0 = Instant::now();
            let status = match client.post(&url).json(&body).send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    match resp.text().await {
                        Ok(text) if status == 200 && text.contains("[DONE]") => status,
                        Ok(_) if status != 200 => status,
                        _ => 0,
                    }
                }
                Err(_) => 0,
            };
            out.push((status, t0.elapsed()));
        }
    };
    futures_util::future::join_all((0..c).map(|_| worker()))
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// A wedged engine (it accepts legs and never sends a byte while its `/health` stays 200, as a
/// wedged GPU worker behind a live API server does) is out of placement within seconds, and the
/// requests it held are served elsewhere: no client waits more than `first_token_timeout_s`
/// plus a few seconds, every request of two bursts of 60 at concurrency 8 is served, requests
/// that never touched it are never slow, and it stays out (its readmission probes fail) until
/// it generates again (behaviour.md 6.9). Before the stall watch a wedged decode engine held 4
/// clients of each burst for their whole 20 s timeout (a split's decode leg waits
/// `first_token_timeout_s + kv_transfer_timeout_s`, 32 s here) and was never ejected.
async fn a_wedged_engine_is_out_within_seconds_and_its_requests_served(wedged: Wedged) {
    const FIRST_TOKEN_S: f64 = 2.0;
    let builder = match wedged {
        Wedged::Decode | Wedged::Prefill => Fleet::builder().prefill(2).decode(2),
        Wedged::DecodeWithAgents => Fleet::builder()
            .prefill(2)
            .decode(2)
            .host("h0", &["p0", "d0"])
            .host("h1", &["p1", "d1"]),
        Wedged::Aggregated => Fleet::builder()
            .engine("e0", "decode")
            .engine("e1", "decode"),
    };
    let f = builder
        .fleet(json!({"engine": {"first_token_timeout_s": FIRST_TOKEN_S}}))
        .start()
        .await;
    let router = f.router();
    let iid = match wedged {
        Wedged::Decode | Wedged::DecodeWithAgents => "d0",
        Wedged::Prefill => "p0",
        Wedged::Aggregated => "e0",
    };
    router.complete("warm").await;
    let requests = || -> Vec<RequestRow> {
        let rows = router.request_rows().into_iter();
        rows.filter(|r| !r.terminal.is_empty()).collect()
    };
    // The journal is written after the answer: wait for the warm request's row, or it could
    // land after this count and be read as one of the bursts' (it touched the engine once).
    let before = eventually(
        "the warm request's journal row",
        Duration::from_secs(10),
        || async {
            let n = requests().len();
            (n >= 1).then_some(n)
        },
    )
    .await;
    // Every leg it is given hangs until the router gives up; its health answers 200.
    f.sim(iid)
        .fault(json!({"phase": "any", "action": "hang", "ms": 600000, "count": 1000000}))
        .await;
    let t0 = Instant::now();
    let first = burst(router, 60, 8, "wedge").await;
    let second = burst(router, 60, 8, "after").await;
    let limit = Duration::from_secs_f64(FIRST_TOKEN_S + 5.0);
    for (n, b) in [(1, &first), (2, &second)] {
        let failed: Vec<_> = b.iter().filter(|(s, _)| *s != 200).collect();
        assert!(failed.is_empty(), "burst {n}: not served {failed:?}");
        let slowest = b.iter().map(|(_, d)| *d).max().unwrap_or_default();
        assert!(
            slowest < limit,
            "burst {n}: a client waited {slowest:?} ({wedged:?} wedged)"
        );
    }
    let ejected = router.first_event_typed("engine_ejected", iid).await;
    // An aggregated leg's own limit is `first_token_timeout_s`: three of them in a row eject
    // the engine (cause `stream`) as fast as the stall watch does; a split's legs wait far
    // longer (its decode leg adds `kv_transfer_timeout_s`, its prefill leg has
    // `prefill_timeout_s`), so there only the stall watch can see it.
    match wedged {
        Wedged::Aggregated => assert!(
            ejected.cause == "stalled" || ejected.cause == "stream",
            "{ejected:?}"
        ),
        Wedged::Decode | Wedged::DecodeWithAgents | Wedged::Prefill => {
            assert_eq!(ejected.cause, "stalled", "{ejected:?}");
        }
    }
    if ejected.cause == "stalled" {
        let probe = router.event_rows_of("engine_probe", iid);
        assert!(
            probe
                .iter()
                .any(|p| p.kind == "stall" && p.outcome == "failed"),
            "the failed stall probe is journalled: {probe:?}"
        );
    }
    // Requests whose legs never touched the wedged engine were never slow; those it held
    // were failed over and served.
    let rows: Vec<RequestRow> = requests().into_iter().skip(before).collect();
    let touched = |r: &RequestRow| r.legs.iter().any(|l| l.iid.as_deref() == Some(iid));
    let held: Vec<&RequestRow> = rows.iter().filter(|r| touched(r)).collect();
    assert!(!held.is_empty(), "the wedged engine was given some request");
    for r in &held {
        assert_eq!(r.terminal, "completed", "{r:?}");
        assert!(r.attempts >= 2, "failed over: {r:?}");
    }
    for r in rows.iter().filter(|r| !touched(r)) {
        let d = r.duration_s.unwrap_or(f64::MAX);
        assert!(
            d < FIRST_TOKEN_S,
            "a request that never touched {iid} took {d} s: {r:?}"
        );
    }
    let m = router.metrics().await;
    let cause = format!("cause=\"{}\"", ejected.cause);
    assert_eq!(
        metric(
            &m,
            "narwhal_engine_ejections_total",
            &[&format!("iid=\"{iid}\""), &cause]
        ),
        Some(1.0),
        "{m}"
    );
    // Still wedged: its readmission probes fail and it stays out; once it generates it is
    // readmitted through a probe, never on its health alone.
    assert!(router.events_of("engine_readmitted", iid).is_empty());
    if matches!(wedged, Wedged::DecodeWithAgents) {
        // Its health answers 200: the router validates it through its agent (whose checks
        // generate on it and hang), and it stays out meanwhile.
        router
            .journal_event("recovery_validation_started", Some(iid))
            .await;
        assert!(router.events_of("engine_readmitted", iid).is_empty());
        assert_eq!(router.state().await.ejected, [iid]);
        return;
    }
    f.sim(iid).clear_faults().await;
    let back = router.first_event_typed("engine_readmitted", iid).await;
    assert_eq!(back.evidence, "generation", "{back:?}");
    eprintln!(
        "{wedged:?}: two bursts in {:?}, slowest {:?}",
        t0.elapsed(),
        first.iter().chain(&second).map(|(_, d)| *d).max()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_decode_engine_is_out_within_seconds_and_its_requests_served() {
    a_wedged_engine_is_out_within_seconds_and_its_requests_served(Wedged::Decode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_decode_engine_with_agents_is_validated_through_them_before_it_returns() {
    a_wedged_engine_is_out_within_seconds_and_its_requests_served(Wedged::DecodeWithAgents).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_prefill_engine_is_out_within_seconds_and_its_requests_served() {
    a_wedged_engine_is_out_within_seconds_and_its_requests_served(Wedged::Prefill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_aggregated_engine_is_out_within_seconds_and_its_requests_served() {
    a_wedged_engine_is_out_within_seconds_and_its_requests_served(Wedged::Aggregated).await;
}
