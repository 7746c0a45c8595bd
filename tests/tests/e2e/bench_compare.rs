//! The mechanics of `narwhal-bench`'s comparison mode (docs/benchmarks.md): it starts the
//! simulators, our two routers and peer routers given as commands, measures them interleaved,
//! and reports a table and a JSON document with the right shape; a P/D peer that does not
//! transfer KV is caught. The "peers" here are our own router launched through
//! `tests/bench/narwhal-serve-peer.sh`, so the test needs nothing outside the workspace.
//! Structure only: no assertion here is about how fast anything is.
// Tests measure wall time (deadlines): the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use narwhal_testkit::bench_docs::{CompareDoc, RowDoc};
use serde_json::Value;

/// Runs `narwhal-bench` with `args`, killing it after `within`.
fn bench(args: &[String], within: Duration) -> Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_narwhal-bench"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("start narwhal-bench");
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait narwhal-bench") {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "narwhal-bench did not finish within {within:?}; stdout:\n{}\nstderr:\n{}",
                std::fs::read_to_string(&out).unwrap_or_default(),
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: std::fs::read(&out).unwrap_or_default(),
        stderr: std::fs::read(&err).unwrap_or_default(),
    }
}

/// `narwhal-serve-peer.sh` with the engine flags `engines` (placeholders included).
fn self_peer(name: &str, engines: &str) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/narwhal-serve-peer.sh");
    format!(
        "{name}=sh {} --bin {{bin_dir}}/narwhal-serve --port {{port}} --dir {{dir}} {engines}",
        script.display()
    )
}

/// `--peer` for a P/D self-peer (`self-pd`) and an aggregated one (`self-agg`).
fn self_peers() -> Vec<String> {
    vec![
        "--peer".into(),
        self_peer("self-pd", "--prefill {prefill_url} --decode {decode_url}"),
        "--peer".into(),
        self_peer("self-agg", "--engine {engine_url}"),
    ]
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn read_json(path: &PathBuf) -> CompareDoc {
    let text = std::fs::read_to_string(path).expect("the --json file");
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the --json file is not the compare document ({e}): {text}"))
}

const TARGETS: [(&str, &str); 5] = [
    ("direct", "direct"),
    ("ours-pd", "pd"),
    ("ours-agg", "agg"),
    ("self-pd", "pd"),
    ("self-agg", "agg"),
];

/// `--compare --latency` with a P/D and an aggregated peer: four sections (throughput and
/// latency, streaming and not), every target in each with every request completed, P/D
/// targets transferring KV for each request, the ratio columns and comparison lines present,
/// and the routers on the CPUs the pinning names.
#[test]
fn comparison_runs_peers_and_reports_every_target() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let mut args = strings(&[
        "--compare",
        "--latency",
        "--requests",
        "200",
        "--latency-requests",
        "20",
        "--rounds",
        "1",
        "--concurrency",
        "8",
        "--json",
    ]);
    args.push(json.display().to_string());
    args.extend(self_peers());
    let out = bench(&args, Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "narwhal-bench failed ({}); stdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );

    // The human tables.
    check_tables(&stdout);

    // The JSON document.
    let doc = read_json(&json);
    check_document_targets(&doc);
    check_sections(&doc);
}

/// The comparison's tables on `stdout`: the four sections, each with every column, a row
/// per target and the comparison lines against each peer.
fn check_tables(stdout: &str) {
    for head in [
        "== throughput · streaming · concurrency 8",
        "== throughput · non-streaming · concurrency 8",
        "== latency · streaming · concurrency 1",
        "== latency · non-streaming · concurrency 1",
    ] {
        assert_eq!(stdout.matches(head).count(), 1, "{head:?} in:\n{stdout}");
    }
    let header_lines: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("target "))
        .collect();
    assert_eq!(header_lines.len(), 4, "{stdout}");
    for h in &header_lines {
        for col in [
            "req/s",
            "p50 ms",
            "p99 ms",
            "cpu ms",
            "RSS MB",
            "xdirect",
            "/self-pd",
            "/self-agg",
        ] {
            assert!(h.contains(col), "column {col:?} missing from {h:?}");
        }
    }
    for (name, kind) in TARGETS {
        let rows = stdout
            .lines()
            .filter(|l| {
                let mut w = l.split_whitespace();
                w.next() == Some(name) && w.next() == Some(kind)
            })
            .count();
        assert_eq!(rows, 4, "{name} rows in:\n{stdout}");
    }
    assert_eq!(stdout.matches("ours-pd vs self-pd: throughput").count(), 4);
    assert_eq!(
        stdout.matches("ours-agg vs self-agg: throughput").count(),
        4
    );
    assert!(!stdout.contains("NOT P/D"), "{stdout}");
}

