//! A decode stream after its first token ([`LiveStream`]): the upstream body, the SSE parser
//! and the relay state of one decode leg, read until the relay has something to say.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;

use narwhal_relay::{
    Aggregator, Head, RelayOptions, RelayStep, SseParser, StreamFailure, StreamState, chunk_usage,
};

use super::{CutDuring, CutFailure, LegError};

/// A decode stream that has produced its first token. Dropping it closes the upstream.
pub(crate) struct LiveStream {
    body: Incoming,
    parser: SseParser,
    state: StreamState,
    /// Upstream bytes read but not parsed yet (the parser stops at the first output).
    rest: Bytes,
    /// The end of the stream (`Done` or `Failed`), seen while frames before it still wait
    /// to be sent.
    pending: Option<RelayStep>,
    /// SSE frames to send first (held chunks and the first token's, and what
    /// [`LiveStream::gather_ready`] added), `data: <json>\n\n`.
    pub(crate) first: Bytes,
    ended: bool,
    /// A failure [`LiveStream::gather_ready`] met, returned by the next [`LiveStream::next`].
    failed: Option<LegError>,
    /// The read-gap timer ([`LiveStream::next`]'s `gap`), made on the first wait.
    gap_timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl LiveStream {
    /// The stream of a decode leg's 200 answer `body`, relayed with `opts`; nothing read yet.
    pub(super) fn new(body: Incoming, opts: RelayOptions) -> LiveStream {
        LiveStream {
            body,
            // One event may be as large as the response may be: the router itself asks for
            // the prompt's token ids, which vLLM sends in the first chunk.
            parser: SseParser::with_limit(
                usize::try_from(opts.max_response_bytes).unwrap_or(usize::MAX),
            ),
            state: StreamState::new(opts),
            rest: Bytes::new(),
            pending: None,
            first: Bytes::new(),
            ended: false,
            failed: None,
            gap_timer: None,
        }
    }

    /// Tokens counted so far.
    pub(crate) fn tokens(&self) -> u64 {
        self.state.tokens()
    }

    /// Generated tokens: the engine's `usage.completion_tokens`, else the tokens counted.
    pub(crate) fn output_tokens(&self) -> u64 {
        self.state.output_tokens()
    }

    /// The engine's usage-only chunk (its JSON), held back from the relayed stream.
    pub(crate) fn take_usage_chunk(&mut self) -> Option<Bytes> {
        self.state.take_usage_chunk()
    }

    /// The first relayed chunk's `id`, `created` and `model`
    /// ([`RelayOptions::capture_head`]).
    pub(crate) fn head(&self) -> Option<&Head> {
        self.state.head()
    }

    /// The answer a non-streaming client's relay built ([`RelayOptions::aggregate`]).
    pub(crate) fn take_aggregator(&mut self) -> Option<Aggregator> {
        self.state.take_aggregator()
    }

    /// The frames relayed by the last [`LiveStream::next`] that returned `Output`.
    pub(crate) fn take_output(&mut self) -> Bytes {
        self.state.take_output()
    }

    /// The engine's usage: its usage-only chunk's `usage` when given (see
    /// [`LiveStream::take_usage_chunk`]), else the counts a content chunk carried.
    pub(crate) fn engine_usage(&self, usage_chunk: Option<&[u8]>) -> Option<Value> {
        usage_chunk
            .and_then(chunk_usage)
            .or_else(|| self.state.engine_usage_value())
    }

    /// Read until the relay has something to say (`Output`, `Done` or `Failed`); `gap` bounds
    /// the wait for each upstream read (`engine.decode_read_timeout_s`). One `Output` carries
    /// every frame of one upstream read (the first stops at the first token, so the clock of
    /// the first output is the first token's).
    pub(crate) async fn next(&mut self, gap: Option<Duration>) -> Result<RelayStep, LegError> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        loop {
            if let Some(step) = self.pending.take() {
                return Ok(step);
            }
            if !self.rest.is_empty() {
                let rest = std::mem::take(&mut self.rest);
                if let Some(step) = self.feed(rest) {
                    return Ok(step);
                }
                continue;
            }
            if self.ended {
                return Ok(self.state.on_end());
            }
            let frame = self.frame_within(gap).await?;
            match frame {
                None => {
                    self.parser.finish();
                    self.ended = true;
                }
                Some(Err(e)) => {
                    return Err(LegError::Cut(CutFailure::new(CutDuring::Stream, &e)));
                }
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data()
                        && let Some(step) = self.feed(data)
                    {
                        return Ok(step);
                    }
                }
            }
        }
    }

    /// Adds to [`LiveStream::first`] the output that is ready without waiting on the engine:
    /// the rest of the read that held the first token, then the frames the engine connection
    /// has already received. One yield lets hyper's connection task, which decodes one chunk
    /// of what it read at a time, hand over the next; the gathering stops at the first wait
    /// after it, or at the stream's end (kept for the next [`LiveStream::next`], as is a
    /// failure met on the way). Costs nothing when the engine sent only the first token: the
    /// frames of one read reach the client in one write instead of one per chunk
    /// (docs/design/architecture.md, "Writes on the client connection").
    pub(crate) async fn gather_ready(&mut self) {
        use futures_util::FutureExt as _;
        let mut gathered: Option<Vec<u8>> = None;
        let mut yielded = false;
        while self.pending.is_none() && self.failed.is_none() {
            match self.next(None).now_or_never() {
                Some(Ok(RelayStep::Output)) => {
                    let out = self.state.take_output();
                    gathered
                        .get_or_insert_with(|| self.first.to_vec())
                        .extend_from_slice(&out);
                    yielded = false;
                }
                Some(Ok(RelayStep::Hold)) => {}
                Some(Ok(end)) => self.pending = Some(end),
                Some(Err(e)) => self.failed = Some(e),
                None if yielded => break,
                None => {
                    tokio::task::yield_now().await;
                    yielded = true;
                }
            }
        }
        if let Some(g) = gathered {
            self.first = Bytes::from(g);
        }
    }

    /// Whether the stream's end (its `[DONE]`, or a failure) is already known: the relay
    /// then finishes without waiting on the engine.
    pub(crate) fn end_known(&self) -> bool {
        self.pending.is_some() || self.failed.is_some()
    }

    /// The next upstream frame, or `ReadTimeout` after `gap` of silence from the call. One
    /// timer serves the whole stream: it is re-armed only when it fires early (it still
    /// holds an earlier call's limit), so a token costs no timer registration.
    async fn frame_within(
        &mut self,
        gap: Option<Duration>,
    ) -> Result<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>, LegError> {
        let Some(g) = gap else {
            return Ok(self.body.frame().await);
        };
        let due = tokio::time::Instant::now() + g;
        let LiveStream {
            body, gap_timer, ..
        } = self;
        let timer = gap_timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        loop {
            tokio::select! {
                biased;
                f = body.frame() => return Ok(f),
                () = timer.as_mut() => {
                    if tokio::time::Instant::now() >= due {
                        return Err(LegError::ReadTimeout);
                    }
                    timer.as_mut().reset(due);
                }
            }
        }
    }

    /// Parses upstream bytes; `Some` when the relay has something to say.
    fn feed(&mut self, data: Bytes) -> Option<RelayStep> {
        let state = &mut self.state;
        let was_started = state.started();
        let mut end: Option<RelayStep> = None;
        let used = self
            .parser
            .feed(&data, |payload| match state.on_data(payload) {
                RelayStep::Hold | RelayStep::Output => was_started || !state.started(),
                step => {
                    end = Some(step);
                    false
                }
            });
        if end.is_none() {
            if self.parser.overflowed() {
                end = Some(RelayStep::Failed(StreamFailure::ResponseLimit));
            } else if used < data.len() {
                self.rest = data.slice(used..);
            }
        }
        match (end, self.state.has_output()) {
            (Some(step), true) => {
                self.pending = Some(step);
                Some(RelayStep::Output)
            }
            (Some(step), false) => Some(step),
            (None, true) => Some(RelayStep::Output),
            (None, false) => None,
        }
    }
}
