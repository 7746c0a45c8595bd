//! Lifecycle request bodies (`POST /narwhal/lifecycle/drain`, `.../readmit`;
//! handoff-and-lifecycle.md, "Lifecycle API"): strict parsing, every error naming the field
//! (answered 400 with the lifecycle document), and the status each refusal of the lifecycle machine
//! answers with ([`refusal_status`]: 404 for an unknown engine, 409 for a conflict).

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Map, Value};

use super::machine::{DrainRequest, LifecycleError, MAX_DEADLINE_S};

/// Default drain deadline, seconds (handoff-and-lifecycle.md, "Draining engines").
const DEFAULT_DEADLINE_S: f64 = 300.0;

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

/// The HTTP status of a lifecycle action the machine refused: 404 when it names an engine
/// the fleet file does not have, 400 for a deadline out of range, 409 for every conflict
/// with the current lifecycle state (a drain repeated with another deadline included).
pub(crate) fn refusal_status(e: &LifecycleError) -> StatusCode {
    match e {
        LifecycleError::UnknownEngines(_) => StatusCode::NOT_FOUND,
        LifecycleError::BadDeadline | LifecycleError::DeadlineTooLong => StatusCode::BAD_REQUEST,
        _ => StatusCode::CONFLICT,
    }
}

/// A readmission request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ReadmitRequest {
    /// Target engine ids; empty with `wave` means the active wave's engines.
    pub(crate) engines: Vec<String>,
    /// Readmit the whole wave as one engine set.
    pub(crate) wave: bool,
}

fn object(body: &Bytes, known: &[&str]) -> Result<Map<String, Value>, RequestError> {
    let m = if body.iter().all(u8::is_ascii_whitespace) {
        Map::new()
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(RequestError::NotAnObject),
            Err(e) => return Err(RequestError::Json(e.to_string())),
        }
    };
    if let Some(k) = m.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(RequestError::UnknownField {
            field: k.clone(),
            expected: known.join(", "),
        });
    }
    Ok(m)
}

fn engines(m: &Map<String, Value>) -> Result<Vec<String>, RequestError> {
    match m.get("engines") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or(RequestError::Engines))
            .collect(),
        Some(_) => Err(RequestError::Engines),
    }
}

fn wave(m: &Map<String, Value>) -> Result<bool, RequestError> {
    match m.get("wave") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(RequestError::Wave),
    }
}

/// Parses a drain body: `{"engines": [...], "wave": bool, "deadline_s": seconds}`, every key
/// optional (an empty body is `{}`; `deadline_s` defaults to 300 and must be in (0, one
/// year]).
///
/// # Errors
/// [`RequestError`] naming the field.
pub(crate) fn parse_drain(body: &Bytes) -> Result<DrainRequest, RequestError> {
    let m = object(body, &["engines", "wave", "deadline_s"])?;
    let (deadline_s, deadline_given) = match m.get("deadline_s") {
        None | Some(Value::Null) => (DEFAULT_DEADLINE_S, false),
        Some(v) => {
            let d = v.as_f64().ok_or(RequestError::Deadline)?;
            if !(d.is_finite() && d > 0.0 && d <= MAX_DEADLINE_S) {
                return Err(RequestError::DeadlineRange(d));
            }
            (d, true)
        }
    };
    Ok(DrainRequest {
        engines: engines(&m)?,
        wave: wave(&m)?,
        deadline_s,
        deadline_given,
    })
}

/// Parses a readmission body: `{"engines": [...], "wave": bool}`.
///
/// # Errors
/// [`RequestError`] naming the field.
pub(crate) fn parse_readmit(body: &Bytes) -> Result<ReadmitRequest, RequestError> {
    let m = object(body, &["engines", "wave"])?;
    Ok(ReadmitRequest {
        engines: engines(&m)?,
        wave: wave(&m)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(s: &str) -> Bytes {
        Bytes::from(s.to_string())
    }

    #[test]
    fn drain_bodies_parse_with_defaults() {
        let r = parse_drain(&body("  ")).unwrap();
        assert_eq!(
            (r.engines.len(), r.wave, r.deadline_s),
            (0, false, DEFAULT_DEADLINE_S)
        );
        assert!(!r.deadline_given);
        let r = parse_drain(&body(r#"{"engines":["p0"],"deadline_s":5,"wave":null}"#)).unwrap();
        assert_eq!((r.engines, r.deadline_s), (vec!["p0".to_string()], 5.0));
        assert!(r.deadline_given);
        let r = parse_readmit(&body(r#"{"wave":true}"#)).unwrap();
        assert!(r.wave && r.engines.is_empty());
    }

    #[test]
    fn every_bad_body_names_its_field() {
        let cases = [
            ("[1]", "the request body must be a JSON object"),
            ("{", "the request body is not valid JSON"),
            (
                r#"{"deadline":1}"#,
                r#"unknown field "deadline" (expected engines, wave, deadline_s)"#,
            ),
            (
                r#"{"engines":"p0"}"#,
                "engines must be a list of engine ids (strings)",
            ),
            (
                r#"{"engines":[1]}"#,
                "engines must be a list of engine ids (strings)",
            ),
            (r#"{"wave":"yes"}"#, "wave must be true or false"),
            (
                r#"{"deadline_s":"soon"}"#,
                "deadline_s must be a number of seconds",
            ),
            (
                r#"{"deadline_s":-1}"#,
                "deadline_s must be > 0 and at most 31536000 seconds (one year), got -1",
            ),
            (r#"{"deadline_s":0}"#, "deadline_s must be > 0"),
            (r#"{"deadline_s":1e300}"#, "deadline_s must be > 0"),
        ];
        for (text, want) in cases {
            let e = parse_drain(&body(text)).unwrap_err().to_string();
            assert!(e.starts_with(want), "{text}: {e}");
        }
        assert_eq!(
            refusal_status(&LifecycleError::UnknownEngines(vec!["zz".into()])),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            refusal_status(&LifecycleError::DeadlineConflict {
                iid: "p0".into(),
                deadline_s: 60.0
            }),
            StatusCode::CONFLICT
        );
        let e = parse_readmit(&body(r#"{"deadline_s":1}"#)).unwrap_err();
        assert_eq!(
            e.to_string(),
            r#"unknown field "deadline_s" (expected engines, wave)"#
        );
    }
}
