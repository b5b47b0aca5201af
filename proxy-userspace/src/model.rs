//! The pure desired-state model: from an [`ObjectSet`] (Services and EndpointSlices) to the
//! backend sets the data path must implement. No I/O, no aya; deterministic (BTree
//! everywhere, so the same objects always give the same state and the same errors).
//!
//! Rules (kube-proxy semantics; where its modes differ, the nftables mode of KEP-3866):
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
//!   protocol) is already used by another Service (the Service first in namespace/name
//!   order keeps it).
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
//!   EHOSTUNREACH where kube-proxy drops). A policy other than `Cluster`/`Local` skips the
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
//!   kube-proxy does; an address in two slices is taken from the first, unless a later
//!   one is on this node. An address that does not parse or whose family is not the slice's
//!   skips that endpoint with an error; the rest of the slice is used. An endpoint without
//!   addresses is skipped with an error.
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

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::source::{ObjectSet, Sourced};

/// A validation error (or warning) for one object: names origin file, kind,
/// namespace/name and reason. Every one is non-fatal (the object, port or endpoint named
/// is skipped), so callers log them at warning level.
pub use crate::source::SourceError as ModelError;

/// The label linking an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

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
/// x IP family x [`Scope`].
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
    /// Weights of the backends for `weighted-round-robin` (every backend has one, >= 1;
    /// endpoints of weight 0 are not in `backends`); empty for other algorithms.
    pub weights: BTreeMap<SocketAddr, u32>,
}

pub use proxy_common::Algorithm;

/// Service annotation choosing its algorithm (`random`, `round-robin`,
/// `weighted-round-robin`, `least-connections`, `source-hash`, `maglev`).
pub const ALGORITHM_ANNOTATION: &str = "ebpf-proxy.io/lb-algorithm";
/// Service annotation with endpoint weights for `weighted-round-robin`: a JSON object from
/// pod name (the endpoint's `targetRef.name`) or endpoint IP address to an integer weight
/// 0..=100 (default 1; 0 takes the endpoint out of new connections).
pub const WEIGHTS_ANNOTATION: &str = "ebpf-proxy.io/weights";
/// Highest weight an endpoint may have (bounds the slots a service uses).
pub const MAX_WEIGHT: u32 = 100;
/// Default `sessionAffinityConfig.clientIP.timeoutSeconds` (Kubernetes API: 3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10800;

/// Parses an algorithm name.
pub fn parse_algorithm(s: &str) -> Option<Algorithm> {
    Algorithm::ALL
        .iter()
        .find(|(_, n)| *n == s)
        .map(|(a, _)| *a)
}

/// Everything the data path must implement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    /// Backend sets by Service port x protocol x family.
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
/// One endpoint as kube-proxy sees it (pkg/proxy endpointslicecache): its address and the
/// conditions and topology that decide whether this node uses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    /// `conditions.ready`; unset means ready (EndpointSlice API).
    pub ready: bool,
    /// `conditions.serving`; unset means serving.
    pub serving: bool,
    /// `conditions.terminating`; unset means not terminating.
    pub terminating: bool,
    /// `nodeName` equals this node's name.
    pub local: bool,
    /// `hints.forZones[].name`.
    pub zone_hints: BTreeSet<String>,
    /// `hints.forNodes[].name`.
    pub node_hints: BTreeSet<String>,
    /// `targetRef.name` (the pod's name), for weights; "" when unset.
    pub pod: String,
}

/// The endpoints of one Service port in one family, by (address, port).
type PortEndpoints = BTreeMap<SocketAddr, EndpointInfo>;

/// Endpoints of one Service by (slice port name, protocol, family).
type ServiceEndpoints = BTreeMap<(String, Protocol, Family), PortEndpoints>;

/// Information about this node: its name (`--hostname-override`). Its zone is the
/// `topology.kubernetes.io/zone` label of the Node object of that name, and its node-port
/// addresses that object's `status.addresses`, when a source has it.
#[derive(Clone, Debug, Default)]
pub struct NodeInfo {
    /// Node name.
    pub name: String,
    /// `--nodeport-addresses` CIDRs: node ports are served only on node addresses inside
    /// one of them; empty means every node address (kube-proxy's iptables default).
    pub nodeport_addresses: Vec<ipnet::IpNet>,
    /// `--nodeport-addresses primary`: only the node's primary address of each family (its
    /// first `InternalIP`), the default of kube-proxy's nftables mode.
    pub nodeport_primary: bool,
    /// `--lb-algorithm`: the algorithm of Services without [`ALGORITHM_ANNOTATION`].
    pub default_algorithm: Algorithm,
}

/// The label holding a Node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Builds the desired state from a snapshot of objects. Returns the state and an error for
/// everything skipped (see the module documentation). Slice errors come first (slices in
/// namespace/name order), then Service errors (Services in namespace/name order).
pub fn build(objects: &ObjectSet, node: &NodeInfo) -> (DesiredState, Vec<ModelError>) {
    build_cached(objects, node, &mut ModelCache::default())
}

