//! The fleet file, starting `narwhal-serve`, and reading its documents (`/narwhal/state`,
//! `/narwhal/lifecycle`, `/narwhal/handoff`, `/ready`, `/health`, `/metrics`, the journal).
//! The control-plane documents are parsed into their types in `narwhal_shared::documents`
//! (`state()`, `lifecycle()`, `ready()`, ...); the `*_json` accessors give the same bodies as
//! JSON for tests that read them by key.

use crate::journal_rows::RequestRow;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use narwhal_shared::documents::{
    Envelope, Health, LIFECYCLE_SCHEMA, Lifecycle, LifecycleReply, Ready, State, state,
};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::agent::AgentHandle;
use crate::certs::DevCerts;
use crate::http::{Http, Reply};
use crate::proc::{
    ChildProc, ProcError, START_TIMEOUT, bin_path, eventually, read_json_file, write_file,
};
use crate::sim::SimHandle;
use crate::{WAIT, wait_until};

/// The fleet file a router is started with.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    /// Served model name.
    pub model: String,
    /// `vllm` or `sglang`.
    pub backend: String,
    /// `(iid, url, role)` per engine.
    pub engines: Vec<(String, String, String)>,
    /// Sections merged over the defaults (`serving`, `engine`, `recovery`, ...), key by key.
    pub overrides: Value,
    /// `engines[].agent` per engine id.
    pub agents: std::collections::BTreeMap<String, Value>,
    /// Engines with `pin: true` (never moved by the role controller).
    pub pins: std::collections::BTreeSet<String>,
    /// More `engines[]` keys per engine id (`health_path`, ...), merged into its entry.
    pub engine_keys: std::collections::BTreeMap<String, Value>,
}

impl FleetSpec {
    /// A fleet of `backend` (`vllm`, `sglang`) over `engines` (`(iid, url, role)`), serving the
    /// simulators' model `tiny-sim`, with no overrides, agents, pins or extra engine keys.
    pub fn new(backend: &str, engines: Vec<(String, String, String)>) -> Self {
        Self {
            model: "tiny-sim".into(),
            backend: backend.into(),
            engines,
            overrides: json!({}),
            agents: std::collections::BTreeMap::new(),
            pins: std::collections::BTreeSet::new(),
            engine_keys: std::collections::BTreeMap::new(),
        }
    }

    /// A fleet over running simulators.
    pub fn for_sims(backend: &str, sims: &[SimHandle]) -> Self {
        let engines = sims
            .iter()
            .map(|s| (s.iid.clone(), s.url.clone(), s.role.clone()))
            .collect();
        Self::new(backend, engines)
    }

    /// Pins engine `iid` (`engines[].pin`).
    pub fn pin(mut self, iid: &str) -> Self {
        self.pins.insert(iid.to_string());
        self
    }

    /// Merges `keys` (an object, e.g. `{"health_path": "/v1/models"}`) into engine `iid`'s
    /// `engines[]` entry.
    pub fn engine_with(mut self, iid: &str, keys: Value) -> Self {
        merge(
            self.engine_keys.entry(iid.to_string()).or_insert(json!({})),
            keys,
        );
        self
    }

    /// Pins engine `iid` to `agent` (its URL, certificate name and signing key).
    pub fn agent(mut self, iid: &str, agent: &AgentHandle) -> Self {
        self.agents.insert(
            iid.to_string(),
            json!({
                "url": agent.url,
                "server_name": agent.server_name,
                "public_key": agent.public_key,
                "agent_id": agent.agent_id,
            }),
        );
        self
    }

    /// Router-to-agent mutual TLS with the dev certificate `name` (`router`, `standby`).
    pub fn tls(self, certs: &DevCerts, name: &str) -> Self {
        self.with(json!({"tls": tls_section(certs, name)}))
    }

    /// Mutual TLS on the control listener (`control.tls`) with the dev certificate `name`.
    pub fn control_tls(self, certs: &DevCerts, name: &str) -> Self {
        self.with(json!({"control": {"tls": tls_section(certs, name)}}))
    }

