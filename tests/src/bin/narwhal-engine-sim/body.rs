//! Response bodies: a whole buffer (optionally fragmented) or a lazily generated SSE token
//! stream. The stream owns the request's [`Tracker`], so a body dropped before it finished (the
//! client closed the connection) is recorded as `cancelled` at once.
//!
//! ```text
//!  poll_frame ─► [role chunk] ─► token chunks (tpot apart) ─► [usage] ─► [DONE] ─► end
//!                      └─ cut fault: K token chunks, flush, then a body error (hyper aborts the
//!                         connection: no terminating chunk, no [DONE])
//!  fragment fault: every produced byte run is re-cut into K-byte frames, one flush each
//! ```
//!
//! No task or channel per request: frames are produced inside `poll_frame`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokio::time::Sleep;

use crate::protocol::{ChunkFormat, DONE};
use crate::stats::{Outcome, Stats, Tracker};
use crate::tokenizer;

/// Tokens batched into one frame when there is no per-token delay (same bytes on the wire,
/// fewer writes).
const BATCH: u64 = 32;

/// Pause between the last chunk before a cut and the abort, so the chunks are flushed first.
const CUT_FLUSH: Duration = Duration::from_millis(20);

/// Generation parameters of a streamed answer.
pub(crate) struct StreamPlan {
    /// Chunk rendering.
    pub(crate) fmt: ChunkFormat,
    /// Prompt hash (generation input).
    pub(crate) prompt_hash: u64,
    /// Prompt length in tokens (usage).
    pub(crate) prompt_tokens: u64,
    /// Simulator seed.
    pub(crate) seed: u64,
    /// Tokens to generate.
    pub(crate) max_tokens: u64,
    /// Chat: send the role chunk first.
    pub(crate) role_chunk: bool,
    /// Send the usage chunk before `[DONE]`.
    pub(crate) include_usage: bool,
    /// Delay between tokens.
    pub(crate) tpot: Duration,
    /// Added to each delay per request running on the engine (`--tpot-per-running-us`).
    pub(crate) tpot_per_running: Duration,
    /// Added to each delay per KV block running requests hold (`--tpot-per-kv-block-us`).
    pub(crate) tpot_per_kv_block: Duration,
    /// Cut fault: abort after this many token chunks.
    pub(crate) cut_after: Option<u64>,
    /// Fragment fault: bytes per write.
    pub(crate) fragment: Option<usize>,
    /// Top-level member added to the last token chunk (streamed prefill's kv_transfer_params).
    pub(crate) final_extra: String,
    /// Choices (`n`): each position streams one chunk per choice, `index` 0..n, choice `i`
    /// generated with seed `seed + i`; usage sums them.
    pub(crate) n: u32,
    /// `usage.prompt_tokens_details.cached_tokens` of the usage chunk, when
    /// `--enable-prompt-tokens-details`.
    pub(crate) cached_tokens: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Role,
    Tokens,
    Tail,
    CutFlush,
    Cut,
    End,
}

/// A streamed token answer; see the module docs.
pub(crate) struct TokenStream {
    plan: StreamPlan,
    tracker: Tracker,
    stats: Arc<Stats>,
    next: u64,
    stage: Stage,
    sleep: Option<Pin<Box<Sleep>>>,
    pending: BytesMut,
    yield_before_next: bool,
    scratch: String,
}

impl TokenStream {
    /// A stream that will settle `tracker` when it ends (or on drop, as cancelled).
    pub(crate) fn new(plan: StreamPlan, mut tracker: Tracker, stats: Arc<Stats>) -> Self {
        tracker.mark_head_sent();
        let stage = if plan.role_chunk {
            Stage::Role
        } else {
            Stage::Tokens
        };
        TokenStream {
            plan,
            tracker,
            stats,
            next: 0,
            stage,
            sleep: None,
            pending: BytesMut::new(),
            yield_before_next: false,
            scratch: String::with_capacity(1024),
        }
    }

