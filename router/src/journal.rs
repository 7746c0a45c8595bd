//! Request journal: JSONL rows written by one task over a bounded channel
//! (behaviour.md 7.8; architecture.md sections 5 and 9.8).
//!
//! ```text
//!  settle() ──try_send(row)──► [bounded channel] ──writer task──► journal.jsonl (append)
//!              full? drop and count                                 header row at open
//! ```
//!
//! The request path never blocks on the journal: a full channel drops the row and counts it.
//!
//! Only whole rows reach the file. The writer appends each batch of rows in one write; when it
//! fails (a full disk, an IO error) whatever part of the batch reached the file is cut off again
//! (the file is truncated to its length before the write), the batch's rows are dropped and
//! counted (`journal_dropped`), the failure is logged once and shown in `/narwhal/state`
//! (`journal_writes_failing`) until a write succeeds, and the next batch starts on a clean line.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::time::{Duration, Instant};

use narwhal_shared::Clock;
use serde::Serialize;
use tokio::sync::mpsc;

mod event;
pub(crate) mod lifecycle;

pub(crate) use event::Event;

/// Rows queued before the writer falls behind and rows are dropped.
pub(crate) const JOURNAL_CAPACITY: usize = 8192;

/// While rows come faster than [`BUSY_ROWS_PER_S`], the writer wakes at most once per this:
/// a row that arrives sooner after the last write waits out the rest, with every row that
/// follows it, and is written in the same batch. Slower than that (a quiet router, a test
/// reading the journal right after its request) every row is written at once. On a router with
/// one core the writer's thread shares it with the request path: waking it per row cost two
/// context switches per request (docs/benchmarks.md, "The journal writer's wake-ups"). At
/// 10,000 rows per second a batch holds about 100 rows, far below [`JOURNAL_CAPACITY`].
pub(crate) const JOURNAL_LINGER: Duration = Duration::from_millis(10);

/// The row rate (rows per second, over the last [`RATE_WINDOW`]) above which the writer
/// lingers. Below it the wake-ups cost under 1% of a core.
pub(crate) const BUSY_ROWS_PER_S: f64 = 1000.0;

/// The window over which the writer measures the row rate.
const RATE_WINDOW: Duration = Duration::from_millis(100);

/// The writer's pacing: the row rate of the last whole window and the current one's count.
#[derive(Debug)]
struct Pace {
    window_from: Option<Instant>,
    rows_in_window: u64,
    rate: f64,
    last_write: Option<Instant>,
}

impl Pace {
    fn new() -> Pace {
        Pace {
            window_from: None,
            rows_in_window: 0,
            rate: 0.0,
            last_write: None,
        }
    }

    /// A batch of `rows` was written at `now`.
    fn wrote(&mut self, rows: usize, now: Instant) {
        let from = *self.window_from.get_or_insert(now);
        let span = now.saturating_duration_since(from);
        if span >= RATE_WINDOW {
            self.rate = self.rows_in_window as f64 / span.as_secs_f64();
            self.window_from = Some(now);
            self.rows_in_window = 0;
        }
        self.rows_in_window += rows as u64;
        self.last_write = Some(now);
    }

    /// How long to wait at `now` before draining the rows that woke the writer.
    fn linger(&self, now: Instant) -> Duration {
        match self.last_write {
            Some(at) if self.rate >= BUSY_ROWS_PER_S => {
                JOURNAL_LINGER.saturating_sub(now.saturating_duration_since(at))
            }
            _ => Duration::ZERO,
        }
    }
}

/// One queued row; the writer puts `schema`, `schema_version` and `run` in front of each (so
/// the request path builds no map to insert them first).
enum Row {
    /// An event row ([`Event`]), serialised on the writer's thread.
    Event(Event),
    /// A row that serialises itself on the writer's thread (a request's row).
    Typed(Box<dyn TypedRow>),
}

