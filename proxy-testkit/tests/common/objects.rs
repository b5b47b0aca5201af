//! The Kubernetes objects the code-driven tests write as manifests: the `web` Service with
//! its EndpointSlices in one builder ([`Web`]), so every test file states only how its
//! Service differs. The scenario files (`tests/scenarios/`) carry their objects as YAML.

use std::net::IpAddr;

/// A Service port: name, port, targetPort, protocol (`TCP`, `UDP`), and its nodePort, if
/// any. The EndpointSlices list the same name with the targetPort as port.
#[derive(Clone, Copy, Debug)]
pub struct Port {
    pub name: &'static str,
    pub port: u32,
    pub target: u16,
    pub proto: &'static str,
    pub node_port: Option<u16>,
}

/// `http`: TCP 80 -> 8080.
pub const HTTP: Port = Port {
    name: "http",
    port: 80,
    target: 8080,
    proto: "TCP",
    node_port: None,
};

/// `dns`: UDP 53 -> 5353.
pub const DNS: Port = Port {
    name: "dns",
    port: 53,
    target: 5353,
    proto: "UDP",
    node_port: None,
};

impl Port {
    /// The port with nodePort `n`.
    pub const fn node_port(self, n: u16) -> Port {
        Port {
            node_port: Some(n),
            ..self
        }
    }
}

/// One endpoint of an EndpointSlice: its address and, when set, `nodeName`, a `targetRef`
/// to a pod of the Service's namespace, and `conditions` (a flow mapping body, e.g.
/// `"ready: false, serving: true"`).
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub node: Option<String>,
    pub pod: Option<String>,
    pub conditions: Option<String>,
}

impl Endpoint {
    /// An endpoint without conditions (ready, as the API reads a missing condition).
    pub fn new(addr: impl Into<IpAddr>) -> Endpoint {
        Endpoint {
            addr: addr.into(),
            node: None,
            pod: None,
            conditions: None,
        }
    }

    /// An endpoint with `conditions: {ready: <ready>}`.
    pub fn ready(addr: impl Into<IpAddr>, ready: bool) -> Endpoint {
        Endpoint::new(addr).conditions(&format!("ready: {ready}"))
    }

    /// On node `node` (`nodeName`).
    pub fn on(mut self, node: &str) -> Endpoint {
        self.node = Some(node.into());
        self
    }

    /// Backed by pod `name` (`targetRef`).
    pub fn pod(mut self, name: &str) -> Endpoint {
        self.pod = Some(name.into());
        self
    }

    /// With `conditions: {<c>}`; an empty `c` means none.
    pub fn conditions(mut self, c: &str) -> Endpoint {
        self.conditions = (!c.is_empty()).then(|| c.into());
        self
    }

    /// The YAML list item, in the slice's namespace `ns`.
    pub fn yaml(&self, ns: &str) -> String {
        let mut s = format!("- addresses: [\"{}\"]\n", self.addr);
        if let Some(n) = &self.node {
            s += &format!("  nodeName: {n}\n");
        }
        if let Some(p) = &self.pod {
            s += &format!("  targetRef: {{kind: Pod, name: {p}, namespace: {ns}}}\n");
        }
        if let Some(c) = &self.conditions {
            s += &format!("  conditions: {{{c}}}\n");
        }
        s
    }
}

/// A Service (default `default/web`) and its EndpointSlices, one per address family of its
/// cluster IPs (`<name>-1` for the first, `<name>-2` for the second), listing the endpoints
/// of that family.
#[derive(Clone, Debug)]
pub struct Web {
    pub namespace: String,
    pub name: String,
    /// `clusterIP` is the first, `clusterIPs` all.
    pub cluster_ips: Vec<String>,
    pub ports: Vec<Port>,
    /// `metadata.annotations`; values are written single-quoted.
    pub annotations: Vec<(String, String)>,
    /// More `spec` lines (indented by two spaces, each ending in a newline), before the ports.
    pub spec: String,
    /// A top-level `status:` block, if any (ending in a newline).
    pub status: String,
    pub endpoints: Vec<Endpoint>,
}

