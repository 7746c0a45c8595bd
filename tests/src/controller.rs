//! Role-controller worlds for end-to-end tests and the bench: engines `e0, e1, ...` with the
//! given roles, the fixture profile of controller.md section 14, SLO 2 s / 0.1 s, and the
//! fast variant of the timings (step 1 s, pass 0.25 s, window 24 s, evidence 12/24 s,
//! cooldown 2 s); a paced load generator; the controller's journal events.
//!
//! ```text
//!  controller_fleet(&["prefill","decode",...]).fleet(json!({...})).start()
//!  Load::start(&router, Shape { rate, input, max_tokens }) ... load.stop().await
//!  router.decisions() / router.decision_where("what", |d| ...) / router.events("below_floor")
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use narwhal_shared::documents::{DecisionEvent, State};
use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};

use crate::WAIT;
use crate::fleet::{Fleet, FleetBuilder};
use crate::proc::wait_until;
use crate::router::RouterHandle;

/// The section-14 fixture profile: prefill `0.001·L + 0.01` s (1000 tokens ≈ 1.01 s),
/// decode step `1e-6·T + 0.01` s, batches of 1–64 requests, 16–200000 KV tokens.
pub fn fixture_profile() -> Value {
    json!({"ttft_a": 0, "ttft_b": 0.001, "ttft_c": 0.01, "tpot_slope": 1e-6,
           "tpot_intercept": 0.01, "decode_min_requests": 1, "decode_max_requests": 64,
           "decode_min_kv_tokens": 16, "decode_max_kv_tokens": 200000,
           "kv_capacity_tokens": 200000})
}

/// The fleet-file sections of a controller world (merged under the builder's own).
pub fn fast_controller_sections() -> Value {
    json!({
        "slo": {"ttft_s": 2.0, "tpot_s": 0.1},
        "profiles": {"default": fixture_profile()},
        "controller": {
            "monitor_interval_s": 0.25,
            "thresholds": {"cooldown_s": 2},
            "reactive": {"step_s": 1, "window_s": 24, "evidence_span_s": 12,
                          "evidence_max_span_s": 24},
        },
    })
}

/// A builder for engines `e0..` with `roles` (in order), long enough contexts for the
/// scenarios' prompts (`--max-model-len 8192`), and [`fast_controller_sections`].
pub fn controller_fleet(roles: &[&str]) -> FleetBuilder {
    let mut b = Fleet::builder().sim_args(&["--max-model-len", "8192"]);
    for (i, r) in roles.iter().enumerate() {
        b = b.engine(&format!("e{i}"), r);
    }
    b.fleet(fast_controller_sections())
}

/// A prompt of `n` token ids (sized exactly by the router, as in section 14).
pub fn token_prompt(n: usize) -> Value {
    Value::from((0..n).map(|i| 100 + (i % 900) as u64).collect::<Vec<_>>())
}

/// [`token_prompt`] whose first token is request `k`'s own, so no two of a load's prompts share
/// a block: each one's prefill is computed in full, as a load of distinct long prompts is on an
/// engine with a prefix cache.
pub fn unique_token_prompt(n: usize, k: u64) -> Value {
    let mut p = token_prompt(n);
    if let Some(first) = p.get_mut(0) {
        *first = Value::from(1000 + k % 30_000);
    }
    p
}

/// [`token_prompt`] whose last token is request `k`'s own: every such prompt of `n` tokens
/// shares its first `n − 1` with the others, so an engine that computed one holds the rest's
/// prefix (a shared-prefix stream served from cache).
pub fn shared_prefix_prompt(n: usize, k: u64) -> Value {
    let mut p = token_prompt(n);
    if let Some(last) = p.as_array_mut().and_then(|a| a.last_mut()) {
        *last = Value::from(1000 + k % 30_000);
    }
    p
}

/// One load shape: `rate` requests per second of `input` prompt tokens, each asking
/// `max_tokens` (none: the engine's default); prompts share no block
/// ([`unique_token_prompt`]) unless `shared_prefix` ([`shared_prefix_prompt`]).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Requests per second.
    pub rate: f64,
    /// Prompt tokens.
    pub input: usize,
    /// `max_tokens`, if any.
    pub max_tokens: Option<u32>,
    /// Whether the prompts share all but their last token.
    pub shared_prefix: bool,
}

impl Shape {
    /// `rate` requests per second of `input`-token prompts asking `max_tokens`, no two
    /// sharing a block.
    pub const fn new(rate: f64, input: usize, max_tokens: Option<u32>) -> Shape {
        Shape {
            rate,
            input,
            max_tokens,
            shared_prefix: false,
        }
    }

