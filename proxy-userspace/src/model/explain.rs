//! Why an endpoint is or is not used: the rules of [`categorize`] told back in words, for
//! `ebpf-proxy explain`.

use std::net::SocketAddr;

use super::endpoints::EndpointInfo;
use super::topology::{EndpointSets, categorize};
use super::tracker::Model;
use super::vocab::ServicePortKey;

/// Every endpoint of the Service port and family of `key` as this node reads it, each with
/// the reason it is not in the backend set (`None` when it is). `local_only`: the set is a
/// Local one (`FRONTEND_F_LOCAL_ONLY`).
pub fn eligibility(
    model: &Model,
    key: &ServicePortKey,
    local_only: bool,
) -> Vec<(SocketAddr, EndpointInfo, Option<String>)> {
    let eps = model.endpoints_of(
        &key.namespace,
        &key.name,
        &key.port_name,
        key.protocol,
        key.family,
    );
    let zone = model.node().zone.clone();
    let sets = categorize(&eps, &model.config().name, &zone);
    eps.into_iter()
        .map(|(a, e)| {
            let reason = why_not(&a, &e, &sets, local_only, &zone);
            (a, e, reason)
        })
        .collect()
}

/// Why endpoint `addr` is not in a backend set built from `sets` (`local_only`: the set is
/// the Local one), or `None` when it is used. The reasons are the rules of [`categorize`].
pub fn why_not(
    addr: &SocketAddr,
    e: &EndpointInfo,
    sets: &EndpointSets,
    local_only: bool,
    zone: &str,
) -> Option<String> {
    let used = if local_only {
        sets.local.contains(addr)
    } else {
        sets.cluster.contains(addr)
    };
    if used {
        return None;
    }
    Some(if !(e.ready || e.serving && e.terminating) {
        if e.terminating {
            "terminating and not serving".to_string()
        } else {
            "not ready".to_string()
        }
    } else if !e.ready {
        "terminating (ready endpoints are preferred)".to_string()
    } else if local_only && !e.local {
        "on another node (Local traffic policy)".to_string()
    } else if sets.topology == "PreferSameNode" {
        "not hinted for this node (topology hints)".to_string()
    } else if sets.topology == "PreferSameZone" {
        format!("not hinted for zone {zone:?} (topology hints)")
    } else {
        "not selected".to_string()
    })
}
