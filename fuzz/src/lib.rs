//! Shared code of the fuzz targets: the checks of parsed objects, and the `model` target's
//! input (a sequence of operations over a small universe of Services, EndpointSlices and
//! Nodes, written as YAML from fuzzer-chosen fields) and its harness.
//!
//! The generator lives here, not in the product: the product only offers the one
//! consistency check of the maps, [`FakeDatapath::consistency_violations`].
//!
//! [`FakeDatapath::consistency_violations`]: proxy_userspace::datapath::fake::FakeDatapath::consistency_violations

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use proxy_userspace::datapath::{Capacity, Interface, fake::FakeDatapath};
use proxy_userspace::model::{Model, NodeInfo, parse_algorithm};
use proxy_userspace::reconcile::{NodeConfig, Outcome, Reconciler};
use proxy_userspace::source::{Change, Kind, Object, ObjectSet, SourceError};

/// Checks what `parse_documents(origin, ..)` returned: every object has a name, Services
/// and EndpointSlices a namespace, a Node none (cluster-scoped), and every object and error
/// names `origin`.
pub fn check_objects(origin: &str, objects: &[Object], errors: &[SourceError]) {
    for o in objects {
        assert_eq!(o.origin(), origin);
        let (ns, name) = o.key();
        assert!(!name.is_empty(), "{} without a name: {o:?}", o.kind());
        let meta_ns = match o {
            Object::Service(s) => s.object.metadata.namespace.clone(),
            Object::EndpointSlice(s) => s.object.metadata.namespace.clone(),
            Object::Node(n) => n.object.metadata.namespace.clone(),
            Object::Pod(p) => p.object.metadata.namespace.clone(),
            Object::Namespace(n) => n.object.metadata.namespace.clone(),
        };
        match o {
            Object::Node(_) | Object::Namespace(_) => {
                assert_eq!(meta_ns, None, "a Node has no namespace: {o:?}");
                assert_eq!(ns, "");
            }
            _ => {
                assert!(
                    meta_ns.as_deref().is_some_and(|n| !n.is_empty()),
                    "{} {name} without a namespace: {o:?}",
                    o.kind()
                );
                assert_eq!(meta_ns.as_deref(), Some(ns.as_str()));
            }
        }
    }
    for e in errors {
        assert_eq!(e.origin, origin, "{e}");
        assert!(!e.reason.is_empty(), "{e:?}");
    }
}

// ---------------------------------------------------------------------------------------
// Values. Small pools of meaningful and broken values, plus free text where the parser
// must cope with anything.

/// Picks from a pool by a fuzzer-chosen index.
fn pick<'a>(pool: &[&'a str], i: u8) -> &'a str {
    pool[i as usize % pool.len()]
}

