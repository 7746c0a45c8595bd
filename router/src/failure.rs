//! Every way a completion request can fail, and the one place that maps a failure to what the
//! client sees (status, JSON body, `Retry-After`, or the SSE error frame after output) and to
//! what is counted (the [`Settlement`]: terminal, reason, journal error) (behaviour.md 1.9,
//! 7.7a): one map, recording who failed.
//!
//! ```text
//!  serve ──RequestFailure──► settlement() ──► accounting (counters, metrics, journal row)
//!                        └─► response(rid) (before output) | stream_frame() (after output)
//! ```
//!
//! Pure: no IO, no clock.

use bytes::Bytes;
use http::{Response, StatusCode};
use narwhal_shared::documents::ErrorReply;

use crate::admission::Refusal;
use crate::ingress::IngressError;
use crate::outcome::{Settlement, Terminal};
use crate::placement::Phase;
use crate::response::{Body, json_response, with_retry_after, with_retry_after_s};
use crate::upstream::LegError;
use narwhal_relay::{StreamFailure, error_frame};

/// Where a request ran out of time (each says so in the journal; the client sees 504
/// `request_expired`, or the `expired` error frame once output started).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Expiry {
    /// The client did not deliver its body before the request deadline.
    BodyRead,
    /// No admission seat before `serving.queue_timeout_s` (`deadline_first`: the request
    /// deadline came first).
    Queue {
        /// The request deadline, not the queue timeout, ended the wait.
        deadline_first: bool,
    },
    /// No first token before the request deadline.
    BeforeOutput,
    /// A leg's own limit that coincided with the request deadline; `detail` is the leg's error.
    LegAtDeadline {
        /// The leg error's detail.
        detail: String,
    },
    /// A non-streaming response was still being collected at the deadline.
    Collecting,
    /// The deadline passed after output started (streaming).
    AfterOutput,
}

/// Why a completion request did not complete.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RequestFailure {
    /// `max_concurrent + queue_capacity` requests are retained, or no seat is free and there
    /// is no queue: 429 `server_overloaded_error`.
    InflightLimit,
    /// The router is not ready (behaviour.md 1.3): 503; `no_engines` when it controls the
    /// fleet and only engines are missing (`backend_unavailable`), else `standby`. `reason` is
    /// the `/ready` reason, for the journal.
    NotReady {
        /// The `/ready` reason.
        reason: String,
        /// Controls the fleet, nothing held, no live engine.
        no_engines: bool,
    },
    /// The body could not be read from the client (it went away): settles `cancelled`.
    BodyUnreadable,
    /// Ingress refused the body (400, 404, 413).
    Invalid(IngressError),
    /// The request ran out of time.
    Expired(Expiry),
    /// The router lost control of the fleet (lease) before placing an attempt: 503 `standby`.
    NotInControl,
    /// No schedulable engine for an attempt: 503 `no_schedulable_engines`.
    NoEngine,
    /// Predictive admission refused the request (controller.md 10.6): 429
    /// `server_overloaded_error`, `Retry-After` per cause, counted `refused/<cause>`.
    Refused(Refusal),
    /// The last attempt's leg failed before output (after any retries): the engine's 4xx for
    /// a client fault, else 502 (504 for a timeout) typed with the leg's phase.
    Leg {
        /// The failed leg.
        phase: Phase,
        /// How it failed.
        err: LegError,
    },
    /// The decode stream failed after the first token: a non-streaming client gets 502 / 504,
    /// a streaming one (200 already sent) the `failed` error frame.
    Decode {
        /// How it failed.
        err: LegError,
        /// The client is streaming (output already reached it).
        streaming: bool,
    },
    /// The client did not deliver its body within `serving.body_read_timeout_s` (a client
    /// that stalls mid-body): 408 `request_timeout`, counted `invalid` (the client's fault;
    /// no engine was called).
    BodyTimeout {
        /// `serving.body_read_timeout_s`.
        limit_s: f64,
    },
    /// The router stopped (SIGTERM) and `serving.graceful_timeout_s` ran out while this
    /// request was still running: before output 503 `standby` with `Retry-After` (another
    /// router can serve it), after output the `failed` error frame; counted
    /// `failed/shutdown`, never as a client cancel (docs/http-api.md, graceful shutdown).
    ShutDown {
        /// Output already reached a streaming client.
        streaming: bool,
    },
}

