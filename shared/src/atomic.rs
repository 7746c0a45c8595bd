//! The one atomic, durable file replacement every file the product writes goes through (the
//! router's state file and `--ready-file`, the lease record and the handoff beside it, the
//! agent's fence and ready file): write a uniquely named sibling temp file, fsync it, rename it
//! over the target, fsync the directory. A failure before the rename leaves the previous file as
//! it was and removes the temp file; a failure of the last step (the directory's fsync) comes
//! after the rename, so the target holds the new bytes, not known durable. Either way a reader
//! sees the old bytes or the new ones, never a torn mix (docs/design/architecture.md 9.9: the
//! reference renamed without the fsyncs).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A step of [`write_atomic`] failed. Before the rename (`create`, `write`, `fsync`,
/// `rename`) the target is untouched; at `fsync directory` it already holds the new bytes, not
/// known durable.
#[derive(Debug, thiserror::Error)]
#[error("{step} {path}: {source}")]
pub struct AtomicWriteError {
    /// Which step: `create`, `write`, `fsync`, `rename` or `fsync directory`.
    pub step: &'static str,
    /// The file or directory the step acted on (the temp file for `create`, `write`, `fsync`).
    pub path: PathBuf,
    /// The I/O error.
    #[source]
    pub source: std::io::Error,
}

/// The directory `path` lives in (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Replaces `path` with `bytes` atomically and durably. The directory must exist. The temp
/// file is `.<name>.<pid>.<random>.tmp` beside the target, so two writers (two processes, or
/// two threads of one) never share one.
///
/// # Errors
/// [`AtomicWriteError`] naming the step and path; the previous file is left as it was, but
/// for a failed directory fsync, after the rename (see [`AtomicWriteError`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), AtomicWriteError> {
    let dir = parent_dir(path);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let (random, ..) = uuid::Uuid::new_v4().as_fields();
    let tmp = dir.join(format!(".{name}.{}.{random:08x}.tmp", std::process::id()));
    let err = |step, p: &Path| {
        let path = p.to_path_buf();
        move |source| AtomicWriteError { step, path, source }
    };
    let result = (|| {
        let mut f = File::create(&tmp).map_err(err("create", &tmp))?;
        f.write_all(bytes).map_err(err("write", &tmp))?;
        f.sync_all().map_err(err("fsync", &tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(err("rename", path))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(err("fsync directory", dir))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temp_behind() {
        let dir = tempfile_dir();
        let path = dir.join("state.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_names_the_step() {
        let dir = tempfile_dir();
        let path = dir.join("state.json");
        write_atomic(&path, b"good").unwrap();
        // A directory where the target should be: the rename fails, the temp file goes.
        let blocked = dir.join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("x"), b"").unwrap();
        let e = write_atomic(&blocked, b"new").unwrap_err();
        assert_eq!(e.step, "rename");
        assert_eq!(std::fs::read(&path).unwrap(), b"good");
        let temps = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                let n = e.as_ref().unwrap().file_name();
                n.to_string_lossy().ends_with(".tmp")
            })
            .count();
        assert_eq!(temps, 0);
        let missing = dir.join("no-such-dir").join("f");
        assert_eq!(write_atomic(&missing, b"x").unwrap_err().step, "create");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let (a, b, ..) = uuid::Uuid::new_v4().as_fields();
        let d = std::env::temp_dir().join(format!("narwhal-atomic-{a:08x}{b:04x}"));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
