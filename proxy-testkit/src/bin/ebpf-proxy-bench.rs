//! `ebpf-proxy-bench` (run by `cargo xtask bench`): ebpf-proxy side by side with the rule sets
//! of kube-proxy's iptables and nftables modes, and with the direct path, on this machine.
//!
//! For each N (services with 10 endpoints each):
//! - control plane: ebpf-proxy from cold (manifests written, agent started on a fresh pin dir,
//!   until its first `sync done`), `iptables-restore` of kube-proxy's iptables rule set and
//!   `nft -f` of its nftables rule set; at some Ns, one endpoint change repeated (ebpf-proxy:
//!   file rename until the pinned maps show the new endpoint, and the agent's own account of
//!   it from its `sync done` line: `latency_us`, `model_us`, `duration_us`; peers: their
//!   incremental update);
//! - data path: new TCP connections per second and per-connection latency (connect, one
//!   request line, one reply line, close) from a client pod to one ClusterIP; for
//!   ebpf-proxy both at the socket and per packet (case `bypass`: a client pod labelled
//!   `ebpf-proxy.io/socket-lb: disabled`, with the agent in the lab's node namespace where
//!   the pod's veth has its node side);
//! - memory: agent RSS after the first sync (and, at some Ns, after its first periodic
//!   verification) and the memlock of its BPF maps;
//! - the control-plane targets, each met or missed (report/targets.rs).
//!
//! `ebpf-proxy-bench micro` (micro.rs) is apart: the cost of one packet in each packet
//! program through `BPF_PROG_TEST_RUN`, next to a minimal floor program and Katran's.
//!
//! Safety: everything runs in a lab of network namespaces (`epb-*`) and a child cgroup
//! (`ebpf-proxy-bench`) created here and removed on exit, panic or Ctrl-C; iptables and nft
//! run only inside the lab's client namespaces (setns before exec; a failed setns fails the
//! spawn); traffic goes only to lab addresses (198.18.0.0/15); every loop is bounded in count
//! and time. The agent's pins live in `/sys/fs/bpf/ebpf-proxy-bench` and are removed.

#[path = "bench/micro/mod.rs"]
mod micro;
#[path = "bench/northsouth.rs"]
mod northsouth;
#[path = "bench/progstats.rs"]
mod progstats;
#[path = "bench/report/mod.rs"]
mod report;

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use aya::maps::{HashMap as BpfHash, Map, MapData};
use clap::{Parser, Subcommand};
use proxy_common::{
    ALL_MAPS, BACKEND_SLOTS, BACKENDS, BackendSlot, BackendSlotKey, FRONTENDS, Frontend,
    FrontendKey, PROTO_TCP,
};
use proxy_testkit::kube_proxy_rules as rules;
use proxy_testkit::testbed::{self, ChildGuard, Lab, Pod, TestCgroup};
use proxy_userspace::datapath::loader;
use report::{Case, Results, Sample};
use rules::Svc;

const PIN_DIR: &str = "ebpf-proxy-bench";
const CGROUP: &str = "ebpf-proxy-bench";
const LAB: &str = "epb";
/// The agent's `--sync-period`: how often it verifies the maps (its default).
const VERIFY_PERIOD: Duration = Duration::from_secs(30);

#[derive(Parser)]
#[command(
    name = "ebpf-proxy-bench",
    about = "ebpf-proxy vs kube-proxy's iptables and nftables rule sets"
)]
struct Cli {
    #[command(subcommand)]
    sub: Option<Sub>,
    #[command(flatten)]
    opts: Opts,
}

#[derive(clap::Args, Clone, Debug)]
struct Opts {
    /// Small run for development: N = 100,1000 (north-south: 100), one run, 10 changes at
    /// N=1000, 1 s / 2000 connections per data path case.
    #[arg(long)]
    quick: bool,
    /// Run one part only: `cluster-ip` (control plane, memory and the socket path to a
    /// ClusterIP), `north-south` (NodePorts from a client outside the cluster) or `micro`
    /// (each packet program alone, as `ebpf-proxy-bench micro` with its defaults).
    #[arg(long, value_parser = ["cluster-ip", "north-south", "micro"])]
    only: Option<String>,
    /// Katran's balancer object for the per-packet part's anchor (see `micro --help`).
    #[arg(long, value_name = "PATH")]
    katran_object: Option<PathBuf>,
    /// North-south: numbers of ClusterIP services (10 endpoints each) loaded next to the
    /// four NodePort services (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1000", value_parser = at_least_one)]
    ns_services: Vec<usize>,
    /// North-south: UDP requests per case and path (upper bound; `--conn-secs` bounds the
    /// time).
    #[arg(long, default_value_t = 2_000_000)]
    udp_count: usize,
    /// Numbers of services (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000,30000", value_parser = at_least_one)]
    services: Vec<usize>,
    /// Repetitions of everything (medians and min-max are over these).
    #[arg(long, default_value_t = 3, value_parser = at_least_one)]
    runs: usize,
    /// Ns at which one endpoint change is measured (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1000,10000,30000")]
    change_at: Vec<usize>,
    /// Ns at which the agent is kept until its first periodic verification (every
    /// `--sync-period`, 30 s) has run, and its RSS is read again (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "10000,30000")]
    steady_at: Vec<usize>,
    /// Endpoint changes per run and case (p99 is over every change of every run).
    #[arg(long, default_value_t = 40)]
    changes: usize,
    /// Connections per data path case (upper bound).
    #[arg(long, default_value_t = 20000)]
    conn_count: usize,
    /// Seconds per data path case (upper bound).
    #[arg(long, default_value_t = 3.0, value_parser = positive_secs)]
    conn_secs: f64,
    /// Cases to run (ebpf, xdp, dsr, bypass, iptables, nftables, direct; xdp = ebpf-proxy
    /// with `--xdp native` and dsr = ebpf-proxy with `--north-south-mode dsr` on both nodes,
    /// in the north-south part only; bypass in the cluster-IP part only).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ebpf,xdp,dsr,bypass,iptables,nftables,direct"
    )]
    cases: Vec<String>,
    /// Output directory.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// The agent binary [default: `ebpf-proxy` next to this binary].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Extra arguments for the agent (repeatable), e.g. `--agent-arg=--log-level=debug` to see
    /// where its start-up time goes in `agent-cold-N.log`.
    #[arg(long, allow_hyphen_values = true)]
    agent_arg: Vec<String>,
    /// Timeout of the agent's first sync, seconds.
    #[arg(long, default_value_t = 600)]
    load_timeout: u64,
    /// Timeout of one cold `iptables-restore` / `nft -f`, seconds. A peer that times out at
    /// some N is recorded as such and not run again at that N or above.
    #[arg(long, default_value_t = 90)]
    peer_timeout: u64,
    /// The `iptables-restore` to run for kube-proxy's iptables rules (e.g.
    /// `iptables-legacy-restore` for the legacy backend).
    #[arg(long, default_value = "iptables-restore")]
    iptables_restore: String,
}

