//! Byte-level JSON scanning for the request path (docs/benchmarks.md): find the few members the
//! router reads or changes in a request body, an SSE frame or an engine answer, and pass every
//! other byte through untouched, without building a `serde_json::Value` tree.
//!
//! ```text
//!  bytes ──Cursor::object(|cursor, member| ...)──► member spans (key, value), in order
//!        └─ the callback reads a value (uint, string, nested object/array) or skips it,
//!           and may drop the member: the cursor records an Edit that removes it, comma
//!           included, so the edited text stays valid JSON
//!  bytes + edits ──apply──► the engine's (or client's) bytes, minus dropped members, with
//!                           replaced values
//! ```
//!
//! The scanner validates what it passes over as `serde_json` does (RFC 8259: structure,
//! string escapes and surrogate pairs, control characters, number grammar, nesting up to
//! [`MAX_DEPTH`]); the input must already be UTF-8 (callers check it once). Pure: no IO.

use std::ops::Range;

use bytes::BufMut;

/// Deepest nesting accepted (serde_json's recursion limit).
pub(crate) const MAX_DEPTH: usize = 128;

/// Why a text is not JSON: what was wrong and at which byte offset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} at byte {at}")]
pub(crate) struct ScanError {
    /// Byte offset of the problem.
    pub(crate) at: usize,
    /// What was expected or wrong.
    pub(crate) what: &'static str,
}

/// What a callback of [`Cursor::object`] does with the member it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// The member stays.
    Yes,
    /// The member is removed (with its comma) when the edits are applied.
    Drop,
}

/// A change to the scanned text, applied by [`apply`]. Edits are kept in text order and
/// never overlap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Edit {
    /// The bytes replaced (empty for an insertion).
    pub(crate) range: Range<usize>,
    /// What is written instead.
    pub(crate) with: Repl,
}

/// The replacement text of an [`Edit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Repl {
    /// Nothing: a deletion.
    Nothing,
    /// An unsigned integer.
    Uint(u64),
    /// A member `"<key>":<n>`, followed by a comma when `comma` (an insertion at the start of
    /// an object that keeps other members).
    Member {
        /// The key, written as is (plain ASCII, no escapes needed).
        key: &'static str,
        /// The value.
        n: u64,
        /// A comma follows.
        comma: bool,
    },
}

/// One object member as the cursor meets it.
#[derive(Debug, Clone)]
pub(crate) struct Member {
    /// The key's raw text between its quotes (escapes not decoded).
    pub(crate) key: Range<usize>,
    /// The raw key contains a backslash escape.
    pub(crate) escaped: bool,
}

/// A position in a JSON text, with the edits recorded so far.
#[derive(Debug)]
pub(crate) struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    depth: usize,
    /// Edits recorded by [`Cursor::object`] (dropped members) and by callers
    /// ([`Cursor::edit`]), in text order.
    pub(crate) edits: Vec<Edit>,
}

