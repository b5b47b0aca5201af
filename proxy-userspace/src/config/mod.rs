//! The agent's settings: command-line flags ([`RunFlags`]: ebpf-proxy's own and every flag of
//! kube-proxy), kube-proxy's configuration file (`--config`, a `KubeProxyConfiguration` of
//! `kubeproxy.config.k8s.io/v1alpha1`, see `file`) and the defaults, merged once into the
//! typed [`AgentConfig`] by [`AgentConfig::resolve`]: a flag given on the command line wins,
//! then the file, then the default.
//!
//! kube-proxy's flags are those of `cmd/kube-proxy/app/options.go` (and the logging flags of
//! component-base `logs/api/v1`) in kubernetes/kubernetes. Each has kube-proxy's meaning where
//! ebpf-proxy has one; the others are accepted and named in one warning each when given a
//! value other than their zero value. The same holds for the file's fields. Values use Go's
//! syntaxes (`go`): durations such as `1m0s` or `1.5s`, booleans as `--flag=false`.
//!
//! `--proxy-mode` / `mode`: empty or `ebpf` run the agent; kube-proxy's own modes stop
//! start-up with one line that says what ebpf-proxy is (`ProxyMode::require_ebpf`).
//!
//! The layout follows kube-proxy's (`pkg/proxy/apis/config`): one settings type,
//! [`AgentConfig`] (here); its defaults, `defaults`; the value types and their checks,
//! shared by the flags and the file, `values`; the flags, `flags`; the file, read and
//! checked section by section, `file`; the merge and the checks across settings,
//! `resolve`; the written-back `KubeProxyConfiguration`, built from [`AgentConfig`],
//! `written`. The settings that a flag (or several names of one), the file and a default
//! give in the same way, or a flag and a default alone, are each defined once, by a row of
//! the table of `settings`, from which their flags, their reading and checking in the file,
//! their precedence and their written-back fields are made; its documentation names the
//! settings left off it and why.
//!
//! Adding a setting: its field in [`AgentConfig`] (or in the settings of the part that uses
//! it, such as the north-south path's), and its row in the table of `settings`: its default
//! (a constant of `defaults` when something else shares it), its flags with their help and
//! value parser (a value type of `values`), and for a `KubeProxyConfiguration` field the
//! section and fields that give it with their reader (a function of `file`; the document
//! types already hold every v1alpha1 field) and, when not the usual one, its written-back
//! form. A setting of another shape (sources that combine otherwise, see `settings`) has its
//! flag in `flags`, its reading in `file`, its precedence line in `resolve` and its
//! line in `written`. A kube-proxy flag or field that gains an effect leaves the warnings of
//! `KubeProxyFlags::warnings` and `file::validate`.

pub(crate) mod defaults;
pub(crate) mod document;
mod fields;
pub(crate) mod file;
pub(crate) mod flags;
pub(crate) mod go;
mod resolve;
mod settings;
mod table;
pub(crate) mod values;
mod written;

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result};
use ipnet::IpNet;
use proxy_common::Algorithm;

pub(crate) use self::defaults::DEFAULT_BPFFS;
pub use self::defaults::DEFAULT_UDP_FLOW_TIMEOUT;
pub(crate) use self::file::{FileSettings, KubeProxyConfiguration};
pub use self::file::{load, parse};
pub(crate) use self::flags::KubeProxyFlags;
pub use self::flags::{PinArgs, RunFlags};
pub use self::values::LogFormat;
pub(crate) use self::values::{
    IpvsScheduler, NodePortAddresses, number_in, parse_conntrack_min, parse_duration,
    parse_positive_duration,
};
// Used by the unit tests only.
#[cfg(test)]
pub(crate) use self::defaults::{
    DEFAULT_CONNTRACK_MIN, DEFAULT_CT_TCP_ESTABLISHED, DEFAULT_MIN_SYNC_PERIOD,
    DEFAULT_OOM_SCORE_ADJ, DEFAULT_SYNC_PERIOD,
};
#[cfg(test)]
pub(crate) use self::file::yaml::plain_type_error;
#[cfg(test)]
pub(crate) use self::values::{ClusterCidrs, DETECT_LOCAL_MODES, ServerAddress};
// The tests read AgentConfig::proxy_mode, whose doc names it.
#[cfg(any(test, doc))]
pub(crate) use self::values::ProxyMode;
use crate::datapath::tc::TcSettings;
pub use crate::source::SourceChoice;

/// The `apiVersion` a configuration file must have.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The `kind` a configuration file must have.
pub const KIND: &str = "KubeProxyConfiguration";

/// What the process does with the settings (kube-proxy's order: `--write-config-to` first,
/// then `--cleanup`, then `--init-only`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Action {
    /// Run the agent.
    #[default]
    Run,
    /// `--write-config-to FILE`: write the effective configuration and exit.
    WriteConfig(PathBuf),
    /// `--cleanup`: remove the data path and exit.
    Cleanup,
    /// `--init-only`: set up the data path and exit.
    InitOnly,
}

