//! Closing TCP connections by socket cookie with sock_diag's `SOCK_DESTROY` (what
//! `ss -K` sends), for `--close-connections-to-removed-endpoints`.
//!
//! Why not `bpf_sock_destroy`: it is only callable from tracing (socket iterator) programs,
//! which this kernel refuses (see the guide's docs/src/benchmarks.md on tracing programs).
//! sock_diag needs `CONFIG_INET_DIAG_DESTROY` and `CAP_NET_ADMIN` in the socket's network
//! namespace.
//!
//! A sock_diag netlink socket only sees the sockets of the network namespace it was
//! created in, and a client socket lives in its pod's namespace. So for each network
//! namespace of the node (the unique `/proc/<pid>/ns/net` of every process, as the
//! DaemonSet runs with `hostPID`, and the named ones under `/run/netns`) a short-lived
//! thread enters it (`setns`), opens a `NETLINK_SOCK_DIAG` socket there, dumps the TCP
//! sockets of both families and destroys those whose `idiag_cookie` is wanted: the cookie is
//! the one `bpf_get_socket_cookie` gave the socket program (both are the kernel's
//! `sock_gen_cookie`), so a socket is matched exactly, never by its addresses alone. The
//! search stops once every wanted cookie was found.
//!
//! The messages (`linux/netlink.h`, `linux/sock_diag.h`, `linux/inet_diag.h`) are encoded
//! here, without a netlink crate: two requests (a dump, a destroy) of one fixed-layout
//! struct each, and one reply struct of which only the socket id is read.

use std::{
    collections::{BTreeSet, HashSet},
    fs::File,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    os::unix::fs::MetadataExt,
    path::PathBuf,
};

const NETLINK_SOCK_DIAG: i32 = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_HDRLEN: usize = 16;
/// `struct inet_diag_req_v2`: family, protocol, ext, pad, states (u32), sockid (48 bytes).
const REQ_LEN: usize = 56;
/// `struct inet_diag_msg`: family, state, timer, retrans, sockid (48 bytes), then five u32.
const MSG_LEN: usize = 72;
/// TCP states worth destroying (`1 << TCP_*`): every state of a connection that is still
/// open or closing, not LISTEN (a server socket) nor TIME_WAIT / CLOSE (already gone).
const TCP_STATES: u32 = (1 << 1) // ESTABLISHED
    | (1 << 2) // SYN_SENT
    | (1 << 3) // SYN_RECV
    | (1 << 4) // FIN_WAIT1
    | (1 << 5) // FIN_WAIT2
    | (1 << 8) // CLOSE_WAIT
    | (1 << 9) // LAST_ACK
    | (1 << 11); // CLOSING

/// `struct inet_diag_sockid` as the kernel sent it (ports and addresses in network order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SockId([u8; 48]);

impl SockId {
    fn cookie(&self) -> u64 {
        let lo = u32::from_ne_bytes(self.0[40..44].try_into().expect("4 bytes"));
        let hi = u32::from_ne_bytes(self.0[44..48].try_into().expect("4 bytes"));
        (hi as u64) << 32 | lo as u64
    }
}

/// The outcome of one [`destroy`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Destroyed {
    /// Sockets closed.
    pub closed: usize,
    /// Wanted cookies found in no network namespace (closed meanwhile, or in a namespace
    /// without a process and not named under /run/netns).
    pub not_found: usize,
    /// Network namespaces searched.
    pub namespaces: usize,
    /// Errors (a namespace that could not be entered, a refused destroy), one line each.
    pub errors: Vec<String>,
}

/// A `nlmsghdr` followed by an `inet_diag_req_v2`.
fn request(kind: u16, flags: u16, family: u8, id: Option<&SockId>) -> Vec<u8> {
    let mut m = Vec::with_capacity(NLMSG_HDRLEN + REQ_LEN);
    m.extend_from_slice(&((NLMSG_HDRLEN + REQ_LEN) as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
    m.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
    m.push(family);
    m.push(libc::IPPROTO_TCP as u8);
    m.push(0); // no extensions
    m.push(0);
    m.extend_from_slice(&TCP_STATES.to_ne_bytes());
    match id {
        Some(id) => m.extend_from_slice(&id.0),
        None => m.extend_from_slice(&[0; 48]),
    }
    m
}

/// A NETLINK_SOCK_DIAG socket in the calling thread's network namespace.
fn diag_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2); the descriptor is owned by the returned OwnedFd.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // Never block for long on a kernel that does not answer.
    let tv = libc::timeval {
        tv_sec: 2,
        tv_usec: 0,
    };
    // SAFETY: setsockopt(2) with a timeval we own.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    Ok(fd)
}

