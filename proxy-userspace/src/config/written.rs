//! The effective configuration as a `KubeProxyConfiguration` (`--write-config-to`): every
//! v1alpha1 field, in kube-proxy's layout. Fields with a meaning here hold the value the
//! agent runs with; the others hold what the file or a flag gave, else kube-proxy's default
//! (`pkg/proxy/apis/config/v1alpha1/defaults.go`). `mode` is written empty, so the file runs
//! ebpf-proxy and kube-proxy alike; the sync periods and `masqueradeAll` are written in every
//! mode's section. Settings of ebpf-proxy alone (map sizes, `--lb-algorithm random`,
//! `--maglev-table-size`, `--cgroup-path`, `--interfaces`, `--socket-lb-scope`, the pin
//! directory, `--manifests`) have no field and are not written.

use std::time::Duration;

use serde_yaml_ng::Value;

use super::file::{
    ClientConnection, Conntrack, DetectLocal, IpTables, Ipvs, KubeProxyConfiguration, Logging,
    NfTables, Winkernel,
};
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
/// is none) and the kube-proxy flags `k`.
pub(super) fn effective(
    c: &AgentConfig,
    k: &KubeProxyFlags,
    read: &KubeProxyConfiguration,
) -> KubeProxyConfiguration {
    let rc = read.client_connection.clone().unwrap_or_default();
    let rt = read.conntrack.clone().unwrap_or_default();
    let rd = read.detect_local.clone().unwrap_or_default();
    let ri = read.iptables.clone().unwrap_or_default();
    let rv = read.ipvs.clone().unwrap_or_default();
    let rn = read.nftables.clone().unwrap_or_default();
    let rl = read.logging.clone().unwrap_or_default();
    let rw = read.winkernel.clone().unwrap_or_default();
    let kubeconfig = match &c.source {
        SourceChoice::Api(Some(p)) => p.display().to_string(),
        _ => String::new(),
    };
    let scheduler = IpvsScheduler::of_algorithm(c.lb_algorithm)
        .map(IpvsScheduler::name)
        .unwrap_or("");
    let masquerade_bit = value(&ri.masquerade_bit, num(14));
    let mut doc = KubeProxyConfiguration {
        api_version: text(API_VERSION),
        bind_address: Some(
            c.bind_address
                .map(|ip| ip.to_string())
                .unwrap_or_else(|| "0.0.0.0".into()),
        ),
        bind_address_hard_fail: Some(c.bind_address_hard_fail),
        client_connection: Some(ClientConnection {
            accept_content_types: string(&rc.accept_content_types, ""),
            burst: value(&rc.burst, num(10)),
            content_type: string(&rc.content_type, "application/vnd.kubernetes.protobuf"),
            kubeconfig: Some(kubeconfig),
            qps: value(&rc.qps, num(5)),
            other: Default::default(),
        }),
        cluster_cidr: Some(
            c.cluster_cidrs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ),
        config_sync_period: value(&read.config_sync_period, dur(Duration::from_secs(900))),
        conntrack: Some(Conntrack {
            max_per_core: num(c.tc.conntrack_max_per_core as i64),
            min: num(c.tc.conntrack_min as i64),
            tcp_be_liberal: flag(&rt.tcp_be_liberal, false),
            tcp_close_wait_timeout: value(
                &rt.tcp_close_wait_timeout,
                dur(Duration::from_secs(3600)),
            ),
            tcp_established_timeout: dur(c.tc.conntrack_tcp_timeout_established),
            udp_stream_timeout: dur(c.tc.conntrack_udp_timeout_stream),
            udp_timeout: dur(c.udp_flow_timeout),
            other: Default::default(),
        }),
        detect_local: Some(DetectLocal {
            bridge_interface: string(&rd.bridge_interface, ""),
            interface_name_prefix: string(&rd.interface_name_prefix, ""),
            other: Default::default(),
        }),
        detect_local_mode: string(&read.detect_local_mode, "ClusterCIDR"),
        enable_profiling: flag(&read.enable_profiling, false),
        feature_gates: read.feature_gates.clone().filter(|g| !g.is_empty()),
        healthz_bind_address: Some(
            c.healthz_bind_address
                .map(|a| a.to_string())
                .unwrap_or_default(),
        ),
        hostname_override: Some(c.hostname_override.clone().unwrap_or_default()),
        iptables: Some(IpTables {
            localhost_node_ports: flag(&ri.localhost_node_ports, true),
            masquerade_all: Some(c.tc.masquerade_all),
            masquerade_bit: masquerade_bit.clone(),
            min_sync_period: dur(c.min_sync_period),
            sync_period: dur(c.sync_period),
            other: Default::default(),
        }),
        ipvs: Some(Ipvs {
            exclude_cidrs: rv.exclude_cidrs.clone().filter(|v| !v.is_empty()),
            min_sync_period: dur(c.min_sync_period),
            scheduler: text(scheduler),
            strict_arp: flag(&rv.strict_arp, false),
            sync_period: dur(c.sync_period),
            tcp_fin_timeout: value(&rv.tcp_fin_timeout, dur(Duration::ZERO)),
            tcp_timeout: value(&rv.tcp_timeout, dur(Duration::ZERO)),
            udp_timeout: value(&rv.udp_timeout, dur(Duration::ZERO)),
            other: Default::default(),
        }),
        kind: text(KIND),
        logging: Some(Logging {
            flush_frequency: value(&rl.flush_frequency, dur(Duration::from_secs(5))),
            format: text(c.log_format.name()),
            options: rl.options.clone().filter(|v| !v.is_null()),
            verbosity: num(c.verbosity.unwrap_or(0) as i64),
            vmodule: rl.vmodule.clone().filter(|v| !v.is_null()),
            other: Default::default(),
        }),
        metrics_bind_address: Some(
            c.metrics_bind_address
                .map(|a| a.to_string())
                .unwrap_or_default(),
        ),
        mode: text(""),
        nftables: Some(NfTables {
            masquerade_all: Some(c.tc.masquerade_all),
            masquerade_bit: value(&rn.masquerade_bit, num(14)),
            min_sync_period: dur(c.min_sync_period),
            sync_period: dur(c.sync_period),
            other: Default::default(),
        }),
        node_port_addresses: c.nodeport_addresses.as_ref().map(|n| n.items()),
        oom_score_adj: num(c.oom_score_adj as i64),
        port_range: string(&read.port_range, ""),
        show_hidden_metrics_for_version: string(&read.show_hidden_metrics_for_version, ""),
        windows_run_as_service: read.windows_run_as_service.filter(|b| *b),
        winkernel: Some(Winkernel {
            enable_dsr: flag(&rw.enable_dsr, false),
            forward_health_check_vip: flag(&rw.forward_health_check_vip, false),
            network_name: string(&rw.network_name, ""),
            root_hns_endpoint_name: string(&rw.root_hns_endpoint_name, ""),
            source_vip: string(&rw.source_vip, ""),
            other: Default::default(),
        }),
        other: Default::default(),
    };

    // kube-proxy flags without an effect here: written as given.
    let cc = doc.client_connection.as_mut().expect("set above");
    if let Some(t) = &k.kube_api_content_type {
        cc.content_type = Some(t.clone());
    }
    if let Some(n) = k.kube_api_burst {
        cc.burst = num(n as i64);
    }
    if let Some(q) = k.kube_api_qps {
        cc.qps = Some(Value::Number(serde_yaml_ng::Number::from(q as f64)));
    }
    if let Some(g) = &k.feature_gates {
        doc.feature_gates = Some(g.0.clone()).filter(|g| !g.is_empty());
    }
    if let Some(p) = k.profiling {
        doc.enable_profiling = Some(p);
    }
    if let Some(v) = &k.show_hidden_metrics_for_version {
        doc.show_hidden_metrics_for_version = Some(v.clone());
    }
    if let Some(b) = k.iptables_masquerade_bit {
        doc.iptables.as_mut().expect("set above").masquerade_bit = num(b as i64);
        doc.nftables.as_mut().expect("set above").masquerade_bit = num(b as i64);
    }
    if let Some(l) = k.iptables_localhost_nodeports {
        doc.iptables
            .as_mut()
            .expect("set above")
            .localhost_node_ports = Some(l);
    }
    let ipvs = doc.ipvs.as_mut().expect("set above");
    if !k.ipvs_exclude_cidrs.is_empty() {
        ipvs.exclude_cidrs = Some(k.ipvs_exclude_cidrs.clone());
    }
    if let Some(a) = k.ipvs_strict_arp {
        ipvs.strict_arp = Some(a);
    }
    for (flag, field) in [
        (k.ipvs_tcp_timeout, &mut ipvs.tcp_timeout),
        (k.ipvs_tcpfin_timeout, &mut ipvs.tcp_fin_timeout),
        (k.ipvs_udp_timeout, &mut ipvs.udp_timeout),
    ] {
        if let Some(d) = flag {
            *field = dur(d);
        }
    }
    if let Some(m) = &k.detect_local_mode {
        doc.detect_local_mode = Some(m.clone());
    }
    let dl = doc.detect_local.as_mut().expect("set above");
    if let Some(b) = &k.pod_bridge_interface {
        dl.bridge_interface = Some(b.clone());
    }
    if let Some(p) = &k.pod_interface_name_prefix {
        dl.interface_name_prefix = Some(p.clone());
    }
    let ct = doc.conntrack.as_mut().expect("set above");
    if let Some(d) = k.conntrack_tcp_timeout_close_wait {
        ct.tcp_close_wait_timeout = dur(d);
    }
    if let Some(b) = k.conntrack_tcp_be_liberal {
        ct.tcp_be_liberal = Some(b);
    }
    if let Some(d) = k.config_sync_period {
        doc.config_sync_period = dur(d);
    }
    if let Some(r) = &k.proxy_port_range {
        doc.port_range = Some(r.clone());
    }
    let lg = doc.logging.as_mut().expect("set above");
    if let Some(d) = k.log_flush_frequency {
        lg.flush_frequency = dur(d);
    }
    if let Some(v) = &k.vmodule {
        lg.vmodule = vmodule(v);
    }
    doc
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
