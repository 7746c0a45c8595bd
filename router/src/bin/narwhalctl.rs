//! `narwhalctl`: the operator and supervisor CLI over a router's control API
//! (`/narwhal/lifecycle`, `/narwhal/lifecycle/drain`, `/narwhal/lifecycle/readmit`,
//! `/narwhal/lifecycle/cancel-drain`).
//!
//! `wave-restart` is the reference external supervisor (behaviour.md 4.6; handoff-and-lifecycle.md,
//! "Whole-wave restart policy"): drain, wait for `ready_to_stop`, run the operator's restart
//! command per engine, readmit, and print each engine's validation checks. `--rolling` restarts one
//! engine at a time under the `individual` policy, so the fleet keeps serving throughout. A wave
//! that stops half-way prints the exact command that continues it (`--resume --engines ...`).
//!
//! Exit codes: 0 success; 1 the router refused or a check failed (409, validation, restart
//! command); 2 usage (including a `--router` that is not a control listener); 3 the router was
//! unreachable or not in control (503, transport, TLS, timeout); 141 standard output was closed
//! (a reader such as `head` went away: narwhalctl stops quietly, as a process killed by SIGPIPE
//! would).
#![forbid(unsafe_code)]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use narwhal_shared::{Clock as _, SystemClock};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(
    name = "narwhalctl",
    version,
    about = "Drain, restart and readmit Narwhal engines"
)]
struct Cli {
    /// Control listener of the active router (`narwhal-serve --control-listen`, default port
    /// 8001), e.g. `http://10.0.0.5:8001`, or `https://…` when the fleet file sets
    /// `control.tls`. The data listener (OpenAI routes) is refused.
    #[arg(long, env = "NARWHAL_ROUTER")]
    router: String,
    /// CA bundle (PEM) that signed the router's control certificate (`control.tls`).
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Client certificate (PEM) issued by the CA in the router's `control.tls.ca`.
    #[arg(long, requires_all = ["ca", "key"])]
    cert: Option<PathBuf>,
    /// Client private key (PEM).
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
    /// Name to verify in the router's certificate when it differs from the host in `--router`
    /// (for example connecting by IP address to a certificate that names `router-a.internal`).
    #[arg(long)]
    server_name: Option<String>,
    /// Print machine-readable JSON instead of tables: exactly one JSON document on stdout.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for the router to answer one call.
    #[arg(long, default_value_t = 60.0)]
    request_timeout_s: f64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show every engine's lifecycle state (ejected engines as `ejected` with the breaker's
    /// cause), the wave and the router's control state.
    Status,
    /// Drain one engine (or `--wave`: the whole fleet).
    Drain {
        /// Engine to drain.
        #[arg(required_unless_present = "wave", conflicts_with = "wave")]
        iid: Option<String>,
        /// Drain every engine as one wave (withdraws router readiness).
        #[arg(long)]
        wave: bool,
        /// Seconds after which the drain is reported `deadline_exceeded`.
        #[arg(long, default_value_t = 300.0)]
        deadline_s: f64,
        /// Wait until the engine (or wave) is `ready_to_stop`.
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this many seconds.
        #[arg(long, default_value_t = 900.0)]
        timeout_s: f64,
    },
    /// Validate and readmit one engine (or `--wave`: the active wave).
    Readmit {
        /// Engine to readmit.
        #[arg(required_unless_present = "wave", conflicts_with = "wave")]
        iid: Option<String>,
        /// Readmit the active wave as one set.
        #[arg(long)]
        wave: bool,
    },
    /// Cancel the drain of one engine that was not restarted: the router validates the same
    /// process through the readmission checks (no restart required) and returns it to
    /// service. Narwhal's own action (docs/deviations.md); `readmit` still requires a restart.
    CancelDrain {
        /// Engine whose drain to cancel.
        iid: String,
    },
    /// Drain the fleet, restart each engine with a command, readmit, report every check.
    ///
    /// The restart command runs on this machine through `sh -c`, once per engine, and must
    /// return only once the new engine process listens (and the old one has exited); see
    /// packaging/narwhal-restart-remote for an ssh wrapper. Placeholders `{iid}`, `{host}`,
    /// `{port}` and `{url}` are replaced by the engine's id and address; the same values are in
    /// the environment as NARWHAL_IID, NARWHAL_ENGINE_HOST, NARWHAL_ENGINE_PORT and
    /// NARWHAL_ENGINE_URL. With `--json` its output goes to stderr.
    WaveRestart {
        /// Shell command restarting one engine (see above for placeholders).
        #[arg(long)]
        restart_cmd: String,
        /// One engine at a time (individual policy) instead of one whole-fleet wave.
        #[arg(long)]
        rolling: bool,
        /// Restart only these engines (comma-separated; default every engine). A whole wave
        /// still drains and readmits every engine.
        #[arg(long, value_delimiter = ',')]
        engines: Vec<String>,
        /// Continue a wave-restart that stopped: engines already held are not drained again,
        /// a wave already drained is not drained again.
        #[arg(long)]
        resume: bool,
        /// Drain deadline per drain, seconds.
        #[arg(long, default_value_t = 300.0)]
        deadline_s: f64,
        /// Give up waiting for `ready_to_stop` after this many seconds.
        #[arg(long, default_value_t = 900.0)]
        timeout_s: f64,
        /// Kill the restart command of one engine after this many seconds.
        #[arg(long, default_value_t = 900.0)]
        restart_timeout_s: f64,
    },
}

/// Why a command failed, with the exit code it maps to.
#[derive(Debug)]
enum Failure {
    /// The router refused the action or a check failed (exit 1).
    Refused(String),
    /// The command line is wrong, e.g. `--router` names the data listener (exit 2).
    Usage(String),
    /// The router could not be reached or does not control the fleet (exit 3).
    Unavailable(String),
    /// Standard output was closed by its reader (exit 141, nothing printed).
    PipeClosed,
}

