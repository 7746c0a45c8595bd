//! The documents the router renders from its parts' snapshots: `/ready`, `/health`,
//! `/v1/models`, `/narwhal/targets`, `/narwhal/state` and `/metrics` (behaviour.md
//! 1.3–1.7, 10). The lifecycle document is the lifecycle's own; the handoff is `handoff`'s.
//! The control-plane documents are the types of `narwhal_shared::documents`, filled in here
//! (and pinned byte for byte by the golden tests, `documents/golden.rs`); `/v1/models` is
//! OpenAI's and stays JSON.
//!
//! ```text
//!  Gate (HA phase, lifecycle hold, live) ─┐
//!  Fleet (slots, breaker, suspects) ──────┼──► ready / health / state / metrics
//!  Accounting, Admission, Lifecycle ──────┘
//! ```

use std::collections::BTreeMap;

use narwhal_shared::documents::lifecycle::Resident;
use narwhal_shared::documents::ready::{NOT_READY, READY};
use narwhal_shared::documents::{self as doc, Ordered, state};

use crate::breaker::FailureClass;
use crate::config::{Config, Role};
use crate::kv_index::{Mode, Reason};
use crate::lifecycle::DrainState;
use crate::metrics::{labels, raise};
use crate::parts::Parts;
use crate::placement::{EngineSlot, Exclusion};

/// `/ready` (behaviour.md 1.3): whether ready, and the body.
pub(crate) fn ready(parts: &Parts) -> (bool, doc::Ready) {
    let view = parts.gate.view();
    let r = &view.readiness;
    (
        r.ready,
        doc::Ready {
            status: if r.ready { READY } else { NOT_READY }.to_string(),
            control_ready: r.control_ready,
            epoch: view.ha.status.epoch,
            holder: shown_holder(&view.ha.status).to_string(),
            reason: r.reason.clone(),
        },
    )
}

/// The lease holder token `/ready`, `/narwhal/state.ha` and `narwhal_router_lease_info` show:
/// this process's token only while it holds an epoch (behaviour.md 1.3: `""` without a
/// lease and on a standby that has not taken over); a standby's own future token is not shown.
fn shown_holder(status: &crate::ha_phase::HaStatus) -> &str {
    if status.epoch == 0 {
        ""
    } else {
        &status.holder
    }
}

/// `/health` (behaviour.md 1.4).
pub(crate) fn health(parts: &Parts) -> doc::Health {
    let view = parts.gate.view();
    doc::Health {
        status: view.health().to_string(),
        instances: parts.cfg.engines.len() as u64,
        available_instances: view.live as u64,
    }
}

/// `/v1/models` (behaviour.md 1.5), each model with OpenAI's `created` (Unix seconds; the
/// answer's time, as vLLM gives it).
pub(crate) fn models(cfg: &Config, created: u64) -> doc::ModelList {
    doc::ModelList {
        object: "list".into(),
        data: std::iter::once(cfg.model.as_str())
            .chain(cfg.adapters.iter().map(String::as_str))
            .filter_map(|id| model_card(cfg, id, created))
            .collect(),
    }
}

/// One model as OpenAI's `GET /v1/models/{model}` answers it: `id`, `object: "model"`,
/// `created`, `owned_by`; an adapter (config `adapters`) also names its base model in
/// `parent`, as vLLM's own card for an adapter does. `None` for an id not served.
pub(crate) fn model_card(cfg: &Config, id: &str, created: u64) -> Option<doc::ModelCard> {
    let parent = if id == cfg.model {
        None
    } else if cfg.adapters.iter().any(|a| a == id) {
        Some(cfg.model.clone())
    } else {
        return None;
    };
    Some(doc::ModelCard {
        id: id.to_string(),
        object: "model".into(),
        created,
        owned_by: "narwhal".into(),
        parent,
    })
}

