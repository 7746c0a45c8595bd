//! End-to-end tests of the HA handoff document and `--resume` (issue 5): real routers,
//! agents and simulators with mutual TLS; the router is killed with SIGKILL and a new one
//! resumes from `recovery.state_path`.

use std::path::Path;
use std::time::Duration;

use narwhal_shared::handoff::Handoff;
use narwhal_testkit::certs::{DevCerts, make_dev_certs};
use narwhal_testkit::{
    AgentHandle, EngineSpec, FleetSpec, RouterHandle, SimHandle, start_agent, start_router,
    start_sim, wait_until,
};
use serde_json::{Value, json};
use tempfile::TempDir;

struct Fleet {
    dir: TempDir,
    sims: Vec<SimHandle>,
    _agents: Vec<AgentHandle>,
    spec: FleetSpec,
    http: reqwest::Client,
}

fn http() -> reqwest::Client {
    narwhal_testkit::http_client()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("HTTP client")
}

/// p0 (prefill) and d0 (decode), each on its own simulated host with an agent.
fn fleet() -> Fleet {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs: DevCerts = make_dev_certs(
        &dir.path().join("certs"),
        &["router", "agent-h0", "agent-h1"],
    )
    .expect("certs");
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
    ];
    let a0 = start_agent(dir.path(), &certs, "h0", &[&sims[0]]).expect("agent h0");
    let a1 = start_agent(dir.path(), &certs, "h1", &[&sims[1]]).expect("agent h1");
    let spec = FleetSpec::for_sims("vllm", &sims)
        .tls(&certs, "router")
        .agent("p0", &a0)
        .agent("d0", &a1);
    Fleet {
        dir,
        sims,
        _agents: vec![a0, a1],
        spec,
        http: http(),
    }
}

fn state_path(dir: &Path) -> std::path::PathBuf {
    dir.join("state.json")
}

async fn get(http: &reqwest::Client, url: String) -> Value {
    http.get(url)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("JSON")
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = http.post(url).json(&body).send().await.expect("POST");
    let status = r.status().as_u16();
    (status, r.json().await.expect("JSON"))
}

async fn serve_some(http: &reqwest::Client, router: &RouterHandle, n: usize) {
    for i in 0..n {
        let r = http
            .post(format!("{}/v1/completions", router.data))
            .json(
                &json!({"model": "tiny-sim", "prompt": format!("resume me {i}"), "max_tokens": 3}),
            )
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200);
    }
}

