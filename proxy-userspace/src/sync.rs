//! Diff-based, ordered sync of a [`DesiredState`] into the service maps.
//!
//! Rules:
//! - Only changed entries are written; the sync keeps a copy of what the maps hold
//!   (adopted from the pinned maps at start, then updated after every successful write).
//! - A service id is bound to one Service port x protocol x family for its lifetime; the
//!   binding is stored in `SERVICE_NAMES`, so a restarted agent adopts the same ids and
//!   rewrites nothing that did not change (established sockets keep their reverse NAT and
//!   UDP flows keep their backend).
//! - Order, so the data path never sees a half-written service: (A) remove frontends and
//!   VIP markers that are no longer wanted, then the slots and names of service ids that no
//!   longer exist; (B) write new or changed backends, names, slots, then VIP markers and
//!   frontends (the frontend carries the backend count, so it is written after its slots);
//!   (C) remove slots past the new counts, then backends nothing refers to.
//! - Before writing anything, the peak number of entries of every map during these steps is
//!   checked against its limit: a desired state that does not fit is refused whole with
//!   [`DatapathError::Full`], and the maps keep their state.
//! - Slots of a service keep their backends in place where possible: removing one backend
//!   moves at most one other slot (the last one into the hole), adding fills holes first.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::SocketAddr,
    time::{Duration, Instant},
};

use proxy_common::{
    Backend, BackendSlotKey, FRONTEND_F_EXTERNAL, FRONTEND_F_VIP_MARKER, Frontend, FrontendKey,
    MemberKey, PROTO_UDP,
};

use crate::{
    datapath::{
        Capacity, Datapath, DatapathError, Snapshot,
        addr::{ip_to_bytes, port_to_map},
    },
    model::{Algorithm, DesiredService, DesiredState, Family, Protocol, Scope, ServicePortKey},
};

/// What one sync did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncStats {
    /// Service ids (Service port x protocol x family) in the desired state.
    pub services: usize,
    /// Frontends in the desired state (without VIP markers).
    pub frontends: usize,
    /// Distinct backends in the desired state.
    pub backends: usize,
    /// Map entries created or replaced.
    pub writes: usize,
    /// Map entries removed.
    pub deletes: usize,
    /// Wall time of the sync.
    pub duration: Duration,
    /// UDP backends that left a service id in this sync: (service id, backend id, backend).
    /// Flows and connected sockets translated to them must be released
    /// ([`crate::datapath::maps::PinnedMaps::release_stale`]), as kube-proxy clears their
    /// conntrack entries.
    pub released: Vec<(u32, u32, Backend)>,
}

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

