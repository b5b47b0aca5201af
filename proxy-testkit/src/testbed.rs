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

use std::ffi::CString;
use std::fs;
use std::io::{self, Read};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

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
// Processes
// ---------------------------------------------------------------------------------------

/// Prepares `cmd` so that the child joins `cgroup` (a cgroup v2 directory) and then the
/// network namespace at `netns` before it executes.
///
/// The cgroup is joined first so that every socket the program creates belongs to it. The
/// mount namespace is not changed (unlike `ip netns exec`, which remounts `/sys`), so the
/// child still sees the root `/sys/fs/cgroup` and `/sys/fs/bpf`.
pub fn configure_in(
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    cmd: &mut Command,
) -> io::Result<()> {
    let procs = cgroup
        .map(|c| CString::new(c.join("cgroup.procs").as_os_str().as_bytes()))
        .transpose()
        .map_err(io::Error::other)?;
    let ns = netns
        .map(|p| CString::new(p.as_os_str().as_bytes()))
        .transpose()
        .map_err(io::Error::other)?;
    // SAFETY: the closure runs in the forked child before exec and only calls
    // async-signal-safe functions (prctl, open, write, setns, close) on data prepared before
    // fork.
    unsafe {
        cmd.pre_exec(move || {
            // Die with the test or demo that started us, even when it is SIGKILLed, so no
            // server or agent outlives its run.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(procs) = &procs {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // "0" moves the writing process itself.
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if n < 0 {
                    return Err(err);
                }
            }
            if let Some(ns) = &ns {
                let fd = libc::open(ns.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let r = libc::setns(fd, libc::CLONE_NEWNET);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if r != 0 {
                    return Err(err);
                }
            }
            Ok(())
        });
    }
    Ok(())
}

/// Spawns `cmd` inside `cgroup` and the network namespace `netns` (see [`configure_in`]).
pub fn spawn_in(
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    cmd: &mut Command,
) -> io::Result<Child> {
    configure_in(netns, cgroup, cmd)?;
    cmd.spawn()
}

/// Runs `cmd` inside `cgroup` and `netns`, waits at most `timeout` and returns its output.
///
/// Standard input is `/dev/null` unless the caller set it. On timeout the child is killed
/// and an error of kind [`io::ErrorKind::TimedOut`] carrying the output so far is returned.
/// A non-zero exit status is not an error: check `output.status`.
pub fn output_in(
    netns: Option<&Path>,
    cgroup: Option<&Path>,
    cmd: &mut Command,
    timeout: Duration,
) -> io::Result<Output> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // Command has no getter for stdin; a caller that wants input uses spawn_in.
    cmd.stdin(Stdio::null());
    let mut child = spawn_in(netns, cgroup, cmd)?;
    let out = child.stdout.take().map(read_all_thread);
    let err = child.stderr.take().map(read_all_thread);
    let mut guard = ChildGuard::new(child);
    let status = guard.wait_timeout(timeout)?;
    // The pipes close when the child exits (or was killed), unless it left grandchildren
    // holding them; those readers are then abandoned.
    let collect = |h: Option<thread::JoinHandle<Vec<u8>>>| -> Vec<u8> {
        h.and_then(|h| {
            let deadline = Instant::now() + Duration::from_secs(2);
            while !h.is_finished() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() { h.join().ok() } else { None }
        })
        .unwrap_or_default()
    };
    match status {
        Some(status) => Ok(Output {
            status,
            stdout: collect(out),
            stderr: collect(err),
        }),
        None => {
            guard.kill();
            let stdout = collect(out);
            let stderr = collect(err);
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{:?} did not finish within {timeout:?}; stdout: {:?}; stderr: {:?}",
                    cmd,
                    String::from_utf8_lossy(&stdout),
                    String::from_utf8_lossy(&stderr)
                ),
            ))
        }
    }
}

fn read_all_thread<R: Read + Send + 'static>(mut r: R) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
}

/// Runs `f` on a new thread that first joins the network namespace at `netns` (the
/// calling thread keeps its namespace). Sockets `f` creates belong to that namespace, but
/// not to a test cgroup: use [`spawn_in`] for traffic that must pass cgroup programs.
pub fn in_netns<T: Send>(netns: &Path, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    let file = fs::File::open(netns)?;
    thread::scope(|s| {
        s.spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: valid fd; affects only this thread, which ends after `f`.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(f())
        })
        .join()
        .map_err(|_| io::Error::other("thread in netns panicked"))?
    })
}

