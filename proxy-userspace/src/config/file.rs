//! kube-proxy's configuration file: a `KubeProxyConfiguration` of
//! `kubeproxy.config.k8s.io/v1alpha1` (`staging/src/k8s.io/kube-proxy/config/v1alpha1/types.go`
//! in kubernetes/kubernetes), read with serde into [`KubeProxyConfiguration`], every field
//! typed and named; fields that v1alpha1 does not have are kept by name in the `other` maps
//! of each level, so they can be reported.
//!
//! [`validate`] turns a document into [`FileSettings`]: the settings that have a meaning in
//! ebpf-proxy, checked, and one warning per field that is unknown or has no effect here.
//! kubeadm writes every field, mostly as `""`, `0s`, `false`, `0` or `null`: such zero values
//! mean "unset" (kube-proxy's defaulting) and are not reported. An invalid value stops
//! start-up with an error naming the field.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

use super::{
    API_VERSION, ClusterCidrs, IpvsScheduler, KIND, LogFormat, NodePortAddresses, ProxyMode,
    ServerAddress,
    go::{format_go_duration, parse_go_duration},
};
use crate::datapath::tc::{MAX_CONNTRACK_FLOWS, MIN_CONNTRACK_FLOWS};

/// Every other field of a level, by name.
pub type Other = BTreeMap<String, Value>;

