//! The agent's flags, bound with clap: ebpf-proxy's own and every flag of kube-proxy
//! (`cmd/kube-proxy/app/options.go`, and the logging flags of component-base `logs/api/v1`,
//! in kubernetes/kubernetes). A flag's name, help, syntax and range are defined once: here,
//! or, for a setting of the table of `settings` (most of ebpf-proxy's own and those the
//! file gives too), in its row, whose flags [`RunFlags`] flattens in. Its value type and parser are shared
//! with the file ([`super::values`]), its default is in [`super::defaults`] (the help
//! repeats it in words), and [`super::AgentConfig::resolve`] applies the flags given onto
//! the settings, over the file.
//!
//! Settings left out are `None` (or empty), so that a flag given at its default value still
//! overrides the file.

use std::{path::PathBuf, time::Duration};

use anyhow::Result;
use proxy_common::Algorithm;

use super::defaults::{DEFAULT_BPFFS, DEFAULT_PIN_DIR};
use super::go::{FeatureGates, parse_go_bool};
use super::settings::SettingFlags;
use super::table::KUBE_PROXY_FLAGS;
use super::values::{
    LogFormat, SchedulerFlag, ServerAddress, check_detect_local_mode, number_in, parse_duration,
    parse_scheduler_flag,
};

/// The bpffs mount and the pin directory (every subcommand that touches pins takes them).
#[derive(clap::Args, Debug, Clone)]
pub struct PinArgs {
    /// Mount point of the BPF file system.
    #[arg(allow_hyphen_values = true, long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Directory under --bpffs holding the pinned maps and links.
    #[arg(allow_hyphen_values = true, long, default_value = DEFAULT_PIN_DIR)]
    pub(crate) pin_dir: String,
}

impl Default for PinArgs {
    fn default() -> Self {
        PinArgs {
            bpffs: PathBuf::from(DEFAULT_BPFFS),
            pin_dir: DEFAULT_PIN_DIR.into(),
        }
    }
}

impl PinArgs {
    /// The pin directory, after checking the name.
    pub fn dir(&self) -> Result<PathBuf> {
        crate::datapath::loader::check_pin_dir_name(&self.pin_dir)?;
        Ok(crate::datapath::loader::pin_dir(&self.bpffs, &self.pin_dir))
    }
}

fn parse_qps(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(n) if n.is_finite() && n >= 0.0 => Ok(n),
        _ => Err("must be a number of queries per second (0 or more, e.g. 5 or 0.5)".into()),
    }
}

fn parse_detect_local_mode(s: &str) -> Result<String, String> {
    check_detect_local_mode(s).map(|()| s.to_string())
}

fn parse_lb_algorithm(s: &str) -> Result<proxy_common::Algorithm, String> {
    crate::model::parse_algorithm(s)
        .ok_or_else(|| format!("{s:?} is not one of {}", crate::model::algorithm_names()))
}

