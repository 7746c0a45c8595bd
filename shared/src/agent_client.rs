//! The router's client for one engine agent (architecture.md sections 3 and 4).
//!
//! ```text
//!   AgentEndpoint {agent_id, url, server_name, public_key} + TlsFiles + AgentTimeouts
//!        └─► AgentClient::new ─► one reqwest::Client (connection pool = per-agent reuse)
//!   client.attestation(iid, &Fence) ─► POST over mTLS ─► SignedDocument ─► Verifier ─► payload
//! ```
//!
//! TLS: the client presents the router certificate and trusts only the fleet CA; the agent's
//! certificate must be valid for `server_name` (the URL host is resolved to the configured
//! address, so `https://127.0.0.1:8443` with server name `agent-gpu-a` checks `agent-gpu-a`).
//! Every signed answer is verified with [`Verifier`] (nonce, epoch, holder, iid, freshness,
//! optional expected process) before it is returned.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::agent_protocol::{
    EnginesAnswer, ErrorBody, FencedRequest, KvConsumeRequest, KvProduceRequest, ModelRequest,
    ProbeProducer, ProbeRequest,
};
use crate::attestation::{
    AttestationPayload, Expected, GenerationPayload, KvConsumePayload, KvProducePayload,
    ProbePayload, SignedPayload, Verifier, VerifyError, new_nonce,
};
use crate::clock::Clock;
use crate::identity::ProcessIdentity;
use crate::signing::{PublicKey, SignedDocument};
use crate::tls::{TlsError, TlsFiles};

/// How to reach one agent (fleet `engines[].agent`, keyed by agent id).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentEndpoint {
    /// The agent's id (`agent_id` in its config and in every payload).
    pub agent_id: String,
    /// `https://HOST:PORT` of the agent.
    pub url: String,
    /// Name the agent certificate must be valid for (e.g. `agent-gpu-a`).
    pub server_name: String,
    /// Pinned agent signing key, `ed25519:<base64>`.
    pub public_key: PublicKey,
}

/// Client timeouts and verification window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AgentTimeouts {
    /// TCP + TLS connect limit, seconds.
    pub connect_s: f64,
    /// Whole-request limit for reads (engines, process, attestation), seconds.
    pub request_s: f64,
    /// Whole-request limit for checks that generate on the engine, seconds.
    pub check_s: f64,
    /// Accepted `issued_at` skew, seconds (fleet `agent.max_skew_s`).
    pub max_skew_s: f64,
}

impl Default for AgentTimeouts {
    fn default() -> Self {
        AgentTimeouts {
            connect_s: 2.0,
            request_s: 5.0,
            check_s: 30.0,
            max_skew_s: 30.0,
        }
    }
}

/// The router's lease position, sent with every POST.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// Lease epoch.
    pub epoch: u64,
    /// Lease holder name.
    pub holder: String,
}

