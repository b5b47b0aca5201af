//! The north-south data path's kernel side: the tcx programs `tc_ingress`/`tc_egress`
//! (`proxy-ebpf/src/tc.rs`) attached to interfaces through pinned links, the tc maps the
//! agent writes (`proxy_common::nat`), this network namespace's interfaces and routes, and
//! the collection of ended least-connections flows. What to attach where and what to write
//! is the reconciler's (`reconcile::node`).
//!
//! The XDP program `xdp_ingress` (`proxy-ebpf/src/xdp.rs`) goes in front of the tcx ingress
//! program of the external interfaces when `--xdp` asks for it ([`XdpSetting`]); the tcx
//! programs stay attached behind it and remain the complete path, so an interface without
//! XDP, or a moment without it (an agent restart replaces the XDP link), only costs speed.
//!
//! Links are pinned as `link_tc_ingress_<ifname>` and `link_tc_egress_<ifname>` in the pin
//! directory, the XDP link as `link_xdp_<mode>_<ifname>` (mode `native` or `generic`, so
//! `services` and the metrics read the mode from the pin's name), so they survive agent restarts and `ebpf-proxy cleanup` detaches them (it
//! removes every `link_*` pin). A restarted agent attaches its own links before it removes
//! the old pins; tcx runs both meanwhile, and the second program finds nothing to do on a
//! packet the first one translated.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::CStr,
    fs,
    net::{IpAddr, Ipv6Addr},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::{Array, HashMap, LpmTrie, MapData},
    programs::{
        LinkOrder, SchedClassifier, TcAttachType, TestRun, TestRunOptions, Xdp,
        links::{FdLink, PinnedLink},
        tc::TcAttachOptions,
    },
};
use ipnet::IpNet;
use proxy_common::nat::{
    CONNTRACK, CtEntry, CtKey, DSR, DsrKey, DsrTarget, IFACE_ADDRS, IfaceAddr, LC_FLOWS,
    LOCAL_ENDPOINTS, SOURCE_RANGES, SourceRange, TC_CFG_CLUSTER_CIDR_V4, TC_CFG_CLUSTER_CIDR_V6,
    TC_CFG_MASQUERADE_ALL, TC_CONFIG, TcConfig, TcCounter, ct_closed, ct_timeout_ns,
};

use crate::datapath::{NodeSnapshot, loader::OBJECT};

/// `--xdp`: whether the external interfaces get the XDP program in front of the tcx
/// programs (kube-proxy-replacement style, as Cilium's `loadBalancer.acceleration`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XdpSetting {
    /// Native (driver) XDP on every external interface; an interface whose driver has none
    /// is an error of the interfaces step (reported, retried; its tcx programs serve it).
    Native,
    /// Native XDP where the driver supports it, else generic (skb) XDP, else the tcx
    /// programs alone (logged).
    BestEffort,
    /// No XDP: the tcx programs alone.
    #[default]
    Disabled,
}

/// How XDP runs on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum XdpMode {
    /// In the driver, before an skb exists (`XDP_FLAGS_DRV_MODE`).
    Native,
    /// On the skb, in the generic receive path (`XDP_FLAGS_SKB_MODE`).
    Generic,
}

impl XdpMode {
    /// `native` or `generic`, as in the pins, logs, metrics and `services`.
    pub fn as_str(self) -> &'static str {
        match self {
            XdpMode::Native => "native",
            XdpMode::Generic => "generic",
        }
    }

    fn aya(self) -> aya::programs::xdp::XdpMode {
        match self {
            XdpMode::Native => aya::programs::xdp::XdpMode::Driver,
            XdpMode::Generic => aya::programs::xdp::XdpMode::Skb,
        }
    }
}