/// The flags of the agent (`ebpf-proxy run`, or `ebpf-proxy` with no subcommand as
/// kube-proxy is run). A setting left out is taken from the configuration file (`--config`),
/// else its default: [`super::AgentConfig::resolve`] merges them once.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RunFlags {
    /// kube-proxy configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1).
    /// Flags given on the command line override its values.
    #[arg(allow_hyphen_values = true, long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Read Services and EndpointSlices from this directory of manifests (*.yaml, *.yml,
    /// *.json), watched for changes, instead of the Kubernetes API.
    #[arg(allow_hyphen_values = true, long, conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// Kubeconfig for the Kubernetes API [default: $KUBECONFIG or ~/.kube/config, else the
    /// in-cluster service account, as kube-rs `Config::infer`]. Read before anything is
    /// attached: a missing or broken configuration stops start-up.
    #[arg(allow_hyphen_values = true, long)]
    pub kubeconfig: Option<PathBuf>,
    /// The settings of the table of `settings` (read as fields of [`RunFlags`]).
    #[command(flatten)]
    pub settings: SettingFlags,
    /// Address of the Prometheus metrics server (`/metrics`): ip:port, an IP alone (port
    /// 10249), or empty to disable it; port 0 picks a free port [default: 127.0.0.1:10249].
    #[arg(allow_hyphen_values = true, long)]
    pub metrics_bind_address: Option<ServerAddress>,
    #[command(flatten)]
    pub pins: PinArgs,
    /// Backend selection of Services without the `ebpf-proxy.io/lb-algorithm` annotation:
    /// random (kube-proxy's), round-robin, weighted-round-robin, least-connections,
    /// source-hash, maglev, weighted-least-connections, shortest-expected-delay, never-queue,
    /// destination-hash, or an IPVS scheduler name (rr, wrr, lc, wlc, sed, nq, sh, dh, mh)
    /// [default: random].
    #[arg(allow_hyphen_values = true, long, value_parser = parse_lb_algorithm)]
    pub lb_algorithm: Option<Algorithm>,
    /// Address of the health server (`/healthz`, `/livez`): ip:port, an IP alone (port
    /// 10256), or empty to disable it; port 0 picks a free port [default: 0.0.0.0:10256].
    #[arg(allow_hyphen_values = true, long)]
    pub healthz_bind_address: Option<ServerAddress>,
    /// Log level of the agent (error, warn, info, debug, trace; other crates log warnings
    /// only), or a tracing filter directive with `=` or `,` (e.g. `info,kube=debug`)
    /// [default: info, or the one of -v].
    #[arg(allow_hyphen_values = true, long)]
    pub log_level: Option<String>,
    /// Log format: one text line or one JSON object per event [default: text].
    #[arg(allow_hyphen_values = true, long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// kube-proxy's other flags.
    #[command(flatten)]
    pub kube_proxy: KubeProxyFlags,
}

impl std::ops::Deref for RunFlags {
    type Target = SettingFlags;

    fn deref(&self) -> &SettingFlags {
        &self.settings
    }
}

