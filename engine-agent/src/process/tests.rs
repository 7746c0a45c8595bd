//! Unit tests of `process`: stat parsing, live `/proc` reads, and the cached-owner rules
//! against a fake `/proc` and the real one.

use std::path::Path;

use narwhal_shared::ProcessIdentity;

use super::stat::read_stat;
use super::*;

fn stat_line(comm: &str, state: char, start: u64) -> String {
    // 52 fields as on Linux 5.x+; starttime is field 22.
    let mut fields: Vec<String> = vec![state.to_string()];
    for i in 4..=52 {
        fields.push(if i == 22 {
            start.to_string()
        } else {
            (i * 3).to_string()
        });
    }
    format!("4242 ({comm}) {}\n", fields.join(" "))
}

#[test]
fn plain_command_name() {
    let f = parse_stat(4242, &stat_line("vllm", 'S', 987_654)).unwrap();
    assert_eq!(f.comm, "vllm");
    assert_eq!(f.state, 'S');
    assert_eq!(f.start_ticks, 987_654);
}

#[test]
fn command_names_with_spaces_parens_and_newlines_do_not_shift_fields() {
    for comm in [
        "python3 -m vllm",
        "evil) S 1 2 3",
        ") R 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 9 (",
        "multi\nline\n) Z",
        "((()))",
        "",
    ] {
        let f = parse_stat(4242, &stat_line(comm, 'R', 123_456)).unwrap();
        assert_eq!(f.comm, comm, "comm {comm:?}");
        assert_eq!(f.state, 'R', "comm {comm:?}");
        assert_eq!(f.start_ticks, 123_456, "comm {comm:?}");
    }
}

#[test]
fn truncated_or_malformed_stat_is_an_error() {
    assert!(matches!(
        parse_stat(1, "1 (x) S 1 2"),
        Err(ProcessError::StatFormat { .. })
    ));
    assert!(matches!(
        parse_stat(1, "1 x S"),
        Err(ProcessError::StatFormat { .. })
    ));
    let bad_start = stat_line("x", 'S', 777).replace(" 777 ", " nope ");
    match parse_stat(1, &bad_start) {
        Err(ProcessError::StatFormat { reason, .. }) => assert!(reason.contains("nope")),
        other => panic!("expected StatFormat, got {other:?}"),
    }
    let mut line = stat_line("x", 'S', 5);
    line = line.replacen(" S ", " SS ", 1);
    assert!(matches!(
        parse_stat(1, &line),
        Err(ProcessError::StatFormat { .. })
    ));
}

#[test]
fn a_reused_pid_is_a_different_process() {
    // Same pid, same boot, new start_ticks: identity equality must say "different".
    let a = parse_stat(4242, &stat_line("engine", 'S', 1000)).unwrap();
    let b = parse_stat(4242, &stat_line("engine", 'S', 2000)).unwrap();
    let ident = |t: u64| ProcessIdentity {
        pid: 4242,
        boot_id: "boot".into(),
        start_ticks: t,
        clk_tck: 100,
        btime: 1,
        process_start_time_seconds: ProcessIdentity::start_time_seconds(1, t, 100),
        exe: "/bin/engine".into(),
        listen_port: None,
        pod: None,
    };
    assert!(!ident(a.start_ticks).same_process(&ident(b.start_ticks)));
    assert!(ident(a.start_ticks).same_process(&ident(a.start_ticks)));
}

#[test]
fn own_process_identity_is_readable_and_stable() {
    let me = std::process::id();
    let a = read_identity(me, None).unwrap();
    let b = read_identity(me, None).unwrap();
    assert!(a.same_process(&b));
    assert_eq!(a.pid, me);
    assert!(a.process_start_time_seconds > a.btime as f64 - 1.0);
    assert!(!a.boot_id.is_empty());
    assert!(!a.exe.is_empty());
}

