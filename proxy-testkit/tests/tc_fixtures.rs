//! Packet-by-packet fixtures of the tc programs (after Katran's: description, maps, input
//! packet, expected verdict, expected output packet), run through `BPF_PROG_TEST_RUN` on the
//! real object without namespaces of a lab, links or interfaces, plus a property test with
//! random and mutated packets. Needs root (BPF); runs in milliseconds.
//!
//! The fixtures whose packets are written out (DNAT and SNAT with their replies, policies,
//! rejects, a bypassed pod's path, untracked mid-flow packets, packet shapes, malformed
//! input) are files in `tests/scenarios/tc/`, run by `tests/scenarios.rs`; here stay those
//! whose expected packets or checks are computed: consistent hashing across nodes, ICMP
//! errors quoting translated packets, random packets, the IPVS schedulers, XDP forwarding
//! and direct server return.
//!
//! The maps are seeded from the Kubernetes objects in [`OBJECTS`] by
//! `tcfix::Harness::seed`, the agent's own model and reconciler. Expected outputs are built from
//! scratch (checksums computed in userspace), so comparing bytes also checks the programs'
//! incremental checksum updates.

mod sched;
mod tcfix;

use tcfix::{
    ACK, DROP, FIN, Harness, ICMP, ICMPV6, PASS, Packet, REDIRECT, RST, SYN, TCP, TcOptions, UDP,
    XDP, XDP_PASS, XDP_REDIRECT, decode, diff, encapsulated, ether, in_private_netns, requote,
    show, sock, step, verify,
};

/// Node `node-1` (this node) and `node-2` with Services of one endpoint per family, so every
/// choice is deterministic (described in the file): the objects the packet fixtures of
/// `tests/scenarios/tc/` share.
const OBJECTS: &str = include_str!("scenarios/tc/objects.yaml");

const INGRESS: &str = "tc_ingress";
const EGRESS: &str = "tc_egress";

/// The addresses of one family in [`OBJECTS`].
#[derive(Clone, Copy)]
struct Fam {
    node: &'static str,
    client: &'static str,
    local: &'static str,
    remote: &'static str,
    external: &'static str,
    lb: &'static str,
    /// A router on the way (source of ICMP errors).
    router: &'static str,
}

const V4: Fam = Fam {
    node: "192.0.2.50",
    client: "198.51.100.7",
    local: "10.0.1.5",
    remote: "10.0.2.7",
    external: "203.0.113.10",
    lb: "203.0.113.20",
    router: "192.0.2.1",
};

const V6: Fam = Fam {
    node: "fd00:100::50",
    client: "2001:db8:c::7",
    local: "fd00:1::5",
    remote: "fd00:2::7",
    external: "2001:db8:e::10",
    lb: "2001:db8:f::20",
    router: "fd00:100::1",
};

/// A harness seeded with [`OBJECTS`] on node-1.
fn seeded(name: &str) -> Harness {
    let h = Harness::new(name);
    h.seed(OBJECTS, "node-1", &TcOptions::default());
    h
}

/// Services whose selection is consistent, added to [`OBJECTS`]: `hashed` (maglev: client
/// address and port) and `sticky` (source-hash: client address), three endpoints on node-1
/// each, reached on an external IP (the same frontend on every node, as behind an ECMP
/// router) and a node port; and node-2, the other node, with its own address.
const CONSISTENT: &str = r#"
---
apiVersion: v1
kind: Node
metadata: {name: node-2}
status: {addresses: [{type: InternalIP, address: 192.0.2.51}]}
---
apiVersion: v1
kind: Service
metadata: {name: hashed, namespace: default, annotations: {ebpf-proxy.io/lb-algorithm: maglev}}
spec:
  type: NodePort
  clusterIP: 10.96.0.20
  externalIPs: [203.0.113.40]
  ports: [{port: 80, nodePort: 30090}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: hashed, namespace: default, labels: {kubernetes.io/service-name: hashed}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.1.20], nodeName: node-1}, {addresses: [10.0.1.21], nodeName: node-1}, {addresses: [10.0.1.22], nodeName: node-1}]
---
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: default, annotations: {ebpf-proxy.io/lb-algorithm: source-hash}}
spec:
  type: NodePort
  clusterIP: 10.96.0.21
  externalIPs: [203.0.113.41]
  ports: [{port: 80, nodePort: 30091}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky, namespace: default, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.1.30], nodeName: node-1}, {addresses: [10.0.1.31], nodeName: node-1}, {addresses: [10.0.1.32], nodeName: node-1}]
"#;

/// The destination an ingress program rewrote a frame to.
fn dst_of(frame: &[u8]) -> std::net::SocketAddr {
    let d = tcfix::decode(frame).expect("an IP frame");
    let port = u16::from_be_bytes([frame[d.l4 + 2], frame[d.l4 + 3]]);
    std::net::SocketAddr::new(d.dst, port)
}

#[test]
fn consistent_selection_picks_the_same_backend_for_an_untracked_mid_flow_packet() {
    in_private_netns(|| {
        let objects = format!("{OBJECTS}{CONSISTENT}");
        let h = Harness::new("consistent1");
        h.seed(&objects, "node-1", &TcOptions::default());
        let other = Harness::new("consistent2");
        other.seed(&objects, "node-2", &TcOptions::default());
        let client = "198.51.100.7";
        for (svc, external, node_port) in [
            ("maglev", "203.0.113.40", 30090u16),
            ("source-hash", "203.0.113.41", 30091),
        ] {
            let mut backends = std::collections::BTreeSet::new();
            for i in 0..12u16 {
                // Twelve clients (maglev hashes the port too; source-hash needs addresses).
                let from = if svc == "maglev" {
                    sock(client, 50000 + i)
                } else {
                    sock(&format!("198.51.100.{}", 20 + i), 50000)
                };
                for (fe, entry) in [
                    (sock(external, 80), "external IP"),
                    (sock("192.0.2.50", node_port), "node port"),
                ] {
                    let syn = Packet::tcp(&from, &fe, SYN);
                    let (v, out) = h.run(INGRESS, &syn.frame());
                    assert_eq!(v, PASS, "{svc}: SYN to the {entry}");
                    let backend = dst_of(&out);
                    assert_ne!(backend, syn.dst, "{svc}: the SYN was translated");
                    backends.insert(backend);
                    let translated = |p: &Packet| Packet {
                        dst: backend,
                        ..p.clone()
                    };
                    // The flow's entries are lost (LRU eviction): its next packet picks again
                    // and gets the same backend.
                    h.forget_flows();
                    let ack = Packet::tcp(&from, &fe, ACK);
                    step(
                        &h,
                        &format!("{svc}: mid-flow ACK to the {entry} after the entries were lost"),
                        INGRESS,
                        &ack.frame(),
                        PASS,
                        Some(&translated(&ack).frame()),
                        Some("tc_untracked_reselected"),
                    );
                    // ... and is tracked again.
                    step(
                        &h,
                        &format!("{svc}: next packet to the {entry}"),
                        INGRESS,
                        &ack.frame(),
                        PASS,
                        Some(&translated(&ack).frame()),
                        Some("tc_translated"),
                    );
                    h.forget_flows();
                }
                // Another node, which never saw the flow, gets its packets to the same
                // external IP (a router moved it there): the same backend.
                let fe = sock(external, 80);
                let syn = Packet::tcp(&from, &fe, SYN);
                let (_, out) = h.run(INGRESS, &syn.frame());
                let backend = dst_of(&out);
                h.forget_flows();
                let ack = Packet::tcp(&from, &fe, ACK);
                step(
                    &other,
                    &format!("{svc}: mid-flow ACK on another node"),
                    INGRESS,
                    &ack.frame(),
                    PASS,
                    Some(
                        &Packet {
                            dst: backend,
                            ..ack.clone()
                        }
                        .frame(),
                    ),
                    Some("tc_untracked_reselected"),
                );
                other.forget_flows();
            }
            assert!(
                backends.len() > 1,
                "{svc}: the clients should spread over the backends: {backends:?}"
            );
        }
        assert_eq!(h.counters()["tc_untracked_passed"], 0);
        assert_eq!(other.counters()["tc_untracked_passed"], 0);
    });
}

