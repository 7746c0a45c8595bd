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
        assert!(local_exhaustion(&e).is_some(), "errno {errno}");
    }
    for errno in [libc::ECONNREFUSED, libc::ECONNRESET, libc::ETIMEDOUT] {
        let e = Wrap(std::io::Error::from_raw_os_error(errno));
        assert!(local_exhaustion(&e).is_none(), "errno {errno}");
    }
    let local = LegError::Local(ConnectFailure::new(
        EngineCall::Leg,
        ConnectStage::Connect,
        "http://e:8000/v1/completions",
        &Wrap(std::io::Error::from_raw_os_error(libc::EMFILE)),
    ));
    assert!(matches!(
        &local,
        LegError::Local(c) if c.kind == TransportKind::Local(LocalResource::Descriptors)
    ));
    assert_eq!(
        local.detail(),
        "connect http://e:8000/v1/completions: client error (Connect): Too many open files (os error 24)"
    );
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
    let kv = LegError::KvHandoff(KvHandoffFailure::NoDescriptor(NoDescriptor::Absent));
    assert!(!kv.transient());
    assert_eq!(kv.class(Phase::Prefill), Some(FailureClass::KvHandoff));
    assert_eq!(
        kv.detail(),
        "no handoff: the prefill answer carries no kv_transfer_params"
    );
    let connect = LegError::Connect(ConnectFailure {
        call: EngineCall::Leg,
        stage: ConnectStage::Request,
        kind: TransportKind::Reset,
        url: "http://e:8000/v1/completions".into(),
        chain: "connection reset".into(),
    });
    assert_eq!(
        connect.class(Phase::Prefill),
        Some(FailureClass::Connection)
    );
    assert_eq!(
        connect.detail(),
        "request http://e:8000/v1/completions: connection reset"
    );
    assert_eq!(LegError::FirstTokenTimeout.http_status(), 504);
    let prefill = LegError::Timeout(LegId::new("r", None, 1, "prefill").limit());
    assert_eq!(
        prefill.detail(),
        "prefill leg exceeded serving.prefill_timeout_s"
    );
    assert_eq!(prefill.class(Phase::Prefill), Some(FailureClass::Timeout));
    assert_eq!(
        (prefill.http_status(), prefill.reason()),
        (504, "engine_timeout")
    );
    assert_eq!(
        LegError::Timeout(LegId::new("r", Some(2), 1, "whole").limit()).detail(),
        "whole leg exceeded serving.request_timeout_s"
    );
}

/// An error whose source is `inner`, shown as `outer`: an error chain as hyper-util builds it.
#[derive(Debug)]
struct Chain(&'static str, std::io::Error);
impl std::fmt::Display for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}
impl std::error::Error for Chain {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.1)
    }
}

/// The transport's kind is read off the error chain: the router's own exhaustion, a
/// timeout, a refusal, a reset, a resolver's failure.
#[test]
fn the_transport_kind_is_read_off_the_error_chain() {
    use std::io::{Error, ErrorKind};
    let kind = |outer, e| TransportKind::of(&Chain(outer, e));
    assert_eq!(
        kind("tcp connect error", Error::from_raw_os_error(libc::ENFILE)),
        TransportKind::Local(LocalResource::Descriptors)
    );
    assert_eq!(
        kind("tcp open error", Error::from_raw_os_error(libc::ENOBUFS)),
        TransportKind::Local(LocalResource::Memory)
    );
    assert_eq!(
        kind(
            "tcp connect error",
            Error::from_raw_os_error(libc::EADDRNOTAVAIL)
        ),
        TransportKind::Local(LocalResource::Ports)
    );
    assert_eq!(
        kind("tcp connect error", Error::new(ErrorKind::TimedOut, "x")),
        TransportKind::TimedOut
    );
    assert_eq!(
        kind(
            "tcp connect error",
            Error::from_raw_os_error(libc::ECONNREFUSED)
        ),
        TransportKind::Refused
    );
    assert_eq!(
        kind("x", Error::from_raw_os_error(libc::ECONNRESET)),
        TransportKind::Reset
    );
    assert_eq!(
        kind(
            "dns error",
            Error::other("failed to lookup address information")
        ),
        TransportKind::Dns
    );
    assert_eq!(kind("x", Error::other("y")), TransportKind::Other);
}

