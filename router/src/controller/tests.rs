//! Pure-core tests of the controller: the conformance scenarios of controller.md 14 run
//! against the machine with a fake clock (one pass per simulated second, arrivals and
//! residents injected directly, as the reference's own values were taken), and every gate,
//! rule and hold reason in its order.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use narwhal_shared::documents::controller as doc;
use narwhal_shared::{Clock as _, SystemClock};
use serde_json::{Value, json};

use super::machine::{Command, Machine, Now};
use super::roles::Engine;
use crate::config::{Config, Role};
use crate::journal::Event;
use crate::placement::Phase;

/// The section-14 fixture profile.
fn profile() -> Value {
    json!({"ttft_a": 0, "ttft_b": 0.001, "ttft_c": 0.01, "tpot_slope": 1e-6,
           "tpot_intercept": 0.01, "decode_min_requests": 1, "decode_max_requests": 64,
           "decode_min_kv_tokens": 16, "decode_max_kv_tokens": 200000,
           "kv_capacity_tokens": 200000})
}

/// A fake world: the fleet as the driver would show it, the machine, a manual clock.
struct World {
    m: Machine,
    fleet: Vec<Engine>,
    t0: Instant,
    now: Instant,
    next: u64,
    risk: Option<(String, Instant)>,
    risk_events: BTreeMap<String, u64>,
    journal: Vec<Event>,
}

fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

impl World {
    /// Engines `e0..` with `roles`, the fixture profile, SLO 2 s / 0.1 s, `extra` merged
    /// over the fleet file.
    fn new(roles: &[&str], extra: Value) -> World {
        let engines: Vec<Value> = roles
            .iter()
            .enumerate()
            .map(|(i, r)| json!({"iid": format!("e{i}"), "url": format!("http://127.0.0.1:{}", 1000 + i), "role": r}))
            .collect();
        let mut doc = json!({
            "schema": "narwhal.fleet", "schema_version": 2, "model": "m",
            "engines": engines, "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
            "profiles": {"default": profile()},
        });
        merge(&mut doc, extra);
        let cfg = Config::from_json_str(&doc.to_string(), &|_| None).expect("fleet file");
        let t0 = SystemClock.now();
        let fleet: Vec<Engine> = cfg
            .engines
            .iter()
            .map(|e| Engine {
                iid: e.iid.clone(),
                role: e.role,
                live: true,
                pinned: e.pin,
                fixed: e.kv_role.fixed_role().map(|_| e.kv_role),
                ejected: false,
            })
            .collect();
        World {
            m: Machine::new(&cfg, t0, fleet.clone()),
            fleet,
            t0,
            now: t0,
            next: 1,
            risk: None,
            risk_events: BTreeMap::new(),
            journal: Vec::new(),
        }
    }

    fn t(&self) -> f64 {
        self.now.saturating_duration_since(self.t0).as_secs_f64()
    }

    fn at(&self) -> Now {
        Now {
            mono: self.now,
            wall: 1000.0 + self.t(),
        }
    }

    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// A sized arrival (it passes through without residency).
    fn arrive(&mut self, input: u64, wanted: u64) -> u64 {
        let id = self.id();
        let now = self.now;
        let b = &mut self.m.core.book;
        b.arrive(id, &format!("r{id}"), now);
        b.sized(id, input, wanted);
        self.m.core.demand.arrival(now, input, wanted);
        b.finished(id, now);
        id
    }

    /// A sized arrival placed (first attempt) on prefill engine `iid`, whose prefix cache
    /// the KV index credits with `cached` of its tokens, as the request path records it; it
    /// passes through without residency.
    fn arrive_cached(&mut self, iid: usize, input: u64, wanted: u64, cached: u64) -> u64 {
        let id = self.id();
        let now = self.now;
        let b = &mut self.m.core.book;
        b.arrive(id, &format!("r{id}"), now);
        b.sized(id, input, wanted);
        self.m.core.demand.arrival(now, input, wanted);
        self.m.core.placed(id, iid, Some(cached), 1, now);
        self.m.core.book.finished(id, now);
        id
    }

    /// A request resident in `phase` on engine `iid` until [`World::finish`].
    fn resident(&mut self, iid: usize, phase: Phase, input: u64, wanted: u64) -> u64 {
        let id = self.id();
        let now = self.now;
        let b = &mut self.m.core.book;
        b.arrive(id, &format!("r{id}"), now);
        b.sized(id, input, wanted);
        b.dispatched(id, iid, phase, now);
        if phase == Phase::Decode {
            b.first_token(id, now);
            b.tokens(id, 1, now);
        }
        id
    }

    /// A decode resident that has not produced a token yet (no token gaps).
    fn quiet(&mut self, iid: usize, input: u64) -> u64 {
        let id = self.id();
        let now = self.now;
        let b = &mut self.m.core.book;
        b.arrive(id, &format!("r{id}"), now);
        b.sized(id, input, 0);
        b.dispatched(id, iid, Phase::Decode, now);
        id
    }

    /// An urgent evaluation now (the latch was armed).
    fn urgent(&mut self) {
        self.observe();
        let now = self.at();
        let c = self.m.urgent(now);
        self.apply(c);
    }

    /// An availability change seen now.
    fn availability(&mut self) {
        self.observe();
        let now = self.at();
        let c = self.m.availability(now);
        self.apply(c);
    }

    /// A request waiting for an admission seat.
    fn waiting(&mut self, input: u64) -> u64 {
        let id = self.id();
        let now = self.now;
        let b = &mut self.m.core.book;
        b.arrive(id, &format!("r{id}"), now);
        b.sized(id, input, 0);
        b.wait(id);
        self.m.core.demand.arrival(now, input, 0);
        id
    }

    fn finish(&mut self, id: u64) {
        let now = self.now;
        self.m.core.book.finished(id, now);
    }