#[test]
fn a_zombie_is_an_error_and_a_reaped_process_has_vanished() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    // Poll (no sleep-as-synchronisation): the unreaped child becomes a zombie.
    let deadline = std::time::Duration::from_secs(10);
    let mut waited = std::time::Duration::ZERO;
    loop {
        match read_identity(pid, None) {
            Err(ProcessError::NotRunning { state: 'Z', .. }) => break,
            // Still running, or caught between exit and zombie: poll again.
            Ok(_)
            | Err(ProcessError::ChangedDuringRead { .. })
            | Err(ProcessError::Exiting { .. }) => {}
            Err(e) => panic!("unexpected {e}"),
        }
        assert!(waited < deadline, "child {pid} never became a zombie");
        std::thread::yield_now();
        std::thread::sleep(std::time::Duration::from_millis(5));
        waited += std::time::Duration::from_millis(5);
    }
    child.wait().unwrap();
    assert!(matches!(
        read_identity(pid, None),
        Err(ProcessError::Vanished { .. }) | Err(ProcessError::NotRunning { .. })
    ));
}

#[test]
fn the_owner_of_a_listening_socket_is_found() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let id = locate(&ProcessLocator::ListenPort(port)).unwrap();
    assert_eq!(id.pid, std::process::id());
    assert_eq!(id.listen_port, Some(port));
    drop(listener);
    assert_port_left(locate(&ProcessLocator::ListenPort(port)), port);
}

/// After our listener closed, the port is never attributed to us. Usually nothing listens
/// there (`NoListener`); on a busy machine another process may already have bound the
/// freed ephemeral port (seen under a loaded test run: `NoOwner`, its socket's owner not
/// yet visible, or that process itself).
fn assert_port_left(found: Result<ProcessIdentity, ProcessError>, port: u16) {
    match found {
        Err(ProcessError::NoListener { port: p }) | Err(ProcessError::NoOwner { port: p, .. }) => {
            assert_eq!(p, port)
        }
        Ok(id) => assert_ne!(id.pid, std::process::id(), "a closed socket is still ours"),
        Err(e) => panic!("port {port}: {e:?}"),
    }
}

#[test]
fn an_unknown_systemd_unit_is_a_named_error() {
    // Whether or not systemd runs here, an unknown unit has no MainPID.
    let unit = "narwhal-no-such-unit-for-tests.service";
    match locate(&ProcessLocator::SystemdUnit(unit.into())) {
        Err(ProcessError::Systemd { unit: u, .. }) => assert_eq!(u, unit),
        other => panic!("expected a Systemd error, got {other:?}"),
    }
}

#[test]
fn a_stale_hint_falls_back_to_the_scan() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let loc = ProcessLocator::ListenPort(port);
    let me = std::process::id();
    assert_eq!(locate_with_hint(&loc, Some(me)).unwrap().pid, me);
    // pid 1 does not own our socket: the scan still finds us.
    assert_eq!(locate_with_hint(&loc, Some(1)).unwrap().pid, me);
    drop(listener);
    assert_port_left(locate_with_hint(&loc, Some(me)), port);
}

#[test]
fn pid_files_are_read_and_bad_ones_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("engine.pid");
    std::fs::write(&good, format!("{}\n", std::process::id())).unwrap();
    assert_eq!(
        locate(&ProcessLocator::PidFile(good)).unwrap().pid,
        std::process::id()
    );
    let bad = dir.path().join("bad.pid");
    std::fs::write(&bad, "nope").unwrap();
    assert!(matches!(
        locate(&ProcessLocator::PidFile(bad)),
        Err(ProcessError::PidFile { .. })
    ));
}

// ---- the cached owner: a fake /proc for every mismatch kind ----

use std::cell::RefCell;
use std::collections::HashMap;

