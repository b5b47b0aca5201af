//! The effective configuration as a `KubeProxyConfiguration` (`--write-config-to`): every
//! v1alpha1 field, in kube-proxy's layout. Fields with a meaning here hold the value the
//! agent runs with; the others hold what the file or a flag gave, else kube-proxy's default
//! (`pkg/proxy/apis/config/v1alpha1/defaults.go`). `mode` is written empty, so the file runs
//! ebpf-proxy and kube-proxy alike; the sync periods and `masqueradeAll` are written in every
//! mode's section. Settings of ebpf-proxy alone (map sizes, `--lb-algorithm random`,
//! `--maglev-table-size`, `--cgroup-path`, `--interfaces`, `--socket-lb-scope`, the pin
//! directory, `--manifests`) have no field and are not written.
//!
//! A kube-proxy flag without an effect here is written as given, over the file's value. Each
//! section is built by one function below, from the settings ([`AgentConfig`]), the file as
//! read and the kube-proxy flags; then the settings of the table of `settings` are written
//! into their fields, as its rows say.

use std::time::Duration;

use serde_yaml_ng::Value;

use super::defaults::kube_proxy as kp;
use super::file::{
    ClientConnection, Conntrack, DetectLocal, IpTables, Ipvs, KubeProxyConfiguration, Logging,
    NfTables, Winkernel,
};
use super::settings::{self, Origins};
use super::{
    API_VERSION, AgentConfig, IpvsScheduler, KIND, KubeProxyFlags, SourceChoice,
    go::format_go_duration,
};

fn dur(d: Duration) -> Option<Value> {
    Some(Value::String(format_go_duration(d)))
}

fn num(n: i64) -> Option<Value> {
    Some(Value::Number(n.into()))
}

fn text(s: &str) -> Option<String> {
    Some(s.to_string())
}

/// The file's value unless absent or null, else `base`.
fn value(file: &Option<Value>, base: Option<Value>) -> Option<Value> {
    file.clone().filter(|v| !v.is_null()).or(base)
}

/// The file's text unless absent or empty, else `base`.
fn string(file: &Option<String>, base: &str) -> Option<String> {
    Some(
        file.clone()
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| base.to_string()),
    )
}

fn flag(file: &Option<bool>, base: bool) -> Option<bool> {
    Some(file.unwrap_or(base))
}

/// Builds the effective document of `c`, from the file as read (`read`, default when there
/// is none), the kube-proxy flags `k` and where the table's settings came from (`origins`).
pub(super) fn effective(
    c: &AgentConfig,
    k: &KubeProxyFlags,
    read: &KubeProxyConfiguration,
    origins: &Origins,
) -> KubeProxyConfiguration {
    let mut doc = KubeProxyConfiguration {
        api_version: text(API_VERSION),
        bind_address: None,
        bind_address_hard_fail: None,
        client_connection: Some(client_connection(c, k, read)),
        cluster_cidr: None,
        config_sync_period: match k.config_sync_period {
            Some(d) => dur(d),
            None => value(&read.config_sync_period, dur(kp::CONFIG_SYNC_PERIOD)),
        },
        conntrack: Some(conntrack(k, read)),
        detect_local: Some(detect_local(k, read)),
        detect_local_mode: match &k.detect_local_mode {
            Some(m) => Some(m.clone()),
            None => string(&read.detect_local_mode, kp::DETECT_LOCAL_MODE),
        },
        enable_profiling: k.profiling.or(flag(&read.enable_profiling, false)),
        feature_gates: match &k.feature_gates {
            Some(g) => Some(g.0.clone()),
            None => read.feature_gates.clone(),
        }
        .filter(|g| !g.is_empty()),
        healthz_bind_address: Some(
            c.healthz_bind_address
                .map(|a| a.to_string())
                .unwrap_or_default(),
        ),
        hostname_override: None,
        iptables: Some(iptables(k, read)),
        ipvs: Some(ipvs(c, k, read)),
        kind: text(KIND),
        logging: Some(logging(c, k, read)),
        metrics_bind_address: Some(
            c.metrics_bind_address
                .map(|a| a.to_string())
                .unwrap_or_default(),
        ),
        mode: text(""),
        nftables: Some(nftables(k, read)),
        node_port_addresses: None,
        oom_score_adj: None,
        port_range: match &k.proxy_port_range {
            Some(r) => Some(r.clone()),
            None => string(&read.port_range, ""),
        },
        show_hidden_metrics_for_version: match &k.show_hidden_metrics_for_version {
            Some(v) => Some(v.clone()),
            None => string(&read.show_hidden_metrics_for_version, ""),
        },
        windows_run_as_service: read.windows_run_as_service.filter(|b| *b),
        winkernel: Some(winkernel(read)),
        other: Default::default(),
    };
    settings::write(c, origins, &mut doc);
    doc
}

