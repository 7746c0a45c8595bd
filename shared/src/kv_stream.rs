//! The engines' KV event sockets as a subscriber reads them (vLLM's `ZmqEventPublisher`, which
//! SGLang shares): a PUB message's frames, and the replay ROUTER's answer. Used by the router
//! (its KV index, docs/design/kv-aware-placement.md) and by the agent (the block set it keeps
//! next to each engine, [`crate::kv_blocks`]).
//!
//! ```text
//! PUB message      [topic, seq (8 bytes big-endian), payload]
//! replay           DEALER sends ["", start (8 bytes BE)];
//!                  reads ["", topic, seq, payload] per buffered batch with seq >= start,
//!                  then ["", "", REPLAY_END, ""]
//! ```

use std::time::Duration;

use bytes::Bytes;
use zeromq::{Socket as _, SocketRecv as _, SocketSend as _, ZmqMessage};

use crate::kv_events::{KvEventBatch, REPLAY_END, decode_batch};

/// `[topic, seq (8 bytes BE), payload]` → `(seq, batch)`; `None` for any other frame shape
/// or a payload [`decode_batch`] refuses.
pub fn parse(frames: &[Bytes]) -> Option<(u64, KvEventBatch)> {
    let [_topic, seq, payload] = frames else {
        return None;
    };
    let seq = u64::from_be_bytes(seq.as_ref().try_into().ok()?);
    Some((seq, decode_batch(payload).ok()?))
}

/// Asks the replay socket at `endpoint` for every buffered batch from `from` on. `None` when it
/// fails, answers something else, or takes longer than `limit`.
pub async fn replay(
    endpoint: &str,
    from: u64,
    limit: Duration,
) -> Option<Vec<(u64, KvEventBatch)>> {
    let run = async {
        let mut d = zeromq::DealerSocket::new();
        d.connect(endpoint).await.ok()?;
        let req = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&from.to_be_bytes()),
        ])
        .ok()?;
        d.send(req).await.ok()?;
        let mut out = Vec::new();
        loop {
            let frames = d.recv().await.ok()?.into_vec();
            match &frames[..] {
                [_, _, seq, _] if seq.as_ref() == REPLAY_END => return Some(out),
                [_, rest @ ..] => out.push(parse(rest)?),
                _ => return None,
            }
        }
    };
    tokio::time::timeout(limit, run).await.ok().flatten()
}
