//! `ebpf-proxy`: the node agent (`run`), the preflight (`check`), and the commands that
//! inspect (`services`) and remove (`cleanup`) its data path.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::PathBuf,
    process::ExitCode,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use proxy_common::{
    Config, Counter, DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS, DEFAULT_MAX_SLOTS,
    DEFAULT_MAX_SOCKETS,
};
use proxy_userspace::{
    check,
    config::{self, ClusterCidrs, LogFormat, NodePortAddresses},
    datapath::{
        Datapath,
        loader::{self, MapSizes},
        maps::PinnedMaps,
    },
    metrics::Metrics,
    model::{self, NodeInfo},
    source::{KubeSource, ManifestSource, Source},
    sync::Syncer,
};
use tracing::{debug, error, info, warn};

/// A kube-proxy replacement on eBPF: Kubernetes Services load-balanced at the socket level
/// for clients on the node, and by tc programs for traffic entering it.
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
    /// List the backends with the services using them and their connection counters.
    Backends(ServicesArgs),
    /// Print the per-service counters (connections, refusals) and the per-reason data path
    /// counters.
    Stats(ServicesArgs),
    /// List the socket-level translations: connected sockets and unconnected UDP flows,
    /// with idle time and staleness.
    Conntrack(ServicesArgs),
    /// Explain what happens to a connection from this node to ADDR:PORT[/PROTO]: matching
    /// frontends, backends and counters; with --manifests or --api also every endpoint of
    /// the Service and why it is or is not eligible (policy, zone, terminating).
    Explain(ExplainArgs),
    /// List ClientIP session-affinity entries (service, client, backend, age, expiry), read
    /// from the pinned maps.
    Affinity(ServicesArgs),
    /// Detach the programs and remove the pinned maps and links (like kube-proxy --cleanup).
    Cleanup(CleanupArgs),
    /// Preflight: check that this node can run the agent (kernel, BTF, bpffs, cgroup v2,
    /// program and map types, helpers, memlock, kube-proxy rules). Exit code 1 on a failure.
    Check(CheckArgs),
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
    /// kube-proxy configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1).
    /// Flags given on the command line override its values.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
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
    #[arg(long, default_value = "30s", value_parser = parse_positive_duration)]
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
    /// Backend selection of Services without the `ebpf-proxy.io/lb-algorithm` annotation:
    /// random (kube-proxy's), round-robin, weighted-round-robin, least-connections,
    /// source-hash or maglev.
    #[arg(long, default_value = "random", value_parser = parse_lb_algorithm)]
    lb_algorithm: proxy_common::Algorithm,
    /// Size of the Maglev lookup tables of source-hash and maglev Services: a prime from 7 to
    /// 65521 (larger tables spread backends more evenly; each costs 4 bytes per entry).
    #[arg(long, default_value_t = proxy_common::MAGLEV_DEFAULT, value_parser = parse_maglev_size)]
    maglev_table_size: u32,
    /// Address of the health server (`/healthz`, `/livez`); port 0 picks a free port.
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: SocketAddr,
    /// Log level of the agent (error, warn, info, debug, trace; other crates log warnings
    /// only), or a tracing filter directive with `=` or `,` (e.g. `info,kube=debug`).
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Log format: one text line or one JSON object per event.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
    /// CIDR of the cluster's pods, or an IPv4 and an IPv6 CIDR separated by a comma
    /// (kube-proxy's --cluster-cidr): traffic entering the node to a cluster IP from a
    /// client outside the prefix of its family is masqueraded (tc path).
    #[arg(long)]
    cluster_cidr: Option<ClusterCidrs>,
    /// Node addresses that serve NodePorts: comma-separated CIDRs, or `primary` (the
    /// node's first InternalIP per family, kube-proxy's nftables default) [default: every
    /// InternalIP and ExternalIP of this node's Node object] (kube-proxy's
    /// --nodeport-addresses).
    #[arg(long)]
    nodeport_addresses: Option<NodePortAddresses>,
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
    #[arg(long, default_value = "30s", value_parser = parse_positive_duration)]
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
struct CheckArgs {
    /// Mount point of the BPF file system.
    #[arg(long, default_value = "/sys/fs/bpf")]
    bpffs: PathBuf,
    /// Mount bpffs at --bpffs when it is not mounted (otherwise that is a failure).
    #[arg(long)]
    mount_bpffs: bool,
    /// cgroup v2 directory the programs would attach to [default: the cgroup2 mount root].
    #[arg(long)]
    cgroup_path: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: Output,
}

