//! The kernel's own statistics of ebpf-proxy's programs: run count and run time of every
//! program attached through the agent's pinned links, while `BPF_ENABLE_STATS` is on (the
//! file descriptor it returns keeps the statistics on; closing it turns them off, so
//! nothing is left enabled after the bench).

use std::{collections::BTreeMap, fs, os::fd::OwnedFd, path::Path};

use anyhow::{Context, Result};
use aya::{
    programs::{links::FdLink, links::PinnedLink, loaded_programs},
    sys::{Stats, enable_stats},
};

/// The programs measured, in report order: (program name, what it is).
pub const PROGRAMS: [(&str, &str); 12] = [
    ("connect4", "connect() of IPv4 sockets"),
    ("connect6", "connect() of IPv6 sockets"),
    ("sendmsg4", "sendmsg() of unconnected IPv4 UDP"),
    ("sendmsg6", "sendmsg() of unconnected IPv6 UDP"),
    ("recvmsg4", "recvmsg() of IPv4 UDP"),
    ("recvmsg6", "recvmsg() of IPv6 UDP"),
    ("getpeername4", "getpeername() of IPv4 sockets"),
    ("getpeername6", "getpeername() of IPv6 sockets"),
    ("sock_release", "release of every socket"),
    (
        "sock_egress",
        "cgroup skb egress: every packet of every socket",
    ),
    ("tc_ingress", "tcx ingress: every packet entering"),
    ("tc_egress", "tcx egress: every packet leaving"),
];

/// Turns the statistics on while the returned descriptor lives.
pub fn enable() -> Result<OwnedFd> {
    enable_stats(Stats::RunTime).context("BPF_ENABLE_STATS (needs Linux >= 5.8 and CAP_SYS_ADMIN)")
}

/// Program name -> program id of the programs attached through the `link_*` pins under
/// `dir` (a program attached to several interfaces is one program).
pub fn attached(dir: &Path) -> BTreeMap<String, u32> {
    let mut ids = BTreeMap::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return ids;
    };
    let mut by_id = BTreeMap::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("link_") {
            continue;
        }
        // Dropping the link closes our descriptor only; the pin keeps it attached.
        let Ok(link) = PinnedLink::from_pin(e.path()) else {
            continue;
        };
        let link: FdLink = link.into();
        if let Ok(info) = link.info() {
            by_id.insert(info.program_id(), ());
        }
    }
    for p in loaded_programs().flatten() {
        if by_id.contains_key(&p.id())
            && let Some(n) = p.name_as_str()
        {
            ids.insert(n.to_string(), p.id());
        }
    }
    ids
}

/// Run count and run time (ns) of each program in `ids`, now.
pub fn snapshot(ids: &BTreeMap<String, u32>) -> BTreeMap<String, (u64, u64)> {
    let mut out = BTreeMap::new();
    for p in loaded_programs().flatten() {
        if let Some((name, _)) = ids.iter().find(|(_, id)| **id == p.id()) {
            out.insert(
                name.clone(),
                (p.run_count(), p.run_time().as_nanos() as u64),
            );
        }
    }
    out
}

/// One program's cost over a measured interval.
#[derive(Clone, Debug, Default)]
pub struct Cost {
    /// Invocations.
    pub runs: u64,
    /// Time in the program, nanoseconds.
    pub ns: u64,
}

/// The costs between two snapshots, by program name (programs that did not run included,
/// with zero).
pub fn delta(
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
) -> BTreeMap<String, Cost> {
    after
        .iter()
        .map(|(name, (runs, ns))| {
            let (r0, n0) = before.get(name).copied().unwrap_or((0, 0));
            (
                name.clone(),
                Cost {
                    runs: runs.saturating_sub(r0),
                    ns: ns.saturating_sub(n0),
                },
            )
        })
        .collect()
}
