//! Privileged integration tests of the north-south data path: NodePorts, external
//! IPs and load balancer IPs served by the tcx programs on the node's external interface to
//! an external client, with real TCP and UDP, on the two-node lab of `nslab` (described
//! there).
//!
//! The `ipv6_*` tests make the lab dual-stack (`Lab::add_ipv6`). The `xdp_*` tests run the
//! same bodies with `--xdp native` on both agents (veth has native XDP) and check that XDP
//! sent packets out itself.

mod common;
mod nslab;

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use common::{BPFFS, DNS, Endpoint, HTTP, NETPROBE, Port, Web, agent_path, of_type};
use nslab::{
    Agent, CLIENT, CLIENT6, EXTERNAL_IP, LB_IP, Lab, NODE_A, NODE_A6, NODE_B, NODE_B6, POD_A0,
    POD_A06, POD_B0, POD_B06, SHORT, T, Xdp, ip_of, set_int_opt, tcp_whoami, udp_whoami,
};
use proxy_testkit::testbed::{ChildGuard, TestCgroup, in_netns, output_in};
use proxy_userspace::datapath::tc;

/// the translation must keep it zero (a zero checksum means "none" in IPv4).
fn udp_whoami_no_csum(client: &Path, to: &str) -> Result<String, i32> {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(client, move || {
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        set_int_opt(&s, libc::SOL_SOCKET, libc::SO_NO_CHECK, 1);
        s.connect(to).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.send(b"ping")
            .map_err(|e| e.raw_os_error().unwrap_or(-1))?;
        let mut buf = [0u8; 512];
        let n = s
            .recv(&mut buf)
            .map_err(|e| e.raw_os_error().unwrap_or(-1))?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    })
    .unwrap()
}

/// TCP and UDP from the client to each frontend of `fes` (TCP port 30080 or 80, UDP 30053
/// or 53 of the same address) reach both backends a0 (on node-a) and b0 (on node-b); a
/// backend on the node that took the flow sees `client`, one on the other node sees that
/// node's address (SNAT, so its replies come back through it). `nodes`: node-a's and
/// node-b's addresses of the family. A connected socket only accepts replies from the
/// address it connected to: each success also shows the client saw the frontend as source.
fn both_backends_with_snat_to_remote_ones(
    c: &Path,
    fes: &[String],
    nodes: [&str; 2],
    client: &str,
) {
    both_backends(c, fes, nodes, client, Mode::Snat)
}

/// How the lab's agents reach a backend on the other node.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// Source-NAT (the default).
    Snat,
    /// `--north-south-mode dsr`: every backend sees the client.
    Dsr,
}

impl Mode {
    /// The agents' flags for the mode.
    fn flags(self) -> &'static [&'static str] {
        match self {
            Mode::Snat => &[],
            Mode::Dsr => &["--north-south-mode", "dsr"],
        }
    }
}

/// [`both_backends_with_snat_to_remote_ones`] in `mode`: with DSR every backend sees the
/// client's address.
fn both_backends(c: &Path, fes: &[String], nodes: [&str; 2], client: &str, mode: Mode) {
    let want = |fe: &str, name: &str| {
        let entry = if fe.contains(nodes[1]) {
            nodes[1]
        } else {
            nodes[0]
        };
        let backend_node = if name == "a0" { nodes[0] } else { nodes[1] };
        if entry == backend_node || mode == Mode::Dsr {
            client.to_string()
        } else {
            entry.to_string()
        }
    };
    for fe in fes {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..24 {
            let (name, peer) = tcp_whoami(c, fe, T).unwrap_or_else(|e| panic!("TCP to {fe}: {e}"));
            assert_eq!(
                ip_of(&peer),
                want(fe, &name),
                "{fe} -> {name}: source seen by the backend"
            );
            seen.insert(name);
        }
        assert_eq!(seen.len(), 2, "{fe}: both backends used: {seen:?}");
        let ufe = fe.replace(":30080", ":30053").replace(":80", ":53");
        let mut useen = std::collections::BTreeSet::new();
        for _ in 0..12 {
            let (name, peer) =
                udp_whoami(c, &ufe, T).unwrap_or_else(|e| panic!("UDP to {ufe}: errno {e}"));
            assert_eq!(ip_of(&peer), want(&ufe, &name), "{ufe} -> {name} (UDP)");
            useen.insert(name);
        }
        assert_eq!(useen.len(), 2, "{ufe}: {useen:?}");
    }
}

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

const BOTH: [(&str, &str); 2] = [(POD_A0, "node-a"), (POD_B0, "node-b")];

#[test]
fn nodeport_external_and_lb_ips_with_snat_to_remote_backends() {
    nodeport_external_and_lb_ips(Xdp::Off, Mode::Snat);
}

#[test]
fn xdp_nodeport_external_and_lb_ips_with_snat_to_remote_backends() {
    nodeport_external_and_lb_ips(Xdp::Native, Mode::Snat);
}

#[test]
fn dsr_nodeport_external_and_lb_ips_keep_the_client_address() {
    nodeport_external_and_lb_ips(Xdp::Off, Mode::Dsr);
}

#[test]
fn xdp_dsr_nodeport_external_and_lb_ips_keep_the_client_address() {
    nodeport_external_and_lb_ips(Xdp::Native, Mode::Dsr);
}

/// With XDP: it runs natively on node-a's interface (the pin says so) and sent packets out
/// itself, and every translated packet's checksums held (no rewrite failed).
fn assert_xdp_worked(lab: &Lab, xdp: Xdp) {
    if xdp == Xdp::Off {
        return;
    }
    assert_xdp_mode(lab, xdp);
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(counters["xdp_forwarded"] > 0, "{counters:?}");
}

/// With XDP: it runs natively on node-a's interface (the pin says so).
fn assert_xdp_mode(lab: &Lab, xdp: Xdp) {
    if xdp == Xdp::Off {
        return;
    }
    let modes = tc::xdp_modes(&lab.agents[0].pin);
    assert_eq!(
        modes.get("eth0"),
        Some(&tc::XdpMode::Native),
        "XDP links: {modes:?}"
    );
}

