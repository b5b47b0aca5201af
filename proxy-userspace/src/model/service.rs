//! A `v1` Service read once, when it changes, into [`ServiceInfo`]: everything the model
//! uses of it and nothing else, so the object itself is dropped on arrival.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::selection::{NorthSouthMode, algorithm_and_weights, north_south_mode};
use super::vocab::{Algorithm, Family, Protocol, UNUSABLE, parse_ip, usable_vip};

/// Default `sessionAffinityConfig.clientIP.timeoutSeconds` (Kubernetes API: 3 hours).
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10800;

/// A Service port: (name, "" when unnamed; protocol; port).
pub(crate) type ServicePort = (String, Protocol, u16);

/// What a Service offers, once it passed validation: cluster IPs (at most one per family,
/// in `clusterIPs` order), ports (name, protocol, port), external addresses
/// (`spec.externalIPs` and `status.loadBalancer.ingress[].ip` in VIP mode, with what they
/// are) and the node port of each port name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Frontends {
    pub vips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    pub external: Vec<(IpAddr, &'static str)>,
    /// `spec.ports[].nodePort` by port name, where set.
    pub node_ports: BTreeMap<String, u16>,
    /// ClientIP affinity timeout in seconds, 0 without affinity.
    pub affinity: u32,
}

/// One Service as the model keeps it. Equality tells a change that matters from one that
/// does not (a status or annotation update that changes nothing here is dropped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ServiceInfo {
    /// File (or "api") the object came from, for errors.
    pub origin: Arc<str>,
    /// `metadata.creationTimestamp`: the oldest Service keeps a contested frontend.
    pub created: Option<Time>,
    /// `Ok(None)`: no frontends by design (headless, ExternalName, no cluster IP);
    /// `Err(reason)`: the Service is skipped as a whole.
    pub frontends: Result<Option<Frontends>, String>,
    /// Per-port or per-address problems: the rest of the Service works.
    pub warnings: Vec<String>,
    /// `internalTrafficPolicy: Local`.
    pub internal_local: bool,
    /// `externalTrafficPolicy: Local`.
    pub external_local: bool,
    /// Algorithm ([`ALGORITHM_ANNOTATION`](super::selection::ALGORITHM_ANNOTATION) or the
    /// default).
    pub algorithm: Algorithm,
    /// Endpoint weights by pod name or address
    /// ([`WEIGHTS_ANNOTATION`](super::selection::WEIGHTS_ANNOTATION)).
    pub weights: BTreeMap<String, u32>,
    /// North-south mode
    /// ([`NORTH_SOUTH_MODE_ANNOTATION`](super::selection::NORTH_SOUTH_MODE_ANNOTATION) or the
    /// default).
    pub north_south: NorthSouthMode,
    /// Problems with the selection annotations (reported after the frontend errors).
    pub selection_warnings: Vec<String>,
    /// `healthCheckNodePort` of an `externalTrafficPolicy: Local` Service: `Ok(port)`, or
    /// `Err(value)` when it is not a port (reported).
    pub health_check: Option<Result<u16, i32>>,
    /// Valid `loadBalancerSourceRanges`.
    pub source_ranges: Vec<IpNet>,
    /// `loadBalancerSourceRanges` entries that are not CIDRs.
    pub bad_ranges: Vec<String>,
    /// Every parseable `status.loadBalancer.ingress[].ip` (whatever its mode), the addresses
    /// source ranges restrict when they are ingress frontends of the Service.
    pub lb_ips: BTreeSet<IpAddr>,
}

