//! The bench itself: its flags' parsers, the lab, the cgroup and pin guards, the tools
//! it needs, and the loop over N that runs every case and writes the report.

use std::collections::BTreeMap;
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use proxy_testkit::kube_proxy_rules as rules;
use proxy_testkit::testbed::{self, ChildGuard, Lab, Pod, TestCgroup};
use proxy_userspace::datapath::loader;

use super::conn_rate::{BYPASS_UID, run_bypass, run_client, run_direct, sysctl_in};
use super::ebpf_run::run_ebpf;
use super::kube_proxy::run_rules;
use super::report::{Case, Results};
use super::{CGROUP, LAB, Opts, PIN_DIR, STOP, check_stop};
use super::{micro, northsouth, progstats, report};

/// A count flag's value: a whole number of at least 1.
pub(super) fn at_least_one(v: &str) -> Result<usize, String> {
    match v.trim().parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        Ok(_) => Err("must be at least 1".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A duration flag's value in seconds: finite and above 0.
pub(super) fn positive_secs(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(_) => Err("must be a number of seconds above 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Removes the agent's pins on drop.
pub(super) struct PinGuard(pub(super) PathBuf);
impl Drop for PinGuard {
    fn drop(&mut self) {
        let _ = loader::cleanup(&self.0);
    }
}

/// Everything the bench creates. Fields drop in order: processes, pins, scratch files,
/// cgroup, lab.
pub(super) struct Env {
    pub(super) agent: Option<ChildGuard>,
    servers: Vec<ChildGuard>,
    pub(super) pins: PinGuard,
    pub(super) scratch: tempfile::TempDir,
    pub(super) cg: TestCgroup,
    pub(super) clients: BTreeMap<Case, Pod>,
    pub(super) lab: Lab,
    pub(super) me: PathBuf,
    pub(super) agent_bin: PathBuf,
    pub(super) agent_log: PathBuf,
    pub(super) manifests: PathBuf,
}

impl Drop for Env {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.terminate(Duration::from_secs(5));
        }
        self.servers.clear();
    }
}

pub(super) fn bench(mut o: Opts) -> Result<()> {
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

pub(super) fn which(tool: &str) -> Option<PathBuf> {
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
