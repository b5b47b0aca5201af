//! The command line of `ebpf-proxy`: the agent (`run`, or no subcommand at all, as kube-proxy
//! is run: `ebpf-proxy --config=/var/lib/kube-proxy/config.conf --hostname-override=NODE`),
//! the preflight (`check`), the inspection commands and `cleanup`. Parsing only; `main`
//! runs the commands.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::{PinArgs, RunFlags, number_in};

/// What `--version` prints after the name, under either name (`ebpf-proxy 0.1.0
/// (kube-proxy compatible flags)`): this binary's version, not a Kubernetes version as
/// kube-proxy's `Kubernetes v1.x.y`.
pub(crate) const VERSION: &str =
    concat!(env!("CARGO_PKG_VERSION"), " (kube-proxy compatible flags)");

/// A kube-proxy replacement on eBPF: Kubernetes Services load-balanced at the socket level
/// for clients on the node, and by tc programs for traffic entering it.
#[derive(Parser, Debug)]
// A flag given twice takes its last value, as pflag does for kube-proxy.
// The version says what the binary is under either name: `kube-proxy --version` (the
// image links kube-proxy to it) cannot honestly print kube-proxy's `Kubernetes vX.Y.Z`.
#[command(
    name = "ebpf-proxy",
    version = VERSION,
    args_conflicts_with_subcommands = true,
    args_override_self = true
)]
pub struct Cli {
    /// A subcommand; without one, the agent runs with the flags below (kube-proxy's command
    /// line, e.g. `--config=/var/lib/kube-proxy/config.conf --hostname-override=NODE`).
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    /// The agent's flags, as `run` takes them.
    #[command(flatten)]
    pub(crate) run: RunFlags,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the node agent: load the data path, follow Services and EndpointSlices, sync maps.
    #[command(args_override_self = true)]
    Run(Box<RunFlags>),
    /// Print the frontends and their backends, read from the pinned maps (works while the
    /// agent is down).
    Services(ServicesArgs),
    /// List the backends with the services using them and their connection counters.
    Backends(ServicesArgs),
    /// Print the per-service counters and the per-reason data path counters. Per Service:
    /// CONNECTIONS (connections and new UDP flows translated, socket and tc paths),
    /// REFUSED (refused or dropped for lack of (local) endpoints), PACKETS and BYTES
    /// (packets translated by the north-south programs, tc and XDP, and their bytes); then each
    /// REASON's COUNT with its MEANING, for the socket and the tc programs.
    Stats(ServicesArgs),
    /// List the socket-level translations: connected sockets and unconnected UDP flows,
    /// with idle time and staleness.
    Conntrack(ServicesArgs),
    /// Explain what happens to a connection from this node to ADDR:PORT[/PROTO]: matching
    /// frontends, backends and counters; with --manifests or --api also every endpoint of
    /// the Service and why it is or is not eligible (policy, zone, terminating), and where
    /// no data path is pinned, what an agent would program for those objects.
    Explain(ExplainArgs),
    /// List ClientIP session-affinity entries (service, client, backend, age, expiry), read
    /// from the pinned maps.
    Affinity(ServicesArgs),
    /// Stream the data path's decisions as they happen (translations, refusals and drops
    /// with their reason, reverse translations, stale sockets, tc flows, SNAT, flow ends,
    /// ICMP errors), one line per event; a summary line when events were lost.
    Monitor(MonitorArgs),
    /// Detach the programs and remove the pinned maps and links (like kube-proxy --cleanup).
    Cleanup(CleanupArgs),
    /// Preflight: check that this node can run the agent (kernel, BTF, bpffs, cgroup v2,
    /// program and map types, helpers, memlock, kube-proxy rules). Exit code 1 on a failure.
    Check(CheckArgs),
    /// Ask the running agent on this node (its status server) whether it has synced, is
    /// ready, and serves the north-south path; with --wait, until it does. Exit code 1 when
    /// a --require condition is not met.
    Status(StatusArgs),
    /// kube-proxy's rules on this node: whether kube-proxy has programmed them (`status`),
    /// and their removal once ebpf-proxy serves the node (`cleanup`).
    #[command(name = "kube-proxy", subcommand)]
    KubeProxy(KubeProxyCommand),
}

