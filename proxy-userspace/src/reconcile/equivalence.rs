//! Randomized equivalence of the incremental control plane with a fresh full build: any
//! sequence of object changes (adds, edits, deletes, conflicting frontends, bad objects,
//! Node edits), read into one model and programmed change by change, leaves exactly the
//! maps, interfaces and health servers that a fresh model and reconciler programmed from
//! the final objects leave.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use proxy_common::{Backend, FrontendKey};

use super::{NodeConfig, Reconciler};
use crate::datapath::{Capacity, Interface, NodeSnapshot, fake::FakeDatapath};
use crate::model::{HealthCheck, Model, NodeInfo};
use crate::source::{Change, Kind, ObjectSet, manifests::parse_documents};

/// A small deterministic PRNG (xorshift), so a failure names its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

const SERVICES: [(&str, &str); 6] = [
    ("a", "web"),
    ("a", "api"),
    ("b", "web"),
    ("b", "dns"),
    ("c", "lb"),
    ("c", "np"),
];

fn service_yaml(r: &mut Rng, ns: &str, name: &str) -> String {
    let cluster_v4 = r
        .pick(&["10.96.0.1", "10.96.0.2", "10.96.0.3", "x"])
        .to_string();
    let ips = match r.below(4) {
        0 => format!("[{cluster_v4}, 'fd00::1']"),
        1 => "['fd00::2']".to_string(),
        _ => format!("[{cluster_v4}]"),
    };
    let mut ports = vec!["{name: http, port: 80, nodePort: 30080}".to_string()];
    if r.chance(50) {
        ports.push(format!(
            "{{name: dns, port: 53, protocol: UDP{}}}",
            if r.chance(50) {
                ", nodePort: 30053"
            } else {
                ""
            }
        ));
    }
    if r.chance(10) {
        ports.push("{name: bad, port: 99999}".into());
    }
    let mut spec = format!(
        "  type: LoadBalancer\n  clusterIPs: {ips}\n  ports: [{}]\n",
        ports.join(", ")
    );
    if r.chance(50) {
        spec += &format!(
            "  externalIPs: [{}]\n",
            r.pick(&["192.0.2.7", "192.0.2.8", "'2001:db8::7'", "bogus"])
        );
    }
    if r.chance(50) {
        spec += &format!(
            "  externalTrafficPolicy: Local\n  healthCheckNodePort: {}\n",
            r.pick(&[31000, 31001, 0, 99999])
        );
    }
    if r.chance(20) {
        spec += "  internalTrafficPolicy: Local\n";
    }
    if r.chance(30) {
        spec += &format!(
            "  loadBalancerSourceRanges: [{}]\n",
            r.pick(&[
                "192.0.2.0/24",
                "'198.51.100.0/24', bogus",
                "'2001:db8::/32'"
            ])
        );
    }
    if r.chance(30) {
        spec += "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n";
    }
    let mut meta = format!("name: {name}, namespace: {ns}");
    if r.chance(60) {
        meta += &format!(
            ", creationTimestamp: '2026-0{}-01T00:00:00Z'",
            1 + r.below(3)
        );
    }
    let alg = r.pick(&[
        "",
        "round-robin",
        "maglev",
        "weighted-round-robin",
        "least-connections",
        "wlc",
        "never-queue",
        "dh",
        "nonsense",
    ]);
    let mut annotations = Vec::new();
    if !alg.is_empty() {
        annotations.push(format!(
            "ebpf-proxy.io/lb-algorithm: {alg}, ebpf-proxy.io/weights: '{{\"10.0.0.1\": 3, \"10.0.0.2\": 0}}'"
        ));
    }
    let north_south = r.pick(&["", "dsr", "hybrid", "snat", "bogus"]);
    if !north_south.is_empty() {
        annotations.push(format!("ebpf-proxy.io/north-south-mode: {north_south}"));
    }
    if !annotations.is_empty() {
        meta += &format!(", annotations: {{{}}}", annotations.join(", "));
    }
    let lb = r.pick(&["203.0.113.9", "203.0.113.10", "192.0.2.7"]);
    let mode = r.pick(&["", ", ipMode: Proxy"]);
    format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{{meta}}}\nspec:\n{spec}status: {{loadBalancer: {{ingress: [{{ip: {lb}{mode}}}]}}}}\n"
    )
}