#[derive(Subcommand)]
enum Sub {
    /// Per-packet cost of each packet program (BPF_PROG_TEST_RUN, nothing attached), next to
    /// a minimal floor program and, with --katran-object, Katran's balancer (needs root;
    /// results in target/bench/micro.md and micro.json).
    Micro(micro::MicroOpts),
    /// (internal) Load client: sequential connections, one JSON line of results.
    #[command(hide = true)]
    Client {
        #[arg(long, value_delimiter = ',')]
        to: Vec<SocketAddr>,
        #[arg(long)]
        count: usize,
        #[arg(long)]
        secs: f64,
        #[arg(long, default_value_t = 200)]
        warmup: usize,
    },
    /// (internal) Server: answers one request line with NAME and waits for the close.
    #[command(hide = true)]
    Serve {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        name: String,
    },
    /// (internal) UDP load client: request/reply on one flow, one JSON line of results.
    #[command(hide = true)]
    UdpClient {
        #[arg(long)]
        to: SocketAddr,
        #[arg(long)]
        count: usize,
        #[arg(long)]
        secs: f64,
        #[arg(long, default_value_t = 200)]
        warmup: usize,
    },
    /// (internal) UDP server: answers every datagram with NAME.
    #[command(hide = true)]
    ServeUdp {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        name: String,
    },
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn check_stop() -> Result<()> {
    if STOP.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.sub {
        Some(Sub::Client {
            to,
            count,
            secs,
            warmup,
        }) => client(&to, count, secs, warmup),
        Some(Sub::Serve { listen, name }) => serve(listen, &name),
        Some(Sub::UdpClient {
            to,
            count,
            secs,
            warmup,
        }) => northsouth::udp_client_main(to, count, secs, warmup),
        Some(Sub::ServeUdp { listen, name }) => northsouth::serve_udp(listen, &name),
        Some(Sub::Micro(opts)) => micro::micro(opts),
        None => {
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                // SAFETY: the handler only stores to an atomic (async-signal-safe).
                unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
            }
            bench(cli.opts)
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ebpf-proxy-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------
// server and client (run as children inside the lab)
// ---------------------------------------------------------------------------------------

fn serve(listen: SocketAddr, name: &str) -> Result<()> {
    let l = TcpListener::bind(listen).with_context(|| format!("bind {listen}"))?;
    let reply = format!("{name}\n").into_bytes();
    let l2 = l.try_clone()?;
    let r2 = reply.clone();
    std::thread::spawn(move || serve_loop(l2, &r2));
    serve_loop(l, &reply)
}

/// Accepts forever; per connection: one request line (small: one read), the reply, then
/// wait (at most 2 s) for the client's close.
fn serve_loop(l: TcpListener, reply: &[u8]) -> ! {
    loop {
        let Ok((mut s, _)) = l.accept() else { continue };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.set_nodelay(true);
        let mut buf = [0u8; 256];
        if matches!(s.read(&mut buf), Ok(n) if n > 0) && s.write_all(reply).is_ok() {
            let _ = s.read(&mut buf);
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize, Debug, Default, Clone)]
struct ClientResult {
    ok: usize,
    errors: usize,
    first_error: Option<String>,
    elapsed_s: f64,
    cps: f64,
    p50_us: f64,
    p99_us: f64,
    names: BTreeMap<String, usize>,
}

fn one_conn(to: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(1))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(1)))?;
    s.write_all(b"hello\n")?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::other("closed without a reply"));
    }
    Ok(line.trim().to_string())
}

