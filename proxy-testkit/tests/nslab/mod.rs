//! The two-node north-south lab: an external client and two nodes on a wire, a pod with a
//! server behind each node, and the real agent per node inside the node's namespace. Used
//! by the north-south scenario files (`tests/scenarios/north-south/`, through
//! `script::northsouth`) and by the tests that stay code (`north_south.rs`).
//!
//! Topology (every piece is a namespace created here, removed on drop, also on panic):
//!
//! ```text
//!   client 198.18.100.100 ─┐
//!   node-a 198.18.100.1 ───┼─ bridge wire0 (namespace "w")
//!   node-b 198.18.100.2 ───┘
//!   node-a: br0 198.18.1.1/24 ── pod a0 198.18.1.10
//!   node-b: br0 198.18.2.1/24 ── pod b0 198.18.2.10
//! ```
//!
//! The client routes 198.19.100.0/24 (external and LB IPs) through node-a; the nodes route
//! each other's pod subnet. Each node runs its own agent *inside its namespace* (so the
//! interface auto-selection finds its `eth0` from the Node object's address), with its own
//! child cgroup and pin directory. Nothing touches the root namespace or root cgroup.
//!
//! [`Lab::add_ipv6`] makes the same topology dual-stack. An XDP lab ([`Xdp::Native`]) runs
//! both agents with `--xdp native` (veth has native XDP); its wire's ports run a
//! pass-through XDP program, without which a veth leaves frames sent to it with `XDP_TX`
//! waiting in its ring, and every lab interface sends complete checksums (a physical wire's
//! frames; XDP cannot see a veth's partial ones).

#![allow(dead_code)]

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::common::{self, AGENT, BPFFS, NETPROBE};
use proxy_testkit::testbed::{
    ChildGuard, Netns, TestCgroup, Wire, ensure_bpffs, in_netns, is_root,
};
use proxy_userspace::datapath::loader;

pub const NODE_A: &str = "198.18.100.1";
pub const NODE_B: &str = "198.18.100.2";
pub const CLIENT: &str = "198.18.100.100";
pub const POD_A0: &str = "198.18.1.10";
pub const POD_B0: &str = "198.18.2.10";
pub const EXTERNAL_IP: &str = "198.19.100.7";
pub const LB_IP: &str = "198.19.100.8";

pub const NODE_A6: &str = "fd00:100::1";
pub const NODE_B6: &str = "fd00:100::2";
pub const CLIENT6: &str = "fd00:100::100";
pub const POD_A06: &str = "fd00:1::10";
pub const POD_B06: &str = "fd00:2::10";

/// The timeout of an exchange that must succeed.
pub const T: Duration = Duration::from_secs(2);
/// The timeout of an exchange expected to fail.
pub const SHORT: Duration = Duration::from_millis(700);

/// An agent in a node namespace: killed, then its pins removed, on drop.
pub struct Agent {
    pub child: Option<ChildGuard>,
    pub pin: PathBuf,
    pub log: PathBuf,
    pub cg: TestCgroup,
    /// Node index and extra flags, for a restart.
    pub node: usize,
    pub extra: Vec<String>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
        let _ = loader::cleanup(&self.pin);
    }
}

impl Agent {
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn syncs(&self) -> usize {
        common::syncs(&self.log())
    }

