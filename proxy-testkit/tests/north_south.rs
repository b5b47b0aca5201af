//! The privileged north-south test that stays code: SNAT bindings through conntrack
//! entries evicted and forged in place, with keys computed from the flow's SNAT port. The
//! other north-south cases are scenario files (`tests/scenarios/north-south/`, run by
//! `tests/scenarios.rs`); the lab is `nslab`'s.

mod common;
mod nslab;

use std::{
    net::{SocketAddr, UdpSocket},
    path::Path,
    time::{Duration, Instant},
};

use common::{DNS, Endpoint, HTTP, Port, Web};
use nslab::{EXTERNAL_IP, LB_IP, Lab, NODE_A, POD_B0, SHORT, T, ip_of};
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
    let w = Web::new("198.19.0.30")
        .ports(&LAB_PORTS)
        .spec(&format!(
            "  type: LoadBalancer\n  externalIPs: [{EXTERNAL_IP}]\n{spec_extra}"
        ))
        .status(&format!(
            "status:\n  loadBalancer:\n    ingress: [{{ip: {LB_IP}}}]\n"
        ))
        .endpoints(on_nodes(endpoints));
    lab.write("web.yaml", &w.yaml());
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
