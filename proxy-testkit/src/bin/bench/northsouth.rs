//! North-south: NodePorts served to a client outside the cluster, with one node's
//! translation swapped between ebpf-proxy's tc programs, kube-proxy's nftables and iptables
//! rule sets, and none at all (plain routing to the pod, the floor), in one topology:
//!
//! ```text
//!   client 198.18.100.100 ─┐
//!   node-a 198.18.100.1 ───┼─ bridge wire0 (namespace epbns-w)
//!   node-b 198.18.100.2 ───┘
//!   node-a: br0 198.18.1.1/24 ── pod a0 198.18.1.10   (the local backend)
//!   node-b: br0 198.18.2.1/24 ── pod b0 198.18.2.10   (the remote backend)
//! ```
//!
//! Only node-a translates, except with DSR; ebpf-proxy runs three times: with its tc
//! programs alone, with `--xdp native` in front of them, and with `--north-south-mode dsr`
//! (direct server return) on node-a and on node-b, where a second agent decapsulates the
//! flows to b0 and answers the client straight from node-b. The wire's ports run a
//! pass-through XDP program and every interface sends complete checksums, in every case (a
//! veth needs both for frames that XDP sends back out; see `Netns::attach_xdp_pass`). Four
//! NodePort Services (`externalTrafficPolicy: Cluster`), one backend each: TCP 30080 →
//! a0:8080, TCP 30081 → b0:8080, UDP 30053 → a0:5353, UDP 30054 → b0:5353, next to N
//! ClusterIP Services with 10 synthetic endpoints each (the rest of a cluster, which
//! kube-proxy's rules walk or look up before they reach the node ports). A
//! flow to the remote backend leaves node-a source-NATed to node-a (both proxies), so its
//! replies come back through node-a; with DSR it leaves node-a IPIP-encapsulated to b0
//! (the client's packet unchanged inside), node-b decapsulates and translates it, and b0's
//! replies go from node-b to the client directly, with the node port as their source.
//! kube-proxy also masquerades flows to the local backend, ebpf-proxy keeps the client
//! address. The floor sends to the pod addresses, routed through node-a (replies from b0
//! come back straight from node-b).
//!
//! Measured per case: new TCP connections per second with one small request each (the
//! bench's client: connect, one line each way, close), and UDP request/reply exchanges per
//! second on one flow (32-byte datagrams, 32 in flight), each bounded by `--conn-secs` and a
//! count; for ebpf-proxy, the kernel's run count and run time of its tc programs (ns per
//! packet, packets per connection or exchange), node-b's too with DSR. After each DSR path,
//! node-a's counters must show the remote backend's flows encapsulated and none
//! source-NATed, and node-b's must show them decapsulated.
//!
//! Safety: namespaces `epbns-*`, the cgroups and pin directories `ebpf-proxy-bench-ns`
//! (node-a's agent) and `ebpf-proxy-bench-ns-b` (node-b's, DSR only), all removed on drop
//! (also on error, panic and Ctrl-C); nft and iptables-restore run only in node-a's
//! namespace; each agent runs inside its node's namespace (so its tc programs attach to that
//! node's interfaces only) with its cgroup programs on its own empty child cgroup; traffic
//! starts in the client namespace towards lab addresses only.

use std::collections::BTreeMap;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use proxy_testkit::kube_proxy_rules::{self as rules, Proto, Svc};
use proxy_testkit::testbed::{self, ChildGuard, Netns, TestCgroup};
use proxy_userspace::datapath::{loader, tc};

use crate::report::{Case, NODE_B_PREFIX, Results, Sample};
use crate::{ClientResult, Opts, PinGuard, check_stop, progstats};

const PREFIX: &str = "epbns";
const PIN_DIR: &str = "ebpf-proxy-bench-ns";
const CGROUP: &str = "ebpf-proxy-bench-ns";
/// node-b's agent (the DSR case): its pin directory and cgroup.
const PIN_DIR_B: &str = "ebpf-proxy-bench-ns-b";
const CGROUP_B: &str = "ebpf-proxy-bench-ns-b";
const CLIENT: &str = "198.18.100.100";
const NODE_A: &str = "198.18.100.1";
const NODE_B: &str = "198.18.100.2";
const POD_A0: &str = "198.18.1.10";
const POD_B0: &str = "198.18.2.10";
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
/// Datagrams in flight of the UDP client.
const UDP_WINDOW: usize = 32;
const WARMUP: usize = 200;