/// What one EndpointSlice gives, independent of the node: its family, its ports (name,
/// protocol, number) and its endpoints (first address, conditions, node, hints).
#[derive(Clone, Debug)]
struct SliceInfo {
    family: Family,
    ports: Vec<(String, Protocol, u16)>,
    endpoints: Vec<(IpAddr, RawEndpoint)>,
}

/// An endpoint as read from a slice, before it is judged against this node.
#[derive(Clone, Debug)]
struct RawEndpoint {
    ready: bool,
    serving: bool,
    terminating: bool,
    node_name: Option<String>,
    zone_hints: BTreeSet<String>,
    node_hints: BTreeSet<String>,
    pod: String,
}

impl RawEndpoint {
    /// This endpoint as `node` sees it: local when the slice names `node` as its node.
    fn judged(&self, node: &NodeInfo) -> EndpointInfo {
        EndpointInfo {
            ready: self.ready,
            serving: self.serving,
            terminating: self.terminating,
            local: self.node_name.as_deref() == Some(node.name.as_str()),
            zone_hints: self.zone_hints.clone(),
            node_hints: self.node_hints.clone(),
            pod: self.pod.clone(),
        }
    }
}

/// What [`build_cached`] remembers between calls: what was read from each EndpointSlice,
/// reused while the slice is the same object (same `Arc`), so one changed slice among
/// thousands costs one parse of its endpoints.
#[derive(Default)]
pub struct ModelCache {
    slices: std::collections::HashMap<(String, String), CachedSlice>,
}

/// A slice object, what was read from it, and the errors reading it gave.
type CachedSlice = (
    std::sync::Arc<EndpointSlice>,
    Option<SliceInfo>,
    Vec<ModelError>,
);

