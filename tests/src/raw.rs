//! Raw HTTP/1 over a blocking `TcpStream`, for tests that must see framing exactly as a router
//! or engine sends it (chunk sizes, a cut without the terminating chunk, no answer at all) or
//! control the connection themselves (disconnect mid-request).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;

use crate::http::{sse_data, sse_text};

/// A raw HTTP/1 response.
#[derive(Debug)]
pub struct RawResponse {
    /// 0 when the connection closed without a response head.
    pub status: u16,
    /// The body (de-chunked).
    pub body: Vec<u8>,
    /// Sizes of the chunks of a chunked body.
    pub chunks: Vec<usize>,
    /// The body ended properly (terminating chunk or full content-length).
    pub complete: bool,
    /// The status line and headers, lowercased (`""` without a head).
    pub head: String,
}

impl RawResponse {
    /// The body as (lossy) UTF-8.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON.
    ///
    /// # Panics
    /// When it is not JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// The body parsed as `T`.
    ///
    /// # Panics
    /// When the body is not a `T`.
    pub fn json_as<T: serde::de::DeserializeOwned>(&self) -> T {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "not a {} ({e}): {}",
                std::any::type_name::<T>(),
                self.text()
            )
        })
    }

    /// SSE `data:` payloads in order ([`sse_data`]).
    pub fn events(&self) -> Vec<String> {
        sse_data(&self.text())
    }

    /// Concatenated token text of an SSE completion/chat stream ([`sse_text`]).
    pub fn stream_text(&self) -> String {
        sse_text(&self.events())
    }
}

/// Connects to `addr` (`host:port`) and writes one request: `METHOD path HTTP/1.1`, `host: x`,
/// `headers`, `content-length`, then `body`. The caller reads (or drops) the connection.
///
/// # Panics
/// When the connection or the write fails.
pub fn send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: x\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).expect("write request");
    s
}

/// One request with `connection: close` and `content-type: application/json` (plus
/// `headers`), read to the end (20 s read timeout) and parsed.
///
/// # Panics
/// When the connection or the write fails.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> RawResponse {
    let mut all = vec![
        ("connection", "close"),
        ("content-type", "application/json"),
    ];
    all.extend_from_slice(headers);
    let mut s = send(addr, method, path, &all, body);
    parse_response(&read_to_end(&mut s, Duration::from_secs(20)))
}

/// Reads from `s` until the peer closes the connection (or a read waits `within`); every
/// byte read.
pub fn read_to_end(s: &mut TcpStream, within: Duration) -> Vec<u8> {
    s.set_read_timeout(Some(within)).expect("read timeout");
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    raw
}

/// Reads from `s` (10 s read timeout) until the bytes so far contain `needle`; returns them.
///
/// # Panics
/// When the connection ends or times out first.
pub fn read_until(s: &mut TcpStream, needle: &str) -> String {
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains(needle) {
        let n = s.read(&mut buf).expect("read");
        assert!(
            n > 0,
            "stream ended before {needle:?}: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Parses a whole HTTP/1 response (head, then a chunked or content-length body).
pub fn parse_response(raw: &[u8]) -> RawResponse {
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return RawResponse {
            status: 0,
            body: raw.to_vec(),
            chunks: vec![],
            complete: false,
            head: String::new(),
        };
    };
    let head = String::from_utf8_lossy(&raw[..split]).to_lowercase();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    let rest = &raw[split + 4..];
    if head.contains("transfer-encoding: chunked") {
        let mut body = Vec::new();
        let mut chunks = Vec::new();
        let mut i = 0;
        let mut complete = false;
        while let Some(nl) = rest[i..].windows(2).position(|w| w == b"\r\n") {
            let size_str = String::from_utf8_lossy(&rest[i..i + nl]).to_string();
            let Ok(size) = usize::from_str_radix(size_str.trim(), 16) else {
                break;
            };
            i += nl + 2;
            if size == 0 {
                complete = true;
                break;
            }
            if i + size > rest.len() {
                body.extend_from_slice(&rest[i..]);
                break;
            }
            body.extend_from_slice(&rest[i..i + size]);
            chunks.push(size);
            i += size + 2;
        }
        RawResponse {
            status,
            body,
            chunks,
            complete,
            head,
        }
    } else {
        let cl = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        RawResponse {
            status,
            complete: cl.is_none_or(|n| n == rest.len()),
            body: rest.to_vec(),
            chunks: vec![],
            head,
        }
    }
}