    fn observe(&mut self) {
        self.m.observe(
            self.fleet.clone(),
            self.risk.clone(),
            self.risk_events.clone(),
        );
    }

    fn apply(&mut self, commands: Vec<Command>) {
        for c in commands {
            match c {
                Command::SetRole { iid, to } => self.fleet[iid].role = to,
                Command::Risk(kind) => {
                    self.risk = Some((kind.to_string(), self.now));
                    *self.risk_events.entry(kind.to_string()).or_default() += 1;
                }
                Command::Journal(v) => self.journal.push(v),
            }
        }
    }

    /// One scheduled pass now.
    fn pass(&mut self) {
        self.observe();
        let now = self.at();
        let c = self.m.pass(now);
        self.apply(c);
    }

    /// A risk event now (a decode leg's first-token timeout).
    fn risk(&mut self, kind: &str) {
        self.risk = Some((kind.to_string(), self.now));
        *self.risk_events.entry(kind.to_string()).or_default() += 1;
    }

    /// Runs to `until` seconds: each second, `rate` arrivals of (`input`, `wanted`) spread
    /// over the second, then one pass.
    fn run(&mut self, until: f64, rate: f64, input: u64, wanted: u64) {
        let mut carry = 0.0;
        while self.t() + 1.0 <= until + 1e-9 {
            let start = self.now;
            carry += rate;
            let k = carry.floor() as u64;
            carry -= k as f64;
            for j in 0..k {
                self.now = start + Duration::from_secs_f64(j as f64 / k as f64);
                self.arrive(input, wanted);
            }
            self.now = start + Duration::from_secs(1);
            self.pass();
        }
    }

    /// Seconds pass with no arrivals, one pass per second.
    fn idle(&mut self, until: f64) {
        self.run(until, 0.0, 0, 0);
    }

    fn decisions(&self) -> Vec<&doc::Decision> {
        self.journal
            .iter()
            .filter_map(|e| match e {
                Event::ControllerDecision(d) => Some(d.as_ref()),
                _ => None,
            })
            .collect()
    }

    /// The journal rows of event `name`, as written (the event rows other than decisions).
    fn events(&self, name: &str) -> Vec<Value> {
        self.journal
            .iter()
            .map(Event::to_value)
            .filter(|e| e["event"] == name)
            .collect()
    }

    fn roles(&self) -> Vec<&'static str> {
        self.fleet.iter().map(|e| e.role.as_str()).collect()
    }

    fn eject(&mut self, iid: usize) {
        self.fleet[iid].live = false;
        self.fleet[iid].ejected = true;
    }

    /// The decisions taken at `t` seconds (wall = 1000 + t).
    fn decided_at(&self, t: f64) -> Vec<&doc::Decision> {
        self.decisions()
            .into_iter()
            .filter(|d| (d.at - 1000.0 - t).abs() < 0.01)
            .collect()
    }
}

/// A decision's detail `key` as written, `null` when the decision has none.
fn detail<'a>(d: &'a doc::Decision, key: &str) -> &'a Value {
    d.details.get(key).unwrap_or(&Value::Null)
}

fn applied(ds: &[&doc::Decision]) -> Vec<(f64, String)> {
    ds.iter()
        .filter(|d| d.result == "applied")
        .map(|d| (d.at - 1000.0, d.by.clone()))
        .collect()
}

/// controller.md S1: prefill pressure consolidates one engine at a time.
#[test]
fn s1_prefill_pressure_consolidates_one_engine_at_a_time() {
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    w.run(59.0, 2.0, 500, 50);
    let ds = w.decisions();
    let at5 = w.decided_at(5.0);
    assert_eq!(at5.len(), 1, "one decision every step: {ds:#?}");
    let d = at5[0];
    assert_eq!(d.reason, "demand evidence is still collecting", "{d:#?}");
    assert_eq!((Some(d.prefill), Some(d.decode)), (Some(2), Some(2)));
    assert_eq!(detail(d, "evidence_blocked_gate"), "evidence");
    assert!(
        (detail(d, "prefill_work").as_f64().unwrap_or(0.0) - 1.02).abs() < 0.03,
        "{d:#?}"
    );
    assert!(
        (detail(d, "objective").as_f64().unwrap_or(0.0) - 0.6375).abs() < 0.02,
        "{d:#?}"
    );
    assert!(applied(&ds).is_empty(), "no move before the window closes");
    assert_eq!(w.decided_at(6.0).len(), 0, "no decision between steps");
    w.run(60.0, 2.0, 500, 50);
    let d = *w.decided_at(60.0).first().expect("a decision at t=60");
    assert_eq!(d.result, "applied", "{d:#?}");
    assert_eq!(d.by, "reactive");
    assert_eq!(detail(d, "eligibility_rule"), "source_shrink");
    assert_eq!(detail(d, "required_confirmations"), 1);
    assert_eq!(
        w.roles(),
        ["prefill", "prefill", "decode", "decode"],
        "e1 in config order"
    );
    w.run(76.0, 2.0, 500, 50);
    let waiting: Vec<_> = w
        .decisions()
        .into_iter()
        .filter(|d| d.reason == "waiting for sustained demand")
        .map(|d| {
            (
                detail(d, "confirmations").as_u64(),
                detail(d, "required_confirmations").as_u64(),
            )
        })
        .collect();
    assert_eq!(waiting, [(Some(1), Some(3)), (Some(2), Some(3))]);
    assert_eq!(
        applied(&w.decisions()),
        [(60.0, "reactive".into()), (75.0, "reactive".into())]
    );
    assert_eq!(w.roles(), ["prefill", "prefill", "prefill", "decode"]);
    w.run(100.0, 2.0, 500, 50);
    let last = *w.decisions().last().expect("decisions");
    assert_eq!(
        last.reason,
        "projected improvement is below the movement margin"
    );
    assert_eq!(detail(last, "eligibility_rule"), "steady_demand");
    assert_eq!(w.m.core.roles.flips["reactive:prefill"], 2);
    assert_eq!(w.m.core.roles.refused_total, 0);
}

