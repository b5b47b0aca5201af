//! Layouts of the data path's counters: the per-CPU reason counters ([`Counter`]) and the
//! per-service and per-backend statistics read by `ebpf-proxy stats` and the metrics.

// Items of sibling modules the doc comments link to.
#[cfg(doc)]
use crate::{MemberKey, SOCK_NAT, SOCK_NAT_OVERFLOW, bypass};

/// Name of the per-CPU counter map: [`Counter`] as `u32` index -> `u64`
/// (BPF_MAP_TYPE_PERCPU_ARRAY, [`COUNTER_MAX`] entries).
pub const COUNTERS: &str = "COUNTERS";

/// Number of entries in [`COUNTERS`].
pub const COUNTER_MAX: u32 = 16;

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

/// Name of the owner map of the per-CPU packet counters: slot `u32` -> owner tag `u64`
/// (BPF_MAP_TYPE_ARRAY, [`PACKET_SLOTS`] entries). Service id `id` may count its packets in
/// slot `id & (PACKET_SLOTS - 1)` of [`SERVICE_PACKETS`] when it owns that slot: the tag's
/// low 32 bits are the owner's service id (0: free), the high 32 bits the slot's generation
/// ([`packet_tag`]). The programs claim a free slot for the service of a packet they count
/// (an atomic compare-and-exchange, so one claim wins); the agent's periodic verification
/// frees the slots of ids no longer bound, with the next generation, so values of an
/// earlier owner never count for a later one. A service whose slot another owns counts in
/// [`SERVICE_STATS`]. Readers add both.
pub const PACKET_OWNERS: &str = "PACKET_OWNERS";
/// Name of the per-CPU packet counters: slot `u32` -> [`PacketCounts`]
/// (BPF_MAP_TYPE_PERCPU_ARRAY, [`PACKET_SLOTS`] entries; see [`PACKET_OWNERS`]). Written by
/// the programs only: a CPU's value counts for the slot's owner when its tag equals the
/// owner's tag, else it is an earlier owner's, reset at the owner's first packet on that
/// CPU. An array lookup instead of [`SERVICE_STATS`]'s hashed one for every tracked packet.
pub const SERVICE_PACKETS: &str = "SERVICE_PACKETS";
/// Slots of [`PACKET_OWNERS`] and [`SERVICE_PACKETS`] (a power of two; 96 KiB per CPU).
/// Service ids are handed out in increasing order, so two live ids share a slot only when
/// they are this many or more apart.
pub const PACKET_SLOTS: u32 = 4096;

/// The owner tag of service id `service_id` in a slot of generation `generation`
/// ([`PACKET_OWNERS`]).
pub const fn packet_tag(service_id: u32, generation: u32) -> u64 {
    service_id as u64 | (generation as u64) << 32
}

/// One CPU's packet counters of a slot of [`SERVICE_PACKETS`]. 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct PacketCounts {
    /// The owner tag these counts belong to ([`packet_tag`]).
    pub tag: u64,
    /// Packets translated through a conntrack entry, as [`ServiceStats::packets`].
    pub packets: u64,
    /// Their bytes, as [`ServiceStats::bytes`].
    pub bytes: u64,
}

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
    /// sees no packets), those a service counted while another id owned its slot of
    /// [`SERVICE_PACKETS`]; readers add the slot's.
    pub packets: u64,
    /// Bytes of those packets (IP length as the tc hook sees it).
    pub bytes: u64,
}

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

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all types are #[repr(C)], contain only integers and explicit padding fields,
    // and are valid for every bit pattern.
    unsafe impl aya::Pod for ServiceStats {}
    unsafe impl aya::Pod for PacketCounts {}
}
