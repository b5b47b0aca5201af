//! Every map of the object. Names, key and value types come from `proxy_common` (the
//! service and socket maps from its root, the packet path's from `proxy_common::nat`); the
//! sizes here are the defaults and the agent overrides them at load time
//! (`EbpfLoader::map_max_entries`).

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{
        Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray, RingBuf,
    },
    macros::btf_map,
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, COUNTER_MAX, Config,
    DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS, DEFAULT_MAX_MAGLEV, DEFAULT_MAX_SLOTS,
    DEFAULT_MAX_SOCKETS, Frontend, FrontendKey, MaglevTable, MemberKey, PACKET_SLOTS, PacketCounts, RevNatKey, RevNatValue,
    ServiceName, ServiceStats, SockNat, UdpFlow, UdpFlowKey,
    bypass::{BypassConfig, MAX_BYPASS_NETNS},
    monitor::{MONITOR_RING_BYTES, MonitorCpu, MonitorCtl, MonitorEvent},
    nat::{
        CtClock, CtEntry, CtKey, DEFAULT_MAX_CONNTRACK, DsrKey, DsrTarget, IfaceAddr, MAX_DSR,
        MAX_IFACES, MAX_LOCAL_ENDPOINTS, MAX_SOURCE_RANGES, SourceRange, TAIL_SLOTS,
        TC_COUNTER_MAX, TcConfig,
    },
};

use crate::{
    fib::FIB_HOP_SLOTS,
    types::{FibHop, Scratch},
};

// ---------------------------------------------------------------------------------------
// Services and the socket path
// ---------------------------------------------------------------------------------------

/// (VIP, port, protocol) -> frontend; see `proxy_common::FRONTENDS`.
#[btf_map]
pub static FRONTENDS: HashMap<FrontendKey, Frontend, { DEFAULT_MAX_FRONTENDS as usize }> =
    HashMap::new();

/// (service id, slot) -> backend id and value; see `proxy_common::BACKEND_SLOTS`.
#[btf_map]
pub static BACKEND_SLOTS: HashMap<BackendSlotKey, BackendSlot, { DEFAULT_MAX_SLOTS as usize }> =
    HashMap::new();

/// backend id -> (address, port); see `proxy_common::BACKENDS`.
#[btf_map]
pub static BACKENDS: HashMap<u32, Backend, { DEFAULT_MAX_BACKENDS as usize }> = HashMap::new();

/// Backend id `id`, if it still exists; `None` for 0, the id of no backend (what the
/// selection functions return when they find none).
#[inline(always)]
pub fn backend(id: u32) -> Option<Backend> {
    if id == 0 {
        return None;
    }
    // SAFETY: copied out at once, see `lb::lookup`.
    unsafe { BACKENDS.get(id).copied() }
}

/// (socket cookie, backend) -> frontend, for recvmsg: unconnected UDP sockets' peers
/// (connected sockets' are in `SOCK_NAT`); LRU so entries of closed sockets age out.
#[btf_map]
pub static REVNAT_SK: LruHashMap<RevNatKey, RevNatValue, { DEFAULT_MAX_SOCKETS as usize }> =
    LruHashMap::new();

/// Connected sockets' reverse-NAT entries by cookie slot; see `proxy_common::SOCK_NAT`.
#[btf_map]
pub static SOCK_NAT: Array<SockNat, { DEFAULT_MAX_SOCKETS as usize }> = Array::new();

/// socket cookie -> connected socket's entry whose slot was taken; see
/// `proxy_common::SOCK_NAT_OVERFLOW`.
#[btf_map]
pub static SOCK_NAT_OVERFLOW: HashMap<u64, SockNat, { DEFAULT_MAX_SOCKETS as usize / 4 }> =
    HashMap::new();

/// Overflow hints (entries in `SOCK_NAT_OVERFLOW`, an earlier version's entries in
/// `REVNAT_SK`); see `proxy_common::SOCK_NAT_SPILLED`.
#[btf_map]
pub static SOCK_NAT_SPILLED: Array<u32, 2> = Array::new();

/// `SOCK_NAT`'s slots - 1 (`proxy_common::SOCK_NAT_SLOT_MASK`), set by the agent at load;
/// a constant in `.rodata` for the verifier. Read with [`sock_nat_slot_mask`].
#[unsafe(no_mangle)]
static SOCK_NAT_SLOT_MASK: u64 = DEFAULT_MAX_SOCKETS as u64 - 1;

/// The value of [`SOCK_NAT_SLOT_MASK`] the agent set (a volatile read, so the compiler
/// does not fold in the default).
#[inline(always)]
pub fn sock_nat_slot_mask() -> u64 {
    // SAFETY: a plain read of an initialised static.
    unsafe { core::ptr::read_volatile(&SOCK_NAT_SLOT_MASK) }
}

