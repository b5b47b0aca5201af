//! This network namespace's interfaces (names, indexes, addresses) and routes.

use std::{
    collections::BTreeMap,
    ffi::CStr,
    fs,
    net::{IpAddr, Ipv6Addr},
};

use anyhow::{Context, Result, bail};

/// Interface names and their IPv4 and IPv6 addresses in this network namespace
/// (`getifaddrs`).
pub fn interface_addresses() -> Result<BTreeMap<String, Vec<IpAddr>>> {
    let mut out: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs(3) fills a list we free below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getifaddrs");
    }
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: nodes of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let entry = out.entry(name).or_default();
        if !ifa.ifa_addr.is_null() {
            // SAFETY: the family says which sockaddr it is.
            unsafe {
                match (*ifa.ifa_addr).sa_family as i32 {
                    libc::AF_INET => {
                        let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                        entry.push(IpAddr::from(u32::from_be(sa.sin_addr.s_addr).to_be_bytes()));
                    }
                    libc::AF_INET6 => {
                        let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                        entry.push(IpAddr::from(sa.sin6_addr.s6_addr));
                    }
                    _ => {}
                }
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: the list from getifaddrs.
    unsafe { libc::freeifaddrs(ifap) };
    Ok(out)
}

/// Checks `--interfaces` before anything is attached: every name must be an interface of
/// this network namespace (a typo would otherwise leave NodePorts unserved while the agent
/// reports healthy).
///
/// Errors: an empty name, or a name without an interface, with the interfaces there are.
pub fn check_interfaces(names: &[String]) -> Result<()> {
    for n in names {
        if n.is_empty() {
            bail!("--interfaces: an empty interface name");
        }
        if if_index(n).is_none() {
            let known = interface_names();
            bail!(
                "--interfaces: no interface {n:?} in this network namespace (there are: {})",
                known.join(", ")
            );
        }
    }
    Ok(())
}

/// The names of the interfaces of the calling thread's network namespace, sorted, from
/// if_nameindex(3) (netlink). /sys/class/net is not used: it shows the namespace sysfs
/// was mounted in, which differs from ours after `setns` or `nsenter --net`.
pub fn interface_names() -> Vec<String> {
    // SAFETY: if_nameindex(3) returns an array ended by a zero entry, or NULL on failure;
    // it is freed below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut p = list;
    // SAFETY: entries of the array up to the terminating one (index 0, name NULL).
    unsafe {
        while (*p).if_index != 0 && !(*p).if_name.is_null() {
            out.push(CStr::from_ptr((*p).if_name).to_string_lossy().into_owned());
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    out.sort();
    out
}

/// The index of interface `name` in this network namespace; `None` when there is none.
pub fn if_index(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: if_nametoindex(3) on a NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// The IPv4 routes of this network namespace from `/proc/net/route`: (device, network,
/// prefix length).
fn ipv4_routes() -> Vec<(String, u32, u8)> {
    let text = fs::read_to_string("/proc/net/route").unwrap_or_default();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Destination and Mask are hex of the address in memory (network) order.
            let dest = u32::from_str_radix(f.get(1)?, 16).ok()?;
            let mask = u32::from_str_radix(f.get(7)?, 16).ok()?;
            let net = u32::from_be_bytes(dest.to_ne_bytes());
            let len = mask.count_ones() as u8;
            Some((f[0].to_string(), net, len))
        })
        .collect()
}

/// The IPv6 routes of this network namespace from `/proc/net/ipv6_route`: (device,
/// network, prefix length). Each line is `DEST PLEN SRC SPLEN NEXTHOP METRIC REFCNT USE
/// FLAGS DEVICE`, addresses as 32 hex digits in network order.
fn ipv6_routes() -> Vec<(String, Ipv6Addr, u8)> {
    let text = fs::read_to_string("/proc/net/ipv6_route").unwrap_or_default();
    parse_ipv6_routes(&text)
}

pub(super) fn parse_ipv6_routes(text: &str) -> Vec<(String, Ipv6Addr, u8)> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let net = u128::from_str_radix(f.first()?, 16).ok()?;
            let len = u8::from_str_radix(f.get(1)?, 16).ok()?;
            Some((f.get(9)?.to_string(), Ipv6Addr::from(net), len))
        })
        .collect()
}

pub(super) fn mask_v6(a: Ipv6Addr, len: u8) -> u128 {
    let a = u128::from(a);
    if len == 0 {
        0
    } else {
        a & (u128::MAX << (128 - len.min(128) as u32))
    }
}

pub(super) fn mask_v4(a: u32, len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        a & (u32::MAX << (32 - len as u32))
    }
}

/// The device of the longest-prefix route to `ip` in this network namespace, default
/// routes excluded (`/proc/net/route`, `/proc/net/ipv6_route`).
pub fn route_device(ip: &IpAddr) -> Option<String> {
    match ip {
        IpAddr::V4(v4) => {
            let a = u32::from(*v4);
            ipv4_routes()
                .into_iter()
                .filter(|(_, net, len)| *len > 0 && mask_v4(a, *len) == mask_v4(*net, *len))
                .max_by_key(|(_, _, len)| *len)
                .map(|(dev, _, _)| dev)
        }
        IpAddr::V6(v6) => ipv6_routes()
            .into_iter()
            .filter(|(_, net, len)| *len > 0 && mask_v6(*v6, *len) == mask_v6(*net, *len))
            .max_by_key(|(_, _, len)| *len)
            .map(|(dev, _, _)| dev),
    }
}