/// `/narwhal/targets` (behaviour.md 1.6): one Prometheus target group per engine, without
/// URL credentials.
pub(crate) fn targets(cfg: &Config) -> doc::Targets {
    cfg.engines
        .iter()
        .map(|e| {
            let (scheme, rest) = e.url.split_once("://").unwrap_or(("http", e.url.as_str()));
            let (authority, path) = match rest.find('/') {
                Some(i) => (&rest[..i], &rest[i..]),
                None => (rest, ""),
            };
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            doc::TargetGroup {
                targets: vec![host.to_string()],
                labels: doc::targets::TargetLabels {
                    iid: e.iid.clone(),
                    backend: cfg.backend.as_str().to_string(),
                    scheme: scheme.to_string(),
                    metrics_path: format!("{}/metrics", path.trim_end_matches('/')),
                },
            }
        })
        .collect()
}

/// `/narwhal/state` (behaviour.md 1.7): the starred fields, others stubbed or omitted.
pub(crate) fn state(parts: &Parts) -> doc::State {
    let gate = parts.gate.view();
    let ready = gate.readiness.ready;
    let ha = &gate.ha.status;
    let tally = parts.accounting.tally();
    let cfg = &parts.cfg;
    let fleet = fleet_view(parts);
    let st = parts.accounting.serving();
    let attempt_failures = st
        .attempt_failures
        .iter()
        .map(|((phase, reason), n)| state::AttemptFailure {
            phase: (*phase).to_string(),
            reason: (*reason).to_string(),
            count: *n,
        })
        .collect();
    let mut pinned: Vec<String> = cfg
        .engines
        .iter()
        .filter(|e| e.pin)
        .map(|e| e.iid.clone())
        .collect();
    pinned.sort_unstable();
    let adm = parts.admission.stats();
    let resume = parts.ha.resume_refused();
    doc::State {
        schema: doc::STATE_SCHEMA.to_string(),
        schema_version: doc::STATE_VERSION,
        journal_run: parts.journal.run().to_string(),
        served: tally.served,
        slo_met: tally.slo_met,
        offered: tally.offered,
        unsized_offered: tally.unsized_offered,
        expired: tally.expired,
        failed: tally.failed,
        cancelled: tally.cancelled,
        invalid_requests: tally.invalid_requests,
        rejected: tally.rejected,
        refused: tally.refused,
        token_accounting: "token_ids".to_string(),
        ha: state::Ha {
            ready,
            standby: ha.phase.standby(),
            epoch: ha.epoch,
            holder: shown_holder(ha).to_string(),
            blocked: ha.phase.blocked().to_string(),
            controls_fleet: gate.ha.controls,
            resume: state::Resume {
                refused: resume.is_some(),
                reason: resume.unwrap_or("").to_string(),
            },
        },
        // The lifecycle view: the lifecycle document minus its envelope (behaviour.md 1.7).
        lifecycle: parts.lifecycle.document("").into_view(),
        admission: state::Admission {
            inflight: adm.inflight as u64,
            queued: adm.queued as u64,
            queue_capacity: cfg.serving.queue_capacity,
            queue_high_water: adm.queue_high_water as u64,
            waiting_prefill: parts.controller.waiting_prefill().unwrap_or(adm.queued) as u64,
            limit: adm.limit as u64,
            loop_lag_s: 0.0,
            sizing_delay_s: 0.0,
            saturation_threshold_s: 0.25 * cfg.slo.ttft_s,
            rejected: tally.rejected,
            refused: tally.refused,
            engine_auth: if cfg.engine.engine_api_key.is_some() {
                "bearer"
            } else {
                "boundary"
            }
            .to_string(),
            mode: cfg.serving.admission.as_str().to_string(),
            margin: cfg.serving.admission_margin,
        },
        outcome_reasons: tally.reasons(),
        serving: state::Serving {
            http_retained: adm.retained as u64,
            http_retained_limit: adm.retained_limit as u64,
            http_retained_high_water: adm.retained_high_water as u64,
            prefill_attempts: st.prefill_attempts,
            decode_attempts: st.decode_attempts,
            retry_attempts: st.retry_attempts,
            retry_credits: parts.accounting.budget().credits(),
            retry_credits_spent: st.retry_credits_spent,
            retry_denied: st.retry_denied,
            served_after_retry: tally.served_after_retry,
            attempt_failures,
            decode_tokens_observed: st.decode_tokens_observed,
            upstream_seconds: state::UpstreamSeconds {
                prefill: st.upstream_prefill_s,
                decode: st.upstream_decode_s,
            },
        },
        pools: state::Pools {
            prefill: fleet.prefill,
            decode: fleet.decode,
        },
        slo: state::Slo {
            ttft_s: cfg.slo.ttft_s,
            tpot_s: cfg.slo.tpot_s,
        },
        first_token_timeout_s: cfg.engine.first_token_timeout_s,
        kv_transfer_timeout_s: cfg.engine.kv_transfer_timeout_s,
        resident: fleet.resident,
        pinned,
        min_prefill: u64::from(cfg.controller.min_prefill),
        min_decode: u64::from(cfg.controller.min_decode),
        ejected: fleet.ejected,
        draining: fleet.draining,
        quarantined: Vec::new(),
        holds: state::Holds {
            timed: Vec::new(),
            inference: fleet.inference_holds,
        },
        inference_sources: fleet.inference_sources,
        breaker: state::Breaker {
            failures: fleet.failures,
            verifying: Vec::new(),
            ejections: fleet.ejections,
            hold_starts: Vec::new(),
            hold_ends: Vec::new(),
            probes: Vec::new(),
            readmissions: fleet.readmissions,
        },
        unserved: parts.accounting.unserved(),
        journal_dropped: parts.journal.dropped(),
        journal_writes_failing: parts.journal.writes_failing(),
        // The health gate and the ejection bound (docs/deviations.md).
        awaiting_health: fleet.awaiting_health,
        degraded: fleet.degraded,
        kv_index: kv_index(parts),
        kv_evidence: parts
            .lifecycle
            .agents()
            .kv_evidence()
            .into_iter()
            .filter_map(|(i, e)| Some((parts.cfg.engines.get(i)?.iid.clone(), e)))
            .collect(),
        // The role controller's fields (controller.md 13), live, or absent when it is off.
        controller: parts.controller.state(),
    }
}

