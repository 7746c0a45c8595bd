//! The command line: the global options (`--router`, TLS, `--json`, the request timeout) and
//! one subcommand per action. Every doc comment here is `--help` text.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "narwhalctl",
    version,
    about = "Drain, restart and readmit Narwhal engines"
)]
pub(crate) struct Cli {
    /// Control listener of the active router (`narwhal-serve --control-listen`, default port
    /// 8001), e.g. `http://10.0.0.5:8001`, or `https://…` when the fleet file sets
    /// `control.tls`. The data listener (OpenAI routes) is refused.
    #[arg(long, env = "NARWHAL_ROUTER")]
    pub(crate) router: String,
    /// CA bundle (PEM) that signed the router's control certificate (`control.tls`).
    #[arg(long)]
    pub(crate) ca: Option<PathBuf>,
    /// Client certificate (PEM) issued by the CA in the router's `control.tls.ca`.
    #[arg(long, requires_all = ["ca", "key"])]
    pub(crate) cert: Option<PathBuf>,
    /// Client private key (PEM).
    #[arg(long, requires = "cert")]
    pub(crate) key: Option<PathBuf>,
    /// Name to verify in the router's certificate when it differs from the host in `--router`
    /// (for example connecting by IP address to a certificate that names `router-a.internal`).
    #[arg(long)]
    pub(crate) server_name: Option<String>,
    /// Print machine-readable JSON instead of tables: exactly one JSON document on stdout.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// Seconds to wait for the router to answer one call.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) request_timeout_s: f64,
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
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
