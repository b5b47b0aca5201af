use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::*;
use crate::source::ObjectSet;
use crate::source::manifests::parse_documents;
use crate::source::{Change, Kind};

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

fn build_yaml(yaml: &str) -> (DesiredState, Vec<String>) {
    build_yaml_on(
        yaml,
        &NodeInfo {
            name: "node-1".into(),
            ..Default::default()
        },
    )
}

fn build_yaml_on(yaml: &str, node: &NodeInfo) -> (DesiredState, Vec<String>) {
    let (state, errors) = build(&objects(yaml), node);
    (state, errors.iter().map(ToString::to_string).collect())
}

fn key(
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

fn addrs(list: &[&str]) -> BTreeSet<SocketAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

fn desired(frontends: &[&str], backends: &[&str]) -> DesiredService {
    DesiredService {
        frontends: addrs(frontends),
        backends: addrs(backends),
        flags: 0,
        ..Default::default()
    }
}

fn state(entries: Vec<(ServicePortKey, DesiredService)>) -> DesiredState {
    DesiredState {
        services: entries.into_iter().collect(),
    }
}

use Family::{V4, V6};
use Protocol::{Tcp, Udp};

const NO_ERRORS: Vec<String> = Vec::new();

/// A Service with the given spec body (indented two spaces).
fn svc(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{spec}"
    )
}

/// An EndpointSlice of Service `service` with the given body (top-level fields).
fn slice(ns: &str, name: &str, service: &str, body: &str) -> String {
    format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: {service}}}\n{body}"
    )
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
fn dual_stack_cluster_ips_split_by_family() {
    let yaml = svc(
        "default",
        "ds",
        "  clusterIP: 10.96.0.20\n  clusterIPs: [10.96.0.20, 'fd00::20']\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "ds-v4",
        "ds",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
    ) + &slice(
        "default",
        "ds-v6",
        "ds",
        "addressType: IPv6\nendpoints: [{addresses: ['fd01::1']}]\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![
            (
                key("default", "ds", "", Tcp, V4),
                desired(&["10.96.0.20:80"], &["10.0.0.1:8080"])
            ),
            (
                key("default", "ds", "", Tcp, V6),
                desired(&["[fd00::20]:80"], &["[fd01::1]:8080"])
            ),
        ])
    );
}

#[test]
fn cluster_ips_take_precedence_and_cluster_ip_is_the_fallback() {
    // clusterIPs alone (IPv6 first).
    let yaml = svc(
        "default",
        "a",
        "  clusterIPs: ['fd00::1', 10.96.0.1]\n  ports: [{port: 80}]\n",
    ) + &svc(
        "default",
        "b",
        "  clusterIP: 10.96.0.2\n  clusterIPs: []\n  ports: [{port: 80}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![
            (
                key("default", "a", "", Tcp, V4),
                desired(&["10.96.0.1:80"], &[])
            ),
            (
                key("default", "a", "", Tcp, V6),
                desired(&["[fd00::1]:80"], &[])
            ),
            (
                key("default", "b", "", Tcp, V4),
                desired(&["10.96.0.2:80"], &[])
            ),
        ])
    );
}

#[test]
fn headless_external_name_and_no_cluster_ip_are_ignored() {
    let yaml = svc(
        "default",
        "headless",
        "  clusterIP: None\n  ports: [{port: 80}]\n",
    ) + &svc(
        "default",
        "headless2",
        "  clusterIPs: [None]\n  ports: [{port: 80}]\n",
    ) + &svc(
        "default",
        "ext",
        "  type: ExternalName\n  externalName: example.com\n  ports: [{port: 80}]\n",
    ) + &svc("default", "noip", "  ports: [{port: 80}]\n")
        + &svc(
            "default",
            "emptyip",
            "  clusterIP: ''\n  ports: [{port: 80}]\n",
        )
        + "---\napiVersion: v1\nkind: Service\nmetadata: {name: nospec}\n"
        + &slice(
            "default",
            "headless-1",
            "headless",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 80}]\n",
        );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(s, DesiredState::default());
}

#[test]
fn node_port_and_load_balancer_services_use_their_cluster_ips() {
    let yaml = svc(
        "default",
        "np",
        "  type: NodePort\n  clusterIP: 10.96.0.5\n  ports: [{port: 80, nodePort: 30080}]\n",
    ) + &svc(
        "default",
        "lb",
        "  type: LoadBalancer\n  clusterIP: 10.96.0.6\n  ports: [{port: 443}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![
            (
                key("default", "lb", "", Tcp, V4),
                desired(&["10.96.0.6:443"], &[])
            ),
            (
                key("default", "np", "", Tcp, V4),
                desired(&["10.96.0.5:80"], &[])
            ),
        ])
    );
}

#[test]
fn protocols_default_tcp_udp_and_sctp_warning() {
    let yaml = svc(
        "kube-system",
        "dns",
        "  clusterIP: 10.96.0.10\n  ports:\n  - {name: dns, port: 53, protocol: UDP}\n  - {name: dns-tcp, port: 53}\n  - {name: sig, port: 9000, protocol: SCTP}\n",
    ) + &slice(
        "kube-system",
        "dns-1",
        "dns",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.53]}]\nports:\n- {name: dns, port: 5353, protocol: UDP}\n- {name: dns-tcp, port: 5353}\n- {name: sig, port: 9000, protocol: SCTP}\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(
        e,
        vec![
            "test.yaml: Service kube-system/dns: port 9000/SCTP (\"sig\"): SCTP is not supported; port skipped"
        ]
    );
    assert_eq!(
        s,
        state(vec![
            (
                key("kube-system", "dns", "dns", Udp, V4),
                desired(&["10.96.0.10:53"], &["10.0.0.53:5353"])
            ),
            (
                key("kube-system", "dns", "dns-tcp", Tcp, V4),
                desired(&["10.96.0.10:53"], &["10.0.0.53:5353"])
            ),
        ])
    );
    assert_eq!(Tcp.number(), 6);
    assert_eq!(Udp.number(), 17);
}

/// A good Service next to each bad one, to show the bad one does not affect it.
fn good() -> String {
    svc(
        "default",
        "good",
        "  clusterIP: 10.96.1.1\n  ports: [{port: 80}]\n",
    )
}

fn good_state() -> DesiredState {
    state(vec![(
        key("default", "good", "", Tcp, V4),
        desired(&["10.96.1.1:80"], &[]),
    )])
}

fn assert_rejected(spec: &str, reason: &str) {
    let (s, e) = build_yaml(&(good() + &svc("default", "bad", spec)));
    assert_eq!(
        e,
        vec![format!(
            "test.yaml: Service default/bad: {reason}; Service skipped"
        )],
        "{spec}"
    );
    assert_eq!(s, good_state(), "{spec}");
}

#[test]
fn invalid_cluster_ip_skips_the_service() {
    assert_rejected(
        "  clusterIP: 10.96.0.300\n  ports: [{port: 80}]\n",
        "invalid cluster IP: \"10.96.0.300\" is not a valid IP address",
    );
    assert_rejected(
        "  clusterIPs: [10.96.0.3, nonsense]\n  ports: [{port: 80}]\n",
        "invalid cluster IP: \"nonsense\" is not a valid IP address",
    );
    assert_rejected(
        "  clusterIP: 127.0.0.1\n  ports: [{port: 80}]\n",
        "cluster IP 127.0.0.1 is not usable (unspecified, loopback, link-local, multicast or broadcast)",
    );
    assert_rejected(
        "  clusterIP: 0.0.0.0\n  ports: [{port: 80}]\n",
        "cluster IP 0.0.0.0 is not usable (unspecified, loopback, link-local, multicast or broadcast)",
    );
    // An IPv4-mapped IPv6 address would turn an IPv6 Service into an IPv4 frontend.
    assert_rejected(
        "  ipFamilies: [IPv6]\n  clusterIP: '::ffff:198.19.200.90'\n  ports: [{port: 80}]\n",
        "invalid cluster IP: \"::ffff:198.19.200.90\" is an IPv4-mapped IPv6 address (write the IPv4 address itself)",
    );
}

