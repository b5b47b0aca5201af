//! The settings that a flag, kube-proxy's configuration file and a default all give (or a
//! flag and a default alone), each defined once, by one row of the table at the end of this
//! file: the field of [`AgentConfig`] it sets, its default, its flags (clap attributes and
//! help, the setting's own name first, then kube-proxy's other names of it), the
//! `KubeProxyConfiguration` fields that give it and its value's reader, and the form it is
//! written back in.
//!
//! From the table, [`settings!`] makes the flags ([`SettingFlags`], flattened into
//! [`super::RunFlags`]), what the flags or the file give ([`SettingValues`], inside
//! [`super::FileSettings`]), where each value came from ([`Origins`]), and the code that
//! drives every step of the table's settings: the flags of one setting must agree
//! ([`SettingFlags::given`]); the file's fields are read and checked section by section, in
//! the file's validation order ([`SettingValues::read`]); a flag given wins, then the file,
//! then the default ([`apply`]); the written-back document holds the value the agent runs
//! with ([`write`]).
//!
//! The settings whose sources interact otherwise keep their code in `flags`, `file`,
//! `resolve` and `written`, each for one reason:
//!
//! - `--metrics-bind-address` / `metricsBindAddress` and `--healthz-bind-address` /
//!   `healthzBindAddress`: the deprecated `--metrics-port` / `--healthz-port` change the port
//!   of whichever value wins (0 disables the server), and the default's family follows the
//!   bind address.
//! - `--log-level`, `-v` / `logging.verbosity`, `--log-format`, `--logging-format` /
//!   `logging.format`: `-v` (or the file's verbosity) gives the level unless `--log-level`
//!   does, the verbosity is also kept as given for the written document, and the two format
//!   flags disagreeing is a warning, not an error.
//! - `--lb-algorithm`, `--ipvs-scheduler` / `ipvs.scheduler`: two flags of different value
//!   types (clap refuses both at once), an empty `--ipvs-scheduler` means the default over
//!   the file, and the document holds the algorithm's scheduler name.
//! - `--manifests`, `--kubeconfig` / `clientConnection.kubeconfig`: one choice of source
//!   (clap refuses both flags); `--master` goes with the API source.
//! - `--proxy-mode` / `mode`: judged against the action (`--cleanup` takes any mode), its
//!   error names where it came from, and it is written empty.
//! - `--write-config-to`, `--cleanup`, `--init-only`: one action of three flags, in
//!   kube-proxy's order.
//! - `--bpffs`, `--pin-dir`: shared with the other subcommands (`PinArgs`), with clap's
//!   defaults.
//! - kube-proxy's flags and fields without an effect here: a warning each, and written back
//!   as given.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use ipnet::IpNet;
use serde_yaml_ng::Value;

use super::AgentConfig;
use super::defaults::kube_proxy as kp;
use super::defaults::{
    DEFAULT_CONNTRACK_MAX_PER_CORE, DEFAULT_CONNTRACK_MIN, DEFAULT_CT_TCP_ESTABLISHED,
    DEFAULT_CT_UDP_STREAM, DEFAULT_MAX_BACKENDS, DEFAULT_MAX_FRONTENDS, DEFAULT_MAX_SLOTS,
    DEFAULT_MAX_SOCKETS, DEFAULT_MIN_SYNC_PERIOD, DEFAULT_OOM_SCORE_ADJ, DEFAULT_STATUS_PORT,
    DEFAULT_SYNC_PERIOD, DEFAULT_UDP_FLOW_TIMEOUT, MAGLEV_DEFAULT, MAX_CONNTRACK_FLOWS,
    OOM_SCORE_ADJ_RANGE, status_bind_address,
};
use super::document::KubeProxyConfiguration;
use super::fields;
use super::go::parse_go_bool;
use super::table::{
    KUBE_PROXY_FLAGS, Origin, Section, WrittenValue, agree, agree_field, any, settings,
};
use super::values::{
    ClusterCidrs, NodePortAddresses, ServerAddress, check_node_name, number_in,
    parse_conntrack_min, parse_duration, parse_maglev_size, parse_north_south_mode,
    parse_positive_duration, parse_required_timeout, parse_timeout,
};
use crate::datapath::loader::KernelLogLevel;
use crate::datapath::tc::XdpSetting;
use crate::model::NorthSouthMode;
use crate::model::bypass::SocketLbScope;

