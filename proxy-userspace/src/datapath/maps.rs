//! [`ServiceMaps`] on the pinned BPF maps (`<bpffs>/<pin-dir>/<MAP>`), opened by path so the
//! agent and the inspection commands (which work while the agent is down) share one code path.

use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap, Map, MapData, MapError, MapInfo, PerCpuArray};
use proxy_common::{
    BACKEND_SLOTS, BACKEND_STATS, BACKENDS, Backend, BackendSlot, BackendSlotKey, CONFIG, COUNTERS,
    Config, FRONTENDS, Frontend, FrontendKey, MAGLEV, MAGLEV_MAX, MEMBERS, MaglevTable, MemberKey,
    PROTO_UDP, REVNAT_F_CONNECTED, REVNAT_SK, RevNatKey, RevNatValue, SERVICE_NAMES, SERVICE_STATS,
    SOCK_NAT, SOCK_NAT_BUSY, SOCK_NAT_OVERFLOW, STALE_SOCKETS, STATS_CARRIED, ServiceName,
    ServiceStats, SockNat, UDP_FLOWS, UdpFlow, UdpFlowKey,
};

use super::{Capacity, DatapathError, Released, ServiceMaps, Snapshot, decode_name, encode_name};

mod packet_slots;

/// The service maps of one pin directory.
pub struct PinnedMaps {
    dir: PathBuf,
    frontends: HashMap<MapData, FrontendKey, Frontend>,
    slots: HashMap<MapData, BackendSlotKey, BackendSlot>,
    backends: HashMap<MapData, u32, Backend>,
    names: HashMap<MapData, u32, ServiceName>,
    members: HashMap<MapData, MemberKey, u32>,
    maglev: HashMap<MapData, u32, MaglevTable>,
    cap: Capacity,
    /// The same maps again, for batched reads ([`super::batch`]; aya's map types do not
    /// lend their descriptors).
    raw: RawMaps,
    /// Puts waiting for [`ServiceMaps::end_bulk`] while a bulk write runs.
    bulk: Option<Bulk>,
    /// The cgroup the socket programs are attached to, where the egress program goes while
    /// some connected UDP socket is stale (`None`: never attached from here, as in the
    /// inspection commands).
    cgroup: Option<PathBuf>,
}

fn map_err(op: &'static str, map: &'static str, e: MapError) -> DatapathError {
    let source = match e {
        MapError::SyscallError(s) => s.io_error,
        other => std::io::Error::other(other.to_string()),
    };
    DatapathError::Map {
        op,
        map,
        error: source,
    }
}

fn open_map(dir: &Path, name: &'static str) -> Result<(Map, u32), DatapathError> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).map_err(|e| map_err("open pinned", name, e))?;
    let info = MapInfo::from_pin(&path).map_err(|e| map_err("info", name, e))?;
    let map = Map::from_map_data(data).map_err(|e| map_err("open pinned", name, e))?;
    Ok((map, info.max_entries()))
}

/// Descriptors of the service maps for [`super::batch`].
struct RawMaps {
    frontends: MapData,
    slots: MapData,
    backends: MapData,
    names: MapData,
    members: MapData,
}

/// Puts buffered by a bulk write, per map, in the order they were made.
#[derive(Default)]
struct Bulk {
    backends: (Vec<u32>, Vec<Backend>),
    members: (Vec<MemberKey>, Vec<u32>),
    slots: (Vec<BackendSlotKey>, Vec<BackendSlot>),
    names: (Vec<u32>, Vec<ServiceName>),
    frontends: (Vec<FrontendKey>, Vec<Frontend>),
}

/// Writes one map's buffered puts with [`super::batch::write_all`].
/// Batches at least this long are written by several threads (see [`write_batch`]).
const PARALLEL_BATCH: usize = 16_384;

