//! The HA fault campaign (docs/testing.md) as code: one run starts a fresh fleet (2 prefill, 2
//! decode, one agent per engine, a file lease of [`LEASE_TTL_S`], a primary and a warm
//! standby), keeps traffic flowing, samples both routers at 20 Hz, performs a lifecycle
//! action, and hits the primary with `kill -9` or a `SIGSTOP` at a chosen point of it. Then
//! it checks what an operator relies on:
//!
//! - no acknowledged action lost: an action answered 200 holds on whichever router controls
//!   the fleet at the end (a drained engine stays out of placement and gets no traffic, a
//!   readmitted one is back);
//! - never two routers reporting `controls_fleet: active` in one sample;
//! - a controller within TTL + 1 s of the fault ending (the kill, or the `SIGCONT`);
//! - totals (`served`) read from the router that controls the fleet never go backwards;
//! - no `ready_to_stop: true` from a router that does not control the fleet.
//!
//! ```text
//!  Scenario { when: Timing, fault: Fault, delay }
//!     run(): Fleet ─► traffic + Sampler (20 Hz, /narwhal/state of both) ─► action ─► fault
//!            ─► settle ─► checks ─► Outcome { violations, takeover, ... }
//!  campaign(runs, seed, parallel): random scenarios, `parallel` fleets at a time
//! ```
//!
//! Used by `tests/tests/ha_faults_e2e.rs` (named scenarios and 20 randomized runs in CI) and
//! by `narwhal-faults --runs N` (the campaign by hand).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use narwhal_shared::handoff::DrainState;
use nix::sys::signal::Signal;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::fleet::{Fleet, LEASE_TTL_S, LeaseBackend};
use crate::http::Http;
use crate::router::{RouterHandle, RouterProbe};
use crate::sampler::{Sample, Sampler};

/// When the fault hits the primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// Right after `drain p1` was answered 200.
    AfterDrainAck,
    /// Right after `readmit p1` (a restarted p1) was answered 200.
    AfterReadmitAck,
    /// While the readmission of a restarted p1 is being validated.
    DuringValidation,
    /// Right after a whole-fleet wave drain was answered 200 (`whole_wave` policy).
    AfterWaveDrainAck,
    /// While the whole wave's readmission is being validated (every engine restarted).
    DuringWaveReadmit,
}

impl Timing {
    /// Every timing, in the order a campaign cycles through them.
    pub const ALL: [Timing; 5] = [
        Timing::AfterDrainAck,
        Timing::AfterReadmitAck,
        Timing::DuringValidation,
        Timing::AfterWaveDrainAck,
        Timing::DuringWaveReadmit,
    ];

    fn wave(self) -> bool {
        matches!(self, Timing::AfterWaveDrainAck | Timing::DuringWaveReadmit)
    }

    fn during(self) -> bool {
        matches!(self, Timing::DuringValidation | Timing::DuringWaveReadmit)
    }
}

/// What hits the primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9`.
    Kill,
    /// `SIGSTOP`, then `SIGCONT` after this long.
    Pause(Duration),
    /// `SIGSTOP` of the primary for the first duration and, at the same moment, of the
    /// standby for the second (a standby slower to notice than the primary is to come back:
    /// the campaign's fleet without a controller).
    PauseBoth(Duration, Duration),
}

/// One run: when, what, and how long after the trigger (the 200, or the readmission
/// request) the fault lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scenario {
    /// When.
    pub when: Timing,
    /// What.
    pub fault: Fault,
    /// Delay between the trigger and the fault.
    pub delay: Duration,
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fault = match self.fault {
            Fault::Kill => "kill -9".to_string(),
            Fault::Pause(d) => format!("SIGSTOP {:.2} s", d.as_secs_f64()),
            Fault::PauseBoth(p, s) => format!(
                "SIGSTOP {:.2} s (standby {:.2} s)",
                p.as_secs_f64(),
                s.as_secs_f64()
            ),
        };
        write!(f, "{fault} {:?} +{} ms", self.when, self.delay.as_millis())
    }
}