/// `kv_index`: the tokenizer check, the tokenize counts and each engine's index
/// (docs/design/kv-aware-placement.md).
fn kv_index(parts: &Parts) -> state::KvIndex {
    let counts = parts.kv.tokenize_counts();
    let check = parts.kv.tokenizer();
    let names = parts.fleet.names();
    state::KvIndex {
        tokenizer: check.as_str().to_string(),
        tokenizer_detail: check.detail().map(str::to_string),
        tokenized: counts.tokenized,
        tokenize_failures: counts.failures,
        tokenize_seconds: counts.seconds,
        unscored: counts.unscored,
        tokenizer_sampled: counts.sampled,
        router_tokenizer: parts.kv.local_tokenizer().map(|(model_dir, shapes)| {
            state::RouterTokenizer {
                model_dir,
                details: shapes
                    .iter()
                    .filter_map(|s| Some((s.shape.to_string(), s.detail.clone()?)))
                    .collect(),
                shapes: shapes
                    .iter()
                    .map(|s| (s.shape.to_string(), s.status.to_string()))
                    .collect(),
                tokenized: counts.local,
                seconds: counts.local_seconds,
                fallbacks: counts.local_fallbacks,
                checked: counts.local_checked,
            }
        }),
        engines: parts
            .kv
            .views()
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                (
                    names[i].clone(),
                    state::KvEngine {
                        mode: v.mode.as_str().to_string(),
                        reason: v.reason.as_str().to_string(),
                        lag_s: v.lag_s,
                        blocks: v.blocks,
                        approx_blocks: v.approx.blocks,
                        approx_evicted: v.approx.evicted,
                        batches: v.counters.batches,
                        gaps: v.counters.gaps,
                        replays: v.counters.replays,
                        resets: v.counters.resets,
                        overflow: v.counters.overflow,
                        skipped: v.counters.skipped,
                        credit: state::KvCreditCheck {
                            checked: v.credit.checked,
                            over_credited: v.credit.over_credited,
                            over_tokens: v.credit.over_tokens,
                            under_tokens: v.credit.under_tokens,
                        },
                    },
                )
            })
            .collect(),
    }
}

