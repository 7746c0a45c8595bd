//! The HA fault campaign (docs/testing.md) as code: one run starts a fresh fleet (2 prefill, 2
//! decode, one agent per engine, a `file` or `etcd` lease of [`LEASE_TTL_S`], a primary and a
//! warm standby), keeps traffic flowing, samples both routers at 20 Hz, performs a lifecycle
//! action, and at a chosen point of it hits the fleet with a [`Fault`]: `kill -9` or `SIGSTOP`
//! of the primary, etcd killed or stopped, the primary cut off from etcd, a router's wall clock
//! stepped, the primary's state-file and journal disk full or read-only, or its state file's
//! fsyncs failing. Then it checks what an operator relies on (and, per fault, what its
//! docstring adds):
//!
//! - no acknowledged action lost: an action answered 200 holds on whichever router controls
//!   the fleet at the end (a drained engine stays out of placement and gets no traffic, a
//!   readmitted one is back); a later request answered 503 or not at all leaves its engine
//!   undetermined only when the router that got it controls the fleet at the end under the
//!   same epoch (its memory keeps the unacknowledged change, docs/ha.md), or when the 503 says
//!   its outcome is unknown (the lease store got the write and did not confirm it);
//! - never two routers reporting `controls_fleet: active` in one sample;
//! - a controller within TTL + 1 s of the fault ending (the kill, or the `SIGCONT`);
//! - totals (`served`) read from the router that controls the fleet never go backwards;
//! - no `ready_to_stop: true` from a router that does not control the fleet.
//!
//! ```text
//!  Scenario { when: Timing, fault: Fault, delay }
//!     run(): Fleet ─► traffic + Sampler (20 Hz, /narwhal/state of both) ─► action ─► fault
//!            ─► settle ─► checks ─► Outcome { violations, takeover, ... }
//!  campaign(runs, seed, parallel, mix): random scenarios of a Mix (lease backends in turn,
//!            fault families drawn), `parallel` fleets at a time
//! ```
//!
//! Used by `tests/tests/e2e/ha_faults_e2e.rs` (named scenarios and 20 randomized runs in CI) and
//! by `narwhal-faults --runs N` (the campaign by hand).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use narwhal_shared::documents::requests::{DrainBody, ReadmitBody};
use narwhal_shared::documents::{Lifecycle, LifecycleReply};
use narwhal_shared::handoff::{DrainState, Handoff};
use nix::sys::signal::Signal;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::faketime::MovableClock;
use crate::fleet::{Fleet, LEASE_TTL_S, LeaseBackend};
use crate::http::Http;
use crate::router::{RouterHandle, RouterProbe};
use crate::sampler::{Sample, Sampler};
use crate::sim_stats::SimStats;

/// When the fault hits the primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// Right after `drain p1` was answered 200.
    AfterDrainAck,
    /// Right after `readmit p1` (a restarted p1) was answered 200.
    AfterReadmitAck,
    /// While the readmission of a restarted p1 is being validated.
    DuringValidation,
    /// Right after a whole-fleet wave drain was answered 200 (`whole_wave` policy).
    AfterWaveDrainAck,
    /// While the whole wave's readmission is being validated (every engine restarted).
    DuringWaveReadmit,
}

impl Timing {
    /// Every timing, in the order a campaign cycles through them.
    pub const ALL: [Timing; 5] = [
        Timing::AfterDrainAck,
        Timing::AfterReadmitAck,
        Timing::DuringValidation,
        Timing::AfterWaveDrainAck,
        Timing::DuringWaveReadmit,
    ];

    fn wave(self) -> bool {
        matches!(self, Timing::AfterWaveDrainAck | Timing::DuringWaveReadmit)
    }

    fn during(self) -> bool {
        matches!(self, Timing::DuringValidation | Timing::DuringWaveReadmit)
    }
}

/// How a partition cuts the link ([`Fault::Partition`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Open connections are dropped and new ones refused (a host that answers with resets).
    Refuse,
    /// Open connections go silent and new ones are never answered (a route that drops
    /// packets): the router sees only its own timeouts.
    Blackhole,
}

/// Which router a fault hits ([`Fault::ClockJump`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The router that holds the lease.
    Primary,
    /// The warm standby.
    Standby,
}

/// What hits the fleet (the primary unless said otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9`.
    Kill,
    /// `SIGSTOP`, then `SIGCONT` after this long.
    Pause(Duration),
    /// `SIGSTOP` of the primary for the first duration and, at the same moment, of the
    /// standby for the second (a standby slower to notice than the primary is to come back:
    /// the campaign's fleet without a controller).
    PauseBoth(Duration, Duration),
    /// etcd lease only: `kill -9` of etcd, restarted after this long on the same ports and
    /// data directory. Both routers lose their store; the holder fences itself when its local
    /// validity ends (a down time over `ttl_s − safety_margin_s`), and someone controls the
    /// fleet again after the restart. The fault ends at the restart.
    EtcdKill(Duration),
    /// etcd lease only: `SIGSTOP` of etcd for this long (past the TTL in random runs), then
    /// `SIGCONT`. etcd's calls hang rather than fail; the holder fences itself when its local
    /// validity ends. The fault ends at the `SIGCONT`.
    EtcdPause(Duration),
    /// etcd lease only: the link between the primary and etcd (a kit TCP proxy only the
    /// primary uses) is cut this way for this long, then healed; the standby still reaches
    /// etcd. Besides the common checks: the primary reports no `controls_fleet: active` later
    /// than TTL after the cut while it lasts (its last keep-alive was before the cut, so its
    /// etcd lease is gone by then and the standby may hold the fleet: it stops acting first,
    /// on its local validity). The fault ends at the heal.
    Partition(Cut, Duration),
    /// The wall clock (`CLOCK_REALTIME`, libfaketime reading an offset file; the monotonic
    /// clock untouched) of one router steps by this many seconds (ahead when positive), and
    /// the run samples on for 3 s (over a TTL). Besides the common checks: the primary, live
    /// and renewing, keeps the fleet: it answers `controls_fleet: active` in every sample it
    /// answers, the standby never does, and the lease's epoch and holder at the end are the
    /// ones before the step (docs/ha.md, "Clocks": no wall clock is compared across routers).
    /// The fault ends at the step.
    ClockJump(Side, i64),
    /// The primary's disk (its `recovery.state_path` directory and its journal, a tmpfs) is
    /// filled to the last byte for this long; meanwhile the primary is sent an action on p1
    /// (after an acknowledged drain, its cancel; after an acknowledged readmission, a drain),
    /// acknowledged or not. Then the disk is freed and the primary
    /// killed (`kill -9`), so the standby must hold every acknowledged action. Besides the
    /// common checks: the state file parses whenever read (during the fault, after it), every
    /// journal line is a whole JSON row. The fault ends at the kill.
    DiskFull(Duration),
    /// [`Fault::DiskFull`] with the disk made read-only instead (files opened from then on
    /// fail with `EROFS`: every state-file write; the journal, opened before, keeps writing:
    /// see `crate::disk`).
    DiskReadOnly(Duration),
    /// [`Fault::DiskFull`] with every fsync of the primary's state-file writes failing with
    /// `EIO` instead (`crate::fsync`: the disk accepts the write and loses it), on whatever
    /// disk the state file is; the journal is not fsynced and is untouched.
    FsyncError(Duration),
}