/// Arguments of `status`.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The agent's status server (its --status-bind-address).
    #[arg(allow_hyphen_values = true, long, default_value = "127.0.0.1:10266")]
    pub address: std::net::SocketAddr,
    /// Conditions that must hold, comma-separated: synced (the first sync is done),
    /// ready (synced, and the health and metrics servers listen: no other process holds
    /// their ports), north-south (NodePorts, external IPs and LB IPs are served to traffic
    /// entering the node: the condition for removing kube-proxy's rules).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "synced")]
    pub require: Vec<crate::status::Requirement>,
    /// Keep asking (every second) until the conditions hold or this time has passed, e.g.
    /// 5m; 0 asks once.
    #[arg(long, allow_hyphen_values = true, default_value = "0s", value_parser = crate::config::parse_duration, value_name = "DURATION")]
    pub wait: std::time::Duration,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
}

/// Output format of the inspection commands.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Aligned columns.
    Table,
    /// JSON.
    Json,
}

/// Arguments of the commands that read the pinned maps.
#[derive(clap::Args, Debug)]
pub struct ServicesArgs {
    /// The pinned data path.
    #[command(flatten)]
    pub pins: PinArgs,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
}

/// Arguments of `check`.
#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// Mount point of the BPF file system.
    #[arg(allow_hyphen_values = true, long, default_value = crate::config::DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Mount bpffs at --bpffs when it is not mounted (otherwise that is a failure).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = crate::config::go::parse_go_bool, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub mount_bpffs: bool,
    /// cgroup v2 directory the programs would attach to [default: the cgroup2 mount root].
    #[arg(allow_hyphen_values = true, long)]
    pub cgroup_path: Option<PathBuf>,
    /// The agent's configuration file, for the settings checked (the conntrack table's
    /// size), as `run --config` reads it.
    #[arg(allow_hyphen_values = true, long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// As `run --conntrack-max-per-core`: the conntrack table's size is checked with it.
    #[arg(allow_hyphen_values = true, long, value_parser = number_in(0u32, crate::datapath::tc::MAX_CONNTRACK_FLOWS), value_name = "N")]
    pub(crate) conntrack_max_per_core: Option<u32>,
    /// As `run --conntrack-min`.
    #[arg(allow_hyphen_values = true, long, value_parser = crate::config::parse_conntrack_min, value_name = "N")]
    pub(crate) conntrack_min: Option<u32>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
}

impl CheckArgs {
    /// The north-south settings to check: `--config` and the conntrack flags merged as
    /// `run` merges them.
    ///
    /// Errors: the file cannot be read or is invalid, or names a kube-proxy mode.
    pub fn tc_settings(&self) -> anyhow::Result<crate::datapath::tc::TcSettings> {
        let file = match &self.config {
            Some(path) => Some(crate::config::load(path)?.settings),
            None => None,
        };
        let mut flags = RunFlags {
            config: self.config.clone(),
            ..Default::default()
        };
        flags.settings.conntrack_max_per_core = self.conntrack_max_per_core;
        flags.settings.conntrack_min = self.conntrack_min;
        Ok(crate::config::AgentConfig::resolve(flags, file)?.tc)
    }
}

/// Arguments of `explain`.
#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// The destination, e.g. `10.96.0.10:53/UDP` (protocol TCP when left out).
    pub target: String,
    /// The pinned data path.
    #[command(flatten)]
    pub pins: PinArgs,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
    /// Read the Services, EndpointSlices and Nodes from this manifest directory to explain
    /// endpoint eligibility.
    #[arg(allow_hyphen_values = true, long, conflicts_with = "api")]
    pub manifests: Option<PathBuf>,
    /// Read them from the Kubernetes API (--kubeconfig, else $KUBECONFIG, ~/.kube/config or
    /// the in-cluster service account).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = crate::config::go::parse_go_bool, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub api: bool,
    /// Kubeconfig for --api.
    #[arg(allow_hyphen_values = true, long, requires = "api")]
    pub kubeconfig: Option<PathBuf>,
    /// The API server for --api, as `run --master` takes it [default: $API_SERVER when set,
    /// which is the chart's apiServer.address inside the agent's container].
    #[arg(
        allow_hyphen_values = true,
        long,
        requires = "api",
        value_name = "HOST:PORT|URL"
    )]
    pub master: Option<String>,
    /// This node's name, for Local policies and topology [default: $NODE_NAME, else the
    /// hostname].
    #[arg(allow_hyphen_values = true, long)]
    pub hostname_override: Option<String>,
}