/// [`build`] with a cache kept by the caller across snapshots; the result is the same.
pub fn build_cached(
    objects: &ObjectSet,
    node: &NodeInfo,
    cache: &mut ModelCache,
) -> (DesiredState, Vec<ModelError>) {
    let mut errors = Vec::new();
    cache
        .slices
        .retain(|k, _| objects.endpoint_slices.contains_key(k));
    let this_node = objects.nodes.get(&node.name);
    let zone = this_node
        .and_then(|n| n.object.metadata.labels.as_ref())
        .and_then(|l| l.get(ZONE_LABEL))
        .cloned()
        .unwrap_or_default();
    let node_ips = node_addresses(this_node, node, &mut errors);

    // Endpoints of every Service, by (namespace, service name) -> (port name, protocol, family).
    let mut endpoints: BTreeMap<(&str, &str), ServiceEndpoints> = BTreeMap::new();
    for ((ns, _), slice) in &objects.endpoint_slices {
        let Some(service) = slice
            .object
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
        else {
            continue;
        };
        let key = (
            ns.clone(),
            slice.object.metadata.name.clone().unwrap_or_default(),
        );
        let fresh = !matches!(cache.slices.get(&key),
            Some((obj, _, _)) if std::sync::Arc::ptr_eq(obj, &slice.object));
        if fresh {
            let mut errs = Vec::new();
            let parsed = read_slice(slice, &mut errs);
            cache
                .slices
                .insert(key.clone(), (slice.object.clone(), parsed, errs));
        }
        let (_, parsed, slice_errors) = &cache.slices[&key];
        errors.extend(slice_errors.iter().cloned());
        let Some(info) = parsed else {
            continue;
        };
        let per_service = endpoints
            .entry((ns.as_str(), service.as_str()))
            .or_default();
        for (port_name, protocol, port) in &info.ports {
            let set = per_service
                .entry((port_name.clone(), *protocol, info.family))
                .or_default();
            for (ip, raw) in &info.endpoints {
                let ep = raw.judged(node);
                let local = ep.local;
                // An endpoint in two slices (during a move between slices): the first one
                // read wins, unless a later one is local (kube-proxy favours local).
                let addr = SocketAddr::new(*ip, *port);
                match set.get(&addr) {
                    Some(_) if !local => {}
                    _ => {
                        set.insert(addr, ep);
                    }
                }
            }
        }
    }

    let mut state = DesiredState::default();
    // Owner of every frontend, to refuse a second Service on the same (VIP, port, protocol).
    let mut owners: BTreeMap<(SocketAddr, Protocol), (&str, &str)> = BTreeMap::new();
    // A contested address (two Services claiming one external IP, LB IP or node port) goes
    // to the oldest Service by creationTimestamp, so a newcomer cannot take over an address
    // in use (CVE-2020-8554's shape); without timestamps (manifests), namespace/name order.
    let mut order: Vec<_> = objects.services.iter().collect();
    order.sort_by(|(ka, a), (kb, b)| {
        let created = |s: &Sourced<Service>| s.object.metadata.creation_timestamp.clone();
        (created(a).is_none(), created(a), *ka).cmp(&(created(b).is_none(), created(b), *kb))
    });
    for ((ns, name), svc) in order {
        let mk_err = |reason: String| {
            ModelError::object(
                svc.origin.clone(),
                "Service",
                ns.clone(),
                name.clone(),
                reason,
            )
        };
        let Frontends {
            vips,
            ports,
            external,
            node_ports,
            affinity,
            warnings,
        } = match service_frontends(svc) {
            Ok(Some(v)) => v,
            Ok(None) => continue,
            Err(reason) => {
                errors.push(mk_err(format!("{reason}; Service skipped")));
                continue;
            }
        };
        let frontends: Vec<(SocketAddr, Protocol)> = ports
            .iter()
            .flat_map(|(_, proto, port)| {
                vips.iter()
                    .map(move |ip| (SocketAddr::new(*ip, *port), *proto))
            })
            .collect();
        if let Some(((addr, proto), (other_ns, other_name))) =
            frontends.iter().find_map(|f| owners.get(f).map(|o| (f, o)))
        {
            errors.push(mk_err(format!(
                "frontend {addr}/{proto} is already used by Service {other_ns}/{other_name}; Service skipped"
            )));
            continue;
        }
        for f in frontends {
            owners.insert(f, (ns.as_str(), name.as_str()));
        }
        errors.extend(warnings.into_iter().map(&mk_err));
        // External addresses: each needs a cluster IP of its family (kube-proxy does not
        // translate families) and must not collide with another Service's frontend.
        let mut external_ok: Vec<(IpAddr, &'static str)> = Vec::new();
        for (ip, what) in external {
            if !vips.iter().any(|v| Family::of(v) == Family::of(&ip)) {
                errors.push(mk_err(format!(
                    "{what} {ip} is {} but the Service has no {} cluster IP; address skipped",
                    Family::of(&ip).as_str(),
                    Family::of(&ip).as_str()
                )));
                continue;
            }
            let clash = ports.iter().find_map(|(_, proto, port)| {
                owners
                    .get(&(SocketAddr::new(ip, *port), *proto))
                    .filter(|o| **o != (ns.as_str(), name.as_str()))
                    .map(|o| (*port, *proto, *o))
            });
            if let Some((port, proto, (other_ns, other_name))) = clash {
                errors.push(mk_err(format!(
                    "{what} {ip}: frontend {}/{proto} is already used by Service {other_ns}/{other_name}; address skipped",
                    SocketAddr::new(ip, port)
                )));
                continue;
            }
            if external_ok.iter().any(|(e, _)| *e == ip) {
                continue; // listed twice (e.g. as externalIP and LB ingress): one frontend
            }
            for (_, proto, port) in &ports {
                owners.insert(
                    (SocketAddr::new(ip, *port), *proto),
                    (ns.as_str(), name.as_str()),
                );
            }
            external_ok.push((ip, what));
        }
        // Node ports on this node's addresses, each (address, node port, protocol) owned
        // by one Service.
        let mut node_port_ok: BTreeMap<String, Vec<SocketAddr>> = BTreeMap::new();
        for (port_name, protocol, _) in &ports {
            let Some(np) = node_ports.get(port_name) else {
                continue;
            };
            for ip in node_ips
                .iter()
                .filter(|ip| vips.iter().any(|v| Family::of(v) == Family::of(ip)))
            {
                let fe = SocketAddr::new(*ip, *np);
                match owners.get(&(fe, *protocol)) {
                    Some(o) if *o != (ns.as_str(), name.as_str()) => {
                        errors.push(mk_err(format!(
                            "node port {fe}/{protocol} is already used by Service {}/{}; node port skipped",
                            o.0, o.1
                        )));
                    }
                    _ => {
                        owners.insert((fe, *protocol), (ns.as_str(), name.as_str()));
                        node_port_ok.entry(port_name.clone()).or_default().push(fe);
                    }
                }
            }
        }

        let spec = svc.object.spec.as_ref();
        let external_local =
            spec.and_then(|s| s.external_traffic_policy.as_deref()) == Some("Local");
        let internal_local =
            spec.and_then(|s| s.internal_traffic_policy.as_deref()) == Some("Local");
        let (algorithm, weights) =
            selection(svc, node.default_algorithm, &mut |w| errors.push(mk_err(w)));
        // A DesiredService with the Service's selection settings; WRR weights applied.
        let policy = |backends: BTreeSet<SocketAddr>,
                      eps: &PortEndpoints,
                      frontends: BTreeSet<SocketAddr>,
                      flags: u32| {
            let mut d = DesiredService {
                frontends,
                backends,
                flags,
                algorithm,
                affinity_timeout_s: affinity,
                weights: BTreeMap::new(),
            };
            if algorithm == Algorithm::WeightedRoundRobin {
                let weight = |a: &SocketAddr| {
                    let pod = eps.get(a).map(|e| e.pod.as_str()).unwrap_or("");
                    weights
                        .get(pod)
                        .filter(|_| !pod.is_empty())
                        .or_else(|| weights.get(&a.ip().to_string()))
                        .copied()
                        .unwrap_or(1)
                };
                d.weights = d.backends.iter().map(|a| (*a, weight(a))).collect();
                d.weights.retain(|_, w| *w > 0);
                d.backends.retain(|a| d.weights.contains_key(a));
            }
            d
        };
        let service_endpoints = endpoints.get(&(ns.as_str(), name.as_str()));
        for (port_name, protocol, port) in &ports {
            for vip in &vips {
                let family = Family::of(vip);
                let key = ServicePortKey {
                    namespace: ns.clone(),
                    name: name.clone(),
                    port_name: port_name.clone(),
                    protocol: *protocol,
                    family,
                    scope: Scope::Internal,
                };
                let eps =
                    service_endpoints.and_then(|e| e.get(&(port_name.clone(), *protocol, family)));
                let empty = PortEndpoints::new();
                let eps = eps.unwrap_or(&empty);
                let sets = categorize(eps, &node.name, &zone);
                let (backends, flags) = if internal_local {
                    (sets.local.clone(), proxy_common::FRONTEND_F_LOCAL_ONLY)
                } else {
                    (sets.cluster.clone(), 0)
                };
                state.services.insert(
                    key.clone(),
                    policy(
                        backends,
                        eps,
                        BTreeSet::from([SocketAddr::new(*vip, *port)]),
                        flags,
                    ),
                );
                // Traffic from this node to external addresses is "internal to the cluster":
                // kube-proxy short-circuits it to the Cluster endpoints whatever the
                // externalTrafficPolicy (pkg/proxy: UsesClusterEndpoints).
                let mut ext: BTreeSet<SocketAddr> = external_ok
                    .iter()
                    .filter(|(ip, _)| Family::of(ip) == family)
                    .map(|(ip, _)| SocketAddr::new(*ip, *port))
                    .collect();
                ext.extend(
                    node_port_ok
                        .get(port_name)
                        .into_iter()
                        .flatten()
                        .filter(|fe| Family::of(&fe.ip()) == family),
                );
                if !ext.is_empty() {
                    // From outside the node: the externalTrafficPolicy endpoints; Local has
                    // no fallback to other nodes (traffic is dropped, the client IP kept).
                    let (ingress_backends, ingress_flags) = if external_local {
                        (
                            sets.local.clone(),
                            proxy_common::FRONTEND_F_EXTERNAL | proxy_common::FRONTEND_F_LOCAL_ONLY,
                        )
                    } else {
                        (sets.cluster.clone(), proxy_common::FRONTEND_F_EXTERNAL)
                    };
                    state.services.insert(
                        ServicePortKey {
                            scope: Scope::Ingress,
                            ..key.clone()
                        },
                        policy(ingress_backends, eps, ext.clone(), ingress_flags),
                    );
                    state.services.insert(
                        ServicePortKey {
                            scope: Scope::External,
                            ..key
                        },
                        policy(sets.cluster, eps, ext, proxy_common::FRONTEND_F_EXTERNAL),
                    );
                }
            }
        }
    }
    (state, errors)
}

/// A Service's algorithm ([`ALGORITHM_ANNOTATION`], else `default`) and endpoint weights
/// ([`WEIGHTS_ANNOTATION`], by pod name or address). A bad annotation is reported through
/// `warn` and ignored (default algorithm, weight 1), the rest of the Service still works.
fn selection(
    svc: &Sourced<Service>,
    default: Algorithm,
    warn: &mut dyn FnMut(String),
) -> (Algorithm, BTreeMap<String, u32>) {
    let ann = svc.object.metadata.annotations.as_ref();
    let mut algorithm = default;
    if let Some(v) = ann.and_then(|a| a.get(ALGORITHM_ANNOTATION)) {
        match parse_algorithm(v.trim()) {
            Some(a) => algorithm = a,
            None => warn(format!(
                "annotation {ALGORITHM_ANNOTATION} {v:?} is not one of {}; using {}",
                Algorithm::ALL
                    .iter()
                    .map(|(_, n)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
                default.name()
            )),
        }
    }
    let mut weights = BTreeMap::new();
    if let Some(v) = ann.and_then(|a| a.get(WEIGHTS_ANNOTATION)) {
        match serde_json::from_str::<BTreeMap<String, i64>>(v) {
            Ok(m) => {
                for (k, w) in m {
                    match u32::try_from(w) {
                        Ok(w) if w <= MAX_WEIGHT => {
                            weights.insert(k, w);
                        }
                        _ => warn(format!(
                            "annotation {WEIGHTS_ANNOTATION}: weight {w} of {k:?} is not 0-{MAX_WEIGHT}; weight 1 used"
                        )),
                    }
                }
            }
            Err(e) => warn(format!(
                "annotation {WEIGHTS_ANNOTATION} is not a JSON object of integer weights ({e}); every weight is 1"
            )),
        }
        if algorithm != Algorithm::WeightedRoundRobin {
            warn(format!(
                "annotation {WEIGHTS_ANNOTATION} has no effect with algorithm {}",
                algorithm.name()
            ));
        }
    }
    (algorithm, weights)
}

/// This node's addresses that serve node ports: the `InternalIP` and `ExternalIP` entries of
/// its Node object's `status.addresses` (the addresses other nodes and load balancers use),
/// narrowed by `NodeInfo::nodeport_addresses` when set. Unparseable ones are reported.
fn node_addresses(
    this_node: Option<&Sourced<k8s_openapi::api::core::v1::Node>>,
    node: &NodeInfo,
    errors: &mut Vec<ModelError>,
) -> BTreeSet<IpAddr> {
    let mut ips = BTreeSet::new();
    let Some(n) = this_node else {
        return ips;
    };
    let addrs = n.object.status.as_ref().and_then(|s| s.addresses.as_ref());
    let mut primary_seen: BTreeSet<Family> = BTreeSet::new();
    for a in addrs.into_iter().flatten() {
        if a.type_ != "InternalIP" && a.type_ != "ExternalIP" {
            continue;
        }
        if node.nodeport_primary {
            let fam = match a.address.parse::<IpAddr>() {
                Ok(ip) => Family::of(&ip),
                Err(_) => continue,
            };
            if a.type_ != "InternalIP" || !primary_seen.insert(fam) {
                continue;
            }
        }
        match a.address.parse::<IpAddr>() {
            Ok(ip) if usable_vip(&ip) => {
                if node.nodeport_addresses.is_empty()
                    || node.nodeport_addresses.iter().any(|c| c.contains(&ip))
                {
                    ips.insert(ip);
                }
            }
            _ => errors.push(ModelError::object(
                n.origin.clone(),
                "Node",
                "",
                node.name.clone(),
                format!(
                    "status.addresses {} {:?} is not a usable IP address; skipped for node ports",
                    a.type_, a.address
                ),
            )),
        }
    }
    ips
}

/// Every endpoint of one Service port and family as this node reads it (all slices merged,
/// as [`build`] does), for `ebpf-proxy explain`; slice errors are dropped.
pub fn endpoints_of(
    objects: &ObjectSet,
    node: &NodeInfo,
    namespace: &str,
    service: &str,
    port_name: &str,
    protocol: Protocol,
    family: Family,
) -> PortEndpoints {
    let mut set = PortEndpoints::new();
    for ((ns, _), slice) in &objects.endpoint_slices {
        let label = slice
            .object
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL));
        if ns != namespace || label.map(String::as_str) != Some(service) {
            continue;
        }
        let Some(info) = read_slice(slice, &mut Vec::new()) else {
            continue;
        };
        if info.family != family {
            continue;
        }
        for (pn, proto, port) in &info.ports {
            if pn != port_name || *proto != protocol {
                continue;
            }
            for (ip, raw) in &info.endpoints {
                let ep = raw.judged(node);
                let addr = SocketAddr::new(*ip, *port);
                if set.contains_key(&addr) && !ep.local {
                    continue;
                }
                set.insert(addr, ep);
            }
        }
    }
    set
}

