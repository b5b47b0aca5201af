//! The node's part of the data path reconciled from the model: the interfaces that get the
//! north-south programs and their SNAT addresses (`TC_IFACE_ADDRS`), this node's endpoint
//! addresses (`TC_LOCAL_ENDPOINTS`), `loadBalancerSourceRanges` (`TC_SOURCE_RANGES`), the
//! direct server return pairs this node accepts (`TC_DSR`) and the `healthCheckNodePort`
//! servers.
//!
//! Interfaces: `--interfaces` names them; by default they are the interfaces of the agent's
//! network namespace (not `lo`) that carry one of this node's addresses (its Node object's
//! `InternalIP`/`ExternalIP`, [`crate::model::node::NodeState`]). When some flows to local
//! backends are source-NATed (`--masquerade-all`, or `--cluster-cidr`), the pod-facing
//! interfaces get the programs too: those the node routes its endpoints through (longest
//! non-default route), other than the external ones. Each interface's SNAT address per
//! family is the node address on it, else its first address of the family (for IPv6 one
//! usable beyond the link: not link-local). A restarted agent attaches its own programs to
//! every wanted interface (replacing the previous agent's links) and detaches the
//! interfaces no longer wanted.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use proxy_common::nat::{DsrKey, DsrTarget, IFACE_F_POD, IfaceAddr};

use crate::{
    datapath::{Datapath, DatapathError, SourceRangeKey, addr::ip_to_bytes},
    model::{DesiredService, HealthCheck, Model, Scope, ServicePortKey},
};

/// The `TC_DSR` entries of one backend set of protocol number `proto` (none without direct
/// server return): for each endpoint of the set on this node, one per external or load
/// balancer IP (that address and the Service port) and one for the node port (all-zero
/// frontend address, the node port), each giving the endpoint's port.
pub fn dsr_entries(set: Option<&DesiredService>, proto: u8) -> Vec<(DsrKey, DsrTarget)> {
    let Some(pairs) = set.and_then(|s| s.dsr.as_deref()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for b in &pairs.local {
        let target = DsrTarget {
            port: b.port().to_be_bytes(),
            _pad: [0; 2],
        };
        let key = |frontend: [u8; 16], port: u16| DsrKey {
            frontend,
            backend: ip_to_bytes(b.ip()),
            port: port.to_be_bytes(),
            proto,
            _pad: 0,
        };
        for fe in &pairs.external {
            out.push((key(ip_to_bytes(fe.ip()), fe.port()), target));
        }
        if let Some(np) = pairs.node_port {
            out.push((key([0; 16], np), target));
        }
    }
    out
}

/// What shapes the node's part beyond the objects.
#[derive(Clone, Debug, Default)]
pub struct NodeConfig {
    /// `--interfaces`: the external interfaces, when given.
    pub interfaces: Vec<String>,
    /// Some flows to local backends are source-NATed: the pod-facing interfaces need the
    /// programs too.
    pub snat_local: bool,
}

/// The `TC_SOURCE_RANGES` entries of the model's source ranges (the data path's
/// `source_range_entries`).
pub fn source_range_entries(model: &Model) -> BTreeMap<SourceRangeKey, u32> {
    crate::datapath::source_range_entries(model.source_ranges())
}

/// An IPv6 address that can be a SNAT source towards other nodes: not link-local
/// (fe80::/10, valid on one link only), loopback, unspecified, multicast or IPv4-mapped.
fn snat_v6(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V6(a) => {
            !(a.is_unicast_link_local()
                || a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || a.to_ipv4_mapped().is_some())
        }
        IpAddr::V4(_) => false,
    }
}

