//! Development certificates for mutual TLS between routers, agents and operators
//! (architecture.md section 3).
//!
//! ```text
//!   make_dev_certs(dir, ["router", "standby", "ctl", "agent-gpu-a", ...])
//!     dir/ca.pem                      self-signed fleet CA (ECDSA P-256), key kept in memory only
//!     dir/NAME.pem, dir/NAME.key      leaf per name, signed by the CA; key mode 0600
//! ```
//! Every leaf has DNS/IP SANs `localhost`, `127.0.0.1` and `NAME`, both the server-auth and the
//! client-auth extended key usages, and the URI SAN of its fleet identity
//! (`spiffe://narwhal/<role>/<id>`, docs/security.md "Identities"), which
//! decides what it may ask an agent. [`make_dev_certs`] infers the role from the name:
//!
//! | name | role | identity URI |
//! |---|---|---|
//! | `router`, `standby`, `router-*`, `standby-*` | router | `spiffe://narwhal/router/NAME` |
//! | `ctl`, `operator`, `narwhalctl`, `ctl-*`, `operator-*` | operator | `spiffe://narwhal/operator/NAME` |
//! | `agent-<id>` | agent | `spiffe://narwhal/agent/<id>` |
//!
//! [`make_certs`] takes explicit roles, including [`DevRole::Unrecognised`] (no identity URI).
//! Calling either twice makes two unrelated CAs (tests use that for "a certificate from another
//! CA"). For production, `docs/security.md` shows how to issue the same files from a real CA.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use narwhal_shared::tls::{FleetIdentity, FleetRole};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The identity a dev certificate carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevRole {
    /// `spiffe://narwhal/router/NAME`: may fence and run checks.
    Router,
    /// `spiffe://narwhal/operator/NAME`: may read agents (and drive the router's control API).
    Operator,
    /// `spiffe://narwhal/agent/<id>` for `agent-<id>`: an agent's serving certificate.
    Agent,
    /// No identity URI at all (a fleet-CA certificate that agents refuse).
    Unrecognised,
}

impl DevRole {
    /// The role [`make_dev_certs`] gives `name` (table in the module doc); None if none fits.
    pub fn for_name(name: &str) -> Option<DevRole> {
        let starts = |p: &str| name.starts_with(p) && name.len() > p.len();
        if matches!(name, "router" | "standby") || starts("router-") || starts("standby-") {
            Some(DevRole::Router)
        } else if matches!(name, "ctl" | "operator" | "narwhalctl")
            || starts("ctl-")
            || starts("operator-")
        {
            Some(DevRole::Operator)
        } else if starts("agent-") {
            Some(DevRole::Agent)
        } else {
            None
        }
    }

    /// The fleet identity of a certificate `name` with this role (None for `Unrecognised`).
    pub fn identity(self, name: &str) -> Option<FleetIdentity> {
        let (role, id) = match self {
            DevRole::Router => (FleetRole::Router, name),
            DevRole::Operator => (FleetRole::Operator, name),
            DevRole::Agent => (
                FleetRole::Agent,
                name.strip_prefix("agent-").unwrap_or(name),
            ),
            DevRole::Unrecognised => return None,
        };
        Some(FleetIdentity {
            role,
            id: id.to_string(),
        })
    }
}

/// Why certificates could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen refused a parameter (e.g. a name that is not a valid DNS name).
    #[error("certificate for {name:?}: {source}")]
    Rcgen {
        /// Certificate name (`ca` for the CA).
        name: String,
        /// rcgen's error.
        source: rcgen::Error,
    },
    /// A name is not a DNS label sequence (letters, digits, `-`, `.`), so it cannot be a SAN
    /// or a file name.
    #[error("certificate name {name:?} must be letters, digits, '-' and '.' only")]
    Name {
        /// The offending name.
        name: String,
    },
    /// [`make_dev_certs`] cannot tell the role from the name (see the module doc).
    #[error(
        "certificate name {name:?}: no role (router, standby, router-*, standby-*, ctl, operator, \
         narwhalctl, ctl-*, operator-*, agent-<id>); use make_certs with an explicit role"
    )]
    Role {
        /// The offending name.
        name: String,
    },
    /// A file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// I/O error.
        source: std::io::Error,
    },
}

/// The files [`make_dev_certs`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevCerts {
    /// Directory holding the files.
    pub dir: PathBuf,
    /// `dir/ca.pem`.
    pub ca: PathBuf,
    /// Names a leaf was made for, in order.
    pub names: Vec<String>,
}

impl DevCerts {
    /// `dir/NAME.pem`.
    pub fn cert(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.pem"))
    }

    /// `dir/NAME.key`.
    pub fn key(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.key"))
    }

    /// `{ca, cert, key}` for `name`, the `tls` section of agent and fleet configs.
    pub fn tls_files(&self, name: &str) -> narwhal_shared::TlsFiles {
        narwhal_shared::TlsFiles {
            ca: self.ca.clone(),
            cert: self.cert(name),
            key: self.key(name),
        }
    }
}

