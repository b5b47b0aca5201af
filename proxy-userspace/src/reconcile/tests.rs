use super::*;
use crate::datapath::{
    Capacity, Interface,
    fake::{FakeDatapath, Op},
};
use crate::model::NodeInfo;
use crate::source::{Change, Kind, manifests::parse_documents};

fn model_of(yaml: &str) -> Model {
    let mut m = Model::new(NodeInfo {
        name: "node-1".into(),
        ..Default::default()
    });
    apply(&mut m, yaml);
    m
}

fn apply(m: &mut Model, yaml: &str) {
    let (objs, errors) = parse_documents("t.yaml", yaml);
    assert!(errors.is_empty(), "{errors:?}");
    for o in objs {
        m.apply(Change::Apply(o));
    }
}

fn svc(name: &str, ip: &str, endpoints: &[&str]) -> String {
    let eps: Vec<String> = endpoints
        .iter()
        .map(|e| format!("{{addresses: [{e}], nodeName: node-2}}"))
        .collect();
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: ns, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nendpoints: [{}]\nports: [{{port: 8080}}]\n",
        eps.join(", ")
    )
}

fn cap(slots: u32) -> Capacity {
    Capacity {
        frontends: 100,
        slots,
        backends: 100,
        services: 100,
    }
}

#[test]
fn a_service_that_does_not_fit_fails_alone_and_is_retried_with_backoff() {
    let mut dp = FakeDatapath::new(cap(3));
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    let mut m = model_of(&(svc("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"])));
    m.commit();
    let t0 = Instant::now();
    assert!(r.apply_all(&mut dp, &m, t0).failed.is_empty());
    // b needs 2 slots, 1 is left: b fails whole, c (1 slot) is applied.
    apply(&mut m, &svc("b", "10.96.0.2", &["10.0.0.3", "10.0.0.4"]));
    apply(&mut m, &svc("c", "10.96.0.3", &["10.0.0.5"]));
    let d = m.commit();
    let out = r.apply(&mut dp, &m, &d, t0);
    assert_eq!(out.failed.len(), 1, "{:?}", out.failed);
    assert_eq!(out.failed[0].0, "ns/b");
    assert!(
        out.failed[0].1.contains("BACKEND_SLOTS")
            && out.failed[0].1.contains("--max-backend-slots")
    );
    assert_eq!(dp.state.slots.len(), 3);
    assert!(
        dp.state.names.values().all(|n| !n.starts_with("ns/b:")),
        "nothing of b is written"
    );
    let f = r.failed().values().next().unwrap().clone();
    assert_eq!((f.attempts, f.retry_at), (1, t0 + RETRY_MIN));
    // Retried before its time: nothing; at its time, still no room: the delay doubles.
    assert!(r.retry(&mut dp, &m, t0).failed.is_empty());
    let out = r.retry(&mut dp, &m, t0 + RETRY_MIN);
    assert_eq!(out.failed.len(), 1);
    let f = r.failed().values().next().unwrap().clone();
    assert_eq!(
        (f.attempts, f.retry_at),
        (2, t0 + RETRY_MIN + 2 * RETRY_MIN)
    );
    // a goes away: room for b at its next retry.
    m.apply(Change::Delete(Kind::Service, ("ns".into(), "a".into())));
    let d = m.commit();
    r.apply(&mut dp, &m, &d, t0 + 2 * RETRY_MIN);
    let out = r.retry(&mut dp, &m, f.retry_at);
    assert_eq!(out.recovered, vec!["ns/b".to_string()]);
    assert!(r.failed().is_empty());
    assert_eq!(dp.state.slots.len(), 3);
    assert_eq!(
        r.verify(&mut dp, &m, f.retry_at).repaired,
        Report::default()
    );
}

