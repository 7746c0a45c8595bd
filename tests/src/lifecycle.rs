//! The router's lifecycle actions as [`RouterHandle`] methods: `POST
//! /narwhal/lifecycle/{drain,readmit,cancel-drain}` with a JSON body (docs/http-api.md; the
//! lifecycle API of docs/design/handoff-and-lifecycle.md).
//!
//! ```text
//!   router.drain(&DrainBody::engine("d0", 30.0)).await   -> (status, LifecycleReply)
//!   router.readmit(&ReadmitBody::wave()).await
//!   router.cancel_drain(&ReadmitBody::engine("p1")).await
//!   router.drain_engine("d0").await / router.readmit_engine("d0").await   {"engines": [iid]}
//!   router.engine_state_until("d0", DrainState::Drained).await    polls GET /narwhal/lifecycle
//!   router.drain_to_complete("d0").await    drain (200), then its drain_complete event
//! ```
//!
//! Each answers `(status, body)`, the body parsed, and (like
//! [`RouterHandle::lifecycle_post`], which they use) asserts that the body is the full lifecycle
//! document whatever the status.

use narwhal_shared::documents::requests::{DrainBody, ReadmitBody};
use narwhal_shared::documents::{Lifecycle, LifecycleReply};
use narwhal_shared::handoff::DrainState;

use crate::router::{EngineEventRow, RouterHandle};

/// The lifecycle actions and their journal events, typed: the bodies are
/// [`DrainBody`]/[`ReadmitBody`], the answers [`LifecycleReply`] (through
/// [`RouterHandle::lifecycle_post`], which asserts that every reply is the full document), the
/// events [`EngineEventRow`]s.
impl RouterHandle {
    /// `POST /narwhal/lifecycle/drain` with `body`: `(status, reply)`.
    pub async fn drain(&self, body: &DrainBody) -> (u16, LifecycleReply) {
        self.lifecycle_post("drain", body).await
    }

    /// `POST /narwhal/lifecycle/readmit` with `body`: `(status, reply)`.
    pub async fn readmit(&self, body: &ReadmitBody) -> (u16, LifecycleReply) {
        self.lifecycle_post("readmit", body).await
    }

    /// `POST /narwhal/lifecycle/cancel-drain` with `body`: `(status, reply)`.
    pub async fn cancel_drain(&self, body: &ReadmitBody) -> (u16, LifecycleReply) {
        self.lifecycle_post("cancel-drain", body).await
    }

    /// [`RouterHandle::drain`] of engine `iid` alone, no deadline: `{"engines": [iid]}`.
    pub async fn drain_engine(&self, iid: &str) -> (u16, LifecycleReply) {
        let body = DrainBody {
            engines: vec![iid.to_string()],
            ..DrainBody::default()
        };
        self.drain(&body).await
    }

    /// [`RouterHandle::readmit`] of engine `iid` alone: `{"engines": [iid]}`.
    pub async fn readmit_engine(&self, iid: &str) -> (u16, LifecycleReply) {
        self.readmit(&ReadmitBody::engine(iid)).await
    }

    /// Drains engine `iid` alone, which must answer 200, and waits for its `drain_complete`
    /// journal event ([`RouterHandle::journal_event`]); the drain's reply.
    ///
    /// # Panics
    /// When the drain is refused or never completes.
    pub async fn drain_to_complete(&self, iid: &str) -> LifecycleReply {
        let (status, doc) = self.drain_engine(iid).await;
        assert_eq!(status, 200, "{doc:#?}");
        self.journal_event("drain_complete", Some(iid)).await;
        doc
    }

    /// Polls `/narwhal/lifecycle` (for at most [`crate::WAIT`]) until engine `iid` is in
    /// `state`; that document.
    ///
    /// # Panics
    /// When it never is.
    pub async fn engine_state_until(&self, iid: &str, state: DrainState) -> Lifecycle {
        let what = format!("{iid} {}", state.as_str());
        self.lifecycle_until(&what, |d| d.engine(iid).is_some_and(|e| e.state == state))
            .await
    }

    /// The journal's lifecycle events (`event: engine_lifecycle`), oldest first, typed.
    pub fn lifecycle_event_rows(&self) -> Vec<EngineEventRow> {
        self.engine_event_rows()
            .into_iter()
            .filter(|e| e.event == "engine_lifecycle")
            .collect()
    }
}
