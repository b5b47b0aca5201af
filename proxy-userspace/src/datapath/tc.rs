//! The north-south data path's kernel side: the tcx programs `tc_ingress`/`tc_egress`
//! (`proxy-ebpf/src/tc.rs`) attached to interfaces through pinned links, the tc maps the
//! agent writes (`proxy_common::nat`), this network namespace's interfaces and routes, and
//! the collection of ended least-connections flows. What to attach where and what to write
//! is the reconciler's ([`crate::reconcile::node`]).
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
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, LpmTrie, MapData},
    programs::{
        LinkOrder, SchedClassifier, TcAttachType, TestRun, TestRunOptions, Xdp,
        links::{FdLink, PinnedLink},
        tc::TcAttachOptions,
    },
};
use ipnet::IpNet;
use proxy_common::{
    ALL_MAPS,
    nat::{
        CONNTRACK, CtEntry, CtKey, IFACE_ADDRS, IfaceAddr, LC_FLOWS, LOCAL_ENDPOINTS,
        SOURCE_RANGES, SourceRange, TC_CFG_CLUSTER_CIDR_V4, TC_CFG_CLUSTER_CIDR_V6,
        TC_CFG_MASQUERADE_ALL, TC_CONFIG, TC_MAPS, TcConfig, TcCounter, ct_closed, ct_timeout_ns,
    },
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
/// [`crate::config::AgentConfig`]).
#[derive(Debug, Clone)]
pub struct TcSettings {
    /// `--interfaces`: the external interfaces, when given.
    pub interfaces: Vec<String>,
    /// `--xdp`.
    pub xdp: XdpSetting,
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
            masquerade_all: false,
            conntrack_max_per_core: DEFAULT_CONNTRACK_MAX_PER_CORE,
            conntrack_min: DEFAULT_CONNTRACK_MIN,
            conntrack_tcp_timeout_established: crate::config::DEFAULT_CT_TCP_ESTABLISHED,
            conntrack_udp_timeout_stream: crate::config::DEFAULT_CT_UDP_STREAM,
        }
    }
}

/// Default of `--conntrack-max-per-core`: 0, not kube-proxy's 32768, because the table is
/// preallocated (a 64-core node would get 2M flows, about 670 MiB).
pub const DEFAULT_CONNTRACK_MAX_PER_CORE: u32 = 0;
/// Default of `--conntrack-min` (kube-proxy's): 131072 flows, about 42 MiB.
pub const DEFAULT_CONNTRACK_MIN: u32 = 131072;
/// Smallest conntrack table in flows: the kernel's LRU maps evict in per-CPU batches, and
/// much smaller tables lose flows that are in use.
pub const MIN_CONNTRACK_FLOWS: u32 = 1024;
/// Largest conntrack table in flows (about 5 GiB preallocated).
pub const MAX_CONNTRACK_FLOWS: u32 = 16 * 1024 * 1024;

impl TcSettings {
    /// Flows of the conntrack table: max(per-core x CPUs, min), kube-proxy's rule for
    /// `nf_conntrack_max` (pkg/proxy/conntrack: `getConntrackMax`), within
    /// [`MIN_CONNTRACK_FLOWS`]..=[`MAX_CONNTRACK_FLOWS`].
    pub fn conntrack_flows(&self) -> u32 {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        let per_core = self.conntrack_max_per_core as u64 * cpus;
        per_core
            .max(self.conntrack_min as u64)
            .clamp(MIN_CONNTRACK_FLOWS as u64, MAX_CONNTRACK_FLOWS as u64) as u32
    }
}

/// Name of the ingress program in the object.
pub const INGRESS_PROGRAM: &str = "tc_ingress";
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
    let prefix = format!("link_{INGRESS_PROGRAM}_");
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_prefix(&prefix).map(str::to_string))
        .collect()
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
            let known: Vec<String> = std::fs::read_dir("/sys/class/net")
                .map(|d| {
                    d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                        .collect()
                })
                .unwrap_or_default();
            bail!(
                "--interfaces: no interface {n:?} in this network namespace (there are: {})",
                known.join(", ")
            );
        }
    }
    Ok(())
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
    /// What was written to `TC_CONFIG` (timeouts for the collection of flows).
    config: TcConfig,
    ebpf: Option<Ebpf>,
    local: HashMap<MapData, [u8; 16], u32>,
    ranges: LpmTrie<MapData, SourceRange, u32>,
    addrs: HashMap<MapData, u32, IfaceAddr>,
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
            dir: dir.to_path_buf(),
            ebpf: None,
            local: open(dir, LOCAL_ENDPOINTS)?,
            ranges: open(dir, SOURCE_RANGES)?,
            addrs: open(dir, IFACE_ADDRS)?,
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
            let mut loader = EbpfLoader::new();
            for name in ALL_MAPS
                .iter()
                .chain(TC_MAPS.iter())
                .chain(proxy_common::monitor::MONITOR_MAPS.iter())
            {
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
        self.attach_tc(ifname)?;
        self.attach_xdp(ifname, external)
    }

    fn attach_tc(&mut self, ifname: &str) -> Result<()> {
        let dir = self.dir.clone();
        let ebpf = self.ebpf()?;
        for (prog, ty) in [
            (EGRESS_PROGRAM, TcAttachType::Egress),
            (INGRESS_PROGRAM, TcAttachType::Ingress),
        ] {
            let p: &mut SchedClassifier = ebpf
                .program_mut(prog)
                .context("program missing")?
                .try_into()?;
            let id = p
                .attach_with_options(ifname, ty, TcAttachOptions::TcxOrder(LinkOrder::default()))
                .with_context(|| format!("attach {prog} to {ifname} (tcx needs Linux >= 6.6)"))?;
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

    /// Attaches the XDP program to external interface `ifname` as `--xdp` says: native,
    /// else (best-effort) generic, else none. An XDP link of an earlier agent on the
    /// interface is removed first: an interface holds one XDP program, and the tcx programs
    /// (attached before this) serve it meanwhile. A pod-facing interface (`external` false)
    /// or `--xdp disabled` gets none (and loses an earlier agent's).
    pub fn attach_xdp(&mut self, ifname: &str, external: bool) -> Result<Option<XdpMode>> {
        self.detach_xdp(ifname)?;
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
            let pin = self.dir.join(xdp_link_name(mode, ifname));
            if let Ok(l) = PinnedLink::from_pin(&pin) {
                drop(l.unpin());
            }
            match fs::remove_file(&pin) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("remove {}", pin.display())),
            }
        }
        Ok(())
    }

    /// Detaches the programs from `ifname` (removes its pinned links).
    pub fn detach(&mut self, ifname: &str) -> Result<()> {
        self.detach_xdp(ifname)?;
        for prog in [INGRESS_PROGRAM, EGRESS_PROGRAM] {
            let pin = self.dir.join(link_name(prog, ifname));
            if let Ok(l) = PinnedLink::from_pin(&pin) {
                drop(l.unpin());
            }
            match fs::remove_file(&pin) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("remove {}", pin.display())),
            }
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
        Ok(s)
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

#[cfg(test)]
mod tests {
    use super::*;

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