    /// Merges `section` into the overrides (objects key by key, at every depth).
    pub fn with(mut self, section: Value) -> Self {
        merge(&mut self.overrides, section);
        self
    }

    /// The fleet document, schema `narwhal.fleet` version 2.
    pub fn to_json(&self, state_dir: &Path) -> Value {
        let mut doc = json!({
            "schema": "narwhal.fleet",
            "schema_version": 2,
            "model": self.model,
            "backend": self.backend,
            "engines": self.engines.iter().map(|(iid, url, role)| {
                let mut e = json!({"iid": iid, "url": url, "role": role});
                if let Some(a) = self.agents.get(iid) {
                    e["agent"] = a.clone();
                }
                if self.pins.contains(iid) {
                    e["pin"] = json!(true);
                }
                if let Some(k) = self.engine_keys.get(iid) {
                    merge(&mut e, k.clone());
                }
                e
            }).collect::<Vec<_>>(),
            "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
            "engine": {"first_token_timeout_s": 10.0, "decode_read_timeout_s": 10.0},
            "controller": {"monitor_interval_s": 0.2},
            "recovery": {"state_path": state_dir.join("state.json"), "readmit_every": 1},
        });
        merge(&mut doc, self.overrides.clone());
        doc
    }
}

fn tls_section(certs: &DevCerts, name: &str) -> Value {
    json!({"ca": certs.ca, "cert": certs.cert(name), "key": certs.key(name)})
}

/// Merges `from` into `into`: objects key by key at every depth, anything else replaced.
pub fn merge(into: &mut Value, from: Value) {
    match (into, from) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                match a.get_mut(&k) {
                    Some(slot) if slot.is_object() && v.is_object() => merge(slot, v),
                    _ => {
                        a.insert(k, v);
                    }
                }
            }
        }
        (slot, v) => *slot = v,
    }
}

/// A running `narwhal-serve`, with the clients its document helpers use.
#[derive(Debug)]
pub struct RouterHandle {
    /// The process (killed on drop).
    pub proc: ChildProc,
    /// Data listener base URL (`/v1/...`).
    pub data: String,
    /// Control listener base URL (`/narwhal/...`, `/metrics`).
    pub control: String,
    /// Request journal path.
    pub journal: PathBuf,
    /// Fleet file path.
    pub fleet: PathBuf,
    /// Its `--ready-file` document (`data`, `control`, `pid`, `run`).
    pub ready_doc: Value,
    /// The client of the document helpers (the fleet's operator identity, if any).
    pub http: Http,
    /// A client with short timeouts, for sampling a router that may be stopped.
    pub fast: Http,
    // Declared last: dropped after the process is killed.
    _tmp: Option<tempfile::TempDir>,
}

/// The ready file's `self_drain` member.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct ReadySelfDrain {
    self_drain: Option<String>,
}

impl RouterHandle {
    /// The self-drain listener's base URL (`control.self_drain`), from the ready file.
    ///
    /// # Panics
    /// When the router has none.
    pub fn self_drain_url(&self) -> String {
        <ReadySelfDrain as serde::Deserialize>::deserialize(&self.ready_doc)
            .ok()
            .and_then(|r| r.self_drain)
            .unwrap_or_else(|| panic!("no self_drain in the ready file: {}", self.ready_doc))
    }
}

/// Writes `fleet` into `dir` and starts `narwhal-serve` on loopback ports with `extra_args`.
///
/// # Errors
/// [`ProcError`] when the router does not start (its stderr tail is in the error).
pub fn start_router(
    dir: &Path,
    label: &str,
    fleet: &FleetSpec,
    extra_args: &[&str],
) -> Result<RouterHandle, ProcError> {
    launch_router(
        dir,
        label,
        &fleet.to_json(dir),
        extra_args,
        Clients::plain(),
    )
}

/// The two clients a [`RouterHandle`] reads documents with.
#[derive(Debug, Clone)]
pub struct Clients {
    /// Ordinary requests (60 s).
    pub http: Http,
    /// Sampling (150 ms).
    pub fast: Http,
}

