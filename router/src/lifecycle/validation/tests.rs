//! Unit tests of the readmission checks' order and outcomes (validation.rs).

use super::*;
use std::sync::Mutex;

/// A fleet of fake engines: per engine an identity, models, and a failing step if any.
struct Fake {
    ids: Mutex<BTreeMap<String, Identity>>,
    fail: BTreeMap<String, &'static str>,
    models: Vec<String>,
    calls: Mutex<Vec<String>>,
    /// After this many attestations of the engine, its process is replaced.
    replace_after: BTreeMap<String, usize>,
}

impl Fake {
    fn new(engines: &[(&str, f64)]) -> Fake {
        Fake {
            ids: Mutex::new(
                engines
                    .iter()
                    .map(|(i, s)| {
                        (
                            i.to_string(),
                            Identity {
                                key: format!("{i}@{s}"),
                                start: *s,
                            },
                        )
                    })
                    .collect(),
            ),
            fail: BTreeMap::new(),
            models: vec!["m".into()],
            calls: Mutex::new(Vec::new()),
            replace_after: BTreeMap::new(),
        }
    }
    fn failing(mut self, iid: &str, step: &'static str) -> Fake {
        self.fail.insert(iid.into(), step);
        self
    }
    fn step(&self, iid: &str, step: &str) -> Result<Identity, CheckError> {
        self.calls.lock().unwrap().push(format!("{step} {iid}"));
        if self.fail.get(iid) == Some(&step) {
            return Err(CheckError::Agent {
                detail: format!("{step} broken"),
            });
        }
        Ok(self.ids.lock().unwrap()[iid].clone())
    }
}

impl Checks for Fake {
    async fn health(&self, iid: &str) -> Result<(), CheckError> {
        let n = self
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| *c == &format!("health {iid}"))
            .count();
        if n >= 1 && self.fail.get(iid) == Some(&"final health") {
            return Err(CheckError::HealthStatus { status: 503 });
        }
        self.step(iid, "health").map(|_| ())
    }
    async fn attest(&self, iid: &str) -> Result<Attested, CheckError> {
        let id = self.step(iid, "attest")?;
        let n = self
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| *c == &format!("attest {iid}"))
            .count();
        if self.replace_after.get(iid).is_some_and(|k| n > *k) {
            let new = Identity {
                key: format!("{iid}@new"),
                start: id.start + 1.0,
            };
            self.ids.lock().unwrap().insert(iid.into(), new.clone());
            return Ok(Attested {
                identity: new,
                models: self.models.clone(),
                fingerprint: "fp".into(),
            });
        }
        Ok(Attested {
            identity: id,
            models: self.models.clone(),
            fingerprint: "fp".into(),
        })
    }
    async fn generation(&self, iid: &str) -> Result<Identity, CheckError> {
        self.step(iid, "generation")
    }
    async fn kv_produce(
        &self,
        iid: &str,
        _: &str,
    ) -> Result<(serde_json::Value, Identity), CheckError> {
        self.step(iid, "produce")
            .map(|i| (serde_json::json!({"from": iid}), i))
    }
    async fn kv_consume(
        &self,
        iid: &str,
        _: &str,
        kv: serde_json::Value,
    ) -> Result<Identity, CheckError> {
        assert!(kv["from"].is_string());
        self.step(iid, "consume")
    }
    async fn probe(
        &self,
        iid: &str,
        _: &str,
        kv: Option<serde_json::Value>,
    ) -> Result<Identity, CheckError> {
        let step = if kv.is_some() {
            "probe-from"
        } else {
            "probe-local"
        };
        self.step(iid, step)
    }
}

fn plan(targets: &[&str], old: Option<f64>) -> Plan {
    Plan {
        targets: targets.iter().map(|s| s.to_string()).collect(),
        roles: vec![("p0".into(), Role::Prefill), ("d0".into(), Role::Decode)],
        live: ["d0".to_string(), "p0".to_string()]
            .into_iter()
            .filter(|i| !targets.contains(&i.as_str()))
            .collect(),
        restart_after: targets.iter().map(|t| (t.to_string(), old)).collect(),
        accepted_starts: BTreeMap::from([("p0".into(), 10.0), ("d0".into(), 20.0)]),
        model: "m".into(),
        wave: false,
        direct_generation: true,
        verify_sources: BTreeMap::new(),
    }
}