/// The zone label of node `name` in `objects`, "" when unknown.
pub fn zone_of(objects: &ObjectSet, name: &str) -> String {
    objects
        .nodes
        .get(name)
        .and_then(|n| n.object.metadata.labels.as_ref())
        .and_then(|l| l.get(ZONE_LABEL))
        .cloned()
        .unwrap_or_default()
}

/// Why endpoint `addr` is not in a backend set built from `sets` (`local_only`: the set is
/// the Local one), or `None` when it is used. The reasons are the rules of [`categorize`].
pub fn why_not(
    addr: &SocketAddr,
    e: &EndpointInfo,
    sets: &EndpointSets,
    local_only: bool,
    zone: &str,
) -> Option<String> {
    let used = if local_only {
        sets.local.contains(addr)
    } else {
        sets.cluster.contains(addr)
    };
    if used {
        return None;
    }
    Some(if !(e.ready || e.serving && e.terminating) {
        if e.terminating {
            "terminating and not serving".to_string()
        } else {
            "not ready".to_string()
        }
    } else if !e.ready {
        "terminating (ready endpoints are preferred)".to_string()
    } else if local_only && !e.local {
        "on another node (Local traffic policy)".to_string()
    } else if sets.topology == "PreferSameNode" {
        "not hinted for this node (topology hints)".to_string()
    } else if sets.topology == "PreferSameZone" {
        format!("not hinted for zone {zone:?} (topology hints)")
    } else {
        "not selected".to_string()
    })
}

