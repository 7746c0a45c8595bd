//! End-to-end wire tests of `narwhal-engine-sim` (docs/engine-simulator.md): two simulator
//! processes on loopback, driven over raw HTTP/1 so that framing (chunks, cuts, drops) is
//! visible exactly as a router sees it.
// Tests measure wall time (deadlines, takeover gaps): the clock ban of clippy.toml is for
// product code.
#![allow(clippy::disallowed_methods)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use narwhal_shared::check_request::Bootstrap;
use narwhal_shared::documents::ErrorReply;
use narwhal_testkit::kv_handle::KvHandle;
use narwhal_testkit::raw::{RawResponse as Resp, request, send};
use narwhal_testkit::sim_stats::{SimFault, SimFaults, SimRecent, SimStats};
use narwhal_testkit::{Answer, SimHandle, poll_blocking as wait_until};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tempfile::TempDir;

/// SGLang's `GET /server_info`, the members these tests read.
#[derive(Debug, Deserialize)]
struct ServerInfo {
    /// `prefill`, `decode` or `null` (a string).
    disaggregation_mode: String,
    served_model_name: String,
    /// `null` unless a prefill-mode server.
    disaggregation_bootstrap_port: Option<u64>,
}

/// SGLang's `GET /get_model_info`, the member these tests read.
#[derive(Debug, Deserialize)]
struct ModelInfo {
    is_generation: bool,
}

/// vLLM's `GET /version`.
#[derive(Debug, Deserialize)]
struct Version {
    version: String,
}

/// vLLM's `POST /tokenize` answer, the members these tests read.
#[derive(Debug, Deserialize)]
struct Tokenized {
    count: u64,
    max_model_len: u64,
}

/// The simulator's `--ready-file` (docs/engine-simulator.md).
#[derive(Debug, Deserialize)]
struct ReadyFile {
    url: String,
    kv_port: Option<u64>,
    bootstrap_port: Option<u64>,
    pid: u32,
}

/// A completion body with SGLang's rendezvous members flattened in.
#[derive(Serialize)]
struct InRoom {
    #[serde(flatten)]
    body: Value,
    #[serde(flatten)]
    room: Bootstrap,
}

/// The `kv_transfer_params` of a completion answer (or stream chunk) `a`, typed.
fn handle_of(a: &Answer) -> KvHandle {
    KvHandle::of(a.kv_transfer_params.as_ref().expect("kv_transfer_params"))
}

/// A running simulator (killed on drop) and its address for raw HTTP/1.
struct Sim {
    handle: SimHandle,
    /// `127.0.0.1:PORT`.
    addr: String,
    _dir: TempDir,
}

impl Sim {
    /// Starts `narwhal-engine-sim` with exactly `args` (its defaults otherwise).
    fn start(args: &[&str]) -> Sim {
        let dir = tempfile::tempdir().expect("tempdir");
        let handle = SimHandle::start_raw(dir.path(), "sim", args).expect("narwhal-engine-sim");
        let line = &handle.proc.first_line;
        let addr = line
            .trim()
            .strip_prefix("narwhal-engine-sim listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Sim {
            handle,
            addr,
            _dir: dir,
        }
    }

    fn get(&self, path: &str) -> Resp {
        request(&self.addr, "GET", path, &[], "")
    }

    fn post(&self, path: &str, body: &Value) -> Resp {
        request(&self.addr, "POST", path, &[], &body.to_string())
    }

    /// `POST /v1/completions`.
    fn complete(&self, body: &Value) -> Resp {
        self.post("/v1/completions", body)
    }

    /// `METHOD <admin_url><tail>`: the test hooks (`/sim/*`), wherever they are served.
    fn admin(&self, method: &str, tail: &str, body: &str) -> Resp {
        let url = self.handle.admin_url();
        let rest = url.strip_prefix("http://").expect("http admin URL");
        let (addr, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        request(addr, method, &format!("/{prefix}{tail}"), &[], body)
    }

    fn stats(&self) -> SimStats {
        let r = self.admin("GET", "/stats", "");
        serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("not the /sim/stats document ({e}): {}", r.text()))
    }

    fn faults(&self) -> Vec<SimFault> {
        self.admin("GET", "/faults", "")
            .json_as::<SimFaults>()
            .faults
    }

    fn fault(&self, f: Value) {
        let r = self.admin("POST", "/faults", &f.to_string());
        assert_eq!(r.status, 200, "fault refused: {}", r.text());
    }

