//! The approximate index carried over a router restart (docs/design/kv-aware-placement.md,
//! "Carried over a restart"). A router that stops gracefully while it controls the fleet writes
//! the approximate guesses of every engine without KV events to `<recovery.state_path>.kv-approx`;
//! the router started after it reads that file once (and removes it), and takes each engine's
//! guesses only once it has read the engine's process start and found the process that the
//! guesses were learned from.
//!
//! ```text
//!  stop:  per engine without kv_events, process start known ──► {process_start, block_size,
//!         [our hash, age ms] least recently touched first}  ──write_atomic──► FILE
//!  start: FILE ──read, remove──► pending: ages + the wall-clock gap, entries ≥ TTL old dropped
//!  score: pending engine, process start read (the health gate reads it before traffic):
//!         the same start (within 1 ms) ──► Approx::import; another ──► dropped;
//!         unknown ──► wait, until every carried guess would have expired
//! ```
//!
//! Nothing here can credit a cache that is not there: a guess is bound to the engine process
//! it was learned from and keeps its age, so it expires when it would have in the router that
//! wrote it. Engines with KV events are not carried: their replay rebuilds the exact index
//! (section 2, "Exact from the first request"). A router that crashes writes nothing, and one
//! whose engine publishes no process start (SGLang, llama.cpp) carries nothing for it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::KvCache;
use crate::fleet::Fleet;
use crate::kv_index::KvIndex;

/// The carried file's schema name.
pub(crate) const SCHEMA: &str = "narwhal.kv_approx";
/// The carried file's schema version.
pub(crate) const VERSION: u32 = 1;

/// Two process starts closer than this (seconds) are the same process (as `facts` compares).
const SAME_START_S: f64 = 1e-3;

/// The carried file of a router whose state file is `state_path`: `<state_path>.kv-approx`.
pub(crate) fn path_for(state_path: &str) -> PathBuf {
    PathBuf::from(format!("{state_path}.kv-approx"))
}

/// `<recovery.state_path>.kv-approx` (schema [`SCHEMA`] version [`VERSION`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CarriedDoc {
    /// [`SCHEMA`].
    pub(crate) schema: String,
    /// [`VERSION`].
    pub(crate) version: u32,
    /// Wall clock when it was written, Unix seconds.
    pub(crate) written_at: f64,
    /// By index slot: an engine's iid (`iid/rankN` for a data-parallel engine's further
    /// ranks).
    pub(crate) slots: BTreeMap<String, CarriedSlot>,
}

/// One slot's guesses in [`CarriedDoc`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CarriedSlot {
    /// `process_start_time_seconds` of the engine process the guesses were learned from.
    pub(crate) process_start: f64,
    /// Tokens per block the chains were cut at.
    pub(crate) block_size: u32,
    /// `[our hash, age in milliseconds at written_at]`, least recently touched first.
    pub(crate) blocks: Vec<(u64, u64)>,
}

/// A slot's carried guesses waiting for its engine's process to be read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pending {
    /// See [`CarriedSlot::process_start`].
    pub(crate) process_start: f64,
    /// See [`CarriedSlot::block_size`].
    pub(crate) block_size: u32,
    /// (our hash, when last touched on this router's monotonic clock), least recently
    /// touched first.
    pub(crate) blocks: Vec<(u64, Instant)>,
}

/// What becomes of a pending slot ([`decide`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Adopt {
    /// The engine runs the process the guesses were learned from: take them.
    Take,
    /// Drop them, for the reason given.
    Drop(String),
    /// The engine's process start is not read yet.
    Wait,
}

/// `doc` read at `now` (monotonic) and `wall` (Unix seconds) as pending guesses per slot: each
/// guess's age is its age when written plus the wall-clock time since (none when the clock went
/// back), and guesses `ttl` old or older are dropped, as are slots left empty.
pub(crate) fn pending(
    doc: &CarriedDoc,
    now: Instant,
    wall: f64,
    ttl: Duration,
) -> BTreeMap<String, Pending> {
    let gap = Duration::try_from_secs_f64(wall - doc.written_at).unwrap_or(Duration::ZERO);
    doc.slots
        .iter()
        .filter_map(|(name, s)| {
            let blocks: Vec<(u64, Instant)> = s
                .blocks
                .iter()
                .filter_map(|(h, age_ms)| {
                    let age = Duration::from_millis(*age_ms).saturating_add(gap);
                    if age >= ttl {
                        return None;
                    }
                    now.checked_sub(age).map(|t| (*h, t))
                })
                .collect();
            (!blocks.is_empty()).then(|| {
                (
                    name.clone(),
                    Pending {
                        process_start: s.process_start,
                        block_size: s.block_size,
                        blocks,
                    },
                )
            })
        })
        .collect()
}

