//! `ebpf-proxy`: the node agent (`run`) and the commands that inspect (`services`) and remove
//! (`cleanup`) its data path.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::PathBuf,
    process::ExitCode,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use proxy_common::{
    Config, Counter, DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS, DEFAULT_MAX_SLOTS,
    DEFAULT_MAX_SOCKETS, FRONTEND_F_VIP_MARKER,
};
use proxy_userspace::{
    datapath::{
        Datapath,
        addr::{proto_name, to_socket_addr},
        loader::{self, MapSizes},
        maps::PinnedMaps,
    },
    metrics::Metrics,
    model::{self, NodeInfo},
    source::{KubeSource, ManifestSource, Source},
    sync::Syncer,
};
use tracing::{error, info, warn};

/// A kube-proxy replacement on eBPF: Kubernetes Services load-balanced at the socket level.
#[derive(Parser, Debug)]
#[command(name = "ebpf-proxy", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the node agent: load the data path, follow Services and EndpointSlices, sync maps.
    Run(Box<RunArgs>),
    /// Print the frontends and their backends, read from the pinned maps (works while the
    /// agent is down).
    Services(ServicesArgs),
    /// Detach the programs and remove the pinned maps and links (like kube-proxy --cleanup).
    Cleanup(CleanupArgs),
}

#[derive(clap::Args, Debug, Clone)]
struct PinArgs {
    /// Mount point of the BPF file system.
    #[arg(long, default_value = "/sys/fs/bpf")]
    bpffs: PathBuf,
    /// Directory under --bpffs holding the pinned maps and links.
    #[arg(long, default_value = "ebpf-proxy")]
    pin_dir: String,
}

impl PinArgs {
    /// The pin directory, after checking the name.
    fn dir(&self) -> Result<PathBuf> {
        loader::check_pin_dir_name(&self.pin_dir)?;
        Ok(loader::pin_dir(&self.bpffs, &self.pin_dir))
    }
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Read Services and EndpointSlices from this directory of manifests (*.yaml, *.yml,
    /// *.json), watched for changes, instead of the Kubernetes API.
    #[arg(long, conflicts_with = "kubeconfig")]
    manifests: Option<PathBuf>,
    /// Kubeconfig for the Kubernetes API [default: $KUBECONFIG or ~/.kube/config, else the
    /// in-cluster service account, as kube-rs `Config::infer`]. Read before anything is
    /// attached: a missing or broken configuration stops start-up.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Minimum time between two syncs from the API source; an isolated change after a
    /// quiet period is applied at once (kube-proxy's --min-sync-period).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    min_sync_period: Duration,
    /// Period of the full resync, which also repairs map entries changed behind the agent's
    /// back (kube-proxy's --sync-period). /healthz fails when an update stays pending for
    /// twice this long.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    sync_period: Duration,
    /// Address of the Prometheus metrics server (`/metrics`); port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:10249")]
    metrics_bind_address: SocketAddr,
    /// cgroup v2 directory to attach the socket programs to [default: the cgroup2 mount root
    /// from /proc/self/mounts, i.e. every process of the node].
    #[arg(long)]
    cgroup_path: Option<PathBuf>,
    #[command(flatten)]
    pins: PinArgs,
    /// Name of this node [default: $NODE_NAME, else the hostname].
    #[arg(long)]
    hostname_override: Option<String>,
    /// Node addresses that serve NodePorts: comma-separated CIDRs, or `primary` (the
    /// node's first InternalIP per family, kube-proxy's nftables default) [default: every
    /// InternalIP and ExternalIP of this node's Node object].
    #[arg(long, value_delimiter = ',')]
    nodeport_addresses: Vec<String>,
    /// Address of the health server (`/healthz`, `/livez`); port 0 picks a free port.
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: SocketAddr,
    /// Log level of the agent (error, warn, info, debug, trace; other crates log warnings
    /// only), or a tracing filter directive with `=` or `,` (e.g. `info,kube=debug`).
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Size of the frontend map (VIP x port x protocol, plus one entry per VIP) when created.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = DEFAULT_MAX_FRONTENDS)]
    max_frontends: u32,
    /// Size of the backend slot map (sum of all services' endpoint counts) when created.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = DEFAULT_MAX_SLOTS)]
    max_backend_slots: u32,
    /// Size of the backend map (distinct endpoint address x port x protocol) when created.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = DEFAULT_MAX_BACKENDS)]
    max_backends: u32,
    /// Size of the per-socket reverse-NAT and UDP flow maps (LRU) when created.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = DEFAULT_MAX_SOCKETS)]
    max_sockets: u32,
    /// Idle time after which an unconnected UDP flow picks a backend anew, like conntrack's
    /// nf_conntrack_udp_timeout (e.g. 30s, 2m).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    udp_flow_timeout: Duration,
    #[command(flatten)]
    tc: proxy_userspace::datapath::tc::TcArgs,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    Table,
    Json,
}

