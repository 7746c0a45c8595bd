//! Readmission validation: the six checks of handoff-and-lifecycle.md ("Readmitting engines"),
//! in order — health, process-bound attestation, configured model, direct generation,
//! role-compatible KV transfer, final health — run over every participant (the targets and the
//! peers they exchange KV with), with the process identity re-checked between steps
//! (behaviour.md 4.8; architecture.md 9.2 and 9.7).
//!
//! The sequencing is here; the I/O is behind [`Checks`] (the router implements it with the
//! engine's `/health` and the agents' signed answers), so every rule is unit-tested with a fake.

use std::collections::{BTreeMap, BTreeSet};

use futures_util::{StreamExt as _, stream};

use super::check_error::CheckError;
use super::machine::EngineOutcome;
pub(crate) use crate::config::Role;

/// The identity a signed answer speaks for: `(boot_id, pid, start_ticks)` plus the process
/// start in Unix seconds (architecture.md section 4).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Identity {
    /// `(boot_id, pid, start_ticks)` rendered as one comparable key.
    pub key: String,
    /// Process start, Unix seconds.
    pub start: f64,
}

/// A verified attestation, reduced to what validation needs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Attested {
    /// The process the attestation is bound to.
    pub identity: Identity,
    /// Models the engine serves (as the agent read them from the engine).
    pub models: Vec<String>,
    /// Short fingerprint shown in the check name (`attestation <fp>`): the signing key id.
    pub fingerprint: String,
}

/// The I/O validation needs. Each call returns a [`CheckError`] naming what failed.
pub(crate) trait Checks {
    /// `GET <engine>/health` from the router answers 200.
    fn health(&self, iid: &str) -> impl Future<Output = Result<(), CheckError>> + Send;
    /// A signed attestation through the engine's agent, verified (key, nonce, epoch, iid,
    /// freshness, contract).
    fn attest(&self, iid: &str) -> impl Future<Output = Result<Attested, CheckError>> + Send;
    /// A signed direct-generation check (≥ 1 token); returns the identity it ran against.
    fn generation(&self, iid: &str) -> impl Future<Output = Result<Identity, CheckError>> + Send;
    /// The producer half of a KV check; returns the KV handle (descriptor or rendezvous) and
    /// the identity it ran against.
    fn kv_produce(
        &self,
        iid: &str,
        check_id: &str,
    ) -> impl Future<Output = Result<(serde_json::Value, Identity), CheckError>> + Send;
    /// The consumer half: decodes from `kv`; must prove the transfer happened (no recompute).
    fn kv_consume(
        &self,
        iid: &str,
        check_id: &str,
        kv: serde_json::Value,
    ) -> impl Future<Output = Result<Identity, CheckError>> + Send;
    /// Verification probe of a suspect: decode from `kv` produced elsewhere, or with `None` a
    /// local probe (both legs on the suspect); returns the identity it ran against.
    fn probe(
        &self,
        iid: &str,
        check_id: &str,
        kv: Option<serde_json::Value>,
    ) -> impl Future<Output = Result<Identity, CheckError>> + Send;
}

/// What to validate.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    /// Engines being readmitted (sorted).
    pub targets: Vec<String>,
    /// Every configured engine with its router role, in config order.
    pub roles: Vec<(String, Role)>,
    /// Engines currently eligible for placement (candidate peers).
    pub live: BTreeSet<String>,
    /// Per target: the pre-restart process start a planned restart must exceed
    /// (`None` when no restart is required, e.g. after a breaker ejection).
    pub restart_after: BTreeMap<String, Option<f64>>,
    /// Last accepted process start per engine; a peer whose live start differs has changed.
    pub accepted_starts: BTreeMap<String, f64>,
    /// The configured model.
    pub model: String,
    /// A whole wave: every configured engine takes part and the pairs cover them all.
    pub wave: bool,
    /// Run the direct-generation check. False for SGLang, whose disaggregated servers only
    /// generate through a bootstrap rendezvous: there the KV-transfer check is the generation
    /// evidence (behaviour.md 4.8 step 5).
    pub direct_generation: bool,
    /// Suspect targets: the producers whose KV fed their failing decodes (`""` = a local
    /// probe). Verification reruns each path before the engine returns (behaviour.md 6.3).
    pub verify_sources: BTreeMap<String, Vec<String>>,
}

