//! Unit tests of the fleet-file validator.

use super::*;

fn no_env(_: &str) -> Option<String> {
    None
}

fn base() -> Value {
    serde_json::json!({
        "schema": "narwhal.fleet", "schema_version": 2,
        "_about": "comment",
        "model": "tiny-sim",
        "backend": "vllm",
        "engines": [
            {"iid": "p0", "url": "http://127.0.0.1:1/", "role": "prefill"},
            {"iid": "d0", "url": "http://127.0.0.1:2"}
        ],
        "slo": {"ttft_s": 2.0, "tpot_s": 0.05}
    })
}

fn issues(v: Value) -> Vec<ConfigIssue> {
    match Config::from_json_str(&v.to_string(), &no_env) {
        Ok(_) => panic!("expected issues"),
        Err(ParseError::Invalid(i)) => i,
        Err(e) => panic!("unexpected {e}"),
    }
}

fn messages(v: Value) -> Vec<String> {
    issues(v).iter().map(ToString::to_string).collect()
}

#[test]
fn minimal_fleet_gets_reference_defaults() {
    let c = Config::from_json_str(&base().to_string(), &no_env).unwrap();
    assert_eq!(c.engines[0].url, "http://127.0.0.1:1");
    assert_eq!(c.engines[0].role, Role::Prefill);
    assert_eq!(c.engines[1].role, Role::Decode);
    assert_eq!(c.serving.max_connections, 768);
    assert_eq!(c.serving.max_attempts, 2);
    assert_eq!(c.serving.max_request_bytes, 4_194_304);
    assert_eq!(c.engine.first_token_timeout_s, 2.5);
    assert_eq!(c.engine.kv_transfer_timeout_s, 30.0);
    assert_eq!(c.engine.decode_read_timeout_s, 10.0);
    assert_eq!(c.recovery.eject_after, 3);
    assert_eq!(c.controller.monitor_interval_s, 1.0);
    assert_eq!(c.lease.backend, LeaseBackend::None);
    assert_eq!(c.backend, Backend::Vllm);
}

/// The engine-health keys (docs/configuration.md): defaults, and a bad
/// value named by its dotted path.
#[test]
fn health_keys_have_defaults_and_name_their_path() {
    let c = Config::from_json_str(&base().to_string(), &no_env).unwrap();
    assert_eq!(c.engines[0].health_path, "/health");
    assert_eq!(c.recovery.max_ejection_percent, 50);
    assert_eq!(c.recovery.max_readmit_interval_s, 300.0);
    assert_eq!(c.recovery.liveness_misses, 2);
    let mut v = base();
    v["engines"][1]["health_path"] = "/v1/models".into();
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(c.engines[1].health_path, "/v1/models");
    let mut v = base();
    v["engines"][0]["health_path"] = "health".into();
    v["engines"][1]["health_path"] = "/health?full=1".into();
    v["recovery"] = serde_json::json!({"max_ejection_percent": 0,
                                      "max_readmit_interval_s": -1});
    let m = messages(v);
    assert!(
        m.iter()
            .any(|x| x.starts_with("engines[0].health_path = \"health\": must be a path")),
        "{m:?}"
    );
    assert!(
        m.iter().any(|x| x.starts_with("engines[1].health_path = ")),
        "{m:?}"
    );
    assert!(
        m.contains(&"recovery.max_ejection_percent = 0: must be an integer in 1..=100".to_string()),
        "{m:?}"
    );
    assert!(
        m.contains(&"recovery.max_readmit_interval_s = -1: must be > 0".to_string()),
        "{m:?}"
    );
    assert_eq!(m.len(), 4, "{m:?}");
}

#[test]
fn example_fleet_file_parses() {
    let text = include_str!("../../testdata/reference-fleet.example.json");
    let c = Config::from_json_str(text, &no_env).unwrap();
    assert_eq!(c.engines.len(), 4);
    assert_eq!(c.lease.backend, LeaseBackend::Etcd);
    assert!(c.control_tls.is_some());
}

/// An unknown key that a dotted path cannot show is named as JSON: the empty key was named
/// by nothing at all. Found by the `fleet_config` fuzz target
/// (tests/fuzz/regressions/fleet_config/empty_key).
#[test]
fn unknown_keys_a_dotted_path_cannot_show_are_named_as_json() {
    let mut v = base();
    v[""] = 1.into();
    v["serving"] = serde_json::json!({"a.b": 2, "": 3});
    let mut m = messages(v);
    m.sort();
    assert_eq!(
        m,
        [
            "\"\": unknown key",
            "serving.\"\": unknown key",
            "serving.\"a.b\": unknown key"
        ],
    );
}

