//! What narwhalctl prints: lines on stdout (a closed pipe stops it quietly), the engine table,
//! each engine's readmission checks and the progress of a wait.

use std::io::Write as _;

use serde_json::Value;

use crate::client::Ctl;
use crate::failure::Failure;

/// Writes one line to stdout; a closed pipe becomes [`Failure::PipeClosed`] instead of a panic.
pub(crate) fn out(line: &str) -> Result<(), Failure> {
    let mut o = std::io::stdout().lock();
    match writeln!(o, "{line}").and_then(|()| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Failure::PipeClosed),
        // Any other stdout failure (disk full on a redirect) is as final for us.
        Err(_) => Err(Failure::PipeClosed),
    }
}

impl Ctl {
    pub(crate) fn show(
        &self,
        doc: &Value,
        ejected: &serde_json::Map<String, Value>,
        ready: &Value,
    ) -> Result<(), Failure> {
        let router = &doc["router"];
        let wave = &doc["wave"];
        let mut line = format!(
            "router: controls_fleet={} ready={}  policy={}",
            router["controls_fleet"].as_str().unwrap_or("?"),
            router["ready"],
            doc["engine_restart_policy"].as_str().unwrap_or("?")
        );
        if let Some(reason) = ready["reason"].as_str().filter(|r| !r.is_empty()) {
            line.push_str(&format!("  not ready: {reason}"));
        }
        out(&line)?;
        if wave["active"].as_bool().unwrap_or(false) {
            out(&format!(
                "wave {}: ready_to_stop={} readiness_withdrawn={}",
                wave["id"].as_str().unwrap_or(""),
                wave["ready_to_stop"],
                wave["readiness_withdrawn"]
            ))?;
        }
        out(&format!(
            "{:<8} {:<18} {:>6} {:>6} {:>9} {:>16} {:>16}  error",
            "engine", "state", "accept", "stop?", "resident", "old start", "new start"
        ))?;
        if let Some(engines) = doc["engines"].as_object() {
            for (iid, e) in engines {
                let res = format!(
                    "{}p/{}d",
                    e["resident"]["prefill"].as_u64().unwrap_or(0),
                    e["resident"]["decode"].as_u64().unwrap_or(0)
                );
                let start = |v: &Value| v.as_f64().map_or("-".to_string(), |s| format!("{s:.2}"));
                let lc_state = e["state"].as_str().unwrap_or("?");
                let mut note = e["error"].as_str().unwrap_or("").to_string();
                let state = match ejected.get(iid) {
                    Some(ej) => {
                        let causes = ej["causes"]
                            .as_object()
                            .map(|c| {
                                c.iter()
                                    .map(|(k, n)| format!("{k} x{n}"))
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            })
                            .filter(|s| !s.is_empty())
                            .unwrap_or_else(|| "cause unknown".into());
                        let ej_note = format!("ejected by the breaker: {causes}");
                        note = if note.is_empty() {
                            ej_note
                        } else {
                            format!("{ej_note}; {note}")
                        };
                        if lc_state == "active" {
                            "ejected".to_string()
                        } else {
                            format!("{lc_state}+ejected")
                        }
                    }
                    None => lc_state.to_string(),
                };
                out(&format!(
                    "{:<8} {:<18} {:>6} {:>6} {:>9} {:>16} {:>16}  {}",
                    iid,
                    state,
                    yes(&e["accepts_new"]),
                    yes(&e["ready_to_stop"]),
                    res,
                    start(&e["old_process_start"]),
                    start(&e["new_process_start"]),
                    note
                ))?;
            }
        }
        Ok(())
    }

    /// Prints, per target, the checks that passed and what failed ([`check_lines`]).
    pub(crate) fn show_checks(
        &self,
        doc: &Value,
        targets: &[String],
        router_error: Option<&str>,
    ) -> Result<(), Failure> {
        if self.json {
            return Ok(());
        }
        for line in check_lines(doc, targets, router_error) {
            out(&line)?;
        }
        Ok(())
    }
}