/// Runs a short command (bounded by `timeout`) and fails unless it exits 0; returns stdout.
pub fn run_checked(netns: Option<&Path>, cmd: &mut Command, timeout: Duration) -> Result<String> {
    let out = output_in(netns, None, cmd, timeout).with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A child process that is killed and reaped when the guard is dropped.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
}

impl ChildGuard {
    /// Takes ownership of `child`.
    pub fn new(child: Child) -> Self {
        Self { child: Some(child) }
    }

    /// Spawns `cmd` with [`spawn_in`] and guards it.
    pub fn spawn_in(
        netns: Option<&Path>,
        cgroup: Option<&Path>,
        cmd: &mut Command,
    ) -> io::Result<Self> {
        spawn_in(netns, cgroup, cmd).map(Self::new)
    }

    /// Process id of the child.
    pub fn id(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// The guarded child (e.g. to take its stdin/stdout).
    pub fn child_mut(&mut self) -> &mut Child {
        self.child
            .as_mut()
            .expect("ChildGuard holds a child until dropped")
    }

    /// Exit status if the child has exited, without blocking.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => c.try_wait(),
            None => Ok(None),
        }
    }

    /// Waits at most `timeout` for the child to exit; `None` if it is still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> io::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `SIGTERM`, waits at most `grace`, then kills. Returns the exit status.
    pub fn terminate(&mut self, grace: Duration) -> io::Result<ExitStatus> {
        if let Some(s) = self.try_wait()? {
            return Ok(s);
        }
        let pid = self.id() as libc::pid_t;
        if pid > 0 {
            // SAFETY: plain syscall on the pid of our own unreaped child.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        if let Some(s) = self.wait_timeout(grace)? {
            return Ok(s);
        }
        let c = self.child_mut();
        let _ = c.kill();
        c.wait()
    }

    /// Kills the child and reaps it (idempotent).
    pub fn kill(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Gives up the guard and returns the child without killing it.
    pub fn into_inner(mut self) -> Child {
        self.child
            .take()
            .expect("ChildGuard holds a child until dropped")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------------------------------
// Network namespaces
// ---------------------------------------------------------------------------------------

/// A named network namespace (`ip netns add NAME`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates the namespace `name` (deleting a leftover of the same name first) and brings
    /// its loopback interface up.
    pub fn create(name: &str) -> Result<Self> {
        if name.is_empty() || name.contains('/') {
            bail!("invalid netns name {name:?}");
        }
        if Path::new(NETNS_RUN_DIR).join(name).exists() {
            let _ = output_in(
                None,
                None,
                Command::new("ip").args(["netns", "del", name]),
                IP_TIMEOUT,
            );
        }
        run_checked(
            None,
            Command::new("ip").args(["netns", "add", name]),
            IP_TIMEOUT,
        )
        .with_context(|| format!("creating netns {name}"))?;
        let ns = Self {
            name: name.to_owned(),
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Name of the namespace.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Path of the namespace file, `/run/netns/NAME` (for `setns`, `nsenter --net=`).
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_RUN_DIR).join(&self.name)
    }

    /// Creates a veth pair inside this namespace: `port` here, enslaved to `bridge` and up,
    /// and its peer as `eth0` directly in `peer` (so no interface ever exists in the root
    /// namespace). The peer is left for the caller to address and bring up.
    pub fn add_bridge_port(&self, port: &str, bridge: &str, peer: &Netns) -> Result<()> {
        self.ip(&[
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            peer.name(),
        ])?;
        self.ip(&["link", "set", port, "master", bridge])?;
        self.ip(&["link", "set", port, "up"])?;
        Ok(())
    }

    /// Adds the bridge `name` (no forwarding delay) and sets it up: the "wire" between the
    /// labs' nodes and clients, or a node's pod bridge.
    pub fn add_bridge(&self, name: &str) -> Result<()> {
        self.ip(&["link", "add", name, "type", "bridge", "forward_delay", "0"])?;
        self.ip(&["link", "set", name, "up"])?;
        Ok(())
    }

    /// Connects `peer` to this namespace's bridge `bridge` through port `port` (see
    /// [`Netns::add_bridge_port`]) and gives the peer's `eth0` the addresses `addrs` (with
    /// their prefix, e.g. `198.18.100.1/24`), up.
    pub fn plug(&self, port: &str, bridge: &str, peer: &Netns, addrs: &[&str]) -> Result<()> {
        self.add_bridge_port(port, bridge, peer)?;
        for a in addrs {
            peer.ip(&["addr", "add", a, "dev", "eth0"])?;
        }
        peer.ip(&["link", "set", "eth0", "up"])?;
        Ok(())
    }

    /// Runs `ip -n NAME ARGS...` and returns its stdout; fails on a non-zero exit.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run_checked(
            None,
            Command::new("ip").arg("-n").arg(&self.name).args(args),
            IP_TIMEOUT,
        )
    }

    /// Runs `program ARGS...` inside the namespace (via `setns`, so `/sys` stays the root
    /// one) with a 10 s timeout and returns its output (whatever the exit status).
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<Output> {
        self.exec_timeout(program, args, IP_TIMEOUT)
    }

    /// Like [`Netns::exec`] with an explicit timeout.
    pub fn exec_timeout(&self, program: &str, args: &[&str], timeout: Duration) -> Result<Output> {
        let mut cmd = Command::new(program);
        cmd.args(args);
        output_in(Some(&self.path()), None, &mut cmd, timeout)
            .with_context(|| format!("running {program} {args:?} in netns {}", self.name))
    }

    /// Spawns `cmd` inside the namespace (and `cgroup`, if given), guarded.
    pub fn spawn(&self, cgroup: Option<&Path>, cmd: &mut Command) -> io::Result<ChildGuard> {
        ChildGuard::spawn_in(Some(&self.path()), cgroup, cmd)
    }

    /// Attaches a pass-through XDP program (`r0 = XDP_PASS; exit`, loaded here through
    /// `BPF_PROG_LOAD`) to interface `ifname` of the namespace in native mode, by an XDP
    /// link (`BPF_LINK_CREATE`); the link lasts while the returned descriptor is open (or
    /// the interface exists). A veth whose peer sends frames with `XDP_TX` gets them
    /// promptly only with an XDP program of its own: the transmit side schedules the
    /// receiver's NAPI only then (drivers/net/veth.c, `veth_xdp_flush`), and with GRO
    /// alone the frames wait in its ring until other traffic wakes it.
    pub fn attach_xdp_pass(&self, ifname: &str) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::{FromRawFd, OwnedFd};
        const BPF_PROG_LOAD: libc::c_long = 5;
        const BPF_LINK_CREATE: libc::c_long = 28;
        const BPF_PROG_TYPE_XDP: u32 = 6;
        const BPF_XDP: u32 = 37;
        const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;
        // mov64 r0, XDP_PASS (2); exit
        let insns: [u64; 2] = [0x0000_0002_0000_00b7, 0x95];
        let license = c"GPL";
        let name = ifname.to_string();
        let r = in_netns(&self.path(), move || -> io::Result<OwnedFd> {
            let ifindex = {
                let c = std::ffi::CString::new(name.as_str()).map_err(io::Error::other)?;
                // SAFETY: a NUL-terminated name.
                unsafe { libc::if_nametoindex(c.as_ptr()) }
            };
            if ifindex == 0 {
                return Err(io::Error::last_os_error());
            }
            // `union bpf_attr` as BPF_PROG_LOAD reads it: prog_type @0, insn_cnt @4,
            // insns @8, license @16, expected_attach_type @68; the rest zero.
            let mut attr = [0u8; 128];
            attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
            attr[4..8].copy_from_slice(&(insns.len() as u32).to_ne_bytes());
            attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
            attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
            attr[68..72].copy_from_slice(&BPF_XDP.to_ne_bytes());
            // SAFETY: the attribute buffer and what it points to outlive the call.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_bpf,
                    BPF_PROG_LOAD,
                    attr.as_ptr(),
                    attr.len() as u32,
                )
            };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a descriptor the kernel just gave us.
            let prog = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            // link_create: prog_fd @0, target_ifindex @4, attach_type @8, flags @12.
            let mut attr = [0u8; 64];
            use std::os::fd::AsRawFd;
            attr[0..4].copy_from_slice(&(prog.as_raw_fd() as u32).to_ne_bytes());
            attr[4..8].copy_from_slice(&ifindex.to_ne_bytes());
            attr[8..12].copy_from_slice(&BPF_XDP.to_ne_bytes());
            attr[12..16].copy_from_slice(&XDP_FLAGS_DRV_MODE.to_ne_bytes());
            // SAFETY: as above.
            let link = unsafe {
                libc::syscall(
                    libc::SYS_bpf,
                    BPF_LINK_CREATE,
                    attr.as_ptr(),
                    attr.len() as u32,
                )
            };
            if link < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: as above.
            Ok(unsafe { OwnedFd::from_raw_fd(link as i32) })
        })?;
        r.with_context(|| {
            format!(
                "pass-through XDP program on {ifname} in netns {}",
                self.name
            )
        })
    }

    /// Turns transmit checksum offload off for interface `ifname` of the namespace
    /// (`ETHTOOL_STXCSUM`, as `ethtool -K IF tx off`), so the frames it sends carry complete
    /// TCP and UDP checksums, as frames from a physical wire do. With offload on, a veth
    /// hands its peer packets whose L4 checksum holds only the pseudo-header sum
    /// (`CHECKSUM_PARTIAL`); an XDP program sees the bytes without that state, and a frame
    /// it sends on with `XDP_TX` or `XDP_REDIRECT` becomes a new packet whose checksum the
    /// receiver verifies, and drops.
    pub fn set_tx_checksum_off(&self, ifname: &str) -> Result<()> {
        const ETHTOOL_STXCSUM: u32 = 0x17;
        self.ethtool_set(ifname, ETHTOOL_STXCSUM, 0)
            .with_context(|| {
                format!(
                    "tx checksum offload off for {ifname} in netns {}",
                    self.name
                )
            })
    }

    /// One ethtool "set value" ioctl (`struct ethtool_value`: `cmd`, `data`) on `ifname`
    /// inside the namespace.
    fn ethtool_set(&self, ifname: &str, cmd: u32, data: u32) -> Result<()> {
        let name = ifname.to_string();
        let r = in_netns(&self.path(), move || -> io::Result<()> {
            #[repr(C)]
            struct EthtoolValue {
                cmd: u32,
                data: u32,
            }
            let mut v = EthtoolValue { cmd, data };
            // SAFETY: an ifreq we own, the name NUL-terminated within IFNAMSIZ, the data
            // pointer to `v` for the duration of the call; the socket is closed below.
            unsafe {
                let mut ifr: libc::ifreq = std::mem::zeroed();
                for (d, s) in ifr.ifr_name.iter_mut().zip(name.bytes().take(15)) {
                    *d = s as libc::c_char;
                }
                ifr.ifr_ifru.ifru_data = (&mut v as *mut EthtoolValue).cast();
                let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let r = libc::ioctl(fd, libc::SIOCETHTOOL, &mut ifr);
                let e = io::Error::last_os_error();
                libc::close(fd);
                if r != 0 {
                    return Err(e);
                }
            }
            Ok(())
        })?;
        Ok(r?)
    }

    /// Writes a sysctl (e.g. `net/ipv6/conf/default/accept_dad`) inside the namespace.
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let script = format!("echo {value} > /proc/sys/{key}");
        let out = self.exec("sh", &["-c", &script])?;
        if !out.status.success() {
            bail!(
                "sysctl {key}={value} in {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = output_in(
            None,
            None,
            Command::new("ip").args(["netns", "del", &self.name]),
            IP_TIMEOUT,
        );
    }
}

