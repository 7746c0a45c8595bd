//! `GET /narwhal/targets`: Prometheus HTTP service discovery, one target group per engine in
//! config order (behaviour.md 1.6).
//!
//! ```text
//!  [{targets: ["<host:port>"], labels: {iid, backend, __scheme__, __metrics_path__}}, ...]
//! ```

use serde::{Deserialize, Serialize};

/// The whole document: one group per configured engine, config order.
pub type Targets = Vec<TargetGroup>;

/// One engine's target group.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TargetGroup {
    /// `host:port` of the engine URL, userinfo removed (one entry).
    pub targets: Vec<String>,
    /// Its labels.
    pub labels: TargetLabels,
}

/// A target group's labels.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TargetLabels {
    /// The engine id.
    pub iid: String,
    /// `vllm` or `sglang`.
    pub backend: String,
    /// The URL scheme, `http` or `https` (`__scheme__`).
    #[serde(rename = "__scheme__")]
    pub scheme: String,
    /// The URL path without its trailing slash, then `/metrics` (`__metrics_path__`).
    #[serde(rename = "__metrics_path__")]
    pub metrics_path: String,
}
