//! Prometheus metrics (behaviour.md 10) via prometheus-client.
//!
//! ```text
//!  settle / attempts / breaker transitions ──inc──► counters, histograms
//!  GET /metrics ──refresh(gauges from the core snapshot)──► OpenMetrics text
//! ```
//!
//! Counters are registered without the `_total` suffix; the OpenMetrics encoder appends it, so
//! samples read `narwhal_served_total 3` as in the reference. Reason-labelled counters are
//! pre-seeded with every known reason at 0.

use prometheus_client::encoding::EncodeMetric;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

mod kv;

pub(crate) use kv::{KvMetrics, raise};

use crate::outcome::{EXPIRED_REASONS, FAILED_REASONS, REFUSED_REASONS, REJECTED_REASONS};

/// Label set: ordered `(name, value)` pairs.
pub(crate) type Labels = Vec<(String, String)>;
type HistFamily = Family<Labels, Histogram, HistCtor>;

/// Builds histograms with fixed bucket edges.
#[derive(Clone, Debug)]
pub(crate) struct HistCtor(Vec<f64>);

impl prometheus_client::metrics::family::MetricConstructor<Histogram> for HistCtor {
    fn new_metric(&self) -> Histogram {
        Histogram::new(self.0.clone())
    }
}

/// Build a label set.
pub(crate) fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

/// Bucket edges = SLO × these factors, rounded to 6 decimals (behaviour.md 10).
const BUCKET_FACTORS: [f64; 11] = [0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0, 1.5, 3.0, 10.0];