fn send(fd: &OwnedFd, msg: &[u8]) -> io::Result<()> {
    // SAFETY: a plain C struct, all zeroes valid (port id 0: the kernel).
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: sendto(2) of our buffer to the address above.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn recv(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: recv(2) into our buffer.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The netlink messages of one datagram: (type, payload).
fn messages(buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + NLMSG_HDRLEN <= buf.len() {
        let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().expect("2 bytes"));
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            break;
        }
        out.push((kind, &buf[at + NLMSG_HDRLEN..at + len]));
        at += (len + 3) & !3; // NLMSG_ALIGN
    }
    out
}

/// The `error` of an NLMSG_ERROR payload (0: an acknowledgement).
fn nl_error(payload: &[u8]) -> i32 {
    payload
        .get(..4)
        .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
        .unwrap_or(-libc::EPROTO)
}

/// The TCP sockets of `family` in this thread's network namespace whose cookie is in
/// `wanted`.
fn dump(fd: &OwnedFd, family: u8, wanted: &HashSet<u64>) -> io::Result<Vec<SockId>> {
    send(
        fd,
        &request(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_REQUEST | NLM_F_DUMP,
            family,
            None,
        ),
    )?;
    let mut found = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = recv(fd, &mut buf)?;
        if n == 0 {
            return Ok(found);
        }
        for (kind, payload) in messages(&buf[..n]) {
            match kind {
                NLMSG_DONE => return Ok(found),
                NLMSG_ERROR => {
                    let e = nl_error(payload);
                    return Err(io::Error::from_raw_os_error(-e));
                }
                SOCK_DIAG_BY_FAMILY if payload.len() >= MSG_LEN => {
                    let id = SockId(payload[4..52].try_into().expect("48 bytes"));
                    if wanted.contains(&id.cookie()) {
                        found.push(id);
                    }
                }
                _ => {}
            }
        }
    }
}

/// Destroys one socket (its exact 4-tuple, interface and cookie); the kernel resets the
/// connection (`tcp_abort`: the peer gets a RST, the owner ECONNABORTED).
fn destroy_one(fd: &OwnedFd, family: u8, id: &SockId) -> io::Result<()> {
    send(
        fd,
        &request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, family, Some(id)),
    )?;
    let mut buf = vec![0u8; 4096];
    let n = recv(fd, &mut buf)?;
    for (kind, payload) in messages(&buf[..n]) {
        if kind == NLMSG_ERROR {
            let e = nl_error(payload);
            return if e == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(-e))
            };
        }
    }
    Err(io::Error::other("no acknowledgement from sock_diag"))
}

/// In the calling thread's network namespace: destroys the TCP sockets whose cookie is
/// in `wanted`; returns the cookies closed.
fn destroy_here(wanted: &HashSet<u64>, errors: &mut Vec<String>, ns: &str) -> Vec<u64> {
    let fd = match diag_socket() {
        Ok(fd) => fd,
        Err(e) => {
            errors.push(format!("{ns}: sock_diag socket: {e}"));
            return Vec::new();
        }
    };
    let mut closed = Vec::new();
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let found = match dump(&fd, family, wanted) {
            Ok(f) => f,
            Err(e) => {
                errors.push(format!("{ns}: dump TCP sockets: {e}"));
                continue;
            }
        };
        for id in found {
            match destroy_one(&fd, family, &id) {
                Ok(()) => closed.push(id.cookie()),
                // Closed meanwhile: nothing left to do.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => closed.push(id.cookie()),
                Err(e) => errors.push(format!(
                    "{ns}: SOCK_DESTROY of socket cookie {}: {e}{}",
                    id.cookie(),
                    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                        " (the kernel lacks CONFIG_INET_DIAG_DESTROY)"
                    } else {
                        ""
                    }
                )),
            }
        }
    }
    closed
}

