//! One run of ebpf-proxy at N: cold start, data path, endpoint changes through the
//! manifest source, and RSS after the first verification.

use std::fs;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use proxy_testkit::kube_proxy_rules as rules;
use rules::Svc;

use super::agent::{
    Maps, SyncLine, agent_log, map_memlock, proc_status_kib, start_agent, stop_agent, write_atomic,
    write_manifests,
};
use super::change_latency::{await_change, run_api_changes};
use super::conn_rate::{data_path, vip_target};
use super::driver::Env;
use super::report::{Case, Results, Sample};
use super::{Opts, VERIFY_PERIOD, check_stop};

pub(super) fn run_ebpf(
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
