//! Replays every committed corpus file (`corpus/<target>/`) and every past crash
//! (`regressions/<target>/`) through its target's `check`, so the main test suite runs them
//! without AFL (docs/testing.md "Fuzzing"). `write_seed_corpus` (ignored) writes the seeds.

use std::path::{Path, PathBuf};

use narwhal_fuzz::TARGETS;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .map(|e| e.expect("a readable directory entry").path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != "README.md"))
        .collect();
    v.sort();
    v
}

/// Runs `check` on each file; the names of the files whose check panicked.
fn replay(check: fn(&[u8]), paths: &[PathBuf]) -> Vec<String> {
    let mut failed = Vec::new();
    for p in paths {
        let data = std::fs::read(p).expect("a readable corpus file");
        if std::panic::catch_unwind(|| check(&data)).is_err() {
            failed.push(p.display().to_string());
        }
    }
    failed
}

#[test]
fn every_target_has_a_seed_corpus() {
    for (name, _) in TARGETS {
        let n = files(&root().join("corpus").join(name)).len();
        assert!(n > 0, "corpus/{name} is empty");
    }
}

#[test]
fn the_corpus_and_the_regressions_pass_every_check() {
    let mut failed = Vec::new();
    for (name, check) in TARGETS {
        for kind in ["corpus", "regressions"] {
            failed.extend(replay(*check, &files(&root().join(kind).join(name))));
        }
    }
    assert!(failed.is_empty(), "checks failed on: {failed:#?}");
}

