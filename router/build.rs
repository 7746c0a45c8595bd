//! Records the git commit of the build for the request-journal header (behaviour.md 7.8:
//! package and git provenance): `git describe --always --abbrev=12` of HEAD, empty outside a
//! git checkout.
//!
//! The script reruns only when HEAD moves: it watches `HEAD`, the ref file HEAD names and
//! `packed-refs`, never the index, so a `git status` (which rewrites `.git/index`) does not
//! rebuild the router. For the same reason it does not mark uncommitted changes (`--dirty`
//! would go stale the moment the tree changed without a rebuild of this script).
use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    Command::new("git")
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    let describe = git(&["describe", "--always", "--abbrev=12"]).unwrap_or_default();
    println!("cargo:rustc-env=NARWHAL_GIT_DESCRIBE={describe}");
    println!("cargo:rerun-if-changed=build.rs");
    // `--git-dir` is where HEAD lives (a worktree's own directory); `--git-common-dir` holds
    // the refs and packed-refs shared by every worktree.
    let (Some(git_dir), Some(common)) = (
        git(&["rev-parse", "--absolute-git-dir"]),
        git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]),
    ) else {
        return;
    };
    let (git_dir, common) = (PathBuf::from(git_dir), PathBuf::from(common));
    let mut watched = vec![git_dir.join("HEAD"), common.join("packed-refs")];
    if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(common.join(reference));
    }
    // A path that does not exist would make cargo rerun the script on every build.
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}
