//! Test kit for Narwhal: starts the real binaries (engine simulators, routers, agents) as child
//! processes on loopback, reads the address each one prints on its first stdout line, and kills
//! them on drop. Used by the end-to-end tests in `tests/tests/`, by `narwhal-dev` and by
//! `narwhal-bench` (DESIGN.md section 8).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod certs;
pub mod etcd;
mod fleet;
mod proc;

pub use fleet::{
    AgentHandle, EngineSpec, FleetSpec, RouterHandle, SimHandle, start_agent, start_router,
    start_sim,
};
pub use proc::{ChildProc, ProcError, bin_path, wait_until};

/// An HTTP client for loopback traffic: no proxies (CI machines may set `HTTP_PROXY`), and
/// rustls's ring provider installed first (our reqwest build carries no default provider).
pub fn http_client() -> reqwest::ClientBuilder {
    // Installing twice is harmless: the second call returns Err, which is ignored.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().no_proxy()
}
