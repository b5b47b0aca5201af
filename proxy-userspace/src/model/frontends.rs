//! Frontend ownership: which Service gets a (address, port, protocol) that several claim,
//! computed per group of Services that share a claim, so a change recomputes only the
//! Services it can affect.
//!
//! Rule: Services take their frontends in age order (creationTimestamp, oldest first;
//! Services without a timestamp after those with one, then namespace/name): a Service whose
//! cluster-IP frontend is already taken is skipped as a whole (and takes nothing); an
//! external address or node port already taken is skipped alone. A newcomer thus cannot
//! take over an address in use (CVE-2020-8554's shape).
//!
//! Within one Service a frontend also has one owner: each of its backend sets (a port's
//! cluster-IP set, a port's set of external addresses and node ports) is a service id in
//! the maps, and one frontend key can point at one of them only. An external address equal
//! to the Service's own cluster IP, or a node port that one of its other ports also uses as
//! a port or node port on that address, is skipped like one taken by another Service.
//!
//! Why groups are exact: a Service's outcome depends only on the owners of the frontends it
//! claims, which are set only by Services claiming the same frontends. The greedy pass over
//! all Services in age order therefore gives, for the Services of one connected group of the
//! "shares a candidate frontend" relation, the same result as the pass over that group alone.

use foldhash::{HashMap, HashMapExt, HashSet};
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::service::ServiceInfo;
use super::vocab::{Family, Protocol, SvcKey};

/// A frontend as claimed: (address, port) x protocol.
pub(crate) type Claim = (SocketAddr, Protocol);

/// Age order of Services: creation time (missing last), then namespace/name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct AgeKey {
    pub no_time: bool,
    pub created: Option<Time>,
    pub key: SvcKey,
}

impl AgeKey {
    pub fn of(key: &SvcKey, info: &ServiceInfo) -> AgeKey {
        AgeKey {
            no_time: info.created.is_none(),
            created: info.created.clone(),
            key: key.clone(),
        }
    }
}

