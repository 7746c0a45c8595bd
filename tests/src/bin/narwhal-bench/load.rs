//! The load generator: C clients, each on one HTTP/1.1 keep-alive connection of its own (as wrk
//! drives a server), sending `POST /v1/completions` one after another until N requests were
//! sent, and timing each to the last byte of its body. With `Shot::h2_streams` set, the
//! clients share HTTP/2 connections instead (prior knowledge), that many clients' streams to a
//! connection, as a gateway multiplexes many clients onto few connections.
//!
//! A request counts as completed when the answer is 200 and its body is whole: a stream ends
//! with `data: [DONE]`, a JSON answer is an object with `choices`. Anything else (a refusal, a
//! reset, a stream cut short, a timeout) is an error, and the client reconnects.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use narwhal_testkit::Answer as Completion;
use serde::Deserialize as _;

/// One measured window's shape.
#[derive(Debug, Clone)]
pub(crate) struct Shot {
    /// Concurrent clients (connections).
    pub concurrency: usize,
    /// Requests to complete or fail.
    pub requests: usize,
    /// `max_tokens` of each request.
    pub tokens: u32,
    /// `stream` of each request.
    pub stream: bool,
    /// Per-request deadline (head and whole body).
    pub timeout: Duration,
    /// `Some(n)`: clients share HTTP/2 connections (prior knowledge), `n` clients to one, each
    /// client's request a stream of its connection; `None`: one HTTP/1.1 connection per client.
    pub h2_streams: Option<usize>,
    /// `Some(r)`: request `i` is sent no earlier than `i / r` seconds after the clients start, so the
    /// offered rate is at most `r` per second whatever the target's speed (the clients still
    /// bound the requests in flight); `None`: each client sends its next request at once.
    pub rate: Option<f64>,
}

/// What one window measured. Times in seconds.
#[derive(Debug, Default, Clone)]
pub(crate) struct Sample {
    /// Wall time from the first request sent to the last answer read.
    pub wall_s: f64,
    /// Latency (send to last body byte) of each completed request, ascending.
    pub latency_s: Vec<f64>,
    /// Time to first body byte of each completed request, ascending.
    pub ttfb_s: Vec<f64>,
    /// Requests that failed.
    pub errors: usize,
    /// The first failure, for the report.
    pub first_error: Option<String>,
}

impl Sample {
    /// Completed requests per second of wall time.
    pub(crate) fn rps(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.latency_s.len() as f64 / self.wall_s
        } else {
            0.0
        }
    }
}

/// The `q` quantile (0..=1) of an ascending list, nearest rank; NaN when empty.
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The JSON body of request number `i` (a distinct prompt per request, model `model`).
pub(crate) fn body(model: &str, i: usize, tokens: u32, stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": model,
            "prompt": format!("bench prompt number {i} with a few words"),
            "max_tokens": tokens,
            "stream": stream,
        })
        .to_string(),
    )
}

/// A client's way to its target: its own HTTP/1.1 connection, or a stream of a shared HTTP/2
/// connection (a clone of the connection's sender).
enum Sender {
    H1(http1::SendRequest<Full<Bytes>>),
    H2(http2::SendRequest<Full<Bytes>>),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_closed(),
            Sender::H2(s) => s.is_closed(),
        }
    }

    async fn ready(&mut self) -> Result<(), hyper::Error> {
        match self {
            Sender::H1(s) => s.ready().await,
            Sender::H2(s) => s.ready().await,
        }
    }

    async fn send(
        &mut self,
        req: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<hyper::body::Incoming>, hyper::Error> {
        match self {
            Sender::H1(s) => s.send_request(req).await,
            Sender::H2(s) => s.send_request(req).await,
        }
    }
}

