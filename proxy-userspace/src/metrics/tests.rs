use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// A Go `prometheus.ExponentialBuckets(start, factor, count)`.
fn exponential(start: f64, factor: f64, count: usize) -> Vec<f64> {
    (0..count).map(|i| start * factor.powi(i as i32)).collect()
}

/// A Go `prometheus.LinearBuckets(start, width, count)`.
fn linear(start: f64, width: f64, count: usize) -> Vec<f64> {
    (0..count).map(|i| start + width * i as f64).collect()
}

/// component-base `metrics.MergeBuckets`: a leading 0, then the lists.
fn merge(lists: &[Vec<f64>]) -> Vec<f64> {
    let mut b = vec![0.0];
    for l in lists {
        b.extend(l);
    }
    b
}

/// One family as kube-proxy's source defines it: name, type, labels, help, buckets.
type Reference = (
    &'static str,
    &'static str,
    Vec<&'static str>,
    &'static str,
    Vec<f64>,
);

/// Every metric family kube-proxy registers in its nftables mode: name (as exposed,
/// counters with `_total`), type, labels, help (without component-base's `[ALPHA] `
/// prefix) and histogram buckets, taken from kubernetes/kubernetes
/// `pkg/proxy/metrics/metrics.go` (`RegisterMetrics`: the families registered for every
/// mode, then `ProxyModeNFTables`'s; the healthz counters are fed by
/// `pkg/proxy/healthcheck/proxy_health.go`), with the `ip_family` labels and the
/// conntrack reconciler families of the current release (the v1.36 Kubernetes metrics
/// reference, generated from that file).
fn kube_proxy_families() -> Vec<Reference> {
    vec![
        (
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "histogram",
            vec!["ip_family"],
            "SyncProxyRules latency in seconds",
            exponential(0.001, 2.0, 15),
        ),
        (
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "gauge",
            vec!["ip_family"],
            "The last time a sync of proxy rules was queued",
            vec![],
        ),
        (
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "gauge",
            vec!["ip_family"],
            "The last time proxy rules were successfully synced",
            vec![],
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "gauge",
            vec![],
            "Pending proxy rules Endpoint changes",
            vec![],
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "counter",
            vec![],
            "Cumulative proxy rules Endpoint changes",
            vec![],
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "gauge",
            vec![],
            "Pending proxy rules Service changes",
            vec![],
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "counter",
            vec![],
            "Cumulative proxy rules Service changes",
            vec![],
        ),
        (
            "kubeproxy_proxy_healthz_total",
            "counter",
            vec!["code"],
            "Cumulative proxy healthz HTTP status",
            vec![],
        ),
        (
            "kubeproxy_proxy_livez_total",
            "counter",
            vec!["code"],
            "Cumulative proxy livez HTTP status",
            vec![],
        ),
        (
            "kubeproxy_network_programming_duration_seconds",
            "histogram",
            vec!["ip_family"],
            "In Cluster Network Programming Latency in seconds",
            merge(&[
                linear(0.25, 0.25, 2),
                linear(1.0, 1.0, 59),
                linear(60.0, 5.0, 12),
                linear(120.0, 30.0, 7),
            ]),
        ),
        (
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "gauge",
            vec!["ip_family", "traffic_policy"],
            "Number of services with a Local traffic policy and no endpoints",
            vec![],
        ),
        (
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
            "counter",
            vec!["ip_family"],
            "Cumulative proxy nftables sync failures",
            vec![],
        ),
        (
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total",
            "counter",
            vec!["ip_family"],
            "Cumulative proxy nftables cleanup failures",
            vec![],
        ),
        (
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "histogram",
            vec!["ip_family"],
            "ReconcileConntrackFlowsLatency latency in seconds",
            exponential(0.001, 2.0, 15),
        ),
        (
            "kubeproxy_conntrack_reconciler_deleted_entries_total",
            "counter",
            vec!["ip_family"],
            "Cumulative conntrack flows deleted by conntrack reconciler",
            vec![],
        ),
    ]
}

/// One family of a text exposition: type, help, label names of its samples, and the
/// `le` values of its buckets.
#[derive(Debug, Default)]
struct Exposed {
    kind: String,
    help: String,
    labels: BTreeSet<Vec<String>>,
    buckets: Vec<f64>,
}

