//! The generic sidecar core: engines, identity, fencing, signing (architecture.md sections 3, 4).
//!
//! ```text
//!   request ─► fence.admit(epoch, holder) ─► identity before ─► plugin leg(s) ─► identity after
//!           ─► payload {header, result} ─► SigningKey::sign ─► SignedDocument
//! ```
//! A process change between the two identity reads fails the check (the result would speak
//! for two processes). Engine-level failures of a check are signed results with `ok: false`;
//! only fencing, unknown engines, unreadable identities and bad requests are HTTP errors.

use std::sync::Arc;
use std::time::Duration;

use narwhal_shared::agent_protocol::{
    EngineEntry, EnginesAnswer, FencedRequest, KvConsumeRequest, KvProduceRequest, ModelRequest,
    ProbeProducer, ProbeRequest,
};
use narwhal_shared::attestation::{
    SCHEMA_ATTESTATION, SCHEMA_GENERATION, SCHEMA_KV_CONSUME, SCHEMA_KV_PRODUCE, SCHEMA_PROBE,
    SCHEMA_VERSION,
};
use narwhal_shared::{
    AttestationPayload, Clock, GenerationPayload, Header, KvConsumePayload, KvProducePayload,
    LegResult, ProbePayload, ProcessIdentity, PublicKey, SignedDocument, SigningKey,
    TransferEvidence, TransferVerdict,
};
use serde::Serialize;
use serde_json::Value;

use crate::config::{Config, EngineConfig};
use crate::evidence::{EVIDENCE_POLL, EVIDENCE_SETTLE, TransferCounters, judge, no_transfer};
use crate::fence::{EpochStore, FenceError};
use crate::metrics::Metrics;
use crate::plugin::{EngineCtx, EngineError, EnginePlugin, plugin_for};
use crate::process::{
    PortRead, ProcessError, ProcessLocator, ReadPath, ResolvedOwner, SharedScan, locate,
    read_port_identity,
};

/// Errors a request can end in (mapped to HTTP in `http.rs`).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// No engine with this iid (404 `unknown_engine`).
    #[error("no engine with iid {iid:?} on this agent")]
    UnknownEngine {
        /// The iid asked for.
        iid: String,
    },
    /// Fenced off or fence not persisted (409 `stale_epoch` / `holder_conflict`, 500).
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// The engine's process could not be identified (503 `process_unavailable`).
    #[error("engine {iid}: process identity: {source}")]
    Process {
        /// Engine.
        iid: String,
        /// Why.
        source: ProcessError,
    },
    /// The engine did not answer a read the document needs (502 `engine_unavailable`).
    #[error("engine {iid}: {source}")]
    Engine {
        /// Engine.
        iid: String,
        /// Why.
        source: EngineError,
    },
    /// The request body is wrong (400 `bad_request`).
    #[error("request field {field}: {reason}")]
    BadRequest {
        /// Offending field.
        field: String,
        /// Why.
        reason: String,
    },
    /// Local failure (500 `internal`).
    #[error("internal: {0}")]
    Internal(String),
    /// No KV block snapshot of this engine (409 `kv_not_followed`): its KV events are not
    /// followed, no batch came yet, or its process changed since its stream started.
    #[error("engine {iid}: no KV block snapshot: {why}")]
    NotFollowed {
        /// Engine.
        iid: String,
        /// Why.
        why: String,
    },
}

struct Engine {
    cfg: EngineConfig,
    ctx: EngineCtx,
    plugin: Arc<dyn EnginePlugin>,
    /// The owner of the engine's listening socket found last time, re-checked (never trusted)
    /// by the next read.
    owner: std::sync::Mutex<Option<ResolvedOwner>>,
    /// The block set followed from its KV events (`kv_events` configured).
    kv: Option<Arc<std::sync::Mutex<crate::kv_follow::Follow>>>,
}

