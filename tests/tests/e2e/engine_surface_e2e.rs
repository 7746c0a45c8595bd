//! Engine surfaces are the engines', not the simulator's (docs/engine-simulator.md).
//!
//! - The simulator's test hooks (`/sim/*`) live on its admin listener only; its engine port
//!   answers 404 for them, as a real vLLM or SGLang server does.
//! - The simulator's `/metrics` carries the engines' own KV-transfer families (vLLM's NIXL
//!   connector counters, SGLang's disaggregation metrics), counted per transfer it really does,
//!   and leaves them out with `--no-kv-metrics`.
//! - The agent's transfer evidence comes from those families and the decode's own outcome:
//!   `confirmed`, `inferred` or `refuted` (real `narwhal-agent` processes, real mutual TLS,
//!   signed answers verified as the router verifies them).
//! - Drain and readmission (the six checks) run through `narwhal-serve` on both dialects.

use std::sync::Arc;

use narwhal_shared::agent_client::Verified;
use narwhal_shared::attestation::KvConsumePayload;
use narwhal_shared::documents::LifecycleReply;
use narwhal_shared::documents::lifecycle::Engine;
use narwhal_shared::{
    AgentClient, AgentEndpoint, AgentTimeouts, Fence, PublicKey, SystemClock, TransferVerdict,
};
use narwhal_testkit::{Answer, Fleet, Http, RouterHandle, SimHandle, metric};
use serde::Deserialize;
use serde_json::{Value, json};

/// A simulator's `--ready-file` document, the field read here.
#[derive(Debug, Deserialize)]
struct SimReady {
    /// Base URL of its admin listener.
    admin: String,
}

// ---------------------------------------------------------------------------------------------
// The simulator's surfaces.

/// A simulator started with exactly `args` (its defaults otherwise), in its own directory.
fn raw_sim(args: &[&str]) -> (SimHandle, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = SimHandle::start_raw(dir.path(), "sim", args).expect("narwhal-engine-sim");
    (s, dir)
}

fn http() -> Http {
    Http::new(std::time::Duration::from_secs(10))
}