    /// The same shape with prompts that share all but their last token.
    pub const fn with_shared_prefix(self) -> Shape {
        Shape {
            shared_prefix: true,
            ..self
        }
    }
}

/// What a load run saw.
#[derive(Debug, Default)]
pub struct LoadStats {
    /// Requests sent.
    pub sent: AtomicU64,
    /// Answered 200.
    pub ok: AtomicU64,
    /// Answered anything else.
    pub failed: AtomicU64,
}

/// A paced open-loop load against a router's data listener: one request task per tick,
/// so a slow request never delays the next; no two requests share a prompt prefix
/// ([`unique_token_prompt`]) unless the shape says so ([`Shape::shared_prefix`]).
pub struct Load {
    stop: Arc<AtomicBool>,
    /// Counters.
    pub stats: Arc<LoadStats>,
    task: tokio::task::JoinHandle<()>,
}

impl Load {
    /// Starts sending `shape` to `router`.
    pub fn start(router: &RouterHandle, shape: Shape) -> Load {
        Load::start_with(router, shape, None)
    }

    /// [`Load::start`] whose clients give up after `abandon_after` (their requests are
    /// cancelled, never completed).
    pub fn start_with(
        router: &RouterHandle,
        shape: Shape,
        abandon_after: Option<Duration>,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(LoadStats::default());
        let url = format!("{}/v1/completions", router.data);
        let client = router.http.client().clone();
        let (s, st) = (stop.clone(), stats.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / shape.rate));
            let mut requests = tokio::task::JoinSet::new();
            while !s.load(Ordering::Relaxed) {
                tick.tick().await;
                let k = st.sent.load(Ordering::Relaxed);
                let prompt = if shape.shared_prefix {
                    shared_prefix_prompt(shape.input, k)
                } else {
                    unique_token_prompt(shape.input, k)
                };
                let body = match shape.max_tokens {
                    Some(m) => json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": m}),
                    None => json!({"model": "tiny-sim", "prompt": prompt}),
                };
                let (client, url, st) = (client.clone(), url.clone(), st.clone());
                st.sent.fetch_add(1, Ordering::Relaxed);
                requests.spawn(async move {
                    let call = async {
                        match client.post(&url).json(&body).send().await {
                            Ok(r) => r.status() == 200 && r.bytes().await.is_ok(),
                            Err(_) => false,
                        }
                    };
                    let ok = match abandon_after {
                        Some(d) => tokio::time::timeout(d, call).await.unwrap_or(false),
                        None => call.await,
                    };
                    let c = if ok { &st.ok } else { &st.failed };
                    c.fetch_add(1, Ordering::Relaxed);
                });
                while requests.try_join_next().is_some() {}
            }
            requests.abort_all();
        });
        Load { stop, stats, task }
    }

    /// Stops sending (requests in flight are abandoned).
    pub async fn stop(self) -> Arc<LoadStats> {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.task.await;
        self.stats
    }
}

/// The head of a journal row, as the kit's filters read it: its naming members, each `None`
/// when the row has none (or one that is not a string). Reading it never fails on an object.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct RowHead {
    /// An event row's name.
    #[serde(deserialize_with = "string_or_none")]
    pub(crate) event: Option<String>,
    /// The engine it is about.
    #[serde(deserialize_with = "string_or_none")]
    pub(crate) iid: Option<String>,
    /// How a request row ended.
    #[serde(deserialize_with = "string_or_none")]
    pub(crate) terminal: Option<String>,
    /// A decision's result.
    #[serde(deserialize_with = "string_or_none")]
    pub(crate) result: Option<String>,
    /// A decision's (or an outcome's) reason.
    #[serde(deserialize_with = "string_or_none")]
    pub(crate) reason: Option<String>,
}

impl RowHead {
    /// The head of `row`; all `None` when `row` is not an object.
    pub(crate) fn of(row: &Value) -> RowHead {
        RowHead::deserialize(row).unwrap_or_default()
    }
}

/// A member that is a string, else `None` (any other JSON value).
fn string_or_none<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::String(s) => Some(s),
        _ => None,
    })
}

impl RouterHandle {
    /// Journal events named `event`, oldest first.
    pub fn events(&self, event: &str) -> Vec<Value> {
        self.journal_rows()
            .into_iter()
            .filter(|r| RowHead::of(r).event.as_deref() == Some(event))
            .collect()
    }

