//! Results: per-window figures, their medians over rounds, ratios, the human table and the JSON
//! document (`--json`, schema `narwhal.bench.compare` version 1, docs/benchmarks.md).

use std::fmt::Write as _;

use serde_json::{Value, json};

pub(crate) use narwhal_testkit::bench_docs::EngineCounts;

use crate::load::{Sample, quantile};
use crate::peer::Kind;

/// One measured window of one target.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    /// Round number, from 0.
    pub round: usize,
    /// Completed requests per second.
    pub rps: f64,
    /// Latency quantiles and median time to first byte, seconds.
    pub p50: f64,
    /// See `p50`.
    pub p99: f64,
    /// See `p50`.
    pub ttfb_p50: f64,
    /// Requests completed.
    pub completed: usize,
    /// Requests failed.
    pub errors: usize,
    /// The first failure.
    pub first_error: Option<String>,
    /// Router CPU seconds (user + system, process tree) over the window; `None` for direct.
    pub cpu_s: Option<f64>,
    /// Router `VmRSS` and `VmHWM` at the window's end, KiB.
    pub rss_kib: Option<(u64, u64)>,
    /// The engines' counts over the window.
    pub engines: EngineCounts,
    /// `/proc/loadavg` at the window's end.
    pub loadavg: [f64; 3],
}

impl Window {
    /// A window from a [`Sample`] and the readings around it.
    pub(crate) fn new(
        round: usize,
        s: &Sample,
        cpu_s: Option<f64>,
        rss_kib: Option<(u64, u64)>,
        engines: EngineCounts,
        loadavg: [f64; 3],
    ) -> Window {
        Window {
            round,
            rps: s.rps(),
            p50: quantile(&s.latency_s, 0.5),
            p99: quantile(&s.latency_s, 0.99),
            ttfb_p50: quantile(&s.ttfb_s, 0.5),
            completed: s.latency_s.len(),
            errors: s.errors,
            first_error: s.first_error.clone(),
            cpu_s,
            rss_kib,
            engines,
            loadavg,
        }
    }

    /// Router CPU per completed request, milliseconds.
    pub(crate) fn cpu_ms_per_req(&self) -> Option<f64> {
        let c = self.cpu_s?;
        (self.completed > 0).then(|| c * 1e3 / self.completed as f64)
    }
}

/// One target's windows in one section.
#[derive(Debug, Clone)]
pub(crate) struct TargetRun {
    /// Target name (`direct`, `ours-pd`, `ours-agg`, a peer's name).
    pub name: String,
    /// Its path kind.
    pub kind: Kind,
    /// Whether it is one of the `--peer` routers.
    pub peer: bool,
    /// One per round, in round order.
    pub windows: Vec<Window>,
}