fn run<F: Future>(f: F) -> F::Output {
    // A single-threaded executor is enough: the fake never pends.
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

#[test]
fn restarted_prefill_passes_every_check_in_the_seed_order() {
    let fake = Fake::new(&[("p0", 15.0), ("d0", 20.0)]);
    let r = run(validate(&plan(&["p0"], Some(10.0)), &fake, "c"));
    assert!(r.passed(), "{r:?}");
    assert_eq!(
        r.engines["p0"].checks,
        [
            "health",
            "attestation fp",
            "model",
            "new process identity",
            "generation",
            "fabric produce to d0",
            "final health"
        ]
    );
    assert_eq!(r.engines["p0"].process_start, Some(15.0));
    assert_eq!(
        r.engines["d0"].checks,
        [
            "health",
            "attestation fp",
            "model",
            "fabric consume from p0"
        ]
    );
}

#[test]
fn an_ejected_peer_validated_as_co_target_pairs_with_the_target() {
    // p0 restarted after its drain; d0 (ejected, not live) joins without a restart
    // requirement (Lifecycle::join_recovery).
    let fake = Fake::new(&[("p0", 15.0), ("d0", 30.0)]);
    let mut p = plan(&["d0", "p0"], Some(10.0));
    p.restart_after.insert("d0".into(), None);
    assert!(p.live.is_empty());
    assert_eq!(
        fabric_pairs(&p).unwrap(),
        [("p0".to_string(), "d0".to_string())],
        "one pair, not one per target"
    );
    let r = run(validate(&p, &fake, "c"));
    assert!(r.passed(), "{r:?}");
    assert!(r.changed_peers.is_empty(), "a co-target is not a peer");
    assert_eq!(
        r.engines["d0"].checks,
        [
            "health",
            "attestation fp",
            "model",
            "process identity",
            "generation",
            "fabric consume from p0",
            "final health"
        ]
    );
    assert_eq!(r.engines["d0"].process_start, Some(30.0));
    p.targets = vec!["p0".into()];
    assert_eq!(
        fabric_pairs(&p).unwrap_err().to_string(),
        "fabric validation requires a peer in the opposite role",
        "without the co-target there is no peer"
    );
}

#[test]
fn decode_target_consumes_from_a_prefill_peer() {
    let fake = Fake::new(&[("p0", 10.0), ("d0", 25.0)]);
    let r = run(validate(&plan(&["d0"], Some(20.0)), &fake, "c"));
    assert!(r.passed(), "{r:?}");
    assert!(
        r.engines["d0"]
            .checks
            .contains(&"fabric consume from p0".to_string())
    );
}

#[test]
fn not_restarted_fails_naming_it() {
    let fake = Fake::new(&[("p0", 10.0), ("d0", 20.0)]);
    let r = run(validate(&plan(&["p0"], Some(10.0)), &fake, "c"));
    assert_eq!(
        r.engines["p0"].failures,
        ["engine process did not restart after drain"]
    );
    assert_eq!(
        r.engines["p0"].checks,
        ["health", "attestation fp", "model"]
    );
}

#[test]
fn no_restart_required_after_a_breaker_ejection() {
    let fake = Fake::new(&[("p0", 10.0), ("d0", 20.0)]);
    let r = run(validate(&plan(&["p0"], None), &fake, "c"));
    assert!(r.passed(), "{r:?}");
    assert!(
        r.engines["p0"]
            .checks
            .contains(&"process identity".to_string())
    );
}

#[test]
fn each_check_failing_on_its_own_names_that_check() {
    let cases = [
        ("health", "health did not answer 200"),
        ("attest", "attestation: attest broken"),
        ("generation", "generation failed"),
        ("produce", "fabric p0->d0: produce"),
        (
            "final health",
            "final health failed after fabric validation",
        ),
    ];
    for (step, want) in cases {
        let fake = Fake::new(&[("p0", 15.0), ("d0", 20.0)]).failing("p0", step);
        let r = run(validate(&plan(&["p0"], Some(10.0)), &fake, "c"));
        assert!(!r.passed(), "{step}");
        let f = r.engines["p0"].failures.join("; ");
        assert!(f.starts_with(want), "{step}: {f}");
    }
    let mut fake = Fake::new(&[("p0", 15.0), ("d0", 20.0)]);
    fake.models = vec!["other".into()];
    let r = run(validate(&plan(&["p0"], Some(10.0)), &fake, "c"));
    assert_eq!(r.engines["p0"].failures, ["serves [\"other\"], expected m"]);
    // A consumer that cannot take the KV fails the pair, named on the target too.
    let fake = Fake::new(&[("p0", 15.0), ("d0", 20.0)]).failing("d0", "consume");
    let r = run(validate(&plan(&["p0"], Some(10.0)), &fake, "c"));
    assert_eq!(
        r.engines["p0"].failures,
        ["fabric p0->d0: consume: consume broken"]
    );
}

#[test]
fn peer_that_changed_is_reported_as_the_peers_failure() {
    let fake = Fake::new(&[("p0", 15.0), ("d0", 99.0)]);
    let r = run(validate(&plan(&["p0"], Some(10.0)), &fake, "c"));
    assert_eq!(
        r.engines["d0"].failures,
        ["peer process changed before readmission"]
    );
    assert!(r.engines["p0"].failures.is_empty());
    assert_eq!(r.changed_peers, ["d0"]);
    assert!(!r.passed());
}

#[test]
fn process_replaced_during_validation_fails_it() {
    let mut fake = Fake::new(&[("p0", 15.0), ("d0", 20.0)]);
    fake.replace_after.insert("p0".into(), 1);
    let r = run(validate(&plan(&["p0"], Some(10.0)), &fake, "c"));
    assert!(
        r.engines["p0"].failures[0]
            .starts_with("identity changed or unavailable during validation"),
        "{r:?}"
    );
}

#[test]
fn sglang_skips_direct_generation_and_relies_on_the_transfer() {
    let fake = Fake::new(&[("p0", 15.0), ("d0", 20.0)]).failing("p0", "generation");
    let mut p = plan(&["p0"], Some(10.0));
    p.direct_generation = false;
    let r = run(validate(&p, &fake, "c"));
    assert!(r.passed(), "{r:?}");
    assert_eq!(
        r.engines["p0"].checks,
        [
            "health",
            "attestation fp",
            "model",
            "new process identity",
            "fabric produce to d0",
            "final health"
        ]
    );
    assert!(
        !fake
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("generation"))
    );
}

