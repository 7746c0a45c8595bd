//! Fault injection queue (`POST/GET/DELETE /sim/faults`), sans IO.
//!
//! ```text
//!  JSON fault(s) ──parse_faults──► FaultQueue::push ──take(phase)──► Action for one request
//! ```
//!
//! A fault applies to the next `count` requests whose phase matches; the first matching fault in
//! queue order wins, and it leaves the queue when its count reaches zero. `"any"` matches the
//! three request phases but never `/health` (health faults are always explicit).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Phase of a request as the fault queue and `/sim/stats` see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Phase {
    /// vLLM `do_remote_decode`, or an SGLang prefill-mode request with bootstrap fields.
    Prefill,
    /// vLLM `do_remote_prefill`, or an SGLang decode-mode request with bootstrap fields.
    Decode,
    /// Everything else: computed locally end to end.
    Aggregated,
    /// Only in faults: matches prefill, decode and aggregated.
    Any,
    /// Only in faults: `GET /health`.
    Health,
    /// Only in faults: SGLang's `POST /pd_role_switch` (`status` answers with the given
    /// body, e.g. `{"success": false, "message": ...}`; `hang` delays the switch).
    #[serde(rename = "role_switch")]
    RoleSwitch,
}

impl Phase {
    /// The lowercase wire name.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::Aggregated => "aggregated",
            Phase::Any => "any",
            Phase::Health => "health",
            Phase::RoleSwitch => "role_switch",
        }
    }
}

/// The wire form of one fault, as posted and as listed (with `count` = remaining uses).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FaultSpec {
    /// Which requests it applies to.
    pub(crate) phase: Phase,
    /// How many matching requests it applies to (default 1, at least 1).
    #[serde(default = "one")]
    pub(crate) count: u32,
    /// How many matching requests pass untouched before the fault applies (default 0). While
    /// skipping, the fault still matches first in queue order: a skipped request gets no fault
    /// at all, not a later one. The listing shows the skips remaining.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) skip: u32,
    /// `status`, `hang`, `cut`, `drop`, `omit_kv`, `fragment` or `fail_transfer`.
    pub(crate) action: String,
    /// For `status`: the HTTP status to answer (100..=599).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) status: Option<u16>,
    /// For `status`: the JSON body to answer (default: an OpenAI-style error naming the fault).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) body: Option<Value>,
    /// For `hang`: milliseconds before the first byte (health: absent = never answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ms: Option<u64>,
    /// For `cut`: token chunks sent before the connection is dropped (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) after_tokens: Option<u32>,
    /// For `fragment`: size in bytes of each separately flushed body write (at least 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) bytes: Option<usize>,
    /// For `fail_transfer`: what the decode does after the failed transfer, as vLLM's
    /// `kv_load_failure_policy`: `fail` (default; the request fails) or `recompute` (the prompt
    /// is recomputed and the request succeeds; vLLM only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) policy: Option<String>,
}

fn one() -> u32 {
    1
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What a matched fault makes the simulator do to one request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Answer `status` with `body` instead of serving.
    Status {
        /// HTTP status code.
        status: u16,
        /// JSON body, or `None` for the default error body.
        body: Option<Value>,
    },
    /// Wait before the first byte (`None` = until the client gives up), then serve normally.
    Hang {
        /// Milliseconds to wait.
        ms: Option<u64>,
    },
    /// Stream `after_tokens` token chunks, then drop the connection (no `[DONE]`, no error
    /// frame). Non-streaming requests are dropped without a response.
    Cut {
        /// Token chunks to send first.
        after_tokens: u32,
    },
    /// Close the connection without any response.
    Drop,
    /// Prefill answers 200 without a KV descriptor and publishes no KV.
    OmitKv,
    /// The request is served and its blocks stored, but no KV event is published for it
    /// (nothing sent, nothing buffered for replay, the sequence does not advance): an engine
    /// whose event stream stalled (`--kv-events-config`).
    MuteKvEvents,
    /// Write the response body in `bytes`-sized writes, each flushed separately.
    Fragment {
        /// Bytes per write.
        bytes: usize,
    },
    /// The decode's KV transfer fails (counted as a failed transfer in `kv.rejected` and the
    /// engine's failure metric); then the request fails, or with `recompute` is served from a
    /// local prefill.
    FailTransfer {
        /// vLLM `kv_load_failure_policy: "recompute"`.
        recompute: bool,
    },
}

