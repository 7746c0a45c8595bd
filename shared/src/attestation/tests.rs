//! Verifier rules, DESIGN.md section 4: one test per way an answer can be refused.

use super::*;
use crate::signing::SigningKey;
use serde_json::json;

fn key() -> SigningKey {
    SigningKey::from_pkcs8(&SigningKey::generate_pkcs8().unwrap()).unwrap()
}

fn process(start_ticks: u64) -> ProcessIdentity {
    ProcessIdentity {
        pid: 77,
        boot_id: "boot".into(),
        start_ticks,
        clk_tck: 100,
        btime: 1_000,
        process_start_time_seconds: ProcessIdentity::start_time_seconds(1_000, start_ticks, 100),
        exe: "/usr/bin/engine".into(),
        listen_port: Some(8000),
    }
}

fn payload(nonce: &str, issued_at: f64) -> Value {
    serde_json::to_value(GenerationPayload {
        header: Header {
            schema: SCHEMA_GENERATION.into(),
            schema_version: SCHEMA_VERSION,
            agent_id: "gpu-a".into(),
            iid: "e0".into(),
            nonce: nonce.into(),
            epoch: 7,
            holder: "router-a".into(),
            issued_at,
            process: process(500),
        },
        model: "tiny-sim".into(),
        result: LegResult {
            ok: true,
            tokens: 1,
            latency_s: 0.01,
            error: None,
        },
    })
    .unwrap()
}

fn expected<'a>(nonce: &'a str, proc_: Option<&'a ProcessIdentity>) -> Expected<'a> {
    Expected {
        agent_id: Some("gpu-a"),
        iid: "e0",
        nonce,
        epoch: 7,
        holder: "router-a",
        process: proc_,
    }
}

const NOW: f64 = 2_000_000.0;

#[test]
fn a_good_answer_verifies_and_its_nonce_cannot_be_replayed() {
    let k = key();
    let v = Verifier::new(k.public_key(), 30.0);
    let doc = k.sign(payload("n1", NOW - 1.0));
    let p: GenerationPayload = v.verify(&doc, &expected("n1", None), NOW).unwrap();
    assert_eq!(p.header.iid, "e0");
    assert_eq!(p.result.tokens, 1);
    assert_eq!(
        v.verify::<GenerationPayload>(&doc, &expected("n1", None), NOW),
        Err(VerifyError::NonceReplayed { nonce: "n1".into() })
    );
    assert!(matches!(
        v.verify::<GenerationPayload>(&doc, &expected("n2", None), NOW),
        Err(VerifyError::NonceMismatch { .. })
    ));
}

#[test]
fn tampered_payload_fails_the_signature() {
    let k = key();
    let v = Verifier::new(k.public_key(), 30.0);
    let mut doc = k.sign(payload("n1", NOW));
    doc.payload["result"]["tokens"] = json!(5);
    assert_eq!(
        v.verify::<GenerationPayload>(&doc, &expected("n1", None), NOW),
        Err(VerifyError::BadSignature)
    );
}

#[test]
fn another_key_is_a_wrong_key_even_with_a_forged_key_id() {
    let k = key();
    let other = key();
    let v = Verifier::new(k.public_key(), 30.0);
    let mut doc = other.sign(payload("n1", NOW));
    assert!(matches!(
        v.verify::<GenerationPayload>(&doc, &expected("n1", None), NOW),
        Err(VerifyError::WrongKey { .. })
    ));
    doc.key_id = k.public_key().key_id();
    assert_eq!(
        v.verify::<GenerationPayload>(&doc, &expected("n1", None), NOW),
        Err(VerifyError::BadSignature)
    );
}

#[test]
fn stale_and_future_answers_are_refused() {
    let k = key();
    let v = Verifier::new(k.public_key(), 30.0);
    let old = k.sign(payload("n1", NOW - 31.0));
    assert!(matches!(
        v.verify::<GenerationPayload>(&old, &expected("n1", None), NOW),
        Err(VerifyError::Stale { .. })
    ));
    let future = k.sign(payload("n2", NOW + 31.0));
    assert!(matches!(
        v.verify::<GenerationPayload>(&future, &expected("n2", None), NOW),
        Err(VerifyError::FromFuture { .. })
    ));
}