/// The interfaces that should have the programs, with the `TC_IFACE_ADDRS` value of each
/// (see the module documentation). Errors: an `--interfaces` name without an interface.
pub fn wanted_interfaces(
    dp: &impl Datapath,
    model: &Model,
    config: &NodeConfig,
) -> anyhow::Result<BTreeMap<String, (u32, IfaceAddr)>> {
    let all = dp.interfaces()?;
    let node_ips = model.node().ips();
    let mut external: BTreeMap<&String, &crate::datapath::Interface> = BTreeMap::new();
    if config.interfaces.is_empty() {
        for (name, i) in &all {
            if name != "lo" && i.addrs.iter().any(|ip| node_ips.contains(ip)) {
                external.insert(name, i);
            }
        }
    } else {
        for n in &config.interfaces {
            match all.get_key_value(n) {
                Some((k, i)) => {
                    external.insert(k, i);
                }
                None => anyhow::bail!("--interfaces: no interface {n:?} in this network namespace"),
            }
        }
    }
    let mut pods: BTreeMap<&String, &crate::datapath::Interface> = BTreeMap::new();
    if config.snat_local && !external.is_empty() {
        for ip in model.local_endpoints() {
            if let Some(dev) = dp.route_device(ip)
                && dev != "lo"
                && let Some((k, i)) = all.get_key_value(&dev)
                && !external.contains_key(k)
            {
                pods.insert(k, i);
            }
        }
    }
    let mut out = BTreeMap::new();
    for (name, i, pod) in external
        .iter()
        .map(|(n, i)| (*n, *i, false))
        .chain(pods.iter().map(|(n, i)| (*n, *i, true)))
    {
        let v4 = i
            .addrs
            .iter()
            .find(|ip| ip.is_ipv4() && node_ips.contains(ip))
            .or_else(|| i.addrs.iter().find(|ip| ip.is_ipv4()));
        let v6 = i
            .addrs
            .iter()
            .find(|ip| snat_v6(ip) && node_ips.contains(ip))
            .or_else(|| i.addrs.iter().find(|ip| snat_v6(ip)));
        let value = IfaceAddr {
            v4: v4.map(|ip| ip_to_bytes(*ip)).unwrap_or([0; 16]),
            v6: v6.map(|ip| ip_to_bytes(*ip)).unwrap_or([0; 16]),
            flags: if pod { IFACE_F_POD } else { 0 },
            _pad: 0,
        };
        out.insert(name.clone(), (i.index, value));
    }
    Ok(out)
}

/// The node's part as applied.
#[derive(Debug, Default)]
pub struct NodeReconciler {
    config: NodeConfig,
    local: BTreeSet<[u8; 16]>,
    ranges: BTreeMap<SourceRangeKey, u32>,
    /// Interfaces this agent attached, with their index and SNAT addresses.
    ifaces: BTreeMap<String, (u32, IfaceAddr)>,
    /// Health-check servers running, and ports that could not be bound (with the error).
    health: BTreeMap<u16, HealthCheck>,
    health_failed: BTreeMap<u16, (HealthCheck, String)>,
    /// Failures of the interfaces step, until it works again.
    iface_error: Option<String>,
    /// `TC_DSR` as applied, and what each `Ingress` backend set asks of it (a key two sets
    /// ask for, which the model's frontend ownership prevents, gets the first set's value).
    dsr: BTreeMap<DsrKey, DsrTarget>,
    dsr_sets: BTreeMap<ServicePortKey, Vec<(DsrKey, DsrTarget)>>,
    dsr_claims: BTreeMap<DsrKey, BTreeMap<ServicePortKey, DsrTarget>>,
}

impl NodeReconciler {
    /// Starts from what the north-south maps hold (an earlier agent's entries are kept or
    /// replaced by the first full pass).
    pub fn adopt(dp: &impl Datapath, config: NodeConfig) -> Result<Self, DatapathError> {
        let snap = dp.node_snapshot()?;
        Ok(NodeReconciler {
            config,
            local: snap.local_endpoints,
            ranges: snap.source_ranges,
            dsr: snap.dsr,
            ..Default::default()
        })
    }