#[test]
fn unknown_keys_name_their_dotted_path_and_all_are_reported() {
    let mut v = base();
    v["engines"][1]["rol"] = "decode".into();
    v["serving"] = serde_json::json!({"max_atempts": 2, "_note": "ok"});
    v["bogus"] = 1.into();
    let m = messages(v);
    assert!(
        m.contains(&"engines[1].rol: unknown key".to_string()),
        "{m:?}"
    );
    assert!(
        m.contains(&"serving.max_atempts: unknown key".to_string()),
        "{m:?}"
    );
    assert!(m.contains(&"bogus: unknown key".to_string()), "{m:?}");
    assert_eq!(m.len(), 3);
}

#[test]
fn type_errors_name_key_and_value() {
    let mut v = base();
    v["serving"] = serde_json::json!({"max_attempts": true, "request_timeout_s": "600"});
    v["engines"][0]["pin"] = "yes".into();
    let m = messages(v);
    assert!(
        m.contains(&"serving.max_attempts must be an integer, got true".to_string()),
        "{m:?}"
    );
    assert!(
        m.contains(&"serving.request_timeout_s must be a number, got \"600\"".to_string()),
        "{m:?}"
    );
    assert!(
        m.contains(&"engines[0].pin must be a boolean, got \"yes\"".to_string()),
        "{m:?}"
    );
}

#[test]
fn range_errors_name_key_value_and_rule() {
    let mut v = base();
    v["serving"] = serde_json::json!({"max_attempts": 4, "retry_base_s": 2.0});
    v["slo"]["ttft_s"] = 0.into();
    v["engines"][0]["role"] = "both".into();
    let m = messages(v);
    assert!(
        m.contains(&"serving.max_attempts = 4: must be an integer in 1..=3".to_string()),
        "{m:?}"
    );
    assert!(
        m.contains(&"slo.ttft_s = 0: must be > 0".to_string()),
        "{m:?}"
    );
    assert!(
        m.iter()
            .any(|s| s.starts_with("serving.retry_cap_s = 1.0: must be ≥")),
        "{m:?}"
    );
    assert!(
        m.contains(&"engines[0].role = \"both\": must be one of prefill, decode".to_string()),
        "{m:?}"
    );
}

/// The request-path keys `serving.body_read_timeout_s` and `serving.max_batch_prompts`:
/// defaults, and range errors naming the dotted path.
#[test]
fn body_read_timeout_and_batch_limit_are_validated() {
    let c = Config::from_json_str(&base().to_string(), &no_env).unwrap();
    assert_eq!(c.serving.body_read_timeout_s, 30.0);
    assert_eq!(c.serving.max_batch_prompts, 64);
    let mut v = base();
    v["serving"] = serde_json::json!({"body_read_timeout_s": 0, "max_batch_prompts": 0});
    let m = messages(v);
    assert!(
        m.contains(&"serving.body_read_timeout_s = 0: must be > 0".to_string()),
        "{m:?}"
    );
    assert!(
        m.iter()
            .any(|s| s
                .starts_with("serving.max_batch_prompts = 0: must be an integer in 1..=4096")),
        "{m:?}"
    );
    let mut v = base();
    v["serving"] = serde_json::json!({"body_read_timeout_s": 2.5, "max_batch_prompts": 8});
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(
        (c.serving.body_read_timeout_s, c.serving.max_batch_prompts),
        (2.5, 8)
    );
}

#[test]
fn float_for_integer_is_refused() {
    let mut v = base();
    v["serving"] = serde_json::json!({"max_connections": 5.0});
    assert_eq!(
        messages(v),
        vec!["serving.max_connections must be an integer, got 5.0".to_string()]
    );
}

#[test]
fn duplicate_iid_and_no_engines() {
    let mut v = base();
    v["engines"][1]["iid"] = "p0".into();
    assert_eq!(
        issues(v),
        vec![ConfigIssue::DuplicateIid {
            iid: "p0".into(),
            first: 0,
            second: 1
        }]
    );
    let mut v = base();
    v["engines"] = serde_json::json!([]);
    assert!(issues(v).contains(&ConfigIssue::NoEngines));
}

