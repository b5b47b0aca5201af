//! The desired-state model: the one reader of Kubernetes objects. Services, EndpointSlices
//! and this node's Node object arrive as changes ([`Change`](crate::source::Change)); each
//! is read once, into the model's own types, and a change that reads the same as before is
//! dropped (as kube-proxy's change trackers drop no-op updates). [`Model::commit`] then
//! recomputes only the Services the changes touched and reports which backend sets and node
//! facts changed (`Delta`).
//! No I/O, no aya; deterministic (the same objects always give the same state and errors,
//! whatever order the changes came in).
//!
//! Concerns, one module each, each importing only those listed before it: `vocab` (the
//! shared identities and terms: keys, protocols, families, scopes, what a backend set is),
//! `labels` (the labels that link, place or exclude objects), `selection` (algorithms,
//! weights and north-south mode, with the `ebpf-proxy.io/*` annotations choosing them),
//! `service` (a Service's frontends and policies), `endpoints` (slices and endpoint
//! conditions), `topology` (which endpoints this node uses: readiness, terminating
//! fallback, topology hints), `node` (this node's flags, addresses and zone),
//! `frontends` (ownership of contested frontends), `sets` (the backend sets and other
//! facts one Service gives), `tracker` (the change tracking of [`Model`]) and `explain`
//! (why an endpoint is or is not used). `bypass` (which pods bypass socket-level
//! translation) stands apart. The public items of the crate-private modules are re-exported
//! here.
//!
//! Rules (kube-proxy semantics; where its modes differ, the nftables mode of KEP-3866):
//!
//! Which objects are read
//! - Services and EndpointSlices labelled `service.kubernetes.io/service-proxy-name` (any
//!   value: meant for another proxy, KEP-2447) or `service.kubernetes.io/headless` (the
//!   EndpointSlice controller's label on the slices of headless Services) are treated as
//!   absent, as kube-proxy's label selector on its watches (`PROXY_LABEL_SELECTOR`)
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
//!   `ServicePortKey` (namespace, name, port name, protocol, family). A missing protocol
//!   is TCP. SCTP ports are skipped with one error each ("SCTP is not supported"); the other
//!   ports of the Service still work.
//! - A Service is skipped as a whole, with one error, when: a cluster IP does not parse or
//!   is unspecified, loopback, multicast or broadcast (a frontend there would hijack node
//!   traffic); `clusterIP` is set and differs from `clusterIPs[0]`; two cluster IPs have the
//!   same family; a port is 0 or above 65535; a port/protocol pair or a port name appears
//!   twice; a protocol is not TCP, UDP or SCTP; or one of its frontends (VIP, port,
//!   protocol) is already used by another Service (the oldest Service keeps it, see
//!   `frontends`).
//! - A Service without ports has no frontends.
//! - External addresses: every `spec.externalIPs` entry and every
//!   `status.loadBalancer.ingress[].ip` whose `ipMode` is unset or `VIP` (KEP-1860: with
//!   `Proxy` the load balancer proxies to the nodes) is a frontend on every Service port,
//!   in a backend set of scope `Scope::External`. An address that does not parse or is
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
//!   endpoints a set gets is kube-proxy's `CategorizeEndpoints` (`categorize`): ready
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
//!   (or the first `InternalIP` per family with `primary`) serve node ports (`NodeState`).
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

pub(crate) mod bypass;
pub(crate) mod endpoints;
pub(crate) mod explain;
pub(crate) mod frontends;
pub(crate) mod labels;
pub(crate) mod node;
pub(crate) mod selection;
pub(crate) mod service;
pub(crate) mod sets;
pub(crate) mod topology;
pub(crate) mod tracker;
pub(crate) mod vocab;

pub use crate::datapath::HealthCheck;
pub(crate) use explain::eligibility;
pub(crate) use labels::SERVICE_NAME_LABEL;
pub use node::NodeInfo;
pub use selection::parse_algorithm;
pub(crate) use selection::{NorthSouthMode, algorithm_names};
pub(crate) use tracker::Delta;
pub use tracker::Model;
// Used by the unit tests only.
#[cfg(test)]
pub(crate) use endpoints::PortEndpoints;
#[cfg(test)]
pub(crate) use labels::{HEADLESS_LABEL, PROXY_LABEL_SELECTOR, SERVICE_PROXY_NAME_LABEL};
#[cfg(test)]
pub(crate) use topology::{EndpointSets, categorize};
#[cfg(test)]
pub(crate) use tracker::build;
#[cfg(test)]
pub(crate) use vocab::DesiredState;
pub(crate) use vocab::{Algorithm, DesiredService, Family, Protocol, Scope, ServicePortKey};

#[cfg(test)]
pub(crate) mod tests;
