//! Layouts of the data-path event stream read by `ebpf-proxy monitor`. Same conventions as
//! the crate root: `#[repr(C)]`, explicit padding, addresses `[u8; 16]` in network byte
//! order (IPv4 stored IPv4-mapped), ports `[u8; 2]` in network byte order.
//!
//! Every program emits a [`MonitorEvent`] at its decision points (a translation, a refusal
//! or drop with its reason, a reverse translation, a stale-socket repair, a new packet flow
//! with its SNAT port, a flow end, an ICMP error translation) into the ring buffer
//! [`MONITOR_EVENTS`], but only while a monitor holds the lease in [`MONITOR_CTL`]:
//! - without a monitor the cost is one array lookup and one compare per decision point
//!   (`expiry_ns` is 0);
//! - a monitor writes `expiry_ns` = now + a few seconds (`bpf_ktime_get_ns`'s clock,
//!   `CLOCK_MONOTONIC`) and refreshes it every second; the programs emit while
//!   now < `expiry_ns`, so a monitor that crashed stops the stream within seconds, and a
//!   monitor that exits cleanly writes 0;
//! - while one runs, each CPU emits at most `rate` events per second with bursts of
//!   `burst` (a token bucket in [`MONITOR_CPU`]); events over the rate, and events the
//!   ring buffer had no room for, are counted per CPU in [`MonitorCpu`] rather than
//!   silently lost, and the monitor reports them.

/// Name of the event ring buffer (BPF_MAP_TYPE_RINGBUF, [`MONITOR_RING_BYTES`] bytes) of
/// [`MonitorEvent`] records.
pub const MONITOR_EVENTS: &str = "MONITOR_EVENTS";
/// Name of the monitor control map: index 0 -> [`MonitorCtl`] (BPF_MAP_TYPE_ARRAY, one
/// entry). Written by the monitor only.
pub const MONITOR_CTL: &str = "MONITOR_CTL";
/// Name of the per-CPU monitor state: index 0 -> [`MonitorCpu`]
/// (BPF_MAP_TYPE_PERCPU_ARRAY, one entry): the token bucket and the counters.
pub const MONITOR_CPU: &str = "MONITOR_CPU";

/// Every map of the event stream, pinned next to the others.
pub const MONITOR_MAPS: [&str; 3] = [MONITOR_EVENTS, MONITOR_CTL, MONITOR_CPU];

/// Size of [`MONITOR_EVENTS`] in bytes (a power of two and a multiple of the page size, as
/// the kernel requires): 2048 records of [`MonitorEvent`] (120 bytes each with an 8-byte header).
pub const MONITOR_RING_BYTES: u32 = 256 * 1024;

/// Default events per second and CPU while a monitor runs.
pub const MONITOR_DEFAULT_RATE: u32 = 1000;
/// Default burst, in events per CPU.
pub const MONITOR_DEFAULT_BURST: u32 = 200;

/// The monitor lease and rate, index 0 of [`MONITOR_CTL`]. 24 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MonitorCtl {
    /// Events are emitted while `bpf_ktime_get_ns()` < this (ns since boot,
    /// `CLOCK_MONOTONIC`); 0: no monitor runs.
    pub expiry_ns: u64,
    /// Nanoseconds of credit one event costs (1e9 / events per second per CPU); 0 means
    /// no rate limit.
    pub cost_ns: u64,
    /// Largest credit a CPU accumulates, in nanoseconds (burst x `cost_ns`).
    pub max_credit_ns: u64,
}

/// Per-CPU state of the event stream, index 0 of [`MONITOR_CPU`]. Counters only grow
/// (since the map was created); readers take differences. 48 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MonitorCpu {
    /// Token bucket credit in nanoseconds (see [`MonitorCtl::cost_ns`]).
    pub credit_ns: u64,
    /// `bpf_ktime_get_ns()` of the last credit update.
    pub last_ns: u64,
    /// Events written to the ring buffer.
    pub emitted: u64,
    /// Events not emitted because this CPU was over the rate.
    pub rate_limited: u64,
    /// Events not emitted because the ring buffer was full (the monitor reads too slowly).
    pub ring_full: u64,
    /// Nanoseconds spent emitting events (from the lease check to the ring buffer write):
    /// the data path's cost of the monitor.
    pub emit_ns: u64,
}

