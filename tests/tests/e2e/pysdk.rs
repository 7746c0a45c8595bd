//! The Python side of the end-to-end tests that use third-party software: the cached virtualenv
//! built by `tests/python/ensure-venv.sh` (official `openai` SDK, llama-cpp-python's server,
//! `gguf`), and `tests/python/sdk_driver.py`, which sends requests through the SDK and reports
//! what the SDK saw as JSON.
//!
//! The venv is set up on demand: a test that finds it missing runs
//! `tests/python/ensure-venv.sh` (which builds under its own `flock`, so concurrent tests and
//! test binaries wait for one build and reuse it; minutes the first time, as llama.cpp
//! compiles), so `cargo test --workspace` on a fresh machine needs nothing else
//! (docs/testing.md). A venv that cannot be built fails the test; it never passes by skipping.
//!
//! The one way out is explicit, and decided when the tests are built: `NARWHAL_SKIP_VENV=1`
//! (never honoured with `CI` or `NARWHAL_REQUIRE_VENV` set, nor with `NARWHAL_PY_VENV` given)
//! makes the test kit's build script (`tests/build.rs`) set the cfg `narwhal_skip_venv`, and
//! every test that needs the venv carries `#[cfg_attr(narwhal_skip_venv, ignore = "...")]`: the
//! harness reports each as `ignored` with the reason, never as `ok`. A test that runs all the
//! same (`--ignored`, or a binary built without the variable) uses the venv: nothing here
//! returns early.
//!
//! Shared by `sdk_e2e.rs`, `llamacpp_e2e.rs` and `kv_events_e2e.rs`; each uses a part of it.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tokio::io::AsyncWriteExt;

/// The members of one `sdk_driver.py` result that say how the call ended: `ok`, and on success
/// `schema_errors`, on failure the exception's `class`, `mro`, `status_code` and `message`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Outcome {
    ok: Option<bool>,
    schema_errors: Option<Vec<Value>>,
    class: Option<String>,
    mro: Option<Vec<String>>,
    status_code: Option<u16>,
    message: Option<String>,
}

/// `result`'s [`Outcome`].
#[track_caller]
fn outcome(result: &Value, what: &str) -> Outcome {
    serde_json::from_value(result.clone())
        .unwrap_or_else(|e| panic!("{what}: not an sdk_driver.py result ({e}): {result}"))
}

/// `tests/python/` of this checkout.
pub(crate) fn python_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("python")
}

/// The venv's interpreter, built on demand.
///
/// Lookup: `$NARWHAL_PY_VENV` when set (it must hold `bin/python`), else
/// `tests/python/ensure-venv.sh` (the cached venv for the current requirement pins, built
/// first when missing; once per test process).
///
/// # Panics
/// When `NARWHAL_PY_VENV` names no venv, or the venv cannot be built (the message names
/// `test`).
pub(crate) fn python(test: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("NARWHAL_PY_VENV").filter(|d| !d.is_empty()) {
        let py = Path::new(&dir).join("bin/python");
        assert!(
            py.exists(),
            "NARWHAL_PY_VENV={} has no bin/python",
            Path::new(&dir).display()
        );
        return py;
    }
    static VENV: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let venv = VENV.get_or_init(ensure_venv);
    match venv {
        Ok(dir) => dir.join("bin/python"),
        Err(why) => panic!(
            "{test}: the Python test venv could not be set up: {why}. \
             tests/python/ensure-venv.sh builds it (needs python3 with venv and pip, a C and a \
             C++ compiler for llama.cpp, and PyPI); `NARWHAL_SKIP_VENV=1 cargo test` builds these \
             tests ignored instead."
        ),
    }
}