/// Reads an OpenMetrics (or Prometheus) text exposition by family name.
fn exposition(text: &str) -> BTreeMap<String, Exposed> {
    let mut out: BTreeMap<String, Exposed> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap();
            out.entry(name.into()).or_default().help = help.into();
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            out.entry(name.into()).or_default().kind = kind.into();
        } else if !line.starts_with('#') && !line.is_empty() {
            let (series, _value) = line.rsplit_once(' ').unwrap();
            let (sample, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}')),
                None => (series, ""),
            };
            let family = out
                .keys()
                .filter(|f| sample.starts_with(f.as_str()))
                .max_by_key(|f| f.len())
                .cloned()
                .unwrap_or_else(|| panic!("sample {sample} before its family"));
            let mut names = Vec::new();
            let e = out.get_mut(&family).unwrap();
            for pair in labels.split(',').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').unwrap();
                if k == "le" {
                    let v = v.trim_matches('"');
                    if v != "+Inf" && !e.buckets.contains(&v.parse().unwrap()) {
                        e.buckets.push(v.parse().unwrap());
                    }
                } else {
                    names.push(k.to_string());
                }
            }
            names.sort();
            e.labels.insert(names);
        }
    }
    out
}

#[test]
fn every_kube_proxy_family_is_exposed_as_kube_proxy_exposes_it() {
    let m = Metrics::new(
        PathBuf::from("/nonexistent"),
        vec![ModelFamily::V4, ModelFamily::V6],
    );
    let k = &m.kube_proxy;
    k.endpoint_changes.inc();
    k.healthz.get_or_create(&[("code", "200")]).inc();
    k.livez.get_or_create(&[("code", "503")]).inc();
    m.synced(
        Duration::from_millis(3),
        true,
        (0, 0, 0, 0),
        Capacity {
            frontends: 1,
            slots: 2,
            backends: 3,
            services: 4,
        },
    );
    let exposed = exposition(&m.encode());
    let ours: BTreeSet<&String> = exposed
        .keys()
        .filter(|n| n.starts_with("kubeproxy_"))
        .collect();
    let theirs = kube_proxy_families();
    assert_eq!(ours.len(), theirs.len(), "families: {ours:?}");
    for (name, kind, labels, help, buckets) in theirs {
        // OpenMetrics names a counter's family without `_total`.
        let family = if kind == "counter" {
            name.trim_end_matches("_total")
        } else {
            name
        };
        let e = exposed
            .get(family)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(e.kind, kind, "{name}");
        assert_eq!(e.help, format!("[ALPHA] {help}"), "{name}");
        let mut labels: Vec<String> = labels.iter().map(|l| l.to_string()).collect();
        labels.sort();
        assert_eq!(e.labels, BTreeSet::from([labels]), "{name}");
        assert_eq!(e.buckets, buckets, "{name}");
    }
    // The agent's own families stay beside them.
    for own in [
        "ebpf_proxy_sync_errors",
        "ebpf_proxy_map_capacity",
        "ebpf_proxy_objects_skipped",
    ] {
        assert!(exposed.contains_key(own), "{own}");
    }
    let text = m.encode();
    for sample in [
        "kubeproxy_sync_proxy_rules_endpoint_changes_total 1",
        "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"} 1",
        "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"external\"} 0",
        "ebpf_proxy_map_capacity{map=\"BACKENDS\"} 3",
    ] {
        assert!(text.contains(sample), "{sample} missing in\n{text}");
    }
}

#[test]
fn last_sync_moves_only_when_everything_was_applied() {
    let m = Metrics::new(PathBuf::from("/nonexistent"), vec![ModelFamily::V4]);
    let cap = Capacity {
        frontends: 1,
        slots: 1,
        backends: 1,
        services: 1,
    };
    m.synced(Duration::ZERO, false, (0, 0, 0, 0), cap);
    let last = |m: &Metrics| {
        m.kube_proxy
            .last_sync
            .get_or_create(&[("ip_family", "IPv4")])
            .get()
    };
    assert_eq!(last(&m), 0.0);
    m.synced(Duration::ZERO, true, (0, 0, 0, 0), cap);
    assert!(last(&m) > 1.0e9);
    assert_eq!(
        m.kube_proxy
            .last_queued
            .get_or_create(&[("ip_family", "IPv4")])
            .get(),
        0.0
    );
    m.queued();
    assert!(
        m.kube_proxy
            .last_queued
            .get_or_create(&[("ip_family", "IPv4")])
            .get()
            > 1.0e9
    );
}

#[test]
fn trigger_time_latency() {
    let now = humantime::parse_rfc3339("2026-01-01T00:00:10Z").unwrap();
    assert_eq!(
        programming_latency(Some("2026-01-01T00:00:07.5Z"), now),
        Some(2.5)
    );
    assert_eq!(programming_latency(Some("2026-01-01T00:00:11Z"), now), None);
    assert_eq!(programming_latency(Some("garbage"), now), None);
    assert_eq!(programming_latency(None, now), None);
}
