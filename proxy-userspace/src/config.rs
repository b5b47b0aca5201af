//! `ebpf-proxy run --config FILE`: kube-proxy's configuration file, a `KubeProxyConfiguration`
//! of `kubeproxy.config.k8s.io/v1alpha1`, read with serde.
//!
//! Only the fields with a meaning here are read ([`FileSettings`]); they fill every setting
//! that was not given as a command-line flag (flags win, as in kube-proxy). Every other field
//! is reported by name in one warning: unknown fields (not in v1alpha1), and v1alpha1 fields
//! that have no effect here when they hold a value other than their zero value (kubeadm
//! writes every field, mostly as `""`, `0s`, `false` or `null`; those are not reported). An
//! invalid value stops start-up with an error that names the field.
//!
//! Durations take Go's notation as kube-proxy writes them (`30s`, `1m0s`, `2h22m`,
//! `500ms`); fractions such as `1.5s` are not accepted. A duration of zero means "unset", as
//! in kube-proxy's defaulting.

use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

use crate::datapath::tc::{
    DEFAULT_CONNTRACK_MAX_PER_CORE, DEFAULT_CONNTRACK_MIN, MAX_CONNTRACK_FLOWS,
    MIN_CONNTRACK_FLOWS, TcSettings,
};
use proxy_common::{
    DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS, DEFAULT_MAX_SLOTS, DEFAULT_MAX_SOCKETS,
};

/// The `apiVersion` a configuration file must have.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
/// The `kind` a configuration file must have.
pub const KIND: &str = "KubeProxyConfiguration";

/// Fields of v1alpha1 that are accepted and have no effect here.
const NO_EFFECT: &[&str] = &[
    "featureGates",
    "bindAddressHardFail",
    "enableProfiling",
    "showHiddenMetricsForVersion",
    "winkernel",
    "detectLocalMode",
    "detectLocal",
    "oomScoreAdj",
    "configSyncPeriod",
    "portRange",
    "windowsRunAsService",
];
const NO_EFFECT_CONNTRACK: &[&str] = &["tcpCloseWaitTimeout", "tcpBeLiberal"];
const NO_EFFECT_IPTABLES: &[&str] = &["masqueradeBit", "masqueradeAll", "localhostNodePorts"];
const NO_EFFECT_IPVS: &[&str] = &[
    "scheduler",
    "excludeCIDRs",
    "strictARP",
    "tcpTimeout",
    "tcpFinTimeout",
    "udpTimeout",
];
const NO_EFFECT_NFTABLES: &[&str] = &["masqueradeBit", "masqueradeAll"];
const NO_EFFECT_CLIENT: &[&str] = &["acceptContentTypes", "contentType", "qps", "burst"];
const NO_EFFECT_LOGGING: &[&str] = &["flushFrequency", "verbosity", "vmodule", "options"];

/// A `KubeProxyConfiguration` as written in the file: the fields read here, everything else
/// kept by name in `other` (so it can be reported, and written back unchanged).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    /// Must be [`API_VERSION`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// Must be [`KIND`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// kube-proxy's idea of the node's primary IP; checked, no effect here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind_address: Option<String>,
    /// `--healthz-bind-address` (`ip:port`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthz_bind_address: Option<String>,
    /// `--metrics-bind-address` (`ip:port`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_bind_address: Option<String>,
    /// `--cluster-cidr`: the pods' CIDR, or a comma-separated dual-stack pair.
    #[serde(
        default,
        rename = "clusterCIDR",
        skip_serializing_if = "Option::is_none"
    )]
    pub cluster_cidr: Option<String>,
    /// `--hostname-override`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname_override: Option<String>,
    /// `--nodeport-addresses`: CIDRs, or `primary` alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_port_addresses: Option<Vec<String>>,
    /// Proxy mode: empty or `ebpf`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// `conntrack.udpTimeout` is `--udp-flow-timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<Section>,
    /// `iptables.syncPeriod` / `iptables.minSyncPeriod`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iptables: Option<Section>,
    /// `ipvs.syncPeriod` / `ipvs.minSyncPeriod`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipvs: Option<Section>,
    /// `nftables.syncPeriod` / `nftables.minSyncPeriod`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nftables: Option<Section>,
    /// `clientConnection.kubeconfig` is `--kubeconfig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_connection: Option<Section>,
    /// `logging.format` (`text` or `json`) is `--log-format`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logging: Option<Section>,
    /// Every other field, by name.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// A nested section (`conntrack`, `iptables`, `ipvs`, `nftables`, `clientConnection`,
/// `logging`): the fields read here, the rest by name.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Section {
    /// `iptables|ipvs|nftables.syncPeriod`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<String>,
    /// `iptables|ipvs|nftables.minSyncPeriod`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<String>,
    /// `conntrack.udpTimeout` (in `ipvs` it has no effect here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<String>,
    /// `clientConnection.kubeconfig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<String>,
    /// `logging.format`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Every other field, by name.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// Log output format (`--log-format`, `logging.format` in the file).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line (tracing-subscriber's JSON format).
    Json,
}

/// A comma-separated list of CIDRs (`--cluster-cidr`, `clusterCIDR`): one CIDR, or an IPv4
/// and an IPv6 one for dual-stack clusters, as kube-proxy accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterCidrs(pub Vec<IpNet>);

impl FromStr for ClusterCidrs {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let cidrs = s
            .split(',')
            .map(|c| {
                c.trim()
                    .parse::<IpNet>()
                    .map_err(|_| format!("{:?} is not a CIDR (e.g. 10.244.0.0/16)", c.trim()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        match cidrs.as_slice() {
            [_] => {}
            [a, b] if a.addr().is_ipv4() != b.addr().is_ipv4() => {}
            _ => {
                return Err(format!(
                    "{s:?}: give one CIDR, or an IPv4 and an IPv6 CIDR separated by a comma"
                ));
            }
        }
        Ok(Self(cidrs))
    }
}

impl fmt::Display for ClusterCidrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&v.join(","))
    }
}

