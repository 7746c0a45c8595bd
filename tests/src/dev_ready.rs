//! The `narwhal-dev up` ready file (`narwhal.dev-fleet` version 1), typed: `narwhal-dev` writes
//! it with these types and [`crate::DevUp`] reads it back with them, so the writer and its
//! readers cannot disagree on a member's name.
//!
//! ```text
//!  {schema, schema_version, dir, dialect, certs, dev_control, dev_pid,
//!   router {data, control, pid, fleet, journal}, standby {data, control, pid, fleet} | null,
//!   engines [{iid, role, url, admin, pid, agent}], agents [{id, url, pid, public_key}]}
//! ```
//!
//! Fields serialise in that order; on parse every field defaults when absent.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `schema` of the ready file.
pub const DEV_FLEET_SCHEMA: &str = "narwhal.dev-fleet";

/// The ready file of a `narwhal-dev up` session: everything it started.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DevReady {
    /// Always [`DEV_FLEET_SCHEMA`].
    pub schema: String,
    /// Always 1.
    pub schema_version: u32,
    /// The session's directory (certificates, fleet file, logs, journal, state).
    pub dir: PathBuf,
    /// `vllm` or `sglang`.
    pub dialect: String,
    /// The directory of the dev certificates.
    pub certs: PathBuf,
    /// `http://127.0.0.1:PORT` of the session's restart endpoint (`""` until it serves).
    pub dev_control: String,
    /// The fleet process (the one that started every child).
    pub dev_pid: u32,
    /// The primary router.
    pub router: DevRouter,
    /// The warm standby router, with `--standby`; `null` without.
    pub standby: Option<DevRouter>,
    /// The simulated engines, in fleet order (prefill first).
    pub engines: Vec<DevEngine>,
    /// The agents, one per simulated host that serves an engine.
    pub agents: Vec<DevAgent>,
}

/// A router of [`DevReady`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DevRouter {
    /// Its data listener's URL.
    pub data: String,
    /// Its control listener's URL.
    pub control: String,
    /// Its process id.
    pub pid: u32,
    /// Its fleet file.
    pub fleet: PathBuf,
    /// Its journal (the primary's only; absent for the standby).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub journal: Option<PathBuf>,
}

/// An engine of [`DevReady`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DevEngine {
    /// Its instance id (`p0`, `d0`, ...).
    pub iid: String,
    /// `prefill` or `decode`.
    pub role: String,
    /// Its OpenAI listener's URL.
    pub url: String,
    /// Its admin listener's URL (the simulator's `/sim/*` hooks).
    pub admin: String,
    /// Its process id.
    pub pid: u32,
    /// The id of the agent that serves it.
    pub agent: String,
}

/// An agent of [`DevReady`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DevAgent {
    /// Its agent id (`host0`, ...).
    pub id: String,
    /// Its URL.
    pub url: String,
    /// Its process id.
    pub pid: u32,
    /// Its `ed25519:<base64>` signing key.
    pub public_key: String,
}

impl DevReady {
    /// Engine `iid`'s entry, if the session has it.
    pub fn engine(&self, iid: &str) -> Option<&DevEngine> {
        self.engines.iter().find(|e| e.iid == iid)
    }
}
