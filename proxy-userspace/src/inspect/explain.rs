//! `ebpf-proxy explain ADDR:PORT/PROTO`: what the data path does with a frontend, from the
//! pinned maps (or, where none are pinned, from what an agent would program for the objects
//! given) and, with the objects, which endpoints are eligible and why the others are not.

use anyhow::{Context, Result};
use proxy_common::{FRONTEND_F_LOCAL_ONLY, FRONTEND_F_VIP_MARKER, Frontend, SCOPE_INGRESS};
use serde::Serialize;

use super::{ServiceRow, print_table, service_rows};
use crate::datapath::{
    Snapshot,
    addr::{proto_name, to_socket_addr},
    view::PinnedView,
};

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
        let backend_connections = backend_connections(snap, f.service_id, &bstats);
        let endpoints = source.and_then(|model| explained_endpoints(model, snap, f, &row));
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
    let verdict = local_verdict(&frontends, marker);
    let ranges = crate::datapath::tc::allowed_ranges(source_ranges, addr.ip());
    let external_verdict = external_verdict(&frontends, ranges.as_deref());
    let ignored_slices = source
        .map(|m| ignored_slices(m, &frontends))
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

/// Connections sent to each backend in the slots of `service_id` (`bstats`: by backend id,
/// from every Service using that backend), by backend address.
fn backend_connections(
    snap: &Snapshot,
    service_id: u32,
    bstats: &std::collections::BTreeMap<u32, u64>,
) -> std::collections::BTreeMap<String, u64> {
    snap.slots
        .iter()
        .filter(|(sk, _)| sk.service_id == service_id)
        .filter_map(|(_, bid)| {
            let b = snap.backends.get(bid)?;
            Some((
                to_socket_addr(b.addr, b.port).to_string(),
                bstats.get(bid).copied().unwrap_or(0),
            ))
        })
        .collect()
}

/// The endpoints of the Service port behind frontend `f` (shown as `row`) with their
/// eligibility on this node, from `model`; `None` when the frontend's service id has no
/// name in `snap` or the name is not a Service port's.
fn explained_endpoints(
    model: &crate::model::Model,
    snap: &Snapshot,
    f: &Frontend,
    row: &ServiceRow,
) -> Option<Vec<ExplainedEndpoint>> {
    let key = crate::reconcile::parse_service_name(snap.names.get(&f.service_id)?)?;
    let local_only = f.flags & FRONTEND_F_LOCAL_ONLY != 0;
    let in_slots: std::collections::BTreeSet<String> = row.backends.iter().cloned().collect();
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
}

/// The verdict for a connection from this node (the socket programs' lookup): the node
/// scope frontend among `frontends`; without one, refused when the address is a cluster IP
/// (`marker`: it has a VIP marker) and left alone otherwise.
fn local_verdict(frontends: &[ExplainedFrontend], marker: bool) -> String {
    let node_scope = frontends.iter().find(|f| f.frontend.scope == "node");
    match node_scope {
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
    }
}

/// [`Explanation::ignored_slices`]: the EndpointSlices of `model` without the service-name
/// label in the namespaces of `frontends`' Services.
fn ignored_slices(model: &crate::model::Model, frontends: &[ExplainedFrontend]) -> Vec<String> {
    let namespaces: std::collections::BTreeSet<&str> = frontends
        .iter()
        .filter_map(|f| f.frontend.service.split('/').next())
        .collect();
    model
        .errors()
        .into_iter()
        .filter(|e| {
            e.kind == "EndpointSlice"
                && e.reason == crate::model::endpoints::UNLABELED_SLICE
                && namespaces.contains(e.namespace.as_str())
        })
        .map(|e| format!("{}/{}", e.namespace, e.name))
        .collect()
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

/// Prints what [`explain`] returned: as text, or as JSON with `json`.
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
mod tests;
