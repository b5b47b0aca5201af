//! Map names, default sizes, keys and values shared by the eBPF data path (`proxy-ebpf`)
//! and the agent (`proxy-userspace`). This crate is the single definition of every layout.
//!
//! Conventions (all maps):
//! - Every key and value is `#[repr(C)]` with explicit padding fields, so the layout is the
//!   same for the BPF target and the host, and `bpftool map dump pinned` shows named fields
//!   (the object is built with BTF).
//! - Addresses are `[u8; 16]` in **network byte order** (the bytes of `struct in6_addr`).
//!   IPv4 addresses are stored IPv4-mapped (`::ffff:a.b.c.d`), so one map serves both
//!   families and an IPv4 VIP reached through a dual-stack IPv6 socket
//!   (`::ffff:10.96.0.10`) matches the IPv4 frontend. Byte arrays (rather than `u32` words)
//!   make `bpftool map dump` print `[..,255,255,10,96,0,10]`, readable at a glance.
//! - Ports are `[u8; 2]` in **network byte order** (`[0, 80]` is port 80), for the same
//!   reason.
//! - Protocols are IANA numbers: [`PROTO_TCP`], [`PROTO_UDP`].
//!
//! Service layout (after Cilium's `lb4_services_v2`/`lb4_backends`, see
//! `shared/notes/architecture.md`): [`FRONTENDS`] maps (VIP, port, protocol) to a
//! [`Frontend`] carrying a service id and a backend count; [`BACKEND_SLOTS`] maps
//! (service id, slot) for slot in `0..count` to a backend id and a copy of that backend (a
//! pick by slot reads one map); [`BACKENDS`] maps a backend id to its (address, port,
//! protocol). The agent writes a service in this order: backends, new slots,
//! then the frontend (count), and removes stale slots and backends last, so a reader never
//! sees a slot index without a backend behind it.

#![no_std]

pub mod bypass;
pub mod monitor;
pub mod nat;

/// IANA protocol number of TCP.
pub const PROTO_TCP: u8 = 6;
/// IANA protocol number of UDP.
pub const PROTO_UDP: u8 = 17;

/// Name of the frontend map: [`FrontendKey`] -> [`Frontend`] (BPF_MAP_TYPE_HASH).
pub const FRONTENDS: &str = "FRONTENDS";
/// Name of the slot map: [`BackendSlotKey`] -> [`BackendSlot`] (BPF_MAP_TYPE_HASH).
pub const BACKEND_SLOTS: &str = "BACKEND_SLOTS";
/// Name of the backend map: backend id `u32` -> [`Backend`] (BPF_MAP_TYPE_HASH).
pub const BACKENDS: &str = "BACKENDS";
/// Name of the socket reverse-NAT map: [`RevNatKey`] -> [`RevNatValue`]
/// (BPF_MAP_TYPE_LRU_HASH; entries age out with their sockets).
pub const REVNAT_SK: &str = "REVNAT_SK";
/// Name of the unconnected-UDP flow map: [`UdpFlowKey`] -> [`UdpFlow`] (BPF_MAP_TYPE_LRU_HASH).
pub const UDP_FLOWS: &str = "UDP_FLOWS";
/// Name of the configuration map: index 0 -> [`Config`] (BPF_MAP_TYPE_ARRAY, one entry).
pub const CONFIG: &str = "CONFIG";
/// Name of the per-CPU counter map: [`Counter`] as `u32` index -> `u64`
/// (BPF_MAP_TYPE_PERCPU_ARRAY, [`COUNTER_MAX`] entries).
pub const COUNTERS: &str = "COUNTERS";

/// Name of the kernel log ring buffer (BPF_MAP_TYPE_RINGBUF, 128 KiB) of aya-log records
/// (`--kernel-log-level`; the name and layout are aya-log-ebpf's). Pinned with the other
/// maps, so the programs of every load (socket, egress, tc, bypassed pods', and those of
/// an earlier agent until their links are replaced) write into one ring the agent reads.
pub const KERNEL_LOGS: &str = "AYA_LOGS";
/// Name of aya-log-ebpf's global log level (`u8` in `.rodata`: 0 off, 1 error, 2 warn,
/// 3 info, 4 debug, 5 trace), set by the agent at every load of the object.
pub const KERNEL_LOG_LEVEL: &str = "AYA_LOG_LEVEL";

/// Name of the stale-socket map: socket cookie `u64` -> service id `u32`
/// (BPF_MAP_TYPE_LRU_HASH). The agent adds a connected UDP socket here when the endpoint it
/// was translated to leaves its service, attaching the egress program first; the egress
/// program then fails the socket's sends (EPERM) until the application connects it again,
/// which picks a live endpoint and removes the entry (closing it removes it too). The agent
/// detaches the egress program when the map is empty. kube-proxy deletes the socket's UDP
/// conntrack entries for the same reason (KEP-1669, "stale UDP flows").
pub const STALE_SOCKETS: &str = "STALE_SOCKETS";

/// Name of the service name map: service id `u32` -> [`ServiceName`] (BPF_MAP_TYPE_HASH).
/// Not read by the data path: it lets `ebpf-proxy services` name what it prints while the
/// agent is down, and lets a restarted agent re-bind service ids to Services exactly.
pub const SERVICE_NAMES: &str = "SERVICE_NAMES";

/// Every map the agent pins, in the order the data path depends on them.
pub const ALL_MAPS: [&str; 23] = [
    FRONTENDS,
    BACKEND_SLOTS,
    BACKENDS,
    MEMBERS,
    MAGLEV,
    REVNAT_SK,
    UDP_FLOWS,
    STALE_SOCKETS,
    RR_CURSORS,
    LC_COUNTS,
    SOCKETS,
    AFFINITY,
    CONFIG,
    COUNTERS,
    SERVICE_STATS,
    BACKEND_STATS,
    STATS_CARRIED,
    SERVICE_NAMES,
    bypass::BYPASS_CONFIG,
    bypass::BYPASS_NETNS,
    SOCK_NAT,
    SOCK_NAT_OVERFLOW,
    SOCK_NAT_SPILLED,
];