#[test]
fn two_cluster_ips_of_one_family_skip_the_service() {
    assert_rejected(
        "  clusterIPs: [10.96.0.3, 10.96.0.4]\n  ports: [{port: 80}]\n",
        "clusterIPs has two IPv4 addresses (10.96.0.3 and 10.96.0.4)",
    );
    assert_rejected(
        "  clusterIPs: ['fd00::3', 10.96.0.4, 'fd00::4']\n  ports: [{port: 80}]\n",
        "clusterIPs has two IPv6 addresses (fd00::3 and fd00::4)",
    );
}

#[test]
fn cluster_ip_must_match_first_cluster_ips() {
    assert_rejected(
        "  clusterIP: 10.96.0.3\n  clusterIPs: [10.96.0.4]\n  ports: [{port: 80}]\n",
        "clusterIP 10.96.0.3 does not match clusterIPs[0] 10.96.0.4",
    );
}

#[test]
fn out_of_range_ports_skip_the_service() {
    assert_rejected(
        "  clusterIP: 10.96.0.3\n  ports: [{port: 0}]\n",
        "port 0 is out of range 1-65535",
    );
    assert_rejected(
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80, name: a}, {name: big, port: 65536}]\n",
        "port 65536 (\"big\") is out of range 1-65535",
    );
    assert_rejected(
        "  clusterIP: 10.96.0.3\n  ports: [{port: -1}]\n",
        "port -1 is out of range 1-65535",
    );
}

#[test]
fn duplicate_ports_skip_the_service() {
    assert_rejected(
        "  clusterIP: 10.96.0.3\n  ports: [{name: a, port: 80}, {name: b, port: 80, protocol: TCP}]\n",
        "port 80/TCP is defined twice",
    );
    assert_rejected(
        "  clusterIP: 10.96.0.3\n  ports: [{name: a, port: 80}, {name: a, port: 81}]\n",
        "port name \"a\" is used twice",
    );
    assert_rejected(
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}, {port: 81}]\n",
        "port name \"\" is used twice",
    );
    assert_rejected(
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80, protocol: HTTP}]\n",
        "unsupported protocol \"HTTP\" on port 80",
    );
}

#[test]
fn colliding_frontend_skips_the_later_service() {
    let yaml = good()
        + &svc(
            "default",
            "later",
            "  clusterIP: 10.96.1.1\n  ports: [{port: 80}]\n",
        )
        + &svc(
            "default",
            "other-port",
            "  clusterIP: 10.96.1.1\n  ports: [{port: 81}]\n",
        );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(
        e,
        vec![
            "test.yaml: Service default/later: frontend 10.96.1.1:80/TCP is already used by Service default/good; Service skipped"
        ]
    );
    assert_eq!(
        s,
        state(vec![
            (
                key("default", "good", "", Tcp, V4),
                desired(&["10.96.1.1:80"], &[])
            ),
            (
                key("default", "other-port", "", Tcp, V4),
                desired(&["10.96.1.1:81"], &[])
            ),
        ])
    );
}

#[test]
fn service_without_ports_has_no_frontends() {
    let (s, e) = build_yaml(&svc("default", "noports", "  clusterIP: 10.96.0.3\n"));
    assert_eq!(e, NO_ERRORS);
    assert_eq!(s, DesiredState::default());
}

#[test]
fn slices_link_by_label_in_the_same_namespace_only() {
    let yaml = svc("a", "web", "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n")
        + &slice("a", "web-1", "web", "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n")
        // Same label, other namespace.
        + &slice("b", "web-1", "web", "addressType: IPv4\nendpoints: [{addresses: [10.0.0.2]}]\nports: [{port: 8080}]\n")
        // No label.
        + "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-x, namespace: a}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.3]}]\nports: [{port: 8080}]\n";
    let (s, e) = build_yaml(&yaml);
    // The slice without the label is ignored, with one warning naming it.
    assert_eq!(
        e,
        [
            "test.yaml: EndpointSlice a/web-x: no kubernetes.io/service-name label, so it belongs to no Service; slice ignored (as kube-proxy does)"
        ]
    );
    assert_eq!(
        s,
        state(vec![(
            key("a", "web", "", Tcp, V4),
            desired(&["10.96.0.3:80"], &["10.0.0.1:8080"])
        )])
    );
}

#[test]
fn selectorless_service_with_hand_made_slice() {
    let yaml = svc(
        "default",
        "ext-db",
        "  clusterIP: 10.96.0.7\n  ports: [{name: pg, port: 5432}]\n",
    ) + &slice(
        "default",
        "ext-db-manual",
        "ext-db",
        "addressType: IPv4\nendpoints: [{addresses: [192.168.1.10]}, {addresses: [192.168.1.11]}]\nports: [{name: pg, port: 5432}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![(
            key("default", "ext-db", "pg", Tcp, V4),
            desired(
                &["10.96.0.7:5432"],
                &["192.168.1.10:5432", "192.168.1.11:5432"]
            )
        )])
    );
}

#[test]
fn address_types_fqdn_ignored_unknown_rejected() {
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "web-fqdn",
        "web",
        "addressType: FQDN\nendpoints: [{addresses: [example.com]}]\nports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "web-odd",
        "web",
        "addressType: IPX\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 80}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(
        e,
        vec![
            "test.yaml: EndpointSlice default/web-odd: unsupported addressType \"IPX\"; EndpointSlice skipped"
        ]
    );
    assert_eq!(
        s,
        state(vec![(
            key("default", "web", "", Tcp, V4),
            desired(&["10.96.0.3:80"], &[])
        )])
    );
}

#[test]
fn readiness_unset_is_ready_false_and_terminating_are_excluded() {
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints:\n- addresses: [10.0.0.1]\n- addresses: [10.0.0.2]\n  conditions: {}\n- addresses: [10.0.0.3]\n  conditions: {ready: true, serving: true}\n- addresses: [10.0.0.4]\n  conditions: {ready: false}\n- addresses: [10.0.0.5]\n  conditions: {ready: false, serving: true, terminating: true}\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![(
            key("default", "web", "", Tcp, V4),
            desired(
                &["10.96.0.3:80"],
                &["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]
            )
        )])
    );
}

#[test]
fn only_the_first_address_of_an_endpoint_is_used() {
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1, 10.0.0.2]}, {addresses: []}]\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(
        e,
        vec![
            "test.yaml: EndpointSlice default/web-1: endpoint 1 has no addresses; endpoint skipped"
        ]
    );
    assert_eq!(
        s,
        state(vec![(
            key("default", "web", "", Tcp, V4),
            desired(&["10.96.0.3:80"], &["10.0.0.1:8080"])
        )])
    );
}

#[test]
fn bad_endpoint_addresses_skip_only_that_endpoint() {
    let yaml = svc(
        "default",
        "web",
        "  clusterIPs: [10.96.0.3, 'fd00::3']\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "web-v4",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.999]}, {addresses: ['fd01::1']}, {addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
    ) + &slice(
        "default",
        "web-v6",
        "web",
        "addressType: IPv6\nendpoints: [{addresses: [10.0.0.2]}, {addresses: ['fd01::2']}, {addresses: ['::ffff:10.0.0.4']}, {addresses: ['fe80::1']}]\nports: [{port: 8080}]\n",
    ) + &slice(
        "default",
        "web-special",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [127.0.0.1]}, {addresses: [169.254.169.254]}, {addresses: [224.0.0.1]}, {addresses: [0.0.0.0]}]\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(
        e,
        vec![
            "test.yaml: EndpointSlice default/web-special: endpoint address 127.0.0.1 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
            "test.yaml: EndpointSlice default/web-special: endpoint address 169.254.169.254 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
            "test.yaml: EndpointSlice default/web-special: endpoint address 224.0.0.1 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
            "test.yaml: EndpointSlice default/web-special: endpoint address 0.0.0.0 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
            "test.yaml: EndpointSlice default/web-v4: endpoint address \"10.0.0.999\" is not a valid IP address; endpoint skipped",
            "test.yaml: EndpointSlice default/web-v4: endpoint address fd01::1 is not an IPv4 address (addressType IPv4); endpoint skipped",
            "test.yaml: EndpointSlice default/web-v6: endpoint address 10.0.0.2 is not an IPv6 address (addressType IPv6); endpoint skipped",
            "test.yaml: EndpointSlice default/web-v6: endpoint address \"::ffff:10.0.0.4\" is an IPv4-mapped IPv6 address (write the IPv4 address itself); endpoint skipped",
            "test.yaml: EndpointSlice default/web-v6: endpoint address fe80::1 is not usable (unspecified, loopback, link-local, multicast or broadcast); endpoint skipped",
        ]
    );
    assert_eq!(
        s,
        state(vec![
            (
                key("default", "web", "", Tcp, V4),
                desired(&["10.96.0.3:80"], &["10.0.0.1:8080"])
            ),
            (
                key("default", "web", "", Tcp, V6),
                desired(&["[fd00::3]:80"], &["[fd01::2]:8080"])
            ),
        ])
    );
}