    /// Writes the `TC_DSR` entries of the backend sets `keys` (a commit's changed sets; the
    /// others are skipped cheaply).
    pub fn apply_dsr<'a>(
        &mut self,
        dp: &mut impl Datapath,
        model: &Model,
        keys: impl Iterator<Item = &'a ServicePortKey>,
    ) -> Result<usize, DatapathError> {
        let mut touched = BTreeSet::new();
        for key in keys.filter(|k| k.scope == Scope::Ingress) {
            let want = dsr_entries(model.port(key), key.protocol.number());
            let old = self.dsr_sets.get(key).map(Vec::as_slice).unwrap_or(&[]);
            if old == want.as_slice() {
                continue;
            }
            for (k, _) in old {
                if let Some(c) = self.dsr_claims.get_mut(k) {
                    c.remove(key);
                    if c.is_empty() {
                        self.dsr_claims.remove(k);
                    }
                }
                touched.insert(*k);
            }
            for (k, v) in &want {
                self.dsr_claims
                    .entry(*k)
                    .or_default()
                    .insert(key.clone(), *v);
                touched.insert(*k);
            }
            if want.is_empty() {
                self.dsr_sets.remove(key);
            } else {
                self.dsr_sets.insert(key.clone(), want);
            }
        }
        let mut n = 0;
        for k in touched {
            let want = self.dsr_wanted(&k);
            match (want, self.dsr.get(&k)) {
                (Some(v), cur) if cur != Some(&v) => {
                    dp.put_dsr(&k, &v)?;
                    self.dsr.insert(k, v);
                    n += 1;
                }
                (None, Some(_)) => {
                    dp.delete_dsr(&k)?;
                    self.dsr.remove(&k);
                    n += 1;
                }
                _ => {}
            }
        }
        Ok(n)
    }

    /// Makes `TC_DSR` hold every backend set's entries (the first pass: also removes what an
    /// earlier agent left that no set asks for).
    pub fn sync_dsr(
        &mut self,
        dp: &mut impl Datapath,
        model: &Model,
    ) -> Result<usize, DatapathError> {
        let mut keys: BTreeSet<ServicePortKey> = model
            .ports()
            .keys()
            .filter(|k| k.scope == Scope::Ingress)
            .cloned()
            .collect();
        keys.extend(self.dsr_sets.keys().cloned());
        let mut n = self.apply_dsr(dp, model, keys.iter())?;
        let stale: Vec<DsrKey> = self
            .dsr
            .keys()
            .filter(|k| !self.dsr_claims.contains_key(*k))
            .copied()
            .collect();
        for k in stale {
            dp.delete_dsr(&k)?;
            self.dsr.remove(&k);
            n += 1;
        }
        Ok(n)
    }

    /// The value backend sets ask `TC_DSR` to hold at `k`.
    fn dsr_wanted(&self, k: &DsrKey) -> Option<DsrTarget> {
        self.dsr_claims
            .get(k)
            .and_then(|c| c.values().next())
            .copied()
    }

    /// Interfaces with the programs attached by this agent.
    pub fn interfaces(&self) -> impl Iterator<Item = &String> {
        self.ifaces.keys()
    }

    /// The north-south path as applied: external and pod-facing interfaces with the
    /// programs, and the interfaces step's failure (until a pass works).
    pub fn north_south(&self) -> crate::status::NorthSouth {
        let (pod, external): (Vec<_>, Vec<_>) = self
            .ifaces
            .iter()
            .partition(|(_, (_, v))| v.flags & IFACE_F_POD != 0);
        crate::status::NorthSouth {
            interfaces: external.into_iter().map(|(n, _)| n.clone()).collect(),
            pod_interfaces: pod.into_iter().map(|(n, _)| n.clone()).collect(),
            errors: self.iface_error.iter().cloned().collect(),
        }
    }

    /// Problems now (each a line naming what is affected): interfaces that could not be
    /// set up, health-check ports that could not be bound.
    pub fn errors(&self) -> BTreeSet<String> {
        let mut out: BTreeSet<String> = self.iface_error.iter().cloned().collect();
        for (port, (c, e)) in &self.health_failed {
            out.insert(format!(
                "Service {}/{}: healthCheckNodePort {port}: cannot listen: {e}",
                c.namespace, c.name
            ));
        }
        out
    }

    /// Makes `TC_LOCAL_ENDPOINTS` hold the model's local endpoint addresses.
    pub fn sync_local(
        &mut self,
        dp: &mut impl Datapath,
        model: &Model,
    ) -> Result<usize, DatapathError> {
        let want: BTreeSet<[u8; 16]> = model.local_endpoints().map(|ip| ip_to_bytes(*ip)).collect();
        let mut n = 0;
        for a in want.difference(&self.local) {
            dp.put_local_endpoint(a)?;
            n += 1;
        }
        for a in self.local.difference(&want) {
            dp.delete_local_endpoint(a)?;
            n += 1;
        }
        self.local = want;
        Ok(n)
    }

    /// Writes the local endpoint addresses that came and went (one commit's delta).
    pub fn apply_local(
        &mut self,
        dp: &mut impl Datapath,
        added: &[IpAddr],
        removed: &[IpAddr],
    ) -> Result<usize, DatapathError> {
        let mut n = 0;
        for ip in added {
            let a = ip_to_bytes(*ip);
            if !self.local.contains(&a) {
                dp.put_local_endpoint(&a)?;
                self.local.insert(a);
                n += 1;
            }
        }
        for ip in removed {
            let a = ip_to_bytes(*ip);
            if self.local.contains(&a) {
                dp.delete_local_endpoint(&a)?;
                self.local.remove(&a);
                n += 1;
            }
        }
        Ok(n)
    }

    /// True when a new local endpoint is routed through an interface without the programs
    /// (a pod-facing interface that needs them): interfaces must be evaluated again. Only
    /// with source-NATed local flows; an interface left without endpoints keeps the programs
    /// until the next verification.
    pub fn needs_pod_interface(&self, dp: &impl Datapath, added: &[IpAddr]) -> bool {
        self.config.snat_local
            && added.iter().any(|ip| {
                dp.route_device(ip)
                    .is_some_and(|d| d != "lo" && !self.ifaces.contains_key(&d))
            })
    }

    /// Makes `TC_SOURCE_RANGES` hold the model's source ranges. Allowed prefixes are written
    /// before restriction markers, and removed after them, so an edit never denies a client
    /// both the old and the new list allow.
    pub fn sync_ranges(
        &mut self,
        dp: &mut impl Datapath,
        model: &Model,
    ) -> Result<usize, DatapathError> {
        let want = source_range_entries(model);
        let mut n = 0;
        let mut adds: Vec<(&SourceRangeKey, &u32)> = want
            .iter()
            .filter(|(k, v)| self.ranges.get(*k) != Some(*v))
            .collect();
        adds.sort_by_key(|(_, v)| **v);
        for (k, v) in adds {
            dp.put_source_range(k, *v)?;
            self.ranges.insert(*k, *v);
            n += 1;
        }
        let mut dels: Vec<(SourceRangeKey, u32)> = self
            .ranges
            .iter()
            .filter(|(k, _)| !want.contains_key(*k))
            .map(|(k, v)| (*k, *v))
            .collect();
        dels.sort_by_key(|(_, v)| std::cmp::Reverse(*v));
        for (k, _) in dels {
            dp.delete_source_range(&k)?;
            self.ranges.remove(&k);
            n += 1;
        }
        Ok(n)
    }

    /// Starts, updates and stops health-check servers to match the model; ports that cannot
    /// be bound are remembered and retried by [`NodeReconciler::retry_health`].
    pub fn sync_health(&mut self, dp: &mut impl Datapath, model: &Model) {
        let want = model.health_checks();
        let gone: Vec<u16> = self
            .health
            .keys()
            .filter(|p| !want.contains_key(p))
            .copied()
            .collect();
        for p in gone {
            dp.stop_health(p);
            self.health.remove(&p);
        }
        self.health_failed.retain(|p, _| want.contains_key(p));
        for (port, c) in want {
            match self.health.get(&port) {
                Some(old) if *old == c => {}
                Some(_) => {
                    dp.update_health(port, &c);
                    self.health.insert(port, c);
                }
                None => match dp.serve_health(port, &c) {
                    Ok(()) => {
                        self.health_failed.remove(&port);
                        self.health.insert(port, c);
                    }
                    Err(e) => {
                        self.health_failed.insert(port, (c, e.to_string()));
                    }
                },
            }
        }
    }

    /// Binds again the health-check ports that could not be bound.
    pub fn retry_health(&mut self, dp: &mut impl Datapath) {
        let failed = std::mem::take(&mut self.health_failed);
        for (port, (c, _)) in failed {
            match dp.serve_health(port, &c) {
                Ok(()) => {
                    self.health.insert(port, c);
                }
                Err(e) => {
                    self.health_failed.insert(port, (c, e.to_string()));
                }
            }
        }
    }

    /// Attaches the programs to the wanted interfaces, writes their SNAT addresses, and
    /// detaches the programs from interfaces no longer wanted (also those an earlier agent
    /// attached). Errors are kept (see [`NodeReconciler::errors`]) until a pass works.
    pub fn sync_interfaces(&mut self, dp: &mut impl Datapath, model: &Model) -> usize {
        match self.try_sync_interfaces(dp, model) {
            Ok(n) => {
                self.iface_error = None;
                n
            }
            Err(e) => {
                self.iface_error = Some(format!("tc: interfaces: {e:#}"));
                0
            }
        }
    }

    fn try_sync_interfaces(
        &mut self,
        dp: &mut impl Datapath,
        model: &Model,
    ) -> anyhow::Result<usize> {
        let wanted = wanted_interfaces(dp, model, &self.config)?;
        let mut n = 0;
        // One interface's failure (e.g. no native XDP with `--xdp native`) is reported and
        // retried without holding up the others.
        let mut failed = Vec::new();
        for (name, (index, value)) in &wanted {
            let had = self.ifaces.get(name);
            if had.map(|(i, v)| (i, v)) != Some((index, value)) {
                if let Some((old_index, _)) = had
                    && old_index != index
                {
                    dp.delete_iface_addr(*old_index)?;
                }
                dp.put_iface_addr(*index, value)?;
                n += 1;
            }
            if had.is_none() {
                let xdp = match dp.attach(name, value.flags & IFACE_F_POD == 0) {
                    Ok(x) => x,
                    Err(e) => {
                        failed.push(format!("{e:#}"));
                        continue;
                    }
                };
                let shown = |a: [u8; 16]| {
                    (a != [0; 16]).then(|| crate::datapath::addr::bytes_to_ip(a).to_string())
                };
                let xdp = xdp.map_or("none", |m| m.as_str());
                tracing::info!(interface = %name, address = ?shown(value.v4), address_v6 = ?shown(value.v6), xdp, "north-south programs attached (tcx ingress and egress, XDP mode as `xdp` says)");
                n += 1;
            }
            self.ifaces.insert(name.clone(), (*index, *value));
        }
        let mine: Vec<String> = self
            .ifaces
            .keys()
            .filter(|n| !wanted.contains_key(*n))
            .cloned()
            .collect();
        for name in mine {
            dp.detach(&name)?;
            if let Some((index, _)) = self.ifaces.remove(&name) {
                dp.delete_iface_addr(index)?;
            }
            tracing::info!(interface = %name, "north-south programs detached");
            n += 1;
        }
        // Links an earlier agent pinned for interfaces no longer wanted.
        for name in dp.attached() {
            if !wanted.contains_key(&name) {
                dp.detach(&name)?;
                tracing::info!(interface = %name, "north-south programs of an earlier agent detached");
                n += 1;
            }
        }
        if !failed.is_empty() {
            anyhow::bail!("{}", failed.join("; "));
        }
        Ok(n)
    }

    /// Compares the north-south maps with what was applied and repairs differences;
    /// re-evaluates the interfaces (some may have appeared) and retries health-check ports.
    pub fn verify(
        &mut self,
        dp: &mut impl Datapath,
        model: &Model,
    ) -> Result<usize, DatapathError> {
        let snap = dp.node_snapshot()?;
        let mut n = 0;
        for a in self.local.difference(&snap.local_endpoints) {
            dp.put_local_endpoint(a)?;
            n += 1;
        }
        for a in snap.local_endpoints.difference(&self.local) {
            dp.delete_local_endpoint(a)?;
            n += 1;
        }
        let mut adds: Vec<(&SourceRangeKey, &u32)> = self
            .ranges
            .iter()
            .filter(|(k, v)| snap.source_ranges.get(*k) != Some(*v))
            .collect();
        adds.sort_by_key(|(_, v)| **v);
        for (k, v) in adds {
            dp.put_source_range(k, *v)?;
            n += 1;
        }
        let mut dels: Vec<(&SourceRangeKey, &u32)> = snap
            .source_ranges
            .iter()
            .filter(|(k, _)| !self.ranges.contains_key(*k))
            .collect();
        dels.sort_by_key(|(_, v)| std::cmp::Reverse(**v));
        for (k, _) in dels {
            dp.delete_source_range(k)?;
            n += 1;
        }
        let want_dsr: BTreeMap<DsrKey, DsrTarget> = self
            .dsr_claims
            .keys()
            .filter_map(|k| Some((*k, self.dsr_wanted(k)?)))
            .collect();
        for (k, v) in &want_dsr {
            if snap.dsr.get(k) != Some(v) {
                dp.put_dsr(k, v)?;
                n += 1;
            }
        }
        for k in snap.dsr.keys().filter(|k| !want_dsr.contains_key(*k)) {
            dp.delete_dsr(k)?;
            n += 1;
        }
        self.dsr = want_dsr;
        let want_addrs: BTreeMap<u32, IfaceAddr> = self.ifaces.values().copied().collect();
        for (i, v) in &want_addrs {
            if snap.iface_addrs.get(i) != Some(v) {
                dp.put_iface_addr(*i, v)?;
                n += 1;
            }
        }
        for i in snap
            .iface_addrs
            .keys()
            .filter(|i| !want_addrs.contains_key(i))
        {
            dp.delete_iface_addr(*i)?;
            n += 1;
        }
        n += self.sync_interfaces(dp, model);
        self.retry_health(dp);
        Ok(n)
    }
}
