//! `narwhalctl status`: every engine's lifecycle state (ejected engines as `ejected` with the
//! breaker's cause), the wave, the router's readiness and the role controller.

use serde_json::{Value, json};

use crate::client::Ctl;
use crate::failure::Failure;
use crate::output::out;

impl Ctl {
    pub(crate) async fn status(&self) -> Result<(), Failure> {
        let mut doc = self.lifecycle().await?;
        let ejected = self.ejected().await;
        let ready = self.get("/ready").await.map(|(_, d)| d).unwrap_or_default();
        let state = match self.get("/narwhal/state").await {
            Ok((200, st)) => st,
            _ => Value::Null,
        };
        let control = controller_status(&state);
        if self.json {
            doc["ejected"] = Value::Object(ejected);
            doc["ready"] = ready;
            doc["roles"] = Value::Object(roles(&state));
            doc["controller"] = control;
            return out(&doc.to_string());
        }
        self.show(&doc, &ejected, &ready)?;
        for line in controller_lines(&state, &control) {
            out(&line)?;
        }
        Ok(())
    }
}

/// Each engine's router role from `/narwhal/state.pools` (`{iid: "prefill"|"decode"}`).
fn roles(state: &Value) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    for role in ["prefill", "decode"] {
        for iid in state["pools"][role].as_array().into_iter().flatten() {
            if let Some(i) = iid.as_str() {
                m.insert(i.to_string(), json!(role));
            }
        }
    }
    m
}

/// The role controller's mode and its newest decision (`by`, `result`, `reason`, `at`, the
/// split it describes), from `/narwhal/state` (`null` fields when unknown).
fn controller_status(state: &Value) -> Value {
    let d = &state["control"]["last_decision"];
    let last = if d.is_object() {
        json!({"by": d["by"], "result": d["result"], "reason": d["reason"], "at": d["at"],
               "prefill": d["prefill"], "decode": d["decode"]})
    } else {
        Value::Null
    };
    json!({"mode": state["controller"], "advisory": state["control"]["advisory"],
           "last_decision": last})
}

/// The status lines of the role controller: each engine's role, then the controller's mode
/// and its last decision with the reason (docs/operate.md, "The role controller").
fn controller_lines(state: &Value, control: &Value) -> Vec<String> {
    let mut lines = Vec::new();
    let roles = roles(state);
    if !roles.is_empty() {
        let list: Vec<String> = roles
            .iter()
            .map(|(iid, r)| format!("{iid}={}", r.as_str().unwrap_or("?")))
            .collect();
        lines.push(format!("roles: {}", list.join(" ")));
    }
    let mode = control["mode"].as_str().unwrap_or("unknown");
    let advisory = if control["advisory"] == json!(true) {
        " (advisory)"
    } else {
        ""
    };
    let last = &control["last_decision"];
    if last.is_object() {
        lines.push(format!(
            "controller: {mode}{advisory}  last decision: {} {} -> {}P/{}D: {}",
            last["by"].as_str().unwrap_or("?"),
            last["result"].as_str().unwrap_or("?"),
            last["prefill"],
            last["decode"],
            last["reason"].as_str().unwrap_or("")
        ));
    } else {
        lines.push(format!("controller: {mode}{advisory}  no decision yet"));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `narwhalctl status` shows each engine's role and the last decision with its reason.
    #[test]
    fn status_lines_name_roles_and_the_last_decision() {
        let state = json!({
            "controller": "reactive",
            "pools": {"prefill": ["e0", "e1"], "decode": ["e2"]},
            "control": {"advisory": false, "last_decision": {
                "by": "reactive", "result": "held", "reason": "waiting for sustained demand",
                "at": 1.0, "prefill": 3, "decode": 1}},
        });
        let lines = controller_lines(&state, &controller_status(&state));
        assert_eq!(lines[0], "roles: e0=prefill e1=prefill e2=decode");
        assert_eq!(
            lines[1],
            "controller: reactive  last decision: reactive held -> 3P/1D: waiting for sustained demand"
        );
        let off = json!({"controller": "off", "pools": {"prefill": [], "decode": ["e0"]}});
        assert_eq!(
            controller_lines(&off, &controller_status(&off))[1],
            "controller: off  no decision yet"
        );
    }
}