/// Writes `keys` and `values` into `map` in batches. A long list (a first sync) is split
/// over up to one thread per CPU (at most 4): the kernel's hash-map inserts, about 1 µs
/// each, are most of a first sync at tens of thousands of Services, and concurrent inserts
/// lock only their own buckets. Returns once every part is written, so the order between
/// maps ([`PinnedMaps::flush`]) holds. Errors: a failed part's, with how many of that part
/// were written.
fn write_batch<K: aya::Pod + Sync, V: aya::Pod + Sync>(
    map: &MapData,
    name: &'static str,
    (keys, values): &(Vec<K>, Vec<V>),
) -> Result<(), DatapathError> {
    let err = |part: usize, (done, e): (usize, std::io::Error)| DatapathError::Map {
        op: "update",
        map: name,
        error: std::io::Error::new(
            e.kind(),
            format!(
                "{e} (batch of {}, part of {part}: {done} written)",
                keys.len()
            ),
        ),
    };
    if keys.is_empty() {
        return Ok(());
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4);
    if keys.len() < PARALLEL_BATCH || threads == 1 {
        return super::batch::write_all(map.fd(), keys, values).map_err(|e| err(keys.len(), e));
    }
    let part = keys.len().div_ceil(threads);
    let fd = map.fd();
    std::thread::scope(|s| {
        let parts: Vec<_> = keys
            .chunks(part)
            .zip(values.chunks(part))
            .map(|(k, v)| {
                s.spawn(move || super::batch::write_all(fd, k, v).map_err(|e| (k.len(), e)))
            })
            .collect();
        parts
            .into_iter()
            .map(|h| h.join().expect("batch writer thread"))
            .collect::<Result<Vec<()>, _>>()
            .map(|_| ())
            .map_err(|(n, e)| err(n, e))
    })
}

fn raw(dir: &Path, name: &'static str) -> Result<MapData, DatapathError> {
    MapData::from_pin(dir.join(name)).map_err(|e| map_err("open pinned", name, e))
}

fn batch_err(op: &'static str, map: &'static str, error: std::io::Error) -> DatapathError {
    DatapathError::Map { op, map, error }
}

fn hash<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &'static str,
) -> Result<(HashMap<MapData, K, V>, u32), DatapathError> {
    let (map, max) = open_map(dir, name)?;
    let m = HashMap::try_from(map).map_err(|e| map_err("open", name, e))?;
    Ok((m, max))
}

impl PinnedMaps {
    /// Opens the maps pinned under `dir` (e.g. `/sys/fs/bpf/ebpf-proxy`).
    ///
    /// Errors: a map is missing (the agent never ran, or `cleanup` removed it) or has
    /// another layout than this build expects.
    pub fn open(dir: &Path) -> Result<Self, DatapathError> {
        let (frontends, f) = hash(dir, FRONTENDS)?;
        let (slots, s) = hash(dir, BACKEND_SLOTS)?;
        let (backends, b) = hash(dir, BACKENDS)?;
        let (names, n) = hash(dir, SERVICE_NAMES)?;
        let (members, _) = hash(dir, MEMBERS)?;
        let (maglev, _) = hash(dir, MAGLEV)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            frontends,
            slots,
            backends,
            names,
            members,
            maglev,
            cap: Capacity {
                frontends: f,
                slots: s,
                backends: b,
                services: n,
            },
            raw: RawMaps {
                frontends: raw(dir, FRONTENDS)?,
                slots: raw(dir, BACKEND_SLOTS)?,
                backends: raw(dir, BACKENDS)?,
                names: raw(dir, SERVICE_NAMES)?,
                members: raw(dir, MEMBERS)?,
            },
            bulk: None,
            cgroup: None,
        })
    }

    /// Lets [`PinnedMaps::release_stale_udp`] attach the egress program to `cgroup` when it
    /// marks a socket stale (the agent's data path; inspection commands never set it).
    pub(crate) fn set_cgroup(&mut self, cgroup: &Path) {
        self.cgroup = Some(cgroup.to_path_buf());
    }

    /// Writes the puts a bulk write buffered, in the order backends, memberships, slots,
    /// names, frontends: a frontend is never visible before the entries it points to.
    /// Buffering goes on until [`ServiceMaps::end_bulk`]. Errors: the first failed batch;
    /// the puts after it are dropped (the caller verifies the maps).
    fn flush(&mut self) -> Result<(), DatapathError> {
        let Some(b) = self.bulk.as_mut().map(std::mem::take) else {
            return Ok(());
        };
        let r = &self.raw;
        write_batch(&r.backends, BACKENDS, &b.backends)?;
        write_batch(&r.members, MEMBERS, &b.members)?;
        write_batch(&r.slots, BACKEND_SLOTS, &b.slots)?;
        write_batch(&r.names, SERVICE_NAMES, &b.names)?;
        write_batch(&r.frontends, FRONTENDS, &b.frontends)
    }

    /// Detaches the egress program once no socket is listed in `STALE_SOCKETS` (they
    /// reconnected or were closed). Returns whether it detached it.
    pub(crate) fn detach_egress_when_idle(&self) -> Result<bool, DatapathError> {
        if !crate::datapath::loader::egress_attached(&self.dir)
            || crate::datapath::loader::stale_sockets_listed(&self.dir)
        {
            return Ok(false);
        }
        crate::datapath::loader::detach_egress(&self.dir).map_err(|e| DatapathError::Map {
            op: "detach egress program of",
            map: STALE_SOCKETS,
            error: std::io::Error::other(format!("{e:#}")),
        })
    }

    /// Writes the data path configuration (index 0 of `CONFIG`).
    pub fn write_config(&self, cfg: &Config) -> Result<(), DatapathError> {
        let (map, _) = open_map(&self.dir, CONFIG)?;
        let mut a: Array<MapData, Config> =
            Array::try_from(map).map_err(|e| map_err("open", CONFIG, e))?;
        a.set(0, cfg, 0).map_err(|e| map_err("update", CONFIG, e))
    }
}

