//! The end-to-end world: simulated engines, one agent per simulated host, routers (a single
//! one, or a primary and a warm standby sharing a lease), dev certificates, all in one
//! temporary directory, built by one builder:
//!
//! ```text
//!   Fleet::builder()                       vLLM, no engines yet
//!       .prefill(1).decode(2)              p0, d0, d1 (fleet-file order)
//!       .agents()                          agent h0 for p0, h1 for d0, h2 for d1 (mutual TLS)
//!       .fleet(json!({...}))               fleet-file sections merged over the defaults
//!       .lease(LeaseBackend::Etcd)         a shared lease (etcd started on loopback)
//!       .standby()                         routers "primary" and "standby" instead of "router"
//!       .start().await                     everything running; routers ready to be read
//! ```
//!
//! What a test does to the world afterwards (restart an engine, kill a router, start another
//! one with `--resume`) goes through the [`Fleet`]'s handles.

use std::path::{Path, PathBuf};
use std::time::Duration;

use narwhal_shared::handoff::Handoff;
use serde::Deserialize;
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::agent::{AgentHandle, start_agent_keyed};
use crate::certs::{DevCerts, make_dev_certs};
use crate::disk::Disk;
use crate::etcd::Etcd;
use crate::fsync::FsyncFault;
use crate::http::Http;
use crate::ports::engine_ports;
use crate::proc::read_json_file;
use crate::proxy::Proxy;
use crate::router::{
    Clients, FleetSpec, RouterHandle, handoff_file_where, launch_router_env, merge,
};
use crate::sim::{EngineSpec, SimHandle, start_sim};

/// What the kit reads of a fleet's `lease` section: its backend and, for `file`, its path.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct LeaseSection {
    /// `file` or `etcd`.
    backend: String,
    /// The lease file (`file` backend).
    path: Option<PathBuf>,
}

/// The environment variable that holds the engines' API key for the routers of a fleet
/// built with [`FleetBuilder::engine_api_key`] (their `engine.engine_api_key_env`).
pub const ENGINE_KEY_VAR: &str = "NARWHAL_TEST_ENGINE_API_KEY";

/// Lease TTL of every HA fleet (seconds); renewal every 0.5 s, safety margin 0.5 s.
pub const LEASE_TTL_S: f64 = 2.0;
/// A standby's poll interval (`--standby-probe-interval`, seconds).
pub const STANDBY_PROBE_S: f64 = 0.25;
/// Missed polls before a standby tries to take over (`--standby-takeover-after`).
pub const STANDBY_TAKEOVER_AFTER: u32 = 4;

/// Where the routers of an HA fleet keep their shared lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseBackend {
    /// A lease file in the fleet's directory (`router.lease`).
    File,
    /// A real etcd started on loopback for the fleet (key `/narwhal/test/lease`).
    Etcd,
    /// A real kube-apiserver started on loopback for the fleet ([`crate::k8s`]): Lease
    /// `narwhal/router-lease`, the routers authenticating as service account
    /// `narwhal/narwhal-router` with the chart's Role (a token file in the fleet's directory).
    Kubernetes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Routers {
    None,
    One,
    PrimaryAndStandby,
}

/// Builds a [`Fleet`]; see the module documentation.
#[derive(Debug, Clone)]
pub struct FleetBuilder {
    dialect: String,
    engines: Vec<EngineSpec>,
    sim_args: Vec<String>,
    kv_events: bool,
    /// Data-parallel ranks per engine (with `kv_events`).
    data_parallel: u16,
    agents_per_engine: bool,
    hosts: Vec<(String, Vec<String>)>,
    contract: Option<Value>,
    certs: Vec<String>,
    overrides: Value,
    pins: Vec<String>,
    engine_keys: Vec<(String, Value)>,
    router_args: Vec<String>,
    control_tls: bool,
    lease: Option<LeaseBackend>,
    routers: Routers,
    engine_key: Option<String>,
    etcd_proxy: bool,
    label_env: Vec<(String, Vec<(String, String)>)>,
    primary_disk: Option<u64>,
    primary_fsync_fault: bool,
}