/// Why no fabric pair could be formed (every target fails with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum FabricError {
    /// A target is not in the plan's roles.
    #[error("{0} is not a configured engine")]
    Unconfigured(String),
    /// No live engine (nor co-target) of the opposite role to pair with.
    #[error("fabric validation requires a peer in the opposite role")]
    NoPeer,
}

/// The fabric pairs `(producer, consumer)` for a plan, or the failure every target gets when
/// no pair exists (behaviour.md 4.8 step 2, with roles bound: our router never switches
/// roles).
///
/// # Errors
/// [`FabricError`].
pub(crate) fn fabric_pairs(plan: &Plan) -> Result<Vec<(String, String)>, FabricError> {
    let producers: Vec<&String> = plan
        .roles
        .iter()
        .filter(|(_, r)| *r == Role::Prefill)
        .map(|(i, _)| i)
        .collect();
    let consumers: Vec<&String> = plan
        .roles
        .iter()
        .filter(|(_, r)| *r == Role::Decode)
        .map(|(i, _)| i)
        .collect();
    if plan.roles.len() < 2 || producers.is_empty() || consumers.is_empty() {
        // Aggregated fleets (one role only) move no KV between engines.
        return Ok(Vec::new());
    }
    let mut pairs = Vec::new();
    if plan.wave {
        for (cursor, p) in producers.iter().enumerate() {
            let c = consumers[cursor % consumers.len()];
            pairs.push(((*p).clone(), c.clone()));
        }
        for c in &consumers {
            if !pairs.iter().any(|(_, cc)| cc == *c) {
                pairs.push((producers[0].clone(), (*c).clone()));
            }
        }
        return Ok(pairs);
    }
    for t in &plan.targets {
        let role = plan.roles.iter().find(|(i, _)| i == t).map(|(_, r)| *r);
        let peer_role = match role {
            Some(Role::Prefill) => Role::Decode,
            Some(Role::Decode) => Role::Prefill,
            None => return Err(FabricError::Unconfigured(t.clone())),
        };
        // A live peer first; else another target of the same validation (an ejected peer the
        // driver added as a co-target: `Lifecycle::join_recovery`).
        let opposite = |i: &String, r: &Role| *r == peer_role && i != t;
        let peer = plan
            .roles
            .iter()
            .find(|(i, r)| opposite(i, r) && plan.live.contains(i))
            .or_else(|| {
                plan.roles
                    .iter()
                    .find(|(i, r)| opposite(i, r) && plan.targets.contains(i))
            })
            .map(|(i, _)| i.clone());
        let Some(peer) = peer else {
            return Err(FabricError::NoPeer);
        };
        let pair = if peer_role == Role::Decode {
            (t.clone(), peer)
        } else {
            (peer, t.clone())
        };
        if !pairs.contains(&pair) {
            pairs.push(pair);
        }
    }
    Ok(pairs)
}

/// Per-engine outcome of a validation run; `passed()` when nobody failed.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Report {
    /// Outcome of every participant (targets and peers).
    pub engines: BTreeMap<String, EngineOutcome>,
    /// Peers whose process changed behind the router's back (the driver ejects them).
    pub changed_peers: Vec<String>,
}

impl Report {
    /// No participant has a failure.
    pub(crate) fn passed(&self) -> bool {
        self.engines.values().all(|o| o.failures.is_empty())
    }

    fn pass(&mut self, iid: &str, check: impl Into<String>) {
        self.engines
            .entry(iid.to_string())
            .or_default()
            .checks
            .push(check.into());
    }

    fn fail(&mut self, iid: &str, failure: impl Into<String>) {
        self.engines
            .entry(iid.to_string())
            .or_default()
            .failures
            .push(failure.into());
    }
}

