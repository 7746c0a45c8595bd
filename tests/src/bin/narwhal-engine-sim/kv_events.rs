//! `--kv-events-config`: vLLM's KV events publisher (vLLM 0.32.0 `ZmqEventPublisher`) on the
//! pure-Rust `zeromq` crate. A PUB socket sends each batch as `[topic, seq, payload]` (seq from
//! 0 per process, 8 bytes big-endian); an optional ROUTER socket replays the last
//! `buffer_steps` batches on request. Encoding: `narwhal_testkit::kv_events`
//! (docs/engine-simulator.md, "KV events").
//!
//! ```text
//! prefix cache ──events──► Publisher::publish ──mpsc──► task ──► PUB   [topic, seq, payload]
//!                                                          └──► ring of (seq, payload)
//!                         replay client ──[id, "", start]──► ROUTER ──► [id, "", topic, seq,
//!                                                     payload]..., [id, "", "", -1, ""]
//! ```

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};

use bytes::Bytes;
use narwhal_testkit::kv_events::{
    KvEvent, KvEventBatch, REPLAY_END, encode_batch, encode_sglang_batch,
};
use serde::Deserialize;
use tokio::sync::mpsc;
use zeromq::{Socket as _, SocketRecv as _, SocketSend as _, ZmqMessage};

/// The JSON of `--kv-events-config`, with vLLM's `KVEventsConfig` keys and defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct KvEventsConfig {
    /// Publish at all (vLLM's default: false).
    #[serde(default)]
    pub(crate) enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; unset: `"zmq"` when enabled, else `"null"` (as vLLM).
    #[serde(default)]
    pub(crate) publisher: Option<String>,
    /// PUB endpoint: one with `*` or `::` binds, `tcp://host:port` connects (vLLM's rule).
    #[serde(default = "default_endpoint")]
    pub(crate) endpoint: String,
    /// ROUTER endpoint for replay requests (always bound); none: no replay.
    #[serde(default)]
    pub(crate) replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub(crate) buffer_steps: usize,
    /// vLLM's PUB high-water mark (accepted; the `zeromq` crate has no such option).
    #[serde(default = "default_hwm")]
    pub(crate) hwm: u64,
    /// vLLM's publish queue bound (accepted; the simulator's queue is unbounded).
    #[serde(default = "default_hwm")]
    pub(crate) max_queue_size: u64,
    /// The first frame of every PUB message (subscribers filter on its prefix).
    #[serde(default)]
    pub(crate) topic: String,
}

impl KvEventsConfig {
    /// Data-parallel rank `rank`'s config: every tcp port plus `rank`, as vLLM's
    /// `ZmqEventPublisher.offset_endpoint_port` offsets them.
    ///
    /// # Errors
    /// Rank > 0 of an endpoint on port 0 (each rank must bind the port plus its rank).
    pub(crate) fn rank(&self, rank: usize) -> Result<KvEventsConfig, String> {
        let offset = |ep: &str| -> Result<String, String> {
            let Some((host, port)) = ep.rsplit_once(':') else {
                return Ok(ep.to_string());
            };
            match port.parse::<usize>() {
                Ok(0) if rank > 0 => Err(format!(
                    "--kv-events-config: endpoint {ep} binds port 0, but with \
                     --data-parallel-size rank {rank} binds the port plus its rank"
                )),
                Ok(p) => Ok(format!("{host}:{}", p + rank)),
                Err(_) => Ok(ep.to_string()),
            }
        };
        Ok(KvEventsConfig {
            endpoint: offset(&self.endpoint)?,
            replay_endpoint: self.replay_endpoint.as_deref().map(offset).transpose()?,
            ..self.clone()
        })
    }
}

fn default_endpoint() -> String {
    "tcp://*:5557".to_string()
}

fn default_buffer_steps() -> usize {
    10_000
}

fn default_hwm() -> u64 {
    100_000
}