/// A YAML scalar holding exactly `s` (a JSON string is a YAML double-quoted scalar).
fn q(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// An address field.
#[derive(Arbitrary, Debug)]
pub enum Addr {
    /// One of `ADDRS` (the index wraps around).
    Pool(u8),
    /// 10.96.0.x (cluster IPs).
    ClusterV4(u8),
    /// fd00::x (cluster IPs).
    ClusterV6(u8),
    /// 10.0.0.x (pod IPs).
    PodV4(u8),
    /// fd00:1::x (pod IPs).
    PodV6(u8),
    /// Anything.
    Text(String),
}

const ADDRS: &[&str] = &[
    "10.96.0.1",
    "fd00::1",
    "192.0.2.7",
    "2001:db8::7",
    "203.0.113.9",
    "192.168.1.5",
    "192.168.1.6",
    "fd00::5",
    "10.0.0.1",
    "10.0.0.254",
    "None",
    "",
    "0.0.0.0",
    "::",
    "127.0.0.1",
    "::1",
    "169.254.1.1",
    "fe80::1",
    "224.0.0.1",
    "ff02::1",
    "255.255.255.255",
    "::ffff:10.96.0.1",
    "::ffff:192.0.2.7",
    " 10.96.0.1",
    "10.96.0.1 ",
    "010.096.000.001",
    "10.96.0.1/32",
    "[fd00::1]",
    "fe80::1%eth0",
    "bogus",
];

impl Addr {
    fn text(&self) -> String {
        match self {
            Addr::Pool(i) => pick(ADDRS, *i).to_string(),
            Addr::ClusterV4(i) => format!("10.96.0.{}", i % 8),
            Addr::ClusterV6(i) => format!("fd00::{:x}", i % 8),
            Addr::PodV4(i) => format!("10.0.0.{}", i % 8),
            Addr::PodV6(i) => format!("fd00:1::{:x}", i % 8),
            Addr::Text(s) => s.clone(),
        }
    }
    fn yaml(&self) -> String {
        q(&self.text())
    }
}

/// A port or port-like number.
#[derive(Arbitrary, Debug)]
pub enum Port {
    /// One of `PORTS` (the index wraps around).
    Pool(u8),
    /// Any number.
    Any(i64),
    /// A number written as a string (not an integer to the API types).
    Quoted(u16),
}

const PORTS: &[i64] = &[
    80, 53, 443, 8080, 8081, 5353, 0, -1, 65535, 65536, 30080, 30053, 31000, 31001, 32767,
];

impl Port {
    fn yaml(&self) -> String {
        match self {
            Port::Pool(i) => PORTS[*i as usize % PORTS.len()].to_string(),
            Port::Any(n) => n.to_string(),
            Port::Quoted(n) => q(&n.to_string()),
        }
    }
}

/// A CIDR of `loadBalancerSourceRanges`.
#[derive(Arbitrary, Debug)]
pub enum Cidr {
    /// One of `CIDRS` (the index wraps around).
    Pool(u8),
    /// Anything.
    Text(String),
}

const CIDRS: &[&str] = &[
    "192.0.2.0/24",
    "198.51.100.7/32",
    " 198.51.100.0/24",
    "0.0.0.0/0",
    "::/0",
    "2001:db8::/32",
    "10.0.0.0/8",
    "192.0.2.7",
    "192.0.2.0/33",
    "bogus",
    "",
];

impl Cidr {
    fn yaml(&self) -> String {
        match self {
            Cidr::Pool(i) => q(pick(CIDRS, *i)),
            Cidr::Text(s) => q(s),
        }
    }
}

const PROTOCOLS: &[&str] = &["TCP", "UDP", "SCTP", "tcp", "ICMP", ""];
const PORT_NAMES: &[&str] = &[
    "http",
    "dns",
    "",
    "https",
    "HTTP",
    "a-very-long-port-name-x",
];
const ZONES: &[&str] = &["zone-a", "zone-b", ""];
const NODES: &[&str] = &["node-1", "node-2", ""];

/// The Services of the universe: (namespace, name).
pub const SERVICES: [(&str, &str); 4] = [("a", "web"), ("a", "api"), ("b", "web"), ("b", "dns")];

fn service_of(i: u8) -> (&'static str, &'static str) {
    SERVICES[i as usize % SERVICES.len()]
}

/// Keeps at most `n` items (the fuzzer's vectors are otherwise unbounded).
fn first<T>(v: &[T], n: usize) -> &[T] {
    &v[..v.len().min(n)]
}

// ---------------------------------------------------------------------------------------
// Objects.

/// One `spec.ports[]` entry.
#[derive(Arbitrary, Debug)]
pub struct ServicePort {
    name: Option<u8>,
    protocol: Option<u8>,
    port: Port,
    node_port: Option<Port>,
    target_port: Option<Port>,
}

/// One `status.loadBalancer.ingress[]` entry.
#[derive(Arbitrary, Debug)]
pub struct Ingress {
    ip: Option<Addr>,
    /// `ipMode`: VIP, Proxy, or a bad value.
    mode: Option<u8>,
}

/// A Service's fields.
#[derive(Arbitrary, Debug)]
pub struct ServiceSpec {
    type_: Option<u8>,
    cluster_ip: Option<Addr>,
    cluster_ips: Option<Vec<Addr>>,
    ports: Vec<ServicePort>,
    external_ips: Vec<Addr>,
    external_policy: Option<u8>,
    internal_policy: Option<u8>,
    health_check_node_port: Option<Port>,
    source_ranges: Vec<Cidr>,
    affinity: Option<u8>,
    affinity_timeout: Option<i64>,
    algorithm: Option<u8>,
    weights: Option<u8>,
    created: Option<u8>,
    ingress: Vec<Ingress>,
}

const TYPES: &[&str] = &[
    "ClusterIP",
    "NodePort",
    "LoadBalancer",
    "ExternalName",
    "Bogus",
];
const POLICIES: &[&str] = &["Cluster", "Local", "local", ""];
const AFFINITIES: &[&str] = &["None", "ClientIP", "", "Sticky"];
const ALGORITHMS: &[&str] = &[
    "random",
    "round-robin",
    "weighted-round-robin",
    "least-connections",
    "source-hash",
    "maglev",
    "nonsense",
    "",
];
const WEIGHTS: &[&str] = &[
    r#"{"10.0.0.1": 3, "10.0.0.2": 0}"#,
    r#"{"pod-1": 5, "10.0.0.3": 1000}"#,
    r#"{"10.0.0.1": -1}"#,
    r#"{"10.0.0.1": 1.5}"#,
    "[1, 2]",
    "not json",
    "",
];

impl ServiceSpec {
    /// The Service as one YAML document.
    pub fn yaml(&self, ns: &str, name: &str) -> String {
        let mut meta = format!("name: {name}, namespace: {ns}");
        if let Some(c) = self.created {
            // Ages decide which Service keeps a contested frontend.
            meta += &format!(", creationTimestamp: '2026-0{}-01T00:00:00Z'", 1 + c % 3);
        }
        let mut ann = Vec::new();
        if let Some(a) = self.algorithm {
            ann.push(format!(
                "ebpf-proxy.io/lb-algorithm: {}",
                q(pick(ALGORITHMS, a))
            ));
        }
        if let Some(w) = self.weights {
            ann.push(format!("ebpf-proxy.io/weights: {}", q(pick(WEIGHTS, w))));
        }
        if !ann.is_empty() {
            meta += &format!(", annotations: {{{}}}", ann.join(", "));
        }
        let mut spec = Vec::new();
        if let Some(t) = self.type_ {
            spec.push(format!("type: {}", pick(TYPES, t)));
        }
        if let Some(ip) = &self.cluster_ip {
            spec.push(format!("clusterIP: {}", ip.yaml()));
        }
        if let Some(ips) = &self.cluster_ips {
            let ips: Vec<String> = first(ips, 3).iter().map(Addr::yaml).collect();
            spec.push(format!("clusterIPs: [{}]", ips.join(", ")));
        }
        let ports: Vec<String> = first(&self.ports, 4)
            .iter()
            .map(|p| {
                let mut f = vec![format!("port: {}", p.port.yaml())];
                if let Some(n) = p.name {
                    f.push(format!("name: {}", q(pick(PORT_NAMES, n))));
                }
                if let Some(pr) = p.protocol {
                    f.push(format!("protocol: {}", q(pick(PROTOCOLS, pr))));
                }
                if let Some(np) = &p.node_port {
                    f.push(format!("nodePort: {}", np.yaml()));
                }
                if let Some(tp) = &p.target_port {
                    f.push(format!("targetPort: {}", tp.yaml()));
                }
                format!("{{{}}}", f.join(", "))
            })
            .collect();
        spec.push(format!("ports: [{}]", ports.join(", ")));
        if !self.external_ips.is_empty() {
            let ips: Vec<String> = first(&self.external_ips, 3)
                .iter()
                .map(Addr::yaml)
                .collect();
            spec.push(format!("externalIPs: [{}]", ips.join(", ")));
        }
        if let Some(p) = self.external_policy {
            spec.push(format!("externalTrafficPolicy: {}", q(pick(POLICIES, p))));
        }
        if let Some(p) = self.internal_policy {
            spec.push(format!("internalTrafficPolicy: {}", q(pick(POLICIES, p))));
        }
        if let Some(p) = &self.health_check_node_port {
            spec.push(format!("healthCheckNodePort: {}", p.yaml()));
        }
        if !self.source_ranges.is_empty() {
            let r: Vec<String> = first(&self.source_ranges, 3)
                .iter()
                .map(Cidr::yaml)
                .collect();
            spec.push(format!("loadBalancerSourceRanges: [{}]", r.join(", ")));
        }
        if let Some(a) = self.affinity {
            spec.push(format!("sessionAffinity: {}", q(pick(AFFINITIES, a))));
        }
        if let Some(t) = self.affinity_timeout {
            spec.push(format!(
                "sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {t}}}}}"
            ));
        }
        let ingress: Vec<String> = first(&self.ingress, 3)
            .iter()
            .map(|i| {
                let mut f = Vec::new();
                if let Some(ip) = &i.ip {
                    f.push(format!("ip: {}", ip.yaml()));
                }
                if let Some(m) = i.mode {
                    f.push(format!(
                        "ipMode: {}",
                        q(pick(&["VIP", "Proxy", "Bogus"], m))
                    ));
                }
                format!("{{{}}}", f.join(", "))
            })
            .collect();
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{{meta}}}\nspec: {{{}}}\nstatus: {{loadBalancer: {{ingress: [{}]}}}}\n",
            spec.join(", "),
            ingress.join(", ")
        )
    }
}

