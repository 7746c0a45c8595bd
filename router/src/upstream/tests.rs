//! Unit tests of the engine client: error classification, bounded reads, SSE assembly.
use super::*;
use serde_json::json;

#[test]
fn engine_errors_keep_their_status_and_never_lose_their_message() {
    let e = status_error(StatusCode::BAD_REQUEST, b"");
    assert_eq!(
        e.client_fault().map(|(s, m, _)| (s, m.to_string())),
        Some((
            400,
            "the engine answered 400 Bad Request without a message".to_string()
        ))
    );
    let e = status_error(
        StatusCode::BAD_REQUEST,
        br#"{"error": {"message": "This model's maximum context length is 256 tokens", "param": "messages", "code": "context_length_exceeded"}}"#,
    );
    assert_eq!(
        e.client_fault()
            .map(|(s, m, p)| (s, m.to_string(), p.clone())),
        Some((
            400,
            "This model's maximum context length is 256 tokens".to_string(),
            json!("messages")
        ))
    );
    assert_eq!(
        e.engine_error()
            .map(serde_json::to_value)
            .map(Result::unwrap),
        Some(
            json!({"message": "This model's maximum context length is 256 tokens",
                     "type": "invalid_request_error", "param": "messages",
                     "code": "context_length_exceeded"})
        ),
        "the engine's words, param and code, in OpenAI's shape"
    );
    // vLLM's shape (`type: BadRequestError`, `code: 400`): the reference's body.
    let v = status_error(
        StatusCode::BAD_REQUEST,
        br#"{"error": {"message": "too long", "type": "BadRequestError", "param": null, "code": 400}}"#,
    );
    assert!(v.engine_error().is_none());
    assert_eq!(v.client_fault().map(|c| c.0), Some(400));
    assert_eq!(e.class(Phase::Decode), None);
    assert!(!e.transient());
    // A 503 is no refusal: no error object is kept for the client.
    let busy = status_error(
        StatusCode::SERVICE_UNAVAILABLE,
        br#"{"error": {"message": "busy"}}"#,
    );
    assert!(busy.engine_error().is_none() && busy.client_fault().is_none());
    let e = status_error(StatusCode::BAD_REQUEST, br#"{"error": {"message": ""}}"#);
    assert_eq!(
        e.detail(),
        "engine answered 400: the engine answered 400 Bad Request without a message"
    );
    let e = status_error(StatusCode::BAD_REQUEST, b"bad request id");
    assert_eq!(
        e.client_fault().map(|c| c.1.to_string()),
        Some("bad request id".into())
    );
    // An in-stream error before output is judged like a status.
    let s = LegError::Stream(StreamFailure::UpstreamError {
        status: 500,
        message: "Requested tokens (300) exceed context window of 256".into(),
    });
    assert_eq!(s.client_fault().map(|c| c.0), Some(400));
    assert_eq!(s.class(Phase::Decode), None);
    let s = LegError::Stream(StreamFailure::UpstreamError {
        status: 500,
        message: "CUDA error".into(),
    });
    assert!(s.client_fault().is_none());
}

#[test]
fn an_engine_refusing_the_router_is_the_engines_failure_not_the_clients() {
    // vLLM `--api-key` without the right bearer token (server_utils.py's middleware).
    let e = status_error(StatusCode::UNAUTHORIZED, br#"{"error": "Unauthorized"}"#);
    assert_eq!(e.client_fault(), None);
    assert!(e.engine_error().is_none());
    assert!(e.transient(), "retried on another engine");
    assert_eq!(e.class(Phase::Decode), Some(FailureClass::EngineConfig));
    assert_eq!(e.class(Phase::Prefill), Some(FailureClass::EngineConfig));
    assert_eq!(e.reason(), "engine_config");
    assert_eq!(e.http_status(), 502);
    for status in [403u16, 404, 405] {
        let e = LegError::Status {
            status,
            message: "no".into(),
            param: Value::Null,
        };
        assert_eq!(e.client_fault(), None, "{status}");
        assert!(e.transient(), "{status}");
        assert_eq!(e.class(Phase::Decode), Some(FailureClass::EngineConfig));
    }
    let s = LegError::Stream(StreamFailure::UpstreamError {
        status: 401,
        message: "Unauthorized".into(),
    });
    assert_eq!(s.client_fault(), None);
    assert_eq!(s.class(Phase::Decode), Some(FailureClass::EngineConfig));
    // A genuine client error is still the client's.
    for status in [400u16, 413, 422] {
        let e = LegError::Status {
            status,
            message: "bad parameter".into(),
            param: Value::Null,
        };
        assert_eq!(e.client_fault().map(|c| c.0), Some(status));
        assert!(!e.transient());
        assert_eq!(e.class(Phase::Decode), None);
    }
}

/// A connect that failed for the router's own descriptors or memory is `local_pool`: no
/// breaker class, no retry, 503; any other I/O error in the chain is the engine's.
#[test]
fn the_routers_own_exhaustion_is_not_the_engines_failure() {
    #[derive(Debug)]
    struct Wrap(std::io::Error);
    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "client error (Connect)")
        }
    }
    impl std::error::Error for Wrap {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    for errno in [
        libc::EMFILE,
        libc::ENFILE,
        libc::ENOBUFS,
        libc::ENOMEM,
        libc::EADDRNOTAVAIL,
    ] {
        let e = Wrap(std::io::Error::from_raw_os_error(errno));
        assert!(local_exhaustion(&e), "errno {errno}");
    }
    for errno in [libc::ECONNREFUSED, libc::ECONNRESET, libc::ETIMEDOUT] {
        let e = Wrap(std::io::Error::from_raw_os_error(errno));
        assert!(!local_exhaustion(&e), "errno {errno}");
    }
    let local = LegError::Local("connect: Too many open files (os error 24)".into());
    assert_eq!(local.class(Phase::Prefill), None);
    assert_eq!(local.class(Phase::Decode), None);
    assert!(!local.transient());
    assert_eq!(local.reason(), "local_pool");
    assert_eq!(local.http_status(), 503);
}

#[test]
fn classification() {
    let ctx = LegError::Status {
        status: 500,
        message: "prompt is too long for the model's context length".into(),
        param: Value::Null,
    };
    assert_eq!(ctx.client_fault().map(|c| c.0), Some(400));
    assert!(!ctx.transient());
    assert_eq!(ctx.class(Phase::Prefill), None);
    let b = LegError::Status {
        status: 400,
        message: "bad".into(),
        param: Value::Null,
    };
    assert_eq!(b.reason(), "engine_rejected");
    let s = LegError::Status {
        status: 503,
        message: "busy".into(),
        param: Value::Null,
    };
    assert!(s.transient());
    assert_eq!(s.class(Phase::Decode), Some(FailureClass::Overload));
    assert_eq!(s.reason(), "engine_overloaded");
    let s = LegError::Status {
        status: 500,
        message: "CUDA error".into(),
        param: Value::Null,
    };
    assert_eq!(s.class(Phase::Decode), Some(FailureClass::InferenceStatus));
    let o = LegError::Status {
        status: 429,
        message: "slow".into(),
        param: Value::Null,
    };
    assert_eq!(o.class(Phase::Decode), Some(FailureClass::Overload));
    assert!(!LegError::KvHandoff("x".into()).transient());
    assert_eq!(
        LegError::KvHandoff("x".into()).class(Phase::Prefill),
        Some(FailureClass::KvHandoff)
    );
    assert_eq!(
        LegError::Connect("x".into()).class(Phase::Prefill),
        Some(FailureClass::Connection)
    );
    assert_eq!(LegError::FirstTokenTimeout.http_status(), 504);
}
