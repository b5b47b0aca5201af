//! Layouts of backend selection: the algorithms a frontend names, and the maps they read
//! beside the slots (round-robin cursors, least-connections counts and sockets, session
//! affinity, backend set membership and weights, Maglev tables). Same conventions as the
//! crate root.

// Items of sibling modules the doc comments link to.
#[cfg(doc)]
use crate::Frontend;

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

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all types are #[repr(C)], contain only integers and explicit padding fields,
    // and are valid for every bit pattern.
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for MemberKey {}
    unsafe impl aya::Pod for MaglevTable {}
}

// Layout checks: the kernel and user builds must agree byte for byte.
const _: () = {
    assert!(core::mem::size_of::<AffinityKey>() == 24);
    assert!(core::mem::size_of::<AffinityValue>() == 16);
    assert!(core::mem::size_of::<MemberKey>() == 8);
    assert!(core::mem::size_of::<MaglevTable>() == 8 + 4 * MAGLEV_MAX);
};
