//! Inspection of the pinned data path (`ebpf-proxy services`, `affinity`): reads the maps
//! only ([`PinnedView`]), so it works while the agent is down, and prints aligned tables or
//! JSON.

use anyhow::{Context, Result};
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
    /// `local-only`, `external`, `no-endpoints` (a Local policy without endpoints on any node).
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

/// The affinity entries of the pinned data path, sorted by service and client.
pub fn affinity_rows(view: &PinnedView, snap: &Snapshot) -> Result<Vec<AffinityRow>> {
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
pub struct BackendRow {
    /// Backend id.
    pub id: u32,
    /// address:port.
    pub backend: String,
    /// TCP or UDP.
    pub protocol: &'static str,
    /// Names of the service ids whose slots hold it.
    pub services: Vec<String>,
    /// Connections and new flows sent to it (per-CPU counters summed).
    pub connections: u64,
    /// Open connections counted for least-connections (0 when the algorithm is not used).
    pub active: u32,
}

/// The backends of the maps with their services and counters.
pub fn backend_rows(view: &PinnedView, snap: &Snapshot) -> Result<Vec<BackendRow>> {
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
pub struct StatsRow {
    /// Service id.
    pub service_id: u32,
    /// Its name.
    pub service: String,
    /// Connections and new UDP flows translated.
    pub connections: u64,
    /// Refused or dropped for lack of (local) endpoints.
    pub refused: u64,
    /// Packets translated by the tc path.
    pub packets: u64,
    /// Bytes of those packets.
    pub bytes: u64,
}

/// `ebpf-proxy stats` as data: per-service counters and the per-reason data path counters.
#[derive(Debug, Serialize)]
pub struct Stats {
    /// Per service id.
    pub services: Vec<StatsRow>,
    /// Per reason (`proxy_common::Counter` names), summed over CPUs.
    pub reasons: std::collections::BTreeMap<&'static str, u64>,
    /// Per reason of the tc path (`proxy_common::nat::TcCounter` names).
    pub tc_reasons: std::collections::BTreeMap<&'static str, u64>,
}

/// Reads the counters of the pinned data path.
pub fn stats(view: &PinnedView, snap: &Snapshot) -> Result<Stats> {
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
pub struct ConntrackRow {
    /// `connected` (TCP connection or connected UDP socket, from `SOCK_NAT` or `REVNAT_SK`)
    /// or `udp-flow` (from `UDP_FLOWS`).
    pub kind: &'static str,
    /// Socket cookie.
    pub cookie: u64,
    /// TCP or UDP.
    pub protocol: &'static str,
    /// Frontend address:port the socket addressed.
    pub frontend: String,
    /// Backend address:port it was translated to.
    pub backend: String,
    /// Service id name.
    pub service: String,
    /// Seconds since the flow's last datagram (UDP flows only).
    pub idle_s: Option<f64>,
    /// Whether the socket's endpoint left and its sends fail until it reconnects.
    pub stale: bool,
}

/// The socket-level translations of the pinned data path (the socket programs' equivalent
/// of a conntrack table).
pub fn conntrack_rows(view: &PinnedView, snap: &Snapshot) -> Result<Vec<ConntrackRow>> {
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

/// One endpoint in `ebpf-proxy explain`.
#[derive(Debug, Serialize)]
pub struct ExplainedEndpoint {
    /// address:port.
    pub endpoint: String,
    /// Pod name (`targetRef.name`), "" when unknown.
    pub pod: String,
    /// Whether it is on this node.
    pub local: bool,
    /// Conditions.
    pub ready: bool,
    /// Conditions.
    pub serving: bool,
    /// Conditions.
    pub terminating: bool,
    /// Zone hints.
    pub zone_hints: Vec<String>,
    /// Whether this node's data path uses it for the frontend.
    pub eligible: bool,
    /// Why not, when not.
    pub reason: Option<String>,
}

/// One matching frontend in `ebpf-proxy explain`.
#[derive(Debug, Serialize)]
pub struct ExplainedFrontend {
    /// The frontend, as in `services`.
    pub frontend: ServiceRow,
    /// Connections and new flows translated through its service id.
    pub connections: u64,
    /// Refusals of its service id.
    pub refused: u64,
    /// Connections sent to each of its backends, from every Service using that backend.
    pub backend_connections: std::collections::BTreeMap<String, u64>,
    /// The Service's endpoints for this port and family with their eligibility, when a
    /// source (manifests or the API) was given.
    pub endpoints: Option<Vec<ExplainedEndpoint>>,
}

/// `ebpf-proxy explain ADDR:PORT/PROTO` as data.
#[derive(Debug, Serialize)]
pub struct Explanation {
    /// What was asked.
    pub target: String,
    /// Where the frontends were read: `pinned maps` (this node's data path), or `objects`
    /// (no data path is pinned here: what an agent would program for the objects given,
    /// counters all zero).
    pub from: &'static str,
    /// The node name assumed for Local traffic policies and topology, and where it came
    /// from (e.g. `worker-1 (--hostname-override)`).
    pub node: String,
    /// The frontends of that address, port and protocol (one per scope).
    pub frontends: Vec<ExplainedFrontend>,
    /// What happens to a connection from this node, in words.
    pub verdict: String,
    /// What happens to a packet to the address entering the node from outside (the tc
    /// path: node ports, external and LB IPs, a cluster IP routed to the node), in words.
    pub external_verdict: String,
    /// EndpointSlices in the namespace of the matching Services that are ignored because
    /// they lack the `kubernetes.io/service-name` label (`namespace/name`; with a source).
    pub ignored_slices: Vec<String>,
    /// With a source, what was skipped that bears on the target, one line per error as the
    /// agent logs it: errors of the matching Services and of their EndpointSlices (a skipped
    /// endpoint is missing from `endpoints`), and errors naming the target frontend (a
    /// Service that lost it to an older one). When the target is no frontend, every
    /// skipped Service instead (at most [`MAX_SKIPPED_SHOWN`], then a count), since one of
    /// them may be the Service that would have defined it.
    pub skipped: Vec<String>,
    /// Which path serves which workload of this node (see [`workload_paths`]).
    pub paths: Vec<String>,
}

/// The verdict for traffic entering the node (the tc programs' lookup, `lb::lookup` with
/// the ingress scope): the ingress frontend of the address, else a cluster IP's frontend
/// (not an external address), else nothing; with the backends, the Local policy and the
/// source ranges of the address (`ranges`: `None` when unrestricted).
pub fn external_verdict(
    frontends: &[ExplainedFrontend],
    ranges: Option<&[ipnet::IpNet]>,
) -> String {
    let ingress = frontends.iter().find(|f| f.frontend.scope == "ingress");
    let cluster_ip = frontends
        .iter()
        .find(|f| f.frontend.scope == "node" && !f.frontend.flags.contains(&"external"));
    let (f, what) = match (ingress, cluster_ip) {
        (Some(f), _) => (f, ""),
        (None, Some(f)) => (f, " (a cluster IP routed to this node)"),
        (None, None) => {
            return "not a frontend for traffic entering the node: passed on untouched".into();
        }
    };
    let r = &f.frontend;
    let local = r.flags.contains(&"local-only");
    // Endpoints elsewhere only: dropped, as kube-proxy; none anywhere: rejected.
    let nowhere = r.flags.contains(&"no-endpoints") || !local;
    let mut v = if r.backends.is_empty() && !nowhere {
        format!("dropped{what}: Local traffic policy and no endpoint on this node")
    } else if r.backends.is_empty() {
        format!("rejected{what} (ICMP port unreachable): the Service has no endpoints")
    } else {
        format!(
            "translated by the tc programs{what} to one of {} backend(s) by {}{}",
            r.backends.len(),
            r.algorithm,
            if local {
                " (Local traffic policy: endpoints on this node only, the client address is kept)"
            } else {
                ""
            }
        )
    };
    match ranges {
        None => {}
        Some([]) => v.push_str(
            "; loadBalancerSourceRanges admit no client of this family: every packet is dropped",
        ),
        Some(r) => {
            let r: Vec<String> = r.iter().map(ToString::to_string).collect();
            v.push_str(&format!(
                "; only from {} (loadBalancerSourceRanges), other clients are dropped",
                r.join(", ")
            ));
        }
    }
    v
}

/// Explains `addr`/`proto` from the pinned maps of `view`, and with `source` (a model fed
/// the objects, as this node reads them) also which endpoints are eligible and why the
/// others are not.
///
/// `node`: the node name assumed, as shown; `source_ranges`: the `TC_SOURCE_RANGES`
/// entries (pinned, or those an agent would write for `source`).
pub fn explain(
    view: &PinnedView,
    snap: &Snapshot,
    addr: std::net::SocketAddr,
    proto: u8,
    source: Option<&crate::model::Model>,
    node: &str,
    source_ranges: &std::collections::BTreeMap<crate::datapath::SourceRangeKey, u32>,
) -> Result<Explanation> {
    use crate::datapath::addr::{ip_to_bytes, port_to_map};
    let stats = view.service_stats().unwrap_or_default();
    let bstats = view.backend_stats().unwrap_or_default();
    let key_addr = ip_to_bytes(addr.ip());
    let key_port = port_to_map(addr.port());
    let rows = service_rows(snap);
    let mut frontends = Vec::new();
    for (k, f) in &snap.frontends {
        if k.addr != key_addr || k.port != key_port || k.proto != proto {
            continue;
        }
        // Compared as map keys: an IPv4 frontend asked as ::ffff:a.b.c.d matches too.
        let shown = to_socket_addr(k.addr, k.port).to_string();
        let Some(row) = rows.iter().find(|r| {
            r.service_id == f.service_id
                && r.frontend == shown
                && r.scope
                    == if k.scope == SCOPE_INGRESS {
                        "ingress"
                    } else {
                        "node"
                    }
        }) else {
            continue;
        };
        let row = ServiceRow {
            service: row.service.clone(),
            frontend: row.frontend.clone(),
            protocol: row.protocol,
            scope: row.scope,
            service_id: row.service_id,
            algorithm: row.algorithm,
            affinity_timeout_s: row.affinity_timeout_s,
            flags: row.flags.clone(),
            backends: row.backends.clone(),
        };
        let backend_connections = snap
            .slots
            .iter()
            .filter(|(sk, _)| sk.service_id == f.service_id)
            .filter_map(|(_, bid)| {
                let b = snap.backends.get(bid)?;
                Some((
                    to_socket_addr(b.addr, b.port).to_string(),
                    bstats.get(bid).copied().unwrap_or(0),
                ))
            })
            .collect();
        let endpoints = source.and_then(|model| {
            let key = crate::reconcile::parse_service_name(snap.names.get(&f.service_id)?)?;
            let local_only = f.flags & FRONTEND_F_LOCAL_ONLY != 0;
            let in_slots: std::collections::BTreeSet<String> =
                row.backends.iter().cloned().collect();
            Some(
                crate::model::eligibility(model, &key, local_only)
                    .into_iter()
                    .map(|(a, e, mut reason)| {
                        if reason.is_none()
                            && row.algorithm == "weighted-round-robin"
                            && !in_slots.contains(&a.to_string())
                        {
                            reason = Some("weight 0 (ebpf-proxy.io/weights)".into());
                        }
                        ExplainedEndpoint {
                            endpoint: a.to_string(),
                            pod: e.pod.to_string(),
                            local: e.local,
                            ready: e.ready,
                            serving: e.serving,
                            terminating: e.terminating,
                            zone_hints: e.zone_hints().iter().cloned().collect(),
                            eligible: reason.is_none(),
                            reason,
                        }
                    })
                    .collect(),
            )
        });
        let st = stats.get(&f.service_id).copied().unwrap_or_default();
        let (connections, refused) = (st.connections, st.refused);
        frontends.push(ExplainedFrontend {
            frontend: row,
            connections,
            refused,
            backend_connections,
            endpoints,
        });
    }
    let marker = snap
        .frontends
        .iter()
        .any(|(k, f)| k.addr == key_addr && k.proto == 0 && f.flags & FRONTEND_F_VIP_MARKER != 0);
    let node_scope = frontends.iter().find(|f| f.frontend.scope == "node");
    let verdict = match node_scope {
        Some(f) if !f.frontend.backends.is_empty() => format!(
            "translated to one of {} backend(s) by {}{}",
            f.frontend.backends.len(),
            f.frontend.algorithm,
            if f.frontend.affinity_timeout_s != 0 {
                format!(
                    " with ClientIP affinity ({} s)",
                    f.frontend.affinity_timeout_s
                )
            } else {
                String::new()
            }
        ),
        Some(f)
            if f.frontend.flags.contains(&"local-only")
                && !f.frontend.flags.contains(&"no-endpoints") =>
        {
            "fails with EHOSTUNREACH: Local traffic policy and no endpoint on this node".into()
        }
        Some(_) => "refused (ECONNREFUSED): the Service has no endpoints".into(),
        None if marker => {
            "refused (ECONNREFUSED): the cluster IP does not define this port and protocol".into()
        }
        None => "not a frontend: left alone by ebpf-proxy".into(),
    };
    let ranges = crate::datapath::tc::allowed_ranges(source_ranges, addr.ip());
    let external_verdict = external_verdict(&frontends, ranges.as_deref());
    let namespaces: std::collections::BTreeSet<&str> = frontends
        .iter()
        .filter_map(|f| f.frontend.service.split('/').next())
        .collect();
    let ignored_slices = source
        .map(|m| {
            m.errors()
                .into_iter()
                .filter(|e| {
                    e.kind == "EndpointSlice"
                        && e.reason == crate::model::endpoints::UNLABELED_SLICE
                        && namespaces.contains(e.namespace.as_str())
                })
                .map(|e| format!("{}/{}", e.namespace, e.name))
                .collect()
        })
        .unwrap_or_default();
    let skipped = source
        .map(|m| skipped_for(m, &frontends, &format!("{addr}/{}", proto_name(proto))))
        .unwrap_or_default();
    Ok(Explanation {
        skipped,
        target: format!("{addr}/{}", proto_name(proto)),
        from: "pinned maps",
        node: node.to_string(),
        frontends,
        verdict,
        external_verdict,
        ignored_slices,
        paths: workload_paths(view, source),
    })
}

/// At most this many skipped Services are listed by `explain` for a target that is no
/// frontend.
pub const MAX_SKIPPED_SHOWN: usize = 10;

/// [`Explanation::skipped`] for the frontends found for `target` (`ADDR:PORT/PROTO`).
fn skipped_for(
    model: &crate::model::Model,
    frontends: &[ExplainedFrontend],
    target: &str,
) -> Vec<String> {
    let errors = model.errors();
    if frontends.is_empty() {
        let services: Vec<String> = errors
            .iter()
            .filter(|e| e.kind == "Service" && e.reason.ends_with("Service skipped"))
            .map(ToString::to_string)
            .collect();
        let more = services.len().saturating_sub(MAX_SKIPPED_SHOWN);
        let mut out: Vec<String> = services.into_iter().take(MAX_SKIPPED_SHOWN).collect();
        if more > 0 {
            out.push(format!(
                "... and {more} more skipped Services (see the agent's log)"
            ));
        }
        return out;
    }
    let services: std::collections::BTreeSet<(&str, &str)> = frontends
        .iter()
        .filter_map(|f| {
            // `ns/name:port/PROTO/family[/scope]`; names never hold ':'.
            let (ns, rest) = f.frontend.service.split_once('/')?;
            Some((ns, rest.split(':').next()?))
        })
        .collect();
    // The owners whose errors count, as (kind, namespace, name): the Services and the
    // slices feeding them, looked up once.
    let owners: std::collections::BTreeSet<(&str, &str, &str)> = services
        .iter()
        .flat_map(|&(ns, name)| {
            std::iter::once(("Service", ns, name)).chain(
                model
                    .slices_of(ns, name)
                    .iter()
                    .map(move |s| ("EndpointSlice", ns, s.as_str())),
            )
        })
        .collect();
    errors
        .iter()
        .filter(|e| {
            owners.contains(&(e.kind.as_str(), e.namespace.as_str(), e.name.as_str()))
                || e.reason.contains(target)
        })
        .map(ToString::to_string)
        .collect()
}

/// Which path serves which workload of this node, one line each: the socket programs
/// (`connect`, `sendmsg`) or, for pods that bypass socket-level translation, the per-packet
/// programs on their interface. From the pins of `view` (the scope, how many pod namespaces
/// are bypassed and on which interfaces) and, with `model`, the pods by name and why.
pub fn workload_paths(view: &PinnedView, model: Option<&crate::model::Model>) -> Vec<String> {
    use proxy_common::bypass::BYPASS_CFG_HOST_ONLY;
    let mut out = Vec::new();
    let pinned = view.bypass().ok();
    let host_only = match (pinned.as_ref(), model) {
        (Some((cfg, _)), _) => cfg.flags & BYPASS_CFG_HOST_ONLY != 0,
        (None, Some(m)) => m.bypass().scope() == crate::model::bypass::SocketLbScope::HostOnly,
        (None, None) => false,
    };
    out.push(if host_only {
        "socket path: the node's own network namespace only (--socket-lb-scope host-only)"
            .to_string()
    } else {
        "socket path: every workload of the attached cgroup but the bypassed pods".to_string()
    });
    if let Some((_, cookies)) = &pinned {
        let links = view.bypass_links();
        if !cookies.is_empty() || !links.is_empty() {
            out.push(format!(
                "per-packet path (pod_ingress/pod_egress): {} pod network namespace(s), interfaces {}",
                cookies.len(),
                links.into_iter().collect::<Vec<_>>().join(",")
            ));
        }
    }
    if let Some(m) = model {
        for p in m.bypassed() {
            let ips: Vec<String> = p.ips.iter().map(ToString::to_string).collect();
            out.push(format!(
                "per-packet path: pod {}/{} ({}), opted out by {}",
                p.namespace,
                p.name,
                ips.join(","),
                match p.reason {
                    "pod" => "its ebpf-proxy.io/socket-lb label or annotation",
                    "namespace" => "its namespace's ebpf-proxy.io/socket-lb label or annotation",
                    _ => "--socket-lb-scope host-only",
                }
            ));
        }
    }
    out
}

/// The service maps an agent would write for `model` (this node's view of the objects), for
/// explaining a Service where no data path is pinned. The reconciler programs an in-memory
/// data path without limits, the same code path as the agent's first sync.
///
/// Errors: a Service the reconciler could not apply (the message names it).
pub fn desired_snapshot(model: &crate::model::Model) -> Result<Snapshot> {
    use crate::datapath::{Capacity, fake::FakeDatapath};
    use crate::reconcile::{NodeConfig, Reconciler};
    let mut dp = FakeDatapath::new(Capacity {
        frontends: u32::MAX,
        slots: u32::MAX,
        backends: u32::MAX,
        services: u32::MAX,
    });
    let mut r = Reconciler::adopt(
        &dp,
        NodeConfig::default(),
        std::time::Duration::from_secs(30),
    )
    .context("an empty in-memory data path")?;
    let out = r.apply_all(&mut dp, model, std::time::Instant::now());
    if let Some((svc, e)) = out.failed.first() {
        anyhow::bail!("{svc}: {e}");
    }
    Ok(dp.state)
}

/// Prints an [`Explanation`].
pub fn print_explanation(e: &Explanation, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(e)?);
        return Ok(());
    }
    println!("{} from this node: {}", e.target, e.verdict);
    println!("{} from outside the node: {}", e.target, e.external_verdict);
    println!("node assumed: {}", e.node);
    for p in &e.paths {
        println!("  {p}");
    }
    if e.from == "objects" {
        println!("(no data path pinned here: what an agent would program for these objects)");
    }
    for s in &e.ignored_slices {
        println!(
            "EndpointSlice {s} is ignored: it has no {} label",
            crate::model::SERVICE_NAME_LABEL
        );
    }
    if !e.skipped.is_empty() {
        println!(
            "{}:",
            if e.frontends.is_empty() {
                "skipped Services (one of them may be meant to define this frontend)"
            } else {
                "skipped, bearing on this frontend"
            }
        );
        for s in &e.skipped {
            println!("  {s}");
        }
    }
    for f in &e.frontends {
        let r = &f.frontend;
        println!();
        println!(
            "frontend {} {} (scope {}) -> {} [id {}]",
            r.frontend, r.protocol, r.scope, r.service, r.service_id
        );
        println!(
            "  algorithm {}, affinity {}, flags {}",
            r.algorithm,
            if r.affinity_timeout_s == 0 {
                "none".to_string()
            } else {
                format!("ClientIP {} s", r.affinity_timeout_s)
            },
            if r.flags.is_empty() {
                "-".to_string()
            } else {
                r.flags.join(",")
            }
        );
        println!(
            "  counters: {} connections, {} refused",
            f.connections, f.refused
        );
        if f.backend_connections.is_empty() {
            println!("  backends: none");
        }
        for (b, n) in &f.backend_connections {
            println!("  backend {b}: {n} connections (from every Service using it)");
        }
        if let Some(eps) = &f.endpoints {
            let table: Vec<Vec<String>> = eps
                .iter()
                .map(|x| {
                    vec![
                        x.endpoint.clone(),
                        if x.pod.is_empty() {
                            "-".into()
                        } else {
                            x.pod.clone()
                        },
                        if x.local { "this" } else { "other" }.to_string(),
                        format!("{}/{}/{}", x.ready, x.serving, x.terminating),
                        if x.zone_hints.is_empty() {
                            "-".into()
                        } else {
                            x.zone_hints.join(",")
                        },
                        if x.eligible { "yes" } else { "no" }.to_string(),
                        x.reason.clone().unwrap_or_default(),
                    ]
                })
                .collect();
            println!();
            print_table(
                &[
                    "  ENDPOINT",
                    "POD",
                    "NODE",
                    "READY/SERVING/TERM",
                    "ZONE HINTS",
                    "ELIGIBLE",
                    "WHY NOT",
                ],
                &table
                    .into_iter()
                    .map(|mut r| {
                        r[0] = format!("  {}", r[0]);
                        r
                    })
                    .collect::<Vec<_>>(),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Model, NodeInfo};

    /// The model of the manifests `yaml` (one file) as node `node` sees them, and the
    /// directory they were read from (the tests put a pin directory that does not exist
    /// there).
    fn model_of(yaml: &str, node: &str) -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("web.yaml"), yaml).unwrap();
        let (objects, errors) = crate::source::manifests::load_dir(dir.path());
        assert!(errors.is_empty(), "{errors:?}");
        let node = NodeInfo {
            name: node.into(),
            ..Default::default()
        };
        (dir, Model::from_objects(&objects, &node))
    }

    #[test]
    fn explain_names_what_was_skipped_for_the_target() {
        let (dir, model) = model_of(
            "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop, creationTimestamp: '2024-01-01T00:00:00Z'}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.7]}
- {addresses: [999.1.1.1]}
---
apiVersion: v1
kind: Service
metadata: {name: dup, namespace: other, creationTimestamp: '2025-01-01T00:00:00Z'}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: badport, namespace: other}
spec: {clusterIP: 10.96.0.20, ports: [{port: 70000}]}
",
            "n1",
        );
        let snap = desired_snapshot(&model).unwrap();
        let nowhere = PinnedView::new(&dir.path().join("no-pins"));
        let none = Default::default();
        let ask = |t: &str| {
            let target: std::net::SocketAddr = t.parse().unwrap();
            explain(&nowhere, &snap, target, 6, Some(&model), "n1", &none).unwrap()
        };
        // A frontend: its slice's skipped endpoint and the Service that lost the frontend.
        let e = ask("10.96.0.10:80");
        assert_eq!(e.frontends.len(), 1);
        assert_eq!(e.skipped.len(), 2, "{:?}", e.skipped);
        assert!(
            e.skipped
                .iter()
                .any(|s| s.contains("EndpointSlice shop/web-1") && s.contains("999.1.1.1")),
            "{:?}",
            e.skipped
        );
        assert!(
            e.skipped
                .iter()
                .any(|s| s.contains("Service other/dup") && s.contains("10.96.0.10:80/TCP")),
            "{:?}",
            e.skipped
        );
        // No frontend: the skipped Services, one of which may be meant to define it.
        let e = ask("10.96.0.20:80");
        assert!(e.frontends.is_empty());
        assert_eq!(e.verdict, "not a frontend: left alone by ebpf-proxy");
        assert!(
            e.skipped
                .iter()
                .any(|s| s.contains("Service other/badport") && s.contains("70000")),
            "{:?}",
            e.skipped
        );
        assert!(
            e.skipped.iter().all(|s| !s.contains("EndpointSlice")),
            "{:?}",
            e.skipped
        );
    }

    #[test]
    fn explain_without_pins_answers_from_what_an_agent_would_program() {
        let (dir, model) = model_of(
            "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.7], nodeName: n1}
- {addresses: [10.0.0.8], nodeName: n2, conditions: {ready: false}}
",
            "n1",
        );
        let snap = desired_snapshot(&model).unwrap();
        let nowhere = PinnedView::new(&dir.path().join("no-pins"));
        let target: std::net::SocketAddr = "10.96.0.10:80".parse().unwrap();
        let none = Default::default();
        let e = explain(&nowhere, &snap, target, 6, Some(&model), "n1 (test)", &none).unwrap();
        assert_eq!(e.node, "n1 (test)");
        assert_eq!(
            e.external_verdict,
            "translated by the tc programs (a cluster IP routed to this node) to one of 1 backend(s) by random"
        );
        assert!(e.ignored_slices.is_empty());
        assert_eq!(
            e.verdict, "translated to one of 1 backend(s) by random",
            "{e:?}"
        );
        let f = &e.frontends[0];
        assert_eq!(f.frontend.service, "shop/web:/TCP/v4");
        assert_eq!(f.frontend.backends, vec!["10.0.0.7:8080".to_string()]);
        let eps = f.endpoints.as_ref().unwrap();
        assert_eq!(eps.len(), 2);
        assert!(
            eps.iter()
                .any(|p| !p.eligible && p.reason.as_deref() == Some("not ready"))
        );
        // An undefined port of the cluster IP is refused, as the data path would.
        let e = explain(
            &nowhere,
            &snap,
            "10.96.0.10:81".parse().unwrap(),
            6,
            Some(&model),
            "n1",
            &none,
        )
        .unwrap();
        assert!(
            e.verdict.contains("does not define this port"),
            "{}",
            e.verdict
        );
    }

    /// From outside the node: the ingress frontend with the external policy's backends,
    /// the Local policy, the LB IP's source ranges; and a slice without the service-name
    /// label in the Service's namespace is named.
    #[test]
    fn explain_says_what_happens_to_traffic_from_outside_and_names_ignored_slices() {
        let text = "apiVersion: v1
kind: Service
metadata: {name: lb, namespace: shop}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  externalTrafficPolicy: Local
  loadBalancerSourceRanges: [192.0.2.0/24]
  ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.9}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: shop, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.7], nodeName: n1}
