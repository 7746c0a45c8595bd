//! The role controller and predictive admission end to end (issue 12): the conformance
//! scenarios of controller-notes section 14 against simulated engines, with the fast variant
//! of the timings (step 1 s, pass 0.25 s, window 24 s, evidence 12/24 s, cooldown 2 s;
//! `narwhal_testkit::controller_fleet`). Each asserts the decisions, flips and refusals the
//! section gives.
#![allow(clippy::disallowed_methods)] // tests measure wall time

use std::time::Duration;

use narwhal_testkit::{Load, Shape, controller_fleet, metric, token_prompt};
use serde_json::{Value, json};

/// L1 of section 14: 2 req/s of 500-token prompts with `max_tokens` 50.
const L1: Shape = Shape {
    rate: 2.0,
    input: 500,
    max_tokens: Some(50),
};

/// L2: 3 req/s of 100-token prompts with `max_tokens` 4000.
const L2: Shape = Shape {
    rate: 3.0,
    input: 100,
    max_tokens: Some(4000),
};

/// How long a scenario waits for a decision it expects (the fast timings are 12–20 s, on a
/// loaded 2-core machine).
const DECIDE: Duration = Duration::from_secs(40);

fn pools(state: &Value, role: &str) -> Vec<String> {
    state["pools"][role]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn is(d: &Value, result: &str, reason: &str) -> bool {
    d["result"] == result && d["reason"].as_str().is_some_and(|r| r.starts_with(reason))
}

/// S1: prefill pressure consolidates one engine at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_prefill_pressure_consolidates_one_engine_at_a_time() {
    let fleet = controller_fleet(&["prefill", "decode", "decode", "decode"])
        .start()
        .await;
    let r = fleet.router();
    let load = Load::start(r, L1);
    let held = r
        .decision_where("held on the evidence gate", DECIDE, |d| {
            is(d, "held", "demand evidence is still collecting")
        })
        .await;
    assert_eq!(
        (held["prefill"].as_u64(), held["decode"].as_u64()),
        (Some(2), Some(2)),
        "{held:#}"
    );
    assert_eq!(held["evidence_blocked_gate"], "evidence");
    let work = held["prefill_work"].as_f64().unwrap_or(0.0);
    assert!(
        (0.8..1.25).contains(&work),
        "about 1.02 engines of prefill: {held:#}"
    );
    let first = r
        .decision_where("the first move", DECIDE, |d| d["result"] == "applied")
        .await;
    assert_eq!(first["by"], "reactive");
    assert_eq!(first["eligibility_rule"], "source_shrink");
    assert_eq!(first["required_confirmations"], 1);
    assert!(
        first["evidence_span_s"].as_f64().unwrap_or(0.0) >= 12.0,
        "{first:#}"
    );
    let s = r.state().await;
    assert_eq!(pools(&s, "prefill"), ["e0", "e1"], "e1 in config order");
    let second = r
        .decision_where("the second move", DECIDE, |d| {
            d["result"] == "applied" && d["at"] != first["at"]
        })
        .await;
    let confirmations: Vec<(Option<u64>, Option<u64>)> = r
        .decisions()
        .iter()
        .filter(|d| d["reason"] == "waiting for sustained demand")
        .map(|d| {
            (
                d["confirmations"].as_u64(),
                d["required_confirmations"].as_u64(),
            )
        })
        .collect();
    assert_eq!(
        confirmations,
        [(Some(1), Some(3)), (Some(2), Some(3))],
        "{second:#}"
    );
    r.decision_where("steady hold", DECIDE, |d| {
        is(
            d,
            "held",
            "projected improvement is below the movement margin",
        ) && d["eligibility_rule"] == "steady_demand"
    })
    .await;
    load.stop().await;
    let s = r.state().await;
    assert_eq!(pools(&s, "prefill"), ["e0", "e1", "e2"]);
    assert_eq!(s["control"]["flips"]["reactive:prefill"], 2);
    assert_eq!(s["control"]["flips_refused"], 0);
    let m = r.metrics().await;
    assert_eq!(
        metric(
            &m,
            "narwhal_flips_total",
            &["to=\"prefill\"", "by=\"reactive\""]
        ),
        Some(2.0)
    );
    assert_eq!(metric(&m, "narwhal_flips_refused_total", &[]), Some(0.0));
}

