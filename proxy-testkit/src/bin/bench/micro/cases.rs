//! ebpf-proxy's cases: the Services its object is seeded with and the packets of each path.

use super::*;

/// Node `node-1` (this node, 192.0.2.50) and `node-2`:
/// - `local`: endpoint 10.0.1.5 on this node: node ports 30080/TCP, 30053/UDP; cluster IP
///   10.96.0.10;
/// - `remote`: endpoint 10.0.2.7 on node-2 (source-NATed): node ports 30081/TCP,
///   30054/UDP.
///
/// (A part of the packet tests' objects.)
pub(super) const OBJECTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1}
status: {addresses: [{type: InternalIP, address: 192.0.2.50}]}
---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30080}, {name: dns, port: 53, protocol: UDP, nodePort: 30053}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: local-v4, namespace: default, labels: {kubernetes.io/service-name: local}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [10.0.1.5], nodeName: node-1}]
---
apiVersion: v1
kind: Service
metadata: {name: remote, namespace: default}
spec:
  type: NodePort
  clusterIP: 10.96.0.11
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30081}, {name: dns, port: 53, protocol: UDP, nodePort: 30054}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: remote-v4, namespace: default, labels: {kubernetes.io/service-name: remote}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 5353, protocol: UDP}]
endpoints: [{addresses: [10.0.2.7], nodeName: node-2}]
"#;

/// Node `node-1` and two Services in `dsr` mode: `dsr-out` with its endpoint on node-2
/// (this node is the entry node): node port 30091; `dsr-in` with its endpoint 10.0.1.5 on
/// this node (the backend's node of flows entering at another node): node port 30093.
pub(super) const DSR_OBJECTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1}
status: {addresses: [{type: InternalIP, address: 192.0.2.50}]}
---
apiVersion: v1
kind: Service
metadata: {name: dsr-out, namespace: default, annotations: {ebpf-proxy.io/north-south-mode: dsr}}
spec:
  type: NodePort
  clusterIP: 10.96.0.40
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30091}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dsr-out-v4, namespace: default, labels: {kubernetes.io/service-name: dsr-out}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.0.2.7], nodeName: node-2}]
---
apiVersion: v1
kind: Service
metadata: {name: dsr-in, namespace: default, annotations: {ebpf-proxy.io/north-south-mode: dsr}}
spec:
  type: NodePort
  clusterIP: 10.96.0.41
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30093}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dsr-in-v4, namespace: default, labels: {kubernetes.io/service-name: dsr-in}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.0.1.5], nodeName: node-1}]
"#;

pub(super) const NODE: &str = "192.0.2.50";
/// Another node: the entry node of the DSR flows this node's endpoint serves.
pub(super) const OTHER_NODE: &str = "192.0.2.60";
pub(super) const CLIENT: &str = "198.51.100.7";
pub(super) const LOCAL: &str = "10.0.1.5";
pub(super) const REMOTE: &str = "10.0.2.7";
/// A bypassed pod on this node, and the cluster IP of `local`.
pub(super) const POD: &str = "10.0.1.20";
pub(super) const CLUSTER_IP: &str = "10.96.0.10";

pub(super) const INGRESS: &str = "tc_ingress";
pub(super) const EGRESS: &str = "tc_egress";
pub(super) const POD_INGRESS: &str = "pod_ingress";
pub(super) const POD_EGRESS: &str = "pod_egress";

/// ebpf-proxy's object loaded in this namespace, seeded with `objects` on node-1; room for
/// a run's new flows in the conntrack.
pub(super) fn harness(name: &str, objects: &str) -> Harness {
    let h = Harness::with_sizes(
        name,
        MapSizes {
            frontends: 1024,
            slots: 1024,
            backends: 1024,
            sockets: 1024,
            conntrack_flows: 65536,
        },
    );
    h.seed(objects, "node-1", &TcOptions::default());
    h
}

pub(super) fn tcp(src: &str, sport: u16, dst: &str, dport: u16, flags: u8) -> Packet {
    Packet::tcp(&sock(src, sport), &sock(dst, dport), flags)
}

/// A data segment ("hello").
pub(super) fn data(src: &str, sport: u16, dst: &str, dport: u16) -> Vec<u8> {
    tcp(src, sport, dst, dport, PSH | ACK).frame()
}

pub(super) fn syn(src: &str, sport: u16, dst: &str, dport: u16) -> Vec<u8> {
    tcp(src, sport, dst, dport, SYN).frame()
}

/// The handshake of client:`cport` -> node port `nport`, backend `backend`:8080 on this
/// node, through tc: SYN at ingress, SYN-ACK at egress, ACK at ingress.
pub(super) fn local_handshake(c: Case, cport: u16, nport: u16) -> Case {
    c.prime(INGRESS, syn(CLIENT, cport, NODE, nport), PASS)
        .prime(
            EGRESS,
            tcp(LOCAL, 8080, CLIENT, cport, SYN | ACK).frame(),
            PASS,
        )
        .prime(INGRESS, tcp(CLIENT, cport, NODE, nport, ACK).frame(), PASS)
}