fn slice_yaml(r: &mut Rng, ns: &str, name: &str, service: &str) -> String {
    let v6 = r.chance(20);
    let pool: &[&str] = if v6 {
        &["'fd00:1::1'", "'fd00:1::2'", "bogus"]
    } else {
        &[
            "10.0.0.1",
            "10.0.0.2",
            "10.0.0.3",
            "10.0.0.4",
            "'fd00:1::9'",
        ]
    };
    let mut eps = Vec::new();
    for _ in 0..r.below(4) {
        let mut e = format!(
            "{{addresses: [{}], nodeName: {}",
            r.pick(pool),
            r.pick(&["node-1", "node-2"])
        );
        match r.below(5) {
            0 => e += ", conditions: {ready: false, serving: true, terminating: true}",
            1 => e += ", conditions: {ready: false}",
            _ => {}
        }
        if r.chance(30) {
            e += &format!(
                ", hints: {{forZones: [{{name: {}}}]}}",
                r.pick(&["zone-a", "zone-b"])
            );
        }
        eps.push(e + "}");
    }
    let ports = r.pick(&[
        "[{name: http, port: 8080}, {name: dns, port: 5353, protocol: UDP}]",
        "[{name: http, port: 8081}]",
        "[{name: dns, port: 5353, protocol: UDP}]",
    ]);
    format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: {ns}, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: {}\nendpoints: [{}]\nports: {ports}\n",
        if v6 { "IPv6" } else { "IPv4" },
        eps.join(", ")
    )
}

fn node_yaml(r: &mut Rng) -> String {
    let mut addrs = vec!["{type: InternalIP, address: 192.168.1.5}".to_string()];
    if r.chance(50) {
        addrs.push("{type: ExternalIP, address: 192.168.1.6}".into());
    }
    if r.chance(30) {
        addrs.push("{type: InternalIP, address: 'fd00::5'}".into());
    }
    if r.chance(10) {
        addrs.push("{type: InternalIP, address: bogus}".into());
    }
    format!(
        "---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-1, labels: {{topology.kubernetes.io/zone: {}}}}}\nstatus: {{addresses: [{}]}}\n",
        r.pick(&["zone-a", "zone-b"]),
        addrs.join(", ")
    )
}

/// One random change.
fn random_change(r: &mut Rng) -> Vec<Change> {
    let one = |yaml: String| {
        let (objs, errors) = parse_documents("gen.yaml", &yaml);
        assert!(errors.is_empty(), "{errors:?}\n{yaml}");
        objs.into_iter().map(Change::Apply).collect::<Vec<_>>()
    };
    match r.below(10) {
        0 => {
            if r.chance(80) {
                one(node_yaml(r))
            } else {
                vec![Change::Delete(Kind::Node, (String::new(), "node-1".into()))]
            }
        }
        1..=4 => {
            let (ns, name) = *r.pick(&SERVICES);
            if r.chance(15) {
                vec![Change::Delete(Kind::Service, (ns.into(), name.into()))]
            } else {
                one(service_yaml(r, ns, name))
            }
        }
        _ => {
            let (ns, service) = *r.pick(&SERVICES);
            let name = format!("{service}-{}", r.below(2));
            if r.chance(15) {
                vec![Change::Delete(Kind::EndpointSlice, (ns.into(), name))]
            } else {
                one(slice_yaml(r, ns, &name, service))
            }
        }
    }
}

fn fake() -> FakeDatapath {
    let mut dp = FakeDatapath::new(Capacity {
        frontends: 10_000,
        slots: 10_000,
        backends: 10_000,
        services: 10_000,
    });
    dp.interfaces.insert(
        "eth0".into(),
        Interface {
            index: 2,
            addrs: vec!["192.168.1.5".parse().unwrap(), "fd00::5".parse().unwrap()],
        },
    );
    dp.interfaces.insert(
        "eth1".into(),
        Interface {
            index: 3,
            addrs: vec!["192.168.1.6".parse().unwrap()],
        },
    );
    dp.interfaces.insert(
        "br0".into(),
        Interface {
            index: 4,
            addrs: vec!["10.0.0.254".parse().unwrap()],
        },
    );
    dp.routes
        .push(("10.0.0.0".parse().unwrap(), 24, "br0".into()));
    dp.busy_ports.insert(31001);
    dp
}

