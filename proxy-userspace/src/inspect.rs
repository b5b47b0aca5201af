//! Inspection of the pinned data path (`ebpf-proxy services`, `affinity`): reads the maps
//! only, so it works while the agent is down, and prints aligned tables or JSON.

use std::path::Path;

use anyhow::{Context, Result};
use aya::maps::{HashMap, Map, MapData};
use proxy_common::{
    AFFINITY, AffinityKey, AffinityValue, Algorithm, FRONTEND_F_EXTERNAL, FRONTEND_F_LOCAL_ONLY,
    FRONTEND_F_VIP_MARKER, SCOPE_INGRESS,
};
use serde::Serialize;

use crate::datapath::{
    Datapath, Snapshot,
    addr::{bytes_to_ip, proto_name, to_socket_addr},
    maps::PinnedMaps,
};

/// Prints `rows` under `header` with columns padded to their widest cell (the last column is
/// not padded).
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let n = cells.len();
        let mut s = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            if i + 1 == n {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(header.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
}

/// One frontend of `ebpf-proxy services`.
#[derive(Debug, Serialize)]
pub struct ServiceRow {
    /// `SERVICE_NAMES` name of the backend set (`ns/name:port/PROTO/family[/scope]`).
    pub service: String,
    /// Frontend address:port.
    pub frontend: String,
    /// TCP or UDP.
    pub protocol: &'static str,
    /// Who the frontend serves: `node` (socket programs) or `ingress` (tc programs).
    pub scope: &'static str,
    /// Service id.
    pub service_id: u32,
    /// Selection algorithm name.
    pub algorithm: &'static str,
    /// ClientIP affinity timeout in seconds, 0 without affinity.
    pub affinity_timeout_s: u32,
    /// `local-only` and/or `external`.
    pub flags: Vec<&'static str>,
    /// Backends in slot order (repeated by weight for weighted round-robin).
    pub backends: Vec<String>,
}

/// The frontends of the maps, sorted by service then frontend.
pub fn service_rows(snap: &Snapshot) -> Vec<ServiceRow> {
    let mut rows = Vec::new();
    for (k, f) in &snap.frontends {
        if f.flags & FRONTEND_F_VIP_MARKER != 0 {
            continue;
        }
        let backends = (0..f.backend_count)
            .map(|slot| {
                let key = proxy_common::BackendSlotKey {
                    service_id: f.service_id,
                    slot,
                };
                match snap.slots.get(&key).and_then(|id| snap.backends.get(id)) {
                    Some(b) => to_socket_addr(b.addr, b.port).to_string(),
                    None => "<missing>".to_string(),
                }
            })
            .collect();
        let mut flags = Vec::new();
        if f.flags & FRONTEND_F_LOCAL_ONLY != 0 {
            flags.push("local-only");
        }
        if f.flags & FRONTEND_F_EXTERNAL != 0 {
            flags.push("external");
        }
        rows.push(ServiceRow {
            service: snap
                .names
                .get(&f.service_id)
                .cloned()
                .unwrap_or_else(|| "?".into()),
            frontend: to_socket_addr(k.addr, k.port).to_string(),
            protocol: proto_name(k.proto),
            scope: if k.scope == SCOPE_INGRESS {
                "ingress"
            } else {
                "node"
            },
            service_id: f.service_id,
            algorithm: Algorithm::from_u8(f.algorithm).map_or("?", Algorithm::name),
            affinity_timeout_s: f.affinity_timeout_s,
            flags,
            backends,
        });
    }
    rows.sort_by(|a, b| (&a.service, &a.frontend).cmp(&(&b.service, &b.frontend)));
    rows
}

/// Prints `ebpf-proxy services`.
pub fn print_services(maps: &PinnedMaps, json: bool) -> Result<()> {
    let rows = service_rows(&maps.snapshot()?);
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.service.clone(),
                r.frontend.clone(),
                r.protocol.to_string(),
                r.scope.to_string(),
                r.service_id.to_string(),
                r.algorithm.to_string(),
                if r.affinity_timeout_s == 0 {
                    "-".into()
                } else {
                    format!("ClientIP/{}s", r.affinity_timeout_s)
                },
                if r.flags.is_empty() {
                    "-".into()
                } else {
                    r.flags.join(",")
                },
                if r.backends.is_empty() {
                    "<none>".to_string()
                } else {
                    r.backends.join(",")
                },
            ]
        })
        .collect();
    print_table(
        &[
            "SERVICE",
            "FRONTEND",
            "PROTO",
            "SCOPE",
            "ID",
            "ALGORITHM",
            "AFFINITY",
            "FLAGS",
            "BACKENDS",
        ],
        &table,
    );
    Ok(())
}