/// A journal row that writes itself: one JSON object, none of whose members is `schema`,
/// `schema_version` or `run` (the journal puts those in front).
pub(crate) trait TypedRow: Send {
    /// Appends the row as one JSON object (`{...}`) to `out`.
    fn write_object(&self, out: &mut Vec<u8>);
}

/// Journal schema name and version.
pub(crate) const SCHEMA: &str = "narwhal.journal";

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
pub(crate) fn run_id(wall_s: f64) -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    format!("{}-{}", wall_s as u64, &hex[..8])
}

/// The header row (architecture.md 9.8: it carries the run id, unlike the reference):
/// `{"meta": {...}}`.
#[derive(Debug, Serialize)]
pub(crate) struct Header<'a> {
    /// The header's members.
    meta: HeaderMeta<'a>,
}

/// The members of the header row, in the order written.
#[derive(Debug, Serialize)]
struct HeaderMeta<'a> {
    /// [`SCHEMA`].
    schema: &'static str,
    /// Always 1.
    schema_version: u32,
    /// The run id ([`run_id`]).
    run: &'a str,
    /// `narwhal-router`.
    package: &'static str,
    /// The crate's version.
    version: &'static str,
    /// `git describe` of the build, `null` outside a checkout.
    git: Option<&'static str>,
    /// How tokens are counted: `token_ids`.
    token_accounting: &'static str,
    /// The admission in force.
    admission: HeaderAdmission<'a>,
}

/// `meta.admission`: `serving.admission` and `serving.admission_margin`.
#[derive(Debug, Serialize)]
struct HeaderAdmission<'a> {
    /// `serving.admission`.
    mode: &'a str,
    /// `serving.admission_margin`.
    margin: f64,
}

/// The header row of run `run` with the admission in force (`serving.admission`,
/// `serving.admission_margin`).
pub(crate) fn header<'a>(run: &'a str, admission: &'a str, margin: f64) -> Header<'a> {
    let git = env!("NARWHAL_GIT_DESCRIBE");
    Header {
        meta: HeaderMeta {
            schema: SCHEMA,
            schema_version: 1,
            run,
            package: "narwhal-router",
            version: env!("CARGO_PKG_VERSION"),
            git: (!git.is_empty()).then_some(git),
            token_accounting: "token_ids",
            admission: HeaderAdmission {
                mode: admission,
                margin,
            },
        },
    }
}