impl Clients {
    /// Plain clients (no client certificate).
    pub fn plain() -> Clients {
        Clients {
            http: Http::new(Duration::from_secs(60)),
            fast: Http::new(Duration::from_millis(150)),
        }
    }

    /// Clients presenting the dev certificate `name` and trusting the fleet CA.
    pub fn identity(certs: &DevCerts, name: &str) -> Clients {
        Clients {
            http: Http::with_identity(certs, name, Duration::from_secs(60)),
            fast: Http::with_identity(certs, name, Duration::from_millis(150)),
        }
    }
}

/// Writes the fleet document `doc` into `dir` as `<label>.fleet.json` and starts
/// `narwhal-serve` on loopback ports (`--journal <label>.journal.jsonl`, `--ready-file
/// <label>.ready.json`, then `extra_args`), logging to `<label>.stderr.log`. Returns once the
/// router answered its listening line and finished its startup identity check.
///
/// # Errors
/// [`ProcError`] when the router does not start (its stderr tail is in the error).
pub fn launch_router(
    dir: &Path,
    label: &str,
    doc: &Value,
    extra_args: &[&str],
    clients: Clients,
) -> Result<RouterHandle, ProcError> {
    launch_router_env(dir, label, doc, extra_args, clients, &[])
}

/// [`launch_router`] with `env` added to the router's environment (for example
/// [`crate::faketime::wall_shifted`]).
///
/// # Errors
/// [`ProcError`] when the router does not start (its stderr tail is in the error).
pub fn launch_router_env(
    dir: &Path,
    label: &str,
    doc: &Value,
    extra_args: &[&str],
    clients: Clients,
    env: &[(String, String)],
) -> Result<RouterHandle, ProcError> {
    let fleet_path = dir.join(format!("{label}.fleet.json"));
    let journal = dir.join(format!("{label}.journal.jsonl"));
    let ready = dir.join(format!("{label}.ready.json"));
    let _ = std::fs::remove_file(&ready);
    // The state file goes into `dir` too: the default `runs/state.json` is relative to the
    // test's working directory, the source tree (tests write only under their own temporary
    // directories).
    let mut doc = doc.clone();
    if doc.pointer("/recovery/state_path").is_none() {
        let state = dir.join(format!("{label}.state.json"));
        merge(
            &mut doc,
            serde_json::json!({"recovery": {"state_path": state.to_string_lossy()}}),
        );
    }
    let text = serde_json::to_string_pretty(&doc).expect("fleet JSON serialises");
    write_file(&fleet_path, &text)?;
    let mut cmd = Command::new(bin_path("narwhal-serve"));
    cmd.arg("--fleet")
        .arg(&fleet_path)
        .args(["--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"])
        .arg("--journal")
        .arg(&journal)
        .arg("--ready-file")
        .arg(&ready)
        .args(extra_args)
        .envs(env.iter().map(|(k, v)| (k, v)));
    let proc = ChildProc::spawn(cmd, label, dir, START_TIMEOUT)?;
    let bad = || ProcError::BadLine {
        bin: "narwhal-serve".into(),
        line: proc.first_line.clone(),
    };
    let data = proc.url_in_first_line(Some("data")).ok_or_else(bad)?;
    let control = proc.url_in_first_line(Some("control")).ok_or_else(bad)?;
    wait_identity_check(&data);
    Ok(RouterHandle {
        proc,
        data,
        control,
        journal,
        fleet: fleet_path,
        ready_doc: read_json_file(&ready),
        http: clients.http,
        fast: clients.fast,
        _tmp: None,
    })
}

impl RouterHandle {
    /// A router over the fleet document `doc` in a temporary directory of its own (removed
    /// when the handle drops), with plain clients.
    ///
    /// # Panics
    /// When the router does not start.
    pub fn standalone(doc: &Value, extra_args: &[&str]) -> RouterHandle {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut r = launch_router(tmp.path(), "router", doc, extra_args, Clients::plain())
            .unwrap_or_else(|e| panic!("router: {e}"));
        r._tmp = Some(tmp);
        r
    }