/// Median; NaN when empty (mean of the middle two for an even count).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl TargetRun {
    fn med(&self, f: impl Fn(&Window) -> f64) -> f64 {
        median(self.windows.iter().map(f).collect())
    }

    /// Median requests per second.
    pub(crate) fn rps(&self) -> f64 {
        self.med(|w| w.rps)
    }

    /// Median CPU ms per request (`None` without a router process).
    pub(crate) fn cpu_ms(&self) -> Option<f64> {
        let v: Vec<f64> = self
            .windows
            .iter()
            .filter_map(Window::cpu_ms_per_req)
            .collect();
        (!v.is_empty()).then(|| median(v))
    }

    /// `VmRSS` at the last window's end and the largest `VmHWM`, MiB.
    pub(crate) fn memory_mib(&self) -> Option<(f64, f64)> {
        let last = self.windows.last()?.rss_kib?;
        let hwm = self
            .windows
            .iter()
            .filter_map(|w| w.rss_kib.map(|m| m.1))
            .max()?;
        Some((last.0 as f64 / 1024.0, hwm as f64 / 1024.0))
    }

    /// Total completed and failed requests.
    pub(crate) fn totals(&self) -> (usize, usize) {
        self.windows
            .iter()
            .fold((0, 0), |(c, e), w| (c + w.completed, e + w.errors))
    }

    /// The engines' counts summed over the windows.
    pub(crate) fn engines(&self) -> EngineCounts {
        self.windows
            .iter()
            .fold(EngineCounts::default(), |a, w| a + w.engines)
    }

    /// For a P/D target: why its engines' counts show it did not do P/D (a decode leg without
    /// its transferred KV, a failed transfer, fewer transfers than completed requests).
    pub(crate) fn pd_problem(&self) -> Option<String> {
        if self.kind != Kind::Pd {
            return None;
        }
        let e = self.engines();
        let (completed, _) = self.totals();
        let mut why = Vec::new();
        if e.recomputed > 0 {
            why.push(format!(
                "{} decode-capable requests recomputed",
                e.recomputed
            ));
        }
        if e.rejected > 0 {
            why.push(format!("{} transfers rejected", e.rejected));
        }
        if (e.consumed as usize) < completed {
            why.push(format!(
                "{} transfers consumed for {completed} completed requests",
                e.consumed
            ));
        }
        (!why.is_empty()).then(|| why.join(", "))
    }

    /// Median over rounds of `f(self) / f(other)` for the same round.
    fn ratio(&self, other: &TargetRun, f: impl Fn(&Window) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self
            .windows
            .iter()
            .filter_map(|w| {
                let o = other.windows.iter().find(|o| o.round == w.round)?;
                let (a, b) = (f(w)?, f(o)?);
                (b > 0.0).then_some(a / b)
            })
            .collect();
        (!v.is_empty()).then(|| median(v))
    }

    /// Median of per-round throughput ratios `self / other`.
    pub(crate) fn rps_ratio(&self, other: &TargetRun) -> Option<f64> {
        self.ratio(other, |w| Some(w.rps))
    }

    /// Median of per-round CPU-per-request ratios `self / other`.
    pub(crate) fn cpu_ratio(&self, other: &TargetRun) -> Option<f64> {
        self.ratio(other, Window::cpu_ms_per_req)
    }

    /// Median over rounds of `p50(self) - p50(other)`, milliseconds.
    pub(crate) fn added_p50_ms(&self, other: &TargetRun) -> Option<f64> {
        let v: Vec<f64> = self
            .windows
            .iter()
            .filter_map(|w| {
                let o = other.windows.iter().find(|o| o.round == w.round)?;
                Some((w.p50 - o.p50) * 1e3)
            })
            .collect();
        (!v.is_empty()).then(|| median(v))
    }
}

/// One table: every target at one concurrency and stream mode.
#[derive(Debug, Clone)]
pub(crate) struct Section {
    /// `throughput` or `latency` (concurrency 1).
    pub mode: &'static str,
    /// Streamed requests or not.
    pub stream: bool,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Requests per window.
    pub requests: usize,
    /// Output tokens per request.
    pub tokens: u32,
    /// The targets, in the order they were declared.
    pub targets: Vec<TargetRun>,
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.prec$}"),
        _ => "-".into(),
    }
}

impl Section {
    fn direct(&self) -> Option<&TargetRun> {
        self.targets.iter().find(|t| t.kind == Kind::Direct)
    }

    fn peers(&self) -> impl Iterator<Item = &TargetRun> {
        self.targets.iter().filter(|t| t.peer)
    }

