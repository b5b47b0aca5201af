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
    model::{self, NodeInfo},
    source::{ManifestSource, Source},
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
    Run(RunArgs),
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
    fn dir(&self) -> PathBuf {
        loader::pin_dir(&self.bpffs, &self.pin_dir)
    }
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Directory of Service and EndpointSlice manifests (*.yaml, *.yml, *.json), watched for
    /// changes.
    #[arg(long)]
    manifests: PathBuf,
    /// cgroup v2 directory to attach the socket programs to [default: the cgroup2 mount root
    /// from /proc/self/mounts, i.e. every process of the node].
    #[arg(long)]
    cgroup_path: Option<PathBuf>,
    #[command(flatten)]
    pins: PinArgs,
    /// Name of this node [default: $NODE_NAME, else the hostname].
    #[arg(long)]
    hostname_override: Option<String>,
    /// Address of the health server (`/healthz`); port 0 picks a free port.
    #[arg(long, default_value = "0.0.0.0:10256")]
    healthz_bind_address: SocketAddr,
    /// Log level (error, warn, info, debug, trace) or a tracing filter directive.
    #[arg(long, default_value = "info")]
    log_level: String,
    /// Size of the frontend map (VIP x port x protocol, plus one entry per VIP) when created.
    #[arg(long, default_value_t = DEFAULT_MAX_FRONTENDS)]
    max_frontends: u32,
    /// Size of the backend slot map (sum of all services' endpoint counts) when created.
    #[arg(long, default_value_t = DEFAULT_MAX_SLOTS)]
    max_backend_slots: u32,
    /// Size of the backend map (distinct endpoint address x port x protocol) when created.
    #[arg(long, default_value_t = DEFAULT_MAX_BACKENDS)]
    max_backends: u32,
    /// Size of the per-socket reverse-NAT and UDP flow maps (LRU) when created.
    #[arg(long, default_value_t = DEFAULT_MAX_SOCKETS)]
    max_sockets: u32,
    /// Idle time after which an unconnected UDP flow picks a backend anew, like conntrack's
    /// nf_conntrack_udp_timeout (e.g. 30s, 2m).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    udp_flow_timeout: Duration,
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

fn init_logs(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => {
            init_logs(&args.log_level);
            run(args)
        }
        Command::Services(args) => services(args),
        Command::Cleanup(args) => cleanup(args),
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

/// Health as kube-proxy's healthz server reports it.
#[derive(Default)]
struct Health {
    /// Time of the last successful sync; `None` until the first one.
    last_updated: Option<SystemTime>,
}

async fn healthz(
    axum::extract::State(h): axum::extract::State<Arc<Mutex<Health>>>,
) -> (axum::http::StatusCode, axum::Json<serde_json::Value>) {
    let last = h.lock().unwrap().last_updated;
    let now = SystemTime::now();
    let fmt = |t: SystemTime| humantime::format_rfc3339_millis(t).to_string();
    let body = serde_json::json!({
        "lastUpdated": last.map(fmt).unwrap_or_default(),
        "currentTime": fmt(now),
    });
    let code = if last.is_some() {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body))
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
    let node = NodeInfo {
        name: node_name(args.hostname_override.clone()),
    };
    let dir = args.pins.dir();
    loader::ensure_bpffs(&args.pins.bpffs)?;
    let cgroup = match &args.cgroup_path {
        Some(p) => p.clone(),
        None => loader::cgroup2_root()?,
    };
    let sizes = MapSizes {
        frontends: args.max_frontends,
        slots: args.max_backend_slots,
        backends: args.max_backends,
        sockets: args.max_sockets,
    };
    loader::load_and_attach(&dir, &cgroup, sizes)?;
    info!(pin_dir = %dir.display(), cgroup = %cgroup.display(), node = %node.name, "data path attached");
    let mut maps = PinnedMaps::open(&dir).context("open the pinned maps")?;
    maps.write_config(&Config {
        udp_flow_timeout_ns: args.udp_flow_timeout.as_nanos().min(u64::MAX as u128) as u64,
        _reserved: 0,
    })?;
    let cap = maps.capacity();
    if cap.frontends != args.max_frontends
        || cap.slots != args.max_backend_slots
        || cap.backends != args.max_backends
    {
        warn!(
            ?cap,
            "adopted pinned maps keep the sizes they were created with; run `ebpf-proxy cleanup` to resize"
        );
    }
    let mut syncer = Syncer::adopt(&maps).context("read the pinned maps")?;
    info!(
        services = syncer.bound_services(),
        "adopted state from pinned maps"
    );

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let health = Arc::new(Mutex::new(Health::default()));
        let app = axum::Router::new()
            .route("/healthz", axum::routing::get(healthz))
            .with_state(health.clone());
        let listener = tokio::net::TcpListener::bind(args.healthz_bind_address)
            .await
            .with_context(|| format!("bind the health server to {}", args.healthz_bind_address))?;
        info!(address = %listener.local_addr()?, "health server listening");
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                error!(error = %e, "health server stopped");
            }
        });

        let mut rx = ManifestSource::new(&args.manifests).start()?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut logged: BTreeSet<String> = BTreeSet::new();
        loop {
            let snap = tokio::select! {
                s = rx.recv() => match s {
                    Some(s) => s,
                    None => anyhow::bail!("the manifest source stopped"),
                },
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
            };
            // Use only the newest snapshot when several queued up.
            let mut snap = snap;
            while let Ok(newer) = rx.try_recv() {
                snap = newer;
            }
            let (desired, model_errors) = model::build(&snap.objects, &node);
            // Each skipped object is reported once while it stays bad, not on every sync.
            let now: BTreeSet<String> =
                snap.errors.iter().chain(model_errors.iter()).map(|e| e.to_string()).collect();
            for e in now.difference(&logged) {
                error!("skipped: {e}");
            }
            logged = now;
            match syncer.sync(&mut maps, &desired) {
                Ok(st) => {
                    health.lock().unwrap().last_updated = Some(SystemTime::now());
                    info!(
                        services = st.services,
                        frontends = st.frontends,
                        backends = st.backends,
                        writes = st.writes,
                        deletes = st.deletes,
                        skipped = logged.len(),
                        duration_us = st.duration.as_micros() as u64,
                        "sync done"
                    );
                }
                Err(e) => error!(error = %e, "sync failed; the data path keeps its previous state"),
            }
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
    let dir = args.pins.dir();
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
    println!(
        "{:<w0$}  {:<w1$}  {:<w2$}  {:>w3$}  {}",
        header[0],
        header[1],
        header[2],
        header[3],
        header[4],
        w0 = w[0],
        w1 = w[1],
        w2 = w[2],
        w3 = w[3]
    );
    for r in &table {
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
    let dir = args.pins.dir();
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