/// Where NodePorts would be served (`--nodeport-addresses`, `nodePortAddresses`): the
/// keyword `primary` (the node's primary addresses) alone, or a list of CIDRs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// The Node object's primary IPv4 and/or IPv6 addresses.
    Primary,
    /// Node addresses within these CIDRs.
    Cidrs(Vec<IpNet>),
}

impl NodePortAddresses {
    /// Parses the list form of the file (each item a CIDR or `primary`).
    pub fn from_items<S: AsRef<str>>(items: &[S]) -> Result<Self, String> {
        let items: Vec<&str> = items.iter().map(|s| s.as_ref().trim()).collect();
        if items.contains(&"primary") {
            if items.len() != 1 {
                return Err("\"primary\" cannot be combined with CIDRs".into());
            }
            return Ok(Self::Primary);
        }
        if items.is_empty() {
            return Err("the list is empty".into());
        }
        items
            .iter()
            .map(|c| {
                c.parse::<IpNet>().map_err(|_| {
                    format!("{c:?} is not a CIDR (e.g. 192.0.2.0/24) or the keyword \"primary\"")
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Self::Cidrs)
    }
}

impl FromStr for NodePortAddresses {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let items: Vec<&str> = s.split(',').collect();
        Self::from_items(&items)
    }
}

impl fmt::Display for NodePortAddresses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Primary => f.write_str("primary"),
            Self::Cidrs(c) => {
                let v: Vec<String> = c.iter().map(ToString::to_string).collect();
                f.write_str(&v.join(","))
            }
        }
    }
}

/// The settings a configuration file gives, after validation; `None` where the file leaves
/// the setting unset (absent, empty, or a zero duration).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FileSettings {
    /// `clientConnection.kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `hostnameOverride`.
    pub hostname_override: Option<String>,
    /// `healthzBindAddress`.
    pub healthz_bind_address: Option<SocketAddr>,
    /// `metricsBindAddress`.
    pub metrics_bind_address: Option<SocketAddr>,
    /// `clusterCIDR`.
    pub cluster_cidr: Option<ClusterCidrs>,
    /// `nodePortAddresses`.
    pub node_port_addresses: Option<NodePortAddresses>,
    /// `{iptables,nftables,ipvs}.syncPeriod`.
    pub sync_period: Option<Duration>,
    /// `{iptables,nftables,ipvs}.minSyncPeriod`.
    pub min_sync_period: Option<Duration>,
    /// `conntrack.udpTimeout`.
    pub udp_flow_timeout: Option<Duration>,
    /// `conntrack.maxPerCore` (`--conntrack-max-per-core`).
    pub conntrack_max_per_core: Option<u32>,
    /// `conntrack.min` (`--conntrack-min`).
    pub conntrack_min: Option<u32>,
    /// `conntrack.tcpEstablishedTimeout` (`--conntrack-tcp-timeout-established`).
    pub conntrack_tcp_timeout_established: Option<Duration>,
    /// `conntrack.udpStreamTimeout` (`--conntrack-udp-timeout-stream`).
    pub conntrack_udp_timeout_stream: Option<Duration>,
    /// `logging.format`.
    pub log_format: Option<LogFormat>,
}

/// A configuration file, read and validated.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Loaded {
    /// The settings it gives.
    pub settings: FileSettings,
    /// One line per field that is unknown or has no effect here, by name.
    pub warnings: Vec<String>,
}

/// Reads and validates the configuration file at `path`.
///
/// Errors: the file cannot be read or parsed, `apiVersion`/`kind` are not kube-proxy's
/// v1alpha1 configuration, `mode` is not empty or `ebpf`, or a field has an invalid value
/// (the message names the field).
pub fn load(path: &Path) -> Result<Loaded> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--config {}: cannot read the file", path.display()))?;
    parse(&text).with_context(|| format!("--config {}", path.display()))
}

/// Parses and validates a configuration file's text (see [`load`]).
pub fn parse(text: &str) -> Result<Loaded> {
    let file: KubeProxyConfiguration =
        serde_yaml_ng::from_str(text).context("not a KubeProxyConfiguration document")?;
    validate(&file)
}

/// True for a value that kube-proxy treats as unset: null, false, 0, "", a zero duration,
/// and empty lists or maps (or maps holding only such values).
fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || humantime::parse_duration(s).is_ok_and(|d| d.is_zero()),
        Value::Sequence(s) => s.is_empty(),
        Value::Mapping(m) => m.values().all(is_unset),
        Value::Tagged(_) => false,
    }
}

/// A string field; empty means unset.
fn text(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

/// A duration field (Go notation); empty or zero means unset.
fn duration(field: &str, v: &Option<String>) -> Result<Option<Duration>> {
    let Some(s) = text(v) else { return Ok(None) };
    let d = humantime::parse_duration(s).map_err(|e| {
        anyhow::anyhow!("{field}: invalid duration {s:?} ({e}); use e.g. 30s, 1m0s or 500ms")
    })?;
    Ok((!d.is_zero()).then_some(d))
}

/// An integer field in `least..=most` (kube-proxy's `*int32`); null or absent is `None`.
fn count(field: &str, v: Option<&Value>, least: u32, most: u32) -> Result<Option<u32>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= least as u64 && n <= most as u64 => Ok(Some(n as u32)),
            _ => bail!("{field}: {} is not an integer in {least}..={most}", show(v)),
        },
    }
}

/// A duration field given as a YAML value (Go notation in a string); null, absent, empty or
/// zero is `None`. Anything else that is not a duration of at least 1 ms is an error naming
/// the field.
fn duration_value(field: &str, v: Option<&Value>) -> Result<Option<Duration>> {
    let text = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => bail!(
            "{field}: {} is not a duration; write a string such as \"24h\" or \"1m30s\"",
            show(other)
        ),
    };
    let d = duration(field, &text)?;
    if let Some(d) = d
        && d < Duration::from_millis(1)
    {
        bail!(
            "{field}: {} is too short (at least 1ms)",
            humantime::format_duration(d)
        );
    }
    Ok(d)
}