/// The network namespaces of the node: one path per distinct namespace, the agent's own
/// first, then those of every process (`/proc/<pid>/ns/net`) and the named ones.
fn namespaces() -> Vec<PathBuf> {
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let mut out = Vec::new();
    let mut add = |p: PathBuf| {
        if let Ok(m) = std::fs::metadata(&p)
            && seen.insert((m.dev(), m.ino()))
        {
            out.push(p);
        }
    };
    add(PathBuf::from("/proc/self/ns/net"));
    if let Ok(dir) = std::fs::read_dir("/proc") {
        let mut pids: Vec<u32> = dir
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        pids.sort_unstable();
        for pid in pids {
            add(PathBuf::from(format!("/proc/{pid}/ns/net")));
        }
    }
    for d in ["/run/netns", "/var/run/netns"] {
        if let Ok(dir) = std::fs::read_dir(d) {
            for e in dir.flatten() {
                add(e.path());
            }
        }
    }
    out
}

/// Closes the TCP sockets whose cookies are `cookies`, wherever they are on the node (see
/// the module documentation). Blocking (netlink and one thread per namespace searched):
/// call it off the async runtime. Each namespace's thread lives only for its search, so
/// no thread of the agent stays in another namespace.
pub fn destroy(cookies: &BTreeSet<u64>) -> Destroyed {
    let mut r = Destroyed::default();
    let mut wanted: HashSet<u64> = cookies.iter().copied().collect();
    for ns in namespaces() {
        if wanted.is_empty() {
            break;
        }
        r.namespaces += 1;
        let name = ns.display().to_string();
        let file = match File::open(&ns) {
            Ok(f) => f,
            // A process that exited since the listing.
            Err(_) => continue,
        };
        let w = wanted.clone();
        let joined = std::thread::spawn(move || {
            let mut errors = Vec::new();
            // SAFETY: setns(2) of this short-lived thread only, with a namespace file we own.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                errors.push(format!("{name}: setns: {}", io::Error::last_os_error()));
                return (Vec::new(), errors);
            }
            let closed = destroy_here(&w, &mut errors, &name);
            (closed, errors)
        })
        .join();
        match joined {
            Ok((closed, errors)) => {
                for c in closed {
                    if wanted.remove(&c) {
                        r.closed += 1;
                    }
                }
                r.errors.extend(errors);
            }
            Err(_) => r
                .errors
                .push(format!("{}: search thread panicked", ns.display())),
        }
    }
    r.not_found = wanted.len();
    r
}

/// Whether this kernel implements `SOCK_DESTROY` for TCP (`CONFIG_INET_DIAG_DESTROY`): a
/// destroy of a socket that cannot exist (all-zero id) in the caller's network namespace is
/// answered "no such socket" when it does, "not supported" when it does not.
///
/// Errors: the sock_diag socket cannot be used (privileges, no `inet_diag`).
pub fn destroy_supported() -> io::Result<bool> {
    let fd = diag_socket()?;
    match destroy_one(&fd, libc::AF_INET as u8, &SockId([0; 48])) {
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(true),
        Ok(()) => Ok(true),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_layout_is_nlmsghdr_then_inet_diag_req_v2() {
        let mut raw = [0u8; 48];
        raw[40..44].copy_from_slice(&0x1234_5678u32.to_ne_bytes());
        raw[44..48].copy_from_slice(&0x9abcu32.to_ne_bytes());
        let id = SockId(raw);
        assert_eq!(id.cookie(), 0x9abc_1234_5678);
        let m = request(SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, 2, Some(&id));
        assert_eq!(m.len(), 72);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 72);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), 21);
        assert_eq!(u16::from_ne_bytes(m[6..8].try_into().unwrap()), 5);
        assert_eq!(&m[16..20], &[2, 6, 0, 0]);
        assert_eq!(
            u32::from_ne_bytes(m[20..24].try_into().unwrap()),
            TCP_STATES
        );
        assert_eq!(&m[24..72], &raw);
    }

    #[test]
    fn messages_split_a_datagram_and_stop_at_a_bad_length() {
        let mut buf = Vec::new();
        for (kind, body) in [(20u16, vec![1u8, 2, 3]), (3, vec![0; 4])] {
            let len = (NLMSG_HDRLEN + body.len()) as u32;
            buf.extend_from_slice(&len.to_ne_bytes());
            buf.extend_from_slice(&kind.to_ne_bytes());
            buf.extend_from_slice(&[0; 10]);
            buf.extend_from_slice(&body);
            while buf.len() % 4 != 0 {
                buf.push(0);
            }
        }
        let m = messages(&buf);
        assert_eq!(m, vec![(20, &[1u8, 2, 3][..]), (3, &[0u8; 4][..])]);
        buf.extend_from_slice(&1000u32.to_ne_bytes());
        buf.extend_from_slice(&[0; 12]);
        assert_eq!(messages(&buf).len(), 2);
    }
}
