//! The service maps (`FRONTENDS`, `BACKEND_SLOTS`, `BACKENDS`, `SERVICE_NAMES`, `MEMBERS`,
//! `MAGLEV`) reconciled per Service port: what each [`ServicePortKey`] has in the maps is
//! kept ([`Applied`]), and a key is written only when the model says it changed.
//!
//! Rules:
//! - A service id is bound to one Service port x protocol x family x scope for its
//!   lifetime; the binding is stored in `SERVICE_NAMES`, so a restarted agent adopts the same
//!   ids ([`ServiceReconciler::adopt`]) and rewrites nothing that did not change (established
//!   sockets keep their reverse NAT and UDP flows keep their backend).
//! - Order within a key, so the data path never sees a half-written service: (A) remove
//!   memberships, frontends and VIP markers that are no longer wanted; (B) write new
//!   backends, the name, changed slots, memberships, the Maglev table, new VIP markers, then
//!   the frontends (a frontend carries the backend count, so it is written after its slots);
//!   (C) remove the Maglev table when no longer hashing, slots past the new count, then
//!   backends no slot refers to. A removed key loses memberships, frontends, markers, slots,
//!   name and table, then its unused backends.
//! - The keys of one Service are applied together: before anything is written, the peak
//!   number of entries of every map during their steps is checked against its limit; a
//!   Service that does not fit is refused whole with [`DatapathError::Full`] (its keys keep
//!   what they had), other Services are applied.
//! - Slots of a key keep their backends in place where possible: removing one backend moves
//!   at most one other slot (the last one into the hole), adding fills holes first.
//! - `MEMBERS` holds the backends of the keys that read it, each with its weight: ClientIP
//!   affinity and the table algorithms (source-hash, maglev, destination-hash), which must
//!   not return a client to a backend that left, and the least-load algorithms
//!   (least-connections with every weight 1, weighted-least-connections,
//!   shortest-expected-delay, never-queue), which divide a backend's connections by its
//!   weight. A weight change rewrites the membership. Other keys pay no membership writes.
//! - [`ServiceReconciler::verify`] compares the maps themselves with what was applied and
//!   repairs every difference in the same order (entries changed behind the agent's back,
//!   leftovers of an interrupted write, entries nothing claims after a restart).

use foldhash::{HashMap, HashMapExt, HashSet};
use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{Hash, Hasher},
    net::SocketAddr,
};

use proxy_common::{
    Backend, BackendSlot, BackendSlotKey, FRONTEND_F_VIP_MARKER, Frontend, FrontendKey, MemberKey,
    PROTO_UDP,
};

use crate::{
    datapath::{
        Capacity, DatapathError, ServiceMaps, Snapshot,
        addr::{ip_to_bytes, port_to_map},
        vip::{MARKER, has_marker, marker_key},
    },
    model::{Algorithm, DesiredService, Family, Protocol, Scope, ServicePortKey},
};

/// Canonical name of a service id, stored in `SERVICE_NAMES`:
/// `namespace/name:port-name/PROTOCOL/family`, e.g. `default/kube-dns:dns/UDP/v4`, with
/// `/external` or `/ingress` appended for the external addresses' sets ([`Scope`]).
pub fn service_name(k: &ServicePortKey) -> String {
    let proto = match k.protocol {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
    };
    let fam = match k.family {
        Family::V4 => "v4",
        Family::V6 => "v6",
    };
    let scope = match k.scope {
        Scope::Internal => "",
        Scope::External => "/external",
        Scope::Ingress => "/ingress",
    };
    format!(
        "{}/{}:{}/{}/{}{scope}",
        k.namespace, k.name, k.port_name, proto, fam
    )
}

/// Inverse of [`service_name`]; `None` for anything else.
pub fn parse_service_name(s: &str) -> Option<ServicePortKey> {
    let mut parts = s.split('/');
    let namespace = parts.next()?.to_string();
    let name_port = parts.next()?;
    let protocol = match parts.next()? {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        _ => return None,
    };
    let family = match parts.next()? {
        "v4" => Family::V4,
        "v6" => Family::V6,
        _ => return None,
    };
    let scope = match parts.next() {
        None => Scope::Internal,
        Some("external") => Scope::External,
        Some("ingress") => Scope::Ingress,
        Some(_) => return None,
    };
    if parts.next().is_some() {
        return None;
    }
    let (name, port_name) = name_port.split_once(':')?;
    Some(ServicePortKey {
        namespace,
        name: name.to_string(),
        port_name: port_name.to_string(),
        protocol,
        family,
        scope,
    })
}

pub(crate) fn backend_value(addr: &SocketAddr, proto: Protocol) -> Backend {
    Backend {
        addr: ip_to_bytes(addr.ip()),
        port: port_to_map(addr.port()),
        proto: proto.number(),
        flags: 0,
    }
}

fn frontend_key(addr: &SocketAddr, proto: Protocol, scope: Scope) -> FrontendKey {
    FrontendKey {
        addr: ip_to_bytes(addr.ip()),
        port: port_to_map(addr.port()),
        proto: proto.number(),
        scope: scope.key_scope(),
    }
}

/// The frontend value of service id `id` with `count` slots, in affinity group `group`.
fn frontend_value(id: u32, count: usize, svc: &DesiredService, group: u32) -> Frontend {
    Frontend {
        service_id: id,
        backend_count: count as u32,
        flags: svc.flags,
        algorithm: svc.algorithm as u8,
        _pad: [0; 3],
        affinity_timeout_s: svc.affinity_timeout_s,
        affinity_group: if svc.affinity_timeout_s != 0 {
            group
        } else {
            0
        },
    }
}

/// The key whose service id names the affinity group of `key`: its cluster IP set.
fn group_key(key: &ServicePortKey) -> ServicePortKey {
    ServicePortKey {
        scope: Scope::Internal,
        ..key.clone()
    }
}

/// Slots of a service: smooth weighted round-robin order for `weighted-round-robin` (each
/// backend `weight` times, interleaved as nginx does, so successive slots spread the
/// weights), else [`arrange_slots`] (survivors keep their slot).
fn plan_slots(svc: &DesiredService, old: &[u32], bids: &[(SocketAddr, u32)]) -> Vec<u32> {
    if svc.algorithm != Algorithm::WeightedRoundRobin {
        let set: BTreeSet<u32> = bids.iter().map(|(_, b)| *b).collect();
        return arrange_slots(old, &set);
    }
    let items: Vec<(u32, i64)> = bids
        .iter()
        .map(|(a, b)| (*b, *svc.weights.get(a).unwrap_or(&1) as i64))
        .collect();
    let total: i64 = items.iter().map(|(_, w)| w).sum();
    let mut current = vec![0i64; items.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for (i, (_, w)) in items.iter().enumerate() {
            current[i] += w;
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total;
        out.push(items[best].0);
    }
    out
}

/// New slot order for a service: survivors keep their slot, new backends fill holes, then
/// the tail moves into holes that are left.
pub fn arrange_slots(old: &[u32], wanted: &BTreeSet<u32>) -> Vec<u32> {
    let mut placed = BTreeSet::new();
    let mut new: Vec<Option<u32>> = old
        .iter()
        .map(|b| (wanted.contains(b) && placed.insert(*b)).then_some(*b))
        .collect();
    let mut adds = wanted.iter().filter(|b| !placed.contains(b)).copied();
    for slot in new.iter_mut() {
        if slot.is_none() {
            *slot = adds.next();
        }
    }
    new.extend(adds.map(Some));
    // Compact: move the last filled slot into the first hole until none is left.
    loop {
        while matches!(new.last(), Some(None)) {
            new.pop();
        }
        match new.iter().position(Option::is_none) {
            Some(hole) => {
                new[hole] = new.pop().flatten();
            }
            None => break,
        }
    }
    new.into_iter().flatten().collect()
}

/// A slot names a backend id whose value the reconciler does not know (a broken invariant:
/// ids come with their values). Reported as a failed `BACKEND_SLOTS` update, so the
/// service's write fails cleanly instead of writing a slot without its backend.
fn unknown_backend(id: u32) -> DatapathError {
    DatapathError::Map {
        op: "update",
        map: "BACKEND_SLOTS",
        error: std::io::Error::other(format!("backend id {id} has no known value")),
    }
}

/// The next id from `next`: ids are handed out in increasing order (wrapping, never 0), so a
/// freed id is not reused soon (a UDP flow remembers its backend id; the data path also
/// checks the address); `taken` rejects ids still in use.
fn alloc_id(next: &mut u32, taken: impl Fn(u32) -> bool) -> u32 {
    loop {
        let id = (*next).max(1);
        *next = id.wrapping_add(1);
        if !taken(id) {
            return id;
        }
    }
}

/// True for algorithms that read a Maglev table.
fn is_hashing(a: Algorithm) -> bool {
    a.uses_table()
}

/// True for keys whose backends must be in `MEMBERS` (affinity, the tables and the
/// least-load algorithms read it).
fn needs_members(svc: &DesiredService) -> bool {
    svc.affinity_timeout_s != 0 || svc.algorithm.reads_members()
}

/// The `MEMBERS` entries of a key: backend id -> weight (1 where the key has no weights);
/// empty for a key that needs none.
fn plan_members(svc: &DesiredService, bids: &[(SocketAddr, u32)]) -> BTreeMap<u32, u32> {
    if !needs_members(svc) {
        return BTreeMap::new();
    }
    bids.iter()
        .map(|(a, b)| (*b, svc.weights.get(a).copied().unwrap_or(1).max(1)))
        .collect()
}

/// A backend's name for Maglev: `address:port/PROTOCOL`, the same on every node.
fn backend_name(b: &Backend) -> String {
    let addr = crate::datapath::addr::to_socket_addr(b.addr, b.port);
    let proto = if b.proto == PROTO_UDP { "UDP" } else { "TCP" };
    format!("{addr}/{proto}")
}

fn table_hash(table: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    table.hash(&mut h);
    h.finish()
}

/// What one key has in the maps.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Applied {
    id: u32,
    /// Backend ids by slot.
    slots: Vec<u32>,
    /// Its frontends (VIP markers not included), by key.
    frontends: Vec<(FrontendKey, Frontend)>,
    /// Its `MEMBERS` entries: backend id -> weight.
    members: BTreeMap<u32, u32>,
    /// Hash of its Maglev table, when it has one.
    maglev: Option<u64>,
}

/// What one key will have, planned before anything is written.
struct Target {
    slots: Vec<u32>,
    frontends: Vec<(FrontendKey, Frontend)>,
    members: BTreeMap<u32, u32>,
    table: Option<(Vec<u32>, u64)>,
}

