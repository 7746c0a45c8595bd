//! Identity-read latency with many sockets on the host (docs/agent.md).
//!
//! ```text
//! cargo run --release -p narwhal-agent --example identity_bench -- [EXTRA_SOCKETS] [READS]
//! ```
//! A child process (this example, run as `hold N`) opens `EXTRA_SOCKETS` (default 2000) loopback
//! sockets (connected pairs), so they are on the host but not in the engine's fd table; this
//! process listens on one more port as the "engine" and times `READS` (default 200) identity reads of that port:
//! the full scan (`locate`: `/proc/net/tcp{,6}` plus every process's fds), the pid-hinted scan
//! (`locate_with_hint`: the socket tables, then the hinted pid's fds), and the cached re-check
//! ([`read_port_identity`] with the owner cached: `/proc/<pid>/fd/<n>` and `/proc/<pid>/stat`). Prints p50, p90 and max in
//! microseconds per kind.
// A benchmark measures wall time: the clock ban of clippy.toml is for product code.
#![allow(clippy::disallowed_methods)]

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use narwhal_agent::{
    LiveProc, ProcessLocator, ReadPath, locate, locate_with_hint, read_port_identity,
};

fn summary(name: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize].as_micros();
    println!(
        "{name:<24} n={:<5} p50={:>7} us  p90={:>7} us  max={:>7} us",
        samples.len(),
        at(0.5),
        at(0.9),
        at(1.0)
    );
}

fn time<T>(reads: usize, mut f: impl FnMut() -> T) -> Vec<Duration> {
    (0..reads)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed()
        })
        .collect()
}

/// `hold N`: open N loopback sockets, print "ready", keep them until stdin closes.
fn hold(extra: usize) {
    let server = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = server.local_addr().expect("addr");
    let mut held = Vec::with_capacity(extra);
    for _ in 0..extra / 2 {
        let c = TcpStream::connect(addr).expect("connect");
        let (s, _) = server.accept().expect("accept");
        held.push((c, s));
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(held);
}

fn main() {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("hold") {
        args.next();
        return hold(args.next().map_or(2000, |a| a.parse().expect("N")));
    }
    let extra: usize = args
        .next()
        .map_or(2000, |a| a.parse().expect("EXTRA_SOCKETS"));
    let reads: usize = args.next().map_or(200, |a| a.parse().expect("READS"));
    let mut holder = Command::new(std::env::current_exe().expect("current_exe"))
        .args(["hold", &extra.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the socket holder");
    let mut line = String::new();
    BufReader::new(holder.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("holder ready");
    assert_eq!(line.trim(), "ready", "holder said {line:?}");
    let engine = TcpListener::bind("127.0.0.1:0").expect("bind engine");
    let port = engine.local_addr().expect("addr").port();
    let tcp = std::fs::read_to_string("/proc/net/tcp")
        .expect("/proc/net/tcp")
        .lines()
        .count()
        + std::fs::read_to_string("/proc/net/tcp6").map_or(0, |t| t.lines().count());
    println!("sockets in /proc/net/tcp{{,6}}: {tcp} lines; engine port {port}; {reads} reads each");
    let loc = ProcessLocator::ListenPort(port);
    let me = std::process::id();
    summary(
        "full scan (locate)",
        time(reads.min(50), || locate(&loc).expect("locate")),
    );
    summary(
        "hinted scan",
        time(reads, || locate_with_hint(&loc, Some(me)).expect("hinted")),
    );
    bench_cached(&loc, reads);
    drop(holder.stdin.take());
    let _ = holder.wait();
}

fn bench_cached(loc: &ProcessLocator, reads: usize) {
    let ProcessLocator::ListenPort(port) = *loc else {
        return;
    };
    let first = read_port_identity(&LiveProc, port, None);
    let owner = first.owner.expect("the scan found the engine");
    summary(
        "cached re-check",
        time(reads, || {
            let r = read_port_identity(&LiveProc, port, Some(owner));
            assert_eq!(r.path, ReadPath::Cached);
            r.result.expect("cached read")
        }),
    );
}