/// Settings of the north-south data path (flags `--interfaces`, `--xdp`, `--masquerade-all`
/// and `--conntrack-*`, merged with the configuration file by
/// `config::AgentConfig`).
#[derive(Debug, Clone)]
pub struct TcSettings {
    /// `--interfaces`: the external interfaces, when given.
    pub interfaces: Vec<String>,
    /// `--xdp`.
    pub xdp: XdpSetting,
    /// `--xdp-veth-peers-ready`: the peers of veth external interfaces run an XDP program,
    /// so native XDP on a veth delivers what it forwards.
    pub xdp_veth_peers_ready: bool,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--conntrack-max-per-core`.
    pub conntrack_max_per_core: u32,
    /// `--conntrack-min`.
    pub conntrack_min: u32,
    /// `--conntrack-tcp-timeout-established`.
    pub conntrack_tcp_timeout_established: std::time::Duration,
    /// `--conntrack-udp-timeout-stream`.
    pub conntrack_udp_timeout_stream: std::time::Duration,
}

impl Default for TcSettings {
    fn default() -> Self {
        TcSettings {
            interfaces: Vec::new(),
            xdp: XdpSetting::Disabled,
            xdp_veth_peers_ready: false,
            masquerade_all: false,
            conntrack_max_per_core: DEFAULT_CONNTRACK_MAX_PER_CORE,
            conntrack_min: DEFAULT_CONNTRACK_MIN,
            conntrack_tcp_timeout_established: DEFAULT_CT_TCP_ESTABLISHED,
            conntrack_udp_timeout_stream: DEFAULT_CT_UDP_STREAM,
        }
    }
}

/// Default of `--conntrack-max-per-core`: 0, not kube-proxy's 32768, because the table is
/// preallocated (a 64-core node would get 2M flows, about 640 MiB).
pub const DEFAULT_CONNTRACK_MAX_PER_CORE: u32 = 0;
/// Default of `--conntrack-min` (kube-proxy's): 131072 flows, about 40 MiB
/// ([`conntrack_prealloc_bytes`]).
pub const DEFAULT_CONNTRACK_MIN: u32 = 131072;
/// Smallest conntrack table in flows: the kernel's LRU maps evict in per-CPU batches, and
/// much smaller tables lose flows that are in use.
pub const MIN_CONNTRACK_FLOWS: u32 = 1024;
/// Largest conntrack table in flows (about 5 GiB preallocated).
pub const MAX_CONNTRACK_FLOWS: u32 = 16 * 1024 * 1024;
/// Default of `--conntrack-tcp-timeout-established` (kube-proxy's): the idle timeout of an
/// established TCP flow.
pub const DEFAULT_CT_TCP_ESTABLISHED: std::time::Duration =
    std::time::Duration::from_secs(24 * 3600);
/// Default of `--conntrack-udp-timeout-stream` (the kernel's
/// `nf_conntrack_udp_timeout_stream`): the idle timeout of a UDP flow that saw replies.
pub const DEFAULT_CT_UDP_STREAM: std::time::Duration = std::time::Duration::from_secs(120);

impl TcSettings {
    /// Flows of the conntrack table: max(per-core x CPUs, min), kube-proxy's rule for
    /// `nf_conntrack_max` (pkg/proxy/conntrack: `getConntrackMax`), within
    /// [`MIN_CONNTRACK_FLOWS`]..=[`MAX_CONNTRACK_FLOWS`].
    pub fn conntrack_flows(&self) -> u32 {
        self.conntrack_size().flows
    }

    /// The conntrack table's size on this node (CPUs from `available_parallelism`).
    pub fn conntrack_size(&self) -> ConntrackSize {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.conntrack_size_for(u32::try_from(cpus).unwrap_or(u32::MAX))
    }

    /// The conntrack table's size for `cpus` CPUs: see [`TcSettings::conntrack_flows`].
    pub fn conntrack_size_for(&self, cpus: u32) -> ConntrackSize {
        let per_core = self.conntrack_max_per_core as u64 * cpus as u64;
        let flows = per_core
            .max(self.conntrack_min as u64)
            .clamp(MIN_CONNTRACK_FLOWS as u64, MAX_CONNTRACK_FLOWS as u64)
            as u32;
        ConntrackSize {
            flows,
            cpus,
            max_per_core: self.conntrack_max_per_core,
            min: self.conntrack_min,
            from_per_core: per_core > self.conntrack_min as u64,
            bytes: conntrack_prealloc_bytes(flows),
        }
    }
}

/// Bytes the kernel adds to each element of a preallocated hash map: `struct htab_elem`
/// (kernel/bpf/hashtab.c: list node, LRU node, hash; 48 bytes on 64-bit kernels), before
/// the key and the value, each rounded up to 8 bytes.
pub const HTAB_ELEM_OVERHEAD: u64 = 48;
/// Bytes of one hash bucket (`struct bucket`: list head and lock); a map has
/// `roundup_pow_of_two(max_entries)` of them.
pub const HTAB_BUCKET_BYTES: u64 = 16;
/// Preallocation above which the agent and `check` warn about the conntrack table.
pub const CONNTRACK_WARN_BYTES: u64 = 256 << 20;
/// Share of the agent's cgroup `memory.max` above which they warn (BPF maps are charged
/// to the memory cgroup of the process that creates them): a quarter.
pub const CONNTRACK_WARN_MEMORY_SHARE: u64 = 4;

/// Bytes the kernel preallocates for a conntrack table of `flows` flows: `TC_CONNTRACK`
/// (an LRU hash: two entries per flow, each [`HTAB_ELEM_OVERHEAD`] + [`CtKey`] + [`CtEntry`],
/// and its buckets). `TC_LC_FLOWS` is not preallocated (`BPF_F_NO_PREALLOC`).
pub fn conntrack_prealloc_bytes(flows: u32) -> u64 {
    let round8 = |n: usize| (n as u64).div_ceil(8) * 8;
    let entries = (flows as u64 * 2).max(2);
    let elem = HTAB_ELEM_OVERHEAD + round8(size_of::<CtKey>()) + round8(size_of::<CtEntry>());
    entries * elem + entries.next_power_of_two() * HTAB_BUCKET_BYTES
}

/// The north-south conntrack table's size and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackSize {
    /// Flows it holds (twice as many map entries).
    pub flows: u32,
    /// CPUs counted.
    pub cpus: u32,
    /// `--conntrack-max-per-core` / `conntrack.maxPerCore`.
    pub max_per_core: u32,
    /// `--conntrack-min` / `conntrack.min`.
    pub min: u32,
    /// The size is per-core x CPUs (else the minimum decided).
    pub from_per_core: bool,
    /// Bytes preallocated ([`conntrack_prealloc_bytes`]).
    pub bytes: u64,
}

/// `bytes` in MiB, rounded to the nearest.
fn mib(bytes: u64) -> u64 {
    (bytes + (1 << 19)) >> 20
}

impl ConntrackSize {
    /// One line: flows, MiB preallocated, and the rule that gave the size.
    pub fn describe(&self) -> String {
        let origin = if self.from_per_core {
            format!(
                "conntrack.maxPerCore (--conntrack-max-per-core) {} x {} CPUs, above conntrack.min {}",
                self.max_per_core, self.cpus, self.min
            )
        } else if self.max_per_core == 0 {
            format!(
                "conntrack.min (--conntrack-min) {}; conntrack.maxPerCore is 0",
                self.min
            )
        } else {
            format!(
                "conntrack.min (--conntrack-min) {}, above conntrack.maxPerCore {} x {} CPUs",
                self.min, self.max_per_core, self.cpus
            )
        };
        let clamp = if self.flows as u64
            != (self.max_per_core as u64 * self.cpus as u64).max(self.min as u64)
        {
            format!(" (limited to {MIN_CONNTRACK_FLOWS}..{MAX_CONNTRACK_FLOWS} flows)")
        } else {
            String::new()
        };
        format!(
            "north-south conntrack table: {} flows, {} MiB preallocated, from {origin}{clamp}",
            self.flows,
            mib(self.bytes)
        )
    }

    /// Why the preallocation is large: above [`CONNTRACK_WARN_BYTES`], or
    /// above a [`CONNTRACK_WARN_MEMORY_SHARE`]th of `memory_max` (the agent's cgroup
    /// `memory.max` in bytes, when it has one); `None` otherwise.
    pub fn excess(&self, memory_max: Option<u64>) -> Option<String> {
        let share = memory_max.filter(|m| self.bytes > m / CONNTRACK_WARN_MEMORY_SHARE);
        if self.bytes <= CONNTRACK_WARN_BYTES && share.is_none() {
            return None;
        }
        let why = match share {
            Some(m) => format!(
                "more than a quarter of this container's memory limit (memory.max {} MiB), to which BPF maps are charged",
                mib(m)
            ),
            None => format!("more than {} MiB", mib(CONNTRACK_WARN_BYTES)),
        };
        Some(format!(
            "{why}; unlike the kernel's conntrack limit that kube-proxy sets from the same settings, this memory is taken at start whatever the traffic"
        ))
    }

    /// What to do about a large table.
    pub fn remedy() -> String {
        format!(
            "set conntrack.maxPerCore: 0 (--conntrack-max-per-core=0) and size the table with conntrack.min (--conntrack-min), e.g. {DEFAULT_CONNTRACK_MIN} flows = {} MiB",
            mib(conntrack_prealloc_bytes(DEFAULT_CONNTRACK_MIN))
        )
    }
}

/// `memory.max` of this process's cgroup v2 in bytes (`/proc/self/cgroup`, under the
/// cgroup2 mount); `None` when unlimited (`max`) or not readable.
pub fn own_cgroup_memory_max() -> Option<u64> {
    let root = crate::mounts::cgroup2_root().ok()?;
    let own = fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let path = root.join(rel.trim().trim_start_matches('/'));
    parse_memory_max(&fs::read_to_string(path.join("memory.max")).ok()?)
}

/// A cgroup v2 `memory.max` file's content: bytes, or `None` for `max`.
pub fn parse_memory_max(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// Name of the ingress program in the object.
pub const INGRESS_PROGRAM: &str = "tc_ingress";
/// The program `tc_ingress` tail-calls to reject a packet to a frontend without endpoints.
pub const REJECT_PROGRAM: &str = "tc_reject";

/// Loads the programs `tc_ingress` and `pod_ingress` tail-call (`tc_reject`) and writes
/// them into the tail-call table `TC_TAILS` of the same load, `ebpf` (the table is not
/// pinned: each load has its own). Without it they drop what they would reject (counted as
/// `tc_dropped_no_endpoints`).
pub fn install_tail_calls(ebpf: &mut Ebpf) -> Result<()> {
    let p: &mut SchedClassifier = ebpf
        .program_mut(REJECT_PROGRAM)
        .with_context(|| format!("program {REJECT_PROGRAM} missing from the object"))?
        .try_into()?;
    p.load()
        .map_err(|e| anyhow::anyhow!("verify: program {REJECT_PROGRAM} was rejected: {e:#}"))?;
    let fd = p.fd()?.try_clone().context("duplicate the tc_reject fd")?;
    let map = ebpf
        .map_mut(proxy_common::nat::TAILS)
        .context("map TC_TAILS missing from the object")?;
    let mut tails = aya::maps::ProgramArray::try_from(map)?;
    tails
        .set(proxy_common::nat::TAIL_REJECT, &fd, 0)
        .context("write TC_TAILS")?;
    Ok(())
}
/// Name of the egress program in the object.
pub const EGRESS_PROGRAM: &str = "tc_egress";
/// Name of the XDP program in the object.
pub const XDP_PROGRAM: &str = "xdp_ingress";
/// Name of the least-connections collection program in the object (never attached; run by
/// [`TcPath::collect_lc_flows`] through `BPF_PROG_TEST_RUN`).
pub const LC_GC_PROGRAM: &str = "tc_lc_gc";

/// How often the agent looks for timed-out or evicted least-connections flows: half the
/// shortest conntrack timeout (unreplied UDP), within 1..=10 s.
pub fn lc_collect_interval(udp_timeout: std::time::Duration) -> std::time::Duration {
    (udp_timeout / 2).clamp(
        std::time::Duration::from_secs(1),
        std::time::Duration::from_secs(10),
    )
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns`, so of the conntrack
/// entries' `last_seen_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) into a timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn link_name(prog: &str, ifname: &str) -> String {
    format!("link_{prog}_{ifname}")
}

