//! The lifecycle actions at the HTTP edge (`POST /narwhal/lifecycle/drain`, `.../readmit`,
//! `.../cancel-drain`; handoff-and-lifecycle.md, "Lifecycle API"; docs/http-api.md): strict
//! parsing of the bodies (every error naming the field), the one opening every action shares
//! ([`act`]), the status each refusal answers ([`status`]) and the reply, always the lifecycle
//! document with its `error` (`""` on success).
//!
//! ```text
//!  handle(action, body)
//!    parse_drain | parse_readmit       ── RequestError ──► 400
//!    act: Ha::scope                    ── none ──────────► 503
//!         drain: check_agents          ── NoAgent ───────► 409
//!         serial lock, Ha::live(scope) ── ended ─────────► 503
//!         the driver's action          ── Outcome ► 200 | ActionError ► status(e)
//!    reply: the lifecycle document with `error`, rendered under the lock
//! ```
//!
//! What each action answers (docs/http-api.md):
//! - drain: 200 the targets are held (an individual drain's `warnings`); 400 a bad body or a
//!   deadline out of range; 404 an unknown engine; 409 a rule, or an engine without an agent;
//!   503 not in control, fenced during the drain, or an identity not captured.
//! - readmit: 200 readmitted; 400 a bad body; 404 an unknown engine; 409 a rule, or the checks
//!   failed; 503 not in control, or fenced during the checks.
//! - cancel-drain: 200 back in placement; 400 a bad body; 409 a rule (an unknown engine
//!   included), or the checks failed; 503 not in control, or fenced during the checks.

use narwhal_shared::documents::LifecycleReply;
use narwhal_shared::documents::requests::DrainBody;
use std::future::Future;

use bytes::Bytes;
use http::StatusCode;
use serde_json::{Map, Value};

use super::action::{ActionError, Outcome, ReadmitRequest, RequestError};
use super::driver::LifecycleDriver;
use super::machine::{DrainRequest, LifecycleError, MAX_DEADLINE_S};
use crate::ha_phase::EpochScope;

/// Default drain deadline, seconds (handoff-and-lifecycle.md, "Draining engines").
const DEFAULT_DEADLINE_S: f64 = 300.0;

/// A lifecycle action's answer: status and the lifecycle document with its `error`.
pub(crate) type Reply = (StatusCode, LifecycleReply);

/// A lifecycle POST route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// `POST /narwhal/lifecycle/drain`.
    Drain,
    /// `POST /narwhal/lifecycle/readmit`.
    Readmit,
    /// `POST /narwhal/lifecycle/cancel-drain` (ours; docs/deviations.md).
    CancelDrain,
}

/// Runs `action` on `body` (the bytes of the request body) and answers: the status and the
/// lifecycle document, whose `error` is the refusal's message (`""` on success).
pub(crate) async fn handle(lc: &LifecycleDriver, action: Action, body: &Bytes) -> Reply {
    match action {
        Action::Drain => {
            let admit = |req: &DrainRequest| lc.check_agents(req);
            let run = |req, scope| lc.drain(req, scope);
            act(lc, parse_drain(body), admit, run).await
        }
        Action::Readmit => {
            let run = |req, scope| lc.readmit(req, scope);
            act(lc, parse_readmit(body), |_| Ok(()), run).await
        }
        Action::CancelDrain => {
            let run = |req, scope| lc.cancel_drain(req, scope);
            act(lc, parse_readmit(body), |_| Ok(()), run).await
        }
    }
}

/// The opening every action shares, then the action: the parsed body (400 when it did not
/// parse), the epoch scope it runs under (503 when this router does not control the fleet),
/// `admit`'s checks of the request that need no lock, then the one-action-at-a-time lock and
/// control re-checked under it (503 when control under the scope ended meanwhile), then `run`.
/// The reply is rendered before the lock is released.
async fn act<R, Fut>(
    lc: &LifecycleDriver,
    parsed: Result<R, RequestError>,
    admit: impl FnOnce(&R) -> Result<(), ActionError>,
    run: impl FnOnce(R, EpochScope) -> Fut,
) -> Reply
where
    Fut: Future<Output = Result<Outcome, ActionError>>,
{
    let (req, scope) = match accept(lc, parsed, admit) {
        Ok(x) => x,
        Err(e) => return reply(lc, Err(e)),
    };
    let _serial = lc.serial().lock().await;
    if !lc.ha().live(&scope) {
        return reply(lc, Err(ActionError::NotInControl));
    }
    let result = run(req, scope).await;
    reply(lc, result)
}

