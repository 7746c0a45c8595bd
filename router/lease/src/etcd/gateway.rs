//! Reading etcd's JSON gateway answers (`/v3/...`): gRPC status codes in the body, base64
//! keys and values, int64 numbers as strings, and the errors that mean re-authenticate.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use serde::Serialize;
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

// Requests. The gateway's JSON mapping of etcd's `etcdserverpb` messages: bytes are base64,
// int64 numbers decimal strings, field names as in the proto (`TTL`, `ID`).

/// `POST /v3/auth/authenticate`.
#[derive(Debug, Serialize)]
pub(super) struct AuthenticateRequest<'a> {
    /// The etcd user (`lease.auth.user`).
    pub(super) name: &'a str,
    /// Its password, read from `lease.auth.password_file`.
    pub(super) password: &'a str,
}

/// `POST /v3/kv/range` of one key, and a transaction's `request_range`.
#[derive(Debug, Serialize)]
pub(super) struct RangeRequest {
    /// The key, base64.
    pub(super) key: String,
}

impl RangeRequest {
    /// The range of exactly `key`.
    pub(super) fn of(key: &str) -> RangeRequest {
        RangeRequest { key: b64(key) }
    }
}

/// A transaction's `request_put`.
#[derive(Debug, Serialize)]
pub(super) struct PutRequest {
    /// The key, base64.
    pub(super) key: String,
    /// The value, base64.
    pub(super) value: String,
    /// The lease the key is attached to (its ID, decimal), none for a key that outlives it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) lease: Option<String>,
}

/// One operation of a transaction (`RequestOp`: `{"request_range": ...}` or
/// `{"request_put": ...}`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum RequestOp {
    /// Read a key.
    RequestRange(RangeRequest),
    /// Write a key.
    RequestPut(PutRequest),
}

/// One guard of a transaction: the key's `mod_revision` equals the one read, or (never seen)
/// its `version` is 0, the key is absent.
#[derive(Debug, Serialize)]
pub(super) struct Compare {
    /// The key, base64.
    pub(super) key: String,
    /// Always `EQUAL`.
    pub(super) result: &'static str,
    /// `MOD` (compare `mod_revision`) or `VERSION` (compare `version`).
    pub(super) target: &'static str,
    /// With `MOD`: the revision read, decimal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) mod_revision: Option<String>,
    /// With `VERSION`: `"0"`, absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) version: Option<String>,
}

impl Compare {
    /// `mod_revision == rev` when the key was seen at `rev`, else "absent" (`version == 0`).
    pub(super) fn unchanged(key: &str, seen: Option<i64>) -> Compare {
        let (target, mod_revision, version) = match seen {
            Some(rev) => ("MOD", Some(rev.to_string()), None),
            None => ("VERSION", None, Some("0".to_string())),
        };
        Compare {
            key: b64(key),
            result: "EQUAL",
            target,
            mod_revision,
            version,
        }
    }
}

/// `POST /v3/kv/txn`: the guards and the operations done when they all hold (no `compare`:
/// an unguarded read of several keys at one revision).
#[derive(Debug, Serialize)]
pub(super) struct TxnRequest {
    /// The guards.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(super) compare: Vec<Compare>,
    /// The operations.
    pub(super) success: Vec<RequestOp>,
}

/// `POST /v3/lease/grant`.
#[derive(Debug, Serialize)]
pub(super) struct LeaseGrantRequest {
    /// The lease's time to live, seconds, decimal.
    #[serde(rename = "TTL")]
    pub(super) ttl: String,
}

/// `POST /v3/lease/revoke` and `/v3/lease/keepalive`: one lease by its ID.
#[derive(Debug, Serialize)]
pub(super) struct LeaseIdRequest {
    /// The lease ID, decimal.
    #[serde(rename = "ID")]
    pub(super) id: String,
}
