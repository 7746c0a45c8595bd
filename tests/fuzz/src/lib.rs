//! Fuzz targets over every place bytes from outside enter Narwhal (docs/testing.md
//! "Fuzzing"). Each target is a module with `check(data: &[u8])`: it feeds the bytes to the
//! product's own parser and panics when a property breaks. The same `check` runs under AFL++
//! (`src/bin/*.rs`, built by `tests/fuzz/run.sh`) and in `cargo test` (`tests/corpus.rs`
//! replays every committed corpus and regression file).
//!
//! | target | bytes from | property beyond "no panic" |
//! |---|---|---|
//! | `ingress` | a client's completion body | ingress answers agree with `serde_json` and the rules (see `narwhal_router::fuzzing::ingress`) |
//! | `relay` | an engine's SSE body | the relay's byte-level scanner accepts a frame iff `serde_json` does; relayed frames are the engine's JSON minus the stripped members; the SSE parser does not depend on how the bytes are cut |
//! | `handoff` | a handoff document or state file | parse → render → parse gives the same document; a valid document survives the state file |
//! | `lifecycle` | a drain / readmit body | accepted deadlines are in range; refusals have a message |
//! | `fleet_config` | a fleet file | a refusal lists at least one issue, and every issue names its key |
//! | `agent_config` | an agent config file | a refusal names a key |
//! | `agent_protocol` | the agent's request bodies, the router's reading of agent answers | a parsed message serialises and parses back equal |
//! | `attestation` | a signed agent answer | the verifier never accepts a payload other than the one signed |
//! | `kv_events` | ZMQ KV event messages | a decoded batch re-encodes and decodes to an equal batch; the KV index takes any stream |

pub mod agent_config;
pub mod agent_protocol;
pub mod attestation;
pub mod fleet_config;
pub mod handoff;
pub mod ingress;
pub mod kv_events;
pub mod lifecycle;
pub mod relay;

/// A target's property: panics when it breaks for `data`.
pub type Check = fn(&[u8]);

/// Every target: its name (the folder under `corpus/` and `regressions/`, and the binary
/// `fuzz-<name with - for _>`) and its check.
pub const TARGETS: &[(&str, Check)] = &[
    ("ingress", ingress::check),
    ("relay", relay::check),
    ("handoff", handoff::check),
    ("lifecycle", lifecycle::check),
    ("fleet_config", fleet_config::check),
    ("agent_config", agent_config::check),
    ("agent_protocol", agent_protocol::check),
    ("attestation", attestation::check),
    ("kv_events", kv_events::check),
];