fn nodeport_external_and_lb_ips(xdp: Xdp, mode: Mode) {
    let tag = match (xdp, mode) {
        (Xdp::Off, Mode::Snat) => "np",
        (Xdp::Native, Mode::Snat) => "xnp",
        (Xdp::Off, Mode::Dsr) => "dnp",
        (Xdp::Native, Mode::Dsr) => "xdnp",
    };
    let mut lab = Lab::with_xdp(tag, xdp);
    web(&lab, "", &BOTH);
    lab.start_agent(0, mode.flags());
    lab.start_agent(1, mode.flags());
    let c = lab.client_path();
    let fes = [
        format!("{NODE_A}:30080"),
        format!("{NODE_B}:30080"),
        format!("{EXTERNAL_IP}:80"),
        format!("{LB_IP}:80"),
    ];
    let mon = common::MonitorRun::start(&lab.agents[0].pin, &["--type", "flow-new"]);
    both_backends(&c, &fes, [NODE_A, NODE_B], CLIENT, mode);
    // The monitor names the program that decided each flow on node-a.
    let new = mon.stop();
    let hook = if xdp == Xdp::Off { "tc-ingress" } else { "xdp" };
    assert!(!new.is_empty(), "no flow-new event on node-a");
    for e in &new {
        assert_eq!(e["hook"], hook, "{e}");
    }
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    let (sent_on, other) = match mode {
        Mode::Snat => ("tc_snat", "tc_dsr_encapsulated"),
        Mode::Dsr => ("tc_dsr_encapsulated", "tc_snat"),
    };
    assert!(
        counters["tc_new_flow"] > 0 && counters[sent_on] > 0 && counters[other] == 0,
        "{counters:?}"
    );
    assert_eq!(counters["tc_rewrite_failed"], 0, "{counters:?}");
    if mode == Mode::Dsr {
        // node-b accepted what node-a encapsulated, and node-a what node-b did.
        let b = tc::counters(&lab.agents[1].pin).unwrap();
        assert!(b["tc_dsr_decapsulated"] > 0, "{b:?}");
        assert!(counters["tc_dsr_decapsulated"] > 0, "{counters:?}");
        assert_eq!(b["tc_dsr_unknown"] + counters["tc_dsr_unknown"], 0);
    }
    // Per-frontend connections, packets and bytes of the ingress sets.
    let per = proxy_userspace::datapath::maps::read_service_stats(&lab.agents[0].pin).unwrap();
    let names = proxy_userspace::datapath::maps::PinnedMaps::open(&lab.agents[0].pin)
        .and_then(|m| {
            use proxy_userspace::datapath::ServiceMaps;
            m.snapshot()
        })
        .unwrap()
        .names;
    let ingress: Vec<_> = per
        .iter()
        .filter(|(id, _)| names.get(id).is_some_and(|n| n.ends_with("/ingress")))
        .map(|(_, s)| *s)
        .collect();
    assert!(!ingress.is_empty(), "{per:?} {names:?}");
    let (c, p, b) = ingress.iter().fold((0, 0, 0), |(c, p, b), s| {
        (c + s.connections, p + s.packets, b + s.bytes)
    });
    assert!(
        c > 0 && p >= c && b > p * 20,
        "connections {c}, packets {p}, bytes {b}"
    );
    if mode == Mode::Dsr {
        // XDP leaves DSR flows to tcx: it forwards nothing itself here.
        assert_xdp_mode(&lab, xdp);
    } else {
        assert_xdp_worked(&lab, xdp);
    }
}

/// A lab whose wire gives the nodes' veths no XDP program (kind, container-based nodes):
/// `--xdp native` refuses node-a's eth0 with the reason and both remedies while its tcx
/// programs serve; `--xdp best-effort` leaves the veth on tcx; `check` flags the veth.
#[test]
fn xdp_on_a_veth_without_an_xdp_peer_is_refused_or_left_to_tcx() {
    let mut lab = Lab::with_xdp("xveth", Xdp::Off);
    web(&lab, "", &BOTH);
    lab.start_agent(1, &[]);
    let cg = TestCgroup::create(&format!("ebpf-proxy-ns4-{}-node-a", lab.tag)).unwrap();
    let log = lab.manifests.path().with_extension("node-a.log");
    let child = lab.spawn_agent(0, &cg, &log, &["--xdp", "native"]);
    let mut agent = Agent {
        child: Some(child),
        pin: Path::new(BPFFS).join(format!("ebpf-proxy-ns4-{}-node-a", lab.tag)),
        log,
        cg,
        node: 0,
        extra: vec!["--xdp".into(), "best-effort".into()],
    };
    let start = Instant::now();
    while !agent.log().contains("is a veth") {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no veth refusal; log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let l = agent.log();
    for needle in [
        "--xdp native: eth0 is a veth",
        "--xdp best-effort",
        "attach an XDP program to the peer",
        "--xdp-veth-peers-ready",
    ] {
        assert!(l.contains(needle), "{needle:?} missing in\n{l}");
    }
    assert!(
        tc::xdp_modes(&agent.pin).is_empty(),
        "no XDP link on the veth"
    );
    // The tcx programs serve it meanwhile, to the backend on the other node too.
    let c = lab.client_path();
    let fe = format!("{NODE_A}:30080");
    let both_backends_answer = || {
        let seen: std::collections::BTreeSet<String> = (0..16)
            .map(|_| {
                tcp_whoami(&c, &fe, T)
                    .unwrap_or_else(|e| panic!("{fe}: {e}"))
                    .0
            })
            .collect();
        assert_eq!(seen.len(), 2, "{seen:?}");
    };
    both_backends_answer();
    // Restarted with its `extra`, best-effort: the veth stays on tcx, flows work.
    lab.agents.push(agent);
    let a = lab.agents.len() - 1;
    lab.restart_agent(a);
    agent = lab.agents.pop().unwrap();
    assert!(
        agent
            .log()
            .contains("--xdp best-effort: a veth gets no XDP"),
        "{}",
        agent.log()
    );
    assert!(tc::xdp_modes(&agent.pin).is_empty());
    both_backends_answer();
    lab.agents.push(agent);
    // `check` in node-a's namespace: native XDP on a veth, with the condition.
    let out = lab.nodes[0]
        .exec_timeout(
            agent_path().to_str().unwrap(),
            &["check", "-o", "json"],
            Duration::from_secs(60),
        )
        .unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let xdp = rows.iter().find(|r| r["check"] == "xdp").unwrap();
    let detail = xdp["detail"].as_str().unwrap();
    assert!(
        detail.contains("eth0: native (")
            && detail.contains("but frames sent back need an XDP program on the peer"),
        "{xdp}"
    );
}

#[test]
fn long_lived_tcp_stream_and_icmp_port_unreachable() {
    long_lived_tcp_stream(Xdp::Off);
}

#[test]
fn xdp_long_lived_tcp_stream_and_icmp_port_unreachable() {
    long_lived_tcp_stream(Xdp::Native);
}

fn long_lived_tcp_stream(xdp: Xdp) {
    let tag = if xdp == Xdp::Off { "st" } else { "xst" };
    let mut lab = Lab::with_xdp(tag, xdp);
    web(&lab, "", &BOTH);
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    // One connection, many request/response rounds over a few seconds, while node-a's agent
    // crashes and restarts: the pinned links and conntrack keep the stream going.
    let stream = echo_stream(&c, format!("{NODE_A}:30080"), 200);
    std::thread::sleep(Duration::from_millis(300));
    lab.restart_agent(0);
    let rounds = stream
        .join()
        .expect("the stream survived the agent restart");
    assert_eq!(rounds, 200);
    // The new agent replaced the links: one tcx program per hook and interface again.
    let links = std::fs::read_dir(&lab.agents[0].pin)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("link_tc_"))
        .count();
    assert_eq!(links, 2, "link_tc_ingress_eth0 and link_tc_egress_eth0");
    // Nothing listens on 5999: the backend's ICMP port unreachable, translated back to the
    // frontend, fails the client's connected UDP socket with ECONNREFUSED.
    let mut refused = 0;
    for _ in 0..6 {
        match udp_whoami(&c, &format!("{NODE_A}:30054"), SHORT) {
            Err(111) => refused += 1,
            other => panic!("expected ECONNREFUSED, got {other:?}"),
        }
    }
    assert_eq!(refused, 6);
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(counters["tc_icmp_translated"] >= 6, "{counters:?}");
    if xdp == Xdp::Native {
        // The backends above are picked at random: make sure flows went to b0 once node-a
        // knows its next hop, which XDP then forwards itself.
        let mut remote = 0;
        for _ in 0..40 {
            let (name, _) = tcp_whoami(&c, &format!("{NODE_A}:30080"), T).unwrap();
            remote += (name == "b0") as u32;
            if remote >= 3 {
                break;
            }
        }
        assert!(remote >= 3, "connections to b0 through node-a");
    }
    assert_xdp_worked(&lab, xdp);
}