/// `%g`-like formatting of an SLO for the `slo` label (`2.0` → `"2"`, `0.05` → `"0.05"`).
pub(crate) fn fmt_g(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

fn buckets(slo: f64) -> Vec<f64> {
    BUCKET_FACTORS
        .iter()
        .map(|f| (slo * f * 1e6).round() / 1e6)
        .collect()
}

/// Every metric family the router exports, in groups that each own their families (the
/// design note in lib.rs: no struct holds more than about eight pieces of shared mutable state).
/// Registration order, hence the `/metrics` order, is the order of [`Metrics::new`], not of these
/// groups.
pub(crate) struct Metrics {
    registry: Registry,
    /// `(name, help, type)` of every family registered through `Metrics::new`: a family
    /// without a sample is still declared (`# HELP`, `# TYPE`) in [`Metrics::render`], as
    /// docs/http-api.md promises and the reference's client library does (prometheus-client
    /// leaves an empty family out).
    declared: Vec<(&'static str, &'static str, &'static str)>,
    /// What ingress saw (behaviour.md 10, contract/traffic): requests offered, sized or not, and
    /// those refused, rejected or invalid before any placement.
    pub(crate) intake: Intake,
    /// How requests ended (behaviour.md 10): served, met both SLOs, expired, failed, cancelled.
    pub(crate) settled: Settled,
    /// The legs sent to engines: attempts per phase, decode tokens seen, attempt failures, upstream seconds, and the TTFT/TPOT histograms.
    pub(crate) legs: Legs,
    /// Retries and the retry budget (behaviour.md 10; `retry.rs`).
    pub(crate) retries: Retries,
    /// Admission and the HTTP front door: in-flight requests, the queue and retained connections, with their limits and high-water marks.
    pub(crate) capacity: Capacity,
    /// Fleet health per engine: ejections and readmissions, breaker streaks, probes, degraded engines and engines awaiting their first health 200.
    pub(crate) engines: EngineHealth,
    /// Lifecycle and roles per engine: drain state, ready_to_stop, lifecycle state, validations, role, pool sizes and resident requests.
    pub(crate) roles: Roles,
    /// This router's readiness, lease epoch and what it persists: journal drops, state-file writes and failures, the last takeover gap.
    pub(crate) durability: Durability,
    pub(crate) slo_label_ttft: String,
    pub(crate) slo_label_tpot: String,
    /// Control, lease and certificate gauges for operators (docs/monitoring.md).
    pub(crate) ops: OpsMetrics,
    /// The KV index per engine and the KV score's `/tokenize` calls
    /// (docs/design/kv-aware-placement.md).
    pub(crate) kv: KvMetrics,
}

/// What ingress saw (behaviour.md 10, contract/traffic): requests offered, sized or not, and those
/// refused, rejected or invalid before any placement.
#[derive(Default)]
pub(crate) struct Intake {
    pub(crate) offered: Counter,
    pub(crate) unsized_offered: Counter,
    pub(crate) invalid_requests: Counter,
    pub(crate) refused: Family<Labels, Counter>,
    pub(crate) rejected: Family<Labels, Counter>,
}

/// How requests ended (behaviour.md 10): served, met both SLOs, expired, failed, cancelled.
#[derive(Default)]
pub(crate) struct Settled {
    pub(crate) served: Counter,
    pub(crate) slo_met: Counter,
    pub(crate) expired: Family<Labels, Counter>,
    pub(crate) failed: Family<Labels, Counter>,
    pub(crate) cancelled: Counter,
}

/// The legs sent to engines: attempts per phase, decode tokens seen, attempt failures, upstream seconds, and the TTFT/TPOT histograms.
pub(crate) struct Legs {
    pub(crate) prefill_attempts: Counter,
    pub(crate) decode_attempts: Counter,
    pub(crate) decode_tokens_observed: Counter,
    pub(crate) attempt_failures: Family<Labels, Counter>,
    /// `narwhal_kv_pickups_total{outcome}`: decode legs that carried a vLLM KV descriptor and
    /// were kept after their request ended before the decode's first output, so the decode
    /// still reads the producer's staged KV (`serve::leg::Pickup`): `collected` (first output:
    /// the KV left the producer, then the leg was closed) or `failed` (the leg failed; the
    /// producer's own expiry frees the blocks). Both seeded at 0.
    pub(crate) kv_pickups: Family<Labels, Counter>,
    pub(crate) upstream_seconds: Family<Labels, Counter<f64, AtomicU64>>,
    pub(crate) ttft: HistFamily,
    pub(crate) tpot: HistFamily,
}

/// Retries and the retry budget (behaviour.md 10; `retry.rs`).
#[derive(Default)]
pub(crate) struct Retries {
    pub(crate) retry_attempts: Counter,
    pub(crate) retry_credits_spent: Counter,
    pub(crate) retry_denied: Counter,
    pub(crate) served_after_retry: Counter,
    pub(crate) retry_credits: Gauge<f64, AtomicU64>,
}

/// Admission and the HTTP front door: in-flight requests, the queue and retained connections, with their limits and high-water marks.
#[derive(Default)]
pub(crate) struct Capacity {
    pub(crate) http_retained: Gauge,
    pub(crate) http_retained_limit: Gauge,
    pub(crate) http_retained_high_water: Gauge,
    pub(crate) admission_inflight: Gauge,
    pub(crate) admission_inflight_limit: Gauge,
    pub(crate) queued: Gauge,
    pub(crate) queue_high_water: Gauge,
}

/// Fleet health per engine: ejections and readmissions, breaker streaks, probes, degraded engines and engines awaiting their first health 200.
#[derive(Default)]
pub(crate) struct EngineHealth {
    pub(crate) ejected_instances: Gauge,
    pub(crate) ejected: Family<Labels, Gauge>,
    pub(crate) ejections: Family<Labels, Counter>,
    pub(crate) readmissions: Family<Labels, Counter>,
    pub(crate) breaker_streak: Family<Labels, Gauge>,
    pub(crate) probes: Family<Labels, Counter>,
    /// 1 while the ejection bound keeps a failing engine in placement.
    pub(crate) engine_degraded: Family<Labels, Gauge>,
    /// 1 while an engine waits for its first health 200 (the health gate).
    pub(crate) engine_awaiting_health: Family<Labels, Gauge>,
}

/// Lifecycle and roles per engine: drain state, ready_to_stop, lifecycle state, validations, role, pool sizes and resident requests.
#[derive(Default)]
pub(crate) struct Roles {
    pub(crate) engine_draining: Family<Labels, Gauge>,
    pub(crate) engine_ready_to_stop: Family<Labels, Gauge>,
    pub(crate) engine_lifecycle_state: Family<Labels, Gauge>,
    pub(crate) lifecycle_validations: Family<Labels, Counter>,
    pub(crate) instance_role: Family<Labels, Gauge>,
    pub(crate) pool_instances: Family<Labels, Gauge>,
    pub(crate) resident: Family<Labels, Gauge>,
    pub(crate) foreign: Family<Labels, Gauge>,
}

/// This router's readiness, lease epoch and what it persists: journal drops, state-file writes and failures, the last takeover gap.
#[derive(Default)]
pub(crate) struct Durability {
    pub(crate) router_ready: Gauge,
    pub(crate) router_lease_epoch: Gauge,
    pub(crate) journal_dropped: Gauge,
    pub(crate) state_writes: Counter,
    pub(crate) state_write_failures: Counter,
    pub(crate) takeover_gap: Gauge<f64, AtomicU64>,
}

impl Legs {
    /// Fresh leg families, the histograms bucketed by `ttft_s` and `tpot_s`.
    fn new(ttft_s: f64, tpot_s: f64) -> Legs {
        Legs {
            prefill_attempts: Counter::default(),
            decode_attempts: Counter::default(),
            decode_tokens_observed: Counter::default(),
            attempt_failures: Family::default(),
            kv_pickups: Family::default(),
            upstream_seconds: Family::default(),
            ttft: HistFamily::new_with_constructor(HistCtor(buckets(ttft_s))),
            tpot: HistFamily::new_with_constructor(HistCtor(buckets(tpot_s))),
        }
    }
}

/// Registers families in `/metrics` order, remembering each one's name, help and type for
/// [`declare_empty`].
#[derive(Default)]
struct Registrar {
    r: Registry,
    declared: Vec<(&'static str, &'static str, &'static str)>,
}

impl Registrar {
    /// Registers family `name` as a clone of `m` (sharing its values).
    fn add<M: prometheus_client::registry::Metric + Clone>(
        &mut self,
        name: &'static str,
        help: &'static str,
        m: &M,
    ) {
        self.declared.push((name, help, kind_of(m)));
        self.r.register(name, help, m.clone());
    }
}

/// The traffic counters: requests served, meeting both SLOs, offered, unsized, expired.
fn register_traffic(reg: &mut Registrar, intake: &Intake, settled: &Settled) {
    reg.add(
        "narwhal_served",
        "Requests completed without error",
        &settled.served,
    );
    reg.add(
        "narwhal_slo_met",
        "Completed requests that met both the TTFT and TPOT SLOs",
        &settled.slo_met,
    );
    reg.add(
        "narwhal_offered",
        "Completion requests seen by ingress",
        &intake.offered,
    );
    reg.add(
        "narwhal_unsized_offered",
        "Requests that settled before sizing",
        &intake.unsized_offered,
    );
    reg.add(
        "narwhal_expired",
        "Original requests terminated by their admission or total deadline, by reason",
        &settled.expired,
    );
}

/// The attempt counters: legs per phase, retries and the credits they spent, decode tokens,
/// attempt failures, KV pickups (both outcomes seeded at 0).
fn register_attempts(reg: &mut Registrar, legs: &Legs, retries: &Retries) {
    reg.add(
        "narwhal_prefill_attempts",
        "Prefill legs dispatched",
        &legs.prefill_attempts,
    );
    reg.add(
        "narwhal_decode_attempts",
        "Decode legs dispatched",
        &legs.decode_attempts,
    );
    reg.add(
        "narwhal_retry_attempts",
        "Attempts after the first",
        &retries.retry_attempts,
    );
    reg.add(
        "narwhal_retry_credits_spent",
        "Retry budget credits spent",
        &retries.retry_credits_spent,
    );
    reg.add(
        "narwhal_retry_denied",
        "Retries denied by the retry budget",
        &retries.retry_denied,
    );
    reg.add(
        "narwhal_served_after_retry",
        "Requests completed by an attempt after the first",
        &retries.served_after_retry,
    );
    reg.add(
        "narwhal_decode_tokens_observed",
        "Output tokens counted from decode streams",
        &legs.decode_tokens_observed,
    );
    reg.add(
        "narwhal_attempt_failures",
        "Failed attempts by request phase and failure reason",
        &legs.attempt_failures,
    );
    reg.add(
        "narwhal_kv_pickups",
        "Decode legs carrying a KV descriptor kept after their request ended before the first output, so the staged KV is still read: collected, or failed (the producer's expiry frees it)",
        &legs.kv_pickups,
    );
    for outcome in ["collected", "failed"] {
        let _ = legs
            .kv_pickups
            .get_or_create(&labels(&[("outcome", outcome)]));
    }
}

/// The admission gauges (retained requests, retry credits, seats, the queue) and the
/// upstream seconds per phase.
fn register_admission(reg: &mut Registrar, capacity: &Capacity, retries: &Retries, legs: &Legs) {
    reg.add(
        "narwhal_http_retained",
        "Completion requests currently retained",
        &capacity.http_retained,
    );
    reg.add(
        "narwhal_http_retained_limit",
        "Retained request limit (max_concurrent + queue_capacity)",
        &capacity.http_retained_limit,
    );
    reg.add(
        "narwhal_http_retained_high_water",
        "Highest retained request count",
        &capacity.http_retained_high_water,
    );
    reg.add(
        "narwhal_retry_credits",
        "Retry budget credits available",
        &retries.retry_credits,
    );
    reg.add(
        "narwhal_admission_inflight",
        "Admission seats in use",
        &capacity.admission_inflight,
    );
    reg.add(
        "narwhal_queued",
        "Requests waiting for an admission seat",
        &capacity.queued,
    );
    reg.add(
        "narwhal_queue_high_water",
        "Most requests ever waiting for an admission seat",
        &capacity.queue_high_water,
    );
    reg.add(
        "narwhal_admission_inflight_limit",
        "Admission seats",
        &capacity.admission_inflight_limit,
    );
    reg.add(
        "narwhal_upstream_seconds",
        "Seconds spent in upstream legs, by phase",
        &legs.upstream_seconds,
    );
}

/// This router's readiness and lease epoch, then the lifecycle and role families per engine.
fn register_lifecycle(reg: &mut Registrar, durability: &Durability, roles: &Roles) {
    reg.add(
        "narwhal_router_ready",
        "1 while this router may admit new traffic",
        &durability.router_ready,
    );
    reg.add(
        "narwhal_router_lease_epoch",
        "Router lease epoch (0 without a lease)",
        &durability.router_lease_epoch,
    );
    reg.add(
        "narwhal_engine_draining",
        "1 while the engine is held out by a drain",
        &roles.engine_draining,
    );
    reg.add(
        "narwhal_engine_ready_to_stop",
        "1 while an external supervisor may stop the engine's process",
        &roles.engine_ready_to_stop,
    );
    reg.add(
        "narwhal_engine_lifecycle_state",
        "1 for the engine's current lifecycle state",
        &roles.engine_lifecycle_state,
    );
    reg.add(
        "narwhal_lifecycle_validations",
        "Readmission validations by engine, kind (operator, recovery) and result",
        &roles.lifecycle_validations,
    );
    reg.add(
        "narwhal_instance_role",
        "Current pool assignment for each engine (1 = assigned this role)",
        &roles.instance_role,
    );
    reg.add(
        "narwhal_pool_instances",
        "Engines assigned to each pool",
        &roles.pool_instances,
    );
    reg.add(
        "narwhal_resident_requests",
        "Requests resident on each instance",
        &roles.resident,
    );
    reg.add(
        "narwhal_engine_foreign_requests",
        "Requests an engine reported running or waiting beyond this router's own (serving.engine_load_poll_s; 0 when off)",
        &roles.foreign,
    );
}

/// The families of requests refused, rejected, invalid, failed or cancelled.
fn register_refusals(reg: &mut Registrar, intake: &Intake, settled: &Settled) {
    reg.add(
        "narwhal_refused",
        "Requests refused by predictive admission, by cause",
        &intake.refused,
    );
    reg.add(
        "narwhal_rejected",
        "Requests refused with HTTP 429 for capacity or HTTP 503 for router readiness, by reason",
        &intake.rejected,
    );
    reg.add(
        "narwhal_invalid_requests",
        "Requests refused as invalid before dispatch",
        &intake.invalid_requests,
    );
    reg.add(
        "narwhal_failed",
        "Requests that ended in an error, by reason",
        &settled.failed,
    );
    reg.add(
        "narwhal_cancelled",
        "Requests abandoned by their client before completion",
        &settled.cancelled,
    );
}

/// The engine health families: ejections, readmissions, breaker streaks, probes, degraded
/// engines and engines awaiting health.
fn register_engine_health(reg: &mut Registrar, engines: &EngineHealth) {
    reg.add(
        "narwhal_ejected_instances",
        "Instances the breaker currently holds out of scheduling and both loads",
        &engines.ejected_instances,
    );
    reg.add(
        "narwhal_ejected",
        "1 while this instance is ejected",
        &engines.ejected,
    );
    reg.add(
        "narwhal_engine_ejections",
        "Engine ejections since router start, by cause",
        &engines.ejections,
    );
    reg.add(
        "narwhal_engine_readmissions",
        "Engines returned to placement, by evidence",
        &engines.readmissions,
    );
    reg.add(
        "narwhal_engine_breaker_streak",
        "Consecutive leg failures per engine and class",
        &engines.breaker_streak,
    );
    reg.add(
        "narwhal_engine_probes",
        "Breaker probes by engine, kind and outcome",
        &engines.probes,
    );
    reg.add(
        "narwhal_engine_degraded",
        "1 while the ejection bound keeps a failing engine in placement",
        &engines.engine_degraded,
    );
    reg.add(
        "narwhal_engine_awaiting_health",
        "1 while an engine waits for its first health answer 200",
        &engines.engine_awaiting_health,
    );
}

/// The TTFT and TPOT histograms, then the journal, takeover and state-file families.
fn register_latency_and_persistence(reg: &mut Registrar, legs: &Legs, durability: &Durability) {
    reg.add(
        "narwhal_ttft_seconds",
        "Router arrival to first token",
        &legs.ttft,
    );
    reg.add(
        "narwhal_tpot_seconds",
        "Mean time per output token after the first",
        &legs.tpot,
    );
    reg.add(
        "narwhal_journal_dropped_rows",
        "Journal rows dropped because the writer fell behind",
        &durability.journal_dropped,
    );
    reg.add(
        "narwhal_standby_takeover_gap_seconds",
        "Seconds from the standby's last good poll of the primary to serving as primary",
        &durability.takeover_gap,
    );
    reg.add(
        "narwhal_state_writes",
        "Handoff documents written to recovery.state_path",
        &durability.state_writes,
    );
    reg.add(
        "narwhal_state_write_failures",
        "State file writes that failed (the previous file stays intact)",
        &durability.state_write_failures,
    );
}

impl Metrics {
    /// Register every family; `ttft_s`/`tpot_s` scale the histogram buckets.
    pub(crate) fn new(ttft_s: f64, tpot_s: f64) -> Self {
        let mut reg = Registrar::default();
        let contract: Family<Labels, Gauge> = Family::default();
        reg.add(
            "narwhal_contract_info",
            "Metrics contract of this router",
            &contract,
        );
        contract
            .get_or_create(&labels(&[("contract", "metrics"), ("version", "2")]))
            .set(1);
        let intake = Intake::default();
        let settled = Settled::default();
        let legs = Legs::new(ttft_s, tpot_s);
        let retries = Retries::default();
        let capacity = Capacity::default();
        let engines = EngineHealth::default();
        let roles = Roles::default();
        let durability = Durability::default();
        register_traffic(&mut reg, &intake, &settled);
        register_attempts(&mut reg, &legs, &retries);
        register_admission(&mut reg, &capacity, &retries, &legs);
        register_lifecycle(&mut reg, &durability, &roles);
        register_refusals(&mut reg, &intake, &settled);
        register_engine_health(&mut reg, &engines);
        register_latency_and_persistence(&mut reg, &legs, &durability);
        let ops = OpsMetrics::register(&mut reg.r);
        let kv = KvMetrics::register(&mut reg.r);
        let m = Metrics {
            registry: Registry::default(),
            declared: Vec::new(),
            intake,
            settled,
            legs,
            retries,
            capacity,
            engines,
            roles,
            durability,
            slo_label_ttft: fmt_g(ttft_s),
            slo_label_tpot: fmt_g(tpot_s),
            ops,
            kv,
        };
        // The admission, monitoring and controller families are rendered live by
        // `controller::report` (controller.md 12).
        let slo: Family<Labels, Gauge<f64, AtomicU64>> = Family::default();
        reg.add(
            "narwhal_slo_seconds",
            "Configured service-level latency budget in seconds",
            &slo,
        );
        slo.get_or_create(&labels(&[("metric", "ttft"), ("slo", &m.slo_label_ttft)]))
            .set(ttft_s);
        slo.get_or_create(&labels(&[("metric", "tpot"), ("slo", &m.slo_label_tpot)]))
            .set(tpot_s);
        m.seed_labels();
        Metrics {
            registry: reg.r,
            declared: reg.declared,
            ..m
        }
    }

    /// Seeds every known reason, cause, phase and SLO label at 0, so each sample exists from
    /// the start.
    fn seed_labels(&self) {
        for r in FAILED_REASONS {
            let _ = self.settled.failed.get_or_create(&labels(&[("reason", r)]));
        }
        for r in REJECTED_REASONS {
            let _ = self
                .intake
                .rejected
                .get_or_create(&labels(&[("reason", r)]));
        }
        for r in EXPIRED_REASONS {
            let _ = self
                .settled
                .expired
                .get_or_create(&labels(&[("reason", r)]));
        }
        for r in REFUSED_REASONS {
            let _ = self.intake.refused.get_or_create(&labels(&[("cause", r)]));
        }
        for p in ["prefill", "decode"] {
            let _ = self
                .legs
                .upstream_seconds
                .get_or_create(&labels(&[("phase", p)]));
        }
        let _ = self
            .legs
            .ttft
            .get_or_create(&labels(&[("slo", &self.slo_label_ttft)]));
        let _ = self
            .legs
            .tpot
            .get_or_create(&labels(&[("slo", &self.slo_label_tpot)]));
    }

    /// Starts the outcome counters at a restored handoff's totals (`--resume`, takeover), so
    /// `/metrics` continues from the previous router's counts as `/narwhal/state` does.
    pub(crate) fn restore_totals(
        &self,
        t: &crate::outcome::Tally,
        h: &narwhal_shared::handoff::Handoff,
    ) {
        let c = |k: &str| h.counters.get(k).copied().unwrap_or(0);
        self.settled.served.inc_by(c("served"));
        self.settled.slo_met.inc_by(c("slo_met"));
        self.intake.offered.inc_by(c("offered"));
        self.intake.unsized_offered.inc_by(c("unsized_offered"));
        self.settled.cancelled.inc_by(c("cancelled"));
        self.intake.invalid_requests.inc_by(c("invalid_requests"));
        for (terminal, family, label) in [
            ("failed", &self.settled.failed, "reason"),
            ("rejected", &self.intake.rejected, "reason"),
            ("expired", &self.settled.expired, "reason"),
            ("refused", &self.intake.refused, "cause"),
        ] {
            if let Some(reasons) = t.reasons.get(terminal) {
                for (reason, n) in reasons {
                    if *n > 0 {
                        family.get_or_create(&labels(&[(label, reason)])).inc_by(*n);
                    }
                }
            }
        }
    }

    /// Observe a first-token latency, seconds.
    pub(crate) fn observe_ttft(&self, s: f64) {
        self.legs
            .ttft
            .get_or_create(&labels(&[("slo", &self.slo_label_ttft)]))
            .observe(s);
    }

    /// Observe a time per output token, seconds.
    pub(crate) fn observe_tpot(&self, s: f64) {
        self.legs
            .tpot
            .get_or_create(&labels(&[("slo", &self.slo_label_tpot)]))
            .observe(s);
    }

    /// Prometheus text (exposition 0.0.4, like the reference) of every family.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        declare_empty(&mut out, &self.declared);
        to_prometheus_text(&out)
    }
}

/// The gauges an operator alerts on (docs/monitoring.md): whether this
/// router controls the fleet, its lease (state, holder, validity left, configured timing) and
/// its certificates' expiry. Refreshed at scrape time (`documents::metrics`). The lease
/// families have no sample with `lease.backend` `none` (nothing expires), the certificate
/// family one per configured certificate.
pub(crate) struct OpsMetrics {
    /// `narwhal_router_controls_fleet`: 1 while this router controls the fleet (lifecycle
    /// `router.controls_fleet` = `active`; always 1 with lease backend `none` unless an agent
    /// fenced it), else 0. Unlike `narwhal_router_ready` it stays 1 during a whole-wave drain.
    pub(crate) controls_fleet: Gauge,
    /// `narwhal_router_lease_info{state, holder}`: 1 for this router's view; `state` =
    /// `active` | `standby` | `fenced`, `holder` = the holder token it holds (`""` when none).
    pub(crate) lease_info: Family<Labels, Gauge>,
    /// `narwhal_router_lease_expires_in_seconds`: seconds until this router's local lease
    /// validity ends (`ttl_s − safety_margin_s` after the last good renewal); 0 when it holds
    /// no lease.
    pub(crate) lease_expires_in: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `narwhal_router_lease_ttl_seconds`: `lease.ttl_s`.
    pub(crate) lease_ttl: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `narwhal_router_lease_renew_interval_seconds`: `lease.renew_interval_s`.
    pub(crate) lease_renew_interval: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `narwhal_router_certificate_expiry_seconds{cert}`: seconds until `notAfter` of each
    /// certificate the router loaded (`tls.cert`, `tls.ca`, `control.tls.cert`,
    /// `control.tls.ca`, `lease.tls.cert`, `lease.tls.ca`; a CA bundle counts its
    /// earliest-expiring certificate); negative once expired.
    pub(crate) certificate_expiry: Family<Labels, Gauge<f64, AtomicU64>>,
    /// `(cert label, notAfter Unix seconds)`, read once from the files at the first scrape.
    pub(crate) not_after: std::sync::OnceLock<Vec<(String, i64)>>,
}

impl OpsMetrics {
    /// Registers the families in `r`.
    fn register(r: &mut Registry) -> OpsMetrics {
        let m = OpsMetrics {
            controls_fleet: Gauge::default(),
            lease_info: Family::default(),
            lease_expires_in: Family::default(),
            lease_ttl: Family::default(),
            lease_renew_interval: Family::default(),
            certificate_expiry: Family::default(),
            not_after: std::sync::OnceLock::new(),
        };
        r.register(
            "narwhal_router_controls_fleet",
            "1 while this router controls the fleet (lease held and not fenced; lease backend none: unless an agent fenced it), else 0; stays 1 during a whole-wave drain",
            m.controls_fleet.clone(),
        );
        r.register(
            "narwhal_router_lease_info",
            "This router's lease view, value 1: state (active, standby, fenced) and the holder token it holds (empty when none)",
            m.lease_info.clone(),
        );
        r.register(
            "narwhal_router_lease_expires_in_seconds",
            "Seconds until this router's local lease validity ends (ttl_s minus safety_margin_s after the last renewal); 0 when it holds no lease; no sample with lease backend none",
            m.lease_expires_in.clone(),
        );
        r.register(
            "narwhal_router_lease_ttl_seconds",
            "lease.ttl_s of the fleet file; no sample with lease backend none",
            m.lease_ttl.clone(),
        );
        r.register(
            "narwhal_router_lease_renew_interval_seconds",
            "lease.renew_interval_s of the fleet file; no sample with lease backend none",
            m.lease_renew_interval.clone(),
        );
        r.register(
            "narwhal_router_certificate_expiry_seconds",
            "Seconds until notAfter of each certificate the router loaded, by fleet-file key (tls.cert, tls.ca, control.tls.cert, control.tls.ca, lease.tls.cert, lease.tls.ca; a CA bundle: its earliest); negative once expired",
            m.certificate_expiry.clone(),
        );
        m
    }
}

/// The exposition type of a metric.
fn kind_of(m: &impl EncodeMetric) -> &'static str {
    match m.metric_type() {
        MetricType::Counter => "counter",
        MetricType::Gauge => "gauge",
        MetricType::Histogram => "histogram",
        MetricType::Info => "info",
        MetricType::Unknown => "unknown",
    }
}

/// Adds `# HELP` and `# TYPE` (OpenMetrics form, before `# EOF`) for every `declared` family the
/// encoder left out for having no sample yet (a labelled counter before its first event), so
/// every family is declared from the start.
fn declare_empty(open_metrics: &mut String, declared: &[(&str, &str, &str)]) {
    let present: std::collections::HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    let mut missing = String::new();
    for (name, help, kind) in declared {
        if !present.contains(name) {
            missing.push_str(&format!("# HELP {name} {help}.\n# TYPE {name} {kind}\n"));
        }
    }
    if missing.is_empty() {
        return;
    }
    match open_metrics.rfind("# EOF") {
        Some(at) => open_metrics.insert_str(at, &missing),
        None => open_metrics.push_str(&missing),
    }
}

/// Rewrite prometheus-client's OpenMetrics output as Prometheus text 0.0.4: counter families
/// are named with their `_total` suffix in `# HELP`/`# TYPE` (as the reference's
/// `# TYPE narwhal_served_total counter`), the help text loses the added final period, and the
/// `# EOF` marker goes.
fn to_prometheus_text(open_metrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let help = help.strip_suffix('.').unwrap_or(help);
            let suffix = if counters.contains(name) {
                "_total"
            } else {
                ""
            };
            out.push_str(&format!("# HELP {name}{suffix} {help}\n"));
        } else if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|l| l.strip_suffix(" counter"))
        {
            out.push_str(&format!("# TYPE {name}_total counter\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Content type of [`Metrics::render`] (behaviour.md 1.1).
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_scale_with_the_slo() {
        assert_eq!(
            buckets(2.0),
            vec![0.05, 0.1, 0.2, 0.4, 0.7, 1.0, 1.4, 2.0, 3.0, 6.0, 20.0]
        );
        assert_eq!(fmt_g(2.0), "2");
        assert_eq!(fmt_g(0.05), "0.05");
    }

    #[test]
    fn render_has_reference_names_and_seeded_reasons() {
        let m = Metrics::new(2.0, 0.1);
        m.settled.served.inc();
        let t = m.render();
        for want in [
            "narwhal_served_total 1",
            "narwhal_failed_total{reason=\"no_engine\"} 0",
            "narwhal_rejected_total{reason=\"inflight_limit\"} 0",
            "narwhal_expired_total{reason=\"handoff\"} 0",
            "narwhal_cancelled_total 0",
            "narwhal_invalid_requests_total 0",
            "narwhal_offered_total 0",
            "# TYPE narwhal_ttft_seconds histogram",
            "# TYPE narwhal_served_total counter",
            "# HELP narwhal_served_total Requests completed without error\n",
            "narwhal_slo_seconds{metric=\"ttft\",slo=\"2\"} 2.0",
        ] {
            assert!(t.contains(want), "missing {want} in\n{t}");
        }
        assert!(!t.contains("# EOF"));
    }

    /// Labelled families are declared before their first sample (docs/http-api.md: every
    /// family with `# HELP` and `# TYPE` from the start), with no sample line.
    #[test]
    fn families_without_a_sample_are_declared() {
        let m = Metrics::new(2.0, 0.1);
        let t = m.render();
        for family in [
            "narwhal_attempt_failures_total",
            "narwhal_engine_ejections_total",
            "narwhal_engine_readmissions_total",
        ] {
            assert!(
                t.contains(&format!("# TYPE {family} counter\n")),
                "{family} not declared in\n{t}"
            );
            assert!(t.contains(&format!("# HELP {family} ")), "{family}");
            assert!(
                !t.contains(&format!("{family}{{")),
                "{family} has no sample yet"
            );
        }
        m.legs
            .attempt_failures
            .get_or_create(&labels(&[("phase", "prefill"), ("reason", "engine_error")]))
            .inc();
        let t = m.render();
        assert_eq!(
            t.matches("# TYPE narwhal_attempt_failures_total counter")
                .count(),
            1,
            "declared once once it has a sample"
        );
    }
}
