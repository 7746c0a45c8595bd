//! Verifier rules, architecture.md section 4: one test per way an answer can be refused.

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
        pod: None,
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

mod transfer_evidence {
    //! The three-valued transfer verdict on the wire, across router/agent versions.
    use super::*;
    use crate::agent_protocol::TransferVerdict;

    fn leg(ok: bool, tokens: u64) -> LegResult {
        LegResult {
            ok,
            tokens,
            latency_s: 0.1,
            error: (!ok).then(|| "decode failed".to_string()),
        }
    }

    /// What an agent before the three-valued verdict sent (no `verdict`, `failed_delta`, `detail`).
    fn legacy(transferred: Value) -> Value {
        json!({"source": "sim_stats", "consumed_delta": 1, "recomputed_delta": 0,
               "engine_phase": "decode", "transferred": transferred})
    }

    #[test]
    fn an_older_agents_answer_still_parses_and_is_judged_from_transferred() {
        let cases = [
            (json!(true), leg(true, 2), TransferVerdict::Confirmed),
            (json!(false), leg(true, 2), TransferVerdict::Refuted),
            (Value::Null, leg(true, 2), TransferVerdict::Inferred),
            (Value::Null, leg(true, 0), TransferVerdict::Refuted),
            (Value::Null, leg(false, 0), TransferVerdict::Refuted),
        ];
        for (transferred, l, want) in cases {
            let ev: TransferEvidence =
                serde_json::from_value(legacy(transferred.clone())).expect("legacy shape");
            assert_eq!(ev.verdict, None);
            assert_eq!(ev.judged(&l), want, "transferred {transferred} leg {l:?}");
        }
    }

    #[test]
    fn the_verdict_is_lower_case_and_wins_over_the_legacy_field() {
        let ev = TransferEvidence {
            source: "vllm_nixl_metrics".into(),
            consumed_delta: Some(0),
            recomputed_delta: None,
            engine_phase: None,
            transferred: None,
            verdict: Some(TransferVerdict::Inferred),
            failed_delta: Some(0),
            detail: Some("no counter moved".into()),
        };
        let v = serde_json::to_value(&ev).unwrap();
        assert_eq!(v["verdict"], "inferred");
        assert_eq!(ev.judged(&leg(true, 2)), TransferVerdict::Inferred);
        for (s, want) in [
            ("confirmed", TransferVerdict::Confirmed),
            ("inferred", TransferVerdict::Inferred),
            ("refuted", TransferVerdict::Refuted),
        ] {
            let got: TransferVerdict = serde_json::from_value(json!(s)).unwrap();
            assert_eq!(got, want);
            assert_eq!(got.as_str(), s);
        }
        assert!(TransferVerdict::Confirmed.accepted() && TransferVerdict::Inferred.accepted());
        assert!(!TransferVerdict::Refuted.accepted());
        // A value this build does not know is an error, never silently accepted.
        assert!(serde_json::from_value::<TransferVerdict>(json!("partial")).is_err());
    }

    #[test]
    fn a_router_built_before_the_verdict_reads_a_new_answer_as_strictly_as_before() {
        // The fields an older router's struct has; serde ignores the rest.
        #[derive(Deserialize)]
        struct OldEvidence {
            source: String,
            consumed_delta: Option<i64>,
            recomputed_delta: Option<i64>,
            transferred: Option<bool>,
        }
        let old_router_accepts = |e: &OldEvidence| {
            e.transferred.unwrap_or(false)
                || (e.consumed_delta.unwrap_or(0) >= 1 && e.recomputed_delta.unwrap_or(0) == 0)
        };
        let new = |verdict, transferred, consumed: Option<i64>| TransferEvidence {
            source: "vllm_nixl_metrics".into(),
            consumed_delta: consumed,
            recomputed_delta: None,
            engine_phase: None,
            transferred,
            verdict: Some(verdict),
            failed_delta: Some(0),
            detail: None,
        };
        let parse = |e: &TransferEvidence| -> OldEvidence {
            serde_json::from_value(serde_json::to_value(e).unwrap()).unwrap()
        };
        let confirmed = parse(&new(TransferVerdict::Confirmed, Some(true), Some(1)));
        assert_eq!(confirmed.source, "vllm_nixl_metrics");
        assert!(old_router_accepts(&confirmed));
        // Inferred is refused by an old router, as every real engine's answer was before.
        assert!(!old_router_accepts(&parse(&new(
            TransferVerdict::Inferred,
            None,
            Some(0)
        ))));
        assert!(!old_router_accepts(&parse(&new(
            TransferVerdict::Refuted,
            Some(false),
            Some(0)
        ))));
    }
}
