//! The data path pinned under one directory (`<bpffs>/<pin-dir>`) as its readers outside the
//! agent's writes see it: the inspection commands (`ebpf-proxy services`, `backends`,
//! `stats`, `affinity`, `conntrack`, `explain`), the metrics collector (on every scrape) and
//! `ebpf-proxy monitor`. Every pinned map they read is opened here, one way: by path, when
//! it is read, nothing held between reads (a view outlives an agent restart and reads what
//! the next agent pinned), the path named in the error. This is the read side of the maps
//! the agent writes through [`PinnedMaps`] and
//! [`TcKernel`](super::tc::TcKernel), as Cilium's `pkg/loadbalancer/maps` is the one way its
//! CLI and metrics dump the load-balancing maps.
//!
//! The view reads; the one writer among its users is the monitor, whose two handles are
//! opened here too: the event ring buffer it drains (`PinnedView::event_stream`) and the
//! lease it holds on it (`PinnedView::monitor_control`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray};
use proxy_common::{
    AFFINITY, AffinityKey, AffinityValue, LC_COUNTS, RevNatKey, RevNatValue, SERVICE_NAMES,
    STALE_SOCKETS, ServiceName, ServiceStats, UDP_FLOWS, UdpFlow, UdpFlowKey,
    bypass::BypassConfig,
    monitor::{MONITOR_CPU, MONITOR_CTL, MONITOR_EVENTS, MonitorCpu, MonitorCtl},
};

use super::{
    DatapathError, Snapshot, SourceRangeKey, bypass, decode_name,
    maps::{self, PinnedMaps},
    tc::{self, XdpMode, monotonic_ns},
};

/// What an error opening the monitor's maps adds: they are missing when no agent of this
/// version pinned the data path there.
const NO_EVENT_STREAM: &str =
    "no event stream: is the agent of this version running? check --bpffs/--pin-dir";

/// The data path pinned under one directory, read on demand; see the module documentation.
#[derive(Clone, Debug)]
pub struct PinnedView {
    dir: PathBuf,
}

impl PinnedView {
    /// The view of the pin directory `dir`. Opens nothing: each read opens the maps it
    /// needs, so a missing map fails that read alone.
    pub fn new(dir: &Path) -> PinnedView {
        PinnedView {
            dir: dir.to_path_buf(),
        }
    }

    /// The pinned map `name`. Errors: `open <path>` with the cause.
    fn pin(&self, name: &str) -> Result<MapData> {
        let path = self.dir.join(name);
        MapData::from_pin(&path).with_context(|| format!("open {}", path.display()))
    }

    /// The pinned map `name` of the monitor's event stream. Errors: `open <path>` with
    /// [`NO_EVENT_STREAM`] and the cause.
    fn monitor_pin(&self, name: &str) -> Result<MapData> {
        let path = self.dir.join(name);
        MapData::from_pin(&path)
            .with_context(|| format!("open {} ({NO_EVENT_STREAM})", path.display()))
    }

    /// The service maps (`FRONTENDS`, `BACKEND_SLOTS`, `BACKENDS`, `SERVICE_NAMES`,
    /// `MEMBERS`, `MAGLEV`), opened. Errors: one is not pinned here (no data path, or
    /// another `--pin-dir`).
    pub fn service_maps(&self) -> Result<PinnedMaps, DatapathError> {
        PinnedMaps::open(&self.dir)
    }

    /// Every service map's contents ([`service_maps`](Self::service_maps), read).
    pub fn snapshot(&self) -> Result<Snapshot, DatapathError> {
        use super::ServiceMaps;
        self.service_maps()?.snapshot()
    }

    /// The socket programs' `COUNTERS`, summed over CPUs, in `proxy_common::Counter` index
    /// order.
    pub fn counters(&self) -> Result<Vec<u64>, DatapathError> {
        maps::read_counters(&self.dir)
    }

    /// The tc programs' `TC_COUNTERS`, summed over CPUs, in `proxy_common::nat::TcCounter`
    /// index order.
    pub(crate) fn tc_counters(&self) -> Result<Vec<u64>, DatapathError> {
        maps::read_tc_counters(&self.dir)
    }

    /// Per service id counters, summed over CPUs, connections included
    /// ([`maps::read_service_stats`]).
    pub(crate) fn service_stats(&self) -> Result<BTreeMap<u32, ServiceStats>, DatapathError> {
        maps::read_service_stats(&self.dir)
    }

    /// Connections and new flows sent to each backend id ([`maps::read_backend_stats`]).
    pub(crate) fn backend_stats(&self) -> Result<BTreeMap<u32, u64>, DatapathError> {
        maps::read_backend_stats(&self.dir)
    }

    /// `LC_COUNTS`: backend id -> connections and tc flows open now, as least-connections
    /// counts them.
    pub(crate) fn lc_counts(&self) -> Result<BTreeMap<u32, u32>> {
        self.u32_map(LC_COUNTS)
    }

    /// A pinned `u32 -> u32` hash map.
    fn u32_map(&self, name: &str) -> Result<BTreeMap<u32, u32>> {
        let map: HashMap<MapData, u32, u32> = HashMap::try_from(Map::HashMap(self.pin(name)?))
            .with_context(|| format!("open {name}"))?;
        let mut out = BTreeMap::new();
        for kv in map.iter() {
            let (k, v) = kv.with_context(|| format!("iterate {name}"))?;
            out.insert(k, v);
        }
        Ok(out)
    }

    /// Every `AFFINITY` entry (client and group -> backend and last use), in map order.
    pub(crate) fn affinity(&self) -> Result<Vec<(AffinityKey, AffinityValue)>> {
        let map: HashMap<MapData, AffinityKey, AffinityValue> =
            HashMap::try_from(Map::LruHashMap(self.pin(AFFINITY)?)).context("open AFFINITY")?;
        map.iter()
            .map(|kv| kv.context("iterate AFFINITY"))
            .collect()
    }