#[derive(clap::Args, Debug)]
struct ServicesArgs {
    #[command(flatten)]
    pins: PinArgs,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: Output,
}

#[derive(clap::Args, Debug)]
struct CleanupArgs {
    #[command(flatten)]
    pins: PinArgs,
    /// cgroup the programs were attached to. Accepted for symmetry with `run`: the programs
    /// are attached only through the pinned links, so removing those detaches them.
    #[arg(long)]
    cgroup_path: Option<PathBuf>,
}

/// The tracing filter for `--log-level`: a plain level applies to the agent, other crates
/// (kube, hyper, notify) log warnings only; anything with `=` or `,` is used as a directive.
fn log_filter(level: &str) -> Result<tracing_subscriber::EnvFilter> {
    const LEVELS: [&str; 6] = ["error", "warn", "info", "debug", "trace", "off"];
    let directive = if LEVELS.contains(&level) {
        format!("warn,ebpf_proxy={level},proxy_userspace={level}")
    } else if level.contains('=') || level.contains(',') {
        level.to_string()
    } else {
        anyhow::bail!(
            "invalid --log-level {level:?}: use error, warn, info, debug, trace, or a tracing directive such as info,kube=debug"
        );
    };
    tracing_subscriber::EnvFilter::try_new(&directive)
        .with_context(|| format!("invalid --log-level {level:?}"))
}

fn init_logs(filter: tracing_subscriber::EnvFilter) {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

/// Lets `ebpf-proxy services | head` end quietly, as other CLI tools do (Rust ignores
/// SIGPIPE, which turns a closed pipe into a panic in `println!`). Not for `run`: the agent
/// must survive a peer closing a socket.
fn restore_sigpipe() {
    // SAFETY: resetting a signal disposition to its default before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => match log_filter(&args.log_level) {
            Ok(filter) => {
                init_logs(filter);
                run(*args)
            }
            Err(e) => Err(e),
        },
        Command::Services(args) => {
            restore_sigpipe();
            services(args)
        }
        Command::Cleanup(args) => {
            restore_sigpipe();
            cleanup(args)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line per cause, the first names the failing step.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Health as kube-proxy's healthz server reports it (`pkg/proxy/healthcheck`): healthy once
/// a sync succeeded, unless an update has been pending for longer than the timeout.
struct Health {
    /// Time of the last successful sync; `None` until the first one.
    last_updated: Option<SystemTime>,
    /// When the oldest update not yet applied arrived; `None` when none is pending.
    queued: Option<SystemTime>,
    /// How long an update may stay pending before /healthz fails.
    timeout: Duration,
}

impl Health {
    fn healthy(&self, now: SystemTime) -> bool {
        self.last_updated.is_some()
            && self
                .queued
                .is_none_or(|q| now.duration_since(q).unwrap_or_default() < self.timeout)
    }
}

async fn healthz(
    axum::extract::State(h): axum::extract::State<Arc<Mutex<Health>>>,
) -> (axum::http::StatusCode, axum::Json<serde_json::Value>) {
    let now = SystemTime::now();
    let (last, healthy) = {
        let h = h.lock().unwrap();
        (h.last_updated, h.healthy(now))
    };
    let fmt = |t: SystemTime| humantime::format_rfc3339_millis(t).to_string();
    let body = serde_json::json!({
        "lastUpdated": last.map(fmt).unwrap_or_default(),
        "currentTime": fmt(now),
    });
    let code = if healthy {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body))
}

async fn metrics_handler(
    axum::extract::State(m): axum::extract::State<Arc<Metrics>>,
) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
}

