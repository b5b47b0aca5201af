//! Which endpoints of a Service port this node uses: kube-proxy's `CategorizeEndpoints`
//! (pkg/proxy/topology.go) into the Cluster and Local sets, with readiness, the terminating
//! fallback (KEP-1669) and topology hints (KEP-2433, KEP-4444).

use std::collections::BTreeSet;
use std::net::SocketAddr;

use super::endpoints::{EndpointInfo, PortEndpoints};

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
        let all_node_hints = ready().all(|(_, e)| !e.node_hints().is_empty());
        let all_zone_hints = ready().all(|(_, e)| !e.zone_hints().is_empty());
        if all_node_hints && ready().any(|(_, e)| e.node_hints().contains(node)) {
            topology = "PreferSameNode";
        } else if all_zone_hints
            && !zone.is_empty()
            && ready().any(|(_, e)| e.zone_hints().contains(zone))
        {
            topology = "PreferSameZone";
        }
    }
    let available = |e: &EndpointInfo| match topology {
        "PreferSameNode" => e.node_hints().contains(node),
        "PreferSameZone" => e.zone_hints().contains(zone),
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

#[cfg(test)]
mod tests;