#[test]
fn local_policy_keeps_client_ip_drops_without_local_endpoint_and_health_checks() {
    let mut lab = Lab::new("lo");
    web(
        &lab,
        "  externalTrafficPolicy: Local\n  healthCheckNodePort: 31000\n",
        &[(POD_B0, "node-b")],
    );
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    // node-b has the endpoint: the backend sees the client's own address.
    for _ in 0..4 {
        let (name, peer) = tcp_whoami(&c, &format!("{NODE_B}:30080"), T).unwrap();
        assert_eq!(name, "b0");
        assert_eq!(ip_of(&peer), CLIENT);
        let (name, peer) = udp_whoami(&c, &format!("{NODE_B}:30053"), T).unwrap();
        assert_eq!(name, "b0");
        assert_eq!(ip_of(&peer), CLIENT);
    }
    // node-a has none: dropped (a timeout, not a refusal).
    let e = tcp_whoami(&c, &format!("{NODE_A}:30080"), SHORT).unwrap_err();
    assert!(e.contains("timed out") || e.contains("os error 110"), "{e}");
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(
        counters["tc_dropped_no_local_endpoints"] > 0,
        "{counters:?}"
    );
    // Health checks as kube-proxy's: 503 with 0 on node-a, 200 with 1 on node-b.
    let curl = |node: &str| {
        let out = lab
            .client
            .exec(
                "curl",
                &[
                    "-s",
                    "-m",
                    "3",
                    "-w",
                    "\n%{http_code}",
                    &format!("http://{node}:31000/"),
                ],
            )
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let a = curl(NODE_A);
    let (body, code) = a.rsplit_once('\n').unwrap();
    assert_eq!(code, "503", "{a}");
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["service"]["namespace"], "default");
    assert_eq!(v["service"]["name"], "web");
    assert_eq!(v["localEndpoints"], 0);
    let b = curl(NODE_B);
    let (body, code) = b.rsplit_once('\n').unwrap();
    assert_eq!(code, "200", "{b}");
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["localEndpoints"], 1);
}

#[test]
fn load_balancer_source_ranges_and_their_edits() {
    let mut lab = Lab::new("sr");
    web(
        &lab,
        &format!("  loadBalancerSourceRanges: [\"{CLIENT}/32\", \"not-a-cidr\"]\n"),
        &[(POD_A0, "node-a")],
    );
    lab.start_agent(0, &[]);
    let c = lab.client_path();
    let lb = format!("{LB_IP}:80");
    assert_eq!(tcp_whoami(&c, &lb, T).unwrap().0, "a0");
    assert!(
        lab.agents[0]
            .log()
            .contains("Service default/web: loadBalancerSourceRanges: \"not-a-cidr\""),
        "{}",
        lab.agents[0].log()
    );
    // Edit: the client is no longer listed; the LB IP drops it, the node port and the
    // external IP still serve it.
    let n = lab.agents[0].syncs();
    web(
        &lab,
        "  loadBalancerSourceRanges: [\"10.0.0.0/8\"]\n",
        &[(POD_A0, "node-a")],
    );
    lab.agents[0].wait_sync_after(n);
    assert!(tcp_whoami(&c, &lb, SHORT).is_err());
    assert_eq!(
        tcp_whoami(&c, &format!("{NODE_A}:30080"), T).unwrap().0,
        "a0"
    );
    assert_eq!(
        tcp_whoami(&c, &format!("{EXTERNAL_IP}:80"), T).unwrap().0,
        "a0"
    );
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(counters["tc_source_range_denied"] > 0, "{counters:?}");
    // Edit: an empty list allows everyone again.
    let n = lab.agents[0].syncs();
    web(&lab, "", &[(POD_A0, "node-a")]);
    lab.agents[0].wait_sync_after(n);
    assert_eq!(tcp_whoami(&c, &lb, T).unwrap().0, "a0");
}

#[test]
fn udp_zero_checksum_hairpin_and_bad_input() {
    let mut lab = Lab::new("hp");
    web(&lab, "", &BOTH);
    // Bad input next to it: an IPv4 LB IP on an IPv6-only Service, and a Service whose
    // source ranges are all invalid. Each is reported, and `web` keeps working.
    lab.write(
        "bad.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: v6only, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 'fd00:198:19::40'\n  ipFamilies: [IPv6]\n  ports: [{port: 80, nodePort: 30090}]\nstatus: {loadBalancer: {ingress: [{ip: 198.19.100.9}]}}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: badranges, namespace: default}\nspec:\n  type: LoadBalancer\n  clusterIP: 198.19.0.41\n  loadBalancerSourceRanges: ['300.1.2.3/8']\n  ports: [{port: 81, nodePort: 30091}]\nstatus: {loadBalancer: {ingress: [{ip: 198.19.100.10}]}}\n",
    );
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let log = lab.agents[0].log();
    assert!(
        log.contains("Service default/v6only") && log.contains("198.19.100.9"),
        "{log}"
    );
    assert!(
        log.contains("Service default/badranges: loadBalancerSourceRanges"),
        "{log}"
    );
    let c = lab.client_path();
    // UDP without checksum, through a local backend and through SNAT to the other node.
    let mut names = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let name = udp_whoami_no_csum(&c, &format!("{NODE_A}:30053"))
            .unwrap_or_else(|e| panic!("UDP without checksum: errno {e}"));
        names.insert(name);
    }
    assert_eq!(names.len(), 2, "{names:?}");
    assert_eq!(
        tcp_whoami(&c, &format!("{LB_IP}:80"), T).unwrap().0.len(),
        2
    );
    // Hairpin: pod a0 (in node-a's cgroup, as every pod of a node is) reaches its own
    // Service through the node port of its node and the LB IP; sometimes itself.
    let a0 = lab.pods[0].path();
    let cg = lab.agents[0].cg.path().to_path_buf();
    let mut seen = std::collections::BTreeSet::new();
    for to in [format!("{NODE_A}:30080"), format!("{LB_IP}:80")] {
        let out = output_in(
            Some(&a0),
            Some(&cg),
            Command::new(NETPROBE).args(["tcp", "--to", &to, "--count", "12"]),
            Duration::from_secs(20),
        )
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["ok"], true, "hairpin to {to}: {text}");
            seen.insert(v["name"].as_str().unwrap().to_string());
        }
    }
    assert!(seen.contains("a0"), "a0 reached itself: {seen:?}");
}

#[test]
fn conntrack_stays_bounded_under_churn() {
    let mut lab = Lab::new("ch");
    web(&lab, "", &BOTH);
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    // 300 short TCP connections and 300 UDP flows (new source port each), bounded in time.
    let to: SocketAddr = format!("{NODE_A}:30080").parse().unwrap();
    let uto: SocketAddr = format!("{NODE_A}:30053").parse().unwrap();
    let start = Instant::now();
    let ok = in_netns(&c, move || {
        let mut ok = 0;
        for _ in 0..300 {
            if start.elapsed() > Duration::from_secs(30) {
                break;
            }
            if let Ok(s) = TcpStream::connect_timeout(&to, T) {
                s.set_read_timeout(Some(T)).unwrap();
                let mut l = String::new();
                if BufReader::new(&s).read_line(&mut l).is_ok() && !l.is_empty() {
                    ok += 1;
                }
            }
            let u = UdpSocket::bind("0.0.0.0:0").unwrap();
            u.set_read_timeout(Some(T)).unwrap();
            u.send_to(b"ping", uto).unwrap();
            let mut buf = [0u8; 64];
            if u.recv_from(&mut buf).is_ok() {
                ok += 1;
            }
        }
        ok
    })
    .unwrap();
    assert_eq!(ok, 600, "every connection and flow answered");
    // At most three entries per flow (original, SNAT stage, reply): the table holds what is
    // live and nothing else, and nothing failed.
    let entries = tc::conntrack_entries(&lab.agents[0].pin).unwrap();
    assert!(entries <= 3 * 600, "{entries} entries");
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert_eq!(counters["tc_conntrack_full"], 0, "{counters:?}");
    assert_eq!(counters["tc_snat_ports_exhausted"], 0, "{counters:?}");
    // A UDP source port the client's kernel hands out again within the flow timeout
    // continues the earlier flow: (almost) every attempt was a new flow.
    assert!(
        (580..=600).contains(&counters["tc_new_flow"]),
        "{counters:?}"
    );
}

