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
//! (service id, slot) for slot in `0..count` to a backend id; [`BACKENDS`] maps a backend id
//! to its (address, port). The agent writes a service in this order: backends, new slots,
//! then the frontend (count), and removes stale slots and backends last, so a reader never
//! sees a slot index without a backend behind it.

#![no_std]

pub mod nat;

/// IANA protocol number of TCP.
pub const PROTO_TCP: u8 = 6;
/// IANA protocol number of UDP.
pub const PROTO_UDP: u8 = 17;

/// Name of the frontend map: [`FrontendKey`] -> [`Frontend`] (BPF_MAP_TYPE_HASH).
pub const FRONTENDS: &str = "FRONTENDS";
/// Name of the slot map: [`BackendSlotKey`] -> backend id `u32` (BPF_MAP_TYPE_HASH).
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

/// Name of the stale-socket map: socket cookie `u64` -> service id `u32`
/// (BPF_MAP_TYPE_LRU_HASH). The agent adds a connected UDP socket here when the endpoint it
/// was translated to leaves its service; the egress program then fails the socket's sends
/// (EPERM) until the application connects it again, which picks a live endpoint and
/// removes the entry. kube-proxy deletes the socket's UDP conntrack entries for the same
/// reason (KEP-1669, "stale UDP flows").
pub const STALE_SOCKETS: &str = "STALE_SOCKETS";

/// Name of the service name map: service id `u32` -> [`ServiceName`] (BPF_MAP_TYPE_HASH).
/// Not read by the data path: it lets `ebpf-proxy services` name what it prints while the
/// agent is down, and lets a restarted agent re-bind service ids to Services exactly.
pub const SERVICE_NAMES: &str = "SERVICE_NAMES";

/// Every map the agent pins, in the order the data path depends on them.
pub const ALL_MAPS: [&str; 9] = [
    FRONTENDS,
    BACKEND_SLOTS,
    BACKENDS,
    REVNAT_SK,
    UDP_FLOWS,
    STALE_SOCKETS,
    CONFIG,
    COUNTERS,
    SERVICE_NAMES,
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

/// Frontend value. 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Frontend {
    /// Id of the backend set (one per Service port x protocol x family); key of
    /// [`BACKEND_SLOTS`]. 0 for a VIP marker.
    pub service_id: u32,
    /// Number of valid slots `0..backend_count`; 0 means "no endpoints: refuse".
    pub backend_count: u32,
    /// `FRONTEND_F_*` bits.
    pub flags: u32,
    /// Reserved; always 0.
    pub _pad: u32,
}

/// Slot key: (service id, slot index). 8 bytes. Value: backend id (`u32`, host order).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BackendSlotKey {
    /// [`Frontend::service_id`].
    pub service_id: u32,
    /// Slot index, `0..Frontend::backend_count`.
    pub slot: u32,
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
/// Written by `connect4/6` and `sendmsg4/6` when they translate a VIP; read by
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

/// [`RevNatValue::flags`] bit: translated by `connect()` (a TCP connection or a connected UDP
/// socket), as opposed to a `sendmsg()` of an unconnected UDP socket.
pub const REVNAT_F_CONNECTED: u8 = 1 << 0;

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
    /// A reverse-NAT or flow entry could not be written (map full).
    MapUpdateFailed = 4,
    /// getpeername()/recvmsg() rewritten back to the VIP.
    ReverseTranslated = 5,
    /// Failed with EHOSTUNREACH: a `Local` traffic policy and no endpoint on this node.
    DroppedNoLocalEndpoints = 6,
    /// A send of a connected UDP socket failed: its endpoint left the service.
    DroppedStaleSocket = 7,
}

impl Counter {
    /// Every counter, in index order, with its Prometheus-style name.
    pub const ALL: [(Counter, &'static str); 8] = [
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
    ];
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
    unsafe impl aya::Pod for RevNatKey {}
    unsafe impl aya::Pod for RevNatValue {}
    unsafe impl aya::Pod for UdpFlowKey {}
    unsafe impl aya::Pod for UdpFlow {}
    unsafe impl aya::Pod for Config {}
    unsafe impl aya::Pod for ServiceName {}
}

// Layout checks: the kernel and user builds must agree byte for byte.
const _: () = {
    assert!(core::mem::size_of::<FrontendKey>() == 20);
    assert!(core::mem::size_of::<Frontend>() == 16);
    assert!(core::mem::size_of::<BackendSlotKey>() == 8);
    assert!(core::mem::size_of::<Backend>() == 20);
    assert!(core::mem::size_of::<RevNatKey>() == 32);
    assert!(core::mem::size_of::<RevNatValue>() == 24);
    assert!(core::mem::size_of::<UdpFlowKey>() == 32);
    assert!(core::mem::size_of::<UdpFlow>() == 32);
    assert!(core::mem::size_of::<Config>() == 16);
    assert!(core::mem::size_of::<ServiceName>() == 256);
};