/// A YAML value as written (for messages), not its Rust debug form.
fn show(v: &Value) -> String {
    serde_yaml_ng::to_string(v)
        .map(|s| s.trim_end().to_string())
        .unwrap_or_else(|_| format!("{v:?}"))
}

/// An `ip:port` field.
fn host_port(field: &str, v: &Option<String>) -> Result<Option<SocketAddr>> {
    let Some(s) = text(v) else { return Ok(None) };
    s.parse::<SocketAddr>().map(Some).map_err(|_| {
        anyhow::anyhow!(
            "{field}: {s:?} is not an IP address and port (e.g. 0.0.0.0:10256 or [::]:10256)"
        )
    })
}

fn warn_other(
    warnings: &mut Vec<String>,
    prefix: &str,
    other: &BTreeMap<String, Value>,
    no_effect: &[&str],
) {
    for (name, value) in other {
        let path = format!("{prefix}{name}");
        if !no_effect.contains(&name.as_str()) {
            warnings.push(format!(
                "--config: unknown field {path:?} (not in {API_VERSION} {KIND}): ignored"
            ));
        } else if !is_unset(value) {
            warnings.push(format!(
                "--config: field {path:?} has no effect in ebpf-proxy: ignored"
            ));
        }
    }
}

/// Checks a parsed file and extracts its settings.
pub fn validate(file: &KubeProxyConfiguration) -> Result<Loaded> {
    match file.api_version.as_deref() {
        Some(API_VERSION) => {}
        other => bail!("apiVersion: expected {API_VERSION:?}, found {other:?}"),
    }
    match file.kind.as_deref() {
        Some(KIND) => {}
        other => bail!("kind: expected {KIND:?}, found {other:?}"),
    }
    if let Some(mode) = text(&file.mode)
        && mode != "ebpf"
    {
        bail!(
            "mode: {mode:?} is not supported by ebpf-proxy; leave it empty or set it to \"ebpf\""
        );
    }
    let mut s = FileSettings::default();
    let mut warnings = Vec::new();

    if let Some(b) = text(&file.bind_address) {
        let ip: IpAddr = b
            .parse()
            .map_err(|_| anyhow::anyhow!("bindAddress: {b:?} is not an IP address"))?;
        if !ip.is_unspecified() {
            warnings.push(format!(
                "--config: field \"bindAddress\" ({b}) has no effect in ebpf-proxy: ignored"
            ));
        }
    }
    s.healthz_bind_address = host_port("healthzBindAddress", &file.healthz_bind_address)?;
    s.metrics_bind_address = host_port("metricsBindAddress", &file.metrics_bind_address)?;
    if let Some(c) = text(&file.cluster_cidr) {
        s.cluster_cidr = Some(c.parse().map_err(|e| anyhow::anyhow!("clusterCIDR: {e}"))?);
    }
    s.hostname_override = text(&file.hostname_override).map(str::to_string);
    if let Some(items) = file.node_port_addresses.as_ref().filter(|v| !v.is_empty()) {
        s.node_port_addresses = Some(
            NodePortAddresses::from_items(items)
                .map_err(|e| anyhow::anyhow!("nodePortAddresses: {e}"))?,
        );
    }

    // Sync periods: kube-proxy reads them from its mode's section. ebpf-proxy has no section
    // of its own, so it takes them from any of the three; values given in several must agree.
    for (field, pick) in [
        (
            "syncPeriod",
            (|x: &Section| &x.sync_period) as fn(&Section) -> &Option<String>,
        ),
        ("minSyncPeriod", |x: &Section| &x.min_sync_period),
    ] {
        let mut found: Option<(String, Duration)> = None;
        for (name, section) in [
            ("nftables", &file.nftables),
            ("iptables", &file.iptables),
            ("ipvs", &file.ipvs),
        ] {
            let Some(section) = section else { continue };
            let path = format!("{name}.{field}");
            let Some(d) = duration(&path, pick(section))? else {
                continue;
            };
            match &found {
                Some((first, v)) if *v != d => bail!(
                    "{path}: {} differs from {first} ({}); give one value",
                    humantime::format_duration(d),
                    humantime::format_duration(*v)
                ),
                Some(_) => {}
                None => found = Some((path, d)),
            }
        }
        let d = found.map(|(_, d)| d);
        if field == "syncPeriod" {
            s.sync_period = d;
        } else {
            s.min_sync_period = d;
        }
    }
    if let (Some(min), Some(max)) = (s.min_sync_period, s.sync_period)
        && min > max
    {
        bail!(
            "minSyncPeriod: {} is longer than syncPeriod ({})",
            humantime::format_duration(min),
            humantime::format_duration(max)
        );
    }
    for (name, section, no_effect) in [
        ("iptables", &file.iptables, NO_EFFECT_IPTABLES),
        ("ipvs", &file.ipvs, NO_EFFECT_IPVS),
        ("nftables", &file.nftables, NO_EFFECT_NFTABLES),
    ] {
        let Some(section) = section else { continue };
        let other = section_rest(section, &["syncPeriod", "minSyncPeriod"]);
        warn_other(&mut warnings, &format!("{name}."), &other, no_effect);
    }

    if let Some(c) = &file.conntrack {
        s.udp_flow_timeout = duration("conntrack.udpTimeout", &c.udp_timeout)?;
        use crate::datapath::tc::{MAX_CONNTRACK_FLOWS, MIN_CONNTRACK_FLOWS};
        s.conntrack_max_per_core = count(
            "conntrack.maxPerCore",
            c.other.get("maxPerCore"),
            0,
            MAX_CONNTRACK_FLOWS,
        )?;
        // 0 is kube-proxy's "leave it as is": the default here.
        s.conntrack_min = match c.other.get("min") {
            Some(v) if v.as_u64() == Some(0) => None,
            v => count("conntrack.min", v, MIN_CONNTRACK_FLOWS, MAX_CONNTRACK_FLOWS)?,
        };
        s.conntrack_tcp_timeout_established = duration_value(
            "conntrack.tcpEstablishedTimeout",
            c.other.get("tcpEstablishedTimeout"),
        )?;
        s.conntrack_udp_timeout_stream = duration_value(
            "conntrack.udpStreamTimeout",
            c.other.get("udpStreamTimeout"),
        )?;
        let mut other = section_rest(c, &["udpTimeout"]);
        for read in [
            "maxPerCore",
            "min",
            "tcpEstablishedTimeout",
            "udpStreamTimeout",
        ] {
            other.remove(read);
        }
        warn_other(&mut warnings, "conntrack.", &other, NO_EFFECT_CONNTRACK);
    }
    if let Some(c) = &file.client_connection {
        s.kubeconfig = text(&c.kubeconfig).map(PathBuf::from);
        let other = section_rest(c, &["kubeconfig"]);
        warn_other(&mut warnings, "clientConnection.", &other, NO_EFFECT_CLIENT);
    }
    if let Some(l) = &file.logging {
        s.log_format = match text(&l.format) {
            None => None,
            Some("text") => Some(LogFormat::Text),
            Some("json") => Some(LogFormat::Json),
            Some(f) => bail!("logging.format: {f:?} is not supported; use \"text\" or \"json\""),
        };
        let other = section_rest(l, &["format"]);
        warn_other(&mut warnings, "logging.", &other, NO_EFFECT_LOGGING);
    }
    warn_other(&mut warnings, "", &file.other, NO_EFFECT);
    Ok(Loaded {
        settings: s,
        warnings,
    })
}