/// One key's plan.
struct Plan {
    key: ServicePortKey,
    id: u32,
    new_id: bool,
    old: Option<Applied>,
    /// `None`: the key is removed.
    new: Option<Target>,
    /// Backends first used by this plan.
    new_backends: Vec<(u32, Backend)>,
}

/// Map entry counts, for the capacity check.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    frontends: i64,
    slots: i64,
    backends: i64,
    names: i64,
}

/// What reconciling did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Map entries created or replaced.
    pub writes: usize,
    /// Map entries removed.
    pub deletes: usize,
    /// Keys applied (written or found up to date).
    pub applied: usize,
    /// UDP backends that left a service id: (service id, backend id, backend). Flows and
    /// connected sockets translated to them must be released
    /// ([`crate::datapath::ServiceMaps::release_stale`]), as kube-proxy clears their
    /// conntrack entries.
    pub released: Vec<(u32, u32, Backend)>,
}

impl Report {
    /// Adds another report's figures to this one.
    pub fn add(&mut self, other: Report) {
        self.writes += other.writes;
        self.deletes += other.deletes;
        self.applied += other.applied;
        self.released.extend(other.released);
    }
}

/// The service maps' reconciler: the bindings of service ids and backend ids, and what
/// every key has in the maps. See the module documentation.
#[derive(Debug, Default)]
pub struct ServiceReconciler {
    applied: HashMap<ServicePortKey, Applied>,
    /// The key bound to each service id.
    keys_by_id: HashMap<u32, ServicePortKey>,
    /// The service id whose key holds each frontend: a frontend moving between Services in
    /// one batch is removed from the key that lost it only if no other key took it over.
    fe_owner: HashMap<FrontendKey, u32>,
    ids_in_use: HashSet<u32>,
    /// Backend id -> (value, number of slots referring to it).
    backends: HashMap<u32, (Backend, u32)>,
    backend_ids: HashMap<Backend, u32>,
    /// Real frontends with a VIP marker on each VIP (the marker exists while > 0).
    vip_refs: HashMap<[u8; 16], u32>,
    /// Entries in the maps that nothing claims (after a restart or an interrupted write),
    /// until [`ServiceReconciler::verify`] removes them; their ids are not handed out.
    orphan_service_ids: HashSet<u32>,
    orphan_backend_ids: HashSet<u32>,
    orphans: Counts,
    counts: Counts,
    next_service_id: u32,
    next_backend_id: u32,
    /// Maglev table size (0: `MAGLEV_DEFAULT`).
    maglev_size: u32,
}

impl ServiceReconciler {
    /// Starts from what the maps hold now (pinned by an earlier run, or empty): each service
    /// id named in `SERVICE_NAMES` is re-bound to its key with the slots, frontends,
    /// memberships and table it has; entries nothing claims are left for
    /// [`ServiceReconciler::verify`] to remove.
    pub fn adopt(dp: &impl ServiceMaps) -> Result<Self, DatapathError> {
        let snap = dp.snapshot()?;
        let mut s = ServiceReconciler::default();
        let mut fe_by_id: HashMap<u32, Vec<(FrontendKey, Frontend)>> = HashMap::new();
        for (k, v) in &snap.frontends {
            if v.flags & FRONTEND_F_VIP_MARKER == 0 {
                fe_by_id.entry(v.service_id).or_default().push((*k, *v));
            }
        }
        for (id, name) in &snap.names {
            let Some(key) = parse_service_name(name) else {
                continue;
            };
            if s.applied.contains_key(&key) {
                continue; // a second id for one key: the first is kept, the other is an orphan
            }
            let mut slots = Vec::new();
            while let Some(b) = snap.slots.get(&BackendSlotKey {
                service_id: *id,
                slot: slots.len() as u32,
            }) {
                if !snap.backends.contains_key(b) {
                    break;
                }
                slots.push(*b);
            }
            let maglev = if snap.maglev.contains(id) {
                dp.get_maglev(*id)?.map(|t| table_hash(&t))
            } else {
                None
            };
            // Memberships of backends in its slots; any other is left for `verify`.
            let members = slots
                .iter()
                .filter_map(|b| {
                    snap.members
                        .get(&MemberKey {
                            service_id: *id,
                            backend_id: *b,
                        })
                        .map(|w| (*b, *w))
                })
                .collect();
            let applied = Applied {
                id: *id,
                slots,
                frontends: fe_by_id.remove(id).unwrap_or_default(),
                members,
                maglev,
            };
            s.account(&applied, 1);
            s.ids_in_use.insert(*id);
            for (k, _) in &applied.frontends {
                s.fe_owner.insert(*k, *id);
            }
            s.keys_by_id.insert(*id, key.clone());
            s.applied.insert(key, applied);
        }
        for a in s.applied.values() {
            for b in &a.slots {
                let v = snap.backends[b];
                s.backends.entry(*b).or_insert((v, 0)).1 += 1;
                s.backend_ids.insert(v, *b);
            }
        }
        s.counts.backends = s.backends.len() as i64;
        // Everything else is an orphan until verified.
        let ids = snap
            .names
            .keys()
            .chain(snap.slots.keys().map(|k| &k.service_id))
            .chain(snap.frontends.values().map(|f| &f.service_id))
            .chain(snap.maglev.iter());
        s.orphan_service_ids = ids
            .filter(|id| **id != 0 && !s.ids_in_use.contains(id))
            .copied()
            .collect();
        s.orphan_backend_ids = snap
            .backends
            .keys()
            .filter(|b| !s.backends.contains_key(b))
            .copied()
            .collect();
        s.orphans = Counts {
            frontends: snap.frontends.len() as i64 - s.counts.frontends,
            slots: snap.slots.len() as i64 - s.counts.slots,
            backends: s.orphan_backend_ids.len() as i64,
            names: snap.names.len() as i64 - s.counts.names,
        };
        let max_sid = s
            .ids_in_use
            .iter()
            .chain(s.orphan_service_ids.iter())
            .max()
            .copied()
            .unwrap_or(0);
        s.next_service_id = max_sid.wrapping_add(1).max(1);
        s.next_backend_id = snap
            .backends
            .keys()
            .max()
            .copied()
            .unwrap_or(0)
            .wrapping_add(1)
            .max(1);
        Ok(s)
    }

    /// Adds (`sign` 1) or removes (-1) a key's entries from the counts and VIP references.
    fn account(&mut self, a: &Applied, sign: i64) {
        self.counts.slots += sign * a.slots.len() as i64;
        self.counts.names += sign;
        self.counts.frontends += sign * a.frontends.len() as i64;
        for (k, f) in &a.frontends {
            if has_marker(f) {
                let r = self.vip_refs.entry(k.addr).or_default();
                if sign > 0 {
                    if *r == 0 {
                        self.counts.frontends += 1;
                    }
                    *r += 1;
                } else {
                    *r -= 1;
                    if *r == 0 {
                        self.vip_refs.remove(&k.addr);
                        self.counts.frontends -= 1;
                    }
                }
            }
        }
    }

    /// Sets the Maglev table size of hashing services (a prime `<= MAGLEV_MAX`); tables are
    /// rewritten when their key is applied next.
    pub fn set_maglev_size(&mut self, size: u32) {
        self.maglev_size = size;
    }

    /// Number of keys bound to a service id.
    pub fn bound(&self) -> usize {
        self.applied.len()
    }

    /// The service id of `key`, when it has one.
    pub fn id_of(&self, key: &ServicePortKey) -> Option<u32> {
        self.applied.get(key).map(|a| a.id)
    }

    /// Every key bound to a service id.
    pub fn keys(&self) -> impl Iterator<Item = &ServicePortKey> {
        self.applied.keys()
    }

    /// Makes room for `keys` Service ports, `frontends` frontends and `backends` backends in
    /// total, so that a first sync of N Services grows no table N times over. A hint: a
    /// backend shared by several Service ports is counted once per port by callers that sum
    /// per port, which reserves more than the tables end up holding.
    pub fn reserve(&mut self, keys: usize, frontends: usize, backends: usize) {
        let more = |want: usize, have: usize| want.saturating_sub(have);
        self.applied.reserve(more(keys, self.applied.len()));
        self.keys_by_id.reserve(more(keys, self.keys_by_id.len()));
        self.ids_in_use.reserve(more(keys, self.ids_in_use.len()));
        self.fe_owner.reserve(more(frontends, self.fe_owner.len()));
        self.backends.reserve(more(backends, self.backends.len()));
        self.backend_ids
            .reserve(more(backends, self.backend_ids.len()));
    }

    /// Entries in use per map: (frontends with VIP markers, slots, backends, names).
    pub fn entry_counts(&self) -> (usize, usize, usize, usize) {
        let c = self.counts;
        (
            c.frontends as usize,
            c.slots as usize,
            c.backends as usize,
            c.names as usize,
        )
    }

    fn table(&self, slots: &[u32], local: &HashMap<u32, Backend>) -> Vec<u32> {
        let names: Vec<(u32, String)> = slots
            .iter()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .filter_map(|bid| {
                self.backends
                    .get(bid)
                    .map(|(b, _)| b)
                    .or_else(|| local.get(bid))
                    .map(|b| (*bid, backend_name(b)))
            })
            .collect();
        let size = if self.maglev_size == 0 {
            proxy_common::MAGLEV_DEFAULT
        } else {
            self.maglev_size
        };
        crate::maglev::table(&names, size)
    }

