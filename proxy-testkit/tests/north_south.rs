//! Privileged integration tests of the north-south data path that stay code: they steer
//! the test from what the data path did (least-connections counts polled while the held
//! connections of whichever backend answered are closed, affinity timing, conntrack entries
//! edited in place). The other north-south cases are scenario files
//! (`tests/scenarios/north-south/`, run by `tests/scenarios.rs`); the lab is `nslab`'s.

mod common;
mod nslab;

use std::{
    io::{BufRead, BufReader},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::Path,
    time::{Duration, Instant},
};

use common::{DNS, Endpoint, HTTP, Port, Web};
use nslab::{
    CLIENT, EXTERNAL_IP, LB_IP, Lab, NODE_A, POD_A0, POD_B0, SHORT, T, ip_of, tcp_whoami,
    udp_whoami,
};
use proxy_testkit::testbed::in_netns;
use proxy_userspace::datapath::tc;

/// The closed port of the lab's Service: UDP 54 -> 5999 (NodePort 30054), where no backend
/// listens.
const CLOSED: Port = Port {
    name: "closed",
    port: 54,
    target: 5999,
    proto: "UDP",
    node_port: Some(30054),
};

/// The lab's ports: TCP 80 -> 8080 (NodePort 30080), UDP 53 -> 5353 (NodePort 30053) and
/// [`CLOSED`].
const LAB_PORTS: [Port; 3] = [HTTP.node_port(30080), DNS.node_port(30053), CLOSED];

/// `endpoints` (address, node) as the slices' endpoints.
fn on_nodes(endpoints: &[(&str, &str)]) -> Vec<Endpoint> {
    endpoints
        .iter()
        .map(|(ip, node)| Endpoint::new(ip.parse::<std::net::IpAddr>().unwrap()).on(node))
        .collect()
}

/// Service `default/web` of type LoadBalancer: [`LAB_PORTS`], cluster IP 198.19.0.30, an
/// external IP and an LB IP, endpoints (address, node). Extra spec lines go after `spec:`.
fn web(lab: &Lab, spec_extra: &str, endpoints: &[(&str, &str)]) {
    web_with(lab, &[], spec_extra, endpoints)
}

/// [`web`] with `metadata.annotations`.
fn web_with(lab: &Lab, annotations: &[(&str, &str)], spec_extra: &str, endpoints: &[(&str, &str)]) {
    let mut w = Web::new("198.19.0.30")
        .ports(&LAB_PORTS)
        .spec(&format!(
            "  type: LoadBalancer\n  externalIPs: [{EXTERNAL_IP}]\n{spec_extra}"
        ))
        .status(&format!(
            "status:\n  loadBalancer:\n    ingress: [{{ip: {LB_IP}}}]\n"
        ))
        .endpoints(on_nodes(endpoints));
    for (k, v) in annotations {
        w = w.annotation(k, v);
    }
    lab.write("web.yaml", &w.yaml());
}

/// A TCP connection from the client namespace held open: the stream and the backend's name
/// (the first line the backend sends).
fn hold(client: &Path, to: &str) -> (TcpStream, String) {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(client, move || {
        let s = TcpStream::connect_timeout(&to, T).unwrap_or_else(|e| panic!("TCP to {to}: {e}"));
        s.set_read_timeout(Some(T)).unwrap();
        let mut name = String::new();
        BufReader::new(&s).read_line(&mut name).unwrap();
        (s, name.trim().to_string())
    })
    .unwrap()
}

/// `ebpf-proxy <command> --pin-dir <agent a's> -o json`, parsed.
fn agent_json(lab: &Lab, a: usize, command: &str) -> serde_json::Value {
    let dir = lab.agents[a].pin.file_name().unwrap().to_str().unwrap();
    common::agent_json(dir, &[command])
}

