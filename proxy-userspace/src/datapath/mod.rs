//! The data path as the control plane sees it, behind traits so the whole control plane can
//! be tested without BPF or root ([`fake::FakeDatapath`]) and run for real
//! ([`kernel::KernelDatapath`]): the service maps ([`ServiceMaps`]), the north-south maps
//! ([`NodeMaps`]), the node's interfaces and the tc programs attached to them
//! ([`Interfaces`]), and the `healthCheckNodePort` servers ([`HealthServers`], served by
//! [`healthcheck::HealthCheckServers`]). [`Datapath`] is all four.

pub mod addr;
pub(crate) mod batch;
pub mod bypass;
pub(crate) mod clock;
pub mod fake;
pub mod healthcheck;
pub mod kernel;
pub mod loader;
pub mod maps;
pub mod tc;
pub(crate) mod veth;
pub mod view;
pub(crate) mod vip;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use proxy_common::{
    Backend, BackendSlot, BackendSlotKey, Frontend, FrontendKey, MemberKey, ServiceName,
    nat::{DsrKey, DsrTarget, IfaceAddr, SOURCE_RANGE_ALLOW, SOURCE_RANGE_RESTRICTED, SourceRange},
};

/// Error of a data path operation.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The desired state does not fit: `needed` entries of `map`, whose limit is `limit`.
    /// Nothing was written.
    #[error("map {map} is full: {needed} entries needed, limit {limit} (raise --{flag})")]
    Full {
        map: &'static str,
        needed: usize,
        limit: u32,
        flag: &'static str,
    },
    /// A map operation failed.
    #[error("{op} on map {map}: {error}")]
    Map {
        op: &'static str,
        map: &'static str,
        error: std::io::Error,
    },
}

/// `max_entries` of each service map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Of `FRONTENDS` (frontends plus one VIP marker per VIP).
    pub frontends: u32,
    /// Of `BACKEND_SLOTS`.
    pub slots: u32,
    /// Of `BACKENDS`.
    pub backends: u32,
    /// Of `SERVICE_NAMES` (one per service id).
    pub services: u32,
}

/// Highest weight an endpoint may have: `MEMBERS` values are 1..=this, and a weighted
/// round-robin set repeats a backend in its slots as often as its weight, so it bounds the
/// slots a service uses.
pub(crate) const MAX_WEIGHT: u32 = 100;

/// Full contents of the service maps, as read back from the kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// `FRONTENDS`.
    pub frontends: BTreeMap<FrontendKey, Frontend>,
    /// `BACKEND_SLOTS`: slot -> backend id.
    pub slots: BTreeMap<BackendSlotKey, u32>,
    /// Slots whose copy of their backend differs from `BACKENDS` (a write outside the
    /// agent): a verification rewrites them; an adoption reads them by id.
    pub stale_slots: BTreeSet<BackendSlotKey>,
    /// `BACKENDS`.
    pub backends: BTreeMap<u32, Backend>,
    /// `SERVICE_NAMES`, decoded.
    pub names: BTreeMap<u32, String>,
    /// `MEMBERS`: membership -> the backend's weight in the set.
    pub members: BTreeMap<MemberKey, u32>,
    /// Service ids with a `MAGLEV` table (the tables themselves are read on demand).
    pub maglev: BTreeSet<u32>,
}

/// What releasing stale UDP state did ([`ServiceMaps::release_stale`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// `UDP_FLOWS` entries deleted.
    pub(crate) flows: usize,
    /// Connected UDP sockets put into `STALE_SOCKETS`.
    pub(crate) sockets: usize,
}

