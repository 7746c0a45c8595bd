//! What failed on a call to an engine, typed: the transport's failure read off its error chain
//! ([`TransportKind`], [`ConnectFailure`], [`CutFailure`]), what was wrong with an answer
//! ([`InvalidAnswer`], [`KvHandoffFailure`], [`EngineAbort`]), and the one error of the calls
//! outside a leg ([`EngineCallError`]: control calls and probes).
//!
//! Each cause keeps the error chain's text (the OS's and hyper's own words) for the journal;
//! its `Display` is the detail the journal, the logs and `/narwhal/state` have always shown.

use std::error::Error;
use std::fmt;
use std::time::Duration;

use http::StatusCode;

/// Which call to an engine failed: a leg of a request, or one of the router's own calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EngineCall {
    /// A leg of a request (prefill, decode or whole), or the monitor's generation probe.
    Leg,
    /// A control GET ([`super::Upstream::get`]: `/health`, `/server_info`).
    Get,
    /// A control POST ([`super::Upstream::post_json`]: `/tokenize`, `/pd_role_switch`).
    Post,
    /// A breaker probe ([`super::Upstream::probe_get`]: the health route, `/metrics`,
    /// `/v1/models`, `/server_info`).
    Probe,
}

/// Which of the router's own resources ran out for a connection ([`super::local_exhaustion`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LocalResource {
    /// File descriptors: the process's limit (`EMFILE`) or the system's (`ENFILE`).
    Descriptors,
    /// Kernel memory for a socket (`ENOBUFS`, `ENOMEM`).
    Memory,
    /// No local port left for the connection (`EADDRNOTAVAIL`).
    Ports,
}

/// What went wrong on the wire, read off an error chain ([`TransportKind::of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransportKind {
    /// The router itself was out of a resource: the connection never reached the engine.
    Local(LocalResource),
    /// An I/O timeout (the connect timeout, `engine.connect_timeout_s`).
    TimedOut,
    /// Nothing listens: the connection was refused.
    Refused,
    /// The connection was reset or aborted by the peer, or the pipe broke.
    Reset,
    /// The connection closed before the message was complete, or the request was dropped
    /// with it.
    Closed,
    /// The engine's host name did not resolve.
    Dns,
    /// The engine spoke something that is not HTTP/1 (a parse error).
    Protocol,
    /// The URL does not make a request (the router's configuration; the engine is not
    /// reached).
    InvalidUrl,
    /// Anything else (the chain says what).
    Other,
}

impl TransportKind {
    /// The kind of a failure, from its source chain: the router's own exhaustion first, then
    /// an I/O timeout, then the first I/O error kind or hyper predicate that names one, then a
    /// resolver's failure (hyper-util's `dns error`).
    pub(crate) fn of(e: &(dyn Error + 'static)) -> TransportKind {
        if let Some(r) = super::local_exhaustion(e) {
            return TransportKind::Local(r);
        }
        if super::is_timeout(e) {
            return TransportKind::TimedOut;
        }
        let mut dns = false;
        let mut src: Option<&(dyn Error + 'static)> = Some(e);
        while let Some(inner) = src {
            if let Some(io) = inner.downcast_ref::<std::io::Error>() {
                match io.kind() {
                    std::io::ErrorKind::ConnectionRefused => return TransportKind::Refused,
                    std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe => return TransportKind::Reset,
                    _ => {}
                }
            }
            if let Some(h) = inner.downcast_ref::<hyper::Error>() {
                if h.is_parse() {
                    return TransportKind::Protocol;
                }
                if h.is_incomplete_message() || h.is_closed() || h.is_canceled() {
                    return TransportKind::Closed;
                }
            }
            dns |= inner.to_string() == "dns error";
            src = inner.source();
        }
        if dns {
            TransportKind::Dns
        } else {
            TransportKind::Other
        }
    }
}

/// Where a request to an engine failed before any answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnectStage {
    /// The request could not be built from the URL.
    Build,
    /// Opening the connection (hyper-util's `is_connect`).
    Connect,
    /// Sending the request or waiting for the answer's head on an open connection.
    Request,
    /// The router's task that ran the leg ended without its result (it panicked or was
    /// cancelled): the SGLang prefill leg's task.
    Task,
}

/// A request to an engine that got no answer: where ([`ConnectStage`]) and why
/// ([`TransportKind`]), on which call, with the error chain's own words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConnectFailure {
    /// The call that failed.
    pub(crate) call: EngineCall,
    /// Where it failed.
    pub(crate) stage: ConnectStage,
    /// What failed.
    pub(crate) kind: TransportKind,
    /// The URL asked (empty for [`ConnectStage::Task`]).
    pub(crate) url: String,
    /// The error chain, `outer: inner: ...` (hyper's and the OS's words).
    pub(crate) chain: String,
}