impl Scenario {
    /// A random scenario of timing `when`: kill or pause (2-6 s; during a validation just
    /// past the TTL, sometimes with the standby stopped 0.5-1.5 s longer), landing 0-150 ms
    /// after an acknowledgement or 50-900 ms into a validation.
    pub fn random(when: Timing, rng: &mut impl Rng) -> Scenario {
        let ttl = Duration::from_secs_f64(LEASE_TTL_S);
        let fault = match rng.random_range(0..3) {
            0 => Fault::Kill,
            1 if when.during() => {
                let p = ttl + Duration::from_millis(rng.random_range(10..300));
                Fault::PauseBoth(p, p + Duration::from_millis(rng.random_range(500..1500)))
            }
            _ if when.during() => {
                Fault::Pause(ttl + Duration::from_millis(rng.random_range(10..300)))
            }
            _ => Fault::Pause(Duration::from_millis(rng.random_range(2000..6000))),
        };
        let delay = if when.during() {
            Duration::from_millis(rng.random_range(50..900))
        } else {
            Duration::from_millis(rng.random_range(0..150))
        };
        Scenario { when, fault, delay }
    }
}

/// What one router showed in one sample (`/narwhal/state`).
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    /// `lifecycle.router.controls_fleet`.
    pub controls: String,
    /// `served`.
    pub served: u64,
    /// Some `ready_to_stop` (an engine's or the wave's) was true.
    pub ready_to_stop: bool,
}

/// The two routers (primary, standby) in one sample; `None` when one did not answer.
pub type Pair = [Option<Seen>; 2];

/// An action answered 200 and what it promised.
#[derive(Debug, Clone, PartialEq)]
pub enum Acked {
    /// These engines are held out of placement.
    Held(Vec<String>),
    /// These engines are back in placement.
    Active(Vec<String>),
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The scenario.
    pub scenario: Scenario,
    /// Everything that broke a rule (empty: the run passed).
    pub violations: Vec<String>,
    /// Seconds from the fault's end to the first sample with a controller.
    pub controller_after_s: Option<f64>,
    /// Samples taken.
    pub samples: usize,
    /// Actions acknowledged, the last one first.
    pub acked: Vec<Acked>,
    /// The readmission running at the fault: its HTTP status (`None`: no answer).
    pub interrupted: Option<Option<u16>>,
}

/// Reads `/narwhal/state` of one router for a sample.
async fn seen(probe: &RouterProbe) -> Option<Seen> {
    let v = probe.state().await?;
    let lc = &v.lifecycle;
    let stop = lc.wave.ready_to_stop || lc.engines.values().any(|e| e.ready_to_stop);
    Some(Seen {
        controls: Some(lc.router.controls_fleet.clone()).filter(|c| !c.is_empty())?,
        served: v.served,
        ready_to_stop: stop,
    })
}

fn active(s: &Option<Seen>) -> bool {
    s.as_ref().is_some_and(|s| s.controls == "active")
}

/// The sample rules: never two active; served never backwards on the active router; no
/// `ready_to_stop` from one that is not active. `fault_end` (time since the sampler started)
/// gives the controller delay.
pub fn judge_samples(samples: &[Sample<Pair>], fault_end: Duration) -> (Vec<String>, Option<f64>) {
    let mut v = Vec::new();
    let mut high: Option<(u64, Duration)> = None;
    for s in samples {
        if s.value.iter().all(active) {
            v.push(format!("both routers active at {:?}", s.at));
        }
        for (k, r) in s.value.iter().enumerate() {
            let Some(r) = r else { continue };
            if r.controls != "active" && r.ready_to_stop {
                v.push(format!(
                    "router {k} ({}) reported ready_to_stop at {:?}",
                    r.controls, s.at
                ));
            }
            if r.controls == "active" {
                if let Some((h, at)) = high
                    && r.served < h
                {
                    v.push(format!(
                        "served went back from {h} (at {at:?}) to {} (router {k} at {:?})",
                        r.served, s.at
                    ));
                }
                if high.is_none_or(|(h, _)| r.served > h) {
                    high = Some((r.served, s.at));
                }
            }
        }
    }
    let after = samples
        .iter()
        .find(|s| s.at >= fault_end && s.value.iter().any(active))
        .map(|s| (s.at - fault_end).as_secs_f64());
    (v, after)
}