fn client(to: &[SocketAddr], count: usize, secs: f64, warmup: usize) -> Result<()> {
    ensure!(!to.is_empty(), "--to");
    for i in 0..warmup {
        let _ = one_conn(to[i % to.len()]);
    }
    let mut lat = Vec::with_capacity(count);
    let mut res = ClientResult::default();
    let limit = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut i = 0;
    while i < count && start.elapsed() < limit {
        let t = Instant::now();
        match one_conn(to[i % to.len()]) {
            Ok(name) => {
                lat.push(t.elapsed().as_secs_f64() * 1e6);
                res.ok += 1;
                *res.names.entry(name).or_default() += 1;
            }
            Err(e) => {
                res.errors += 1;
                res.first_error.get_or_insert_with(|| e.to_string());
            }
        }
        i += 1;
    }
    res.elapsed_s = start.elapsed().as_secs_f64();
    res.cps = res.ok as f64 / res.elapsed_s;
    lat.sort_by(f64::total_cmp);
    res.p50_us = report::percentile(&lat, 50.0);
    res.p99_us = report::percentile(&lat, 99.0);
    println!("{}", serde_json::to_string(&res)?);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// the bench
// ---------------------------------------------------------------------------------------

/// A count flag's value: a whole number of at least 1.
fn at_least_one(v: &str) -> Result<usize, String> {
    match v.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A duration flag's value in seconds: finite and above 0.
fn positive_secs(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(_) => Err("must be a number of seconds above 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Removes the agent's pins on drop.
struct PinGuard(PathBuf);
impl Drop for PinGuard {
    fn drop(&mut self) {
        let _ = loader::cleanup(&self.0);
    }
}

/// Everything the bench creates. Fields drop in order: processes, pins, scratch files,
/// cgroup, lab.
struct Env {
    agent: Option<ChildGuard>,
    servers: Vec<ChildGuard>,
    pins: PinGuard,
    scratch: tempfile::TempDir,
    cg: TestCgroup,
    clients: BTreeMap<Case, Pod>,
    lab: Lab,
    me: PathBuf,
    agent_bin: PathBuf,
    agent_log: PathBuf,
    manifests: PathBuf,
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.terminate(Duration::from_secs(5));
        }
        self.servers.clear();
    }
}

fn bench(mut o: Opts) -> Result<()> {
    ensure!(
        testbed::is_root(),
        "the bench needs root (namespaces, cgroups, BPF)"
    );
    ensure!(
        !loader::OBJECT.is_empty(),
        "built without the eBPF object: use `cargo xtask bench`"
    );
    // The kernel's program statistics, on while this descriptor lives (off again at exit).
    let _stats = match progstats::enable() {
        Ok(fd) => Some(fd),
        Err(e) => {
            eprintln!("warning: no per-program statistics: {e:#}");
            None
        }
    };
    if o.quick {
        o.services = vec![100, 1000];
        o.runs = 1;
        o.change_at = vec![1000];
        o.steady_at = vec![];
        o.changes = 10;
        o.conn_count = 2000;
        o.conn_secs = 1.0;
        o.ns_services = vec![100];
    }
    let only = |part: &str| o.only.is_none() || o.only.as_deref() == Some(part);
    let (cluster_ip, north_south, per_packet) =
        (only("cluster-ip"), only("north-south"), only("micro"));
    if !cluster_ip {
        o.services.clear();
    }
    for c in &o.cases {
        ensure!(
            Case::parse(c).is_some(),
            "unknown case {c:?} (ebpf, xdp, dsr, bypass, iptables, nftables, direct)"
        );
    }
    let cases: Vec<Case> = o.cases.iter().filter_map(|c| Case::parse(c)).collect();
    for (tool, case) in [
        (o.iptables_restore.as_str(), Case::Iptables),
        ("nft", Case::Nftables),
    ] {
        if cases.contains(&case) && which(tool).is_none() {
            bail!(
                "{tool} is missing (Debian packages iptables, nftables; `cargo xtask bench` installs them)"
            );
        }
    }
    testbed::ensure_bpffs()?;
    fs::create_dir_all(&o.out)?;
    let me = std::env::current_exe()?;
    let agent_bin = o
        .agent
        .clone()
        .unwrap_or_else(|| me.with_file_name("ebpf-proxy"));
    ensure!(
        agent_bin.exists(),
        "agent {} not found",
        agent_bin.display()
    );

    let machine = report::Machine::detect();
    eprintln!("machine: {}", machine.line());
    let started = Instant::now();
    let mut results = Results::new(machine, &o.services, o.runs, &o.change_at, o.changes);
    if cluster_ip {
        cluster_ip_part(
            &o,
            me.clone(),
            agent_bin.clone(),
            &cases,
            &mut results,
            started,
        )?;
    }
    if north_south {
        northsouth::run(&o, &me, &agent_bin, &cases, &mut results)?;
    }
    if per_packet {
        // Last, alone on the machine: no agent, lab or peer is left running.
        micro::micro(micro::MicroOpts::defaults(
            &o.out,
            o.katran_object.clone(),
            o.quick,
        ))?;
        if !cluster_ip && !north_south {
            return Ok(());
        }
    }
    results.total_s = started.elapsed().as_secs_f64();
    results.write(&o.out)?;
    report::charts(&results, &o.out)?;
    print!("{}", results.markdown());
    eprintln!(
        "\nwrote {}/results.md, results.json and the charts ({:.0?})",
        o.out.display(),
        started.elapsed()
    );
    Ok(())
}

/// The control plane, memory and socket-path part: every case at every N.
fn cluster_ip_part(
    o: &Opts,
    me: PathBuf,
    agent_bin: PathBuf,
    cases: &[Case],
    results: &mut Results,
    started: Instant,
) -> Result<()> {
    let mut env = setup(o, me, agent_bin)?;
    for run in 0..o.runs {
        for &n in &o.services {
            check_stop()?;
            eprintln!(
                "\n=== run {}/{}, N = {n} ({:.0?} so far) ===",
                run + 1,
                o.runs,
                started.elapsed()
            );
            let real = n / 2;
            let svcs = rules::services(n, real);
            let change_svc = if real == 0 { 1.min(n - 1) } else { 0 };
            for &case in cases {
                check_stop()?;
                results.note_load();
                if let Some(&t) = results.timed_out.get(case.key())
                    && n >= t
                {
                    eprintln!("  {case:?}: skipped (timed out at N={t})");
                    continue;
                }
                let r = match case {
                    Case::Ebpf => run_ebpf(&mut env, o, &svcs, real, change_svc, results, run),
                    Case::Bypass => run_bypass(&mut env, o, &svcs, real, results, run),
                    Case::Iptables | Case::Nftables => {
                        run_rules(&env, o, case, &svcs, real, change_svc, results, run)
                    }
                    Case::Direct => run_direct(&env, o, n, results, run),
                    // XDP serves traffic entering the node, not the socket path.
                    Case::Xdp | Case::Dsr => continue,
                };
                if let Err(e) = r {
                    if STOP.load(Ordering::SeqCst) {
                        return Err(e);
                    }
                    eprintln!("  {case:?} at N={n} failed: {e:#}");
                    results
                        .failures
                        .push(format!("run {} N={n} {case:?}: {e:#}", run + 1));
                }
            }
            // Partial results survive an interruption of a long run.
            results.write(&o.out)?;
        }
    }
    drop(env);
    Ok(())
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

fn setup(o: &Opts, me: PathBuf, agent_bin: PathBuf) -> Result<Env> {
    let pin = loader::pin_dir(Path::new(testbed::BPFFS_PATH), PIN_DIR);
    // A leftover of a crashed run.
    let _ = loader::cleanup(&pin);
    // Removed on drop; a leftover of a crashed run only takes disk under --out.
    fs::create_dir_all(&o.out)?;
    let scratch = tempfile::Builder::new()
        .prefix("scratch-")
        .tempdir_in(fs::canonicalize(&o.out)?)?;
    let manifests = scratch.path().join("manifests");
    fs::create_dir_all(&manifests)?;
    let cg = TestCgroup::create(CGROUP)?;
    let mut lab = Lab::new(LAB, false)?;
    let mut clients = BTreeMap::new();
    for (i, case) in Case::ALL.into_iter().enumerate() {
        let pod = lab.add_pod(case.pod(), Ipv4Addr::new(198, 18, 0, 2 + i as u8), None)?;
        // Many short connections: reuse TIME_WAIT ports and use the whole port range.
        for (k, v) in [
            ("net/ipv4/tcp_tw_reuse", "1"),
            ("net/ipv4/ip_local_port_range", "1024 65535"),
        ] {
            sysctl_in(&pod, k, v)?;
        }
        clients.insert(case, pod);
    }
    let mut env = Env {
        agent: None,
        servers: Vec::new(),
        pins: PinGuard(pin),
        scratch,
        cg,
        clients,
        lab,
        me,
        agent_bin,
        agent_log: PathBuf::new(),
        manifests,
    };
    env.agent_log = env.scratch.path().join("agent.log");
    // The bypassed client's sandbox as a kubelet lays it out for the agent to find: the
    // cgroup `pod<uid>` holding a process of the pod's namespace. The node namespace
    // forwards: the pod's packets to a ClusterIP reach its node side through the gateway.
    let bypass_cg = env.cg.path().join(format!("pod{BYPASS_UID}"));
    fs::create_dir_all(&bypass_cg)?;
    let pause = env.clients[&Case::Bypass].spawn(
        Some(&bypass_cg),
        Command::new("sleep")
            .arg("86400")
            .stdin(Stdio::null())
            .stdout(Stdio::null()),
    )?;
    env.servers.push(pause);
    env.lab.node().sysctl("net/ipv4/ip_forward", "1")?;
    for j in 0..rules::ENDPOINTS {
        let pod = env
            .lab
            .add_pod(&format!("b{j}"), rules::real_backend(j), None)?;
        let g = pod.spawn(
            None,
            Command::new(&env.me)
                .args([
                    "serve",
                    "--listen",
                    &format!("0.0.0.0:{}", rules::REAL_PORT),
                ])
                .args(["--name", &format!("b{j}")])
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        )?;
        env.servers.push(g);
    }
    // Bounded wait until every server answers (from the direct client).
    let to: Vec<String> = (0..rules::ENDPOINTS)
        .map(|j| format!("{}:{}", rules::real_backend(j), rules::REAL_PORT))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = run_client(&env, Case::Direct, &to.join(","), 10, 2.0, 0);
        if r.as_ref()
            .is_ok_and(|r| r.errors == 0 && r.names.len() == rules::ENDPOINTS)
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("backend servers did not come up: {r:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(env)
}

fn sysctl_in(pod: &Pod, key: &str, value: &str) -> Result<()> {
    let out = pod.output(
        None,
        Command::new("sh").args(["-c", &format!("echo {value} > /proc/sys/{key}")]),
        Duration::from_secs(10),
    )?;
    ensure!(out.status.success(), "sysctl {key} in {}", pod.netns);
    Ok(())
}

/// Runs the load client in the case's client pod (in the bench cgroup for ebpf-proxy).
fn run_client(
    env: &Env,
    case: Case,
    to: &str,
    count: usize,
    secs: f64,
    warmup: usize,
) -> Result<ClientResult> {
    let pod = &env.clients[&case];
    let cg = matches!(case, Case::Ebpf | Case::Bypass).then(|| env.cg.path());
    run_client_in(&env.me, &pod.path(), cg, to, count, secs, warmup)
}

/// Runs the load client (this binary, `me`) in the namespace at `ns` and `cgroup`.
fn run_client_in(
    me: &Path,
    ns: &Path,
    cg: Option<&Path>,
    to: &str,
    count: usize,
    secs: f64,
    warmup: usize,
) -> Result<ClientResult> {
    let out = testbed::output_in(
        Some(ns),
        cg,
        Command::new(me).args([
            "client",
            "--to",
            to,
            "--count",
            &count.to_string(),
            "--secs",
            &secs.to_string(),
            "--warmup",
            &warmup.to_string(),
        ]),
        Duration::from_secs_f64(secs + 60.0),
    )?;
    ensure!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("client output {line:?}"))
}

/// Measures the data path of `case` towards `to`, records it.
fn data_path(
    env: &Env,
    o: &Opts,
    case: Case,
    to: &str,
    n: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    check_stop()?;
    let warmup = 200;
    // The agent's cost is measured by the control-plane cases: the data path is measured
    // with it at rest, not while it still frees what its first sync built.
    if let Some(pid) = env.agent.as_ref().map(|a| a.id()) {
        let waited = wait_idle(pid);
        if waited > Duration::from_millis(600) {
            eprintln!("  {case:?}: waited {waited:.1?} for the agent to go idle");
        }
    }
    // The kernel's statistics of ebpf-proxy's programs over the client's run.
    let progs = matches!(case, Case::Ebpf | Case::Bypass).then(|| progstats::attached(&env.pins.0));
    // The invocation floor, next to ebpf-proxy's programs for the same connections.
    let floor = match (case, &progs) {
        (Case::Ebpf, Some(_)) => match progstats::Floor::attach(env.cg.path()) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("warning: no invocation floor: {e:#}");
                None
            }
        },
        _ => None,
    };
    let floor_ids = floor.as_ref().map(|f| f.named()).unwrap_or_default();
    let before = progs.as_ref().map(progstats::snapshot);
    let floor_before = progstats::snapshot(&floor_ids);
    let r = run_client(env, case, to, o.conn_count, o.conn_secs, warmup)?;
    if let (Some(ids), Some(before)) = (&progs, &before) {
        let conns = (warmup + r.ok + r.errors) as f64;
        // ns per invocation of a program that only returns, by hook.
        let floors: BTreeMap<String, f64> =
            progstats::delta(&floor_before, &progstats::snapshot(&floor_ids))
                .into_iter()
                .filter(|(_, c)| c.runs > 0)
                .map(|(name, c)| (name, c.ns as f64 / c.runs as f64))
                .collect();
        drop(floor);
        for (name, v) in &floors {
            results.add(case, n, run, Sample::Prog(format!("ns_per_run:{name}"), *v));
        }
        let mut total = 0.0;
        let mut above = (!floors.is_empty()).then_some(0.0);
        let mut line = String::new();
        for (name, c) in progstats::delta(before, &progstats::snapshot(ids)) {
            if c.runs == 0 {
                continue;
            }
            let per_run = c.ns as f64 / c.runs as f64;
            let runs = c.runs as f64 / conns;
            total += c.ns as f64 / conns;
            if let Some(a) = &mut above {
                let f = progstats::floor_of(&name)
                    .and_then(|h| floors.get(h))
                    .copied();
                *a += (per_run - f.unwrap_or(0.0)).max(0.0) * runs;
            }
            line.push_str(&format!(" {name} {per_run:.0} ns x {runs:.2};"));
            results.add(
                case,
                n,
                run,
                Sample::Prog(format!("ns_per_run:{name}"), per_run),
            );
            results.add(
                case,
                n,
                run,
                Sample::Prog(format!("runs_per_conn:{name}"), runs),
            );
            results.add(
                case,
                n,
                run,
                Sample::Prog(format!("ns_per_conn:{name}"), c.ns as f64 / conns),
            );
        }
        results.add(case, n, run, Sample::BpfNsPerConn(total));
        if let Some(a) = above {
            results.add(case, n, run, Sample::Prog("above_floor:all".into(), a));
        }
        let fl: String = floors
            .iter()
            .map(|(k, v)| format!(" {k} {v:.0} ns;"))
            .collect();
        eprintln!("  {case:?} BPF per connection: {total:.0} ns ({line} ) floor:{fl}");
    }
    eprintln!(
        "  {case:?} data path: {:.0} conn/s, p50 {:.0} us, p99 {:.0} us, {} ok, {} errors, {} backends{}",
        r.cps,
        r.p50_us,
        r.p99_us,
        r.ok,
        r.errors,
        r.names.len(),
        r.first_error
            .as_deref()
            .map(|e| format!(" (first error: {e})"))
            .unwrap_or_default()
    );
    ensure!(r.ok > 0, "no connection succeeded: {:?}", r.first_error);
    results.add(case, n, run, Sample::Cps(r.cps));
    results.add(case, n, run, Sample::P50Us(r.p50_us));
    results.add(case, n, run, Sample::P99Us(r.p99_us));
    results.add(case, n, run, Sample::ConnErrors(r.errors as f64));
    results.add(case, n, run, Sample::BackendsSeen(r.names.len() as f64));
    Ok(())
}

fn run_direct(env: &Env, o: &Opts, n: usize, results: &mut Results, run: usize) -> Result<()> {
    let to: Vec<String> = (0..rules::ENDPOINTS)
        .map(|j| format!("{}:{}", rules::real_backend(j), rules::REAL_PORT))
        .collect();
    data_path(env, o, Case::Direct, &to.join(","), n, results, run)
}

/// UID of the bypassed client pod (`Case::Bypass`).
const BYPASS_UID: &str = "00000000-bench-bypass";
/// The node name the agent of the `bypass` case runs as (the Pod's `spec.nodeName`).
const BYPASS_NODE: &str = "bench-node";

/// ebpf-proxy's per-packet path: the agent with the same manifests plus the client pod
/// `c-bypass` opted out of socket-level translation, started in the lab's node namespace
/// (where the pod's veth has its node side), once its programs are on the pod's interface;
/// then the same data-path run as the other cases, from that pod (in the bench cgroup, so
/// the socket programs see its connections and leave them alone).
fn run_bypass(
    env: &mut Env,
    o: &Opts,
    svcs: &[Svc],
    real: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let r = run_bypass_inner(env, o, svcs, real, results, run);
    stop_agent(env);
    r
}

fn run_bypass_inner(
    env: &mut Env,
    o: &Opts,
    svcs: &[Svc],
    real: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let n = svcs.len();
    stop_agent(env);
    let change_svc = if real == 0 { 1.min(n - 1) } else { 0 };
    write_manifests(&env.manifests, svcs, change_svc)?;
    let pod = &env.clients[&Case::Bypass];
    write_atomic(
        &env.manifests.join("pod-bypass.yaml"),
        &format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {}\n  namespace: default\n  uid: {BYPASS_UID}\n  labels: {{ebpf-proxy.io/socket-lb: disabled}}\nspec:\n  nodeName: {BYPASS_NODE}\n  containers: [{{name: client, image: client}}]\nstatus:\n  podIP: {}\n  podIPs: [{{ip: {}}}]\n",
            pod.name, pod.ipv4, pod.ipv4
        ),
    )?;
    let node = env.lab.node().path();
    start_agent(
        env,
        o,
        n,
        &[
            "--manifests".into(),
            env.manifests.display().to_string(),
            "--hostname-override".into(),
            BYPASS_NODE.into(),
        ],
        Some(&node),
    )?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        check_stop()?;
        let listed = proxy_userspace::datapath::bypass::read_pinned(&env.pins.0)
            .map(|(_, cookies)| cookies.len())
            .unwrap_or(0);
        if listed == 1 && proxy_userspace::datapath::bypass::attached_pods(&env.pins.0).len() == 1 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the bypassed pod was not programmed within 30 s: {}",
            agent_log(env)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let flows = || {
        proxy_userspace::datapath::tc::counters(&env.pins.0)
            .map(|c| c["tc_new_flow"])
            .unwrap_or(0)
    };
    let before = flows();
    data_path(env, o, Case::Bypass, &vip_target(real), n, results, run)?;
    // The connections were the per-packet path's, not the socket's.
    let per_packet = flows() - before;
    eprintln!("  Bypass: {per_packet} packet flows started by pod_ingress");
    ensure!(
        per_packet > 0,
        "no packet flow: the bypassed pod's connections were not translated per packet"
    );
    Ok(())
}

