//! Waiting on the breaker (docs/http-api.md, the breaker section; docs/deviations.md, "Engine
//! health and the breaker"): an engine's journal events, its ejection and its readmission, as
//! [`RouterHandle`] methods. Every wait polls for at most [`WAIT`].
//!
//! ```text
//!   router.events_of("engine_ejected", "d1")        journal rows of one event and engine
//!   router.wait_ejected("d1").await                  /narwhal/state lists d1 as ejected
//!   router.first_event("engine_readmitted", "d1")    the first such row, once there is one
//! ```

use narwhal_shared::documents::State;
use serde_json::Value;

use crate::controller::RowHead;
use crate::router::{EngineEventRow, RouterHandle};
use crate::{WAIT, eventually};

impl RouterHandle {
    /// Journal rows of `event` (`engine_ejected`, `engine_readmitted`, `engine_probe`, ...)
    /// about engine `iid`, oldest first.
    pub fn events_of(&self, event: &str, iid: &str) -> Vec<Value> {
        self.journal_rows()
            .into_iter()
            .filter(|r| {
                let head = RowHead::of(r);
                head.event.as_deref() == Some(event) && head.iid.as_deref() == Some(iid)
            })
            .collect()
    }

    /// Waits until the journal holds an `event` row about `iid`; the first one.
    ///
    /// # Panics
    /// When none comes within [`WAIT`].
    pub async fn first_event(&self, event: &str, iid: &str) -> Value {
        eventually(&format!("{event} of {iid}"), WAIT, || async {
            self.events_of(event, iid).first().cloned()
        })
        .await
    }
}

/// The same waits, typed ([`EngineEventRow`], [`State`]).
impl RouterHandle {
    /// [`RouterHandle::events_of`], typed: the journal's `event` rows about engine `iid`,
    /// oldest first.
    pub fn event_rows_of(&self, event: &str, iid: &str) -> Vec<EngineEventRow> {
        self.engine_event_rows()
            .into_iter()
            .filter(|r| r.event == event && r.iid == iid)
            .collect()
    }

    /// [`RouterHandle::first_event`], typed: waits until the journal holds an `event` row about
    /// `iid`; the first one.
    ///
    /// # Panics
    /// When none comes within [`WAIT`].
    pub async fn first_event_typed(&self, event: &str, iid: &str) -> EngineEventRow {
        eventually(&format!("{event} of {iid}"), WAIT, || async {
            self.event_rows_of(event, iid).first().cloned()
        })
        .await
    }

    /// [`RouterHandle::wait_ejected`], typed: waits until `/narwhal/state` lists `iid` among the
    /// ejected engines; that state.
    ///
    /// # Panics
    /// When it does not within [`WAIT`].
    pub async fn wait_ejected(&self, iid: &str) -> State {
        eventually(&format!("{iid} ejected"), WAIT, || async {
            let st = self.state().await;
            st.ejected.iter().any(|x| x == iid).then_some(st)
        })
        .await
    }
}