#[test]
fn bad_slice_ports_skip_only_that_port() {
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{name: a, port: 80}, {name: b, port: 81}, {name: c, port: 82}, {name: d, port: 83}]\n",
    ) + &slice(
        "default",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports:\n- {name: a, port: 0}\n- {name: b, port: 70000}\n- {name: c}\n- {name: d, port: 8083}\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(
        e,
        vec![
            "test.yaml: EndpointSlice default/web-1: port 0 (\"a\") is out of range 1-65535; port skipped",
            "test.yaml: EndpointSlice default/web-1: port 70000 (\"b\") is out of range 1-65535; port skipped",
            "test.yaml: EndpointSlice default/web-1: port (\"c\") has no port number; port skipped",
        ]
    );
    assert_eq!(
        s,
        state(vec![
            (
                key("default", "web", "a", Tcp, V4),
                desired(&["10.96.0.3:80"], &[])
            ),
            (
                key("default", "web", "b", Tcp, V4),
                desired(&["10.96.0.3:81"], &[])
            ),
            (
                key("default", "web", "c", Tcp, V4),
                desired(&["10.96.0.3:82"], &[])
            ),
            (
                key("default", "web", "d", Tcp, V4),
                desired(&["10.96.0.3:83"], &["10.0.0.1:8083"])
            ),
        ])
    );
}

#[test]
fn target_port_resolution_by_port_name_per_slice() {
    // Named targetPort resolved differently on two slices, even for the same IP.
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{name: http, port: 80, targetPort: web}, {name: metrics, port: 9100}]\n",
    ) + &slice(
        "default",
        "web-old",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}, {addresses: [10.0.0.2]}]\nports: [{name: http, port: 8080}, {name: metrics, port: 9100}]\n",
    ) + &slice(
        "default",
        "web-new",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{name: http, port: 9090}]\n",
    ) + &slice(
        "default",
        "web-other-name",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.9]}]\nports: [{name: https, port: 8443}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![
            (
                key("default", "web", "http", Tcp, V4),
                desired(
                    &["10.96.0.3:80"],
                    &["10.0.0.1:8080", "10.0.0.1:9090", "10.0.0.2:8080"]
                )
            ),
            (
                key("default", "web", "metrics", Tcp, V4),
                desired(&["10.96.0.3:9100"], &["10.0.0.1:9100", "10.0.0.2:9100"])
            ),
        ])
    );
}

#[test]
fn unnamed_port_matches_unnamed_or_empty_named_slice_ports() {
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80, targetPort: 8080}]\n",
    ) + &slice(
        "default",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
    ) + &slice(
        "default",
        "web-2",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.2]}]\nports: [{name: '', port: 8080}]\n",
    ) + &slice(
        "default",
        "web-3",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.3]}]\nports: [{name: http, port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![(
            key("default", "web", "", Tcp, V4),
            desired(&["10.96.0.3:80"], &["10.0.0.1:8080", "10.0.0.2:8080"])
        )])
    );
}

#[test]
fn slice_port_protocol_must_match() {
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{name: p, port: 80}]\n",
    ) + &slice(
        "default",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{name: p, port: 8080, protocol: UDP}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![(
            key("default", "web", "p", Tcp, V4),
            desired(&["10.96.0.3:80"], &[])
        )])
    );
}

#[test]
fn slices_are_merged_and_backends_deduplicated() {
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}, {addresses: [10.0.0.2]}, {addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
    ) + &slice(
        "default",
        "web-2",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.2]}, {addresses: [10.0.0.3]}]\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![(
            key("default", "web", "", Tcp, V4),
            desired(
                &["10.96.0.3:80"],
                &["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]
            )
        )])
    );
}

#[test]
fn frontend_without_endpoints_and_endpoints_without_frontend_family() {
    // IPv4-only Service: the IPv6 slice is dropped; no slice at all still gives a
    // frontend with empty backends.
    let yaml = svc(
        "default",
        "v4only",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "v4only-v6",
        "v4only",
        "addressType: IPv6\nendpoints: [{addresses: ['fd01::1']}]\nports: [{port: 8080}]\n",
    ) + &svc(
        "default",
        "empty",
        "  clusterIPs: [10.96.0.4, 'fd00::4']\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "empty-v4",
        "empty",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1], conditions: {ready: false}}]\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(
        s,
        state(vec![
            (
                key("default", "empty", "", Tcp, V4),
                desired(&["10.96.0.4:80"], &[])
            ),
            (
                key("default", "empty", "", Tcp, V6),
                desired(&["[fd00::4]:80"], &[])
            ),
            (
                key("default", "v4only", "", Tcp, V4),
                desired(&["10.96.0.3:80"], &[])
            ),
        ])
    );
}

#[test]
fn slice_errors_are_reported_even_without_a_service() {
    let yaml = slice(
        "default",
        "orphan",
        "gone",
        "addressType: IPv4\nendpoints: [{addresses: [bad]}]\nports: [{port: 80}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(
        e,
        vec![
            "test.yaml: EndpointSlice default/orphan: endpoint address \"bad\" is not a valid IP address; endpoint skipped"
        ]
    );
    assert_eq!(s, DesiredState::default());
}

#[test]
fn counts() {
    // Two Services share a backend (same addr, port, proto): one backend, two slots.
    let yaml = svc(
        "default",
        "a",
        "  clusterIPs: [10.96.0.1, 'fd00::1']\n  ports: [{name: x, port: 80}, {name: y, port: 53, protocol: UDP}]\n",
    ) + &svc(
        "default",
        "b",
        "  clusterIP: 10.96.0.2\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "a-1",
        "a",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}, {addresses: [10.0.0.2]}]\nports: [{name: x, port: 8080}, {name: y, port: 8080, protocol: UDP}]\n",
    ) + &slice(
        "default",
        "b-1",
        "b",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(s.services.len(), 5);
    assert_eq!(
        s.vips(),
        ["10.96.0.1", "10.96.0.2", "fd00::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect()
    );
    // a: 2 ports x 2 families, b: 1.
    assert_eq!(s.frontend_count(), 5);
    // 10.0.0.1:8080/TCP, 10.0.0.2:8080/TCP, 10.0.0.1:8080/UDP, 10.0.0.2:8080/UDP.
    assert_eq!(s.backend_count(), 4);
    // a/x/V4: 2, a/y/V4: 2, b/V4: 1, the V6 sets: 0.
    assert_eq!(s.slot_count(), 5);
    assert_eq!(DesiredState::default().frontend_count(), 0);
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

#[test]
fn the_oldest_service_keeps_a_contested_external_ip() {
    let with_time = |name: &str, t: &str| {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default, creationTimestamp: '{t}'}}\nspec:\n  clusterIP: 10.96.0.{}\n  externalIPs: [192.0.2.7]\n  ports: [{{port: 80}}]\n",
            if name == "web" { 3 } else { 4 }
        )
    };
    // "dup" sorts before "web" but was created later: "web" keeps the address.
    let yaml = with_time("web", "2026-01-01T00:00:00Z") + &with_time("dup", "2026-06-01T00:00:00Z");
    let (_, e) = build_yaml(&yaml);
    assert_eq!(
        e,
        vec![
            "test.yaml: Service default/dup: externalIP 192.0.2.7: frontend 192.0.2.7:80/TCP is already used by Service default/web; address skipped"
        ]
    );
}

