//! Streaming relay, sans-IO (behaviour.md 7.3; architecture.md section 5), byte level
//! (docs/benchmarks.md).
//!
//! ```text
//!  upstream body bytes ──SseParser::feed──► data payloads ──StreamState::on_data──► RelayStep
//!      (any fragmentation, \n \r\n \r)        (comments dropped)   Hold | Output | Done | Failed
//!  streaming client:      StreamState::take_output ──► "data: <the engine's JSON>\n\n" ...
//!  non-streaming client:  the same scan feeds an Aggregator (RelayOptions::aggregate)
//!                         StreamState::take_aggregator ──► one text_completion / chat.completion
//! ```
//!
//! Each frame is scanned once (module `rawjson`) for the few members the router needs
//! (token evidence, `finish_reason`, `usage`, an `error`), and the engine's bytes are
//! forwarded untouched but for the members the client did not ask for (`token_ids`,
//! `prompt_token_ids`) and, for prompt `k` of a fanned-out batch, the choice indexes; no
//! `serde_json::Value` is built per frame. For a non-streaming client the same scan notes where
//! the members its answer merges lie (text, deltas, finish and stop reasons, logprobs, tool
//! calls, kept token ids), and the [`Aggregator`] merges them from the engine's bytes: no SSE is
//! written and scanned again. The answer is the one [`Aggregator::push_frames`] builds from the
//! frames a streaming relay would write (a proptest and the relay fuzz target hold them equal).
//!
//! Nothing is sent to the client before the first token-bearing chunk: earlier data chunks are
//! held (at most [`MAX_HELD_FRAMES`] and `max_response_bytes`), so a failure before output can
//! still be answered with an HTTP status and retried. Tokens are counted from the engine's
//! `usage`, else `token_ids` lengths, else one per content-bearing chunk (any
//! OpenAI-compatible engine: llama.cpp, TGI, SGLang chat send no ids); see [`StreamState`].
//! Usage-only chunks are held back for the serving layer, which forwards the engine's, merges
//! a fanned-out batch's or estimates one ([`usage_value`], [`sum_usages`]).

mod aggregate;
mod answer;
mod frames;
mod rawjson;
mod sse;
mod stream;
#[cfg(test)]
mod tests;

pub use aggregate::{Aggregator, assemble_sse};
pub use answer::{AnswerFacts, clean_answer, descriptor_span};
pub use frames::{
    answer_chunks, data_frame, done_frame, error_frame, reindex, sanitize_answer, sum_usages,
    usage_value,
};
pub use sse::{DEFAULT_MAX_EVENT_BYTES, SseData, SseParser};
pub use stream::{
    EngineUsage, Head, MAX_HELD_FRAMES, RelayOptions, RelayStep, StreamFailure, StreamState,
    chunk_usage, upstream_error,
};
