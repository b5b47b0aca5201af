//! EndpointSlices read once, when they change, into `SliceInfo`, and the endpoints of a
//! Service port merged from its slices (kube-proxy's pkg/proxy endpointslicecache). Which of
//! them this node uses is `topology::categorize`'s.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::labels::SERVICE_NAME_LABEL;
use super::vocab::{Family, ModelError, Protocol, UNUSABLE, parse_ip, usable_vip};

/// The annotation the EndpointSlice controller sets to the time of the change that
/// triggered the slice's last update (source of the network programming latency).
pub const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// One endpoint as kube-proxy sees it (pkg/proxy endpointslicecache): its conditions and the
/// topology that decide whether this node uses it.
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
    /// Topology hints, when the endpoint has any (boxed: most have none, and a cluster has
    /// hundreds of thousands of endpoints).
    pub hints: Option<Box<Hints>>,
    /// `targetRef.name` (the pod's name), for weights; "" when unset.
    pub pod: Box<str>,
}

/// An endpoint's topology hints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hints {
    /// `hints.forZones[].name`.
    pub zones: BTreeSet<String>,
    /// `hints.forNodes[].name`.
    pub nodes: BTreeSet<String>,
}

static NO_HINTS: BTreeSet<String> = BTreeSet::new();

impl EndpointInfo {
    /// `hints.forZones[].name`.
    pub fn zone_hints(&self) -> &BTreeSet<String> {
        self.hints.as_ref().map_or(&NO_HINTS, |h| &h.zones)
    }

    /// `hints.forNodes[].name`.
    pub fn node_hints(&self) -> &BTreeSet<String> {
        self.hints.as_ref().map_or(&NO_HINTS, |h| &h.nodes)
    }
}

/// The endpoints of one Service port in one family, by (address, port).
pub type PortEndpoints = BTreeMap<SocketAddr, EndpointInfo>;

/// Endpoints of one Service by (slice port name, protocol, family).
pub(crate) type ServiceEndpoints = BTreeMap<(String, Protocol, Family), PortEndpoints>;

/// The reason of the error of an EndpointSlice without the `kubernetes.io/service-name`
/// label.
pub const UNLABELED_SLICE: &str = "no kubernetes.io/service-name label, so it belongs to no Service; slice ignored (as kube-proxy does)";

/// What one EndpointSlice gives: the Service it belongs to, its family, ports (name,
/// protocol, number) and endpoints (first address, as this node judges it), plus the
/// addresses of its endpoints on this node and the errors reading it gave. Equality tells a
/// change that matters from one that does not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SliceInfo {
    /// `kubernetes.io/service-name`; slices without it feed no Service.
    pub service: Option<String>,
    /// `None` for a slice that feeds nothing (FQDN) or is invalid.
    pub parsed: Option<ParsedSlice>,
    /// Every address of the endpoints whose `nodeName` is this node, whatever their
    /// conditions: a backend among them is reached without leaving the node.
    pub local_addrs: Vec<IpAddr>,
    /// What was skipped.
    pub errors: Vec<ModelError>,
}

/// The usable part of a slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParsedSlice {
    pub family: Family,
    pub ports: Vec<(String, Protocol, u16)>,
    pub endpoints: Vec<(IpAddr, EndpointInfo)>,
}

impl SliceInfo {
    /// Reads a slice of namespace `ns` (`origin`: its file or "api") as node `node` sees it.
    pub fn read(origin: &Arc<str>, ns: &str, slice: &EndpointSlice, node: &str) -> SliceInfo {
        let mut errors = Vec::new();
        let parsed = read_slice(origin, ns, slice, node, &mut errors);
        let mut local_addrs: Vec<IpAddr> = slice
            .endpoints
            .iter()
            .filter(|ep| ep.node_name.as_deref() == Some(node))
            .flat_map(|ep| ep.addresses.iter().filter_map(|a| a.parse::<IpAddr>().ok()))
            .collect();
        local_addrs.shrink_to_fit();
        let service = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
            .cloned();
        if service.is_none() {
            // kube-proxy ignores such a slice too, silently; one warning says why its
            // endpoints are not used.
            errors.push(ModelError::object(
                origin.to_string(),
                "EndpointSlice",
                ns,
                slice.metadata.name.clone().unwrap_or_default(),
                UNLABELED_SLICE,
            ));
        }
        SliceInfo {
            service,
            parsed,
            local_addrs,
            errors,
        }
    }
}

/// What one slice gives (see [`ParsedSlice`]); `None` for a slice that feeds nothing (FQDN)
/// or is invalid (error pushed).
fn read_slice(
    origin: &Arc<str>,
    ns: &str,
    slice: &EndpointSlice,
    node: &str,
    errors: &mut Vec<ModelError>,
) -> Option<ParsedSlice> {
    let name = slice.metadata.name.clone().unwrap_or_default();
    let mut err = |reason: String| {
        errors.push(ModelError::object(
            origin.to_string(),
            "EndpointSlice",
            ns,
            name.clone(),
            reason,
        ))
    };
    let family = match slice.address_type.as_str() {
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
    for p in slice.ports.iter().flatten() {
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
    for (i, ep) in slice.endpoints.iter().enumerate() {
        let cond = ep.conditions.as_ref();
        // Unset conditions: ready and serving unknown mean true, terminating false
        // (EndpointSlice API; kube-proxy reads them the same way).
        let hints = Hints {
            zones: ep
                .hints
                .iter()
                .flat_map(|h| h.for_zones.iter().flatten())
                .map(|z| z.name.clone())
                .collect(),
            nodes: ep
                .hints
                .iter()
                .flat_map(|h| h.for_nodes.iter().flatten())
                .map(|n| n.name.clone())
                .collect(),
        };
        let info = EndpointInfo {
            ready: cond.and_then(|c| c.ready) != Some(false),
            serving: cond.and_then(|c| c.serving) != Some(false),
            terminating: cond.and_then(|c| c.terminating) == Some(true),
            local: ep.node_name.as_deref() == Some(node),
            hints: (hints != Hints::default()).then(|| Box::new(hints)),
            pod: ep
                .target_ref
                .as_ref()
                .and_then(|r| r.name.as_deref())
                .unwrap_or_default()
                .into(),
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
            Ok(ip) => endpoints.push((ip, info)),
            Err(e) => err(format!("endpoint address {e}; endpoint skipped")),
        }
    }
    // Exact capacities: a cluster holds hundreds of thousands of these.
    ports.shrink_to_fit();
    endpoints.shrink_to_fit();
    Some(ParsedSlice {
        family,
        ports,
        endpoints,
    })
}

/// Merges the slices of one Service (in slice name order) into its endpoints per slice port
/// name x protocol x family. An endpoint in two slices (during a move between slices): the
/// first one read wins, unless a later one is local (kube-proxy favours local).
pub(crate) fn merge<'a>(slices: impl Iterator<Item = &'a ParsedSlice>) -> ServiceEndpoints {
    let mut out = ServiceEndpoints::new();
    for info in slices {
        for (port_name, protocol, port) in &info.ports {
            let set = out
                .entry((port_name.clone(), *protocol, info.family))
                .or_default();
            for (ip, ep) in &info.endpoints {
                let addr = SocketAddr::new(*ip, *port);
                match set.get(&addr) {
                    Some(_) if !ep.local => {}
                    _ => {
                        set.insert(addr, ep.clone());
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