/// One measured path: protocol and backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NsPath {
    TcpLocal,
    TcpRemote,
    UdpLocal,
    UdpRemote,
}

impl NsPath {
    pub const ALL: [NsPath; 4] = [
        NsPath::TcpLocal,
        NsPath::TcpRemote,
        NsPath::UdpLocal,
        NsPath::UdpRemote,
    ];

    /// Metric-name part: `tcp_local`, ...
    pub fn key(self) -> &'static str {
        match self {
            NsPath::TcpLocal => "tcp_local",
            NsPath::TcpRemote => "tcp_remote",
            NsPath::UdpLocal => "udp_local",
            NsPath::UdpRemote => "udp_remote",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            NsPath::TcpLocal => "TCP, backend on the node",
            NsPath::TcpRemote => "TCP, backend on another node (SNAT or DSR)",
            NsPath::UdpLocal => "UDP, backend on the node",
            NsPath::UdpRemote => "UDP, backend on another node (SNAT or DSR)",
        }
    }

    pub fn is_tcp(self) -> bool {
        matches!(self, NsPath::TcpLocal | NsPath::TcpRemote)
    }

    fn remote(self) -> bool {
        matches!(self, NsPath::TcpRemote | NsPath::UdpRemote)
    }

    fn node_port(self) -> u16 {
        match self {
            NsPath::TcpLocal => 30080,
            NsPath::TcpRemote => 30081,
            NsPath::UdpLocal => 30053,
            NsPath::UdpRemote => 30054,
        }
    }

    /// The backend's name (what its server answers) and address.
    fn backend(self) -> (&'static str, &'static str) {
        if self.remote() {
            ("b0", POD_B0)
        } else {
            ("a0", POD_A0)
        }
    }

    /// Where the client sends: node-a's node port, or the pod itself (the floor).
    fn target(self, case: Case) -> String {
        let port = if self.is_tcp() { TCP_PORT } else { UDP_PORT };
        match case {
            Case::Direct => format!("{}:{port}", self.backend().1),
            _ => format!("{NODE_A}:{}", self.node_port()),
        }
    }

    /// The NodePort Service of this path (ClusterIP `rules::vip(n + index)`).
    fn service(self, n: usize) -> Svc {
        let i = NsPath::ALL.iter().position(|p| *p == self).unwrap();
        let (_, addr) = self.backend();
        Svc {
            name: format!("np-{}", self.key().replace('_', "-")),
            vip: rules::vip(n + i),
            endpoints: vec![(
                addr.parse().unwrap(),
                if self.is_tcp() { TCP_PORT } else { UDP_PORT },
            )],
            node_port: Some(self.node_port()),
            proto: if self.is_tcp() {
                Proto::Tcp
            } else {
                Proto::Udp
            },
        }
    }
}

/// The topology. Field order is drop order: processes, pins, scratch files, the cgroups,
/// then the namespaces (pods before the nodes, the wire last).
struct Topology {
    /// node-a's agent.
    agent: Option<ChildGuard>,
    /// node-b's agent (the DSR case only).
    agent_b: Option<ChildGuard>,
    servers: Vec<ChildGuard>,
    pins: PinGuard,
    pins_b: PinGuard,
    scratch: tempfile::TempDir,
    cg: TestCgroup,
    cg_b: TestCgroup,
    pods: Vec<Netns>,
    node_a: Netns,
    node_b: Netns,
    client: Netns,
    /// The wire's pass-through XDP links, released before the wire.
    _wire_xdp: Vec<std::os::fd::OwnedFd>,
    _wire: Netns,
}

fn ns(what: &str) -> Result<Netns> {
    Netns::create(&format!("{PREFIX}-{what}"))
}

