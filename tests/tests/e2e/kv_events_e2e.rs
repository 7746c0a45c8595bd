//! The engine simulator's prefix cache and KV events (docs/engine-simulator.md, "Prefix cache"
//! and "KV events"):
//! - `encoding_matches_vllms_publisher`: the fixture of `tests/python/kv_events_reference.py`,
//!   published by vLLM's own `ZmqEventPublisher` (the pinned wheel's `kv_events.py`, in the
//!   Python test venv), equals byte for byte what `narwhal_testkit::kv_events` encodes, and the
//!   replay socket's frames and end marker are the ones the simulator sends.
//! - `encoding_matches_sglangs_publisher`: the same for SGLang's encoding, against SGLang's own
//!   publisher (the pinned wheel's `sglang/srt/disaggregation/kv_events.py`).
//! - `sim_publishes_its_prompt_blocks`: a simulator with `--kv-events-config` publishes
//!   `BlockStored` for a prompt's full blocks from sequence 0, a repeated prompt is a cache hit
//!   (`/metrics`, `/sim/stats`) with no new store, and replay gives the same bytes as the PUB.
//!
//! Needs the Python test venv for the first test (`tests/python/ensure-venv.sh`); built with
//! `NARWHAL_SKIP_VENV=1` that one is listed as ignored (docs/testing.md).

use crate::pysdk;

use std::time::Duration;

use narwhal_testkit::kv_events::{
    ExtraKey, KvEvent, KvEventBatch, REPLAY_END, decode_batch, encode_batch, encode_sglang_batch,
    pub_frames,
};
use narwhal_testkit::{SimHandle, wait_until};
use serde::Deserialize;
use serde_json::{Value, json};
use zeromq::{Socket as _, SocketRecv as _, SocketSend as _, ZmqMessage};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// What `kv_events_reference.py` prints: the engine and pinned version it ran, the topic (hex),
/// each fixture batch with the frames the engine's publisher sent for it, the frames a live SUB
/// received and the frames a replay DEALER received (each frame hex).
#[derive(Debug, Deserialize)]
struct ReferenceDoc {
    engine: String,
    version: String,
    topic: String,
    batches: Vec<ReferenceBatch>,
    live: Vec<Vec<String>>,
    replay: Vec<Vec<String>>,
}

/// One of a [`ReferenceDoc`]'s batches: the fixture and the publisher's frames for it (`None`
/// when the replay did not have it).
#[derive(Debug, Deserialize)]
struct ReferenceBatch {
    fixture: FixtureBatch,
    #[serde(default)]
    frames: Option<Vec<String>>,
}

/// A fixture batch (plain JSON, as the reference script prints it).
#[derive(Debug, Deserialize)]
struct FixtureBatch {
    ts: f64,
    events: Vec<FixtureEvent>,
    #[serde(default)]
    data_parallel_rank: Option<i64>,
}

/// A fixture event, by its `type`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type")]
enum FixtureEvent {
    BlockStored {
        block_hashes: Vec<FixtureHash>,
        #[serde(default)]
        parent_block_hash: Option<FixtureHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        #[serde(default)]
        lora_id: Option<i64>,
        #[serde(default)]
        medium: Option<String>,
        #[serde(default)]
        lora_name: Option<String>,
        #[serde(default)]
        extra_keys: Option<Vec<Option<Vec<FixtureExtraKey>>>>,
        #[serde(default)]
        group_idx: Option<u32>,
        #[serde(default)]
        kv_cache_spec_kind: Option<String>,
        #[serde(default)]
        session_id: Option<String>,
        #[serde(default)]
        cache_salt: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<FixtureHash>,
        #[serde(default)]
        medium: Option<String>,
        #[serde(default)]
        group_idx: Option<u32>,
    },
    AllBlocksCleared,
}

/// A block hash of the fixture: vLLM's unsigned, or SGLang's signed int64 (its 64 bits).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
enum FixtureHash {
    Unsigned(u64),
    Signed(i64),
}

impl FixtureHash {
    fn bits(self) -> u64 {
        match self {
            FixtureHash::Unsigned(u) => u,
            FixtureHash::Signed(i) => i as u64,
        }
    }
}

