//! Engine pods drain themselves through the router (`control.self_drain`; docs/kubernetes.md,
//! "Self-drain"), on a real kube-apiserver (`narwhal_testkit::k8s`) with real routers, agents
//! and simulators: the pods are objects on the API server whose IP and container port are the
//! simulators', and their tokens are minted by TokenRequest bound to them, as a projected
//! service-account token volume holds them.
//!
//! - a pod's token reads and drains its own engine, through `narwhal-prestop` (the preStop
//!   hook), which returns once the engine is `ready_to_stop`;
//! - another pod's token naming that engine is refused 403; a token for another audience, and a
//!   request without one, 401; a deleted pod's token drains nothing;
//! - `narwhal-prestop` with no router to answer fails open within its connect timeout;
//! - a rollout restart of an engine StatefulSet by the real controllers, the test playing the
//!   kubelet, and a rolling restart by hand, under steady traffic, fail no request.
// Tests measure wall time (deadlines): the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use narwhal_shared::documents::{ErrorReply, SelfDrainStatus};
use narwhal_shared::handoff::DrainState;
use narwhal_testkit::k8s::{Grant, KubeApiServer, Rule, SA_ISSUER};
use narwhal_testkit::{ById, Fleet, bin_path};
use serde_json::json;

const NS: &str = "narwhal";
const AUDIENCE: &str = "narwhal-self-drain";

