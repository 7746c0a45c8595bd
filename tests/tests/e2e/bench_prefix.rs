//! `narwhal-bench prefix` on a tiny scale (docs/benchmarks.md, "Shared-prefix workload"): the
//! report's table and JSON carry every target, the oracle and the standby figure, and our
//! router with the engines' KV events hits the engines' prefix caches more often than the same
//! router with no cache credit. Only that comparison of hit rates is asserted, no time: both
//! targets see the same trace on the same (restarted, cold) simulators, and with eight group
//! prefixes of about 22 blocks over engines holding 48 blocks each, a placement that ignores
//! the caches spreads every group over every engine and evicts what it needs.
// Tests measure wall time (deadlines): the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use narwhal_testkit::ById;
use narwhal_testkit::bench_docs::PrefixDoc;

#[test]
fn shared_prefix_workload_reports_every_target_and_exact_beats_blind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("prefix.json");
    let md = dir.path().join("prefix.md");
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let args = [
        "prefix",
        "--duration-s",
        "10",
        "--rate",
        "6",
        "--groups",
        "8",
        "--prefix-min",
        "320",
        "--prefix-max",
        "400",
        "--question-tokens",
        "8",
        "--sessions",
        "4",
        "--turns",
        "3",
        "--user-tokens",
        "8",
        "--answer-tokens",
        "8",
        "--turn-gap-s",
        "0.5",
        "--output-tokens",
        "4",
        "--kv-cache-blocks",
        "48",
        "--prefill-us-per-token",
        "100",
        "--ttft-ms",
        "5",
        "--tpot-ms",
        "5",
        "--tpot-per-running-us",
        "0",
        "--targets",
        "ours-exact,ours-blind,round-robin",
        "--standby-s",
        "16",
        "--request-timeout",
        "30",
    ];
    let mut child = Command::new(env!("CARGO_BIN_EXE_narwhal-bench"))
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--out")
        .arg(&md)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("start narwhal-bench");
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("narwhal-bench prefix did not finish within 300 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(
        status.success(),
        "narwhal-bench prefix failed ({status}); stdout:\n{stdout}\nstderr:\n{stderr}"
    );

    // The markdown table, on stdout and in --out.
    let table = std::fs::read_to_string(&md).expect("the --out file");
    for text in [&stdout, &table] {
        assert!(
            text.contains("| target | hit rate | x oracle | TTFT p50 s | TTFT p90 s | SLO met |"),
            "{text}"
        );
        for row in [
            "| ours-exact |",
            "| ours-blind |",
            "| round-robin |",
            "| oracle (pooled LRU) |",
        ] {
            assert_eq!(text.matches(row).count(), 1, "{row} in:\n{text}");
        }
        assert!(
            text.contains("standby (ours exact, kill -9 of the primary)"),
            "{text}"
        );
    }

    let text = std::fs::read_to_string(&json).expect("the --json file");
    let doc: PrefixDoc = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("not the prefix document ({e}): {text}"));
    assert_eq!(doc.schema, "narwhal.bench.prefix");
    let requests = doc.requests;
    assert!(requests >= 20, "{doc:?}");
    let (oracle, unbounded) = (doc.oracle.hit_rate, doc.oracle.unbounded_hit_rate);
    assert!(
        0.0 < oracle && oracle <= unbounded && unbounded < 1.0,
        "{doc:?}"
    );
    let names: Vec<&str> = doc.targets.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["ours-exact", "ours-blind", "round-robin"]);
    let mut rate = std::collections::BTreeMap::new();
    for t in &doc.targets {
        assert_eq!(t.requests, Some(requests), "{t:?}");
        // The restarted engine fails what it was serving; everything else completes.
        assert!(t.completed.unwrap_or(0) + 5 >= requests, "{t:?}");
        for (k, v) in [
            ("ttft_p50_s", t.ttft_p50_s),
            ("ttft_p90_s", t.ttft_p90_s),
            ("slo_attainment", t.slo_attainment),
            ("throughput_rps", t.throughput_rps),
        ] {
            assert!(v.is_some(), "{k} in {t:?}");
        }
        let h = t.hit_rate.expect("hit_rate");
        assert!((0.0..=1.0).contains(&h), "{t:?}");
        assert!(t.queries.unwrap_or(0) > 0, "{t:?}");
        rate.insert(t.name.clone(), h);
    }
    let (exact, blind) = (*rate.of("ours-exact"), *rate.of("ours-blind"));
    assert!(
        exact > blind,
        "exact {exact:.3} vs blind {blind:.3}:\n{stdout}"
    );
    let s = doc.standby.as_ref().expect("the standby figure");
    for (k, v) in [
        ("hit_rate_before", s.hit_rate_before),
        ("hit_rate_after", s.hit_rate_after),
        ("ratio", s.ratio),
    ] {
        assert!(v.is_some(), "{k} in {s:?}");
    }
    assert!(s.before.queries.unwrap_or(0) > 0, "{s:?}");
    assert!(s.after.queries.unwrap_or(0) > 0, "{s:?}");
    println!("{stdout}");
}

