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

/// An error body in the OpenAI shape, `{"error": {"message", "type"[, "param"][, "code"]}}`:
/// every error the router answers (the data path's refusals and failures, behaviour.md 1.9;
/// `/narwhal/state` and `/narwhal/handoff` when their totals could not be made durable,
/// behaviour.md 1.7; the 404 and 405 of either listener), and an engine's own refusal passed
/// through as the engine wrote it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ErrorReply {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// `error` of an [`ErrorReply`]. `param` and `code` are written only when set: `Some(Null)`
/// writes `null`, as OpenAI's invalid-request errors carry both keys.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ErrorDetail {
    /// The message.
    pub message: String,
    /// Its class (`unavailable`, `not_found`, `invalid_request_error`, ...).
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault (a string, or `null`); absent when not written.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    pub param: Option<serde_json::Value>,
    /// A machine-readable code (a string such as `model_not_found`, an engine's number, or
    /// `null`); absent when not written.
    #[serde(skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    pub code: Option<serde_json::Value>,
    /// Any other member an engine's own error carried, kept in its order after these.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// A member that is present deserialises to `Some`, `null` included (absent stays `None`
/// through `#[serde(default)]`).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

impl ErrorReply {
    /// An error of class `kind` with `message`, `{"error": {"message", "type"}}`.
    pub fn new(message: impl Into<String>, kind: impl Into<String>) -> Self {
        ErrorReply {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.into(),
                ..ErrorDetail::default()
            },
        }
    }

    /// An error whose `code` repeats its `type`: `{"error": {"message", "type", "code"}}`.
    pub fn coded(message: impl Into<String>, kind: &str) -> Self {
        ErrorReply::new(message, kind).with_code(kind)
    }

    /// OpenAI's invalid-request error naming the field at fault (`None`: `null`):
    /// `{"error": {"message", "type": "invalid_request_error", "param", "code": null}}`.
    pub fn invalid_request(message: impl Into<String>, param: Option<&str>) -> Self {
        let mut reply = ErrorReply::new(message, "invalid_request_error");
        reply.error.param = Some(param.map_or(serde_json::Value::Null, Into::into));
        reply.error.code = Some(serde_json::Value::Null);
        reply
    }

    /// The same error with `code` set to `code`.
    #[must_use]
    pub fn with_code(mut self, code: &str) -> Self {
        self.error.code = Some(code.into());
        self
    }
}