/// (socket cookie, frontend) -> chosen backend for unconnected UDP.
#[btf_map]
pub static UDP_FLOWS: LruHashMap<UdpFlowKey, UdpFlow, { DEFAULT_MAX_SOCKETS as usize }> =
    LruHashMap::new();

/// socket cookie -> service id of connected UDP sockets whose endpoint left the service;
/// see `proxy_common::STALE_SOCKETS`.
#[btf_map]
pub static STALE_SOCKETS: LruHashMap<u64, u32, { DEFAULT_MAX_SOCKETS as usize }> =
    LruHashMap::new();

/// Data path configuration (index 0).
#[btf_map]
pub static CONFIG: Array<Config, 1> = Array::new();

/// Per-CPU counters indexed by `proxy_common::Counter`.
#[btf_map]
pub static COUNTERS: PerCpuArray<u64, { COUNTER_MAX as usize }> = PerCpuArray::new();

/// service id -> name; written by the agent for operators and restarts, never read here.
#[btf_map]
pub static SERVICE_NAMES: HashMap<u32, ServiceName, { DEFAULT_MAX_FRONTENDS as usize }> =
    HashMap::new();

/// (service id, backend id) -> weight; see `proxy_common::MEMBERS`. Not preallocated (its
/// size follows the slots actually used).
#[btf_map]
pub static MEMBERS: HashMap<
    MemberKey,
    u32,
    { DEFAULT_MAX_SLOTS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// service id -> Maglev table; see `proxy_common::MAGLEV`. Not preallocated: a table is
/// 256 KiB and only hashing services have one.
#[btf_map]
pub static MAGLEV: HashMap<
    u32,
    MaglevTable,
    { DEFAULT_MAX_MAGLEV as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Per-CPU round-robin cursors by service id; see `proxy_common::RR_CURSORS`.
#[btf_map]
pub static RR_CURSORS: PerCpuHashMap<
    u32,
    u32,
    { DEFAULT_MAX_FRONTENDS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

/// Active connections by backend id; see `proxy_common::LC_COUNTS`.
#[btf_map]
pub static LC_COUNTS: HashMap<
    u32,
    u32,
    { DEFAULT_MAX_BACKENDS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Connected sockets: cookie -> backend id (| counted bit); see `proxy_common::SOCKETS`.
#[btf_map]
pub static SOCKETS: LruHashMap<u64, u32, { DEFAULT_MAX_SOCKETS as usize }> = LruHashMap::new();

/// ClientIP session affinity; see `proxy_common::AFFINITY`.
#[btf_map]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityValue, { DEFAULT_MAX_SOCKETS as usize }> =
    LruHashMap::new();

/// Per-CPU counters by service id; see `proxy_common::SERVICE_STATS`. Not preallocated:
/// a preallocated per-CPU map allocates every element's per-CPU memory when it is created,
/// most of a start-up's map creation.
#[btf_map]
pub static SERVICE_STATS: PerCpuHashMap<
    u32,
    ServiceStats,
    { DEFAULT_MAX_FRONTENDS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

/// Owners of the per-CPU packet counter slots; see `proxy_common::PACKET_OWNERS`.
#[btf_map]
pub static PACKET_OWNERS: Array<u64, { PACKET_SLOTS as usize }> = Array::new();

/// Per-CPU packet counters by slot; see `proxy_common::SERVICE_PACKETS`.
#[btf_map]
pub static SERVICE_PACKETS: PerCpuArray<PacketCounts, { PACKET_SLOTS as usize }> =
    PerCpuArray::new();

/// Per-CPU connections by (service id, backend id); see `proxy_common::BACKEND_STATS`. Not
/// preallocated (see `SERVICE_STATS`).
#[btf_map]
pub static BACKEND_STATS: PerCpuHashMap<
    MemberKey,
    u64,
    { DEFAULT_MAX_SLOTS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = PerCpuHashMap::new();

/// Carried connection counts; see `proxy_common::STATS_CARRIED`. Written by the agent,
/// never read here.
#[btf_map]
pub static STATS_CARRIED: HashMap<
    MemberKey,
    u64,
    { DEFAULT_MAX_FRONTENDS as usize + DEFAULT_MAX_BACKENDS as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

// ---------------------------------------------------------------------------------------
// Workloads that bypass socket-level translation (see `proxy_common::bypass`)
// ---------------------------------------------------------------------------------------

/// Bypass configuration (index 0); see `proxy_common::bypass::BYPASS_CONFIG`.
#[btf_map]
pub static BYPASS_CONFIG: Array<BypassConfig, 1> = Array::new();

/// Network namespace cookie -> `BYPASS_POD` for pods opted out of socket-level
/// translation; see `proxy_common::bypass::BYPASS_NETNS`.
#[btf_map]
pub static BYPASS_NETNS: HashMap<u64, u32, { MAX_BYPASS_NETNS as usize }> = HashMap::new();

// ---------------------------------------------------------------------------------------
// The packet path (tc today): conntrack, SNAT, source ranges
// ---------------------------------------------------------------------------------------

/// Packet tuple -> rewritten tuple, both directions of every translated flow; see
/// `proxy_common::nat::CONNTRACK`.
#[btf_map]
pub static TC_CONNTRACK: LruHashMap<CtKey, CtEntry, { DEFAULT_MAX_CONNTRACK as usize }> =
    LruHashMap::new();

/// Endpoint address -> 1 for the endpoints running on this node.
#[btf_map]
pub static TC_LOCAL_ENDPOINTS: HashMap<[u8; 16], u32, { MAX_LOCAL_ENDPOINTS as usize }> =
    HashMap::new();

/// ifindex -> node address used to masquerade flows that arrived on it.
#[btf_map]
pub static TC_IFACE_ADDRS: HashMap<u32, IfaceAddr, { MAX_IFACES as usize }> = HashMap::new();

/// tc configuration (index 0).
#[btf_map]
pub static TC_CONFIG: Array<TcConfig, 1> = Array::new();

/// The conntrack clock (index 0); see `proxy_common::nat::CT_CLOCK`. Not pinned: one per
/// load, written by the agent before the load's programs are attached.
#[btf_map]
pub static TC_CT_CLOCK: Array<CtClock, 1> = Array::new();

/// Tail-call table of the tc programs; see `proxy_common::nat::TAILS`.
#[btf_map]
pub static TC_TAILS: ProgramArray<{ TAIL_SLOTS as usize }> = ProgramArray::new();

/// Per-CPU counters indexed by `proxy_common::nat::TcCounter`.
#[btf_map]
pub static TC_COUNTERS: PerCpuArray<u64, { TC_COUNTER_MAX as usize }> = PerCpuArray::new();

/// (LB IP, client) prefixes of `spec.loadBalancerSourceRanges`.
#[btf_map]
pub static TC_SOURCE_RANGES: LpmTrie<SourceRange, u32, { MAX_SOURCE_RANGES as usize }> =
    LpmTrie::new();

/// (frontend, backend) -> backend port of the direct server return flows this node
/// accepts encapsulated; see `proxy_common::nat::DSR`.
#[btf_map]
pub static TC_DSR: HashMap<
    DsrKey,
    DsrTarget,
    { MAX_DSR as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Original-direction key -> backend id of the tc flows counted for least-connections; see
/// `proxy_common::nat::LC_FLOWS`.
#[btf_map]
pub static TC_LC_FLOWS: HashMap<
    CtKey,
    u32,
    { DEFAULT_MAX_CONNTRACK as usize / 2 },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// One [`Scratch`] per CPU.
#[btf_map]
pub static TC_SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// Per-CPU next-hop cache of `fib::lookup`, direct-mapped (`fib::FIB_HOP_SLOTS` slots of
/// [`FibHop`]). Not pinned: one per load, never read by the agent.
#[btf_map]
pub static FIB_HOPS: PerCpuArray<FibHop, { FIB_HOP_SLOTS as usize }> = PerCpuArray::new();

// ---------------------------------------------------------------------------------------
// The event stream of `ebpf-proxy monitor` (see `proxy_common::monitor`)
// ---------------------------------------------------------------------------------------

/// Event records for the monitor; see `proxy_common::monitor::MONITOR_EVENTS`.
#[btf_map]
pub static MONITOR_EVENTS: RingBuf<MonitorEvent, { MONITOR_RING_BYTES as usize }> = RingBuf::new();

/// The monitor's lease and rate (index 0); see `proxy_common::monitor::MONITOR_CTL`.
#[btf_map]
pub static MONITOR_CTL: Array<MonitorCtl, 1> = Array::new();

/// Per-CPU token bucket and event counters; see `proxy_common::monitor::MONITOR_CPU`.
#[btf_map]
pub static MONITOR_CPU: PerCpuArray<MonitorCpu, 1> = PerCpuArray::new();

/// Per-CPU note of the last selection's ClientIP affinity outcome, `service id << 8 |
/// EVENT_F_AFFINITY_*`, written by `lb::select` while a monitor runs and taken by the
/// emitter of the same connection's event. Never read by the agent.
#[btf_map]
pub static MONITOR_AFFINITY: PerCpuArray<u64, 1> = PerCpuArray::new();
