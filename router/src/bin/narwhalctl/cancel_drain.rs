//! `narwhalctl cancel-drain`: return an engine that was drained but not restarted to service,
//! through the same readmission checks (docs/deviations.md).

use narwhal_shared::documents::LifecycleReply;
use narwhal_shared::documents::requests::ReadmitBody;

use crate::client::Ctl;
use crate::failure::Failure;
use crate::output::out;

impl Ctl {
    /// POSTs a drain cancel of `iid` and prints its checks, as [`Ctl::readmit`] does.
    pub(crate) async fn cancel_drain(
        &self,
        iid: &str,
    ) -> Result<LifecycleReply, (Failure, Option<LifecycleReply>)> {
        let body = ReadmitBody::engine(iid);
        self.validating_post("/narwhal/lifecycle/cancel-drain", body, Some(iid))
            .await
    }
}

/// Runs `narwhalctl cancel-drain`: refuses a listener that is not a control listener, cancels
/// the drain, and prints that the engine is back (or the lifecycle document with `--json`,
/// also on a refusal).
pub(crate) async fn run(ctl: &Ctl, iid: &str) -> Result<(), Failure> {
    ctl.lifecycle().await?;
    match ctl.cancel_drain(iid).await {
        Ok(doc) => {
            if ctl.json {
                out(&serde_json::to_string(&doc).unwrap_or_default())
            } else {
                out(&format!("{iid}: drain cancelled, back in service"))
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
