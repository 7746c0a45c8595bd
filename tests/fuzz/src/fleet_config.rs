//! Fleet files through the router's validator (`Config::from_json_str`).

use narwhal_router::config::{Config, ConfigIssue, ParseError};

/// Checks one fleet file's text (invalid UTF-8 is refused before parsing, as `Config::load`
/// does when it reads the file). `${VAR}` references resolve to a fixed value.
///
/// # Panics
/// When a schema refusal lists no issue, or an issue names no key.
pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let env = |k: &str| (k == "FUZZ_HOST").then(|| "127.0.0.1".to_string());
    match Config::from_json_str(text, &env) {
        Ok(_) | Err(ParseError::Json(_)) => {}
        Err(ParseError::Invalid(issues)) => {
            assert!(!issues.is_empty(), "refused without an issue");
            for issue in &issues {
                let path = match issue {
                    ConfigIssue::UnknownKey { path }
                    | ConfigIssue::Missing { path }
                    | ConfigIssue::Type { path, .. }
                    | ConfigIssue::Rule { path, .. } => path.as_str(),
                    ConfigIssue::DuplicateIid { .. } => "engines",
                    ConfigIssue::NoEngines => "engines",
                    ConfigIssue::BackendMismatch { .. } => "backend",
                };
                assert!(!path.is_empty(), "an issue without a key: {issue:?}");
                assert!(!issue.to_string().is_empty());
            }
        }
    }
}