fn hashes(v: Vec<FixtureHash>) -> Vec<u64> {
    v.into_iter().map(FixtureHash::bits).collect()
}

/// One extra-key entry of the fixture: a string, an `[identifier, offset]` pair, or
/// `{"digest": hex}` (bytes).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum FixtureExtraKey {
    Text(String),
    Media(String, i64),
    Digest { digest: String },
}

impl FixtureExtraKey {
    fn key(self) -> ExtraKey {
        match self {
            FixtureExtraKey::Text(s) => ExtraKey::Text(s),
            FixtureExtraKey::Media(identifier, offset) => ExtraKey::Media { identifier, offset },
            FixtureExtraKey::Digest { digest: hex } => ExtraKey::Digest(
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                    .collect(),
            ),
        }
    }
}

/// The fixture's event as our type.
fn event(e: FixtureEvent) -> KvEvent {
    match e {
        FixtureEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
            kv_cache_spec_kind,
            session_id,
            cache_salt,
        } => KvEvent::BlockStored {
            block_hashes: hashes(block_hashes),
            parent_block_hash: parent_block_hash.map(FixtureHash::bits),
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys: extra_keys.map(|keys| {
                keys.into_iter()
                    .map(|k| k.map(|parts| parts.into_iter().map(FixtureExtraKey::key).collect()))
                    .collect()
            }),
            group_idx,
            kv_cache_spec_kind,
            session_id,
            cache_salt,
        },
        FixtureEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => KvEvent::BlockRemoved {
            block_hashes: hashes(block_hashes),
            medium,
            group_idx,
        },
        FixtureEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
    }
}

/// The simulator's ready file, the KV event endpoints (present with `--kv-events-config`).
#[derive(Debug, Deserialize)]
struct SimKvReady {
    kv_events_endpoint: String,
    kv_events_replay_endpoint: String,
}

#[tokio::test]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn encoding_matches_vllms_publisher() {
    matches_reference("vllm", "0.32.0", encode_batch).await;
}

/// SGLang 0.5 publishes its KV events in its own encoding (signed int64 hashes, optional
/// fields left out, `cache_salt` on salted stores): its own publisher's frames equal what
/// `encode_sglang_batch` (the simulator's `--dialect sglang`) writes, and the router's
/// decoder reads them back to the same events. Before, every SGLang batch failed to decode.
#[tokio::test]
#[cfg_attr(narwhal_skip_venv, ignore = "NARWHAL_SKIP_VENV=1: no Python venv")]
async fn encoding_matches_sglangs_publisher() {
    matches_reference("sglang", "0.5.23", encode_sglang_batch).await;
}