impl ConnectFailure {
    /// The failure of `call` to `url` at `stage`, its kind read off the error `e`.
    pub(crate) fn new(
        call: EngineCall,
        stage: ConnectStage,
        url: &str,
        e: &(dyn Error + 'static),
    ) -> ConnectFailure {
        ConnectFailure {
            call,
            stage,
            kind: TransportKind::of(e),
            url: url.to_string(),
            chain: super::error_chain(e),
        }
    }

    /// The request of `call` to `url` could not be built (`e`: the builder's error).
    pub(crate) fn bad_url(call: EngineCall, url: &str, e: &http::Error) -> ConnectFailure {
        ConnectFailure {
            call,
            stage: ConnectStage::Build,
            kind: TransportKind::InvalidUrl,
            url: url.to_string(),
            chain: e.to_string(),
        }
    }

    /// The SGLang prefill leg's task ended without its result (`e`: tokio's words).
    pub(crate) fn task_ended(e: &tokio::task::JoinError) -> ConnectFailure {
        ConnectFailure {
            call: EngineCall::Leg,
            stage: ConnectStage::Task,
            kind: TransportKind::Other,
            url: String::new(),
            chain: e.to_string(),
        }
    }

    /// Whether the router's own resources ran out ([`TransportKind::Local`]).
    pub(crate) fn is_local(&self) -> bool {
        matches!(self.kind, TransportKind::Local(_))
    }
}

/// The journal's words: a leg's or a control POST's name the URL and the stage (`connect
/// <url>: `, `request <url>: `, `bad engine URL <url>: `), a probe's only a bad URL, a control
/// GET's none (the chain alone).
impl fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let url = &self.url;
        match (self.call, self.stage) {
            (_, ConnectStage::Task) => write!(f, "prefill task ended: ")?,
            (EngineCall::Get, _) => {}
            (_, ConnectStage::Build) => write!(f, "bad engine URL {url}: ")?,
            (EngineCall::Probe, _) => {}
            (EngineCall::Leg | EngineCall::Post, ConnectStage::Connect) => {
                write!(f, "connect {url}: ")?;
            }
            (EngineCall::Leg | EngineCall::Post, ConnectStage::Request) => {
                write!(f, "request {url}: ")?;
            }
        }
        f.write_str(&self.chain)
    }
}

/// Which answer was cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CutDuring {
    /// A whole answer read at once (a prefill's, a whole leg's, a control call's, a probe's).
    Answer,
    /// A decode leg's stream, after its answer's head.
    Stream,
}

/// An answer's body that failed mid-way (cut, reset, a protocol error), with the error
/// chain's own words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CutFailure {
    /// Which body.
    pub(crate) during: CutDuring,
    /// What failed.
    pub(crate) kind: TransportKind,
    /// The error chain (hyper's and the OS's words).
    pub(crate) chain: String,
}