/// A Node manifest named `name` in `zone`.
fn node(name: &str, zone: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels: {{topology.kubernetes.io/zone: {zone}}}\n"
    )
}

/// One endpoint as a YAML flow mapping.
fn ep(addr: &str, node: &str, cond: &str, hints: &str) -> String {
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
fn web_backends(spec_extra: &str, eps: &[String]) -> (DesiredService, Vec<String>) {
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

fn set(list: &[&str]) -> BTreeSet<SocketAddr> {
    list.iter()
        .map(|a| format!("{a}:8080").parse().unwrap())
        .collect()
}

#[test]
fn terminating_endpoints_are_used_only_when_none_is_ready() {
    let ready = ep("10.0.0.1", "node-2", "", "");
    let term_serving = ep(
        "10.0.0.2",
        "node-2",
        "ready: false, serving: true, terminating: true",
        "",
    );
    let term_not_serving = ep(
        "10.0.0.3",
        "node-2",
        "ready: false, serving: false, terminating: true",
        "",
    );
    let not_ready = ep("10.0.0.4", "node-2", "ready: false", "");
    let all = [
        ready.clone(),
        term_serving.clone(),
        term_not_serving.clone(),
        not_ready.clone(),
    ];
    assert_eq!(web_backends("", &all).0.backends, set(&["10.0.0.1"]));
    // No ready endpoint: the serving terminating ones.
    let (d, e) = web_backends("", &all[1..]);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(d.backends, set(&["10.0.0.2"]));
    // Terminating but not serving, or not ready without terminating: nothing.
    assert_eq!(web_backends("", &all[2..]).0.backends, set(&[]));
}

#[test]
fn internal_traffic_policy_local_uses_this_nodes_endpoints_and_flags_the_frontend() {
    let eps = [
        ep("10.0.0.1", "node-1", "", ""),
        ep("10.0.0.2", "node-2", "", ""),
    ];
    let (d, e) = web_backends("  internalTrafficPolicy: Local\n", &eps);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(d.backends, set(&["10.0.0.1"]));
    assert_eq!(d.flags, proxy_common::FRONTEND_F_LOCAL_ONLY);
    // None local: empty, still flagged (EHOSTUNREACH rather than ECONNREFUSED).
    let (d, _) = web_backends("  internalTrafficPolicy: Local\n", &eps[1..]);
    assert!(d.backends.is_empty());
    assert_eq!(d.flags, proxy_common::FRONTEND_F_LOCAL_ONLY);
    // No usable endpoint on any node (a not-ready one only): kube-proxy rejects, so the
    // frontend says there are none at all.
    let not_ready = [ep("10.0.0.2", "node-2", "ready: false", "")];
    let (d, _) = web_backends("  internalTrafficPolicy: Local\n", &not_ready);
    assert!(d.backends.is_empty());
    assert_eq!(
        d.flags,
        proxy_common::FRONTEND_F_LOCAL_ONLY | proxy_common::FRONTEND_F_NO_ENDPOINTS
    );
    // Cluster policy without endpoints carries no policy flag.
    let (d, _) = web_backends("", &not_ready);
    assert_eq!(d.flags, 0);
    // Local falls back to this node's serving terminating endpoints, independently of
    // the cluster-wide ready ones.
    let eps = [
        ep(
            "10.0.0.1",
            "node-1",
            "ready: false, serving: true, terminating: true",
            "",
        ),
        ep("10.0.0.2", "node-2", "", ""),
    ];
    let (d, _) = web_backends("  internalTrafficPolicy: Local\n", &eps);
    assert_eq!(d.backends, set(&["10.0.0.1"]));
    // Cluster policy (explicit) uses both nodes.
    let (d, _) = web_backends("  internalTrafficPolicy: Cluster\n", &eps);
    assert_eq!(d.backends, set(&["10.0.0.2"]));
    assert_eq!(d.flags, 0);
    let (_, e) = web_backends("  internalTrafficPolicy: Nearby\n", &eps);
    assert_eq!(
        e,
        vec![
            "test.yaml: Service default/web: internalTrafficPolicy \"Nearby\" is not Cluster or Local; Service skipped"
        ]
    );
}

#[test]
fn zone_hints_narrow_the_cluster_set_with_kube_proxys_fallbacks() {
    let za = "forZones: [{name: zone-a}]";
    let zb = "forZones: [{name: zone-b}]";
    let eps = [
        ep("10.0.0.1", "node-1", "", za),
        ep("10.0.0.2", "node-2", "", zb),
        ep("10.0.0.3", "node-3", "", za),
    ];
    assert_eq!(
        web_backends("", &eps).0.backends,
        set(&["10.0.0.1", "10.0.0.3"])
    );
    // trafficDistribution is the controller's input; kube-proxy (and we) read hints.
    assert_eq!(
        web_backends("  trafficDistribution: PreferClose\n", &eps)
            .0
            .backends,
        set(&["10.0.0.1", "10.0.0.3"])
    );
    // One ready endpoint without hints: hints are ignored.
    let partial = [
        eps[0].clone(),
        eps[1].clone(),
        ep("10.0.0.3", "node-3", "", ""),
    ];
    assert_eq!(
        web_backends("", &partial).0.backends,
        set(&["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    );
    // A not-ready endpoint without hints does not disable them.
    let with_unready = [
        eps[0].clone(),
        eps[1].clone(),
        ep("10.0.0.4", "node-3", "ready: false", ""),
    ];
    assert_eq!(
        web_backends("", &with_unready).0.backends,
        set(&["10.0.0.1"])
    );
    // No endpoint for this zone: every endpoint.
    let other_zone = [eps[1].clone(), ep("10.0.0.5", "node-2", "", zb)];
    assert_eq!(
        web_backends("", &other_zone).0.backends,
        set(&["10.0.0.2", "10.0.0.5"])
    );
}

#[test]
fn node_hints_win_over_zone_hints_and_need_this_node() {
    let h = |zone: &str, node: &str| {
        format!("forZones: [{{name: {zone}}}], forNodes: [{{name: {node}}}]")
    };
    let eps = [
        ep("10.0.0.1", "node-1", "", &h("zone-a", "node-1")),
        ep("10.0.0.2", "node-2", "", &h("zone-a", "node-2")),
        ep("10.0.0.3", "node-3", "", &h("zone-b", "node-3")),
    ];
    assert_eq!(web_backends("", &eps).0.backends, set(&["10.0.0.1"]));
    // No endpoint hinted for node-1: zone hints apply.
    assert_eq!(web_backends("", &eps[1..]).0.backends, set(&["10.0.0.2"]));
    let sets = categorize(&PortEndpoints::new(), "node-1", "zone-a");
    assert_eq!(sets, EndpointSets::default());
}

#[test]
fn zone_hints_need_the_node_zone_label() {
    // Same endpoints, Node object without a zone: hints cannot match, all are used.
    let yaml = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "web-1",
        "web",
        &format!(
            "addressType: IPv4\nendpoints: [{}, {}]\nports: [{{port: 8080}}]\n",
            ep("10.0.0.1", "node-1", "", "forZones: [{name: zone-a}]"),
            ep("10.0.0.2", "node-2", "", "forZones: [{name: zone-b}]")
        ),
    );
    let (s, _) = build_yaml(&yaml);
    assert_eq!(
        s.services[&key("default", "web", "", Tcp, V4)].backends,
        set(&["10.0.0.1", "10.0.0.2"])
    );
}

#[test]
fn external_addresses_get_the_cluster_endpoints_whatever_the_policies() {
    let eps = [
        ep("10.0.0.1", "node-1", "", ""),
        ep("10.0.0.2", "node-2", "", ""),
    ];
    let yaml = svc(
        "default",
        "lb",
        "  type: LoadBalancer\n  clusterIPs: [10.96.0.10, 'fd00::10']\n  ports: [{port: 80}]\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Local\n  externalIPs: [192.0.2.7, 'not-an-ip', 127.0.0.1, '::ffff:192.0.2.9', 169.254.169.254]\n",
    ) + "status:\n  loadBalancer:\n    ingress:\n    - {ip: 192.0.2.8}\n    - {ip: 192.0.2.9, ipMode: Proxy}\n    - {ip: '2001:db8::8'}\n    - {hostname: lb.example.com}\n"
        + &slice(
            "default",
            "lb-1",
            "lb",
            &format!(
                "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                eps.join(", ")
            ),
        )
        + &svc(
            "default",
            "single",
            "  clusterIP: 10.96.0.11\n  ports: [{port: 80}]\n  externalIPs: ['2001:db8::1', 192.0.2.7]\n",
        );
    let (s, e) = build_yaml(&yaml);
    let ext = ServicePortKey {
        scope: Scope::External,
        ..key("default", "lb", "", Tcp, V4)
    };
    assert_eq!(
        s.services[&ext],
        DesiredService {
            frontends: addrs(&["192.0.2.7:80", "192.0.2.8:80"]),
            backends: set(&["10.0.0.1", "10.0.0.2"]),
            flags: proxy_common::FRONTEND_F_EXTERNAL,
            ..Default::default()
        }
    );
    // From outside the node the same frontends follow externalTrafficPolicy: Local.
    let ingress = ServicePortKey {
        scope: Scope::Ingress,
        ..key("default", "lb", "", Tcp, V4)
    };
    assert_eq!(
        s.services[&ingress],
        DesiredService {
            frontends: addrs(&["192.0.2.7:80", "192.0.2.8:80"]),
            backends: set(&["10.0.0.1"]),
            flags: proxy_common::FRONTEND_F_EXTERNAL | proxy_common::FRONTEND_F_LOCAL_ONLY,
            ..Default::default()
        }
    );
    let ext6 = ServicePortKey {
        scope: Scope::External,
        ..key("default", "lb", "", Tcp, V6)
    };
    assert_eq!(s.services[&ext6].frontends, addrs(&["[2001:db8::8]:80"]));
    // The cluster IP keeps its Local policy.
    let int = &s.services[&key("default", "lb", "", Tcp, V4)];
    assert_eq!(int.backends, set(&["10.0.0.1"]));
    assert_eq!(int.flags, proxy_common::FRONTEND_F_LOCAL_ONLY);
    assert_eq!(
        e,
        vec![
            "test.yaml: Service default/lb: externalIP \"not-an-ip\" is not a valid IP address; address skipped",
            "test.yaml: Service default/lb: externalIP 127.0.0.1 is not usable (unspecified, loopback, link-local, multicast or broadcast); address skipped",
            "test.yaml: Service default/lb: externalIP \"::ffff:192.0.2.9\" is an IPv4-mapped IPv6 address (write the IPv4 address itself); address skipped",
            "test.yaml: Service default/lb: externalIP 169.254.169.254 is not usable (unspecified, loopback, link-local, multicast or broadcast); address skipped",
            "test.yaml: Service default/single: externalIP 2001:db8::1 is IPv6 but the Service has no IPv6 cluster IP; address skipped",
            "test.yaml: Service default/single: externalIP 192.0.2.7: frontend 192.0.2.7:80/TCP is already used by Service default/lb; address skipped",
        ]
    );
    // The single-stack Service keeps its cluster IP and has no external set.
    assert!(
        s.services
            .contains_key(&key("default", "single", "", Tcp, V4))
    );
    assert!(!s.services.contains_key(&ServicePortKey {
        scope: Scope::External,
        ..key("default", "single", "", Tcp, V4)
    }));
}

#[test]
fn an_endpoint_in_two_slices_prefers_the_local_copy() {
    let yaml = node("node-1", "zone-a")
        + &svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n  internalTrafficPolicy: Local\n",
        )
        + &slice(
            "default",
            "web-a",
            "web",
            &format!(
                "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                ep("10.0.0.1", "node-2", "", "")
            ),
        )
        + &slice(
            "default",
            "web-b",
            "web",
            &format!(
                "addressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
                ep("10.0.0.1", "node-1", "", "")
            ),
        );
    let (s, _) = build_yaml(&yaml);
    assert_eq!(
        s.services[&key("default", "web", "", Tcp, V4)].backends,
        set(&["10.0.0.1"])
    );
}

/// Every (address, port, protocol, key scope) belongs to one backend set, also within
/// one Service: an external IP equal to the Service's own cluster IP, and a node port
/// two of its ports use on the same address, are skipped as taken.
#[test]
fn a_frontend_belongs_to_one_backend_set_within_a_service() {
    let yaml = "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 192.168.1.5}]}\n".to_string()
        + &svc(
            "default",
            "self",
            "  type: NodePort\n  clusterIP: 10.96.0.9\n  externalIPs: [10.96.0.9, 192.0.2.9]\n  ports: [{name: http, port: 80, nodePort: 30080}, {name: alt, port: 81, nodePort: 30080}]\n",
        );
    let (s, e) = build_yaml(&yaml);
    let mut owner: BTreeMap<(SocketAddr, Protocol, u8), &ServicePortKey> = BTreeMap::new();
    for (k, v) in &s.services {
        for f in &v.frontends {
            if let Some(other) = owner.insert((*f, k.protocol, k.scope.key_scope()), k) {
                panic!("{f}/{} is a frontend of {other:?} and of {k:?}", k.protocol);
            }
        }
    }
    let ext = |port_name: &str| ServicePortKey {
        scope: Scope::External,
        ..key("default", "self", port_name, Protocol::Tcp, Family::V4)
    };
    assert_eq!(
        s.services[&ext("http")].frontends,
        addrs(&["192.0.2.9:80", "192.168.1.5:30080"])
    );
    assert_eq!(s.services[&ext("alt")].frontends, addrs(&["192.0.2.9:81"]));
    assert_eq!(
        e,
        vec![
            "test.yaml: Service default/self: externalIP 10.96.0.9: frontend 10.96.0.9:80/TCP is already used by another port or address of this Service; address skipped",
            "test.yaml: Service default/self: node port 192.168.1.5:30080/TCP is already used by another port or address of this Service; node port skipped",
        ]
    );
}

#[test]
fn node_ports_on_this_nodes_addresses_with_nodeport_addresses() {
    let node_yaml = "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus:\n  addresses:\n  - {type: Hostname, address: node-1}\n  - {type: InternalIP, address: 192.168.1.5}\n  - {type: InternalIP, address: 192.168.1.6}\n  - {type: ExternalIP, address: 203.0.113.5}\n  - {type: InternalIP, address: 'fd00::5'}\n  - {type: ExternalIP, address: bogus}\n";
    let yaml = node_yaml.to_string()
        + &svc(
            "default",
            "np",
            "  type: NodePort\n  clusterIP: 10.96.0.10\n  ports: [{name: http, port: 80, nodePort: 30080}, {name: dns, port: 53, protocol: UDP, nodePort: 30053}]\n",
        )
        + &svc(
            "default",
            "zclash",
            "  type: NodePort\n  clusterIP: 10.96.0.11\n  ports: [{port: 80, nodePort: 30080}]\n",
        )
        + &slice(
            "default",
            "np-1",
            "np",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1], nodeName: node-2}]\nports: [{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]\n",
        );
    let ext = |port_name: &str, proto| ServicePortKey {
        scope: Scope::External,
        ..key("default", "np", port_name, proto, V4)
    };
    let node = |cidrs: &[&str], primary| NodeInfo {
        name: "node-1".into(),
        nodeport_addresses: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
        nodeport_primary: primary,
        ..Default::default()
    };
    let (s, e) = build_yaml_on(&yaml, &node(&[], false));
    assert_eq!(
        s.services[&ext("http", Tcp)].frontends,
        addrs(&[
            "192.168.1.5:30080",
            "192.168.1.6:30080",
            "203.0.113.5:30080"
        ])
    );
    assert_eq!(
        s.services[&ext("dns", Udp)].frontends,
        addrs(&[
            "192.168.1.5:30053",
            "192.168.1.6:30053",
            "203.0.113.5:30053"
        ])
    );
    assert_eq!(s.services[&ext("http", Tcp)].backends, set(&["10.0.0.1"]));
    assert_eq!(
        e,
        vec![
            "test.yaml: Node node-1: status.addresses ExternalIP \"bogus\" is not a usable IP address; skipped for node ports",
            "test.yaml: Service default/zclash: node port 192.168.1.5:30080/TCP is already used by Service default/np; node port skipped",
            "test.yaml: Service default/zclash: node port 192.168.1.6:30080/TCP is already used by Service default/np; node port skipped",
            "test.yaml: Service default/zclash: node port 203.0.113.5:30080/TCP is already used by Service default/np; node port skipped",
        ]
    );
    // The IPv6 node address has no IPv6 cluster IP to serve.
    let (s, _) = build_yaml_on(&yaml, &node(&[], true));
    assert_eq!(
        s.services[&ext("http", Tcp)].frontends,
        addrs(&["192.168.1.5:30080"])
    );
    let (s, _) = build_yaml_on(&yaml, &node(&["203.0.113.0/24"], false));
    assert_eq!(
        s.services[&ext("http", Tcp)].frontends,
        addrs(&["203.0.113.5:30080"])
    );
    // Another node's name: no Node object, no node ports.
    let other = NodeInfo {
        name: "node-9".into(),
        ..Default::default()
    };
    let (s, _) = build_yaml_on(&yaml, &other);
    assert!(!s.services.contains_key(&ext("http", Tcp)));
}

const LB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 31000\n  loadBalancerSourceRanges: ['192.0.2.0/24', ' 198.51.100.7/32', 'bogus', '2001:db8::/32']\n  ports: [{port: 80, nodePort: 30080}]\nstatus: {loadBalancer: {ingress: [{ip: 203.0.113.9}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: lb-1, namespace: default, labels: {kubernetes.io/service-name: lb}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints:\n- {addresses: [10.0.1.5], nodeName: node-1}\n- {addresses: [10.0.2.5], nodeName: node-2}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 192.0.2.50}, {type: Hostname, address: n1}]}\n";

fn node1() -> NodeInfo {
    NodeInfo {
        name: "node-1".into(),
        ..Default::default()
    }
}

#[test]
fn source_ranges_restrict_lb_ips_with_valid_ranges_of_their_family() {
    let m = Model::from_objects(&objects(LB), &node1());
    let errors: Vec<String> = m.errors().iter().map(ToString::to_string).collect();
    assert_eq!(
        errors,
        [
            "test.yaml: Service default/lb: loadBalancerSourceRanges: \"bogus\" is not a CIDR (ADDR/LEN); range ignored"
        ]
    );
    let ranges: Vec<(IpAddr, Vec<IpNet>)> = m
        .source_ranges()
        .map(|(ip, c)| (*ip, c.copied().collect()))
        .collect();
    // The IPv6 range does not apply to an IPv4 LB IP.
    assert_eq!(
        ranges,
        vec![(
            "203.0.113.9".parse().unwrap(),
            vec![
                "192.0.2.0/24".parse().unwrap(),
                "198.51.100.7/32".parse().unwrap()
            ]
        )]
    );
    // As map entries: a restriction marker and one allowed prefix per range.
    let e = crate::reconcile::node::source_range_entries(&m);
    let lb = crate::datapath::addr::ip_to_bytes("203.0.113.9".parse().unwrap());
    let marker = proxy_common::nat::SourceRange {
        lb_addr: lb,
        client: [0; 16],
    };
    assert_eq!(
        e.get(&(128, marker)),
        Some(&proxy_common::nat::SOURCE_RANGE_RESTRICTED)
    );
    let net = proxy_common::nat::SourceRange {
        lb_addr: lb,
        client: crate::datapath::addr::ip_to_bytes("192.0.2.0".parse().unwrap()),
    };
    assert_eq!(
        e.get(&(128 + 96 + 24, net)),
        Some(&proxy_common::nat::SOURCE_RANGE_ALLOW)
    );
    assert_eq!(e.len(), 3, "{e:?}");
}

#[test]
fn all_invalid_ranges_allow_everyone() {
    let yaml = LB.replace(
        "['192.0.2.0/24', ' 198.51.100.7/32', 'bogus', '2001:db8::/32']",
        "['bogus']",
    );
    let m = Model::from_objects(&objects(&yaml), &node1());
    assert_eq!(m.source_ranges().count(), 0);
    assert_eq!(m.errors().len(), 1);
}

#[test]
fn local_endpoints_node_addresses_and_health_checks() {
    let m = Model::from_objects(&objects(LB), &node1());
    assert_eq!(
        m.local_endpoints().copied().collect::<Vec<_>>(),
        vec!["10.0.1.5".parse::<IpAddr>().unwrap()]
    );
    assert_eq!(
        m.node().ips(),
        BTreeSet::from(["192.0.2.50".parse().unwrap()])
    );
    let h = m.health_checks();
    let c = &h[&31000];
    assert_eq!((c.namespace.as_str(), c.name.as_str()), ("default", "lb"));
    assert_eq!(c.local_endpoints, 1);
    // Another node has no local endpoint: 0 (the server answers 503 there).
    let other = Model::from_objects(
        &objects(LB),
        &NodeInfo {
            name: "node-3".into(),
            ..Default::default()
        },
    );
    assert_eq!(other.health_checks()[&31000].local_endpoints, 0);
}

fn lb_local(name: &str, policy: &str, port: i64) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec: {{type: LoadBalancer, clusterIP: 10.96.0.{}, externalTrafficPolicy: {policy}, healthCheckNodePort: {port}, ports: [{{port: 80}}]}}\n",
        name.len() + name.as_bytes()[0] as usize % 50
    )
}