#[test]
fn suspect_reruns_the_recorded_paths_before_returning() {
    let fake = Fake::new(&[("p0", 10.0), ("d0", 20.0)]);
    let mut p = plan(&["d0"], None);
    p.verify_sources
        .insert("d0".into(), vec!["".into(), "p0".into()]);
    let r = run(validate(&p, &fake, "c"));
    assert!(r.passed(), "{r:?}");
    let checks = &r.engines["d0"].checks;
    let at = |name: &str| {
        checks
            .iter()
            .position(|c| c == name)
            .unwrap_or_else(|| panic!("{name} in {checks:?}"))
    };
    assert!(at("fabric consume from p0") < at("verification (local probe)"));
    assert!(at("verification from p0") < at("final health"));
    let fake = Fake::new(&[("p0", 10.0), ("d0", 20.0)]).failing("d0", "probe-from");
    let r = run(validate(&p, &fake, "c"));
    assert_eq!(
        r.engines["d0"].failures,
        ["verification from p0: probe-from broken"]
    );
}

#[test]
fn no_live_peer_fails_every_target() {
    let fake = Fake::new(&[("p0", 15.0), ("d0", 20.0)]);
    let mut p = plan(&["p0"], Some(10.0));
    p.live.clear();
    let r = run(validate(&p, &fake, "c"));
    assert_eq!(
        r.engines["p0"].failures,
        ["fabric validation requires a peer in the opposite role"]
    );
}

#[test]
fn wave_pairs_cover_every_engine() {
    let mut p = plan(&["p0", "p1", "d0", "d1", "d2"], Some(1.0));
    p.wave = true;
    p.roles = vec![
        ("p0".into(), Role::Prefill),
        ("d0".into(), Role::Decode),
        ("p1".into(), Role::Prefill),
        ("d1".into(), Role::Decode),
        ("d2".into(), Role::Decode),
    ];
    let pairs = fabric_pairs(&p).unwrap();
    assert_eq!(
        pairs,
        [("p0", "d0"), ("p1", "d1"), ("p0", "d2")].map(|(a, b)| (a.to_string(), b.to_string()))
    );
}

/// A [`Fake`] whose every call pends a few times first, so that checks of different
/// engines interleave; counts the calls in flight.
struct Slow {
    inner: Fake,
    in_flight: std::sync::atomic::AtomicUsize,
    max_in_flight: std::sync::atomic::AtomicUsize,
}

impl Slow {
    fn new(inner: Fake) -> Slow {
        Slow {
            inner,
            in_flight: 0.into(),
            max_in_flight: 0.into(),
        }
    }
    async fn around<T>(&self, f: impl Future<Output = T>) -> T {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.max_in_flight.fetch_max(now, SeqCst);
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        let out = f.await;
        self.in_flight.fetch_sub(1, SeqCst);
        out
    }
    /// Each engine's calls, in the order they were made.
    fn per_engine(calls: &[String]) -> BTreeMap<String, Vec<String>> {
        let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for c in calls {
            let (step, iid) = c.split_once(' ').expect("step iid");
            out.entry(iid.to_string())
                .or_default()
                .push(step.to_string());
        }
        out
    }
}