/// S12: predictive refusals price the queue and the prompt; open mode serves both.
///
/// The reference injected the three resident prefills; a router admitting predictively never
/// lets a 3.03 s backlog build against a 2 s budget (the second of them would price 2.02 s),
/// so here `admission_margin` 0.55 (budget 3.10 s) admits the backlog, and the section's
/// 100-token request then prices 3.14 s against 3.10 s (`Retry-After: 1`), a 3200-token one
/// 3.21 s of its own. `admission::tests` holds the section's exact numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s12_predictive_admission_refuses_what_cannot_make_its_ttft() {
    for mode in ["predictive", "open"] {
        let fleet = controller_fleet(&["prefill", "decode", "decode", "decode"])
            .fleet(json!({"serving": {"admission": mode, "admission_margin": 0.55}}))
            .start()
            .await;
        let r = fleet.router();
        // Three 1000-token prefills held on e0: a 3.03 s backlog.
        fleet
            .sim("e0")
            .fault(json!({"phase": "prefill", "action": "hang", "ms": 15000, "count": 3}))
            .await;
        let mut held = Vec::new();
        for _ in 0..3 {
            let (client, url) = (
                r.http.client().clone(),
                format!("{}/v1/completions", r.data),
            );
            held.push(tokio::spawn(async move {
                let body =
                    json!({"model": "tiny-sim", "prompt": token_prompt(1000), "max_tokens": 4});
                client
                    .post(url)
                    .json(&body)
                    .send()
                    .await
                    .map(|x| x.status().as_u16())
            }));
        }
        r.state_where("three prefills resident on e0", |s| {
            s["resident"]["e0"]["prefill"] == 3
        })
        .await;
        let small = json!({"model": "tiny-sim", "prompt": token_prompt(100), "max_tokens": 4});
        let big = json!({"model": "tiny-sim", "prompt": token_prompt(3200), "max_tokens": 4});
        let a = r.post_data("/v1/completions", &small).await;
        let b = r.post_data("/v1/completions", &big).await;
        let s = r.state().await;
        if mode == "open" {
            assert_eq!(
                (a.status.as_u16(), b.status.as_u16()),
                (200, 200),
                "open mode serves both"
            );
            let rows: Vec<Value> = r
                .journal_rows()
                .into_iter()
                .filter(|x| x["terminal"] == "completed")
                .collect();
            assert!(
                rows.iter()
                    .all(|x| x["admission_price"]["price_s"].as_f64().unwrap_or(0.0) > 2.0),
                "{rows:#?}"
            );
            // The 2nd and 3rd backlog prefills (2.02 s, 3.03 s) and both requests placed over
            // the 2 s TTFT (controller-notes 10.7).
            assert_eq!(s["unserved"], 4);
            continue;
        }
        assert_eq!(a.status, 429);
        assert_eq!(a.header("retry-after"), "1");
        assert_eq!(
            a.json()["error"],
            json!({"message": "cheapest placement prices TTFT at 3.14s against the 3.10s budget; retry as the priced queue drains",
                   "type": "server_overloaded_error"})
        );
        assert_eq!(b.status, 429);
        assert_eq!(
            b.header("retry-after"),
            "",
            "a prompt too long has no retry"
        );
        assert!(
            b.json()["error"]["message"]
                .as_str()
                .unwrap_or("")
                .starts_with(
                    "this prompt's own prefill prices TTFT at 3.21s against the 3.10s budget"
                )
        );
        let refused: Vec<Value> = r
            .journal_rows()
            .into_iter()
            .filter(|x| x["terminal"] == "refused")
            .collect();
        assert_eq!(refused.len(), 2);
        let q = &refused[0];
        assert_eq!(
            (
                q["reason"].as_str(),
                q["refused_cause"].as_str(),
                q["refused"].as_bool()
            ),
            (Some("queue"), Some("queue"), Some(true))
        );
        assert_eq!(q["status"], 429);
        assert_eq!(q["error_type"], "server_overloaded_error");
        let price = &q["admission_price"];
        assert_eq!(
            (
                price["attempt"].as_u64(),
                price["backlog_s"].as_f64(),
                price["own_prefill_s"].as_f64()
            ),
            (Some(1), Some(3.03), Some(0.11))
        );
        assert!(
            (price["price_s"].as_f64().unwrap_or(0.0) - 3.14).abs() < 0.01,
            "{price}"
        );
        assert_eq!(q["attempt_failures"].as_array().map(Vec::len), Some(1));
        assert_eq!(q["attempt_failures"][0]["retry_reason"], "not_dispatched");
        assert_eq!(refused[1]["refused_cause"], "prompt");
        // unserved: the 2nd and 3rd backlog placements and both refused ones.
        assert_eq!(
            (s["refused"].as_u64(), s["unserved"].as_u64()),
            (Some(2), Some(4))
        );
        assert_eq!(s["admission"]["mode"], "predictive");
        let m = r.metrics().await;
        assert_eq!(
            metric(&m, "narwhal_refused_total", &["cause=\"queue\""]),
            Some(1.0)
        );
        assert_eq!(
            metric(&m, "narwhal_refused_total", &["cause=\"prompt\""]),
            Some(1.0)
        );
        assert_eq!(metric(&m, "narwhal_unserved_total", &[]), Some(4.0));
        assert_eq!(
            metric(&m, "narwhal_admission_info", &["mode=\"predictive\""]),
            Some(1.0)
        );
        assert_eq!(
            metric(
                &m,
                "narwhal_attempt_failures_total",
                &["phase=\"prefill\"", "reason=\"queue\""]
            ),
            Some(1.0)
        );
        for h in held {
            h.abort();
        }
    }
}