#[test]
fn invalid_and_shared_health_ports_are_reported_naming_the_services() {
    let yaml = [
        lb_local("a-big", "Local", 99999),
        lb_local("b-zero", "Local", 0),
        lb_local("c-first", "Local", 31000),
        lb_local("d-second", "Local", 31000),
        lb_local("e-cluster", "Cluster", 99999),
        lb_local("f-ok", "Local", 31001),
    ]
    .concat();
    let mut m = Model::from_objects(&objects(&yaml), &node1());
    let h = m.health_checks();
    assert_eq!(h.keys().copied().collect::<Vec<_>>(), [31000, 31001]);
    assert_eq!(h[&31000].name, "c-first");
    let errors: Vec<String> = m.errors().iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 3, "{errors:#?}");
    assert!(
        errors[0]
            .starts_with("test.yaml: Service ns/a-big: healthCheckNodePort 99999 is not a port"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].starts_with("test.yaml: Service ns/b-zero: healthCheckNodePort 0 is not a port"),
        "{}",
        errors[1]
    );
    assert!(
        errors[2].contains("Service ns/d-second: healthCheckNodePort 31000")
            && errors[2].contains("Service ns/c-first"),
        "{}",
        errors[2]
    );
    // The first goes: the second gets the port, its error goes.
    m.apply(Change::Delete(
        Kind::Service,
        ("ns".into(), "c-first".into()),
    ));
    let d = m.commit();
    assert!(d.health_changed);
    assert_eq!(m.health_checks()[&31000].name, "d-second");
    assert_eq!(d.errors_removed.len(), 1, "{d:?}");
    assert_eq!(m.errors().len(), 2);
}

