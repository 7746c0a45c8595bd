//! `narwhalctl readmit`: validate and readmit one engine or the active wave, printing each
//! engine's checks (the validating POST is shared with `cancel-drain`).

use narwhal_shared::documents::requests::ReadmitBody;
use narwhal_shared::documents::{Lifecycle, LifecycleReply};
use narwhal_shared::handoff::DrainState;

use crate::client::Ctl;
use crate::failure::Failure;
use crate::output::out;

impl Ctl {
    /// POSTs a readmission and prints each target's checks (never an empty list).
    pub(crate) async fn readmit(
        &self,
        iid: Option<&str>,
    ) -> Result<LifecycleReply, (Failure, Option<LifecycleReply>)> {
        let body = match iid {
            Some(i) => ReadmitBody::engine(i),
            None => ReadmitBody::wave(),
        };
        self.validating_post("/narwhal/lifecycle/readmit", body, iid)
            .await
    }

    /// POSTs an action that validates engines (readmit, cancel-drain) and prints each
    /// target's checks (never an empty list).
    pub(crate) async fn validating_post(
        &self,
        path: &str,
        body: ReadmitBody,
        iid: Option<&str>,
    ) -> Result<LifecycleReply, (Failure, Option<LifecycleReply>)> {
        match self.post(path, &body).await {
            Ok(doc) => {
                let targets = targets_of(&doc.document, iid);
                self.show_checks(&doc.document, &targets, None)
                    .map_err(|f| (f, None))?;
                Ok(doc)
            }
            Err((f, Some(doc))) => {
                let lc = &doc.document;
                let targets = targets_of(lc, iid);
                let router_error = if lc.error.is_empty() {
                    f.message().to_string()
                } else {
                    lc.error.clone()
                };
                if let Err(p) = self.show_checks(lc, &targets, Some(&router_error)) {
                    return Err((p, None));
                }
                let failed: Vec<String> = targets
                    .iter()
                    .filter(|i| lc.engine(i).is_some_and(|e| !e.error.is_empty()))
                    .cloned()
                    .collect();
                let f = match f {
                    Failure::Refused(m) if !failed.is_empty() => {
                        Failure::Refused(format!("{m} (failed: {})", failed.join(", ")))
                    }
                    other => other,
                };
                Err((f, Some(doc)))
            }
            Err(e) => Err(e),
        }
    }
}

/// The engines an action applied to: the named one, or the wave's members.
pub(crate) fn targets_of(doc: &Lifecycle, iid: Option<&str>) -> Vec<String> {
    match iid {
        Some(i) => vec![i.to_string()],
        None => doc
            .engines
            .iter()
            .filter(|(_, e)| e.state != DrainState::Active || !e.checks.is_empty())
            .map(|(k, _)| k.clone())
            .collect(),
    }
}

/// Runs `narwhalctl readmit`: refuses a listener that is not a control listener, readmits,
/// and prints `readmitted` (or the lifecycle document with `--json`, also on a refusal).
pub(crate) async fn run(ctl: &Ctl, iid: Option<&str>) -> Result<(), Failure> {
    ctl.lifecycle().await?;
    match ctl.readmit(iid).await {
        Ok(doc) => {
            if ctl.json {
                out(&serde_json::to_string(&doc).unwrap_or_default())
            } else {
                out("readmitted")
            }
        }
        Err((f, doc)) => {
            if ctl.json
                && let Some(d) = doc
            {
                out(&serde_json::to_string(&d).unwrap_or_default())?;
            }
            Err(f)
        }
    }
}
