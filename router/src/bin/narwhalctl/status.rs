//! `narwhalctl status`: every engine's lifecycle state (ejected engines as `ejected` with the
//! breaker's cause), the wave, the router's readiness and the role controller.

use narwhal_shared::documents::{Lifecycle, Ordered, Ready, State};
use serde::Serialize;

use crate::client::{Ctl, Ejected};
use crate::failure::Failure;
use crate::output::out;

/// What `status --json` prints: the lifecycle document, then what narwhalctl adds.
#[derive(Serialize)]
struct StatusReport {
    #[serde(flatten)]
    lifecycle: Lifecycle,
    /// Ejected engines with their breaker causes.
    ejected: Ordered<Ejected>,
    /// `/ready`'s body, `null` when it did not answer with one.
    ready: Option<Ready>,
    /// Each engine's router role ([`roles`]).
    roles: Ordered<&'static str>,
    /// The role controller ([`controller_status`]).
    controller: ControllerStatus,
}

/// The role controller as `status` shows it: its mode, whether advisory, its newest decision
/// (`null` fields when unknown).
#[derive(Debug, Serialize, PartialEq)]
struct ControllerStatus {
    /// `controller` of `/narwhal/state` (`reactive`, `off`).
    mode: Option<String>,
    /// `control.advisory`.
    advisory: Option<bool>,
    /// The head of `control.last_decision`.
    last_decision: Option<LastDecision>,
}

/// The newest decision's head: who, what came of it, why, when (wall seconds) and the split.
#[derive(Debug, Serialize, PartialEq)]
struct LastDecision {
    by: String,
    result: String,
    reason: String,
    at: f64,
    prefill: u64,
    decode: u64,
}

impl Ctl {
    pub(crate) async fn status(&self) -> Result<(), Failure> {
        let doc = self.lifecycle().await?;
        let ejected = self.ejected().await;
        let ready = self.ready().await;
        let state = self.state().await;
        let control = controller_status(state.as_ref());
        if self.json {
            let report = StatusReport {
                lifecycle: doc,
                ejected,
                ready,
                roles: roles(state.as_ref()),
                controller: control,
            };
            return out(&serde_json::to_string(&report).unwrap_or_default());
        }
        self.show(&doc, &ejected, ready.as_ref())?;
        for line in controller_lines(state.as_ref(), &control) {
            out(&line)?;
        }
        Ok(())
    }
}

/// Each engine's router role from `/narwhal/state.pools` (`{iid: "prefill"|"decode"}`,
/// prefill engines first).
fn roles(state: Option<&State>) -> Ordered<&'static str> {
    let mut m = Ordered::new();
    if let Some(st) = state {
        for (role, pool) in [("prefill", &st.pools.prefill), ("decode", &st.pools.decode)] {
            for iid in pool {
                m.insert(iid.clone(), role);
            }
        }
    }
    m
}

/// The role controller's mode and its newest decision (`by`, `result`, `reason`, `at`, the
/// split it describes), from `/narwhal/state`.
fn controller_status(state: Option<&State>) -> ControllerStatus {
    let report = state.map(|st| &st.controller);
    let control = report.and_then(|r| r.fields.as_ref()).map(|f| &f.control);
    ControllerStatus {
        mode: report.map(|r| r.controller.clone()),
        advisory: control.map(|c| c.advisory),
        last_decision: control
            .and_then(|c| c.last_decision.as_ref())
            .map(|d| LastDecision {
                by: d.by.clone(),
                result: d.result.clone(),
                reason: d.reason.clone(),
                at: d.at,
                prefill: d.prefill,
                decode: d.decode,
            }),
    }
}

/// The status lines of the role controller: each engine's role, then the controller's mode
/// and its last decision with the reason (docs/operate.md, "The role controller").
fn controller_lines(state: Option<&State>, control: &ControllerStatus) -> Vec<String> {
    let mut lines = Vec::new();
    let roles = roles(state);
    if !roles.is_empty() {
        let list: Vec<String> = roles.iter().map(|(iid, r)| format!("{iid}={r}")).collect();
        lines.push(format!("roles: {}", list.join(" ")));
    }
    let mode = control.mode.as_deref().unwrap_or("unknown");
    let advisory = if control.advisory == Some(true) {
        " (advisory)"
    } else {
        ""
    };
    match &control.last_decision {
        Some(last) => lines.push(format!(
            "controller: {mode}{advisory}  last decision: {} {} -> {}P/{}D: {}",
            last.by, last.result, last.prefill, last.decode, last.reason
        )),
        None => lines.push(format!("controller: {mode}{advisory}  no decision yet")),
    }
    lines
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn state(v: serde_json::Value) -> Option<State> {
        Some(serde_json::from_value(v).expect("a state document"))
    }

    /// `narwhalctl status` shows each engine's role and the last decision with its reason.
    #[test]
    fn status_lines_name_roles_and_the_last_decision() {
        let st = state(json!({
            "controller": "reactive",
            "pools": {"prefill": ["e0", "e1"], "decode": ["e2"]},
            "control": {"advisory": false, "last_decision": {
                "by": "reactive", "result": "held", "reason": "waiting for sustained demand",
                "at": 1.0, "prefill": 3, "decode": 1}},
        }));
        let lines = controller_lines(st.as_ref(), &controller_status(st.as_ref()));
        assert_eq!(lines[0], "roles: e0=prefill e1=prefill e2=decode");
        assert_eq!(
            lines[1],
            "controller: reactive  last decision: reactive held -> 3P/1D: waiting for sustained demand"
        );
        let off = state(json!({"controller": "off", "pools": {"prefill": [], "decode": ["e0"]}}));
        assert_eq!(
            controller_lines(off.as_ref(), &controller_status(off.as_ref()))[1],
            "controller: off  no decision yet"
        );
        assert_eq!(
            controller_lines(None, &controller_status(None)),
            ["controller: unknown  no decision yet"],
            "no state: nothing known"
        );
    }

    /// `status --json`'s `controller`: `null` fields when unknown, the decision's head.
    #[test]
    fn the_controller_status_is_null_where_unknown() {
        let text = |s: Option<&State>| serde_json::to_string(&controller_status(s)).expect("json");
        assert_eq!(
            text(None),
            r#"{"mode":null,"advisory":null,"last_decision":null}"#
        );
        let off = state(json!({"controller": "off"}));
        assert_eq!(
            text(off.as_ref()),
            r#"{"mode":"off","advisory":null,"last_decision":null}"#
        );
        let on = state(
            json!({"controller": "reactive", "control": {"advisory": true,
            "last_decision": {"by": "decode_floor", "result": "applied", "reason": "r",
                              "at": 2.5, "prefill": 1, "decode": 2, "objective": null}}}),
        );
        assert_eq!(
            text(on.as_ref()),
            r#"{"mode":"reactive","advisory":true,"last_decision":{"by":"decode_floor","result":"applied","reason":"r","at":2.5,"prefill":1,"decode":2}}"#
        );
    }
}