/// The public message of a request cut by the graceful-shutdown budget.
const SHUTDOWN_MESSAGE: &str = "Router is shutting down";

/// The status a busy engine's answer (408, 429, 503: overload, not failure) becomes for the client
/// once the retries are spent: 429 for a 429, else 503, both with `Retry-After`; `None` for any
/// other failure.
fn busy(err: &LegError) -> Option<u16> {
    let status = match err {
        LegError::Status { status, .. } => *status,
        LegError::Stream(StreamFailure::UpstreamError { status, .. }) => *status,
        _ => return None,
    };
    match status {
        429 => Some(429),
        408 | 503 => Some(503),
        _ => None,
    }
}

/// `{"error": {"message", "type"}}`.
fn error_body(message: &str, ty: &str) -> ErrorReply {
    ErrorReply::new(message, ty)
}

/// `{"error": {"message", "type", "code"}}` with `code` = `type`.
fn coded_body(message: &str, ty: &str) -> ErrorReply {
    ErrorReply::coded(message, ty)
}

const EXPIRED_MESSAGE: &str = "original request deadline expired";

impl RequestFailure {
    /// The settlement counted for this failure (terminal, reason label, status, journal
    /// error, error type).
    pub(crate) fn settlement(&self) -> Settlement {
        let status = self.status().as_u16();
        match self {
            RequestFailure::InflightLimit => Settlement::new(
                Terminal::Rejected,
                "inflight_limit",
                status,
                "router in-flight limit reached",
                "server_overloaded_error",
            ),
            RequestFailure::NotReady { reason, .. } => Settlement::new(
                Terminal::Rejected,
                "not_ready",
                status,
                format!("not ready: {reason}"),
                self.not_ready_type(),
            ),
            RequestFailure::BodyUnreadable => Settlement::cancelled(),
            RequestFailure::Invalid(e) => {
                Settlement::new(Terminal::Invalid, "", status, e.to_string(), e.error_type())
            }
            RequestFailure::Expired(expiry) => {
                let (reason, error) = match expiry {
                    Expiry::BodyRead => (
                        "deadline",
                        "request body not received before the deadline".to_string(),
                    ),
                    Expiry::Queue {
                        deadline_first: true,
                    } => ("deadline", EXPIRED_MESSAGE.to_string()),
                    Expiry::Queue {
                        deadline_first: false,
                    } => ("queue_timeout", "queue deadline expired".to_string()),
                    Expiry::BeforeOutput => (
                        "deadline",
                        "request deadline expired before output".to_string(),
                    ),
                    Expiry::LegAtDeadline { detail } => (
                        "deadline",
                        format!("request deadline expired before output ({detail})"),
                    ),
                    Expiry::Collecting => (
                        "deadline",
                        "request deadline expired while collecting".to_string(),
                    ),
                    Expiry::AfterOutput => (
                        "deadline",
                        "request deadline expired after output".to_string(),
                    ),
                };
                let ty = match expiry {
                    Expiry::Queue {
                        deadline_first: false,
                    } => "queue_expired",
                    Expiry::AfterOutput => "decode",
                    _ => "request_expired",
                };
                Settlement::new(Terminal::Expired, reason, status, error, ty)
            }
            RequestFailure::NotInControl => Settlement::new(
                Terminal::Rejected,
                "not_ready",
                status,
                "the router lost control of the fleet before placing the request",
                "standby",
            ),
            RequestFailure::NoEngine => Settlement::new(
                Terminal::Failed,
                "no_engine",
                status,
                "no schedulable engine for this attempt",
                "no_schedulable_engines",
            ),
            RequestFailure::Refused(r) => Settlement::new(
                Terminal::Refused,
                r.cause,
                status,
                format!("refused: {}", r.cause),
                "server_overloaded_error",
            ),
            RequestFailure::Leg { phase, err } => match err.client_fault() {
                Some(_) => Settlement::new(
                    Terminal::Failed,
                    "engine_rejected",
                    status,
                    err.detail(),
                    "invalid_request_error",
                ),
                None => Settlement::new(
                    Terminal::Failed,
                    err.reason(),
                    status,
                    format!("{}: {}", phase.as_str(), err.detail()),
                    phase.as_str(),
                ),
            },
            RequestFailure::Decode { err, .. } => Settlement::new(
                Terminal::Failed,
                err.reason(),
                status,
                format!("decode: {}", err.detail()),
                "decode",
            ),
            RequestFailure::BodyTimeout { limit_s } => Settlement::new(
                Terminal::Invalid,
                "",
                status,
                format!(
                    "request body not received within serving.body_read_timeout_s ({limit_s} s)"
                ),
                "invalid_request_error",
            ),
            RequestFailure::ShutDown { streaming } => Settlement::new(
                Terminal::Failed,
                "shutdown",
                status,
                "serving.graceful_timeout_s ran out after SIGTERM",
                if *streaming { "decode" } else { "standby" },
            ),
        }
    }