/// An engine's data-parallel ranks publish on its ports plus their rank: with vLLM's default
/// ports (5557, 5558) and two ranks, rank 1's PUB is rank 0's replay socket, refused naming
/// both keys; ranks that reach another engine's ports are refused naming it; a size that runs
/// the ports past 65535, or 0, is refused; spaced ports pass, each rank's sockets the ports
/// plus its rank; the sglang backend refuses more than one rank.
#[test]
fn data_parallel_ranks_need_ports_of_their_own() {
    let kv = |ep: &str, replay: &str, dp: u64| serde_json::json!({"endpoint": ep, "replay_endpoint": replay, "data_parallel_size": dp});
    let mut v = base();
    v["engines"][0]["kv_events"] = kv("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", 2);
    let m = messages(v);
    assert!(
        m.len() == 1
            && m[0].contains("engines[0].kv_events.endpoint (rank 1: tcp://127.0.0.1:5558)")
            && m[0].contains("engines[0].kv_events.replay_endpoint")
            && m[0].contains("data_parallel_size (2) apart"),
        "{m:?}"
    );
    let mut v = base();
    v["engines"][0]["kv_events"] = kv("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5567", 4);
    v["engines"][1]["kv_events"] = kv("tcp://127.0.0.1:5560", "tcp://127.0.0.1:5580", 1);
    let m = messages(v);
    assert!(
        m.len() == 1
            && m[0].contains("engines[1].kv_events.endpoint")
            && m[0].contains("rank 3")
            && m[0].contains("\"p0\""),
        "{m:?}"
    );
    for (dp, port) in [(0, 5557), (65, 5557), (3, 65534)] {
        let mut v = base();
        v["engines"][0]["kv_events"] = kv(
            &format!("tcp://127.0.0.1:{port}"),
            "tcp://127.0.0.1:7000",
            dp,
        );
        assert!(
            messages(v)
                .iter()
                .any(|x| x.contains("engines[0].kv_events")),
            "dp {dp} at {port}"
        );
    }
    let mut v = base();
    v["engines"][0]["kv_events"] = kv("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5567", 4);
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    let k = c.engines[0].kv_events.clone().expect("kv_events");
    assert_eq!(k.data_parallel_size, 4);
    let r3 = k.rank(3);
    assert_eq!(r3.endpoint, "tcp://127.0.0.1:5560");
    assert_eq!(r3.replay_endpoint.as_deref(), Some("tcp://127.0.0.1:5570"));
    v["backend"] = serde_json::json!("sglang");
    let m = messages(v);
    assert!(
        m.iter()
            .any(|x| x.contains("engines[0].kv_events.data_parallel_size")),
        "{m:?}"
    );
}

/// Two engines naming one KV-event socket (as `endpoint` or `replay_endpoint`, `localhost` for
/// `127.0.0.1` included) are refused, naming both engines; distinct sockets pass.
#[test]
fn two_engines_sharing_a_kv_event_socket_are_refused_naming_both() {
    let kv =
        |ep: &str, replay: &str| serde_json::json!({"endpoint": ep, "replay_endpoint": replay});
    let mut v = base();
    v["engines"][0]["kv_events"] = kv("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558");
    v["engines"][1]["kv_events"] = kv("tcp://LOCALHOST:5557", "tcp://127.0.0.1:6558");
    let m = messages(v);
    assert_eq!(m.len(), 1, "{m:?}");
    assert!(
        m[0].contains("engines[1].kv_events.endpoint")
            && m[0].contains("engines[0].kv_events.endpoint")
            && m[0].contains("\"p0\"")
            && m[0].contains("\"d0\""),
        "{m:?}"
    );
    let mut v = base();
    v["engines"][0]["kv_events"] = kv("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558");
    v["engines"][1]["kv_events"] = kv("tcp://127.0.0.1:5558", "tcp://127.0.0.1:6558");
    let m = messages(v);
    assert!(
        m.len() == 1 && m[0].contains("engines[0].kv_events.replay_endpoint"),
        "a replay socket is a socket too: {m:?}"
    );
    let mut v = base();
    v["engines"][0]["kv_events"] = kv("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558");
    v["engines"][1]["kv_events"] = kv("tcp://127.0.0.1:6557", "tcp://127.0.0.1:6558");
    assert!(Config::from_json_str(&v.to_string(), &no_env).is_ok());
}

#[test]
fn missing_required_keys() {
    let v = serde_json::json!({"schema": "narwhal.fleet", "schema_version": 2});
    let m = messages(v);
    for want in [
        "model: required key is missing",
        "engines: required key is missing",
        "slo: required key is missing",
    ] {
        assert!(m.contains(&want.to_string()), "{m:?}");
    }
}

