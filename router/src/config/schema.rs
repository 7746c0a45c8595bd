//! The fleet-file keys `narwhal-serve` accepts, read from the validator itself, and the check
//! that `docs/configuration.md` documents exactly those keys (one truth in the docs).
//!
//! ```text
//!  {} ──Checker::fleet──► objects checked + their known keys ──fill every key with {} ([{}]
//!   ▲                                                            where an array is expected)──┐
//!   └──────────────────────────────── until nothing new ──────────────────────────────────────┘
//!  ──► accepted_keys(): {"serving.max_attempts", "engines[].agent.url", ...}
//! ```
//!
//! The validator's `obj(path, value, known)` calls are the single source: a key added to a
//! `known` list is accepted by the binary, so it appears here, and the unit test below fails
//! until a row documents it. Objects the validator only walks when they are present
//! (`engines[].agent`, `engine_contract`, ...) are reached because the probe fills every known
//! key with an empty object and walks again, until no new object appears.

use std::collections::BTreeSet;

use serde_json::{Value, json};

use super::{Checker, ConfigIssue};

/// Rounds of the probe before giving up (the schema is a few levels deep).
const MAX_ROUNDS: usize = 16;

/// `engines[3].agent` → `engines[].agent`: array indexes dropped, as the docs name keys.
fn normalise(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut in_index = false;
    for c in path.chars() {
        match c {
            '[' => {
                in_index = true;
                out.push('[');
            }
            ']' => {
                in_index = false;
                out.push(']');
            }
            _ if in_index => {}
            _ => out.push(c),
        }
    }
    out
}

/// The value at a dotted validator path (`engines[0].agent`, `""` for the root), if present.
fn at_mut<'a>(doc: &'a mut Value, path: &str) -> Option<&'a mut Value> {
    if path.is_empty() {
        return Some(doc);
    }
    let mut cur = doc;
    for seg in path.split('.') {
        let (key, index) = match seg.split_once('[') {
            Some((k, rest)) => (k, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (seg, None),
        };
        cur = cur.get_mut(key)?;
        if let Some(i) = index {
            cur = cur.get_mut(i)?;
        }
    }
    Some(cur)
}