/// Default `max_entries` of [`FRONTENDS`] (one per VIP x port x protocol, plus one
/// VIP marker per VIP). The agent may override it (`--max-frontends`).
pub const DEFAULT_MAX_FRONTENDS: u32 = 65536;
/// Default `max_entries` of [`BACKEND_SLOTS`] (sum of backend counts over service ids).
pub const DEFAULT_MAX_SLOTS: u32 = 262144;
/// Default `max_entries` of [`BACKENDS`] (distinct endpoint address x port x protocol).
pub const DEFAULT_MAX_BACKENDS: u32 = 131072;
/// Default `max_entries` of [`REVNAT_SK`], [`UDP_FLOWS`] and [`STALE_SOCKETS`] (LRU, per
/// socket or flow).
pub const DEFAULT_MAX_SOCKETS: u32 = 262144;
/// Number of entries in [`COUNTERS`].
pub const COUNTER_MAX: u32 = 16;

/// Highest number of backends one service id may have; bounds the agent's writes and
/// documents the slot range `0..MAX_BACKENDS_PER_SERVICE`.
pub const MAX_BACKENDS_PER_SERVICE: u32 = 65535;

/// [`Frontend::flags`] bit: this entry is a VIP marker (key port 0, protocol 0), present for
/// every VIP so that a port that is not defined on the VIP is refused (ECONNREFUSED) instead
/// of leaking to the network, as kube-proxy's nftables mode rejects it.
pub const FRONTEND_F_VIP_MARKER: u32 = 1 << 0;

/// [`Frontend::flags`] bit: the backend set holds only this node's endpoints because of a
/// `Local` traffic policy (KEP-2086 `internalTrafficPolicy`). With no endpoint, kube-proxy
/// drops such traffic rather than rejecting it; a socket-level hook cannot drop a
/// connect(), so it fails at once with EHOSTUNREACH (counted as
/// [`Counter::DroppedNoLocalEndpoints`]) instead of the ECONNREFUSED of a Service without
/// any endpoint.
pub const FRONTEND_F_LOCAL_ONLY: u32 = 1 << 1;

/// [`Frontend::flags`] bit: an external address (externalIP, load balancer IP) or a node
/// port, rather than a cluster IP. Such addresses get no VIP marker: kube-proxy's nftables
/// mode rejects undefined ports on cluster IPs only, and a node IP carries the node's own
/// services.
pub const FRONTEND_F_EXTERNAL: u32 = 1 << 2;

/// [`Frontend::flags`] bit, only with [`FRONTEND_F_LOCAL_ONLY`]: the Service port has no
/// usable endpoint on any node (kube-proxy's `hasEndpoints` false: no ready endpoint and no
/// serving terminating one). kube-proxy's nftables mode then rejects the traffic, as for any
/// Service without endpoints, where a `Local` policy without local endpoints while other
/// nodes have some is a drop (pkg/proxy/nftables/proxier.go, `syncProxyRules`: the
/// `reject-chain` verdict when `!hasEndpoints`, `drop` when only the local ones are missing).
pub const FRONTEND_F_NO_ENDPOINTS: u32 = 1 << 3;

/// [`Frontend::flags`] bit, on `SCOPE_INGRESS` frontends only: direct server return. A new
/// flow from outside to a backend on another node is not source-NATed: the client's packet
/// is sent to the backend encapsulated (IPIP / IPv6-in-IPv6, see
/// `proxy_common::nat::DSR`), unchanged inside, and the backend's node translates it and
/// answers the client directly from the frontend address. Set from `--north-south-mode`
/// (`dsr`: TCP and UDP; `hybrid`: TCP only) or the Service's north-south mode annotation,
/// never with `externalTrafficPolicy: Local` (which keeps the client address anyway).
pub const FRONTEND_F_DSR: u32 = 1 << 4;

/// [`FrontendKey::scope`] of frontends for traffic that starts on this node (the socket
/// programs: pods and host processes, which reach external addresses and node ports with the
/// Cluster endpoints, kube-proxy's short-circuit).
pub const SCOPE_NODE: u8 = 0;
/// [`FrontendKey::scope`] of frontends for traffic that enters the node from outside (the tc
/// programs): external addresses and node ports with the `externalTrafficPolicy` endpoints.
pub const SCOPE_INGRESS: u8 = 1;

/// Frontend key: (VIP, port, protocol, scope). 20 bytes.
///
/// The VIP marker of an address uses `port = 0`, `proto = 0`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct FrontendKey {
    /// VIP, 16 bytes in network byte order; IPv4 stored IPv4-mapped.
    pub addr: [u8; 16],
    /// Port, network byte order.
    pub port: [u8; 2],
    /// IANA protocol number ([`PROTO_TCP`], [`PROTO_UDP`]), 0 for a VIP marker.
    pub proto: u8,
    /// Who reaches it: [`SCOPE_NODE`] (socket programs) or [`SCOPE_INGRESS`] (tc programs).
    pub scope: u8,
}

/// Frontend value. 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Frontend {
    /// Id of the backend set (one per Service port x protocol x family x scope); key of
    /// [`BACKEND_SLOTS`]. 0 for a VIP marker.
    pub service_id: u32,
    /// Number of valid slots `0..backend_count`; 0 means "no endpoints: refuse".
    pub backend_count: u32,
    /// `FRONTEND_F_*` bits.
    pub flags: u32,
    /// Backend selection for new connections and flows: an [`Algorithm`] as `u8`.
    pub algorithm: u8,
    /// Reserved; always 0.
    pub _pad: [u8; 3],
    /// `sessionAffinity: ClientIP` timeout in seconds (1..=86400); 0 means no affinity.
    pub affinity_timeout_s: u32,
    /// Key of the Service port's affinity entries ([`AffinityKey::group`]): the same for every
    /// frontend and scope of one Service port and family, so a client keeps its backend
    /// whether it uses the cluster IP, a node port or a load balancer IP.
    pub affinity_group: u32,
}

