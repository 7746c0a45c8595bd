//! What one readmission check can find (handoff-and-lifecycle.md, "Readmitting engines";
//! behaviour.md 4.8): the typed failure of a check, and the three-valued evidence of a KV transfer.

/// How a KV transfer is known to have happened (or not), as the consuming engine's agent
/// judged it from the engine's own counters and the decode leg: `Confirmed` (a transfer counter
/// moved), `Inferred` (the engine publishes no counters; the decode with the handle succeeded
/// with tokens) or `Refuted` (a failure counter moved, or the decode failed). Shared with the
/// agent (`narwhal_shared::agent_protocol::TransferVerdict`); read through
/// [`narwhal_shared::TransferEvidence::judged`], which also reads older agents' two-valued
/// `transferred`. "No record" is never "failed": `Inferred` passes the fabric check
/// (docs/agent.md, "Transfer evidence").
pub(crate) use narwhal_shared::agent_protocol::TransferVerdict as KvEvidence;

/// Why one check could not pass. Each names what failed; validation prefixes the check.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum CheckError {
    /// The engine id is not in the fleet file.
    #[error("{iid} is not configured")]
    Unconfigured {
        /// The engine id.
        iid: String,
    },
    /// The engine has no `engines[].agent`.
    #[error("no agent configured for this engine (engines[].agent)")]
    NoAgent,
    /// `GET <engine>/health` answered another status.
    #[error("HTTP {status}")]
    HealthStatus {
        /// The status.
        status: u16,
    },
    /// The engine did not answer (connect error, timeout): the client's message.
    #[error("{0}")]
    Unreachable(String),
    /// The agent call failed (transport, refusal, a signature or freshness failure): the
    /// agent client's message.
    #[error("{detail}")]
    Agent {
        /// The agent client's error, rendered.
        detail: String,
    },
    /// The process identity could not be read through the agent.
    #[error("process identity unreadable: {0}")]
    IdentityUnreadable(Box<CheckError>),
    /// The direct generation failed or produced nothing.
    #[error("{}", .error.as_deref().unwrap_or("no tokens generated"))]
    Generation {
        /// The engine's error, if it gave one.
        error: Option<String>,
    },
    /// The producer half of a KV check failed.
    #[error("{}", .error.as_deref().unwrap_or("prefill failed"))]
    Produce {
        /// The engine's error, if it gave one.
        error: Option<String>,
    },
    /// The producer answered without a KV descriptor or rendezvous.
    #[error("the producer returned no KV descriptor or rendezvous")]
    NoKvHandle,
    /// The consumer half of a KV check failed.
    #[error("{}", .error.as_deref().unwrap_or("decode failed"))]
    Consume {
        /// The engine's error, if it gave one.
        error: Option<String>,
    },
    /// The consumer decoded nothing after the transfer.
    #[error("no tokens decoded after the transfer")]
    NoTokensDecoded,
    /// The transfer evidence is not accepted ([`KvEvidence::accepted`]).
    #[error("{}", transfer_message(*.evidence, .origin, .detail.as_deref()))]
    Transfer {
        /// What the consumer's evidence says.
        evidence: KvEvidence,
        /// Where the agent read it (`vllm_nixl_metrics`, `sglang_disaggregation_metrics`,
        /// `none`).
        origin: String,
        /// The agent's reason (the counter that moved, or what was missing).
        detail: Option<String>,
    },
    /// A verification probe failed.
    #[error("{}", .error.clone().unwrap_or_else(|| format!("probe failed ({})", .origin)))]
    Probe {
        /// The failing leg's error, if any.
        error: Option<String>,
        /// Where the agent read the transfer evidence.
        origin: String,
    },
}

fn transfer_message(evidence: KvEvidence, source: &str, detail: Option<&str>) -> String {
    let why = detail.unwrap_or("the consumer did not receive the producer's KV");
    format!("KV transfer {evidence} ({source}): {why}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evidence(
        transferred: Option<bool>,
        verdict: Option<KvEvidence>,
    ) -> narwhal_shared::TransferEvidence {
        narwhal_shared::TransferEvidence {
            source: "test".into(),
            consumed_delta: None,
            recomputed_delta: None,
            engine_phase: None,
            transferred,
            verdict,
            failed_delta: None,
            detail: None,
        }
    }

    fn leg(ok: bool, tokens: u64) -> narwhal_shared::attestation::LegResult {
        narwhal_shared::attestation::LegResult {
            ok,
            tokens,
            latency_s: 0.01,
            error: None,
        }
    }

    /// "No record" is its own case, never read as a failed transfer (docs/agent.md): an
    /// inferred transfer passes the fabric check, a refuted one does not, and an older agent's
    /// two-valued `transferred` is read the same way.
    #[test]
    fn transfer_evidence_is_three_valued_and_inferred_passes() {
        let judged = |t, v, ok, n| evidence(t, v).judged(&leg(ok, n));
        assert_eq!(
            judged(None, Some(KvEvidence::Confirmed), true, 3),
            KvEvidence::Confirmed
        );
        assert_eq!(judged(Some(true), None, true, 3), KvEvidence::Confirmed);
        assert_eq!(judged(Some(false), None, true, 3), KvEvidence::Refuted);
        assert_eq!(judged(None, None, true, 3), KvEvidence::Inferred);
        assert_eq!(judged(None, None, false, 0), KvEvidence::Refuted);
        assert!(KvEvidence::Confirmed.accepted());
        assert!(KvEvidence::Inferred.accepted());
        assert!(!KvEvidence::Refuted.accepted());
        let refuted = CheckError::Transfer {
            evidence: KvEvidence::Refuted,
            origin: "vllm_nixl_metrics".into(),
            detail: Some("vllm:nixl_num_failed_transfers_total rose by 1".into()),
        };
        assert_eq!(
            refuted.to_string(),
            "KV transfer refuted (vllm_nixl_metrics): vllm:nixl_num_failed_transfers_total rose by 1"
        );
    }

    /// Check errors keep the one-line messages operators and tests read.
    #[test]
    fn check_errors_name_what_failed() {
        let unreadable = CheckError::IdentityUnreadable(Box::new(CheckError::NoAgent));
        assert_eq!(
            unreadable.to_string(),
            "process identity unreadable: no agent configured for this engine (engines[].agent)"
        );
        assert_eq!(
            CheckError::HealthStatus { status: 503 }.to_string(),
            "HTTP 503"
        );
        assert_eq!(
            CheckError::Generation { error: None }.to_string(),
            "no tokens generated"
        );
        assert_eq!(
            CheckError::Consume {
                error: Some("bad handle".into())
            }
            .to_string(),
            "bad handle"
        );
        assert_eq!(
            CheckError::Probe {
                error: None,
                origin: "sim_stats".into()
            }
            .to_string(),
            "probe failed (sim_stats)"
        );
    }
}