/// Cases without routes: flows to a backend on this node, new flows, UDP, ICMP, the pod
/// path.
pub(super) fn node_cases() -> Vec<Case> {
    use Hook::Tc;
    use Like::{New, Tracked};
    let udp = Packet::udp(&sock(CLIENT, 40001), &sock(NODE, 30053)).frame();
    let dnat_udp = Packet::udp(&sock(CLIENT, 40002), &sock(LOCAL, 5353));
    let icmp = Packet::icmp_error(LOCAL, CLIENT, 3, 3, &dnat_udp.ip(), 64).frame();
    let pod_syn = Packet::tcp(&sock(POD, 45100), &sock(CLUSTER_IP, 80), SYN).frame();
    vec![
        local_handshake(
            Case::new(
                "TCP data, tracked, backend on this node",
                INGRESS,
                Tc,
                Tracked,
            ),
            40000,
            30080,
        )
        .counter("tc_translated")
        .frame(data(CLIENT, 40000, NODE, 30080)),
        local_handshake(
            Case::new(
                "TCP reply, tracked, backend on this node",
                EGRESS,
                Tc,
                Tracked,
            ),
            40000,
            30080,
        )
        .counter("tc_translated")
        .frame(data(LOCAL, 8080, CLIENT, 40000)),
        Case::new("SYN of a new flow, backend on this node", INGRESS, Tc, New)
            .counter("tc_new_flow")
            .per_sample(|i| syn(CLIENT, (NEW_PORT_BASE + i) as u16, NODE, 30080)),
        Case::new("UDP datagram, tracked", INGRESS, Tc, Tracked)
            .prime(INGRESS, udp.clone(), PASS)
            .counter("tc_translated")
            .frame(udp),
        Case::new(
            "ICMP port unreachable quoting a DNATed datagram",
            EGRESS,
            Tc,
            Tracked,
        )
        .prime(
            INGRESS,
            Packet::udp(&sock(CLIENT, 40002), &sock(NODE, 30053)).frame(),
            PASS,
        )
        .counter("tc_icmp_translated")
        .frame(icmp),
        Case::new(
            "pod: TCP data to a cluster IP, tracked",
            POD_INGRESS,
            Tc,
            Tracked,
        )
        .prime(POD_INGRESS, pod_syn.clone(), PASS)
        .counter("tc_translated")
        .frame(data(POD, 45100, CLUSTER_IP, 80)),
        Case::new(
            "pod: TCP reply into the pod, tracked",
            POD_EGRESS,
            Tc,
            Tracked,
        )
        .prime(POD_INGRESS, pod_syn, PASS)
        .counter("tc_translated")
        .frame(data(LOCAL, 8080, POD, 45100)),
        Case::new(
            "pod: SYN of a new flow to a cluster IP",
            POD_INGRESS,
            Tc,
            New,
        )
        .counter("tc_new_flow")
        .per_sample(|i| {
            Packet::tcp(
                &sock(POD, (NEW_PORT_BASE + i) as u16),
                &sock(CLUSTER_IP, 80),
                SYN,
            )
            .frame()
        }),
    ]
}