/// Runs the checks of `plan` in handoff-and-lifecycle.md's order and reports every participant's
/// outcome. Targets that pass carry the validated process start in `process_start`.
pub(crate) async fn validate<C: Checks>(plan: &Plan, checks: &C, check_id: &str) -> Report {
    let mut report = Report::default();
    for t in &plan.targets {
        report.engines.entry(t.clone()).or_default();
    }
    let pairs = match fabric_pairs(plan) {
        Ok(p) => p,
        Err(e) => {
            for t in &plan.targets {
                report.fail(t, e.to_string());
            }
            return report;
        }
    };
    let (participants, peers) = participants_of(plan, &pairs);

    // 1-4: each participant's checks in order, up to PARALLEL_ENGINES participants at a time;
    // the outcomes are applied in participant order, so the report is the sequential one.
    let attested = run_first_steps(plan, checks, &participants, &peers, &mut report).await;
    if !report.passed() {
        return report;
    }

    // 5. Role-compatible KV transfer, each pair with identities re-checked on both sides. The
    // pairs run in rounds of pairs that share no engine, each pair after every earlier pair of
    // its engines, so each engine's transfers keep the pairs' order; the outcomes are applied
    // in pair order.
    fabric(checks, check_id, &pairs, &attested, plan, &mut report).await;
    if !report.passed() {
        return report;
    }

    // Suspects: rerun the paths that failed in service (producer -> suspect, or local).
    verify_suspects(plan, checks, check_id, &attested, &mut report).await;
    if !report.passed() {
        return report;
    }

    // 6. Final health, then the final identity recheck of every participant (each up to
    // PARALLEL_ENGINES at a time, applied in order).
    final_health(plan, checks, &mut report).await;
    if !report.passed() {
        return report;
    }
    final_identities(checks, &participants, &attested, &mut report).await;
    report
}

/// The participants (the targets, then each pair's engines not yet named) and the peers among
/// them (participants that are not targets).
fn participants_of(plan: &Plan, pairs: &[(String, String)]) -> (Vec<String>, BTreeSet<String>) {
    let mut participants: Vec<String> = plan.targets.clone();
    let mut peers: BTreeSet<String> = BTreeSet::new();
    for (p, c) in pairs {
        for i in [p, c] {
            if !participants.contains(i) {
                participants.push(i.clone());
                peers.insert(i.clone());
            }
        }
    }
    (participants, peers)
}

/// Checks 1-4 of every participant, up to [`PARALLEL_ENGINES`] at a time, recorded in
/// `report` in participant order; returns each participant's attestation.
async fn run_first_steps<C: Checks>(
    plan: &Plan,
    checks: &C,
    participants: &[String],
    peers: &BTreeSet<String>,
    report: &mut Report,
) -> BTreeMap<String, Attested> {
    let is_target = |i: &str| plan.targets.iter().any(|t| t == i);
    // (Futures collected before they are streamed: a stream over a closure's futures would
    // make this future's `Send` depend on higher-ranked lifetimes the compiler cannot prove.)
    let futures: Vec<_> = participants
        .iter()
        .map(|iid| first_steps(plan, checks, iid, peers.contains(iid), is_target(iid)))
        .collect();
    let steps: Vec<FirstSteps> = at_once(futures).await;
    let mut attested: BTreeMap<String, Attested> = BTreeMap::new();
    for (iid, s) in participants.iter().zip(steps) {
        for check in s.passed {
            report.pass(iid, check);
        }
        if let Some(f) = s.failure {
            report.fail(iid, f);
        }
        if s.changed_peer {
            report.changed_peers.push(iid.clone());
        }
        if let Some(start) = s.process_start {
            report
                .engines
                .get_mut(iid)
                .expect("target entry exists")
                .process_start = Some(start);
        }
        if let Some(a) = s.attested {
            attested.insert(iid.clone(), a);
        }
    }
    attested
}