/// The endpoint sets of one Service port for this node (pkg/proxy `CategorizeEndpoints`).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct EndpointSets {
    /// For `Cluster` policies: ready endpoints narrowed by topology hints, else the serving
    /// and terminating ones (KEP-1669).
    pub cluster: BTreeSet<SocketAddr>,
    /// For `Local` policies: this node's ready endpoints, else its serving and terminating
    /// ones.
    pub local: BTreeSet<SocketAddr>,
    /// Topology narrowing applied to `cluster`: "" (none), `PreferSameZone` or
    /// `PreferSameNode`.
    pub topology: &'static str,
}

/// Splits endpoints into the Cluster and Local sets of this node (`node` name, `zone` label,
/// "" when unknown), with kube-proxy's rules:
/// - Topology (KEP-2433, KEP-4444 `trafficDistribution`): kube-proxy reads the hints the
///   EndpointSlice controller writes, not the Service field. When every ready endpoint has
///   a node hint and one names this node, only endpoints hinted for this node are used
///   (`PreferSameNode`); else when every ready endpoint has a zone hint and one names this
///   node's zone, only endpoints hinted for this zone (`PreferSameZone`, also what
///   `PreferClose` gives); otherwise every endpoint.
/// - Cluster: ready endpoints available under that topology; when none, every serving and
///   terminating endpoint (KEP-1669).
/// - Local: ready endpoints on this node; when none, this node's serving and terminating
///   endpoints.
pub fn categorize(eps: &PortEndpoints, node: &str, zone: &str) -> EndpointSets {
    let ready = || eps.iter().filter(|(_, e)| e.ready);
    let mut topology = "";
    if ready().next().is_some() {
        let all_node_hints = ready().all(|(_, e)| !e.node_hints.is_empty());
        let all_zone_hints = ready().all(|(_, e)| !e.zone_hints.is_empty());
        if all_node_hints && ready().any(|(_, e)| e.node_hints.contains(node)) {
            topology = "PreferSameNode";
        } else if all_zone_hints
            && !zone.is_empty()
            && ready().any(|(_, e)| e.zone_hints.contains(zone))
        {
            topology = "PreferSameZone";
        }
    }
    let available = |e: &EndpointInfo| match topology {
        "PreferSameNode" => e.node_hints.contains(node),
        "PreferSameZone" => e.zone_hints.contains(zone),
        _ => true,
    };
    let mut cluster: BTreeSet<SocketAddr> = ready()
        .filter(|(_, e)| available(e))
        .map(|(a, _)| *a)
        .collect();
    if cluster.is_empty() {
        cluster = eps
            .iter()
            .filter(|(_, e)| e.serving && e.terminating)
            .map(|(a, _)| *a)
            .collect();
    }
    let mut local: BTreeSet<SocketAddr> =
        ready().filter(|(_, e)| e.local).map(|(a, _)| *a).collect();
    if local.is_empty() {
        local = eps
            .iter()
            .filter(|(_, e)| e.local && !e.ready && e.serving && e.terminating)
            .map(|(a, _)| *a)
            .collect();
    }
    EndpointSets {
        cluster,
        local,
        topology,
    }
}

