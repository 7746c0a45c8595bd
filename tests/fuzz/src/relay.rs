//! An engine's SSE body through the router's byte-level relay (`narwhal_relay`): the SSE
//! parser, `StreamState` (whose frames the byte-level `rawjson` scanner reads), the
//! `Aggregator` and `assemble_sse`, checked against `serde_json`.
//!
//! Input layout: `[options (1 byte)][cut (1 byte)][the engine's body]`. Option bits: 0 the
//! client asked for `return_token_ids`, 1 a 512-byte `max_response_bytes` (else 1 MiB), 2 a
//! non-streaming client (`collect`), 3 prompt 3 of a fanned-out batch (`index_base`), 4
//! `capture_head`, 5 a chat route (for the aggregator). The body is fed to the SSE parser in
//! two pieces, cut at `cut × len / 256`. A second relay with the same options builds the
//! answer in its own scan (`RelayOptions::aggregate`): it must take the same steps and build
//! the answer the `Aggregator` builds from the first one's frames.

use std::collections::VecDeque;

use narwhal_relay::{
    Aggregator, RelayOptions, RelayStep, SseParser, StreamFailure, StreamState, assemble_sse,
    usage_value,
};
use serde_json::Value;

/// The batch prompt index option bit 3 stands for.
const BASE: u64 = 3;

/// Checks one input (layout in the module doc).
///
/// # Panics
/// When the relay and `serde_json` disagree: the scanner refuses a frame `serde_json` reads
/// as JSON, or accepts one it does not; a relayed frame is not JSON, or is not one of the
/// engine's frames (in order) minus the members the options strip; the engine's
/// `usage.prompt_tokens` is not what the relay reports; the SSE parser gives other events
/// when the same bytes arrive cut in two.
pub fn check(data: &[u8]) {
    let [flags, cut, body @ ..] = data else {
        return;
    };
    let opts = RelayOptions {
        return_token_ids: flags & 1 != 0,
        max_response_bytes: if flags & 2 != 0 { 512 } else { 1 << 20 },
        collect: flags & 4 != 0,
        index_base: (flags & 8 != 0).then_some(BASE),
        capture_head: flags & 16 != 0,
        aggregate: None,
    };
    let chat = flags & 32 != 0;

    // The SSE parser: whole, and cut in two.
    let payloads = sse_events(body, &[body.len()]);
    let at = usize::from(*cut) * body.len() / 256;
    assert_eq!(
        sse_events(body, &[at, body.len()]),
        payloads,
        "SSE events depend on where the bytes are cut (at {at})"
    );

    let mut state = StreamState::new(opts);
    let mut agg = Aggregator::new(chat);
    let mut scanned = StreamState::new(RelayOptions {
        aggregate: Some(chat),
        ..opts
    });
    // The engine's frames that may be relayed, as the client should see them, in order.
    let mut expected: VecDeque<Value> = VecDeque::new();
    for payload in &payloads {
        let text = String::from_utf8_lossy(payload);
        let sj = serde_json::from_str::<Value>(&text);
        let step = state.on_data(payload);
        assert_eq!(
            scanned.on_data(payload),
            step,
            "the aggregating relay took another step on {text:?}"
        );
        if text.trim_ascii() == "[DONE]" {
            if matches!(step, RelayStep::Done) {
                break;
            }
            assert!(
                matches!(step, RelayStep::Failed(StreamFailure::DoneBeforeToken)),
                "[DONE] gave {step:?}"
            );
            return;
        }
        let scanner_refused = matches!(
            &step,
            RelayStep::Failed(StreamFailure::InvalidFrame(m)) if m.starts_with("data frame is not JSON")
        );
        assert_eq!(
            scanner_refused,
            sj.is_err(),
            "scanner and serde_json disagree on {text:?}: relay {step:?}, serde_json {sj:?}"
        );
        if let Ok(v) = &sj {
            if !v.is_object() {
                assert!(
                    matches!(step, RelayStep::Failed(StreamFailure::InvalidFrame(_))),
                    "a frame that is not an object gave {step:?}"
                );
                return;
            }
            expected.push_back(client_view(v.clone(), opts));
            if let Some(p) = v
                .get("usage")
                .filter(|u| u.is_object())
                .and_then(|u| u.get("prompt_tokens"))
                .and_then(Value::as_u64)
                && !matches!(step, RelayStep::Failed(_))
            {
                assert_eq!(state.prompt_tokens(), Some(p), "usage.prompt_tokens");
            }
        }
        let out = state.take_output();
        check_output(&out, &mut expected);
        agg.push_frames(&out);
        if let RelayStep::Failed(_) = step {
            return;
        }
    }
    if let Some(head) = state.head() {
        for raw in [&head.id, &head.created, &head.model] {
            assert!(
                serde_json::from_str::<Value>(raw).is_ok(),
                "head member {raw:?} is not JSON"
            );
        }
    }
    let usage = usage_value(
        state.engine_usage_value().as_ref(),
        1,
        state.output_tokens(),
    );
    let whole = agg.finish(usage.clone());
    assert!(serde_json::to_vec(&whole).is_ok());
    if state.started() {
        let built = scanned.take_aggregator().expect("an aggregating relay");
        assert_eq!(
            built.finish(usage),
            whole,
            "the answer built in the scan is not the relayed frames' answer"
        );
    }
    let _ = assemble_sse(body, chat);
}