/// Sends completions to both routers in turn until stopped (failures are expected while the
/// routers change places).
fn traffic(
    p: &RouterHandle,
    s: &RouterHandle,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let urls = [p.data.clone(), s.data.clone()];
    let http = Http::new(Duration::from_secs(3));
    tokio::spawn(async move {
        let body = json!({"model": "tiny-sim", "prompt": "fault campaign", "max_tokens": 2});
        let mut k = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let url = format!("{}/v1/completions", urls[k % 2]);
            k += 1;
            let r = http.client().post(url).json(&body).send().await;
            if r.is_err() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    })
}

/// `POST <control>/narwhal/lifecycle/<action>` from a background task: its status, or
/// `None` when the router never answered.
fn post_in_background(
    r: &RouterHandle,
    action: &str,
    body: Value,
) -> tokio::task::JoinHandle<Option<u16>> {
    let url = format!("{}/narwhal/lifecycle/{action}", r.control);
    let http = r.http.clone();
    tokio::spawn(async move {
        let resp = http.client().post(url).json(&body).send().await.ok()?;
        Some(resp.status().as_u16())
    })
}

/// A fresh fleet for `when`: 2 prefill, 2 decode, one agent each, a file lease, a standby;
/// engines answer after 100 ms, 300 ms when a validation is to be hit (it then lasts over a
/// second, as on a real fleet, so it outlives a router coming back), and wave scenarios run
/// under `whole_wave`.
async fn fleet(when: Timing) -> Fleet {
    let ttft = if when.during() { "300" } else { "100" };
    let mut b = Fleet::builder()
        .prefill(2)
        .decode(2)
        .agents()
        .sim_args(&["--ttft-ms", ttft])
        .lease(LeaseBackend::File)
        .standby();
    if when.wave() {
        b = b.restart_policy("whole_wave");
    }
    b.start().await
}

