//! Reaching etcd: endpoints checked, the HTTP client with `lease.tls` (or the system's trust
//! store) and the user's password for `lease.auth`.

use std::path::Path;
use std::time::Duration;

use crate::LeaseError;
use crate::config::{EtcdAccess, EtcdTls, etcd_endpoint_rule};

use super::*;

/// The rustls error behind `err`, looking inside I/O errors (tokio-rustls wraps it in an
/// `io::Error`, which hyper wraps in another; `io::Error::source` skips the wrapped error).
pub(super) fn find_rustls<'e>(
    err: &'e (dyn std::error::Error + 'static),
) -> Option<&'e rustls::Error> {
    if let Some(r) = err.downcast_ref::<rustls::Error>() {
        return Some(r);
    }
    let inner = err.downcast_ref::<std::io::Error>()?.get_ref()?;
    find_rustls(inner)
}

/// Checks the endpoints and the access files; the base URLs to call and the HTTP client.
pub(super) fn prepare(
    configured: &[String],
    access: &EtcdAccess,
    op_timeout: Duration,
) -> Result<(Vec<String>, reqwest::Client), LeaseError> {
    let tls = access.tls.is_some();
    let endpoints = configured
        .iter()
        .enumerate()
        .map(|(i, e)| {
            if let Some(rule) = etcd_endpoint_rule(e, tls) {
                return Err(config_err(format!("lease.endpoints[{i}] = {e:?}: {rule}")));
            }
            let e = e.strip_suffix('/').unwrap_or(e);
            Ok(if e.contains("://") {
                e.to_string()
            } else if tls {
                format!("https://{e}")
            } else {
                format!("http://{e}")
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(auth) = &access.auth {
        if auth.user.is_empty() {
            return Err(config_err("lease.auth.user: must not be empty"));
        }
        read_password(&auth.password_file)?;
    }
    let system = EtcdTls {
        ca: None,
        cert: None,
        key: None,
    };
    let rustls = match &access.tls {
        Some(t) => tls_config(t)?,
        // An https:// endpoint without lease.tls: the system's trust store.
        None if endpoints.iter().any(|e| e.starts_with("https://")) => tls_config(&system)?,
        None => narwhal_shared::tls::plain_http_client_config()
            .map_err(|e| config_err(format!("lease: {e}")))?,
    };
    // Each endpoint gets its share of the call's time, so one that hangs (a stopped member)
    // leaves time to try the next one.
    let per_endpoint = op_timeout / u32::try_from(endpoints.len()).unwrap_or(1).max(1);
    let http = reqwest::Client::builder()
        .use_preconfigured_tls(rustls)
        // etcd is reached directly: proxy environment variables are not used.
        .no_proxy()
        .connect_timeout(per_endpoint)
        .timeout(per_endpoint)
        .build()
        .map_err(|e| config_err(format!("lease: building the etcd HTTP client: {e}")))?;
    Ok((endpoints, http))
}

/// The rustls client configuration for `lease.tls`: only `ca` trusted, the client
/// certificate presented when given, ALPN `http/1.1` (etcd's port also speaks gRPC/h2).
pub(super) fn tls_config(t: &EtcdTls) -> Result<rustls::ClientConfig, LeaseError> {
    use narwhal_shared::TlsError;
    use narwhal_shared::tls::{ClientCert, ServerTrust, build_client_config};
    let trust = match &t.ca {
        Some(ca) => ServerTrust::Ca(ca),
        None => {
            let mut roots = rustls::RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found.errors.first().map_or_else(
                    || "it holds no certificate".to_string(),
                    ToString::to_string,
                );
                return Err(config_err(format!(
                    "lease.tls.ca: not set, and the system's trust store cannot be used ({why}): \
                     set lease.tls.ca to etcd's CA"
                )));
            }
            ServerTrust::Roots(roots)
        }
    };
    let identity = match (&t.cert, &t.key) {
        (Some(cert), Some(key)) => Some(ClientCert { cert, key }),
        (None, None) => None,
        (Some(_), None) => return Err(config_err("lease.tls.key: required with lease.tls.cert")),
        (None, Some(_)) => return Err(config_err("lease.tls.cert: required with lease.tls.key")),
    };
    build_client_config(trust, identity, &[b"http/1.1"]).map_err(|e| match e {
        TlsError::Rustls {
            context: "adding the fleet CA",
            source,
        } => config_err(format!(
            "lease.tls.ca: {}: not a usable CA certificate: {source}",
            t.ca.as_deref().unwrap_or(Path::new("")).display()
        )),
        TlsError::Rustls {
            context: "client certificate and key",
            source,
        } => config_err(format!(
            "lease.tls.key: {} does not match lease.tls.cert {}: {source}",
            t.key.as_deref().unwrap_or(Path::new("")).display(),
            t.cert.as_deref().unwrap_or(Path::new("")).display()
        )),
        other => config_err(format!("lease.{other}")),
    })
}

/// The password in `path`: the file's text without one trailing newline (`\n` or `\r\n`).
pub(super) fn read_password(path: &Path) -> Result<String, LeaseError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        config_err(format!(
            "lease.auth.password_file: cannot read {}: {e}",
            path.display()
        ))
    })?;
    let pw = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(&text);
    if pw.is_empty() {
        return Err(config_err(format!(
            "lease.auth.password_file: {} is empty",
            path.display()
        )));
    }
    Ok(pw.to_string())
}
