//! The HA handoff document, schema `narwhal.handoff` version 1 (handoff-and-lifecycle.md, "HA
//! handoff"; behaviour.md 2.1–2.6), its validation, and its atomic persistence to
//! `recovery.state_path`.
//!
//! One validator serves every reader and writer (architecture.md section 7): the router before
//! it writes the state file or answers `GET /narwhal/handoff`, `--resume` before it applies, and
//! a standby before it retains a polled document. A document that fails validation is never
//! written, applied or retained, and the error names the field.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `schema` of the handoff document.
pub const HANDOFF_SCHEMA: &str = "narwhal.handoff";
/// The one `schema_version` this release reads and writes.
pub const HANDOFF_VERSION: u32 = 1;

/// The request counters a handoff carries (behaviour.md 2.1; the six of
/// handoff-and-lifecycle.md plus the reference's five extra totals).
pub const COUNTERS: [&str; 11] = [
    "offered",
    "unsized_offered",
    "served",
    "slo_met",
    "expired",
    "invalid_requests",
    "failed",
    "refused",
    "rejected",
    "cancelled",
    "unserved",
];

/// Terminals whose reasons are carried in `outcome_reasons`.
pub const REASON_TERMINALS: [&str; 4] = ["failed", "rejected", "expired", "refused"];

/// Lifecycle state of one engine (behaviour.md 4.2). An engine without a record is `Active`
/// (the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainState {
    /// In service (no hold).
    #[default]
    Active,
    /// Out of placement; resident requests are finishing.
    Draining,
    /// Out of placement, no resident work, pre-restart process identity recorded.
    Drained,
    /// The drain deadline passed with work still resident (reported, never cancelled).
    DeadlineExceeded,
    /// Readmission checks are running.
    Validating,
    /// Held out after a failed identity capture or a failed validation.
    Blocked,
}

impl DrainState {
    /// Every state, in the order the metrics label them.
    pub const ALL: [DrainState; 6] = [
        DrainState::Active,
        DrainState::Draining,
        DrainState::Drained,
        DrainState::DeadlineExceeded,
        DrainState::Validating,
        DrainState::Blocked,
    ];

    /// The state's name in documents, events and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            DrainState::Active => "active",
            DrainState::Draining => "draining",
            DrainState::Drained => "drained",
            DrainState::DeadlineExceeded => "deadline_exceeded",
            DrainState::Validating => "validating",
            DrainState::Blocked => "blocked",
        }
    }
}

/// One engine's lifecycle record (behaviour.md 4.1). Times are wall-clock Unix seconds; a
/// reader re-anchors the drain deadline to its own monotonic clock (architecture.md 9.8).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainRecord {
    /// Engine id.
    pub iid: String,
    /// Current state.
    pub state: DrainState,
    /// When the hold started (wall seconds).
    pub requested_at: f64,
    /// Drain deadline (wall seconds); equals `requested_at` for holds without a drain.
    pub deadline_at: f64,
    /// Readmission requires a process start newer than `old_process_start`.
    pub restart_required: bool,
    /// `wave-<12 hex>` or `""`.
    pub wave_id: String,
    /// Process start (Unix seconds) of the process the supervisor may stop.
    pub old_process_start: Option<f64>,
    /// Process start accepted at readmission.
    pub new_process_start: Option<f64>,
    /// Last error, `""` when none.
    pub error: String,
    /// Checks passed in the last validation, in the order they ran.
    pub checks: Vec<String>,
}

/// The lifecycle part of a handoff (behaviour.md 2.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleState {
    /// Active wave id, `""` when none.
    #[serde(default)]
    pub wave_id: String,
    /// Drain records, sorted by `iid`.
    pub records: Vec<DrainRecord>,
    /// Lifecycle events, oldest first (at most 200).
    #[serde(default)]
    pub events: Vec<Value>,
    /// The writer's configured restart policy: `individual` or `whole_wave`.
    pub engine_restart_policy: String,
    /// Last accepted process start per engine, Unix seconds.
    #[serde(default)]
    pub process_starts: BTreeMap<String, f64>,
}

