//! Agent config files through the agent's validator (`narwhal_agent::Config::parse`).

use narwhal_agent::{Config, ConfigError};

/// Checks one config file's text.
///
/// # Panics
/// When a refusal names no key.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = Config::parse(text) {
        names_a_key(&e);
    }
}

fn names_a_key(e: &ConfigError) {
    match e {
        ConfigError::Json { key, .. } | ConfigError::Field { key, .. } => {
            // serde_path_to_error writes the root as "."; a refusal must say what it names.
            assert!(
                !key.is_empty() && key != ".",
                "a refusal without a key: {e:?}"
            );
        }
        ConfigError::Many(all) => {
            assert!(!all.is_empty(), "an empty list of refusals");
            all.iter().for_each(names_a_key);
        }
        ConfigError::Read { .. } => panic!("parse read a file: {e:?}"),
    }
    assert!(!e.to_string().is_empty());
}