    /// A router over `fleet` in a temporary directory of its own (removed when the handle
    /// drops), with plain clients.
    ///
    /// # Panics
    /// When the router does not start.
    pub fn over(fleet: &FleetSpec, extra_args: &[&str]) -> RouterHandle {
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut r = start_router(tmp.path(), "router", fleet, extra_args)
            .unwrap_or_else(|e| panic!("router: {e}"));
        r._tmp = Some(tmp);
        r
    }

    /// `GET <control><path>`.
    pub async fn get(&self, path: &str) -> Reply {
        self.http.get(format!("{}{path}", self.control)).await
    }

    /// `GET <data><path>`.
    pub async fn get_data(&self, path: &str) -> Reply {
        self.http.get(format!("{}{path}", self.data)).await
    }

    /// `POST <data><path>` with a JSON body (`/v1/completions`, `/v1/chat/completions`).
    pub async fn post_data(&self, path: &str, body: &Value) -> Reply {
        self.http.post(format!("{}{path}", self.data), body).await
    }

    /// [`RouterHandle::post_data`] keeping whatever body arrived before it ended or broke off.
    pub async fn post_data_partial(&self, path: &str, body: &Value) -> Reply {
        self.http
            .post_partial(format!("{}{path}", self.data), body)
            .await
    }

    /// A non-streaming completion of `prompt` (model `tiny-sim`), whatever its answer.
    pub async fn completion(&self, prompt: &str, max_tokens: u32) -> Reply {
        let body = json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": max_tokens});
        self.post_data("/v1/completions", &body).await
    }

    /// A non-streaming completion of 4 tokens that must answer 200 with tokens.
    pub async fn complete(&self, prompt: &str) {
        let r = self.completion(prompt, 4).await;
        let body = r.json_or_null();
        assert_eq!(r.status, 200, "completion {prompt:?}: {body}");
        assert!(
            body["usage"]["completion_tokens"].as_u64().unwrap_or(0) > 0,
            "{body}"
        );
    }

    /// `GET /narwhal/state`, parsed ([`State`]).
    ///
    /// # Panics
    /// When the body is not a state document.
    pub async fn state(&self) -> State {
        let r = self.get("/narwhal/state").await;
        whole(&r.what, &parse_document(&r.what, &r.text()))
    }

    /// The `ha` section of `/narwhal/state`.
    pub async fn ha(&self) -> state::Ha {
        self.state().await.ha
    }

    /// `GET /narwhal/handoff`.
    pub async fn handoff(&self) -> Value {
        self.get("/narwhal/handoff").await.json()
    }

    /// `GET /metrics` as text.
    pub async fn metrics(&self) -> String {
        self.get("/metrics").await.text()
    }

    /// `GET /ready` on the control listener: `(status, body)`.
    ///
    /// # Panics
    /// When the body is not a `/ready` document.
    pub async fn ready(&self) -> (u16, Ready) {
        let r = self.get("/ready").await;
        (r.status.as_u16(), parse_document(&r.what, &r.text()))
    }

    /// `GET /ready` on the control listener, which must answer 503; its body (`reason`,
    /// `control_ready`, ...).
    pub async fn not_ready(&self) -> Ready {
        let (status, body) = self.ready().await;
        assert_eq!(status, 503, "{}: {body:?}", self.proc.label);
        body
    }

    /// `GET /health` on the control listener: `(status, body)`.
    ///
    /// # Panics
    /// When the body is not a `/health` document.
    pub async fn health(&self) -> (u16, Health) {
        let r = self.get("/health").await;
        (r.status.as_u16(), parse_document(&r.what, &r.text()))
    }

    /// `GET /narwhal/lifecycle`, which must answer 200 with the lifecycle document.
    pub async fn lifecycle(&self) -> Lifecycle {
        let r = self.get("/narwhal/lifecycle").await;
        assert_eq!(r.status, 200, "{}: {}", r.what, r.text());
        let doc: Lifecycle = whole(&r.what, &parse_document(&r.what, &r.text()));
        assert!(doc.is_lifecycle(), "{}: {}", r.what, r.text());
        doc
    }