/// Kills simulator `iid` and sends requests until the breaker ejects it (`eject_after` 1).
async fn kill_and_eject(fleet: &mut narwhal_testkit::Fleet, iid: &str) {
    fleet.sim_mut(iid).proc.kill();
    let r = fleet.router();
    let mut answers = Vec::new();
    for _ in 0..200 {
        let s = r.state().await;
        if s["ejected"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == iid))
        {
            return;
        }
        let body = json!({"model": "tiny-sim", "prompt": token_prompt(10), "max_tokens": 2});
        let a = r.post_data("/v1/completions", &body).await;
        answers.push(format!("{} {}", a.status, a.text()));
    }
    let tail: Vec<&String> = answers.iter().rev().take(5).collect();
    let s = r.state().await;
    panic!(
        "{iid} never ejected; last answers: {tail:#?}; pools {} resident {} ejected {}",
        s["pools"], s["resident"], s["ejected"]
    );
}

/// S2: moves to decode wait for the cooldown (counted from router start); then the fresh
/// p→d risk holds consolidation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_moves_to_decode_wait_for_the_cooldown() {
    let fleet = controller_fleet(&["prefill", "prefill", "prefill", "decode"])
        .fleet(json!({"controller": {"thresholds": {"cooldown_s": 6}}}))
        .start()
        .await;
    let r = fleet.router();
    let load = Load::start(r, L2);
    let blocked = r
        .decision_where("blocked by the cooldown", DECIDE, |d| {
            is(d, "blocked", "decode cooldown has not elapsed")
        })
        .await;
    let first = r
        .decision_where("e0 to decode", DECIDE, |d| d["result"] == "applied")
        .await;
    assert!(first["at"].as_f64() > blocked["at"].as_f64());
    assert_eq!(pools(&r.state().await, "decode"), ["e0", "e3"]);
    r.decision_where("blocked again after the move", DECIDE, |d| {
        is(d, "blocked", "decode cooldown has not elapsed")
            && d["at"].as_f64() > first["at"].as_f64()
    })
    .await;
    let second = r
        .decision_where("e1 to decode", DECIDE, |d| {
            d["result"] == "applied" && d["at"] != first["at"]
        })
        .await;
    let gap = second["at"].as_f64().unwrap_or(0.0) - first["at"].as_f64().unwrap_or(0.0);
    assert!(
        gap >= 5.9,
        "the cooldown counts from the last move to decode: {gap}"
    );
    let risk = r
        .decision_where("held on the p→d risk", DECIDE, |d| {
            is(d, "held", "p to d recovery")
        })
        .await;
    assert_eq!(risk["evidence_blocked_gate"], "risk", "{risk:#}");
    assert!(
        risk["reason"]
            .as_str()
            .unwrap_or("")
            .ends_with("s ago: re-collecting one evidence window")
    );
    load.stop().await;
    let s = r.state().await;
    assert_eq!(pools(&s, "prefill"), ["e2"], "no third move");
    assert_eq!(s["demand_evidence"]["risk_events"]["p_to_d_recovery"], 2);
    let refused = s["flips_refused"].as_array().cloned().unwrap_or_default();
    assert!(
        !refused.is_empty() && refused.iter().all(|x| x["to"] == "decode"),
        "{refused:?}"
    );
}