/// Errors from agent calls.
#[derive(Debug, thiserror::Error)]
pub enum AgentClientError {
    /// TLS material could not be loaded.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// `url` is not `https://HOST:PORT` or its host cannot be resolved.
    #[error("agent {agent_id}: url {url:?}: {reason}")]
    Url {
        /// Agent id.
        agent_id: String,
        /// The URL.
        url: String,
        /// Why it is unusable.
        reason: String,
    },
    /// Connect, TLS handshake, timeout or body transfer failed.
    #[error("agent {agent_id}: {path}: transport: {source}")]
    Transport {
        /// Agent id.
        agent_id: String,
        /// Request path.
        path: String,
        /// reqwest's error.
        source: reqwest::Error,
    },
    /// The agent answered 409 `stale_epoch`: a newer router epoch exists (we are fenced).
    #[error("agent {agent_id}: stale epoch {sent}: agent accepted {highest:?}")]
    StaleEpoch {
        /// Agent id.
        agent_id: String,
        /// Our epoch.
        sent: u64,
        /// The agent's highest accepted epoch.
        highest: Option<u64>,
    },
    /// The agent answered 403 `forbidden`: this side's client certificate lacks the identity
    /// the call needs (a router's `spiffe://narwhal/router/<id>` URI SAN for fenced calls;
    /// docs/security.md).
    #[error("agent {agent_id}: {path}: HTTP 403 forbidden (rule {rule}): {message}")]
    Forbidden {
        /// Agent id.
        agent_id: String,
        /// Request path.
        path: String,
        /// The rule the certificate failed (`router_identity_required`, ...).
        rule: String,
        /// Message from the body (names the certificate's identity).
        message: String,
    },
    /// Any other non-2xx answer.
    #[error("agent {agent_id}: {path}: HTTP {status}: {code}: {message}")]
    Status {
        /// Agent id.
        agent_id: String,
        /// Request path.
        path: String,
        /// HTTP status.
        status: u16,
        /// Error code from the body (`unknown` when the body is not an error body).
        code: String,
        /// Error message from the body.
        message: String,
    },
    /// The body was not the expected JSON.
    #[error("agent {agent_id}: {path}: undecodable answer: {reason}")]
    Decode {
        /// Agent id.
        agent_id: String,
        /// Request path.
        path: String,
        /// serde's message.
        reason: String,
    },
    /// The signed answer failed verification.
    #[error("agent {agent_id}: {path}: {source}")]
    Verify {
        /// Agent id.
        agent_id: String,
        /// Request path.
        path: String,
        /// The verification failure.
        source: VerifyError,
    },
    /// The local wall clock is unusable.
    #[error("wall clock: {0}")]
    Clock(#[from] crate::clock::ClockError),
}

/// A verified answer: the payload and the document it came from (kept for journals).
#[derive(Debug, Clone)]
pub struct Verified<P> {
    /// The verified payload.
    pub payload: P,
    /// The signed document as received.
    pub document: SignedDocument,
}

/// Idle connections kept per agent, at most: as many as a readmission's concurrent checks can
/// hold open on one agent (the router checks up to 32 engines at once, each one call at a
/// time; `router/src/lifecycle/validation.rs`), so a wave's next check on an engine reuses a
/// connection instead of a new mutual-TLS handshake (an ECDHE exchange, both certificate
/// chains verified). With 4, a burst of 8 calls to one agent left 4 of its connections closed
/// and opened again for the next check.
pub const IDLE_CONNECTIONS: usize = 32;

/// mTLS client for one agent, with connection reuse and verification.
pub struct AgentClient {
    endpoint: AgentEndpoint,
    base: String,
    http: reqwest::Client,
    timeouts: AgentTimeouts,
    verifier: Verifier,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("endpoint", &self.endpoint)
            .field("base", &self.base)
            .finish()
    }
}

impl AgentClient {
    /// Builds the client: loads `tls` (router cert, key, fleet CA), pins the agent's key.
    ///
    /// # Errors
    /// [`AgentClientError::Tls`] for TLS files, [`AgentClientError::Url`] for a bad URL.
    pub fn new(
        endpoint: AgentEndpoint,
        tls: &TlsFiles,
        timeouts: AgentTimeouts,
        clock: Arc<dyn Clock>,
    ) -> Result<AgentClient, AgentClientError> {
        Self::with_tls_config(endpoint, tls.client_config()?, timeouts, clock)
    }

