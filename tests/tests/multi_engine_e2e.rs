//! Many engines in one simulator process (`narwhal-engine-sim --engines N`,
//! docs/engine-simulator.md, "Many engines in one process"): each engine has its own ports,
//! engine id, counters and faults and answers as a one-engine process does; they share the
//! process identity, and a restart restarts all of them on the same ports.

use std::time::Duration;

use narwhal_testkit::{Http, MultiSim, metric};
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
        async move { http.get(url).await.json() }
    };
    let (sa, sb) = (stats(&a).await, stats(&b).await);
    assert_eq!(sa["requests"]["aggregated"], 1, "{sa}");
    assert_eq!(sb["requests"]["aggregated"], 0, "{sb}");
    assert_eq!(sa["engine_id"], "m-0");
    assert_eq!(sb["engine_id"], "m-1");
    // One process: one pid and one process start, which is what the agent reads for each.
    assert_eq!(sa["pid"], sb["pid"]);
    assert_eq!(sa["started_at"], sb["started_at"]);
    assert_eq!(sa["pid"], u64::from(multi.proc.pid()));
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
        assert_eq!(s["requests"]["aggregated"], 0, "fresh state: {s}");
        assert_eq!(s["pid"], u64::from(multi.proc.pid()));
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