/// Whether `p` is taken now that its engine's process start reads `start` (`None`: not read
/// yet) at `now`: taken for the same process, dropped for another, or once every guess it
/// holds has expired (`ttl`) while waiting.
pub(crate) fn decide(p: &Pending, start: Option<f64>, now: Instant, ttl: Duration) -> Adopt {
    let newest = p.blocks.iter().map(|(_, t)| *t).max();
    if newest.is_none_or(|t| now.saturating_duration_since(t) >= ttl) {
        return Adopt::Drop(
            "every carried guess expired before the engine's process was read".into(),
        );
    }
    match start {
        None => Adopt::Wait,
        Some(s) if (s - p.process_start).abs() <= SAME_START_S => Adopt::Take,
        Some(s) => Adopt::Drop(format!(
            "the engine runs another process (started {s}, the guesses' {})",
            p.process_start
        )),
    }
}

impl KvCache {
    /// Writes the approximate guesses of every engine without KV events whose process start is
    /// known to `path` (atomically), as [`CarriedDoc`] at `wall`; with none, removes an older
    /// file instead. Called once, by a router stopping gracefully while it controls the fleet.
    /// Failures are logged: a router that cannot write it starts cold next time.
    pub(crate) fn save_carried(&self, fleet: &Fleet, path: &Path, wall: f64) {
        let now = self.clock.now();
        let mut slots = BTreeMap::new();
        {
            let ix = self.lock();
            for s in 0..self.ranks.len() {
                let Some(process_start) = fleet.process_start(self.ranks.engine(s)) else {
                    continue;
                };
                let Some((block_size, blocks)) = ix.approx_export(s, now) else {
                    continue;
                };
                let blocks = blocks
                    .into_iter()
                    .map(|(h, age)| (h, age.as_millis() as u64))
                    .collect();
                slots.insert(
                    self.slot_name(s),
                    CarriedSlot {
                        process_start,
                        block_size,
                        blocks,
                    },
                );
            }
        }
        if slots.is_empty() {
            let _ = std::fs::remove_file(path);
            return;
        }
        let blocks: usize = slots.values().map(|s| s.blocks.len()).sum();
        let doc = CarriedDoc {
            schema: SCHEMA.into(),
            version: VERSION,
            written_at: wall,
            slots,
        };
        let written = serde_json::to_vec(&doc)
            .map_err(|e| e.to_string())
            .and_then(|bytes| {
                narwhal_shared::atomic::write_atomic(path, &bytes).map_err(|e| e.to_string())
            });
        match written {
            Ok(()) => tracing::info!(
                path = %path.display(),
                engines = doc.slots.len(),
                blocks,
                "approximate KV index carried for the next router"
            ),
            Err(e) => tracing::warn!(
                path = %path.display(),
                error = %e,
                "approximate KV index not carried; the next router starts it cold"
            ),
        }
    }