impl KvEventsConfig {
    /// Parses the flag's JSON; `Ok(None)` when events are off (`enable_kv_cache_events`
    /// false, or publisher `"null"`).
    ///
    /// # Errors
    /// A message naming `--kv-events-config` and the offending key.
    pub(crate) fn parse(text: &str) -> Result<Option<Self>, String> {
        let c: KvEventsConfig = serde_json::from_str(text)
            .map_err(|e| format!("--kv-events-config: invalid JSON config: {e}"))?;
        let publisher = c.publisher.clone().unwrap_or_else(|| {
            if c.enable_kv_cache_events {
                "zmq".into()
            } else {
                "null".into()
            }
        });
        match publisher.as_str() {
            "zmq" | "null" => {}
            p => {
                return Err(format!(
                    "--kv-events-config: unknown \"publisher\" {p:?} (expected \"zmq\" or \"null\")"
                ));
            }
        }
        if !c.enable_kv_cache_events || publisher == "null" {
            return Ok(None);
        }
        for (key, n) in [
            ("buffer_steps", c.buffer_steps as u64),
            ("hwm", c.hwm),
            ("max_queue_size", c.max_queue_size),
        ] {
            if n == 0 {
                return Err(format!("--kv-events-config: {key:?} must be at least 1"));
            }
        }
        for (key, ep) in [
            ("endpoint", Some(&c.endpoint)),
            ("replay_endpoint", c.replay_endpoint.as_ref()),
        ] {
            if let Some(ep) = ep
                && !ep.starts_with("tcp://")
            {
                return Err(format!(
                    "--kv-events-config: {key:?} {ep:?}: only tcp:// endpoints are supported"
                ));
            }
        }
        Ok(Some(c))
    }
}

/// Whether vLLM binds `endpoint` (wildcard or IPv6 `::`) rather than connecting to it.
pub(crate) fn binds(endpoint: &str) -> bool {
    endpoint.contains('*') || endpoint.contains("::")
}