/// Bytes that end a run of plain string content: the closing quote, a backslash, and the
/// control characters a JSON string may not hold.
static STRING_SPECIAL: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 0x20 {
        t[c] = true;
        c += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// Whether `b` is JSON whitespace.
fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `b`, recording into `edits` (cleared; pass a reused buffer to
    /// avoid an allocation per text).
    pub(crate) fn new(b: &'a [u8], mut edits: Vec<Edit>) -> Self {
        edits.clear();
        Cursor {
            b,
            pos: 0,
            depth: 0,
            edits,
        }
    }

    /// The text scanned.
    pub(crate) fn bytes(&self) -> &'a [u8] {
        self.b
    }

    /// The current offset.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    fn err(&self, what: &'static str) -> ScanError {
        ScanError { at: self.pos, what }
    }

    /// Skips whitespace.
    pub(crate) fn ws(&mut self) {
        while self.pos < self.b.len() && is_ws(self.b[self.pos]) {
            self.pos += 1;
        }
    }

    /// The next byte after whitespace, not consumed.
    pub(crate) fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.pos).copied()
    }

    /// Records an edit (a caller's replacement of a value it read). Must come after every
    /// edit recorded so far in text order.
    pub(crate) fn edit(&mut self, range: Range<usize>, with: Repl) {
        debug_assert!(self.edits.last().is_none_or(|e| e.range.end <= range.start));
        self.edits.push(Edit { range, with });
    }

    /// Fails unless only whitespace remains.
    ///
    /// # Errors
    /// [`ScanError`] "trailing characters".
    pub(crate) fn end(&mut self) -> Result<(), ScanError> {
        self.ws();
        if self.pos == self.b.len() {
            Ok(())
        } else {
            Err(self.err("trailing characters"))
        }
    }

    /// Skips (and validates) one value; returns its span.
    ///
    /// # Errors
    /// [`ScanError`] when the text is not a JSON value there.
    pub(crate) fn value(&mut self) -> Result<Range<usize>, ScanError> {
        match self.peek() {
            Some(b'{') => self.object(|c, _| c.value().map(|_| Keep::Yes)),
            Some(b'[') => self.array(|c, _| c.value().map(|_| ())),
            Some(b'"') => self.string().map(|r| r.start - 1..r.end + 1),
            Some(b'-' | b'0'..=b'9') => self.number().map(|(r, _)| r),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(_) => Err(self.err("expected a value")),
            None => Err(self.err("EOF while parsing a value")),
        }
    }

    /// Reads a value that is a non-negative integer fitting `u64` (what
    /// `serde_json::Value::as_u64` accepts), else skips it and gives `None`.
    ///
    /// # Errors
    /// [`ScanError`] when the text is not a JSON value there.
    pub(crate) fn uint(&mut self) -> Result<(Range<usize>, Option<u64>), ScanError> {
        match self.peek() {
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => self.value().map(|r| (r, None)),
        }
    }

    /// Whether the value at the cursor is `null` (consumed) or not (not consumed).
    ///
    /// # Errors
    /// [`ScanError`] for a broken `null`.
    pub(crate) fn null(&mut self) -> Result<bool, ScanError> {
        if self.peek() == Some(b'n') {
            self.literal(b"null")?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Skips one value and tells whether it carries something: a non-empty string, array or
    /// object (numbers, booleans and `null` do not).
    ///
    /// # Errors
    /// [`ScanError`] when the text is not a JSON value there.
    pub(crate) fn nonempty(&mut self) -> Result<bool, ScanError> {
        let first = self.peek();
        let r = self.value()?;
        Ok(match first {
            Some(b'"') => r.len() > 2,
            Some(b'[' | b'{') => {
                let inner = &self.b[r.start + 1..r.end - 1];
                inner.iter().any(|&c| !is_ws(c))
            }
            _ => false,
        })
    }

    fn literal(&mut self, word: &'static [u8]) -> Result<Range<usize>, ScanError> {
        let start = self.pos;
        if self.b[start..].starts_with(word) {
            self.pos += word.len();
            Ok(start..self.pos)
        } else {
            Err(self.err("expected a literal"))
        }
    }

    /// A number at the cursor: its span and its value when it is a non-negative integer that
    /// fits `u64` (not `-0`, which serde_json reads as a float).
    fn number(&mut self) -> Result<(Range<usize>, Option<u64>), ScanError> {
        let b = self.b;
        let start = self.pos;
        let mut i = start;
        let neg = b.get(i) == Some(&b'-');
        if neg {
            i += 1;
        }
        let int_start = i;
        match b.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
            }
            _ => {
                self.pos = i;
                return Err(self.err("invalid number"));
            }
        }
        let int_end = i;
        let mut integer = true;
        let mut exponent = false;
        if b.get(i) == Some(&b'.') {
            integer = false;
            i += 1;
            let d = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == d {
                self.pos = i;
                return Err(self.err("invalid number"));
            }
        }
        if matches!(b.get(i), Some(b'e' | b'E')) {
            integer = false;
            exponent = true;
            i += 1;
            if matches!(b.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            let d = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == d {
                self.pos = i;
                return Err(self.err("invalid number"));
            }
        }
        // serde_json refuses a number whose f64 value is infinite ("number out of range"),
        // which the grammar allows (`1e400`). Only an exponent or over 308 integer digits can
        // get there, so only those are parsed.
        if (exponent || int_end - int_start > 308)
            && !std::str::from_utf8(&b[start..i])
                .ok()
                .and_then(|t| t.parse::<f64>().ok())
                .is_some_and(f64::is_finite)
        {
            self.pos = start;
            return Err(self.err("number out of range"));
        }
        self.pos = i;
        let value = if !integer || neg {
            None
        } else {
            b[int_start..int_end].iter().try_fold(0u64, |acc, &d| {
                acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
            })
        };
        Ok((start..i, value))
    }

    /// A string at the cursor (after whitespace): the span of its raw content between the
    /// quotes. Validates escapes (surrogates paired) and refuses control characters.
    ///
    /// # Errors
    /// [`ScanError`] when there is no valid string there.
    pub(crate) fn string(&mut self) -> Result<Range<usize>, ScanError> {
        Ok(self.string_escaped()?.0)
    }

    /// [`Cursor::string`] and whether the raw content holds a backslash escape.
    ///
    /// # Errors
    /// [`ScanError`] when there is no valid string there.
    pub(crate) fn string_escaped(&mut self) -> Result<(Range<usize>, bool), ScanError> {
        if self.peek() != Some(b'"') {
            return Err(self.err("expected a string"));
        }
        let b = self.b;
        let start = self.pos + 1;
        let mut i = start;
        let mut escaped = false;
        loop {
            while i < b.len() && !STRING_SPECIAL[usize::from(b[i])] {
                i += 1;
            }
            match b.get(i) {
                Some(b'"') => {
                    self.pos = i + 1;
                    return Ok((start..i, escaped));
                }
                Some(b'\\') => {
                    escaped = true;
                    i = self.escape(i + 1)?;
                }
                Some(_) => {
                    self.pos = i;
                    return Err(self.err("control character in a string"));
                }
                None => {
                    self.pos = i;
                    return Err(self.err("EOF while parsing a string"));
                }
            }
        }
    }

    /// Validates the escape after a backslash at `i`; returns the offset after it.
    fn escape(&mut self, i: usize) -> Result<usize, ScanError> {
        let b = self.b;
        match b.get(i) {
            Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(i + 1),
            Some(b'u') => {
                let hi = self.hex4(i + 1)?;
                match hi {
                    0xD800..=0xDBFF => {
                        if b.get(i + 5) != Some(&b'\\') || b.get(i + 6) != Some(&b'u') {
                            self.pos = i + 5;
                            return Err(self.err("lone leading surrogate in hex escape"));
                        }
                        let lo = self.hex4(i + 7)?;
                        if !(0xDC00..=0xDFFF).contains(&lo) {
                            self.pos = i + 7;
                            return Err(self.err("lone leading surrogate in hex escape"));
                        }
                        Ok(i + 11)
                    }
                    0xDC00..=0xDFFF => {
                        self.pos = i + 1;
                        Err(self.err("unexpected end of hex escape"))
                    }
                    _ => Ok(i + 5),
                }
            }
            _ => {
                self.pos = i;
                Err(self.err("invalid escape"))
            }
        }
    }

    fn hex4(&mut self, i: usize) -> Result<u32, ScanError> {
        let Some(h) = self.b.get(i..i + 4) else {
            self.pos = self.b.len();
            return Err(self.err("EOF while parsing a string"));
        };
        let mut n = 0u32;
        for &c in h {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => {
                    self.pos = i;
                    return Err(self.err("invalid escape"));
                }
            };
            n = n * 16 + u32::from(d);
        }
        Ok(n)
    }

    fn enter(&mut self) -> Result<(), ScanError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.err("recursion limit exceeded"));
        }
        Ok(())
    }

    /// Walks the object at the cursor: `f` is called for each member with the cursor at its
    /// value and must consume exactly that value (read it, walk it, or [`Cursor::value`]);
    /// a member it drops is removed by an [`Edit`] (comma included). Returns the object's
    /// span.
    ///
    /// # Errors
    /// [`ScanError`] when the text is not a JSON object there, or `f`'s error.
    pub(crate) fn object(
        &mut self,
        mut f: impl FnMut(&mut Self, &Member) -> Result<Keep, ScanError>,
    ) -> Result<Range<usize>, ScanError> {
        if self.peek() != Some(b'{') {
            return Err(self.err("expected an object"));
        }
        self.enter()?;
        let open = self.pos;
        self.pos += 1;
        // Removal bookkeeping: a dropped member after a kept one goes with the comma before
        // it; a run of dropped members before the first kept one goes with the comma after.
        let mut kept_before = false;
        let mut prev_end = 0;
        let mut run_start: Option<usize> = None;
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(open..self.pos);
        }
        loop {
            self.ws();
            let start = self.pos;
            let (key, escaped) = self.string_escaped()?;
            if self.peek() != Some(b':') {
                return Err(self.err("expected ':'"));
            }
            self.pos += 1;
            self.ws();
            let member = Member { key, escaped };
            let at = self.edits.len();
            let keep = f(self, &member)?;
            let end = self.pos;
            match keep {
                Keep::Drop => {
                    // Whatever the callback recorded inside a dropped value goes with it.
                    self.edits.truncate(at);
                    if kept_before {
                        self.edits.push(Edit {
                            range: prev_end..end,
                            with: Repl::Nothing,
                        });
                    } else if run_start.is_none() {
                        run_start = Some(start);
                    }
                }
                Keep::Yes => {
                    if let Some(s) = run_start.take() {
                        self.edits.insert(
                            at,
                            Edit {
                                range: s..start,
                                with: Repl::Nothing,
                            },
                        );
                    }
                    kept_before = true;
                }
            }
            prev_end = end;
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => return Err(self.err("expected ',' or '}'")),
                None => return Err(self.err("EOF while parsing an object")),
            }
        }
        if let Some(s) = run_start {
            self.edits.push(Edit {
                range: s..prev_end,
                with: Repl::Nothing,
            });
        }
        self.depth -= 1;
        Ok(open..self.pos)
    }

    /// Walks the array at the cursor: `f` is called for each element (its index) with the
    /// cursor at it and must consume exactly that element. Returns the array's span.
    ///
    /// # Errors
    /// [`ScanError`] when the text is not a JSON array there, or `f`'s error.
    pub(crate) fn array(
        &mut self,
        mut f: impl FnMut(&mut Self, usize) -> Result<(), ScanError>,
    ) -> Result<Range<usize>, ScanError> {
        if self.peek() != Some(b'[') {
            return Err(self.err("expected an array"));
        }
        self.enter()?;
        let open = self.pos;
        self.pos += 1;
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(open..self.pos);
        }
        let mut n = 0;
        loop {
            self.ws();
            f(self, n)?;
            n += 1;
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    break;
                }
                Some(_) => return Err(self.err("expected ',' or ']'")),
                None => return Err(self.err("EOF while parsing a list")),
            }
        }
        self.depth -= 1;
        Ok(open..self.pos)
    }

    /// Whether a member's key is `name` (escapes decoded when the key has any).
    #[cfg(test)]
    pub(crate) fn key_is(&self, m: &Member, name: &str) -> bool {
        let raw = &self.b[m.key.clone()];
        if !m.escaped {
            return raw == name.as_bytes();
        }
        decode_key(self.b, m).as_deref() == Some(name)
    }
}