    /// Produces the next run of bytes into `scratch`; `Pending` while a tpot/flush timer runs;
    /// `Err` to abort the connection.
    fn produce(&mut self, cx: &mut Context<'_>) -> Poll<Result<bool, std::io::Error>> {
        self.scratch.clear();
        match self.stage {
            Stage::Role => {
                for i in 0..self.plan.n.max(1) {
                    self.plan.fmt.set_index(i);
                    self.plan.fmt.role_chunk(&mut self.scratch);
                }
                self.stage = Stage::Tokens;
                Poll::Ready(Ok(true))
            }
            Stage::Tokens => {
                if self.next > 0 && !self.plan.tpot.is_zero() {
                    // Running: those in flight less those waiting for a place
                    // (`--max-num-seqs`), which are not in the batch.
                    let running = self.stats.running();
                    let blocks = self
                        .stats
                        .kv_used
                        .load(std::sync::atomic::Ordering::Relaxed);
                    let gap = self.plan.tpot
                        + self.plan.tpot_per_running
                            * u32::try_from(running.max(1) - 1).unwrap_or(0)
                        + self.plan.tpot_per_kv_block.mul_f64(blocks as f64);
                    let sleep = self
                        .sleep
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep(gap)));
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.sleep = None;
                }
                let batch = if self.plan.tpot.is_zero() && self.plan.cut_after.is_none() {
                    BATCH
                } else {
                    1
                };
                let mut produced = 0;
                while produced < batch && self.next < self.plan.max_tokens {
                    if let Some(k) = self.plan.cut_after
                        && self.next >= k
                    {
                        break;
                    }
                    let position = self.next;
                    self.next += 1;
                    produced += 1;
                    let last = self.next == self.plan.max_tokens;
                    let extra = if last {
                        self.plan.final_extra.as_str()
                    } else {
                        ""
                    };
                    for i in 0..self.plan.n.max(1) {
                        let id = tokenizer::generated_token(
                            self.plan.prompt_hash,
                            self.plan.seed.wrapping_add(u64::from(i)),
                            position,
                        );
                        self.plan.fmt.set_index(i);
                        self.plan
                            .fmt
                            .token_chunk(&mut self.scratch, id, last, extra);
                    }
                }
                let width = u64::from(self.plan.n.max(1));
                self.stats
                    .prom_generation_tokens
                    .fetch_add(produced * width, Relaxed);
                self.tracker.set_tokens(self.next * width);
                if let Some(k) = self.plan.cut_after
                    && self.next >= k.min(self.plan.max_tokens)
                {
                    // K token chunks sent (or all of them when K >= max_tokens): no [DONE].
                    self.stage = Stage::CutFlush;
                } else if self.next >= self.plan.max_tokens {
                    self.stage = Stage::Tail;
                }
                Poll::Ready(Ok(produced > 0))
            }
            Stage::Tail => {
                let completion = self.next * u64::from(self.plan.n.max(1));
                if self.plan.include_usage {
                    self.plan.fmt.usage_chunk(
                        &mut self.scratch,
                        self.plan.prompt_tokens,
                        completion,
                        self.plan.cached_tokens,
                    );
                }
                self.scratch.push_str(DONE);
                self.stage = Stage::End;
                self.tracker.finish(Outcome::Ok, 200, completion);
                Poll::Ready(Ok(true))
            }
            Stage::CutFlush => {
                let sleep = self
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(CUT_FLUSH)));
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleep = None;
                self.stage = Stage::Cut;
                Poll::Ready(Ok(false))
            }
            Stage::Cut => {
                self.tracker.finish_fault(200, self.next);
                self.stage = Stage::End;
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "injected cut fault",
                )))
            }
            Stage::End => Poll::Ready(Ok(false)),
        }
    }
}

