//! An in-memory data path: the same operations as the BPF maps (with capacities), the
//! node's interfaces, the tc programs and the health-check servers, with a log of every write
//! in order, so the whole control plane can be tested without root, and `explain` can show
//! what an agent would program where no data path is pinned.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use super::HealthCheck;
use super::{
    Capacity, DatapathError, HealthServers, Interface, Interfaces, NodeMaps, NodeSnapshot,
    Released, ServiceMaps, Snapshot, SourceRangeKey,
};
use proxy_common::{
    Backend, BackendSlot, BackendSlotKey, Frontend, FrontendKey, MemberKey,
    nat::{DsrKey, DsrTarget, IfaceAddr},
};

/// One write, as logged by [`FakeDatapath`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    PutFrontend(FrontendKey, Frontend),
    DeleteFrontend(FrontendKey),
    /// A slot by backend id (the fake keeps the id; the copy of the backend is the kernel's).
    PutSlot(BackendSlotKey, u32),
    DeleteSlot(BackendSlotKey),
    PutBackend(u32, Backend),
    DeleteBackend(u32),
    PutName(u32, String),
    DeleteName(u32),
    PutMember(MemberKey, u32),
    DeleteMember(MemberKey),
    PutMaglev(u32, Vec<u32>),
    DeleteMaglev(u32),
    Release(Vec<(u32, u32, Backend)>),
    PutLocalEndpoint([u8; 16]),
    DeleteLocalEndpoint([u8; 16]),
    PutSourceRange(SourceRangeKey, u32),
    DeleteSourceRange(SourceRangeKey),
    PutIfaceAddr(u32, IfaceAddr),
    DeleteIfaceAddr(u32),
    PutDsr(DsrKey, DsrTarget),
    DeleteDsr(DsrKey),
    Attach(String),
    Detach(String),
    ServeHealth(u16, HealthCheck),
    UpdateHealth(u16, HealthCheck),
    StopHealth(u16),
}

/// Maps, interfaces and servers in memory. Writes beyond the capacity fail like a full BPF
/// hash map (E2BIG).
#[derive(Debug)]
pub struct FakeDatapath {
    /// Current contents of the service maps.
    pub(crate) state: Snapshot,
    /// Current contents of the north-south maps.
    pub(crate) node: NodeSnapshot,
    /// Limits.
    pub(crate) cap: Capacity,
    /// Every successful write, in order.
    pub(crate) log: Vec<Op>,
    /// Maglev tables by service id (their ids are in `state.maglev`).
    pub(crate) tables: BTreeMap<u32, Vec<u32>>,
    /// The interfaces of the (pretend) network namespace.
    pub interfaces: BTreeMap<String, Interface>,
    /// Routes: (network, prefix length, device), longest prefix wins.
    pub routes: Vec<(IpAddr, u8, String)>,
    /// Interfaces with the programs attached.
    pub(crate) attached: BTreeSet<String>,
    /// Interfaces whose attach fails (as `--xdp native` on a driver without native XDP).
    pub(crate) refuse_attach: BTreeSet<String>,
    /// Health-check servers running.
    pub(crate) health: BTreeMap<u16, HealthCheck>,
    /// Ports a server cannot bind (in use by another process).
    pub busy_ports: BTreeSet<u16>,
    /// Calls of the least-connections collection.
    pub(crate) collections: usize,
    /// When set, the service-map write after this many more succeeds fails (EIO), once.
    pub(crate) fail_after: Option<usize>,
    /// Batch as the kernel data path does: between [`ServiceMaps::begin_bulk`] and
    /// [`ServiceMaps::end_bulk`], puts are buffered and written (and logged) in its order.
    /// Off: every put is written at once.
    pub(crate) batching: bool,
    /// Ids with per-service counters (`SERVICE_STATS` keys; the programs create them).
    pub(crate) service_stats: BTreeSet<u32>,
    /// Connection counters: pairs (`BACKEND_STATS`) and carried keys, the ones with an id
    /// 0 (`STATS_CARRIED`), in one map: (service id, backend id) -> count.
    pub(crate) pair_stats: BTreeMap<MemberKey, u64>,
    /// Most carried keys `STATS_CARRIED` takes (`None`: no limit); one beyond is refused as
    /// full.
    pub(crate) pair_stats_max: Option<usize>,
    bulk: Option<Vec<Op>>,
}

