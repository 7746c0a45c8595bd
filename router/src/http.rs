//! The two HTTP listeners (architecture.md section 3) on hyper's servers, and their routes. A
//! plain listener speaks HTTP/1.1 and HTTP/2 on the same port: a connection that opens with
//! the HTTP/2 preface (prior knowledge, RFC 9113 section 3.3, as gateways and gRPC-style
//! clients send it) is served by hyper's HTTP/2 server, every other by its HTTP/1.1 server
//! ([`opens_with_h2_preface`]). Over HTTP/2 many streams share one connection and one
//! descriptor (docs/operate.md, "Many concurrent streams"). The control listener under
//! `control.tls` is HTTP/1.1 only.
//!
//! ```text
//!  data listener:    POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
//!                    GET /v1/models/{model}, GET /health, GET /ready
//!  control listener: GET /narwhal/state, /narwhal/handoff, /narwhal/lifecycle,
//!                    /narwhal/targets, /metrics, /health, /ready;
//!                    POST /narwhal/lifecycle/drain, /narwhal/lifecycle/readmit,
//!                    /narwhal/lifecycle/cancel-drain (ours)
//! ```
//!
//! hyper is used directly (not axum) so that a client disconnect drops the service future,
//! which is what cancels the upstream legs (behaviour.md 7.7).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use narwhal_shared::documents::ErrorReply;

use crate::documents;
use crate::ingress::Endpoint;
use crate::lifecycle::api::Action;
use crate::parts::Parts;
use crate::response::{Body, json_response};
use crate::serve::completion;

/// Largest lifecycle request body accepted, bytes.
const CONTROL_BODY_LIMIT: usize = 64 * 1024;

/// A control POST body that could not be read whole within [`CONTROL_BODY_LIMIT`] (a
/// transport error, or the limit reached).
#[derive(Debug, thiserror::Error)]
#[error("request body unreadable or over {limit} bytes: {0}", limit = CONTROL_BODY_LIMIT)]
struct BodyError(#[source] Box<dyn std::error::Error + Send + Sync>);

/// Reads a control POST body, bounded by [`CONTROL_BODY_LIMIT`].
///
/// # Errors
/// [`BodyError`] when the body cannot be read or is over the limit.
async fn read_control_body(req: Request<Incoming>) -> Result<bytes::Bytes, BodyError> {
    let limited = http_body_util::Limited::new(req.into_body(), CONTROL_BODY_LIMIT);
    match limited.collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(BodyError(e)),
    }
}

/// Which listener a connection arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Data,
    Control,
    /// `control.self_drain.listen`: engine pods' preStop hooks (bearer tokens, no client
    /// certificates).
    SelfDrain,
}