/// A member's key with its escapes decoded (`None` if it cannot be: the scanner validated it,
/// so only for a key that is not UTF-8).
pub(crate) fn decode_key(b: &[u8], m: &Member) -> Option<String> {
    serde_json::from_slice::<String>(&b[m.key.start - 1..m.key.end + 1]).ok()
}

/// Writes `src[span]` with `edits` applied (in order, non-overlapping, inside `span`) to
/// `out`.
pub(crate) fn apply(src: &[u8], span: Range<usize>, edits: &[Edit], out: &mut impl BufMut) {
    let mut at = span.start;
    for e in edits {
        out.put_slice(&src[at..e.range.start]);
        match e.with {
            Repl::Nothing => {}
            Repl::Uint(n) => push_uint(out, n),
            Repl::Member { key, n, comma } => {
                out.put_u8(b'"');
                out.put_slice(key.as_bytes());
                out.put_slice(b"\":");
                push_uint(out, n);
                if comma {
                    out.put_u8(b',');
                }
            }
        }
        at = e.range.end;
    }
    out.put_slice(&src[at..span.end]);
}

/// The length of what [`apply`] writes for `span` with `edits`, without writing it.
pub(crate) fn edited_len(span: Range<usize>, edits: &[Edit]) -> u64 {
    let digits = |n: u64| itoa::Buffer::new().format(n).len();
    let mut len = span.len();
    for e in edits {
        len -= e.range.len();
        len += match e.with {
            Repl::Nothing => 0,
            Repl::Uint(n) => digits(n),
            Repl::Member { key, n, comma } => key.len() + 3 + digits(n) + usize::from(comma),
        };
    }
    len as u64
}