    /// Polls `/narwhal/lifecycle` until `ok(doc)` (for at most [`WAIT`]).
    ///
    /// # Panics
    /// When it never holds; the message shows the last document.
    pub async fn lifecycle_until(&self, what: &str, ok: impl Fn(&Lifecycle) -> bool) -> Lifecycle {
        let got = wait_until(WAIT, || async {
            let d = self.lifecycle().await;
            ok(&d).then_some(d)
        })
        .await;
        match got {
            Some(d) => d,
            None => panic!(
                "timed out waiting for {what}: {:#?}",
                self.lifecycle().await
            ),
        }
    }

    /// `POST /narwhal/lifecycle/<action>` with `body`: `(status, reply)`. Every reply must
    /// be the full lifecycle document (handoff-and-lifecycle.md, "Lifecycle API").
    pub async fn lifecycle_post(
        &self,
        action: &str,
        body: &impl serde::Serialize,
    ) -> (u16, LifecycleReply) {
        let body = serde_json::to_string(body).expect("a request body serialises");
        self.lifecycle_post_raw(action, &body).await
    }

    /// [`RouterHandle::lifecycle_post`] as JSON, for what a test reads by key.
    pub async fn lifecycle_post_json(&self, action: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.lifecycle_post_text(action, &body.to_string()).await;
        let doc: Value = parse_document("lifecycle reply", &text);
        (status, doc)
    }

    /// [`RouterHandle::lifecycle_post`] with a raw body (for malformed-body tests).
    pub async fn lifecycle_post_raw(&self, action: &str, body: &str) -> (u16, LifecycleReply) {
        let (status, text) = self.lifecycle_post_text(action, body).await;
        let raw: Value = parse_document("lifecycle reply", &text);
        (status, whole("lifecycle reply", &raw))
    }

    /// POSTs `body` to `/narwhal/lifecycle/<action>`: the status and the reply's text, which
    /// must be the full lifecycle document.
    async fn lifecycle_post_text(&self, action: &str, body: &str) -> (u16, String) {
        let url = format!("{}/narwhal/lifecycle/{action}", self.control);
        let r = self.http.post_raw(url, body).await;
        let text = r.text();
        let envelope: Envelope = parse_document(&r.what, &text);
        assert_eq!(
            envelope.schema, LIFECYCLE_SCHEMA,
            "every reply is the full document: {text}"
        );
        (r.status.as_u16(), text)
    }

    /// Journal rows parsed as JSON (header included).
    pub fn journal_rows(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.journal)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The request rows the router served with 200 (rows with a `rid`), oldest first, typed.
    pub fn served_requests(&self) -> Vec<RequestRow> {
        self.journal_rows()
            .into_iter()
            .filter(|r| r.get("rid").is_some())
            .filter_map(|r| serde_json::from_value::<RequestRow>(r).ok())
            .filter(|r| r.status == Some(200))
            .collect()
    }

    /// Whether the journal holds lifecycle event `action` (of engine `iid`, if given).
    pub fn has_event(&self, action: &str, iid: Option<&str>) -> bool {
        self.lifecycle_event_rows()
            .iter()
            .any(|e| e.action == action && iid.is_none_or(|i| e.iid == i))
    }

    /// Waits (at most [`WAIT`]) for lifecycle event `action` (of engine `iid`, if given),
    /// reading only the journal file, never the router; the event.
    ///
    /// # Panics
    /// When it never appears; the message lists the events.
    pub async fn journal_event(&self, action: &str, iid: Option<&str>) -> EngineEventRow {
        let found = wait_until(WAIT, || async {
            self.lifecycle_event_rows()
                .into_iter()
                .find(|e| e.action == action && iid.is_none_or(|i| e.iid == i))
        })
        .await;
        found.unwrap_or_else(|| {
            panic!(
                "no {action} {iid:?} event in the journal; events: {:#?}",
                self.lifecycle_event_rows()
            )
        })
    }

