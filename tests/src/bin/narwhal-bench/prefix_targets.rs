//! The targets of `narwhal-bench prefix`: how each starts (one of our routers, a peer, or
//! round robin by the bench itself), how it is waited for, and how a router is restarted in the
//! middle of a run (`--router-restart-at`).

#[allow(clippy::wildcard_imports)]
use super::*;

/// A started target: what keeps it alive (dropped: stopped).
pub(super) enum Running {
    Ours(Box<narwhal_testkit::RouterHandle>),
    Peer(PeerProc),
    Client,
}

pub(super) struct TargetDef {
    pub(super) name: String,
    pub(super) what: String,
    pub(super) peer: Option<PeerSpec>,
}

/// `--targets` and every `--peer` (aggregated, each name once), in order.
pub(super) fn target_defs(a: &Args) -> Result<Vec<TargetDef>, String> {
    let mut defs = Vec::new();
    for t in a
        .targets
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        let what = match t {
            "ours-exact" => "narwhal-serve, engines' kv_events in the fleet file",
            "ours-approx" => "narwhal-serve, no kv_events",
            "ours-blind" => "narwhal-serve, serving.kv_aware_placement false (placement by load)",
            "ours-tokens" => "narwhal-serve as ours-exact, serving.placement_load tokens",
            "round-robin" => "the bench itself, request i to engine i mod N",
            other => return Err(format!("--targets: unknown target {other:?}")),
        };
        defs.push(TargetDef {
            name: t.into(),
            what: what.into(),
            peer: None,
        });
    }
    for spec in &a.peers {
        let p = PeerSpec::parse(spec)?;
        if p.kind != PeerKind::Agg {
            return Err(format!("--peer {}: needs {{engine_urls}}", p.name));
        }
        if defs.iter().any(|d| d.name == p.name) {
            return Err(format!("--peer {}: the name is taken", p.name));
        }
        defs.push(TargetDef {
            name: p.name.clone(),
            what: String::new(),
            peer: Some(p),
        });
    }
    Ok(defs)
}