/// Cases that leave through a FIB lookup: source-NATed flows through tc and XDP.
pub(super) fn routed_cases() -> Vec<Case> {
    use Hook::{Tc, Xdp};
    use Like::{New, Tracked};
    // tc: client:42000 -> node port 30081 -> 10.0.2.7:8080, source-NATed to the node
    // address keeping the client's port (free).
    let tc_flow = |c: Case| {
        c.prime(INGRESS, syn(CLIENT, 42000, NODE, 30081), PASS)
            .prime(EGRESS, syn(CLIENT, 42000, REMOTE, 8080), PASS)
            .prime(
                INGRESS,
                tcp(REMOTE, 8080, NODE, 42000, SYN | ACK).frame(),
                REDIRECT,
            )
    };
    // XDP: client:45000 -> node port 30081, both translations at once.
    let xdp_flow = |c: Case| {
        c.prime(XDP, syn(CLIENT, 45000, NODE, 30081), XDP_REDIRECT)
            .prime(
                XDP,
                tcp(REMOTE, 8080, NODE, 45000, SYN | ACK).frame(),
                XDP_REDIRECT,
            )
    };
    vec![
        tc_flow(Case::new(
            "TCP data to a remote backend (DNAT)",
            INGRESS,
            Tc,
            Tracked,
        ))
        .counter("tc_translated")
        .frame(data(CLIENT, 42000, NODE, 30081)),
        tc_flow(Case::new(
            "TCP data to a remote backend, SNAT stage",
            EGRESS,
            Tc,
            Tracked,
        ))
        .counter("tc_translated")
        .frame(data(CLIENT, 42000, REMOTE, 8080)),
        tc_flow(Case::new(
            "TCP reply of a remote backend (reverse SNAT and DNAT, sent on)",
            INGRESS,
            Tc,
            Tracked,
        ))
        .verdict(REDIRECT)
        .counter("tc_translated")
        .frame(data(REMOTE, 8080, NODE, 42000)),
        xdp_flow(Case::new(
            "XDP: TCP data to a remote backend (DNAT and SNAT, sent on)",
            XDP,
            Xdp,
            Tracked,
        ))
        .verdict(XDP_REDIRECT)
        .counter("xdp_forwarded")
        .frame(data(CLIENT, 45000, NODE, 30081)),
        xdp_flow(Case::new(
            "XDP: TCP reply of a remote backend (sent on)",
            XDP,
            Xdp,
            Tracked,
        ))
        .verdict(XDP_REDIRECT)
        .counter("xdp_forwarded")
        .frame(data(REMOTE, 8080, NODE, 45000)),
        Case::new(
            "XDP: SYN of a new flow to a remote backend (sent on)",
            XDP,
            Xdp,
            New,
        )
        .verdict(XDP_REDIRECT)
        .counter("tc_new_flow")
        .per_sample(|i| syn(CLIENT, (NEW_PORT_BASE + i) as u16, NODE, 30081)),
        Case::new(
            "XDP: TCP data, backend on this node (left to tc)",
            XDP,
            Xdp,
            Tracked,
        )
        .prime(XDP, syn(CLIENT, 45001, NODE, 30080), XDP_PASS)
        .verdict(XDP_PASS)
        .frame(data(CLIENT, 45001, NODE, 30080)),
    ]
}

/// Direct server return: the entry node and the backend's node.
pub(super) fn dsr_cases() -> Vec<Case> {
    use Hook::Tc;
    use Like::Tracked;
    let entry = |c: Case| {
        c.prime(INGRESS, syn(CLIENT, 46000, NODE, 30091), REDIRECT)
            .prime(
                INGRESS,
                tcp(CLIENT, 46000, NODE, 30091, ACK).frame(),
                REDIRECT,
            )
    };
    let inner_syn = tcp(CLIENT, 46010, OTHER_NODE, 30093, SYN).ip();
    let accepted = move |c: Case| {
        c.prime(
            INGRESS,
            ether(&encapsulated(&inner_syn, OTHER_NODE, LOCAL), false),
            PASS,
        )
    };
    let inner_data = tcp(CLIENT, 46010, OTHER_NODE, 30093, PSH | ACK).ip();
    vec![
        entry(Case::new(
            "DSR entry node: TCP data, tracked (encapsulated, sent on)",
            INGRESS,
            Tc,
            Tracked,
        ))
        .verdict(REDIRECT)
        .counter("tc_dsr_encapsulated")
        .frame(data(CLIENT, 46000, NODE, 30091)),
        accepted.clone()(Case::new(
            "DSR backend node: encapsulated TCP data, tracked (decapsulated, DNAT)",
            INGRESS,
            Tc,
            Tracked,
        ))
        .counter("tc_translated")
        .frame(ether(&encapsulated(&inner_data, OTHER_NODE, LOCAL), false)),
        accepted(Case::new(
            "DSR backend node: TCP reply (from the frontend)",
            EGRESS,
            Tc,
            Tracked,
        ))
        .counter("tc_translated")
        .frame(data(LOCAL, 8080, CLIENT, 46010)),
    ]
}

/// Routes of the XDP and DSR cases, in this thread's namespace: an interface `xf0` (a
/// veth; its peer `xf1` only gives it a carrier) with the node's address, the other node's
/// pod network (10.0.2.0/24) behind a router with a neighbour entry, the client's network
/// (198.51.100.0/24) behind another; forwarding on (the FIB lookup refuses otherwise).
/// The packet tests' setup.
pub(super) fn routes() -> Result<()> {
    let ip = |args: &str| -> Result<()> {
        let st = Command::new("ip")
            .args(args.split_whitespace())
            .status()
            .context("run ip")?;
        ensure!(st.success(), "ip {args}");
        Ok(())
    };
    fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("ip_forward")?;
    ip("link add xf0 address 02:00:00:00:00:50 type veth peer name xf1")?;
    ip("link set lo up")?;
    ip("link set xf1 up")?;
    ip("link set xf0 up")?;
    ip("addr add 192.0.2.50/24 dev xf0")?;
    ip("route add 10.0.2.0/24 via 192.0.2.2 dev xf0")?;
    ip("route add 198.51.100.0/24 via 192.0.2.1 dev xf0")?;
    ip("neigh add 192.0.2.2 lladdr 02:00:00:00:00:22 dev xf0 nud permanent")?;
    ip("neigh add 192.0.2.1 lladdr 02:00:00:00:00:11 dev xf0 nud permanent")?;
    Ok(())
}