impl Topology {
    fn new(me: &Path, out: &Path) -> Result<Topology> {
        let pin_guard = |dir: &str| {
            let pin = loader::pin_dir(Path::new(testbed::BPFFS_PATH), dir);
            // A leftover of a crashed run.
            let _ = loader::cleanup(&pin);
            PinGuard(pin)
        };
        let pins = pin_guard(PIN_DIR);
        let pins_b = pin_guard(PIN_DIR_B);
        let scratch = tempfile::Builder::new()
            .prefix("scratch-ns-")
            .tempdir_in(fs::canonicalize(out)?)?;
        let cg = TestCgroup::create(CGROUP)?;
        let cg_b = TestCgroup::create(CGROUP_B)?;
        let wire = ns("w")?;
        wire.ip(&[
            "link",
            "add",
            "wire0",
            "type",
            "bridge",
            "forward_delay",
            "0",
        ])?;
        wire.ip(&["link", "set", "wire0", "up"])?;
        let client = ns("c")?;
        let node_a = ns("a")?;
        let node_b = ns("b")?;
        let mut wire_xdp = Vec::new();
        for (i, (n, addr)) in [(&node_a, NODE_A), (&node_b, NODE_B), (&client, CLIENT)]
            .into_iter()
            .enumerate()
        {
            let port = format!("p{i}");
            wire.add_bridge_port(&port, "wire0", n)?;
            n.ip(&["addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
            n.ip(&["link", "set", "eth0", "up"])?;
            // For the XDP case, in every case (one topology): frames node-a's XDP sends
            // back with XDP_TX reach the bridge promptly only through a port with an XDP
            // program, and XDP needs complete checksums, as a physical wire delivers.
            wire_xdp.push(wire.attach_xdp_pass(&port)?);
            wire.set_tx_checksum_off(&port)?;
            n.set_tx_checksum_off("eth0")?;
        }
        for (n, gw, other_subnet, other_node) in [
            (&node_a, "198.18.1.1/24", "198.18.2.0/24", NODE_B),
            (&node_b, "198.18.2.1/24", "198.18.1.0/24", NODE_A),
        ] {
            n.ip(&["link", "add", "br0", "type", "bridge", "forward_delay", "0"])?;
            n.ip(&["addr", "add", gw, "dev", "br0"])?;
            n.ip(&["link", "set", "br0", "up"])?;
            n.ip(&["route", "add", other_subnet, "via", other_node])?;
            n.sysctl("net/ipv4/ip_forward", "1")?;
            // Flows to node-b's pod leave node-a by the interface they came in on: no
            // redirects, so the client keeps sending through node-a in every case.
            for dev in ["all", "default", "eth0"] {
                n.sysctl(&format!("net/ipv4/conf/{dev}/send_redirects"), "0")?;
            }
        }
        // The floor's route: the pods through node-a, as NodePort traffic goes.
        client.ip(&["route", "add", "198.18.1.0/24", "via", NODE_A])?;
        client.ip(&["route", "add", "198.18.2.0/24", "via", NODE_A])?;
        // Many short connections: reuse TIME_WAIT ports and use the whole port range.
        client.sysctl("net/ipv4/tcp_tw_reuse", "1")?;
        client.sysctl("net/ipv4/ip_local_port_range", "1024 65535")?;
        let mut t = Topology {
            agent: None,
            agent_b: None,
            servers: Vec::new(),
            pins,
            pins_b,
            scratch,
            cg,
            cg_b,
            pods: Vec::new(),
            node_a,
            node_b,
            client,
            _wire_xdp: wire_xdp,
            _wire: wire,
        };
        for (node, name, addr, gw) in [
            (0, "a0", POD_A0, "198.18.1.1"),
            (1, "b0", POD_B0, "198.18.2.1"),
        ] {
            let pod = ns(name)?;
            let n = if node == 0 { &t.node_a } else { &t.node_b };
            n.add_bridge_port(&format!("v{name}"), "br0", &pod)?;
            pod.ip(&["addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
            pod.ip(&["link", "set", "eth0", "up"])?;
            pod.ip(&["route", "add", "default", "via", gw])?;
            pod.set_tx_checksum_off("eth0")?;
            n.set_tx_checksum_off(&format!("v{name}"))?;
            for (sub, listen) in [
                ("serve", format!("0.0.0.0:{TCP_PORT}")),
                ("serve-udp", format!("0.0.0.0:{UDP_PORT}")),
            ] {
                let g = pod.spawn(
                    None,
                    Command::new(me)
                        .args([sub, "--listen", &listen, "--name", name])
                        .stdin(Stdio::null())
                        .stdout(Stdio::null()),
                )?;
                t.servers.push(g);
            }
            t.pods.push(pod);
        }
        Ok(t)
    }

    /// The log of node-a's agent (`b`: node-b's).
    fn agent_log(&self, b: bool) -> PathBuf {
        self.scratch
            .path()
            .join(if b { "agent-b.log" } else { "agent.log" })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.scratch.path().join(name)
    }
}

/// The north-south part of the bench: every case of `cases` at every N of
/// `o.ns_services`, `o.runs` times, into `results`.
pub fn run(
    o: &Opts,
    me: &Path,
    agent_bin: &Path,
    cases: &[Case],
    results: &mut Results,
) -> Result<()> {
    eprintln!("\n=== north-south (NodePorts from outside the cluster) ===");
    let mut t = Topology::new(me, &o.out)?;
    wait_floor(&t, me)?;
    results.north_south = o.ns_services.clone();
    for run in 0..o.runs {
        for &n in &o.ns_services {
            // A bypassed pod's per-packet path is for traffic from pods, not from outside.
            for &case in cases.iter().filter(|&&c| c != Case::Bypass) {
                check_stop()?;
                results.note_load();
                eprintln!(
                    "  north-south run {}/{}, N = {n}, {case:?}",
                    run + 1,
                    o.runs
                );
                let r = one_case(&mut t, o, me, agent_bin, case, n, results);
                if let Err(e) = r {
                    if crate::STOP.load(std::sync::atomic::Ordering::SeqCst) {
                        return Err(e);
                    }
                    eprintln!("  north-south {case:?} at N={n} failed: {e:#}");
                    results
                        .failures
                        .push(format!("north-south run {} N={n} {case:?}: {e:#}", run + 1));
                }
            }
            results.write(&o.out)?;
        }
    }
    Ok(())
}

/// Waits (at most 10 s) until both backends answer the floor's TCP and UDP.
fn wait_floor(t: &Topology, me: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    for p in NsPath::ALL {
        loop {
            let ok = if p.is_tcp() {
                crate::run_client_in(
                    me,
                    &t.client.path(),
                    None,
                    &p.target(Case::Direct),
                    5,
                    2.0,
                    0,
                )
                .is_ok_and(|r| r.errors == 0 && r.ok > 0)
            } else {
                udp_client(t, me, &p.target(Case::Direct), 5, 1.0, 0).is_ok_and(|r| r.ok > 0)
            };
            if ok {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "the backend of {} does not answer",
                p.label()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}

/// The services of one case: N ClusterIP Services and the four NodePort ones.
fn services(n: usize) -> Vec<Svc> {
    // No background service has real endpoints: `real` past the end.
    let mut svcs = rules::services(n, usize::MAX);
    svcs.extend(NsPath::ALL.map(|p| p.service(n)));
    svcs
}

fn one_case(
    t: &mut Topology,
    o: &Opts,
    me: &Path,
    agent_bin: &Path,
    case: Case,
    n: usize,
    results: &mut Results,
) -> Result<()> {
    let svcs = services(n);
    let r = match case {
        Case::Direct => measure(t, o, me, case, n, results),
        // Not run here (see `run`).
        Case::Bypass => Ok(()),
        Case::Ebpf | Case::Xdp | Case::Dsr => start_agents(t, o, agent_bin, &svcs, case)
            .and_then(|()| measure(t, o, me, case, n, results)),
        Case::Iptables | Case::Nftables => {
            apply_rules(t, o, case, &svcs).and_then(|()| measure(t, o, me, case, n, results))
        }
    };
    // The next case starts from a node without translation (not timed).
    let reset = match case {
        Case::Direct | Case::Bypass => Ok(()),
        Case::Ebpf | Case::Xdp | Case::Dsr => {
            stop_agents(t);
            Ok(())
        }
        Case::Iptables | Case::Nftables => reset_rules(t, o),
    };
    r.and(reset)
}

/// Starts the agents of `case` with `svcs`: node-a's; with [`Case::Xdp`], with `--xdp
/// native` (and the run fails unless node-a's `eth0` runs it natively); with [`Case::Dsr`],
/// node-a's and node-b's, both with `--north-south-mode dsr` (node-b's decapsulates the
/// flows node-a sends to b0). Returns once each has synced and attached its tc programs.
fn start_agents(
    t: &mut Topology,
    o: &Opts,
    agent_bin: &Path,
    svcs: &[Svc],
    case: Case,
) -> Result<()> {
    stop_agents(t);
    let dir = t.file("manifests");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    let mut text = String::new();
    for (name, addr) in [("node-a", NODE_A), ("node-b", NODE_B)] {
        text.push_str(&format!(
            r#"{{"apiVersion":"v1","kind":"Node","metadata":{{"name":"{name}"}},"status":{{"addresses":[{{"type":"InternalIP","address":"{addr}"}}]}}}}"#
        ));
        text.push('\n');
    }
    for s in svcs {
        text.push_str(&rules::service_json(s));
        text.push('\n');
        let node = s.node_port.map(|_| {
            if s.endpoints[0].0.to_string() == POD_B0 {
                "node-b"
            } else {
                "node-a"
            }
        });
        text.push_str(&rules::slice_json_on(s, node));
        text.push('\n');
    }
    fs::write(dir.join("objects.json"), text)?;
    let mode: &[&str] = match case {
        Case::Xdp => &["--xdp", "native", "--xdp-veth-peers-ready"],
        Case::Dsr => &["--north-south-mode", "dsr"],
        _ => &[],
    };
    t.agent = Some(spawn_agent(t, o, agent_bin, svcs, &dir, false, mode)?);
    if case == Case::Dsr {
        t.agent_b = Some(spawn_agent(t, o, agent_bin, svcs, &dir, true, mode)?);
    }
    let deadline = Instant::now() + Duration::from_secs(o.load_timeout);
    for b in [false, true] {
        loop {
            check_stop()?;
            let l = fs::read_to_string(t.agent_log(b)).unwrap_or_default();
            let agent = if b { &mut t.agent_b } else { &mut t.agent };
            let Some(agent) = agent.as_mut() else {
                break;
            };
            if l.contains("sync done") && l.contains("north-south programs attached") {
                break;
            }
            let node = if b { "node-b" } else { "node-a" };
            if let Some(s) = agent.try_wait()? {
                bail!("{node}'s agent exited ({s}): {l}");
            }
            ensure!(
                Instant::now() < deadline,
                "{node}'s agent did not start: {l}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(())
}

/// Spawns one agent on the manifests in `dir`, in node-a's namespace with its cgroup and pin
/// directory, or (`b`) in node-b's with node-b's; `extra` are its mode's flags.
fn spawn_agent(
    t: &Topology,
    o: &Opts,
    agent_bin: &Path,
    svcs: &[Svc],
    dir: &Path,
    b: bool,
    extra: &[&str],
) -> Result<ChildGuard> {
    let (netns, cg, pin_dir, node) = if b {
        (&t.node_b, &t.cg_b, PIN_DIR_B, "node-b")
    } else {
        (&t.node_a, &t.cg, PIN_DIR, "node-a")
    };
    let endpoints: usize = svcs.iter().map(|s| s.endpoints.len()).sum();
    let room = |need: usize, default: u32| (((need as f64 * 1.25) as u32).max(default)).to_string();
    let log = fs::File::create(t.agent_log(b))?;
    let child = netns.spawn(
        None,
        Command::new(agent_bin)
            .args(["run", "--manifests"])
            .arg(dir)
            .arg("--cgroup-path")
            .arg(cg.path())
            .args(["--pin-dir", pin_dir, "--hostname-override", node])
            .args(["--healthz-bind-address", "127.0.0.1:0"])
            .args([
                "--max-frontends",
                &room(2 * svcs.len(), proxy_common::DEFAULT_MAX_FRONTENDS),
            ])
            .args([
                "--max-backend-slots",
                &room(endpoints, proxy_common::DEFAULT_MAX_SLOTS),
            ])
            .args([
                "--max-backends",
                &room(endpoints, proxy_common::DEFAULT_MAX_BACKENDS),
            ])
            .args(extra)
            .args(&o.agent_arg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log),
    );
    child.with_context(|| format!("start {node}'s agent"))
}

/// Stops both agents (if running) and removes their pins, so no program stays attached.
fn stop_agents(t: &mut Topology) {
    for a in [t.agent.take(), t.agent_b.take()].into_iter().flatten() {
        let mut a = a;
        let _ = a.terminate(Duration::from_secs(10));
    }
    let _ = loader::cleanup(&t.pins.0);
    let _ = loader::cleanup(&t.pins_b.0);
}

fn apply_rules(t: &Topology, o: &Opts, case: Case, svcs: &[Svc]) -> Result<()> {
    reset_rules(t, o)?;
    let file = t.file("rules.txt");
    let (text, program, args): (String, &str, &[&str]) = match case {
        Case::Iptables => (
            rules::iptables_full(svcs),
            o.iptables_restore.as_str(),
            &["-w", "5", "--noflush"],
        ),
        _ => (rules::nft_full(svcs), "nft", &["-f", "-"]),
    };
    fs::write(&file, text)?;
    let took = crate::apply_in_netns(
        &t.node_a.path(),
        program,
        args,
        &file,
        Duration::from_secs(o.peer_timeout),
    )?;
    eprintln!(
        "    {case:?}: {program} took {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    Ok(())
}

/// Removes every rule set from node-a: kube-proxy's nftables table, and the tables
/// iptables-nft creates (emptied first, for a legacy `--iptables-restore`), so no NAT or
/// conntrack hook stays registered for the next case.
fn reset_rules(t: &Topology, o: &Opts) -> Result<()> {
    let file = t.file("reset.txt");
    let ns = t.node_a.path();
    let long = Duration::from_secs(600);
    // A tool that is missing (its case not selected) has nothing to remove.
    if crate::which(&o.iptables_restore).is_some() {
        fs::write(&file, rules::IPTABLES_EMPTY)?;
        crate::apply_in_netns(&ns, &o.iptables_restore, &["-w", "5"], &file, long)?;
    }
    if crate::which("nft").is_some() {
        // Adding each table first makes its delete succeed when it does not exist.
        let mut text = String::new();
        for table in ["ip kube-proxy", "ip nat", "ip filter"] {
            text.push_str(&format!("add table {table}\ndelete table {table}\n"));
        }
        fs::write(&file, text)?;
        crate::apply_in_netns(&ns, "nft", &["-f", "-"], &file, long)?;
    }
    Ok(())
}

/// Measures every path of `case` (its translation in place on node-a), records it.
fn measure(
    t: &Topology,
    o: &Opts,
    me: &Path,
    case: Case,
    n: usize,
    results: &mut Results,
) -> Result<()> {
    // The agents measured: node-a's in every ebpf-proxy case, node-b's with DSR.
    let mut agents: Vec<Agent> = Vec::new();
    if matches!(case, Case::Ebpf | Case::Xdp | Case::Dsr) {
        agents.push(Agent::new(&t.pins.0, "", "node-a", case == Case::Xdp)?);
    }
    if case == Case::Dsr {
        agents.push(Agent::new(&t.pins_b.0, NODE_B_PREFIX, "node-b", false)?);
    }
    for p in NsPath::ALL {
        check_stop()?;
        let before: Vec<_> = agents.iter().map(Agent::snapshot).collect();
        let to = p.target(case);
        let want = p.backend().0;
        let add = |results: &mut Results, m: &str, v: f64| {
            results.add(
                case,
                n,
                0,
                Sample::NorthSouth(format!("{}:{m}", p.key()), v),
            );
        };
        let flows = if p.is_tcp() {
            let r = crate::run_client_in(
                me,
                &t.client.path(),
                None,
                &to,
                o.conn_count,
                o.conn_secs,
                WARMUP,
            )?;
            log_tcp(case, p, &r);
            ensure!(r.ok > 0, "no connection succeeded: {:?}", r.first_error);
            ensure!(
                r.names.keys().all(|k| k == want),
                "{to} reached {:?}, not {want}",
                r.names
            );
            add(results, "rate", r.cps);
            add(results, "p50_us", r.p50_us);
            add(results, "p99_us", r.p99_us);
            add(results, "errors", r.errors as f64);
            (WARMUP + r.ok + r.errors) as f64
        } else {
            let r = udp_client(t, me, &to, o.udp_count, o.conn_secs, WARMUP)?;
            eprintln!(
                "    {case:?} {}: {:.0} exchanges/s, {} ok, {} lost, {} errors{}",
                p.label(),
                r.rate,
                r.ok,
                r.lost,
                r.errors,
                r.first_error
                    .as_deref()
                    .map(|e| format!(" (first error: {e})"))
                    .unwrap_or_default()
            );
            ensure!(r.ok > 0, "no UDP reply: {:?}", r.first_error);
            ensure!(
                r.names.keys().all(|k| k == want),
                "{to} answered by {:?}, not {want}",
                r.names
            );
            add(results, "rate", r.rate);
            add(results, "lost", r.lost as f64);
            add(results, "errors", r.errors as f64);
            (WARMUP + r.sent) as f64
        };
        let mut moved = Vec::new();
        for (a, before) in agents.iter().zip(&before) {
            let m = a.record(before, flows, &mut |m, v| add(results, m, v));
            let shown: Vec<String> = m
                .iter()
                .filter(|(_, d)| **d > 0)
                .map(|(name, d)| format!("{name} {d}"))
                .collect();
            eprintln!(
                "    {case:?} {}: {}'s tc counters {}",
                p.label(),
                a.node,
                shown.join(", ")
            );
            moved.push(m);
        }
        if case == Case::Dsr {
            check_dsr(p, &moved[0], &moved[1])?;
        }
    }
    Ok(())
}

/// With DSR, the flows of path `p` went as they should, from node-a's (`a`) and node-b's
/// (`b`) tc counters over its run: to the remote backend encapsulated by node-a, none
/// source-NATed, and decapsulated by node-b; to the local one, none encapsulated.
fn check_dsr(p: NsPath, a: &BTreeMap<&str, u64>, b: &BTreeMap<&str, u64>) -> Result<()> {
    // A counter that could not be read is absent: zero, so the check fails.
    let get = |c: &BTreeMap<&str, u64>, name: &str| c.get(name).copied().unwrap_or(0);
    let (encapsulated, snat) = (get(a, "tc_dsr_encapsulated"), get(a, "tc_snat"));
    let decapsulated = get(b, "tc_dsr_decapsulated");
    if p.remote() {
        ensure!(
            encapsulated > 0 && snat == 0 && decapsulated > 0,
            "{}: not direct server return (node-a encapsulated {encapsulated} and source-NATed {snat} packets, node-b decapsulated {decapsulated})",
            p.label()
        );
    } else {
        ensure!(
            encapsulated == 0,
            "{}: node-a encapsulated {encapsulated} packets to a local backend",
            p.label()
        );
    }
    Ok(())
}

/// One agent whose programs and counters are measured.
struct Agent<'a> {
    pins: &'a Path,
    /// Prefix of its metrics' program part (`""` for node-a, [`NODE_B_PREFIX`]).
    prefix: &'static str,
    node: &'static str,
    /// Program name -> id of its attached programs.
    ids: BTreeMap<String, u32>,
}

/// Program statistics and tc counters of one agent at one instant.
type AgentSnapshot = (BTreeMap<String, (u64, u64)>, BTreeMap<&'static str, u64>);

impl<'a> Agent<'a> {
    /// The agent pinned under `pins`; fails unless its `tc_ingress` (and, with `xdp`, its
    /// `xdp_ingress`) is attached.
    fn new(pins: &'a Path, prefix: &'static str, node: &'static str, xdp: bool) -> Result<Self> {
        let ids = progstats::attached(pins);
        for (want, name) in [(true, "tc_ingress"), (xdp, "xdp_ingress")] {
            ensure!(
                !want || ids.contains_key(name),
                "{name} is not among {node}'s agent's attached programs: {ids:?}"
            );
        }
        Ok(Agent {
            pins,
            prefix,
            node,
            ids,
        })
    }

    fn snapshot(&self) -> AgentSnapshot {
        (
            progstats::snapshot(&self.ids),
            tc::counters(self.pins).unwrap_or_default(),
        )
    }

    /// Records its program costs over `flows` connections or exchanges since `before`
    /// (`ns_per_run:<prefix><program>`, `runs_per_flow:<prefix><program>`,
    /// `<prefix>bpf_ns_per_flow`) and its tc counters' growth (`tc_counter:<prefix><name>`)
    /// through `add`, logs the costs, and returns the counters' growth.
    fn record(
        &self,
        before: &AgentSnapshot,
        flows: f64,
        add: &mut dyn FnMut(&str, f64),
    ) -> BTreeMap<&'static str, u64> {
        let prefix = self.prefix;
        let mut total = 0.0;
        let mut line = String::new();
        for (name, c) in progstats::delta(&before.0, &progstats::snapshot(&self.ids)) {
            if c.runs == 0 {
                continue;
            }
            let per_run = c.ns as f64 / c.runs as f64;
            let runs = c.runs as f64 / flows;
            total += c.ns as f64 / flows;
            line.push_str(&format!(" {name} {per_run:.0} ns x {runs:.2};"));
            add(&format!("ns_per_run:{prefix}{name}"), per_run);
            add(&format!("runs_per_flow:{prefix}{name}"), runs);
        }
        add(&format!("{prefix}bpf_ns_per_flow"), total);
        eprintln!(
            "      {}: BPF {total:.0} ns per connection or exchange ({line} )",
            self.node
        );
        // The tc path's own counters over the run (drops and fallbacks explain misses).
        let after = tc::counters(self.pins).unwrap_or_default();
        let moved: BTreeMap<&'static str, u64> = after
            .iter()
            .map(|(name, v)| {
                (
                    *name,
                    v.saturating_sub(before.1.get(name).copied().unwrap_or(0)),
                )
            })
            .collect();
        for (name, d) in &moved {
            add(&format!("tc_counter:{prefix}{name}"), *d as f64);
        }
        moved
    }
}

fn log_tcp(case: Case, p: NsPath, r: &ClientResult) {
    eprintln!(
        "    {case:?} {}: {:.0} conn/s, p50 {:.0} us, p99 {:.0} us, {} ok, {} errors{}",
        p.label(),
        r.cps,
        r.p50_us,
        r.p99_us,
        r.ok,
        r.errors,
        r.first_error
            .as_deref()
            .map(|e| format!(" (first error: {e})"))
            .unwrap_or_default()
    );
}

/// What the UDP client reports (one JSON line).
#[derive(serde::Serialize, serde::Deserialize, Debug, Default, Clone)]
pub struct UdpResult {
    /// Requests sent in the measured interval.
    pub sent: usize,
    /// Replies received.
    pub ok: usize,
    /// Requests given up (no reply within 200 ms).
    pub lost: usize,
    /// Send or receive errors (e.g. ECONNREFUSED from an ICMP port unreachable).
    pub errors: usize,
    pub first_error: Option<String>,
    /// From the first request to the last reply, seconds.
    pub elapsed_s: f64,
    /// Replies per second.
    pub rate: f64,
    /// Replies per answering server name.
    pub names: std::collections::BTreeMap<String, usize>,
}

fn udp_client(
    t: &Topology,
    me: &Path,
    to: &str,
    count: usize,
    secs: f64,
    warmup: usize,
) -> Result<UdpResult> {
    crate::load_client(
        me,
        &t.client.path(),
        None,
        "udp-client",
        to,
        count,
        secs,
        warmup,
        30.0,
    )
}

/// (run inside the lab) The UDP client: one connected socket, 32-byte requests, at most
/// [`UDP_WINDOW`] in flight, for at most `secs` seconds or `count` requests after `warmup`
/// sequential exchanges; prints one JSON [`UdpResult`].
pub fn udp_client_main(to: SocketAddr, count: usize, secs: f64, warmup: usize) -> Result<()> {
    use std::io::ErrorKind;
    let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
    s.connect(to)?;
    s.set_read_timeout(Some(Duration::from_millis(200)))?;
    let req = [b'x'; 32];
    let mut buf = [0u8; 256];
    for _ in 0..warmup {
        let _ = s.send(&req);
        let _ = s.recv(&mut buf);
    }
    let mut r = UdpResult::default();
    let mut names: std::collections::BTreeMap<Vec<u8>, usize> = Default::default();
    let note = |r: &mut UdpResult, e: std::io::Error| {
        r.errors += 1;
        r.first_error.get_or_insert_with(|| e.to_string());
    };
    let limit = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut last_ok = Duration::ZERO;
    let mut inflight = 0usize;
    while r.errors < 10_000 {
        let sending = r.sent < count && start.elapsed() < limit;
        if sending && inflight < UDP_WINDOW {
            r.sent += 1;
            match s.send(&req) {
                Ok(_) => inflight += 1,
                Err(e) => note(&mut r, e),
            }
            continue;
        }
        if inflight == 0 {
            if sending {
                continue;
            }
            break;
        }
        match s.recv(&mut buf) {
            Ok(k) => {
                inflight -= 1;
                r.ok += 1;
                last_ok = start.elapsed();
                match names.get_mut(&buf[..k]) {
                    Some(c) => *c += 1,
                    None => {
                        names.insert(buf[..k].to_vec(), 1);
                    }
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                r.lost += inflight;
                inflight = 0;
            }
            Err(e) => {
                inflight -= 1;
                note(&mut r, e);
            }
        }
    }
    r.elapsed_s = last_ok.as_secs_f64();
    r.rate = if r.elapsed_s > 0.0 {
        r.ok as f64 / r.elapsed_s
    } else {
        0.0
    };
    r.names = names
        .into_iter()
        .map(|(k, v)| (String::from_utf8_lossy(&k).trim().to_string(), v))
        .collect();
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

/// (run inside the lab) The UDP server: answers every datagram with `name`.
pub fn serve_udp(listen: SocketAddr, name: &str) -> Result<()> {
    let s = std::net::UdpSocket::bind(listen).with_context(|| format!("bind {listen}"))?;
    let reply = format!("{name}\n").into_bytes();
    let mut buf = [0u8; 2048];
    loop {
        if let Ok((_, from)) = s.recv_from(&mut buf) {
            let _ = s.send_to(&reply, from);
        }
    }
}