/// `clientConnection`: the kubeconfig of the API source.
fn client_connection(
    c: &AgentConfig,
    k: &KubeProxyFlags,
    read: &KubeProxyConfiguration,
) -> ClientConnection {
    let rc = read.client_connection.clone().unwrap_or_default();
    let kubeconfig = match &c.source {
        SourceChoice::Api(Some(p)) => p.display().to_string(),
        _ => String::new(),
    };
    ClientConnection {
        accept_content_types: string(&rc.accept_content_types, ""),
        burst: match k.kube_api_burst {
            Some(n) => num(n as i64),
            None => value(&rc.burst, num(kp::BURST)),
        },
        content_type: match &k.kube_api_content_type {
            Some(t) => Some(t.clone()),
            None => string(&rc.content_type, kp::CONTENT_TYPE),
        },
        kubeconfig: Some(kubeconfig),
        qps: match k.kube_api_qps {
            Some(q) => Some(Value::Number(serde_yaml_ng::Number::from(q as f64))),
            None => value(&rc.qps, num(kp::QPS)),
        },
        other: Default::default(),
    }
}

/// `conntrack`: the fields without an effect here (the others are the table's).
fn conntrack(k: &KubeProxyFlags, read: &KubeProxyConfiguration) -> Conntrack {
    let rt = read.conntrack.clone().unwrap_or_default();
    Conntrack {
        tcp_be_liberal: k
            .conntrack_tcp_be_liberal
            .or(flag(&rt.tcp_be_liberal, false)),
        tcp_close_wait_timeout: match k.conntrack_tcp_timeout_close_wait {
            Some(d) => dur(d),
            None => value(
                &rt.tcp_close_wait_timeout,
                dur(kp::CONNTRACK_TCP_CLOSE_WAIT_TIMEOUT),
            ),
        },
        ..Default::default()
    }
}

/// `detectLocal`: nothing has an effect here.
fn detect_local(k: &KubeProxyFlags, read: &KubeProxyConfiguration) -> DetectLocal {
    let rd = read.detect_local.clone().unwrap_or_default();
    DetectLocal {
        bridge_interface: match &k.pod_bridge_interface {
            Some(b) => Some(b.clone()),
            None => string(&rd.bridge_interface, ""),
        },
        interface_name_prefix: match &k.pod_interface_name_prefix {
            Some(p) => Some(p.clone()),
            None => string(&rd.interface_name_prefix, ""),
        },
        other: Default::default(),
    }
}

/// `iptables`: the fields without an effect here (`masqueradeAll` and the sync periods are
/// the table's).
fn iptables(k: &KubeProxyFlags, read: &KubeProxyConfiguration) -> IpTables {
    let ri = read.iptables.clone().unwrap_or_default();
    IpTables {
        localhost_node_ports: k
            .iptables_localhost_nodeports
            .or(flag(&ri.localhost_node_ports, kp::LOCALHOST_NODE_PORTS)),
        masquerade_bit: masquerade_bit(k, &ri.masquerade_bit),
        ..Default::default()
    }
}

/// `nftables`: the fields without an effect here (`masqueradeAll` and the sync periods are
/// the table's).
fn nftables(k: &KubeProxyFlags, read: &KubeProxyConfiguration) -> NfTables {
    let rn = read.nftables.clone().unwrap_or_default();
    NfTables {
        masquerade_bit: masquerade_bit(k, &rn.masquerade_bit),
        ..Default::default()
    }
}