/// One entry of `ebpf-proxy affinity`.
#[derive(Debug, Serialize)]
pub struct AffinityRow {
    /// Name of the Service port (its cluster IP set) the entry belongs to.
    pub service: String,
    /// Client IP, or `netns:<cookie>` for sockets without a bound address.
    pub client: String,
    /// Backend address:port the client sticks to.
    pub backend: String,
    /// Seconds since the client's last new connection.
    pub age_s: f64,
    /// Seconds until the entry expires (negative: expired, kept until the LRU drops it),
    /// when the frontend's timeout is known.
    pub expires_in_s: Option<f64>,
}

/// Nanoseconds of CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    // SAFETY: clock_gettime(2) into a zeroed struct we own.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The affinity entries of the pin directory `dir`, sorted by service and client.
pub fn affinity_rows(dir: &Path, snap: &Snapshot) -> Result<Vec<AffinityRow>> {
    let path = dir.join(AFFINITY);
    let data = MapData::from_pin(&path).with_context(|| format!("open {}", path.display()))?;
    let map: HashMap<MapData, AffinityKey, AffinityValue> =
        HashMap::try_from(Map::LruHashMap(data)).context("open AFFINITY")?;
    let now = monotonic_ns();
    let timeout_of = |group: u32| {
        snap.frontends
            .values()
            .find(|f| f.affinity_group == group && f.affinity_timeout_s != 0)
            .map(|f| f.affinity_timeout_s)
    };
    let mut rows = Vec::new();
    for kv in map.iter() {
        let (k, v) = kv.context("iterate AFFINITY")?;
        let client = if k.client[..8] == proxy_common::client_of_netns(0)[..8] {
            let mut c = [0u8; 8];
            c.copy_from_slice(&k.client[8..]);
            format!("netns:{}", u64::from_le_bytes(c))
        } else {
            bytes_to_ip(k.client).to_string()
        };
        let backend = snap
            .backends
            .get(&v.backend_id)
            .map(|b| to_socket_addr(b.addr, b.port).to_string())
            .unwrap_or_else(|| format!("<backend {} removed>", v.backend_id));
        let age_s = now.saturating_sub(v.last_used_ns) as f64 / 1e9;
        rows.push(AffinityRow {
            service: snap
                .names
                .get(&k.group)
                .cloned()
                .unwrap_or_else(|| format!("group {}", k.group)),
            client,
            backend,
            age_s,
            expires_in_s: timeout_of(k.group).map(|t| t as f64 - age_s),
        });
    }
    rows.sort_by(|a, b| (&a.service, &a.client).cmp(&(&b.service, &b.client)));
    Ok(rows)
}

/// Prints `ebpf-proxy affinity`.
pub fn print_affinity(dir: &Path, maps: &PinnedMaps, json: bool) -> Result<()> {
    let rows = affinity_rows(dir, &maps.snapshot()?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.service.clone(),
                r.client.clone(),
                r.backend.clone(),
                format!("{:.1}s", r.age_s),
                r.expires_in_s
                    .map(|e| {
                        if e > 0.0 {
                            format!("{e:.1}s")
                        } else {
                            "expired".into()
                        }
                    })
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    print_table(
        &["SERVICE", "CLIENT", "BACKEND", "AGE", "EXPIRES IN"],
        &table,
    );
    Ok(())
}