fn vip_target(real: usize) -> String {
    format!("{}:{}", rules::vip(real), rules::SVC_PORT)
}

// ---------------------------------------------------------------------------------------
// ebpf-proxy
// ---------------------------------------------------------------------------------------

fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().unwrap().to_string_lossy()
    ));
    fs::write(&tmp, text)?;
    fs::rename(&tmp, path)?;
    Ok(())
}

/// Writes the manifests: services and slices in files of 1000 services each, the slice of
/// the service that the change test edits in a file of its own.
fn write_manifests(dir: &Path, svcs: &[Svc], change_svc: usize) -> Result<()> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    for (k, chunk) in svcs.chunks(1000).enumerate() {
        let mut text = String::with_capacity(chunk.len() * 1200);
        for (i, s) in chunk.iter().enumerate() {
            text.push_str(&rules::service_json(s));
            text.push('\n');
            if k * 1000 + i != change_svc {
                text.push_str(&rules::slice_json(s));
                text.push('\n');
            }
        }
        fs::write(dir.join(format!("services-{k:03}.json")), text)?;
    }
    fs::write(
        dir.join("change.json"),
        rules::slice_json(&svcs[change_svc]) + "\n",
    )?;
    Ok(())
}

fn agent_log(env: &Env) -> String {
    fs::read_to_string(&env.agent_log).unwrap_or_default()
}