    /// Whether `/sim/stats` comes to satisfy `reached` within `within`.
    fn stat_reaches(&self, reached: impl Fn(&SimStats) -> bool, within: Duration) -> bool {
        wait_until(within, || reached(&self.stats()))
    }

    /// The last of `/sim/stats` `recent` requests.
    fn last_recent(&self) -> SimRecent {
        self.stats()
            .recent
            .last()
            .expect("a recent request")
            .clone()
    }
}

/// An SGLang prefill-mode and decode-mode simulator (each with its extra flags) and the
/// prefill's bootstrap port.
fn sglang_pair(prefill: &[&str], decode: &[&str]) -> (Sim, Sim, u64) {
    let with = |mode: &str, extra: &[&str]| {
        let mut args = vec!["--dialect", "sglang", "--disaggregation-mode"];
        args.push(if mode == "p" { "prefill" } else { "decode" });
        args.extend_from_slice(extra);
        Sim::start(&args)
    };
    let (p, d) = (with("p", prefill), with("d", decode));
    let bport = bootstrap_port(&p);
    (p, d, bport)
}

/// A prefill of `room` on `p` that a fault answers with `status`.
fn failing_prefill(p: &Sim, bport: u64, room: u64, status: u16) {
    p.fault(json!({"phase": "prefill", "action": "status", "status": status}));
    let body = in_room(json!({"prompt": PROMPT, "max_tokens": 1}), bport, room);
    assert_eq!(p.complete(&body).status, status);
}

/// `body` with the SGLang rendezvous of `room` on the bootstrap server at `bport`.
fn in_room(body: Value, bport: u64, room: u64) -> Value {
    let room = Bootstrap {
        bootstrap_host: "127.0.0.1".into(),
        bootstrap_port: Some(bport),
        bootstrap_room: room,
    };
    serde_json::to_value(InRoom { body, room }).expect("a request body")
}

const PROMPT: &str = "the quick brown fox jumps over the lazy dog again and again";

