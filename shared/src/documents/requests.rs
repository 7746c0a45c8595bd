//! The request bodies of the router's control API (behaviour.md 1.10,
//! handoff-and-lifecycle.md 2.3-2.6): what `narwhalctl`, supervisors and the tests send, and
//! what the router's lifecycle routes read.
//!
//! ```text
//!  POST /narwhal/lifecycle/drain          DrainBody    {"engines": [...], "wave", "deadline_s"}
//!  POST /narwhal/lifecycle/readmit        ReadmitBody  {"engines": [...], "wave"}
//!  POST /narwhal/lifecycle/cancel-drain   ReadmitBody  {"engines": [iid]}
//! ```
//!
//! Every key is optional and unknown keys are refused (400 naming the key); the router reads
//! the body with its own checks so each refusal names the field at fault.

use serde::{Deserialize, Serialize};

/// `POST /narwhal/lifecycle/drain`: drain `engines`, or the whole fleet as one wave.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DrainBody {
    /// Engine ids to drain (empty with `wave`: every engine).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<String>,
    /// Drain the whole fleet as one wave.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub wave: bool,
    /// The drain deadline, seconds in (0, one year]; the router's default (300) when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_s: Option<f64>,
}

/// `POST /narwhal/lifecycle/readmit` and `.../cancel-drain`: readmit (or cancel the drain of)
/// `engines`, or the active wave.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReadmitBody {
    /// Engine ids (empty with `wave`: the active wave's engines).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<String>,
    /// The whole wave as one engine set.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub wave: bool,
}

impl DrainBody {
    /// A drain of the one engine `iid` with `deadline_s`.
    pub fn engine(iid: &str, deadline_s: f64) -> Self {
        DrainBody {
            engines: vec![iid.to_string()],
            wave: false,
            deadline_s: Some(deadline_s),
        }
    }

    /// A whole-fleet wave drain with `deadline_s`.
    pub fn wave(deadline_s: f64) -> Self {
        DrainBody {
            engines: Vec::new(),
            wave: true,
            deadline_s: Some(deadline_s),
        }
    }
}

impl ReadmitBody {
    /// The one engine `iid`.
    pub fn engine(iid: &str) -> Self {
        ReadmitBody {
            engines: vec![iid.to_string()],
            wave: false,
        }
    }

    /// The active wave.
    pub fn wave() -> Self {
        ReadmitBody {
            engines: Vec::new(),
            wave: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bodies narwhalctl sends, byte for byte as before they were typed.
    #[test]
    fn bodies_are_written_as_narwhalctl_sent_them() {
        assert_eq!(
            serde_json::to_string(&DrainBody::engine("p0", 30.0)).unwrap(),
            r#"{"engines":["p0"],"deadline_s":30.0}"#
        );
        assert_eq!(
            serde_json::to_string(&DrainBody::wave(300.0)).unwrap(),
            r#"{"wave":true,"deadline_s":300.0}"#
        );
        assert_eq!(
            serde_json::to_string(&ReadmitBody::engine("d1")).unwrap(),
            r#"{"engines":["d1"]}"#
        );
        assert_eq!(
            serde_json::to_string(&ReadmitBody::wave()).unwrap(),
            r#"{"wave":true}"#
        );
        let back: DrainBody = serde_json::from_str(r#"{"engines":["p0"],"deadline_s":5}"#).unwrap();
        assert_eq!(back, DrainBody::engine("p0", 5.0));
        assert!(serde_json::from_str::<ReadmitBody>(r#"{"deadline_s":5}"#).is_err());
    }
}
