//! A real Kubernetes API server for tests (docs/kubernetes.md, "What is tested"): the tests
//! start kube-apiserver v1.20.2, built from Debian's own source package, on a loopback port
//! with its own etcd, and `cargo test --workspace` on a fresh machine builds it once.
//!
//! ```text
//!   control_plane_bin(name): $NARWHAL_K8S_BIN_DIR/<name> ─► <cache>/k8s-v1.20.2/bin/<name>
//!                    ─► build it: tests/k8s/build-control-plane.sh (apt source package, Debian's
//!                       Go; about 4 minutes of two cores, once per machine, under a file lock)
//!   KubeApiServer::start(): etcd (narwhal_testkit::etcd) + kube-apiserver on free loopback
//!                    ports; a CA and serving certificate made now with rcgen; one admin token
//!                    (group system:masters); service-account signing keys, so TokenRequest
//!                    mints pod-bound tokens; RBAC on
//!   KubeClient:      typed REST calls for setup and for checking what the router wrote
//! ```
//!
//! A test that needs the API server and cannot have it FAILS with the reason; it never passes
//! by skipping.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::etcd::{EtcdOptions, EtcdServer, cache_dir, free_port};

/// Signals for [`KubeApiServer::signal`] (SIGSTOP, SIGCONT), re-exported for tests that do
/// not depend on nix.
pub use nix::sys::signal::Signal;

/// The Kubernetes version the kit builds and starts.
pub const K8S_VERSION: &str = "v1.20.2";
/// The service-account issuer, and the default audience of the tokens it mints.
pub const SA_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

/// The path of control-plane binary `name` (`kube-apiserver`, `kube-controller-manager`,
/// `kube-scheduler`), building all three once per machine when no cached copy exists (see the
/// module doc).
///
/// # Errors
/// What was tried, and the build's log, when none can be had.
pub fn control_plane_bin(name: &str) -> Result<PathBuf, String> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = DIR.get_or_init(find_or_build).clone()?;
    Ok(dir.join(name))
}