/// The `narwhal_kv_index_*` families from the index's snapshot.
fn kv_gauges(parts: &Parts) {
    let (m, c) = (&parts.metrics.kv.gauges, &parts.metrics.kv.counters);
    let names = parts.fleet.names();
    for (i, v) in parts.kv.views().into_iter().enumerate() {
        let iid = names[i].as_str();
        let l = labels(&[("iid", iid)]);
        for mode in Mode::ALL {
            m.mode
                .get_or_create(&labels(&[("iid", iid), ("mode", mode.as_str())]))
                .set(i64::from(mode == v.mode));
        }
        for reason in Reason::ALL {
            m.reason
                .get_or_create(&labels(&[("iid", iid), ("reason", reason.as_str())]))
                .set(i64::from(reason == v.reason));
        }
        if let Some(lag) = v.lag_s {
            m.lag.get_or_create(&l).set(lag);
        }
        m.blocks.get_or_create(&l).set(v.blocks as i64);
        m.approx_blocks
            .get_or_create(&l)
            .set(v.approx.blocks as i64);
        raise(&c.gaps.get_or_create(&l), v.counters.gaps);
        raise(&c.replays.get_or_create(&l), v.counters.replays);
        raise(&c.resets.get_or_create(&l), v.counters.resets);
        let k = &parts.metrics.kv.credit;
        raise(&k.checked.get_or_create(&l), v.credit.checked);
        raise(&k.over.get_or_create(&l), v.credit.over_tokens);
        raise(&k.under.get_or_create(&l), v.credit.under_tokens);
    }
    let counts = parts.kv.tokenize_counts();
    raise(&c.tokenize_failures, counts.failures);
    raise(&c.unscored, counts.unscored);
    let t = &parts.metrics.kv.router_tokenizer;
    raise(&t.tokenized, counts.local);
    raise(&t.fallbacks, counts.local_fallbacks);
    let spent = t.seconds.get();
    if counts.local_seconds > spent {
        t.seconds.inc_by(counts.local_seconds - spent);
    }
    let spent = c.tokenize_seconds.get();
    if counts.seconds > spent {
        c.tokenize_seconds.inc_by(counts.seconds - spent);
    }
}

/// What `/narwhal/state` shows of the fleet, read under one lock: engine lists sorted by id,
/// suspects in config order.
struct FleetView {
    ejected: Vec<String>,
    draining: Vec<String>,
    awaiting_health: Vec<String>,
    degraded: Vec<String>,
    prefill: Vec<String>,
    decode: Vec<String>,
    inference_sources: Ordered<Vec<String>>,
    inference_holds: Vec<state::InferenceHold>,
    resident: BTreeMap<String, Resident>,
    failures: BTreeMap<String, state::Streaks>,
    ejections: Vec<state::Ejection>,
    readmissions: Vec<state::Readmission>,
}

/// The field of `streaks` that counts `class` (a new class fails to compile here until the
/// document has its field).
fn streak_of(streaks: &mut state::Streaks, class: FailureClass) -> &mut u64 {
    match class {
        FailureClass::Connection => &mut streaks.connection,
        FailureClass::Timeout => &mut streaks.timeout,
        FailureClass::Overload => &mut streaks.overload,
        FailureClass::InferenceStatus => &mut streaks.inference_status,
        FailureClass::KvHandoff => &mut streaks.kv_handoff,
        FailureClass::Stream => &mut streaks.stream,
        FailureClass::EngineConfig => &mut streaks.engine_config,
    }
}