/// What a Service offers: cluster IPs (at most one per family, in `clusterIPs` order),
/// ports (name, protocol, port), external addresses (`spec.externalIPs` and
/// `status.loadBalancer.ingress[].ip` in VIP mode, with what they are) and per-port or
/// per-address warnings.
struct Frontends {
    vips: Vec<IpAddr>,
    ports: Vec<(String, Protocol, u16)>,
    external: Vec<(IpAddr, &'static str)>,
    /// `spec.ports[].nodePort` by port name, where set.
    node_ports: BTreeMap<String, u16>,
    /// ClientIP affinity timeout in seconds, 0 without affinity.
    affinity: u32,
    warnings: Vec<String>,
}

/// Checks that an address may be a frontend or an endpoint: not unspecified, loopback,
/// link-local (169.254.0.0/16, fe80::/10: a cloud's metadata address among them),
/// multicast or broadcast. A frontend there would hijack node traffic; the API server's
/// validation rejects the same for endpoints and external IPs.
fn usable_vip(ip: &IpAddr) -> bool {
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast() || v4.is_link_local())
        || matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local()))
}

/// What [`usable_vip`] refuses, for messages.
const UNUSABLE: &str = "unspecified, loopback, link-local, multicast or broadcast";

/// Parses an address field. IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) are refused, as
/// the API server's stricter IP validation does (KEP-4858): the data path stores IPv4
/// addresses in that very form, so one would silently become an IPv4 address of an IPv6
/// object.
fn parse_ip(s: &str) -> Result<IpAddr, String> {
    let ip: IpAddr = s
        .parse()
        .map_err(|_| format!("{s:?} is not a valid IP address"))?;
    if let IpAddr::V6(v6) = ip
        && v6.to_ipv4_mapped().is_some()
    {
        return Err(format!(
            "{s:?} is an IPv4-mapped IPv6 address (write the IPv4 address itself)"
        ));
    }
    Ok(ip)
}