fn find_or_build() -> Result<PathBuf, String> {
    if let Some(d) = std::env::var_os("NARWHAL_K8S_BIN_DIR") {
        let d = PathBuf::from(d);
        return if d.join("kube-apiserver").is_file() {
            Ok(d)
        } else {
            Err(format!(
                "NARWHAL_K8S_BIN_DIR={} holds no kube-apiserver",
                d.display()
            ))
        };
    }
    let dir = cache_dir().join(format!("k8s-{K8S_VERSION}")).join("bin");
    let have = |d: &Path| {
        [
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
        ]
        .iter()
        .all(|b| d.join(b).is_file())
    };
    if have(&dir) {
        return Ok(dir);
    }
    std::fs::create_dir_all(cache_dir()).map_err(|e| format!("creating the cache: {e}"))?;
    // One build per machine: other test processes wait on the lock, then find the binaries.
    let lock = std::fs::File::create(cache_dir().join("k8s-build.lock"))
        .map_err(|e| format!("k8s build lock: {e}"))?;
    lock.lock().map_err(|e| format!("k8s build lock: {e}"))?;
    if have(&dir) {
        return Ok(dir);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("k8s/build-control-plane.sh");
    let log = cache_dir().join("k8s-build.log");
    eprintln!(
        "narwhal-testkit: building kube-apiserver {K8S_VERSION} from Debian's source package \
         (once per machine, about 4 minutes; log {})",
        log.display()
    );
    let out = std::fs::File::create(&log).map_err(|e| format!("k8s build log: {e}"))?;
    let status = Command::new("bash")
        .arg(&script)
        .arg(&dir)
        .stdin(Stdio::null())
        .stdout(out.try_clone().map_err(|e| e.to_string())?)
        .stderr(out)
        .status()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    if !status.success() || !have(&dir) {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        return Err(format!(
            "{} failed ({status}); the last lines of {}:\n{}",
            script.display(),
            log.display(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    Ok(dir)
}

/// A Kubernetes `Status` (an error answer), or any answer's `kind` and `message`.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default)]
pub struct StatusDoc {
    /// `Status` for errors.
    pub kind: String,
    /// What went wrong.
    pub message: String,
    /// `NotFound`, `Conflict`, `Forbidden`, ...
    pub reason: String,
}

/// A failed REST call: the HTTP status (0: no answer) and the message.
#[derive(Debug, Clone)]
pub struct CallError {
    /// HTTP status; 0 when there was no answer.
    pub status: u16,
    /// The server's `Status` message, or the transport error.
    pub message: String,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.status, self.message)
    }
}

/// A REST client of the API server with one bearer token.
#[derive(Debug, Clone)]
pub struct KubeClient {
    http: reqwest::Client,
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    token: String,
}

impl KubeClient {
    /// A client of `url` trusting `ca`, presenting `token`.
    ///
    /// # Panics
    /// When the CA cannot be read.
    pub fn new(url: &str, ca: &Path, token: &str) -> KubeClient {
        let tls = narwhal_shared::tls::build_client_config(
            narwhal_shared::tls::ServerTrust::Ca(ca),
            None,
            &[b"http/1.1"],
        )
        .expect("API server CA");
        KubeClient {
            http: reqwest::Client::builder()
                .use_preconfigured_tls(tls)
                .no_proxy()
                .timeout(Duration::from_secs(20))
                .build()
                .expect("reqwest client"),
            url: url.to_string(),
            token: token.to_string(),
        }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&(impl Serialize + Sync)>,
    ) -> Result<T, CallError> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.map_err(|e| CallError {
            status: 0,
            message: format!("{e:?}"),
        })?;
        let status = resp.status().as_u16();
        let bytes = resp.bytes().await.map_err(|e| CallError {
            status,
            message: e.to_string(),
        })?;
        if (200..300).contains(&status) {
            return serde_json::from_slice(&bytes).map_err(|e| CallError {
                status,
                message: format!(
                    "not the expected document ({e}): {}",
                    String::from_utf8_lossy(&bytes)
                ),
            });
        }
        let s: StatusDoc = serde_json::from_slice(&bytes).unwrap_or_default();
        Err(CallError {
            status,
            message: if s.message.is_empty() {
                String::from_utf8_lossy(&bytes).into_owned()
            } else {
                format!("{}: {}", s.reason, s.message)
            },
        })
    }

    /// `GET path`, typed.
    ///
    /// # Errors
    /// The status and message of a failed call.
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, CallError> {
        self.call(reqwest::Method::GET, path, None::<&()>).await
    }

    /// `POST path` with `body`, typed.
    ///
    /// # Errors
    /// The status and message of a failed call.
    pub async fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &(impl Serialize + Sync),
    ) -> Result<T, CallError> {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    /// `PUT path` with `body`, typed.
    ///
    /// # Errors
    /// The status and message of a failed call.
    pub async fn put<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &(impl Serialize + Sync),
    ) -> Result<T, CallError> {
        self.call(reqwest::Method::PUT, path, Some(body)).await
    }

    /// `DELETE path`.
    ///
    /// # Errors
    /// The status and message of a failed call.
    pub async fn delete(&self, path: &str) -> Result<(), CallError> {
        self.call::<serde_json::Value>(reqwest::Method::DELETE, path, None::<&()>)
            .await
            .map(drop)
    }

    /// Creates (`POST`) the object `body` at collection `path`; an object that already exists
    /// is left as it is.
    ///
    /// # Panics
    /// On any other failure.
    pub async fn ensure(&self, path: &str, body: &(impl Serialize + Sync)) {
        match self.post::<serde_json::Value>(path, body).await {
            Ok(_) => {}
            Err(e) if e.status == 409 => {}
            Err(e) => panic!("creating at {path}: {e}"),
        }
    }
}

/// The namespace of the fleet's Lease ([`crate::LeaseBackend::Kubernetes`]).
pub const KUBE_NAMESPACE: &str = "narwhal";
/// The fleet's Lease name (the chart's default, `lease.kubernetes.name`).
pub const KUBE_LEASE: &str = "narwhal-router";
/// The routers' service account.
pub const KUBE_ROUTER_ACCOUNT: &str = "narwhal-router";

/// The routers' Role for Lease `name`, as the chart grants it: `get` and `update` on that one
/// Lease, `create` on leases (which RBAC cannot limit by name) in [`KUBE_NAMESPACE`].
pub fn router_grant(name: &str) -> Grant<'_> {
    Grant {
        namespace: KUBE_NAMESPACE,
        account: KUBE_ROUTER_ACCOUNT,
        rules: vec![
            Rule {
                api_groups: vec!["coordination.k8s.io"],
                resources: vec!["leases"],
                resource_names: vec![name],
                verbs: vec!["get", "update"],
            },
            Rule {
                api_groups: vec!["coordination.k8s.io"],
                resources: vec!["leases"],
                resource_names: vec![],
                verbs: vec!["create"],
            },
        ],
    }
}