/// Every frontend a Service could claim: its cluster-IP frontends, its external addresses
/// on every port (those with a cluster IP of their family), and its node ports on the node's
/// node-port addresses of a family it has a cluster IP of.
pub(crate) fn candidate_claims(info: &ServiceInfo, node_port_ips: &BTreeSet<IpAddr>) -> Vec<Claim> {
    let Ok(Some(f)) = &info.frontends else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let has_family = |ip: &IpAddr| f.vips.iter().any(|v| Family::of(v) == Family::of(ip));
    for (name, proto, port) in &f.ports {
        for vip in &f.vips {
            out.push((SocketAddr::new(*vip, *port), *proto));
        }
        for (ip, _) in &f.external {
            if has_family(ip) {
                out.push((SocketAddr::new(*ip, *port), *proto));
            }
        }
        if let Some(np) = f.node_ports.get(name) {
            for ip in node_port_ips.iter().filter(|ip| has_family(ip)) {
                out.push((SocketAddr::new(*ip, *np), *proto));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Who claims each frontend. Nearly every frontend has one claimant, so a short vector
/// (not an ordered set, which allocates a whole node for one element) holds them.
#[derive(Debug, Default)]
pub(crate) struct ClaimIndex {
    claims: HashMap<Claim, Vec<SvcKey>>,
}

impl ClaimIndex {
    /// Adds `who`'s claims; returns the other Services claiming any of them.
    pub fn add(&mut self, who: &SvcKey, claims: &[Claim], neighbours: &mut HashSet<SvcKey>) {
        for c in claims {
            let set = self.claims.entry(*c).or_default();
            neighbours.extend(set.iter().cloned());
            if !set.contains(who) {
                set.push(who.clone());
            }
        }
    }

    /// Removes `who`'s claims; returns the other Services claiming any of them.
    pub fn remove(&mut self, who: &SvcKey, claims: &[Claim], neighbours: &mut HashSet<SvcKey>) {
        for c in claims {
            if let Some(set) = self.claims.get_mut(c) {
                set.retain(|k| k != who);
                neighbours.extend(set.iter().cloned());
                if set.is_empty() {
                    self.claims.remove(c);
                }
            }
        }
    }

    /// Every claimant of `c`.
    pub fn claimants(&self, c: &Claim) -> impl Iterator<Item = &SvcKey> {
        self.claims.get(c).into_iter().flatten()
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.claims.clear();
    }
}

/// The outcome of ownership for one Service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Resolution {
    /// Set when a cluster-IP frontend belongs to another Service: the Service is skipped.
    pub skipped: Option<String>,
    /// External addresses the Service got (each once), with what they are.
    pub external: Vec<(IpAddr, &'static str)>,
    /// Node-port frontends the Service got, by port name.
    pub node_ports: BTreeMap<String, Vec<SocketAddr>>,
    /// Addresses and node ports skipped, in the order they were found.
    pub errors: Vec<String>,
}

/// Who owns a frontend: the Service, the port name, and whether it is the port's cluster-IP
/// backend set (else its external one: external addresses and node ports).
type Owner<'a> = (&'a SvcKey, &'a str, bool);

/// Runs the greedy ownership pass over `group` (every Service of a connected group, each
/// with its info), in age order.
pub(crate) fn resolve(
    group: &mut [(AgeKey, &ServiceInfo)],
    node_port_ips: &BTreeSet<IpAddr>,
) -> HashMap<SvcKey, Resolution> {
    group.sort_by(|a, b| a.0.cmp(&b.0));
    let mut owners: HashMap<Claim, Owner> = HashMap::new();
    let mut out = HashMap::new();
    for (age, info) in group.iter() {
        let me = &age.key;
        let Ok(Some(f)) = &info.frontends else {
            continue;
        };
        let mut r = Resolution::default();
        let cluster: Vec<(Claim, &str)> = f
            .ports
            .iter()
            .flat_map(|(name, proto, port)| {
                f.vips
                    .iter()
                    .map(move |ip| ((SocketAddr::new(*ip, *port), *proto), name.as_str()))
            })
            .collect();
        // (Ports are distinct per protocol, so a Service's cluster-IP frontends never
        // collide among themselves.)
        if let Some(((addr, proto), other)) = cluster
            .iter()
            .find_map(|(c, _)| owners.get(c).filter(|o| o.0 != me).map(|o| (c, o.0)))
        {
            r.skipped = Some(format!(
                "frontend {addr}/{proto} is already used by Service {}/{}; Service skipped",
                other.0, other.1
            ));
            out.insert(me.clone(), r);
            continue;
        }
        for (c, name) in cluster {
            owners.insert(c, (me, name, true));
        }
        let by = |o: &Owner| {
            if o.0 == me {
                "another port or address of this Service".to_string()
            } else {
                format!("Service {}/{}", o.0.0, o.0.1)
            }
        };
        // External addresses: each needs a cluster IP of its family (kube-proxy does not
        // translate families) and must not collide with another Service's frontend.
        for (ip, what) in &f.external {
            if !f.vips.iter().any(|v| Family::of(v) == Family::of(ip)) {
                r.errors.push(format!(
                    "{what} {ip} is {} but the Service has no {} cluster IP; address skipped",
                    Family::of(ip).as_str(),
                    Family::of(ip).as_str()
                ));
                continue;
            }
            let clash = f.ports.iter().find_map(|(name, proto, port)| {
                owners
                    .get(&(SocketAddr::new(*ip, *port), *proto))
                    .filter(|o| **o != (me, name.as_str(), false))
                    .map(|o| (*port, *proto, *o))
            });
            if let Some((port, proto, other)) = clash {
                r.errors.push(format!(
                    "{what} {ip}: frontend {}/{proto} is already used by {}; address skipped",
                    SocketAddr::new(*ip, port),
                    by(&other)
                ));
                continue;
            }
            if r.external.iter().any(|(e, _)| e == ip) {
                continue; // listed twice (e.g. as externalIP and LB ingress): one frontend
            }
            for (name, proto, port) in &f.ports {
                owners.insert((SocketAddr::new(*ip, *port), *proto), (me, name, false));
            }
            r.external.push((*ip, what));
        }
        // Node ports on this node's addresses, each (address, node port, protocol) owned
        // by one Service.
        for (port_name, protocol, _) in &f.ports {
            let Some(np) = f.node_ports.get(port_name) else {
                continue;
            };
            for ip in node_port_ips
                .iter()
                .filter(|ip| f.vips.iter().any(|v| Family::of(v) == Family::of(ip)))
            {
                let fe = SocketAddr::new(*ip, *np);
                match owners.get(&(fe, *protocol)) {
                    Some(o) if *o != (me, port_name.as_str(), false) => {
                        r.errors.push(format!(
                            "node port {fe}/{protocol} is already used by {}; node port skipped",
                            by(o)
                        ));
                    }
                    _ => {
                        owners.insert((fe, *protocol), (me, port_name, false));
                        r.node_ports.entry(port_name.clone()).or_default().push(fe);
                    }
                }
            }
        }
        out.insert(me.clone(), r);
    }
    out
}

#[cfg(test)]
mod tests;
