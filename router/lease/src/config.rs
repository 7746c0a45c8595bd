//! The fleet file's `lease` section as the lease backends take it (the router's config
//! validator builds it; docs/configuration.md lists the keys, architecture.md section 7).

use std::path::PathBuf;

/// `lease.backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseBackend {
    /// No fencing (single router).
    None,
    /// flock + atomically replaced JSON record.
    File,
    /// etcd v3 lease.
    Etcd,
}

/// `lease.tls`: how the etcd backend checks etcd's certificate, and the client certificate it
/// presents when etcd requires one (`--client-cert-auth`). PEM paths, as written (relative
/// paths resolve against the router's working directory, like the top-level `tls`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// `lease.tls.ca`: the CA certificate(s) etcd's serving certificate must chain to, then
    /// the only roots trusted; `None`: the system's trust store (as etcdctl without
    /// `--cacert`).
    pub ca: Option<PathBuf>,
    /// `lease.tls.cert`: client certificate chain (leaf first); given together with `key`.
    pub cert: Option<PathBuf>,
    /// `lease.tls.key`: the client certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
}

/// `lease.auth`: an etcd user (etcd RBAC, `etcdctl auth enable`). The password is read from
/// `password_file` (one line; a trailing newline is dropped), never from the fleet file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdAuth {
    /// `lease.auth.user`: the etcd user name (non-empty).
    pub user: String,
    /// `lease.auth.password_file`: file holding the user's password; re-read at each
    /// (re-)authentication, so a rotated password is picked up without a restart.
    pub password_file: PathBuf,
}

/// How the etcd backend reaches etcd: TLS and authentication (`lease.tls`, `lease.auth`;
/// both optional, used only by `backend = "etcd"`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdAccess {
    /// `lease.tls`; `None`: `http://` endpoints, or `https://` ones verified against the
    /// system's trust store with no client certificate.
    pub tls: Option<EtcdTls>,
    /// `lease.auth`; `None`: no etcd user (etcd without RBAC, or client-certificate only).
    pub auth: Option<EtcdAuth>,
}

/// `lease` section (ours, architecture.md section 7; docs/ha.md).
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseSection {
    /// Backend (default `none`).
    pub backend: LeaseBackend,
    /// File backend path (required for `file`).
    pub path: String,
    /// etcd endpoints (required non-empty for `etcd`).
    pub endpoints: Vec<String>,
    /// etcd key (default `/narwhal/router-lease`).
    pub key: String,
    /// Lease time to live, seconds (default 5; > renew + margin).
    pub ttl_s: f64,
    /// Renewal period, seconds (default 1).
    pub renew_interval_s: f64,
    /// Safety margin, seconds (default 1).
    pub safety_margin_s: f64,
    /// etcd TLS and authentication (`lease.tls`, `lease.auth`; empty by default).
    pub etcd: EtcdAccess,
}

/// Why an etcd endpoint cannot be used, if it cannot. Usable: `https://HOST:PORT`,
/// `http://HOST:PORT` when `lease.tls` is not set, or a bare `HOST:PORT` (`https` when
/// `lease.tls` is set, else `http`).
pub fn etcd_endpoint_rule(endpoint: &str, tls: bool) -> Option<&'static str> {
    let rest = match endpoint.split_once("://") {
        Some(("https", rest)) => rest,
        Some(("http", _)) if tls => {
            return Some("a plain http:// endpoint while lease.tls is set: use https://");
        }
        Some(("http", rest)) => rest,
        Some(_) => return Some("must be http://HOST:PORT, https://HOST:PORT or HOST:PORT"),
        None => endpoint,
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() || rest.contains(['/', '?', '#', '@', ' ']) {
        return Some("must be http://HOST:PORT, https://HOST:PORT or HOST:PORT (no path)");
    }
    None
}