- {addresses: [10.0.0.8], nodeName: n2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: orphan-1, namespace: shop}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.9], nodeName: n1}
";
        let (objects, errors) = crate::source::manifests::parse_documents("t.yaml", text);
        assert!(errors.is_empty(), "{errors:?}");
        let mut set = crate::source::ObjectSet::default();
        for o in objects {
            set.insert(o);
        }
        let explain_on = |node: &str| {
            let model = Model::from_objects(
                &set,
                &NodeInfo {
                    name: node.into(),
                    ..Default::default()
                },
            );
            // The unlabeled slice is reported once, by namespace/name.
            let unlabeled: Vec<String> = model
                .errors()
                .iter()
                .filter(|e| e.reason == crate::model::endpoints::UNLABELED_SLICE)
                .map(ToString::to_string)
                .collect();
            assert_eq!(
                unlabeled,
                [
                    "t.yaml: EndpointSlice shop/orphan-1: no kubernetes.io/service-name label, so it belongs to no Service; slice ignored (as kube-proxy does)"
                ]
            );
            let snap = desired_snapshot(&model).unwrap();
            let ranges = crate::reconcile::node::source_range_entries(&model);
            let e = explain(
                &PinnedView::new(std::path::Path::new("/nonexistent")),
                &snap,
                "203.0.113.9:80".parse().unwrap(),
                6,
                Some(&model),
                node,
                &ranges,
            )
            .unwrap();
            assert_eq!(e.ignored_slices, ["shop/orphan-1"]);
            e
        };
        let e = explain_on("n1");
        assert_eq!(
            e.external_verdict,
            "translated by the tc programs to one of 1 backend(s) by random (Local traffic policy: endpoints on this node only, the client address is kept); only from 192.0.2.0/24 (loadBalancerSourceRanges), other clients are dropped"
        );
        // From this node, the Cluster endpoints (kube-proxy's short-circuit).
        assert_eq!(e.verdict, "translated to one of 2 backend(s) by random");
        let e = explain_on("n3");
        assert!(
            e.external_verdict.starts_with(
                "dropped: Local traffic policy and no endpoint on this node; only from 192.0.2.0/24"
            ),
            "{}",
            e.external_verdict
        );
        assert_eq!(
            external_verdict(&[], None),
            "not a frontend for traffic entering the node: passed on untouched"
        );
    }
}