/// A Service `ns/{name}` on 10.96.1.{n}:80 with extra metadata lines, and its slice
/// with one endpoint on another node and the same labels.
fn labelled(name: &str, n: u8, labels: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns, labels: {{{labels}}}}}\nspec: {{clusterIP: 10.96.1.{n}, ports: [{{port: 80}}]}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: ns, labels: {{kubernetes.io/service-name: {name}{}{labels}}}}}\naddressType: IPv4\nports: [{{port: 80}}]\nendpoints: [{{addresses: [10.0.1.{n}], nodeName: node-2}}]\n",
        if labels.is_empty() { "" } else { ", " }
    )
}

#[test]
fn objects_labelled_for_another_proxy_or_headless_are_not_proxied() {
    let yaml = labelled("plain", 1, "")
        + &labelled(
            "other-proxy",
            2,
            "service.kubernetes.io/service-proxy-name: other",
        )
        + &labelled(
            "empty-name",
            3,
            "service.kubernetes.io/service-proxy-name: ''",
        )
        + &labelled("headless", 4, "service.kubernetes.io/headless: ''");
    let (s, errors) = build_yaml(&yaml);
    assert!(errors.is_empty(), "{errors:?}");
    let names: BTreeSet<&str> = s.services.keys().map(|k| k.name.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["plain"]),
        "any value of the label excludes"
    );

    // Gaining the label removes what the Service gave; losing it brings it back (the
    // watch's DELETED and ADDED events under kube-proxy's selector).
    let mut m = model(&labelled("web", 5, ""));
    assert_eq!(m.ports().len(), 1);
    apply_yaml(
        &mut m,
        &labelled("web", 5, "service.kubernetes.io/service-proxy-name: istio"),
    );
    let d = m.commit();
    assert!(m.ports().is_empty(), "{d:?}");
    assert_eq!(d.ports.len(), 1);
    apply_yaml(&mut m, &labelled("web", 5, ""));
    m.commit();
    let (k, v) = m.ports().iter().next().expect("back");
    assert_eq!(k.name, "web");
    assert_eq!(v.backends, addrs(&["10.0.1.5:80"]));
    // A slice alone with the label: the Service stays, without those endpoints.
    apply_yaml(
        &mut m,
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: ns, labels: {kubernetes.io/service-name: web, service.kubernetes.io/headless: ''}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints: [{addresses: [10.0.1.5]}]\n",
    );
    m.commit();
    assert!(m.ports().values().next().unwrap().backends.is_empty());
    assert_eq!(
        PROXY_LABEL_SELECTOR,
        format!("!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}")
    );
}