    /// As [`AgentClient::new`] with a prebuilt rustls client configuration (tests use this to
    /// present a foreign or no client certificate).
    ///
    /// # Errors
    /// [`AgentClientError::Url`] for a bad URL.
    pub fn with_tls_config(
        endpoint: AgentEndpoint,
        tls: rustls::ClientConfig,
        timeouts: AgentTimeouts,
        clock: Arc<dyn Clock>,
    ) -> Result<AgentClient, AgentClientError> {
        let url_err = |reason: String| AgentClientError::Url {
            agent_id: endpoint.agent_id.clone(),
            url: endpoint.url.clone(),
            reason,
        };
        let url = reqwest::Url::parse(&endpoint.url).map_err(|e| url_err(e.to_string()))?;
        if url.scheme() != "https" {
            return Err(url_err(
                "scheme must be https (no plaintext agent listener)".into(),
            ));
        }
        let host = url
            .host_str()
            .ok_or_else(|| url_err("no host".into()))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = url
            .port_or_known_default()
            .ok_or_else(|| url_err("no port".into()))?;
        let mut builder = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(secs(timeouts.connect_s))
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(IDLE_CONNECTIONS)
            .no_proxy();
        if host != endpoint.server_name {
            let addr: SocketAddr = (host.as_str(), port)
                .to_socket_addrs()
                .map_err(|e| url_err(format!("cannot resolve {host}: {e}")))?
                .next()
                .ok_or_else(|| url_err(format!("{host} resolves to nothing")))?;
            builder = builder.resolve(&endpoint.server_name, addr);
        }
        let http = builder
            .build()
            .map_err(|e| url_err(format!("client: {e}")))?;
        let base = format!("https://{}:{}", endpoint.server_name, port);
        let verifier = Verifier::new(endpoint.public_key, timeouts.max_skew_s);
        Ok(AgentClient {
            endpoint,
            base,
            http,
            timeouts,
            verifier,
            clock,
        })
    }

    /// The endpoint this client talks to.
    pub fn endpoint(&self) -> &AgentEndpoint {
        &self.endpoint
    }

    /// The verifier (pinned key + nonce ledger) this client uses.
    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// `GET /health` → the JSON body.
    ///
    /// # Errors
    /// Transport, status or decode errors.
    pub async fn health(&self) -> Result<Value, AgentClientError> {
        self.get("/health").await
    }

    /// `GET /v1/engines`.
    ///
    /// # Errors
    /// Transport, status or decode errors.
    pub async fn engines(&self) -> Result<EnginesAnswer, AgentClientError> {
        self.get("/v1/engines").await
    }

    /// `GET /v1/engines/{iid}/process` (unsigned; use an attestation when it must be proven).
    ///
    /// # Errors
    /// Transport, status or decode errors.
    pub async fn process(&self, iid: &str) -> Result<ProcessIdentity, AgentClientError> {
        self.get(&format!("/v1/engines/{iid}/process")).await
    }

    /// `GET /v1/engines/{iid}/kv/snapshot`: the engine's KV block set as the agent follows it
    /// (unsigned: a consumer holds its credit against the engine's own counts anyway).
    ///
    /// # Errors
    /// Transport, status (404: not followed; 409: no batch yet, or its process changed) or
    /// decode errors.
    pub async fn kv_snapshot(
        &self,
        iid: &str,
    ) -> Result<crate::agent_protocol::KvSnapshot, AgentClientError> {
        self.get(&format!("/v1/engines/{iid}/kv/snapshot")).await
    }

    /// `POST /v1/engines/{iid}/attestation`, verified; `expect_process` additionally requires
    /// the attested process to be that one.
    ///
    /// # Errors
    /// Transport, status, [`AgentClientError::StaleEpoch`] or [`AgentClientError::Verify`].
    pub async fn attestation(
        &self,
        iid: &str,
        fence: &Fence,
        expect_process: Option<&ProcessIdentity>,
    ) -> Result<Verified<AttestationPayload>, AgentClientError> {
        self.fenced(
            iid,
            "attestation",
            fence,
            |nonce| FencedRequest {
                nonce,
                epoch: fence.epoch,
                holder: fence.holder.clone(),
            },
            expect_process,
            self.timeouts.request_s,
        )
        .await
    }

    /// `POST /v1/engines/{iid}/checks/generation`, verified.
    ///
    /// # Errors
    /// As [`AgentClient::attestation`].
    pub async fn generation_check(
        &self,
        iid: &str,
        fence: &Fence,
        model: &str,
    ) -> Result<Verified<GenerationPayload>, AgentClientError> {
        self.fenced(
            iid,
            "checks/generation",
            fence,
            |nonce| ModelRequest {
                nonce,
                epoch: fence.epoch,
                holder: fence.holder.clone(),
                model: model.to_string(),
            },
            None,
            self.timeouts.check_s,
        )
        .await
    }

