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

/// True when argument `id` was given on the command line (or through its environment
/// variable), as opposed to taking its default: only such flags override the file.
pub fn given(matches: &clap::ArgMatches, id: &str) -> bool {
    matches!(
        matches.value_source(id),
        Some(clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable)
    )
}

/// Sets `target` to the file's `value` unless the flag was `given`.
pub fn fill<T>(target: &mut T, given: bool, value: Option<T>) {
    if let (false, Some(v)) = (given, value) {
        *target = v;
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

    #[test]
    fn fill_keeps_given_flags() {
        let mut v = 1;
        fill(&mut v, true, Some(2));
        assert_eq!(v, 1);
        fill(&mut v, false, Some(3));
        assert_eq!(v, 3);
        fill(&mut v, false, None);
        assert_eq!(v, 3);
    }
}