/// The fleet part of `/narwhal/state` ([`FleetView`]).
fn fleet_view(parts: &Parts) -> FleetView {
    let names: Vec<&str> = parts.cfg.engines.iter().map(|e| e.iid.as_str()).collect();
    parts.fleet.read(|fleet| {
        let sorted_by = |pred: &dyn Fn(&EngineSlot) -> bool| {
            let mut v: Vec<String> = fleet
                .slots()
                .iter()
                .enumerate()
                .filter(|(_, s)| pred(s))
                .map(|(i, _)| names[i].to_string())
                .collect();
            v.sort_unstable();
            v
        };
        let mut degraded: Vec<String> = (0..names.len())
            .filter(|i| fleet.breaker().is_degraded(*i))
            .map(|i| names[i].to_string())
            .collect();
        degraded.sort_unstable();
        let mut inference_sources = Ordered::new();
        let mut inference_holds = Vec::new();
        for (i, set) in fleet.suspects().iter().enumerate() {
            if !set.is_empty() {
                let producers: Vec<String> = set.iter().cloned().collect();
                inference_sources.insert(names[i], producers.clone());
                inference_holds.push(state::InferenceHold {
                    iid: names[i].to_string(),
                    recorded_producers: producers,
                });
            }
        }
        let breaker = fleet.breaker();
        let mut resident = BTreeMap::new();
        let mut failures = BTreeMap::new();
        for (i, s) in fleet.slots().iter().enumerate() {
            resident.insert(
                names[i].to_string(),
                Resident {
                    prefill: u64::from(s.resident_prefill),
                    decode: u64::from(s.resident_decode),
                },
            );
            let mut streaks = state::Streaks {
                liveness: u64::from(breaker.misses(i)),
                ..state::Streaks::default()
            };
            for c in FailureClass::ALL {
                *streak_of(&mut streaks, c) = u64::from(breaker.streak(i, c));
            }
            failures.insert(names[i].to_string(), streaks);
        }
        let ejections = breaker
            .ejections()
            .iter()
            .map(|((i, cause), n)| state::Ejection {
                iid: names[*i].to_string(),
                cause: cause.as_str().to_string(),
                count: *n,
            })
            .collect();
        let readmissions = breaker
            .readmissions()
            .iter()
            .map(|((i, evidence), n)| state::Readmission {
                iid: names[*i].to_string(),
                evidence: evidence.to_string(),
                count: *n,
            })
            .collect();
        FleetView {
            ejected: sorted_by(&|s| s.excluded.contains(&Exclusion::Ejected)),
            draining: sorted_by(&|s| s.excluded.contains(&Exclusion::Draining)),
            awaiting_health: sorted_by(&|s| s.excluded.contains(&Exclusion::AwaitingHealth)),
            degraded,
            prefill: sorted_by(&|s| s.role == Role::Prefill),
            decode: sorted_by(&|s| s.role == Role::Decode),
            inference_sources,
            inference_holds,
            resident,
            failures,
            ejections,
            readmissions,
        }
    })
}

