//! Endpoint change latency through the Kubernetes API source (the fake API server), as
//! the agent and kube-proxy's programming-duration metric account for it.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use proxy_testkit::kube_proxy_rules as rules;
use rules::Svc;

use super::agent::{Maps, SyncLine, agent_log, start_agent, v4_mapped};
use super::driver::Env;
use super::report::{Case, Results, Sample};
use super::{Opts, check_stop};

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
pub(super) fn run_api_changes(
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
pub(super) fn await_change(
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
