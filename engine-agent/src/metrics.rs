//! Prometheus metrics of the agent, `GET /metrics` (docs/agent.md, docs/monitoring.md).
//!
//! ```text
//!   identity reads (path, outcome, seconds) ─┐
//!   checks (kind, outcome)                   ├─► counters / histogram ─┐
//!   fence refusals, authz refusals          ─┘                         ├─► OpenMetrics text
//!   scrape: fence epoch, certificate expiry (clock now) ─► gauges ─────┘
//! ```
//! Counters are registered without `_total`; the OpenMetrics encoder appends it. Every label
//! value is from a fixed set (no iids, no error texts), so the series count is bounded.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, &'static str)>;

/// Check kinds (label `kind`).
pub const CHECK_KINDS: [&str; 5] = [
    "attestation",
    "generation",
    "kv_produce",
    "kv_consume",
    "probe",
];

/// Identity-read latency buckets, seconds: 50 µs to 250 ms (a cached read is tens of µs, a
/// scan of a busy host's sockets tens of ms).
const IDENTITY_BUCKETS: [f64; 12] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
];

/// Every metric family the agent exports.
pub struct Metrics {
    registry: Registry,
    identity_reads: Family<Labels, Counter>,
    identity_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    checks: Family<Labels, Counter>,
    fence_epoch: Gauge,
    fence_refusals: Family<Labels, Counter>,
    authz_refusals: Family<Labels, Counter>,
    cert_expiry: Family<Labels, Gauge<f64, AtomicU64>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn identity_histogram() -> Histogram {
    Histogram::new(IDENTITY_BUCKETS)
}

impl Metrics {
    /// Registers every family; `agent_id` and the crate version go into `build_info`.
    pub fn new(agent_id: &str) -> Metrics {
        let mut r = Registry::default();
        let identity_reads = Family::<Labels, Counter>::default();
        r.register(
            "narwhal_agent_identity_reads",
            "Engine process identity reads by path (cached re-check, scan of the host's sockets, direct pid file or unit) and outcome (ok, error)",
            identity_reads.clone(),
        );
        let identity_seconds = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(
            identity_histogram,
        );
        r.register(
            "narwhal_agent_identity_read_seconds",
            "Duration of one engine process identity read, by path",
            identity_seconds.clone(),
        );
        let checks = Family::<Labels, Counter>::default();
        r.register(
            "narwhal_agent_checks",
            "Fenced calls by kind (attestation, generation, kv_produce, kv_consume, probe) and outcome (ok; failed = signed with ok false; else the error code: stale_epoch, holder_conflict, forbidden, bad_request, unknown_engine, process_unavailable, engine_unavailable, internal)",
            checks.clone(),
        );
        let fence_epoch = Gauge::default();
        r.register(
            "narwhal_agent_fence_epoch",
            "Highest router lease epoch this agent accepted (persisted in state_dir)",
            fence_epoch.clone(),
        );
        let fence_refusals = Family::<Labels, Counter>::default();
        r.register(
            "narwhal_agent_fence_refusals",
            "Calls refused by the fence, by reason (stale_epoch: lower epoch; holder_conflict: same epoch, other holder)",
            fence_refusals.clone(),
        );
        let authz_refusals = Family::<Labels, Counter>::default();
        r.register(
            "narwhal_agent_forbidden",
            "Calls refused 403 by the caller's certificate identity, by rule and caller role (router, operator, agent, none)",
            authz_refusals.clone(),
        );
        let cert_expiry = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        r.register(
            "narwhal_agent_certificate_expiry_seconds",
            "Seconds until notAfter of the agent's serving certificate (cert=serving) and of the earliest-expiring fleet CA certificate it trusts (cert=ca); negative once expired",
            cert_expiry.clone(),
        );
        let build = Family::<Vec<(&'static str, String)>, Gauge>::default();
        r.register(
            "narwhal_agent_build_info",
            "Agent build and identity: version and agent_id labels; value 1",
            build.clone(),
        );
        build
            .get_or_create(&vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("agent_id", agent_id.to_string()),
            ])
            .set(1);
        for kind in CHECK_KINDS {
            let _ = checks.get_or_create(&vec![("kind", kind), ("outcome", "ok")]);
        }
        for reason in ["stale_epoch", "holder_conflict"] {
            let _ = fence_refusals.get_or_create(&vec![("reason", reason)]);
        }
        Metrics {
            registry: r,
            identity_reads,
            identity_seconds,
            checks,
            fence_epoch,
            fence_refusals,
            authz_refusals,
            cert_expiry,
        }
    }