    /// Applies the desired state of the keys of one Service: `None` removes a key. The keys
    /// must all belong to one Service. On [`DatapathError::Full`] nothing was written; on
    /// another error the keys before the failing one are applied, the failing one may be
    /// half-written (in the safe order) and [`ServiceReconciler::verify`] must run before it
    /// is retried.
    pub fn apply_service(
        &mut self,
        dp: &mut impl ServiceMaps,
        items: &[(ServicePortKey, Option<&DesiredService>)],
        report: &mut Report,
    ) -> Result<(), DatapathError> {
        // Removals first: they free entries the others may need.
        let mut order: Vec<&(ServicePortKey, Option<&DesiredService>)> = items.iter().collect();
        order.sort_by_key(|(k, d)| (d.is_some(), k.clone()));
        let mut local_bids: HashMap<Backend, u32> = HashMap::new();
        let mut local_values: HashMap<u32, Backend> = HashMap::new();
        let mut local_ids: HashMap<ServicePortKey, u32> = HashMap::new();
        let mut plans = Vec::new();
        for (key, desired) in order {
            let old = self.applied.get(key).cloned();
            let Some(svc) = desired else {
                if let Some(old) = old {
                    plans.push(Plan {
                        key: key.clone(),
                        id: old.id,
                        new_id: false,
                        old: Some(old),
                        new: None,
                        new_backends: Vec::new(),
                    });
                }
                continue;
            };
            let (id, new_id) = match &old {
                Some(a) => (a.id, false),
                None => {
                    let (used, orphans) = (&self.ids_in_use, &self.orphan_service_ids);
                    let in_batch: HashSet<u32> = local_ids.values().copied().collect();
                    let id = alloc_id(&mut self.next_service_id, |id| {
                        used.contains(&id) || orphans.contains(&id) || in_batch.contains(&id)
                    });
                    (id, true)
                }
            };
            local_ids.insert(key.clone(), id);
            let mut bids = Vec::new();
            let mut new_backends = Vec::new();
            for addr in &svc.backends {
                let b = backend_value(addr, key.protocol);
                let bid = match self.backend_ids.get(&b).or(local_bids.get(&b)) {
                    Some(id) => *id,
                    None => {
                        let (used, orphans) = (&self.backends, &self.orphan_backend_ids);
                        let id = alloc_id(&mut self.next_backend_id, |id| {
                            used.contains_key(&id)
                                || orphans.contains(&id)
                                || local_values.contains_key(&id)
                        });
                        local_bids.insert(b, id);
                        local_values.insert(id, b);
                        new_backends.push((id, b));
                        id
                    }
                };
                bids.push((*addr, bid));
            }
            let old_slots = old.as_ref().map(|a| a.slots.as_slice()).unwrap_or(&[]);
            let slots = plan_slots(svc, old_slots, &bids);
            let gk = group_key(key);
            let group = local_ids
                .get(&gk)
                .copied()
                .or_else(|| self.id_of(&gk))
                .unwrap_or(id);
            let mut frontends: Vec<(FrontendKey, Frontend)> = svc
                .frontends
                .iter()
                .map(|fe| {
                    (
                        frontend_key(fe, key.protocol, key.scope),
                        frontend_value(id, slots.len(), svc, group),
                    )
                })
                .collect();
            frontends.sort_by_key(|(k, _)| *k);
            let table = is_hashing(svc.algorithm).then(|| {
                let t = self.table(&slots, &local_values);
                let h = table_hash(&t);
                (t, h)
            });
            plans.push(Plan {
                key: key.clone(),
                id,
                new_id,
                old,
                new: Some(Target {
                    members: plan_members(svc, &bids),
                    slots,
                    frontends,
                    table,
                }),
                new_backends,
            });
        }
        self.check_capacity(dp.capacity(), &plans)?;
        let mut unused = BTreeSet::new();
        for p in plans {
            let applied = p.new.is_some();
            self.write(dp, p, &mut unused, report)?;
            if applied {
                report.applied += 1;
            }
        }
        // Backends no slot refers to any more, after every key (one may have moved from a
        // removed key to another).
        for bid in unused {
            if self.backends.get(&bid).is_some_and(|(_, r)| *r == 0) {
                dp.delete_backend(bid)?;
                report.deletes += 1;
                if let Some((b, _)) = self.backends.remove(&bid) {
                    self.backend_ids.remove(&b);
                }
                self.counts.backends -= 1;
            }
        }
        Ok(())
    }

    /// Refuses plans whose peak entry counts exceed the maps' limits, or whose largest key
    /// exceeds `MAX_BACKENDS_PER_SERVICE`, naming the map, the limit and the flag that raises
    /// it. Steps run in plan order, each key's removals before its additions.
    fn check_capacity(&self, cap: Capacity, plans: &[Plan]) -> Result<(), DatapathError> {
        let mut run = Counts {
            frontends: self.counts.frontends + self.orphans.frontends,
            slots: self.counts.slots + self.orphans.slots,
            backends: self.counts.backends + self.orphans.backends,
            names: self.counts.names + self.orphans.names,
        };
        let mut peak = run;
        let mut vips: HashMap<[u8; 16], i64> = HashMap::new();
        let mut largest = 0;
        for p in plans {
            let empty = Vec::new();
            let old_fe = p.old.as_ref().map(|a| &a.frontends).unwrap_or(&empty);
            let new_fe = p.new.as_ref().map(|t| &t.frontends).unwrap_or(&empty);
            let old_keys: HashSet<&FrontendKey> = old_fe.iter().map(|(k, _)| k).collect();
            let new_keys: HashSet<&FrontendKey> = new_fe.iter().map(|(k, _)| k).collect();
            let vip = |vips: &mut HashMap<[u8; 16], i64>, a: [u8; 16]| -> i64 {
                *vips
                    .entry(a)
                    .or_insert_with(|| *self.vip_refs.get(&a).unwrap_or(&0) as i64)
            };
            // (A) removals.
            for (k, f) in old_fe.iter().filter(|(k, _)| !new_keys.contains(k)) {
                run.frontends -= 1;
                if has_marker(f) {
                    let n = vip(&mut vips, k.addr);
                    vips.insert(k.addr, n - 1);
                    if n == 1 {
                        run.frontends -= 1;
                    }
                }
            }
            let old_slots = p.old.as_ref().map(|a| a.slots.len()).unwrap_or(0) as i64;
            let new_slots = p.new.as_ref().map(|t| t.slots.len()).unwrap_or(0) as i64;
            if p.new.is_none() {
                run.slots -= old_slots;
                run.names -= 1;
            }
            // (B) additions.
            if p.new_id {
                run.names += 1;
            }
            run.backends += p.new_backends.len() as i64;
            run.slots += (new_slots - old_slots).max(0);
            for (k, f) in new_fe.iter().filter(|(k, _)| !old_keys.contains(k)) {
                run.frontends += 1;
                if has_marker(f) {
                    let n = vip(&mut vips, k.addr);
                    vips.insert(k.addr, n + 1);
                    if n == 0 {
                        run.frontends += 1;
                    }
                }
            }
            peak.frontends = peak.frontends.max(run.frontends);
            peak.slots = peak.slots.max(run.slots);
            peak.backends = peak.backends.max(run.backends);
            peak.names = peak.names.max(run.names);
            // (C) stale slots (backends nothing uses are removed after every key).
            if p.new.is_some() {
                run.slots -= (old_slots - new_slots).max(0);
            }
            largest = largest.max(new_slots as usize);
        }
        let checks = [
            ("FRONTENDS", peak.frontends, cap.frontends, "max-frontends"),
            ("BACKEND_SLOTS", peak.slots, cap.slots, "max-backend-slots"),
            ("BACKENDS", peak.backends, cap.backends, "max-backends"),
            ("SERVICE_NAMES", peak.names, cap.services, "max-frontends"),
            (
                "BACKEND_SLOTS (per service)",
                largest as i64,
                proxy_common::MAX_BACKENDS_PER_SERVICE,
                "max-backend-slots",
            ),
        ];
        for (map, needed, limit, flag) in checks {
            if needed > limit as i64 {
                return Err(DatapathError::Full {
                    map,
                    needed: needed as usize,
                    limit,
                    flag,
                });
            }
        }
        Ok(())
    }

