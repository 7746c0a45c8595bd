//! The request path's side of the controller: the bookkeeping hook ([`Track`]), sizing
//! through the engines' `/tokenize`, the admission seat with its queue, the urgency latch and
//! queued refusals, and the TTFT price at placement (controller.md 1, 2.4, 10).
//!
//! ```text
//!  serve: track(rid) ─► size() ─► seat() ─► [place] ─► admit(plan) ─► legs ─► tokens ─► drop
//!            │            │          │ wait, note_prefill_risk (urgent latch), re-price
//!            │            │          └─ refused while queued ─► 429 (never dispatched)
//!            │            └─ /tokenize on the least-occupied live engine (backoff), else chars
//!            └─ arrival, unsized offers, completions ─► demand windows
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;

use super::Controller;
use crate::admission::{self, Admission, Price};
use crate::config::{AdmissionMode, Role, secs};
use crate::failure::{Expiry, RequestFailure};
use crate::ingress::Validated;
use crate::placement::{Phase, Plan};

use crate::admission::Refusal;

/// The longest `/tokenize` backoff (controller.md 10.2).
const TOKENIZE_BACKOFF_CAP: Duration = Duration::from_secs(30);

struct Inner {
    ctl: Arc<Controller>,
    id: u64,
    arrived: Instant,
    sized: AtomicBool,
    invalid: AtomicBool,
    completed: AtomicBool,
    /// Output tokens wanted per prompt (`max_tokens`; 0 when unset), once sized.
    wanted: AtomicU64,
}

/// One request's bookkeeping handle: cheap to clone; when the last clone drops the request
/// is finished (an unsized one counts as unsized demand unless it was invalid; a completed
/// one teaches the output model).
#[derive(Clone)]
pub(crate) struct Track(Arc<Inner>);

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.ctl.enabled {
            return;
        }
        let now = self.ctl.h.clock.now();
        let mut m = self.ctl.lock();
        let req = m.core.book.finished(self.id, now);
        if !self.sized.load(Ordering::Relaxed) && !self.invalid.load(Ordering::Relaxed) {
            m.core.demand.settled_unsized(now);
        }
        if self.completed.load(Ordering::Relaxed)
            && let Some(r) = req
            && r.delivered > 0
        {
            m.core
                .demand
                .completion(now, r.input, r.wanted, r.delivered);
        }
    }
}

/// A request waiting for an admission seat; leaves the waiting list on drop.
pub(crate) struct Waiting(Track);

impl Drop for Waiting {
    fn drop(&mut self) {
        let t = &self.0.0;
        if t.ctl.enabled {
            t.ctl.lock().core.book.unwait(t.id);
        }
    }
}

impl Track {
    fn with(&self, f: impl FnOnce(&mut super::machine::Machine, u64, Instant)) {
        let t = &self.0;
        if !t.ctl.enabled {
            return;
        }
        let now = t.ctl.h.clock.now();
        f(&mut t.ctl.lock(), t.id, now);
    }

    /// Arrival (monotonic).
    pub(crate) fn arrived(&self) -> Instant {
        self.0.arrived
    }

    /// The request settled as invalid before sizing: not unsized demand.
    pub(crate) fn invalid(&self) {
        self.0.invalid.store(true, Ordering::Relaxed);
    }

    /// The request completed (its delivered tokens teach the output model).
    pub(crate) fn completed(&self) {
        self.0.completed.store(true, Ordering::Relaxed);
    }

    /// A leg was dispatched to engine `iid`.
    pub(crate) fn dispatched(&self, iid: usize, phase: Phase) {
        self.with(|m, id, now| m.core.book.dispatched(id, iid, phase, now));
    }

    /// The decode leg produced its first token.
    pub(crate) fn first_token(&self) {
        self.with(|m, id, now| m.core.book.first_token(id, now));
    }

    /// `total` output tokens relayed so far.
    pub(crate) fn tokens(&self, total: u64) {
        self.with(|m, id, now| m.core.book.tokens(id, total, now));
    }