/// `masqueradeBit` of the iptables and nftables sections: `--iptables-masquerade-bit`, else
/// the section's, else kube-proxy's default.
fn masquerade_bit(k: &KubeProxyFlags, read: &Option<Value>) -> Option<Value> {
    match k.iptables_masquerade_bit {
        Some(b) => num(b as i64),
        None => value(read, num(kp::MASQUERADE_BIT)),
    }
}

/// `ipvs`: the default algorithm by its scheduler name (empty when it has none), and the
/// table's sync periods.
fn ipvs(c: &AgentConfig, k: &KubeProxyFlags, read: &KubeProxyConfiguration) -> Ipvs {
    let rv = read.ipvs.clone().unwrap_or_default();
    let scheduler = IpvsScheduler::of_algorithm(c.lb_algorithm)
        .map(IpvsScheduler::name)
        .unwrap_or("");
    let timeout = |flag: Option<Duration>, read: &Option<Value>| match flag {
        Some(d) => dur(d),
        None => value(read, dur(Duration::ZERO)),
    };
    Ipvs {
        exclude_cidrs: match k.ipvs_exclude_cidrs.is_empty() {
            false => Some(k.ipvs_exclude_cidrs.clone()),
            true => rv.exclude_cidrs.clone().filter(|v| !v.is_empty()),
        },
        scheduler: text(scheduler),
        strict_arp: k.ipvs_strict_arp.or(flag(&rv.strict_arp, false)),
        tcp_fin_timeout: timeout(k.ipvs_tcpfin_timeout, &rv.tcp_fin_timeout),
        tcp_timeout: timeout(k.ipvs_tcp_timeout, &rv.tcp_timeout),
        udp_timeout: timeout(k.ipvs_udp_timeout, &rv.udp_timeout),
        ..Default::default()
    }
}

/// `logging`: the format and the verbosity.
fn logging(c: &AgentConfig, k: &KubeProxyFlags, read: &KubeProxyConfiguration) -> Logging {
    let rl = read.logging.clone().unwrap_or_default();
    Logging {
        flush_frequency: match k.log_flush_frequency {
            Some(d) => dur(d),
            None => value(&rl.flush_frequency, dur(kp::LOG_FLUSH_FREQUENCY)),
        },
        format: text(c.log_format.name()),
        options: rl.options.clone().filter(|v| !v.is_null()),
        verbosity: num(c.verbosity.unwrap_or(0) as i64),
        vmodule: match &k.vmodule {
            Some(v) => vmodule(v),
            None => rl.vmodule.clone().filter(|v| !v.is_null()),
        },
        other: Default::default(),
    }
}

/// `winkernel`: Windows only, written as read.
fn winkernel(read: &KubeProxyConfiguration) -> Winkernel {
    let rw = read.winkernel.clone().unwrap_or_default();
    Winkernel {
        enable_dsr: flag(&rw.enable_dsr, false),
        forward_health_check_vip: flag(&rw.forward_health_check_vip, false),
        network_name: string(&rw.network_name, ""),
        root_hns_endpoint_name: string(&rw.root_hns_endpoint_name, ""),
        source_vip: string(&rw.source_vip, ""),
        other: Default::default(),
    }
}

/// `--vmodule pattern=N,...` as v1alpha1's `vmodule` list of `{filePattern, verbosity}`;
/// `None` when it does not parse.
fn vmodule(flag: &str) -> Option<Value> {
    let mut items = Vec::new();
    for pair in flag.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (pattern, level) = pair.split_once('=')?;
        let level: u32 = level.trim().parse().ok()?;
        let mut m = serde_yaml_ng::Mapping::new();
        m.insert(
            "filePattern".into(),
            Value::String(pattern.trim().to_string()),
        );
        m.insert("verbosity".into(), Value::Number(level.into()));
        items.push(Value::Mapping(m));
    }
    Some(Value::Sequence(items))
}
