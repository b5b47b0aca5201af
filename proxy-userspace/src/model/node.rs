//! What the model knows of this node: the flags that shape it ([`NodeInfo`]) and its `v1`
//! Node object, read once into [`NodeState`]: its addresses with the roles they play (node
//! ports, SNAT and the choice of external interfaces), its zone, and whether it is being
//! removed (for `/healthz`'s `nodeEligible`).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;

use super::labels::ZONE_LABEL;
use super::selection::NorthSouthMode;
use super::vocab::{Algorithm, Family, ModelError, usable_vip};

/// Information about this node that does not come from objects: its name
/// (`--hostname-override`) and the flags that shape the model. Its zone and addresses come
/// from the Node object of that name (`NodeState`).
#[derive(Clone, Debug, Default)]
pub struct NodeInfo {
    /// Node name.
    pub name: String,
    /// `--nodeport-addresses` CIDRs: node ports are served only on node addresses inside
    /// one of them; empty means every node address (kube-proxy's iptables default).
    pub nodeport_addresses: Vec<IpNet>,
    /// `--nodeport-addresses primary`: only the node's primary address of each family (its
    /// first `InternalIP`), the default of kube-proxy's nftables mode.
    pub nodeport_primary: bool,
    /// `--lb-algorithm`: the algorithm of Services without the `ebpf-proxy.io/lb-algorithm`
    /// annotation (`ALGORITHM_ANNOTATION`).
    pub default_algorithm: Algorithm,
    /// `--north-south-mode`: the mode of Services without the
    /// `ebpf-proxy.io/north-south-mode` annotation (`NORTH_SOUTH_MODE_ANNOTATION`).
    pub north_south_mode: NorthSouthMode,
}

/// One `InternalIP` or `ExternalIP` of this node's `status.addresses`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAddress {
    /// The address.
    pub ip: IpAddr,
    /// `InternalIP` (true) or `ExternalIP` (false).
    pub internal: bool,
    /// Node ports are served on it: inside `--nodeport-addresses` (every address when unset;
    /// with `primary`, only the first `InternalIP` of each family).
    pub node_port: bool,
}

/// What the model reads from this node's Node object. The default (no Node object) has no
/// address and no zone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeState {
    /// The `topology.kubernetes.io/zone` label, "" when unset.
    pub zone: String,
    /// Usable `InternalIP` and `ExternalIP` addresses, in `status.addresses` order. They
    /// pick the external interfaces (those carrying one) and their SNAT addresses.
    pub addresses: Vec<NodeAddress>,
    /// Addresses that could not be used (reported).
    pub errors: Vec<ModelError>,
    /// `metadata.deletionTimestamp` is set: the node is being deleted.
    pub deleting: bool,
    /// `spec.taints` has [`TO_BE_DELETED_TAINT`]: the cluster autoscaler is removing it.
    pub to_be_deleted: bool,
}

/// Taint the cluster autoscaler puts on a node it is about to delete (kube-proxy's
/// `healthcheck.ToBeDeletedTaint`).
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

impl NodeState {
    /// Reads the Node object (`origin`: its file or "api") with the node-port address rules
    /// of `config` (`--nodeport-addresses`).
    pub fn read(origin: &Arc<str>, n: &Node, config: &NodeInfo) -> NodeState {
        let zone = n
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ZONE_LABEL))
            .cloned()
            .unwrap_or_default();
        let mut addresses = Vec::new();
        let mut errors = Vec::new();
        let mut primary_seen: BTreeSet<Family> = BTreeSet::new();
        let listed = n.status.as_ref().and_then(|s| s.addresses.as_ref());
        for a in listed.into_iter().flatten() {
            if a.type_ != "InternalIP" && a.type_ != "ExternalIP" {
                continue;
            }
            let ip = match a.address.parse::<IpAddr>() {
                Ok(ip) if usable_vip(&ip) => ip,
                _ => {
                    errors.push(ModelError::object(
                        origin.to_string(),
                        "Node",
                        "",
                        config.name.clone(),
                        format!(
                            "status.addresses {} {:?} is not a usable IP address; skipped for node ports",
                            a.type_, a.address
                        ),
                    ));
                    continue;
                }
            };
            let internal = a.type_ == "InternalIP";
            let node_port = if config.nodeport_primary {
                internal && primary_seen.insert(Family::of(&ip))
            } else {
                config.nodeport_addresses.is_empty()
                    || config.nodeport_addresses.iter().any(|c| c.contains(&ip))
            };
            addresses.push(NodeAddress {
                ip,
                internal,
                node_port,
            });
        }
        NodeState {
            zone,
            addresses,
            errors,
            deleting: n.metadata.deletion_timestamp.is_some(),
            to_be_deleted: n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT)),
        }
    }

    /// The node may keep receiving load-balanced traffic: it is neither being deleted nor
    /// tainted [`TO_BE_DELETED_TAINT`] (kube-proxy's `NodeEligible`, KEP-3836). Without a
    /// Node object (manifests that hold none) it counts as eligible: nothing says it is
    /// going away.
    pub fn eligible(&self) -> bool {
        !self.deleting && !self.to_be_deleted
    }

    /// The addresses node ports are served on.
    pub fn node_port_ips(&self) -> BTreeSet<IpAddr> {
        self.addresses
            .iter()
            .filter(|a| a.node_port)
            .map(|a| a.ip)
            .collect()
    }

    /// Every usable `InternalIP`/`ExternalIP` address.
    pub fn ips(&self) -> BTreeSet<IpAddr> {
        self.addresses.iter().map(|a| a.ip).collect()
    }
}

#[cfg(test)]
mod tests;