/// Runs `kv_events_reference.py ENGINE <venv>/ENGINE-src` (the pinned wheel's own publisher
/// and classes) and checks each fixture batch's frames, the live SUB frames and the replay
/// against ours.
async fn matches_reference(engine: &str, version: &str, encode: fn(&KvEventBatch) -> Vec<u8>) {
    let test = format!("encoding_matches_{engine}s_publisher");
    let py = pysdk::python(&test);
    let venv = py.parent().and_then(|b| b.parent()).expect("venv dir");
    let src = venv.join(format!("{engine}-src"));
    assert!(
        src.is_dir(),
        "{} is missing (tests/python/ensure-venv.sh extracts {engine}'s kv_events.py there)",
        src.display()
    );
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        pysdk::command(&py)
            .arg(pysdk::python_dir().join("kv_events_reference.py"))
            .arg(engine)
            .arg(&src)
            .output(),
    )
    .await
    .expect("reference script within 60 s")
    .expect("run the reference script");
    assert!(
        out.status.success(),
        "kv_events_reference.py {engine} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).expect("reference JSON");
    let reference: ReferenceDoc =
        serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("reference ({e}): {doc}"));
    assert_eq!(reference.engine, engine);
    assert_eq!(reference.version, version, "the pinned wheel");
    let topic = "kv@sim";
    assert_eq!(reference.topic, hex(topic.as_bytes()));
    let batches = reference.batches;
    assert!(!batches.is_empty());
    let n_batches = batches.len();
    let mut ours_by_seq = Vec::new();
    for (seq, b) in batches.into_iter().enumerate() {
        let f = b.fixture;
        let batch = KvEventBatch {
            ts: f.ts,
            events: f.events.into_iter().map(event).collect(),
            // vLLM's publisher fills in its rank when the batch has none.
            data_parallel_rank: Some(f.data_parallel_rank.unwrap_or(0)),
        };
        let payload = encode(&batch);
        let ours: Vec<String> = pub_frames(topic, seq as u64, &payload)
            .iter()
            .map(|x| hex(x))
            .collect();
        let theirs: Vec<String> = b
            .frames
            .unwrap_or_else(|| panic!("batch {seq} missing from {engine}'s replay: {doc}"));
        assert_eq!(
            ours, theirs,
            "batch {seq}: our frames differ from {engine}'s"
        );
        assert_eq!(decode_batch(&payload).expect("decode"), batch);
        ours_by_seq.push(ours);
    }
    // The live SUB frames: a fixture batch the slow-joining SUB received is the replayed one;
    // after the replay the script publishes the last batch again under new sequence numbers
    // until the SUB has one of them, so at least one live frame is always checked.
    let last = n_batches - 1;
    let mut republished = 0;
    for l in reference.live {
        let seq = u64::from_str_radix(&l[1], 16).expect("a sequence frame") as usize;
        let want = if seq < n_batches {
            ours_by_seq[seq].clone()
        } else {
            republished += 1;
            let mut w = ours_by_seq[last].clone();
            w[1] = hex(&(seq as u64).to_be_bytes());
            w
        };
        assert_eq!(l, want, "live frames of sequence {seq}");
    }
    assert!(
        republished > 0,
        "the SUB received none of the republished batches: {doc}"
    );
    // Replay as a DEALER sees it: ["", topic, seq, payload] per batch, then the end marker.
    let replay = reference.replay;
    assert_eq!(replay.len(), n_batches + 1);
    assert_eq!(
        replay.last().expect("end"),
        &[
            String::new(),
            String::new(),
            hex(&REPLAY_END),
            String::new()
        ]
    );
    for (i, r) in replay[..n_batches].iter().enumerate() {
        let mut want = vec![String::new()];
        want.extend(ours_by_seq[i].clone());
        assert_eq!(r, &want, "replayed batch {i}");
    }
}

async fn metric(sim: &SimHandle, line_start: &str) -> u64 {
    let text = reqwest::get(format!("{}/metrics", sim.url))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no {line_start} in /metrics:\n{text}")) as u64
}

async fn complete(sim: &SimHandle, prompt: &str) {
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", sim.url))
        .json(&json!({"prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 200);
}

fn frames(m: ZmqMessage) -> Vec<Vec<u8>> {
    m.into_vec().into_iter().map(|b| b.to_vec()).collect()
}

fn stored(batch: &KvEventBatch) -> Vec<(Vec<u64>, Vec<u32>)> {
    batch
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                token_ids,
                ..
            } => Some((block_hashes.clone(), token_ids.clone())),
            _ => None,
        })
        .collect()
}

async fn replay_from(ep: &str, start: u64) -> Vec<Vec<Vec<u8>>> {
    let mut d = zeromq::DealerSocket::new();
    d.connect(ep).await.expect("connect replay");
    let req = ZmqMessage::try_from(vec![
        bytes::Bytes::new(),
        bytes::Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .expect("message");
    d.send(req).await.expect("send replay request");
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), d.recv())
            .await
            .expect("replay answer within 10 s")
            .expect("replay recv");
        let f = frames(m);
        if f.get(2).map(Vec::as_slice) == Some(&REPLAY_END[..]) {
            assert_eq!(f, vec![vec![], vec![], REPLAY_END.to_vec(), vec![]]);
            return out;
        }
        out.push(f);
    }
}