/// A `KubeProxyConfiguration` document. Fields are declared in the order kube-proxy writes
/// them (alphabetical), so [`super::AgentConfig::kube_proxy_configuration`] writes the same
/// layout. Durations and integers are kept as YAML values so that a wrong type is reported
/// naming the field; absent fields are `None` and are not written.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    /// Must be [`API_VERSION`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// kube-proxy's idea of the node's primary IP (`--bind-address`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind_address: Option<String>,
    /// `--bind-address-hard-fail`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind_address_hard_fail: Option<bool>,
    /// API client settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_connection: Option<ClientConnection>,
    /// `--cluster-cidr`: one CIDR or a comma-separated dual-stack pair.
    #[serde(
        default,
        rename = "clusterCIDR",
        skip_serializing_if = "Option::is_none"
    )]
    pub cluster_cidr: Option<String>,
    /// `--config-sync-period` (informer resync).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_sync_period: Option<Value>,
    /// Conntrack settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<Conntrack>,
    /// Settings of `detectLocalMode`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detect_local: Option<DetectLocal>,
    /// `--detect-local-mode`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detect_local_mode: Option<String>,
    /// `--profiling`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_profiling: Option<bool>,
    /// `--feature-gates`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feature_gates: Option<BTreeMap<String, bool>>,
    /// `--healthz-bind-address` (`ip:port`, or an IP alone for port 10256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthz_bind_address: Option<String>,
    /// `--hostname-override`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname_override: Option<String>,
    /// iptables mode settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iptables: Option<IpTables>,
    /// IPVS mode settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipvs: Option<Ipvs>,
    /// Must be [`KIND`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Logging settings (component-base `LoggingConfiguration`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logging: Option<Logging>,
    /// `--metrics-bind-address` (`ip:port`, or an IP alone for port 10249).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_bind_address: Option<String>,
    /// `--proxy-mode`: empty or `ebpf` here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// nftables mode settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nftables: Option<NfTables>,
    /// `--nodeport-addresses`: CIDRs, or `primary` alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_port_addresses: Option<Vec<String>>,
    /// `--oom-score-adj`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_score_adj: Option<Value>,
    /// Unused by kube-proxy since its userspace mode was removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_range: Option<String>,
    /// `--show-hidden-metrics-for-version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub show_hidden_metrics_for_version: Option<String>,
    /// Windows service mode (Windows only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub windows_run_as_service: Option<bool>,
    /// Windows (HNS) settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub winkernel: Option<Winkernel>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// `clientConnection` (component-base `ClientConnectionConfiguration`).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnection {
    /// Accept header of API requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accept_content_types: Option<String>,
    /// `--kube-api-burst`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<Value>,
    /// `--kube-api-content-type`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// `--kubeconfig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<String>,
    /// `--kube-api-qps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qps: Option<Value>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// `conntrack`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Conntrack {
    /// `--conntrack-max-per-core`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_per_core: Option<Value>,
    /// `--conntrack-min`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<Value>,
    /// `--conntrack-tcp-be-liberal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_be_liberal: Option<bool>,
    /// `--conntrack-tcp-timeout-close-wait`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_close_wait_timeout: Option<Value>,
    /// `--conntrack-tcp-timeout-established`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_established_timeout: Option<Value>,
    /// `--conntrack-udp-timeout-stream`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_stream_timeout: Option<Value>,
    /// `--conntrack-udp-timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<Value>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// `detectLocal`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocal {
    /// `--pod-bridge-interface`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge_interface: Option<String>,
    /// `--pod-interface-name-prefix`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface_name_prefix: Option<String>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// `iptables`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpTables {
    /// `--iptables-localhost-nodeports`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub localhost_node_ports: Option<bool>,
    /// `--masquerade-all` (iptables mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masquerade_all: Option<bool>,
    /// `--iptables-masquerade-bit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masquerade_bit: Option<Value>,
    /// `--iptables-min-sync-period`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<Value>,
    /// `--iptables-sync-period`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<Value>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// `ipvs`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ipvs {
    /// `--ipvs-exclude-cidrs`.
    #[serde(
        default,
        rename = "excludeCIDRs",
        skip_serializing_if = "Option::is_none"
    )]
    pub exclude_cidrs: Option<Vec<String>>,
    /// `--ipvs-min-sync-period`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<Value>,
    /// `--ipvs-scheduler`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<String>,
    /// `--ipvs-strict-arp`.
    #[serde(default, rename = "strictARP", skip_serializing_if = "Option::is_none")]
    pub strict_arp: Option<bool>,
    /// `--ipvs-sync-period`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<Value>,
    /// `--ipvs-tcpfin-timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_fin_timeout: Option<Value>,
    /// `--ipvs-tcp-timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_timeout: Option<Value>,
    /// `--ipvs-udp-timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<Value>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// `nftables`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NfTables {
    /// `--masquerade-all` (nftables mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masquerade_all: Option<bool>,
    /// The fwmark bit of the nftables mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masquerade_bit: Option<Value>,
    /// nftables mode's minimum sync period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<Value>,
    /// nftables mode's sync period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<Value>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// `logging` (component-base `LoggingConfiguration`).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Logging {
    /// `--log-flush-frequency` (a duration or nanoseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_frequency: Option<Value>,
    /// `--logging-format`: `text` or `json`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Format options (`text`/`json` `splitStream`, `infoBufferSize`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<Value>,
    /// `-v`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<Value>,
    /// `--vmodule`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmodule: Option<Value>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// `winkernel` (Windows only).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Winkernel {
    /// HNS policies with DSR.
    #[serde(default, rename = "enableDSR", skip_serializing_if = "Option::is_none")]
    pub enable_dsr: Option<bool>,
    /// Forward the service VIP for health checks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_health_check_vip: Option<bool>,
    /// HNS network name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_name: Option<String>,
    /// HNS endpoint of the root network namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_hns_endpoint_name: Option<String>,
    /// Source VIP for NAT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_vip: Option<String>,
    /// Fields v1alpha1 does not have.
    #[serde(flatten, skip_serializing)]
    pub other: Other,
}