    /// One identity read: `path` (`cached`, `scan`, `direct`), whether it succeeded, seconds.
    pub fn identity_read(&self, path: &'static str, ok: bool, seconds: f64) {
        let outcome = if ok { "ok" } else { "error" };
        self.identity_reads
            .get_or_create(&vec![("path", path), ("outcome", outcome)])
            .inc();
        self.identity_seconds
            .get_or_create(&vec![("path", path)])
            .observe(seconds);
    }

    /// One fenced call of `kind` ended with `outcome` (`ok`, `failed` or an error code).
    pub fn check(&self, kind: &'static str, outcome: &'static str) {
        self.checks
            .get_or_create(&vec![("kind", kind), ("outcome", outcome)])
            .inc();
        if matches!(outcome, "stale_epoch" | "holder_conflict") {
            self.fence_refusals
                .get_or_create(&vec![("reason", outcome)])
                .inc();
        }
    }

    /// A 403 under `rule` to a caller of `role`.
    pub fn forbidden(&self, rule: &'static str, role: &'static str) {
        self.authz_refusals
            .get_or_create(&vec![("rule", rule), ("role", role)])
            .inc();
    }

    /// Renders the text exposition after setting the scrape-time gauges: the fence `epoch`,
    /// and seconds until each certificate's notAfter (`now` is wall-clock Unix seconds;
    /// `not_after` pairs `serving`/`ca` with Unix seconds).
    pub fn render(&self, epoch: u64, now: f64, not_after: &[(&'static str, i64)]) -> String {
        self.fence_epoch
            .set(i64::try_from(epoch).unwrap_or(i64::MAX));
        for (cert, at) in not_after {
            self.cert_expiry
                .get_or_create(&vec![("cert", *cert)])
                .set(*at as f64 - now);
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_has_every_family_with_bounded_labels() {
        let m = Metrics::new("a");
        m.identity_read("cached", true, 0.00004);
        m.identity_read("scan", false, 0.02);
        m.check("attestation", "ok");
        m.check("generation", "stale_epoch");
        m.forbidden("router_identity_required", "operator");
        let text = m.render(7, 1000.0, &[("serving", 1000 + 86_400), ("ca", 500)]);
        for needle in [
            "narwhal_agent_identity_reads_total{path=\"cached\",outcome=\"ok\"} 1",
            "narwhal_agent_identity_reads_total{path=\"scan\",outcome=\"error\"} 1",
            "narwhal_agent_identity_read_seconds_bucket{le=\"0.00005\",path=\"cached\"} 1",
            "narwhal_agent_checks_total{kind=\"attestation\",outcome=\"ok\"} 1",
            "narwhal_agent_checks_total{kind=\"generation\",outcome=\"stale_epoch\"} 1",
            "narwhal_agent_checks_total{kind=\"probe\",outcome=\"ok\"} 0",
            "narwhal_agent_fence_refusals_total{reason=\"stale_epoch\"} 1",
            "narwhal_agent_fence_refusals_total{reason=\"holder_conflict\"} 0",
            "narwhal_agent_forbidden_total{rule=\"router_identity_required\",role=\"operator\"} 1",
            "narwhal_agent_fence_epoch 7",
            "narwhal_agent_certificate_expiry_seconds{cert=\"serving\"} 86400",
            "narwhal_agent_certificate_expiry_seconds{cert=\"ca\"} -500",
            "narwhal_agent_build_info{version=\"",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
    }
}