/// The JSON document's header and targets: schema, no problems, each target's kind, pid,
/// CPUs (pinned: the router CPU), peer flag and command.
fn check_document_targets(doc: &CompareDoc) {
    assert_eq!(doc.schema, "narwhal.bench.compare");
    assert_eq!(doc.version, 1);
    assert_eq!(doc.problems, 0);
    let router_cpus = doc.pinning.as_ref().and_then(|p| p.router_cpus.clone());
    assert_eq!(doc.targets.len(), TARGETS.len());
    for (t, (name, kind)) in doc.targets.iter().zip(TARGETS) {
        assert_eq!((t.name.as_str(), t.kind.as_str()), (name, kind));
        if name == "direct" {
            assert!(t.pid.is_none());
        } else {
            assert!(t.pid.is_some(), "{t:?}");
            if let Some(cpus) = &router_cpus {
                // Pinned: every thread of every router runs only on the router CPU.
                assert_eq!(t.cpus.as_deref(), Some(cpus.as_str()), "{t:?}");
            }
        }
        assert_eq!(t.peer, name.starts_with("self-"), "{t:?}");
        assert_eq!(t.command.is_some(), name.starts_with("self-"), "{t:?}");
    }
}

/// The JSON document's sections: their shapes in order, and in each every target with every
/// request completed, its figures, and P/D targets transferring KV for each request.
fn check_sections(doc: &CompareDoc) {
    let shapes: Vec<(&str, bool, u64, u64)> = doc
        .sections
        .iter()
        .map(|s| (s.mode.as_str(), s.stream, s.concurrency, s.requests))
        .collect();
    assert_eq!(
        shapes,
        [
            ("throughput", true, 8, 200),
            ("latency", true, 1, 20),
            ("throughput", false, 8, 200),
            ("latency", false, 1, 20),
        ]
    );
    for s in &doc.sections {
        let requests = s.requests;
        assert_eq!(s.targets.len(), TARGETS.len());
        for (t, (name, kind)) in s.targets.iter().zip(TARGETS) {
            check_row(t, name, kind, requests);
        }
    }
}

/// One target's row of a section: every request completed, finite positive figures, the
/// ratio columns, memory for routers, and KV transferred for each request of a P/D target.
fn check_row(t: &RowDoc, name: &str, kind: &str, requests: u64) {
    assert_eq!(t.name, name);
    assert_eq!(t.completed, requests, "{name}: {t:?}");
    assert_eq!(t.errors, 0, "{name}: {t:?}");
    assert_eq!(t.windows.len(), 1);
    for (field, v) in [
        ("rps", t.rps),
        ("p50_ms", t.p50_ms),
        ("p99_ms", t.p99_ms),
        ("ttfb_p50_ms", t.ttfb_p50_ms),
        ("ratio_to_direct", t.ratio_to_direct),
    ] {
        let v = v.unwrap_or(f64::NAN);
        assert!(v.is_finite() && v > 0.0, "{name}.{field} = {v}");
    }
    let ratios = &t.ratio_to_peers;
    assert_eq!(
        ratios.keys().map(String::as_str).collect::<Vec<_>>(),
        ["self-pd", "self-agg"]
    );
    if t.peer {
        // A target against itself, round by round.
        assert_eq!(
            ratios.get(name).and_then(Value::as_f64),
            Some(1.0),
            "{name}: {t:?}"
        );
    }
    if name == "direct" {
        assert!(t.cpu_ms_per_request.is_none() && t.rss_mib.is_none());
        assert_eq!(t.ratio_to_direct, Some(1.0));
    } else {
        let cpu = t.cpu_ms_per_request.expect("cpu per request");
        assert!(cpu.is_finite() && cpu >= 0.0, "{name}: {t:?}");
        let (rss, peak) = (t.rss_mib.expect("rss"), t.peak_rss_mib.expect("peak"));
        assert!(rss > 0.0 && peak >= rss, "{name}: {t:?}");
    }
    let e = &t.engines;
    if kind == "pd" {
        // Each completed request: one prefill leg, one decode leg fed by its KV.
        for (k, n) in [
            ("prefill", e.prefill),
            ("decode", e.decode),
            ("issued", e.issued),
            ("consumed", e.consumed),
        ] {
            assert_eq!(n, requests, "{name} engines.{k}: {e:?}");
        }
        for (k, n) in [
            ("aggregated", e.aggregated),
            ("recomputed", e.recomputed),
            ("rejected", e.rejected),
        ] {
            assert_eq!(n, 0, "{name} engines.{k}: {e:?}");
        }
        assert!(t.pd_problem.is_none());
    } else {
        assert_eq!(e.aggregated, requests, "{name} engines: {e:?}");
    }
}

