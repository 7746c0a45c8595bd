//! The Kubernetes objects the backend reads and writes: a `coordination.k8s.io/v1` Lease and
//! the API server's `Status` answer. Members this backend does not use are kept as they were
//! read (`rest`), so a whole-object `PUT` never drops what another tool put there (labels
//! from a chart, owner references, managed fields).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The annotation holding the `narwhal.router-lease` record (the same JSON as the file
/// backend's record).
pub const RECORD_ANNOTATION: &str = "narwhal.dev/router-lease";
/// The annotation holding the holder's published handoff document: the JSON as it is, or,
/// when that does not fit the object, [`GZIP_PREFIX`] and the gzip of it in base64.
pub const HANDOFF_ANNOTATION: &str = "narwhal.dev/handoff";
/// How a gzipped handoff annotation starts (a JSON document never does).
pub const GZIP_PREFIX: &str = "gzip+base64:";
/// The finalizer the backend puts on the Lease it creates: a `kubectl delete` then only marks
/// the Lease for deletion, so its epoch survives and the next claim goes on from it.
pub const KEEP_EPOCH_FINALIZER: &str = "narwhal.dev/keep-epoch";
/// What the API server allows for all of an object's annotations together, bytes
/// (`TotalAnnotationSizeLimitB` in Kubernetes' apimachinery validation).
pub const ANNOTATIONS_LIMIT_BYTES: usize = 256 * 1024;

/// A `coordination.k8s.io/v1` Lease.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseObject {
    /// `coordination.k8s.io/v1`.
    #[serde(default)]
    pub api_version: String,
    /// `Lease`.
    #[serde(default)]
    pub kind: String,
    /// Name, namespace, resource version, annotations, finalizers.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The Lease's own fields, mirrored from the record for `kubectl get lease`.
    #[serde(default)]
    pub spec: LeaseSpec,
    /// Anything else the server sent.
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// The object metadata this backend reads or writes.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    /// The object's name.
    #[serde(default)]
    pub name: String,
    /// Its namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The version a `PUT` must name to be applied (compare-and-swap; a stale one is 409).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    /// Annotations: the record and the handoff live here.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Finalizers ([`KEEP_EPOCH_FINALIZER`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finalizers: Vec<String>,
    /// Set when someone deleted the object and a finalizer keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<String>,
    /// Anything else the server sent (uid, labels, managed fields, ...).
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// `LeaseSpec`: what `kubectl get lease` shows. The backend writes it from the record and
/// never decides from it (the record annotation is the truth).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseSpec {
    /// The holder token; absent once released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_identity: Option<String>,
    /// The record's ttl, whole seconds (rounded up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_duration_seconds: Option<i32>,
    /// When the current holder claimed (`MicroTime`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquire_time: Option<String>,
    /// When the current holder last wrote (`MicroTime`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<String>,
    /// The fencing epoch (saturating at `i32::MAX`): one more per change of holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_transitions: Option<i32>,
    /// Anything else (newer servers' `strategy`, `preferredHolder`).
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// The API server's `Status` answer to a failed call: what went wrong, for the error message.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Status {
    /// Human-readable.
    #[serde(default)]
    pub message: String,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Forbidden`, `Invalid`, ...
    #[serde(default)]
    pub reason: String,
}

/// The annotation value for handoff document `doc`: itself when `room` bytes hold it, else
/// [`GZIP_PREFIX`] and its gzip in base64 (a fleet's handoff shrinks about tenfold).
pub fn encode_handoff(doc: &str, room: usize) -> String {
    if doc.len() <= room {
        return doc.to_string();
    }
    use base64::Engine as _;
    use std::io::Write as _;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    // Writing into a Vec cannot fail.
    let _ = gz.write_all(doc.as_bytes());
    let packed = gz.finish().unwrap_or_default();
    format!(
        "{GZIP_PREFIX}{}",
        base64::engine::general_purpose::STANDARD.encode(packed)
    )
}

/// The handoff document an annotation value holds (see [`encode_handoff`]).
///
/// # Errors
/// What is wrong with a gzipped value (not base64, not gzip, not UTF-8).
pub fn decode_handoff(value: &str) -> Result<Vec<u8>, String> {
    let Some(packed) = value.strip_prefix(GZIP_PREFIX) else {
        return Ok(value.as_bytes().to_vec());
    };
    use base64::Engine as _;
    use std::io::Read as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(packed)
        .map_err(|e| format!("not base64: {e}"))?;
    let mut doc = Vec::new();
    flate2::read::GzDecoder::new(bytes.as_slice())
        .read_to_end(&mut doc)
        .map_err(|e| format!("not gzip: {e}"))?;
    Ok(doc)
}

/// A Unix time (seconds) as Kubernetes' `MicroTime` (`2006-01-02T15:04:05.000000Z`: exactly six
/// fractional digits, UTC); `None` for a time outside what the format can write.
pub fn micro_time(unix_s: f64) -> Option<String> {
    // Rounded to whole microseconds first: an f64 holds today's Unix time in microseconds
    // exactly, not in nanoseconds.
    let micros = (unix_s * 1e6).round();
    if !micros.is_finite() {
        return None;
    }
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(micros as i128 * 1000).ok()?;
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    t.format(&format).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_time_has_six_fractional_digits_in_utc() {
        assert_eq!(
            micro_time(1_765_000_000.25).as_deref(),
            Some("2025-12-06T05:46:40.250000Z")
        );
        assert_eq!(
            micro_time(0.0).as_deref(),
            Some("1970-01-01T00:00:00.000000Z")
        );
        assert_eq!(micro_time(f64::NAN), None);
        assert_eq!(micro_time(f64::INFINITY), None);
    }

    #[test]
    fn a_handoff_too_large_as_it_is_is_gzipped_and_read_back() {
        let doc = format!("{{\"pad\":\"{}\"}}", "x".repeat(10_000));
        assert_eq!(encode_handoff(&doc, 20_000), doc, "fits: kept as it is");
        let packed = encode_handoff(&doc, 1_000);
        assert!(
            packed.starts_with(GZIP_PREFIX) && packed.len() < 1_000,
            "{}",
            packed.len()
        );
        assert_eq!(decode_handoff(&packed).unwrap(), doc.as_bytes());
        assert_eq!(decode_handoff(&doc).unwrap(), doc.as_bytes());
        assert!(
            decode_handoff("gzip+base64:@@")
                .unwrap_err()
                .contains("not base64")
        );
        assert!(
            decode_handoff("gzip+base64:AAAA")
                .unwrap_err()
                .contains("not gzip")
        );
    }

    #[test]
    fn members_not_used_survive_a_read_and_a_write() {
        let text = r#"{"apiVersion":"coordination.k8s.io/v1","kind":"Lease",
            "metadata":{"name":"l","namespace":"n","resourceVersion":"7","uid":"u-1",
                        "labels":{"app":"narwhal"},"annotations":{"a":"b"}},
            "spec":{"holderIdentity":"h","preferredHolder":"x"}}"#;
        let obj: LeaseObject = serde_json::from_str(text).unwrap();
        let back = serde_json::to_value(&obj).unwrap();
        let want: Value = serde_json::from_str(text).unwrap();
        assert_eq!(back, want);
    }
}