impl FakeDatapath {
    /// Empty maps with the given limits, no interfaces.
    pub fn new(cap: Capacity) -> Self {
        Self {
            state: Snapshot::default(),
            node: NodeSnapshot::default(),
            cap,
            log: Vec::new(),
            tables: Default::default(),
            interfaces: BTreeMap::new(),
            routes: Vec::new(),
            attached: BTreeSet::new(),
            refuse_attach: BTreeSet::new(),
            health: BTreeMap::new(),
            busy_ports: BTreeSet::new(),
            collections: 0,
            fail_after: None,
            batching: false,
            service_stats: BTreeSet::new(),
            pair_stats: BTreeMap::new(),
            pair_stats_max: None,
            bulk: None,
        }
    }

    /// Buffers a put during a bulk write; false when it is to be written now.
    fn buffered(&mut self, op: impl FnOnce() -> Op) -> bool {
        match &mut self.bulk {
            Some(b) => {
                b.push(op());
                true
            }
            None => false,
        }
    }

    /// Writes the buffered puts in the kernel data path's order (backends, memberships,
    /// slots, names, frontends; each map's in the order made).
    fn flush(&mut self) -> Result<(), DatapathError> {
        let Some(mut ops) = self.bulk.as_mut().map(std::mem::take) else {
            return Ok(());
        };
        let rank = |op: &Op| match op {
            Op::PutBackend(..) => 0,
            Op::PutMember(..) => 1,
            Op::PutSlot(..) => 2,
            Op::PutName(..) => 3,
            _ => 4,
        };
        ops.sort_by_key(rank);
        let bulk = self.bulk.take();
        let mut r = Ok(());
        for op in ops {
            r = match op {
                Op::PutBackend(id, v) => self.put_backend(id, &v),
                Op::PutMember(k, w) => self.put_member(&k, w),
                Op::PutSlot(k, b) => self.put_slot(
                    &k,
                    &BackendSlot {
                        backend_id: b,
                        ..Default::default()
                    },
                ),
                Op::PutName(id, n) => self.put_name(id, &n),
                Op::PutFrontend(k, v) => self.put_frontend(&k, &v),
                other => unreachable!("only puts are buffered: {other:?}"),
            };
            if r.is_err() {
                break;
            }
        }
        self.bulk = bulk;
        r
    }

