//! Map definitions. Names, key and value types come from `proxy_common`; the sizes here are
//! the defaults and the agent overrides them at load time (`EbpfLoader::map_max_entries`).

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, HashMap, LruHashMap, LruPerCpuHashMap, PerCpuArray, PerCpuHashMap},
    macros::btf_map,
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlotKey, COUNTER_MAX, Config, DEFAULT_MAX_BACKENDS,
    DEFAULT_MAX_FRONTENDS, DEFAULT_MAX_MAGLEV, DEFAULT_MAX_SLOTS, DEFAULT_MAX_SOCKETS, Frontend,
    FrontendKey, MaglevTable, MemberKey, RevNatKey, RevNatValue, ServiceName, ServiceStats,
    UdpFlow, UdpFlowKey,
};

/// (VIP, port, protocol) -> frontend; see `proxy_common::FRONTENDS`.
#[btf_map]
pub static FRONTENDS: HashMap<FrontendKey, Frontend, { DEFAULT_MAX_FRONTENDS as usize }> =
    HashMap::new();

/// (service id, slot) -> backend id; see `proxy_common::BACKEND_SLOTS`.
#[btf_map]
pub static BACKEND_SLOTS: HashMap<BackendSlotKey, u32, { DEFAULT_MAX_SLOTS as usize }> =
    HashMap::new();

/// backend id -> (address, port); see `proxy_common::BACKENDS`.
#[btf_map]
pub static BACKENDS: HashMap<u32, Backend, { DEFAULT_MAX_BACKENDS as usize }> = HashMap::new();

/// (socket cookie, backend) -> frontend, for getpeername/recvmsg; LRU so entries of
/// closed sockets age out.
#[btf_map]
pub static REVNAT_SK: LruHashMap<RevNatKey, RevNatValue, { DEFAULT_MAX_SOCKETS as usize }> =
    LruHashMap::new();

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

/// (service id, backend id) -> present; see `proxy_common::MEMBERS`. Not preallocated (its
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

/// Per-CPU counters by service id; see `proxy_common::SERVICE_STATS`.
#[btf_map]
pub static SERVICE_STATS: LruPerCpuHashMap<u32, ServiceStats, { DEFAULT_MAX_FRONTENDS as usize }> =
    LruPerCpuHashMap::new();

/// Per-CPU connections by backend id; see `proxy_common::BACKEND_STATS`.
#[btf_map]
pub static BACKEND_STATS: LruPerCpuHashMap<u32, u64, { DEFAULT_MAX_BACKENDS as usize }> =
    LruPerCpuHashMap::new();