/// The families of faults a campaign draws from ([`Mix`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// [`Fault::Kill`], [`Fault::Pause`], [`Fault::PauseBoth`] of the primary.
    Process,
    /// [`Fault::EtcdKill`], [`Fault::EtcdPause`] (etcd lease).
    Etcd,
    /// [`Fault::Partition`] (etcd lease).
    Partition,
    /// [`Fault::ClockJump`].
    Clock,
    /// [`Fault::DiskFull`], [`Fault::DiskReadOnly`] (a `tmpfs` mount: root only).
    Disk,
    /// [`Fault::FsyncError`] (a preloaded library: no privilege needed).
    Fsync,
}

impl Kind {
    /// Whether this family can run on `lease`.
    pub fn runs_on(self, lease: LeaseBackend) -> bool {
        lease == LeaseBackend::Etcd || !matches!(self, Kind::Etcd | Kind::Partition)
    }
}

impl Fault {
    /// The family.
    pub fn kind(self) -> Kind {
        match self {
            Fault::Kill | Fault::Pause(_) | Fault::PauseBoth(..) => Kind::Process,
            Fault::EtcdKill(_) | Fault::EtcdPause(_) => Kind::Etcd,
            Fault::Partition(..) => Kind::Partition,
            Fault::ClockJump(..) => Kind::Clock,
            Fault::DiskFull(_) | Fault::DiskReadOnly(_) => Kind::Disk,
            Fault::FsyncError(_) => Kind::Fsync,
        }
    }

    /// A short name for summaries (`kill`, `etcd kill`, `partition blackhole`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Pause(_) => "pause",
            Fault::PauseBoth(..) => "pause both",
            Fault::EtcdKill(_) => "etcd kill",
            Fault::EtcdPause(_) => "etcd pause",
            Fault::Partition(Cut::Refuse, _) => "partition refuse",
            Fault::Partition(Cut::Blackhole, _) => "partition blackhole",
            Fault::ClockJump(Side::Primary, _) => "clock primary",
            Fault::ClockJump(Side::Standby, _) => "clock standby",
            Fault::DiskFull(_) => "disk full",
            Fault::DiskReadOnly(_) => "disk read-only",
            Fault::FsyncError(_) => "fsync error",
        }
    }
}

/// What a campaign draws from: lease backends (in turn, run by run) and fault families
/// (drawn among those that run on the run's backend).
#[derive(Debug, Clone, Copy)]
pub struct Mix {
    /// Lease backends, in turn.
    pub leases: &'static [LeaseBackend],
    /// Fault families.
    pub kinds: &'static [Kind],
}

impl Mix {
    /// The first campaign: `file` lease, kill and pause of the primary.
    pub const PROCESS: Mix = Mix {
        leases: &[LeaseBackend::File],
        kinds: &[Kind::Process],
    };
    /// The store, network, clock and disk faults, on `file` and `etcd` in turn.
    pub const WIDE: Mix = Mix {
        leases: &[LeaseBackend::Etcd, LeaseBackend::File],
        kinds: &[
            Kind::Etcd,
            Kind::Partition,
            Kind::Clock,
            Kind::Disk,
            Kind::Fsync,
        ],
    };
    /// [`Mix::WIDE`] without the disk faults, for a machine that refuses the `tmpfs` mount
    /// they need.
    pub const WIDE_WITHOUT_DISK: Mix = Mix {
        leases: &[LeaseBackend::Etcd, LeaseBackend::File],
        kinds: &[Kind::Etcd, Kind::Partition, Kind::Clock, Kind::Fsync],
    };
    /// The etcd and partition faults alone (etcd lease).
    pub const STORE: Mix = Mix {
        leases: &[LeaseBackend::Etcd],
        kinds: &[Kind::Etcd, Kind::Partition],
    };
    /// The disk and fsync faults alone, on `file` and `etcd` in turn.
    pub const DISK: Mix = Mix {
        leases: &[LeaseBackend::Etcd, LeaseBackend::File],
        kinds: &[Kind::Disk, Kind::Fsync],
    };
    /// Every family, on `file` and `etcd` in turn.
    pub const ALL: Mix = Mix {
        leases: &[LeaseBackend::Etcd, LeaseBackend::File],
        kinds: &[
            Kind::Process,
            Kind::Etcd,
            Kind::Partition,
            Kind::Clock,
            Kind::Disk,
            Kind::Fsync,
        ],
    };
}

/// One run: when, what, how long after the trigger (the 200, or the readmission request)
/// the fault lands, and on which lease backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scenario {
    /// When.
    pub when: Timing,
    /// What.
    pub fault: Fault,
    /// Delay between the trigger and the fault.
    pub delay: Duration,
    /// The fleet's lease (the etcd and partition faults need [`LeaseBackend::Etcd`]).
    pub lease: LeaseBackend,
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fault = match self.fault {
            Fault::Kill => "kill -9".to_string(),
            Fault::Pause(d) => format!("SIGSTOP {:.2} s", d.as_secs_f64()),
            Fault::PauseBoth(p, s) => format!(
                "SIGSTOP {:.2} s (standby {:.2} s)",
                p.as_secs_f64(),
                s.as_secs_f64()
            ),
            Fault::EtcdKill(d) => format!("etcd kill -9, down {:.2} s", d.as_secs_f64()),
            Fault::EtcdPause(d) => format!("etcd SIGSTOP {:.2} s", d.as_secs_f64()),
            Fault::Partition(c, d) => format!("partition {c:?} {:.2} s", d.as_secs_f64()),
            Fault::ClockJump(side, by) => format!("{side:?} wall clock {by:+} s"),
            Fault::DiskFull(d) => format!("disk full {:.2} s, then kill -9", d.as_secs_f64()),
            Fault::DiskReadOnly(d) => {
                format!("disk read-only {:.2} s, then kill -9", d.as_secs_f64())
            }
            Fault::FsyncError(d) => {
                format!("fsync errors {:.2} s, then kill -9", d.as_secs_f64())
            }
        };
        let lease = match self.lease {
            LeaseBackend::File => "file",
            LeaseBackend::Etcd => "etcd",
            LeaseBackend::Kubernetes => "kubernetes",
        };
        write!(
            f,
            "[{lease}] {fault} {:?} +{} ms",
            self.when,
            self.delay.as_millis()
        )
    }
}

