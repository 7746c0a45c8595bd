//! A loopback TCP proxy that can be cut and healed, for network-partition tests (a standby that
//! cannot reach its primary while the primary keeps its lease; a primary cut off from etcd).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
    /// What connections send (new and open ones) is read and kept, unforwarded, until the
    /// link opens; then each that is still open gets what it sent to the target, and one its
    /// peer closed meanwhile is dropped, its kept bytes never forwarded (a server's front door
    /// that queues requests and discards those whose client left). Answers to what was
    /// forwarded before still flow back.
    Hold,
}

/// A loopback TCP proxy to one target: [`Proxy::cut`] drops every open connection and
/// refuses new ones, [`Proxy::blackhole`] leaves them open and silent, [`Proxy::hold`] keeps new
/// ones unforwarded until healed, [`Proxy::heal`] forwards new connections again. Stops when
/// dropped.
#[derive(Debug)]
pub struct Proxy {
    /// The proxy's URL, with the target's scheme (`http://127.0.0.1:PORT`).
    pub url: String,
    link: Arc<watch::Sender<Link>>,
    stop: CancellationToken,
    counts: Arc<Counts>,
}

/// What a held link did ([`Proxy::hold`]).
#[derive(Debug, Default)]
struct Counts {
    held: AtomicUsize,
    held_posts: AtomicUsize,
    discarded: AtomicUsize,
    forwarded_after_hold: AtomicUsize,
}

/// Waits until the link is `Open` again (or the proxy stops).
async fn until_open(rx: &mut watch::Receiver<Link>) {
    while *rx.borrow_and_update() != Link::Open {
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// What one turn of [`relay`] saw.
enum Turn {
    Stop,
    Link,
    FromPeer(std::io::Result<usize>),
    FromTarget(std::io::Result<usize>),
}

/// One proxied connection: forwards both ways while the link is open; while it is held, what
/// the peer sends is kept (and the target's answers to earlier requests still flow back) until
/// the link opens, or dropped unforwarded when the peer closes first; refused or blackholed, as
/// [`Link`] says.
async fn relay(
    mut inbound: tokio::net::TcpStream,
    addr: String,
    mut rx: watch::Receiver<Link>,
    s: CancellationToken,
    counts: Arc<Counts>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut out: Option<tokio::net::TcpStream> = None;
    let mut kept: Vec<u8> = Vec::new();
    let (mut ib, mut ob) = (vec![0u8; 16384], vec![0u8; 16384]);
    loop {
        let link = *rx.borrow_and_update();
        match link {
            Link::Refuse => return, // dropped: the peer sees the connection end
            Link::Blackhole => {
                // Silent until healed or stopped; dropped then (its upstream half is gone).
                drop(out);
                tokio::select! {
                    () = s.cancelled() => {}
                    () = until_open(&mut rx) => {}
                }
                return;
            }
            Link::Open => {
                if out.is_none() {
                    let Ok(o) = tokio::net::TcpStream::connect(&addr).await else {
                        return;
                    };
                    out = Some(o);
                }
                if !kept.is_empty() {
                    let Some(o) = out.as_mut() else { return };
                    if o.write_all(&kept).await.is_err() {
                        return;
                    }
                    kept.clear();
                    counts.forwarded_after_hold.fetch_add(1, Ordering::SeqCst);
                }
            }
            Link::Hold => {}
        }
        let turn = {
            let from_target = async {
                match out.as_mut() {
                    Some(o) => o.read(&mut ob).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = s.cancelled() => Turn::Stop,
                r = rx.changed() => if r.is_err() { Turn::Stop } else { Turn::Link },
                n = inbound.read(&mut ib) => Turn::FromPeer(n),
                n = from_target => Turn::FromTarget(n),
            }
        };
        match turn {
            Turn::Stop => return,
            Turn::Link => {}
            Turn::FromPeer(Ok(0) | Err(_)) => {
                if !kept.is_empty() {
                    counts.discarded.fetch_add(1, Ordering::SeqCst);
                }
                return;
            }
            Turn::FromPeer(Ok(n)) => {
                if *rx.borrow() == Link::Hold || out.is_none() {
                    if kept.is_empty() {
                        counts.held.fetch_add(1, Ordering::SeqCst);
                        if ib[..n].starts_with(b"POST ") {
                            counts.held_posts.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    kept.extend_from_slice(&ib[..n]);
                } else if let Some(o) = out.as_mut()
                    && o.write_all(&ib[..n]).await.is_err()
                {
                    return;
                }
            }
            Turn::FromTarget(Ok(0) | Err(_)) => return,
            Turn::FromTarget(Ok(n)) => {
                if inbound.write_all(&ob[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// The accept loop: one task per connection, forwarding while the link is open.
async fn serve(
    listener: std::net::TcpListener,
    addr: String,
    l: Arc<watch::Sender<Link>>,
    s: CancellationToken,
    counts: Arc<Counts>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let inbound = tokio::select! {
            () = s.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((sock, _)) => sock,
                Err(_) => return,
            },
        };
        let rx = l.subscribe();
        let s = s.clone();
        let addr = addr.clone();
        let counts = counts.clone();
        tokio::spawn(relay(inbound, addr, rx, s, counts));
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
        let counts = Arc::new(Counts::default());
        let c = counts.clone();
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
                rt.block_on(serve(listener, addr, l, s, c));
            })
            .expect("proxy thread");
        Proxy {
            url,
            link,
            stop,
            counts,
        }
    }

    /// Holds the link: what connections send from now on is kept, unforwarded, until
    /// [`Proxy::heal`]; then each still open is forwarded what it sent, and one its peer
    /// closed meanwhile is discarded, never reaching the target.
    pub fn hold(&self) {
        self.link.send_replace(Link::Hold);
    }

    /// Connections whose held bytes begin a `POST` (a completion, not a health probe's `GET`).
    pub fn held_posts(&self) -> usize {
        self.counts.held_posts.load(Ordering::SeqCst)
    }

    /// `(held, discarded, forwarded after the hold)`: connections that sent something while
    /// held, those whose peer closed them before the heal, and those forwarded at the heal.
    pub fn hold_counts(&self) -> (usize, usize, usize) {
        let c = &self.counts;
        (
            c.held.load(Ordering::SeqCst),
            c.discarded.load(Ordering::SeqCst),
            c.forwarded_after_hold.load(Ordering::SeqCst),
        )
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
