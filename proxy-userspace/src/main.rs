//! `ebpf-proxy`: the node agent (`run`), the preflight (`check`), and the commands that
//! inspect (`services`) and remove (`cleanup`) its data path.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use proxy_common::Counter;
use proxy_userspace::{
    agent, check,
    config::{self, AgentConfig, LogFormat, PinArgs, RunFlags},
    datapath::{ServiceMaps, loader, maps::PinnedMaps},
    model::{Model, NodeInfo},
};
use tracing::warn;

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
    Run(Box<RunFlags>),
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

/// `run`: the configuration file merged into the flags once, then the logs, then the agent.
fn start_run(flags: RunFlags) -> Result<()> {
    let (file, warnings) = match &flags.config {
        Some(path) => {
            let loaded = config::load(path)?;
            (Some(loaded.settings), loaded.warnings)
        }
        None => (None, Vec::new()),
    };
    let config = AgentConfig::resolve(flags, file)?;
    init_logs(log_filter(&config.log_level)?, config.log_format);
    for w in &warnings {
        warn!("{w}");
    }
    agent::run(config)
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
        Command::Run(args) => start_run(*args),
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
        name: AgentConfig::resolve(
            RunFlags {
                hostname_override: args.hostname_override.clone(),
                pins: args.pins.clone(),
                ..Default::default()
            },
            None,
        )?
        .node_name(),
        ..Default::default()
    };
    let model = if let Some(m) = &args.manifests {
        let (objects, errors) = proxy_userspace::source::manifests::load_dir(m);
        for e in errors {
            eprintln!("warning: {e}");
        }
        Some(Model::from_objects(&objects, &node))
    } else if args.api {
        let objects = list_from_api(args.kubeconfig.as_deref(), &node.name)?;
        Some(Model::from_objects(&objects, &node))
    } else {
        None
    };
    let e =
        proxy_userspace::inspect::explain(&dir, &maps.snapshot()?, addr, proto, model.as_ref())?;
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

    /// `run` flags as `main` gets them.
    fn run_flags(argv: &[&str]) -> RunFlags {
        let m = Cli::command()
            .try_get_matches_from(["ebpf-proxy", "run"].iter().chain(argv))
            .unwrap();
        let Command::Run(flags) = Cli::from_arg_matches(&m).unwrap().command else {
            panic!("not run");
        };
        *flags
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

    fn file() -> Option<config::FileSettings> {
        Some(config::parse(FILE).unwrap().settings)
    }

    #[test]
    fn the_file_fills_what_no_flag_gave_and_defaults_fill_the_rest() {
        let a = AgentConfig::resolve(run_flags(&["--config", "f.yaml"]), file()).unwrap();
        assert_eq!(
            a.source,
            config::SourceChoice::Api(Some(PathBuf::from("/etc/kube-proxy/kubeconfig")))
        );
        assert_eq!(a.hostname_override.as_deref(), Some("file-node"));
        assert_eq!(a.healthz_bind_address, "0.0.0.0:20256".parse().unwrap());
        assert_eq!(a.metrics_bind_address, "0.0.0.0:20249".parse().unwrap());
        assert_eq!(a.cluster_cidrs, vec!["10.244.0.0/16".parse().unwrap()]);
        assert_eq!(
            a.nodeport_addresses,
            Some(config::NodePortAddresses::Primary)
        );
        assert_eq!(a.sync_period, std::time::Duration::from_secs(60));
        assert_eq!(a.min_sync_period, std::time::Duration::from_secs(5));
        assert_eq!(a.udp_flow_timeout, std::time::Duration::from_secs(60));
        assert_eq!(a.log_format, LogFormat::Json);
        // Not in the file: the defaults.
        assert_eq!(a.maglev_table_size, proxy_common::MAGLEV_DEFAULT);
        assert_eq!(
            a.tc.conntrack_min,
            config::AgentConfig::resolve(RunFlags::default(), None)
                .unwrap()
                .tc
                .conntrack_min
        );
        let d = AgentConfig::resolve(run_flags(&[]), None).unwrap();
        assert_eq!(d.sync_period, config::DEFAULT_SYNC_PERIOD);
        assert_eq!(d.metrics_bind_address, "127.0.0.1:10249".parse().unwrap());
        assert_eq!(d.source, config::SourceChoice::Api(None));
    }

    #[test]
    fn min_sync_period_longer_than_sync_period_is_refused() {
        let e = AgentConfig::resolve(
            run_flags(&["--sync-period", "30s", "--min-sync-period", "1m"]),
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--min-sync-period (1m) is longer than --sync-period (30s)"),
            "{e}"
        );
        AgentConfig::resolve(
            run_flags(&["--sync-period", "30s", "--min-sync-period", "30s"]),
            None,
        )
        .unwrap();
        // The file's minSyncPeriod is checked against a flag's sync period too.
        let e = AgentConfig::resolve(run_flags(&["--sync-period", "2s"]), file()).unwrap_err();
        assert!(
            e.to_string().contains("is longer than --sync-period (2s)"),
            "{e}"
        );
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
        let a = AgentConfig::resolve(
            run_flags(&[
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
                "--min-sync-period",
                "5s",
            ]),
            file(),
        )
        .unwrap();
        assert_eq!(
            a.source,
            config::SourceChoice::Manifests(PathBuf::from("/tmp/m")),
            "--manifests given: the file's kubeconfig is not used"
        );
        assert_eq!(a.hostname_override.as_deref(), Some("flag-node"));
        assert_eq!(a.metrics_bind_address, "127.0.0.1:10249".parse().unwrap());
        assert_eq!(a.sync_period, std::time::Duration::from_secs(10));
        assert_eq!(a.udp_flow_timeout, std::time::Duration::from_secs(30));
        assert_eq!(a.log_format, LogFormat::Text);
        assert_eq!(a.cluster_cidrs.len(), 2);
        assert_eq!(a.nodeport_addresses.unwrap().to_string(), "192.0.2.0/24");
        // Not given as flags: from the file.
        assert_eq!(a.healthz_bind_address, "0.0.0.0:20256".parse().unwrap());
    }

    #[test]
    fn kubeconfig_flag_overrides_the_file_and_other_fields_still_apply() {
        let a = AgentConfig::resolve(run_flags(&["--kubeconfig", "/root/.kube/other"]), file())
            .unwrap();
        assert_eq!(
            a.source,
            config::SourceChoice::Api(Some(PathBuf::from("/root/.kube/other")))
        );
        assert_eq!(a.hostname_override.as_deref(), Some("file-node"));
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