#[test]
fn a_node_being_deleted_or_tainted_for_deletion_is_not_eligible() {
    let node = |meta: &str, spec: &str| {
        format!(
            "---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-1{meta}}}\nspec: {{{spec}}}\n"
        )
    };
    let mut m = Model::new(node1());
    assert!(
        m.node().eligible(),
        "no Node object: nothing says it goes away"
    );
    apply_yaml(&mut m, &node("", ""));
    assert!(m.node().eligible());
    apply_yaml(
        &mut m,
        &node(
            "",
            "taints: [{key: ToBeDeletedByClusterAutoscaler, value: '1700000000', effect: NoSchedule}]",
        ),
    );
    assert!(m.node().to_be_deleted && !m.node().eligible());
    apply_yaml(
        &mut m,
        &node("", "taints: [{key: other, effect: NoSchedule}]"),
    );
    assert!(m.node().eligible(), "other taints do not matter");
    apply_yaml(
        &mut m,
        &node(", deletionTimestamp: '2026-01-01T00:00:00Z'", ""),
    );
    assert!(m.node().deleting && !m.node().eligible());
    assert!(m.commit().node_changed);
}

#[test]
fn local_policy_sets_without_local_endpoints_are_flagged_only_with_remote_ones() {
    let yaml = |eps: &str| {
        svc(
            "ns",
            "web",
            "  type: NodePort\n  clusterIP: 10.96.0.10\n  internalTrafficPolicy: Local\n  externalTrafficPolicy: Local\n  ports: [{port: 80, nodePort: 30080}]\n",
        ) + &slice(
            "ns",
            "web-1",
            "web",
            &format!("addressType: IPv4\nports: [{{port: 80}}]\nendpoints: [{eps}]\n"),
        ) + "---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 192.0.2.1}]}\n"
    };
    let flagged = |eps: &str| {
        let (s, _) = build_yaml(&yaml(eps));
        s.services
            .iter()
            .filter(|(_, d)| d.no_local_endpoints)
            .map(|(k, _)| k.scope)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        flagged("{addresses: [10.0.0.2], nodeName: node-2}"),
        [Scope::Internal, Scope::Ingress]
    );
    assert!(flagged("{addresses: [10.0.0.1], nodeName: node-1}").is_empty());
    assert!(flagged("").is_empty(), "no endpoints at all: not counted");
}

/// A model fed `yaml` and committed.
fn model(yaml: &str) -> Model {
    Model::from_objects(&objects(yaml), &node1())
}

fn apply_yaml(m: &mut Model, yaml: &str) {
    let (objs, errors) = parse_documents("test.yaml", yaml);
    assert!(errors.is_empty(), "{errors:?}");
    for o in objs {
        m.apply(Change::Apply(o));
    }
}

#[test]
fn a_change_that_reads_the_same_is_dropped() {
    let base = svc(
        "default",
        "web",
        "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n",
    ) + &slice(
        "default",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
    );
    let mut m = model(&base);
    // The same objects again, with a status, a resourceVersion and an annotation the
    // model does not read: nothing to do.
    let again = base
        .replace(
            "metadata: {name: web, namespace: default}",
            "metadata: {name: web, namespace: default, resourceVersion: '7', annotations: {x: y}}",
        )
        .replace("  name: web-1\n", "  name: web-1\n  resourceVersion: '9'\n");
    apply_yaml(&mut m, &again);
    let d = m.commit();
    assert!(d.is_empty(), "{d:?}");
    assert_eq!((d.service_changes, d.endpoint_changes), (0, 0));
    // A real change is one backend set.
    apply_yaml(&mut m, &again.replace("10.0.0.1", "10.0.0.2"));
    let d = m.commit();
    assert_eq!(d.ports.len(), 1, "{d:?}");
    assert_eq!(d.endpoint_changes, 1);
}

#[test]
fn a_slice_change_touches_only_its_service() {
    let mut yaml = String::new();
    for i in 0..50 {
        yaml += &svc(
            "default",
            &format!("s{i}"),
            &format!("  clusterIP: 10.96.1.{i}\n  ports: [{{port: 80}}]\n"),
        );
        yaml += &slice(
            "default",
            &format!("s{i}-1"),
            &format!("s{i}"),
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]\nports: [{port: 8080}]\n",
        );
    }
    let mut m = model(&yaml);
    apply_yaml(
        &mut m,
        &slice(
            "default",
            "s7-1",
            "s7",
            "addressType: IPv4\nendpoints: [{addresses: [10.0.0.9]}]\nports: [{port: 8080}]\n",
        ),
    );
    let d = m.commit();
    assert_eq!(
        d.ports.iter().map(|k| k.name.as_str()).collect::<Vec<_>>(),
        ["s7"]
    );
    assert_eq!(m.desired_state(), model(&yaml.replace(
        "name: s7-1\n  namespace: default\n  labels: {kubernetes.io/service-name: s7}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.1]}]",
        "name: s7-1\n  namespace: default\n  labels: {kubernetes.io/service-name: s7}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.9]}]",
    )).desired_state());
}

#[test]
fn a_contested_frontend_moves_when_its_owner_goes() {
    let yaml = svc(
        "a",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    ) + &svc(
        "b",
        "web",
        "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
    );
    let mut m = model(&yaml);
    assert_eq!(m.errors().len(), 1);
    assert!(m.ports().keys().all(|k| k.namespace == "a"));
    m.apply(Change::Delete(Kind::Service, ("a".into(), "web".into())));
    let d = m.commit();
    assert_eq!(d.errors_removed.len(), 1, "{d:?}");
    assert!(!m.ports().is_empty());
    assert!(m.ports().keys().all(|k| k.namespace == "b"));
    // It comes back, younger than b now? No timestamps: namespace order, a wins again.
    apply_yaml(
        &mut m,
        &svc(
            "a",
            "web",
            "  clusterIP: 10.96.0.3\n  ports: [{port: 80}]\n",
        ),
    );
    m.commit();
    assert!(m.ports().keys().all(|k| k.namespace == "a"));
    assert_eq!(m.desired_state(), model(&yaml).desired_state());
}