/// Waits until the state file holds a document satisfying `pred`.
async fn state_file_where(dir: &Path, pred: impl Fn(&Handoff) -> bool) -> Handoff {
    wait_until(Duration::from_secs(10), || async {
        let text = std::fs::read_to_string(state_path(dir)).ok()?;
        let h = Handoff::parse(&text).ok()?;
        pred(&h).then_some(h)
    })
    .await
    .expect("state file reached the expected content")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_validates_round_trips_and_resume_restores_totals_and_holds() {
    let f = fleet();
    let mut a = start_router(f.dir.path(), "router-a", &f.spec, &[]).expect("router a");
    // Ready only after every engine's identity was checked through its agent.
    let ready = f
        .http
        .get(format!("{}/ready", a.data))
        .send()
        .await
        .expect("ready");
    assert_eq!(ready.status(), 200);
    let lc = get(&f.http, format!("{}/narwhal/lifecycle", a.control)).await;
    for iid in ["p0", "d0"] {
        assert!(
            lc["process_starts"][iid].is_f64(),
            "{iid}'s start accepted before ready: {lc}"
        );
    }
    serve_some(&f.http, &a, 5).await;
    // Drain d0 (restart required) so the handoff carries a lifecycle hold.
    let (s, doc) = post(
        &f.http,
        format!("{}/narwhal/lifecycle/drain", a.control),
        json!({"engines": ["d0"], "deadline_s": 60}),
    )
    .await;
    assert_eq!(s, 200, "{doc}");
    let live = get(&f.http, format!("{}/narwhal/handoff", a.control)).await;
    let h = Handoff::from_value(live.clone()).expect("the live handoff validates");
    assert_eq!(h.schema, "narwhal.handoff");
    assert_eq!(h.schema_version, 1);
    assert_eq!(h.engines, ["d0", "p0"], "sorted");
    assert_eq!((h.epoch, h.holder.as_str()), (0, ""));
    for c in [
        "served",
        "failed",
        "unserved",
        "refused",
        "rejected",
        "cancelled",
        "offered",
        "expired",
        "invalid_requests",
        "slo_met",
        "unsized_offered",
    ] {
        assert!(h.counters.contains_key(c), "counter {c} missing: {live}");
    }
    assert_eq!(h.counters["served"], 5);
    assert!(h.demand_risk.is_none());
    assert_eq!(
        serde_json::to_value(&h).expect("serialise"),
        live,
        "round trip"
    );
    let saved = state_file_where(f.dir.path(), |h| {
        h.counters["served"] == 5
            && h.lifecycle
                .records
                .iter()
                .any(|r| r.iid == "d0" && r.old_process_start.is_some())
    })
    .await;
    let old_start = saved.lifecycle.records[0].old_process_start;
    // kill -9: no graceful shutdown, no final write.
    a.proc.kill();
    let b = start_router(f.dir.path(), "router-b", &f.spec, &["--resume"]).expect("router b");
    let st = get(&f.http, format!("{}/narwhal/state", b.control)).await;
    assert_eq!(st["served"], 5, "totals restored: {st}");
    assert_eq!(st["offered"], 5, "{st}");
    assert_eq!(st["ha"]["resume"]["refused"], false, "{st}");
    let lc = get(&f.http, format!("{}/narwhal/lifecycle", b.control)).await;
    let d0 = &lc["engines"]["d0"];
    assert_eq!(d0["state"], "drained", "the hold survives: {lc}");
    assert_eq!(d0["accepts_new"], false, "{lc}");
    assert_eq!(d0["old_process_start"], json!(old_start), "{lc}");
    assert_eq!(
        d0["resident"]["decode"], 0,
        "resident tracking starts fresh: {lc}"
    );
    let m = b.metrics(&f.http).await.expect("metrics");
    assert!(
        m.lines()
            .any(|l| l.starts_with("narwhal_served_total") && l.ends_with(" 5")),
        "metrics continue from the restored totals: {m}"
    );
    // The restored hold is a real hold: readmission needs the restart, then succeeds.
    let (s, doc) = post(
        &f.http,
        format!("{}/narwhal/lifecycle/readmit", b.control),
        json!({"engines": ["d0"]}),
    )
    .await;
    assert_eq!(s, 409, "{doc}");
    let mut f = f;
    f.sims[1].restart(&[]).expect("restart d0");
    let (s, doc) = post(
        &f.http,
        format!("{}/narwhal/lifecycle/readmit", b.control),
        json!({"engines": ["d0"]}),
    )
    .await;
    assert_eq!(s, 200, "{doc}");
    serve_some(&f.http, &b, 2).await;
    let st = get(&f.http, format!("{}/narwhal/state", b.control)).await;
    assert_eq!(st["served"], 7, "{st}");
}

/// A torn file, a document with a bad field and a document for another fleet are each refused
/// with a reason naming what is wrong; the file is moved aside (never overwritten), and with
/// an agent on every engine the router holds the fleet in a restart-required wave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_refuses_torn_invalid_and_foreign_documents() {
    let f = fleet();
    let a = start_router(f.dir.path(), "router-a", &f.spec, &[]).expect("router a");
    serve_some(&f.http, &a, 1).await;
    let good = get(&f.http, format!("{}/narwhal/handoff", a.control)).await;
    drop(a);
    let text = serde_json::to_string(&good).expect("json");
    let mut bad_epoch = good.clone();
    bad_epoch["epoch"] = json!(-1);
    let mut foreign = good.clone();
    foreign["engines"] = json!(["e0", "e9"]);
    foreign["roles"] = json!({});
    foreign["lifecycle"]["process_starts"] = json!({});
    let mut other_model = good.clone();
    other_model["model"] = json!("another-model");
    let cases: [(&str, String, &str); 4] = [
        ("torn", text[..text.len() / 2].to_string(), "not JSON"),
        ("bad field", bad_epoch.to_string(), "epoch"),
        ("foreign fleet", foreign.to_string(), "handoff names"),
        ("foreign model", other_model.to_string(), "model"),
    ];
    for (i, (name, content, want)) in cases.into_iter().enumerate() {
        let path = state_path(f.dir.path());
        std::fs::write(&path, &content).expect("write state file");
        let r = start_router(f.dir.path(), &format!("router-{i}"), &f.spec, &["--resume"])
            .expect("router starts despite a bad state file");
        let st = get(&f.http, format!("{}/narwhal/state", r.control)).await;
        let reason = st["ha"]["resume"]["reason"].as_str().unwrap_or_default();
        assert_eq!(st["ha"]["resume"]["refused"], true, "{name}: {st}");
        assert!(
            reason.contains(want),
            "{name}: reason {reason:?} lacks {want:?}"
        );
        assert_eq!(st["served"], 0, "{name}: nothing applied: {st}");
        let aside = f.dir.path().join("state.json.refused");
        assert_eq!(
            std::fs::read_to_string(&aside).expect("refused file kept"),
            content,
            "{name}: the refused file is kept intact"
        );
        let ready = f
            .http
            .get(format!("{}/ready", r.control))
            .send()
            .await
            .expect("ready");
        assert_eq!(ready.status(), 503, "{name}");
        let body: Value = ready.json().await.expect("json");
        let why = body["reason"].as_str().unwrap_or_default();
        assert!(
            why.starts_with("whole-wave restart required: handoff rejected:"),
            "{name}: {body}"
        );
        let lc = get(&f.http, format!("{}/narwhal/lifecycle", r.control)).await;
        assert_eq!(lc["engines"]["p0"]["state"], "blocked", "{name}: {lc}");
        assert_eq!(lc["wave"]["active"], true, "{name}: {lc}");
        std::fs::remove_file(&aside).ok();
    }
}

