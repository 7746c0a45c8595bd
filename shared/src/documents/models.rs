//! `GET /v1/models` and `GET /v1/models/{model}`: OpenAI's model list and card, as the router
//! answers them (behaviour.md 1.5).
//!
//! ```text
//!  {object: "list", data: [{id, object: "model", created, owned_by, parent?}, ...]}
//! ```

use serde::{Deserialize, Serialize};

/// The model list: the served model, then each adapter.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ModelList {
    /// `"list"`.
    pub object: String,
    /// The cards.
    pub data: Vec<ModelCard>,
}

/// One model: `created` is the answer's time (Unix seconds), as vLLM gives it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ModelCard {
    /// The name a request's `model` gives.
    pub id: String,
    /// `"model"`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// `"narwhal"`.
    pub owned_by: String,
    /// For an adapter: its base model (vLLM's adapter card names it); absent for the base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}