// ---------------------------------------------------------------------------------------
// Bridge lab
// ---------------------------------------------------------------------------------------

/// A small L2 network made only of namespaces: a "node" namespace `<prefix>-node` holding a
/// Linux bridge ([`LAB_BRIDGE`], gateway [`LAB_GATEWAY_V4`] / [`LAB_GATEWAY_V6`]) and one
/// namespace `<prefix>-<name>` per pod, connected to the bridge by a veth pair (pod side
/// `eth0`). Every namespace is deleted when the lab is dropped.
#[derive(Debug)]
pub struct Lab {
    // Declared before `node`: pods are deleted first.
    pods: Vec<Netns>,
    node: Netns,
    prefix: String,
    ipv6: bool,
    next_veth: u32,
}

/// A pod of a [`Lab`]: a handle to its namespace and addresses. The namespace belongs to
/// the lab and lives until the lab is dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// Pod name as given to [`Lab::add_pod`].
    pub name: String,
    /// Name of the pod's network namespace.
    pub netns: String,
    /// IPv4 address of `eth0`.
    pub ipv4: Ipv4Addr,
    /// IPv6 address of `eth0`, if the lab is dual-stack.
    pub ipv6: Option<Ipv6Addr>,
}

impl Pod {
    /// Path of the pod's namespace file.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_RUN_DIR).join(&self.netns)
    }

    /// Spawns `cmd` inside the pod's namespace (and `cgroup`, if given), guarded.
    pub fn spawn(&self, cgroup: Option<&Path>, cmd: &mut Command) -> io::Result<ChildGuard> {
        ChildGuard::spawn_in(Some(&self.path()), cgroup, cmd)
    }

    /// Runs `cmd` inside the pod's namespace (and `cgroup`) with a timeout; see [`output_in`].
    pub fn output(
        &self,
        cgroup: Option<&Path>,
        cmd: &mut Command,
        timeout: Duration,
    ) -> io::Result<Output> {
        output_in(Some(&self.path()), cgroup, cmd, timeout)
    }
}