/// Cheap handle the request path uses to emit rows.
#[derive(Debug, Clone)]
pub struct Journal {
    tx: Option<mpsc::Sender<Row>>,
    run: Arc<str>,
    dropped: Arc<AtomicU64>,
    failing: Arc<AtomicBool>,
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
        clock: Arc<dyn Clock>,
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
        let len = file.metadata().map_err(err)?.len();
        let dropped = Arc::new(AtomicU64::new(0));
        let failing = Arc::new(AtomicBool::new(false));
        let mut w = Writer::new(file, len, run, dropped.clone(), failing.clone());
        // A header of strings and numbers always serialises.
        let mut head =
            serde_json::to_vec(&header(run, admission.0, admission.1)).unwrap_or_default();
        head.push(b'\n');
        w.sink.append(&head).map_err(err)?;
        w.len += head.len() as u64;
        let (tx, mut rx) = mpsc::channel::<Row>(JOURNAL_CAPACITY);
        let task = tokio::task::spawn_blocking(move || {
            let mut batch = Vec::new();
            let mut pace = Pace::new();
            while let Some(row) = rx.blocking_recv() {
                let wait = pace.linger(clock.now());
                if !wait.is_zero() {
                    std::thread::sleep(wait);
                }
                batch.push(row);
                while let Ok(more) = rx.try_recv() {
                    batch.push(more);
                }
                w.write_batch(&batch);
                pace.wrote(batch.len(), clock.now());
                batch.clear();
            }
        });
        Ok((
            Journal {
                tx: Some(tx),
                run: run.into(),
                dropped,
                failing,
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
            failing: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The run id.
    pub fn run(&self) -> &str {
        &self.run
    }

    /// Rows dropped, whole: because the writer fell behind, or because a write failed (a full
    /// disk, an IO error).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The last write failed: rows are being dropped (and counted) until one succeeds.
    pub fn writes_failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }

    /// Queue one event row ([`Event`]); adds `schema`, `schema_version`, `run` in front. Never
    /// blocks: a full queue drops the row and counts it.
    pub(crate) fn emit(&self, event: impl Into<Event>) {
        let Some(tx) = &self.tx else { return };
        if tx.try_send(Row::Event(event.into())).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Queue one row that serialises itself on the writer's thread ([`TypedRow`]); adds
    /// `schema`, `schema_version`, `run` in front. Never blocks.
    pub(crate) fn emit_typed(&self, row: Box<dyn TypedRow>) {
        let Some(tx) = &self.tx else { return };
        if tx.try_send(Row::Typed(row)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Close the channel so the writer drains and exits.
    pub fn close(&mut self) {
        self.tx = None;
    }
}

/// Appends `front` (the row's first members, its `{` open) and then the JSON object `write`
/// appends, merged into one object: the object's own `{` becomes the comma after `front`, and
/// an empty object only closes it.
fn after_front(buf: &mut Vec<u8>, front: &[u8], write: impl FnOnce(&mut Vec<u8>)) {
    buf.extend_from_slice(front);
    let open = buf.len();
    write(buf);
    if buf.len() - open <= 2 {
        // `{}`: nothing after the front.
        buf.truncate(open);
        buf.push(b'}');
    } else {
        buf[open] = b',';
    }
}

/// The file a journal appends to: one whole write, and a cut back to an earlier length.
trait Sink {
    /// Appends `bytes` (all of them, or an error; some may have reached the file).
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()>;
    /// Truncates the file to `len` bytes.
    fn cut(&mut self, len: u64) -> std::io::Result<()>;
}

impl Sink for std::fs::File {
    fn append(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.write_all(bytes)
    }

    fn cut(&mut self, len: u64) -> std::io::Result<()> {
        self.set_len(len)
    }
}

/// The writer task's state: the file's length after its last whole row, and the outage.
struct Writer<S> {
    sink: S,
    /// Bytes of whole rows in the file.
    len: u64,
    /// A failed write could not be cut off: the file ends in a fragment, and the next write
    /// starts with a line break so every later row is on a line of its own.
    torn: bool,
    /// Rows dropped since writes started failing (`None`: writes succeed).
    outage: Option<u64>,
    dropped: Arc<AtomicU64>,
    failing: Arc<AtomicBool>,
    /// `{"schema":"narwhal.journal","schema_version":1,"run":<run>`: the front of every row.
    front: Vec<u8>,
}

impl<S: Sink> Writer<S> {
    fn new(
        sink: S,
        len: u64,
        run: &str,
        dropped: Arc<AtomicU64>,
        failing: Arc<AtomicBool>,
    ) -> Self {
        let front = format!(
            "{{\"schema\":\"{SCHEMA}\",\"schema_version\":1,\"run\":{}",
            serde_json::Value::String(run.to_string())
        );
        Writer {
            sink,
            len,
            torn: false,
            outage: None,
            dropped,
            failing,
            front: front.into_bytes(),
        }
    }

    /// Appends `rows` whole, or drops and counts them all.
    fn write_batch(&mut self, rows: &[Row]) {
        let mut buf = Vec::with_capacity(rows.len() * 512);
        if self.torn {
            buf.push(b'\n');
        }
        for row in rows {
            match row {
                // An event of strings, numbers and lists always serialises.
                Row::Event(e) => after_front(&mut buf, &self.front, |b| {
                    let _ = serde_json::to_writer(b, e);
                }),
                Row::Typed(r) => after_front(&mut buf, &self.front, |b| r.write_object(b)),
            }
            buf.push(b'\n');
        }
        match self.sink.append(&buf) {
            Ok(()) => {
                self.len += buf.len() as u64;
                self.torn = false;
                if let Some(lost) = self.outage.take() {
                    self.failing.store(false, Ordering::Relaxed);
                    tracing::info!(dropped_rows = lost, "journal writes succeed again");
                }
            }
            Err(e) => {
                self.torn = match self.sink.cut(self.len) {
                    Ok(()) => false,
                    Err(cut) => {
                        tracing::warn!(error = %cut, "journal: a failed write could not be cut off");
                        true
                    }
                };
                let n = rows.len() as u64;
                self.dropped.fetch_add(n, Ordering::Relaxed);
                match &mut self.outage {
                    Some(lost) => *lost += n,
                    None => {
                        self.outage = Some(n);
                        self.failing.store(true, Ordering::Relaxed);
                        tracing::warn!(error = %e, "journal write failed: whole rows are dropped and counted (journal_dropped) until a write succeeds");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn run_id_shape() {
        let r = run_id(1_796_008_620.7);
        let (secs, hex) = r.split_once('-').unwrap();
        assert_eq!(secs, "1796008620");
        assert_eq!(hex.len(), 8);
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn the_writer_lingers_only_while_rows_come_fast() {
        let t0 = narwhal_shared::SystemClock.now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut p = Pace::new();
        assert_eq!(p.linger(t0), Duration::ZERO, "the first row at once");
        // Slow rows (one per 20 ms: 50 per second) are written at once.
        for i in 0..10 {
            p.wrote(1, ms(20 * i));
            assert_eq!(p.linger(ms(20 * i + 1)), Duration::ZERO);
        }
        // 100 rows in the next 100 ms (1,000 per second): from the window's close on, a row
        // right after a write waits out the rest of the linger.
        for i in 0..100 {
            p.wrote(1, ms(200 + i));
        }
        p.wrote(1, ms(300));
        assert_eq!(p.linger(ms(304)), Duration::from_millis(6));
        assert_eq!(p.linger(ms(310)), Duration::ZERO, "the linger has passed");
        // A quiet spell: the next window's rate is low again.
        p.wrote(1, ms(2000));
        assert_eq!(p.linger(ms(2001)), Duration::ZERO);
    }

    #[tokio::test]
    async fn header_then_rows_with_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/journal.jsonl");
        let (mut j, task) = Journal::open(
            &path,
            "1-abcdef01",
            ("open", 0.0),
            Arc::new(narwhal_shared::SystemClock),
        )
        .unwrap();
        j.emit(Event::EngineAdmitted {
            iid: "e0".into(),
            at: 1.5,
        });
        struct Typed(&'static str);
        impl TypedRow for Typed {
            fn write_object(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(self.0.as_bytes());
            }
        }
        j.emit_typed(Box::new(Typed(r#"{"rid":"r2"}"#)));
        j.emit_typed(Box::new(Typed("{}")));
        j.close();
        task.await.unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        // The three fields in front, then the row's own in its order.
        let raw: Vec<&str> = text.lines().skip(1).collect();
        assert_eq!(
            raw,
            [
                r#"{"schema":"narwhal.journal","schema_version":1,"run":"1-abcdef01","event":"engine_admitted","iid":"e0","at":1.5}"#,
                r#"{"schema":"narwhal.journal","schema_version":1,"run":"1-abcdef01","rid":"r2"}"#,
                r#"{"schema":"narwhal.journal","schema_version":1,"run":"1-abcdef01"}"#,
            ]
        );
        let lines: Vec<Value> = text
            .lines()
            .take(2)
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["meta"]["schema"], "narwhal.journal");
        assert_eq!(lines[0]["meta"]["run"], "1-abcdef01");
        assert_eq!(lines[0]["meta"]["package"], "narwhal-router");
        assert_eq!(lines[1]["run"], "1-abcdef01");
        assert_eq!(lines[1]["schema_version"], 1);
        assert_eq!(lines[1]["iid"], "e0");
        assert_eq!(j.dropped(), 0);
    }

    /// A file that takes `room` more bytes, then fails a write half-way (ENOSPC); `cut`
    /// truncates it like `set_len`.
    struct Disk {
        bytes: Vec<u8>,
        room: usize,
        cut_fails: bool,
    }

    impl Sink for Disk {
        fn append(&mut self, b: &[u8]) -> std::io::Result<()> {
            let fits = b.len().min(self.room);
            self.bytes.extend_from_slice(&b[..fits]);
            self.room -= fits;
            if fits < b.len() {
                return Err(std::io::Error::from_raw_os_error(28));
            }
            Ok(())
        }

        fn cut(&mut self, len: u64) -> std::io::Result<()> {
            if self.cut_fails {
                return Err(std::io::Error::from_raw_os_error(5));
            }
            self.bytes.truncate(len as usize);
            Ok(())
        }
    }

    /// A request-like row of about 60 bytes: `{"rid":"r<i>","queue_waits":{"admission":0.0}}`.
    struct Rid(u64);

    impl TypedRow for Rid {
        fn write_object(&self, out: &mut Vec<u8>) {
            let row = format!(
                r#"{{"rid":"r{}","queue_waits":{{"admission":0.0}}}}"#,
                self.0
            );
            out.extend_from_slice(row.as_bytes());
        }
    }

    fn rows(from: u64, n: u64) -> Vec<Row> {
        (from..from + n)
            .map(|i| Row::Typed(Box::new(Rid(i))))
            .collect()
    }

    fn writer(room: usize, cut_fails: bool) -> Writer<Disk> {
        let disk = Disk {
            bytes: Vec::new(),
            room,
            cut_fails,
        };
        let flags = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        Writer::new(disk, 0, "1-ab", flags.0, flags.1)
    }

    fn lines(w: &Writer<Disk>) -> Vec<String> {
        String::from_utf8(w.sink.bytes.clone())
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// A full disk mid-row: the fragment is cut off, the rows are dropped and counted, the
    /// outage is flagged, and once space is back the file goes on with whole rows.
    #[test]
    fn a_full_disk_drops_whole_rows_counts_them_and_resumes_on_a_clean_line() {
        let mut w = writer(300, false);
        w.write_batch(&rows(0, 2));
        assert_eq!(lines(&w).len(), 2);
        w.write_batch(&rows(2, 5));
        w.write_batch(&rows(7, 3));
        assert_eq!(w.dropped.load(Ordering::Relaxed), 8);
        assert!(w.failing.load(Ordering::Relaxed));
        w.sink.room = 1 << 20;
        w.write_batch(&rows(10, 2));
        assert!(!w.failing.load(Ordering::Relaxed));
        let got = lines(&w);
        assert_eq!(got.len(), 4, "{got:?}");
        for l in &got {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            assert!(v["rid"].is_string());
        }
        let rids: Vec<Value> = got
            .iter()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["rid"].clone())
            .collect();
        assert_eq!(rids, vec!["r0", "r1", "r10", "r11"]);
        assert_eq!(w.dropped.load(Ordering::Relaxed), 8);
    }

    /// When even the cut fails, the fragment stays but the next row starts a line of its own.
    #[test]
    fn a_fragment_that_cannot_be_cut_never_splices_the_next_row() {
        let mut w = writer(100, true);
        w.write_batch(&rows(0, 3));
        assert_eq!(w.dropped.load(Ordering::Relaxed), 3);
        w.sink.room = 1 << 20;
        w.write_batch(&rows(3, 1));
        let got = lines(&w);
        let last: Value = serde_json::from_str(got.last().unwrap()).unwrap();
        assert_eq!(last["rid"], "r3");
        let torn = got
            .iter()
            .filter(|l| serde_json::from_str::<Value>(l).is_err())
            .count();
        assert_eq!(torn, 1, "one fragment, on a line of its own: {got:?}");
    }
}
