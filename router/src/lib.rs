//! Narwhal router (`narwhal-serve`): placement, P/D serving for vLLM and SGLang, streaming
//! relay, breaker, outcome accounting, metrics, state and journal (DESIGN.md sections 3, 5, 6).
//!
//! ```text
//!  clients ──► data listener ──► ingress ──► placement ──► prefill leg ─┐
//!                                   │                       decode leg ◄┘ (vLLM: descriptor,
//!                                   ▼                          │         SGLang: rendezvous)
//!                               outcome (one settle) ◄── relay ◄┘
//!                                   ├─► metrics  ├─► journal  └─► /narwhal/state
//!  monitor task ──► breaker probes (GET /health) ──► readmission
//! ```
//!
//! Pure cores (`placement`, `relay`, `breaker`, `ingress`, `outcome`, `config`) take `now` and
//! RNGs as arguments; the drivers (`serve`, `http`, `upstream`, `state`) do the IO.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod accounting;
mod admission;
mod app;
mod bootstrap;
pub mod breaker;
mod cli;
pub mod config;
mod demand;
mod documents;
mod failure;
mod fleet;
mod ha;
mod handoff;
mod http;
pub mod ingress;
pub mod journal;
pub mod lease;
pub mod lifecycle;
mod metrics;
mod monitor;
pub mod outcome;
mod parts;
mod phase;
pub mod placement;
mod readiness;
pub mod relay;
mod response;
pub mod retry;
mod serve;
mod upstream;

pub use app::{Error, Listeners, RunOptions, run};
pub use cli::main_from_args;
pub use config::{Backend, Config, ConfigError, ConfigIssue, Role};
pub use ha::StandbyOptions;
pub use journal::Journal;
