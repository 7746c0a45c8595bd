//! Self-drain (`control.self_drain`; docs/kubernetes.md, "Self-drain"): an engine pod's preStop
//! hook drains that pod's own engine through the router and waits until it may stop, with
//! nothing but the pod's bound service-account token.
//!
//! ```text
//!  POST /narwhal/self-drain  {"engine"?: iid}     Authorization: Bearer <pod's token>
//!  GET  /narwhal/self-drain                       (same token)
//!    TokenReview(token, audience)   ── not authenticated ──────────────────────► 401
//!    the pod it is bound to          ── none (not a pod-bound token) ───────────► 403
//!    GET the pod                     ── gone, or a new pod under the name ──────► 403
//!    its engines: URL host = podIP, port one of its container ports ── none ────► 403
//!    POST: a named engine not among them ──────────────────────────────────────► 403
//!    POST: the lifecycle drain of its engines (as /narwhal/lifecycle/drain answers)
//!    GET:  SelfDrainStatus {pod, engines, ready_to_stop}
//! ```
//!
//! The pod is read from the API server on every call rather than trusted from the token: the
//! API server still accepts a pod-bound token for a moment after its pod was deleted, so a token
//! whose pod is gone, or whose name now belongs to another pod (another UID), drains nothing. A
//! pod marked for deletion is the normal case (its preStop runs then) and may drain itself.

use std::collections::BTreeMap;
use std::time::Instant;

use http::StatusCode;
use narwhal_lease::kubernetes::api::{Failure, KubeApi};
use narwhal_shared::documents::SelfDrainStatus;
use serde::{Deserialize, Serialize};

use crate::config::{Config, SelfDrainSection};

/// The key TokenReview puts the bound pod's name under in `user.extra`.
const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
/// The key TokenReview puts the bound pod's UID under in `user.extra`.
const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";
/// The user name prefix of a service account (`system:serviceaccount:<ns>:<name>`).
const SA_USER_PREFIX: &str = "system:serviceaccount:";

/// How long one API call may take, seconds.
const API_TIMEOUT_S: f64 = 5.0;
/// TokenReviews in flight at once: a flood of requests with made-up tokens waits here instead
/// of loading the API server (and the router's own identity, which also keeps its lease).
const MAX_REVIEWS: usize = 8;
/// How long an accepted token's pod is kept (by the token's SHA-256), so a readiness probe
/// every few seconds costs one TokenReview per this period, not one per probe.
const REVIEW_CACHE: std::time::Duration = std::time::Duration::from_secs(10);
/// At most this many cached reviews; past it the cache is emptied.
const REVIEW_CACHE_MAX: usize = 4096;

/// A refused self-drain: the status to answer and why.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Refusal {
    /// 401, 403, 400, or 503 when the API server could not be asked.
    pub(crate) status: StatusCode,
    /// What to tell the caller.
    pub(crate) message: String,
}

fn refuse(status: StatusCode, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        message: message.into(),
    }
}

/// The pod a token is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PodRef {
    /// Its namespace (from the service account's user name).
    pub(crate) namespace: String,
    /// Its name.
    pub(crate) name: String,
    /// Its UID.
    pub(crate) uid: String,
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The self-drain's Kubernetes side: TokenReview and pod reads.
#[derive(Debug)]
pub(crate) struct SelfDrain {
    api: KubeApi,
    audience: String,
    deadline_s: f64,
    reviews: tokio::sync::Semaphore,
    /// Accepted tokens (SHA-256) and their pod, with when they were reviewed.
    reviewed: std::sync::Mutex<std::collections::HashMap<[u8; 32], (PodRef, Instant)>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct TokenReview<'a> {
    api_version: &'static str,
    kind: &'static str,
    spec: TokenReviewSpec<'a>,
}

