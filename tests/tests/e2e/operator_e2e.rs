//! Errors that say what to do, and lifecycle ergonomics (docs/operate.md), with the
//! real binaries on loopback:
//!
//! - a file the fleet file names that cannot be used stops `narwhal-serve` before it listens:
//!   exit 2, nothing on stdout, no ready file, the key named; `check-config` says the same
//!   without binding, and names a directory the run could not write;
//! - a router fenced by agents that remember a newer epoch (after an HA run, started with
//!   `lease: none`) names the cause in `/ready`, `/narwhal/state` and `narwhalctl`, and the
//!   reset documented in docs/operate.md (`narwhal-agent fence reset`) brings it back;
//! - `cancel-drain` returns an un-restarted engine after the checks, with its own events, and
//!   refuses a restarted one (which readmission takes); a drain of a role's only
//!   live engine says how traffic is served meanwhile.
#![allow(clippy::disallowed_methods)] // tests read the clock for deadlines

use std::path::Path;
use std::process::Command;

use narwhal_shared::documents::requests::{DrainBody, ReadmitBody};
use narwhal_shared::handoff::DrainState;
use narwhal_testkit::{
    ById, Clients, EngineSpec, Fleet, FleetSpec, LeaseBackend, WAIT, bin_path, eventually,
    launch_router, metric, narwhalctl, start_sim,
};
use serde_json::{Value, json};

/// `narwhal-serve` with `args`, run to completion: (exit code, stdout, stderr).
fn serve(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin_path("narwhal-serve"))
        .args(args)
        .env_remove("NARWHAL_FLEET")
        .output()
        .expect("run narwhal-serve");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write_fleet(dir: &Path, name: &str, doc: &Value) -> String {
    let p = dir.join(name);
    std::fs::write(&p, doc.to_string()).expect("fleet file");
    p.to_string_lossy().into_owned()
}

/// A readmission or cancel-drain body naming `iids`.
fn engines(iids: &[&str]) -> ReadmitBody {
    ReadmitBody {
        engines: iids.iter().map(|i| i.to_string()).collect(),
        wave: false,
    }
}