/// The agent: configured engines, key, fence and clock.
pub struct Agent {
    agent_id: String,
    engines: Vec<Engine>,
    key: SigningKey,
    fence: EpochStore,
    clock: Arc<dyn Clock>,
    metrics: Metrics,
    /// `/proc` with the host scans of concurrent identity reads shared.
    procs: Arc<SharedScan>,
    /// `("serving" | "ca", notAfter Unix seconds)` of the loaded TLS certificates.
    not_after: Vec<(&'static str, i64)>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("agent_id", &self.agent_id)
            .field(
                "engines",
                &self.engines.iter().map(|e| &e.cfg.iid).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A plain-HTTP client for loopback engine calls. reqwest is built without a default crypto
/// provider, so it gets an explicit ring config (unused for `http://` engines).
pub fn engine_http_client(connect_timeout: Duration) -> Result<reqwest::Client, String> {
    let tls = narwhal_shared::tls::plain_http_client_config().map_err(|e| e.to_string())?;
    reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .no_proxy()
        .connect_timeout(connect_timeout)
        .pool_max_idle_per_host(2)
        .build()
        .map_err(|e| e.to_string())
}

fn sign<P: Serialize>(key: &SigningKey, payload: &P) -> Result<SignedDocument, RequestError> {
    let value = serde_json::to_value(payload).map_err(|e| RequestError::Internal(e.to_string()))?;
    Ok(key.sign(value))
}

fn changed_during(
    before: &ProcessIdentity,
    after: &Result<ProcessIdentity, RequestError>,
) -> Option<String> {
    match after {
        Ok(a) if a.same_process(before) => None,
        Ok(a) => Some(format!(
            "engine process changed during the check (pid {} start_ticks {} → pid {} start_ticks {})",
            before.pid, before.start_ticks, a.pid, a.start_ticks
        )),
        Err(e) => Some(format!("engine process unavailable after the check: {e}")),
    }
}

fn taint(mut leg: LegResult, problem: Option<String>) -> LegResult {
    if let Some(p) = problem {
        leg.ok = false;
        leg.error = Some(match leg.error {
            Some(e) => format!("{p}; {e}"),
            None => p,
        });
    }
    leg
}

/// Fails a leg whose transfer was refuted although the decode itself succeeded (a failure
/// counter rose, or the consumer cannot receive KV), naming why.
fn refute(mut leg: LegResult, transfer: &TransferEvidence) -> LegResult {
    if transfer.verdict == Some(TransferVerdict::Refuted) && leg.ok {
        leg.ok = false;
        leg.error = Some(format!(
            "KV transfer refuted: {}",
            transfer.detail.as_deref().unwrap_or("no reason given")
        ));
    }
    leg
}

/// notAfter of the serving certificate and of the earliest-expiring CA certificate.
fn certificate_expiry(
    tls: &narwhal_shared::TlsFiles,
) -> Result<Vec<(&'static str, i64)>, crate::error::Error> {
    use narwhal_shared::tls::{load_certs, not_after_unix};
    let mut out = Vec::new();
    let bad = |field: &'static str, path: &std::path::Path, e: &dyn std::fmt::Display| {
        crate::error::Error::Tls(narwhal_shared::TlsError::Verifier {
            path: path.to_path_buf(),
            reason: format!("tls.{field}: {e}"),
        })
    };
    // CA first, then the certificate: the order server_config reads them in, so a missing
    // file is reported the same way.
    let mut ca_min: Option<i64> = None;
    for c in load_certs("ca", &tls.ca)? {
        let at = not_after_unix(&c).map_err(|e| bad("ca", &tls.ca, &e))?;
        ca_min = Some(ca_min.map_or(at, |m| m.min(at)));
    }
    if let Some(at) = ca_min {
        out.push(("ca", at));
    }
    let serving = load_certs("cert", &tls.cert)?;
    if let Some(leaf) = serving.first() {
        out.push((
            "serving",
            not_after_unix(leaf).map_err(|e| bad("cert", &tls.cert, &e))?,
        ));
    }
    Ok(out)
}

/// 16 random hex digits, to make engine request ids unique per leg.
fn short_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

impl Agent {
    /// Builds the agent from a validated config: loads the signing key (refusing loose
    /// permissions) and opens the fence under `state_dir`.
    ///
    /// # Errors
    /// [`crate::error::Error`] naming the config key.
    pub fn new(config: &Config, clock: Arc<dyn Clock>) -> Result<Agent, crate::error::Error> {
        let key = crate::keys::load(&config.signing_key)?;
        let fence = EpochStore::open(&config.state_dir)?;
        let http = engine_http_client(Duration::from_secs_f64(config.timeouts.engine_s))
            .map_err(crate::error::Error::HttpClient)?;
        let engines = config
            .engines
            .iter()
            .map(|cfg| Engine {
                ctx: EngineCtx {
                    http: http.clone(),
                    base: cfg.url.clone(),
                    read_timeout: Duration::from_secs_f64(config.timeouts.engine_s),
                    leg_timeout: Duration::from_secs_f64(config.timeouts.generation_s),
                    bootstrap_host: cfg.bootstrap_host.clone(),
                    clock: clock.clone(),
                    api_key: cfg.api_key.clone(),
                },
                plugin: plugin_for(cfg.dialect),
                owner: std::sync::Mutex::new(None),
                kv: cfg
                    .kv_events
                    .as_ref()
                    .map(|_| Arc::new(std::sync::Mutex::new(crate::kv_follow::Follow::new()))),
                cfg: cfg.clone(),
            })
            .collect();
        Ok(Agent {
            metrics: Metrics::new(&config.agent_id),
            not_after: certificate_expiry(&config.tls)?,
            agent_id: config.agent_id.clone(),
            engines,
            key,
            fence,
            clock,
            procs: Arc::new(SharedScan::default()),
        })
    }

    /// The agent's metrics (recorded by the HTTP layer too).
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The fence as persisted now.
    pub fn fence_state(&self) -> crate::fence::FenceState {
        self.fence.current()
    }

    /// `GET /metrics`: the text exposition, with the fence epoch and certificate expiry as of
    /// now.
    pub fn render_metrics(&self) -> String {
        let now = self.clock.wall().unwrap_or(0.0);
        self.metrics
            .render(self.fence.current().epoch, now, &self.not_after)
    }

    /// The agent id.
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// The public half of the signing key (`ed25519:<base64>`).
    pub fn public_key(&self) -> PublicKey {
        self.key.public_key()
    }

    /// Starts one follower per engine with `kv_events` (docs/agent.md, "KV block snapshots");
    /// they live as long as the runtime.
    pub fn follow_kv_events(self: &Arc<Self>) {
        for (i, e) in self.engines.iter().enumerate() {
            let (Some(cfg), Some(state)) = (e.cfg.kv_events.clone(), e.kv.clone()) else {
                continue;
            };
            let me = Arc::clone(self);
            let iid = e.cfg.iid.clone();
            let identity = move || {
                let me = Arc::clone(&me);
                async move { me.identity(&me.engines[i]).await.ok() }
            };
            tokio::spawn(crate::kv_follow::run(iid, cfg, state, identity));
        }
    }

    /// `GET /v1/engines/{iid}/kv/snapshot`: the engine's block set as its events told it, bound
    /// to the process that stored it.
    ///
    /// # Errors
    /// Unknown engine; the process read ([`RequestError::Process`]);
    /// [`RequestError::NotFollowed`] (no `kv_events`, no batch yet, or the engine's process
    /// changed since its stream started).
    pub async fn kv_snapshot(
        &self,
        iid: &str,
    ) -> Result<narwhal_shared::agent_protocol::KvSnapshot, RequestError> {
        use base64::Engine as _;
        let e = self.engine(iid)?;
        let not_followed = |why: &str| RequestError::NotFollowed {
            iid: iid.to_string(),
            why: why.to_string(),
        };
        let state = e.kv.as_ref().ok_or_else(|| {
            not_followed("the agent does not follow its KV events (engines[].kv_events)")
        })?;
        let now = self.identity(e).await?;
        let (snap, process, blocks) = {
            let f = state.lock().unwrap_or_else(|p| p.into_inner());
            let ts = self.clock.wall().unwrap_or(0.0);
            (f.set.snapshot(ts), f.process.clone(), f.set.len() as u64)
        };
        let snap = snap.ok_or_else(|| not_followed("no KV event batch came yet"))?;
        let process = process.ok_or_else(|| not_followed("its process was not read yet"))?;
        if !process.same_process(&now) {
            return Err(not_followed(
                "its process changed since its events were followed (the new process's stream starts the set again)",
            ));
        }
        Ok(narwhal_shared::agent_protocol::KvSnapshot {
            iid: iid.to_string(),
            process,
            next_seq: snap.next_seq,
            complete: snap.complete,
            blocks,
            batch: base64::engine::general_purpose::STANDARD
                .encode(narwhal_shared::kv_events::encode_batch(&snap.batch)),
        })
    }

    fn engine(&self, iid: &str) -> Result<&Engine, RequestError> {
        self.engines
            .iter()
            .find(|e| e.cfg.iid == iid)
            .ok_or_else(|| RequestError::UnknownEngine {
                iid: iid.to_string(),
            })
    }

    async fn identity(&self, engine: &Engine) -> Result<ProcessIdentity, RequestError> {
        let locator = engine.cfg.locator.clone();
        let iid = engine.cfg.iid.clone();
        let cached = engine.owner.lock().map(|g| *g).unwrap_or(None);
        let started = self.clock.now();
        let procs = Arc::clone(&self.procs);
        let read = tokio::task::spawn_blocking(move || match locator {
            ProcessLocator::ListenPort(port) => read_port_identity(&*procs, port, cached),
            other => PortRead {
                result: locate(&other),
                path: ReadPath::Direct,
                mismatch: None,
                owner: None,
            },
        })
        .await
        .map_err(|e| RequestError::Internal(format!("identity task: {e}")))?;
        self.metrics.identity_read(
            read.path.as_str(),
            read.result.is_ok(),
            (self.clock.now() - started).as_secs_f64(),
        );
        if let Some(m) = &read.mismatch {
            tracing::info!(engine.iid = %iid, reason = %m, "engine process changed or moved: rescanned");
        }
        if let Ok(mut g) = engine.owner.lock() {
            *g = read.owner;
        }
        read.result
            .map_err(|source| RequestError::Process { iid, source })
    }

    fn header(
        &self,
        schema: &str,
        iid: &str,
        nonce: &str,
        epoch: u64,
        holder: &str,
        process: ProcessIdentity,
    ) -> Result<Header, RequestError> {
        let issued_at = self
            .clock
            .wall()
            .map_err(|e| RequestError::Internal(e.to_string()))?;
        Ok(Header {
            schema: schema.to_string(),
            schema_version: SCHEMA_VERSION,
            agent_id: self.agent_id.clone(),
            iid: iid.to_string(),
            nonce: nonce.to_string(),
            epoch,
            holder: holder.to_string(),
            issued_at,
            process,
        })
    }

    fn check_model(model: &str) -> Result<(), RequestError> {
        if model.trim().is_empty() {
            return Err(RequestError::BadRequest {
                field: "model".into(),
                reason: "must not be empty".into(),
            });
        }
        Ok(())
    }

    /// `GET /v1/engines`. The engines' identities are read concurrently.
    pub async fn engines(&self) -> EnginesAnswer {
        let reads = futures_util::future::join_all(self.engines.iter().map(|e| self.identity(e)));
        let engines = self
            .engines
            .iter()
            .zip(reads.await)
            .map(|(e, read)| {
                let (process, error) = match read {
                    Ok(p) => (Some(p), None),
                    Err(err) => (None, Some(err.to_string())),
                };
                EngineEntry {
                    iid: e.cfg.iid.clone(),
                    url: e.cfg.url.clone(),
                    dialect: e.cfg.dialect.as_str().to_string(),
                    process,
                    error,
                }
            })
            .collect();
        EnginesAnswer {
            agent_id: self.agent_id.clone(),
            engines,
        }
    }

    /// `GET /v1/engines/{iid}/process`.
    ///
    /// # Errors
    /// [`RequestError::UnknownEngine`] or [`RequestError::Process`].
    pub async fn process(&self, iid: &str) -> Result<ProcessIdentity, RequestError> {
        let e = self.engine(iid)?;
        self.identity(e).await
    }

    /// `POST /v1/engines/{iid}/attestation`: identity, engine facts, contract, signed.
    ///
    /// # Errors
    /// Fence, unknown engine, process, or engine read errors.
    #[tracing::instrument(name = "attestation", skip_all, fields(engine.iid = %iid, fence.epoch = req.epoch))]
    pub async fn attestation(
        &self,
        iid: &str,
        req: FencedRequest,
    ) -> Result<SignedDocument, RequestError> {
        let e = self.engine(iid)?;
        self.fence.admit(req.epoch, &req.holder)?;
        let before = self.identity(e).await?;
        let facts = e
            .plugin
            .facts(&e.ctx)
            .await
            .map_err(|source| RequestError::Engine {
                iid: iid.to_string(),
                source,
            })?;
        let after = self.identity(e).await?;
        if !after.same_process(&before) {
            return Err(RequestError::Process {
                iid: iid.to_string(),
                source: ProcessError::ChangedDuringRead {
                    pid: after.pid,
                    before: before.start_ticks,
                    after: after.start_ticks,
                },
            });
        }
        let payload = AttestationPayload {
            header: self.header(
                SCHEMA_ATTESTATION,
                iid,
                &req.nonce,
                req.epoch,
                &req.holder,
                after,
            )?,
            engine: facts,
            contract: e.cfg.contract.as_ref().map(|c| c.contract.clone()),
            launch_digest: e
                .cfg
                .contract
                .as_ref()
                .and_then(|c| c.launch_digest.clone()),
        };
        sign(&self.key, &payload)
    }

    /// `POST /v1/engines/{iid}/checks/generation`.
    ///
    /// # Errors
    /// Fence, unknown engine, process or bad-request errors.
    #[tracing::instrument(name = "generation_check", skip_all, fields(engine.iid = %iid, fence.epoch = req.epoch))]
    pub async fn generation(
        &self,
        iid: &str,
        req: ModelRequest,
    ) -> Result<SignedDocument, RequestError> {
        let e = self.engine(iid)?;
        Self::check_model(&req.model)?;
        self.fence.admit(req.epoch, &req.holder)?;
        let before = self.identity(e).await?;
        let leg = e.plugin.generate(&e.ctx, &req.model).await;
        let after = self.identity(e).await;
        let result = taint(leg, changed_during(&before, &after));
        tracing::info!(ok = result.ok, tokens = result.tokens, error = ?result.error, "generation check");
        let payload = GenerationPayload {
            header: self.header(
                SCHEMA_GENERATION,
                iid,
                &req.nonce,
                req.epoch,
                &req.holder,
                before,
            )?,
            model: req.model,
            result,
        };
        sign(&self.key, &payload)
    }

    /// `POST /v1/engines/{iid}/checks/kv/produce`.
    ///
    /// # Errors
    /// Fence, unknown engine, process or bad-request errors.
    #[tracing::instrument(name = "kv_produce", skip_all, fields(engine.iid = %iid, check.id = %req.check_id))]
    pub async fn kv_produce(
        &self,
        iid: &str,
        req: KvProduceRequest,
    ) -> Result<SignedDocument, RequestError> {
        let e = self.engine(iid)?;
        Self::check_model(&req.model)?;
        self.fence.admit(req.epoch, &req.holder)?;
        let before = self.identity(e).await?;
        let (leg, kv) = e.plugin.produce(&e.ctx, &req.model, &req.check_id).await;
        let after = self.identity(e).await;
        let problem = changed_during(&before, &after);
        let kv = if problem.is_some() { None } else { kv };
        let result = taint(leg, problem);
        tracing::info!(ok = result.ok, error = ?result.error, "kv produce");
        let payload = KvProducePayload {
            header: self.header(
                SCHEMA_KV_PRODUCE,
                iid,
                &req.nonce,
                req.epoch,
                &req.holder,
                before,
            )?,
            model: req.model,
            check_id: req.check_id,
            result,
            kv,
        };
        sign(&self.key, &payload)
    }

    /// The decode leg on `e` with `kv` (`None`: a local decode) and the transfer evidence read
    /// from the engine's own surfaces around it (crate::evidence).
    async fn consume_with_evidence(
        &self,
        e: &Engine,
        model: &str,
        check_id: &str,
        kv: Option<&Value>,
    ) -> (LegResult, TransferEvidence) {
        let request_id = format!("narwhal-check-{check_id}-{}-decode", short_id());
        let before = match kv {
            Some(_) => e.plugin.transfer_counters(&e.ctx).await,
            None => None,
        };
        let leg = e
            .plugin
            .consume(&e.ctx, model, check_id, kv, &request_id)
            .await;
        if kv.is_none() {
            return (leg, no_transfer("local decode: no KV transfer attempted"));
        }
        let after = self.settled_counters(e, before.as_ref(), leg.ok).await;
        let j = judge(&leg, before.as_ref(), after.as_ref(), EVIDENCE_SETTLE);
        tracing::info!(verdict = %j.verdict, source = j.source, detail = %j.detail,
            "kv transfer evidence");
        let transfer = j.evidence();
        (refute(leg, &transfer), transfer)
    }

    /// Reads the engine's transfer counters after a decode leg. After a successful leg with a
    /// baseline that publishes counters, re-reads every [`EVIDENCE_POLL`] until one moves or
    /// [`EVIDENCE_SETTLE`] passes (the engine may record a transfer shortly after the stream).
    async fn settled_counters(
        &self,
        e: &Engine,
        before: Option<&TransferCounters>,
        leg_ok: bool,
    ) -> Option<TransferCounters> {
        let started = self.clock.now();
        loop {
            let now = e.plugin.transfer_counters(&e.ctx).await;
            let waiting = leg_ok
                && matches!((before, &now), (Some(b), Some(a))
                    if b.published() && a.published() && !a.moved_since(b)
                        && a.cannot_receive.is_none());
            let elapsed = self.clock.now().duration_since(started);
            if !waiting || elapsed >= EVIDENCE_SETTLE {
                return now;
            }
            tokio::time::sleep(EVIDENCE_POLL.min(EVIDENCE_SETTLE - elapsed)).await;
        }
    }

    /// `POST /v1/engines/{iid}/checks/kv/consume`.
    ///
    /// # Errors
    /// Fence, unknown engine, process or bad-request errors.
    #[tracing::instrument(name = "kv_consume", skip_all, fields(engine.iid = %iid, check.id = %req.check_id))]
    pub async fn kv_consume(
        &self,
        iid: &str,
        req: KvConsumeRequest,
    ) -> Result<SignedDocument, RequestError> {
        let e = self.engine(iid)?;
        Self::check_model(&req.model)?;
        if !req.kv.is_object() {
            return Err(RequestError::BadRequest {
                field: "kv".into(),
                reason: "must be the producer's descriptor or rendezvous object".into(),
            });
        }
        self.fence.admit(req.epoch, &req.holder)?;
        let before = self.identity(e).await?;
        let (leg, transfer) = self
            .consume_with_evidence(e, &req.model, &req.check_id, Some(&req.kv))
            .await;
        let after = self.identity(e).await;
        let result = taint(leg, changed_during(&before, &after));
        tracing::info!(ok = result.ok, tokens = result.tokens, verdict = ?transfer.verdict,
            error = ?result.error, "kv consume");
        let payload = KvConsumePayload {
            header: self.header(
                SCHEMA_KV_CONSUME,
                iid,
                &req.nonce,
                req.epoch,
                &req.holder,
                before,
            )?,
            model: req.model,
            check_id: req.check_id,
            result,
            transfer,
        };
        sign(&self.key, &payload)
    }

    /// `POST /v1/engines/{iid}/probe`: standalone (both legs on the suspect: a prefill leg,
    /// then a local streamed decode), from a local producer iid, or from a handed-in KV handle.
    ///
    /// # Errors
    /// Fence, unknown engine (suspect or producer), process or bad-request errors.
    #[tracing::instrument(name = "probe", skip_all, fields(engine.iid = %iid, fence.epoch = req.epoch))]
    pub async fn probe(
        &self,
        iid: &str,
        req: ProbeRequest,
    ) -> Result<SignedDocument, RequestError> {
        let e = self.engine(iid)?;
        Self::check_model(&req.model)?;
        if let Some(ProbeProducer::Iid(p)) = &req.producer {
            self.engine(p)?;
        }
        self.fence.admit(req.epoch, &req.holder)?;
        let before = self.identity(e).await?;
        if matches!(req.producer, Some(ProbeProducer::Kv(_))) && req.check_id.is_none() {
            return Err(RequestError::BadRequest {
                field: "check_id".into(),
                reason: "required with producer.kv (the prompt the KV was produced for)".into(),
            });
        }
        let check_id = req
            .check_id
            .clone()
            .unwrap_or_else(|| format!("probe-{}", req.nonce));
        let (mode, produce, kv) = match &req.producer {
            None if e.plugin.standalone_prefill() => {
                let (leg, _kv) = e.plugin.produce(&e.ctx, &req.model, &check_id).await;
                // Same engine: the decode reuses its own prefix cache, no descriptor
                // (behaviour.md 7.1 step 6).
                ("standalone", Some(leg), None)
            }
            None => ("standalone", None, None),
            Some(ProbeProducer::Iid(p)) => {
                let pe = self.engine(p)?;
                let (leg, kv) = pe.plugin.produce(&pe.ctx, &req.model, &check_id).await;
                ("from_producer", Some(leg), kv)
            }
            Some(ProbeProducer::Kv(kv)) => ("from_producer", None, Some(kv.clone())),
        };
        let produce_ok = produce.as_ref().is_none_or(|l| l.ok);
        let needs_kv = req.producer.is_some();
        let (consume, transfer) = if !produce_ok || (needs_kv && kv.is_none()) {
            (
                crate::plugin::failed(0.0, "not run: the producer leg failed".into()),
                no_transfer("the decode did not run: the producer leg failed"),
            )
        } else {
            self.consume_with_evidence(e, &req.model, &check_id, kv.as_ref())
                .await
        };
        let after = self.identity(e).await;
        let consume = taint(consume, changed_during(&before, &after));
        let ok = produce_ok && consume.ok && transfer.verdict.is_none_or(TransferVerdict::accepted);
        tracing::info!(ok, mode, error = ?consume.error, "probe");
        let payload = ProbePayload {
            header: self.header(
                SCHEMA_PROBE,
                iid,
                &req.nonce,
                req.epoch,
                &req.holder,
                before,
            )?,
            model: req.model,
            mode: mode.to_string(),
            produce,
            consume,
            transfer,
            ok,
        };
        sign(&self.key, &payload)
    }
}