fn xdp_link_name(mode: XdpMode, ifname: &str) -> String {
    format!("link_xdp_{}_{ifname}", mode.as_str())
}

/// The interfaces with a pinned tcx ingress link under the pin directory `dir` (those with
/// the north-south programs).
pub fn tc_interfaces(dir: &Path) -> BTreeSet<String> {
    linked_interfaces(dir, INGRESS_PROGRAM)
}

/// The interfaces with a pinned link of program `prog` under the pin directory `dir`
/// (pins named `link_<prog>_<interface>`).
pub fn linked_interfaces(dir: &Path, prog: &str) -> BTreeSet<String> {
    let prefix = format!("link_{prog}_");
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_prefix(&prefix).map(str::to_string))
        .collect()
}

/// Detaches and removes the pinned link at `pin`, if any (a missing pin is no error).
fn remove_link_pin(pin: &Path) -> Result<()> {
    if let Ok(l) = PinnedLink::from_pin(pin) {
        drop(l.unpin());
    }
    match fs::remove_file(pin) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("remove {}", pin.display())),
    }
}

/// The interfaces with a pinned XDP link under the pin directory `dir`, with the mode each
/// runs in (from the pins' names).
pub fn xdp_modes(dir: &Path) -> BTreeMap<String, XdpMode> {
    let mut out = BTreeMap::new();
    for name in fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
    {
        for mode in [XdpMode::Native, XdpMode::Generic] {
            if let Some(ifname) = name.strip_prefix(&xdp_link_name(mode, "")) {
                out.insert(ifname.to_string(), mode);
            }
        }
    }
    out
}

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