/// A peer that names the P/D engines but serves every request from the decode engine alone
/// (our router over that one engine) is caught: its P/D line says NOT P/D, the JSON names the
/// problem, and the run exits 1.
#[test]
fn pd_peer_that_does_not_transfer_kv_fails_the_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("bench.json");
    let mut args = strings(&[
        "--requests",
        "40",
        "--rounds",
        "1",
        "--concurrency",
        "4",
        "--stream",
        "true",
        "--json",
    ]);
    args.push(json.display().to_string());
    args.push("--peer".into());
    args.push(self_peer("fake-pd", "--engine {decode_url}"));
    let out = bench(&args, Duration::from_secs(180));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("fake-pd engines:"))
        .unwrap_or_else(|| panic!("no fake-pd engines line in:\n{stdout}"));
    assert!(
        line.contains("NOT P/D") && line.contains("recomputed"),
        "{line}"
    );
    let doc = read_json(&json);
    assert_eq!(doc.problems, 1, "{doc:?}");
    let rows = &doc.sections[0].targets;
    let row = |n: &str| rows.iter().find(|t| t.name == n).expect(n);
    assert!(row("fake-pd").pd_problem.is_some());
    assert!(row("ours-pd").pd_problem.is_none());
    assert_eq!(row("fake-pd").errors, 0);
}

