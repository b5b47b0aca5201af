//! The desired-state model: the one reader of Kubernetes objects. Services, EndpointSlices
//! and this node's Node object arrive as changes ([`Change`]); each is read once, into the
//! model's own types, and a change that reads the same as before is dropped (as kube-proxy's
//! change trackers drop no-op updates). [`Model::commit`] then recomputes only the Services
//! the changes touched and reports which backend sets and node facts changed ([`Delta`]).
//! No I/O, no aya; deterministic (the same objects always give the same state and errors,
//! whatever order the changes came in).
//!
//! Concerns, one module each: [`service`] (a Service's frontends, policies, selection),
//! [`endpoints`] (slices, endpoint conditions, topology categorization), [`node`] (this
//! node's addresses and zone), [`frontends`] (ownership of contested frontends) and
//! [`explain`] (why an endpoint is or is not used).
//!
//! Rules (kube-proxy semantics; where its modes differ, the nftables mode of KEP-3866):
//!
//! Which objects are read
//! - Services and EndpointSlices labelled `service.kubernetes.io/service-proxy-name` (any
//!   value: meant for another proxy, KEP-2447) or `service.kubernetes.io/headless` (the
//!   EndpointSlice controller's label on the slices of headless Services) are treated as
//!   absent, as kube-proxy's label selector on its watches ([`PROXY_LABEL_SELECTOR`])
//!   filters them out: gaining the label removes what they gave, losing it brings them
//!   back. The API source sends the same selector to the API server; the rule here applies
//!   it to every source (manifests too). kube-proxy has no setting to choose a proxy name
//!   of its own, so neither has ebpf-proxy.
//!
//! Services
//! - Frontends are the addresses of `spec.clusterIPs`, or `spec.clusterIP` when
//!   `clusterIPs` is empty, for every `type` except `ExternalName`. Headless Services
//!   (`clusterIP: None`), `ExternalName` Services and Services without any cluster IP are
//!   ignored without error.
//! - Each `spec.ports[]` entry gives one backend set per cluster IP family, identified by a
//!   [`ServicePortKey`] (namespace, name, port name, protocol, family). A missing protocol
//!   is TCP. SCTP ports are skipped with one error each ("SCTP is not supported"); the other
//!   ports of the Service still work.
//! - A Service is skipped as a whole, with one error, when: a cluster IP does not parse or
//!   is unspecified, loopback, multicast or broadcast (a frontend there would hijack node
//!   traffic); `clusterIP` is set and differs from `clusterIPs[0]`; two cluster IPs have the
//!   same family; a port is 0 or above 65535; a port/protocol pair or a port name appears
//!   twice; a protocol is not TCP, UDP or SCTP; or one of its frontends (VIP, port,
//!   protocol) is already used by another Service (the oldest Service keeps it, see
//!   [`frontends`]).
//! - A Service without ports has no frontends.
//! - External addresses: every `spec.externalIPs` entry and every
//!   `status.loadBalancer.ingress[].ip` whose `ipMode` is unset or `VIP` (KEP-1860: with
//!   `Proxy` the load balancer proxies to the nodes) is a frontend on every Service port,
//!   in a backend set of scope [`Scope::External`]. An address that does not parse or is
//!   unusable, whose family has no cluster IP, or whose frontend belongs to another Service
//!   is skipped alone with an error. Seen from this node (the only traffic the socket
//!   programs see) they use the Cluster endpoints whatever `externalTrafficPolicy` says:
//!   kube-proxy short-circuits traffic from inside the cluster to external addresses.
//! - `internalTrafficPolicy: Local` (KEP-2086) gives the cluster IPs only this node's
//!   endpoints, flagged `FRONTEND_F_LOCAL_ONLY` (with none, the data path fails with
//!   EHOSTUNREACH where kube-proxy drops). When the Service port has no usable endpoint on
//!   any node the frontend is also flagged `FRONTEND_F_NO_ENDPOINTS`: kube-proxy rejects
//!   that whatever the policy (ECONNREFUSED at the socket, an ICMP error from tc). A policy other than `Cluster`/`Local` skips the
//!   Service with an error.
//!
//! Endpoints
//! - An EndpointSlice belongs to the Service named by its `kubernetes.io/service-name`
//!   label in the same namespace; slices without the label are ignored. This is the only
//!   link, so selectorless Services with hand-made slices work the same way.
//! - `addressType` `IPv4`/`IPv6` feed the backends of that family; `FQDN` slices are
//!   ignored; any other address type skips the slice with an error.
//! - Conditions: `ready` and `serving` unset mean true (the EndpointSlice API: "unknown
//!   state should be interpreted as ready"), `terminating` unset means false. Which
//!   endpoints a set gets is kube-proxy's `CategorizeEndpoints` ([`categorize`]): ready
//!   ones, narrowed by topology hints (`hints.forNodes`, then `hints.forZones` against the
//!   `topology.kubernetes.io/zone` label of this node's Node object) when every ready
//!   endpoint has one and one matches; when no endpoint is ready, the serving and
//!   terminating ones (KEP-1669); for Local sets the same on this node's endpoints
//!   (`nodeName`). Only an endpoint's first address (`addresses[0]`) is used, as
//!   kube-proxy does; an address in two slices is taken from the first (in slice name
//!   order), unless a later one is on this node. An address that does not parse or whose
//!   family is not the slice's skips that endpoint with an error; the rest of the slice is
//!   used. An endpoint without addresses is skipped with an error.
//! - Slice ports: a missing name is `""`, a missing protocol TCP (the API server's
//!   defaults). A port that is missing, 0 or above 65535, or whose protocol is not TCP,
//!   UDP or SCTP, is skipped with an error. SCTP slice ports are ignored silently (the
//!   Service port reports it).
//! - targetPort resolution is kube-proxy's: a Service port takes the slice ports with the
//!   same name and protocol (the EndpointSlice controller names slice ports after Service
//!   ports and has already resolved named and numeric targetPorts per endpoint). One
//!   Service port may thus reach different container ports on different slices, even on
//!   the same IP. All slices of a Service are merged and backends deduplicated by
//!   (address, port).
//! - A backend set of a family with a frontend but no endpoints has empty backends (the
//!   data path refuses with ECONNREFUSED). Endpoints of a family the Service has no
//!   cluster IP of are dropped.
//!
//! North-south facts (for the tc path and the health-check servers)
//! - Node: the usable `InternalIP`/`ExternalIP` addresses of this node's Node object pick
//!   the external interfaces and their SNAT addresses; those inside `--nodeport-addresses`
//!   (or the first `InternalIP` per family with `primary`) serve node ports ([`NodeState`]).
//! - Local endpoints: every address of an endpoint whose `nodeName` is this node, in any
//!   slice and condition (reached without leaving the node).
//! - Source ranges: `loadBalancerSourceRanges` restrict each LB ingress IP that is an ingress
//!   frontend of the Service to the ranges of its family (none of its family: no
//!   restriction, as kube-proxy filters the list before deciding); invalid entries are
//!   reported and ignored. Two Services on one LB IP allow the union of their ranges.
//! - Health checks: `healthCheckNodePort` of every `externalTrafficPolicy: Local` Service,
//!   with the count of distinct addresses in its `externalTrafficPolicy` backend sets; a
//!   port outside 1-65535 is reported; a port asked for by two Services goes to the first in
//!   namespace/name order, the other is reported.

pub mod bypass;
pub mod endpoints;
pub mod explain;
pub(crate) mod frontends;
pub mod node;
pub(crate) mod service;

use foldhash::{HashMap, HashSet, HashSetExt};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

pub use endpoints::{
    EndpointInfo, EndpointSets, PortEndpoints, TRIGGER_TIME_ANNOTATION, categorize,
};
pub use explain::{eligibility, why_not};
pub use node::{NodeAddress, NodeState};

use crate::source::{Change, Kind, Object, ObjectSet};
use endpoints::SliceInfo;
use frontends::{AgeKey, Claim, ClaimIndex, Resolution};
use service::ServiceInfo;

/// A validation error (or warning) for one object: names origin file, kind,
/// namespace/name and reason. Every one is non-fatal (the object, port or endpoint named
/// is skipped), so callers log them at warning level.
pub use crate::source::SourceError as ModelError;

/// The label linking an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// (namespace, name) of a namespaced object; ("", name) for a Node.
pub type SvcKey = (String, String);

/// Transport protocol of a Service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Protocol {
    /// IANA protocol number ([`proxy_common::PROTO_TCP`], [`proxy_common::PROTO_UDP`]).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proxy_common::PROTO_TCP,
            Protocol::Udp => proxy_common::PROTO_UDP,
        }
    }

    /// Name as in Kubernetes manifests (`TCP`, `UDP`).
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// IP family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// Family of an address.
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// Name as in EndpointSlice `addressType` (`IPv4`, `IPv6`).
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// Which frontends of a Service port a backend set serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Scope {
    /// The cluster IPs, with `internalTrafficPolicy`.
    #[default]
    Internal,
    /// The external addresses (`spec.externalIPs`, load balancer ingress IPs) and node
    /// ports as reached from this node (socket programs): always the Cluster endpoints, as
    /// kube-proxy short-circuits traffic from inside the cluster to them.
    External,
    /// The same frontends as reached from outside the node (tc programs, key scope
    /// `SCOPE_INGRESS`): the `externalTrafficPolicy` endpoints.
    Ingress,
}

impl Scope {
    /// `FrontendKey::scope` of this set's frontends.
    pub fn key_scope(self) -> u8 {
        match self {
            Scope::Internal | Scope::External => proxy_common::SCOPE_NODE,
            Scope::Ingress => proxy_common::SCOPE_INGRESS,
        }
    }
}

/// Identity of one backend set: a Service port (by port name; "" when unnamed) x protocol
/// x IP family x [`Scope`]. Ordered so the sets of one Service port are adjacent, the
/// [`Scope::Internal`] one first.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortKey {
    /// Namespace of the Service.
    pub namespace: String,
    /// Name of the Service.
    pub name: String,
    /// Name of the Service port; "" when unnamed.
    pub port_name: String,
    /// Protocol of the Service port.
    pub protocol: Protocol,
    /// Family of the frontends and backends.
    pub family: Family,
    /// Which frontends the set serves.
    pub scope: Scope,
}

/// The desired frontends and backends of one [`ServicePortKey`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredService {
    /// Every frontend (address, port) of this Service port in this family and scope.
    pub frontends: BTreeSet<SocketAddr>,
    /// Endpoints this node uses, deduplicated by (address, port), sorted.
    pub backends: BTreeSet<SocketAddr>,
    /// `proxy_common::FRONTEND_F_*` bits of the frontends (`FRONTEND_F_LOCAL_ONLY`).
    pub flags: u32,
    /// Backend selection for new connections (`--lb-algorithm`, or the Service's
    /// [`ALGORITHM_ANNOTATION`]).
    pub algorithm: Algorithm,
    /// `sessionAffinity: ClientIP` timeout in seconds; 0 without affinity.
    pub affinity_timeout_s: u32,
    /// Weights of the backends (1..=[`MAX_WEIGHT`]) for the algorithms that read them
    /// ([`Algorithm::uses_weights`]: every backend has one); empty for the others. Endpoints
    /// of weight 0 are not in `backends`, whatever the algorithm.
    pub weights: BTreeMap<SocketAddr, u32>,
    /// A `Local` traffic policy set (`FRONTEND_F_LOCAL_ONLY`) without a local endpoint while
    /// the Service has endpoints on other nodes: kube-proxy counts these in
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`.
    pub no_local_endpoints: bool,
    /// With `FRONTEND_F_DSR` (an `Ingress` set): the direct server return pairs this node
    /// accepts for it.
    pub dsr: Option<Box<DsrPairs>>,
}

pub use proxy_common::Algorithm;

/// Service annotation choosing its algorithm: a name of [`Algorithm::ALL`] (`random`,
/// `round-robin`, `weighted-round-robin`, `least-connections`, `source-hash`, `maglev`,
/// `weighted-least-connections`, `shortest-expected-delay`, `never-queue`,
/// `destination-hash`) or an IPVS scheduler name of [`Algorithm::IPVS`] (`rr`, `wrr`, `lc`,
/// `wlc`, `sed`, `nq`, `sh`, `dh`, `mh`).
pub const ALGORITHM_ANNOTATION: &str = "ebpf-proxy.io/lb-algorithm";
/// Service annotation with endpoint weights: a JSON object from pod name (the endpoint's
/// `targetRef.name`) or endpoint IP address to an integer weight 0..=100 (default 1). The
/// weighted algorithms ([`Algorithm::uses_weights`]) follow the weights; 0 takes the
/// endpoint out of new connections with every algorithm (established ones are untouched),
/// as IPVS quiesces a server of weight 0.
pub const WEIGHTS_ANNOTATION: &str = "ebpf-proxy.io/weights";
/// Service annotation choosing how flows from outside the cluster reach a backend on
/// another node: `snat`, `dsr` or `hybrid` ([`NorthSouthMode`]); without it,
/// `--north-south-mode` decides.
pub const NORTH_SOUTH_MODE_ANNOTATION: &str = "ebpf-proxy.io/north-south-mode";

/// How a flow entering the node from outside (node port, external or load balancer IP, with
/// `externalTrafficPolicy: Cluster`) reaches a backend on another node (`--north-south-mode`,
/// or a Service's [`NORTH_SOUTH_MODE_ANNOTATION`]). A backend on the entry node, and every
/// flow of a `Local` policy, keep the client address in every mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NorthSouthMode {
    /// Source-NAT to the entry node's address, replies back through it (kube-proxy's
    /// behaviour; the backend sees the entry node as the client).
    #[default]
    Snat,
    /// Direct server return for TCP and UDP: the client's packet is forwarded encapsulated
    /// to the backend, whose node answers the client directly from the frontend address
    /// (`proxy_common::nat::DSR`); the backend sees the client's address.
    Dsr,
    /// Direct server return for TCP, SNAT for UDP (Cilium's hybrid mode: a UDP flow has no
    /// handshake whose MSS could be lowered for the encapsulation, and its datagrams are
    /// often large).
    Hybrid,
}

impl NorthSouthMode {
    /// Every mode with its name.
    pub const ALL: [(NorthSouthMode, &'static str); 3] = [
        (NorthSouthMode::Snat, "snat"),
        (NorthSouthMode::Dsr, "dsr"),
        (NorthSouthMode::Hybrid, "hybrid"),
    ];

    /// The mode named `s` (`snat`, `dsr`, `hybrid`).
    pub fn from_name(s: &str) -> Option<NorthSouthMode> {
        Self::ALL.iter().find(|(_, n)| *n == s).map(|(m, _)| *m)
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(m, _)| *m == self)
            .map_or("snat", |(_, n)| n)
    }

    /// Whether flows of `protocol` go by direct server return in this mode.
    pub fn dsr_for(self, protocol: Protocol) -> bool {
        match self {
            NorthSouthMode::Snat => false,
            NorthSouthMode::Dsr => true,
            NorthSouthMode::Hybrid => protocol == Protocol::Tcp,
        }
    }
}

/// The direct server return pairs one `Ingress` backend set accepts on this node (see
/// `proxy_common::nat::DSR`): packets another node encapsulated to one of `local`, naming
/// one of `external` or, on any node's address, `node_port`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DsrPairs {
    /// The Service port's `nodePort`, if any (another node's address is in the packet).
    pub node_port: Option<u16>,
    /// The external and load balancer IPs of the set's family, with the Service port.
    pub external: BTreeSet<SocketAddr>,
    /// Endpoints of the Service port on this node that an entry node may have chosen
    /// (ready, or serving while terminating), whatever this node's own topology filtering.
    pub local: BTreeSet<SocketAddr>,
}

/// Highest weight an endpoint may have (bounds the slots a service uses).
pub const MAX_WEIGHT: u32 = 100;
/// Default `sessionAffinityConfig.clientIP.timeoutSeconds` (Kubernetes API: 3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10800;

/// Parses an algorithm name as [`ALGORITHM_ANNOTATION`] and `--lb-algorithm` take it: an
/// ebpf-proxy name ([`Algorithm::ALL`]) or an IPVS scheduler name ([`Algorithm::IPVS`]).
pub fn parse_algorithm(s: &str) -> Option<Algorithm> {
    Algorithm::from_name(s)
}

/// Every name [`parse_algorithm`] accepts, for messages: `random, round-robin, ... (IPVS:
/// rr, wrr, ...)`.
pub fn algorithm_names() -> String {
    let own: Vec<&str> = Algorithm::ALL.iter().map(|(_, n)| *n).collect();
    let ipvs: Vec<&str> = Algorithm::IPVS.iter().map(|(n, _)| *n).collect();
    format!("{} (IPVS: {})", own.join(", "), ipvs.join(", "))
}

/// Every backend set the data path must implement, in key order (what [`build`] returns;
/// the agent reads [`Model::ports`] instead of copying it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    /// Backend sets by Service port x protocol x family x scope.
    pub services: BTreeMap<ServicePortKey, DesiredService>,
}