/// The fields of a section other than `read`, by name (typed fields not read in this section
/// count as other fields, so they are reported too).
fn section_rest(s: &Section, read: &[&str]) -> BTreeMap<String, Value> {
    let mut other = s.other.clone();
    for (f, v) in [
        ("syncPeriod", &s.sync_period),
        ("minSyncPeriod", &s.min_sync_period),
        ("udpTimeout", &s.udp_timeout),
        ("kubeconfig", &s.kubeconfig),
        ("format", &s.format),
    ] {
        if let Some(v) = v
            && !read.contains(&f)
        {
            other.insert(f.into(), Value::String(v.clone()));
        }
    }
    other
}

/// Mount point of the BPF file system by default.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";
/// Pin directory under the BPF file system by default.
pub const DEFAULT_PIN_DIR: &str = "ebpf-proxy";
/// `--min-sync-period` by default (kube-proxy's).
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
/// `--sync-period` by default (kube-proxy's).
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// `--metrics-bind-address` by default (kube-proxy's).
pub const DEFAULT_METRICS_BIND_ADDRESS: &str = "127.0.0.1:10249";
/// `--healthz-bind-address` by default (kube-proxy's).
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: &str = "0.0.0.0:10256";
/// `--udp-flow-timeout` by default (the kernel's `nf_conntrack_udp_timeout`).
pub const DEFAULT_UDP_FLOW_TIMEOUT: Duration = Duration::from_secs(30);
/// `--conntrack-tcp-timeout-established` by default (kube-proxy's).
pub const DEFAULT_CT_TCP_ESTABLISHED: Duration = Duration::from_secs(24 * 3600);
/// `--conntrack-udp-timeout-stream` by default (kube-proxy's).
pub const DEFAULT_CT_UDP_STREAM: Duration = Duration::from_secs(120);
/// Longest period or timeout accepted (timer arithmetic stays far from overflow).
pub const MAX_PERIOD: Duration = Duration::from_secs(365 * 24 * 3600);

/// The bpffs mount and the pin directory (every subcommand that touches pins takes them).
#[derive(clap::Args, Debug, Clone)]
pub struct PinArgs {
    /// Mount point of the BPF file system.
    #[arg(long, default_value = DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// Directory under --bpffs holding the pinned maps and links.
    #[arg(long, default_value = DEFAULT_PIN_DIR)]
    pub pin_dir: String,
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

/// A duration greater than zero and at most [`MAX_PERIOD`] (humantime syntax).
pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    if d > MAX_PERIOD {
        return Err("must be at most 8760h (a year)".into());
    }
    Ok(d)
}

/// A duration of at least 1 ms (humantime syntax: 30s, 2m, 24h).
pub fn parse_timeout(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(1) {
        return Err(format!("{s:?} is too short (at least 1ms)"));
    }
    if d > MAX_PERIOD {
        return Err("must be at most 8760h (a year)".into());
    }
    Ok(d)
}

fn parse_lb_algorithm(s: &str) -> Result<proxy_common::Algorithm, String> {
    crate::model::parse_algorithm(s)
        .ok_or_else(|| format!("{s:?} is not one of {}", crate::model::algorithm_names()))
}

fn parse_maglev_size(s: &str) -> Result<u32, String> {
    let n: u32 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !crate::maglev::is_prime(n) || n as usize > proxy_common::MAGLEV_MAX || n < 7 {
        return Err(format!(
            "{n} is not a prime between 7 and {} (e.g. 251, 1021, 4093, 16381, 65521)",
            proxy_common::MAGLEV_MAX
        ));
    }
    Ok(n)
}

