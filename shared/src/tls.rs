//! rustls configuration builders for router ⇄ agent mutual TLS (architecture.md section 3).
//!
//! ```text
//!   TlsFiles {ca, cert, key} (PEM paths) ──► server_config() ──► agent listener: client cert
//!                                                                 required, chained to `ca`
//!                                        └─► client_config() ──► router: presents `cert`, trusts
//!                                                                 only `ca` for the agent
//! ```
//!
//! Both sides use the ring crypto provider explicitly (no process-wide default needed).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};

/// PEM files for one side of a mutual-TLS connection.
///
/// JSON shape (agent config `tls`, fleet `tls`): `{"ca": PATH, "cert": PATH, "key": PATH}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// Fleet CA certificate(s), PEM: the only roots trusted for the peer.
    pub ca: PathBuf,
    /// This side's certificate chain, PEM (leaf first).
    pub cert: PathBuf,
    /// This side's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Errors building a TLS configuration; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("tls.{field}: cannot read {path}: {source}")]
    Read {
        /// Config key (`ca`, `cert` or `key`).
        field: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file held no usable PEM item of the right kind.
    #[error("tls.{field}: {path} holds no {what}")]
    Empty {
        /// Config key.
        field: &'static str,
        /// The file.
        path: PathBuf,
        /// What was looked for.
        what: &'static str,
    },
    /// rustls refused the material (bad key, mismatched key and certificate, bad CA).
    #[error("tls: {context}: {source}")]
    Rustls {
        /// What was being built.
        context: &'static str,
        /// rustls' error.
        source: rustls::Error,
    },
    /// The client verifier could not be built from the CA.
    #[error("tls.ca: {path}: client verifier: {reason}")]
    Verifier {
        /// CA file.
        path: PathBuf,
        /// Reason.
        reason: String,
    },
}

fn read(field: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        field,
        path: path.to_path_buf(),
        source,
    })
}

/// Reads every certificate in a PEM file.
///
/// # Errors
/// [`TlsError::Read`] or [`TlsError::Empty`] naming `field` and the path.
pub fn load_certs(
    field: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(field, path)?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::Empty {
            field,
            path: path.to_path_buf(),
            what: "CERTIFICATE",
        });
    }
    Ok(certs)
}

/// Reads the first private key in a PEM file.
///
/// # Errors
/// [`TlsError::Read`] or [`TlsError::Empty`] naming `field` and the path.
pub fn load_key(field: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(field, path)?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .ok()
        .flatten()
        .ok_or_else(|| TlsError::Empty {
            field,
            path: path.to_path_buf(),
            what: "PRIVATE KEY",
        })
}

fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in load_certs("ca", path)? {
        store.add(cert).map_err(|source| TlsError::Rustls {
            context: "adding the fleet CA",
            source,
        })?;
    }
    Ok(store)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsFiles {
    /// Server side (the agent): presents `cert`/`key`, requires a client certificate chaining
    /// to `ca`; ALPN `http/1.1`.
    ///
    /// # Errors
    /// Any [`TlsError`], naming the file.
    pub fn server_config(&self) -> Result<ServerConfig, TlsError> {
        let roots = Arc::new(roots(&self.ca)?);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| TlsError::Verifier {
                path: self.ca.clone(),
                reason: e.to_string(),
            })?;
        self.server_config_with(verifier)
    }

    /// Server side without client certificates (the router's self-drain listener, whose
    /// callers authenticate with a bearer token): presents `cert`/`key`; `ca` is not used;
    /// ALPN `http/1.1`.
    ///
    /// # Errors
    /// Any [`TlsError`], naming the file.
    pub fn server_config_without_client_auth(&self) -> Result<ServerConfig, TlsError> {
        self.server_config_with(Arc::new(rustls::server::NoClientAuth))
    }

    /// `cert`/`key` served with `verifier` deciding on client certificates; ALPN `http/1.1`.
    fn server_config_with(
        &self,
        verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    ) -> Result<ServerConfig, TlsError> {
        let mut cfg = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Rustls {
                context: "protocol versions",
                source,
            })?
            .with_client_cert_verifier(verifier)
            .with_single_cert(load_certs("cert", &self.cert)?, load_key("key", &self.key)?)
            .map_err(|source| TlsError::Rustls {
                context: "server certificate and key",
                source,
            })?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(cfg)
    }

    /// Client side (the router, tests): trusts only `ca`, presents `cert`/`key`.
    ///
    /// # Errors
    /// Any [`TlsError`], naming the file.
    pub fn client_config(&self) -> Result<ClientConfig, TlsError> {
        build_client_config(
            ServerTrust::Ca(&self.ca),
            Some(ClientCert {
                cert: &self.cert,
                key: &self.key,
            }),
            &[],
        )
    }
}