settings! {
    /// `--sync-period` / `{iptables,nftables,ipvs}.syncPeriod`.
    sync_period: Duration => sync_period {
        default: DEFAULT_SYNC_PERIOD,
        flags: {
            /// Period of the verification that compares the maps with what was applied and
            /// repairs entries changed behind the agent's back (kube-proxy's
            /// --iptables-sync-period). /healthz fails when an update stays pending for twice
            /// this long [default: 30s].
            #[arg(long, allow_hyphen_values = true, value_parser = parse_positive_duration)]
            sync_period,
            /// Same as --sync-period.
            #[arg(long, allow_hyphen_values = true, value_parser = parse_positive_duration, value_name = "DURATION", help_heading = KUBE_PROXY_FLAGS)]
            iptables_sync_period,
            /// Same as --sync-period.
            #[arg(long, allow_hyphen_values = true, value_parser = parse_positive_duration, value_name = "DURATION", help_heading = KUBE_PROXY_FLAGS)]
            ipvs_sync_period,
        },
        // Zero is unset: kube-proxy's defaulting replaces it; kubeadm writes 0s everywhere.
        file: SyncPeriods fields::nonzero_duration => [
            "nftables.syncPeriod" = nftables.sync_period,
            "iptables.syncPeriod" = iptables.sync_period,
            "ipvs.syncPeriod" = ipvs.sync_period,
        ],
    },
    /// `--min-sync-period` / `{iptables,nftables,ipvs}.minSyncPeriod`.
    min_sync_period: Duration => min_sync_period {
        default: DEFAULT_MIN_SYNC_PERIOD,
        flags: {
            /// Minimum time between two syncs from the API source; an isolated change after a
            /// quiet period is applied at once; 0 syncs every change at once (kube-proxy's
            /// --iptables-min-sync-period) [default: 1s].
            #[arg(long, allow_hyphen_values = true, value_parser = parse_duration)]
            min_sync_period,
            /// Same as --min-sync-period.
            #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION", help_heading = KUBE_PROXY_FLAGS)]
            iptables_min_sync_period,
            /// Same as --min-sync-period.
            #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, value_name = "DURATION", help_heading = KUBE_PROXY_FLAGS)]
            ipvs_min_sync_period,
        },
        file: SyncPeriods fields::nonzero_duration => [
            "nftables.minSyncPeriod" = nftables.min_sync_period,
            "iptables.minSyncPeriod" = iptables.min_sync_period,
            "ipvs.minSyncPeriod" = ipvs.min_sync_period,
        ],
    },
    /// `--bind-address-hard-fail` / `bindAddressHardFail`.
    bind_address_hard_fail: bool => bind_address_hard_fail {
        default: false,
        flags: {
            /// Exit when the health or metrics server cannot bind its address (otherwise the
            /// bind is retried every 5 s while the data path runs).
            #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL", help_heading = KUBE_PROXY_FLAGS)]
            bind_address_hard_fail,
        },
        file: TopLevel fields::boolean => ["bindAddressHardFail" = bind_address_hard_fail],
    },
    /// `--masquerade-all` / `{iptables,nftables}.masqueradeAll`.
    masquerade_all: bool => tc.masquerade_all {
        default: false,
        flags: {
            /// Source-NAT every external flow of a Cluster-policy Service to the node address,
            /// also when the backend runs on this node (kube-proxy's --masquerade-all).
            #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = parse_go_bool, value_name = "BOOL")]
            masquerade_all,
        },
        // Either mode's section: kube-proxy reads its own.
        file: ModeSections fields::boolean => [
            "iptables.masqueradeAll" = iptables.masquerade_all,
            "nftables.masqueradeAll" = nftables.masquerade_all,
        ],
        combine: any,
    },
    /// `--cluster-cidr` / `clusterCIDR` (empty: none).
    cluster_cidr: ClusterCidrs => cluster_cidrs {
        default: Vec::new(),
        into: |c: ClusterCidrs| c.0,
        flags: {
            /// CIDR of the cluster's pods, or an IPv4 and an IPv6 CIDR separated by a comma
            /// (kube-proxy's --cluster-cidr): traffic entering the node to a cluster IP from a
            /// client outside the prefix of its family is masqueraded (tc path). Empty is as if
            /// not given.
            #[arg(allow_hyphen_values = true, long)]
            cluster_cidr,
        },
        // Empty, as kube-proxy's default, is as if not given.
        unset: |c: &ClusterCidrs| c.0.is_empty(),
        // Read before nodePortAddresses (the table's order is the file's validation order).
        file: TopLevel fields::cluster_cidrs => ["clusterCIDR" = cluster_cidr],
        written: |c: &Vec<IpNet>, _| Some(c.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")),
    },
    /// `--nodeport-addresses` / `nodePortAddresses` (`None`: every node address).
    node_port_addresses: NodePortAddresses => nodeport_addresses {
        default: None,
        into: Some,
        flags: {
            /// Node addresses that serve NodePorts: comma-separated CIDRs, or `primary` (the
            /// node's first InternalIP per family, kube-proxy's nftables default) [default: every
            /// InternalIP and ExternalIP of this node's Node object] (kube-proxy's
            /// --nodeport-addresses).
            #[arg(allow_hyphen_values = true, long)]
            nodeport_addresses,
        },
        // Empty, as kube-proxy's default, is as if not given.
        unset: |n: &NodePortAddresses| *n == NodePortAddresses::Cidrs(Vec::new()),
        file: TopLevel fields::node_port_addresses => [
            "nodePortAddresses" = node_port_addresses,
        ],
        written: |n: &Option<NodePortAddresses>, _| n.as_ref().map(|n| n.items()),
    },
    /// `--udp-flow-timeout` / `conntrack.udpTimeout`.
    udp_flow_timeout: Duration => udp_flow_timeout {
        default: DEFAULT_UDP_FLOW_TIMEOUT,
        flags: {
            /// Idle time after which an unconnected UDP flow picks a backend anew, like
            /// conntrack's nf_conntrack_udp_timeout (e.g. 30s, 2m; kube-proxy's
            /// --conntrack-udp-timeout) [default: 30s].
            #[arg(long, allow_hyphen_values = true, value_parser = parse_required_timeout)]
            udp_flow_timeout,
            /// Same as --udp-flow-timeout (0 keeps the default).
            #[arg(long, allow_hyphen_values = true, value_parser = parse_timeout, value_name = "DURATION", help_heading = KUBE_PROXY_FLAGS)]
            conntrack_udp_timeout,
        },
        unset: |d: &Duration| d.is_zero(),
        file: Conntrack fields::timeout => ["conntrack.udpTimeout" = conntrack.udp_timeout],
    },
    /// `--conntrack-max-per-core` / `conntrack.maxPerCore`.
    conntrack_max_per_core: u32 => tc.conntrack_max_per_core {
        default: DEFAULT_CONNTRACK_MAX_PER_CORE,
        flags: {
            /// Flows tracked per CPU by the north-south conntrack table (kube-proxy's
            /// --conntrack-max-per-core); the table holds max(this x CPUs, --conntrack-min)
            /// flows. The table is preallocated (about 320 bytes per flow), unlike the
            /// kernel's conntrack limit kube-proxy sets, so the default is 0: --conntrack-min
            /// alone, whatever the core count. Fixed when the pinned table is created
            /// [default: 0].
            #[arg(long, allow_hyphen_values = true, value_parser = number_in(0u32, MAX_CONNTRACK_FLOWS), value_name = "N")]
            conntrack_max_per_core,
        },
        file: Conntrack fields::count_in(0, MAX_CONNTRACK_FLOWS) => [
            "conntrack.maxPerCore" = conntrack.max_per_core,
        ],
        // Unless given, written as null, so that each program applies its own default to the
        // file: 0 here (a preallocated table), 32768 in kube-proxy, for which 0 would mean
        // "leave nf_conntrack_max alone" after a rollback.
        written: |n: &u32, origin| match origin {
            Origin::Default => Some(Value::Null),
            _ => n.field(),
        },
    },
    /// `--conntrack-min` / `conntrack.min`.
    conntrack_min: u32 => tc.conntrack_min {
        default: DEFAULT_CONNTRACK_MIN,
        flags: {
            /// Least number of flows of the north-south conntrack table (kube-proxy's
            /// --conntrack-min), from 1024 (smaller LRU tables lose live flows to the kernel's
            /// batch eviction) to 16777216; 0 keeps the default [default: 131072].
            #[arg(long, allow_hyphen_values = true, value_parser = parse_conntrack_min, value_name = "N")]
            conntrack_min,
        },
        // 0 is kube-proxy's "leave it as is": the default here.
        unset: |n: &u32| *n == 0,
        file: Conntrack fields::conntrack_min => ["conntrack.min" = conntrack.min],
    },
    /// `--conntrack-tcp-timeout-established` / `conntrack.tcpEstablishedTimeout`.
    conntrack_tcp_timeout_established: Duration => tc.conntrack_tcp_timeout_established {
        default: DEFAULT_CT_TCP_ESTABLISHED,
        flags: {
            /// Idle timeout of an established TCP flow in the north-south conntrack
            /// (kube-proxy's --conntrack-tcp-timeout-established), e.g. 24h; 0 keeps the
            /// default [default: 24h].
            #[arg(long, allow_hyphen_values = true, value_parser = parse_timeout)]
            conntrack_tcp_timeout_established,
        },
        unset: |d: &Duration| d.is_zero(),
        file: Conntrack fields::timeout => [
            "conntrack.tcpEstablishedTimeout" = conntrack.tcp_established_timeout,
        ],
    },
    /// `--conntrack-udp-timeout-stream` / `conntrack.udpStreamTimeout`.
    conntrack_udp_timeout_stream: Duration => tc.conntrack_udp_timeout_stream {
        default: DEFAULT_CT_UDP_STREAM,
        flags: {
            /// Idle timeout of a UDP flow that saw replies in the north-south conntrack
            /// (kube-proxy's --conntrack-udp-timeout-stream, the kernel's
            /// nf_conntrack_udp_timeout_stream), e.g. 2m; 0 keeps the default. Unreplied UDP
            /// flows use --udp-flow-timeout [default: 2m].
            #[arg(long, allow_hyphen_values = true, value_parser = parse_timeout)]
            conntrack_udp_timeout_stream,
        },
        unset: |d: &Duration| d.is_zero(),
        file: Conntrack fields::timeout => [
            "conntrack.udpStreamTimeout" = conntrack.udp_stream_timeout,
        ],
    },
    /// `--maglev-table-size` (the flag alone).
    maglev_table_size: u32 => maglev_table_size {
        default: MAGLEV_DEFAULT,
        flags: {
            /// Size of the Maglev lookup tables of source-hash and maglev Services: a prime from 7 to
            /// 65521 (larger tables spread backends more evenly; each costs 4 bytes per entry)
            /// [default: 16381].
            #[arg(long, allow_hyphen_values = true, value_parser = parse_maglev_size)]
            maglev_table_size,
        },
    },
    /// `--socket-lb-scope` (the flag alone).
    socket_lb_scope: SocketLbScope => socket_lb_scope {
        default: SocketLbScope::default(),
        flags: {
            /// Which sockets the socket programs translate: `all`, or `host-only` (only the node's
            /// own network namespace; pods are translated per packet on their interfaces, as
            /// Cilium's `socketLB.hostNamespaceOnly`). Pods and namespaces also opt out one by one
            /// with the label or annotation `ebpf-proxy.io/socket-lb: disabled` [default: all].
            #[arg(allow_hyphen_values = true, long, value_enum)]
            socket_lb_scope,
        },
    },
    /// `--north-south-mode` (the flag alone).
    north_south_mode: NorthSouthMode => north_south_mode {
        default: NorthSouthMode::default(),
        flags: {
            /// How a flow from outside (node port, external or LB IP, `externalTrafficPolicy:
            /// Cluster`) reaches a backend on another node: `snat` (source-NAT to this node's
            /// address, kube-proxy's), `dsr` (direct server return: the packet is forwarded
            /// encapsulated, IPIP or IPv6-in-IPv6, and the backend's node answers the client
            /// directly; the backend sees the client's address), or `hybrid` (DSR for TCP, SNAT for
            /// UDP). Every node must run the same mode (a DSR packet is accepted by the backend's
            /// node only when it runs DSR for that Service too). Services override it with the
            /// annotation `ebpf-proxy.io/north-south-mode` [default: snat].
            #[arg(allow_hyphen_values = true, long, value_name = "MODE", value_parser = parse_north_south_mode)]
            north_south_mode,
        },
    },
    /// `--kernel-log-level` (the flag alone).
    kernel_log_level: KernelLogLevel => kernel_log_level {
        default: KernelLogLevel::default(),
        flags: {
            /// Level of the kernel programs' own log lines (aya-log), forwarded to the agent's log
            /// under the target `ebpf_proxy::kernel` whatever `--log-level` says: off, error, warn,
            /// info, debug (one line per decision: a connection translated or refused, a packet
            /// flow started, dropped or rejected) or trace (also every connect() to an address
            /// that is no frontend). Off costs nothing: the verifier removes the disabled lines
            /// [default: off].
            #[arg(allow_hyphen_values = true, long, value_enum)]
            kernel_log_level,
        },
    },
    /// `--max-frontends` (the flag alone).
    max_frontends: u32 => map_sizes.frontends {
        default: DEFAULT_MAX_FRONTENDS,
        flags: {
            /// Size of the frontend map (VIP x port x protocol, plus one entry per VIP) when created
            /// [default: 65536].
            #[arg(long, allow_hyphen_values = true, value_parser = number_in(1u32, u32::MAX))]
            max_frontends,
        },
    },
    /// `--max-backend-slots` (the flag alone).
    max_backend_slots: u32 => map_sizes.slots {
        default: DEFAULT_MAX_SLOTS,
        flags: {
            /// Size of the backend slot map (sum of all services' endpoint counts) when created
            /// [default: 262144].
            #[arg(long, allow_hyphen_values = true, value_parser = number_in(1u32, u32::MAX))]
            max_backend_slots,
        },
    },
    /// `--max-backends` (the flag alone).
    max_backends: u32 => map_sizes.backends {
        default: DEFAULT_MAX_BACKENDS,
        flags: {
            /// Size of the backend map (distinct endpoint address x port x protocol) when created
            /// [default: 131072].
            #[arg(long, allow_hyphen_values = true, value_parser = number_in(1u32, u32::MAX))]
            max_backends,
        },
    },
    /// `--max-sockets` (the flag alone).
    max_sockets: u32 => map_sizes.sockets {
        default: DEFAULT_MAX_SOCKETS,
        flags: {
            /// Size of the per-socket reverse-NAT and UDP flow maps (LRU) when created; connected
            /// sockets' reverse-NAT slots get the largest power of two not above it
            /// [default: 262144].
            #[arg(long, allow_hyphen_values = true, value_parser = number_in(1u32, u32::MAX))]
            max_sockets,
        },
    },
    /// `--xdp` (the flag alone).
    xdp: XdpSetting => tc.xdp {
        default: XdpSetting::default(),
        flags: {
            /// XDP in front of the tcx programs on the external interfaces, for the same
            /// NodePorts, external IPs and LB IPs with the same conntrack: `native` (driver XDP on
            /// every external interface; an interface without it is an error), `best-effort`
            /// (native where the driver supports it, else generic XDP, else the tcx programs
            /// alone) or `disabled`. `ebpf-proxy check` tells which interfaces have native XDP
            /// [default: disabled].
            #[arg(allow_hyphen_values = true, long, value_enum, value_name = "MODE")]
            xdp,
        },
    },
    /// `--cgroup-path` (the flag alone; `None`: the cgroup2 mount root).
    cgroup_path: PathBuf => cgroup_path {
        default: None,
        into: Some,
        flags: {
            /// cgroup v2 directory to attach the socket programs to [default: the cgroup2 mount root
            /// from /proc/self/mounts, i.e. every process of the node].
            #[arg(allow_hyphen_values = true, long)]
            cgroup_path,
        },
    },
    /// `--close-connections-to-removed-endpoints` (the flag alone).
    close_connections_to_removed_endpoints: bool => close_connections_to_removed_endpoints {
        default: false,
        flags: {
            /// Close the TCP connections of client sockets translated to an endpoint that left its
            /// Service (gone from the EndpointSlices, or neither ready nor serving), with sock_diag's
            /// SOCK_DESTROY in the socket's network namespace, as `ss -K` does. Off by default, as
            /// kube-proxy leaves established connections alone.
            #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = parse_go_bool, action = clap::ArgAction::Set, value_name = "BOOL")]
            close_connections_to_removed_endpoints: bool,
        },
    },
    /// `--status-bind-address` (the flag alone; `None`: no status server).
    status_bind_address: ServerAddress => status_bind_address {
        default: Some(status_bind_address()),
        into: |a: ServerAddress| a.resolve(DEFAULT_STATUS_PORT),
        flags: {
            /// Address of the agent's own status server (`/readyz`, `/livez`, `/status`; read by
            /// `ebpf-proxy status` and the DaemonSet's probes), on a port kube-proxy never binds so
            /// that its answers cannot come from kube-proxy while both run: ip:port, an IP alone
            /// (port 10266), or empty to disable it; port 0 picks a free port
            /// [default: 127.0.0.1:10266].
            #[arg(allow_hyphen_values = true, long)]
            status_bind_address,
        },
    },
    /// `--interfaces` (the flag alone; empty: the interfaces of the node's addresses).
    interfaces: Vec<String> => tc.interfaces {
        default: Vec::new(),
        flags: {
            /// Interfaces that serve NodePorts, external IPs and LB IPs to traffic from outside the
            /// node, comma-separated [default: the interfaces of the agent's network namespace that
            /// carry one of this node's InternalIP/ExternalIP addresses from its Node object].
            #[arg(allow_hyphen_values = true, long, value_delimiter = ',')]
            interfaces: Vec<String>,
        },
    },
    /// `--xdp-veth-peers-ready` (the flag alone).
    xdp_veth_peers_ready: bool => tc.xdp_veth_peers_ready {
        default: false,
        flags: {
            /// The peers of veth external interfaces run an XDP program in native mode, so frames
            /// the XDP program sends back or redirects into a veth are delivered: lets --xdp use
            /// native XDP on veths, which it otherwise refuses (native) or skips (best-effort).
            #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", default_value = "false", value_parser = parse_go_bool, action = clap::ArgAction::Set, value_name = "BOOL")]
            xdp_veth_peers_ready: bool,
        },
    },
    /// `--oom-score-adj` / `oomScoreAdj`.
    oom_score_adj: i32 => oom_score_adj {
        default: DEFAULT_OOM_SCORE_ADJ,
        flags: {
            /// oom_score_adj of the agent process, -1000..=1000 [default: -999].
            #[arg(long, allow_hyphen_values = true, value_parser = number_in(OOM_SCORE_ADJ_RANGE.0, OOM_SCORE_ADJ_RANGE.1), value_name = "N", help_heading = KUBE_PROXY_FLAGS)]
            oom_score_adj,
        },
        // Read after nodePortAddresses (the table's order is the file's validation order).
        file: TopLevel fields::count_in(OOM_SCORE_ADJ_RANGE.0, OOM_SCORE_ADJ_RANGE.1) => [
            "oomScoreAdj" = oom_score_adj,
        ],
    },
    /// `--hostname-override` / `hostnameOverride`, trimmed and lowercased as kube-proxy does
    /// (`None`: the node name is resolved at start).
    hostname_override: String => hostname_override {
        default: None,
        into: |h: String| Some(h.trim().to_lowercase()),
        flags: {
            /// Name of this node [default: $NODE_NAME, else the hostname]; trimmed and lowercased,
            /// as kube-proxy does, then refused unless it is a Node name (a DNS subdomain).
            #[arg(allow_hyphen_values = true, long)]
            hostname_override,
        },
        // An empty flag is an error (after the disagreements of the rows above it); an empty
        // field is unset.
        check: |h: &String| -> Result<()> {
            if h.trim().is_empty() {
                bail!("--hostname-override: an empty name is invalid");
            }
            check_node_name(&h.trim().to_lowercase())
                .map_err(|e| anyhow::anyhow!("--hostname-override: {e}"))
        },
        file: TopLevel fields::name => ["hostnameOverride" = hostname_override],
        written: |h: &Option<String>, _| Some(h.clone().unwrap_or_default()),
    },
    /// `--bind-address` / `bindAddress`: kube-proxy's idea of the node's primary IP; only its
    /// family is used here (the default server addresses are IPv6 when it is IPv6).
    bind_address: IpAddr => bind_address {
        default: None,
        into: Some,
        flags: {
            /// kube-proxy's idea of the node's primary IP; only its family is used here (the
            /// default server addresses are IPv6 when it is IPv6).
            #[arg(allow_hyphen_values = true, long, value_name = "IP", help_heading = KUBE_PROXY_FLAGS)]
            bind_address,
        },
        file: BindAddress fields::ip_address => ["bindAddress" = bind_address],
        written: |ip: &Option<IpAddr>, _| {
            Some(ip.map_or_else(|| kp::BIND_ADDRESS.into(), |ip| ip.to_string()))
        },
    },
}