/// A restarted agent's first pass over adopted maps is written in batches: buffered
/// puts go out in dependency order and before any delete, so the data path is
/// consistent after every single write, whatever changed while no agent ran (Services
/// gone, grown, shrunk, moved to Maglev, new).
#[test]
fn batched_first_pass_over_adopted_maps_is_consistent_at_every_write() {
    let before = [
        svc("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
        svc("b", "10.96.0.2", &["10.0.0.4", "10.0.0.5"]),
        svc("c", "10.96.0.3", &["10.0.0.6"]),
        svc("d", "10.96.0.4", &["10.0.0.7", "10.0.0.8"]),
    ]
    .concat();
    let mut dp = FakeDatapath::new(cap(100));
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    let mut m = model_of(&before);
    m.commit();
    assert!(r.apply_all(&mut dp, &m, Instant::now()).failed.is_empty());

    let maglev = svc("d", "10.96.0.4", &["10.0.0.7", "10.0.0.9"]).replacen(
        "metadata: {name: d, namespace: ns}",
        "metadata: {name: d, namespace: ns, annotations: {ebpf-proxy.io/lb-algorithm: maglev}}",
        1,
    );
    let after = [
        svc("a", "10.96.0.1", &["10.0.0.3"]),
        svc(
            "b",
            "10.96.0.2",
            &["10.0.0.4", "10.0.0.5", "10.0.0.10", "10.0.0.11"],
        ),
        maglev,
        svc("e", "10.96.0.5", &["10.0.0.1", "10.0.0.12"]),
    ]
    .concat();
    let mut m = model_of(&after);
    m.commit();
    dp.batching = true;
    dp.log.clear();
    let (start, tables) = (dp.state.clone(), dp.tables.clone());
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    let out = r.apply_all(&mut dp, &m, Instant::now());
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    services::tests::assert_every_step_consistent(&dp.log, &start, &tables);
    // The same maps as an agent writing entry by entry from empty maps.
    let mut fresh = FakeDatapath::new(cap(100));
    let mut fr = Reconciler::adopt(&fresh, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    fr.apply_all(&mut fresh, &m, Instant::now());
    assert_eq!(dp.state.frontends.len(), fresh.state.frontends.len());
    assert_eq!(dp.state.slots.len(), fresh.state.slots.len());
    assert_eq!(dp.state.backends.len(), fresh.state.backends.len());
    assert_eq!(dp.tables.len(), 1);
    assert!(r.verify(&mut dp, &m, Instant::now()).repaired == Report::default());
}

/// A batch that fails is repaired entry by entry at once and reported.
#[test]
fn failed_batch_is_verified_and_reported() {
    let mut dp = FakeDatapath::new(cap(100));
    dp.batching = true;
    dp.fail_after = Some(2);
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    let mut m = model_of(
        &[
            svc("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]),
            svc("b", "10.96.0.2", &["10.0.0.3"]),
        ]
        .concat(),
    );
    m.commit();
    let out = r.apply_all(&mut dp, &m, Instant::now());
    assert!(
        out.failed.iter().any(|(what, _)| what == "(batched write)"),
        "{:?}",
        out.failed
    );
    assert!(
        dp.consistency_violations().is_empty(),
        "{:?}",
        dp.consistency_violations()
    );
    assert_eq!(dp.state.slots.len(), 3);
    assert_eq!(
        r.verify(&mut dp, &m, Instant::now()).repaired,
        Report::default()
    );
}

#[test]
fn backoff_is_bounded_by_the_resync_period() {
    let mut dp = FakeDatapath::new(cap(0));
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(5)).unwrap();
    let mut m = model_of(&svc("a", "10.96.0.1", &["10.0.0.1"]));
    m.commit();
    let mut t = Instant::now();
    r.apply_all(&mut dp, &m, t);
    for _ in 0..10 {
        t = r.next_retry().unwrap();
        r.retry(&mut dp, &m, t);
    }
    let f = r.failed().values().next().unwrap();
    assert_eq!(f.retry_at - t, Duration::from_secs(5));
}

#[test]
fn a_write_that_failed_half_way_is_verified_before_the_retry() {
    let mut dp = FakeDatapath::new(cap(100));
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    let mut m = model_of(&svc("a", "10.96.0.1", &["10.0.0.1"]));
    m.commit();
    let t0 = Instant::now();
    r.apply_all(&mut dp, &m, t0);
    // Two new backends: the second backend write fails.
    apply(&mut m, &svc("a", "10.96.0.1", &["10.0.0.2", "10.0.0.3"]));
    let d = m.commit();
    dp.fail_after = Some(1);
    let out = r.apply(&mut dp, &m, &d, t0);
    assert_eq!(out.failed.len(), 1, "{:?}", out.failed);
    assert!(
        out.failed[0].1.contains("EIO") || out.failed[0].1.contains("Input/output"),
        "{:?}",
        out.failed
    );
    // The old backend set still serves: the frontend was not rewritten.
    let fe = dp.state.frontends.values().find(|f| f.flags == 0).unwrap();
    assert_eq!(fe.backend_count, 1);
    // The retry verifies first (the half-written backend goes), then applies.
    let out = r.retry(&mut dp, &m, r.next_retry().unwrap());
    assert_eq!(out.repaired.deletes, 1, "{:?}", dp.log);
    assert!(out.failed.is_empty() && r.failed().is_empty());
    let fe = dp.state.frontends.values().find(|f| f.flags == 0).unwrap();
    assert_eq!(fe.backend_count, 2);
    assert_eq!(dp.state.backends.len(), 2);
    assert_eq!(
        r.verify(&mut dp, &m, Instant::now()).repaired,
        Report::default()
    );
}

#[test]
fn verification_repairs_entries_changed_behind_the_agents_back() {
    let mut dp = FakeDatapath::new(cap(100));
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    let mut m = model_of(&svc("a", "10.96.0.1", &["10.0.0.1", "10.0.0.2"]));
    m.commit();
    r.apply_all(&mut dp, &m, Instant::now());
    let good = dp.state.clone();
    // Someone deletes a slot and adds a frontend nothing claims.
    let slot = *dp.state.slots.keys().next().unwrap();
    dp.state.slots.remove(&slot);
    let mut stray = *dp.state.frontends.keys().find(|k| k.proto == 6).unwrap();
    stray.port = [0, 81];
    dp.state
        .frontends
        .insert(stray, proxy_common::Frontend::default());
    let out = r.verify(&mut dp, &m, Instant::now());
    assert_eq!((out.repaired.writes, out.repaired.deletes), (1, 1));
    assert_eq!(dp.state, good);
}

fn node_yaml(addrs: &[&str]) -> String {
    let a: Vec<String> = addrs
        .iter()
        .map(|a| format!("{{type: InternalIP, address: '{a}'}}"))
        .collect();
    format!(
        "---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-1}}\nstatus: {{addresses: [{}]}}\n",
        a.join(", ")
    )
}

fn lab() -> FakeDatapath {
    let mut dp = FakeDatapath::new(cap(100));
    for (name, index, addrs) in [
        ("lo", 1, vec!["127.0.0.1"]),
        ("eth0", 2, vec!["192.168.1.5", "fe80::1", "fd00::5"]),
        ("eth1", 3, vec!["192.168.2.5"]),
        ("br0", 4, vec!["10.0.0.254"]),
    ] {
        dp.interfaces.insert(
            name.into(),
            Interface {
                index,
                addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            },
        );
    }
    dp.routes
        .push(("10.0.0.0".parse().unwrap(), 24, "br0".into()));
    dp
}

#[test]
fn interfaces_follow_the_node_addresses_and_pods_behind_snat() {
    let mut dp = lab();
    // An earlier agent left programs on eth1.
    dp.attached.insert("eth1".into());
    let config = NodeConfig {
        interfaces: Vec::new(),
        snat_local: true,
    };
    let mut r = Reconciler::adopt(&dp, config, Duration::from_secs(30)).unwrap();
    let mut m = model_of(&node_yaml(&["192.168.1.5", "fd00::5"]));
    m.commit();
    r.apply_all(&mut dp, &m, Instant::now());
    assert_eq!(dp.attached, BTreeSet::from(["eth0".to_string()]));
    let a = dp.node.iface_addrs[&2];
    assert_eq!(
        a.v4,
        crate::datapath::addr::ip_to_bytes("192.168.1.5".parse().unwrap())
    );
    assert_eq!(
        a.v6,
        crate::datapath::addr::ip_to_bytes("fd00::5".parse().unwrap()),
        "never link-local"
    );
    assert_eq!(a.flags, 0);
    // An endpoint on this node, behind br0: br0 gets the programs as a pod interface.
    apply(
        &mut m,
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: w-1, namespace: ns, labels: {kubernetes.io/service-name: w}}\naddressType: IPv4\nendpoints: [{addresses: [10.0.0.7], nodeName: node-1}]\nports: [{port: 80}]\n",
    );
    let d = m.commit();
    assert!(d.local_endpoints_changed);
    r.apply(&mut dp, &m, &d, Instant::now());
    assert!(dp.attached.contains("br0"));
    assert_eq!(
        dp.node.iface_addrs[&4].flags,
        proxy_common::nat::IFACE_F_POD
    );
    assert_eq!(dp.node.local_endpoints.len(), 1);
    // The node's address moves to eth1: eth0 loses the programs.
    apply(&mut m, &node_yaml(&["192.168.2.5"]));
    let d = m.commit();
    r.apply(&mut dp, &m, &d, Instant::now());
    assert_eq!(
        dp.attached,
        BTreeSet::from(["br0".to_string(), "eth1".to_string()])
    );
    assert!(!dp.node.iface_addrs.contains_key(&2));
    assert!(dp.log.contains(&Op::Detach("eth0".into())));
    assert_eq!(r.verify(&mut dp, &m, Instant::now()).node_changes, 0);
}

/// A LoadBalancer Service with a node port, one endpoint on this node and one elsewhere,
/// the north-south mode annotation `mode` ("" for none).
fn dsr_svc(mode: &str, local_ready: bool) -> String {
    let ann = if mode.is_empty() {
        String::new()
    } else {
        format!(", annotations: {{ebpf-proxy.io/north-south-mode: {mode}}}")
    };
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: ns{ann}}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.9\n  ports: [{{name: http, port: 80, nodePort: 30080}}, {{name: dns, port: 53, protocol: UDP, nodePort: 30053}}]\nstatus: {{loadBalancer: {{ingress: [{{ip: 203.0.113.9}}]}}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: lb-1, namespace: ns, labels: {{kubernetes.io/service-name: lb}}}}\naddressType: IPv4\nendpoints: [{{addresses: [10.0.1.5], nodeName: node-1, conditions: {{ready: {local_ready}}}}}, {{addresses: [10.0.2.5], nodeName: node-2}}]\nports: [{{name: http, port: 8080}}, {{name: dns, port: 5353, protocol: UDP}}]\n"
    )
}

