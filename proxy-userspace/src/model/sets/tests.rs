use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use crate::model::tests::{
    LB, NO_ERRORS, addrs, build_yaml, desired, ep, key, node1, objects, set, slice, state, svc,
    web_backends,
};
use crate::model::{
    Algorithm, DesiredService, Family, Model, Protocol, Scope, ServicePortKey, algorithm_names,
    parse_algorithm,
};
use Family::{V4, V6};
use Protocol::Tcp;

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
    let e = crate::datapath::source_range_entries(m.source_ranges());
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