/// Writes the seed corpus from the repository's own documents and examples. Run by hand
/// after changing a seed: `cargo test -p narwhal-fuzz --test corpus -- --ignored`.
#[test]
#[ignore = "writes tests/fuzz/corpus/: run by hand"]
fn write_seed_corpus() {
    let repo = root().join("../..");
    let read = |p: &str| std::fs::read(repo.join(p)).expect(p);
    let mut seeds: Vec<(&str, &str, Vec<u8>)> = Vec::new();
    let text = |t: &'static str, n: &'static str, s: &str| (t, n, s.as_bytes().to_vec());

    for (n, s) in [
        (
            "completion",
            r#"{"model":"m","prompt":"Hello there","max_tokens":16}"#,
        ),
        (
            "chat_stream",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_completion_tokens":8}"#,
        ),
        (
            "batch",
            r#"{"prompt":["a b c",[1,2,3],"d"],"n":1,"return_token_ids":true}"#,
        ),
        (
            "token_ids",
            r#"{"prompt":[101,2023,2003],"echo":true,"logprobs":1,"best_of":2}"#,
        ),
        (
            "reserved",
            r#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true}}"#,
        ),
        ("not_json", r#"{"prompt": "x""#),
    ] {
        seeds.push(text("ingress", n, s));
    }

    for (flags, n, body) in [
        (
            0u8,
            "vllm_completion",
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"Hi\",\"token_ids\":[42],\"finish_reason\":null}]}\n\ndata: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"!\",\"token_ids\":[7],\"finish_reason\":\"length\"}],\"usage\":null}\n\ndata: {\"id\":\"cmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\ndata: [DONE]\n\n",
        ),
        (
            8 | 16 | 32,
            "chat_batch_prompt",
            "data: {\"id\":\"c\",\"created\":2,\"model\":\"m\",\"prompt_token_ids\":[1,2],\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\r\n\r\ndata: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"yo\",\"reasoning_content\":null},\"finish_reason\":\"stop\"}],\r\ndata: \"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}\r\n\r\n: keep-alive\r\n\r\ndata: [DONE]\r\n\r\n",
        ),
        (
            1 | 4,
            "error_frame",
            "data: {\"choices\":[{\"text\":\"\\u00e9\\ud83d\\ude00 \",\"index\":0}]}\n\ndata: {\"error\":{\"message\":\"boom\",\"code\":503}}\n\n",
        ),
        (2, "done_first", "event: x\ndata: [DONE]\n\n"),
    ] {
        let mut b = vec![flags, 128];
        b.extend_from_slice(body.as_bytes());
        seeds.push(("relay", n, b));
    }

    seeds.push(text("handoff", "reference", HANDOFF));

    for (n, s) in [
        (
            "drain",
            r#"{"engines":["e0","e1"],"wave":false,"deadline_s":60.5}"#,
        ),
        ("wave", r#"{"wave":true}"#),
        ("empty", ""),
        ("unknown", r#"{"engines":["e0"],"force":1}"#),
    ] {
        seeds.push(text("lifecycle", n, s));
    }

    seeds.push((
        "fleet_config",
        "packaging_example",
        read("packaging/fleet.example.json"),
    ));
    seeds.push((
        "fleet_config",
        "reference_example",
        read("router/testdata/reference-fleet.example.json"),
    ));
    seeds.push((
        "agent_config",
        "packaging_example",
        read("packaging/agent.example.json"),
    ));

    for (n, s) in [
        ("fenced", r#"{"nonce":"n1","epoch":7,"holder":"router-a"}"#),
        (
            "kv_consume",
            r#"{"nonce":"n","epoch":1,"holder":"h","model":"m","check_id":"c1","kv":{"remote_engine_id":"x","remote_block_ids":[1,2]}}"#,
        ),
        (
            "probe",
            r#"{"nonce":"n","epoch":1,"holder":"h","model":"m","producer":null,"check_id":"c"}"#,
        ),
        (
            "engines",
            r#"{"agent_id":"gpu-a","engines":[{"iid":"e0","url":"http://127.0.0.1:8000","dialect":"vllm","process":{"pid":77,"boot_id":"b","start_ticks":500,"clk_tck":100,"btime":1000,"process_start_time_seconds":1005.0,"exe":"/usr/bin/engine","listen_port":8000},"error":null}]}"#,
        ),
        (
            "error",
            r#"{"error":{"code":"stale_epoch","message":"epoch 6 < 7","highest_epoch":7,"rule":"fleet"}}"#,
        ),
    ] {
        seeds.push(text("agent_protocol", n, s));
    }

    let signed = serde_json::to_vec(&narwhal_fuzz::attestation::signed_seed()).unwrap();
    seeds.push(("attestation", "generation", signed));

    {
        use narwhal_shared::kv_events::{KvEvent, KvEventBatch, encode_batch, pub_frames};
        let stored = KvEventBatch {
            ts: 1_764_470_000.25,
            events: vec![KvEvent::BlockStored {
                block_hashes: vec![11, 12],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
                block_size: 4,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                extra_keys: None,
                group_idx: Some(0),
                kv_cache_spec_kind: None,
                session_id: None,
                cache_salt: None,
            }],
            data_parallel_rank: Some(0),
        };
        let removed = KvEventBatch {
            ts: 1_764_470_001.0,
            events: vec![
                KvEvent::BlockRemoved {
                    block_hashes: vec![12],
                    medium: Some("GPU".into()),
                    group_idx: None,
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: None,
        };
        let msg = |seq: u64, b: &KvEventBatch| pub_frames("kv@e0", seq, &encode_batch(b)).to_vec();
        let stream = narwhal_fuzz::kv_events::encode(&[msg(0, &stored), msg(1, &removed)]);
        seeds.push(("kv_events", "stored_removed", stream));
        let restart = narwhal_fuzz::kv_events::encode(&[msg(5, &stored), msg(0, &stored)]);
        seeds.push(("kv_events", "gap_restart", restart));
        seeds.push(("kv_events", "bare_batch", encode_batch(&stored)));
    }

    for (target, name, bytes) in seeds {
        let dir = root().join("corpus").join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

/// The reference handoff document (shared/src/handoff.rs tests, behaviour.md 2.1).
const HANDOFF: &str = r#"{"schema":"narwhal.handoff","schema_version":1,"at":1764470000.12,"run":"1764469000-1a2b3c4d",
 "model":"m","epoch":7,"holder":"host-a:8000:5f0c","engines":["e0","e1"],
 "roles":{"e0":"prefill","e1":"decode"},"ejected":[],"inference_sources":{"e1":["e0"]},
 "counters":{"offered":10,"unsized_offered":0,"served":9,"slo_met":9,"expired":0,
   "invalid_requests":0,"failed":1,"refused":0,"rejected":0,"cancelled":0,"unserved":0},
 "outcome_reasons":{"failed":{"engine_error":1},"rejected":{},"expired":{},"refused":{}},
 "lifecycle":{"wave_id":"","records":[
     {"iid":"e0","state":"drained","requested_at":1764469990.0,"deadline_at":1764470290.0,
      "restart_required":true,"wave_id":"","old_process_start":1764460000.5,
      "new_process_start":null,"error":"","checks":[]}],
   "events":[],"engine_restart_policy":"individual",
   "process_starts":{"e0":1764460000.5,"e1":1764460003.25}},
 "demand_risk":{"kind":"first_token_timeout","age_s":12.5,"events":{"first_token_timeout":1}}}"#;
