//! The KV side channel: the simulator's stand-in for NIXL reads (vLLM, `--kv-listen`) and the
//! SGLang bootstrap server (`--bootstrap-port`). One JSON line each way over TCP; a consumer
//! keeps its connection to a producer for the next block read, as a vLLM decode engine keeps
//! its NIXL connection to each remote engine (a room pull has a connection of its own).
//!
//! ```text
//!  consumer (decode engine)                               producer (prefill engine)
//!  {"op":"read_blocks","engine_id","block_ids",  ───►  check engine id, take blocks (once)
//!   "consumer"}
//!  {"op":"pull_room","room","wait_ms","consumer"} ───►  wait ≤ wait_ms for the room, take it (once)
//!                                                ◄───  {"ok":true,"engine_id","prompt_hash",
//!                                                        "prompt_tokens","request_id"}
//!                                                       | {"ok":false,"error":"..."}
//! ```
//!
//! The consumer then checks the prompt hash against its own request (docs/engine-simulator.md,
//! "KV side channel").

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::kv::{KvPayload, Pull};
use crate::server::Sim;

/// Longest accepted request/reply line (bytes).
const MAX_LINE: usize = 1 << 20;

/// Connect timeout to a producer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A side-channel request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Request {
    /// vLLM: read (and free) the blocks of a descriptor.
    ReadBlocks {
        /// `remote_engine_id` of the descriptor; must equal the producer's current id.
        engine_id: String,
        /// `remote_block_ids`.
        block_ids: Vec<u64>,
        /// The consumer's URL (recorded as the producer's `kv_peer`).
        consumer: String,
    },
    /// SGLang: wait up to `wait_ms` for a room to be published, then take it.
    PullRoom {
        /// `bootstrap_room`.
        room: u64,
        /// Milliseconds to wait for the prefill to publish.
        wait_ms: u64,
        /// The consumer's URL.
        consumer: String,
    },
}

/// A side-channel reply.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Reply {
    /// Success flag.
    pub(crate) ok: bool,
    /// Producer engine id.
    #[serde(default)]
    pub(crate) engine_id: String,
    /// Prompt hash of the KV.
    #[serde(default)]
    pub(crate) prompt_hash: u64,
    /// Prompt tokens covered.
    #[serde(default)]
    pub(crate) prompt_tokens: usize,
    /// Producer request id.
    #[serde(default)]
    pub(crate) request_id: String,
    /// Failure reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<String>,
}

impl Reply {
    fn ok(engine_id: &str, p: KvPayload) -> Self {
        Reply {
            ok: true,
            engine_id: engine_id.to_string(),
            prompt_hash: p.prompt_hash,
            prompt_tokens: p.prompt_tokens,
            request_id: p.request_id,
            error: None,
        }
    }

    fn err(engine_id: &str, e: impl Into<String>) -> Self {
        Reply {
            ok: false,
            engine_id: engine_id.to_string(),
            prompt_hash: 0,
            prompt_tokens: 0,
            request_id: String::new(),
            error: Some(e.into()),
        }
    }
}

/// Consumer-side transfer failure. Messages name the producer and the reason, as vLLM logs a
/// failed NIXL transfer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TransferError {
    /// TCP connect failed or timed out.
    #[error("KV producer at {addr} is unreachable: {reason}")]
    Unreachable {
        /// `host:port`.
        addr: String,
        /// OS error or timeout.
        reason: String,
    },
    /// The connection broke or the reply was not a reply line.
    #[error("KV side channel to {addr} failed: {reason}")]
    Protocol {
        /// `host:port`.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// The producer refused.
    #[error("KV transfer from {addr} failed: {reason}")]
    Refused {
        /// `host:port`.
        addr: String,
        /// The producer's reason.
        reason: String,
    },
}

/// Idle side-channel connections of [`Request::ReadBlocks`], by producer `host:port`: a
/// consumer keeps its connection to each producer, as a vLLM decode engine keeps its NIXL
/// handshake and UCX endpoint with each remote engine instead of connecting per request.
static IDLE: LazyLock<Mutex<HashMap<String, Vec<BufReader<TcpStream>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Idle connections kept per producer.
const IDLE_PER_PRODUCER: usize = 64;

