//! Ed25519 keys and signed documents (architecture.md section 4, "Signed documents" and "Keys").
//!
//! ```text
//!   PKCS#8 v2 key file ──► SigningKey::from_pkcs8 ──► sign(payload) ──► SignedDocument
//!   "ed25519:<base64>"  ──► PublicKey::parse ──────────► verify(SignedDocument)
//! ```
//!
//! The signature covers [`crate::canonical_json`] of `payload`; it and the public key are
//! spelled in standard base64 with padding.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::canonical::canonical_json;

/// Errors from key handling.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The bytes are not an Ed25519 PKCS#8 (v1 with public key, or v2) document.
    #[error("not an Ed25519 PKCS#8 key: {reason}")]
    Pkcs8 {
        /// ring's reason.
        reason: String,
    },
    /// The public key text is not `ed25519:<base64 of 32 bytes>`.
    #[error("public key {text:?} is not \"ed25519:<base64 of 32 bytes>\"")]
    PublicKey {
        /// The offending text.
        text: String,
    },
    /// The system random source failed while generating a key.
    #[error("random source failed while generating a key")]
    Random,
}

/// A signed document: `{"payload": {...}, "signature": "<base64>", "key_id": "<16 hex>"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SignedDocument {
    /// The signed payload (any JSON object; see [`crate::attestation`] for the schemas).
    pub payload: Value,
    /// Standard base64 of the 64-byte Ed25519 signature over `canonical_json(payload)`.
    pub signature: String,
    /// [`PublicKey::key_id`] of the signer.
    pub key_id: String,
}

/// An Ed25519 private key (held by the agent).
pub struct SigningKey {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKey({})", self.public_key())
    }
}

impl SigningKey {
    /// Generates a new key and returns its PKCS#8 v2 encoding (what `keygen` writes).
    ///
    /// # Errors
    /// [`KeyError::Random`] if the system random source fails.
    pub fn generate_pkcs8() -> Result<Vec<u8>, KeyError> {
        let rng = ring::rand::SystemRandom::new();
        Ed25519KeyPair::generate_pkcs8(&rng)
            .map(|doc| doc.as_ref().to_vec())
            .map_err(|_| KeyError::Random)
    }

    /// Parses a PKCS#8 document (v2 as written by `keygen`, or v1 with the public key).
    ///
    /// # Errors
    /// [`KeyError::Pkcs8`] naming ring's rejection reason.
    pub fn from_pkcs8(bytes: &[u8]) -> Result<SigningKey, KeyError> {
        let pair =
            Ed25519KeyPair::from_pkcs8_maybe_unchecked(bytes).map_err(|e| KeyError::Pkcs8 {
                reason: e.to_string(),
            })?;
        Ok(SigningKey { pair })
    }

    /// The matching public key.
    pub fn public_key(&self) -> PublicKey {
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey { bytes }
    }

    /// Signs `payload` (canonical JSON bytes) and wraps it in a [`SignedDocument`].
    pub fn sign(&self, payload: Value) -> SignedDocument {
        let sig = self.pair.sign(&canonical_json(&payload));
        SignedDocument {
            payload,
            signature: B64.encode(sig.as_ref()),
            key_id: self.public_key().key_id(),
        }
    }
}

/// An Ed25519 public key, spelled `ed25519:<standard base64 of the 32 key bytes>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicKey {
    bytes: [u8; 32],
}

impl PublicKey {
    /// Parses `ed25519:<base64>`.
    ///
    /// # Errors
    /// [`KeyError::PublicKey`] with the offending text.
    pub fn parse(text: &str) -> Result<PublicKey, KeyError> {
        let bad = || KeyError::PublicKey {
            text: text.to_string(),
        };
        let b64 = text.trim().strip_prefix("ed25519:").ok_or_else(bad)?;
        let raw = B64.decode(b64).map_err(|_| bad())?;
        let bytes: [u8; 32] = raw.try_into().map_err(|_| bad())?;
        Ok(PublicKey { bytes })
    }

    /// First 16 hex digits of SHA-256 over the 32 key bytes; names the key in documents.
    pub fn key_id(&self) -> String {
        let d = ring::digest::digest(&ring::digest::SHA256, &self.bytes);
        d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// True when `signature_b64` is a valid Ed25519 signature by this key over `message`.
    pub fn verify_bytes(&self, message: &[u8], signature_b64: &str) -> bool {
        let Ok(sig) = B64.decode(signature_b64) else {
            return false;
        };
        UnparsedPublicKey::new(&ED25519, &self.bytes)
            .verify(message, &sig)
            .is_ok()
    }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ed25519:{}", B64.encode(self.bytes))
    }
}

impl Serialize for PublicKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PublicKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PublicKey::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sign_then_verify_and_round_trip_the_public_key() {
        let key = SigningKey::from_pkcs8(&SigningKey::generate_pkcs8().unwrap()).unwrap();
        let doc = key.sign(json!({"b": 2, "a": 1}));
        let pk = PublicKey::parse(&key.public_key().to_string()).unwrap();
        assert_eq!(pk, key.public_key());
        assert_eq!(doc.key_id, pk.key_id());
        assert!(pk.verify_bytes(&canonical_json(&doc.payload), &doc.signature));
        assert!(!pk.verify_bytes(&canonical_json(&json!({"a": 1, "b": 3})), &doc.signature));
    }

    #[test]
    fn bad_public_keys_and_key_files_are_named_errors() {
        assert!(matches!(
            PublicKey::parse("rsa:AAAA"),
            Err(KeyError::PublicKey { .. })
        ));
        assert!(matches!(
            PublicKey::parse("ed25519:AAAA"),
            Err(KeyError::PublicKey { .. })
        ));
        assert!(matches!(
            SigningKey::from_pkcs8(b"junk"),
            Err(KeyError::Pkcs8 { .. })
        ));
    }
}
