//! What the role-controller scenarios of docs/design/controller.md section 14 share, beyond
//! [`crate::controller_fleet`]: the section's loads, a controller world started under load,
//! waiting for a decision by its result and reason, bursts of requests, and ejecting an engine.
//!
//! ```text
//!  let (fleet, load) = controller_fleet(&ONE_P_THREE_D).start_loaded(L1).await;
//!  let r = fleet.router();
//!  let held = r.decision_is("the evidence hold", "held", "demand evidence is still collecting").await;
//!  let moved = r.applied("the first move", DECIDE).await;
//!  let queued = r.burst(6, 1000, 2);           // (status, x-request-id) per request
//!  fleet.kill_and_eject("e2").await;           // eject_after 1
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use narwhal_shared::documents::state::Pools;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::controller::{Load, RowHead, Shape, token_prompt, unique_token_prompt};
use crate::fleet::{Fleet, FleetBuilder};
use crate::router::RouterHandle;

/// Prompts [`RouterHandle::burst`] has sent (numbers them apart from a [`Load`]'s, which
/// count from 0).
static BURST_PROMPTS: AtomicU64 = AtomicU64::new(20_000);

/// L1 of section 14: 2 req/s of 500-token prompts with `max_tokens` 50.
pub const L1: Shape = Shape::new(2.0, 500, Some(50));

/// L2 of section 14: 3 req/s of 100-token prompts with `max_tokens` 4000.
pub const L2: Shape = Shape::new(3.0, 100, Some(4000));

/// How long a scenario waits for a decision it expects (the fast timings are 12–20 s, on a
/// loaded 2-core machine).
pub const DECIDE: Duration = Duration::from_secs(40);

/// The roles of the section's usual world, 1P3D: `e0` prefill, `e1`..`e3` decode.
pub const ONE_P_THREE_D: [&str; 4] = ["prefill", "decode", "decode", "decode"];

/// Whether decision `d` has `result` (`applied`, `held`, `blocked`, `advisory`) and a reason
/// starting with `reason`.
pub fn decided(d: &Value, result: &str, reason: &str) -> bool {
    let head = RowHead::of(d);
    head.result.as_deref() == Some(result) && head.reason.is_some_and(|r| r.starts_with(reason))
}

/// A row's `reason`, borrowed from it (`None` when absent or not a string).
#[derive(Default, Deserialize)]
#[serde(default)]
struct ReasonOf<'a> {
    #[serde(borrow)]
    reason: Option<&'a str>,
}

/// A decision's (or any journal row's) `reason`, `""` when it has none.
pub fn reason_of(d: &Value) -> &str {
    ReasonOf::deserialize(d)
        .unwrap_or_default()
        .reason
        .unwrap_or("")
}

/// What [`pools`] reads of `/narwhal/state`.
#[derive(Default, Deserialize)]
#[serde(default)]
struct PoolsOf {
    pools: Pools,
}

/// The engines of `role` in `/narwhal/state`'s `pools`, in order.
pub fn pools(state: &Value, role: &str) -> Vec<String> {
    let p = PoolsOf::deserialize(state).unwrap_or_default().pools;
    match role {
        "prefill" => p.prefill,
        "decode" => p.decode,
        _ => Vec::new(),
    }
}

impl FleetBuilder {
    /// One request at a time through the router (`--max-concurrent 1`) and an admission queue
    /// of `queue_capacity` behind it (`queue_timeout_s` 30), for scenarios that hold the seat.
    pub fn one_seat(self, queue_capacity: u32) -> Self {
        self.fleet(json!({"serving": {"queue_capacity": queue_capacity, "queue_timeout_s": 30}}))
            .router_args(&["--max-concurrent", "1"])
    }

    /// Starts the world and, at once, `shape` against its router.
    ///
    /// # Panics
    /// As [`FleetBuilder::start`]; or when the builder starts no router.
    pub async fn start_loaded(self, shape: Shape) -> (Fleet, Load) {
        let fleet = self.start().await;
        let load = Load::start(fleet.router(), shape);
        (fleet, load)
    }
}

impl RouterHandle {
    /// Waits (at most [`DECIDE`]) for a decision with `result` and a reason starting with
    /// `reason` ([`decided`]); `what` names it in the failure.
    ///
    /// # Panics
    /// When none comes; the message lists the last decisions.
    pub async fn decision_is(&self, what: &str, result: &str, reason: &str) -> Value {
        self.decision_where(what, DECIDE, |d| decided(d, result, reason))
            .await
    }

    /// Waits (at most `within`) for the first decision whose result is `applied`.
    ///
    /// # Panics
    /// When none comes; the message lists the last decisions.
    pub async fn applied(&self, what: &str, within: Duration) -> Value {
        self.decision_where(what, within, |d| {
            RowHead::of(d).result.as_deref() == Some("applied")
        })
        .await
    }

    /// Posts `n` completions of `input`-token prompts asking `max_tokens`, all at once, each
    /// from its own task; each task answers `(status, x-request-id)` (`(0, "")` when the
    /// request failed). Abort the tasks to abandon requests held on an engine. No two prompts
    /// of this process's bursts share a block ([`unique_token_prompt`]): each prefill is cold,
    /// as section 14 prices them (a burst of one prompt would be priced at its uncached
    /// tokens after the first, controller.md 3.5).
    pub fn burst(
        &self,
        n: usize,
        input: usize,
        max_tokens: u32,
    ) -> Vec<tokio::task::JoinHandle<(u16, String)>> {
        let url = format!("{}/v1/completions", self.data);
        (0..n)
            .map(|_| {
                let (client, url) = (self.http.client().clone(), url.clone());
                let k = BURST_PROMPTS.fetch_add(1, Ordering::Relaxed);
                let body = json!({"model": "tiny-sim", "prompt": unique_token_prompt(input, k),
                                  "max_tokens": max_tokens});
                tokio::spawn(async move {
                    match client.post(url).json(&body).send().await {
                        Ok(resp) => {
                            let rid = resp
                                .headers()
                                .get("x-request-id")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                                .to_string();
                            (resp.status().as_u16(), rid)
                        }
                        Err(_) => (0, String::new()),
                    }
                })
            })
            .collect()
    }

    /// Journal rows of requests that settled `terminal` (`completed`, `refused`, ...).
    pub fn settled(&self, terminal: &str) -> Vec<Value> {
        self.journal_rows()
            .into_iter()
            .filter(|x| RowHead::of(x).terminal.as_deref() == Some(terminal))
            .collect()
    }
}

impl Fleet {
    /// Kills simulator `iid` and sends requests through the router until its breaker ejects
    /// it (a fleet with `recovery.eject_after` 1).
    ///
    /// # Panics
    /// When it is not ejected after 200 requests; the message has the last answers and state.
    pub async fn kill_and_eject(&mut self, iid: &str) {
        self.sim_mut(iid).proc.kill();
        let r = self.router();
        let mut answers = Vec::new();
        for _ in 0..200 {
            if r.state().await.ejected.iter().any(|x| x == iid) {
                return;
            }
            let body = json!({"model": "tiny-sim", "prompt": token_prompt(10), "max_tokens": 2});
            let a = r.post_data("/v1/completions", &body).await;
            answers.push(format!("{} {}", a.status, a.text()));
        }
        let tail: Vec<&String> = answers.iter().rev().take(5).collect();
        let s = r.state().await;
        panic!(
            "{iid} never ejected; last answers: {tail:#?}; pools {:?} resident {:?} ejected {:?}",
            s.pools, s.resident, s.ejected
        );
    }
}