/// ICMP errors about translated flows, for one family: `big` is "fragmentation needed" or
/// "packet too big", `unreach` port unreachable, `ttl` time exceeded (type, code).
fn icmp_errors(h: &Harness, f: Fam, big: (u8, u8), unreach: (u8, u8), ttl: (u8, u8)) {
    icmp_errors_of_a_local_flow(h, f, unreach, ttl);
    icmp_errors_of_a_snat_flow(h, f, big);
}

/// Errors about a flow to the local backend (no SNAT), leaving at egress.
fn icmp_errors_of_a_local_flow(h: &Harness, f: Fam, unreach: (u8, u8), ttl: (u8, u8)) {
    // A flow to the local backend (no SNAT).
    let client = sock(f.client, 45000);
    let front = sock(f.node, 30053);
    let dgram = Packet::udp(&client, &front);
    let dnat = Packet {
        dst: sock(f.local, 5353).parse().unwrap(),
        ..dgram.clone()
    };
    step(
        h,
        "UDP flow for the ICMP errors",
        INGRESS,
        &dgram.frame(),
        PASS,
        Some(&dnat.frame()),
        Some("tc_new_flow"),
    );
    // The backend answers port unreachable, quoting the DNATed datagram: at egress the
    // outer source (the backend) and the quoted destination become the frontend.
    let err = Packet::icmp_error(f.local, f.client, unreach.0, unreach.1, &dnat.ip(), 64);
    let want = Packet::icmp_error(
        f.node,
        f.client,
        unreach.0,
        unreach.1,
        &requote(&dgram, &dnat.ip()),
        64,
    );
    step(
        h,
        "port unreachable from the backend",
        EGRESS,
        &err.frame(),
        PASS,
        Some(&want.frame()),
        Some("tc_icmp_translated"),
    );
    // A router between the node and the backend quotes the DNATed packet: only the quote
    // changes (the outer source is the router).
    let err = Packet::icmp_error(f.router, f.client, ttl.0, ttl.1, &dnat.ip(), 48);
    let want = Packet::icmp_error(
        f.router,
        f.client,
        ttl.0,
        ttl.1,
        &requote(&dgram, &dnat.ip()),
        48,
    );
    step(
        h,
        "time exceeded from a router",
        EGRESS,
        &err.frame(),
        PASS,
        Some(&want.frame()),
        Some("tc_icmp_translated"),
    );
}

/// An error about a source-NATed flow, arriving at ingress; other ICMP left alone.
fn icmp_errors_of_a_snat_flow(h: &Harness, f: Fam, big: (u8, u8)) {
    // A source-NATed flow: a router on the backend's side reports "too big" to the node
    // address, quoting the SNATed packet; at ingress it becomes an error from the frontend
    // to the client quoting the client's own packet.
    let client = sock(f.client, 45001);
    let syn = Packet::tcp(&client, &sock(f.node, 30081), SYN);
    let backend = sock(f.remote, 8080);
    let dnat = Packet {
        dst: backend.parse().unwrap(),
        ..syn.clone()
    };
    step(
        h,
        "TCP flow to a remote backend",
        INGRESS,
        &syn.frame(),
        PASS,
        Some(&dnat.frame()),
        Some("tc_snat"),
    );
    let port = h
        .snat_port(client.parse().unwrap(), backend.parse().unwrap(), TCP)
        .expect("SNAT stage");
    let snat = Packet {
        src: sock(f.node, port).parse().unwrap(),
        ..dnat.clone()
    };
    step(
        h,
        "SNAT at egress",
        EGRESS,
        &snat_input(&dnat),
        PASS,
        Some(&snat.frame()),
        Some("tc_translated"),
    );
    let mut err = Packet::icmp_error(f.router, f.node, big.0, big.1, &snat.ip(), 68);
    err.icmp_rest = [0, 0, 0x05, 0x00]; // MTU 1280
    let mut want = Packet::icmp_error(
        f.router,
        f.client,
        big.0,
        big.1,
        &requote(&syn, &snat.ip()),
        68,
    );
    want.icmp_rest = err.icmp_rest;
    step(
        h,
        "too big from a router on the backend's side",
        INGRESS,
        &err.frame(),
        PASS,
        Some(&want.frame()),
        Some("tc_icmp_translated"),
    );
    // Other ICMP (echo) is never touched.
    let mut echo = Packet::icmp_error(
        f.client,
        f.node,
        if f.node.contains(':') { 128 } else { 8 },
        0,
        &[],
        0,
    );
    echo.payload = b"ping".to_vec();
    step(h, "echo request", INGRESS, &echo.frame(), PASS, None, None);
}

/// The frame of an already DNATed packet as it reaches egress.
fn snat_input(dnat: &Packet) -> Vec<u8> {
    dnat.frame()
}

#[test]
fn ipv4_icmp_errors_quoting_translated_packets() {
    in_private_netns(|| icmp_errors(&seeded("icmp4"), V4, (3, 4), (3, 3), (11, 0)));
}

#[test]
fn ipv6_icmp_errors_quoting_translated_packets() {
    in_private_netns(|| icmp_errors(&seeded("icmp6"), V6, (2, 0), (1, 4), (3, 0)));
}

// ---------------------------------------------------------------------------------------
// property test
// ---------------------------------------------------------------------------------------

/// splitmix64: a small deterministic generator (the seed is printed on failure).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
}

