//! The drain action (`POST /narwhal/lifecycle/drain`; handoff-and-lifecycle.md, "Draining
//! engines"; behaviour.md 1.10, 4.3–4.4): the machine holds the targets out of placement, then
//! their process identities are captured through the agents and bound; and what a drain of a
//! role's only live engine does to serving (the 200's `warnings`).

use crate::config::{Backend, Role};
use crate::ha_phase::EpochScope;
use crate::lifecycle::action::{ActionError, Outcome};
use crate::lifecycle::machine::DrainRequest;

use super::{LifecycleDriver, new_wave_id};

impl LifecycleDriver {
    /// Refuses a drain of engines without an agent: such an engine could be held out but never
    /// bound to a process identity, so it could never be readmitted; the drain is refused
    /// instead of wedging it (architecture.md 9.2). Reads only the configuration, so it runs
    /// before the one-action-at-a-time lock.
    ///
    /// # Errors
    /// [`ActionError::NoAgent`] naming the engines, sorted.
    pub(crate) fn check_agents(&self, req: &DrainRequest) -> Result<(), ActionError> {
        let mut agentless: Vec<&str> = self
            .cfg
            .engines
            .iter()
            .enumerate()
            .filter(|(i, e)| {
                (req.engines.contains(&e.iid) || (req.wave && req.engines.is_empty()))
                    && !self.agents().has(*i)
            })
            .map(|(_, e)| e.iid.as_str())
            .collect();
        if agentless.is_empty() {
            return Ok(());
        }
        agentless.sort_unstable();
        Err(ActionError::NoAgent(
            agentless.into_iter().map(String::from).collect(),
        ))
    }

    /// `POST /narwhal/lifecycle/drain` (handoff-and-lifecycle.md, "Draining engines";
    /// behaviour.md 1.10, 4.3–4.4), run by `api` under the one-action-at-a-time lock with
    /// control under `scope` checked, after [`LifecycleDriver::check_agents`]. Every target
    /// leaves placement, then its process identity is recorded. The outcome of an individual
    /// drain carries `warnings` ([`sole_engine_warning`]); a wave's carries none.
    ///
    /// # Errors
    /// [`ActionError::Refused`] by a drain rule (nothing changes);
    /// [`ActionError::FencedDuringDrain`] when control under `scope` ended while identities
    /// were captured; [`ActionError::CaptureFailed`] when an identity could not be recorded
    /// (the engine stays held; the same drain retries).
    pub(crate) async fn drain(
        &self,
        req: DrainRequest,
        scope: EpochScope,
    ) -> Result<Outcome, ActionError> {
        let plan = {
            let live = self.fleet().live_names();
            let mut lc = self.exec.lock();
            let plan = lc
                .begin(self.exec.now(), &req, &live, &new_wave_id())
                .map_err(ActionError::Refused)?;
            self.exec.commit(&mut lc);
            plan
        };
        self.wake.notify_one();
        // Every target is out of placement now; record identities (architecture.md section 4).
        let captured = futures_util::future::join_all(
            plan.capture
                .iter()
                .map(|iid| self.reader.capture(iid, &scope)),
        );
        let captured = tokio::select! {
            c = captured => c,
            () = scope.ended() => Vec::new(),
        };
        if !self.ha().live(&scope) {
            return Err(ActionError::FencedDuringDrain);
        }
        let mut failures = Vec::new();
        {
            let ejected = self.fleet().ejected_names();
            let counts = self.fleet().resident_counts();
            let mut lc = self.exec.lock();
            let t = self.exec.now();
            for (iid, r) in plan.capture.iter().zip(captured) {
                let err = r.as_ref().err().map(ToString::to_string);
                if !lc.bind_identity(t, iid, r, ejected.contains(iid)) {
                    failures.push(format!("{iid}: {}", err.unwrap_or_default()));
                }
            }
            lc.refresh(t, |iid| counts.get(iid).copied().unwrap_or(0));
            self.exec.commit(&mut lc);
        }
        if !self.ha().live(&scope) {
            return Err(ActionError::FencedDuringDrain);
        }
        if !failures.is_empty() {
            failures.sort();
            return Err(ActionError::CaptureFailed(failures));
        }
        Ok(Outcome {
            warnings: (!req.wave).then(|| self.drain_warnings(&plan.targets)),
        })
    }