/// The hint added to a failed tcx attach, from the errno of the link creation: the kernel
/// refuses an unknown attach type (no tcx before Linux 6.6) with EINVAL, or EOPNOTSUPP /
/// ENOTSUPP (524, the kernel-internal code some paths leak); EEXIST means the program is
/// already attached to that hook (tcx holds a program once per hook, whatever link put it
/// there), so "tcx missing" would mislead.
pub(crate) fn tcx_attach_hint(e: &aya::programs::ProgramError) -> Option<&'static str> {
    const ENOTSUPP: i32 = 524;
    let aya::programs::ProgramError::SyscallError(s) = e else {
        return None;
    };
    match s.io_error.raw_os_error()? {
        libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP => Some("tcx needs Linux >= 6.6"),
        libc::EEXIST => Some("another link already attaches this program to that hook"),
        _ => None,
    }
}

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

fn parse_ipv6_routes(text: &str) -> Vec<(String, Ipv6Addr, u8)> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let net = u128::from_str_radix(f.first()?, 16).ok()?;
            let len = u8::from_str_radix(f.get(1)?, 16).ok()?;
            Some((f.get(9)?.to_string(), Ipv6Addr::from(net), len))
        })
        .collect()
}

fn mask_v6(a: Ipv6Addr, len: u8) -> u128 {
    let a = u128::from(a);
    if len == 0 {
        0
    } else {
        a & (u128::MAX << (128 - len.min(128) as u32))
    }
}

fn mask_v4(a: u32, len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        a & (u32::MAX << (32 - len as u32))
    }
}