/// The flags of `ebpf-proxy run`. A setting left out is taken from the configuration file
/// (`--config`), else its default: [`AgentConfig::resolve`] merges them once.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RunFlags {
    /// kube-proxy configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1).
    /// Flags given on the command line override its values.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Read Services and EndpointSlices from this directory of manifests (*.yaml, *.yml,
    /// *.json), watched for changes, instead of the Kubernetes API.
    #[arg(long, conflicts_with = "kubeconfig")]
    pub manifests: Option<PathBuf>,
    /// Kubeconfig for the Kubernetes API [default: $KUBECONFIG or ~/.kube/config, else the
    /// in-cluster service account, as kube-rs `Config::infer`]. Read before anything is
    /// attached: a missing or broken configuration stops start-up.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Minimum time between two syncs from the API source; an isolated change after a
    /// quiet period is applied at once (kube-proxy's --min-sync-period) [default: 1s].
    #[arg(long, value_parser = humantime::parse_duration)]
    pub min_sync_period: Option<Duration>,
    /// Period of the verification that compares the maps with what was applied and
    /// repairs entries changed behind the agent's back (kube-proxy's --sync-period).
    /// /healthz fails when an update stays pending for twice this long [default: 30s].
    #[arg(long, value_parser = parse_positive_duration)]
    pub sync_period: Option<Duration>,
    /// Address of the Prometheus metrics server (`/metrics`); port 0 picks a free port
    /// [default: 127.0.0.1:10249].
    #[arg(long)]
    pub metrics_bind_address: Option<SocketAddr>,
    /// cgroup v2 directory to attach the socket programs to [default: the cgroup2 mount root
    /// from /proc/self/mounts, i.e. every process of the node].
    #[arg(long)]
    pub cgroup_path: Option<PathBuf>,
    #[command(flatten)]
    pub pins: PinArgs,
    /// Name of this node [default: $NODE_NAME, else the hostname].
    #[arg(long)]
    pub hostname_override: Option<String>,
    /// Backend selection of Services without the `ebpf-proxy.io/lb-algorithm` annotation:
    /// random (kube-proxy's), round-robin, weighted-round-robin, least-connections,
    /// source-hash, maglev, weighted-least-connections, shortest-expected-delay, never-queue,
    /// destination-hash, or an IPVS scheduler name (rr, wrr, lc, wlc, sed, nq, sh, dh, mh)
    /// [default: random].
    #[arg(long, value_parser = parse_lb_algorithm)]
    pub lb_algorithm: Option<proxy_common::Algorithm>,
    /// Size of the Maglev lookup tables of source-hash and maglev Services: a prime from 7 to
    /// 65521 (larger tables spread backends more evenly; each costs 4 bytes per entry)
    /// [default: 16381].
    #[arg(long, value_parser = parse_maglev_size)]
    pub maglev_table_size: Option<u32>,
    /// Address of the health server (`/healthz`, `/livez`); port 0 picks a free port
    /// [default: 0.0.0.0:10256].
    #[arg(long)]
    pub healthz_bind_address: Option<SocketAddr>,
    /// Log level of the agent (error, warn, info, debug, trace; other crates log warnings
    /// only), or a tracing filter directive with `=` or `,` (e.g. `info,kube=debug`)
    /// [default: info].
    #[arg(long)]
    pub log_level: Option<String>,
    /// Log format: one text line or one JSON object per event [default: text].
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// CIDR of the cluster's pods, or an IPv4 and an IPv6 CIDR separated by a comma
    /// (kube-proxy's --cluster-cidr): traffic entering the node to a cluster IP from a
    /// client outside the prefix of its family is masqueraded (tc path).
    #[arg(long)]
    pub cluster_cidr: Option<ClusterCidrs>,
    /// Node addresses that serve NodePorts: comma-separated CIDRs, or `primary` (the
    /// node's first InternalIP per family, kube-proxy's nftables default) [default: every
    /// InternalIP and ExternalIP of this node's Node object] (kube-proxy's
    /// --nodeport-addresses).
    #[arg(long)]
    pub nodeport_addresses: Option<NodePortAddresses>,
    /// Size of the frontend map (VIP x port x protocol, plus one entry per VIP) when created
    /// [default: 65536].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_frontends: Option<u32>,
    /// Size of the backend slot map (sum of all services' endpoint counts) when created
    /// [default: 524288].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_backend_slots: Option<u32>,
    /// Size of the backend map (distinct endpoint address x port x protocol) when created
    /// [default: 262144].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_backends: Option<u32>,
    /// Size of the per-socket reverse-NAT and UDP flow maps (LRU) when created
    /// [default: 262144].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_sockets: Option<u32>,
    /// Idle time after which an unconnected UDP flow picks a backend anew, like conntrack's
    /// nf_conntrack_udp_timeout (e.g. 30s, 2m) [default: 30s].
    #[arg(long, value_parser = parse_positive_duration)]
    pub udp_flow_timeout: Option<Duration>,
    /// Interfaces that serve NodePorts, external IPs and LB IPs to traffic from outside the
    /// node, comma-separated [default: the interfaces of the agent's network namespace that
    /// carry one of this node's InternalIP/ExternalIP addresses from its Node object].
    #[arg(long, value_delimiter = ',')]
    pub interfaces: Vec<String>,
    /// Source-NAT every external flow of a Cluster-policy Service to the node address, also
    /// when the backend runs on this node (kube-proxy's --masquerade-all).
    #[arg(long)]
    pub masquerade_all: bool,
    /// Flows tracked per CPU by the north-south conntrack table (kube-proxy's
    /// --conntrack-max-per-core); the table holds max(this x CPUs, --conntrack-min) flows.
    /// The table is preallocated (about 320 bytes per flow), unlike the kernel's conntrack
    /// limit kube-proxy sets, so the default is 0: --conntrack-min alone, whatever the core
    /// count. Fixed when the pinned table is created [default: 0].
    #[arg(long, value_parser = clap::value_parser!(u32).range(..=MAX_CONNTRACK_FLOWS as i64))]
    pub conntrack_max_per_core: Option<u32>,
    /// Least number of flows of the north-south conntrack table (kube-proxy's
    /// --conntrack-min), from 1024 (smaller LRU tables lose live flows to the kernel's batch
    /// eviction) to 16777216 [default: 131072].
    #[arg(long, value_parser = clap::value_parser!(u32).range(MIN_CONNTRACK_FLOWS as i64..=MAX_CONNTRACK_FLOWS as i64))]
    pub conntrack_min: Option<u32>,
    /// Idle timeout of an established TCP flow in the north-south conntrack (kube-proxy's
    /// --conntrack-tcp-timeout-established), e.g. 24h [default: 24h].
    #[arg(long, value_parser = parse_timeout)]
    pub conntrack_tcp_timeout_established: Option<Duration>,
    /// Idle timeout of a UDP flow that saw replies in the north-south conntrack (kube-proxy's
    /// --conntrack-udp-timeout-stream, the kernel's nf_conntrack_udp_timeout_stream), e.g.
    /// 2m. Unreplied UDP flows use --udp-flow-timeout [default: 2m].
    #[arg(long, value_parser = parse_timeout)]
    pub conntrack_udp_timeout_stream: Option<Duration>,
}