/// A running end-to-end world; every process is killed when it drops.
#[derive(Debug)]
pub struct Fleet {
    /// The single router (`router`), or the primary (`primary`) of an HA fleet, when the
    /// builder started one.
    pub router: Option<RouterHandle>,
    /// The warm standby (`standby`), with [`FleetBuilder::standby`].
    pub standby: Option<RouterHandle>,
    /// The simulated engines, in fleet-file order.
    pub sims: Vec<SimHandle>,
    /// The agents, in host order.
    pub agents: Vec<AgentHandle>,
    /// The client tests use (presents the `operator` certificate when the fleet has
    /// certificates).
    pub http: Http,
    /// `vllm` or `sglang`.
    pub dialect: String,
    clients: Clients,
    certs: Option<DevCerts>,
    base: FleetSpec,
    lease: Option<Value>,
    control_tls: bool,
    etcd: Option<Etcd>,
    /// The primary's way to etcd, with [`FleetBuilder::primary_etcd_through_a_proxy`].
    etcd_proxy: Option<Proxy>,
    /// The API server of a [`LeaseBackend::Kubernetes`] lease.
    kube: Option<crate::k8s::KubeApiServer>,
    /// Added to the environment of the router of that label ([`FleetBuilder::router_env`]).
    label_env: Vec<(String, Vec<(String, String)>)>,
    /// The primary's state file and journal disk ([`FleetBuilder::primary_disk`]); before
    /// `dir`, so it is unmounted before the directory is removed.
    disk: Option<Disk>,
    /// The primary's fsync fault ([`FleetBuilder::primary_fsync_fault`]).
    fsync: Option<FsyncFault>,
    /// Added to every router's environment (the engine key of [`FleetBuilder::engine_api_key`]).
    router_env: Vec<(String, String)>,
    dir: TempDir,
}

impl Fleet {
    /// One prefill and one decode simulator of `dialect` behind a router whose fleet file
    /// takes `overrides` (merged over the kit's defaults).
    pub async fn pd_pair(dialect: &str, overrides: Value) -> Fleet {
        Fleet::builder()
            .dialect(dialect)
            .prefill(1)
            .decode(1)
            .fleet(overrides)
            .start()
            .await
    }

    /// A builder: vLLM, no engines, no agents, one router.
    pub fn builder() -> FleetBuilder {
        FleetBuilder {
            dialect: "vllm".into(),
            engines: Vec::new(),
            sim_args: Vec::new(),
            kv_events: false,
            data_parallel: 1,
            agents_per_engine: false,
            hosts: Vec::new(),
            contract: None,
            certs: Vec::new(),
            overrides: json!({}),
            pins: Vec::new(),
            engine_keys: Vec::new(),
            router_args: Vec::new(),
            engine_key: None,
            control_tls: false,
            lease: None,
            routers: Routers::One,
            etcd_proxy: false,
            label_env: Vec::new(),
            primary_disk: None,
            primary_fsync_fault: false,
        }
    }

    /// `prefill` + `decode` simulators of `dialect` (`p0..`, `d0..`) and nothing else: no
    /// agents, no router (a test of the engines' own surface, or one that starts its router).
    ///
    /// # Panics
    /// When a simulator does not start.
    pub async fn sims_only(dialect: &str, prefill: usize, decode: usize) -> Fleet {
        Fleet::builder()
            .dialect(dialect)
            .prefill(prefill)
            .decode(decode)
            .no_router()
            .start()
            .await
    }
}

impl FleetBuilder {
    /// Engines speak `dialect` (`vllm`, the default, or `sglang`).
    pub fn dialect(mut self, dialect: &str) -> Self {
        self.dialect = dialect.to_string();
        self
    }

    fn add(mut self, prefix: &str, role: &str, n: usize) -> Self {
        let have = self.engines.iter().filter(|e| e.role == role).count();
        for k in have..have + n {
            self.engines
                .push(EngineSpec::new(&format!("{prefix}{k}"), role));
        }
        self
    }

    /// `n` more prefill engines, `p0`, `p1`, ...
    pub fn prefill(self, n: usize) -> Self {
        self.add("p", "prefill", n)
    }

    /// `n` more decode engines, `d0`, `d1`, ...
    pub fn decode(self, n: usize) -> Self {
        self.add("d", "decode", n)
    }

    /// One engine with id `iid` and role `role` (`prefill` or `decode`).
    pub fn engine(mut self, iid: &str, role: &str) -> Self {
        self.engines.push(EngineSpec::new(iid, role));
        self
    }

    /// One engine with id `iid` and role `role` listening on loopback address `host`
    /// (`127.0.0.11`): an engine of an address of its own, as a pod has.
    pub fn engine_on(mut self, iid: &str, role: &str, host: &str) -> Self {
        self.engines.push(EngineSpec::new(iid, role).on(host));
        self
    }

    /// One engine with id `iid`, role `role` and simulator flags of its own (besides those of
    /// [`FleetBuilder::sim_args`]), e.g. `--api-key k` on one engine only.
    pub fn engine_with_args(mut self, iid: &str, role: &str, args: &[&str]) -> Self {
        self.engines.push(EngineSpec::new(iid, role).args(args));
        self
    }