fn write(path: &Path, contents: &str, mode: u32) -> Result<(), CertError> {
    let io = |source| CertError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(io)?;
    f.write_all(contents.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

/// A name must be a DNS label sequence (it becomes a SAN and a file name) and not `ca`.
fn check_name(name: &str) -> Result<(), CertError> {
    let ok = !name.is_empty()
        && !name.starts_with(['-', '.'])
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if !ok || name == "ca" {
        return Err(CertError::Name {
            name: name.to_string(),
        });
    }
    Ok(())
}

/// Writes a fresh fleet CA (`ca.pem`) and a certificate and key (`NAME.pem`, `NAME.key`) for
/// each of `names` into `dir` (created if missing; existing files are replaced), each with the
/// identity of the role its name implies ([`DevRole::for_name`]).
///
/// # Errors
/// [`CertError::Name`] for an unusable name, [`CertError::Role`] for a name without a role,
/// [`CertError::Rcgen`] if rcgen refuses, [`CertError::Io`] for a file.
pub fn make_dev_certs(dir: &Path, names: &[&str]) -> Result<DevCerts, CertError> {
    names.iter().try_for_each(|n| check_name(n))?;
    let specs = names
        .iter()
        .map(|n| {
            DevRole::for_name(n)
                .map(|r| (*n, r))
                .ok_or_else(|| CertError::Role {
                    name: n.to_string(),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    make_certs(dir, &specs)
}

/// As [`make_dev_certs`], with each leaf's role given.
///
/// # Errors
/// As [`make_dev_certs`].
pub fn make_certs(dir: &Path, specs: &[(&str, DevRole)]) -> Result<DevCerts, CertError> {
    let names: Vec<&str> = specs.iter().map(|(n, _)| *n).collect();
    names.iter().try_for_each(|n| check_name(n))?;
    std::fs::create_dir_all(dir).map_err(|source| CertError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let rc = |name: &str| {
        let name = name.to_string();
        move |source| CertError::Rcgen { name, source }
    };
    let ca_key = KeyPair::generate().map_err(rc("ca"))?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(rc("ca"))?;
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "Narwhal dev fleet CA");
    ca_params
        .distinguished_name
        .push(DnType::OrganizationName, "Narwhal dev");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(rc("ca"))?;
    let ca_path = dir.join("ca.pem");
    write(&ca_path, &ca_cert.pem(), 0o644)?;
    let issuer = Issuer::new(ca_params, ca_key);

    for (name, role) in specs {
        let key = KeyPair::generate().map_err(rc(name))?;
        let mut params = CertificateParams::new(vec![
            "localhost".to_string(),
            "127.0.0.1".to_string(),
            name.to_string(),
        ])
        .map_err(rc(name))?;
        if let Some(identity) = role.identity(name) {
            let uri = identity.uri().try_into().map_err(rc(name))?;
            params.subject_alt_names.push(SanType::URI(uri));
        }
        params.distinguished_name.push(DnType::CommonName, *name);
        params
            .distinguished_name
            .push(DnType::OrganizationName, "Narwhal dev");
        params.is_ca = IsCa::NoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &issuer).map_err(rc(name))?;
        write(&dir.join(format!("{name}.pem")), &cert.pem(), 0o644)?;
        write(
            &dir.join(format!("{name}.key")),
            &key.serialize_pem(),
            0o600,
        )?;
    }
    Ok(DevCerts {
        dir: dir.to_path_buf(),
        ca: ca_path,
        names: names.iter().map(|n| n.to_string()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    #[test]
    fn writes_ca_and_leaves_that_rustls_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let certs = make_dev_certs(dir.path(), &["router", "agent-a"]).unwrap();
        assert!(certs.ca.exists());
        for name in ["router", "agent-a"] {
            assert!(certs.cert(name).exists());
            let mode = std::fs::metadata(certs.key(name))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o600);
            // Both configurations build: the key matches the certificate and the CA parses.
            certs.tls_files(name).server_config().unwrap();
            certs.tls_files(name).client_config().unwrap();
        }
        assert!(matches!(
            make_dev_certs(dir.path(), &["not a dns name!"]),
            Err(CertError::Name { .. })
        ));
        assert!(matches!(
            make_dev_certs(dir.path(), &["mystery"]),
            Err(CertError::Role { .. })
        ));
    }

    fn identity_of(certs: &DevCerts, name: &str) -> Result<FleetIdentity, String> {
        let der = narwhal_shared::tls::load_certs("cert", &certs.cert(name)).unwrap();
        narwhal_shared::tls::fleet_identity(&der[0]).map_err(|e| e.to_string())
    }

    #[test]
    fn each_leaf_carries_the_identity_of_its_role() {
        let dir = tempfile::tempdir().unwrap();
        let certs = make_dev_certs(
            dir.path(),
            &[
                "router", "standby", "ctl", "operator", "agent-h0", "router-b",
            ],
        )
        .unwrap();
        for (name, uri) in [
            ("router", "spiffe://narwhal/router/router"),
            ("standby", "spiffe://narwhal/router/standby"),
            ("router-b", "spiffe://narwhal/router/router-b"),
            ("ctl", "spiffe://narwhal/operator/ctl"),
            ("operator", "spiffe://narwhal/operator/operator"),
            ("agent-h0", "spiffe://narwhal/agent/h0"),
        ] {
            assert_eq!(identity_of(&certs, name).unwrap().uri(), uri, "{name}");
        }
        let plain = make_certs(
            &dir.path().join("plain"),
            &[("someone", DevRole::Unrecognised)],
        )
        .unwrap();
        let err = identity_of(&plain, "someone").unwrap_err();
        assert!(err.contains("no URI SAN"), "{err}");
    }
}
