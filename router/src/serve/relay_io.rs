//! The relay's IO loop: once an attempt produced its first output, the rest of each prompt's
//! answer goes to the client (a streaming client's SSE channel, or the [`Aggregator`] of a
//! non-streaming client), feeding the breaker and the role controller on the way
//! (behaviour.md 7.3). The byte-level rules of what is relayed are in `crate::relay`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::breaker::Observation;
use crate::config::secs;
use crate::controller::Track;
use crate::failure::{Expiry, RequestFailure};
use crate::fleet::Resident;
use crate::kv_cache::KvCache;
use crate::outcome::Pending;
use crate::parts::Parts;
use crate::placement::Phase;
use crate::upstream::{CleanAnswer, LegError, LiveStream};
use narwhal_relay::{
    Head, RelayStep, answer_chunks, data_frame, reindex, sanitize_answer, sum_usages, usage_value,
};

use super::Answering;
use super::leg::AbortOnDrop;
use super::leg::{Output, Started};

pub(super) fn gap(parts: &Parts) -> Option<Duration> {
    let g = parts.cfg.engine.decode_read_timeout_s;
    (g > 0.0).then(|| secs(g))
}

pub(super) struct TokenClock {
    pub(super) first_at: Instant,
    pub(super) first_tokens: u64,
    pub(super) last_at: Instant,
    pub(super) tokens: u64,
}

impl TokenClock {
    pub(super) fn new(at: Instant, tokens: u64) -> Self {
        TokenClock {
            first_at: at,
            first_tokens: tokens,
            last_at: at,
            tokens,
        }
    }
    pub(super) fn update(&mut self, at: Instant, tokens: u64) {
        if tokens > self.tokens {
            self.tokens = tokens;
            self.last_at = at;
        }
    }
    pub(super) fn tpot(&self) -> Option<f64> {
        let extra = self.tokens.saturating_sub(self.first_tokens);
        (extra > 0).then(|| (self.last_at - self.first_at).as_secs_f64() / extra as f64)
    }
}

/// What one prompt's answer contributes to the request's record.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SubStats {
    /// Generated tokens (the engine's count when it gave one).
    pub(super) tokens: u64,
    /// Mean gap between streamed tokens after the first, seconds.
    pub(super) tpot: Option<f64>,
    /// The engine's own `usage.prompt_tokens`, when its answer carried usage.
    pub(super) prompt_tokens: Option<u64>,
    /// The engine's own `usage.prompt_tokens_details.cached_tokens` (vLLM with
    /// `--enable-prompt-tokens-details`), when its answer carried it.
    pub(super) cached_tokens: Option<u64>,
}

/// `usage.prompt_tokens` of an engine's usage object.
fn engine_prompt_tokens(usage: Option<&Value>) -> Option<u64> {
    usage?.get("prompt_tokens")?.as_u64()
}

/// `usage.prompt_tokens_details.cached_tokens` of an engine's usage object: the prompt tokens
/// the engine served from its prefix cache (vLLM's `PromptTokenUsageInfo`, written under
/// `--enable-prompt-tokens-details`; on a P/D decode, the prefill's count). Absent or null:
/// `None`.
fn engine_cached_tokens(usage: Option<&Value>) -> Option<u64> {
    usage?
        .get("prompt_tokens_details")?
        .get("cached_tokens")?
        .as_u64()
}

/// Completes the request's journal record from its sub-requests' `stats`, and holds its KV
/// credit against the engine's own cached-token count (`kv`, [`KvCache::check_credit`]) when
/// both are known.
pub(super) fn finish_record(pending: &mut Pending, stats: &[SubStats], kv: &KvCache) {
    let rec = pending.record();
    rec.output_len = stats.iter().map(|s| s.tokens).sum();
    // Every prompt's engine count, or none: a partial sum would read as the request's.
    rec.engine_prompt_tokens = stats
        .iter()
        .map(|s| s.prompt_tokens)
        .sum::<Option<u64>>()
        .filter(|_| !stats.is_empty());
    rec.engine_cached_tokens = stats
        .iter()
        .map(|s| s.cached_tokens)
        .sum::<Option<u64>>()
        .filter(|_| !stats.is_empty());
    if let (Some((e, rank, reported)), Some(credited), Some(engine), [_]) = (
        rec.kv_check,
        rec.cached_tokens,
        rec.engine_cached_tokens,
        stats,
    ) {
        kv.check_credit(e, rank, reported, credited, engine);
    }
    let tpots: Vec<f64> = stats.iter().filter_map(|s| s.tpot).collect();
    rec.tpot_s = (!tpots.is_empty()).then(|| tpots.iter().sum::<f64>() / tpots.len() as f64);
}

