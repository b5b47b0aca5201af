use crate::model::tests::{
    NO_ERRORS, build_yaml, desired, good, good_state, key, slice, state, svc,
};
use crate::model::{DesiredState, Family, Protocol};
use Family::{V4, V6};
use Protocol::{Tcp, Udp};

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
fn service_without_ports_has_no_frontends() {
    let (s, e) = build_yaml(&svc("default", "noports", "  clusterIP: 10.96.0.3\n"));
    assert_eq!(e, NO_ERRORS);
    assert_eq!(s, DesiredState::default());
}
