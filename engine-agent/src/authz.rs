//! Who may call an agent (docs/security.md, "Identities").
//!
//! ```text
//!   TLS handshake (chain to the fleet CA) ─► leaf certificate ─► Caller (URI SAN
//!   spiffe://narwhal/<role>/<id>, or why there is none) ─► authorize(caller, access)
//!       Access::Fenced (POST: epoch, holder, attestation, checks, probe) ─► router only
//!       Access::Read   (GET /health, /v1/engines, …/process, /metrics)   ─► router or operator
//!       anything else ─► 403 {"error":{"code":"forbidden","rule":…,"message":…}}
//! ```
//! The handshake already proved the certificate chains to the fleet CA; the identity decides
//! what it may do, so an operator's (or a monitoring system's) certificate cannot present an
//! epoch and fence the routers. The rule is pure ([`authorize`]); the HTTP layer attaches the
//! [`Caller`] of each connection and asks.

use narwhal_shared::tls::{FleetIdentity, FleetRole, IdentityError, fleet_identity};

/// The client of one TLS connection, from its leaf certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Its fleet identity, or why it has none usable.
    pub identity: Result<FleetIdentity, IdentityError>,
}

impl Caller {
    /// The caller presenting `der` (the leaf of the verified chain).
    pub fn from_cert(der: &[u8]) -> Caller {
        Caller {
            identity: fleet_identity(der),
        }
    }

    /// A caller without a certificate (only reachable when serving without TLS, i.e. never
    /// from the binary): it has no identity and is refused everything.
    pub fn anonymous() -> Caller {
        Caller {
            identity: Err(IdentityError::Missing { uris: Vec::new() }),
        }
    }

    /// `spiffe://narwhal/router/r1`, or `no fleet identity (...)` for logs and messages.
    pub fn describe(&self) -> String {
        match &self.identity {
            Ok(id) => id.uri(),
            Err(e) => format!("a certificate with {e}"),
        }
    }

    /// The role label for metrics: `router`, `operator`, `agent` or `none`.
    pub fn role_label(&self) -> &'static str {
        match &self.identity {
            Ok(id) => id.role.as_str(),
            Err(_) => "none",
        }
    }
}

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads that change nothing and carry no epoch: `GET /health`, `/v1/engines`,
    /// `/v1/engines/{iid}/process`, `/metrics`.
    Read,
    /// Calls that present an epoch and holder (they can raise the fence) and drive the engine:
    /// attestation, generation and KV checks, probes.
    Fenced,
}

/// A refusal: the rule's id (the `rule` field of the 403 body) and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forbidden {
    /// `router_identity_required` or `fleet_identity_required`.
    pub rule: &'static str,
    /// The rule in words, naming the identity the caller has.
    pub message: String,
}

/// Rule id: fenced calls need a router identity.
pub const RULE_ROUTER: &str = "router_identity_required";
/// Rule id: reads need a router or operator identity.
pub const RULE_FLEET: &str = "fleet_identity_required";

/// Decides whether `caller` may make a call needing `access`.
///
/// # Errors
/// [`Forbidden`] naming the rule.
pub fn authorize(caller: &Caller, access: Access) -> Result<(), Forbidden> {
    let role = caller.identity.as_ref().ok().map(|i| i.role);
    match (access, role) {
        (_, Some(FleetRole::Router)) | (Access::Read, Some(FleetRole::Operator)) => Ok(()),
        (Access::Fenced, _) => Err(Forbidden {
            rule: RULE_ROUTER,
            message: format!(
                "only a router identity (URI SAN spiffe://narwhal/router/<id>) may present an \
                 epoch and holder or run attestations, checks and probes; the caller is {}",
                caller.describe()
            ),
        }),
        (Access::Read, _) => Err(Forbidden {
            rule: RULE_FLEET,
            message: format!(
                "reads need a router or operator identity (URI SAN \
                 spiffe://narwhal/router/<id> or spiffe://narwhal/operator/<id>); the caller is {}",
                caller.describe()
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(uri: Option<&str>) -> Caller {
        Caller {
            identity: match uri.and_then(FleetIdentity::from_uri) {
                Some(i) => Ok(i),
                None => Err(IdentityError::Missing {
                    uris: uri.map(str::to_string).into_iter().collect(),
                }),
            },
        }
    }

    #[test]
    fn only_a_router_may_make_fenced_calls_and_operators_may_read() {
        let router = caller(Some("spiffe://narwhal/router/r1"));
        let operator = caller(Some("spiffe://narwhal/operator/alice"));
        let agent = caller(Some("spiffe://narwhal/agent/gpu-a"));
        let none = caller(None);
        let foreign = caller(Some("spiffe://example.org/router/r1"));
        assert_eq!(authorize(&router, Access::Fenced), Ok(()));
        assert_eq!(authorize(&router, Access::Read), Ok(()));
        assert_eq!(authorize(&operator, Access::Read), Ok(()));
        for c in [&operator, &agent, &none, &foreign] {
            let e = authorize(c, Access::Fenced).unwrap_err();
            assert_eq!(e.rule, RULE_ROUTER, "{c:?}");
            assert!(e.message.contains(&c.describe()), "{e:?}");
        }
        for c in [&agent, &none, &foreign] {
            assert_eq!(authorize(c, Access::Read).unwrap_err().rule, RULE_FLEET);
        }
        assert_eq!(
            authorize(&Caller::anonymous(), Access::Read)
                .unwrap_err()
                .rule,
            RULE_FLEET
        );
    }

    #[test]
    fn identity_uris_are_parsed_strictly() {
        for bad in [
            "spiffe://narwhal/router/",
            "spiffe://narwhal/router",
            "spiffe://narwhal/admin/x",
            "spiffe://narwhal/router/a/b",
            "spiffe://narwhal/router/a b",
            "https://narwhal/router/a",
            "spiffe://narwhalx/router/a",
        ] {
            assert_eq!(FleetIdentity::from_uri(bad), None, "{bad}");
        }
        let id = FleetIdentity::from_uri("spiffe://narwhal/operator/ops-1.example_x").unwrap();
        assert_eq!(id.role, FleetRole::Operator);
        assert_eq!(id.id, "ops-1.example_x");
        assert_eq!(id.uri(), "spiffe://narwhal/operator/ops-1.example_x");
    }
}