/// What an event reports ([`MonitorEvent::kind`]).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    /// A socket's connect() or sendmsg() to a frontend was translated to a backend.
    SockTranslate = 1,
    /// A socket's connect() or sendmsg() was refused ([`MonitorEvent::reason`]).
    SockRefuse = 2,
    /// recvmsg()/getpeername() showed the frontend instead of the backend.
    SockReverse = 3,
    /// A send of a connected UDP socket whose endpoint left was dropped.
    StaleDrop = 4,
    /// A packet started a translated flow (tc); with [`EVENT_F_SNAT`], the SNAT address and
    /// port in [`MonitorEvent::nat`].
    FlowNew = 5,
    /// A packet that would start a flow was dropped ([`MonitorEvent::reason`]).
    FlowDrop = 6,
    /// A flow ended: a tracked TCP flow closed (FIN both ways or RST; no reason), or a
    /// connected UDP socket's translation went with the socket
    /// ([`EventReason::SocketClosed`]).
    FlowEnd = 7,
    /// An ICMP or ICMPv6 error quoting a translated packet was translated.
    IcmpTranslate = 8,
}

impl EventKind {
    /// Every kind with its name (as the monitor prints and filters it).
    pub const ALL: [(EventKind, &'static str); 8] = [
        (EventKind::SockTranslate, "translate"),
        (EventKind::SockRefuse, "refuse"),
        (EventKind::SockReverse, "reverse"),
        (EventKind::StaleDrop, "stale-drop"),
        (EventKind::FlowNew, "flow-new"),
        (EventKind::FlowDrop, "flow-drop"),
        (EventKind::FlowEnd, "flow-end"),
        (EventKind::IcmpTranslate, "icmp"),
    ];

    /// The kind numbered `v`.
    pub fn from_u8(v: u8) -> Option<EventKind> {
        Self::ALL
            .iter()
            .find(|(k, _)| *k as u8 == v)
            .map(|(k, _)| *k)
    }

    /// The kind's name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(k, _)| *k == self)
            .map_or("?", |(_, n)| n)
    }
}

/// Why an event's connection or packet got no backend ([`MonitorEvent::reason`]); 0 for
/// events that are not refusals or drops.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventReason {
    /// Not a refusal.
    None = 0,
    /// The Service has no endpoints.
    NoEndpoints = 1,
    /// The port or protocol is not defined on the cluster IP.
    UndefinedPort = 2,
    /// A `Local` traffic policy and no endpoint on this node.
    NoLocalEndpoints = 3,
    /// The connected UDP socket's endpoint left the Service.
    StaleSocket = 4,
    /// The client is outside the LB IP's `loadBalancerSourceRanges`.
    SourceRange = 5,
    /// No SNAT address on the interface.
    NoSnatAddress = 6,
    /// No free SNAT port.
    SnatPortsExhausted = 7,
    /// A conntrack entry could not be written.
    ConntrackFull = 8,
    /// The backend is of the other address family, or a rewrite failed.
    RewriteFailed = 9,
    /// The socket was closed (released): its translation state went with it.
    SocketClosed = 10,
}

impl EventReason {
    /// Every reason with its name (as the monitor prints and filters it).
    pub const ALL: [(EventReason, &'static str); 11] = [
        (EventReason::None, ""),
        (EventReason::NoEndpoints, "no-endpoints"),
        (EventReason::UndefinedPort, "undefined-port"),
        (EventReason::NoLocalEndpoints, "no-local-endpoints"),
        (EventReason::StaleSocket, "stale-socket"),
        (EventReason::SourceRange, "source-range"),
        (EventReason::NoSnatAddress, "no-snat-address"),
        (EventReason::SnatPortsExhausted, "snat-ports-exhausted"),
        (EventReason::ConntrackFull, "conntrack-full"),
        (EventReason::RewriteFailed, "rewrite-failed"),
        (EventReason::SocketClosed, "socket-closed"),
    ];

    /// The reason numbered `v`.
    pub fn from_u8(v: u8) -> Option<EventReason> {
        Self::ALL
            .iter()
            .find(|(k, _)| *k as u8 == v)
            .map(|(k, _)| *k)
    }

    /// The reason's name ("" for [`EventReason::None`]).
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(k, _)| *k == self)
            .map_or("?", |(_, n)| n)
    }
}

