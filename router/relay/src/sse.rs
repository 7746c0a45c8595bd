//! Incremental SSE parsing (WHATWG event-stream rules), bounded per event.

/// One dispatched SSE event's `data` payload (multi-line data joined by `\n`), as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseData(pub String);

/// Incremental SSE parser (WHATWG event-stream rules): lines end with `\n`, `\r\n` or `\r`; a
/// blank line dispatches the event; `:` lines are comments; only the `data` field is kept.
/// Works on bytes: a line is found with `memchr`, and an event's data is handed out as a
/// slice of a buffer the parser reuses.
#[derive(Debug)]
pub struct SseParser {
    /// The unfinished line carried over from the previous bytes.
    pub(crate) line: Vec<u8>,
    pending_cr: bool,
    data: Vec<u8>,
    has_data: bool,
    overflowed: bool,
    /// Longest line or event buffered, bytes.
    max_event_bytes: usize,
}

/// The longest SSE line or event a parser made with [`SseParser::new`] buffers, bytes: the
/// default of `serving.max_response_bytes` (16 MiB). The router's own parsers take the
/// configured `serving.max_response_bytes` instead ([`SseParser::with_limit`]): one event can
/// never be larger than the response it belongs to may be, and it must hold what the router
/// itself asks a decode leg for (vLLM puts every prompt token id in the first chunk when asked
/// for `return_token_ids`: about 6-7 bytes a token, so 16 MiB holds a 2-million-token prompt).
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 << 20;

impl Default for SseParser {
    fn default() -> Self {
        Self::with_limit(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseParser {
    /// A parser at the start of a stream, bounded by [`DEFAULT_MAX_EVENT_BYTES`].
    pub fn new() -> Self {
        Self::default()
    }

    /// A parser at the start of a stream that buffers at most `max_event_bytes` of one line or
    /// event. An upstream that never ends a line or an event past this is broken, or sends more
    /// than the response may hold: the stream fails ([`SseParser::overflowed`]) instead of
    /// growing router memory.
    pub fn with_limit(max_event_bytes: usize) -> Self {
        SseParser {
            line: Vec::new(),
            pending_cr: false,
            data: Vec::new(),
            has_data: false,
            overflowed: false,
            max_event_bytes,
        }
    }

    /// Feeds the next upstream bytes: `on_event` gets each event's data completed by them, in
    /// order, and returns whether to go on. Returns the bytes consumed: all of them, or fewer
    /// when `on_event` stopped the parser (the rest is to be fed again later).
    pub fn feed(&mut self, bytes: &[u8], mut on_event: impl FnMut(&[u8]) -> bool) -> usize {
        let mut i = 0;
        while i < bytes.len() {
            if self.pending_cr {
                self.pending_cr = false;
                if bytes[i] == b'\n' {
                    i += 1;
                    continue;
                }
            }
            let Some(k) = memchr::memchr2(b'\n', b'\r', &bytes[i..]) else {
                self.carry(&bytes[i..]);
                return bytes.len();
            };
            let end = i + k;
            self.pending_cr = bytes[end] == b'\r';
            let go_on = if self.line.is_empty() {
                if k > self.max_event_bytes {
                    self.overflowed = true;
                    true
                } else {
                    self.end_line(&bytes[i..end], &mut on_event)
                }
            } else {
                self.carry(&bytes[i..end]);
                let line = std::mem::take(&mut self.line);
                let go_on = self.end_line(&line, &mut on_event);
                self.line = line;
                self.line.clear();
                go_on
            };
            i = end + 1;
            if !go_on {
                return i;
            }
        }
        i
    }

    /// Feeds bytes and collects the events they complete (tests and tools; the relay uses
    /// [`SseParser::feed`]). Invalid UTF-8 is replaced.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseData> {
        let mut out = Vec::new();
        self.feed(bytes, |d| {
            out.push(SseData(String::from_utf8_lossy(d).into_owned()));
            true
        });
        out
    }

    /// Keeps part of an unfinished line, dropping it once the line is over the limit.
    fn carry(&mut self, part: &[u8]) {
        if self.line.len() + part.len() > self.max_event_bytes {
            self.overflowed = true;
            self.line.clear();
            return;
        }
        self.line.extend_from_slice(part);
    }

    /// An upstream line or event exceeded the parser's limit; the stream must fail.
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// The upstream ended. An event not terminated by a blank line is discarded (SSE rules).
    pub fn finish(&mut self) {
        self.line.clear();
        self.data.clear();
        self.has_data = false;
    }

    fn end_line(&mut self, line: &[u8], on_event: &mut impl FnMut(&[u8]) -> bool) -> bool {
        if line.is_empty() {
            if !self.has_data {
                return true;
            }
            self.has_data = false;
            let go_on = on_event(&self.data);
            self.data.clear();
            return go_on;
        }
        if line[0] == b':' {
            return true;
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if !self.has_data {
                self.data.clear();
                self.data.extend_from_slice(value);
                self.has_data = true;
            } else if self.data.len() + value.len() >= self.max_event_bytes {
                self.overflowed = true;
                self.has_data = false;
                self.data.clear();
            } else {
                self.data.push(b'\n');
                self.data.extend_from_slice(value);
            }
        }
        true
    }
}
