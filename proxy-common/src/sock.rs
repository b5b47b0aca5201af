//! Layouts of the socket path's own state: the reverse-NAT entries that let
//! `getpeername()` and `recvmsg()` show the frontend a socket addressed (one slot per
//! connected socket, an overflow map, and the unconnected UDP sends' map), the
//! unconnected-UDP flows, the stale UDP sockets and the socket path's configuration. Same
//! conventions as the crate root.

// Items of sibling modules the doc comments link to.
#[cfg(doc)]
use crate::{Frontend, PROTO_TCP, PROTO_UDP, SOCKETS};

/// Name of the socket reverse-NAT map: [`RevNatKey`] -> [`RevNatValue`]
/// (BPF_MAP_TYPE_LRU_HASH; entries age out with their sockets).
pub const REVNAT_SK: &str = "REVNAT_SK";
/// Name of the unconnected-UDP flow map: [`UdpFlowKey`] -> [`UdpFlow`] (BPF_MAP_TYPE_LRU_HASH).
pub const UDP_FLOWS: &str = "UDP_FLOWS";
/// Name of the configuration map: index 0 -> [`Config`] (BPF_MAP_TYPE_ARRAY, one entry).
pub const CONFIG: &str = "CONFIG";

/// Name of the stale-socket map: socket cookie `u64` -> service id `u32`
/// (BPF_MAP_TYPE_LRU_HASH). The agent adds a connected UDP socket here when the endpoint it
/// was translated to leaves its service, attaching the egress program first; the egress
/// program then fails the socket's sends (EPERM) until the application connects it again,
/// which picks a live endpoint and removes the entry (closing it removes it too). The agent
/// detaches the egress program when the map is empty. kube-proxy deletes the socket's UDP
/// conntrack entries for the same reason (KEP-1669, "stale UDP flows").
pub const STALE_SOCKETS: &str = "STALE_SOCKETS";

/// Default `max_entries` of [`REVNAT_SK`], [`UDP_FLOWS`] and [`STALE_SOCKETS`] (LRU, per
/// socket or flow).
pub const DEFAULT_MAX_SOCKETS: u32 = 262144;

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

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all types are #[repr(C)], contain only integers and explicit padding fields,
    // and are valid for every bit pattern.
    unsafe impl aya::Pod for RevNatKey {}
    unsafe impl aya::Pod for RevNatValue {}
    unsafe impl aya::Pod for SockNat {}
    unsafe impl aya::Pod for UdpFlowKey {}
    unsafe impl aya::Pod for UdpFlow {}
    unsafe impl aya::Pod for Config {}
}

// Layout checks: the kernel and user builds must agree byte for byte.
const _: () = {
    assert!(core::mem::size_of::<RevNatKey>() == 32);
    assert!(core::mem::size_of::<RevNatValue>() == 24);
    assert!(core::mem::size_of::<SockNat>() == 56);
    assert!(sock_nat_slots(0) == 1 && sock_nat_slots(1) == 1 && sock_nat_slots(3) == 2);
    assert!(sock_nat_slots(DEFAULT_MAX_SOCKETS) == DEFAULT_MAX_SOCKETS);
    assert!(sock_nat_slots(300_000) == 262_144 && sock_nat_slots(u32::MAX) == 1 << 31);
    assert!(core::mem::size_of::<UdpFlowKey>() == 32);
    assert!(core::mem::size_of::<UdpFlow>() == 32);
    assert!(core::mem::size_of::<Config>() == 16);
};