/// Answers one request. The control routes' steps that wait (a durable publish, a lifecycle
/// action's acknowledgement, a control body) are boxed where they are awaited, so this
/// future's size is a completion's: a request carries only what its own route needs (at
/// 10,000 streams waiting in the admission queue, each holds one).
async fn route(parts: Arc<Parts>, side: Side, mut req: Request<Incoming>) -> Response<Body> {
    let rid = uuid::Uuid::new_v4().to_string();
    let path = req.uri().path().to_string();
    // HEAD is GET without the content, wherever GET is served (RFC 9110 sections 9.1 and
    // 9.3.2): load balancers and monitors probe `/ready` and `/health` with it. The route
    // answers as for GET; hyper, which saw the HEAD, sends the status and headers (the
    // `content-length` the GET would have) and no body.
    if req.method() == Method::HEAD && allowed(side, &path).is_some_and(|a| a.starts_with("GET")) {
        *req.method_mut() = Method::GET;
    }
    let method = req.method().clone();
    match (side, method, path.as_str()) {
        (Side::Data, Method::POST, "/v1/completions") => {
            completion(parts, Endpoint::Completions, req).await
        }
        (Side::Data, Method::POST, "/v1/chat/completions") => {
            completion(parts, Endpoint::Chat, req).await
        }
        (Side::Data, Method::GET, "/v1/models") => {
            let created = parts.wall() as u64;
            json_response(
                StatusCode::OK,
                &documents::models(&parts.cfg, created),
                &rid,
            )
        }
        (Side::Data, Method::GET, p) if p.starts_with(MODELS_PREFIX) => model(&parts, p, &rid),
        (_, Method::GET, "/health") => {
            json_response(StatusCode::OK, &documents::health(&parts), &rid)
        }
        (_, Method::GET, "/ready") => {
            let (ready, body) = documents::ready(&parts);
            let mut r = json_response(
                if ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                },
                &body,
                &rid,
            );
            if !ready {
                r.headers_mut().insert(
                    http::header::RETRY_AFTER,
                    http::HeaderValue::from_static("1"),
                );
            }
            r
        }
        (Side::Control, Method::GET, "/narwhal/state") => {
            // Totals shown are durable first (ha-and-fencing.md; handoff::durable_document).
            match Box::pin(crate::handoff::durable_document(&parts, documents::state)).await {
                Ok(doc) => json_response(StatusCode::OK, &doc, &rid),
                Err(e) => json_response(StatusCode::SERVICE_UNAVAILABLE, &e, &rid),
            }
        }
        (Side::Control, Method::GET, "/narwhal/handoff") => {
            match Box::pin(crate::handoff::durable_document(
                &parts,
                crate::handoff::snapshot,
            ))
            .await
            {
                Ok(doc) => json_response(StatusCode::OK, &doc, &rid),
                Err(e) => json_response(StatusCode::SERVICE_UNAVAILABLE, &e, &rid),
            }
        }
        (Side::Control, Method::GET, "/narwhal/lifecycle") => {
            json_response(StatusCode::OK, &parts.lifecycle.document(""), &rid)
        }
        (
            Side::Control,
            Method::POST,
            "/narwhal/lifecycle/drain"
            | "/narwhal/lifecycle/readmit"
            | "/narwhal/lifecycle/cancel-drain",
        ) => {
            let body = match Box::pin(read_control_body(req)).await {
                Ok(b) => b,
                Err(e) => {
                    // The body may be unread: the connection cannot carry another request.
                    let doc = parts.lifecycle.document(&e.to_string());
                    let mut r = json_response(StatusCode::BAD_REQUEST, &doc, &rid);
                    r.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                    return r;
                }
            };
            let action = match path.as_str() {
                "/narwhal/lifecycle/drain" => Action::Drain,
                "/narwhal/lifecycle/cancel-drain" => Action::CancelDrain,
                _ => Action::Readmit,
            };
            Box::pin(lifecycle_action(parts, action, body, &rid)).await
        }
        (Side::SelfDrain, Method::POST, "/narwhal/self-drain") => {
            Box::pin(self_drain_post(parts, req, &rid)).await
        }
        (Side::SelfDrain, Method::GET, "/narwhal/self-drain") => {
            Box::pin(self_drain_get(parts, req.headers(), &rid)).await
        }
        (Side::Control, Method::GET, "/narwhal/targets") => {
            json_response(StatusCode::OK, &documents::targets(&parts.cfg), &rid)
        }
        (Side::Control, Method::GET, "/metrics") => {
            let text = documents::metrics(&parts);
            Box::pin(crate::handoff::publish_for_read(&parts)).await;
            let mut r = Response::new(Full::new(bytes::Bytes::from(text)).boxed());
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
            );
            r
        }
        (side, m, p) => match allowed(side, p) {
            Some(allow) => {
                let mut r = json_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &ErrorReply::new(
                        format!("method {m} not allowed on {p} (allowed: {allow})"),
                        "invalid_request_error",
                    ),
                    &rid,
                );
                r.headers_mut()
                    .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
                r
            }
            None => json_response(
                StatusCode::NOT_FOUND,
                &ErrorReply::new(format!("no route {p} on this listener"), "not_found"),
                &rid,
            ),
        },
    }
}