#[test]
fn masquerade_all_and_cluster_ips_from_outside_the_cluster_cidr() {
    let mut lab = Lab::new("mq");
    web(&lab, "", &BOTH);
    lab.client
        .ip(&["route", "add", "198.19.0.0/24", "via", NODE_A])
        .unwrap();
    lab.start_agent(0, &["--masquerade-all", "--cluster-cidr", "198.18.0.0/22"]);
    lab.start_agent(1, &[]);
    assert!(
        lab.agents[0].log().contains("interface=br0"),
        "the pod-facing bridge gets the programs with --masquerade-all: {}",
        lab.agents[0].log()
    );
    let c = lab.client_path();
    // Every flow is masqueraded, to the local backend too; a cluster IP routed to the node
    // from outside the cluster CIDR is served and masqueraded as well.
    for fe in [format!("{NODE_A}:30080"), "198.19.0.30:80".to_string()] {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..16 {
            let (name, peer) =
                tcp_whoami(&c, &fe, T).unwrap_or_else(|e| panic!("TCP to {fe}: {e}"));
            assert_eq!(ip_of(&peer), NODE_A, "{fe} -> {name}");
            seen.insert(name);
        }
        assert_eq!(seen.len(), 2, "{fe}: {seen:?}");
        let (name, peer) = udp_whoami(&c, &fe.replace(":30080", ":30053").replace(":80", ":53"), T)
            .unwrap_or_else(|e| panic!("UDP to {fe}: errno {e}"));
        assert_eq!(ip_of(&peer), NODE_A, "{fe} -> {name} (UDP)");
    }
}

#[test]
fn fragmentation_needed_reaches_the_client_for_path_mtu_discovery() {
    let mut lab = Lab::new("pm");
    web(&lab, "", &[(POD_B0, "node-b")]);
    // node-b forwards to its pods over a 1200-byte link: a full-size DF segment from node-a
    // (SNAT, node-a -> b0) gets "fragmentation needed" back from node-b, which node-a must
    // translate for the client (quoting client -> node-a:30080), or the flow stalls.
    lab.nodes[1]
        .ip(&["link", "set", "br0", "mtu", "1200"])
        .unwrap();
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    let to: SocketAddr = format!("{NODE_A}:30080").parse().unwrap();
    large_line_comes_back(&lab, &c, to);
}

/// Sends a 6000-byte line over one TCP connection from the client namespace to `to` and
/// checks it comes back whole: full-size segments crossed a smaller MTU on the way to the
/// backend, so this works only when the ICMP error about it (fragmentation needed, packet
/// too big) reached the client translated, which node-a's counter confirms.
fn large_line_comes_back(lab: &Lab, client: &Path, to: SocketAddr) {
    assert_eq!(
        large_line_echo(client, to),
        Ok(3 + 6000),
        "the large line came back"
    );
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(counters["tc_icmp_translated"] > 0, "{counters:?}");
}

/// Sends a 6000-byte line over one TCP connection from the client namespace to `to`: the
/// length of the line that came back (the backend's name, a space, the line).
fn large_line_echo(client: &Path, to: SocketAddr) -> Result<usize, String> {
    in_netns(client, move || {
        let s = TcpStream::connect_timeout(&to, T).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        let mut name = String::new();
        r.read_line(&mut name).unwrap();
        let big = "x".repeat(6000);
        w.write_all(format!("{big}\n").as_bytes()).unwrap();
        let mut l = String::new();
        r.read_line(&mut l)
            .map(|_| l.trim().len())
            .map_err(|e| e.to_string())
    })
    .unwrap()
}

/// One TCP connection from the client namespace to `to`, in a thread: `rounds` lines sent
/// 10 ms apart, each checked as the backend echoes it (its name, then the line). The
/// thread's result is the number of rounds; it panics when the stream breaks.
fn echo_stream(client: &Path, to: String, rounds: usize) -> std::thread::JoinHandle<usize> {
    let to: SocketAddr = to.parse().unwrap();
    let client = client.to_path_buf();
    std::thread::spawn(move || {
        in_netns(&client, move || {
            let s = TcpStream::connect_timeout(&to, T).unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            let mut w = s.try_clone().unwrap();
            let mut r = BufReader::new(s);
            let mut name = String::new();
            r.read_line(&mut name).unwrap();
            let mut n = 0;
            for i in 0..rounds {
                w.write_all(format!("line-{i}\n").as_bytes()).unwrap();
                let mut l = String::new();
                r.read_line(&mut l).unwrap();
                assert_eq!(l.trim(), format!("{} line-{i}", name.trim()));
                n += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            n
        })
        .unwrap()
    })
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

// ---------------------------------------------------------------------------------------
// IPv6: the same lab made dual-stack by `Lab::add_ipv6`.
// ---------------------------------------------------------------------------------------
const EXTERNAL_IP6: &str = "fd00:199::7";
const LB_IP6: &str = "fd00:199::8";
const CLUSTER_IP6: &str = "fd00:198:19::30";
/// Dual-stack `default/web`: the ports of [`web`], cluster IPs, external IPs and LB IPs of
/// both families; IPv4 endpoints `v4` and IPv6 endpoints `v6` as (address, node).
fn dual(v4: &[(&str, &str)], v6: &[(&str, &str)]) -> Web {
    Web::new("198.19.0.30")
        .cluster_ip(CLUSTER_IP6)
        .ports(&LAB_PORTS)
        .spec(&format!(
            "  type: LoadBalancer\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n  externalIPs: [{EXTERNAL_IP}, '{EXTERNAL_IP6}']\n"
        ))
        .status(&format!(
            "status:\n  loadBalancer:\n    ingress: [{{ip: {LB_IP}}}, {{ip: '{LB_IP6}'}}]\n"
        ))
        .endpoints(on_nodes(v4))
        .endpoints(on_nodes(v6))
}

/// Writes [`dual`] with extra spec lines.
fn web_dual(lab: &Lab, spec_extra: &str, v4: &[(&str, &str)], v6: &[(&str, &str)]) {
    lab.write("web.yaml", &dual(v4, v6).spec(spec_extra).yaml());
}

const BOTH4: [(&str, &str); 2] = [(POD_A0, "node-a"), (POD_B0, "node-b")];
const BOTH6: [(&str, &str); 2] = [(POD_A06, "node-a"), (POD_B06, "node-b")];

/// `[addr]:port`.
fn v6(addr: &str, port: u16) -> String {
    format!("[{addr}]:{port}")
}

#[test]
fn ipv6_nodeport_external_and_lb_ips_with_snat_to_remote_backends() {
    let mut lab = Lab::new("n6");
    lab.add_ipv6();
    web_dual(&lab, "", &BOTH4, &BOTH6);
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    // Every exchange below also needs neighbour discovery through the programs on eth0.
    // A connected TCP or UDP socket only accepts replies from the address it connected to:
    // each success shows the client saw the frontend as the source.
    let fes = [
        v6(NODE_A6, 30080),
        v6(NODE_B6, 30080),
        v6(EXTERNAL_IP6, 80),
        v6(LB_IP6, 80),
    ];
    both_backends_with_snat_to_remote_ones(&c, &fes, [NODE_A6, NODE_B6], CLIENT6);
    // IPv4 next to it, in the same dual-stack lab.
    for _ in 0..8 {
        let (name, _) = tcp_whoami(&c, &format!("{NODE_A}:30080"), T).unwrap();
        assert!(name == "a0" || name == "b0");
    }
    // Hairpin over IPv6: pod a0 (in node-a's cgroup) reaches the node port and the LB IP
    // through the socket programs.
    let a0 = lab.pods[0].path();
    let cg = lab.agents[0].cg.path().to_path_buf();
    for to in [v6(NODE_A6, 30080), v6(LB_IP6, 80)] {
        let out = output_in(
            Some(&a0),
            Some(&cg),
            Command::new(NETPROBE).args(["tcp", "--to", &to, "--count", "6"]),
            Duration::from_secs(20),
        )
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["ok"], true, "hairpin to {to}: {text}");
        }
        assert_eq!(text.lines().count(), 6, "{text}");
    }
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(
        counters["tc_new_flow"] > 0 && counters["tc_snat"] > 0,
        "{counters:?}"
    );
    for k in [
        "tc_rewrite_failed",
        "tc_no_snat_address",
        "tc_conntrack_full",
    ] {
        assert_eq!(counters[k], 0, "{k}: {counters:?}");
    }
}