    /// The human table, with the comparison lines under it.
    pub(crate) fn table(&self) -> String {
        let mut out = String::new();
        let rounds = self.targets.first().map_or(0, |t| t.windows.len());
        let _ = writeln!(
            out,
            "\n== {} · {} · concurrency {} · {} tokens · {} requests x {} rounds (medians of rounds)",
            self.mode,
            if self.stream {
                "streaming"
            } else {
                "non-streaming"
            },
            self.concurrency,
            self.tokens,
            self.requests,
            rounds
        );
        let w = self
            .targets
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(6)
            .max(6);
        let mut head = format!(
            "{:<w$} {:<6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>7} {:>7}",
            "target",
            "path",
            "req/s",
            "p50 ms",
            "p99 ms",
            "ttfb ms",
            "+p50 ms",
            "cpu ms",
            "RSS MB",
            "peak MB",
            "xdirect"
        );
        for p in self.peers() {
            let _ = write!(
                head,
                " {:>w2$}",
                format!("/{}", p.name),
                w2 = p.name.len() + 1
            );
        }
        head.push_str("  errors");
        let _ = writeln!(out, "{head}");
        let direct = self.direct();
        for t in &self.targets {
            let mem = t.memory_mib();
            let (_, errors) = t.totals();
            let mut line = format!(
                "{:<w$} {:<6} {:>8.0} {:>8.2} {:>8.2} {:>8.2} {:>8} {:>7} {:>7} {:>7} {:>7}",
                t.name,
                t.kind.as_str(),
                t.rps(),
                t.med(|w| w.p50) * 1e3,
                t.med(|w| w.p99) * 1e3,
                t.med(|w| w.ttfb_p50) * 1e3,
                fmt_opt(direct.and_then(|d| t.added_p50_ms(d)), 3),
                fmt_opt(t.cpu_ms(), 3),
                fmt_opt(mem.map(|m| m.0), 1),
                fmt_opt(mem.map(|m| m.1), 1),
                fmt_opt(direct.and_then(|d| t.rps_ratio(d)), 2),
            );
            for p in self.peers() {
                let _ = write!(
                    line,
                    " {:>w2$}",
                    fmt_opt(t.rps_ratio(p), 2),
                    w2 = p.name.len() + 1
                );
            }
            let _ = write!(line, "  {errors:>6}");
            let _ = writeln!(out, "{line}");
        }
        // Ours against each peer of the same kind.
        for ours in self
            .targets
            .iter()
            .filter(|t| !t.peer && t.kind != Kind::Direct)
        {
            for p in self.peers().filter(|p| p.kind == ours.kind) {
                let _ = writeln!(
                    out,
                    "  {} vs {}: throughput {}x, router CPU per request {}x, p50 {:+.3} ms (medians of per-round ratios)",
                    ours.name,
                    p.name,
                    fmt_opt(ours.rps_ratio(p), 2),
                    fmt_opt(ours.cpu_ratio(p), 2),
                    ours.added_p50_ms(p).unwrap_or(f64::NAN),
                );
            }
        }
        for t in self.targets.iter().filter(|t| t.kind == Kind::Pd) {
            let e = t.engines();
            let _ = writeln!(
                out,
                "  {} engines: {} prefill legs, {} decode legs, {} KV issued, {} consumed, {} recomputed, {} rejected{}",
                t.name,
                e.prefill,
                e.decode,
                e.issued,
                e.consumed,
                e.recomputed,
                e.rejected,
                t.pd_problem()
                    .map(|p| format!("  <- NOT P/D: {p}"))
                    .unwrap_or_default()
            );
        }
        for t in &self.targets {
            if let Some(e) = t.windows.iter().find_map(|w| w.first_error.as_ref()) {
                let _ = writeln!(out, "  {} first error: {e}", t.name);
            }
        }
        out
    }