impl DesiredState {
    /// Every VIP (address of any frontend).
    pub fn vips(&self) -> BTreeSet<IpAddr> {
        self.services
            .values()
            .flat_map(|s| s.frontends.iter().map(SocketAddr::ip))
            .collect()
    }

    /// Number of distinct frontends (VIP, port, protocol): entries of the frontend map,
    /// VIP markers not included.
    pub fn frontend_count(&self) -> usize {
        self.services
            .iter()
            .flat_map(|(k, s)| s.frontends.iter().map(move |f| (*f, k.protocol)))
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// Number of distinct backends (address, port, protocol): entries of the backend map.
    pub fn backend_count(&self) -> usize {
        self.services
            .iter()
            .flat_map(|(k, s)| s.backends.iter().map(move |b| (*b, k.protocol)))
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// Number of backend slots: the sum of every backend set's size.
    pub fn slot_count(&self) -> usize {
        self.services.values().map(|s| s.backends.len()).sum()
    }
}

/// Information about this node that does not come from objects: its name
/// (`--hostname-override`) and the flags that shape the model. Its zone and addresses come
/// from the Node object of that name ([`NodeState`]).
#[derive(Clone, Debug, Default)]
pub struct NodeInfo {
    /// Node name.
    pub name: String,
    /// `--nodeport-addresses` CIDRs: node ports are served only on node addresses inside
    /// one of them; empty means every node address (kube-proxy's iptables default).
    pub nodeport_addresses: Vec<IpNet>,
    /// `--nodeport-addresses primary`: only the node's primary address of each family (its
    /// first `InternalIP`), the default of kube-proxy's nftables mode.
    pub nodeport_primary: bool,
    /// `--lb-algorithm`: the algorithm of Services without [`ALGORITHM_ANNOTATION`].
    pub default_algorithm: Algorithm,
    /// `--north-south-mode`: the mode of Services without [`NORTH_SOUTH_MODE_ANNOTATION`].
    pub north_south_mode: NorthSouthMode,
}

/// The label holding a Node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Label naming the proxy meant to implement a Service (`service.kubernetes.io/
/// service-proxy-name`, KEP-2447); the EndpointSlice controller copies it to the slices.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// Label the EndpointSlice controller puts on the slices of headless Services.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";
/// The label selector of kube-proxy's Service and EndpointSlice watches
/// (`cmd/kube-proxy/app/server.go`): objects with either label are not proxied.
pub const PROXY_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// True when an object's labels exclude it from proxying ([`PROXY_LABEL_SELECTOR`]).
pub fn excluded_by_labels(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> bool {
    meta.labels
        .as_ref()
        .is_some_and(|l| l.contains_key(SERVICE_PROXY_NAME_LABEL) || l.contains_key(HEADLESS_LABEL))
}

/// What a `healthCheckNodePort` server reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    /// Namespace of the Service.
    pub namespace: String,
    /// Name of the Service.
    pub name: String,
    /// Distinct endpoint addresses of the Service's `externalTrafficPolicy` backend sets on
    /// this node.
    pub local_endpoints: usize,
}

/// What one [`Model::commit`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Backend sets added, changed or removed (read the new state with [`Model::port`];
    /// `None` there means removed).
    pub ports: BTreeSet<ServicePortKey>,
    /// This node's addresses or zone changed (interfaces and SNAT addresses follow them).
    pub node_changed: bool,
    /// The set of endpoint addresses on this node changed.
    pub local_endpoints_changed: bool,
    /// Endpoint addresses now on this node that were not.
    pub local_endpoints_added: Vec<IpAddr>,
    /// Endpoint addresses no longer on this node.
    pub local_endpoints_removed: Vec<IpAddr>,
    /// The source ranges changed.
    pub source_ranges_changed: bool,
    /// The health-check ports or what they report changed.
    pub health_changed: bool,
    /// Errors that appeared (each is reported once while it lasts).
    pub errors_added: Vec<ModelError>,
    /// Errors that are gone.
    pub errors_removed: Vec<ModelError>,
    /// Service changes that read differently from before (kube-proxy's service changes).
    pub service_changes: u64,
    /// EndpointSlice changes that read differently from before.
    pub endpoint_changes: u64,
    /// `endpoints.kubernetes.io/last-change-trigger-time` of the slices that changed, with
    /// the family of their `addressType`.
    pub trigger_times: Vec<(Family, String)>,
}

impl Delta {
    /// True when nothing changed.
    pub fn is_empty(&self) -> bool {
        self.ports.is_empty()
            && !self.node_changed
            && !self.local_endpoints_changed
            && !self.source_ranges_changed
            && !self.health_changed
            && self.errors_added.is_empty()
            && self.errors_removed.is_empty()
    }
}

/// Who an error is about, so each object's errors are replaced when it changes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum ErrorOwner {
    Slice(SvcKey),
    Node,
    Service(SvcKey),
    HealthPort(u16),
}

/// One Service: what was read, its ownership key and claims, and what it gives.
#[derive(Debug)]
struct ServiceEntry {
    info: ServiceInfo,
    age: AgeKey,
    claims: Vec<Claim>,
    output: ServiceOutput,
}

/// What one Service gives.
#[derive(Debug, Default, PartialEq, Eq)]
struct ServiceOutput {
    /// Its backend sets (the values are in [`Model::ports`]).
    ports: Vec<ServicePortKey>,
    errors: Vec<ModelError>,
    /// (`healthCheckNodePort`, local endpoint count).
    health: Option<(u16, usize)>,
    /// Allowed CIDRs by restricted LB IP.
    ranges: BTreeMap<IpAddr, BTreeSet<IpNet>>,
}

/// The model: every object read so far and the desired state derived from it, kept up to
/// date per change. See the module documentation.
#[derive(Debug, Default)]
pub struct Model {
    config: NodeInfo,
    /// This node's Node object as read, and where it came from.
    node: NodeState,
    node_origin: Option<Arc<str>>,
    // Boxed values: a hash map's buckets are allocated for its capacity, up to twice the
    // entries, so large inline values would waste that much again.
    services: HashMap<SvcKey, Box<ServiceEntry>>,
    slices: HashMap<SvcKey, Box<SliceInfo>>,
    /// (namespace, Service name) -> its slices' names, in name order (a short sorted
    /// vector: most Services have one slice).
    slices_of: HashMap<SvcKey, Vec<String>>,
    claims: ClaimIndex,
    ports: BTreeMap<ServicePortKey, DesiredService>,
    local_endpoints: BTreeMap<IpAddr, u32>,
    /// LB IP -> allowed CIDR -> number of Services allowing it.
    ranges: BTreeMap<IpAddr, BTreeMap<IpNet, u32>>,
    /// Health-check port -> the Services asking for it (namespace/name order) and their
    /// local endpoint counts.
    health: BTreeMap<u16, BTreeMap<SvcKey, usize>>,
    errors: HashMap<ErrorOwner, Vec<ModelError>>,
    // What the next commit must do and report.
    dirty: HashSet<SvcKey>,
    all_dirty: bool,
    health_touched: BTreeSet<u16>,
    error_net: HashMap<ModelError, i32>,
    local_net: HashMap<IpAddr, i32>,
    pending: Delta,
    /// Pods, Namespaces and `--socket-lb-scope`: which pods bypass socket-level
    /// translation.
    bypass: bypass::BypassState,
}

impl Model {
    /// An empty model for this node.
    pub fn new(config: NodeInfo) -> Model {
        Model {
            config,
            ..Default::default()
        }
    }

    /// Sets `--socket-lb-scope` (see [`bypass`]).
    pub fn set_socket_lb_scope(&mut self, scope: bypass::SocketLbScope) {
        self.bypass.set_scope(scope);
    }

    /// The Pods, Namespaces and scope that decide which pods bypass socket-level
    /// translation.
    pub fn bypass(&self) -> &bypass::BypassState {
        &self.bypass
    }

    /// The pods of this node that bypass socket-level translation, in (namespace, name)
    /// order.
    pub fn bypassed(&self) -> Vec<bypass::BypassedPod> {
        self.bypass.bypassed(&self.config.name)
    }

    /// The node configuration.
    pub fn config(&self) -> &NodeInfo {
        &self.config
    }