/// The number after ` key=` in a log line.
fn field(line: &str, key: &str) -> Option<u64> {
    let pat = format!(" {key}=");
    let rest = &line[line.find(&pat)? + pat.len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

fn v4_mapped(a: Ipv4Addr) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[10] = 0xff;
    b[11] = 0xff;
    b[12..].copy_from_slice(&a.octets());
    b
}

/// The pinned service maps, read one key at a time.
struct Maps {
    frontends: BpfHash<MapData, FrontendKey, Frontend>,
    slots: BpfHash<MapData, BackendSlotKey, BackendSlot>,
}

impl Maps {
    fn open(dir: &Path) -> Result<Self> {
        let open = |name: &str| -> Result<Map> {
            Ok(Map::from_map_data(MapData::from_pin(dir.join(name))?)?)
        };
        Ok(Self {
            frontends: BpfHash::try_from(open(FRONTENDS)?)?,
            slots: BpfHash::try_from(open(BACKEND_SLOTS)?)?,
        })
    }

    /// Backend addresses of the TCP frontend `vip:80` (empty when absent).
    fn backends_of(&self, vip: Ipv4Addr) -> Vec<[u8; 16]> {
        let key = FrontendKey {
            addr: v4_mapped(vip),
            port: rules::SVC_PORT.to_be_bytes(),
            proto: PROTO_TCP,
            scope: 0,
        };
        let Ok(f) = self.frontends.get(&key, 0) else {
            return Vec::new();
        };
        (0..f.backend_count)
            .filter_map(|slot| {
                self.slots
                    .get(
                        &BackendSlotKey {
                            service_id: f.service_id,
                            slot,
                        },
                        0,
                    )
                    .ok()
                    .map(|s| s.backend.addr)
            })
            .collect()
    }
}

/// memlock bytes of every pinned map of the agent (from /proc/self/fdinfo), and of the
/// three service maps alone.
fn map_memlock(dir: &Path) -> (u64, u64) {
    let (mut all, mut svc) = (0, 0);
    for name in ALL_MAPS {
        let Ok(m) = MapData::from_pin(dir.join(name)) else {
            continue;
        };
        let fd = m.fd().as_fd().as_raw_fd();
        let info = fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap_or_default();
        let bytes = info
            .lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        all += bytes;
        if [FRONTENDS, BACKEND_SLOTS, BACKENDS].contains(&name) {
            svc += bytes;
        }
    }
    (all, svc)
}

/// CPU time (user + system) of process `pid` in clock ticks, from `/proc/PID/stat`.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold spaces), utime and stime are fields 12 and 13.
    let mut f = s.rsplit_once(')')?.1.split_whitespace().skip(11);
    Some(f.next()?.parse::<u64>().ok()? + f.next()?.parse::<u64>().ok()?)
}

/// Waits until process `pid` has used at most one clock tick (10 ms) of CPU in 500 ms, for
/// at most 10 s (or until it is gone); returns how long it waited.
fn wait_idle(pid: u32) -> Duration {
    let t = Instant::now();
    let mut last = cpu_ticks(pid);
    while t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(500));
        let now = cpu_ticks(pid);
        match (last, now) {
            (Some(a), Some(b)) if b.saturating_sub(a) > 1 => last = now,
            _ => break,
        }
    }
    t.elapsed()
}

fn proc_status_kib(pid: u32, key: &str) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with(key))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

fn stop_agent(env: &mut Env) {
    if let Some(mut a) = env.agent.take() {
        let _ = a.terminate(Duration::from_secs(10));
    }
    let _ = loader::cleanup(&env.pins.0);
}

fn run_ebpf(
    env: &mut Env,
    o: &Opts,
    svcs: &[Svc],
    real: usize,
    change_svc: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let r = run_ebpf_inner(env, o, svcs, real, change_svc, results, run);
    stop_agent(env);
    r?;
    if o.change_at.contains(&svcs.len()) {
        let r = run_api_changes(env, o, svcs, change_svc, results, run);
        stop_agent(env);
        r?;
    }
    Ok(())
}