#[test]
fn epoch_holder_iid_agent_and_schema_are_each_checked() {
    let k = key();
    let v = Verifier::new(k.public_key(), 30.0);
    let doc = k.sign(payload("n1", NOW));
    let mut e = expected("n1", None);
    e.epoch = 8;
    assert!(matches!(
        v.verify::<GenerationPayload>(&doc, &e, NOW),
        Err(VerifyError::EpochMismatch {
            expected: 8,
            found: 7
        })
    ));
    let mut e = expected("n1", None);
    e.holder = "router-b";
    assert!(matches!(
        v.verify::<GenerationPayload>(&doc, &e, NOW),
        Err(VerifyError::HolderMismatch { .. })
    ));
    let mut e = expected("n1", None);
    e.iid = "e1";
    assert!(matches!(
        v.verify::<GenerationPayload>(&doc, &e, NOW),
        Err(VerifyError::IidMismatch { .. })
    ));
    let mut e = expected("n1", None);
    e.agent_id = Some("gpu-b");
    assert!(matches!(
        v.verify::<GenerationPayload>(&doc, &e, NOW),
        Err(VerifyError::AgentMismatch { .. })
    ));
    assert!(matches!(
        v.verify::<AttestationPayload>(&doc, &expected("n1", None), NOW),
        Err(VerifyError::WrongSchema { .. })
    ));
    let mut broken = payload("n1", NOW);
    broken["epoch"] = json!("seven");
    let doc = k.sign(broken);
    match v.verify::<GenerationPayload>(&doc, &expected("n1", None), NOW) {
        Err(VerifyError::Malformed { path, .. }) => assert_eq!(path, "epoch"),
        other => panic!("expected Malformed, got {other:?}"),
    }
}

#[test]
fn a_restarted_or_pid_reused_process_does_not_match() {
    let k = key();
    let v = Verifier::new(k.public_key(), 30.0);
    let doc = k.sign(payload("n1", NOW));
    let restarted = process(501);
    assert!(matches!(
        v.verify::<GenerationPayload>(&doc, &expected("n1", Some(&restarted)), NOW),
        Err(VerifyError::ProcessChanged {
            found_start_ticks: 500,
            expected_start_ticks: 501,
            ..
        })
    ));
    let same = process(500);
    assert!(
        v.verify::<GenerationPayload>(&doc, &expected("n1", Some(&same)), NOW)
            .is_ok()
    );
}

#[test]
fn contract_fields_must_match_the_declared_contract() {
    let attested = json!({"engine_version": "0.11.0", "kv_heads": 8});
    let declared = json!({"engine_version": "0.11.0", "kv_heads": 8});
    assert!(check_contract(attested.as_object(), declared.as_object().unwrap()).is_ok());
    let declared = json!({"engine_version": "0.11.0", "kv_heads": 4});
    assert_eq!(
        check_contract(attested.as_object(), declared.as_object().unwrap()),
        Err(VerifyError::ContractMismatch {
            field: "kv_heads".into(),
            observed: "8".into(),
            expected: "4".into()
        })
    );
    assert!(check_contract(None, declared.as_object().unwrap()).is_err());
}

#[test]
fn nonces_are_distinct_hex() {
    let a = new_nonce();
    assert_eq!(a.len(), 32);
    assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, new_nonce());
}

#[test]
fn signatures_survive_a_json_round_trip_of_awkward_floats() {
    // The agent signs a Value, sends text, the router parses text back into a Value: every
    // float must come back bit-identical (serde_json `float_roundtrip`), or signatures break.
    let k = key();
    let pk = k.public_key();
    let mut x: f64 = 1_764_461_234.123_456_7;
    for i in 0..500u32 {
        x = x * 1.000_000_119 + f64::from(i) / 7.0;
        let doc = k.sign(json!({"issued_at": x, "latency_s": 1.0 / (f64::from(i) + 3.0)}));
        let text = serde_json::to_string(&doc).unwrap();
        let back: crate::signing::SignedDocument = serde_json::from_str(&text).unwrap();
        assert_eq!(back.payload, doc.payload, "float changed in transit at {i}");
        assert!(pk.verify_bytes(&canonical_json(&back.payload), &back.signature));
    }
}

#[test]
fn the_host_contract_must_describe_the_live_engine_version() {
    let mut payload = AttestationPayload {
        header: serde_json::from_value(payload("n", NOW)).unwrap(),
        engine: EngineFacts {
            dialect: "vllm".into(),
            version: "0.11.0".into(),
            models: vec!["m".into()],
            bootstrap_port: None,
        },
        contract: json!({"engine_version": "0.11.0", "kv_heads": 8})
            .as_object()
            .cloned(),
        launch_digest: None,
    };
    let declared = json!({"kv_heads": 8});
    check_attestation_contract(&payload, declared.as_object().unwrap()).unwrap();
    payload.engine.version = "0.12.0".into();
    match check_attestation_contract(&payload, declared.as_object().unwrap()) {
        Err(VerifyError::ContractMismatch { field, .. }) => assert_eq!(field, "engine_version"),
        other => panic!("expected engine_version mismatch, got {other:?}"),
    }
}