#[derive(clap::Args, Debug)]
struct ExplainArgs {
    /// The destination, e.g. `10.96.0.10:53/UDP` (protocol TCP when left out).
    target: String,
    #[command(flatten)]
    pins: PinArgs,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: Output,
    /// Read the Services, EndpointSlices and Nodes from this manifest directory to explain
    /// endpoint eligibility.
    #[arg(long, conflicts_with = "api")]
    manifests: Option<PathBuf>,
    /// Read them from the Kubernetes API (--kubeconfig, else $KUBECONFIG, ~/.kube/config or
    /// the in-cluster service account).
    #[arg(long)]
    api: bool,
    /// Kubeconfig for --api.
    #[arg(long, requires = "api")]
    kubeconfig: Option<PathBuf>,
    /// This node's name, for Local policies and topology [default: $NODE_NAME, else the
    /// hostname].
    #[arg(long)]
    hostname_override: Option<String>,
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

fn init_logs(filter: tracing_subscriber::EnvFilter, format: LogFormat) {
    use std::io::IsTerminal;
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().init(),
    }
}

/// Fills every setting of `run` that was not given as a flag from the configuration file,
/// as kube-proxy does with `--config`: a flag given on the command line wins, a flag left at
/// its default does not.
fn apply_config(args: &mut RunArgs, m: &clap::ArgMatches, file: config::FileSettings) {
    use config::{fill, given};
    // The file's kubeconfig is a source choice; --manifests is the other one.
    if !given(m, "manifests") {
        fill(
            &mut args.kubeconfig,
            given(m, "kubeconfig"),
            file.kubeconfig.map(Some),
        );
    }
    fill(
        &mut args.hostname_override,
        given(m, "hostname_override"),
        file.hostname_override.map(Some),
    );
    fill(
        &mut args.healthz_bind_address,
        given(m, "healthz_bind_address"),
        file.healthz_bind_address,
    );
    fill(
        &mut args.metrics_bind_address,
        given(m, "metrics_bind_address"),
        file.metrics_bind_address,
    );
    fill(
        &mut args.cluster_cidr,
        given(m, "cluster_cidr"),
        file.cluster_cidr.map(Some),
    );
    fill(
        &mut args.nodeport_addresses,
        given(m, "nodeport_addresses"),
        file.node_port_addresses.map(Some),
    );
    fill(
        &mut args.sync_period,
        given(m, "sync_period"),
        file.sync_period,
    );
    fill(
        &mut args.min_sync_period,
        given(m, "min_sync_period"),
        file.min_sync_period,
    );
    fill(
        &mut args.udp_flow_timeout,
        given(m, "udp_flow_timeout"),
        file.udp_flow_timeout,
    );
    fill(
        &mut args.tc.conntrack_max_per_core,
        given(m, "conntrack_max_per_core"),
        file.conntrack_max_per_core,
    );
    fill(
        &mut args.tc.conntrack_min,
        given(m, "conntrack_min"),
        file.conntrack_min,
    );
    fill(
        &mut args.tc.conntrack_tcp_timeout_established,
        given(m, "conntrack_tcp_timeout_established"),
        file.conntrack_tcp_timeout_established,
    );
    fill(
        &mut args.tc.conntrack_udp_timeout_stream,
        given(m, "conntrack_udp_timeout_stream"),
        file.conntrack_udp_timeout_stream,
    );
    fill(
        &mut args.log_format,
        given(m, "log_format"),
        file.log_format,
    );
}

/// `run` up to the agent: the configuration file merged into the flags, then the logs.
fn start_run(mut args: RunArgs, m: Option<&clap::ArgMatches>) -> Result<()> {
    let mut warnings = Vec::new();
    if let (Some(path), Some(m)) = (args.config.clone(), m) {
        let loaded = config::load(&path)?;
        apply_config(&mut args, m, loaded.settings);
        warnings = loaded.warnings;
    }
    check_periods(&args)?;
    init_logs(log_filter(&args.log_level)?, args.log_format);
    for w in &warnings {
        warn!("{w}");
    }
    run(args)
}

/// kube-proxy's validation: `--min-sync-period` may not exceed `--sync-period`, whether
/// they come from flags or the configuration file.
fn check_periods(args: &RunArgs) -> Result<()> {
    if args.sync_period > MAX_PERIOD {
        anyhow::bail!("--sync-period must be at most 8760h (a year)");
    }
    if args.min_sync_period > args.sync_period {
        anyhow::bail!(
            "--min-sync-period ({}) is longer than --sync-period ({})",
            humantime::format_duration(args.min_sync_period),
            humantime::format_duration(args.sync_period)
        );
    }
    Ok(())
}