/// Refreshes the scrape-time gauges and renders `/metrics` (behaviour.md 10).
pub(crate) fn metrics(parts: &Parts) -> String {
    let m = &parts.metrics;
    let view = parts.gate.view();
    m.durability
        .router_ready
        .set(i64::from(view.readiness.ready));
    for (iid, state, ready_to_stop) in parts.lifecycle.gauges() {
        m.roles
            .engine_ready_to_stop
            .get_or_create(&labels(&[("iid", &iid)]))
            .set(i64::from(ready_to_stop));
        for st in DrainState::ALL {
            m.roles
                .engine_lifecycle_state
                .get_or_create(&labels(&[("iid", &iid), ("state", st.as_str())]))
                .set(i64::from(st.as_str() == state));
        }
    }
    m.durability
        .router_lease_epoch
        .set(view.ha.status.epoch as i64);
    ops_gauges(parts, &view);
    kv_gauges(parts);
    let adm = parts.admission.stats();
    m.capacity.http_retained.set(adm.retained as i64);
    m.capacity
        .http_retained_high_water
        .set(adm.retained_high_water as i64);
    m.capacity.queued.set(adm.queued as i64);
    m.capacity.queue_high_water.set(adm.queue_high_water as i64);
    m.capacity.admission_inflight.set(adm.inflight as i64);
    m.durability
        .journal_dropped
        .set(parts.journal.dropped() as i64);
    m.retries
        .retry_credits
        .set(parts.accounting.budget().credits());
    let names = parts.fleet.names();
    parts.fleet.read(|fleet| {
        let mut ejected = 0;
        let mut pool = [0i64; 2];
        for (i, s) in fleet.slots().iter().enumerate() {
            let iid = names[i].as_str();
            let is_ej = s.excluded.contains(&Exclusion::Ejected);
            ejected += i64::from(is_ej);
            m.engines
                .ejected
                .get_or_create(&labels(&[("iid", iid)]))
                .set(i64::from(is_ej));
            m.roles
                .engine_draining
                .get_or_create(&labels(&[("iid", iid)]))
                .set(i64::from(s.excluded.contains(&Exclusion::Draining)));
            m.engines
                .engine_degraded
                .get_or_create(&labels(&[("iid", iid)]))
                .set(i64::from(fleet.breaker().is_degraded(i)));
            m.engines
                .engine_awaiting_health
                .get_or_create(&labels(&[("iid", iid)]))
                .set(i64::from(s.excluded.contains(&Exclusion::AwaitingHealth)));
            for role in [Role::Prefill, Role::Decode] {
                m.roles
                    .instance_role
                    .get_or_create(&labels(&[("iid", iid), ("role", role.as_str())]))
                    .set(i64::from(s.role == role));
            }
            pool[usize::from(s.role == Role::Decode)] += 1;
            m.roles
                .resident
                .get_or_create(&labels(&[("iid", iid), ("phase", "prefill")]))
                .set(i64::from(s.resident_prefill));
            m.roles
                .resident
                .get_or_create(&labels(&[("iid", iid), ("phase", "decode")]))
                .set(i64::from(s.resident_decode));
            m.roles
                .foreign
                .get_or_create(&labels(&[("iid", iid)]))
                .set(i64::from(s.foreign));
            for c in FailureClass::ALL {
                m.engines
                    .breaker_streak
                    .get_or_create(&labels(&[("iid", iid), ("class", c.as_str())]))
                    .set(i64::from(fleet.breaker().streak(i, c)));
            }
        }
        m.engines.ejected_instances.set(ejected);
        m.roles
            .pool_instances
            .get_or_create(&labels(&[("role", "prefill")]))
            .set(pool[0]);
        m.roles
            .pool_instances
            .get_or_create(&labels(&[("role", "decode")]))
            .set(pool[1]);
    });
    let mut text = m.render();
    text.push_str(&parts.controller.metrics(parts.accounting.unserved()));
    text
}

/// Refreshes the operator gauges ([`crate::metrics::OpsMetrics`]): control, the lease view and
/// timing, and certificate expiry (docs/monitoring.md).
fn ops_gauges(parts: &Parts, view: &crate::readiness::GateView) {
    let ops = &parts.metrics.ops;
    ops.controls_fleet.set(i64::from(view.ha.controls));
    let lease = parts.ha.lease();
    if lease.enabled() {
        ops.lease_info.clear();
        ops.lease_info
            .get_or_create(&labels(&[
                ("state", view.controls_label()),
                ("holder", shown_holder(&view.ha.status)),
            ]))
            .set(1);
        let left = lease.valid_until().map_or(0.0, |until| {
            until
                .saturating_duration_since(parts.clock.now())
                .as_secs_f64()
        });
        ops.lease_expires_in.get_or_create(&Vec::new()).set(left);
        let timing = lease.timing();
        ops.lease_ttl
            .get_or_create(&Vec::new())
            .set(timing.ttl.as_secs_f64());
        ops.lease_renew_interval
            .get_or_create(&Vec::new())
            .set(timing.renew_interval.as_secs_f64());
    }
    let not_after = ops
        .not_after
        .get_or_init(|| certificate_not_after(&parts.cfg));
    let now = parts.wall();
    for (cert, at) in not_after {
        ops.certificate_expiry
            .get_or_create(&labels(&[("cert", cert)]))
            .set(*at as f64 - now);
    }
}

