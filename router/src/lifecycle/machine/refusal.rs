//! Why the machine refuses a lifecycle action ([`LifecycleError`]): the rules of drain,
//! readmission and cancel-drain, each with the reference's wording (behaviour.md 4.3, 4.7, 1.10).

/// A rejected lifecycle action: each maps to HTTP 409 with the message as the document's
/// `error` (behaviour.md 4.3, 4.7, 1.10; the wording is the reference's, byte for byte,
/// because supervisors match on it).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum LifecycleError {
    /// Non-wave drain under `whole_wave`.
    #[error("engine_restart_policy requires a whole-wave drain")]
    PolicyRequiresWave,
    /// Ids not in the fleet file.
    #[error("unknown engine(s): {}", .0.join(", "))]
    UnknownEngines(Vec<String>),
    /// `deadline_s` not finite or not positive.
    #[error("deadline_s must be positive")]
    BadDeadline,
    /// `deadline_s` over [`MAX_DEADLINE_S`](super::MAX_DEADLINE_S).
    #[error("deadline_s must be at most 31536000 (one year)")]
    DeadlineTooLong,
    /// A repeated drain names another `deadline_s` than the accepted one: refused rather
    /// than silently keeping the old deadline; repeat it without
    /// `deadline_s` or with the same value.
    #[error(
        "a drain of {iid} is already active with deadline_s {deadline_s}; repeat it without deadline_s or with the same value"
    )]
    DeadlineConflict {
        /// The engine whose drain is active.
        iid: String,
        /// Its accepted deadline, seconds.
        deadline_s: f64,
    },
    /// A wave drain that does not name every engine.
    #[error("a whole-wave drain must name every configured engine")]
    WaveMustNameAll,
    /// A non-wave drain of zero or several engines.
    #[error("a non-wave drain must name exactly one engine")]
    NonWaveExactlyOne,
    /// Another lifecycle action holds these engines.
    #[error("lifecycle action already active for {}", .0.join(", "))]
    AlreadyActive(Vec<String>),
    /// Draining this engine would leave nothing to place on.
    #[error("the last schedulable engine requires a whole-wave drain")]
    LastSchedulable,
    /// A wave readmission that does not name exactly the active wave.
    #[error("whole-wave readmission must name the active wave's complete engine set")]
    WaveReadmitSet,
    /// An individual readmission while a wave is active.
    #[error("an active whole wave must be validated and readmitted as one engine set")]
    WaveActive,
    /// An individual readmission of zero or several engines.
    #[error("readmission must name exactly one engine")]
    ReadmitExactlyOne,
    /// A readmission target that is not drained or blocked.
    #[error("{iid} is {state}, expected drained")]
    NotDrained {
        /// The engine.
        iid: String,
        /// Its state's name.
        state: &'static str,
    },
    /// A planned restart without a recorded pre-restart identity.
    #[error("{0} has no recorded pre-restart process identity")]
    NoPreRestartIdentity(String),
    /// A cancel-drain of zero or several engines, or with `wave` (ours; docs/deviations.md).
    #[error(
        "cancel-drain must name exactly one engine (a whole wave is readmitted as one set after a restart)"
    )]
    CancelExactlyOne,
    /// A cancel-drain of an engine no drain holds.
    #[error(
        "{iid} is {state}: only a draining, drained, deadline_exceeded or blocked drain can be cancelled"
    )]
    CancelNotHeld {
        /// The engine.
        iid: String,
        /// Its state's name.
        state: &'static str,
    },
    /// A cancel-drain of a member of the active whole wave.
    #[error(
        "{0} is held by the active whole wave: a wave is readmitted as one set after a restart (readmit with wave: true)"
    )]
    CancelInWave(String),
    /// A cancel-drain of an engine held by a failed breaker recovery, not a drain.
    #[error("{0} is held by a breaker recovery, not a drain: it returns through its recovery")]
    CancelNotADrain(String),
    /// A cancel-drain of a drain that never recorded the process it holds.
    #[error(
        "{0} has no recorded process identity (the drain could not record one): repeat the drain once its agent answers, or restart it and readmit"
    )]
    CancelNoIdentity(String),
}