    /// Every engine requires API key `key` (vLLM `--api-key`); the router sends it
    /// (`engine.engine_api_key_env` = [`ENGINE_KEY_VAR`], set in its environment) and so does
    /// every agent (`engines[].api_key_file`, a file in the fleet's directory).
    pub fn engine_api_key(mut self, key: &str) -> Self {
        self.sim_args
            .extend(["--api-key".to_string(), key.to_string()]);
        crate::router::merge(
            &mut self.overrides,
            json!({"engine": {"engine_api_key_env": ENGINE_KEY_VAR}}),
        );
        self.engine_key = Some(key.to_string());
        self
    }

    /// Simulator flags for every engine (`--tpot-ms 40`, ...).
    pub fn sim_args(mut self, args: &[&str]) -> Self {
        self.sim_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Every simulator publishes vLLM's KV events (`--kv-events-config`, topic `kv`) on two
    /// ports of its own, kept across `SimHandle::restart`, and the fleet file names them as
    /// each engine's `kv_events` (docs/engine-simulator.md "KV events";
    /// docs/design/kv-aware-placement.md).
    pub fn kv_events(mut self) -> Self {
        self.kv_events = true;
        self
    }

    /// Every engine runs `n` data-parallel ranks (`--data-parallel-size n`), each with its
    /// own prefix cache and KV events on the ports plus its rank; the fleet file names
    /// `kv_events.data_parallel_size` (with [`FleetBuilder::kv_events`]).
    pub fn data_parallel(mut self, n: u16) -> Self {
        self.data_parallel = n.max(1);
        self
    }

    /// One agent per engine (`h0` for the first engine, `h1` for the second, ...), each engine
    /// pinned to its agent in the fleet file; routers talk to them over mutual TLS.
    pub fn agents(mut self) -> Self {
        self.agents_per_engine = true;
        self
    }

    /// An agent `id` serving `iids` (several engines on one simulated host). Hosts start in
    /// the order they are named.
    pub fn host(mut self, id: &str, iids: &[&str]) -> Self {
        self.hosts
            .push((id.to_string(), iids.iter().map(|s| s.to_string()).collect()));
        self
    }

    /// Every agent attests this host contract document (`engines[].contract_document`).
    pub fn contract_document(mut self, doc: Value) -> Self {
        self.contract = Some(doc);
        self
    }

    /// More dev certificates (from the fleet CA) for the test's own use (`ctl`, ...).
    pub fn certs(mut self, names: &[&str]) -> Self {
        self.certs.extend(names.iter().map(|s| s.to_string()));
        self
    }

    /// Fleet-file sections merged over the defaults, key by key.
    pub fn fleet(mut self, section: Value) -> Self {
        crate::router::merge(&mut self.overrides, section);
        self
    }

    /// Pins engines `iids` in the fleet file (`engines[].pin`: the role controller never
    /// moves them).
    pub fn pin(mut self, iids: &[&str]) -> Self {
        self.pins.extend(iids.iter().map(|s| s.to_string()));
        self
    }

    /// Merges `keys` into engine `iid`'s `engines[]` entry of the fleet file (e.g.
    /// `{"kv_role": "kv_consumer"}`).
    pub fn engine_keys(mut self, iid: &str, keys: Value) -> Self {
        self.engine_keys.push((iid.to_string(), keys));
        self
    }

    /// Extra `narwhal-serve` flags for the builder's single router (`--max-concurrent 1`).
    pub fn router_args(mut self, args: &[&str]) -> Self {
        self.router_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// `recovery.engine_restart_policy` (`individual` or `whole_wave`).
    pub fn restart_policy(self, policy: &str) -> Self {
        self.fleet(json!({"recovery": {"engine_restart_policy": policy}}))
    }

    /// Mutual TLS on every router's control listener (`control.tls`, the router's own
    /// certificate); the fleet's client presents `operator`.
    pub fn control_tls(mut self) -> Self {
        self.control_tls = true;
        self
    }

    /// A lease shared by every router ([`LEASE_TTL_S`]); each router keeps its own state file
    /// (`<label>.state.json`) and runs with `--router-id <label>`. The builder's router is then
    /// a primary labelled `primary`, started once it controls the fleet.
    pub fn lease(mut self, backend: LeaseBackend) -> Self {
        self.lease = Some(backend);
        self
    }

    /// With an etcd lease: the router labelled `primary` reaches etcd through a loopback TCP
    /// [`Proxy`] the test can cut, blackhole and heal ([`Fleet::etcd_proxy`]), the others
    /// directly: a partition between the primary and its lease store.
    pub fn primary_etcd_through_a_proxy(mut self) -> Self {
        self.etcd_proxy = true;
        self
    }

    /// `env` added to the environment of the router labelled `label` (`primary`, `standby`),
    /// for example a [`crate::faketime::MovableClock`]'s.
    pub fn router_env(mut self, label: &str, env: Vec<(String, String)>) -> Self {
        self.label_env.push((label.to_string(), env));
        self
    }

    /// The router labelled `primary` keeps its state file (`recovery.state_path`) and its
    /// journal on a disk of its own, a `tmpfs` of `bytes` bytes the test can fill or make
    /// read-only ([`Fleet::disk`]; root only, see [`Disk`]).
    pub fn primary_disk(mut self, bytes: u64) -> Self {
        self.primary_disk = Some(bytes);
        self
    }

    /// The router labelled `primary` runs under an fsync fault ([`Fleet::fsync_fault`],
    /// [`FsyncFault`]), off until the test turns it on, that reaches the temp files of its
    /// state-file writes (`.<state file name>...`, beside the state file), and nothing else.
    pub fn primary_fsync_fault(mut self) -> Self {
        self.primary_fsync_fault = true;
        self
    }

    /// No router: the test starts its own ([`Fleet::start_router`], [`Fleet::primary`]).
    pub fn no_router(mut self) -> Self {
        self.routers = Routers::None;
        self
    }

    /// A warm standby (`standby`) of the primary, polling every [`STANDBY_PROBE_S`].
    ///
    /// # Panics
    /// In [`FleetBuilder::start`], without a [`FleetBuilder::lease`].
    pub fn standby(mut self) -> Self {
        self.routers = Routers::PrimaryAndStandby;
        self
    }

    fn host_plan(&self) -> Vec<(String, Vec<String>)> {
        let mut hosts = self.hosts.clone();
        if self.agents_per_engine {
            hosts.extend(
                self.engines
                    .iter()
                    .enumerate()
                    .map(|(i, e)| (format!("h{i}"), vec![e.iid.clone()])),
            );
        }
        hosts
    }

    /// Starts everything: certificates, simulators, agents, etcd, then the routers.
    ///
    /// # Panics
    /// When any process does not start (the message names it and carries its log tail).
    pub async fn start(self) -> Fleet {
        assert!(
            self.routers != Routers::PrimaryAndStandby || self.lease.is_some(),
            "a standby needs a lease: FleetBuilder::lease"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let hosts = self.host_plan();
        let wants_certs =
            !hosts.is_empty() || !self.certs.is_empty() || self.control_tls || self.lease.is_some();
        let certs = wants_certs.then(|| {
            let mut names: Vec<String> = vec!["router".into(), "standby".into(), "operator".into()];
            names.extend(self.certs.iter().cloned());
            names.extend(hosts.iter().map(|(h, _)| format!("agent-{h}")));
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            make_dev_certs(&dir.path().join("certs"), &names).expect("dev certificates")
        });
        let clients = match &certs {
            Some(c) => Clients::identity(c, "operator"),
            None => Clients::plain(),
        };
        let (sims, kv_keys) = self.start_sims(dir.path());
        let router_env: Vec<(String, String)> = self
            .engine_key
            .iter()
            .map(|k| (ENGINE_KEY_VAR.to_string(), k.clone()))
            .collect();
        let mut base = FleetSpec::for_sims(&self.dialect, &sims).with(self.overrides.clone());
        for iid in &self.pins {
            base = base.pin(iid);
        }
        for (iid, keys) in kv_keys.into_iter().chain(self.engine_keys.iter().cloned()) {
            base = base.engine_with(&iid, keys);
        }
        let (base, agents) = self.start_agents(dir.path(), &hosts, &sims, certs.as_ref(), base);
        let (lease, etcd, kube) = self.start_lease(dir.path()).await;
        let etcd_proxy = match (&etcd, self.etcd_proxy) {
            (Some(e), true) => Some(Proxy::start(&e.endpoint).await),
            _ => None,
        };
        let disk = self
            .primary_disk
            .map(|bytes| Disk::mount(&dir.path().join("disk"), bytes));
        let lease = lease.map(|mut l| {
            crate::router::merge(
                &mut l,
                json!({"ttl_s": LEASE_TTL_S, "renew_interval_s": 0.5, "safety_margin_s": 0.5}),
            );
            l
        });
        let mut fleet = Fleet {
            router: None,
            standby: None,
            sims,
            agents,
            http: clients.http.clone(),
            dialect: self.dialect.clone(),
            clients,
            certs,
            base,
            lease,
            control_tls: self.control_tls,
            etcd,
            etcd_proxy,
            kube,
            label_env: self.label_env.clone(),
            disk,
            fsync: None,
            router_env,
            dir,
        };
        if self.primary_fsync_fault {
            let state = fleet.state_path("primary");
            let name = state
                .file_name()
                .expect("a state file name")
                .to_string_lossy();
            let under = narwhal_shared::atomic::parent_dir(&state).join(format!(".{name}"));
            fleet.fsync = Some(FsyncFault::new(&fleet.dir().join("fsync.flag"), &under));
        }
        self.start_routers(&mut fleet).await;
        fleet
    }

    /// Starts the simulators under `dir` (with `kv_events`, each publishing KV events on ports
    /// of its own): them, and the fleet-file keys that name each one's event endpoints.
    fn start_sims(&self, dir: &Path) -> (Vec<SimHandle>, Vec<(String, Value)>) {
        let args: Vec<&str> = self.sim_args.iter().map(String::as_str).collect();
        let mut kv_keys = Vec::new();
        let sims: Vec<SimHandle> = self
            .engines
            .iter()
            .map(|spec| {
                let mut spec = spec.clone().args(&args);
                if self.kv_events {
                    // Below the ephemeral range: a port released by `bind(:0)` may be the next
                    // outgoing connection's before the simulator binds it (crate::ports).
                    let dp = self.data_parallel;
                    let (p, r) = (engine_ports(dp), engine_ports(dp));
                    let cfg = json!({"enable_kv_cache_events": true, "publisher": "zmq",
                        "endpoint": format!("tcp://*:{p}"),
                        "replay_endpoint": format!("tcp://*:{r}"), "topic": "kv"});
                    spec = spec.args(&["--kv-events-config", &cfg.to_string()]);
                    let mut keys = json!({"endpoint": format!("tcp://127.0.0.1:{p}"),
                        "replay_endpoint": format!("tcp://127.0.0.1:{r}"), "topic": "kv"});
                    if dp > 1 {
                        spec = spec.args(&["--data-parallel-size", &dp.to_string()]);
                        merge(&mut keys, json!({"data_parallel_size": dp}));
                    }
                    kv_keys.push((spec.iid.clone(), json!({ "kv_events": keys })));
                }
                start_sim(dir, &spec, &self.dialect)
                    .unwrap_or_else(|e| panic!("simulator {}: {e}", spec.iid))
            })
            .collect();
        (sims, kv_keys)
    }

    /// Writes the contract document and the engine key file (when set) under `dir`, then
    /// starts an agent per host of `hosts` over its engines of `sims`: `base` naming each
    /// engine's agent, and the agents.
    fn start_agents(
        &self,
        dir: &Path,
        hosts: &[(String, Vec<String>)],
        sims: &[SimHandle],
        certs: Option<&DevCerts>,
        mut base: FleetSpec,
    ) -> (FleetSpec, Vec<AgentHandle>) {
        let contract = self.contract.as_ref().map(|doc| {
            let path = dir.join("engine-attestation.json");
            std::fs::write(&path, doc.to_string()).expect("contract document");
            path
        });
        let key_file = self.engine_key.as_ref().map(|key| {
            let path = dir.join("engine-api.key");
            std::fs::write(&path, format!("{key}\n")).expect("engine key file");
            path
        });
        let mut agents = Vec::new();
        for (host, iids) in hosts {
            let mine: Vec<&SimHandle> = iids
                .iter()
                .map(|iid| {
                    sims.iter()
                        .find(|s| &s.iid == iid)
                        .unwrap_or_else(|| panic!("host {host}: no engine {iid}"))
                })
                .collect();
            let certs = certs.expect("certificates");
            let a = start_agent_keyed(
                dir,
                certs,
                host,
                &mine,
                contract.as_deref(),
                key_file.as_deref(),
            )
            .unwrap_or_else(|e| panic!("agent {host}: {e}"));
            for iid in iids {
                base = base.agent(iid, &a);
            }
            agents.push(a);
        }
        (base, agents)
    }

    /// The lease document of [`FleetBuilder::lease`] (a file under `dir`, or a fresh etcd or
    /// kube-apiserver started here), and that etcd or API server.
    async fn start_lease(
        &self,
        dir: &Path,
    ) -> (
        Option<Value>,
        Option<Etcd>,
        Option<crate::k8s::KubeApiServer>,
    ) {
        match self.lease {
            None => (None, None, None),
            Some(LeaseBackend::File) => (
                Some(json!({"backend": "file", "path": dir.join("router.lease")})),
                None,
                None,
            ),
            Some(LeaseBackend::Etcd) => {
                let etcd = Etcd::start(crate::etcd::EtcdOptions::default()).await;
                let l = json!({"backend": "etcd", "endpoints": [etcd.endpoint],
                               "key": "/narwhal/test/lease"});
                (Some(l), Some(etcd), None)
            }
            Some(LeaseBackend::Kubernetes) => {
                use crate::k8s::{KUBE_LEASE, KUBE_NAMESPACE, KUBE_ROUTER_ACCOUNT, router_grant};
                let api = crate::k8s::KubeApiServer::start().await;
                let admin = api.admin();
                admin.grant(&router_grant(KUBE_LEASE)).await;
                let token = admin.token_for(KUBE_NAMESPACE, KUBE_ROUTER_ACCOUNT).await;
                let token_file = dir.join("router.token");
                std::fs::write(&token_file, token).expect("write the router's token");
                let l = json!({"backend": "kubernetes", "kubernetes": {
                    "name": KUBE_LEASE, "namespace": KUBE_NAMESPACE, "api_server": api.url,
                    "token_file": token_file, "ca_file": api.ca}});
                (Some(l), None, Some(api))
            }
        }
    }

    /// Starts the builder's routers on `fleet`: none, one (waiting for its startup identity
    /// check with agents), a primary, or a primary and its standby.
    async fn start_routers(&self, fleet: &mut Fleet) {
        match (self.routers, fleet.lease.is_some()) {
            (Routers::None, _) => {}
            (Routers::One, false) => {
                let args: Vec<&str> = self.router_args.iter().map(String::as_str).collect();
                let r = fleet.start_router("router", &args);
                if !fleet.agents.is_empty() {
                    // The startup identity check (behaviour.md 4.10) accepts every process
                    // in one step; tests start from there, so it never races what they do.
                    let iids: Vec<String> = fleet.sims.iter().map(|s| s.iid.clone()).collect();
                    r.lifecycle_until("process identities accepted at startup", |d| {
                        iids.iter().all(|i| d.process_starts.contains_key(i))
                    })
                    .await;
                }
                fleet.router = Some(r);
            }
            (Routers::One, true) => fleet.router = Some(fleet.primary("primary").await),
            (Routers::PrimaryAndStandby, _) => {
                let p = fleet.primary("primary").await;
                fleet.standby = Some(fleet.standby_of("standby", &p.control, &[]));
                fleet.router = Some(p);
            }
        }
    }
}

impl Fleet {
    /// The fleet's directory (logs, fleet files, journals, state files).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Stops router `r` with `SIGSTOP` outside the `file` lease's flock: the kit takes
    /// `<lease.path>.lock` itself (retrying for up to 5 s), signals, and lets go. A router
    /// frozen inside that lock holds off every other router's lease operation until it
    /// resumes (docs/ha.md, `file` backend); a test of a takeover after a pause must not
    /// leave that to chance (on a loaded machine a renewal's fsync keeps the lock long enough
    /// to be hit). Without a `file` lease: a plain `SIGSTOP`.
    ///
    /// # Panics
    /// When the lock file cannot be opened or stays held for 5 s.
    pub async fn pause_outside_the_lease_lock(&self, r: &RouterHandle) {
        let lock = self
            .lease
            .as_ref()
            .and_then(|l| LeaseSection::deserialize(l).ok())
            .filter(|l| l.backend == "file")
            .and_then(|l| l.path)
            .map(|p| {
                let mut lock = p.into_os_string();
                lock.push(".lock");
                PathBuf::from(lock)
            });
        let Some(lock) = lock else {
            r.proc.signal(nix::sys::signal::Signal::SIGSTOP);
            return;
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock)
            .unwrap_or_else(|e| panic!("the lease lock {}: {e}", lock.display()));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock)
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(e) => panic!("the lease lock {}: {e}", lock.display()),
            }
        }
        r.proc.signal(nix::sys::signal::Signal::SIGSTOP);
        drop(file);
    }