/// A scripted `/proc`: processes (pid -> start_ticks, or an error), their socket fds, and
/// the answers of successive scans. Counts scans so a test can see which path ran.
#[derive(Default)]
struct FakeProc {
    procs: HashMap<u32, Result<u64, ProcessError>>,
    fds: HashMap<(u32, u32), u64>,
    scans: RefCell<Vec<Result<ResolvedOwner, ProcessError>>>,
    scanned: RefCell<usize>,
}

impl FakeProc {
    fn process(mut self, pid: u32, start: u64, fd: u32, inode: u64) -> Self {
        self.procs.insert(pid, Ok(start));
        self.fds.insert((pid, fd), inode);
        self
    }
    fn scan_finds(self, r: Result<ResolvedOwner, ProcessError>) -> Self {
        self.scans.borrow_mut().push(r);
        self
    }
    fn scans(&self) -> usize {
        *self.scanned.borrow()
    }
}

impl ProcView for FakeProc {
    fn socket_inode(&self, pid: u32, fd: u32) -> Option<u64> {
        self.fds.get(&(pid, fd)).copied()
    }
    fn identity(&self, pid: u32, port: u16) -> Result<ProcessIdentity, ProcessError> {
        let start = self
            .procs
            .get(&pid)
            .cloned()
            .unwrap_or(Err(ProcessError::Vanished { pid }))?;
        Ok(ProcessIdentity {
            pid,
            boot_id: "boot".into(),
            start_ticks: start,
            clk_tck: 100,
            btime: 1,
            process_start_time_seconds: ProcessIdentity::start_time_seconds(1, start, 100),
            exe: "/bin/engine".into(),
            listen_port: Some(port),
            pod: None,
        })
    }
    fn scan(&self, port: u16, _hint: Option<u32>) -> Result<ResolvedOwner, ProcessError> {
        *self.scanned.borrow_mut() += 1;
        let mut scans = self.scans.borrow_mut();
        if scans.is_empty() {
            return Err(ProcessError::NoListener { port });
        }
        scans.remove(0)
    }
}

fn owner(pid: u32, start_ticks: u64, fd: u32, inode: u64) -> ResolvedOwner {
    ResolvedOwner {
        pid,
        start_ticks,
        fd,
        inode,
    }
}

#[test]
fn a_confirmed_cached_owner_is_answered_without_a_scan() {
    let view = FakeProc::default().process(10, 500, 7, 9001);
    let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
    assert_eq!(read.path, ReadPath::Cached);
    assert_eq!(read.mismatch, None);
    assert_eq!(read.result.unwrap().start_ticks, 500);
    assert_eq!(read.owner, Some(owner(10, 500, 7, 9001)));
    assert_eq!(view.scans(), 0);
}

#[test]
fn nothing_cached_scans_and_caches_the_confirmed_owner() {
    let view = FakeProc::default()
        .process(10, 500, 7, 9001)
        .scan_finds(Ok(owner(10, 500, 7, 9001)));
    let read = read_port_identity(&view, 8000, None);
    assert_eq!(read.path, ReadPath::Scan);
    assert_eq!(read.result.unwrap().pid, 10);
    assert_eq!(read.owner, Some(owner(10, 500, 7, 9001)));
    assert_eq!(view.scans(), 1);
}

#[test]
fn a_restarted_engine_under_a_new_pid_is_found_by_the_scan() {
    // The old process (pid 10) is gone; pid 11 listens now.
    let view = FakeProc::default()
        .process(11, 900, 5, 9002)
        .scan_finds(Ok(owner(11, 900, 5, 9002)));
    let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
    assert_eq!(read.path, ReadPath::Scan);
    assert_eq!(
        read.mismatch,
        Some(Mismatch::SocketGone {
            pid: 10,
            inode: 9001
        })
    );
    let id = read.result.unwrap();
    assert_eq!((id.pid, id.start_ticks), (11, 900));
    assert_eq!(read.owner, Some(owner(11, 900, 5, 9002)));
}

