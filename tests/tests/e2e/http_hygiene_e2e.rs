//! HTTP hygiene of the data and control listeners (docs/deviations.md), end to end over raw
//! sockets, where framing and connection handling are visible:
//! - an answer sent before the request body was read (413, and every early refusal) says
//!   `Connection: close`, so a keep-alive client opens a new connection instead of writing
//!   its next request into a closed one;
//! - a 405 names the allowed methods in `Allow`, and HEAD is served wherever GET is;
//! - a client that stalls mid-body is answered 408 after `serving.body_read_timeout_s`, not
//!   held for `serving.request_timeout_s`.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use narwhal_shared::documents::ErrorReply;
use narwhal_testkit::raw::{self, RawResponse};
use narwhal_testkit::{FakeEngine, RouterHandle, WAIT, eventually, router_over_fakes};
use serde_json::json;

async fn router(overrides: serde_json::Value) -> RouterHandle {
    let e = FakeEngine::new(0, 2);
    router_over_fakes("vllm", &[("e0", &e, "decode")], overrides).await
}

fn addr(url: &str) -> &str {
    url.trim_start_matches("http://")
}

/// Reads one response from a keep-alive connection until the server closes it (or a read
/// waits `within`); the parsed response and its lowercased head.
fn read_to_close(s: &mut TcpStream, within: Duration) -> (RawResponse, String) {
    let resp = raw::parse_response(&raw::read_to_end(s, within));
    let head = resp.head.clone();
    (resp, head)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_413_tells_the_keepalive_client_to_reconnect() {
    let r = router(json!({"serving": {"max_request_bytes": 65536}})).await;
    let big =
        json!({"model": "tiny-sim", "prompt": "x ".repeat(50_000), "max_tokens": 2}).to_string();
    let addr = addr(&r.data).to_string();
    let (resp, head) = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(&addr).expect("connect");
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            big.len()
        );
        // The router may answer and close before it read the body: write what it takes.
        let _ = s.write_all(req.as_bytes());
        let _ = s.write_all(big.as_bytes());
        read_to_close(&mut s, Duration::from_secs(10))
    })
    .await
    .expect("client thread");
    assert_eq!(resp.status, 413, "{head}");
    assert!(
        head.contains("\r\nconnection: close"),
        "the 413 tells the client the connection ends: {head}"
    );
    assert_eq!(resp.json_as::<ErrorReply>().error.kind, "request_too_large");
    // A new connection serves the next request.
    let ok = r.completion("hello", 2).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_405_names_the_allowed_methods() {
    let r = router(json!({})).await;
    let (data, control) = (addr(&r.data).to_string(), addr(&r.control).to_string());
    let answers = tokio::task::spawn_blocking(move || {
        [
            (data.clone(), "GET", "/v1/completions", "POST"),
            (data.clone(), "PUT", "/v1/chat/completions", "POST"),
            (data.clone(), "POST", "/health", "GET"),
            (data.clone(), "DELETE", "/v1/models/tiny-sim", "GET"),
            (control.clone(), "GET", "/narwhal/lifecycle/drain", "POST"),
            (control.clone(), "POST", "/metrics", "GET"),
        ]
        .into_iter()
        .map(|(a, method, path, allow)| {
            let mut s = raw::send(&a, method, path, &[("connection", "close")], "");
            let (resp, head) = read_to_close(&mut s, Duration::from_secs(10));
            (method, path, allow, resp.status, head)
        })
        .collect::<Vec<_>>()
    })
    .await
    .expect("client thread");
    for (method, path, allow, status, head) in answers {
        assert_eq!(status, 405, "{method} {path}: {head}");
        assert!(
            head.contains(&format!("\r\nallow: {}", allow.to_lowercase())),
            "{method} {path}: {head}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stalls_mid_body_gets_408_after_the_body_timeout() {
    let r = router(json!({"serving": {"body_read_timeout_s": 1}})).await;
    let addr = addr(&r.data).to_string();
    let (resp, head, took) = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(&addr).expect("connect");
        let t0 = Instant::now();
        s.write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
        )
        .expect("write");
        // ... and nothing more: the client stalls with 91 bytes owed.
        let (resp, head) = read_to_close(&mut s, Duration::from_secs(20));
        (resp, head, t0.elapsed())
    })
    .await
    .expect("client thread");
    assert_eq!(resp.status, 408, "{head}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(8),
        "bounded by serving.body_read_timeout_s (1 s), not the 600 s request timeout: {took:?}"
    );
    assert!(head.contains("\r\nconnection: close"), "{head}");
    let err = resp.json_as::<ErrorReply>().error;
    assert_eq!(err.code, Some(json!("request_timeout")), "{err:?}");
    assert!(
        err.message.contains("serving.body_read_timeout_s"),
        "{err:?}"
    );
    let row = eventually("the stalled request's journal row", WAIT, || async {
        r.request_rows().into_iter().find(|x| x.status == Some(408))
    })
    .await;
    assert_eq!(row.terminal, "invalid", "{row:?}");
}

