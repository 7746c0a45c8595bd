//! A whole answer cleaned for the client at byte level: what [`crate::sanitize_answer`] and
//! [`crate::usage_value`] do to its value, done with one scan of the engine's bytes when the
//! answer carries its own complete usage, so a non-streaming client's answer is not parsed into
//! a `serde_json::Value` and written again (docs/benchmarks.md).
//!
//! ```text
//!  engine bytes ──clean_answer──► Some((bytes minus kv_transfer_params and unrequested
//!                                       token ids, AnswerFacts))      one scan, one copy
//!                └───────────────► None: parse the value (the rules of the value path apply:
//!                                  an error member, no choices array, a usage to complete,
//!                                  an escaped key, invalid JSON)
//! ```
//!
//! Pure: no IO.

use crate::rawjson::{Cursor, Keep, ScanError, apply};

/// What [`clean_answer`] read of the engine's `usage` (every count the request's record takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerFacts {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`: the generated tokens.
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` (vLLM with `--enable-prompt-tokens-details`),
    /// when it is an unsigned integer.
    pub cached_tokens: Option<u64>,
}

/// The top-level members the scan acts on; one given twice sends the answer to the value
/// path (a `Value` keeps the last of duplicates).
const WATCHED: [&[u8]; 5] = [
    b"error",
    b"choices",
    b"usage",
    b"kv_transfer_params",
    b"prompt_token_ids",
];

/// Walks an answer's top-level members as both scans here read them: a key written with an
/// escape, a `watched` member given twice or a non-null `error` marks the answer `odd` (the
/// value path answers it); `f` reads every other member (it must consume the value, and may
/// mark the answer odd too). Returns the object's span.
fn top_members<'a>(
    c: &mut Cursor<'a>,
    watched: &[&[u8]],
    odd: &mut bool,
    mut f: impl FnMut(&mut Cursor<'a>, &[u8], &mut bool) -> Result<Keep, ScanError>,
) -> Result<std::ops::Range<usize>, ScanError> {
    let mut seen = 0u64;
    c.object(|c, m| {
        if m.escaped {
            *odd = true;
            c.value()?;
            return Ok(Keep::Yes);
        }
        let key = &c.bytes()[m.key.clone()];
        if let Some(i) = watched.iter().position(|w| *w == key) {
            *odd |= seen & (1 << i) != 0;
            seen |= 1 << i;
        }
        if key == b"error" {
            if !c.null()? {
                *odd = true;
                c.value()?;
            }
            return Ok(Keep::Yes);
        }
        f(c, key, odd)
    })
}

/// The engine's whole answer `bytes`, cleaned as [`crate::sanitize_answer`] cleans its value
/// (`kv_transfer_params` removed at the top and from every choice; `prompt_token_ids` at the
/// top and `token_ids` and `prompt_token_ids` of every choice removed unless
/// `return_token_ids`), with everything else as the engine wrote it, and its usage counts.
///
/// `None` when the answer needs the value path: not UTF-8, not a JSON object, a key written
/// with an escape, a watched member given twice, a non-null `error`, `choices` not an array, or a
/// `usage` without unsigned `prompt_tokens`, `completion_tokens` and `total_tokens` (the value
/// path estimates or completes it). The bytes returned parse to the value the value path
/// builds (a proptest holds the two together).
pub fn clean_answer(bytes: &[u8], return_token_ids: bool) -> Option<(Vec<u8>, AnswerFacts)> {
    std::str::from_utf8(bytes).ok()?;
    let strip = !return_token_ids;
    let mut c = Cursor::new(bytes, Vec::new());
    if c.peek() != Some(b'{') {
        return None;
    }
    let start = c.pos();
    let mut usage: Option<AnswerFacts> = None;
    let mut choices = false;
    let mut odd = false;
    let walked = top_members(&mut c, &WATCHED, &mut odd, |c, key, odd| {
        match key {
            b"kv_transfer_params" => {
                c.value()?;
                return Ok(Keep::Drop);
            }
            b"prompt_token_ids" => {
                c.value()?;
                if strip {
                    return Ok(Keep::Drop);
                }
            }
            b"choices" => {
                if c.peek() != Some(b'[') {
                    *odd = true;
                    c.value()?;
                    return Ok(Keep::Yes);
                }
                choices = true;
                c.array(|c, _| {
                    if c.peek() != Some(b'{') {
                        c.value()?;
                        return Ok(());
                    }
                    c.object(|c, m| {
                        if m.escaped {
                            *odd = true;
                        }
                        let key = &c.bytes()[m.key.clone()];
                        c.value()?;
                        Ok(match key {
                            b"kv_transfer_params" => Keep::Drop,
                            b"token_ids" | b"prompt_token_ids" if strip => Keep::Drop,
                            _ => Keep::Yes,
                        })
                    })?;
                    Ok(())
                })?;
            }
            b"usage" => {
                usage = None;
                if c.peek() != Some(b'{') {
                    c.value()?;
                    return Ok(Keep::Yes);
                }
                let (mut p, mut n, mut t, mut cached) = (None, None, None, None);
                let mut seen_usage = [false; 4];
                c.object(|c, m| {
                    if m.escaped {
                        *odd = true;
                    }
                    let key = &c.bytes()[m.key.clone()];
                    let slot = match key {
                        b"prompt_tokens" => 0,
                        b"completion_tokens" => 1,
                        b"total_tokens" => 2,
                        b"prompt_tokens_details" => 3,
                        _ => {
                            c.value()?;
                            return Ok(Keep::Yes);
                        }
                    };
                    if seen_usage[slot] {
                        *odd = true;
                    }
                    seen_usage[slot] = true;
                    match slot {
                        0 => p = c.uint()?.1,
                        1 => n = c.uint()?.1,
                        2 => t = c.uint()?.1,
                        _ => {
                            cached = None;
                            if c.peek() == Some(b'{') {
                                c.object(|c, m| {
                                    if m.escaped {
                                        *odd = true;
                                    }
                                    if &c.bytes()[m.key.clone()] == b"cached_tokens" {
                                        cached = c.uint()?.1;
                                    } else {
                                        c.value()?;
                                    }
                                    Ok(Keep::Yes)
                                })?;
                            } else {
                                c.value()?;
                            }
                        }
                    }
                    Ok(Keep::Yes)
                })?;
                if let (Some(p), Some(n), Some(_)) = (p, n, t) {
                    usage = Some(AnswerFacts {
                        prompt_tokens: p,
                        completion_tokens: n,
                        cached_tokens: cached,
                    });
                }
            }
            _ => {
                c.value()?;
            }
        }
        Ok(Keep::Yes)
    });
    let end = c.pos();
    if walked.is_err() || c.end().is_err() || odd || !choices {
        return None;
    }
    let facts = usage?;
    let mut out = Vec::with_capacity(end - start);
    apply(bytes, start..end, &c.edits, &mut out);
    Some((out, facts))
}

/// Where a vLLM prefill answer's KV descriptor is in `bytes`: `choices[0].kv_transfer_params`
/// when it is not null, else the top-level `kv_transfer_params` when it is not null, as
/// `Value::pointer` finds them (vLLM's NIXL connector answers with one of the two), so the
/// descriptor alone is parsed and carried, not the whole answer.
///
/// `None` when the answer needs the value path: not UTF-8, not a JSON object, a key written
/// with an escape, `error`, `choices` or `kv_transfer_params` given twice (at the top or in the
/// first choice), a non-null `error`, `choices` not an array, no descriptor, or a descriptor
/// that is not an object (the value path then answers, finishes or fails the prefill as
/// before).
pub fn descriptor_span(bytes: &[u8]) -> Option<std::ops::Range<usize>> {
    std::str::from_utf8(bytes).ok()?;
    let mut c = Cursor::new(bytes, Vec::new());
    if c.peek() != Some(b'{') {
        return None;
    }
    let mut top: Option<std::ops::Range<usize>> = None;
    let mut first: Option<std::ops::Range<usize>> = None;
    let mut choices = false;
    let mut odd = false;
    let walked = top_members(
        &mut c,
        &[b"error", b"choices", b"kv_transfer_params"],
        &mut odd,
        |c, key, odd| {
            match key {
                b"kv_transfer_params" => {
                    top = if c.null()? { None } else { Some(c.value()?) };
                }
                b"choices" => {
                    if c.peek() != Some(b'[') {
                        *odd = true;
                        c.value()?;
                        return Ok(Keep::Yes);
                    }
                    choices = true;
                    c.array(|c, i| {
                        if i > 0 || c.peek() != Some(b'{') {
                            c.value()?;
                            return Ok(());
                        }
                        let mut twice = false;
                        c.object(|c, m| {
                            if m.escaped {
                                *odd = true;
                            }
                            if &c.bytes()[m.key.clone()] == b"kv_transfer_params" {
                                *odd |= twice;
                                twice = true;
                                first = if c.null()? { None } else { Some(c.value()?) };
                            } else {
                                c.value()?;
                            }
                            Ok(Keep::Yes)
                        })?;
                        Ok(())
                    })?;
                }
                _ => {
                    c.value()?;
                }
            }
            Ok(Keep::Yes)
        },
    );
    if walked.is_err() || c.end().is_err() || odd || !choices {
        return None;
    }
    first.or(top).filter(|r| bytes[r.start] == b'{')
}