/// Backend selection algorithms ([`Frontend::algorithm`]).
///
/// The Linux IPVS schedulers (`net/netfilter/ipvs/ip_vs_*.c`) map onto these by name
/// ([`Algorithm::from_ipvs`]). Every algorithm chooses among the backends of the
/// frontend's set; an endpoint of weight 0 is not in the set, so it takes no new
/// connection (IPVS's "quiesced" server) while its established connections go on.
///
/// The least-load algorithms (`LeastConnections`, `WeightedLeastConnections`,
/// `ShortestExpectedDelay`, `NeverQueue`) read one count per backend ([`LC_COUNTS`]): its
/// open connections (a socket from its translated `connect()` to its release; a tc flow
/// from its first packet until it closes or times out), summed over every Service using
/// the backend. IPVS keeps two counts per server and Service: `activeconns` (TCP
/// connections in ESTABLISHED, and UDP "connections" until their timeout) and `inactconns`
/// (TCP connections in any other state: SYN_RECV, FIN_WAIT, TIME_WAIT, ...), and ranks
/// `lc`/`wlc` by `activeconns * 256 + inactconns`, `sed`/`nq` by `activeconns + 1`. The
/// socket hooks see a connection from `connect()` to `close()`, not its TCP states, so
/// every counted connection is "active" here and the inactive part is always 0; the
/// rankings are then IPVS's with `inactconns = 0` (a handshake or a closing connection
/// counts fully rather than 1/256, and a TIME_WAIT socket no longer counts once the
/// application released it). The count is per backend rather than per Service, since one
/// pod serving several Services carries the load of all of them.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Algorithm {
    /// Uniformly random per connection (kube-proxy's iptables and nftables modes).
    #[default]
    Random = 0,
    /// Successive new connections take successive slots, with one cursor per CPU and
    /// service id (IPVS `rr`).
    RoundRobin = 1,
    /// Round-robin over slots in which each endpoint appears as often as its weight
    /// (interleaved by the agent, smooth weighted round-robin order; IPVS `wrr`).
    WeightedRoundRobin = 2,
    /// The backend with the fewest active connections ([`LC_COUNTS`]); ties at random
    /// (IPVS `lc`). Its members have weight 1 in [`MEMBERS`].
    LeastConnections = 3,
    /// Maglev consistent hashing of the client address ([`MAGLEV`]; IPVS `sh` and `mh`).
    SourceHash = 4,
    /// Maglev consistent hashing of the client address and port (IPVS `sh` and `mh` with
    /// their `sh-port` / `mh-port` flag).
    Maglev = 5,
    /// The backend with the lowest `connections / weight` (IPVS `wlc`); weights from
    /// [`MEMBERS`]. Compared by cross-multiplication, ties at random.
    WeightedLeastConnections = 6,
    /// The backend with the lowest `(connections + 1) / weight`, the expected delay of one
    /// more connection (IPVS `sed`).
    ShortestExpectedDelay = 7,
    /// An idle backend (no connection) if there is one, chosen at random among the idle
    /// ones; else as [`Algorithm::ShortestExpectedDelay`] (IPVS `nq`).
    NeverQueue = 8,
    /// Maglev consistent hashing of the frontend address the client addressed (IPVS `dh`):
    /// every connection to one frontend address goes to one backend while the set is
    /// unchanged, whoever the client is.
    DestinationHash = 9,
}

impl Algorithm {
    /// Every algorithm with its annotation / flag name, in number order.
    pub const ALL: [(Algorithm, &'static str); 10] = [
        (Algorithm::Random, "random"),
        (Algorithm::RoundRobin, "round-robin"),
        (Algorithm::WeightedRoundRobin, "weighted-round-robin"),
        (Algorithm::LeastConnections, "least-connections"),
        (Algorithm::SourceHash, "source-hash"),
        (Algorithm::Maglev, "maglev"),
        (
            Algorithm::WeightedLeastConnections,
            "weighted-least-connections",
        ),
        (Algorithm::ShortestExpectedDelay, "shortest-expected-delay"),
        (Algorithm::NeverQueue, "never-queue"),
        (Algorithm::DestinationHash, "destination-hash"),
    ];

    /// The IPVS scheduler names (ipvsadm `-s`, kube-proxy's `ipvs.scheduler`) with the
    /// algorithm that does what the scheduler does. Where the rules differ:
    /// - `sh` and `mh` both hash the client address into a Maglev table here (IPVS's `sh`
    ///   table has 256 buckets, `mh` is Maglev; either way one client keeps one backend
    ///   while the set is unchanged). IPVS gives a server a share of those tables
    ///   proportional to its weight; this table is unweighted (kube-proxy's IPVS mode gives
    ///   every endpoint weight 1, so its Services see no difference). Their `sh-port` /
    ///   `mh-port` flags (hash the port too) are [`Algorithm::Maglev`].
    /// - `dh` refuses a connection whose bucket holds a quiesced server; here a quiesced
    ///   endpoint leaves the set and the table is rebuilt, so its frontends move to other
    ///   backends (what IPVS's `sh-fallback` / `mh-fallback` do for the source hashes).
    /// - `lblc` and `lblcr` (locality-based, for cache clusters) have no equivalent.
    pub const IPVS: [(&'static str, Algorithm); 9] = [
        ("rr", Algorithm::RoundRobin),
        ("wrr", Algorithm::WeightedRoundRobin),
        ("lc", Algorithm::LeastConnections),
        ("wlc", Algorithm::WeightedLeastConnections),
        ("sed", Algorithm::ShortestExpectedDelay),
        ("nq", Algorithm::NeverQueue),
        ("sh", Algorithm::SourceHash),
        ("dh", Algorithm::DestinationHash),
        ("mh", Algorithm::SourceHash),
    ];

    /// The algorithm numbered `n`, if any.
    pub const fn from_u8(n: u8) -> Option<Algorithm> {
        match n {
            0 => Some(Algorithm::Random),
            1 => Some(Algorithm::RoundRobin),
            2 => Some(Algorithm::WeightedRoundRobin),
            3 => Some(Algorithm::LeastConnections),
            4 => Some(Algorithm::SourceHash),
            5 => Some(Algorithm::Maglev),
            6 => Some(Algorithm::WeightedLeastConnections),
            7 => Some(Algorithm::ShortestExpectedDelay),
            8 => Some(Algorithm::NeverQueue),
            9 => Some(Algorithm::DestinationHash),
            _ => None,
        }
    }

    /// The name used in annotations and flags.
    pub const fn name(self) -> &'static str {
        Algorithm::ALL[self as usize].1
    }

    /// The algorithm of an ebpf-proxy name ([`Algorithm::ALL`]) or an IPVS scheduler name
    /// ([`Algorithm::IPVS`]); exact, case-sensitive match (as IPVS and kube-proxy match).
    pub fn from_name(s: &str) -> Option<Algorithm> {
        Algorithm::ALL
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(a, _)| *a)
            .or_else(|| Algorithm::from_ipvs(s))
    }

