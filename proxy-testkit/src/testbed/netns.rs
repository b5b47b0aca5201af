//! [`Netns`]: a named network namespace, deleted on drop, and what is done inside it
//! (interfaces, bridges, `ip` commands, processes, XDP, ethtool, sysctls).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::process::{ChildGuard, in_netns, output_in, run_checked};
use super::{IP_TIMEOUT, NETNS_RUN_DIR};

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