fn idle() -> std::sync::MutexGuard<'static, HashMap<String, Vec<BufReader<TcpStream>>>> {
    IDLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends one request to `host:port` and reads the reply; `read_timeout` bounds the wait for it.
/// A [`Request::ReadBlocks`] reuses an idle connection to the producer when there is one (and
/// keeps its own afterwards); one that breaks before its reply (the producer closed it, e.g.
/// it restarted) is retried once on a new connection. A [`Request::PullRoom`] has a connection
/// of its own, which the producer watches for the consumer's departure while the room waits.
pub(crate) async fn call(
    host: &str,
    port: u16,
    req: &Request,
    read_timeout: Duration,
) -> Result<Reply, TransferError> {
    let addr = format!("{host}:{port}");
    let keep = matches!(req, Request::ReadBlocks { .. });
    let proto = |reason: String| TransferError::Protocol {
        addr: addr.clone(),
        reason,
    };
    let mut line = serde_json::to_vec(req).map_err(|e| proto(e.to_string()))?;
    line.push(b'\n');
    let reused = if keep {
        idle().get_mut(&addr).and_then(Vec::pop)
    } else {
        None
    };
    let (mut stream, reply) = match reused {
        Some(mut s) => match exchange(&mut s, &line, read_timeout).await {
            Ok(reply) => (s, reply),
            // Nothing came back on a kept connection: the producer closed it (or restarted);
            // the request is sent again on a new one.
            Err(Exchange::Broken(_)) => {
                let mut s = connect(&addr).await?;
                let reply = exchange(&mut s, &line, read_timeout)
                    .await
                    .map_err(|e| proto(e.reason()))?;
                (s, reply)
            }
            Err(e) => return Err(proto(e.reason())),
        },
        None => {
            let mut s = connect(&addr).await?;
            let reply = exchange(&mut s, &line, read_timeout)
                .await
                .map_err(|e| proto(e.reason()))?;
            (s, reply)
        }
    };
    let reply: Reply = serde_json::from_str(&reply).map_err(|e| proto(e.to_string()))?;
    if keep {
        let mut idle = idle();
        let list = idle.entry(addr.clone()).or_default();
        if list.len() < IDLE_PER_PRODUCER {
            list.push(stream);
        }
    } else {
        let _ = stream.get_mut().shutdown().await;
    }
    if !reply.ok {
        return Err(TransferError::Refused {
            addr,
            reason: reply.error.unwrap_or_default(),
        });
    }
    Ok(reply)
}

async fn connect(addr: &str) -> Result<BufReader<TcpStream>, TransferError> {
    let unreachable = |reason: String| TransferError::Unreachable {
        addr: addr.to_string(),
        reason,
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(BufReader::new(s))
        }
        Ok(Err(e)) => Err(unreachable(e.to_string())),
        Err(_) => Err(unreachable(format!(
            "connect timed out after {CONNECT_TIMEOUT:?}"
        ))),
    }
}

/// How one request-reply exchange failed.
enum Exchange {
    /// The connection broke, or closed, before any byte of the reply.
    Broken(String),
    /// The connection closed in the middle of the reply (the producer may have handled the
    /// request: never sent again).
    Cut,
    /// No reply within the read timeout.
    TimedOut(Duration),
}

impl Exchange {
    fn reason(&self) -> String {
        match self {
            Exchange::Broken(r) => r.clone(),
            Exchange::Cut => "connection closed mid-reply".into(),
            Exchange::TimedOut(t) => format!("no reply within {t:?}"),
        }
    }
}

/// Writes `line` and reads one reply line.
async fn exchange(
    stream: &mut BufReader<TcpStream>,
    line: &[u8],
    read_timeout: Duration,
) -> Result<String, Exchange> {
    stream
        .get_mut()
        .write_all(line)
        .await
        .map_err(|e| Exchange::Broken(e.to_string()))?;
    let mut reply = String::new();
    match tokio::time::timeout(read_timeout, stream.read_line(&mut reply)).await {
        Err(_) => Err(Exchange::TimedOut(read_timeout)),
        Ok(Err(e)) => Err(Exchange::Broken(e.to_string())),
        Ok(Ok(0)) => Err(Exchange::Broken("connection closed without a reply".into())),
        Ok(Ok(_)) if !reply.ends_with('\n') => Err(Exchange::Cut),
        Ok(Ok(_)) => Ok(reply),
    }
}

