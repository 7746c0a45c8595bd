//! The monitoring files `packaging/` ships (the Grafana dashboard, the Prometheus alert rules
//! and their unit tests; docs/monitoring.md) against live processes: every metric name they use
//! is one a router or an agent exports, and the families the alerts rely on have samples.
//! `packaging/check-monitoring.sh` checks the same files with promtool.

use std::path::Path;

/// The families a Prometheus text exposition declares (`# TYPE`) or has samples of, with the
/// `_bucket`/`_sum`/`_count` series of its histograms.
fn exposed_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut live = std::collections::BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut w = rest.split_whitespace();
            let (name, kind) = (w.next().unwrap_or(""), w.next().unwrap_or(""));
            live.insert(name.to_string());
            if kind == "histogram" {
                for s in ["_bucket", "_sum", "_count"] {
                    live.insert(format!("{name}{s}"));
                }
            }
        } else if !line.starts_with('#') {
            let name: String = line
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            live.insert(name);
        }
    }
    live
}

/// `narwhal_*` string literals of the Rust sources under `dir` (registered family names; a
/// counter also as `<name>_total`): a family appears in `/metrics` only once it has a sample.
fn registered_names(dir: &Path) -> std::collections::BTreeSet<String> {
    let mut registered = std::collections::BTreeSet::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("source dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let src = std::fs::read_to_string(&p).unwrap_or_default();
                for lit in src.split('"').skip(1).step_by(2) {
                    if lit.starts_with("narwhal_")
                        && lit.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    {
                        registered.insert(lit.to_string());
                        registered.insert(format!("{lit}_total"));
                    }
                }
            }
        }
    }
    registered
}

/// Every `narwhal_*` name in the Grafana dashboard and the alert rules (and their tests) is one
/// a live router or a live agent exports (or their sources register), and the operator
/// families the alerts rely on have samples on a router with a lease, agents and control TLS
/// (docs/monitoring.md: the router's control, lease and certificate gauges; the dashboard's
/// agent names reconciled with the agent's real `/metrics`). Before, the rules used
/// fallbacks and assumed agent names listed in `metrics-not-yet-exported.txt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitoring_files_use_the_metric_names_router_and_agents_export() {
    let f = narwhal_testkit::Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .control_tls()
        .lease(narwhal_testkit::LeaseBackend::File)
        .start()
        .await;
    let text = f.router().metrics().await;
    let agent_text = f
        .http
        .get(format!("{}/metrics", f.agents[0].url))
        .await
        .text();
    let metric = |t: &str, name: &str, labels: &[&str]| {
        narwhal_testkit::metric(t, name, labels)
            .unwrap_or_else(|| panic!("no sample of {name} {labels:?} in:\n{t}"))
    };
    assert_eq!(metric(&text, "narwhal_router_controls_fleet", &[]), 1.0);
    assert_eq!(
        metric(
            &text,
            "narwhal_router_lease_info",
            &["state=\"active\"", "holder=\"primary:"]
        ),
        1.0
    );
    assert_eq!(metric(&text, "narwhal_router_lease_ttl_seconds", &[]), 2.0);
    assert_eq!(
        metric(&text, "narwhal_router_lease_renew_interval_seconds", &[]),
        0.5
    );
    let left = metric(&text, "narwhal_router_lease_expires_in_seconds", &[]);
    assert!(left > 0.0 && left <= 1.5, "ttl − margin bounds it: {left}");
    for cert in ["tls.cert", "tls.ca", "control.tls.cert", "control.tls.ca"] {
        let label = format!("cert=\"{cert}\"");
        let days = metric(
            &text,
            "narwhal_router_certificate_expiry_seconds",
            &[&label],
        ) / 86400.0;
        assert!(days > 1.0, "{cert}: {days} days");
    }
    assert!(
        metric(
            &agent_text,
            "narwhal_agent_certificate_expiry_seconds",
            &["cert=\"serving\""]
        ) > 86400.0
    );
    assert!(metric(&agent_text, "narwhal_agent_fence_epoch", &[]) >= 1.0);

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut live = exposed_names(&text);
    live.extend(exposed_names(&agent_text));
    let registered = registered_names(&root.join("router/src"));
    assert!(
        registered.contains("narwhal_engine_ejections_total"),
        "router/src no longer registers narwhal_engine_ejections: {registered:?}"
    );
    live.extend(registered);
    live.extend(registered_names(&root.join("engine-agent/src")));
    assert!(
        !root
            .join("packaging/prometheus/metrics-not-yet-exported.txt")
            .exists(),
        "every metric the monitoring files use is exported: no list of missing ones"
    );
    for file in [
        "grafana/narwhal-dashboard.json",
        "prometheus/narwhal-alerts.yml",
        "prometheus/narwhal-alerts.test.yml",
    ] {
        // A __name__ regex over both components names both metrics.
        let text = std::fs::read_to_string(root.join("packaging").join(file))
            .unwrap()
            .replace(
                "narwhal_(router|agent)_certificate_expiry_seconds",
                "narwhal_router_certificate_expiry_seconds narwhal_agent_certificate_expiry_seconds",
            );
        let mut unknown = std::collections::BTreeSet::new();
        let mut seen = 0;
        let mut rest = text.as_str();
        while let Some(i) = rest.find("narwhal_") {
            let name: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // Not part of a longer word (e.g. a label value such as `xnarwhal_`).
            let standalone = rest[..i]
                .chars()
                .last()
                .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
            if standalone {
                seen += 1;
                if !live.contains(&name) {
                    unknown.insert(name.clone());
                }
            }
            rest = &rest[i + name.len().max(1)..];
        }
        assert!(seen > 5, "{file}: no metric names found");
        assert!(
            unknown.is_empty(),
            "{file} uses metric names neither narwhal-serve nor narwhal-agent exports: {unknown:?}"
        );
    }
}