/// The latest consolidation-risk event (behaviour.md 9).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DemandRisk {
    /// `first_token_timeout` or `p_to_d_recovery`.
    pub kind: String,
    /// Seconds since the newest event, on the writer's clock.
    #[serde(default)]
    pub age_s: f64,
    /// Events seen per kind.
    #[serde(default)]
    pub events: BTreeMap<String, u64>,
}

/// The handoff document. Fields serialise in the order of behaviour.md 2.1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handoff {
    /// Always [`HANDOFF_SCHEMA`].
    pub schema: String,
    /// Always [`HANDOFF_VERSION`].
    pub schema_version: u32,
    /// Wall-clock write time, Unix seconds.
    pub at: f64,
    /// Journal run id of the writing process.
    pub run: String,
    /// Configured served model.
    pub model: String,
    /// Lease epoch; 0 without HA fencing.
    #[serde(default)]
    pub epoch: u64,
    /// Lease holder token; `""` without HA fencing.
    #[serde(default)]
    pub holder: String,
    /// Configured engine ids, sorted.
    pub engines: Vec<String>,
    /// Router role (`prefill` or `decode`) of every engine.
    pub roles: BTreeMap<String, String>,
    /// Breaker-ejected engines, sorted.
    #[serde(default)]
    pub ejected: Vec<String>,
    /// Suspect engine → producers whose KV fed its failing decodes (`""` = local probe).
    #[serde(default)]
    pub inference_sources: BTreeMap<String, Vec<String>>,
    /// Request totals ([`COUNTERS`]).
    pub counters: BTreeMap<String, u64>,
    /// Per terminal, reason → count (non-zero only).
    #[serde(default)]
    pub outcome_reasons: BTreeMap<String, BTreeMap<String, u64>>,
    /// Durable lifecycle state.
    pub lifecycle: LifecycleState,
    /// Latest consolidation-risk event, or null.
    pub demand_risk: Option<DemandRisk>,
}