/// Where relayed chunks go: a streaming client's channel, or the [`Aggregator`] that builds a
/// non-streaming client's one response object.
pub(super) trait Sink {
    /// Delivers relayed SSE frames; `false` when the client is gone or too slow (it has
    /// until `deadline` to take them).
    fn deliver(&mut self, frames: Bytes, deadline: Instant) -> impl Future<Output = bool> + Send;
    /// Resolves when the client went away (never for a non-streaming client, whose handler
    /// future hyper drops instead). Made once per relay: the future does not borrow the sink.
    fn gone(&self) -> impl Future<Output = ()> + Send + 'static;
}

/// A streaming client: SSE frames over the response body's channel. For a whole answer
/// (a prefill that finished the generation), `base` shifts choice indexes for prompt `base`
/// of a fanned-out batch and `head` keeps its `id`, `created` and `model` for a usage chunk
/// the router writes itself (a live stream's relay does both itself).
pub(super) struct Stream {
    pub(super) tx: mpsc::Sender<Bytes>,
    pub(super) base: Option<u64>,
    pub(super) head: Option<Head>,
}

impl Stream {
    pub(super) fn new(tx: &mpsc::Sender<Bytes>, base: Option<u64>) -> Stream {
        Stream {
            tx: tx.clone(),
            base,
            head: None,
        }
    }
}

impl Stream {
    /// Delivers a whole answer as the SSE chunks of a stream ([`answer_chunks`]).
    pub(super) async fn deliver_whole(
        &mut self,
        answer: &Value,
        chat: bool,
        deadline: Instant,
    ) -> bool {
        let mut frames = Vec::new();
        for mut chunk in answer_chunks(answer, chat) {
            if let Some(base) = self.base {
                reindex(&mut chunk, base);
            }
            if self.head.is_none() {
                self.head = Some(Head::of(&chunk));
            }
            frames.extend_from_slice(&data_frame(&chunk));
        }
        self.deliver(Bytes::from(frames), deadline).await
    }
}

impl Sink for Stream {
    async fn deliver(&mut self, frames: Bytes, deadline: Instant) -> bool {
        // A client that stops reading must not hold its seats and the upstream past the
        // deadline.
        matches!(
            tokio::time::timeout_at(deadline.into(), self.tx.send(frames)).await,
            Ok(Ok(()))
        )
    }

    fn gone(&self) -> impl Future<Output = ()> + Send + 'static {
        let tx = self.tx.clone();
        async move { tx.closed().await }
    }
}

/// Sends a final frame (the usage chunk, `[DONE]` or the error frame), waiting at most
/// [`FINAL_FRAME_WAIT`] for a slow client.
pub(super) async fn finish_frame(tx: &mpsc::Sender<Bytes>, frame: Bytes) {
    let _ = tokio::time::timeout(FINAL_FRAME_WAIT, tx.send(frame)).await;
}

/// A non-streaming client's sink: its answer is built in the relay's own scan of each
/// frame ([`narwhal_relay::RelayOptions::aggregate`]), so no frames reach it.
struct Collect;

impl Sink for Collect {
    async fn deliver(&mut self, frames: Bytes, _deadline: Instant) -> bool {
        debug_assert!(frames.is_empty(), "an aggregating relay writes no frames");
        true
    }

    fn gone(&self) -> impl Future<Output = ()> + Send + 'static {
        std::future::pending::<()>()
    }
}

/// How a relay ended.
pub(super) enum Relayed {
    /// `[DONE]` after output.
    Done,
    /// The client went away (or stopped reading): `pending` settles on drop.
    ClientGone,
    /// The deadline passed, the stream failed after the first output, or the shutdown
    /// budget ran out.
    Failed(RequestFailure),
}

/// How long a final frame (`[DONE]` or the error frame) may wait for a slow client.
pub(super) const FINAL_FRAME_WAIT: Duration = Duration::from_secs(1);

/// The engines and timing of one started answer, without its output.
pub(super) struct Served {
    pub(super) served_by: usize,
    pub(super) decode_ok: bool,
    pub(super) producer: Option<usize>,
    pub(super) decode_at: Instant,
    /// The role controller's bookkeeping of this prompt (token gaps, completion).
    pub(super) track: Track,
}