/// A Service's [`Frontends`]. `Ok(None)` for a Service that has no frontends by design
/// (headless, ExternalName, no cluster IP); `Err(reason)` for an invalid Service.
fn service_frontends(svc: &Sourced<Service>) -> Result<Option<Frontends>, String> {
    let Some(spec) = svc.object.spec.as_ref() else {
        return Ok(None);
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok(None);
    }
    let cluster_ip = spec.cluster_ip.as_deref().filter(|s| !s.is_empty());
    let ip_strings: Vec<&str> = match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => {
            if let Some(ip) = cluster_ip
                && ip != ips[0]
            {
                return Err(format!(
                    "clusterIP {ip} does not match clusterIPs[0] {}",
                    ips[0]
                ));
            }
            ips.iter().map(String::as_str).collect()
        }
        _ => cluster_ip.into_iter().collect(),
    };
    if ip_strings.is_empty() || ip_strings[0] == "None" {
        return Ok(None);
    }
    let mut vips: Vec<IpAddr> = Vec::new();
    for s in ip_strings {
        let ip: IpAddr = parse_ip(s).map_err(|e| format!("invalid cluster IP: {e}"))?;
        if !usable_vip(&ip) {
            return Err(format!("cluster IP {ip} is not usable ({UNUSABLE})"));
        }
        if let Some(other) = vips.iter().find(|v| Family::of(v) == Family::of(&ip)) {
            return Err(format!(
                "clusterIPs has two {} addresses ({other} and {ip})",
                Family::of(&ip).as_str()
            ));
        }
        vips.push(ip);
    }
    for policy in [
        (
            "internalTrafficPolicy",
            spec.internal_traffic_policy.as_deref(),
        ),
        (
            "externalTrafficPolicy",
            spec.external_traffic_policy.as_deref(),
        ),
    ] {
        if let (field, Some(v)) = policy
            && v != "Cluster"
            && v != "Local"
        {
            return Err(format!("{field} {v:?} is not Cluster or Local"));
        }
    }

    let mut ports = Vec::new();
    let mut node_ports = BTreeMap::new();
    let mut warnings = Vec::new();
    let mut seen_ports: BTreeSet<(i32, String)> = BTreeSet::new();
    let mut seen_names: BTreeSet<&str> = BTreeSet::new();
    for p in spec.ports.iter().flatten() {
        let name = p.name.as_deref().unwrap_or("");
        let proto_name = p.protocol.as_deref().unwrap_or("TCP");
        let shown = if name.is_empty() {
            String::new()
        } else {
            format!(" ({name:?})")
        };
        if !(1..=65535).contains(&p.port) {
            return Err(format!("port {}{shown} is out of range 1-65535", p.port));
        }
        if !seen_ports.insert((p.port, proto_name.to_string())) {
            return Err(format!("port {}/{proto_name} is defined twice", p.port));
        }
        if !seen_names.insert(name) {
            return Err(format!("port name {name:?} is used twice"));
        }
        let protocol = match proto_name {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => {
                warnings.push(format!(
                    "port {}/SCTP{shown}: SCTP is not supported; port skipped",
                    p.port
                ));
                continue;
            }
            other => {
                return Err(format!(
                    "unsupported protocol {other:?} on port {}{shown}",
                    p.port
                ));
            }
        };
        match p.node_port {
            None | Some(0) => {}
            Some(n @ 1..=65535) => {
                node_ports.insert(name.to_string(), n as u16);
            }
            Some(n) => warnings.push(format!(
                "nodePort {n} of port {}{shown} is out of range 1-65535; node port skipped",
                p.port
            )),
        }
        ports.push((name.to_string(), protocol, p.port as u16));
    }

    let mut external = Vec::new();
    let mut candidates: Vec<(&str, &'static str)> = spec
        .external_ips
        .iter()
        .flatten()
        .map(|s| (s.as_str(), "externalIP"))
        .collect();
    // Ingress IPs in VIP mode only: with ipMode Proxy the load balancer proxies to the
    // nodes and the IP must not be captured (KEP-1860).
    let ingress = svc
        .object
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for ing in ingress.into_iter().flatten() {
        let Some(ip) = ing.ip.as_deref().filter(|s| !s.is_empty()) else {
            continue;
        };
        match ing.ip_mode.as_deref().unwrap_or("VIP") {
            "VIP" => candidates.push((ip, "load balancer ingress IP")),
            "Proxy" => {}
            other => warnings.push(format!(
                "load balancer ingress IP {ip}: ipMode {other:?} is not VIP or Proxy; address skipped"
            )),
        }
    }
    for (s, what) in candidates {
        match parse_ip(s) {
            Ok(ip) if usable_vip(&ip) => external.push((ip, what)),
            Ok(ip) => warnings.push(format!(
                "{what} {ip} is not usable ({UNUSABLE}); address skipped"
            )),
            Err(e) => warnings.push(format!("{what} {e}; address skipped")),
        }
    }
    let affinity = match spec.session_affinity.as_deref() {
        None | Some("") | Some("None") => 0,
        Some("ClientIP") => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match t {
                None => DEFAULT_AFFINITY_TIMEOUT_S,
                Some(t @ 1..=86400) => t as u32,
                Some(t) => {
                    return Err(format!(
                        "sessionAffinityConfig.clientIP.timeoutSeconds {t} is out of range 1-86400"
                    ));
                }
            }
        }
        Some(other) => return Err(format!("sessionAffinity {other:?} is not None or ClientIP")),
    };
    Ok(Some(Frontends {
        vips,
        ports,
        external,
        node_ports,
        affinity,
        warnings,
    }))
}

