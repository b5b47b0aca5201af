//! Prometheus metrics (prometheus-client), with kube-proxy's names where the meaning is the
//! same (`pkg/proxy/metrics/metrics.go`), plus the agent's own under `ebpf_proxy_`.
//!
//! Cardinality: every metric is unlabelled or labelled by a fixed set (map name, data path
//! reason), so the series count does not grow with the number of Services.

use std::{
    path::PathBuf,
    sync::atomic::AtomicU64,
    time::{Duration, SystemTime},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use proxy_common::Counter as DpCounter;

use crate::datapath::{Capacity, maps::read_counters};

/// Label set `{map="FRONTENDS"}`.
pub type MapLabel = [(&'static str, &'static str); 1];

/// The agent's metrics. Cheap to update; encoded on each scrape of `/metrics`.
#[derive(Debug)]
pub struct Metrics {
    /// Registry holding everything below.
    pub registry: Registry,
    /// `kubeproxy_sync_proxy_rules_duration_seconds`: time of one map sync.
    pub sync_duration: Histogram,
    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds`: Unix time of the last successful sync.
    pub last_sync: Gauge<f64, AtomicU64>,
    /// `kubeproxy_network_programming_duration_seconds`: from an EndpointSlice's
    /// `endpoints.kubernetes.io/last-change-trigger-time` to the data path applying it.
    pub network_programming: Histogram,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_total`: EndpointSlice changes seen.
    pub endpoint_changes: Counter,
    /// `kubeproxy_sync_proxy_rules_service_changes_total`: Service changes seen.
    pub service_changes: Counter,
    /// `ebpf_proxy_sync_errors_total`: syncs that failed (full map, map write error).
    pub sync_errors: Counter,
    /// `ebpf_proxy_objects_skipped`: objects, ports or endpoints skipped for bad input now.
    pub skipped: Gauge,
    /// `ebpf_proxy_map_entries{map}`: entries in use.
    pub map_entries: Family<MapLabel, Gauge>,
    /// `ebpf_proxy_map_capacity{map}`: `max_entries`.
    pub map_capacity: Family<MapLabel, Gauge>,
    /// `ebpf_proxy_change_latency_seconds{source}`: from the source seeing a change (a file
    /// event, a watch event) to the maps written.
    pub change_latency: Family<[(&'static str, &'static str); 1], Histogram>,
    /// `ebpf_proxy_service_ports{status}`: Service ports applied and failed now.
    pub service_ports: Family<[(&'static str, &'static str); 1], Gauge>,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_pending`: EndpointSlice changes read but
    /// not yet programmed.
    pub endpoint_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_service_changes_pending`: Service changes read but not
    /// yet programmed.
    pub service_changes_pending: Gauge,
}

/// Reads the data path's per-CPU counters at scrape time (`ebpf_proxy_datapath_events_total`
/// with label `reason`, see `proxy_common::Counter`).
#[derive(Debug)]
struct DatapathCounters {
    pin_dir: PathBuf,
}

impl Collector for DatapathCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(values) = read_counters(&self.pin_dir) else {
            return Ok(());
        };
        {
            let mut family = encoder.encode_descriptor(
            "ebpf_proxy_datapath_events",
            "Socket-level data path events by reason (translated, refused_no_endpoints, ...), summed over CPUs",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
            for (c, name) in DpCounter::ALL {
                let v = values.get(c as usize).copied().unwrap_or(0);
                let labels = [("reason", name)];
                let m = family.encode_family(&labels)?;
                ConstCounter::new(v).encode(m)?;
            }
        }
        if let Ok(values) = crate::datapath::maps::read_tc_counters(&self.pin_dir) {
            let mut family = encoder.encode_descriptor(
                "ebpf_proxy_tc_events",
                "North-south (tc) data path events by reason (tc_new_flow, tc_snat, tc_dropped_no_local_endpoints, tc_conntrack_full, tc_source_range_denied, ...), summed over CPUs",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (c, name) in proxy_common::nat::TcCounter::ALL {
                let v = values.get(c as usize).copied().unwrap_or(0);
                let labels = [("reason", name)];
                let m = family.encode_family(&labels)?;
                ConstCounter::new(v).encode(m)?;
            }
        }
        self.encode_per_service(&mut encoder)
    }
}

impl DatapathCounters {
    /// Per service id and per backend counters, labelled from `SERVICE_NAMES` and
    /// `BACKENDS`. One series per service id (Service port x protocol x family x scope) and
    /// per backend (address x port x protocol): bounded by the map sizes.
    fn encode_per_service(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use crate::datapath::{
            ServiceMaps,
            maps::{PinnedMaps, read_backend_stats, read_service_stats},
        };
        let Ok(maps) = PinnedMaps::open(&self.pin_dir) else {
            return Ok(());
        };
        let (Ok(snap), Ok(svc), Ok(be)) = (
            maps.snapshot(),
            read_service_stats(&self.pin_dir),
            read_backend_stats(&self.pin_dir),
        ) else {
            return Ok(());
        };
        let labels_of = |id: u32| -> Option<Vec<(&'static str, String)>> {
            let k = crate::reconcile::parse_service_name(snap.names.get(&id)?)?;
            Some(vec![
                ("namespace", k.namespace),
                ("service", k.name),
                ("port", k.port_name),
                ("protocol", k.protocol.as_str().to_string()),
                ("family", k.family.as_str().to_string()),
                (
                    "scope",
                    match k.scope {
                        crate::model::Scope::Internal => "cluster-ip",
                        crate::model::Scope::External => "external",
                        crate::model::Scope::Ingress => "ingress",
                    }
                    .to_string(),
                ),
            ])
        };
        type Field = fn(&proxy_common::ServiceStats) -> u64;
        let families: [(&str, &str, Field); 4] = [
            (
                "ebpf_proxy_service_connections",
                "New connections and UDP flows translated, per Service port, family and scope, summed over CPUs",
                |s| s.connections,
            ),
            (
                "ebpf_proxy_service_refused",
                "Connections and datagrams refused or dropped for lack of (local) endpoints, per Service port, family and scope",
                |s| s.refused,
            ),
            (
                "ebpf_proxy_service_packets",
                "Packets translated by the tc path, per Service port, family and scope",
                |s| s.packets,
            ),
            (
                "ebpf_proxy_service_bytes",
                "Bytes of the packets translated by the tc path, per Service port, family and scope",
                |s| s.bytes,
            ),
        ];
        for (name, help, field) in families {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (id, st) in &svc {
                let Some(labels) = labels_of(*id) else {
                    continue;
                };
                let m = family.encode_family(&labels)?;
                ConstCounter::new(field(st)).encode(m)?;
            }
        }
        let backend_labels = |id: u32| {
            let b = snap.backends.get(&id)?;
            Some([
                (
                    "backend",
                    crate::datapath::addr::to_socket_addr(b.addr, b.port).to_string(),
                ),
                (
                    "protocol",
                    crate::datapath::addr::proto_name(b.proto).to_string(),
                ),
            ])
        };
        let mut family = encoder.encode_descriptor(
            "ebpf_proxy_backend_connections",
            "New connections and UDP flows sent to each backend (address:port, protocol), summed over CPUs",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (id, n) in &be {
            let Some(labels) = backend_labels(*id) else {
                continue;
            };
            let m = family.encode_family(&labels)?;
            ConstCounter::new(*n).encode(m)?;
        }
        // The data path's own least-connections counts (connections and tc flows open now).
        let active = crate::inspect::read_u32_map(&self.pin_dir, proxy_common::LC_COUNTS)
            .unwrap_or_default();
        let mut family = encoder.encode_descriptor(
            "ebpf_proxy_backend_active_connections",
            "Open connections and live tc flows counted for least-connections per backend (address:port, protocol); 0 unless a Service using it has that algorithm",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (id, n) in &active {
            let Some(labels) = backend_labels(*id) else {
                continue;
            };
            let m = family.encode_family(&labels)?;
            prometheus_client::metrics::gauge::ConstGauge::new(*n as i64).encode(m)?;
        }
        Ok(())
    }
}

impl Metrics {
    /// Registers every metric; the data path counters are read from `pin_dir` on scrape.
    pub fn new(pin_dir: PathBuf) -> Self {
        let mut registry = Registry::default();
        let sync_duration = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds (one diff-based map sync)",
            sync_duration.clone(),
        );
        let last_sync = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            last_sync.clone(),
        );
        let network_programming = Histogram::new([
            0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        ]);
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            network_programming.clone(),
        );
        let endpoint_changes = Counter::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules EndpointSlice changes",
            endpoint_changes.clone(),
        );
        let service_changes = Counter::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            service_changes.clone(),
        );
        let sync_errors = Counter::default();
        registry.register(
            "ebpf_proxy_sync_errors",
            "Map syncs that failed (the data path kept its state)",
            sync_errors.clone(),
        );
        let skipped = Gauge::default();
        registry.register(
            "ebpf_proxy_objects_skipped",
            "Objects, ports or endpoints currently skipped for bad input (see the agent log)",
            skipped.clone(),
        );
        let map_entries = Family::<MapLabel, Gauge>::default();
        registry.register(
            "ebpf_proxy_map_entries",
            "Entries in use in a service map",
            map_entries.clone(),
        );
        let map_capacity = Family::<MapLabel, Gauge>::default();
        registry.register(
            "ebpf_proxy_map_capacity",
            "max_entries of a service map",
            map_capacity.clone(),
        );
        let change_latency =
            Family::<[(&'static str, &'static str); 1], Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 18))
            });
        registry.register(
            "ebpf_proxy_change_latency_seconds",
            "From the source seeing a change (file event, watch event) to the maps written",
            change_latency.clone(),
        );
        let service_ports = Family::<[(&'static str, &'static str); 1], Gauge>::default();
        registry.register(
            "ebpf_proxy_service_ports",
            "Service ports (Service port x protocol x family x scope) by status: applied, or failed (retried with backoff, see the agent log)",
            service_ports.clone(),
        );
        let endpoint_changes_pending = Gauge::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules EndpointSlice changes",
            endpoint_changes_pending.clone(),
        );
        let service_changes_pending = Gauge::default();
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            service_changes_pending.clone(),
        );
        registry.register_collector(Box::new(DatapathCounters { pin_dir }));
        Self {
            change_latency,
            service_ports,
            endpoint_changes_pending,
            service_changes_pending,
            registry,
            sync_duration,
            last_sync,
            network_programming,
            endpoint_changes,
            service_changes,
            sync_errors,
            skipped,
            map_entries,
            map_capacity,
        }
    }

    /// Records a sync of `duration` and the maps' fill: `entries` is (frontends with VIP
    /// markers, slots, backends, names).
    pub fn synced(&self, duration: Duration, entries: (usize, usize, usize, usize), cap: Capacity) {
        self.sync_duration.observe(duration.as_secs_f64());
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_sync.set(now.as_secs_f64());
        for (name, used, limit) in [
            ("FRONTENDS", entries.0, cap.frontends),
            ("BACKEND_SLOTS", entries.1, cap.slots),
            ("BACKENDS", entries.2, cap.backends),
            ("SERVICE_NAMES", entries.3, cap.services),
        ] {
            self.map_entries
                .get_or_create(&[("map", name)])
                .set(used as i64);
            self.map_capacity
                .get_or_create(&[("map", name)])
                .set(limit as i64);
        }
    }

    /// Text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Seconds from an EndpointSlice's `endpoints.kubernetes.io/last-change-trigger-time`
/// annotation (RFC 3339) to `now`; `None` when absent, unparseable or in the future.
pub fn programming_latency(annotation: Option<&str>, now: SystemTime) -> Option<f64> {
    let t = humantime::parse_rfc3339_weak(annotation?).ok()?;
    now.duration_since(t).ok().map(|d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kube_proxy_names_are_exposed() {
        let m = Metrics::new(PathBuf::from("/nonexistent"));
        m.endpoint_changes.inc();
        m.synced(
            Duration::from_millis(3),
            (0, 0, 0, 0),
            Capacity {
                frontends: 1,
                slots: 2,
                backends: 3,
                services: 4,
            },
        );
        let text = m.encode();
        for name in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_network_programming_duration_seconds_count",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 1",
            "kubeproxy_sync_proxy_rules_service_changes_total 0",
            "ebpf_proxy_map_capacity{map=\"BACKENDS\"} 3",
        ] {
            assert!(text.contains(name), "{name} missing in\n{text}");
        }
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
}
