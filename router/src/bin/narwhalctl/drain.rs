//! `narwhalctl drain`: drain one engine or the whole fleet as one wave, and with `--wait` poll
//! until it is `ready_to_stop` (the polling is shared with `wave-restart`).

use std::time::Duration;

use narwhal_shared::documents::requests::DrainBody;
use narwhal_shared::documents::{Lifecycle, LifecycleReply, Ordered};
use narwhal_shared::{Clock as _, SystemClock};

use crate::client::Ctl;
use crate::failure::Failure;
use crate::output::{out, progress_line};

impl Ctl {
    /// Polls the lifecycle document until `done(doc)`, printing progress when it changes.
    pub(crate) async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Lifecycle) -> bool,
    ) -> Result<Lifecycle, Failure> {
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
            let controls = doc.router.controls_fleet.as_str();
            if controls != "active" {
                return Err(Failure::Unavailable(format!(
                    "waiting for {what}: the router at {} no longer controls the fleet ({})",
                    self.addr,
                    if controls.is_empty() { "?" } else { controls }
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
    ) -> Result<LifecycleReply, (Failure, Option<LifecycleReply>)> {
        let body = match iid {
            Some(i) => DrainBody::engine(i, deadline_s),
            None => DrainBody::wave(deadline_s),
        };
        let doc = self.post("/narwhal/lifecycle/drain", &body).await?;
        if !self.json {
            for w in doc.warnings.iter().flatten() {
                out(&format!("warning: {w}")).map_err(|f| (f, None))?;
            }
        }
        if !wait {
            return Ok(doc);
        }
        let last = self.wait_stop(iid, timeout).await.map_err(|f| (f, None))?;
        Ok(LifecycleReply {
            document: last,
            warnings: doc.warnings,
        })
    }

    pub(crate) async fn wait_stop(
        &self,
        iid: Option<&str>,
        timeout: Duration,
    ) -> Result<Lifecycle, Failure> {
        match iid {
            Some(i) => {
                let i = i.to_string();
                self.wait(&format!("{i} ready_to_stop"), timeout, move |d| {
                    d.engine(&i).is_some_and(|e| e.ready_to_stop)
                })
                .await
            }
            None => {
                self.wait("wave ready_to_stop", timeout, |d| d.wave.ready_to_stop)
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
                out(&serde_json::to_string(&doc).unwrap_or_default())
            } else {
                ctl.show(&doc.document, &ctl.ejected().await, None)
            }
        }
        Err((f, doc)) => {
            if let Some(d) = doc {
                if ctl.json {
                    out(&serde_json::to_string(&d).unwrap_or_default())?;
                } else {
                    ctl.show(&d.document, &Ordered::new(), None)?;
                }
            }
            Err(f)
        }
    }
}