/// A random well-formed packet about the addresses of [`OBJECTS`]: mostly towards its
/// frontends (with their protocols) and from its backends, so the translating and dropping
/// paths are reached, plus random tuples and ICMP errors quoting random packets.
fn random_packet(r: &mut Rng) -> Packet {
    let v6 = r.below(2) == 1;
    let f = if v6 { V6 } else { V4 };
    let peers = [
        f.node, f.client, f.local, f.remote, f.external, f.lb, f.router,
    ];
    let ports = [
        30080u16, 30053, 30081, 30054, 30082, 30084, 30085, 30086, 30087, 30088, 80, 53, 8080,
        5353, 40000, 45000,
    ];
    let frontends = [
        (TCP, f.node, 30080u16),
        (UDP, f.node, 30053),
        (TCP, f.node, 30081),
        (UDP, f.node, 30054),
        (TCP, f.node, 30082),
        (TCP, f.node, 30085),
        (UDP, f.node, 30087),
        (TCP, f.node, 30086),
        (TCP, f.external, 80),
        (UDP, f.external, 53),
        (TCP, f.lb, 80),
        (UDP, f.lb, 53),
        (TCP, "203.0.113.30", 80),
    ];
    let flags = [SYN, ACK, SYN | ACK, FIN | ACK, RST, 0];
    let (proto, src, dst) = match r.below(6) {
        0..=2 => {
            let (proto, addr, port) = r.pick(&frontends);
            let addr = if v6 && !addr.contains(':') {
                f.lb
            } else {
                addr
            };
            let client = if !v6 && r.below(8) == 0 {
                "192.0.2.99"
            } else {
                f.client
            };
            let cport = 40000 + r.below(64) as u16;
            (proto, sock(client, cport), sock(addr, port))
        }
        3 => {
            let proto = r.pick(&[TCP, UDP]);
            let bport = if proto == TCP { 8080 } else { 5353 };
            let to = r.pick(&[f.client, f.node]);
            let from = r.pick(&[f.local, f.remote]);
            let port = 32768 + r.below(64) as u16;
            (proto, sock(from, bport), sock(to, port))
        }
        4 => {
            let proto = r.pick(&[TCP, UDP]);
            let (a, pa, b, pb) = (
                r.pick(&peers),
                r.pick(&ports),
                r.pick(&peers),
                r.pick(&ports),
            );
            (proto, sock(a, pa), sock(b, pb))
        }
        _ => (ICMP, String::new(), String::new()),
    };
    let mut p = match proto {
        TCP => {
            let fl = r.pick(&flags);
            Packet::tcp(&src, &dst, fl)
        }
        UDP => Packet::udp(&src, &dst),
        _ => {
            // An ICMP error quoting a random TCP/UDP packet of the family.
            let (a, pa, b, pb) = (
                r.pick(&peers),
                r.pick(&ports),
                r.pick(&peers),
                r.pick(&ports),
            );
            let q = Packet::udp(&sock(a, pa), &sock(b, pb));
            let (ty, code) = if v6 {
                r.pick(&[(1, 4), (2, 0), (3, 0), (128, 0)])
            } else {
                r.pick(&[(3, 3), (3, 4), (11, 0), (8, 0)])
            };
            let (from, to) = (r.pick(&peers), r.pick(&peers));
            let len = 28 + r.below(40);
            Packet::icmp_error(from, to, ty, code, &q.ip(), len)
        }
    };
    p.payload = (0..r.below(64)).map(|_| r.next() as u8).collect();
    if !v6 && r.below(4) == 0 {
        p.ip_options = vec![1; 4 * (1 + r.below(3))];
    }
    if v6 && r.below(4) == 0 {
        p.ext = vec![(r.pick(&[0u8, 60]), vec![1, 4, 0, 0, 0, 0])];
    }
    if !v6 && p.proto == UDP && r.below(4) == 0 {
        p.udp_no_csum = true;
    }
    p
}

#[test]
fn random_and_mutated_packets_always_get_a_verdict_and_rewrites_keep_checksums() {
    in_private_netns(|| {
        let h = seeded("property");
        let seed = 0x5eed_0015_u64;
        let mut r = Rng(seed);
        let (mut translated, mut dropped) = (0, 0);
        for i in 0..4000 {
            let p = random_packet(&mut r);
            let valid = p.frame();
            // Half as built (valid checksums), half mutated: bytes flipped, then maybe
            // truncated or extended.
            let input = if i % 2 == 0 {
                valid
            } else {
                let mut f = valid;
                for _ in 0..1 + r.below(4) {
                    let at = 12 + r.below(f.len() - 12);
                    f[at] ^= 1 << r.below(8);
                }
                match r.below(4) {
                    // At least one byte after the Ethernet header (the kernel runs nothing shorter).
                    0 => f.truncate(15 + r.below(f.len() - 15)),
                    1 => f.extend((0..r.below(16)).map(|_| r.next() as u8)),
                    _ => {}
                }
                f
            };
            if !tcfix::runnable(&input) {
                continue;
            }
            for prog in [INGRESS, EGRESS] {
                let (v, out) = h.run(prog, &input);
                assert!(
                    matches!(v, PASS | DROP | REDIRECT),
                    "seed {seed:#x} packet {i}: {prog} returned {v} for {}",
                    show(&input)
                );
                if v == DROP {
                    dropped += 1;
                }
                if out != input {
                    translated += 1;
                    // A reject answers with an ICMP error of its own length.
                    let rejected = v == REDIRECT
                        && decode(&out).is_some_and(|d| matches!(d.proto, ICMP | ICMPV6))
                        && decode(&input).is_some_and(|d| matches!(d.proto, TCP | UDP));
                    if !rejected {
                        assert_eq!(
                            out.len(),
                            input.len(),
                            "seed {seed:#x} packet {i}: length changed"
                        );
                    }
                    if verify(&input).is_ok() {
                        verify(&out).unwrap_or_else(|e| {
                            panic!(
                                "seed {seed:#x} packet {i} ({prog}): {e} wrong after the rewrite of {} into {}",
                                show(&input),
                                show(&out)
                            )
                        });
                    }
                }
            }
        }
        // The generator reaches the translating paths and the drops, not only passes.
        assert!(translated > 200, "only {translated} packets were rewritten");
        assert!(dropped > 10, "only {dropped} packets were dropped");
    });
}

/// Node `node-1` with NodePort Services whose endpoints are all on this node (no SNAT), one
/// per IPVS scheduler that has a data path of its own; each has endpoints of its own, since
/// the connection counts are per backend:
/// - `wlc` (30090) and `nq` (30091): weights 1, 3 and 0 by address;
/// - `dh` (30092): three endpoints, eight external IPs.
const SCHEDULERS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1}
status: {addresses: [{type: InternalIP, address: 192.0.2.50}]}
---
apiVersion: v1
kind: Service
metadata:
  name: wlc
  namespace: default
  annotations: {ebpf-proxy.io/lb-algorithm: wlc, ebpf-proxy.io/weights: '{"10.0.1.21": 1, "10.0.1.22": 3, "10.0.1.23": 0}'}
spec:
  type: NodePort
  clusterIP: 10.96.0.90
  ports: [{port: 80, nodePort: 30090}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: wlc, namespace: default, labels: {kubernetes.io/service-name: wlc}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.1.21], nodeName: node-1}, {addresses: [10.0.1.22], nodeName: node-1}, {addresses: [10.0.1.23], nodeName: node-1}]
---
apiVersion: v1
kind: Service
metadata:
  name: nq
  namespace: default
  annotations: {ebpf-proxy.io/lb-algorithm: nq, ebpf-proxy.io/weights: '{"10.0.1.31": 1, "10.0.1.32": 3, "10.0.1.33": 0}'}
spec:
  type: NodePort
  clusterIP: 10.96.0.91
  ports: [{port: 80, nodePort: 30091}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: nq, namespace: default, labels: {kubernetes.io/service-name: nq}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.1.31], nodeName: node-1}, {addresses: [10.0.1.32], nodeName: node-1}, {addresses: [10.0.1.33], nodeName: node-1}]
---
apiVersion: v1
kind: Service
metadata:
  name: dh
  namespace: default
  annotations: {ebpf-proxy.io/lb-algorithm: dh}
spec:
  type: NodePort
  clusterIP: 10.96.0.92
  externalIPs: [203.0.113.40, 203.0.113.41, 203.0.113.42, 203.0.113.43, 203.0.113.44, 203.0.113.45, 203.0.113.46, 203.0.113.47]
  ports: [{port: 80, nodePort: 30092}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dh, namespace: default, labels: {kubernetes.io/service-name: dh}}
addressType: IPv4
ports: [{port: 8080}]
endpoints: [{addresses: [10.0.1.41], nodeName: node-1}, {addresses: [10.0.1.42], nodeName: node-1}, {addresses: [10.0.1.43], nodeName: node-1}]
"#;