#[derive(Serialize)]
struct TokenReviewSpec<'a> {
    token: &'a str,
    audiences: [&'a str; 1],
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenReviewAnswer {
    status: TokenReviewStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenReviewStatus {
    authenticated: bool,
    user: UserInfo,
    /// The audiences the token was accepted for (TokenReview asks clients to check it).
    audiences: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct UserInfo {
    username: String,
    extra: BTreeMap<String, Vec<String>>,
}

/// The members of a Pod the self-drain reads.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Pod {
    metadata: PodMeta,
    spec: PodSpec,
    status: PodStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PodMeta {
    uid: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PodSpec {
    containers: Vec<Container>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Container {
    ports: Vec<ContainerPort>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct ContainerPort {
    container_port: u16,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct PodStatus {
    phase: String,
    #[serde(rename = "podIP")]
    pod_ip: String,
    #[serde(rename = "podIPs")]
    pod_ips: Vec<PodIp>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PodIp {
    ip: String,
}

/// `POST /narwhal/self-drain`'s body: empty, or the one engine to drain.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct SelfDrainBody {
    /// One of the pod's engines; absent: all of them.
    pub(crate) engine: Option<String>,
}

impl SelfDrain {
    /// The self-drain of `section`, resolving its API access as a pod's (see
    /// [`KubeApi::resolve`]).
    ///
    /// # Errors
    /// `control.self_drain.<key>: <why>`.
    pub(crate) fn from_config(section: &SelfDrainSection) -> Result<SelfDrain, String> {
        let api = KubeApi::resolve(
            section.api_server.as_deref(),
            section.token_file.as_deref(),
            section.ca_file.as_deref(),
            std::time::Duration::from_secs_f64(API_TIMEOUT_S),
            |k| std::env::var(k).ok(),
        )
        .map_err(|e| format!("control.self_drain.{e}"))?;
        Ok(SelfDrain {
            api,
            audience: section.audience.clone(),
            deadline_s: section.deadline_s,
            reviews: tokio::sync::Semaphore::new(MAX_REVIEWS),
            reviewed: std::sync::Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// The drain deadline of a self-drain, seconds.
    pub(crate) fn deadline_s(&self) -> f64 {
        self.deadline_s
    }

    fn unavailable(&self, what: &str, f: &Failure) -> Refusal {
        refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{what} at {}: {f}", self.api.base()),
        )
    }

    /// The pod `token` is bound to, by TokenReview for this router's audience ([`MAX_REVIEWS`]
    /// at once; an accepted token is kept [`REVIEW_CACHE`] from `now`).
    ///
    /// # Errors
    /// 401 when the token is not accepted (expired, another audience, not a token);
    /// 403 when it is not bound to a pod; 503 when the API server could not be asked.
    pub(crate) async fn pod_of(&self, token: &str, now: Instant) -> Result<PodRef, Refusal> {
        let digest: [u8; 32] = ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
            .as_ref()
            .try_into()
            .unwrap_or([0; 32]);
        let cached = self
            .reviewed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&digest)
            .filter(|(_, at)| now.saturating_duration_since(*at) < REVIEW_CACHE)
            .map(|(pod, _)| pod.clone());
        if let Some(pod) = cached {
            return Ok(pod);
        }
        let _permit = self.reviews.acquire().await.map_err(|_| {
            refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "the router is shutting down",
            )
        })?;
        let pod = self.review(token).await?;
        let mut cache = self
            .reviewed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if cache.len() >= REVIEW_CACHE_MAX {
            cache.clear();
        }
        cache.insert(digest, (pod.clone(), now));
        Ok(pod)
    }

    /// One TokenReview of `token` (see [`SelfDrain::pod_of`]).
    async fn review(&self, token: &str) -> Result<PodRef, Refusal> {
        let review = TokenReview {
            api_version: "authentication.k8s.io/v1",
            kind: "TokenReview",
            spec: TokenReviewSpec {
                token,
                audiences: [&self.audience],
            },
        };
        let answer: TokenReviewAnswer = self
            .api
            .post("/apis/authentication.k8s.io/v1/tokenreviews", &review)
            .await
            .map_err(|f| self.unavailable("TokenReview", &f))?;
        let st = answer.status;
        // The API server's reason is kept for the log, not shown to a caller that may be anyone.
        if !st.authenticated || !(st.audiences.is_empty() || st.audiences.contains(&self.audience))
        {
            return Err(refuse(
                StatusCode::UNAUTHORIZED,
                format!(
                    "the token was not accepted for audience {:?}",
                    self.audience
                ),
            ));
        }
        let first = |k: &str| st.user.extra.get(k).and_then(|v| v.first()).cloned();
        let namespace = st
            .user
            .username
            .strip_prefix(SA_USER_PREFIX)
            .and_then(|rest| rest.split_once(':'))
            .map(|(ns, _)| ns.to_string());
        match (namespace, first(POD_NAME_EXTRA), first(POD_UID_EXTRA)) {
            (Some(namespace), Some(name), Some(uid)) => Ok(PodRef {
                namespace,
                name,
                uid,
            }),
            _ => Err(refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "{} is not bound to a pod: only a pod's projected service-account token \
                     (audience {:?}) may drain that pod's engine",
                    st.user.username, self.audience
                ),
            )),
        }
    }

    /// The engines of `pod` in `cfg` (indices), read from the live pod: its UID must be the
    /// token's, and an engine is the pod's when its URL's host is (or resolves to) the pod's IP
    /// and its port is one of the pod's container ports (any port when it declares none).
    ///
    /// # Errors
    /// 403 when the pod is gone, is another pod under the name, has no IP, or serves no engine
    /// of this fleet; 503 when the API server could not be asked.
    pub(crate) async fn engines_of(
        &self,
        cfg: &Config,
        pod: &PodRef,
    ) -> Result<Vec<usize>, Refusal> {
        let path = format!("/api/v1/namespaces/{}/pods/{}", pod.namespace, pod.name);
        let live: Pod = match self.api.get(&path).await {
            Ok(p) => p,
            Err(Failure::Server { status: 404, .. }) => {
                return Err(refuse(
                    StatusCode::FORBIDDEN,
                    format!("pod {pod} is gone: its token drains nothing"),
                ));
            }
            Err(Failure::Server { status: 403, .. }) => {
                tracing::warn!(%pod, "self-drain: the router may not read the pod (its RBAC)");
                return Err(refuse(
                    StatusCode::FORBIDDEN,
                    format!("the router may not read pod {pod}: its engines cannot be told"),
                ));
            }
            Err(f) => return Err(self.unavailable(&format!("reading pod {pod}"), &f)),
        };
        if live.status.phase != "Running" {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "pod {pod} is {:?}, not Running: its address may be another pod's now",
                    live.status.phase
                ),
            ));
        }
        if live.metadata.uid != pod.uid {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "pod {pod} is now another pod (uid {}, the token's is {}): its token \
                     drains nothing",
                    live.metadata.uid, pod.uid
                ),
            ));
        }
        let mut ips: Vec<String> = live
            .status
            .pod_ips
            .iter()
            .map(|p| p.ip.clone())
            .filter(|ip| !ip.is_empty())
            .collect();
        if ips.is_empty() && !live.status.pod_ip.is_empty() {
            ips.push(live.status.pod_ip.clone());
        }
        let ip = ips.join(", ");
        if ips.is_empty() {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                format!("pod {pod} has no IP yet: it serves no engine"),
            ));
        }
        let ports: Vec<u16> = live
            .spec
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().map(|p| p.container_port))
            .collect();
        let engines = engines_at(cfg, &ips, &ports).await?;
        if engines.is_empty() {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                format!("pod {pod} ({ip}) serves no engine of this fleet"),
            ));
        }
        Ok(engines)
    }
}

