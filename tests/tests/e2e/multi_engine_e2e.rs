//! Many engines in one simulator process (`narwhal-engine-sim --engines N`,
//! docs/engine-simulator.md, "Many engines in one process"): each engine has its own ports,
//! engine id, counters and faults and answers as a one-engine process does; they share the
//! process identity, and a restart restarts all of them on the same ports.

use std::time::Duration;

use narwhal_testkit::sim_stats::SimStats;
use narwhal_testkit::{ById, Http, MultiSim, metric};
use serde_json::json;

fn http() -> Http {
    Http::new(Duration::from_secs(10))
}

fn completion() -> serde_json::Value {
    json!({"model": "tiny-sim", "prompt": "hello there", "max_tokens": 4})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_of_one_process_answer_independently_and_restart_together() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut multi = MultiSim::start(dir.path(), "multi", "vllm", 3, &["--engine-id", "m"])
        .expect("narwhal-engine-sim --engines 3");
    let http = http();
    assert_eq!(multi.engines.len(), 3);
    let (a, b) = (multi.engines[0].clone(), multi.engines[1].clone());
    assert_ne!(a.port, b.port, "each engine on its own port");
    assert_ne!(a.admin, b.admin, "each engine with its own admin listener");
    assert_ne!(
        a.kv_port, b.kv_port,
        "each engine with its own side channel"
    );
    assert_eq!((a.engine_id.as_str(), b.engine_id.as_str()), ("m-0", "m-1"));

    // A fault armed on one engine is that engine's only.
    let fault = json!({"phase": "health", "action": "status", "status": 503, "count": 1});
    let r = http.post(format!("{}/faults", b.admin_url()), &fault).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(http.get(format!("{}/health", a.url)).await.status, 200);
    assert_eq!(http.get(format!("{}/health", b.url)).await.status, 503);
    assert_eq!(http.get(format!("{}/health", b.url)).await.status, 200);

    // A completion on one engine is counted by that engine only; the engine port is the
    // engine's (no hooks), as in a one-engine process.
    let r = http
        .post(format!("{}/v1/completions", a.url), &completion())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(http.get(format!("{}/sim/stats", a.url)).await.status, 404);
    let stats = |e: &narwhal_testkit::MultiEngine| {
        let url = format!("{}/stats", e.admin_url());
        let http = http.clone();
        async move { http.get(url).await.json_as::<SimStats>() }
    };
    let (sa, sb) = (stats(&a).await, stats(&b).await);
    assert_eq!(sa.requests.aggregated, 1, "{sa:?}");
    assert_eq!(sb.requests.aggregated, 0, "{sb:?}");
    assert_eq!(sa.engine_id, "m-0");
    assert_eq!(sb.engine_id, "m-1");
    // One process: one pid and one process start, which is what the agent reads for each.
    assert_eq!(sa.pid, sb.pid);
    assert_eq!(sa.started_at, sb.started_at);
    assert_eq!(sa.pid, multi.proc.pid());
    let start = |text: &str| metric(text, "process_start_time_seconds", &[]);
    let ma = http.get(format!("{}/metrics", a.url)).await.text();
    let mb = http.get(format!("{}/metrics", b.url)).await.text();
    assert!(start(&ma).is_some(), "{ma}");
    assert_eq!(start(&ma), start(&mb));

    // A restart restarts every engine, on the same ports, with new engine ids.
    let old_pid = multi.proc.pid();
    let ports: Vec<(u16, String, Option<u16>)> = multi
        .engines
        .iter()
        .map(|e| (e.port, e.admin.clone(), e.kv_port))
        .collect();
    multi.restart().expect("restart in place");
    assert_ne!(multi.proc.pid(), old_pid);
    let again: Vec<(u16, String, Option<u16>)> = multi
        .engines
        .iter()
        .map(|e| (e.port, e.admin.clone(), e.kv_port))
        .collect();
    assert_eq!(again, ports);
    for e in &multi.engines {
        let s = stats(e).await;
        assert_eq!(s.requests.aggregated, 0, "fresh state: {s:?}");
        assert_eq!(s.pid, multi.proc.pid());
    }
}

