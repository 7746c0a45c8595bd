//! The two HTTP listeners (DESIGN.md section 3) on hyper's HTTP/1 server, and the monitor task.
//!
//! ```text
//!  data listener:    POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
//!                    GET /health, GET /ready
//!  control listener: GET /narwhal/state, /narwhal/targets, /metrics, /health, /ready
//!  monitor task:     every controller.monitor_interval_s: breaker probes (GET /health)
//! ```
//!
//! hyper is used directly (not axum) so that a client disconnect drops the service future,
//! which is what cancels the upstream legs (reference-notes 7.7).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::breaker::{Observation, ProbeKind};
use crate::config::{Backend, Role, secs};
use crate::ingress::Endpoint;
use crate::lifecycle;
use crate::metrics::labels;
use crate::response::{Body, json_response};
use crate::serve::{completion, refresh_bootstrap_port};
use crate::state::Shared;

/// Largest lifecycle request body accepted, bytes.
const CONTROL_BODY_LIMIT: usize = 64 * 1024;

/// Reads a control POST body, bounded by [`CONTROL_BODY_LIMIT`].
async fn read_control_body(req: Request<Incoming>) -> Result<bytes::Bytes, String> {
    let limited = http_body_util::Limited::new(req.into_body(), CONTROL_BODY_LIMIT);
    match limited.collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(format!(
            "request body unreadable or over {CONTROL_BODY_LIMIT} bytes: {e}"
        )),
    }
}

/// Which listener a connection arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Data,
    Control,
}

async fn route(shared: Arc<Shared>, side: Side, req: Request<Incoming>) -> Response<Body> {
    let rid = uuid::Uuid::new_v4().to_string();
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match (side, method, path.as_str()) {
        (Side::Data, Method::POST, "/v1/completions") => {
            completion(shared, Endpoint::Completions, req).await
        }
        (Side::Data, Method::POST, "/v1/chat/completions") => {
            completion(shared, Endpoint::Chat, req).await
        }
        (Side::Data, Method::GET, "/v1/models") => {
            json_response(StatusCode::OK, &shared.models_doc(), &rid)
        }
        (_, Method::GET, "/health") => json_response(StatusCode::OK, &shared.health_doc(), &rid),
        (_, Method::GET, "/ready") => {
            let (ready, body) = shared.ready_doc();
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
            json_response(StatusCode::OK, &shared.state_doc(), &rid)
        }
        (Side::Control, Method::GET, "/narwhal/handoff") => {
            match serde_json::to_value(crate::handoff::snapshot(&shared)) {
                Ok(v) => json_response(StatusCode::OK, &v, &rid),
                Err(e) => json_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &json!({"error": {"message": format!("handoff: {e}"), "type": "internal"}}),
                    &rid,
                ),
            }
        }
        (Side::Control, Method::GET, "/narwhal/lifecycle") => json_response(
            StatusCode::OK,
            &lifecycle::driver::document(&shared, ""),
            &rid,
        ),
        (
            Side::Control,
            Method::POST,
            "/narwhal/lifecycle/drain" | "/narwhal/lifecycle/readmit",
        ) => {
            let body = match read_control_body(req).await {
                Ok(b) => b,
                Err(e) => {
                    return json_response(
                        StatusCode::BAD_REQUEST,
                        &lifecycle::driver::document(&shared, &e),
                        &rid,
                    );
                }
            };
            // The action runs in its own task: a client that gives up (a timeout during a long
            // validation) must not cancel it half-way and leave records `validating`.
            let action = if path == "/narwhal/lifecycle/drain" {
                tokio::spawn(lifecycle::driver::drain(shared.clone(), body))
            } else {
                tokio::spawn(lifecycle::driver::readmit(shared.clone(), body))
            };
            match action.await {
                Ok((status, doc)) => json_response(status, &doc, &rid),
                Err(e) => json_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &lifecycle::driver::document(&shared, &format!("lifecycle action failed: {e}")),
                    &rid,
                ),
            }
        }
        (Side::Control, Method::GET, "/narwhal/targets") => {
            json_response(StatusCode::OK, &shared.targets_doc(), &rid)
        }
        (Side::Control, Method::GET, "/metrics") => {
            let text = shared.render_metrics();
            let mut r = Response::new(Full::new(bytes::Bytes::from(text)).boxed());
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
            );
            r
        }
        (side, m, p) => {
            let known = match side {
                Side::Data => [
                    "/v1/completions",
                    "/v1/chat/completions",
                    "/v1/models",
                    "/health",
                    "/ready",
                ]
                .contains(&p),
                Side::Control => [
                    "/narwhal/handoff",
                    "/narwhal/lifecycle",
                    "/narwhal/lifecycle/drain",
                    "/narwhal/lifecycle/readmit",
                    "/narwhal/state",
                    "/narwhal/targets",
                    "/metrics",
                    "/health",
                    "/ready",
                ]
                .contains(&p),
            };
            if known {
                json_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &json!({"error": {"message": format!("method {m} not allowed on {p}"), "type": "invalid_request_error"}}),
                    &rid,
                )
            } else {
                json_response(
                    StatusCode::NOT_FOUND,
                    &json!({"error": {"message": format!("no route {p} on this listener"), "type": "not_found"}}),
                    &rid,
                )
            }
        }
    }
}

