//! Development certificates for mutual TLS between routers, agents and operators (issue 3).
//! Filled in by the engine-agent work; intentionally empty until then.