    /// Counts down [`FakeDatapath::fail_after`]; an error when it reaches zero.
    fn injected(&mut self, map: &'static str) -> Result<(), DatapathError> {
        match self.fail_after {
            Some(0) => {
                self.fail_after = None;
                Err(DatapathError::Map {
                    op: "update",
                    map,
                    error: std::io::Error::from_raw_os_error(libc::EIO),
                })
            }
            Some(n) => {
                self.fail_after = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl super::FlowCollection for FakeDatapath {
    fn collect_lc_flows(&mut self) -> anyhow::Result<usize> {
        self.collections += 1;
        Ok(0)
    }
}

fn full(map: &'static str) -> DatapathError {
    DatapathError::Map {
        op: "update",
        map,
        error: std::io::Error::from_raw_os_error(libc::E2BIG),
    }
}

/// [`FakeDatapath::pair_stats`] for [`super::apply_pair_sweep`].
struct FakePairs<'a> {
    map: &'a mut BTreeMap<MemberKey, u64>,
    max: Option<usize>,
}

impl super::PairCounters for FakePairs<'_> {
    fn ensure(&mut self, k: &MemberKey) -> Result<(), DatapathError> {
        if !self.map.contains_key(k) {
            let carried = self
                .map
                .keys()
                .filter(|k| k.service_id == 0 || k.backend_id == 0)
                .count();
            if self.max.is_some_and(|m| carried >= m) {
                return Err(full("STATS_CARRIED"));
            }
            self.map.insert(*k, 0);
        }
        Ok(())
    }
    fn take(&mut self, k: &MemberKey) -> Result<Option<u64>, DatapathError> {
        Ok(self.map.remove(k))
    }
    fn add(&mut self, k: &MemberKey, n: u64) -> Result<(), DatapathError> {
        *self.map.get_mut(k).expect("ensured") += n;
        Ok(())
    }
    fn delete(&mut self, k: &MemberKey) -> Result<(), DatapathError> {
        self.map.remove(k);
        Ok(())
    }
}

impl ServiceMaps for FakeDatapath {
    fn sweep_stats(&mut self, bound: &super::Bound<'_>) -> Result<usize, DatapathError> {
        let before = self.service_stats.len();
        self.service_stats.retain(|id| (bound.service)(*id));
        let plan = super::plan_pair_sweep(self.pair_stats.keys().copied(), bound);
        let mut pairs = FakePairs {
            map: &mut self.pair_stats,
            max: self.pair_stats_max,
        };
        Ok(before - self.service_stats.len() + super::apply_pair_sweep(&plan, &mut pairs)?)
    }
    fn capacity(&self) -> Capacity {
        self.cap
    }
    fn snapshot(&self) -> Result<Snapshot, DatapathError> {
        Ok(self.state.clone())
    }
    fn begin_bulk(&mut self) {
        if self.batching {
            self.bulk.get_or_insert_with(Vec::new);
        }
    }
    fn end_bulk(&mut self) -> Result<(), DatapathError> {
        let r = self.flush();
        self.bulk = None;
        r
    }
    fn put_frontend(&mut self, key: &FrontendKey, value: &Frontend) -> Result<(), DatapathError> {
        if self.buffered(|| Op::PutFrontend(*key, *value)) {
            return Ok(());
        }
        self.injected("FRONTENDS")?;
        let m = &mut self.state.frontends;
        if !m.contains_key(key) && m.len() >= self.cap.frontends as usize {
            return Err(full("FRONTENDS"));
        }
        m.insert(*key, *value);
        self.log.push(Op::PutFrontend(*key, *value));
        Ok(())
    }
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), DatapathError> {
        self.flush()?;
        self.state.frontends.remove(key);
        self.log.push(Op::DeleteFrontend(*key));
        Ok(())
    }
    fn put_slot(&mut self, key: &BackendSlotKey, value: &BackendSlot) -> Result<(), DatapathError> {
        let backend_id = value.backend_id;
        if self.buffered(|| Op::PutSlot(*key, backend_id)) {
            return Ok(());
        }
        self.injected("BACKEND_SLOTS")?;
        let m = &mut self.state.slots;
        if !m.contains_key(key) && m.len() >= self.cap.slots as usize {
            return Err(full("BACKEND_SLOTS"));
        }
        m.insert(*key, backend_id);
        self.state.stale_slots.remove(key);
        self.log.push(Op::PutSlot(*key, backend_id));
        Ok(())
    }
    fn delete_slot(&mut self, key: &BackendSlotKey) -> Result<(), DatapathError> {
        self.flush()?;
        self.state.slots.remove(key);
        self.state.stale_slots.remove(key);
        self.log.push(Op::DeleteSlot(*key));
        Ok(())
    }
    fn put_backend(&mut self, id: u32, value: &Backend) -> Result<(), DatapathError> {
        if self.buffered(|| Op::PutBackend(id, *value)) {
            return Ok(());
        }
        self.injected("BACKENDS")?;
        let m = &mut self.state.backends;
        if !m.contains_key(&id) && m.len() >= self.cap.backends as usize {
            return Err(full("BACKENDS"));
        }
        m.insert(id, *value);
        self.log.push(Op::PutBackend(id, *value));
        Ok(())
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), DatapathError> {
        self.flush()?;
        self.state.backends.remove(&id);
        self.log.push(Op::DeleteBackend(id));
        Ok(())
    }
    fn put_name(&mut self, service_id: u32, name: &str) -> Result<(), DatapathError> {
        if self.buffered(|| Op::PutName(service_id, name.to_string())) {
            return Ok(());
        }
        self.injected("SERVICE_NAMES")?;
        let m = &mut self.state.names;
        if !m.contains_key(&service_id) && m.len() >= self.cap.services as usize {
            return Err(full("SERVICE_NAMES"));
        }
        m.insert(service_id, name.to_string());
        self.log.push(Op::PutName(service_id, name.to_string()));
        Ok(())
    }
    fn delete_name(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.flush()?;
        self.state.names.remove(&service_id);
        self.log.push(Op::DeleteName(service_id));
        Ok(())
    }
    fn put_member(&mut self, key: &MemberKey, weight: u32) -> Result<(), DatapathError> {
        if self.buffered(|| Op::PutMember(*key, weight)) {
            return Ok(());
        }
        self.injected("MEMBERS")?;
        let m = &mut self.state.members;
        if !m.contains_key(key) && m.len() >= self.cap.slots as usize {
            return Err(full("MEMBERS"));
        }
        m.insert(*key, weight);
        self.log.push(Op::PutMember(*key, weight));
        Ok(())
    }
    fn delete_member(&mut self, key: &MemberKey) -> Result<(), DatapathError> {
        self.flush()?;
        self.state.members.remove(key);
        self.log.push(Op::DeleteMember(*key));
        Ok(())
    }
    fn get_maglev(&self, service_id: u32) -> Result<Option<Vec<u32>>, DatapathError> {
        Ok(self.tables.get(&service_id).cloned())
    }
    fn put_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<(), DatapathError> {
        self.flush()?;
        self.tables.insert(service_id, table.to_vec());
        self.state.maglev.insert(service_id);
        self.log.push(Op::PutMaglev(service_id, table.to_vec()));
        Ok(())
    }
    fn delete_maglev(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.flush()?;
        self.tables.remove(&service_id);
        self.state.maglev.remove(&service_id);
        self.log.push(Op::DeleteMaglev(service_id));
        Ok(())
    }
    fn release_stale(
        &mut self,
        released: &[(u32, u32, Backend)],
    ) -> Result<Released, DatapathError> {
        self.flush()?;
        self.log.push(Op::Release(released.to_vec()));
        Ok(Released::default())
    }
}

impl NodeMaps for FakeDatapath {
    fn node_snapshot(&self) -> Result<NodeSnapshot, DatapathError> {
        Ok(self.node.clone())
    }
    fn put_local_endpoint(&mut self, addr: &[u8; 16]) -> Result<(), DatapathError> {
        self.node.local_endpoints.insert(*addr);
        self.log.push(Op::PutLocalEndpoint(*addr));
        Ok(())
    }
    fn delete_local_endpoint(&mut self, addr: &[u8; 16]) -> Result<(), DatapathError> {
        self.node.local_endpoints.remove(addr);
        self.log.push(Op::DeleteLocalEndpoint(*addr));
        Ok(())
    }
    fn put_source_range(&mut self, key: &SourceRangeKey, value: u32) -> Result<(), DatapathError> {
        self.node.source_ranges.insert(*key, value);
        self.log.push(Op::PutSourceRange(*key, value));
        Ok(())
    }
    fn delete_source_range(&mut self, key: &SourceRangeKey) -> Result<(), DatapathError> {
        self.node.source_ranges.remove(key);
        self.log.push(Op::DeleteSourceRange(*key));
        Ok(())
    }
    fn put_iface_addr(&mut self, ifindex: u32, value: &IfaceAddr) -> Result<(), DatapathError> {
        self.node.iface_addrs.insert(ifindex, *value);
        self.log.push(Op::PutIfaceAddr(ifindex, *value));
        Ok(())
    }
    fn delete_iface_addr(&mut self, ifindex: u32) -> Result<(), DatapathError> {
        self.node.iface_addrs.remove(&ifindex);
        self.log.push(Op::DeleteIfaceAddr(ifindex));
        Ok(())
    }
    fn put_dsr(&mut self, key: &DsrKey, value: &DsrTarget) -> Result<(), DatapathError> {
        self.node.dsr.insert(*key, *value);
        self.log.push(Op::PutDsr(*key, *value));
        Ok(())
    }
    fn delete_dsr(&mut self, key: &DsrKey) -> Result<(), DatapathError> {
        self.node.dsr.remove(key);
        self.log.push(Op::DeleteDsr(*key));
        Ok(())
    }
}

impl Interfaces for FakeDatapath {
    fn interfaces(&self) -> anyhow::Result<BTreeMap<String, Interface>> {
        Ok(self.interfaces.clone())
    }
    fn route_device(&self, ip: &IpAddr) -> Option<String> {
        self.routes
            .iter()
            .filter(|(net, len, _)| {
                *len > 0
                    && ipnet::IpNet::new(*net, *len)
                        .map(|n| n.contains(ip))
                        .unwrap_or(false)
            })
            .max_by_key(|(_, len, _)| *len)
            .map(|(_, _, dev)| dev.clone())
    }
    fn attached(&self) -> BTreeSet<String> {
        self.attached.clone()
    }
    fn attach(
        &mut self,
        name: &str,
        _external: bool,
    ) -> anyhow::Result<Option<super::tc::XdpMode>> {
        anyhow::ensure!(self.interfaces.contains_key(name), "no interface {name}");
        anyhow::ensure!(
            !self.refuse_attach.contains(name),
            "{name}: cannot attach XDP in native mode"
        );
        self.attached.insert(name.to_string());
        self.log.push(Op::Attach(name.to_string()));
        Ok(None)
    }
    fn detach(&mut self, name: &str) -> anyhow::Result<()> {
        self.attached.remove(name);
        self.log.push(Op::Detach(name.to_string()));
        Ok(())
    }
}

impl HealthServers for FakeDatapath {
    fn serve_health(&mut self, port: u16, check: &HealthCheck) -> std::io::Result<()> {
        if self.busy_ports.contains(&port) {
            return Err(std::io::Error::from(std::io::ErrorKind::AddrInUse));
        }
        self.health.insert(port, check.clone());
        self.log.push(Op::ServeHealth(port, check.clone()));
        Ok(())
    }
    fn update_health(&mut self, port: u16, check: &HealthCheck) {
        self.health.insert(port, check.clone());
        self.log.push(Op::UpdateHealth(port, check.clone()));
    }
    fn stop_health(&mut self, port: u16) {
        self.health.remove(&port);
        self.log.push(Op::StopHealth(port));
    }
}

/// When a [`consistency_violations`] check is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Moment {
    /// Between any two map writes: what the data path needs to translate every connection
    /// it can see at that instant (the reconciler's write order guarantees it).
    #[cfg(any(test, doc))]
    AnyWrite,
    /// After a reconciler call returned: additionally nothing is left over.
    AtRest,
}