    /// Waits (at most [`WAIT`]) until the journal holds `n` rows of `event`; returns them all.
    /// An event written after the decision a test waited for (a floor restored once the flip
    /// applied) may still be in the journal writer's buffer when the decision is read.
    ///
    /// # Panics
    /// When fewer come.
    pub async fn events_at_least(&self, event: &str, n: usize) -> Vec<Value> {
        let found = wait_until(WAIT, || async {
            let e = self.events(event);
            (e.len() >= n).then_some(e)
        })
        .await;
        found.unwrap_or_else(|| panic!("fewer than {n} {event} events within {WAIT:?}"))
    }

    /// The controller's decisions (journal `controller_decision`), oldest first.
    pub fn decisions(&self) -> Vec<Value> {
        self.events("controller_decision")
    }

    /// Waits (at most `within`) for a decision satisfying `pred`, reading only the journal.
    ///
    /// # Panics
    /// When none comes; the message lists the last decisions.
    pub async fn decision_where(
        &self,
        what: &str,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let found = wait_until(within, || async {
            self.decisions().into_iter().find(|d| pred(d))
        })
        .await;
        found.unwrap_or_else(|| {
            let all = self.decisions();
            let tail: Vec<String> = all
                .iter()
                .rev()
                .take(12)
                .rev()
                .map(|row| {
                    let d = serde_json::from_value::<DecisionEvent>(row.clone())
                        .unwrap_or_default()
                        .decision;
                    let rule = d.details.get("eligibility_rule").unwrap_or(&Value::Null);
                    format!(
                        "{} {}P/{}D {} {}: {} (rule {rule})",
                        d.at, d.prefill, d.decode, d.by, d.result, d.reason
                    )
                })
                .collect();
            panic!("no decision {what} within {within:?}; last: {tail:#?}")
        })
    }

    /// Sends `shape` until a decision satisfying `pred` comes (at most `within`), then stops
    /// the load; returns the decision.
    ///
    /// # Panics
    /// When none comes.
    pub async fn decision_under_load(
        &self,
        shape: Shape,
        what: &str,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let load = Load::start(self, shape);
        let d = self.decision_where(what, within, pred).await;
        load.stop().await;
        d
    }

    /// Waits (at most `within`) until the journal holds `n` decisions; returns them.
    ///
    /// # Panics
    /// When it does not.
    pub async fn decisions_at_least(&self, n: usize, within: Duration) -> Vec<Value> {
        let found = wait_until(within, || async {
            let d = self.decisions();
            (d.len() >= n).then_some(d)
        })
        .await;
        found.unwrap_or_else(|| panic!("fewer than {n} decisions within {within:?}"))
    }
}

/// A streaming completion held open on the engine that decodes it.
pub struct HeldStream {
    resp: reqwest::Response,
    /// The SSE text read so far.
    pub text: String,
}

impl HeldStream {
    /// Reads the stream to its end; whether it ended with `[DONE]`.
    pub async fn finish(mut self) -> bool {
        while let Ok(Some(c)) = self.resp.chunk().await {
            self.text.push_str(&String::from_utf8_lossy(&c));
        }
        self.text.contains("[DONE]")
    }
}

fn decode_residents(state: &State) -> std::collections::BTreeMap<String, u64> {
    state
        .resident
        .iter()
        .map(|(k, v)| (k.clone(), v.decode))
        .collect()
}

impl RouterHandle {
    /// Opens a streaming completion of an `input`-token prompt asking `max_tokens`, waits for
    /// its first token, and returns it with the engine that decodes it (the one whose
    /// decode residents grew). Call it with no other traffic running.
    ///
    /// # Panics
    /// When the answer is not 200, or no engine shows the new resident.
    pub async fn hold_stream(&self, input: usize, max_tokens: u32) -> (HeldStream, String) {
        let before = decode_residents(&self.state().await);
        let resp = self
            .http
            .client()
            .post(format!("{}/v1/completions", self.data))
            .json(&json!({"model": "tiny-sim", "prompt": token_prompt(input),
                          "max_tokens": max_tokens, "stream": true}))
            .send()
            .await
            .expect("stream request");
        assert_eq!(resp.status(), 200, "stream");
        let mut s = HeldStream {
            resp,
            text: String::new(),
        };
        s.text = crate::router::read_to_first_token(&mut s.resp).await;
        let iid = wait_until(WAIT, || async {
            let now = decode_residents(&self.state().await);
            now.iter()
                .find(|(k, n)| **n > before.get(*k).copied().unwrap_or(0))
                .map(|(k, _)| k.clone())
        })
        .await
        .expect("the stream's decode engine shows it resident");
        (s, iid)
    }
}
