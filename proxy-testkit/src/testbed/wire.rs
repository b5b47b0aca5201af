//! The wire lab: [`Wire`], nodes and clients on one L2 segment, pods routed behind the
//! nodes.

use anyhow::Result;

use super::netns::Netns;

/// Name of the bridge of a [`Wire`] (inside its namespace).
pub const WIRE_BRIDGE: &str = "wire0";

/// An L2 segment between hosts (nodes and external clients) made only of namespaces: the
/// namespace `<prefix>-w` holding the bridge [`WIRE_BRIDGE`], and one namespace
/// `<prefix>-<name>` per host, plugged into it through a veth pair (wire side `p<i>`, host
/// side `eth0`). Each node routes its pods behind a bridge of its own ([`Wire::node`],
/// [`Wire::pod`]). The caller owns the host and pod namespaces and drops them before the
/// wire (declare them first).
#[derive(Debug)]
pub struct Wire {
    prefix: String,
    ns: Netns,
    next_port: u32,
}

impl Wire {
    /// Creates the wire's namespace `<prefix>-w` with its bridge up.
    pub fn new(prefix: &str) -> Result<Wire> {
        let ns = Netns::create(&format!("{prefix}-w"))?;
        ns.add_bridge(WIRE_BRIDGE)?;
        Ok(Wire {
            prefix: prefix.to_owned(),
            ns,
            next_port: 0,
        })
    }

    /// The wire's namespace (holds the bridge and the wire ends of the veth pairs).
    pub fn ns(&self) -> &Netns {
        &self.ns
    }

    /// A host namespace `<prefix>-<name>` plugged into the wire, its `eth0` addressed
    /// `addrs` (with their prefix, e.g. `198.18.100.1/24`) and up. Returns the namespace and
    /// the name of its port on the wire (`p0`, `p1`, ... in the order of the calls).
    pub fn host(&mut self, name: &str, addrs: &[&str]) -> Result<(Netns, String)> {
        let host = Netns::create(&format!("{}-{name}", self.prefix))?;
        let port = format!("p{}", self.next_port);
        self.next_port += 1;
        self.ns.plug(&port, WIRE_BRIDGE, &host, addrs)?;
        Ok((host, port))
    }

    /// [`Wire::host`] for a node that routes its pods: also a bridge `br0` addressed
    /// `gateway` (with its prefix, e.g. `198.18.1.1/24`; the pods' default gateway) and IPv4
    /// forwarding on.
    pub fn node(&mut self, name: &str, addrs: &[&str], gateway: &str) -> Result<(Netns, String)> {
        let (node, port) = self.host(name, addrs)?;
        node.add_bridge("br0")?;
        node.ip(&["addr", "add", gateway, "dev", "br0"])?;
        node.sysctl("net/ipv4/ip_forward", "1")?;
        Ok((node, port))
    }

    /// A pod namespace `<prefix>-<name>` behind `node`'s `br0` (see [`Wire::node`]) through
    /// the veth `v<name>` (node side): `eth0` addressed `addr` (with its prefix) and up, its
    /// default route via `gateway` (an address of the node's bridge).
    pub fn pod(&self, node: &Netns, name: &str, addr: &str, gateway: &str) -> Result<Netns> {
        let pod = Netns::create(&format!("{}-{name}", self.prefix))?;
        node.plug(&format!("v{name}"), "br0", &pod, &[addr])?;
        pod.ip(&["route", "add", "default", "via", gateway])?;
        Ok(pod)
    }
}