impl Lab {
    /// Creates the node namespace `<prefix>-node` with its bridge. With `ipv6`, the bridge
    /// and every pod also get an IPv6 address (without duplicate address detection).
    pub fn new(prefix: &str, ipv6: bool) -> Result<Self> {
        let node = Netns::create(&format!("{prefix}-node"))?;
        if ipv6 {
            disable_dad(&node)?;
        }
        node.ip(&[
            "link",
            "add",
            LAB_BRIDGE,
            "type",
            "bridge",
            "forward_delay",
            "0",
        ])?;
        // A MAC of its own, as CNI's bridge plugin gives its bridge: otherwise the bridge
        // takes the lowest of its ports' MACs and changes it when that port goes (a pod
        // deleted), and the other pods' neighbour entries for the gateway go stale, their
        // traffic through the node stalling until they resolve it again.
        node.ip(&["link", "set", LAB_BRIDGE, "address", LAB_BRIDGE_MAC])?;
        node.ip(&[
            "addr",
            "add",
            &format!("{LAB_GATEWAY_V4}/{LAB_PREFIX_V4}"),
            "dev",
            LAB_BRIDGE,
        ])?;
        if ipv6 {
            node.ip(&[
                "addr",
                "add",
                &format!("{LAB_GATEWAY_V6}/{LAB_PREFIX_V6}"),
                "dev",
                LAB_BRIDGE,
                "nodad",
            ])?;
        }
        node.ip(&["link", "set", LAB_BRIDGE, "up"])?;
        Ok(Self {
            pods: Vec::new(),
            node,
            prefix: prefix.to_owned(),
            ipv6,
            next_veth: 0,
        })
    }