/// A service account in a namespace, with a Role and RoleBinding granting `rules`.
#[derive(Debug, Clone)]
pub struct Grant<'a> {
    /// Namespace (created when missing).
    pub namespace: &'a str,
    /// The service account (created).
    pub account: &'a str,
    /// The Role's rules, as RBAC `PolicyRule`s.
    pub rules: Vec<Rule<'a>>,
}

/// One RBAC `PolicyRule`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rule<'a> {
    /// API groups (`""` core, `coordination.k8s.io`).
    pub api_groups: Vec<&'a str>,
    /// Resources (`leases`).
    pub resources: Vec<&'a str>,
    /// Only these objects (empty: all).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub resource_names: Vec<&'a str>,
    /// Verbs.
    pub verbs: Vec<&'a str>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Object<'a, S: Serialize> {
    api_version: &'a str,
    kind: &'a str,
    metadata: Meta<'a>,
    #[serde(flatten)]
    body: S,
}

#[derive(Serialize)]
struct Meta<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<&'a str>,
}

#[derive(Serialize)]
struct NoBody {}

#[derive(Serialize)]
struct RoleBody<'a> {
    rules: &'a [Rule<'a>],
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct BindingBody<'a> {
    role_ref: RoleRef<'a>,
    subjects: Vec<Subject<'a>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct RoleRef<'a> {
    api_group: &'a str,
    kind: &'a str,
    name: &'a str,
}

#[derive(Serialize)]
struct Subject<'a> {
    kind: &'a str,
    name: &'a str,
    namespace: &'a str,
}

#[derive(Serialize)]
struct TokenRequestBody<'a> {
    spec: TokenRequestSpec<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct TokenRequestSpec<'a> {
    audiences: Vec<&'a str>,
    expiration_seconds: i64,
}

#[derive(serde::Deserialize)]
struct TokenRequestAnswer {
    status: TokenStatus,
}

#[derive(serde::Deserialize)]
struct TokenStatus {
    token: String,
}