/// S3: a first-token timeout re-arms the evidence window; the handoff carries the risk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_a_first_token_timeout_rearms_the_evidence_window() {
    let fleet = controller_fleet(&["prefill", "decode", "decode", "decode"])
        .fleet(json!({"engine": {"first_token_timeout_s": 1.0}}))
        .start()
        .await;
    let r = fleet.router();
    let load = Load::start(r, L1);
    r.decision_where("an early evidence hold", DECIDE, |d| {
        is(d, "held", "demand evidence is still collecting")
    })
    .await;
    // One decode leg misses its first-token deadline (its retry lands elsewhere).
    fleet
        .sim("e2")
        .fault(json!({"phase": "decode", "action": "hang", "ms": 3000}))
        .await;
    let s = r
        .state_where("a first-token timeout risk", |s| {
            s["demand_evidence"]["risk_kind"] == "first_token_timeout"
        })
        .await;
    let risk_wall = s["control"]["last_decision"]["at"].as_f64().unwrap_or(0.0)
        - s["demand_evidence"]["risk_age_s"].as_f64().unwrap_or(0.0);
    let held = r
        .decision_where("held on the timeout risk", DECIDE, |d| {
            is(d, "held", "first token timeout")
        })
        .await;
    assert_eq!(held["evidence_blocked_gate"], "risk");
    assert!(
        held["reason"]
            .as_str()
            .unwrap_or("")
            .ends_with(" s ago: re-collecting one evidence window"),
        "{held:#}"
    );
    let m = r.metrics().await;
    assert_eq!(
        metric(&m, "narwhal_demand_evidence_refused", &["gate=\"risk\""]),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "narwhal_demand_evidence_risk_events_total",
            &["kind=\"first_token_timeout\""]
        ),
        Some(1.0)
    );
    let handoff = r.handoff().await;
    assert_eq!(
        handoff["demand_risk"]["kind"], "first_token_timeout",
        "{handoff:#}"
    );
    let moved = r
        .decision_where(
            "the move after a new window",
            Duration::from_secs(60),
            |d| d["result"] == "applied",
        )
        .await;
    let after = moved["at"].as_f64().unwrap_or(0.0) - risk_wall;
    assert!(
        after >= 11.5,
        "the move comes a full evidence span after the event: {after}"
    );
    assert!(
        moved["evidence_span_s"].as_f64().unwrap_or(0.0) >= 12.0,
        "{moved:#}"
    );
    load.stop().await;
}