    /// The node namespace (holds the bridge and the node ends of the veth pairs).
    pub fn node(&self) -> &Netns {
        &self.node
    }

    /// Whether pods get IPv6 addresses.
    pub fn ipv6(&self) -> bool {
        self.ipv6
    }

    /// Adds a pod namespace `<prefix>-<name>` with `eth0` addressed `ipv4/24` (and
    /// `ipv6/64`), default routes via the bridge, and the peer veth enslaved to the bridge.
    /// `ipv4` must be in `198.18.0.0/24` (not .0, .1 or .255).
    pub fn add_pod(&mut self, name: &str, ipv4: Ipv4Addr, ipv6: Option<Ipv6Addr>) -> Result<Pod> {
        let o = ipv4.octets();
        let g = LAB_GATEWAY_V4.octets();
        if o[..3] != g[..3] || matches!(o[3], 0 | 1 | 255) {
            bail!("pod address {ipv4} is not a host address of {LAB_GATEWAY_V4}/{LAB_PREFIX_V4}");
        }
        if ipv6.is_some() && !self.ipv6 {
            bail!("pod {name} has an IPv6 address but the lab was created without IPv6");
        }
        let ns = Netns::create(&format!("{}-{name}", self.prefix))?;
        if self.ipv6 {
            disable_dad(&ns)?;
        }
        let veth = format!("veth{}", self.next_veth);
        self.next_veth += 1;
        self.node.add_bridge_port(&veth, LAB_BRIDGE, &ns)?;
        ns.ip(&[
            "addr",
            "add",
            &format!("{ipv4}/{LAB_PREFIX_V4}"),
            "dev",
            "eth0",
        ])?;
        if let Some(v6) = ipv6 {
            ns.ip(&[
                "addr",
                "add",
                &format!("{v6}/{LAB_PREFIX_V6}"),
                "dev",
                "eth0",
                "nodad",
            ])?;
        }
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&[
            "route",
            "add",
            "default",
            "via",
            &LAB_GATEWAY_V4.to_string(),
        ])?;
        if ipv6.is_some() {
            ns.ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &LAB_GATEWAY_V6.to_string(),
            ])?;
        }
        let pod = Pod {
            name: name.to_owned(),
            netns: ns.name().to_owned(),
            ipv4,
            ipv6,
        };
        self.pods.push(ns);
        Ok(pod)
    }

    /// Deletes pod `name`'s namespace (`ip netns del`), as when its sandbox goes away: once
    /// no process holds it any more, its `eth0` and with it the node end of the veth pair
    /// are gone. [`Lab::add_pod`] may then add a pod of the same name (a new namespace and
    /// a new veth). Returns whether the lab had such a pod.
    pub fn remove_pod(&mut self, name: &str) -> bool {
        let netns = format!("{}-{name}", self.prefix);
        let before = self.pods.len();
        // Dropping the `Netns` deletes it.
        self.pods.retain(|ns| ns.name() != netns);
        self.pods.len() != before
    }
}

