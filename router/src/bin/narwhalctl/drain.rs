//! `narwhalctl drain`: drain one engine or the whole fleet as one wave, and with `--wait` poll
//! until it is `ready_to_stop` (the polling is shared with `wave-restart`).

use std::time::Duration;

use narwhal_shared::{Clock as _, SystemClock};
use serde_json::{Value, json};

use crate::client::Ctl;
use crate::failure::Failure;
use crate::output::{out, progress_line};

impl Ctl {
    /// Polls the lifecycle document until `done(doc)`, printing progress when it changes.
    pub(crate) async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Result<Value, Failure> {
        let clock = SystemClock;
        let deadline = clock.now() + timeout;
        let mut last = String::new();
        loop {
            let doc = self.lifecycle().await?;
            if done(&doc) {
                return Ok(doc);
            }
            let progress = progress_line(&doc);
            if progress != last && !self.json {
                out(&format!("waiting for {what}: {progress}"))?;
                last.clone_from(&progress);
            }
            if doc["router"]["controls_fleet"] != "active" {
                return Err(Failure::Unavailable(format!(
                    "waiting for {what}: the router at {} no longer controls the fleet ({})",
                    self.addr,
                    doc["router"]["controls_fleet"].as_str().unwrap_or("?")
                )));
            }
            if clock.now() >= deadline {
                return Err(Failure::Unavailable(format!(
                    "timed out after {:.0} s waiting for {what} ({progress})",
                    timeout.as_secs_f64()
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// POSTs a drain and, with `wait`, polls until `ready_to_stop`. Returns the last document.
    pub(crate) async fn drain(
        &self,
        iid: Option<&str>,
        deadline_s: f64,
        wait: bool,
        timeout: Duration,
    ) -> Result<Value, (Failure, Option<Value>)> {
        let body = match iid {
            Some(i) => json!({"engines": [i], "deadline_s": deadline_s}),
            None => json!({"wave": true, "deadline_s": deadline_s}),
        };
        let doc = self.post("/narwhal/lifecycle/drain", body).await?;
        let warnings = doc["warnings"].clone();
        if !self.json {
            for w in warnings.as_array().into_iter().flatten() {
                out(&format!("warning: {}", w.as_str().unwrap_or_default()))
                    .map_err(|f| (f, None))?;
            }
        }
        if !wait {
            return Ok(doc);
        }
        let mut last = self.wait_stop(iid, timeout).await.map_err(|f| (f, None))?;
        if warnings.is_array() {
            last["warnings"] = warnings;
        }
        Ok(last)
    }

    pub(crate) async fn wait_stop(
        &self,
        iid: Option<&str>,
        timeout: Duration,
    ) -> Result<Value, Failure> {
        match iid {
            Some(i) => {
                let i = i.to_string();
                self.wait(&format!("{i} ready_to_stop"), timeout, move |d| {
                    d["engines"][&i]["ready_to_stop"] == true
                })
                .await
            }
            None => {
                self.wait("wave ready_to_stop", timeout, |d| {
                    d["wave"]["ready_to_stop"] == true
                })
                .await
            }
        }
    }
}

/// Runs `narwhalctl drain`: refuses a listener that is not a control listener, drains, and
/// prints the lifecycle document (or the engine table), also when the router refused.
pub(crate) async fn run(
    ctl: &Ctl,
    iid: Option<&str>,
    deadline_s: f64,
    wait: bool,
    timeout_s: f64,
) -> Result<(), Failure> {
    // Refuse a wrong listener before acting.
    ctl.lifecycle().await?;
    match ctl
        .drain(iid, deadline_s, wait, Duration::from_secs_f64(timeout_s))
        .await
    {
        Ok(doc) => {
            if ctl.json {
                out(&doc.to_string())
            } else {
                ctl.show(&doc, &ctl.ejected().await, &Value::Null)
            }
        }
        Err((f, doc)) => {
            if let Some(d) = doc {
                if ctl.json {
                    out(&d.to_string())?;
                } else {
                    ctl.show(&d, &serde_json::Map::new(), &Value::Null)?;
                }
            }
            Err(f)
        }
    }
}