/// The engines whose URL's host is one of `ips`, or a name that resolves to one of them (a
/// StatefulSet pod's DNS name, a headless Service's), and whose port is one of `ports` (any
/// port when `ports` is empty). A name resolved through a ClusterIP Service gives the Service's
/// address, never a pod's: such an engine is no pod's (docs/kubernetes.md, "Self-drain").
/// Addresses compare in canonical form (`::ffff:10.0.0.5` is `10.0.0.5`).
///
/// # Errors
/// 503 when an engine's name cannot be resolved now (it may be this pod's).
async fn engines_at(cfg: &Config, ips: &[String], ports: &[u16]) -> Result<Vec<usize>, Refusal> {
    let want: Vec<std::net::IpAddr> = ips
        .iter()
        .filter_map(|ip| ip.parse::<std::net::IpAddr>().ok())
        .map(|a| a.to_canonical())
        .collect();
    if want.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for (i, e) in cfg.engines.iter().enumerate() {
        let Ok(url) = reqwest::Url::parse(&e.url) else {
            continue;
        };
        let Some(port) = url.port_or_known_default() else {
            continue;
        };
        if !ports.is_empty() && !ports.contains(&port) {
            continue;
        }
        let Some(host) = url.host_str() else { continue };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let matches = match host.parse::<std::net::IpAddr>() {
            Ok(a) => want.contains(&a.to_canonical()),
            Err(_) => {
                let resolved = tokio::time::timeout(
                    std::time::Duration::from_secs(2),
                    tokio::net::lookup_host((host, port)),
                )
                .await;
                match resolved {
                    Ok(Ok(addrs)) => {
                        let addrs: Vec<std::net::IpAddr> =
                            addrs.map(|a| a.ip().to_canonical()).collect();
                        // A name of several addresses (a Service's own name) is no one pod's.
                        addrs.len() == 1 && want.contains(&addrs[0])
                    }
                    Ok(Err(err)) => {
                        return Err(refuse(
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("engine {} ({host}) cannot be resolved now: {err}", e.iid),
                        ));
                    }
                    Err(_) => {
                        return Err(refuse(
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("engine {} ({host}) did not resolve within 2 s", e.iid),
                        ));
                    }
                }
            }
        };
        if matches {
            out.push(i);
        }
    }
    Ok(out)
}