/// S4: the decode floor is restored from the lightest prefill engine; then the last
/// prefill engine is kept, every pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_the_decode_floor_is_restored_then_the_last_prefill_engine_kept() {
    let mut fleet = controller_fleet(&["prefill", "prefill", "decode", "decode"])
        .fleet(json!({"controller": {"min_decode": 2}, "recovery": {"eject_after": 1}}))
        .start()
        .await;
    // Three prefills held on the two prefill engines: p2c spreads them 2/1, and the floor
    // restoration must take the engine holding less resident prefill.
    for iid in ["e0", "e1"] {
        fleet
            .sim(iid)
            .fault(json!({"phase": "prefill", "action": "hang", "ms": 60000, "count": 3}))
            .await;
    }
    let mut held = Vec::new();
    let resident = {
        let r = fleet.router();
        for _ in 0..3 {
            let (client, url) = (
                r.http.client().clone(),
                format!("{}/v1/completions", r.data),
            );
            held.push(tokio::spawn(async move {
                let body =
                    json!({"model": "tiny-sim", "prompt": token_prompt(200), "max_tokens": 2});
                let _ = client.post(url).json(&body).send().await;
            }));
        }
        let s = r
            .state_where("three resident prefills", |s| {
                let n = |i: &str| s["resident"][i]["prefill"].as_u64().unwrap_or(0);
                n("e0") + n("e1") == 3
            })
            .await;
        s["resident"].clone()
    };
    for iid in ["e0", "e1"] {
        fleet.sim(iid).clear_faults().await;
    }
    let lighter = if resident["e0"]["prefill"].as_u64() < resident["e1"]["prefill"].as_u64() {
        "e0"
    } else {
        "e1"
    };
    // The held requests reserved decode engines too; placement avoids the busier one, so
    // the decode engine killed first is the less reserved (the scenario's "e2").
    let res = |i: &str| resident[i]["decode"].as_u64().unwrap_or(0);
    let (first, second) = if res("e2") <= res("e3") {
        ("e2", "e3")
    } else {
        ("e3", "e2")
    };
    kill_and_eject(&mut fleet, first).await;
    let r = fleet.router();
    let d = r
        .decision_where("the decode floor restored", DECIDE, |d| {
            d["by"] == "decode_floor" && d["result"] == "applied"
        })
        .await;
    assert_eq!(d["reason"], "restore min_decode");
    assert_eq!(
        (d["prefill"].as_u64(), d["decode"].as_u64()),
        (Some(1), Some(3))
    );
    assert!(
        d.get("objective").is_none(),
        "floor flips carry no details: {d:#}"
    );
    let ev = r.events("decode_floor_restored");
    assert_eq!(
        ev[0]["iid"], lighter,
        "the engine holding less resident prefill: {resident}"
    );
    assert_eq!(
        (ev[0]["live_decode"].as_u64(), ev[0]["min_decode"].as_u64()),
        (Some(2), Some(2))
    );
    let s = r.state().await;
    assert_eq!(s["decode_floor"]["restoration_moves"], 1);
    assert_eq!(s["demand_evidence"]["risk_kind"], "p_to_d_recovery");
    // The held requests go, so traffic reaches the second decode engine to be killed.
    for h in held.drain(..) {
        h.abort();
    }
    r.state_where("no resident prefill", |s| {
        ["e0", "e1"]
            .iter()
            .all(|i| s["resident"][*i]["prefill"] == 0)
    })
    .await;
    kill_and_eject(&mut fleet, second).await;
    let r = fleet.router();
    let last = r
        .decision_where("the last prefill engine kept", DECIDE, |d| {
            d["by"] == "decode_floor"
                && is(d, "blocked", "prefill floor keeps the last live engine")
        })
        .await;
    assert_eq!(
        (last["prefill"].as_u64(), last["decode"].as_u64()),
        (Some(0), Some(4))
    );
    let count = |r: &narwhal_testkit::RouterHandle| {
        r.decisions()
            .iter()
            .filter(|d| d["reason"] == "prefill floor keeps the last live engine")
            .count()
    };
    let n = count(r);
    narwhal_testkit::eventually("a refusal every pass", Duration::from_secs(10), || async {
        (count(r) >= n + 3).then_some(())
    })
    .await;
    let since = last["at"].as_f64().unwrap_or(0.0);
    assert!(
        r.decisions()
            .iter()
            .all(|d| d["by"] != "reactive" || d["at"].as_f64().unwrap_or(0.0) < since),
        "no reactive step while below the decode floor"
    );
    assert_eq!(
        metric(&r.metrics().await, "narwhal_decode_below_floor", &[]),
        Some(1.0)
    );
}