impl Scenario {
    /// A random scenario of timing `when` on lease `lease`, of a family of `kinds` that runs
    /// on it ([`Kind::runs_on`]; [`Kind::Process`] when none does), landing 0-150 ms after an
    /// acknowledgement or 50-900 ms into a validation:
    ///
    /// - process: kill or pause (2-6 s; during a validation just past the TTL, sometimes
    ///   with the standby stopped 0.5-1.5 s longer);
    /// - etcd: `kill -9` of etcd, down 0.2-4 s, or `SIGSTOP` of it 10-1500 ms past the TTL;
    /// - partition: refused or blackholed, 0.3-4 s;
    /// - clock: the primary's or the standby's wall clock steps 5-120 s ahead or back;
    /// - disk: full or read-only for 1-3 s;
    /// - fsync: the state file's fsyncs fail for 1-3 s.
    pub fn random(
        when: Timing,
        lease: LeaseBackend,
        kinds: &[Kind],
        rng: &mut impl Rng,
    ) -> Scenario {
        let ttl = Duration::from_secs_f64(LEASE_TTL_S);
        let ms = |rng: &mut dyn rand::RngCore, lo: u64, hi: u64| {
            Duration::from_millis(rng.random_range(lo..hi))
        };
        let usable: Vec<Kind> = kinds.iter().copied().filter(|k| k.runs_on(lease)).collect();
        let kind = if usable.is_empty() {
            Kind::Process
        } else {
            usable[rng.random_range(0..usable.len())]
        };
        let fault = match kind {
            Kind::Process => Scenario::process_fault(when, rng),
            Kind::Etcd if rng.random_bool(0.5) => Fault::EtcdKill(ms(rng, 200, 4000)),
            Kind::Etcd => Fault::EtcdPause(ttl + ms(rng, 10, 1500)),
            Kind::Partition => {
                let cut = if rng.random_bool(0.5) {
                    Cut::Refuse
                } else {
                    Cut::Blackhole
                };
                Fault::Partition(cut, ms(rng, 300, 4000))
            }
            Kind::Clock => {
                let side = if rng.random_bool(0.5) {
                    Side::Primary
                } else {
                    Side::Standby
                };
                let by = rng.random_range(5..=120i64);
                Fault::ClockJump(side, if rng.random_bool(0.5) { by } else { -by })
            }
            Kind::Disk if rng.random_bool(0.5) => Fault::DiskFull(ms(rng, 1000, 3000)),
            Kind::Disk => Fault::DiskReadOnly(ms(rng, 1000, 3000)),
            Kind::Fsync => Fault::FsyncError(ms(rng, 1000, 3000)),
        };
        let delay = if when.during() {
            Duration::from_millis(rng.random_range(50..900))
        } else {
            Duration::from_millis(rng.random_range(0..150))
        };
        Scenario {
            when,
            fault,
            delay,
            lease,
        }
    }

    fn process_fault(when: Timing, rng: &mut impl Rng) -> Fault {
        let ttl = Duration::from_secs_f64(LEASE_TTL_S);
        match rng.random_range(0..3) {
            0 => Fault::Kill,
            1 if when.during() => {
                let p = ttl + Duration::from_millis(rng.random_range(10..300));
                Fault::PauseBoth(p, p + Duration::from_millis(rng.random_range(500..1500)))
            }
            _ if when.during() => {
                Fault::Pause(ttl + Duration::from_millis(rng.random_range(10..300)))
            }
            _ => Fault::Pause(Duration::from_millis(rng.random_range(2000..6000))),
        }
    }
}

/// What one router showed in one sample (`/narwhal/state`).
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    /// `lifecycle.router.controls_fleet`.
    pub controls: String,
    /// `served`.
    pub served: u64,
    /// Some `ready_to_stop` (an engine's or the wave's) was true.
    pub ready_to_stop: bool,
}

/// The two routers (primary, standby) in one sample; `None` when one did not answer.
pub type Pair = [Option<Seen>; 2];

/// An action answered 200 and what it promised.
#[derive(Debug, Clone, PartialEq)]
pub enum Acked {
    /// These engines are held out of placement.
    Held(Vec<String>),
    /// These engines are back in placement.
    Active(Vec<String>),
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The scenario.
    pub scenario: Scenario,
    /// Everything that broke a rule (empty: the run passed).
    pub violations: Vec<String>,
    /// Seconds from the fault's end to the first sample with a controller.
    pub controller_after_s: Option<f64>,
    /// Samples taken.
    pub samples: usize,
    /// Actions acknowledged, the last one first.
    pub acked: Vec<Acked>,
    /// The readmission running at the fault: its HTTP status (`None`: no answer).
    pub interrupted: Option<Option<u16>>,
    /// What the fault did, for the log (the disk faults' acknowledgement and journal).
    pub notes: Vec<String>,
}

/// Reads `/narwhal/state` of one router for a sample.
async fn seen(probe: &RouterProbe) -> Option<Seen> {
    let v = probe.state().await?;
    let lc = &v.lifecycle;
    let stop = lc.wave.ready_to_stop || lc.engines.values().any(|e| e.ready_to_stop);
    Some(Seen {
        controls: Some(lc.router.controls_fleet.clone()).filter(|c| !c.is_empty())?,
        served: v.served,
        ready_to_stop: stop,
    })
}

fn active(s: &Option<Seen>) -> bool {
    s.as_ref().is_some_and(|s| s.controls == "active")
}

