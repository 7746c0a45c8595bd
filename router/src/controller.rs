//! The demand-driven role controller and predictive admission (controller.md):
//! a part of its own beside `fleet`, fed by the request path's bookkeeping through
//! [`Track`], changing roles through [`Fleet`] and holding engines through the lifecycle.
//!
//! ```text
//!  serve ──Track: sized, waiting, dispatched, first token, tokens, finished──► Book, demand
//!        ──seat() (queue, urgent latch, queued refusals) / admit() (price at placement)──► 429
//!  driver (every monitor_interval_s, or woken by the latch)
//!     HA phase + lifecycle hold ──controls?──► Machine::pass | urgent | interrupt
//!     commands: SetRole ──► Fleet::set_role (vLLM) | engine-side switch (SGLang) ──► role check
//!               Risk ──► DemandRisk (the handoff's demand_risk)     Journal ──► journal
//!  documents ◄──report (state fields, metrics families)
//! ```
//!
//! The pure core is `machine` (passes, floors, latch) over `policy` (the reactive decision),
//! `roles` (flip guards, donor, history), `scoring` (split prices, FIFO projection),
//! `evidence` (the consolidation gate) and `book` (bookkeeping); `driver` applies what it
//! decides; `intake` is the request path's side; `report` renders it. Without engine
//! profiles (`profiles.default` / `profiles.engines`) the controller is off: roles stay as
//! configured and no controller field is reported.

mod book;
mod decision;
mod driver;
mod evidence;
mod intake;
mod machine;
mod policy;
pub(crate) mod report;
mod roles;
mod scoring;
mod stage;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

use narwhal_shared::Clock;
use tokio::sync::Notify;

use crate::config::Config;
use crate::demand::DemandRisk;
use crate::fleet::Fleet;
use crate::ha_phase::Ha;
use crate::journal::Journal;
use crate::lifecycle::driver::LifecycleDriver;
use crate::readiness::Gate;
use crate::upstream::Upstream;

pub(crate) use intake::Track;
use machine::Machine;

/// What the controller is built over.
pub(crate) struct Handles {
    pub(crate) cfg: Arc<Config>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) fleet: Arc<Fleet>,
    pub(crate) lifecycle: Arc<LifecycleDriver>,
    pub(crate) ha: Arc<Ha>,
    pub(crate) gate: Arc<Gate>,
    pub(crate) upstream: Upstream,
    pub(crate) journal: Journal,
    pub(crate) demand: Arc<DemandRisk>,
}

/// The monitoring failure ledger of the controller stage (controller.md 11.1
/// `monitoring_stage_failure`; behaviour.md 10 monitoring families). Process-local.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Ledger {
    /// Failed controller passes in total.
    pub(crate) failures: u64,
    /// Failed passes in a row.
    pub(crate) consecutive: u64,
    /// The last failure's class.
    pub(crate) last_class: Option<String>,
    /// When it happened (wall clock).
    pub(crate) last_at: Option<f64>,
}

/// The controller part (see the module doc).
pub(crate) struct Controller {
    h: Handles,
    /// On when every engine has a profile.
    enabled: bool,
    machine: Mutex<Machine>,
    /// Wakes the driver for an urgent evaluation.
    wake: Notify,
    next_id: AtomicU64,
    ledger: Mutex<Ledger>,
    /// Engines whose role change (engine-side switch or role check) is running.
    changing: Mutex<BTreeSet<usize>>,
    /// `/tokenize` failures per engine: `(consecutive failures, backed off until)`.
    tokenize_backoff: Mutex<Vec<(u32, Option<std::time::Instant>)>>,
    /// The router's own tokenizer (`engine.tokenizer`), set at startup: sizes a prompt
    /// without an engine's `/tokenize` (docs/design/kv-aware-placement.md, "The router's
    /// tokenizer").
    tokenizer: std::sync::OnceLock<Arc<narwhal_tokenizer::ModelTokenizer>>,
}

impl Controller {
    /// The controller over `h`, built now (the prefill→decode cooldown counts from here).
    pub(crate) fn new(h: Handles) -> Controller {
        let started = h.clock.now();
        let enabled = !h.cfg.profiles.is_empty();
        let engines = driver::engines_view(&h.cfg, &h.fleet);
        let machine = Machine::new(&h.cfg, started, engines);
        let n = h.cfg.engines.len();
        Controller {
            enabled,
            machine: Mutex::new(machine),
            wake: Notify::new(),
            next_id: AtomicU64::new(1),
            ledger: Mutex::new(Ledger::default()),
            changing: Mutex::new(BTreeSet::new()),
            tokenize_backoff: Mutex::new(vec![(0, None); n]),
            tokenizer: std::sync::OnceLock::new(),
            h,
        }
    }

    /// Sizes prompts with `model` from now on (set once, at startup).
    pub(crate) fn use_tokenizer(&self, model: Arc<narwhal_tokenizer::ModelTokenizer>) {
        let _ = self.tokenizer.set(model);
    }

    fn lock(&self) -> MutexGuard<'_, Machine> {
        self.machine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The monitoring ledger.
    pub(crate) fn ledger(&self) -> Ledger {
        self.ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
