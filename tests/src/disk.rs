//! A small disk the test can fill or make read-only under a running process: a `tmpfs` of a
//! fixed size mounted on a directory of the fleet (the primary's `recovery.state_path` and
//! journal live there). Needs root with `CAP_SYS_ADMIN` (a container as root has it unless
//! it drops it); without it a test that needs it FAILS saying so, it never passes silently.
//!
//! Why a mount: as root, file modes do not stop writes, so `chmod` cannot make a directory
//! read-only or full. Read-only is a read-only bind mount of the disk over itself: the kernel
//! refuses to remount a filesystem read-only while a file on it is open for writing (`EBUSY`),
//! and the router keeps its journal open, so files opened from then on (every state-file
//! write: a temporary file, then a rename) fail with `EROFS` while a file already open for
//! writing (the journal) keeps writing; [`Disk::fill`] is the fault that reaches the journal.
//! An fsync error (a disk that accepts writes and loses them) is `crate::fsync`'s, which needs
//! no mount.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// A `tmpfs` mounted on a directory; unmounted (lazily, so open files do not hold it) on
/// drop.
#[derive(Debug)]
pub struct Disk {
    /// The mount point.
    pub path: PathBuf,
    filler: PathBuf,
    /// The read-only bind mount is on (one more mount to remove on drop).
    ro: AtomicBool,
}

fn mount(args: &[&str], at: &Path) -> Result<(), String> {
    let out = Command::new("mount")
        .args(args)
        .arg(at)
        .output()
        .map_err(|e| format!("mount {args:?} {}: {e}", at.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "mount {args:?} {}: {} {}",
            at.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Disk {
    /// Whether this machine lets the test kit mount a `tmpfs` (root with `CAP_SYS_ADMIN`): a
    /// 64 KiB one is mounted on a temporary directory and removed. `Err` says why not.
    pub fn mountable() -> Result<(), String> {
        let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
        mount(&["-t", "tmpfs", "-o", "size=65536", "tmpfs"], dir.path())?;
        let _ = Command::new("umount").arg("-l").arg(dir.path()).output();
        Ok(())
    }

    /// Mounts a `tmpfs` of `bytes` bytes on `path` (created when missing).
    ///
    /// # Panics
    /// When the mount fails (not root, no `CAP_SYS_ADMIN`): the message says so.
    pub fn mount(path: &Path, bytes: u64) -> Disk {
        std::fs::create_dir_all(path).expect("mount point");
        let size = format!("size={bytes}");
        mount(&["-t", "tmpfs", "-o", &size, "tmpfs"], path).unwrap_or_else(|e| {
            panic!(
                "the disk faults need a tmpfs mount (root with CAP_SYS_ADMIN, as in the CI \
                 container): {e}"
            )
        });
        Disk {
            path: path.to_path_buf(),
            filler: path.join(".filler"),
            ro: AtomicBool::new(false),
        }
    }

    /// Fills the disk to the last byte: a filler file written until the disk answers
    /// `ENOSPC`. Returns the bytes written.
    ///
    /// # Panics
    /// When the filler cannot be created or the write fails with another error.
    pub fn fill(&self) -> u64 {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.filler)
            .expect("filler");
        let block = vec![0u8; 4096];
        let mut n = 0u64;
        loop {
            match f.write(&block) {
                Ok(0) => return n,
                Ok(k) => n += k as u64,
                Err(e) if e.raw_os_error() == Some(28) => break,
                Err(e) => panic!("filling {}: {e}", self.path.display()),
            }
        }
        // The last partial page, byte by byte.
        while f.write(&[0u8]).is_ok_and(|k| k == 1) {
            n += 1;
        }
        n
    }

    /// Frees what [`Disk::fill`] took.
    pub fn unfill(&self) {
        let _ = std::fs::remove_file(&self.filler);
    }

    /// Makes the disk read-only for every file opened from now on (`true`: a read-only bind
    /// mount over it, see the module doc; creating, renaming and writing fail with `EROFS`,
    /// files stay readable) or writable again (`false`: that bind mount removed).
    ///
    /// # Panics
    /// When a mount fails.
    pub fn read_only(&self, ro: bool) {
        let r = if ro {
            let at = self.path.display().to_string();
            mount(&["--bind", &at], &self.path)
                .and_then(|()| mount(&["-o", "remount,bind,ro"], &self.path))
        } else {
            let out = Command::new("umount").arg(&self.path).output();
            match out {
                Ok(o) if o.status.success() => Ok(()),
                Ok(o) => Err(format!(
                    "umount {}: {}",
                    self.path.display(),
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => Err(format!("umount {}: {e}", self.path.display())),
            }
        };
        r.unwrap_or_else(|e| panic!("{e}"));
        self.ro.store(ro, Ordering::SeqCst);
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        if self.ro.load(Ordering::SeqCst) {
            let _ = Command::new("umount").arg("-l").arg(&self.path).output();
        }
        let _ = Command::new("umount").arg("-l").arg(&self.path).output();
    }
}