/// controller.md 3.5: S1's load served from cache. Every 500-token prompt is placed on e0
/// with 496 tokens credited as cached, so the demand is 2 req/s of 4-token prefills (0.028
/// prefill engines, not 1.02) and the fleet never consolidates: priced by prompt length
/// (before this pricing) the same stream moved e1 to prefill at t≈60, as in S1.
#[test]
fn a_cached_prefix_workload_does_not_consolidate() {
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    let mut carry = 0.0f64;
    while w.t() + 1.0 <= 100.0 + 1e-9 {
        let start = w.now;
        carry += 2.0;
        let k = carry.floor() as u64;
        carry -= k as f64;
        for j in 0..k {
            w.now = start + Duration::from_secs_f64(j as f64 / k as f64);
            w.arrive_cached(0, 500, 50, 496);
        }
        w.now = start + Duration::from_secs(1);
        w.pass();
    }
    let ds = w.decisions();
    assert!(applied(&ds).is_empty(), "no flip: {ds:#?}");
    assert_eq!(w.roles(), ["prefill", "decode", "decode", "decode"]);
    assert!(w.events("flips_refused").is_empty());
    let d = *w.decided_at(60.0).first().expect("a decision at t=60");
    assert!(
        (detail(d, "prefill_work").as_f64().unwrap_or(1.0) - 0.028).abs() < 0.005,
        "{d:#?}"
    );
    assert_eq!(d.reason, "insufficient demand history", "{d:#?}");
}

/// controller.md 3.5: admission's cheapest own prefill prices each engine at its uncached
/// tokens; a request not yet scored (one waiting for a seat) is priced at its whole prompt.
#[test]
fn the_cheapest_prefill_is_priced_at_the_uncached_tokens() {
    let w = World::new(&["prefill", "prefill", "decode", "decode"], json!({}));
    let cold = w.m.core.cheapest_prefill(1000, &[]).expect("profiled");
    assert!((cold - 1.01).abs() < 1e-9, "{cold}");
    let warm = w.m.core.cheapest_prefill(1000, &[0, 992, 0, 0]);
    assert!(warm.is_some_and(|p| (p - 0.018).abs() < 1e-9), "{warm:?}");
    // Only prefill engines are candidates while one is live: a decode's cache is not used.
    let decode_only = w.m.core.cheapest_prefill(1000, &[0, 0, 1000, 0]);
    assert!(decode_only.is_some_and(|p| (p - 1.01).abs() < 1e-9));
}

/// controller.md S2: moves to decode wait for the cooldown (from router start), then the
/// fresh p→d risk re-arms the evidence window.
#[test]
fn s2_moves_to_decode_wait_for_the_cooldown() {
    let mut w = World::new(&["prefill", "prefill", "prefill", "decode"], json!({}));
    w.run(5.0, 3.0, 100, 4000);
    let d = *w.decided_at(5.0).first().expect("t=5");
    assert_eq!(
        (Some(d.result.as_str()), Some(d.reason.as_str())),
        (Some("blocked"), Some("decode cooldown has not elapsed")),
        "{d:#?}"
    );
    assert_eq!(
        w.m.core.roles.refusals().last().map(|r| r.to),
        Some(Role::Decode)
    );
    w.run(10.0, 3.0, 100, 4000);
    assert_eq!(
        w.roles(),
        ["decode", "prefill", "prefill", "decode"],
        "e0 at t=10"
    );
    w.run(15.0, 3.0, 100, 4000);
    assert_eq!(
        w.decided_at(15.0)[0].reason,
        "decode cooldown has not elapsed"
    );
    w.run(20.0, 3.0, 100, 4000);
    assert_eq!(
        w.roles(),
        ["decode", "decode", "prefill", "decode"],
        "e1 at t=20"
    );
    w.run(25.0, 3.0, 100, 4000);
    let d = w.decided_at(25.0)[0];
    assert_eq!(
        d.reason, "p to d recovery 5.0 s ago: re-collecting one evidence window",
        "{d:#?}"
    );
    assert_eq!(detail(d, "evidence_blocked_gate"), "risk");
    assert_eq!(w.risk_events["p_to_d_recovery"], 2);
    w.run(40.0, 3.0, 100, 4000);
    assert_eq!(applied(&w.decisions()).len(), 2, "no third move: 0 < p");
}

/// controller.md S3: a first-token timeout re-arms the window; the move comes once a
/// new window closed after it.
#[test]
fn s3_a_first_token_timeout_rearms_the_evidence_window() {
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    w.run(55.0, 2.0, 500, 50);
    w.risk("first_token_timeout");
    w.run(60.0, 2.0, 500, 50);
    let d = w.decided_at(60.0)[0];
    assert_eq!(
        d.reason,
        "first token timeout 5.0 s ago: re-collecting one evidence window"
    );
    assert_eq!(detail(d, "evidence_blocked_gate"), "risk");
    assert!(applied(&w.decisions()).is_empty());
    w.run(114.0, 2.0, 500, 50);
    assert!(
        applied(&w.decisions()).is_empty(),
        "not before 60 s after the event"
    );
    w.run(115.0, 2.0, 500, 50);
    assert_eq!(applied(&w.decisions()), [(115.0, "reactive".into())]);
}

