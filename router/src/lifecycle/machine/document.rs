//! The lifecycle document, schema `narwhal.lifecycle` version 1 (handoff-and-lifecycle.md,
//! "Lifecycle API"; behaviour.md 4.11), as the machine renders it.

use narwhal_shared::handoff::DrainState;
use serde_json::{Map, Value, json};

use super::Lifecycle;
use super::record::{Record, wave_str};

/// What the document needs to know about one engine beyond its record.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineView {
    /// Requests of this engine in their prefill leg.
    pub resident_prefill: u32,
    /// Requests of this engine in their decode leg.
    pub resident_decode: u32,
    /// Eligible for new placement (not held, ejected, quarantined).
    pub accepts_new: bool,
}

impl Lifecycle {
    /// The lifecycle document, schema `narwhal.lifecycle` version 1 (handoff-and-lifecycle.md,
    /// "Lifecycle API", behaviour.md 4.11; `router.controls_fleet` is `"active"`, `"standby"` or
    /// `"fenced"`, architecture.md 9.1). `view(iid)` gives resident counts and placement
    /// eligibility; `error` is the rejected action's message, `""` on success.
    pub fn document(
        &self,
        controls_fleet: &str,
        ready: bool,
        view: impl Fn(&str) -> EngineView,
        error: &str,
    ) -> Value {
        let mut engines = Map::new();
        for iid in self.all_sorted() {
            let v = view(&iid);
            let rec = self.records.get(&iid);
            let state = rec.map_or(DrainState::Active, |r| r.state);
            engines.insert(
                iid.clone(),
                json!({
                    "state": state.as_str(),
                    "draining": state != DrainState::Active,
                    "accepts_new": v.accepts_new && state == DrainState::Active,
                    "ready_to_stop": self.ready_to_stop(&iid),
                    "resident": {"prefill": v.resident_prefill, "decode": v.resident_decode},
                    "deadline_at": rec.map(|r| r.deadline_at),
                    "restart_required": rec.is_some_and(Record::restart_required),
                    "wave_id": rec.map_or("", |r| wave_str(r, &self.wave_id)),
                    "old_process_start": rec.and_then(|r| r.old_process_start),
                    "new_process_start": rec.and_then(|r| r.new_process_start),
                    "checks": rec.map_or(&[][..], |r| r.checks.as_slice()),
                    "error": rec.map_or("", |r| r.error.as_str()),
                }),
            );
        }
        json!({
            "schema": "narwhal.lifecycle",
            "schema_version": 1,
            "router": {"controls_fleet": controls_fleet, "ready": ready},
            "wave": {
                "id": self.wave_id,
                "active": !self.wave_id.is_empty(),
                "readiness_withdrawn": !self.blocked_reason.is_empty(),
                "ready_to_stop": self.wave_ready_to_stop(),
            },
            "engines": engines,
            "events": self.events.iter().collect::<Vec<_>>(),
            "engine_restart_policy": self.policy.as_str(),
            "process_starts": self.process_starts,
            "error": error,
        })
    }
}