impl CutFailure {
    /// The body read `during` failed with `e`.
    pub(crate) fn new(during: CutDuring, e: &(dyn Error + 'static)) -> CutFailure {
        CutFailure {
            during,
            kind: TransportKind::of(e),
            chain: super::error_chain(e),
        }
    }
}

/// A leg's words: `reading the answer: <chain>` for a whole answer, the chain alone for a
/// stream.
impl fmt::Display for CutFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.during == CutDuring::Answer {
            f.write_str("reading the answer: ")?;
        }
        f.write_str(&self.chain)
    }
}

/// What is wrong with a non-streamed answer the engine gave with status 200.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum InvalidAnswer {
    /// The answer does not parse as JSON.
    #[error("answer is not JSON: {parser}")]
    NotJson {
        /// The JSON parser's message (what and where).
        parser: String,
    },
    /// The answer has no `choices` array.
    #[error("answer has no choices array")]
    NoChoices,
}

/// Why an SGLang prefill engine's bootstrap port could not be learned from its
/// `/server_info` ([`crate::bootstrap::refresh`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum BootstrapError {
    /// The engine did not answer (connect error, timeout): the control call's failure.
    #[error("{0}")]
    Unreachable(EngineCallError),
    /// The router could not open the connection (out of descriptors or memory): nothing is
    /// known about the engine. The failure's kind names the resource.
    #[error("router out of connection resources: {0}")]
    Local(ConnectFailure),
    /// `/server_info` answered another status.
    #[error("{url} answered {status}")]
    Status {
        /// The `/server_info` URL.
        url: String,
        /// Its status.
        status: StatusCode,
    },
    /// The answer is not JSON.
    #[error("{url}: not JSON: {reason}")]
    NotJson {
        /// The `/server_info` URL.
        url: String,
        /// The parser's message.
        reason: String,
    },
    /// The answer has no usable `disaggregation_bootstrap_port`.
    #[error("{url}: no disaggregation_bootstrap_port")]
    NoPort {
        /// The `/server_info` URL.
        url: String,
    },
}

/// Why a vLLM prefill answer carries no usable KV descriptor (the answer is then a 502
/// naming it, never recomputed: docs/design/engine-protocols.md 2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NoDescriptor {
    /// Neither `choices[0].kv_transfer_params` nor `kv_transfer_params`.
    #[error("no handoff: the prefill answer carries no kv_transfer_params")]
    Absent,
    /// `kv_transfer_params` is empty or not an object.
    #[error("no handoff: kv_transfer_params is not a non-empty object")]
    NotAnObject,
    /// `remote_engine_id` missing, empty or not a string.
    #[error("no handoff: remote_engine_id must be a non-empty string")]
    EngineId,
    /// `remote_block_ids` is not a list of non-negative integers (or of such lists).
    #[error(
        "no handoff: remote_block_ids must be a list of non-negative integers or a list of such lists"
    )]
    BlockIds,
}

/// Why a prefill leg produced no usable KV handoff (descriptor or rendezvous).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum KvHandoffFailure {
    /// vLLM: the prefill's 200 answer has no usable KV descriptor.
    #[error("{0}")]
    NoDescriptor(NoDescriptor),
    /// SGLang: the prefill engine's bootstrap port could not be learned from its
    /// `/server_info` (the router's own exhaustion is [`super::LegError::Local`] instead).
    #[error("{0}")]
    BootstrapPort(BootstrapError),
    /// SGLang: the prefill engine's URL names no host for the decode's rendezvous.
    #[error("prefill engine URL has no host")]
    NoHost,
}

/// The elapsed limit of a leg that timed out ([`super::LegError::Timeout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum LegLimit {
    /// A prefill leg's, `serving.prefill_timeout_s` (or the request's deadline, if sooner).
    #[error("prefill leg exceeded serving.prefill_timeout_s")]
    Prefill,
    /// A whole (non-streaming, aggregated) leg's: the request's deadline,
    /// `serving.request_timeout_s`.
    #[error("whole leg exceeded serving.request_timeout_s")]
    Whole,
}