/// The one error of the control calls and the probes says what failed, and shows the words
/// the journal and the logs have always shown for each call.
#[test]
fn an_engine_calls_failure_keeps_its_words() {
    let url = "http://e:8000/health";
    let refused = Chain(
        "client error (Connect)",
        std::io::Error::from_raw_os_error(libc::ECONNREFUSED),
    );
    let refused_chain = error_chain(&refused);
    let timed_out = Chain(
        "client error (Connect)",
        std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timeout"),
    );
    let emfile = Chain(
        "client error (Connect)",
        std::io::Error::from_raw_os_error(libc::EMFILE),
    );
    let emfile_chain = error_chain(&emfile);
    let err = |call, failure| EngineCallError { call, failure };
    let connect = |call, e: &Chain| {
        CallFailure::from(ConnectFailure::new(call, ConnectStage::Connect, url, e))
    };
    for call in [EngineCall::Get, EngineCall::Post, EngineCall::Probe] {
        let e = err(call, connect(call, &refused));
        assert!(!e.is_local() && !e.timed_out(), "{call:?}");
        let want = match call {
            EngineCall::Get => refused_chain.clone(),
            EngineCall::Probe => format!("unreachable: {refused_chain}"),
            _ => format!("connect {url}: {refused_chain}"),
        };
        assert_eq!(e.to_string(), want);
        let e = err(call, connect(call, &emfile));
        assert!(e.is_local(), "{call:?}");
        let want = match call {
            EngineCall::Post => {
                format!("router out of connection resources: connect {url}: {emfile_chain}")
            }
            _ => format!("router out of connection resources: {emfile_chain}"),
        };
        assert_eq!(e.to_string(), want);
        let e = err(call, CallFailure::TimedOut(Duration::from_millis(1500)));
        assert!(e.timed_out());
        let want = match call {
            EngineCall::Probe => "timed out: no answer within 1.500s",
            _ => "timed out after 1.500s",
        };
        assert_eq!(e.to_string(), want);
        let e = err(call, CallFailure::Body(BodyFailure::TooLarge));
        assert!(!e.timed_out() && !e.is_local());
        let want = match call {
            EngineCall::Probe => "unreachable: answer over the size limit",
            _ => "answer over the size limit",
        };
        assert_eq!(e.to_string(), want);
    }
    let probe = err(EngineCall::Probe, connect(EngineCall::Probe, &timed_out));
    assert!(probe.timed_out());
    assert_eq!(
        probe.to_string(),
        format!("timed out: {}", error_chain(&timed_out))
    );
    let bad = Request::builder()
        .uri("http://bad host/")
        .body(())
        .unwrap_err();
    let probe = err(
        EngineCall::Probe,
        CallFailure::Connect(ConnectFailure::bad_url(
            EngineCall::Probe,
            "http://bad host",
            &bad,
        )),
    );
    assert!(!probe.timed_out() && !probe.is_local());
    assert_eq!(
        probe.to_string(),
        format!("unreachable: bad engine URL http://bad host: {bad}")
    );
    let get = err(
        EngineCall::Get,
        CallFailure::Connect(ConnectFailure::bad_url(
            EngineCall::Get,
            "http://bad host",
            &bad,
        )),
    );
    assert_eq!(get.to_string(), bad.to_string());
    let cut = CutFailure::new(CutDuring::Answer, &refused);
    assert_eq!(
        LegError::Cut(cut.clone()).detail(),
        format!("reading the answer: {refused_chain}")
    );
    assert_eq!(
        err(EngineCall::Get, CallFailure::Body(BodyFailure::Cut(cut))).to_string(),
        refused_chain
    );
}