#[test]
fn wrong_schema_version() {
    let mut v = base();
    v["schema_version"] = 1.into();
    assert_eq!(
        messages(v),
        vec!["schema_version = 1: must be 2".to_string()]
    );
}

#[test]
fn nan_and_infinity_are_not_json() {
    let text = base().to_string().replace("2.0", "NaN");
    assert!(matches!(
        Config::from_json_str(&text, &no_env),
        Err(ParseError::Json(_))
    ));
    let text = base().to_string().replace("2.0", "Infinity");
    assert!(matches!(
        Config::from_json_str(&text, &no_env),
        Err(ParseError::Json(_))
    ));
}

#[test]
fn backend_sources_must_agree() {
    let mut v = base();
    v["engine"] = serde_json::json!({"backend": "sglang"});
    assert_eq!(
        issues(v),
        vec![ConfigIssue::BackendMismatch {
            top: "vllm".into(),
            engine: "sglang".into()
        }]
    );
    let mut v = base();
    v.as_object_mut().unwrap().remove("backend");
    v["engine"] = serde_json::json!({"backend": "sglang"});
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(c.backend, Backend::Sglang);
}

#[test]
fn env_references_resolve_whole_values_only() {
    let mut v = base();
    v["engines"][0]["url"] = "${P0_URL}".into();
    let env = |k: &str| (k == "P0_URL").then(|| "http://10.0.0.1:9/".to_string());
    let c = Config::from_json_str(&v.to_string(), &env).unwrap();
    assert_eq!(c.engines[0].url, "http://10.0.0.1:9");
    let m = messages(v.clone());
    assert!(
        m.iter()
            .any(|s| s.starts_with("engines[0].url = \"${P0_URL}\": environment variable P0_URL")),
        "{m:?}"
    );
    v["engines"][0]["url"] = "http://${HOST}:9".into();
    let m = messages(v);
    assert!(
        m.iter().any(|s| s.contains("must be the whole value")),
        "{m:?}"
    );
}

#[test]
fn lease_timing_rule() {
    let mut v = base();
    v["lease"] = serde_json::json!({"backend": "file", "path": "/tmp/l", "ttl_s": 1.0});
    let m = messages(v);
    assert_eq!(
        m,
        vec!["lease.ttl_s = 1.0: must exceed renew_interval_s + safety_margin_s (2)".to_string()]
    );
}

#[test]
fn lease_etcd_tls_and_auth_parse_into_the_section() {
    let mut v = base();
    v["lease"] = serde_json::json!({"backend": "etcd",
        "endpoints": ["etcd-a:2379", "https://etcd-b:2379"],
        "tls": {"ca": "/etc/narwhal/etcd-ca.pem", "cert": "/etc/narwhal/etcd.pem",
                "key": "/etc/narwhal/etcd.key"},
        "auth": {"user": "narwhal", "password_file": "/etc/narwhal/etcd.password"}});
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(
        c.lease.etcd,
        EtcdAccess {
            tls: Some(EtcdTls {
                ca: Some("/etc/narwhal/etcd-ca.pem".into()),
                cert: Some("/etc/narwhal/etcd.pem".into()),
                key: Some("/etc/narwhal/etcd.key".into()),
            }),
            auth: Some(EtcdAuth {
                user: "narwhal".into(),
                password_file: "/etc/narwhal/etcd.password".into(),
            }),
        }
    );
    // Both are optional: https:// alone is verified against the system's trust store.
    v["lease"] = serde_json::json!({"backend": "etcd", "endpoints": ["https://e:2379"]});
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(c.lease.etcd, EtcdAccess::default());
}