/// Check 5: a KV transfer over every pair, in rounds of pairs sharing no engine, identities
/// re-checked on both sides; recorded in `report` in pair order.
async fn fabric<C: Checks>(
    checks: &C,
    check_id: &str,
    pairs: &[(String, String)],
    attested: &BTreeMap<String, Attested>,
    plan: &Plan,
    report: &mut Report,
) {
    if pairs.is_empty() {
        for t in &plan.targets {
            report.pass(t, "fabric not applicable: no engine of the opposite role");
        }
    }
    let mut outcomes: Vec<Option<Result<(), String>>> = vec![None; pairs.len()];
    for round in pair_rounds(pairs) {
        let futures: Vec<_> = round
            .into_iter()
            .map(|n| {
                let (src, dst) = &pairs[n];
                let id = format!("{check_id}-{n}");
                let attested = &attested;
                async move {
                    let outcome = async {
                        let (kv, pid) = checks
                            .kv_produce(src, &id)
                            .await
                            .map_err(|e| format!("produce: {e}"))?;
                        if pid.key != attested[src].identity.key {
                            return Err(format!("{src} process changed during validation"));
                        }
                        let cid = checks
                            .kv_consume(dst, &id, kv)
                            .await
                            .map_err(|e| format!("consume: {e}"))?;
                        if cid.key != attested[dst].identity.key {
                            return Err(format!("{dst} process changed during validation"));
                        }
                        Ok(())
                    }
                    .await;
                    (n, outcome)
                }
            })
            .collect();
        let done: Vec<(usize, Result<(), String>)> = at_once(futures).await;
        for (n, o) in done {
            outcomes[n] = Some(o);
        }
    }
    for ((src, dst), outcome) in pairs.iter().zip(outcomes) {
        match outcome.expect("every pair ran in a round") {
            Ok(()) => {
                report.pass(src, format!("fabric produce to {dst}"));
                report.pass(dst, format!("fabric consume from {src}"));
            }
            Err(e) => {
                report.fail(src, format!("fabric {src}->{dst}: {e}"));
                report.fail(dst, format!("fabric {src}->{dst}: {e}"));
            }
        }
    }
}

/// Suspects: reruns each target's paths that failed in service (producer to the target, or a
/// local probe), recorded in `report`.
async fn verify_suspects<C: Checks>(
    plan: &Plan,
    checks: &C,
    check_id: &str,
    attested: &BTreeMap<String, Attested>,
    report: &mut Report,
) {
    for t in &plan.targets {
        for (n, producer) in plan.verify_sources.get(t).into_iter().flatten().enumerate() {
            let id = format!("{check_id}-verify-{n}");
            let outcome = async {
                let kv = if producer.is_empty() {
                    None
                } else {
                    let (kv, _) = checks
                        .kv_produce(producer, &id)
                        .await
                        .map_err(|e| format!("produce on {producer}: {e}"))?;
                    Some(kv)
                };
                let pid = checks.probe(t, &id, kv).await.map_err(|e| e.to_string())?;
                if pid.key != attested[t].identity.key {
                    return Err(format!("{t} process changed during validation"));
                }
                Ok(())
            }
            .await;
            let name = if producer.is_empty() {
                "verification (local probe)".to_string()
            } else {
                format!("verification from {producer}")
            };
            match outcome {
                Ok(()) => report.pass(t, name),
                Err(e) => report.fail(t, format!("{name}: {e}")),
            }
        }
    }
}

/// Check 6: every target's final health, up to [`PARALLEL_ENGINES`] at a time, recorded in order.
async fn final_health<C: Checks>(plan: &Plan, checks: &C, report: &mut Report) {
    let futures: Vec<_> = plan
        .targets
        .iter()
        .map(|t| async move { checks.health(t).await.is_ok() })
        .collect();
    let healths: Vec<bool> = at_once(futures).await;
    for (t, ok) in plan.targets.iter().zip(healths) {
        if ok {
            report.pass(t, "final health");
        } else {
            report.fail(t, "final health failed after fabric validation");
        }
    }
}

/// Check 6: every participant's final identity recheck against its first attestation, up to
/// [`PARALLEL_ENGINES`] at a time, recorded in order.
async fn final_identities<C: Checks>(
    checks: &C,
    participants: &[String],
    attested: &BTreeMap<String, Attested>,
    report: &mut Report,
) {
    let futures: Vec<_> = participants.iter().map(|iid| checks.attest(iid)).collect();
    let finals: Vec<Result<Attested, CheckError>> = at_once(futures).await;
    for (iid, r) in participants.iter().zip(finals) {
        match r {
            Ok(a) if a.identity.key == attested[iid].identity.key => {}
            Ok(_) => report.fail(
                iid,
                "identity changed or unavailable during validation: the process was replaced",
            ),
            Err(e) => report.fail(
                iid,
                format!("identity changed or unavailable during validation: {e}"),
            ),
        }
    }
}

