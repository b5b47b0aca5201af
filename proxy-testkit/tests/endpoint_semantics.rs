//! Privileged integration tests of kube-proxy's endpoint selection rules on the socket-level
//! data path: internalTrafficPolicy Local, the short-circuit of external addresses,
//! terminating endpoints (KEP-1669), topology hints, stale UDP flows and sockets after an
//! endpoint change, and pod IPs never being translated.
//!
//! Two "nodes" share one lab: each is a cgroup with its own agent (`--hostname-override
//! node-a` / `node-b`) and pin directory, reading the same manifests. Clients run in the
//! client pod inside one node's cgroup. Backends b0 and b2 are on node-a, b1 and b3 on node-b
//! (by the endpoints' `nodeName`). Everything is removed on drop.

mod common;

use std::{
    net::IpAddr,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use common::*;

const ECONNREFUSED: i64 = 111;
const EHOSTUNREACH: i64 = 113;
const EPERM: i64 = 1;
const VIP: &str = "198.19.0.20";

fn b(i: usize) -> IpAddr {
    IpAddr::V4(backend_v4(i))
}

/// The node of backend `i`.
fn node_of(i: usize) -> &'static str {
    if i.is_multiple_of(2) {
        "node-a"
    } else {
        "node-b"
    }
}

/// One endpoint of backend `i` as a YAML list item, with extra conditions and hints.
fn ep(i: usize, conditions: &str, hints: &str) -> String {
    let mut s = format!("- addresses: [\"{}\"]\n  nodeName: {}\n", b(i), node_of(i));
    if !conditions.is_empty() {
        s += &format!("  conditions: {{{conditions}}}\n");
    }
    if !hints.is_empty() {
        s += &format!("  hints: {{{hints}}}\n");
    }
    s
}

/// Service `default/web` (TCP 80 -> 8080, UDP 53 -> 5353) with extra spec lines, and its
/// slice with the given endpoint items.
fn web(env: &Env, spec_extra: &str, status: &str, endpoints: &[String]) {
    let mut svc = service(
        "default",
        "web",
        &[VIP],
        &[("http", 80, 8080, "TCP"), ("dns", 53, 5353, "UDP")],
    );
    svc += spec_extra;
    svc += status;
    let sl = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: default\n  labels:\n    kubernetes.io/service-name: web\naddressType: IPv4\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: dns, port: 5353, protocol: UDP}}\nendpoints:\n{}",
        endpoints.concat()
    );
    env.write_manifest("web.yaml", &format!("{svc}---\n{sl}"));
}

/// Node objects with zone labels (node-a in zone-a, node-b in zone-b) and addresses
/// (node-a is the lab's node namespace, 198.18.0.1; node-b's address exists nowhere).
fn nodes(env: &Env) {
    env.write_manifest(
        "nodes.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-a}}\nstatus: {addresses: [{type: InternalIP, address: 198.18.0.1}]}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: node-b, labels: {topology.kubernetes.io/zone: zone-b}}\nstatus: {addresses: [{type: InternalIP, address: 198.18.0.250}]}\n",
    );
}

fn syncs(log: &str) -> usize {
    log.matches("sync done").count()
}

/// Two nodes: the Env's own agent is node-a, the returned one node-b. `n` backends.
fn two_nodes(name: &str, n: usize) -> (Env, OtherNode) {
    let mut env = Env::new(name, n, false);
    env.extra_agent_args = vec!["--hostname-override".into(), "node-a".into()];
    nodes(&env);
    web(&env, "", "", &[]);
    env.start_agent();
    let other = env.add_node("node-b");
    (env, other)
}