/// Sums the per-CPU counters of the `COUNTERS` map pinned under `dir`, in
/// `proxy_common::Counter` index order.
pub fn read_counters(dir: &Path) -> Result<Vec<u64>, DatapathError> {
    read_percpu_counters(dir, COUNTERS)
}

/// Sums the per-CPU counters of the tc path's `TC_COUNTERS` map pinned under `dir`, in
/// `proxy_common::nat::TcCounter` index order.
pub(crate) fn read_tc_counters(dir: &Path) -> Result<Vec<u64>, DatapathError> {
    read_percpu_counters(dir, proxy_common::nat::TC_COUNTERS)
}

/// Sums every entry of the per-CPU `u64` array `name` pinned under `dir` over the CPUs.
fn read_percpu_counters(dir: &Path, name: &'static str) -> Result<Vec<u64>, DatapathError> {
    let (map, _) = open_map(dir, name)?;
    let a: PerCpuArray<MapData, u64> =
        PerCpuArray::try_from(map).map_err(|e| map_err("open", name, e))?;
    let mut out = Vec::new();
    for i in 0..a.len() {
        let v = a.get(&i, 0).map_err(|e| map_err("lookup", name, e))?;
        out.push(v.iter().sum());
    }
    Ok(out)
}

/// Per-service counters of the maps pinned under `dir`, summed over CPUs: `SERVICE_STATS`,
/// with each service's packets and bytes counted in its slot of `SERVICE_PACKETS` and its
/// connections added (its `BACKEND_STATS` pairs and its carried count in
/// `STATS_CARRIED`; see [`read_connection_counts`]).
pub fn read_service_stats(
    dir: &Path,
) -> Result<std::collections::BTreeMap<u32, ServiceStats>, DatapathError> {
    let (map, _) = open_map(dir, SERVICE_STATS)?;
    let m: aya::maps::PerCpuHashMap<MapData, u32, ServiceStats> =
        aya::maps::PerCpuHashMap::try_from(map).map_err(|e| map_err("open", SERVICE_STATS, e))?;
    let mut out = std::collections::BTreeMap::new();
    for kv in m.iter() {
        let (k, v) = kv.map_err(|e| map_err("iterate", SERVICE_STATS, e))?;
        let sum = v.iter().fold(ServiceStats::default(), |a, s| ServiceStats {
            connections: a.connections + s.connections,
            refused: a.refused + s.refused,
            packets: a.packets + s.packets,
            bytes: a.bytes + s.bytes,
        });
        out.insert(k, sum);
    }
    packet_slots::add_packets(dir, &mut out)?;
    for (k, n) in read_connection_counts(dir)? {
        if k.service_id != 0 {
            out.entry(k.service_id)
                .or_insert_with(ServiceStats::default)
                .connections += n;
        }
    }
    Ok(out)
}

