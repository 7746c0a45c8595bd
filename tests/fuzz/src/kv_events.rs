//! vLLM KV event messages (ZMQ frames `[topic, 8-byte big-endian sequence, msgpack batch]`)
//! through the decoder (`narwhal_shared::kv_events::decode_batch`) and the router's KV index
//! ([`narwhal_router::fuzzing::kv_stream`]).
//!
//! Input layout: messages one after another, each `[frame count (1 byte, taken mod 5)]`
//! then per frame `[length (2 bytes big-endian)][bytes]`; a frame cut short by the end of the
//! input keeps what there is. [`encode`] writes it.

use bytes::Bytes;
use narwhal_shared::Clock as _;
use narwhal_shared::kv_events::{decode_batch, encode_batch};

/// Splits an input into messages (see the module doc).
pub fn messages(mut data: &[u8]) -> Vec<Vec<Bytes>> {
    let mut out = Vec::new();
    while let Some((&n, rest)) = data.split_first() {
        data = rest;
        let mut frames = Vec::new();
        for _ in 0..n % 5 {
            let len = match data {
                [a, b, rest @ ..] => {
                    data = rest;
                    usize::from(u16::from_be_bytes([*a, *b]))
                }
                _ => std::mem::take(&mut data).len(),
            };
            let (frame, rest) = data.split_at(len.min(data.len()));
            frames.push(Bytes::copy_from_slice(frame));
            data = rest;
        }
        out.push(frames);
    }
    out
}

/// The input [`messages`] splits back into `msgs` (frames of at most 65535 bytes).
pub fn encode(msgs: &[Vec<Vec<u8>>]) -> Vec<u8> {
    let mut out = Vec::new();
    for frames in msgs {
        out.push(frames.len() as u8);
        for f in frames {
            out.extend_from_slice(&(f.len() as u16).to_be_bytes());
            out.extend_from_slice(f);
        }
    }
    out
}

/// Checks one input: the whole input and every message's last frame as a batch payload, then
/// every message through the KV index.
///
/// # Panics
/// When a decoded batch does not re-encode to bytes that decode to the same batch (`ts` NaN
/// compared by its encoding), or the KV index breaks a rule of its own.
pub fn check(data: &[u8]) {
    round_trip(data);
    let msgs = messages(data);
    for frames in &msgs {
        if let Some(last) = frames.last() {
            round_trip(last);
        }
    }
    narwhal_router::fuzzing::kv_stream(&msgs, narwhal_shared::SystemClock.now());
}

fn round_trip(payload: &[u8]) {
    let Ok(batch) = decode_batch(payload) else {
        return;
    };
    let bytes = encode_batch(&batch);
    let again = decode_batch(&bytes)
        .unwrap_or_else(|e| panic!("a re-encoded batch does not decode: {e}\n{batch:?}"));
    assert_eq!(encode_batch(&again), bytes, "re-encoding is not stable");
    if !batch.ts.is_nan() {
        assert_eq!(again, batch, "decode -> encode -> decode changed the batch");
    }
}