/// Sizes of the maps created at start (adopted pins keep theirs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct MapSizeSettings {
    /// `--max-frontends`.
    pub frontends: u32,
    /// `--max-backend-slots`.
    pub slots: u32,
    /// `--max-backends`.
    pub backends: u32,
    /// `--max-sockets`.
    pub sockets: u32,
}

/// Every setting of the agent, merged once from the flags, the configuration file and the
/// defaults (a flag given wins, then the file, then the default), typed.
///
/// `AgentConfig::default()` holds zero values, not the settings' defaults: those are what
/// [`AgentConfig::resolve`] gives without flags and file.
#[derive(Clone, Debug, Default)]
pub struct AgentConfig {
    /// What to do.
    pub action: Action,
    /// `--proxy-mode` / `mode` (only [`ProxyMode::Ebpf`] runs: resolving refuses the others,
    /// so only the tests read it).
    #[cfg(test)]
    pub(crate) proxy_mode: ProxyMode,
    /// Where objects come from.
    pub source: SourceChoice,
    /// `--master`: the API server's URL, overriding the kubeconfig's.
    pub master: Option<String>,
    /// `--min-sync-period` (the pacing of the API source).
    pub(crate) min_sync_period: Duration,
    /// `--sync-period`.
    pub(crate) sync_period: Duration,
    /// `--metrics-bind-address` (`None`: no metrics server).
    pub(crate) metrics_bind_address: Option<SocketAddr>,
    /// `--healthz-bind-address` (`None`: no health server).
    pub(crate) healthz_bind_address: Option<SocketAddr>,
    /// `--status-bind-address` (`None`: no status server).
    pub(crate) status_bind_address: Option<SocketAddr>,
    /// `--bind-address-hard-fail`: a server that cannot bind stops the agent.
    pub(crate) bind_address_hard_fail: bool,
    /// `--bind-address` (kept for the written configuration).
    pub(crate) bind_address: Option<IpAddr>,
    /// `--cgroup-path` (`None`: the cgroup2 mount root).
    pub cgroup_path: Option<PathBuf>,
    /// The pin directory.
    pub pins: PinArgs,
    /// `--hostname-override`, trimmed and lowercased (the node name is resolved at start).
    pub hostname_override: Option<String>,
    /// `--lb-algorithm` (or `--ipvs-scheduler`).
    pub(crate) lb_algorithm: Algorithm,
    /// `--maglev-table-size`.
    pub(crate) maglev_table_size: u32,
    /// `--socket-lb-scope`.
    pub(crate) socket_lb_scope: crate::model::bypass::SocketLbScope,
    /// `--north-south-mode`.
    pub north_south_mode: crate::model::NorthSouthMode,
    /// `--kernel-log-level`.
    pub kernel_log_level: crate::datapath::loader::KernelLogLevel,
    /// `--close-connections-to-removed-endpoints`.
    pub(crate) close_connections_to_removed_endpoints: bool,
    /// `--log-level` (or `-v`).
    pub log_level: String,
    /// `-v` / `logging.verbosity` as given (for the written configuration).
    pub(crate) verbosity: Option<u32>,
    /// `--log-format`.
    pub log_format: LogFormat,
    /// `--cluster-cidr`.
    pub cluster_cidrs: Vec<IpNet>,
    /// `--nodeport-addresses` (`None`: every node address).
    pub nodeport_addresses: Option<NodePortAddresses>,
    /// Map sizes.
    pub(crate) map_sizes: MapSizeSettings,
    /// `--udp-flow-timeout`.
    pub(crate) udp_flow_timeout: Duration,
    /// The north-south path.
    pub tc: TcSettings,
    /// `--oom-score-adj`.
    pub(crate) oom_score_adj: i32,
    /// One line per flag given that has no effect here.
    pub warnings: Vec<String>,
    /// The effective configuration as a `KubeProxyConfiguration` (`--write-config-to`).
    pub document: KubeProxyConfiguration,
}

impl AgentConfig {
    /// The node name: `--hostname-override`, else `$NODE_NAME`, else the hostname
    /// (lowercased, as kube-proxy's `nodeutil.GetHostname`).
    pub fn node_name(&self) -> String {
        self.hostname_override
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| {
                std::env::var("NODE_NAME")
                    .ok()
                    .filter(|s| !s.trim().is_empty())
            })
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .map(|s| s.trim().to_lowercase())
            .unwrap_or_default()
    }

    /// The effective configuration as kube-proxy's configuration file (YAML), as
    /// `--write-config-to` writes it.
    pub(crate) fn kube_proxy_configuration(&self) -> String {
        serde_yaml_ng::to_string(&self.document).expect("the document serializes")
    }

    /// `--write-config-to`: writes the effective configuration as kube-proxy's configuration
    /// file (YAML, `AgentConfig::kube_proxy_configuration`) to `path`.
    pub fn write_config(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.kube_proxy_configuration())
            .with_context(|| format!("--write-config-to {}", path.display()))
    }
}

#[cfg(test)]
pub(crate) mod tests;