/// Participants whose checks run at once (each one's checks stay in order): enough that a
/// wave of hundreds of engines is not validated one engine after another, few enough that an
/// agent serving many engines is not asked everything at once.
pub(crate) const PARALLEL_ENGINES: usize = 32;

/// Runs `futures` up to [`PARALLEL_ENGINES`] at a time; their outputs in their order.
async fn at_once<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    stream::iter(futures)
        .buffered(PARALLEL_ENGINES)
        .collect()
        .await
}

/// What checks 1-4 found for one participant, in the order they ran.
#[derive(Debug, Default)]
struct FirstSteps {
    /// The checks it passed, in order.
    passed: Vec<String>,
    /// The check that ended its checks.
    failure: Option<String>,
    /// A peer whose process changed behind the router's back.
    changed_peer: bool,
    /// A target's validated process start.
    process_start: Option<f64>,
    /// Its attestation, when it got past the model check.
    attested: Option<Attested>,
}

/// Health, attestation, model and (for a target) the restart rule and direct generation of one
/// participant, in that order; the first failure ends them.
async fn first_steps<C: Checks>(
    plan: &Plan,
    checks: &C,
    iid: &str,
    is_peer: bool,
    is_target: bool,
) -> FirstSteps {
    let mut s = FirstSteps::default();
    let fail = |mut s: FirstSteps, f: String| {
        s.failure = Some(f);
        s
    };
    if let Err(e) = checks.health(iid).await {
        return fail(s, format!("health did not answer 200: {e}"));
    }
    s.passed.push("health".into());
    let a = match checks.attest(iid).await {
        Ok(a) => a,
        Err(e) => return fail(s, format!("attestation: {e}")),
    };
    s.passed.push(format!("attestation {}", a.fingerprint));
    if is_peer
        && plan
            .accepted_starts
            .get(iid)
            .is_some_and(|prev| *prev != a.identity.start)
    {
        s.changed_peer = true;
        return fail(s, "peer process changed before readmission".into());
    }
    if !a.models.contains(&plan.model) {
        let f = format!("serves {:?}, expected {}", a.models, plan.model);
        return fail(s, f);
    }
    s.passed.push("model".into());
    if is_target {
        match plan.restart_after.get(iid).copied().flatten() {
            Some(old) if a.identity.start <= old => {
                return fail(s, "engine process did not restart after drain".into());
            }
            Some(_) => s.passed.push("new process identity".into()),
            None => s.passed.push("process identity".into()),
        }
        if plan.direct_generation {
            match checks.generation(iid).await {
                Ok(id) if id.key == a.identity.key => s.passed.push("generation".into()),
                Ok(_) => {
                    return fail(
                        s,
                        "identity changed or unavailable during validation: generation ran on another process".into(),
                    );
                }
                Err(e) => return fail(s, format!("generation failed: {e}")),
            }
        }
        s.process_start = Some(a.identity.start);
    }
    s.attested = Some(a);
    s
}

/// The fabric pairs (indices into `pairs`) in rounds: each pair goes into the round after the
/// last round of either of its engines, so the pairs of one round share no engine and each
/// engine's pairs run in their order.
fn pair_rounds(pairs: &[(String, String)]) -> Vec<Vec<usize>> {
    let mut last: BTreeMap<&str, usize> = BTreeMap::new();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (n, (src, dst)) in pairs.iter().enumerate() {
        let r = [src, dst]
            .iter()
            .filter_map(|i| last.get(i.as_str()).map(|r| r + 1))
            .max()
            .unwrap_or(0);
        if rounds.len() <= r {
            rounds.resize_with(r + 1, Vec::new);
        }
        rounds[r].push(n);
        last.insert(src, r);
        last.insert(dst, r);
    }
    rounds
}

#[cfg(test)]
mod tests;
