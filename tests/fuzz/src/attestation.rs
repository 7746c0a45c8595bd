//! Signed agent answers (`{"payload", "signature", "key_id"}`) through the router's verifier
//! (`narwhal_shared::Verifier`), pinned to a fixed test key.
//!
//! The committed corpus holds documents signed with that key ([`signed_seed`]): a fuzzer
//! mutating them explores every refusal after the signature too only where it keeps the
//! signed bytes, which is the point: no mutation may be accepted.

use std::sync::OnceLock;

use narwhal_shared::{
    AttestationPayload, Expected, GenerationPayload, KvConsumePayload, KvProducePayload,
    ProbePayload, SignedDocument, SignedPayload, SigningKey, Verifier, canonical_json,
};
use serde_json::{Value, json};

/// The verifier's wall clock for every check, Unix seconds.
pub const NOW: f64 = 2_000_000.0;
/// The nonce every check expects.
pub const NONCE: &str = "fuzz-nonce";

/// The test key: a PKCS#8 v1 document (RFC 8410) around a fixed Ed25519 seed. Ed25519
/// signatures are deterministic, so a corpus signed with it stays valid.
fn key() -> &'static SigningKey {
    static KEY: OnceLock<SigningKey> = OnceLock::new();
    KEY.get_or_init(|| {
        let mut der = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(&[0x5a; 32]);
        SigningKey::from_pkcs8(&der).expect("the fixed test key parses")
    })
}

/// The payload of the seed answer: a generation check on engine `e0` issued a second before
/// [`NOW`], for the nonce [`NONCE`].
fn seed_payload() -> Value {
    json!({
        "schema": "narwhal.agent-generation-check", "schema_version": 1,
        "agent_id": "gpu-a", "iid": "e0", "nonce": NONCE, "epoch": 7, "holder": "router-a",
        "issued_at": NOW - 1.0,
        "process": {"pid": 77, "boot_id": "boot", "start_ticks": 500, "clk_tck": 100,
            "btime": 1000, "process_start_time_seconds": 1005.0, "exe": "/usr/bin/engine",
            "listen_port": 8000},
        "model": "tiny-sim",
        "result": {"ok": true, "tokens": 1, "latency_s": 0.01, "error": null}
    })
}

/// The seed answer, signed with the test key (what `corpus/attestation/` holds).
pub fn signed_seed() -> SignedDocument {
    key().sign(seed_payload())
}

/// Checks one answer's text against every payload type.
///
/// # Panics
/// When the verifier accepts a document whose payload is not the one the test key signed.
pub fn check(data: &[u8]) {
    let Ok(doc) = serde_json::from_slice::<SignedDocument>(data) else {
        return;
    };
    static SIGNED: OnceLock<Vec<u8>> = OnceLock::new();
    let signed = SIGNED.get_or_init(|| canonical_json(&seed_payload()));
    let expected = expected();
    let accepted = [
        accepts::<AttestationPayload>(&doc, &expected),
        accepts::<GenerationPayload>(&doc, &expected),
        accepts::<KvProducePayload>(&doc, &expected),
        accepts::<KvConsumePayload>(&doc, &expected),
        accepts::<ProbePayload>(&doc, &expected),
    ];
    if accepted.iter().any(|a| *a) {
        assert_eq!(
            &canonical_json(&doc.payload),
            signed,
            "the verifier accepted a payload the key never signed"
        );
    }
}

/// What the seed attestation was signed for: the checks every verification here expects.
fn expected() -> Expected<'static> {
    Expected {
        agent_id: Some("gpu-a"),
        iid: "e0",
        nonce: NONCE,
        epoch: 7,
        holder: "router-a",
        process: None,
    }
}

fn accepts<P: SignedPayload>(doc: &SignedDocument, expected: &Expected<'_>) -> bool {
    // A fresh verifier each time: its nonce ledger would refuse the second type's check.
    Verifier::new(key().public_key(), 30.0)
        .verify::<P>(doc, expected, NOW)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_verifies_and_a_changed_payload_does_not() {
        let doc = signed_seed();
        let expected = expected();
        assert!(accepts::<GenerationPayload>(&doc, &expected));
        let mut changed = doc.clone();
        changed.payload["result"]["tokens"] = json!(2);
        assert!(!accepts::<GenerationPayload>(&changed, &expected));
        check(&serde_json::to_vec(&doc).unwrap());
    }
}