/// Why a handoff document was refused. Every variant names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HandoffError {
    /// `schema` or `schema_version` is not this release's: the writer speaks another contract.
    #[error("contract version: {field}: {reason}")]
    ContractVersion {
        /// `schema` or `schema_version`.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A field has the wrong type or value.
    #[error("{field}: {reason}")]
    Field {
        /// Dotted path of the field (`lifecycle.records[0].state`).
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The text is not JSON (a torn or truncated file).
    #[error("not JSON: {0}")]
    Syntax(String),
}

fn field(field: impl Into<String>, reason: impl Into<String>) -> HandoffError {
    HandoffError::Field {
        field: field.into(),
        reason: reason.into(),
    }
}

impl Handoff {
    /// Parses and validates a document.
    ///
    /// # Errors
    /// [`HandoffError`] naming the first offending field.
    pub fn from_value(v: Value) -> Result<Handoff, HandoffError> {
        let obj = v.as_object().ok_or_else(|| HandoffError::ContractVersion {
            field: "(document)".into(),
            reason: "must be a JSON object".into(),
        })?;
        match obj.get("schema") {
            Some(Value::String(s)) if s == HANDOFF_SCHEMA => {}
            other => {
                return Err(HandoffError::ContractVersion {
                    field: "schema".into(),
                    reason: format!("must be {HANDOFF_SCHEMA:?}, got {}", show(other)),
                });
            }
        }
        match obj.get("schema_version") {
            Some(Value::Number(n)) if n.as_u64() == Some(u64::from(HANDOFF_VERSION)) => {}
            other => {
                return Err(HandoffError::ContractVersion {
                    field: "schema_version".into(),
                    reason: format!("must be {HANDOFF_VERSION}, got {}", show(other)),
                });
            }
        }
        let h: Handoff = serde_path_to_error::deserialize(v).map_err(|e| {
            let path = e.path().to_string();
            field(path, e.inner().to_string())
        })?;
        h.validate()?;
        Ok(h)
    }

    /// Parses text (a state file or an HTTP body) and validates it.
    ///
    /// # Errors
    /// [`HandoffError::Syntax`] for text that is not JSON, else as [`Handoff::from_value`].
    pub fn parse(text: &str) -> Result<Handoff, HandoffError> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| HandoffError::Syntax(e.to_string()))?;
        Handoff::from_value(v)
    }

    /// The semantic rules of behaviour.md 2.3, tightened: times finite, engines sorted and
    /// unique, every id a configured one, roles valid, records consistent with the wave.
    ///
    /// # Errors
    /// [`HandoffError`] naming the first offending field.
    pub fn validate(&self) -> Result<(), HandoffError> {
        if self.schema != HANDOFF_SCHEMA {
            return Err(HandoffError::ContractVersion {
                field: "schema".into(),
                reason: format!("must be {HANDOFF_SCHEMA:?}"),
            });
        }
        if self.schema_version != HANDOFF_VERSION {
            return Err(HandoffError::ContractVersion {
                field: "schema_version".into(),
                reason: format!("must be {HANDOFF_VERSION}"),
            });
        }
        if !self.at.is_finite() || self.at <= 0.0 {
            return Err(field("at", "must be a positive finite Unix time"));
        }
        if self.engines.is_empty() {
            return Err(field("engines", "must name at least one engine"));
        }
        let mut sorted = self.engines.clone();
        sorted.sort();
        sorted.dedup();
        if sorted != self.engines {
            return Err(field("engines", "must be sorted and unique"));
        }
        let known: BTreeSet<&str> = self.engines.iter().map(String::as_str).collect();
        let check_id = |path: String, iid: &str| {
            if known.contains(iid) {
                Ok(())
            } else {
                Err(field(path, format!("{iid:?} is not in engines")))
            }
        };
        for (iid, role) in &self.roles {
            check_id(format!("roles.{iid}"), iid)?;
            if role != "prefill" && role != "decode" {
                return Err(field(
                    format!("roles.{iid}"),
                    format!("must be \"prefill\" or \"decode\", got {role:?}"),
                ));
            }
        }
        for (i, iid) in self.ejected.iter().enumerate() {
            check_id(format!("ejected[{i}]"), iid)?;
        }
        for (iid, producers) in &self.inference_sources {
            check_id(format!("inference_sources.{iid}"), iid)?;
            if producers.is_empty() {
                return Err(field(
                    format!("inference_sources.{iid}"),
                    "must list at least one producer (\"\" for a local probe)",
                ));
            }
            for (i, p) in producers.iter().enumerate() {
                if !p.is_empty() {
                    check_id(format!("inference_sources.{iid}[{i}]"), p)?;
                }
            }
        }
        for name in self.counters.keys() {
            if !COUNTERS.contains(&name.as_str()) {
                return Err(field(format!("counters.{name}"), "unknown counter"));
            }
        }
        for terminal in self.outcome_reasons.keys() {
            if !REASON_TERMINALS.contains(&terminal.as_str()) {
                return Err(field(
                    format!("outcome_reasons.{terminal}"),
                    "unknown terminal",
                ));
            }
        }
        let lc = &self.lifecycle;
        if lc.engine_restart_policy != "individual" && lc.engine_restart_policy != "whole_wave" {
            return Err(field(
                "lifecycle.engine_restart_policy",
                format!(
                    "must be \"individual\" or \"whole_wave\", got {:?}",
                    lc.engine_restart_policy
                ),
            ));
        }
        for (iid, start) in &lc.process_starts {
            check_id(format!("lifecycle.process_starts.{iid}"), iid)?;
            if !start.is_finite() || *start <= 0.0 {
                return Err(field(
                    format!("lifecycle.process_starts.{iid}"),
                    "must be a positive finite Unix time",
                ));
            }
        }
        let mut seen = BTreeSet::new();
        for (i, r) in lc.records.iter().enumerate() {
            let at = |f: &str| format!("lifecycle.records[{i}].{f}");
            check_id(at("iid"), &r.iid)?;
            if !seen.insert(r.iid.as_str()) {
                return Err(field(at("iid"), format!("{:?} has two records", r.iid)));
            }
            for (name, t) in [
                ("requested_at", r.requested_at),
                ("deadline_at", r.deadline_at),
            ] {
                if !t.is_finite() {
                    return Err(field(at(name), "must be a finite Unix time"));
                }
            }
            for (name, t) in [
                ("old_process_start", r.old_process_start),
                ("new_process_start", r.new_process_start),
            ] {
                if t.is_some_and(|t| !t.is_finite() || t <= 0.0) {
                    return Err(field(
                        at(name),
                        "must be null or a positive finite Unix time",
                    ));
                }
            }
            if !r.wave_id.is_empty() && r.wave_id != lc.wave_id {
                return Err(field(
                    at("wave_id"),
                    format!("{:?} is not the active wave {:?}", r.wave_id, lc.wave_id),
                ));
            }
        }
        if !lc.wave_id.is_empty() {
            let members: BTreeSet<&str> = lc
                .records
                .iter()
                .filter(|r| r.wave_id == lc.wave_id)
                .map(|r| r.iid.as_str())
                .collect();
            if members != known {
                return Err(field(
                    "lifecycle.wave_id",
                    "a wave must hold a record for every engine",
                ));
            }
        }
        if let Some(risk) = &self.demand_risk
            && (!risk.age_s.is_finite() || risk.age_s < 0.0)
        {
            return Err(field("demand_risk.age_s", "must be a finite number >= 0"));
        }
        Ok(())
    }

    /// Checks that this document describes the fleet being served (behaviour.md 2.7 steps
    /// 2–3, plus the model, which the reference never compares).
    ///
    /// # Errors
    /// A one-line reason, shown in `/ready` and `/narwhal/state`.
    pub fn matches_fleet(
        &self,
        model: &str,
        engines: &[String],
        policy: &str,
    ) -> Result<(), String> {
        let mut mine = engines.to_vec();
        mine.sort();
        if self.engines != mine {
            return Err(format!(
                "handoff names {:?}, this fleet is {:?}",
                self.engines, mine
            ));
        }
        if self.model != model {
            return Err(format!(
                "handoff is for model {:?}, this fleet serves {model:?}",
                self.model
            ));
        }
        if self.lifecycle.engine_restart_policy != policy {
            return Err("handoff engine restart policy mismatch".to_string());
        }
        Ok(())
    }
}

