//! `narwhal-prestop`: an engine pod's preStop hook (docs/kubernetes.md, "Self-drain"). Drains
//! this pod's engine through the router's self-drain listener, authenticated by the pod's
//! projected service-account token, and returns once the router says it may stop
//! (`ready_to_stop`), or when its budget ends. It fails open: when no router answers within
//! `--connect-timeout-s`, it returns at once, so a node drain never hangs on it.
//!
//! Exit status: 0 ready to stop; 1 no router answered within `--connect-timeout-s`, or it
//! answered 503 (not in control during a takeover, or the API server could not be asked) for
//! `--unavailable-wait-s`; 2 the router refused (the message says why: token, pod, engine); 3
//! the budget ended first. A drain request sent and not answered is followed by polling, which
//! asks again while the router shows the engine not draining. Kubelet goes on to SIGTERM either way;
//! a non-zero status shows as a `FailedPreStopHook` event on the pod.
//!
//! With `--ready` it is the engine container's readiness probe instead: exit 0 when the router
//! places on every engine of this pod (each `accepts_new`: readmitted through the checks), 1
//! otherwise. A rollout that waits for Ready pods then waits for the router's checks before it
//! takes the next pod down.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use narwhal_shared::documents::{ErrorReply, SelfDrainStatus};

#[derive(Parser)]
#[command(
    name = "narwhal-prestop",
    version,
    about = "Drain this engine pod's engine through the Narwhal router, then return"
)]
struct Args {
    /// The router's self-drain listener (`control.self_drain.listen`), through the chart's
    /// Service: `https://narwhal-self-drain.narwhal.svc:8002`.
    #[arg(long, env = "NARWHAL_SELF_DRAIN_URL")]
    router: String,
    /// The pod's projected service-account token for the self-drain audience.
    #[arg(
        long,
        env = "NARWHAL_TOKEN_FILE",
        default_value = "/var/run/secrets/narwhal/token"
    )]
    token_file: PathBuf,
    /// CA (PEM) of the router's certificate (`control.tls`); needed for `https://`.
    #[arg(long, env = "NARWHAL_CA")]
    ca: Option<PathBuf>,
    /// Name to verify in the router's certificate when it differs from the host in `--router`
    /// (connect to the Service's address, verify the certificate for `router.internal`).
    #[arg(long)]
    server_name: Option<String>,
    /// Drain only this engine of the pod (default: all of the pod's engines).
    #[arg(long)]
    engine: Option<String>,
    /// Give up waiting after this many seconds (keep it below the pod's
    /// terminationGracePeriodSeconds minus the engine's own shutdown).
    #[arg(long, default_value_t = 300.0)]
    budget_s: f64,
    /// How long to keep trying to reach a router before failing open.
    #[arg(long, default_value_t = 5.0)]
    connect_timeout_s: f64,
    /// How long to keep asking a router that answers 503 (it does not control the fleet: a
    /// takeover is under way; or it cannot ask the API server) before failing open.
    #[arg(long, default_value_t = 30.0)]
    unavailable_wait_s: f64,
    /// Seconds between polls of the drain.
    #[arg(long, default_value_t = 1.0)]
    poll_s: f64,
    /// Readiness probe: drain nothing; exit 0 when the router places on every engine of this
    /// pod, 1 otherwise.
    #[arg(long)]
    ready: bool,
}

#[derive(serde::Serialize)]
struct Body<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    engine: Option<&'a str>,
}

/// One call's outcome.
enum Answer {
    /// A 2xx with its body.
    Ok(Vec<u8>),
    /// The router answered with an error: status and message.
    Refused(u16, String),
    /// No connection to a router.
    Unreachable(String),
    /// Sent, and no answer came (a timeout, a connection cut): the drain may have started.
    Unanswered(String),
}