    /// `POST /v1/engines/{iid}/checks/kv/produce`, verified.
    ///
    /// # Errors
    /// As [`AgentClient::attestation`].
    pub async fn kv_produce(
        &self,
        iid: &str,
        fence: &Fence,
        model: &str,
        check_id: &str,
    ) -> Result<Verified<KvProducePayload>, AgentClientError> {
        self.fenced(
            iid,
            "checks/kv/produce",
            fence,
            |nonce| KvProduceRequest {
                nonce,
                epoch: fence.epoch,
                holder: fence.holder.clone(),
                model: model.to_string(),
                check_id: check_id.to_string(),
            },
            None,
            self.timeouts.check_s,
        )
        .await
    }

    /// `POST /v1/engines/{iid}/checks/kv/consume` with the producer's `kv` handle, verified.
    ///
    /// # Errors
    /// As [`AgentClient::attestation`].
    pub async fn kv_consume(
        &self,
        iid: &str,
        fence: &Fence,
        model: &str,
        check_id: &str,
        kv: Value,
    ) -> Result<Verified<KvConsumePayload>, AgentClientError> {
        self.fenced(
            iid,
            "checks/kv/consume",
            fence,
            |nonce| KvConsumeRequest {
                nonce,
                epoch: fence.epoch,
                holder: fence.holder.clone(),
                model: model.to_string(),
                check_id: check_id.to_string(),
                kv,
            },
            None,
            self.timeouts.check_s,
        )
        .await
    }

    /// `POST /v1/engines/{iid}/probe`, verified. `check_id` must be the produce half's id
    /// when `producer` is a handed-in KV handle.
    ///
    /// # Errors
    /// As [`AgentClient::attestation`].
    pub async fn probe(
        &self,
        iid: &str,
        fence: &Fence,
        model: &str,
        producer: Option<ProbeProducer>,
        check_id: Option<&str>,
    ) -> Result<Verified<ProbePayload>, AgentClientError> {
        self.fenced(
            iid,
            "probe",
            fence,
            |nonce| ProbeRequest {
                nonce,
                epoch: fence.epoch,
                holder: fence.holder.clone(),
                model: model.to_string(),
                producer,
                check_id: check_id.map(str::to_string),
            },
            None,
            self.timeouts.check_s,
        )
        .await
    }

    /// POSTs `body` to `path` and returns the raw signed document, unverified (for tests and
    /// tools that inspect what the agent said).
    ///
    /// # Errors
    /// Transport, status or decode errors.
    pub async fn post_raw<B: Serialize>(
        &self,
        path: &str,
        body: &B,
        epoch: u64,
    ) -> Result<SignedDocument, AgentClientError> {
        let req = self
            .http
            .post(format!("{}{}", self.base, path))
            .timeout(secs(self.timeouts.check_s))
            .json(body);
        self.send(path, req, Some(epoch)).await
    }