impl ServiceInfo {
    /// Reads a Service (`origin`: its file or "api") with the algorithm and the north-south
    /// mode of Services without the annotations.
    pub fn read(
        origin: Arc<str>,
        svc: &Service,
        default_algorithm: Algorithm,
        default_mode: NorthSouthMode,
    ) -> ServiceInfo {
        let mut warnings = Vec::new();
        let frontends = frontends(svc, &mut warnings);
        let spec = svc.spec.as_ref();
        let external_local =
            spec.and_then(|s| s.external_traffic_policy.as_deref()) == Some("Local");
        let internal_local =
            spec.and_then(|s| s.internal_traffic_policy.as_deref()) == Some("Local");
        let mut selection_warnings = Vec::new();
        let (algorithm, weights) =
            algorithm_and_weights(svc, default_algorithm, &mut selection_warnings);
        let north_south = north_south_mode(svc, default_mode, &mut selection_warnings);
        let health_check = spec
            .filter(|_| external_local)
            .and_then(|s| s.health_check_node_port)
            .map(|asked| u16::try_from(asked).ok().filter(|p| *p != 0).ok_or(asked));
        let mut source_ranges = Vec::new();
        let mut bad_ranges = Vec::new();
        for r in spec
            .and_then(|s| s.load_balancer_source_ranges.as_ref())
            .into_iter()
            .flatten()
        {
            match r.trim().parse::<IpNet>() {
                Ok(c) => source_ranges.push(c),
                Err(_) => bad_ranges.push(r.trim().to_string()),
            }
        }
        let lb_ips = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|l| l.ingress.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|i| i.ip.as_deref())
            .filter_map(|ip| ip.parse::<IpAddr>().ok())
            .collect();
        ServiceInfo {
            origin,
            created: svc.metadata.creation_timestamp.clone(),
            frontends,
            warnings,
            internal_local,
            external_local,
            algorithm,
            weights,
            north_south,
            selection_warnings,
            health_check,
            source_ranges,
            bad_ranges,
            lb_ips,
        }
    }
}

/// A Service's [`Frontends`]. `Ok(None)` for a Service that has no frontends by design
/// (headless, ExternalName, no cluster IP); `Err(reason)` for an invalid Service. Per-port
/// and per-address problems go to `warnings` (only when the Service is valid).
fn frontends(svc: &Service, warnings: &mut Vec<String>) -> Result<Option<Frontends>, String> {
    let Some(spec) = svc.spec.as_ref() else {
        return Ok(None);
    };
    if spec.type_.as_deref() == Some("ExternalName") {
        return Ok(None);
    }
    let Some(vips) = cluster_ips(spec)? else {
        return Ok(None);
    };
    traffic_policies(spec)?;
    let mut port_warnings = Vec::new();
    let (ports, node_ports) = ports(spec, &mut port_warnings)?;
    let external = external_addresses(svc, spec, &mut port_warnings);
    let affinity = affinity(spec)?;
    warnings.extend(port_warnings);
    Ok(Some(Frontends {
        vips,
        ports,
        external,
        node_ports,
        affinity,
    }))
}

/// The cluster IPs (`clusterIPs`, else `clusterIP`), at most one per family; `Ok(None)` for a
/// headless Service or one without a cluster IP.
fn cluster_ips(spec: &ServiceSpec) -> Result<Option<Vec<IpAddr>>, String> {
    let cluster_ip = spec.cluster_ip.as_deref().filter(|s| !s.is_empty());
    let ip_strings: Vec<&str> = match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => {
            if let Some(ip) = cluster_ip
                && ip != ips[0]
            {
                return Err(format!(
                    "clusterIP {ip} does not match clusterIPs[0] {}",
                    ips[0]
                ));
            }
            ips.iter().map(String::as_str).collect()
        }
        _ => cluster_ip.into_iter().collect(),
    };
    if ip_strings.is_empty() || ip_strings[0] == "None" {
        return Ok(None);
    }
    let mut vips: Vec<IpAddr> = Vec::new();
    for s in ip_strings {
        let ip: IpAddr = parse_ip(s).map_err(|e| format!("invalid cluster IP: {e}"))?;
        if !usable_vip(&ip) {
            return Err(format!("cluster IP {ip} is not usable ({UNUSABLE})"));
        }
        if let Some(other) = vips.iter().find(|v| Family::of(v) == Family::of(&ip)) {
            return Err(format!(
                "clusterIPs has two {} addresses ({other} and {ip})",
                Family::of(&ip).as_str()
            ));
        }
        vips.push(ip);
    }
    Ok(Some(vips))
}

/// Checks `internalTrafficPolicy` and `externalTrafficPolicy`: unset, `Cluster` or `Local`.
fn traffic_policies(spec: &ServiceSpec) -> Result<(), String> {
    for policy in [
        (
            "internalTrafficPolicy",
            spec.internal_traffic_policy.as_deref(),
        ),
        (
            "externalTrafficPolicy",
            spec.external_traffic_policy.as_deref(),
        ),
    ] {
        if let (field, Some(v)) = policy
            && v != "Cluster"
            && v != "Local"
        {
            return Err(format!("{field} {v:?} is not Cluster or Local"));
        }
    }
    Ok(())
}