/// Per-backend connection counts pinned under `dir` ([`read_connection_counts`]), summed over
/// the backend's keys: backend id -> connections and new flows sent to it.
pub(crate) fn read_backend_stats(
    dir: &Path,
) -> Result<std::collections::BTreeMap<u32, u64>, DatapathError> {
    let mut out = std::collections::BTreeMap::new();
    for (k, n) in read_connection_counts(dir)? {
        if k.backend_id != 0 {
            *out.entry(k.backend_id).or_insert(0) += n;
        }
    }
    Ok(out)
}

/// The connection counts pinned under `dir` by key: `BACKEND_STATS`'s pairs, each summed
/// over CPUs, and the carried counts of `STATS_CARRIED` (keys with one id 0). Never during
/// this process's sweep of them (`COUNTS_SWEEP`), so a reader here never sees a count both
/// on its pair and where it moved; a key met twice (a delete during the walk restarts it)
/// counts once.
pub fn read_connection_counts(
    dir: &Path,
) -> Result<std::collections::BTreeMap<MemberKey, u64>, DatapathError> {
    let _sweep = COUNTS_SWEEP.lock().unwrap_or_else(|e| e.into_inner());
    let mut out = std::collections::BTreeMap::new();
    for kv in pair_stats(dir)?.iter() {
        let (k, v) = kv.map_err(|e| map_err("iterate", BACKEND_STATS, e))?;
        out.insert(k, v.iter().sum::<u64>());
    }
    let carried: std::collections::BTreeMap<MemberKey, u64> = carried_stats(dir)?
        .iter()
        .collect::<Result<_, _>>()
        .map_err(|e| map_err("iterate", STATS_CARRIED, e))?;
    for (k, n) in carried {
        *out.entry(k).or_insert(0) += n;
    }
    Ok(out)
}

/// Held by a sweep of the connection counts and by their readers in this process (the
/// agent's verification and `/metrics`).
static COUNTS_SWEEP: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn pair_stats(
    dir: &Path,
) -> Result<aya::maps::PerCpuHashMap<MapData, MemberKey, u64>, DatapathError> {
    let (map, _) = open_map(dir, BACKEND_STATS)?;
    aya::maps::PerCpuHashMap::try_from(map).map_err(|e| map_err("open", BACKEND_STATS, e))
}

fn carried_stats(dir: &Path) -> Result<HashMap<MapData, MemberKey, u64>, DatapathError> {
    let (map, _) = open_map(dir, STATS_CARRIED)?;
    HashMap::try_from(map).map_err(|e| map_err("open", STATS_CARRIED, e))
}

/// Deletes the keys of per-CPU hash map `name` pinned under `dir` for which `live` says
/// false; returns how many went.
fn sweep<V: aya::Pod>(
    dir: &Path,
    name: &'static str,
    live: &dyn Fn(u32) -> bool,
) -> Result<usize, DatapathError> {
    let (map, _) = open_map(dir, name)?;
    let mut m: aya::maps::PerCpuHashMap<MapData, u32, V> =
        aya::maps::PerCpuHashMap::try_from(map).map_err(|e| map_err("open", name, e))?;
    let dead: Vec<u32> = m
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !live(*k))
        .collect();
    for k in &dead {
        ignore_missing(m.remove(k)).map_err(|e| map_err("delete", name, e))?;
    }
    Ok(dead.len())
}

