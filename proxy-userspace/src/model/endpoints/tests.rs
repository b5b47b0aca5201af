use crate::model::tests::{NO_ERRORS, build_yaml, desired, ep, key, node, set, slice, state, svc};
use crate::model::{DesiredState, Family, Protocol};
use Family::{V4, V6};
use Protocol::Tcp;

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