    /// A cheap handle for sampling this router from another task.
    pub fn probe(&self) -> RouterProbe {
        RouterProbe {
            control: self.control.clone(),
            fast: self.fast.clone(),
        }
    }

    /// `router.controls_fleet` of `/narwhal/lifecycle` ([`RouterProbe::controls`]).
    pub async fn controls(&self) -> Option<String> {
        self.probe().controls().await
    }

    /// Waits until [`RouterHandle::controls`] is `want`.
    ///
    /// # Panics
    /// When it is not within `within`; the message has the last answer and the log tail.
    pub async fn wait_controls(&self, want: &str, within: Duration) {
        let got = wait_until(within, || async {
            (self.controls().await.as_deref() == Some(want)).then_some(())
        })
        .await;
        assert!(
            got.is_some(),
            "{} never reported controls_fleet {want:?} within {within:?}; last: {:?}\n{}",
            self.proc.label,
            self.controls().await,
            self.proc.stderr_tail(20)
        );
    }

    /// Polls `/ready` (control listener) until 200, for at most `within`; the time since
    /// `since` when it was.
    pub async fn wait_ready(&self, since: Instant, within: Duration) -> Option<Duration> {
        let probe = self.probe();
        wait_until(within, || async {
            probe.ready_ok().await.then(|| since.elapsed())
        })
        .await
    }
}

/// A streaming completion through a router, read chunk by chunk.
#[derive(Debug)]
pub struct LiveStream {
    /// The response being read.
    pub resp: reqwest::Response,
    /// Everything read so far.
    pub text: String,
}

impl LiveStream {
    /// Reads to the end; asserts a clean finish (`data: [DONE]` last, no error frame).
    pub async fn finish(mut self) -> String {
        while let Some(c) = self.resp.chunk().await.expect("stream chunk") {
            self.text.push_str(&String::from_utf8_lossy(&c));
        }
        assert!(
            self.text.trim_end().ends_with("data: [DONE]"),
            "stream did not finish cleanly: {}",
            self.text
        );
        assert!(!self.text.contains("\"error\""), "{}", self.text);
        self.text
    }

    /// Reads until the stream ends or breaks off, whatever the ending.
    pub async fn drain(mut self) -> String {
        while let Ok(Some(c)) = self.resp.chunk().await {
            self.text.push_str(&String::from_utf8_lossy(&c));
        }
        self.text
    }
}

impl RouterHandle {
    /// Starts a streaming completion of `max_tokens` tokens and waits for its first token
    /// chunk (so its decode leg is resident on the decode engine).
    ///
    /// # Panics
    /// When the answer is not 200 or the stream ends before a token.
    pub async fn open_stream(&self, prompt: &str, max_tokens: u32) -> LiveStream {
        let resp = self
            .http
            .client()
            .post(format!("{}/v1/completions", self.data))
            .json(
                &json!({"model": "tiny-sim", "prompt": prompt, "max_tokens": max_tokens,
                          "stream": true}),
            )
            .send()
            .await
            .expect("stream request");
        assert_eq!(resp.status(), 200, "stream {prompt:?}");
        let mut s = LiveStream {
            resp,
            text: String::new(),
        };
        s.text = read_to_first_token(&mut s.resp).await;
        s
    }
}

/// Reads an SSE completion until its first token chunk; returns the text read.
///
/// # Panics
/// When the stream breaks or ends before a token.
pub(crate) async fn read_to_first_token(resp: &mut reqwest::Response) -> String {
    let mut text = String::new();
    while !text.contains("\"text\"") {
        let c = resp
            .chunk()
            .await
            .expect("stream chunk")
            .expect("stream ended before its first token");
        text.push_str(&String::from_utf8_lossy(&c));
    }
    text
}

/// A router's control listener and a short-timeout client: cloneable, for samplers.
#[derive(Debug, Clone)]
pub struct RouterProbe {
    /// Control listener base URL.
    pub control: String,
    /// Short-timeout client.
    pub fast: Http,
}