/// A TCP packet with `flags` from `client` to `frontend` through `tc_ingress`: checks that
/// it passes DNATed to port 8080 of one of the Service's endpoints with valid checksums and
/// nothing else changed; returns that endpoint's address.
fn dnat_to(h: &Harness, client: &str, frontend: &str, flags: u8) -> String {
    let p = Packet::tcp(client, frontend, flags);
    let (v, out) = h.run(INGRESS, &p.frame());
    assert_eq!(v, PASS, "{client} -> {frontend}: {}", show(&out));
    let d = tcfix::decode(&out).expect("an IP frame");
    let want = Packet {
        dst: std::net::SocketAddr::new(d.dst, 8080),
        ..p
    };
    assert!(
        out == want.frame(),
        "{client} -> {frontend}: {}",
        diff(&out, &want.frame())
    );
    verify(&out).unwrap_or_else(|e| panic!("{e} wrong in {}", show(&out)));
    d.dst.to_string()
}

/// Sum of the least-load connection counts of every backend (`LC_COUNTS`).
fn open_flows(h: &Harness) -> u32 {
    let m: aya::maps::HashMap<aya::maps::MapData, u32, u32> = h.map(proxy_common::LC_COUNTS);
    m.iter().filter_map(|r| r.ok()).map(|(_, c)| c).sum()
}

#[test]
fn ipvs_least_load_schedulers_count_tc_flows_and_follow_weights() {
    in_private_netns(|| {
        let h = Harness::new("sched-lc");
        h.seed(SCHEDULERS, "node-1", &TcOptions::default());
        let client = |port: u16| sock("198.51.100.7", port);
        // wlc, weights 1:3:0: eight flows open together split 2 and 6, every choice a
        // least-loaded backend at its moment, never the weight-0 endpoint.
        let w = [("10.0.1.21", 1), ("10.0.1.22", 3)];
        let seq: Vec<String> = (0..8)
            .map(|i| dnat_to(&h, &client(50000 + i), "192.0.2.50:30090", SYN))
            .collect();
        println!("wlc over tc: {seq:?}");
        sched::assert_least_cost(&seq, &w, sched::wlc_cost);
        assert_eq!(
            sched::tally(&seq),
            sched::counts(&[("10.0.1.21", 2), ("10.0.1.22", 6)])
        );
        assert_eq!(open_flows(&h), 8);
        // The client resets every flow: each count is given back ...
        for i in 0..8 {
            dnat_to(&h, &client(50000 + i), "192.0.2.50:30090", RST | ACK);
        }
        assert_eq!(open_flows(&h), 0);
        // ... so the next eight split the same way.
        let seq: Vec<String> = (0..8)
            .map(|i| dnat_to(&h, &client(50100 + i), "192.0.2.50:30090", SYN))
            .collect();
        sched::assert_least_cost(&seq, &w, sched::wlc_cost);
        assert_eq!(
            sched::tally(&seq),
            sched::counts(&[("10.0.1.21", 2), ("10.0.1.22", 6)])
        );

        // nq, weights 1:3:0: the two idle weighted endpoints first, one flow each, then sed.
        let w = [("10.0.1.31", 1), ("10.0.1.32", 3)];
        let seq: Vec<String> = (0..6)
            .map(|i| dnat_to(&h, &client(51000 + i), "192.0.2.50:30091", SYN))
            .collect();
        println!("nq over tc: {seq:?}");
        let mut first = seq[..2].to_vec();
        first.sort();
        assert_eq!(first, ["10.0.1.31", "10.0.1.32"], "{seq:?}");
        sched::assert_least_cost(&seq, &w, sched::nq_cost);
        assert_eq!(
            sched::tally(&seq),
            sched::counts(&[("10.0.1.31", 1), ("10.0.1.32", 5)])
        );
    });
}

#[test]
fn ipvs_destination_hash_maps_each_frontend_address_to_one_backend() {
    in_private_netns(|| {
        let h = Harness::new("sched-dh");
        h.seed(SCHEDULERS, "node-1", &TcOptions::default());
        let frontends: Vec<String> = std::iter::once("192.0.2.50:30092".to_string())
            .chain((40..48).map(|i| format!("203.0.113.{i}:80")))
            .collect();
        let mut per_frontend = std::collections::BTreeMap::new();
        for (f, fe) in frontends.iter().enumerate() {
            // Ten clients (addresses and ports) to one frontend address: one backend.
            let reached: std::collections::BTreeSet<String> = (0..10u16)
                .map(|c| {
                    let client = sock(&format!("198.51.100.{}", 10 + c), 52000 + f as u16);
                    dnat_to(&h, &client, fe, SYN)
                })
                .collect();
            assert_eq!(reached.len(), 1, "{fe}: {reached:?}");
            per_frontend.insert(fe.clone(), reached.into_iter().next().unwrap());
        }
        println!("dh over tc: {per_frontend:?}");
        let used: std::collections::BTreeSet<&String> = per_frontend.values().collect();
        assert!(used.len() >= 2, "{per_frontend:?}");
        // dh counts nothing.
        assert_eq!(open_flows(&h), 0);
    });
}

// ---------------------------------------------------------------------------------------
// XDP
// ---------------------------------------------------------------------------------------

/// MAC address of the fixture's output interface `xf0` and of the two next hops behind it.
const XF0_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x50];
const BACKEND_HOP_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x22];
const CLIENT_HOP_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x11];

/// Routes for the XDP fixtures, in the fixture's private namespace: an interface `xf0`
/// (a veth, [`XF0_MAC`]; its peer `xf1` only gives it a carrier) on the node's network, the other node's pod network behind a
/// router with a known neighbour entry ([`BACKEND_HOP_MAC`]), the client's network behind
/// another ([`CLIENT_HOP_MAC`]), and a second client network (`far`) behind a router with no
/// neighbour entry. Forwarding on (the FIB lookup refuses otherwise).
struct Routes {
    far_client: &'static str,
}

fn ip(args: &str) {
    let st = std::process::Command::new("ip")
        .args(args.split_whitespace())
        .status()
        .expect("run ip");
    assert!(st.success(), "ip {args}");
}

fn xdp_routes(f: Fam) -> Routes {
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").expect("ip_forward");
    std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1").expect("ipv6 forwarding");
    ip("link add xf0 address 02:00:00:00:00:50 type veth peer name xf1");
    ip("link set lo up");
    ip("link set xf1 up");
    ip("link set xf0 up");
    if f.node == V4.node {
        ip("addr add 192.0.2.50/24 dev xf0");
        ip("route add 10.0.2.0/24 via 192.0.2.2 dev xf0");
        ip("route add 198.51.100.0/24 via 192.0.2.1 dev xf0");
        ip("route add 100.64.0.0/24 via 192.0.2.3 dev xf0");
        ip("neigh add 192.0.2.2 lladdr 02:00:00:00:00:22 dev xf0 nud permanent");
        ip("neigh add 192.0.2.1 lladdr 02:00:00:00:00:11 dev xf0 nud permanent");
        Routes {
            far_client: "100.64.0.7",
        }
    } else {
        ip("addr add fd00:100::50/64 dev xf0 nodad");
        ip("route add fd00:2::/64 via fd00:100::2 dev xf0");
        ip("route add 2001:db8:c::/48 via fd00:100::1 dev xf0");
        ip("route add 2001:db8:d::/48 via fd00:100::3 dev xf0");
        ip("neigh add fd00:100::2 lladdr 02:00:00:00:00:22 dev xf0 nud permanent");
        ip("neigh add fd00:100::1 lladdr 02:00:00:00:00:11 dev xf0 nud permanent");
        Routes {
            far_client: "2001:db8:d::7",
        }
    }
}

