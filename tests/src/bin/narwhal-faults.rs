//! `narwhal-faults`: the HA fault campaign (docs/testing.md) by hand. Each run starts a fresh
//! fleet (2 prefill, 2 decode, agents, a 2 s file or etcd lease, a primary and a warm
//! standby), hits it right after an acknowledged drain or readmission, during validation, or
//! during a wave, with a fault: `kill -9` or `SIGSTOP` of the primary, etcd killed or stopped,
//! the primary cut off from etcd, a router's wall clock stepped, the primary's state-file and
//! journal disk full or read-only, its state file's fsyncs failing
//! (`--faults process|store|disk|wide|all`), and judges it
//! (`narwhal_testkit::faults`). Prints every run and a summary; exits 1 when a run broke a
//! rule. The disk faults mount a tmpfs: run it as root (a container's root will do).
//!
//! ```sh
//! cargo build --workspace --bins && nice -n 10 ./target/debug/narwhal-faults --runs 100
//! ```

use std::process::ExitCode;

use clap::Parser;
use rand::Rng;
use tokio::signal::unix::{SignalKind, signal};

/// Command line.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Run the HA fault campaign (docs/testing.md) on fresh local fleets"
)]
struct Cli {
    /// How many runs.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Seed of the scenarios (default: random, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Fleets at a time.
    #[arg(long, default_value_t = 2)]
    parallel: usize,
    /// Which faults: `process` (kill and pause of the primary, file lease), `store` (etcd
    /// and partition faults, etcd lease), `disk` (disk full or read-only and fsync errors,
    /// etcd and file leases in turn), `wide` (etcd, partition, clock, disk and fsync faults,
    /// etcd and file leases in turn) or `all`.
    #[arg(long, default_value = "all", value_parser = ["process", "store", "disk", "wide", "all"])]
    faults: String,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let seed = cli.seed.unwrap_or_else(|| rand::rng().random());
    let mix = match cli.faults.as_str() {
        "process" => narwhal_testkit::faults::Mix::PROCESS,
        "store" => narwhal_testkit::faults::Mix::STORE,
        "disk" => narwhal_testkit::faults::Mix::DISK,
        "wide" => narwhal_testkit::faults::Mix::WIDE,
        _ => narwhal_testkit::faults::Mix::ALL,
    };
    eprintln!(
        "narwhal-faults: {} runs, seed {seed}, {} at a time, faults {}",
        cli.runs, cli.parallel, cli.faults
    );
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        eprintln!("narwhal-faults: cannot handle SIGTERM");
        return ExitCode::FAILURE;
    };
    // Interrupted: returning drops the runtime, every run with it, and so every fleet's
    // processes (the kit kills them on drop).
    let outcomes = tokio::select! {
        o = narwhal_testkit::faults::campaign(cli.runs, seed, cli.parallel, mix) => o,
        _ = tokio::signal::ctrl_c() => {
            eprintln!("narwhal-faults: interrupted; stopping the fleets");
            return ExitCode::from(130);
        }
        _ = term.recv() => {
            eprintln!("narwhal-faults: terminated; stopping the fleets");
            return ExitCode::from(143);
        }
    };
    let summary = narwhal_testkit::faults::summary(&outcomes);
    println!("seed {seed}: {summary}");
    if outcomes.iter().any(|o| !o.violations.is_empty()) {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
