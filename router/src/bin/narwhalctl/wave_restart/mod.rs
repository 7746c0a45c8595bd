//! `narwhalctl wave-restart`, the reference external supervisor (behaviour.md 4.6;
//! handoff-and-lifecycle.md, "Whole-wave restart policy"): drain, wait for `ready_to_stop`,
//! run the restart command per engine (`restart_cmd.rs`), readmit, and report every check
//! (`report.rs`). `--rolling` does it one engine at a time; a wave that stops prints the
//! command that continues it.

mod report;
mod restart_cmd;

use std::time::Duration;

use narwhal_shared::documents::Lifecycle;
use narwhal_shared::handoff::DrainState;

use self::report::{Resume, WaveReport, next_command};
use self::restart_cmd::engine_addresses;
use crate::client::Ctl;
use crate::failure::Failure;
use crate::output::out;

/// `wave-restart` options.
pub(crate) struct WaveOpts {
    pub(crate) cmd: String,
    pub(crate) rolling: bool,
    pub(crate) engines: Vec<String>,
    pub(crate) resume: bool,
    pub(crate) deadline_s: f64,
    pub(crate) timeout: Duration,
    pub(crate) restart_timeout: Duration,
}

impl Ctl {
    /// Makes `iid` ready to stop for a rolling restart: drain it, or with `--resume` adopt a
    /// drain already in place. Returns false when the engine turned out readmitted already.
    async fn rolling_hold(&self, o: &WaveOpts, iid: &str) -> Result<bool, Failure> {
        let state_of = |d: &Lifecycle| d.engine(iid).map(|e| e.state);
        let mut doc = self.lifecycle().await?;
        // A readmission in flight (ours, timed out, or another client's): let it finish.
        if state_of(&doc) == Some(DrainState::Validating) {
            doc = self
                .wait(&format!("{iid} validation"), o.timeout, |d| {
                    state_of(d) != Some(DrainState::Validating)
                })
                .await?;
            if o.resume && state_of(&doc) == Some(DrainState::Active) {
                return Ok(false);
            }
        }
        let state = state_of(&doc).map_or("?", DrainState::as_str);
        match state {
            "active" => {
                if !self.json {
                    out(&format!("== {iid}: drain"))?;
                }
                self.drain(Some(iid), o.deadline_s, true, o.timeout)
                    .await
                    .map_err(|(f, _)| f)?;
            }
            _ if !o.resume => {
                return Err(Failure::Refused(format!(
                    "{iid} is already held (state {state}): continue with --resume, or readmit it first"
                )));
            }
            "blocked" => {
                if !self.json {
                    out(&format!(
                        "== {iid}: already held (blocked), restarting it again"
                    ))?;
                }
            }
            _ => {
                if !self.json {
                    out(&format!(
                        "== {iid}: already held ({state}), waiting for ready_to_stop"
                    ))?;
                }
                self.wait_stop(Some(iid), o.timeout).await?;
            }
        }
        Ok(true)
    }