#[test]
fn a_reused_pid_with_another_start_time_is_never_the_old_identity() {
    // Same pid, same fd number and inode number (as unlikely as it gets), new start time:
    // the start time alone must force the scan, and the answer is the new process.
    let view = FakeProc::default()
        .process(10, 777, 7, 9001)
        .scan_finds(Ok(owner(10, 777, 7, 9001)));
    let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
    assert_eq!(
        read.mismatch,
        Some(Mismatch::Restarted {
            pid: 10,
            before: 500,
            after: 777
        })
    );
    assert_eq!(read.path, ReadPath::Scan);
    assert_eq!(read.result.unwrap().start_ticks, 777);
    assert_eq!(read.owner.unwrap().start_ticks, 777);
}

#[test]
fn a_process_that_stopped_listening_is_an_error_not_its_old_identity() {
    // Pid 10 is alive with the same start time, but its fd 7 is something else now, and
    // nobody listens on the port.
    let mut view = FakeProc::default().process(10, 500, 7, 4444);
    view.scans.borrow_mut().clear();
    let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
    assert!(matches!(read.mismatch, Some(Mismatch::SocketGone { .. })));
    assert_eq!(read.result, Err(ProcessError::NoListener { port: 8000 }));
    assert_eq!(read.owner, None, "the cache is dropped");
    view.fds.clear();
    let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
    assert_eq!(read.result, Err(ProcessError::NoListener { port: 8000 }));
}

#[test]
fn a_zombie_or_vanished_owner_is_an_error() {
    // The cached owner still "holds" the fd in our fake but reads as a zombie; the scan
    // finds it again (it has not released the socket yet), and it is still a zombie.
    let zombie = Err(ProcessError::NotRunning {
        pid: 10,
        state: 'Z',
    });
    let mut view = FakeProc::default()
        .process(10, 500, 7, 9001)
        .scan_finds(Ok(owner(10, 500, 7, 9001)))
        .scan_finds(Ok(owner(10, 500, 7, 9001)));
    view.procs.insert(10, zombie.clone());
    let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
    assert_eq!(
        read.mismatch,
        Some(Mismatch::Unreadable(ProcessError::NotRunning {
            pid: 10,
            state: 'Z'
        }))
    );
    assert_eq!(read.result.map(|_| ()), zombie.map(|_: u64| ()));
    assert_eq!(read.owner, None);
    // Vanished: no process, no fds; the scan finds no listener.
    let view = FakeProc::default();
    let read = read_port_identity(&view, 8000, Some(owner(10, 500, 7, 9001)));
    assert_eq!(read.result, Err(ProcessError::NoListener { port: 8000 }));
}

#[test]
fn an_owner_that_changes_between_scan_and_read_is_rescanned_once_then_an_error() {
    // First scan names pid 10 with start 500, but pid 10 is now start 600 (it died and the
    // pid was reused between the scan and the read); the second scan names pid 12.
    let view = FakeProc::default()
        .process(10, 600, 7, 9001)
        .process(12, 800, 3, 9003)
        .scan_finds(Ok(owner(10, 500, 7, 9001)))
        .scan_finds(Ok(owner(12, 800, 3, 9003)));
    let read = read_port_identity(&view, 8000, None);
    assert_eq!(read.result.unwrap().pid, 12);
    assert_eq!(view.scans(), 2);
    // Twice unstable: an error naming the port, nothing cached.
    let view = FakeProc::default()
        .process(10, 600, 7, 9001)
        .scan_finds(Ok(owner(10, 500, 7, 9001)))
        .scan_finds(Ok(owner(10, 501, 7, 9001)));
    let read = read_port_identity(&view, 8000, None);
    assert!(
        matches!(
            read.result,
            Err(ProcessError::OwnerChanged { port: 8000, .. })
        ),
        "{:?}",
        read.result
    );
    assert_eq!(read.owner, None);
}

// ---- the same rules against the real /proc ----