/// kube-proxy's flags that ebpf-proxy has no name of its own for (the others are in
/// [`RunFlags`] under their kube-proxy names). Each is `None` unless given.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(next_help_heading = KUBE_PROXY_FLAGS)]
pub struct KubeProxyFlags {
    /// Write the effective configuration (flags, --config and defaults merged) to FILE as a
    /// KubeProxyConfiguration and exit.
    #[arg(allow_hyphen_values = true, long, value_name = "FILE")]
    pub write_config_to: Option<PathBuf>,
    /// Remove everything ebpf-proxy installed (programs, links, pinned maps under
    /// --bpffs/--pin-dir) and exit, as `ebpf-proxy cleanup`.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub cleanup: Option<bool>,
    /// Do the privileged start-up (preflight, mount bpffs, load, attach and pin the data
    /// path), then exit; a later run adopts what was pinned.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub init_only: Option<bool>,
    /// Proxy mode: empty or `ebpf`; kube-proxy's iptables, ipvs, nftables and kernelspace
    /// modes stop start-up with an error.
    #[arg(allow_hyphen_values = true, long, value_name = "MODE")]
    pub proxy_mode: Option<String>,
    /// URL of the Kubernetes API server, overriding the kubeconfig's.
    #[arg(allow_hyphen_values = true, long, value_name = "URL")]
    pub master: Option<String>,
    /// Default algorithm by its IPVS scheduler name: rr, wrr, lc, wlc, sed, nq, sh, dh, mh
    /// (see --lb-algorithm; mh is source-hash); empty keeps the default algorithm.
    #[arg(allow_hyphen_values = true, long, value_name = "SCHEDULER", value_parser = parse_scheduler_flag, conflicts_with = "lb_algorithm")]
    pub ipvs_scheduler: Option<SchedulerFlag>,
    /// Deprecated in kube-proxy: port of the health server (0 disables it).
    #[arg(allow_hyphen_values = true, long, value_name = "PORT", value_parser = number_in(0u16, u16::MAX))]
    pub healthz_port: Option<u16>,
    /// Deprecated in kube-proxy: port of the metrics server (0 disables it).
    #[arg(allow_hyphen_values = true, long, value_name = "PORT", value_parser = number_in(0u16, u16::MAX))]
    pub metrics_port: Option<u16>,
    /// Same as --log-format.
    #[arg(allow_hyphen_values = true, long, value_enum, value_name = "FORMAT")]
    pub logging_format: Option<LogFormat>,
    /// klog verbosity: 0-2 is --log-level info, 3-4 debug, 5 and more trace.
    #[arg(allow_hyphen_values = true, short = 'v', long = "v", value_name = "N", value_parser = number_in(0u32, u32::MAX))]
    pub verbosity: Option<u32>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "Name=bool,...")]
    pub feature_gates: Option<FeatureGates>,
    /// No effect here (the client sends JSON).
    #[arg(allow_hyphen_values = true, long, value_name = "TYPE")]
    pub kube_api_content_type: Option<String>,
    /// No effect here (the client does not throttle).
    #[arg(allow_hyphen_values = true, long, value_name = "N", value_parser = number_in(0i32, i32::MAX))]
    pub kube_api_burst: Option<i32>,
    /// No effect here (the client does not throttle).
    #[arg(allow_hyphen_values = true, long, value_name = "QPS", value_parser = parse_qps)]
    pub kube_api_qps: Option<f32>,
    /// No effect here (no /debug/pprof).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub profiling: Option<bool>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "VERSION")]
    pub show_hidden_metrics_for_version: Option<String>,
    /// No effect here (no fwmark).
    #[arg(allow_hyphen_values = true, long, value_name = "BIT", value_parser = number_in(0i32, 31))]
    pub iptables_masquerade_bit: Option<i32>,
    /// No effect here: node ports are never served on loopback (as kube-proxy's nftables
    /// mode).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub iptables_localhost_nodeports: Option<bool>,
    /// No effect here.
    #[arg(
        allow_hyphen_values = true,
        long,
        value_delimiter = ',',
        value_name = "CIDR,..."
    )]
    pub ipvs_exclude_cidrs: Vec<String>,
    /// No effect here.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub ipvs_strict_arp: Option<bool>,
    /// No effect here.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub ipvs_tcp_timeout: Option<Duration>,
    /// No effect here.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub ipvs_tcpfin_timeout: Option<Duration>,
    /// No effect here.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub ipvs_udp_timeout: Option<Duration>,
    /// How kube-proxy tells local traffic: ClusterCIDR (what --cluster-cidr does here),
    /// NodeCIDR, BridgeInterface or InterfaceNamePrefix (accepted, no effect here); any
    /// other value stops start-up, as in kube-proxy.
    #[arg(allow_hyphen_values = true, long, value_name = "MODE", value_parser = parse_detect_local_mode)]
    pub detect_local_mode: Option<String>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "NAME")]
    pub pod_bridge_interface: Option<String>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,
    /// No effect here.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,
    /// No effect here.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub conntrack_tcp_be_liberal: Option<bool>,
    /// No effect here (watches are not resynced).
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub config_sync_period: Option<Duration>,
    /// Removed from kube-proxy (userspace mode); no effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "RANGE")]
    pub proxy_port_range: Option<String>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "PATTERN=N,...")]
    pub vmodule: Option<String>,
    /// No effect here (logs are not buffered).
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION")]
    pub log_flush_frequency: Option<Duration>,
    /// No effect here (logs go to stderr).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub log_text_split_stream: Option<bool>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "SIZE")]
    pub log_text_info_buffer_size: Option<String>,
    /// No effect here (logs go to stderr).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
    pub log_json_split_stream: Option<bool>,
    /// No effect here.
    #[arg(allow_hyphen_values = true, long, value_name = "SIZE")]
    pub log_json_info_buffer_size: Option<String>,
    /// No effect here (cAdvisor's flag, linked into kube-proxy).
    #[arg(allow_hyphen_values = true, long, value_name = "FILES")]
    pub boot_id_file: Option<String>,
    /// No effect here (cAdvisor's flag, linked into kube-proxy).
    #[arg(allow_hyphen_values = true, long, value_name = "FILES")]
    pub machine_id_file: Option<String>,
}