fn disable_dad(ns: &Netns) -> Result<()> {
    ns.sysctl("net/ipv6/conf/all/accept_dad", "0")?;
    ns.sysctl("net/ipv6/conf/default/accept_dad", "0")
}

// ---------------------------------------------------------------------------------------
// Wire lab: nodes and clients on one L2 segment, pods routed behind the nodes
// ---------------------------------------------------------------------------------------

/// Name of the bridge of a [`Wire`] (inside its namespace).
pub const WIRE_BRIDGE: &str = "wire0";

/// An L2 segment between hosts (nodes and external clients) made only of namespaces: the
/// namespace `<prefix>-w` holding the bridge [`WIRE_BRIDGE`], and one namespace
/// `<prefix>-<name>` per host, plugged into it through a veth pair (wire side `p<i>`, host
/// side `eth0`). Each node routes its pods behind a bridge of its own ([`Wire::node`],
/// [`Wire::pod`]). The caller owns the host and pod namespaces and drops them before the
/// wire (declare them first).
#[derive(Debug)]
pub struct Wire {
    prefix: String,
    ns: Netns,
    next_port: u32,
}

impl Wire {
    /// Creates the wire's namespace `<prefix>-w` with its bridge up.
    pub fn new(prefix: &str) -> Result<Wire> {
        let ns = Netns::create(&format!("{prefix}-w"))?;
        ns.add_bridge(WIRE_BRIDGE)?;
        Ok(Wire {
            prefix: prefix.to_owned(),
            ns,
            next_port: 0,
        })
    }

    /// The wire's namespace (holds the bridge and the wire ends of the veth pairs).
    pub fn ns(&self) -> &Netns {
        &self.ns
    }

    /// A host namespace `<prefix>-<name>` plugged into the wire, its `eth0` addressed
    /// `addrs` (with their prefix, e.g. `198.18.100.1/24`) and up. Returns the namespace and
    /// the name of its port on the wire (`p0`, `p1`, ... in the order of the calls).
    pub fn host(&mut self, name: &str, addrs: &[&str]) -> Result<(Netns, String)> {
        let host = Netns::create(&format!("{}-{name}", self.prefix))?;
        let port = format!("p{}", self.next_port);
        self.next_port += 1;
        self.ns.plug(&port, WIRE_BRIDGE, &host, addrs)?;
        Ok((host, port))
    }

    /// [`Wire::host`] for a node that routes its pods: also a bridge `br0` addressed
    /// `gateway` (with its prefix, e.g. `198.18.1.1/24`; the pods' default gateway) and IPv4
    /// forwarding on.
    pub fn node(&mut self, name: &str, addrs: &[&str], gateway: &str) -> Result<(Netns, String)> {
        let (node, port) = self.host(name, addrs)?;
        node.add_bridge("br0")?;
        node.ip(&["addr", "add", gateway, "dev", "br0"])?;
        node.sysctl("net/ipv4/ip_forward", "1")?;
        Ok((node, port))
    }