#[test]
fn ipv6_local_policy_keeps_the_client_address_and_drops_without_local_endpoint() {
    let mut lab = Lab::new("l6");
    lab.add_ipv6();
    web_dual(
        &lab,
        "  externalTrafficPolicy: Local\n",
        &[(POD_B0, "node-b")],
        &[(POD_B06, "node-b")],
    );
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    for _ in 0..4 {
        let (name, peer) = tcp_whoami(&c, &v6(NODE_B6, 30080), T).unwrap();
        assert_eq!((name.as_str(), ip_of(&peer).as_str()), ("b0", CLIENT6));
        let (name, peer) = udp_whoami(&c, &v6(NODE_B6, 30053), T).unwrap();
        assert_eq!((name.as_str(), ip_of(&peer).as_str()), ("b0", CLIENT6));
    }
    let e = tcp_whoami(&c, &v6(NODE_A6, 30080), SHORT).unwrap_err();
    assert!(e.contains("timed out") || e.contains("os error 110"), "{e}");
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(
        counters["tc_dropped_no_local_endpoints"] > 0,
        "{counters:?}"
    );
}

/// One TCP connect() from the client namespace: the errno it failed with (`None` when it
/// connected) and how long it took.
fn tcp_connect_errno(client: &Path, to: &str, timeout: Duration) -> (Option<i32>, Duration) {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(client, move || {
        let started = Instant::now();
        let r = TcpStream::connect_timeout(&to, timeout);
        (
            r.err().map(|e| e.raw_os_error().unwrap_or(-1)),
            started.elapsed(),
        )
    })
    .unwrap()
}

/// A Service without any endpoint, reached from outside the node, is rejected as
/// kube-proxy's nftables mode rejects it: the tc program answers with an ICMP / ICMPv6 port
/// unreachable from the frontend address, so a TCP client gets ECONNREFUSED at once (not a
/// timeout) and a UDP client gets ECONNREFUSED on its connected socket; IPv4 and IPv6, node
/// port, external IP and LB IP. A `Local` policy without endpoints anywhere is a Service
/// without endpoints too.
#[test]
fn services_without_endpoints_are_rejected_from_outside_in_both_families() {
    let mut lab = Lab::new("rj");
    lab.add_ipv6();
    // No EndpointSlice at all.
    lab.write(
        "web.yaml",
        &dual(&[], &[])
            .ports(&LAB_PORTS[..2])
            .spec("  externalTrafficPolicy: Local\n")
            .service_yaml(),
    );
    lab.start_agent(0, &[]);
    let c = lab.client_path();
    let fes = [
        (format!("{NODE_A}:30080"), format!("{NODE_A}:30053")),
        (format!("{EXTERNAL_IP}:80"), format!("{EXTERNAL_IP}:53")),
        (format!("{LB_IP}:80"), format!("{LB_IP}:53")),
        (v6(NODE_A6, 30080), v6(NODE_A6, 30053)),
        (v6(EXTERNAL_IP6, 80), v6(EXTERNAL_IP6, 53)),
        (v6(LB_IP6, 80), v6(LB_IP6, 53)),
    ];
    for (tcp, udp) in &fes {
        let (errno, took) = tcp_connect_errno(&c, tcp, Duration::from_secs(5));
        assert_eq!(
            errno,
            Some(111),
            "TCP to {tcp}: ECONNREFUSED (took {took:?})"
        );
        // Refused, not timed out (5 s); the first IPv6 exchange also waits for neighbour
        // discovery (about 1 s in this lab).
        assert!(
            took < Duration::from_secs(3),
            "TCP to {tcp}: refused at once, took {took:?}"
        );
        assert_eq!(
            udp_whoami(&c, udp, T),
            Err(111),
            "UDP to {udp}: the ICMP error fails the connected socket"
        );
    }
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(
        counters["tc_rejected_no_endpoints"] >= 2 * fes.len() as u64,
        "{counters:?}"
    );
    assert_eq!(counters["tc_dropped_no_local_endpoints"], 0, "{counters:?}");
    assert_eq!(counters["tc_new_flow"], 0, "{counters:?}");
}

#[test]
fn ipv6_load_balancer_source_ranges() {
    let mut lab = Lab::new("s6");
    lab.add_ipv6();
    web_dual(
        &lab,
        &format!("  loadBalancerSourceRanges: ['{CLIENT6}/128', '198.51.100.0/24']\n"),
        &[(POD_A0, "node-a")],
        &[(POD_A06, "node-a")],
    );
    lab.start_agent(0, &[]);
    let c = lab.client_path();
    let lb6 = v6(LB_IP6, 80);
    assert_eq!(tcp_whoami(&c, &lb6, T).unwrap().0, "a0");
    // The IPv4 LB IP admits only its IPv4 range, which the client is not in.
    assert!(tcp_whoami(&c, &format!("{LB_IP}:80"), SHORT).is_err());
    // Edit: an IPv6 range without the client. The IPv6 LB IP drops it; the node port and
    // the external IP (not subject to source ranges) still serve it.
    let n = lab.agents[0].syncs();
    web_dual(
        &lab,
        "  loadBalancerSourceRanges: ['fd00:dead::/64']\n",
        &[(POD_A0, "node-a")],
        &[(POD_A06, "node-a")],
    );
    lab.agents[0].wait_sync_after(n);
    assert!(tcp_whoami(&c, &lb6, SHORT).is_err());
    assert_eq!(tcp_whoami(&c, &v6(NODE_A6, 30080), T).unwrap().0, "a0");
    assert_eq!(tcp_whoami(&c, &v6(EXTERNAL_IP6, 80), T).unwrap().0, "a0");
    // The IPv4 LB IP has no range of its family left: open again.
    assert_eq!(tcp_whoami(&c, &format!("{LB_IP}:80"), T).unwrap().0, "a0");
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(counters["tc_source_range_denied"] >= 2, "{counters:?}");
}

#[test]
fn ipv6_packet_too_big_and_port_unreachable_reach_the_client() {
    let mut lab = Lab::new("p6");
    lab.add_ipv6();
    web_dual(&lab, "", &[(POD_B0, "node-b")], &[(POD_B06, "node-b")]);
    // node-b forwards to its pods over a 1280-byte link (the IPv6 minimum): a full-size
    // segment from node-a (SNAT, node-a -> b0) gets ICMPv6 packet too big back from
    // node-b, which node-a must translate for the client (quoting client -> node-a:30080);
    // IPv6 routers never fragment, so without it the flow stalls.
    lab.nodes[1]
        .ip(&["link", "set", "br0", "mtu", "1280"])
        .unwrap();
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    let to: SocketAddr = v6(NODE_A6, 30080).parse().unwrap();
    large_line_comes_back(&lab, &c, to);
    // Nothing listens on 5999: b0's ICMPv6 port unreachable, translated back to the
    // frontend, fails the client's connected UDP socket with ECONNREFUSED. Through node-a
    // (SNAT: translated at node-a's ingress) and node-b (local backend: at its egress).
    for (node, agent) in [(NODE_A6, 0), (NODE_B6, 1)] {
        let before = tc::counters(&lab.agents[agent].pin).unwrap()["tc_icmp_translated"];
        for _ in 0..4 {
            match udp_whoami(&c, &v6(node, 30054), SHORT) {
                Err(111) => {}
                other => panic!("{node}: expected ECONNREFUSED, got {other:?}"),
            }
        }
        let after = tc::counters(&lab.agents[agent].pin).unwrap()["tc_icmp_translated"];
        assert!(after >= before + 4, "{node}: {before} -> {after}");
    }
}