    /// Applies one change: the object is read (and dropped); what it affects is recomputed
    /// at the next [`Model::commit`]. A change that reads the same as what the model holds
    /// is dropped.
    pub fn apply(&mut self, change: Change) {
        match change {
            Change::Apply(Object::Service(s)) => {
                let key = svc_key(&s.object.metadata);
                if excluded_by_labels(&s.object.metadata) {
                    self.set_service(key, None);
                    return;
                }
                let info = ServiceInfo::read(
                    Arc::from(s.origin.as_str()),
                    &s.object,
                    self.config.default_algorithm,
                    self.config.north_south_mode,
                );
                self.set_service(key, Some(info));
            }
            Change::Apply(Object::EndpointSlice(s)) => {
                let key = svc_key(&s.object.metadata);
                if excluded_by_labels(&s.object.metadata) {
                    self.set_slice(key, None);
                    return;
                }
                let info = SliceInfo::read(
                    &Arc::from(s.origin.as_str()),
                    &key.0,
                    &s.object,
                    &self.config.name,
                );
                let trigger = s
                    .object
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(TRIGGER_TIME_ANNOTATION))
                    .cloned();
                let family = if s.object.address_type == "IPv6" {
                    Family::V6
                } else {
                    Family::V4
                };
                if self.set_slice(key, Some(info))
                    && let Some(t) = trigger
                {
                    self.pending.trigger_times.push((family, t));
                }
            }
            Change::Apply(Object::Node(n)) => {
                if n.object.metadata.name.as_deref() != Some(self.config.name.as_str()) {
                    return;
                }
                let origin: Arc<str> = Arc::from(n.origin.as_str());
                let state = NodeState::read(&origin, &n.object, &self.config);
                self.set_node(Some((origin, state)));
            }
            Change::Delete(Kind::Service, key) => self.set_service(key, None),
            Change::Delete(Kind::EndpointSlice, key) => {
                self.set_slice(key, None);
            }
            Change::Delete(Kind::Node, (_, name)) => {
                if name == self.config.name {
                    self.set_node(None);
                }
            }
            Change::Apply(Object::Pod(p)) => self.bypass.apply_pod(&p.object),
            Change::Apply(Object::Namespace(n)) => self.bypass.apply_namespace(&n.object),
            Change::Delete(Kind::Pod, (ns, name)) => self.bypass.delete_pod(&ns, &name),
            Change::Delete(Kind::Namespace, (_, name)) => self.bypass.delete_namespace(&name),
        }
    }

    fn set_errors(&mut self, owner: ErrorOwner, new: Vec<ModelError>) {
        let old = if new.is_empty() {
            self.errors.remove(&owner).unwrap_or_default()
        } else {
            self.errors.insert(owner, new.clone()).unwrap_or_default()
        };
        if old == new {
            return;
        }
        for e in old {
            *self.error_net.entry(e).or_default() -= 1;
        }
        for e in new {
            *self.error_net.entry(e).or_default() += 1;
        }
    }

    fn set_service(&mut self, key: SvcKey, new: Option<ServiceInfo>) {
        let old = self.services.get(&key);
        if old.map(|e| &e.info) == new.as_ref() {
            return;
        }
        self.pending.service_changes += 1;
        let node_ports = self.node.node_port_ips();
        let mut neighbours = HashSet::new();
        let old_output = match self.services.remove(&key) {
            Some(old) => {
                self.claims.remove(&key, &old.claims, &mut neighbours);
                old.output
            }
            None => ServiceOutput::default(),
        };
        match new {
            Some(info) => {
                let age = AgeKey::of(&key, &info);
                let claims = frontends::candidate_claims(&info, &node_ports);
                self.claims.add(&key, &claims, &mut neighbours);
                self.services.insert(
                    key.clone(),
                    Box::new(ServiceEntry {
                        info,
                        age,
                        claims,
                        output: old_output,
                    }),
                );
                self.dirty.insert(key);
            }
            None => {
                self.install_output(&key, old_output, ServiceOutput::default());
                self.dirty.remove(&key);
            }
        }
        self.dirty.extend(neighbours);
    }

    /// Returns whether the slice read differently from before.
    fn set_slice(&mut self, key: SvcKey, new: Option<SliceInfo>) -> bool {
        let old = self.slices.get(&key);
        if old.map(|b| &**b) == new.as_ref() {
            return false;
        }
        self.pending.endpoint_changes += 1;
        let old = self.slices.remove(&key);
        let (ns, name) = key.clone();
        if let Some(old) = &old {
            for a in &old.local_addrs {
                if let Some(n) = self.local_endpoints.get_mut(a) {
                    *n -= 1;
                    if *n == 0 {
                        self.local_endpoints.remove(a);
                        *self.local_net.entry(*a).or_default() -= 1;
                    }
                }
            }
            if let Some(svc) = &old.service {
                let sk = (ns.clone(), svc.clone());
                if let Some(set) = self.slices_of.get_mut(&sk) {
                    set.retain(|n| *n != name);
                    if set.is_empty() {
                        self.slices_of.remove(&sk);
                    }
                }
                if self.services.contains_key(&sk) {
                    self.dirty.insert(sk);
                }
            }
        }
        let errors = new.as_ref().map(|n| n.errors.clone()).unwrap_or_default();
        if let Some(new) = new {
            for a in &new.local_addrs {
                let n = self.local_endpoints.entry(*a).or_default();
                if *n == 0 {
                    *self.local_net.entry(*a).or_default() += 1;
                }
                *n += 1;
            }
            if let Some(svc) = &new.service {
                let sk = (ns.clone(), svc.clone());
                let set = self.slices_of.entry(sk.clone()).or_default();
                if let Err(at) = set.binary_search(&name) {
                    set.insert(at, name.clone());
                }
                if self.services.contains_key(&sk) {
                    self.dirty.insert(sk);
                }
            }
            self.slices.insert(key.clone(), Box::new(new));
        }
        self.set_errors(ErrorOwner::Slice(key), errors);
        true
    }

    fn set_node(&mut self, new: Option<(Arc<str>, NodeState)>) {
        let (origin, state) = match new {
            Some((o, s)) => (Some(o), s),
            None => (None, NodeState::default()),
        };
        if state == self.node {
            self.node_origin = origin;
            return;
        }
        self.pending.node_changed = true;
        let ports_changed = state.node_port_ips() != self.node.node_port_ips();
        let zone_changed = state.zone != self.node.zone;
        self.set_errors(ErrorOwner::Node, state.errors.clone());
        self.node = state;
        self.node_origin = origin;
        if ports_changed {
            // Node-port claims of every Service change: rebuild the index.
            let node_ports = self.node.node_port_ips();
            self.claims.clear();
            let mut ignore = HashSet::new();
            for (k, e) in self.services.iter_mut() {
                e.claims = frontends::candidate_claims(&e.info, &node_ports);
                self.claims.add(k, &e.claims, &mut ignore);
            }
        }
        if ports_changed || zone_changed {
            self.all_dirty = true;
        }
    }

    /// Recomputes what the changes since the last commit affect and returns what changed.
    pub fn commit(&mut self) -> Delta {
        let dirty: Vec<SvcKey> = if std::mem::take(&mut self.all_dirty) {
            self.dirty.clear();
            self.services.keys().cloned().collect()
        } else {
            self.dirty
                .drain()
                .filter(|k| self.services.contains_key(k))
                .collect()
        };
        // Expand to the groups of Services sharing a candidate frontend.
        let mut done: HashSet<SvcKey> = HashSet::new();
        let node_ports = self.node.node_port_ips();
        for start in dirty {
            if done.contains(&start) {
                continue;
            }
            let mut group: Vec<SvcKey> = vec![start.clone()];
            done.insert(start);
            let mut i = 0;
            while i < group.len() {
                let e = &self.services[&group[i]];
                for c in &e.claims {
                    for a in self.claims.claimants(c) {
                        if done.insert(a.clone()) {
                            group.push(a.clone());
                        }
                    }
                }
                i += 1;
            }
            let resolved = {
                let mut members: Vec<(AgeKey, &ServiceInfo)> = group
                    .iter()
                    .map(|k| {
                        let e = &self.services[k];
                        (e.age.clone(), &e.info)
                    })
                    .collect();
                frontends::resolve(&mut members, &node_ports)
            };
            for k in group {
                let r = resolved.get(&k).cloned().unwrap_or_default();
                let (mut out, sets) = self.compute(&k, &r);
                self.stage(&mut out, sets);
                let old = std::mem::take(&mut self.services.get_mut(&k).expect("in group").output);
                let installed = self.install_output(&k, old, out);
                self.services.get_mut(&k).expect("in group").output = installed;
            }
        }
        // Health-check ports: the first Service in namespace/name order keeps a port.
        for port in std::mem::take(&mut self.health_touched) {
            self.pending.health_changed = true;
            let mut errors = Vec::new();
            if let Some(claims) = self.health.get(&port) {
                let mut it = claims.keys();
                let first = it.next().cloned();
                for (ns, name) in it {
                    let (fns, fname) = first.as_ref().expect("a first claim");
                    let origin = self
                        .services
                        .get(&(ns.clone(), name.clone()))
                        .map(|e| e.info.origin.to_string())
                        .unwrap_or_default();
                    errors.push(ModelError::object(
                        origin,
                        "Service",
                        ns.clone(),
                        name.clone(),
                        format!(
                            "healthCheckNodePort {port} is also the port of Service {fns}/{fname}, which keeps it; no health-check server for {ns}/{name}"
                        ),
                    ));
                }
            }
            self.set_errors(ErrorOwner::HealthPort(port), errors);
        }
        let mut delta = std::mem::take(&mut self.pending);
        for (e, n) in self.error_net.drain() {
            match n.cmp(&0) {
                std::cmp::Ordering::Greater => delta.errors_added.push(e),
                std::cmp::Ordering::Less => delta.errors_removed.push(e),
                std::cmp::Ordering::Equal => {}
            }
        }
        delta.errors_added.sort();
        delta.errors_removed.sort();
        for (a, n) in self.local_net.drain() {
            match n.cmp(&0) {
                std::cmp::Ordering::Greater => delta.local_endpoints_added.push(a),
                std::cmp::Ordering::Less => delta.local_endpoints_removed.push(a),
                std::cmp::Ordering::Equal => {}
            }
        }
        delta.local_endpoints_added.sort();
        delta.local_endpoints_removed.sort();
        delta.local_endpoints_changed =
            !delta.local_endpoints_added.is_empty() || !delta.local_endpoints_removed.is_empty();
        delta
    }

    /// Replaces a Service's output, recording what changed; returns the new output.
    fn install_output(
        &mut self,
        key: &SvcKey,
        old: ServiceOutput,
        new: ServiceOutput,
    ) -> ServiceOutput {
        // Backend sets: the values were staged in `new_ports` by `compute`.
        let new_keys: BTreeSet<&ServicePortKey> = new.ports.iter().collect();
        for k in &old.ports {
            if !new_keys.contains(k) && self.ports.remove(k).is_some() {
                self.pending.ports.insert(k.clone());
            }
        }
        if old.health != new.health {
            if let Some((port, _)) = old.health
                && let Some(set) = self.health.get_mut(&port)
            {
                set.remove(key);
                if set.is_empty() {
                    self.health.remove(&port);
                }
                self.health_touched.insert(port);
            }
            if let Some((port, local)) = new.health {
                self.health
                    .entry(port)
                    .or_default()
                    .insert(key.clone(), local);
                self.health_touched.insert(port);
            }
        }
        if old.ranges != new.ranges {
            self.pending.source_ranges_changed = true;
            for (ip, cidrs) in &old.ranges {
                if let Some(m) = self.ranges.get_mut(ip) {
                    for c in cidrs {
                        if let Some(n) = m.get_mut(c) {
                            *n -= 1;
                            if *n == 0 {
                                m.remove(c);
                            }
                        }
                    }
                    if m.is_empty() {
                        self.ranges.remove(ip);
                    }
                }
            }
            for (ip, cidrs) in &new.ranges {
                let m = self.ranges.entry(*ip).or_default();
                for c in cidrs {
                    *m.entry(*c).or_default() += 1;
                }
            }
        }
        if old.errors != new.errors {
            self.set_errors(ErrorOwner::Service(key.clone()), new.errors.clone());
        }
        new
    }

    /// Computes a Service's output from what was read and its ownership resolution, with
    /// its backend sets (not yet in [`Model::ports`], see [`Model::stage`]).
    fn compute(
        &self,
        key: &SvcKey,
        r: &Resolution,
    ) -> (ServiceOutput, BTreeMap<ServicePortKey, DesiredService>) {
        let (ns, name) = key;
        let e = &self.services[key];
        let info = &e.info;
        let origin = info.origin.to_string();
        let mk_err = |reason: String| {
            ModelError::object(origin.clone(), "Service", ns.clone(), name.clone(), reason)
        };
        let mut out = ServiceOutput::default();
        let mut sets: BTreeMap<ServicePortKey, DesiredService> = BTreeMap::new();
        match &info.frontends {
            Err(reason) => out
                .errors
                .push(mk_err(format!("{reason}; Service skipped"))),
            Ok(None) => {}
            Ok(Some(_)) if r.skipped.is_some() => {
                out.errors.push(mk_err(r.skipped.clone().expect("checked")))
            }
            Ok(Some(f)) => {
                out.errors
                    .extend(info.warnings.iter().cloned().map(&mk_err));
                out.errors.extend(r.errors.iter().cloned().map(&mk_err));
                out.errors
                    .extend(info.selection_warnings.iter().cloned().map(&mk_err));
                let slices = self
                    .slices_of
                    .get(key)
                    .into_iter()
                    .flatten()
                    .filter_map(|s| self.slices.get(&(ns.clone(), s.clone())))
                    .filter_map(|s| s.parsed.as_ref());
                let endpoints = endpoints::merge(slices);
                service_sets(
                    key,
                    info,
                    f,
                    r,
                    &endpoints,
                    &self.config.name,
                    &self.node.zone,
                    &mut sets,
                );
                // Source ranges of the LB IPs that are ingress frontends of this Service.
                if !info.source_ranges.is_empty() {
                    for (ip, _) in &r.external {
                        if !info.lb_ips.contains(ip) {
                            continue;
                        }
                        let fam: BTreeSet<IpNet> = info
                            .source_ranges
                            .iter()
                            .filter(|c| c.addr().is_ipv4() == ip.is_ipv4())
                            .map(|c| c.trunc())
                            .collect();
                        if !fam.is_empty() {
                            out.ranges.insert(*ip, fam);
                        }
                    }
                }
            }
        }
        for bad in &info.bad_ranges {
            out.errors.push(mk_err(format!(
                "loadBalancerSourceRanges: {bad:?} is not a CIDR (ADDR/LEN); range ignored"
            )));
        }
        match info.health_check {
            Some(Ok(port)) => {
                let local: BTreeSet<IpAddr> = sets
                    .iter()
                    .filter(|(k, _)| k.scope == Scope::Ingress)
                    .flat_map(|(_, s)| s.backends.iter().map(|b| b.ip()))
                    .collect();
                out.health = Some((port, local.len()));
            }
            Some(Err(asked)) => out.errors.push(mk_err(format!(
                "healthCheckNodePort {asked} is not a port (1-65535); no health-check server"
            ))),
            None => {}
        }
        (out, sets)
    }

    /// Puts a Service's backend sets into [`Model::ports`], recording the changed keys, and
    /// lists them in its output.
    fn stage(&mut self, out: &mut ServiceOutput, sets: BTreeMap<ServicePortKey, DesiredService>) {
        for (k, v) in sets {
            if self.ports.get(&k) != Some(&v) {
                self.pending.ports.insert(k.clone());
                self.ports.insert(k.clone(), v);
            }
            out.ports.push(k);
        }
    }

    /// Every backend set, in key order.
    pub fn ports(&self) -> &BTreeMap<ServicePortKey, DesiredService> {
        &self.ports
    }

    /// One backend set; `None` when it does not exist (removed).
    pub fn port(&self, key: &ServicePortKey) -> Option<&DesiredService> {
        self.ports.get(key)
    }

    /// This node's Node object as read (default when there is none).
    pub fn node(&self) -> &NodeState {
        &self.node
    }

    /// Addresses of the endpoints on this node (any slice, any condition).
    pub fn local_endpoints(&self) -> impl Iterator<Item = &IpAddr> {
        self.local_endpoints.keys()
    }

    /// Restricted LB IPs and the CIDRs allowed to reach each.
    pub fn source_ranges(&self) -> impl Iterator<Item = (&IpAddr, impl Iterator<Item = &IpNet>)> {
        self.ranges.iter().map(|(ip, m)| (ip, m.keys()))
    }

    /// The health-check servers to run: port -> what it reports.
    pub fn health_checks(&self) -> BTreeMap<u16, HealthCheck> {
        self.health
            .iter()
            .filter_map(|(port, claims)| {
                let ((ns, name), local) = claims.iter().next()?;
                Some((
                    *port,
                    HealthCheck {
                        namespace: ns.clone(),
                        name: name.clone(),
                        local_endpoints: *local,
                    },
                ))
            })
            .collect()
    }

    /// Every error now, in a stable order: this node, slices (namespace/name), Services (in
    /// age order), health-check ports.
    pub fn errors(&self) -> Vec<ModelError> {
        let mut owners: Vec<&ErrorOwner> = self.errors.keys().collect();
        let age = |o: &ErrorOwner| match o {
            ErrorOwner::Service(k) => self.services.get(k).map(|e| e.age.clone()),
            _ => None,
        };
        owners.sort_by(|a, b| {
            let rank = |o: &ErrorOwner| match o {
                ErrorOwner::Node => 0,
                ErrorOwner::Slice(_) => 1,
                ErrorOwner::Service(_) => 2,
                ErrorOwner::HealthPort(_) => 3,
            };
            (rank(a), age(a), *a).cmp(&(rank(b), age(b), *b))
        });
        owners
            .into_iter()
            .flat_map(|o| self.errors[o].iter().cloned())
            .collect()
    }

    /// The EndpointSlices (names) feeding Service `namespace`/`name`, in name order.
    pub fn slices_of(&self, namespace: &str, name: &str) -> &[String] {
        self.slices_of
            .get(&(namespace.to_string(), name.to_string()))
            .map_or(&[], Vec::as_slice)
    }

    /// Number of errors now.
    pub fn error_count(&self) -> usize {
        self.errors.values().map(Vec::len).sum()
    }

    /// Every backend set as a [`DesiredState`] (a copy: for tests and tools).
    pub fn desired_state(&self) -> DesiredState {
        DesiredState {
            services: self.ports.clone(),
        }
    }

    /// Every endpoint of one Service port and family as this node reads it (all slices
    /// merged as for the backend sets), for `ebpf-proxy explain` and for the endpoints
    /// whose connections `--close-connections-to-removed-endpoints` keeps.
    pub fn endpoints_of(
        &self,
        namespace: &str,
        service: &str,
        port_name: &str,
        protocol: Protocol,
        family: Family,
    ) -> PortEndpoints {
        let key = (namespace.to_string(), service.to_string());
        let slices = self
            .slices_of
            .get(&key)
            .into_iter()
            .flatten()
            .filter_map(|s| self.slices.get(&(namespace.to_string(), s.clone())))
            .filter_map(|s| s.parsed.as_ref());
        endpoints::merge(slices)
            .remove(&(port_name.to_string(), protocol, family))
            .unwrap_or_default()
    }

    /// Number of Services and EndpointSlices held.
    pub fn object_counts(&self) -> (usize, usize) {
        (self.services.len(), self.slices.len())
    }
}