/// The settings a configuration file gives, after validation; `None` where the file leaves
/// the setting unset (absent, empty, null, or a zero duration).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FileSettings {
    /// `clientConnection.kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `hostnameOverride`.
    pub hostname_override: Option<String>,
    /// `bindAddress` (only its family matters here: the default server addresses).
    pub bind_address: Option<IpAddr>,
    /// `healthzBindAddress` (an IP alone gets port 10256).
    pub healthz_bind_address: Option<SocketAddr>,
    /// `metricsBindAddress` (an IP alone gets port 10249).
    pub metrics_bind_address: Option<SocketAddr>,
    /// `bindAddressHardFail`.
    pub bind_address_hard_fail: Option<bool>,
    /// `clusterCIDR`.
    pub cluster_cidr: Option<ClusterCidrs>,
    /// `nodePortAddresses`.
    pub node_port_addresses: Option<NodePortAddresses>,
    /// `mode`; `None` when empty.
    pub mode: Option<ProxyMode>,
    /// `{iptables,nftables,ipvs}.syncPeriod`.
    pub sync_period: Option<Duration>,
    /// `{iptables,nftables,ipvs}.minSyncPeriod`.
    pub min_sync_period: Option<Duration>,
    /// `iptables.masqueradeAll` or `nftables.masqueradeAll`.
    pub masquerade_all: Option<bool>,
    /// `ipvs.scheduler`.
    pub ipvs_scheduler: Option<IpvsScheduler>,
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
    /// `logging.verbosity` (`-v`).
    pub verbosity: Option<u32>,
    /// `oomScoreAdj`.
    pub oom_score_adj: Option<i32>,
    /// The document as read, for `--write-config-to` (it keeps the values of the fields
    /// without an effect here).
    pub document: KubeProxyConfiguration,
}

/// A configuration file, read and validated.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Loaded {
    /// The settings it gives.
    pub settings: FileSettings,
    /// One line per field that is unknown or has no effect here, by name.
    pub warnings: Vec<String>,
}

/// True for a value that kube-proxy treats as unset: null, false, 0, "", a zero duration,
/// and empty lists or maps (or maps holding only such values).
pub fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty() || parse_go_duration(s).is_ok_and(|d| d.is_zero()),
        Value::Sequence(s) => s.is_empty(),
        Value::Mapping(m) => m.values().all(is_unset),
        Value::Tagged(_) => false,
    }
}

/// A YAML value as written (for messages), not its Rust debug form.
pub fn show(v: &Value) -> String {
    serde_yaml_ng::to_string(v)
        .map(|s| s.trim_end().to_string())
        .unwrap_or_else(|_| format!("{v:?}"))
}

/// A string field; empty means unset.
fn text(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

/// A duration field (Go notation in a string); null, absent or empty is `None`, zero is
/// `Some(0)`. Anything else that is not a duration is an error naming the field.
fn duration(field: &str, v: &Option<Value>) -> Result<Option<Duration>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
        Some(Value::String(s)) => parse_go_duration(s)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{field}: {e}")),
        Some(other) => bail!(
            "{field}: {} is not a duration; write a string such as \"30s\" or \"1m30s\"",
            show(other)
        ),
    }
}

/// A duration field where zero means unset (kube-proxy's "0 to leave as-is"); a value
/// below 1 ms is an error.
fn timeout(field: &str, v: &Option<Value>) -> Result<Option<Duration>> {
    let Some(d) = duration(field, v)?.filter(|d| !d.is_zero()) else {
        return Ok(None);
    };
    if d < Duration::from_millis(1) {
        bail!(
            "{field}: {} is too short (at least 1ms)",
            format_go_duration(d)
        );
    }
    Ok(Some(d))
}

/// An integer field in `least..=most` (kube-proxy's `*int32`); null or absent is `None`.
fn count(field: &str, v: &Option<Value>, least: i64, most: i64) -> Result<Option<i64>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(n) if n >= least && n <= most => Ok(Some(n)),
            _ => bail!(
                "{field}: {} is not an integer from {least} to {most}",
                show(v)
            ),
        },
    }
}

/// An `ip:port` field (an IP alone gets `default_port`, as kube-proxy's defaulting appends
/// it); empty is `None`.
fn server_address(
    field: &str,
    v: &Option<String>,
    default_port: u16,
) -> Result<Option<SocketAddr>> {
    let Some(s) = text(v) else { return Ok(None) };
    match s.parse::<ServerAddress>() {
        Ok(a) => Ok(a.resolve(default_port)),
        Err(_) => {
            bail!(
                "{field}: {s:?} is not an IP address and port (e.g. 0.0.0.0:{default_port} or [::]:{default_port})"
            )
        }
    }
}

/// Collects the warnings of one level: unknown fields always, fields without an effect here
/// when they hold something other than their zero value.
struct Warnings(Vec<String>);