/// Lets `fd` survive exec so a child inherits it (std sets close-on-exec on sockets).
fn inheritable(fd: std::os::fd::BorrowedFd<'_>) {
    use nix::fcntl::{F_GETFD, F_SETFD, FdFlag, fcntl};
    let flags = FdFlag::from_bits_truncate(fcntl(fd, F_GETFD).unwrap());
    fcntl(fd, F_SETFD(flags - FdFlag::FD_CLOEXEC)).unwrap();
}

#[test]
fn live_a_closed_listener_is_never_answered_from_the_cache() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let first = read_port_identity(&LiveProc, port, None);
    assert_eq!(first.path, ReadPath::Scan);
    assert_eq!(first.result.as_ref().unwrap().pid, std::process::id());
    let cached = first.owner.expect("an owner to cache");
    let again = read_port_identity(&LiveProc, port, Some(cached));
    assert_eq!(again.path, ReadPath::Cached);
    assert!(
        again
            .result
            .unwrap()
            .same_process(first.result.as_ref().unwrap())
    );
    // Same process, still alive, same start time, but it closed the socket: never the
    // cached answer. (A child forked by a concurrent test can hold a copy of the socket
    // until its exec closes it, so poll until nobody listens.)
    drop(listener);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let after = read_port_identity(&LiveProc, port, Some(cached));
        assert_eq!(after.path, ReadPath::Scan, "{after:?}");
        assert!(
            matches!(after.mismatch, Some(Mismatch::SocketGone { .. })),
            "{after:?}"
        );
        assert!(
            after.result.as_ref().map(|i| i.pid) != Ok(std::process::id()),
            "answered for a process that closed its listener: {after:?}"
        );
        if after.result == Err(ProcessError::NoListener { port }) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{after:?}");
        std::thread::yield_now();
    }
}

#[test]
fn live_the_port_handed_to_a_new_process_is_read_as_that_process_then_its_zombie_is_not() {
    use std::os::fd::AsFd as _;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mine = read_port_identity(&LiveProc, port, None);
    let cached = mine.owner.expect("owner");
    assert_eq!(cached.pid, std::process::id());
    // A "restarted engine": a new process holding the same listening socket.
    inheritable(listener.as_fd());
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn sleep");
    drop(listener);
    let child_pid = child.id();
    // Poll: the child holds the inherited socket from exec on.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let moved = loop {
        let r = read_port_identity(&LiveProc, port, Some(cached));
        if r.result.as_ref().map(|i| i.pid) == Ok(child_pid) {
            break r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "child never seen: {r:?}"
        );
        std::thread::yield_now();
    };
    assert_eq!(moved.path, ReadPath::Scan);
    assert!(matches!(moved.mismatch, Some(Mismatch::SocketGone { .. })));
    let child_owner = moved.owner.expect("child cached");
    assert_eq!(
        read_port_identity(&LiveProc, port, Some(child_owner)).path,
        ReadPath::Cached
    );
    // The child dies and is not reaped. While it is dying it may still be answered (it
    // holds the socket until its files are released); once it is a zombie it never is,
    // and the port has no listener.
    child.kill().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !matches!(
        read_stat(Path::new("/proc"), child_pid),
        Err(ProcessError::NotRunning { state: 'Z', .. })
    ) {
        assert!(std::time::Instant::now() < deadline, "child never a zombie");
        std::thread::yield_now();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let r = read_port_identity(&LiveProc, port, Some(child_owner));
        assert!(
            r.result.as_ref().map(|i| i.pid) != Ok(child_pid),
            "a zombie answered with its old identity: {r:?}"
        );
        if r.result == Err(ProcessError::NoListener { port }) {
            assert_eq!(r.owner, None);
            break;
        }
        // Only a process spawned by a concurrent test in the instant the socket was
        // inheritable could still hold it; it exits at once.
        assert!(
            std::time::Instant::now() < deadline,
            "still listening: {r:?}"
        );
        std::thread::yield_now();
    }
    child.wait().unwrap();
}