    /// The dev certificates.
    ///
    /// # Panics
    /// For a fleet without certificates (no agents, no TLS, no lease).
    pub fn certs(&self) -> &DevCerts {
        self.certs.as_ref().expect("this fleet has no certificates")
    }

    /// The builder's router (`router`, or the primary).
    ///
    /// # Panics
    /// When the builder started none ([`FleetBuilder::no_router`]).
    pub fn router(&self) -> &RouterHandle {
        self.router.as_ref().expect("the builder started no router")
    }

    /// [`Fleet::router`], mutable (to kill or signal it).
    ///
    /// # Panics
    /// When the builder started none.
    pub fn router_mut(&mut self) -> &mut RouterHandle {
        self.router.as_mut().expect("the builder started no router")
    }

    /// The builder's standby.
    ///
    /// # Panics
    /// Without [`FleetBuilder::standby`].
    pub fn standby(&self) -> &RouterHandle {
        self.standby
            .as_ref()
            .expect("the builder started no standby")
    }

    /// The simulator of engine `iid`.
    ///
    /// # Panics
    /// When there is none.
    pub fn sim(&self, iid: &str) -> &SimHandle {
        &self.sims[position(&self.sims, |s| s.iid == iid, "engine", iid)]
    }

    /// [`Fleet::sim`], mutable (to restart it).
    ///
    /// # Panics
    /// When there is none.
    pub fn sim_mut(&mut self, iid: &str) -> &mut SimHandle {
        let i = position(&self.sims, |s| s.iid == iid, "engine", iid);
        &mut self.sims[i]
    }

