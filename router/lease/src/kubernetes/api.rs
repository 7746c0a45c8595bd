//! A minimal Kubernetes API client: one API server, a bearer token read from its file before
//! every call (so a projected token the kubelet rotates is used at once), only the cluster CA
//! trusted, every call bounded. The lease backend ([`super::KubeLease`]) and the router's
//! self-drain (TokenReview, pod reads) call through it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::object::Status;
use crate::config::{SA_CA_FILE, SA_TOKEN_FILE, kube_api_server_rule};

/// One call's failure.
#[derive(Debug, Clone)]
pub enum Failure {
    /// No answer (connection, TLS, timeout), or the token file could not be read. `sent`: the
    /// request may have reached the server (so a write may have landed).
    Transport {
        /// What failed, with its causes.
        message: String,
        /// Whether the request may have reached the server.
        sent: bool,
    },
    /// The server answered with an error status.
    Server {
        /// The HTTP status.
        status: u16,
        /// The `Status` reason (`NotFound`, `Conflict`, `Forbidden`, ...), or `""`.
        reason: String,
        /// The `Status` message, or the start of the body.
        message: String,
    },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Transport { message, .. } => f.write_str(message),
            Failure::Server {
                status,
                reason,
                message,
            } => write!(f, "{status} {reason}: {message}"),
        }
    }
}

/// A client of one API server (see the module doc).
#[derive(Debug, Clone)]
pub struct KubeApi {
    /// `https://HOST:PORT`, no trailing slash.
    base: String,
    token_file: PathBuf,
    timeout: Duration,
    http: reqwest::Client,
}

impl KubeApi {
    /// A client of `base` (`https://HOST:PORT`) presenting the token in `token_file`, trusting
    /// only `ca_file`, each call bounded by `timeout`.
    ///
    /// # Errors
    /// `ca_file: <path>: <why>` when the CA cannot be used (the caller prefixes its key).
    pub fn new(
        base: &str,
        token_file: &Path,
        ca_file: &Path,
        timeout: Duration,
    ) -> Result<KubeApi, String> {
        use narwhal_shared::tls::{ServerTrust, build_client_config};
        let rustls = build_client_config(ServerTrust::Ca(ca_file), None, &[b"http/1.1"])
            .map_err(|e| format!("ca_file: {}: {e}", ca_file.display()))?;
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(rustls)
            .no_proxy()
            .connect_timeout(timeout)
            .timeout(timeout)
            .build()
            .map_err(|e| format!("ca_file: building the HTTP client: {e}"))?;
        Ok(KubeApi {
            base: base.trim_end_matches('/').to_string(),
            token_file: token_file.to_path_buf(),
            timeout,
            http,
        })
    }

