//! Ports for long-lived servers the tests start themselves (real vLLM engines and their side
//! channels), chosen outside the kernel's ephemeral range.
//!
//! [`crate::free_port`] binds `:0` and releases the port, so the kernel may hand the same port
//! to the next `bind(:0)` or outgoing connection on the machine. A real vLLM makes many of those
//! while it loads (torch's gloo store, its ZMQ sockets), and a side-channel port picked that way
//! was once taken by the engine next to it: the NIXL handshake listener died with "Address
//! already in use" and the engine never served. Ports below the ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`) are never handed out by the kernel unasked, and
//! this module never hands out the same one twice in a process.

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::Mutex;

/// The lowest port handed out.
const LOW: u16 = 10_000;

static TAKEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// The first port of the kernel's ephemeral range (`ip_local_port_range`), 32768 when it cannot
/// be read.
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A port in `[10000, ephemeral start)` that is free on every interface now (a TCP listener
/// binds it on `0.0.0.0`, which also covers `127.0.0.1`) and that this process has not handed
/// out before.
///
/// # Panics
/// When the range holds no such port (it holds over 20 000).
pub fn engine_port() -> u16 {
    let high = ephemeral_start().max(LOW + 1_000);
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    let taken = taken.get_or_insert_with(HashSet::new);
    let free = |port: u16| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok();
    let port = pick(LOW, high, rand::random::<u32>(), taken, free)
        .unwrap_or_else(|| panic!("no free port in [{LOW}, {high})"));
    taken.insert(port);
    port
}

/// The first of `n` consecutive ports, each as [`engine_port`] hands them out (a data-parallel
/// engine's ranks bind a base port plus their rank).
///
/// # Panics
/// When the range holds no such run.
pub fn engine_ports(n: u16) -> u16 {
    let high = ephemeral_start().max(LOW + 1_000);
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    let taken = taken.get_or_insert_with(HashSet::new);
    let free = |port: u16| TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok();
    let n = n.max(1);
    let base = pick(
        LOW,
        high.saturating_sub(n - 1),
        rand::random::<u32>(),
        taken,
        |p| (p..p + n).all(|q| !taken.contains(&q) && free(q)),
    )
    .unwrap_or_else(|| panic!("no {n} free consecutive ports in [{LOW}, {high})"));
    taken.extend(base..base + n);
    base
}

/// The first port of `[low, high)`, scanning from `low + start % (high - low)` and wrapping,
/// that is not in `taken` and for which `free` holds.
fn pick(
    low: u16,
    high: u16,
    start: u32,
    taken: &HashSet<u16>,
    free: impl Fn(u16) -> bool,
) -> Option<u16> {
    let span = u32::from(high.checked_sub(low)?);
    (0..span)
        .map(|i| low + ((start % span.max(1) + i) % span) as u16)
        .find(|p| !taken.contains(p) && free(*p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_and_never_repeat() {
        let high = ephemeral_start();
        let ports: Vec<u16> = (0..200).map(|_| engine_port()).collect();
        assert!(ports.iter().all(|p| (LOW..high).contains(p)), "{ports:?}");
        let unique: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(unique.len(), ports.len());
    }

    #[test]
    fn a_port_in_use_or_handed_out_is_skipped_and_the_scan_wraps() {
        let taken: HashSet<u16> = [10_006].into();
        let busy = |p: u16| p != 10_005;
        assert_eq!(pick(10_000, 10_010, 5, &taken, busy), Some(10_007));
        assert_eq!(pick(10_000, 10_010, 19, &taken, busy), Some(10_009));
        assert_eq!(
            pick(10_000, 10_010, 9, &taken, |p| p == 10_002),
            Some(10_002)
        );
        assert_eq!(pick(10_000, 10_010, 0, &taken, |_| false), None);
        assert_eq!(pick(10_000, 10_000, 0, &taken, |_| true), None);
    }
}