/// Bad peer specs are refused before anything starts, naming the peer and the fault.
#[test]
fn bad_peer_specs_are_refused() {
    for (spec, says) in [
        ("noname", "expected NAME=COMMAND"),
        ("p=router --port {port}", "names no engines"),
        ("p=router {engine_url} {prefill_url}", "both"),
        ("p=router {engine_url} {prot}", "unknown placeholder {prot}"),
        ("ours-pd=router {engine_url}", "built-in"),
    ] {
        let out = bench(
            &["--peer".to_string(), spec.to_string()],
            Duration::from_secs(30),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{spec}: {stderr}");
        assert!(stderr.contains(says), "{spec}: {stderr}");
    }
    let out = bench(
        &strings(&["--peer", "a=r {engine_url}", "--peer", "a=r {engine_url}"]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--peer a: the name is given twice"));
}

/// `narwhal-bench concurrency` (docs/benchmarks.md, "Concurrent streams"): at each level every
/// target of the shape (direct, ours, a P/D peer; the aggregated peer is left out) carries that
/// many preconnected streams with none failed, the routers' rows name their CPU, RSS and
/// descriptor peaks (at least one descriptor per stream: the clients' connections), and the
/// six charts are written. Bad levels are refused before anything starts.
#[test]
fn concurrency_runs_every_level_on_every_target() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plots = dir.path().join("plots");
    let mut args = strings(&[
        "concurrency",
        "--shape",
        "pd",
        "--levels",
        "16,4",
        "--tokens",
        "4",
        "--tpot-ms",
        "2",
        "--plots",
    ]);
    args.push(plots.display().to_string());
    args.extend(self_peers());
    let out = bench(&args, Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "narwhal-bench concurrency failed ({}); stdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    assert!(
        stderr.contains("--peer self-agg is agg, not --shape pd: left out"),
        "{stderr}"
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("| 4 |") || l.starts_with("| 16 |"))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    assert_eq!(rows.len(), 6, "two levels x three targets:\n{stdout}");
    for level in ["4", "16"] {
        let n: u64 = level.parse().expect("level");
        for target in ["direct", "ours-pd", "self-pd"] {
            let row = rows
                .iter()
                .find(|r| r[1] == level && r[2] == target)
                .unwrap_or_else(|| panic!("no row for {target} at {level}:\n{stdout}"));
            assert_eq!(row[8], "0", "errors of {target} at {level}:\n{stdout}");
            let rps: f64 = row[3].parse().expect("req/s");
            assert!(rps > 0.0, "{target} at {level}:\n{stdout}");
            if target == "direct" {
                assert_eq!(&row[9..12], ["-", "-", "-"], "{stdout}");
            } else {
                let fds: u64 = row[11].parse().expect("peak fds");
                assert!(
                    fds >= n,
                    "{target} at {level}: {fds} descriptors:\n{stdout}"
                );
                let rss: f64 = row[10].parse().expect("peak RSS");
                assert!(rss > 1.0, "{target} at {level}:\n{stdout}");
            }
        }
    }
    assert!(
        stdout.contains("goals: ours-pd at 16 streams: errors 0"),
        "{stdout}"
    );
    assert!(stdout.contains("vs self-pd: req/s"), "{stdout}");
    for chart in ["rps", "ttft-p99", "e2e-p99", "cpu", "rss", "fds"] {
        let svg = std::fs::read_to_string(plots.join(format!("concurrency-{chart}.svg")))
            .unwrap_or_else(|e| panic!("concurrency-{chart}.svg: {e}"));
        assert!(svg.contains("<svg"), "{chart}");
    }
    for bad in [["--levels", "0"], ["--tokens", "0"]] {
        let out = bench(
            &strings(&["concurrency", bad[0], bad[1]]),
            Duration::from_secs(30),
        );
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(bad[0]),
            "{bad:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `fleet-scale` with a P/D peer over a two-engine fleet: the fleet row, then the peers'
/// table with our router's row and the peer's (CPU per request, the ratio to ours, RSS), and
/// the peer's lines on the CPU and memory charts; an aggregated peer is refused.
#[test]
fn fleet_scale_measures_a_peer_over_the_same_fleet() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plots = dir.path().join("plots");
    let mut args = strings(&[
        "fleet-scale",
        "--engines",
        "2",
        "--per-agent",
        "2",
        "--requests",
        "100",
        "--latency-requests",
        "10",
        "--reads",
        "2",
        "--idle-s",
        "0.5",
        "--plots",
    ]);
    args.push(plots.display().to_string());
    args.push("--peer".into());
    args.push(self_peer(
        "self-pd",
        "--prefill {prefill_url} --decode {decode_url}",
    ));
    let out = bench(&args, Duration::from_secs(300));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "narwhal-bench fleet-scale failed ({}); stdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("| 2 | 2 | "))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    let peer_rows: Vec<&Vec<&str>> = rows.iter().filter(|r| r.len() == 10).collect();
    assert_eq!(peer_rows.len(), 2, "narwhal and self-pd:\n{stdout}");
    for (row, name) in peer_rows.iter().zip(["narwhal", "self-pd"]) {
        assert_eq!(row[3], name, "{stdout}");
        let cpu: f64 = row[4].parse().expect("CPU µs/req");
        assert!(cpu > 0.0, "{stdout}");
        let rss: f64 = row[8].parse().expect("RSS");
        assert!(rss > 1.0, "{stdout}");
    }
    assert_eq!(peer_rows[0][5], "1.00", "ours against ours:\n{stdout}");
    for chart in ["cpu-per-request", "memory"] {
        let svg = std::fs::read_to_string(plots.join(format!("fleet-{chart}.svg")))
            .unwrap_or_else(|e| panic!("fleet-{chart}.svg: {e}"));
        assert!(svg.contains("self-pd"), "fleet-{chart}.svg names the peer");
    }
    let agg = bench(
        &strings(&[
            "fleet-scale",
            "--peer",
            &self_peer("agg", "--engine {engine_url}"),
        ]),
        Duration::from_secs(30),
    );
    assert_eq!(agg.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&agg.stderr).contains("--peer agg: the fleet is P/D"),
        "{}",
        String::from_utf8_lossy(&agg.stderr)
    );
}