/// Checks the service maps the way the data path reads them and returns every rule broken
/// (empty when consistent). `tables` holds the Maglev tables by service id
/// ([`FakeDatapath::tables`]).
///
/// At any write ([`Moment::AnyWrite`]):
/// - every frontend other than a VIP marker has a `SERVICE_NAMES` entry for its service id
///   (a restarted agent adopts its ids from there), slots `0..backend_count` of its service
///   id, and each of those slots names an existing backend (the socket programs pick a slot
///   below the count and read its backend);
/// - every cluster-IP frontend (neither a marker nor external) has the VIP marker of its
///   address (so undefined ports of a VIP are refused, never leaked);
/// - every `MEMBERS` entry and every nonzero entry of a Maglev table names an existing
///   backend (0 is no backend: the table of a Service without endpoints is all zeros), and
///   every `MEMBERS` weight is in 1..=100 (the data path skips a member of weight 0).
///
/// At rest ([`Moment::AtRest`]) also:
/// - a VIP marker exists only for an address that has a cluster-IP frontend;
/// - every slot belongs to a frontend's service id and lies below its backend count;
/// - every backend is named by a slot;
/// - every Maglev table and every membership belongs to a service id that has a frontend;
/// - every backend in the slots of a frontend that reads `MEMBERS` (ClientIP affinity, the
///   table and weighted least-load algorithms) is a member.
///
/// The sync unit tests and the `model` fuzz target use this one definition.
pub(crate) fn consistency_violations(
    s: &Snapshot,
    tables: &BTreeMap<u32, Vec<u32>>,
    moment: Moment,
) -> Vec<String> {
    let mut out = Vec::new();
    let (counts, marked) = frontend_violations(s, &mut out);
    reference_violations(s, tables, &mut out);
    if moment == Moment::AtRest {
        leftover_violations(s, tables, &counts, &marked, &mut out);
        membership_violations(s, &mut out);
    }
    out
}