/// Why a certificate's expiry is not exported ([`certificate_not_after`]).
#[derive(Debug, thiserror::Error)]
enum ExpiryError {
    /// The file cannot be read or holds no certificate.
    #[error(transparent)]
    Load(#[from] narwhal_shared::TlsError),
    /// A certificate in it does not parse.
    #[error(transparent)]
    Parse(#[from] narwhal_shared::tls::IdentityError),
}

/// `notAfter` (Unix seconds) of every certificate the fleet file names, by key: `X.cert` (the
/// leaf) and `X.ca` (the earliest-expiring certificate of the bundle) for `X` in `tls`,
/// `control.tls`, `lease.tls`. A file that cannot be read or parsed is skipped: the router
/// checked every one before it started (`cli::preflight`), so only a file changed since then
/// is missing here, and the log says so.
fn certificate_not_after(cfg: &Config) -> Vec<(String, i64)> {
    use narwhal_shared::tls::{load_certs, not_after_unix};
    let mut files: Vec<(String, std::path::PathBuf)> = Vec::new();
    for (key, t) in [("tls", &cfg.tls), ("control.tls", &cfg.control_tls)] {
        if let Some(t) = t {
            files.push((format!("{key}.cert"), t.cert.clone()));
            files.push((format!("{key}.ca"), t.ca.clone()));
        }
    }
    if let Some(t) = &cfg.lease.etcd.tls {
        if let Some(c) = &t.cert {
            files.push(("lease.tls.cert".into(), c.clone()));
        }
        if let Some(c) = &t.ca {
            files.push(("lease.tls.ca".into(), c.clone()));
        }
    }
    let mut out = Vec::new();
    for (key, path) in files {
        let read = load_certs("cert", &path).map_err(ExpiryError::from);
        let ats: Result<Vec<i64>, ExpiryError> = read.and_then(|certs| {
            let certs = if key.ends_with(".cert") {
                &certs[..certs.len().min(1)]
            } else {
                &certs[..]
            };
            certs
                .iter()
                .map(|c| not_after_unix(c).map_err(ExpiryError::from))
                .collect()
        });
        match ats {
            Ok(ats) => {
                if let Some(at) = ats.into_iter().min() {
                    out.push((key, at));
                }
            }
            Err(e) => {
                tracing::warn!(cert = %key, path = %path.display(), error = %e, "certificate expiry not exported")
            }
        }
    }
    out
}

#[cfg(test)]
mod golden;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::{EjectCause, Observation};
    use serde_json::{Value, json};

    // These tests read the documents as they are sent.
    fn wire<T: serde::Serialize>(doc: T) -> Value {
        serde_json::to_value(doc).expect("serialises")
    }

    fn ready(p: &Parts) -> (bool, Value) {
        let (ok, doc) = super::ready(p);
        (ok, wire(doc))
    }

    fn health(p: &Parts) -> Value {
        wire(super::health(p))
    }

    fn state(p: &Parts) -> Value {
        wire(super::state(p))
    }
    use narwhal_shared::{Clock as _, ManualClock, SystemClock};
    use std::sync::Arc;

    fn parts() -> Arc<Parts> {
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        crate::parts::for_test(
            json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
                "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                            {"iid": "d0", "url": "http://127.0.0.1:2"}],
                "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                "serving": {"request_timeout_s": 10, "prefill_timeout_s": 5},
                "recovery": {"eject_after": 1}
            }),
            clock,
            "test",
        )
    }

    /// Readiness follows the live engines; the last engine of a role failing stays in placement flagged degraded
    /// (docs/deviations.md); an absent one is ejected.
    #[test]
    fn readiness_follows_live_engines() {
        let p = parts();
        assert_eq!(ready(&p).1["status"], "ready");
        assert_eq!(state(&p)["awaiting_health"], json!([]));
        p.fleet.eject(0, EjectCause::ProcessIdentity);
        assert_eq!(health(&p)["available_instances"], 1);
        assert_eq!(state(&p)["ejected"], json!(["p0"]));
        p.fleet
            .observe(1, Observation::LegFailed(FailureClass::Stream));
        assert_eq!(state(&p)["degraded"], json!(["d0"]));
        assert_eq!(state(&p)["breaker"]["failures"]["d0"]["stream"], 1);
        assert!(metrics(&p).contains("narwhal_engine_degraded{iid=\"d0\"} 1"));
        p.fleet.eject(1, EjectCause::HealthProbe);
        let (ready, doc) = ready(&p);
        assert!(!ready);
        assert_eq!(doc["reason"], "no available engines");
        assert_eq!(doc["control_ready"], true);
        assert_eq!(health(&p)["status"], "degraded");
        let m = metrics(&p);
        assert!(m.contains("narwhal_router_ready 0"), "{m}");
        assert!(m.contains("narwhal_ejected{iid=\"d0\"} 1"), "{m}");
        assert!(
            m.contains("narwhal_engine_ejections_total{iid=\"d0\",cause=\"health_probe\"} 1"),
            "{m}"
        );
    }

    /// controller.md 13: every controller field is live or absent, never a constant that looks
    /// live.
    #[test]
    fn controller_fields_are_live_or_absent() {
        let off = state(&parts());
        assert_eq!(
            off["controller"], "off",
            "no profiles: the controller is off"
        );
        for k in ["control", "monitoring", "demand_evidence", "flips", "load"] {
            assert!(
                off.get(k).is_none(),
                "{k} is absent with the controller off"
            );
        }
        assert!(
            off["admission"].get("waiting_decode").is_none(),
            "no decode queue exists"
        );
        assert_eq!(off["admission"]["waiting_prefill"], 0);
        assert_eq!(off["admission"]["mode"], "open");
        let clock = Arc::new(ManualClock::new(SystemClock.now(), 1000.0));
        let p = crate::parts::for_test(
            json!({
                "schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
                "engines": [{"iid": "p0", "url": "http://127.0.0.1:1", "role": "prefill"},
                            {"iid": "d0", "url": "http://127.0.0.1:2"}],
                "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                "serving": {"admission": "predictive"},
                "profiles": {"default": {"ttft_a": 0, "ttft_b": 0.001, "ttft_c": 0.01,
                    "tpot_slope": 1e-6, "tpot_intercept": 0.01, "decode_max_requests": 64,
                    "decode_max_kv_tokens": 200000}}
            }),
            clock,
            "test",
        );
        let on = state(&p);
        assert_eq!(on["controller"], "reactive");
        assert_eq!(
            on["control"]["last_decision"],
            Value::Null,
            "null until the first decision"
        );
        assert_eq!(
            on["control"]["flips"]["reactive:prefill"], 0,
            "the seeded series"
        );
        assert_eq!(on["monitoring"]["stages"]["controller"]["failures"], 0);
        assert_eq!(on["demand_evidence"]["blocked_gate"], "evidence");
        assert_eq!(on["admission"]["mode"], "predictive");
        assert_eq!(on["decode_floor"]["live_decode"], 1);
        let m = metrics(&p);
        for want in [
            "narwhal_admission_info{mode=\"predictive\"} 1",
            "narwhal_unserved_total 0",
            "narwhal_flips_total{to=\"prefill\",by=\"reactive\"} 0",
            "narwhal_demand_evidence_refused{gate=\"evidence\"} 1",
            "# TYPE narwhal_controller_last_decision gauge",
        ] {
            assert!(m.contains(want), "missing {want}");
        }
        assert!(
            !m.contains("narwhal_controller_last_decision{"),
            "no decision yet"
        );
    }

    /// docs/monitoring.md: control is exported apart from readiness, and without a lease no
    /// lease gauge has a sample (nothing can expire, so no lease alert can fire).
    #[test]
    fn control_is_exported_and_lease_gauges_need_a_lease() {
        let p = parts();
        // Both engines gone (absent engines are ejected outside the failure bound).
        p.fleet.eject(0, EjectCause::ProcessIdentity);
        p.fleet.eject(1, EjectCause::HealthProbe);
        let m = metrics(&p);
        assert!(m.contains("narwhal_router_ready 0"), "{m}");
        assert!(m.contains("narwhal_router_controls_fleet 1"), "{m}");
        for family in [
            "narwhal_router_lease_expires_in_seconds ",
            "narwhal_router_lease_ttl_seconds ",
            "narwhal_router_lease_info{",
            "narwhal_router_certificate_expiry_seconds{",
        ] {
            assert!(!m.contains(family), "{family} has a sample: {m}");
        }
        assert_eq!(ready(&p).1["holder"], "", "no lease, no holder");
    }

    #[test]
    fn targets_strip_userinfo_and_keep_the_path() {
        let p = parts();
        let t = targets(&p.cfg);
        assert_eq!(t[0].targets, ["127.0.0.1:1"]);
        assert_eq!(t[1].labels.iid, "d0");
    }
}
