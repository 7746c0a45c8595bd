//! Build script of narwhal-testkit: decides whether the end-to-end tests that need the Python
//! test venv (`tests/tests/e2e/sdk_e2e.rs`, `tests/tests/e2e/llamacpp_e2e.rs`, the vLLM check in
//! `tests/tests/e2e/kv_events_e2e.rs`) are compiled as ignored.
//!
//! With `NARWHAL_SKIP_VENV=1` (and neither `CI`, `NARWHAL_REQUIRE_VENV` nor `NARWHAL_PY_VENV`
//! set) it sets the cfg `narwhal_skip_venv`, and those tests carry
//! `#[cfg_attr(narwhal_skip_venv, ignore = "...")]`: the test harness then lists each as
//! `ignored` with the reason and counts it under `ignored`, instead of a pass
//! (docs/testing.md, "Skipping the venv tests"). Cargo reruns this script, and rebuilds the
//! crate, whenever one of those variables changes.
//!
//! The real-vLLM stage (`tests/tests/vllm_e2e.rs`) is the other way round: built ignored unless
//! `NARWHAL_VLLM=1` sets the cfg `narwhal_vllm`, so `cargo test --workspace` does not spend the
//! stage's minutes and 6.7 GB; `.ci/run` runs it as its own stage with the variable set.

fn set(k: &str) -> bool {
    std::env::var(k).is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    for k in [
        "NARWHAL_SKIP_VENV",
        "NARWHAL_REQUIRE_VENV",
        "NARWHAL_PY_VENV",
        "CI",
        "NARWHAL_VLLM",
    ] {
        println!("cargo::rerun-if-env-changed={k}");
    }
    println!("cargo::rustc-check-cfg=cfg(narwhal_skip_venv)");
    println!("cargo::rustc-check-cfg=cfg(narwhal_vllm)");
    if set("NARWHAL_VLLM") {
        println!("cargo::rustc-cfg=narwhal_vllm");
    }
    let venv_given = std::env::var_os("NARWHAL_PY_VENV").is_some_and(|d| !d.is_empty());
    if set("NARWHAL_SKIP_VENV") && !set("CI") && !set("NARWHAL_REQUIRE_VENV") && !venv_given {
        println!("cargo::rustc-cfg=narwhal_skip_venv");
    }
}
