//! `ebpf-proxy cleanup`: the north-south flows drained, then every link and map pin
//! removed, the programs that start translations first.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{maps::Map, programs::links::PinnedLink};
use proxy_common::nat::CONNTRACK;

use super::{pinned_maps, pins::is_on_bpffs};
use crate::datapath::clock::monotonic_ns;

/// Everything `cleanup` removed.
#[derive(Debug, Default)]
pub struct CleanupReport {
    /// Link pins removed (each detached its program).
    pub links: Vec<PathBuf>,
    /// Map pins removed.
    pub maps: Vec<PathBuf>,
    /// Whether the pin directory itself was removed.
    pub dir_removed: bool,
    /// How long the north-south flows were drained before the programs went (`None`: no
    /// packet programs were attached).
    pub drained: Option<std::time::Duration>,
}

/// Longest wait of [`cleanup`] for the north-south flows open at that moment.
pub const DRAIN_MAX: std::time::Duration = std::time::Duration::from_secs(3);

/// A flow whose last packet is older than this counts as idle for the drain.
const DRAIN_IDLE_NS: u64 = 500_000_000;

/// Drains the north-south flows of the pins under `dir` before their programs go: sets
/// `TC_CFG_DRAIN` (no new flow starts: a first packet goes to the kernel, where the rules
/// of the proxy taking over, kube-proxy's on a rollback, translate it), then waits until no
/// tracked flow that is still open saw a packet in the last 0.5 s, at most [`DRAIN_MAX`].
/// Without the drain, a connection in flight when the programs go would have its next
/// packet translated anew by those rules, to a backend that does not know it, and be reset.
/// Returns how long it waited; `None` when the maps cannot be opened.
fn drain_flows(dir: &Path) -> Option<std::time::Duration> {
    use aya::maps::{Array, HashMap, MapData};
    use proxy_common::nat::{
        CT_F_EGRESS, CtEntry, CtKey, TC_CFG_DRAIN, TC_CONFIG, TcConfig, ct_closed,
    };
    let open = |name: &str| {
        MapData::from_pin(dir.join(name))
            .ok()
            .and_then(|d| Map::from_map_data(d).ok())
    };
    let mut cfg: Array<MapData, TcConfig> = open(TC_CONFIG)?.try_into().ok()?;
    let mut c = cfg.get(&0, 0).ok()?;
    c.flags |= TC_CFG_DRAIN;
    cfg.set(0, c, 0).ok()?;
    let ct: HashMap<MapData, CtKey, CtEntry> = open(CONNTRACK)?.try_into().ok()?;
    let start = std::time::Instant::now();
    while start.elapsed() < DRAIN_MAX {
        let now = monotonic_ns();
        let busy = ct.iter().filter_map(|kv| kv.ok()).any(|(_, e)| {
            e.flags & CT_F_EGRESS == 0
                && !ct_closed(e.flags)
                && now.saturating_sub(e.last_seen_ns) < DRAIN_IDLE_NS
        });
        if !busy {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Some(start.elapsed())
}

/// Detaches the programs (by removing their pinned links) and removes the pinned maps and the
/// pin directory. Missing pieces are not errors, so it can run on a half-cleaned node.
pub fn cleanup(dir: &Path) -> Result<CleanupReport> {
    let mut r = CleanupReport::default();
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(r);
    };
    // Only pins are removed: a directory elsewhere (a mistyped --bpffs) is left alone.
    if !is_on_bpffs(dir) {
        bail!(
            "{} is not on a BPF file system: nothing ebpf-proxy pinned can be there, nothing removed (check --bpffs)",
            dir.display()
        );
    }
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    let packet_programs = files.iter().any(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("link_tc_") || n.starts_with("link_xdp_"))
    });
    if packet_programs {
        r.drained = drain_flows(dir);
    }
    // The programs that start translations (connect, sendmsg, tc ingress) go first, those
    // that reverse them (recvmsg, getpeername, tc egress, ...) last: a connection in its
    // handshake at that moment is then either not translated at all or has its replies
    // reversed, instead of a SYN-ACK leaving with the backend's address.
    files.sort_by_key(|p| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let starts = ["connect4", "connect6", "sendmsg4", "sendmsg6", "tc_ingress"]
            .iter()
            .any(|prog| name.contains(prog));
        (!starts, p.clone())
    });
    for path in files {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if name.starts_with("link_") || name.starts_with("next_") {
            match PinnedLink::from_pin(&path) {
                Ok(l) => drop(l.unpin()),
                Err(_) => drop(fs::remove_file(&path)),
            }
            r.links.push(path);
        } else if pinned_maps().any(|m| m == name) {
            fs::remove_file(&path).with_context(|| format!("remove {}", path.display()))?;
            r.maps.push(path);
        }
    }
    r.dir_removed = fs::remove_dir(dir).is_ok();
    Ok(r)
}