async fn connect(addr: SocketAddr) -> Result<Sender, String> {
    let tcp = tcp(addr).await?;
    let (sender, conn) = http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("handshake {addr}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Sender::H1(sender))
}

/// One HTTP/2 connection with prior knowledge (RFC 9113 section 3.3).
async fn connect_h2(addr: SocketAddr) -> Result<http2::SendRequest<Full<Bytes>>, String> {
    let tcp = tcp(addr).await?;
    let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .map_err(|e| format!("HTTP/2 handshake {addr}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

async fn tcp(addr: SocketAddr) -> Result<tokio::net::TcpStream, String> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// One answer read whole: status, body, time to first body byte.
struct Answer {
    status: u16,
    body: Vec<u8>,
    ttfb: Option<Duration>,
}

async fn exchange(
    sender: &mut Sender,
    addr: SocketAddr,
    path: &str,
    body: Bytes,
    keep_body: bool,
    start: Instant,
) -> Result<Answer, String> {
    sender
        .ready()
        .await
        .map_err(|e| format!("connection: {e}"))?;
    // HTTP/2 carries the target in `:scheme` and `:authority`, from an absolute URI.
    let uri = match sender {
        Sender::H1(_) => path.to_string(),
        Sender::H2(_) => format!("http://{addr}{path}"),
    };
    let req = http::Request::post(uri)
        .header(http::header::HOST, addr.to_string())
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let resp = sender
        .send(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let status = resp.status().as_u16();
    let mut incoming = resp.into_body();
    let mut out = Vec::new();
    let mut tail: Vec<u8> = Vec::new();
    let mut ttfb = None;
    while let Some(frame) = incoming.frame().await {
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        if let Ok(data) = frame.into_data() {
            if data.is_empty() {
                continue;
            }
            if ttfb.is_none() {
                ttfb = Some(start.elapsed());
            }
            if keep_body {
                out.extend_from_slice(&data);
            } else {
                // Only the end matters for the completeness check.
                tail.extend_from_slice(&data);
                if tail.len() > 64 {
                    tail.drain(..tail.len() - 64);
                }
            }
        }
    }
    Ok(Answer {
        status,
        body: if keep_body { out } else { tail },
        ttfb,
    })
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &b[start..end.max(start)]
}

/// Whether a 200 answer's body is whole: a stream's tail is `data: [DONE]`; a JSON answer is an
/// object naming `choices`.
fn complete(stream: bool, body: &[u8]) -> bool {
    let t = trim(body);
    if stream {
        t.ends_with(b"data: [DONE]")
    } else {
        t.starts_with(b"{") && t.ends_with(b"}") && t.windows(9).any(|w| w == b"\"choices\"")
    }
}

/// Drives one window against `addr`: `shot.concurrency` clients share the numbers
/// `first..first + shot.requests` as their requests' prompts. Each client connects when it
/// sends its first request, inside the window.
pub(crate) async fn drive(addr: SocketAddr, model: &str, shot: &Shot, first: usize) -> Sample {
    drive_clients(addr, model, shot, first, false).await
}

/// [`drive`], but every client opens its connection first and the window starts once all of
/// them are connected (or failed to): the steady state of many long-lived client connections,
/// without the connect storm (and listen-queue overflow) of thousands opened at once inside
/// the window. A failed connect counts as one failed request.
pub(crate) async fn drive_connected(
    addr: SocketAddr,
    model: &str,
    shot: &Shot,
    first: usize,
) -> Sample {
    drive_clients(addr, model, shot, first, true).await
}

async fn drive_clients(
    addr: SocketAddr,
    model: &str,
    shot: &Shot,
    first: usize,
    preconnect: bool,
) -> Sample {
    let bodies: Arc<Vec<Bytes>> = Arc::new(
        (0..shot.requests)
            .map(|i| body(model, first + i, shot.tokens, shot.stream))
            .collect(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let clients = shot.concurrency.max(1);
    // Preconnected clients (and every client of shared HTTP/2 connections, opened first) wait
    // here, then the window's clock starts.
    let gated = preconnect || shot.h2_streams.is_some();
    let gate = Arc::new(tokio::sync::Barrier::new(clients + 1));
    let mut t0 = Instant::now();
    // HTTP/2: the shared connections, opened before the clients start (a failed one is its
    // clients' failed connect).
    let shared: Vec<Result<http2::SendRequest<Full<Bytes>>, String>> = match shot.h2_streams {
        Some(per) => {
            let n = clients.div_ceil(per.max(1));
            let opens = (0..n).map(|_| async {
                match tokio::time::timeout(shot.timeout, connect_h2(addr)).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("no HTTP/2 connection within {:?}", shot.timeout)),
                }
            });
            futures_util::future::join_all(opens).await
        }
        None => Vec::new(),
    };
    let mut tasks = Vec::with_capacity(clients);
    let paced_from = tokio::time::Instant::now();
    for k in 0..clients {
        let (bodies, next, shot, gate) = (bodies.clone(), next.clone(), shot.clone(), gate.clone());
        let share = (!shared.is_empty()).then(|| shared[k % shared.len()].clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut ttfb = Vec::new();
            let mut errors = 0usize;
            let mut first_error = None;
            let mut sender: Option<Sender> = None;
            let h2 = share.is_some();
            if let Some(share) = share {
                match share {
                    Ok(s) => sender = Some(Sender::H2(s)),
                    Err(e) => first_error = Some(e),
                }
            }
            if gated {
                if !h2 {
                    match tokio::time::timeout(shot.timeout, connect(addr)).await {
                        Ok(Ok(s)) => sender = Some(s),
                        Ok(Err(e)) => first_error = Some(e),
                        Err(_) => {
                            first_error = Some(format!("no connection within {:?}", shot.timeout))
                        }
                    }
                }
                gate.wait().await;
                if first_error.is_some() {
                    // This client's share goes to the others; its failed connect is one error.
                    return (lat, ttfb, 1, first_error);
                }
            }
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= bodies.len() {
                    break;
                }
                if let Some(r) = shot.rate.filter(|r| *r > 0.0) {
                    tokio::time::sleep_until(paced_from + Duration::from_secs_f64(i as f64 / r))
                        .await;
                }
                let start = Instant::now();
                let attempt = async {
                    let s = match sender.take() {
                        Some(s) if !s.is_closed() => s,
                        // A lost HTTP/2 connection: this client goes on on one of its own.
                        _ if h2 => Sender::H2(connect_h2(addr).await?),
                        _ => connect(addr).await?,
                    };
                    let mut s = s;
                    let answer = exchange(
                        &mut s,
                        addr,
                        "/v1/completions",
                        bodies[i].clone(),
                        !shot.stream,
                        start,
                    )
                    .await?;
                    Ok::<_, String>((s, answer))
                };
                let outcome = tokio::time::timeout(shot.timeout, attempt).await;
                match outcome {
                    Ok(Ok((s, a))) if a.status == 200 && complete(shot.stream, &a.body) => {
                        lat.push(start.elapsed().as_secs_f64());
                        ttfb.push(a.ttfb.unwrap_or_default().as_secs_f64());
                        sender = Some(s);
                    }
                    outcome => {
                        errors += 1;
                        if first_error.is_none() {
                            first_error = Some(match outcome {
                                Ok(Ok((_, a))) => format!(
                                    "status {}: {}",
                                    a.status,
                                    String::from_utf8_lossy(&a.body[..a.body.len().min(300)])
                                ),
                                Ok(Err(e)) => e,
                                Err(_) => format!("no whole answer within {:?}", shot.timeout),
                            });
                        }
                    }
                }
            }
            (lat, ttfb, errors, first_error)
        }));
    }
    if gated {
        gate.wait().await;
        t0 = Instant::now();
    }
    let mut sample = Sample::default();
    for t in tasks {
        match t.await {
            Ok((l, f, e, fe)) => {
                sample.latency_s.extend(l);
                sample.ttfb_s.extend(f);
                sample.errors += e;
                if sample.first_error.is_none() {
                    sample.first_error = fe;
                }
            }
            Err(e) => {
                sample.errors += 1;
                sample
                    .first_error
                    .get_or_insert(format!("client task: {e}"));
            }
        }
    }
    sample.wall_s = t0.elapsed().as_secs_f64();
    sample.latency_s.sort_by(f64::total_cmp);
    sample.ttfb_s.sort_by(f64::total_cmp);
    sample
}

/// One request on a fresh connection, its whole answer returned: `(status, body)`. For probes.
///
/// # Errors
/// A message when the connection or the exchange fails or `timeout` passes.
pub(crate) async fn once(
    addr: SocketAddr,
    body: Bytes,
    timeout: Duration,
) -> Result<(u16, Vec<u8>), String> {
    let attempt = async {
        let mut s = connect(addr).await?;
        let a = exchange(&mut s, addr, "/v1/completions", body, true, Instant::now()).await?;
        Ok::<_, String>((a.status, a.body))
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

/// The generated text of an answer: `choices[0].text` of a JSON completion, or the `text` of
/// every `data:` frame of a stream, concatenated.
///
/// # Errors
/// A message naming what is missing or malformed.
pub(crate) fn answer_text(stream: bool, body: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(body).map_err(|e| format!("answer is not UTF-8: {e}"))?;
    if !stream {
        let a: Completion = serde_json::from_str(text)
            .map_err(|e| format!("answer is not a JSON completion: {e}"))?;
        return a
            .choice(0)
            .and_then(|c| c.text.clone())
            .ok_or_else(|| format!("answer has no choices[0].text: {text}"));
    }
    let mut out = String::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let data = data.trim();
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(data).map_err(|e| format!("frame is not JSON ({e}): {data}"))?;
        if v.get("error").is_some() {
            return Err(format!("error frame: {data}"));
        }
        let a = Completion::deserialize(&v)
            .map_err(|e| format!("frame is not a chunk ({e}): {data}"))?;
        if let Some(t) = a.choice(0).and_then(|c| c.text.as_deref()) {
            out.push_str(t);
        }
    }
    if !done {
        return Err("stream did not end with data: [DONE]".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completeness() {
        assert!(complete(true, b"data: {}\n\ndata: [DONE]\n\n"));
        assert!(!complete(true, b"data: {}\n\n"));
        assert!(complete(false, b"{\"choices\":[]}\n"));
        assert!(!complete(false, b"{\"error\":{}}"));
        assert!(!complete(false, b"{\"choices\":["));
    }

    #[test]
    fn texts() {
        let s = b"data: {\"choices\":[{\"text\":\" a\"}]}\n\ndata: {\"choices\":[{\"text\":\" b\"}]}\n\ndata: [DONE]\n\n";
        assert_eq!(answer_text(true, s).unwrap(), " a b");
        assert!(answer_text(true, b"data: {\"error\":{}}\n\ndata: [DONE]\n\n").is_err());
        assert_eq!(
            answer_text(false, b"{\"choices\":[{\"text\":\"x\"}]}").unwrap(),
            "x"
        );
    }

    #[test]
    fn quantiles() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 0.99), 5.0);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