#[test]
fn ipv6_cluster_cidr_and_masquerade_all() {
    let mut lab = Lab::new("m6");
    lab.add_ipv6();
    web_dual(&lab, "", &BOTH4, &BOTH6);
    lab.client
        .ip(&["-6", "route", "add", "fd00:198:19::/64", "via", NODE_A6])
        .unwrap();
    // node-a: a dual-stack cluster CIDR holding both pod subnets but not the client
    // (fd00:100::/64 is outside fd00::/24); node-b: --masquerade-all.
    lab.start_agent(0, &["--cluster-cidr", "198.18.0.0/22,fd00::/24"]);
    lab.start_agent(1, &["--masquerade-all"]);
    let c = lab.client_path();
    let mut cases = Vec::new();
    for _ in 0..16 {
        // The cluster IP from outside the cluster CIDR: masqueraded, local backend too.
        let (name, peer) = tcp_whoami(&c, &v6(CLUSTER_IP6, 80), T).unwrap();
        assert_eq!(ip_of(&peer), NODE_A6, "cluster IP -> {name}");
        cases.push(name);
        // A node port on node-a: no masquerade for the local backend.
        let (name, peer) = tcp_whoami(&c, &v6(NODE_A6, 30080), T).unwrap();
        let want = if name == "a0" { CLIENT6 } else { NODE_A6 };
        assert_eq!(ip_of(&peer), want, "node-a node port -> {name}");
        // node-b masquerades everything, its local backend too.
        let (name, peer) = tcp_whoami(&c, &v6(NODE_B6, 30080), T).unwrap();
        assert_eq!(ip_of(&peer), NODE_B6, "node-b node port -> {name}");
        cases.push(name);
    }
    assert!(
        cases.iter().any(|n| n == "a0") && cases.iter().any(|n| n == "b0"),
        "{cases:?}"
    );
    let (_, peer) = udp_whoami(&c, &v6(CLUSTER_IP6, 53), T).unwrap();
    assert_eq!(ip_of(&peer), NODE_A6);
}

#[test]
fn ipv6_without_a_node_ipv6_address_snat_drops_and_local_backends_work() {
    let mut lab = Lab::new("x6");
    lab.add_ipv6();
    // node-a's wire interface loses its IPv6 address and keeps a link-local one only (no
    // SNAT address of the family there); the client reaches the IPv6 LB IP through that
    // link-local address, and node-a the client through an on-link route.
    let a = &lab.nodes[0];
    a.ip(&["-6", "addr", "del", &format!("{NODE_A6}/64"), "dev", "eth0"])
        .unwrap();
    a.ip(&["-6", "addr", "add", "fe80::a/64", "dev", "eth0", "nodad"])
        .unwrap();
    a.ip(&["-6", "route", "replace", "fd00:100::/64", "dev", "eth0"])
        .unwrap();
    lab.client
        .ip(&[
            "-6",
            "route",
            "replace",
            "fd00:199::/64",
            "via",
            "fe80::a",
            "dev",
            "eth0",
        ])
        .unwrap();
    let lb6 = v6(LB_IP6, 80);
    // A remote backend needs SNAT: dropped and counted.
    web_dual(&lab, "", &BOTH4, &[(POD_B06, "node-b")]);
    lab.start_agent(0, &[]);
    let c = lab.client_path();
    assert!(tcp_whoami(&c, &lb6, SHORT).is_err());
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(counters["tc_no_snat_address"] > 0, "{counters:?}");
    // A local backend keeps the client address: no SNAT address needed.
    let n = lab.agents[0].syncs();
    web_dual(&lab, "", &BOTH4, &[(POD_A06, "node-a")]);
    lab.agents[0].wait_sync_after(n);
    let (name, peer) = tcp_whoami(&c, &lb6, T).unwrap();
    assert_eq!((name.as_str(), ip_of(&peer).as_str()), ("a0", CLIENT6));
}

#[test]
fn ipv6_time_exceeded_reaches_the_client() {
    let mut lab = Lab::new("t6");
    lab.add_ipv6();
    web_dual(&lab, "", &[(POD_B0, "node-b")], &[(POD_B06, "node-b")]);
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    // Hop limit 2: node-a forwards the (DNATed, SNATed) datagram with 1 left, node-b cannot
    // forward it to b0 and sends ICMPv6 time exceeded to node-a's address, which node-a
    // translates for the client (quoting client -> node-a:30053). A connected socket with
    // IPV6_RECVERR reports it as EHOSTUNREACH.
    let to: SocketAddr = v6(NODE_A6, 30053).parse().unwrap();
    let r = in_netns(&c, move || {
        use std::os::fd::AsRawFd;
        let s = UdpSocket::bind("[::]:0").unwrap();
        let fd = s.as_raw_fd();
        for (opt, v) in [(libc::IPV6_UNICAST_HOPS, 2), (libc::IPV6_RECVERR, 1)] {
            let v: libc::c_int = v;
            // SAFETY: setsockopt on our socket with an int.
            let r = unsafe {
                libc::setsockopt(
                    fd,
                    libc::IPPROTO_IPV6,
                    opt,
                    &v as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as u32,
                )
            };
            assert_eq!(r, 0, "setsockopt {opt}");
        }
        s.connect(to).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.send(b"whoami").unwrap();
        let mut buf = [0u8; 512];
        s.recv(&mut buf).map_err(|e| e.raw_os_error().unwrap_or(-1))
    })
    .unwrap();
    assert_eq!(r.map(|_| ()), Err(libc::EHOSTUNREACH), "time exceeded");
    let counters = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(counters["tc_icmp_translated"] > 0, "{counters:?}");
    // With the default hop limit the same frontend answers.
    assert_eq!(udp_whoami(&c, &v6(NODE_A6, 30053), T).unwrap().0, "b0");
}

#[test]
fn ipv6_only_local_endpoints_get_the_pod_facing_interface_with_masquerade_all() {
    let mut lab = Lab::new("o6");
    lab.add_ipv6();
    // No IPv4 endpoint at all: node-b finds its pod-facing bridge from the IPv6 routes
    // (/proc/net/ipv6_route), where the masqueraded flows to b0 get their SNAT stage and
    // their replies.
    web_dual(&lab, "", &[], &[(POD_B06, "node-b")]);
    lab.start_agent(1, &["--masquerade-all"]);
    assert!(
        lab.agents[0].log().contains("interface=br0"),
        "{}",
        lab.agents[0].log()
    );
    let c = lab.client_path();
    for _ in 0..4 {
        let (name, peer) = tcp_whoami(&c, &v6(NODE_B6, 30080), T).unwrap();
        assert_eq!((name.as_str(), ip_of(&peer).as_str()), ("b0", NODE_B6));
        let (name, peer) = udp_whoami(&c, &v6(NODE_B6, 30053), T).unwrap();
        assert_eq!((name.as_str(), ip_of(&peer).as_str()), ("b0", NODE_B6));
    }
}