/// `p` as XDP sends it on: TTL (hop limit) one less, addressed to the next hop `dmac`
/// from `xf0`.
fn forwarded(p: &Packet, dmac: [u8; 6]) -> Vec<u8> {
    let mut f = Packet {
        ttl: p.ttl - 1,
        ..p.clone()
    }
    .frame();
    f[0..6].copy_from_slice(&dmac);
    f[6..12].copy_from_slice(&XF0_MAC);
    f
}

/// The XDP program on flows of one family: a flow to a remote backend translated both ways
/// at once and sent out with `XDP_REDIRECT` (the next hop is on `xf0`, not on the interface
/// the frame arrived on) in both directions; a flow to a local backend DNATed and handed to
/// the stack, where the tc program finds nothing more to do; a reply without a neighbour
/// entry and a packet whose TTL expires left untouched for the tc program; a flow started
/// by the tc programs continued by XDP (one conntrack); the next-hop cache.
fn xdp_flows(h: &Harness, f: Fam, r: &Routes) {
    xdp_remote_flow(h, f);
    xdp_local_flow(h, f);
    xdp_left_to_the_stack(h, f, r);
    xdp_continues_tc_flows(h, f);
    xdp_next_hop_cache(h, f);
}

/// A TCP flow to a remote backend, translated both ways and sent on by XDP alone.
fn xdp_remote_flow(h: &Harness, f: Fam) {
    let client = sock(f.client, 45000);
    let backend = sock(f.remote, 8080);
    let syn = Packet::tcp(&client, &sock(f.node, 30081), SYN);
    let before = h.counters();
    let (v, out) = h.run(XDP, &syn.frame());
    assert_eq!(v, XDP_REDIRECT, "SYN to a remote backend: {}", show(&out));
    let port = h
        .snat_port(client.parse().unwrap(), backend.parse().unwrap(), TCP)
        .expect("the SNAT stage of the flow");
    let want = Packet {
        src: sock(f.node, port).parse().unwrap(),
        dst: backend.parse().unwrap(),
        ..syn.clone()
    };
    assert!(
        out == forwarded(&want, BACKEND_HOP_MAC),
        "SYN to a remote backend: {} differs: {}",
        show(&out),
        diff(&out, &forwarded(&want, BACKEND_HOP_MAC))
    );
    verify(&out).expect("checksums of the forwarded SYN");
    let after = h.counters();
    for c in ["tc_new_flow", "tc_snat", "xdp_forwarded"] {
        assert_eq!(after[c], before[c] + 1, "counter {c}");
    }

    let synack = Packet::tcp(&backend, &sock(f.node, port), SYN | ACK);
    let want = Packet {
        src: sock(f.node, 30081).parse().unwrap(),
        dst: client.parse().unwrap(),
        ..synack.clone()
    };
    step(
        h,
        "the backend's SYN-ACK (reverse SNAT and DNAT, sent on)",
        XDP,
        &synack.frame(),
        XDP_REDIRECT,
        Some(&forwarded(&want, CLIENT_HOP_MAC)),
        Some("xdp_forwarded"),
    );
    let ack = Packet::tcp(&client, &sock(f.node, 30081), ACK);
    let want = Packet {
        src: sock(f.node, port).parse().unwrap(),
        dst: backend.parse().unwrap(),
        ..ack.clone()
    };
    step(
        h,
        "the client's ACK of the tracked flow",
        XDP,
        &ack.frame(),
        XDP_REDIRECT,
        Some(&forwarded(&want, BACKEND_HOP_MAC)),
        Some("xdp_forwarded"),
    );
}

/// A flow to a local backend: DNAT in XDP, then the stack.
fn xdp_local_flow(h: &Harness, f: Fam) {
    // A local backend: DNAT in XDP, then the stack; the tc program leaves it alone.
    let syn = Packet::tcp(&sock(f.client, 45001), &sock(f.node, 30080), SYN);
    let dnat = Packet {
        dst: sock(f.local, 8080).parse().unwrap(),
        ..syn.clone()
    };
    let out = step(
        h,
        "SYN to a local backend (DNAT, to the stack)",
        XDP,
        &syn.frame(),
        XDP_PASS,
        Some(&dnat.frame()),
        Some("tc_new_flow"),
    );
    step(
        h,
        "the DNATed SYN at tc ingress (not translated twice)",
        INGRESS,
        &out,
        PASS,
        None,
        None,
    );
    let ack = Packet::tcp(&sock(f.client, 45001), &sock(f.node, 30080), ACK);
    step(
        h,
        "a packet of a flow to a local backend (left to tc)",
        XDP,
        &ack.frame(),
        XDP_PASS,
        None,
        None,
    );
}

/// Packets XDP hands to the stack untouched: a reply without a neighbour entry for its next
/// hop (tc sends it), a TTL about to expire.
fn xdp_left_to_the_stack(h: &Harness, f: Fam, r: &Routes) {
    let backend = sock(f.remote, 8080);
    // No neighbour entry for the far client's router: its reply goes to tc untouched,
    // which sends it with bpf_redirect_neigh.
    let far = sock(r.far_client, 45002);
    let syn = Packet::tcp(&far, &sock(f.node, 30081), SYN);
    let (v, _) = h.run(XDP, &syn.frame());
    assert_eq!(v, XDP_REDIRECT, "SYN of the far client");
    let port = h
        .snat_port(far.parse().unwrap(), backend.parse().unwrap(), TCP)
        .expect("the SNAT stage of the far client's flow");
    let synack = Packet::tcp(&backend, &sock(f.node, port), SYN | ACK);
    step(
        h,
        "a reply towards a next hop without a neighbour entry",
        XDP,
        &synack.frame(),
        XDP_PASS,
        None,
        Some("xdp_to_stack"),
    );
    let want = Packet {
        src: sock(f.node, 30081).parse().unwrap(),
        dst: far.parse().unwrap(),
        ..synack.clone()
    };
    step(
        h,
        "the same reply at tc ingress",
        INGRESS,
        &synack.frame(),
        REDIRECT,
        Some(&want.frame()),
        Some("tc_translated"),
    );

    // A TTL about to expire: the stack answers it.
    let mut last = Packet::tcp(&sock(f.client, 45003), &sock(f.node, 30081), SYN);
    last.ttl = 1;
    step(h, "TTL 1", XDP, &last.frame(), XDP_PASS, None, None);
}

/// A TCP flow the tc programs started, continued in XDP (one conntrack); UDP to a remote
/// backend.
fn xdp_continues_tc_flows(h: &Harness, f: Fam) {
    let backend = sock(f.remote, 8080);
    // A flow the tc programs started, continued in XDP.
    let client = sock(f.client, 45004);
    let syn = Packet::tcp(&client, &sock(f.node, 30081), SYN);
    let (v, dnat) = h.run(INGRESS, &syn.frame());
    assert_eq!(v, PASS, "tc ingress: SYN");
    let (v, _) = h.run(EGRESS, &dnat);
    assert_eq!(v, PASS, "tc egress: SNAT stage");
    let port = h
        .snat_port(client.parse().unwrap(), backend.parse().unwrap(), TCP)
        .expect("the SNAT stage of the tc flow");
    let ack = Packet::tcp(&client, &sock(f.node, 30081), ACK);
    let want = Packet {
        src: sock(f.node, port).parse().unwrap(),
        dst: backend.parse().unwrap(),
        ..ack.clone()
    };
    step(
        h,
        "an ACK of a flow started by tc, in XDP",
        XDP,
        &ack.frame(),
        XDP_REDIRECT,
        Some(&forwarded(&want, BACKEND_HOP_MAC)),
        Some("xdp_forwarded"),
    );

    // UDP to a remote backend.
    let dgram = Packet::udp(&sock(f.client, 45005), &sock(f.node, 30054));
    let (v, out) = h.run(XDP, &dgram.frame());
    assert_eq!(v, XDP_REDIRECT, "UDP to a remote backend: {}", show(&out));
    verify(&out).expect("checksums of the forwarded datagram");
}