/// What a frontend means, independent of ids: its value's settings, the service name of its
/// id and of its affinity group, and its backends in slot order (sorted: the slot order
/// depends on history).
type FrontendView = (u32, u8, u32, String, String, Vec<Backend>);

/// What the fake data path holds, independent of the ids allocated.
#[derive(Debug, PartialEq, Eq)]
struct View {
    frontends: BTreeMap<FrontendKey, FrontendView>,
    members: BTreeMap<(String, Backend), u32>,
    maglev: BTreeMap<String, Vec<Option<Backend>>>,
    node: NodeSnapshot,
    attached: BTreeSet<String>,
    health: BTreeMap<u16, HealthCheck>,
}

fn view(dp: &FakeDatapath) -> View {
    let s = &dp.state;
    let name = |id: u32| {
        s.names
            .get(&id)
            .cloned()
            .unwrap_or_else(|| format!("#{id}"))
    };
    let mut frontends = BTreeMap::new();
    for (k, f) in &s.frontends {
        let mut backends: Vec<Backend> = (0..f.backend_count)
            .filter_map(|slot| {
                s.slots.get(&proxy_common::BackendSlotKey {
                    service_id: f.service_id,
                    slot,
                })
            })
            .map(|b| s.backends[b])
            .collect();
        backends.sort_by_key(|b| (b.addr, b.port, b.proto));
        let group = if f.affinity_group != 0 {
            name(f.affinity_group)
        } else {
            String::new()
        };
        let who = if f.flags & proxy_common::FRONTEND_F_VIP_MARKER != 0 {
            String::new()
        } else {
            name(f.service_id)
        };
        frontends.insert(
            *k,
            (
                f.flags,
                f.algorithm,
                f.affinity_timeout_s,
                who,
                group,
                backends,
            ),
        );
    }
    let members = s
        .members
        .iter()
        .map(|(m, w)| ((name(m.service_id), s.backends[&m.backend_id]), *w))
        .collect();
    let maglev = dp
        .tables
        .iter()
        .map(|(id, t)| {
            (
                name(*id),
                t.iter().map(|b| s.backends.get(b).copied()).collect(),
            )
        })
        .collect();
    View {
        frontends,
        members,
        maglev,
        node: dp.node.clone(),
        attached: dp.attached.clone(),
        health: dp.health.clone(),
    }
}

fn node_info() -> NodeInfo {
    NodeInfo {
        name: "node-1".into(),
        ..Default::default()
    }
}

fn node_config() -> NodeConfig {
    NodeConfig {
        interfaces: Vec::new(),
        snat_local: true,
    }
}

