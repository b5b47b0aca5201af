//! The ClusterIP data path: connection rate and latency from a client pod (directly, per
//! case, and for a pod that bypasses the socket path).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use proxy_testkit::kube_proxy_rules as rules;
use proxy_testkit::testbed::{self, Pod};
use rules::Svc;

use super::agent::{agent_log, start_agent, stop_agent, wait_idle, write_atomic, write_manifests};
use super::child::ClientResult;
use super::driver::Env;
use super::progstats;
use super::report::{Case, Results, Sample};
use super::{Opts, check_stop};

pub(super) fn sysctl_in(pod: &Pod, key: &str, value: &str) -> Result<()> {
    let out = pod.output(
        None,
        Command::new("sh").args(["-c", &format!("echo {value} > /proc/sys/{key}")]),
        Duration::from_secs(10),
    )?;
    ensure!(out.status.success(), "sysctl {key} in {}", pod.netns);
    Ok(())
}

/// Runs the load client in the case's client pod (in the bench cgroup for ebpf-proxy).
pub(super) fn run_client(
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
pub(super) fn run_client_in(
    me: &Path,
    ns: &Path,
    cg: Option<&Path>,
    to: &str,
    count: usize,
    secs: f64,
    warmup: usize,
) -> Result<ClientResult> {
    load_client(me, ns, cg, "client", to, count, secs, warmup, 60.0)
}

/// Runs this binary's load client `subcommand` (`client`, `udp-client`) in the namespace at
/// `ns` and `cg` against `to` (`count` at once for `secs` seconds after `warmup`), allowed
/// `secs + slack_s` seconds, and parses the JSON line it prints.
#[allow(clippy::too_many_arguments)]
pub(super) fn load_client<T: serde::de::DeserializeOwned>(
    me: &Path,
    ns: &Path,
    cg: Option<&Path>,
    subcommand: &str,
    to: &str,
    count: usize,
    secs: f64,
    warmup: usize,
    slack_s: f64,
) -> Result<T> {
    let out = testbed::output_in(
        Some(ns),
        cg,
        Command::new(me).args([
            subcommand,
            "--to",
            to,
            "--count",
            &count.to_string(),
            "--secs",
            &secs.to_string(),
            "--warmup",
            &warmup.to_string(),
        ]),
        Duration::from_secs_f64(secs + slack_s),
    )?;
    ensure!(
        out.status.success(),
        "{subcommand} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).with_context(|| format!("{subcommand} output {line:?}"))
}

/// Measures the data path of `case` towards `to`, records it.
pub(super) fn data_path(
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

pub(super) fn run_direct(
    env: &Env,
    o: &Opts,
    n: usize,
    results: &mut Results,
    run: usize,
) -> Result<()> {
    let to: Vec<String> = (0..rules::ENDPOINTS)
        .map(|j| format!("{}:{}", rules::real_backend(j), rules::REAL_PORT))
        .collect();
    data_path(env, o, Case::Direct, &to.join(","), n, results, run)
}

/// UID of the bypassed client pod (`Case::Bypass`).
pub(super) const BYPASS_UID: &str = "00000000-bench-bypass";
/// The node name the agent of the `bypass` case runs as (the Pod's `spec.nodeName`).
const BYPASS_NODE: &str = "bench-node";

/// ebpf-proxy's per-packet path: the agent with the same manifests plus the client pod
/// `c-bypass` opted out of socket-level translation, started in the lab's node namespace
/// (where the pod's veth has its node side), once its programs are on the pod's interface;
/// then the same data-path run as the other cases, from that pod (in the bench cgroup, so
/// the socket programs see its connections and leave them alone).
pub(super) fn run_bypass(
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

pub(super) fn vip_target(real: usize) -> String {
    format!("{}:{}", rules::vip(real), rules::SVC_PORT)
}
