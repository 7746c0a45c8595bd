//! Types and mechanisms shared by the Narwhal router (`narwhal-serve`), the engine agent
//! (`narwhal-agent`) and the test kit: clocks, and (as the agent and HA issues land) the
//! versioned schemas, canonical JSON, Ed25519 signing and rustls configuration builders.
//!
//! Everything here is pure or near-pure so both sides of a protocol use one implementation
//! (DESIGN.md section 2).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod clock;

pub use clock::{Clock, ClockError, ManualClock, SystemClock};
