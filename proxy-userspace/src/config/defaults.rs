//! Every default of the agent's settings, defined once: ebpf-proxy's own, and kube-proxy's
//! (`pkg/proxy/apis/config/v1alpha1/defaults.go` in kubernetes/kubernetes). The resolution
//! ([`super::AgentConfig::resolve`]) takes a setting's default from here when neither a flag
//! nor the file gives it; the written configuration ([`super::AgentConfig::document`]) and
//! the file's warnings use kube-proxy's defaults of the fields without an effect here, so a
//! file holding them warns about nothing.
//!
//! The north-south conntrack table's defaults and bounds belong to the data path that sizes
//! it ([`crate::datapath::tc`]), the map sizes and the unreplied UDP flow timeout to the
//! kernel programs (`proxy_common`), the status port to its server; they are re-exported or
//! used here, not repeated.

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

pub(crate) use crate::datapath::tc::{
    DEFAULT_CONNTRACK_MAX_PER_CORE, DEFAULT_CONNTRACK_MIN, DEFAULT_CT_TCP_ESTABLISHED,
    DEFAULT_CT_UDP_STREAM, MAX_CONNTRACK_FLOWS, MIN_CONNTRACK_FLOWS,
};
pub(crate) use crate::status::DEFAULT_STATUS_PORT;
/// The map sizes (`--max-*`) and the Maglev table's (`--maglev-table-size`) by default, which
/// the kernel programs' map definitions share.
pub use proxy_common::{
    DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS, DEFAULT_MAX_SLOTS, DEFAULT_MAX_SOCKETS,
    MAGLEV_DEFAULT,
};

/// Mount point of the BPF file system by default.
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf";
/// Pin directory under the BPF file system by default.
pub const DEFAULT_PIN_DIR: &str = "ebpf-proxy";
/// `--min-sync-period` by default (kube-proxy's).
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
/// `--sync-period` by default (kube-proxy's).
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// Port of the metrics server by default (kube-proxy's `ports.ProxyStatusPort`).
pub const DEFAULT_METRICS_PORT: u16 = 10249;
/// Port of the health server by default (kube-proxy's `ports.ProxyHealthzPort`).
pub const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// `--udp-flow-timeout` by default (the kernel's `nf_conntrack_udp_timeout`; the kernel
/// programs apply the same default to a frontend without one).
pub const DEFAULT_UDP_FLOW_TIMEOUT: Duration =
    Duration::from_nanos(proxy_common::DEFAULT_UDP_FLOW_TIMEOUT_NS);
/// `--oom-score-adj` by default (kube-proxy's `qos.KubeProxyOOMScoreAdj`).
pub const DEFAULT_OOM_SCORE_ADJ: i32 = -999;
/// The range of `--oom-score-adj` and `oomScoreAdj` (the kernel's).
pub const OOM_SCORE_ADJ_RANGE: (i32, i32) = (-1000, 1000);
/// `--log-level` by default (also what `-v` 0 to 2 means).
pub const DEFAULT_LOG_LEVEL: &str = "info";
/// Longest period or timeout accepted (timer arithmetic stays far from overflow).
pub const MAX_PERIOD: Duration = Duration::from_secs(365 * 24 * 3600);

/// `--metrics-bind-address` by default: kube-proxy's `127.0.0.1:10249`, `[::1]:10249` when
/// `--bind-address` is IPv6.
pub fn metrics_bind_address(ipv6: bool) -> SocketAddr {
    match ipv6 {
        true => SocketAddr::from((Ipv6Addr::LOCALHOST, DEFAULT_METRICS_PORT)),
        false => SocketAddr::from((Ipv4Addr::LOCALHOST, DEFAULT_METRICS_PORT)),
    }
}

/// `--healthz-bind-address` by default: kube-proxy's `0.0.0.0:10256`, `[::]:10256` when
/// `--bind-address` is IPv6.
pub fn healthz_bind_address(ipv6: bool) -> SocketAddr {
    match ipv6 {
        true => SocketAddr::from((Ipv6Addr::UNSPECIFIED, DEFAULT_HEALTHZ_PORT)),
        false => SocketAddr::from((Ipv4Addr::UNSPECIFIED, DEFAULT_HEALTHZ_PORT)),
    }
}

/// `--status-bind-address` by default: `127.0.0.1:10266`, a port kube-proxy never binds.
pub fn status_bind_address() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, DEFAULT_STATUS_PORT))
}

/// kube-proxy's defaults of the `KubeProxyConfiguration` fields that have no effect here:
/// written back as kube-proxy writes them, and not warned about when a file holds them.
pub mod kube_proxy {
    use std::time::Duration;

    /// `bindAddress`.
    pub const BIND_ADDRESS: &str = "0.0.0.0";
    /// `clientConnection.contentType`.
    pub const CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";
    /// `clientConnection.qps`.
    pub const QPS: i64 = 5;
    /// `clientConnection.burst`.
    pub const BURST: i64 = 10;
    /// `configSyncPeriod`.
    pub const CONFIG_SYNC_PERIOD: Duration = Duration::from_secs(15 * 60);
    /// `conntrack.tcpCloseWaitTimeout`.
    pub const CONNTRACK_TCP_CLOSE_WAIT_TIMEOUT: Duration = Duration::from_secs(3600);
    /// `detectLocalMode`.
    pub const DETECT_LOCAL_MODE: &str = "ClusterCIDR";
    /// `iptables.localhostNodePorts`.
    pub const LOCALHOST_NODE_PORTS: bool = true;
    /// `iptables.masqueradeBit` and `nftables.masqueradeBit`.
    pub const MASQUERADE_BIT: i64 = 14;
    /// `logging.flushFrequency`.
    pub const LOG_FLUSH_FREQUENCY: Duration = Duration::from_secs(5);
}