/// The rules of every non-marker frontend at any write (its name, its VIP marker, its slots
/// and their backends) into `out`; returns the backend count by service id and the
/// addresses that have a cluster-IP frontend.
fn frontend_violations(
    s: &Snapshot,
    out: &mut Vec<String>,
) -> (BTreeMap<u32, u32>, BTreeSet<[u8; 16]>) {
    use super::vip::{has_marker, marker_key};
    use proxy_common::FRONTEND_F_VIP_MARKER;

    // Backend count by service id, over the non-marker frontends.
    let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
    let mut marked: BTreeSet<[u8; 16]> = BTreeSet::new();
    for (k, f) in &s.frontends {
        if f.flags & FRONTEND_F_VIP_MARKER != 0 {
            continue;
        }
        let count = counts.entry(f.service_id).or_insert(f.backend_count);
        if *count != f.backend_count {
            out.push(format!(
                "frontend {k:?}: backend count {} differs from {} of another frontend of \
                 service id {}",
                f.backend_count, count, f.service_id
            ));
        }
        if !s.names.contains_key(&f.service_id) {
            out.push(format!(
                "frontend {k:?}: service id {} has no name",
                f.service_id
            ));
        }
        if has_marker(f) {
            marked.insert(k.addr);
            if !s.frontends.contains_key(&marker_key(k.addr)) {
                out.push(format!("frontend {k:?}: VIP marker missing"));
            }
        }
        for slot in 0..f.backend_count {
            let key = BackendSlotKey {
                service_id: f.service_id,
                slot,
            };
            match s.slots.get(&key) {
                None => out.push(format!("frontend {k:?}: slot {slot} missing")),
                Some(b) if !s.backends.contains_key(b) => out.push(format!(
                    "frontend {k:?}: slot {slot} names missing backend {b}"
                )),
                Some(_) => {}
            }
        }
    }
    (counts, marked)
}

