//! The readmission checks as the router runs them: `/health` through the engine client,
//! everything else through the engine's agent, signed and verified (handoff-and-lifecycle.md,
//! "Readmitting engines"; architecture.md section 4 and 9.7). [`validation`](super::validation)
//! sequences them.

use std::sync::Arc;

use http::StatusCode;
use narwhal_shared::{AgentClient, Fence, ProcessIdentity};
use serde_json::Value;

use super::agents::{Agents, agent_error, ended};
use super::check_error::CheckError;
use super::validation::{Attested, Checks, Identity};
use crate::config::{Config, secs};
use crate::ha_phase::{EpochScope, Ha};
use crate::upstream::Upstream;

/// [`Checks`] through the router's engine client (health) and the agents (everything signed),
/// all under the epoch the validation began in (its [`EpochScope`]): every check first makes
/// sure control under that epoch has not ended (ha-and-fencing.md).
pub(crate) struct AgentChecks<'a> {
    pub(crate) cfg: &'a Config,
    pub(crate) agents: &'a Agents,
    pub(crate) ha: &'a Ha,
    pub(crate) upstream: &'a Upstream,
    pub(crate) scope: &'a EpochScope,
    pub(crate) fence: Fence,
}

/// The identity a signed answer speaks for.
pub(crate) fn identity(p: &ProcessIdentity) -> Identity {
    Identity {
        key: format!("{}:{}:{}", p.boot_id, p.pid, p.start_ticks),
        start: p.process_start_time_seconds,
    }
}

impl AgentChecks<'_> {
    fn index(&self, iid: &str) -> Result<usize, CheckError> {
        if let Some(detail) = ended(self.ha, self.scope) {
            return Err(CheckError::Agent { detail });
        }
        self.cfg
            .engines
            .iter()
            .position(|e| e.iid == iid)
            .ok_or_else(|| CheckError::Unconfigured {
                iid: iid.to_string(),
            })
    }

    fn agent(&self, iid: &str) -> Result<Arc<AgentClient>, CheckError> {
        let i = self.index(iid)?;
        self.agents.get(i).cloned().ok_or(CheckError::NoAgent)
    }

    fn agent_failed(&self, e: narwhal_shared::AgentClientError) -> CheckError {
        CheckError::Agent {
            detail: agent_error(self.ha, self.fence.epoch, e),
        }
    }
}

impl Checks for AgentChecks<'_> {
    async fn health(&self, iid: &str) -> Result<(), CheckError> {
        let i = self.index(iid)?;
        let url = format!("{}/health", self.cfg.engines[i].url);
        match self
            .upstream
            .get(&url, secs(self.cfg.engine.health_timeout_s))
            .await
        {
            Ok((StatusCode::OK, _)) => Ok(()),
            Ok((s, _)) => Err(CheckError::HealthStatus { status: s.as_u16() }),
            Err(e) => Err(CheckError::Unreachable(e.to_string())),
        }
    }

    async fn attest(&self, iid: &str) -> Result<Attested, CheckError> {
        let a = self.agent(iid)?;
        let v = a
            .attestation(iid, &self.fence, None)
            .await
            .map_err(|e| self.agent_failed(e))?;
        Ok(Attested {
            identity: identity(&v.payload.header.process),
            models: v.payload.engine.models.clone(),
            fingerprint: v.document.key_id.clone(),
        })
    }

    async fn generation(&self, iid: &str) -> Result<Identity, CheckError> {
        let a = self.agent(iid)?;
        let v = a
            .generation_check(iid, &self.fence, &self.cfg.model)
            .await
            .map_err(|e| self.agent_failed(e))?;
        let r = &v.payload.result;
        if !r.ok || r.tokens == 0 {
            return Err(CheckError::Generation {
                error: r.error.clone(),
            });
        }
        Ok(identity(&v.payload.header.process))
    }

    async fn kv_produce(&self, iid: &str, check_id: &str) -> Result<(Value, Identity), CheckError> {
        let a = self.agent(iid)?;
        let v = a
            .kv_produce(iid, &self.fence, &self.cfg.model, check_id)
            .await
            .map_err(|e| self.agent_failed(e))?;
        let p = &v.payload;
        if !p.result.ok {
            return Err(CheckError::Produce {
                error: p.result.error.clone(),
            });
        }
        let kv = p.kv.clone().ok_or(CheckError::NoKvHandle)?;
        Ok((kv, identity(&p.header.process)))
    }

    async fn kv_consume(
        &self,
        iid: &str,
        check_id: &str,
        kv: Value,
    ) -> Result<Identity, CheckError> {
        let a = self.agent(iid)?;
        let v = a
            .kv_consume(iid, &self.fence, &self.cfg.model, check_id, kv)
            .await
            .map_err(|e| self.agent_failed(e))?;
        let p = &v.payload;
        self.agents
            .record_kv_evidence(self.index(iid)?, p.transfer.clone());
        if !p.result.ok {
            return Err(CheckError::Consume {
                error: p.result.error.clone(),
            });
        }
        if p.result.tokens == 0 {
            return Err(CheckError::NoTokensDecoded);
        }
        let evidence = p.transfer.judged(&p.result);
        if !evidence.accepted() {
            return Err(CheckError::Transfer {
                evidence,
                origin: p.transfer.source.clone(),
                detail: p.transfer.detail.clone(),
            });
        }
        Ok(identity(&p.header.process))
    }

    async fn probe(
        &self,
        iid: &str,
        check_id: &str,
        kv: Option<Value>,
    ) -> Result<Identity, CheckError> {
        let a = self.agent(iid)?;
        let producer = kv.map(narwhal_shared::agent_protocol::ProbeProducer::Kv);
        let v = a
            .probe(iid, &self.fence, &self.cfg.model, producer, Some(check_id))
            .await
            .map_err(|e| self.agent_failed(e))?;
        let p = &v.payload;
        if !p.ok {
            return Err(CheckError::Probe {
                error: p
                    .consume
                    .error
                    .clone()
                    .or_else(|| p.produce.as_ref().and_then(|l| l.error.clone())),
                origin: p.transfer.source.clone(),
            });
        }
        Ok(identity(&p.header.process))
    }
}
