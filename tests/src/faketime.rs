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
    let out = Command::new("date")
        .arg("+%s")
        .envs(env.iter().map(|(k, v)| (k, v)))
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
    assert!(
        (shown - real - secs).abs() <= 2,
        "libfaketime does not shift the clock here: date +%s under FAKETIME={secs:+}s printed \
         {shown}, the real clock reads {real}"
    );
    env
}