/// Per target, the checks that passed and what failed. Never an empty "checks passed:" list:
/// when nothing passed it says what stopped the readmission. `router_error` is the router's
/// answer when it was not a success (a 409 `readmission validation failed`, a 503 `this router
/// does not control the fleet` or `router control was fenced during validation`).
fn check_lines(doc: &Value, targets: &[String], router_error: Option<&str>) -> Vec<String> {
    let mut lines = Vec::new();
    for iid in targets {
        let e = &doc["engines"][iid];
        let checks: Vec<&str> = e["checks"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let engine_error = e["error"].as_str().filter(|s| !s.is_empty());
        lines.push(match (checks.is_empty(), router_error) {
            (false, None) => format!("{iid}: checks passed: {}", checks.join(", ")),
            (false, Some(_)) => format!(
                "{iid}: checks passed before it stopped: {}",
                checks.join(", ")
            ),
            (true, Some(_)) => format!("{iid}: no check passed"),
            (true, None) => format!("{iid}: readmitted (the router reported no checks)"),
        });
        if let Some(err) = engine_error {
            lines.push(format!("{iid}: FAILED: {err}"));
        } else if let Some(r) = router_error {
            lines.push(format!("{iid}: FAILED: {r}"));
        }
    }
    lines
}

fn yes(v: &Value) -> &'static str {
    if v.as_bool().unwrap_or(false) {
        "yes"
    } else {
        "no"
    }
}

/// One line summarising every held engine: `e0 draining 2p/0d, e1 drained`.
pub(crate) fn progress_line(doc: &Value) -> String {
    let Some(engines) = doc["engines"].as_object() else {
        return String::new();
    };
    engines
        .iter()
        .filter(|(_, e)| e["state"] != "active")
        .map(|(iid, e)| {
            let state = e["state"].as_str().unwrap_or("?");
            let (p, d) = (
                e["resident"]["prefill"].as_u64().unwrap_or(0),
                e["resident"]["decode"].as_u64().unwrap_or(0),
            );
            if p + d > 0 {
                format!("{iid} {state} ({p} prefill, {d} decode resident)")
            } else {
                format!("{iid} {state}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn progress_names_held_engines_with_resident_work() {
        let doc = json!({"engines": {
            "e0": {"state": "draining", "resident": {"prefill": 1, "decode": 2}},
            "e1": {"state": "active", "resident": {"prefill": 0, "decode": 0}},
            "e2": {"state": "drained", "resident": {"prefill": 0, "decode": 0}},
        }});
        assert_eq!(
            progress_line(&doc),
            "e0 draining (1 prefill, 2 decode resident), e2 drained"
        );
    }

    #[test]
    fn check_lines_never_print_an_empty_list_and_name_what_stopped_the_readmission() {
        let t = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // 503 before any check: the router is not in control.
        let doc = json!({"engines": {"p0": {"checks": [], "error": ""}}});
        assert_eq!(
            check_lines(
                &doc,
                &t(&["p0"]),
                Some("this router does not control the fleet")
            ),
            t(&[
                "p0: no check passed",
                "p0: FAILED: this router does not control the fleet"
            ])
        );
        // Fenced during validation: what passed before, and why it stopped.
        let doc = json!({"engines": {"d0": {"checks": ["health", "attestation k"], "error": ""}}});
        assert_eq!(
            check_lines(
                &doc,
                &t(&["d0"]),
                Some("router control was fenced during validation")
            ),
            t(&[
                "d0: checks passed before it stopped: health, attestation k",
                "d0: FAILED: router control was fenced during validation"
            ])
        );
        // A failed check: the engine's own error wins over the router's summary.
        let doc = json!({"engines": {"d0": {"checks": ["health"], "error": "generation: 500"}}});
        assert_eq!(
            check_lines(&doc, &t(&["d0"]), Some("readmission validation failed")),
            t(&[
                "d0: checks passed before it stopped: health",
                "d0: FAILED: generation: 500"
            ])
        );
        // Success.
        let doc = json!({"engines": {"d0": {"checks": ["health", "final health"], "error": ""}}});
        assert_eq!(
            check_lines(&doc, &t(&["d0"]), None),
            t(&["d0: checks passed: health, final health"])
        );
        // An engine the document does not know.
        let lines = check_lines(&json!({}), &t(&["x"]), Some("HTTP 503"));
        assert_eq!(lines, t(&["x: no check passed", "x: FAILED: HTTP 503"]));
    }
}
