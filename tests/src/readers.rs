//! Typed readers of documents the tests read that have no type the kit can import: the
//! simulator's SGLang answers, what `narwhal-bench profile` measures, narwhalctl's `--json`
//! reports (narwhalctl's own types live in its binary), and OpenAI's exact `usage`. Each reads
//! the members the tests check.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use crate::parse_row;

/// SGLang's `GET /server_info` as the simulator answers it, the fields read here.
#[derive(Debug, Deserialize)]
pub struct ServerInfo {
    /// The launch argument.
    pub disaggregation_mode: String,
    /// The schedulers' live state.
    pub internal_states: Vec<SchedulerState>,
}

/// One entry of [`ServerInfo::internal_states`].
#[derive(Debug, Deserialize)]
pub struct SchedulerState {
    /// The live role (it differs from the launch argument after a switch).
    pub disaggregation_mode: String,
    /// Decode CUDA-graph memory (0 outside decode).
    pub decode_cuda_graph_memory_gb: f64,
}

impl ServerInfo {
    /// The first scheduler's live role.
    pub fn live_mode(&self) -> Option<&str> {
        self.internal_states
            .first()
            .map(|s| s.disaggregation_mode.as_str())
    }
}

/// SGLang's `POST /pd_role_switch` answer, the fields read here.
#[derive(Debug, Deserialize)]
pub struct RoleSwitchReply {
    /// The switch was made.
    pub success: Option<bool>,
    /// Why not, when it was not.
    pub message: Option<String>,
}

/// What `narwhal-bench profile` measured (a fleet file's profile), the costs checked here.
#[derive(Debug, Deserialize)]
pub struct MeasuredProfile {
    /// TTFT model: seconds per squared prompt token.
    pub ttft_a: f64,
    /// TTFT model: seconds per prompt token.
    pub ttft_b: f64,
    /// TTFT model: fixed seconds.
    pub ttft_c: f64,
    /// TPOT model: fixed seconds per token.
    pub tpot_intercept: f64,
    /// TPOT model: seconds per token per running request.
    pub tpot_request_slope: f64,
}

/// The document `narwhalctl --json wave-restart` prints (schema `narwhalctl.wave-restart`), the
/// fields these tests read (narwhalctl's own type is inside its binary).
#[derive(Debug, Deserialize)]
pub struct WaveReport {
    /// The wave finished.
    pub ok: bool,
    /// What happened to each engine.
    pub engines: Vec<EngineReport>,
    /// What stopped the wave, `None` on success.
    pub error: Option<String>,
    /// The exact command that continues the wave, `None` on success.
    pub next_command: Option<String>,
    /// The router's lifecycle document at the end, `None` if it could not be read.
    /// Read it with [`crate::whole`], so a missing member is not taken for its default.
    pub lifecycle: Option<Value>,
}

/// One engine of a [`WaveReport`].
#[derive(Debug, Deserialize)]
pub struct EngineReport {
    /// The engine id.
    pub iid: String,
    /// The restart command exited 0.
    pub restarted: bool,
    /// The readmission passed.
    pub readmitted: bool,
    /// Checks the router reported for it.
    pub checks: Vec<String>,
}

/// What `narwhalctl --json status` adds to the lifecycle document: the ejected engines with
/// their breaker causes.
#[derive(Debug, Deserialize)]
pub struct StatusReport {
    /// Per ejected engine.
    pub ejected: BTreeMap<String, Ejected>,
}

/// An ejected engine of a [`StatusReport`]: ejections per breaker cause.
#[derive(Debug, Deserialize)]
pub struct Ejected {
    /// Ejections per breaker cause.
    pub causes: BTreeMap<String, u64>,
}

/// An answer's `usage` with exactly OpenAI's three counts (wire shape: another key, such as
/// `estimated`, or a missing count refuses to parse).
#[derive(Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExactUsage {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
    /// Their sum.
    pub total_tokens: u64,
}

impl ExactUsage {
    /// The usage of answer `v`.
    pub fn of(v: &Value) -> ExactUsage {
        #[derive(Deserialize)]
        struct WithUsage {
            usage: ExactUsage,
        }
        parse_row::<WithUsage>(v).usage
    }

    /// `prompt` + `completion` = the total.
    pub fn new(prompt_tokens: u64, completion_tokens: u64) -> ExactUsage {
        ExactUsage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}
