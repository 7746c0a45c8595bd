//! Test kit for Narwhal: starts the real binaries (engine simulators, routers, agents) as child
//! processes on loopback, reads the address each one prints on its first stdout line, and kills
//! them on drop. Used by the end-to-end tests in `tests/tests/`, by `narwhal-dev` and by
//! `narwhal-bench` (DESIGN.md section 8).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod certs;
mod fleet;
mod proc;

pub use fleet::{EngineSpec, FleetSpec, RouterHandle, SimHandle, start_router, start_sim};
pub use proc::{ChildProc, ProcError, bin_path, wait_until};