/// Serves the side channel on `listener` until the process exits.
pub(crate) async fn serve(listener: TcpListener, sim: Arc<Sim>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "kv side channel accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let sim = sim.clone();
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let mut stream = BufReader::new(stream);
            // Block reads follow one another on a kept connection; a room pull ends it.
            loop {
                let mut line = String::new();
                let n = match (&mut stream)
                    .take(MAX_LINE as u64)
                    .read_line(&mut line)
                    .await
                {
                    Ok(n) => n,
                    Err(_) => return,
                };
                if n == 0 {
                    return;
                }
                let (reply, last) = match serde_json::from_str::<Request>(&line) {
                    Ok(req @ Request::ReadBlocks { .. }) => (handle(&sim, req).await, false),
                    // A consumer that goes away while waiting for a room (its decode request
                    // was cancelled) must not consume the room: stop waiting on EOF.
                    // `biased`, EOF first: when the room is published after the consumer
                    // left, a ready EOF must win over handing the room to a dead connection.
                    Ok(req) => tokio::select! {
                        biased;
                        () = until_eof(stream.get_mut()) => return,
                        r = handle(&sim, req) => (r, true),
                    },
                    Err(e) => (
                        Reply::err(&sim.engine_id, format!("bad side channel request: {e}")),
                        true,
                    ),
                };
                let Ok(mut out) = serde_json::to_vec(&reply) else {
                    return;
                };
                out.push(b'\n');
                if stream.get_mut().write_all(&out).await.is_err() {
                    return;
                }
                if last {
                    let _ = stream.get_mut().shutdown().await;
                    return;
                }
            }
        });
    }
}

/// Resolves when the peer closes its side of the connection (or it breaks).
async fn until_eof(s: &mut TcpStream) {
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

async fn handle(sim: &Sim, req: Request) -> Reply {
    let me = sim.engine_id.as_str();
    match req {
        Request::ReadBlocks {
            engine_id,
            block_ids,
            consumer,
        } => {
            if engine_id != me {
                return Reply::err(
                    me,
                    format!(
                        "remote_engine_id {engine_id:?} does not match this producer's engine id \
                         {me:?} (producer restarted?)"
                    ),
                );
            }
            let res = sim.blocks_lock().take(Instant::now(), &block_ids);
            match res {
                Ok(p) => {
                    sim.stats.kv_served.fetch_add(1, Relaxed);
                    sim.stats.set_peer(&p.request_id, &consumer);
                    Reply::ok(me, p)
                }
                Err(e) => Reply::err(me, e.to_string()),
            }
        }
        Request::PullRoom {
            room,
            wait_ms,
            consumer,
        } => {
            let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
            loop {
                let rx = {
                    let mut g = sim.rooms_lock();
                    match g.store.take(Instant::now(), room) {
                        Pull::Ready(p) => {
                            sim.stats.kv_served.fetch_add(1, Relaxed);
                            drop(g);
                            sim.stats.set_peer(&p.request_id, &consumer);
                            return Reply::ok(me, p);
                        }
                        Pull::Failed(e) => {
                            return Reply::err(me, format!("prefill for room {room} failed: {e}"));
                        }
                        Pull::Pending => {}
                    }
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    g.waiters.entry(room).or_default().push(tx);
                    rx
                };
                if tokio::time::timeout_at(deadline, rx).await.is_err() {
                    let mut g = sim.rooms_lock();
                    // Published right as the wait ran out: still hand it over.
                    if let Pull::Ready(p) = g.store.take(Instant::now(), room) {
                        sim.stats.kv_served.fetch_add(1, Relaxed);
                        drop(g);
                        sim.stats.set_peer(&p.request_id, &consumer);
                        return Reply::ok(me, p);
                    }
                    if let Some(w) = g.waiters.get_mut(&room) {
                        w.retain(|s| !s.is_closed());
                        if w.is_empty() {
                            g.waiters.remove(&room);
                        }
                    }
                    return Reply::err(
                        me,
                        format!("bootstrap room {room} was not published within {wait_ms} ms"),
                    );
                }
            }
        }
    }
}
