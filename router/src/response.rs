//! HTTP response helpers shared by every route: the body type and JSON answers.

use std::convert::Infallible;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use narwhal_shared::documents::ErrorReply;

/// Response body type for every route.
pub(crate) type Body = BoxBody<Bytes, Infallible>;

/// A full JSON response with `x-request-id: rid`: `v` in its compact form (a document type of
/// `narwhal_shared::documents`, or a `Value`). A body that cannot be serialised (none of ours)
/// becomes a 500 naming why.
pub(crate) fn json_response<T: serde::Serialize + ?Sized>(
    status: StatusCode,
    v: &T,
    rid: &str,
) -> Response<Body> {
    let (status, body) = match serde_json::to_vec(v) {
        Ok(b) => (status, b),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::to_vec(&ErrorReply::new(format!("response: {e}"), "internal"))
                .unwrap_or_default(),
        ),
    };
    json_bytes_response(status, Bytes::from(body), rid)
}

/// An `application/json` response of `body` (JSON already written: an engine's answer cleaned
/// at byte level) with `status` and the `x-request-id` header.
pub(crate) fn json_bytes_response(status: StatusCode, body: Bytes, rid: &str) -> Response<Body> {
    let mut r = Response::new(Full::new(body).boxed());
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(v) = HeaderValue::from_str(rid) {
        h.insert("x-request-id", v);
    }
    r
}

/// Adds `Retry-After: 1` (a 429 or 503 the client may retry shortly).
pub(crate) fn with_retry_after(mut r: Response<Body>) -> Response<Body> {
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// Adds `Retry-After: n` (a predictive refusal: the seconds until the priced queue drains).
pub(crate) fn with_retry_after_s(mut r: Response<Body>, n: u64) -> Response<Body> {
    r.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from(n));
    r
}