impl KubeProxyFlags {
    /// One warning per flag given that has no effect here (a zero value, such as
    /// `--profiling=false`, is not reported); `--bind-address`'s is the table's row's, told
    /// first by `resolve`.
    pub fn warnings(&self) -> Vec<String> {
        let given = |set: bool, name: &str| {
            set.then(|| format!("flag --{name} has no effect in ebpf-proxy: ignored"))
        };
        let text = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.trim().is_empty());
        let yes = |v: &Option<bool>| v.unwrap_or(false);
        let nonzero = |v: &Option<Duration>| v.is_some_and(|d| !d.is_zero());
        [
            given(
                self.feature_gates.as_ref().is_some_and(|g| !g.0.is_empty()),
                "feature-gates",
            ),
            given(text(&self.kube_api_content_type), "kube-api-content-type"),
            given(
                self.kube_api_burst.is_some_and(|n| n != 0),
                "kube-api-burst",
            ),
            given(self.kube_api_qps.is_some_and(|n| n != 0.0), "kube-api-qps"),
            given(yes(&self.profiling), "profiling"),
            given(
                text(&self.show_hidden_metrics_for_version),
                "show-hidden-metrics-for-version",
            ),
            given(
                self.iptables_masquerade_bit.is_some(),
                "iptables-masquerade-bit",
            ),
            given(
                yes(&self.iptables_localhost_nodeports),
                "iptables-localhost-nodeports",
            ),
            given(!self.ipvs_exclude_cidrs.is_empty(), "ipvs-exclude-cidrs"),
            given(yes(&self.ipvs_strict_arp), "ipvs-strict-arp"),
            given(nonzero(&self.ipvs_tcp_timeout), "ipvs-tcp-timeout"),
            given(nonzero(&self.ipvs_tcpfin_timeout), "ipvs-tcpfin-timeout"),
            given(nonzero(&self.ipvs_udp_timeout), "ipvs-udp-timeout"),
            given(
                self.detect_local_mode
                    .as_deref()
                    .is_some_and(|m| !m.is_empty() && m != "ClusterCIDR"),
                "detect-local-mode",
            ),
            given(text(&self.pod_bridge_interface), "pod-bridge-interface"),
            given(
                text(&self.pod_interface_name_prefix),
                "pod-interface-name-prefix",
            ),
            given(
                nonzero(&self.conntrack_tcp_timeout_close_wait),
                "conntrack-tcp-timeout-close-wait",
            ),
            given(
                yes(&self.conntrack_tcp_be_liberal),
                "conntrack-tcp-be-liberal",
            ),
            given(nonzero(&self.config_sync_period), "config-sync-period"),
            given(text(&self.proxy_port_range), "proxy-port-range"),
            given(text(&self.vmodule), "vmodule"),
            given(nonzero(&self.log_flush_frequency), "log-flush-frequency"),
            given(yes(&self.log_text_split_stream), "log-text-split-stream"),
            given(
                text(&self.log_text_info_buffer_size),
                "log-text-info-buffer-size",
            ),
            given(yes(&self.log_json_split_stream), "log-json-split-stream"),
            given(
                text(&self.log_json_info_buffer_size),
                "log-json-info-buffer-size",
            ),
            given(text(&self.boot_id_file), "boot-id-file"),
            given(text(&self.machine_id_file), "machine-id-file"),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}
