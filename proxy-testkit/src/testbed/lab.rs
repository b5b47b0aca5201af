//! The bridge lab: [`Lab`], a node namespace holding a bridge and one namespace per
//! [`Pod`], connected to the bridge by veth pairs.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Result, bail};

use super::netns::Netns;
use super::process::{ChildGuard, output_in};
use super::{
    LAB_BRIDGE, LAB_BRIDGE_MAC, LAB_GATEWAY_V4, LAB_GATEWAY_V6, LAB_PREFIX_V4, LAB_PREFIX_V6,
    NETNS_RUN_DIR,
};

/// A small L2 network made only of namespaces: a "node" namespace `<prefix>-node` holding a
/// Linux bridge ([`LAB_BRIDGE`], gateway [`LAB_GATEWAY_V4`] / [`LAB_GATEWAY_V6`]) and one
/// namespace `<prefix>-<name>` per pod, connected to the bridge by a veth pair (pod side
/// `eth0`). Every namespace is deleted when the lab is dropped.
#[derive(Debug)]
pub struct Lab {
    // Declared before `node`: pods are deleted first.
    pods: Vec<Netns>,
    node: Netns,
    prefix: String,
    ipv6: bool,
    next_veth: u32,
}

/// A pod of a [`Lab`]: a handle to its namespace and addresses. The namespace belongs to
/// the lab and lives until the lab is dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// Pod name as given to [`Lab::add_pod`].
    pub name: String,
    /// Name of the pod's network namespace.
    pub netns: String,
    /// IPv4 address of `eth0`.
    pub ipv4: Ipv4Addr,
    /// IPv6 address of `eth0`, if the lab is dual-stack.
    pub ipv6: Option<Ipv6Addr>,
}

impl Pod {
    /// Path of the pod's namespace file.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_RUN_DIR).join(&self.netns)
    }

    /// Spawns `cmd` inside the pod's namespace (and `cgroup`, if given), guarded.
    pub fn spawn(&self, cgroup: Option<&Path>, cmd: &mut Command) -> io::Result<ChildGuard> {
        ChildGuard::spawn_in(Some(&self.path()), cgroup, cmd)
    }

    /// Runs `cmd` inside the pod's namespace (and `cgroup`) with a timeout; see [`output_in`].
    pub fn output(
        &self,
        cgroup: Option<&Path>,
        cmd: &mut Command,
        timeout: Duration,
    ) -> io::Result<Output> {
        output_in(Some(&self.path()), cgroup, cmd, timeout)
    }
}

impl Lab {
    /// Creates the node namespace `<prefix>-node` with its bridge. With `ipv6`, the bridge
    /// and every pod also get an IPv6 address (without duplicate address detection).
    pub fn new(prefix: &str, ipv6: bool) -> Result<Self> {
        let node = Netns::create(&format!("{prefix}-node"))?;
        if ipv6 {
            disable_dad(&node)?;
        }
        node.ip(&[
            "link",
            "add",
            LAB_BRIDGE,
            "type",
            "bridge",
            "forward_delay",
            "0",
        ])?;
        // A MAC of its own, as CNI's bridge plugin gives its bridge: otherwise the bridge
        // takes the lowest of its ports' MACs and changes it when that port goes (a pod
        // deleted), and the other pods' neighbour entries for the gateway go stale, their
        // traffic through the node stalling until they resolve it again.
        node.ip(&["link", "set", LAB_BRIDGE, "address", LAB_BRIDGE_MAC])?;
        node.ip(&[
            "addr",
            "add",
            &format!("{LAB_GATEWAY_V4}/{LAB_PREFIX_V4}"),
            "dev",
            LAB_BRIDGE,
        ])?;
        if ipv6 {
            node.ip(&[
                "addr",
                "add",
                &format!("{LAB_GATEWAY_V6}/{LAB_PREFIX_V6}"),
                "dev",
                LAB_BRIDGE,
                "nodad",
            ])?;
        }
        node.ip(&["link", "set", LAB_BRIDGE, "up"])?;
        Ok(Self {
            pods: Vec::new(),
            node,
            prefix: prefix.to_owned(),
            ipv6,
            next_veth: 0,
        })
    }

    /// The node namespace (holds the bridge and the node ends of the veth pairs).
    pub fn node(&self) -> &Netns {
        &self.node
    }

    /// Whether pods get IPv6 addresses.
    pub fn ipv6(&self) -> bool {
        self.ipv6
    }

    /// Adds a pod namespace `<prefix>-<name>` with `eth0` addressed `ipv4/24` (and
    /// `ipv6/64`), default routes via the bridge, and the peer veth enslaved to the bridge.
    /// `ipv4` must be in `198.18.0.0/24` (not .0, .1 or .255).
    pub fn add_pod(&mut self, name: &str, ipv4: Ipv4Addr, ipv6: Option<Ipv6Addr>) -> Result<Pod> {
        let o = ipv4.octets();
        let g = LAB_GATEWAY_V4.octets();
        if o[..3] != g[..3] || matches!(o[3], 0 | 1 | 255) {
            bail!("pod address {ipv4} is not a host address of {LAB_GATEWAY_V4}/{LAB_PREFIX_V4}");
        }
        if ipv6.is_some() && !self.ipv6 {
            bail!("pod {name} has an IPv6 address but the lab was created without IPv6");
        }
        let ns = Netns::create(&format!("{}-{name}", self.prefix))?;
        if self.ipv6 {
            disable_dad(&ns)?;
        }
        let veth = format!("veth{}", self.next_veth);
        self.next_veth += 1;
        self.node.add_bridge_port(&veth, LAB_BRIDGE, &ns)?;
        ns.ip(&[
            "addr",
            "add",
            &format!("{ipv4}/{LAB_PREFIX_V4}"),
            "dev",
            "eth0",
        ])?;
        if let Some(v6) = ipv6 {
            ns.ip(&[
                "addr",
                "add",
                &format!("{v6}/{LAB_PREFIX_V6}"),
                "dev",
                "eth0",
                "nodad",
            ])?;
        }
        ns.ip(&["link", "set", "eth0", "up"])?;
        ns.ip(&[
            "route",
            "add",
            "default",
            "via",
            &LAB_GATEWAY_V4.to_string(),
        ])?;
        if ipv6.is_some() {
            ns.ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &LAB_GATEWAY_V6.to_string(),
            ])?;
        }
        let pod = Pod {
            name: name.to_owned(),
            netns: ns.name().to_owned(),
            ipv4,
            ipv6,
        };
        self.pods.push(ns);
        Ok(pod)
    }

    /// Deletes pod `name`'s namespace (`ip netns del`), as when its sandbox goes away: once
    /// no process holds it any more, its `eth0` and with it the node end of the veth pair
    /// are gone. [`Lab::add_pod`] may then add a pod of the same name (a new namespace and
    /// a new veth). Returns whether the lab had such a pod.
    pub fn remove_pod(&mut self, name: &str) -> bool {
        let netns = format!("{}-{name}", self.prefix);
        let before = self.pods.len();
        // Dropping the `Netns` deletes it.
        self.pods.retain(|ns| ns.name() != netns);
        self.pods.len() != before
    }
}

fn disable_dad(ns: &Netns) -> Result<()> {
    ns.sysctl("net/ipv6/conf/all/accept_dad", "0")?;
    ns.sysctl("net/ipv6/conf/default/accept_dad", "0")
}
