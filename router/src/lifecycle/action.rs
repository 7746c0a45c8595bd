//! The typed edge of a lifecycle action, without HTTP: the request each action takes, what an
//! accepted action reports ([`Outcome`]) and every way one is refused ([`ActionError`], with
//! [`RequestError`] for a body that does not parse). `api` parses bodies into these types and
//! maps each refusal to its status code; `driver` runs the actions (handoff-and-lifecycle.md,
//! "Lifecycle API"; docs/http-api.md).
//!
//! ```text
//!  body ──api::parse_*──► DrainRequest | ReadmitRequest ──driver action──► Outcome
//!            └─RequestError─┐                               └─ActionError─┐
//!                           └──────────────► api::status ◄────────────────┘
//! ```

use super::machine::LifecycleError;

/// The `error` of every action refused because this router does not control the fleet (503).
pub(crate) const NOT_IN_CONTROL: &str = "this router does not control the fleet";

/// A readmission (`POST /narwhal/lifecycle/readmit`) or a cancel-drain
/// (`POST /narwhal/lifecycle/cancel-drain`, the same body): the shared request type narwhalctl
/// sends.
pub(crate) type ReadmitRequest = narwhal_shared::documents::requests::ReadmitBody;

/// Why a lifecycle request body was refused (HTTP 400).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum RequestError {
    /// Valid JSON, but not an object.
    #[error("the request body must be a JSON object")]
    NotAnObject,
    /// Not JSON.
    #[error("the request body is not valid JSON: {0}")]
    Json(String),
    /// A key the action does not take.
    #[error("unknown field {field:?} (expected {expected})")]
    UnknownField {
        /// The key.
        field: String,
        /// The keys the action takes, comma-separated.
        expected: String,
    },
    /// `engines` is not a list of strings.
    #[error("engines must be a list of engine ids (strings)")]
    Engines,
    /// `wave` is not a boolean.
    #[error("wave must be true or false")]
    Wave,
    /// `deadline_s` is not a number.
    #[error("deadline_s must be a number of seconds")]
    Deadline,
    /// `deadline_s` is a number out of range: not positive, or over a year.
    #[error("deadline_s must be > 0 and at most 31536000 seconds (one year), got {0}")]
    DeadlineRange(f64),
}

/// What an accepted action reports besides the lifecycle document (HTTP 200, `error` `""`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Outcome {
    /// The document's `warnings` (an individual drain's, one line per drained engine that was
    /// its role's only live engine; possibly empty); `None`: the document has no `warnings`.
    pub(crate) warnings: Option<Vec<String>>,
}

/// Why a lifecycle action was refused or did not complete: one variant per refusal, its
/// message the document's `error` byte for byte (docs/http-api.md). `api::status` maps each
/// to its HTTP status.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum ActionError {
    /// The body does not parse (400).
    #[error(transparent)]
    BadRequest(RequestError),
    /// This router does not control the fleet, or control under the action's epoch ended
    /// before it started (503).
    #[error("{}", NOT_IN_CONTROL)]
    NotInControl,
    /// A drain names engines without an agent (sorted): they could be held out but never
    /// bound to a process identity, so never readmitted (409; architecture.md 9.2).
    #[error(
        "no agent configured for {} (engines[].agent): process identity cannot be recorded",
        .0.join(", ")
    )]
    NoAgent(Vec<String>),
    /// The machine refused a drain or a readmission (404 unknown engines, 400 a deadline out
    /// of range, 409 every other rule; behaviour.md 4.3, 4.7).
    #[error(transparent)]
    Refused(LifecycleError),
    /// The machine refused a cancel-drain (409, whatever the rule).
    #[error(transparent)]
    CancelRefused(LifecycleError),
    /// Control under the drain's epoch ended while identities were captured (503).
    #[error("router control was fenced during drain")]
    FencedDuringDrain,
    /// Process identities could not be captured: `"<iid>: <detail>"` per engine, sorted (503;
    /// the engines stay held and the same drain retries).
    #[error("{}", .0.join("; "))]
    CaptureFailed(Vec<String>),
    /// Control under the action's epoch ended while the checks ran: nothing of them is
    /// applied, the records stay held (503).
    #[error("router control was fenced during validation")]
    FencedDuringValidation,
    /// A readmission's checks failed: every candidate is `blocked` with its failure (409).
    #[error("readmission validation failed")]
    ValidationFailed,
    /// A cancel-drain's checks failed, or the engine was restarted since the drain: it is
    /// `blocked`, restart-required (409).
    #[error("drain cancel validation failed")]
    CancelValidationFailed,
}
