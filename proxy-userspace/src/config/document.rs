//! kube-proxy's configuration file as a document: `KubeProxyConfiguration` of
//! `kubeproxy.config.k8s.io/v1alpha1` (`staging/src/k8s.io/kube-proxy/config/v1alpha1/types.go`
//! in kubernetes/kubernetes), every field typed and named, read and written with serde. Fields
//! that v1alpha1 does not have are kept by name in the `other` map of each level, so they
//! can be reported.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

/// Every other field of a level, by name.
pub type Other = BTreeMap<String, Value>;

/// A `KubeProxyConfiguration` document. Fields are declared in the order kube-proxy writes
/// them (alphabetical), so [`crate::config::AgentConfig::kube_proxy_configuration`] writes the same
/// layout. Durations and integers are kept as YAML values so that a wrong type is reported
/// naming the field; absent fields are `None` and are not written.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    /// Must be [`API_VERSION`](crate::config::API_VERSION).
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
    /// Must be [`KIND`](crate::config::KIND).
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