/// The Service ports (name, protocol, port) and the node port of each port name. SCTP ports
/// and out-of-range node ports are skipped with a warning in `port_warnings`.
fn ports(
    spec: &ServiceSpec,
    port_warnings: &mut Vec<String>,
) -> Result<(Vec<ServicePort>, BTreeMap<String, u16>), String> {
    let mut ports = Vec::new();
    let mut node_ports = BTreeMap::new();
    let mut seen_ports: BTreeSet<(i32, String)> = BTreeSet::new();
    let mut seen_names: BTreeSet<&str> = BTreeSet::new();
    for p in spec.ports.iter().flatten() {
        let name = p.name.as_deref().unwrap_or("");
        let proto_name = p.protocol.as_deref().unwrap_or("TCP");
        let shown = if name.is_empty() {
            String::new()
        } else {
            format!(" ({name:?})")
        };
        if !(1..=65535).contains(&p.port) {
            return Err(format!("port {}{shown} is out of range 1-65535", p.port));
        }
        if !seen_ports.insert((p.port, proto_name.to_string())) {
            return Err(format!("port {}/{proto_name} is defined twice", p.port));
        }
        if !seen_names.insert(name) {
            return Err(format!("port name {name:?} is used twice"));
        }
        let protocol = match proto_name {
            "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => {
                port_warnings.push(format!(
                    "port {}/SCTP{shown}: SCTP is not supported; port skipped",
                    p.port
                ));
                continue;
            }
            other => {
                return Err(format!(
                    "unsupported protocol {other:?} on port {}{shown}",
                    p.port
                ));
            }
        };
        match p.node_port {
            None | Some(0) => {}
            Some(n @ 1..=65535) => {
                node_ports.insert(name.to_string(), n as u16);
            }
            Some(n) => port_warnings.push(format!(
                "nodePort {n} of port {}{shown} is out of range 1-65535; node port skipped",
                p.port
            )),
        }
        ports.push((name.to_string(), protocol, p.port as u16));
    }
    Ok((ports, node_ports))
}

/// The usable external addresses (`spec.externalIPs`, then load balancer ingress IPs in VIP
/// mode), each with what it is; the others are skipped with a warning in `port_warnings`.
fn external_addresses(
    svc: &Service,
    spec: &ServiceSpec,
    port_warnings: &mut Vec<String>,
) -> Vec<(IpAddr, &'static str)> {
    let mut external = Vec::new();
    let mut candidates: Vec<(&str, &'static str)> = spec
        .external_ips
        .iter()
        .flatten()
        .map(|s| (s.as_str(), "externalIP"))
        .collect();
    // Ingress IPs in VIP mode only: with ipMode Proxy the load balancer proxies to the
    // nodes and the IP must not be captured (KEP-1860).
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for ing in ingress.into_iter().flatten() {
        let Some(ip) = ing.ip.as_deref().filter(|s| !s.is_empty()) else {
            continue;
        };
        match ing.ip_mode.as_deref().unwrap_or("VIP") {
            "VIP" => candidates.push((ip, "load balancer ingress IP")),
            "Proxy" => {}
            other => port_warnings.push(format!(
                "load balancer ingress IP {ip}: ipMode {other:?} is not VIP or Proxy; address skipped"
            )),
        }
    }
    for (s, what) in candidates {
        match parse_ip(s) {
            Ok(ip) if usable_vip(&ip) => external.push((ip, what)),
            Ok(ip) => port_warnings.push(format!(
                "{what} {ip} is not usable ({UNUSABLE}); address skipped"
            )),
            Err(e) => port_warnings.push(format!("{what} {e}; address skipped")),
        }
    }
    external
}

/// The ClientIP affinity timeout in seconds, 0 without affinity.
fn affinity(spec: &ServiceSpec) -> Result<u32, String> {
    Ok(match spec.session_affinity.as_deref() {
        None | Some("") | Some("None") => 0,
        Some("ClientIP") => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match t {
                None => DEFAULT_AFFINITY_TIMEOUT_S,
                Some(t @ 1..=86400) => t as u32,
                Some(t) => {
                    return Err(format!(
                        "sessionAffinityConfig.clientIP.timeoutSeconds {t} is out of range 1-86400"
                    ));
                }
            }
        }
        Some(other) => return Err(format!("sessionAffinity {other:?} is not None or ClientIP")),
    })
}

#[cfg(test)]
mod tests;
