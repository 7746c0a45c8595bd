//! What the lifecycle actions answer (`POST /narwhal/lifecycle/drain`, `.../readmit`,
//! `.../cancel-drain`; behaviour.md 1.10, handoff-and-lifecycle.md 2.3–2.6), and the error
//! body of the control routes that are not lifecycle documents.
//!
//! ```text
//!  200, 400, 404, 409, 503   the lifecycle document, `error` set ("" on success)
//!                            + `warnings` on an individual drain's 200
//!  /narwhal/state 503        {"error": {"message", "type": "unavailable"}}
//! ```

use serde::{Deserialize, Serialize};

use super::lifecycle::Lifecycle;

/// A lifecycle action's answer: the whole lifecycle document with its `error`, then, on the 200
/// of an individual drain only, `warnings` (behaviour.md 1.10; absent otherwise, `[]` when
/// there is nothing to warn about).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LifecycleReply {
    /// The lifecycle document after the action (its `error` says why it was refused).
    #[serde(flatten)]
    pub document: Lifecycle,
    /// One line per drained engine that was its role's only live engine, saying how traffic is
    /// served until one returns (ours; docs/operate.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warnings: Option<Vec<String>>,
}

impl From<Lifecycle> for LifecycleReply {
    fn from(document: Lifecycle) -> Self {
        LifecycleReply {
            document,
            warnings: None,
        }
    }
}

/// An error body in the OpenAI shape, `{"error": {"message", "type"}}`: `/narwhal/state` and
/// `/narwhal/handoff` when their totals could not be made durable (behaviour.md 1.7), and the
/// 404 and 405 of either listener.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ErrorReply {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// `error` of an [`ErrorReply`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ErrorDetail {
    /// The message.
    pub message: String,
    /// Its class (`unavailable`, `not_found`, `invalid_request_error`, ...).
    #[serde(rename = "type")]
    pub kind: String,
}

impl ErrorReply {
    /// An error of class `kind` with `message`.
    pub fn new(message: impl Into<String>, kind: impl Into<String>) -> Self {
        ErrorReply {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.into(),
            },
        }
    }
}