/// Sweeps the connection counts as [`super::plan_pair_sweep`] plans and
/// [`super::apply_pair_sweep`] applies, while no reader in this process reads them.
/// Returns how many keys were deleted.
fn sweep_pairs(dir: &Path, bound: &super::Bound<'_>) -> Result<usize, DatapathError> {
    let _sweep = COUNTS_SWEEP.lock().unwrap_or_else(|e| e.into_inner());
    let cpus = aya::util::nr_cpus()
        .map_err(|(_, e)| map_err("count CPUs for", BACKEND_STATS, MapError::from(e)))?;
    let raw = MapData::from_pin(dir.join(BACKEND_STATS))
        .map_err(|e| map_err("open pinned", BACKEND_STATS, e))?;
    let mut m = KernelPairs {
        pairs: pair_stats(dir)?,
        raw,
        carried: carried_stats(dir)?,
        cpus,
    };
    // The keys only (a key met twice during a walk is planned once).
    let mut keys = std::collections::BTreeSet::new();
    for k in m.pairs.keys() {
        keys.insert(k.map_err(|e| map_err("iterate", BACKEND_STATS, e))?);
    }
    for k in m.carried.keys() {
        keys.insert(k.map_err(|e| map_err("iterate", STATS_CARRIED, e))?);
    }
    let plan = super::plan_pair_sweep(keys, bound);
    super::apply_pair_sweep(&plan, &mut m)
}

/// The connection counts for [`super::apply_pair_sweep`]: pairs are taken from
/// `BACKEND_STATS`, carried keys live in `STATS_CARRIED`.
struct KernelPairs {
    pairs: aya::maps::PerCpuHashMap<MapData, MemberKey, u64>,
    /// `BACKEND_STATS` again, for the command aya lacks ([`super::batch::take_per_cpu_u64`]).
    raw: MapData,
    carried: HashMap<MapData, MemberKey, u64>,
    cpus: usize,
}

/// `BPF_NOEXIST` and `BPF_EXIST`, the update flags of `bpf(2)`: create only, replace only.
const BPF_NOEXIST: u64 = 1;
const BPF_EXIST: u64 = 2;

impl KernelPairs {
    fn carried_count(&self, k: &MemberKey) -> Result<Option<u64>, DatapathError> {
        match self.carried.get(k, 0) {
            Ok(n) => Ok(Some(n)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err("lookup", STATS_CARRIED, e)),
        }
    }
}

impl super::PairCounters for KernelPairs {
    fn ensure(&mut self, k: &MemberKey) -> Result<(), DatapathError> {
        if self.carried_count(k)?.is_some() {
            return Ok(());
        }
        match self.carried.insert(k, 0, BPF_NOEXIST) {
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                Ok(())
            }
            r => r.map_err(|e| map_err("update", STATS_CARRIED, e)),
        }
    }

    fn take(&mut self, k: &MemberKey) -> Result<Option<u64>, DatapathError> {
        super::batch::take_per_cpu_u64(self.raw.fd(), k, self.cpus)
            .map(|v| v.map(|v| v.iter().sum()))
            .map_err(|error| DatapathError::Map {
                op: "lookup and delete",
                map: BACKEND_STATS,
                error,
            })
    }

    fn add(&mut self, k: &MemberKey, n: u64) -> Result<(), DatapathError> {
        let had = self.carried_count(k)?.unwrap_or(0);
        self.carried
            .insert(k, had.saturating_add(n), BPF_EXIST)
            .map_err(|e| map_err("update", STATS_CARRIED, e))
    }

    fn delete(&mut self, k: &MemberKey) -> Result<(), DatapathError> {
        // A carried key from a build that kept them in `BACKEND_STATS` goes from there too.
        if k.service_id == 0 || k.backend_id == 0 {
            ignore_missing(self.carried.remove(k))
                .map_err(|e| map_err("delete", STATS_CARRIED, e))?;
        }
        ignore_missing(self.pairs.remove(k)).map_err(|e| map_err("delete", BACKEND_STATS, e))
    }
}