/// Writes `n` in decimal.
pub(crate) fn push_uint(out: &mut impl BufMut, n: u64) {
    let mut buf = itoa::Buffer::new();
    out.put_slice(buf.format(n).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

    /// Scans `text` fully (validating it) and drops the top-level members named `drop`.
    fn drop_members(text: &str, drop: &[&str]) -> Result<String, ScanError> {
        let mut c = Cursor::new(text.as_bytes(), Vec::new());
        c.object(|c, m| {
            c.value()?;
            let gone = drop.iter().any(|d| c.key_is(m, d));
            Ok(if gone { Keep::Drop } else { Keep::Yes })
        })?;
        c.end()?;
        let mut out = Vec::new();
        apply(text.as_bytes(), 0..text.len(), &c.edits, &mut out);
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn dropping_members_keeps_valid_json_whatever_their_position() {
        let text = r#"{ "a" : 1 , "b":[2, {"x":3}] ,"c":"s", "d":null }"#;
        let names = ["a", "b", "c", "d"];
        // Every subset of the four members.
        for mask in 0u32..16 {
            let drop: Vec<&str> = (0..4)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| names[i])
                .collect();
            let out = drop_members(text, &drop).unwrap();
            let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out}: {e}"));
            let mut want: Value = serde_json::from_str(text).unwrap();
            for d in &drop {
                want.as_object_mut().unwrap().remove(*d);
            }
            assert_eq!(v, want, "{drop:?} -> {out}");
        }
    }

    #[test]
    fn escaped_keys_are_decoded() {
        let out = drop_members(r#"{"tok\u0065n_ids":[1],"k":2}"#, &["token_ids"]).unwrap();
        assert_eq!(out, r#"{"k":2}"#);
    }

    /// A number out of f64's range is refused, as serde_json refuses it; one that underflows
    /// to zero is not. Found writing the `relay` fuzz target's serde_json property
    /// (tests/fuzz/regressions/relay/number_out_of_range): the scanner accepted `1e400`, so
    /// the relay forwarded such a frame to a streaming client while the aggregated answer,
    /// read with serde_json, silently dropped it.
    #[test]
    fn numbers_out_of_range_are_refused_as_serde_json_refuses_them() {
        let huge = format!("1{}", "0".repeat(400));
        for text in [
            "1e400",
            "-1.5E+309",
            "1e99999999999999999999",
            huge.as_str(),
        ] {
            let mut c = Cursor::new(text.as_bytes(), Vec::new());
            assert!(c.value().is_err(), "{text}");
            assert!(serde_json::from_str::<Value>(text).is_err(), "{text}");
        }
        for text in ["1e-400", "0e999", "1.7976931348623157e308", "-2.5e-5"] {
            let mut c = Cursor::new(text.as_bytes(), Vec::new());
            c.value().unwrap();
            c.end().unwrap();
            assert!(serde_json::from_str::<Value>(text).is_ok(), "{text}");
        }
    }

    #[test]
    fn numbers_read_as_serde_json_reads_them() {
        for (text, want) in [
            ("0", Some(0)),
            ("-0", None),
            ("17", Some(17)),
            ("18446744073709551615", Some(u64::MAX)),
            ("18446744073709551616", None),
            ("-1", None),
            ("1.0", None),
            ("1e2", None),
            ("\"1\"", None),
            ("null", None),
        ] {
            let mut c = Cursor::new(text.as_bytes(), Vec::new());
            let (_, n) = c.uint().unwrap();
            c.end().unwrap();
            let v: Value = serde_json::from_str(text).unwrap();
            assert_eq!(n, want, "{text}");
            assert_eq!(n, v.as_u64(), "{text}");
        }
    }

    #[test]
    fn invalid_texts_are_refused() {
        for text in [
            "",
            "{",
            "{\"a\"}",
            "{\"a\":}",
            "{\"a\":1,}",
            "[1,]",
            "[1 2]",
            "01",
            "1.",
            "-",
            "1e",
            "\"\\x\"",
            "\"\\ud800\"",
            "\"\\udc00\"",
            "\"a\nb\"",
            "tru",
            "nul",
            "{} x",
            "{\"a\":1}}",
        ] {
            let mut c = Cursor::new(text.as_bytes(), Vec::new());
            let r = c.value().and_then(|_| c.end());
            assert!(r.is_err(), "{text:?} accepted");
            assert!(serde_json::from_str::<Value>(text).is_err(), "{text:?}");
        }
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert!(Cursor::new(deep.as_bytes(), Vec::new()).value().is_err());
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(Cursor::new(ok.as_bytes(), Vec::new()).value().is_ok());
    }

    #[test]
    fn nonempty_values() {
        for (text, want) in [
            ("\"\"", false),
            ("\"a\"", true),
            ("[ ]", false),
            ("[0]", true),
            ("{}", false),
            ("{\"a\":1}", true),
            ("0", false),
            ("null", false),
            ("true", false),
        ] {
            let mut c = Cursor::new(text.as_bytes(), Vec::new());
            assert_eq!(c.nonempty().unwrap(), want, "{text}");
        }
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            "[a-z\\\\\"\u{e9}\u{1f980}\n ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z_]{1,6}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever JSON serde_json writes (compact or pretty), the scanner accepts it, spans
        /// it exactly, and dropping a member gives what removing it from the Value gives.
        #[test]
        fn scanner_agrees_with_serde_json(v in arb_json(), pretty in any::<bool>(), k in 0usize..6) {
            let text = if pretty { serde_json::to_string_pretty(&v) } else { serde_json::to_string(&v) }.unwrap();
            let mut c = Cursor::new(text.as_bytes(), Vec::new());
            let span = c.value().unwrap();
            c.end().unwrap();
            prop_assert_eq!(span, 0..text.len());
            if let Value::Object(m) = &v
                && let Some(name) = m.keys().nth(k).cloned()
            {
                let out = drop_members(&text, &[&name]).unwrap();
                let mut want = v.clone();
                want.as_object_mut().unwrap().remove(&name);
                prop_assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), want);
            }
        }
    }

    #[test]
    fn replacements_and_insertions() {
        let text = br#"{"a":1,"b":2}"#;
        let edits = [
            Edit {
                range: 1..1,
                with: Repl::Member {
                    key: "index",
                    n: 7,
                    comma: true,
                },
            },
            Edit {
                range: 5..6,
                with: Repl::Uint(42),
            },
        ];
        let mut out = Vec::new();
        apply(text, 0..text.len(), &edits, &mut out);
        assert_eq!(
            serde_json::from_slice::<Value>(&out).unwrap(),
            json!({"index": 7, "a": 42, "b": 2})
        );
        assert_eq!(edited_len(0..text.len(), &edits), out.len() as u64);
        let edits = [Edit {
            range: 1..7,
            with: Repl::Nothing,
        }];
        let mut out = Vec::new();
        apply(text, 0..text.len(), &edits, &mut out);
        assert_eq!(out, br#"{"b":2}"#);
        assert_eq!(edited_len(0..text.len(), &edits), out.len() as u64);
    }
}