/// A self-drain call's status and body; over TLS trusting `ca` when given (no client
/// certificate: the listener asks for none).
async fn call(
    url: &str,
    ca: Option<&std::path::Path>,
    token: Option<&str>,
    body: Option<&str>,
) -> (u16, String) {
    use narwhal_shared::tls::{ServerTrust, build_client_config, plain_http_client_config};
    let tls = match ca {
        Some(ca) => build_client_config(ServerTrust::Ca(ca), None, &[b"http/1.1"]).unwrap(),
        None => plain_http_client_config().unwrap(),
    };
    let http = reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let url = format!("{url}/narwhal/self-drain");
    let mut req = match body {
        Some(b) => http
            .post(&url)
            .header("content-type", "application/json")
            .body(b.to_string()),
        None => http.get(&url),
    };
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

fn message(body: &str) -> String {
    serde_json::from_str::<ErrorReply>(body)
        .map(|e| e.error.message)
        .unwrap_or_else(|_| body.to_string())
}

/// The port of engine `iid`'s URL in the fleet.
fn port_of(f: &Fleet, iid: &str) -> u16 {
    let url = reqwest::Url::parse(&f.sim(iid).url).unwrap();
    url.port().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_drains_only_its_own_engine_with_its_bound_token() {
    let c = Cluster::start(false).await;
    let (admin, dir) = (&c.admin, c.dir.path());
    let f = Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .control_tls()
        .fleet(c.self_drain())
        .start()
        .await;
    // TLS with the control certificate, no client certificate asked.
    let url = f.router().self_drain_url();
    assert!(url.starts_with("https://"), "{url}");
    let ca = f.certs().ca.clone();

    // Two engine pods at the simulators' address and ports.
    let p0 = admin
        .create_pod(NS, "p0-pod", "engine", &[port_of(&f, "p0")], "127.0.0.1")
        .await;
    let d0 = admin
        .create_pod(NS, "d0-pod", "engine", &[port_of(&f, "d0")], "127.0.0.1")
        .await;
    let p0_token = admin.pod_token(NS, "engine", "p0-pod", &p0, AUDIENCE).await;
    let d0_token = admin.pod_token(NS, "engine", "d0-pod", &d0, AUDIENCE).await;

    // Its own engine, read with its token.
    let (status, body) = call(&url, Some(&ca), Some(&p0_token), None).await;
    assert_eq!(status, 200, "{body}");
    let st: SelfDrainStatus = serde_json::from_str(&body).unwrap();
    assert_eq!(st.pod, "narwhal/p0-pod");
    assert_eq!(st.engines.keys().collect::<Vec<_>>(), vec!["p0"]);
    assert!(!st.ready_to_stop);

    // Another pod's token naming p0: 403, and p0 stays in placement.
    let (status, body) = call(
        &url,
        Some(&ca),
        Some(&d0_token),
        Some(r#"{"engine": "p0"}"#),
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        message(&body),
        "pod narwhal/d0-pod may drain only its own engine(s) (d0), not p0"
    );
    // A token for another audience (the API server's own), and none at all: 401.
    let api_token = admin
        .pod_token(NS, "engine", "p0-pod", &p0, SA_ISSUER)
        .await;
    let (status, body) = call(&url, Some(&ca), Some(&api_token), Some("{}")).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        message(&body)
            .starts_with("the token was not accepted for audience \"narwhal-self-drain\""),
        "{body}"
    );
    let (status, body) = call(&url, Some(&ca), None, Some("{}")).await;
    assert_eq!(status, 401, "{body}");
    let lc = f.router().lifecycle().await;
    assert_eq!(lc.engines.of("p0").state, DrainState::Active, "{lc:#?}");

    // The preStop hook with p0's token: drains p0 and returns once it may stop.
    let token_file = dir.join("p0.token");
    std::fs::write(&token_file, &p0_token).unwrap();
    let started = Instant::now();
    let out = tokio::process::Command::new(bin_path("narwhal-prestop"))
        .args(["--router", &url, "--budget-s", "60", "--poll-s", "0.2"])
        .arg("--token-file")
        .arg(&token_file)
        .arg("--ca")
        .arg(&ca)
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("narwhal/p0-pod ready to stop"), "{stderr}");
    eprintln!(
        "[kubernetes_e2e] preStop returned after {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let lc = f.router().lifecycle().await;
    let e = lc.engines.of("p0");
    assert!(e.draining && e.ready_to_stop, "{lc:#?}");
    assert_eq!(lc.engines.of("d0").state, DrainState::Active, "{lc:#?}");
    // Run again (a hook retried): nothing changes, it is still ready to stop.
    let (status, body) = call(&url, Some(&ca), Some(&p0_token), Some("{}")).await;
    assert_eq!(status, 200, "{body}");

    // The pod is deleted: its token drains nothing (refused by TokenReview, or by the pod
    // check while the API server still accepts a token of a pod just deleted).
    admin.delete_pod_now(NS, "d0-pod").await;
    let (status, body) = call(&url, Some(&ca), Some(&d0_token), Some("{}")).await;
    assert!(status == 401 || status == 403, "{status} {body}");
    if status == 403 {
        assert_eq!(
            message(&body),
            "pod narwhal/d0-pod is gone: its token drains nothing"
        );
    }
    let lc = f.router().lifecycle().await;
    assert_eq!(lc.engines.of("d0").state, DrainState::Active, "{lc:#?}");
}

/// With no router to answer, the preStop hook fails open within its connect timeout, so a node
/// drain never waits on it.
#[tokio::test]
async fn the_prestop_hook_fails_open_when_no_router_answers() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "t").unwrap();
    let port = narwhal_testkit::etcd::free_port();
    let started = Instant::now();
    let out = tokio::process::Command::new(bin_path("narwhal-prestop"))
        .args([
            "--router",
            &format!("http://127.0.0.1:{port}"),
            "--connect-timeout-s",
            "1",
        ])
        .arg("--token-file")
        .arg(&token_file)
        .output()
        .await
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("failing open"), "{stderr}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

/// What the steady traffic of a rolling restart saw.
#[derive(Debug, Default)]
struct Traffic {
    sent: u64,
    failed: Vec<String>,
}

/// Completions sent back to back by `workers` clients until `stop`.
fn steady_traffic(
    data: &str,
    workers: usize,
    stop: tokio_util::sync::CancellationToken,
) -> Vec<tokio::task::JoinHandle<Traffic>> {
    (0..workers)
        .map(|w| {
            let url = format!("{data}/v1/completions");
            let stop = stop.clone();
            tokio::spawn(async move {
                let http = reqwest::Client::builder()
                    .no_proxy()
                    .timeout(Duration::from_secs(60))
                    .build()
                    .unwrap();
                let mut t = Traffic::default();
                let mut n = 0u64;
                while !stop.is_cancelled() {
                    n += 1;
                    let body = json!({"model": "tiny-sim", "max_tokens": 4,
                                      "prompt": format!("rolling restart {w} {n}")});
                    t.sent += 1;
                    match http.post(&url).json(&body).send().await {
                        Ok(r) if r.status() == 200 => {}
                        Ok(r) => {
                            let status = r.status();
                            t.failed
                                .push(format!("{status}: {}", r.text().await.unwrap_or_default()));
                        }
                        Err(e) => t.failed.push(e.to_string()),
                    }
                }
                t
            })
        })
        .collect()
}

/// A rolling restart of four engine pods under steady traffic, as Kubernetes runs one: for each
/// pod in turn, the pod is marked for deletion, its preStop hook (`narwhal-prestop` with the
/// pod's token) drains its engine and returns once it may stop, the engine process is stopped
/// and a new one started at the same address (the replacement pod, with a new token), and the
/// router readmits it through the six checks by itself (`control.self_drain.readmit`). No
/// request fails; each new process is readmitted (its start newer than the drained one's)
/// before the next pod goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_four_engine_pods_fails_no_request() {
    let c = Cluster::start(false).await;
    let (admin, dir) = (&c.admin, c.dir.path());
    let mut f = Fleet::builder()
        .prefill(2)
        .decode(2)
        .agents()
        .fleet(c.self_drain())
        .start()
        .await;
    let url = f.router().self_drain_url();
    let stop = tokio_util::sync::CancellationToken::new();
    let workers = steady_traffic(&f.router().data, 4, stop.clone());

    for iid in ["p0", "p1", "d0", "d1"] {
        let pod = format!("{iid}-pod");
        let uid = admin
            .create_pod(NS, &pod, "engine", &[port_of(&f, iid)], "127.0.0.1")
            .await;
        let token_file = dir.join(format!("{pod}.token"));
        std::fs::write(
            &token_file,
            admin.pod_token(NS, "engine", &pod, &uid, AUDIENCE).await,
        )
        .unwrap();
        let old_start = f
            .router()
            .lifecycle()
            .await
            .process_starts
            .get(iid)
            .copied();

        // Deletion: the pod is marked, its preStop runs with the pod's token.
        let out = tokio::process::Command::new(bin_path("narwhal-prestop"))
            .args(["--router", &url, "--budget-s", "60", "--poll-s", "0.2"])
            .arg("--token-file")
            .arg(&token_file)
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{iid}: {stderr}");
        let lc = f.router().lifecycle().await;
        let e = lc.engines.of(iid);
        assert!(e.draining && e.ready_to_stop, "{iid}: {lc:#?}");

        // SIGTERM, the pod object removed, the replacement's process at the same address.
        admin.delete_pod_now(NS, &pod).await;
        if iid == "p0" {
            // The old process answers health for a while after its drain (here 2.5 s, two
            // rounds of the readmission loop): it is never readmitted, and the drain stays
            // ready to stop, not blocked.
            tokio::time::sleep(Duration::from_millis(2500)).await;
            let lc = f.router().lifecycle().await;
            let e = lc.engines.of(iid);
            assert!(
                e.draining && e.ready_to_stop && e.state == DrainState::Drained,
                "{iid} still drained: {lc:#?}"
            );
        }
        f.sim_mut(iid).restart(&[]).expect("restart the engine");
        let readmitted = f.router().journal_event("readmitted", Some(iid)).await;
        let lc = f.router().lifecycle().await;
        assert!(lc.engines.of(iid).accepts_new, "{iid}: {lc:#?}");
        let new_start = lc.process_starts.get(iid).copied();
        assert!(
            new_start > old_start,
            "{iid}: readmitted with a newer process ({old_start:?} -> {new_start:?}): \
             {readmitted:?}"
        );
    }
    // The traffic goes on a moment on the restarted fleet, then stops.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    no_request_failed("rolling restart", workers).await;
    for iid in ["p0", "p1", "d0", "d1"] {
        let st = f.sim(iid).counters().await;
        let r = st.requests;
        // More than the readmission's own generation check: traffic came back.
        assert!(
            r.prefill + r.decode + r.aggregated > 1,
            "{iid} serves again: {r:?}"
        );
    }
}