/// Splits a started answer into its output, what the relay needs to know, and the guards
/// (seat, SGLang prefill task) that must live until the answer ends.
pub(super) fn split(s: Started) -> (Output, Served, Guards) {
    let served = Served {
        served_by: s.served_by,
        decode_ok: s.decode_ok,
        producer: s.producer,
        decode_at: s.decode_at,
        track: s.track,
    };
    (s.out, served, (s._seat, s._prefill_task))
}

/// The seat and SGLang prefill task of an answer being relayed.
pub(super) type Guards = (Option<Resident>, Option<AbortOnDrop>);

/// Relays the rest of a started decode stream into `sink` until `[DONE]`, a failure, the
/// request deadline, the shutdown budget or the client's departure (behaviour.md 7.3),
/// feeding the breaker on the way. The one relay loop of both client kinds.
pub(super) async fn relay(
    parts: &Parts,
    live: &mut LiveStream,
    served: &Served,
    sink: &mut impl Sink,
    deadline: Instant,
    first_at: Instant,
    streaming: bool,
) -> (Relayed, TokenClock) {
    let mut clock = TokenClock::new(first_at, live.tokens());
    served.track.tokens(live.tokens());
    let end = 'relay: {
        let first = std::mem::take(&mut live.first);
        if !first.is_empty() && !sink.deliver(first, deadline).await {
            break 'relay Relayed::ClientGone;
        }
        let gap = gap(parts);
        // Made once, not per token: each is a registration (a timer, the client channel's
        // and the shutdown token's waiter lists) that a per-event future would redo.
        let gone = sink.gone();
        let expired = tokio::time::sleep_until(deadline.into());
        let ended = parts.gate.requests_ended();
        tokio::pin!(gone, expired, ended);
        loop {
            let step = tokio::select! {
                // The deadline, the client and a shutdown come before more output.
                biased;
                () = &mut gone => break 'relay Relayed::ClientGone,
                () = &mut expired => {
                    let expiry = if streaming { Expiry::AfterOutput } else { Expiry::Collecting };
                    break 'relay Relayed::Failed(RequestFailure::Expired(expiry));
                }
                () = &mut ended => {
                    break 'relay Relayed::Failed(RequestFailure::ShutDown { streaming });
                }
                s = live.next(gap) => s,
            };
            clock.update(parts.clock.now(), live.tokens());
            served.track.tokens(live.tokens());
            let err = match step {
                Ok(RelayStep::Output) => {
                    if !sink.deliver(live.take_output(), deadline).await {
                        break 'relay Relayed::ClientGone;
                    }
                    continue;
                }
                Ok(RelayStep::Hold) => continue,
                Ok(RelayStep::Done) => {
                    if served.decode_ok {
                        parts.fleet.observe(served.served_by, Observation::DecodeOk);
                    }
                    break 'relay Relayed::Done;
                }
                Ok(RelayStep::Failed(f)) => LegError::Stream(f),
                Err(e) => e,
            };
            if let Some(class) = err.class(Phase::Decode) {
                parts.fleet.observe_leg_failure(
                    served.served_by,
                    Phase::Decode,
                    class,
                    served.producer,
                );
            }
            tracing::warn!(error = %err.detail(), "decode stream failed after output");
            break 'relay Relayed::Failed(RequestFailure::Decode { err, streaming });
        }
    };
    (end, clock)
}

/// Tokens of a whole answer without usage, estimated from its text like a prompt.
pub(super) fn estimate_tokens(answer: &Value, chars_per_token: f64) -> u64 {
    let chars: usize = answer
        .get("choices")
        .and_then(Value::as_array)
        .map(|choices| {
            choices
                .iter()
                .map(|c| {
                    c.get("text")
                        .or_else(|| c.pointer("/message/content"))
                        .and_then(Value::as_str)
                        .map_or(0, |t| t.chars().count())
                })
                .sum()
        })
        .unwrap_or(0);
    (chars as f64 / chars_per_token.max(0.1)).ceil() as u64
}

