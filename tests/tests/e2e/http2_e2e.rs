//! HTTP/2 on the data listener (docs/http-api.md, "HTTP/1.1 and HTTP/2"), end to end: the real
//! `narwhal-serve` in front of a vLLM prefill/decode pair of `narwhal-engine-sim` processes,
//! driven by hyper's HTTP/2 client with prior knowledge (a connection that opens with the
//! HTTP/2 preface). Asserts that:
//! - many streams on one connection are served at once, each answer equal to the same
//!   request's over HTTP/1.1, and counted;
//! - a stream the client resets cancels its engine legs and settles as cancelled, while the
//!   connection's other streams go on;
//! - an early refusal (413) carries no connection-specific field and leaves the connection
//!   serving the next stream;
//! - an HTTP/1.1 client whose first bytes trickle in (`P`, then `O`, ...: they could still be
//!   the preface) is served as HTTP/1.1 once they tell.
// Tests measure wall time (deadlines): the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use narwhal_shared::documents::ErrorReply;
use narwhal_testkit::{Fleet, openai_request, sse_data, sse_text, wait_until};
use serde_json::{Value, json};

type H2 = http2::SendRequest<Full<Bytes>>;

/// A vLLM P/D pair behind a router with `overrides`.
async fn fleet(overrides: Value) -> Fleet {
    Fleet::pd_pair("vllm", overrides).await
}