/// The memberships' and the Maglev tables' backends and weights, at any write, into `out`.
fn reference_violations(s: &Snapshot, tables: &BTreeMap<u32, Vec<u32>>, out: &mut Vec<String>) {
    for (m, w) in &s.members {
        if !s.backends.contains_key(&m.backend_id) {
            out.push(format!("member {m:?} names a missing backend"));
        }
        if !(1..=super::MAX_WEIGHT).contains(w) {
            out.push(format!("member {m:?} has weight {w}, not 1-100"));
        }
    }
    for (id, table) in tables {
        if let Some(b) = table
            .iter()
            .find(|b| **b != 0 && !s.backends.contains_key(b))
        {
            out.push(format!(
                "Maglev table of service id {id} names missing backend {b}"
            ));
        }
    }
}

/// At rest: markers, slots, backends, tables and memberships that nothing claims, into
/// `out`; `counts` and `marked` as [`frontend_violations`] returns them.
fn leftover_violations(
    s: &Snapshot,
    tables: &BTreeMap<u32, Vec<u32>>,
    counts: &BTreeMap<u32, u32>,
    marked: &BTreeSet<[u8; 16]>,
    out: &mut Vec<String>,
) {
    use proxy_common::FRONTEND_F_VIP_MARKER;

    for (k, f) in &s.frontends {
        if f.flags & FRONTEND_F_VIP_MARKER != 0 && !marked.contains(&k.addr) {
            out.push(format!("VIP marker {k:?} without a cluster-IP frontend"));
        }
    }
    for k in s.slots.keys() {
        if counts.get(&k.service_id).is_none_or(|c| k.slot >= *c) {
            out.push(format!("orphan slot {k:?}"));
        }
    }
    let named: BTreeSet<u32> = s.slots.values().copied().collect();
    for id in s.backends.keys() {
        if !named.contains(id) {
            out.push(format!("orphan backend {id}"));
        }
    }
    for id in tables.keys() {
        if !counts.contains_key(id) {
            out.push(format!("orphan Maglev table of service id {id}"));
        }
    }
    for m in s.members.keys() {
        if !counts.contains_key(&m.service_id) {
            out.push(format!("orphan member {m:?}"));
        }
    }
}

/// At rest: frontends that read memberships have every backend of their slots as a member
/// (the least-load scan skips a backend without a weight, the hashes one without a
/// membership), into `out`.
fn membership_violations(s: &Snapshot, out: &mut Vec<String>) {
    use proxy_common::FRONTEND_F_VIP_MARKER;

    for (k, f) in &s.frontends {
        let reads = f.affinity_timeout_s != 0
            || proxy_common::Algorithm::from_u8(f.algorithm).is_some_and(|a| a.reads_members());
        if f.flags & FRONTEND_F_VIP_MARKER != 0 || !reads {
            continue;
        }
        for slot in 0..f.backend_count {
            let key = BackendSlotKey {
                service_id: f.service_id,
                slot,
            };
            if let Some(b) = s.slots.get(&key) {
                let m = MemberKey {
                    service_id: f.service_id,
                    backend_id: *b,
                };
                if !s.members.contains_key(&m) {
                    out.push(format!(
                        "frontend {k:?}: backend {b} of slot {slot} is not a member"
                    ));
                }
            }
        }
    }
}

impl FakeDatapath {
    /// Every rule of the service maps that the current maps break at rest (empty when
    /// consistent): the crate's one consistency check, `consistency_violations`, at
    /// `Moment::AtRest`.
    pub fn consistency_violations(&self) -> Vec<String> {
        consistency_violations(&self.state, &self.tables, Moment::AtRest)
    }
}