/// A record that was `validating` when the router died comes back `blocked` with the
/// reference's error, out of placement, and can be readmitted without a new drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_validation_is_restored_as_blocked() {
    let f = fleet();
    let a = start_router(f.dir.path(), "router-a", &f.spec, &[]).expect("router a");
    let mut doc = get(&f.http, format!("{}/narwhal/handoff", a.control)).await;
    drop(a);
    doc["lifecycle"]["records"] = json!([{
        "iid": "d0", "state": "validating", "requested_at": 1.0e9, "deadline_at": 1.0e9,
        "restart_required": true, "wave_id": "", "old_process_start": 1.0,
        "new_process_start": null, "error": "", "checks": []
    }]);
    std::fs::write(state_path(f.dir.path()), doc.to_string()).expect("write");
    let b = start_router(f.dir.path(), "router-b", &f.spec, &["--resume"]).expect("router b");
    let lc = get(&f.http, format!("{}/narwhal/lifecycle", b.control)).await;
    let d0 = &lc["engines"]["d0"];
    assert_eq!(d0["state"], "blocked", "{lc}");
    assert_eq!(
        d0["error"],
        "readmission validation was interrupted by router replacement"
    );
    assert_eq!(d0["accepts_new"], false);
    // The running d0 started after `old_process_start` (1.0): readmission passes.
    let (s, doc) = post(
        &f.http,
        format!("{}/narwhal/lifecycle/readmit", b.control),
        json!({"engines": ["d0"]}),
    )
    .await;
    assert_eq!(s, 200, "{doc}");
    assert_eq!(doc["engines"]["d0"]["state"], "active");
}