fn dsr_key(frontend: &str, port: u16, proto: u8) -> proxy_common::nat::DsrKey {
    use crate::datapath::addr::ip_to_bytes;
    proxy_common::nat::DsrKey {
        frontend: if frontend.is_empty() {
            [0; 16]
        } else {
            ip_to_bytes(frontend.parse().unwrap())
        },
        backend: ip_to_bytes("10.0.1.5".parse().unwrap()),
        port: port.to_be_bytes(),
        proto,
        _pad: 0,
    }
}

#[test]
fn direct_server_return_pairs_follow_the_mode_and_the_local_endpoints() {
    use proxy_common::{FRONTEND_F_DSR, PROTO_TCP, PROTO_UDP, nat::DsrTarget};
    let mut dp = FakeDatapath::new(cap(100));
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    // An earlier agent left a pair nothing asks for.
    dp.node
        .dsr
        .insert(dsr_key("192.0.2.1", 80, PROTO_TCP), DsrTarget::default());
    let mut r2 = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    std::mem::swap(&mut r, &mut r2);
    // Hybrid: TCP only. The LB IP and the node port (any node's address) are accepted
    // for the endpoint on this node, giving its port.
    let mut m = model_of(&dsr_svc("hybrid", true));
    m.commit();
    r.apply_all(&mut dp, &m, Instant::now());
    let t = DsrTarget {
        port: 8080u16.to_be_bytes(),
        _pad: [0; 2],
    };
    assert_eq!(
        dp.node.dsr,
        BTreeMap::from([
            (dsr_key("203.0.113.9", 80, PROTO_TCP), t),
            (dsr_key("", 30080, PROTO_TCP), t),
        ])
    );
    let dsr_frontends = |dp: &FakeDatapath| {
        dp.state
            .frontends
            .iter()
            .filter(|(_, f)| f.flags & FRONTEND_F_DSR != 0)
            .map(|(k, _)| (k.proto, u16::from_be_bytes(k.port)))
            .collect::<BTreeSet<_>>()
    };
    // (No Node object: this node serves no node port itself, yet accepts the node
    // port's pairs, which name another node's address.)
    assert_eq!(
        dsr_frontends(&dp),
        BTreeSet::from([(PROTO_TCP, 80)]),
        "ingress frontends of TCP only carry the flag"
    );
    // dsr: UDP too.
    apply(&mut m, &dsr_svc("dsr", true));
    let d = m.commit();
    r.apply(&mut dp, &m, &d, Instant::now());
    assert_eq!(dp.node.dsr.len(), 4);
    assert!(dp.node.dsr.contains_key(&dsr_key("", 30053, PROTO_UDP)));
    // The local endpoint neither ready nor serving: nothing to accept.
    apply(&mut m, &dsr_svc("dsr", false));
    let d = m.commit();
    r.apply(&mut dp, &m, &d, Instant::now());
    assert!(dp.node.dsr.is_empty(), "{:?}", dp.node.dsr);
    // Back, then snat: the pairs and the flags go.
    apply(&mut m, &dsr_svc("dsr", true));
    let d = m.commit();
    r.apply(&mut dp, &m, &d, Instant::now());
    assert_eq!(dp.node.dsr.len(), 4);
    apply(&mut m, &dsr_svc("", true));
    let d = m.commit();
    r.apply(&mut dp, &m, &d, Instant::now());
    assert!(dp.node.dsr.is_empty());
    assert!(dsr_frontends(&dp).is_empty());
    // Verification repairs a pair removed behind the agent's back.
    apply(&mut m, &dsr_svc("dsr", true));
    let d = m.commit();
    r.apply(&mut dp, &m, &d, Instant::now());
    let good = dp.node.dsr.clone();
    dp.node.dsr.pop_first();
    r.verify(&mut dp, &m, Instant::now());
    assert_eq!(dp.node.dsr, good);
}