/// Runs one scenario on a fresh fleet and judges it.
///
/// # Panics
/// When the fleet cannot be set up or an action before the fault is not answered 200 (the
/// scenario could not be staged: that is a broken test, not a finding).
pub async fn run(scenario: Scenario) -> Outcome {
    let when = scenario.when;
    let mut f = fleet(when).await;
    let mut p = f.router.take().expect("primary");
    let s = f.standby.take().expect("standby");
    let ha = p.ha().await;
    let (epoch, holder) = (ha.epoch, ha.holder);
    f.wait_retained("standby", epoch, &holder, |_| true).await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(&p, &s, stop.clone());
    let (pp, sp) = (p.probe(), s.probe());
    let sampler = Sampler::start(Duration::from_millis(50), move || {
        let (pp, sp) = (pp.clone(), sp.clone());
        async move {
            let (a, b) = tokio::join!(seen(&pp), seen(&sp));
            [a, b]
        }
    });
    let t0 = Instant::now();
    let mut acked: Vec<Acked> = Vec::new();
    let all: Vec<String> = f.sims.iter().map(|x| x.iid.clone()).collect();
    let p1 = vec!["p1".to_string()];
    // Stage the action; `pending` is a readmission the fault will interrupt.
    let ack = |what: &str, status: u16, doc: &serde_json::Value| {
        assert_eq!(status, 200, "{scenario}: {what} before the fault: {doc:#?}");
    };
    let mut pending = None;
    if when.wave() {
        let (st, doc) = p.drain(&json!({"wave": true, "deadline_s": 60})).await;
        ack("wave drain", st, &doc);
        acked.push(Acked::Held(all.clone()));
        if when == Timing::DuringWaveReadmit {
            p.lifecycle_until("the wave ready to stop", |d| d.wave.ready_to_stop)
                .await;
            for sim in &mut f.sims {
                sim.restart(&[]).expect("restart simulator");
            }
            pending = Some(post_in_background(&p, "readmit", json!({"wave": true})));
        }
    } else {
        let (st, doc) = p.drain(&json!({"engines": p1, "deadline_s": 60})).await;
        ack("drain p1", st, &doc);
        acked.push(Acked::Held(p1.clone()));
        if when != Timing::AfterDrainAck {
            p.lifecycle_until("p1 drained", |d| {
                d.engine("p1")
                    .is_some_and(|e| e.state == DrainState::Drained)
            })
            .await;
            f.sim_mut("p1").restart(&[]).expect("restart p1");
            if when == Timing::AfterReadmitAck {
                let (st, doc) = p.readmit(&json!({"engines": p1})).await;
                ack("readmit p1", st, &doc);
                acked.push(Acked::Active(p1.clone()));
            } else {
                pending = Some(post_in_background(&p, "readmit", json!({"engines": p1})));
            }
        }
    }
    acked.reverse();
    tokio::time::sleep(scenario.delay).await;
    // The fault.
    let fault_end = match scenario.fault {
        Fault::Kill => {
            p.proc.kill();
            t0.elapsed()
        }
        Fault::Pause(d) => {
            p.proc.signal(Signal::SIGSTOP);
            tokio::time::sleep(d).await; // the fault itself, not a synchronisation
            p.proc.signal(Signal::SIGCONT);
            t0.elapsed()
        }
        Fault::PauseBoth(dp, ds) => {
            p.proc.signal(Signal::SIGSTOP);
            s.proc.signal(Signal::SIGSTOP);
            tokio::time::sleep(dp.min(ds)).await; // the fault itself
            let (first, second) = if dp <= ds { (&p, &s) } else { (&s, &p) };
            first.proc.signal(Signal::SIGCONT);
            tokio::time::sleep(dp.max(ds) - dp.min(ds)).await;
            second.proc.signal(Signal::SIGCONT);
            t0.elapsed()
        }
    };
    let interrupted = match pending {
        Some(h) => Some(h.await.unwrap_or(None)),
        None => None,
    };
    if interrupted == Some(Some(200)) {
        let engines = if when.wave() { all.clone() } else { p1.clone() };
        acked.insert(0, Acked::Active(engines));
    }
    let mut violations = Vec::new();
    // Settle: one router controls the fleet (bounded well past the rule's TTL + 1 s, which
    // the samples judge).
    let routers = [&p, &s];
    let mut controller = None;
    for _ in 0..200 {
        for (k, r) in routers.iter().enumerate() {
            if r.probe().controls().await.as_deref() == Some("active") {
                controller = Some(k);
            }
        }
        if controller.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A second of samples after the settle.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let _ = load.await;
    let samples = sampler.stop().await;
    let (mut sample_violations, controller_after_s) = judge_samples(&samples, fault_end);
    violations.append(&mut sample_violations);
    let limit = LEASE_TTL_S + 1.0;
    match controller_after_s {
        Some(d) if d <= limit => {}
        Some(d) => violations.push(format!(
            "a controller only {d:.3} s after the fault ended (limit {limit} s)"
        )),
        None => violations.push("no controller sampled after the fault".into()),
    }
    match controller {
        None => violations.push("no router controls the fleet at the end".into()),
        Some(k) => check_acked(routers[k], &f, &acked, &mut violations).await,
    }
    Outcome {
        scenario,
        violations,
        controller_after_s,
        samples: samples.len(),
        acked,
        interrupted,
    }
}

/// The newest acknowledged promise per engine holds on the controller `c`; engines held out
/// get no traffic from it.
async fn check_acked(c: &RouterHandle, f: &Fleet, acked: &[Acked], v: &mut Vec<String>) {
    let lc = c.lifecycle().await;
    let mut seen_iids = std::collections::BTreeSet::new();
    let mut held = Vec::new();
    for a in acked {
        let (iids, want_held) = match a {
            Acked::Held(i) => (i, true),
            Acked::Active(i) => (i, false),
        };
        for iid in iids {
            if !seen_iids.insert(iid.clone()) {
                continue; // a newer acknowledged action decided this engine
            }
            let e = lc.engine(iid).cloned().unwrap_or_default();
            let state = e.state.as_str();
            if want_held {
                // Held out of placement (draining, drained, validating, blocked, ...) with its
                // pre-restart process start recorded, until a validated readmission.
                held.push(iid.clone());
                if e.state == DrainState::Active || e.accepts_new || e.old_process_start.is_none() {
                    v.push(format!(
                        "acknowledged drain of {iid} lost: {state}, accepts_new {}, \
                         old_process_start {:?}",
                        e.accepts_new, e.old_process_start
                    ));
                }
            } else if e.state != DrainState::Active {
                v.push(format!("acknowledged readmission of {iid} lost: {state}"));
            }
        }
    }
    let requests = |st: &Value| {
        ["prefill", "decode", "aggregated"]
            .iter()
            .map(|k| st["requests"][k].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    let mut before = Vec::new();
    for iid in &held {
        before.push(requests(&f.sim(iid).stats().await));
    }
    for k in 0..6 {
        let _ = c.completion(&format!("after the fault {k}"), 2).await;
    }
    for (iid, b) in held.iter().zip(before) {
        let after = requests(&f.sim(iid).stats().await);
        if after != b {
            v.push(format!(
                "{iid} was drained (acknowledged) but got {} requests",
                after - b
            ));
        }
    }
}

/// Runs `runs` random scenarios (timings in turn, from `seed`), `parallel` fleets at a
/// time; outcomes in run order.
pub async fn campaign(runs: usize, seed: u64, parallel: usize) -> Vec<Outcome> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let scenarios: Vec<Scenario> = (0..runs)
        .map(|k| Scenario::random(Timing::ALL[k % Timing::ALL.len()], &mut rng))
        .collect();
    let mut out = Vec::new();
    for chunk in scenarios.chunks(parallel.max(1)) {
        let handles: Vec<_> = chunk.iter().map(|s| tokio::spawn(run(*s))).collect();
        for (h, s) in handles.into_iter().zip(chunk) {
            match h.await {
                Ok(o) => {
                    eprintln!(
                        "[faults] {} -> {} (controller after {:?} s, {} samples, readmit {:?})",
                        o.scenario,
                        if o.violations.is_empty() {
                            "ok".to_string()
                        } else {
                            format!("{:?}", o.violations)
                        },
                        o.controller_after_s.map(|d| (d * 1000.0).round() / 1000.0),
                        o.samples,
                        o.interrupted
                    );
                    out.push(o);
                }
                Err(e) => out.push(Outcome {
                    scenario: *s,
                    violations: vec![format!("the run panicked: {e}")],
                    controller_after_s: None,
                    samples: 0,
                    acked: Vec::new(),
                    interrupted: None,
                }),
            }
        }
    }
    out
}

/// A summary of a campaign: runs and passes per timing and fault kind, the violations, and
/// the controller delays.
pub fn summary(outcomes: &[Outcome]) -> String {
    use std::collections::BTreeMap;
    let mut by: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for o in outcomes {
        let kind = match o.scenario.fault {
            Fault::Kill => "kill",
            Fault::Pause(_) => "pause",
            Fault::PauseBoth(..) => "pause both",
        };
        let e = by
            .entry(format!("{:?} {kind}", o.scenario.when))
            .or_default();
        e.0 += 1;
        e.1 += usize::from(o.violations.is_empty());
    }
    let mut delays: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.controller_after_s)
        .collect();
    delays.sort_by(f64::total_cmp);
    let passed = outcomes.iter().filter(|o| o.violations.is_empty()).count();
    let mut text = format!("{passed} of {} runs passed\n", outcomes.len());
    for (k, (n, ok)) in by {
        text.push_str(&format!("  {k}: {ok}/{n}\n"));
    }
    if let (Some(med), Some(max)) = (delays.get(delays.len() / 2), delays.last()) {
        text.push_str(&format!(
            "  controller after the fault ended: median {med:.3} s, max {max:.3} s\n"
        ));
    }
    for o in outcomes.iter().filter(|o| !o.violations.is_empty()) {
        text.push_str(&format!("  FAILED {}: {:?}\n", o.scenario, o.violations));
    }
    text
}