/// The address to bind for `tcp://HOST:PORT`: `*` is every interface, except `tcp://*:0`,
/// which vLLM binds on its node IP: the simulator binds the `--listen` IP.
fn bind_addr(endpoint: &str, listen_ip: IpAddr) -> Result<SocketAddr, String> {
    let rest = endpoint.trim_start_matches("tcp://");
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("--kv-events-config: endpoint {endpoint:?} has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("--kv-events-config: endpoint {endpoint:?}: bad port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip = match host {
        "*" if port == 0 => listen_ip,
        "*" => IpAddr::from([0, 0, 0, 0]),
        h => h
            .parse()
            .map_err(|_| format!("--kv-events-config: endpoint {endpoint:?}: bad host"))?,
    };
    Ok(SocketAddr::new(ip, port))
}

/// `tcp://IP:PORT` of a bound listener, with an unspecified IP shown as loopback.
fn shown(addr: SocketAddr) -> String {
    let ip = if addr.ip().is_unspecified() {
        IpAddr::from([127, 0, 0, 1])
    } else {
        addr.ip()
    };
    format!("tcp://{}", SocketAddr::new(ip, addr.port()))
}

async fn bind_socket<S: zeromq::Socket>(
    sock: &mut S,
    key: &str,
    endpoint: &str,
    listen_ip: IpAddr,
) -> Result<String, String> {
    let addr = bind_addr(endpoint, listen_ip)?;
    let l = std::net::TcpListener::bind(addr)
        .map_err(|e| format!("--kv-events-config: cannot bind {key} {endpoint}: {e}"))?;
    let local = l.local_addr().unwrap_or(addr);
    sock.bind_listener(l)
        .await
        .map_err(|e| format!("--kv-events-config: cannot serve {key} {endpoint}: {e}"))?;
    Ok(shown(local))
}

/// The running publisher: [`Publisher::publish`] queues a batch; a task sends it.
pub(crate) struct Publisher {
    tx: mpsc::UnboundedSender<Vec<KvEvent>>,
    /// The PUB endpoint as bound (`tcp://IP:PORT`) or connected to (as given).
    pub(crate) endpoint: String,
    /// The ROUTER endpoint as bound, if replay is on.
    pub(crate) replay_endpoint: Option<String>,
}

impl Publisher {
    /// Binds or connects the sockets and starts the publishing task.
    ///
    /// # Errors
    /// A message naming `--kv-events-config` and the endpoint that failed.
    pub(crate) async fn start(
        cfg: &KvEventsConfig,
        listen_ip: IpAddr,
        encoding: Encoding,
    ) -> Result<Self, String> {
        let mut publ = zeromq::PubSocket::new();
        let endpoint = if binds(&cfg.endpoint) {
            bind_socket(&mut publ, "endpoint", &cfg.endpoint, listen_ip).await?
        } else {
            publ.connect(&cfg.endpoint).await.map_err(|e| {
                format!(
                    "--kv-events-config: cannot connect endpoint {}: {e}",
                    cfg.endpoint
                )
            })?;
            cfg.endpoint.clone()
        };
        let mut replay = None;
        let mut replay_endpoint = None;
        if let Some(ep) = &cfg.replay_endpoint {
            let mut r = zeromq::RouterSocket::new();
            replay_endpoint = Some(bind_socket(&mut r, "replay_endpoint", ep, listen_ip).await?);
            replay = Some(r);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let topic = Bytes::from(cfg.topic.clone().into_bytes());
        tokio::spawn(run(publ, replay, rx, topic, cfg.buffer_steps, encoding));
        Ok(Publisher {
            tx,
            endpoint,
            replay_endpoint,
        })
    }

    /// Queues one batch of `events` (nothing when empty), stamped now.
    pub(crate) fn publish(&self, events: Vec<KvEvent>) {
        if !events.is_empty() {
            let _ = self.tx.send(events);
        }
    }
}

/// Whose classes a batch is encoded with: vLLM 0.32's (`--dialect vllm`) or SGLang 0.5's
/// (`--dialect sglang`: signed hashes, optional fields left out; `encode_sglang_batch`). The
/// frames, sequence numbers and replay are the same for both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    /// `KVEventBatch` of `vllm/distributed/kv_events.py`.
    Vllm,
    /// `KVEventBatch` of `sglang/srt/disaggregation/kv_events.py`.
    Sglang,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn message(frames: Vec<Bytes>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(frames).ok()
}

async fn run(
    mut publ: zeromq::PubSocket,
    mut replay: Option<zeromq::RouterSocket>,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    topic: Bytes,
    buffer_steps: usize,
    encoding: Encoding,
) {
    let mut seq: u64 = 0;
    let mut ring: VecDeque<(u64, Bytes)> = VecDeque::new();
    loop {
        let request = async {
            match replay.as_mut() {
                Some(r) => r.recv().await.ok(),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            events = rx.recv() => {
                let Some(events) = events else { return };
                let batch = KvEventBatch { ts: now(), events, data_parallel_rank: Some(0) };
                let payload = Bytes::from(match encoding {
                    Encoding::Vllm => encode_batch(&batch),
                    Encoding::Sglang => encode_sglang_batch(&batch),
                });
                let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
                if let Some(m) = message(frames)
                    && let Err(e) = publ.send(m).await
                {
                    tracing::warn!(error = %e, "kv events: PUB send failed");
                }
                if ring.len() == buffer_steps {
                    ring.pop_front();
                }
                ring.push_back((seq, payload));
                seq += 1;
            }
            Some(req) = request => {
                let frames = req.into_vec();
                let [id, _, start] = frames.as_slice() else {
                    tracing::warn!(frames = frames.len(), "kv events: invalid replay request");
                    continue;
                };
                let start = start.iter().fold(0u64, |a, b| (a << 8) | u64::from(*b));
                let Some(r) = replay.as_mut() else { continue };
                for (s, payload) in ring.iter().filter(|(s, _)| *s >= start) {
                    let m = message(vec![id.clone(), Bytes::new(), topic.clone(),
                        Bytes::copy_from_slice(&s.to_be_bytes()), payload.clone()]);
                    if let Some(m) = m {
                        let _ = r.send(m).await;
                    }
                }
                let end = vec![id.clone(), Bytes::new(), Bytes::new(),
                    Bytes::copy_from_slice(&REPLAY_END), Bytes::new()];
                if let Some(m) = message(end) {
                    let _ = r.send(m).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_follows_vllm_defaults_and_names_the_flag() {
        assert!(KvEventsConfig::parse("{}").unwrap().is_none());
        assert!(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"null"}"#)
                .unwrap()
                .is_none()
        );
        let c = KvEventsConfig::parse(r#"{"enable_kv_cache_events":true}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.endpoint.as_str(), c.buffer_steps),
            ("tcp://*:5557", 10_000)
        );
        let e = KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"kafka"}"#)
            .unwrap_err();
        assert!(
            e.contains("--kv-events-config") && e.contains("kafka"),
            "{e}"
        );
        let e =
            KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"endpint":"x"}"#).unwrap_err();
        assert!(e.contains("endpint"), "{e}");
    }

    #[test]
    fn bind_or_connect_as_vllm() {
        assert!(binds("tcp://*:5557"));
        assert!(!binds("tcp://127.0.0.1:5557"));
        let lo = IpAddr::from([127, 0, 0, 1]);
        assert_eq!(
            bind_addr("tcp://*:0", lo).unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert_eq!(
            bind_addr("tcp://*:7", lo).unwrap(),
            "0.0.0.0:7".parse().unwrap()
        );
    }
}