    /// A failed attempt's legs ended.
    pub(crate) fn attempt_ended(&self) {
        self.with(|m, id, now| m.core.book.attempt_ended(id, now));
    }

    /// Sized: `input` prompt tokens and `wanted` output tokens per prompt for `prompts`
    /// prompts (a batch's demand is all of its prompts').
    fn sized(&self, input: u64, wanted: u64, prompts: u64) {
        self.0.sized.store(true, Ordering::Relaxed);
        self.0.wanted.store(wanted, Ordering::Relaxed);
        self.with(|m, id, now| {
            m.core.book.sized(id, input, wanted * prompts);
            m.core.demand.arrival(now, input, wanted * prompts);
        });
    }

    /// One prompt of this (batch) request, `input` prompt tokens, tracked on its own from
    /// here: its legs, tokens and completion. Its demand arrived with the request (not again).
    pub(crate) fn prompt(&self, input: u64) -> Track {
        let t = &self.0;
        let ctl = t.ctl.clone();
        let id = ctl.next_id.fetch_add(1, Ordering::Relaxed);
        let wanted = t.wanted.load(Ordering::Relaxed);
        if ctl.enabled {
            let mut m = ctl.lock();
            let rid = m
                .core
                .book
                .req(t.id)
                .map(|r| r.rid.clone())
                .unwrap_or_default();
            m.core.book.arrive(id, &rid, t.arrived);
            m.core.book.sized(id, input, wanted);
        }
        Track(Arc::new(Inner {
            ctl,
            id,
            arrived: t.arrived,
            sized: AtomicBool::new(true),
            invalid: AtomicBool::new(false),
            completed: AtomicBool::new(false),
            wanted: AtomicU64::new(wanted),
        }))
    }
}

/// `max_completion_tokens`, else `max_tokens`, when a positive integer; else 0
/// (controller.md 3.2).
fn wanted(v: &Validated) -> u64 {
    ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| v.body.get(*k).and_then(Value::as_u64).filter(|n| *n > 0))
        .unwrap_or(0)
}

impl Controller {
    /// Starts tracking request `rid` (arrived now).
    pub(crate) fn track(self: &Arc<Self>, rid: &str) -> Track {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let arrived = self.h.clock.now();
        if self.enabled {
            self.lock().core.book.arrive(id, rid, arrived);
        }
        Track(Arc::new(Inner {
            ctl: self.clone(),
            id,
            arrived,
            sized: AtomicBool::new(false),
            invalid: AtomicBool::new(false),
            completed: AtomicBool::new(false),
            wanted: AtomicU64::new(0),
        }))
    }

    /// Sizes the prompt (controller.md 10.2): a token-id prompt by its length; with
    /// predictive admission and `engine.tokenize`, a text prompt by the router's own tokenizer
    /// when `engine.tokenizer` is set and it renders the request, else through `/tokenize` on the
    /// least-occupied live engine (a failing engine backs off `1 s·2^(k−1)`, at most 30 s);
    /// else the ingress estimate (characters / `chars_per_token`). Records the arrival.
    pub(crate) async fn size(&self, track: &Track, v: &Validated) -> u64 {
        let mut input = v.input_len;
        let text =
            v.body.get("messages").is_some() || v.body.get("prompt").is_some_and(Value::is_string);
        if self.enabled
            && self.h.cfg.serving.admission == AdmissionMode::Predictive
            && self.h.cfg.engine.tokenize
            && text
            && let Some(n) = self.tokenize(v).await
        {
            input = n.max(1);
        }
        let prompts = crate::ingress::batch_prompts(v).map_or(1, |p| p.len() as u64);
        track.sized(input, wanted(v), prompts);
        input
    }