    /// The algorithm of an IPVS scheduler name ([`Algorithm::IPVS`]) only.
    pub fn from_ipvs(s: &str) -> Option<Algorithm> {
        Algorithm::IPVS
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, a)| *a)
    }

    /// True for the algorithms that read endpoint weights: weighted round-robin (from the
    /// slot layout) and the weighted least-load family (from [`MEMBERS`]).
    pub const fn uses_weights(self) -> bool {
        matches!(
            self,
            Algorithm::WeightedRoundRobin
                | Algorithm::WeightedLeastConnections
                | Algorithm::ShortestExpectedDelay
                | Algorithm::NeverQueue
        )
    }

    /// True for the algorithms that choose by the backends' active connections
    /// ([`LC_COUNTS`]): the data path counts the connections and flows of their frontends.
    pub const fn counts_connections(self) -> bool {
        matches!(
            self,
            Algorithm::LeastConnections
                | Algorithm::WeightedLeastConnections
                | Algorithm::ShortestExpectedDelay
                | Algorithm::NeverQueue
        )
    }

    /// True for the algorithms that read [`MEMBERS`]: the table algorithms (a backend that
    /// left is never chosen from a stale table) and the least-load ones (the weights; every
    /// weight is 1 for least-connections). ClientIP affinity reads it too, whatever the
    /// algorithm.
    pub const fn reads_members(self) -> bool {
        self.uses_table() || self.counts_connections()
    }

    /// True for the algorithms that read the service's Maglev table ([`MAGLEV`]).
    pub const fn uses_table(self) -> bool {
        matches!(
            self,
            Algorithm::SourceHash | Algorithm::Maglev | Algorithm::DestinationHash
        )
    }
}

/// True when [`Frontend::algorithm`] `n` counts connections
/// ([`Algorithm::counts_connections`]); an unknown number does not.
#[inline(always)]
pub const fn counts_connections(n: u8) -> bool {
    match Algorithm::from_u8(n) {
        Some(a) => a.counts_connections(),
        None => false,
    }
}

/// Name of the per-CPU round-robin cursor map: service id `u32` -> next slot `u32`
/// (BPF_MAP_TYPE_PERCPU_HASH).
pub const RR_CURSORS: &str = "RR_CURSORS";
/// Name of the least-connections counter map: backend id `u32` -> active connections `u32`
/// (BPF_MAP_TYPE_HASH), maintained by the data path: +1 when a connection is translated to
/// the backend, -1 when its socket is released.
pub const LC_COUNTS: &str = "LC_COUNTS";
/// Name of the map of least-connections sockets: socket cookie `u64` -> backend id `u32`
/// with [`SOCKET_F_COUNTED`] set (BPF_MAP_TYPE_LRU_HASH). Written by `connect()`
/// translations of least-connections frontends only (other sockets need no state beyond
/// their reverse-NAT entry); the socket's release gives the count back.
pub const SOCKETS: &str = "SOCKETS";
/// [`SOCKETS`] value bit: the connection is counted in [`LC_COUNTS`] (backend ids stay
/// below it).
pub const SOCKET_F_COUNTED: u32 = 1 << 31;
/// Name of the session-affinity map: [`AffinityKey`] -> [`AffinityValue`]
/// (BPF_MAP_TYPE_LRU_HASH).
pub const AFFINITY: &str = "AFFINITY";
/// Name of the membership map: [`MemberKey`] (service id, backend id) -> the backend's
/// weight in that set, `u32` in `1..=100` (BPF_MAP_TYPE_HASH, not preallocated). Written
/// for the keys that read it: ClientIP affinity and the table algorithms only return a
/// client to a backend that is still a member of the frontend's set (not removed, not
/// ready, not terminating, not of weight 0), and the least-load algorithms
/// ([`Algorithm::counts_connections`]) divide a backend's connections by this weight (a
/// backend without a membership is leaving and is skipped). Keys without weights
/// (least-connections, the tables, affinity) hold 1; weighted round-robin's weights are in
/// its slot layout.
pub const MEMBERS: &str = "MEMBERS";
/// Name of the Maglev table map: service id `u32` -> [`MaglevTable`]
/// (BPF_MAP_TYPE_HASH, BPF_F_NO_PREALLOC: only services using a hashing algorithm have one).
pub const MAGLEV: &str = "MAGLEV";

