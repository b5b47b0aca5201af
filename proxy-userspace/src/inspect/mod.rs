//! Inspection of the pinned data path (`ebpf-proxy services`, `affinity`, `backends`,
//! `stats`, `conntrack`, and `explain` in its own module): reads the maps only
//! ([`PinnedView`]), so it works while the agent is down, and prints aligned tables or JSON.

use anyhow::Result;
use proxy_common::{
    Algorithm, FRONTEND_F_EXTERNAL, FRONTEND_F_LOCAL_ONLY, FRONTEND_F_VIP_MARKER, SCOPE_INGRESS,
};
use serde::Serialize;

use crate::datapath::{
    Snapshot,
    addr::{bytes_to_ip, proto_name, to_socket_addr},
    tc::monotonic_ns,
    view::PinnedView,
};

mod explain;

pub use explain::{desired_snapshot, explain, print_explanation, workload_paths};

/// Prints `rows` under `header` with columns padded to their widest cell (the last column is
/// not padded).
pub(crate) fn print_table(header: &[&str], rows: &[Vec<String>]) {
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

/// Prints `rows` as pretty JSON, or as a table of `cells(row)` under `header`.
fn print_rows<R: Serialize>(
    rows: &[R],
    json: bool,
    header: &[&str],
    cells: impl Fn(&R) -> Vec<String>,
) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(rows)?);
        return Ok(());
    }
    let table: Vec<Vec<String>> = rows.iter().map(cells).collect();
    print_table(header, &table);
    Ok(())
}

/// "-" for an empty string.
fn or_dash(s: String) -> String {
    if s.is_empty() { "-".into() } else { s }
}

/// One frontend of `ebpf-proxy services`.
#[derive(Debug, Serialize)]
pub struct ServiceRow {
    /// `SERVICE_NAMES` name of the backend set (`ns/name:port/PROTO/family[/scope]`).
    pub(crate) service: String,
    /// Frontend address:port.
    pub(crate) frontend: String,
    /// TCP or UDP.
    pub(crate) protocol: &'static str,
    /// Who the frontend serves: `node` (socket programs) or `ingress` (tc programs).
    pub(crate) scope: &'static str,
    /// Service id.
    pub(crate) service_id: u32,
    /// Selection algorithm name.
    pub(crate) algorithm: &'static str,
    /// ClientIP affinity timeout in seconds, 0 without affinity.
    pub(crate) affinity_timeout_s: u32,
    /// `local-only`, `external`, `no-endpoints` (a Local policy without endpoints on any node).
    pub(crate) flags: Vec<&'static str>,
    /// Backends in slot order (repeated by weight for weighted round-robin).
    pub(crate) backends: Vec<String>,
}