/// The HTTP client and the base URL to call (with `--server-name`, the name, resolved to the
/// `--router` address).
async fn client(args: &Args) -> Result<(reqwest::Client, String), String> {
    use narwhal_shared::tls::{ServerTrust, build_client_config, plain_http_client_config};
    let tls = match &args.ca {
        Some(ca) => build_client_config(ServerTrust::Ca(ca), None, &[b"http/1.1"])
            .map_err(|e| format!("--ca {}: {e}", ca.display()))?,
        None => plain_http_client_config().map_err(|e| e.to_string())?,
    };
    let mut b = reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .no_proxy()
        .connect_timeout(Duration::from_secs_f64(args.connect_timeout_s.max(0.1)))
        .timeout(Duration::from_secs(30));
    let mut url = reqwest::Url::parse(&args.router).map_err(|e| format!("--router: {e}"))?;
    if let Some(name) = &args.server_name {
        let host = url.host_str().unwrap_or_default().to_string();
        let port = url.port_or_known_default().unwrap_or(443);
        let sock = tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|e| format!("--router: cannot resolve {host}: {e}"))?
            .next()
            .ok_or_else(|| format!("--router: {host} has no address"))?;
        b = b.resolve(name, sock);
        url.set_host(Some(name))
            .map_err(|e| format!("--server-name {name:?}: {e}"))?;
    }
    let http = b.build().map_err(|e| e.to_string())?;
    Ok((http, url.as_str().trim_end_matches('/').to_string()))
}

async fn call(http: &reqwest::Client, base: &str, args: &Args, post: bool) -> Answer {
    let token = match std::fs::read_to_string(&args.token_file) {
        Ok(t) => t.trim().to_string(),
        Err(e) => {
            return Answer::Refused(0, format!("token file {}: {e}", args.token_file.display()));
        }
    };
    let url = format!("{base}/narwhal/self-drain");
    let req = if post {
        http.post(&url).json(&Body {
            engine: args.engine.as_deref(),
        })
    } else {
        http.get(&url)
    };
    match req.bearer_auth(token).send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let bytes = resp.bytes().await.map(|b| b.to_vec()).unwrap_or_default();
            if (200..300).contains(&status) {
                Answer::Ok(bytes)
            } else {
                let msg = serde_json::from_slice::<ErrorReply>(&bytes)
                    .map(|e| e.error.message)
                    .ok()
                    .filter(|m| !m.is_empty())
                    .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
                Answer::Refused(status, msg)
            }
        }
        Err(e) if e.is_connect() => Answer::Unreachable(e.to_string()),
        Err(e) => Answer::Unanswered(e.to_string()),
    }
}

