//! Backend sets: what one Service gives this node ([`ServiceOutput`]), computed from what was
//! read of it, the frontends it owns ([`Resolution`]) and the endpoints of its slices. Per
//! Service port and cluster IP family: the cluster-IP set with `internalTrafficPolicy`, and
//! for its external addresses and node ports the set seen from this node (the Cluster
//! endpoints) and the one seen from outside (`externalTrafficPolicy`, north-south mode); plus
//! the Service's errors, its health-check port and its source ranges.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::endpoints::{self, ParsedSlice, PortEndpoints, ServiceEndpoints};
use super::frontends::Resolution;
use super::service::{Frontends, ServiceInfo};
use super::topology::{EndpointSets, categorize};
use super::vocab::{
    DesiredService, DsrPairs, Family, ModelError, Protocol, Scope, ServicePortKey, SvcKey,
};

/// What one Service gives.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ServiceOutput {
    /// Its backend sets (the values are in `Model::ports`).
    pub ports: Vec<ServicePortKey>,
    pub errors: Vec<ModelError>,
    /// (`healthCheckNodePort`, local endpoint count).
    pub health: Option<(u16, usize)>,
    /// Allowed CIDRs by restricted LB IP.
    pub ranges: BTreeMap<IpAddr, BTreeSet<IpNet>>,
}

/// Computes a Service's output from what was read (`info`), its ownership resolution and
/// its slices (in name order; read only when the Service has frontends), as node `node` in
/// zone `zone` ("" when unknown) sees it. Its backend sets come apart, not yet listed in
/// `ports`: the caller installs them.
pub(crate) fn service_output<'a>(
    (ns, name): &SvcKey,
    info: &ServiceInfo,
    r: &Resolution,
    slices: impl Iterator<Item = &'a ParsedSlice>,
    node: &str,
    zone: &str,
) -> (ServiceOutput, BTreeMap<ServicePortKey, DesiredService>) {
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
            let endpoints = endpoints::merge(slices);
            let service = ServiceSets {
                ns,
                name,
                info,
                f,
                r,
                node,
                zone,
            };
            service.all(&endpoints, &mut sets);
            out.ranges = source_ranges(info, r);
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

/// Source ranges of the LB IPs that are ingress frontends of the Service: each such IP gets
/// the valid ranges of its family (none of its family: no entry, so no restriction).
fn source_ranges(info: &ServiceInfo, r: &Resolution) -> BTreeMap<IpAddr, BTreeSet<IpNet>> {
    let mut ranges = BTreeMap::new();
    if info.source_ranges.is_empty() {
        return ranges;
    }
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
            ranges.insert(*ip, fam);
        }
    }
    ranges
}

/// One valid Service whose backend sets are being built, seen from node `node` in zone
/// `zone`.
struct ServiceSets<'a> {
    ns: &'a str,
    name: &'a str,
    info: &'a ServiceInfo,
    f: &'a Frontends,
    r: &'a Resolution,
    node: &'a str,
    zone: &'a str,
}