    fn tokenize_candidate(&self) -> Option<usize> {
        let now = self.h.clock.now();
        let backoff = self
            .tokenize_backoff
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let counts = self.h.fleet.resident_counts();
        let names = self.h.fleet.names();
        let live = self.h.fleet.live_names();
        (0..names.len())
            .filter(|i| live.contains(&names[*i]))
            .filter(|i| backoff[*i].1.is_none_or(|until| until <= now))
            .min_by_key(|i| (counts.get(&names[*i]).copied().unwrap_or(0), *i))
    }

    async fn tokenize(&self, v: &Validated) -> Option<u64> {
        // The router's own tokenizer first: no engine round trip; a request it cannot render
        // goes to `/tokenize` as before.
        let t0 = self.h.clock.now();
        if let Some(model) = self.tokenizer.get()
            && let Ok(tokens) = crate::kv_cache::tokens_of(model, &v.body).await
        {
            let n = tokens.len() as u64;
            let spent = self.h.clock.now().saturating_duration_since(t0);
            let _ = v.tokens.set((tokens, spent.as_micros() as u64));
            return Some(n);
        }
        let iid = self.tokenize_candidate()?;
        let mut body = json!({"model": self.h.cfg.model});
        for k in ["prompt", "messages"] {
            if let Some(x) = v.body.get(k) {
                body[k] = x.clone();
            }
        }
        let url = format!("{}/tokenize", self.h.cfg.engines[iid].url);
        let timeout = secs(self.h.cfg.engine.tokenize_timeout_s);
        let answer = self.h.upstream.post_json(&url, &body, timeout).await;
        let count = match &answer {
            Ok((status, bytes)) if status.is_success() => {
                serde_json::from_slice::<Value>(bytes).ok().and_then(|v| {
                    v["count"]
                        .as_u64()
                        .or_else(|| v["tokens"].as_array().map(|t| t.len() as u64))
                })
            }
            _ => None,
        };
        let mut b = self
            .tokenize_backoff
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match count {
            Some(_) => b[iid] = (0, None),
            None => {
                let k = b[iid].0 + 1;
                let wait = Duration::from_secs(1 << (k - 1).min(5)).min(TOKENIZE_BACKOFF_CAP);
                b[iid] = (k, Some(self.h.clock.now() + wait));
                tracing::debug!(engine.id = %self.h.cfg.engines[iid].iid, "tokenize failed; using the character estimate");
            }
        }
        count
    }

    fn budget_s(&self) -> f64 {
        self.h.cfg.slo.ttft_s * (1.0 + self.h.cfg.serving.admission_margin)
    }

    /// The admission seat (behaviour.md 7.4; controller.md 2.4, 10.1): at once when
    /// one is free; with `queue_capacity > 0` the request waits FIFO until
    /// `queue_timeout_s` (or the request deadline), joining the waiting list the urgent
    /// projection reads; under predictive admission it is re-priced on entry and whenever
    /// elapsed time alone would break its budget, and refused (429) before it takes a seat.
    /// A client that leaves while queued drops this future: it is never dispatched.
    ///
    /// Returns the seat and the seconds waited for it.
    ///
    /// # Errors
    /// [`RequestFailure::InflightLimit`] (no seat, no queue), [`RequestFailure::Expired`]
    /// (queue timeout or deadline), [`RequestFailure::Refused`] (priced out while queued).
    pub(crate) async fn seat(
        &self,
        adm: &Arc<Admission>,
        track: &Track,
        deadline: Instant,
    ) -> Result<(OwnedSemaphorePermit, f64), RequestFailure> {
        let serving = &self.h.cfg.serving;
        if serving.queue_capacity == 0 {
            return adm
                .seats()
                .clone()
                .try_acquire_owned()
                .map(|p| (p, 0.0))
                .map_err(|_| RequestFailure::InflightLimit);
        }
        if let Ok(p) = adm.seats().clone().try_acquire_owned() {
            return Ok((p, 0.0));
        }
        let asked = self.h.clock.now();
        let by = (track.arrived() + secs(serving.queue_timeout_s)).min(deadline);
        let _queued = adm.queued();
        let _waiting = self.wait(track);
        // One acquire for the whole wait: the semaphore is FIFO, re-checks keep the place.
        let acquire = adm.seats().clone().acquire_owned();
        tokio::pin!(acquire);
        loop {
            let refuse_at = self.queued_refusal(track)?;
            let recheck = refuse_at.unwrap_or(by).min(by);
            tokio::select! {
                acquired = &mut acquire => {
                    let waited = self.h.clock.now().saturating_duration_since(asked).as_secs_f64();
                    return acquired
                        .map(|p| (p, waited))
                        .map_err(|_| RequestFailure::InflightLimit);
                }
                () = tokio::time::sleep_until(recheck.into()) => {
                    if self.h.clock.now() >= by {
                        return Err(RequestFailure::Expired(Expiry::Queue {
                            deadline_first: by == deadline,
                        }));
                    }
                }
            }
        }
    }

