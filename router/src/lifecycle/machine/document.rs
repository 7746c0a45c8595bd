//! The lifecycle document, schema `narwhal.lifecycle` version 1 (handoff-and-lifecycle.md,
//! "Lifecycle API"; behaviour.md 4.11), as the machine renders it.

use narwhal_shared::documents::lifecycle as doc;
use narwhal_shared::handoff::DrainState;

use super::Lifecycle;
use super::record::{Record, wave_str};

/// What the document needs to know about one engine beyond its record.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct EngineView {
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
    /// `router.controller` is left `None`: the driver names the controller it saw.
    pub(crate) fn document(
        &self,
        controls_fleet: &str,
        ready: bool,
        view: impl Fn(&str) -> EngineView,
        error: &str,
    ) -> doc::Lifecycle {
        let engines = self
            .all_sorted()
            .into_iter()
            .map(|iid| {
                let v = view(&iid);
                let rec = self.records.get(&iid);
                let state = rec.map_or(DrainState::Active, |r| r.state);
                let engine = doc::Engine {
                    state,
                    draining: state != DrainState::Active,
                    accepts_new: v.accepts_new && state == DrainState::Active,
                    ready_to_stop: self.ready_to_stop(&iid),
                    resident: doc::Resident {
                        prefill: u64::from(v.resident_prefill),
                        decode: u64::from(v.resident_decode),
                    },
                    deadline_at: rec.map(|r| r.deadline_at),
                    restart_required: rec.is_some_and(Record::restart_required),
                    wave_id: rec.map_or("", |r| wave_str(r, &self.wave_id)).to_string(),
                    old_process_start: rec.and_then(|r| r.old_process_start),
                    new_process_start: rec.and_then(|r| r.new_process_start),
                    checks: rec.map_or_else(Vec::new, |r| r.checks.clone()),
                    error: rec.map_or("", |r| r.error.as_str()).to_string(),
                };
                (iid, engine)
            })
            .collect();
        doc::Lifecycle {
            schema: doc::LIFECYCLE_SCHEMA.to_string(),
            schema_version: doc::LIFECYCLE_VERSION,
            router: doc::RouterView {
                controls_fleet: controls_fleet.to_string(),
                ready,
                controller: None,
            },
            wave: doc::Wave {
                id: self.wave_id.clone(),
                active: !self.wave_id.is_empty(),
                readiness_withdrawn: !self.blocked_reason.is_empty(),
                ready_to_stop: self.wave_ready_to_stop(),
            },
            engines,
            events: self.events.iter().cloned().collect(),
            engine_restart_policy: self.policy.as_str().to_string(),
            process_starts: self.process_starts.clone(),
            error: error.to_string(),
        }
    }
}
