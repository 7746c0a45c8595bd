//! The socket fds of a process: one `readlinkat(2)` per fd of `/proc/<pid>/fd`.
//!
//! The `procfs` crate's fd iterator opens each fd entry (`O_PATH`), reads its link, `fstat`s it
//! for the mode and closes it: four system calls per fd where the link alone says whether it
//! is a socket and which. A host scan reads every fd of every process (a router's connections,
//! an engine's hundreds of sockets), so during a whole-fleet wave those calls were most of an
//! agent's CPU (docs/benchmarks.md, "Fleet size"). Only the link is read here.

use std::fs::File;
use std::path::Path;

/// `(fd, socket inode)` of every socket fd of `pid`, in `/proc/<pid>/fd` order; `None` when the
/// directory cannot be read (the process is gone, or not ours to read). An fd closed during
/// the listing is left out.
pub(super) fn socket_fds(pid: u32) -> Option<Vec<(u32, u64)>> {
    let dir = Path::new("/proc").join(pid.to_string()).join("fd");
    let handle = File::open(&dir).ok()?;
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).ok()?.flatten() {
        let name = entry.file_name();
        let Some(fd) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(link) = nix::fcntl::readlinkat(&handle, name.as_os_str()) else {
            continue;
        };
        if let Some(inode) = link.to_str().and_then(socket_inode_of) {
            out.push((fd, inode));
        }
    }
    Some(out)
}

/// The inode of an fd link `socket:[INODE]`; `None` for any other target.
pub(super) fn socket_inode_of(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn lists_this_process_sockets_and_nothing_else() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let file = File::open("/proc/self/stat").unwrap();
        let me = std::process::id();
        let fds = socket_fds(me).unwrap();
        let fd = listener.as_raw_fd() as u32;
        let want = procfs::process::Process::myself()
            .unwrap()
            .fd_from_fd(fd as i32)
            .unwrap();
        let procfs::process::FDTarget::Socket(inode) = want.target else {
            panic!("not a socket: {want:?}");
        };
        assert!(fds.contains(&(fd, inode)), "{fds:?}");
        assert!(!fds.iter().any(|(f, _)| *f == file.as_raw_fd() as u32));
    }

    #[test]
    fn a_missing_process_has_no_fds() {
        assert_eq!(socket_fds(u32::MAX), None);
    }

    #[test]
    fn only_socket_links_have_an_inode() {
        assert_eq!(socket_inode_of("socket:[12345]"), Some(12345));
        assert_eq!(socket_inode_of("pipe:[12345]"), None);
        assert_eq!(socket_inode_of("/dev/null"), None);
        assert_eq!(socket_inode_of("socket:[x]"), None);
    }
}