/// The frontends of the maps, sorted by service then frontend.
pub(crate) fn service_rows(snap: &Snapshot) -> Vec<ServiceRow> {
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
        if f.flags & proxy_common::FRONTEND_F_NO_ENDPOINTS != 0 {
            flags.push("no-endpoints");
        }
        if f.flags & proxy_common::FRONTEND_F_DSR != 0 {
            flags.push("dsr");
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
pub fn print_services(view: &PinnedView, json: bool) -> Result<()> {
    let rows = service_rows(&view.snapshot()?);
    let header = [
        "SERVICE",
        "FRONTEND",
        "PROTO",
        "SCOPE",
        "ID",
        "ALGORITHM",
        "AFFINITY",
        "FLAGS",
        "BACKENDS",
    ];
    print_rows(&rows, json, &header, |r| {
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
            or_dash(r.flags.join(",")),
            if r.backends.is_empty() {
                "<none>".to_string()
            } else {
                r.backends.join(",")
            },
        ]
    })
}

/// One entry of `ebpf-proxy affinity`.
#[derive(Debug, Serialize)]
pub(crate) struct AffinityRow {
    /// Name of the Service port (its cluster IP set) the entry belongs to.
    pub(crate) service: String,
    /// Client IP, or `netns:<cookie>` for sockets without a bound address.
    pub(crate) client: String,
    /// Backend address:port the client sticks to.
    pub(crate) backend: String,
    /// Seconds since the client's last new connection.
    pub(crate) age_s: f64,
    /// Seconds until the entry expires (negative: expired, kept until the LRU drops it),
    /// when the frontend's timeout is known.
    pub(crate) expires_in_s: Option<f64>,
}

/// The affinity entries of the pinned data path, sorted by service and client.
pub(crate) fn affinity_rows(view: &PinnedView, snap: &Snapshot) -> Result<Vec<AffinityRow>> {
    let entries = view.affinity()?;
    let now = monotonic_ns();
    let timeout_of = |group: u32| {
        snap.frontends
            .values()
            .find(|f| f.affinity_group == group && f.affinity_timeout_s != 0)
            .map(|f| f.affinity_timeout_s)
    };
    let mut rows = Vec::new();
    for (k, v) in entries {
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
pub fn print_affinity(view: &PinnedView, json: bool) -> Result<()> {
    let rows = affinity_rows(view, &view.snapshot()?)?;
    let header = ["SERVICE", "CLIENT", "BACKEND", "AGE", "EXPIRES IN"];
    print_rows(&rows, json, &header, |r| {
        vec![
            r.service.clone(),
            r.client.clone(),
            r.backend.clone(),
            format!("{:.1}s", r.age_s),
            match r.expires_in_s {
                Some(e) if e > 0.0 => format!("{e:.1}s"),
                Some(_) => "expired".into(),
                None => "-".into(),
            },
        ]
    })
}

/// One backend of `ebpf-proxy backends`.
#[derive(Debug, Serialize)]
pub(crate) struct BackendRow {
    /// Backend id.
    pub(crate) id: u32,
    /// address:port.
    pub(crate) backend: String,
    /// TCP or UDP.
    pub(crate) protocol: &'static str,
    /// Names of the service ids whose slots hold it.
    pub(crate) services: Vec<String>,
    /// Connections and new flows sent to it (per-CPU counters summed).
    pub(crate) connections: u64,
    /// Open connections counted for least-connections (0 when the algorithm is not used).
    pub(crate) active: u32,
}

/// The backends of the maps with their services and counters.
pub(crate) fn backend_rows(view: &PinnedView, snap: &Snapshot) -> Result<Vec<BackendRow>> {
    let stats = view.backend_stats().unwrap_or_default();
    let active = view.lc_counts().unwrap_or_default();
    let mut services: std::collections::BTreeMap<u32, std::collections::BTreeSet<String>> =
        Default::default();
    for (k, bid) in &snap.slots {
        if let Some(n) = snap.names.get(&k.service_id) {
            services.entry(*bid).or_default().insert(n.clone());
        }
    }
    Ok(snap
        .backends
        .iter()
        .map(|(id, b)| BackendRow {
            id: *id,
            backend: to_socket_addr(b.addr, b.port).to_string(),
            protocol: proto_name(b.proto),
            services: services
                .get(id)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default(),
            connections: stats.get(id).copied().unwrap_or(0),
            active: active.get(id).copied().unwrap_or(0),
        })
        .collect())
}

/// Prints `ebpf-proxy backends`.
pub fn print_backends(view: &PinnedView, json: bool) -> Result<()> {
    let rows = backend_rows(view, &view.snapshot()?)?;
    let header = [
        "ID",
        "BACKEND",
        "PROTO",
        "CONNECTIONS",
        "ACTIVE",
        "SERVICES",
    ];
    print_rows(&rows, json, &header, |r| {
        vec![
            r.id.to_string(),
            r.backend.clone(),
            r.protocol.to_string(),
            r.connections.to_string(),
            r.active.to_string(),
            or_dash(r.services.join(",")),
        ]
    })
}

/// One service id of `ebpf-proxy stats`.
#[derive(Debug, Serialize)]
pub(crate) struct StatsRow {
    /// Service id.
    pub(crate) service_id: u32,
    /// Its name.
    pub(crate) service: String,
    /// Connections and new UDP flows translated.
    pub(crate) connections: u64,
    /// Refused or dropped for lack of (local) endpoints.
    pub(crate) refused: u64,
    /// Packets translated by the tc path.
    pub(crate) packets: u64,
    /// Bytes of those packets.
    pub(crate) bytes: u64,
}

/// `ebpf-proxy stats` as data: per-service counters and the per-reason data path counters.
#[derive(Debug, Serialize)]
pub(crate) struct Stats {
    /// Per service id.
    pub(crate) services: Vec<StatsRow>,
    /// Per reason (`proxy_common::Counter` names), summed over CPUs.
    pub(crate) reasons: std::collections::BTreeMap<&'static str, u64>,
    /// Per reason of the tc path (`proxy_common::nat::TcCounter` names).
    pub(crate) tc_reasons: std::collections::BTreeMap<&'static str, u64>,
}

/// Reads the counters of the pinned data path.
pub(crate) fn stats(view: &PinnedView, snap: &Snapshot) -> Result<Stats> {
    let per = view.service_stats()?;
    let services = per
        .iter()
        .map(|(id, st)| StatsRow {
            service_id: *id,
            service: snap.names.get(id).cloned().unwrap_or_else(|| "?".into()),
            connections: st.connections,
            refused: st.refused,
            packets: st.packets,
            bytes: st.bytes,
        })
        .collect();
    let values = view.counters()?;
    let reasons = proxy_common::Counter::ALL
        .iter()
        .map(|(c, n)| (*n, values.get(*c as usize).copied().unwrap_or(0)))
        .collect();
    let tc = view.tc_counters().unwrap_or_default();
    let tc_reasons = proxy_common::nat::TcCounter::ALL
        .iter()
        .map(|(c, n)| (*n, tc.get(*c as usize).copied().unwrap_or(0)))
        .collect();
    Ok(Stats {
        services,
        reasons,
        tc_reasons,
    })
}

/// Prints `ebpf-proxy stats`.
pub fn print_stats(view: &PinnedView, json: bool) -> Result<()> {
    let s = stats(view, &view.snapshot()?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    let table: Vec<Vec<String>> = s
        .services
        .iter()
        .map(|r| {
            vec![
                r.service.clone(),
                r.service_id.to_string(),
                r.connections.to_string(),
                r.refused.to_string(),
                r.packets.to_string(),
                r.bytes.to_string(),
            ]
        })
        .collect();
    print_table(
        &[
            "SERVICE",
            "ID",
            "CONNECTIONS",
            "REFUSED",
            "PACKETS",
            "BYTES",
        ],
        &table,
    );
    println!();
    let meaning = |n: &str| {
        proxy_common::Counter::ALL
            .iter()
            .find(|(_, name)| *name == n)
            .map(|(c, _)| c.meaning())
            .or_else(|| {
                proxy_common::nat::TcCounter::ALL
                    .iter()
                    .find(|(_, name)| *name == n)
                    .map(|(c, _)| c.meaning())
            })
            .unwrap_or("")
    };
    let rows = |m: &std::collections::BTreeMap<&'static str, u64>| -> Vec<Vec<String>> {
        m.iter()
            .map(|(n, v)| vec![n.to_string(), v.to_string(), meaning(n).to_string()])
            .collect()
    };
    print_table(&["REASON", "COUNT", "MEANING"], &rows(&s.reasons));
    println!();
    print_table(&["TC REASON", "COUNT", "MEANING"], &rows(&s.tc_reasons));
    Ok(())
}

/// One socket-level translation of `ebpf-proxy conntrack`: a connected socket or an
/// unconnected UDP flow.
#[derive(Debug, Serialize)]
pub(crate) struct ConntrackRow {
    /// `connected` (TCP connection or connected UDP socket, from `SOCK_NAT` or `REVNAT_SK`)
    /// or `udp-flow` (from `UDP_FLOWS`).
    pub(crate) kind: &'static str,
    /// Socket cookie.
    pub(crate) cookie: u64,
    /// TCP or UDP.
    pub(crate) protocol: &'static str,
    /// Frontend address:port the socket addressed.
    pub(crate) frontend: String,
    /// Backend address:port it was translated to.
    pub(crate) backend: String,
    /// Service id name.
    pub(crate) service: String,
    /// Seconds since the flow's last datagram (UDP flows only).
    pub(crate) idle_s: Option<f64>,
    /// Whether the socket's endpoint left and its sends fail until it reconnects.
    pub(crate) stale: bool,
}

/// The socket-level translations of the pinned data path (the socket programs' equivalent
/// of a conntrack table).
pub(crate) fn conntrack_rows(view: &PinnedView, snap: &Snapshot) -> Result<Vec<ConntrackRow>> {
    let stale = view.stale_sockets()?;
    let name = |id: u32| snap.names.get(&id).cloned().unwrap_or_else(|| "?".into());
    let mut rows = Vec::new();
    view.for_each_connected(|k, v| {
        rows.push(ConntrackRow {
            kind: "connected",
            cookie: k.cookie,
            protocol: proto_name(v.proto),
            frontend: to_socket_addr(v.addr, v.port).to_string(),
            backend: to_socket_addr(k.addr, k.port).to_string(),
            service: name(v.service_id),
            idle_s: None,
            stale: stale.contains(k.cookie),
        })
    })?;
    let now = monotonic_ns();
    for (k, f) in view.udp_flows()? {
        let backend = snap
            .backends
            .get(&f.backend_id)
            .map(|b| to_socket_addr(b.addr, b.port).to_string())
            .unwrap_or_else(|| format!("<backend {} removed>", f.backend_id));
        rows.push(ConntrackRow {
            kind: "udp-flow",
            cookie: k.cookie,
            protocol: "UDP",
            frontend: to_socket_addr(k.addr, k.port).to_string(),
            backend,
            service: name(f.service_id),
            idle_s: Some(now.saturating_sub(f.last_seen_ns) as f64 / 1e9),
            stale: false,
        });
    }
    rows.sort_by(|a, b| (a.kind, a.cookie, &a.frontend).cmp(&(b.kind, b.cookie, &b.frontend)));
    Ok(rows)
}

/// Prints `ebpf-proxy conntrack`.
pub fn print_conntrack(view: &PinnedView, json: bool) -> Result<()> {
    let rows = conntrack_rows(view, &view.snapshot()?)?;
    let header = [
        "KIND", "COOKIE", "PROTO", "FRONTEND", "BACKEND", "IDLE", "STATE", "SERVICE",
    ];
    print_rows(&rows, json, &header, |r| {
        vec![
            r.kind.to_string(),
            r.cookie.to_string(),
            r.protocol.to_string(),
            r.frontend.clone(),
            r.backend.clone(),
            r.idle_s
                .map(|s| format!("{s:.1}s"))
                .unwrap_or_else(|| "-".into()),
            if r.stale { "stale" } else { "-" }.to_string(),
            r.service.clone(),
        ]
    })
}
