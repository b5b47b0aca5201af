//! The north-south settings (`--xdp`, `--masquerade-all`, `--conntrack-*`), the
//! conntrack table's size and memory they give, and the tc configuration they write.

use std::fs;

use ipnet::IpNet;
use proxy_common::nat::{
    CtEntry, CtKey, TC_CFG_CLUSTER_CIDR_V4, TC_CFG_CLUSTER_CIDR_V6, TC_CFG_MASQUERADE_ALL, TcConfig,
};

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
    pub(crate) fn conntrack_flows(&self) -> u32 {
        self.conntrack_size().flows
    }

    /// The conntrack table's size on this node (CPUs from `available_parallelism`).
    pub(crate) fn conntrack_size(&self) -> ConntrackSize {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.conntrack_size_for(u32::try_from(cpus).unwrap_or(u32::MAX))
    }

    /// The conntrack table's size for `cpus` CPUs: see [`TcSettings::conntrack_flows`].
    pub(crate) fn conntrack_size_for(&self, cpus: u32) -> ConntrackSize {
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

/// The flags and cluster CIDRs of the tc configuration ([`proxy_common::nat::TC_CONFIG`]) for these flags
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