/// Runs lifecycle `action` on `body` and answers once it is acknowledged durable where a
/// successor reads ([`crate::handoff::acknowledged_action`]).
async fn lifecycle_action(
    parts: Arc<Parts>,
    action: Action,
    body: bytes::Bytes,
    rid: &str,
) -> Response<Body> {
    let (status, doc) = crate::handoff::acknowledged_action(&parts, action, body).await;
    json_response(status, &doc, rid)
}

/// A self-drain refusal as an error document.
fn refused(r: &crate::self_drain::Refusal, rid: &str) -> Response<Body> {
    let kind = match r.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::BAD_REQUEST => "invalid_request_error",
        _ => "unavailable",
    };
    json_response(r.status, &ErrorReply::new(r.message.clone(), kind), rid)
}

/// The calling pod and its engines' ids, or the refusal (module `self_drain`).
async fn self_drain_caller(
    parts: &Parts,
    headers: &http::HeaderMap,
) -> Result<(crate::self_drain::PodRef, Vec<String>), crate::self_drain::Refusal> {
    let sd = parts
        .self_drain
        .get()
        .ok_or_else(|| crate::self_drain::Refusal {
            status: StatusCode::NOT_FOUND,
            message: "control.self_drain is not configured".into(),
        })?;
    let token = crate::self_drain::bearer(headers)?;
    let pod = sd.pod_of(&token, parts.clock.now()).await?;
    let engines = sd.engines_of(&parts.cfg, &pod).await?;
    let names = engines
        .iter()
        .map(|i| parts.cfg.engines[*i].iid.clone())
        .collect();
    Ok((pod, names))
}

/// `POST /narwhal/self-drain`: drains the calling pod's engines (or the one it names among
/// them) with `control.self_drain.deadline_s`; engines already out of placement are left as
/// they are, so a preStop hook that runs twice changes nothing.
async fn self_drain_post(parts: Arc<Parts>, req: Request<Incoming>, rid: &str) -> Response<Body> {
    let headers = req.headers().clone();
    let body = match read_control_body(req).await {
        Ok(b) => b,
        Err(e) => {
            let r = crate::self_drain::Refusal {
                status: StatusCode::BAD_REQUEST,
                message: e.to_string(),
            };
            let mut resp = refused(&r, rid);
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
            return resp;
        }
    };
    let asked: crate::self_drain::SelfDrainBody = if body.iter().all(u8::is_ascii_whitespace) {
        crate::self_drain::SelfDrainBody::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => {
                let r = crate::self_drain::Refusal {
                    status: StatusCode::BAD_REQUEST,
                    message: format!("body: {e} (expected {{}} or {{\"engine\": \"<id>\"}})"),
                };
                return refused(&r, rid);
            }
        }
    };
    let (pod, mine) = match self_drain_caller(&parts, &headers).await {
        Ok(x) => x,
        Err(r) => return refused(&r, rid),
    };
    let targets: Vec<String> = match asked.engine {
        Some(e) if mine.contains(&e) => vec![e],
        Some(e) => {
            let r = crate::self_drain::Refusal {
                status: StatusCode::FORBIDDEN,
                message: format!(
                    "pod {pod} may drain only its own engine(s) ({}), not {e}",
                    mine.join(", ")
                ),
            };
            return refused(&r, rid);
        }
        None => mine,
    };
    if let Err(r) = attested_in_pod(&parts, &pod, &targets).await {
        return refused(&r, rid);
    }
    let doc = parts.lifecycle.document("");
    let fresh: Vec<String> = targets
        .iter()
        .filter(|iid| doc.engines.get(*iid).is_none_or(|e| !e.draining))
        .cloned()
        .collect();
    tracing::info!(%pod, engines = ?targets, draining_now = ?fresh, "self-drain");
    if fresh.is_empty() {
        // Already draining (a hook run twice, or a first call whose answer was lost): answer
        // only once that state is durable where a successor reads, as the first call would.
        let scope = parts.ha.scope();
        let (status, doc) = crate::handoff::acknowledge(
            &parts,
            StatusCode::OK,
            narwhal_shared::documents::LifecycleReply::from(doc),
            scope.as_ref(),
        )
        .await;
        return json_response(status, &doc, rid);
    }
    let deadline_s = parts
        .self_drain
        .get()
        .map_or(300.0, crate::self_drain::SelfDrain::deadline_s);
    let drain = narwhal_shared::documents::requests::DrainBody {
        engines: fresh,
        wave: false,
        deadline_s: Some(deadline_s),
    };
    let body = serde_json::to_vec(&drain).unwrap_or_default();
    lifecycle_action(parts, Action::Drain, body.into(), rid).await
}