    /// Writes one plan in the safe order and records it.
    fn write(
        &mut self,
        dp: &mut impl ServiceMaps,
        p: Plan,
        unused: &mut BTreeSet<u32>,
        report: &mut Report,
    ) -> Result<(), DatapathError> {
        let id = p.id;
        let empty = Applied {
            id,
            slots: Vec::new(),
            frontends: Vec::new(),
            members: BTreeMap::new(),
            maglev: None,
        };
        // What the key holds now: a frontend of it may have been taken over by a key written
        // earlier in this batch.
        let old = self
            .applied
            .get(&p.key)
            .cloned()
            .or_else(|| p.old.clone())
            .unwrap_or(empty);
        let old_set: BTreeSet<u32> = old.slots.iter().copied().collect();
        let (new_slots, new_fe, new_members, new_table) = match &p.new {
            Some(t) => (
                t.slots.clone(),
                t.frontends.clone(),
                t.members.clone(),
                t.table.as_ref(),
            ),
            None => (Vec::new(), Vec::new(), BTreeMap::new(), None),
        };
        let new_set: BTreeSet<u32> = new_slots.iter().copied().collect();
        let new_keys: BTreeMap<FrontendKey, Frontend> = new_fe.iter().copied().collect();
        let old_keys: BTreeMap<FrontendKey, Frontend> = old.frontends.iter().copied().collect();
        // VIP markers after this plan.
        let mut vip_after: BTreeMap<[u8; 16], i64> = BTreeMap::new();
        for (k, f) in old
            .frontends
            .iter()
            .filter(|(k, _)| !new_keys.contains_key(k))
        {
            if has_marker(f) {
                *vip_after
                    .entry(k.addr)
                    .or_insert_with(|| *self.vip_refs.get(&k.addr).unwrap_or(&0) as i64) -= 1;
            }
        }
        for (k, f) in new_fe.iter().filter(|(k, _)| !old_keys.contains_key(k)) {
            if has_marker(f) {
                *vip_after
                    .entry(k.addr)
                    .or_insert_with(|| *self.vip_refs.get(&k.addr).unwrap_or(&0) as i64) += 1;
            }
        }
        let had_marker = |a: &[u8; 16]| self.vip_refs.get(a).is_some_and(|n| *n > 0);
        let marker_del: Vec<[u8; 16]> = vip_after
            .iter()
            .filter(|(a, n)| **n <= 0 && had_marker(a))
            .map(|(a, _)| *a)
            .collect();
        let marker_add: Vec<[u8; 16]> = vip_after
            .iter()
            .filter(|(a, n)| **n > 0 && !had_marker(a))
            .map(|(a, _)| *a)
            .collect();

        // --- (A) removals ---------------------------------------------------------------
        // Memberships first: affinity and Maglev stop choosing a leaving backend before its
        // slot goes.
        for bid in old.members.keys() {
            if !new_members.contains_key(bid) {
                dp.delete_member(&MemberKey {
                    service_id: id,
                    backend_id: *bid,
                })?;
                report.deletes += 1;
            }
        }
        for (k, _) in old
            .frontends
            .iter()
            .filter(|(k, _)| !new_keys.contains_key(k))
        {
            if self.fe_owner.get(k) == Some(&id) {
                dp.delete_frontend(k)?;
                report.deletes += 1;
            }
        }
        for a in &marker_del {
            dp.delete_frontend(&marker_key(*a))?;
            report.deletes += 1;
        }
        if p.new.is_none() {
            for slot in 0..old.slots.len() as u32 {
                dp.delete_slot(&BackendSlotKey {
                    service_id: id,
                    slot,
                })?;
                report.deletes += 1;
            }
            dp.delete_name(id)?;
            report.deletes += 1;
            if old.maglev.is_some() {
                dp.delete_maglev(id)?;
                report.deletes += 1;
            }
        }

        // --- (B) writes -------------------------------------------------------------------
        // Addresses whose cluster-IP frontend this key took over from another Service.
        let mut taken_vips = Vec::new();
        if p.new.is_some() {
            for (bid, b) in &p.new_backends {
                dp.put_backend(*bid, b)?;
                report.writes += 1;
            }
            if p.new_id {
                dp.put_name(id, &service_name(&p.key))?;
                report.writes += 1;
            }
            for (i, bid) in new_slots.iter().enumerate() {
                if old.slots.get(i) != Some(bid) {
                    // Backends first known in this plan are recorded after the writes.
                    let backend = p
                        .new_backends
                        .iter()
                        .find(|(n, _)| n == bid)
                        .map(|(_, b)| *b)
                        .or_else(|| self.backends.get(bid).map(|(b, _)| *b))
                        .ok_or_else(|| unknown_backend(*bid))?;
                    dp.put_slot(
                        &BackendSlotKey {
                            service_id: id,
                            slot: i as u32,
                        },
                        &BackendSlot {
                            backend_id: *bid,
                            backend,
                        },
                    )?;
                    report.writes += 1;
                }
            }
            for (bid, w) in &new_members {
                if old.members.get(bid) != Some(w) {
                    dp.put_member(
                        &MemberKey {
                            service_id: id,
                            backend_id: *bid,
                        },
                        *w,
                    )?;
                    report.writes += 1;
                }
            }
            if let Some((table, h)) = new_table
                && old.maglev != Some(*h)
            {
                dp.put_maglev(id, table)?;
                report.writes += 1;
            }
            // Markers first: a new VIP refuses undefined ports from its first moment.
            for a in &marker_add {
                dp.put_frontend(&marker_key(*a), &MARKER)?;
                report.writes += 1;
            }
            for (k, v) in &new_fe {
                if old_keys.get(k) != Some(v) {
                    dp.put_frontend(k, v)?;
                    report.writes += 1;
                    taken_vips.extend(self.take_over(k, id));
                }
            }

            // --- (C) stale entries ----------------------------------------------------------
            if old.maglev.is_some() && new_table.is_none() {
                dp.delete_maglev(id)?;
                report.deletes += 1;
            }
            for slot in new_slots.len()..old.slots.len() {
                dp.delete_slot(&BackendSlotKey {
                    service_id: id,
                    slot: slot as u32,
                })?;
                report.deletes += 1;
            }
        }
        // Record: backends first known now, references, then unused backends.
        for (bid, b) in &p.new_backends {
            self.backends.insert(*bid, (*b, 0));
            self.backend_ids.insert(*b, *bid);
            self.counts.backends += 1;
        }
        for b in &new_slots {
            if let Some(e) = self.backends.get_mut(b) {
                e.1 += 1;
            }
        }
        for b in &old.slots {
            if let Some(e) = self.backends.get_mut(b) {
                e.1 = e.1.saturating_sub(1);
                if e.1 == 0 {
                    unused.insert(*b);
                }
            }
        }
        for bid in old_set.difference(&new_set) {
            if let Some((b, _)) = self.backends.get(bid)
                && b.proto == PROTO_UDP
            {
                report.released.push((id, *bid, *b));
            }
        }
        if let Some(a) = self.applied.get(&p.key).cloned() {
            self.account(&a, -1);
            for (k, _) in &a.frontends {
                if self.fe_owner.get(k) == Some(&id) {
                    self.fe_owner.remove(k);
                }
            }
        }
        match p.new {
            Some(t) => {
                for (k, _) in &t.frontends {
                    self.fe_owner.insert(*k, id);
                }
                self.keys_by_id.insert(id, p.key.clone());
                let a = Applied {
                    id,
                    slots: t.slots,
                    frontends: t.frontends,
                    members: t.members,
                    maglev: t.table.map(|(_, h)| h),
                };
                self.account(&a, 1);
                self.ids_in_use.insert(id);
                self.applied.insert(p.key, a);
            }
            None => {
                self.ids_in_use.remove(&id);
                self.keys_by_id.remove(&id);
                self.applied.remove(&p.key);
            }
        }
        // A VIP whose last cluster-IP frontend became another key's external address or
        // node port loses its marker (other ports of the address are no longer refused).
        for a in taken_vips {
            if self.vip_refs.get(&a).is_none_or(|n| *n == 0) {
                dp.delete_frontend(&marker_key(a))?;
                report.deletes += 1;
            }
        }
        Ok(())
    }

    /// Frontend `k` was just written for service id `id`: when another key held it (it moves
    /// between Services in one batch), that key no longer does, so its later removal of the
    /// frontend does not undo this write. Returns the frontend's address when the other key
    /// held it as a cluster IP (its VIP reference is gone; the caller removes the marker once
    /// nothing refers to the VIP).
    fn take_over(&mut self, k: &FrontendKey, id: u32) -> Option<[u8; 16]> {
        let &other = self.fe_owner.get(k)?;
        if other == id {
            return None;
        }
        self.fe_owner.insert(*k, id);
        let okey = self.keys_by_id.get(&other).cloned()?;
        let a = self.applied.get_mut(&okey)?;
        let pos = a.frontends.iter().position(|(fk, _)| fk == k)?;
        let (_, v) = a.frontends.remove(pos);
        let removed = Applied {
            id: other,
            slots: Vec::new(),
            frontends: vec![(*k, v)],
            members: BTreeMap::new(),
            maglev: None,
        };
        // Its frontend (and a VIP reference) leave the other key's count; its name stays.
        self.account(&removed, -1);
        self.counts.names += 1;
        has_marker(&v).then_some(k.addr)
    }

    /// The service maps as they should be, from what was applied.
    fn expected(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for (key, a) in &self.applied {
            for (k, v) in &a.frontends {
                s.frontends.insert(*k, *v);
            }
            for (i, b) in a.slots.iter().enumerate() {
                s.slots.insert(
                    BackendSlotKey {
                        service_id: a.id,
                        slot: i as u32,
                    },
                    *b,
                );
            }
            for (b, w) in &a.members {
                s.members.insert(
                    MemberKey {
                        service_id: a.id,
                        backend_id: *b,
                    },
                    *w,
                );
            }
            s.names.insert(a.id, service_name(key));
            if a.maglev.is_some() {
                s.maglev.insert(a.id);
            }
        }
        for a in self.vip_refs.keys() {
            s.frontends.insert(marker_key(*a), MARKER);
        }
        for (id, (b, _)) in &self.backends {
            s.backends.insert(*id, *b);
        }
        s
    }

    /// Compares the maps with what was applied and repairs every difference in the safe
    /// order: entries nothing claims are removed, missing or changed ones written again.
    /// Returns the repairs made (0 and 0 when the maps were as expected).
    pub fn verify(&mut self, dp: &mut impl ServiceMaps) -> Result<Report, DatapathError> {
        let mut r = Report::default();
        // Backends left unused by an interrupted write are not wanted.
        let unused: Vec<u32> = self
            .backends
            .iter()
            .filter(|(_, (_, refs))| *refs == 0)
            .map(|(id, _)| *id)
            .collect();
        for id in unused {
            if let Some((b, _)) = self.backends.remove(&id) {
                self.backend_ids.remove(&b);
            }
            self.counts.backends -= 1;
        }
        let have = dp.snapshot()?;
        let want = self.expected();
        // (A) removals, in the order the data path tolerates.
        for k in have
            .members
            .keys()
            .filter(|k| !want.members.contains_key(k))
        {
            dp.delete_member(k)?;
            r.deletes += 1;
        }
        let stale_fe: Vec<&FrontendKey> = have
            .frontends
            .keys()
            .filter(|k| !want.frontends.contains_key(k))
            .collect();
        for k in stale_fe
            .iter()
            .filter(|k| k.proto != 0)
            .chain(stale_fe.iter().filter(|k| k.proto == 0))
        {
            dp.delete_frontend(k)?;
            r.deletes += 1;
        }
        for k in have.slots.keys().filter(|k| !want.slots.contains_key(k)) {
            dp.delete_slot(k)?;
            r.deletes += 1;
        }
        for id in have.names.keys().filter(|id| !want.names.contains_key(id)) {
            dp.delete_name(*id)?;
            r.deletes += 1;
        }
        // (B) writes.
        for (id, b) in &want.backends {
            if have.backends.get(id) != Some(b) {
                dp.put_backend(*id, b)?;
                r.writes += 1;
            }
        }
        for (id, n) in &want.names {
            if have.names.get(id) != Some(n) {
                dp.put_name(*id, n)?;
                r.writes += 1;
            }
        }
        for (k, b) in &want.slots {
            if have.slots.get(k) != Some(b) || have.stale_slots.contains(k) {
                let backend = *want.backends.get(b).ok_or_else(|| unknown_backend(*b))?;
                dp.put_slot(
                    k,
                    &BackendSlot {
                        backend_id: *b,
                        backend,
                    },
                )?;
                r.writes += 1;
            }
        }
        for (k, w) in &want.members {
            if have.members.get(k) != Some(w) {
                dp.put_member(k, *w)?;
                r.writes += 1;
            }
        }
        let hashing: Vec<(u32, Vec<u32>, u64)> = self
            .applied
            .values()
            .filter_map(|a| a.maglev.map(|h| (a.id, a.slots.clone(), h)))
            .collect();
        for (id, slots, h) in hashing {
            let current = dp.get_maglev(id)?.map(|t| table_hash(&t));
            if current != Some(h) {
                let t = self.table(&slots, &HashMap::new());
                dp.put_maglev(id, &t)?;
                r.writes += 1;
                // The size may have changed since: remember what is there now.
                let nh = table_hash(&t);
                if let Some(a) = self.applied.values_mut().find(|a| a.id == id) {
                    a.maglev = Some(nh);
                }
            }
        }
        let (markers, real): (Vec<_>, Vec<_>) =
            want.frontends.iter().partition(|(k, _)| k.proto == 0);
        for (k, v) in markers.into_iter().chain(real) {
            if have.frontends.get(k) != Some(v) {
                dp.put_frontend(k, v)?;
                r.writes += 1;
            }
        }
        // (C) stale tables and backends.
        for id in have.maglev.difference(&want.maglev) {
            dp.delete_maglev(*id)?;
            r.deletes += 1;
        }
        for id in have
            .backends
            .keys()
            .filter(|id| !want.backends.contains_key(id))
        {
            dp.delete_backend(*id)?;
            r.deletes += 1;
        }
        self.orphan_service_ids.clear();
        self.orphan_backend_ids.clear();
        self.orphans = Counts::default();
        self.sweep_counters(dp);
        Ok(r)
    }