/// `ebpf-proxy backends -o json` of agent `a`: "address:port/PROTO" -> least-connections
/// count (`active`).
fn active(lab: &Lab, a: usize) -> std::collections::BTreeMap<String, u64> {
    let rows = agent_json(lab, a, "backends");
    rows.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                format!(
                    "{}/{}",
                    r["backend"].as_str().unwrap(),
                    r["protocol"].as_str().unwrap()
                ),
                r["active"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Waits (at most `within`) until `f` holds for agent `a`'s least-connections counts.
fn wait_active(
    lab: &Lab,
    a: usize,
    within: Duration,
    what: &str,
    f: impl Fn(&std::collections::BTreeMap<String, u64>) -> bool,
) {
    let start = Instant::now();
    loop {
        let now = active(lab, a);
        if f(&now) {
            return;
        }
        assert!(start.elapsed() < within, "{what}: counts {now:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

const POD_A1: &str = "198.18.1.11";

#[test]
fn least_connections_counts_tc_flows_and_gives_them_back() {
    let mut lab = Lab::new("lc");
    lab.add_pod(0, "a1", POD_A1, "198.18.1.1");
    // a0 and a1 on node-a (client address kept), b0 on node-b (reached through SNAT).
    web_with(
        &lab,
        &[("ebpf-proxy.io/lb-algorithm", "least-connections")],
        "",
        &[(POD_A0, "node-a"), (POD_A1, "node-a"), (POD_B0, "node-b")],
    );
    // Unreplied UDP flows expire after 1 s, answered ones after 2 s: the collection of
    // ended flows is seen within the test.
    let flags = [
        "--udp-flow-timeout",
        "1s",
        "--conntrack-udp-timeout-stream",
        "2s",
    ];
    lab.start_agent(0, &flags);
    let c = lab.client_path();
    let np = format!("{NODE_A}:30080");
    // Least-connections with held connections: every round of three new connections goes
    // to the three backends once (ties are broken at random, a busier backend never wins).
    let mut held: Vec<(TcpStream, String)> = Vec::new();
    for round in 0..2 {
        let names: std::collections::BTreeSet<String> = (0..3)
            .map(|_| {
                let h = hold(&c, &np);
                let n = h.1.clone();
                held.push(h);
                n
            })
            .collect();
        assert_eq!(names.len(), 3, "round {round}: {held:?}");
    }
    let tcp = |name: &str| {
        let ip = match name {
            "a0" => POD_A0,
            "a1" => POD_A1,
            _ => POD_B0,
        };
        format!("{ip}:8080/TCP")
    };
    wait_active(&lab, 0, T, "two held connections each", |m| {
        ["a0", "a1", "b0"]
            .iter()
            .all(|n| m.get(&tcp(n)) == Some(&2))
    });
    // Short connections (closed by both sides: FIN each way) give their count back at once.
    for _ in 0..6 {
        tcp_whoami(&c, &np, T).unwrap();
    }
    wait_active(&lab, 0, T, "closed connections released", |m| {
        ["a0", "a1", "b0"]
            .iter()
            .all(|n| m.get(&tcp(n)) == Some(&2))
    });
    // Closing both connections of one backend makes it the least loaded: the next two new
    // connections go there. Also for the SNAT backend b0 (its FIN comes back through the
    // node as a reply).
    for victim in ["a1", "b0"] {
        held.retain(|(_, n)| n != victim);
        wait_active(&lab, 0, T, &format!("{victim} released"), |m| {
            m.get(&tcp(victim)) == Some(&0)
        });
        for _ in 0..2 {
            let h = hold(&c, &np);
            assert_eq!(h.1, victim, "least-connections picks the idle backend");
            held.push(h);
        }
    }
    // The counts are pinned: an agent crash and restart keeps them.
    lab.restart_agent(0);
    wait_active(&lab, 0, T, "counts after a restart", |m| {
        ["a0", "a1", "b0"]
            .iter()
            .all(|n| m.get(&tcp(n)) == Some(&2))
    });
    // UDP flows have no FIN: each is counted while live, and the agent's collection gives
    // the count back once its conntrack entry timed out (2 s after the last reply).
    for _ in 0..3 {
        udp_whoami(&c, &format!("{NODE_A}:30053"), T).unwrap();
    }
    let udp_total = |m: &std::collections::BTreeMap<String, u64>| -> u64 {
        m.iter()
            .filter(|(k, _)| k.ends_with("/UDP"))
            .map(|(_, v)| v)
            .sum()
    };
    let m = active(&lab, 0);
    assert_eq!(udp_total(&m), 3, "three live UDP flows counted: {m:?}");
    assert!(
        m.iter()
            .filter(|(k, _)| k.ends_with(":5353/UDP"))
            .all(|(_, v)| *v == 1),
        "one UDP flow per backend: {m:?}"
    );
    wait_active(&lab, 0, Duration::from_secs(8), "UDP flows expired", |m| {
        udp_total(m) == 0
    });
    // The held TCP connections are untouched by the collection.
    let m = active(&lab, 0);
    assert!(
        ["a0", "a1", "b0"]
            .iter()
            .all(|n| m.get(&tcp(n)) == Some(&2)),
        "{m:?}"
    );
    // Closing everything gives every count back.
    drop(held);
    wait_active(&lab, 0, T, "all released", |m| m.values().all(|v| *v == 0));
}

#[test]
fn affinity_and_algorithms_apply_to_node_ports_and_lb_ips() {
    let mut lab = Lab::new("af");
    lab.add_pod(0, "a1", POD_A1, "198.18.1.1");
    let local = [(POD_A0, "node-a"), (POD_A1, "node-a")];
    // ClientIP affinity (2 s) over least-connections, as the socket-path test: with a
    // connection held on the affine backend, least-connections alone would pick the other
    // one, so which backend a new connection gets tells whether the affinity held.
    web_with(
        &lab,
        &[("ebpf-proxy.io/lb-algorithm", "least-connections")],
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 2}}\n",
        &local,
    );
    lab.start_agent(0, &[]);
    let c = lab.client_path();
    let np = format!("{NODE_A}:30080");
    let first = hold(&c, &np);
    let other = if first.1 == "a0" { "a1" } else { "a0" };
    std::thread::sleep(Duration::from_millis(1600));
    // Affinity is shared by every frontend of the Service port: the LB IP too.
    let again = hold(&c, &format!("{LB_IP}:80"));
    assert_eq!(again.1, first.1, "affine within the timeout (LB IP)");
    std::thread::sleep(Duration::from_millis(1600));
    let third = hold(&c, &np);
    assert_eq!(third.1, first.1, "the timeout counts from the last use");
    std::thread::sleep(Duration::from_millis(2400));
    let fourth = hold(&c, &np);
    assert_eq!(
        fourth.1, other,
        "affinity expired: least-connections picks the idle backend"
    );
    let text = agent_json(&lab, 0, "affinity").to_string();
    assert!(
        text.contains(CLIENT),
        "affinity keyed by the external client's address: {text}"
    );
    drop((first, again, third, fourth));

    // Source hashing on the node port: one client address always gets the same backend.
    let n = lab.agents[0].syncs();
    web_with(
        &lab,
        &[("ebpf-proxy.io/lb-algorithm", "source-hash")],
        "",
        &local,
    );
    lab.agents[0].wait_sync_after(n);
    let names: std::collections::BTreeSet<String> =
        (0..12).map(|_| tcp_whoami(&c, &np, T).unwrap().0).collect();
    assert_eq!(
        names.len(),
        1,
        "source-hash: one backend per client: {names:?}"
    );

    // Round-robin on the node port: per-CPU cursors, so each backend gets its share within
    // one per CPU of an even split.
    let n = lab.agents[0].syncs();
    web_with(
        &lab,
        &[("ebpf-proxy.io/lb-algorithm", "round-robin")],
        "",
        &local,
    );
    lab.agents[0].wait_sync_after(n);
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    for _ in 0..30 {
        *seen.entry(tcp_whoami(&c, &np, T).unwrap().0).or_default() += 1;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        seen.len() == 2 && seen.values().all(|v| v.abs_diff(15) <= cpus),
        "round-robin over 30 connections: {seen:?}"
    );
}

/// A connected UDP socket in the client namespace (kept across exchanges: one flow).
fn udp_socket(client: &Path, to: &str) -> UdpSocket {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(client, move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.connect(to).unwrap();
        s.set_read_timeout(Some(SHORT)).unwrap();
        s
    })
    .unwrap()
}

/// One `whoami` exchange on `s`: the backend's name and the peer it saw, or None when no
/// answer came within [`SHORT`].
fn exchange(s: &UdpSocket) -> Option<(String, String)> {
    s.send(b"whoami").ok()?;
    let mut buf = [0u8; 512];
    let n = s.recv(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    let mut it = text.split_whitespace();
    Some((it.next()?.to_string(), it.next()?.to_string()))
}

fn mapped(ip: &str) -> [u8; 16] {
    let v4: std::net::Ipv4Addr = ip.parse().unwrap();
    proxy_common::v4_mapped(u32::from(v4).to_be())
}

#[test]
fn snat_bindings_survive_eviction_and_a_taken_port_is_never_shared() {
    use aya::maps::{HashMap as BpfHashMap, Map, MapData};
    use proxy_common::nat::{CT_F_REPLY, CT_F_SNAT, CtEntry, CtKey};
    let mut lab = Lab::new("ev");
    // One backend on node-b: every flow through node-a is source-NATed.
    web(&lab, "", &[(POD_B0, "node-b")]);
    // A small table (1024 flows: 2048 entries; one SNAT flow takes 3) so that churn evicts.
    lab.start_agent(
        0,
        &["--conntrack-min", "1024", "--conntrack-max-per-core", "0"],
    );
    let pin = lab.agents[0].pin.clone();
    let ct = || -> BpfHashMap<MapData, CtKey, CtEntry> {
        let data = MapData::from_pin(pin.join(proxy_common::nat::CONNTRACK)).unwrap();
        BpfHashMap::try_from(Map::LruHashMap(data)).unwrap()
    };
    let info = MapData::from_pin(pin.join(proxy_common::nat::CONNTRACK))
        .unwrap()
        .info()
        .unwrap();
    assert_eq!(
        info.max_entries(),
        2048,
        "--conntrack-min 1024 flows: 2048 entries"
    );
    let c = lab.client_path();
    let s = udp_socket(&c, &format!("{NODE_A}:30053"));
    let (name, peer) = exchange(&s).expect("first exchange");
    assert_eq!(name, "b0");
    let port: u16 = peer.parse::<SocketAddr>().unwrap().port();
    assert_eq!(ip_of(&peer), NODE_A, "source-NATed to the node address");
    let reply_key = CtKey {
        saddr: mapped(POD_B0),
        daddr: mapped(NODE_A),
        sport: 5353u16.to_be_bytes(),
        dport: port.to_be_bytes(),
        proto: 17,
        _pad: [0; 3],
    };
    // The reply entry evicted (as LRU eviction would): the flow's next packet writes it
    // again, on the same port, and the exchange works.
    ct().remove(&reply_key).unwrap();
    let (_, again) = exchange(&s).expect("exchange after the reply entry was evicted");
    assert_eq!(again, peer, "same SNAT port kept");
    assert!(ct().get(&reply_key, 0).is_ok(), "reply entry written again");
    // Evicted, and the port taken meanwhile by another live flow (a stand-in entry leading
    // to another client): the flow's packet is dropped, not mixed into the other flow, and
    // counted; its next packet is a new flow on another port.
    ct().remove(&reply_key).unwrap();
    let other = CtEntry {
        saddr: mapped(NODE_A),
        daddr: mapped("198.18.100.200"),
        sport: 30053u16.to_be_bytes(),
        dport: 9999u16.to_be_bytes(),
        flags: CT_F_REPLY | CT_F_SNAT,
        _pad: 0,
        service_id: 0,
        peer_tick: 0,
        last_seen_ns: tc::monotonic_ns(),
    };
    ct().insert(reply_key, other, 0).unwrap();
    assert!(
        exchange(&s).is_none(),
        "a packet of a flow that lost its port is dropped"
    );
    assert_eq!(tc::counters(&pin).unwrap()["tc_snat_binding_lost"], 1);
    let (_, fresh) = exchange(&s).expect("the next packet starts a new flow");
    assert_ne!(fresh, peer, "a new SNAT port, not the taken one");
    assert_eq!(
        ct().get(&reply_key, 0).unwrap().daddr,
        mapped("198.18.100.200"),
        "the other flow's binding is untouched"
    );
    // Churn well beyond the table's size with a long-lived flow in the middle: the table
    // stays bounded, every short flow is answered, and the long-lived flow keeps working
    // (the LRU keeps what is in use).
    let long = udp_socket(&c, &format!("{NODE_A}:30053"));
    let (_, long_peer) = exchange(&long).unwrap();
    let to: SocketAddr = format!("{NODE_A}:30053").parse().unwrap();
    let (answered, long_ok, port_changes) = in_netns(&c, move || {
        let start = Instant::now();
        let (mut answered, mut long_ok, mut port_changes) = (0, 0, 0);
        for i in 0..1000 {
            if start.elapsed() > Duration::from_secs(40) {
                break;
            }
            let u = UdpSocket::bind("0.0.0.0:0").unwrap();
            u.set_read_timeout(Some(T)).unwrap();
            u.send_to(b"whoami", to).unwrap();
            let mut buf = [0u8; 128];
            if u.recv_from(&mut buf)
                .is_ok_and(|(n, _)| buf[..n].starts_with(b"b0 "))
            {
                answered += 1;
            }
            if i % 50 == 0
                && let Some((name, p)) = exchange(&long)
            {
                long_ok += (name == "b0") as usize;
                port_changes += (p != long_peer) as usize;
            }
        }
        (answered, long_ok, port_changes)
    })
    .unwrap();
    assert_eq!(answered, 1000, "every short flow answered");
    assert_eq!(long_ok, 20, "the long-lived flow answered every time");
    assert_eq!(port_changes, 0, "the long-lived flow kept its SNAT port");
    let entries = tc::conntrack_entries(&pin).unwrap();
    assert!(entries <= 2048, "{entries} entries in a 2048-entry table");
    let counters = tc::counters(&pin).unwrap();
    assert_eq!(counters["tc_conntrack_full"], 0, "{counters:?}");
}