    /// A pod namespace `<prefix>-<name>` behind `node`'s `br0` (see [`Wire::node`]) through
    /// the veth `v<name>` (node side): `eth0` addressed `addr` (with its prefix) and up, its
    /// default route via `gateway` (an address of the node's bridge).
    pub fn pod(&self, node: &Netns, name: &str, addr: &str, gateway: &str) -> Result<Netns> {
        let pod = Netns::create(&format!("{}-{name}", self.prefix))?;
        node.plug(&format!("v{name}"), "br0", &pod, &[addr])?;
        pod.ip(&["route", "add", "default", "via", gateway])?;
        Ok(pod)
    }
}

// ---------------------------------------------------------------------------------------
// cgroup v2
// ---------------------------------------------------------------------------------------

/// Finds the cgroup v2 mount point in `/proc/self/mounts`.
pub fn cgroup2_mount() -> Result<PathBuf> {
    proxy_userspace::mounts::cgroup2_root()
}

/// A child cgroup of the cgroup v2 root, removed on drop (its processes are moved to the
/// root cgroup first).
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
    root: PathBuf,
}

impl TestCgroup {
    /// Creates `<cgroup2 mount>/<name>`, removing a leftover of the same name first.
    pub fn create(name: &str) -> Result<Self> {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            bail!("invalid cgroup name {name:?}");
        }
        let root = cgroup2_mount()?;
        let path = root.join(name);
        if path.exists() {
            remove_cgroup(&path, &root)
                .with_context(|| format!("removing leftover cgroup {}", path.display()))?;
        }
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Self { path, root })
    }

    /// Path of the cgroup directory (for `--cgroup-path` and [`spawn_in`]).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Pids currently in the cgroup (not in its descendants).
    pub fn pids(&self) -> Vec<u32> {
        read_pids(&self.path)
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = remove_cgroup(&self.path, &self.root);
    }
}