    async fn wave_steps(
        &self,
        o: &WaveOpts,
        rep: &mut WaveReport,
        next: &mut Option<Resume>,
    ) -> Result<(), Failure> {
        let doc = self.lifecycle().await?;
        let all: Vec<String> = doc.engines.keys().cloned().collect();
        for e in &o.engines {
            if !all.contains(e) {
                return Err(Failure::Usage(format!(
                    "--engines: {e:?} is not an engine of this router (engines: {})",
                    all.join(", ")
                )));
            }
        }
        let chosen: Vec<String> = if o.engines.is_empty() {
            all.clone()
        } else {
            all.iter()
                .filter(|e| o.engines.contains(e))
                .cloned()
                .collect()
        };
        let addrs = engine_addresses(self).await;
        if o.rolling {
            for (k, iid) in chosen.iter().enumerate() {
                *next = Some(Resume::Engines(chosen[k..].to_vec()));
                if !self.rolling_hold(o, iid).await? {
                    rep.engine(iid).readmitted = true;
                    continue;
                }
                rep.engine(iid).drained = true;
                self.restart(o, iid, &addrs, rep).await?;
                if !self.json {
                    out(&format!("== {iid}: readmit"))?;
                }
                let r = self.readmit(Some(iid)).await;
                let doc = match &r {
                    Ok(d) | Err((_, Some(d))) => Some(d.document.clone()),
                    Err((_, None)) => None,
                };
                if let Some(d) = &doc {
                    rep.record_checks(d, std::slice::from_ref(iid));
                }
                if let Err((f, _)) = r {
                    // Continuing restarts this engine again (harmless: it is held) and then
                    // the ones after it, so one command always continues the wave. When it
                    // is the last one and only its checks failed, readmitting is enough.
                    *next = Some(
                        if k + 1 == chosen.len()
                            && !restart_missing(doc.as_ref(), iid)
                            && matches!(f, Failure::Refused(_))
                        {
                            Resume::Readmit(iid.clone())
                        } else {
                            Resume::Engines(chosen[k..].to_vec())
                        },
                    );
                    rep.engine(iid).error = f.message().to_string();
                    return Err(f);
                }
                rep.engine(iid).readmitted = true;
            }
            *next = None;
            return Ok(());
        }
        // Whole wave.
        *next = Some(Resume::Engines(chosen.clone()));
        let wave_active = doc.wave.active;
        if wave_active && !o.resume {
            return Err(Failure::Refused(format!(
                "a wave ({}) is already active: continue it with --resume",
                doc.wave.id
            )));
        }
        if wave_active {
            if !self.json {
                out("== wave: already active, waiting until every engine is drained or blocked")?;
            }
            self.wait("wave members drained", o.timeout, |d| {
                d.engines
                    .values()
                    .filter(|e| !e.wave_id.is_empty())
                    .all(|e| matches!(e.state, DrainState::Drained | DrainState::Blocked))
            })
            .await?;
        } else {
            if !self.json {
                out(&format!("== wave: drain {}", all.join(", ")))?;
            }
            self.drain(None, o.deadline_s, true, o.timeout)
                .await
                .map_err(|(f, _)| f)?;
        }
        for iid in &all {
            rep.engine(iid).drained = true;
        }
        for (k, iid) in chosen.iter().enumerate() {
            *next = Some(Resume::Engines(chosen[k..].to_vec()));
            self.restart(o, iid, &addrs, rep).await?;
        }
        if !self.json {
            out("== wave: readmit")?;
        }
        let r = self.readmit(None).await;
        let doc = match &r {
            Ok(d) | Err((_, Some(d))) => Some(d.document.clone()),
            Err((_, None)) => None,
        };
        if let Some(d) = &doc {
            rep.record_checks(d, &all);
        }
        match r {
            Ok(_) => {
                for iid in &all {
                    rep.engine(iid).readmitted = true;
                }
                *next = None;
                Ok(())
            }
            Err((f, _)) => {
                let not_restarted: Vec<String> = all
                    .iter()
                    .filter(|i| restart_missing(doc.as_ref(), i))
                    .cloned()
                    .collect();
                // Engines the router says did not restart are restarted again; otherwise every
                // process is new and the readmission is what is left.
                *next = Some(if not_restarted.is_empty() {
                    Resume::ReadmitWave
                } else {
                    Resume::Engines(not_restarted)
                });
                Err(f)
            }
        }
    }

    pub(crate) async fn wave_restart(&self, o: &WaveOpts) -> Result<(), Failure> {
        let mut rep = WaveReport {
            schema: "narwhalctl.wave-restart",
            schema_version: 1,
            ok: false,
            mode: if o.rolling { "rolling" } else { "wave" },
            router: self.router.clone(),
            engines: Vec::new(),
            error: None,
            next_command: None,
            lifecycle: None,
        };
        let mut next = None;
        let result = self.wave_steps(o, &mut rep, &mut next).await;
        if let Err(Failure::PipeClosed) = result {
            // Nobody reads stdout any more: stop, but leave the way back on stderr.
            if let Some(n) = &next {
                eprintln!(
                    "narwhalctl: stdout closed; wave-restart stopped; continue with: {}",
                    next_command(n)
                );
            }
            return result;
        }
        if let Err(Failure::Usage(_)) = &result {
            return result;
        }
        let final_doc = self.lifecycle().await.ok();
        rep.lifecycle.clone_from(&final_doc);
        rep.ok = result.is_ok();
        if let Err(f) = &result {
            rep.error = Some(f.message().to_string());
            rep.next_command = next.as_ref().map(next_command);
        }
        if self.json {
            out(&serde_json::to_string(&rep).unwrap_or_default())?;
        } else if let Some(doc) = &final_doc {
            let ejected = self.ejected().await;
            self.show(doc, &ejected, None)?;
        }
        match result {
            Ok(()) => Ok(()),
            Err(f) => {
                let msg = match &rep.next_command {
                    Some(n) => format!(
                        "wave-restart stopped: {}\nnext: fix the cause above, then run:\n  {n}",
                        f.message()
                    ),
                    None => format!("wave-restart stopped: {}", f.message()),
                };
                Err(match f {
                    Failure::Refused(_) => Failure::Refused(msg),
                    Failure::Unavailable(_) => Failure::Unavailable(msg),
                    other => other,
                })
            }
        }
    }
}

/// Whether the router said `iid`'s process did not restart after its drain.
fn restart_missing(doc: Option<&Lifecycle>, iid: &str) -> bool {
    doc.and_then(|d| d.engine(iid))
        .is_some_and(|e| e.error.contains("did not restart"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn restart_missing_reads_the_routers_error() {
        let doc: Lifecycle = serde_json::from_value(json!({"engines": {
            "e0": {"error": "engine process did not restart after drain"},
            "e1": {"error": "generation failed"}}}))
        .expect("a lifecycle document");
        assert!(restart_missing(Some(&doc), "e0"));
        assert!(!restart_missing(Some(&doc), "e1"));
        assert!(!restart_missing(None, "e0"));
    }
}