/// Output format of `monitor`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MonitorOutput {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line.
    Json,
}

/// Arguments of `monitor`.
#[derive(clap::Args, Debug)]
pub struct MonitorArgs {
    /// The pinned data path.
    #[command(flatten)]
    pub pins: PinArgs,
    /// Only events of this Service (`namespace/name`).
    #[arg(allow_hyphen_values = true, long)]
    pub service: Option<String>,
    /// Only events whose client, frontend or backend has this address.
    #[arg(allow_hyphen_values = true, long)]
    pub address: Option<std::net::IpAddr>,
    /// Only events whose frontend or backend has this port.
    #[arg(allow_hyphen_values = true, long, value_parser = number_in(1u16, u16::MAX))]
    pub port: Option<u16>,
    /// Only events of this protocol (tcp or udp).
    #[arg(allow_hyphen_values = true, long)]
    pub protocol: Option<String>,
    /// Only events of these types (comma-separated): translate, refuse, reverse,
    /// stale-drop, flow-new, flow-drop, flow-end, icmp.
    #[arg(allow_hyphen_values = true, long = "type", value_delimiter = ',')]
    pub types: Vec<String>,
    /// Only events with these reasons (comma-separated): no-endpoints, undefined-port,
    /// no-local-endpoints, stale-socket, source-range, no-snat-address,
    /// snat-ports-exhausted, conntrack-full, rewrite-failed.
    #[arg(allow_hyphen_values = true, long = "reason", value_delimiter = ',')]
    pub reasons: Vec<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: MonitorOutput,
    /// Stop after this many events (at least 1).
    #[arg(allow_hyphen_values = true, long, value_parser = number_in(1u64, u64::MAX))]
    pub count: Option<u64>,
    /// Stop after this long: seconds (`5`, `0.5`) or a duration (`5s`, `2m`), more than
    /// zero and at most a year.
    #[arg(allow_hyphen_values = true, long, value_parser = parse_monitor_duration)]
    pub duration: Option<std::time::Duration>,
    /// Events per second each CPU may emit while the monitor runs (0: no limit); the
    /// events over it are counted as lost.
    #[arg(allow_hyphen_values = true, long, default_value_t = proxy_common::monitor::MONITOR_DEFAULT_RATE, value_parser = number_in(0u32, u32::MAX))]
    pub rate: u32,
    /// Burst of events per CPU above the rate.
    #[arg(allow_hyphen_values = true, long, default_value_t = proxy_common::monitor::MONITOR_DEFAULT_BURST, value_parser = number_in(0u32, u32::MAX))]
    pub burst: u32,
}

/// Arguments of `cleanup`.
#[derive(clap::Args, Debug)]
pub struct CleanupArgs {
    /// The pinned data path.
    #[command(flatten)]
    pub pins: PinArgs,
    /// cgroup the programs were attached to. Accepted for symmetry with `run`: the programs
    /// are attached only through the pinned links, so removing those detaches them.
    #[arg(allow_hyphen_values = true, long)]
    pub cgroup_path: Option<PathBuf>,
    /// Remove nothing until kube-proxy has programmed this node (its canary chain and a full
    /// sync in iptables, or its synced nftables table), waiting at most this long, e.g. 5m:
    /// the rollback's guard, so that something always serves the Services. Exit code 1,
    /// nothing removed, when kube-proxy has not programmed the node by then.
    #[arg(long, allow_hyphen_values = true, value_parser = crate::config::parse_duration, value_name = "DURATION")]
    pub wait_for_kube_proxy: Option<std::time::Duration>,
}

