//! Test and demo support: RAII guards for network namespaces, a bridge "lab" of pod
//! namespaces, a child cgroup v2, and processes started inside them.
//!
//! Not used by the agent itself. Everything here needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN).
//!
//! Safety rules this module enforces:
//! - Every interface is created inside a namespace this module created; nothing is added to
//!   the root network namespace.
//! - The only cgroup touched is a child of the cgroup2 mount, created here.
//! - Every guard cleans up in `Drop` (best effort, never panics) and every constructor first
//!   removes a leftover of the same name, so a crashed earlier run does not break the next.
//! - Every wait is bounded in time.

use std::io::{self, Read};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::thread;
use std::time::Duration;

use anyhow::Result;

mod cgroup;
mod lab;
mod netns;
mod process;
#[cfg(test)]
mod tests;
mod wire;

pub use cgroup::{TestCgroup, cgroup2_mount};
pub use lab::{Lab, Pod};
pub use netns::Netns;
pub use process::{ChildGuard, configure_in, in_netns, output_in, run_checked, spawn_in};
pub use wire::{WIRE_BRIDGE, Wire};

/// Directory where `ip netns` keeps its namespace files.
pub const NETNS_RUN_DIR: &str = "/run/netns";
/// Where bpffs is mounted by [`ensure_bpffs`].
pub const BPFFS_PATH: &str = "/sys/fs/bpf";
/// Timeout for the short `ip` commands this module runs.
const IP_TIMEOUT: Duration = Duration::from_secs(10);

/// Gateway address of the lab bridge (in the node namespace); pods use it as default route.
/// The lab's pod subnet is `198.18.0.0/24` (RFC 2544 benchmark range), which exists only
/// inside the lab's namespaces.
pub const LAB_GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// Prefix length of the lab's IPv4 pod subnet.
pub const LAB_PREFIX_V4: u8 = 24;
/// IPv6 gateway address of the lab bridge; the lab's IPv6 pod subnet is `fd00:198:18::/64`.
pub const LAB_GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x198, 0x18, 0, 0, 0, 0, 1);
/// Prefix length of the lab's IPv6 pod subnet.
pub const LAB_PREFIX_V6: u8 = 64;
/// Name of the bridge inside the lab's node namespace.
pub const LAB_BRIDGE: &str = "br0";
/// The lab bridge's MAC address (locally administered, unicast), set explicitly so it never
/// follows its ports' (see [`Lab::new`]).
pub const LAB_BRIDGE_MAC: &str = "02:eb:70:00:00:01";

// ---------------------------------------------------------------------------------------
// bpffs
// ---------------------------------------------------------------------------------------

/// Mounts bpffs on [`BPFFS_PATH`] unless it is mounted already. Returns `true` when it
/// mounted it now.
pub fn ensure_bpffs() -> Result<bool> {
    proxy_userspace::mounts::ensure_bpffs(Path::new(BPFFS_PATH))
}

/// True when the process runs as root (the namespace and cgroup helpers need it).
pub fn is_root() -> bool {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A port held the way kube-proxy's health server holds 10256 while kube-proxy still runs
/// next to ebpf-proxy: it answers 200 to `/healthz` and `/livez` and 404 to any other path
/// (Go's `ServeMux`). Serves from a thread until dropped, which closes the port.
pub struct KubeProxyHealth {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl KubeProxyHealth {
    /// Serves on `listener` (bound by the caller, e.g. inside a lab namespace with
    /// [`in_netns`]).
    pub fn serve(listener: std::net::TcpListener) -> io::Result<Self> {
        use std::io::Write;
        use std::sync::atomic::Ordering;
        listener.set_nonblocking(true)?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = stop.clone();
        let thread = thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut c, _)) => {
                        let _ = c.set_nonblocking(false);
                        let _ = c.set_read_timeout(Some(Duration::from_secs(1)));
                        let mut buf = [0u8; 1024];
                        let n = c.read(&mut buf).unwrap_or(0);
                        let req = String::from_utf8_lossy(&buf[..n]);
                        let path = req.split_whitespace().nth(1).unwrap_or("");
                        let answer = if path == "/healthz" || path == "/livez" {
                            "HTTP/1.0 200 OK\r\n\r\n{\"healthy\":true}"
                        } else {
                            "HTTP/1.0 404 Not Found\r\n\r\n404 page not found\n"
                        };
                        let _ = c.write_all(answer.as_bytes());
                    }
                    Err(_) => thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Ok(KubeProxyHealth {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for KubeProxyHealth {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The status code of `GET path` on `addr` from the network namespace `netns` (`None`: no
/// answer within `timeout`), as a kubelet's HTTP probe asks.
pub fn http_get_code(
    netns: Option<&Path>,
    addr: std::net::SocketAddr,
    path: &str,
    timeout: Duration,
) -> Option<u16> {
    let path = path.to_string();
    let get = move || -> Option<u16> {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect_timeout(&addr, timeout).ok()?;
        s.set_read_timeout(Some(timeout)).ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .ok()?;
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text.split_whitespace().nth(1)?.parse().ok()
    };
    match netns {
        Some(ns) => in_netns(ns, get).ok().flatten(),
        None => get(),
    }
}