/// The service maps. Every write is one map operation; ordering is the caller's.
pub trait ServiceMaps {
    /// Limits of the maps.
    fn capacity(&self) -> Capacity;
    /// Reads every service map.
    fn snapshot(&self) -> Result<Snapshot, DatapathError>;
    /// Starts a bulk write: the puts that follow may be buffered and written together (one
    /// system call per few thousand entries) by [`ServiceMaps::end_bulk`], or before any
    /// other operation, in the order backends, memberships, slots, names, frontends, so a
    /// frontend is never visible before what it points to. The default writes each put at
    /// once.
    fn begin_bulk(&mut self) {}
    /// Writes what the bulk write buffered and ends it. Errors: the first failed batch; the
    /// buffered puts after it are not written (verify the maps to repair).
    fn end_bulk(&mut self) -> Result<(), DatapathError> {
        Ok(())
    }
    /// Creates or replaces a frontend.
    fn put_frontend(&mut self, key: &FrontendKey, value: &Frontend) -> Result<(), DatapathError>;
    /// Removes a frontend (absent is not an error).
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), DatapathError>;
    /// Creates or replaces a slot: the backend id and a copy of its value.
    fn put_slot(&mut self, key: &BackendSlotKey, value: &BackendSlot) -> Result<(), DatapathError>;
    /// Removes a slot (absent is not an error).
    fn delete_slot(&mut self, key: &BackendSlotKey) -> Result<(), DatapathError>;
    /// Creates or replaces a backend.
    fn put_backend(&mut self, id: u32, value: &Backend) -> Result<(), DatapathError>;
    /// Removes a backend (absent is not an error).
    fn delete_backend(&mut self, id: u32) -> Result<(), DatapathError>;
    /// Creates or replaces a service name.
    fn put_name(&mut self, service_id: u32, name: &str) -> Result<(), DatapathError>;
    /// Removes a service name (absent is not an error).
    fn delete_name(&mut self, service_id: u32) -> Result<(), DatapathError>;
    /// Marks a backend as a member of a service id's set with its weight there (1..=100;
    /// 1 for sets without weights), or changes its weight.
    fn put_member(&mut self, key: &MemberKey, weight: u32) -> Result<(), DatapathError>;
    /// Removes a membership (absent is not an error).
    fn delete_member(&mut self, key: &MemberKey) -> Result<(), DatapathError>;
    /// The Maglev table of a service id, if any (its `size` entries).
    fn get_maglev(&self, service_id: u32) -> Result<Option<Vec<u32>>, DatapathError>;
    /// Creates or replaces the Maglev table of a service id (`table.len()` is its size, a
    /// prime `<= MAGLEV_MAX`).
    fn put_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<(), DatapathError>;
    /// Removes a Maglev table (absent is not an error).
    fn delete_maglev(&mut self, service_id: u32) -> Result<(), DatapathError>;
    /// Releases what the socket programs translated to UDP backends that left a service:
    /// `released` holds (service id, backend id, backend). Their UDP flows are forgotten
    /// and connected UDP sockets marked stale (kube-proxy clears their conntrack entries).
    fn release_stale(
        &mut self,
        released: &[(u32, u32, Backend)],
    ) -> Result<Released, DatapathError>;
    /// Deletes the counters of ids no longer bound (`SERVICE_STATS` by service id,
    /// `BACKEND_STATS` and `STATS_CARRIED` keys naming such an id; their packet counter
    /// slots in `PACKET_OWNERS` are freed) and the (service,
    /// backend) counters of pairs no longer in use, moving their counts to the carried keys
    /// (`STATS_CARRIED`) of the service and the backend that stay bound (`plan_pair_sweep`,
    /// `apply_pair_sweep`): those maps are not LRU and ids are not reused soon. Returns how
    /// many entries were deleted. Data paths without counters delete nothing.
    fn sweep_stats(&mut self, _bound: &Bound<'_>) -> Result<usize, DatapathError> {
        Ok(0)
    }
}

/// What the agent has bound now, for [`ServiceMaps::sweep_stats`].
pub struct Bound<'a> {
    /// Whether a service id is bound.
    pub service: &'a dyn Fn(u32) -> bool,
    /// Whether a backend id is bound.
    pub backend: &'a dyn Fn(u32) -> bool,
    /// Whether (service id, backend id) is in use: the backend is in the service's slots.
    pub member: &'a dyn Fn(u32, u32) -> bool,
}

/// What a sweep of the connection counters does (`proxy_common::BACKEND_STATS` pairs,
/// `proxy_common::STATS_CARRIED` carried keys), planned from their keys.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PairSweep {
    /// Keys deleted without carrying their count anywhere: carried keys of ids no longer
    /// bound (their series end), pairs whose service and backend are both unbound.
    pub(crate) delete: Vec<MemberKey>,
    /// Pairs no longer in use, each with the carried keys, `(service id, 0)` and/or
    /// `(0, backend id)`, its count moves to.
    pub(crate) moves: Vec<(MemberKey, Vec<MemberKey>)>,
}

/// Plans the sweep of the counters with keys `keys`: a pair (service id, backend id) not in
/// use goes, its count carried to `(service id, 0)` if that service is bound and to
/// `(0, backend id)` if that backend is; a carried key of an id no longer bound goes (its
/// id's series ends); pairs in use stay.
pub(crate) fn plan_pair_sweep(
    keys: impl IntoIterator<Item = MemberKey>,
    bound: &Bound<'_>,
) -> PairSweep {
    let mut plan = PairSweep::default();
    for k in keys {
        let (s, b) = (k.service_id, k.backend_id);
        match (s, b) {
            (0, 0) => plan.delete.push(k),
            (s, 0) if !(bound.service)(s) => plan.delete.push(k),
            (0, b) if !(bound.backend)(b) => plan.delete.push(k),
            (_, 0) | (0, _) => {}
            (s, b) if (bound.member)(s, b) => {}
            (s, b) => {
                let mut to = Vec::new();
                if (bound.service)(s) {
                    to.push(MemberKey {
                        service_id: s,
                        backend_id: 0,
                    });
                }
                if (bound.backend)(b) {
                    to.push(MemberKey {
                        service_id: 0,
                        backend_id: b,
                    });
                }
                if to.is_empty() {
                    plan.delete.push(k);
                } else {
                    plan.moves.push((k, to));
                }
            }
        }
    }
    plan
}