impl Checks for Slow {
    async fn health(&self, iid: &str) -> Result<(), CheckError> {
        self.around(self.inner.health(iid)).await
    }
    async fn attest(&self, iid: &str) -> Result<Attested, CheckError> {
        self.around(self.inner.attest(iid)).await
    }
    async fn generation(&self, iid: &str) -> Result<Identity, CheckError> {
        self.around(self.inner.generation(iid)).await
    }
    async fn kv_produce(
        &self,
        iid: &str,
        id: &str,
    ) -> Result<(serde_json::Value, Identity), CheckError> {
        self.around(self.inner.kv_produce(iid, id)).await
    }
    async fn kv_consume(
        &self,
        iid: &str,
        id: &str,
        kv: serde_json::Value,
    ) -> Result<Identity, CheckError> {
        self.around(self.inner.kv_consume(iid, id, kv)).await
    }
    async fn probe(
        &self,
        iid: &str,
        id: &str,
        kv: Option<serde_json::Value>,
    ) -> Result<Identity, CheckError> {
        self.around(self.inner.probe(iid, id, kv)).await
    }
}

/// A wave of `p` prefill and `d` decode engines, every one a target restarted after 1.0.
fn wave_plan(p: usize, d: usize) -> (Plan, Vec<(String, f64)>) {
    let mut roles = Vec::new();
    for i in 0..p {
        roles.push((format!("p{i}"), Role::Prefill));
    }
    for i in 0..d {
        roles.push((format!("d{i}"), Role::Decode));
    }
    let ids: Vec<(String, f64)> = roles.iter().map(|(i, _)| (i.clone(), 5.0)).collect();
    let plan = Plan {
        targets: roles.iter().map(|(i, _)| i.clone()).collect(),
        live: BTreeSet::new(),
        restart_after: roles.iter().map(|(i, _)| (i.clone(), Some(1.0))).collect(),
        accepted_starts: roles.iter().map(|(i, _)| (i.clone(), 1.0)).collect(),
        roles,
        model: "m".into(),
        wave: true,
        direct_generation: true,
        verify_sources: BTreeMap::new(),
    };
    (plan, ids)
}

fn fake_of(ids: &[(String, f64)]) -> Fake {
    let refs: Vec<(&str, f64)> = ids.iter().map(|(i, s)| (i.as_str(), *s)).collect();
    Fake::new(&refs)
}

#[tokio::test]
async fn a_wave_checks_engines_at_once_and_each_engine_in_order() {
    // 40 engines, more than PARALLEL_ENGINES; 5 prefill for 35 decode engines, so p0 is
    // in several pairs. One decode engine fails its generation, one prefill engine its
    // attestation: the report must be exactly the one-engine-after-another report.
    let (plan, ids) = wave_plan(5, 35);
    for failing in [None, Some(("d7", "generation")), Some(("p3", "attest"))] {
        let make = || match failing {
            Some((iid, step)) => fake_of(&ids).failing(iid, step),
            None => fake_of(&ids),
        };
        let oracle = make();
        // The fake never pends: one engine after another, the order before parallelism.
        let expected = run(validate(&plan, &oracle, "c"));
        let slow = Slow::new(make());
        let report = validate(&plan, &slow, "c").await;
        assert_eq!(report, expected, "failing {failing:?}");
        assert_eq!(report.passed(), failing.is_none());
        let seq = Slow::per_engine(&oracle.calls.lock().unwrap());
        let par = Slow::per_engine(&slow.inner.calls.lock().unwrap());
        assert_eq!(
            par, seq,
            "each engine's checks in the same order ({failing:?})"
        );
        let max = slow.max_in_flight.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            max > 1 && max <= PARALLEL_ENGINES,
            "{max} calls at once, failing {failing:?}"
        );
    }
}

#[test]
fn fabric_rounds_keep_each_engines_pairs_in_order() {
    let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    // A wave with more decode engines: p0 produces for d0 and then d2.
    assert_eq!(
        pair_rounds(&pairs(&[("p0", "d0"), ("p1", "d1"), ("p0", "d2")])),
        [vec![0, 1], vec![2]]
    );
    // d0 consumes from p0 and then p1; p2 -> d1 shares nothing and runs in the first round.
    assert_eq!(
        pair_rounds(&pairs(&[("p0", "d0"), ("p1", "d0"), ("p2", "d1")])),
        [vec![0, 2], vec![1]]
    );
    // A chain: each pair after the previous one of either engine.
    assert_eq!(
        pair_rounds(&pairs(&[
            ("p0", "d0"),
            ("p1", "d0"),
            ("p1", "d1"),
            ("p0", "d1")
        ])),
        [vec![0], vec![1], vec![2], vec![3]]
    );
}