/// The parsed request and the epoch scope it runs under, or the first refusal: the body, then
/// control of the fleet, then `admit`.
fn accept<R>(
    lc: &LifecycleDriver,
    parsed: Result<R, RequestError>,
    admit: impl FnOnce(&R) -> Result<(), ActionError>,
) -> Result<(R, EpochScope), ActionError> {
    let req = parsed.map_err(ActionError::BadRequest)?;
    let scope = lc.ha().scope().ok_or(ActionError::NotInControl)?;
    admit(&req)?;
    Ok((req, scope))
}

/// The HTTP status of a refusal (docs/http-api.md): 400 a body that does not parse or a
/// deadline out of range, 404 a drain or readmission naming an engine the fleet file does not
/// have, 409 every conflict with the lifecycle state (a repeated drain with another deadline
/// included) and failed checks, 503 when this router does not (or no longer) control the fleet
/// and when identities could not be captured.
pub(crate) fn status(e: &ActionError) -> StatusCode {
    match e {
        ActionError::BadRequest(_) => StatusCode::BAD_REQUEST,
        ActionError::Refused(LifecycleError::UnknownEngines(_)) => StatusCode::NOT_FOUND,
        ActionError::Refused(LifecycleError::BadDeadline | LifecycleError::DeadlineTooLong) => {
            StatusCode::BAD_REQUEST
        }
        ActionError::NoAgent(_)
        | ActionError::Refused(_)
        | ActionError::CancelRefused(_)
        | ActionError::ValidationFailed
        | ActionError::CancelValidationFailed => StatusCode::CONFLICT,
        ActionError::NotInControl
        | ActionError::FencedDuringDrain
        | ActionError::CaptureFailed(_)
        | ActionError::FencedDuringValidation => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The reply to an action's result: 200 and the document (with the outcome's `warnings`), or
/// the refusal's status and the document with its message as `error`.
fn reply(lc: &LifecycleDriver, result: Result<Outcome, ActionError>) -> Reply {
    match result {
        Ok(outcome) => {
            let mut doc: LifecycleReply = lc.document("").into();
            doc.warnings = outcome.warnings;
            (StatusCode::OK, doc)
        }
        Err(e) => (status(&e), lc.document(&e.to_string()).into()),
    }
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
    let deadline_s = match m.get("deadline_s") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let d = v.as_f64().ok_or(RequestError::Deadline)?;
            if !(d.is_finite() && d > 0.0 && d <= MAX_DEADLINE_S) {
                return Err(RequestError::DeadlineRange(d));
            }
            Some(d)
        }
    };
    let body = DrainBody {
        engines: engines(&m)?,
        wave: wave(&m)?,
        deadline_s,
    };
    Ok(DrainRequest {
        engines: body.engines,
        wave: body.wave,
        deadline_s: body.deadline_s.unwrap_or(DEFAULT_DEADLINE_S),
        deadline_given: body.deadline_s.is_some(),
    })
}