impl PinnedMaps {
    /// Releases what was translated to UDP backends that left a service: `released` holds
    /// (service id, backend id, backend), as [`ServiceMaps::release_stale`] takes them (the
    /// reconciler's `Report::released`).
    /// `UDP_FLOWS` entries of those pairs are deleted, and connected UDP sockets whose
    /// reverse-NAT entry names such a pair are put into `STALE_SOCKETS`, after the egress
    /// program that fails their sends is attached (see [`PinnedMaps::set_cgroup`]). This is
    /// the socket level's equivalent of kube-proxy deleting the UDP conntrack entries of a
    /// removed endpoint. Costs one pass over `UDP_FLOWS` and the connected sockets' entries
    /// ([`for_each_connected`]), only when `released` is not empty. TCP sockets are never touched.
    pub(crate) fn release_stale_udp(
        &self,
        released: &[(u32, u32, Backend)],
    ) -> Result<Released, DatapathError> {
        let mut r = Released::default();
        if released.is_empty() {
            return Ok(r);
        }
        let by_id: std::collections::HashSet<(u32, u32)> =
            released.iter().map(|(s, b, _)| (*s, *b)).collect();
        let by_addr: std::collections::HashSet<(u32, [u8; 16], [u8; 2])> = released
            .iter()
            .map(|(s, _, b)| (*s, b.addr, b.port))
            .collect();

        let (flows, _) = hash::<UdpFlowKey, UdpFlow>(&self.dir, UDP_FLOWS)?;
        let mut flows = flows;
        let stale_flows: Vec<UdpFlowKey> = flows
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, f)| by_id.contains(&(f.service_id, f.backend_id)))
            .map(|(k, _)| k)
            .collect();
        for k in &stale_flows {
            ignore_missing(flows.remove(k)).map_err(|e| map_err("delete", UDP_FLOWS, e))?;
            r.flows += 1;
        }

        let (stale, _) = hash::<u64, u32>(&self.dir, STALE_SOCKETS)?;
        let mut stale = stale;
        let mut sockets: Vec<(u64, u32)> = Vec::new();
        for_each_connected(&self.dir, |k, v| {
            if v.proto == PROTO_UDP && by_addr.contains(&(v.service_id, k.addr, k.port)) {
                sockets.push((k.cookie, v.service_id));
            }
        })?;
        if !sockets.is_empty()
            && let Some(cg) = &self.cgroup
        {
            // Before the first entry: the program that fails a stale socket's sends must be
            // in place when the socket is listed.
            crate::datapath::loader::attach_egress(&self.dir, cg).map_err(|e| {
                DatapathError::Map {
                    op: "attach egress program for",
                    map: STALE_SOCKETS,
                    error: std::io::Error::other(format!("{e:#}")),
                }
            })?;
        }
        for (cookie, sid) in sockets {
            stale
                .insert(cookie, sid, 0)
                .map_err(|e| map_err("update", STALE_SOCKETS, e))?;
            r.sockets += 1;
        }
        Ok(r)
    }
}

/// Passes every connected socket's reverse-NAT entry in the pin directory `dir` to `f`, as
/// (key, value): the `SOCK_NAT` slots in use, the `SOCK_NAT_OVERFLOW` entries (sockets
/// whose slot was taken), and the `REVNAT_SK` entries with `REVNAT_F_CONNECTED` (written
/// by a version without slots). One batched pass over each map, holding one chunk at a
/// time. A slot being written (`SOCK_NAT_BUSY`) and an entry whose peer the socket has
/// since addressed directly (all zeros) are left out; a pin directory of a version without
/// slots has only `REVNAT_SK` to read.
///
/// Errors: a map cannot be opened (other than a missing `SOCK_NAT` or
/// `SOCK_NAT_OVERFLOW`) or read.
pub fn for_each_connected(
    dir: &Path,
    mut f: impl FnMut(&RevNatKey, &RevNatValue),
) -> Result<(), DatapathError> {
    let open = |name: &'static str| {
        MapData::from_pin(dir.join(name)).map_err(|e| map_err("open pinned", name, e))
    };
    let revnat = open(REVNAT_SK)?;
    super::batch::for_each(revnat.fd(), |k: &RevNatKey, v: &RevNatValue| {
        if v.flags & REVNAT_F_CONNECTED != 0 {
            f(k, v)
        }
    })
    .map_err(|e| batch_err("read", REVNAT_SK, e))?;
    if dir.join(SOCK_NAT_OVERFLOW).exists() {
        super::batch::for_each(open(SOCK_NAT_OVERFLOW)?.fd(), |_: &u64, e: &SockNat| {
            if e.key.addr != [0; 16] {
                f(&e.key, &e.value)
            }
        })
        .map_err(|e| batch_err("read", SOCK_NAT_OVERFLOW, e))?;
    }
    if !dir.join(SOCK_NAT).exists() {
        return Ok(());
    }
    let slots = open(SOCK_NAT)?;
    super::batch::for_each(slots.fd(), |_: &u32, e: &SockNat| {
        if e.key.cookie != 0 && e.key.cookie & SOCK_NAT_BUSY == 0 && e.key.addr != [0; 16] {
            f(&e.key, &e.value)
        }
    })
    .map_err(|e| batch_err("read", SOCK_NAT, e))
}