/// Why an engine gave a request up, answering 200.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum EngineAbort {
    /// A vLLM prefill's choices end with `finish_reason: "abort"` and carry no
    /// `kv_transfer_params`.
    #[error(
        "the prefill answered 200 with finish_reason \"abort\" and no kv_transfer_params (the engine aborted the request)"
    )]
    PrefillAborted,
}

/// Why an answer's body could not be read whole ([`super::read_bounded`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BodyFailure {
    /// The body is over the read's bound.
    TooLarge,
    /// The body failed mid-way.
    Cut(CutFailure),
}

/// What failed on a control call or a probe ([`EngineCallError`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CallFailure {
    /// The request got no answer: it could not be built, connected or sent, or the
    /// connection broke before the answer's head.
    Connect(ConnectFailure),
    /// The router could not open the connection: it is out of descriptors or memory
    /// ([`TransportKind::Local`]). Says nothing about the engine.
    Local(ConnectFailure),
    /// The answer's body could not be read whole (over the call's bound, or cut).
    Body(BodyFailure),
    /// No answer within the call's timeout.
    TimedOut(Duration),
}

impl From<ConnectFailure> for CallFailure {
    /// [`CallFailure::Local`] for the router's own exhaustion, else [`CallFailure::Connect`].
    fn from(c: ConnectFailure) -> CallFailure {
        if c.is_local() {
            CallFailure::Local(c)
        } else {
            CallFailure::Connect(c)
        }
    }
}

/// Why a call to an engine outside a leg got no answer: a control call
/// ([`super::Upstream::get`], [`super::Upstream::post_json`]) or a breaker probe
/// ([`super::Upstream::probe_get`]). An answer with any status is an answer, not this error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EngineCallError {
    /// The call that failed ([`EngineCall::Get`], [`EngineCall::Post`] or
    /// [`EngineCall::Probe`]).
    pub(crate) call: EngineCall,
    /// What failed.
    pub(crate) failure: CallFailure,
}

impl EngineCallError {
    /// Whether the router's own resources ran out ([`CallFailure::Local`]): nothing is known
    /// about the engine.
    pub(crate) fn is_local(&self) -> bool {
        matches!(self.failure, CallFailure::Local(_))
    }

    /// Whether the call timed out, or its connection could not be set up in time (the
    /// engine may be busy rather than gone); any other failure but [`Self::is_local`] finds
    /// the engine unreachable.
    pub(crate) fn timed_out(&self) -> bool {
        match &self.failure {
            CallFailure::TimedOut(_) => true,
            CallFailure::Connect(c) => {
                c.stage == ConnectStage::Connect && c.kind == TransportKind::TimedOut
            }
            _ => false,
        }
    }
}

/// The journal's words. A control call: the connect failure's words, `router out of
/// connection resources: ...`, `answer over the size limit`, the cut body's chain or `timed
/// out after <s>s`. A probe: `timed out: ...`, `unreachable: ...` or `router out of connection
/// resources: ...`.
impl fmt::Display for EngineCallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let probe = self.call == EngineCall::Probe;
        match &self.failure {
            CallFailure::Local(c) => write!(f, "router out of connection resources: {c}"),
            CallFailure::Connect(c) if probe && self.timed_out() => write!(f, "timed out: {c}"),
            CallFailure::TimedOut(d) if probe => {
                write!(f, "timed out: no answer within {:.3}s", d.as_secs_f64())
            }
            CallFailure::TimedOut(d) => write!(f, "timed out after {:.3}s", d.as_secs_f64()),
            other => {
                if probe {
                    f.write_str("unreachable: ")?;
                }
                match other {
                    CallFailure::Connect(c) => write!(f, "{c}"),
                    CallFailure::Body(BodyFailure::TooLarge) => {
                        f.write_str("answer over the size limit")
                    }
                    CallFailure::Body(BodyFailure::Cut(c)) => f.write_str(&c.chain),
                    CallFailure::Local(_) | CallFailure::TimedOut(_) => Ok(()),
                }
            }
        }
    }
}

impl Error for EngineCallError {}