/// One `endpoints[]` entry of a slice.
#[derive(Arbitrary, Debug)]
pub struct Endpoint {
    addresses: Vec<Addr>,
    node: Option<u8>,
    ready: Option<bool>,
    serving: Option<bool>,
    terminating: Option<bool>,
    zones: Option<Vec<u8>>,
    for_nodes: Option<Vec<u8>>,
    pod: Option<u8>,
}

/// One `ports[]` entry of a slice.
#[derive(Arbitrary, Debug)]
pub struct SlicePort {
    name: Option<u8>,
    protocol: Option<u8>,
    port: Option<Port>,
}

/// An EndpointSlice's fields.
#[derive(Arbitrary, Debug)]
pub struct SliceSpec {
    /// The Service it belongs to (`kubernetes.io/service-name`), none when unset.
    service: Option<u8>,
    address_type: u8,
    endpoints: Vec<Endpoint>,
    ports: Option<Vec<SlicePort>>,
}

impl SliceSpec {
    /// The slice as one YAML document.
    pub fn yaml(&self, ns: &str, name: &str) -> String {
        let labels = match self.service {
            Some(s) => format!(
                ", labels: {{kubernetes.io/service-name: {}}}",
                service_of(s).1
            ),
            None => String::new(),
        };
        let endpoints: Vec<String> = first(&self.endpoints, 6)
            .iter()
            .map(|e| {
                let a: Vec<String> = first(&e.addresses, 2).iter().map(Addr::yaml).collect();
                let mut f = vec![format!("addresses: [{}]", a.join(", "))];
                if let Some(n) = e.node {
                    f.push(format!("nodeName: {}", q(pick(NODES, n))));
                }
                let mut c = Vec::new();
                for (k, v) in [
                    ("ready", e.ready),
                    ("serving", e.serving),
                    ("terminating", e.terminating),
                ] {
                    if let Some(v) = v {
                        c.push(format!("{k}: {v}"));
                    }
                }
                if !c.is_empty() {
                    f.push(format!("conditions: {{{}}}", c.join(", ")));
                }
                let mut hints = Vec::new();
                if let Some(z) = &e.zones {
                    let z: Vec<String> = first(z, 2)
                        .iter()
                        .map(|z| format!("{{name: {}}}", q(pick(ZONES, *z))))
                        .collect();
                    hints.push(format!("forZones: [{}]", z.join(", ")));
                }
                if let Some(n) = &e.for_nodes {
                    let n: Vec<String> = first(n, 2)
                        .iter()
                        .map(|n| format!("{{name: {}}}", q(pick(NODES, *n))))
                        .collect();
                    hints.push(format!("forNodes: [{}]", n.join(", ")));
                }
                if !hints.is_empty() {
                    f.push(format!("hints: {{{}}}", hints.join(", ")));
                }
                if let Some(p) = e.pod {
                    f.push(format!("targetRef: {{kind: Pod, name: pod-{}}}", p % 4));
                }
                format!("{{{}}}", f.join(", "))
            })
            .collect();
        let ports = match &self.ports {
            None => String::new(),
            Some(ports) => {
                let p: Vec<String> = first(ports, 3)
                    .iter()
                    .map(|p| {
                        let mut f = Vec::new();
                        if let Some(n) = p.name {
                            f.push(format!("name: {}", q(pick(PORT_NAMES, n))));
                        }
                        if let Some(pr) = p.protocol {
                            f.push(format!("protocol: {}", q(pick(PROTOCOLS, pr))));
                        }
                        if let Some(port) = &p.port {
                            f.push(format!("port: {}", port.yaml()));
                        }
                        format!("{{{}}}", f.join(", "))
                    })
                    .collect();
                format!("ports: [{}]\n", p.join(", "))
            }
        };
        format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: {ns}{labels}}}\naddressType: {}\nendpoints: [{}]\n{ports}",
            q(pick(
                &["IPv4", "IPv6", "FQDN", "ipv4", "Bogus"],
                self.address_type
            )),
            endpoints.join(", ")
        )
    }
}