/// Parses a readmission (or cancel-drain) body: `{"engines": [...], "wave": bool}`.
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
            status(&ActionError::Refused(LifecycleError::UnknownEngines(vec![
                "zz".into()
            ]))),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            status(&ActionError::Refused(LifecycleError::DeadlineConflict {
                iid: "p0".into(),
                deadline_s: 60.0
            })),
            StatusCode::CONFLICT
        );
        let e = parse_readmit(&body(r#"{"deadline_s":1}"#)).unwrap_err();
        assert_eq!(
            e.to_string(),
            r#"unknown field "deadline_s" (expected engines, wave)"#
        );
    }

    /// Every refusal keeps the status and the `error` it answered before actions were typed
    /// (docs/http-api.md).
    #[test]
    fn every_refusal_has_its_status_and_message() {
        let unknown = || LifecycleError::UnknownEngines(vec!["zz".into()]);
        let cases = [
            (
                ActionError::BadRequest(RequestError::Wave),
                400,
                "wave must be true or false",
            ),
            (
                ActionError::NotInControl,
                503,
                "this router does not control the fleet",
            ),
            (
                ActionError::NoAgent(vec!["d0".into(), "p0".into()]),
                409,
                "no agent configured for d0, p0 (engines[].agent): process identity cannot be \
                 recorded",
            ),
            (
                ActionError::Refused(unknown()),
                404,
                "unknown engine(s): zz",
            ),
            (
                ActionError::Refused(LifecycleError::BadDeadline),
                400,
                "deadline_s must be positive",
            ),
            (
                ActionError::Refused(LifecycleError::LastSchedulable),
                409,
                "the last schedulable engine requires a whole-wave drain",
            ),
            (
                ActionError::CancelRefused(unknown()),
                409,
                "unknown engine(s): zz",
            ),
            (
                ActionError::FencedDuringDrain,
                503,
                "router control was fenced during drain",
            ),
            (
                ActionError::CaptureFailed(vec!["d0: down".into(), "p0: refused".into()]),
                503,
                "d0: down; p0: refused",
            ),
            (
                ActionError::FencedDuringValidation,
                503,
                "router control was fenced during validation",
            ),
            (
                ActionError::ValidationFailed,
                409,
                "readmission validation failed",
            ),
            (
                ActionError::CancelValidationFailed,
                409,
                "drain cancel validation failed",
            ),
        ];
        for (e, code, message) in cases {
            assert_eq!(
                (status(&e).as_u16(), e.to_string().as_str()),
                (code, message)
            );
        }
    }

    /// The shared opening, through [`handle`]: a body that does not parse is 400 before
    /// anything else, a router that does not control the fleet answers 503, a drain of an
    /// engine without an agent 409 before the lock, and the machine's refusals keep their
    /// statuses (an unknown engine: 404 for a drain or readmission, 409 for a cancel-drain).
    #[tokio::test]
    async fn the_opening_refuses_in_order_with_the_document() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (parts, _clock) = crate::ha_phase::tests::leased(dir.path());
        let ask = |action, body: &'static str| {
            let lc = parts.lifecycle.clone();
            async move {
                let (status, doc) = handle(&lc, action, &Bytes::from_static(body.as_bytes())).await;
                assert_eq!(doc.document.schema, "narwhal.lifecycle", "{doc:?}");
                let error = doc.document.error.clone();
                (status.as_u16(), error)
            }
        };
        let (code, error) = ask(Action::Drain, "{").await;
        assert_eq!(code, 400);
        assert!(
            error.starts_with("the request body is not valid JSON"),
            "{error}"
        );
        let standby = ask(Action::Readmit, r#"{"engines": ["d0"]}"#).await;
        assert_eq!(
            standby,
            (503, super::super::action::NOT_IN_CONTROL.to_string())
        );
        assert_eq!(parts.ha.lease().claim().await, Ok(1));
        parts.ha.publish(crate::ha_phase::HaPhase::Active);
        let cases = [
            (
                Action::Drain,
                r#"{"wave": true}"#,
                409,
                "no agent configured for d0, p0 (engines[].agent): process identity cannot be \
                 recorded",
            ),
            (
                Action::Drain,
                r#"{"engines": ["zz"]}"#,
                404,
                "unknown engine(s): zz",
            ),
            (
                Action::Readmit,
                r#"{"engines": ["zz"]}"#,
                404,
                "unknown engine(s): zz",
            ),
            (
                Action::Readmit,
                r#"{"engines": ["d0"]}"#,
                409,
                "d0 is active, expected drained",
            ),
            (
                Action::CancelDrain,
                r#"{"engines": ["zz"]}"#,
                409,
                "unknown engine(s): zz",
            ),
            (
                Action::CancelDrain,
                r#"{"engines": ["d0"]}"#,
                409,
                "d0 is active: only a draining, drained, deadline_exceeded or blocked drain can \
                 be cancelled",
            ),
        ];
        for (action, body, code, error) in cases {
            assert_eq!(ask(action, body).await, (code, error.to_string()), "{body}");
        }
    }
}