impl KubeClient {
    /// Creates `g`'s namespace, service account, Role (named after the account) and
    /// RoleBinding; what exists already is left as it is.
    pub async fn grant(&self, g: &Grant<'_>) {
        let ns = g.namespace;
        self.ensure(
            "/api/v1/namespaces",
            &Object {
                api_version: "v1",
                kind: "Namespace",
                metadata: Meta {
                    name: ns,
                    namespace: None,
                },
                body: NoBody {},
            },
        )
        .await;
        let meta = || Meta {
            name: g.account,
            namespace: Some(ns),
        };
        self.ensure(
            &format!("/api/v1/namespaces/{ns}/serviceaccounts"),
            &Object {
                api_version: "v1",
                kind: "ServiceAccount",
                metadata: meta(),
                body: NoBody {},
            },
        )
        .await;
        self.ensure(
            &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles"),
            &Object {
                api_version: "rbac.authorization.k8s.io/v1",
                kind: "Role",
                metadata: meta(),
                body: RoleBody { rules: &g.rules },
            },
        )
        .await;
        self.ensure(
            &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"),
            &Object {
                api_version: "rbac.authorization.k8s.io/v1",
                kind: "RoleBinding",
                metadata: meta(),
                body: BindingBody {
                    role_ref: RoleRef {
                        api_group: "rbac.authorization.k8s.io",
                        kind: "Role",
                        name: g.account,
                    },
                    subjects: vec![Subject {
                        kind: "ServiceAccount",
                        name: g.account,
                        namespace: ns,
                    }],
                },
            },
        )
        .await;
    }

    /// A token for service account `account` in `namespace` (TokenRequest), valid for an
    /// hour, for the API server's own audience.
    ///
    /// # Panics
    /// When the API server refuses.
    pub async fn token_for(&self, namespace: &str, account: &str) -> String {
        let a: TokenRequestAnswer = self
            .post(
                &format!("/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"),
                &Object {
                    api_version: "authentication.k8s.io/v1",
                    kind: "TokenRequest",
                    metadata: Meta {
                        name: account,
                        namespace: Some(namespace),
                    },
                    body: TokenRequestBody {
                        spec: TokenRequestSpec {
                            audiences: vec![SA_ISSUER],
                            expiration_seconds: 3600,
                        },
                    },
                },
            )
            .await
            .unwrap_or_else(|e| panic!("TokenRequest for {namespace}/{account}: {e}"));
        a.status.token
    }
}

/// The members of a Pod the kit reads back.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default)]
pub struct PodDoc {
    /// `metadata` (name, uid, deletion).
    pub metadata: PodMetaDoc,
    /// `spec` (the node it is bound to).
    pub spec: PodSpecDoc,
    /// `status` (phase).
    pub status: PodStatusDoc,
}

/// A Pod's `spec`, the members the kit reads.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodSpecDoc {
    /// The node the scheduler bound it to (`None` while pending).
    pub node_name: Option<String>,
}

/// A Pod's `status`, the members the kit reads.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default)]
pub struct PodStatusDoc {
    /// `Pending`, `Running`, ...
    pub phase: String,
    /// `Ready`, `ContainersReady`, ...
    pub conditions: Vec<ConditionDoc>,
}

impl PodStatusDoc {
    /// Its `Ready` condition is `True`.
    pub fn ready(&self) -> bool {
        self.conditions
            .iter()
            .any(|c| c.kind == "Ready" && c.status == "True")
    }
}

/// One status condition.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default)]
pub struct ConditionDoc {
    /// `Ready`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// `True`, `False`, `Unknown`.
    pub status: String,
    /// Why (`Unschedulable`, ...).
    pub reason: String,
    /// What the controller said.
    pub message: String,
}

/// A list answer's `items`.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default)]
pub struct ListDoc<T> {
    /// The objects.
    pub items: Vec<T>,
}

/// A Pod's `metadata`, the members the kit reads.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodMetaDoc {
    /// The pod's name.
    pub name: String,
    /// Its UID.
    pub uid: String,
    /// Set once it is being deleted.
    pub deletion_timestamp: Option<String>,
}

