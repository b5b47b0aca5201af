//! Reading the tc maps pinned under a pin directory (for `inspect`, the metrics and the
//! lab tests), and opening them.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv6Addr},
    path::Path,
};

use anyhow::{Context, Result};
use aya::maps::{HashMap, LpmTrie, MapData};
use ipnet::IpNet;
use proxy_common::nat::{CONNTRACK, CtEntry, CtKey, SOURCE_RANGES, SourceRange, TcCounter};

/// Opens the map `name` pinned under `dir` as a `T`.
pub(super) fn open<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    dir: &Path,
    name: &str,
) -> Result<T> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("open {}", path.display()))?;
    let map = aya::maps::Map::from_map_data(data)?;
    T::try_from(map).with_context(|| format!("open {name}"))
}

/// The `TC_SOURCE_RANGES` entries pinned under `dir`.
///
/// Errors: the map is not pinned there (no tc path) or cannot be read.
pub fn pinned_source_ranges(dir: &Path) -> Result<BTreeMap<crate::datapath::SourceRangeKey, u32>> {
    let m: LpmTrie<MapData, SourceRange, u32> = open(dir, SOURCE_RANGES)?;
    let mut out = BTreeMap::new();
    for kv in m.iter() {
        let (k, v) = kv.context("iterate TC_SOURCE_RANGES")?;
        out.insert((k.prefix_len(), k.data()), v);
    }
    Ok(out)
}

/// The client ranges `TC_SOURCE_RANGES` admits to load balancer IP `lb`: `None` when the
/// IP is not restricted (no marker), else the allowed prefixes (empty: nobody).
pub fn allowed_ranges(
    entries: &BTreeMap<crate::datapath::SourceRangeKey, u32>,
    lb: IpAddr,
) -> Option<Vec<IpNet>> {
    use proxy_common::nat::{SOURCE_RANGE_ALLOW, SOURCE_RANGE_RESTRICTED};
    let lb_addr = crate::datapath::addr::ip_to_bytes(lb);
    let restricted = entries
        .iter()
        .any(|((len, k), v)| *len == 128 && k.lb_addr == lb_addr && *v == SOURCE_RANGE_RESTRICTED);
    if !restricted {
        return None;
    }
    let ranges = entries
        .iter()
        .filter(|((len, k), v)| *len > 128 && k.lb_addr == lb_addr && **v == SOURCE_RANGE_ALLOW)
        .filter_map(|((len, k), _)| {
            let bits = (len - 128) as u8;
            let ip = Ipv6Addr::from(k.client);
            match ip.to_ipv4_mapped() {
                Some(v4) if bits >= 96 => IpNet::new(IpAddr::V4(v4), bits - 96).ok(),
                _ => IpNet::new(IpAddr::V6(ip), bits).ok(),
            }
        })
        .collect();
    Some(ranges)
}

/// Number of live entries of the conntrack map pinned under `dir` (both directions).
pub fn conntrack_entries(dir: &Path) -> Result<usize> {
    let m: HashMap<MapData, CtKey, CtEntry> = open(dir, CONNTRACK)?;
    Ok(m.keys().filter(|k| k.is_ok()).count())
}

/// Sums of the per-CPU tc counters pinned under `dir`, by name.
pub fn counters(dir: &Path) -> Result<BTreeMap<&'static str, u64>> {
    let values = crate::datapath::maps::read_tc_counters(dir)?;
    Ok(TcCounter::ALL
        .iter()
        .map(|(c, name)| (*name, values.get(*c as usize).copied().unwrap_or(0)))
        .collect())
}
