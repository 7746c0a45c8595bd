//! HTTPS front: axum routes (architecture.md section 4 table) served only over mutual TLS.
//!
//! ```text
//!  TcpListener ─accept─► TLS handshake (client cert must chain to the fleet CA, else the
//!  handshake fails) ─► hyper http/1.1 ─► axum Router ─► Agent ─► JSON / ErrorBody
//! ```
//! Each connection's [`Caller`] (the fleet identity in its client certificate) is attached to
//! its requests, and every matched route asks [`authorize`] first: POST routes (they carry an
//! epoch and holder) need a router identity, GET routes a router or operator identity; a
//! refusal is 403 `forbidden` naming the rule, before the body is read or the fence consulted.
//!
//! Errors map to HTTP in one place, [`status_of`]: 400 `bad_request`, 403 `forbidden`, 404
//! `unknown_engine`, 409 `stale_epoch` / `holder_conflict`, 502 `engine_unavailable`, 503
//! `process_unavailable`, 500 `internal`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use narwhal_shared::SignedDocument;
use narwhal_shared::agent_protocol::{AgentHealth, ErrorBody, ErrorDetail};
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::agent::{Agent, RequestError};
use crate::authz::{Access, Caller, authorize};
use crate::fence::FenceError;

/// HTTP status and error code for a request error.
pub fn status_of(e: &RequestError) -> (StatusCode, &'static str, Option<u64>) {
    match e {
        RequestError::UnknownEngine { .. } => (StatusCode::NOT_FOUND, "unknown_engine", None),
        RequestError::Fence(FenceError::Stale { highest, .. }) => {
            (StatusCode::CONFLICT, "stale_epoch", Some(*highest))
        }
        RequestError::Fence(FenceError::HolderConflict { epoch, .. }) => {
            (StatusCode::CONFLICT, "holder_conflict", Some(*epoch))
        }
        RequestError::Fence(_) | RequestError::Internal(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, "internal", None)
        }
        RequestError::Process { .. } => {
            (StatusCode::SERVICE_UNAVAILABLE, "process_unavailable", None)
        }
        RequestError::Engine { .. } => (StatusCode::BAD_GATEWAY, "engine_unavailable", None),
        RequestError::BadRequest { .. } => (StatusCode::BAD_REQUEST, "bad_request", None),
        RequestError::NotFollowed { .. } => (StatusCode::CONFLICT, "kv_not_followed", None),
    }
}

struct ApiError(RequestError);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code, highest_epoch) = status_of(&self.0);
        if status.is_server_error() {
            tracing::warn!(error = %self.0, code, "request failed");
        } else {
            tracing::info!(error = %self.0, code, "request refused");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: code.to_string(),
                message: self.0.to_string(),
                highest_epoch,
                rule: None,
            },
        };
        (status, axum::Json(body)).into_response()
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        ApiError(e)
    }
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        ApiError(RequestError::BadRequest {
            field: if path == "." { "(body)".into() } else { path },
            reason: e.inner().to_string(),
        })
    })
}

type Shared = State<Arc<Agent>>;

/// The check kind of a POST route (metric label `kind`).
fn kind_of(route: &str) -> &'static str {
    match route.rsplit('/').next() {
        Some("attestation") => "attestation",
        Some("generation") => "generation",
        Some("produce") => "kv_produce",
        Some("consume") => "kv_consume",
        _ => "probe",
    }
}

/// 403 unless the connection's caller may use this route (see the module doc).
async fn guard(State(agent): Shared, route: MatchedPath, req: Request, next: Next) -> Response {
    let access = if req.method() == Method::POST {
        Access::Fenced
    } else {
        Access::Read
    };
    let anonymous;
    let caller = match req.extensions().get::<Arc<Caller>>() {
        Some(c) => c.as_ref(),
        None => {
            anonymous = Caller::anonymous();
            &anonymous
        }
    };
    match authorize(caller, access) {
        Ok(()) => next.run(req).await,
        Err(refusal) => {
            agent.metrics().forbidden(refusal.rule, caller.role_label());
            if access == Access::Fenced {
                agent.metrics().check(kind_of(route.as_str()), "forbidden");
            }
            tracing::warn!(route = route.as_str(), caller = %caller.describe(), rule = refusal.rule,
                "call refused by caller identity");
            let body = ErrorBody {
                error: ErrorDetail {
                    code: "forbidden".into(),
                    message: format!("{} {}: {}", req.method(), route.as_str(), refusal.message),
                    highest_epoch: None,
                    rule: Some(refusal.rule.to_string()),
                },
            };
            (StatusCode::FORBIDDEN, axum::Json(body)).into_response()
        }
    }
}