/// S5: the prefill floor is recovered at once, without cooldown, dwell, evidence or risk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_the_prefill_floor_is_recovered_at_once() {
    let mut fleet = controller_fleet(&["prefill", "decode", "decode", "decode"])
        .fleet(
            json!({"recovery": {"eject_after": 1}, "controller": {"thresholds": {"dwell_s": 100}}}),
        )
        .start()
        .await;
    kill_and_eject(&mut fleet, "e0").await;
    let r = fleet.router();
    let d = r
        .decision_where("floor recovery", DECIDE, |d| d["by"] == "floor_recovery")
        .await;
    assert_eq!(
        (d["result"].as_str(), d["reason"].as_str()),
        (Some("applied"), Some("restore min_prefill"))
    );
    assert_eq!(
        (d["prefill"].as_u64(), d["decode"].as_u64()),
        (Some(2), Some(2)),
        "counts include the ejected e0"
    );
    let below = r.events("below_floor");
    assert_eq!(below.len(), 1);
    assert_eq!(
        (
            below[0]["live_prefill"].as_u64(),
            below[0]["min_prefill"].as_u64()
        ),
        (Some(0), Some(1))
    );
    assert_eq!(below[0]["ejected"], json!(["e0"]));
    assert_eq!(below[0]["quarantined"], json!([]));
    let rec = r.events("below_floor_recovered");
    assert_eq!(rec.len(), 1);
    assert!(
        rec[0]["duration_s"].as_f64().unwrap_or(9.0) < 2.0,
        "{:?}",
        rec[0]
    );
    let s = r.state().await;
    assert_eq!(pools(&s, "prefill"), ["e0", "e1"]);
    assert_eq!(s["below_floor"]["breaches"], 1);
    assert_eq!(
        s["demand_evidence"]["risk_kind"],
        Value::Null,
        "no risk event"
    );
}

/// S6: no donor: the fleet-health hold; vLLM serves prefill on decode engines meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_without_a_donor_the_fleet_health_hold_applies() {
    let mut fleet = controller_fleet(&["prefill", "decode", "decode"])
        .fleet(json!({"controller": {"min_decode": 2}, "recovery": {"eject_after": 1}}))
        .start()
        .await;
    kill_and_eject(&mut fleet, "e0").await;
    let r = fleet.router();
    let load = Load::start(r, L1);
    let d = r
        .decision_where("the health hold", DECIDE, |d| {
            is(d, "held", "fleet health is changing")
        })
        .await;
    assert_eq!(
        (d["prefill"].as_u64(), d["decode"].as_u64()),
        (Some(1), Some(2))
    );
    let stats = load.stop().await;
    assert!(
        stats.ok.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "completions still succeed"
    );
    let s = r.state().await;
    assert_eq!(r.events("below_floor").len(), 1);
    assert_eq!(s["control"]["flips_refused"], 0);
    assert_eq!(pools(&s, "prefill"), ["e0"]);
    let agg: u64 = [fleet.sim("e1"), fleet.sim("e2")]
        .iter()
        .map(|x| x.proc.pid())
        .count() as u64;
    assert_eq!(agg, 2);
    let served_aggregated = fleet.sim("e1").stats().await["requests"]["aggregated"]
        .as_u64()
        .unwrap_or(0)
        + fleet.sim("e2").stats().await["requests"]["aggregated"]
            .as_u64()
            .unwrap_or(0);
    assert!(served_aggregated > 0, "prefill legs ran on e1/e2");
}