/// The sample rules: never two active; served never backwards on the active router; no
/// `ready_to_stop` from one that is not active. `fault_end` (time since the sampler started)
/// gives the controller delay.
pub fn judge_samples(samples: &[Sample<Pair>], fault_end: Duration) -> (Vec<String>, Option<f64>) {
    let mut v = Vec::new();
    let mut high: Option<(u64, Duration)> = None;
    for s in samples {
        if s.value.iter().all(active) {
            v.push(format!("both routers active at {:?}", s.at));
        }
        for (k, r) in s.value.iter().enumerate() {
            let Some(r) = r else { continue };
            if r.controls != "active" && r.ready_to_stop {
                v.push(format!(
                    "router {k} ({}) reported ready_to_stop at {:?}",
                    r.controls, s.at
                ));
            }
            if r.controls == "active" {
                if let Some((h, at)) = high
                    && r.served < h
                {
                    v.push(format!(
                        "served went back from {h} (at {at:?}) to {} (router {k} at {:?})",
                        r.served, s.at
                    ));
                }
                if high.is_none_or(|(h, _)| r.served > h) {
                    high = Some((r.served, s.at));
                }
            }
        }
    }
    let after = samples
        .iter()
        .find(|s| s.at >= fault_end && s.value.iter().any(active))
        .map(|s| (s.at - fault_end).as_secs_f64());
    (v, after)
}

/// Sends completions to both routers in turn until stopped (failures are expected while the
/// routers change places).
fn traffic(
    p: &RouterHandle,
    s: &RouterHandle,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let urls = [p.data.clone(), s.data.clone()];
    let http = Http::new(Duration::from_secs(3));
    tokio::spawn(async move {
        let body = json!({"model": "tiny-sim", "prompt": "fault campaign", "max_tokens": 2});
        let mut k = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let url = format!("{}/v1/completions", urls[k % 2]);
            k += 1;
            let r = http.client().post(url).json(&body).send().await;
            if r.is_err() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    })
}

/// `POST <control>/narwhal/lifecycle/<action>` from a background task: its status and the
/// document's `error` (empty when none), or `None` when the router never answered.
fn post_in_background(
    r: &RouterHandle,
    action: &str,
    body: Value,
) -> tokio::task::JoinHandle<Option<(u16, String)>> {
    let url = format!("{}/narwhal/lifecycle/{action}", r.control);
    let http = r.http.clone();
    tokio::spawn(async move {
        let resp = http.client().post(url).json(&body).send().await.ok()?;
        let status = resp.status().as_u16();
        let doc: Lifecycle = resp.json().await.unwrap_or_default();
        Some((status, doc.error))
    })
}

/// Bytes of the primary's disk for the disk faults: room for its state file and a run's
/// journal.
const DISK_BYTES: u64 = 16 << 20;

/// A fresh fleet for `scenario`: 2 prefill, 2 decode, one agent each, the scenario's lease,
/// a standby; engines answer after 100 ms, 300 ms when a validation is to be hit (it then
/// lasts over a second, as on a real fleet, so it outlives a router coming back), and wave
/// scenarios run under `whole_wave`. A partition puts a proxy between the primary and etcd, a
/// clock step runs the router it hits on `clock`, a disk fault gives the primary its disk.
async fn fleet(scenario: &Scenario, clock: Option<&MovableClock>) -> Fleet {
    let when = scenario.when;
    let ttft = if when.during() { "300" } else { "100" };
    let mut b = Fleet::builder()
        .prefill(2)
        .decode(2)
        .agents()
        .sim_args(&["--ttft-ms", ttft])
        .lease(scenario.lease)
        .standby();
    if when.wave() {
        b = b.restart_policy("whole_wave");
    }
    match scenario.fault {
        Fault::Partition(..) => b = b.primary_etcd_through_a_proxy(),
        Fault::ClockJump(side, _) => {
            let label = match side {
                Side::Primary => "primary",
                Side::Standby => "standby",
            };
            b = b.router_env(label, clock.expect("a clock").env());
        }
        Fault::DiskFull(_) | Fault::DiskReadOnly(_) => b = b.primary_disk(DISK_BYTES),
        Fault::FsyncError(_) => b = b.primary_fsync_fault(),
        _ => {}
    }
    b.start().await
}