async fn run(args: Args) -> ExitCode {
    let (http, base) = match client(&args).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("narwhal-prestop: {e}");
            return ExitCode::from(2);
        }
    };
    if args.ready {
        return match call(&http, &base, &args, false).await {
            Answer::Ok(bytes) => match serde_json::from_slice::<SelfDrainStatus>(&bytes) {
                Ok(st) if !st.engines.is_empty() && st.engines.values().all(|e| e.accepts_new) => {
                    ExitCode::SUCCESS
                }
                Ok(st) => {
                    let out: Vec<&String> = st
                        .engines
                        .iter()
                        .filter(|(_, e)| !e.accepts_new)
                        .map(|(iid, _)| iid)
                        .collect();
                    eprintln!("narwhal-prestop: not in placement yet: {out:?}");
                    ExitCode::from(1)
                }
                Err(e) => {
                    eprintln!("narwhal-prestop: not a self-drain status: {e}");
                    ExitCode::from(1)
                }
            },
            Answer::Refused(status, msg) => {
                eprintln!("narwhal-prestop: the router refused ({status}): {msg}");
                ExitCode::from(1)
            }
            Answer::Unreachable(e) | Answer::Unanswered(e) => {
                eprintln!(
                    "narwhal-prestop: no router answered at {}: {e}",
                    args.router
                );
                ExitCode::from(1)
            }
        };
    }
    let started = tokio::time::Instant::now();
    let budget = Duration::from_secs_f64(args.budget_s.max(0.0));
    let connect = Duration::from_secs_f64(args.connect_timeout_s.max(0.0));
    let poll = Duration::from_secs_f64(args.poll_s.max(0.05));
    let unavailable = Duration::from_secs_f64(args.unavailable_wait_s.max(0.0)).min(budget);
    // Start the drain: a router that cannot be reached is retried until the connect timeout,
    // one that answers 503 until the unavailable wait, then the hook fails open.
    match start(&http, &base, &args, started, connect, unavailable).await {
        Ok(()) => {}
        Err(code) => return code,
    }
    eprintln!("narwhal-prestop: drain started; waiting until ready to stop");
    loop {
        match call(&http, &base, &args, false).await {
            Answer::Ok(bytes) => match serde_json::from_slice::<SelfDrainStatus>(&bytes) {
                Ok(st) if st.ready_to_stop => {
                    eprintln!(
                        "narwhal-prestop: {} ready to stop after {:.1} s ({})",
                        st.pod,
                        started.elapsed().as_secs_f64(),
                        st.engines.keys().cloned().collect::<Vec<_>>().join(", ")
                    );
                    return ExitCode::SUCCESS;
                }
                // An engine not draining (a drain whose start was lost, a router that took
                // over without it): ask again.
                Ok(st) if st.engines.values().any(|e| !e.draining) => {
                    eprintln!("narwhal-prestop: not draining at the router: asking again");
                    let _ = call(&http, &base, &args, true).await;
                }
                _ => {}
            },
            Answer::Refused(status, msg) => {
                eprintln!("narwhal-prestop: polling the drain ({status}): {msg}");
            }
            Answer::Unreachable(e) | Answer::Unanswered(e) => {
                eprintln!("narwhal-prestop: polling the drain: {e}");
            }
        }
        if started.elapsed() + poll > budget {
            eprintln!(
                "narwhal-prestop: not ready to stop within the {} s budget: stopping anyway",
                budget.as_secs_f64()
            );
            return ExitCode::from(3);
        }
        tokio::time::sleep(poll).await;
    }
}

/// Starts the drain (see [`run`]); the exit code when the hook ends here.
async fn start(
    http: &reqwest::Client,
    base: &str,
    args: &Args,
    started: tokio::time::Instant,
    connect: Duration,
    unavailable: Duration,
) -> Result<(), ExitCode> {
    loop {
        match call(http, base, args, true).await {
            Answer::Ok(_) => return Ok(()),
            // Sent and not answered: the router may be draining (a long wait for its lifecycle
            // lock); polling shows it, and asks again if it is not.
            Answer::Unanswered(e) => {
                eprintln!("narwhal-prestop: the drain request got no answer ({e}): polling");
                return Ok(());
            }
            Answer::Refused(503, msg) if started.elapsed() < unavailable => {
                eprintln!("narwhal-prestop: the router cannot drain now (503): {msg}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Answer::Refused(503, msg) => {
                eprintln!(
                    "narwhal-prestop: the router could not drain within {} s (503: {msg}): not \
                     draining (failing open)",
                    unavailable.as_secs_f64()
                );
                return Err(ExitCode::from(1));
            }
            Answer::Refused(status, msg) => {
                eprintln!("narwhal-prestop: the router refused the drain ({status}): {msg}");
                return Err(ExitCode::from(2));
            }
            Answer::Unreachable(e) if started.elapsed() >= connect => {
                eprintln!(
                    "narwhal-prestop: no router answered at {} within {} s ({e}): not draining \
                     (failing open)",
                    args.router,
                    connect.as_secs_f64()
                );
                return Err(ExitCode::from(1));
            }
            Answer::Unreachable(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(run(args)),
        Err(e) => {
            eprintln!("narwhal-prestop: starting the runtime: {e}");
            ExitCode::from(2)
        }
    }
}