    fn not_ready_type(&self) -> &'static str {
        match self {
            RequestFailure::NotReady {
                no_engines: true, ..
            } => "backend_unavailable",
            _ => "standby",
        }
    }

    /// The HTTP status: the one answered before output, 200 once output started.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            RequestFailure::InflightLimit | RequestFailure::Refused(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            RequestFailure::NotReady { .. }
            | RequestFailure::NotInControl
            | RequestFailure::NoEngine => StatusCode::SERVICE_UNAVAILABLE,
            RequestFailure::BodyUnreadable => StatusCode::BAD_REQUEST,
            RequestFailure::Invalid(e) => e.response().0,
            RequestFailure::Expired(Expiry::AfterOutput)
            | RequestFailure::Decode {
                streaming: true, ..
            } => StatusCode::OK,
            RequestFailure::Expired(_) => StatusCode::GATEWAY_TIMEOUT,
            RequestFailure::Leg { err, .. } if busy(err).is_some() => busy(err)
                .and_then(|s| StatusCode::from_u16(s).ok())
                .unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            RequestFailure::Leg { err, .. } => match err.client_fault() {
                Some((status, ..)) => {
                    StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST)
                }
                None => StatusCode::from_u16(err.http_status()).unwrap_or(StatusCode::BAD_GATEWAY),
            },
            RequestFailure::Decode { err, .. } => {
                StatusCode::from_u16(err.http_status()).unwrap_or(StatusCode::BAD_GATEWAY)
            }
            RequestFailure::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            RequestFailure::ShutDown { streaming: true } => StatusCode::OK,
            RequestFailure::ShutDown { streaming: false } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The JSON error body answered before output (behaviour.md 1.9). After output there
    /// is no body: see [`RequestFailure::stream_frame`].
    pub(crate) fn body(&self) -> ErrorReply {
        match self {
            RequestFailure::InflightLimit => {
                error_body("router in-flight limit reached", "server_overloaded_error")
            }
            RequestFailure::NotReady { .. } => {
                let message = match self.not_ready_type() {
                    "backend_unavailable" => "No engines are available",
                    _ => "Router is not ready",
                };
                coded_body(message, self.not_ready_type())
            }
            RequestFailure::BodyUnreadable => {
                error_body("request body read failed", "invalid_request_error")
            }
            RequestFailure::Invalid(e) => e.response().1,
            RequestFailure::Expired(Expiry::Queue {
                deadline_first: false,
            }) => error_body("queue deadline expired", "queue_expired"),
            RequestFailure::Expired(_) => error_body(EXPIRED_MESSAGE, "request_expired"),
            RequestFailure::NotInControl => coded_body("Router is not ready", "standby"),
            RequestFailure::NoEngine => {
                coded_body("Engine capacity is unavailable", "no_schedulable_engines")
            }
            RequestFailure::Refused(r) => error_body(&r.message, "server_overloaded_error"),
            RequestFailure::Leg { err, .. } if busy(err).is_some() => coded_body(
                "Every engine able to serve this request is busy; retry after the Retry-After delay",
                "server_overloaded_error",
            ),
            RequestFailure::Leg {
                err: err @ LegError::Local(_),
                ..
            } => coded_body(err.public_message(), "server_overloaded_error"),
            RequestFailure::Leg { phase, err } => match (err.engine_error(), err.client_fault()) {
                // The engine's own refusal, as it wrote it (docs/deviations.md).
                (Some(error), Some(_)) => ErrorReply {
                    error: error.clone(),
                },
                (None, Some((_, message, param))) => {
                    let mut reply = ErrorReply::invalid_request(message, None);
                    reply.error.param = Some(param.clone());
                    reply
                }
                (_, None) => coded_body(err.public_message(), phase.as_str()),
            },
            RequestFailure::Decode { err, .. } => {
                let message = match err {
                    LegError::Stream(StreamFailure::ResponseLimit) => {
                        "Response exceeds the configured limit"
                    }
                    _ => "Invalid non-streaming upstream response",
                };
                coded_body(message, "decode")
            }
            RequestFailure::BodyTimeout { limit_s } => ErrorReply::invalid_request(
                format!(
                    "request body not received within serving.body_read_timeout_s ({limit_s} s)"
                ),
                None,
            )
            .with_code("request_timeout"),
            RequestFailure::ShutDown { .. } => coded_body(SHUTDOWN_MESSAGE, "standby"),
        }
    }

    /// The `Retry-After` seconds, if the answer carries one (overload and readiness refusals,
    /// a shutdown before output, an engine's busy answer after the retries and a router out
    /// of connection resources: 1 s; a
    /// predictive refusal: its own, none for `prompt`).
    pub(crate) fn retry_after_s(&self) -> Option<u64> {
        match self {
            RequestFailure::InflightLimit
            | RequestFailure::NotReady { .. }
            | RequestFailure::NotInControl
            | RequestFailure::NoEngine
            | RequestFailure::ShutDown { streaming: false } => Some(1),
            RequestFailure::Leg { err, .. } if busy(err).is_some() => Some(1),
            RequestFailure::Leg {
                err: LegError::Local(_),
                ..
            } => Some(1),
            RequestFailure::Refused(r) => r.retry_after,
            _ => None,
        }
    }

    /// The full answer before output, with `x-request-id: rid`.
    ///
    /// A router out of connection resources also closes the client's connection
    /// (`Connection: close`): its descriptor is what another request needs.
    pub(crate) fn response(&self, rid: &str) -> Response<Body> {
        let r = json_response(self.status(), &self.body(), rid);
        let mut r = match self.retry_after_s() {
            Some(1) => with_retry_after(r),
            Some(n) => with_retry_after_s(r, n),
            None => r,
        };
        if matches!(
            self,
            RequestFailure::Leg {
                err: LegError::Local(_),
                ..
            }
        ) {
            r.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
        r
    }

    /// The single final SSE frame once output started (behaviour.md 1.9): `expired` for
    /// the deadline, `failed` with the public message for a failed stream; `None` before
    /// output.
    pub(crate) fn stream_frame(&self) -> Option<Bytes> {
        match self {
            RequestFailure::Expired(Expiry::AfterOutput) => {
                Some(error_frame("Request deadline expired", "decode", "expired"))
            }
            RequestFailure::Decode {
                err,
                streaming: true,
            } => Some(error_frame(err.public_message(), "decode", "failed")),
            RequestFailure::ShutDown { streaming: true } => {
                Some(error_frame(SHUTDOWN_MESSAGE, "decode", "failed"))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// The body as the client reads it.
    fn wire(f: &RequestFailure) -> Value {
        serde_json::to_value(f.body()).expect("an error body serialises")
    }

    fn leg(status: u16, message: &str) -> LegError {
        LegError::Status {
            status,
            message: message.into(),
            param: Value::Null,
        }
    }

    /// One failure and what it must map to: status, body `type`, whether it carries
    /// Retry-After, its terminal and reason.
    type Case = (
        RequestFailure,
        u16,
        &'static str,
        bool,
        Terminal,
        &'static str,
    );

    /// Every failure before output, each with its expected mapping.
    fn failure_cases() -> Vec<Case> {
        let mut cases = first_cases();
        cases.extend(later_cases());
        cases
    }

    /// The first half of [`failure_cases`].
    fn first_cases() -> Vec<Case> {
        vec![
            (
                RequestFailure::InflightLimit,
                429,
                "server_overloaded_error",
                true,
                Terminal::Rejected,
                "inflight_limit",
            ),
            (
                RequestFailure::NotReady {
                    reason: "no available engines".into(),
                    no_engines: true,
                },
                503,
                "backend_unavailable",
                true,
                Terminal::Rejected,
                "not_ready",
            ),
            (
                RequestFailure::NotReady {
                    reason: "shadowing".into(),
                    no_engines: false,
                },
                503,
                "standby",
                true,
                Terminal::Rejected,
                "not_ready",
            ),
            (
                RequestFailure::Invalid(IngressError::TooLarge { limit: 10 }),
                413,
                "request_too_large",
                false,
                Terminal::Invalid,
                "",
            ),
            (
                RequestFailure::Invalid(IngressError::InvalidJson),
                400,
                "invalid_request_error",
                false,
                Terminal::Invalid,
                "",
            ),
            (
                RequestFailure::Expired(Expiry::BodyRead),
                504,
                "request_expired",
                false,
                Terminal::Expired,
                "deadline",
            ),
            (
                RequestFailure::Expired(Expiry::Queue {
                    deadline_first: false,
                }),
                504,
                "queue_expired",
                false,
                Terminal::Expired,
                "queue_timeout",
            ),
            (
                RequestFailure::Expired(Expiry::Queue {
                    deadline_first: true,
                }),
                504,
                "request_expired",
                false,
                Terminal::Expired,
                "deadline",
            ),
            (
                RequestFailure::NotInControl,
                503,
                "standby",
                true,
                Terminal::Rejected,
                "not_ready",
            ),
            (
                RequestFailure::NoEngine,
                503,
                "no_schedulable_engines",
                true,
                Terminal::Failed,
                "no_engine",
            ),
        ]
    }

    /// The second half of [`failure_cases`].
    fn later_cases() -> Vec<Case> {
        vec![
            (
                RequestFailure::Leg {
                    phase: Phase::Prefill,
                    err: leg(500, "CUDA error"),
                },
                502,
                "prefill",
                false,
                Terminal::Failed,
                "engine_error",
            ),
            // Overload is not failure: a busy engine's 503 or 429 reaches
            // the client as a back-off answer, not a 502.
            (
                RequestFailure::Leg {
                    phase: Phase::Prefill,
                    err: leg(503, "busy"),
                },
                503,
                "server_overloaded_error",
                true,
                Terminal::Failed,
                "engine_overloaded",
            ),
            (
                RequestFailure::Leg {
                    phase: Phase::Decode,
                    err: leg(429, "too many requests"),
                },
                429,
                "server_overloaded_error",
                true,
                Terminal::Failed,
                "engine_overloaded",
            ),
            (
                RequestFailure::Leg {
                    phase: Phase::Decode,
                    err: LegError::FirstTokenTimeout,
                },
                504,
                "decode",
                false,
                Terminal::Failed,
                "engine_timeout",
            ),
            (
                RequestFailure::Leg {
                    phase: Phase::Prefill,
                    err: leg(400, "prompt too long"),
                },
                400,
                "invalid_request_error",
                false,
                Terminal::Failed,
                "engine_rejected",
            ),
            (
                RequestFailure::Decode {
                    err: LegError::Stream(StreamFailure::ResponseLimit),
                    streaming: false,
                },
                502,
                "decode",
                false,
                Terminal::Failed,
                "response_limit",
            ),
            (
                RequestFailure::BodyTimeout { limit_s: 30.0 },
                408,
                "invalid_request_error",
                false,
                Terminal::Invalid,
                "",
            ),
            (
                RequestFailure::ShutDown { streaming: false },
                503,
                "standby",
                true,
                Terminal::Failed,
                "shutdown",
            ),
            (
                RequestFailure::Leg {
                    phase: Phase::Decode,
                    err: LegError::Stream(StreamFailure::UpstreamError {
                        status: 400,
                        message: "prompt is too long".into(),
                    }),
                },
                400,
                "invalid_request_error",
                false,
                Terminal::Failed,
                "engine_rejected",
            ),
            (
                RequestFailure::Leg {
                    phase: Phase::Prefill,
                    err: LegError::Local(crate::upstream::ConnectFailure {
                        call: crate::upstream::EngineCall::Leg,
                        stage: crate::upstream::ConnectStage::Connect,
                        kind: crate::upstream::TransportKind::Local(
                            crate::upstream::LocalResource::Descriptors,
                        ),
                        url: "http://10.0.0.7:8000/v1/completions".into(),
                        chain: "client error (Connect): Too many open files (os error 24)".into(),
                    }),
                },
                503,
                "server_overloaded_error",
                true,
                Terminal::Failed,
                "local_pool",
            ),
        ]
    }

    /// Every failure before output: status, body type, Retry-After, and what is counted
    /// (behaviour.md 1.9 and 7.7a).
    #[test]
    fn each_failure_maps_to_one_status_body_and_settlement() {
        let cases = failure_cases();
        for (f, status, ty, retry_after, terminal, reason) in cases {
            assert_eq!(f.retry_after_s().is_some(), retry_after, "{f:?}");
            let r = f.response("rid-1");
            assert_eq!(r.status().as_u16(), status, "{f:?}");
            assert_eq!(wire(&f)["error"]["type"], ty, "{f:?}");
            assert_eq!(
                r.headers().contains_key(http::header::RETRY_AFTER),
                retry_after,
                "{f:?}"
            );
            assert_eq!(r.headers()["x-request-id"], "rid-1");
            let s = f.settlement();
            assert_eq!((s.terminal, s.reason.as_str()), (terminal, reason), "{f:?}");
            assert_eq!(s.status, Some(status), "{f:?}");
            assert!(f.stream_frame().is_none(), "{f:?}");
        }
    }

    #[test]
    fn client_faults_carry_the_engine_message_and_param() {
        let f = RequestFailure::Leg {
            phase: Phase::Decode,
            err: LegError::Status {
                status: 500,
                message: "prompt is too long for the context length".into(),
                param: json!("prompt"),
            },
        };
        assert_eq!(f.status(), StatusCode::BAD_REQUEST);
        let b = wire(&f);
        assert_eq!(
            b["error"]["message"],
            "prompt is too long for the context length"
        );
        assert_eq!(b["error"]["param"], "prompt");
        assert_eq!(b["error"]["code"], Value::Null);
        assert_eq!(
            f.settlement().error_type.as_deref(),
            Some("invalid_request_error")
        );
    }

    /// An engine that refused the router (its API key, a route it lacks) is the engine's
    /// failure: the client gets a 5xx typed with the phase, never `invalid_request_error`.
    #[test]
    fn an_engine_refusing_the_router_is_a_5xx_for_the_client() {
        let f = RequestFailure::Leg {
            phase: Phase::Decode,
            err: LegError::Status {
                status: 401,
                message: "Unauthorized".into(),
                param: Value::Null,
            },
        };
        assert_eq!(f.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(wire(&f)["error"]["type"], "decode");
        assert_eq!(wire(&f)["error"]["message"], "Upstream request failed");
        let s = f.settlement();
        assert_eq!(s.reason, "engine_config");
        assert_eq!(s.error_type.as_deref(), Some("decode"));
    }

    /// An engine's refusal with its own error object reaches the client as the engine wrote
    /// it, with the engine's status (llama.cpp's context-length 400 keeps
    /// its `code`), and is counted `failed/engine_rejected`.
    #[test]
    fn an_engine_refusal_is_relayed_as_the_engine_wrote_it() {
        let error = json!({"message": "This model's maximum context length is 256 tokens",
                           "type": "invalid_request_error", "param": "messages",
                           "code": "context_length_exceeded"});
        let f = RequestFailure::Leg {
            phase: Phase::Decode,
            err: LegError::Refused {
                status: 400,
                error: Box::new(serde_json::from_value(error.clone()).unwrap()),
            },
        };
        assert_eq!(f.status(), StatusCode::BAD_REQUEST);
        assert_eq!(wire(&f), json!({ "error": error }));
        let s = f.settlement();
        assert_eq!(
            (s.terminal, s.reason.as_str()),
            (Terminal::Failed, "engine_rejected")
        );
    }

    #[test]
    fn engine_details_reach_the_journal_never_the_client() {
        let f = RequestFailure::Leg {
            phase: Phase::Prefill,
            err: LegError::Connect(crate::upstream::ConnectFailure {
                call: crate::upstream::EngineCall::Leg,
                stage: crate::upstream::ConnectStage::Connect,
                kind: crate::upstream::TransportKind::Refused,
                url: "10.0.0.7:8000".into(),
                chain: "refused".into(),
            }),
        };
        assert_eq!(wire(&f)["error"]["message"], "Upstream request failed");
        assert_eq!(
            f.settlement().error.as_deref(),
            Some("prefill: connect 10.0.0.7:8000: refused")
        );
    }

    #[test]
    fn after_output_the_answer_is_one_error_frame_and_status_200() {
        let expired = RequestFailure::Expired(Expiry::AfterOutput);
        let s = expired.settlement();
        assert_eq!((s.terminal, s.status), (Terminal::Expired, Some(200)));
        assert_eq!(s.error_type.as_deref(), Some("decode"));
        let frame = expired.stream_frame().expect("frame");
        assert!(
            std::str::from_utf8(&frame)
                .unwrap()
                .contains("\"code\":\"expired\""),
        );
        let failed = RequestFailure::Decode {
            err: LegError::ReadTimeout,
            streaming: true,
        };
        let s = failed.settlement();
        assert_eq!(
            (s.terminal, s.reason.as_str(), s.status),
            (Terminal::Failed, "engine_timeout", Some(200))
        );
        let frame = failed.stream_frame().expect("frame");
        let text = std::str::from_utf8(&frame).unwrap();
        assert!(text.contains("\"code\":\"failed\"") && text.contains("Upstream request failed"));
    }

    /// Graceful shutdown (docs/http-api.md): a stream still running when the budget runs
    /// out ends with the documented error frame and is settled failed, not cancelled.
    #[test]
    fn a_stream_cut_by_the_shutdown_budget_ends_with_an_error_frame_and_fails() {
        let f = RequestFailure::ShutDown { streaming: true };
        let s = f.settlement();
        assert_eq!(
            (s.terminal, s.reason.as_str(), s.status),
            (Terminal::Failed, "shutdown", Some(200))
        );
        let frame = f.stream_frame().expect("frame");
        assert_eq!(
            &frame[..],
            b"data: {\"error\":{\"message\":\"Router is shutting down\",\"type\":\"decode\",\"code\":\"failed\"}}\n\n"
        );
    }

    #[test]
    fn an_unreadable_body_settles_cancelled_with_a_400() {
        let f = RequestFailure::BodyUnreadable;
        assert_eq!(f.settlement().terminal, Terminal::Cancelled);
        assert_eq!(f.status(), StatusCode::BAD_REQUEST);
        assert_eq!(wire(&f)["error"]["message"], "request body read failed");
    }

    /// A predictive refusal (controller.md 10.6): 429 `server_overloaded_error` without
    /// `code`, its own `Retry-After`, counted `refused/<cause>`.
    #[test]
    fn a_predictive_refusal_answers_429_with_its_retry_after() {
        use crate::admission::{Price, judge};
        let price = Price {
            attempt: 1,
            backlog_s: 3.03,
            own_prefill_s: 0.11,
            elapsed_s: 0.0,
            handoff_s: 0.0,
            price_s: 3.03 + 0.11,
        };
        let f = RequestFailure::Refused(judge(&price, 2.0, 0.11, false).expect("refused"));
        let r = f.response("rid-1");
        assert_eq!(r.status().as_u16(), 429);
        assert_eq!(r.headers()[http::header::RETRY_AFTER], "2");
        assert_eq!(wire(&f)["error"]["type"], "server_overloaded_error");
        assert!(wire(&f)["error"].get("code").is_none());
        let s = f.settlement();
        assert_eq!(
            (s.terminal, s.reason.as_str()),
            (Terminal::Refused, "queue")
        );
        assert_eq!(s.error.as_deref(), Some("refused: queue"));
        let own = Price {
            backlog_s: 0.0,
            own_prefill_s: 3.01,
            price_s: 3.01,
            ..price
        };
        let f = RequestFailure::Refused(judge(&own, 2.0, 3.01, false).expect("refused"));
        assert!(
            !f.response("rid-2")
                .headers()
                .contains_key(http::header::RETRY_AFTER)
        );
    }
}