    /// Waits (bounded) until the log has more than `n` syncs.
    pub fn wait_sync_after(&self, n: usize) {
        let start = Instant::now();
        while self.syncs() <= n {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "agent did not sync; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The lab: namespaces (dropped pods first, the wire last), agents and servers.
pub struct Lab {
    pub tag: String,
    // Field order is drop order: processes, then namespaces.
    pub agents: Vec<Agent>,
    /// `--xdp native` for every agent.
    pub xdp: Xdp,
    pub servers: Vec<ChildGuard>,
    pub manifests: tempfile::TempDir,
    pub pods: Vec<Netns>,
    pub nodes: Vec<Netns>,
    pub client: Netns,
    /// The wire's pass-through XDP links (`--xdp native` labs), before the wire so they
    /// are released first.
    _wire_xdp: Vec<std::os::fd::OwnedFd>,
    wire: Wire,
}

/// Whether the agents of a lab run with `--xdp native`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Xdp {
    Off,
    Native,
}

impl Lab {
    /// The lab of most tests: the tcx programs alone, or, when `EBPF_PROXY_LAB_XDP=native`
    /// is set (an opt-in run of the whole file in XDP mode), with `--xdp native`.
    pub fn new(tag: &str) -> Lab {
        let xdp = match std::env::var("EBPF_PROXY_LAB_XDP").as_deref() {
            Ok("native") => Xdp::Native,
            _ => Xdp::Off,
        };
        Lab::with_xdp(tag, xdp)
    }

    /// The lab, its agents running with `--xdp native` when `xdp` says so.
    pub fn with_xdp(tag: &str, xdp: Xdp) -> Lab {
        assert!(is_root(), "the north-south tests need root");
        assert!(
            !loader::OBJECT.is_empty(),
            "built without the eBPF object: run `cargo xtask test`"
        );
        ensure_bpffs().expect("bpffs");
        let mut wire = Wire::new(&format!("ns4-{tag}")).expect("wire");
        let mut wire_xdp = Vec::new();
        let (a, pa) = wire
            .node("a", &[&format!("{NODE_A}/24")], "198.18.1.1/24")
            .unwrap();
        let (b, pb) = wire
            .node("b", &[&format!("{NODE_B}/24")], "198.18.2.1/24")
            .unwrap();
        let (client, pc) = wire.host("c", &[&format!("{CLIENT}/24")]).unwrap();
        if xdp == Xdp::Native {
            for (n, port) in [(&a, &pa), (&b, &pb), (&client, &pc)] {
                // XDP_TX'd frames reach the bridge promptly only through a port with an
                // XDP program; every sender completes its checksums, as on a physical wire.
                wire_xdp.push(wire.ns().attach_xdp_pass(port).unwrap());
                wire.ns().set_tx_checksum_off(port).unwrap();
                n.set_tx_checksum_off("eth0").unwrap();
            }
        }
        for (n, other_subnet, other_node) in
            [(&a, "198.18.2.0/24", NODE_B), (&b, "198.18.1.0/24", NODE_A)]
        {
            n.ip(&["route", "add", other_subnet, "via", other_node])
                .unwrap();
        }
        client
            .ip(&["route", "add", "198.19.100.0/24", "via", NODE_A])
            .unwrap();
        let mut lab = Lab {
            xdp,
            tag: tag.into(),
            agents: Vec::new(),
            servers: Vec::new(),
            manifests: tempfile::tempdir().unwrap(),
            pods: Vec::new(),
            nodes: vec![a, b],
            client,
            _wire_xdp: wire_xdp,
            wire,
        };
        lab.add_pod(0, "a0", POD_A0, "198.18.1.1");
        lab.add_pod(1, "b0", POD_B0, "198.18.2.1");
        lab.write(
            "nodes.yaml",
            &format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\nstatus: {{addresses: [{{type: InternalIP, address: {NODE_A}}}]}}\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-b}}\nstatus: {{addresses: [{{type: InternalIP, address: {NODE_B}}}]}}\n"
            ),
        );
        lab
    }

    /// A pod behind node `node` (0 = a, 1 = b) serving its name on TCP 8080 and UDP 5353.
    pub fn add_pod(&mut self, node: usize, name: &str, addr: &str, gw: &str) {
        let n = &self.nodes[node];
        let pod = self.wire.pod(n, name, &format!("{addr}/24"), gw).unwrap();
        if self.xdp == Xdp::Native {
            pod.set_tx_checksum_off("eth0").unwrap();
            n.set_tx_checksum_off(&format!("v{name}")).unwrap();
        }
        let server = pod
            .spawn(
                None,
                Command::new(NETPROBE)
                    .args(["serve", "--name", name, "--tcp", ":8080", "--udp", ":5353"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            )
            .expect("server");
        self.servers.push(server);
        self.pods.push(pod);
    }

    pub fn write(&self, file: &str, text: &str) {
        let tmp = self.manifests.path().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.manifests.path().join(file)).unwrap();
    }

    /// Starts the agent of node `i` (0 = node-a) in its namespace; waits for its first sync
    /// and for the tc programs on its `eth0`.
    pub fn start_agent(&mut self, i: usize, extra: &[&str]) {
        self.spawn_node_agent(i, extra);
        wait_started(self.agents.last().expect("the agent"));
    }

    /// Starts the agent of node `i` as [`Lab::start_agent`] does, without waiting for it.
    pub fn spawn_node_agent(&mut self, i: usize, extra: &[&str]) {
        let node = ["node-a", "node-b"][i];
        let pin_dir = format!("ebpf-proxy-ns4-{}-{node}", self.tag);
        let pin = Path::new(BPFFS).join(&pin_dir);
        let _ = loader::cleanup(&pin);
        let cg = TestCgroup::create(&format!("ebpf-proxy-ns4-{}-{node}", self.tag)).unwrap();
        let log = self.manifests.path().with_extension(format!("{node}.log"));
        let child = self.spawn_agent(i, &cg, &log, extra);
        let agent = Agent {
            child: Some(child),
            pin,
            log,
            cg,
            node: i,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        self.agents.push(agent);
    }

    /// Kills agent `a` (SIGKILL, as a crash: the pinned data path stays) and starts it again
    /// on the same pin directory, which it adopts.
    pub fn restart_agent(&mut self, a: usize) {
        if let Some(mut c) = self.agents[a].child.take() {
            c.kill();
        }
        let (i, extra) = (self.agents[a].node, self.agents[a].extra.clone());
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let child = self.spawn_agent(i, &self.agents[a].cg, &self.agents[a].log, &extra);
        self.agents[a].child = Some(child);
        wait_started(&self.agents[a]);
    }

    pub fn spawn_agent(&self, i: usize, cg: &TestCgroup, log: &Path, extra: &[&str]) -> ChildGuard {
        let node = ["node-a", "node-b"][i];
        let pin_dir = format!("ebpf-proxy-ns4-{}-{node}", self.tag);
        let logf = std::fs::File::create(log).unwrap();
        self.nodes[i]
            .spawn(
                None,
                Command::new(AGENT)
                    .args(["run", "--manifests"])
                    .arg(self.manifests.path())
                    .arg("--cgroup-path")
                    .arg(cg.path())
                    .args(["--pin-dir", &pin_dir, "--hostname-override", node])
                    .args(["--healthz-bind-address", "127.0.0.1:0"])
                    .args(["--metrics-bind-address", "127.0.0.1:0"])
                    .args(["--status-bind-address", "127.0.0.1:0"])
                    .args(match self.xdp {
                        Xdp::Native => &["--xdp", "native", "--xdp-veth-peers-ready"][..],
                        Xdp::Off => &[],
                    })
                    .args(extra)
                    .stdout(Stdio::null())
                    .stderr(logf),
            )
            .expect("agent")
    }

    /// Makes the lab dual-stack, before any agent starts: ULA addresses on the wire
    /// (`fd00:100::/64`: node-a ::1, node-b ::2, client ::100) and the pod bridges
    /// (`fd00:1::/64` on node-a, `fd00:2::/64` on node-b, pods ::10 behind gateway ::1),
    /// IPv6 forwarding in the nodes, routes between the pod subnets, the client's route
    /// to the IPv6 external and LB IPs (`fd00:199::/64`) through node-a, and Node objects
    /// with both InternalIPs. Every address is added `nodad` (usable at once). The pods do
    /// not rate-limit ICMPv6 errors (port unreachable is asserted per datagram). The
    /// servers already listen on dual-stack sockets.
    pub fn add_ipv6(&mut self) {
        let addr = |n: &Netns, a: &str, dev: &str| {
            n.ip(&["-6", "addr", "add", a, "dev", dev, "nodad"])
                .unwrap();
        };
        for (n, a) in [
            (&self.nodes[0], NODE_A6),
            (&self.nodes[1], NODE_B6),
            (&self.client, CLIENT6),
        ] {
            addr(n, &format!("{a}/64"), "eth0");
        }
        for (i, gw, other, via) in [
            (0, "fd00:1::1/64", "fd00:2::/64", NODE_B6),
            (1, "fd00:2::1/64", "fd00:1::/64", NODE_A6),
        ] {
            let n = &self.nodes[i];
            n.sysctl("net/ipv6/conf/all/forwarding", "1").unwrap();
            addr(n, gw, "br0");
            n.ip(&["-6", "route", "add", other, "via", via]).unwrap();
        }
        for (i, (a, gw)) in [(POD_A06, "fd00:1::1"), (POD_B06, "fd00:2::1")]
            .into_iter()
            .enumerate()
        {
            let p = &self.pods[i];
            addr(p, &format!("{a}/64"), "eth0");
            p.ip(&["-6", "route", "add", "default", "via", gw]).unwrap();
            p.sysctl("net/ipv6/icmp/ratelimit", "0").unwrap();
        }
        self.client
            .ip(&["-6", "route", "add", "fd00:199::/64", "via", NODE_A6])
            .unwrap();
        self.write(
            "nodes.yaml",
            &format!(
                "apiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\nstatus: {{addresses: [{{type: InternalIP, address: {NODE_A}}}, {{type: InternalIP, address: '{NODE_A6}'}}]}}\n---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-b}}\nstatus: {{addresses: [{{type: InternalIP, address: {NODE_B}}}, {{type: InternalIP, address: '{NODE_B6}'}}]}}\n"
            ),
        );
    }

    pub fn client_path(&self) -> PathBuf {
        self.client.path()
    }
}

/// Waits (at most 20 s) until the agent synced and attached its tc programs.
pub fn wait_started(agent: &Agent) {
    let start = Instant::now();
    loop {
        let l = agent.log();
        if l.contains("sync done") && l.contains("north-south programs attached") {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "agent did not start; log:\n{l}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The IP of `peer` as a backend printed it (IPv4-mapped when the server socket is
/// dual-stack), as plain text.
pub fn ip_of(peer: &str) -> String {
    peer.parse::<SocketAddr>()
        .map(|a| a.ip().to_canonical().to_string())
        .unwrap_or_else(|_| panic!("not an address: {peer:?}"))
}

/// One TCP connection from the client namespace: the backend's name and the client
/// address the backend saw.
pub fn tcp_whoami(client: &Path, to: &str, timeout: Duration) -> Result<(String, String), String> {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(client, move || {
        let s = TcpStream::connect_timeout(&to, timeout).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(timeout)).unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        let mut name = String::new();
        r.read_line(&mut name).map_err(|e| e.to_string())?;
        w.write_all(b"whoami\n").map_err(|e| e.to_string())?;
        let mut line = String::new();
        r.read_line(&mut line).map_err(|e| e.to_string())?;
        let mut it = line.split_whitespace();
        let (n, peer) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
        Ok((n.to_string(), peer.to_string()))
    })
    .unwrap()
}

/// One UDP exchange on a connected socket from the client namespace (either family: the
/// socket is bound to the wildcard of `to`'s), on a socket `setup` prepared (socket options)
/// before it connects: the backend's name and the client address it saw, or the errno (111
/// for a translated ICMP port unreachable).
pub fn udp_whoami(
    client: &Path,
    to: &str,
    timeout: Duration,
    setup: impl FnOnce(&UdpSocket) + Send,
) -> Result<(String, String), i32> {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(client, move || {
        let s = UdpSocket::bind(if to.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }).unwrap();
        setup(&s);
        s.connect(to).unwrap();
        s.set_read_timeout(Some(timeout)).unwrap();
        s.send(b"whoami")
            .map_err(|e| e.raw_os_error().unwrap_or(-1))?;
        let mut buf = [0u8; 512];
        let n = s
            .recv(&mut buf)
            .map_err(|e| e.raw_os_error().unwrap_or(-1))?;
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        let mut it = text.split_whitespace();
        Ok((
            it.next().unwrap_or("").to_string(),
            it.next().unwrap_or("").to_string(),
        ))
    })
    .unwrap()
}

/// `setsockopt(level, name)` of an int on socket `s`; panics when refused.
pub fn set_int_opt(
    s: &impl std::os::fd::AsRawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) {
    // SAFETY: setsockopt on our own socket with an int of the right size.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            level,
            name,
            &value as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as u32,
        )
    };
    assert_eq!(r, 0, "setsockopt({level}, {name})");
}