#[test]
fn an_interface_that_fails_to_attach_does_not_hold_up_the_others() {
    let mut dp = lab();
    dp.refuse_attach.insert("eth0".into());
    let config = NodeConfig {
        interfaces: vec!["eth0".into(), "eth1".into()],
        snat_local: false,
    };
    let mut r = Reconciler::adopt(&dp, config, Duration::from_secs(30)).unwrap();
    let mut m = model_of("");
    m.commit();
    r.apply_all(&mut dp, &m, Instant::now());
    assert_eq!(dp.attached, BTreeSet::from(["eth1".to_string()]));
    let e = r.node.errors();
    assert_eq!(e.len(), 1);
    assert!(e.iter().next().unwrap().contains("eth0"), "{e:?}");
    // Retried until it works.
    dp.refuse_attach.clear();
    r.verify(&mut dp, &m, Instant::now());
    assert!(r.node.errors().is_empty());
    assert_eq!(
        dp.attached,
        BTreeSet::from(["eth0".to_string(), "eth1".to_string()])
    );
}

#[test]
fn a_missing_interface_is_reported_until_it_appears() {
    let mut dp = lab();
    let config = NodeConfig {
        interfaces: vec!["eth9".into()],
        snat_local: false,
    };
    let mut r = Reconciler::adopt(&dp, config, Duration::from_secs(30)).unwrap();
    let mut m = model_of("");
    m.commit();
    r.apply_all(&mut dp, &m, Instant::now());
    let e = r.node.errors();
    assert_eq!(e.len(), 1);
    assert!(e.iter().next().unwrap().contains("eth9"), "{e:?}");
    dp.interfaces.insert(
        "eth9".into(),
        Interface {
            index: 9,
            addrs: vec![],
        },
    );
    r.verify(&mut dp, &m, Instant::now());
    assert!(r.node.errors().is_empty());
    assert!(dp.attached.contains("eth9"));
}

#[test]
fn health_servers_follow_the_model_and_busy_ports_are_retried() {
    let mut dp = lab();
    dp.busy_ports.insert(31000);
    let mut r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
    let yaml = "---\napiVersion: v1\nkind: Service\nmetadata: {name: lb, namespace: ns}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.9, externalTrafficPolicy: Local, healthCheckNodePort: 31000, ports: [{port: 80, nodePort: 30080}]}\n";
    let mut m = model_of(yaml);
    m.commit();
    r.apply_all(&mut dp, &m, Instant::now());
    assert!(dp.health.is_empty());
    let e = r.node.errors();
    assert!(
        e.iter()
            .any(|e| e.contains("healthCheckNodePort 31000: cannot listen")),
        "{e:?}"
    );
    dp.busy_ports.clear();
    r.verify(&mut dp, &m, Instant::now());
    assert_eq!(dp.health[&31000].local_endpoints, 0);
    assert!(r.node.errors().is_empty());
    // The Service goes: so does its server.
    m.apply(Change::Delete(Kind::Service, ("ns".into(), "lb".into())));
    let d = m.commit();
    r.apply(&mut dp, &m, &d, Instant::now());
    assert!(dp.health.is_empty());
}