/// Seconds between two endpoint changes through the API source: more than kube-proxy's
/// default `--min-sync-period` (1 s), so each change is programmed alone and unpaced, as a
/// lone change in a cluster is.
const API_CHANGE_GAP: Duration = Duration::from_millis(1100);

/// The agent with the Kubernetes API source (the in-process fake API server holding the
/// same Services and EndpointSlices): one endpoint change at a time, each applied with an
/// `endpoints.kubernetes.io/last-change-trigger-time` of its apply time, measured until the
/// pinned maps show it, by the agent (`latency_us`), and by kube-proxy's
/// `kubeproxy_network_programming_duration_seconds` (its mean: the buckets start at
/// 250 ms).
fn run_api_changes(
    env: &mut Env,
    o: &Opts,
    svcs: &[Svc],
    change_svc: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use proxy_testkit::fakeapi::FakeApiServer;
    let n = svcs.len();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let api = rt.block_on(FakeApiServer::start("127.0.0.1:0".parse()?))?;
    for s in svcs {
        api.apply_service(serde_json::from_str::<Service>(&rules::service_json(s))?);
        api.apply_endpoint_slice(serde_json::from_str::<EndpointSlice>(&rules::slice_json(
            s,
        ))?);
    }
    let kubeconfig = env.scratch.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let (wall, _) = start_agent(
        env,
        o,
        n,
        &[
            "--kubeconfig".into(),
            kubeconfig.display().to_string(),
            "--metrics-bind-address".into(),
            "127.0.0.1:10249".into(),
            "--status-bind-address".into(),
            "127.0.0.1:0".into(),
        ],
        None,
    )?;
    eprintln!(
        "  Ebpf (API source) cold: wall (start to sync done) {:.1} ms",
        wall.as_secs_f64() * 1e3
    );
    results.add(
        Case::Ebpf,
        n,
        run,
        Sample::ApiColdWallMs(wall.as_secs_f64() * 1e3),
    );
    let maps = Maps::open(&env.pins.0)?;
    let before = programming_sum_count()?;
    let mut svc = svcs[change_svc].clone();
    let changes = o.changes.div_ceil(2);
    for k in 0..changes {
        check_stop()?;
        std::thread::sleep(API_CHANGE_GAP);
        let new_ip = rules::change_addr(k);
        svc.endpoints[rules::ENDPOINTS - 1].0 = new_ip;
        let mut slice: EndpointSlice = serde_json::from_str(&rules::slice_json(&svc))?;
        let now = humantime::format_rfc3339_nanos(std::time::SystemTime::now()).to_string();
        slice.metadata.annotations = Some(
            [(
                "endpoints.kubernetes.io/last-change-trigger-time".to_string(),
                now,
            )]
            .into(),
        );
        let syncs = SyncLine::count(&agent_log(env));
        let t = Instant::now();
        api.apply_endpoint_slice(slice);
        let (lat, sync) = await_change(env, &maps, svc.vip, new_ip, t, syncs)
            .with_context(|| format!("API change {k}"))?;
        results.add(
            Case::Ebpf,
            n,
            run,
            Sample::ApiChangeMs(lat.as_secs_f64() * 1e3),
        );
        results.add(
            Case::Ebpf,
            n,
            run,
            Sample::ApiChangeLatencyMs(sync.latency_us as f64 / 1e3),
        );
    }
    let after = programming_sum_count()?;
    let count = after.1 - before.1;
    if count > 0.0 {
        results.add(
            Case::Ebpf,
            n,
            run,
            Sample::ApiProgrammingMeanMs((after.0 - before.0) / count * 1e3),
        );
    }
    results.log_api_change(n);
    Ok(())
}

