//! Engine lifecycle: drain of one engine or a whole-fleet wave, `ready_to_stop` for external
//! supervisors, and readmission through the six checks of the seed (health, process-bound
//! attestation, configured model, direct generation, role-compatible KV transfer, final
//! health), each run through the engines' agents and each signed.
//!
//! ```text
//!  POST drain ──► machine::begin (held out of placement) ──► agents: attestation (identity)
//!                    ──► machine::bind_identity ──► refresh on resident change and on a timer
//!  POST readmit ──► machine::mark_validating ──► validation::validate (agents, signed)
//!                    ──► machine::readmitted | machine::validation_failed
//!  breaker ejection + health OK ──► recovery validation (no restart required)
//! ```
//!
//! `machine` and `validation` are pure (clock and I/O passed in); `driver` does the I/O.

pub mod machine;
pub mod validation;

pub(crate) mod driver;

pub use machine::{
    DrainPlan, DrainRecord, DrainRequest, DrainState, EngineOutcome, EngineView, Lifecycle,
    LifecycleError, Now,
};
pub use validation::{Attested, Checks, Identity, Plan, Report, fabric_pairs, validate};