/// Subcommands of `kube-proxy`.
#[derive(Subcommand, Debug)]
pub enum KubeProxyCommand {
    /// Say whether kube-proxy's rules are on this node and whether kube-proxy has programmed
    /// them (iptables: its canary chain and a full sync; nftables: its synced table); exit
    /// code 0 when it has.
    Status(KubeProxyStatusArgs),
    /// Remove kube-proxy's iptables chains and nftables tables from this node, as
    /// `kube-proxy --cleanup` does. Refuses while kube-proxy still runs on the node, or while
    /// this node's ebpf-proxy agent does not serve it (synced, and NodePorts, external and LB
    /// IPs served by its north-south programs: tcx, Linux >= 6.6), unless --force.
    Cleanup(KubeProxyCleanupArgs),
}

/// Arguments of `kube-proxy status`.
#[derive(clap::Args, Debug)]
pub struct KubeProxyStatusArgs {
    /// Keep reading (every second) until kube-proxy has programmed the node or this time
    /// has passed, e.g. 5m; 0 reads once.
    #[arg(long, allow_hyphen_values = true, default_value = "0s", value_parser = crate::config::parse_duration, value_name = "DURATION")]
    pub wait: std::time::Duration,
}

/// Arguments of `kube-proxy cleanup`.
#[derive(clap::Args, Debug)]
pub struct KubeProxyCleanupArgs {
    /// The agent's status server (its --status-bind-address), asked whether it serves the
    /// node.
    #[arg(allow_hyphen_values = true, long, default_value = "127.0.0.1:10266")]
    pub status_address: std::net::SocketAddr,
    /// Remove the rules even when kube-proxy still runs or the agent does not serve the
    /// node.
    #[arg(long)]
    pub force: bool,
    /// Only say what would be removed.
    #[arg(long)]
    pub dry_run: bool,
}

/// `monitor --duration`: plain seconds, or a duration as the agent's flags take it (Go's
/// syntax); greater than zero and at most a year.
///
/// Errors: not a number nor a duration, zero or negative, too long.
pub(crate) fn parse_monitor_duration(s: &str) -> Result<std::time::Duration, String> {
    // A bare number is seconds: the same checks as any duration flag.
    if s.parse::<f64>().is_ok() {
        return crate::config::parse_positive_duration(&format!("{s}s"));
    }
    crate::config::parse_positive_duration(s)
}