/// Waits for one endpoint change started at `t`: until `vip`'s backends in the maps hold
/// `new_ip` (polled one key at a time every 100 µs; a poll is about 20 map lookups), then
/// for the agent's own account of it, the first `sync done` line after the `syncs` the
/// log held before the change. Returns the time to the maps and that line; errors after
/// 30 s of either wait.
fn await_change(
    env: &Env,
    maps: &Maps,
    vip: Ipv4Addr,
    new_ip: Ipv4Addr,
    t: Instant,
    syncs: usize,
) -> Result<(Duration, SyncLine)> {
    let want = v4_mapped(new_ip);
    let lat = loop {
        if maps.backends_of(vip).contains(&want) {
            break t.elapsed();
        }
        ensure!(
            t.elapsed() < Duration::from_secs(30),
            "not in the maps after 30 s"
        );
        std::thread::sleep(Duration::from_micros(100));
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(l) = SyncLine::nth(&agent_log(env), syncs) {
            return Ok((lat, l));
        }
        ensure!(Instant::now() < deadline, "no sync done after 30 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `_sum` and `_count` of `kubeproxy_network_programming_duration_seconds` (every family)
/// from the agent's `/metrics` on 127.0.0.1:10249.
fn programming_sum_count() -> Result<(f64, f64)> {
    let mut c = TcpStream::connect("127.0.0.1:10249").context("connect to the agent's /metrics")?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    c.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut text = String::new();
    c.read_to_string(&mut text)?;
    let (mut sum, mut count) = (0.0, 0.0);
    for l in text.lines() {
        let value = |l: &str| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if l.starts_with("kubeproxy_network_programming_duration_seconds_sum") {
            sum += value(l).unwrap_or(0.0);
        } else if l.starts_with("kubeproxy_network_programming_duration_seconds_count") {
            count += value(l).unwrap_or(0.0);
        }
    }
    Ok((sum, count))
}

/// One run of ebpf-proxy with the manifest source at N = `svcs.len()`: its cold start, the
/// data path, then (where `--change-at` and `--steady-at` name N) endpoint changes and the
/// RSS after the first verification. Leaves the agent running (`run_ebpf` stops it).
fn run_ebpf_inner(
    env: &mut Env,
    o: &Opts,
    svcs: &[Svc],
    real: usize,
    change_svc: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let n = svcs.len();
    let (t0, pid, maps) = ebpf_cold_start(env, o, svcs, change_svc, results, run)?;
    data_path(env, o, Case::Ebpf, &vip_target(real), n, results, run)?;
    if o.change_at.contains(&n) {
        ebpf_manifest_changes(env, o, &maps, &svcs[change_svc], n, results, run)?;
    }
    if o.steady_at.contains(&n) {
        ebpf_verified_rss(t0, pid, n, results, run)?;
    }
    Ok(())
}

/// Starts the agent on the manifests of `svcs` and records its cold start: the first
/// sync (its time and the model's part), the wall time to it, RSS and the maps' memory.
/// Returns when the agent was started, its pid, and its maps; errors when the agent does
/// not start or its maps lack the last service after the first sync.
fn ebpf_cold_start(
    env: &mut Env,
    o: &Opts,
    svcs: &[Svc],
    change_svc: usize,
    results: &mut Results,
    run: usize,
) -> Result<(Instant, u32, Maps)> {
    let n = svcs.len();
    stop_agent(env);
    write_manifests(&env.manifests, svcs, change_svc)?;
    let t0 = Instant::now();
    let (wall, pid) = start_agent(
        env,
        o,
        n,
        &["--manifests".into(), env.manifests.display().to_string()],
        None,
    )?;
    let log = agent_log(env);
    // Kept for a look at where the start-up time went (the last run's of each N).
    let _ = fs::write(o.out.join(format!("agent-cold-{n}.log")), &log);
    let first = SyncLine::nth(&log, 0).context("a `sync done` line with duration_us")?;
    if first.services as usize != n {
        eprintln!(
            "  warning: the agent synced {} services, expected {n}",
            first.services
        );
    }
    let maps = Maps::open(&env.pins.0)?;
    ensure!(
        maps.backends_of(svcs[n - 1].vip).len() == rules::ENDPOINTS,
        "the maps do not hold the last service after sync done"
    );
    let rss = proc_status_kib(pid, "VmRSS:").unwrap_or(0);
    let hwm = proc_status_kib(pid, "VmHWM:").unwrap_or(0);
    let (mem_all, mem_svc) = map_memlock(&env.pins.0);
    eprintln!(
        "  Ebpf cold: sync {:.1} ms, model {:.1} ms, wall (start to sync done) {:.1} ms, RSS {} MiB (peak {} MiB), maps {:.1} MiB (service maps {:.1} MiB)",
        first.duration_us as f64 / 1e3,
        first.model_us as f64 / 1e3,
        wall.as_secs_f64() * 1e3,
        rss / 1024,
        hwm / 1024,
        mem_all as f64 / 1048576.0,
        mem_svc as f64 / 1048576.0
    );
    results.add(
        Case::Ebpf,
        n,
        run,
        Sample::ColdMs(first.duration_us as f64 / 1e3),
    );
    results.add(
        Case::Ebpf,
        n,
        run,
        Sample::ColdModelMs(first.model_us as f64 / 1e3),
    );
    results.add(
        Case::Ebpf,
        n,
        run,
        Sample::ColdWallMs(wall.as_secs_f64() * 1e3),
    );
    results.add(Case::Ebpf, n, run, Sample::RssMiB(rss as f64 / 1024.0));
    results.add(Case::Ebpf, n, run, Sample::PeakRssMiB(hwm as f64 / 1024.0));
    results.add(
        Case::Ebpf,
        n,
        run,
        Sample::MapMiB(mem_all as f64 / 1048576.0),
    );
    results.add(
        Case::Ebpf,
        n,
        run,
        Sample::ServiceMapMiB(mem_svc as f64 / 1048576.0),
    );
    Ok((t0, pid, maps))
}

/// `--changes` endpoint changes of `svc` through the manifest source, one at a time: each
/// its last endpoint's new address written to `change.json`, timed until `maps` show it
/// and by the agent's `sync done` line (latency, map writes, model). Errors when the file
/// cannot be written, a change is not seen within 30 s, or the run is stopped.
fn ebpf_manifest_changes(
    env: &Env,
    o: &Opts,
    maps: &Maps,
    svc: &Svc,
    n: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let mut svc = svc.clone();
    let file = env.manifests.join("change.json");
    for k in 0..o.changes {
        check_stop()?;
        let new_ip = rules::change_addr(k);
        svc.endpoints[rules::ENDPOINTS - 1].0 = new_ip;
        let syncs = SyncLine::count(&agent_log(env));
        let t = Instant::now();
        write_atomic(&file, &(rules::slice_json(&svc) + "\n"))?;
        let (lat, sync) = await_change(env, maps, svc.vip, new_ip, t, syncs)
            .with_context(|| format!("change {k}"))?;
        let ms = |us: u64| us as f64 / 1e3;
        results.add(
            Case::Ebpf,
            n,
            run,
            Sample::ChangeMs(lat.as_secs_f64() * 1e3),
        );
        results.add(
            Case::Ebpf,
            n,
            run,
            Sample::ChangeLatencyMs(ms(sync.latency_us)),
        );
        results.add(
            Case::Ebpf,
            n,
            run,
            Sample::ChangeSyncMs(ms(sync.duration_us)),
        );
        results.add(Case::Ebpf, n, run, Sample::ChangeModelMs(ms(sync.model_us)));
        // A pause, so each change is read alone (a burst would be one sync).
        std::thread::sleep(Duration::from_millis(50));
    }
    results.log_change(Case::Ebpf, n, run);
    // Kept for a look at where a change's time went.
    let _ = fs::write(o.out.join(format!("agent-changes-{n}.log")), agent_log(env));
    Ok(())
}

/// Waits until the agent `pid`, started at `t0`, has run its first periodic verification,
/// then records its RSS and peak RSS (MiB). Errors only when the run is stopped.
fn ebpf_verified_rss(
    t0: Instant,
    pid: u32,
    n: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    // The verification snapshots every map entry: RSS once it has run (its loop starts
    // after loading, at most a few seconds after the process).
    let at = t0 + VERIFY_PERIOD + Duration::from_secs(8);
    while Instant::now() < at {
        check_stop()?;
        std::thread::sleep(Duration::from_millis(200));
    }
    let rss = proc_status_kib(pid, "VmRSS:").unwrap_or(0);
    let hwm = proc_status_kib(pid, "VmHWM:").unwrap_or(0);
    eprintln!(
        "  Ebpf after the first verification: RSS {} MiB (peak {} MiB)",
        rss / 1024,
        hwm / 1024
    );
    results.add(
        Case::Ebpf,
        n,
        run,
        Sample::RssVerifiedMiB(rss as f64 / 1024.0),
    );
    results.add(
        Case::Ebpf,
        n,
        run,
        Sample::PeakRssVerifiedMiB(hwm as f64 / 1024.0),
    );
    Ok(())
}

/// Starts the agent on a fresh pin directory with `source` (its source flags) and extra
/// flags, sized for `n` services, and waits for its first `sync done`. Returns the wall
/// time from the start to that line and the agent's pid.
/// `netns`: the network namespace to run it in (the bench's own when `None`).
fn start_agent(
    env: &mut Env,
    o: &Opts,
    n: usize,
    source: &[String],
    netns: Option<&Path>,
) -> Result<(Duration, u32)> {
    let room = |need: usize, default: u32| -> String {
        (((need as f64 * 1.25) as u32).max(default)).to_string()
    };
    let log = fs::File::create(&env.agent_log)?;
    let t0 = Instant::now();
    let mut cmd = Command::new(&env.agent_bin);
    cmd.arg("run")
        .args(source)
        .arg("--cgroup-path")
        .arg(env.cg.path())
        .args([
            "--pin-dir",
            PIN_DIR,
            "--healthz-bind-address",
            "127.0.0.1:0",
            "--sync-period",
            &format!("{}s", VERIFY_PERIOD.as_secs()),
        ])
        .args([
            "--max-frontends",
            &room(2 * n, proxy_common::DEFAULT_MAX_FRONTENDS),
        ])
        .args([
            "--max-backend-slots",
            &room(n * rules::ENDPOINTS, proxy_common::DEFAULT_MAX_SLOTS),
        ])
        .args([
            "--max-backends",
            &room(n * rules::ENDPOINTS, proxy_common::DEFAULT_MAX_BACKENDS),
        ])
        .args(&o.agent_arg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    let child = testbed::spawn_in(netns, None, &mut cmd).context("start the agent")?;
    let pid = child.id();
    env.agent = Some(ChildGuard::new(child));
    let deadline = t0 + Duration::from_secs(o.load_timeout);
    let wall = loop {
        check_stop()?;
        if agent_log(env).contains("sync done") {
            break t0.elapsed();
        }
        if let Some(s) = env.agent.as_mut().unwrap().try_wait()? {
            bail!("agent exited ({s}): {}", agent_log(env));
        }
        ensure!(
            Instant::now() < deadline,
            "no sync within {}s: {}",
            o.load_timeout,
            agent_log(env)
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    Ok((wall, pid))
}

/// The fields of one `sync done` line of the agent's log.
#[derive(Debug, Clone, Copy)]
struct SyncLine {
    services: u64,
    duration_us: u64,
    model_us: u64,
    latency_us: u64,
}

impl SyncLine {
    fn lines(log: &str) -> impl Iterator<Item = &str> {
        log.lines().filter(|l| l.contains("sync done"))
    }

    /// Number of `sync done` lines.
    fn count(log: &str) -> usize {
        Self::lines(log).count()
    }

    /// The `i`-th (from 0) `sync done` line.
    fn nth(log: &str, i: usize) -> Option<SyncLine> {
        let line = Self::lines(log).nth(i)?;
        Some(SyncLine {
            services: field(line, "services").unwrap_or(0),
            duration_us: field(line, "duration_us")?,
            model_us: field(line, "model_us").unwrap_or(0),
            latency_us: field(line, "latency_us").unwrap_or(0),
        })
    }
}

// ---------------------------------------------------------------------------------------
// kube-proxy's rule sets
// ---------------------------------------------------------------------------------------

/// Runs `program args` with `input` on stdin inside the case's client namespace; returns
/// how long it took. Never runs in the root namespace: the spawn fails if setns fails.
fn apply_in(
    env: &Env,
    case: Case,
    program: &str,
    args: &[&str],
    input: &Path,
    timeout: Duration,
) -> Result<Duration> {
    let pod = &env.clients[&case];
    ensure!(
        pod.netns.starts_with(&format!("{LAB}-")),
        "refusing to run {program} outside a bench namespace"
    );
    apply_in_netns(&pod.path(), program, args, input, timeout)
}

/// Runs `program args` with `input` on stdin inside the bench namespace at `ns` (a path
/// under /run/netns whose name starts with the bench's prefix [`LAB`]); returns how long
/// it took.
fn apply_in_netns(
    ns: &Path,
    program: &str,
    args: &[&str],
    input: &Path,
    timeout: Duration,
) -> Result<Duration> {
    ensure!(
        ns.parent() == Some(Path::new(testbed::NETNS_RUN_DIR))
            && ns
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(LAB)),
        "refusing to run {program} outside a bench namespace ({})",
        ns.display()
    );
    let ns = ns.to_path_buf();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(fs::File::open(input)?)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let t = Instant::now();
    let mut child = ChildGuard::spawn_in(Some(&ns), None, &mut cmd)?;
    let mut err = child.child_mut().stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut status = None;
    while status.is_none() && t.elapsed() < timeout && !STOP.load(Ordering::SeqCst) {
        status = child.wait_timeout(Duration::from_millis(200).min(timeout))?;
    }
    let took = t.elapsed();
    check_stop()?;
    let Some(status) = status else {
        child.kill();
        bail!("{program} {args:?} did not finish within {timeout:?}");
    };
    let stderr = reader.join().unwrap_or_default();
    ensure!(
        status.success(),
        "{program} {args:?} failed ({status}): {}",
        stderr.trim()
    );
    Ok(took)
}

fn reset_rules(env: &Env, o: &Opts, case: Case) -> Result<()> {
    let scratch = env.scratch.path().join("reset.txt");
    match case {
        Case::Iptables => {
            fs::write(&scratch, rules::IPTABLES_EMPTY)?;
            apply_in(
                env,
                case,
                &o.iptables_restore,
                &["-w", "5"],
                &scratch,
                Duration::from_secs(600),
            )?;
        }
        _ => {
            // Creating it first makes the delete succeed when it does not exist yet.
            fs::write(
                &scratch,
                "add table ip kube-proxy\ndelete table ip kube-proxy\n",
            )?;
            apply_in(
                env,
                case,
                "nft",
                &["-f", "-"],
                &scratch,
                Duration::from_secs(600),
            )?;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_rules(
    env: &Env,
    o: &Opts,
    case: Case,
    svcs: &[Svc],
    real: usize,
    change_svc: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let r = run_rules_inner(env, o, case, svcs, real, change_svc, results, run);
    // The next case and N start from empty tables (not timed).
    let reset = reset_rules(env, o, case);
    r.and(reset)
}

#[allow(clippy::too_many_arguments)]
fn run_rules_inner(
    env: &Env,
    o: &Opts,
    case: Case,
    svcs: &[Svc],
    real: usize,
    change_svc: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let n = svcs.len();
    reset_rules(env, o, case)?;
    let file = env.scratch.path().join("rules.txt");
    let (text, program, args): (String, &str, &[&str]) = match case {
        Case::Iptables => (
            rules::iptables_full(svcs),
            o.iptables_restore.as_str(),
            &["-w", "5", "--noflush", "--counters"],
        ),
        _ => (rules::nft_full(svcs), "nft", &["-f", "-"]),
    };
    fs::write(&file, &text)?;
    let lines = text.lines().count();
    drop(text);
    let took = match apply_in(
        env,
        case,
        program,
        args,
        &file,
        Duration::from_secs(o.peer_timeout),
    ) {
        Err(e) if e.to_string().contains("did not finish within") => {
            eprintln!(
                "  {case:?} cold: {program} of {lines} lines timed out after {} s",
                o.peer_timeout
            );
            results.timed_out.insert(case.key().to_string(), n);
            results.add(case, n, run, Sample::TimedOutS(o.peer_timeout as f64));
            results.add(case, n, run, Sample::RuleLines(lines as f64));
            return Ok(());
        }
        r => r?,
    };
    eprintln!(
        "  {case:?} cold: {program} of {lines} lines took {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    results.add(case, n, run, Sample::ColdMs(took.as_secs_f64() * 1e3));
    results.add(case, n, run, Sample::RuleLines(lines as f64));

    data_path(env, o, case, &vip_target(real), n, results, run)?;

    if o.change_at.contains(&n) {
        let mut cur = svcs[change_svc].clone();
        for k in 0..o.changes {
            check_stop()?;
            let mut next = cur.clone();
            next.endpoints[rules::ENDPOINTS - 1].0 = rules::change_addr(k);
            let text = match case {
                Case::Iptables => {
                    let mut all = svcs.to_vec();
                    all[change_svc] = next.clone();
                    rules::iptables_change(&all, &cur, &next)
                }
                _ => rules::nft_change(&cur, &next),
            };
            fs::write(&file, text)?;
            let took = apply_in(env, case, program, args, &file, Duration::from_secs(120))?;
            results.add(case, n, run, Sample::ChangeMs(took.as_secs_f64() * 1e3));
            cur = next;
        }
        results.log_change(case, n, run);
    }
    let _ = fs::remove_file(&file);
    Ok(())
}
