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
    /// A `coordination.k8s.io/v1` Lease object on the Kubernetes API server
    /// (docs/ha.md, "`kubernetes` backend").
    Kubernetes,
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
    /// `lease.kubernetes` (used only by `backend = "kubernetes"`).
    pub kubernetes: KubernetesAccess,
}

/// `lease.kubernetes`: which Lease object, on which API server, with which credentials. Every
/// key but `name` defaults to what Kubernetes mounts into a pod (its service account's token,
/// the cluster CA, its namespace) and the API server address Kubernetes puts in every pod's
/// environment; the defaults are resolved when the router starts
/// ([`crate::KubeLease::from_access`]), so a router outside a pod names them all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesAccess {
    /// `lease.kubernetes.name`: the Lease object's name (default `narwhal-router`; a DNS
    /// subdomain name, checked by the config validator).
    pub name: String,
    /// `lease.kubernetes.namespace`; `None`: the pod's own namespace, read from
    /// [`SA_NAMESPACE_FILE`].
    pub namespace: Option<String>,
    /// `lease.kubernetes.api_server` (`https://HOST:PORT`); `None`:
    /// `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`.
    pub api_server: Option<String>,
    /// `lease.kubernetes.token_file`: a bearer token, read again before every call, so a
    /// projected token that the kubelet rotates is picked up; `None`: [`SA_TOKEN_FILE`].
    pub token_file: Option<PathBuf>,
    /// `lease.kubernetes.ca_file`: the CA the API server's certificate must chain to, then the
    /// only root trusted; `None`: [`SA_CA_FILE`].
    pub ca_file: Option<PathBuf>,
}

impl Default for KubernetesAccess {
    fn default() -> Self {
        KubernetesAccess {
            name: DEFAULT_KUBE_LEASE_NAME.to_string(),
            namespace: None,
            api_server: None,
            token_file: None,
            ca_file: None,
        }
    }
}

/// `lease.kubernetes.name`'s default.
pub const DEFAULT_KUBE_LEASE_NAME: &str = "narwhal-router";
/// Where Kubernetes mounts a pod's service-account token.
pub const SA_TOKEN_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";
/// Where Kubernetes mounts the cluster CA in a pod.
pub const SA_CA_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt";
/// Where Kubernetes mounts a pod's namespace.
pub const SA_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// Why `url` cannot be a Kubernetes API server address, if it cannot: it must be
/// `https://HOST:PORT`, no path (a trailing `/` is dropped).
pub fn kube_api_server_rule(url: &str) -> Option<&'static str> {
    let rest = url
        .trim_end_matches('/')
        .strip_prefix("https://")
        .unwrap_or("");
    (rest.is_empty() || rest.contains(['/', '?', '#', '@', ' ']))
        .then_some("must be https://HOST:PORT (no path)")
}

/// Why `name` cannot name a Kubernetes object (a Lease, a namespace), if it cannot: RFC 1123
/// DNS subdomain rules as the API server applies them (at most 253 characters of lowercase
/// letters, digits, `-` and `.`, starting and ending with a letter or digit).
pub fn kube_name_rule(name: &str) -> Option<&'static str> {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if name.is_empty() || name.len() > 253 {
        return Some("must be 1 to 253 characters");
    }
    if !name.chars().all(ok_char) || !alnum(name.chars().next()) || !alnum(name.chars().last()) {
        return Some(
            "must be lowercase letters, digits, '-' and '.', starting and ending with a letter \
             or digit (a Kubernetes object name)",
        );
    }
    None
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
