//! The HTTP client of the router's control API: `--router` (http or https), `--ca`, `--cert`
//! and `--key` (the router's `control.tls`), `--server-name`, `--request-timeout-s`; GET and
//! POST with the router's answers mapped to [`Failure`]s (transport errors: `transport.rs`).

use std::path::PathBuf;
use std::time::Duration;

use narwhal_shared::documents::{ErrorReply, Lifecycle, LifecycleReply, Ordered, Ready, State};
use serde::de::DeserializeOwned;

use crate::cli::Cli;
use crate::failure::Failure;

/// A client of one router's control listener, built from the command line by [`Ctl::new`].
pub(crate) struct Ctl {
    pub(crate) http: reqwest::Client,
    /// Base URL requests are sent to (its host is `--server-name` when one is given).
    pub(crate) base: String,
    /// `host:port` from `--router`: where narwhalctl connects, named in every error.
    pub(crate) addr: String,
    /// The URL as given, scheme included.
    pub(crate) router: String,
    /// Whether a client certificate is presented.
    pub(crate) client_cert: bool,
    /// Whether `--ca` was given.
    pub(crate) ca: Option<PathBuf>,
    pub(crate) json: bool,
    pub(crate) timeout: Duration,
}

impl Ctl {
    /// Builds the client from `--router`, `--ca`/`--cert`/`--key`, `--server-name` and
    /// `--request-timeout-s`; with `--server-name` it connects to the `--router` address and
    /// verifies the certificate for that name. Errors are [`Failure::Usage`]: a `--router` that
    /// is not an http(s) URL, unusable TLS files, an address that does not resolve.
    pub(crate) async fn new(cli: &Cli) -> Result<Self, Failure> {
        // Our reqwest build carries no default TLS provider: install ring (harmless if set).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let url = reqwest::Url::parse(cli.router.trim_end_matches('/')).map_err(|e| {
            Failure::Usage(format!(
                "--router {:?} is not a URL ({e}); expected e.g. http://10.0.0.5:8001",
                cli.router
            ))
        })?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(Failure::Usage(format!(
                "--router {:?}: the scheme must be http or https",
                cli.router
            )));
        }
        // host_str() keeps the brackets of an IPv6 address.
        let host = url.host_str().unwrap_or_default().to_string();
        let port = url.port_or_known_default().unwrap_or(80);
        let addr = format!("{host}:{port}");
        let mut b = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs_f64(cli.request_timeout_s));
        if let Some(ca) = &cli.ca {
            let cfg = match (&cli.cert, &cli.key) {
                (Some(cert), Some(key)) => narwhal_shared::TlsFiles {
                    ca: ca.clone(),
                    cert: cert.clone(),
                    key: key.clone(),
                }
                .client_config(),
                _ => narwhal_shared::tls::build_client_config(
                    narwhal_shared::tls::ServerTrust::Ca(ca),
                    None,
                    &[],
                ),
            }
            .map_err(|e| Failure::Usage(e.to_string()))?;
            b = b.use_preconfigured_tls(cfg);
        }
        let mut base = url.as_str().trim_end_matches('/').to_string();
        if let Some(name) = &cli.server_name {
            // Connect to the --router address, verify the certificate for `name`.
            let sock = tokio::net::lookup_host(&addr)
                .await
                .map_err(|e| Failure::Usage(format!("--router: cannot resolve {addr}: {e}")))?
                .next()
                .ok_or_else(|| Failure::Usage(format!("--router: {addr} has no address")))?;
            b = b.resolve(name, sock);
            let mut u = url.clone();
            u.set_host(Some(name))
                .map_err(|e| Failure::Usage(format!("--server-name {name:?}: {e}")))?;
            base = u.as_str().trim_end_matches('/').to_string();
        }
        Ok(Ctl {
            http: b
                .build()
                .map_err(|e| Failure::Usage(format!("HTTP client: {e}")))?,
            base,
            addr,
            router: url.as_str().trim_end_matches('/').to_string(),
            client_cert: cli.cert.is_some(),
            ca: cli.ca.clone(),
            json: cli.json,
            timeout: Duration::from_secs_f64(cli.request_timeout_s),
        })
    }

    /// GETs `path`: the status and the body text, whatever the status.
    pub(crate) async fn get_text(&self, path: &str) -> Result<(u16, String), Failure> {
        let url = format!("{}{path}", self.base);
        let r = match self.http.get(&url).send().await {
            Ok(r) => r,
            Err(e) => return Err(self.transport(&format!("GET {path}"), &e).await),
        };
        let status = r.status().as_u16();
        let text = r
            .text()
            .await
            .map_err(|e| Failure::Unavailable(format!("GET {path} at {}: {e}", self.addr)))?;
        Ok((status, text))
    }

    /// GETs `path` and parses the body as `T` (`None` when it is not JSON of that shape).
    pub(crate) async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
    ) -> Result<(u16, Option<T>), Failure> {
        let (status, text) = self.get_text(path).await?;
        Ok((status, serde_json::from_str(&text).ok()))
    }

    /// The lifecycle document. A listener without `/narwhal/lifecycle` (the data listener,
    /// or something else) is a usage error naming what it is.
    pub(crate) async fn lifecycle(&self) -> Result<Lifecycle, Failure> {
        let (status, text) = self.get_text("/narwhal/lifecycle").await?;
        let doc = serde_json::from_str::<Lifecycle>(&text)
            .ok()
            .filter(Lifecycle::is_lifecycle);
        if status == 200
            && let Some(doc) = doc
        {
            return Ok(doc);
        }
        let detail = error_text(&text)
            .map(|m| format!(" ({m})"))
            .unwrap_or_default();
        let models = self
            .get_text("/v1/models")
            .await
            .map_or(0, |(status, _)| status);
        let what = if models == 200 {
            "this is narwhal-serve's data listener (it serves /v1/models)".to_string()
        } else {
            "this is not a narwhal-serve control listener".to_string()
        };
        if status == 404 || status == 200 || models == 200 {
            return Err(Failure::Usage(format!(
                "--router {}: GET /narwhal/lifecycle answered {status}{detail}: {what}. narwhalctl needs the router's control listener (narwhal-serve --control-listen, default port 8001; `control` in its ready file)",
                self.router
            )));
        }
        Err(Failure::Unavailable(format!(
            "GET /narwhal/lifecycle at {}: HTTP {status}{detail}",
            self.addr
        )))
    }

    /// `/ready`, when it answers with its body.
    pub(crate) async fn ready(&self) -> Option<Ready> {
        self.get::<Ready>("/ready").await.ok()?.1
    }

    /// `/narwhal/state`, when it answers 200 with it.
    pub(crate) async fn state(&self) -> Option<State> {
        match self.get::<State>("/narwhal/state").await {
            Ok((200, state)) => state,
            _ => None,
        }
    }

    /// POSTs a lifecycle action; 2xx gives the document, 409 and 503 name the router's error
    /// and come with the document when the router sent one.
    pub(crate) async fn post(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<LifecycleReply, (Failure, Option<LifecycleReply>)> {
        let url = format!("{}{path}", self.base);
        let r = match self.http.post(&url).json(body).send().await {
            Ok(r) => r,
            Err(e) => return Err((self.transport(&format!("POST {path}"), &e).await, None)),
        };
        let status = r.status();
        let text = match r.text().await {
            Ok(t) => t,
            Err(e) => {
                return Err((
                    Failure::Unavailable(format!("POST {path} at {}: {status}: {e}", self.addr)),
                    None,
                ));
            }
        };
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&text) {
            return Err((
                Failure::Unavailable(format!(
                    "POST {path} at {}: {status}: body is not JSON: {e}",
                    self.addr
                )),
                None,
            ));
        }
        let parsed = serde_json::from_str::<LifecycleReply>(&text);
        if status.is_success() {
            return parsed.map_err(|e| {
                let f = Failure::Unavailable(format!(
                    "POST {path} at {}: {status}: not a lifecycle document: {e}",
                    self.addr
                ));
                (f, None)
            });
        }
        let doc = parsed.ok().filter(|d| d.document.is_lifecycle());
        if status.as_u16() == 404 && doc.is_none() {
            return Err((
                Failure::Usage(format!(
                    "--router {}: POST {path} answered 404: narwhalctl needs the router's control listener (narwhal-serve --control-listen)",
                    self.router
                )),
                None,
            ));
        }
        let mut msg = format!(
            "{path}: HTTP {}: {}",
            status.as_u16(),
            error_text(&text).as_deref().unwrap_or("(no error message)")
        );
        if status.as_u16() == 503 {
            // "does not control the fleet" alone does not say why: /ready does.
            if let Some(ready) = self.ready().await
                && !ready.reason.is_empty()
            {
                msg.push_str(&format!(" (router not ready: {})", ready.reason));
            }
        }
        let f = if status.as_u16() == 503 || status.is_server_error() {
            Failure::Unavailable(msg)
        } else {
            Failure::Refused(msg)
        };
        Err((f, doc))
    }

    /// Ejected engines with their breaker causes, from `/narwhal/state`, in its order. Empty
    /// when the state cannot be read.
    pub(crate) async fn ejected(&self) -> Ordered<Ejected> {
        let Some(st) = self.state().await else {
            return Ordered::new();
        };
        st.ejected
            .iter()
            .map(|iid| {
                let causes = st
                    .breaker
                    .ejections
                    .iter()
                    .filter(|e| e.iid == *iid)
                    .map(|e| (e.cause.clone(), e.count))
                    .collect();
                (iid.clone(), Ejected { causes })
            })
            .collect()
    }
}

/// An ejected engine as `status --json` shows it: `{"causes": {<cause>: <count>}}`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub(crate) struct Ejected {
    /// Ejections per breaker cause, in `/narwhal/state`'s order.
    pub(crate) causes: Ordered<u64>,
}

/// The router's error message in a body: a lifecycle document's `error` (a string) or an
/// OpenAI-style body's `error.message`; `None` when empty or absent.
pub(crate) fn error_text(text: &str) -> Option<String> {
    let message = match serde_json::from_str::<Lifecycle>(text) {
        Ok(doc) => doc.error,
        Err(_) => serde_json::from_str::<ErrorReply>(text).ok()?.error.message,
    };
    Some(message).filter(|m| !m.is_empty())
}
