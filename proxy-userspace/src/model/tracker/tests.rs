use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::model::tests::{LB, apply_yaml, ep, key, model, node, node1, objects, set, slice, svc};
use crate::model::{Family, Model, NodeInfo, Protocol};
use crate::source::{Change, Kind};
use Family::V4;
use Protocol::Tcp;

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
