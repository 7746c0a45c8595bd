//! What narwhalctl prints: lines on stdout (a closed pipe stops it quietly), the engine table,
//! each engine's readmission checks and the progress of a wait.

use std::io::Write as _;

use narwhal_shared::documents::{Lifecycle, Ordered, Ready};
use narwhal_shared::handoff::DrainState;

use crate::client::{Ctl, Ejected};
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
    /// Prints the router line, the wave (when one is active) and the engine table; an engine
    /// in `ejected` shows as ejected with the breaker's causes.
    pub(crate) fn show(
        &self,
        doc: &Lifecycle,
        ejected: &Ordered<Ejected>,
        ready: Option<&Ready>,
    ) -> Result<(), Failure> {
        let router = &doc.router;
        let wave = &doc.wave;
        let mut line = format!(
            "router: controls_fleet={} ready={}  policy={}",
            or_unknown(&router.controls_fleet),
            router.ready,
            or_unknown(&doc.engine_restart_policy)
        );
        if let Some(reason) = ready.map(|r| r.reason.as_str()).filter(|r| !r.is_empty()) {
            line.push_str(&format!("  not ready: {reason}"));
        }
        out(&line)?;
        if wave.active {
            out(&format!(
                "wave {}: ready_to_stop={} readiness_withdrawn={}",
                wave.id, wave.ready_to_stop, wave.readiness_withdrawn
            ))?;
        }
        out(&format!(
            "{:<8} {:<18} {:>6} {:>6} {:>9} {:>16} {:>16}  error",
            "engine", "state", "accept", "stop?", "resident", "old start", "new start"
        ))?;
        for (iid, e) in &doc.engines {
            let res = format!("{}p/{}d", e.resident.prefill, e.resident.decode);
            let start = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("{s:.2}"));
            let lc_state = e.state.as_str();
            let mut note = e.error.clone();
            let state = match ejected.get(iid) {
                Some(ej) => {
                    let causes = ej
                        .causes
                        .iter()
                        .map(|(k, n)| format!("{k} x{n}"))
                        .collect::<Vec<_>>()
                        .join(", ");
                    let causes = if causes.is_empty() {
                        "cause unknown".to_string()
                    } else {
                        causes
                    };
                    let ej_note = format!("ejected by the breaker: {causes}");
                    note = if note.is_empty() {
                        ej_note
                    } else {
                        format!("{ej_note}; {note}")
                    };
                    if e.state == DrainState::Active {
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
                yes(e.accepts_new),
                yes(e.ready_to_stop),
                res,
                start(e.old_process_start),
                start(e.new_process_start),
                note
            ))?;
        }
        Ok(())
    }

    /// Prints, per target, the checks that passed and what failed ([`check_lines`]).
    pub(crate) fn show_checks(
        &self,
        doc: &Lifecycle,
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

/// `s`, or `?` when the router left it empty.
fn or_unknown(s: &str) -> &str {
    if s.is_empty() { "?" } else { s }
}

/// Per target, the checks that passed and what failed. Never an empty "checks passed:" list:
/// when nothing passed it says what stopped the readmission. `router_error` is the router's
/// answer when it was not a success (a 409 `readmission validation failed`, a 503 `this router
/// does not control the fleet` or `router control was fenced during validation`).
fn check_lines(doc: &Lifecycle, targets: &[String], router_error: Option<&str>) -> Vec<String> {
    let mut lines = Vec::new();
    for iid in targets {
        let e = doc.engine(iid);
        let checks: Vec<&str> = e
            .map(|e| e.checks.iter().map(String::as_str).collect())
            .unwrap_or_default();
        let engine_error = e.map(|e| e.error.as_str()).filter(|s| !s.is_empty());
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

fn yes(v: bool) -> &'static str {
    if v { "yes" } else { "no" }
}

/// One line summarising every held engine: `e0 draining 2p/0d, e1 drained`.
pub(crate) fn progress_line(doc: &Lifecycle) -> String {
    doc.engines
        .iter()
        .filter(|(_, e)| e.state != DrainState::Active)
        .map(|(iid, e)| {
            let state = e.state.as_str();
            let (p, d) = (e.resident.prefill, e.resident.decode);
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

    /// A (partial) lifecycle document, as a reader parses it.
    fn lifecycle(v: serde_json::Value) -> Lifecycle {
        serde_json::from_value(v).expect("a lifecycle document")
    }

    #[test]
    fn progress_names_held_engines_with_resident_work() {
        let doc = lifecycle(json!({"engines": {
            "e0": {"state": "draining", "resident": {"prefill": 1, "decode": 2}},
            "e1": {"state": "active", "resident": {"prefill": 0, "decode": 0}},
            "e2": {"state": "drained", "resident": {"prefill": 0, "decode": 0}},
        }}));
        assert_eq!(
            progress_line(&doc),
            "e0 draining (1 prefill, 2 decode resident), e2 drained"
        );
    }

    #[test]
    fn check_lines_never_print_an_empty_list_and_name_what_stopped_the_readmission() {
        let t = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // 503 before any check: the router is not in control.
        let doc = lifecycle(json!({"engines": {"p0": {"checks": [], "error": ""}}}));
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
        let doc = lifecycle(
            json!({"engines": {"d0": {"checks": ["health", "attestation k"], "error": ""}}}),
        );
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
        let doc = lifecycle(
            json!({"engines": {"d0": {"checks": ["health"], "error": "generation: 500"}}}),
        );
        assert_eq!(
            check_lines(&doc, &t(&["d0"]), Some("readmission validation failed")),
            t(&[
                "d0: checks passed before it stopped: health",
                "d0: FAILED: generation: 500"
            ])
        );
        // Success.
        let doc = lifecycle(
            json!({"engines": {"d0": {"checks": ["health", "final health"], "error": ""}}}),
        );
        assert_eq!(
            check_lines(&doc, &t(&["d0"]), None),
            t(&["d0: checks passed: health, final health"])
        );
        // An engine the document does not know.
        let lines = check_lines(&lifecycle(json!({})), &t(&["x"]), Some("HTTP 503"));
        assert_eq!(lines, t(&["x: no check passed", "x: FAILED: HTTP 503"]));
    }
}