/// Where the agent reads objects from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceChoice {
    /// A directory of manifests (`--manifests`).
    Manifests(PathBuf),
    /// The Kubernetes API, with this kubeconfig (else `Config::infer`).
    Api(Option<PathBuf>),
}

/// Sizes of the maps created at start (adopted pins keep theirs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizeSettings {
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
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Where objects come from.
    pub source: SourceChoice,
    /// `--min-sync-period` (the pacing of the API source).
    pub min_sync_period: Duration,
    /// `--sync-period`.
    pub sync_period: Duration,
    /// `--metrics-bind-address`.
    pub metrics_bind_address: SocketAddr,
    /// `--healthz-bind-address`.
    pub healthz_bind_address: SocketAddr,
    /// `--cgroup-path` (`None`: the cgroup2 mount root).
    pub cgroup_path: Option<PathBuf>,
    /// The pin directory.
    pub pins: PinArgs,
    /// `--hostname-override` as given (the node name is resolved at start).
    pub hostname_override: Option<String>,
    /// `--lb-algorithm`.
    pub lb_algorithm: proxy_common::Algorithm,
    /// `--maglev-table-size`.
    pub maglev_table_size: u32,
    /// `--log-level`.
    pub log_level: String,
    /// `--log-format`.
    pub log_format: LogFormat,
    /// `--cluster-cidr`.
    pub cluster_cidrs: Vec<IpNet>,
    /// `--nodeport-addresses` (`None`: every node address).
    pub nodeport_addresses: Option<NodePortAddresses>,
    /// Map sizes.
    pub map_sizes: MapSizeSettings,
    /// `--udp-flow-timeout`.
    pub udp_flow_timeout: Duration,
    /// The north-south path.
    pub tc: TcSettings,
}

impl AgentConfig {
    /// Merges the flags with the configuration file's settings (`file`, when `--config` was
    /// given) and the defaults.
    ///
    /// Errors: `--min-sync-period` longer than `--sync-period` (as kube-proxy's
    /// validation), whether they come from flags or the file.
    pub fn resolve(flags: RunFlags, file: Option<FileSettings>) -> Result<AgentConfig> {
        let f = file.unwrap_or_default();
        let source = match flags.manifests {
            Some(m) => SourceChoice::Manifests(m),
            // The file's kubeconfig is a source choice too; --manifests is the other one.
            None => SourceChoice::Api(flags.kubeconfig.or(f.kubeconfig)),
        };
        let c = AgentConfig {
            source,
            min_sync_period: flags
                .min_sync_period
                .or(f.min_sync_period)
                .unwrap_or(DEFAULT_MIN_SYNC_PERIOD),
            sync_period: flags
                .sync_period
                .or(f.sync_period)
                .unwrap_or(DEFAULT_SYNC_PERIOD),
            metrics_bind_address: flags
                .metrics_bind_address
                .or(f.metrics_bind_address)
                .unwrap_or_else(|| DEFAULT_METRICS_BIND_ADDRESS.parse().expect("valid")),
            healthz_bind_address: flags
                .healthz_bind_address
                .or(f.healthz_bind_address)
                .unwrap_or_else(|| DEFAULT_HEALTHZ_BIND_ADDRESS.parse().expect("valid")),
            cgroup_path: flags.cgroup_path,
            pins: flags.pins,
            hostname_override: flags.hostname_override.or(f.hostname_override),
            lb_algorithm: flags.lb_algorithm.unwrap_or_default(),
            maglev_table_size: flags
                .maglev_table_size
                .unwrap_or(proxy_common::MAGLEV_DEFAULT),
            log_level: flags.log_level.unwrap_or_else(|| "info".into()),
            log_format: flags.log_format.or(f.log_format).unwrap_or_default(),
            cluster_cidrs: flags
                .cluster_cidr
                .or(f.cluster_cidr)
                .map(|c| c.0)
                .unwrap_or_default(),
            nodeport_addresses: flags.nodeport_addresses.or(f.node_port_addresses),
            map_sizes: MapSizeSettings {
                frontends: flags.max_frontends.unwrap_or(DEFAULT_MAX_FRONTENDS),
                slots: flags.max_backend_slots.unwrap_or(DEFAULT_MAX_SLOTS),
                backends: flags.max_backends.unwrap_or(DEFAULT_MAX_BACKENDS),
                sockets: flags.max_sockets.unwrap_or(DEFAULT_MAX_SOCKETS),
            },
            udp_flow_timeout: flags
                .udp_flow_timeout
                .or(f.udp_flow_timeout)
                .unwrap_or(DEFAULT_UDP_FLOW_TIMEOUT),
            tc: TcSettings {
                interfaces: flags.interfaces,
                masquerade_all: flags.masquerade_all,
                conntrack_max_per_core: flags
                    .conntrack_max_per_core
                    .or(f.conntrack_max_per_core)
                    .unwrap_or(DEFAULT_CONNTRACK_MAX_PER_CORE),
                conntrack_min: flags
                    .conntrack_min
                    .or(f.conntrack_min)
                    .unwrap_or(DEFAULT_CONNTRACK_MIN),
                conntrack_tcp_timeout_established: flags
                    .conntrack_tcp_timeout_established
                    .or(f.conntrack_tcp_timeout_established)
                    .unwrap_or(DEFAULT_CT_TCP_ESTABLISHED),
                conntrack_udp_timeout_stream: flags
                    .conntrack_udp_timeout_stream
                    .or(f.conntrack_udp_timeout_stream)
                    .unwrap_or(DEFAULT_CT_UDP_STREAM),
            },
        };
        if c.sync_period > MAX_PERIOD {
            bail!("--sync-period must be at most 8760h (a year)");
        }
        if c.min_sync_period > c.sync_period {
            bail!(
                "--min-sync-period ({}) is longer than --sync-period ({})",
                humantime::format_duration(c.min_sync_period),
                humantime::format_duration(c.sync_period)
            );
        }
        Ok(c)
    }

