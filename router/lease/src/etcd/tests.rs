//! The etcd backend against a real etcd (the test kit starts one).

use super::*;
use crate::config::etcd_endpoint_rule;
use serde_json::json;

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

/// How a fake gateway answers one request, from its head (request line and headers,
/// lowercased): the JSON body (a `400` when it holds `"error"`), or `None` to never answer.
type Answer = std::sync::Arc<
    dyn Fn(String) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send>>
        + Send
        + Sync,
>;

/// A one-endpoint stand-in for etcd's JSON gateway on loopback, answering each request as
/// `answer` says; returns the endpoint.
async fn fake_gateway(answer: Answer) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                loop {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    // One request: headers, then the body its Content-Length gives.
                    let (head_end, len) = loop {
                        let Ok(n) = conn.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
                            let len = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse::<usize>().ok())
                                .unwrap_or(0);
                            break (i + 4, len);
                        }
                    };
                    while buf.len() < head_end + len {
                        let Ok(n) = conn.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let Some(body) = answer(head).await else {
                        std::future::pending::<()>().await;
                        return;
                    };
                    let status = if body.contains("\"error\"") {
                        "400 Bad Request"
                    } else {
                        "200 OK"
                    };
                    let resp = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if conn.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    endpoint
}

/// A fake gateway whose `/v3/auth/authenticate` answers a token after `auth_delay` (etcd's
/// bcrypt check on a loaded host), every other path an empty range at once, only with that
/// token. Returns the endpoint and how many password checks it was asked for.
async fn slow_password_gateway(
    auth_delay: Duration,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let checks = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = checks.clone();
    let answer: Answer = std::sync::Arc::new(move |head: String| {
        let counted = counted.clone();
        Box::pin(async move {
            Some(if head.starts_with("post /v3/auth/authenticate ") {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(auth_delay).await;
                r#"{"header":{"revision":"1"},"token":"tok"}"#.to_string()
            } else if head.contains("\r\nauthorization: tok") {
                r#"{"header":{"revision":"1"}}"#.to_string()
            } else {
                r#"{"error":"etcdserver: user name is empty","code":3}"#.to_string()
            })
        })
    });
    (fake_gateway(answer).await, checks)
}

/// A publish whose transaction was sent and never answered ends `Unconfirmed`: etcd may
/// still commit it, so the router must not tell the operator nothing was recorded. A publish
/// that fails before anything is written (the record cannot be read) stays `Unavailable`.
#[tokio::test]
async fn a_publish_whose_transaction_goes_unanswered_is_unconfirmed() {
    use narwhal_shared::{Clock as _, SystemClock};
    let timing = crate::LeaseTiming {
        ttl: Duration::from_secs(3),
        renew_interval: Duration::from_millis(500),
        safety_margin: Duration::from_millis(500),
    };
    let clock = SystemClock;
    let now = clock.now();
    let wall = clock.wall().unwrap();
    let mut core = crate::Lease::new("r1".into(), timing);
    let crate::Claim::Write(rec) = core.claim(None, now, wall) else {
        panic!("a first claim writes");
    };
    core.granted(rec.epoch, now);
    core.wrote(&rec, now);
    let key = "/narwhal/fake/router-lease";
    let range = json!({"header": {"revision": "7"}, "count": "1", "kvs": [{
        "key": B64.encode(key), "value": B64.encode(render_record(&rec)),
        "mod_revision": "7", "create_revision": "7", "version": "1"}]})
    .to_string();
    let endpoint = |range_answered: bool| {
        let range = range.clone();
        let answer: Answer = std::sync::Arc::new(move |head: String| {
            let range = range.clone();
            Box::pin(async move {
                if head.starts_with("post /v3/kv/range ") {
                    range_answered.then_some(range)
                } else {
                    None
                }
            })
        });
        fake_gateway(answer)
    };
    let lease = |endpoint: String| {
        EtcdLease::with_access(
            vec![endpoint],
            key,
            Duration::from_secs(3),
            Duration::from_millis(250),
            &EtcdAccess::default(),
        )
        .unwrap()
    };

    let sent = lease(endpoint(true).await);
    let err = sent.publish(&core, now, b"{}".to_vec()).await.unwrap_err();
    assert!(matches!(err, LeaseError::Unconfirmed(_)), "{err:?}");
    assert!(err.to_string().contains("etcd txn on "), "{err}");
    assert!(matches!(
        crate::LeaseLoss::from(err),
        crate::LeaseLoss::Unconfirmed(_)
    ));

    let unread = lease(endpoint(false).await);
    let err = unread
        .publish(&core, now, b"{}".to_vec())
        .await
        .unwrap_err();
    assert!(!matches!(err, LeaseError::Unconfirmed(_)), "{err:?}");
    assert!(err.to_string().contains("etcd get on "), "{err}");
    assert!(matches!(
        crate::LeaseLoss::from(err),
        crate::LeaseLoss::Unavailable(_)
    ));
}

/// etcd's password check outlasting the per-call bound (0.25 s here, a renew interval) is
/// still answered: it is bounded by the lease TTL instead, so a loaded etcd host delays the
/// first call rather than failing every one of them. It used to time out at the call bound
/// and, retried, never got a token.
#[tokio::test]
async fn a_password_check_slower_than_a_call_bound_is_waited_for_up_to_the_ttl() {
    let (endpoint, checks) = slow_password_gateway(Duration::from_millis(700)).await;
    let dir = tempfile::tempdir().unwrap();
    let pw = dir.path().join("pw");
    std::fs::write(&pw, "s3cret").unwrap();
    let access = EtcdAccess {
        tls: None,
        auth: Some(EtcdAuth {
            user: "narwhal".into(),
            password_file: pw,
        }),
    };
    let lease = EtcdLease::with_access(
        vec![endpoint.clone()],
        "/narwhal/slow/router-lease",
        Duration::from_secs(3),
        Duration::from_millis(250),
        &access,
    )
    .unwrap();
    assert_eq!(lease.read().await.unwrap(), None);
    // Once the token is held, calls are quick again: no second password check.
    assert_eq!(lease.read().await.unwrap(), None);
    assert_eq!(checks.load(std::sync::atomic::Ordering::SeqCst), 1);

    // A TTL below the check's time bounds it: the call fails naming the password check.
    let short = EtcdLease::with_access(
        vec![endpoint],
        "/narwhal/slow/router-lease",
        Duration::from_millis(400),
        Duration::from_millis(250),
        &access,
    )
    .unwrap();
    let err = short.read().await.unwrap_err().to_string();
    assert!(err.contains("etcd authenticate on "), "{err}");
}
