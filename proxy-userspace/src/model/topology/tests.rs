use crate::model::tests::{NO_ERRORS, build_yaml, ep, key, set, slice, svc, web_backends};
use crate::model::{EndpointSets, Family, PortEndpoints, Protocol, categorize};
use Family::V4;
use Protocol::Tcp;

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
