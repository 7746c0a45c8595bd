//! Reading etcd's JSON gateway answers (`/v3/...`): gRPC status codes in the body, base64
//! keys and values, int64 numbers as strings, and the errors that mean re-authenticate.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde_json::Value;

use crate::LeaseRecord;

use super::*;

/// etcd's message, with what to change when it is one an operator cannot act on alone.
pub(super) fn explain(message: String) -> String {
    if message.contains("CommonName of client") {
        format!(
            "{message} (etcd with --client-cert-auth and authentication enabled refuses, on its \
             JSON gateway, a client certificate that carries a Common Name: issue \
             lease.tls.cert without a CN; the etcd user comes from lease.auth)"
        )
    } else {
        message
    }
}

/// etcd no longer accepts our token: expired, unknown, or issued before the auth store
/// changed (a user, role or password edit).
pub(super) fn token_refused(code: i64, message: &str) -> bool {
    code == GRPC_UNAUTHENTICATED
        || message.contains("invalid auth token")
        || message.contains("revision of auth store is old")
        || message.contains("user name is empty")
}

/// etcd wants a user (RBAC on) and we sent none.
pub(super) fn auth_required(message: &str) -> bool {
    message.contains("user name is empty") || message.contains("permission denied")
}

/// A gateway answer: the JSON document, or etcd's gRPC code and message. Errors come as
/// `{"error": "...", "message": "...", "code": N}` (unary calls) or
/// `{"error": {"grpc_code": N, "message": "..."}}` (streaming calls).
pub(super) fn parse_answer(
    status: reqwest::StatusCode,
    bytes: &[u8],
) -> Result<Value, (i64, String)> {
    // A streaming answer is one JSON document per line; one request gives one.
    let first = bytes
        .split(|b| *b == b'\n')
        .find(|l| !l.iter().all(u8::is_ascii_whitespace))
        .unwrap_or(bytes);
    let Ok(v) = serde_json::from_slice::<Value>(first) else {
        let text = String::from_utf8_lossy(bytes);
        let text = text.trim();
        let shown: String = text.chars().take(200).collect();
        let hint = if status == reqwest::StatusCode::NOT_FOUND {
            " (etcd's JSON gateway is not served there: it needs etcd >= 3.4 with the gRPC \
             gateway on, enable-grpc-gateway in etcd's config file)"
        } else {
            ""
        };
        return Err((
            0,
            format!("HTTP {status} with a body that is not etcd's JSON: {shown:?}{hint}"),
        ));
    };
    match v.get("error") {
        Some(Value::String(e)) => {
            let message = v.get("message").and_then(Value::as_str).unwrap_or(e);
            Err((int(v.get("code")), message.to_string()))
        }
        Some(Value::Object(e)) => {
            let message = e.get("message").and_then(Value::as_str).unwrap_or("");
            Err((int(e.get("grpc_code")), message.to_string()))
        }
        _ if !status.is_success() => Err((0, format!("HTTP {status}: {v}"))),
        _ => Ok(v),
    }
}

pub(super) fn b64(s: &str) -> String {
    B64.encode(s.as_bytes())
}

/// An `int64` field: proto3 JSON writes it as a decimal string; an absent field is 0.
pub(super) fn int(v: Option<&Value>) -> i64 {
    match v {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The first key-value of a range answer (`kvs[0]`), if any.
pub(super) fn first_kv(range: Option<&Value>) -> Option<&Value> {
    range?.get("kvs")?.as_array()?.first()
}

/// The view the pure core decides on when `<key>` has vanished but `<key>/epoch` remembers
/// epoch `e`: an expired record at `e`, so a claim takes `e + 1`.
pub(super) fn vanished(epoch: u64) -> LeaseRecord {
    LeaseRecord {
        epoch,
        expires_at: f64::NEG_INFINITY,
        holder: String::new(),
        schema: crate::LEASE_SCHEMA.to_string(),
        schema_version: 1,
        updated_at: f64::NEG_INFINITY,
    }
}