    /// Deletes the counters of ids not bound now and of (service, backend) pairs no longer
    /// in any slot, keeping their counts in the sums of what stays bound
    /// ([`ServiceMaps::sweep_stats`]): at every verification, and at start before any id
    /// is handed out, since an id an earlier agent released may be handed out again then
    /// (ids continue after the highest bound one) and must not inherit its counts. Not a
    /// repair (the programs wrote them); a failure leaves entries, or a count to move, for
    /// the next verification, so it is logged, not returned.
    pub fn sweep_counters(&self, dp: &mut impl ServiceMaps) {
        let pairs: HashSet<(u32, u32)> = self
            .applied
            .values()
            .flat_map(|a| a.slots.iter().map(move |b| (a.id, *b)))
            .collect();
        let bound = crate::datapath::Bound {
            service: &|id| self.ids_in_use.contains(&id),
            backend: &|id| self.backends.contains_key(&id),
            member: &|s, b| pairs.contains(&(s, b)),
        };
        match dp.sweep_stats(&bound) {
            Ok(0) => {}
            Ok(n) => tracing::debug!(entries = n, "counters of released ids deleted"),
            Err(e) => {
                tracing::warn!(error = %e, "sweeping the counters of released ids and endpoints failed; retried at the next verification")
            }
        }
    }
}
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proxy_common::FRONTEND_F_EXTERNAL;
    use crate::datapath::{
        Capacity,
        fake::{FakeDatapath, Moment, Op, consistency_violations},
    };

    pub(crate) type Tables = BTreeMap<u32, Vec<u32>>;
    use crate::model::DesiredState;

    /// The old whole-state entry point, for tests: applies every key of `d` and removes the
    /// keys it lacks, Service by Service; the first error is returned (after every Service
    /// was tried).
    fn sync(
        s: &mut ServiceReconciler,
        dp: &mut FakeDatapath,
        d: &DesiredState,
    ) -> Result<Report, DatapathError> {
        let mut keys: BTreeSet<ServicePortKey> = d.services.keys().cloned().collect();
        keys.extend(s.keys().cloned());
        let mut r = Report::default();
        let mut err = None;
        let mut group: Vec<(ServicePortKey, Option<&DesiredService>)> = Vec::new();
        let mut flush = |group: &mut Vec<(ServicePortKey, Option<&DesiredService>)>,
                         s: &mut ServiceReconciler,
                         dp: &mut FakeDatapath,
                         r: &mut Report| {
            if !group.is_empty() {
                if let Err(e) = s.apply_service(dp, group, r) {
                    err.get_or_insert(e);
                }
                group.clear();
            }
        };
        for k in keys {
            if group
                .first()
                .is_some_and(|(g, _)| (&g.namespace, &g.name) != (&k.namespace, &k.name))
            {
                flush(&mut group, s, dp, &mut r);
            }
            let v = d.services.get(&k);
            group.push((k, v));
        }
        flush(&mut group, s, dp, &mut r);
        match err {
            Some(e) => Err(e),
            None => Ok(r),
        }
    }

    fn cap() -> Capacity {
        Capacity {
            frontends: 100,
            slots: 100,
            backends: 100,
            services: 100,
        }
    }

    fn key(name: &str, proto: Protocol) -> ServicePortKey {
        ServicePortKey {
            namespace: "default".into(),
            name: name.into(),
            port_name: "http".into(),
            protocol: proto,
            family: Family::V4,
            scope: Scope::Internal,
        }
    }

    fn svc(frontends: &[&str], backends: &[&str]) -> DesiredService {
        DesiredService {
            frontends: frontends.iter().map(|s| s.parse().unwrap()).collect(),
            backends: backends.iter().map(|s| s.parse().unwrap()).collect(),
            flags: 0,
            ..Default::default()
        }
    }

    fn state(items: Vec<(ServicePortKey, DesiredService)>) -> DesiredState {
        DesiredState {
            services: items.into_iter().collect(),
        }
    }

    /// Replays the op log and checks the maps after every single write
    /// ([`consistency_violations`] at [`Moment::AnyWrite`]), then at rest after the last.
    pub(crate) fn assert_every_step_consistent(
        log: &[Op],
        start: &Snapshot,
        start_tables: &Tables,
    ) {
        let mut s = start.clone();
        let mut tables = start_tables.clone();
        for (i, op) in log.iter().enumerate() {
            match op {
                Op::PutFrontend(k, v) => drop(s.frontends.insert(*k, *v)),
                Op::DeleteFrontend(k) => drop(s.frontends.remove(k)),
                Op::PutSlot(k, v) => drop(s.slots.insert(*k, *v)),
                Op::DeleteSlot(k) => drop(s.slots.remove(k)),
                Op::PutBackend(k, v) => drop(s.backends.insert(*k, *v)),
                Op::DeleteBackend(k) => drop(s.backends.remove(k)),
                Op::PutName(k, v) => drop(s.names.insert(*k, v.clone())),
                Op::DeleteName(k) => drop(s.names.remove(k)),
                Op::PutMember(k, w) => drop(s.members.insert(*k, *w)),
                Op::DeleteMember(k) => drop(s.members.remove(k)),
                Op::PutMaglev(id, t) => {
                    s.maglev.insert(*id);
                    tables.insert(*id, t.clone());
                }
                Op::DeleteMaglev(id) => {
                    s.maglev.remove(id);
                    tables.remove(id);
                }
                _ => {}
            }
            let v = consistency_violations(&s, &tables, Moment::AnyWrite);
            assert!(v.is_empty(), "after write {i} ({op:?}): {v:#?}");
        }
        let v = consistency_violations(&s, &tables, Moment::AtRest);
        assert!(v.is_empty(), "at rest: {v:#?}");
    }

    #[test]
    fn arrange_keeps_survivors_in_place() {
        let set = |v: &[u32]| v.iter().copied().collect::<BTreeSet<_>>();
        assert_eq!(arrange_slots(&[], &set(&[3, 1, 2])), vec![1, 2, 3]);
        assert_eq!(arrange_slots(&[1, 2, 3], &set(&[1, 2, 3])), vec![1, 2, 3]);
        // Remove the middle one: the last moves into its hole.
        assert_eq!(arrange_slots(&[1, 2, 3], &set(&[1, 3])), vec![1, 3]);
        // Replace: the new one takes the hole.
        assert_eq!(arrange_slots(&[1, 2, 3], &set(&[1, 3, 4])), vec![1, 4, 3]);
        // Grow.
        assert_eq!(arrange_slots(&[1, 2], &set(&[1, 2, 5])), vec![1, 2, 5]);
        assert_eq!(arrange_slots(&[1, 2, 3], &set(&[])), Vec::<u32>::new());
        assert_eq!(arrange_slots(&[1, 2, 3, 4], &set(&[4])), vec![4]);
    }

    #[test]
    fn service_names_round_trip() {
        let k = key("web", Protocol::Udp);
        assert_eq!(service_name(&k), "default/web:http/UDP/v4");
        assert_eq!(parse_service_name(&service_name(&k)), Some(k));
        let unnamed = ServicePortKey {
            port_name: String::new(),
            family: Family::V6,
            ..key("x", Protocol::Tcp)
        };
        assert_eq!(parse_service_name(&service_name(&unnamed)), Some(unnamed));
        let external = ServicePortKey {
            scope: Scope::External,
            ..key("lb", Protocol::Tcp)
        };
        assert_eq!(service_name(&external), "default/lb:http/TCP/v4/external");
        assert_eq!(parse_service_name(&service_name(&external)), Some(external));
        assert_eq!(parse_service_name("default/lb:http/TCP/v4/other"), None);
        assert_eq!(parse_service_name("garbage"), None);
    }

    #[test]
    fn removed_udp_backends_are_reported_for_release_and_tcp_ones_are_not() {
        for incremental in [false, true] {
            let mut dp = FakeDatapath::new(cap());
            let mut s = ServiceReconciler::adopt(&dp).unwrap();
            let both = |udp: &[&str], tcp: &[&str]| {
                state(vec![
                    (key("dns", Protocol::Udp), svc(&["10.96.0.10:53"], udp)),
                    (key("dns", Protocol::Tcp), svc(&["10.96.0.10:53"], tcp)),
                ])
            };
            let st = sync(
                &mut s,
                &mut dp,
                &both(&["10.0.0.1:53", "10.0.0.2:53"], &["10.0.0.1:53"]),
            )
            .unwrap();
            assert!(st.released.is_empty());
            if !incremental {
                s = ServiceReconciler::adopt(&dp).unwrap(); // the next sync is a full one
            }
            let udp_id = s.id_of(&key("dns", Protocol::Udp)).unwrap();
            let st = sync(&mut s, &mut dp, &both(&["10.0.0.2:53"], &[])).unwrap();
            assert_eq!(st.released.len(), 1, "{:?}", st.released);
            let (sid, bid, b) = st.released[0];
            assert_eq!(sid, udp_id);
            assert_eq!(
                b,
                backend_value(&"10.0.0.1:53".parse().unwrap(), Protocol::Udp)
            );
            assert_ne!(bid, 0);
            // Removing the whole UDP Service releases its last backend too.
            if !incremental {
                s = ServiceReconciler::adopt(&dp).unwrap();
            }
            let st = sync(
                &mut s,
                &mut dp,
                &state(vec![(
                    key("dns", Protocol::Tcp),
                    svc(&["10.96.0.10:53"], &[]),
                )]),
            )
            .unwrap();
            assert_eq!(st.released.len(), 1, "{:?}", st.released);
            assert_eq!(st.released[0].0, udp_id);
        }
    }

    #[test]
    fn external_frontends_get_no_vip_marker_and_their_own_key_scope() {
        for incremental in [false, true] {
            let mut dp = FakeDatapath::new(cap());
            let mut s = ServiceReconciler::adopt(&dp).unwrap();
            let mut ext = svc(&["192.0.2.7:80", "192.168.1.5:30080"], &["10.0.0.1:8080"]);
            ext.flags = FRONTEND_F_EXTERNAL;
            let mut ingress = ext.clone();
            ingress.flags |= proxy_common::FRONTEND_F_LOCAL_ONLY;
            let k = |scope| ServicePortKey {
                scope,
                ..key("lb", Protocol::Tcp)
            };
            let d = state(vec![
                (
                    k(Scope::Internal),
                    svc(&["10.96.0.1:80"], &["10.0.0.1:8080"]),
                ),
                (k(Scope::External), ext),
                (k(Scope::Ingress), ingress),
            ]);
            if incremental {
                sync(&mut s, &mut dp, &DesiredState::default()).unwrap();
            }
            sync(&mut s, &mut dp, &d).unwrap();
            // 5 frontends and the cluster IP's VIP marker.
            assert_eq!(s.entry_counts().0, 6);
            assert_eq!(dp.state.frontends.len(), 6);
            let markers: Vec<_> = dp.state.frontends.keys().filter(|k| k.proto == 0).collect();
            assert_eq!(markers.len(), 1, "only the cluster IP: {markers:?}");
            let scopes: BTreeSet<u8> = dp.state.frontends.keys().map(|k| k.scope).collect();
            assert_eq!(
                scopes,
                BTreeSet::from([proxy_common::SCOPE_NODE, proxy_common::SCOPE_INGRESS])
            );
            // Removing everything leaves nothing behind.
            sync(&mut s, &mut dp, &DesiredState::default()).unwrap();
            assert!(dp.state.frontends.is_empty(), "{:?}", dp.state.frontends);
        }
    }

    #[test]
    fn frontend_flags_come_from_the_desired_state() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let mut d = svc(&["10.96.0.1:80"], &[]);
        d.flags = proxy_common::FRONTEND_F_LOCAL_ONLY;
        sync(
            &mut s,
            &mut dp,
            &state(vec![(key("web", Protocol::Tcp), d.clone())]),
        )
        .unwrap();
        let fe = |dp: &FakeDatapath| {
            *dp.state
                .frontends
                .iter()
                .find(|(k, _)| k.proto != 0)
                .unwrap()
                .1
        };
        assert_eq!(fe(&dp).flags, proxy_common::FRONTEND_F_LOCAL_ONLY);
        d.flags = 0;
        sync(
            &mut s,
            &mut dp,
            &state(vec![(key("web", Protocol::Tcp), d)]),
        )
        .unwrap();
        assert_eq!(fe(&dp).flags, 0);
    }

    #[test]
    fn first_sync_writes_everything_in_order() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let d = state(vec![(
            key("web", Protocol::Tcp),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]),
        )]);
        let st = sync(&mut s, &mut dp, &d).unwrap();
        assert_eq!(st.writes, 2 + 1 + 2 + 2); // backends, name, slots, marker + frontend
        // Random selection never reads memberships: none are written.
        assert_eq!(dp.state.members.len(), 0);
        assert_eq!(dp.state.frontends.len(), 2);
        assert_eq!(dp.state.slots.len(), 2);
        assert_eq!(dp.state.backends.len(), 2);
        assert_every_step_consistent(&dp.log, &Snapshot::default(), &Tables::new());
        // The frontend comes last.
        assert!(
            matches!(dp.log.last(), Some(Op::PutFrontend(k, f)) if k.proto == 6 && f.backend_count == 2)
        );
        // Keys are in network byte order.
        let fk = dp.state.frontends.keys().find(|k| k.proto == 6).unwrap();
        assert_eq!(fk.port, [0, 80]);
    }

    #[test]
    fn memberships_follow_affinity_and_hashing_and_come_before_the_frontend() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let k = key("web", Protocol::Tcp);
        let mut d = svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]);
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert!(dp.state.members.is_empty());
        // Affinity on: the memberships are written before the frontend that reads them.
        d.affinity_timeout_s = 60;
        dp.log.clear();
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert_eq!(dp.state.members.len(), 2);
        let last_member = dp
            .log
            .iter()
            .rposition(|o| matches!(o, Op::PutMember(..)))
            .unwrap();
        let frontend = dp
            .log
            .iter()
            .position(|o| matches!(o, Op::PutFrontend(k, _) if k.proto == 6))
            .unwrap();
        assert!(last_member < frontend, "{:?}", dp.log);
        // Maglev instead of affinity: memberships stay, a table is added.
        d.affinity_timeout_s = 0;
        d.algorithm = Algorithm::Maglev;
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert_eq!(dp.state.members.len(), 2);
        assert_eq!(dp.state.maglev.len(), 1);
        // Back to random: memberships and table go.
        d.algorithm = Algorithm::Random;
        sync(&mut s, &mut dp, &state(vec![(k, d)])).unwrap();
        assert!(dp.state.members.is_empty());
        assert!(dp.state.maglev.is_empty());
        assert_eq!(s.verify(&mut dp).unwrap(), Report::default());
    }

    /// `MEMBERS` of the fake as (backend address, weight), for readable assertions.
    fn member_weights(dp: &FakeDatapath) -> BTreeMap<String, u32> {
        dp.state
            .members
            .iter()
            .map(|(m, w)| {
                let b = dp.state.backends[&m.backend_id];
                (
                    crate::datapath::addr::to_socket_addr(b.addr, b.port).to_string(),
                    *w,
                )
            })
            .collect()
    }

    fn weighted(d: &mut DesiredService, list: &[(&str, u32)]) {
        d.weights = list.iter().map(|(a, w)| (a.parse().unwrap(), *w)).collect();
    }

    #[test]
    fn weighted_least_load_keys_carry_weights_in_memberships() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let k = key("web", Protocol::Tcp);
        let three = ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"];
        let mut d = svc(&["10.96.0.10:80"], &three);
        d.algorithm = Algorithm::WeightedLeastConnections;
        weighted(
            &mut d,
            &[
                ("10.0.0.1:8080", 1),
                ("10.0.0.2:8080", 3),
                ("10.0.0.3:8080", 1),
            ],
        );
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        // One slot per backend (the scan compares each once, by its weight), no table.
        assert_eq!(dp.state.slots.len(), 3);
        assert!(dp.state.maglev.is_empty());
        let mut want = BTreeMap::from([
            ("10.0.0.1:8080".to_string(), 1),
            ("10.0.0.2:8080".to_string(), 3),
            ("10.0.0.3:8080".to_string(), 1),
        ]);
        assert_eq!(member_weights(&dp), want);
        let v = consistency_violations(&dp.state, &dp.tables, Moment::AtRest);
        assert!(v.is_empty(), "{v:#?}");

        // A weight change rewrites that membership only.
        weighted(
            &mut d,
            &[
                ("10.0.0.1:8080", 1),
                ("10.0.0.2:8080", 5),
                ("10.0.0.3:8080", 1),
            ],
        );
        dp.log.clear();
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert_eq!(dp.log.len(), 1, "{:?}", dp.log);
        assert!(matches!(dp.log[0], Op::PutMember(_, 5)), "{:?}", dp.log);
        want.insert("10.0.0.2:8080".into(), 5);
        assert_eq!(member_weights(&dp), want);

        // Weight 0 (the model leaves the endpoint out): its membership goes first, so the
        // scan skips it before its slot moves; every step is consistent.
        d.backends.remove(&"10.0.0.3:8080".parse().unwrap());
        weighted(&mut d, &[("10.0.0.1:8080", 1), ("10.0.0.2:8080", 5)]);
        let (before, before_tables) = (dp.state.clone(), dp.tables.clone());
        dp.log.clear();
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert_every_step_consistent(&dp.log, &before, &before_tables);
        assert!(matches!(dp.log[0], Op::DeleteMember(_)), "{:?}", dp.log);
        want.remove("10.0.0.3:8080");
        assert_eq!(member_weights(&dp), want);

        // A restarted agent adopts the weights: nothing to write.
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        dp.log.clear();
        let r = sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert_eq!((r.writes, r.deletes), (0, 0), "{:?}", dp.log);
        assert_eq!(s.verify(&mut dp).unwrap(), Report::default());

        // A weight changed behind the agent's back is repaired.
        let m = *dp.state.members.keys().next().unwrap();
        let was = dp.state.members[&m];
        dp.put_member(&m, 9).unwrap();
        let r = s.verify(&mut dp).unwrap();
        assert_eq!((r.writes, r.deletes), (1, 0));
        assert_eq!(dp.state.members[&m], was);

        // A slot whose copy of its backend went stale keeps its id at adoption and is
        // rewritten by the verification.
        let k0 = *dp.state.slots.keys().next().unwrap();
        dp.state.stale_slots.insert(k0);
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        dp.log.clear();
        let r = sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert_eq!((r.writes, r.deletes), (0, 0), "{:?}", dp.log);
        let r = s.verify(&mut dp).unwrap();
        assert_eq!((r.writes, r.deletes), (1, 0));
        assert!(
            matches!(dp.log[..], [Op::PutSlot(sk, _)] if sk == k0),
            "{:?}",
            dp.log
        );
        assert!(dp.state.stale_slots.is_empty());

        // The other weighted least-load algorithms keep the memberships; least-connections
        // has them all of weight 1; round-robin needs none.
        for a in [Algorithm::ShortestExpectedDelay, Algorithm::NeverQueue] {
            d.algorithm = a;
            sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
            assert_eq!(member_weights(&dp), want, "{a:?}");
        }
        d.algorithm = Algorithm::LeastConnections;
        d.weights.clear();
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        want.values_mut().for_each(|w| *w = 1);
        assert_eq!(member_weights(&dp), want);
        d.algorithm = Algorithm::RoundRobin;
        sync(&mut s, &mut dp, &state(vec![(k.clone(), d.clone())])).unwrap();
        assert!(dp.state.members.is_empty());
        assert_eq!(s.verify(&mut dp).unwrap(), Report::default());
    }

    #[test]
    fn destination_hash_has_a_table_and_memberships_of_weight_one() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let k = key("web", Protocol::Tcp);
        let mut d = svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]);
        d.algorithm = Algorithm::DestinationHash;
        sync(&mut s, &mut dp, &state(vec![(k, d)])).unwrap();
        assert_eq!(dp.state.maglev.len(), 1);
        let table = dp.tables.values().next().unwrap();
        let ids: BTreeSet<u32> = table.iter().copied().collect();
        assert_eq!(ids, dp.state.backends.keys().copied().collect());
        assert_eq!(
            member_weights(&dp),
            BTreeMap::from([
                ("10.0.0.1:8080".to_string(), 1),
                ("10.0.0.2:8080".to_string(), 1)
            ])
        );
        let v = consistency_violations(&dp.state, &dp.tables, Moment::AtRest);
        assert!(v.is_empty(), "{v:#?}");
    }

    #[test]
    fn unchanged_state_writes_nothing() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let d = state(vec![(
            key("web", Protocol::Tcp),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
        )]);
        sync(&mut s, &mut dp, &d).unwrap();
        dp.log.clear();
        let st = sync(&mut s, &mut dp, &d).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0));
        assert!(dp.log.is_empty());
    }

    #[test]
    fn removing_a_backend_moves_one_slot_and_keeps_every_step_consistent() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let k = key("web", Protocol::Tcp);
        let three = ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"];
        let with_affinity = |b: &[&str]| {
            let mut d = svc(&["10.96.0.10:80"], b);
            d.affinity_timeout_s = 30;
            d
        };
        sync(
            &mut s,
            &mut dp,
            &state(vec![(k.clone(), with_affinity(&three))]),
        )
        .unwrap();
        let before = dp.state.clone();
        let before_tables = dp.tables.clone();
        dp.log.clear();
        sync(
            &mut s,
            &mut dp,
            &state(vec![(
                k,
                with_affinity(&["10.0.0.1:8080", "10.0.0.3:8080"]),
            )]),
        )
        .unwrap();
        assert_every_step_consistent(&dp.log, &before, &before_tables);
        // The leaving backend stops being a member first (affinity and Maglev let go of it).
        assert!(
            matches!(dp.log[0], Op::DeleteMember(MemberKey { backend_id: 2, .. })),
            "{:?}",
            dp.log
        );
        dp.log.remove(0);
        // slot 1 rewritten (3 moved in), frontend count 2, slot 2 deleted, backend 2 deleted.
        assert_eq!(dp.log.len(), 4, "{:?}", dp.log);
        assert!(matches!(
            dp.log[0],
            Op::PutSlot(BackendSlotKey { slot: 1, .. }, _)
        ));
        assert!(matches!(
            dp.log[1],
            Op::PutFrontend(
                _,
                Frontend {
                    backend_count: 2,
                    ..
                }
            )
        ));
        assert!(matches!(
            dp.log[2],
            Op::DeleteSlot(BackendSlotKey { slot: 2, .. })
        ));
        assert!(matches!(dp.log[3], Op::DeleteBackend(_)));
    }

    #[test]
    fn removed_service_is_deleted_frontend_first_and_vip_marker_too() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        sync(
            &mut s,
            &mut dp,
            &state(vec![(
                key("web", Protocol::Tcp),
                svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
            )]),
        )
        .unwrap();
        let before = dp.state.clone();
        let before_tables = dp.tables.clone();
        dp.log.clear();
        sync(&mut s, &mut dp, &DesiredState::default()).unwrap();
        assert_every_step_consistent(&dp.log, &before, &before_tables);
        assert_eq!(dp.state, Snapshot::default());
        assert!(
            matches!(dp.log[0], Op::DeleteFrontend(FrontendKey { proto: 6, .. })),
            "{:?}",
            dp.log
        );
        assert!(matches!(
            dp.log[1],
            Op::DeleteFrontend(FrontendKey { proto: 0, .. })
        ));
    }

    #[test]
    fn zero_endpoints_gives_a_frontend_with_count_zero() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        sync(
            &mut s,
            &mut dp,
            &state(vec![(
                key("web", Protocol::Tcp),
                svc(&["10.96.0.10:80"], &[]),
            )]),
        )
        .unwrap();
        let f = dp.state.frontends.values().find(|f| f.flags == 0).unwrap();
        assert_eq!(f.backend_count, 0);
        assert!(dp.state.slots.is_empty());
    }

    #[test]
    fn tcp_and_udp_of_one_port_are_distinct_frontends_sharing_backend_addresses() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let d = state(vec![
            (
                key("dns", Protocol::Tcp),
                svc(&["10.96.0.10:53"], &["10.0.0.1:53"]),
            ),
            (
                key("dns", Protocol::Udp),
                svc(&["10.96.0.10:53"], &["10.0.0.1:53"]),
            ),
        ]);
        sync(&mut s, &mut dp, &d).unwrap();
        // 2 frontends + 1 marker; backends differ by protocol.
        assert_eq!(dp.state.frontends.len(), 3);
        assert_eq!(dp.state.backends.len(), 2);
    }

    #[test]
    fn full_map_is_refused_whole_and_state_is_kept() {
        let mut dp = FakeDatapath::new(Capacity {
            frontends: 100,
            slots: 3,
            backends: 100,
            services: 100,
        });
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let ok = state(vec![(
            key("a", Protocol::Tcp),
            svc(&["10.96.0.1:80"], &["10.0.0.1:80", "10.0.0.2:80"]),
        )]);
        sync(&mut s, &mut dp, &ok).unwrap();
        let before = dp.state.clone();
        let too_big = state(vec![
            (
                key("a", Protocol::Tcp),
                svc(&["10.96.0.1:80"], &["10.0.0.1:80", "10.0.0.2:80"]),
            ),
            (
                key("b", Protocol::Tcp),
                svc(&["10.96.0.2:80"], &["10.0.0.3:80", "10.0.0.4:80"]),
            ),
        ]);
        let err = sync(&mut s, &mut dp, &too_big).unwrap_err();
        assert!(
            matches!(
                err,
                DatapathError::Full {
                    map: "BACKEND_SLOTS",
                    needed: 4,
                    limit: 3,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("--max-backend-slots"));
        assert_eq!(dp.state, before);
        // And the old state still syncs cleanly afterwards.
        let st = sync(&mut s, &mut dp, &ok).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0));
    }

    /// A service's and a backend's connections as readers sum them (pairs and carried keys).
    fn service_sum(dp: &FakeDatapath, sid: u32) -> u64 {
        dp.pair_stats
            .iter()
            .filter(|(k, _)| k.service_id == sid)
            .map(|(_, n)| n)
            .sum()
    }
    fn backend_sum(dp: &FakeDatapath, bid: u32) -> u64 {
        dp.pair_stats
            .iter()
            .filter(|(k, _)| k.backend_id == bid)
            .map(|(_, n)| n)
            .sum()
    }
    /// web (one endpoint, 10.0.0.1:8080) and one more TCP Service `name` with one endpoint.
    fn web_and(web: &ServicePortKey, name: &str, vip: &str, backend: &str) -> DesiredState {
        state(vec![
            (web.clone(), svc(&["10.96.0.10:80"], &["10.0.0.1:8080"])),
            (key(name, Protocol::Tcp), svc(&[vip], &[backend])),
        ])
    }
    fn pair(service_id: u32, backend_id: u32) -> MemberKey {
        MemberKey {
            service_id,
            backend_id,
        }
    }

    #[test]
    fn verification_deletes_the_counters_of_released_ids_only() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let web = key("web", Protocol::Tcp);
        let both = state(vec![
            (web.clone(), svc(&["10.96.0.10:80"], &["10.0.0.1:8080"])),
            (
                key("dns", Protocol::Udp),
                svc(&["10.96.0.11:53"], &["10.0.0.2:53"]),
            ),
        ]);
        sync(&mut s, &mut dp, &both).unwrap();
        let services: BTreeSet<u32> = dp.state.names.keys().copied().collect();
        let in_use: BTreeMap<MemberKey, u64> = dp
            .state
            .slots
            .iter()
            .map(|(k, b)| (pair(k.service_id, *b), 5))
            .collect();
        // The programs counted for every pair in use, and for ids released long ago.
        dp.service_stats = services.iter().copied().chain([9_999]).collect();
        dp.pair_stats = in_use.clone();
        dp.pair_stats.insert(pair(9_999, 8_888), 3);
        dp.pair_stats.insert(pair(9_999, 0), 3);
        dp.pair_stats.insert(pair(0, 8_888), 3);
        s.verify(&mut dp).unwrap();
        assert_eq!(dp.service_stats, services);
        assert_eq!(dp.pair_stats, in_use);
        // A Service leaves: its id's counters go at the next verification; its backend,
        // bound to nothing else, goes too.
        let web_only = state(vec![(
            web.clone(),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
        )]);
        sync(&mut s, &mut dp, &web_only).unwrap();
        s.verify(&mut dp).unwrap();
        let web_id = s.id_of(&web).unwrap();
        assert_eq!(dp.service_stats, BTreeSet::from([web_id]));
        let left: BTreeSet<u32> = dp.state.backends.keys().copied().collect();
        assert_eq!(left.len(), 1);
        let web_b1 = *left.first().unwrap();
        assert_eq!(dp.pair_stats, BTreeMap::from([(pair(web_id, web_b1), 5)]));
        // A backend leaves a Service that stays, while another Service still uses it: the
        // pair goes, its count is carried to the Service's and the backend's keys, so no
        // sum goes down; the pair of the backend that stays is untouched.
        let shared = state(vec![
            (
                web.clone(),
                svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.3:8080"]),
            ),
            (
                key("api", Protocol::Tcp),
                svc(&["10.96.0.13:80"], &["10.0.0.3:8080"]),
            ),
        ]);
        sync(&mut s, &mut dp, &shared).unwrap();
        let api_id = s.id_of(&key("api", Protocol::Tcp)).unwrap();
        let b3 = *dp.state.backends.keys().find(|id| **id != web_b1).unwrap();
        dp.pair_stats.insert(pair(web_id, b3), 7);
        dp.pair_stats.insert(pair(api_id, b3), 2);
        let web_only_b1 = web_and(&web, "api", "10.96.0.13:80", "10.0.0.3:8080");
        sync(&mut s, &mut dp, &web_only_b1).unwrap();
        s.verify(&mut dp).unwrap();
        assert_eq!(
            dp.pair_stats,
            BTreeMap::from([
                (pair(web_id, web_b1), 5),
                (pair(web_id, 0), 7),
                (pair(api_id, b3), 2),
                (pair(0, b3), 7),
            ])
        );
        assert_eq!(
            (service_sum(&dp, web_id), service_sum(&dp, api_id)),
            (12, 2)
        );
        assert_eq!((backend_sum(&dp, web_b1), backend_sum(&dp, b3)), (5, 9));
        // The second verification changes nothing; then api leaves, taking the backend with
        // it: every key naming either goes, web keeps its sum.
        s.verify(&mut dp).unwrap();
        assert_eq!(service_sum(&dp, web_id), 12);
        sync(&mut s, &mut dp, &web_only).unwrap();
        s.verify(&mut dp).unwrap();
        assert_eq!(
            dp.pair_stats,
            BTreeMap::from([(pair(web_id, web_b1), 5), (pair(web_id, 0), 7)])
        );
        // A Service leaves while its backend stays bound to another: the pair's count moves
        // to the backend's key only.
        let with_x = web_and(&web, "x", "10.96.0.14:80", "10.0.0.1:8080");
        sync(&mut s, &mut dp, &with_x).unwrap();
        let x_id = s.id_of(&key("x", Protocol::Tcp)).unwrap();
        dp.pair_stats.insert(pair(x_id, web_b1), 3);
        sync(&mut s, &mut dp, &web_only).unwrap();
        s.verify(&mut dp).unwrap();
        assert_eq!(
            dp.pair_stats,
            BTreeMap::from([
                (pair(web_id, web_b1), 5),
                (pair(web_id, 0), 7),
                (pair(0, web_b1), 3),
            ])
        );
        assert_eq!(backend_sum(&dp, web_b1), 8);
        // A full map: the key a pair's count moves to cannot be created, so the pair stays
        // and is counted once, in place; the next sweep with room moves it, once.
        sync(&mut s, &mut dp, &shared).unwrap();
        let b3 = *dp.state.backends.keys().find(|id| **id != web_b1).unwrap();
        dp.pair_stats.insert(pair(web_id, b3), 6);
        sync(&mut s, &mut dp, &web_only_b1).unwrap();
        dp.pair_stats_max = Some(
            dp.pair_stats
                .keys()
                .filter(|k| k.service_id == 0 || k.backend_id == 0)
                .count(),
        );
        s.sweep_counters(&mut dp);
        s.sweep_counters(&mut dp);
        assert_eq!(dp.pair_stats.get(&pair(web_id, b3)), Some(&6));
        assert_eq!((service_sum(&dp, web_id), backend_sum(&dp, b3)), (18, 6));
        dp.pair_stats_max = None;
        s.sweep_counters(&mut dp);
        assert_eq!(dp.pair_stats.get(&pair(web_id, b3)), None);
        assert_eq!(dp.pair_stats.get(&pair(0, b3)), Some(&6));
        assert_eq!((service_sum(&dp, web_id), backend_sum(&dp, b3)), (18, 6));
        sync(&mut s, &mut dp, &web_only).unwrap();
        s.verify(&mut dp).unwrap();
        // A restart after a removal no verification saw: the removed Service's id is the
        // next one handed out, and the sweep at start keeps it from inheriting the counts.
        let both = web_and(&web, "late", "10.96.0.12:80", "10.0.0.4:80");
        sync(&mut s, &mut dp, &both).unwrap();
        let late_id = s.id_of(&key("late", Protocol::Tcp)).unwrap();
        let late_b = *dp.state.backends.keys().find(|id| **id != web_b1).unwrap();
        dp.service_stats = [web_id, late_id].into();
        dp.pair_stats.insert(pair(late_id, late_b), 4);
        sync(&mut s, &mut dp, &web_only).unwrap();
        let restarted = ServiceReconciler::adopt(&dp).unwrap();
        restarted.sweep_counters(&mut dp);
        assert_eq!(dp.service_stats, BTreeSet::from([web_id]));
        assert_eq!(
            dp.pair_stats,
            BTreeMap::from([
                (pair(web_id, web_b1), 5),
                (pair(web_id, 0), 13),
                (pair(0, web_b1), 3),
            ])
        );
    }

    #[test]
    fn restart_adopts_ids_and_rewrites_nothing() {
        let mut dp = FakeDatapath::new(cap());
        let d = state(vec![
            (
                key("web", Protocol::Tcp),
                svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]),
            ),
            (
                key("dns", Protocol::Udp),
                svc(&["10.96.0.11:53"], &["10.0.0.1:53"]),
            ),
        ]);
        sync(&mut ServiceReconciler::adopt(&dp).unwrap(), &mut dp, &d).unwrap();
        dp.log.clear();
        let mut again = ServiceReconciler::adopt(&dp).unwrap();
        let st = sync(&mut again, &mut dp, &d).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0), "{:?}", dp.log);
        // A new service after restart gets a fresh id, not one in use.
        let mut d2 = d.clone();
        d2.services.insert(
            key("new", Protocol::Tcp),
            svc(&["10.96.0.12:80"], &["10.0.0.9:80"]),
        );
        sync(&mut again, &mut dp, &d2).unwrap();
        let ids: BTreeSet<u32> = dp.state.names.keys().copied().collect();
        assert_eq!(ids.len(), 3);
    }

    #[test]
    fn restart_removes_what_nothing_claims() {
        let mut dp = FakeDatapath::new(cap());
        let d = state(vec![(
            key("web", Protocol::Tcp),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
        )]);
        sync(&mut ServiceReconciler::adopt(&dp).unwrap(), &mut dp, &d).unwrap();
        // Garbage left by some other writer.
        dp.state.slots.insert(
            BackendSlotKey {
                service_id: 999,
                slot: 0,
            },
            12345,
        );
        dp.state.names.insert(999, "not a name".into());
        let mut again = ServiceReconciler::adopt(&dp).unwrap();
        sync(&mut again, &mut dp, &DesiredState::default()).unwrap();
        // What a key had goes with it; what nothing claims goes at the verification.
        let r = again.verify(&mut dp).unwrap();
        assert_eq!((r.writes, r.deletes), (0, 2));
        assert_eq!(dp.state, Snapshot::default());
    }

    #[test]
    fn ipv6_frontends_and_backends() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let k = ServicePortKey {
            family: Family::V6,
            ..key("web", Protocol::Tcp)
        };
        sync(
            &mut s,
            &mut dp,
            &state(vec![(k, svc(&["[fd00::10]:80"], &["[fd00:1::1]:8080"]))]),
        )
        .unwrap();
        let b = dp.state.backends.values().next().unwrap();
        assert!(!proxy_common::is_v4_mapped(&b.addr));
        assert_eq!(
            crate::datapath::addr::to_socket_addr(b.addr, b.port),
            "[fd00:1::1]:8080".parse().unwrap()
        );
    }

    /// What the maps mean: frontend (addr, proto) -> backend addresses; and no orphans.
    fn meaning(s: &Snapshot) -> BTreeMap<(SocketAddr, u8), BTreeSet<SocketAddr>> {
        use crate::datapath::addr::to_socket_addr;
        let mut m = BTreeMap::new();
        let mut used_slots = BTreeSet::new();
        let mut vips = BTreeSet::new();
        for (k, f) in &s.frontends {
            if k.proto == 0 {
                continue;
            }
            vips.insert(k.addr);
            let mut set = BTreeSet::new();
            for slot in 0..f.backend_count {
                let sk = BackendSlotKey {
                    service_id: f.service_id,
                    slot,
                };
                let b = s.backends[&s.slots[&sk]];
                set.insert(to_socket_addr(b.addr, b.port));
                used_slots.insert(sk);
            }
            m.insert((to_socket_addr(k.addr, k.port), k.proto), set);
        }
        let markers: BTreeSet<[u8; 16]> = s
            .frontends
            .keys()
            .filter(|k| k.proto == 0)
            .map(|k| k.addr)
            .collect();
        assert_eq!(markers, vips, "one VIP marker per VIP, no more");
        assert_eq!(used_slots.len(), s.slots.len(), "orphan slots");
        let used_b: BTreeSet<u32> = s.slots.values().copied().collect();
        assert_eq!(used_b.len(), s.backends.len(), "orphan backends");
        let ids: BTreeSet<u32> = s
            .frontends
            .values()
            .filter(|f| f.flags == 0)
            .map(|f| f.service_id)
            .collect();
        assert!(s.names.keys().all(|id| ids.contains(id)));
        m
    }

    fn expected(d: &DesiredState) -> BTreeMap<(SocketAddr, u8), BTreeSet<SocketAddr>> {
        let mut m = BTreeMap::new();
        for (k, svc) in &d.services {
            for fe in &svc.frontends {
                m.insert((*fe, k.protocol.number()), svc.backends.clone());
            }
        }
        m
    }

    #[test]
    fn incremental_syncs_match_the_desired_state_at_every_step() {
        // Deterministic pseudo-random sequence of desired states over a small universe, so
        // services appear, change, move VIPs, share backends and disappear.
        let mut seed: u64 = 0x9e3779b97f4a7c15;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut dp = FakeDatapath::new(Capacity {
            frontends: 1000,
            slots: 1000,
            backends: 1000,
            services: 1000,
        });
        let mut s = ServiceReconciler::adopt(&dp).unwrap();
        let mut d = DesiredState::default();
        for step in 0..500 {
            let name = format!("s{}", rnd(12));
            let proto = if rnd(2) == 0 {
                Protocol::Tcp
            } else {
                Protocol::Udp
            };
            let k = key(&name, proto);
            match rnd(4) {
                0 => {
                    d.services.remove(&k);
                }
                _ => {
                    let svc_no = name[1..].parse::<u8>().unwrap();
                    // Two VIPs per service number, ports vary: VIPs are shared between
                    // the TCP and UDP keys of one name.
                    let vip = format!("10.96.0.{}:{}", svc_no + 1, 80 + rnd(2));
                    let mut backends = BTreeSet::new();
                    for _ in 0..rnd(5) {
                        backends.insert(
                            format!("10.0.0.{}:{}", 1 + rnd(8), 8080 + rnd(2))
                                .parse()
                                .unwrap(),
                        );
                    }
                    d.services.insert(
                        k,
                        DesiredService {
                            frontends: [vip.parse().unwrap()].into(),
                            backends,
                            flags: 0,
                            ..Default::default()
                        },
                    );
                }
            }
            // The model never gives one frontend (VIP, port, protocol) to two keys; mimic it.
            let mut seen = BTreeSet::new();
            d.services
                .retain(|k, v| v.frontends.iter().all(|f| seen.insert((*f, k.protocol))));
            let before = dp.state.clone();
            let before_tables = dp.tables.clone();
            dp.log.clear();
            sync(&mut s, &mut dp, &d).unwrap_or_else(|e| panic!("step {step}: {e}"));
            assert_every_step_consistent(&dp.log, &before, &before_tables);
            assert_eq!(meaning(&dp.state), expected(&d), "step {step}");
            // A fresh full sync from the kernel state agrees and writes nothing.
            assert_eq!(s.verify(&mut dp).unwrap(), Report::default(), "step {step}");
            let mut fresh = ServiceReconciler::adopt(&dp).unwrap();
            let st = sync(&mut fresh, &mut dp, &d).unwrap();
            assert_eq!(
                (st.writes, st.deletes),
                (0, 0),
                "step {step}: incremental state differs from full"
            );
        }
    }
}