/// Largest Maglev table size ([`MaglevTable::entries`] length); sizes are primes up to this.
pub const MAGLEV_MAX: usize = 65521;
/// Default Maglev table size (a prime, as in Cilium and the Maglev paper's evaluation).
pub const MAGLEV_DEFAULT: u32 = 16381;
/// Default `max_entries` of [`MAGLEV`].
pub const DEFAULT_MAX_MAGLEV: u32 = 1024;
/// Most slots least-connections compares per decision: a larger service is compared over a
/// window of this many consecutive slots starting at a random one.
pub const LC_SCAN_MAX: u32 = 32;

/// Name of the per-service counter map: service id `u32` -> [`ServiceStats`]
/// (BPF_MAP_TYPE_PERCPU_HASH, not preallocated: one value per CPU, summed by readers; the
/// programs create an id's entry at its first count, and the agent's periodic verification
/// deletes the entries of ids no longer bound).
pub const SERVICE_STATS: &str = "SERVICE_STATS";
/// Name of the connection counter map: [`MemberKey`] (service id, backend id) -> connections
/// and new flows of that service sent to that backend, `u64` (BPF_MAP_TYPE_PERCPU_HASH, not
/// preallocated: one value per CPU, summed by readers). One key per translation, so a
/// connection costs the programs one counter lookup: a service's connections are the sum
/// over its keys, a backend's over its keys. The agent's periodic verification moves the
/// count of a pair whose backend left the service to [`STATS_CARRIED`], so neither sum
/// goes down, and deletes the pair.
pub const BACKEND_STATS: &str = "BACKEND_STATS";
/// Name of the map of carried connection counts: [`MemberKey`] `(service id, 0)` or
/// `(0, backend id)` -> the connections `u64` that pairs of [`BACKEND_STATS`] no longer in
/// use counted for that service or backend while it stays bound (BPF_MAP_TYPE_HASH, not
/// preallocated). Written by the agent only, never by the programs, so it always has room
/// for every bound id; readers add it to [`BACKEND_STATS`]'s sums. Keys of ids no longer
/// bound are deleted.
pub const STATS_CARRIED: &str = "STATS_CARRIED";

/// Per-CPU counters of one service id. 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ServiceStats {
    /// New connections (connect) and new unconnected-UDP flows translated, as counted by an
    /// earlier version: the programs count them in [`BACKEND_STATS`] now, and readers add
    /// both.
    pub connections: u64,
    /// Connections and datagrams refused or dropped for lack of (local) endpoints.
    pub refused: u64,
    /// Packets translated by the tc path through a conntrack entry (both directions; a flow's
    /// first packet, translated while the entry is created, is not counted: the socket path
    /// sees no packets).
    pub packets: u64,
    /// Bytes of those packets (IP length as the tc hook sees it).
    pub bytes: u64,
}

/// Affinity key: (Service port group, client). 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityKey {
    /// [`Frontend::affinity_group`].
    pub group: u32,
    /// Reserved; always 0.
    pub _pad: u32,
    /// Client: its address, network byte order, IPv4-mapped; for a socket without a bound
    /// source address, its network namespace (see [`client_of_netns`]).
    pub client: [u8; 16],
}

/// Affinity value. 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityValue {
    /// Backend id the client sticks to.
    pub backend_id: u32,
    /// Reserved; always 0.
    pub _pad: u32,
    /// `bpf_ktime_get_ns()` of the client's last new connection to the group (ns since
    /// boot); the entry is used while `now - last_used_ns < timeout`.
    pub last_used_ns: u64,
}

/// Membership key: (service id, backend id). 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct MemberKey {
    /// [`Frontend::service_id`].
    pub service_id: u32,
    /// Backend id.
    pub backend_id: u32,
}

/// A Maglev lookup table (Eisenbud et al., NSDI 2016): `entries[hash % size]` is the backend
/// id for a client hash. `8 + 4 * MAGLEV_MAX` bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevTable {
    /// Table size M, a prime `<= MAGLEV_MAX`.
    pub size: u32,
    /// Reserved; always 0.
    pub _pad: u32,
    /// Backend ids; `entries[size..]` are 0.
    pub entries: [u32; MAGLEV_MAX],
}

/// The client id of a socket in network namespace `cookie` (`bpf_get_netns_cookie`): used by
/// the socket programs when the socket has no bound source address, since every pod has its
/// own network namespace (one pod = one client IP) and host processes share the node's.
/// Bytes: `fe80:ffff:ffff:ffff` then the cookie, little-endian; never an address a pod uses.
#[inline(always)]
pub const fn client_of_netns(cookie: u64) -> [u8; 16] {
    let c = cookie.to_le_bytes();
    [
        0xfe, 0x80, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, c[0], c[1], c[2], c[3], c[4], c[5], c[6],
        c[7],
    ]
}

/// Slot key: (service id, slot index). 8 bytes. Value: [`BackendSlot`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BackendSlotKey {
    /// [`Frontend::service_id`].
    pub service_id: u32,
    /// Slot index, `0..Frontend::backend_count`.
    pub slot: u32,
}

/// Slot value: the backend id (host order) and a copy of its [`BACKENDS`] value, so a pick
/// by slot (random, round robin) reads one map instead of two. The agent writes `BACKENDS`
/// first and deletes an id only after every slot naming it is rewritten or deleted, so
/// while an id is in a slot its value is the copy's (a freed id may name another backend
/// later, in new slots); a copy that differs anyway (a write outside the agent) is
/// rewritten by the periodic verification. 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BackendSlot {
    /// The backend id (never 0).
    pub backend_id: u32,
    /// Its value, as in [`BACKENDS`].
    pub backend: Backend,
}

/// Backend value (key: backend id `u32`, host order, never 0). 20 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend {
    /// Endpoint address, 16 bytes network byte order; IPv4 stored IPv4-mapped.
    pub addr: [u8; 16],
    /// Endpoint port, network byte order.
    pub port: [u8; 2],
    /// IANA protocol number.
    pub proto: u8,
    /// Reserved; always 0.
    pub flags: u8,
}