#[test]
fn a_zone_change_of_the_node_reapplies_topology_hints() {
    let eps = [
        ep("10.0.0.1", "node-2", "", "forZones: [{name: zone-a}]"),
        ep("10.0.0.2", "node-3", "", "forZones: [{name: zone-b}]"),
    ];
    let yaml = node("node-1", "zone-a")
        + &svc(
            "default",
            "web",
            "  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n",
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
    let mut m = model(&yaml);
    let k = key("default", "web", "", Tcp, V4);
    assert_eq!(m.port(&k).unwrap().backends, set(&["10.0.0.1"]));
    apply_yaml(&mut m, &node("node-1", "zone-b"));
    let d = m.commit();
    assert!(d.node_changed && d.ports.contains(&k));
    assert_eq!(m.port(&k).unwrap().backends, set(&["10.0.0.2"]));
}

/// Service web (cluster IP 10.96.0.10, port 80) with `annotations` (a YAML flow map
/// body) and endpoints pod-1..pod-3 at 10.0.0.1..3; its internal set and the errors.
fn annotated_web(annotations: &str) -> (DesiredService, Vec<String>) {
    let yaml = format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default, annotations: {{{annotations}}}}}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{{port: 80}}]\n"
    ) + &slice(
        "default",
        "web-1",
        "web",
        "addressType: IPv4\nendpoints:\n- {addresses: [10.0.0.1], targetRef: {kind: Pod, name: pod-1}}\n- {addresses: [10.0.0.2], targetRef: {kind: Pod, name: pod-2}}\n- {addresses: [10.0.0.3], targetRef: {kind: Pod, name: pod-3}}\nports: [{port: 8080}]\n",
    );
    let (s, e) = build_yaml(&yaml);
    let d = s.services.get(&key("default", "web", "", Tcp, V4));
    (d.cloned().unwrap_or_default(), e)
}

fn weights(list: &[(&str, u32)]) -> BTreeMap<SocketAddr, u32> {
    list.iter()
        .map(|(a, w)| (format!("{a}:8080").parse().unwrap(), *w))
        .collect()
}

#[test]
fn algorithm_names_and_ipvs_scheduler_names_are_accepted() {
    for (a, n) in Algorithm::ALL {
        assert_eq!(parse_algorithm(n), Some(a), "{n}");
        assert_eq!(a.name(), n);
        assert_eq!(Algorithm::from_u8(a as u8), Some(a));
    }
    let ipvs = [
        ("rr", Algorithm::RoundRobin),
        ("wrr", Algorithm::WeightedRoundRobin),
        ("lc", Algorithm::LeastConnections),
        ("wlc", Algorithm::WeightedLeastConnections),
        ("sed", Algorithm::ShortestExpectedDelay),
        ("nq", Algorithm::NeverQueue),
        ("sh", Algorithm::SourceHash),
        ("dh", Algorithm::DestinationHash),
        ("mh", Algorithm::SourceHash),
    ];
    for (n, a) in ipvs {
        assert_eq!(parse_algorithm(n), Some(a), "{n}");
        assert_eq!(parse_ipvs_scheduler(n, ""), Ok(a), "{n}");
    }
    // IPVS names are exact (case-sensitive), and the own names are not IPVS names.
    assert_eq!(parse_algorithm("WLC"), None);
    assert_eq!(parse_algorithm(""), None);
    assert!(parse_ipvs_scheduler("least-connections", "").is_err());
    assert!(algorithm_names().ends_with("(IPVS: rr, wrr, lc, wlc, sed, nq, sh, dh, mh)"));
    // Scheduler flags as ipvsadm -b takes them.
    assert_eq!(parse_ipvs_scheduler("sh", "sh-port"), Ok(Algorithm::Maglev));
    assert_eq!(
        parse_ipvs_scheduler("mh", "mh-fallback, mh-port"),
        Ok(Algorithm::Maglev)
    );
    assert_eq!(
        parse_ipvs_scheduler("sh", "sh-fallback"),
        Ok(Algorithm::SourceHash)
    );
    assert_eq!(
        parse_ipvs_scheduler("mh", "sh-port"),
        Err("IPVS scheduler flag \"sh-port\" does not apply to \"mh\" (sh takes sh-port, sh-fallback; mh takes mh-port, mh-fallback)".into())
    );
    assert_eq!(
        parse_ipvs_scheduler("", ""),
        Err("IPVS scheduler \"\" is not one of rr, wrr, lc, wlc, sed, nq, sh, dh, mh".into())
    );
    let e = parse_ipvs_scheduler("lblcr", "").unwrap_err();
    assert!(e.contains("locality-based") && e.contains("dh"), "{e}");
    // The data path counts connections for the least-load family only.
    let counted: Vec<&str> = Algorithm::ALL
        .iter()
        .filter(|(a, _)| proxy_common::counts_connections(*a as u8))
        .map(|(_, n)| *n)
        .collect();
    assert_eq!(
        counted,
        [
            "least-connections",
            "weighted-least-connections",
            "shortest-expected-delay",
            "never-queue"
        ]
    );
    assert!(!proxy_common::counts_connections(200));
}

#[test]
fn weights_reach_the_weighted_algorithms_and_zero_drains_with_every_algorithm() {
    let w = r#"ebpf-proxy.io/weights: '{"pod-1": 3, "10.0.0.2": 0}'"#;
    // IPVS names in the annotation; weights by pod name and by address, default 1.
    for alg in ["wlc", "sed", "nq", "wrr", "weighted-least-connections"] {
        let (d, e) = annotated_web(&format!("ebpf-proxy.io/lb-algorithm: {alg}, {w}"));
        assert_eq!(e, NO_ERRORS, "{alg}");
        assert_eq!(d.algorithm, parse_algorithm(alg).unwrap());
        assert_eq!(d.backends, set(&["10.0.0.1", "10.0.0.3"]), "{alg}");
        assert_eq!(
            d.weights,
            weights(&[("10.0.0.1", 3), ("10.0.0.3", 1)]),
            "{alg}"
        );
    }
    // Without the annotation every weight is 1.
    let (d, _) = annotated_web("ebpf-proxy.io/lb-algorithm: nq");
    assert_eq!(
        d.weights,
        weights(&[("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.3", 1)])
    );
    // Algorithms without weights: weight 0 still drains (IPVS quiesces it for every
    // scheduler); the other weights are reported as without effect.
    for alg in ["lc", "dh", "random"] {
        let (d, e) = annotated_web(&format!("ebpf-proxy.io/lb-algorithm: {alg}, {w}"));
        assert_eq!(d.backends, set(&["10.0.0.1", "10.0.0.3"]), "{alg}");
        assert!(d.weights.is_empty(), "{alg}");
        assert_eq!(
            e,
            vec![format!(
                "test.yaml: Service default/web: annotation ebpf-proxy.io/weights: weights other than 0 have no effect with algorithm {}",
                d.algorithm.name()
            )],
            "{alg}"
        );
    }
    let (d, e) =
        annotated_web(r#"ebpf-proxy.io/lb-algorithm: dh, ebpf-proxy.io/weights: '{"pod-3": 0}'"#);
    assert_eq!(e, NO_ERRORS);
    assert_eq!(d.backends, set(&["10.0.0.1", "10.0.0.2"]));
    // An unknown name lists every accepted one.
    let (d, e) = annotated_web("ebpf-proxy.io/lb-algorithm: lblc");
    assert_eq!(d.algorithm, Algorithm::Random);
    assert_eq!(
        e,
        vec![format!(
            "test.yaml: Service default/web: annotation ebpf-proxy.io/lb-algorithm \"lblc\" is not one of {}; using random",
            algorithm_names()
        )]
    );
}