/// (namespace, name) of an object; the namespace defaults to "default".
fn svc_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> SvcKey {
    (
        meta.namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".into()),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The backend sets of one valid Service into `sets`.
#[allow(clippy::too_many_arguments)]
fn service_sets(
    (ns, name): &SvcKey,
    info: &ServiceInfo,
    f: &service::Frontends,
    r: &Resolution,
    endpoints: &endpoints::ServiceEndpoints,
    node: &str,
    zone: &str,
    sets: &mut BTreeMap<ServicePortKey, DesiredService>,
) {
    let algorithm = info.algorithm;
    // A DesiredService with the Service's selection settings and weights: an endpoint of
    // weight 0 leaves the set whatever the algorithm (IPVS's quiesced server), the others'
    // weights are kept for the algorithms that read them.
    let policy = |backends: BTreeSet<SocketAddr>,
                  eps: &PortEndpoints,
                  frontends: BTreeSet<SocketAddr>,
                  flags: u32| {
        let mut d = DesiredService {
            frontends,
            backends,
            flags,
            algorithm,
            affinity_timeout_s: f.affinity,
            weights: BTreeMap::new(),
            no_local_endpoints: false,
            dsr: None,
        };
        if !info.weights.is_empty() {
            let weight = |a: &SocketAddr| {
                let pod = eps.get(a).map(|e| &*e.pod).unwrap_or("");
                info.weights
                    .get(pod)
                    .filter(|_| !pod.is_empty())
                    .or_else(|| info.weights.get(&a.ip().to_string()))
                    .copied()
                    .unwrap_or(1)
            };
            d.backends.retain(|a| weight(a) > 0);
            if algorithm.uses_weights() {
                d.weights = d.backends.iter().map(|a| (*a, weight(a))).collect();
            }
        } else if algorithm.uses_weights() {
            d.weights = d.backends.iter().map(|a| (*a, 1)).collect();
        }
        d
    };
    let empty = PortEndpoints::new();
    for (port_name, protocol, port) in &f.ports {
        for vip in &f.vips {
            let family = Family::of(vip);
            let key = ServicePortKey {
                namespace: ns.clone(),
                name: name.clone(),
                port_name: port_name.clone(),
                protocol: *protocol,
                family,
                scope: Scope::Internal,
            };
            let eps = endpoints
                .get(&(port_name.clone(), *protocol, family))
                .unwrap_or(&empty);
            let cats = categorize(eps, node, zone);
            // Local policy, no local endpoint, endpoints elsewhere (kube-proxy's
            // CategorizeEndpoints: hasAnyEndpoints without local ones).
            let no_local = cats.local.is_empty() && !cats.cluster.is_empty();
            // No usable endpoint anywhere (kube-proxy's !hasEndpoints): rejected whatever
            // the policy, so a Local frontend says so.
            let none = if cats.cluster.is_empty() {
                proxy_common::FRONTEND_F_NO_ENDPOINTS
            } else {
                0
            };
            let (backends, flags) = if info.internal_local {
                (
                    cats.local.clone(),
                    proxy_common::FRONTEND_F_LOCAL_ONLY | none,
                )
            } else {
                (cats.cluster.clone(), 0)
            };
            let mut internal = policy(
                backends,
                eps,
                BTreeSet::from([SocketAddr::new(*vip, *port)]),
                flags,
            );
            internal.no_local_endpoints = info.internal_local && no_local;
            sets.insert(key.clone(), internal);
            // Traffic from this node to external addresses is "internal to the cluster":
            // kube-proxy short-circuits it to the Cluster endpoints whatever the
            // externalTrafficPolicy (pkg/proxy: UsesClusterEndpoints).
            let mut ext: BTreeSet<SocketAddr> = r
                .external
                .iter()
                .filter(|(ip, _)| Family::of(ip) == family)
                .map(|(ip, _)| SocketAddr::new(*ip, *port))
                .collect();
            ext.extend(
                r.node_ports
                    .get(port_name)
                    .into_iter()
                    .flatten()
                    .filter(|fe| Family::of(&fe.ip()) == family),
            );
            if !ext.is_empty() {
                // From outside the node: the externalTrafficPolicy endpoints; Local has no
                // fallback to other nodes (traffic is dropped, the client IP kept).
                let (ingress_backends, ingress_flags) = if info.external_local {
                    (
                        cats.local.clone(),
                        proxy_common::FRONTEND_F_EXTERNAL
                            | proxy_common::FRONTEND_F_LOCAL_ONLY
                            | none,
                    )
                } else if info.north_south.dsr_for(*protocol) {
                    (
                        cats.cluster.clone(),
                        proxy_common::FRONTEND_F_EXTERNAL | proxy_common::FRONTEND_F_DSR,
                    )
                } else {
                    (cats.cluster.clone(), proxy_common::FRONTEND_F_EXTERNAL)
                };
                let mut ingress = policy(ingress_backends, eps, ext.clone(), ingress_flags);
                ingress.no_local_endpoints = info.external_local && no_local;
                if ingress_flags & proxy_common::FRONTEND_F_DSR != 0 {
                    ingress.dsr = Some(Box::new(DsrPairs {
                        node_port: f.node_ports.get(port_name).copied(),
                        external: r
                            .external
                            .iter()
                            .filter(|(ip, _)| Family::of(ip) == family)
                            .map(|(ip, _)| SocketAddr::new(*ip, *port))
                            .collect(),
                        local: eps
                            .iter()
                            .filter(|(_, e)| e.local && (e.ready || (e.serving && e.terminating)))
                            .map(|(a, _)| *a)
                            .collect(),
                    }));
                }
                sets.insert(
                    ServicePortKey {
                        scope: Scope::Ingress,
                        ..key.clone()
                    },
                    ingress,
                );
                sets.insert(
                    ServicePortKey {
                        scope: Scope::External,
                        ..key
                    },
                    policy(cats.cluster, eps, ext, proxy_common::FRONTEND_F_EXTERNAL),
                );
            }
        }
    }
}

/// Builds the desired state from a set of objects at once: a fresh [`Model`] fed every
/// object. Returns the state and an error for everything skipped, in [`Model::errors`]
/// order.
pub fn build(objects: &ObjectSet, node: &NodeInfo) -> (DesiredState, Vec<ModelError>) {
    let model = Model::from_objects(objects, node);
    (model.desired_state(), model.errors())
}

impl Model {
    /// A model fed every object of `objects` and committed.
    pub fn from_objects(objects: &ObjectSet, node: &NodeInfo) -> Model {
        let mut model = Model::new(node.clone());
        for n in objects.nodes.values() {
            model.apply(Change::Apply(Object::Node(n.clone())));
        }
        for n in objects.namespaces.values() {
            model.apply(Change::Apply(Object::Namespace(n.clone())));
        }
        for p in objects.pods.values() {
            model.apply(Change::Apply(Object::Pod(p.clone())));
        }
        for s in objects.endpoint_slices.values() {
            model.apply(Change::Apply(Object::EndpointSlice(s.clone())));
        }
        for s in objects.services.values() {
            model.apply(Change::Apply(Object::Service(s.clone())));
        }
        model.commit();
        model
    }
}
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::source::manifests::parse_documents;
    use crate::source::{Change, Kind};

    /// Objects from YAML documents (origin "test.yaml"); the YAML must be valid.
    pub(crate) fn objects(yaml: &str) -> ObjectSet {
        let (objs, errors) = parse_documents("test.yaml", yaml);
        assert!(errors.is_empty(), "fixture errors: {errors:?}");
        let mut set = ObjectSet::default();
        for o in objs {
            assert!(set.insert(o).is_none(), "duplicate in fixture");
        }
        set
    }

    fn build_yaml(yaml: &str) -> (DesiredState, Vec<String>) {
        build_yaml_on(
            yaml,
            &NodeInfo {
                name: "node-1".into(),
                ..Default::default()
            },
        )
    }

    fn build_yaml_on(yaml: &str, node: &NodeInfo) -> (DesiredState, Vec<String>) {
        let (state, errors) = build(&objects(yaml), node);
        (state, errors.iter().map(ToString::to_string).collect())
    }

    fn key(
        ns: &str,
        name: &str,
        port_name: &str,
        protocol: Protocol,
        family: Family,
    ) -> ServicePortKey {
        ServicePortKey {
            namespace: ns.into(),
            name: name.into(),
            port_name: port_name.into(),
            protocol,
            family,
            scope: Scope::Internal,
        }
    }

    fn addrs(list: &[&str]) -> BTreeSet<SocketAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn desired(frontends: &[&str], backends: &[&str]) -> DesiredService {
        DesiredService {
            frontends: addrs(frontends),
            backends: addrs(backends),
            flags: 0,
            ..Default::default()
        }
    }

    fn state(entries: Vec<(ServicePortKey, DesiredService)>) -> DesiredState {
        DesiredState {
            services: entries.into_iter().collect(),
        }
    }

    use Family::{V4, V6};
    use Protocol::{Tcp, Udp};

    const NO_ERRORS: Vec<String> = Vec::new();

    /// A Service with the given spec body (indented two spaces).
    fn svc(ns: &str, name: &str, spec: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}"
        )
    }

    /// An EndpointSlice of Service `service` with the given body (top-level fields).
    fn slice(ns: &str, name: &str, service: &str, body: &str) -> String {
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: {service}}}\n{body}"
        )
    }

    #[test]
    fn cluster_ip_with_ready_endpoints() {
        let yaml = svc(
            "shop",
            "web",
            "  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80, targetPort: 8080}]\n",
        ) + &slice(
            "shop",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints:\n- addresses: [10.0.0.2]\n- addresses: [10.0.0.1]\n  conditions: {ready: true}\nports: [{name: http, port: 8080, protocol: TCP}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![(
                key("shop", "web", "http", Tcp, V4),
                desired(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"])
            )])
        );
    }

    #[test]
    fn dual_stack_cluster_ips_split_by_family() {
        let yaml = svc(
            "default",
            "ds",
            "  clusterIP: 10.96.0.20\n  clusterIPs: [10.96.0.20, 'fd00::20']\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "ds-v4",
            "ds",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
        ) + &slice(
            "default",
            "ds-v6",
            "ds",
            "addressType: IPv6\nendpoints: [{addresses: ['fd01::1']}]\nports: [{port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![
                (
                    key("default", "ds", "", Tcp, V4),
                    desired(&["10.96.0.20:80"], &["10.0.0.1:8080"])
                ),
                (
                    key("default", "ds", "", Tcp, V6),
                    desired(&["[fd00::20]:80"], &["[fd01::1]:8080"])
                ),
            ])
        );
    }

    #[test]
    fn cluster_ips_take_precedence_and_cluster_ip_is_the_fallback() {
        // clusterIPs alone (IPv6 first).
        let yaml = svc(
            "default",
            "a",
            "  clusterIPs: ['fd00::1', 10.96.0.1]\n  ports: [{port: 80}]\n",
        ) + &svc(
            "default",
            "b",
            "  clusterIP: 10.96.0.2\n  clusterIPs: []\n  ports: [{port: 80}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![
                (
                    key("default", "a", "", Tcp, V4),
                    desired(&["10.96.0.1:80"], &[])
                ),
                (
                    key("default", "a", "", Tcp, V6),
                    desired(&["[fd00::1]:80"], &[])
                ),
                (
                    key("default", "b", "", Tcp, V4),
                    desired(&["10.96.0.2:80"], &[])
                ),
            ])
        );
    }

    #[test]
    fn headless_external_name_and_no_cluster_ip_are_ignored() {
        let yaml = svc(
            "default",
            "headless",
            "  clusterIP: None\n  ports: [{port: 80}]\n",
        ) + &svc(
            "default",
            "headless2",
            "  clusterIPs: [None]\n  ports: [{port: 80}]\n",
        ) + &svc(
            "default",
            "ext",
            "  type: ExternalName\n  externalName: example.com\n  ports: [{port: 80}]\n",
        ) + &svc("default", "noip", "  ports: [{port: 80}]\n")
            + &svc(
                "default",
                "emptyip",
                "  clusterIP: ''\n  ports: [{port: 80}]\n",
            )
            + "---\napiVersion: v1\nkind: Service\nmetadata: {name: nospec}\n"
            + &slice(
                "default",
                "headless-1",
                "headless",
                "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 80}]\n",
            );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(s, DesiredState::default());
    }

    #[test]
    fn node_port_and_load_balancer_services_use_their_cluster_ips() {
        let yaml = svc(
            "default",
            "np",
            "  type: NodePort\n  clusterIP: 10.96.0.5\n  ports: [{port: 80, nodePort: 30080}]\n",
        ) + &svc(
            "default",
            "lb",
            "  type: LoadBalancer\n  clusterIP: 10.96.0.6\n  ports: [{port: 443}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![
                (
                    key("default", "lb", "", Tcp, V4),
                    desired(&["10.96.0.6:443"], &[])
                ),
                (
                    key("default", "np", "", Tcp, V4),
                    desired(&["10.96.0.5:80"], &[])
                ),
            ])
        );
    }

    #[test]
    fn protocols_default_tcp_udp_and_sctp_warning() {
        let yaml = svc(
            "kube-system",
            "dns",
            "  clusterIP: 10.96.0.10\n  ports:\n  - {name: dns, port: 53, protocol: UDP}\n  - {name: dns-tcp, port: 53}\n  - {name: sig, port: 9000, protocol: SCTP}\n",
        ) + &slice(
            "kube-system",
            "dns-1",
            "dns",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.53]}]\nports:\n- {name: dns, port: 5353, protocol: UDP}\n- {name: dns-tcp, port: 5353}\n- {name: sig, port: 9000, protocol: SCTP}\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(
            e,
            vec![
                "test.yaml: Service kube-system/dns: port 9000/SCTP (\"sig\"): SCTP is not supported; port skipped"
            ]
        );
        assert_eq!(
            s,
            state(vec![
                (
                    key("kube-system", "dns", "dns", Udp, V4),
                    desired(&["10.96.0.10:53"], &["10.0.0.53:5353"])
                ),
                (
                    key("kube-system", "dns", "dns-tcp", Tcp, V4),
                    desired(&["10.96.0.10:53"], &["10.0.0.53:5353"])
                ),
            ])
        );
        assert_eq!(Tcp.number(), 6);
        assert_eq!(Udp.number(), 17);
    }

    /// A good Service next to each bad one, to show the bad one does not affect it.
    fn good() -> String {
        svc(
            "default",
            "good",
            "  clusterIP: 10.96.1.1\n  ports: [{port: 80}]\n",
        )
    }

    fn good_state() -> DesiredState {
        state(vec![(
            key("default", "good", "", Tcp, V4),
            desired(&["10.96.1.1:80"], &[]),
        )])
    }

    fn assert_rejected(spec: &str, reason: &str) {
        let (s, e) = build_yaml(&(good() + &svc("default", "bad", spec)));
        assert_eq!(
            e,
            vec![format!(
                "test.yaml: Service default/bad: {reason}; Service skipped"
            )],
            "{spec}"
        );
        assert_eq!(s, good_state(), "{spec}");
    }

    #[test]
    fn invalid_cluster_ip_skips_the_service() {
        assert_rejected(
            "  clusterIP: 10.96.0.300\n  ports: [{port: 80}]\n",
            "invalid cluster IP: \"10.96.0.300\" is not a valid IP address",
        );
        assert_rejected(
            "  clusterIPs: [10.96.0.3, nonsense]\n  ports: [{port: 80}]\n",
            "invalid cluster IP: \"nonsense\" is not a valid IP address",
        );
        assert_rejected(
            "  clusterIP: 127.0.0.1\n  ports: [{port: 80}]\n",
            "cluster IP 127.0.0.1 is not usable (unspecified, loopback, link-local, multicast or broadcast)",
        );
        assert_rejected(
            "  clusterIP: 0.0.0.0\n  ports: [{port: 80}]\n",
            "cluster IP 0.0.0.0 is not usable (unspecified, loopback, link-local, multicast or broadcast)",
        );
        // An IPv4-mapped IPv6 address would turn an IPv6 Service into an IPv4 frontend.
        assert_rejected(
            "  ipFamilies: [IPv6]\n  clusterIP: '::ffff:198.19.200.90'\n  ports: [{port: 80}]\n",
            "invalid cluster IP: \"::ffff:198.19.200.90\" is an IPv4-mapped IPv6 address (write the IPv4 address itself)",
        );
    }

    #[test]
    fn two_cluster_ips_of_one_family_skip_the_service() {
        assert_rejected(
            "  clusterIPs: [10.96.0.3, 10.96.0.4]\n  ports: [{port: 80}]\n",
            "clusterIPs has two IPv4 addresses (10.96.0.3 and 10.96.0.4)",
        );
        assert_rejected(
            "  clusterIPs: ['fd00::3', 10.96.0.4, 'fd00::4']\n  ports: [{port: 80}]\n",
            "clusterIPs has two IPv6 addresses (fd00::3 and fd00::4)",
        );
    }

    #[test]
    fn cluster_ip_must_match_first_cluster_ips() {
        assert_rejected(
            "  clusterIP: 10.96.0.3\n  clusterIPs: [10.96.0.4]\n  ports: [{port: 80}]\n",
            "clusterIP 10.96.0.3 does not match clusterIPs[0] 10.96.0.4",
        );
    }

    #[test]
    fn out_of_range_ports_skip_the_service() {
        assert_rejected(
            "  clusterIP: 10.96.0.3\n  ports: [{port: 0}]\n",
            "port 0 is out of range 1-65535",
        );
        assert_rejected(
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80, name: a}, {name: big, port: 65536}]\n",
            "port 65536 (\"big\") is out of range 1-65535",
        );
        assert_rejected(
            "  clusterIP: 10.96.0.3\n  ports: [{port: -1}]\n",
            "port -1 is out of range 1-65535",
        );
    }

    #[test]
    fn duplicate_ports_skip_the_service() {
        assert_rejected(
            "  clusterIP: 10.96.0.3\n  ports: [{name: a, port: 80}, {name: b, port: 80, protocol: TCP}]\n",
            "port 80/TCP is defined twice",
        );
        assert_rejected(
            "  clusterIP: 10.96.0.3\n  ports: [{name: a, port: 80}, {name: a, port: 81}]\n",
            "port name \"a\" is used twice",
        );
        assert_rejected(
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}, {port: 81}]\n",
            "port name \"\" is used twice",
        );
        assert_rejected(
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80, protocol: HTTP}]\n",
            "unsupported protocol \"HTTP\" on port 80",
        );
    }

    #[test]
    fn colliding_frontend_skips_the_later_service() {
        let yaml = good()
            + &svc(
                "default",
                "later",
                "  clusterIP: 10.96.1.1\n  ports: [{port: 80}]\n",
            )
            + &svc(
                "default",
                "other-port",
                "  clusterIP: 10.96.1.1\n  ports: [{port: 81}]\n",
            );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(
            e,
            vec![
                "test.yaml: Service default/later: frontend 10.96.1.1:80/TCP is already used by Service default/good; Service skipped"
            ]
        );
        assert_eq!(
            s,
            state(vec![
                (
                    key("default", "good", "", Tcp, V4),
                    desired(&["10.96.1.1:80"], &[])
                ),
                (
                    key("default", "other-port", "", Tcp, V4),
                    desired(&["10.96.1.1:81"], &[])
                ),
            ])
        );
    }

    #[test]
    fn service_without_ports_has_no_frontends() {
        let (s, e) = build_yaml(&svc("default", "noports", "  clusterIP: 10.96.0.3\n"));
        assert_eq!(e, NO_ERRORS);
        assert_eq!(s, DesiredState::default());
    }

    #[test]
    fn slices_link_by_label_in_the_same_namespace_only() {
        let yaml = svc("a", "web", "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n")
            + &slice("a", "web-1", "web", "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n")
            // Same label, other namespace.
            + &slice("b", "web-1", "web", "addressType: IPv4\nendpoints: [{addresses: [10.0.0.2]}]\nports: [{port: 8080}]\n")
            // No label.
            + "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-x, namespace: a}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.3]}]\nports: [{port: 8080}]\n";
        let (s, e) = build_yaml(&yaml);
        // The slice without the label is ignored, with one warning naming it.
        assert_eq!(
            e,
            [
                "test.yaml: EndpointSlice a/web-x: no kubernetes.io/service-name label, so it belongs to no Service; slice ignored (as kube-proxy does)"
            ]
        );
        assert_eq!(
            s,
            state(vec![(
                key("a", "web", "", Tcp, V4),
                desired(&["10.96.0.3:80"], &["10.0.0.1:8080"])
            )])
        );
    }

    #[test]
    fn selectorless_service_with_hand_made_slice() {
        let yaml = svc(
            "default",
            "ext-db",
            "  clusterIP: 10.96.0.7\n  ports: [{name: pg, port: 5432}]\n",
        ) + &slice(
            "default",
            "ext-db-manual",
            "ext-db",
            "addressType: IPv4\nendpoints: [{addresses: [192.168.1.10]}, {addresses: [192.168.1.11]}]\nports: [{name: pg, port: 5432}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![(
                key("default", "ext-db", "pg", Tcp, V4),
                desired(
                    &["10.96.0.7:5432"],
                    &["192.168.1.10:5432", "192.168.1.11:5432"]
                )
            )])
        );
    }

    #[test]
    fn address_types_fqdn_ignored_unknown_rejected() {
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "web-fqdn",
            "web",
            "addressType: FQDN\nendpoints: [{addresses: [example.com]}]\nports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "web-odd",
            "web",
            "addressType: IPX\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 80}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(
            e,
            vec![
                "test.yaml: EndpointSlice default/web-odd: unsupported addressType \"IPX\"; EndpointSlice skipped"
            ]
        );
        assert_eq!(
            s,
            state(vec![(
                key("default", "web", "", Tcp, V4),
                desired(&["10.96.0.3:80"], &[])
            )])
        );
    }

    #[test]
    fn readiness_unset_is_ready_false_and_terminating_are_excluded() {
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints:\n- addresses: [10.0.0.1]\n- addresses: [10.0.0.2]\n  conditions: {}\n- addresses: [10.0.0.3]\n  conditions: {ready: true, serving: true}\n- addresses: [10.0.0.4]\n  conditions: {ready: false}\n- addresses: [10.0.0.5]\n  conditions: {ready: false, serving: true, terminating: true}\nports: [{port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![(
                key("default", "web", "", Tcp, V4),
                desired(
                    &["10.96.0.3:80"],
                    &["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]
                )
            )])
        );
    }

    #[test]
    fn only_the_first_address_of_an_endpoint_is_used() {
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1, 10.0.0.2]}, {addresses: []}]\nports: [{port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(
            e,
            vec![
                "test.yaml: EndpointSlice default/web-1: endpoint 1 has no addresses; endpoint skipped"
            ]
        );
        assert_eq!(
            s,
            state(vec![(
                key("default", "web", "", Tcp, V4),
                desired(&["10.96.0.3:80"], &["10.0.0.1:8080"])
            )])
        );
    }

    #[test]
    fn bad_endpoint_addresses_skip_only_that_endpoint() {
        let yaml = svc(
            "default",
            "web",
            "  clusterIPs: [10.96.0.3, 'fd00::3']\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "web-v4",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.999]}, {addresses: ['fd01::1']}, {addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
        ) + &slice(
            "default",
            "web-v6",
            "web",
            "addressType: IPv6\nendpoints: [{addresses: [10.0.0.2]}, {addresses: ['fd01::2']}, {addresses: ['::ffff:10.0.0.4']}, {addresses: ['fe80::1']}]\nports: [{port: 8080}]\n",
        ) + &slice(
            "default",
            "web-special",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [127.0.0.1]}, {addresses: [169.254.169.254]}, {addresses: [224.0.0.1]}, {addresses: [0.0.0.0]}]\nports: [{port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(
            e,
            vec![
                "test.yaml: EndpointSlice default/web-special: endpoint address 127.0.0.1 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
                "test.yaml: EndpointSlice default/web-special: endpoint address 169.254.169.254 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
                "test.yaml: EndpointSlice default/web-special: endpoint address 224.0.0.1 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
                "test.yaml: EndpointSlice default/web-special: endpoint address 0.0.0.0 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
                "test.yaml: EndpointSlice default/web-v4: endpoint address \"10.0.0.999\" is not a valid IP address; endpoint skipped",
                "test.yaml: EndpointSlice default/web-v4: endpoint address fd01::1 is not an IPv4 address (addressType IPv4); endpoint skipped",
                "test.yaml: EndpointSlice default/web-v6: endpoint address 10.0.0.2 is not an IPv6 address (addressType IPv6); endpoint skipped",
                "test.yaml: EndpointSlice default/web-v6: endpoint address \"::ffff:10.0.0.4\" is an IPv4-mapped IPv6 address (write the IPv4 address itself); endpoint skipped",
                "test.yaml: EndpointSlice default/web-v6: endpoint address fe80::1 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
            ]
        );
        assert_eq!(
            s,
            state(vec![
                (
                    key("default", "web", "", Tcp, V4),
                    desired(&["10.96.0.3:80"], &["10.0.0.1:8080"])
                ),
                (
                    key("default", "web", "", Tcp, V6),
                    desired(&["[fd00::3]:80"], &["[fd01::2]:8080"])
                ),
            ])
        );
    }

    #[test]
    fn bad_slice_ports_skip_only_that_port() {
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{name: a, port: 80}, {name: b, port: 81}, {name: c, port: 82}, {name: d, port: 83}]\n",
        ) + &slice(
            "default",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports:\n- {name: a, port: 0}\n- {name: b, port: 70000}\n- {name: c}\n- {name: d, port: 8083}\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(
            e,
            vec![
                "test.yaml: EndpointSlice default/web-1: port 0 (\"a\") is out of range 1-65535; port skipped",
                "test.yaml: EndpointSlice default/web-1: port 70000 (\"b\") is out of range 1-65535; port skipped",
                "test.yaml: EndpointSlice default/web-1: port (\"c\") has no port number; port skipped",
            ]
        );
        assert_eq!(
            s,
            state(vec![
                (
                    key("default", "web", "a", Tcp, V4),
                    desired(&["10.96.0.3:80"], &[])
                ),
                (
                    key("default", "web", "b", Tcp, V4),
                    desired(&["10.96.0.3:81"], &[])
                ),
                (
                    key("default", "web", "c", Tcp, V4),
                    desired(&["10.96.0.3:82"], &[])
                ),
                (
                    key("default", "web", "d", Tcp, V4),
                    desired(&["10.96.0.3:83"], &["10.0.0.1:8083"])
                ),
            ])
        );
    }

    #[test]
    fn target_port_resolution_by_port_name_per_slice() {
        // Named targetPort resolved differently on two slices, even for the same IP.
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{name: http, port: 80, targetPort: web}, {name: metrics, port: 9100}]\n",
        ) + &slice(
            "default",
            "web-old",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}, {addresses: [10.0.0.2]}]\nports: [{name: http, port: 8080}, {name: metrics, port: 9100}]\n",
        ) + &slice(
            "default",
            "web-new",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{name: http, port: 9090}]\n",
        ) + &slice(
            "default",
            "web-other-name",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.9]}]\nports: [{name: https, port: 8443}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![
                (
                    key("default", "web", "http", Tcp, V4),
                    desired(
                        &["10.96.0.3:80"],
                        &["10.0.0.1:8080", "10.0.0.1:9090", "10.0.0.2:8080"]
                    )
                ),
                (
                    key("default", "web", "metrics", Tcp, V4),
                    desired(&["10.96.0.3:9100"], &["10.0.0.1:9100", "10.0.0.2:9100"])
                ),
            ])
        );
    }

    #[test]
    fn unnamed_port_matches_unnamed_or_empty_named_slice_ports() {
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80, targetPort: 8080}]\n",
        ) + &slice(
            "default",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
        ) + &slice(
            "default",
            "web-2",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.2]}]\nports: [{name: '', port: 8080}]\n",
        ) + &slice(
            "default",
            "web-3",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.3]}]\nports: [{name: http, port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![(
                key("default", "web", "", Tcp, V4),
                desired(&["10.96.0.3:80"], &["10.0.0.1:8080", "10.0.0.2:8080"])
            )])
        );
    }

    #[test]
    fn slice_port_protocol_must_match() {
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{name: p, port: 80}]\n",
        ) + &slice(
            "default",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{name: p, port: 8080, protocol: UDP}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![(
                key("default", "web", "p", Tcp, V4),
                desired(&["10.96.0.3:80"], &[])
            )])
        );
    }

    #[test]
    fn slices_are_merged_and_backends_deduplicated() {
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}, {addresses: [10.0.0.2]}, {addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
        ) + &slice(
            "default",
            "web-2",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.2]}, {addresses: [10.0.0.3]}]\nports: [{port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![(
                key("default", "web", "", Tcp, V4),
                desired(
                    &["10.96.0.3:80"],
                    &["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]
                )
            )])
        );
    }

    #[test]
    fn frontend_without_endpoints_and_endpoints_without_frontend_family() {
        // IPv4-only Service: the IPv6 slice is dropped; no slice at all still gives a
        // frontend with empty backends.
        let yaml = svc(
            "default",
            "v4only",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "v4only-v6",
            "v4only",
            "addressType: IPv6\nendpoints: [{addresses: ['fd01::1']}]\nports: [{port: 8080}]\n",
        ) + &svc(
            "default",
            "empty",
            "  clusterIPs: [10.96.0.4, 'fd00::4']\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "empty-v4",
            "empty",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1], conditions: {ready: false}}]\nports: [{port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(
            s,
            state(vec![
                (
                    key("default", "empty", "", Tcp, V4),
                    desired(&["10.96.0.4:80"], &[])
                ),
                (
                    key("default", "empty", "", Tcp, V6),
                    desired(&["[fd00::4]:80"], &[])
                ),
                (
                    key("default", "v4only", "", Tcp, V4),
                    desired(&["10.96.0.3:80"], &[])
                ),
            ])
        );
    }

    #[test]
    fn slice_errors_are_reported_even_without_a_service() {
        let yaml = slice(
            "default",
            "orphan",
            "gone",
            "addressType: IPv4\nendpoints: [{addresses: [bad]}]\nports: [{port: 80}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(
            e,
            vec![
                "test.yaml: EndpointSlice default/orphan: endpoint address \"bad\" is not a valid IP address; endpoint skipped"
            ]
        );
        assert_eq!(s, DesiredState::default());
    }

    #[test]
    fn counts() {
        // Two Services share a backend (same addr, port, proto): one backend, two slots.
        let yaml = svc(
            "default",
            "a",
            "  clusterIPs: [10.96.0.1, 'fd00::1']\n  ports: [{name: x, port: 80}, {name: y, port: 53, protocol: UDP}]\n",
        ) + &svc(
            "default",
            "b",
            "  clusterIP: 10.96.0.2\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "a-1",
            "a",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}, {addresses: [10.0.0.2]}]\nports: [{name: x, port: 8080}, {name: y, port: 8080, protocol: UDP}]\n",
        ) + &slice(
            "default",
            "b-1",
            "b",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(s.services.len(), 5);
        assert_eq!(
            s.vips(),
            ["10.96.0.1", "10.96.0.2", "fd00::1"]
                .iter()
                .map(|a| a.parse().unwrap())
                .collect()
        );
        // a: 2 ports x 2 families, b: 1.
        assert_eq!(s.frontend_count(), 5);
        // 10.0.0.1:8080/TCP, 10.0.0.2:8080/TCP, 10.0.0.1:8080/UDP, 10.0.0.2:8080/UDP.
        assert_eq!(s.backend_count(), 4);
        // a/x/V4: 2, a/y/V4: 2, b/V4: 1, the V6 sets: 0.
        assert_eq!(s.slot_count(), 5);
        assert_eq!(DesiredState::default().frontend_count(), 0);
    }

    #[test]
    fn build_is_deterministic() {
        let yaml = svc(
            "b",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        ) + &svc(
            "a",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        );
        let (s1, e1) = build_yaml(&yaml);
        let (s2, e2) = build_yaml(&yaml);
        assert_eq!((&s1, &e1), (&s2, &e2));
        // Namespace "a" sorts first and keeps the frontend.
        assert_eq!(
            e1,
            vec![
                "test.yaml: Service b/web: frontend 10.96.0.3:80/TCP is already used by Service a/web; Service skipped"
            ]
        );
    }

    #[test]
    fn the_oldest_service_keeps_a_contested_external_ip() {
        let with_time = |name: &str, t: &str| {
            format!(
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default, creationTimestamp: '{t}'}}\nspec:\n  clusterIP: 10.96.0.{}\n  externalIPs: [192.0.2.7]\n  ports: [{{port: 80}}]\n",
                if name == "web" { 3 } else { 4 }
            )
        };
        // "dup" sorts before "web" but was created later: "web" keeps the address.
        let yaml =
            with_time("web", "2026-01-01T00:00:00Z") + &with_time("dup", "2026-06-01T00:00:00Z");
        let (_, e) = build_yaml(&yaml);
        assert_eq!(
            e,
            vec![
                "test.yaml: Service default/dup: externalIP 192.0.2.7: frontend 192.0.2.7:80/TCP is already used by Service default/web; address skipped"
            ]
        );
    }

    /// A Node manifest named `name` in `zone`.
    fn node(name: &str, zone: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels: {{topology.kubernetes.io/zone: {zone}}}\n"
        )
    }

    /// One endpoint as a YAML flow mapping.
    fn ep(addr: &str, node: &str, cond: &str, hints: &str) -> String {
        let mut s = format!("{{addresses: [{addr}], nodeName: {node}");
        if !cond.is_empty() {
            s += &format!(", conditions: {{{cond}}}");
        }
        if !hints.is_empty() {
            s += &format!(", hints: {{{hints}}}");
        }
        s + "}"
    }

    /// Backends of web's internal set (port 80/TCP/IPv4) for endpoints `eps`, seen from
    /// node-1 in zone-a, with extra spec lines.
    fn web_backends(spec_extra: &str, eps: &[String]) -> (DesiredService, Vec<String>) {
        let yaml = node("node-1", "zone-a")
            + &svc(
                "default",
                "web",
                &format!("  clusterIP: 10.96.0.10\n  ports: [{{port: 80}}]\n{spec_extra}"),
            )
            + &slice(
                "default",
                "web-1",
                "web",
                &format!(
                    "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                    eps.join(", ")
                ),
            );
        let (s, e) = build_yaml(&yaml);
        let d = s.services.get(&key("default", "web", "", Tcp, V4));
        (d.cloned().unwrap_or_default(), e)
    }

    fn set(list: &[&str]) -> BTreeSet<SocketAddr> {
        list.iter()
            .map(|a| format!("{a}:8080").parse().unwrap())
            .collect()
    }

    #[test]
    fn terminating_endpoints_are_used_only_when_none_is_ready() {
        let ready = ep("10.0.0.1", "node-2", "", "");
        let term_serving = ep(
            "10.0.0.2",
            "node-2",
            "ready: false, serving: true, terminating: true",
            "",
        );
        let term_not_serving = ep(
            "10.0.0.3",
            "node-2",
            "ready: false, serving: false, terminating: true",
            "",
        );
        let not_ready = ep("10.0.0.4", "node-2", "ready: false", "");
        let all = [
            ready.clone(),
            term_serving.clone(),
            term_not_serving.clone(),
            not_ready.clone(),
        ];
        assert_eq!(web_backends("", &all).0.backends, set(&["10.0.0.1"]));
        // No ready endpoint: the serving terminating ones.
        let (d, e) = web_backends("", &all[1..]);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(d.backends, set(&["10.0.0.2"]));
        // Terminating but not serving, or not ready without terminating: nothing.
        assert_eq!(web_backends("", &all[2..]).0.backends, set(&[]));
    }

    #[test]
    fn internal_traffic_policy_local_uses_this_nodes_endpoints_and_flags_the_frontend() {
        let eps = [
            ep("10.0.0.1", "node-1", "", ""),
            ep("10.0.0.2", "node-2", "", ""),
        ];
        let (d, e) = web_backends("  internalTrafficPolicy: Local\n", &eps);
        assert_eq!(e, NO_ERRORS);
        assert_eq!(d.backends, set(&["10.0.0.1"]));
        assert_eq!(d.flags, proxy_common::FRONTEND_F_LOCAL_ONLY);
        // None local: empty, still flagged (EHOSTUNREACH rather than ECONNREFUSED).
        let (d, _) = web_backends("  internalTrafficPolicy: Local\n", &eps[1..]);
        assert!(d.backends.is_empty());
        assert_eq!(d.flags, proxy_common::FRONTEND_F_LOCAL_ONLY);
        // No usable endpoint on any node (a not-ready one only): kube-proxy rejects, so the
        // frontend says there are none at all.
        let not_ready = [ep("10.0.0.2", "node-2", "ready: false", "")];
        let (d, _) = web_backends("  internalTrafficPolicy: Local\n", &not_ready);
        assert!(d.backends.is_empty());
        assert_eq!(
            d.flags,
            proxy_common::FRONTEND_F_LOCAL_ONLY | proxy_common::FRONTEND_F_NO_ENDPOINTS
        );
        // Cluster policy without endpoints carries no policy flag.
        let (d, _) = web_backends("", &not_ready);
        assert_eq!(d.flags, 0);
        // Local falls back to this node's serving terminating endpoints, independently of
        // the cluster-wide ready ones.
        let eps = [
            ep(
                "10.0.0.1",
                "node-1",
                "ready: false, serving: true, terminating: true",
                "",
            ),
            ep("10.0.0.2", "node-2", "", ""),
        ];
        let (d, _) = web_backends("  internalTrafficPolicy: Local\n", &eps);
        assert_eq!(d.backends, set(&["10.0.0.1"]));
        // Cluster policy (explicit) uses both nodes.
        let (d, _) = web_backends("  internalTrafficPolicy: Cluster\n", &eps);
        assert_eq!(d.backends, set(&["10.0.0.2"]));
        assert_eq!(d.flags, 0);
        let (_, e) = web_backends("  internalTrafficPolicy: Nearby\n", &eps);
        assert_eq!(
            e,
            vec![
                "test.yaml: Service default/web: internalTrafficPolicy \"Nearby\" is not Cluster or Local; Service skipped"
            ]
        );
    }

    #[test]
    fn zone_hints_narrow_the_cluster_set_with_kube_proxys_fallbacks() {
        let za = "forZones: [{name: zone-a}]";
        let zb = "forZones: [{name: zone-b}]";
        let eps = [
            ep("10.0.0.1", "node-1", "", za),
            ep("10.0.0.2", "node-2", "", zb),
            ep("10.0.0.3", "node-3", "", za),
        ];
        assert_eq!(
            web_backends("", &eps).0.backends,
            set(&["10.0.0.1", "10.0.0.3"])
        );
        // trafficDistribution is the controller's input; kube-proxy (and we) read hints.
        assert_eq!(
            web_backends("  trafficDistribution: PreferClose\n", &eps)
                .0
                .backends,
            set(&["10.0.0.1", "10.0.0.3"])
        );
        // One ready endpoint without hints: hints are ignored.
        let partial = [
            eps[0].clone(),
            eps[1].clone(),
            ep("10.0.0.3", "node-3", "", ""),
        ];
        assert_eq!(
            web_backends("", &partial).0.backends,
            set(&["10.0.0.1", "10.0.0.2", "10.0.0.3"])
        );
        // A not-ready endpoint without hints does not disable them.
        let with_unready = [
            eps[0].clone(),
            eps[1].clone(),
            ep("10.0.0.4", "node-3", "ready: false", ""),
        ];
        assert_eq!(
            web_backends("", &with_unready).0.backends,
            set(&["10.0.0.1"])
        );
        // No endpoint for this zone: every endpoint.
        let other_zone = [eps[1].clone(), ep("10.0.0.5", "node-2", "", zb)];
        assert_eq!(
            web_backends("", &other_zone).0.backends,
            set(&["10.0.0.2", "10.0.0.5"])
        );
    }

    #[test]
    fn node_hints_win_over_zone_hints_and_need_this_node() {
        let h = |zone: &str, node: &str| {
            format!("forZones: [{{name: {zone}}}], forNodes: [{{name: {node}}}]")
        };
        let eps = [
            ep("10.0.0.1", "node-1", "", &h("zone-a", "node-1")),
            ep("10.0.0.2", "node-2", "", &h("zone-a", "node-2")),
            ep("10.0.0.3", "node-3", "", &h("zone-b", "node-3")),
        ];
        assert_eq!(web_backends("", &eps).0.backends, set(&["10.0.0.1"]));
        // No endpoint hinted for node-1: zone hints apply.
        assert_eq!(web_backends("", &eps[1..]).0.backends, set(&["10.0.0.2"]));
        let sets = categorize(&PortEndpoints::new(), "node-1", "zone-a");
        assert_eq!(sets, EndpointSets::default());
    }

    #[test]
    fn zone_hints_need_the_node_zone_label() {
        // Same endpoints, Node object without a zone: hints cannot match, all are used.
        let yaml = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "web-1",
            "web",
            &format!(
                "addressType: IPv4\nendpoints: [{}, {}]\nports: [{{port: 8080}}]\n",
                ep("10.0.0.1", "node-1", "", "forZones: [{name: zone-a}]"),
                ep("10.0.0.2", "node-2", "", "forZones: [{name: zone-b}]")
            ),
        );
        let (s, _) = build_yaml(&yaml);
        assert_eq!(
            s.services[&key("default", "web", "", Tcp, V4)].backends,
            set(&["10.0.0.1", "10.0.0.2"])
        );
    }

    #[test]
    fn external_addresses_get_the_cluster_endpoints_whatever_the_policies() {
        let eps = [
            ep("10.0.0.1", "node-1", "", ""),
            ep("10.0.0.2", "node-2", "", ""),
        ];
        let yaml = svc(
            "default",
            "lb",
            "  type: LoadBalancer\n  clusterIPs: [10.96.0.10, 'fd00::10']\n  ports: [{port: 80}]\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Local\n  externalIPs: [192.0.2.7, 'not-an-ip', 127.0.0.1, '::ffff:192.0.2.9', 169.254.169.254]\n",
        ) + "status:\n  loadBalancer:\n    ingress:\n    - {ip: 192.0.2.8}\n    - {ip: 192.0.2.9, ipMode: Proxy}\n    - {ip: '2001:db8::8'}\n    - {hostname: lb.example.com}\n"
            + &slice(
                "default",
                "lb-1",
                "lb",
                &format!(
                    "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                    eps.join(", ")
                ),
            )
            + &svc(
                "default",
                "single",
                "  clusterIP: 10.96.0.11\n  ports: [{port: 80}]\n  externalIPs: ['2001:db8::1', 192.0.2.7]\n",
            );
        let (s, e) = build_yaml(&yaml);
        let ext = ServicePortKey {
            scope: Scope::External,
            ..key("default", "lb", "", Tcp, V4)
        };
        assert_eq!(
            s.services[&ext],
            DesiredService {
                frontends: addrs(&["192.0.2.7:80", "192.0.2.8:80"]),
                backends: set(&["10.0.0.1", "10.0.0.2"]),
                flags: proxy_common::FRONTEND_F_EXTERNAL,
                ..Default::default()
            }
        );
        // From outside the node the same frontends follow externalTrafficPolicy: Local.
        let ingress = ServicePortKey {
            scope: Scope::Ingress,
            ..key("default", "lb", "", Tcp, V4)
        };
        assert_eq!(
            s.services[&ingress],
            DesiredService {
                frontends: addrs(&["192.0.2.7:80", "192.0.2.8:80"]),
                backends: set(&["10.0.0.1"]),
                flags: proxy_common::FRONTEND_F_EXTERNAL | proxy_common::FRONTEND_F_LOCAL_ONLY,
                ..Default::default()
            }
        );
        let ext6 = ServicePortKey {
            scope: Scope::External,
            ..key("default", "lb", "", Tcp, V6)
        };
        assert_eq!(s.services[&ext6].frontends, addrs(&["[2001:db8::8]:80"]));
        // The cluster IP keeps its Local policy.
        let int = &s.services[&key("default", "lb", "", Tcp, V4)];
        assert_eq!(int.backends, set(&["10.0.0.1"]));
        assert_eq!(int.flags, proxy_common::FRONTEND_F_LOCAL_ONLY);
        assert_eq!(
            e,
            vec![
                "test.yaml: Service default/lb: externalIP \"not-an-ip\" is not a valid IP address; address skipped",
                "test.yaml: Service default/lb: externalIP 127.0.0.1 is not usable (unspecified, loopback, link-local, multicast or broadcast); address skipped",
                "test.yaml: Service default/lb: externalIP \"::ffff:192.0.2.9\" is an IPv4-mapped IPv6 address (write the IPv4 address itself); address skipped",
                "test.yaml: Service default/lb: externalIP 169.254.169.254 is not usable (unspecified, loopback, link-local, multicast or broadcast); address skipped",
                "test.yaml: Service default/single: externalIP 2001:db8::1 is IPv6 but the Service has no IPv6 cluster IP; address skipped",
                "test.yaml: Service default/single: externalIP 192.0.2.7: frontend 192.0.2.7:80/TCP is already used by Service default/lb; address skipped",
            ]
        );
        // The single-stack Service keeps its cluster IP and has no external set.
        assert!(
            s.services
                .contains_key(&key("default", "single", "", Tcp, V4))
        );
        assert!(!s.services.contains_key(&ServicePortKey {
            scope: Scope::External,
            ..key("default", "single", "", Tcp, V4)
        }));
    }

    #[test]
    fn an_endpoint_in_two_slices_prefers_the_local_copy() {
        let yaml = node("node-1", "zone-a")
            + &svc(
                "default",
                "web",
                "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n  internalTrafficPolicy: Local\n",
            )
            + &slice(
                "default",
                "web-a",
                "web",
                &format!(
                    "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                    ep("10.0.0.1", "node-2", "", "")
                ),
            )
            + &slice(
                "default",
                "web-b",
                "web",
                &format!(
                    "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                    ep("10.0.0.1", "node-1", "", "")
                ),
            );
        let (s, _) = build_yaml(&yaml);
        assert_eq!(
            s.services[&key("default", "web", "", Tcp, V4)].backends,
            set(&["10.0.0.1"])
        );
    }

    /// Every (address, port, protocol, key scope) belongs to one backend set, also within
    /// one Service: an external IP equal to the Service's own cluster IP, and a node port
    /// two of its ports use on the same address, are skipped as taken.
    #[test]
    fn a_frontend_belongs_to_one_backend_set_within_a_service() {
        let yaml = "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 192.168.1.5}]}\n".to_string()
            + &svc(
                "default",
                "self",
                "  type: NodePort\n  clusterIP: 10.96.0.9\n  externalIPs: [10.96.0.9, 192.0.2.9]\n  ports: [{name: http, port: 80, nodePort: 30080}, {name: alt, port: 81, nodePort: 30080}]\n",
            );
        let (s, e) = build_yaml(&yaml);
        let mut owner: BTreeMap<(SocketAddr, Protocol, u8), &ServicePortKey> = BTreeMap::new();
        for (k, v) in &s.services {
            for f in &v.frontends {
                if let Some(other) = owner.insert((*f, k.protocol, k.scope.key_scope()), k) {
                    panic!("{f}/{} is a frontend of {other:?} and of {k:?}", k.protocol);
                }
            }
        }
        let ext = |port_name: &str| ServicePortKey {
            scope: Scope::External,
            ..key("default", "self", port_name, Protocol::Tcp, Family::V4)
        };
        assert_eq!(
            s.services[&ext("http")].frontends,
            addrs(&["192.0.2.9:80", "192.168.1.5:30080"])
        );
        assert_eq!(s.services[&ext("alt")].frontends, addrs(&["192.0.2.9:81"]));
        assert_eq!(
            e,
            vec![
                "test.yaml: Service default/self: externalIP 10.96.0.9: frontend 10.96.0.9:80/TCP is already used by another port or address of this Service; address skipped",
                "test.yaml: Service default/self: node port 192.168.1.5:30080/TCP is already used by another port or address of this Service; node port skipped",
            ]
        );
    }

    #[test]
    fn node_ports_on_this_nodes_addresses_with_nodeport_addresses() {
        let node_yaml = "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus:\n  addresses:\n  - {type: Hostname, address: node-1}\n  - {type: InternalIP, address: 192.168.1.5}\n  - {type: InternalIP, address: 192.168.1.6}\n  - {type: ExternalIP, address: 203.0.113.5}\n  - {type: InternalIP, address: 'fd00::5'}\n  - {type: ExternalIP, address: bogus}\n";
        let yaml = node_yaml.to_string()
            + &svc(
                "default",
                "np",
                "  type: NodePort\n  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80, nodePort: 30080}, {name: dns, port: 53, protocol: UDP, nodePort: 30053}]\n",
            )
            + &svc(
                "default",
                "zclash",
                "  type: NodePort\n  clusterIP: 10.96.0.11\n  ports: [{port: 80, nodePort: 30080}]\n",
            )
            + &slice(
                "default",
                "np-1",
                "np",
                "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1], nodeName: node-2}]\nports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]\n",
            );
        let ext = |port_name: &str, proto| ServicePortKey {
            scope: Scope::External,
            ..key("default", "np", port_name, proto, V4)
        };
        let node = |cidrs: &[&str], primary| NodeInfo {
            name: "node-1".into(),
            nodeport_addresses: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            nodeport_primary: primary,
            ..Default::default()
        };
        let (s, e) = build_yaml_on(&yaml, &node(&[], false));
        assert_eq!(
            s.services[&ext("http", Tcp)].frontends,
            addrs(&[
                "192.168.1.5:30080",
                "192.168.1.6:30080",
                "203.0.113.5:30080"
            ])
        );
        assert_eq!(
            s.services[&ext("dns", Udp)].frontends,
            addrs(&[
                "192.168.1.5:30053",
                "192.168.1.6:30053",
                "203.0.113.5:30053"
            ])
        );
        assert_eq!(s.services[&ext("http", Tcp)].backends, set(&["10.0.0.1"]));
        assert_eq!(
            e,
            vec![
                "test.yaml: Node node-1: status.addresses ExternalIP \"bogus\" is not a usable IP address; skipped for node ports",
                "test.yaml: Service default/zclash: node port 192.168.1.5:30080/TCP is already used by Service default/np; node port skipped",
                "test.yaml: Service default/zclash: node port 192.168.1.6:30080/TCP is already used by Service default/np; node port skipped",
                "test.yaml: Service default/zclash: node port 203.0.113.5:30080/TCP is already used by Service default/np; node port skipped",
            ]
        );
        // The IPv6 node address has no IPv6 cluster IP to serve.
        let (s, _) = build_yaml_on(&yaml, &node(&[], true));
        assert_eq!(
            s.services[&ext("http", Tcp)].frontends,
            addrs(&["192.168.1.5:30080"])
        );
        let (s, _) = build_yaml_on(&yaml, &node(&["203.0.113.0/24"], false));
        assert_eq!(
            s.services[&ext("http", Tcp)].frontends,
            addrs(&["203.0.113.5:30080"])
        );
        // Another node's name: no Node object, no node ports.
        let other = NodeInfo {
            name: "node-9".into(),
            ..Default::default()
        };
        let (s, _) = build_yaml_on(&yaml, &other);
        assert!(!s.services.contains_key(&ext("http", Tcp)));
    }

    const LB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 31000\n  loadBalancerSourceRanges: ['192.0.2.0/24', ' 198.51.100.7/32', 'bogus', '2001:db8::/32']\n  ports: [{port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.9}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: lb-1, namespace: default, labels: {kubernetes.io/service-name: lb}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints:\n- {addresses: [10.0.1.5], nodeName: node-1}\n- {addresses: [10.0.2.5], nodeName: node-2}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 192.0.2.50}, {type: Hostname, address: n1}]}\n";

    fn node1() -> NodeInfo {
        NodeInfo {
            name: "node-1".into(),
            ..Default::default()
        }
    }

    #[test]
    fn source_ranges_restrict_lb_ips_with_valid_ranges_of_their_family() {
        let m = Model::from_objects(&objects(LB), &node1());
        let errors: Vec<String> = m.errors().iter().map(ToString::to_string).collect();
        assert_eq!(
            errors,
            [
                "test.yaml: Service default/lb: loadBalancerSourceRanges: \"bogus\" is not a CIDR (ADDR/LEN); range ignored"
            ]
        );
        let ranges: Vec<(IpAddr, Vec<IpNet>)> = m
            .source_ranges()
            .map(|(ip, c)| (*ip, c.copied().collect()))
            .collect();
        // The IPv6 range does not apply to an IPv4 LB IP.
        assert_eq!(
            ranges,
            vec![(
                "203.0.113.9".parse().unwrap(),
                vec![
                    "192.0.2.0/24".parse().unwrap(),
                    "198.51.100.7/32".parse().unwrap()
                ]
            )]
        );
        // As map entries: a restriction marker and one allowed prefix per range.
        let e = crate::reconcile::node::source_range_entries(&m);
        let lb = crate::datapath::addr::ip_to_bytes("203.0.113.9".parse().unwrap());
        let marker = proxy_common::nat::SourceRange {
            lb_addr: lb,
            client: [0; 16],
        };
        assert_eq!(
            e.get(&(128, marker)),
            Some(&proxy_common::nat::SOURCE_RANGE_RESTRICTED)
        );
        let net = proxy_common::nat::SourceRange {
            lb_addr: lb,
            client: crate::datapath::addr::ip_to_bytes("192.0.2.0".parse().unwrap()),
        };
        assert_eq!(
            e.get(&(128 + 96 + 24, net)),
            Some(&proxy_common::nat::SOURCE_RANGE_ALLOW)
        );
        assert_eq!(e.len(), 3, "{e:?}");
    }

    #[test]
    fn all_invalid_ranges_allow_everyone() {
        let yaml = LB.replace(
            "['192.0.2.0/24', ' 198.51.100.7/32', 'bogus', '2001:db8::/32']",
            "['bogus']",
        );
        let m = Model::from_objects(&objects(&yaml), &node1());
        assert_eq!(m.source_ranges().count(), 0);
        assert_eq!(m.errors().len(), 1);
    }

    #[test]
    fn local_endpoints_node_addresses_and_health_checks() {
        let m = Model::from_objects(&objects(LB), &node1());
        assert_eq!(
            m.local_endpoints().copied().collect::<Vec<_>>(),
            vec!["10.0.1.5".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(
            m.node().ips(),
            BTreeSet::from(["192.0.2.50".parse().unwrap()])
        );
        let h = m.health_checks();
        let c = &h[&31000];
        assert_eq!((c.namespace.as_str(), c.name.as_str()), ("default", "lb"));
        assert_eq!(c.local_endpoints, 1);
        // Another node has no local endpoint: 0 (the server answers 503 there).
        let other = Model::from_objects(
            &objects(LB),
            &NodeInfo {
                name: "node-3".into(),
                ..Default::default()
            },
        );
        assert_eq!(other.health_checks()[&31000].local_endpoints, 0);
    }

    fn lb_local(name: &str, policy: &str, port: i64) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec: {{type: LoadBalancer, clusterIP: 10.96.0.{}, externalTrafficPolicy: {policy}, healthCheckNodePort: {port}, ports: [{{port: 80}}]}}\n",
            name.len() + name.as_bytes()[0] as usize % 50
        )
    }

    #[test]
    fn invalid_and_shared_health_ports_are_reported_naming_the_services() {
        let yaml = [
            lb_local("a-big", "Local", 99999),
            lb_local("b-zero", "Local", 0),
            lb_local("c-first", "Local", 31000),
            lb_local("d-second", "Local", 31000),
            lb_local("e-cluster", "Cluster", 99999),
            lb_local("f-ok", "Local", 31001),
        ]
        .concat();
        let mut m = Model::from_objects(&objects(&yaml), &node1());
        let h = m.health_checks();
        assert_eq!(h.keys().copied().collect::<Vec<_>>(), [31000, 31001]);
        assert_eq!(h[&31000].name, "c-first");
        let errors: Vec<String> = m.errors().iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 3, "{errors:#?}");
        assert!(
            errors[0].starts_with(
                "test.yaml: Service ns/a-big: healthCheckNodePort 99999 is not a port"
            ),
            "{}",
            errors[0]
        );
        assert!(
            errors[1]
                .starts_with("test.yaml: Service ns/b-zero: healthCheckNodePort 0 is not a port"),
            "{}",
            errors[1]
        );
        assert!(
            errors[2].contains("Service ns/d-second: healthCheckNodePort 31000")
                && errors[2].contains("Service ns/c-first"),
            "{}",
            errors[2]
        );
        // The first goes: the second gets the port, its error goes.
        m.apply(Change::Delete(
            Kind::Service,
            ("ns".into(), "c-first".into()),
        ));
        let d = m.commit();
        assert!(d.health_changed);
        assert_eq!(m.health_checks()[&31000].name, "d-second");
        assert_eq!(d.errors_removed.len(), 1, "{d:?}");
        assert_eq!(m.errors().len(), 2);
    }

    /// A Service `ns/{name}` on 10.96.1.{n}:80 with extra metadata lines, and its slice
    /// with one endpoint on another node and the same labels.
    fn labelled(name: &str, n: u8, labels: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns, labels: {{{labels}}}}}\nspec: {{clusterIP: 10.96.1.{n}, ports: [{{port: 80}}]}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: ns, labels: {{kubernetes.io/service-name: {name}{}{labels}}}}}\naddressType: IPv4\nports: [{{port: 80}}]\nendpoints: [{{addresses: [10.0.1.{n}], nodeName: node-2}}]\n",
            if labels.is_empty() { "" } else { ", " }
        )
    }

    #[test]
    fn objects_labelled_for_another_proxy_or_headless_are_not_proxied() {
        let yaml = labelled("plain", 1, "")
            + &labelled(
                "other-proxy",
                2,
                "service.kubernetes.io/service-proxy-name: other",
            )
            + &labelled(
                "empty-name",
                3,
                "service.kubernetes.io/service-proxy-name: ''",
            )
            + &labelled("headless", 4, "service.kubernetes.io/headless: ''");
        let (s, errors) = build_yaml(&yaml);
        assert!(errors.is_empty(), "{errors:?}");
        let names: BTreeSet<&str> = s.services.keys().map(|k| k.name.as_str()).collect();
        assert_eq!(
            names,
            BTreeSet::from(["plain"]),
            "any value of the label excludes"
        );

        // Gaining the label removes what the Service gave; losing it brings it back (the
        // watch's DELETED and ADDED events under kube-proxy's selector).
        let mut m = model(&labelled("web", 5, ""));
        assert_eq!(m.ports().len(), 1);
        apply_yaml(
            &mut m,
            &labelled("web", 5, "service.kubernetes.io/service-proxy-name: istio"),
        );
        let d = m.commit();
        assert!(m.ports().is_empty(), "{d:?}");
        assert_eq!(d.ports.len(), 1);
        apply_yaml(&mut m, &labelled("web", 5, ""));
        m.commit();
        let (k, v) = m.ports().iter().next().expect("back");
        assert_eq!(k.name, "web");
        assert_eq!(v.backends, addrs(&["10.0.1.5:80"]));
        // A slice alone with the label: the Service stays, without those endpoints.
        apply_yaml(
            &mut m,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: ns, labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ''}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints: [{addresses: [10.0.1.5]}]\n",
        );
        m.commit();
        assert!(m.ports().values().next().unwrap().backends.is_empty());
        assert_eq!(
            PROXY_LABEL_SELECTOR,
            format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}")
        );
    }

    #[test]
    fn a_node_being_deleted_or_tainted_for_deletion_is_not_eligible() {
        let node = |meta: &str, spec: &str| {
            format!(
                "---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-1{meta}}}\nspec: {{{spec}}}\n"
            )
        };
        let mut m = Model::new(node1());
        assert!(
            m.node().eligible(),
            "no Node object: nothing says it goes away"
        );
        apply_yaml(&mut m, &node("", ""));
        assert!(m.node().eligible());
        apply_yaml(
            &mut m,
            &node(
                "",
                "taints: [{key: ToBeDeletedByClusterAutoscaler, value: '1700000000', effect: NoSchedule}]",
            ),
        );
        assert!(m.node().to_be_deleted && !m.node().eligible());
        apply_yaml(
            &mut m,
            &node("", "taints: [{key: other, effect: NoSchedule}]"),
        );
        assert!(m.node().eligible(), "other taints do not matter");
        apply_yaml(
            &mut m,
            &node(", deletionTimestamp: '2026-01-01T00:00:00Z'", ""),
        );
        assert!(m.node().deleting && !m.node().eligible());
        assert!(m.commit().node_changed);
    }

    #[test]
    fn local_policy_sets_without_local_endpoints_are_flagged_only_with_remote_ones() {
        let yaml = |eps: &str| {
            svc(
                "ns",
                "web",
                "  type: NodePort\n  clusterIP: 10.96.0.10\n  internalTrafficPolicy: Local\n  externalTrafficPolicy: Local\n  ports: [{port: 80, nodePort: 30080}]\n",
            ) + &slice(
                "ns",
                "web-1",
                "web",
                &format!("addressType: IPv4\nports: [{{port: 80}}]\nendpoints: [{eps}]\n"),
            ) + "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 192.0.2.1}]}\n"
        };
        let flagged = |eps: &str| {
            let (s, _) = build_yaml(&yaml(eps));
            s.services
                .iter()
                .filter(|(_, d)| d.no_local_endpoints)
                .map(|(k, _)| k.scope)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            flagged("{addresses: [10.0.0.2], nodeName: node-2}"),
            [Scope::Internal, Scope::Ingress]
        );
        assert!(flagged("{addresses: [10.0.0.1], nodeName: node-1}").is_empty());
        assert!(flagged("").is_empty(), "no endpoints at all: not counted");
    }

    /// A model fed `yaml` and committed.
    fn model(yaml: &str) -> Model {
        Model::from_objects(&objects(yaml), &node1())
    }

    fn apply_yaml(m: &mut Model, yaml: &str) {
        let (objs, errors) = parse_documents("test.yaml", yaml);
        assert!(errors.is_empty(), "{errors:?}");
        for o in objs {
            m.apply(Change::Apply(o));
        }
    }

    #[test]
    fn a_change_that_reads_the_same_is_dropped() {
        let base = svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n",
        ) + &slice(
            "default",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
        );
        let mut m = model(&base);
        // The same objects again, with a status, a resourceVersion and an annotation the
        // model does not read: nothing to do.
        let again = base
            .replace(
                "metadata: {name: web, namespace: default}",
                "metadata: {name: web, namespace: default, resourceVersion: '7', annotations: {x: y}}",
            )
            .replace("  name: web-1\n", "  name: web-1\n  resourceVersion: '9'\n");
        apply_yaml(&mut m, &again);
        let d = m.commit();
        assert!(d.is_empty(), "{d:?}");
        assert_eq!((d.service_changes, d.endpoint_changes), (0, 0));
        // A real change is one backend set.
        apply_yaml(&mut m, &again.replace("10.0.0.1", "10.0.0.2"));
        let d = m.commit();
        assert_eq!(d.ports.len(), 1, "{d:?}");
        assert_eq!(d.endpoint_changes, 1);
    }

    #[test]
    fn a_slice_change_touches_only_its_service() {
        let mut yaml = String::new();
        for i in 0..50 {
            yaml += &svc(
                "default",
                &format!("s{i}"),
                &format!("  clusterIP: 10.96.1.{i}\n  ports: [{{port: 80}}]\n"),
            );
            yaml += &slice(
                "default",
                &format!("s{i}-1"),
                &format!("s{i}"),
                "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
            );
        }
        let mut m = model(&yaml);
        apply_yaml(
            &mut m,
            &slice(
                "default",
                "s7-1",
                "s7",
                "addressType: IPv4\nendpoints: [{addresses: [10.0.0.9]}]\nports: [{port: 8080}]\n",
            ),
        );
        let d = m.commit();
        assert_eq!(
            d.ports.iter().map(|k| k.name.as_str()).collect::<Vec<_>>(),
            ["s7"]
        );
        assert_eq!(m.desired_state(), model(&yaml.replace(
            "name: s7-1\n  namespace: default\n  labels: {kubernetes.io/service-name: s7}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]",
            "name: s7-1\n  namespace: default\n  labels: {kubernetes.io/service-name: s7}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.9]}]",
        )).desired_state());
    }

    #[test]
    fn a_contested_frontend_moves_when_its_owner_goes() {
        let yaml = svc(
            "a",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        ) + &svc(
            "b",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        );
        let mut m = model(&yaml);
        assert_eq!(m.errors().len(), 1);
        assert!(m.ports().keys().all(|k| k.namespace == "a"));
        m.apply(Change::Delete(Kind::Service, ("a".into(), "web".into())));
        let d = m.commit();
        assert_eq!(d.errors_removed.len(), 1, "{d:?}");
        assert!(!m.ports().is_empty());
        assert!(m.ports().keys().all(|k| k.namespace == "b"));
        // It comes back, younger than b now? No timestamps: namespace order, a wins again.
        apply_yaml(
            &mut m,
            &svc(
                "a",
                "web",
                "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
            ),
        );
        m.commit();
        assert!(m.ports().keys().all(|k| k.namespace == "a"));
        assert_eq!(m.desired_state(), model(&yaml).desired_state());
    }

    #[test]
    fn a_zone_change_of_the_node_reapplies_topology_hints() {
        let eps = [
            ep("10.0.0.1", "node-2", "", "forZones: [{name: zone-a}]"),
            ep("10.0.0.2", "node-3", "", "forZones: [{name: zone-b}]"),
        ];
        let yaml = node("node-1", "zone-a")
            + &svc(
                "default",
                "web",
                "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n",
            )
            + &slice(
                "default",
                "web-1",
                "web",
                &format!(
                    "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                    eps.join(", ")
                ),
            );
        let mut m = model(&yaml);
        let k = key("default", "web", "", Tcp, V4);
        assert_eq!(m.port(&k).unwrap().backends, set(&["10.0.0.1"]));
        apply_yaml(&mut m, &node("node-1", "zone-b"));
        let d = m.commit();
        assert!(d.node_changed && d.ports.contains(&k));
        assert_eq!(m.port(&k).unwrap().backends, set(&["10.0.0.2"]));
    }

    /// Service web (cluster IP 10.96.0.10, port 80) with `annotations` (a YAML flow map
    /// body) and endpoints pod-1..pod-3 at 10.0.0.1..3; its internal set and the errors.
    fn annotated_web(annotations: &str) -> (DesiredService, Vec<String>) {
        let yaml = format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default, annotations: {{{annotations}}}}}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{{port: 80}}]\n"
        ) + &slice(
            "default",
            "web-1",
            "web",
            "addressType: IPv4\nendpoints:\n- {addresses: [10.0.0.1], targetRef: {kind: Pod, name: pod-1}}\n- {addresses: [10.0.0.2], targetRef: {kind: Pod, name: pod-2}}\n- {addresses: [10.0.0.3], targetRef: {kind: Pod, name: pod-3}}\nports: [{port: 8080}]\n",
        );
        let (s, e) = build_yaml(&yaml);
        let d = s.services.get(&key("default", "web", "", Tcp, V4));
        (d.cloned().unwrap_or_default(), e)
    }

    fn weights(list: &[(&str, u32)]) -> BTreeMap<SocketAddr, u32> {
        list.iter()
            .map(|(a, w)| (format!("{a}:8080").parse().unwrap(), *w))
            .collect()
    }

    #[test]
    fn algorithm_names_and_ipvs_scheduler_names_are_accepted() {
        for (a, n) in Algorithm::ALL {
            assert_eq!(parse_algorithm(n), Some(a), "{n}");
            assert_eq!(a.name(), n);
            assert_eq!(Algorithm::from_u8(a as u8), Some(a));
        }
        let ipvs = [
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
        for (n, a) in ipvs {
            assert_eq!(parse_algorithm(n), Some(a), "{n}");
        }
        // IPVS names are exact (case-sensitive), and the own names are not IPVS names.
        assert_eq!(parse_algorithm("WLC"), None);
        assert_eq!(parse_algorithm(""), None);
        assert!(algorithm_names().ends_with("(IPVS: rr, wrr, lc, wlc, sed, nq, sh, dh, mh)"));
        // The data path counts connections for the least-load family only.
        let counted: Vec<&str> = Algorithm::ALL
            .iter()
            .filter(|(a, _)| proxy_common::counts_connections(*a as u8))
            .map(|(_, n)| *n)
            .collect();
        assert_eq!(
            counted,
            [
                "least-connections",
                "weighted-least-connections",
                "shortest-expected-delay",
                "never-queue"
            ]
        );
        assert!(!proxy_common::counts_connections(200));
    }

    #[test]
    fn weights_reach_the_weighted_algorithms_and_zero_drains_with_every_algorithm() {
        let w = r#"ebpf-proxy.io/weights: '{"pod-1": 3, "10.0.0.2": 0}'"#;
        // IPVS names in the annotation; weights by pod name and by address, default 1.
        for alg in ["wlc", "sed", "nq", "wrr", "weighted-least-connections"] {
            let (d, e) = annotated_web(&format!("ebpf-proxy.io/lb-algorithm: {alg}, {w}"));
            assert_eq!(e, NO_ERRORS, "{alg}");
            assert_eq!(d.algorithm, parse_algorithm(alg).unwrap());
            assert_eq!(d.backends, set(&["10.0.0.1", "10.0.0.3"]), "{alg}");
            assert_eq!(
                d.weights,
                weights(&[("10.0.0.1", 3), ("10.0.0.3", 1)]),
                "{alg}"
            );
        }
        // Without the annotation every weight is 1.
        let (d, _) = annotated_web("ebpf-proxy.io/lb-algorithm: nq");
        assert_eq!(
            d.weights,
            weights(&[("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.3", 1)])
        );
        // Algorithms without weights: weight 0 still drains (IPVS quiesces it for every
        // scheduler); the other weights are reported as without effect.
        for alg in ["lc", "dh", "random"] {
            let (d, e) = annotated_web(&format!("ebpf-proxy.io/lb-algorithm: {alg}, {w}"));
            assert_eq!(d.backends, set(&["10.0.0.1", "10.0.0.3"]), "{alg}");
            assert!(d.weights.is_empty(), "{alg}");
            assert_eq!(
                e,
                vec![format!(
                    "test.yaml: Service default/web: annotation ebpf-proxy.io/weights: weights other than 0 have no effect with algorithm {}",
                    d.algorithm.name()
                )],
                "{alg}"
            );
        }
        let (d, e) = annotated_web(
            r#"ebpf-proxy.io/lb-algorithm: dh, ebpf-proxy.io/weights: '{"pod-3": 0}'"#,
        );
        assert_eq!(e, NO_ERRORS);
        assert_eq!(d.backends, set(&["10.0.0.1", "10.0.0.2"]));
        // An unknown name lists every accepted one.
        let (d, e) = annotated_web("ebpf-proxy.io/lb-algorithm: lblc");
        assert_eq!(d.algorithm, Algorithm::Random);
        assert_eq!(
            e,
            vec![format!(
                "test.yaml: Service default/web: annotation ebpf-proxy.io/lb-algorithm \"lblc\" is not one of {}; using random",
                algorithm_names()
            )]
        );
    }
}
