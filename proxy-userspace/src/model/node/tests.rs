use crate::model::tests::{addrs, apply_yaml, build_yaml_on, key, node1, set, slice, svc};
use crate::model::{Family, Model, NodeInfo, Protocol, Scope, ServicePortKey};
use Family::V4;
use Protocol::{Tcp, Udp};

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
