use super::*;
use crate::model::{Model, NodeInfo};

/// The model of the manifests `yaml` (one file) as node `node` sees them, and the
/// directory they were read from (the tests put a pin directory that does not exist
/// there).
fn model_of(yaml: &str, node: &str) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("web.yaml"), yaml).unwrap();
    let (objects, errors) = crate::source::manifests::load_dir(dir.path());
    assert!(errors.is_empty(), "{errors:?}");
    let node = NodeInfo {
        name: node.into(),
        ..Default::default()
    };
    (dir, Model::from_objects(&objects, &node))
}

#[test]
fn explain_names_what_was_skipped_for_the_target() {
    let (dir, model) = model_of(
        "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop, creationTimestamp: '2024-01-01T00:00:00Z'}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.7]}
- {addresses: [999.1.1.1]}
---
apiVersion: v1
kind: Service
metadata: {name: dup, namespace: other, creationTimestamp: '2025-01-01T00:00:00Z'}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: badport, namespace: other}
spec: {clusterIP: 10.96.0.20, ports: [{port: 70000}]}
",
        "n1",
    );
    let snap = desired_snapshot(&model).unwrap();
    let nowhere = PinnedView::new(&dir.path().join("no-pins"));
    let none = Default::default();
    let ask = |t: &str| {
        let target: std::net::SocketAddr = t.parse().unwrap();
        explain(&nowhere, &snap, target, 6, Some(&model), "n1", &none).unwrap()
    };
    // A frontend: its slice's skipped endpoint and the Service that lost the frontend.
    let e = ask("10.96.0.10:80");
    assert_eq!(e.frontends.len(), 1);
    assert_eq!(e.skipped.len(), 2, "{:?}", e.skipped);
    assert!(
        e.skipped
            .iter()
            .any(|s| s.contains("EndpointSlice shop/web-1") && s.contains("999.1.1.1")),
        "{:?}",
        e.skipped
    );
    assert!(
        e.skipped
            .iter()
            .any(|s| s.contains("Service other/dup") && s.contains("10.96.0.10:80/TCP")),
        "{:?}",
        e.skipped
    );
    // No frontend: the skipped Services, one of which may be meant to define it.
    let e = ask("10.96.0.20:80");
    assert!(e.frontends.is_empty());
    assert_eq!(e.verdict, "not a frontend: left alone by ebpf-proxy");
    assert!(
        e.skipped
            .iter()
            .any(|s| s.contains("Service other/badport") && s.contains("70000")),
        "{:?}",
        e.skipped
    );
    assert!(
        e.skipped.iter().all(|s| !s.contains("EndpointSlice")),
        "{:?}",
        e.skipped
    );
}

#[test]
fn explain_without_pins_answers_from_what_an_agent_would_program() {
    let (dir, model) = model_of(
        "apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.7], nodeName: n1}
- {addresses: [10.0.0.8], nodeName: n2, conditions: {ready: false}}
",
        "n1",
    );
    let snap = desired_snapshot(&model).unwrap();
    let nowhere = PinnedView::new(&dir.path().join("no-pins"));
    let target: std::net::SocketAddr = "10.96.0.10:80".parse().unwrap();
    let none = Default::default();
    let e = explain(&nowhere, &snap, target, 6, Some(&model), "n1 (test)", &none).unwrap();
    assert_eq!(e.node, "n1 (test)");
    assert_eq!(
        e.external_verdict,
        "translated by the tc programs (a cluster IP routed to this node) to one of 1 backend(s) by random"
    );
    assert!(e.ignored_slices.is_empty());
    assert_eq!(
        e.verdict, "translated to one of 1 backend(s) by random",
        "{e:?}"
    );
    let f = &e.frontends[0];
    assert_eq!(f.frontend.service, "shop/web:/TCP/v4");
    assert_eq!(f.frontend.backends, vec!["10.0.0.7:8080".to_string()]);
    let eps = f.endpoints.as_ref().unwrap();
    assert_eq!(eps.len(), 2);
    assert!(
        eps.iter()
            .any(|p| !p.eligible && p.reason.as_deref() == Some("not ready"))
    );
    // An undefined port of the cluster IP is refused, as the data path would.
    let e = explain(
        &nowhere,
        &snap,
        "10.96.0.10:81".parse().unwrap(),
        6,
        Some(&model),
        "n1",
        &none,
    )
    .unwrap();
    assert!(
        e.verdict.contains("does not define this port"),
        "{}",
        e.verdict
    );
}

/// From outside the node: the ingress frontend with the external policy's backends,
/// the Local policy, the LB IP's source ranges; and a slice without the service-name
/// label in the Service's namespace is named.
#[test]
fn explain_says_what_happens_to_traffic_from_outside_and_names_ignored_slices() {
    let text = "apiVersion: v1
kind: Service
metadata: {name: lb, namespace: shop}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  externalTrafficPolicy: Local
  loadBalancerSourceRanges: [192.0.2.0/24]
  ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.9}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: lb-1, namespace: shop, labels: {kubernetes.io/service-name: lb}}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.7], nodeName: n1}
- {addresses: [10.0.0.8], nodeName: n2}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: orphan-1, namespace: shop}
addressType: IPv4
ports: [{port: 8080}]
endpoints:
- {addresses: [10.0.0.9], nodeName: n1}
";
    let (objects, errors) = crate::source::manifests::parse_documents("t.yaml", text);
    assert!(errors.is_empty(), "{errors:?}");
    let mut set = crate::source::ObjectSet::default();
    for o in objects {
        set.insert(o);
    }
    let explain_on = |node: &str| {
        let model = Model::from_objects(
            &set,
            &NodeInfo {
                name: node.into(),
                ..Default::default()
            },
        );
        // The unlabeled slice is reported once, by namespace/name.
        let unlabeled: Vec<String> = model
            .errors()
            .iter()
            .filter(|e| e.reason == crate::model::endpoints::UNLABELED_SLICE)
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            unlabeled,
            [
                "t.yaml: EndpointSlice shop/orphan-1: no kubernetes.io/service-name label, so it belongs to no Service; slice ignored (as kube-proxy does)"
            ]
        );
        let snap = desired_snapshot(&model).unwrap();
        let ranges = crate::reconcile::node::source_range_entries(&model);
        let e = explain(
            &PinnedView::new(std::path::Path::new("/nonexistent")),
            &snap,
            "203.0.113.9:80".parse().unwrap(),
            6,
            Some(&model),
            node,
            &ranges,
        )
        .unwrap();
        assert_eq!(e.ignored_slices, ["shop/orphan-1"]);
        e
    };
    let e = explain_on("n1");
    assert_eq!(
        e.external_verdict,
        "translated by the tc programs to one of 1 backend(s) by random (Local traffic policy: endpoints on this node only, the client address is kept); only from 192.0.2.0/24 (loadBalancerSourceRanges), other clients are dropped"
    );
    // From this node, the Cluster endpoints (kube-proxy's short-circuit).
    assert_eq!(e.verdict, "translated to one of 2 backend(s) by random");
    let e = explain_on("n3");
    assert!(
        e.external_verdict.starts_with(
            "dropped: Local traffic policy and no endpoint on this node; only from 192.0.2.0/24"
        ),
        "{}",
        e.external_verdict
    );
    assert_eq!(
        external_verdict(&[], None),
        "not a frontend for traffic entering the node: passed on untouched"
    );
}