/// The flags and cluster CIDRs of the tc configuration ([`TC_CONFIG`]) for these flags
/// (the timeouts are left 0: the defaults).
pub fn tc_config(args: &TcSettings, cluster_cidrs: &[IpNet]) -> TcConfig {
    let mut config = TcConfig::default();
    if args.masquerade_all {
        config.flags |= TC_CFG_MASQUERADE_ALL;
    }
    if let Some(IpNet::V4(c)) = cluster_cidrs.iter().find(|c| c.addr().is_ipv4()) {
        config.flags |= TC_CFG_CLUSTER_CIDR_V4;
        config.cluster_cidr_v4 = c.network().octets();
        config.cluster_cidr_v4_len = c.prefix_len();
    }
    if let Some(IpNet::V6(c)) = cluster_cidrs.iter().find(|c| c.addr().is_ipv6()) {
        config.flags |= TC_CFG_CLUSTER_CIDR_V6;
        config.cluster_cidr_v6 = c.network().octets();
        config.cluster_cidr_v6_len = c.prefix_len();
    }
    config
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

/// The tc programs of one pin directory (loaded on first use) and the tc maps the agent
/// writes.
pub struct TcKernel {
    dir: PathBuf,
    /// `--xdp`.
    xdp: XdpSetting,
    /// `--xdp-veth-peers-ready`.
    veth_peers_ready: bool,
    /// What was written to `TC_CONFIG` (timeouts for the collection of flows).
    config: TcConfig,
    ebpf: Option<Ebpf>,
    /// Interfaces whose tcx programs this load attached (a second attach of the same
    /// program to a hook fails with EEXIST: a retry after an XDP failure attaches XDP only).
    tc_attached: BTreeSet<String>,
    local: HashMap<MapData, [u8; 16], u32>,
    ranges: LpmTrie<MapData, SourceRange, u32>,
    addrs: HashMap<MapData, u32, IfaceAddr>,
    dsr: HashMap<MapData, DsrKey, DsrTarget>,
}

impl TcKernel {
    /// Opens the tc maps of the pin directory `dir` (loaded by `loader::load_and_attach`,
    /// which pins them) and writes the configuration. Nothing is attached.
    ///
    /// `cluster_cidrs` is `--cluster-cidr` (kube-proxy's meaning): its first prefix of each
    /// family is used for the clients of that family. `udp_timeout` (`--udp-flow-timeout`)
    /// is the idle timeout of unreplied UDP flows.
    pub fn new(
        dir: &Path,
        args: &TcSettings,
        cluster_cidrs: &[IpNet],
        udp_timeout: std::time::Duration,
    ) -> Result<Self> {
        let ns = |d: std::time::Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        let config = TcConfig {
            tcp_established_ns: ns(args.conntrack_tcp_timeout_established),
            udp_ns: ns(udp_timeout),
            udp_stream_ns: ns(args.conntrack_udp_timeout_stream),
            ..tc_config(args, cluster_cidrs)
        };
        let mut cfg: Array<MapData, TcConfig> = open(dir, TC_CONFIG)?;
        cfg.set(0, config, 0).context("write TC_CONFIG")?;
        Ok(Self {
            config,
            xdp: args.xdp,
            veth_peers_ready: args.xdp_veth_peers_ready,
            dir: dir.to_path_buf(),
            ebpf: None,
            tc_attached: BTreeSet::new(),
            local: open(dir, LOCAL_ENDPOINTS)?,
            ranges: open(dir, SOURCE_RANGES)?,
            addrs: open(dir, IFACE_ADDRS)?,
            dsr: open(dir, DSR)?,
        })
    }

    /// Some flows to local backends are source-NATed (`--masquerade-all`, or a cluster IP
    /// reached from outside `--cluster-cidr`): their SNAT stage and replies need the
    /// programs on the pod-facing interfaces too.
    pub fn snat_local(&self) -> bool {
        self.config.flags
            & (TC_CFG_MASQUERADE_ALL | TC_CFG_CLUSTER_CIDR_V4 | TC_CFG_CLUSTER_CIDR_V6)
            != 0
    }

    /// Loads the tc programs once (maps adopted from the pins).
    fn ebpf(&mut self) -> Result<&mut Ebpf> {
        if self.ebpf.is_none() {
            let mut loader = crate::datapath::loader::new_loader();
            for name in crate::datapath::loader::pinned_maps() {
                loader.map_pin_path(name, self.dir.join(name));
            }
            let mut ebpf = loader.load(OBJECT).context("load the tc programs")?;
            for prog in [INGRESS_PROGRAM, EGRESS_PROGRAM, LC_GC_PROGRAM] {
                let p: &mut SchedClassifier = ebpf
                    .program_mut(prog)
                    .with_context(|| format!("program {prog} missing from the object"))?
                    .try_into()?;
                p.load()
                    .map_err(|e| anyhow::anyhow!("verify: program {prog} was rejected: {e:#}"))?;
            }
            // Only when asked for: a kernel that rejects it still runs the tcx path.
            if self.xdp != XdpSetting::Disabled {
                let p: &mut Xdp = ebpf
                    .program_mut(XDP_PROGRAM)
                    .with_context(|| format!("program {XDP_PROGRAM} missing from the object"))?
                    .try_into()?;
                p.load().map_err(|e| {
                    anyhow::anyhow!("verify: program {XDP_PROGRAM} was rejected: {e:#}")
                })?;
            }
            install_tail_calls(&mut ebpf)?;
            self.ebpf = Some(ebpf);
        }
        Ok(self.ebpf.as_mut().expect("loaded above"))
    }

    /// Gives back the least-connections counts of tc flows that ended without a FIN or RST
    /// seen by the data path: timed out (UDP, idle TCP) or evicted from the LRU conntrack.
    /// Every `TC_LC_FLOWS` key whose original-direction entry is missing, closed or idle
    /// beyond its timeout goes through `tc_lc_gc`, which checks again and releases the count
    /// atomically with the data path. Returns how many flows were released. Cheap when no
    /// least-connections Service has tc flows (the map is empty).
    pub fn collect_lc_flows(&mut self) -> Result<usize> {
        let flows: HashMap<MapData, CtKey, u32> = open(&self.dir, LC_FLOWS)?;
        let ct: HashMap<MapData, CtKey, CtEntry> = open(&self.dir, CONNTRACK)?;
        let now = monotonic_ns();
        let c = self.config;
        let dead: Vec<CtKey> = flows
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| match ct.get(k, 0) {
                Ok(e) => {
                    let timeout = ct_timeout_ns(
                        e.flags,
                        k.proto,
                        c.tcp_established_ns,
                        c.udp_ns,
                        c.udp_stream_ns,
                    );
                    ct_closed(e.flags) || now.saturating_sub(e.last_seen_ns) > timeout
                }
                Err(_) => true,
            })
            .collect();
        if dead.is_empty() {
            return Ok(0);
        }
        let ebpf = self.ebpf()?;
        let p: &mut SchedClassifier = ebpf
            .program_mut(LC_GC_PROGRAM)
            .with_context(|| format!("program {LC_GC_PROGRAM} missing from the object"))?
            .try_into()?;
        let mut released = 0;
        for k in dead {
            // 14 bytes standing for an Ethernet header (the kernel wants one), then the key.
            let mut data = [0u8; 14 + std::mem::size_of::<CtKey>()];
            // SAFETY: CtKey is plain old data (#[repr(C)], no padding holes left unset).
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    (&k as *const CtKey).cast::<u8>(),
                    std::mem::size_of::<CtKey>(),
                )
            };
            data[14..].copy_from_slice(bytes);
            let r = p
                .test_run(TestRunOptions {
                    data_in: Some(&data),
                    ..TestRunOptions::new()
                })
                .with_context(|| format!("run {LC_GC_PROGRAM}"))?;
            if r.return_value == 1 {
                released += 1;
            }
        }
        Ok(released)
    }

    /// Attaches the egress and ingress programs to `ifname` (replacing pinned links of an
    /// earlier agent only once the new ones are pinned). Egress first, so that no flow the
    /// ingress program translates has its replies leave untranslated. Then, for an
    /// `external` interface, the XDP program as `--xdp` says ([`TcKernel::attach_xdp`]).
    /// Returns the XDP mode the interface runs in (`None`: the tcx programs alone).
    ///
    /// Errors: a tcx attachment or pin failed; with `--xdp native`, the interface has no
    /// native XDP.
    pub fn attach(&mut self, ifname: &str, external: bool) -> Result<Option<XdpMode>> {
        if !self.tc_attached.contains(ifname) {
            self.attach_tc(ifname)?;
            self.tc_attached.insert(ifname.to_string());
        }
        self.attach_xdp(ifname, external)
    }

    fn attach_tc(&mut self, ifname: &str) -> Result<()> {
        let dir = self.dir.clone();
        let ebpf = self.ebpf()?;
        attach_pinned(
            ebpf,
            &dir,
            ifname,
            [
                (EGRESS_PROGRAM, TcAttachType::Egress),
                (INGRESS_PROGRAM, TcAttachType::Ingress),
            ],
        )
    }

    /// Attaches the XDP program to external interface `ifname` as `--xdp` says: native,
    /// else (best-effort) generic, else none. An XDP link of an earlier agent on the
    /// interface is removed first: an interface holds one XDP program, and the tcx programs
    /// (attached before this) serve it meanwhile. A pod-facing interface (`external` false)
    /// or `--xdp disabled` gets none (and loses an earlier agent's).
    ///
    /// A veth (kind and container-based nodes) gets no XDP unless `--xdp-veth-peers-ready`
    /// says its peer runs an XDP program: without one the frames the program forwards are
    /// lost ([`crate::datapath::veth`]). `--xdp native` refuses it with the remedies,
    /// `best-effort` leaves it to the tcx programs.
    pub fn attach_xdp(&mut self, ifname: &str, external: bool) -> Result<Option<XdpMode>> {
        self.detach_xdp(ifname)?;
        let unready_veth = external
            && self.xdp != XdpSetting::Disabled
            && !self.veth_peers_ready
            && crate::datapath::veth::is_veth(ifname);
        if unready_veth {
            if self.xdp == XdpSetting::Native {
                bail!("{}", crate::datapath::veth::native_refusal(ifname));
            }
            tracing::info!(interface = %ifname, "--xdp best-effort: a veth gets no XDP (frames it forwards need an XDP program on the peer; --xdp-veth-peers-ready when the peers have one): the tcx programs serve it");
            return Ok(None);
        }
        let modes: &[XdpMode] = match self.xdp {
            _ if !external => &[],
            XdpSetting::Disabled => &[],
            XdpSetting::Native => &[XdpMode::Native],
            XdpSetting::BestEffort => &[XdpMode::Native, XdpMode::Generic],
        };
        let setting = self.xdp;
        let dir = self.dir.clone();
        let mut errors = Vec::new();
        for &mode in modes {
            let ebpf = self.ebpf()?;
            let p: &mut Xdp = ebpf
                .program_mut(XDP_PROGRAM)
                .context("program missing")?
                .try_into()?;
            match p.attach(ifname, mode.aya()) {
                Ok(id) => {
                    let link: FdLink = p.take_link(id)?.try_into()?;
                    let pin = dir.join(xdp_link_name(mode, ifname));
                    link.pin(&pin)
                        .with_context(|| format!("pin {}", pin.display()))?;
                    return Ok(Some(mode));
                }
                Err(e) => errors.push(format!("{}: {e:#}", mode.as_str())),
            }
        }
        match setting {
            XdpSetting::Native => bail!(
                "--xdp native: {ifname}: cannot attach XDP in native mode (does its driver support XDP? `ebpf-proxy check` tells): {}",
                errors.join("; ")
            ),
            XdpSetting::BestEffort => {
                tracing::warn!(interface = %ifname, errors = %errors.join("; "), "--xdp best-effort: no XDP on this interface, the tcx programs serve it alone");
                Ok(None)
            }
            XdpSetting::Disabled => Ok(None),
        }
    }

    /// Removes the XDP link of `ifname` (any mode), if pinned.
    fn detach_xdp(&mut self, ifname: &str) -> Result<()> {
        for mode in [XdpMode::Native, XdpMode::Generic] {
            remove_link_pin(&self.dir.join(xdp_link_name(mode, ifname)))?;
        }
        Ok(())
    }

    /// Detaches the programs from `ifname` (removes its pinned links).
    pub fn detach(&mut self, ifname: &str) -> Result<()> {
        self.tc_attached.remove(ifname);
        self.detach_xdp(ifname)?;
        for prog in [INGRESS_PROGRAM, EGRESS_PROGRAM] {
            remove_link_pin(&self.dir.join(link_name(prog, ifname)))?;
        }
        Ok(())
    }

    /// Interfaces with a pinned ingress link in the pin directory.
    pub fn attached(&self) -> BTreeSet<String> {
        tc_interfaces(&self.dir)
    }

    /// Reads the tc maps the agent writes.
    pub fn snapshot(&self) -> Result<NodeSnapshot> {
        let mut s = NodeSnapshot::default();
        for k in self.local.keys() {
            s.local_endpoints
                .insert(k.context("iterate TC_LOCAL_ENDPOINTS")?);
        }
        for kv in self.ranges.iter() {
            let (k, v) = kv.context("iterate TC_SOURCE_RANGES")?;
            s.source_ranges.insert((k.prefix_len(), k.data()), v);
        }
        for kv in self.addrs.iter() {
            let (k, v) = kv.context("iterate TC_IFACE_ADDRS")?;
            s.iface_addrs.insert(k, v);
        }
        for kv in self.dsr.iter() {
            let (k, v) = kv.context("iterate TC_DSR")?;
            s.dsr.insert(k, v);
        }
        Ok(s)
    }

    /// `TC_DSR`.
    pub fn dsr(&mut self) -> &mut HashMap<MapData, DsrKey, DsrTarget> {
        &mut self.dsr
    }

    /// `TC_LOCAL_ENDPOINTS`.
    pub fn local_endpoints(&mut self) -> &mut HashMap<MapData, [u8; 16], u32> {
        &mut self.local
    }

    /// `TC_SOURCE_RANGES`.
    pub fn source_ranges(&mut self) -> &mut LpmTrie<MapData, SourceRange, u32> {
        &mut self.ranges
    }

    /// `TC_IFACE_ADDRS`.
    pub fn iface_addrs(&mut self) -> &mut HashMap<MapData, u32, IfaceAddr> {
        &mut self.addrs
    }
}