impl Warnings {
    fn unknown(&mut self, prefix: &str, other: &Other) {
        for name in other.keys() {
            self.0.push(format!(
                "--config: unknown field \"{prefix}{name}\" (not in {API_VERSION} {KIND}): ignored"
            ));
        }
    }

    fn inert(&mut self, path: &str, set: bool) {
        if set {
            self.0.push(format!(
                "--config: field \"{path}\" has no effect in ebpf-proxy: ignored"
            ));
        }
    }
}

fn set_value(v: &Option<Value>) -> bool {
    v.as_ref().is_some_and(|v| !is_unset(v))
}

/// Whether `v` is set (see [`set_value`]) to something other than kube-proxy's default
/// `default` (a number, or a duration in Go notation), so that a file holding kube-proxy's
/// defaults, such as one `--write-config-to` wrote, warns about nothing.
fn set_other_than(v: &Option<Value>, default: &str) -> bool {
    let Some(v) = v.as_ref().filter(|v| !is_unset(v)) else {
        return false;
    };
    match v {
        Value::Number(n) => n.as_f64() != default.parse::<f64>().ok(),
        Value::String(s) => match (parse_go_duration(s), parse_go_duration(default)) {
            (Ok(a), Ok(b)) => a != b,
            _ => s.trim() != default,
        },
        _ => true,
    }
}

fn set_text(v: &Option<String>) -> bool {
    text(v).is_some()
}

fn set_bool(v: &Option<bool>) -> bool {
    v.unwrap_or(false)
}