fn read_pids(cg: &Path) -> Vec<u32> {
    fs::read_to_string(cg.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Removes a cgroup and its descendants, moving their processes to `root`. Bounded: about
/// one second of retries for processes that are still exiting.
fn remove_cgroup(cg: &Path, root: &Path) -> io::Result<()> {
    if let Ok(entries) = fs::read_dir(cg) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                let _ = remove_cgroup(&e.path(), root);
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        for pid in read_pids(cg) {
            // Fails for a zombie, which goes away when reaped; the retry loop covers it.
            let _ = fs::write(root.join("cgroup.procs"), pid.to_string());
        }
        match fs::remove_dir(cg) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The deploy manifests and the demo's examples must parse as the Kubernetes objects
    /// they claim to be.
    #[test]
    fn deploy_manifests_parse() {
        use k8s_openapi::api::{apps, core, discovery, rbac};
        use serde::Deserialize;
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        let mut files: Vec<PathBuf> = Vec::new();
        for dir in [root.join("kustomize/base"), root.join("examples")] {
            for e in fs::read_dir(&dir).unwrap().flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "yaml") {
                    files.push(p);
                }
            }
        }
        assert!(
            files.len() >= 3,
            "expected deploy/kustomize/base/*.yaml and deploy/examples/*.yaml"
        );
        let mut kinds = Vec::new();
        for f in files {
            let text = fs::read_to_string(&f).unwrap();
            for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                let v = serde_yaml_ng::Value::deserialize(doc).unwrap();
                if v.is_null() {
                    continue;
                }
                let kind = v["kind"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{}: no kind", f.display()))
                    .to_owned();
                let ok = match kind.as_str() {
                    "Service" => serde_yaml_ng::from_value::<core::v1::Service>(v).map(drop),
                    "EndpointSlice" => {
                        serde_yaml_ng::from_value::<discovery::v1::EndpointSlice>(v).map(drop)
                    }
                    "DaemonSet" => serde_yaml_ng::from_value::<apps::v1::DaemonSet>(v).map(drop),
                    "ConfigMap" => serde_yaml_ng::from_value::<core::v1::ConfigMap>(v).map(drop),
                    "ServiceAccount" => {
                        serde_yaml_ng::from_value::<core::v1::ServiceAccount>(v).map(drop)
                    }
                    "Namespace" => serde_yaml_ng::from_value::<core::v1::Namespace>(v).map(drop),
                    "ClusterRole" => {
                        serde_yaml_ng::from_value::<rbac::v1::ClusterRole>(v).map(drop)
                    }
                    "ClusterRoleBinding" => {
                        serde_yaml_ng::from_value::<rbac::v1::ClusterRoleBinding>(v).map(drop)
                    }
                    other => panic!("{}: unexpected kind {other}", f.display()),
                };
                ok.unwrap_or_else(|e| panic!("{}: {kind}: {e}", f.display()));
                kinds.push(kind);
            }
        }
        for k in [
            "Service",
            "EndpointSlice",
            "DaemonSet",
            "ClusterRole",
            "ClusterRoleBinding",
        ] {
            assert!(kinds.iter().any(|x| x == k), "no {k} in deploy/");
        }
    }

    #[test]
    fn finds_cgroup2_or_explains() {
        match cgroup2_mount() {
            Ok(p) => assert!(p.is_absolute()),
            Err(e) => assert!(e.to_string().contains("cgroup2")),
        }
    }

    /// Needs root (skipped otherwise); creates namespaces `epunit-*`.
    #[test]
    fn lab_pods_reach_each_other() {
        assert!(is_root(), "needs root: run `cargo xtask test` as root");
        let mut lab = Lab::new("epunit", true).unwrap();
        let a = lab
            .add_pod(
                "a",
                Ipv4Addr::new(198, 18, 0, 10),
                Some("fd00:198:18::10".parse().unwrap()),
            )
            .unwrap();
        let b = lab
            .add_pod(
                "b",
                Ipv4Addr::new(198, 18, 0, 11),
                Some("fd00:198:18::11".parse().unwrap()),
            )
            .unwrap();
        // A RST (connection refused) from b's closed port proves that b is reachable.
        for dst in [std::net::IpAddr::from(b.ipv4), b.ipv6.unwrap().into()] {
            let r = in_netns(&a.path(), move || {
                std::net::TcpStream::connect_timeout(&(dst, 9).into(), Duration::from_secs(2))
            })
            .unwrap();
            assert_eq!(
                r.unwrap_err().kind(),
                io::ErrorKind::ConnectionRefused,
                "{dst}"
            );
        }
        let path = a.path();
        drop(lab);
        assert!(!path.exists());
    }

    /// Needs root; creates namespaces `epwire-*`. A host on the wire reaches a pod routed
    /// behind a node.
    #[test]
    fn wire_hosts_reach_pods_behind_a_node() {
        assert!(is_root(), "needs root: run `cargo xtask test` as root");
        let mut wire = Wire::new("epwire").unwrap();
        let (node, _) = wire
            .node("n", &["198.18.100.1/24"], "198.18.1.1/24")
            .unwrap();
        let (client, port) = wire.host("c", &["198.18.100.100/24"]).unwrap();
        assert_eq!(port, "p1");
        client
            .ip(&["route", "add", "198.18.1.0/24", "via", "198.18.100.1"])
            .unwrap();
        let pod = wire
            .pod(&node, "p0", "198.18.1.10/24", "198.18.1.1")
            .unwrap();
        // A RST (connection refused) from the pod's closed port proves the route both ways.
        let dst: std::net::SocketAddr = "198.18.1.10:9".parse().unwrap();
        let r = in_netns(&client.path(), move || {
            std::net::TcpStream::connect_timeout(&dst, Duration::from_secs(2))
        })
        .unwrap();
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionRefused);
        let paths = [pod.path(), client.path(), node.path(), wire.ns().path()];
        drop((pod, client, node, wire));
        assert!(paths.iter().all(|p| !p.exists()));
    }

    /// Needs root (skipped otherwise); creates the cgroup `ebpf-proxy-unit`.
    #[test]
    fn cgroup_spawn_and_cleanup() {
        assert!(is_root(), "needs root: run `cargo xtask test` as root");
        let cg = TestCgroup::create("ebpf-proxy-unit").unwrap();
        let mut child =
            ChildGuard::spawn_in(None, Some(cg.path()), Command::new("sleep").arg("5")).unwrap();
        assert_eq!(cg.pids(), vec![child.id()]);
        let p = cg.path().to_owned();
        // Dropped while the process still runs: it is moved out, the cgroup removed.
        drop(cg);
        assert!(!p.exists());
        child.kill();
    }
}