/// Whether each of `targets` runs in `pod` as its agent attests it: an engine whose agent
/// reports the pod its process runs in (`ProcessIdentity::pod`, read from the process's
/// cgroup) must report this pod's UID. An engine outside a pod (no binding) is matched by its
/// address alone ([`crate::self_drain::SelfDrain::engines_of`]). This closes what an address
/// cannot: a pod IP reused by another pod, host-network pods sharing the node's address.
///
/// # Errors
/// 403 when an engine's process runs in another pod; 503 when its agent does not answer.
async fn attested_in_pod(
    parts: &Parts,
    pod: &crate::self_drain::PodRef,
    targets: &[String],
) -> Result<(), crate::self_drain::Refusal> {
    let agents = parts.lifecycle.agents();
    for iid in targets {
        let Some(i) = parts.cfg.engines.iter().position(|e| &e.iid == iid) else {
            continue;
        };
        let Some(agent) = agents.get(i) else { continue };
        match agent.process(iid).await {
            Ok(p) => match p.pod {
                Some(b) if b.pod_uid != pod.uid => {
                    return Err(crate::self_drain::Refusal {
                        status: StatusCode::FORBIDDEN,
                        message: format!(
                            "engine {iid} runs in another pod (uid {}), not in {pod}",
                            b.pod_uid
                        ),
                    });
                }
                _ => {}
            },
            Err(e) => {
                return Err(crate::self_drain::Refusal {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    message: format!("engine {iid}'s agent did not say which pod it runs in: {e}"),
                });
            }
        }
    }
    Ok(())
}

/// `GET /narwhal/self-drain`: the calling pod's engines and whether they may stop.
async fn self_drain_get(parts: Arc<Parts>, headers: &http::HeaderMap, rid: &str) -> Response<Body> {
    match self_drain_caller(&parts, headers).await {
        Ok((pod, mine)) => {
            let doc = parts.lifecycle.document("");
            json_response(
                StatusCode::OK,
                &crate::self_drain::status_of(&doc, &pod, &mine),
                rid,
            )
        }
        Err(r) => refused(&r, rid),
    }
}

/// `GET /v1/models/` + model id.
const MODELS_PREFIX: &str = "/v1/models/";

/// `GET /v1/models/{model}` as OpenAI answers it: the model object for the served model or one
/// of its adapters, else
/// 404 `model_not_found` naming the id (the id is percent-decoded and may contain `/`).
fn model(parts: &Parts, path: &str, rid: &str) -> Response<Body> {
    let raw = &path[MODELS_PREFIX.len()..];
    let id = percent_encoding::percent_decode_str(raw).decode_utf8_lossy();
    if let Some(card) = documents::model_card(&parts.cfg, &id, parts.wall() as u64) {
        return json_response(StatusCode::OK, &card, rid);
    }
    json_response(
        StatusCode::NOT_FOUND,
        &ErrorReply::invalid_request(format!("The model '{id}' does not exist"), Some("model"))
            .with_code("model_not_found"),
        rid,
    )
}