/// A Node's fields.
#[derive(Arbitrary, Debug)]
pub struct NodeSpec {
    /// node-1 (this node) or node-2.
    name: u8,
    zone: Option<u8>,
    /// (type, address).
    addresses: Vec<(u8, Addr)>,
}

impl NodeSpec {
    fn name(&self) -> &'static str {
        pick(&["node-1", "node-2"], self.name)
    }

    /// The Node as one YAML document.
    pub fn yaml(&self) -> String {
        let labels = match self.zone {
            Some(z) => format!(
                ", labels: {{topology.kubernetes.io/zone: {}}}",
                q(pick(ZONES, z))
            ),
            None => String::new(),
        };
        let a: Vec<String> = first(&self.addresses, 4)
            .iter()
            .map(|(t, a)| {
                format!(
                    "{{type: {}, address: {}}}",
                    pick(&["InternalIP", "ExternalIP", "Hostname", "Bogus"], *t),
                    a.yaml()
                )
            })
            .collect();
        format!(
            "---\napiVersion: v1\nkind: Node\nmetadata: {{name: {}{labels}}}\nstatus: {{addresses: [{}]}}\n",
            self.name(),
            a.join(", ")
        )
    }
}

// ---------------------------------------------------------------------------------------
// The `model` target.

/// One step of the `model` target.
#[derive(Arbitrary, Debug)]
pub enum Step {
    /// Adds or replaces a Service of [`SERVICES`].
    Service(u8, ServiceSpec),
    /// Adds or replaces slice `<service>-<0|1>` in the namespace of a Service of
    /// [`SERVICES`].
    Slice(u8, bool, SliceSpec),
    /// Adds or replaces a Node.
    Node(NodeSpec),
    /// Deletes a Service.
    DeleteService(u8),
    /// Deletes a slice.
    DeleteSlice(u8, bool),
    /// Deletes node-1 or node-2.
    DeleteNode(u8),
    /// Commits the model and programs the delta.
    Commit,
    /// Commits, programs, then verifies the maps.
    Verify,
}

