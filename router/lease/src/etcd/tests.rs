//! The etcd backend against a real etcd (the test kit starts one).

use super::*;
use crate::config::etcd_endpoint_rule;

#[test]
fn gateway_answers_and_errors_parse() {
    let ok = reqwest::StatusCode::OK;
    let v = parse_answer(ok, br#"{"header":{"revision":"7"},"succeeded":true}"#).unwrap();
    assert_eq!(v["succeeded"], true);
    // A streaming answer: one document per line.
    let v = parse_answer(ok, b"{\"result\":{\"ID\":\"5\",\"TTL\":\"3\"}}\n").unwrap();
    assert_eq!(int(v["result"].get("TTL")), 3);
    let unary = br#"{"error":"etcdserver: requested lease not found","message":"etcdserver: requested lease not found","code":5}"#;
    assert_eq!(
        parse_answer(reqwest::StatusCode::NOT_FOUND, unary).unwrap_err(),
        (5, "etcdserver: requested lease not found".to_string())
    );
    let stream = br#"{"error":{"grpc_code":16,"http_code":401,"message":"etcdserver: invalid auth token","http_status":"Unauthorized"}}"#;
    assert_eq!(
        parse_answer(reqwest::StatusCode::OK, stream).unwrap_err(),
        (16, "etcdserver: invalid auth token".to_string())
    );
    let (_, msg) = parse_answer(
        reqwest::StatusCode::BAD_REQUEST,
        b"Client sent an HTTP request to an HTTPS server.\n",
    )
    .unwrap_err();
    assert!(
        msg.contains("HTTP 400 Bad Request with a body that is not etcd's JSON"),
        "{msg}"
    );
    assert!(msg.contains("HTTPS server"), "{msg}");
    let (_, msg) =
        parse_answer(reqwest::StatusCode::NOT_FOUND, b"404 page not found\n").unwrap_err();
    assert!(
        msg.contains("etcd's JSON gateway is not served there"),
        "{msg}"
    );
}

#[test]
fn int64_fields_are_strings_or_absent() {
    assert_eq!(
        int(Some(&json!("4111120348176656901"))),
        4111120348176656901
    );
    assert_eq!(int(Some(&json!(12))), 12);
    assert_eq!(int(None), 0);
    assert_eq!(int(Some(&json!("x"))), 0);
}

#[test]
fn endpoints_follow_the_tls_setting_and_bad_ones_name_their_index() {
    let d = Duration::from_secs(1);
    let s = EtcdLease::new(
        vec!["127.0.0.1:2379".into(), "http://h:1/".into()],
        "/k",
        d,
        d,
    )
    .unwrap();
    assert_eq!(s.endpoints(), ["http://127.0.0.1:2379", "http://h:1"]);
    // https:// without lease.tls is usable (verified against the system's trust store).
    assert_eq!(etcd_endpoint_rule("https://b:2", false), None);
    let dir = tempfile::tempdir().unwrap();
    let certs = narwhal_testkit::etcd::EtcdCerts::make(dir.path());
    let tls = EtcdAccess {
        tls: Some(EtcdTls {
            ca: Some(certs.ca),
            cert: None,
            key: None,
        }),
        auth: None,
    };
    let s =
        EtcdLease::with_access(vec!["b:2".into(), "https://c:3".into()], "/k", d, d, &tls).unwrap();
    assert_eq!(s.endpoints(), ["https://b:2", "https://c:3"]);
    let err = EtcdLease::with_access(
        vec!["https://b:2".into(), "http://a:1".into()],
        "/k",
        d,
        d,
        &tls,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "lease config: lease.endpoints[1] = \"http://a:1\": a plain http:// endpoint while \
         lease.tls is set: use https://"
    );
    let err = EtcdLease::new(vec!["unix:///run/etcd.sock".into()], "/k", d, d)
        .unwrap_err()
        .to_string();
    assert!(err.contains("lease.endpoints[0]"), "{err}");
}

#[test]
fn access_files_are_read_at_construction_and_errors_name_the_key() {
    let d = Duration::from_secs(1);
    let dir = tempfile::tempdir().unwrap();
    let build = |access: &EtcdAccess| {
        EtcdLease::with_access(vec!["127.0.0.1:2379".into()], "/k", d, d, access)
    };
    let missing = dir.path().join("nope.pem");
    let access = EtcdAccess {
        tls: Some(EtcdTls {
            ca: Some(missing.clone()),
            cert: None,
            key: None,
        }),
        auth: None,
    };
    let err = build(&access).unwrap_err().to_string();
    assert!(
        err.starts_with("lease config: lease.tls.ca: cannot read "),
        "{err}"
    );
    let not_pem = dir.path().join("ca.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let access = EtcdAccess {
        tls: Some(EtcdTls {
            ca: Some(not_pem),
            cert: None,
            key: None,
        }),
        auth: None,
    };
    let err = build(&access).unwrap_err().to_string();
    assert!(
        err.contains("lease.tls.ca: ") && err.contains("holds no CERTIFICATE"),
        "{err}"
    );

    let pw = dir.path().join("pw");
    let auth = |file: &std::path::PathBuf| EtcdAccess {
        tls: None,
        auth: Some(EtcdAuth {
            user: "narwhal".into(),
            password_file: file.clone(),
        }),
    };
    let err = build(&auth(&pw)).unwrap_err().to_string();
    assert!(
        err.contains("lease.auth.password_file: cannot read "),
        "{err}"
    );
    std::fs::write(&pw, "\n").unwrap();
    let err = build(&auth(&pw)).unwrap_err().to_string();
    assert!(
        err.contains("lease.auth.password_file: ") && err.ends_with("is empty"),
        "{err}"
    );
    std::fs::write(&pw, "s3cret\n").unwrap();
    assert_eq!(read_password(&pw).unwrap(), "s3cret");
    let s = build(&auth(&pw)).unwrap();
    let shown = format!("{s:?}");
    assert!(
        shown.contains("narwhal") && !shown.contains("s3cret"),
        "{shown}"
    );
}
