//! Fixtures shared by the model's tests (objects from YAML, expected keys and sets) and the
//! tests that go through the whole model at once.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use crate::model::{
    DesiredService, DesiredState, Family, Model, NodeInfo, Protocol, Scope, ServicePortKey, build,
};
use crate::source::manifests::parse_documents;
use crate::source::{Change, ObjectSet};
use Family::V4;
use Protocol::Tcp;

/// Objects from YAML documents (origin "test.yaml"); the YAML must be valid.
pub(crate) fn objects(yaml: &str) -> ObjectSet {
    let (objs, errors) = parse_documents("test.yaml", yaml);
    assert!(errors.is_empty(), "fixture errors: {errors:?}");
    let mut set = ObjectSet::default();
    for o in objs {
        assert!(set.insert(o).is_none(), "duplicate in fixture");
    }
    set
}

pub(crate) fn build_yaml(yaml: &str) -> (DesiredState, Vec<String>) {
    build_yaml_on(
        yaml,
        &NodeInfo {
            name: "node-1".into(),
            ..Default::default()
        },
    )
}

pub(crate) fn build_yaml_on(yaml: &str, node: &NodeInfo) -> (DesiredState, Vec<String>) {
    let (state, errors) = build(&objects(yaml), node);
    (state, errors.iter().map(ToString::to_string).collect())
}

pub(crate) fn key(
    ns: &str,
    name: &str,
    port_name: &str,
    protocol: Protocol,
    family: Family,
) -> ServicePortKey {
    ServicePortKey {
        namespace: ns.into(),
        name: name.into(),
        port_name: port_name.into(),
        protocol,
        family,
        scope: Scope::Internal,
    }
}

pub(crate) fn addrs(list: &[&str]) -> BTreeSet<SocketAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

pub(crate) fn desired(frontends: &[&str], backends: &[&str]) -> DesiredService {
    DesiredService {
        frontends: addrs(frontends),
        backends: addrs(backends),
        flags: 0,
        ..Default::default()
    }
}

pub(crate) fn state(entries: Vec<(ServicePortKey, DesiredService)>) -> DesiredState {
    DesiredState {
        services: entries.into_iter().collect(),
    }
}

pub(crate) const NO_ERRORS: Vec<String> = Vec::new();

/// A Service with the given spec body (indented two spaces).
pub(crate) fn svc(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}"
    )
}

/// An EndpointSlice of Service `service` with the given body (top-level fields).
pub(crate) fn slice(ns: &str, name: &str, service: &str, body: &str) -> String {
    format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: {service}}}\n{body}"
    )
}

/// A good Service next to each bad one, to show the bad one does not affect it.
pub(crate) fn good() -> String {
    svc(
        "default",
        "good",
        "  clusterIP: 10.96.1.1\n  ports: [{port: 80}]\n",
    )
}

pub(crate) fn good_state() -> DesiredState {
    state(vec![(
        key("default", "good", "", Tcp, V4),
        desired(&["10.96.1.1:80"], &[]),
    )])
}

/// A Node manifest named `name` in `zone`.
pub(crate) fn node(name: &str, zone: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels: {{topology.kubernetes.io/zone: {zone}}}\n"
    )
}

/// One endpoint as a YAML flow mapping.
pub(crate) fn ep(addr: &str, node: &str, cond: &str, hints: &str) -> String {
    let mut s = format!("{{addresses: [{addr}], nodeName: {node}");
    if !cond.is_empty() {
        s += &format!(", conditions: {{{cond}}}");
    }
    if !hints.is_empty() {
        s += &format!(", hints: {{{hints}}}");
    }
    s + "}"
}

/// Backends of web's internal set (port 80/TCP/IPv4) for endpoints `eps`, seen from
/// node-1 in zone-a, with extra spec lines.
pub(crate) fn web_backends(spec_extra: &str, eps: &[String]) -> (DesiredService, Vec<String>) {
    let yaml = node("node-1", "zone-a")
        + &svc(
            "default",
            "web",
            &format!("  clusterIP: 10.96.0.10\n  ports: [{{port: 80}}]\n{spec_extra}"),
        )
        + &slice(
            "default",
            "web-1",
            "web",
            &format!(
                "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                eps.join(", ")
            ),
        );
    let (s, e) = build_yaml(&yaml);
    let d = s.services.get(&key("default", "web", "", Tcp, V4));
    (d.cloned().unwrap_or_default(), e)
}

pub(crate) fn set(list: &[&str]) -> BTreeSet<SocketAddr> {
    list.iter()
        .map(|a| format!("{a}:8080").parse().unwrap())
        .collect()
}

pub(crate) const LB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 31000\n  loadBalancerSourceRanges: ['192.0.2.0/24', ' 198.51.100.7/32', 'bogus', '2001:db8::/32']\n  ports: [{port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.9}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: lb-1, namespace: default, labels: {kubernetes.io/service-name: lb}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints:\n- {addresses: [10.0.1.5], nodeName: node-1}\n- {addresses: [10.0.2.5], nodeName: node-2}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 192.0.2.50}, {type: Hostname, address: n1}]}\n";

pub(crate) fn node1() -> NodeInfo {
    NodeInfo {
        name: "node-1".into(),
        ..Default::default()
    }
}

/// A model fed `yaml` and committed.
pub(crate) fn model(yaml: &str) -> Model {
    Model::from_objects(&objects(yaml), &node1())
}

pub(crate) fn apply_yaml(m: &mut Model, yaml: &str) {
    let (objs, errors) = parse_documents("test.yaml", yaml);
    assert!(errors.is_empty(), "{errors:?}");
    for o in objs {
        m.apply(Change::Apply(o));
    }
}

#[test]
fn cluster_ip_with_ready_endpoints() {
    let yaml = svc(
        "shop",
        "web",
        "  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80, targetPort: 8080}]\n",
    ) + &slice(
        "shop",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints:\n- addresses: [10.0.0.2]\n- addresses: [10.0.0.1]\n  conditions: {ready: true}\nports: [{name: http, port: 8080, protocol: TCP}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![(
            key("shop", "web", "http", Tcp, V4),
            desired(&["10.96.0.10:80"], &["10.0.0.1:8080", "10.0.0.2:8080"])
        )])
    );
}

#[test]
fn build_is_deterministic() {
    let yaml = svc(
        "b",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    ) + &svc(
        "a",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    );
    let (s1, e1) = build_yaml(&yaml);
    let (s2, e2) = build_yaml(&yaml);
    assert_eq!((&s1, &e1), (&s2, &e2));
    // Namespace "a" sorts first and keeps the frontend.
    assert_eq!(
        e1,
        vec![
            "test.yaml: Service b/web: frontend 10.96.0.3:80/TCP is already used by Service a/web; Service skipped"
        ]
    );
}