#[test]
fn lease_etcd_tls_and_auth_errors_name_the_key_and_never_show_a_password() {
    let mut v = base();
    v["lease"] = serde_json::json!({"backend": "etcd",
        "endpoints": ["http://etcd-a:2379", "etcd://b", "https://c:1/v3"],
        "tls": {"cert": "/c.pem", "cacert": "/ca.pem"},
        "auth": {"password": "hunter2", "password_file": ""}});
    let m = messages(v.clone());
    assert!(!m.iter().any(|x| x.contains("hunter2")), "{m:?}");
    for want in [
        "lease.tls.cacert: unknown key",
        "lease.tls.key = (absent): required with lease.tls.cert (the client certificate's key)",
        "lease.auth.password = (not shown): a password is never written in the fleet file: \
         put it in a file only the router can read and name that file in \
         lease.auth.password_file",
        "lease.auth.user: required key is missing",
        "lease.auth.password_file must be a non-empty path string, got \"\"",
        "lease.endpoints[0] = \"http://etcd-a:2379\": a plain http:// endpoint while \
         lease.tls is set: use https://",
        "lease.endpoints[1] = \"etcd://b\": must be http://HOST:PORT, https://HOST:PORT or \
         HOST:PORT",
        "lease.endpoints[2] = \"https://c:1/v3\": must be http://HOST:PORT, \
         https://HOST:PORT or HOST:PORT (no path)",
    ] {
        assert!(m.contains(&want.to_string()), "missing {want:?} in {m:#?}");
    }
    assert_eq!(m.len(), 8, "{m:#?}");

    // Only the etcd backend reads them.
    v["lease"] = serde_json::json!({"backend": "file", "path": "/tmp/l",
        "tls": {"ca": "/ca.pem"}, "auth": {"user": "u", "password": "hunter2"}});
    let m = messages(v);
    assert_eq!(
        m,
        vec![
            "lease.tls = {…}: only used by lease.backend = \"etcd\"",
            "lease.auth = {…}: only used by lease.backend = \"etcd\"",
            "lease.auth.password = (not shown): a password is never written in the fleet \
             file: put it in a file only the router can read and name that file in \
             lease.auth.password_file",
            "lease.auth.password_file: required key is missing",
        ]
    );
}

#[test]
fn comments_are_ignored_everywhere() {
    let mut v = base();
    v["engines"][0]["_why"] = "prefill host".into();
    v["serving"] = serde_json::json!({"_x": {"anything": 1}});
    assert!(Config::from_json_str(&v.to_string(), &no_env).is_ok());
}

/// The KV-aware placement keys of the approximate index (docs/configuration.md `serving`):
/// defaults, and each bad value named by its dotted path.
#[test]
fn kv_approximate_index_keys_have_defaults_and_name_their_path() {
    let c = Config::from_json_str(&base().to_string(), &no_env).unwrap();
    assert!(c.serving.kv_aware_placement);
    assert_eq!(c.serving.kv_approx_ttl_s, 120.0);
    assert_eq!(c.serving.kv_approx_block_size, 16);
    assert_eq!(c.serving.kv_approx_credit, 1.0);
    assert_eq!(c.serving.kv_pending_s, 10.0);
    assert_eq!(
        (
            c.serving.kv_balance_abs_threshold,
            c.serving.kv_balance_rel_threshold
        ),
        (1000, 1.5),
        "the balance guard is a backstop (docs/design/kv-aware-placement.md section 5)"
    );
    let mut v = base();
    v["serving"] = serde_json::json!({
        "kv_approx_ttl_s": 0, "kv_approx_block_size": 0, "kv_approx_credit": 1.5,
        "kv_aware_placement": "yes", "kv_pending_s": -1
    });
    let m = messages(v);
    for want in [
        "serving.kv_approx_ttl_s = 0: must be > 0",
        "serving.kv_pending_s = -1: must be > 0",
        "serving.kv_approx_credit = 1.5: must be in (0, 1]",
        "serving.kv_aware_placement must be a boolean, got \"yes\"",
    ] {
        assert!(m.contains(&want.to_string()), "{want} in {m:?}");
    }
    assert!(
        m.iter()
            .any(|s| s
                .starts_with("serving.kv_approx_block_size = 0: must be an integer in 1..=65536")),
        "{m:?}"
    );
    let mut v = base();
    v["serving"] = serde_json::json!({
        "kv_approx_ttl_s": 30, "kv_approx_block_size": 4, "kv_approx_credit": 0.5,
        "kv_aware_placement": false, "kv_pending_s": 3
    });
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(
        (
            c.serving.kv_aware_placement,
            c.serving.kv_approx_ttl_s,
            c.serving.kv_approx_block_size,
            c.serving.kv_approx_credit,
            c.serving.kv_pending_s
        ),
        (false, 30.0, 4, 0.5, 3.0)
    );
}

