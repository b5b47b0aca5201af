//! Layouts of the service maps: frontends (VIP, port, protocol, scope), the slots of each
//! backend set, the backends, and the names of the service ids. Same conventions as the
//! crate root: `#[repr(C)]`, explicit padding, addresses `[u8; 16]` in network byte order
//! (IPv4 stored IPv4-mapped), ports `[u8; 2]` in network byte order. The order in which
//! the agent writes them is the crate root's "Service layout".

// Items of sibling modules the doc comments link to.
#[cfg(doc)]
use crate::{AffinityKey, Algorithm, Counter, PROTO_TCP, PROTO_UDP};

/// Name of the frontend map: [`FrontendKey`] -> [`Frontend`] (BPF_MAP_TYPE_HASH).
pub const FRONTENDS: &str = "FRONTENDS";
/// Name of the slot map: [`BackendSlotKey`] -> [`BackendSlot`] (BPF_MAP_TYPE_HASH).
pub const BACKEND_SLOTS: &str = "BACKEND_SLOTS";
/// Name of the backend map: backend id `u32` -> [`Backend`] (BPF_MAP_TYPE_HASH).
pub const BACKENDS: &str = "BACKENDS";

/// Name of the service name map: service id `u32` -> [`ServiceName`] (BPF_MAP_TYPE_HASH).
/// Not read by the data path: it lets `ebpf-proxy services` name what it prints while the
/// agent is down, and lets a restarted agent re-bind service ids to Services exactly.
pub const SERVICE_NAMES: &str = "SERVICE_NAMES";

/// Default `max_entries` of [`FRONTENDS`] (one per VIP x port x protocol, plus one
/// VIP marker per VIP). The agent may override it (`--max-frontends`).
pub const DEFAULT_MAX_FRONTENDS: u32 = 65536;
/// Default `max_entries` of [`BACKEND_SLOTS`] (sum of backend counts over service ids).
pub const DEFAULT_MAX_SLOTS: u32 = 262144;
/// Default `max_entries` of [`BACKENDS`] (distinct endpoint address x port x protocol).
pub const DEFAULT_MAX_BACKENDS: u32 = 131072;

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
    unsafe impl aya::Pod for ServiceName {}
}

// Layout checks: the kernel and user builds must agree byte for byte.
const _: () = {
    assert!(core::mem::size_of::<FrontendKey>() == 20);
    assert!(core::mem::size_of::<Frontend>() == 24);
    assert!(core::mem::size_of::<BackendSlotKey>() == 8);
    assert!(core::mem::size_of::<Backend>() == 20);
    assert!(core::mem::size_of::<BackendSlot>() == 24);
    assert!(core::mem::size_of::<ServiceName>() == 256);
};
