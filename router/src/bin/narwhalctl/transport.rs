//! Transport errors as messages an operator can act on: a TLS refusal (which side, which
//! certificate, which name), a refused connection, plain http to a TLS listener, a timeout;
//! every message names the address connected to.

use std::time::Duration;

use crate::client::Ctl;
use crate::failure::Failure;

/// The next error in a chain. `io::Error::source()` skips the error it wraps (it returns the
/// wrapped error's source), so an `io::Error` is followed into what it wraps instead; that is
/// where rustls puts its error (`io::Error::new(InvalidData, rustls::Error)`), sometimes inside
/// another `io::Error`.
fn next_in_chain<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a (dyn std::error::Error + 'static)> {
    if let Some(io) = err.downcast_ref::<std::io::Error>()
        && let Some(inner) = io.get_ref()
    {
        return Some(inner);
    }
    err.source()
}

/// The `rustls::Error` somewhere in an error's chain (also inside `io::Error`s).
fn rustls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        cur = next_in_chain(err);
    }
    None
}

/// A name rustls lists as presented (`DnsName("a.example")`, `IpAddress(..)`) as the bare name.
fn presented_name(p: &str) -> &str {
    match (p.find('"'), p.rfind('"')) {
        (Some(a), Some(b)) if b > a => &p[a + 1..b],
        _ => p,
    }
}

/// The `io::ErrorKind` somewhere in an error's source chain.
fn io_kind(e: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        cur = next_in_chain(err);
    }
    None
}

/// Full text of an error and its sources, `a: b: c`.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(err) = cur {
        let s = err.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
        cur = err.source();
    }
    parts.join(": ")
}

impl Ctl {
    /// Turns a transport error into a message an operator can act on: names TLS, the client
    /// certificate, or a certificate name mismatch, and always the address connected to.
    pub(crate) async fn transport(&self, what: &str, e: &reqwest::Error) -> Failure {
        let addr = &self.addr;
        let full = chain(e);
        if e.is_timeout() {
            return Failure::Unavailable(format!(
                "{what}: no answer from {addr} within {:.0} s (--request-timeout-s)",
                self.timeout.as_secs_f64()
            ));
        }
        if let Some(r) = rustls_error(e) {
            return Failure::Unavailable(format!("{what}: {}", self.explain_tls(r)));
        }
        if io_kind(e) == Some(std::io::ErrorKind::ConnectionRefused) {
            return Failure::Unavailable(format!(
                "{what}: connection refused by {addr}: nothing listens there (is narwhal-serve running, and is this its --control-listen address?)"
            ));
        }
        if self.router.starts_with("http://") && self.speaks_tls().await {
            return Failure::Unavailable(format!(
                "{what}: the control listener at {addr} speaks TLS (the router's fleet file sets control.tls) and this was plain http: use --router https://{addr} with --ca, --cert and --key (a client certificate from the CA in control.tls.ca) [{full}]"
            ));
        }
        Failure::Unavailable(format!("{what}: {addr}: {full}"))
    }

    fn explain_tls(&self, r: &rustls::Error) -> String {
        use rustls::{AlertDescription as A, CertificateError as C, Error as E};
        let addr = &self.addr;
        match r {
            E::InvalidCertificate(C::NotValidForName) => format!(
                "certificate name mismatch: the certificate the router presented at {addr} is not valid for the name narwhalctl verified; connect by a name it holds or pass --server-name"
            ),
            E::InvalidCertificate(C::NotValidForNameContext {
                expected,
                presented,
            }) => format!(
                "certificate name mismatch: the certificate the router presented at {addr} is not valid for {:?} (it names {}); connect by one of those names or pass --server-name NAME",
                expected.to_str(),
                presented
                    .iter()
                    .map(|p| presented_name(p))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            E::InvalidCertificate(C::UnknownIssuer | C::BadSignature) => format!(
                "TLS: the certificate the router presented at {addr} is not signed by a trusted CA ({r}); {}",
                if self.ca.is_some() {
                    "--ca must be the CA that issued the router's control.tls.cert"
                } else {
                    "pass --ca with the CA that issued the router's control.tls.cert"
                }
            ),
            E::InvalidCertificate(c) => {
                format!("TLS: the certificate the router presented at {addr} is refused: {c:?}")
            }
            E::AlertReceived(A::CertificateRequired) | E::AlertReceived(A::HandshakeFailure)
                if !self.client_cert =>
            {
                format!(
                    "TLS: the router at {addr} requires a client certificate (control.tls is on) and none was given: pass --cert and --key issued by the CA in its control.tls.ca ({r})"
                )
            }
            E::AlertReceived(
                A::UnknownCA
                | A::BadCertificate
                | A::CertificateUnknown
                | A::AccessDenied
                | A::DecryptError
                | A::CertificateExpired
                | A::CertificateRevoked
                | A::UnsupportedCertificate,
            ) => format!(
                "TLS: the router at {addr} refused our client certificate ({r}): --cert must be issued by the CA in the router's control.tls.ca and be valid now"
            ),
            E::InvalidMessage(_) if self.router.starts_with("https://") => format!(
                "TLS: {addr} did not answer TLS ({r}): the control listener has no control.tls; use --router http://{addr}"
            ),
            other => format!("TLS with {addr} failed: {other}"),
        }
    }

    /// Whether the listener at `addr` answers a TLS handshake (any TLS-level answer counts,
    /// an untrusted certificate included).
    async fn speaks_tls(&self) -> bool {
        let url = format!("https://{}/ready", self.addr);
        // Trusts no server: a TLS listener answers with its certificate, which fails to
        // verify, and that failure is the evidence.
        let Ok(cfg) = narwhal_shared::tls::plain_http_client_config() else {
            return false;
        };
        let probe = reqwest::Client::builder()
            .no_proxy()
            .use_preconfigured_tls(cfg)
            .timeout(Duration::from_secs(5))
            .build();
        let Ok(probe) = probe else { return false };
        match probe.get(&url).send().await {
            Ok(_) => true,
            Err(e) => {
                rustls_error(&e).is_some_and(|r| !matches!(r, rustls::Error::InvalidMessage(_)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presented_names_lose_their_wrapper() {
        assert_eq!(
            presented_name(r#"DnsName("router-a.internal")"#),
            "router-a.internal"
        );
        assert_eq!(presented_name("10.0.0.5"), "10.0.0.5");
    }
}
