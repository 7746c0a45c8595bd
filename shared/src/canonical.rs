//! Canonical JSON: the exact bytes an Ed25519 signature covers (architecture.md section 4).
//!
//! ```text
//!   serde_json::Value ──► canonical_json() ──► Vec<u8>  (keys sorted by UTF-8 bytes, no whitespace,
//!                                                        serde_json number and string spelling)
//!   Vec<u8> ──► sha256_digest() ──► "sha256:<64 hex>"
//! ```
//!
//! The workspace enables serde_json's `preserve_order`, so map order is insertion order; this
//! module sorts keys itself, recursively, so two parties that build the same document in a
//! different key order still sign and verify the same bytes.

use serde_json::Value;

/// Serialises `value` canonically: object keys sorted (byte order) at every depth, no
/// whitespace, numbers and strings spelled as `serde_json` spells them.
pub fn canonical_json(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    write_value(value, &mut out);
    out
}

fn write_value(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push(b'{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_scalar(&Value::String(key.clone()), out);
                out.push(b':');
                // Key taken from this map a line above, so the lookup cannot miss.
                if let Some(v) = map.get(key.as_str()) {
                    write_value(v, out);
                }
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(v, out);
            }
            out.push(b']');
        }
        scalar => write_scalar(scalar, out),
    }
}

fn write_scalar(value: &Value, out: &mut Vec<u8>) {
    // Writing a scalar Value into a Vec cannot fail (no I/O error, no non-string keys).
    let _ = serde_json::to_writer(&mut *out, value);
}

/// `"sha256:" + hex(sha256(canonical_json(value)))`, the digest spelling used by attestation
/// documents (behaviour.md 5.4; note the reference also ASCII-escapes, which this does not).
pub fn sha256_digest(value: &Value) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, &canonical_json(value));
    let mut s = String::with_capacity(7 + 64);
    s.push_str("sha256:");
    for b in digest.as_ref() {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_sorted_at_every_depth_without_whitespace() {
        let v = json!({"b": 1, "a": {"z": [1, {"y": true, "x": null}], "c": "s"}, "A": 1.5});
        assert_eq!(
            String::from_utf8(canonical_json(&v)).unwrap(),
            r#"{"A":1.5,"a":{"c":"s","z":[1,{"x":null,"y":true}]},"b":1}"#
        );
    }

    #[test]
    fn insertion_order_does_not_change_the_bytes() {
        let a: Value = serde_json::from_str(r#"{"x":1,"y":{"p":2,"q":3}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"y":{"q":3,"p":2},"x":1}"#).unwrap();
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(sha256_digest(&a), sha256_digest(&b));
        assert!(sha256_digest(&a).starts_with("sha256:"));
        assert_eq!(sha256_digest(&a).len(), 7 + 64);
    }

    #[test]
    fn strings_are_escaped() {
        let v = json!({"k\"": "a\nb"});
        assert_eq!(
            String::from_utf8(canonical_json(&v)).unwrap(),
            r#"{"k\"":"a\nb"}"#
        );
    }
}
