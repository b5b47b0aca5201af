//! The north-south data path seen from the agent (issue 4): attaching the tcx programs
//! `tc_ingress`/`tc_egress` (`proxy-ebpf/src/tc.rs`) to the node's external interfaces
//! through pinned links, and keeping the tc maps (`proxy_common::nat`) in line with the
//! objects: node-local endpoints, the SNAT address of each interface, the configuration,
//! and `spec.loadBalancerSourceRanges`. Health-check servers for `healthCheckNodePort` are
//! in [`crate::healthcheck`].
//!
//! Interfaces: `--interfaces` names them; by default they are the interfaces *of the
//! agent's network namespace* that carry one of this node's addresses (the `InternalIP`
//! and `ExternalIP` entries of its Node object). Selection follows every sync: a new
//! interface gets the programs, one no longer selected loses them.
//!
//! Links are pinned as `link_tc_ingress_<ifname>` and `link_tc_egress_<ifname>` in the pin
//! directory, so they survive agent restarts and `ebpf-proxy cleanup` detaches them (it
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
    maps::{Array, HashMap, LpmTrie, MapData, lpm_trie::Key},
    programs::{
        LinkOrder, SchedClassifier, TcAttachType, TestRun, TestRunOptions,
        links::{FdLink, PinnedLink},
        tc::TcAttachOptions,
    },
};
use ipnet::IpNet;
use proxy_common::{
    ALL_MAPS,
    nat::{
        CONNTRACK, CtEntry, CtKey, IFACE_ADDRS, IFACE_F_POD, IfaceAddr, LC_FLOWS, LOCAL_ENDPOINTS,
        SOURCE_RANGE_ALLOW, SOURCE_RANGE_RESTRICTED, SOURCE_RANGES, SourceRange,
        TC_CFG_CLUSTER_CIDR_V4, TC_CFG_CLUSTER_CIDR_V6, TC_CFG_MASQUERADE_ALL, TC_CONFIG, TC_MAPS,
        TcConfig, TcCounter, ct_closed, ct_timeout_ns,
    },
};
use tracing::{error, info};

use crate::{
    datapath::{addr::ip_to_bytes, loader::OBJECT},
    model::{DesiredState, NodeInfo, Scope},
    source::ObjectSet,
};

/// Command-line flags of the north-south data path (flattened into `ebpf-proxy run`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TcArgs {
    /// Interfaces that serve NodePorts, external IPs and LB IPs to traffic from outside the
    /// node, comma-separated [default: the interfaces of the agent's network namespace that
    /// carry one of this node's InternalIP/ExternalIP addresses from its Node object].
    #[arg(long, value_delimiter = ',')]
    pub interfaces: Vec<String>,
    /// Source-NAT every external flow of a Cluster-policy Service to the node address, also
    /// when the backend runs on this node (kube-proxy's --masquerade-all).
    #[arg(long)]
    pub masquerade_all: bool,
    /// Flows tracked per CPU by the north-south conntrack table (kube-proxy's
    /// --conntrack-max-per-core); the table holds max(this x CPUs, --conntrack-min) flows.
    /// The table is preallocated (about 320 bytes per flow), unlike the kernel's conntrack
    /// limit kube-proxy sets, so the default is 0: --conntrack-min alone, whatever the core
    /// count. Fixed when the pinned table is created.
    #[arg(long, default_value_t = DEFAULT_CONNTRACK_MAX_PER_CORE, value_parser = clap::value_parser!(u32).range(..=MAX_CONNTRACK_FLOWS as i64))]
    pub conntrack_max_per_core: u32,
    /// Least number of flows of the north-south conntrack table (kube-proxy's
    /// --conntrack-min), from 1024 (smaller LRU tables lose live flows to the kernel's batch
    /// eviction) to 16777216.
    #[arg(long, default_value_t = DEFAULT_CONNTRACK_MIN, value_parser = clap::value_parser!(u32).range(MIN_CONNTRACK_FLOWS as i64..=MAX_CONNTRACK_FLOWS as i64))]
    pub conntrack_min: u32,
    /// Idle timeout of an established TCP flow in the north-south conntrack (kube-proxy's
    /// --conntrack-tcp-timeout-established), e.g. 24h.
    #[arg(long, default_value = "24h", value_parser = positive_duration)]
    pub conntrack_tcp_timeout_established: std::time::Duration,
    /// Idle timeout of a UDP flow that saw replies in the north-south conntrack (kube-proxy's
    /// --conntrack-udp-timeout-stream, the kernel's nf_conntrack_udp_timeout_stream), e.g.
    /// 2m. Unreplied UDP flows use --udp-flow-timeout.
    #[arg(long, default_value = "2m", value_parser = positive_duration)]
    pub conntrack_udp_timeout_stream: std::time::Duration,
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

