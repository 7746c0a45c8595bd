//! The agent registry: one mutual-TLS client per distinct engine agent, indexed by engine
//! (architecture.md section 4), and what an agent's error means for this router's control.

use std::collections::BTreeMap;
use std::sync::Arc;

use narwhal_shared::{
    AgentClient, AgentClientError, AgentEndpoint, AgentTimeouts, Clock, KeyError,
};

use crate::config::Config;
use crate::ha_phase::{EpochScope, Ha};

/// Why the agent clients could not be built (`Agents::from_config`); each names the key.
#[derive(Debug, thiserror::Error)]
pub enum AgentsError {
    /// An engine has an agent but the fleet file has no `tls` section.
    #[error("tls: required by engines[].agent (mutual TLS to the agents)")]
    NoTls,
    /// `engines[index].agent.public_key` is not an `ed25519:<base64>` key.
    #[error("engines[{index}].agent.public_key: {source}")]
    PublicKey {
        /// The engine.
        index: usize,
        /// What is wrong with the key.
        source: KeyError,
    },
    /// The client of `engines[index].agent` could not be built (TLS files, URL).
    #[error("engines[{index}].agent: {source}")]
    Client {
        /// The engine.
        index: usize,
        /// The client's error (boxed: it is large).
        source: Box<AgentClientError>,
    },
}

/// The mTLS clients of the engines' agents, one per distinct agent, indexed by engine.
pub(crate) struct Agents {
    per_engine: Vec<Option<Arc<AgentClient>>>,
    /// The transfer evidence of each engine's latest KV consume check (engine index → the
    /// agent's signed `transfer` object), shown in `/narwhal/state.kv_evidence`.
    kv_evidence: std::sync::Mutex<BTreeMap<usize, narwhal_shared::TransferEvidence>>,
}

impl Agents {
    /// No agents (fleets without `engines[].agent`, and unit tests).
    #[cfg(test)]
    pub(crate) fn none(engines: usize) -> Agents {
        Agents {
            per_engine: vec![None; engines],
            kv_evidence: Default::default(),
        }
    }

    /// Builds one client per distinct agent of the fleet file (engines on one host share it).
    ///
    /// # Errors
    /// [`AgentsError`] naming the offending key (`tls`, `engines[0].agent.public_key`,
    /// `engines[0].agent: tls.cert ...`).
    pub(crate) fn from_config(cfg: &Config, clock: Arc<dyn Clock>) -> Result<Agents, AgentsError> {
        let mut per_engine = Vec::with_capacity(cfg.engines.len());
        let mut built: BTreeMap<(String, String), Arc<AgentClient>> = BTreeMap::new();
        let timeouts = AgentTimeouts {
            connect_s: cfg.agent.timeout_s.min(5.0),
            request_s: cfg.agent.timeout_s,
            check_s: cfg.agent.timeout_s.max(30.0),
            max_skew_s: cfg.agent.max_skew_s,
        };
        for (i, e) in cfg.engines.iter().enumerate() {
            let Some(a) = &e.agent else {
                per_engine.push(None);
                continue;
            };
            let key = (a.url.clone(), a.server_name.clone());
            if let Some(c) = built.get(&key) {
                per_engine.push(Some(c.clone()));
                continue;
            }
            let tls = cfg.tls.as_ref().ok_or(AgentsError::NoTls)?;
            let public_key = narwhal_shared::PublicKey::parse(&a.public_key)
                .map_err(|source| AgentsError::PublicKey { index: i, source })?;
            let endpoint = AgentEndpoint {
                agent_id: a.agent_id.clone(),
                url: a.url.clone(),
                server_name: a.server_name.clone(),
                public_key,
            };
            let files = narwhal_shared::TlsFiles {
                ca: tls.ca.clone(),
                cert: tls.cert.clone(),
                key: tls.key.clone(),
            };
            let client =
                AgentClient::new(endpoint, &files, timeouts, clock.clone()).map_err(|e| {
                    AgentsError::Client {
                        index: i,
                        source: Box::new(e),
                    }
                })?;
            let client = Arc::new(client);
            built.insert(key, client.clone());
            per_engine.push(Some(client));
        }
        Ok(Agents {
            per_engine,
            kv_evidence: Default::default(),
        })
    }