/// The router of the other node's pod network on `xf0` ([`xdp_routes`]).
fn backend_router(f: Fam) -> &'static str {
    if f.node == V4.node {
        "192.0.2.2"
    } else {
        "fd00:100::2"
    }
}

/// XDP's next-hop cache: a segment longer than any the cached next hop's MTU check passed is
/// looked up again (too big for the route: DNATed, to the stack, whose tcx egress applies
/// the SNAT stage and answers it), the next segment of the usual size is sent on; a changed
/// neighbour of the next hop is used once the cache's tick (about a second) is over.
fn xdp_next_hop_cache(h: &Harness, f: Fam) {
    let client = sock(f.client, 45006);
    let frontend = sock(f.node, 30081);
    let backend = sock(f.remote, 8080);
    let (v, out) = h.run(XDP, &Packet::tcp(&client, &frontend, SYN).frame());
    assert_eq!(v, XDP_REDIRECT, "SYN to a remote backend: {}", show(&out));
    let port = h
        .snat_port(client.parse().unwrap(), backend.parse().unwrap(), TCP)
        .expect("the SNAT stage of the flow");
    let ack = Packet::tcp(&client, &frontend, ACK);
    let sent = |p: &Packet, mac: [u8; 6]| {
        let want = Packet {
            src: sock(f.node, port).parse().unwrap(),
            dst: backend.parse().unwrap(),
            ..p.clone()
        };
        forwarded(&want, mac)
    };
    step(
        h,
        "an ACK (its next hop now cached)",
        XDP,
        &ack.frame(),
        XDP_REDIRECT,
        Some(&sent(&ack, BACKEND_HOP_MAC)),
        Some("xdp_forwarded"),
    );
    let big = Packet {
        payload: vec![0x61; 1600],
        ..ack.clone()
    };
    step(
        h,
        "a segment longer than xf0's 1500-byte MTU, after the cached next hop",
        XDP,
        &big.frame(),
        XDP_PASS,
        Some(
            &Packet {
                dst: backend.parse().unwrap(),
                ..big.clone()
            }
            .frame(),
        ),
        Some("xdp_to_stack"),
    );
    let data = Packet {
        payload: vec![0x62; 1000],
        ..ack.clone()
    };
    step(
        h,
        "a 1000-byte segment (within the MTU)",
        XDP,
        &data.frame(),
        XDP_REDIRECT,
        Some(&sent(&data, BACKEND_HOP_MAC)),
        Some("xdp_forwarded"),
    );
    const MOVED: [u8; 6] = [0x02, 0, 0, 0, 0, 0x23];
    let router = backend_router(f);
    ip(&format!(
        "neigh replace {router} lladdr 02:00:00:00:00:23 dev xf0 nud permanent"
    ));
    // Longer than a tick of the conntrack clock (2^30 ns) and its lag.
    std::thread::sleep(std::time::Duration::from_millis(1300));
    let changed = step(
        h,
        "a segment after the next hop's neighbour changed and a tick passed",
        XDP,
        &data.frame(),
        XDP_REDIRECT,
        Some(&sent(&data, MOVED)),
        Some("xdp_forwarded"),
    );
    assert_eq!(changed[0..6], MOVED, "the changed neighbour's address");
    ip(&format!(
        "neigh replace {router} lladdr 02:00:00:00:00:22 dev xf0 nud permanent"
    ));
}

#[test]
fn ipv4_xdp_forwards_remote_flows_and_leaves_the_rest_to_tc() {
    in_private_netns(|| {
        let r = xdp_routes(V4);
        xdp_flows(&seeded("xdp4"), V4, &r)
    });
}

#[test]
fn ipv6_xdp_forwards_remote_flows_and_leaves_the_rest_to_tc() {
    in_private_netns(|| {
        let r = xdp_routes(V6);
        xdp_flows(&seeded("xdp6"), V6, &r)
    });
}

// ---------------------------------------------------------------------------------------
// Direct server return
// ---------------------------------------------------------------------------------------

/// Node `node-1` of [`OBJECTS`] and two Services in `dsr` mode (the annotation):
/// - `dsr-out`: endpoints on node-2 only (this node is the entry node): node ports
///   30091/TCP, 30092/UDP, LB IPs 203.0.113.40 and 2001:db8:f::40;
/// - `dsr-in`: endpoints on node-1 (this node is the backend's node for another entry
///   node): node ports 30093/TCP, 30094/UDP, external IPs 203.0.113.41 and 2001:db8:e::41.
const DSR_OBJECTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1}
status: {addresses: [{type: InternalIP, address: 192.0.2.50}, {type: InternalIP, address: "fd00:100::50"}]}
---
apiVersion: v1
kind: Service
metadata: {name: dsr-out, namespace: default, annotations: {ebpf-proxy.io/north-south-mode: dsr}}
spec:
  type: LoadBalancer
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.0.40
  clusterIPs: [10.96.0.40, "fd00:96::40"]
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30091}, {name: dns, port: 53, protocol: UDP, nodePort: 30092}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.40}, {ip: "2001:db8:f::40"}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dsr-out-v4, namespace: default, labels: {kubernetes.io/service-name: dsr-out}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [10.0.2.7], nodeName: node-2}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dsr-out-v6, namespace: default, labels: {kubernetes.io/service-name: dsr-out}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: ["fd00:2::7"], nodeName: node-2}]
---
apiVersion: v1
kind: Service
metadata: {name: dsr-in, namespace: default, annotations: {ebpf-proxy.io/north-south-mode: dsr}}
spec:
  type: NodePort
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  clusterIP: 10.96.0.41
  clusterIPs: [10.96.0.41, "fd00:96::41"]
  externalIPs: [203.0.113.41, "2001:db8:e::41"]
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30093}, {name: dns, port: 53, protocol: UDP, nodePort: 30094}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dsr-in-v4, namespace: default, labels: {kubernetes.io/service-name: dsr-in}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [10.0.1.5], nodeName: node-1}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dsr-in-v6, namespace: default, labels: {kubernetes.io/service-name: dsr-in}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: ["fd00:1::5"], nodeName: node-1}]
"#;

/// Another node of the family (the entry node of the flows this node accepts).
fn other_node(f: Fam) -> &'static str {
    if f.node == V4.node {
        "192.0.2.60"
    } else {
        "fd00:100::60"
    }
}

/// An Ethernet frame from `xf0` to the next hop `dmac` carrying `ip`.
fn sent_on(ip: &[u8], v6: bool, dmac: [u8; 6]) -> Vec<u8> {
    let mut f = ether(ip, v6);
    f[0..6].copy_from_slice(&dmac);
    f[6..12].copy_from_slice(&XF0_MAC);
    f
}

/// A TCP MSS option.
fn mss(v: u16) -> Vec<u8> {
    let b = v.to_be_bytes();
    vec![2, 4, b[0], b[1]]
}

/// Both ends of direct server return for one family, in this order (each part finds the
/// conntrack the earlier ones left).
fn dsr_flows(h: &Harness, f: Fam) {
    dsr_entry_node(h, f);
    dsr_too_big(h, f);
    dsr_backend_node(h, f);
    dsr_after_close(h, f);
}