/// A duration flag that must be at least 1 ms (humantime syntax: 30s, 2m, 24h).
fn positive_duration(s: &str) -> std::result::Result<std::time::Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d < std::time::Duration::from_millis(1) {
        return Err(format!("{s:?} is too short (at least 1ms)"));
    }
    Ok(d)
}

impl TcArgs {
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

/// The north-south data path of one agent.
pub struct TcPath {
    dir: PathBuf,
    args: TcArgs,
    /// Some flows to local backends are source-NATed (`--masquerade-all`, or a cluster IP
    /// reached from outside `--cluster-cidr`): their SNAT stage and replies need the
    /// programs on the pod-facing interfaces too.
    snat_local: bool,
    /// What was written to `TC_CONFIG` (timeouts for the collection of flows).
    config: TcConfig,
    ebpf: Option<Ebpf>,
    attached: BTreeSet<String>,
    local: BTreeSet<[u8; 16]>,
    ranges: BTreeMap<(u32, SourceRange), u32>,
    logged: BTreeSet<String>,
    /// Health-check servers of `healthCheckNodePort`s.
    pub health: crate::healthcheck::HealthChecks,
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

fn if_index(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: if_nametoindex(3) on a NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// This node's `InternalIP`/`ExternalIP` addresses from its Node object.
pub fn node_ips(objects: &ObjectSet, node: &NodeInfo) -> BTreeSet<IpAddr> {
    objects
        .nodes
        .get(&node.name)
        .and_then(|n| n.object.status.as_ref())
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect()
}

/// Addresses of the endpoints whose `nodeName` is this node (any slice, any condition):
/// a backend among them is reached without leaving the node.
pub fn local_endpoints(objects: &ObjectSet, node: &NodeInfo) -> BTreeSet<IpAddr> {
    let mut out = BTreeSet::new();
    for s in objects.endpoint_slices.values() {
        for ep in &s.object.endpoints {
            if ep.node_name.as_deref() != Some(node.name.as_str()) {
                continue;
            }
            out.extend(ep.addresses.iter().filter_map(|a| a.parse::<IpAddr>().ok()));
        }
    }
    out
}

/// The source range entries for every Service with `spec.loadBalancerSourceRanges`: a
/// restriction marker per LB IP that is an ingress frontend, and one allowed prefix per
/// valid range of the LB IP's family. Invalid ranges are reported (naming the Service) and
/// ignored; a list with no valid range of the family allows everyone, as kube-proxy, which
/// filters the list before deciding whether the Service has a firewall.
pub fn source_ranges(
    objects: &ObjectSet,
    state: &DesiredState,
    errors: &mut Vec<String>,
) -> BTreeMap<(u32, SourceRange), u32> {
    let ingress: BTreeSet<IpAddr> = state
        .services
        .iter()
        .filter(|(k, _)| k.scope == Scope::Ingress)
        .flat_map(|(_, s)| s.frontends.iter().map(|f| f.ip()))
        .collect();
    let mut out = BTreeMap::new();
    for ((ns, name), svc) in &objects.services {
        let Some(spec) = svc.object.spec.as_ref() else {
            continue;
        };
        let Some(ranges) = spec.load_balancer_source_ranges.as_ref() else {
            continue;
        };
        if ranges.is_empty() {
            continue;
        }
        let mut cidrs = Vec::new();
        for r in ranges {
            match r.trim().parse::<IpNet>() {
                Ok(c) => cidrs.push(c),
                Err(_) => errors.push(format!(
                    "{}: Service {ns}/{name}: loadBalancerSourceRanges: {:?} is not a CIDR (ADDR/LEN); range ignored",
                    svc.origin,
                    r.trim()
                )),
            }
        }
        let lb_ips = svc
            .object
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|l| l.ingress.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|i| i.ip.as_deref())
            .filter_map(|ip| ip.parse::<IpAddr>().ok())
            .filter(|ip| ingress.contains(ip));
        for lb in lb_ips {
            let fam: Vec<&IpNet> = cidrs
                .iter()
                .filter(|c| c.addr().is_ipv4() == lb.is_ipv4())
                .collect();
            if fam.is_empty() {
                continue;
            }
            let lb_addr = ip_to_bytes(lb);
            out.insert(
                (
                    128,
                    SourceRange {
                        lb_addr,
                        client: [0; 16],
                    },
                ),
                SOURCE_RANGE_RESTRICTED,
            );
            for c in fam {
                let bits = if c.addr().is_ipv4() {
                    96 + c.prefix_len() as u32
                } else {
                    c.prefix_len() as u32
                };
                let mut client = ip_to_bytes(c.addr());
                mask(&mut client, bits);
                out.insert(
                    (128 + bits, SourceRange { lb_addr, client }),
                    SOURCE_RANGE_ALLOW,
                );
            }
        }
    }
    out
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

/// An IPv6 address that can be a SNAT source towards other nodes: not link-local
/// (fe80::/10, valid on one link only), loopback, unspecified, multicast or IPv4-mapped.
fn snat_v6(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V6(a) => {
            !(a.is_unicast_link_local()
                || a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || a.to_ipv4_mapped().is_some())
        }
        IpAddr::V4(_) => false,
    }
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

/// Clears the bits of `a` after the first `bits`.
fn mask(a: &mut [u8; 16], bits: u32) {
    for (i, b) in a.iter_mut().enumerate() {
        let start = i as u32 * 8;
        if start >= bits {
            *b = 0;
        } else if start + 8 > bits {
            *b &= 0xffu8 << (8 - (bits - start));
        }
    }
}

/// The flags and cluster CIDRs of the tc configuration ([`TC_CONFIG`]) for these flags
/// (the timeouts are left 0: the defaults).
pub fn tc_config(args: &TcArgs, cluster_cidrs: &[IpNet]) -> TcConfig {
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

impl TcPath {
    /// Prepares the tc data path of the pin directory `dir` (loaded by
    /// `loader::load_and_attach`, which pins the tc maps too) and writes its configuration.
    /// Nothing is attached until [`TcPath::sync`] knows the interfaces.
    ///
    /// `cluster_cidrs` is `--cluster-cidr` (kube-proxy's meaning): its first prefix of each
    /// family is used for the clients of that family. `udp_timeout` (`--udp-flow-timeout`)
    /// is the idle timeout of unreplied UDP flows.
    pub fn new(
        dir: &Path,
        args: TcArgs,
        cluster_cidrs: &[IpNet],
        udp_timeout: std::time::Duration,
    ) -> Result<Self> {
        let ns = |d: std::time::Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        let config = TcConfig {
            tcp_established_ns: ns(args.conntrack_tcp_timeout_established),
            udp_ns: ns(udp_timeout),
            udp_stream_ns: ns(args.conntrack_udp_timeout_stream),
            ..tc_config(&args, cluster_cidrs)
        };
        let snat_local = config.flags
            & (TC_CFG_MASQUERADE_ALL | TC_CFG_CLUSTER_CIDR_V4 | TC_CFG_CLUSTER_CIDR_V6)
            != 0;
        let mut cfg: Array<MapData, TcConfig> = open(dir, TC_CONFIG)?;
        cfg.set(0, config, 0).context("write TC_CONFIG")?;
        Ok(Self {
            config,
            dir: dir.to_path_buf(),
            args,
            snat_local,
            ebpf: None,
            attached: BTreeSet::new(),
            local: BTreeSet::new(),
            ranges: BTreeMap::new(),
            logged: BTreeSet::new(),
            health: crate::healthcheck::HealthChecks::default(),
        })
    }

    /// Follows one sync: interfaces, SNAT addresses, local endpoints, source ranges and
    /// health-check servers. Errors are logged (once while they last), never fatal: the
    /// ClusterIP data path must keep syncing.
    pub fn sync(&mut self, objects: &ObjectSet, node: &NodeInfo, state: &DesiredState) {
        let mut errors = Vec::new();
        if let Err(e) = self.sync_interfaces(objects, node) {
            errors.push(format!("tc: interfaces: {e:#}"));
        }
        if let Err(e) = self.sync_local(objects, node) {
            errors.push(format!("tc: {e:#}"));
        }
        let ranges = source_ranges(objects, state, &mut errors);
        if let Err(e) = self.sync_ranges(ranges) {
            errors.push(format!("tc: {e:#}"));
        }
        let want = crate::healthcheck::wanted_checked(objects, state, &mut errors);
        self.health.sync(want, &mut errors);
        let now: BTreeSet<String> = errors.into_iter().collect();
        for e in now.difference(&self.logged) {
            error!("{e}");
        }
        self.logged = now;
    }

    /// Retries the health-check ports of the last sync that could not be bound (called at
    /// the periodic resync, so a freed port is served without waiting for an object change).
    /// New errors are logged; the next sync logs the full set again as usual.
    pub fn retry_health(&mut self) {
        let mut errors = Vec::new();
        self.health.retry(&mut errors);
        for e in errors {
            if self.logged.insert(e.clone()) {
                error!("{e}");
            }
        }
    }

    fn selected(
        &self,
        objects: &ObjectSet,
        node: &NodeInfo,
    ) -> Result<BTreeMap<String, Vec<IpAddr>>> {
        let all = interface_addresses()?;
        if !self.args.interfaces.is_empty() {
            let mut out = BTreeMap::new();
            for i in &self.args.interfaces {
                match all.get(i) {
                    Some(a) => {
                        out.insert(i.clone(), a.clone());
                    }
                    None => bail!("--interfaces: no interface {i:?} in this network namespace"),
                }
            }
            return Ok(out);
        }
        let ips = node_ips(objects, node);
        Ok(all
            .into_iter()
            .filter(|(name, a)| name != "lo" && a.iter().any(|ip| ips.contains(ip)))
            .collect())
    }

    /// With `--masquerade-all` or `--cluster-cidr` (both source-NAT some flows to local
    /// backends), the pod-facing interfaces: those this netns routes this node's endpoints
    /// through (longest match in `/proc/net/route` or `/proc/net/ipv6_route`, default
    /// routes excluded), other than the external ones. Masqueraded flows to local backends
    /// get their SNAT stage and their replies there. Only when external interfaces were
    /// found, so an agent without node addresses in its netns attaches nothing at all.
    fn pod_interfaces(
        &self,
        objects: &ObjectSet,
        node: &NodeInfo,
        external: &BTreeMap<String, Vec<IpAddr>>,
    ) -> BTreeMap<String, Vec<IpAddr>> {
        let mut out = BTreeMap::new();
        if !self.snat_local || external.is_empty() {
            return out;
        }
        let routes = ipv4_routes();
        let routes6 = ipv6_routes();
        let all = interface_addresses().unwrap_or_default();
        for ip in local_endpoints(objects, node) {
            let best = match ip {
                IpAddr::V4(v4) => {
                    let a = u32::from(v4);
                    routes
                        .iter()
                        .filter(|(_, net, len)| *len > 0 && mask_v4(a, *len) == mask_v4(*net, *len))
                        .max_by_key(|(_, _, len)| *len)
                        .map(|(dev, _, _)| dev)
                }
                IpAddr::V6(v6) => routes6
                    .iter()
                    .filter(|(_, net, len)| *len > 0 && mask_v6(v6, *len) == mask_v6(*net, *len))
                    .max_by_key(|(_, _, len)| *len)
                    .map(|(dev, _, _)| dev),
            };
            if let Some(dev) = best
                && !external.contains_key(dev)
                && dev != "lo"
            {
                out.insert(dev.clone(), all.get(dev).cloned().unwrap_or_default());
            }
        }
        out
    }

    fn sync_interfaces(&mut self, objects: &ObjectSet, node: &NodeInfo) -> Result<()> {
        let mut wanted = self.selected(objects, node)?;
        let pods = self.pod_interfaces(objects, node, &wanted);
        wanted.extend(pods.iter().map(|(k, v)| (k.clone(), v.clone())));
        let ips = node_ips(objects, node);
        let mut addrs: HashMap<MapData, u32, IfaceAddr> = open(&self.dir, IFACE_ADDRS)?;
        for (name, a) in &wanted {
            let Some(ifindex) = if_index(name) else {
                continue;
            };
            // Per family: the node address on the interface, else its first address of the
            // family (for IPv6 one usable beyond the link: not link-local).
            let v4 = a
                .iter()
                .find(|ip| ip.is_ipv4() && ips.contains(ip))
                .or_else(|| a.iter().find(|ip| ip.is_ipv4()));
            let v6 = a
                .iter()
                .find(|ip| snat_v6(ip) && ips.contains(ip))
                .or_else(|| a.iter().find(|ip| snat_v6(ip)));
            let value = IfaceAddr {
                v4: v4.map(|ip| ip_to_bytes(*ip)).unwrap_or([0; 16]),
                v6: v6.map(|ip| ip_to_bytes(*ip)).unwrap_or([0; 16]),
                flags: if pods.contains_key(name) {
                    IFACE_F_POD
                } else {
                    0
                },
                _pad: 0,
            };
            if addrs.get(&ifindex, 0).ok() != Some(value) {
                addrs
                    .insert(ifindex, value, 0)
                    .context("write TC_IFACE_ADDRS")?;
            }
            if !self.attached.contains(name) {
                self.attach(name)?;
                info!(interface = %name, address = ?v4, address_v6 = ?v6, "north-south programs attached (tcx ingress and egress)");
                self.attached.insert(name.clone());
            }
        }
        let gone: Vec<String> = self
            .attached
            .iter()
            .filter(|n| !wanted.contains_key(*n))
            .cloned()
            .collect();
        for name in gone {
            for prog in [INGRESS_PROGRAM, EGRESS_PROGRAM] {
                let pin = self.dir.join(link_name(prog, &name));
                if let Ok(l) = PinnedLink::from_pin(&pin) {
                    drop(l.unpin());
                }
                let _ = fs::remove_file(&pin);
            }
            if let Some(i) = if_index(&name) {
                let _ = addrs.remove(&i);
            }
            info!(interface = %name, "north-south programs detached");
            self.attached.remove(&name);
        }
        Ok(())
    }

    /// Loads the tc programs once (maps adopted from the pins).
    fn ebpf(&mut self) -> Result<&mut Ebpf> {
        if self.ebpf.is_none() {
            let mut loader = EbpfLoader::new();
            for name in ALL_MAPS.iter().chain(TC_MAPS.iter()) {
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

    fn attach(&mut self, ifname: &str) -> Result<()> {
        let dir = self.dir.clone();
        let ebpf = self.ebpf()?;
        for (prog, ty) in [
            (INGRESS_PROGRAM, TcAttachType::Ingress),
            (EGRESS_PROGRAM, TcAttachType::Egress),
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

    fn sync_local(&mut self, objects: &ObjectSet, node: &NodeInfo) -> Result<()> {
        let want: BTreeSet<[u8; 16]> = local_endpoints(objects, node)
            .iter()
            .map(|ip| ip_to_bytes(*ip))
            .collect();
        if want == self.local {
            return Ok(());
        }
        let mut m: HashMap<MapData, [u8; 16], u32> = open(&self.dir, LOCAL_ENDPOINTS)?;
        for a in want.difference(&self.local) {
            m.insert(a, 1, 0).context("write TC_LOCAL_ENDPOINTS")?;
        }
        for a in self.local.difference(&want) {
            let _ = m.remove(a);
        }
        self.local = want;
        Ok(())
    }

    fn sync_ranges(&mut self, want: BTreeMap<(u32, SourceRange), u32>) -> Result<()> {
        if want == self.ranges {
            return Ok(());
        }
        let mut m: LpmTrie<MapData, SourceRange, u32> = open(&self.dir, SOURCE_RANGES)?;
        // Allowed ranges first, markers last; removals in the opposite order, so an edit
        // never denies a client that both the old and the new list allow.
        let mut adds: Vec<(&(u32, SourceRange), &u32)> = want
            .iter()
            .filter(|(k, v)| self.ranges.get(*k) != Some(*v))
            .collect();
        adds.sort_by_key(|(_, v)| **v);
        for ((len, data), v) in adds {
            m.insert(&Key::new(*len, *data), *v, 0)
                .context("write TC_SOURCE_RANGES")?;
        }
        let mut dels: Vec<(&(u32, SourceRange), &u32)> = self
            .ranges
            .iter()
            .filter(|(k, _)| !want.contains_key(*k))
            .collect();
        dels.sort_by_key(|(_, v)| std::cmp::Reverse(**v));
        for ((len, data), _) in dels {
            let _ = m.remove(&Key::new(*len, *data));
        }
        self.ranges = want;
        Ok(())
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
    use crate::model::{build, tests::objects};

    const LB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 31000\n  loadBalancerSourceRanges: ['192.0.2.0/24', ' 198.51.100.7/32', 'bogus', '2001:db8::/32']\n  ports: [{port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.9}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: lb-1, namespace: default, labels: {kubernetes.io/service-name: lb}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints:\n- {addresses: [10.0.1.5], nodeName: node-1}\n- {addresses: [10.0.2.5], nodeName: node-2}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 192.0.2.50}, {type: Hostname, address: n1}]}\n";

    fn node() -> NodeInfo {
        NodeInfo {
            name: "node-1".into(),
            ..Default::default()
        }
    }

    #[test]
    fn source_ranges_restrict_lb_ips_with_valid_ranges_of_their_family() {
        let objs = objects(LB);
        let (state, _) = build(&objs, &node());
        let mut errors = Vec::new();
        let r = source_ranges(&objs, &state, &mut errors);
        assert_eq!(
            errors,
            [
                "test.yaml: Service default/lb: loadBalancerSourceRanges: \"bogus\" is not a CIDR (ADDR/LEN); range ignored"
            ]
        );
        let lb = ip_to_bytes("203.0.113.9".parse().unwrap());
        let marker = SourceRange {
            lb_addr: lb,
            client: [0; 16],
        };
        assert_eq!(r.get(&(128, marker)), Some(&SOURCE_RANGE_RESTRICTED));
        let net = SourceRange {
            lb_addr: lb,
            client: ip_to_bytes("192.0.2.0".parse().unwrap()),
        };
        assert_eq!(r.get(&(128 + 96 + 24, net)), Some(&SOURCE_RANGE_ALLOW));
        // The IPv6 range does not apply to an IPv4 LB IP: marker + two ranges.
        assert_eq!(r.len(), 3, "{r:?}");
    }

    #[test]
    fn all_invalid_ranges_allow_everyone() {
        let yaml = LB.replace(
            "['192.0.2.0/24', ' 198.51.100.7/32', 'bogus', '2001:db8::/32']",
            "['bogus']",
        );
        let objs = objects(&yaml);
        let (state, _) = build(&objs, &node());
        let mut errors = Vec::new();
        assert!(source_ranges(&objs, &state, &mut errors).is_empty());
        assert_eq!(errors.len(), 1);
    }

    #[test]
    fn local_endpoints_node_ips_and_health_checks() {
        let objs = objects(LB);
        let n = node();
        assert_eq!(
            local_endpoints(&objs, &n),
            BTreeSet::from(["10.0.1.5".parse().unwrap()])
        );
        assert_eq!(
            node_ips(&objs, &n),
            BTreeSet::from(["192.0.2.50".parse().unwrap()])
        );
        let (state, _) = build(&objs, &n);
        let want = crate::healthcheck::wanted(&objs, &state);
        let c = &want[&31000];
        assert_eq!((c.namespace.as_str(), c.name.as_str()), ("default", "lb"));
        assert_eq!(c.local_endpoints, 1);
        // Another node has no local endpoint: 0 (the server answers 503 there).
        let (state, _) = build(
            &objs,
            &NodeInfo {
                name: "node-3".into(),
                ..Default::default()
            },
        );
        assert_eq!(
            crate::healthcheck::wanted(&objs, &state)[&31000].local_endpoints,
            0
        );
    }

    #[test]
    fn ipv6_routes_snat_addresses_and_dual_stack_cluster_cidr() {
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
        assert!(snat_v6(&"fd00:100::1".parse().unwrap()));
        assert!(!snat_v6(&"fe80::1".parse().unwrap()));
        assert!(!snat_v6(&"::ffff:192.0.2.1".parse().unwrap()));
        assert!(!snat_v6(&"192.0.2.1".parse().unwrap()));
        let cidrs: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap(), "fd00::/48".parse().unwrap()];
        let c = tc_config(&TcArgs::default(), &cidrs);
        assert_eq!(c.flags, TC_CFG_CLUSTER_CIDR_V4 | TC_CFG_CLUSTER_CIDR_V6);
        assert_eq!(
            (c.cluster_cidr_v4, c.cluster_cidr_v4_len),
            ([10, 0, 0, 0], 8)
        );
        assert_eq!(c.cluster_cidr_v6_len, 48);
        assert_eq!(&c.cluster_cidr_v6[..2], &[0xfd, 0]);
        let c = tc_config(&TcArgs::default(), &cidrs[1..]);
        assert_eq!(c.flags, TC_CFG_CLUSTER_CIDR_V6);
    }

    #[test]
    fn masks_and_routes() {
        let mut a = [0xff; 16];
        mask(&mut a, 96 + 20);
        assert_eq!(&a[12..], &[0xff, 0xff, 0xf0, 0]);
        assert_eq!(mask_v4(0xc612_0105, 24), 0xc612_0100);
        assert_eq!(mask_v4(0xc612_0105, 0), 0);
    }
}