    /// POSTs the body `make(nonce)` (a fresh nonce) to `/v1/engines/{iid}/{route}` and
    /// verifies the signed answer: pinned key, schema, agent id, that nonce, `fence`, `iid`,
    /// freshness, and `expect_process` when given.
    async fn fenced<B: Serialize, P: SignedPayload>(
        &self,
        iid: &str,
        route: &str,
        fence: &Fence,
        make: impl FnOnce(String) -> B,
        expect_process: Option<&ProcessIdentity>,
        timeout_s: f64,
    ) -> Result<Verified<P>, AgentClientError> {
        let nonce = new_nonce();
        let body = make(nonce.clone());
        let path = format!("/v1/engines/{iid}/{route}");
        let req = self
            .http
            .post(format!("{}{path}", self.base))
            .timeout(secs(timeout_s))
            .json(&body);
        let document: SignedDocument = self.send(&path, req, Some(fence.epoch)).await?;
        let expected = Expected {
            agent_id: Some(&self.endpoint.agent_id),
            iid,
            nonce: &nonce,
            epoch: fence.epoch,
            holder: &fence.holder,
            process: expect_process,
        };
        let now = self.clock.wall()?;
        let payload = self
            .verifier
            .verify::<P>(&document, &expected, now)
            .map_err(|source| AgentClientError::Verify {
                agent_id: self.endpoint.agent_id.clone(),
                path,
                source,
            })?;
        Ok(Verified { payload, document })
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, AgentClientError> {
        let req = self
            .http
            .get(format!("{}{}", self.base, path))
            .timeout(secs(self.timeouts.request_s));
        self.send(path, req, None).await
    }

    async fn send<T: DeserializeOwned>(
        &self,
        path: &str,
        req: reqwest::RequestBuilder,
        epoch: Option<u64>,
    ) -> Result<T, AgentClientError> {
        let agent_id = &self.endpoint.agent_id;
        let transport = |source| AgentClientError::Transport {
            agent_id: agent_id.clone(),
            path: path.to_string(),
            source,
        };
        let resp = req.send().await.map_err(transport)?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(transport)?;
        if !status.is_success() {
            let (code, message, highest, rule) = match serde_json::from_slice::<ErrorBody>(&bytes) {
                Ok(b) => (
                    b.error.code,
                    b.error.message,
                    b.error.highest_epoch,
                    b.error.rule,
                ),
                Err(_) => (
                    "unknown".to_string(),
                    String::from_utf8_lossy(&bytes).chars().take(200).collect(),
                    None,
                    None,
                ),
            };
            if status.as_u16() == 403 {
                return Err(AgentClientError::Forbidden {
                    agent_id: agent_id.clone(),
                    path: path.to_string(),
                    rule: rule.unwrap_or_else(|| code.clone()),
                    message,
                });
            }
            if status.as_u16() == 409 && code == "stale_epoch" {
                return Err(AgentClientError::StaleEpoch {
                    agent_id: agent_id.clone(),
                    sent: epoch.unwrap_or(0),
                    highest,
                });
            }
            return Err(AgentClientError::Status {
                agent_id: agent_id.clone(),
                path: path.to_string(),
                status: status.as_u16(),
                code,
                message,
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| AgentClientError::Decode {
            agent_id: agent_id.clone(),
            path: path.to_string(),
            reason: e.to_string(),
        })
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(if s.is_finite() && s > 0.0 { s } else { 1.0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::signing::SigningKey;

    fn endpoint(url: &str) -> AgentEndpoint {
        let key = SigningKey::from_pkcs8(&SigningKey::generate_pkcs8().unwrap()).unwrap();
        AgentEndpoint {
            agent_id: "gpu-a".into(),
            url: url.into(),
            server_name: "agent-gpu-a".into(),
            public_key: key.public_key(),
        }
    }

    fn build(url: &str) -> Result<AgentClient, AgentClientError> {
        AgentClient::with_tls_config(
            endpoint(url),
            crate::tls::plain_http_client_config().unwrap(),
            AgentTimeouts::default(),
            Arc::new(SystemClock),
        )
    }

    #[test]
    fn plaintext_and_malformed_agent_urls_are_refused_naming_the_agent() {
        for url in ["http://127.0.0.1:8443", "not a url", "https://"] {
            match build(url) {
                Err(e @ AgentClientError::Url { .. }) => {
                    let text = e.to_string();
                    assert!(text.contains("gpu-a"), "{text}");
                }
                other => panic!("{url}: expected Url error, got {other:?}"),
            }
        }
    }

    #[test]
    fn requests_go_to_the_server_name_resolved_to_the_configured_address() {
        let c = build("https://127.0.0.1:8443").unwrap();
        assert_eq!(c.base, "https://agent-gpu-a:8443");
        let same = AgentClient::with_tls_config(
            AgentEndpoint {
                server_name: "localhost".into(),
                ..endpoint("https://localhost:9443/")
            },
            crate::tls::plain_http_client_config().unwrap(),
            AgentTimeouts::default(),
            Arc::new(SystemClock),
        )
        .unwrap();
        assert_eq!(same.base, "https://localhost:9443");
    }
}
