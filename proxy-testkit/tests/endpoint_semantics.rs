//! Privileged integration tests of kube-proxy's endpoint selection rules on the socket-level
//! data path that need a client running through the change: stale UDP flows and sockets
//! after an endpoint change, and UDP clients of a Service that gets endpoints.
//!
//! The rules that are objects in and connections out (internalTrafficPolicy Local, the
//! short-circuit of external addresses, terminating endpoints, topology hints, pod IPs never
//! being translated) are scenario files `tests/scenarios/socket/endpoints-*.txtar`.
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

/// `default/web` (TCP 80 -> 8080, UDP 53 -> 5353) with the backends `eps` as endpoints on
/// their nodes.
fn web(eps: &[usize]) -> Web {
    Web::new(VIP).endpoints(eps.iter().map(|i| Endpoint::new(b(*i)).on(node_of(*i))))
}

/// Node objects with zone labels (node-a in zone-a, node-b in zone-b) and addresses
/// (node-a is the lab's node namespace, 198.18.0.1; node-b's address exists nowhere).
fn nodes(env: &Env) {
    env.write_manifest(
        "nodes.yaml",
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-a}}\nstatus: {addresses: [{type: InternalIP, address: 198.18.0.1}]}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: node-b, labels: {topology.kubernetes.io/zone: zone-b}}\nstatus: {addresses: [{type: InternalIP, address: 198.18.0.250}]}\n",
    );
}

/// Two nodes: the Env's own agent is node-a, the returned one node-b. `n` backends.
fn two_nodes(name: &str, n: usize) -> (Env, OtherNode) {
    let mut env = Env::new(name, n, false);
    env.extra_agent_args = vec!["--hostname-override".into(), "node-a".into()];
    nodes(&env);
    env.write_web(&web(&[]));
    env.start_agent();
    let other = env.add_node("node-b");
    (env, other)
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
    apply_on(&env, &[&other], || env.write_web(&web(&[0])));
    let extra: &[&str] = if connected {
        &["--connected", "--reconnect"]
    } else {
        &[]
    };
    let client = udp_stream(&env, &a, &format!("{VIP}:53"), 30, extra);
    std::thread::sleep(Duration::from_millis(1000));
    let changed_at = now_ms();
    apply_on(&env, &[&other], || env.write_web(&web(&[1])));
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
    apply_on(&env, &[&other], || env.write_web(&web(&[0])));
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