/// The data payloads an SSE parser gives for `body` fed in pieces ending at `ends`.
fn sse_events(body: &[u8], ends: &[usize]) -> Vec<Vec<u8>> {
    let mut parser = SseParser::with_limit(1 << 20);
    let mut out = Vec::new();
    let mut from = 0;
    for &end in ends {
        let mut piece = &body[from..end];
        while !piece.is_empty() {
            let used = parser.feed(piece, |d| {
                out.push(d.to_vec());
                true
            });
            piece = &piece[used..];
        }
        from = end;
    }
    out
}

/// A relayed frame must parse, and be the next of the engine's frames that the relay may
/// forward (some are held back or dropped: usage-only chunks, frames without choices).
fn check_output(out: &[u8], expected: &mut VecDeque<Value>) {
    let text = std::str::from_utf8(out).expect("relayed bytes are UTF-8");
    for frame in text.split_terminator("\n\n") {
        let json = frame
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("a relayed frame without `data: `: {frame:?}"));
        assert!(
            !json.contains('\n'),
            "a relayed frame spans lines: {json:?}"
        );
        let v: Value = serde_json::from_str(json)
            .unwrap_or_else(|e| panic!("a relayed frame is not JSON ({e}): {json:?}"));
        loop {
            let next = expected
                .pop_front()
                .unwrap_or_else(|| panic!("a relayed frame the engine never sent: {json}"));
            if next == v {
                break;
            }
        }
    }
}

/// An engine frame as the client must see it: `prompt_token_ids` and each choice's
/// `token_ids`/`prompt_token_ids` gone unless the client asked for ids; for a batch prompt,
/// `usage` gone and each choice's `index` shifted by the prompt's (or set to it).
fn client_view(mut v: Value, opts: RelayOptions) -> Value {
    let strip = !opts.return_token_ids;
    let Some(m) = v.as_object_mut() else {
        return v;
    };
    if strip {
        m.remove("prompt_token_ids");
    }
    if opts.index_base.is_some() {
        m.remove("usage");
    }
    if let Some(Value::Array(choices)) = m.get_mut("choices") {
        for c in choices.iter_mut().filter_map(Value::as_object_mut) {
            if strip {
                c.remove("token_ids");
                c.remove("prompt_token_ids");
            }
            if let Some(base) = opts.index_base {
                let i = c.get("index").and_then(Value::as_u64).unwrap_or(0);
                c.insert("index".into(), base.saturating_add(i).into());
            }
        }
    }
    v
}