/// The methods a known route takes (the `Allow` header of a 405, RFC 9110 section 15.5.6):
/// `POST`, or `GET, HEAD` (HEAD wherever GET is served, RFC 9110 section 9.1); `None` for a
/// path this listener does not serve.
fn allowed(side: Side, path: &str) -> Option<&'static str> {
    let post = match side {
        Side::Data => ["/v1/completions", "/v1/chat/completions"].contains(&path),
        Side::SelfDrain => path == "/narwhal/self-drain",
        Side::Control => [
            "/narwhal/lifecycle/drain",
            "/narwhal/lifecycle/readmit",
            "/narwhal/lifecycle/cancel-drain",
        ]
        .contains(&path),
    };
    let get = match side {
        Side::SelfDrain => ["/narwhal/self-drain", "/health", "/ready"].contains(&path),
        Side::Data => {
            ["/v1/models", "/health", "/ready"].contains(&path) || path.starts_with(MODELS_PREFIX)
        }
        Side::Control => [
            "/narwhal/handoff",
            "/narwhal/lifecycle",
            "/narwhal/state",
            "/narwhal/targets",
            "/metrics",
            "/health",
            "/ready",
        ]
        .contains(&path),
    };
    match (post, get) {
        (true, true) => Some("GET, HEAD, POST"),
        (true, false) => Some("POST"),
        (false, true) => Some("GET, HEAD"),
        (false, false) => None,
    }
}

/// HTTP streams one HTTP/2 connection may carry at once (its `SETTINGS_MAX_CONCURRENT_STREAMS`,
/// RFC 9113 section 6.5.2; hyper's default). A client past it waits for one to end or opens
/// another connection.
const H2_MAX_STREAMS: u32 = 200;

/// The HTTP/2 connection preface a client with prior knowledge opens with (RFC 9113 section
/// 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How long a new plain connection may take to send the bytes that tell HTTP/2's preface from
/// an HTTP/1.1 request (as hyper's HTTP/1.1 header-read timeout, 30 s, bounds the head after
/// them); a connection that sends nothing for that long is closed.
const FIRST_BYTES_WAIT: Duration = Duration::from_secs(30);

/// Whether a plain connection opens with the HTTP/2 preface, from its first bytes, peeked (the
/// server that serves it reads them again). Three bytes decide: `PRI` begins the preface and
/// no HTTP/1.1 request the router serves (the method is reserved for it, RFC 9113 section
/// 3.4); anything else, or an end of stream, is HTTP/1.1's to answer. Fewer bytes that could
/// still be the preface (a `P` alone) are waited on, in growing steps.
///
/// # Errors
/// The peek's I/O error (the connection is gone).
async fn opens_with_h2_preface(stream: &tokio::net::TcpStream) -> std::io::Result<bool> {
    let mut buf = [0u8; 24];
    let mut wait = Duration::from_millis(1);
    loop {
        let n = stream.peek(&mut buf).await?;
        if n == 0 || buf[..n] != H2_PREFACE[..n] {
            return Ok(false);
        }
        if n >= 3 {
            return Ok(true);
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(50));
    }
}

/// The HTTP/1.1 server of one connection: keep-alive, on tokio's timer (hyper's header-read
/// timeout).
fn http1_builder() -> http1::Builder {
    let mut b = http1::Builder::new();
    b.timer(TokioTimer::new()).keep_alive(true);
    b
}

/// The HTTP/2 server of one connection: its streams run as tasks of their own.
fn http2_builder() -> http2::Builder<TokioExecutor> {
    let mut b = http2::Builder::new(TokioExecutor::new());
    b.timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_STREAMS);
    b
}

