//! Loading the embedded object: its maps sized from the flags, created or adopted from the
//! pins (after the migrations of [`super::migrate`]), or, for `check`, every program
//! verified with small unpinned maps.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{Ebpf, EbpfLoader, programs::Program};
use proxy_common::{
    AFFINITY, BACKEND_SLOTS, BACKEND_STATS, BACKENDS, FRONTENDS, LC_COUNTS, MEMBERS, REVNAT_SK,
    RR_CURSORS, SERVICE_NAMES, SERVICE_STATS, SOCK_NAT, SOCK_NAT_OVERFLOW, SOCK_NAT_SLOT_MASK,
    SOCKETS, STALE_SOCKETS, STATS_CARRIED, UDP_FLOWS,
    nat::{CONNTRACK, LC_FLOWS},
    sock_nat_slots,
};

use super::{
    MapSizes, OBJECT,
    errors::{load_error, program_load_error},
    migrate, new_loader, pinned_maps,
};

/// The values [`set_sock_nat_slots`] points the global at: `2^k - 1` at index `k`.
static SOCK_NAT_SLOT_MASKS: [u64; 33] = {
    let mut m = [0u64; 33];
    let mut k = 0;
    while k < 33 {
        m[k] = (1u64 << k) - 1;
        k += 1;
    }
    m
};

/// Sets the size of `SOCK_NAT` (a power of two, see [`proxy_common::sock_nat_slots`])
/// and the programs' slot mask to match; `slots` that is no power of two gets the mask of
/// the largest power of two below it, so every index stays inside the map.
pub(super) fn set_sock_nat_slots(loader: &mut EbpfLoader<'_>, slots: u32) {
    let slots = slots.max(1);
    let k = 31 - slots.leading_zeros() as usize;
    loader.map_max_entries(SOCK_NAT, slots).override_global(
        SOCK_NAT_SLOT_MASK,
        &SOCK_NAT_SLOT_MASKS[k],
        true,
    );
}

/// A loader for the embedded object with the given map sizes.
fn object_loader(sizes: MapSizes) -> EbpfLoader<'static> {
    let mut loader = new_loader();
    set_sock_nat_slots(&mut loader, sock_nat_slots(sizes.sockets));
    loader
        .map_max_entries(SOCK_NAT_OVERFLOW, (sizes.sockets / 4).max(1))
        .map_max_entries(FRONTENDS, sizes.frontends)
        .map_max_entries(SERVICE_NAMES, sizes.frontends)
        .map_max_entries(BACKEND_SLOTS, sizes.slots)
        .map_max_entries(BACKENDS, sizes.backends)
        .map_max_entries(REVNAT_SK, sizes.sockets)
        .map_max_entries(UDP_FLOWS, sizes.sockets)
        .map_max_entries(SOCKETS, sizes.sockets)
        // Only some sockets need these (stale UDP sockets, clients of affinity Services): a
        // quarter of --max-sockets, LRU beyond that.
        .map_max_entries(STALE_SOCKETS, (sizes.sockets / 4).max(1))
        .map_max_entries(AFFINITY, (sizes.sockets / 4).max(1))
        .map_max_entries(MEMBERS, sizes.slots)
        .map_max_entries(LC_COUNTS, sizes.backends)
        .map_max_entries(RR_CURSORS, sizes.frontends)
        .map_max_entries(SERVICE_STATS, sizes.frontends)
        // The (service, backend) pairs in use are at most the slots; the counts carried
        // from pairs no longer in use, one per bound service or backend. Neither map is
        // preallocated, but their buckets are allocated at creation: 16 bytes each, their
        // number the size rounded up to a power of two (4 MiB each at the default sizes).
        .map_max_entries(BACKEND_STATS, sizes.slots)
        .map_max_entries(
            STATS_CARRIED,
            sizes.frontends.saturating_add(sizes.backends),
        )
        .map_max_entries(CONNTRACK, sizes.conntrack_entries())
        .map_max_entries(LC_FLOWS, sizes.conntrack_flows.max(1));
    loader
}

