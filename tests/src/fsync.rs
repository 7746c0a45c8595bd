//! An fsync error under a running router, without a kernel module: a small C library
//! (`fsync/shim.c`, built here with the C compiler the toolchain links with) preloaded into
//! the router (`LD_PRELOAD`) makes `fsync(2)` and `fdatasync(2)` fail with `EIO` for files
//! whose path starts with a prefix, while a flag file exists. The product's one durable write
//! (`narwhal_shared::write_atomic`: temp file, fsync, rename, fsync the directory) then fails
//! at its fsync step, as on a disk that accepts writes and loses them; a device-mapper target
//! (`dm-flakey`, `dm-error`) would need a kernel module and a block device.
//!
//! The router is dynamically linked against glibc (Rust's `x86_64-unknown-linux-gnu`), so
//! its `fsync` calls go through the dynamic symbol the library replaces.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const SHIM: &str = include_str!("fsync/shim.c");

/// The built library, once per test process: `Err` says why it could not be built.
fn library() -> Result<&'static Path, String> {
    static LIB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("narwhal-fsync-shim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let src = dir.join("shim.c");
        let lib = dir.join("libnarwhal_fsync_fault.so");
        std::fs::write(&src, SHIM).map_err(|e| format!("{}: {e}", src.display()))?;
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = Command::new(&cc)
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(&src)
            .arg("-ldl")
            .output()
            .map_err(|e| format!("{cc}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{cc} -shared {}: {}",
                src.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(lib)
    })
    .as_ref()
    .map(PathBuf::as_path)
    .map_err(Clone::clone)
}

/// An fsync fault for the files of one router whose paths start with `under`.
#[derive(Debug)]
pub struct FsyncFault {
    lib: PathBuf,
    flag: PathBuf,
    under: PathBuf,
}

impl FsyncFault {
    /// A fault, off, for files whose paths start with `under` (a path prefix, not only a
    /// directory: `<dir>/.primary.state.json` catches the state file's temp files), switched
    /// by the flag file `flag`.
    ///
    /// # Panics
    /// When the library cannot be built (no C compiler): the message says so.
    pub fn new(flag: &Path, under: &Path) -> FsyncFault {
        let lib = library().unwrap_or_else(|e| {
            panic!("the fsync fault needs a C compiler to build its shim: {e}")
        });
        let _ = std::fs::remove_file(flag);
        FsyncFault {
            lib: lib.to_path_buf(),
            flag: flag.to_path_buf(),
            under: under.to_path_buf(),
        }
    }

    /// The environment of the process the fault reaches.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), self.lib.display().to_string()),
            (
                "NARWHAL_TEST_FSYNC_FAIL".into(),
                self.flag.display().to_string(),
            ),
            (
                "NARWHAL_TEST_FSYNC_UNDER".into(),
                self.under.display().to_string(),
            ),
        ]
    }

    /// Turns the fault on (every fsync under the prefix fails with `EIO`) or off.
    ///
    /// # Panics
    /// When the flag file cannot be written or removed.
    pub fn fail(&self, on: bool) {
        if on {
            std::fs::write(&self.flag, b"EIO\n").expect("fsync fault flag");
        } else if let Err(e) = std::fs::remove_file(&self.flag) {
            assert_eq!(
                e.kind(),
                std::io::ErrorKind::NotFound,
                "fsync fault flag: {e}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child process under the shim: its fsync fails with EIO under the prefix while the
    /// flag exists, and succeeds elsewhere and once the flag is gone. The child is coreutils'
    /// `dd conv=fsync`, which fsyncs the file it wrote and fails when that fails.
    #[test]
    fn fsync_fails_under_the_prefix_only_while_the_flag_exists() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fault = FsyncFault::new(&dir.path().join("flag"), &dir.path().join("state"));
        let dd = |name: &str| {
            Command::new("dd")
                .args([
                    "if=/dev/zero",
                    "bs=1",
                    "count=1",
                    "conv=fsync",
                    "status=none",
                ])
                .arg(format!("of={}", dir.path().join(name).display()))
                .envs(fault.env())
                .output()
                .expect("dd")
        };
        assert!(dd("state.tmp").status.success(), "off: fsync passes");
        fault.fail(true);
        let failed = dd("state.tmp");
        assert!(!failed.status.success(), "on: fsync under the prefix fails");
        let err = String::from_utf8_lossy(&failed.stderr).to_lowercase();
        assert!(err.contains("input/output error"), "{err}");
        assert!(dd("other").status.success(), "on: fsync elsewhere passes");
        fault.fail(false);
        assert!(dd("state.tmp").status.success(), "off again: fsync passes");
    }
}