fn open<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    dir: &Path,
    name: &str,
) -> Result<T> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("open {}", path.display()))?;
    let map = aya::maps::Map::from_map_data(data)?;
    T::try_from(map).with_context(|| format!("open {name}"))
}

/// The `TC_SOURCE_RANGES` entries pinned under `dir`.
///
/// Errors: the map is not pinned there (no tc path) or cannot be read.
pub fn pinned_source_ranges(dir: &Path) -> Result<BTreeMap<crate::datapath::SourceRangeKey, u32>> {
    let m: LpmTrie<MapData, SourceRange, u32> = open(dir, SOURCE_RANGES)?;
    let mut out = BTreeMap::new();
    for kv in m.iter() {
        let (k, v) = kv.context("iterate TC_SOURCE_RANGES")?;
        out.insert((k.prefix_len(), k.data()), v);
    }
    Ok(out)
}

/// The client ranges `TC_SOURCE_RANGES` admits to load balancer IP `lb`: `None` when the
/// IP is not restricted (no marker), else the allowed prefixes (empty: nobody).
pub fn allowed_ranges(
    entries: &BTreeMap<crate::datapath::SourceRangeKey, u32>,
    lb: IpAddr,
) -> Option<Vec<IpNet>> {
    use proxy_common::nat::{SOURCE_RANGE_ALLOW, SOURCE_RANGE_RESTRICTED};
    let lb_addr = crate::datapath::addr::ip_to_bytes(lb);
    let restricted = entries
        .iter()
        .any(|((len, k), v)| *len == 128 && k.lb_addr == lb_addr && *v == SOURCE_RANGE_RESTRICTED);
    if !restricted {
        return None;
    }
    let ranges = entries
        .iter()
        .filter(|((len, k), v)| *len > 128 && k.lb_addr == lb_addr && **v == SOURCE_RANGE_ALLOW)
        .filter_map(|((len, k), _)| {
            let bits = (len - 128) as u8;
            let ip = Ipv6Addr::from(k.client);
            match ip.to_ipv4_mapped() {
                Some(v4) if bits >= 96 => IpNet::new(IpAddr::V4(v4), bits - 96).ok(),
                _ => IpNet::new(IpAddr::V6(ip), bits).ok(),
            }
        })
        .collect();
    Some(ranges)
}