/// HEAD is served wherever GET is (RFC 9110 sections 9.1 and 9.3.2): on every GET route of
/// both listeners it answers GET's status, content type and content length, and no body; a
/// POST route still answers HEAD 405 naming POST, and a GET route's 405 lists HEAD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_answers_what_get_answers_without_a_body() {
    let r = router(json!({})).await;
    let (data, control) = (addr(&r.data).to_string(), addr(&r.control).to_string());
    let answers = tokio::task::spawn_blocking(move || {
        let routes = [
            (data.clone(), "/health"),
            (data.clone(), "/ready"),
            (data.clone(), "/v1/models"),
            (data.clone(), "/v1/models/tiny-sim"),
            (control.clone(), "/health"),
            (control.clone(), "/ready"),
            (control.clone(), "/metrics"),
            (control.clone(), "/narwhal/lifecycle"),
            (control.clone(), "/narwhal/targets"),
        ];
        let mut out = Vec::new();
        for (a, path) in routes {
            let mut s = raw::send(&a, "GET", path, &[("connection", "close")], "");
            let (get, get_head) = read_to_close(&mut s, Duration::from_secs(10));
            let mut s = raw::send(&a, "HEAD", path, &[("connection", "close")], "");
            let bytes = raw::read_to_end(&mut s, Duration::from_secs(10));
            out.push((path, get, get_head, bytes));
        }
        let mut s = raw::send(
            &data,
            "HEAD",
            "/v1/completions",
            &[("connection", "close")],
            "",
        );
        let post_route = read_to_close(&mut s, Duration::from_secs(10));
        let mut s = raw::send(&data, "POST", "/ready", &[("connection", "close")], "");
        let get_route = read_to_close(&mut s, Duration::from_secs(10));
        (out, post_route, get_route)
    })
    .await
    .expect("client thread");
    let (answers, (post_route, post_head), (get_route, get_head405)) = answers;
    let header = |head: &str, name: &str| -> Option<String> {
        head.split("\r\n")
            .find_map(|l| l.strip_prefix(&format!("{name}: ")).map(str::to_string))
    };
    for (path, get, get_head, bytes) in answers {
        let text = String::from_utf8_lossy(&bytes).to_string();
        let (head, body) = text.split_once("\r\n\r\n").expect("a response head");
        let head = head.to_lowercase();
        let status: u16 = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
        assert_eq!(status, get.status, "HEAD {path}: {head}");
        assert_eq!(body, "", "HEAD {path} sends no body");
        for name in ["content-type", "content-length"] {
            assert_eq!(
                header(&head, name),
                header(&get_head, name),
                "HEAD {path}: {name} as for GET\nHEAD: {head}\nGET: {get_head}"
            );
        }
        assert!(header(&head, "content-length").is_some(), "{path}: {head}");
    }
    assert_eq!(post_route.status, 405, "{post_head}");
    assert_eq!(
        header(&post_head, "allow").as_deref(),
        Some("post"),
        "{post_head}"
    );
    assert_eq!(get_route.status, 405, "{get_head405}");
    assert_eq!(
        header(&get_head405, "allow").as_deref(),
        Some("get, head"),
        "{get_head405}"
    );
}
