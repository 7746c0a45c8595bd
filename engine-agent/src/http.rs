//! HTTPS front: axum routes (DESIGN.md section 4 table) served only over mutual TLS.
//!
//! ```text
//!  TcpListener ─accept─► TLS handshake (client cert must chain to the fleet CA, else the
//!  handshake fails) ─► hyper http/1.1 ─► axum Router ─► Agent ─► JSON / ErrorBody
//! ```
//! Errors map to HTTP in one place, [`status_of`]: 400 `bad_request`, 404 `unknown_engine`,
//! 409 `stale_epoch` / `holder_conflict`, 502 `engine_unavailable`, 503
//! `process_unavailable`, 500 `internal`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use narwhal_shared::agent_protocol::{ErrorBody, ErrorDetail};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::agent::{Agent, RequestError};
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

/// The agent's routes.
pub fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route(
            "/health",
            get(|State(a): Shared| async move {
                axum::Json(json!({"status": "ok", "agent_id": a.agent_id(),
                    "public_key": a.public_key().to_string()}))
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
            "/v1/engines/{iid}/attestation",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let req = parse(&body)?;
                    a.attestation(&iid, req)
                        .await
                        .map(axum::Json)
                        .map_err(ApiError)
                },
            ),
        )
        .route(
            "/v1/engines/{iid}/checks/generation",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let req = parse(&body)?;
                    a.generation(&iid, req)
                        .await
                        .map(axum::Json)
                        .map_err(ApiError)
                },
            ),
        )
        .route(
            "/v1/engines/{iid}/checks/kv/produce",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let req = parse(&body)?;
                    a.kv_produce(&iid, req)
                        .await
                        .map(axum::Json)
                        .map_err(ApiError)
                },
            ),
        )
        .route(
            "/v1/engines/{iid}/checks/kv/consume",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let req = parse(&body)?;
                    a.kv_consume(&iid, req)
                        .await
                        .map(axum::Json)
                        .map_err(ApiError)
                },
            ),
        )
        .route(
            "/v1/engines/{iid}/probe",
            post(
                |State(a): Shared, Path(iid): Path<String>, body: Bytes| async move {
                    let req = parse(&body)?;
                    a.probe(&iid, req).await.map(axum::Json).map_err(ApiError)
                },
            ),
        )
        .with_state(agent)
}

/// Serves `app` over TLS on `listener` until `shutdown` resolves. Connections whose TLS
/// handshake fails (no client certificate, foreign CA) or exceeds `handshake` are dropped.
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
