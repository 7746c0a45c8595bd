//! A loopback TCP proxy that can be cut, for network-partition tests (a standby that cannot
//! reach its primary while the primary keeps its lease).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;

/// A loopback TCP proxy to one target: [`Proxy::cut`] drops every open connection and
/// refuses new ones (accepts and closes them at once). Stops when dropped.
#[derive(Debug)]
pub struct Proxy {
    /// The proxy's URL, with the target's scheme (`http://127.0.0.1:PORT`).
    pub url: String,
    open: Arc<AtomicBool>,
    conns: CancellationToken,
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to `target`
    /// (`scheme://host:port`; TLS passes through untouched).
    ///
    /// # Panics
    /// When `target` has no scheme or the port cannot be bound.
    pub async fn start(target: &str) -> Proxy {
        let (scheme, addr) = target.split_once("://").expect("URL with a scheme");
        let addr = addr.trim_end_matches('/').to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind proxy");
        let url = format!("{scheme}://{}", listener.local_addr().expect("addr"));
        let open = Arc::new(AtomicBool::new(true));
        let conns = CancellationToken::new();
        let stop = CancellationToken::new();
        let (o, c, s) = (open.clone(), conns.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let mut inbound = tokio::select! {
                    () = s.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((sock, _)) => sock,
                        Err(_) => return,
                    },
                };
                if !o.load(Ordering::SeqCst) {
                    continue; // dropped: connection reset
                }
                let addr = addr.clone();
                let c = c.clone();
                tokio::spawn(async move {
                    let Ok(mut out) = tokio::net::TcpStream::connect(&addr).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut out) => {}
                        () = c.cancelled() => {}
                    }
                });
            }
        });
        Proxy {
            url,
            open,
            conns,
            stop,
        }
    }

    /// Cuts the link: open connections are dropped, new ones refused.
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.conns.cancel();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.conns.cancel();
    }
}