/// Runs `tests/python/ensure-venv.sh --find`, and when that finds none, the build (under the
/// script's lock); the venv directory.
fn ensure_venv() -> Result<PathBuf, String> {
    let script = python_dir().join("ensure-venv.sh");
    let run = |args: &[&str], quiet: bool| {
        std::process::Command::new("bash")
            .arg(&script)
            .args(args)
            .stdin(Stdio::null())
            .stderr(if quiet {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .output()
            .map_err(|e| format!("running {}: {e}", script.display()))
    };
    let last_line = |out: &std::process::Output| {
        let stdout = String::from_utf8_lossy(&out.stdout);
        PathBuf::from(stdout.lines().last().unwrap_or_default().trim())
    };
    let found = run(&["--find"], true)?;
    if found.status.success() {
        return Ok(last_line(&found));
    }
    let _ = writeln!(
        std::io::stderr(),
        "\n*** building the Python test venv (tests/python/ensure-venv.sh; minutes the first \
         time, llama.cpp compiles) ***\n"
    );
    let built = run(&[], false)?;
    if built.status.success() {
        Ok(last_line(&built))
    } else {
        // The script's last stdout line names the cause (a missing compiler, venv module...).
        let stdout = String::from_utf8_lossy(&built.stdout);
        let cause = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with("error: "))
            .map_or_else(String::new, |l| format!(": {}", &l["error: ".len()..]));
        Err(format!(
            "ensure-venv.sh exited with {}{cause}",
            built.status
        ))
    }
}

/// A `tokio` command with proxies removed: the tests talk to loopback only, and CI machines may
/// set `HTTP_PROXY`.
pub(crate) fn command(program: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    for k in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        cmd.env_remove(k);
    }
    cmd.env("NO_PROXY", "127.0.0.1,localhost")
        .env("PYTHONUNBUFFERED", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .kill_on_drop(true);
    cmd
}

/// Runs `calls` (a JSON array, see `sdk_driver.py`) through the official SDK against the
/// OpenAI base URL `base` (`http://HOST:PORT`, `/v1` is appended) and returns one result per
/// call. Each result has `ok`; on success `text`, `finish_reason`, `usage`, `schema_errors` and
/// the dumped `response` or `chunks`; on failure `class`, `mro`, `status_code`, `message`, `body`.
///
/// # Panics
/// When the driver does not finish within `timeout` or does not print the results.
pub(crate) async fn sdk(python: &Path, base: &str, calls: &Value, timeout: Duration) -> Vec<Value> {
    let mut child = command(python)
        .arg(python_dir().join("sdk_driver.py"))
        .args(["--base-url", &format!("{base}/v1")])
        .args(["--timeout", &timeout.as_secs_f64().to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sdk_driver.py");
    let mut stdin = child.stdin.take().expect("piped stdin");
    stdin
        .write_all(calls.to_string().as_bytes())
        .await
        .expect("write calls");
    drop(stdin);
    let n = calls.as_array().map_or(1, Vec::len) as u32;
    let out = tokio::time::timeout(
        timeout * n + Duration::from_secs(30),
        child.wait_with_output(),
    )
    .await
    .expect("sdk_driver.py finished in time")
    .expect("sdk_driver.py ran");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let results: Vec<Value> = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "sdk_driver.py printed no results ({e}; status {}); stderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(
        results.len(),
        n as usize,
        "one result per call: {results:?}"
    );
    results
}

/// The single result of a one-call [`sdk`] run.
pub(crate) async fn sdk1(python: &Path, base: &str, call: Value, timeout: Duration) -> Value {
    sdk(python, base, &Value::Array(vec![call]), timeout)
        .await
        .remove(0)
}

/// Asserts a call succeeded and its answer validates against the SDK's own types; returns it.
#[track_caller]
pub(crate) fn ok(result: &Value, what: &str) -> Value {
    let o = outcome(result, what);
    assert_eq!(
        o.ok,
        Some(true),
        "{what}: expected a successful answer, the SDK raised {}",
        result
    );
    assert_eq!(
        o.schema_errors,
        Some(vec![]),
        "{what}: the answer does not validate against the SDK's types: {result}"
    );
    result.clone()
}

/// Asserts a call failed with the SDK exception `class` (which must be an `APIStatusError`) and
/// HTTP `status`, and returns its message.
#[track_caller]
pub(crate) fn api_error(result: &Value, class: &str, status: u16, what: &str) -> String {
    let o = outcome(result, what);
    assert_eq!(
        o.ok,
        Some(false),
        "{what}: expected {class} ({status}), got a successful answer: {result}"
    );
    assert_eq!(
        o.class.as_deref(),
        Some(class),
        "{what}: expected the SDK to raise {class}: {result}"
    );
    assert!(
        o.mro
            .is_some_and(|m| m.iter().any(|c| c == "APIStatusError")),
        "{what}: {class} should be an APIStatusError: {result}"
    );
    assert_eq!(o.status_code, Some(status), "{what}: {result}");
    o.message.unwrap_or_default()
}