    /// Joins the waiting list and notes the prefill risk (controller.md 2.4): a projected
    /// TTFT breach arms the latch and wakes the driver.
    fn wait(&self, track: &Track) -> Waiting {
        if self.enabled {
            let now = self.h.clock.now();
            let mut m = self.lock();
            m.core.book.wait(track.0.id);
            // The fleet as it is now (roles, exclusions) for the projection.
            let engines = super::driver::engines_view(&self.h.cfg, &self.h.fleet);
            m.core.engines = engines;
            if m.note_prefill_risk(now) {
                drop(m);
                self.wake.notify_one();
            }
        }
        Waiting(track.clone())
    }

    /// Prices a queued request (predictive only): `Err` when it can no longer make its TTFT
    /// budget; else when elapsed time alone would break it (`arrived + budget − cheapest
    /// placement price`), to re-check then.
    fn queued_refusal(&self, track: &Track) -> Result<Option<Instant>, RequestFailure> {
        if !self.enabled || self.h.cfg.serving.admission != AdmissionMode::Predictive {
            return Ok(None);
        }
        let now = self.h.clock.now();
        let m = self.lock();
        let Some(req) = m.core.book.req(track.0.id) else {
            return Ok(None);
        };
        let input = req.input;
        let engines = super::driver::engines_view(&self.h.cfg, &self.h.fleet);
        let live_prefill = engines
            .iter()
            .enumerate()
            .filter(|(_, e)| e.live && e.role == Role::Prefill)
            .map(|(i, _)| i)
            .collect::<Vec<_>>();
        let pool = if live_prefill.is_empty() {
            engines
                .iter()
                .enumerate()
                .filter(|(_, e)| e.live)
                .map(|(i, _)| i)
                .collect()
        } else {
            live_prefill.clone()
        };
        let cheapest = pool
            .iter()
            .filter_map(|i| {
                let p = m.core.profiles[*i].as_ref()?;
                let load = m.core.book.load(*i);
                Some((load.prefill_s, p.prefill_time(input)))
            })
            .min_by(|a, b| (a.0 + a.1).total_cmp(&(b.0 + b.1)));
        let Some((backlog, own)) = cheapest else {
            return Ok(None);
        };
        let handoff = m.core.snapshot(now).handoff_s;
        let elapsed = now.saturating_duration_since(track.arrived()).as_secs_f64();
        let price = Price {
            attempt: 1,
            backlog_s: backlog,
            own_prefill_s: own,
            elapsed_s: elapsed,
            handoff_s: handoff,
            price_s: backlog + own + elapsed + handoff,
        };
        let budget = self.budget_s();
        let cheapest_own = pool
            .iter()
            .filter_map(|i| m.core.profiles[*i].as_ref())
            .map(|p| p.prefill_time(input))
            .fold(f64::INFINITY, f64::min);
        drop(m);
        if let Some(r) = admission::judge(&price, budget, cheapest_own, live_prefill.is_empty()) {
            return Err(RequestFailure::Refused(r));
        }
        let slack = budget - (backlog + own + handoff);
        Ok(Some(
            track.arrived() + secs(slack.max(0.0)) + Duration::from_millis(1),
        ))
    }