/// Socket reverse-NAT key: (socket cookie, backend address, backend port). 32 bytes.
///
/// Written by `sendmsg4/6` when they translate a VIP (connected sockets' entries are in
/// [`SOCK_NAT`] and [`SOCK_NAT_OVERFLOW`]; versions without those wrote them here); read by
/// `getpeername4/6` and `recvmsg4/6`, which only rewrite a peer that this very socket
/// reached through a VIP (a pod IP addressed directly has no entry and stays untouched).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNatKey {
    /// `bpf_get_socket_cookie()` of the client socket.
    pub cookie: u64,
    /// Backend address, network byte order, IPv4-mapped for IPv4.
    pub addr: [u8; 16],
    /// Backend port, network byte order.
    pub port: [u8; 2],
    /// Reserved; always 0.
    pub _pad: [u8; 6],
}

/// Socket reverse-NAT value: the frontend the socket addressed. 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNatValue {
    /// VIP, network byte order, IPv4-mapped for IPv4.
    pub addr: [u8; 16],
    /// Frontend port, network byte order.
    pub port: [u8; 2],
    /// IANA protocol of the socket ([`PROTO_TCP`], [`PROTO_UDP`]).
    pub proto: u8,
    /// `REVNAT_F_*` bits: how the socket was translated.
    pub flags: u8,
    /// [`Frontend::service_id`] the backend was chosen from; the agent uses it to find the
    /// sockets of an endpoint that left its service.
    pub service_id: u32,
}

/// Name of the connected sockets' reverse-NAT table: slot index `u32` -> [`SockNat`]
/// (BPF_MAP_TYPE_ARRAY, a power of two of slots, at most `--max-sockets`).
///
/// `connect4/6` keep a translated socket's entry in slot `cookie & mask` (mask: the global
/// [`SOCK_NAT_SLOT_MASK`], slots - 1): an array slot costs no hashing, bucket lock or LRU
/// list, and the kernel hands socket cookies out in sequence (per CPU, in batches), so
/// consecutive connections write neighbouring slots. A slot held by another live socket
/// (a cookie a multiple of `slots` apart) sends the entry to [`SOCK_NAT_OVERFLOW`].
/// Entries of unconnected UDP sends stay in [`REVNAT_SK`]: `getpeername` reads the
/// socket's slot, then its overflow entry; `recvmsg` reads `REVNAT_SK`'s unconnected
/// entries first (the latest datagram sent with an address decides), then those.
///
/// Claiming protocol (the agent reads slots while the kernel writes them): a free slot has
/// cookie 0; `connect()` claims it by a compare-and-swap of the cookie from 0 to
/// `cookie |` [`SOCK_NAT_BUSY`], writes the entry, then stores the plain cookie (an atomic
/// exchange, a full barrier); `sock_release` of that socket stores 0. A reader takes a
/// slot only when its cookie is non-zero without the busy bit, and one whose peer is all
/// zeros no longer translates (see [`SOCK_NAT_OVERFLOW`]). A batched read copies a
/// slot without a lock, so a slot released and claimed again during its copy can show the
/// released socket's cookie with the new socket's backend (a window of nanoseconds): the
/// agent's passes over the entries then act on a closed socket, a no-op, and miss the new
/// one until their next pass.
pub const SOCK_NAT: &str = "SOCK_NAT";
/// Name of the connected sockets' overflow map: socket cookie `u64` -> [`SockNat`]
/// (BPF_MAP_TYPE_HASH, a quarter of `--max-sockets`): the entries whose [`SOCK_NAT`]
/// slot another live socket holds. Keyed by cookie alone, so a socket's release finds and
/// deletes its entry whatever its state (a failed blocking connect or `connect(AF_UNSPEC)`
/// clears the peer first); not an LRU map, so no live socket's entry is evicted (a full
/// map refuses the new entry: `map_update_failed`, and that socket's `getpeername()` shows
/// its endpoint). An entry whose peer is all zeros no longer translates (the socket
/// addressed a pod directly since) but still carries what the release needs.
pub const SOCK_NAT_OVERFLOW: &str = "SOCK_NAT_OVERFLOW";
/// Name of the object's global `u64` (`.rodata`) holding `slots - 1` of [`SOCK_NAT`],
/// set by the agent at every load to the size of the map the programs use (created or
/// adopted). A mask beyond the map only sends more entries to [`SOCK_NAT_OVERFLOW`] (an
/// index past the end misses).
pub const SOCK_NAT_SLOT_MASK: &str = "SOCK_NAT_SLOT_MASK";
/// Name of the overflow hints: index -> `u32` (BPF_MAP_TYPE_ARRAY, two entries).
///
/// - [`SPILLED_OVERFLOW`]: connected sockets' entries in [`SOCK_NAT_OVERFLOW`], kept by
///   the programs (and set by the agent to the map's entry count when it creates this map
///   next to an adopted overflow map). While it is 0, `sock_release` and `getpeername` look
///   only at the socket's slot, which spares every connected socket that was never
///   translated (accepted server sockets, pods' direct connections) a hash lookup.
/// - [`SPILLED_LEGACY`]: non-zero while [`REVNAT_SK`] may hold connected sockets' entries
///   written by a version without slots; set by the agent at a start that finds such an
///   entry there (or adopts the pins of such a version, whose programs may still add
///   some until their links are replaced), cleared by a start that finds none (these
///   programs never add one). While it is set, a release, `getpeername` or `recvmsg` that
///   found nothing looks there too. Entries of that version's sockets that died without
///   their release finding them (a failed blocking connect) keep it set until the LRU
///   drops them.
pub const SOCK_NAT_SPILLED: &str = "SOCK_NAT_SPILLED";
/// Index of [`SOCK_NAT_SPILLED`]: entries in [`SOCK_NAT_OVERFLOW`].
pub const SPILLED_OVERFLOW: u32 = 0;
/// Index of [`SOCK_NAT_SPILLED`]: an earlier version's connected entries in [`REVNAT_SK`].
pub const SPILLED_LEGACY: u32 = 1;
/// Bit of [`SockNat`]'s cookie while `connect()` is writing the slot.
pub const SOCK_NAT_BUSY: u64 = 1 << 63;