/// Which servers a client configuration trusts.
#[derive(Debug)]
pub enum ServerTrust<'a> {
    /// None: for reqwest clients that only speak plain `http://` (engines on loopback; reqwest
    /// is built without a process-wide crypto provider, so it needs a configuration anyway),
    /// and for probes whose evidence is a certificate that fails to verify.
    Nobody,
    /// Only the CA certificate(s) in this PEM file (the fleet CA, etcd's CA).
    Ca(&'a Path),
    /// These roots (the system's trust store, loaded by the caller).
    Roots(RootCertStore),
}

/// The certificate a client presents (mutual TLS).
#[derive(Debug, Clone, Copy)]
pub struct ClientCert<'a> {
    /// Certificate chain, PEM (leaf first).
    pub cert: &'a Path,
    /// Private key, PEM.
    pub key: &'a Path,
}

/// The one rustls client-configuration builder of the workspace (router to agents and to etcd,
/// `narwhalctl`, the agent's and the router's plain-HTTP engine clients, the test kit): the
/// ring provider, rustls' safe default protocol versions, `trust` as the roots, `identity`
/// presented when given, and `alpn` as the ALPN protocols (empty: none offered).
///
/// # Errors
/// [`TlsError::Read`] / [`TlsError::Empty`] naming the file (`ca`, `cert`, `key`);
/// [`TlsError::Rustls`] with context `adding the fleet CA` (an unusable CA certificate) or
/// `client certificate and key` (a key that does not match its certificate).
pub fn build_client_config(
    trust: ServerTrust<'_>,
    identity: Option<ClientCert<'_>>,
    alpn: &[&[u8]],
) -> Result<ClientConfig, TlsError> {
    let roots = match trust {
        ServerTrust::Nobody => RootCertStore::empty(),
        ServerTrust::Ca(ca) => roots(ca)?,
        ServerTrust::Roots(r) => r,
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Rustls {
            context: "protocol versions",
            source,
        })?
        .with_root_certificates(roots);
    let mut cfg = match identity {
        Some(id) => builder
            .with_client_auth_cert(load_certs("cert", id.cert)?, load_key("key", id.key)?)
            .map_err(|source| TlsError::Rustls {
                context: "client certificate and key",
                source,
            })?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(cfg)
}

/// A client configuration that trusts no server and presents no certificate: for reqwest
/// clients that only speak plain `http://` (see [`ServerTrust::Nobody`]).
///
/// # Errors
/// [`TlsError::Rustls`] if the ring provider refuses the default protocol versions.
pub fn plain_http_client_config() -> Result<ClientConfig, TlsError> {
    build_client_config(ServerTrust::Nobody, None, &[])
}

/// What a fleet certificate allows its holder to do with an agent (`docs/security.md`,
/// "Identities").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FleetRole {
    /// A router (primary or standby): may present an epoch and holder, run attestations,
    /// checks and probes, and read.
    Router,
    /// An operator, supervisor or monitoring system (`narwhalctl`, Prometheus): may read.
    Operator,
    /// An agent's own serving certificate: no calls to agents.
    Agent,
}

