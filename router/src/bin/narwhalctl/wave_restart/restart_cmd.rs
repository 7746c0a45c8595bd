//! The operator's restart command: run once per engine through `sh -c`, with the engine's
//! address in its placeholders and environment, under `--restart-timeout-s`.

use narwhal_shared::documents::Targets;
use narwhal_shared::{Clock as _, SystemClock};

use super::WaveOpts;
use super::report::WaveReport;
use crate::client::Ctl;
use crate::failure::Failure;
use crate::output::out;

/// Engine addresses from `/narwhal/targets`: iid → (host, port, url).
pub(super) async fn engine_addresses(
    ctl: &Ctl,
) -> std::collections::BTreeMap<String, (String, String, String)> {
    let mut m = std::collections::BTreeMap::new();
    let Ok((200, Some(doc))) = ctl.get::<Targets>("/narwhal/targets").await else {
        return m;
    };
    for g in &doc {
        let (iid, Some(target)) = (g.labels.iid.as_str(), g.targets.first()) else {
            continue;
        };
        if iid.is_empty() {
            continue;
        }
        let scheme = if g.labels.scheme.is_empty() {
            "http"
        } else {
            g.labels.scheme.as_str()
        };
        let (host, port) = target.rsplit_once(':').unwrap_or((target, ""));
        m.insert(
            iid.to_string(),
            (
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string(),
                port.to_string(),
                format!("{scheme}://{target}"),
            ),
        );
    }
    m
}

impl Ctl {
    /// Runs the restart command for `iid`; its output goes to stderr under `--json`.
    pub(super) async fn restart(
        &self,
        o: &WaveOpts,
        iid: &str,
        addrs: &std::collections::BTreeMap<String, (String, String, String)>,
        rep: &mut WaveReport,
    ) -> Result<(), Failure> {
        let (host, port, url) = addrs.get(iid).cloned().unwrap_or_default();
        let line = o
            .cmd
            .replace("{iid}", iid)
            .replace("{host}", &host)
            .replace("{port}", &port)
            .replace("{url}", &url);
        if !self.json {
            out(&format!("{iid}: running restart command: {line}"))?;
        }
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c")
            .arg(&line)
            .env("NARWHAL_IID", iid)
            .env("NARWHAL_ENGINE_HOST", &host)
            .env("NARWHAL_ENGINE_PORT", &port)
            .env("NARWHAL_ENGINE_URL", &url)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        if self.json {
            // stdout carries exactly one JSON document: the command's output goes to stderr.
            cmd.stdout(std::process::Stdio::from(std::io::stderr()));
        }
        let t0 = SystemClock.now();
        let child = cmd.spawn();
        let mut child = child.map_err(|e| {
            Failure::Refused(format!(
                "{iid}: restart command {line:?} could not start: {e}"
            ))
        })?;
        let status = match tokio::time::timeout(o.restart_timeout, child.wait()).await {
            Ok(s) => {
                s.map_err(|e| Failure::Refused(format!("{iid}: restart command {line:?}: {e}")))?
            }
            Err(_) => {
                let _ = child.kill().await;
                rep.engine(iid).restart_s = Some((SystemClock.now() - t0).as_secs_f64());
                return Err(Failure::Refused(format!(
                    "{iid}: restart command {line:?} did not finish within {:.0} s (--restart-timeout-s); killed",
                    o.restart_timeout.as_secs_f64()
                )));
            }
        };
        let r = rep.engine(iid);
        r.restart_s = Some((SystemClock.now() - t0).as_secs_f64());
        r.restart_exit = status.code();
        if !status.success() {
            return Err(Failure::Refused(format!(
                "{iid}: restart command {line:?} exited with {status}"
            )));
        }
        r.restarted = true;
        Ok(())
    }
}
