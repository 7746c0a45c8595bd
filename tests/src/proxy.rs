//! A loopback TCP proxy that can be cut and healed, for network-partition tests (a standby that
//! cannot reach its primary while the primary keeps its lease; a primary cut off from etcd).

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// What the link does to traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Forwards both ways.
    Open,
    /// Open connections are dropped (the peer sees a reset or EOF), new ones accepted and
    /// closed at once.
    Refuse,
    /// Open connections stop forwarding but stay open, new ones are accepted and never
    /// answered: the peer sees silence until its own timeout (a dropped route, a firewall that
    /// drops packets).
    Blackhole,
}

/// A loopback TCP proxy to one target: [`Proxy::cut`] drops every open connection and
/// refuses new ones, [`Proxy::blackhole`] leaves them open and silent, [`Proxy::heal`]
/// forwards new connections again. Stops when dropped.
#[derive(Debug)]
pub struct Proxy {
    /// The proxy's URL, with the target's scheme (`http://127.0.0.1:PORT`).
    pub url: String,
    link: Arc<watch::Sender<Link>>,
    stop: CancellationToken,
}

/// Waits until the link is no longer `Open` (or the proxy stops); returns what it became.
async fn until_not_open(rx: &mut watch::Receiver<Link>) -> Link {
    loop {
        let now = *rx.borrow_and_update();
        if now != Link::Open {
            return now;
        }
        if rx.changed().await.is_err() {
            return Link::Refuse;
        }
    }
}

/// Waits until the link is `Open` again (or the proxy stops).
async fn until_open(rx: &mut watch::Receiver<Link>) {
    while *rx.borrow_and_update() != Link::Open {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// The accept loop: one task per connection, forwarding while the link is open.
async fn serve(
    listener: std::net::TcpListener,
    addr: String,
    l: Arc<watch::Sender<Link>>,
    s: CancellationToken,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let mut inbound = tokio::select! {
            () = s.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((sock, _)) => sock,
                Err(_) => return,
            },
        };
        let mut rx = l.subscribe();
        let s = s.clone();
        let addr = addr.clone();
        tokio::spawn(async move {
            let mode = *rx.borrow_and_update();
            if mode == Link::Open {
                let Ok(mut out) = tokio::net::TcpStream::connect(&addr).await else {
                    return;
                };
                let became = tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut out) => return,
                    () = s.cancelled() => return,
                    became = until_not_open(&mut rx) => became,
                };
                drop(out);
                if became == Link::Refuse {
                    return; // dropped: the peer sees the connection end
                }
            } else if mode == Link::Refuse {
                return; // accepted and closed
            }
            // Blackholed: hold the connection, silent, until healed or stopped; it is dropped
            // then (its upstream half is gone).
            tokio::select! {
                () = s.cancelled() => {}
                () = until_open(&mut rx) => {}
            }
            drop(inbound);
        });
    }
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `target`
    /// (`scheme://host:port`; TLS passes through untouched), on a thread of its own.
    ///
    /// # Panics
    /// When `target` has no scheme or the port cannot be bound.
    pub async fn start(target: &str) -> Proxy {
        let (scheme, addr) = target.split_once("://").expect("URL with a scheme");
        let addr = addr.trim_end_matches('/').to_string();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        listener.set_nonblocking(true).expect("nonblocking proxy");
        let url = format!("{scheme}://{}", listener.local_addr().expect("addr"));
        let link = Arc::new(watch::Sender::new(Link::Open));
        let stop = CancellationToken::new();
        let (l, s) = (link.clone(), stop.clone());
        // A thread and runtime of its own: the test's runtime (samplers, traffic, other
        // fleets) must not delay what the proxy forwards, or a loaded machine would fence
        // the router behind it before any fault.
        std::thread::Builder::new()
            .name("narwhal-test-proxy".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("proxy runtime");
                rt.block_on(serve(listener, addr, l, s));
            })
            .expect("proxy thread");
        Proxy { url, link, stop }
    }

    /// Cuts the link: open connections are dropped, new ones refused (accepted and closed).
    pub fn cut(&self) {
        self.link.send_replace(Link::Refuse);
    }

    /// Blackholes the link: open connections stop forwarding but stay open, new ones are
    /// accepted and never answered.
    pub fn blackhole(&self) {
        self.link.send_replace(Link::Blackhole);
    }

    /// Heals the link: new connections are forwarded again (connections held by a blackhole
    /// are closed).
    pub fn heal(&self) {
        self.link.send_replace(Link::Open);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
