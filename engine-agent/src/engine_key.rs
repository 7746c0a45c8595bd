//! The engine's API key as the agent holds it: its own module, so that the configuration
//! (which reads it) and the engine plugins (which send it) both depend on it and not on each
//! other (the agent's modules form no import cycle: `router/src/layering.rs`).

/// An engine's API key (vLLM `--api-key`), sent as `Authorization: Bearer <key>` on every
/// agent call to the engine. Its `Debug` never shows it, so no log, error or document does.
#[derive(Clone, PartialEq, Eq)]
pub struct EngineKey(String);

impl EngineKey {
    /// Wraps a key (non-empty, no surrounding whitespace: config validation ensures it).
    pub fn new(key: impl Into<String>) -> Self {
        EngineKey(key.into())
    }

    /// Whether the key can be one bearer token: visible ASCII, no spaces.
    pub fn is_token(&self) -> bool {
        self.0.bytes().all(|b| (0x21..=0x7e).contains(&b))
    }

    /// The `Authorization` header value, `Bearer <key>`.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }
}

impl std::fmt::Debug for EngineKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineKey(<redacted>)")
    }
}