/// S7: advisory mode runs every guard and never moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s7_advisory_mode_decides_without_moving() {
    let fleet = controller_fleet(&["prefill", "decode", "decode", "decode"])
        .fleet(json!({"controller": {"advisory": true}}))
        .start()
        .await;
    let r = fleet.router();
    let load = Load::start(r, L1);
    let first = r
        .decision_where("an advisory decision", DECIDE, |d| {
            d["result"] == "advisory"
        })
        .await;
    assert_eq!(first["reason"], "post-move objective improved");
    r.decision_where("a second advisory decision", DECIDE, |d| {
        d["result"] == "advisory" && d["at"] != first["at"]
    })
    .await;
    load.stop().await;
    let s = r.state().await;
    assert_eq!(pools(&s, "prefill"), ["e0"], "roles never change");
    assert!(
        s["flips_refused"]
            .as_array()
            .is_some_and(|a| a.iter().all(|x| x["why"] == "advisory mode"))
    );
    let m = r.metrics().await;
    assert_eq!(metric(&m, "narwhal_controller_advisory", &[]), Some(1.0));
    assert!(
        metric(
            &m,
            "narwhal_controller_decisions_total",
            &["result=\"advisory\""]
        )
        .unwrap_or(0.0)
            >= 2.0
    );
    for (to, by) in [
        ("prefill", "reactive"),
        ("decode", "reactive"),
        ("decode", "decode_floor"),
        ("prefill", "floor_recovery"),
    ] {
        let to_l = format!("to=\"{to}\"");
        let by_l = format!("by=\"{by}\"");
        assert_eq!(
            metric(&m, "narwhal_flips_total", &[&to_l, &by_l]),
            Some(0.0)
        );
    }
}

/// S8: pinned decode engines, and the decode-resident guard, refuse the donor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s8_pins_and_the_resident_guard_refuse_the_donor() {
    let fleet = controller_fleet(&["prefill", "decode", "decode", "decode"])
        .pin(&["e1", "e2", "e3"])
        .start()
        .await;
    let r = fleet.router();
    let load = Load::start(r, L1);
    r.decision_where("blocked by pins", DECIDE, |d| {
        is(
            d,
            "blocked",
            "pins or nominated engine exclude every source candidate",
        )
    })
    .await;
    load.stop().await;
    drop(fleet);

    let fleet = controller_fleet(&["prefill", "decode", "decode", "decode"])
        .sim_args(&["--tpot-ms", "10"])
        .fleet(json!({"controller": {"thresholds": {"flip_resident_guard": 2}}}))
        .start()
        .await;
    let r = fleet.router();
    let mut streams = Vec::new();
    let mut per: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    while ["e1", "e2", "e3"]
        .iter()
        .any(|i| per.get(*i).copied().unwrap_or(0) < 3)
    {
        let (s, iid) = r.hold_stream(20, 4000).await;
        *per.entry(iid).or_default() += 1;
        streams.push(s);
        assert!(streams.len() < 20, "p2c spreads streams: {per:?}");
    }
    let lightest = per.values().min().copied().unwrap_or(0);
    let load = Load::start(r, L1);
    let d = r
        .decision_where("blocked by the resident guard", DECIDE, |d| {
            is(d, "blocked", "lightest decode donor carries")
        })
        .await;
    assert!(
        d["reason"]
            .as_str()
            .unwrap_or("")
            .ends_with("residents, above flip_resident_guard 2"),
        "{d:#}"
    );
    assert!(lightest >= 3);
    load.stop().await;
}

/// S9: no adjacent split (1P1D); demand below the floor (1P3D at 1 req/s of 200 tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s9_no_adjacent_split_and_too_little_demand_hold() {
    let fleet = controller_fleet(&["prefill", "decode"]).start().await;
    let r = fleet.router();
    let load = Load::start(r, L1);
    r.decision_where("held on the margin", DECIDE, |d| {
        is(
            d,
            "held",
            "projected improvement is below the movement margin",
        )
    })
    .await;
    tokio::time::sleep(Duration::from_secs(14)).await;
    load.stop().await;
    let reasons: std::collections::BTreeSet<String> = r
        .decisions()
        .iter()
        .filter_map(|d| d["reason"].as_str().map(String::from))
        .collect();
    assert!(
        reasons.iter().all(
            |x| x == "projected improvement is below the movement margin"
                || x == "insufficient demand history"
        ),
        "{reasons:?}"
    );
    drop(fleet);
    let fleet = controller_fleet(&["prefill", "decode", "decode", "decode"])
        .start()
        .await;
    let r = fleet.router();
    let load = Load::start(r, Shape::new(1.0, 200, Some(50)));
    tokio::time::sleep(Duration::from_secs(16)).await;
    load.stop().await;
    let ds = r.decisions();
    assert!(ds.len() >= 10);
    assert!(
        ds.iter()
            .all(|d| d["reason"] == "insufficient demand history"),
        "{ds:#?}"
    );
}
