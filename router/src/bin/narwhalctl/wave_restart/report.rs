//! What a wave-restart did per engine (the `--json` report) and, when it stopped, the exact
//! command that continues it.

use narwhal_shared::documents::Lifecycle;

/// What happened to one engine during a wave-restart (`--json` report `engines[]`).
#[derive(Default, serde::Serialize)]
pub(super) struct EngineReport {
    pub(super) iid: String,
    /// The drain was accepted (or found already held with `--resume`).
    pub(super) drained: bool,
    /// The restart command exited 0.
    pub(super) restarted: bool,
    /// Exit code of the restart command, when it ran and exited.
    pub(super) restart_exit: Option<i32>,
    /// Seconds the restart command took.
    pub(super) restart_s: Option<f64>,
    /// The readmission passed.
    pub(super) readmitted: bool,
    /// Checks the router reported for it.
    pub(super) checks: Vec<String>,
    /// What failed for it, `""` when nothing did.
    pub(super) error: String,
}

/// The single JSON document `wave-restart --json` prints (schema `narwhalctl.wave-restart` v1).
#[derive(serde::Serialize)]
pub(super) struct WaveReport {
    pub(super) schema: &'static str,
    pub(super) schema_version: u32,
    pub(super) ok: bool,
    pub(super) mode: &'static str,
    pub(super) router: String,
    pub(super) engines: Vec<EngineReport>,
    /// What stopped the wave, `null` on success.
    pub(super) error: Option<String>,
    /// The exact command that continues the wave, `null` on success.
    pub(super) next_command: Option<String>,
    /// The router's lifecycle document at the end (`null` if it could not be read).
    pub(super) lifecycle: Option<Lifecycle>,
}

/// Where a wave stopped, for the next command.
pub(super) enum Resume {
    /// Continue with `--resume --engines <list>` (the engines still to do).
    Engines(Vec<String>),
    /// Everything was restarted; only the readmission is left.
    ReadmitWave,
    /// Everything was restarted; only this engine's readmission is left.
    Readmit(String),
}

impl WaveReport {
    pub(super) fn engine(&mut self, iid: &str) -> &mut EngineReport {
        if let Some(i) = self.engines.iter().position(|e| e.iid == iid) {
            return &mut self.engines[i];
        }
        self.engines.push(EngineReport {
            iid: iid.to_string(),
            ..EngineReport::default()
        });
        self.engines.last_mut().expect("just pushed")
    }

    pub(super) fn record_checks(&mut self, doc: &Lifecycle, targets: &[String]) {
        for iid in targets {
            let e = doc.engine(iid);
            let checks = e.map(|e| e.checks.clone()).unwrap_or_default();
            let err = e.map(|e| e.error.clone()).unwrap_or_default();
            let r = self.engine(iid);
            r.checks = checks;
            if !err.is_empty() {
                r.error = err;
            }
        }
    }
}

/// The command line of this invocation with `--resume`/`--engines` replaced by `resume`.
pub(super) fn next_command(resume: &Resume) -> String {
    let args: Vec<String> = std::env::args().collect();
    let mut kept: Vec<String> = Vec::new();
    let mut global: Vec<String> = Vec::new();
    let mut i = 1;
    let mut seen_sub = false;
    while i < args.len() {
        let a = &args[i];
        if a == "--resume" || a.starts_with("--engines=") {
            i += 1;
            continue;
        }
        if a == "--engines" {
            i += 2;
            continue;
        }
        if a == "wave-restart" && !seen_sub {
            seen_sub = true;
        }
        if seen_sub {
            kept.push(a.clone());
        } else {
            global.push(a.clone());
        }
        i += 1;
    }
    let prog = args
        .first()
        .map_or("narwhalctl".to_string(), |p| shell_quote(p));
    // Global options (everything before the subcommand) are kept as given.
    let mut parts = vec![prog];
    parts.extend(global.iter().map(|a| shell_quote(a)));
    match resume {
        Resume::Engines(list) => {
            parts.extend(kept.iter().map(|a| shell_quote(a)));
            parts.push("--resume".into());
            parts.push("--engines".into());
            parts.push(shell_quote(&list.join(",")));
        }
        Resume::ReadmitWave => {
            parts.push("readmit".into());
            parts.push("--wave".into());
        }
        Resume::Readmit(iid) => {
            parts.push("readmit".into());
            parts.push(shell_quote(iid));
        }
    }
    parts.join(" ")
}

/// Quotes `s` for a POSIX shell when it holds anything but plain characters.
fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quote_leaves_plain_words_and_quotes_the_rest() {
        assert_eq!(shell_quote("--router"), "--router");
        assert_eq!(shell_quote("http://10.0.0.5:8001"), "http://10.0.0.5:8001");
        assert_eq!(
            shell_quote("systemctl restart {iid}"),
            "'systemctl restart {iid}'"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
