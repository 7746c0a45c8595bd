//! Test kit for Narwhal: starts the real binaries (engine simulators, routers, agents, etcd) as
//! child processes on loopback, reads the address each one prints on its first stdout line,
//! and kills them on drop. Used by the end-to-end tests in `tests/tests/e2e/` (one binary) and
//! `router/tests/`, by `narwhal-dev` and by `narwhal-bench` (architecture.md section 8).
//!
//! ```text
//!   Fleet::builder()...start()   the world of an end-to-end test (fleet.rs)
//!     SimHandle                  one narwhal-engine-sim; its /sim/* hooks via admin_url()
//!     AgentHandle                one narwhal-agent (a simulated GPU host); attest, fence_file
//!                                and client_as for calls to its API (agent_calls.rs)
//!     RouterHandle               one narwhal-serve, with document helpers (state, lifecycle,
//!                                handoff, ready, metrics, journal events)
//!     Etcd                       a real etcd for the lease backend
//!   events_of / wait_ejected     an engine's breaker events, ejection, readmission (breaker.rs)
//!   faketime                     libfaketime: a router whose wall clock is shifted
//!   Http / Reply                 JSON, SSE and metrics reading (http.rs)
//!   wait_until / eventually      the one way tests wait: poll with a deadline (proc.rs);
//!   blocking_until, poll_blocking  the same for synchronous tests (process.rs, proc.rs)
//!   run / run_within / ctl       a command's exit code and output; narwhalctl (process.rs)
//!   DevUp                        a `narwhal-dev up` session (devup.rs)
//!   router.drain / readmit /     the lifecycle actions, and waits on an engine's lifecycle
//!     cancel_drain               state (lifecycle.rs)
//!   FakeEngine                   an in-process fake engine for router tests (fake.rs)
//!   raw                          HTTP/1 on a TcpStream, for framing tests
//!   kv_events                    vLLM's KV events on the wire (msgpack batches, ZMQ frames)
//!   Proxy, Sampler               network cuts, 20 Hz sampling during HA faults
//!   controller_fleet, Load       role-controller worlds (fixture profile, fast timings) and
//!                                paced load (controller.rs); the section-14 loads, decisions
//!                                by result and reason, bursts (scenario.rs)
//!   faults                       the HA fault campaign: scenarios, one run, judged
//! ```
// Tests and their harness measure wall time (deadlines, takeover gaps): the clock ban of
// clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

mod agent;
mod agent_calls;
pub mod bench_docs;
mod breaker;
mod by_id;
pub mod certs;
mod controller;
pub mod dev_ready;
mod devup;
pub mod disk;
pub mod etcd;
mod fake;
pub mod faketime;
pub mod faults;
mod fleet;
pub mod fsync;
mod http;
pub mod k8s;
pub mod kv_handle;
mod lifecycle;
pub mod ports;
mod proc;
mod process;
mod proxy;
pub mod raw;
pub mod readers;
mod router;
mod sampler;
mod scenario;
mod sim;
pub mod sim_stats;
pub mod sim_tokenizer;

use std::time::Duration;

pub use agent::{
    AgentEngine, AgentHandle, keygen, start_agent, start_agent_for, start_agent_keyed,
    start_agent_with,
};
pub use agent_calls::{client_as, get_text, post_json};
pub use by_id::ById;
pub use controller::{
    HeldStream, Load, LoadStats, Shape, controller_fleet, fast_controller_sections,
    fixture_profile, shared_prefix_prompt, token_prompt, unique_token_prompt,
};
pub use devup::{DevUp, UP_TIMEOUT};
pub use etcd::{Etcd, free_port};
pub use fake::{FakeEngine, Seen, fake_descriptor, router_over_fakes};
pub use fleet::{
    ENGINE_KEY_VAR, Fleet, FleetBuilder, LEASE_TTL_S, LeaseBackend, STANDBY_PROBE_S,
    STANDBY_TAKEOVER_AFTER,
};
pub use http::{
    Answer, AnswerChoice, AnswerMessage, Http, Reply, Usage, answer_text, count, http_client,
    metric, openai_request, sse_data, sse_text, strings, usage_of,
};
pub use ports::{engine_port, engine_ports};
pub use proc::{
    ChildProc, ProcError, START_TIMEOUT, bin_path, eventually, poll_blocking, read_json_file,
    wait_until, write_executable,
};
pub use process::{
    CommandOutput, alive, blocking_until, ctl, exit_within, json_values, run, run_within,
    signal_pid, wait_all_dead,
};
pub use proxy::Proxy;
pub use router::{
    Clients, FleetSpec, JournalMeta, LiveStream, RouterHandle, RouterProbe, handoff_file_where,
    launch_router, launch_router_env, merge, narwhalctl, parse_document, start_router, whole,
};
pub use sampler::{Sample, Sampler};
pub use scenario::{DECIDE, L1, L2, ONE_P_THREE_D, decided, pools, reason_of};
pub use sim::{EngineSpec, MultiEngine, MultiSim, SimHandle, start_sim};

/// vLLM's KV events on the wire (msgpack batches, ZMQ frames): the router's codec in
/// `narwhal-shared`, re-exported for the simulator and the tests.
pub use narwhal_shared::kv_events;

/// Upper bound for a condition an end-to-end test polls for when nothing tighter is asserted
/// (a journal event, a lifecycle state): generous, for a loaded 2-core machine.
pub const WAIT: Duration = Duration::from_secs(20);

/// Journal rows and `/narwhal/state` read as types: request rows with their outcome, event
/// rows, the controller's decisions with typed details (journal_rows.rs).
mod journal_rows;
pub use journal_rows::{
    AdmissionPrice, AttemptFailureRow, DecisionDetails, DecisionRow, EventRow, LegRow, QueueWaits,
    RequestRow, parse_row,
};
/// Typed journal rows: engine and lifecycle events, settled requests (router.rs).
pub use router::EngineEventRow;
