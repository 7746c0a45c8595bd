//! The control-plane documents, each defined once: the router renders them (it serialises
//! these types), narwhalctl and the test kit parse them (they deserialise these types), so a
//! change to a document fails to compile in all three (architecture.md section 2). The handoff,
//! `narwhal.handoff`, is [`crate::handoff`].
//!
//! | Route | Type | Module |
//! |---|---|---|
//! | `GET /narwhal/state` | [`State`] (`narwhal.state` v1) | [`state`] |
//! | `GET /narwhal/lifecycle` | [`Lifecycle`] (`narwhal.lifecycle` v1) | [`lifecycle`] |
//! | `POST /narwhal/lifecycle/{drain,readmit,cancel-drain}` | [`LifecycleReply`] | [`replies`] |
//! | their request bodies | [`requests::DrainBody`], [`requests::ReadmitBody`] | [`requests`] |
//! | `GET /ready`, `GET /health` | [`Ready`], [`Health`] | [`ready`] |
//! | `GET /narwhal/targets` | [`targets::Targets`] | [`targets`] |
//! | the role controller's fields and decisions | [`ControllerReport`], [`Decision`] | [`controller`] |
//!
//! Serialisation keeps the bytes operators scrape: struct fields come in the order the router
//! has always written them, `null` stays `null` (`Option` without `skip_serializing_if`) and a
//! field that is absent when empty stays absent. Parsing is lenient: fields default when a
//! router one version apart omits them, and unknown fields are ignored. The router's golden
//! tests (`router/testdata/golden/`) pin the bytes.

pub mod controller;
pub mod lifecycle;
pub mod models;
mod ordered;
pub mod ready;
pub mod replies;
pub mod requests;
pub mod state;
pub mod targets;

use serde::{Deserialize, Serialize};

pub use controller::{ControllerFields, ControllerReport, Decision, DecisionEvent};
pub use lifecycle::{
    LIFECYCLE_SCHEMA, LIFECYCLE_VERSION, Lifecycle, LifecycleView, SelfDrainStatus,
};
pub use models::{ModelCard, ModelList};
pub use ordered::Ordered;
pub use ready::{Health, Ready};
pub use replies::{ErrorReply, LifecycleReply};
pub use state::{STATE_SCHEMA, STATE_VERSION, State};
pub use targets::{TargetGroup, Targets};

/// The schema envelope `{schema, schema_version}` of a versioned document: what a reader looks
/// at before it picks the type to parse a body as (`""` and 0 for a body without one).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Envelope {
    /// `narwhal.lifecycle`, `narwhal.state`, ...
    pub schema: String,
    /// Its version.
    pub schema_version: u32,
}

#[cfg(test)]
mod tests;