    /// Records the transfer evidence of engine `i`'s latest KV consume check.
    pub(crate) fn record_kv_evidence(&self, i: usize, evidence: narwhal_shared::TransferEvidence) {
        self.kv_evidence
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(i, evidence);
    }

    /// The latest KV consume evidence per engine index.
    pub(crate) fn kv_evidence(&self) -> BTreeMap<usize, narwhal_shared::TransferEvidence> {
        self.kv_evidence
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The agent of engine `i`, if it has one.
    pub(crate) fn get(&self, i: usize) -> Option<&Arc<AgentClient>> {
        self.per_engine.get(i).and_then(Option::as_ref)
    }

    /// True when engine `i` has an agent.
    pub(crate) fn has(&self, i: usize) -> bool {
        self.get(i).is_some()
    }

    /// True when every engine has an agent.
    pub(crate) fn all(&self) -> bool {
        self.per_engine.iter().all(Option::is_some)
    }

    /// True when some engine has an agent.
    pub(crate) fn any(&self) -> bool {
        self.per_engine.iter().any(Option::is_some)
    }
}

/// An agent's error to a call made under epoch `epoch`, as one line. An agent that saw a
/// newer epoch than the one held now proves another router took over: this one fences itself
/// at once and stops renewing (architecture.md section 3, fencing reaches the hosts), with the
/// cause as its `/ready` reason ([`stale_epoch_reason`]). A late `stale_epoch` answer to a call of
/// an epoch that already ended fences nothing (ha-and-fencing.md: such answers fenced a router that
/// had just claimed the next epoch).
pub(crate) fn agent_error(ha: &Ha, epoch: u64, e: AgentClientError) -> String {
    if let AgentClientError::StaleEpoch {
        agent_id,
        sent,
        highest,
    } = &e
        && ha.stale_answer(epoch)
    {
        ha.fence_because(stale_epoch_reason(
            agent_id,
            *sent,
            *highest,
            ha.lease().enabled(),
        ));
    }
    e.to_string()
}

/// Why work of `scope` may not call an agent now, if it may not: control under its epoch
/// ended (a fence, a lapse, the standby loop). Checked before every agent call of lifecycle
/// work, so work started under one epoch never reaches an agent after that epoch ended, nor
/// under a later one (ha-and-fencing.md).
pub(crate) fn ended(ha: &Ha, scope: &EpochScope) -> Option<String> {
    (!ha.live(scope)).then(|| {
        format!(
            "router control under epoch {} ended; the work started under it stopped",
            scope.epoch()
        )
    })
}

/// The `/ready` reason of a router fenced by an agent's `409 stale_epoch`: which agent, the epoch
/// it accepted, the one this router presented, and what to do. Without a lease (`lease.backend`
/// `none`, epoch 0) the usual cause is an agent that served an HA pair before: its fence is reset
/// with `narwhal-agent fence reset` (docs/operate.md).
pub(crate) fn stale_epoch_reason(
    agent_id: &str,
    sent: u64,
    highest: Option<u64>,
    lease: bool,
) -> String {
    let accepted = highest.map_or_else(|| "a newer epoch".to_string(), |h| format!("epoch {h}"));
    if lease {
        format!(
            "fenced by agent {agent_id}: it accepted router {accepted}, newer than this router's epoch {sent}: another router took over"
        )
    } else {
        format!(
            "fenced by agent {agent_id}: it accepted router {accepted} and this router, with lease.backend none, presents epoch {sent}; if no other router controls the fleet, reset the agents' fence (narwhal-agent fence reset, docs/operate.md) and restart this router"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_epoch_reason_names_the_agent_the_epochs_and_the_remedy() {
        let none = stale_epoch_reason("gpu-a", 0, Some(3), false);
        for part in [
            "agent gpu-a",
            "epoch 3",
            "epoch 0",
            "lease.backend none",
            "fence reset",
        ] {
            assert!(none.contains(part), "{part}: {none}");
        }
        let leased = stale_epoch_reason("gpu-b", 4, None, true);
        assert!(
            leased.contains("agent gpu-b") && leased.contains("a newer epoch"),
            "{leased}"
        );
        assert!(leased.contains("another router took over"), "{leased}");
    }
}