    /// The agent with id `id`.
    ///
    /// # Panics
    /// When there is none.
    pub fn agent(&self, id: &str) -> &AgentHandle {
        &self.agents[position(&self.agents, |a| a.agent_id == id, "agent", id)]
    }

    /// [`Fleet::agent`], mutable (to restart it).
    ///
    /// # Panics
    /// When there is none.
    pub fn agent_mut(&mut self, id: &str) -> &mut AgentHandle {
        let i = position(&self.agents, |a| a.agent_id == id, "agent", id);
        &mut self.agents[i]
    }

    /// The state file of router `label`: `<label>.state.json` with a lease, else the one
    /// `state.json` every router of the fleet shares (so `--resume` finds it).
    /// The primary's is on its disk with [`FleetBuilder::primary_disk`].
    pub fn state_path(&self, label: &str) -> PathBuf {
        match self.lease {
            Some(_) => match &self.disk {
                Some(d) if label == "primary" => d.path.join(format!("{label}.state.json")),
                _ => self.dir().join(format!("{label}.state.json")),
            },
            None => self.dir().join("state.json"),
        }
    }

    /// The fleet file of router `label` whose agent identity is the certificate `cert`
    /// (`router`, `standby`): the engines and their agents, the builder's sections, and with a
    /// lease its own state file and the shared lease.
    pub fn spec(&self, label: &str, cert: &str) -> FleetSpec {
        let mut spec = self.base.clone();
        if !self.agents.is_empty() {
            spec = spec.tls(self.certs(), cert);
        }
        if self.control_tls {
            spec = spec.control_tls(self.certs(), cert);
        }
        if let Some(lease) = &self.lease {
            let mut lease = lease.clone();
            if let Some(p) = self.etcd_proxy.as_ref().filter(|_| label == "primary") {
                merge(&mut lease, json!({"endpoints": [p.url]}));
            }
            spec = spec.with(json!({
                "lease": lease,
                "recovery": {"state_path": self.state_path(label)},
            }));
        }
        spec
    }

