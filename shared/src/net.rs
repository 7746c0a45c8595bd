//! A TCP listener with a listen queue of the caller's size. Tokio's `TcpListener::bind` asks
//! for 1024 pending connections, which a burst of thousands of clients overflows: their SYNs
//! are dropped and come back after the kernel's retransmission backoff (docs/operate.md,
//! "Many concurrent streams"). The router and the engine simulator both bind through this.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};

/// Binds `addr` with `SO_REUSEADDR` (as `TcpListener::bind` does: a restarted process rebinds
/// at once over connections in TIME_WAIT) and listens with a queue of `backlog` pending
/// connections (the kernel caps it at `net.core.somaxconn`).
///
/// # Errors
/// The socket, option, bind or listen call's error.
pub fn listen(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}