fn show(v: Option<&Value>) -> String {
    v.map_or("nothing".to_string(), Value::to_string)
}

/// Why the state file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The document failed validation; nothing was written.
    #[error("refusing to write an invalid handoff: {0}")]
    Invalid(#[from] HandoffError),
    /// A file-system step failed; the previous file is untouched.
    #[error("{step} {path}: {source}")]
    Io {
        /// Which step (`create`, `write`, `fsync`, `rename`, `fsync directory`).
        step: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Writes `doc` to `path` atomically and durably: validate, write a sibling temp file,
/// fsync it, rename it over `path`, fsync the directory (architecture.md 9.9). A failure at any
/// step leaves the previous file as it was and removes the temp file. The directory must
/// exist (the router makes it once at start): one removed under a running router is an
/// error, never silently made again.
///
/// # Errors
/// [`PersistError`].
pub fn write_state_file(path: &Path, doc: &Handoff) -> Result<(), PersistError> {
    doc.validate()?;
    let mut text = serde_json::to_vec(doc).map_err(|e| PersistError::Io {
        step: "serialise",
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    text.push(b'\n');
    crate::atomic::write_atomic(path, &text).map_err(|e| PersistError::Io {
        step: e.step,
        path: e.path,
        source: e.source,
    })
}

/// What a state file held.
#[derive(Debug)]
pub enum Loaded {
    /// No file: start fresh.
    Absent,
    /// A valid document.
    Valid(Box<Handoff>),
    /// A file that cannot be used (torn, invalid, unreadable): start without it and report
    /// the reason; the file is left in place for the operator.
    Refused(String),
}

/// Reads and validates the state file at `path` (behaviour.md 2.6, tightened: a torn or
/// invalid file is reported, never applied, never a crash).
pub fn load_state_file(path: &Path) -> Loaded {
    match std::fs::read_to_string(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Loaded::Absent,
        Err(e) => Loaded::Refused(format!("{}: {e}", path.display())),
        Ok(text) => match Handoff::parse(&text) {
            Ok(h) => Loaded::Valid(Box::new(h)),
            Err(e) => Loaded::Refused(format!("{}: {e}", path.display())),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc() -> Value {
        json!({"schema":"narwhal.handoff","schema_version":1,"at":1764470000.12,"run":"1764469000-1a2b3c4d",
         "model":"m","epoch":7,"holder":"host-a:8000:5f0c","engines":["e0","e1"],
         "roles":{"e0":"prefill","e1":"decode"},"ejected":[],"inference_sources":{"e1":["e0"]},
         "counters":{"offered":10,"unsized_offered":0,"served":9,"slo_met":9,"expired":0,
           "invalid_requests":0,"failed":1,"refused":0,"rejected":0,"cancelled":0,"unserved":0},
         "outcome_reasons":{"failed":{"engine_error":1},"rejected":{},"expired":{},"refused":{}},
         "lifecycle":{"wave_id":"","records":[
             {"iid":"e0","state":"drained","requested_at":1764469990.0,"deadline_at":1764470290.0,
              "restart_required":true,"wave_id":"","old_process_start":1764460000.5,
              "new_process_start":null,"error":"","checks":[]}],
           "events":[],"engine_restart_policy":"individual",
           "process_starts":{"e0":1764460000.5,"e1":1764460003.25}},
         "demand_risk":{"kind":"first_token_timeout","age_s":12.5,"events":{"first_token_timeout":1}}})
    }

    fn refuse(mutate: impl FnOnce(&mut Value)) -> HandoffError {
        let mut v = doc();
        mutate(&mut v);
        Handoff::from_value(v).expect_err("must be refused")
    }

    #[test]
    fn reference_example_validates_and_round_trips() {
        let h = Handoff::from_value(doc()).unwrap();
        assert_eq!(h.lifecycle.records[0].state, DrainState::Drained);
        let again = Handoff::from_value(serde_json::to_value(&h).unwrap()).unwrap();
        assert_eq!(h, again);
        let keys: Vec<String> = serde_json::to_value(&h)
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        assert_eq!(
            keys[..6],
            ["schema", "schema_version", "at", "run", "model", "epoch"]
        );
    }

    #[test]
    fn every_bad_field_is_named() {
        type Mutation = Box<dyn FnOnce(&mut Value)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|v| v["schema"] = json!("narwhal.other")), "schema"),
            (
                Box::new(|v| v["schema_version"] = json!(2)),
                "schema_version",
            ),
            (
                Box::new(|v| v["schema_version"] = json!(true)),
                "schema_version",
            ),
            (Box::new(|v| v["epoch"] = json!(-1)), "epoch"),
            (Box::new(|v| v["epoch"] = json!(true)), "epoch"),
            (Box::new(|v| v["holder"] = json!(5)), "holder"),
            (Box::new(|v| v["engines"] = json!(["e1", "e0"])), "engines"),
            (Box::new(|v| v["roles"]["e0"] = json!("both")), "roles.e0"),
            (Box::new(|v| v["ejected"] = json!(["e9"])), "ejected[0]"),
            (
                Box::new(|v| v["inference_sources"]["e1"] = json!([])),
                "inference_sources.e1",
            ),
            (
                Box::new(|v| v["inference_sources"]["e1"] = json!(["e7"])),
                "inference_sources.e1[0]",
            ),
            (
                Box::new(|v| v["lifecycle"]["process_starts"]["e9"] = json!(1.0)),
                "lifecycle.process_starts.e9",
            ),
            (
                Box::new(|v| v["lifecycle"]["process_starts"]["e0"] = json!(0)),
                "lifecycle.process_starts.e0",
            ),
            (
                Box::new(|v| v["lifecycle"]["records"][0]["state"] = json!("sleeping")),
                "lifecycle.records[0].state",
            ),
            (
                Box::new(|v| v["lifecycle"]["engine_restart_policy"] = json!("never")),
                "lifecycle.engine_restart_policy",
            ),
            (
                Box::new(|v| v["lifecycle"]["wave_id"] = json!("wave-1")),
                "lifecycle.wave_id",
            ),
            (
                Box::new(|v| v["lifecycle"]["records"][0]["wave_id"] = json!("wave-x")),
                "lifecycle.records[0].wave_id",
            ),
            (
                Box::new(|v| v["demand_risk"]["age_s"] = json!(-3)),
                "demand_risk.age_s",
            ),
            (Box::new(|v| v["surprise"] = json!(1)), "surprise"),
        ];
        for (mutate, name) in cases {
            let e = refuse(mutate).to_string();
            assert!(e.contains(name), "error {e:?} should name {name}");
        }
    }

    #[test]
    fn contract_version_errors_are_distinguished() {
        assert!(matches!(
            refuse(|v| v["schema_version"] = json!(0)),
            HandoffError::ContractVersion { .. }
        ));
        assert!(matches!(
            refuse(|v| v["epoch"] = json!("x")),
            HandoffError::Field { .. }
        ));
    }

    #[test]
    fn foreign_fleet_is_refused_with_a_reason() {
        let h = Handoff::from_value(doc()).unwrap();
        let mine = ["e0".to_string(), "e9".to_string()];
        let e = h.matches_fleet("m", &mine, "individual").unwrap_err();
        assert!(e.starts_with("handoff names"), "{e}");
        let ours = ["e1".to_string(), "e0".to_string()];
        assert!(h.matches_fleet("m", &ours, "individual").is_ok());
        assert!(h.matches_fleet("other", &ours, "individual").is_err());
        assert_eq!(
            h.matches_fleet("m", &ours, "whole_wave").unwrap_err(),
            "handoff engine restart policy mismatch"
        );
    }

    #[test]
    fn state_file_round_trip_and_torn_file_never_replaces_a_good_one() {
        let dir = std::env::temp_dir().join(format!("narwhal-handoff-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("state.json");
        assert!(matches!(load_state_file(&path), Loaded::Absent));
        let h = Handoff::from_value(doc()).unwrap();
        // The directory is not made by a write: one removed under a router stays removed.
        assert!(matches!(
            write_state_file(&path, &h),
            Err(PersistError::Io { .. })
        ));
        assert!(!dir.exists());
        std::fs::create_dir_all(&dir).unwrap();
        write_state_file(&path, &h).unwrap();
        match load_state_file(&path) {
            Loaded::Valid(back) => assert_eq!(*back, h),
            other => panic!("{other:?}"),
        }
        // An invalid document is refused and the good file stays.
        let mut bad = h.clone();
        bad.engines = vec!["e1".into(), "e0".into()];
        assert!(matches!(
            write_state_file(&path, &bad),
            Err(PersistError::Invalid(_))
        ));
        assert!(matches!(load_state_file(&path), Loaded::Valid(_)));
        // No temp files remain.
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        // A torn file is reported, not applied.
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, &text[..text.len() / 2]).unwrap();
        match load_state_file(&path) {
            Loaded::Refused(reason) => assert!(reason.contains("not JSON"), "{reason}"),
            other => panic!("{other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
