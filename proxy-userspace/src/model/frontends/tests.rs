use std::collections::BTreeMap;
use std::net::SocketAddr;

use crate::model::tests::{addrs, build_yaml, desired, good, key, state, svc};
use crate::model::{Family, Protocol, Scope, ServicePortKey};
use Family::V4;
use Protocol::Tcp;

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
