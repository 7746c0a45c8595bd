//! What one readmission check can find (seed "Readmitting engines"; reference-notes 4.8):
//! the typed failure of a check, and the three-valued evidence of a KV transfer.

/// How a KV transfer is known to have happened (or not), from the consumer's evidence
/// (reference-notes 4.8 step 5; issue 10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEvidence {
    /// The consuming engine recorded this transfer: its per-request record says the KV was
    /// received, or its counters moved (at least one consumed, none recomputed).
    Confirmed,
    /// The engine publishes no record: the decode succeeded with the handle, so a transfer
    /// is inferred, not seen. "No record" is never "failed".
    Inferred,
    /// The engine recorded a recompute or nothing consumed.
    Refuted,
}

impl KvEvidence {
    /// Reads the consumer's evidence. Counters that confirm win over a per-request record
    /// that says otherwise (as before the enum).
    pub fn of(t: &narwhal_shared::TransferEvidence) -> KvEvidence {
        let counters_confirm =
            t.consumed_delta.unwrap_or(0) >= 1 && t.recomputed_delta.unwrap_or(0) == 0;
        let recorded =
            t.transferred.is_some() || t.consumed_delta.is_some() || t.recomputed_delta.is_some();
        if t.transferred == Some(true) || counters_confirm {
            KvEvidence::Confirmed
        } else if recorded {
            KvEvidence::Refuted
        } else {
            KvEvidence::Inferred
        }
    }

    /// Whether the fabric check accepts this evidence today: only `Confirmed`. An inferred
    /// transfer is refused as it always was here; issue 10 ("real engines") flips this once
    /// the agents read the engines' own transfer counters, as `docs/agent.md` describes.
    pub fn accepted(self) -> bool {
        self == KvEvidence::Confirmed
    }
}

/// Why one check could not pass. Each names what failed; validation prefixes the check.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckError {
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
    #[error("{}", transfer_message(*.evidence, .origin))]
    Transfer {
        /// What the consumer's evidence says.
        evidence: KvEvidence,
        /// Where the agent read it (`sim_stats`, `none`, ...).
        origin: String,
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

fn transfer_message(evidence: KvEvidence, source: &str) -> String {
    match evidence {
        KvEvidence::Inferred => format!(
            "no KV transfer record ({source}): a transfer inferred from the decode is not accepted"
        ),
        KvEvidence::Refuted | KvEvidence::Confirmed => {
            format!("no KV transfer observed ({source}): the consumer recomputed the prefill")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evidence(
        transferred: Option<bool>,
        consumed: Option<i64>,
        recomputed: Option<i64>,
    ) -> narwhal_shared::TransferEvidence {
        narwhal_shared::TransferEvidence {
            source: "test".into(),
            consumed_delta: consumed,
            recomputed_delta: recomputed,
            engine_phase: None,
            transferred,
        }
    }

    /// "No record" is its own case, never read as a failed transfer (issue 8); today only a
    /// confirmed transfer passes the fabric check (issue 10 decides on inferred ones).
    #[test]
    fn transfer_evidence_is_three_valued() {
        let of = |t, c, r| KvEvidence::of(&evidence(t, c, r));
        assert_eq!(of(Some(true), None, None), KvEvidence::Confirmed);
        assert_eq!(of(None, Some(1), Some(0)), KvEvidence::Confirmed);
        assert_eq!(
            of(Some(false), Some(2), Some(0)),
            KvEvidence::Confirmed,
            "counters that confirm win"
        );
        assert_eq!(of(Some(false), None, None), KvEvidence::Refuted);
        assert_eq!(of(None, Some(1), Some(1)), KvEvidence::Refuted);
        assert_eq!(of(None, Some(0), Some(0)), KvEvidence::Refuted);
        assert_eq!(of(None, None, None), KvEvidence::Inferred);
        assert!(KvEvidence::Confirmed.accepted());
        assert!(!KvEvidence::Refuted.accepted());
        assert!(!KvEvidence::Inferred.accepted());
        let inferred = CheckError::Transfer {
            evidence: KvEvidence::Inferred,
            origin: "none".into(),
        }
        .to_string();
        assert!(!inferred.contains("recomputed"), "{inferred}");
        let refuted = CheckError::Transfer {
            evidence: KvEvidence::Refuted,
            origin: "sim_stats".into(),
        };
        assert_eq!(
            refuted.to_string(),
            "no KV transfer observed (sim_stats): the consumer recomputed the prefill"
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