/// controller.md S4: decode-floor restoration, then the last prefill engine is kept.
#[test]
fn s4_the_decode_floor_is_restored_from_the_lightest_prefill_engine() {
    let mut w = World::new(
        &["prefill", "prefill", "decode", "decode"],
        json!({"controller": {"min_decode": 2}}),
    );
    w.resident(0, Phase::Prefill, 1000, 10);
    w.resident(0, Phase::Prefill, 1000, 10);
    w.idle(3.0);
    w.eject(2);
    w.idle(4.0);
    let d = w.decided_at(4.0)[0];
    assert_eq!(
        (
            Some(d.by.as_str()),
            Some(d.result.as_str()),
            Some(d.reason.as_str())
        ),
        (
            Some("decode_floor"),
            Some("applied"),
            Some("restore min_decode")
        )
    );
    assert_eq!((Some(d.prefill), Some(d.decode)), (Some(1), Some(3)));
    assert!(
        !d.details.contains_key("objective"),
        "floor flips carry no details"
    );
    assert_eq!(
        w.roles(),
        ["prefill", "decode", "decode", "decode"],
        "e1: less resident prefill"
    );
    let ev = w.events("decode_floor_restored");
    assert_eq!(ev[0]["iid"], "e1");
    assert_eq!(
        (ev[0]["live_decode"].as_u64(), ev[0]["min_decode"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(w.m.core.roles.restoration_moves, 1);
    assert_eq!(
        w.risk.as_ref().map(|r| r.0.as_str()),
        Some("p_to_d_recovery")
    );
    w.eject(3);
    w.idle(7.0);
    for t in [5.0, 6.0, 7.0] {
        let ds = w.decided_at(t);
        assert_eq!(ds.len(), 1, "a refusal every pass");
        assert_eq!(
            (
                Some(ds[0].by.as_str()),
                Some(ds[0].result.as_str()),
                Some(ds[0].reason.as_str())
            ),
            (
                Some("decode_floor"),
                Some("blocked"),
                Some("prefill floor keeps the last live engine")
            )
        );
        assert_eq!(
            (Some(ds[0].prefill), Some(ds[0].decode)),
            (Some(0), Some(4))
        );
    }
    assert!(
        w.decisions().iter().all(|d| d.by != "reactive"),
        "no reactive step below the floor"
    );
}

/// controller.md S5: prefill-floor recovery, with the breach edges.
#[test]
fn s5_the_prefill_floor_is_recovered_without_gates() {
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    w.idle(2.0);
    w.eject(0);
    w.availability();
    let below = w.events("below_floor");
    assert_eq!(below.len(), 1);
    assert_eq!(below[0]["live_prefill"], 0);
    assert_eq!(below[0]["ejected"], json!(["e0"]));
    assert_eq!(below[0]["quarantined"], json!([]));
    assert_eq!(w.m.floor.breaches, 1);
    w.idle(3.0);
    let d = w.decided_at(3.0)[0];
    assert_eq!(
        (
            Some(d.by.as_str()),
            Some(d.result.as_str()),
            Some(d.reason.as_str())
        ),
        (
            Some("floor_recovery"),
            Some("applied"),
            Some("restore min_prefill")
        )
    );
    assert_eq!(
        (Some(d.prefill), Some(d.decode)),
        (Some(2), Some(2)),
        "counts include the ejected e0"
    );
    assert_eq!(w.roles(), ["prefill", "prefill", "decode", "decode"]);
    let rec = w.events("below_floor_recovered");
    assert!(
        (rec[0]["duration_s"].as_f64().unwrap_or(0.0) - 1.0).abs() < 0.01,
        "{:?}",
        rec[0]
    );
    assert!(w.risk.is_none(), "no risk event");
}

/// controller.md S6: no donor: the health hold, and no refusal.
#[test]
fn s6_without_a_donor_the_fleet_health_hold_applies() {
    let mut w = World::new(
        &["prefill", "decode", "decode"],
        json!({"controller": {"min_decode": 2}}),
    );
    w.run(10.0, 2.0, 500, 50);
    w.eject(0);
    w.availability();
    w.run(20.0, 2.0, 500, 50);
    assert_eq!(w.events("below_floor").len(), 1);
    assert_eq!(w.m.core.roles.refused_total, 0);
    let d = w.decided_at(20.0)[0];
    assert_eq!(d.reason, "fleet health is changing");
    assert_eq!((Some(d.prefill), Some(d.decode)), (Some(1), Some(2)));
    assert!(applied(&w.decisions()).is_empty());
}

/// controller.md S7: advisory mode runs every guard and changes nothing.
#[test]
fn s7_advisory_mode_decides_without_moving() {
    let mut w = World::new(
        &["prefill", "decode", "decode", "decode"],
        json!({"controller": {"advisory": true}}),
    );
    w.run(70.0, 2.0, 500, 50);
    for t in [60.0, 65.0, 70.0] {
        let d = w.decided_at(t)[0];
        assert_eq!(
            (Some(d.result.as_str()), Some(d.reason.as_str())),
            (Some("advisory"), Some("post-move objective improved"))
        );
    }
    assert_eq!(w.roles(), ["prefill", "decode", "decode", "decode"]);
    assert!(w.m.core.roles.refusals().all(|r| r.why == "advisory mode"));
    assert_eq!(w.m.core.roles.flips.values().sum::<u64>(), 0);
    assert_eq!(
        w.m.decisions[&(
            super::decision::By::Reactive,
            super::decision::Outcome::Advisory
        )],
        3
    );
}

/// controller.md S8: pins, and the decode-resident guard.
#[test]
fn s8_pins_and_the_resident_guard_refuse_the_donor() {
    let pinned = json!({"engines": []});
    let _ = pinned;
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    for e in &mut w.fleet[1..] {
        e.pinned = true;
    }
    w.run(60.0, 2.0, 500, 50);
    let d = w.decided_at(60.0)[0];
    assert_eq!(
        (Some(d.result.as_str()), Some(d.reason.as_str())),
        (
            Some("blocked"),
            Some("pins or nominated engine exclude every source candidate")
        )
    );

    let mut w = World::new(
        &["prefill", "decode", "decode", "decode"],
        json!({"controller": {"thresholds": {"flip_resident_guard": 2}}}),
    );
    for iid in 1..4 {
        for _ in 0..3 {
            w.quiet(iid, 100);
        }
    }
    w.run(60.0, 2.0, 500, 50);
    let d = w.decided_at(60.0)[0];
    assert_eq!(
        d.reason, "lightest decode donor carries 3 residents, above flip_resident_guard 2",
        "{d:#?}"
    );
}

/// controller.md S9: no adjacent split; demand below the floor.
#[test]
fn s9_no_adjacent_split_and_too_little_demand_hold() {
    let mut w = World::new(&["prefill", "decode"], json!({}));
    w.run(80.0, 2.0, 500, 50);
    assert!(
        w.decisions()
            .iter()
            .all(|d| d.reason == "projected improvement is below the movement margin")
    );
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    w.run(80.0, 1.0, 200, 50);
    assert!(
        w.decisions()
            .iter()
            .all(|d| d.reason == "insufficient demand history")
    );
}

/// controller.md S10: unknown outputs hold until observed prefill pressure opens the
/// recovery path.
#[test]
fn s10_incomplete_demand_moves_on_observed_pressure() {
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    w.run(30.0, 2.0, 500, 0);
    let d = w.decided_at(30.0)[0];
    assert_eq!(
        d.reason,
        "incomplete demand requires observed phase pressure and fleet profiles"
    );
    assert_eq!(detail(d, "demand_complete"), false);
    for _ in 0..5 {
        w.resident(0, Phase::Prefill, 1000, 0);
    }
    w.waiting(1000);
    w.waiting(1000);
    w.run(75.0, 2.0, 500, 0);
    let moved = applied(&w.decisions());
    assert_eq!(moved.len(), 1, "{:#?}", w.decisions());
    let t = moved[0].0;
    let d = w.decided_at(t)[0];
    assert_eq!(detail(d, "decision_basis"), "prefill_pressure_recovery");
    assert!(
        (detail(d, "recovery_prefill_ratio").as_f64().unwrap_or(0.0) - 3.535).abs() < 0.01,
        "{d:#?}"
    );
    let waits: Vec<_> = [t - 10.0, t - 5.0]
        .iter()
        .map(|x| detail(w.decided_at(*x)[0], "confirmations").as_u64())
        .collect();
    assert_eq!(waits, [Some(1), Some(2)]);
}

/// controller.md S11: an urgent TTFT recovery cascades once the evidence is closed.
#[test]
fn s11_urgent_recovery_cascades() {
    let mut w = World::new(
        &["prefill", "decode", "decode", "decode"],
        json!({"serving": {"queue_capacity": 16, "queue_timeout_s": 30}}),
    );
    w.run(30.0, 1.0, 100, 10);
    // Before the window closes the urgent path holds on the evidence gate.
    let early: Vec<u64> = (0..6).map(|_| w.waiting(1000)).collect();
    assert!(w.m.note_prefill_risk(w.now));
    w.urgent();
    let d = *w.decisions().last().expect("urgent decision");
    assert_eq!(d.reason, "demand evidence is still collecting", "{d:#?}");
    assert_eq!(detail(d, "eligibility_rule"), "projected_ttft_recovery");
    for id in early {
        w.m.core.book.unwait(id);
        w.finish(id);
    }
    w.run(70.0, 1.0, 100, 10);
    let ids: Vec<u64> = (0..6).map(|_| w.waiting(1000)).collect();
    assert!(w.m.note_prefill_risk(w.now));
    w.urgent();
    let d = *w.decisions().last().expect("urgent decision");
    assert_eq!(
        (
            Some(d.result.as_str()),
            detail(d, "eligibility_rule").as_str()
        ),
        (Some("applied"), Some("projected_ttft_recovery")),
        "{d:#?}"
    );
    assert_eq!(detail(d, "required_confirmations"), 1);
    assert_eq!(*detail(d, "trigger_rid"), format!("r{}", ids[5]));
    let p = detail(d, "projected_ttft_s").as_f64().unwrap_or(0.0);
    assert!((6.0..6.4).contains(&p), "{p}");
    let c = detail(d, "candidate_projected_ttft_s")
        .as_f64()
        .unwrap_or(0.0);
    assert!((3.0..3.3).contains(&c), "{c}");
    assert!(w.m.latched(), "the queue still breaches: re-armed");
    w.urgent();
    assert_eq!(w.roles(), ["prefill", "prefill", "prefill", "decode"]);
    assert!(w.m.latched());
    w.urgent();
    let d = *w.decisions().last().expect("urgent decision");
    assert_eq!(
        d.reason,
        "projected TTFT recovery requires a strict prefill improvement"
    );
}

/// controller.md S14: rising decode demand blocks consolidation.
#[test]
fn s14_rising_decode_demand_blocks_consolidation() {
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    w.run(57.0, 2.0, 500, 50);
    let mut reasons = Vec::new();
    while w.t() < 110.0 {
        let start = w.now;
        for j in 0..2 {
            w.now = start + Duration::from_secs_f64(j as f64 / 2.0);
            w.arrive(500, 50);
        }
        for j in 0..3 {
            w.now = start + Duration::from_secs_f64(j as f64 / 3.0);
            w.arrive(100, 3000);
        }
        w.now = start + Duration::from_secs(1);
        w.pass();
        if let Some(d) = w.decided_at(w.t()).first() {
            reasons.push((d.reason.clone(), detail(d, "evidence_trend_ratio").as_f64()));
        }
    }
    assert!(applied(&w.decisions()).is_empty());
    assert_eq!(
        reasons[0].0, "projected decode pressure blocks consolidation",
        "{reasons:?}"
    );
    let trend: Vec<_> = reasons
        .iter()
        .filter(|(r, _)| r == "rising decode demand blocks consolidation")
        .collect();
    assert!(!trend.is_empty(), "{reasons:?}");
    assert!(trend.iter().all(|(_, t)| t.unwrap_or(0.0) > 1.25));
}

/// controller.md S15: flip bookkeeping: in-flight residents, drained_s, reversals.
#[test]
fn s15_flip_bookkeeping_tracks_residents_and_reversals() {
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    w.fleet[0].pinned = true;
    let s1 = w.quiet(1, 100);
    for iid in [2, 3] {
        w.quiet(iid, 100);
        w.quiet(iid, 100);
    }
    w.run(60.0, 2.0, 500, 50);
    assert_eq!(
        w.roles(),
        ["prefill", "prefill", "decode", "decode"],
        "e1: the lightest donor"
    );
    let f = w.m.core.roles.history().last().cloned().expect("a flip");
    assert_eq!((f.iid, f.decode_inflight, f.drained_s), (1, 1, None));
    assert_eq!(w.m.core.roles.inflight, (0, 1));
    w.run(62.0, 2.0, 500, 50);
    assert_eq!(
        w.m.core.roles.history().last().and_then(|f| f.drained_s),
        None,
        "the stream is still resident"
    );
    w.finish(s1);
    w.run(63.0, 2.0, 500, 50);
    let drained = w.m.core.roles.history().last().and_then(|f| f.drained_s);
    assert_eq!(drained, Some(3.0));
    // e2 and e3 go: the decode floor takes e1 back (e0 is pinned): a reversal.
    w.eject(2);
    w.eject(3);
    w.run(64.0, 2.0, 500, 50);
    assert_eq!(w.fleet[1].role, Role::Decode);
    assert_eq!(w.m.core.roles.reversals, 1);
}

/// controller.md S13 (the machine's part): a busy SGLang donor is held out of new
/// placements until idle, then switched.
#[test]
fn s13_a_busy_engine_side_donor_is_held_until_idle() {
    let mut w = World::new(
        &["prefill", "decode", "decode", "decode"],
        json!({"backend": "sglang"}),
    );
    let streams: Vec<u64> = (1..4).map(|iid| w.quiet(iid, 100)).collect();
    w.run(60.0, 2.0, 500, 50);
    let d = w.decided_at(60.0)[0];
    assert_eq!(
        d.reason,
        "holding e1 out of new placements until it is idle for an engine-side role switch"
    );
    assert_eq!(
        w.m.core.roles.held(w.now).into_iter().collect::<Vec<_>>(),
        [1]
    );
    w.run(65.0, 2.0, 500, 50);
    assert_eq!(
        w.decided_at(65.0)[0].result,
        "blocked",
        "the hold is renewed"
    );
    w.finish(streams[0]);
    w.run(70.0, 2.0, 500, 50);
    let d = w.decided_at(70.0)[0];
    assert_eq!(d.result, "applied", "{d:#?}");
    assert_eq!(w.roles(), ["prefill", "prefill", "decode", "decode"]);
    assert!(
        w.m.core.roles.held(w.now).is_empty(),
        "an applied flip clears the holds"
    );
}

/// The flip guards of controller.md 7.1, in their order: each case breaks two guards and
/// the earlier one is reported.
#[test]
fn flip_guards_refuse_in_their_order() {
    use super::decision::{By, Details};
    use super::roles::{Ctx, Flipped, Request};
    let req = |to: Role, by: By| Request {
        to,
        by,
        bypass_cooldown: false,
        bypass_dwell: false,
        candidate: None,
        reason: "post-move objective improved".into(),
        details: Details::default(),
    };
    let reason = |f: &Flipped| f.decision().reason.clone();
    let mut w = World::new(
        &["prefill", "decode", "decode", "decode"],
        json!({"controller": {"min_decode": 2, "thresholds": {"dwell_s": 30, "flip_resident_guard": 1}}}),
    );
    let now = w.now + Duration::from_secs(1);
    let flip = |w: &mut World, r: Request, now: Instant| {
        let core = &mut w.m.core;
        let mut ctx = Ctx {
            engines: &mut core.engines,
            book: &core.book,
            now,
            wall: 0.0,
            panic: false,
        };
        core.roles.flip(&mut ctx, r)
    };
    // 1 before 2: to decode in the cooldown, from the last live prefill engine.
    w.observe();
    assert_eq!(
        reason(&flip(&mut w, req(Role::Decode, By::Reactive), now)),
        "decode cooldown has not elapsed"
    );
    // 2: the last live prefill engine (cooldown over).
    let later = w.now + Duration::from_secs(11);
    assert_eq!(
        reason(&flip(&mut w, req(Role::Decode, By::Reactive), later)),
        "prefill floor keeps the last live engine"
    );
    // 4: min_decode 2 keeps 2 of 3 live decode engines when one is ejected.
    w.fleet[3].live = false;
    w.observe();
    assert_eq!(
        reason(&flip(&mut w, req(Role::Prefill, By::Reactive), later)),
        "min_decode keeps 2 live decode engines"
    );
    w.fleet[3].live = true;
    // 6: a donor with 2 decode residents against guard 1.
    for iid in 1..4 {
        w.quiet(iid, 10);
        w.quiet(iid, 10);
    }
    w.observe();
    assert_eq!(
        reason(&flip(&mut w, req(Role::Prefill, By::Reactive), later)),
        "lightest decode donor carries 2 residents, above flip_resident_guard 1"
    );
    // 5 before 6: every decode engine pinned.
    for e in &mut w.fleet[1..] {
        e.pinned = true;
    }
    w.observe();
    assert_eq!(
        reason(&flip(&mut w, req(Role::Prefill, By::Reactive), later)),
        "pins or nominated engine exclude every source candidate"
    );
    // 3: min_prefill 2 keeps both live prefill engines.
    let mut w2 = World::new(
        &["prefill", "prefill", "decode"],
        json!({"controller": {"min_prefill": 2, "min_decode": 1}}),
    );
    w2.observe();
    let t = w2.now + Duration::from_secs(11);
    assert_eq!(
        reason(&flip(&mut w2, req(Role::Decode, By::Reactive), t)),
        "min_prefill keeps 2 live prefill engines"
    );
    // Dwell: an engine that just moved is no donor until dwell_s passed.
    let mut w3 = World::new(
        &["prefill", "decode", "decode", "decode"],
        json!({"controller": {"thresholds": {"dwell_s": 30, "cooldown_s": 0}}}),
    );
    w3.observe();
    let t = w3.now + Duration::from_secs(1);
    assert!(matches!(
        flip(&mut w3, req(Role::Prefill, By::Reactive), t),
        Flipped::Applied { iid: 1, .. }
    ));
    let t2 = t + Duration::from_secs(5);
    let mut r = req(Role::Decode, By::Reactive);
    r.candidate = Some(1);
    assert_eq!(
        reason(&flip(&mut w3, r.clone(), t2)),
        "source engine dwell has not elapsed"
    );
    r.bypass_dwell = true;
    assert!(
        matches!(flip(&mut w3, r, t2), Flipped::Applied { iid: 1, .. }),
        "floor recovery bypasses the dwell"
    );
    assert_eq!(
        w3.m.core.roles.reversals, 1,
        "a second flip of the same engine is a reversal"
    );
    // 7 after every guard: advisory.
    let mut w4 = World::new(
        &["prefill", "decode", "decode"],
        json!({"controller": {"advisory": true}}),
    );
    w4.observe();
    let t4 = w4.now;
    let f = flip(&mut w4, req(Role::Prefill, By::Reactive), t4);
    assert!(matches!(f, Flipped::Advisory(_)));
    assert_eq!(
        w4.m.core.roles.refusals().last().map(|r| r.why.clone()),
        Some("advisory mode".into())
    );
    assert_eq!(w4.m.core.engines[1].role, Role::Decode, "the role is kept");
}

/// The panic rule bypasses the cooldown once decode load stayed above panic_ratio·E for
/// sustained_intervals passes with prefill load at most S (controller.md section 6).
#[test]
fn panic_bypasses_the_cooldown_and_is_counted() {
    let mut w = World::new(
        &["prefill", "prefill", "prefill", "decode"],
        json!({"controller": {"thresholds": {"panic_ratio": 1.0, "cooldown_s": 1000}}}),
    );
    // A decode stream whose token gaps are ten times the TPOT budget.
    let id = w.resident(3, Phase::Decode, 100, 4000);
    let mut total = 1;
    while w.t() < 20.0 {
        w.now += Duration::from_millis(500);
        total += 1;
        w.m.core.book.tokens(id, total, w.now);
        w.now += Duration::from_millis(500);
        w.arrive(100, 4000);
        w.arrive(100, 4000);
        w.arrive(100, 4000);
        w.pass();
    }
    assert!(
        applied(&w.decisions())
            .iter()
            .any(|(_, by)| by == "reactive"),
        "{:#?}",
        w.decisions()
    );
    let to_decode = w.m.core.roles.flips["reactive:decode"];
    assert!(to_decode >= 1);
    assert_eq!(
        w.m.panic_bypasses, to_decode,
        "every reactive move to decode was inside the cooldown"
    );
}

/// controller.md 5.2: the demand gates' reasons in their order.
#[test]
fn the_demand_gates_hold_with_their_reasons() {
    // Too few arrivals: insufficient demand history.
    let mut w = World::new(&["prefill", "decode"], json!({}));
    w.run(5.0, 1.0, 500, 50);
    assert_eq!(w.decided_at(5.0)[0].reason, "insufficient demand history");
    // A recovery with a live engine unprofiled: profiles first.
    let mut w = World::new(
        &["prefill", "decode", "decode"],
        json!({"serving": {"queue_capacity": 4, "queue_timeout_s": 10}}),
    );
    for _ in 0..4 {
        w.waiting(1500);
    }
    assert!(w.m.note_prefill_risk(w.now));
    w.m.core.profiles[2] = None;
    w.urgent();
    assert_eq!(
        w.decisions().last().map(|d| d.reason.as_str()),
        Some("projected TTFT recovery requires fleet profiles")
    );
}

/// controller.md 5.9 reasons 1, 6 and 7: the floors, the profile's domain, KV capacity.
#[test]
fn floors_coverage_and_kv_capacity_hold_the_reported_row() {
    // 1: min_decode 3 leaves no room for a second prefill engine.
    let mut w = World::new(
        &["prefill", "decode", "decode", "decode"],
        json!({"controller": {"min_decode": 3}}),
    );
    w.run(65.0, 2.0, 500, 50);
    assert_eq!(
        w.decided_at(65.0)[0].reason,
        "min_decode blocks the adjacent split"
    );
    // 1 (the other side): min_prefill 2 at 2P2D under decode-heavy demand.
    let mut w = World::new(
        &["prefill", "prefill", "decode", "decode"],
        json!({"controller": {"min_prefill": 2, "thresholds": {"cooldown_s": 0}}}),
    );
    w.run(10.0, 3.0, 100, 4000);
    assert_eq!(
        w.decided_at(10.0)[0].reason,
        "min_prefill blocks the adjacent split"
    );
    // 6: resident batches beyond the profiled KV range.
    let mut w = World::new(&["prefill", "decode", "decode", "decode"], json!({}));
    for iid in 1..4 {
        w.quiet(iid, 250_000);
    }
    w.run(65.0, 2.0, 500, 50);
    assert_eq!(
        w.decided_at(65.0)[0].reason,
        "decode profile does not cover proposed work"
    );
    // 7: covered, but beyond the engine's KV capacity.
    let mut p = profile();
    p["kv_capacity_tokens"] = json!(100_000);
    let mut w = World::new(
        &["prefill", "decode", "decode", "decode"],
        json!({"profiles": {"default": p}}),
    );
    for iid in 1..4 {
        w.quiet(iid, 150_000);
    }
    w.run(65.0, 2.0, 500, 50);
    assert_eq!(
        w.decided_at(65.0)[0].reason,
        "projected decode work exceeds KV capacity"
    );
}

/// controller.md 5.9 reason 9 for a move to decode, and rule `steady_demand` once the
/// demand held steady for evidence_span_s with the window closed.
#[test]
fn a_source_above_shrink_waits_for_steady_demand() {
    // 3P1D: the decode engine at ~0.77 of its budget, prefill light; 2P2D would put the
    // prefill side at ~0.57 (> S = 0.5): unsafe until the demand is steady.
    let mut w = World::new(&["prefill", "prefill", "prefill", "decode"], json!({}));
    w.run(30.0, 1.8, 500, 400);
    let d = w.decided_at(30.0)[0];
    assert_eq!(
        d.reason, "projected prefill pressure blocks consolidation",
        "{d:#?}"
    );
    w.run(80.0, 1.8, 500, 400);
    let rules: Vec<_> = w
        .decisions()
        .iter()
        .filter_map(|d| detail(d, "eligibility_rule").as_str().map(String::from))
        .collect();
    assert!(rules.iter().any(|r| r == "steady_demand"), "{rules:?}");
    assert_eq!(applied(&w.decisions()).len(), 1, "{:#?}", w.decisions());
}

/// controller.md 5.6: a settled fleet whose short view departs from the window demand
/// follows it at once (rule `settled_departure`, one confirmation), before the window
/// demand catches up; afterwards the reverse move is held while the departure leads.
#[test]
fn a_settled_fleet_follows_a_departure_of_the_short_view() {
    // 2P2D balanced: prefill and decode each at ~0.4 of their budgets.
    let mut w = World::new(&["prefill", "prefill", "decode", "decode"], json!({}));
    w.run(130.0, 1.25, 500, 550);
    assert!(
        applied(&w.decisions()).is_empty(),
        "settled: {:#?}",
        w.decisions().last()
    );
    // Decode-heavy from t=130.
    w.run(145.0, 1.25, 100, 1500);
    let moved = applied(&w.decisions());
    let brief: Vec<String> = w
        .decisions()
        .iter()
        .map(|d| {
            format!(
                "{} {} {} {} {}",
                d.at,
                d.prefill,
                d.reason,
                detail(d, "eligibility_rule"),
                detail(d, "objective_delta")
            )
        })
        .collect();
    assert_eq!(moved.len(), 1, "{brief:#?}");
    let d = w.decided_at(moved[0].0)[0];
    assert_eq!(detail(d, "eligibility_rule"), "settled_departure", "{d:#?}");
    assert_eq!(detail(d, "required_confirmations"), 1);
    assert_eq!(*detail(d, "demand_horizon_s"), json!(15.0));
    assert!(d.details.contains_key("departure_age_s"));
    assert_eq!(
        w.fleet.iter().filter(|e| e.role == Role::Prefill).count(),
        1
    );
    assert!(
        moved[0].0 <= 140.0,
        "within two steps of the shift: {moved:?}"
    );
    // While the departure leads, the move back toward prefill is held (reason 2).
    w.run(150.0, 1.25, 100, 1500);
    assert!(
        w.decisions()
            .iter()
            .any(|d| d.reason == "departure toward decode holds the reverse move"),
        "{:#?}",
        w.decisions().last()
    );
}

/// A vLLM engine launched as a fixed KV producer or consumer (`engines[].kv_role`) is never a
/// donor: with every decode engine a `kv_consumer` the move is refused naming them, and a
/// `kv_both` engine among them is the one that moves.
#[test]
fn fixed_kv_roles_are_never_flipped() {
    let engines = |kinds: [&str; 3]| {
        let mut v = vec![
            json!({"iid": "e0", "url": "http://127.0.0.1:1000", "role": "prefill",
                                "kv_role": "kv_producer"}),
        ];
        for (i, k) in kinds.iter().enumerate() {
            v.push(json!({"iid": format!("e{}", i + 1),
                          "url": format!("http://127.0.0.1:{}", 1001 + i),
                          "role": "decode", "kv_role": k}));
        }
        json!({"engines": v})
    };
    let roles = ["prefill", "decode", "decode", "decode"];
    let mut w = World::new(&roles, engines(["kv_consumer"; 3]));
    w.run(60.0, 2.0, 500, 50);
    let d = w.decided_at(60.0)[0];
    assert_eq!(
        (Some(d.result.as_str()), Some(d.reason.as_str())),
        (
            Some("blocked"),
            Some(
                "e1, e2, e3: launched as kv_consumer (engines[].kv_role), a fixed role vLLM cannot flip in place"
            )
        ),
        "{d:#?}"
    );
    assert_eq!(w.roles(), roles);

    let mut w = World::new(&roles, engines(["kv_consumer", "kv_both", "kv_consumer"]));
    w.run(60.0, 2.0, 500, 50);
    assert_eq!(w.decided_at(60.0)[0].result, "applied");
    assert_eq!(
        w.roles(),
        ["prefill", "prefill", "decode", "decode"]
            .map(|r| r)
            .iter()
            .enumerate()
            .map(|(i, r)| if i == 1 {
                "decode"
            } else if i == 2 {
                "prefill"
            } else {
                r
            })
            .collect::<Vec<_>>(),
        "e2, the only kv_both engine, moves"
    );
}