impl KubeClient {
    /// Binds service account `namespace/account` to the cluster role `role` (a
    /// ClusterRoleBinding named `<account>-<role>`, `:` replaced by `-`).
    pub async fn bind_cluster_role(&self, namespace: &str, account: &str, role: &str) {
        let name = format!("{account}-{}", role.replace(':', "-"));
        self.ensure(
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            &Object {
                api_version: "rbac.authorization.k8s.io/v1",
                kind: "ClusterRoleBinding",
                metadata: Meta {
                    name: &name,
                    namespace: None,
                },
                body: BindingBody {
                    role_ref: RoleRef {
                        api_group: "rbac.authorization.k8s.io",
                        kind: "ClusterRole",
                        name: role,
                    },
                    subjects: vec![Subject {
                        kind: "ServiceAccount",
                        name: account,
                        namespace,
                    }],
                },
            },
        )
        .await;
    }

    /// Creates pod `namespace/name` running as service account `account` with one container
    /// declaring `ports`, then writes its status as a kubelet would (`Running`, Ready, `podIP`
    /// = `ip`); its UID.
    ///
    /// # Panics
    /// When the API server refuses.
    pub async fn create_pod(
        &self,
        namespace: &str,
        name: &str,
        account: &str,
        ports: &[u16],
        ip: &str,
    ) -> String {
        let ports: Vec<serde_json::Value> = ports
            .iter()
            .map(|p| serde_json::json!({"containerPort": p}))
            .collect();
        let pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"serviceAccountName": account, "nodeName": "node-a",
                     "containers": [{"name": "engine", "image": "engine:test", "ports": ports}]}
        });
        let mut created: serde_json::Value = self
            .post(&format!("/api/v1/namespaces/{namespace}/pods"), &pod)
            .await
            .unwrap_or_else(|e| panic!("creating pod {namespace}/{name}: {e}"));
        crate::router::merge(
            &mut created,
            serde_json::json!({"status": {"phase": "Running", "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True"}]}}),
        );
        let done: PodDoc = self
            .put(
                &format!("/api/v1/namespaces/{namespace}/pods/{name}/status"),
                &created,
            )
            .await
            .unwrap_or_else(|e| panic!("writing the status of pod {namespace}/{name}: {e}"));
        done.metadata.uid
    }

    /// The pods of `namespace` whose labels match `selector` (`app=engine`).
    ///
    /// # Panics
    /// When the API server refuses.
    pub async fn pods(&self, namespace: &str, selector: &str) -> Vec<PodDoc> {
        let list: ListDoc<PodDoc> = self
            .get(&format!(
                "/api/v1/namespaces/{namespace}/pods?labelSelector={selector}"
            ))
            .await
            .unwrap_or_else(|e| panic!("listing pods of {namespace}: {e}"));
        list.items
    }

    /// Writes pod `namespace/name`'s status as a kubelet does once its container runs:
    /// `Running`, `podIP` = `ip`, and Ready when its readiness probe passed (`ready`).
    ///
    /// # Errors
    /// The failed call (a pod deleted meanwhile, a conflict with another writer).
    pub async fn set_pod_running(
        &self,
        namespace: &str,
        name: &str,
        ip: &str,
        ready: bool,
    ) -> Result<(), CallError> {
        let path = format!("/api/v1/namespaces/{namespace}/pods/{name}");
        let mut pod: serde_json::Value = self.get(&path).await?;
        let ready = if ready { "True" } else { "False" };
        crate::router::merge(
            &mut pod,
            serde_json::json!({"status": {"phase": "Running", "podIP": ip,
                "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": ready},
                               {"type": "ContainersReady", "status": ready},
                               {"type": "Initialized", "status": "True"},
                               {"type": "PodScheduled", "status": "True"}]}}),
        );
        self.put::<serde_json::Value>(&format!("{path}/status"), &pod)
            .await
            .map(drop)
    }

    /// Creates node `name` with room for 110 pods and writes its status Ready, as a kubelet
    /// registering would, with no taints.
    ///
    /// # Panics
    /// When the API server refuses.
    pub async fn create_node(&self, name: &str) {
        let node = serde_json::json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}});
        let mut created: serde_json::Value = self
            .post("/api/v1/nodes", &node)
            .await
            .unwrap_or_else(|e| panic!("creating node {name}: {e}"));
        let room = serde_json::json!({"cpu": "64", "memory": "256Gi", "pods": "110"});
        crate::router::merge(
            &mut created,
            serde_json::json!({"status": {"capacity": room, "allocatable": room,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}),
        );
        self.put::<serde_json::Value>(&format!("/api/v1/nodes/{name}/status"), &created)
            .await
            .unwrap_or_else(|e| panic!("writing node {name}'s status: {e}"));
        // The API server's admission (TaintNodesByCondition) gives a new node the `not-ready`
        // taint; the node lifecycle controller that would lift it is not run, so lift it here.
        self.merge_patch(
            &format!("/api/v1/nodes/{name}"),
            &serde_json::json!({"spec": {"taints": null}}),
        )
        .await
        .unwrap_or_else(|e| panic!("lifting node {name}'s not-ready taint: {e}"));
    }

    /// Merge-patches the object at `path` with `patch` (`application/merge-patch+json`).
    ///
    /// # Errors
    /// The status and message of a failed call.
    pub async fn merge_patch(
        &self,
        path: &str,
        patch: &serde_json::Value,
    ) -> Result<(), CallError> {
        let resp = self
            .http
            .patch(format!("{}{path}", self.url))
            .bearer_auth(&self.token)
            .header("content-type", "application/merge-patch+json")
            .body(patch.to_string())
            .send()
            .await
            .map_err(|e| CallError {
                status: 0,
                message: e.to_string(),
            })?;
        let status = resp.status().as_u16();
        if (200..300).contains(&status) {
            return Ok(());
        }
        Err(CallError {
            status,
            message: resp.text().await.unwrap_or_default(),
        })
    }

    /// Deletes pod `namespace/name` at once (grace period 0), as a kubelet confirms it.
    ///
    /// # Panics
    /// When the API server refuses.
    pub async fn delete_pod_now(&self, namespace: &str, name: &str) {
        self.call::<serde_json::Value>(
            reqwest::Method::DELETE,
            &format!("/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0"),
            None::<&()>,
        )
        .await
        .unwrap_or_else(|e| panic!("deleting pod {namespace}/{name}: {e}"));
    }

    /// A token for service account `namespace/account` bound to pod `pod` (its `uid`), for
    /// `audience`, valid for an hour: what a projected service-account token volume holds.
    ///
    /// # Panics
    /// When the API server refuses.
    pub async fn pod_token(
        &self,
        namespace: &str,
        account: &str,
        pod: &str,
        uid: &str,
        audience: &str,
    ) -> String {
        let req = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [audience], "expirationSeconds": 3600,
                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod, "uid": uid}}
        });
        let a: TokenRequestAnswer = self
            .post(
                &format!("/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"),
                &req,
            )
            .await
            .unwrap_or_else(|e| panic!("TokenRequest bound to pod {namespace}/{pod}: {e}"));
        a.status.token
    }
}

