//! What the router learns about an engine's process from the engine's own routes, and when
//! two readings name different processes (an engine restarted in place).
//!
//! ```text
//!  GET /metrics      ──parse_process_start──► process_start   (vLLM: prometheus_client's
//!                                                              process collector)
//!  GET /v1/models    ──parse_models─────────► models          (every OpenAI server)
//!  GET /server_info  ──parse_bootstrap_port─► bootstrap_port  (SGLang prefill servers)
//!         Facts (old) .differs(Facts (new)) ──► Some(reason) = a new process
//! ```
//!
//! Pure: parsing and comparison only; `bootstrap.rs` reads the routes, `Fleet` keeps the
//! facts of the current process. What real engines expose (read in their sources):
//! - vLLM serves `process_start_time_seconds` on `/metrics` from prometheus_client's default
//!   registry (the API server process); with several API servers it switches to the
//!   multiprocess registry, which has no process families, so the start may be missing.
//!   `/v1/models` `created` is the time of the request (pydantic default factory), not a
//!   process identity. `remote_engine_id` in a prefill's `kv_transfer_params` changes with
//!   the process unless configured, but a data-parallel engine reports one id per rank, so a
//!   new id only asks for a fresh reading ([`Facts`] decides).
//! - SGLang's `/server_info` (`/get_server_info`) returns its server arguments, including
//!   `disaggregation_bootstrap_port`; its `/metrics` uses the multiprocess registry (no
//!   process start). A restarted prefill server may come back on another bootstrap port.
//! - llama.cpp and other OpenAI servers: `/v1/models` only.

use std::collections::BTreeSet;

use serde_json::Value;

/// Facts about one engine process; `None` = not published (or not read yet).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Facts {
    /// `process_start_time_seconds` (Unix seconds) from `/metrics`.
    pub(crate) process_start: Option<f64>,
    /// Model ids listed by `GET /v1/models`.
    pub(crate) models: Option<BTreeSet<String>>,
    /// SGLang `disaggregation_bootstrap_port` from `/server_info`.
    pub(crate) bootstrap_port: Option<u16>,
}

impl Facts {
    /// Why `newer` names another process than `self`: the first fact known in both that
    /// differs (a process start more than 1 ms apart, another model set, another bootstrap
    /// port); `None` when nothing known differs.
    pub(crate) fn differs(&self, newer: &Facts) -> Option<String> {
        if let (Some(a), Some(b)) = (self.process_start, newer.process_start)
            && (a - b).abs() > 1e-3
        {
            return Some(format!("process start {a} -> {b}"));
        }
        if let (Some(a), Some(b)) = (&self.models, &newer.models)
            && a != b
        {
            return Some(format!(
                "served models {} -> {}",
                join(a.iter()),
                join(b.iter())
            ));
        }
        if let (Some(a), Some(b)) = (self.bootstrap_port, newer.bootstrap_port)
            && a != b
        {
            return Some(format!("bootstrap port {a} -> {b}"));
        }
        None
    }

    /// Takes every fact `newer` knows (a reading refreshes what was known).
    pub(crate) fn merge(&mut self, newer: Facts) {
        if newer.process_start.is_some() {
            self.process_start = newer.process_start;
        }
        if newer.models.is_some() {
            self.models = newer.models;
        }
        if newer.bootstrap_port.is_some() {
            self.bootstrap_port = newer.bootstrap_port;
        }
    }
}

fn join<'a>(it: impl Iterator<Item = &'a String>) -> String {
    let v: Vec<&str> = it.map(String::as_str).collect();
    format!("[{}]", v.join(","))
}

/// The value of the first `process_start_time_seconds` sample (with or without labels) of a
/// Prometheus text exposition, if finite and > 0.
pub(crate) fn parse_process_start(text: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let rest = l.strip_prefix("process_start_time_seconds")?;
            let value = if let Some(r) = rest.strip_prefix('{') {
                r.split_once('}')?.1
            } else if rest.starts_with([' ', '\t']) {
                rest
            } else {
                return None;
            };
            value.split_whitespace().next()?.parse::<f64>().ok()
        })
        .filter(|v| v.is_finite() && *v > 0.0)
}

/// The model ids of an OpenAI `GET /v1/models` answer (`data[].id`).
pub(crate) fn parse_models(v: &Value) -> Option<BTreeSet<String>> {
    let ids: BTreeSet<String> = v
        .get("data")?
        .as_array()?
        .iter()
        .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string))
        .collect();
    (!ids.is_empty()).then_some(ids)
}

/// SGLang `/server_info` `disaggregation_bootstrap_port`: a number, or a string holding one.
pub(crate) fn parse_bootstrap_port(v: &Value) -> Option<u16> {
    v.get("disaggregation_bootstrap_port")
        .and_then(|p| {
            p.as_u64()
                .or_else(|| p.as_str().and_then(|s| s.parse().ok()))
        })
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn process_start_is_read_from_the_metrics_text() {
        let text = "# HELP process_start_time_seconds Start time\n\
                    # TYPE process_start_time_seconds gauge\n\
                    process_start_time_seconds_other 5\n\
                    process_start_time_seconds 1.76446123456e+09\n";
        assert_eq!(parse_process_start(text), Some(1.76446123456e9));
        assert_eq!(
            parse_process_start("process_start_time_seconds{pid=\"7\"} 12.5\n"),
            Some(12.5)
        );
        assert_eq!(parse_process_start("vllm:num_requests_running 1\n"), None);
        assert_eq!(
            parse_process_start("process_start_time_seconds NaN\n"),
            None
        );
    }

    #[test]
    fn models_and_bootstrap_ports_are_read_from_json() {
        let m = parse_models(&json!({"data": [{"id": "a"}, {"id": "b"}]})).unwrap();
        assert_eq!(m, BTreeSet::from(["a".to_string(), "b".to_string()]));
        assert_eq!(parse_models(&json!({"data": []})), None);
        assert_eq!(
            parse_bootstrap_port(&json!({"disaggregation_bootstrap_port": 8998})),
            Some(8998)
        );
        assert_eq!(
            parse_bootstrap_port(&json!({"disaggregation_bootstrap_port": "8999"})),
            Some(8999)
        );
        assert_eq!(
            parse_bootstrap_port(&json!({"disaggregation_bootstrap_port": null})),
            None
        );
    }

    /// Only facts known on both sides decide; any known difference names a new process.
    #[test]
    fn a_known_difference_names_a_new_process() {
        let old = Facts {
            process_start: Some(100.0),
            models: Some(BTreeSet::from(["m".to_string()])),
            bootstrap_port: Some(8998),
        };
        assert_eq!(old.differs(&Facts::default()), None);
        assert_eq!(old.differs(&old.clone()), None);
        let moved = Facts {
            bootstrap_port: Some(9000),
            ..Facts::default()
        };
        assert_eq!(
            old.differs(&moved).as_deref(),
            Some("bootstrap port 8998 -> 9000")
        );
        let restarted = Facts {
            process_start: Some(200.0),
            ..old.clone()
        };
        assert!(
            old.differs(&restarted)
                .unwrap()
                .starts_with("process start")
        );
        let other_model = Facts {
            models: Some(BTreeSet::from(["n".to_string()])),
            ..old.clone()
        };
        assert_eq!(
            old.differs(&other_model).as_deref(),
            Some("served models [m] -> [n]")
        );
        let mut merged = Facts::default();
        merged.merge(moved);
        merged.merge(Facts {
            process_start: Some(1.0),
            ..Facts::default()
        });
        assert_eq!(
            (merged.process_start, merged.bootstrap_port),
            (Some(1.0), Some(9000))
        );
    }
}