/// The routes, for an HTTP/1.1 connection.
fn h1_service(
    parts: Arc<Parts>,
    side: Side,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Body>, Infallible>> + Send,
> + Clone {
    service_fn(move |req| {
        let parts = parts.clone();
        async move { Ok::<_, Infallible>(route(parts, side, req).await) }
    })
}

/// The routes, for an HTTP/2 connection's streams.
fn h2_service(
    parts: Arc<Parts>,
    side: Side,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
> + Clone {
    service_fn(move |req| {
        let parts = parts.clone();
        async move {
            // Boxed: a stream's task holds the route's state only until the answer's head is
            // out (a stream's body is relayed by a task of its own), not for the whole stream.
            // An HTTP/1.1 connection needs no box: hyper keeps its one in-flight request's
            // state in a slot of the connection, reused request after request.
            let mut r = Box::pin(route(parts, side, req)).await;
            // Connection-specific fields are not HTTP/2's (RFC 9113 section 8.2.2): the
            // `Connection: close` that ends an HTTP/1.1 connection after an early refusal has
            // no meaning on a stream, and the connection's other streams go on.
            r.headers_mut().remove(http::header::CONNECTION);
            Ok::<_, Infallible>(r)
        }
    })
}

/// Accept loop for one listener until `stop`, then wait up to `grace` for open connections
/// (by then `app::run` has drained the requests: this is for their last bytes and idle
/// keep-alive connections).
pub(crate) async fn serve(
    listener: TcpListener,
    parts: Arc<Parts>,
    side: Side,
    stop: CancellationToken,
    grace: Duration,
) {
    let graceful = GracefulShutdown::new();
    let tls = match (side, &parts.cfg.control_tls) {
        (Side::Control | Side::SelfDrain, Some(files)) => {
            let files = narwhal_shared::TlsFiles {
                ca: files.ca.clone(),
                cert: files.cert.clone(),
                key: files.key.clone(),
            };
            let made = if side == Side::SelfDrain {
                // Callers authenticate with their pod's token, not a certificate.
                files.server_config_without_client_auth()
            } else {
                files.server_config()
            };
            match made {
                Ok(cfg) => Some(tokio_rustls::TlsAcceptor::from(Arc::new(cfg))),
                Err(e) => {
                    tracing::error!(error = %e, "control.tls unusable; the control listener stays closed");
                    return;
                }
            }
        }
        _ => None,
    };
    let h1 = http1_builder();
    let h2 = http2_builder();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        match &tls {
            None => {
                let (h1, h2) = (h1.clone(), h2.clone());
                let parts = parts.clone();
                let watcher = graceful.watcher();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let first =
                        tokio::time::timeout(FIRST_BYTES_WAIT, opens_with_h2_preface(&stream));
                    let speaks_h2 = tokio::select! {
                        r = first => match r {
                            Ok(Ok(h2)) => h2,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "connection ended before its first bytes");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "no request within the first-bytes wait");
                                return;
                            }
                        },
                        // Shutting down: a connection that sent nothing yet is idle; it closes
                        // as hyper closes idle keep-alive connections.
                        () = stop.cancelled() => return,
                    };
                    let ended = if speaks_h2 {
                        let conn =
                            h2.serve_connection(TokioIo::new(stream), h2_service(parts, side));
                        watcher.watch(conn).await
                    } else {
                        let conn =
                            h1.serve_connection(TokioIo::new(stream), h1_service(parts, side));
                        watcher.watch(conn).await
                    };
                    if let Err(e) = ended {
                        tracing::debug!(%peer, error = %e, "connection ended with error");
                    }
                });
            }
            Some(acceptor) => {
                // Mutual TLS: only clients whose certificate chains to the fleet CA (standby
                // routers, narwhalctl, supervisors) get past the handshake (architecture.md 3).
                // HTTP/1.1 only: the TLS configuration offers no ALPN.
                let acceptor = acceptor.clone();
                let watcher = graceful.watcher();
                let h1 = h1.clone();
                let svc = h1_service(parts.clone(), side);
                tokio::spawn(async move {
                    let tls = match tokio::time::timeout(
                        Duration::from_secs(10),
                        acceptor.accept(stream),
                    )
                    .await
                    {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::info!(%peer, error = %e, "control TLS handshake refused");
                            return;
                        }
                        Err(_) => {
                            tracing::info!(%peer, "control TLS handshake timed out");
                            return;
                        }
                    };
                    let conn = h1.serve_connection(TokioIo::new(tls), svc);
                    if let Err(e) = watcher.watch(conn).await {
                        tracing::debug!(%peer, error = %e, "connection ended with error");
                    }
                });
            }
        }
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_s = grace.as_secs_f64(),
            "connections still open after the graceful timeout"
        );
    }
}