/// The operations [`apply_pair_sweep`] needs on the connection counters: pairs in
/// `BACKEND_STATS` (counts summed over CPUs), carried keys in `STATS_CARRIED`.
pub(crate) trait PairCounters {
    /// Creates the carried key `k` with count 0 unless it exists. Errors: the map is full.
    fn ensure(&mut self, k: &MemberKey) -> Result<(), DatapathError>;
    /// Removes the pair `k` and returns its count, in one step (a count the programs add
    /// before it is not lost between a read and a delete); `None` when absent.
    fn take(&mut self, k: &MemberKey) -> Result<Option<u64>, DatapathError>;
    /// Adds `n` to the existing carried key `k` (an update in place: it cannot find the map
    /// full).
    fn add(&mut self, k: &MemberKey, n: u64) -> Result<(), DatapathError>;
    /// Removes key `k` (absent is not an error).
    fn delete(&mut self, k: &MemberKey) -> Result<(), DatapathError>;
}

/// Applies `plan`: the deletes, then each move on its own: its carried keys are created
/// first (a move whose key cannot be, the map being full, is left for the next sweep and
/// its error returned once every other move is done), then the pair is taken and its count
/// added to them. A sum therefore never counts a pair twice, and only a failure between
/// the take and the adds (or an agent dying there) loses that pair's count. Returns how
/// many keys were deleted.
pub(crate) fn apply_pair_sweep(
    plan: &PairSweep,
    m: &mut impl PairCounters,
) -> Result<usize, DatapathError> {
    let mut deleted = 0;
    for k in &plan.delete {
        m.delete(k)?;
        deleted += 1;
    }
    let mut full = None;
    'moves: for (pair, to) in &plan.moves {
        for t in to {
            if let Err(e) = m.ensure(t) {
                full.get_or_insert(e);
                continue 'moves;
            }
        }
        if let Some(n) = m.take(pair)? {
            deleted += 1;
            if n != 0 {
                for t in to {
                    m.add(t, n)?;
                }
            }
        }
    }
    match full {
        Some(e) => Err(e),
        None => Ok(deleted),
    }
}

/// A `TC_SOURCE_RANGES` key: (prefix length in bits over the whole [`SourceRange`], data).
pub type SourceRangeKey = (u32, SourceRange);

/// The `TC_SOURCE_RANGES` entries of `loadBalancerSourceRanges`: `ranges` holds each
/// restricted LB IP with the CIDRs it admits (as the model's `Model::source_ranges` gives
/// them); per LB IP a marker and one allowed prefix per CIDR (IPv4 as IPv4-mapped
/// addresses).
pub(crate) fn source_range_entries<'a, C>(
    ranges: impl IntoIterator<Item = (&'a IpAddr, C)>,
) -> BTreeMap<SourceRangeKey, u32>
where
    C: IntoIterator<Item = &'a IpNet>,
{
    let mut out = BTreeMap::new();
    for (lb, cidrs) in ranges {
        let lb_addr = addr::ip_to_bytes(*lb);
        out.insert(
            (
                128,
                SourceRange {
                    lb_addr,
                    client: [0; 16],
                },
            ),
            SOURCE_RANGE_RESTRICTED,
        );
        for c in cidrs {
            let bits = match c {
                IpNet::V4(_) => 96 + c.prefix_len() as u32,
                IpNet::V6(_) => c.prefix_len() as u32,
            };
            let mut client = addr::ip_to_bytes(c.addr());
            mask(&mut client, bits);
            out.insert(
                (128 + bits, SourceRange { lb_addr, client }),
                SOURCE_RANGE_ALLOW,
            );
        }
    }
    out
}

/// Clears the bits of `a` after the first `bits`.
fn mask(a: &mut [u8; 16], bits: u32) {
    for (i, b) in a.iter_mut().enumerate() {
        let start = i as u32 * 8;
        if start >= bits {
            *b = 0;
        } else if start + 8 > bits {
            *b &= 0xffu8 << (8 - (bits - start));
        }
    }
}

/// Full contents of the north-south maps the agent writes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeSnapshot {
    /// `TC_LOCAL_ENDPOINTS` keys (IPv4-mapped or IPv6 addresses).
    pub(crate) local_endpoints: BTreeSet<[u8; 16]>,
    /// `TC_SOURCE_RANGES`.
    pub(crate) source_ranges: BTreeMap<SourceRangeKey, u32>,
    /// `TC_IFACE_ADDRS` by interface index.
    pub(crate) iface_addrs: BTreeMap<u32, IfaceAddr>,
    /// `TC_DSR`.
    pub(crate) dsr: BTreeMap<DsrKey, DsrTarget>,
}

