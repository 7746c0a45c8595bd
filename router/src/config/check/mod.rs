//! The fleet-file validator: every key of every section walked by hand, every problem
//! collected with its dotted path. The generic field readers and the top level live here, each
//! section in its own file.

use serde_json::{Map, Value};

use super::{
    AdmissionMode, AgentSection, Backend, Config, ConfigIssue, Controller, EngineConfig,
    EngineSection, Profile, Recovery, RestartPolicy, Slo, TlsFiles,
};

mod controller;
mod engines;
mod lease;
mod serving;

pub(super) const TOP_KEYS: &[&str] = &[
    "schema",
    "schema_version",
    "model",
    "adapters",
    "backend",
    "engines",
    "slo",
    "controller",
    "serving",
    "engine",
    "recovery",
    "profiles",
    "engine_contract",
    "hardware",
    "agent",
    "lease",
    "tls",
    "control",
];

pub(super) struct Checker<'e> {
    pub(super) issues: Vec<ConfigIssue>,
    pub(super) env: &'e dyn Fn(&str) -> Option<String>,
    /// Every object checked, with the keys it accepts (`schema::accepted_keys`).
    pub(super) objects: Vec<(String, Vec<String>)>,
}

pub(super) fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        format!("{}…", &s[..s.floor_char_boundary(77)])
    } else {
        s
    }
}

/// The dotted path of `key` under `parent` (`""` for the root).
///
/// A key that a dotted path could not show (empty, or holding `.`, `[`, `]`, `"` or a space)
/// is written as a JSON string, so the path still says which key it is: `""`,
/// `serving."a.b"`.
pub(super) fn join(parent: &str, key: &str) -> String {
    let plain = !key.is_empty()
        && !key
            .chars()
            .any(|c| matches!(c, '.' | '[' | ']' | '"') || c.is_whitespace() || c.is_control());
    let key = if plain {
        key.to_string()
    } else {
        serde_json::Value::String(key.to_string()).to_string()
    };
    if parent.is_empty() {
        key
    } else {
        format!("{parent}.{key}")
    }
}

/// A checked object: remembers its dotted path.
pub(super) struct Obj<'v> {
    pub(super) path: String,
    pub(super) map: Option<&'v Map<String, Value>>,
}

impl<'v> Obj<'v> {
    fn get(&self, key: &str) -> Option<&'v Value> {
        self.map.and_then(|m| m.get(key)).filter(|v| !v.is_null())
    }
    fn p(&self, key: &str) -> String {
        join(&self.path, key)
    }
}