/// Lets `ebpf-proxy services | head` end quietly, as other CLI tools do (Rust ignores
/// SIGPIPE, which turns a closed pipe into a panic in `println!`). Not for `run`: the agent
/// must survive a peer closing a socket.
fn restore_sigpipe() {
    // SAFETY: resetting a signal disposition to its default before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::Run(args) => start_run(*args, matches.subcommand_matches("run")),
        Command::Check(args) => {
            restore_sigpipe();
            return check_command(args);
        }
        Command::Services(args) => {
            restore_sigpipe();
            services(args)
        }
        Command::Affinity(args) => {
            restore_sigpipe();
            affinity(args)
        }
        Command::Backends(args) => {
            restore_sigpipe();
            inspect_with(args, proxy_userspace::inspect::print_backends)
        }
        Command::Stats(args) => {
            restore_sigpipe();
            inspect_with(args, proxy_userspace::inspect::print_stats)
        }
        Command::Conntrack(args) => {
            restore_sigpipe();
            inspect_with(args, proxy_userspace::inspect::print_conntrack)
        }
        Command::Explain(args) => {
            restore_sigpipe();
            explain(args)
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

/// A duration greater than zero (humantime syntax).
fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    if d > MAX_PERIOD {
        return Err("must be at most 8760h (a year)".into());
    }
    Ok(d)
}

/// Longest period or timeout accepted (timer arithmetic stays far from overflow).
const MAX_PERIOD: Duration = Duration::from_secs(365 * 24 * 3600);

fn parse_lb_algorithm(s: &str) -> Result<proxy_common::Algorithm, String> {
    model::parse_algorithm(s).ok_or_else(|| {
        let names: Vec<&str> = proxy_common::Algorithm::ALL
            .iter()
            .map(|(_, n)| *n)
            .collect();
        format!("{s:?} is not one of {}", names.join(", "))
    })
}

fn parse_maglev_size(s: &str) -> Result<u32, String> {
    let n: u32 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !proxy_userspace::maglev::is_prime(n) || n as usize > proxy_common::MAGLEV_MAX || n < 7 {
        return Err(format!(
            "{n} is not a prime between 7 and {} (e.g. 251, 1021, 4093, 16381, 65521)",
            proxy_common::MAGLEV_MAX
        ));
    }
    Ok(n)
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
    let (nodeport_addresses, nodeport_primary) = match &args.nodeport_addresses {
        None => (Vec::new(), false),
        Some(NodePortAddresses::Primary) => (Vec::new(), true),
        Some(NodePortAddresses::Cidrs(c)) => (c.clone(), false),
    };
    let node = NodeInfo {
        default_algorithm: args.lb_algorithm,
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
    proxy_userspace::datapath::tc::check_interfaces(&args.tc.interfaces)?;
    preflight(&args)?;
    let cgroup = match &args.cgroup_path {
        Some(p) => p.clone(),
        None => loader::cgroup2_root()?,
    };
    if let Some(c) = &args.cluster_cidr {
        info!(cluster_cidr = %c, "cluster CIDR");
    }
    if let Some(n) = &args.nodeport_addresses {
        info!(nodeport_addresses = %n, "NodePort addresses");
    }
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
        conntrack_flows: args.tc.conntrack_flows(),
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
            if let Ok(ct) = aya::maps::MapInfo::from_pin(dir.join(proxy_common::nat::CONNTRACK))
                && ct.max_entries() != sizes.conntrack_entries()
            {
                warn!(
                    pinned_entries = ct.max_entries(),
                    wanted_entries = sizes.conntrack_entries(),
                    "the adopted north-south conntrack keeps the size it was created with; run `ebpf-proxy cleanup` to resize"
                );
            }
            let cluster_cidrs = args.cluster_cidr.as_ref().map(|c| c.0.clone()).unwrap_or_default();
            let tc = proxy_userspace::datapath::tc::TcPath::new(&dir, args.tc.clone(), &cluster_cidrs, args.udp_flow_timeout)?;
            let mut syncer = Syncer::adopt(&maps).context("read the pinned maps")?;
            syncer.set_maglev_size(args.maglev_table_size);
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
        let health = Arc::new(Mutex::new(Health { last_updated: None, queued: None, timeout: args.sync_period.saturating_mul(2) }));
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
        // Least-connections counts of tc flows that timed out or were evicted (no FIN/RST
        // for the data path to see) are given back by a periodic collection.
        let mut collect = tokio::time::interval(proxy_userspace::datapath::tc::lc_collect_interval(args.udp_flow_timeout));
        collect.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut collect_failed = false;
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
                _ = collect.tick() => {
                    match tc.collect_lc_flows() {
                        Ok(n) => {
                            if n > 0 {
                                debug!(flows = n, "least-connections counts of ended tc flows given back");
                            }
                            collect_failed = false;
                        }
                        // Logged once while it lasts; the counts of ended flows stay until it works.
                        Err(e) => {
                            if !collect_failed {
                                error!(error = %format!("{e:#}"), "collecting ended least-connections tc flows failed");
                            }
                            collect_failed = true;
                        }
                    }
                    continue;
                }
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
            };
            let Some(mut snap) = snap else {
                // Health-check ports whose bind failed are retried at every resync.
                tc.retry_health();
                // Full resync: compare with what the kernel holds, not with our copy.
                if let Some(d) = &desired {
                    let adopted = Syncer::adopt(&maps).map(|mut s| {
                        s.set_maglev_size(args.maglev_table_size);
                        s
                    });
                    match adopted {
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

/// The preflight checks of `run` (without the program probes: the load that follows reports
/// its own failures with the step); a failure stops start-up with the message `check` prints.
fn preflight(args: &RunArgs) -> Result<()> {
    let results = check::run_checks(&check::Options {
        bpffs: args.pins.bpffs.clone(),
        mount_bpffs: true,
        cgroup: args.cgroup_path.clone(),
        probe_programs: false,
    });
    for r in &results {
        match r.status {
            check::Status::Ok => tracing::debug!(check = r.check, "preflight: {}", r.detail),
            check::Status::Warn | check::Status::Skip => warn!("preflight: {}", r.message()),
            check::Status::Fail => {}
        }
    }
    let failures: Vec<String> = results
        .iter()
        .filter(|r| r.status == check::Status::Fail)
        .map(|r| r.message())
        .collect();
    if !failures.is_empty() {
        anyhow::bail!("preflight check failed: {}", failures.join("; "));
    }
    Ok(())
}

/// `ebpf-proxy check`: exit code 0 when nothing failed, 1 otherwise.
fn check_command(args: CheckArgs) -> ExitCode {
    let results = check::run_checks(&check::Options {
        bpffs: args.bpffs,
        mount_bpffs: args.mount_bpffs,
        cgroup: args.cgroup_path,
        probe_programs: true,
    });
    match args.output {
        Output::Json => match serde_json::to_string_pretty(&results) {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
        Output::Table => print!("{}", check::table(&results)),
    }
    if check::failed(&results) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn services(args: ServicesArgs) -> Result<()> {
    let dir = args.pins.dir()?;
    let maps = open_pins(&dir)?;
    proxy_userspace::inspect::print_services(&maps, args.output == Output::Json)?;
    if args.output == Output::Table
        && let Ok(c) = maps.counters()
    {
        let parts: Vec<String> = Counter::ALL
            .iter()
            .map(|(idx, name)| format!("{name}={}", c.get(*idx as usize).copied().unwrap_or(0)))
            .collect();
        println!("\ncounters: {}", parts.join(" "));
    }
    Ok(())
}

fn affinity(args: ServicesArgs) -> Result<()> {
    let dir = args.pins.dir()?;
    let maps = open_pins(&dir)?;
    proxy_userspace::inspect::print_affinity(&dir, &maps, args.output == Output::Json)
}

fn inspect_with(
    args: ServicesArgs,
    print: fn(&std::path::Path, &PinnedMaps, bool) -> Result<()>,
) -> Result<()> {
    let dir = args.pins.dir()?;
    let maps = open_pins(&dir)?;
    print(&dir, &maps, args.output == Output::Json)
}

/// Parses `ADDR:PORT[/PROTO]`.
fn parse_target(s: &str) -> Result<(SocketAddr, u8)> {
    let (addr, proto) = match s.rsplit_once('/') {
        Some((a, p)) => (a, p),
        None => (s, "TCP"),
    };
    let proto = match proto.to_ascii_uppercase().as_str() {
        "TCP" => proxy_common::PROTO_TCP,
        "UDP" => proxy_common::PROTO_UDP,
        other => anyhow::bail!("protocol {other:?} is not TCP or UDP"),
    };
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("{addr:?} is not ADDR:PORT (IPv6 as [ADDR]:PORT)"))?;
    Ok((addr, proto))
}

fn explain(args: ExplainArgs) -> Result<()> {
    let (addr, proto) = parse_target(&args.target)?;
    let dir = args.pins.dir()?;
    let maps = open_pins(&dir)?;
    let node = NodeInfo {
        name: node_name(args.hostname_override.clone()),
        ..Default::default()
    };
    let objects = if let Some(m) = &args.manifests {
        let (objects, errors) = proxy_userspace::source::manifests::load_dir(m);
        for e in errors {
            eprintln!("warning: {e}");
        }
        Some(objects)
    } else if args.api {
        Some(list_from_api(args.kubeconfig.as_deref(), &node.name)?)
    } else {
        None
    };
    let e = proxy_userspace::inspect::explain(
        &dir,
        &maps.snapshot()?,
        addr,
        proto,
        objects.as_ref().map(|o| (o, &node)),
    )?;
    proxy_userspace::inspect::print_explanation(&e, args.output == Output::Json)
}

/// One list of Services, EndpointSlices and this node's Node from the API.
fn list_from_api(
    kubeconfig: Option<&std::path::Path>,
    node: &str,
) -> Result<proxy_userspace::source::ObjectSet> {
    use k8s_openapi::api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice};
    use proxy_userspace::source::{Object, ObjectSet, Sourced};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let config = match kubeconfig {
            Some(kc) => {
                let kc = kube::config::Kubeconfig::read_from(kc)
                    .with_context(|| format!("read kubeconfig {}", kc.display()))?;
                kube::Config::from_custom_kubeconfig(
                    kc,
                    &kube::config::KubeConfigOptions::default(),
                )
                .await?
            }
            None => kube::Config::infer().await?,
        };
        let client = kube::Client::try_from(config)?;
        let lp = kube::api::ListParams::default();
        let mut set = ObjectSet::default();
        for s in kube::Api::<Service>::all(client.clone()).list(&lp).await? {
            set.insert(Object::Service(Sourced::new("api", s)));
        }
        for s in kube::Api::<EndpointSlice>::all(client.clone())
            .list(&lp)
            .await?
        {
            set.insert(Object::EndpointSlice(Sourced::new("api", s)));
        }
        if let Some(n) = kube::Api::<Node>::all(client).get_opt(node).await? {
            set.insert(Object::Node(Sourced::new("api", n)));
        }
        anyhow::Ok(set)
    })
}

fn open_pins(dir: &std::path::Path) -> Result<PinnedMaps> {
    PinnedMaps::open(dir).with_context(|| {
        format!(
            "no ebpf-proxy data path pinned at {} (is the agent running? check --bpffs/--pin-dir)",
            dir.display()
        )
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `run` arguments and their matches, as `main` gets them.
    fn run_args(argv: &[&str]) -> (RunArgs, clap::ArgMatches) {
        let m = Cli::command()
            .try_get_matches_from(["ebpf-proxy", "run"].iter().chain(argv))
            .unwrap();
        let Command::Run(args) = Cli::from_arg_matches(&m).unwrap().command else {
            panic!("not run");
        };
        (*args, m.subcommand_matches("run").unwrap().clone())
    }

    const FILE: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: /etc/kube-proxy/kubeconfig}
hostnameOverride: file-node
healthzBindAddress: 0.0.0.0:20256
metricsBindAddress: 0.0.0.0:20249
clusterCIDR: 10.244.0.0/16
nodePortAddresses: [primary]
nftables: {syncPeriod: 1m, minSyncPeriod: 5s}
conntrack: {udpTimeout: 1m}
logging: {format: json}
";

    #[test]
    fn the_file_fills_what_no_flag_gave() {
        let (mut a, m) = run_args(&["--config", "f.yaml"]);
        apply_config(&mut a, &m, config::parse(FILE).unwrap().settings);
        assert_eq!(
            a.kubeconfig.as_deref(),
            Some(std::path::Path::new("/etc/kube-proxy/kubeconfig"))
        );
        assert_eq!(a.hostname_override.as_deref(), Some("file-node"));
        assert_eq!(a.healthz_bind_address, "0.0.0.0:20256".parse().unwrap());
        assert_eq!(a.metrics_bind_address, "0.0.0.0:20249".parse().unwrap());
        assert_eq!(a.cluster_cidr.unwrap().to_string(), "10.244.0.0/16");
        assert_eq!(a.nodeport_addresses, Some(NodePortAddresses::Primary));
        assert_eq!(a.sync_period, Duration::from_secs(60));
        assert_eq!(a.min_sync_period, Duration::from_secs(5));
        assert_eq!(a.udp_flow_timeout, Duration::from_secs(60));
        assert_eq!(a.log_format, LogFormat::Json);
    }

    #[test]
    fn min_sync_period_longer_than_sync_period_is_refused() {
        let (a, _) = run_args(&["--sync-period", "30s", "--min-sync-period", "1m"]);
        let e = check_periods(&a).unwrap_err().to_string();
        assert!(
            e.contains("--min-sync-period (1m) is longer than --sync-period (30s)"),
            "{e}"
        );
        let (a, _) = run_args(&["--sync-period", "30s", "--min-sync-period", "30s"]);
        check_periods(&a).unwrap();
        let huge = Cli::command().try_get_matches_from([
            "ebpf-proxy",
            "run",
            "--sync-period",
            "9999999999999s",
        ]);
        assert!(huge.is_err(), "a sync period beyond a year is refused");
    }

    #[test]
    fn flags_given_override_the_file_even_at_their_default_value() {
        let (mut a, m) = run_args(&[
            "--config",
            "f.yaml",
            "--manifests",
            "/tmp/m",
            "--hostname-override",
            "flag-node",
            // Explicitly given, though equal to the default: the flag still wins.
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--sync-period",
            "10s",
            "--udp-flow-timeout",
            "30s",
            "--log-format",
            "text",
            "--cluster-cidr",
            "10.0.0.0/8,fd00::/64",
            "--nodeport-addresses",
            "192.0.2.0/24",
        ]);
        apply_config(&mut a, &m, config::parse(FILE).unwrap().settings);
        assert_eq!(
            a.kubeconfig, None,
            "--manifests given: the file's kubeconfig is not used"
        );
        assert_eq!(a.hostname_override.as_deref(), Some("flag-node"));
        assert_eq!(a.metrics_bind_address, "127.0.0.1:10249".parse().unwrap());
        assert_eq!(a.sync_period, Duration::from_secs(10));
        assert_eq!(a.udp_flow_timeout, Duration::from_secs(30));
        assert_eq!(a.log_format, LogFormat::Text);
        assert_eq!(a.cluster_cidr.unwrap().to_string(), "10.0.0.0/8,fd00::/64");
        assert_eq!(a.nodeport_addresses.unwrap().to_string(), "192.0.2.0/24");
        // Not given as flags: from the file.
        assert_eq!(a.healthz_bind_address, "0.0.0.0:20256".parse().unwrap());
        assert_eq!(a.min_sync_period, Duration::from_secs(5));
    }

    #[test]
    fn kubeconfig_flag_overrides_the_file_and_other_fields_still_apply() {
        let (mut a, m) = run_args(&["--kubeconfig", "/root/.kube/other"]);
        apply_config(&mut a, &m, config::parse(FILE).unwrap().settings);
        assert_eq!(
            a.kubeconfig.as_deref(),
            Some(std::path::Path::new("/root/.kube/other"))
        );
        assert_eq!(a.hostname_override.as_deref(), Some("file-node"));
    }

    /// `apply_config` asks clap about these ids; a misspelt one would make the file win
    /// over a flag that was given (clap checks ids only in debug builds).
    #[test]
    fn ids_asked_by_apply_config_are_arguments_of_run() {
        let cmd = Cli::command();
        let run = cmd.find_subcommand("run").unwrap();
        let src = include_str!("main.rs");
        let body = &src[src.find("fn apply_config(").unwrap()..];
        let body = &body[..body.find("\n}\n").unwrap()];
        let ids: Vec<&str> = body
            .split("given(m, \"")
            .skip(1)
            .map(|s| &s[..s.find('"').unwrap()])
            .collect();
        assert!(ids.len() >= 11, "{ids:?}");
        for id in ids {
            assert!(
                run.get_arguments().any(|a| a.get_id() == id),
                "{id} is not an argument of run"
            );
        }
    }

    #[test]
    fn invalid_list_flags_are_refused() {
        for argv in [
            ["--cluster-cidr", "10.0.0.0/33"],
            ["--nodeport-addresses", "primary,10.0.0.0/8"],
            ["--log-format", "xml"],
        ] {
            let r = Cli::command().try_get_matches_from(["ebpf-proxy", "run"].iter().chain(&argv));
            assert!(r.is_err(), "{argv:?}");
        }
    }
}
