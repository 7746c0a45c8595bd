//! The agent's startup error: its own module, so that the modules that raise it do not import
//! the crate root that starts them (the agent's modules form no import cycle:
//! `router/src/layering.rs`).

use crate::config::ConfigError;
use crate::fence::FenceError;
use crate::keys::KeyFileError;

/// Startup errors; each names the config key at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The config file is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The signing key is missing, unreadable, too open or not a key.
    #[error(transparent)]
    Key(#[from] KeyFileError),
    /// TLS material (config key `tls.*`) is unusable.
    #[error(transparent)]
    Tls(#[from] narwhal_shared::TlsError),
    /// `state_dir` or its fence file is unusable.
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// The engine HTTP client could not be built.
    #[error("engine http client: {0}")]
    HttpClient(String),
    /// Binding or serving failed.
    #[error("listen {addr}: {source}")]
    Listen {
        /// Address.
        addr: String,
        /// I/O error.
        source: std::io::Error,
    },
}
