//! The model's change tracking ([`Model`]): every Service, EndpointSlice and this node's
//! Node object as read, what each Service gives, and the indexes that tell which Services a
//! change affects. [`Model::apply`] reads a change and drops one that reads the same (as
//! kube-proxy's service and endpoints change trackers do); [`Model::commit`] recomputes the
//! Services marked dirty, with the other Services sharing a candidate frontend, and returns
//! what changed ([`Delta`]).

use foldhash::{HashMap, HashSet, HashSetExt};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::bypass;
use super::endpoints::{self, ParsedSlice, PortEndpoints, SliceInfo, TRIGGER_TIME_ANNOTATION};
use super::frontends::{self, AgeKey, Claim, ClaimIndex, Resolution};
use super::labels::excluded_by_labels;
use super::node::{NodeInfo, NodeState};
use super::service::ServiceInfo;
use super::sets::{self, ServiceOutput};
use super::vocab::{
    DesiredService, DesiredState, Family, ModelError, Protocol, ServicePortKey, SvcKey,
};
use crate::datapath::HealthCheck;
use crate::source::event::{Change, Kind, Object, ObjectSet};

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

#[cfg(test)]
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
    pub(crate) fn set_socket_lb_scope(&mut self, scope: bypass::SocketLbScope) {
        self.bypass.set_scope(scope);
    }

    /// The Pods, Namespaces and scope that decide which pods bypass socket-level
    /// translation.
    pub(crate) fn bypass(&self) -> &bypass::BypassState {
        &self.bypass
    }

    /// The pods of this node that bypass socket-level translation, in (namespace, name)
    /// order.
    pub(crate) fn bypassed(&self) -> Vec<bypass::BypassedPod> {
        self.bypass.bypassed(&self.config.name)
    }

    /// The node configuration.
    pub(crate) fn config(&self) -> &NodeInfo {
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
        sets::service_output(
            key,
            &self.services[key].info,
            r,
            self.parsed_slices(&key.0, &key.1),
            &self.config.name,
            &self.node.zone,
        )
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
    pub(crate) fn ports(&self) -> &BTreeMap<ServicePortKey, DesiredService> {
        &self.ports
    }

    /// One backend set; `None` when it does not exist (removed).
    pub(crate) fn port(&self, key: &ServicePortKey) -> Option<&DesiredService> {
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
    pub(crate) fn slices_of(&self, namespace: &str, name: &str) -> &[String] {
        self.slices_of
            .get(&(namespace.to_string(), name.to_string()))
            .map_or(&[], Vec::as_slice)
    }

    /// Number of errors now.
    pub(crate) fn error_count(&self) -> usize {
        self.errors.values().map(Vec::len).sum()
    }

    /// Every backend set as a `DesiredState` (a copy: for tests and tools).
    pub fn desired_state(&self) -> DesiredState {
        DesiredState {
            services: self.ports.clone(),
        }
    }

    /// Every endpoint of one Service port and family as this node reads it (all slices
    /// merged as for the backend sets), for `ebpf-proxy explain` and for the endpoints
    /// whose connections `--close-connections-to-removed-endpoints` keeps.
    pub(crate) fn endpoints_of(
        &self,
        namespace: &str,
        service: &str,
        port_name: &str,
        protocol: Protocol,
        family: Family,
    ) -> PortEndpoints {
        endpoints::merge(self.parsed_slices(namespace, service))
            .remove(&(port_name.to_string(), protocol, family))
            .unwrap_or_default()
    }

    /// The parsed slices of Service `namespace`/`service`, in slice name order.
    fn parsed_slices<'a>(
        &'a self,
        namespace: &'a str,
        service: &str,
    ) -> impl Iterator<Item = &'a ParsedSlice> {
        self.slices_of
            .get(&(namespace.to_string(), service.to_string()))
            .into_iter()
            .flatten()
            .filter_map(move |s| self.slices.get(&(namespace.to_string(), s.clone())))
            .filter_map(|s| s.parsed.as_ref())
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

/// Builds the desired state from a set of objects at once: a fresh [`Model`] fed every
/// object. Returns the state and an error for everything skipped, in [`Model::errors`]
/// order.
#[cfg(test)]
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
mod tests;