impl RouterProbe {
    /// `router.controls_fleet` of `/narwhal/lifecycle` (`active`, `standby`, `fenced`), or
    /// `None` when the router does not answer within the short timeout.
    pub async fn controls(&self) -> Option<String> {
        let r = self
            .fast
            .try_get(format!("{}/narwhal/lifecycle", self.control))
            .await?;
        let doc: Lifecycle = serde_json::from_slice(&r.body).ok()?;
        Some(doc.router.controls_fleet).filter(|c| !c.is_empty())
    }

    /// `/narwhal/state`, or `None` when the router does not answer 200 within the short
    /// timeout.
    pub async fn state(&self) -> Option<State> {
        let r = self
            .fast
            .try_get(format!("{}/narwhal/state", self.control))
            .await?;
        if r.status != 200 {
            return None;
        }
        serde_json::from_slice(&r.body).ok()
    }

    /// Whether `/ready` answers 200 within the short timeout.
    pub async fn ready_ok(&self) -> bool {
        self.fast
            .try_get(format!("{}/ready", self.control))
            .await
            .is_some_and(|r| r.status == 200)
    }
}

/// Parses `text` (the body of `what`) as `T`.
///
/// # Panics
/// When it is not JSON of that shape; the message shows the text.
pub fn parse_document<T: DeserializeOwned>(what: &str, text: &str) -> T {
    serde_json::from_str(text)
        .unwrap_or_else(|e| panic!("{what}: not the expected document ({e}): {text}"))
}

/// `raw` read as the document `T` whole: written back, it is `raw` again, so no member was
/// missing (and defaulted by a lenient reader), none unknown (and dropped), none of another
/// type. For the documents whose type is also the writer's (the shared lifecycle document,
/// ...), which read leniently for compatibility.
///
/// # Panics
/// When `raw` is not a `T`, or not all of it.
pub fn whole<T: DeserializeOwned + serde::Serialize>(what: &str, raw: &Value) -> T {
    let doc: T = serde_json::from_value(raw.clone())
        .unwrap_or_else(|e| panic!("{what}: not the expected document ({e}): {raw}"));
    let back = serde_json::to_value(&doc).expect("a document serialises");
    assert_eq!(
        &back, raw,
        "{what}: the typed reading is not the whole document (a member missing, unknown or \
         of another type)"
    );
    doc
}

/// Runs `narwhalctl --router <router> <args>` to completion.
///
/// # Panics
/// When the binary cannot be run.
pub fn narwhalctl<S: AsRef<OsStr>>(router: &str, args: &[S]) -> std::process::Output {
    Command::new(bin_path("narwhalctl"))
        .args(["--router", router])
        .args(args)
        .output()
        .expect("run narwhalctl")
}