/// Serves `app` on a bound listener in the background; returns its address.
fn serve(
    what: &'static str,
    listener: std::net::TcpListener,
    app: axum::Router,
) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let local = listener.local_addr()?;
    info!(address = %local, "{what} server listening");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            error!(error = %e, "{what} server stopped");
        }
    });
    Ok(local)
}

/// Counts objects added, changed or removed between two maps of one kind.
fn changes<T: PartialEq>(
    old: &std::collections::BTreeMap<(String, String), T>,
    new: &std::collections::BTreeMap<(String, String), T>,
) -> u64 {
    let changed = new.iter().filter(|(k, v)| old.get(*k) != Some(*v)).count();
    let removed = old.keys().filter(|k| !new.contains_key(*k)).count();
    (changed + removed) as u64
}

/// The Kubernetes API configuration (`--kubeconfig`, else `Config::infer`: KUBECONFIG,
/// ~/.kube/config, in-cluster); `None` with `--manifests`. Resolved before the data path is
/// touched, so a missing or broken configuration changes nothing.
async fn kube_config(args: &RunArgs) -> Result<Option<kube::Config>> {
    if args.manifests.is_some() {
        return Ok(None);
    }
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            anyhow::anyhow!(
                "no usable Kubernetes API configuration ({e}); pass --kubeconfig or --manifests, set KUBECONFIG, or run in a pod"
            )
        })?,
    };
    Ok(Some(config))
}

async fn start_source(
    args: &RunArgs,
    node: &NodeInfo,
    config: Option<kube::Config>,
) -> Result<tokio::sync::mpsc::Receiver<proxy_userspace::source::Snapshot>> {
    let (Some(config), None) = (config, &args.manifests) else {
        let dir = args.manifests.as_ref().context("no source")?;
        info!(dir = %dir.display(), "source: manifests");
        return ManifestSource::new(dir).start();
    };
    info!(server = %config.cluster_url, "source: Kubernetes API");
    let client = kube::Client::try_from(config).context("create the Kubernetes client")?;
    KubeSource::new(client, node.name.clone(), args.min_sync_period).start()
}

/// Releases UDP flows and connected UDP sockets translated to endpoints that left their
/// service in the last sync (see `PinnedMaps::release_stale`); failures are logged, the
/// next removal retries nothing (LRU entries of closed sockets age out on their own).
fn release_stale(maps: &PinnedMaps, released: &[(u32, u32, proxy_common::Backend)]) {
    if released.is_empty() {
        return;
    }
    match maps.release_stale(released) {
        Ok(r) => info!(
            endpoints = released.len(),
            udp_flows = r.flows,
            connected_udp_sockets = r.sockets,
            "released UDP flows and sockets of removed endpoints"
        ),
        Err(e) => error!(error = %e, "releasing UDP flows of removed endpoints failed"),
    }
}

/// `--nodeport-addresses`: comma-separated CIDRs, or `primary`; empty is every address.
fn parse_nodeport_addresses(list: &[String]) -> Result<(Vec<model::Cidr>, bool)> {
    let mut cidrs = Vec::new();
    let mut primary = false;
    for item in list
        .iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        if item == "primary" {
            primary = true;
        } else {
            cidrs.push(
                item.parse::<model::Cidr>()
                    .map_err(|e| anyhow::anyhow!("--nodeport-addresses: {e}"))?,
            );
        }
    }
    if primary && !cidrs.is_empty() {
        anyhow::bail!("--nodeport-addresses: `primary` cannot be combined with CIDRs");
    }
    Ok((cidrs, primary))
}