/// Every response body the simulator sends.
pub(crate) enum SimBody {
    /// A whole buffer, sent in one frame (or in `fragment`-byte frames).
    Full {
        /// Remaining bytes.
        data: Bytes,
        /// Fragment fault: bytes per write.
        fragment: Option<usize>,
        /// Yield (and so flush) before the next fragment.
        yield_before_next: bool,
    },
    /// A generated SSE stream.
    Stream(Box<TokenStream>),
}

impl SimBody {
    /// A whole body.
    pub(crate) fn full(data: impl Into<Bytes>) -> Self {
        SimBody::Full {
            data: data.into(),
            fragment: None,
            yield_before_next: false,
        }
    }

    /// A whole body written `fragment` bytes at a time.
    pub(crate) fn fragmented(data: impl Into<Bytes>, fragment: Option<usize>) -> Self {
        SimBody::Full {
            data: data.into(),
            fragment,
            yield_before_next: false,
        }
    }

    /// An empty body.
    pub(crate) fn empty() -> Self {
        Self::full(Bytes::new())
    }
}

/// Yields once (so hyper flushes what it has) when `flag` is set; clears it.
fn yield_once(flag: &mut bool, cx: &mut Context<'_>) -> bool {
    if *flag {
        *flag = false;
        cx.waker().wake_by_ref();
        true
    } else {
        false
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            SimBody::Full {
                data,
                fragment,
                yield_before_next,
            } => {
                if data.is_empty() {
                    return Poll::Ready(None);
                }
                match fragment {
                    None => Poll::Ready(Some(Ok(Frame::data(std::mem::take(data))))),
                    Some(k) => {
                        if yield_once(yield_before_next, cx) {
                            return Poll::Pending;
                        }
                        let n = (*k).min(data.len());
                        *yield_before_next = true;
                        Poll::Ready(Some(Ok(Frame::data(data.split_to(n)))))
                    }
                }
            }
            SimBody::Stream(s) => loop {
                if let Some(k) = s.plan.fragment
                    && !s.pending.is_empty()
                {
                    if yield_once(&mut s.yield_before_next, cx) {
                        return Poll::Pending;
                    }
                    let n = k.min(s.pending.len());
                    s.yield_before_next = true;
                    return Poll::Ready(Some(Ok(Frame::data(s.pending.split_to(n).freeze()))));
                }
                if s.stage == Stage::End {
                    return Poll::Ready(None);
                }
                match s.produce(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                    Poll::Ready(Ok(false)) => continue,
                    Poll::Ready(Ok(true)) => {
                        if s.plan.fragment.is_some() {
                            s.pending.extend_from_slice(s.scratch.as_bytes());
                            continue;
                        }
                        let bytes = Bytes::copy_from_slice(s.scratch.as_bytes());
                        return Poll::Ready(Some(Ok(Frame::data(bytes))));
                    }
                }
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            SimBody::Full { data, .. } => data.is_empty(),
            SimBody::Stream(s) => s.stage == Stage::End && s.pending.is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full { data, .. } => SizeHint::with_exact(data.len() as u64),
            SimBody::Stream(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::Phase;
    use crate::protocol::Kind;
    use http_body_util::BodyExt;

    fn plan(kind: Kind, max_tokens: u64) -> StreamPlan {
        StreamPlan {
            fmt: ChunkFormat::new(kind, "cmpl-t", "m", 1, true, &[1, 2, 3]),
            n: 1,
            prompt_hash: 42,
            prompt_tokens: 3,
            seed: 0,
            max_tokens,
            role_chunk: kind == Kind::Chat,
            include_usage: true,
            tpot: Duration::ZERO,
            tpot_per_running: Duration::ZERO,
            tpot_per_kv_block: Duration::ZERO,
            cut_after: None,
            fragment: None,
            final_extra: String::new(),
            cached_tokens: None,
        }
    }

    fn body(plan: StreamPlan, stats: &Arc<Stats>) -> SimBody {
        let t = Tracker::new(stats.clone(), "r".into(), Phase::Aggregated);
        SimBody::Stream(Box::new(TokenStream::new(plan, t, stats.clone())))
    }

    /// Collects frames until the end or an error: (frames, ended with error).
    async fn collect(mut b: SimBody) -> (Vec<Bytes>, bool) {
        let mut frames = Vec::new();
        while let Some(f) = b.frame().await {
            match f {
                Ok(f) => frames.push(f.into_data().expect("data frame")),
                Err(_) => return (frames, true),
            }
        }
        (frames, false)
    }

    fn text(frames: &[Bytes]) -> String {
        frames
            .iter()
            .map(|f| String::from_utf8_lossy(f).into_owned())
            .collect()
    }

    fn recent_outcome(stats: &Stats) -> (String, u64) {
        let doc = serde_json::to_value(stats.doc("e", "vllm", "m", 0.0)).unwrap();
        let r = &doc["recent"][0];
        (
            r["outcome"].as_str().unwrap().to_string(),
            r["tokens"].as_u64().unwrap(),
        )
    }

    #[tokio::test]
    async fn full_stream_ends_with_usage_and_done() {
        let stats = Arc::new(Stats::default());
        let (frames, err) = collect(body(plan(Kind::Chat, 4), &stats)).await;
        assert!(!err);
        let t = text(&frames);
        assert_eq!(
            t.matches("\"token_ids\":[").count(),
            5,
            "role chunk + 4 tokens"
        );
        assert!(t.contains("\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4"));
        assert!(t.ends_with("data: [DONE]\n\n"));
        assert_eq!(recent_outcome(&stats), ("ok".into(), 4));
        assert_eq!(stats.prom_generation_tokens.load(Relaxed), 4);
    }

    #[tokio::test]
    async fn cut_sends_k_tokens_then_errors_without_done() {
        let stats = Arc::new(Stats::default());
        let mut p = plan(Kind::Completion, 10);
        p.cut_after = Some(3);
        let (frames, err) = collect(body(p, &stats)).await;
        assert!(
            err,
            "the body ends with an error so hyper aborts the connection"
        );
        let t = text(&frames);
        assert_eq!(t.matches("data: ").count(), 3);
        assert!(!t.contains("[DONE]"));
        assert_eq!(recent_outcome(&stats), ("fault".into(), 3));
    }

    #[tokio::test]
    async fn fragments_reassemble_to_the_same_bytes() {
        let stats = Arc::new(Stats::default());
        let (whole, _) = collect(body(plan(Kind::Completion, 5), &stats)).await;
        let mut p = plan(Kind::Completion, 5);
        p.fragment = Some(5);
        let (frags, err) = collect(body(p, &stats)).await;
        assert!(!err);
        assert!(frags.iter().all(|f| f.len() <= 5 && !f.is_empty()));
        assert_eq!(text(&frags), text(&whole));
    }

    #[tokio::test]
    async fn tpot_paces_tokens_and_a_dropped_body_is_cancelled() {
        let stats = Arc::new(Stats::default());
        let mut p = plan(Kind::Completion, 5);
        p.tpot = Duration::from_millis(20);
        let t0 = tokio::time::Instant::now();
        let (frames, _) = collect(body(p, &stats)).await;
        assert_eq!(frames.len(), 6, "one frame per token, then usage + [DONE]");
        // tokio's `start_paused` needs the test-util feature, which this crate does not enable;
        // real time with a lower bound only.
        assert!(t0.elapsed() >= Duration::from_millis(80), "4 gaps of 20 ms");

        let stats = Arc::new(Stats::default());
        let mut p = plan(Kind::Completion, 5);
        p.tpot = Duration::from_millis(100);
        let mut b = body(p, &stats);
        let first = b.frame().await.unwrap().unwrap();
        assert!(first.is_data());
        assert_eq!(stats.in_flight.load(Relaxed), 1);
        drop(b);
        assert_eq!(stats.in_flight.load(Relaxed), 0);
        assert_eq!(stats.cancelled.load(Relaxed), 1);
        assert_eq!(recent_outcome(&stats), ("cancelled".into(), 1));
    }
}