#[test]
fn vllm_descriptor_decode_equals_aggregated_and_is_consumed_once() {
    let p = Sim::start(&["--engine-id", "prod-1"]);
    let d = Sim::start(&["--engine-id", "dec-1"]);
    // Aggregated reference on the decode engine.
    let agg = d.complete(&json!({"model": "tiny-sim", "prompt": PROMPT, "max_tokens": 6}));
    assert_eq!(agg.status, 200);
    let agg_text = agg
        .json_as::<Answer>()
        .choice(0)
        .and_then(|c| c.text.clone())
        .unwrap();
    assert_eq!(agg_text.split_whitespace().count(), 6);

    // Prefill leg as the router sends it (behaviour.md 7.1 step 2).
    let pre = request(
        &p.addr,
        "POST",
        "/v1/completions",
        &[("x-request-id", "r1-a1-prefill")],
        &json!({"model": "tiny-sim", "prompt": PROMPT, "max_tokens": 1, "stream": false,
                "kv_transfer_params": {"do_remote_decode": true}})
        .to_string(),
    );
    assert_eq!(pre.status, 200, "{}", pre.text());
    let pre: Answer = pre.json_as();
    let kv = handle_of(&pre);
    assert_eq!(kv.do_remote_prefill, Some(true));
    assert_eq!(kv.do_remote_decode, Some(false));
    assert_eq!(kv.remote_engine_id.as_deref(), Some("prod-1"));
    assert_eq!(kv.remote_host.as_deref(), Some("127.0.0.1"));
    assert_eq!(kv.tp_size, Some(1));
    // 12 prompt tokens -> one 16-token block.
    assert_eq!(kv.remote_block_ids.as_ref().unwrap().len(), 1);
    assert_eq!(pre.usage().completion_tokens, Some(1));

    // Decode leg (behaviour.md 7.1 step 6).
    let dec_body = json!({"model": "tiny-sim", "prompt": PROMPT, "max_tokens": 6,
        "stream": true, "return_token_ids": true, "stream_interval": 1,
        "kv_transfer_params": pre.kv_transfer_params});
    let dec = request(
        &d.addr,
        "POST",
        "/v1/completions",
        &[("x-request-id", "r1-a1-decode")],
        &dec_body.to_string(),
    );
    assert_eq!(dec.status, 200);
    assert!(dec.complete);
    assert_eq!(dec.events().last().map(String::as_str), Some("[DONE]"));
    assert_eq!(
        dec.stream_text(),
        agg_text,
        "decode after transfer = aggregated"
    );
    let first: Answer = serde_json::from_str(&dec.events()[0]).unwrap();
    let first = first.choice(0).unwrap();
    assert_eq!(first.token_ids.as_ref().unwrap().len(), 1);
    assert_eq!(first.prompt_token_ids.as_ref().unwrap().len(), 12);

    let ps = p.stats();
    assert_eq!(ps.kv.issued, 1);
    assert_eq!(ps.kv.served, 1);
    assert_eq!(ps.requests.prefill, 1);
    let pr = ps.recent.last().unwrap().clone();
    assert_eq!(pr.request_id, "r1-a1-prefill");
    assert_eq!(pr.block_ids, kv.remote_block_ids);
    assert_eq!(pr.kv_peer, Some(format!("http://{}", d.addr)));
    let ds = d.stats();
    assert_eq!(ds.kv.consumed, 1);
    assert_eq!(ds.kv.recomputed, 1, "the aggregated reference");
    assert_eq!(ds.requests.decode, 1);
    let dr = ds.recent.last().unwrap().clone();
    assert_eq!(dr.request_id, "r1-a1-decode");
    assert_eq!(dr.kv_peer.as_deref(), Some("prod-1"));
    assert_eq!(dr.outcome, "ok");
    assert_eq!(dr.tokens, 6);

    // A second decode with the same descriptor: blocks were freed on the first read.
    let again = d.complete(&dec_body);
    assert_eq!(again.status, 200, "stream already started");
    let ev = again.events();
    assert_eq!(ev.len(), 2, "{ev:?}");
    let err: ErrorReply = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(err.error.code, Some(json!(500)));
    assert!(err.error.message.contains("already consumed"), "{err:?}");
    assert_eq!(ev[1], "[DONE]");

    // A descriptor naming another engine id (the producer restarted): non-streaming -> 500.
    let pre2 = p
        .complete(&json!({"prompt": PROMPT, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": true}}))
        .json_as::<Answer>();
    let kv2 = KvHandle {
        remote_engine_id: Some("prod-0-before-restart".into()),
        ..handle_of(&pre2)
    };
    let wrong = d.complete(&json!({"prompt": PROMPT, "max_tokens": 6, "kv_transfer_params": kv2}));
    assert_eq!(wrong.status, 500);
    assert!(wrong.text().contains("does not match"), "{}", wrong.text());

    // A descriptor for another prompt: hash mismatch.
    let pre3 = p
        .complete(
            &json!({"prompt": "something else entirely", "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": true}}),
        )
        .json_as::<Answer>();
    let other = d.complete(&json!({"prompt": PROMPT, "max_tokens": 6,
                "kv_transfer_params": pre3.kv_transfer_params}));
    assert_eq!(other.status, 500);
    assert!(
        other.text().contains("different prompt"),
        "{}",
        other.text()
    );

    // Unreachable producer.
    let kv4 = KvHandle {
        remote_port: Some(1),
        ..kv.clone()
    };
    let unreachable =
        d.complete(&json!({"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv4}));
    assert_eq!(unreachable.status, 500);
    assert!(unreachable.text().contains("unreachable"));

    let ds = d.stats();
    assert_eq!(ds.kv.consumed, 1);
    assert_eq!(ds.kv.rejected, 4);
}

#[test]
fn vllm_blocks_expire_after_the_lease() {
    let p = Sim::start(&["--kv-lease-s", "0.3"]);
    let d = Sim::start(&[]);
    let pre = p
        .complete(&json!({"prompt": PROMPT, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": true}}))
        .json_as::<Answer>();
    assert!(p.stat_reaches(|s| s.kv.expired == 1, Duration::from_secs(3)));
    let late = d.complete(&json!({"prompt": PROMPT, "max_tokens": 2,
                "kv_transfer_params": pre.kv_transfer_params}));
    assert_eq!(late.status, 500);
    assert_eq!(p.stats().kv.served, 0);
}

fn bootstrap_port(p: &Sim) -> u64 {
    let info: ServerInfo = p.get("/server_info").json_as();
    assert_eq!(info.disaggregation_mode, "prefill");
    assert_eq!(info.served_model_name, "tiny-sim");
    info.disaggregation_bootstrap_port.expect("bootstrap port")
}

#[test]
fn sglang_bootstrap_prefill_and_decode_in_both_orders() {
    let (p, d, bport) = sglang_pair(&["--engine-id", "sg-p"], &[]);
    let agg = d.complete(&json!({"prompt": PROMPT, "max_tokens": 5, "stream": true}));
    assert_eq!(agg.status, 200);
    let agg_text = agg.stream_text();
    assert_eq!(agg_text.split_whitespace().count(), 5);

    for (room, decode_first) in [(1001u64, true), (1002u64, false)] {
        let pre_body = in_room(
            json!({"prompt": PROMPT, "max_tokens": 1, "stream": false,
                   "rid": format!("room{room}-prefill")}),
            bport,
            room,
        );
        let dec_body = in_room(
            json!({"prompt": PROMPT, "max_tokens": 5, "stream": true,
                   "return_token_ids": true, "rid": format!("room{room}-decode")}),
            bport,
            room,
        );
        let d_addr = d.addr.clone();
        let p_addr = p.addr.clone();
        let post = |addr: &str, body: &Value| {
            request(addr, "POST", "/v1/completions", &[], &body.to_string())
        };
        let (dec, pre) = if decode_first {
            let h = thread::spawn(move || {
                request(
                    &d_addr,
                    "POST",
                    "/v1/completions",
                    &[],
                    &dec_body.to_string(),
                )
            });
            // Let the decode reach the bootstrap server first.
            assert!(d.stat_reaches(|s| s.in_flight == 1, Duration::from_secs(2)));
            let pre = post(&p_addr, &pre_body);
            (h.join().unwrap(), pre)
        } else {
            let pre = post(&p_addr, &pre_body);
            (post(&d_addr, &dec_body), pre)
        };
        assert_eq!(pre.status, 200, "{}", pre.text());
        assert_eq!(pre.json_as::<Answer>().usage().completion_tokens, Some(1));
        assert_eq!(dec.status, 200);
        assert_eq!(dec.stream_text(), agg_text, "room {room}");
        let last = d.last_recent();
        assert_eq!(last.request_id, format!("room{room}-decode"));
        assert_eq!(last.room, Some(room));
        assert_eq!(last.kv_peer.as_deref(), Some("sg-p"));
        assert_eq!(last.outcome, "ok");
    }
    let ps = p.stats();
    assert_eq!(ps.kv.issued, 2);
    assert_eq!(ps.kv.served, 2);
    assert_eq!(ps.requests.prefill, 2);
    let ds = d.stats();
    assert_eq!(ds.kv.consumed, 2);
    assert_eq!(ds.requests.decode, 2);

    // A prefill-mode server refuses requests without the rendezvous.
    let bad = p.complete(&json!({"prompt": PROMPT}));
    assert_eq!(bad.status, 400);
    // The room is consumed once: a second decode of room 1002 waits and fails.
}

#[test]
fn sglang_decode_fails_within_the_bound_when_the_room_never_appears() {
    let (p, d, bport) = sglang_pair(&[], &["--kv-lease-s", "1"]);
    let t0 = Instant::now();
    let r = d.complete(&in_room(
        json!({"prompt": PROMPT, "max_tokens": 3}),
        bport,
        77,
    ));
    let took = t0.elapsed();
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(r.text().contains("not published"), "{}", r.text());
    assert!(took >= Duration::from_millis(900), "waited {took:?}");
    assert!(took < Duration::from_secs(4), "waited {took:?}");

    // A prefill failure is reported to the waiting decode at once.
    failing_prefill(&p, bport, 78, 503);
    let t0 = Instant::now();
    let r = d.complete(&in_room(
        json!({"prompt": PROMPT, "max_tokens": 3, "stream": true}),
        bport,
        78,
    ));
    assert!(t0.elapsed() < Duration::from_millis(800));
    let ev = r.events();
    assert!(
        ev[0].contains("\"error\"") && ev[0].contains("failed"),
        "{ev:?}"
    );
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));

    // A 4xx prefill (refused before the scheduler) publishes nothing: the decode waits the bound.
    failing_prefill(&p, bport, 80, 400);
    let t0 = Instant::now();
    let r = d.complete(&in_room(json!({"prompt": PROMPT}), bport, 80));
    assert_eq!(r.status, 500);
    assert!(r.text().contains("not published"), "{}", r.text());
    assert!(t0.elapsed() >= Duration::from_millis(900));

    // Unreachable bootstrap server.
    let r = d.complete(&in_room(json!({"prompt": PROMPT}), 1, 79));
    assert_eq!(r.status, 500);
    assert_eq!(d.stats().kv.rejected, 4);
}

#[test]
fn faults_status_omit_kv_cut_fragment_drop_and_health() {
    let s = Sim::start(&[]);
    let body = json!({"prompt": PROMPT, "max_tokens": 5, "stream": true});

    s.fault(
        json!({"phase": "aggregated", "action": "status", "status": 503,
                   "body": {"error": {"message": "overloaded"}}}),
    );
    assert_eq!(s.faults().len(), 1);
    let r = s.complete(&body);
    assert_eq!(r.status, 503);
    assert_eq!(r.json_as::<ErrorReply>().error.message, "overloaded");
    assert_eq!(s.faults(), []);
    assert_eq!(s.complete(&body).status, 200, "count 1 by default");

    s.fault(json!({"phase": "prefill", "action": "omit_kv"}));
    let r = s.complete(&json!({"prompt": PROMPT, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": true}}));
    assert_eq!(r.status, 200);
    // wire shape: the member is absent, not null.
    assert!(r.json().get("kv_transfer_params").is_none());
    assert_eq!(s.stats().kv.issued, 0);

    s.fault(json!({"phase": "any", "action": "cut", "after_tokens": 2}));
    let r = s.complete(&body);
    assert_eq!(r.status, 200);
    assert!(!r.complete, "no terminating chunk after a cut");
    let ev = r.events();
    assert_eq!(ev.len(), 2, "{ev:?}");
    assert!(!r.text().contains("[DONE]") && !r.text().contains("\"error\""));

    s.fault(json!({"phase": "aggregated", "action": "fragment", "bytes": 7}));
    let r = s.complete(&body);
    assert!(r.complete);
    assert!(r.chunks.len() > 10, "{:?}", r.chunks);
    assert!(r.chunks.iter().all(|c| *c <= 7), "{:?}", r.chunks);
    assert_eq!(r.stream_text().split_whitespace().count(), 5);
    assert_eq!(r.events().last().map(String::as_str), Some("[DONE]"));

    s.fault(json!({"phase": "aggregated", "action": "drop"}));
    let r = s.complete(&body);
    assert_eq!(r.status, 0, "no response at all");
    assert!(r.body.is_empty());

    s.fault(json!({"phase": "health", "action": "status", "status": 500}));
    assert_eq!(s.get("/health").status, 500);
    assert_eq!(s.get("/health").status, 200);

    s.fault(json!({"phase": "decode", "action": "hang", "ms": 10, "count": 3}));
    assert_eq!(s.faults()[0].count, 3);
    assert_eq!(s.admin("DELETE", "/faults", "").status, 200);
    assert_eq!(s.faults(), []);
    let bad = s.admin(
        "POST",
        "/faults",
        &json!({"phase": "decode", "action": "explode"}).to_string(),
    );
    assert_eq!(bad.status, 400);

    let outcomes: Vec<String> = s.stats().recent.iter().map(|r| r.outcome.clone()).collect();
    assert_eq!(
        outcomes,
        ["fault", "ok", "fault", "fault", "fault", "fault"],
        "status, plain, omit_kv, cut, fragment, drop"
    );
}

#[test]
fn client_disconnects_are_counted_as_cancelled() {
    let s = Sim::start(&["--ttft-ms", "3000"]);
    // Disconnect during the time-to-first-token wait.
    let body = json!({"prompt": PROMPT, "max_tokens": 4}).to_string();
    let c = send(
        &s.addr,
        "POST",
        "/v1/completions",
        &[("x-request-id", "gone-1")],
        &body,
    );
    assert!(s.stat_reaches(|s| s.in_flight == 1, Duration::from_secs(2)));
    let t0 = Instant::now();
    drop(c);
    assert!(s.stat_reaches(|s| s.cancelled == 1, Duration::from_secs(1)));
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    let st = s.stats();
    assert_eq!(st.in_flight, 0);
    let last = st.recent.last().unwrap().clone();
    assert_eq!(last.request_id, "gone-1");
    assert_eq!(last.outcome, "cancelled");

    // Disconnect mid-stream.
    let s = Sim::start(&["--tpot-ms", "200"]);
    let body = json!({"prompt": PROMPT, "max_tokens": 50, "stream": true}).to_string();
    let mut c = send(&s.addr, "POST", "/v1/completions", &[], &body);
    let mut buf = [0u8; 4096];
    let n = c.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    drop(c);
    assert!(s.stat_reaches(|s| s.cancelled == 1, Duration::from_secs(2)));
    assert_eq!(s.stats().in_flight, 0);
}

#[test]
fn validation_metrics_and_ready_file() {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready.json");
    let s = Sim::start(&[
        "--max-model-len",
        "32",
        "--model",
        "m1",
        "--ready-file",
        ready.to_str().unwrap(),
    ]);
    let doc: ReadyFile = serde_json::from_slice(&std::fs::read(&ready).unwrap()).unwrap();
    assert_eq!(doc.url, format!("http://{}", s.addr));
    assert!(doc.kv_port.unwrap() > 0);
    assert_eq!(doc.bootstrap_port, None);
    assert_eq!(doc.pid, s.handle.proc.pid());

    let r = s.complete(&json!({"model": "nope", "prompt": "a"}));
    assert_eq!(r.status, 404);
    assert_eq!(
        r.json_as::<ErrorReply>().error.message,
        "The model `nope` does not exist."
    );
    let r = request(&s.addr, "POST", "/v1/completions", &[], "{not json");
    assert_eq!(r.status, 400);
    let long = vec!["w"; 40].join(" ");
    let r = s.complete(&json!({"prompt": long}));
    assert_eq!(r.status, 400);
    assert!(r.text().contains("maximum context length is 32"));
    let r = s.post(
        "/v1/chat/completions",
        &json!({"model": "m1", "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 2}),
    );
    assert_eq!(r.status, 200);
    let v: Answer = r.json_as();
    assert_eq!(v.object.as_deref(), Some("chat.completion"));
    assert_eq!(v.usage().completion_tokens, Some(2));
    assert_eq!(s.get("/version").json_as::<Version>().version, "0.11.0-sim");
    let m = s.get("/metrics").text();
    assert!(m.contains(
        "vllm:request_success_total{engine=\"0\",finished_reason=\"length\",model_name=\"m1\"} 1"
    ));
    assert!(m.contains("vllm:num_requests_running"));
    let start: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("process_start_time_seconds "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(start, s.stats().started_at);
    let t: Tokenized = s
        .post("/tokenize", &json!({"model": "m1", "prompt": "a b c"}))
        .json_as();
    assert_eq!(t.count, 3);
    assert_eq!(t.max_model_len, 32);
    assert_eq!(s.stats().requests.aggregated, 4);
    assert_eq!(s.admin("POST", "/stats/reset", "").status, 200);
    assert_eq!(s.stats().requests.aggregated, 0);
}

#[test]
fn cancelled_sglang_decode_does_not_consume_its_room() {
    let (p, d, bport) = sglang_pair(&["--kv-lease-s", "0.5"], &[]);
    let body = in_room(
        json!({"prompt": PROMPT, "max_tokens": 3, "stream": true, "rid": "gone-decode"}),
        bport,
        500,
    )
    .to_string();
    let c = send(&d.addr, "POST", "/v1/completions", &[], &body);
    assert!(d.stat_reaches(|s| s.in_flight == 1, Duration::from_secs(2)));
    drop(c);
    assert!(d.stat_reaches(|s| s.cancelled == 1, Duration::from_secs(1)));
    let last = d.last_recent();
    assert_eq!(last.request_id, "gone-decode");
    assert_eq!(last.room, Some(500));
    // The prefill publishes after the decode went away: nobody takes the room, it expires.
    let pre = p.complete(&in_room(
        json!({"prompt": PROMPT, "max_tokens": 1}),
        bport,
        500,
    ));
    assert_eq!(pre.status, 200);
    assert!(p.stat_reaches(|s| s.kv.expired == 1, Duration::from_secs(3)));
    assert_eq!(p.stats().kv.served, 0);
}

#[test]
fn health_hang_holds_until_the_client_gives_up() {
    let s = Sim::start(&["--dialect", "sglang"]);
    s.fault(json!({"phase": "health", "action": "hang"}));
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 256];
    let err = c.read(&mut buf).expect_err("no answer while hanging");
    assert!(matches!(
        err.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    ));
    drop(c);
    assert_eq!(s.get("/health").status, 200, "the fault applied once");
    let info: ServerInfo = s.get("/server_info").json_as();
    assert_eq!(info.disaggregation_mode, "null");
    assert_eq!(info.disaggregation_bootstrap_port, None);
    assert!(
        s.get("/get_model_info")
            .json_as::<ModelInfo>()
            .is_generation
    );
    assert!(s.get("/metrics").text().contains("sglang:num_running_reqs"));
    assert_eq!(s.get("/version").status, 404, "vLLM-only route");
}

#[test]
fn max_running_tpot_and_streamed_prefill() {
    let s = Sim::start(&["--max-running", "1", "--ttft-ms", "400", "--tpot-ms", "40"]);
    let addr = s.addr.clone();
    let first = thread::spawn(move || {
        request(
            &addr,
            "POST",
            "/v1/completions",
            &[],
            &json!({"prompt": PROMPT, "max_tokens": 5, "stream": true}).to_string(),
        )
    });
    assert!(s.stat_reaches(|s| s.in_flight == 1, Duration::from_secs(2)));
    let busy = s.complete(&json!({"prompt": PROMPT}));
    assert_eq!(busy.status, 429, "{}", busy.text());
    let t0 = Instant::now();
    let first = first.join().unwrap();
    assert_eq!(first.status, 200);
    assert_eq!(first.stream_text().split_whitespace().count(), 5);
    // The ttft wait overlapped the 429; the four 40 ms gaps did not.
    assert!(
        t0.elapsed() >= Duration::from_millis(150),
        "{:?}",
        t0.elapsed()
    );
    let recent = s.stats().recent.clone();
    assert_eq!(recent[0].status, 429);
    assert_eq!(recent[1].outcome, "ok");

    // A streamed prefill carries kv_transfer_params on its last token chunk.
    let p = Sim::start(&["--engine-id", "sp"]);
    let r = p.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
                "stream": true, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    let ev = r.events();
    assert_eq!(ev.len(), 4, "role, 2 tokens, [DONE]: {ev:?}");
    let last: Answer = serde_json::from_str(&ev[2]).unwrap();
    assert_eq!(handle_of(&last).remote_engine_id.as_deref(), Some("sp"));
    assert_eq!(
        last.choice(0).and_then(|c| c.finish_reason.as_deref()),
        Some("length")
    );
    assert_eq!(p.stats().kv.issued, 1);
}

/// The value of gauge `vllm:<name>` in a `/metrics` text (`""` when it has none).
fn vllm_gauge(metrics: &str, name: &str) -> String {
    metrics
        .lines()
        .find(|l| l.starts_with(&format!("vllm:{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .unwrap_or_default()
        .to_string()
}

/// `--max-num-seqs` as vLLM's scheduler: past the bound a request waits its turn (it is not
/// refused), counted in `num_requests_waiting` and not in `num_requests_running`, and its first
/// token comes after the running one ends.
#[test]
fn max_num_seqs_queues_the_rest_in_the_waiting_queue() {
    let s = Sim::start(&["--max-num-seqs", "1", "--tpot-ms", "60"]);
    let body = json!({"prompt": PROMPT, "max_tokens": 5, "stream": true}).to_string();
    let send = |body: String| {
        let addr = s.addr.clone();
        thread::spawn(move || {
            let r = request(&addr, "POST", "/v1/completions", &[], &body);
            (r, Instant::now())
        })
    };
    let first = send(body.clone());
    assert!(s.stat_reaches(|s| s.in_flight == 1, Duration::from_secs(2)));
    let second = send(body);
    assert!(
        s.stat_reaches(|s| s.waiting == 1, Duration::from_secs(2)),
        "{:?}",
        s.stats()
    );
    let metrics = s.get("/metrics").text();
    let gauge = |name: &str| vllm_gauge(&metrics, name);
    assert_eq!(gauge("num_requests_running"), "1", "{metrics}");
    assert_eq!(gauge("num_requests_waiting"), "1", "{metrics}");
    let (first, first_end) = first.join().unwrap();
    let (second, second_end) = second.join().unwrap();
    assert_eq!(first.status, 200);
    assert_eq!(second.status, 200, "waited, not refused: {}", second.text());
    assert_eq!(second.stream_text().split_whitespace().count(), 5);
    // The second ran only once the first had ended, and its four 60 ms gaps came after that.
    let after = second_end.duration_since(first_end);
    assert!(after >= Duration::from_millis(200), "{after:?}");
    assert_eq!(s.stats().waiting, 0);
    assert_eq!(s.stats().in_flight, 0);
}

/// `--kv-pool` as vLLM's one block pool: a running request holds its prompt's and its
/// output's blocks in the prefix cache's capacity, so one that does not fit beside it waits
/// (`num_requests_waiting`, `kv_cache_usage_perc` at the first's share) and runs once the first
/// ends. Its prefix is looked up when it is scheduled, not when it arrived: it hits the first's
/// prompt blocks, stored when the first was scheduled and kept cached after it ended.
#[test]
fn kv_pool_holds_running_requests_blocks_beside_the_cache() {
    // 8 blocks of 4 tokens; each request: 12 prompt tokens + 16 output = 7 blocks (the second
    // shares the first's two leading blocks, and needs 5 more: 1 left).
    let s = Sim::start(&[
        "--kv-pool",
        "--block-size",
        "4",
        "--kv-cache-blocks",
        "8",
        "--tpot-ms",
        "40",
        "--enable-prompt-tokens-details",
    ]);
    let prompt = "a b c d e f g h i j k l";
    let body = |tail: &str| {
        json!({"prompt": format!("{prompt}{tail}"), "max_tokens": 16, "stream": true,
               "stream_options": {"include_usage": true}})
        .to_string()
    };
    let send = |body: String| {
        let addr = s.addr.clone();
        thread::spawn(move || {
            let r = request(&addr, "POST", "/v1/completions", &[], &body);
            (r, Instant::now())
        })
    };
    let first = send(body(""));
    assert!(s.stat_reaches(|s| s.in_flight == 1, Duration::from_secs(2)));
    let second = send(body(""));
    assert!(
        s.stat_reaches(|s| s.waiting == 1, Duration::from_secs(2)),
        "{:?}",
        s.stats()
    );
    let metrics = s.get("/metrics").text();
    let gauge = |name: &str| vllm_gauge(&metrics, name);
    assert_eq!(gauge("num_requests_waiting"), "1", "{metrics}");
    assert_eq!(
        gauge("kv_cache_usage_perc"),
        "0.875",
        "7 of 8 blocks: {metrics}"
    );
    let (first, first_end) = first.join().unwrap();
    let (second, second_end) = second.join().unwrap();
    assert_eq!(
        (first.status, second.status),
        (200, 200),
        "{}",
        second.text()
    );
    // The second's fifteen 40 ms gaps came after the first ended.
    assert!(
        second_end.duration_since(first_end) >= Duration::from_millis(500),
        "{:?}",
        second_end.duration_since(first_end)
    );
    let cached = |r: &Resp| {
        r.events().iter().find_map(|e| {
            serde_json::from_str::<Answer>(e)
                .ok()
                .and_then(|a| a.usage)
                .and_then(|u| u.prompt_tokens_details)
                .and_then(|d| d.cached_tokens)
        })
    };
    assert_eq!(cached(&first), Some(0));
    assert_eq!(
        cached(&second),
        Some(8),
        "two of the first's three blocks (the last token is recomputed)"
    );
    let stats = s.stats();
    assert_eq!((stats.waiting, stats.in_flight), (0, 0));
    let metrics = s.get("/metrics").text();
    assert!(
        metrics.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny-sim\"} 0\n"),
        "nothing held once both ended: {metrics}"
    );
}

/// A decode engine keeps its side-channel connection to a producer for the next block read
/// (docs/engine-simulator.md, "KV side channel"); when the producer restarts on the same ports,
/// the kept connection is dead, and the next read goes over a new one instead of failing.
#[test]
fn a_kept_side_channel_survives_a_producer_restart() {
    let kv = narwhal_testkit::engine_port().to_string();
    let listen = format!("127.0.0.1:{}", narwhal_testkit::engine_port());
    let kv_listen = format!("127.0.0.1:{kv}");
    let producer = |id: &str| {
        Sim::start(&[
            "--engine-id",
            id,
            "--listen",
            &listen,
            "--kv-listen",
            &kv_listen,
        ])
    };
    let d = Sim::start(&["--engine-id", "dec-1"]);
    let transfer = |p: &Sim, i: usize| {
        let prompt = format!("{PROMPT} {i}");
        let pre = p
            .complete(&json!({"prompt": prompt, "max_tokens": 1,
                              "kv_transfer_params": {"do_remote_decode": true}}))
            .json_as::<Answer>();
        assert_eq!(
            handle_of(&pre).remote_port.map(|p| p.to_string()),
            Some(kv.clone())
        );
        let dec = d.complete(&json!({"prompt": prompt, "max_tokens": 3,
                                     "kv_transfer_params": pre.kv_transfer_params}));
        assert_eq!(dec.status, 200, "transfer {i}: {}", dec.text());
    };
    let mut p = producer("prod-a");
    transfer(&p, 0);
    transfer(&p, 1);
    p.handle.proc.kill();
    drop(p);
    p = producer("prod-b");
    transfer(&p, 2);
    transfer(&p, 3);
    let ds = d.stats();
    assert_eq!(ds.kv.consumed, 4, "{ds:?}");
    assert_eq!(ds.kv.rejected, 0, "{ds:?}");
    assert_eq!(p.stats().kv.served, 2);
}