/// The north-south maps the agent writes. Every write is one map operation.
pub trait NodeMaps {
    /// Reads them.
    fn node_snapshot(&self) -> Result<NodeSnapshot, DatapathError>;
    /// Adds an endpoint address of this node.
    fn put_local_endpoint(&mut self, addr: &[u8; 16]) -> Result<(), DatapathError>;
    /// Removes one (absent is not an error).
    fn delete_local_endpoint(&mut self, addr: &[u8; 16]) -> Result<(), DatapathError>;
    /// Creates or replaces a source range entry.
    fn put_source_range(&mut self, key: &SourceRangeKey, value: u32) -> Result<(), DatapathError>;
    /// Removes one (absent is not an error).
    fn delete_source_range(&mut self, key: &SourceRangeKey) -> Result<(), DatapathError>;
    /// Creates or replaces the SNAT addresses of an interface.
    fn put_iface_addr(&mut self, ifindex: u32, value: &IfaceAddr) -> Result<(), DatapathError>;
    /// Removes them (absent is not an error).
    fn delete_iface_addr(&mut self, ifindex: u32) -> Result<(), DatapathError>;
    /// Creates or replaces a direct server return pair this node accepts.
    fn put_dsr(&mut self, key: &DsrKey, value: &DsrTarget) -> Result<(), DatapathError>;
    /// Removes one (absent is not an error).
    fn delete_dsr(&mut self, key: &DsrKey) -> Result<(), DatapathError>;
}

/// One interface of the agent's network namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Interface {
    /// Its index.
    pub index: u32,
    /// Its IPv4 and IPv6 addresses.
    pub addrs: Vec<IpAddr>,
}

/// The node's interfaces and the north-south programs attached to them.
pub trait Interfaces {
    /// The interfaces of the agent's network namespace, by name.
    fn interfaces(&self) -> anyhow::Result<BTreeMap<String, Interface>>;
    /// The device of the longest-prefix route to `ip` other than a default route.
    fn route_device(&self, ip: &IpAddr) -> Option<String>;
    /// The interfaces that have the programs attached (by this agent or an earlier one).
    fn attached(&self) -> BTreeSet<String>;
    /// Attaches the ingress and egress programs to an interface, and for an `external` one
    /// (not pod-facing) the XDP program as `--xdp` says. Returns the XDP mode it runs in
    /// (`None`: the tcx programs alone).
    fn attach(&mut self, name: &str, external: bool) -> anyhow::Result<Option<tc::XdpMode>>;
    /// Detaches them.
    fn detach(&mut self, name: &str) -> anyhow::Result<()>;
}

/// What a `healthCheckNodePort` server reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    /// Namespace of the Service.
    pub(crate) namespace: String,
    /// Name of the Service.
    pub(crate) name: String,
    /// Distinct endpoint addresses of the Service's `externalTrafficPolicy` backend sets on
    /// this node.
    pub(crate) local_endpoints: usize,
}

/// The `healthCheckNodePort` servers (one per port, on every address).
pub trait HealthServers {
    /// Starts serving `check` on `port`. Errors: the port cannot be bound (busy).
    fn serve_health(&mut self, port: u16, check: &HealthCheck) -> std::io::Result<()>;
    /// Changes what a running server reports.
    fn update_health(&mut self, port: u16, check: &HealthCheck);
    /// Stops a server.
    fn stop_health(&mut self, port: u16);
}

/// The periodic collection of least-connections counts of north-south flows that ended
/// without a FIN or RST the data path saw (timed out, evicted).
pub(crate) trait FlowCollection {
    /// Gives the counts of such flows back; returns how many flows were collected.
    fn collect_lc_flows(&mut self) -> anyhow::Result<usize>;
}

/// Everything the reconciler drives.
pub trait Datapath: ServiceMaps + NodeMaps + Interfaces + HealthServers {}

impl<T: ServiceMaps + NodeMaps + Interfaces + HealthServers> Datapath for T {}

/// Encodes a service name for `SERVICE_NAMES`, truncated to the map's value size.
pub(crate) fn encode_name(name: &str) -> ServiceName {
    let mut v = ServiceName::default();
    let bytes = name.as_bytes();
    let n = bytes.len().min(v.name.len());
    v.name[..n].copy_from_slice(&bytes[..n]);
    v.len = n as u32;
    v
}

/// Decodes a `SERVICE_NAMES` value (lossy on invalid UTF-8).
pub(crate) fn decode_name(v: &ServiceName) -> String {
    let n = (v.len as usize).min(v.name.len());
    String::from_utf8_lossy(&v.name[..n]).into_owned()
}