/// [`MonitorEvent::flags`]: the backend came from a fresh ClientIP affinity entry.
pub const EVENT_F_AFFINITY_HIT: u8 = 1;
/// The frontend has ClientIP affinity and no fresh entry was found (the algorithm chose).
pub const EVENT_F_AFFINITY_MISS: u8 = 2;
/// The connect() repaired a stale connected UDP socket (its endpoint had left).
pub const EVENT_F_STALE_REPAIRED: u8 = 4;
/// The flow is source-NATed to [`MonitorEvent::nat`].
pub const EVENT_F_SNAT: u8 = 8;
/// The event comes from recvmsg() (else getpeername()), for [`EventKind::SockReverse`]; the
/// event is an unconnected UDP datagram (sendmsg()), for [`EventKind::SockTranslate`].
pub const EVENT_F_DATAGRAM: u8 = 16;
/// A packet tuple event ([`EventKind::FlowEnd`], [`EventKind::IcmpTranslate`]): `client` ->
/// `frontend` is the tuple of the entry that matched, `nat` -> `backend` what it rewrites
/// the packet to.
pub const EVENT_F_TUPLE: u8 = 32;
/// [`EventKind::FlowNew`]: the flow goes by direct server return (sent encapsulated to a
/// backend on another node, which answers the client itself; see
/// `crate::nat::DSR`).
pub const EVENT_F_DSR: u8 = 64;

/// [`MonitorEvent::hook`]: which program emitted the event.
pub const HOOK_SOCK: u8 = 1;
/// The cgroup skb egress program.
pub const HOOK_SKB: u8 = 2;
/// The tcx ingress program.
pub const HOOK_TC_INGRESS: u8 = 3;
/// The tcx egress program.
pub const HOOK_TC_EGRESS: u8 = 4;
/// The XDP program (`--xdp`): flows it starts, ends or drops.
pub const HOOK_XDP: u8 = 5;

/// One data-path event. 120 bytes (128 with the ring buffer's record header). Fields a kind has no value for are zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct MonitorEvent {
    /// `bpf_ktime_get_ns()` at emission (ns since boot, `CLOCK_MONOTONIC`).
    pub ts_ns: u64,
    /// Socket cookie (socket events), else 0.
    pub cookie: u64,
    /// Network namespace cookie of the socket (socket events), else 0.
    pub netns: u64,
    /// cgroup v2 id of the process (connect/sendmsg events), else 0.
    pub cgroup: u64,
    /// The client: the packet's source, or the socket's bound address, else the address
    /// the Service sees for the socket's network namespace (`crate::client_of_netns`); all
    /// zero when not known yet.
    pub client: [u8; 16],
    /// The frontend (VIP) the client addressed.
    pub frontend: [u8; 16],
    /// The backend chosen (all zero when refused).
    pub backend: [u8; 16],
    /// The SNAT address ([`EVENT_F_SNAT`]), or the rewritten source of a tuple event.
    pub nat: [u8; 16],
    /// Client port (0 when not known).
    pub client_port: [u8; 2],
    /// Frontend port.
    pub frontend_port: [u8; 2],
    /// Backend port.
    pub backend_port: [u8; 2],
    /// SNAT port, or the rewritten source port of a tuple event.
    pub nat_port: [u8; 2],
    /// [`crate::Frontend::service_id`] (0 when unknown: an undefined port has no Service
    /// port).
    pub service_id: u32,
    /// Backend id (0 when refused).
    pub backend_id: u32,
    /// [`EventKind`] as a number.
    pub kind: u8,
    /// [`EventReason`] as a number.
    pub reason: u8,
    /// IANA protocol number.
    pub proto: u8,
    /// [`crate::Algorithm`] of the frontend as a number (0xff when not known).
    pub algorithm: u8,
    /// `EVENT_F_*` bits.
    pub flags: u8,
    /// `HOOK_*`.
    pub hook: u8,
    /// Reserved; always 0.
    pub _pad: [u8; 2],
}

/// [`MonitorEvent::algorithm`] when the algorithm is not known.
pub const ALGORITHM_UNKNOWN: u8 = 0xff;

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: #[repr(C)], integers and explicit padding only, valid for every bit pattern.
    unsafe impl aya::Pod for MonitorCtl {}
    unsafe impl aya::Pod for MonitorCpu {}
    unsafe impl aya::Pod for MonitorEvent {}
}

const _: () = {
    assert!(core::mem::size_of::<MonitorCtl>() == 24);
    assert!(core::mem::size_of::<MonitorCpu>() == 48);
    assert!(core::mem::size_of::<MonitorEvent>() == 120);
};