/// The number of [`SOCK_NAT`] slots for `--max-sockets` `sockets`: the largest power of
/// two not above it (at least 1), so the map never exceeds the socket capacity asked for.
pub const fn sock_nat_slots(sockets: u32) -> u32 {
    if sockets <= 1 {
        1
    } else {
        1 << (31 - sockets.leading_zeros())
    }
}

/// One slot of [`SOCK_NAT`]: the reverse-NAT entry of a connected socket (TCP, or UDP after
/// `connect()`), found by its cookie without hashing. `key.cookie` 0 marks a free slot.
/// 56 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockNat {
    /// The socket (cookie) and the backend it was connected to.
    pub key: RevNatKey,
    /// The frontend it addressed.
    pub value: RevNatValue,
}

/// [`RevNatValue::flags`] bit: translated by `connect()` (a TCP connection or a connected UDP
/// socket), as opposed to a `sendmsg()` of an unconnected UDP socket.
pub const REVNAT_F_CONNECTED: u8 = 1 << 0;
/// [`RevNatValue::flags`] bit: the connection is counted for least-connections; the
/// socket's [`SOCKETS`] record names the backend whose count its release gives back.
pub const REVNAT_F_COUNTED: u8 = 1 << 1;

/// Unconnected-UDP flow key: (socket cookie, frontend). 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct UdpFlowKey {
    /// `bpf_get_socket_cookie()` of the client socket.
    pub cookie: u64,
    /// VIP, network byte order, IPv4-mapped for IPv4.
    pub addr: [u8; 16],
    /// Frontend port, network byte order.
    pub port: [u8; 2],
    /// Reserved; always 0.
    pub _pad: [u8; 6],
}

/// Unconnected-UDP flow value: the backend a socket's datagrams to one frontend go to,
/// kept while the flow is active (as a kube-proxy conntrack entry is). 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct UdpFlow {
    /// Backend id chosen for the flow.
    pub backend_id: u32,
    /// [`Frontend::service_id`] the choice was made for; a changed id means a new choice.
    pub service_id: u32,
    /// `bpf_ktime_get_ns()` of the last datagram sent or received on the flow (ns since boot).
    pub last_seen_ns: u64,
    /// Backend address at choice time; a mismatch (id reused) means a new choice.
    pub addr: [u8; 16],
}

/// Longest service name [`ServiceName`] holds, in bytes.
pub const SERVICE_NAME_LEN: usize = 248;

/// Name of a service id: `namespace/name:port-name/PROTOCOL/family`, UTF-8, not
/// NUL-terminated, `len` bytes used (e.g. `default/kube-dns:dns-tcp/TCP/v4`). 256 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceName {
    /// Bytes used in `name`.
    pub len: u32,
    /// Reserved; always 0.
    pub _pad: u32,
    /// The name bytes.
    pub name: [u8; SERVICE_NAME_LEN],
}

impl Default for ServiceName {
    fn default() -> Self {
        Self {
            len: 0,
            _pad: 0,
            name: [0; SERVICE_NAME_LEN],
        }
    }
}

/// Data path configuration, index 0 of [`CONFIG`]. 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Config {
    /// Idle time after which an unconnected-UDP flow picks a backend anew, in nanoseconds.
    /// 0 means [`DEFAULT_UDP_FLOW_TIMEOUT_NS`].
    pub udp_flow_timeout_ns: u64,
    /// Reserved; always 0.
    pub _reserved: u64,
}

/// Default UDP flow idle timeout: 30 s, the kernel's `nf_conntrack_udp_timeout`
/// (kube-proxy relies on conntrack for UDP stickiness).
pub const DEFAULT_UDP_FLOW_TIMEOUT_NS: u64 = 30_000_000_000;

/// Indices of [`COUNTERS`] (per-CPU `u64`): why the data path translated or refused.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// A connect() or sendmsg() to a frontend was translated to a backend.
    Translated = 0,
    /// Refused: the frontend has no endpoints.
    RefusedNoEndpoints = 1,
    /// Refused: the port/protocol is not defined on this VIP.
    RefusedUndefinedPort = 2,
    /// A slot or backend lookup missed (the agent was rewriting the service).
    SlotMiss = 3,
    /// A reverse-NAT entry, a flow entry or a connection counter could not be written (map
    /// full).
    MapUpdateFailed = 4,
    /// getpeername()/recvmsg() rewritten back to the VIP.
    ReverseTranslated = 5,
    /// Failed with EHOSTUNREACH: a `Local` traffic policy and no endpoint on this node.
    DroppedNoLocalEndpoints = 6,
    /// A send of a connected UDP socket failed: its endpoint left the service.
    DroppedStaleSocket = 7,
    /// A connect() or sendmsg() to a frontend left untouched: its workload bypasses
    /// socket-level translation (see [`bypass`]); its packets are translated per packet.
    Bypassed = 8,
    /// A connected socket's reverse-NAT entry went to [`SOCK_NAT_OVERFLOW`]: another live
    /// socket holds its [`SOCK_NAT`] slot. Many of these mean `--max-sockets` is small for the
    /// node's open connections.
    ReverseNatSpilled = 9,
}