impl Checker<'_> {
    pub(super) fn rule(&mut self, path: String, v: &Value, rule: impl Into<String>) {
        self.issues.push(ConfigIssue::Rule {
            path,
            value: show(v),
            rule: rule.into(),
        });
    }

    pub(super) fn ty(&mut self, path: String, v: &Value, expected: &'static str) {
        self.issues.push(ConfigIssue::Type {
            path,
            expected,
            value: show(v),
        });
    }

    /// Check `v` is an object with only `known` keys (plus `_comments`).
    pub(super) fn obj<'v>(&mut self, path: &str, v: Option<&'v Value>, known: &[&str]) -> Obj<'v> {
        self.objects.push((
            path.to_string(),
            known.iter().map(|k| (*k).to_string()).collect(),
        ));
        let map = match v {
            None | Some(Value::Null) => None,
            Some(Value::Object(m)) => {
                for k in m.keys() {
                    if !k.starts_with('_') && !known.contains(&k.as_str()) {
                        self.issues.push(ConfigIssue::UnknownKey {
                            path: join(path, k),
                        });
                    }
                }
                Some(m)
            }
            Some(other) => {
                self.ty(path.to_string(), other, "an object");
                None
            }
        };
        Obj {
            path: path.to_string(),
            map,
        }
    }

    pub(super) fn num(
        &mut self,
        o: &Obj<'_>,
        key: &str,
        default: f64,
        check: fn(f64) -> Option<&'static str>,
    ) -> f64 {
        let Some(v) = o.get(key) else { return default };
        match v.as_f64() {
            Some(x) if v.is_number() => {
                if let Some(rule) = check(x) {
                    self.rule(o.p(key), v, rule);
                }
                x
            }
            _ => {
                self.ty(o.p(key), v, "a number");
                default
            }
        }
    }

    pub(super) fn int(&mut self, o: &Obj<'_>, key: &str, default: u64, min: u64, max: u64) -> u64 {
        let Some(v) = o.get(key) else { return default };
        match v.as_u64() {
            Some(x) => {
                if x < min || x > max {
                    let rule = if max == u64::MAX {
                        format!("must be an integer ≥ {min}")
                    } else {
                        format!("must be an integer in {min}..={max}")
                    };
                    self.rule(o.p(key), v, rule);
                }
                x
            }
            None if v.is_i64() => {
                self.rule(o.p(key), v, format!("must be an integer ≥ {min}"));
                default
            }
            None => {
                self.ty(o.p(key), v, "an integer");
                default
            }
        }
    }

    pub(super) fn boolean(&mut self, o: &Obj<'_>, key: &str, default: bool) -> bool {
        let Some(v) = o.get(key) else { return default };
        match v.as_bool() {
            Some(b) => b,
            None => {
                self.ty(o.p(key), v, "a boolean");
                default
            }
        }
    }

    pub(super) fn string(&mut self, o: &Obj<'_>, key: &str, default: &str) -> String {
        let Some(v) = o.get(key) else {
            return default.to_string();
        };
        match v.as_str() {
            Some(s) => s.to_string(),
            None => {
                self.ty(o.p(key), v, "a string");
                default.to_string()
            }
        }
    }

    pub(super) fn choice(
        &mut self,
        o: &Obj<'_>,
        key: &str,
        default: &'static str,
        allowed: &[&'static str],
    ) -> &'static str {
        let Some(v) = o.get(key) else { return default };
        match v.as_str() {
            Some(s) => match allowed.iter().find(|a| **a == s) {
                Some(a) => a,
                None => {
                    self.rule(
                        o.p(key),
                        v,
                        format!("must be one of {}", allowed.join(", ")),
                    );
                    default
                }
            },
            None => {
                self.ty(o.p(key), v, "a string");
                default
            }
        }
    }

    /// Validate the keys and primitive types of a section this version does not act on.
    pub(super) fn passive(&mut self, o: &Obj<'_>, keys: &[(&str, Kind)]) {
        for (k, kind) in keys {
            let Some(v) = o.get(k) else { continue };
            let ok = match kind {
                Kind::NonNegNum => v.as_f64().is_some_and(|x| x >= 0.0),
                Kind::PosNum => v.as_f64().is_some_and(|x| x > 0.0),
                Kind::Int => v.is_u64(),
                Kind::BoolOrNull => v.is_boolean(),
                Kind::Str => v.is_string(),
            };
            if !ok {
                let expected = match kind {
                    Kind::NonNegNum => "a number ≥ 0",
                    Kind::PosNum => "a number > 0",
                    Kind::Int => "an integer ≥ 0",
                    Kind::BoolOrNull => "a boolean",
                    Kind::Str => "a string",
                };
                self.ty(o.p(k), v, expected);
            }
        }
    }

    pub(super) fn env_ref(&mut self, path: String, raw: String) -> String {
        if let Some(name) = raw.strip_prefix("${").and_then(|r| r.strip_suffix('}')) {
            if name.is_empty() || name.contains('$') || name.contains('{') || name.contains('}') {
                self.rule(
                    path,
                    &Value::String(raw.clone()),
                    "malformed ${VAR} reference",
                );
                return raw;
            }
            match (self.env)(name) {
                Some(val) if !val.is_empty() && !val.contains("${") => return val,
                Some(val) if val.contains("${") => {
                    self.rule(
                        path,
                        &Value::String(raw.clone()),
                        format!("environment variable {name} contains another reference"),
                    );
                }
                _ => {
                    self.rule(
                        path,
                        &Value::String(raw.clone()),
                        format!("environment variable {name} is unset or empty"),
                    );
                }
            }
            raw
        } else if raw.contains("${") {
            self.rule(
                path,
                &Value::String(raw.clone()),
                "a ${VAR} reference must be the whole value",
            );
            raw
        } else {
            raw
        }
    }

    pub(super) fn fleet(&mut self, root: &Value) -> Option<Config> {
        let top = self.obj("", Some(root), TOP_KEYS);
        if top.map.is_none() {
            if !root.is_object() {
                // obj() already reported the type problem with an empty path; name it.
                self.issues.clear();
                self.ty("(fleet file)".into(), root, "an object");
            }
            return None;
        }
        let model = self.schema_and_model(&top);
        let adapters = self.adapters(top.get("adapters"), &model);
        let top_backend = top
            .get("backend")
            .is_some()
            .then(|| self.choice(&top, "backend", "vllm", &["vllm", "sglang"]));

        let engines = self.engines(top.get("engines"));

        let slo = self.slo(&top);

        let controller = self.controller(top.get("controller"), engines.len());
        let serving = self.serving(top.get("serving"));
        let engine = self.engine(top.get("engine"), &serving, engines.len());
        let recovery = self.recovery(top.get("recovery"));
        let (default_profile, engine_profiles) = self.profiles(top.get("profiles"));
        self.hardware(top.get("hardware"));
        let engine_contract = self.contract(top.get("engine_contract"));
        let agent = self.agent_section(top.get("agent"));
        let lease = self.lease(top.get("lease"));
        let tls = self.tls("tls", top.get("tls"));
        let control = self.obj("control", top.get("control"), &["tls", "self_drain"]);
        let control_tls = self.tls("control.tls", control.get("tls"));
        let self_drain = self.self_drain(control.get("self_drain"));

        let backend = self.backend(top_backend, &engine, &engines);
        let n = self.fleet_rules(&top, &engines, &controller, &recovery, tls.as_ref());
        let profiles = self.resolve_profiles(&engines, default_profile, engine_profiles);
        if serving.admission == AdmissionMode::Predictive && profiles.is_empty() && n > 0 {
            self.rule(
                "serving.admission".into(),
                &Value::from("predictive"),
                "predictive admission prices every request with the engine profiles: \
                 set profiles.default or profiles.engines.<iid>",
            );
        }
        Some(Config {
            model,
            adapters,
            backend,
            profiles,
            engines,
            slo,
            controller,
            serving,
            engine,
            recovery,
            agent,
            lease,
            tls,
            control_tls,
            self_drain,
            engine_contract,
        })
    }

    /// `schema` and `schema_version` (required, fixed), and `model`, a non-empty string.
    fn schema_and_model(&mut self, top: &Obj<'_>) -> String {
        match top.get("schema") {
            Some(Value::String(s)) if s == "narwhal.fleet" => {}
            Some(v) => self.rule("schema".into(), v, "must be \"narwhal.fleet\""),
            None => self.issues.push(ConfigIssue::Missing {
                path: "schema".into(),
            }),
        }
        match top.get("schema_version") {
            Some(v) if v.as_u64() == Some(2) => {}
            Some(v) => self.rule("schema_version".into(), v, "must be 2"),
            None => self.issues.push(ConfigIssue::Missing {
                path: "schema_version".into(),
            }),
        }
        match top.get("model") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(v) => {
                self.ty("model".into(), v, "a non-empty string");
                String::new()
            }
            None => {
                self.issues.push(ConfigIssue::Missing {
                    path: "model".into(),
                });
                String::new()
            }
        }
    }

    /// `slo` (required): `ttft_s` and `tpot_s`, both required and positive.
    fn slo(&mut self, top: &Obj<'_>) -> Slo {
        let slo_obj = self.obj("slo", top.get("slo"), &["ttft_s", "tpot_s"]);
        if top.get("slo").is_none() {
            self.issues
                .push(ConfigIssue::Missing { path: "slo".into() });
        }
        for k in ["ttft_s", "tpot_s"] {
            if slo_obj.map.is_some() && slo_obj.get(k).is_none() {
                self.issues
                    .push(ConfigIssue::Missing { path: slo_obj.p(k) });
            }
        }
        Slo {
            ttft_s: self.num(&slo_obj, "ttft_s", 1.0, positive),
            tpot_s: self.num(&slo_obj, "tpot_s", 0.1, positive),
        }
    }

    /// `agent`: the router's agent timeout and tolerated clock skew.
    fn agent_section(&mut self, v: Option<&Value>) -> AgentSection {
        let agent_obj = self.obj("agent", v, &["timeout_s", "max_skew_s"]);
        AgentSection {
            timeout_s: self.num(&agent_obj, "timeout_s", 10.0, positive),
            max_skew_s: self.num(&agent_obj, "max_skew_s", 30.0, non_negative),
        }
    }

    /// The backend (top-level `backend`, else `engine.backend`, else vLLM; the two must agree)
    /// and what it rules out: data-parallel ranks with SGLang, another dialect or connector.
    fn backend(
        &mut self,
        top_backend: Option<&str>,
        engine: &EngineSection,
        engines: &[EngineConfig],
    ) -> Backend {
        let backend = match (top_backend, engine.backend) {
            (Some(t), Some(e)) if t != e.as_str() => {
                self.issues.push(ConfigIssue::BackendMismatch {
                    top: t.to_string(),
                    engine: e.as_str().to_string(),
                });
                Backend::Vllm
            }
            (Some("sglang"), _) => Backend::Sglang,
            (Some(_), _) => Backend::Vllm,
            (None, Some(e)) => e,
            (None, None) => Backend::Vllm,
        };
        if backend == Backend::Sglang {
            // The router steers a request to a rank with vLLM's `X-data-parallel-rank`
            // header; SGLang's rank routing is not supported.
            for (i, e) in engines.iter().enumerate() {
                if let Some(k) = e.kv_events.as_ref().filter(|k| k.data_parallel_size > 1) {
                    self.rule(
                        format!("engines[{i}].kv_events.data_parallel_size"),
                        &Value::from(k.data_parallel_size),
                        "must be 1 with the sglang backend (the router steers requests to a \
                         data-parallel rank with vLLM's X-data-parallel-rank header only)",
                    );
                }
            }
        }
        if !engine.dialect.is_empty() && engine.dialect != backend.as_str() {
            self.rule(
                "engine.dialect".into(),
                &Value::String(engine.dialect.clone()),
                format!("must equal the backend ({backend})"),
            );
        }
        let default_connector = match backend {
            Backend::Vllm => "nixl",
            Backend::Sglang => "mooncake",
        };
        if !engine.connector.is_empty() && engine.connector != default_connector {
            self.rule(
                "engine.connector".into(),
                &Value::String(engine.connector.clone()),
                format!("backend {backend} supports only connector \"{default_connector}\""),
            );
        }
        backend
    }

    /// The rules across sections: engines present, the role floors within the engine count,
    /// an agent on every engine for whole-wave restarts, `tls` when agents are used. Returns
    /// the engine count.
    fn fleet_rules(
        &mut self,
        top: &Obj<'_>,
        engines: &[EngineConfig],
        controller: &Controller,
        recovery: &Recovery,
        tls: Option<&TlsFiles>,
    ) -> u32 {
        if top.get("engines").is_some()
            && engines.is_empty()
            && top.get("engines").is_some_and(Value::is_array)
        {
            self.issues.push(ConfigIssue::NoEngines);
        }
        if top.get("engines").is_none() {
            self.issues.push(ConfigIssue::Missing {
                path: "engines".into(),
            });
        }
        let n = engines.len() as u32;
        if n > 0
            && !(n == 1 && controller.min_prefill == 1 && controller.min_decode == 1)
            && controller.min_prefill + controller.min_decode > n
        {
            self.rule(
                "controller.min_prefill".into(),
                &Value::from(controller.min_prefill),
                format!(
                    "min_prefill + min_decode ({}) exceeds the engine count ({n})",
                    controller.min_prefill + controller.min_decode
                ),
            );
        }
        // architecture.md 9.2: process identity comes from the agents, so whole-wave restarts need
        // an agent on every engine rather than an engine_contract.
        if recovery.engine_restart_policy == RestartPolicy::WholeWave
            && engines.iter().any(|e| e.agent.is_none())
        {
            self.rule(
                "recovery.engine_restart_policy".into(),
                &Value::from("whole_wave"),
                "whole_wave requires engines[].agent on every engine",
            );
        }
        if tls.is_none() && engines.iter().any(|e| e.agent.is_some()) {
            self.issues.push(ConfigIssue::Missing {
                path:
                    "tls (required by engines[].agent: the router talks to agents over mutual TLS)"
                        .into(),
            });
        }
        n
    }

    /// `adapters`: the LoRA adapters every engine serves beside `model`, each a non-empty
    /// string named once and not the model itself (a request's `model` may name one; its
    /// blocks are keyed by it, docs/design/kv-aware-placement.md).
    fn adapters(&mut self, v: Option<&Value>, model: &str) -> Vec<String> {
        let Some(v) = v else {
            return Vec::new();
        };
        let Some(items) = v.as_array() else {
            self.ty("adapters".into(), v, "an array of adapter names");
            return Vec::new();
        };
        let mut out: Vec<String> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let path = format!("adapters[{i}]");
            match item.as_str() {
                Some("") => self.rule(path, item, "must not be empty"),
                Some(name) if name == model => {
                    self.rule(path, item, "names the base model; list only its adapters");
                }
                Some(name) if out.iter().any(|o| o == name) => {
                    self.rule(path, item, "is listed twice");
                }
                Some(name) => out.push(name.to_string()),
                None => self.ty(path, item, "a non-empty string"),
            }
        }
        out
    }

    /// One profile per engine in config order, or none at all (controller.md 3.4: every
    /// price goes through a profile, so a partial set is an error naming the engines left
    /// out); a profile for an unknown engine is an error too.
    pub(super) fn resolve_profiles(
        &mut self,
        engines: &[EngineConfig],
        default: Option<Profile>,
        named: Vec<(String, Profile)>,
    ) -> Vec<Profile> {
        for (iid, _) in &named {
            if !engines.iter().any(|e| &e.iid == iid) {
                self.rule(
                    format!("profiles.engines.{iid}"),
                    &Value::from(iid.as_str()),
                    "names no configured engine",
                );
            }
        }
        if default.is_none() && named.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut missing = Vec::new();
        for e in engines {
            match named.iter().find(|(i, _)| *i == e.iid).map(|(_, p)| p) {
                Some(p) => out.push(p.clone()),
                None => match &default {
                    Some(d) => out.push(d.clone()),
                    None => missing.push(e.iid.clone()),
                },
            }
        }
        if !missing.is_empty() {
            self.rule(
                "profiles.engines".into(),
                &Value::from(missing.join(", ")),
                "these engines have no profile (give every engine one, or set profiles.default)",
            );
            return Vec::new();
        }
        out
    }
}

#[derive(Clone, Copy)]
pub(super) enum Kind {
    NonNegNum,
    PosNum,
    Int,
    BoolOrNull,
    Str,
}

pub(super) fn positive(x: f64) -> Option<&'static str> {
    (x <= 0.0).then_some("must be > 0")
}

pub(super) fn non_negative(x: f64) -> Option<&'static str> {
    (x < 0.0).then_some("must be ≥ 0")
}