/// The entry node: new flows and later packets to a remote backend leave encapsulated, from
/// tc or after XDP started the flow.
fn dsr_entry_node(h: &Harness, f: Fam) {
    let v6 = f.node.contains(':');
    let lb = if v6 { "2001:db8:f::40" } else { "203.0.113.40" };

    // Entry node: a new flow to a remote backend goes out encapsulated, untranslated
    // inside, towards the backend's next hop; so does every later packet of it.
    let client = sock(f.client, 46000);
    for (what, p) in [
        (
            "SYN to the node port",
            Packet::tcp(&client, &sock(f.node, 30091), SYN),
        ),
        (
            "the client's ACK",
            Packet::tcp(&client, &sock(f.node, 30091), ACK),
        ),
        (
            "UDP to the LB IP",
            Packet::udp(&sock(f.client, 46001), &sock(lb, 53)),
        ),
    ] {
        let want = sent_on(
            &encapsulated(&p.ip(), f.node, f.remote),
            v6,
            BACKEND_HOP_MAC,
        );
        step(
            h,
            what,
            INGRESS,
            &p.frame(),
            REDIRECT,
            Some(&want),
            Some("tc_dsr_encapsulated"),
        );
    }
    let ct = h.conntrack();
    let entries: Vec<_> = ct
        .iter()
        .filter(|(k, _)| k.sport == 46000u16.to_be_bytes())
        .collect();
    assert_eq!(entries.len(), 1, "one entry, no reply entry: {entries:?}");
    assert_ne!(entries[0].1.flags & proxy_common::nat::CT_F_DSR_ENCAP, 0);
    assert_ne!(
        entries[0].1.flags & proxy_common::nat::CT_F_SEEN_REPLY,
        0,
        "the client's ACK established the flow"
    );

    // XDP starts the flow and leaves the packet to tc, which encapsulates it.
    let syn = Packet::tcp(&sock(f.client, 46002), &sock(f.node, 30091), SYN);
    step(
        h,
        "SYN in XDP",
        XDP,
        &syn.frame(),
        XDP_PASS,
        None,
        Some("tc_new_flow"),
    );
    let want = sent_on(
        &encapsulated(&syn.ip(), f.node, f.remote),
        v6,
        BACKEND_HOP_MAC,
    );
    step(
        h,
        "the same SYN at tc ingress",
        INGRESS,
        &syn.frame(),
        REDIRECT,
        Some(&want),
        Some("tc_translated"),
    );
}

/// The entry node: a packet too big once encapsulated is answered to the client.
fn dsr_too_big(h: &Harness, f: Fam) {
    let v6 = f.node.contains(':');
    // Too big once encapsulated: "fragmentation needed" / "packet too big" with the MTU
    // left for the inner packet, back to the client.
    let mut big = Packet::udp(&sock(f.client, 46003), &sock(f.node, 30092));
    big.payload = vec![7; if v6 { 1500 - 40 - 8 } else { 1500 - 20 - 8 }];
    big.frag = 0x4000; // DF
    let before = h.counters();
    let (v, out) = h.run(INGRESS, &big.frame());
    assert_eq!(v, REDIRECT, "too big: {}", show(&out));
    verify(&out).expect("checksums of the ICMP error");
    let d = decode(&out).expect("an IP frame");
    assert_eq!(d.dst, f.client.parse::<std::net::IpAddr>().unwrap());
    let icmp = &out[d.l4..];
    if v6 {
        assert_eq!(
            (d.proto, icmp[0], icmp[1]),
            (ICMPV6, 2, 0),
            "packet too big"
        );
        assert_eq!(u32::from_be_bytes(icmp[4..8].try_into().unwrap()), 1460);
    } else {
        assert_eq!(
            (d.proto, icmp[0], icmp[1]),
            (ICMP, 3, 4),
            "fragmentation needed"
        );
        assert_eq!(u16::from_be_bytes([icmp[6], icmp[7]]), 1480);
    }
    assert_eq!(h.counters()["tc_dsr_too_big"], before["tc_dsr_too_big"] + 1);
    // A packet that fits goes through.
    big.payload
        .truncate(big.payload.len() - if v6 { 40 } else { 20 });
    let (v, _) = h.run(INGRESS, &big.frame());
    assert_eq!(v, REDIRECT, "a datagram that fits");
}

/// The backend's node: encapsulated packets of accepted pairs are decapsulated and DNATed,
/// the replies leave from the frontend; anything else is left alone.
fn dsr_backend_node(h: &Harness, f: Fam) {
    let v6 = f.node.contains(':');
    let ext = if v6 { "2001:db8:e::41" } else { "203.0.113.41" };
    let other = other_node(f);

    // Backend's node: an encapsulated SYN to another node's node port, for an endpoint
    // here: the outer header goes, the inner packet is DNATed to the endpoint.
    let client = sock(f.client, 46010);
    let syn = Packet::tcp(&client, &sock(other, 30093), SYN);
    let frame = ether(&encapsulated(&syn.ip(), other, f.local), v6);
    let dnat = Packet {
        dst: sock(f.local, 8080).parse().unwrap(),
        ..syn.clone()
    };
    step(
        h,
        "an encapsulated SYN to a node port of another node",
        INGRESS,
        &frame,
        PASS,
        Some(&dnat.frame()),
        Some("tc_dsr_decapsulated"),
    );
    // The backend's SYN-ACK leaves from the frontend, its MSS lowered by the overhead.
    let synack = Packet {
        tcp_options: mss(1460),
        ..Packet::tcp(&sock(f.local, 8080), &client, SYN | ACK)
    };
    let want = Packet {
        src: sock(other, 30093).parse().unwrap(),
        tcp_options: mss(if v6 { 1420 } else { 1440 }),
        ..synack.clone()
    };
    step(
        h,
        "the backend's SYN-ACK (from the frontend, MSS lowered)",
        EGRESS,
        &synack.frame(),
        PASS,
        Some(&want.frame()),
        Some("tc_translated"),
    );
    // Later packets arrive encapsulated too.
    let ack = Packet::tcp(&client, &sock(other, 30093), ACK);
    let frame = ether(&encapsulated(&ack.ip(), other, f.local), v6);
    let dnat = Packet {
        dst: sock(f.local, 8080).parse().unwrap(),
        ..ack.clone()
    };
    step(
        h,
        "the client's encapsulated ACK",
        INGRESS,
        &frame,
        PASS,
        Some(&dnat.frame()),
        Some("tc_translated"),
    );
    // An external IP (the same address on every node), UDP.
    let dgram = Packet::udp(&sock(f.client, 46011), &sock(ext, 53));
    let frame = ether(&encapsulated(&dgram.ip(), other, f.local), v6);
    let dnat = Packet {
        dst: sock(f.local, 5353).parse().unwrap(),
        ..dgram.clone()
    };
    step(
        h,
        "an encapsulated datagram to an external IP",
        INGRESS,
        &frame,
        PASS,
        Some(&dnat.frame()),
        Some("tc_dsr_decapsulated"),
    );

    // Not ours: a pair this node does not accept (the frontend's endpoints are elsewhere),
    // and a tunnel to an address that is no endpoint here: untouched.
    let stray = Packet::tcp(&sock(f.client, 46012), &sock(other, 30091), SYN);
    let frame = ether(&encapsulated(&stray.ip(), other, f.local), v6);
    step(
        h,
        "an unknown pair",
        INGRESS,
        &frame,
        PASS,
        None,
        Some("tc_dsr_unknown"),
    );
    let frame = ether(&encapsulated(&stray.ip(), other, f.remote), v6);
    step(
        h,
        "a tunnel to another address",
        INGRESS,
        &frame,
        PASS,
        None,
        None,
    );
    // tc egress leaves encapsulated packets alone (the entry node's own, on their way out).
    let frame = ether(&encapsulated(&syn.ip(), f.node, f.remote), v6);
    step(
        h,
        "an encapsulated packet at egress",
        EGRESS,
        &frame,
        PASS,
        None,
        None,
    );
}

