//! The `narwhal-agent` binary: keygen and refusing to start on bad configuration (docs/agent.md).

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;

use narwhal_shared::PublicKey;

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_narwhal-agent"))
}

fn config(dir: &Path, key: &Path) -> std::path::PathBuf {
    let path = dir.join("agent.json");
    let doc = serde_json::json!({
        "schema": "narwhal.agent-config", "schema_version": 1,
        "agent_id": "gpu-test", "listen": "127.0.0.1:0",
        "tls": {"ca": dir.join("ca.pem"), "cert": dir.join("a.pem"), "key": dir.join("a.key")},
        "signing_key": key, "state_dir": dir.join("state"),
        "engines": [{"iid": "e0", "url": "http://127.0.0.1:9", "dialect": "vllm"}]
    });
    std::fs::write(&path, doc.to_string()).unwrap();
    path
}

#[test]
fn keygen_writes_a_0600_key_and_prints_its_public_key() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("agent.pk8");
    let out = agent()
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8(out.stdout).unwrap();
    let line = line.trim();
    assert!(line.starts_with("ed25519:"), "{line}");
    let pk = PublicKey::parse(line).unwrap();
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let loaded = narwhal_agent::load_signing_key(&key).unwrap();
    assert_eq!(loaded.public_key(), pk);
    // A second keygen must not silently replace the key.
    let again = agent()
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("signing_key"));
}

#[test]
fn a_key_readable_by_others_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("agent.pk8");
    assert!(
        agent()
            .args(["keygen", "--out"])
            .arg(&key)
            .output()
            .unwrap()
            .status
            .success()
    );
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let cfg = config(dir.path(), &key);
    let out = agent()
        .args(["run", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("signing_key"), "{err}");
    assert!(err.contains("0644"), "{err}");
    assert!(err.contains(key.to_str().unwrap()), "{err}");
    assert!(out.stdout.is_empty(), "must not announce a listener");
}

#[test]
fn a_bad_key_file_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("agent.pk8");
    std::fs::write(&key, b"-----BEGIN NOTHING-----").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let cfg = config(dir.path(), &key);
    let out = agent()
        .args(["run", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refusing to start"), "{err}");
    assert!(err.contains("signing_key"), "{err}");
    // A missing key is named too.
    let cfg = config(dir.path(), &dir.path().join("missing.pk8"));
    let out = agent()
        .args(["run", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.pk8"));
}

#[test]
fn unknown_and_invalid_config_keys_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.json");
    std::fs::write(
        &path,
        r#"{"schema": "narwhal.agent-config", "schema_version": 1, "agent_id": "a",
            "listen": "127.0.0.1:0", "tls": {"ca": "c", "cert": "c", "key": "k"},
            "signing_key": "k", "state_dir": "s",
            "engines": [{"iid": "e0", "url": "http://127.0.0.1:1", "dialect": "vllm", "rol": "x"}]}"#,
    )
    .unwrap();
    let out = agent()
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("engines[0]"), "{err}");
    assert!(err.contains("rol"), "{err}");
}

#[test]
fn missing_tls_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("agent.pk8");
    assert!(
        agent()
            .args(["keygen", "--out"])
            .arg(&key)
            .output()
            .unwrap()
            .status
            .success()
    );
    let cfg = config(dir.path(), &key);
    let out = agent()
        .args(["check-config", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tls.ca"), "{err}");
}
