//! The types every module shares, below the maps and the logic (as Katran's
//! `balancer_structs.h` comes before its maps and its program): what a hook asks of the
//! load balancer ([`Scope`], [`Request`]), what it gets back ([`Lookup`], [`Refusal`]), and
//! the per-CPU scratch space of a new flow ([`Scratch`]). Map layouts shared with the agent
//! are in `proxy-common`.

use proxy_common::{
    Backend, FRONTEND_F_LOCAL_ONLY, FRONTEND_F_NO_ENDPOINTS, Frontend,
    nat::{CtEntry, CtKey},
};

use crate::addr::L4Addr;

/// Which frontends a hook serves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Connections and flows that start on this node (the socket hooks): `SCOPE_NODE`
    /// frontends (cluster IPs, and external addresses and node ports with the Cluster
    /// endpoints, kube-proxy's short-circuit). A cluster IP's undefined port is refused.
    Node,
    /// Packets entering the node from outside (tc, XDP): `SCOPE_INGRESS` frontends (node
    /// ports, external and LB IPs with the `externalTrafficPolicy` endpoints), else a
    /// cluster IP routed to the node (kube-proxy serves those too). Undefined ports pass.
    Ingress,
}

/// What a destination is.
pub enum Lookup {
    /// Not a frontend: leave it alone.
    NotService,
    /// Refused before any endpoint is considered (a cluster IP's undefined port).
    Refused(Refusal),
    /// A frontend; `cluster_ip` when an [`Scope::Ingress`] lookup found a cluster IP (its
    /// masquerading rule differs, see `admit::needs_snat`).
    Frontend { fe: Frontend, cluster_ip: bool },
}

/// Why a connection, flow or packet gets no backend. Counted and answered per hook: the
/// socket hooks fail the syscall (ECONNREFUSED, or EHOSTUNREACH for
/// [`Refusal::NoLocalEndpoints`]: a connect() cannot be dropped silently), the packet hooks
/// drop.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The port or protocol is not defined on this cluster IP (kube-proxy's nftables mode
    /// rejects it).
    UndefinedPort,
    /// The Service has no endpoints (kube-proxy rejects).
    NoEndpoints,
    /// A `Local` traffic policy and no endpoint on this node while other nodes have some
    /// (kube-proxy drops; KEP-2086 for `internalTrafficPolicy`, KEP-1672 for
    /// `externalTrafficPolicy`).
    NoLocalEndpoints,
}

impl Refusal {
    /// Why frontend `fe` has no backend to give: a `Local` policy without local endpoints
    /// while other nodes have some, else no endpoints at all.
    #[inline(always)]
    pub fn no_backend(fe: &Frontend) -> Refusal {
        if fe.flags & (FRONTEND_F_LOCAL_ONLY | FRONTEND_F_NO_ENDPOINTS) == FRONTEND_F_LOCAL_ONLY {
            Refusal::NoLocalEndpoints
        } else {
            Refusal::NoEndpoints
        }
    }
}

/// A new connection or flow: the frontend it addressed and who opens it.
pub struct Request {
    /// The frontend (address IPv4-mapped, port, protocol).
    pub frontend: L4Addr,
    /// The client, for the selection policies that depend on it (source hashing, ClientIP
    /// affinity): the packet's source on the packet path; on the socket path the socket's
    /// bound source address, else its network namespace
    /// (`proxy_common::client_of_netns`), with the port zero when unknown.
    pub client: L4Addr,
}

/// The initial value of the backend `lb::select` writes (an all-zero entry, never a real
/// backend).
pub const NO_BACKEND: Backend = Backend {
    addr: [0; 16],
    port: [0; 2],
    proto: 0,
    flags: 0,
};

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
    pub req: Request,
    /// Service id whose counters the new flow's caller updates (0: none).
    pub count_sid: u32,
    /// Backend id chosen for it (0 when refused).
    pub count_bid: u32,
    /// 1 when the flow found no endpoint.
    pub count_refused: u32,
    /// 1 when the new flow is counted for the least-load algorithms (`TC_LC_FLOWS`).
    pub count_lc: u32,
    /// The monitor event of the new flow's decision (`monitor::word`; 0: none), emitted
    /// by the entry point.
    pub mon: u64,
    /// Service id of that decision (0 before the frontend is known).
    pub mon_sid: u32,
    /// Backend id of that decision (0: none).
    pub mon_bid: u32,
    /// For `tc_reject`: 0 to answer with a port unreachable; else the MTU to name in an
    /// ICMP "fragmentation needed" / ICMPv6 "packet too big" (a direct server return packet
    /// too big once encapsulated). Read and cleared by `tc_reject`.
    pub reject_mtu: u32,
    /// The outer destination (the backend) of the encapsulated packet being accepted.
    pub dsr_backend: [u8; 16],
    /// Its port (network byte order), from `TC_DSR`.
    pub dsr_port: [u8; 2],
}

/// A slot of the next-hop cache (`maps::FIB_HOPS`, see `fib::lookup`): the result of a
/// successful `bpf_fib_lookup` from `src` to `dst` (IPv4-mapped or IPv6, network byte
/// order) for a packet that arrived on `ifindex_in`, during conntrack clock tick `tick`
/// (`ct::tick`), for IP packets of at most `checked_len` bytes (the longest length the
/// lookup's MTU check passed). Empty while `ifindex_out` is 0. Never read by the agent.
#[repr(C)]
pub struct FibHop {
    /// Source address of the lookup.
    pub src: [u8; 16],
    /// Destination address of the lookup.
    pub dst: [u8; 16],
    /// Interface the looked-up packet arrived on.
    pub ifindex_in: u32,
    /// Output interface of the route (0: empty slot).
    pub ifindex_out: u32,
    /// The output interface's MAC address.
    pub smac: [u8; 6],
    /// The next hop's MAC address.
    pub dmac: [u8; 6],
    /// The longest IP packet, in bytes, the route's MTU check passed.
    pub checked_len: u16,
    /// Explicit padding (zero).
    pub _pad: u16,
    /// The tick of the lookup; the slot serves that tick only.
    pub tick: u32,
    /// Explicit padding (zero).
    pub _pad2: u32,
}