    /// The client a component configures with `api_server`, `token_file` and `ca_file`, each
    /// defaulting to what Kubernetes gives a pod: `https://$KUBERNETES_SERVICE_HOST:
    /// $KUBERNETES_SERVICE_PORT` (read through `env`), its service-account token and the
    /// cluster CA ([`SA_TOKEN_FILE`], [`SA_CA_FILE`]). Reads the token now, so a missing one
    /// stops the component at startup.
    ///
    /// # Errors
    /// `<key>: <why>` naming `api_server` (not set outside a pod, or not `https://HOST:PORT`),
    /// `token_file` (unreadable or empty) or `ca_file`; the caller prefixes its section.
    pub fn resolve(
        api_server: Option<&str>,
        token_file: Option<&Path>,
        ca_file: Option<&Path>,
        timeout: Duration,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<KubeApi, String> {
        let api_server = match api_server {
            Some(a) => a.trim_end_matches('/').to_string(),
            None => match (
                env("KUBERNETES_SERVICE_HOST"),
                env("KUBERNETES_SERVICE_PORT"),
            ) {
                (Some(h), Some(p)) if !h.is_empty() && !p.is_empty() => {
                    // An IPv6 service address needs brackets in a URL.
                    let host = if h.contains(':') { format!("[{h}]") } else { h };
                    format!("https://{host}:{p}")
                }
                _ => {
                    return Err("api_server: not set, and KUBERNETES_SERVICE_HOST / \
                                KUBERNETES_SERVICE_PORT are not in the environment (not in a \
                                pod?): set it to https://HOST:PORT"
                        .into());
                }
            },
        };
        if let Some(rule) = kube_api_server_rule(&api_server) {
            return Err(format!("api_server = {api_server:?}: {rule}"));
        }
        let token_file = token_file.unwrap_or(Path::new(SA_TOKEN_FILE));
        let ca_file = ca_file.unwrap_or(Path::new(SA_CA_FILE));
        read_token(token_file).map_err(|e| format!("token_file: {e}"))?;
        KubeApi::new(&api_server, token_file, ca_file, timeout)
    }

    /// The API server's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The token file presented.
    pub fn token_file(&self) -> &Path {
        &self.token_file
    }

    /// One call to `url` (absolute): `GET` without a body, `POST`/`PUT` with a JSON one; the
    /// answer's bytes on a 2xx.
    ///
    /// # Errors
    /// [`Failure`]: no answer, or the server's error status with its `Status` message.
    pub async fn call(
        &self,
        method: reqwest::Method,
        url: &str,
        body: Option<&(impl Serialize + Sync)>,
    ) -> Result<Vec<u8>, Failure> {
        let token = read_token(&self.token_file).map_err(|e| Failure::Transport {
            message: format!("token file: {e}"),
            sent: false,
        })?;
        let mut req = self
            .http
            .request(method, url)
            .bearer_auth(token)
            .header(http::header::ACCEPT, "application/json");
        if let Some(b) = body {
            req = req.json(b);
        }
        let work = async {
            let resp = req.send().await.map_err(|e| Failure::Transport {
                message: describe(&e),
                sent: !e.is_connect(),
            })?;
            let status = resp.status();
            let bytes = resp.bytes().await.map_err(|e| Failure::Transport {
                message: describe(&e),
                sent: true,
            })?;
            if status.is_success() {
                return Ok(bytes.to_vec());
            }
            let s: Status = serde_json::from_slice(&bytes).unwrap_or_default();
            let message = if s.message.is_empty() {
                String::from_utf8_lossy(&bytes).chars().take(300).collect()
            } else {
                s.message
            };
            Err(Failure::Server {
                status: status.as_u16(),
                reason: s.reason,
                message,
            })
        };
        match tokio::time::timeout(self.timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(Failure::Transport {
                message: format!("timed out after {} s", self.timeout.as_secs_f64()),
                sent: true,
            }),
        }
    }

    /// `GET <base><path>`, parsed as `T`.
    ///
    /// # Errors
    /// As [`KubeApi::call`]; an answer that is not a `T` is a [`Failure::Transport`].
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, Failure> {
        let url = format!("{}{path}", self.base);
        let bytes = self.call(reqwest::Method::GET, &url, None::<&()>).await?;
        parse(&bytes)
    }

    /// `POST <base><path>` with `body`, the answer parsed as `T`.
    ///
    /// # Errors
    /// As [`KubeApi::call`]; an answer that is not a `T` is a [`Failure::Transport`].
    pub async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &(impl Serialize + Sync),
    ) -> Result<T, Failure> {
        let url = format!("{}{path}", self.base);
        let bytes = self.call(reqwest::Method::POST, &url, Some(body)).await?;
        parse(&bytes)
    }
}

fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Failure> {
    serde_json::from_slice(bytes).map_err(|e| Failure::Transport {
        message: format!("the answer is not the expected document: {e}"),
        sent: true,
    })
}

/// The bearer token in `path`, trimmed.
///
/// # Errors
/// `<path>: <why>` for an unreadable file, `<path> is empty` for an empty one.
pub fn read_token(path: &Path) -> Result<String, String> {
    match std::fs::read_to_string(path) {
        Ok(t) if !t.trim().is_empty() => Ok(t.trim().to_string()),
        Ok(_) => Err(format!("{} is empty", path.display())),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// A transport error with its causes.
fn describe(e: &reqwest::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = err.source();
    }
    if e.is_timeout() {
        parts.push("timed out".into());
    }
    parts.join(": ")
}