/// Number of live entries of the conntrack map pinned under `dir` (both directions).
pub fn conntrack_entries(dir: &Path) -> Result<usize> {
    let m: HashMap<MapData, CtKey, CtEntry> = open(dir, CONNTRACK)?;
    Ok(m.keys().filter(|k| k.is_ok()).count())
}

/// Sums of the per-CPU tc counters pinned under `dir`, by name.
pub fn counters(dir: &Path) -> Result<BTreeMap<&'static str, u64>> {
    let values = super::maps::read_tc_counters(dir)?;
    Ok(TcCounter::ALL
        .iter()
        .map(|(c, name)| (*name, values.get(*c as usize).copied().unwrap_or(0)))
        .collect())
}

/// Attaches each `(program, direction)` of `ebpf` to `ifname` with tcx, in order, and pins
/// its link as `link_<program>_<ifname>` under `dir`, replacing the link an earlier agent
/// pinned there only once the new one is in place (so the interface is never left without
/// the program). Errors: attaching (with a hint from the errno: tcx needs Linux >= 6.6,
/// or the hook is taken) or pinning.
pub(crate) fn attach_pinned(
    ebpf: &mut Ebpf,
    dir: &Path,
    ifname: &str,
    progs: [(&str, TcAttachType); 2],
) -> Result<()> {
    for (prog, ty) in progs {
        let p: &mut SchedClassifier = ebpf
            .program_mut(prog)
            .context("program missing")?
            .try_into()?;
        let id = p
            .attach_with_options(ifname, ty, TcAttachOptions::TcxOrder(LinkOrder::default()))
            .map_err(|e| {
                let hint = tcx_attach_hint(&e).map(|h| format!(" ({h})"));
                anyhow::Error::new(e).context(format!(
                    "attach {prog} to {ifname}{}",
                    hint.unwrap_or_default()
                ))
            })?;
        let link: FdLink = p.take_link(id)?.try_into()?;
        let pin = dir.join(link_name(prog, ifname));
        let next = dir.join(format!("next_{prog}_{ifname}"));
        let _ = fs::remove_file(&next);
        link.pin(&next)
            .with_context(|| format!("pin {}", next.display()))?;
        if pin.exists() {
            match PinnedLink::from_pin(&pin) {
                Ok(old) => drop(old.unpin()),
                Err(_) => drop(fs::remove_file(&pin)),
            }
        }
        fs::rename(&next, &pin).with_context(|| format!("pin {}", pin.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_errors_list_this_namespace_and_attach_hints_follow_the_errno() {
        // Every network namespace has lo; the list comes from this process's namespace.
        let names = interface_names();
        assert!(names.iter().any(|n| n == "lo"), "{names:?}");
        let e = check_interfaces(&["lo".into(), "no-such-if0".into()]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("\"no-such-if0\""), "{msg}");
        let listed = msg.split("(there are: ").nth(1).expect(&msg);
        assert!(listed.split([',', ' ', ')']).any(|n| n == "lo"), "{msg}");
        let err = |errno: i32| {
            aya::programs::ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_mprog_attach",
                io_error: std::io::Error::from_raw_os_error(errno),
            })
        };
        for errno in [libc::EINVAL, libc::EOPNOTSUPP, 524] {
            assert_eq!(tcx_attach_hint(&err(errno)), Some("tcx needs Linux >= 6.6"));
        }
        let exists = tcx_attach_hint(&err(libc::EEXIST)).unwrap();
        assert!(
            !exists.contains("6.6") && exists.contains("already"),
            "{exists}"
        );
        assert_eq!(tcx_attach_hint(&err(libc::EPERM)), None);
        assert_eq!(
            tcx_attach_hint(&aya::programs::ProgramError::NotLoaded),
            None
        );
    }

    #[test]
    fn conntrack_size_says_its_memory_and_origin_and_warns_when_large() {
        // Per element: htab_elem + CtKey (40) + CtEntry (56), two entries per flow.
        assert_eq!(
            conntrack_prealloc_bytes(131072),
            262144 * (48 + 40 + 56) + 262144 * 16
        );
        let default = TcSettings::default().conntrack_size_for(64);
        assert_eq!(default.flows, DEFAULT_CONNTRACK_MIN);
        assert!(!default.from_per_core);
        assert_eq!(
            default.describe(),
            "north-south conntrack table: 131072 flows, 40 MiB preallocated, from conntrack.min (--conntrack-min) 131072; conntrack.maxPerCore is 0"
        );
        assert_eq!(default.excess(None), None);
        // kube-proxy's ConfigMap value on 64 cores.
        let migrated = TcSettings {
            conntrack_max_per_core: 32768,
            ..Default::default()
        }
        .conntrack_size_for(64);
        assert_eq!(migrated.flows, 32768 * 64);
        assert_eq!(
            migrated.describe(),
            "north-south conntrack table: 2097152 flows, 640 MiB preallocated, from conntrack.maxPerCore (--conntrack-max-per-core) 32768 x 64 CPUs, above conntrack.min 131072"
        );
        let w = crate::check::conntrack(&migrated, None);
        assert_eq!(w.status, crate::check::Status::Warn);
        assert!(
            w.detail.starts_with("2097152 flows, 640 MiB preallocated, from conntrack.maxPerCore (--conntrack-max-per-core) 32768 x 64 CPUs, above conntrack.min 131072: more than 256 MiB; "),
            "{}",
            w.detail
        );
        let remedy = w.remedy.unwrap();
        assert!(
            remedy.contains("conntrack.maxPerCore: 0 (--conntrack-max-per-core=0)"),
            "{remedy}"
        );
        assert!(remedy.contains("131072 flows = 40 MiB"), "{remedy}");
        assert_eq!(
            crate::check::conntrack(&default, None).status,
            crate::check::Status::Ok
        );
        // Small on few CPUs: the minimum decides, and it says so.
        let small = TcSettings {
            conntrack_max_per_core: 32768,
            ..Default::default()
        }
        .conntrack_size_for(2);
        assert_eq!(small.flows, 131072);
        assert!(small.describe().contains(
            "from conntrack.min (--conntrack-min) 131072, above conntrack.maxPerCore 32768 x 2 CPUs"
        ));
        // Within a memory limit: a quarter of memory.max is the bound.
        assert_eq!(small.excess(Some(1 << 30)), None);
        let w = small.excess(Some(128 << 20)).unwrap();
        assert!(w.contains("memory.max 128 MiB"), "{w}");
        // Clamped sizes say so.
        let huge = TcSettings {
            conntrack_max_per_core: MAX_CONNTRACK_FLOWS,
            ..Default::default()
        }
        .conntrack_size_for(4);
        assert_eq!(huge.flows, MAX_CONNTRACK_FLOWS);
        assert!(
            huge.describe()
                .ends_with("(limited to 1024..16777216 flows)"),
            "{}",
            huge.describe()
        );
        assert_eq!(parse_memory_max("max\n"), None);
        assert_eq!(parse_memory_max("536870912\n"), Some(512 << 20));
    }

    #[test]
    fn ipv6_routes_and_dual_stack_cluster_cidr() {
        let text = "fd000002000000000000000000000000 40 00000000000000000000000000000000 00 fd000100000000000000000000000002 00000400 00000001 00000000 00000003     eth0\n\
                    fe800000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001      br0\n";
        let r = parse_ipv6_routes(text);
        assert_eq!(
            r,
            vec![
                ("eth0".to_string(), "fd00:2::".parse().unwrap(), 64),
                ("br0".to_string(), "fe80::".parse().unwrap(), 64),
            ]
        );
        assert_eq!(
            mask_v6("fd00:2::10".parse().unwrap(), 64),
            mask_v6("fd00:2::".parse().unwrap(), 64)
        );
        assert_ne!(
            mask_v6("fd00:3::10".parse().unwrap(), 64),
            mask_v6("fd00:2::".parse().unwrap(), 64)
        );
        let cidrs: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap(), "fd00::/48".parse().unwrap()];
        let c = tc_config(&TcSettings::default(), &cidrs);
        assert_eq!(c.flags, TC_CFG_CLUSTER_CIDR_V4 | TC_CFG_CLUSTER_CIDR_V6);
        assert_eq!(
            (c.cluster_cidr_v4, c.cluster_cidr_v4_len),
            ([10, 0, 0, 0], 8)
        );
        assert_eq!(c.cluster_cidr_v6_len, 48);
        assert_eq!(&c.cluster_cidr_v6[..2], &[0xfd, 0]);
        let c = tc_config(&TcSettings::default(), &cidrs[1..]);
        assert_eq!(c.flags, TC_CFG_CLUSTER_CIDR_V6);
    }

    #[test]
    fn ipv4_masks() {
        assert_eq!(mask_v4(0xc612_0105, 24), 0xc612_0100);
        assert_eq!(mask_v4(0xc612_0105, 0), 0);
    }
}