#[tokio::test]
async fn sim_publishes_its_prompt_blocks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv"});
    let sim = SimHandle::start_raw(
        dir.path(),
        "kv",
        &["--block-size", "4", "--kv-events-config", &cfg.to_string()],
    )
    .expect("start sim");
    let SimKvReady {
        kv_events_endpoint: pub_ep,
        kv_events_replay_endpoint: replay_ep,
    } = serde_json::from_value(sim.ready.clone()).unwrap_or_else(|e| {
        panic!(
            "kv_events_endpoint and kv_events_replay_endpoint in the ready file ({e}): {}",
            sim.ready
        )
    });
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&pub_ep).await.expect("connect SUB");
    sub.subscribe("kv").await.expect("subscribe");

    // Ten words: two full blocks of 4 tokens and two tokens left over.
    let prompt = "a b c d e f g h i j";
    complete(&sim, prompt).await;
    // The first batch (seq 0) may have left before the subscription arrived: replay has it.
    let first = wait_until(Duration::from_secs(10), || {
        let ep = replay_ep.clone();
        async move {
            let r = replay_from(&ep, 0).await;
            (!r.is_empty()).then_some(r)
        }
    })
    .await
    .expect("a replayed batch within 10 s");
    assert_eq!(first.len(), 1, "one batch for one prefill");
    assert!(first[0][0].is_empty(), "the DEALER's empty delimiter");
    assert_eq!(first[0][1], b"kv".to_vec(), "topic");
    assert_eq!(
        first[0][2],
        0u64.to_be_bytes().to_vec(),
        "sequence starts at 0"
    );
    let batch = decode_batch(&first[0][3]).expect("decode");
    assert_eq!(batch.data_parallel_rank, Some(0));
    let s = stored(&batch);
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].0.len(), 2, "two full blocks stored");
    assert_eq!(s[0].1.len(), 8, "their 8 token ids");

    // A repeated prompt: a hit for both blocks, nothing new stored, no batch published.
    complete(&sim, prompt).await;
    assert_eq!(
        metric(&sim, "vllm:prefix_cache_hits_total").await,
        8,
        "8 tokens hit"
    );
    assert_eq!(metric(&sim, "vllm:prefix_cache_queries_total").await, 20);
    assert_eq!(
        metric(
            &sim,
            "vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"tiny-sim\",source=\"local_cache_hit\"}"
        )
        .await,
        8
    );
    assert_eq!(
        metric(
            &sim,
            "vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"tiny-sim\",source=\"local_compute\"}"
        )
        .await,
        12
    );

    // A longer prompt sharing the prefix stores only its new block, with its parent; it comes
    // live over the SUB (retried with fresh prompts until the subscription is in place).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    let live = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no live batch within 10 s"
        );
        n += 1;
        complete(&sim, &format!("{prompt} k{n} l m")).await;
        let mut got = None;
        // The SUB may also hold the first batch (seq 0), when it subscribed in time.
        while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
            let f = frames(m);
            if f[1] != 0u64.to_be_bytes() {
                got = Some(f);
                break;
            }
        }
        if let Some(f) = got {
            break f;
        }
    };
    assert_eq!(live[0], b"kv".to_vec());
    let seq = u64::from_be_bytes(live[1].clone().try_into().expect("8-byte seq"));
    assert!(seq >= 1, "after the first batch");
    let b = decode_batch(&live[2]).expect("decode live");
    match &b.events[..] {
        [
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                ..
            },
        ] => {
            assert_eq!(block_hashes.len(), 1);
            assert_eq!(*parent_block_hash, Some(s[0].0[1]), "chained to the prefix");
            assert_eq!(token_ids.len(), 4);
            assert_eq!(*block_size, 4);
            assert_eq!(medium.as_deref(), Some("GPU"));
        }
        e => panic!("expected one BlockStored, got {e:?}"),
    }
    // Replay from that sequence gives the same bytes as the PUB did.
    let again = replay_from(&replay_ep, seq).await;
    assert_eq!(again[0][1..], live[..]);

    let stats = sim.counters().await;
    let pc = stats
        .prefix_cache
        .expect("the simulator's prefix cache counters");
    assert_eq!(pc.capacity, 4096);
    assert!(pc.blocks >= 3, "{pc:?}");
    assert!(pc.hits >= 8, "{pc:?}");
}
