//! Engine lifecycle: drain of one engine or a whole-fleet wave, `ready_to_stop` for external
//! supervisors, and readmission through the six checks of handoff-and-lifecycle.md (health,
//! process-bound attestation, configured model, direct generation, role-compatible KV transfer,
//! final health), each run through the engines' agents and each signed.
//!
//! ```text
//!  POST drain ──api──► driver ──► machine::begin (held out of placement) ──► identity:
//!                    agents' attestation ──► machine::bind_identity ──► refresh on resident
//!                    change and on a timer
//!  POST readmit ──api──► driver ──► machine::mark_validating ──► validation::validate
//!                    (agent_checks: signed) ──► machine::readmitted | validation_failed
//!  breaker ejection + health OK ──► recovery validation (no restart required)
//!  every machine change ──► executor::commit (holds → fleet, readiness hold, journal)
//! ```
//!
//! `machine`, `events` and `validation` are pure (clock and I/O passed in); `check_error` is
//! what one check can find. `api` is the HTTP edge (bodies, the opening every action shares,
//! statuses, replies) over `action`'s types (requests, `Outcome`, `ActionError`); `driver`
//! runs the actions; `agents` is the agent registry and `agent_checks` runs the checks through
//! it; `identity` reads process identities and runs the startup/takeover identity check;
//! `executor` owns the machine and applies its decisions. Imports go one way:
//! `api` → `driver` → (`agent_checks`, `identity`, `executor`) → `machine`, `validation`.

pub(crate) mod machine;
pub(crate) mod validation;

pub(crate) mod action;
pub(crate) mod agent_checks;
pub(crate) mod agents;
pub(crate) mod api;
pub(crate) mod check_error;
pub(crate) mod driver;
pub(crate) mod executor;
pub(crate) mod identity;

pub(crate) use agents::AgentsError;
pub(crate) use machine::DrainState;