    /// Prices attempt `attempt` at placement (controller.md 10.4, 10.7): the chosen
    /// engine's resident prefill plus this prompt's own prefill, plus elapsed time and the
    /// fleet's handoff delay. The own prefill is priced at the prompt's uncached tokens on
    /// the engine that computes it (controller.md 3.5): `cached[i]` = the prompt tokens the
    /// KV index credits engine `i` with (config order; empty without a KV score, which
    /// prices the whole prompt); the placement is recorded with it in the bookkeeping and,
    /// on a first attempt, in the demand. A placement whose engine alone misses the TTFT
    /// counts `unserved` (through `unserved`). Returns the journal's `admission_price`
    /// (`None` when the controller is off), or the refusal of a first attempt under
    /// predictive admission (retries skip the TTFT check).
    pub(crate) fn admit(
        &self,
        track: &Track,
        plan: Plan,
        attempt: u32,
        cached: &[u64],
        unserved: impl FnOnce(),
    ) -> Result<Option<Value>, Refusal> {
        if !self.enabled {
            return Ok(None);
        }
        let now = self.h.clock.now();
        let mut m = self.lock();
        let input = m.core.book.req(track.0.id).map_or(0, |r| r.input);
        let engines = super::driver::engines_view(&self.h.cfg, &self.h.fleet);
        let (chosen, aggregated) = match plan {
            Plan::Split { prefill, .. } => (prefill, false),
            Plan::Aggregated { engine } => (engine, true),
        };
        let chosen_cached = cached.get(chosen).copied();
        m.core
            .placed(track.0.id, chosen, chosen_cached, attempt, now);
        let uncached = input.saturating_sub(chosen_cached.unwrap_or(0));
        let load = m.core.book.load(chosen);
        let own = m.core.profiles[chosen]
            .as_ref()
            .map_or(0.0, |p| p.prefill_time(uncached));
        let no_prefill = !engines.iter().any(|e| e.live && e.role == Role::Prefill);
        let unpriced = aggregated && no_prefill && load.decode > 0;
        let placement = if unpriced {
            f64::INFINITY
        } else {
            load.prefill_s + own
        };
        let handoff = m.core.snapshot(now).handoff_s;
        let elapsed = now.saturating_duration_since(track.arrived()).as_secs_f64();
        let price = Price {
            attempt,
            backlog_s: load.prefill_s,
            own_prefill_s: own,
            elapsed_s: elapsed,
            handoff_s: handoff,
            price_s: placement + elapsed + handoff,
        };
        let cheapest_own = m.core.cheapest_prefill(input, cached).unwrap_or(own);
        let refused = if attempt == 1 && self.h.cfg.serving.admission == AdmissionMode::Predictive {
            admission::judge(&price, self.budget_s(), cheapest_own, no_prefill)
        } else {
            None
        };
        // An admitted prefill joins its engine's backlog now, under the same lock as its
        // price, so a request priced a moment later sees it (the dispatch that follows
        // records it again, idempotently). Found by controller_e2e S12 on a loaded machine:
        // concurrent arrivals were all priced against the same backlog and over-admitted.
        if refused.is_none()
            && let Plan::Split { prefill, .. } = plan
        {
            m.core
                .book
                .dispatched(track.0.id, prefill, Phase::Prefill, now);
        }
        drop(m);
        if placement > self.h.cfg.slo.ttft_s {
            unserved();
        }
        if let Some(r) = refused {
            return Err(r);
        }
        Ok(Some(price.to_value()))
    }

    /// Requests waiting for an admission seat now (`/narwhal/state.admission.waiting_prefill`;
    /// `None` when the controller is off and nothing tracks them).
    pub(crate) fn waiting_prefill(&self) -> Option<usize> {
        self.enabled.then(|| self.lock().core.book.waiting().len())
    }
}
