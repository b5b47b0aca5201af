//! `ebpf-proxy`: the node agent (`run`), the preflight (`check`), and the commands that
//! inspect (`services`) and remove (`cleanup`) its data path.

use std::{net::SocketAddr, process::ExitCode};

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches};
use proxy_common::Counter;
use proxy_userspace::{
    agent, check,
    cli::{
        CheckArgs, CleanupArgs, Cli, Command, ExplainArgs, MonitorArgs, MonitorOutput, Output,
        ServicesArgs,
    },
    config::{self, Action, AgentConfig, LogFormat, PinArgs, RunFlags},
    datapath::{loader, view::PinnedView},
    model::{Model, NodeInfo},
};
use tracing::{info, warn};

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

/// The agent (`run`, or no subcommand): the configuration file merged into the flags once,
/// then what kube-proxy's action flags ask (`--write-config-to`, `--cleanup`,
/// `--init-only`), else the agent.
fn start_run(flags: RunFlags) -> Result<()> {
    let (file, mut warnings) = match &flags.config {
        Some(path) => {
            let loaded = config::load(path)?;
            (Some(loaded.settings), loaded.warnings)
        }
        None => (None, Vec::new()),
    };
    let config = AgentConfig::resolve(flags, file)?;
    warnings.extend(config.warnings.iter().cloned());
    if config.action == Action::Cleanup {
        // kube-proxy --cleanup: remove what was installed and exit 0.
        restore_sigpipe();
        return cleanup_pins(&config.pins, None);
    }
    let mut filter = log_filter(&config.log_level)?;
    if config.kernel_log_level != loader::KernelLogLevel::Off {
        // The kernel's lines were asked for by their own flag: --log-level does not hide them.
        filter = filter.add_directive(
            format!("{}=trace", proxy_userspace::kernel_log::TARGET)
                .parse()
                .context("kernel log directive")?,
        );
    }
    init_logs(filter, config.log_format);
    for w in &warnings {
        warn!("{w}");
    }
    match &config.action {
        Action::WriteConfig(path) => {
            config.write_config(path)?;
            info!(file = %path.display(), "wrote configuration");
            Ok(())
        }
        Action::InitOnly => agent::init_only(config),
        Action::Run | Action::Cleanup => agent::run(config),
    }
}

/// Lets `ebpf-proxy services | head` end quietly, as other CLI tools do (Rust ignores
/// SIGPIPE, which turns a closed pipe into a panic in `println!`). Not for `run`: the agent
/// must survive a peer closing a socket.
fn restore_sigpipe() {
    // SAFETY: resetting a signal disposition to its default before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
}