    /// The section as JSON.
    pub(crate) fn to_json(&self) -> Value {
        let direct = self.direct();
        let targets: Vec<Value> = self
            .targets
            .iter()
            .map(|t| {
                let (completed, errors) = t.totals();
                let mem = t.memory_mib();
                let peers: serde_json::Map<String, Value> = self
                    .peers()
                    .map(|p| (p.name.clone(), json!(t.rps_ratio(p))))
                    .collect();
                let cpu_peers: serde_json::Map<String, Value> = self
                    .peers()
                    .map(|p| (p.name.clone(), json!(t.cpu_ratio(p))))
                    .collect();
                json!({
                    "name": t.name,
                    "kind": t.kind.as_str(),
                    "peer": t.peer,
                    "rps": t.rps(),
                    "p50_ms": t.med(|w| w.p50) * 1e3,
                    "p99_ms": t.med(|w| w.p99) * 1e3,
                    "ttfb_p50_ms": t.med(|w| w.ttfb_p50) * 1e3,
                    "added_p50_ms": direct.and_then(|d| t.added_p50_ms(d)),
                    "cpu_ms_per_request": t.cpu_ms(),
                    "rss_mib": mem.map(|m| m.0),
                    "peak_rss_mib": mem.map(|m| m.1),
                    "ratio_to_direct": direct.and_then(|d| t.rps_ratio(d)),
                    "ratio_to_peers": peers,
                    "cpu_ratio_to_peers": cpu_peers,
                    "completed": completed,
                    "errors": errors,
                    "engines": t.engines(),
                    "pd_problem": t.pd_problem(),
                    "windows": t.windows.iter().map(|w| json!({
                        "round": w.round,
                        "rps": w.rps,
                        "p50_ms": w.p50 * 1e3,
                        "p99_ms": w.p99 * 1e3,
                        "ttfb_p50_ms": w.ttfb_p50 * 1e3,
                        "completed": w.completed,
                        "errors": w.errors,
                        "first_error": w.first_error,
                        "cpu_s": w.cpu_s,
                        "cpu_ms_per_request": w.cpu_ms_per_req(),
                        "rss_kib": w.rss_kib.map(|m| m.0),
                        "hwm_kib": w.rss_kib.map(|m| m.1),
                        "engines": w.engines,
                        "loadavg": w.loadavg,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({
            "mode": self.mode,
            "stream": self.stream,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "tokens": self.tokens,
            "targets": targets,
        })
    }

    /// Failed requests plus P/D targets that did not do P/D.
    pub(crate) fn problems(&self) -> usize {
        self.targets
            .iter()
            .map(|t| t.totals().1 + usize::from(t.pd_problem().is_some()))
            .sum()
    }
}

/// The performance goals line for our routers in `sections` (streamed CPU per request, RSS,
/// added p50 at concurrency 1), for the reader's convenience; nothing is asserted.
pub(crate) fn goals(sections: &[Section]) -> String {
    let mut parts = Vec::new();
    for s in sections.iter().filter(|s| s.stream) {
        let find = |n: &str| s.targets.iter().find(|t| t.name == n);
        if s.mode == "throughput" {
            if let Some(t) = find("ours-agg") {
                parts.push(format!(
                    "ours-agg CPU {} ms/req (goal <= 0.10)",
                    fmt_opt(t.cpu_ms(), 3)
                ));
            }
            if let Some(t) = find("ours-pd") {
                parts.push(format!(
                    "ours-pd CPU {} ms/req (goal <= 0.15)",
                    fmt_opt(t.cpu_ms(), 3)
                ));
            }
            let peak = s
                .targets
                .iter()
                .filter(|t| !t.peer)
                .filter_map(|t| t.memory_mib().map(|m| m.1))
                .fold(f64::NAN, f64::max);
            parts.push(format!(
                "peak RSS {} MiB (goal < 32)",
                fmt_opt(Some(peak), 1)
            ));
        } else if let (Some(t), Some(d)) = (find("ours-agg"), s.direct()) {
            parts.push(format!(
                "ours-agg +p50 {} ms at concurrency 1 (goal <= 0.15)",
                fmt_opt(t.added_p50_ms(d), 3)
            ));
        }
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("\nperformance goals (streamed): {}\n", parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn win(round: usize, rps: f64, p50: f64, cpu: Option<f64>, completed: usize) -> Window {
        Window {
            round,
            rps,
            p50,
            p99: p50 * 2.0,
            ttfb_p50: p50 / 2.0,
            completed,
            errors: 0,
            first_error: None,
            cpu_s: cpu,
            rss_kib: cpu.map(|_| (10 * 1024, 12 * 1024)),
            engines: EngineCounts::default(),
            loadavg: [0.0; 3],
        }
    }

    fn run(name: &str, kind: Kind, peer: bool, w: Vec<Window>) -> TargetRun {
        TargetRun {
            name: name.into(),
            kind,
            peer,
            windows: w,
        }
    }

    #[test]
    fn medians_and_ratios_are_per_round() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
        let d = run(
            "direct",
            Kind::Direct,
            false,
            vec![
                win(0, 100.0, 0.001, None, 10),
                win(1, 200.0, 0.001, None, 10),
            ],
        );
        let o = run(
            "ours-agg",
            Kind::Agg,
            false,
            vec![
                win(0, 50.0, 0.002, Some(0.01), 10),
                win(1, 50.0, 0.003, Some(0.02), 10),
            ],
        );
        // Per-round ratios 0.5 and 0.25, median 0.375 (not 50 / 150).
        assert_eq!(o.rps_ratio(&d), Some(0.375));
        assert!((o.added_p50_ms(&d).unwrap() - 1.5).abs() < 1e-9);
        assert!((o.cpu_ms().unwrap() - 1.5).abs() < 1e-9);
        assert_eq!(d.cpu_ms(), None);
        assert_eq!(o.memory_mib(), Some((10.0, 12.0)));
    }

    #[test]
    fn pd_without_transfers_is_flagged() {
        let mut w = win(0, 1.0, 0.001, Some(0.1), 10);
        w.engines = EngineCounts {
            prefill: 10,
            decode: 10,
            issued: 10,
            consumed: 10,
            ..Default::default()
        };
        let good = run("p", Kind::Pd, true, vec![w.clone()]);
        assert_eq!(good.pd_problem(), None);
        w.engines.consumed = 0;
        w.engines.recomputed = 10;
        let bad = run("p", Kind::Pd, true, vec![w]);
        assert!(bad.pd_problem().unwrap().contains("recomputed"));
        let s = Section {
            mode: "throughput",
            stream: true,
            concurrency: 1,
            requests: 10,
            tokens: 16,
            targets: vec![good, bad],
        };
        assert_eq!(s.problems(), 1);
        assert!(s.table().contains("NOT P/D"));
    }
}