    /// The node name: `--hostname-override`, else `$NODE_NAME`, else the hostname.
    pub fn node_name(&self) -> String {
        self.hostname_override
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| std::env::var("NODE_NAME").ok().filter(|s| !s.is_empty()))
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field a kube-proxy v1alpha1 file can have, as kubeadm writes it, with values.
    const FULL: &str = r#"
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 45s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
featureGates: {}
healthzBindAddress: 0.0.0.0:10256
hostnameOverride: node-1
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 2s
  syncPeriod: 1m0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
logging:
  flushFrequency: 0
  format: json
  options:
    json:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: 127.0.0.1:10249
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: [192.0.2.0/24, "2001:db8::/64"]
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

    #[test]
    fn full_file_round_trip() {
        let loaded = parse(FULL).unwrap();
        assert_eq!(
            loaded.warnings,
            Vec::<String>::new(),
            "zero values are not reported"
        );
        let s = &loaded.settings;
        assert_eq!(
            s.kubeconfig.as_deref(),
            Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert_eq!(s.hostname_override.as_deref(), Some("node-1"));
        assert_eq!(
            s.healthz_bind_address,
            Some("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(
            s.metrics_bind_address,
            Some("127.0.0.1:10249".parse().unwrap())
        );
        assert_eq!(
            s.cluster_cidr.as_ref().unwrap().to_string(),
            "10.244.0.0/16,fd00:10:244::/56"
        );
        assert_eq!(
            s.node_port_addresses.as_ref().unwrap().to_string(),
            "192.0.2.0/24,2001:db8::/64"
        );
        assert_eq!(s.sync_period, Some(Duration::from_secs(60)));
        assert_eq!(s.min_sync_period, Some(Duration::from_secs(2)));
        assert_eq!(s.udp_flow_timeout, Some(Duration::from_secs(45)));
        assert_eq!(s.log_format, Some(LogFormat::Json));

        // Written back and read again, the file gives the same document and settings.
        let file: KubeProxyConfiguration = serde_yaml_ng::from_str(FULL).unwrap();
        let again = serde_yaml_ng::to_string(&file).unwrap();
        let file2: KubeProxyConfiguration = serde_yaml_ng::from_str(&again).unwrap();
        assert_eq!(file, file2);
        assert_eq!(parse(&again).unwrap(), loaded);
        // Nothing of the original was lost on the way.
        let a: Value = serde_yaml_ng::from_str(FULL).unwrap();
        let b: Value = serde_yaml_ng::from_str(&again).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn minimal_file_sets_nothing() {
        let l =
            parse("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n")
                .unwrap();
        assert_eq!(l, Loaded::default());
        let l = parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ebpf\n",
        )
        .unwrap();
        assert_eq!(l, Loaded::default());
    }

    fn err(body: &str) -> String {
        let text = format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{body}"
        );
        format!("{:#}", parse(&text).unwrap_err())
    }

    #[test]
    fn each_invalid_value_names_the_field() {
        for (body, expected) in [
            (
                "mode: iptables\n",
                "mode: \"iptables\" is not supported by ebpf-proxy; leave it empty or set it to \"ebpf\"",
            ),
            (
                "mode: ipvs\n",
                "mode: \"ipvs\" is not supported by ebpf-proxy",
            ),
            (
                "bindAddress: node-1\n",
                "bindAddress: \"node-1\" is not an IP address",
            ),
            (
                "healthzBindAddress: 0.0.0.0\n",
                "healthzBindAddress: \"0.0.0.0\" is not an IP address and port",
            ),
            (
                "metricsBindAddress: localhost:10249\n",
                "metricsBindAddress: \"localhost:10249\" is not an IP address and port",
            ),
            (
                "clusterCIDR: 10.244.0.0/33\n",
                "clusterCIDR: \"10.244.0.0/33\" is not a CIDR",
            ),
            (
                "clusterCIDR: 10.0.0.0/16,10.1.0.0/16\n",
                "clusterCIDR: \"10.0.0.0/16,10.1.0.0/16\": give one CIDR, or an IPv4 and an IPv6 CIDR",
            ),
            (
                "nodePortAddresses: [primary, 10.0.0.0/8]\n",
                "nodePortAddresses: \"primary\" cannot be combined with CIDRs",
            ),
            (
                "nodePortAddresses: [all]\n",
                "nodePortAddresses: \"all\" is not a CIDR",
            ),
            (
                "conntrack:\n  udpTimeout: soon\n",
                "conntrack.udpTimeout: invalid duration \"soon\"",
            ),
            (
                "iptables:\n  syncPeriod: -1s\n",
                "iptables.syncPeriod: invalid duration \"-1s\"",
            ),
            (
                "nftables:\n  minSyncPeriod: 1x\n",
                "nftables.minSyncPeriod: invalid duration \"1x\"",
            ),
            (
                "iptables:\n  syncPeriod: 10s\nnftables:\n  syncPeriod: 20s\n",
                "iptables.syncPeriod: 10s differs from nftables.syncPeriod (20s)",
            ),
            (
                "iptables:\n  syncPeriod: 10s\n  minSyncPeriod: 1m\n",
                "minSyncPeriod: 1m is longer than syncPeriod (10s)",
            ),
            (
                "logging:\n  format: xml\n",
                "logging.format: \"xml\" is not supported; use \"text\" or \"json\"",
            ),
            (
                "hostnameOverride: [a]\n",
                "not a KubeProxyConfiguration document",
            ),
        ] {
            let e = err(body);
            assert!(e.contains(expected), "{body:?}: {e}");
        }
        for (text, expected) in [
            (
                "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n",
                "apiVersion: expected \"kubeproxy.config.k8s.io/v1alpha1\", found Some(\"kubeproxy.config.k8s.io/v1alpha2\")",
            ),
            (
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
                "kind: expected \"KubeProxyConfiguration\", found Some(\"KubeletConfiguration\")",
            ),
            ("kind: KubeProxyConfiguration\n", "apiVersion: expected"),
        ] {
            let e = format!("{:#}", parse(text).unwrap_err());
            assert!(e.contains(expected), "{text:?}: {e}");
        }
    }

    #[test]
    fn unknown_and_meaningless_fields_are_warned_about_once_each_by_name() {
        let l = parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             bindAddress: 192.0.2.1\n\
             fooBar: 1\n\
             enableProfiling: true\n\
             oomScoreAdj: -999\n\
             featureGates: {SomeGate: true}\n\
             conntrack:\n  maxPerCore: 32768\n  tcpBeLiberal: true\n  udpTimeout: 30s\n  colour: red\n\
             iptables:\n  masqueradeAll: true\n  udpTimeout: 5s\n\
             ipvs:\n  scheduler: rr\n\
             clientConnection:\n  qps: 50\n\
             logging:\n  verbosity: 4\n",
        )
        .unwrap();
        let expected = [
            "--config: field \"bindAddress\" (192.0.2.1) has no effect in ebpf-proxy: ignored",
            "--config: field \"iptables.masqueradeAll\" has no effect in ebpf-proxy: ignored",
            "--config: unknown field \"iptables.udpTimeout\" (not in kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration): ignored",
            "--config: field \"ipvs.scheduler\" has no effect in ebpf-proxy: ignored",
            "--config: unknown field \"conntrack.colour\" (not in kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration): ignored",
            "--config: field \"conntrack.tcpBeLiberal\" has no effect in ebpf-proxy: ignored",
            "--config: field \"clientConnection.qps\" has no effect in ebpf-proxy: ignored",
            "--config: field \"logging.verbosity\" has no effect in ebpf-proxy: ignored",
            "--config: field \"enableProfiling\" has no effect in ebpf-proxy: ignored",
            "--config: field \"featureGates\" has no effect in ebpf-proxy: ignored",
            "--config: unknown field \"fooBar\" (not in kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration): ignored",
            "--config: field \"oomScoreAdj\" has no effect in ebpf-proxy: ignored",
        ];
        assert_eq!(loaded_sorted(&l.warnings), loaded_sorted(&expected));
        assert_eq!(l.settings.udp_flow_timeout, Some(Duration::from_secs(30)));
        assert_eq!(l.settings.conntrack_max_per_core, Some(32768));
    }