/// The `model` target's input.
#[derive(Arbitrary, Debug)]
pub struct Scenario {
    /// Small map limits, so Services are refused for lack of room.
    small_maps: bool,
    /// `--nodeport-addresses primary`.
    nodeport_primary: bool,
    /// `--nodeport-addresses` CIDRs: none, or one of a pool.
    nodeport_cidr: Option<u8>,
    /// `--lb-algorithm`.
    default_algorithm: u8,
    /// The steps, at most [`MAX_STEPS`] used.
    steps: Vec<Step>,
}

/// Steps read from one input (keeps every run short).
pub const MAX_STEPS: usize = 48;

fn node_info(s: &Scenario) -> NodeInfo {
    NodeInfo {
        name: "node-1".into(),
        nodeport_addresses: s
            .nodeport_cidr
            .map(|i| pick(&["192.168.1.0/24", "192.168.1.6/32", "fd00::/64"], i))
            .map(|c| c.parse().expect("a CIDR of the pool"))
            .into_iter()
            .collect(),
        nodeport_primary: s.nodeport_primary,
        default_algorithm: parse_algorithm(pick(&ALGORITHMS[..6], s.default_algorithm))
            .expect("an algorithm of the pool"),
        north_south_mode: Default::default(),
    }
}

fn fake(small: bool) -> FakeDatapath {
    let cap = if small {
        Capacity {
            frontends: 12,
            slots: 10,
            backends: 6,
            services: 6,
        }
    } else {
        Capacity {
            frontends: 10_000,
            slots: 10_000,
            backends: 10_000,
            services: 10_000,
        }
    };
    let mut dp = FakeDatapath::new(cap);
    for (name, index, addrs) in [
        ("eth0", 2, &["192.168.1.5", "fd00::5"][..]),
        ("eth1", 3, &["192.168.1.6"][..]),
        ("br0", 4, &["10.0.0.254"][..]),
    ] {
        dp.interfaces.insert(
            name.into(),
            Interface {
                index,
                addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            },
        );
    }
    dp.routes
        .push(("10.0.0.0".parse().unwrap(), 24, "br0".into()));
    dp.busy_ports.insert(31001);
    dp
}

/// The changes one YAML document gives (none when it does not parse: a file whose only
/// object is broken holds nothing).
fn parsed(yaml: &str) -> Vec<Change> {
    let (objects, errors) = proxy_userspace::source::manifests::parse_documents("gen.yaml", yaml);
    check_objects("gen.yaml", &objects, &errors);
    objects.into_iter().map(Change::Apply).collect()
}

