//! The model's vocabulary: the identities and terms every part of it shares (a Service's
//! key, protocols, families, scopes, the key of a backend set), what the model gives for one
//! backend set ([`DesiredService`]) and for all of them ([`DesiredState`]), and which
//! addresses it accepts at all. The bottom of the model: it imports none of its siblings.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

/// A validation error (or warning) for one object: names origin file, kind,
/// namespace/name and reason. Every one is non-fatal (the object, port or endpoint named
/// is skipped), so callers log them at warning level.
pub use crate::source::error::SourceError as ModelError;

pub use proxy_common::Algorithm;

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
    /// `selection::ALGORITHM_ANNOTATION`).
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

/// Highest weight an endpoint may have (the data path's bound).
pub(crate) use crate::datapath::MAX_WEIGHT;

/// Every backend set the data path must implement, in key order (what
/// [`Model::desired_state`](super::Model::desired_state) returns; the agent reads
/// [`Model::ports`](super::Model::ports) instead of copying it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredState {
    /// Backend sets by Service port x protocol x family x scope.
    pub services: BTreeMap<ServicePortKey, DesiredService>,
}

// Summaries the unit tests check a desired state with.
#[cfg(test)]
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

/// Checks that an address may be a frontend or an endpoint: not unspecified, loopback,
/// link-local (169.254.0.0/16, fe80::/10: a cloud's metadata address among them),
/// multicast or broadcast. A frontend there would hijack node traffic; the API server's
/// validation rejects the same for endpoints and external IPs.
pub(crate) fn usable_vip(ip: &IpAddr) -> bool {
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || matches!(ip, IpAddr::V4(v4) if v4.is_broadcast() || v4.is_link_local())
        || matches!(ip, IpAddr::V6(v6) if v6.is_unicast_link_local()))
}

/// What [`usable_vip`] refuses, for messages.
pub(crate) const UNUSABLE: &str = "unspecified, loopback, link-local, multicast or broadcast";

/// Parses an address field. IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) are refused, as
/// the API server's stricter IP validation does (KEP-4858): the data path stores IPv4
/// addresses in that very form, so one would silently become an IPv4 address of an IPv6
/// object.
pub(crate) fn parse_ip(s: &str) -> Result<IpAddr, String> {
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

#[cfg(test)]
mod tests;