    /// Reads the file a router before this one carried (if any) at `wall`, keeps its guesses
    /// pending ([`pending`]) and removes it, so a later start never reads it again. A file
    /// that does not parse, or of another schema or version, is logged and removed.
    pub(crate) fn load_carried(&self, path: &Path, wall: f64) {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "carried approximate KV index unreadable; starting it cold");
                return;
            }
        };
        let _ = std::fs::remove_file(path);
        let doc = match serde_json::from_slice::<CarriedDoc>(&bytes) {
            Ok(d) if d.schema == SCHEMA && d.version == VERSION => d,
            Ok(d) => {
                tracing::warn!(path = %path.display(), schema = %d.schema, version = d.version, "carried approximate KV index of another schema ignored");
                return;
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "carried approximate KV index does not parse; ignored");
                return;
            }
        };
        let ttl = crate::config::secs(self.cfg.serving.kv_approx_ttl_s);
        let known: BTreeMap<String, usize> = (0..self.ranks.len())
            .map(|s| (self.slot_name(s), s))
            .collect();
        let pending: BTreeMap<usize, Pending> = pending(&doc, self.clock.now(), wall, ttl)
            .into_iter()
            .filter_map(|(name, p)| known.get(&name).map(|s| (*s, p)))
            .collect();
        tracing::info!(
            path = %path.display(),
            engines = pending.len(),
            blocks = pending.values().map(|p| p.blocks.len()).sum::<usize>(),
            "carried approximate KV index read; each engine's guesses are taken once its process is confirmed"
        );
        *self.carry_lock() = pending;
    }

    /// Takes or drops the pending carried guesses whose engine's process start is now known
    /// ([`decide`]); called with the index locked, before a score reads it.
    pub(super) fn adopt_carried(&self, fleet: &Fleet, ix: &mut KvIndex, now: Instant) {
        let mut carry = self.carry_lock();
        if carry.is_empty() {
            return;
        }
        let ttl = crate::config::secs(self.cfg.serving.kv_approx_ttl_s);
        carry.retain(|&s, p| {
            let e = self.ranks.engine(s);
            match decide(p, fleet.process_start(e), now, ttl) {
                Adopt::Wait => true,
                Adopt::Take => {
                    let taken = ix.approx_import(s, p.block_size, &p.blocks, fleet.incarnation(e));
                    tracing::info!(engine.id = %self.slot_name(s), blocks = taken, "carried approximate KV guesses taken");
                    false
                }
                Adopt::Drop(why) => {
                    tracing::info!(engine.id = %self.slot_name(s), reason = %why, "carried approximate KV guesses dropped");
                    false
                }
            }
        });
    }

    fn carry_lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, Pending>> {
        self.carry.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn doc() -> CarriedDoc {
        let slot = |start: f64, blocks: Vec<(u64, u64)>| CarriedSlot {
            process_start: start,
            block_size: 16,
            blocks,
        };
        CarriedDoc {
            schema: SCHEMA.into(),
            version: VERSION,
            written_at: 1000.0,
            slots: [
                ("e0".to_string(), slot(10.0, vec![(1, 100_000), (2, 5_000)])),
                ("e1".to_string(), slot(20.0, vec![(3, 119_000)])),
            ]
            .into(),
        }
    }

    #[test]
    fn ages_grow_by_the_wall_clock_gap_and_expired_guesses_are_dropped() {
        let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock) + secs(1000);
        let ttl = secs(120);
        // Read 2 s after it was written: e1's only guess (119 s + 2 s) expired.
        let p = pending(&doc(), now, 1002.0, ttl);
        assert_eq!(p.keys().collect::<Vec<_>>(), ["e0"]);
        assert_eq!(
            p["e0"].blocks,
            [(1, now - secs(102)), (2, now - secs(7))],
            "least recently touched first, aged by the gap"
        );
        // A wall clock that went back adds nothing.
        let back = pending(&doc(), now, 900.0, ttl);
        assert_eq!(back["e1"].blocks, [(3, now - secs(119))]);
        // Read after the TTL: nothing.
        assert!(pending(&doc(), now, 1200.0, ttl).is_empty());
        // The document round-trips as JSON, and an unknown field is refused.
        let text = serde_json::to_string(&doc()).unwrap();
        assert_eq!(serde_json::from_str::<CarriedDoc>(&text).unwrap(), doc());
        let extra = text.replacen("{", "{\"x\":1,", 1);
        assert!(serde_json::from_str::<CarriedDoc>(&extra).is_err());
    }

    #[test]
    fn guesses_are_taken_only_for_the_process_they_were_learned_from() {
        let now = narwhal_shared::Clock::now(&narwhal_shared::SystemClock) + secs(1000);
        let ttl = secs(120);
        let p = pending(&doc(), now, 1000.0, ttl).remove("e0").unwrap();
        assert_eq!(decide(&p, None, now, ttl), Adopt::Wait);
        assert_eq!(decide(&p, Some(10.0005), now, ttl), Adopt::Take);
        assert!(
            matches!(decide(&p, Some(10.5), now, ttl), Adopt::Drop(w) if w.contains("another process"))
        );
        // Still unread once its newest guess (5 s old) expired: dropped.
        assert_eq!(decide(&p, None, now + secs(114), ttl), Adopt::Wait);
        assert!(
            matches!(decide(&p, None, now + secs(115), ttl), Adopt::Drop(w) if w.contains("expired"))
        );
    }
}