impl Failure {
    fn exit(&self) -> ExitCode {
        match self {
            Failure::Refused(_) => ExitCode::from(1),
            Failure::Usage(_) => ExitCode::from(2),
            Failure::Unavailable(_) => ExitCode::from(3),
            Failure::PipeClosed => ExitCode::from(141),
        }
    }
    fn message(&self) -> &str {
        match self {
            Failure::Refused(m) | Failure::Usage(m) | Failure::Unavailable(m) => m,
            Failure::PipeClosed => "standard output closed",
        }
    }
}

/// Writes one line to stdout; a closed pipe becomes [`Failure::PipeClosed`] instead of a panic.
fn out(line: &str) -> Result<(), Failure> {
    let mut o = std::io::stdout().lock();
    match writeln!(o, "{line}").and_then(|()| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Failure::PipeClosed),
        // Any other stdout failure (disk full on a redirect) is as final for us.
        Err(_) => Err(Failure::PipeClosed),
    }
}

/// Quotes `s` for a POSIX shell when it holds anything but plain characters.
fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

struct Ctl {
    http: reqwest::Client,
    /// Base URL requests are sent to (its host is `--server-name` when one is given).
    base: String,
    /// `host:port` from `--router`: where narwhalctl connects, named in every error.
    addr: String,
    /// The URL as given, scheme included.
    router: String,
    /// Whether a client certificate is presented.
    client_cert: bool,
    /// Whether `--ca` was given.
    ca: Option<PathBuf>,
    json: bool,
    timeout: Duration,
}

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
    async fn new(cli: &Cli) -> Result<Self, Failure> {
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

    /// Turns a transport error into a message an operator can act on: names TLS, the client
    /// certificate, or a certificate name mismatch, and always the address connected to.
    async fn transport(&self, what: &str, e: &reqwest::Error) -> Failure {
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

    /// GETs `path` and parses JSON; any status is returned with its body.
    async fn get(&self, path: &str) -> Result<(u16, Value), Failure> {
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
        let doc = serde_json::from_str(&text).unwrap_or(Value::Null);
        Ok((status, doc))
    }

    /// The lifecycle document. A listener without `/narwhal/lifecycle` (the data listener,
    /// or something else) is a usage error naming what it is.
    async fn lifecycle(&self) -> Result<Value, Failure> {
        let (status, doc) = self.get("/narwhal/lifecycle").await?;
        if status == 200 && doc["schema"] == "narwhal.lifecycle" {
            return Ok(doc);
        }
        let detail = doc["error"]["message"]
            .as_str()
            .or_else(|| doc["error"].as_str())
            .map(|m| format!(" ({m})"))
            .unwrap_or_default();
        let (models, _) = self.get("/v1/models").await.unwrap_or((0, Value::Null));
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

    /// POSTs a lifecycle action; 2xx gives the document, 409 and 503 name the router's error
    /// and come with the document when the router sent one.
    async fn post(&self, path: &str, body: Value) -> Result<Value, (Failure, Option<Value>)> {
        let url = format!("{}{path}", self.base);
        let r = match self.http.post(&url).json(&body).send().await {
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
        let doc: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                return Err((
                    Failure::Unavailable(format!(
                        "POST {path} at {}: {status}: body is not JSON: {e}",
                        self.addr
                    )),
                    None,
                ));
            }
        };
        if status.is_success() {
            return Ok(doc);
        }
        if status.as_u16() == 404 && doc["schema"] != "narwhal.lifecycle" {
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
            error_text(&doc).unwrap_or("(no error message)")
        );
        if status.as_u16() == 503 {
            // "does not control the fleet" alone does not say why: /ready does.
            if let Ok((_, ready)) = self.get("/ready").await
                && let Some(reason) = ready["reason"].as_str().filter(|r| !r.is_empty())
            {
                msg.push_str(&format!(" (router not ready: {reason})"));
            }
        }
        let f = if status.as_u16() == 503 || status.is_server_error() {
            Failure::Unavailable(msg)
        } else {
            Failure::Refused(msg)
        };
        let doc = (doc["schema"] == "narwhal.lifecycle").then_some(doc);
        Err((f, doc))
    }

    /// Ejected engines with their breaker causes, from `/narwhal/state`:
    /// `{iid: {"causes": {cause: count}}}`. Empty when the state cannot be read.
    async fn ejected(&self) -> serde_json::Map<String, Value> {
        let mut map = serde_json::Map::new();
        let Ok((200, st)) = self.get("/narwhal/state").await else {
            return map;
        };
        let ejected: Vec<&str> = st["ejected"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        for iid in ejected {
            let mut causes = serde_json::Map::new();
            for e in st["breaker"]["ejections"].as_array().into_iter().flatten() {
                if e["iid"] == iid
                    && let Some(c) = e["cause"].as_str()
                {
                    causes.insert(c.to_string(), e["count"].clone());
                }
            }
            map.insert(iid.to_string(), json!({"causes": causes}));
        }
        map
    }

    async fn status(&self) -> Result<(), Failure> {
        let mut doc = self.lifecycle().await?;
        let ejected = self.ejected().await;
        let ready = self.get("/ready").await.map(|(_, d)| d).unwrap_or_default();
        let state = match self.get("/narwhal/state").await {
            Ok((200, st)) => st,
            _ => Value::Null,
        };
        let control = controller_status(&state);
        if self.json {
            doc["ejected"] = Value::Object(ejected);
            doc["ready"] = ready;
            doc["roles"] = Value::Object(roles(&state));
            doc["controller"] = control;
            return out(&doc.to_string());
        }
        self.show(&doc, &ejected, &ready)?;
        for line in controller_lines(&state, &control) {
            out(&line)?;
        }
        Ok(())
    }

    fn show(
        &self,
        doc: &Value,
        ejected: &serde_json::Map<String, Value>,
        ready: &Value,
    ) -> Result<(), Failure> {
        let router = &doc["router"];
        let wave = &doc["wave"];
        let mut line = format!(
            "router: controls_fleet={} ready={}  policy={}",
            router["controls_fleet"].as_str().unwrap_or("?"),
            router["ready"],
            doc["engine_restart_policy"].as_str().unwrap_or("?")
        );
        if let Some(reason) = ready["reason"].as_str().filter(|r| !r.is_empty()) {
            line.push_str(&format!("  not ready: {reason}"));
        }
        out(&line)?;
        if wave["active"].as_bool().unwrap_or(false) {
            out(&format!(
                "wave {}: ready_to_stop={} readiness_withdrawn={}",
                wave["id"].as_str().unwrap_or(""),
                wave["ready_to_stop"],
                wave["readiness_withdrawn"]
            ))?;
        }
        out(&format!(
            "{:<8} {:<18} {:>6} {:>6} {:>9} {:>16} {:>16}  error",
            "engine", "state", "accept", "stop?", "resident", "old start", "new start"
        ))?;
        if let Some(engines) = doc["engines"].as_object() {
            for (iid, e) in engines {
                let res = format!(
                    "{}p/{}d",
                    e["resident"]["prefill"].as_u64().unwrap_or(0),
                    e["resident"]["decode"].as_u64().unwrap_or(0)
                );
                let start = |v: &Value| v.as_f64().map_or("-".to_string(), |s| format!("{s:.2}"));
                let lc_state = e["state"].as_str().unwrap_or("?");
                let mut note = e["error"].as_str().unwrap_or("").to_string();
                let state = match ejected.get(iid) {
                    Some(ej) => {
                        let causes = ej["causes"]
                            .as_object()
                            .map(|c| {
                                c.iter()
                                    .map(|(k, n)| format!("{k} x{n}"))
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            })
                            .filter(|s| !s.is_empty())
                            .unwrap_or_else(|| "cause unknown".into());
                        let ej_note = format!("ejected by the breaker: {causes}");
                        note = if note.is_empty() {
                            ej_note
                        } else {
                            format!("{ej_note}; {note}")
                        };
                        if lc_state == "active" {
                            "ejected".to_string()
                        } else {
                            format!("{lc_state}+ejected")
                        }
                    }
                    None => lc_state.to_string(),
                };
                out(&format!(
                    "{:<8} {:<18} {:>6} {:>6} {:>9} {:>16} {:>16}  {}",
                    iid,
                    state,
                    yes(&e["accepts_new"]),
                    yes(&e["ready_to_stop"]),
                    res,
                    start(&e["old_process_start"]),
                    start(&e["new_process_start"]),
                    note
                ))?;
            }
        }
        Ok(())
    }

    /// Prints, per target, the checks that passed and what failed ([`check_lines`]).
    fn show_checks(
        &self,
        doc: &Value,
        targets: &[String],
        router_error: Option<&str>,
    ) -> Result<(), Failure> {
        if self.json {
            return Ok(());
        }
        for line in check_lines(doc, targets, router_error) {
            out(&line)?;
        }
        Ok(())
    }

    /// Polls the lifecycle document until `done(doc)`, printing progress when it changes.
    async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Result<Value, Failure> {
        let clock = SystemClock;
        let deadline = clock.now() + timeout;
        let mut last = String::new();
        loop {
            let doc = self.lifecycle().await?;
            if done(&doc) {
                return Ok(doc);
            }
            let progress = progress_line(&doc);
            if progress != last && !self.json {
                out(&format!("waiting for {what}: {progress}"))?;
                last.clone_from(&progress);
            }
            if doc["router"]["controls_fleet"] != "active" {
                return Err(Failure::Unavailable(format!(
                    "waiting for {what}: the router at {} no longer controls the fleet ({})",
                    self.addr,
                    doc["router"]["controls_fleet"].as_str().unwrap_or("?")
                )));
            }
            if clock.now() >= deadline {
                return Err(Failure::Unavailable(format!(
                    "timed out after {:.0} s waiting for {what} ({progress})",
                    timeout.as_secs_f64()
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// POSTs a drain and, with `wait`, polls until `ready_to_stop`. Returns the last document.
    async fn drain(
        &self,
        iid: Option<&str>,
        deadline_s: f64,
        wait: bool,
        timeout: Duration,
    ) -> Result<Value, (Failure, Option<Value>)> {
        let body = match iid {
            Some(i) => json!({"engines": [i], "deadline_s": deadline_s}),
            None => json!({"wave": true, "deadline_s": deadline_s}),
        };
        let doc = self.post("/narwhal/lifecycle/drain", body).await?;
        let warnings = doc["warnings"].clone();
        if !self.json {
            for w in warnings.as_array().into_iter().flatten() {
                out(&format!("warning: {}", w.as_str().unwrap_or_default()))
                    .map_err(|f| (f, None))?;
            }
        }
        if !wait {
            return Ok(doc);
        }
        let mut last = self.wait_stop(iid, timeout).await.map_err(|f| (f, None))?;
        if warnings.is_array() {
            last["warnings"] = warnings;
        }
        Ok(last)
    }

    async fn wait_stop(&self, iid: Option<&str>, timeout: Duration) -> Result<Value, Failure> {
        match iid {
            Some(i) => {
                let i = i.to_string();
                self.wait(&format!("{i} ready_to_stop"), timeout, move |d| {
                    d["engines"][&i]["ready_to_stop"] == true
                })
                .await
            }
            None => {
                self.wait("wave ready_to_stop", timeout, |d| {
                    d["wave"]["ready_to_stop"] == true
                })
                .await
            }
        }
    }

    /// POSTs a readmission and prints each target's checks (never an empty list).
    async fn readmit(&self, iid: Option<&str>) -> Result<Value, (Failure, Option<Value>)> {
        let body = match iid {
            Some(i) => json!({"engines": [i]}),
            None => json!({"wave": true}),
        };
        self.validating_post("/narwhal/lifecycle/readmit", body, iid)
            .await
    }

    /// POSTs a drain cancel of `iid` and prints its checks, as [`Ctl::readmit`] does.
    async fn cancel_drain(&self, iid: &str) -> Result<Value, (Failure, Option<Value>)> {
        let body = json!({"engines": [iid]});
        self.validating_post("/narwhal/lifecycle/cancel-drain", body, Some(iid))
            .await
    }

    /// POSTs an action that validates engines (readmit, cancel-drain) and prints each
    /// target's checks (never an empty list).
    async fn validating_post(
        &self,
        path: &str,
        body: Value,
        iid: Option<&str>,
    ) -> Result<Value, (Failure, Option<Value>)> {
        match self.post(path, body).await {
            Ok(doc) => {
                let targets = targets_of(&doc, iid);
                self.show_checks(&doc, &targets, None)
                    .map_err(|f| (f, None))?;
                Ok(doc)
            }
            Err((f, Some(doc))) => {
                let targets = targets_of(&doc, iid);
                let router_error = error_text(&doc)
                    .map(str::to_string)
                    .unwrap_or_else(|| f.message().to_string());
                if let Err(p) = self.show_checks(&doc, &targets, Some(&router_error)) {
                    return Err((p, None));
                }
                let failed: Vec<String> = targets
                    .iter()
                    .filter(|i| {
                        doc["engines"][i.as_str()]["error"]
                            .as_str()
                            .is_some_and(|e| !e.is_empty())
                    })
                    .cloned()
                    .collect();
                let f = match f {
                    Failure::Refused(m) if !failed.is_empty() => {
                        Failure::Refused(format!("{m} (failed: {})", failed.join(", ")))
                    }
                    other => other,
                };
                Err((f, Some(doc)))
            }
            Err(e) => Err(e),
        }
    }
}

/// Per target, the checks that passed and what failed. Never an empty "checks passed:" list:
/// when nothing passed it says what stopped the readmission. `router_error` is the router's
/// answer when it was not a success (a 409 `readmission validation failed`, a 503 `this router
/// does not control the fleet` or `router control was fenced during validation`).
fn check_lines(doc: &Value, targets: &[String], router_error: Option<&str>) -> Vec<String> {
    let mut lines = Vec::new();
    for iid in targets {
        let e = &doc["engines"][iid];
        let checks: Vec<&str> = e["checks"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let engine_error = e["error"].as_str().filter(|s| !s.is_empty());
        lines.push(match (checks.is_empty(), router_error) {
            (false, None) => format!("{iid}: checks passed: {}", checks.join(", ")),
            (false, Some(_)) => format!(
                "{iid}: checks passed before it stopped: {}",
                checks.join(", ")
            ),
            (true, Some(_)) => format!("{iid}: no check passed"),
            (true, None) => format!("{iid}: readmitted (the router reported no checks)"),
        });
        if let Some(err) = engine_error {
            lines.push(format!("{iid}: FAILED: {err}"));
        } else if let Some(r) = router_error {
            lines.push(format!("{iid}: FAILED: {r}"));
        }
    }
    lines
}

/// The router's error message in a lifecycle document (`error` is a string there) or an
/// OpenAI-style body (`error.message`).
fn error_text(doc: &Value) -> Option<&str> {
    doc["error"]
        .as_str()
        .or_else(|| doc["error"]["message"].as_str())
        .filter(|s| !s.is_empty())
}

fn yes(v: &Value) -> &'static str {
    if v.as_bool().unwrap_or(false) {
        "yes"
    } else {
        "no"
    }
}

/// One line summarising every held engine: `e0 draining 2p/0d, e1 drained`.
fn progress_line(doc: &Value) -> String {
    let Some(engines) = doc["engines"].as_object() else {
        return String::new();
    };
    engines
        .iter()
        .filter(|(_, e)| e["state"] != "active")
        .map(|(iid, e)| {
            let state = e["state"].as_str().unwrap_or("?");
            let (p, d) = (
                e["resident"]["prefill"].as_u64().unwrap_or(0),
                e["resident"]["decode"].as_u64().unwrap_or(0),
            );
            if p + d > 0 {
                format!("{iid} {state} ({p} prefill, {d} decode resident)")
            } else {
                format!("{iid} {state}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The engines an action applied to: the named one, or the wave's members.
fn targets_of(doc: &Value, iid: Option<&str>) -> Vec<String> {
    match iid {
        Some(i) => vec![i.to_string()],
        None => doc["engines"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(_, e)| {
                        e["state"] != "active"
                            || e["checks"].as_array().is_some_and(|c| !c.is_empty())
                    })
                    .map(|(k, _)| k.clone())
                    .collect()
            })
            .unwrap_or_default(),
    }
}

// ------------------------------------------------------------------------------------------
// wave-restart

/// `wave-restart` options.
struct WaveOpts {
    cmd: String,
    rolling: bool,
    engines: Vec<String>,
    resume: bool,
    deadline_s: f64,
    timeout: Duration,
    restart_timeout: Duration,
}

/// What happened to one engine during a wave-restart (`--json` report `engines[]`).
#[derive(Default, serde::Serialize)]
struct EngineReport {
    iid: String,
    /// The drain was accepted (or found already held with `--resume`).
    drained: bool,
    /// The restart command exited 0.
    restarted: bool,
    /// Exit code of the restart command, when it ran and exited.
    restart_exit: Option<i32>,
    /// Seconds the restart command took.
    restart_s: Option<f64>,
    /// The readmission passed.
    readmitted: bool,
    /// Checks the router reported for it.
    checks: Vec<String>,
    /// What failed for it, `""` when nothing did.
    error: String,
}

/// The single JSON document `wave-restart --json` prints (schema `narwhalctl.wave-restart` v1).
#[derive(serde::Serialize)]
struct WaveReport {
    schema: &'static str,
    schema_version: u32,
    ok: bool,
    mode: &'static str,
    router: String,
    engines: Vec<EngineReport>,
    /// What stopped the wave, `null` on success.
    error: Option<String>,
    /// The exact command that continues the wave, `null` on success.
    next_command: Option<String>,
    /// The router's lifecycle document at the end (`null` if it could not be read).
    lifecycle: Value,
}

/// Where a wave stopped, for the next command.
enum Resume {
    /// Continue with `--resume --engines <list>` (the engines still to do).
    Engines(Vec<String>),
    /// Everything was restarted; only the readmission is left.
    ReadmitWave,
    /// Everything was restarted; only this engine's readmission is left.
    Readmit(String),
}

impl WaveReport {
    fn engine(&mut self, iid: &str) -> &mut EngineReport {
        if let Some(i) = self.engines.iter().position(|e| e.iid == iid) {
            return &mut self.engines[i];
        }
        self.engines.push(EngineReport {
            iid: iid.to_string(),
            ..EngineReport::default()
        });
        self.engines.last_mut().expect("just pushed")
    }

    fn record_checks(&mut self, doc: &Value, targets: &[String]) {
        for iid in targets {
            let e = &doc["engines"][iid.as_str()];
            let checks = e["checks"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default();
            let err = e["error"].as_str().unwrap_or("").to_string();
            let r = self.engine(iid);
            r.checks = checks;
            if !err.is_empty() {
                r.error = err;
            }
        }
    }
}

/// The command line of this invocation with `--resume`/`--engines` replaced by `resume`.
fn next_command(resume: &Resume) -> String {
    let args: Vec<String> = std::env::args().collect();
    let mut kept: Vec<String> = Vec::new();
    let mut global: Vec<String> = Vec::new();
    let mut i = 1;
    let mut seen_sub = false;
    while i < args.len() {
        let a = &args[i];
        if a == "--resume" || a.starts_with("--engines=") {
            i += 1;
            continue;
        }
        if a == "--engines" {
            i += 2;
            continue;
        }
        if a == "wave-restart" && !seen_sub {
            seen_sub = true;
        }
        if seen_sub {
            kept.push(a.clone());
        } else {
            global.push(a.clone());
        }
        i += 1;
    }
    let prog = args
        .first()
        .map_or("narwhalctl".to_string(), |p| shell_quote(p));
    // Global options (everything before the subcommand) are kept as given.
    let mut parts = vec![prog];
    parts.extend(global.iter().map(|a| shell_quote(a)));
    match resume {
        Resume::Engines(list) => {
            parts.extend(kept.iter().map(|a| shell_quote(a)));
            parts.push("--resume".into());
            parts.push("--engines".into());
            parts.push(shell_quote(&list.join(",")));
        }
        Resume::ReadmitWave => {
            parts.push("readmit".into());
            parts.push("--wave".into());
        }
        Resume::Readmit(iid) => {
            parts.push("readmit".into());
            parts.push(shell_quote(iid));
        }
    }
    parts.join(" ")
}

/// Engine addresses from `/narwhal/targets`: iid → (host, port, url).
async fn engine_addresses(
    ctl: &Ctl,
) -> std::collections::BTreeMap<String, (String, String, String)> {
    let mut m = std::collections::BTreeMap::new();
    let Ok((200, doc)) = ctl.get("/narwhal/targets").await else {
        return m;
    };
    for g in doc.as_array().into_iter().flatten() {
        let (Some(iid), Some(target)) = (g["labels"]["iid"].as_str(), g["targets"][0].as_str())
        else {
            continue;
        };
        let scheme = g["labels"]["__scheme__"].as_str().unwrap_or("http");
        let (host, port) = target.rsplit_once(':').unwrap_or((target, ""));
        m.insert(
            iid.to_string(),
            (
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string(),
                port.to_string(),
                format!("{scheme}://{target}"),
            ),
        );
    }
    m
}

impl Ctl {
    /// Runs the restart command for `iid`; its output goes to stderr under `--json`.
    async fn restart(
        &self,
        o: &WaveOpts,
        iid: &str,
        addrs: &std::collections::BTreeMap<String, (String, String, String)>,
        rep: &mut WaveReport,
    ) -> Result<(), Failure> {
        let (host, port, url) = addrs.get(iid).cloned().unwrap_or_default();
        let line = o
            .cmd
            .replace("{iid}", iid)
            .replace("{host}", &host)
            .replace("{port}", &port)
            .replace("{url}", &url);
        if !self.json {
            out(&format!("{iid}: running restart command: {line}"))?;
        }
        let mut cmd = tokio::process::Command::new("sh");
        cmd.arg("-c")
            .arg(&line)
            .env("NARWHAL_IID", iid)
            .env("NARWHAL_ENGINE_HOST", &host)
            .env("NARWHAL_ENGINE_PORT", &port)
            .env("NARWHAL_ENGINE_URL", &url)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        if self.json {
            // stdout carries exactly one JSON document: the command's output goes to stderr.
            cmd.stdout(std::process::Stdio::from(std::io::stderr()));
        }
        let t0 = SystemClock.now();
        let child = cmd.spawn();
        let mut child = child.map_err(|e| {
            Failure::Refused(format!(
                "{iid}: restart command {line:?} could not start: {e}"
            ))
        })?;
        let status = match tokio::time::timeout(o.restart_timeout, child.wait()).await {
            Ok(s) => {
                s.map_err(|e| Failure::Refused(format!("{iid}: restart command {line:?}: {e}")))?
            }
            Err(_) => {
                let _ = child.kill().await;
                rep.engine(iid).restart_s = Some((SystemClock.now() - t0).as_secs_f64());
                return Err(Failure::Refused(format!(
                    "{iid}: restart command {line:?} did not finish within {:.0} s (--restart-timeout-s); killed",
                    o.restart_timeout.as_secs_f64()
                )));
            }
        };
        let r = rep.engine(iid);
        r.restart_s = Some((SystemClock.now() - t0).as_secs_f64());
        r.restart_exit = status.code();
        if !status.success() {
            return Err(Failure::Refused(format!(
                "{iid}: restart command {line:?} exited with {status}"
            )));
        }
        r.restarted = true;
        Ok(())
    }

    /// Makes `iid` ready to stop for a rolling restart: drain it, or with `--resume` adopt a
    /// drain already in place. Returns false when the engine turned out readmitted already.
    async fn rolling_hold(&self, o: &WaveOpts, iid: &str) -> Result<bool, Failure> {
        let mut doc = self.lifecycle().await?;
        // A readmission in flight (ours, timed out, or another client's): let it finish.
        if doc["engines"][iid]["state"] == "validating" {
            doc = self
                .wait(&format!("{iid} validation"), o.timeout, |d| {
                    d["engines"][iid]["state"] != "validating"
                })
                .await?;
            if o.resume && doc["engines"][iid]["state"] == "active" {
                return Ok(false);
            }
        }
        let state = doc["engines"][iid]["state"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        match state.as_str() {
            "active" => {
                if !self.json {
                    out(&format!("== {iid}: drain"))?;
                }
                self.drain(Some(iid), o.deadline_s, true, o.timeout)
                    .await
                    .map_err(|(f, _)| f)?;
            }
            _ if !o.resume => {
                return Err(Failure::Refused(format!(
                    "{iid} is already held (state {state}): continue with --resume, or readmit it first"
                )));
            }
            "blocked" => {
                if !self.json {
                    out(&format!(
                        "== {iid}: already held (blocked), restarting it again"
                    ))?;
                }
            }
            _ => {
                if !self.json {
                    out(&format!(
                        "== {iid}: already held ({state}), waiting for ready_to_stop"
                    ))?;
                }
                self.wait_stop(Some(iid), o.timeout).await?;
            }
        }
        Ok(true)
    }

    async fn wave_steps(
        &self,
        o: &WaveOpts,
        rep: &mut WaveReport,
        next: &mut Option<Resume>,
    ) -> Result<(), Failure> {
        let doc = self.lifecycle().await?;
        let all: Vec<String> = doc["engines"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        for e in &o.engines {
            if !all.contains(e) {
                return Err(Failure::Usage(format!(
                    "--engines: {e:?} is not an engine of this router (engines: {})",
                    all.join(", ")
                )));
            }
        }
        let chosen: Vec<String> = if o.engines.is_empty() {
            all.clone()
        } else {
            all.iter()
                .filter(|e| o.engines.contains(e))
                .cloned()
                .collect()
        };
        let addrs = engine_addresses(self).await;
        if o.rolling {
            for (k, iid) in chosen.iter().enumerate() {
                *next = Some(Resume::Engines(chosen[k..].to_vec()));
                if !self.rolling_hold(o, iid).await? {
                    rep.engine(iid).readmitted = true;
                    continue;
                }
                rep.engine(iid).drained = true;
                self.restart(o, iid, &addrs, rep).await?;
                if !self.json {
                    out(&format!("== {iid}: readmit"))?;
                }
                let r = self.readmit(Some(iid)).await;
                let doc = match &r {
                    Ok(d) | Err((_, Some(d))) => Some(d.clone()),
                    Err((_, None)) => None,
                };
                if let Some(d) = &doc {
                    rep.record_checks(d, std::slice::from_ref(iid));
                }
                if let Err((f, _)) = r {
                    // Continuing restarts this engine again (harmless: it is held) and then
                    // the ones after it, so one command always continues the wave. When it
                    // is the last one and only its checks failed, readmitting is enough.
                    *next = Some(
                        if k + 1 == chosen.len()
                            && !restart_missing(doc.as_ref(), iid)
                            && matches!(f, Failure::Refused(_))
                        {
                            Resume::Readmit(iid.clone())
                        } else {
                            Resume::Engines(chosen[k..].to_vec())
                        },
                    );
                    rep.engine(iid).error = f.message().to_string();
                    return Err(f);
                }
                rep.engine(iid).readmitted = true;
            }
            *next = None;
            return Ok(());
        }
        // Whole wave.
        *next = Some(Resume::Engines(chosen.clone()));
        let wave_active = doc["wave"]["active"] == true;
        if wave_active && !o.resume {
            return Err(Failure::Refused(format!(
                "a wave ({}) is already active: continue it with --resume",
                doc["wave"]["id"].as_str().unwrap_or("")
            )));
        }
        if wave_active {
            if !self.json {
                out("== wave: already active, waiting until every engine is drained or blocked")?;
            }
            self.wait("wave members drained", o.timeout, |d| {
                d["engines"].as_object().is_some_and(|m| {
                    m.values()
                        .filter(|e| !e["wave_id"].as_str().unwrap_or("").is_empty())
                        .all(|e| e["state"] == "drained" || e["state"] == "blocked")
                })
            })
            .await?;
        } else {
            if !self.json {
                out(&format!("== wave: drain {}", all.join(", ")))?;
            }
            self.drain(None, o.deadline_s, true, o.timeout)
                .await
                .map_err(|(f, _)| f)?;
        }
        for iid in &all {
            rep.engine(iid).drained = true;
        }
        for (k, iid) in chosen.iter().enumerate() {
            *next = Some(Resume::Engines(chosen[k..].to_vec()));
            self.restart(o, iid, &addrs, rep).await?;
        }
        if !self.json {
            out("== wave: readmit")?;
        }
        let r = self.readmit(None).await;
        let doc = match &r {
            Ok(d) | Err((_, Some(d))) => Some(d.clone()),
            Err((_, None)) => None,
        };
        if let Some(d) = &doc {
            rep.record_checks(d, &all);
        }
        match r {
            Ok(_) => {
                for iid in &all {
                    rep.engine(iid).readmitted = true;
                }
                *next = None;
                Ok(())
            }
            Err((f, _)) => {
                let not_restarted: Vec<String> = all
                    .iter()
                    .filter(|i| restart_missing(doc.as_ref(), i))
                    .cloned()
                    .collect();
                // Engines the router says did not restart are restarted again; otherwise every
                // process is new and the readmission is what is left.
                *next = Some(if not_restarted.is_empty() {
                    Resume::ReadmitWave
                } else {
                    Resume::Engines(not_restarted)
                });
                Err(f)
            }
        }
    }

    async fn wave_restart(&self, o: &WaveOpts) -> Result<(), Failure> {
        let mut rep = WaveReport {
            schema: "narwhalctl.wave-restart",
            schema_version: 1,
            ok: false,
            mode: if o.rolling { "rolling" } else { "wave" },
            router: self.router.clone(),
            engines: Vec::new(),
            error: None,
            next_command: None,
            lifecycle: Value::Null,
        };
        let mut next = None;
        let result = self.wave_steps(o, &mut rep, &mut next).await;
        if let Err(Failure::PipeClosed) = result {
            // Nobody reads stdout any more: stop, but leave the way back on stderr.
            if let Some(n) = &next {
                eprintln!(
                    "narwhalctl: stdout closed; wave-restart stopped; continue with: {}",
                    next_command(n)
                );
            }
            return result;
        }
        if let Err(Failure::Usage(_)) = &result {
            return result;
        }
        let final_doc = self.lifecycle().await.ok();
        rep.lifecycle = final_doc.clone().unwrap_or(Value::Null);
        rep.ok = result.is_ok();
        if let Err(f) = &result {
            rep.error = Some(f.message().to_string());
            rep.next_command = next.as_ref().map(next_command);
        }
        if self.json {
            out(&serde_json::to_string(&rep).unwrap_or_default())?;
        } else if let Some(doc) = &final_doc {
            let ejected = self.ejected().await;
            self.show(doc, &ejected, &Value::Null)?;
        }
        match result {
            Ok(()) => Ok(()),
            Err(f) => {
                let msg = match &rep.next_command {
                    Some(n) => format!(
                        "wave-restart stopped: {}\nnext: fix the cause above, then run:\n  {n}",
                        f.message()
                    ),
                    None => format!("wave-restart stopped: {}", f.message()),
                };
                Err(match f {
                    Failure::Refused(_) => Failure::Refused(msg),
                    Failure::Unavailable(_) => Failure::Unavailable(msg),
                    other => other,
                })
            }
        }
    }
}

/// Whether the router said `iid`'s process did not restart after its drain.
fn restart_missing(doc: Option<&Value>, iid: &str) -> bool {
    doc.and_then(|d| d["engines"][iid]["error"].as_str())
        .is_some_and(|e| e.contains("did not restart"))
}

async fn run(cli: &Cli) -> Result<(), Failure> {
    let ctl = Ctl::new(cli).await?;
    match &cli.cmd {
        Cmd::Status => ctl.status().await,
        Cmd::Drain {
            iid,
            wave: _,
            deadline_s,
            wait,
            timeout_s,
        } => {
            // Refuse a wrong listener before acting.
            ctl.lifecycle().await?;
            match ctl
                .drain(
                    iid.as_deref(),
                    *deadline_s,
                    *wait,
                    Duration::from_secs_f64(*timeout_s),
                )
                .await
            {
                Ok(doc) => {
                    if ctl.json {
                        out(&doc.to_string())
                    } else {
                        ctl.show(&doc, &ctl.ejected().await, &Value::Null)
                    }
                }
                Err((f, doc)) => {
                    if let Some(d) = doc {
                        if ctl.json {
                            out(&d.to_string())?;
                        } else {
                            ctl.show(&d, &serde_json::Map::new(), &Value::Null)?;
                        }
                    }
                    Err(f)
                }
            }
        }
        Cmd::CancelDrain { iid } => {
            ctl.lifecycle().await?;
            match ctl.cancel_drain(iid).await {
                Ok(doc) => {
                    if ctl.json {
                        out(&doc.to_string())
                    } else {
                        out(&format!("{iid}: drain cancelled, back in service"))
                    }
                }
                Err((f, doc)) => {
                    if ctl.json
                        && let Some(d) = doc
                    {
                        out(&d.to_string())?;
                    }
                    Err(f)
                }
            }
        }
        Cmd::Readmit { iid, wave: _ } => {
            ctl.lifecycle().await?;
            match ctl.readmit(iid.as_deref()).await {
                Ok(doc) => {
                    if ctl.json {
                        out(&doc.to_string())
                    } else {
                        out("readmitted")
                    }
                }
                Err((f, doc)) => {
                    if ctl.json
                        && let Some(d) = doc
                    {
                        out(&d.to_string())?;
                    }
                    Err(f)
                }
            }
        }
        Cmd::WaveRestart {
            restart_cmd,
            rolling,
            engines,
            resume,
            deadline_s,
            timeout_s,
            restart_timeout_s,
        } => {
            ctl.wave_restart(&WaveOpts {
                cmd: restart_cmd.clone(),
                rolling: *rolling,
                engines: engines.clone(),
                resume: *resume,
                deadline_s: *deadline_s,
                timeout: Duration::from_secs_f64(*timeout_s),
                restart_timeout: Duration::from_secs_f64(*restart_timeout_s),
            })
            .await
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::PipeClosed) => Failure::PipeClosed.exit(),
        Err(f) => {
            eprintln!("narwhalctl: {}", f.message());
            f.exit()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quote_leaves_plain_words_and_quotes_the_rest() {
        assert_eq!(shell_quote("--router"), "--router");
        assert_eq!(shell_quote("http://10.0.0.5:8001"), "http://10.0.0.5:8001");
        assert_eq!(
            shell_quote("systemctl restart {iid}"),
            "'systemctl restart {iid}'"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn progress_names_held_engines_with_resident_work() {
        let doc = json!({"engines": {
            "e0": {"state": "draining", "resident": {"prefill": 1, "decode": 2}},
            "e1": {"state": "active", "resident": {"prefill": 0, "decode": 0}},
            "e2": {"state": "drained", "resident": {"prefill": 0, "decode": 0}},
        }});
        assert_eq!(
            progress_line(&doc),
            "e0 draining (1 prefill, 2 decode resident), e2 drained"
        );
    }

    #[test]
    fn check_lines_never_print_an_empty_list_and_name_what_stopped_the_readmission() {
        let t = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // 503 before any check: the router is not in control.
        let doc = json!({"engines": {"p0": {"checks": [], "error": ""}}});
        assert_eq!(
            check_lines(
                &doc,
                &t(&["p0"]),
                Some("this router does not control the fleet")
            ),
            t(&[
                "p0: no check passed",
                "p0: FAILED: this router does not control the fleet"
            ])
        );
        // Fenced during validation: what passed before, and why it stopped.
        let doc = json!({"engines": {"d0": {"checks": ["health", "attestation k"], "error": ""}}});
        assert_eq!(
            check_lines(
                &doc,
                &t(&["d0"]),
                Some("router control was fenced during validation")
            ),
            t(&[
                "d0: checks passed before it stopped: health, attestation k",
                "d0: FAILED: router control was fenced during validation"
            ])
        );
        // A failed check: the engine's own error wins over the router's summary.
        let doc = json!({"engines": {"d0": {"checks": ["health"], "error": "generation: 500"}}});
        assert_eq!(
            check_lines(&doc, &t(&["d0"]), Some("readmission validation failed")),
            t(&[
                "d0: checks passed before it stopped: health",
                "d0: FAILED: generation: 500"
            ])
        );
        // Success.
        let doc = json!({"engines": {"d0": {"checks": ["health", "final health"], "error": ""}}});
        assert_eq!(
            check_lines(&doc, &t(&["d0"]), None),
            t(&["d0: checks passed: health, final health"])
        );
        // An engine the document does not know.
        let lines = check_lines(&json!({}), &t(&["x"]), Some("HTTP 503"));
        assert_eq!(lines, t(&["x: no check passed", "x: FAILED: HTTP 503"]));
    }

    #[test]
    fn presented_names_lose_their_wrapper() {
        assert_eq!(
            presented_name(r#"DnsName("router-a.internal")"#),
            "router-a.internal"
        );
        assert_eq!(presented_name("10.0.0.5"), "10.0.0.5");
    }

    #[test]
    fn restart_missing_reads_the_routers_error() {
        let doc = json!({"engines": {"e0": {"error": "engine process did not restart after drain"},
                                     "e1": {"error": "generation failed"}}});
        assert!(restart_missing(Some(&doc), "e0"));
        assert!(!restart_missing(Some(&doc), "e1"));
        assert!(!restart_missing(None, "e0"));
    }
}

/// Each engine's router role from `/narwhal/state.pools` (`{iid: "prefill"|"decode"}`).
fn roles(state: &Value) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    for role in ["prefill", "decode"] {
        for iid in state["pools"][role].as_array().into_iter().flatten() {
            if let Some(i) = iid.as_str() {
                m.insert(i.to_string(), json!(role));
            }
        }
    }
    m
}

/// The role controller's mode and its newest decision (`by`, `result`, `reason`, `at`, the
/// split it describes), from `/narwhal/state` (`null` fields when unknown).
fn controller_status(state: &Value) -> Value {
    let d = &state["control"]["last_decision"];
    let last = if d.is_object() {
        json!({"by": d["by"], "result": d["result"], "reason": d["reason"], "at": d["at"],
               "prefill": d["prefill"], "decode": d["decode"]})
    } else {
        Value::Null
    };
    json!({"mode": state["controller"], "advisory": state["control"]["advisory"],
           "last_decision": last})
}

/// The status lines of the role controller: each engine's role, then the controller's mode
/// and its last decision with the reason (docs/operate.md, "The role controller").
fn controller_lines(state: &Value, control: &Value) -> Vec<String> {
    let mut lines = Vec::new();
    let roles = roles(state);
    if !roles.is_empty() {
        let list: Vec<String> = roles
            .iter()
            .map(|(iid, r)| format!("{iid}={}", r.as_str().unwrap_or("?")))
            .collect();
        lines.push(format!("roles: {}", list.join(" ")));
    }
    let mode = control["mode"].as_str().unwrap_or("unknown");
    let advisory = if control["advisory"] == json!(true) {
        " (advisory)"
    } else {
        ""
    };
    let last = &control["last_decision"];
    if last.is_object() {
        lines.push(format!(
            "controller: {mode}{advisory}  last decision: {} {} -> {}P/{}D: {}",
            last["by"].as_str().unwrap_or("?"),
            last["result"].as_str().unwrap_or("?"),
            last["prefill"],
            last["decode"],
            last["reason"].as_str().unwrap_or("")
        ));
    } else {
        lines.push(format!("controller: {mode}{advisory}  no decision yet"));
    }
    lines
}

#[cfg(test)]
mod controller_status_tests {
    use super::*;

    /// `narwhalctl status` shows each engine's role and the last decision with its reason.
    #[test]
    fn status_lines_name_roles_and_the_last_decision() {
        let state = json!({
            "controller": "reactive",
            "pools": {"prefill": ["e0", "e1"], "decode": ["e2"]},
            "control": {"advisory": false, "last_decision": {
                "by": "reactive", "result": "held", "reason": "waiting for sustained demand",
                "at": 1.0, "prefill": 3, "decode": 1}},
        });
        let lines = controller_lines(&state, &controller_status(&state));
        assert_eq!(lines[0], "roles: e0=prefill e1=prefill e2=decode");
        assert_eq!(
            lines[1],
            "controller: reactive  last decision: reactive held -> 3P/1D: waiting for sustained demand"
        );
        let off = json!({"controller": "off", "pools": {"prefill": [], "decode": ["e0"]}});
        assert_eq!(
            controller_lines(&off, &controller_status(&off))[1],
            "controller: off  no decision yet"
        );
    }
}
