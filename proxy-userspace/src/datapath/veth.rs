//! Whether an interface is a veth, and what that means for XDP on it.
//!
//! A veth's native XDP program runs, but a frame it sends back out (`XDP_TX`) or redirects
//! into another veth is delivered promptly only when the peer has an XDP program of its
//! own: the sender schedules the receiver's NAPI only then (drivers/net/veth.c,
//! `veth_xdp_flush`); with GRO alone the frames wait in the peer's ring until other traffic
//! wakes it, and without either they are dropped. On kind nodes and every
//! container-based node the external interface is a veth whose peer lives in the host, so
//! `--xdp native` there would attach, then lose every frame the program forwards.

use std::io;

/// The driver name of `ifname` in this network namespace (`ETHTOOL_GDRVINFO`), e.g. `veth`,
/// `virtio_net`, `mlx5_core`.
///
/// Errors: no such interface, or the ioctl fails.
pub fn driver(ifname: &str) -> io::Result<String> {
    const ETHTOOL_GDRVINFO: u32 = 0x0000_0003;
    /// `struct ethtool_drvinfo` (include/uapi/linux/ethtool.h): cmd, then driver[32], ...
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        version: [u8; 32],
        fw_version: [u8; 32],
        bus_info: [u8; 32],
        erom_version: [u8; 32],
        reserved2: [u8; 12],
        n_priv_flags: u32,
        n_stats: u32,
        testinfo_len: u32,
        eedump_len: u32,
        regdump_len: u32,
    }
    if ifname.len() >= libc::IFNAMSIZ {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {ifname:?} is too long"),
        ));
    }
    // SAFETY: all-zero bytes are a valid DrvInfo and ifreq.
    let mut info: DrvInfo = unsafe { std::mem::zeroed() };
    info.cmd = ETHTOOL_GDRVINFO;
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(ifname.bytes()) {
        *d = s as libc::c_char;
    }
    req.ifr_ifru.ifru_data = (&mut info as *mut DrvInfo).cast();
    // SAFETY: a datagram socket used for one ioctl, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCETHTOOL with an ifreq whose data points at a live ethtool_drvinfo.
    let r = unsafe { libc::ioctl(fd, libc::SIOCETHTOOL, &mut req) };
    let err = io::Error::last_os_error();
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    if r < 0 {
        return Err(io::Error::new(err.kind(), format!("{ifname}: {err}")));
    }
    let end = info.driver.iter().position(|&b| b == 0).unwrap_or(32);
    Ok(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

/// `ifname` is a veth (false when its driver cannot be read).
pub fn is_veth(ifname: &str) -> bool {
    driver(ifname).is_ok_and(|d| d == "veth")
}

/// Why `--xdp native` refuses a veth, with both remedies.
pub fn native_refusal(ifname: &str) -> String {
    format!(
        "--xdp native: {ifname} is a veth: its native XDP runs, but frames the program sends back (XDP_TX) or redirects are dropped unless the veth's peer runs an XDP program, so NodePort, external and LB IP flows to other nodes would fail. Either use --xdp best-effort (veths stay on the tcx programs, other interfaces get XDP) or --xdp disabled; or attach an XDP program to the peer in native mode (any program that returns XDP_PASS, e.g. `ip link set dev PEER xdpdrv obj pass.o sec xdp` on the host that holds the peer) and pass --xdp-veth-peers-ready"
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_is_not_a_veth_and_a_missing_interface_is_an_error() {
        // lo has no ethtool driver info (EOPNOTSUPP) on most kernels; either way not veth.
        assert!(!super::is_veth("lo"));
        assert!(super::driver("no-such-if0").is_err());
        assert!(super::native_refusal("eth0").contains("--xdp best-effort"));
        assert!(super::native_refusal("eth0").contains("--xdp-veth-peers-ready"));
    }
}
