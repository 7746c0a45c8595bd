//! The agent protocol's bodies: what the agent parses from the router (its POST bodies, read
//! with `serde_path_to_error` as the agent's HTTP layer does) and what the router parses from
//! an agent (`GET /v1/engines`, error bodies, signed answers before verification).

use narwhal_shared::SignedDocument;
use narwhal_shared::agent_protocol::{
    EnginesAnswer, ErrorBody, FencedRequest, KvConsumeRequest, KvProduceRequest, ModelRequest,
    ProbeRequest,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Checks one body against every message type.
///
/// # Panics
/// When a parsed message does not serialise, or its JSON does not parse back equal.
pub fn check(data: &[u8]) {
    round_trip::<FencedRequest>(data);
    round_trip::<ModelRequest>(data);
    round_trip::<KvProduceRequest>(data);
    round_trip::<KvConsumeRequest>(data);
    round_trip::<ProbeRequest>(data);
    round_trip::<EnginesAnswer>(data);
    round_trip::<ErrorBody>(data);
    round_trip::<SignedDocument>(data);
}

fn round_trip<T: DeserializeOwned + Serialize + PartialEq + std::fmt::Debug>(data: &[u8]) {
    let mut de = serde_json::Deserializer::from_slice(data);
    // The agent reads a body with `serde_path_to_error` over serde_json's reader, which
    // refuses trailing characters (`end`).
    let Ok(msg) = serde_path_to_error::deserialize::<_, T>(&mut de) else {
        return;
    };
    if de.end().is_err() {
        return;
    }
    let text = serde_json::to_vec(&msg).expect("a parsed message serialises");
    let again: T = serde_json::from_slice(&text).unwrap_or_else(|e| {
        panic!(
            "{}: rendered message does not parse: {e}\n{}",
            std::any::type_name::<T>(),
            String::from_utf8_lossy(&text)
        )
    });
    assert_eq!(
        msg,
        again,
        "{} changed in a round trip",
        std::any::type_name::<T>()
    );
}