/// Prepares a whole answer for the client: cleaned ([`sanitize_answer`]), with the engine's
/// usage or an estimated one. Returns its generated tokens.
pub(super) fn finish_whole(answer: &mut Value, a: &Answering, estimate: u64) -> u64 {
    sanitize_answer(answer, a.return_token_ids);
    let counted = estimate_tokens(answer, a.chars_per_token);
    let usage = usage_value(answer.get("usage"), estimate, counted);
    let tokens = usage
        .get("completion_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(counted);
    answer["usage"] = usage;
    tokens
}

/// One prompt's answer to a streaming client.
pub(super) struct StreamOne {
    pub(super) relayed: Relayed,
    pub(super) stats: SubStats,
    /// This prompt's usage (the engine's, or estimated).
    pub(super) usage: Value,
    /// The engine's usage-only chunk (its JSON), when it sent one.
    pub(super) engine_chunk: Option<Bytes>,
    /// `id`, `created`, `model` of the first chunk sent.
    pub(super) head: Option<Head>,
}

pub(super) async fn stream_one(
    parts: &Parts,
    s: Started,
    mut sink: Stream,
    deadline: Instant,
    first_at: Instant,
    a: &Answering,
    estimate: u64,
) -> StreamOne {
    let (out, served, guards) = split(s);
    // A streaming client's whole answer is cut into chunks from its value.
    let one = match out.into_whole() {
        Ok(mut answer) => {
            let prompt_tokens = engine_prompt_tokens(answer.get("usage"));
            let cached_tokens = engine_cached_tokens(answer.get("usage"));
            let tokens = finish_whole(&mut answer, a, estimate);
            served.track.tokens(tokens);
            let relayed = if sink.deliver_whole(&answer, a.chat, deadline).await {
                Relayed::Done
            } else {
                Relayed::ClientGone
            };
            if matches!(relayed, Relayed::Done) && served.decode_ok {
                parts.fleet.observe(served.served_by, Observation::DecodeOk);
            }
            StreamOne {
                relayed,
                stats: SubStats {
                    tokens,
                    tpot: None,
                    prompt_tokens,
                    cached_tokens,
                },
                usage: answer["usage"].take(),
                engine_chunk: None,
                head: sink.head.take(),
            }
        }
        Err(mut live) => {
            let (relayed, clock) = relay(
                parts, &mut live, &served, &mut sink, deadline, first_at, true,
            )
            .await;
            let engine_chunk = live.take_usage_chunk();
            let engine_usage = live.engine_usage(engine_chunk.as_deref());
            // Only a client that asked for usage gets one (the engine's, or the router's).
            let usage = if a.include_usage {
                usage_value(engine_usage.as_ref(), estimate, live.tokens())
            } else {
                Value::Null
            };
            StreamOne {
                relayed,
                stats: SubStats {
                    tokens: live.output_tokens(),
                    tpot: clock.tpot(),
                    prompt_tokens: engine_prompt_tokens(engine_usage.as_ref()),
                    cached_tokens: engine_cached_tokens(engine_usage.as_ref()),
                },
                usage,
                engine_chunk,
                head: sink.head.take().or_else(|| live.head().cloned()),
            }
        }
    };
    if matches!(one.relayed, Relayed::Done) {
        served.track.completed();
    }
    let decode_s = (parts.clock.now() - served.decode_at).as_secs_f64();
    parts.accounting.decode_finished(decode_s, one.stats.tokens);
    drop(guards);
    one
}

/// How a streaming answer ended.
pub(super) struct StreamEnd {
    pub(super) relayed: Relayed,
    /// The usage chunk's frame to send before `[DONE]` (only when the client asked for
    /// usage).
    pub(super) usage_chunk: Option<Bytes>,
    pub(super) stats: Vec<SubStats>,
}

/// The frame of a usage-only chunk the router writes (an engine that sent none, or a
/// fanned-out batch): the first chunk's `id`, `created` and `model` as the engine wrote them.
pub(super) fn usage_chunk(head: Option<Head>, usage: &Value, chat: bool) -> Bytes {
    let head = head.unwrap_or(Head {
        id: "null".into(),
        created: "null".into(),
        model: "null".into(),
    });
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    Bytes::from(format!(
        "data: {{\"id\":{},\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[],\"usage\":{usage}}}\n\n",
        head.id, head.created, head.model
    ))
}

/// The usage chunk of a fanned-out batch stream: the first prompt's engine chunk as the engine
/// wrote it (its `id`, `created`, `model`, `system_fingerprint`, ...) with `usage` replaced by
/// the batch's sum, so the chunk is what one engine serving the whole batch would send. `None`
/// when the chunk is not a JSON object.
pub(super) fn summed_engine_chunk(chunk: &[u8], usage: &Value) -> Option<Bytes> {
    let mut v: Value = serde_json::from_slice(chunk).ok()?;
    v.as_object_mut()?.insert("usage".into(), usage.clone());
    Some(engine_frame(v.to_string().as_bytes()))
}

/// The SSE frame of an engine's own chunk (its JSON as it wrote it).
pub(super) fn engine_frame(chunk: &[u8]) -> Bytes {
    let mut f = Vec::with_capacity(chunk.len() + 8);
    f.extend_from_slice(b"data: ");
    f.extend_from_slice(chunk);
    f.extend_from_slice(b"\n\n");
    Bytes::from(f)
}

/// Streams every prompt's answer to the client (one prompt: its own stream; a batch: the
/// prompts' streams interleaved, choice `k` for prompt `k`, the first failure ending all).
pub(super) async fn stream_all(
    parts: &Parts,
    started: Vec<Started>,
    tx: &mpsc::Sender<Bytes>,
    deadline: Instant,
    first_at: Instant,
    a: &Answering,
) -> StreamEnd {
    if started.len() == 1 {
        let s = started.into_iter().next().expect("one started answer");
        let one = stream_one(
            parts,
            s,
            Stream::new(tx, None),
            deadline,
            first_at,
            a,
            a.estimates[0],
        )
        .await;
        let usage_chunk = (matches!(one.relayed, Relayed::Done) && a.include_usage).then(|| {
            match one.engine_chunk {
                Some(chunk) => engine_frame(&chunk),
                None => usage_chunk(one.head, &one.usage, a.chat),
            }
        });
        return StreamEnd {
            relayed: one.relayed,
            usage_chunk,
            stats: vec![one.stats],
        };
    }
    let n = started.len();
    let mut running: FuturesUnordered<_> = started
        .into_iter()
        .enumerate()
        .map(|(k, s)| {
            let sink = Stream::new(tx, Some(k as u64 * a.choices));
            async move {
                let one = stream_one(parts, s, sink, deadline, first_at, a, a.estimates[k]).await;
                (k, one)
            }
        })
        .collect();
    let mut done: Vec<Option<StreamOne>> = (0..n).map(|_| None).collect();
    while let Some((k, one)) = running.next().await {
        if !matches!(one.relayed, Relayed::Done) {
            // Dropping the others closes their decode legs.
            drop(running);
            let mut stats: Vec<SubStats> = done.iter().flatten().map(|o| o.stats).collect();
            stats.push(one.stats);
            return StreamEnd {
                relayed: one.relayed,
                usage_chunk: None,
                stats,
            };
        }
        done[k] = Some(one);
    }
    let done: Vec<StreamOne> = done.into_iter().flatten().collect();
    let usage_chunk = a.include_usage.then(|| {
        let usage = sum_usages(done.iter().map(|o| &o.usage));
        done[0]
            .engine_chunk
            .as_deref()
            .and_then(|c| summed_engine_chunk(c, &usage))
            .unwrap_or_else(|| usage_chunk(done[0].head.clone(), &usage, a.chat))
    });
    StreamEnd {
        relayed: Relayed::Done,
        usage_chunk,
        stats: done.iter().map(|o| o.stats).collect(),
    }
}

/// A non-streaming client's answer: a value the router built or cleaned, or an engine's
/// answer cleaned at byte level ([`Output::Clean`]), sent as it is.
pub(super) enum Answer {
    Value(Value),
    Clean(CleanAnswer),
}

impl Answer {
    fn into_value(self) -> Value {
        match self {
            Answer::Value(v) => v,
            Answer::Clean(c) => c.into_value(),
        }
    }
}

/// How a non-streaming answer ended.
pub(super) struct CollectEnd {
    pub(super) answer: Result<Answer, RequestFailure>,
    pub(super) stats: Vec<SubStats>,
}

pub(super) async fn collect_one(
    parts: &Parts,
    s: Started,
    deadline: Instant,
    first_at: Instant,
    a: &Answering,
    estimate: u64,
) -> (Result<Answer, RequestFailure>, SubStats) {
    let (out, served, guards) = split(s);
    let (answer, stats) = match out {
        Output::Clean(clean) => {
            let f = clean.facts;
            served.track.tokens(f.completion_tokens);
            if served.decode_ok {
                parts.fleet.observe(served.served_by, Observation::DecodeOk);
            }
            let stats = SubStats {
                tokens: f.completion_tokens,
                tpot: None,
                prompt_tokens: Some(f.prompt_tokens),
                cached_tokens: f.cached_tokens,
            };
            (Ok(Answer::Clean(clean)), stats)
        }
        Output::Whole(mut answer) => {
            let prompt_tokens = engine_prompt_tokens(answer.get("usage"));
            let cached_tokens = engine_cached_tokens(answer.get("usage"));
            let tokens = finish_whole(&mut answer, a, estimate);
            served.track.tokens(tokens);
            if served.decode_ok {
                parts.fleet.observe(served.served_by, Observation::DecodeOk);
            }
            let stats = SubStats {
                tokens,
                tpot: None,
                prompt_tokens,
                cached_tokens,
            };
            (Ok(Answer::Value(answer)), stats)
        }
        Output::Live(mut live) => {
            let (relayed, clock) = relay(
                parts,
                &mut live,
                &served,
                &mut Collect,
                deadline,
                first_at,
                false,
            )
            .await;
            let mut stats = SubStats {
                tokens: live.output_tokens(),
                tpot: clock.tpot(),
                prompt_tokens: None,
                cached_tokens: None,
            };
            let answer = match relayed {
                Relayed::Done => {
                    let engine_chunk = live.take_usage_chunk();
                    let engine_usage = live.engine_usage(engine_chunk.as_deref());
                    stats.prompt_tokens = engine_prompt_tokens(engine_usage.as_ref());
                    stats.cached_tokens = engine_cached_tokens(engine_usage.as_ref());
                    let usage = usage_value(engine_usage.as_ref(), estimate, live.tokens());
                    let agg = live
                        .take_aggregator()
                        .expect("a non-streaming client's decode legs aggregate (relay_options)");
                    Ok(Answer::Value(agg.finish(usage)))
                }
                Relayed::Failed(failure) => Err(failure),
                // An `Aggregator` takes every chunk and never reports its client gone (hyper
                // drops this future instead, and `pending` settles on drop).
                Relayed::ClientGone => unreachable!("a non-streaming relay has no client to lose"),
            };
            (answer, stats)
        }
    };
    if answer.is_ok() {
        served.track.completed();
    }
    let decode_s = (parts.clock.now() - served.decode_at).as_secs_f64();
    parts.accounting.decode_finished(decode_s, stats.tokens);
    drop(guards);
    (answer, stats)
}

/// Collects every prompt's answer into one response object (a batch: choice `k` for prompt
/// `k`, usage summed; the first failure ends all).
pub(super) async fn collect_all(
    parts: &Parts,
    started: Vec<Started>,
    deadline: Instant,
    first_at: Instant,
    a: &Answering,
) -> CollectEnd {
    if started.len() == 1 {
        let s = started.into_iter().next().expect("one started answer");
        let (answer, stats) = collect_one(parts, s, deadline, first_at, a, a.estimates[0]).await;
        return CollectEnd {
            answer,
            stats: vec![stats],
        };
    }
    let n = started.len();
    let mut running: FuturesUnordered<_> = started
        .into_iter()
        .enumerate()
        .map(|(k, s)| async move {
            let r = collect_one(parts, s, deadline, first_at, a, a.estimates[k]).await;
            (k, r)
        })
        .collect();
    let mut answers: Vec<Option<Value>> = (0..n).map(|_| None).collect();
    let mut stats = Vec::with_capacity(n);
    while let Some((k, (answer, st))) = running.next().await {
        stats.push(st);
        match answer {
            Ok(v) => answers[k] = Some(v.into_value()),
            Err(failure) => {
                return CollectEnd {
                    answer: Err(failure),
                    stats,
                };
            }
        }
    }
    let answers: Vec<Value> = answers.into_iter().flatten().collect();
    CollectEnd {
        answer: Ok(Answer::Value(merge_answers(answers, a.choices))),
        stats,
    }
}

/// One response object for a fanned-out batch: the first answer's `id`, `object`, `created`
/// and `model`, every answer's choices with prompt `k`'s choice `i` as index `k × width + i`
/// (vLLM's numbering; `width` = the client's `n`), the usages summed.
pub(super) fn merge_answers(answers: Vec<Value>, width: u64) -> Value {
    let usage = sum_usages(answers.iter().filter_map(|a| a.get("usage")));
    let mut merged: Option<Value> = None;
    let mut choices = Vec::new();
    for (k, mut a) in answers.into_iter().enumerate() {
        reindex(&mut a, k as u64 * width);
        if let Some(Value::Array(c)) = a.get_mut("choices").map(Value::take) {
            choices.extend(c);
        }
        merged.get_or_insert(a);
    }
    let mut merged = merged.unwrap_or_else(|| json!({}));
    merged["choices"] = Value::Array(choices);
    merged["usage"] = usage;
    merged
}
