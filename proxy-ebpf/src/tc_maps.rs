//! Maps of the tc (north-south) data path. Names, layouts and sizes come from
//! `proxy_common::nat`; the agent may override `TC_CONNTRACK`'s size at load time.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
    macros::btf_map,
};
use proxy_common::nat::{
    CtEntry, CtKey, DEFAULT_MAX_CONNTRACK, IfaceAddr, MAX_IFACES, MAX_LOCAL_ENDPOINTS,
    MAX_SOURCE_RANGES, SourceRange, TC_COUNTER_MAX, TcConfig,
};

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

/// Per-CPU counters indexed by `proxy_common::nat::TcCounter`.
#[btf_map]
pub static TC_COUNTERS: PerCpuArray<u64, { TC_COUNTER_MAX as usize }> = PerCpuArray::new();

/// (LB IP, client) prefixes of `spec.loadBalancerSourceRanges`.
#[btf_map]
pub static TC_SOURCE_RANGES: LpmTrie<SourceRange, u32, { MAX_SOURCE_RANGES as usize }> =
    LpmTrie::new();

/// Original-direction key -> backend id of the tc flows counted for least-connections; see
/// `proxy_common::nat::LC_FLOWS`.
#[btf_map]
pub static TC_LC_FLOWS: HashMap<
    CtKey,
    u32,
    { DEFAULT_MAX_CONNTRACK as usize / 2 },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Per-CPU scratch space of a new flow (the two entries and the reply key do not fit the
/// 512-byte BPF stack next to everything else). Never read by the agent.
#[repr(C)]
pub struct Scratch {
    /// Original-direction entry being built.
    pub fwd: CtEntry,
    /// Reply-direction entry being built.
    pub rev: CtEntry,
    /// Reply key (the SNAT binding being tried).
    pub rkey: CtKey,
    /// Key of the SNAT stage (client -> backend, on egress).
    pub ekey: CtKey,
    /// Entry of the SNAT stage.
    pub eg: CtEntry,
    /// FIB lookup of a reply sent out directly.
    pub fib: aya_ebpf::bindings::bpf_fib_lookup,
    /// The selection request of a new flow.
    pub req: crate::lb::Request,
    /// Service id whose counters the new flow's caller updates (0: none).
    pub count_sid: u32,
    /// Backend id chosen for it (0 when refused).
    pub count_bid: u32,
    /// 1 when the flow found no endpoint.
    pub count_refused: u32,
    /// 1 when the new flow is counted for least-connections (`TC_LC_FLOWS`).
    pub count_lc: u32,
}

/// One [`Scratch`] per CPU.
#[btf_map]
pub static TC_SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();
