//! The per-CPU packet counter slots (`proxy_common::PACKET_OWNERS`,
//! `proxy_common::SERVICE_PACKETS`): their counts added to the per-service counters, and the
//! slots of ids no longer bound freed for a later owner.

use std::{collections::BTreeMap, path::Path};

use aya::maps::{Array, MapData, PerCpuArray};
use proxy_common::{PACKET_OWNERS, PacketCounts, SERVICE_PACKETS, ServiceStats, packet_tag};

use super::{batch_err, map_err, open_map};
use crate::datapath::{Bound, DatapathError, batch};

/// The owner tag of every slot (slot, tag), or `None` when the pins are an earlier
/// version's, without the slots (or, after an interrupted pinning, without either map).
fn owners(dir: &Path) -> Result<Option<Vec<(u32, u64)>>, DatapathError> {
    let path = dir.join(PACKET_OWNERS);
    if !path.exists() || !dir.join(SERVICE_PACKETS).exists() {
        return Ok(None);
    }
    let data = MapData::from_pin(&path).map_err(|e| map_err("open pinned", PACKET_OWNERS, e))?;
    batch::read_all::<u32, u64>(data.fd())
        .map(Some)
        .map_err(|e| batch_err("read", PACKET_OWNERS, e))
}

/// Adds the packets and bytes each owned slot counted to its owner's entry of `out`: the
/// CPUs' values whose tag is the owner's (another tag is an earlier owner's).
pub(super) fn add_packets(
    dir: &Path,
    out: &mut BTreeMap<u32, ServiceStats>,
) -> Result<(), DatapathError> {
    let Some(owners) = owners(dir)? else {
        return Ok(());
    };
    let (map, _) = open_map(dir, SERVICE_PACKETS)?;
    let counts: PerCpuArray<MapData, PacketCounts> =
        PerCpuArray::try_from(map).map_err(|e| map_err("open", SERVICE_PACKETS, e))?;
    for (slot, tag) in owners {
        let id = tag as u32;
        if id == 0 {
            continue;
        }
        let per_cpu = counts
            .get(&slot, 0)
            .map_err(|e| map_err("lookup", SERVICE_PACKETS, e))?;
        let (packets, bytes) = per_cpu
            .iter()
            .filter(|c| c.tag == tag)
            .fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes));
        if packets != 0 || bytes != 0 {
            let e = out.entry(id).or_default();
            e.packets += packets;
            e.bytes += bytes;
        }
    }
    Ok(())
}

/// Frees the slots whose owner is no longer bound, each with the next generation (the
/// programs only claim free slots, so none of them writes an owner this changes). Returns
/// how many.
pub(super) fn free_released(dir: &Path, bound: &Bound<'_>) -> Result<usize, DatapathError> {
    let Some(owners) = owners(dir)? else {
        return Ok(0);
    };
    let released: Vec<(u32, u64)> = owners
        .into_iter()
        .filter(|(_, tag)| *tag as u32 != 0 && !(bound.service)(*tag as u32))
        .collect();
    if released.is_empty() {
        return Ok(0);
    }
    let (map, _) = open_map(dir, PACKET_OWNERS)?;
    let mut a: Array<MapData, u64> =
        Array::try_from(map).map_err(|e| map_err("open", PACKET_OWNERS, e))?;
    for (slot, tag) in &released {
        let next = packet_tag(0, ((tag >> 32) as u32).wrapping_add(1));
        a.set(*slot, next, 0)
            .map_err(|e| map_err("update", PACKET_OWNERS, e))?;
    }
    Ok(released.len())
}