#[test]
fn kv_role_fixes_an_engine_to_its_leg() {
    let mut v = base();
    v["engines"][0]["kv_role"] = "kv_producer".into();
    v["engines"][1]["kv_role"] = "kv_consumer".into();
    let cfg = Config::from_json_str(&v.to_string(), &no_env).expect("valid");
    assert_eq!(
        cfg.engines.iter().map(|e| e.kv_role).collect::<Vec<_>>(),
        [KvRole::Producer, KvRole::Consumer]
    );
    let v = base();
    let cfg = Config::from_json_str(&v.to_string(), &no_env).expect("valid");
    assert!(cfg.engines.iter().all(|e| e.kv_role == KvRole::Both));

    let mut v = base();
    v["engines"][0]["kv_role"] = "kv_consumer".into();
    v["engines"][1]["kv_role"] = "producer".into();
    let m = messages(v);
    assert!(
        m.contains(
            &"engines[0].kv_role = \"kv_consumer\": a kv_consumer engine serves only the decode leg: its role must be \"decode\""
                .to_string()
        ),
        "{m:?}"
    );
    assert!(
        m.iter()
            .any(|l| l.starts_with("engines[1].kv_role") && l.contains("kv_both")),
        "{m:?}"
    );
}

/// `adapters`: empty by default; each a non-empty name listed once that is not the base
/// model, each bad entry named by its index.
#[test]
fn adapters_are_named_once_and_never_the_base_model() {
    let c = Config::from_json_str(&base().to_string(), &no_env).unwrap();
    assert!(c.adapters.is_empty());
    let mut v = base();
    v["adapters"] = serde_json::json!(["tenant-a", "tenant-b"]);
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(c.adapters, ["tenant-a", "tenant-b"]);
    v["adapters"] = serde_json::json!(["tenant-a", "", "tiny-sim", "tenant-a", 3]);
    let m = messages(v);
    for want in ["adapters[1]", "adapters[2]", "adapters[3]", "adapters[4]"] {
        assert!(m.iter().any(|x| x.contains(want)), "{want}: {m:?}");
    }
    assert!(!m.iter().any(|x| x.contains("adapters[0]")), "{m:?}");
    let mut v = base();
    v["adapters"] = serde_json::json!("tenant-a");
    assert!(messages(v).iter().any(|x| x.contains("adapters")));
}

#[test]
fn lease_kubernetes_parses_into_the_section_with_the_pod_defaults_left_open() {
    let mut v = base();
    v["lease"] = serde_json::json!({"backend": "kubernetes"});
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(c.lease.backend, LeaseBackend::Kubernetes);
    assert_eq!(c.lease.kubernetes, KubernetesAccess::default());
    assert_eq!(c.lease.kubernetes.name, "narwhal-router");
    v["lease"] = serde_json::json!({"backend": "kubernetes", "kubernetes": {
        "name": "router-a", "namespace": "inference", "api_server": "https://10.0.0.1:6443",
        "token_file": "/run/token", "ca_file": "/run/ca.crt"}});
    let c = Config::from_json_str(&v.to_string(), &no_env).unwrap();
    assert_eq!(
        c.lease.kubernetes,
        KubernetesAccess {
            name: "router-a".into(),
            namespace: Some("inference".into()),
            api_server: Some("https://10.0.0.1:6443".into()),
            token_file: Some("/run/token".into()),
            ca_file: Some("/run/ca.crt".into()),
        }
    );
}

#[test]
fn lease_kubernetes_errors_name_the_key() {
    let mut v = base();
    v["lease"] = serde_json::json!({"backend": "kubernetes", "kubernetes": {
        "name": "Router_A", "namespace": "-ns", "api_server": "http://10.0.0.1:6443/x",
        "token_file": "", "ca": "/x"}});
    let m = messages(v.clone());
    for want in [
        "lease.kubernetes.ca: unknown key",
        "lease.kubernetes.name = \"Router_A\": must be lowercase letters",
        "lease.kubernetes.namespace = \"-ns\": must be lowercase letters",
        "lease.kubernetes.api_server = \"http://10.0.0.1:6443/x\": must be https://HOST:PORT (no path)",
        "lease.kubernetes.token_file must be a non-empty path string, got \"\"",
    ] {
        assert!(m.iter().any(|x| x.starts_with(want)), "{want} not in {m:?}");
    }
    v["lease"] = serde_json::json!({"backend": "etcd", "endpoints": ["e:2379"],
        "kubernetes": {"name": "x"}});
    let m = messages(v);
    assert!(
        m.iter()
            .any(|x| x == "lease.kubernetes = {…}: only used by lease.backend = \"kubernetes\""),
        "{m:?}"
    );
}