/// The backends still live per service id, as (address, port) in `REVNAT_SK`'s byte
/// order: see [`tcp_sockets_to_removed`].
pub(crate) type LiveBackends =
    std::collections::HashMap<u32, std::collections::HashSet<([u8; 16], [u8; 2])>>;

/// The client sockets `connect()` translated over TCP to a backend that is not live for
/// its service id: cookies of the connected TCP sockets' entries ([`for_each_connected`])
/// whose service id is a key of `live` and whose backend (address, port in network order)
/// is not in that key's set. Service ids not in `live` are not looked at. One pass over
/// those entries in the pin directory `dir`.
pub(crate) fn tcp_sockets_to_removed(
    dir: &Path,
    live: &LiveBackends,
) -> Result<std::collections::BTreeSet<u64>, DatapathError> {
    let mut cookies = std::collections::BTreeSet::new();
    for_each_connected(dir, |k, v| {
        if v.proto == proxy_common::PROTO_TCP
            && live
                .get(&v.service_id)
                .is_some_and(|l| !l.contains(&(k.addr, k.port)))
        {
            cookies.insert(k.cookie);
        }
    })?;
    Ok(cookies)
}

fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) | Err(MapError::ElementNotFound) => Ok(()),
        Err(MapError::SyscallError(s)) if s.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

impl ServiceMaps for PinnedMaps {
    fn sweep_stats(&mut self, bound: &super::Bound<'_>) -> Result<usize, DatapathError> {
        Ok(
            sweep::<ServiceStats>(&self.dir, SERVICE_STATS, bound.service)?
                + packet_slots::free_released(&self.dir, bound)?
                + sweep_pairs(&self.dir, bound)?,
        )
    }
    fn capacity(&self) -> Capacity {
        self.cap
    }

    fn begin_bulk(&mut self) {
        self.bulk.get_or_insert_with(Bulk::default);
    }

    fn end_bulk(&mut self) -> Result<(), DatapathError> {
        let r = self.flush();
        self.bulk = None;
        r
    }

    fn snapshot(&self) -> Result<Snapshot, DatapathError> {
        debug_assert!(self.bulk.is_none(), "snapshot during a bulk write");
        // Batched: a periodic verification of 30,000 Services reads ~700,000 entries.
        use super::batch::read_all;
        let r = &self.raw;
        let e = |map| move |err| batch_err("read", map, err);
        let mut s = Snapshot {
            frontends: read_all(r.frontends.fd())
                .map_err(e(FRONTENDS))?
                .into_iter()
                .collect(),
            backends: read_all(r.backends.fd())
                .map_err(e(BACKENDS))?
                .into_iter()
                .collect(),
            names: read_all::<u32, ServiceName>(r.names.fd())
                .map_err(e(SERVICE_NAMES))?
                .into_iter()
                .map(|(k, v)| (k, decode_name(&v)))
                .collect(),
            members: read_all(r.members.fd())
                .map_err(e(MEMBERS))?
                .into_iter()
                .collect(),
            ..Snapshot::default()
        };
        for (k, v) in
            read_all::<BackendSlotKey, BackendSlot>(r.slots.fd()).map_err(e(BACKEND_SLOTS))?
        {
            if s.backends.get(&v.backend_id) != Some(&v.backend) {
                s.stale_slots.insert(k);
            }
            s.slots.insert(k, v.backend_id);
        }
        for k in self.maglev.keys() {
            s.maglev
                .insert(k.map_err(|e| map_err("iterate", MAGLEV, e))?);
        }
        Ok(s)
    }