impl Counter {
    /// Every counter, in index order, with its Prometheus-style name.
    pub const ALL: [(Counter, &'static str); 10] = [
        (Counter::Translated, "translated"),
        (Counter::RefusedNoEndpoints, "refused_no_endpoints"),
        (Counter::RefusedUndefinedPort, "refused_undefined_port"),
        (Counter::SlotMiss, "slot_miss"),
        (Counter::MapUpdateFailed, "map_update_failed"),
        (Counter::ReverseTranslated, "reverse_translated"),
        (
            Counter::DroppedNoLocalEndpoints,
            "dropped_no_local_endpoints",
        ),
        (Counter::DroppedStaleSocket, "dropped_stale_socket"),
        (Counter::Bypassed, "bypassed"),
        (Counter::ReverseNatSpilled, "reverse_nat_spilled"),
    ];

    /// What the counter counts, in one line for operators (`ebpf-proxy stats`).
    pub const fn meaning(self) -> &'static str {
        match self {
            Counter::Translated => "connect()/sendmsg() to a frontend sent to a backend",
            Counter::RefusedNoEndpoints => "refused (ECONNREFUSED): the frontend has no endpoints",
            Counter::RefusedUndefinedPort => "refused (ECONNREFUSED): port not defined on the VIP",
            Counter::SlotMiss => "a backend lookup missed while the agent rewrote the service",
            Counter::MapUpdateFailed => {
                "a reverse-NAT entry, flow entry or connection counter not written (map full)"
            }
            Counter::ReverseTranslated => {
                "getpeername()/recvmsg() showed the VIP instead of the backend"
            }
            Counter::DroppedNoLocalEndpoints => {
                "failed (EHOSTUNREACH): Local policy, no endpoint on this node"
            }
            Counter::DroppedStaleSocket => "a send of a UDP socket whose endpoint left failed",
            Counter::Bypassed => "left to the per-packet path (bypassed workload)",
            Counter::ReverseNatSpilled => {
                "a connection's reverse-NAT entry went to the overflow map (its slot was taken)"
            }
        }
    }
}

/// Builds the 16-byte form of an IPv4 address given as `bpf_sock_addr.user_ip4` holds it
/// (network byte order in a `u32`, so its memory bytes are the address bytes).
#[inline(always)]
pub const fn v4_mapped(ip4_be: u32) -> [u8; 16] {
    let b = ip4_be.to_ne_bytes();
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, b[0], b[1], b[2], b[3],
    ]
}

/// True when a 16-byte address is IPv4-mapped (`::ffff:0:0/96`).
#[inline(always)]
pub const fn is_v4_mapped(a: &[u8; 16]) -> bool {
    a[0] == 0
        && a[1] == 0
        && a[2] == 0
        && a[3] == 0
        && a[4] == 0
        && a[5] == 0
        && a[6] == 0
        && a[7] == 0
        && a[8] == 0
        && a[9] == 0
        && a[10] == 0xff
        && a[11] == 0xff
}

/// The IPv4 address of a mapped address as `bpf_sock_addr.user_ip4` holds it.
#[inline(always)]
pub const fn v4_of_mapped(a: &[u8; 16]) -> u32 {
    u32::from_ne_bytes([a[12], a[13], a[14], a[15]])
}

/// 16 address bytes -> the four `u32` words of `bpf_sock_addr.user_ip6` (memory order kept).
#[inline(always)]
pub const fn words_of(a: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// The four `u32` words of `bpf_sock_addr.user_ip6` -> 16 address bytes.
#[inline(always)]
pub const fn bytes_of(w: &[u32; 4]) -> [u8; 16] {
    let (a, b, c, d) = (
        w[0].to_ne_bytes(),
        w[1].to_ne_bytes(),
        w[2].to_ne_bytes(),
        w[3].to_ne_bytes(),
    );
    [
        a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], c[0], c[1], c[2], c[3], d[0], d[1], d[2],
        d[3],
    ]
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all types are #[repr(C)], contain only integers and explicit padding fields,
    // and are valid for every bit pattern.
    unsafe impl aya::Pod for FrontendKey {}
    unsafe impl aya::Pod for Frontend {}
    unsafe impl aya::Pod for BackendSlotKey {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for BackendSlot {}
    unsafe impl aya::Pod for RevNatKey {}
    unsafe impl aya::Pod for RevNatValue {}
    unsafe impl aya::Pod for SockNat {}
    unsafe impl aya::Pod for UdpFlowKey {}
    unsafe impl aya::Pod for UdpFlow {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for ServiceName {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for MemberKey {}
    unsafe impl aya::Pod for MaglevTable {}
    unsafe impl aya::Pod for ServiceStats {}
}

// Layout checks: the kernel and user builds must agree byte for byte.
const _: () = {
    assert!(core::mem::size_of::<FrontendKey>() == 20);
    assert!(core::mem::size_of::<Frontend>() == 24);
    assert!(core::mem::size_of::<AffinityKey>() == 24);
    assert!(core::mem::size_of::<AffinityValue>() == 16);
    assert!(core::mem::size_of::<MemberKey>() == 8);
    assert!(core::mem::size_of::<MaglevTable>() == 8 + 4 * MAGLEV_MAX);
    assert!(core::mem::size_of::<BackendSlotKey>() == 8);
    assert!(core::mem::size_of::<Backend>() == 20);
    assert!(core::mem::size_of::<BackendSlot>() == 24);
    assert!(core::mem::size_of::<RevNatKey>() == 32);
    assert!(core::mem::size_of::<RevNatValue>() == 24);
    assert!(core::mem::size_of::<SockNat>() == 56);
    assert!(sock_nat_slots(0) == 1 && sock_nat_slots(1) == 1 && sock_nat_slots(3) == 2);
    assert!(sock_nat_slots(DEFAULT_MAX_SOCKETS) == DEFAULT_MAX_SOCKETS);
    assert!(sock_nat_slots(300_000) == 262_144 && sock_nat_slots(u32::MAX) == 1 << 31);
    assert!(core::mem::size_of::<UdpFlowKey>() == 32);
    assert!(core::mem::size_of::<UdpFlow>() == 32);
    assert!(core::mem::size_of::<Config>() == 16);
    assert!(core::mem::size_of::<ServiceName>() == 256);
};