/// The bearer token of an `Authorization` header.
///
/// # Errors
/// 401 when there is none.
pub(crate) fn bearer(headers: &http::HeaderMap) -> Result<String, Refusal> {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            refuse(
                StatusCode::UNAUTHORIZED,
                "no bearer token: send the pod's projected service-account token as \
                 Authorization: Bearer <token>",
            )
        })
}

/// The status document of `pod`'s `engines` from the lifecycle document `doc`.
pub(crate) fn status_of(
    doc: &narwhal_shared::documents::Lifecycle,
    pod: &PodRef,
    engines: &[String],
) -> SelfDrainStatus {
    let engines: BTreeMap<String, _> = engines
        .iter()
        .filter_map(|iid| doc.engines.get(iid).map(|e| (iid.clone(), e.clone())))
        .collect();
    SelfDrainStatus {
        pod: pod.to_string(),
        ready_to_stop: !engines.is_empty() && engines.values().all(|e| e.ready_to_stop),
        engines,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(urls: &[&str]) -> Config {
        let mut engines = Vec::new();
        for (i, u) in urls.iter().enumerate() {
            engines.push(serde_json::json!({"iid": format!("e{i}"), "url": u, "role": "decode"}));
        }
        let v = serde_json::json!({"schema": "narwhal.fleet", "schema_version": 2,
            "model": "m", "slo": {"ttft_s": 1, "tpot_s": 0.1}, "engines": engines});
        Config::from_json_str(&v.to_string(), &|_| None).unwrap()
    }

    #[tokio::test]
    async fn an_engine_is_the_pods_by_address_or_resolved_name_and_container_port() {
        let c = cfg(&[
            "http://127.0.0.1:8000",
            "http://localhost:8001",
            "http://127.0.0.2:8000",
            "http://[::1]:8000",
        ]);
        let at = |ips: &[&str]| ips.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
        assert_eq!(
            engines_at(&c, &at(&["127.0.0.1"]), &[8000]).await,
            Ok(vec![0])
        );
        // A name that resolves to the pod's IP (a StatefulSet pod's DNS name on a cluster).
        assert_eq!(
            engines_at(&c, &at(&["127.0.0.1"]), &[8001]).await,
            Ok(vec![1])
        );
        assert_eq!(
            engines_at(&c, &at(&["127.0.0.1"]), &[]).await,
            Ok(vec![0, 1])
        );
        // Dual stack: either of the pod's addresses; a mapped address is the plain one.
        assert_eq!(
            engines_at(&c, &at(&["10.0.0.9", "::1"]), &[8000]).await,
            Ok(vec![3])
        );
        assert_eq!(
            engines_at(&c, &at(&["::ffff:127.0.0.2"]), &[8000]).await,
            Ok(vec![2])
        );
        assert_eq!(
            engines_at(&c, &at(&["10.0.0.9"]), &[8000]).await,
            Ok(vec![])
        );
        assert_eq!(engines_at(&c, &at(&["not an ip"]), &[]).await, Ok(vec![]));
        // A name that does not resolve now may be this pod's: 503, not "no engine".
        let unresolvable = cfg(&["http://no-such-host.invalid:8000"]);
        let err = engines_at(&unresolvable, &at(&["10.0.0.9"]), &[8000])
            .await
            .unwrap_err();
        assert_eq!(err.status, StatusCode::SERVICE_UNAVAILABLE, "{err:?}");
    }
}