fn backend_value(addr: &SocketAddr, proto: Protocol) -> Backend {
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

/// True for a frontend whose address gets a VIP marker: cluster IPs only (see
/// `FRONTEND_F_EXTERNAL`).
fn has_marker(f: &Frontend) -> bool {
    f.flags & (FRONTEND_F_VIP_MARKER | FRONTEND_F_EXTERNAL) == 0
}

fn marker_key(addr: [u8; 16]) -> FrontendKey {
    FrontendKey {
        addr,
        port: [0; 2],
        proto: 0,
        scope: 0,
    }
}

const MARKER: Frontend = Frontend {
    service_id: 0,
    backend_count: 0,
    flags: FRONTEND_F_VIP_MARKER,
    algorithm: 0,
    _pad: [0; 3],
    affinity_timeout_s: 0,
    affinity_group: 0,
};

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

/// Refuses a plan whose peak entry counts (frontends, slots, backends, names) exceed the
/// maps' limits, or whose largest service exceeds `MAX_BACKENDS_PER_SERVICE`, naming the map,
/// the limit and the flag that raises it.
fn check_capacity(
    cap: Capacity,
    peaks: [usize; 4],
    largest_service: usize,
) -> Result<(), DatapathError> {
    let checks = [
        ("FRONTENDS", peaks[0], cap.frontends, "max-frontends"),
        ("BACKEND_SLOTS", peaks[1], cap.slots, "max-backend-slots"),
        ("BACKENDS", peaks[2], cap.backends, "max-backends"),
        ("SERVICE_NAMES", peaks[3], cap.services, "max-frontends"),
        (
            "BACKEND_SLOTS (per service)",
            largest_service,
            proxy_common::MAX_BACKENDS_PER_SERVICE,
            "max-backend-slots",
        ),
    ];
    for (map, needed, limit, flag) in checks {
        if needed > limit as usize {
            return Err(DatapathError::Full {
                map,
                needed,
                limit,
                flag,
            });
        }
    }
    Ok(())
}

/// The next id from `next`: ids are handed out in increasing order (wrapping, never 0), so a
/// freed id is not reused soon and ids allocated in one sync never collide with each other;
/// `taken` rejects ids the maps still use.
fn alloc_id(next: &mut u32, taken: impl Fn(u32) -> bool) -> u32 {
    loop {
        let id = (*next).max(1);
        *next = id.wrapping_add(1);
        if !taken(id) {
            return id;
        }
    }
}

/// One key of an incremental sync: (key, service id, old slots, new slots or `None` when the
/// key is removed, whether the id is new).
type Plan = (ServicePortKey, u32, Vec<u32>, Option<Vec<u32>>, bool);

/// The sync state: the bindings of service ids and a copy of the maps.
///
/// The first sync after [`Syncer::adopt`] (and any sync after a failed one) is a full sync
/// that compares every entry. Later syncs are incremental: only the Service ports whose
/// desired frontends or backends changed are planned and written, with reference counts
/// deciding when a backend or a VIP marker is no longer used, so the cost of one change does
/// not grow with the number of services.
#[derive(Debug, Default)]
pub struct Syncer {
    ids: BTreeMap<ServicePortKey, u32>,
    cur: Snapshot,
    backend_ids: HashMap<Backend, u32>,
    next_service_id: u32,
    next_backend_id: u32,
    /// Desired state last applied completely, per key; valid when `incremental_ok`.
    applied: BTreeMap<ServicePortKey, DesiredService>,
    /// Slots referring to each backend id (over all services).
    backend_refs: HashMap<u32, u32>,
    /// Real frontends on each VIP (a VIP marker exists while this is > 0).
    vip_refs: HashMap<[u8; 16], u32>,
    /// The maps hold exactly `applied` (set by a successful sync, cleared by a failed one).
    incremental_ok: bool,
    /// Maglev table size (0: `MAGLEV_DEFAULT`).
    maglev_size: u32,
}

/// True for algorithms that read a Maglev table.
fn is_hashing(a: Algorithm) -> bool {
    matches!(a, Algorithm::SourceHash | Algorithm::Maglev)
}

/// A backend's name for Maglev: `address:port/PROTOCOL`, the same on every node.
fn backend_name(b: &Backend) -> String {
    let addr = crate::datapath::addr::to_socket_addr(b.addr, b.port);
    let proto = if b.proto == PROTO_UDP { "UDP" } else { "TCP" };
    format!("{addr}/{proto}")
}

impl Syncer {
    /// Starts from what the maps hold now (pinned by an earlier run, or empty): service ids
    /// are re-bound by their `SERVICE_NAMES` entry; entries nothing claims are removed by the
    /// first sync.
    pub fn adopt(dp: &impl Datapath) -> Result<Self, DatapathError> {
        let cur = dp.snapshot()?;
        let mut s = Syncer::default();
        for (id, name) in &cur.names {
            if let Some(k) = parse_service_name(name) {
                s.ids.insert(k, *id);
            }
        }
        for (id, b) in &cur.backends {
            s.backend_ids.insert(*b, *id);
        }
        let max_sid = cur
            .names
            .keys()
            .chain(cur.slots.keys().map(|k| &k.service_id))
            .chain(cur.frontends.values().map(|f| &f.service_id))
            .max()
            .copied()
            .unwrap_or(0);
        s.next_service_id = max_sid.wrapping_add(1).max(1);
        s.next_backend_id = cur
            .backends
            .keys()
            .max()
            .copied()
            .unwrap_or(0)
            .wrapping_add(1)
            .max(1);
        s.cur = cur;
        Ok(s)
    }

    /// What the sync believes the maps hold.
    pub fn current(&self) -> &Snapshot {
        &self.cur
    }

    /// Number of service ids currently bound.
    pub fn bound_services(&self) -> usize {
        self.ids.len()
    }

    fn service_ids_in_use(&self) -> BTreeSet<u32> {
        let mut used: BTreeSet<u32> = self.ids.values().copied().collect();
        used.extend(self.cur.names.keys());
        used.extend(self.cur.slots.keys().map(|k| k.service_id));
        used.extend(self.cur.frontends.values().map(|f| f.service_id));
        used
    }

    /// The backend id of `b`: the one it has, one allocated earlier in this sync (`local`),
    /// or a new one (monotonic as service ids: a UDP flow remembers its backend id, so a
    /// quickly reused id could send a flow elsewhere; the data path also checks the address).
    /// The flag says whether the id is new.
    fn backend_id(&mut self, b: &Backend, local: &mut HashMap<Backend, u32>) -> (u32, bool) {
        if let Some(id) = self.backend_ids.get(b).or(local.get(b)) {
            return (*id, false);
        }
        let backends = &self.cur.backends;
        let id = alloc_id(&mut self.next_backend_id, |id| backends.contains_key(&id));
        local.insert(*b, id);
        (id, true)
    }

    /// Sets the Maglev table size of hashing services (a prime `<= MAGLEV_MAX`); tables are
    /// rewritten by the next sync of each service.
    pub fn set_maglev_size(&mut self, size: u32) {
        self.maglev_size = size;
    }

    /// Adds the memberships of `slots` that the maps lack, and writes the Maglev table of a
    /// hashing service when it differs from the one in the map. Called after the slots and
    /// backends are written and before the frontend, so a table never names a backend the
    /// data path cannot resolve.
    fn write_members_and_table(
        &mut self,
        dp: &mut impl Datapath,
        id: u32,
        slots: &[u32],
        svc: &DesiredService,
        stats: &mut SyncStats,
    ) -> Result<(), DatapathError> {
        for bid in slots.iter().collect::<BTreeSet<_>>() {
            let k = MemberKey {
                service_id: id,
                backend_id: *bid,
            };
            if !self.cur.members.contains(&k) {
                dp.put_member(&k)?;
                self.cur.members.insert(k);
                stats.writes += 1;
            }
        }
        if is_hashing(svc.algorithm) {
            let names: Vec<(u32, String)> = slots
                .iter()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .filter_map(|bid| self.cur.backends.get(bid).map(|b| (*bid, backend_name(b))))
                .collect();
            let size = if self.maglev_size == 0 {
                proxy_common::MAGLEV_DEFAULT
            } else {
                self.maglev_size
            };
            let table = crate::maglev::table(&names, size);
            let same =
                self.cur.maglev.contains(&id) && dp.get_maglev(id)?.as_deref() == Some(&table[..]);
            if !same {
                dp.put_maglev(id, &table)?;
                self.cur.maglev.insert(id);
                stats.writes += 1;
            }
        }
        Ok(())
    }

    /// Appends the UDP backends of `old` that are not in `new` to `out` (see
    /// [`SyncStats::released`]).
    fn note_released(
        &self,
        id: u32,
        old: &[u32],
        new: &BTreeSet<u32>,
        out: &mut Vec<(u32, u32, Backend)>,
    ) {
        for bid in old.iter().filter(|b| !new.contains(b)) {
            if let Some(b) = self.cur.backends.get(bid)
                && b.proto == PROTO_UDP
            {
                out.push((id, *bid, *b));
            }
        }
    }

    fn cur_slots(&self, id: u32) -> Vec<u32> {
        let mut v = Vec::new();
        for slot in 0.. {
            match self.cur.slots.get(&BackendSlotKey {
                service_id: id,
                slot,
            }) {
                Some(b) => v.push(*b),
                None => break,
            }
        }
        v
    }

    /// Makes the maps match `desired`. On error, the maps hold a consistent prefix of the
    /// ordered steps and the next call (a full sync) continues from there; on
    /// [`DatapathError::Full`] nothing was written.
    pub fn sync(
        &mut self,
        dp: &mut impl Datapath,
        desired: &DesiredState,
    ) -> Result<SyncStats, DatapathError> {
        let result = if self.incremental_ok {
            self.sync_incremental(dp, desired)
        } else {
            self.sync_full(dp, desired)
        };
        match &result {
            Ok(_) => {
                if !self.incremental_ok {
                    self.rebuild_refs();
                    self.applied = desired.services.clone();
                    self.incremental_ok = true;
                }
            }
            Err(DatapathError::Full { .. }) => {}
            Err(_) => self.incremental_ok = false,
        }
        result
    }

    fn rebuild_refs(&mut self) {
        self.backend_refs.clear();
        for bid in self.cur.slots.values() {
            *self.backend_refs.entry(*bid).or_default() += 1;
        }
        self.vip_refs.clear();
        for (k, _) in self.cur.frontends.iter().filter(|(_, f)| has_marker(f)) {
            *self.vip_refs.entry(k.addr).or_default() += 1;
        }
    }

    /// Plans and writes only the keys whose desired state changed (see the type's doc).
    fn sync_incremental(
        &mut self,
        dp: &mut impl Datapath,
        desired: &DesiredState,
    ) -> Result<SyncStats, DatapathError> {
        let start = Instant::now();
        let mut stats = SyncStats {
            services: desired.services.len(),
            frontends: 0,
            backends: 0,
            ..Default::default()
        };
        let changed: Vec<&ServicePortKey> = desired
            .services
            .iter()
            .filter(|(k, v)| self.applied.get(*k) != Some(*v))
            .map(|(k, _)| k)
            .collect();
        let removed: Vec<ServicePortKey> = self
            .applied
            .keys()
            .filter(|k| !desired.services.contains_key(*k))
            .cloned()
            .collect();
        let fe_of = |key: &ServicePortKey, svc: &DesiredService| -> Vec<FrontendKey> {
            svc.frontends
                .iter()
                .map(|a| frontend_key(a, key.protocol, key.scope))
                .collect()
        };

        // --- Plan ---------------------------------------------------------------------------
        let mut new_backends: BTreeMap<u32, Backend> = BTreeMap::new();
        let mut local_bids: HashMap<Backend, u32> = HashMap::new();
        let mut old_fe: BTreeSet<FrontendKey> = BTreeSet::new();
        let mut new_fe: BTreeMap<FrontendKey, Frontend> = BTreeMap::new();
        let mut ref_delta: HashMap<u32, i64> = HashMap::new();
        let mut local_ids: HashMap<ServicePortKey, u32> = HashMap::new();
        // (key, id, old slots, new slots); removed keys have no new slots.
        let mut plans: Vec<Plan> = Vec::new();
        for key in &removed {
            let Some(id) = self.ids.get(key).copied() else {
                continue;
            };
            old_fe.extend(fe_of(key, &self.applied[key]));
            let old = self.cur_slots(id);
            for b in &old {
                *ref_delta.entry(*b).or_default() -= 1;
            }
            self.note_released(id, &old, &BTreeSet::new(), &mut stats.released);
            plans.push((key.clone(), id, old, None, false));
        }
        for key in changed {
            let svc = &desired.services[key];
            if let Some(prev) = self.applied.get(key) {
                old_fe.extend(fe_of(key, prev));
            }
            let (id, is_new) = match self.ids.get(key) {
                Some(id) => (*id, false),
                None => {
                    // Without an O(N) scan: a bound id has a name and, with backends, slot 0.
                    let (names, slots) = (&self.cur.names, &self.cur.slots);
                    let taken = |id| {
                        names.contains_key(&id)
                            || slots.contains_key(&BackendSlotKey {
                                service_id: id,
                                slot: 0,
                            })
                    };
                    let id = alloc_id(&mut self.next_service_id, taken);
                    (id, true)
                }
            };
            local_ids.insert(key.clone(), id);
            let mut bids = Vec::new();
            for addr in &svc.backends {
                let b = backend_value(addr, key.protocol);
                let (bid, new) = self.backend_id(&b, &mut local_bids);
                if new {
                    new_backends.insert(bid, b);
                }
                bids.push((*addr, bid));
            }
            let set: BTreeSet<u32> = bids.iter().map(|(_, b)| *b).collect();
            let old = self.cur_slots(id);
            self.note_released(id, &old, &set, &mut stats.released);
            let new = plan_slots(svc, &old, &bids);
            for b in &old {
                *ref_delta.entry(*b).or_default() -= 1;
            }
            for b in &new {
                *ref_delta.entry(*b).or_default() += 1;
            }
            let gk = group_key(key);
            let group = local_ids
                .get(&gk)
                .or_else(|| self.ids.get(&gk))
                .copied()
                .unwrap_or(id);
            for k in fe_of(key, svc) {
                new_fe.insert(k, frontend_value(id, new.len(), svc, group));
            }
            plans.push((key.clone(), id, old, Some(new), is_new));
        }
        let fe_delete: Vec<FrontendKey> = old_fe
            .iter()
            .filter(|k| !new_fe.contains_key(*k) && self.cur.frontends.contains_key(*k))
            .copied()
            .collect();
        let mut vip_after: HashMap<[u8; 16], i64> = HashMap::new();
        for k in fe_delete
            .iter()
            .filter(|k| self.cur.frontends.get(*k).is_some_and(has_marker))
        {
            *vip_after
                .entry(k.addr)
                .or_insert_with(|| *self.vip_refs.get(&k.addr).unwrap_or(&0) as i64) -= 1;
        }
        for k in new_fe
            .iter()
            .filter(|(k, f)| has_marker(f) && !self.cur.frontends.contains_key(*k))
            .map(|(k, _)| k)
        {
            *vip_after
                .entry(k.addr)
                .or_insert_with(|| *self.vip_refs.get(&k.addr).unwrap_or(&0) as i64) += 1;
        }
        let marker_add: Vec<[u8; 16]> = vip_after
            .iter()
            .filter(|(a, n)| **n > 0 && !self.cur.frontends.contains_key(&marker_key(**a)))
            .map(|(a, _)| *a)
            .collect();
        let marker_del: Vec<[u8; 16]> = vip_after
            .iter()
            .filter(|(a, n)| **n <= 0 && self.cur.frontends.contains_key(&marker_key(**a)))
            .map(|(a, _)| *a)
            .collect();

        // --- Capacity (peak during the ordered steps) ----------------------------------------
        let added_fe = new_fe
            .keys()
            .filter(|k| !self.cur.frontends.contains_key(*k))
            .count();
        let peak_frontends = self.cur.frontends.len() - fe_delete.len() - marker_del.len()
            + added_fe
            + marker_add.len();
        let mut peak_slots = self.cur.slots.len();
        for (_, _, old, new, _) in &plans {
            match new {
                None => peak_slots -= old.len(),
                Some(new) => peak_slots += new.len().saturating_sub(old.len()),
            }
        }
        let peak_backends = self.cur.backends.len() + new_backends.len();
        let new_ids = plans.iter().filter(|p| p.4).count();
        let removed_ids = plans.iter().filter(|p| p.3.is_none()).count();
        let peak_names = self.cur.names.len() - removed_ids.min(self.cur.names.len()) + new_ids;
        let largest = plans
            .iter()
            .filter_map(|p| p.3.as_ref())
            .map(Vec::len)
            .max()
            .unwrap_or(0);
        check_capacity(
            dp.capacity(),
            [peak_frontends, peak_slots, peak_backends, peak_names],
            largest,
        )?;

        // --- (A) removals ---------------------------------------------------------------------
        // Memberships first: affinity and Maglev stop choosing a leaving backend before its
        // slot goes.
        for (_, id, old, new, _) in &plans {
            let keep: BTreeSet<u32> = new.iter().flatten().copied().collect();
            for bid in old.iter().collect::<BTreeSet<_>>() {
                let k = MemberKey {
                    service_id: *id,
                    backend_id: *bid,
                };
                if !keep.contains(bid) && self.cur.members.contains(&k) {
                    dp.delete_member(&k)?;
                    self.cur.members.remove(&k);
                    stats.deletes += 1;
                }
            }
        }
        for k in &fe_delete {
            dp.delete_frontend(k)?;
            self.cur.frontends.remove(k);
            stats.deletes += 1;
        }
        for a in &marker_del {
            let k = marker_key(*a);
            dp.delete_frontend(&k)?;
            self.cur.frontends.remove(&k);
            stats.deletes += 1;
        }
        for (key, id, old, new, _) in &plans {
            if new.is_some() {
                continue;
            }
            for slot in 0..old.len() as u32 {
                let k = BackendSlotKey {
                    service_id: *id,
                    slot,
                };
                dp.delete_slot(&k)?;
                self.cur.slots.remove(&k);
                stats.deletes += 1;
            }
            if self.cur.names.contains_key(id) {
                dp.delete_name(*id)?;
                self.cur.names.remove(id);
                stats.deletes += 1;
            }
            self.ids.remove(key);
            self.applied.remove(key);
        }

        // --- (B) writes -------------------------------------------------------------------------
        for (bid, b) in &new_backends {
            dp.put_backend(*bid, b)?;
            self.cur.backends.insert(*bid, *b);
            self.backend_ids.insert(*b, *bid);
            stats.writes += 1;
        }
        for (key, id, _, new, _) in &plans {
            if new.is_none() {
                continue;
            }
            let name = service_name(key);
            if self.cur.names.get(id) != Some(&name) {
                dp.put_name(*id, &name)?;
                self.cur.names.insert(*id, name);
                stats.writes += 1;
            }
            self.ids.insert(key.clone(), *id);
        }
        for (_, id, _, new, _) in &plans {
            let Some(new) = new else { continue };
            for (i, bid) in new.iter().enumerate() {
                let k = BackendSlotKey {
                    service_id: *id,
                    slot: i as u32,
                };
                if self.cur.slots.get(&k) != Some(bid) {
                    dp.put_slot(&k, *bid)?;
                    self.cur.slots.insert(k, *bid);
                    stats.writes += 1;
                }
            }
        }
        for (key, id, _, new, _) in &plans {
            let Some(new) = new else { continue };
            self.write_members_and_table(dp, *id, new, &desired.services[key], &mut stats)?;
        }
        for a in &marker_add {
            let k = marker_key(*a);
            dp.put_frontend(&k, &MARKER)?;
            self.cur.frontends.insert(k, MARKER);
            stats.writes += 1;
        }
        for (k, v) in &new_fe {
            if self.cur.frontends.get(k) != Some(v) {
                dp.put_frontend(k, v)?;
                self.cur.frontends.insert(*k, *v);
                stats.writes += 1;
            }
        }

        // --- (C) stale slots and backends --------------------------------------------------------
        for (key, id, _, new, _) in &plans {
            let hashing = new.is_some() && is_hashing(desired.services[key].algorithm);
            if !hashing && self.cur.maglev.contains(id) {
                dp.delete_maglev(*id)?;
                self.cur.maglev.remove(id);
                stats.deletes += 1;
            }
        }
        for (_, id, old, new, _) in &plans {
            let Some(new) = new else { continue };
            for slot in new.len()..old.len() {
                let k = BackendSlotKey {
                    service_id: *id,
                    slot: slot as u32,
                };
                dp.delete_slot(&k)?;
                self.cur.slots.remove(&k);
                stats.deletes += 1;
            }
        }
        for (bid, d) in &ref_delta {
            let r = self.backend_refs.entry(*bid).or_default();
            *r = (*r as i64 + d).max(0) as u32;
        }
        let unused: Vec<u32> = ref_delta
            .keys()
            .filter(|b| self.backend_refs.get(*b) == Some(&0))
            .copied()
            .collect();
        for bid in unused {
            self.backend_refs.remove(&bid);
            if let Some(b) = self.cur.backends.remove(&bid) {
                dp.delete_backend(bid)?;
                self.backend_ids.remove(&b);
                stats.deletes += 1;
            }
        }
        for (a, n) in vip_after {
            if n > 0 {
                self.vip_refs.insert(a, n as u32);
            } else {
                self.vip_refs.remove(&a);
            }
        }
        for (key, _, _, new, _) in &plans {
            if new.is_some() {
                self.applied
                    .insert(key.clone(), desired.services[key].clone());
            }
        }
        // A marker exists exactly for the addresses counted in vip_refs.
        stats.frontends = self.cur.frontends.len() - self.vip_refs.len();
        stats.backends = self.cur.backends.len();
        stats.duration = start.elapsed();
        Ok(stats)
    }

    /// Compares every entry of the maps with `desired` (first sync, after errors).
    fn sync_full(
        &mut self,
        dp: &mut impl Datapath,
        desired: &DesiredState,
    ) -> Result<SyncStats, DatapathError> {
        let start = Instant::now();
        let mut stats = SyncStats::default();

        // --- Plan -------------------------------------------------------------------------
        // Bind ids (new bindings are only kept once written, see below).
        let used = self.service_ids_in_use();
        let mut bind: BTreeMap<ServicePortKey, u32> = BTreeMap::new();
        for key in desired.services.keys() {
            let id = match self.ids.get(key) {
                Some(id) => *id,
                None => alloc_id(&mut self.next_service_id, |id| used.contains(&id)),
            };
            bind.insert(key.clone(), id);
        }
        // Backend ids.
        let mut want_backends: BTreeMap<u32, Backend> = BTreeMap::new();
        let mut local_bids: HashMap<Backend, u32> = HashMap::new();
        let mut want_slots: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let mut want_frontends: BTreeMap<FrontendKey, Frontend> = BTreeMap::new();
        let mut want_names: BTreeMap<u32, String> = BTreeMap::new();
        let mut old_lens: HashMap<u32, usize> = HashMap::new();
        for (key, svc) in &desired.services {
            let id = bind[key];
            let mut bids = Vec::new();
            for addr in &svc.backends {
                let b = backend_value(addr, key.protocol);
                let (bid, _) = self.backend_id(&b, &mut local_bids);
                want_backends.insert(bid, b);
                bids.push((*addr, bid));
            }
            let set: BTreeSet<u32> = bids.iter().map(|(_, b)| *b).collect();
            let old = self.cur_slots(id);
            old_lens.insert(id, old.len());
            self.note_released(id, &old, &set, &mut stats.released);
            let slots = plan_slots(svc, &old, &bids);
            let group = bind.get(&group_key(key)).copied().unwrap_or(id);
            for fe in &svc.frontends {
                want_frontends.insert(
                    frontend_key(fe, key.protocol, key.scope),
                    frontend_value(id, slots.len(), svc, group),
                );
                if svc.flags & FRONTEND_F_EXTERNAL == 0 {
                    want_frontends.insert(marker_key(ip_to_bytes(fe.ip())), MARKER);
                }
            }
            want_slots.insert(id, slots);
            want_names.insert(id, service_name(key));
        }
        stats.services = desired.services.len();
        stats.frontends = want_frontends
            .values()
            .filter(|f| f.flags & FRONTEND_F_VIP_MARKER == 0)
            .count();
        stats.backends = want_backends.len();

        // --- Capacity (peak during the ordered steps) ------------------------------------------
        let cap = dp.capacity();
        let peak_frontends = want_frontends.len();
        let peak_slots: usize = want_slots
            .iter()
            .map(|(id, s)| s.len().max(old_lens[id]))
            .sum();
        let peak_backends = self
            .cur
            .backends
            .keys()
            .chain(want_backends.keys())
            .collect::<BTreeSet<_>>()
            .len();
        let peak_names = want_names.len();
        let largest = want_slots.values().map(Vec::len).max().unwrap_or(0);
        check_capacity(
            cap,
            [peak_frontends, peak_slots, peak_backends, peak_names],
            largest,
        )?;

        // --- (A) removals of what is no longer wanted ------------------------------------------
        let want_members: BTreeSet<MemberKey> = want_slots
            .iter()
            .flat_map(|(id, slots)| {
                slots.iter().map(|bid| MemberKey {
                    service_id: *id,
                    backend_id: *bid,
                })
            })
            .collect();
        let stale_members: Vec<MemberKey> = self
            .cur
            .members
            .difference(&want_members)
            .copied()
            .collect();
        for k in stale_members {
            dp.delete_member(&k)?;
            self.cur.members.remove(&k);
            stats.deletes += 1;
        }
        let stale_fe: Vec<FrontendKey> = self
            .cur
            .frontends
            .keys()
            .filter(|k| !want_frontends.contains_key(k))
            .copied()
            .collect();
        // Real frontends before VIP markers: a removed VIP briefly refuses rather than leaks.
        for k in stale_fe
            .iter()
            .filter(|k| k.proto != 0)
            .chain(stale_fe.iter().filter(|k| k.proto == 0))
        {
            dp.delete_frontend(k)?;
            self.cur.frontends.remove(k);
            stats.deletes += 1;
        }
        let wanted_ids: BTreeSet<u32> = want_slots.keys().copied().collect();
        let stale_slots: Vec<BackendSlotKey> = self
            .cur
            .slots
            .keys()
            .filter(|k| !wanted_ids.contains(&k.service_id))
            .copied()
            .collect();
        for k in &stale_slots {
            if let Some(bid) = self.cur.slots.get(k)
                && let Some(b) = self.cur.backends.get(bid)
                && b.proto == PROTO_UDP
            {
                stats.released.push((k.service_id, *bid, *b));
            }
        }
        for k in stale_slots {
            dp.delete_slot(&k)?;
            self.cur.slots.remove(&k);
            stats.deletes += 1;
        }
        let stale_names: Vec<u32> = self
            .cur
            .names
            .keys()
            .filter(|id| !wanted_ids.contains(id))
            .copied()
            .collect();
        for id in stale_names {
            dp.delete_name(id)?;
            self.cur.names.remove(&id);
            stats.deletes += 1;
        }
        self.ids.retain(|_, id| wanted_ids.contains(id));

        // --- (B) writes -------------------------------------------------------------------
        for (bid, b) in &want_backends {
            if self.cur.backends.get(bid) != Some(b) {
                dp.put_backend(*bid, b)?;
                self.cur.backends.insert(*bid, *b);
                self.backend_ids.insert(*b, *bid);
                stats.writes += 1;
            }
        }
        for (key, id) in &bind {
            let name = &want_names[id];
            if self.cur.names.get(id) != Some(name) {
                dp.put_name(*id, name)?;
                self.cur.names.insert(*id, name.clone());
                stats.writes += 1;
            }
            self.ids.insert(key.clone(), *id);
        }
        for (id, slots) in &want_slots {
            for (i, bid) in slots.iter().enumerate() {
                let k = BackendSlotKey {
                    service_id: *id,
                    slot: i as u32,
                };
                if self.cur.slots.get(&k) != Some(bid) {
                    dp.put_slot(&k, *bid)?;
                    self.cur.slots.insert(k, *bid);
                    stats.writes += 1;
                }
            }
        }
        for (key, id) in &bind {
            self.write_members_and_table(
                dp,
                *id,
                &want_slots[id],
                &desired.services[key],
                &mut stats,
            )?;
        }
        // Markers first: a new VIP refuses undefined ports from its first moment.
        let (markers, real): (Vec<_>, Vec<_>) =
            want_frontends.iter().partition(|(k, _)| k.proto == 0);
        for (k, v) in markers.into_iter().chain(real) {
            if self.cur.frontends.get(k) != Some(v) {
                dp.put_frontend(k, v)?;
                self.cur.frontends.insert(*k, *v);
                stats.writes += 1;
            }
        }

        // --- (C) stale slots and backends ------------------------------------------------------
        let extra: Vec<BackendSlotKey> = self
            .cur
            .slots
            .keys()
            .filter(|k| {
                want_slots
                    .get(&k.service_id)
                    .is_some_and(|s| k.slot as usize >= s.len())
            })
            .copied()
            .collect();
        for k in extra {
            dp.delete_slot(&k)?;
            self.cur.slots.remove(&k);
            stats.deletes += 1;
        }
        let hashing_ids: BTreeSet<u32> = bind
            .iter()
            .filter(|(k, _)| is_hashing(desired.services[*k].algorithm))
            .map(|(_, id)| *id)
            .collect();
        let stale_tables: Vec<u32> = self.cur.maglev.difference(&hashing_ids).copied().collect();
        for id in stale_tables {
            dp.delete_maglev(id)?;
            self.cur.maglev.remove(&id);
            stats.deletes += 1;
        }
        let stale_b: Vec<u32> = self
            .cur
            .backends
            .keys()
            .filter(|id| !want_backends.contains_key(id))
            .copied()
            .collect();
        for id in stale_b {
            dp.delete_backend(id)?;
            if let Some(b) = self.cur.backends.remove(&id) {
                self.backend_ids.remove(&b);
            }
            stats.deletes += 1;
        }
        stats.duration = start.elapsed();
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::{
        Capacity,
        fake::{FakeDatapath, Op},
    };

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

    /// Every frontend's slots and backends resolve (what the data path needs at any time).
    fn assert_consistent(s: &Snapshot) {
        for (k, f) in &s.frontends {
            if f.flags & FRONTEND_F_VIP_MARKER != 0 {
                continue;
            }
            let marker = marker_key(k.addr);
            assert!(
                s.frontends.contains_key(&marker),
                "VIP marker missing for {k:?}"
            );
            for slot in 0..f.backend_count {
                let bid = s
                    .slots
                    .get(&BackendSlotKey {
                        service_id: f.service_id,
                        slot,
                    })
                    .expect("slot");
                assert!(s.backends.contains_key(bid), "backend {bid} missing");
            }
        }
    }

    /// Replays the op log and checks consistency after every single write.
    fn assert_every_step_consistent(log: &[Op], start: &Snapshot) {
        let mut s = start.clone();
        for op in log {
            match op {
                Op::PutFrontend(k, v) => drop(s.frontends.insert(*k, *v)),
                Op::DeleteFrontend(k) => drop(s.frontends.remove(k)),
                Op::PutSlot(k, v) => drop(s.slots.insert(*k, *v)),
                Op::DeleteSlot(k) => drop(s.slots.remove(k)),
                Op::PutBackend(k, v) => drop(s.backends.insert(*k, *v)),
                Op::DeleteBackend(k) => drop(s.backends.remove(k)),
                Op::PutName(k, v) => drop(s.names.insert(*k, v.clone())),
                Op::DeleteName(k) => drop(s.names.remove(k)),
                Op::PutMember(k) => drop(s.members.insert(*k)),
                Op::DeleteMember(k) => drop(s.members.remove(k)),
                Op::PutMaglev(id, t) => {
                    // A table only names backends the data path can resolve.
                    assert!(t.iter().all(|b| s.backends.contains_key(b)), "{t:?}");
                    s.maglev.insert(*id);
                }
                Op::DeleteMaglev(id) => drop(s.maglev.remove(id)),
            }
            for m in &s.members {
                assert!(s.backends.contains_key(&m.backend_id), "member {m:?}");
            }
            // A frontend may only point at slots that exist; slots may point past a count.
            assert_consistent(&s);
        }
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
            let mut s = Syncer::adopt(&dp).unwrap();
            let both = |udp: &[&str], tcp: &[&str]| {
                state(vec![
                    (key("dns", Protocol::Udp), svc(&["10.96.0.10:53"], udp)),
                    (key("dns", Protocol::Tcp), svc(&["10.96.0.10:53"], tcp)),
                ])
            };
            let st = s
                .sync(
                    &mut dp,
                    &both(&["10.0.0.1:53", "10.0.0.2:53"], &["10.0.0.1:53"]),
                )
                .unwrap();
            assert!(st.released.is_empty());
            if !incremental {
                s = Syncer::adopt(&dp).unwrap(); // the next sync is a full one
            }
            let udp_id = s.ids[&key("dns", Protocol::Udp)];
            let st = s.sync(&mut dp, &both(&["10.0.0.2:53"], &[])).unwrap();
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
                s = Syncer::adopt(&dp).unwrap();
            }
            let st = s
                .sync(
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
            let mut s = Syncer::adopt(&dp).unwrap();
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
                s.sync(&mut dp, &DesiredState::default()).unwrap();
            }
            let st = s.sync(&mut dp, &d).unwrap();
            assert_eq!(st.frontends, 5);
            let markers: Vec<_> = dp.state.frontends.keys().filter(|k| k.proto == 0).collect();
            assert_eq!(markers.len(), 1, "only the cluster IP: {markers:?}");
            let scopes: BTreeSet<u8> = dp.state.frontends.keys().map(|k| k.scope).collect();
            assert_eq!(
                scopes,
                BTreeSet::from([proxy_common::SCOPE_NODE, proxy_common::SCOPE_INGRESS])
            );
            // Removing everything leaves nothing behind.
            s.sync(&mut dp, &DesiredState::default()).unwrap();
            assert!(dp.state.frontends.is_empty(), "{:?}", dp.state.frontends);
        }
    }

    #[test]
    fn frontend_flags_come_from_the_desired_state() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = Syncer::adopt(&dp).unwrap();
        let mut d = svc(&["10.96.0.1:80"], &[]);
        d.flags = proxy_common::FRONTEND_F_LOCAL_ONLY;
        s.sync(
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
        s.sync(&mut dp, &state(vec![(key("web", Protocol::Tcp), d)]))
            .unwrap();
        assert_eq!(fe(&dp).flags, 0);
    }

    #[test]
    fn first_sync_writes_everything_in_order() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = Syncer::adopt(&dp).unwrap();
        let d = state(vec![(
            key("web", Protocol::Tcp),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"]),
        )]);
        let st = s.sync(&mut dp, &d).unwrap();
        assert_eq!(st.writes, 2 + 1 + 2 + 2 + 2); // backends, name, slots, members, marker + frontend
        assert_eq!(dp.state.members.len(), 2);
        assert_eq!(dp.state.frontends.len(), 2);
        assert_eq!(dp.state.slots.len(), 2);
        assert_eq!(dp.state.backends.len(), 2);
        assert_every_step_consistent(&dp.log, &Snapshot::default());
        // The frontend comes last.
        assert!(
            matches!(dp.log.last(), Some(Op::PutFrontend(k, f)) if k.proto == 6 && f.backend_count == 2)
        );
        // Keys are in network byte order.
        let fk = dp.state.frontends.keys().find(|k| k.proto == 6).unwrap();
        assert_eq!(fk.port, [0, 80]);
    }

    #[test]
    fn unchanged_state_writes_nothing() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = Syncer::adopt(&dp).unwrap();
        let d = state(vec![(
            key("web", Protocol::Tcp),
            svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
        )]);
        s.sync(&mut dp, &d).unwrap();
        dp.log.clear();
        let st = s.sync(&mut dp, &d).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0));
        assert!(dp.log.is_empty());
    }

    #[test]
    fn removing_a_backend_moves_one_slot_and_keeps_every_step_consistent() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = Syncer::adopt(&dp).unwrap();
        let k = key("web", Protocol::Tcp);
        let three = ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"];
        s.sync(
            &mut dp,
            &state(vec![(k.clone(), svc(&["10.96.0.10:80"], &three))]),
        )
        .unwrap();
        let before = dp.state.clone();
        dp.log.clear();
        s.sync(
            &mut dp,
            &state(vec![(
                k,
                svc(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.3:8080"]),
            )]),
        )
        .unwrap();
        assert_every_step_consistent(&dp.log, &before);
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
        let mut s = Syncer::adopt(&dp).unwrap();
        s.sync(
            &mut dp,
            &state(vec![(
                key("web", Protocol::Tcp),
                svc(&["10.96.0.10:80"], &["10.0.0.1:8080"]),
            )]),
        )
        .unwrap();
        let before = dp.state.clone();
        dp.log.clear();
        s.sync(&mut dp, &DesiredState::default()).unwrap();
        assert_every_step_consistent(&dp.log, &before);
        assert_eq!(dp.state, Snapshot::default());
        assert!(matches!(dp.log[0], Op::DeleteMember(_)), "{:?}", dp.log);
        assert!(matches!(
            dp.log[1],
            Op::DeleteFrontend(FrontendKey { proto: 6, .. })
        ));
        assert!(matches!(
            dp.log[2],
            Op::DeleteFrontend(FrontendKey { proto: 0, .. })
        ));
    }

    #[test]
    fn zero_endpoints_gives_a_frontend_with_count_zero() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = Syncer::adopt(&dp).unwrap();
        s.sync(
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
        let mut s = Syncer::adopt(&dp).unwrap();
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
        s.sync(&mut dp, &d).unwrap();
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
        let mut s = Syncer::adopt(&dp).unwrap();
        let ok = state(vec![(
            key("a", Protocol::Tcp),
            svc(&["10.96.0.1:80"], &["10.0.0.1:80", "10.0.0.2:80"]),
        )]);
        s.sync(&mut dp, &ok).unwrap();
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
        let err = s.sync(&mut dp, &too_big).unwrap_err();
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
        let st = s.sync(&mut dp, &ok).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0));
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
        Syncer::adopt(&dp).unwrap().sync(&mut dp, &d).unwrap();
        dp.log.clear();
        let mut again = Syncer::adopt(&dp).unwrap();
        let st = again.sync(&mut dp, &d).unwrap();
        assert_eq!((st.writes, st.deletes), (0, 0), "{:?}", dp.log);
        // A new service after restart gets a fresh id, not one in use.
        let mut d2 = d.clone();
        d2.services.insert(
            key("new", Protocol::Tcp),
            svc(&["10.96.0.12:80"], &["10.0.0.9:80"]),
        );
        again.sync(&mut dp, &d2).unwrap();
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
        Syncer::adopt(&dp).unwrap().sync(&mut dp, &d).unwrap();
        // Garbage left by some other writer.
        dp.state.slots.insert(
            BackendSlotKey {
                service_id: 999,
                slot: 0,
            },
            12345,
        );
        dp.state.names.insert(999, "not a name".into());
        let mut again = Syncer::adopt(&dp).unwrap();
        again.sync(&mut dp, &DesiredState::default()).unwrap();
        assert_eq!(dp.state, Snapshot::default());
    }

    #[test]
    fn ipv6_frontends_and_backends() {
        let mut dp = FakeDatapath::new(cap());
        let mut s = Syncer::adopt(&dp).unwrap();
        let k = ServicePortKey {
            family: Family::V6,
            ..key("web", Protocol::Tcp)
        };
        s.sync(
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
        let mut s = Syncer::adopt(&dp).unwrap();
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
            dp.log.clear();
            s.sync(&mut dp, &d)
                .unwrap_or_else(|e| panic!("step {step}: {e}"));
            assert_every_step_consistent(&dp.log, &before);
            assert_eq!(meaning(&dp.state), expected(&d), "step {step}");
            // A fresh full sync from the kernel state agrees and writes nothing.
            let mut fresh = Syncer::adopt(&dp).unwrap();
            let st = fresh.sync(&mut dp, &d).unwrap();
            assert_eq!(
                (st.writes, st.deletes),
                (0, 0),
                "step {step}: incremental state differs from full"
            );
        }
    }
}
