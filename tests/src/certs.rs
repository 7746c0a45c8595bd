//! Development certificates for mutual TLS between routers, agents and operators (issue 3;
//! DESIGN.md section 3).
//!
//! ```text
//!   make_dev_certs(dir, ["router", "standby", "ctl", "agent-gpu-a", ...])
//!     dir/ca.pem                      self-signed fleet CA (ECDSA P-256), key kept in memory only
//!     dir/NAME.pem, dir/NAME.key      leaf per name, signed by the CA; key mode 0600
//! ```
//! Every leaf has SANs `localhost`, `127.0.0.1` and `NAME`, and both the server-auth and the
//! client-auth extended key usages, so one file pair works for either side of a connection.
//! Calling it twice makes two unrelated CAs (tests use that for "a certificate from another
//! CA"). For production, `docs/security.md` shows how to issue the same files from a real CA.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

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

/// Writes a fresh fleet CA (`ca.pem`) and a certificate and key (`NAME.pem`, `NAME.key`) for
/// each of `names` into `dir` (created if missing; existing files are replaced).
///
/// # Errors
/// [`CertError::Name`] for an unusable name, [`CertError::Rcgen`] if rcgen refuses,
/// [`CertError::Io`] for a file.
pub fn make_dev_certs(dir: &Path, names: &[&str]) -> Result<DevCerts, CertError> {
    for name in names {
        let ok = !name.is_empty()
            && !name.starts_with(['-', '.'])
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
        if !ok || *name == "ca" {
            return Err(CertError::Name {
                name: name.to_string(),
            });
        }
    }
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

    for name in names {
        let key = KeyPair::generate().map_err(rc(name))?;
        let mut params = CertificateParams::new(vec![
            "localhost".to_string(),
            "127.0.0.1".to_string(),
            name.to_string(),
        ])
        .map_err(rc(name))?;
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
    }
}