    /// Starts router `label` (agent identity `router`) with `args`; its handle reads with the
    /// fleet's client.
    ///
    /// # Panics
    /// When it does not start.
    pub fn start_router(&self, label: &str, args: &[&str]) -> RouterHandle {
        self.launch(label, "router", args)
    }

    fn launch(&self, label: &str, cert: &str, args: &[&str]) -> RouterHandle {
        self.launch_env(label, cert, args, &[])
    }

    fn launch_env(
        &self,
        label: &str,
        cert: &str,
        args: &[&str],
        env: &[(String, String)],
    ) -> RouterHandle {
        let doc = self.spec(label, cert).to_json(self.dir());
        if let Some(d) = self.disk.as_ref().filter(|_| label == "primary") {
            // The journal goes where the kit names it (`<label>.journal.jsonl`): a link to the
            // disk.
            let link = self.dir().join(format!("{label}.journal.jsonl"));
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(d.path.join(format!("{label}.journal.jsonl")), &link)
                    .expect("journal link");
            }
        }
        let mine = self
            .label_env
            .iter()
            .filter(|(l, _)| l == label)
            .flat_map(|(_, e)| e.iter());
        let fsync = self
            .fsync
            .as_ref()
            .filter(|_| label == "primary")
            .map(FsyncFault::env)
            .unwrap_or_default();
        let env: Vec<(String, String)> = self
            .router_env
            .iter()
            .chain(mine)
            .chain(env)
            .chain(&fsync)
            .cloned()
            .collect();
        launch_router_env(self.dir(), label, &doc, args, self.clients.clone(), &env)
            .unwrap_or_else(|e| panic!("router {label}: {e}"))
    }

    /// Starts a primary (`--router-id <label>`, plus `args`) and waits (10 s) until it
    /// controls the fleet.
    ///
    /// # Panics
    /// When it does not start or never controls the fleet.
    pub async fn primary_with(&self, label: &str, args: &[&str]) -> RouterHandle {
        let mut all = vec!["--router-id", label];
        all.extend_from_slice(args);
        let r = self.launch(label, "router", &all);
        r.wait_controls("active", Duration::from_secs(10)).await;
        r
    }

    /// [`Fleet::primary_with`] without extra flags.
    pub async fn primary(&self, label: &str) -> RouterHandle {
        self.primary_with(label, &[]).await
    }

    /// Starts a warm standby `label` (agent identity `standby`) of the router whose control
    /// listener is `primary_control`, polling every [`STANDBY_PROBE_S`] and trying to take over
    /// after [`STANDBY_TAKEOVER_AFTER`] misses, with `extra` flags.
    ///
    /// # Panics
    /// When it does not start.
    pub fn standby_of(&self, label: &str, primary_control: &str, extra: &[&str]) -> RouterHandle {
        self.standby_of_env(label, primary_control, extra, &[])
    }

    /// [`Fleet::standby_of`] with `env` added to the standby's environment (for example
    /// [`crate::faketime::wall_shifted`]: a standby whose wall clock is off).
    ///
    /// # Panics
    /// When it does not start.
    pub fn standby_of_env(
        &self,
        label: &str,
        primary_control: &str,
        extra: &[&str],
        env: &[(String, String)],
    ) -> RouterHandle {
        let probe = STANDBY_PROBE_S.to_string();
        let after = STANDBY_TAKEOVER_AFTER.to_string();
        let mut args = vec![
            "--router-id",
            label,
            "--standby-of",
            primary_control,
            "--standby-probe-interval",
            &probe,
            "--standby-takeover-after",
            &after,
        ];
        args.extend_from_slice(extra);
        self.launch_env(label, "standby", &args, env)
    }

    /// Waits (10 s) until router `label` has persisted a handoff of `epoch` and `holder` that
    /// satisfies `pred` (a standby's retained copy).
    ///
    /// # Panics
    /// When it does not.
    pub async fn wait_retained(
        &self,
        label: &str,
        epoch: u64,
        holder: &str,
        pred: impl Fn(&Handoff) -> bool,
    ) -> Handoff {
        let path = self.state_path(label);
        handoff_file_where(&path, Duration::from_secs(10), |h| {
            h.epoch == epoch && h.holder == holder && pred(h)
        })
        .await
    }

    /// The lease file's path (`None` without a file lease).
    pub fn lease_path(&self) -> Option<PathBuf> {
        self.lease.as_ref()?["path"].as_str().map(PathBuf::from)
    }

    /// The file lease's record (`None` for etcd, no lease, or no file yet).
    pub fn lease_file(&self) -> Option<Value> {
        let v = read_json_file(&self.lease_path()?);
        (!v.is_null()).then_some(v)
    }

    /// Writes a lease record as another router would (temporary file, then rename).
    ///
    /// # Panics
    /// Without a file lease, or when the file cannot be written.
    pub fn write_lease_file(&self, record: &Value) {
        let path = self.lease_path().expect("a file lease");
        narwhal_shared::write_atomic(&path, format!("{record}\n").as_bytes()).expect("write lease");
    }

    /// The fleet's kube-apiserver ([`LeaseBackend::Kubernetes`]).
    ///
    /// # Panics
    /// Without a Kubernetes lease.
    pub fn kube(&self) -> &crate::k8s::KubeApiServer {
        self.kube
            .as_ref()
            .expect("this fleet has no Kubernetes lease")
    }

    /// The fleet's etcd.
    ///
    /// # Panics
    /// Without an etcd lease.
    pub fn etcd(&self) -> &Etcd {
        self.etcd.as_ref().expect("this fleet has no etcd")
    }

    /// [`Fleet::etcd`], mutable (to kill and restart it).
    ///
    /// # Panics
    /// Without an etcd lease.
    pub fn etcd_mut(&mut self) -> &mut Etcd {
        self.etcd.as_mut().expect("this fleet has no etcd")
    }

    /// The proxy between the primary and etcd.
    ///
    /// # Panics
    /// Without [`FleetBuilder::primary_etcd_through_a_proxy`] and an etcd lease.
    pub fn etcd_proxy(&self) -> &Proxy {
        self.etcd_proxy
            .as_ref()
            .expect("this fleet's primary reaches etcd directly")
    }

    /// The primary's fsync fault.
    ///
    /// # Panics
    /// Without [`FleetBuilder::primary_fsync_fault`].
    pub fn fsync_fault(&self) -> &FsyncFault {
        self.fsync
            .as_ref()
            .expect("this fleet's primary runs under no fsync fault")
    }

    /// The primary's state-file and journal disk.
    ///
    /// # Panics
    /// Without [`FleetBuilder::primary_disk`].
    pub fn disk(&self) -> &Disk {
        self.disk
            .as_ref()
            .expect("this fleet has no disk of its own")
    }
}

/// Where in `items` the one `is` picks is; panics naming the `kind` and `name` looked for.
fn position<T>(items: &[T], is: impl Fn(&T) -> bool, kind: &str, name: &str) -> usize {
    items
        .iter()
        .position(is)
        .unwrap_or_else(|| panic!("no {kind} {name} in this fleet"))
}