/// Applies a change with `write` and waits until both agents synced it.
fn apply(env: &Env, other: &OtherNode, write: impl FnOnce()) {
    let (a, b) = (syncs(&env.log()), syncs(&other.log()));
    write();
    let start = Instant::now();
    while syncs(&env.log()) <= a || syncs(&other.log()) <= b {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no sync after the change:\n{}\n{}",
            env.log(),
            other.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// TCP connections to `to` from node `cg`: answering backends, or the errnos seen.
fn tcp_from(env: &Env, cg: &Path, to: &str, count: usize) -> Vec<Probe> {
    env.probe_in(cg, &["tcp", "--to", to, "--count", &count.to_string()])
}

fn names(probes: &[Probe]) -> std::collections::BTreeSet<String> {
    by_name(probes).into_keys().collect()
}

fn set(list: &[&str]) -> std::collections::BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn internal_traffic_policy_local_uses_each_nodes_endpoints_and_fails_fast_without() {
    let (env, other) = two_nodes("itp", 2);
    let (a, bnode) = (env.cg.path().to_path_buf(), other.cg.path().to_path_buf());
    let to = format!("{VIP}:80");

    // Cluster policy: both nodes reach both endpoints.
    apply(&env, &other, || {
        web(&env, "", "", &[ep(0, "", ""), ep(1, "", "")])
    });
    assert_eq!(names(&tcp_from(&env, &a, &to, 30)), set(&["b0", "b1"]));
    assert_eq!(names(&tcp_from(&env, &bnode, &to, 30)), set(&["b0", "b1"]));

    // Local: each node only its own endpoint, for TCP and UDP.
    let local = "  internalTrafficPolicy: Local\n";
    apply(&env, &other, || {
        web(&env, local, "", &[ep(0, "", ""), ep(1, "", "")])
    });
    assert_eq!(names(&tcp_from(&env, &a, &to, 20)), set(&["b0"]));
    assert_eq!(names(&tcp_from(&env, &bnode, &to, 20)), set(&["b1"]));
    let udp = env.probe_in(
        &bnode,
        &["udp", "--to", &format!("{VIP}:53"), "--count", "10"],
    );
    assert_eq!(names(&udp), set(&["b1"]));

    // No endpoint on node-a: its clients fail at once with EHOSTUNREACH (kube-proxy drops;
    // a connect() cannot be dropped at the socket level), node-b still works.
    apply(&env, &other, || web(&env, local, "", &[ep(1, "", "")]));
    let started = Instant::now();
    let r = tcp_from(&env, &a, &to, 3);
    let took = started.elapsed();
    println!("connect without a local endpoint failed in {took:?}: {r:?}");
    assert!(r.iter().all(|p| errno(p) == Some(EHOSTUNREACH)), "{r:?}");
    assert!(took < Duration::from_secs(2), "fails fast, took {took:?}");
    let r = env.probe_in(&a, &["udp", "--to", &format!("{VIP}:53"), "--count", "2"]);
    assert!(r.iter().all(|p| errno(p) == Some(EHOSTUNREACH)), "{r:?}");
    assert_eq!(names(&tcp_from(&env, &bnode, &to, 10)), set(&["b1"]));

    // Without any endpoint at all, Local is ECONNREFUSED like a Cluster Service without
    // endpoints: kube-proxy rejects a Service without endpoints whatever its policy, and
    // drops only when other nodes have endpoints.
    apply(&env, &other, || web(&env, local, "", &[]));
    let r = tcp_from(&env, &bnode, &to, 1);
    assert_eq!(errno(&r[0]), Some(ECONNREFUSED), "{r:?}");
    apply(&env, &other, || web(&env, "", "", &[]));
    let r = tcp_from(&env, &bnode, &to, 1);
    assert_eq!(errno(&r[0]), Some(ECONNREFUSED), "{r:?}");
}

#[test]
fn external_addresses_from_inside_reach_remote_endpoints_despite_local_external_policy() {
    let (env, other) = two_nodes("short", 2);
    let a = env.cg.path().to_path_buf();
    // externalTrafficPolicy Local, one external IP and one LB ingress IP, endpoint only on
    // node-b. These addresses exist on no interface: only translation can answer.
    // The http port has node port 30080 (on node-a's address 198.18.0.1, where nothing
    // listens on that port: only translation can answer).
    let spec = "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  externalIPs: [\"203.0.113.10\", \"not-an-ip\"]\n";
    let status = "status:\n  loadBalancer:\n    ingress:\n    - ip: 203.0.113.11\n";
    let write = || {
        web(&env, spec, status, &[ep(1, "", "")]);
        let text = std::fs::read_to_string(env.manifests.path().join("web.yaml")).unwrap();
        env.write_manifest(
            "web.yaml",
            &text.replace(
                "{name: http, port: 80, targetPort: 8080, protocol: TCP}",
                "{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}",
            ),
        );
    };
    apply(&env, &other, write);
    for to in [
        "203.0.113.10:80",
        "203.0.113.11:80",
        "198.18.0.1:30080",
        &format!("{VIP}:80"),
    ] {
        let r = tcp_from(&env, &a, to, 5);
        assert_eq!(names(&r), set(&["b1"]), "{to}: {r:?}");
        // The client sees the address it connected to.
        assert!(r.iter().all(|p| p["peer"] == to), "{r:?}");
    }
    let r = env.probe_in(&a, &["udp", "--to", "203.0.113.11:53", "--count", "3"]);
    assert_eq!(names(&r), set(&["b1"]));
    // The bad address is reported by name and skipped alone.
    env.wait_log(
        |l| l.contains("externalIP \"not-an-ip\" is not a valid IP address; address skipped"),
        "bad externalIP error",
    );
    // Node-b's clients reach node ports on node-b's addresses only; node-a's address is
    // not theirs to translate (node-a's own data path serves it from outside).
    let r = tcp_from(&env, other.cg.path(), "198.18.0.1:30080", 1);
    assert_eq!(errno(&r[0]), Some(ECONNREFUSED), "{r:?}");
    // Undefined ports on external addresses and node IPs are left alone (kube-proxy's
    // nftables mode rejects undefined ports on cluster IPs only): 198.18.0.1:22 is the
    // node namespace itself, which answers with a reset, not translated.
    let r = tcp_from(&env, &a, "198.18.0.1:22", 1);
    assert_eq!(errno(&r[0]), Some(ECONNREFUSED), "{r:?}");
    let maps = env.snapshot();
    let markers: Vec<_> = maps.frontends.keys().filter(|k| k.proto == 0).collect();
    assert_eq!(
        markers.len(),
        1,
        "a VIP marker for the cluster IP only: {markers:?}"
    );
}

#[test]
fn terminating_endpoints_serve_only_when_nothing_is_ready() {
    let (env, other) = two_nodes("term", 3);
    let a = env.cg.path().to_path_buf();
    let to = format!("{VIP}:80");
    let terminating = "ready: false, serving: true, terminating: true";
    let gone = "ready: false, serving: false, terminating: true";

    apply(&env, &other, || {
        web(
            &env,
            "",
            "",
            &[ep(0, "", ""), ep(1, terminating, ""), ep(2, gone, "")],
        )
    });
    assert_eq!(names(&tcp_from(&env, &a, &to, 20)), set(&["b0"]));

    // b0 stops being ready: the serving terminating endpoint takes the traffic.
    apply(&env, &other, || {
        web(
            &env,
            "",
            "",
            &[
                ep(0, "ready: false", ""),
                ep(1, terminating, ""),
                ep(2, gone, ""),
            ],
        )
    });
    assert_eq!(names(&tcp_from(&env, &a, &to, 20)), set(&["b1"]));

    // Only non-serving terminating endpoints: the Service has no endpoints.
    apply(&env, &other, || {
        web(&env, "", "", &[ep(1, gone, ""), ep(2, gone, "")])
    });
    let r = tcp_from(&env, &a, &to, 2);
    assert!(r.iter().all(|p| errno(p) == Some(ECONNREFUSED)), "{r:?}");

    // Local policy: node-b's own terminating endpoint, although node-a has a ready one.
    apply(&env, &other, || {
        web(
            &env,
            "  internalTrafficPolicy: Local\n",
            "",
            &[ep(0, "", ""), ep(1, terminating, "")],
        )
    });
    assert_eq!(
        names(&tcp_from(&env, other.cg.path(), &to, 10)),
        set(&["b1"])
    );
    assert_eq!(names(&tcp_from(&env, &a, &to, 10)), set(&["b0"]));
}

#[test]
fn topology_hints_keep_traffic_in_zone_or_node_with_fallbacks() {
    let (env, other) = two_nodes("topo", 4);
    let (a, bnode) = (env.cg.path().to_path_buf(), other.cg.path().to_path_buf());
    let to = format!("{VIP}:80");
    let zone = |z: &str| format!("forZones: [{{name: {z}}}]");

    // b0, b1 hinted for zone-a; b2, b3 for zone-b.
    let zoned = [
        ep(0, "", &zone("zone-a")),
        ep(1, "", &zone("zone-a")),
        ep(2, "", &zone("zone-b")),
        ep(3, "", &zone("zone-b")),
    ];
    let spec = "  trafficDistribution: PreferClose\n";
    apply(&env, &other, || web(&env, spec, "", &zoned));
    assert_eq!(names(&tcp_from(&env, &a, &to, 40)), set(&["b0", "b1"]));
    assert_eq!(names(&tcp_from(&env, &bnode, &to, 40)), set(&["b2", "b3"]));

    // One ready endpoint without a hint: hints are ignored everywhere.
    let mut partial = zoned.clone();
    partial[3] = ep(3, "", "");
    apply(&env, &other, || web(&env, spec, "", &partial));
    assert_eq!(
        names(&tcp_from(&env, &a, &to, 60)),
        set(&["b0", "b1", "b2", "b3"])
    );

    // No endpoint for zone-b: node-b uses every endpoint, node-a keeps its zone.
    let only_a = [ep(0, "", &zone("zone-a")), ep(1, "", &zone("zone-a"))];
    apply(&env, &other, || web(&env, spec, "", &only_a));
    assert_eq!(names(&tcp_from(&env, &bnode, &to, 40)), set(&["b0", "b1"]));

    // Node hints (PreferSameNode) win over zone hints when one names this node.
    let node_hint = |i: usize| {
        format!(
            "forZones: [{{name: zone-a}}], forNodes: [{{name: {}}}]",
            node_of(i)
        )
    };
    let by_node = [ep(0, "", &node_hint(0)), ep(1, "", &node_hint(1))];
    apply(&env, &other, || {
        web(
            &env,
            "  trafficDistribution: PreferSameNode\n",
            "",
            &by_node,
        )
    });
    assert_eq!(names(&tcp_from(&env, &a, &to, 20)), set(&["b0"]));
    assert_eq!(names(&tcp_from(&env, &bnode, &to, 20)), set(&["b1"]));
}

/// Starts a UDP client in node `cg` sending to `to` every 100 ms for `count` attempts.
fn udp_stream(env: &Env, cg: &Path, to: &str, count: u32, extra: &[&str]) -> ChildGuardOut {
    let mut cmd = Command::new(NETPROBE);
    cmd.args(["udp", "--to", to, "--count", &count.to_string()])
        .args(["--interval-ms", "100", "--timeout-ms", "300"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    ChildGuardOut(env.client.spawn(Some(cg), &mut cmd).expect("udp client"))
}

/// A running netprobe whose JSON lines are read when it ends.
struct ChildGuardOut(proxy_testkit::testbed::ChildGuard);

impl ChildGuardOut {
    fn lines(self) -> Vec<Probe> {
        finish_probe(self.0)
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Replaces b0 by b1 under a UDP client sending every 100 ms, and checks that nothing goes
/// to b0 after the change (b0 keeps running, so a stale flow would still be answered) and
/// that no datagram is lost; returns how long after the change the first b1 answer came.
fn replace_under_udp_stream(name: &str, connected: bool) {
    let (env, other) = two_nodes(name, 2);
    let a = env.cg.path().to_path_buf();
    // Another Service keeps b0 as an endpoint, so b0's backend entry stays in the maps and
    // only the release of flows and sockets can move the client.
    let keep = service(
        "default",
        "keep",
        &["198.19.0.21"],
        &[("dns", 53, 5353, "UDP")],
    );
    let keep_slice = slice(
        "default",
        "keep-1",
        "keep",
        "IPv4",
        &[("dns", 5353, "UDP")],
        &[(b(0), true)],
    );
    env.write_manifest("keep.yaml", &format!("{keep}---\n{keep_slice}"));
    apply(&env, &other, || web(&env, "", "", &[ep(0, "", "")]));
    let extra: &[&str] = if connected {
        &["--connected", "--reconnect"]
    } else {
        &[]
    };
    let client = udp_stream(&env, &a, &format!("{VIP}:53"), 30, extra);
    std::thread::sleep(Duration::from_millis(1000));
    let changed_at = now_ms();
    apply(&env, &other, || web(&env, "", "", &[ep(1, "", "")]));
    let synced_at = now_ms();
    // The egress program that fails a stale socket's sends is attached only for it.
    assert_eq!(
        env.pin_path().join("link_sock_egress").exists(),
        connected,
        "egress program attached only when a connected socket went stale"
    );
    let lines = client.lines();
    assert_eq!(lines.len(), 30, "{lines:?}");
    let before: Vec<&Probe> = lines
        .iter()
        .filter(|p| p["at_ms"].as_u64().unwrap() < changed_at)
        .collect();
    assert!(before.len() >= 5, "{lines:?}");
    assert!(before.iter().all(|p| p["name"] == "b0"), "{before:?}");
    let after: Vec<&Probe> = lines
        .iter()
        .filter(|p| p["at_ms"].as_u64().unwrap() > synced_at)
        .collect();
    assert!(after.len() >= 10, "{lines:?}");
    // No silent loss, nothing to the removed endpoint once the agent synced.
    assert!(lines.iter().all(|p| p["ok"] == true), "{lines:?}");
    assert!(after.iter().all(|p| p["name"] == "b1"), "{after:?}");
    let first_b1 = lines
        .iter()
        .find(|p| p["name"] == "b1")
        .map(|p| p["at_ms"].as_u64().unwrap())
        .unwrap();
    println!(
        "{} UDP: first answer from the new endpoint {} ms after the manifest change (agent synced after {} ms)",
        if connected {
            "connected"
        } else {
            "unconnected"
        },
        first_b1.saturating_sub(changed_at),
        synced_at - changed_at
    );
    if connected {
        // The application saw one error (EPERM) and reconnected.
        let errors: Vec<&Probe> = lines
            .iter()
            .filter(|p| !p["reconnected_after"].is_null())
            .collect();
        assert_eq!(errors.len(), 1, "{lines:?}");
        assert_eq!(errors[0]["reconnected_after"]["errno"], EPERM, "{errors:?}");
        assert_eq!(errors[0]["name"], "b1");
        // The socket reconnected (and is closed now): no socket is stale, so the agent's
        // next collection pass (every 10 s with the default UDP timeout) detaches the
        // egress program again.
        let link = env.pin_path().join("link_sock_egress");
        let start = Instant::now();
        while link.exists() {
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "egress program still attached with no stale socket"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn unconnected_udp_flow_moves_to_the_new_endpoint_at_once() {
    replace_under_udp_stream("udpflow", false);
}

#[test]
fn connected_udp_socket_to_a_removed_endpoint_gets_an_error_and_recovers() {
    replace_under_udp_stream("udpconn", true);
}

#[test]
fn udp_clients_recover_at_once_when_a_service_gets_endpoints() {
    let (env, other) = two_nodes("none2some", 1);
    let a = env.cg.path().to_path_buf();
    // No endpoints: refused.
    let client = udp_stream(&env, &a, &format!("{VIP}:53"), 25, &[]);
    std::thread::sleep(Duration::from_millis(800));
    let changed_at = now_ms();
    apply(&env, &other, || web(&env, "", "", &[ep(0, "", "")]));
    let synced_at = now_ms();
    let lines = client.lines();
    let refused = lines
        .iter()
        .filter(|p| errno(p) == Some(ECONNREFUSED))
        .count();
    assert!(refused >= 5, "{lines:?}");
    let after: Vec<&Probe> = lines
        .iter()
        .filter(|p| p["at_ms"].as_u64().unwrap() > synced_at)
        .collect();
    assert!(
        after.len() >= 10 && after.iter().all(|p| p["name"] == "b0"),
        "{lines:?}"
    );
    let first_ok = lines.iter().find(|p| p["ok"] == true).unwrap();
    println!(
        "first answer {} ms after the manifest change (agent synced after {} ms)",
        first_ok["at_ms"]
            .as_u64()
            .unwrap()
            .saturating_sub(changed_at),
        synced_at - changed_at
    );
}

#[test]
fn pod_ips_are_never_translated() {
    let (env, other) = two_nodes("podip", 2);
    let a = env.cg.path().to_path_buf();
    // b1 is the only endpoint; connections straight to b0's and b1's pod IPs (which are
    // endpoints' addresses, on the Service's target ports) reach exactly those pods.
    apply(&env, &other, || web(&env, "", "", &[ep(1, "", "")]));
    for i in [0, 1] {
        let to = format!("{}:8080", b(i));
        let r = tcp_from(&env, &a, &to, 5);
        assert_eq!(names(&r), set(&[&format!("b{i}")]), "{r:?}");
        assert!(r.iter().all(|p| p["peer"] == to), "{r:?}");
        let r = env.probe_in(
            &a,
            &["udp", "--to", &format!("{}:5353", b(i)), "--count", "3"],
        );
        assert_eq!(names(&r), set(&[&format!("b{i}")]), "{r:?}");
        assert!(
            r.iter().all(|p| p["from"] == format!("{}:5353", b(i))),
            "{r:?}"
        );
    }
}