/// A kube-apiserver with its own etcd, on loopback, killed on drop.
#[derive(Debug)]
pub struct KubeApiServer {
    etcd: EtcdServer,
    child: Child,
    command: (PathBuf, Vec<std::ffi::OsString>),
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// The CA the serving certificate chains to (PEM).
    pub ca: PathBuf,
    /// A token of group `system:masters`.
    pub admin_token: String,
    log: PathBuf,
    /// kube-controller-manager and kube-scheduler, once started.
    controllers: Vec<Child>,
    dir: tempfile::TempDir,
}

fn make_ca() -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params
        .distinguished_name
        .push(DnType::CommonName, "narwhal test cluster CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let cert = params.self_signed(&key).expect("self-sign CA");
    (cert.pem(), Issuer::new(params, key))
}

fn make_serving(issuer: &Issuer<'static, KeyPair>) -> (String, String) {
    let key = KeyPair::generate().expect("serving key");
    let sans = ["127.0.0.1", "localhost", "kubernetes.default.svc"];
    let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .expect("serving params");
    params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, issuer).expect("sign serving");
    (cert.pem(), key.serialize_pem())
}

impl KubeApiServer {
    /// Starts etcd and kube-apiserver and waits (90 s) until `/readyz` answers 200 and the
    /// `default` namespace exists.
    ///
    /// # Panics
    /// When the binaries cannot be had or the server does not become ready (its log says why).
    pub async fn start() -> KubeApiServer {
        let bin = control_plane_bin("kube-apiserver")
            .unwrap_or_else(|e| panic!("these tests need a real kube-apiserver: {e}"));
        let etcd = EtcdServer::start(EtcdOptions::default()).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).expect("write");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
            p
        };
        let (ca_pem, issuer) = make_ca();
        let ca = write("ca.pem", &ca_pem);
        let (cert, key) = make_serving(&issuer);
        let cert = write("apiserver.pem", &cert);
        let key = write("apiserver.key", &key);
        let sa = KeyPair::generate().expect("service-account key");
        let sa_key = write("sa.key", &sa.serialize_pem());
        let sa_pub = write("sa.pub", &sa.public_key_pem());
        let admin_token = format!("admin-{:016x}", rand::random::<u64>());
        let tokens = write(
            "tokens.csv",
            &format!("{admin_token},narwhal-admin,narwhal-admin-uid,\"system:masters\"\n"),
        );
        let log = dir.path().join("kube-apiserver.log");
        for _ in 0..3 {
            let port = free_port();
            let url = format!("https://127.0.0.1:{port}");
            let mut cmd = Command::new(&bin);
            cmd.args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
                .arg(format!("--secure-port={port}"))
                .arg("--insecure-port=0")
                .arg(format!("--etcd-servers={}", etcd.endpoint))
                .arg("--tls-cert-file")
                .arg(&cert)
                .arg("--tls-private-key-file")
                .arg(&key)
                .arg("--cert-dir")
                .arg(dir.path().join("certs"))
                .arg("--token-auth-file")
                .arg(&tokens)
                .arg("--authorization-mode=RBAC")
                .arg(format!("--service-account-issuer={SA_ISSUER}"))
                .arg("--service-account-key-file")
                .arg(&sa_pub)
                .arg("--service-account-signing-key-file")
                .arg(&sa_key)
                .arg(format!("--api-audiences={SA_ISSUER}"))
                .arg("--feature-gates=BoundServiceAccountTokenVolume=true")
                .arg("--service-cluster-ip-range=10.96.0.0/16")
                .arg("--allow-privileged=true")
                .arg("--enable-priority-and-fairness=false")
                .arg("--profiling=false");
            let command = (bin.clone(), cmd.get_args().map(ToOwned::to_owned).collect());
            let out = std::fs::File::create(&log).expect("apiserver log");
            let mut child = cmd
                .stdin(Stdio::null())
                .stdout(out.try_clone().expect("dup log"))
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()));
            let admin = KubeClient::new(&url, &ca, &admin_token);
            if wait_ready(&mut child, &admin, &log).await {
                return KubeApiServer {
                    etcd,
                    child,
                    command,
                    url,
                    ca,
                    admin_token,
                    log,
                    controllers: Vec::new(),
                    dir,
                };
            }
            // Most likely a port taken meanwhile: try another.
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!(
            "kube-apiserver {} did not become ready in 3 attempts; its last log:\n{}",
            bin.display(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// Starts kube-controller-manager (every controller but those of cloud, node lifecycle and
    /// IPAM, routes and Services) and kube-scheduler against this server with the admin token,
    /// neither serving a port nor electing a leader, and registers node `node-a`: Deployments,
    /// StatefulSets, PodDisruptionBudgets and scheduling then work; the test plays the kubelet.
    ///
    /// # Panics
    /// When a binary cannot be had or started.
    pub async fn start_controllers(&mut self) {
        let kubeconfig = self.dir.path().join("admin.kubeconfig");
        let doc = serde_json::json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url,
                          "certificate-authority": self.ca}}],
            "users": [{"name": "admin", "user": {"token": self.admin_token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
            "current-context": "test"
        });
        std::fs::write(&kubeconfig, doc.to_string()).expect("kubeconfig");
        let sa_key = self.dir.path().join("sa.key");
        let spawn = |name: &str, args: Vec<String>| {
            let bin =
                control_plane_bin(name).unwrap_or_else(|e| panic!("these tests need {name}: {e}"));
            let log = std::fs::File::create(self.dir.path().join(format!("{name}.log")))
                .expect("controller log");
            Command::new(&bin)
                .args(args)
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("dup log"))
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("spawning {}: {e}", bin.display()))
        };
        let kc = format!("--kubeconfig={}", kubeconfig.display());
        self.controllers.push(spawn(
            "kube-controller-manager",
            vec![
                kc.clone(),
                "--controllers=*,-nodelifecycle,-nodeipam,-cloud-node-lifecycle,-route,-service"
                    .into(),
                "--leader-elect=false".into(),
                "--port=0".into(),
                "--secure-port=0".into(),
                format!("--service-account-private-key-file={}", sa_key.display()),
                format!("--root-ca-file={}", self.ca.display()),
                "--concurrent-statefulset-syncs=2".into(),
            ],
        ));
        self.controllers.push(spawn(
            "kube-scheduler",
            vec![
                kc,
                "--leader-elect=false".into(),
                "--port=0".into(),
                "--secure-port=0".into(),
            ],
        ));
        self.admin().create_node("node-a").await;
    }

    /// A controller's log (`kube-controller-manager`, `kube-scheduler`).
    pub fn controller_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// The API server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its temporary directory (certificates, keys, log).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Its etcd.
    pub fn etcd(&self) -> &EtcdServer {
        &self.etcd
    }

    /// A client with the admin token.
    pub fn admin(&self) -> KubeClient {
        KubeClient::new(&self.url, &self.ca, &self.admin_token)
    }

    /// A client presenting `token`.
    pub fn client(&self, token: &str) -> KubeClient {
        KubeClient::new(&self.url, &self.ca, token)
    }

    /// Sends `sig` (SIGSTOP, SIGCONT) to the API server.
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("signal kube-apiserver");
    }

    /// `kill -9` of the API server (reaped); [`KubeApiServer::restart`] brings it back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the API server again after [`KubeApiServer::kill`], same port, same etcd, and
    /// waits until it is ready.
    ///
    /// # Panics
    /// When it does not become ready.
    pub async fn restart(&mut self) {
        let (bin, args) = &self.command;
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .expect("apiserver log");
        self.child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("respawning {}: {e}", bin.display()));
        let admin = self.admin();
        assert!(
            wait_ready(&mut self.child, &admin, &self.log).await,
            "kube-apiserver did not restart:\n{}",
            self.log_text()
        );
    }
}

/// Waits (90 s) until the API server answers a read of the `default` namespace (which it
/// creates itself once its bootstrap controllers ran); `false` when it exited or timed out.
async fn wait_ready(child: &mut Child, admin: &KubeClient, log: &Path) -> bool {
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            eprintln!(
                "kube-apiserver exited with {status}:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            return false;
        }
        let ready = admin
            .get::<serde_json::Value>("/api/v1/namespaces/default")
            .await;
        if ready.is_ok() {
            return true;
        }
        if t0.elapsed() > Duration::from_secs(90) {
            eprintln!(
                "kube-apiserver at {} not ready after 90 s ({:?})",
                admin.url,
                ready.err()
            );
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

impl Drop for KubeApiServer {
    fn drop(&mut self) {
        for c in &mut self.controllers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