/// mimalloc rather than glibc's malloc: after the first sync frees the transient structures
/// of tens of thousands of Services, glibc merges and sorts every freed chunk at the next
/// larger allocation, which took 5-15 ms out of the first change at 30,000 Services (the
/// p99 of a change). mimalloc frees into per-page lists and gives memory back on its own
/// (1 s after it is freed; the agent also collects after the first sync and every
/// verification).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Transparent huge pages off for this process, before the heap grows. mimalloc asks for
/// huge pages on its arenas (`MADV_HUGEPAGE`), so with the kernel's THP setting `always` or
/// `madvise` each 2 MiB region the heap touches became resident whole: at 10,000 Services x
/// 10 endpoints the agent held about 120 MiB right after its first sync with them and about
/// 97 MiB without (the same as setting `MIMALLOC_ALLOW_THP=0`). The process-wide switch
/// (`PR_SET_THP_DISABLE`, Linux >= 3.15) also covers what mimalloc reserved before `main`.
fn no_transparent_huge_pages() {
    // SAFETY: prctl with integer arguments only. A kernel that refuses it leaves THP as
    // configured, which costs memory only.
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
}

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.into_command() {
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
        Command::Monitor(args) => {
            restore_sigpipe();
            monitor(args)
        }
        Command::Cleanup(args) => {
            restore_sigpipe();
            cleanup(args)
        }
        Command::Status(args) => {
            restore_sigpipe();
            return status_command(args);
        }
        Command::KubeProxy(cmd) => {
            restore_sigpipe();
            kube_proxy_command(cmd)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The causes on one line, the first names the failing step; a cause that
            // repeats the text of the one before it is printed once.
            eprintln!("error: {}", proxy_userspace::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// `ebpf-proxy check`: exit code 0 when nothing failed, 1 otherwise.
fn check_command(args: CheckArgs) -> ExitCode {
    let tc = match args.tc_settings() {
        Ok(tc) => tc,
        Err(e) => {
            eprintln!("error: {}", proxy_userspace::error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    let results = check::run_checks(&check::Options {
        bpffs: args.bpffs,
        mount_bpffs: args.mount_bpffs,
        cgroup: args.cgroup_path,
        probe_programs: true,
        tc,
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

/// `ebpf-proxy status`: the agent's status, exit code 0 when every `--require` holds.
fn status_command(args: proxy_userspace::cli::StatusArgs) -> ExitCode {
    use proxy_userspace::status;
    let read = status::wait_for(
        args.address,
        &args.require,
        args.wait,
        std::time::Duration::from_secs(1),
    );
    let (st, unmet) = match read {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {}", proxy_userspace::error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    match args.output {
        Output::Json => match serde_json::to_string_pretty(&st) {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
        Output::Table => print!("{}", status::table(&st)),
    }
    if unmet.is_empty() {
        return ExitCode::SUCCESS;
    }
    for u in &unmet {
        eprintln!("not met: {u}");
    }
    ExitCode::FAILURE
}

fn services(args: ServicesArgs) -> Result<()> {
    let dir = args.pins.dir()?;
    let view = open_pins(&dir)?;
    proxy_userspace::inspect::print_services(&view, args.output == Output::Json)?;
    if args.output == Output::Table
        && let Ok(c) = view.counters()
    {
        let parts: Vec<String> = Counter::ALL
            .iter()
            .map(|(idx, name)| format!("{name}={}", c.get(*idx as usize).copied().unwrap_or(0)))
            .collect();
        println!(
            "\ncounters: {} (`ebpf-proxy stats` says what each counts)",
            parts.join(" ")
        );
        for line in proxy_userspace::inspect::workload_paths(&view, None) {
            println!("{line}");
        }
    }
    if args.output == Output::Table {
        let xdp = view.xdp_modes();
        let parts: Vec<String> = view
            .tc_interfaces()
            .iter()
            .map(|i| {
                let mode = xdp.get(i).map_or("none", |m| m.as_str());
                format!("{i} (tcx, xdp {mode})")
            })
            .collect();
        if !parts.is_empty() {
            println!("north-south interfaces: {}", parts.join(", "));
        }
    }
    Ok(())
}

fn affinity(args: ServicesArgs) -> Result<()> {
    let dir = args.pins.dir()?;
    let view = open_pins(&dir)?;
    proxy_userspace::inspect::print_affinity(&view, args.output == Output::Json)
}

fn inspect_with(args: ServicesArgs, print: fn(&PinnedView, bool) -> Result<()>) -> Result<()> {
    let dir = args.pins.dir()?;
    let view = open_pins(&dir)?;
    print(&view, args.output == Output::Json)
}

/// Parses `ADDR:PORT[/PROTO]` (IPv6 as `[ADDR]:PORT`; PROTO `TCP` or `UDP`, any case,
/// TCP when left out). Errors quote the whole argument and say which part is wrong.
fn parse_target(s: &str) -> Result<(SocketAddr, u8)> {
    const FORM: &str = "ADDR:PORT[/TCP|/UDP], IPv6 as [ADDR]:PORT";
    let (addr, proto) = s.split_once('/').unwrap_or((s, "TCP"));
    let proto = match proto.to_ascii_uppercase().as_str() {
        "TCP" => proxy_common::PROTO_TCP,
        "UDP" => proxy_common::PROTO_UDP,
        _ => anyhow::bail!("{s:?}: protocol {proto:?} is not TCP or UDP ({FORM})"),
    };
    match addr.parse::<SocketAddr>() {
        Ok(a) => Ok((a, proto)),
        Err(_) => {
            // A port that is a number but too large is the likely slip: say so.
            if let Some((_, port)) = addr.rsplit_once(':')
                && !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && port.parse::<u16>().is_err()
            {
                anyhow::bail!("{s:?}: port {port} is out of range (0-65535)");
            }
            anyhow::bail!("{s:?} is not {FORM}")
        }
    }
}

fn explain(args: ExplainArgs) -> Result<()> {
    let (addr, proto) = parse_target(&args.target)?;
    let dir = args.pins.dir()?;
    let mut flags = RunFlags {
        pins: args.pins.clone(),
        ..Default::default()
    };
    flags.settings.hostname_override = args.hostname_override.clone();
    let node = NodeInfo {
        name: AgentConfig::resolve(flags, None)?.node_name(),
        ..Default::default()
    };
    let model = if let Some(m) = &args.manifests {
        // As `run`: a path that is not a readable directory is an error, not an empty set.
        std::fs::read_dir(m)
            .with_context(|| format!("--manifests {}: cannot read the directory", m.display()))?;
        let (objects, errors) = proxy_userspace::source::manifests::load_dir(m);
        for e in errors {
            eprintln!("warning: {e}");
        }
        if objects.services.is_empty() {
            eprintln!(
                "warning: --manifests {}: no Service found (read: *.yaml, *.yml and *.json files, dot files and backups~ skipped)",
                m.display()
            );
        }
        Some(Model::from_objects(&objects, &node))
    } else if args.api {
        let objects = list_from_api(
            args.kubeconfig.as_deref(),
            args.master.as_deref(),
            &node.name,
        )?;
        Some(Model::from_objects(&objects, &node))
    } else {
        None
    };
    // With objects but no data path pinned (a laptop, a node before the agent runs), the
    // explanation is of what an agent would program for them.
    let view = PinnedView::new(&dir);
    let (snapshot, pinned) = match (open_pins(&dir), &model) {
        (Ok(pins), _) => (pins.snapshot()?, true),
        (Err(_), Some(m)) => (proxy_userspace::inspect::desired_snapshot(m)?, false),
        (Err(e), None) => return Err(e),
    };
    // The tc path's source ranges: pinned (none without a tc path), else an agent's.
    let ranges = match (&model, pinned) {
        (_, true) => view.source_ranges().unwrap_or_default(),
        (Some(m), false) => proxy_userspace::reconcile::source_range_entries(m),
        (None, false) => Default::default(),
    };
    let node_from = if args.hostname_override.is_some() {
        "--hostname-override"
    } else if std::env::var("NODE_NAME").is_ok_and(|n| !n.trim().is_empty()) {
        "$NODE_NAME"
    } else {
        "the hostname; set --hostname-override for another node"
    };
    let mut e = proxy_userspace::inspect::explain(
        &view,
        &snapshot,
        addr,
        proto,
        model.as_ref(),
        &format!("{} ({node_from})", node.name),
        &ranges,
    )?;
    if !pinned {
        e.from = "objects";
    }
    proxy_userspace::inspect::print_explanation(&e, args.output == Output::Json)
}

/// One list of Services, EndpointSlices and this node's Node from the API.
fn list_from_api(
    kubeconfig: Option<&std::path::Path>,
    master: Option<&str>,
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
                // Its own check first: kube's error quotes the path twice and drops the
                // reason.
                std::fs::metadata(kc).with_context(|| format!("--kubeconfig {}", kc.display()))?;
                let kc = kube::config::Kubeconfig::read_from(kc)
                    .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", kc.display()))?;
                kube::Config::from_custom_kubeconfig(
                    kc,
                    &kube::config::KubeConfigOptions::default(),
                )
                .await?
            }
            None => {
                // As the agent reaches the API: in its container $API_SERVER holds the
                // chart's apiServer.address.
                let master = master.map(str::to_string).or_else(|| {
                    std::env::var("API_SERVER")
                        .ok()
                        .filter(|m| !m.trim().is_empty())
                });
                match master {
                    Some(m) => proxy_userspace::source::kube_config(
                        &config::SourceChoice::Api(None),
                        Some(&m),
                    )
                    .await?
                    .expect("an API source"),
                    None => kube::Config::infer().await.context(
                        "no Kubernetes API configuration: give --kubeconfig or --master, or \
                         --manifests DIR to explain from manifests",
                    )?,
                }
            }
        };
        let server = config.cluster_url.to_string();
        let client = kube::Client::try_from(config)
            .with_context(|| format!("API server {server}: cannot build a client"))?;
        let from_server = || format!("API server {server}");
        let lp = kube::api::ListParams::default();
        let mut set = ObjectSet::default();
        let services = kube::Api::<Service>::all(client.clone())
            .list(&lp)
            .await
            .with_context(|| format!("{}: list Services", from_server()))?;
        for s in services {
            set.insert(Object::Service(Sourced::new("api", s)));
        }
        let slices = kube::Api::<EndpointSlice>::all(client.clone())
            .list(&lp)
            .await
            .with_context(|| format!("{}: list EndpointSlices", from_server()))?;
        for s in slices {
            set.insert(Object::EndpointSlice(Sourced::new("api", s)));
        }
        if let Some(n) = kube::Api::<Node>::all(client)
            .get_opt(node)
            .await
            .with_context(|| format!("{}: get Node {node}", from_server()))?
        {
            set.insert(Object::Node(Sourced::new("api", n)));
        }
        anyhow::Ok(set)
    })
}

/// The view of the data path pinned at `dir`, once its service maps open.
fn open_pins(dir: &std::path::Path) -> Result<PinnedView> {
    let view = PinnedView::new(dir);
    view.service_maps().with_context(|| {
        format!(
            "no ebpf-proxy data path pinned at {} (is the agent running? check --bpffs/--pin-dir)",
            dir.display()
        )
    })?;
    Ok(view)
}

/// `ebpf-proxy monitor`: the filters checked, then the stream until --count, --duration
/// or Ctrl-C.
fn monitor(args: MonitorArgs) -> Result<()> {
    use proxy_userspace::monitor::{self, Filter, Options};
    let protocol = match args
        .protocol
        .as_deref()
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None => None,
        Some("tcp") => Some(proxy_common::PROTO_TCP),
        Some("udp") => Some(proxy_common::PROTO_UDP),
        Some(other) => anyhow::bail!("--protocol {other:?} is not tcp or udp"),
    };
    if let Some(s) = &args.service
        && s.split('/').count() != 2
    {
        anyhow::bail!("--service {s:?} is not namespace/name");
    }
    let filter = Filter {
        service: args.service.clone(),
        address: args.address,
        port: args.port,
        protocol,
        kinds: args
            .types
            .iter()
            .map(|t| monitor::parse_kind(t))
            .collect::<Result<_>>()?,
        reasons: args
            .reasons
            .iter()
            .map(|r| monitor::parse_reason(r))
            .collect::<Result<_>>()?,
    };
    let opts = Options {
        dir: args.pins.dir()?,
        filter,
        json: args.output == MonitorOutput::Json,
        count: args.count,
        duration: args.duration,
        rate: args.rate,
        burst: args.burst,
    };
    monitor::run(&opts, &mut std::io::stdout().lock())
}

fn cleanup(args: CleanupArgs) -> Result<()> {
    let _ = args.cgroup_path;
    cleanup_pins(&args.pins, args.wait_for_kube_proxy)
}

/// `ebpf-proxy kube-proxy status|cleanup`.
fn kube_proxy_command(cmd: proxy_userspace::cli::KubeProxyCommand) -> Result<()> {
    use proxy_userspace::{cli::KubeProxyCommand, kube_proxy};
    match cmd {
        KubeProxyCommand::Status(a) => {
            let found = kube_proxy::wait_programmed(a.wait, std::time::Duration::from_secs(1));
            for l in found.describe() {
                println!("{l}");
            }
            if !found.programmed() {
                anyhow::bail!(
                    "kube-proxy has not programmed this node{}",
                    if found.any() {
                        " (its rules are there, but without the canary and a full sync)"
                    } else {
                        ""
                    }
                );
            }
            println!("kube-proxy has programmed this node");
            Ok(())
        }
        KubeProxyCommand::Cleanup(a) => {
            let gates = if a.force {
                Ok(())
            } else {
                kube_proxy::check_gates(std::path::Path::new("/proc"), a.status_address)
            };
            if a.dry_run {
                // What would go, and whether it would be allowed now.
                for l in kube_proxy::cleanup(true)? {
                    println!("{l}");
                }
                return gates.context("a cleanup now would be refused");
            }
            gates?;
            for l in kube_proxy::cleanup(false)? {
                println!("{l}");
            }
            Ok(())
        }
    }
}

/// How long a cleanup waits for an agent that still holds the pin directory (a DaemonSet
/// pod terminating: its grace period is 5 s).
const CLEANUP_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// `cleanup` and `--cleanup`: detach the programs and remove the pins, saying what went;
/// never while an agent runs on them, and with `wait_for_kube_proxy` not before kube-proxy
/// has programmed this node. In that order: nothing pinned is done at once; an agent still
/// stopping is waited for, then its lock is held while kube-proxy is waited for, so no agent
/// starts again on the pins meanwhile.
fn cleanup_pins(pins: &PinArgs, wait_for_kube_proxy: Option<std::time::Duration>) -> Result<()> {
    let dir = pins.dir()?;
    if !dir.exists() {
        // Nothing to do is a success (kube-proxy --cleanup's meaning), but a mistyped
        // --bpffs should not look like one.
        let mounted = proxy_userspace::mounts::find_mount("bpf", Some(&pins.bpffs))
            .ok()
            .flatten()
            .is_some();
        let why = if mounted {
            String::new()
        } else {
            format!(" ({} is no mounted bpffs)", pins.bpffs.display())
        };
        println!("nothing to clean up at {}{why}", dir.display());
        return Ok(());
    }
    let lock = match loader::wait_pin_dir_free(&dir, std::time::Duration::ZERO) {
        Ok(l) => l,
        Err(_) => {
            println!(
                "an agent still holds {}: waiting (at most {} s) for it to stop",
                dir.display(),
                CLEANUP_LOCK_WAIT.as_secs()
            );
            loader::wait_pin_dir_free(&dir, CLEANUP_LOCK_WAIT)?
        }
    };
    if let Some(wait) = wait_for_kube_proxy {
        use proxy_userspace::kube_proxy;
        let found = kube_proxy::wait_programmed(wait, std::time::Duration::from_secs(1));
        for l in found.describe() {
            println!("kube-proxy: {l}");
        }
        if !found.programmed() {
            anyhow::bail!(
                "kube-proxy has not programmed this node within {} (no canary chain with a full sync, no synced nftables table): nothing removed, ebpf-proxy keeps serving; deploy kube-proxy and wait until its pod on this node runs",
                humantime::format_duration(wait)
            );
        }
    }
    let r = loader::cleanup(&dir)?;
    drop(lock);
    if let Some(d) = r.drained {
        println!(
            "drained north-south flows for {} ms (no new flow; open ones finished, at most {} s)",
            d.as_millis(),
            loader::DRAIN_MAX.as_secs()
        );
    }
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_target;

    #[test]
    fn target_forms_and_errors() {
        let ok = |s: &str| parse_target(s).unwrap_or_else(|e| panic!("{s}: {e:#}"));
        assert_eq!(ok("10.96.0.10:53/udp").1, proxy_common::PROTO_UDP);
        assert_eq!(ok("10.96.0.10:80").1, proxy_common::PROTO_TCP);
        assert_eq!(ok("[fd00::a]:443/TCP").0.port(), 443);
        let err = |s: &str| format!("{:#}", parse_target(s).unwrap_err());
        assert!(err("10.0.0.1:99999").contains("port 99999 is out of range"));
        let e = err("10.0.0.1:80/udp/extra");
        assert!(
            e.contains("\"10.0.0.1:80/udp/extra\"") && e.contains("\"udp/extra\""),
            "{e}"
        );
        assert!(err("10.0.0.1:80/SCTP").contains("protocol \"SCTP\" is not TCP or UDP"));
        assert!(err("fd00::1:80").contains("IPv6 as [ADDR]:PORT"));
        assert!(err("10.0.0.1").contains("is not ADDR:PORT"));
    }
}