/// Every dotted key the fleet-file validator accepts (`_` comment keys aside), with array
/// elements written `[]` (`engines[].agent.agent_id`). Includes keys that are accepted only
/// to be refused with a specific message (`lease.auth.password`).
pub(crate) fn accepted_keys() -> BTreeSet<String> {
    let no_env = |_: &str| None;
    let mut doc = json!({});
    let mut objects = Vec::new();
    for _ in 0..MAX_ROUNDS {
        let mut c = Checker {
            issues: Vec::new(),
            env: &no_env,
            objects: Vec::new(),
        };
        c.fleet(&doc);
        let mut changed = false;
        // Where the validator wants an array, give it one element to walk.
        for issue in &c.issues {
            if let ConfigIssue::Type { path, expected, .. } = issue
                && expected.contains("array")
                && let Some(v) = at_mut(&mut doc, path)
                && v.is_object()
            {
                *v = json!([{}]);
                changed = true;
            }
        }
        for (path, known) in &c.objects {
            let Some(Value::Object(map)) = at_mut(&mut doc, path) else {
                continue;
            };
            for k in known {
                if !map.contains_key(k) {
                    map.insert(k.clone(), json!({}));
                    changed = true;
                }
            }
        }
        objects = c.objects;
        if !changed {
            break;
        }
    }
    objects
        .iter()
        .flat_map(|(path, known)| {
            let parent = normalise(path);
            known.iter().map(move |k| {
                if parent.is_empty() {
                    k.clone()
                } else {
                    format!("{parent}.{k}")
                }
            })
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod docs {
    //! Reading the reference tables of the docs (between `<!-- BEGIN name -->` and
    //! `<!-- END name -->` markers).

    use std::collections::BTreeMap;
    use std::path::PathBuf;

    /// `docs/<file>` of this checkout.
    pub(crate) fn read(file: &str) -> String {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../docs")
            .join(file);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// The text between `<!-- BEGIN name` and `<!-- END name` in `text`.
    pub(crate) fn section<'a>(text: &'a str, file: &str, name: &str) -> &'a str {
        let begin = format!("<!-- BEGIN {name}");
        let end = format!("<!-- END {name}");
        let start = text
            .find(&begin)
            .unwrap_or_else(|| panic!("docs/{file}: no `{begin} -->` marker"));
        let stop = text[start..]
            .find(&end)
            .unwrap_or_else(|| panic!("docs/{file}: no `{end} -->` marker after `{begin}`"));
        &text[start..start + stop]
    }

    /// The `code` spans of a piece of Markdown.
    pub(crate) fn code_spans(s: &str) -> Vec<&str> {
        s.split('`').skip(1).step_by(2).collect()
    }

    /// Table rows of `section`, keyed by the section heading they are under: `(heading, first
    /// cell)` for every row that is not a header or separator row. Rows keep their line.
    pub(crate) fn rows(section: &str) -> Vec<(String, String, usize)> {
        let mut heading = String::new();
        let mut out = Vec::new();
        let mut header_next = false;
        for (n, line) in section.lines().enumerate() {
            let t = line.trim();
            if let Some(h) = t.strip_prefix('#') {
                heading = h.trim_start_matches('#').trim().to_string();
                header_next = true;
                continue;
            }
            if !t.starts_with('|') {
                header_next = true;
                continue;
            }
            if header_next {
                // The header row of a table.
                header_next = false;
                continue;
            }
            let first = t.trim_matches('|').split('|').next().unwrap_or("").trim();
            if first.chars().all(|c| c == '-' || c == ':' || c == ' ') {
                continue;
            }
            out.push((heading.clone(), first.to_string(), n + 1));
        }
        out
    }

    /// The dotted keys the `fleet-keys` tables document, each with the heading it is under:
    /// a heading's code spans are prefixes (`### \`serving\``; `### Top level` has none), a
    /// row's first-cell code spans are keys relative to each prefix.
    pub(crate) fn fleet_keys(text: &str) -> BTreeMap<String, String> {
        let mut keys = BTreeMap::new();
        for (heading, first, _) in rows(section(text, "configuration.md", "fleet-keys")) {
            let mut prefixes: Vec<&str> = code_spans(&heading);
            if prefixes.is_empty() {
                prefixes.push("");
            }
            for p in &prefixes {
                for k in code_spans(&first) {
                    let key = if p.is_empty() {
                        k.to_string()
                    } else {
                        format!("{p}.{k}")
                    };
                    keys.insert(key, heading.clone());
                }
            }
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_reaches_objects_walked_only_when_present() {
        let keys = accepted_keys();
        for k in [
            "schema",
            "engines",
            "engines[].iid",
            "engines[].agent.agent_id",
            "engines[].shared_device.gpu_uuid",
            "engine_contract.image_digest",
            "controller.thresholds.expand",
            "recovery.health.window_s",
            "lease.tls.ca",
            "lease.auth.password_file",
            "tls.cert",
            "control.tls.key",
        ] {
            assert!(keys.contains(k), "{k} missing from {keys:?}");
        }
        assert!(
            keys.iter()
                .all(|k| !k.contains("[0]") && !k.starts_with('.')),
            "{keys:?}"
        );
    }

    /// `docs/configuration.md` documents every fleet-file key the binary
    /// accepts, and no key it refuses. Fails naming the key and where its row goes.
    #[test]
    fn configuration_md_documents_exactly_the_accepted_fleet_keys() {
        let text = docs::read("configuration.md");
        let documented = docs::fleet_keys(&text);
        let accepted = accepted_keys();
        let mut problems = Vec::new();
        for k in &accepted {
            if !documented.contains_key(k) {
                let (parent, leaf) = k.rsplit_once('.').unwrap_or(("", k.as_str()));
                let table = if parent.is_empty() {
                    "the `### Top level` table".to_string()
                } else {
                    format!("the table under the heading \"### `{parent}`\" (create it if missing)")
                };
                problems.push(format!(
                    "fleet key `{k}` is accepted by narwhal-serve (router/src/config/check/) but not documented: add a row `| \\`{leaf}\\` | ... |` to {table} in docs/configuration.md, between the fleet-keys markers"
                ));
            }
        }
        for (k, heading) in &documented {
            if !accepted.contains(k) {
                problems.push(format!(
                    "docs/configuration.md documents fleet key `{k}` (under \"{heading}\") but narwhal-serve refuses it as an unknown key: fix or remove the row, or add the key to the validator in router/src/config/check/"
                ));
            }
        }
        assert!(problems.is_empty(), "\n{}\n", problems.join("\n"));
    }
}