fn node_name(flag: Option<String>) -> String {
    flag.filter(|s| !s.is_empty())
        .or_else(|| std::env::var("NODE_NAME").ok().filter(|s| !s.is_empty()))
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_default()
}

fn run(args: RunArgs) -> Result<()> {
    let (nodeport_addresses, nodeport_primary) =
        parse_nodeport_addresses(&args.nodeport_addresses)?;
    let node = NodeInfo {
        nodeport_addresses,
        nodeport_primary,
        name: node_name(args.hostname_override.clone()),
    };
    // Check every input before touching the data path, so a mistake changes nothing.
    let dir = args.pins.dir()?;
    if let Some(m) = &args.manifests {
        std::fs::read_dir(m)
            .with_context(|| format!("--manifests {}: cannot read the directory", m.display()))?;
    }
    if let Some(k) = &args.kubeconfig {
        std::fs::metadata(k).with_context(|| format!("--kubeconfig {}", k.display()))?;
    }
    loader::ensure_bpffs(&args.pins.bpffs)?;
    let cgroup = match &args.cgroup_path {
        Some(p) => p.clone(),
        None => loader::cgroup2_root()?,
    };
    loader::check_cgroup(&cgroup)?;
    let bind = |what: &str, addr: SocketAddr| -> Result<std::net::TcpListener> {
        let l = std::net::TcpListener::bind(addr)
            .with_context(|| format!("bind the {what} server to {addr}"))?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    let health_listener = bind("health", args.healthz_bind_address)?;
    let metrics_listener = bind("metrics", args.metrics_bind_address)?;
    let sizes = MapSizes {
        frontends: args.max_frontends,
        slots: args.max_backend_slots,
        backends: args.max_backends,
        sockets: args.max_sockets,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let config = rt.block_on(kube_config(&args))?;
    let fresh = !dir.exists();
    let _lock = loader::lock_pin_dir(&dir)?;

    rt.block_on(async move {
        // Start-up: on failure, a pin directory this run created is removed again (one that
        // was adopted keeps serving the node).
        let started = async {
            loader::load_and_attach(&dir, &cgroup, sizes)?;
            info!(pin_dir = %dir.display(), cgroup = %cgroup.display(), node = %node.name, "data path attached");
            let maps = PinnedMaps::open(&dir).context("open the pinned maps")?;
            maps.write_config(&Config {
                udp_flow_timeout_ns: args.udp_flow_timeout.as_nanos().min(u64::MAX as u128) as u64,
                _reserved: 0,
            })?;
            let cap = maps.capacity();
            if cap.frontends != args.max_frontends || cap.slots != args.max_backend_slots || cap.backends != args.max_backends {
                warn!(?cap, "adopted pinned maps keep the sizes they were created with; run `ebpf-proxy cleanup` to resize");
            }
            let tc = proxy_userspace::datapath::tc::TcPath::new(&dir, args.tc.clone())?;
            let syncer = Syncer::adopt(&maps).context("read the pinned maps")?;
            info!(services = syncer.bound_services(), "adopted state from pinned maps");
            let rx = start_source(&args, &node, config).await?;
            anyhow::Ok((maps, syncer, rx, tc))
        }
        .await;
        let (mut maps, mut syncer, mut rx, mut tc) = match started {
            Ok(v) => v,
            Err(e) => {
                if fresh {
                    let _ = loader::cleanup(&dir);
                }
                return Err(e);
            }
        };
        let health = Arc::new(Mutex::new(Health { last_updated: None, queued: None, timeout: args.sync_period * 2 }));
        let metrics = Arc::new(Metrics::new(dir.clone()));
        let health_app = axum::Router::new()
            .route("/healthz", axum::routing::get(healthz))
            .route("/livez", axum::routing::get(healthz))
            .with_state(health.clone());
        serve("health", health_listener, health_app)?;
        let metrics_app =
            axum::Router::new().route("/metrics", axum::routing::get(metrics_handler)).with_state(metrics.clone());
        serve("metrics", metrics_listener, metrics_app)?;

        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut resync = tokio::time::interval(args.sync_period);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        resync.tick().await;
        let mut logged: BTreeSet<String> = BTreeSet::new();
        let mut previous = proxy_userspace::source::ObjectSet::default();
        let mut desired: Option<model::DesiredState> = None;
        let mut model_cache = model::ModelCache::default();
        loop {
            let snap = tokio::select! {
                s = rx.recv() => match s {
                    Some(s) => Some(s),
                    None => anyhow::bail!("the object source stopped"),
                },
                _ = resync.tick() => None,
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
            };
            let Some(mut snap) = snap else {
                // Full resync: compare with what the kernel holds, not with our copy.
                if let Some(d) = &desired {
                    match Syncer::adopt(&maps) {
                        Ok(mut fresh) => match fresh.sync(&mut maps, d) {
                            Ok(st) if st.writes + st.deletes > 0 => {
                                release_stale(&maps, &st.released);
                                warn!(writes = st.writes, deletes = st.deletes, "full resync repaired map entries changed outside the agent");
                                syncer = fresh;
                            }
                            Ok(_) => syncer = fresh,
                            Err(e) => error!(error = %e, "full resync failed"),
                        },
                        Err(e) => error!(error = %e, "full resync: reading the maps failed"),
                    }
                }
                continue;
            };
            // Use only the newest snapshot when several queued up.
            while let Ok(newer) = rx.try_recv() {
                snap = newer;
            }
            let received = SystemTime::now();
            {
                let mut h = health.lock().unwrap();
                h.queued.get_or_insert(received);
            }
            metrics.service_changes.inc_by(changes(&previous.services, &snap.objects.services));
            metrics.endpoint_changes.inc_by(changes(&previous.endpoint_slices, &snap.objects.endpoint_slices));
            let model_start = std::time::Instant::now();
            let (d, model_errors) = model::build_cached(&snap.objects, &node, &mut model_cache);
            let model_us = model_start.elapsed().as_micros() as u64;
            // Each skipped object is reported once while it stays bad, not on every sync.
            let now: BTreeSet<String> =
                snap.errors.iter().chain(model_errors.iter()).map(|e| e.to_string()).collect();
            for e in now.difference(&logged) {
                error!("{e}");
            }
            logged = now;
            metrics.skipped.set(logged.len() as i64);
            if d.services.is_empty() && syncer.bound_services() > 0 {
                warn!(
                    services = syncer.bound_services(),
                    "the source holds no Services: removing every Service from the data path"
                );
            }
            match syncer.sync(&mut maps, &d) {
                Ok(st) => {
                    release_stale(&maps, &st.released);
                    let done = SystemTime::now();
                    {
                        let mut h = health.lock().unwrap();
                        h.last_updated = Some(done);
                        h.queued = None;
                    }
                    metrics.synced(st.duration, syncer.current(), maps.capacity());
                    for (key, slice) in &snap.objects.endpoint_slices {
                        if previous.endpoint_slices.get(key) == Some(slice) {
                            continue;
                        }
                        let trigger = slice.object.metadata.annotations.as_ref().and_then(|a| a.get("endpoints.kubernetes.io/last-change-trigger-time"));
                        if let Some(lat) = proxy_userspace::metrics::programming_latency(trigger.map(String::as_str), done) {
                            metrics.network_programming.observe(lat);
                        }
                    }
                    info!(
                        services = st.services,
                        frontends = st.frontends,
                        backends = st.backends,
                        writes = st.writes,
                        deletes = st.deletes,
                        skipped = logged.len(),
                        duration_us = st.duration.as_micros() as u64,
                        model_us,
                        "sync done"
                    );
                    tc.sync(&snap.objects, &node, &d);
                    desired = Some(d);
                }
                Err(e) => {
                    metrics.sync_errors.inc();
                    error!(error = %e, "sync failed; the data path keeps its previous state");
                }
            }
            previous = snap.objects;
        }
        info!("stopping; the data path stays attached and pinned for the next agent (use `ebpf-proxy cleanup` to remove it)");
        Ok(())
    })
}

#[derive(serde::Serialize)]
struct ServiceRow {
    service: String,
    frontend: String,
    protocol: &'static str,
    service_id: u32,
    backends: Vec<String>,
}

fn services(args: ServicesArgs) -> Result<()> {
    let dir = args.pins.dir()?;
    let maps = PinnedMaps::open(&dir).with_context(|| {
        format!(
            "no ebpf-proxy data path pinned at {} (is the agent running? check --bpffs/--pin-dir)",
            dir.display()
        )
    })?;
    let snap = maps.snapshot()?;
    let mut rows = Vec::new();
    for (k, f) in &snap.frontends {
        if f.flags & FRONTEND_F_VIP_MARKER != 0 {
            continue;
        }
        let backends = (0..f.backend_count)
            .map(|slot| {
                let key = proxy_common::BackendSlotKey {
                    service_id: f.service_id,
                    slot,
                };
                match snap.slots.get(&key).and_then(|id| snap.backends.get(id)) {
                    Some(b) => to_socket_addr(b.addr, b.port).to_string(),
                    None => "<missing>".to_string(),
                }
            })
            .collect();
        rows.push(ServiceRow {
            service: snap
                .names
                .get(&f.service_id)
                .cloned()
                .unwrap_or_else(|| "?".into()),
            frontend: to_socket_addr(k.addr, k.port).to_string(),
            protocol: proto_name(k.proto),
            service_id: f.service_id,
            backends,
        });
    }
    rows.sort_by(|a, b| (&a.service, &a.frontend).cmp(&(&b.service, &b.frontend)));
    if args.output == Output::Json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let header = ["SERVICE", "FRONTEND", "PROTO", "ID", "BACKENDS"];
    let table: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            let b = if r.backends.is_empty() {
                "<none: refused>".to_string()
            } else {
                r.backends.join(",")
            };
            [
                r.service.clone(),
                r.frontend.clone(),
                r.protocol.to_string(),
                r.service_id.to_string(),
                b,
            ]
        })
        .collect();
    let mut w = header.map(str::len);
    for row in &table {
        for (i, c) in row.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |r: [&str; 5]| {
        println!(
            "{:<w0$}  {:<w1$}  {:<w2$}  {:>w3$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2],
            w3 = w[3]
        );
    };
    line(header);
    for r in &table {
        line([&r[0], &r[1], &r[2], &r[3], &r[4]]);
    }
    if let Ok(c) = maps.counters() {
        let parts: Vec<String> = Counter::ALL
            .iter()
            .map(|(idx, name)| format!("{name}={}", c.get(*idx as usize).copied().unwrap_or(0)))
            .collect();
        println!("\ncounters: {}", parts.join(" "));
    }
    Ok(())
}

fn cleanup(args: CleanupArgs) -> Result<()> {
    let dir = args.pins.dir()?;
    let r = loader::cleanup(&dir)?;
    for l in &r.links {
        println!("detached {}", l.display());
    }
    for m in &r.maps {
        println!("removed {}", m.display());
    }
    if r.dir_removed {
        println!("removed {}", dir.display());
    } else if r.links.is_empty() && r.maps.is_empty() {
        println!("nothing to clean up at {}", dir.display());
    }
    let _ = args.cgroup_path;
    Ok(())
}