    fn put_frontend(&mut self, key: &FrontendKey, value: &Frontend) -> Result<(), DatapathError> {
        if let Some(b) = &mut self.bulk {
            b.frontends.0.push(*key);
            b.frontends.1.push(*value);
            return Ok(());
        }
        self.frontends
            .insert(key, value, 0)
            .map_err(|e| map_err("update", FRONTENDS, e))
    }
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), DatapathError> {
        self.flush()?;
        ignore_missing(self.frontends.remove(key)).map_err(|e| map_err("delete", FRONTENDS, e))
    }
    fn put_slot(&mut self, key: &BackendSlotKey, value: &BackendSlot) -> Result<(), DatapathError> {
        if let Some(b) = &mut self.bulk {
            b.slots.0.push(*key);
            b.slots.1.push(*value);
            return Ok(());
        }
        self.slots
            .insert(key, value, 0)
            .map_err(|e| map_err("update", BACKEND_SLOTS, e))
    }
    fn delete_slot(&mut self, key: &BackendSlotKey) -> Result<(), DatapathError> {
        self.flush()?;
        ignore_missing(self.slots.remove(key)).map_err(|e| map_err("delete", BACKEND_SLOTS, e))
    }
    fn put_backend(&mut self, id: u32, value: &Backend) -> Result<(), DatapathError> {
        if let Some(b) = &mut self.bulk {
            b.backends.0.push(id);
            b.backends.1.push(*value);
            return Ok(());
        }
        self.backends
            .insert(id, value, 0)
            .map_err(|e| map_err("update", BACKENDS, e))
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), DatapathError> {
        self.flush()?;
        ignore_missing(self.backends.remove(&id)).map_err(|e| map_err("delete", BACKENDS, e))
    }
    fn put_name(&mut self, service_id: u32, name: &str) -> Result<(), DatapathError> {
        if let Some(b) = &mut self.bulk {
            b.names.0.push(service_id);
            b.names.1.push(encode_name(name));
            return Ok(());
        }
        self.names
            .insert(service_id, encode_name(name), 0)
            .map_err(|e| map_err("update", SERVICE_NAMES, e))
    }
    fn delete_name(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.flush()?;
        ignore_missing(self.names.remove(&service_id))
            .map_err(|e| map_err("delete", SERVICE_NAMES, e))
    }
    fn put_member(&mut self, key: &MemberKey, weight: u32) -> Result<(), DatapathError> {
        if let Some(b) = &mut self.bulk {
            b.members.0.push(*key);
            b.members.1.push(weight);
            return Ok(());
        }
        self.members
            .insert(key, weight, 0)
            .map_err(|e| map_err("update", MEMBERS, e))
    }
    fn delete_member(&mut self, key: &MemberKey) -> Result<(), DatapathError> {
        self.flush()?;
        ignore_missing(self.members.remove(key)).map_err(|e| map_err("delete", MEMBERS, e))
    }
    fn get_maglev(&self, service_id: u32) -> Result<Option<Vec<u32>>, DatapathError> {
        match self.maglev.get(&service_id, 0) {
            Ok(t) => {
                let n = (t.size as usize).min(MAGLEV_MAX);
                Ok(Some(t.entries[..n].to_vec()))
            }
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err("lookup", MAGLEV, e)),
        }
    }
    fn put_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<(), DatapathError> {
        // A live frontend's table may name backends that are still buffered.
        self.flush()?;
        // 256 KiB: built on the heap, never on the stack.
        let mut t: Box<MaglevTable> = Box::new(MaglevTable {
            size: table.len().min(MAGLEV_MAX) as u32,
            _pad: 0,
            entries: [0; MAGLEV_MAX],
        });
        let n = table.len().min(MAGLEV_MAX);
        t.entries[..n].copy_from_slice(&table[..n]);
        // By reference: `*t` would move 256 KiB onto the stack.
        #[allow(clippy::needless_borrows_for_generic_args)]
        self.maglev
            .insert(service_id, &*t, 0)
            .map_err(|e| map_err("update", MAGLEV, e))
    }
    fn delete_maglev(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.flush()?;
        ignore_missing(self.maglev.remove(&service_id)).map_err(|e| map_err("delete", MAGLEV, e))
    }
    fn release_stale(
        &mut self,
        released: &[(u32, u32, Backend)],
    ) -> Result<Released, DatapathError> {
        self.flush()?;
        self.release_stale_udp(released)
    }
}