/// A StatefulSet's status, the members read here.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct StsStatus {
    ready_replicas: u32,
    updated_replicas: u32,
    current_revision: String,
    update_revision: String,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct StsDoc {
    status: StsStatus,
}

/// The engines of the StatefulSet `engine`, by ordinal: pod `engine-<k>` is engine `ENGINES[k]`
/// at loopback address `127.0.0.<10 + k>`.
const ENGINES: [&str; 4] = ["p0", "p1", "d0", "d1"];

fn ordinal(pod: &str) -> usize {
    pod.rsplit('-').next().and_then(|k| k.parse().ok()).unwrap()
}

/// `narwhal-prestop` as a pod's hook with the token in `token_file`: `--ready` as the readiness
/// probe, else the preStop; its exit code and stderr.
async fn prestop(url: &str, token_file: &std::path::Path, ready: bool) -> (Option<i32>, String) {
    let mut cmd = tokio::process::Command::new(bin_path("narwhal-prestop"));
    cmd.args(["--router", url, "--budget-s", "60", "--poll-s", "0.2"])
        .arg("--token-file")
        .arg(token_file);
    if ready {
        cmd.arg("--ready");
    }
    let out = cmd.output().await.unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `kubectl rollout restart` of a 4-pod engine StatefulSet with a PodDisruptionBudget, on a real
/// API server with the real StatefulSet controller and scheduler, under steady traffic. The test
/// plays the kubelet: it starts a pod's engine (a simulator at the pod's address) and probes its
/// readiness with `narwhal-prestop --ready` (Ready only once the router places on it again);
/// on deletion it runs the preStop (`narwhal-prestop`, the pod's bound token), stops the engine
/// and confirms the deletion. Each pod is drained before its engine stops, each new pod is
/// readmitted through the router's checks before it turns Ready (so before the controller takes
/// the next one), and no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_restart_of_an_engine_statefulset_fails_no_request() {
    let c = Cluster::start(true).await;
    let admin = &c.admin;
    let ip = |k: usize| format!("127.0.0.{}", 10 + k);
    let mut f = Fleet::builder()
        .engine_on("p0", "prefill", &ip(0))
        .engine_on("p1", "prefill", &ip(1))
        .engine_on("d0", "decode", &ip(2))
        .engine_on("d1", "decode", &ip(3))
        .agents()
        .fleet(c.self_drain())
        .start()
        .await;
    let url = f.router().self_drain_url();

    let sts = json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "engine", "namespace": NS},
        "spec": {"replicas": 4, "serviceName": "engine", "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": "engine"}},
                 "updateStrategy": {"type": "RollingUpdate"},
                 "template": {"metadata": {"labels": {"app": "engine"}},
                              "spec": {"serviceAccountName": "engine",
                                       "terminationGracePeriodSeconds": 120,
                                       "containers": [{"name": "engine", "image": "engine:test"}]}}}});
    let sts_path = format!("/apis/apps/v1/namespaces/{NS}/statefulsets");
    admin.ensure(&sts_path, &sts).await;
    let pdb = json!({"apiVersion": "policy/v1beta1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "engine", "namespace": NS},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "engine"}}}});
    admin
        .ensure(
            &format!("/apis/policy/v1beta1/namespaces/{NS}/poddisruptionbudgets"),
            &pdb,
        )
        .await;

    let stop = tokio_util::sync::CancellationToken::new();
    let mut workers = Vec::new();
    let mut kubelet = Kubelet::default();
    let mut rollout_started = false;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if Instant::now() > deadline {
            panic!("the rollout did not finish: {}", c.explain(&kubelet).await);
        }
        kubelet.round(&c, &mut f, &url).await;
        let st: StsDoc = admin.get(&format!("{sts_path}/engine")).await.unwrap();
        let s = &st.status;
        if !rollout_started && s.ready_replicas == 4 {
            // Every pod Ready: the steady traffic starts, then `kubectl rollout restart`.
            workers = steady_traffic(&f.router().data, 4, stop.clone());
            tokio::time::sleep(Duration::from_millis(300)).await;
            admin
                .merge_patch(
                    &format!("{sts_path}/engine"),
                    &json!({"spec": {"template": {"metadata": {"annotations": {
                        "kubectl.kubernetes.io/restartedAt": "now"}}}}}),
                )
                .await
                .unwrap();
            rollout_started = true;
        } else if rollout_started
            && kubelet.drained.len() == 4
            && s.ready_replicas == 4
            && s.updated_replicas == 4
            && s.current_revision == s.update_revision
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The StatefulSet controller takes pods down from the highest ordinal, one at a time.
    assert_eq!(
        kubelet.drained,
        ["engine-3", "engine-2", "engine-1", "engine-0"]
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    no_request_failed("StatefulSet rollout restart", workers).await;
    for iid in ENGINES {
        let ev = f.router().journal_event("readmitted", Some(iid)).await;
        assert_eq!(ev.iid, iid);
    }
}

/// An API server with the router's identity (TokenReview through `system:auth-delegator`,
/// reading pods) and the engines' service account, and the router's token in a file.
struct Cluster {
    api: KubeApiServer,
    admin: narwhal_testkit::k8s::KubeClient,
    dir: tempfile::TempDir,
    router_token: std::path::PathBuf,
}

impl Cluster {
    /// Starts it, with the controllers and a node when `controllers`.
    async fn start(controllers: bool) -> Cluster {
        let mut api = KubeApiServer::start().await;
        if controllers {
            api.start_controllers().await;
        }
        let admin = api.admin();
        admin
            .grant(&Grant {
                namespace: NS,
                account: "narwhal-router",
                rules: vec![Rule {
                    api_groups: vec![""],
                    resources: vec!["pods"],
                    resource_names: vec![],
                    verbs: vec!["get"],
                }],
            })
            .await;
        admin
            .bind_cluster_role(NS, "narwhal-router", "system:auth-delegator")
            .await;
        admin
            .grant(&Grant {
                namespace: NS,
                account: "engine",
                rules: vec![],
            })
            .await;
        let dir = tempfile::tempdir().unwrap();
        let router_token = dir.path().join("router.token");
        std::fs::write(&router_token, admin.token_for(NS, "narwhal-router").await).unwrap();
        Cluster {
            api,
            admin,
            dir,
            router_token,
        }
    }

    /// The fleet-file section of a router that takes self-drains from this cluster's pods.
    fn self_drain(&self) -> serde_json::Value {
        json!({"control": {"self_drain": {
            "listen": "127.0.0.1:0", "audience": AUDIENCE, "deadline_s": 60,
            "api_server": self.api.url, "token_file": self.router_token,
            "ca_file": self.api.ca}}})
    }

    /// The pods and the controllers' last lines, for a rollout that did not finish.
    async fn explain(&self, kubelet: &Kubelet) -> String {
        let pods = self.admin.pods(NS, "app=engine").await;
        let tail = |name: &str| {
            let log = self.api.controller_log(name);
            let lines: Vec<&str> = log.lines().rev().take(25).collect();
            lines.into_iter().rev().collect::<Vec<_>>().join("\n")
        };
        format!(
            "drained {:?}; pods {pods:#?}\nkube-scheduler:\n{}\nkube-controller-manager:\n{}",
            kubelet.drained,
            tail("kube-scheduler"),
            tail("kube-controller-manager")
        )
    }
}

/// Joins the traffic workers and asserts that they ran and that no request failed.
async fn no_request_failed(what: &str, workers: Vec<tokio::task::JoinHandle<Traffic>>) {
    let mut sent = 0;
    let mut failed = Vec::new();
    for w in workers {
        let t = w.await.unwrap();
        sent += t.sent;
        failed.extend(t.failed);
    }
    eprintln!(
        "[kubernetes_e2e] {what}: {sent} requests, {} failed",
        failed.len()
    );
    assert!(sent > 20, "traffic ran: {sent}");
    assert!(failed.is_empty(), "failed requests: {failed:#?}");
}

/// The test's kubelet for the StatefulSet `engine` ([`ENGINES`]).
#[derive(Default)]
struct Kubelet {
    /// Each pod's bound token, in a file, by pod UID.
    tokens: std::collections::BTreeMap<String, std::path::PathBuf>,
    /// The pods drained by their preStop, in order.
    drained: Vec<String>,
    /// Which engines' processes were stopped (their next pod starts a new one).
    stopped: [bool; 4],
}

impl Kubelet {
    /// One round over the pods bound to the node: a pod being deleted runs its preStop (which
    /// must drain its engine), its engine stops and its deletion is confirmed; a new pod starts
    /// its engine (a new process where one was stopped) and runs; a running pod turns Ready
    /// when its readiness probe (`narwhal-prestop --ready`) passes.
    async fn round(&mut self, c: &Cluster, f: &mut Fleet, url: &str) {
        for pod in c.admin.pods(NS, "app=engine").await {
            if pod.spec.node_name.is_none() {
                continue;
            }
            let name = pod.metadata.name.clone();
            let k = ordinal(&name);
            let iid = ENGINES[k];
            let ip = format!("127.0.0.{}", 10 + k);
            let token_file = self.token(c, &name, &pod.metadata.uid).await;
            if pod.metadata.deletion_timestamp.is_some() {
                let (code, stderr) = prestop(url, &token_file, false).await;
                assert_eq!(code, Some(0), "{name} preStop: {stderr}");
                let lc = f.router().lifecycle().await;
                let e = lc.engines.of(iid);
                assert!(e.draining && e.ready_to_stop, "{iid} drained: {lc:#?}");
                f.sim_mut(iid).proc.kill();
                c.admin.delete_pod_now(NS, &name).await;
                self.drained.push(name);
                self.stopped[k] = true;
            } else if pod.status.ready() {
            } else if pod.status.phase != "Running" {
                if self.stopped[k] {
                    f.sim_mut(iid).restart(&[]).expect("start the engine");
                    self.stopped[k] = false;
                }
                let _ = c.admin.set_pod_running(NS, &name, &ip, false).await;
            } else if prestop(url, &token_file, true).await.0 == Some(0) {
                let _ = c.admin.set_pod_running(NS, &name, &ip, true).await;
            }
        }
    }

    /// Pod `name`'s bound token (UID `uid`) in a file, minted once.
    async fn token(&mut self, c: &Cluster, name: &str, uid: &str) -> std::path::PathBuf {
        if let Some(t) = self.tokens.get(uid) {
            return t.clone();
        }
        let t = c.dir.path().join(format!("{uid}.token"));
        let token = c.admin.pod_token(NS, "engine", name, uid, AUDIENCE).await;
        std::fs::write(&t, token).unwrap();
        self.tokens.insert(uid.to_string(), t.clone());
        t
    }
}