    #[test]
    fn conntrack_size_and_timeouts_are_read_and_checked() {
        let l = parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             conntrack:\n  maxPerCore: 0\n  min: 4096\n  tcpEstablishedTimeout: 1h\n  udpStreamTimeout: 2.5m\n",
        )
        .unwrap();
        assert!(l.warnings.is_empty(), "{:?}", l.warnings);
        assert_eq!(l.settings.conntrack_max_per_core, Some(0));
        assert_eq!(l.settings.conntrack_min, Some(4096));
        assert_eq!(
            l.settings.conntrack_tcp_timeout_established,
            Some(Duration::from_secs(3600))
        );
        assert_eq!(
            l.settings.conntrack_udp_timeout_stream,
            Some(Duration::from_secs(150))
        );
        // kube-proxy's 0 = leave as is: the default here.
        let l = parse(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             conntrack:\n  maxPerCore: 0\n  min: 0\n",
        )
        .unwrap();
        assert_eq!(l.settings.conntrack_min, None);
        for (bad, field) in [
            (
                "min: 10",
                "conntrack.min: 10 is not an integer in 1024..=16777216",
            ),
            (
                "maxPerCore: -1",
                "conntrack.maxPerCore: -1 is not an integer",
            ),
            ("min: many", "conntrack.min: many is not an integer"),
            (
                "tcpEstablishedTimeout: soon",
                "conntrack.tcpEstablishedTimeout",
            ),
            (
                "udpStreamTimeout: 10",
                "conntrack.udpStreamTimeout: 10 is not a duration",
            ),
            (
                "tcpEstablishedTimeout: [1, 2]",
                "conntrack.tcpEstablishedTimeout: - 1",
            ),
            (
                "tcpEstablishedTimeout: 500us",
                "conntrack.tcpEstablishedTimeout: 500us is too short",
            ),
        ] {
            let e = parse(&format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nconntrack:\n  {bad}\n"
            ))
            .unwrap_err();
            assert!(format!("{e:#}").contains(field), "{bad}: {e:#}");
        }
    }

    fn loaded_sorted<S: AsRef<str>>(v: &[S]) -> Vec<String> {
        let mut v: Vec<String> = v.iter().map(|s| s.as_ref().to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn list_flags_parse_like_kube_proxy() {
        assert_eq!(
            "10.0.0.0/8".parse::<ClusterCidrs>().unwrap().to_string(),
            "10.0.0.0/8"
        );
        assert!("10.0.0.0/8,fd00::/64".parse::<ClusterCidrs>().is_ok());
        assert!("fd00::/64,fd01::/64".parse::<ClusterCidrs>().is_err());
        assert!("".parse::<ClusterCidrs>().is_err());
        assert_eq!(
            "primary".parse::<NodePortAddresses>().unwrap(),
            NodePortAddresses::Primary
        );
        assert_eq!(
            "10.0.0.0/8, 192.168.0.0/16"
                .parse::<NodePortAddresses>()
                .unwrap()
                .to_string(),
            "10.0.0.0/8,192.168.0.0/16"
        );
        assert!("primary,10.0.0.0/8".parse::<NodePortAddresses>().is_err());
    }

    #[test]
    fn readme_example_is_valid_and_quiet() {
        let readme = include_str!("../../README.md");
        let section = &readme[readme.find("### Configuration file").expect("section")..];
        let start = section.find("```yaml\n").expect("yaml block") + "```yaml\n".len();
        let example = &section[start..start + section[start..].find("```").unwrap()];
        let l = parse(example).unwrap();
        assert_eq!(l.warnings, Vec::<String>::new());
        assert_eq!(l.settings.log_format, Some(LogFormat::Json));
        assert_eq!(l.settings.sync_period, Some(Duration::from_secs(30)));
    }
}