/// Both nodes after the client's FIN and after the pairs went.
fn dsr_after_close(h: &Harness, f: Fam) {
    let v6 = f.node.contains(':');
    let other = other_node(f);

    // The entry node after the client's FIN: half-closed (the backend's FIN never passes
    // there), with the longer half-closed timeout rather than the closed one.
    let fin = Packet::tcp(&sock(f.client, 46000), &sock(f.node, 30091), FIN | ACK);
    let (v, _) = h.run(INGRESS, &fin.frame());
    assert_eq!(v, REDIRECT, "the client's FIN, encapsulated");
    let (_, e) = h
        .conntrack()
        .into_iter()
        .find(|(k, _)| k.sport == 46000u16.to_be_bytes())
        .expect("the entry of the flow");
    assert!(!proxy_common::nat::ct_closed(e.flags), "{:#x}", e.flags);
    assert_eq!(
        proxy_common::nat::ct_timeout_ns(e.flags, TCP, 0, 0, 0),
        proxy_common::nat::CT_TIMEOUT_TCP_HALF_CLOSED_NS
    );

    // The pairs go (the endpoint is no longer ready, or the Service left DSR): the flows
    // this node tracks go on, new ones are not accepted.
    let mut pairs: aya::maps::HashMap<
        aya::maps::MapData,
        proxy_common::nat::DsrKey,
        proxy_common::nat::DsrTarget,
    > = h.map(proxy_common::nat::DSR);
    let keys: Vec<_> = pairs.keys().filter_map(|k| k.ok()).collect();
    for k in keys {
        pairs.remove(&k).unwrap();
    }
    // The client's ACK of the flow the backend's node tracks (`dsr_backend_node`).
    let ack = Packet::tcp(&sock(f.client, 46010), &sock(other, 30093), ACK);
    let frame = ether(&encapsulated(&ack.ip(), other, f.local), v6);
    let dnat = Packet {
        dst: sock(f.local, 8080).parse().unwrap(),
        ..ack.clone()
    };
    step(
        h,
        "an encapsulated packet of a tracked flow without its pair",
        INGRESS,
        &frame,
        PASS,
        Some(&dnat.frame()),
        Some("tc_translated"),
    );
    let late = Packet::tcp(&sock(f.client, 46013), &sock(other, 30093), SYN);
    let frame = ether(&encapsulated(&late.ip(), other, f.local), v6);
    step(
        h,
        "a new flow without its pair",
        INGRESS,
        &frame,
        PASS,
        None,
        Some("tc_dsr_unknown"),
    );
}

#[test]
fn ipv4_direct_server_return_encapsulation_and_decapsulation() {
    in_private_netns(|| {
        let _r = xdp_routes(V4);
        let h = Harness::new("dsr4");
        h.seed(DSR_OBJECTS, "node-1", &TcOptions::default());
        dsr_flows(&h, V4)
    });
}

#[test]
fn ipv6_direct_server_return_encapsulation_and_decapsulation() {
    in_private_netns(|| {
        let _r = xdp_routes(V6);
        let h = Harness::new("dsr6");
        h.seed(DSR_OBJECTS, "node-1", &TcOptions::default());
        dsr_flows(&h, V6)
    });
}

// ---------------------------------------------------------------------------------------
// Per-service packet counters
// ---------------------------------------------------------------------------------------

/// A tracked packet counts in its Service port's slot of `SERVICE_PACKETS` once its first
/// counted packet claimed the free slot, in `SERVICE_STATS` while another id owns the slot;
/// the verification frees the slot of an id no longer bound with the next generation, and
/// readers add both maps.
#[test]
fn tracked_packets_count_in_their_service_slot_or_else_in_the_hash() {
    use aya::maps::{Array, MapData, PerCpuHashMap};
    use proxy_common::{PACKET_OWNERS, PACKET_SLOTS, SERVICE_STATS, ServiceStats, packet_tag};
    use proxy_userspace::datapath::{
        Bound, ServiceMaps,
        maps::{PinnedMaps, read_service_stats},
    };
    in_private_netns(|| {
        let h = seeded("slots");
        let client = sock(V4.client, 46100);
        let frontend = sock(V4.node, 30080);
        let (v, _) = h.run(INGRESS, &Packet::tcp(&client, &frontend, SYN).frame());
        assert_eq!(v, PASS, "SYN to a local backend");
        let sid = h
            .conntrack()
            .iter()
            .find(|(k, e)| {
                k.sport == 46100u16.to_be_bytes() && e.flags & proxy_common::nat::CT_F_REPLY == 0
            })
            .map(|(_, e)| e.service_id)
            .expect("the flow's original entry");
        let slot = sid & (PACKET_SLOTS - 1);
        let owners = || -> Array<MapData, u64> { h.map(PACKET_OWNERS) };
        let in_hash = || -> u64 {
            let m: PerCpuHashMap<MapData, u32, ServiceStats> = h.map(SERVICE_STATS);
            m.get(&sid, 0)
                .map(|v| v.iter().map(|s| s.packets).sum())
                .unwrap_or(0)
        };
        let total = || read_service_stats(&h.dir).unwrap()[&sid];
        let ack = Packet::tcp(&client, &frontend, ACK).frame();
        let send = |n: usize| {
            for _ in 0..n {
                assert_eq!(h.run(INGRESS, &ack).0, PASS, "a tracked segment");
            }
        };
        // Another id (not bound) holds the slot: the packets count in the hash.
        let other = sid + PACKET_SLOTS;
        owners().set(slot, packet_tag(other, 0), 0).unwrap();
        send(2);
        assert_eq!(in_hash(), 2, "counted in SERVICE_STATS");
        assert_eq!(total().packets, 2);
        assert!(total().bytes > 2 * 40, "bytes: {:?}", total());
        // The verification frees it (only `sid` is bound), with the next generation.
        let bound = |id: u32| id == sid;
        let sweep = || {
            PinnedMaps::open(&h.dir)
                .unwrap()
                .sweep_stats(&Bound {
                    service: &bound,
                    backend: &|_| true,
                    member: &|_, _| true,
                })
                .unwrap()
        };
        assert!(sweep() >= 1, "the slot of the unbound id freed");
        assert_eq!(owners().get(&slot, 0).unwrap(), packet_tag(0, 1));
        // The next packet claims it for its own id; the hash's count stays in the sum.
        send(3);
        assert_eq!(owners().get(&slot, 0).unwrap(), packet_tag(sid, 1));
        assert_eq!(in_hash(), 2, "no longer counted in SERVICE_STATS");
        assert_eq!(total().packets, 5, "the hash's 2 and the slot's 3");
        // A bound owner keeps its slot.
        sweep();
        assert_eq!(owners().get(&slot, 0).unwrap(), packet_tag(sid, 1));
        send(1);
        assert_eq!(total().packets, 6);
        // Pins without the counter slots (an interrupted pinning, an earlier version's):
        // readers and the sweep go on with the hash.
        std::fs::remove_file(h.dir.join(proxy_common::SERVICE_PACKETS)).unwrap();
        assert_eq!(total().packets, 2, "the hash's count alone");
        sweep();
    });
}