/// One HTTP/2 connection (prior knowledge) to the router's data listener.
async fn connect(f: &Fleet) -> H2 {
    let addr = f.router().data.trim_start_matches("http://").to_string();
    let tcp = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect to the data listener");
    let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .expect("HTTP/2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

/// A POST of `body` to `path` on the stream `h2` opens; status, headers and the whole body.
async fn post(h2: &mut H2, f: &Fleet, path: &str, body: String) -> (u16, http::HeaderMap, String) {
    h2.ready().await.expect("connection ready");
    let req = http::Request::post(format!("{}{path}", f.router().data))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    tokio::time::timeout(Duration::from_secs(30), async {
        let resp = h2.send_request(req).await.expect("stream answered");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .expect("body read whole")
            .to_bytes();
        (
            status,
            headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    })
    .await
    .expect("answered within 30 s")
}

/// The text a completion answered, streamed or not.
fn text_of(stream: bool, body: &str) -> String {
    if stream {
        let frames = sse_data(body);
        assert_eq!(
            frames.last().map(String::as_str),
            Some("[DONE]"),
            "the stream ends whole: {body}"
        );
        sse_text(&frames)
    } else {
        let v: Value = serde_json::from_str(body).expect("JSON answer");
        narwhal_testkit::answer_text(&v)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_on_one_connection_are_served_at_once_and_answer_as_over_http1() {
    let f = fleet(json!({})).await;
    let h2 = connect(&f).await;
    let mut tasks = Vec::new();
    for i in 0..24 {
        let stream = i % 3 != 0;
        let chat = i % 4 == 1;
        let (path, b) = openai_request(chat, stream, &format!("h2 prompt {i}"), 6);
        let mut h2 = h2.clone();
        let f_data = f.router().data.clone();
        tasks.push(tokio::spawn(async move {
            h2.ready().await.expect("connection ready");
            let req = http::Request::post(format!("{f_data}{path}"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(b.to_string())))
                .expect("request");
            let resp = h2.send_request(req).await.expect("stream answered");
            let status = resp.status().as_u16();
            assert_eq!(resp.version(), http::Version::HTTP_2);
            let bytes = resp
                .into_body()
                .collect()
                .await
                .expect("body read whole")
                .to_bytes();
            (
                i,
                path,
                b,
                stream,
                status,
                String::from_utf8_lossy(&bytes).into_owned(),
            )
        }));
    }
    for t in tasks {
        let (i, path, b, stream, status, body) = t.await.expect("stream task");
        assert_eq!(status, 200, "stream {i}: {body}");
        // The same request over HTTP/1.1 answers the same text (the simulator's output is a
        // function of the prompt).
        let over_h1 = f.http.post(format!("{}{path}", f.router().data), &b).await;
        assert_eq!(over_h1.status.as_u16(), 200, "{}", over_h1.text());
        assert_eq!(
            text_of(stream, &body),
            text_of(stream, &over_h1.text()),
            "stream {i}: HTTP/2 and HTTP/1.1 answers differ"
        );
    }
    let st = f.router().state().await;
    assert_eq!(st.served, 48, "{st:?}");
    assert_eq!(st.failed, 0, "{st:?}");
    // Every one went prefill then decode, the descriptor carried.
    let p = f.sim("p0").counters().await;
    assert_eq!(p.requests.prefill, 48, "{p:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_stream_cancels_its_legs_and_the_connection_goes_on() {
    let f = fleet(json!({})).await;
    f.sim("p0")
        .fault(json!({"phase": "prefill", "action": "hang", "ms": 30000}))
        .await;
    let mut h2 = connect(&f).await;
    let (path, b) = openai_request(false, true, "slow prefill over h2", 6);
    let url = format!("{}{path}", f.router().data);
    let mut doomed = h2.clone();
    let req = tokio::spawn(async move {
        doomed.ready().await.expect("ready");
        let req = http::Request::post(url)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(b.to_string())))
            .expect("request");
        doomed.send_request(req).await
    });
    let running = wait_until(Duration::from_secs(5), || async {
        (f.sim("p0").counters().await.in_flight == 1).then_some(())
    })
    .await;
    assert!(running.is_some(), "the prefill leg never started");
    // Dropping the response future resets the stream (RST_STREAM CANCEL); the connection and
    // its other streams stay.
    req.abort();
    let seen = wait_until(Duration::from_secs(1), || async {
        let p = f.sim("p0").counters().await;
        (p.cancelled == 1 && p.in_flight == 0).then_some(())
    })
    .await;
    assert!(
        seen.is_some(),
        "the engine did not see the cancellation within 1 s: {:?}",
        f.sim("p0").counters().await
    );
    let settled = wait_until(Duration::from_secs(2), || async {
        let st = f.router().state().await;
        (st.cancelled == 1).then_some(st)
    })
    .await;
    assert!(
        settled.is_some(),
        "the router did not settle the reset stream as cancelled"
    );
    // The same connection serves the next stream.
    let (path, b) = openai_request(false, true, "after the reset", 6);
    let (status, _, body) = post(&mut h2, &f, path, b.to_string()).await;
    assert_eq!(status, 200, "{body}");
    assert!(!text_of(true, &body).is_empty(), "{body}");
    let st = f.router().state().await;
    assert_eq!(st.served, 1, "{st:?}");
    assert_eq!(st.cancelled, 1, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_refusal_keeps_the_connection_and_names_no_connection_field() {
    let f = fleet(json!({"serving": {"max_request_bytes": 65536}})).await;
    let mut h2 = connect(&f).await;
    let big =
        json!({"model": "tiny-sim", "prompt": "x ".repeat(50_000), "max_tokens": 2}).to_string();
    let (status, headers, body) = post(&mut h2, &f, "/v1/completions", big).await;
    assert_eq!(status, 413, "{body}");
    assert!(
        headers.get(http::header::CONNECTION).is_none(),
        "no connection-specific field on a stream: {headers:?}"
    );
    let v: ErrorReply = serde_json::from_str(&body).expect("JSON refusal");
    assert_eq!(v.error.kind, "request_too_large", "{v:?}");
    let (path, b) = openai_request(false, false, "after the refusal", 4);
    let (status, _, body) = post(&mut h2, &f, path, b.to_string()).await;
    assert_eq!(status, 200, "the connection serves the next stream: {body}");
    let st = f.router().state().await;
    assert_eq!(st.served, 1, "{st:?}");
    assert_eq!(st.invalid_requests, 1, "the refusal is counted: {st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_request_that_trickles_in_is_served_as_http1() {
    use std::io::Write;
    let f = fleet(json!({})).await;
    let addr = f.router().data.trim_start_matches("http://").to_string();
    let (status, head, body) = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        s.set_nodelay(true).expect("nodelay");
        let req = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: 59\r\n\r\n{\"model\": \"tiny-sim\", \"prompt\": \"trickle\", \"max_tokens\": 3}";
        // The stimulus is a slow client: its first two bytes are a prefix of the HTTP/2
        // preface, each sent on its own after a pause.
        for b in &req[..2] {
            s.write_all(std::slice::from_ref(b)).expect("write a byte");
            std::thread::sleep(Duration::from_millis(40));
        }
        s.write_all(&req[2..]).expect("write the rest");
        let resp = narwhal_testkit::raw::parse_response(&narwhal_testkit::raw::read_to_end(
            &mut s,
            Duration::from_secs(10),
        ));
        (resp.status, resp.head.clone(), resp.json())
    })
    .await
    .expect("client thread");
    assert_eq!(status, 200, "{head}");
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(
        !narwhal_testkit::answer_text(&body).is_empty(),
        "an answer: {body}"
    );
}