impl Web {
    /// `default/web` on cluster IP `vip` with ports [`HTTP`] and [`DNS`], no endpoints.
    pub fn new(vip: &str) -> Web {
        Web {
            namespace: "default".into(),
            name: "web".into(),
            cluster_ips: vec![vip.into()],
            ports: vec![HTTP, DNS],
            annotations: Vec::new(),
            spec: String::new(),
            status: String::new(),
            endpoints: Vec::new(),
        }
    }

    /// Named `name` instead.
    pub fn named(mut self, name: &str) -> Web {
        self.name = name.into();
        self
    }

    /// With these ports instead.
    pub fn ports(mut self, ports: &[Port]) -> Web {
        self.ports = ports.to_vec();
        self
    }

    /// With more `spec` lines (see [`Web::spec`]).
    pub fn spec(mut self, lines: &str) -> Web {
        self.spec += lines;
        self
    }

    /// With a `status:` block.
    pub fn status(mut self, yaml: &str) -> Web {
        self.status = yaml.into();
        self
    }

    /// With endpoint `e`.
    pub fn endpoint(mut self, e: Endpoint) -> Web {
        self.endpoints.push(e);
        self
    }

    /// With these endpoints.
    pub fn endpoints(mut self, eps: impl IntoIterator<Item = Endpoint>) -> Web {
        self.endpoints.extend(eps);
        self
    }

    /// With a ready endpoint (`conditions: {ready: true}`) for each address.
    pub fn ready(self, addrs: &[IpAddr]) -> Web {
        self.endpoints(addrs.iter().map(|a| Endpoint::ready(*a, true)))
    }

    /// The Service and its slices as one multi-document YAML text.
    pub fn yaml(&self) -> String {
        let mut s = self.service_yaml();
        let mut families: Vec<bool> = Vec::new();
        for ip in &self.cluster_ips {
            let v6 = ip.contains(':');
            if !families.contains(&v6) {
                families.push(v6);
            }
        }
        let ns = &self.namespace;
        for (i, v6) in families.into_iter().enumerate() {
            s += &format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {}-{}\n  namespace: {ns}\n  labels:\n    kubernetes.io/service-name: {}\naddressType: {}\nports:\n",
                self.name,
                i + 1,
                self.name,
                if v6 { "IPv6" } else { "IPv4" }
            );
            for p in &self.ports {
                s += &format!(
                    "- {{name: {}, port: {}, protocol: {}}}\n",
                    p.name, p.target, p.proto
                );
            }
            s += "endpoints:\n";
            for e in self.endpoints.iter().filter(|e| e.addr.is_ipv6() == v6) {
                s += &e.yaml(ns);
            }
        }
        s
    }

    /// The Service alone, without EndpointSlices.
    pub fn service_yaml(&self) -> String {
        let ns = &self.namespace;
        let mut s = format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {}\n  namespace: {ns}\n",
            self.name
        );
        if !self.annotations.is_empty() {
            s += "  annotations:\n";
            for (k, v) in &self.annotations {
                s += &format!("    {k}: '{v}'\n");
            }
        }
        let ips: Vec<String> = self
            .cluster_ips
            .iter()
            .map(|s| format!("\"{s}\""))
            .collect();
        s += &format!(
            "spec:\n  clusterIP: {}\n  clusterIPs: [{}]\n{}  ports:\n",
            ips[0],
            ips.join(", "),
            self.spec
        );
        for p in &self.ports {
            let node_port = p.node_port.map(|n| format!(", nodePort: {n}"));
            s += &format!(
                "  - {{name: {}, port: {}, targetPort: {}, protocol: {}{}}}\n",
                p.name,
                p.port,
                p.target,
                p.proto,
                node_port.unwrap_or_default()
            );
        }
        s += &self.status;
        s
    }
}