fn check_seed(seed: u64) {
    let mut r = Rng(seed);
    let mut model = Model::new(node_info());
    let mut objects = ObjectSet::default();
    let mut dp = fake();
    let mut rec = Reconciler::adopt(&dp, node_config(), Duration::from_secs(30)).unwrap();
    let now = Instant::now();
    let mut first = true;
    for step in 0..200 {
        for c in random_change(&mut r) {
            objects.apply(c.clone());
            model.apply(c);
        }
        if r.chance(40) {
            let delta = model.commit();
            let out = if first {
                first = false;
                rec.apply_all(&mut dp, &model, now)
            } else {
                rec.apply(&mut dp, &model, &delta, now)
            };
            assert!(
                out.failed.is_empty(),
                "seed {seed} step {step}: {:?}",
                out.failed
            );
            let broken = dp.consistency_violations();
            assert!(broken.is_empty(), "seed {seed} step {step}: {broken:#?}");
            if r.chance(20) {
                let n = dp.log.len();
                let v = rec.verify(&mut dp, &model, now);
                if v.repaired.writes + v.repaired.deletes > 0 {
                    eprintln!("repairs: {:#?}", &dp.log[n..]);
                }
                assert_eq!(
                    (v.repaired.writes, v.repaired.deletes),
                    (0, 0),
                    "seed {seed} step {step}: verification found differences"
                );
            }
        }
    }
    let delta = model.commit();
    if first {
        rec.apply_all(&mut dp, &model, now);
    } else {
        rec.apply(&mut dp, &model, &delta, now);
    }
    let fresh_model = Model::from_objects(&objects, &node_info());
    assert_eq!(
        model.desired_state(),
        fresh_model.desired_state(),
        "seed {seed}: the incremental desired state differs from a full build"
    );
    let errs = |m: &Model| {
        let mut v: Vec<String> = m.errors().iter().map(ToString::to_string).collect();
        v.sort();
        v
    };
    assert_eq!(
        errs(&model),
        errs(&fresh_model),
        "seed {seed}: errors differ"
    );
    assert_eq!(
        model.health_checks(),
        fresh_model.health_checks(),
        "seed {seed}"
    );
    let mut fresh_dp = fake();
    let mut fresh_rec =
        Reconciler::adopt(&fresh_dp, node_config(), Duration::from_secs(30)).unwrap();
    fresh_rec.apply_all(&mut fresh_dp, &fresh_model, now);
    let (a, b) = (view(&dp), view(&fresh_dp));
    let broken = dp.consistency_violations();
    assert!(broken.is_empty(), "seed {seed}: {broken:#?}");
    assert_eq!(a, b, "seed {seed}: the maps differ from a fresh full build");
    assert_eq!(
        rec.node.errors(),
        fresh_rec.node.errors(),
        "seed {seed}: node errors differ"
    );
    // And the verification agrees there is nothing to repair.
    let v = rec.verify(&mut dp, &model, now);
    assert_eq!(
        (v.repaired.writes, v.repaired.deletes),
        (0, 0),
        "seed {seed}"
    );
}

#[test]
fn incremental_changes_give_the_maps_of_a_fresh_full_build() {
    for seed in 1..=60u64 {
        check_seed(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
}

/// A VIP marker lives as long as a cluster-IP frontend of its address: when an older
/// Service's external IP takes over the frontend of a younger Service's cluster IP (which is
/// then skipped), the marker goes with it, as in a fresh full build.
#[test]
fn a_vip_marker_goes_when_its_cluster_ip_frontend_becomes_an_external_address() {
    use crate::datapath::addr::ip_to_bytes;
    use crate::datapath::vip::marker_key;
    let apply = |model: &mut Model, yaml: &str| {
        let (objs, errors) = parse_documents("test.yaml", yaml);
        assert!(errors.is_empty(), "{errors:?}");
        for o in objs {
            model.apply(Change::Apply(o));
        }
    };
    let marker = marker_key(ip_to_bytes("10.96.0.4".parse().unwrap()));
    let mut model = Model::new(node_info());
    let mut dp = fake();
    let mut rec = Reconciler::adopt(&dp, node_config(), Duration::from_secs(30)).unwrap();
    let now = Instant::now();
    // "a/web" alone: its cluster IP gets a marker.
    apply(
        &mut model,
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: a}\nspec: {clusterIP: 10.96.0.4, ports: [{port: 80, protocol: UDP}]}\n",
    );
    model.commit();
    rec.apply_all(&mut dp, &model, now);
    assert!(dp.state.frontends.contains_key(&marker));
    // "a/api" sorts first (no creation times), so its external IP keeps 10.96.0.4:80/UDP and
    // "a/web" is skipped.
    apply(
        &mut model,
        "apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: a}\nspec: {clusterIP: 10.96.0.3, externalIPs: [10.96.0.4], ports: [{port: 80, protocol: UDP}]}\n",
    );
    let delta = model.commit();
    let out = rec.apply(&mut dp, &model, &delta, now);
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    assert!(
        !dp.state.frontends.contains_key(&marker),
        "stale VIP marker of 10.96.0.4"
    );
    let broken = dp.consistency_violations();
    assert!(broken.is_empty(), "{broken:#?}");
    let v = rec.verify(&mut dp, &model, now);
    assert_eq!((v.repaired.writes, v.repaired.deletes), (0, 0));
}