    /// `STALE_SOCKETS`, opened for lookups.
    pub(crate) fn stale_sockets(&self) -> Result<StaleSockets> {
        let map = HashMap::try_from(Map::LruHashMap(self.pin(STALE_SOCKETS)?))
            .context("open STALE_SOCKETS")?;
        Ok(StaleSockets(map))
    }

    /// Passes every connected socket's reverse-NAT entry to `f`
    /// ([`maps::for_each_connected`]).
    pub(crate) fn for_each_connected(
        &self,
        f: impl FnMut(&RevNatKey, &RevNatValue),
    ) -> Result<(), DatapathError> {
        maps::for_each_connected(&self.dir, f)
    }

    /// Every `UDP_FLOWS` entry (an unconnected socket's flow to a frontend), in map order.
    pub(crate) fn udp_flows(&self) -> Result<Vec<(UdpFlowKey, UdpFlow)>> {
        let map: HashMap<MapData, UdpFlowKey, UdpFlow> =
            HashMap::try_from(Map::LruHashMap(self.pin(UDP_FLOWS)?)).context("open UDP_FLOWS")?;
        map.iter()
            .map(|kv| kv.context("iterate UDP_FLOWS"))
            .collect()
    }

    /// The `TC_SOURCE_RANGES` entries. Errors: the map is not pinned here (no tc path) or
    /// cannot be read.
    pub fn source_ranges(&self) -> Result<BTreeMap<SourceRangeKey, u32>> {
        tc::pinned_source_ranges(&self.dir)
    }

    /// The interfaces with the north-south programs (a pinned tcx ingress link).
    pub fn tc_interfaces(&self) -> BTreeSet<String> {
        tc::tc_interfaces(&self.dir)
    }

    /// The interfaces with a pinned XDP link, with the mode each runs in.
    pub fn xdp_modes(&self) -> BTreeMap<String, XdpMode> {
        tc::xdp_modes(&self.dir)
    }

    /// The socket-level bypass: `BYPASS_CONFIG` and the namespace cookies of
    /// `BYPASS_NETNS` ([`bypass::read_pinned`]).
    pub(crate) fn bypass(&self) -> Result<(BypassConfig, Vec<u64>)> {
        bypass::read_pinned(&self.dir)
    }

    /// The interfaces of bypassed pods with the per-packet programs attached
    /// ([`bypass::attached_pods`]).
    pub(crate) fn bypass_links(&self) -> BTreeSet<String> {
        bypass::attached_pods(&self.dir)
    }

    /// The monitor's per-CPU state (`MONITOR_CPU`), summed over CPUs: events emitted, events
    /// lost by cause, time spent emitting.
    pub fn monitor_totals(&self) -> Result<MonitorCpu> {
        let a: PerCpuArray<MapData, MonitorCpu> =
            PerCpuArray::try_from(Map::PerCpuArray(self.pin(MONITOR_CPU)?))?;
        let mut t = MonitorCpu::default();
        for c in a.get(&0, 0)?.iter() {
            t.emitted += c.emitted;
            t.rate_limited += c.rate_limited;
            t.ring_full += c.ring_full;
            t.emit_ns += c.emit_ns;
        }
        Ok(t)
    }

    /// Whether a monitor holds the lease of the event stream now (`MONITOR_CTL`'s expiry is
    /// ahead of `CLOCK_MONOTONIC`).
    pub fn monitor_lease_held(&self) -> Result<bool> {
        let a: Array<MapData, MonitorCtl> = Array::try_from(Map::Array(self.pin(MONITOR_CTL)?))?;
        Ok(a.get(&0, 0)?.expiry_ns > monotonic_ns())
    }

    /// `SERVICE_NAMES`, opened to be read again whenever the caller needs (the monitor meets
    /// service ids that appeared after it started).
    pub(crate) fn service_names(&self) -> Result<ServiceNames> {
        Ok(ServiceNames(HashMap::try_from(Map::HashMap(
            self.pin(SERVICE_NAMES)?,
        ))?))
    }

    /// The monitor's event ring buffer, `MONITOR_EVENTS`, as pinned (the monitor takes its
    /// lock before it reads it as a ring buffer: one reader at a time).
    pub(crate) fn event_stream(&self) -> Result<MapData> {
        self.monitor_pin(MONITOR_EVENTS)
    }

    /// `MONITOR_CTL`, for the monitor's lease (its expiry and rate).
    pub(crate) fn monitor_control(&self) -> Result<Array<MapData, MonitorCtl>> {
        Ok(Array::try_from(Map::Array(self.monitor_pin(MONITOR_CTL)?))?)
    }
}

/// `STALE_SOCKETS` opened: the cookies of connected UDP sockets whose backend left.
pub(crate) struct StaleSockets(HashMap<MapData, u64, u32>);

impl StaleSockets {
    /// Whether the socket of `cookie` is stale (its sends fail until it reconnects).
    pub(crate) fn contains(&self, cookie: u64) -> bool {
        self.0.get(&cookie, 0).is_ok()
    }
}

/// `SERVICE_NAMES` opened ([`PinnedView::service_names`]).
pub(crate) struct ServiceNames(HashMap<MapData, u32, ServiceName>);

impl ServiceNames {
    /// Service id -> name, decoded, as the map holds them now (entries that cannot be read
    /// are left out).
    pub(crate) fn read(&self) -> BTreeMap<u32, String> {
        self.0
            .iter()
            .filter_map(|r| r.ok())
            .map(|(id, n)| (id, decode_name(&n)))
            .collect()
    }
}