/// Records the outcome of a fenced call of `kind` and shapes the answer.
fn finish(
    agent: &Agent,
    kind: &'static str,
    result: Result<SignedDocument, ApiError>,
) -> Result<axum::Json<SignedDocument>, ApiError> {
    let outcome = match &result {
        Ok(doc) => {
            let ok = if kind == "probe" {
                doc.payload.get("ok")
            } else {
                doc.payload.get("result").and_then(|r| r.get("ok"))
            };
            if ok.and_then(serde_json::Value::as_bool) == Some(false) {
                "failed"
            } else {
                "ok"
            }
        }
        Err(ApiError(e)) => status_of(e).1,
    };
    agent.metrics().check(kind, outcome);
    result.map(axum::Json)
}

/// The agent's routes, each behind [`guard`].
pub fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route(
            "/health",
            get(|State(a): Shared| async move {
                axum::Json(AgentHealth {
                    status: "ok".into(),
                    agent_id: a.agent_id().to_string(),
                    public_key: a.public_key().to_string(),
                })
            }),
        )
        .route(
            "/metrics",
            get(|State(a): Shared| async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    a.render_metrics(),
                )
            }),
        )
        .route(
            "/v1/engines",
            get(|State(a): Shared| async move { axum::Json(a.engines().await) }),
        )
        .route(
            "/v1/engines/{iid}/process",
            get(|State(a): Shared, Path(iid): Path<String>| async move {
                a.process(&iid).await.map(axum::Json).map_err(ApiError)
            }),
        )
        .route(
            "/v1/engines/{iid}/kv/snapshot",
            get(|State(a): Shared, Path(iid): Path<String>| async move {
                a.kv_snapshot(&iid).await.map(axum::Json).map_err(ApiError)
            }),
        )
        .route(
            "/v1/engines/{iid}/attestation",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let r = match parse(&body) {
                        Ok(req) => a.attestation(&iid, req).await.map_err(ApiError),
                        Err(e) => Err(e),
                    };
                    finish(&a, "attestation", r)
                },
            ),
        )
        .route(
            "/v1/engines/{iid}/checks/generation",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let r = match parse(&body) {
                        Ok(req) => a.generation(&iid, req).await.map_err(ApiError),
                        Err(e) => Err(e),
                    };
                    finish(&a, "generation", r)
                },
            ),
        )
        .route(
            "/v1/engines/{iid}/checks/kv/produce",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let r = match parse(&body) {
                        Ok(req) => a.kv_produce(&iid, req).await.map_err(ApiError),
                        Err(e) => Err(e),
                    };
                    finish(&a, "kv_produce", r)
                },
            ),
        )
        .route(
            "/v1/engines/{iid}/checks/kv/consume",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let r = match parse(&body) {
                        Ok(req) => a.kv_consume(&iid, req).await.map_err(ApiError),
                        Err(e) => Err(e),
                    };
                    finish(&a, "kv_consume", r)
                },
            ),
        )
        .route(
            "/v1/engines/{iid}/probe",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let r = match parse(&body) {
                        Ok(req) => a.probe(&iid, req).await.map_err(ApiError),
                        Err(e) => Err(e),
                    };
                    finish(&a, "probe", r)
                },
            ),
        )
        .route_layer(axum::middleware::from_fn_with_state(agent.clone(), guard))
        .with_state(agent)
}

/// Serves `app` over TLS on `listener` until `shutdown` resolves. Connections whose TLS
/// handshake fails (no client certificate, foreign CA) or exceeds `handshake` are dropped; the
/// others get their [`Caller`] (from the verified leaf certificate) on every request.
pub(crate) async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    app: Router,
    handshake: Duration,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(handshake, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::info!(peer = %peer, error = %e, "TLS handshake refused");
                    return;
                }
                Err(_) => {
                    tracing::info!(peer = %peer, "TLS handshake timed out");
                    return;
                }
            };
            let caller = match tls.get_ref().1.peer_certificates() {
                Some([leaf, ..]) => Caller::from_cert(leaf),
                _ => Caller::anonymous(),
            };
            tracing::debug!(peer = %peer, caller = %caller.describe(), "connection accepted");
            let app = app.layer(axum::Extension(Arc::new(caller)));
            let service = TowerToHyperService::new(app);
            let conn = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .http1_only()
                .serve_connection(TokioIo::new(tls), service)
                .await;
            if let Err(e) = conn {
                tracing::debug!(peer = %peer, error = %e, "connection ended with an error");
            }
        });
    }
}