impl FleetRole {
    /// The path segment of the identity URI: `router`, `operator` or `agent`.
    pub fn as_str(self) -> &'static str {
        match self {
            FleetRole::Router => "router",
            FleetRole::Operator => "operator",
            FleetRole::Agent => "agent",
        }
    }

    fn parse(s: &str) -> Option<FleetRole> {
        match s {
            "router" => Some(FleetRole::Router),
            "operator" => Some(FleetRole::Operator),
            "agent" => Some(FleetRole::Agent),
            _ => None,
        }
    }
}

/// Scheme and trust domain of fleet identity URIs: `spiffe://narwhal/<role>/<id>`.
pub const IDENTITY_URI_PREFIX: &str = "spiffe://narwhal/";

/// The identity a fleet certificate carries: one URI SAN `spiffe://narwhal/<role>/<id>`, with
/// `role` one of `router`, `operator`, `agent` and `id` made of letters, digits, `-`, `_`, `.`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetIdentity {
    /// The role.
    pub role: FleetRole,
    /// The member's id (`router-a`, `alice`, `gpu-a`).
    pub id: String,
}

impl FleetIdentity {
    /// `spiffe://narwhal/<role>/<id>`, the URI SAN to issue.
    pub fn uri(&self) -> String {
        format!("{IDENTITY_URI_PREFIX}{}/{}", self.role.as_str(), self.id)
    }

    /// Parses `spiffe://narwhal/<role>/<id>`; None for any other URI.
    pub fn from_uri(uri: &str) -> Option<FleetIdentity> {
        let rest = uri.strip_prefix(IDENTITY_URI_PREFIX)?;
        let (role, id) = rest.split_once('/')?;
        let role = FleetRole::parse(role)?;
        let id_ok = !id.is_empty()
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        id_ok.then(|| FleetIdentity {
            role,
            id: id.to_string(),
        })
    }
}

impl std::fmt::Display for FleetIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.uri())
    }
}

/// Why a certificate carries no usable fleet identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The DER is not an X.509 certificate.
    #[error("not an X.509 certificate: {0}")]
    Unparsable(String),
    /// No URI SAN of the form `spiffe://narwhal/<role>/<id>`.
    #[error(
        "no URI SAN of the form spiffe://narwhal/<router|operator|agent>/<id> (URI SANs: {uris:?})"
    )]
    Missing {
        /// The URI SANs the certificate has.
        uris: Vec<String>,
    },
    /// Several fleet identities with different roles: refused rather than guessed.
    #[error("more than one fleet role in the URI SANs: {uris:?}")]
    Ambiguous {
        /// The identity URIs found.
        uris: Vec<String>,
    },
}

fn parse_cert(der: &[u8]) -> Result<x509_parser::certificate::X509Certificate<'_>, IdentityError> {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, c)| c)
        .map_err(|e| IdentityError::Unparsable(e.to_string()))
}

/// The fleet identity of a (DER) certificate: its `spiffe://narwhal/<role>/<id>` URI SANs.
/// Several URIs naming the same role are fine (the first id is kept); two roles are
/// [`IdentityError::Ambiguous`].
///
/// # Errors
/// [`IdentityError`].
pub fn fleet_identity(der: &[u8]) -> Result<FleetIdentity, IdentityError> {
    let cert = parse_cert(der)?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| IdentityError::Unparsable(e.to_string()))?;
    let uris: Vec<String> = san
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::URI(u) => Some((*u).to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let found: Vec<FleetIdentity> = uris
        .iter()
        .filter_map(|u| FleetIdentity::from_uri(u))
        .collect();
    match found.first() {
        None => Err(IdentityError::Missing { uris }),
        Some(first) if found.iter().all(|f| f.role == first.role) => Ok(first.clone()),
        Some(_) => Err(IdentityError::Ambiguous {
            uris: found.iter().map(FleetIdentity::uri).collect(),
        }),
    }
}

/// `notAfter` of a (DER) certificate, Unix seconds.
///
/// # Errors
/// [`IdentityError::Unparsable`].
pub fn not_after_unix(der: &[u8]) -> Result<i64, IdentityError> {
    Ok(parse_cert(der)?.validity().not_after.timestamp())
}