/// The state file at `path` parses as JSON, or is absent (nothing torn).
fn state_file_whole(path: &std::path::Path, when: &str, v: &mut Vec<String>) {
    match std::fs::read(path) {
        Ok(bytes) => {
            if let Err(e) = serde_json::from_slice::<Value>(&bytes) {
                v.push(format!(
                    "state file {} torn {when}: {e} ({} bytes)",
                    path.display(),
                    bytes.len()
                ));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => v.push(format!(
            "state file {} unreadable {when}: {e}",
            path.display()
        )),
    }
}

/// Every line of the journal at `path` is a whole JSON row; returns how many there are.
fn journal_whole(path: &std::path::Path, v: &mut Vec<String>) -> usize {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut rows = 0;
    for (k, line) in text.lines().enumerate() {
        match serde_json::from_str::<Value>(line) {
            Ok(_) => rows += 1,
            Err(e) => v.push(format!(
                "journal {} line {} is not a whole row: {e}: {:?}",
                path.display(),
                k + 1,
                line.chars().take(120).collect::<String>()
            )),
        }
    }
    if !text.is_empty() && !text.ends_with('\n') {
        v.push(format!(
            "journal {} ends in the middle of a row",
            path.display()
        ));
    }
    rows
}

/// What a run recorded: the actions acknowledged, the rules broken (none: it passed), and
/// notes for the log.
#[derive(Debug, Default)]
struct Record {
    /// Actions acknowledged, the last one first.
    acked: Vec<Acked>,
    /// Everything that broke a rule.
    violations: Vec<String>,
    /// What the fault did.
    notes: Vec<String>,
}

/// The readmission a fault interrupts, running in the background (see [`post_in_background`]).
type Pending = tokio::task::JoinHandle<Option<(u16, String)>>;

/// Runs one scenario on a fresh fleet and judges it.
///
/// # Panics
/// When the fleet cannot be set up or an action before the fault is not answered 200 (the
/// scenario could not be staged: that is a broken test, not a finding).
pub async fn run(scenario: Scenario) -> Outcome {
    let when = scenario.when;
    let clock_dir = tempfile::tempdir().expect("tempdir");
    let clock = matches!(scenario.fault, Fault::ClockJump(..))
        .then(|| MovableClock::new(clock_dir.path().join("wall-clock")));
    let mut f = fleet(&scenario, clock.as_ref()).await;
    let mut p = f.router.take().expect("primary");
    let s = f.standby.take().expect("standby");
    let ha = p.ha().await;
    let (epoch, holder) = (ha.epoch, ha.holder);
    f.wait_retained("standby", epoch, &holder, |_| true).await;
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(&p, &s, stop.clone());
    let (pp, sp) = (p.probe(), s.probe());
    let sampler = Sampler::start(Duration::from_millis(50), move || {
        let (pp, sp) = (pp.clone(), sp.clone());
        async move {
            let (a, b) = tokio::join!(seen(&pp), seen(&sp));
            [a, b]
        }
    });
    let t0 = Instant::now();
    let mut rec = Record::default();
    let all: Vec<String> = f.sims.iter().map(|x| x.iid.clone()).collect();
    let p1 = vec!["p1".to_string()];
    let pending = stage(&scenario, &mut f, &p, &all, &mut rec.acked).await;
    tokio::time::sleep(scenario.delay).await;
    // The fault.
    let (fault_end, primary_must_not_act) =
        inject(&scenario, &mut f, &mut p, &s, clock.as_ref(), t0, &mut rec).await;
    // A 503 whose write reached the lease store unconfirmed (docs/ha.md): its outcome is
    // unknown, and the store, so a successor, may hold it.
    let (interrupted, outcome_unknown, made_in_memory) =
        interrupted_answer(pending, &mut rec.notes).await;
    if interrupted == Some(Some(200)) {
        let engines = if when.wave() { all.clone() } else { p1.clone() };
        rec.acked.insert(0, Acked::Active(engines));
    }
    // Settle: one router controls the fleet (bounded well past the rule's TTL + 1 s, which
    // the samples judge).
    let routers = [&p, &s];
    let controller = settle(routers).await;
    // A second of samples after the settle.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let _ = load.await;
    let samples = sampler.stop().await;
    let (mut sample_violations, controller_after_s) = judge_samples(&samples, fault_end);
    rec.violations.append(&mut sample_violations);
    if let Some(window) = primary_must_not_act {
        judge_partition(&samples, window, &mut rec.violations);
    }
    if let Fault::ClockJump(..) = scenario.fault {
        judge_clock_step(&samples, fault_end, &mut rec.violations);
        judge_clock_lease(&p, controller, (epoch, &holder), &mut rec.violations).await;
    }
    let limit = LEASE_TTL_S + 1.0;
    match controller_after_s {
        Some(d) if d <= limit => {}
        Some(d) => rec.violations.push(format!(
            "a controller only {d:.3} s after the fault ended (limit {limit} s)"
        )),
        None => rec
            .violations
            .push("no controller sampled after the fault".into()),
    }
    let mut end_epoch = None;
    if let Some(k) = controller {
        let ha = routers[k].ha().await;
        rec.notes.push(format!(
            "controller at the end: {} (epoch {} before the fault, {} at the end)",
            ["primary", "standby"][k],
            epoch,
            ha.epoch
        ));
        end_epoch = Some(ha.epoch);
    }
    // A readmission answered 503 (not acknowledged) or not at all may have taken effect: it
    // stays in the memory of the router that made it (docs/ha.md, "Failover without loss"),
    // which publishes it when it controls the fleet again under the same epoch, or under the
    // next one when the 503 came after the change was made (its publish failed: "could not
    // be made durable") and nobody held the lease after it: that router then claims the next
    // epoch with its own memory (docs/ha.md, "Fencing and coming back"). Only then is the
    // engine's state undetermined; on a successor, or under a later epoch otherwise (a
    // validation fenced before it changed anything must not act later), the earlier
    // acknowledged action must hold, unless the 503 said its outcome is unknown (the lease
    // store got the write and did not confirm it: a successor may read it).
    let reclaimed = made_in_memory && end_epoch == Some(epoch + 1);
    let same_control = controller == Some(0) && (end_epoch == Some(epoch) || reclaimed);
    let undetermined: Vec<String> = match interrupted {
        Some(None | Some(503)) if same_control || outcome_unknown => {
            let engines = if when.wave() { all.clone() } else { p1.clone() };
            rec.notes.push(if same_control && reclaimed {
                format!(
                    "{engines:?} undetermined: the unacknowledged readmission's router claimed \
                     epoch {} with its own memory",
                    epoch + 1
                )
            } else if same_control {
                format!(
                    "{engines:?} undetermined: the unacknowledged readmission's router kept \
                     epoch {epoch}"
                )
            } else {
                format!("{engines:?} undetermined: the readmission's outcome is unknown")
            });
            engines
        }
        _ => Vec::new(),
    };
    match controller {
        None => rec
            .violations
            .push("no router controls the fleet at the end".into()),
        Some(k) => {
            check_acked(
                routers[k],
                &f,
                &rec.acked,
                &undetermined,
                &mut rec.violations,
            )
            .await;
        }
    }
    Outcome {
        scenario,
        violations: rec.violations,
        controller_after_s,
        samples: samples.len(),
        acked: rec.acked,
        interrupted,
        notes: rec.notes,
    }
}

/// Stages the scenario's action on primary `p` before the fault (`all`: every engine),
/// recording what was acknowledged in `acked`, the last one first; the readmission the fault
/// is to interrupt, if any, still running.
async fn stage(
    scenario: &Scenario,
    f: &mut Fleet,
    p: &RouterHandle,
    all: &[String],
    acked: &mut Vec<Acked>,
) -> Option<Pending> {
    let when = scenario.when;
    let p1 = vec!["p1".to_string()];
    // Stage the action; `pending` is a readmission the fault will interrupt.
    let ack = |what: &str, status: u16, doc: &LifecycleReply| {
        assert_eq!(status, 200, "{scenario}: {what} before the fault: {doc:#?}");
    };
    let mut pending = None;
    if when.wave() {
        let (st, doc) = p.drain(&DrainBody::wave(60.0)).await;
        ack("wave drain", st, &doc);
        acked.push(Acked::Held(all.to_vec()));
        if when == Timing::DuringWaveReadmit {
            p.lifecycle_until("the wave ready to stop", |d| d.wave.ready_to_stop)
                .await;
            for sim in &mut f.sims {
                sim.restart(&[]).expect("restart simulator");
            }
            pending = Some(post_in_background(p, "readmit", json!({"wave": true})));
        }
    } else {
        let (st, doc) = p.drain(&DrainBody::engine("p1", 60.0)).await;
        ack("drain p1", st, &doc);
        acked.push(Acked::Held(p1.clone()));
        if when != Timing::AfterDrainAck {
            p.lifecycle_until("p1 drained", |d| {
                d.engine("p1")
                    .is_some_and(|e| e.state == DrainState::Drained)
            })
            .await;
            f.sim_mut("p1").restart(&[]).expect("restart p1");
            if when == Timing::AfterReadmitAck {
                let (st, doc) = p.readmit(&ReadmitBody::engine("p1")).await;
                ack("readmit p1", st, &doc);
                acked.push(Acked::Active(p1.clone()));
            } else {
                pending = Some(post_in_background(p, "readmit", json!({"engines": p1})));
            }
        }
    }
    acked.reverse();
    pending
}

/// Hits the fleet with the scenario's fault (primary `p`, standby `s`, `clock` for a clock
/// step; `t0`: when the samples began): when the fault ended, and for a partition the samples
/// `(from, to]` in which the primary must not report `active`.
async fn inject(
    scenario: &Scenario,
    f: &mut Fleet,
    p: &mut RouterHandle,
    s: &RouterHandle,
    clock: Option<&MovableClock>,
    t0: Instant,
    rec: &mut Record,
) -> (Duration, Option<(Duration, Duration)>) {
    // Samples in (from, to] in which the primary must not report `active` (a partition).
    let mut primary_must_not_act: Option<(Duration, Duration)> = None;
    let fault_end = match scenario.fault {
        Fault::Kill => {
            p.proc.kill();
            t0.elapsed()
        }
        Fault::Pause(d) => {
            p.proc.signal(Signal::SIGSTOP);
            tokio::time::sleep(d).await; // the fault itself, not a synchronisation
            p.proc.signal(Signal::SIGCONT);
            t0.elapsed()
        }
        Fault::PauseBoth(dp, ds) => {
            p.proc.signal(Signal::SIGSTOP);
            s.proc.signal(Signal::SIGSTOP);
            tokio::time::sleep(dp.min(ds)).await; // the fault itself
            let (first, second) = if dp <= ds { (&*p, s) } else { (s, &*p) };
            first.proc.signal(Signal::SIGCONT);
            tokio::time::sleep(dp.max(ds) - dp.min(ds)).await;
            second.proc.signal(Signal::SIGCONT);
            t0.elapsed()
        }
        Fault::EtcdKill(d) => {
            f.etcd_mut().kill();
            tokio::time::sleep(d).await; // the fault itself
            f.etcd_mut().restart().await;
            t0.elapsed()
        }
        Fault::EtcdPause(d) => {
            f.etcd().signal(Signal::SIGSTOP);
            tokio::time::sleep(d).await; // the fault itself
            f.etcd().signal(Signal::SIGCONT);
            t0.elapsed()
        }
        Fault::Partition(cut, d) => {
            match cut {
                Cut::Refuse => f.etcd_proxy().cut(),
                Cut::Blackhole => f.etcd_proxy().blackhole(),
            }
            let cut_at = t0.elapsed();
            tokio::time::sleep(d).await; // the fault itself
            f.etcd_proxy().heal();
            let healed = t0.elapsed();
            primary_must_not_act = Some((cut_at + Duration::from_secs_f64(LEASE_TTL_S), healed));
            healed
        }
        Fault::ClockJump(side, by) => {
            let r = if side == Side::Primary { &*p } else { s };
            clock_jump(side, by, clock.expect("a clock"), r, t0, rec).await
        }
        Fault::DiskFull(d) | Fault::DiskReadOnly(d) | Fault::FsyncError(d) => {
            disk_fault(scenario, d, f, p, t0, rec).await
        }
    };
    (fault_end, primary_must_not_act)
}

/// [`Fault::ClockJump`]: steps `clock` by `by` seconds, waits over a TTL of renewals, and
/// checks that the step reached router `r` (the `side` it hits). When the step was made.
async fn clock_jump(
    side: Side,
    by: i64,
    clock: &MovableClock,
    r: &RouterHandle,
    t0: Instant,
    rec: &mut Record,
) -> Duration {
    clock.set(by);
    let at = t0.elapsed();
    // Over a TTL of renewals on the stepped clock: a skew-driven takeover shows here.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The step reached the router: its handoff document's `at` (its wall clock).
    let shown = serde_json::from_value::<Handoff>(r.handoff().await)
        .ok()
        .map(|h| h.at);
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("wall clock")
        .as_secs_f64();
    match shown {
        Some(t) if (t - real - by as f64).abs() < 2.0 => {
            rec.notes
                .push(format!("{side:?} wall clock off by {:+.1} s", t - real));
        }
        _ => rec.violations.push(format!(
            "the step did not reach the {side:?}: handoff at {shown:?}, real clock \
             {real:.1}, step {by:+} s (a broken test, not a finding)"
        )),
    }
    at
}

/// The disk faults ([`Fault::DiskFull`], [`Fault::DiskReadOnly`], [`Fault::FsyncError`]) on
/// primary `p` for `d`: an action while the disk fails, the state file and journal whole
/// during and after it, and the primary killed at the end. When it was killed.
async fn disk_fault(
    scenario: &Scenario,
    d: Duration,
    f: &Fleet,
    p: &mut RouterHandle,
    t0: Instant,
    rec: &mut Record,
) -> Duration {
    let when = scenario.when;
    let state = f.state_path("primary");
    let journal = p.journal.clone();
    let started = Instant::now();
    let write_failures = || async {
        crate::http::metric(
            &p.metrics().await,
            "narwhal_state_write_failures_total",
            &[],
        )
        .unwrap_or(0.0)
    };
    let failures_before = write_failures().await;
    match scenario.fault {
        Fault::DiskFull(_) => {
            let n = f.disk().fill();
            rec.notes.push(format!("disk filled with {n} bytes"));
        }
        Fault::DiskReadOnly(_) => f.disk().read_only(true),
        _ => f.fsync_fault().fail(true),
    }
    // An action while the disk fails, acknowledged only if durable where a successor
    // reads it (docs/ha.md): p1's drain cancelled after an acknowledged drain, p1
    // drained again after an acknowledged readmission (none while a validation runs).
    let p1 = vec!["p1".to_string()];
    let action = match when {
        Timing::AfterDrainAck => Some(("cancel-drain", json!({"engines": p1}))),
        Timing::AfterReadmitAck => Some(("drain", json!({"engines": p1, "deadline_s": 60}))),
        _ => None,
    };
    let acted = action.is_some();
    if let Some((name, body)) = action {
        let st = post_in_background(p, name, body)
            .await
            .unwrap_or(None)
            .map(|(st, _)| st);
        rec.notes
            .push(format!("{name} p1 on the failing disk: {st:?}"));
        if st == Some(200) {
            rec.acked.insert(
                0,
                if name == "drain" {
                    Acked::Held(p1)
                } else {
                    Acked::Active(p1)
                },
            );
        }
    }
    state_file_whole(&state, "during the disk fault", &mut rec.violations);
    tokio::time::sleep(d.saturating_sub(started.elapsed())).await; // the fault itself
    let failed_writes = write_failures().await - failures_before;
    rec.notes
        .push(format!("{failed_writes} state-file writes failed"));
    if acted && failed_writes < 1.0 {
        rec.violations.push(format!(
            "no state-file write failed under the {} fault (a broken test, not a \
             finding)",
            scenario.fault.name()
        ));
    }
    match scenario.fault {
        Fault::DiskFull(_) => f.disk().unfill(),
        Fault::DiskReadOnly(_) => f.disk().read_only(false),
        _ => f.fsync_fault().fail(false),
    }
    if let Some(st) = p.probe().state().await {
        rec.notes.push(format!(
            "journal_dropped {}, journal_writes_failing {}",
            st.journal_dropped, st.journal_writes_failing
        ));
    }
    p.proc.kill();
    let end = t0.elapsed();
    state_file_whole(&state, "after the disk fault", &mut rec.violations);
    let rows = journal_whole(&journal, &mut rec.violations);
    rec.notes.push(format!("{rows} journal rows"));
    end
}

/// How the readmission the fault interrupted (if any) was answered: `(its status, None when
/// it got no answer; whether a 503 said its outcome is unknown; whether a 503 came after the
/// change was made in the router's memory, its publish failing)`, a refusal noted in `notes`.
async fn interrupted_answer(
    pending: Option<Pending>,
    notes: &mut Vec<String>,
) -> (Option<Option<u16>>, bool, bool) {
    let mut outcome_unknown = false;
    let mut made_in_memory = false;
    let interrupted = match pending {
        Some(h) => {
            let answer = h.await.unwrap_or(None);
            if let Some((st, error)) = answer.as_ref().filter(|(st, _)| *st != 200) {
                notes.push(format!("readmission answered {st}: {error}"));
                outcome_unknown = *st == 503 && error.contains("outcome unknown");
                made_in_memory = *st == 503 && error.contains("could not be made durable");
            }
            Some(answer.map(|(st, _)| st))
        }
        None => None,
    };
    (interrupted, outcome_unknown, made_in_memory)
}

/// Waits (up to 200 polls 50 ms apart) until one of `routers` reports it controls the fleet:
/// its index (the last such when both do).
async fn settle(routers: [&RouterHandle; 2]) -> Option<usize> {
    let mut controller = None;
    for _ in 0..200 {
        for (k, r) in routers.iter().enumerate() {
            if r.probe().controls().await.as_deref() == Some("active") {
                controller = Some(k);
            }
        }
        if controller.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    controller
}

/// A partition: the primary, cut off from etcd, must not report `active` in the samples of
/// `(from, to]` (a TTL past the cut, to the heal).
fn judge_partition(
    samples: &[Sample<Pair>],
    (from, to): (Duration, Duration),
    v: &mut Vec<String>,
) {
    for smp in samples.iter().filter(|x| x.at > from && x.at <= to) {
        if active(&smp.value[0]) {
            v.push(format!(
                "the primary, cut off from etcd, still reported active at {:?} (after \
                 {from:?}, a TTL past the cut)",
                smp.at
            ));
            break;
        }
    }
}

/// A wall-clock step must leave the lease where it was: primary `p` (router 0) controls the
/// fleet at the end under the `(epoch, holder)` of `before`.
async fn judge_clock_lease(
    p: &RouterHandle,
    controller: Option<usize>,
    (epoch, holder): (u64, &str),
    v: &mut Vec<String>,
) {
    if controller != Some(0) {
        v.push(format!(
            "the fleet left its live, renewing holder after a wall-clock step (controller \
             at the end: {controller:?})"
        ));
    } else {
        let now = p.ha().await;
        if (now.epoch, now.holder.as_str()) != (epoch, holder) {
            v.push(format!(
                "the lease moved after a wall-clock step: epoch {epoch} holder {holder} \
                 before, epoch {} holder {} after",
                now.epoch, now.holder
            ));
        }
    }
}

/// A wall-clock step must not move the fleet: from the step on, the primary reports
/// `active` whenever it answers, and the standby never does.
fn judge_clock_step(samples: &[Sample<Pair>], step: Duration, v: &mut Vec<String>) {
    for smp in samples.iter().filter(|x| x.at >= step) {
        let [p, s] = &smp.value;
        if let Some(p) = p.as_ref().filter(|p| p.controls != "active") {
            v.push(format!(
                "the primary reported {} at {:?} after a wall-clock step",
                p.controls, smp.at
            ));
            return;
        }
        if active(s) {
            v.push(format!(
                "the standby reported active at {:?} after a wall-clock step",
                smp.at
            ));
            return;
        }
    }
}

/// The newest acknowledged promise per engine holds on the controller `c` (except on the
/// `undetermined` engines, whose newest request was not acknowledged and may have taken
/// effect); engines held out get no traffic from it.
async fn check_acked(
    c: &RouterHandle,
    f: &Fleet,
    acked: &[Acked],
    undetermined: &[String],
    v: &mut Vec<String>,
) {
    let lc = c.lifecycle().await;
    let mut seen_iids: std::collections::BTreeSet<String> = undetermined.iter().cloned().collect();
    let mut held = Vec::new();
    for a in acked {
        let (iids, want_held) = match a {
            Acked::Held(i) => (i, true),
            Acked::Active(i) => (i, false),
        };
        for iid in iids {
            if !seen_iids.insert(iid.clone()) {
                continue; // a newer acknowledged action decided this engine
            }
            let e = lc.engine(iid).cloned().unwrap_or_default();
            let state = e.state.as_str();
            if want_held {
                // Held out of placement (draining, drained, validating, blocked, ...) with its
                // pre-restart process start recorded, until a validated readmission.
                held.push(iid.clone());
                if e.state == DrainState::Active || e.accepts_new || e.old_process_start.is_none() {
                    v.push(format!(
                        "acknowledged drain of {iid} lost: {state}, accepts_new {}, \
                         old_process_start {:?}",
                        e.accepts_new, e.old_process_start
                    ));
                }
            } else if e.state != DrainState::Active {
                v.push(format!("acknowledged readmission of {iid} lost: {state}"));
            }
        }
    }
    let requests =
        |st: &SimStats| st.requests.prefill + st.requests.decode + st.requests.aggregated;
    let mut before = Vec::new();
    for iid in &held {
        before.push(requests(&f.sim(iid).counters().await));
    }
    for k in 0..6 {
        let _ = c.completion(&format!("after the fault {k}"), 2).await;
    }
    for (iid, b) in held.iter().zip(before) {
        let after = requests(&f.sim(iid).counters().await);
        if after != b {
            v.push(format!(
                "{iid} was drained (acknowledged) but got {} requests",
                after - b
            ));
        }
    }
}

/// Runs `runs` random scenarios of `mix` (timings and lease backends in turn, from `seed`),
/// `parallel` fleets at a time; outcomes in run order.
pub async fn campaign(runs: usize, seed: u64, parallel: usize, mix: Mix) -> Vec<Outcome> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let scenarios: Vec<Scenario> = (0..runs)
        .map(|k| {
            let when = Timing::ALL[k % Timing::ALL.len()];
            let lease = mix.leases[(k / Timing::ALL.len()) % mix.leases.len().max(1)];
            Scenario::random(when, lease, mix.kinds, &mut rng)
        })
        .collect();
    let mut out = Vec::new();
    for chunk in scenarios.chunks(parallel.max(1)) {
        let handles: Vec<_> = chunk.iter().map(|s| tokio::spawn(run(*s))).collect();
        for (h, s) in handles.into_iter().zip(chunk) {
            match h.await {
                Ok(o) => {
                    eprintln!(
                        "[faults] {} -> {} (controller after {:?} s, {} samples, readmit {:?}{})",
                        o.scenario,
                        if o.violations.is_empty() {
                            "ok".to_string()
                        } else {
                            format!("{:?}", o.violations)
                        },
                        o.controller_after_s.map(|d| (d * 1000.0).round() / 1000.0),
                        o.samples,
                        o.interrupted,
                        if o.notes.is_empty() {
                            String::new()
                        } else {
                            format!("; {}", o.notes.join("; "))
                        }
                    );
                    out.push(o);
                }
                Err(e) => out.push(Outcome {
                    scenario: *s,
                    violations: vec![format!("the run panicked: {e}")],
                    controller_after_s: None,
                    samples: 0,
                    acked: Vec::new(),
                    interrupted: None,
                    notes: Vec::new(),
                }),
            }
        }
    }
    out
}

/// A summary of a campaign: runs and passes per timing and fault kind, the violations, and
/// the controller delays.
pub fn summary(outcomes: &[Outcome]) -> String {
    use std::collections::BTreeMap;
    let mut by: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for o in outcomes {
        let lease = match o.scenario.lease {
            LeaseBackend::File => "file",
            LeaseBackend::Etcd => "etcd",
            LeaseBackend::Kubernetes => "kubernetes",
        };
        let e = by
            .entry(format!(
                "[{lease}] {} {:?}",
                o.scenario.fault.name(),
                o.scenario.when
            ))
            .or_default();
        e.0 += 1;
        e.1 += usize::from(o.violations.is_empty());
    }
    let mut delays: Vec<f64> = outcomes
        .iter()
        .filter_map(|o| o.controller_after_s)
        .collect();
    delays.sort_by(f64::total_cmp);
    let passed = outcomes.iter().filter(|o| o.violations.is_empty()).count();
    let mut text = format!("{passed} of {} runs passed\n", outcomes.len());
    for (k, (n, ok)) in by {
        text.push_str(&format!("  {k}: {ok}/{n}\n"));
    }
    if let (Some(med), Some(max)) = (delays.get(delays.len() / 2), delays.last()) {
        text.push_str(&format!(
            "  controller after the fault ended: median {med:.3} s, max {max:.3} s\n"
        ));
    }
    for o in outcomes.iter().filter(|o| !o.violations.is_empty()) {
        text.push_str(&format!("  FAILED {}: {:?}\n", o.scenario, o.violations));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(controls: &str) -> Option<Seen> {
        Some(Seen {
            controls: controls.into(),
            served: 0,
            ready_to_stop: false,
        })
    }

    fn at(ms: u64, pair: Pair) -> Sample<Pair> {
        Sample {
            at: Duration::from_millis(ms),
            value: pair,
        }
    }

    #[test]
    fn a_torn_state_file_is_a_violation_an_absent_or_whole_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("primary.state.json");
        let mut v = Vec::new();
        state_file_whole(&path, "now", &mut v);
        std::fs::write(&path, br#"{"epoch": 1}"#).unwrap();
        state_file_whole(&path, "now", &mut v);
        assert!(v.is_empty(), "{v:?}");
        std::fs::write(&path, br#"{"epoch": 1, "eng"#).unwrap();
        state_file_whole(&path, "now", &mut v);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].contains("torn now"), "{v:?}");
    }

    #[test]
    fn a_journal_cut_mid_row_is_a_violation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.jsonl");
        std::fs::write(&path, "{\"a\":1}\n{\"b\":2}\n").unwrap();
        let mut v = Vec::new();
        assert_eq!(journal_whole(&path, &mut v), 2);
        assert!(v.is_empty(), "{v:?}");
        std::fs::write(&path, "{\"a\":1}\n{\"b\":").unwrap();
        journal_whole(&path, &mut v);
        assert_eq!(v.len(), 2, "a broken line and no final newline: {v:?}");
    }

    #[test]
    fn a_clock_step_that_moves_the_fleet_is_a_violation() {
        let ok = [
            at(100, [seen("active"), seen("standby")]),
            at(200, [None, seen("standby")]),
            at(300, [seen("active"), seen("standby")]),
        ];
        let mut v = Vec::new();
        judge_clock_step(&ok, Duration::from_millis(50), &mut v);
        assert!(v.is_empty(), "{v:?}");
        let moved = [
            at(100, [seen("active"), seen("standby")]),
            at(200, [seen("fenced"), seen("active")]),
        ];
        judge_clock_step(&moved, Duration::from_millis(50), &mut v);
        assert_eq!(v.len(), 1, "{v:?}");
        // Before the step, the rule does not apply.
        let mut v = Vec::new();
        judge_clock_step(&moved, Duration::from_millis(250), &mut v);
        assert!(v.is_empty(), "{v:?}");
    }
}