    /// A drain's `warnings`: a drained engine that was its role's only live engine leaves the
    /// fleet serving aggregated (or, for SGLang without a decode engine, not at all) until one
    /// returns (docs/operate.md; [`sole_engine_warning`]). One line per such target.
    fn drain_warnings(&self, targets: &[String]) -> Vec<String> {
        let fleet = self.fleet();
        fleet.read(|state| {
            targets
                .iter()
                .filter_map(|iid| {
                    let i = fleet.index(iid)?;
                    let role = state.slots()[i].role;
                    let others = state
                        .slots()
                        .iter()
                        .enumerate()
                        .any(|(j, s)| j != i && s.role == role && s.is_live());
                    sole_engine_warning(self.cfg.backend, role, iid, others)
                })
                .collect()
        })
    }

    /// The 200 answer of an individual drain of `targets`, as the drain route builds it
    /// (golden tests, `documents::golden`: a drain without agents is refused before it gets
    /// there).
    #[cfg(test)]
    pub(crate) fn drain_reply_for_test(
        &self,
        targets: &[String],
    ) -> (http::StatusCode, narwhal_shared::documents::LifecycleReply) {
        let mut reply: narwhal_shared::documents::LifecycleReply = self.document("").into();
        reply.warnings = Some(self.drain_warnings(targets));
        (http::StatusCode::OK, reply)
    }
}

/// What draining `iid`, of role `role`, does to serving when no other engine of that role is
/// live (`others_live` false): placement then serves every request aggregated, as one leg
/// without KV transfer (behaviour.md 6.7; docs/http-api.md "Serving"): on the decode
/// engines when the prefill pool is empty; on the prefill engines when a vLLM decode pool is
/// empty; and not at all (503 `no_schedulable_engines`) when an SGLang decode pool is empty,
/// since SGLang serves aggregated only on decode engines. `None` while another engine of the
/// role is live.
fn sole_engine_warning(
    backend: Backend,
    role: Role,
    iid: &str,
    others_live: bool,
) -> Option<String> {
    if others_live {
        return None;
    }
    let r = role.as_str();
    Some(match (backend, role) {
        (_, Role::Prefill) => format!(
            "{iid} was the only live {r} engine: until a {r} engine returns, requests are served aggregated on the decode engines (one leg, no prefill/decode split)"
        ),
        (Backend::Vllm, Role::Decode) => format!(
            "{iid} was the only live {r} engine: until a {r} engine returns, requests are served aggregated on the prefill engines (one leg, no prefill/decode split)"
        ),
        (Backend::Sglang, Role::Decode) => format!(
            "{iid} was the only live {r} engine: until a {r} engine returns, every request is answered 503 no_schedulable_engines (SGLang serves aggregated only on decode engines)"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draining_a_roles_only_live_engine_says_how_traffic_is_served() {
        assert_eq!(
            sole_engine_warning(Backend::Vllm, Role::Prefill, "p0", true),
            None
        );
        let w = sole_engine_warning(Backend::Vllm, Role::Prefill, "p0", false).unwrap();
        assert!(w.starts_with("p0 was the only live prefill engine"), "{w}");
        assert!(w.contains("aggregated on the decode engines"), "{w}");
        let w = sole_engine_warning(Backend::Vllm, Role::Decode, "d0", false).unwrap();
        assert!(w.contains("aggregated on the prefill engines"), "{w}");
        let w = sole_engine_warning(Backend::Sglang, Role::Decode, "d0", false).unwrap();
        assert!(w.contains("503 no_schedulable_engines"), "{w}");
    }
}
