//! Every journal row the router writes besides a request's own (`accounting::RequestRow`) and
//! the header: one variant per `event`, serialised with the `event` name first and then the
//! variant's fields in declaration order (the order readers of the reference's journal see).
//! docs/logging.md lists the variants; a test holds the list to this type.

use narwhal_shared::documents::controller as doc;
use serde::Serialize;

use crate::journal::lifecycle::LifecycleEvent;

/// One journal event row, `{"event": <name>, <fields>}`; the journal puts `schema`,
/// `schema_version` and `run` in front. Times (`at`) are wall-clock Unix seconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub(crate) enum Event {
    /// A probe, an agent or a failed rendezvous saw another process behind an engine's URL.
    EngineIdentityChanged {
        /// The engine.
        iid: String,
        /// What changed.
        reason: String,
        /// When.
        at: f64,
    },
    /// An engine's health answered 200 and it entered placement.
    EngineAdmitted {
        /// The engine.
        iid: String,
        /// When.
        at: f64,
    },
    /// The breaker ejected an engine (`cause`: the failure class).
    EngineEjected {
        /// The engine.
        iid: String,
        /// The failure class (`EjectCause::as_str`).
        cause: &'static str,
        /// When.
        at: f64,
    },
    /// An ejected engine returned (`evidence`: `generation` or `lifecycle`).
    EngineReadmitted {
        /// The engine.
        iid: String,
        /// What proved it healthy.
        evidence: &'static str,
        /// When.
        at: f64,
    },
    /// An engine kept in placement because ejecting it would exceed its role's ejection bound.
    EngineDegraded {
        /// The engine.
        iid: String,
        /// The failure class.
        cause: &'static str,
        /// When.
        at: f64,
    },
    /// A generation or stall probe of an engine (`outcome` `passed` without `error`, else
    /// `failed` with it).
    EngineProbe {
        /// The engine.
        iid: String,
        /// `generation` or `stall`.
        kind: &'static str,
        /// `passed` or `failed`.
        outcome: &'static str,
        /// Why it failed, `null` when it passed.
        error: Option<String>,
        /// When.
        at: f64,
    },
    /// A lifecycle transition (drain, wave, readmission; `action` names it).
    EngineLifecycle(LifecycleEvent),
    /// A controller pass failed.
    MonitoringStageFailure {
        /// The stage (`controller`).
        stage: &'static str,
        /// The failure's class.
        class: String,
        /// When.
        at: f64,
        /// Failures in a row.
        consecutive: u64,
    },
    /// A controller decision, with the detail keys it has (controller.md 13).
    ControllerDecision(Box<doc::Decision>),
    /// The engine-side role switch failed; the engine is ejected.
    RoleSwitchFailed {
        /// The engine.
        iid: String,
        /// The role it was moving to.
        to: &'static str,
        /// Why.
        error: String,
        /// When.
        at: f64,
    },
    /// The readmission checks passed against an engine in its new role.
    RoleCheckPassed {
        /// The engine.
        iid: String,
        /// Its new role.
        role: &'static str,
        /// The checks that ran, in order.
        checks: Vec<String>,
        /// When.
        at: f64,
    },
    /// The role check failed; the flip is reversed.
    RoleCheckFailed {
        /// The engine.
        iid: String,
        /// The role it was checked in.
        role: &'static str,
        /// Why.
        error: String,
        /// When.
        at: f64,
    },
    /// The controller moved an engine to decode to restore `min_decode`.
    DecodeFloorRestored {
        /// When.
        at: f64,
        /// The engine moved.
        iid: String,
        /// Live decode engines after the move.
        live_decode: usize,
        /// The floor.
        min_decode: usize,
    },
    /// Live prefill engines fell below `min_prefill`.
    BelowFloor {
        /// When.
        at: f64,
        /// Live prefill engines.
        live_prefill: usize,
        /// The floor.
        min_prefill: usize,
        /// The ejected engines, sorted.
        ejected: Vec<String>,
        /// Quarantined engines (always empty: the router quarantines none; the reference's key).
        quarantined: Vec<String>,
    },
    /// Live prefill engines are back at or above `min_prefill`.
    BelowFloorRecovered {
        /// When.
        at: f64,
        /// How long the breach lasted, seconds.
        duration_s: f64,
        /// Live prefill engines.
        live_prefill: usize,
        /// The floor.
        min_prefill: usize,
    },
}

impl From<LifecycleEvent> for Event {
    fn from(ev: LifecycleEvent) -> Self {
        Event::EngineLifecycle(ev)
    }
}

impl Event {
    /// The row as a JSON value (`event` first), as the journal writes it without the three
    /// leading members.
    pub(crate) fn to_value(&self) -> serde_json::Value {
        // Every variant serialises: plain fields, strings and numbers.
        serde_json::to_value(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The variant names (snake case) declared in this file, read with syn.
    fn declared_events() -> Vec<String> {
        let src = include_str!("event.rs");
        let file = syn::parse_file(src).expect("event.rs parses");
        let mut names = Vec::new();
        for item in file.items {
            if let syn::Item::Enum(e) = item
                && e.ident == "Event"
            {
                {
                    for v in e.variants {
                        let mut snake = String::new();
                        for (i, c) in v.ident.to_string().chars().enumerate() {
                            if c.is_ascii_uppercase() && i > 0 {
                                snake.push('_');
                            }
                            snake.push(c.to_ascii_lowercase());
                        }
                        names.push(snake);
                    }
                }
            }
        }
        names
    }

    /// docs/logging.md's table of journal events lists exactly this type's variants (and the
    /// request row), so the docs cannot drift from what the router writes.
    #[test]
    fn logging_md_lists_every_event_of_the_type() {
        let whole = include_str!("../../../docs/logging.md");
        let from = whole
            .find("## Journal rows")
            .expect("docs/logging.md has a Journal rows section");
        let doc = whole[from + 2..].split("\n## ").next().unwrap_or_default();
        let declared = declared_events();
        assert!(declared.len() > 10, "{declared:?}");
        let listed: Vec<String> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .filter(|n| *n != "event" && n.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .map(str::to_string)
            .collect();
        for name in &declared {
            assert!(
                listed.contains(name),
                "docs/logging.md lists no journal event `{name}` (a variant of journal::Event)"
            );
        }
        let section: Vec<&String> = listed
            .iter()
            .filter(|n| !declared.contains(n) && n.as_str() != "request")
            .collect();
        assert!(
            section.is_empty(),
            "docs/logging.md's event table lists events the router never writes: {section:?}"
        );
    }

    #[test]
    fn rows_put_the_event_name_first_and_fields_in_declared_order() {
        let row = Event::EngineEjected {
            iid: "p0".into(),
            cause: "timeout",
            at: 1.5,
        };
        assert_eq!(
            serde_json::to_string(&row).unwrap(),
            r#"{"event":"engine_ejected","iid":"p0","cause":"timeout","at":1.5}"#
        );
        let row = Event::BelowFloor {
            at: 2.0,
            live_prefill: 0,
            min_prefill: 1,
            ejected: vec!["p0".into()],
            quarantined: Vec::new(),
        };
        assert_eq!(
            serde_json::to_string(&row).unwrap(),
            r#"{"event":"below_floor","at":2.0,"live_prefill":0,"min_prefill":1,"ejected":["p0"],"quarantined":[]}"#
        );
    }
}
