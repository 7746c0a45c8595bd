//! libfaketime for end-to-end tests: a child process whose wall clock (`CLOCK_REALTIME`) is
//! shifted while its monotonic clock is untouched (`FAKETIME_DONT_FAKE_MONOTONIC=1`), as on a
//! host that lost NTP or a VM that resumed (docs/ha.md, "Clocks"). The library is Debian's
//! `faketime` package (`.ci/run` installs it); without it a test that needs it FAILS saying
//! so, it never passes silently.

use std::path::PathBuf;
use std::process::Command;

/// Where Debian (and a local build) put `libfaketime.so.1`.
const CANDIDATES: [&str; 3] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
];

/// The library: `NARWHAL_LIBFAKETIME`, else the first of the usual paths that exists.
///
/// # Panics
/// When there is none, naming the package to install.
pub fn library() -> PathBuf {
    if let Some(p) = std::env::var_os("NARWHAL_LIBFAKETIME") {
        return PathBuf::from(p);
    }
    CANDIDATES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime not found (looked at {CANDIDATES:?}): this test needs it; install \
                 Debian's `faketime` package (apt-get install faketime; .ci/run does), or set \
                 NARWHAL_LIBFAKETIME to libfaketime.so.1"
            )
        })
}

/// The environment that shifts a child's wall clock by `secs` seconds (ahead when positive)
/// and leaves its monotonic clock alone. Checked on `date +%s` first.
///
/// # Panics
/// When libfaketime is missing ([`library`]) or does not shift the clock here.
pub fn wall_shifted(secs: i64) -> Vec<(String, String)> {
    let env = vec![
        ("LD_PRELOAD".to_string(), library().display().to_string()),
        ("FAKETIME".to_string(), format!("{secs:+}s")),
        ("FAKETIME_DONT_FAKE_MONOTONIC".to_string(), "1".to_string()),
    ];
    let (shown, real) = date_under(env.iter().map(|(k, v)| (k, v)));
    assert!(
        (shown - real - secs).abs() <= 2,
        "libfaketime does not shift the clock here: date +%s under FAKETIME={secs:+}s printed \
         {shown}, the real clock reads {real}"
    );
    env
}

/// A wall clock the test can move while the process runs: libfaketime reading an offset
/// (`+0s`, `-30s`) from a file on every call (`FAKETIME_TIMESTAMP_FILE` with
/// `FAKETIME_NO_CACHE=1`, libfaketime 0.9.7 and later; Debian ships 0.9.10), the monotonic
/// clock untouched.
#[derive(Debug, Clone)]
pub struct MovableClock {
    /// The offset file.
    pub file: PathBuf,
}

impl MovableClock {
    /// A clock at offset 0 kept in `file` (written now), checked on `date +%s` under a step of
    /// 1000 s first.
    ///
    /// # Panics
    /// When the file cannot be written.
    /// When the file cannot be written, libfaketime is missing ([`library`]) or a step does
    /// not show in `date +%s` here.
    pub fn new(file: PathBuf) -> MovableClock {
        let c = MovableClock { file };
        c.set(1000);
        let (shown, real) = date_under(c.env());
        assert!(
            (shown - real - 1000).abs() <= 2,
            "libfaketime does not read FAKETIME_TIMESTAMP_FILE here: date +%s printed {shown}, \
             the real clock reads {real}, the file says +1000s"
        );
        c.set(0);
        c
    }

    /// The environment of a child that runs on this clock.
    ///
    /// # Panics
    /// When libfaketime is missing ([`library`]).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".to_string(), library().display().to_string()),
            (
                "FAKETIME_TIMESTAMP_FILE".to_string(),
                self.file.display().to_string(),
            ),
            ("FAKETIME_NO_CACHE".to_string(), "1".to_string()),
            ("FAKETIME_DONT_FAKE_MONOTONIC".to_string(), "1".to_string()),
        ]
    }

    /// Moves the clock to `secs` seconds from the real one (ahead when positive): a running
    /// child sees the step at its next clock read.
    ///
    /// # Panics
    /// When the file cannot be written.
    pub fn set(&self, secs: i64) {
        // Written whole, then renamed, so a read never sees half an offset.
        let tmp = self.file.with_extension("tmp");
        std::fs::write(&tmp, format!("{secs:+}s\n")).expect("faketime offset");
        std::fs::rename(&tmp, &self.file).expect("faketime offset");
    }
}

/// `date +%s` run under `env`, and the real wall clock read just after: `(shown, real)` in
/// seconds since the epoch.
///
/// # Panics
/// When `date` cannot run or prints no number.
fn date_under<K, V>(env: impl IntoIterator<Item = (K, V)>) -> (i64, i64)
where
    K: AsRef<std::ffi::OsStr>,
    V: AsRef<std::ffi::OsStr>,
{
    let out = Command::new("date")
        .arg("+%s")
        .envs(env)
        .output()
        .unwrap_or_else(|e| panic!("date +%s under libfaketime: {e}"));
    let shown: i64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("date +%s under libfaketime printed {out:?}"));
    let real = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("wall clock after 1970")
        .as_secs() as i64;
    (shown, real)
}
