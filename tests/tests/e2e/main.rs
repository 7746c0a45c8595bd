//! The end-to-end tests, one test binary with a module per topic (as linkerd2-proxy's
//! integration tests are built): the real `narwhal-serve`, `narwhal-agent` and
//! `narwhal-engine-sim` processes on loopback, driven through the test kit (`tests/src/`).
//!
//! One binary instead of one per file: each test binary links the whole kit and its
//! dependencies, so forty of them spent most of a clean build linking (docs/testing.md, "One
//! test binary"). Run one topic with its module path as the filter:
//!
//! ```text
//! cargo test -p narwhal-testkit --test e2e serving_e2e::
//! cargo test -p narwhal-testkit --test e2e fleet_health_e2e::a_wedged
//! ```
//!
//! The real-vLLM stage stays a binary of its own (`tests/tests/vllm_e2e.rs`): it is built with
//! its own cfg (`NARWHAL_VLLM=1`, `tests/build.rs`) and run as its own CI stage, and building it
//! into this binary would rebuild every topic for that stage.

mod agent_authz_e2e;
mod agent_e2e;
mod bench_compare;
mod bench_prefix;
mod controller_e2e;
mod engine_surface_e2e;
mod fleet_health_e2e;
mod ha_e2e;
mod ha_faults_e2e;
mod handoff_e2e;
mod http2_e2e;
mod http_hygiene_e2e;
mod kubernetes_e2e;
mod kv_events_e2e;
mod kv_placement_e2e;
mod kv_standby_e2e;
mod lifecycle_e2e;
mod llamacpp_e2e;
mod logging_e2e;
mod monitoring_e2e;
mod multi_engine_e2e;
mod narwhal_dev_e2e;
mod narwhalctl_output_e2e;
mod narwhalctl_tls_e2e;
mod operator_e2e;
mod packaging_e2e;
mod pysdk;
mod request_path_e2e;
mod residency_e2e;
mod sdk_e2e;
mod serving_e2e;
mod shutdown_e2e;
mod sim_protocol;
mod streamed_whole_e2e;
mod suspect_e2e;
