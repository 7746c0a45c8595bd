//! Every listening TCP socket of the agent's network namespace, as `(port, inode)`.
//!
//! First from the kernel's socket diagnostics (sock_diag(7): a `NETLINK_SOCK_DIAG` dump of
//! `AF_INET` and `AF_INET6` TCP sockets with the state filter `LISTEN`), the interface `ss`
//! uses. The kernel answers that dump from its listening hash alone, so it costs the number of
//! listeners. `/proc/net/tcp{,6}` instead prints every socket of the namespace, established
//! and `TIME_WAIT` ones included, walking the whole established hash table on each read: on a
//! host with a router's connections, or many agents' scans at once, that walk was nearly all
//! of an agent's CPU during a whole-fleet wave (docs/benchmarks.md, "Fleet size").
//!
//! When the netlink dump cannot be made (a kernel without `inet_diag`, a sandbox refusing
//! `AF_NETLINK`), the socket tables in `/proc/net` answer the same question, more slowly.

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_sys::protocols::NETLINK_SOCK_DIAG;
use netlink_sys::{Socket, SocketAddr};
use procfs::net::TcpState;

use super::ProcessError;
use super::stat::proc_err;

/// The kernel's `TCP_LISTEN` state number (include/net/tcp_states.h).
const TCP_LISTEN: u8 = 10;

/// Every TCP socket in LISTEN state, IPv4 and IPv6, as `(local port, socket inode)`;
/// unsorted, an inode may repeat. From sock_diag, else from `/proc/net/tcp{,6}`.
///
/// # Errors
/// [`ProcessError::Proc`] when neither the netlink dump nor either `/proc/net` table can be
/// read.
pub(super) fn listening_sockets() -> Result<Vec<(u16, u64)>, ProcessError> {
    match diag_listeners() {
        Ok(found) => Ok(found),
        Err(why) => {
            tracing::debug!(error = %why, "sock_diag dump failed: reading /proc/net/tcp");
            proc_listeners()
        }
    }
}

/// The listeners from `/proc/net/tcp` and `/proc/net/tcp6`.
pub(super) fn proc_listeners() -> Result<Vec<(u16, u64)>, ProcessError> {
    let v4 = procfs::net::tcp();
    let v6 = procfs::net::tcp6();
    if let (Err(e), Err(_)) = (&v4, &v6) {
        return Err(proc_err("/proc/net/tcp", e));
    }
    Ok(v4
        .into_iter()
        .flatten()
        .chain(v6.into_iter().flatten())
        .filter(|e| e.state == TcpState::Listen && e.inode != 0)
        .map(|e| (e.local_address.port(), e.inode))
        .collect())
}

/// The listeners from two sock_diag dumps (IPv4, then IPv6) on one netlink socket.
pub(super) fn diag_listeners() -> Result<Vec<(u16, u64)>, String> {
    let mut socket = Socket::new(NETLINK_SOCK_DIAG).map_err(|e| format!("socket: {e}"))?;
    socket.bind_auto().map_err(|e| format!("bind: {e}"))?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(|e| format!("connect: {e}"))?;
    let mut found = Vec::new();
    for (seq, (family, id)) in [
        (AF_INET, SocketId::new_v4()),
        (AF_INET6, SocketId::new_v6()),
    ]
    .into_iter()
    .enumerate()
    {
        dump(&socket, seq as u32 + 1, family, id, &mut found)?;
    }
    Ok(found)
}

/// One dump of `family`'s listening TCP sockets into `found`.
fn dump(
    socket: &Socket,
    seq: u32,
    family: u8,
    socket_id: SocketId,
    found: &mut Vec<(u16, u64)>,
) -> Result<(), String> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    header.sequence_number = seq;
    let mut packet = NetlinkMessage::new(
        header,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::LISTEN,
            socket_id,
        })
        .into(),
    );
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket.send(&buf, 0).map_err(|e| format!("send: {e}"))?;
    // A dump arrives as datagrams of one or more messages each, ended by NLMSG_DONE.
    let mut datagram = Vec::with_capacity(64 * 1024);
    loop {
        datagram.clear();
        let n = socket
            .recv(&mut datagram, 0)
            .map_err(|e| format!("recv: {e}"))?;
        let mut at = 0;
        while at < n {
            let msg = NetlinkMessage::<SockDiagMessage>::deserialize(&datagram[at..n])
                .map_err(|e| format!("a sock_diag answer: {e}"))?;
            let len = msg.header.length as usize;
            match msg.payload {
                // The state filter already holds; checked again all the same.
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r))
                    if r.header.state == TCP_LISTEN && r.header.inode != 0 =>
                {
                    found.push((r.header.socket_id.source_port, u64::from(r.header.inode)));
                }
                NetlinkPayload::Done(_) => return Ok(()),
                NetlinkPayload::Error(e) => return Err(format!("the kernel answered {e}")),
                _ => {}
            }
            if len == 0 {
                break;
            }
            at += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut v: Vec<(u16, u64)>) -> Vec<(u16, u64)> {
        v.sort_unstable();
        v.dedup();
        v
    }

    #[test]
    fn the_netlink_dump_and_the_proc_tables_list_the_same_listeners() {
        let v4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let v6 = std::net::TcpListener::bind("[::1]:0").ok();
        // A connected socket: in /proc/net/tcp, never a listener.
        let _client = std::net::TcpStream::connect(v4.local_addr().unwrap()).unwrap();
        let diag = sorted(diag_listeners().expect("sock_diag dump"));
        let ports: Vec<u16> = diag.iter().map(|(p, _)| *p).collect();
        assert!(ports.contains(&v4.local_addr().unwrap().port()), "{diag:?}");
        if let Some(v6) = &v6 {
            assert!(ports.contains(&v6.local_addr().unwrap().port()), "{diag:?}");
        }
        // Other processes may open or close listeners between the two reads: compare ours.
        let proc_ = sorted(proc_listeners().unwrap());
        let mine = |v: &[(u16, u64)]| -> Vec<(u16, u64)> {
            let want: Vec<u16> = std::iter::once(&v4)
                .chain(v6.as_ref())
                .map(|l| l.local_addr().unwrap().port())
                .collect();
            v.iter()
                .filter(|(p, _)| want.contains(p))
                .copied()
                .collect()
        };
        assert_eq!(mine(&diag), mine(&proc_));
        assert!(!mine(&diag).is_empty());
    }

    #[test]
    fn a_closed_listener_is_gone_from_the_dump() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening_sockets().unwrap().iter().any(|(p, _)| *p == port));
        drop(l);
        assert!(!listening_sockets().unwrap().iter().any(|(p, _)| *p == port));
    }
}
