//! Client completion bodies through the router's ingress rules
//! ([`narwhal_router::fuzzing::ingress`] holds the properties).

/// Checks one body (any bytes: the router reads the body before it knows it is JSON).
pub fn check(data: &[u8]) {
    narwhal_router::fuzzing::ingress(data);
}