/// Waits (at most 20 s) until a router with agents has finished its startup identity check:
/// its `/ready` reason is no longer "engine identity validation pending". Whatever readiness
/// it then has (ready, standby, held) is the test's to assert.
fn wait_identity_check(data: &str) {
    use std::io::{Read, Write};
    let Some(addr) = data.strip_prefix("http://") else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let answer = std::net::TcpStream::connect(addr).and_then(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(
                format!("GET /ready HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )?;
            let mut text = String::new();
            s.read_to_string(&mut text)?;
            Ok(text)
        });
        match answer {
            Ok(text) if !text.contains("engine identity validation pending") => return,
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Waits (at most `within`) until a handoff document at `path` parses and satisfies `pred`.
///
/// # Panics
/// When it does not.
pub async fn handoff_file_where(
    path: &Path,
    within: Duration,
    pred: impl Fn(&narwhal_shared::handoff::Handoff) -> bool,
) -> narwhal_shared::handoff::Handoff {
    eventually(
        &format!(
            "the state file {} to reach the expected content",
            path.display()
        ),
        within,
        || async {
            let text = std::fs::read_to_string(path).ok()?;
            let h = narwhal_shared::handoff::Handoff::parse(&text).ok()?;
            pred(&h).then_some(h)
        },
    )
    .await
}

/// An event row of the journal (docs/logging.md, "Journal rows") as the tests read it: the
/// engine events (`engine_ejected`, `engine_probe`, ...) and the lifecycle events
/// (`event: engine_lifecycle`, named by `action`; docs/http-api.md, lifecycle). A field the
/// event does not carry keeps its default (`""`, empty, `None`).
#[derive(Debug, Clone, PartialEq, Default, serde::Deserialize)]
#[serde(default)]
pub struct EngineEventRow {
    /// `engine_ejected`, `engine_lifecycle`, ...
    pub event: String,
    /// A lifecycle event's action (`drain_started`, `readmitted`, ...).
    pub action: String,
    /// Wall-clock Unix seconds.
    pub at: f64,
    /// The engine.
    pub iid: String,
    /// Why an engine was ejected or degraded.
    pub cause: String,
    /// How an ejected engine returned (`generation`, `lifecycle`).
    pub evidence: String,
    /// Why (`engine_identity_changed`, `restart_required`, `process_excluded`).
    pub reason: String,
    /// A probe's kind (`generation`, `stall`).
    pub kind: String,
    /// A probe's outcome (`passed`, `failed`).
    pub outcome: String,
    /// What failed (a probe, a validation, an identity capture); `None` when null or absent.
    pub error: Option<String>,
    /// A lifecycle event's wave, `""` when none.
    pub wave_id: String,
    /// A wave event's members.
    pub engines: Vec<String>,
    /// A lifecycle event's process start (Unix seconds).
    pub process_start: Option<f64>,
    /// Requests resident at `drain_deadline_exceeded`.
    pub resident: Option<u64>,
}

impl RouterHandle {
    /// The journal's event rows (rows with an `event`), oldest first, typed. The controller's
    /// rows whose details do not fit an [`EngineEventRow`] are left out.
    ///
    /// # Panics
    /// When an engine event (`engine_*`) does not parse: it is never left out.
    pub fn engine_event_rows(&self) -> Vec<EngineEventRow> {
        self.journal_rows()
            .into_iter()
            .filter_map(|r| {
                let event = r.get("event")?.as_str()?.to_string();
                match serde_json::from_value(r.clone()) {
                    Ok(row) => Some(row),
                    Err(e) if event.starts_with("engine_") => {
                        panic!("journal: {event} is not an event row ({e}): {r}")
                    }
                    Err(_) => None,
                }
            })
            .collect()
    }
}

/// The journal's first row, `{"meta": {...}}`: the fields the tests read.
#[derive(Debug, Clone, PartialEq, Default, serde::Deserialize)]
#[serde(default)]
pub struct JournalMeta {
    /// `narwhal.journal`.
    pub schema: String,
    /// The run id.
    pub run: Option<String>,
}

impl RouterHandle {
    /// Every request row of the journal (rows with a `rid`, any status), oldest first, typed.
    ///
    /// # Panics
    /// When a request row does not parse as a [`RequestRow`].
    pub fn request_rows(&self) -> Vec<RequestRow> {
        self.journal_rows()
            .into_iter()
            .filter(|r| r.get("rid").is_some())
            .map(|r| {
                serde_json::from_value(r.clone())
                    .unwrap_or_else(|e| panic!("journal request row ({e}): {r}"))
            })
            .collect()
    }

    /// Polls `/narwhal/state` (for at most [`WAIT`]) until it answers a state document for
    /// which `ok(state)`; that state.
    ///
    /// # Panics
    /// When it never does.
    pub async fn state_until(&self, what: &str, ok: impl Fn(&State) -> bool) -> State {
        let got = wait_until(WAIT, || async {
            let s = self.state().await;
            (s.is_state() && ok(&s)).then_some(s)
        })
        .await;
        got.unwrap_or_else(|| panic!("/narwhal/state never showed {what}"))
    }

    /// The `meta` of the journal's first row, `None` while the journal is empty or its first
    /// row is not a header.
    pub fn journal_meta(&self) -> Option<JournalMeta> {
        let first = self.journal_rows().into_iter().next()?;
        serde_json::from_value(first.get("meta")?.clone()).ok()
    }
}