/// `healthCheckNodePort` answers on the node's IPv6 address too (the server listens on
/// `[::]` dual-stack), and a port busy at start-up is served once freed, by the periodic
/// resync alone (no object changes meanwhile).
#[test]
fn health_check_node_port_answers_on_ipv6_and_is_retried_after_a_busy_port() {
    let mut lab = Lab::new("h6");
    lab.add_ipv6();
    web_dual(
        &lab,
        "  externalTrafficPolicy: Local\n  healthCheckNodePort: 31000\n",
        &[(POD_B0, "node-b")],
        &[(POD_B06, "node-b")],
    );
    // Something else holds 31000 on node-b when its agent starts.
    let blocker = in_netns(&lab.nodes[1].path(), || {
        std::net::TcpListener::bind("0.0.0.0:31000")
    })
    .unwrap()
    .unwrap();
    lab.start_agent(0, &[]);
    lab.start_agent(1, &["--sync-period", "1s"]);
    let busy = "Service default/web: healthCheckNodePort 31000: cannot listen";
    let start = Instant::now();
    while !lab.agents[1].log().contains(busy) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "busy port not reported; log:\n{}",
            lab.agents[1].log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Status code and body of one health check from the client (curl bounded by -m).
    let check = |url: &str| -> (String, serde_json::Value) {
        let out = lab
            .client
            .exec(
                "curl",
                &["-s", "-g", "-m", "3", "-w", "\n%{http_code}", url],
            )
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        (
            code.to_string(),
            serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
        )
    };
    // node-a (no local endpoint): 503 with 0 over IPv6 and IPv4.
    for url in [
        format!("http://[{NODE_A6}]:31000/"),
        format!("http://{NODE_A}:31000/healthz"),
    ] {
        let (code, v) = check(&url);
        assert_eq!(code, "503", "{url}: {v}");
        assert_eq!(v["service"]["name"], "web", "{url}");
        assert_eq!(v["localEndpoints"], 0, "{url}");
    }
    // node-b: the port is freed; the next resyncs (every 1 s) bind it.
    drop(blocker);
    let start = Instant::now();
    loop {
        let (code, v) = check(&format!("http://[{NODE_B6}]:31000/"));
        if code == "200" {
            assert_eq!(v["localEndpoints"], 2, "{v}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "node-b's health check not served after the port was freed ({code}); log:\n{}",
            lab.agents[1].log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, v) = check(&format!("http://{NODE_B}:31000/"));
    assert_eq!(code, "200", "{v}");
    let log = lab.agents[1].log();
    assert_eq!(log.matches(busy).count(), 1, "reported once:\n{log}");
    assert!(log.contains("health-check server listening"), "{log}");
}

/// `ebpf-proxy monitor` on the tc path: one `flow-new` event per connection with the
/// client, frontend and backend (no SNAT under a Local policy), a `flow-drop` with its
/// reason on the node without a local endpoint, and the flows' ends.
#[test]
fn monitor_shows_tc_flows_drops_and_flow_ends() {
    use common::MonitorRun;
    let mut lab = Lab::new("mon");
    web(
        &lab,
        "  externalTrafficPolicy: Local\n  healthCheckNodePort: 31000\n",
        &[(POD_B0, "node-b")],
    );
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    let mon_a = MonitorRun::start(&lab.agents[0].pin, &[]);
    let mon_b = MonitorRun::start(&lab.agents[1].pin, &[]);
    for _ in 0..2 {
        let (name, peer) = tcp_whoami(&c, &format!("{NODE_B}:30080"), T).unwrap();
        assert_eq!(name, "b0");
        assert_eq!(ip_of(&peer), CLIENT);
    }
    assert!(udp_whoami(&c, &format!("{NODE_A}:30053"), SHORT).is_err());
    let a = mon_a.stop();
    let b = mon_b.stop();

    let new: Vec<&serde_json::Value> = of_type(&b, "flow-new");
    assert_eq!(new.len(), 2, "{b:#?}");
    for e in &new {
        assert_eq!(e["frontend"], format!("{NODE_B}:30080"), "{e}");
        assert_eq!(e["backend"], format!("{POD_B0}:8080"), "{e}");
        assert_eq!(e["protocol"], "TCP");
        assert_eq!(e["hook"], "tc-ingress");
        assert_eq!(e["service"], "default/web:http/TCP/v4/ingress", "{e}");
        assert!(e["nat"].is_null(), "Local policy: no SNAT: {e}");
        assert!(
            e["client"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{CLIENT}:")),
            "{e}"
        );
    }
    assert_ne!(new[0]["client"], new[1]["client"], "two connections");
    let ends: Vec<&serde_json::Value> = of_type(&b, "flow-end");
    assert_eq!(ends.len(), 2, "{b:#?}");
    for e in &ends {
        let involves_client = [&e["client"], &e["frontend"]]
            .iter()
            .any(|v| v.as_str().unwrap().starts_with(&format!("{CLIENT}:")));
        assert!(involves_client, "{e}");
    }

    let drops: Vec<&serde_json::Value> = of_type(&a, "flow-drop");
    assert!(!drops.is_empty(), "{a:#?}");
    for e in &drops {
        assert_eq!(e["reason"], "no-local-endpoints", "{e}");
        assert_eq!(e["frontend"], format!("{NODE_A}:30053"), "{e}");
        assert_eq!(e["protocol"], "UDP");
        assert!(e["backend"].is_null(), "{e}");
        assert!(
            e["client"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{CLIENT}:")),
            "{e}"
        );
    }
    assert!(a.iter().all(|e| e["type"] == "flow-drop"), "{a:#?}");
}

// ---------------------------------------------------------------------------------------
// Direct server return
// ---------------------------------------------------------------------------------------

/// `tcpdump` on a node's `eth0`, one line per IP packet to or from an address, killed on
/// drop.
struct Capture {
    child: Option<ChildGuard>,
    out: PathBuf,
}

impl Capture {
    /// Starts capturing on node `node`'s `eth0` the packets to or from `host` (`ip` or
    /// `ip6` by its family); returns once tcpdump listens (bounded).
    fn start(lab: &Lab, node: usize, host: &str, name: &str) -> Capture {
        let out = lab.manifests.path().with_extension(format!("{name}.cap"));
        let err = lab
            .manifests
            .path()
            .with_extension(format!("{name}.cap.err"));
        let family = if host.contains(':') { "ip6" } else { "ip" };
        let child = lab.nodes[node]
            .spawn(
                None,
                Command::new("tcpdump")
                    .args(["-i", "eth0", "-n", "-l", "--immediate-mode"])
                    .arg(format!("{family} host {host}"))
                    .stdout(std::fs::File::create(&out).unwrap())
                    .stderr(std::fs::File::create(&err).unwrap()),
            )
            .expect("tcpdump");
        let start = Instant::now();
        while !std::fs::read_to_string(&err)
            .unwrap_or_default()
            .contains("listening on")
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "tcpdump did not start: {}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Capture {
            child: Some(child),
            out,
        }
    }

    /// Stops the capture: the lines it printed.
    fn stop(&mut self) -> Vec<String> {
        std::thread::sleep(Duration::from_millis(300));
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }
}

/// Lines of a capture whose packet goes to `host` (tcpdump -n: `src.port > dst.port:`).
fn to_host(lines: &[String], host: &str) -> usize {
    lines
        .iter()
        .filter(|l| l.contains(&format!("> {host}.")))
        .count()
}

/// Lines of a capture whose packet comes from `host`.
fn from_host(lines: &[String], host: &str) -> usize {
    lines
        .iter()
        .filter(|l| l.contains(&format!(" {host}.")) && !l.contains(&format!("> {host}.")))
        .count()
}

/// Direct server return, IPv4, with the backend on node-b only, so every flow entering
/// node-a is forwarded encapsulated: the backend sees the client's address for TCP and UDP
/// to the node port, the external IP and the LB IP; captures show requests but no reply on
/// node-a's interface and the replies leaving node-b; a 6000-byte line crosses the
/// encapsulation whole (the SYN-ACK's MSS was lowered); a UDP datagram that fills the wire's
/// MTU gets "fragmentation needed" naming the MTU left after the outer header, which the
/// client's stack applies; a TCP stream survives a restart of each agent.
#[test]
fn dsr_replies_bypass_the_entry_node_and_mtu_and_restarts_hold() {
    let mut lab = Lab::new("dsr");
    web(&lab, "", &[(POD_B0, "node-b")]);
    lab.start_agent(0, Mode::Dsr.flags());
    lab.start_agent(1, Mode::Dsr.flags());
    let c = lab.client_path();
    let mut cap_a = Capture::start(&lab, 0, CLIENT, "a");
    let mut cap_b = Capture::start(&lab, 1, CLIENT, "b");
    for fe in [
        format!("{NODE_A}:30080"),
        format!("{EXTERNAL_IP}:80"),
        format!("{LB_IP}:80"),
    ] {
        for _ in 0..4 {
            let (name, peer) =
                tcp_whoami(&c, &fe, T).unwrap_or_else(|e| panic!("TCP to {fe}: {e}"));
            assert_eq!(
                (name.as_str(), ip_of(&peer).as_str()),
                ("b0", CLIENT),
                "{fe}"
            );
        }
        let ufe = fe.replace(":30080", ":30053").replace(":80", ":53");
        for _ in 0..4 {
            let (name, peer) =
                udp_whoami(&c, &ufe, T).unwrap_or_else(|e| panic!("UDP to {ufe}: errno {e}"));
            assert_eq!(
                (name.as_str(), ip_of(&peer).as_str()),
                ("b0", CLIENT),
                "{ufe}"
            );
        }
    }
    let to: SocketAddr = format!("{NODE_A}:30080").parse().unwrap();
    assert_eq!(
        large_line_echo(&c, to),
        Ok(3 + 6000),
        "the large line came back"
    );
    // Nothing listens on b0:5999: b0's port unreachable, translated on node-b (from the
    // frontend, quoting the client's datagram to it), fails the client's socket.
    for _ in 0..3 {
        assert_eq!(
            udp_whoami(&c, &format!("{NODE_A}:30054"), SHORT),
            Err(libc::ECONNREFUSED)
        );
    }
    let a = cap_a.stop();
    let b = cap_b.stop();
    assert!(from_host(&a, CLIENT) > 0, "node-a saw the requests: {a:#?}");
    assert_eq!(to_host(&a, CLIENT), 0, "no reply left node-a: {a:#?}");
    assert!(
        to_host(&b, CLIENT) > 0,
        "node-b answered the client itself: {b:#?}"
    );
    let ca = tc::counters(&lab.agents[0].pin).unwrap();
    let cb = tc::counters(&lab.agents[1].pin).unwrap();
    assert!(
        ca["tc_dsr_encapsulated"] > 0 && ca["tc_snat"] == 0,
        "{ca:?}"
    );
    assert!(
        cb["tc_dsr_decapsulated"] > 0 && cb["tc_dsr_unknown"] == 0,
        "{cb:?}"
    );
    assert!(cb["tc_icmp_translated"] >= 3, "{cb:?}");
    assert_eq!(ca["tc_rewrite_failed"] + cb["tc_rewrite_failed"], 0);

    // Path MTU: 1472 bytes of UDP fill the wire's 1500; encapsulated they would not fit.
    let to: SocketAddr = format!("{NODE_A}:30053").parse().unwrap();
    let (first, then, mtu) = in_netns(&c, move || {
        use std::os::fd::AsRawFd;
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        set_int_opt(
            &s,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        );
        s.connect(to).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        s.send(&[b'x'; 1472]).unwrap();
        let mut buf = [0u8; 2048];
        let first = s.recv(&mut buf).map_err(|e| e.raw_os_error().unwrap_or(-1));
        // The route now knows the smaller MTU: a datagram that fits it gets its answer.
        let then = s
            .send(&[b'x'; 1452])
            .and_then(|_| s.recv(&mut buf))
            .map(|n| String::from_utf8_lossy(&buf[..n]).into_owned())
            .map_err(|e| e.raw_os_error().unwrap_or(-1));
        let mut mtu: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as u32;
        // SAFETY: getsockopt(IP_MTU) into an int on our connected socket.
        unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_IP,
                libc::IP_MTU,
                &mut mtu as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        (first.map(|_| ()), then, mtu)
    })
    .unwrap();
    assert_eq!(
        first,
        Err(libc::EMSGSIZE),
        "fragmentation needed reached the socket"
    );
    assert_eq!(mtu, 1480, "the MTU left after the outer header");
    assert!(
        then.as_deref().is_ok_and(|t| t.starts_with("b0")),
        "{then:?}"
    );
    let ca = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(ca["tc_dsr_too_big"] > 0, "{ca:?}");

    // A stream through node-a to b0 while node-a's agent, then node-b's, restarts.
    let stream = echo_stream(&c, format!("{NODE_A}:30080"), 300);
    std::thread::sleep(Duration::from_millis(300));
    lab.restart_agent(0);
    std::thread::sleep(Duration::from_millis(300));
    lab.restart_agent(1);
    let rounds = stream
        .join()
        .expect("the stream survived both agents' restarts");
    assert_eq!(rounds, 300);
}

/// The per-Service annotation, IPv4 and IPv6: `hybrid` on a Service while the agents run
/// the default (SNAT): TCP goes by direct server return (the backend sees the client), UDP
/// is source-NATed (it sees node-a); in IPv6 a 6000-byte line crosses the encapsulation
/// (the MSS lowered by the 40-byte outer header) and no TCP reply leaves node-a.
#[test]
fn dsr_hybrid_annotation_in_both_families() {
    let mut lab = Lab::new("dh");
    lab.add_ipv6();
    // The annotation, on the dual-stack Service.
    lab.write(
        "web.yaml",
        &dual(&[(POD_B0, "node-b")], &[(POD_B06, "node-b")])
            .annotation("ebpf-proxy.io/north-south-mode", "hybrid")
            .yaml(),
    );
    lab.start_agent(0, &[]);
    lab.start_agent(1, &[]);
    let c = lab.client_path();
    let mut cap = Capture::start(&lab, 0, CLIENT6, "a6");
    for (tcp, udp, client, node) in [
        (
            format!("{NODE_A}:30080"),
            format!("{NODE_A}:30053"),
            CLIENT,
            NODE_A,
        ),
        (v6(NODE_A6, 30080), v6(NODE_A6, 30053), CLIENT6, NODE_A6),
        (v6(LB_IP6, 80), v6(LB_IP6, 53), CLIENT6, NODE_A6),
    ] {
        for _ in 0..3 {
            let (name, peer) = tcp_whoami(&c, &tcp, T).unwrap_or_else(|e| panic!("TCP {tcp}: {e}"));
            assert_eq!(
                (name.as_str(), ip_of(&peer).as_str()),
                ("b0", client),
                "{tcp}"
            );
            let (name, peer) =
                udp_whoami(&c, &udp, T).unwrap_or_else(|e| panic!("UDP {udp}: errno {e}"));
            assert_eq!(
                (name.as_str(), ip_of(&peer).as_str()),
                ("b0", node),
                "{udp}"
            );
        }
    }
    let to: SocketAddr = v6(NODE_A6, 30080).parse().unwrap();
    assert_eq!(
        large_line_echo(&c, to),
        Ok(3 + 6000),
        "the large line came back"
    );
    let lines = cap.stop();
    let tcp_replies = lines
        .iter()
        .filter(|l| l.contains(&format!("> {CLIENT6}.")) && l.contains("Flags"))
        .count();
    assert_eq!(tcp_replies, 0, "no TCP reply left node-a: {lines:#?}");
    let ca = tc::counters(&lab.agents[0].pin).unwrap();
    assert!(ca["tc_dsr_encapsulated"] > 0 && ca["tc_snat"] > 0, "{ca:?}");
}
