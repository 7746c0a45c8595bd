//! The `engines`, `engine`, `tls`, `engine_contract` and `hardware` sections: each engine's
//! url, role, agent and health path, the engine limits, the TLS files and the contract.

use std::path::PathBuf;

use serde_json::Value;

use super::{Checker, Kind, non_negative, positive};
use crate::config::{
    Backend, ConfigIssue, EngineAgent, EngineConfig, EngineSection, KvEventsSource, KvRole, Role,
    Serving, TlsFiles,
};

/// A KV-event socket as compared across engines: `tcp://host:port` with the host lowercased and
/// `localhost` read as `127.0.0.1`.
/// The most data-parallel ranks one engine's `kv_events` may name.
const MAX_DP_RANKS: u64 = 64;

fn socket_key(endpoint: &str) -> String {
    let rest = endpoint.strip_prefix("tcp://").unwrap_or(endpoint);
    let (host, port) = rest.rsplit_once(':').unwrap_or((rest, ""));
    let host = host.to_ascii_lowercase();
    let host = if host == "localhost" {
        "127.0.0.1".to_string()
    } else {
        host
    };
    format!("tcp://{host}:{port}")
}

impl Checker<'_> {
    pub(super) fn engines(&mut self, v: Option<&Value>) -> Vec<EngineConfig> {
        let Some(v) = v else { return Vec::new() };
        let Some(items) = v.as_array() else {
            self.ty("engines".into(), v, "an array");
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut seen: Vec<(String, usize)> = Vec::new();
        // Every KV-event socket named so far: (socket, engine index, iid, key).
        let mut sockets: Vec<(String, usize, String, String)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let path = format!("engines[{i}]");
            let o = self.obj(
                &path,
                Some(item),
                &[
                    "iid",
                    "url",
                    "role",
                    "pin",
                    "kv_role",
                    "attestation_url",
                    "shared_device",
                    "agent",
                    "health_path",
                    "kv_events",
                ],
            );
            if o.map.is_none() {
                continue;
            }
            let iid = self.engine_iid(&o);
            let url = self.engine_url(&o);
            let (role, pin, kv_role) = self.engine_role(&o);
            let raw_att = self.string(&o, "attestation_url", "");
            let attestation_url = self.env_ref(o.p("attestation_url"), raw_att);
            self.shared_device(&o);
            let agent = self.engine_agent(&o);
            if !iid.is_empty() {
                if let Some((_, first)) = seen.iter().find(|(s, _)| *s == iid) {
                    self.issues.push(ConfigIssue::DuplicateIid {
                        iid: iid.clone(),
                        first: *first,
                        second: i,
                    });
                } else {
                    seen.push((iid.clone(), i));
                }
            }
            let health_path = self.health_path(&o);
            let kv_events = self.kv_events(&o);
            if let Some(k) = &kv_events {
                self.one_publisher_per_socket(&mut sockets, k, i, &iid);
            }
            out.push(EngineConfig {
                iid,
                url,
                role,
                pin,
                kv_role,
                attestation_url,
                agent,
                health_path,
                kv_events,
            });
        }
        out
    }

    /// `engines[i].iid`: a non-empty string (empty when missing or mistyped).
    fn engine_iid(&mut self, o: &super::Obj<'_>) -> String {
        match o.get("iid") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(v) => {
                self.ty(o.p("iid"), v, "a non-empty string");
                String::new()
            }
            None => {
                self.issues.push(ConfigIssue::Missing { path: o.p("iid") });
                String::new()
            }
        }
    }

    /// `engines[i].url`: an http:// or https:// URL (or `${VAR}`), without its trailing `/`.
    fn engine_url(&mut self, o: &super::Obj<'_>) -> String {
        match o.get("url") {
            Some(Value::String(s)) if !s.is_empty() => {
                let s = self.env_ref(o.p("url"), s.clone());
                if !(s.starts_with("http://") || s.starts_with("https://") || s.starts_with("${")) {
                    self.rule(
                        o.p("url"),
                        &Value::String(s.clone()),
                        "must be an http:// or https:// URL",
                    );
                }
                s.trim_end_matches('/').to_string()
            }
            Some(v) => {
                self.ty(o.p("url"), v, "a non-empty string");
                String::new()
            }
            None => {
                self.issues.push(ConfigIssue::Missing { path: o.p("url") });
                String::new()
            }
        }
    }

    /// `engines[i].role`, `pin` and `kv_role`; a fixed-role `kv_role` must match the role.
    fn engine_role(&mut self, o: &super::Obj<'_>) -> (Role, bool, KvRole) {
        let role = match self.choice(o, "role", "decode", &["prefill", "decode"]) {
            "prefill" => Role::Prefill,
            _ => Role::Decode,
        };
        let pin = self.boolean(o, "pin", false);
        let kv_role = match self.choice(
            o,
            "kv_role",
            "kv_both",
            &["kv_both", "kv_producer", "kv_consumer"],
        ) {
            "kv_producer" => KvRole::Producer,
            "kv_consumer" => KvRole::Consumer,
            _ => KvRole::Both,
        };
        if let Some(fixed) = kv_role.fixed_role()
            && fixed != role
        {
            self.rule(
                o.p("kv_role"),
                &Value::String(kv_role.as_str().into()),
                format!(
                    "a {} engine serves only the {} leg: its role must be \"{}\"",
                    kv_role.as_str(),
                    fixed.as_str(),
                    fixed.as_str()
                ),
            );
        }
        (role, pin, kv_role)
    }

    /// `engines[i].shared_device`: read and type-checked, not used.
    fn shared_device(&mut self, o: &super::Obj<'_>) {
        let sd = self.obj(
            &o.p("shared_device"),
            o.get("shared_device"),
            &[
                "group",
                "gpu_uuid",
                "device_allowance",
                "gpu_memory_utilization",
            ],
        );
        self.passive(
            &sd,
            &[
                ("group", Kind::Str),
                ("gpu_uuid", Kind::Str),
                ("device_allowance", Kind::NonNegNum),
                ("gpu_memory_utilization", Kind::PosNum),
            ],
        );
    }

    /// `engines[i].agent`: the engine's agent (url, server name, ed25519 key, agent id).
    fn engine_agent(&mut self, o: &super::Obj<'_>) -> Option<EngineAgent> {
        let av = o.get("agent")?;
        let a = self.obj(
            &o.p("agent"),
            Some(av),
            &["url", "server_name", "public_key", "agent_id"],
        );
        if a.map.is_none() {
            None
        } else {
            let req = |c: &mut Self, k: &str| match a.get(k) {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                Some(v) => {
                    c.ty(a.p(k), v, "a non-empty string");
                    String::new()
                }
                None => {
                    c.issues.push(ConfigIssue::Missing { path: a.p(k) });
                    String::new()
                }
            };
            let url = req(self, "url");
            let server_name = req(self, "server_name");
            let public_key = req(self, "public_key");
            if !public_key.is_empty() && !public_key.starts_with("ed25519:") {
                self.rule(
                    a.p("public_key"),
                    &Value::String(public_key.clone()),
                    "must start with \"ed25519:\"",
                );
            }
            let agent_id = match a.get("agent_id") {
                None => server_name.clone(),
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                Some(v) => {
                    self.ty(a.p("agent_id"), v, "a non-empty string");
                    String::new()
                }
            };
            Some(EngineAgent {
                url: url.trim_end_matches('/').to_string(),
                server_name,
                public_key,
                agent_id,
            })
        }
    }

    /// `engines[i].health_path`: a path starting with `/`, no query or fragment.
    fn health_path(&mut self, o: &super::Obj<'_>) -> String {
        let health_path = self.string(o, "health_path", "/health");
        if !health_path.starts_with('/') || health_path.contains(['?', '#', ' ']) {
            self.rule(
                o.p("health_path"),
                &Value::String(health_path.clone()),
                "must be a path starting with / (no query, e.g. \"/health\" or \"/v1/models\")",
            );
        }
        health_path
    }

    /// Refuses a KV-event socket (`endpoint` or `replay_endpoint`) that an earlier engine
    /// already names, naming both engines: one socket is one engine's publisher, and two
    /// engines reading it would credit one with the other's blocks while it looks `exact`
    /// (docs/design/kv-aware-placement.md). Hosts compare case-blind, `localhost` as
    /// `127.0.0.1`.
    fn one_publisher_per_socket(
        &mut self,
        sockets: &mut Vec<(String, usize, String, String)>,
        k: &KvEventsSource,
        i: usize,
        iid: &str,
    ) {
        let named = [
            ("endpoint", Some(&k.endpoint)),
            ("replay_endpoint", k.replay_endpoint.as_ref()),
        ];
        // Each data-parallel rank publishes on the ports plus its rank: with vLLM's defaults
        // (5557 and 5558) rank 1's PUB is rank 0's replay port.
        let ranked = named.into_iter().flat_map(|(key, ep)| {
            (0..k.data_parallel_size).filter_map(move |r| {
                let ep = ep.filter(|e| !e.is_empty())?;
                let label = if r == 0 {
                    key.to_string()
                } else {
                    format!("{key} (rank {r}: {})", super::super::offset_port(ep, r))
                };
                Some((label, super::super::offset_port(ep, r)))
            })
        });
        for (key, ep) in ranked {
            let ep = &ep;
            let socket = socket_key(ep);
            if let Some((_, j, _, other_key)) = sockets
                .iter()
                .find(|(s, ..)| *s == socket)
                .filter(|(_, j, ..)| *j == i)
            {
                self.rule(
                    format!("engines[{i}].kv_events.{key}"),
                    &Value::String(ep.clone()),
                    format!(
                        "is also engines[{j}].kv_events.{other_key}: each data-parallel rank \
                         binds the ports plus its rank, so endpoint and replay_endpoint must be \
                         at least data_parallel_size ({}) apart",
                        k.data_parallel_size
                    ),
                );
            } else if let Some((_, j, other, other_key)) =
                sockets.iter().find(|(s, ..)| *s == socket)
            {
                self.rule(
                    format!("engines[{i}].kv_events.{key}"),
                    &Value::String(ep.clone()),
                    format!(
                        "is also engines[{j}].kv_events.{other_key} (engine {other:?}); one socket \
                         publishes one engine's KV events, so engine {iid:?} would be credited \
                         with {other:?}'s blocks (each engine, and each data-parallel rank, \
                         binds its own port)"
                    ),
                );
            } else {
                sockets.push((socket, i, iid.to_string(), key));
            }
        }
    }

    /// `engines[i].kv_events`: `endpoint` required, `replay_endpoint` optional, both
    /// `tcp://HOST:PORT` the router connects to (no `*`: that is the engine's bind address).
    fn kv_events(&mut self, o: &super::Obj<'_>) -> Option<KvEventsSource> {
        let v = o.get("kv_events")?;
        let k = self.obj(
            &o.p("kv_events"),
            Some(v),
            &["endpoint", "replay_endpoint", "topic", "data_parallel_size"],
        );
        k.map?;
        let endpoint = |c: &mut Self, key: &str, required: bool| match k.get(key) {
            Some(Value::String(s)) => {
                let ok = s
                    .strip_prefix("tcp://")
                    .and_then(|rest| rest.rsplit_once(':'))
                    .is_some_and(|(host, port)| {
                        !host.is_empty()
                            && !host.contains('*')
                            && port.parse::<u16>().is_ok_and(|p| p > 0)
                    });
                if !ok {
                    c.rule(
                        k.p(key),
                        &Value::String(s.clone()),
                        "must be tcp://HOST:PORT the router connects to (not a `*` bind address)",
                    );
                }
                Some(s.clone())
            }
            Some(v) => {
                c.ty(k.p(key), v, "a string");
                None
            }
            None => {
                if required {
                    c.issues.push(ConfigIssue::Missing { path: k.p(key) });
                }
                None
            }
        };
        let ep = endpoint(self, "endpoint", true);
        let replay_endpoint = endpoint(self, "replay_endpoint", false);
        let topic = self.string(&k, "topic", "");
        let data_parallel_size = self.int(&k, "data_parallel_size", 1, 1, MAX_DP_RANKS) as u32;
        for (key, e) in [
            ("endpoint", ep.as_ref()),
            ("replay_endpoint", replay_endpoint.as_ref()),
        ] {
            let last = e
                .and_then(|e| e.rsplit_once(':'))
                .and_then(|(_, p)| p.parse::<u32>().ok())
                .map(|p| p + data_parallel_size - 1);
            if last.is_some_and(|p| p > u32::from(u16::MAX)) {
                self.rule(
                    k.p(key),
                    &Value::String(e.cloned().unwrap_or_default()),
                    format!(
                        "its port plus data_parallel_size - 1 ({}) must be a port (rank r \
                         publishes on the port plus r)",
                        last.unwrap_or_default()
                    ),
                );
            }
        }
        Some(KvEventsSource {
            endpoint: ep.unwrap_or_default(),
            replay_endpoint,
            topic,
            data_parallel_size,
        })
    }

    pub(super) fn engine(
        &mut self,
        v: Option<&Value>,
        serving: &Serving,
        _n: usize,
    ) -> EngineSection {
        let o = self.obj(
            "engine",
            v,
            &[
                "backend",
                "connector",
                "dialect",
                "tokenize",
                "tokenizer",
                "chars_per_token",
                "tokenize_timeout_s",
                "engine_api_key_env",
                "control_connections",
                "pool_timeout_s",
                "connect_timeout_s",
                "health_timeout_s",
                "decode_read_timeout_s",
                "first_token_timeout_s",
                "kv_transfer_timeout_s",
                "first_token_calibration_path",
            ],
        );
        let backend = o.get("backend").is_some().then(|| {
            match self.choice(&o, "backend", "vllm", &["vllm", "sglang"]) {
                "sglang" => Backend::Sglang,
                _ => Backend::Vllm,
            }
        });
        let engine_api_key_env = self.string(&o, "engine_api_key_env", "");
        let engine_api_key = if engine_api_key_env.is_empty() {
            None
        } else {
            let val = (self.env)(&engine_api_key_env).filter(|s| !s.is_empty());
            if val.is_none() {
                self.rule(
                    "engine.engine_api_key_env".into(),
                    &Value::String(engine_api_key_env.clone()),
                    "names an environment variable that is unset or empty",
                );
            }
            val
        };
        let e = EngineSection {
            backend,
            connector: self.string(&o, "connector", ""),
            dialect: self.string(&o, "dialect", ""),
            tokenize: self.boolean(&o, "tokenize", true),
            tokenizer: Some(self.string(&o, "tokenizer", "")).filter(|s| !s.is_empty()),
            chars_per_token: self.num(&o, "chars_per_token", 3.8, positive),
            tokenize_timeout_s: self.num(&o, "tokenize_timeout_s", 2.0, positive),
            engine_api_key_env,
            engine_api_key,
            control_connections: self.int(&o, "control_connections", 0, 0, u64::MAX),
            pool_timeout_s: self.num(&o, "pool_timeout_s", 5.0, positive),
            connect_timeout_s: self.num(&o, "connect_timeout_s", 10.0, positive),
            health_timeout_s: self.num(&o, "health_timeout_s", 5.0, positive),
            decode_read_timeout_s: self.num(&o, "decode_read_timeout_s", 10.0, non_negative),
            first_token_timeout_s: self.num(&o, "first_token_timeout_s", 2.5, positive),
            kv_transfer_timeout_s: self.num(&o, "kv_transfer_timeout_s", 30.0, positive),
            first_token_calibration_path: self.string(&o, "first_token_calibration_path", ""),
        };
        if e.first_token_timeout_s > serving.request_timeout_s {
            self.rule(
                "engine.first_token_timeout_s".into(),
                &Value::from(e.first_token_timeout_s),
                format!(
                    "must be ≤ serving.request_timeout_s ({})",
                    serving.request_timeout_s
                ),
            );
        }
        e
    }

    pub(super) fn tls(&mut self, path: &str, v: Option<&Value>) -> Option<TlsFiles> {
        let o = self.obj(path, v, &["ca", "cert", "key"]);
        o.map?;
        let f = |c: &mut Self, k: &str| match o.get(k) {
            Some(Value::String(s)) if !s.is_empty() => PathBuf::from(s),
            Some(v) => {
                c.ty(o.p(k), v, "a non-empty path string");
                PathBuf::new()
            }
            None => {
                c.issues.push(ConfigIssue::Missing { path: o.p(k) });
                PathBuf::new()
            }
        };
        Some(TlsFiles {
            ca: f(self, "ca"),
            cert: f(self, "cert"),
            key: f(self, "key"),
        })
    }

    pub(super) fn contract(&mut self, v: Option<&Value>) -> Option<Value> {
        let v = v?;
        let o = self.obj(
            "engine_contract",
            Some(v),
            &[
                "engine_version",
                "image_digest",
                "transfer_version",
                "connector_version",
                "model_architecture",
                "model_dtype",
                "kv_heads",
                "head_size",
                "hidden_layers",
                "attention_backend",
                "kv_cache_dtype",
                "cross_layers_blocks",
                "hybrid_kv_cache_manager",
                "connector",
                "kv_role",
                "transfer_mode",
                "speculative_config",
                "enforce_handshake_compat",
            ],
        );
        o.map?;
        self.passive(
            &o,
            &[
                ("engine_version", Kind::Str),
                ("image_digest", Kind::Str),
                ("transfer_version", Kind::Str),
                ("connector_version", Kind::Int),
                ("model_architecture", Kind::Str),
                ("model_dtype", Kind::Str),
                ("kv_heads", Kind::Int),
                ("head_size", Kind::Int),
                ("hidden_layers", Kind::Int),
                ("attention_backend", Kind::Str),
                ("kv_cache_dtype", Kind::Str),
                ("cross_layers_blocks", Kind::BoolOrNull),
                ("hybrid_kv_cache_manager", Kind::BoolOrNull),
                ("connector", Kind::Str),
                ("kv_role", Kind::Str),
                ("transfer_mode", Kind::Str),
                ("speculative_config", Kind::Str),
                ("enforce_handshake_compat", Kind::BoolOrNull),
            ],
        );
        for k in ["engine_version", "connector"] {
            if o.get(k).and_then(Value::as_str).is_none_or(str::is_empty) {
                self.issues.push(ConfigIssue::Missing { path: o.p(k) });
            }
        }
        if let Some(d) = o.get("image_digest").and_then(Value::as_str)
            && !d.is_empty()
            && !(d.len() == 71
                && d.starts_with("sha256:")
                && d[7..]
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
        {
            self.rule(
                o.p("image_digest"),
                &Value::String(d.to_string()),
                "must be \"\" or sha256:<64 lowercase hex>",
            );
        }
        Some(v.clone())
    }

    pub(super) fn hardware(&mut self, v: Option<&Value>) {
        let o = self.obj(
            "hardware",
            v,
            &["accelerator", "accelerators_per_engine", "tensor_parallel"],
        );
        if o.map.is_none() {
            return;
        }
        let acc = self.string(&o, "accelerator", "");
        if acc.is_empty() {
            self.issues.push(ConfigIssue::Missing {
                path: o.p("accelerator"),
            });
        }
        let per = self.int(&o, "accelerators_per_engine", 1, 1, u64::MAX);
        let tp = self.int(&o, "tensor_parallel", 1, 1, u64::MAX);
        if tp > per {
            self.rule(
                o.p("tensor_parallel"),
                &Value::from(tp),
                format!("must be ≤ accelerators_per_engine ({per})"),
            );
        }
    }
}