/// A simulator started without `--admin-listen` (scripts older than the admin listener) still
/// answers the hooks on its engine port, so their fault injection keeps working; everything in
/// this project passes `--admin-listen` (`SimHandle`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_admin_listen_the_hooks_are_also_on_the_engine_port_for_older_scripts() {
    let http = http();
    let dir = tempfile::tempdir().expect("tempdir");
    let s = SimHandle::start_raw_legacy(dir.path(), "sim", &[]).expect("narwhal-engine-sim");
    let fault = json!({"phase": "decode", "action": "drop"});
    assert_eq!(
        http.post(format!("{}/sim/faults", s.url), &fault)
            .await
            .status,
        200
    );
    assert_eq!(s.faults().await.len(), 1);
    assert_eq!(http.get(format!("{}/sim/stats", s.url)).await.status, 200);
    assert_eq!(http.get(format!("{}/v1/models", s.url)).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_hooks_are_served_only_on_the_admin_listener() {
    let http = http();
    for dialect in ["vllm", "sglang"] {
        let (s, _dir) = raw_sim(&["--dialect", dialect]);
        assert_ne!(s.admin, s.url, "{dialect}: a listener of its own");
        let ready: SimReady = serde_json::from_value(s.ready.clone())
            .unwrap_or_else(|e| panic!("{dialect}: ready file: {e}: {}", s.ready));
        assert_eq!(ready.admin, s.admin);
        // The engine port is the engine's: no hooks, a 404 as from vLLM or SGLang.
        for (method, path) in [
            ("GET", "/sim/stats"),
            ("GET", "/sim/faults"),
            ("POST", "/sim/faults"),
            ("DELETE", "/sim/faults"),
            ("POST", "/sim/stats/reset"),
        ] {
            let url = format!("{}{path}", s.url);
            let r = match method {
                "GET" => http.get(&url).await,
                "POST" => {
                    http.post(&url, &json!({"phase": "decode", "action": "drop"}))
                        .await
                }
                _ => http.delete(&url).await,
            };
            assert_eq!(r.status, 404, "{dialect} engine port {method} {path}");
        }
        // Nothing was queued through the engine port, and the admin listener serves the hooks.
        assert_eq!(s.faults().await, []);
        assert_eq!(s.counters().await.dialect, dialect);
        // The admin listener serves nothing of the engine's.
        for path in ["/v1/models", "/metrics", "/health"] {
            let r = http.get(format!("{}{path}", s.admin)).await;
            assert_eq!(r.status, 404, "{dialect} admin {path}");
        }
        assert_eq!(http.get(format!("{}/v1/models", s.url)).await.status, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_keeps_its_port_across_a_restart() {
    let mut f = Fleet::sims_only("vllm", 1, 1).await;
    let before = f.sim("d0").admin.clone();
    f.sim_mut("d0").restart(&[]).expect("restart d0");
    assert_eq!(f.sim("d0").admin, before);
    assert_eq!(f.sim("d0").counters().await.requests.decode, 0);
}

/// A vLLM prefill on `p` (through the engine port): its descriptor.
async fn vllm_prefill(http: &Http, p: &SimHandle, prompt: &str) -> Value {
    let r = http
        .post(
            format!("{}/v1/completions", p.url),
            &json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json_as::<Answer>()
        .kv_transfer_params
        .unwrap_or(Value::Null)
}

/// A vLLM decode on `d` with descriptor `kv` (non-streaming): the status.
async fn vllm_decode(http: &Http, d: &SimHandle, prompt: &str, kv: &Value) -> u16 {
    http.post(
        format!("{}/v1/completions", d.url),
        &json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": 2,
                "kv_transfer_params": kv}),
    )
    .await
    .status
    .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_metrics_count_nixl_transfers_the_simulator_really_did() {
    let http = http();
    let f = Fleet::sims_only("vllm", 1, 1).await;
    let (p, d) = (f.sim("p0"), f.sim("d0"));
    let page = || async { http.get(format!("{}/metrics", d.url)).await.text() };
    let xfers = |m: &str| metric(m, "vllm:nixl_xfer_time_seconds_count", &["engine=\"0\""]);
    let failed = |m: &str| metric(m, "vllm:nixl_num_failed_transfers_total", &["engine=\"0\""]);
    let m = page().await;
    assert_eq!((xfers(&m), failed(&m)), (Some(0.0), Some(0.0)), "{m}");
    assert!(m.contains("# TYPE vllm:nixl_xfer_time_seconds histogram"));
    assert!(m.contains("# TYPE vllm:nixl_num_failed_transfers counter"));

    let kv = vllm_prefill(&http, p, "count me").await;
    assert_eq!(vllm_decode(&http, d, "count me", &kv).await, 200);
    let m = page().await;
    assert_eq!((xfers(&m), failed(&m)), (Some(1.0), Some(0.0)), "{m}");
    assert_eq!(
        metric(&m, "vllm:nixl_xfer_time_seconds_bucket", &["le=\"+Inf\""]),
        Some(1.0)
    );
    // The same descriptor again: the blocks were consumed, the read fails.
    assert_eq!(vllm_decode(&http, d, "count me", &kv).await, 500);
    let m = page().await;
    assert_eq!((xfers(&m), failed(&m)), (Some(1.0), Some(1.0)), "{m}");
    // An aggregated request moves neither.
    let r = http
        .post(
            format!("{}/v1/completions", d.url),
            &json!({"model": "tiny-sim", "prompt": "local", "max_tokens": 1}),
        )
        .await;
    assert_eq!(r.status, 200);
    let m = page().await;
    assert_eq!((xfers(&m), failed(&m)), (Some(1.0), Some(1.0)), "{m}");
    // Prometheus counters are not reset with the test statistics.
    assert_eq!(
        http.post(format!("{}/stats/reset", d.admin_url()), &json!({}))
            .await
            .status,
        200
    );
    assert_eq!(xfers(&page().await), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_metrics_count_decode_transfers_and_failures() {
    let http = http();
    let f = Fleet::sims_only("sglang", 1, 1).await;
    let (p, d) = (f.sim("p0"), f.sim("d0"));
    let page = || async { http.get(format!("{}/metrics", d.url)).await.text() };
    let stage = "stage=\"decode_transferred\"";
    let m = page().await;
    // Declared from the start; the labelled series appear at their first increment.
    assert!(m.contains("# TYPE sglang:per_stage_req_latency_seconds histogram"));
    assert!(m.contains("# TYPE sglang:num_transfer_failed_reqs_total counter"));
    assert_eq!(
        metric(&m, "sglang:per_stage_req_latency_seconds_count", &[stage]),
        None
    );
    let room = 4242u64;
    let body = |extra: Value| {
        let mut b = json!({"model": "tiny-sim", "prompt": "rendezvous", "max_tokens": 2,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": room});
        if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        b
    };
    let prefill = http
        .post(
            format!("{}/v1/completions", p.url),
            &body(json!({"max_tokens": 1})),
        )
        .await;
    assert_eq!(prefill.status, 200, "{}", prefill.text());
    let decode = http
        .post(format!("{}/v1/completions", d.url), &body(json!({})))
        .await;
    assert_eq!(decode.status, 200, "{}", decode.text());
    let m = page().await;
    assert_eq!(
        metric(&m, "sglang:per_stage_req_latency_seconds_count", &[stage]),
        Some(1.0),
        "{m}"
    );
    // An injected transfer failure is counted as SGLang counts one, and the decode fails.
    d.fault(json!({"phase": "decode", "action": "fail_transfer"}))
        .await;
    let decode = http
        .post(
            format!("{}/v1/completions", d.url),
            &body(json!({"bootstrap_room": room + 1})),
        )
        .await;
    assert_eq!(decode.status, 500, "{}", decode.text());
    assert!(decode.text().contains("injected transfer failure"));
    let m = page().await;
    assert_eq!(
        metric(&m, "sglang:num_transfer_failed_reqs_total", &[]),
        Some(1.0),
        "{m}"
    );
    // vLLM's recompute policy is not SGLang's: refused, naming the field.
    let r = http
        .post(
            format!("{}/faults", d.admin_url()),
            &json!({"phase": "decode", "action": "fail_transfer", "policy": "recompute"}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("policy"), "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_kv_metrics_leaves_the_transfer_families_out() {
    let http = http();
    for dialect in ["vllm", "sglang"] {
        let (s, _dir) = raw_sim(&["--dialect", dialect, "--no-kv-metrics"]);
        let m = http.get(format!("{}/metrics", s.url)).await.text();
        assert!(!m.contains(":nixl_"), "{dialect}: {m}");
        assert!(!m.contains("per_stage_req_latency"), "{dialect}: {m}");
        assert!(!m.contains("failed_reqs"), "{dialect}: {m}");
        // vLLM's default registry publishes the process start; SGLang's multiprocess one
        // does not (the router must not rely on it there).
        assert_eq!(
            m.contains("process_start_time_seconds"),
            dialect == "vllm",
            "{dialect}: {m}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The agent's evidence, signed and verified.

/// `p0` behind agent `a`, `d0` behind agent `b`, no router; every simulator gets `sim_args`.
async fn two_hosts(dialect: &str, sim_args: &[&str]) -> Fleet {
    Fleet::builder()
        .dialect(dialect)
        .engine("p0", "prefill")
        .engine("d0", "decode")
        .host("a", &["p0"])
        .host("b", &["d0"])
        .sim_args(sim_args)
        .no_router()
        .start()
        .await
}

/// The router's client for agent `id` (pinned key, router certificate), as in agent_e2e.
fn client(f: &Fleet, id: &str) -> AgentClient {
    let a = f.agent(id);
    AgentClient::new(
        AgentEndpoint {
            agent_id: id.into(),
            url: a.url.clone(),
            server_name: a.server_name.clone(),
            public_key: PublicKey::parse(&a.public_key).expect("agent key"),
        },
        &f.certs().tls_files("router"),
        AgentTimeouts::default(),
        Arc::new(SystemClock),
    )
    .expect("agent client")
}

fn fence() -> Fence {
    Fence {
        epoch: 1,
        holder: "router-a".into(),
    }
}

/// One KV check: agent `a` produces on `p0` under `check_id`, agent `b` consumes on `d0`.
async fn kv_check(f: &Fleet, check_id: &str) -> Verified<KvConsumePayload> {
    let (a, b) = (client(f, "a"), client(f, "b"));
    let produced = a
        .kv_produce("p0", &fence(), "tiny-sim", check_id)
        .await
        .expect("produce");
    assert!(produced.payload.result.ok, "{:?}", produced.payload.result);
    let kv = produced
        .payload
        .kv
        .clone()
        .expect("descriptor or rendezvous");
    b.kv_consume("d0", &fence(), "tiny-sim", check_id, kv)
        .await
        .expect("consume answer")
}

/// The fault of a KV transfer that fails on the decode side (vLLM's default
/// `kv_load_failure_policy` "fail"; SGLang aborts).
fn fail_transfer() -> Value {
    json!({"phase": "decode", "action": "fail_transfer"})
}

/// With `fault` on `d0` (if any), one KV check ([`kv_check`]) whose transfer is refuted.
async fn refuted_check(
    f: &Fleet,
    fault: Option<Value>,
    check_id: &str,
) -> Verified<KvConsumePayload> {
    if let Some(fault) = fault {
        f.sim("d0").fault(fault).await;
    }
    let c = kv_check(f, check_id).await;
    let t = &c.payload.transfer;
    assert_eq!(t.verdict, Some(TransferVerdict::Refuted), "{t:?}");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_engines_transfer_counters_the_evidence_is_confirmed() {
    for (dialect, source, counter) in [
        (
            "vllm",
            "vllm_nixl_metrics",
            "vllm:nixl_xfer_time_seconds_count",
        ),
        (
            "sglang",
            "sglang_disaggregation_metrics",
            "sglang:per_stage_req_latency_seconds_count{stage=\"decode_transferred\"}",
        ),
    ] {
        let f = two_hosts(dialect, &[]).await;
        let c = kv_check(&f, &format!("{dialect}-confirmed")).await;
        let (r, t) = (&c.payload.result, &c.payload.transfer);
        assert!(r.ok && r.tokens >= 1, "{dialect}: {r:?}");
        assert_eq!(
            t.verdict,
            Some(TransferVerdict::Confirmed),
            "{dialect}: {t:?}"
        );
        assert_eq!(t.source, source);
        assert_eq!(t.consumed_delta, Some(1), "{dialect}: {t:?}");
        assert_eq!(t.failed_delta, Some(0), "{dialect}: {t:?}");
        assert_eq!(t.transferred, Some(true), "legacy field for older routers");
        let detail = t.detail.as_deref().unwrap_or_default();
        assert!(
            detail.contains(&format!("{counter} rose by 1")),
            "{dialect}: {detail}"
        );
        if dialect == "vllm" {
            // vLLM computes the last token of a transferred prompt, nothing more; the rest
            // came over the connector.
            assert_eq!(t.recomputed_delta, Some(1), "{t:?}");
            assert!(
                detail.contains("source=\"external_kv_transfer\"} rose by"),
                "{detail}"
            );
        } else {
            assert_eq!(
                t.recomputed_delta, None,
                "SGLang publishes no sources: {t:?}"
            );
        }
        assert_eq!(f.sim("d0").counters().await.kv.consumed, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_transfer_counters_a_successful_decode_is_inferred() {
    for dialect in ["vllm", "sglang"] {
        let f = two_hosts(dialect, &["--no-kv-metrics"]).await;
        let c = kv_check(&f, &format!("{dialect}-inferred")).await;
        let (r, t) = (&c.payload.result, &c.payload.transfer);
        assert!(r.ok && r.tokens >= 1, "{dialect}: the check passes: {r:?}");
        assert_eq!(
            t.verdict,
            Some(TransferVerdict::Inferred),
            "{dialect}: {t:?}"
        );
        assert_eq!(t.source, "none");
        assert_eq!(t.transferred, None, "an older router still refuses it");
        assert_eq!((t.consumed_delta, t.failed_delta), (None, None));
        assert!(
            t.detail
                .as_deref()
                .is_some_and(|d| d.contains("publishes no KV-transfer counters")),
            "{t:?}"
        );
        // The simulator did transfer: only the evidence is weaker.
        assert_eq!(f.sim("d0").counters().await.kv.consumed, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_transfer_is_refuted_and_fails_the_check_naming_it() {
    // vLLM, kv_load_failure_policy "recompute": the decode itself succeeds; only the NIXL
    // failure counter shows the transfer failed.
    let f = two_hosts("vllm", &[]).await;
    let c = refuted_check(
        &f,
        Some(json!({"phase": "decode", "action": "fail_transfer", "policy": "recompute"})),
        "vllm-recompute",
    )
    .await;
    let (r, t) = (&c.payload.result, &c.payload.transfer);
    assert_eq!(t.failed_delta, Some(1), "{t:?}");
    assert_eq!(t.transferred, Some(false));
    assert!(!r.ok, "the agent's KV check fails: {r:?}");
    let err = r.error.as_deref().unwrap_or_default();
    assert!(
        err.starts_with("KV transfer refuted: ")
            && err.contains("vllm:nixl_num_failed_transfers_total rose by 1"),
        "{err}"
    );
    assert!(r.tokens >= 1, "the engine served the prompt recomputed");
    // vLLM's prompt tokens by source show the recompute: the whole prompt computed locally.
    assert!(
        t.recomputed_delta.is_some_and(|d| d > 1),
        "local_compute rose by the prompt: {t:?}"
    );
    let kv = f.sim("d0").counters().await.kv;
    assert_eq!((kv.rejected, kv.recomputed), (1, 1), "{kv:?}");

    // Policy "fail" (vLLM's default): the decode fails with the engine's message.
    let c = refuted_check(&f, Some(fail_transfer()), "vllm-fail").await;
    let (r, t) = (&c.payload.result, &c.payload.transfer);
    assert!(!r.ok);
    assert!(
        r.error
            .as_deref()
            .is_some_and(|e| e.contains("injected transfer failure")),
        "{r:?}"
    );
    let detail = t.detail.as_deref().unwrap_or_default();
    assert!(
        detail.contains("the decode with the KV handle failed")
            && detail.contains("vllm:nixl_num_failed_transfers_total rose by 1"),
        "{detail}"
    );

    // SGLang aborts a failed transfer; its counter names it.
    let f = two_hosts("sglang", &[]).await;
    let c = refuted_check(&f, Some(fail_transfer()), "sglang-fail").await;
    let (r, t) = (&c.payload.result, &c.payload.transfer);
    assert!(!r.ok);
    assert!(
        t.detail
            .as_deref()
            .is_some_and(|d| d.contains("sglang:num_transfer_failed_reqs_total")),
        "{t:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_consumer_that_is_not_in_decode_mode_is_refuted() {
    // Restarted without its disaggregation mode, the decode engine serves the rendezvous
    // request recomputed; its /server_info says so, whatever its counters say.
    let mut f = two_hosts("sglang", &["--no-kv-metrics"]).await;
    f.sim_mut("d0")
        .restart(&["--disaggregation-mode", "null"])
        .expect("restart d0 in null mode");
    let c = refuted_check(&f, None, "sglang-null").await;
    let r = &c.payload.result;
    assert!(!r.ok);
    let err = r.error.as_deref().unwrap_or_default();
    assert!(err.contains("disaggregation_mode \"null\""), "{err}");
    assert_eq!(f.sim("d0").counters().await.kv.consumed, 0);
}

// ---------------------------------------------------------------------------------------------
// Drain and readmission through the router, with the hooks off the engine port.

/// A P/D fleet of `dialect` with one agent per engine, every simulator started with `sim_args`.
async fn lab(dialect: &str, sim_args: &[&str]) -> (Fleet, RouterHandle) {
    let mut f = Fleet::builder()
        .dialect(dialect)
        .prefill(1)
        .decode(1)
        .agents()
        .sim_args(sim_args)
        .restart_policy("individual")
        .start()
        .await;
    let r = f.router.take().expect("router");
    (f, r)
}

/// The six readmission checks (plus the final health) of `iid` on `dialect`, in order; SGLang
/// has no direct generation (its decode needs a rendezvous).
fn expected_checks(dialect: &str, iid: &str) -> Vec<String> {
    let fabric = match iid {
        "d0" => "fabric consume from p0",
        _ => "fabric produce to d0",
    };
    let mut c = vec!["health", "attestation", "model", "new process identity"];
    if dialect == "vllm" {
        c.push("generation");
    }
    c.extend([fabric, "final health"]);
    c.into_iter().map(str::to_string).collect()
}

/// `POST /narwhal/lifecycle/readmit` of engine `iid` alone: `(status, reply)`, typed.
async fn readmit(r: &RouterHandle, iid: &str) -> (u16, LifecycleReply) {
    r.lifecycle_post("readmit", &json!({"engines": [iid]}))
        .await
}

/// Engine `iid`'s entry of a lifecycle reply.
///
/// # Panics
/// When the reply does not list it.
fn entry<'a>(doc: &'a LifecycleReply, iid: &str) -> &'a Engine {
    doc.document
        .engine(iid)
        .unwrap_or_else(|| panic!("{iid} in the reply: {doc:#?}"))
}

fn assert_checks(got: &[String], want: &[String], ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: checks {got:?}");
    for (g, w) in got.iter().zip(want) {
        if w == "attestation" {
            assert!(g.starts_with("attestation "), "{ctx}: {g:?} in {got:?}");
        } else {
            assert_eq!(g, w, "{ctx}: checks {got:?}");
        }
    }
}

/// Drains `iid`, restarts its simulator, readmits it: 200 with every check passed, then P/D
/// traffic is served again.
async fn drain_restart_readmit(f: &mut Fleet, r: &RouterHandle, iid: &str) {
    let ctx = format!("{} {iid}", f.dialect);
    let (status, doc) = r.drain_engine(iid).await;
    assert_eq!(status, 200, "{ctx}: {doc:#?}");
    r.journal_event("drain_complete", Some(iid)).await;
    f.sim_mut(iid).restart(&[]).expect("restart");
    let (status, doc) = readmit(r, iid).await;
    assert_eq!(
        status,
        200,
        "{ctx}: {doc:#?}\nrouter log: {}",
        r.proc.stderr_tail(40)
    );
    let e = entry(&doc, iid);
    assert_eq!(e.state.as_str(), "active", "{ctx}: {doc:#?}");
    assert_checks(&e.checks, &expected_checks(&f.dialect, iid), &ctx);
    let before = f.sim("d0").counters().await.kv.consumed;
    r.complete(&format!("served after {iid} came back")).await;
    let after = f.sim("d0").counters().await.kv.consumed;
    assert!(after > before, "{ctx}: P/D traffic after the readmission");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_and_readmission_pass_on_confirmed_evidence_with_the_hooks_off_the_engine_port() {
    for dialect in ["vllm", "sglang"] {
        let (mut f, r) = lab(dialect, &[]).await;
        drain_restart_readmit(&mut f, &r, "d0").await;
        // The router shows the consume check's evidence: on vLLM, the decode computed only
        // the last prompt token (vllm:prompt_tokens_by_source), the rest came transferred.
        let evidence = r.state().await.kv_evidence;
        let e = evidence.get("d0");
        assert_eq!(
            e.and_then(|e| e.verdict),
            Some(TransferVerdict::Confirmed),
            "{dialect}: {evidence:?}"
        );
        let recomputed = e.and_then(|e| e.recomputed_delta);
        match dialect {
            "vllm" => assert_eq!(recomputed, Some(1), "{evidence:?}"),
            _ => assert!(recomputed.is_none(), "{evidence:?}"),
        }
        drain_restart_readmit(&mut f, &r, "p0").await;
    }
}

/// Engines that publish no KV-transfer counters (older vLLM, SGLang without `--enable-metrics`):
/// the agent's evidence is `inferred`, which the readmission must accept (docs/agent.md).
/// Fails until the router accepts it: `router/src/lifecycle/driver.rs` `kv_consume` still
/// requires `transfer.transferred == Some(true)` (`t.transferred.unwrap_or(false)`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_and_readmission_pass_on_inferred_evidence_when_engines_publish_no_counters() {
    for dialect in ["vllm", "sglang"] {
        let (mut f, r) = lab(dialect, &["--no-kv-metrics"]).await;
        drain_restart_readmit(&mut f, &r, "d0").await;
        drain_restart_readmit(&mut f, &r, "p0").await;
    }
}

/// Engines started with an API key (vLLM `--api-key`: 401 on `/v1/*` without the bearer
/// token; `/health`, `/metrics`, `/version` open): with the key in the agents' config
/// (`engines[].api_key_file`) and the router's (`engine.engine_api_key_env`), P/D traffic is
/// served and a drained, restarted engine readmits through all six checks. Before the fix the
/// agent sent no key, so an engine was excluded at start (`/v1/models: HTTP 401`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_in_front_of_keyed_engines_readmit_through_the_six_checks() {
    let mut f = Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .engine_api_key("sk-engine-test")
        .restart_policy("individual")
        .start()
        .await;
    let r = f.router.take().expect("router");
    r.complete("served by keyed engines").await;
    // Nobody reached the engines without the key.
    for iid in ["p0", "d0"] {
        assert_eq!(f.sim(iid).counters().await.unauthorized, 0, "{iid}");
    }
    drain_restart_readmit(&mut f, &r, "d0").await;
    drain_restart_readmit(&mut f, &r, "p0").await;
    for iid in ["p0", "d0"] {
        assert_eq!(f.sim(iid).counters().await.unauthorized, 0, "{iid}");
    }
    // The key is in no document the agents sign or the router serves.
    // The raw body: no field of it, known or not, carries the key.
    let st = r.get("/narwhal/state").await.text();
    assert!(!st.contains("sk-engine-test"), "{st}");
    for a in &f.agents {
        let text = std::fs::read_to_string(&a.config).expect("agent config");
        assert!(
            !text.contains("sk-engine-test"),
            "the key itself is in {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refuted_transfer_fails_readmission_naming_the_counter() {
    let (mut f, r) = lab("vllm", &[]).await;
    r.drain_to_complete("d0").await;
    f.sim_mut("d0").restart(&[]).expect("restart d0");
    f.sim("d0")
        .fault(json!({"phase": "decode", "action": "fail_transfer", "policy": "recompute"}))
        .await;
    let (status, doc) = readmit(&r, "d0").await;
    assert_eq!(status, 409, "{doc:#?}");
    let e = entry(&doc, "d0");
    assert_eq!(e.state.as_str(), "blocked", "{doc:#?}");
    let err = &e.error;
    assert!(
        err.contains("KV transfer refuted")
            && err.contains("vllm:nixl_num_failed_transfers_total rose by 1"),
        "{err}"
    );
    let want = expected_checks("vllm", "d0");
    assert_checks(&e.checks, &want[..5], "refuted fabric");
    // Fault spent: the retry passes.
    let (status, doc) = readmit(&r, "d0").await;
    assert_eq!(status, 200, "{doc:#?}");
    assert_checks(&entry(&doc, "d0").checks, &want, "retry");
}
