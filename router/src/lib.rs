//! Narwhal router (`narwhal-serve`): placement, P/D serving for vLLM and SGLang, streaming
//! relay, breaker, outcome accounting, metrics, engine lifecycle, HA (lease, handoff, warm
//! standby), state and journal (architecture.md sections 3, 5, 6, 7, 9).
//!
//! The design documents live under `docs/design/`, and comments cite them by file name and
//! section number: "behaviour.md 4.3" is section 4.3 of `docs/design/behaviour.md` (the
//! reference's behaviour), "controller.md 9.3" of `docs/design/controller.md` (the role
//! controller and predictive admission), "architecture.md 9.6" of `docs/design/architecture.md`
//! (this router's design and its deliberate departures from the reference). Beside them,
//! `handoff-and-lifecycle.md` (the HA handoff and engine lifecycle contract, cited by heading,
//! e.g. "Readmitting engines"), `ha-and-fencing.md` (lease, epochs, fencing, the standby) and
//! `engine-protocols.md` (vLLM and SGLang descriptors, bootstrap, engine routes and metrics).
//! A full path such as `docs/ha.md` or `docs/http-api.md` names an operator document.
//!
//! ```text
//!  clients ──► data listener ──► ingress ──► admission ──► placement ──► prefill leg ─┐
//!                                   │                                    decode leg ◄┘ (vLLM:
//!                                   ▼                                       │  descriptor, SGLang:
//!                      accounting (one settle) ◄── relay ◄──────────────────┘  rendezvous)
//!                                   ├─► metrics  ├─► journal  └─► /narwhal/state, handoff
//!  monitor task ──► health gate, liveness, readmission probes (GET health_path, process facts)
//!                 ──► readmission: agent validation (lifecycle) or a generation probe
//!  controller task ◄── Track (request-path bookkeeping) ──► role flips (Fleet), role checks
//!                                                           and holds (lifecycle)
//! ```
//!
//! # Design note: module map, ownership, events, locks
//!
//! Modules depend on each other in one direction, from the bottom layer up; a lower layer
//! never names an upper one. `layering.rs` (a unit test) fails the build's tests when an
//! import cycle appears among the top-level modules or among the files of one module.
//!
//! | layer | modules | what they are |
//! |---|---|---|
//! | 0 pure cores | `config` (and `config::schema`, the accepted keys read from its validator), `profile`, `placement` (load, and the KV score), `kv_index` (the engines' KV blocks from their events, and `kv_index::approx`, those guessed from our own placements), `breaker`, `facts`, `ingress`, `outcome`, `retry`, `demand` (risk, windows, model) | rules with `now` and RNGs passed in; no clock, no IO (`facts`: an engine process's facts and when two readings name different processes). Below them, in crates of their own so Cargo enforces the direction: `narwhal-lease` (router/lease: the lease `machine`, the file and etcd backends and the renewal driver; re-exported here as `lease`) and `narwhal-relay` (router/relay: SSE parsing, token evidence, usage, whole-answer and batch merging, and `rawjson`, the byte-level JSON scanner the relay finds its few members with) |
//! | 0 leaves | `journal`, `metrics`, `response` | the journal writer, Prometheus families, JSON responses |
//! | 1 engine client | `upstream`, `failure` | legs to engines and how they fail; `RequestFailure`, the one map to status, body and settlement |
//! | 1 parts | `fleet`, `accounting`, `admission`, `ha_phase`, `kv_cache` (the KV index behind its lock, the event subscribers, `/tokenize` for scoring) | own their data behind narrow handles (below) |
//! | 2 | `readiness`, `bootstrap` | the readiness gate over `ha_phase` + `fleet`; what is read from an engine's own routes: SGLang bootstrap ports, process facts, whose fault a failed rendezvous is (`fleet` + `upstream`) |
//! | 3 | `lifecycle` (`action`, `api`, `agents`, `agent_checks`, `identity`, `executor`, `driver`) | drains, waves, readmission through the agents |
//! | 3 | `controller` (pure: `book`, `stage`, `scoring`, `evidence`, `roles`, `policy`, `machine`, `decision`; `driver`, `intake`, `report`) | the demand-driven role controller and predictive admission's request-path side; over `fleet`, `lifecycle`, `demand`, `admission` |
//! | 4 | `parts` | `Parts`, a bundle of handles to every part, built once; owns nothing itself |
//! | 5 | `serve`, `documents`, `handoff`, `monitor` | the request pipeline; `/ready`, `/health`, `/narwhal/state`, `/metrics`; the handoff; breaker probes and the startup health wait |
//! | 6 | `ha` (`primary`, `standby`), `http` | the lease loop and the warm standby; the listeners and routes |
//! | 7 | `app`, `cli`, this root | wiring (`run`) and the command line |
//! | 8 | `fuzzing` (only with the `fuzzing` feature) | entry points of the fuzz targets (`tests/fuzz`): ingress, lifecycle bodies, the KV event stream |
//!
//! Upper modules keep their own pure cores: `lifecycle::{machine, events, validation, check_error}`
//! (drains, waves, readmission rules) and `ha::machine` (the standby's decisions) take `now`
//! and results as arguments and return what to do.
//!
//! **Ownership.** Each part owns its state; nothing else holds a lock on it:
//! - `Fleet`: engine slots (role, exclusions, resident counts), the breaker and the
//!   application of its transitions (exclusions, metrics, journal), suspect producers, the
//!   facts of each engine's current process (SGLang bootstrap port included); the live count
//!   is an atomic. One mutex, taken only inside `fleet.rs`; the startup wait listens on its
//!   `settled` notification.
//! - `Accounting`: the outcome tally (the single source `/narwhal/state`, `/metrics` and the
//!   handoff read), attempt/retry/upstream counters (atomics), the retry budget (a lock-free
//!   cell); it is the `SettleSink` every request settles into exactly once.
//! - `Admission`: retained-request limit, seats, queue (atomics and a semaphore).
//! - `Ha` (`ha_phase.rs`): the `HaPhase` (active, validating identities, shadowing, blocked,
//!   fenced) on a `tokio::sync::watch` channel, with the lease's local validity, the
//!   controller a standby saw, the current `EpochScope`, and the handoff publisher's slot.
//!   `/ready`, `/health`, `controls_fleet` and the metrics derive from it through pure
//!   functions.
//! - `LifecycleDriver`: the pure lifecycle machine (behind its `Executor`), the agents, and
//!   the one-action-at-a-time lock.
//! - `Gate` (`readiness.rs`): a mirror of the lifecycle's readiness hold, read with the HA
//!   phase and the live count on every request without the lifecycle's lock; and the graceful
//!   shutdown: an atomic "stopping" flag (`/ready` 503 `shutting down`) and the cancellation
//!   token that ends the requests still running when `serving.graceful_timeout_s` ran out.
//!   Shutdown is not an HA phase: the router keeps its lease and control until the last
//!   request ended, and the lease loop keeps publishing its phase meanwhile.
//! - `DemandRisk`: the newest consolidation-risk event (handoff `demand_risk`).
//! - `Controller`: the controller machine (bookkeeping, demand windows, role changes,
//!   decisions) behind one mutex taken only inside `controller/`; the request path feeds it
//!   through `Track` (one short lock per event), its driver task runs a pass every
//!   `monitor_interval_s` (or at once when the urgency latch or an availability change wakes
//!   it) and applies the machine's commands: `Fleet::set_role`, `Fleet::set_switching`,
//!   `Fleet::set_avoided`, `LifecycleDriver::role_check`, `DemandRisk::record`, the journal.
//!   It never holds its lock across a call into the fleet or the lifecycle. A standby,
//!   fenced or lifecycle-held router decides nothing (`Machine::interrupt`).
//!
//! **Events, not imports.** Lower layers tell upper ones what happened through channels:
//! the fleet notifies `resident_changed` (the lifecycle's timer re-evaluates drains),
//! `availability_changed` (the controller's floor edges) and `dirty` (the state-file writer
//! persists); the lease driver reports a lost renewal to
//! `ha::primary`, whose `Renewal::lost` tells the `ha` supervisor to run the standby; the
//! lifecycle machine emits typed `LifecycleEvent`s that its executor journals (only while
//! the router controls the fleet); the HA phase is published on its watch channel; the
//! handoff is published beside the lease record (`handoff::publish`) on `dirty`, after every
//! renewal (`LeaseDriver::renewed`), before a lifecycle action is acknowledged and before
//! totals are shown (ha-and-fencing.md); `app::run` drains on SIGTERM through the gate
//! (`begin_shutdown`, then `end_requests` at the budget), which the request path reads (the
//! readiness check, and a `select!` arm of the attempts and of the relay).
//!
//! **Locks.** No lock is held across a call into a higher layer, and the order is the layer
//! order: the lifecycle machine's mutex may be held while the fleet is asked or told
//! something (the executor applying holds), never the reverse (the fleet calls nothing
//! above it). Every other lock is private to one part and held for a few field updates.
//! The request path takes the fleet lock for placement and residency and the tally lock at
//! settlement; counters, the budget, admission, readiness and the HA phase are atomics or a
//! watch read.
//!
//! **Where later work lands.** Breaker and ejection policy: `breaker` (pure) and
//! `Fleet::apply`. The role controller is `controller` (above); predictive admission's pure
//! price is in `admission`, its waiting and placement hooks in `controller::intake`. Epoch-bound
//! work: take `Ha::scope()` when it starts (its agent calls carry `EpochScope::fence()`),
//! check `Ha::live` before each effect and stop on `EpochScope::ended()`; a part that decides
//! for the fleet (a role controller) watches `Ha::subscribe()` and decides nothing unless the
//! phase holds control (ha-and-fencing.md). Hot-path locks: placement state and the tally are
//! each behind one part's handle, replaceable without touching callers.

mod accounting;
mod admission;
mod app;
mod bootstrap;
mod breaker;
mod cli;
pub mod config;
mod controller;
mod demand;
mod documents;
mod engine_load;
mod facts;
mod failure;
mod fleet;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod ha;
mod ha_phase;
mod handoff;
mod http;
mod ingress;
mod journal;
mod kv_cache;
mod kv_index;
#[cfg(test)]
mod layering;
pub use narwhal_lease as lease;
mod lifecycle;
mod metrics;
mod monitor;
mod outcome;
mod parts;
mod placement;
mod profile;
mod readiness;
mod response;
mod restart_readmit;
mod retry;
mod self_drain;
mod serve;
mod stall;
mod upstream;

pub use app::{AnnounceError, Error, Listeners, RunOptions, run};
pub use cli::main_from_args;
pub use config::{Backend, Config, ConfigError, ConfigIssue, Role};
pub use ha::StandbyOptions;
pub use journal::Journal;