/// A missing TLS file was found only after the `listening` line and the ready file (exit 1); the
/// unit's `RestartPreventExitStatus=2` needs exit 2 before anything is bound or printed.
/// `check-config` reports the same problems, and directories the run would write in.
#[test]
fn an_unusable_file_stops_the_router_before_it_listens_and_check_config_names_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sims = vec![
        start_sim(dir.path(), &EngineSpec::new("p0", "prefill"), "vllm").expect("p0"),
        start_sim(dir.path(), &EngineSpec::new("d0", "decode"), "vllm").expect("d0"),
    ];
    let spec = FleetSpec::for_sims("vllm", &sims);
    let good = spec.to_json(dir.path());
    let good_path = write_fleet(dir.path(), "good.json", &good);
    let missing = dir.path().join("nowhere");
    let bad = spec
        .clone()
        .with(json!({
            "control": {"tls": {"ca": missing.join("ca.pem"), "cert": missing.join("c.pem"),
                                "key": missing.join("c.key")}},
            "tls": {"ca": missing.join("ca.pem"), "cert": missing.join("r.pem"),
                    "key": missing.join("r.key")},
            "engine": {"tokenizer": missing},
        }))
        .to_json(dir.path());
    let bad_path = write_fleet(dir.path(), "bad.json", &bad);
    let ready = dir.path().join("ready.json");
    let ready_s = ready.to_string_lossy().into_owned();
    let (code, stdout, stderr) = serve(&[
        "--fleet",
        &bad_path,
        "--listen",
        "127.0.0.1:0",
        "--control-listen",
        "127.0.0.1:0",
        "--journal",
        &dir.path().join("j.jsonl").to_string_lossy(),
        "--ready-file",
        &ready_s,
    ]);
    assert_eq!(code, 2, "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.is_empty(), "nothing on stdout: {stdout}");
    assert!(!ready.exists(), "no ready file before the checks pass");
    for key in [
        "tls.ca: cannot read",
        "control.tls.ca: cannot read",
        "engine.tokenizer: ",
    ] {
        assert!(stderr.contains(key), "{key}: {stderr}");
    }
    assert!(
        stderr.contains(&format!("{}", missing.join("tokenizer.json").display())),
        "the tokenizer's file named: {stderr}"
    );

    // check-config: the same problems, exit 2, nothing bound or written.
    let (code, stdout, stderr) = serve(&["check-config", "--fleet", &bad_path]);
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("control.tls.ca: cannot read"), "{stderr}");
    assert!(stderr.contains("engine.tokenizer: "), "{stderr}");
    // A good fleet: one summary line, exit 0; the run's flags are checked too.
    let (code, stdout, stderr) = serve(&["check-config", "--fleet", &good_path]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains(" ok: 2 engine(s), 0 with an agent, backend vllm, lease none"),
        "{stdout}"
    );
    let (code, _, stderr) = serve(&[
        "check-config",
        "--fleet",
        &good_path,
        "--standby-of",
        "http://127.0.0.1:1",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--standby-of needs a lease"), "{stderr}");
    // A lease directory the run could not write (a ProtectSystem sandbox, a read-only mount):
    // /proc takes no new files, even from root.
    let lease = spec
        .clone()
        .with(json!({"lease": {"backend": "file", "path": "/proc/narwhal-test/router.lease"}}))
        .to_json(dir.path());
    let lease_path = write_fleet(dir.path(), "lease.json", &lease);
    let (code, _, stderr) = serve(&["check-config", "--fleet", &lease_path]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("lease.path: cannot create files in /proc")
            && stderr.contains("ReadWritePaths"),
        "{stderr}"
    );
    // Two engines naming one KV-event socket: one would be credited with the other's blocks
    // while shown `exact`; refused naming both.
    let mut crossed = spec.clone();
    for iid in ["p0", "d0"] {
        crossed = crossed.engine_with(
            iid,
            json!({"kv_events": {"endpoint": "tcp://127.0.0.1:5557"}}),
        );
    }
    let crossed = crossed.to_json(dir.path());
    let crossed_path = write_fleet(dir.path(), "crossed.json", &crossed);
    let (code, _, stderr) = serve(&["check-config", "--fleet", &crossed_path]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("engines[1].kv_events.endpoint")
            && stderr.contains("engines[0].kv_events.endpoint"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("j.jsonl").exists(),
        "check-config and the refused run wrote no journal"
    );
}

/// Agents that accepted an HA router's epoch fence a router started with `lease: none` (epoch 0).
/// Before: `/ready` said "lease held by another router" (there is no lease) and narwhalctl only
/// "this router does not control the fleet". Now the cause and the remedy are named everywhere an
/// operator looks, and the documented reset works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_fenced_by_a_stale_epoch_names_the_agent_and_the_documented_reset_clears_it() {
    let mut f = Fleet::builder()
        .prefill(1)
        .decode(1)
        .agents()
        .lease(LeaseBackend::File)
        .start()
        .await;
    let epoch = f.router().ha().await.epoch;
    assert!(epoch >= 1);
    // The HA router checked every identity at startup, presenting its epoch to both agents.
    f.router_mut().proc.kill();
    let mut doc = f
        .spec("nolease", "router")
        .with(json!({"recovery": {"state_path": f.dir().join("nolease.state.json")}}))
        .to_json(f.dir());
    // The lease section replaced whole (not merged: no file lease keys are left behind).
    doc.as_object_mut()
        .expect("a fleet document")
        .insert("lease".into(), json!({"backend": "none"}));
    let clients = Clients::identity(f.certs(), "operator");
    let r = launch_router(f.dir(), "nolease", &doc, &[], clients.clone()).expect("router");
    let ready = eventually("the router is fenced by the agents", WAIT, || async {
        let (status, ready) = r.ready().await;
        (status == 503 && ready.reason.starts_with("fenced by agent")).then_some(ready)
    })
    .await;
    let reason = ready.reason;
    for part in [
        format!("accepted router epoch {epoch}"),
        "presents epoch 0".into(),
        "lease.backend none".into(),
        "narwhal-agent fence reset".into(),
    ] {
        assert!(reason.contains(&part), "{part}: {reason}");
    }
    assert_eq!(r.ha().await.blocked, reason);
    assert_eq!(r.health().await.1.status, "fenced");
    let out = narwhalctl(&r.control, &["status"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("not ready: {reason}")),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = narwhalctl(&r.control, &["drain", "p0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("does not control the fleet (router not ready: fenced by agent"),
        "a 503 names why: {stderr}"
    );

    // docs/operate.md: stop each agent, `narwhal-agent fence reset`, start it, restart the router.
    drop(r);
    for id in ["h0", "h1"] {
        let agent = f.agent_mut(id);
        agent.proc.kill();
        let out = Command::new(bin_path("narwhal-agent"))
            .args(["fence", "reset", "--config"])
            .arg(&agent.config)
            .output()
            .expect("fence reset");
        assert!(
            out.status.success(),
            "{id}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        agent.restart(None).expect("agent restart");
    }
    let r = launch_router(f.dir(), "nolease", &doc, &[], clients).expect("router again");
    eventually("the reset fleet is controlled again", WAIT, || async {
        (r.ready().await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(r.completion("after the reset", 2).await.status, 200);
}

/// Before, an engine drained by mistake could only return through a restart (a readmission without
/// one leaves it `blocked`). `cancel-drain` validates the same process and returns it, with its own
/// journal events; a restarted engine is refused (the readmission of handoff-and-lifecycle.md is
/// for it). A drain of a role's only live engine warns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_drain_returns_the_same_process_and_a_sole_engine_drain_warns() {
    let mut f = Fleet::builder().prefill(2).decode(1).agents().start().await;
    let control = f.router().control.clone();
    let r = f.router();
    let (status, doc) = r.drain(&DrainBody::engine("p1", 30.0)).await;
    assert_eq!(status, 200, "{doc:#?}");
    assert_eq!(doc.warnings, Some(vec![]), "p0 still serves prefill");
    r.engine_state_until("p1", DrainState::Drained).await;
    let out = narwhalctl(&control, &["cancel-drain", "p1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("p1: checks passed: health, attestation")
            && stdout.contains("process identity")
            && !stdout.contains("new process identity"),
        "{stdout}"
    );
    assert!(stdout.contains("p1: drain cancelled"), "{stdout}");
    let lc = r.lifecycle().await;
    let p1 = &lc.engines.of("p1");
    assert_eq!(p1.state, DrainState::Active, "{lc:#?}");
    assert!(p1.accepts_new, "{lc:#?}");
    assert_eq!(p1.new_process_start, p1.old_process_start);
    r.journal_event("drain_cancel_started", Some("p1")).await;
    let ev = r.journal_event("drain_cancelled", Some("p1")).await;
    assert_eq!(ev.process_start, p1.old_process_start, "{ev:?}");
    assert!(!r.has_event("readmitted", Some("p1")), "not a readmission");
    let m = r.metrics().await;
    assert_eq!(
        metric(
            &m,
            "narwhal_lifecycle_validations_total",
            &["iid=\"p1\"", "kind=\"cancel_drain\"", "result=\"passed\""]
        ),
        Some(1.0),
        "{m}"
    );

    // d0 is the only decode engine: the drain says so, and requests are served aggregated.
    let out = narwhalctl(&control, &["drain", "d0"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains(
            "warning: d0 was the only live decode engine: until a decode engine returns, requests are served aggregated on the prefill engines"
        ),
        "{stdout}"
    );
    assert_eq!(f.router().completion("aggregated", 2).await.status, 200);
    f.router()
        .engine_state_until("d0", DrainState::Drained)
        .await;

    // A restarted engine is not a cancel: refused, and readmission takes it.
    f.sim_mut("d0").restart(&[]).expect("restart d0");
    let r = f.router();
    let (status, doc) = r.cancel_drain(&engines(&["d0"])).await;
    assert_eq!(status, 409, "{doc:#?}");
    assert!(
        doc.document
            .engine("d0")
            .is_some_and(|e| e.error.contains("engine process restarted since the drain")),
        "{doc:#?}"
    );
    let (status, doc) = r.readmit_engine("d0").await;
    assert_eq!(status, 200, "{doc:#?}");
    // Rules: a wave, an active engine.
    let wave = ReadmitBody {
        wave: true,
        ..ReadmitBody::default()
    };
    let (status, doc) = r.cancel_drain(&wave).await;
    assert_eq!(status, 409, "{doc:#?}");
    let (status, doc) = r.cancel_drain(&engines(&["p0"])).await;
    assert_eq!(status, 409, "{doc:#?}");
    assert!(doc.document.error.starts_with("p0 is active"), "{doc:#?}");
}