impl ServiceSets<'_> {
    /// Every backend set of the Service into `sets`.
    fn all(
        &self,
        endpoints: &ServiceEndpoints,
        sets: &mut BTreeMap<ServicePortKey, DesiredService>,
    ) {
        let empty = PortEndpoints::new();
        for (port_name, protocol, port) in &self.f.ports {
            for vip in &self.f.vips {
                let eps = endpoints
                    .get(&(port_name.clone(), *protocol, Family::of(vip)))
                    .unwrap_or(&empty);
                self.port(port_name, *protocol, *port, vip, eps, sets);
            }
        }
    }

    /// The sets of one Service port on cluster IP `vip`, from the endpoints `eps` of that
    /// port and family.
    fn port(
        &self,
        port_name: &str,
        protocol: Protocol,
        port: u16,
        vip: &IpAddr,
        eps: &PortEndpoints,
        sets: &mut BTreeMap<ServicePortKey, DesiredService>,
    ) {
        let info = self.info;
        let family = Family::of(vip);
        let key = ServicePortKey {
            namespace: self.ns.to_string(),
            name: self.name.to_string(),
            port_name: port_name.to_string(),
            protocol,
            family,
            scope: Scope::Internal,
        };
        let cats = categorize(eps, self.node, self.zone);
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
        let mut internal = self.set(
            backends,
            eps,
            BTreeSet::from([SocketAddr::new(*vip, port)]),
            flags,
        );
        internal.no_local_endpoints = info.internal_local && no_local;
        sets.insert(key.clone(), internal);
        // Traffic from this node to external addresses is "internal to the cluster":
        // kube-proxy short-circuits it to the Cluster endpoints whatever the
        // externalTrafficPolicy (pkg/proxy: UsesClusterEndpoints).
        let mut ext = self.external(family, port);
        ext.extend(
            self.r
                .node_ports
                .get(port_name)
                .into_iter()
                .flatten()
                .filter(|fe| Family::of(&fe.ip()) == family),
        );
        if ext.is_empty() {
            return;
        }
        // From outside the node: the externalTrafficPolicy endpoints; Local has no
        // fallback to other nodes (traffic is dropped, the client IP kept).
        let (ingress_backends, ingress_flags) = self.ingress_policy(protocol, &cats, none);
        let mut ingress = self.set(ingress_backends, eps, ext.clone(), ingress_flags);
        ingress.no_local_endpoints = info.external_local && no_local;
        if ingress_flags & proxy_common::FRONTEND_F_DSR != 0 {
            ingress.dsr = Some(Box::new(DsrPairs {
                node_port: self.f.node_ports.get(port_name).copied(),
                external: self.external(family, port),
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
            self.set(cats.cluster, eps, ext, proxy_common::FRONTEND_F_EXTERNAL),
        );
    }

    /// The external addresses the Service owns in `family`, on Service port `port`.
    fn external(&self, family: Family, port: u16) -> BTreeSet<SocketAddr> {
        self.r
            .external
            .iter()
            .filter(|(ip, _)| Family::of(ip) == family)
            .map(|(ip, _)| SocketAddr::new(*ip, port))
            .collect()
    }

    /// Backends and flags of the set seen from outside the node: `externalTrafficPolicy`,
    /// else direct server return when the north-south mode uses it for `protocol`. `none`:
    /// `FRONTEND_F_NO_ENDPOINTS` when no endpoint is usable anywhere.
    fn ingress_policy(
        &self,
        protocol: Protocol,
        cats: &EndpointSets,
        none: u32,
    ) -> (BTreeSet<SocketAddr>, u32) {
        if self.info.external_local {
            (
                cats.local.clone(),
                proxy_common::FRONTEND_F_EXTERNAL | proxy_common::FRONTEND_F_LOCAL_ONLY | none,
            )
        } else if self.info.north_south.dsr_for(protocol) {
            (
                cats.cluster.clone(),
                proxy_common::FRONTEND_F_EXTERNAL | proxy_common::FRONTEND_F_DSR,
            )
        } else {
            (cats.cluster.clone(), proxy_common::FRONTEND_F_EXTERNAL)
        }
    }

    /// A DesiredService with the Service's selection settings and weights: an endpoint of
    /// weight 0 leaves the set whatever the algorithm (IPVS's quiesced server), the others'
    /// weights are kept for the algorithms that read them.
    fn set(
        &self,
        backends: BTreeSet<SocketAddr>,
        eps: &PortEndpoints,
        frontends: BTreeSet<SocketAddr>,
        flags: u32,
    ) -> DesiredService {
        let info = self.info;
        let algorithm = info.algorithm;
        let mut d = DesiredService {
            frontends,
            backends,
            flags,
            algorithm,
            affinity_timeout_s: self.f.affinity,
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
    }
}

#[cfg(test)]
mod tests;
