//! Request journal: JSONL rows written by one task over a bounded channel
//! (behaviour.md 7.8; architecture.md sections 5 and 9.8).
//!
//! ```text
//!  settle() ──try_send(row)──► [bounded channel] ──writer task──► journal.jsonl (append)
//!              full? drop and count                                 header row at open
//! ```
//!
//! The request path never blocks on the journal: a full channel drops the row and counts it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use tokio::sync::mpsc;

/// Rows queued before the writer falls behind and rows are dropped.
pub const JOURNAL_CAPACITY: usize = 8192;

/// Journal schema name and version.
pub const SCHEMA: &str = "narwhal.journal";

/// Opening the journal failed.
#[derive(Debug, thiserror::Error)]
#[error("journal {path}: {source}")]
pub struct JournalError {
    /// The journal path.
    pub path: PathBuf,
    /// The IO error.
    pub source: std::io::Error,
}

/// A run id `"<unix secs>-<8 hex>"` (behaviour.md 7.8), `wall_s` = process start.
pub fn run_id(wall_s: f64) -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    format!("{}-{}", wall_s as u64, &hex[..8])
}

/// The header row (architecture.md 9.8: it carries the run id, unlike the reference) with the
/// admission in force (`serving.admission`, `serving.admission_margin`).
pub fn header(run: &str, admission: &str, margin: f64) -> Value {
    let git = env!("NARWHAL_GIT_DESCRIBE");
    json!({"meta": {
        "schema": SCHEMA,
        "schema_version": 1,
        "run": run,
        "package": "narwhal-router",
        "version": env!("CARGO_PKG_VERSION"),
        "git": if git.is_empty() { Value::Null } else { Value::String(git.to_string()) },
        "token_accounting": "token_ids",
        "admission": {"mode": admission, "margin": margin},
    }})
}

/// Cheap handle the request path uses to emit rows.
#[derive(Debug, Clone)]
pub struct Journal {
    tx: Option<mpsc::Sender<Value>>,
    run: Arc<str>,
    dropped: Arc<AtomicU64>,
}

impl Journal {
    /// Open (append) `path`, write the header, and spawn the writer task. Must run inside a
    /// tokio runtime.
    ///
    /// # Errors
    /// [`JournalError`] when the directory or file cannot be created or written.
    pub fn open(
        path: &Path,
        run: &str,
        admission: (&str, f64),
    ) -> Result<(Journal, tokio::task::JoinHandle<()>), JournalError> {
        let err = |source| JournalError {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(err)?;
        let mut w = std::io::BufWriter::new(file);
        writeln!(w, "{}", header(run, admission.0, admission.1)).map_err(err)?;
        w.flush().map_err(err)?;
        let (tx, mut rx) = mpsc::channel::<Value>(JOURNAL_CAPACITY);
        let task = tokio::task::spawn_blocking(move || {
            while let Some(row) = rx.blocking_recv() {
                let mut ok = writeln!(w, "{row}").is_ok();
                while let Ok(more) = rx.try_recv() {
                    ok &= writeln!(w, "{more}").is_ok();
                }
                ok &= w.flush().is_ok();
                if !ok {
                    tracing::warn!("journal write failed");
                }
            }
            let _ = w.flush();
        });
        Ok((
            Journal {
                tx: Some(tx),
                run: run.into(),
                dropped: Arc::new(AtomicU64::new(0)),
            },
            task,
        ))
    }

    /// A journal that drops every row (tests, or when none is wanted).
    pub fn disabled(run: &str) -> Journal {
        Journal {
            tx: None,
            run: run.into(),
            dropped: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The run id.
    pub fn run(&self) -> &str {
        &self.run
    }

    /// Rows dropped because the writer fell behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Queue one row; adds `schema`, `schema_version`, `run` in front. Never blocks.
    pub fn emit(&self, row: Value) {
        let Some(tx) = &self.tx else { return };
        let mut full = serde_json::Map::new();
        full.insert("schema".into(), SCHEMA.into());
        full.insert("schema_version".into(), 1.into());
        full.insert("run".into(), Value::String(self.run.to_string()));
        if let Value::Object(m) = row {
            full.extend(m);
        }
        if tx.try_send(Value::Object(full)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Close the channel so the writer drains and exits.
    pub fn close(&mut self) {
        self.tx = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_id_shape() {
        let r = run_id(1_796_008_620.7);
        let (secs, hex) = r.split_once('-').unwrap();
        assert_eq!(secs, "1796008620");
        assert_eq!(hex.len(), 8);
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[tokio::test]
    async fn header_then_rows_with_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/journal.jsonl");
        let (mut j, task) = Journal::open(&path, "1-abcdef01", ("open", 0.0)).unwrap();
        j.emit(json!({"rid": "r1", "terminal": "completed"}));
        j.close();
        task.await.unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["meta"]["schema"], "narwhal.journal");
        assert_eq!(lines[0]["meta"]["run"], "1-abcdef01");
        assert_eq!(lines[0]["meta"]["package"], "narwhal-router");
        assert_eq!(lines[1]["run"], "1-abcdef01");
        assert_eq!(lines[1]["schema_version"], 1);
        assert_eq!(lines[1]["rid"], "r1");
        assert_eq!(j.dropped(), 0);
    }
}