/// Checks a parsed document and extracts its settings.
///
/// Errors: `apiVersion`/`kind` are not kube-proxy's v1alpha1 configuration, or a field has an
/// invalid value (the message names the field). `mode` is returned, not judged here: the
/// caller decides ([`super::AgentConfig::resolve`]).
pub fn validate(file: &KubeProxyConfiguration) -> Result<Loaded> {
    match file.api_version.as_deref() {
        Some(API_VERSION) => {}
        Some(other) => bail!("apiVersion: expected {API_VERSION:?}, found {other:?}"),
        None => bail!("apiVersion: expected {API_VERSION:?}, found none"),
    }
    match file.kind.as_deref() {
        Some(KIND) => {}
        Some(other) => bail!("kind: expected {KIND:?}, found {other:?}"),
        None => bail!("kind: expected {KIND:?}, found none"),
    }
    let mut s = FileSettings {
        document: file.clone(),
        mode: text(&file.mode).map(ProxyMode::parse),
        ..Default::default()
    };
    let mut w = Warnings(Vec::new());

    if let Some(b) = text(&file.bind_address) {
        let ip: IpAddr = b
            .parse()
            .map_err(|_| anyhow::anyhow!("bindAddress: {b:?} is not an IP address"))?;
        if !ip.is_unspecified() {
            w.0.push(format!(
                "--config: field \"bindAddress\" ({b}) has no effect in ebpf-proxy: ignored"
            ));
        }
        s.bind_address = Some(ip);
    }
    s.bind_address_hard_fail = file.bind_address_hard_fail;
    s.healthz_bind_address =
        server_address("healthzBindAddress", &file.healthz_bind_address, 10256)?;
    s.metrics_bind_address =
        server_address("metricsBindAddress", &file.metrics_bind_address, 10249)?;
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
    s.oom_score_adj = count("oomScoreAdj", &file.oom_score_adj, -1000, 1000)?.map(|n| n as i32);

    // Sync periods: kube-proxy reads them from its mode's section. ebpf-proxy has no section
    // of its own, so it takes them from any of the three; values given in several must agree.
    let sections: [(&str, Option<&Value>, Option<&Value>); 3] = [
        (
            "nftables",
            file.nftables.as_ref().and_then(|x| x.sync_period.as_ref()),
            file.nftables
                .as_ref()
                .and_then(|x| x.min_sync_period.as_ref()),
        ),
        (
            "iptables",
            file.iptables.as_ref().and_then(|x| x.sync_period.as_ref()),
            file.iptables
                .as_ref()
                .and_then(|x| x.min_sync_period.as_ref()),
        ),
        (
            "ipvs",
            file.ipvs.as_ref().and_then(|x| x.sync_period.as_ref()),
            file.ipvs.as_ref().and_then(|x| x.min_sync_period.as_ref()),
        ),
    ];
    for (field, min) in [("syncPeriod", false), ("minSyncPeriod", true)] {
        let mut found: Option<(String, Duration)> = None;
        for (name, sync, min_sync) in &sections {
            let path = format!("{name}.{field}");
            let v = if min { min_sync } else { sync };
            let Some(d) = duration(&path, &v.cloned())? else {
                continue;
            };
            // Zero is unset: kube-proxy's defaulting replaces it (30s, 1s); kubeadm writes
            // 0s everywhere.
            if d.is_zero() {
                continue;
            }
            match &found {
                Some((first, v)) if *v != d => bail!(
                    "{path}: {} differs from {first} ({}); give one value",
                    format_go_duration(d),
                    format_go_duration(*v)
                ),
                Some(_) => {}
                None => found = Some((path, d)),
            }
        }
        let d = found.map(|(_, d)| d);
        if min {
            s.min_sync_period = d;
        } else {
            s.sync_period = d;
        }
    }
    if let (Some(min), Some(max)) = (s.min_sync_period, s.sync_period)
        && min > max
    {
        bail!(
            "minSyncPeriod: {} is longer than syncPeriod ({})",
            format_go_duration(min),
            format_go_duration(max)
        );
    }
    let mut masquerade_all = None;
    if let Some(t) = &file.iptables {
        if t.masquerade_all.is_some() {
            masquerade_all = Some(masquerade_all.unwrap_or(false) | set_bool(&t.masquerade_all));
        }
        w.inert(
            "iptables.masqueradeBit",
            set_other_than(&t.masquerade_bit, "14"),
        );
        // ebpf-proxy never serves node ports on loopback, as kube-proxy's nftables mode, which
        // ignores this field too; no warning, since kube-proxy's default (true) is in every
        // file it writes.
        w.unknown("iptables.", &t.other);
    }
    if let Some(t) = &file.nftables {
        if t.masquerade_all.is_some() {
            masquerade_all = Some(masquerade_all.unwrap_or(false) | set_bool(&t.masquerade_all));
        }
        w.inert(
            "nftables.masqueradeBit",
            set_other_than(&t.masquerade_bit, "14"),
        );
        w.unknown("nftables.", &t.other);
    }
    s.masquerade_all = masquerade_all;
    if let Some(t) = &file.ipvs {
        if let Some(name) = text(&t.scheduler) {
            s.ipvs_scheduler = Some(
                name.parse()
                    .map_err(|e| anyhow::anyhow!("ipvs.scheduler: {e}"))?,
            );
        }
        w.inert(
            "ipvs.excludeCIDRs",
            t.exclude_cidrs.as_ref().is_some_and(|v| !v.is_empty()),
        );
        w.inert("ipvs.strictARP", set_bool(&t.strict_arp));
        w.inert("ipvs.tcpTimeout", set_value(&t.tcp_timeout));
        w.inert("ipvs.tcpFinTimeout", set_value(&t.tcp_fin_timeout));
        w.inert("ipvs.udpTimeout", set_value(&t.udp_timeout));
        w.unknown("ipvs.", &t.other);
    }

    if let Some(c) = &file.conntrack {
        s.udp_flow_timeout = timeout("conntrack.udpTimeout", &c.udp_timeout)?;
        s.conntrack_max_per_core = count(
            "conntrack.maxPerCore",
            &c.max_per_core,
            0,
            MAX_CONNTRACK_FLOWS as i64,
        )?
        .map(|n| n as u32);
        // 0 is kube-proxy's "leave it as is": the default here.
        s.conntrack_min = match &c.min {
            Some(v) if v.as_i64() == Some(0) => None,
            v => count(
                "conntrack.min",
                v,
                MIN_CONNTRACK_FLOWS as i64,
                MAX_CONNTRACK_FLOWS as i64,
            )?
            .map(|n| n as u32),
        };
        s.conntrack_tcp_timeout_established = timeout(
            "conntrack.tcpEstablishedTimeout",
            &c.tcp_established_timeout,
        )?;
        s.conntrack_udp_timeout_stream =
            timeout("conntrack.udpStreamTimeout", &c.udp_stream_timeout)?;
        w.inert(
            "conntrack.tcpCloseWaitTimeout",
            set_other_than(&c.tcp_close_wait_timeout, "1h"),
        );
        w.inert("conntrack.tcpBeLiberal", set_bool(&c.tcp_be_liberal));
        w.unknown("conntrack.", &c.other);
    }
    if let Some(c) = &file.client_connection {
        s.kubeconfig = text(&c.kubeconfig).map(PathBuf::from);
        w.inert(
            "clientConnection.acceptContentTypes",
            set_text(&c.accept_content_types),
        );
        w.inert(
            "clientConnection.contentType",
            text(&c.content_type).is_some_and(|t| t != "application/vnd.kubernetes.protobuf"),
        );
        w.inert("clientConnection.qps", set_other_than(&c.qps, "5"));
        w.inert("clientConnection.burst", set_other_than(&c.burst, "10"));
        w.unknown("clientConnection.", &c.other);
    }
    if let Some(l) = &file.logging {
        s.log_format = match text(&l.format) {
            None => None,
            Some("text") => Some(LogFormat::Text),
            Some("json") => Some(LogFormat::Json),
            Some(f) => bail!("logging.format: {f:?} is not supported; use \"text\" or \"json\""),
        };
        s.verbosity = count("logging.verbosity", &l.verbosity, 0, u32::MAX as i64)?
            .map(|n| n as u32)
            .filter(|n| *n > 0);
        w.inert(
            "logging.flushFrequency",
            set_other_than(&l.flush_frequency, "5s"),
        );
        w.inert("logging.vmodule", set_value(&l.vmodule));
        w.inert("logging.options", set_value(&l.options));
        w.unknown("logging.", &l.other);
    }
    if let Some(d) = &file.detect_local {
        w.inert("detectLocal.bridgeInterface", set_text(&d.bridge_interface));
        w.inert(
            "detectLocal.interfaceNamePrefix",
            set_text(&d.interface_name_prefix),
        );
        w.unknown("detectLocal.", &d.other);
    }
    // kube-proxy refuses a mode it does not know; ClusterCIDR is what ebpf-proxy does with
    // clusterCIDR, the other modes are not.
    if let Some(m) = text(&file.detect_local_mode) {
        super::check_detect_local_mode(m).map_err(|e| anyhow::anyhow!("detectLocalMode: {e}"))?;
    }
    w.inert(
        "detectLocalMode",
        text(&file.detect_local_mode).is_some_and(|m| m != "ClusterCIDR"),
    );
    if let Some(k) = &file.winkernel {
        w.inert("winkernel.enableDSR", set_bool(&k.enable_dsr));
        w.inert(
            "winkernel.forwardHealthCheckVip",
            set_bool(&k.forward_health_check_vip),
        );
        w.inert("winkernel.networkName", set_text(&k.network_name));
        w.inert(
            "winkernel.rootHnsEndpointName",
            set_text(&k.root_hns_endpoint_name),
        );
        w.inert("winkernel.sourceVip", set_text(&k.source_vip));
        w.unknown("winkernel.", &k.other);
    }
    w.inert(
        "configSyncPeriod",
        set_other_than(&file.config_sync_period, "15m"),
    );
    w.inert("enableProfiling", set_bool(&file.enable_profiling));
    w.inert(
        "featureGates",
        file.feature_gates.as_ref().is_some_and(|g| !g.is_empty()),
    );
    w.inert("portRange", set_text(&file.port_range));
    w.inert(
        "showHiddenMetricsForVersion",
        set_text(&file.show_hidden_metrics_for_version),
    );
    w.inert(
        "windowsRunAsService",
        set_bool(&file.windows_run_as_service),
    );
    w.unknown("", &file.other);
    Ok(Loaded {
        settings: s,
        warnings: w.0,
    })
}