/// The agents, tenants, bypass and restart shapes' machinery on a tiny scale, all in one run:
/// chat completions with a tools block, salted tenants, a third of the requests straight to
/// the engines, and each of our routers restarted half way (SIGTERM, started again). No
/// request fails across the restart (ours finishes what it serves; the client retries until
/// the new router answers), and the figure's windows both looked prompts up.
#[test]
fn agents_tenants_bypass_and_a_router_restart_run_and_fail_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("prefix.json");
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let args = [
        "prefix",
        "--agents",
        "--think-min-s",
        "1",
        "--think-max-s",
        "3",
        "--tenants",
        "3",
        "--bypass",
        "0.3",
        "--restart-at",
        "-1",
        "--router-restart-at",
        "0.5",
        "--duration-s",
        "24",
        "--rate",
        "4",
        "--groups",
        "4",
        "--prefix-min",
        "200",
        "--prefix-max",
        "300",
        "--question-tokens",
        "8",
        "--sessions",
        "6",
        "--turns",
        "3",
        "--user-tokens",
        "8",
        "--answer-tokens",
        "8",
        "--session-share",
        "0.6",
        "--output-tokens",
        "4",
        "--kv-cache-blocks",
        "200",
        "--prefill-us-per-token",
        "100",
        "--ttft-ms",
        "5",
        "--tpot-ms",
        "5",
        "--tpot-per-running-us",
        "0",
        "--targets",
        "ours-exact,ours-approx",
        "--standby-s",
        "0",
        "--request-timeout",
        "30",
    ];
    let mut child = Command::new(env!("CARGO_BIN_EXE_narwhal-bench"))
        .args(args)
        .arg("--json")
        .arg(&json)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("start narwhal-bench");
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("narwhal-bench prefix did not finish within 300 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(
        status.success(),
        "narwhal-bench prefix failed ({status}); stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let text = std::fs::read_to_string(&json).expect("the --json file");
    let doc: PrefixDoc = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("not the prefix document ({e}): {text}"));
    assert!(doc.standby.is_none(), "{doc:?}");
    assert!(doc.requests >= 40, "{doc:?}");
    for t in &doc.targets {
        assert_eq!(t.completed, Some(doc.requests), "{t:?}\n{stdout}");
        let r = t.router_restart.as_ref().expect("router_restart");
        assert!(r.before.queries.unwrap_or(0) > 0, "{r:?}");
        assert!(r.after.queries.unwrap_or(0) > 0, "{r:?}");
        assert!((0.0..=1.0).contains(&r.hit_rate_before), "{r:?}");
        assert!((0.0..=1.0).contains(&r.hit_rate_after), "{r:?}");
        assert!(r.down_s > 0.0, "{r:?}");
    }
    println!("{stdout}");
}
