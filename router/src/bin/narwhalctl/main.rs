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
//!
//! Layout: `cli` (the command line), `client` (the HTTP client: `--router`, TLS,
//! `--server-name`) and `transport` (its errors as operator messages), `failure` (exit codes),
//! `output` (what is printed), and one module per command: `status`, `drain`, `readmit`,
//! `cancel_drain`, `wave_restart`.

mod cancel_drain;
mod cli;
mod client;
mod drain;
mod failure;
mod output;
mod readmit;
mod status;
mod transport;
mod wave_restart;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser as _;

use crate::cli::{Cli, Cmd};
use crate::client::Ctl;
use crate::failure::Failure;
use crate::wave_restart::WaveOpts;

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
        } => drain::run(&ctl, iid.as_deref(), *deadline_s, *wait, *timeout_s).await,
        Cmd::CancelDrain { iid } => cancel_drain::run(&ctl, iid).await,
        Cmd::Readmit { iid, wave: _ } => readmit::run(&ctl, iid.as_deref()).await,
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