#[test]
fn many_engine_mode_refuses_fixed_ports_and_a_single_events_endpoint() {
    let bin = narwhal_testkit::bin_path("narwhal-engine-sim");
    for args in [
        vec!["--engines", "2", "--listen", "127.0.0.1:1"],
        vec!["--engines", "2", "--kv-events-config", "{}"],
        vec!["--engines", "0"],
    ] {
        let out = std::process::Command::new(&bin)
            .args(&args)
            .output()
            .expect("run narwhal-engine-sim");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--engines"), "{args:?}: {err}");
    }
}

/// A router and an agent over the engines of one many-engine process, each engine named by its
/// port (`engines[].process.listen_port`): the startup identity check accepts the one process
/// start for every engine, requests are served across them, and a whole wave (drain, restart
/// of the process, readmit) passes the six checks for each engine, each with the new process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_readmits_a_wave_of_engines_sharing_one_process() {
    use narwhal_testkit::certs::make_dev_certs;
    use narwhal_testkit::{AgentEngine, Clients, FleetSpec, launch_router, start_agent_for};

    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let mut multi = MultiSim::start(d, "multi", "vllm", 4, &[]).expect("simulators");
    let certs = make_dev_certs(&d.join("certs"), &["router", "operator", "agent-h0"])
        .expect("dev certificates");
    let iids = ["p0", "p1", "d0", "d1"];
    let engines: Vec<AgentEngine> = iids
        .iter()
        .zip(&multi.engines)
        .map(|(iid, e)| AgentEngine {
            iid: iid.to_string(),
            url: e.url.clone(),
            dialect: "vllm".into(),
            port: e.port,
            kv_events: None,
        })
        .collect();
    let agent = start_agent_for(
        d,
        &certs,
        "h0",
        &engines,
        None,
        None,
        json!({"engine_s": 5, "generation_s": 20}),
    )
    .expect("agent");
    let fleet_engines = engines
        .iter()
        .map(|e| {
            let role = if e.iid.starts_with('p') {
                "prefill"
            } else {
                "decode"
            };
            (e.iid.clone(), e.url.clone(), role.to_string())
        })
        .collect();
    let mut spec = FleetSpec::new("vllm", fleet_engines).tls(&certs, "router");
    for iid in iids {
        spec = spec.agent(iid, &agent);
    }
    let router = launch_router(
        d,
        "router",
        &spec.to_json(d),
        &[],
        Clients::identity(&certs, "operator"),
    )
    .expect("router");
    let first = router
        .lifecycle_until("every engine's process accepted", |l| {
            iids.iter().all(|i| l.process_starts.contains_key(*i))
        })
        .await;
    let start = *first.process_starts.of("p0");
    assert!(
        iids.iter().all(|i| first.process_starts[*i] == start),
        "one process, one start: {:?}",
        first.process_starts
    );
    for n in 0..8 {
        router
            .complete(&format!("request {n} across the engines"))
            .await;
    }

    let (code, doc) = router
        .lifecycle_post_json("drain", &json!({"wave": true, "deadline_s": 30}))
        .await;
    assert_eq!(code, 200, "{doc}");
    router
        .lifecycle_until("the wave is ready to stop", |l| l.wave.ready_to_stop)
        .await;
    multi.restart().expect("restart the process");
    let (code, doc) = router
        .lifecycle_post_json("readmit", &json!({"wave": true}))
        .await;
    assert_eq!(code, 200, "{doc}");
    let after = router.lifecycle().await;
    for iid in iids {
        let e = after.engine(iid).expect("engine");
        assert!(
            e.checks.iter().any(|c| c == "new process identity"),
            "{iid}: {:?}",
            e.checks
        );
        assert!(
            e.checks.iter().any(|c| c == "final health"),
            "{iid}: {:?}",
            e.checks
        );
        assert!(after.process_starts[iid] > start, "{iid}: a newer start");
    }
    router.complete("served again after the wave").await;
}