impl Action {
    /// The wire name of the action.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Action::Status { .. } => "status",
            Action::Hang { .. } => "hang",
            Action::Cut { .. } => "cut",
            Action::Drop => "drop",
            Action::OmitKv => "omit_kv",
            Action::MuteKvEvents => "mute_kv_events",
            Action::Fragment { .. } => "fragment",
            Action::FailTransfer { .. } => "fail_transfer",
        }
    }
}

/// Why a posted fault was refused (answered 400). Messages name the field and value.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FaultError {
    /// Not a JSON object or array of objects of the fault shape.
    #[error("invalid fault JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Unknown `action`.
    #[error(
        "fault action {0:?} is not one of status, hang, cut, drop, omit_kv, mute_kv_events, \
         fragment, fail_transfer"
    )]
    UnknownAction(String),
    /// A required field is missing for this action.
    #[error("fault action {action:?} requires field {field:?}")]
    Missing {
        /// The action.
        action: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// A field value is out of range.
    #[error("fault field {field:?} = {value} is out of range ({expected})")]
    Range {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// The action cannot apply to the phase.
    #[error("fault action {action:?} does not apply to phase {phase:?}")]
    PhaseAction {
        /// The action.
        action: &'static str,
        /// The phase.
        phase: &'static str,
    },
}

/// Validates one spec into its action.
pub(crate) fn validate(spec: &FaultSpec) -> Result<Action, FaultError> {
    if spec.count == 0 {
        return Err(FaultError::Range {
            field: "count",
            value: "0".into(),
            expected: ">= 1",
        });
    }
    let action = match spec.action.as_str() {
        "status" => {
            let status = spec.status.ok_or(FaultError::Missing {
                action: "status",
                field: "status",
            })?;
            if !(100..=599).contains(&status) {
                return Err(FaultError::Range {
                    field: "status",
                    value: status.to_string(),
                    expected: "100..=599",
                });
            }
            Action::Status {
                status,
                body: spec.body.clone(),
            }
        }
        "hang" => {
            if spec.ms.is_none() && !matches!(spec.phase, Phase::Health | Phase::RoleSwitch) {
                return Err(FaultError::Missing {
                    action: "hang",
                    field: "ms",
                });
            }
            Action::Hang { ms: spec.ms }
        }
        "cut" => Action::Cut {
            after_tokens: spec.after_tokens.unwrap_or(0),
        },
        "drop" => Action::Drop,
        "omit_kv" => Action::OmitKv,
        "mute_kv_events" => Action::MuteKvEvents,
        "fragment" => {
            let bytes = spec.bytes.ok_or(FaultError::Missing {
                action: "fragment",
                field: "bytes",
            })?;
            if bytes == 0 {
                return Err(FaultError::Range {
                    field: "bytes",
                    value: "0".into(),
                    expected: ">= 1",
                });
            }
            Action::Fragment { bytes }
        }
        "fail_transfer" => match spec.policy.as_deref() {
            None | Some("fail") => Action::FailTransfer { recompute: false },
            Some("recompute") => Action::FailTransfer { recompute: true },
            Some(other) => {
                return Err(FaultError::Range {
                    field: "policy",
                    value: format!("{other:?}"),
                    expected: "\"fail\" or \"recompute\"",
                });
            }
        },
        other => return Err(FaultError::UnknownAction(other.to_string())),
    };
    if spec.policy.is_some() && !matches!(action, Action::FailTransfer { .. }) {
        return Err(FaultError::Range {
            field: "policy",
            value: format!("{:?}", spec.policy),
            expected: "only with action fail_transfer",
        });
    }
    let phase_ok = match (spec.phase, &action) {
        (_, Action::FailTransfer { .. }) => spec.phase == Phase::Decode,
        (Phase::Health | Phase::RoleSwitch, a) => {
            matches!(a, Action::Status { .. } | Action::Hang { .. })
        }
        (Phase::Decode | Phase::Aggregated, a) => !matches!(a, Action::OmitKv),
        (Phase::Prefill | Phase::Any, _) => true,
    };
    if !phase_ok {
        return Err(FaultError::PhaseAction {
            action: action.name(),
            phase: spec.phase.as_str(),
        });
    }
    Ok(action)
}

/// Parses a posted body: one fault object or an array of them. All are validated before any is
/// accepted.
pub(crate) fn parse_faults(body: &[u8]) -> Result<Vec<(FaultSpec, Action)>, FaultError> {
    let v: Value = serde_json::from_slice(body)?;
    let specs: Vec<FaultSpec> = match v {
        Value::Array(_) => serde_json::from_value(v)?,
        other => vec![serde_json::from_value(other)?],
    };
    specs
        .into_iter()
        .map(|s| validate(&s).map(|a| (s, a)))
        .collect()
}

/// Ordered queue of pending faults.
#[derive(Default)]
pub(crate) struct FaultQueue {
    items: Vec<(FaultSpec, Action)>,
}

impl FaultQueue {
    /// Appends validated faults at the end.
    pub(crate) fn push(&mut self, faults: impl IntoIterator<Item = (FaultSpec, Action)>) {
        self.items.extend(faults);
    }

    /// Removes every fault.
    pub(crate) fn clear(&mut self) {
        self.items.clear();
    }

    /// `true` when no fault is pending.
    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The pending faults with their remaining counts.
    pub(crate) fn list(&self) -> Vec<FaultSpec> {
        self.items.iter().map(|(s, _)| s.clone()).collect()
    }

    /// Takes one use of the first fault matching a request of `phase` (`prefill`, `decode`,
    /// `aggregated` or `health`).
    pub(crate) fn take(&mut self, phase: Phase) -> Option<Action> {
        let idx = self.items.iter().position(|(s, _)| {
            s.phase == phase
                || (s.phase == Phase::Any && !matches!(phase, Phase::Health | Phase::RoleSwitch))
        })?;
        let (spec, action) = &mut self.items[idx];
        if spec.skip > 0 {
            spec.skip -= 1;
            return None;
        }
        let action = action.clone();
        spec.count -= 1;
        if spec.count == 0 {
            self.items.remove(idx);
        }
        Some(action)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(json: &str) -> FaultQueue {
        let mut q = FaultQueue::default();
        q.push(parse_faults(json.as_bytes()).expect("valid faults"));
        q
    }

    #[test]
    fn fault_applies_to_count_matching_requests_then_leaves() {
        let mut q = q(r#"{"phase":"decode","count":2,"action":"status","status":503}"#);
        assert_eq!(q.take(Phase::Prefill), None);
        assert_eq!(q.take(Phase::Aggregated), None);
        let a = q.take(Phase::Decode);
        assert_eq!(
            a,
            Some(Action::Status {
                status: 503,
                body: None
            })
        );
        assert_eq!(q.list()[0].count, 1, "listing shows the remaining count");
        assert!(q.take(Phase::Decode).is_some());
        assert_eq!(q.take(Phase::Decode), None);
        assert!(q.is_empty());
    }

    #[test]
    fn any_matches_request_phases_but_not_health_and_order_wins() {
        let mut q = q(r#"[{"phase":"any","action":"drop"},
                         {"phase":"prefill","action":"omit_kv"},
                         {"phase":"health","action":"status","status":500}]"#);
        assert_eq!(q.take(Phase::Prefill), Some(Action::Drop));
        assert_eq!(q.take(Phase::Prefill), Some(Action::OmitKv));
        assert_eq!(
            q.take(Phase::Health),
            Some(Action::Status {
                status: 500,
                body: None
            })
        );
        assert!(q.is_empty());
    }

    #[test]
    fn mute_kv_events_applies_to_request_phases_only() {
        let mut q = q(r#"{"phase":"aggregated","action":"mute_kv_events","count":2}"#);
        assert_eq!(q.take(Phase::Aggregated), Some(Action::MuteKvEvents));
        assert_eq!(q.take(Phase::Aggregated), Some(Action::MuteKvEvents));
        assert!(q.is_empty());
        assert!(
            parse_faults(br#"{"phase":"health","action":"mute_kv_events"}"#)
                .unwrap_err()
                .to_string()
                .contains("mute_kv_events")
        );
    }

    #[test]
    fn invalid_faults_are_refused_naming_the_field() {
        let err = |s: &str| parse_faults(s.as_bytes()).unwrap_err().to_string();
        assert!(err(r#"{"phase":"decode","action":"status"}"#).contains("\"status\""));
        assert!(err(r#"{"phase":"decode","action":"explode"}"#).contains("explode"));
        assert!(err(r#"{"phase":"decode","action":"hang"}"#).contains("\"ms\""));
        assert!(err(r#"{"phase":"decode","action":"fragment","bytes":0}"#).contains("bytes"));
        assert!(err(r#"{"phase":"health","action":"cut"}"#).contains("health"));
        assert!(err(r#"{"phase":"decode","action":"omit_kv"}"#).contains("omit_kv"));
        assert!(err(r#"{"phase":"decode","action":"drop","count":0}"#).contains("count"));
        assert!(err(r#"{"phase":"nope","action":"drop"}"#).contains("invalid fault JSON"));
        assert!(err(r#"{"phase":"decode","action":"drop","extra":1}"#).contains("extra"));
        assert!(err(r#"{"phase":"any","action":"fail_transfer"}"#).contains("fail_transfer"));
        assert!(
            err(r#"{"phase":"decode","action":"fail_transfer","policy":"retry"}"#)
                .contains("policy")
        );
        assert!(err(r#"{"phase":"decode","action":"drop","policy":"fail"}"#).contains("policy"));
        // One bad fault in a list refuses the whole list.
        assert!(parse_faults(br#"[{"phase":"decode","action":"drop"},{"phase":"x"}]"#).is_err());
    }

    #[test]
    fn skip_lets_the_first_matching_requests_pass() {
        let mut q = q(
            r#"[{"phase":"health","action":"status","status":503,"skip":2},
                         {"phase":"health","action":"status","status":500}]"#,
        );
        assert_eq!(
            q.take(Phase::Prefill),
            None,
            "other phases do not consume skips"
        );
        assert_eq!(q.take(Phase::Health), None);
        assert_eq!(q.list()[0].skip, 1, "listing shows the skips remaining");
        assert_eq!(
            q.take(Phase::Health),
            None,
            "a skipped request gets no later fault"
        );
        assert_eq!(
            q.take(Phase::Health),
            Some(Action::Status {
                status: 503,
                body: None
            })
        );
        assert_eq!(
            q.take(Phase::Health),
            Some(Action::Status {
                status: 500,
                body: None
            })
        );
        assert!(q.is_empty());
    }

    #[test]
    fn fail_transfer_defaults_to_fail_and_takes_recompute() {
        let mut q = q(r#"[{"phase":"decode","action":"fail_transfer"},
                         {"phase":"decode","action":"fail_transfer","policy":"recompute"}]"#);
        assert_eq!(q.take(Phase::Prefill), None);
        assert_eq!(
            q.take(Phase::Decode),
            Some(Action::FailTransfer { recompute: false })
        );
        assert_eq!(
            q.take(Phase::Decode),
            Some(Action::FailTransfer { recompute: true })
        );
    }

    #[test]
    fn health_hang_without_ms_means_forever() {
        let mut q = q(r#"{"phase":"health","action":"hang"}"#);
        assert_eq!(q.take(Phase::Health), Some(Action::Hang { ms: None }));
    }
}