/// Checks one reconciler call: the maps are consistent at rest, and a Service port failed
/// only because it did not fit (refused whole before anything was written), never because
/// a write failed half-way.
fn check_outcome(dp: &FakeDatapath, out: &Outcome, what: &str) {
    let broken = dp.consistency_violations();
    assert!(broken.is_empty(), "after {what}: {broken:#?}");
    for (service, error) in &out.failed {
        assert!(
            error.contains(" is full: "),
            "after {what}: {service} failed other than for lack of room: {error}"
        );
    }
}

/// Runs one scenario: the model is fed change by change and the fake data path programmed
/// at every commit; see the crate documentation of the `model` target.
pub fn run(s: &Scenario) {
    let info = node_info(s);
    let mut model = Model::new(info.clone());
    let mut objects = ObjectSet::default();
    let mut dp = fake(s.small_maps);
    let config = NodeConfig {
        interfaces: Vec::new(),
        snat_local: true,
    };
    let mut rec = Reconciler::adopt(&dp, config, Duration::from_secs(30)).expect("empty maps");
    let now = Instant::now();
    let mut first_pass = true;
    let mut program = |model: &mut Model, rec: &mut Reconciler, dp: &mut FakeDatapath| {
        let delta = model.commit();
        let out = if std::mem::take(&mut first_pass) {
            rec.apply_all(dp, model, now)
        } else {
            rec.apply(dp, model, &delta, now)
        };
        check_outcome(dp, &out, "a commit");
    };
    for step in first(&s.steps, MAX_STEPS) {
        let changes = match step {
            Step::Service(i, spec) => {
                let (ns, name) = service_of(*i);
                parsed(&spec.yaml(ns, name))
            }
            Step::Slice(i, second, spec) => {
                let (ns, service) = service_of(*i);
                parsed(&spec.yaml(ns, &format!("{service}-{}", u8::from(*second))))
            }
            Step::Node(spec) => parsed(&spec.yaml()),
            Step::DeleteService(i) => {
                let (ns, name) = service_of(*i);
                vec![Change::Delete(Kind::Service, (ns.into(), name.into()))]
            }
            Step::DeleteSlice(i, second) => {
                let (ns, service) = service_of(*i);
                let name = format!("{service}-{}", u8::from(*second));
                vec![Change::Delete(Kind::EndpointSlice, (ns.into(), name))]
            }
            Step::DeleteNode(n) => {
                let name = pick(&["node-1", "node-2"], *n);
                vec![Change::Delete(Kind::Node, (String::new(), name.into()))]
            }
            Step::Commit => {
                program(&mut model, &mut rec, &mut dp);
                continue;
            }
            Step::Verify => {
                program(&mut model, &mut rec, &mut dp);
                let out = rec.verify(&mut dp, &model, now);
                check_outcome(&dp, &out, "a verification");
                assert_eq!(
                    (out.repaired.writes, out.repaired.deletes),
                    (0, 0),
                    "a verification right after a commit found differences"
                );
                continue;
            }
        };
        for c in changes {
            objects.apply(c.clone());
            model.apply(c);
        }
    }
    program(&mut model, &mut rec, &mut dp);

    // The incremental model agrees with a fresh full build of the final objects.
    let fresh = Model::from_objects(&objects, &info);
    assert_eq!(
        model.desired_state(),
        fresh.desired_state(),
        "the incremental desired state differs from a full build"
    );
    let errors = |m: &Model| {
        let mut v: Vec<String> = m.errors().iter().map(ToString::to_string).collect();
        v.sort();
        v
    };
    assert_eq!(
        errors(&model),
        errors(&fresh),
        "the errors differ from a full build"
    );
    assert_eq!(model.health_checks(), fresh.health_checks());
    let ranges = |m: &Model| {
        m.source_ranges()
            .map(|(ip, c)| (*ip, c.copied().collect::<Vec<_>>()))
            .collect::<BTreeMap<_, _>>()
    };
    assert_eq!(ranges(&model), ranges(&fresh), "source ranges differ");
    assert_eq!(
        model.local_endpoints().collect::<Vec<_>>(),
        fresh.local_endpoints().collect::<Vec<_>>(),
        "local endpoints differ"
    );

    // And the maps hold what was applied: a verification repairs nothing.
    let out = rec.verify(&mut dp, &model, now);
    check_outcome(&dp, &out, "the last verification");
    assert_eq!(
        (out.repaired.writes, out.repaired.deletes),
        (0, 0),
        "the last verification found differences"
    );
}