/// Accept loop for one listener until `stop`, then wait up to `grace` for open connections.
pub(crate) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    side: Side,
    stop: CancellationToken,
    grace: Duration,
) {
    let graceful = GracefulShutdown::new();
    let tls = match (side, &shared.cfg.control_tls) {
        (Side::Control, Some(files)) => {
            let files = narwhal_shared::TlsFiles {
                ca: files.ca.clone(),
                cert: files.cert.clone(),
                key: files.key.clone(),
            };
            match files.server_config() {
                Ok(cfg) => Some(tokio_rustls::TlsAcceptor::from(Arc::new(cfg))),
                Err(e) => {
                    tracing::error!(error = %e, "control.tls unusable; the control listener stays closed");
                    return;
                }
            }
        }
        _ => None,
    };
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
        let svc = {
            let shared = shared.clone();
            service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(route(shared, side, req).await) }
            })
        };
        let builder = {
            let mut b = http1::Builder::new();
            b.timer(hyper_util::rt::TokioTimer::new()).keep_alive(true);
            b
        };
        match &tls {
            None => {
                let fut = graceful.watch(builder.serve_connection(TokioIo::new(stream), svc));
                tokio::spawn(async move {
                    if let Err(e) = fut.await {
                        tracing::debug!(%peer, error = %e, "connection ended with error");
                    }
                });
            }
            Some(acceptor) => {
                // Mutual TLS: only clients whose certificate chains to the fleet CA (standby
                // routers, narwhalctl, supervisors) get past the handshake (DESIGN.md 3).
                let acceptor = acceptor.clone();
                let watcher = graceful.watcher();
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
                    let conn = builder.serve_connection(TokioIo::new(tls), svc);
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

/// Monitor: every `controller.monitor_interval_s`, run due breaker probes (reference-notes 6.4).
pub(crate) async fn monitor(shared: Arc<Shared>, stop: CancellationToken) {
    let period = secs(shared.cfg.controller.monitor_interval_s);
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        lifecycle::driver::enforce_whole_wave(&shared);
        let due = {
            let now = shared.clock.now();
            shared.core().breaker.due_probes(now)
        };
        for (iid, kind) in due {
            let shared = shared.clone();
            let span = tracing::info_span!("probe", engine = %shared.cfg.engines[iid].iid);
            tokio::spawn(
                async move {
                    let url = format!("{}/health", shared.cfg.engines[iid].url);
                    let res = shared
                        .upstream
                        .get(&url, secs(shared.cfg.engine.health_timeout_s))
                        .await;
                    let ok = matches!(res, Ok((StatusCode::OK, _)));
                    let kind_label = match kind {
                        ProbeKind::Readmission => "readmission",
                        ProbeKind::Verification => "health",
                    };
                    shared
                        .metrics
                        .probes
                        .get_or_create(&labels(&[
                            ("iid", &shared.cfg.engines[iid].iid),
                            ("kind", kind_label),
                            ("outcome", if ok { "passed" } else { "failed" }),
                        ]))
                        .inc();
                    if ok
                        && shared.cfg.backend == Backend::Sglang
                        && shared.cfg.engines[iid].role == Role::Prefill
                        && let Err(e) = refresh_bootstrap_port(&shared, iid).await
                    {
                        tracing::warn!(error = %e, "bootstrap port refresh failed");
                    }
                    tracing::debug!(ok, "probe finished");
                    if ok && kind == ProbeKind::Readmission && shared.agents.has(iid) {
                        // An engine with an agent comes back only through validation of its
                        // running process (issue 4: transient breaker ejection), not on a
                        // bare health answer.
                        if !lifecycle::driver::recover(shared.clone(), iid).await {
                            shared.core().breaker.probe_inconclusive(iid);
                        }
                        return;
                    }
                    shared.observe(
                        iid,
                        if ok {
                            Observation::HealthOk
                        } else {
                            Observation::HealthFailed
                        },
                    );
                }
                .instrument(span),
            );
        }
    }
}

/// SGLang: learn every prefill engine's bootstrap port at startup (best effort).
pub(crate) async fn warm_bootstrap_ports(shared: Arc<Shared>) {
    if shared.cfg.backend != Backend::Sglang {
        return;
    }
    for (iid, e) in shared.cfg.engines.iter().enumerate() {
        if e.role == Role::Prefill
            && let Err(err) = refresh_bootstrap_port(&shared, iid).await
        {
            tracing::warn!(engine.id = %e.iid, error = %err, "bootstrap port unknown at startup; will retry per request");
        }
    }
}