/// Loads every program of the embedded object into the kernel, with small maps that are not
/// pinned, attaches nothing, and unloads everything again: the preflight of `check` for the
/// attach types (each program of a cgroup `sock_addr` section is loaded with the expected
/// attach type its section names, e.g. `connect4`) and the verifier. Returns the names of
/// the programs, with the program type when it is not cgroup `sock_addr`.
///
/// Errors name the step (load, verify) as `load_and_attach` does.
pub fn verify_programs() -> Result<Vec<String>> {
    if OBJECT.is_empty() {
        bail!("this binary was built without the eBPF object; build it with `cargo xtask build`");
    }
    let small = MapSizes {
        frontends: 64,
        slots: 64,
        backends: 64,
        sockets: 64,
        conntrack_flows: 64,
    };
    let mut ebpf = object_loader(small)
        .load(OBJECT)
        .map_err(|e| load_error(e, false))?;
    let mut names: Vec<String> = ebpf.programs().map(|(n, _)| n.to_string()).collect();
    names.sort();
    let mut loaded = Vec::new();
    for name in names {
        let Some(program) = ebpf.program_mut(&name) else {
            continue;
        };
        match program {
            Program::CgroupSockAddr(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(name);
            }
            Program::SchedClassifier(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(format!("{name} (sched_cls)"));
            }
            Program::CgroupSkb(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(format!("{name} (cgroup_skb)"));
            }
            Program::CgroupSock(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(format!("{name} (cgroup_sock)"));
            }
            Program::Xdp(p) => {
                p.load().map_err(|e| program_load_error(&name, e))?;
                loaded.push(format!("{name} (xdp)"));
            }
            other => {
                let t = other.prog_type();
                loaded.push(format!("{name} ({t:?}, not loaded by the check)"));
            }
        }
    }
    Ok(loaded)
}

/// Loads the embedded object with its maps pinned under `dir`: maps pinned by an earlier run
/// are adopted (those whose layout differs from this build's are created anew, with a
/// warning), the others created with `sizes` and pinned. No program is loaded into the
/// kernel or attached; the caller picks them from the returned object.
///
/// Errors name the step (load, pin) and a remedy.
pub fn load_pinned(dir: &Path, sizes: MapSizes) -> Result<Ebpf> {
    if OBJECT.is_empty() {
        bail!("this binary was built without the eBPF object; build it with `cargo xtask build`");
    }
    fs::create_dir_all(dir)
        .with_context(|| format!("pin: create pin directory {}", dir.display()))?;
    let pins: Vec<(&str, PathBuf)> = pinned_maps().map(|m| (m, dir.join(m))).collect();
    let migration = migrate::before_load(dir)?;
    let mut loader = object_loader(sizes);
    // Carried counts created next to adopted maps have room for every id those can bind.
    if !dir.join(STATS_CARRIED).exists()
        && let (Ok(names), Ok(backends)) = (
            aya::maps::MapInfo::from_pin(dir.join(SERVICE_NAMES)),
            aya::maps::MapInfo::from_pin(dir.join(BACKENDS)),
        )
    {
        loader.map_max_entries(
            STATS_CARRIED,
            names.max_entries().saturating_add(backends.max_entries()),
        );
    }
    migration.size_carried_slots(dir, &mut loader);
    // An adopted `SOCK_NAT` keeps its size: the programs' mask must follow it.
    if let Ok(info) = aya::maps::MapInfo::from_pin(dir.join(SOCK_NAT)) {
        set_sock_nat_slots(&mut loader, info.max_entries());
    }
    for (name, path) in &pins {
        loader.map_pin_path(name, path.as_path());
    }
    let ebpf = loader.load(OBJECT).map_err(|e| load_error(e, true))?;
    migration.after_load(dir)?;
    Ok(ebpf)
}