/// What one slice gives (see [`SliceInfo`]); `None` for a slice that feeds nothing (FQDN)
/// or is invalid (error pushed).
fn read_slice(slice: &Sourced<EndpointSlice>, errors: &mut Vec<ModelError>) -> Option<SliceInfo> {
    let meta = &slice.object.metadata;
    let ns = meta.namespace.clone().unwrap_or_else(|| "default".into());
    let name = meta.name.clone().unwrap_or_default();
    let mut err = |reason: String| {
        errors.push(ModelError::object(
            slice.origin.clone(),
            "EndpointSlice",
            ns.clone(),
            name.clone(),
            reason,
        ))
    };
    let family = match slice.object.address_type.as_str() {
        "IPv4" => Family::V4,
        "IPv6" => Family::V6,
        "FQDN" => return None,
        other => {
            err(format!(
                "unsupported addressType {other:?}; EndpointSlice skipped"
            ));
            return None;
        }
    };

    let mut ports: Vec<(String, Protocol, u16)> = Vec::new();
    for p in slice.object.ports.iter().flatten() {
        let port_name = p.name.as_deref().unwrap_or("");
        let shown = if port_name.is_empty() {
            String::new()
        } else {
            format!(" ({port_name:?})")
        };
        let protocol = match p.protocol.as_deref().unwrap_or("TCP") {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => continue,
            other => {
                err(format!(
                    "unsupported protocol {other:?} on port{shown}; port skipped"
                ));
                continue;
            }
        };
        match p.port {
            Some(n @ 1..=65535) => ports.push((port_name.to_string(), protocol, n as u16)),
            Some(n) => err(format!(
                "port {n}{shown} is out of range 1-65535; port skipped"
            )),
            None => err(format!("port{shown} has no port number; port skipped")),
        }
    }

    let mut endpoints = Vec::new();
    for (i, ep) in slice.object.endpoints.iter().enumerate() {
        let cond = ep.conditions.as_ref();
        // Unset conditions: ready and serving unknown mean true, terminating false
        // (EndpointSlice API; kube-proxy reads them the same way).
        let raw = RawEndpoint {
            ready: cond.and_then(|c| c.ready) != Some(false),
            serving: cond.and_then(|c| c.serving) != Some(false),
            terminating: cond.and_then(|c| c.terminating) == Some(true),
            node_name: ep.node_name.clone(),
            zone_hints: ep
                .hints
                .iter()
                .flat_map(|h| h.for_zones.iter().flatten())
                .map(|z| z.name.clone())
                .collect(),
            node_hints: ep
                .hints
                .iter()
                .flat_map(|h| h.for_nodes.iter().flatten())
                .map(|n| n.name.clone())
                .collect(),
            pod: ep
                .target_ref
                .as_ref()
                .and_then(|r| r.name.clone())
                .unwrap_or_default(),
        };
        // kube-proxy uses only the first address of an endpoint.
        let Some(first) = ep.addresses.first() else {
            err(format!("endpoint {i} has no addresses; endpoint skipped"));
            continue;
        };
        match parse_ip(first) {
            Ok(ip) if Family::of(&ip) != family => err(format!(
                "endpoint address {ip} is not an {} address (addressType {}); endpoint skipped",
                family.as_str(),
                family.as_str()
            )),
            Ok(ip) if !usable_vip(&ip) => err(format!(
                "endpoint address {ip} is not usable ({UNUSABLE}); endpoint skipped"
            )),
            Ok(ip) => endpoints.push((ip, raw)),
            Err(e) => err(format!("endpoint address {e}; endpoint skipped")),
        }
    }
    Some(SliceInfo {
        family,
        ports,
        endpoints,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::source::manifests::parse_documents;

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
        assert_eq!(e, NO_ERRORS);
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
}