/// How target `def` starts over `sims` (a peer with its placeholders rendered, one of our
/// routers, or nothing for round robin), and a peer's rendered command.
pub(super) fn start_target(
    a: &Args,
    def: &TargetDef,
    dir: &std::path::Path,
    sims: &[SimHandle],
    events: &[Events],
    bin_dir: &str,
) -> Result<(Launch, Option<String>), String> {
    let urls: Vec<String> = sims.iter().map(|s| s.url.clone()).collect();
    let kv: Vec<Value> = events
        .iter()
        .map(|e| json!({"endpoint": e.endpoint, "replay_endpoint": e.replay}))
        .collect();
    Ok(match (def.name.as_str(), &def.peer) {
        (_, Some(p)) => {
            let pdir = dir.join(format!("peer-{}", p.name));
            std::fs::create_dir_all(&pdir).map_err(|e| e.to_string())?;
            let port = engine_port();
            let mut v: BTreeMap<&str, String> = BTreeMap::new();
            v.insert("port", port.to_string());
            v.insert("aux_port", engine_port().to_string());
            v.insert("host", "127.0.0.1".into());
            v.insert("model", MODEL.into());
            v.insert("dir", pdir.display().to_string());
            v.insert("bin_dir", bin_dir.to_string());
            v.insert("engine_url", urls[0].clone());
            v.insert("engine_urls", urls.join(" "));
            let pairs = |f: &dyn Fn(&Events) -> &str| {
                urls.iter()
                    .zip(events)
                    .map(|(u, e)| format!("{u}={}", f(e)))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            v.insert("kv_event_sources", pairs(&|e| &e.endpoint));
            v.insert("kv_event_replay_sources", pairs(&|e| &e.replay));
            let command = p.render(&v)?;
            let launch = Launch::Peer {
                name: p.name.clone(),
                command: command.clone(),
                dir: dir.to_path_buf(),
                url: format!("http://127.0.0.1:{port}"),
            };
            (launch, Some(command))
        }
        ("round-robin", None) => (Launch::Client, None),
        (name, None) => {
            let kv = match name {
                "ours-exact" | "ours-tokens" => Some(kv.clone()),
                _ => None,
            };
            let mut spec = ours_fleet(sims, kv, a);
            if name == "ours-blind" {
                spec = spec.with(json!({"serving": {"kv_aware_placement": false}}));
            }
            if name == "ours-tokens" {
                spec = spec.with(json!({"serving": {"placement_load": "tokens"}}));
            }
            let launch = Launch::Ours {
                dir: dir.to_path_buf(),
                name: name.to_string(),
                spec: Box::new(spec),
            };
            (launch, None)
        }
    })
}

/// How a target starts (owned, so a router restart can start it again on a blocking thread).
#[derive(Debug, Clone)]
pub(super) enum Launch {
    /// One of our routers: the fleet file written into `dir` under `name` (the same state
    /// file each time).
    Ours {
        dir: PathBuf,
        name: String,
        spec: Box<FleetSpec>,
    },
    /// A peer's rendered command, listening at `url`.
    Peer {
        name: String,
        command: String,
        dir: PathBuf,
        url: String,
    },
    /// Round robin by the bench itself.
    Client,
}

impl Launch {
    /// Starts it (blocking until our router prints its listening line): what keeps it alive
    /// and its URL (empty: round robin).
    pub(super) fn start(&self) -> Result<(Running, String), String> {
        match self {
            Launch::Ours { dir, name, spec } => {
                let r = start_router(dir, name, spec, &["--log-level", "warn"])
                    .map_err(|e| format!("router {name}: {e}"))?;
                let url = r.data.clone();
                Ok((Running::Ours(Box::new(r)), url))
            }
            Launch::Peer {
                name,
                command,
                dir,
                url,
            } => Ok((
                Running::Peer(PeerProc::spawn(name, command, dir)?),
                url.clone(),
            )),
            Launch::Client => Ok((Running::Client, String::new())),
        }
    }
}

/// Stops `running` as a deployment restarts a router: SIGTERM (our router finishes what it
/// serves), at most 30 s to exit, then SIGKILL.
pub(super) fn stop_gracefully(running: Running) {
    match running {
        Running::Ours(mut r) => {
            r.proc.signal(nix::sys::signal::Signal::SIGTERM);
            r.proc.wait_exit(Duration::from_secs(30));
        }
        Running::Peer(mut p) => {
            let group = nix::unistd::Pid::from_raw(-(p.pid as i32));
            let _ = nix::sys::signal::kill(group, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(30);
            while p.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Running::Client => {}
    }
}

/// Waits until every URL of `targets` completes a one-word prompt, within `--start-timeout`;
/// an error when target `def`'s peer process exits first.
pub(super) async fn wait_ready(
    a: &Args,
    def: &TargetDef,
    http: &reqwest::Client,
    running: &mut Running,
    targets: &[String],
) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs_f64(a.start_timeout);
    for t in targets {
        loop {
            if let Running::Peer(p) = running
                && let Some(st) = p.exited()
            {
                return Err(format!(
                    "peer {} exited ({st}): {}",
                    def.name,
                    p.log_tail(20)
                ));
            }
            let r = answers(http, t).await;
            if r.is_ok() {
                break;
            }
            if Instant::now() >= deadline {
                let tail = match &*running {
                    Running::Peer(p) => p.log_tail(20),
                    _ => String::new(),
                };
                return Err(format!(
                    "{} did not answer within {} s: {r:?} {tail}",
                    def.name, a.start_timeout
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// The target a trace is sent to: how it starts again (a router restart), what keeps it
/// running, and its URL (empty: round robin over the engines themselves).
pub(super) struct Target<'a> {
    pub(super) def: &'a TargetDef,
    pub(super) launch: &'a Launch,
    pub(super) running: &'a mut Running,
    pub(super) url: &'a str,
}

/// Restarts the target router on a blocking thread: requests meanwhile retry (`routed` holds
/// the old URL twice) until the new router listens, then go to it. Resolves to what keeps the
/// new one running and the seconds from the SIGTERM to its listening line.
pub(super) fn restart_router(
    target: &mut Target<'_>,
    routed: &Arc<Mutex<Vec<String>>>,
    http: &reqwest::Client,
) -> tokio::task::JoinHandle<Result<(Running, f64), String>> {
    let old = std::mem::replace(target.running, Running::Client);
    let launch = target.launch.clone();
    let routed = routed.clone();
    {
        let mut u = routed.lock().unwrap_or_else(|e| e.into_inner());
        let was = u[0].clone();
        *u = vec![was.clone(), was];
    }
    let http = http.clone();
    tokio::spawn(async move {
        let t0 = Instant::now();
        let (running, url) = tokio::task::spawn_blocking(move || {
            stop_gracefully(old);
            launch.start()
        })
        .await
        .map_err(|e| e.to_string())??;
        // Until it completes a one-word prompt, requests keep retrying (at the new URL).
        *routed.lock().unwrap_or_else(|e| e.into_inner()) = vec![url.clone(), url.clone()];
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if answers(&http, &url).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let down_s = t0.elapsed().as_secs_f64();
        *routed.lock().unwrap_or_else(|e| e.into_inner()) = vec![url];
        Ok((running, down_s))
    })
}

/// Whether `url` completes a one-word prompt (no full block: nothing cached, nothing stored);
/// the refusal or error otherwise.
async fn answers(http: &reqwest::Client, url: &str) -> Result<(), String> {
    let r = http
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 1}))
        .send()
        .await;
    match r {
        Ok(r) if r.status().is_success() => Ok(()),
        Ok(r) => Err(format!("status {}", r.status())),
        Err(e) => Err(e.to_string()),
    }
}
