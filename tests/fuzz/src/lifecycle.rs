//! Lifecycle request bodies (`POST /narwhal/lifecycle/drain`, `.../readmit`, `.../cancel`)
//! through the router's parsers ([`narwhal_router::fuzzing::lifecycle_body`]).

/// Checks one body.
pub fn check(data: &[u8]) {
    narwhal_router::fuzzing::lifecycle_body(data);
}