impl Cli {
    /// The command to run: the subcommand, else the agent with the top-level flags.
    pub fn into_command(self) -> Command {
        self.command
            .unwrap_or_else(|| Command::Run(Box::new(self.run)))
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use clap::{CommandFactory, FromArgMatches};

    use super::*;
    use crate::config::{self, Action, AgentConfig, ProxyMode, SourceChoice};

    fn command(argv: &[&str]) -> Command {
        let m = Cli::command()
            .try_get_matches_from(argv)
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        Cli::from_arg_matches(&m).unwrap().into_command()
    }

    /// The container command of kubeadm's kube-proxy DaemonSet (the fixture), with
    /// `$(NODE_NAME)` expanded as the kubelet does.
    fn kubeadm_command(node: &str) -> Vec<String> {
        let ds: serde_yaml_ng::Value = serde_yaml_ng::from_str(include_str!(
            "../tests/fixtures/kubeadm/kube-proxy-daemonset.yaml"
        ))
        .unwrap();
        ds["spec"]["template"]["spec"]["containers"][0]["command"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().replace("$(NODE_NAME)", node))
            .collect()
    }

    #[test]
    fn kubeadm_daemonset_and_configmap_run_the_agent_unchanged() {
        let argv = kubeadm_command("Worker-1");
        assert_eq!(argv[0], "/usr/local/bin/kube-proxy");
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let Command::Run(flags) = command(&argv) else {
            panic!("no subcommand must run the agent");
        };
        assert_eq!(
            flags.config.as_deref(),
            Some(std::path::Path::new("/var/lib/kube-proxy/config.conf"))
        );
        // The ConfigMap's config.conf, as mounted at /var/lib/kube-proxy.
        let loaded = config::parse(config::tests::KUBEADM).unwrap();
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let c = AgentConfig::resolve(*flags, Some(loaded.settings)).unwrap();
        assert_eq!(c.action, Action::Run);
        assert_eq!(c.proxy_mode, ProxyMode::Ebpf);
        assert_eq!(c.hostname_override.as_deref(), Some("worker-1"));
        assert_eq!(c.node_name(), "worker-1");
        assert_eq!(
            c.source,
            SourceChoice::Api(Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf")))
        );
        assert_eq!(c.cluster_cidrs, vec!["10.244.0.0/16".parse().unwrap()]);
        assert_eq!(
            c.healthz_bind_address,
            Some("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(
            c.metrics_bind_address,
            Some("127.0.0.1:10249".parse().unwrap())
        );
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn subcommands_still_work_and_run_takes_the_same_flags() {
        assert!(matches!(
            command(&["ebpf-proxy", "services"]),
            Command::Services(_)
        ));
        assert!(matches!(
            command(&["ebpf-proxy", "cleanup", "--pin-dir", "x"]),
            Command::Cleanup(_)
        ));
        let Command::Monitor(m) = command(&[
            "ebpf-proxy",
            "monitor",
            "--type",
            "translate,refuse",
            "--reason=no-endpoints",
            "-o",
            "json",
            "--count",
            "3",
        ]) else {
            panic!("not monitor");
        };
        assert_eq!(m.types, ["translate", "refuse"]);
        assert_eq!(m.reasons, ["no-endpoints"]);
        assert_eq!(m.output, MonitorOutput::Json);
        assert_eq!(m.count, Some(3));
        let argv = [
            "--config=/c.yaml",
            "--hostname-override=n",
            "--proxy-mode=ebpf",
            "-v=2",
            "--cleanup",
        ];
        let with_run: Vec<&str> = ["ebpf-proxy", "run"].iter().chain(&argv).copied().collect();
        let without: Vec<&str> = ["kube-proxy"].iter().chain(&argv).copied().collect();
        let (Command::Run(a), Command::Run(b)) = (command(&with_run), command(&without)) else {
            panic!("not run");
        };
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        // A flag given twice takes its last value (pflag's rule).
        let Command::Run(f) = command(&["kube-proxy", "--sync-period=1s", "--sync-period=2s"])
        else {
            panic!("not run")
        };
        assert_eq!(f.sync_period, Some(std::time::Duration::from_secs(2)));
        // kube-proxy's --version works too, and says what this is under either name.
        for argv0 in ["kube-proxy", "/usr/local/bin/kube-proxy", "ebpf-proxy"] {
            let e = Cli::command()
                .try_get_matches_from([argv0, "--version"])
                .unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::DisplayVersion);
            assert_eq!(
                e.to_string(),
                format!(
                    "ebpf-proxy {} (kube-proxy compatible flags)\n",
                    env!("CARGO_PKG_VERSION")
                )
            );
        }
        // Unknown flags are still refused (kube-proxy refuses them as well).
        assert!(
            Cli::command()
                .try_get_matches_from(["kube-proxy", "--no-such-flag"])
                .is_err()
        );
    }
    #[test]
    fn boolean_flags_take_go_values_as_kube_proxy_does() {
        // pflag's booleans: `--flag` and `--flag=true` set it, `--flag=false` clears it, a
        // separate word is no value (it stays an argument).
        for (arg, want) in [
            (None, false),
            (Some("--close-connections-to-removed-endpoints"), true),
            (Some("--close-connections-to-removed-endpoints=true"), true),
            (Some("--close-connections-to-removed-endpoints=1"), true),
            (
                Some("--close-connections-to-removed-endpoints=false"),
                false,
            ),
            (Some("--close-connections-to-removed-endpoints=F"), false),
        ] {
            let argv: Vec<&str> = ["kube-proxy"].into_iter().chain(arg).collect();
            let Command::Run(f) = command(&argv) else {
                panic!("not run")
            };
            assert_eq!(f.close_connections_to_removed_endpoints, want, "{arg:?}");
        }
        assert!(
            Cli::command()
                .try_get_matches_from([
                    "kube-proxy",
                    "--close-connections-to-removed-endpoints=maybe"
                ])
                .is_err()
        );
        for (arg, want) in [
            ("--mount-bpffs", true),
            ("--mount-bpffs=true", true),
            ("--mount-bpffs=false", false),
        ] {
            let Command::Check(c) = command(&["ebpf-proxy", "check", arg]) else {
                panic!("not check")
            };
            assert_eq!(c.mount_bpffs, want, "{arg}");
        }
        let Command::Check(c) = command(&["ebpf-proxy", "check"]) else {
            panic!("not check")
        };
        assert!(!c.mount_bpffs);
        for (arg, want) in [
            ("--api", true),
            ("--api=true", true),
            ("--api=false", false),
        ] {
            let Command::Explain(e) = command(&["ebpf-proxy", "explain", "10.96.0.10:53", arg])
            else {
                panic!("not explain")
            };
            assert_eq!(e.api, want, "{arg}");
        }
    }

    /// `monitor --count 0` would wait for an event and print it: refused, naming the flag.
    #[test]
    fn monitor_count_is_at_least_one() {
        let e = Cli::command()
            .try_get_matches_from(["ebpf-proxy", "monitor", "--count", "0"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("'--count"), "{e}");
        assert!(
            Cli::command()
                .try_get_matches_from(["ebpf-proxy", "monitor", "--count", "1"])
                .is_ok()
        );
    }

    /// A value given as the next argument may start with '-', as pflag takes it: a
    /// negative duration or number is refused by its own check, naming the flag, not
    /// taken for an unknown flag.
    #[test]
    fn negative_values_after_a_space_reach_their_checks() {
        for argv in [
            &["ebpf-proxy", "--min-sync-period", "-1s"][..],
            &["ebpf-proxy", "run", "--min-sync-period", "-1s"][..],
            &["ebpf-proxy", "--sync-period", "-30s"][..],
        ] {
            let e = Cli::command().try_get_matches_from(argv).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("negative"), "{argv:?}: {msg}");
            assert!(msg.contains("-sync-period"), "{argv:?}: {msg}");
        }
        let e = Cli::command()
            .try_get_matches_from(["ebpf-proxy", "--max-sockets", "-5"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid value '-5' for '--max-sockets"), "{e}");
        // Every option that takes a value, in the subcommands too.
        for (argv, flag) in [
            (
                &["ebpf-proxy", "check", "--conntrack-min", "-1"][..],
                "--conntrack-min",
            ),
            (&["ebpf-proxy", "monitor", "--count", "-1"][..], "--count"),
            (&["ebpf-proxy", "monitor", "--rate", "-1"][..], "--rate"),
            (
                &["ebpf-proxy", "monitor", "--duration", "-5"][..],
                "--duration",
            ),
            (
                &["ebpf-proxy", "--healthz-port", "-1"][..],
                "--healthz-port",
            ),
            (&["ebpf-proxy", "--v", "-1"][..], "--v"),
        ] {
            let e = Cli::command()
                .try_get_matches_from(argv)
                .unwrap_err()
                .to_string();
            assert!(e.contains("invalid value '-"), "{argv:?}: {e}");
            assert!(e.contains(&format!("'{flag}")), "{argv:?}: {e}");
        }
        let Command::Run(r) = command(&["ebpf-proxy", "--min-sync-period", "2s"]) else {
            panic!("not run")
        };
        assert_eq!(r.min_sync_period, Some(std::time::Duration::from_secs(2)));
    }

    /// `monitor --duration` takes seconds or a duration, and refuses what no clock can
    /// count instead of panicking.
    #[test]
    fn monitor_duration_takes_seconds_or_a_duration() {
        use std::time::Duration;
        assert_eq!(parse_monitor_duration("1"), Ok(Duration::from_secs(1)));
        assert_eq!(
            parse_monitor_duration("0.5"),
            Ok(Duration::from_millis(500))
        );
        assert_eq!(parse_monitor_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_monitor_duration("2m"), Ok(Duration::from_secs(120)));
        for bad in ["0", "-5", "1e20", "NaN", "inf", "0s", "abc", "-1s"] {
            assert!(parse_monitor_duration(bad).is_err(), "{bad}");
        }
        let Command::Monitor(m) = command(&["ebpf-proxy", "monitor", "--duration", "5s"]) else {
            panic!("not monitor")
        };
        assert_eq!(m.duration, Some(Duration::from_secs(5)));
    }
}
