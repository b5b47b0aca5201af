//! Prometheus metrics (prometheus-client): every family kube-proxy registers in its nftables
//! mode ([`KubeProxyMetrics`], `pkg/proxy/metrics/metrics.go` and the health server's
//! counters), fed with the same meaning, and the agent's own under `ebpf_proxy_`.
//!
//! Cardinality: kube-proxy's families and the agent's first ones are unlabelled or labelled
//! by a fixed set (IP family, status code, map name, data path reason); the per-service and
//! per-backend series are bounded by the map sizes.

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

use crate::datapath::{Capacity, view::PinnedView};
use crate::model::Family as ModelFamily;

/// Label set `{map="FRONTENDS"}`.
pub type MapLabel = [(&'static str, &'static str); 1];
/// Label set `{ip_family="IPv4"}` (kube-proxy's per-family proxiers: `IPv4`, `IPv6`).
pub type IpFamilyLabel = [(&'static str, &'static str); 1];
/// Label set `{code="200"}`.
pub type CodeLabel = [(&'static str, &'static str); 1];
/// Label set `{ip_family="IPv4", traffic_policy="internal"}`.
pub type PolicyLabels = [(&'static str, &'static str); 2];

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// `kubeproxy_sync_proxy_rules_duration_seconds` buckets: `ExponentialBuckets(0.001, 2, 15)`.
fn sync_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// `kubeproxy_network_programming_duration_seconds` buckets: component-base's
/// `MergeBuckets` (a leading 0) of 0.25 s, 0.5 s; 1 s to 59 s by 1 s; 60 s to 115 s by 5 s;
/// 120 s to 300 s by 30 s.
fn programming_buckets() -> Histogram {
    let mut b = vec![0.0, 0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * i as f64));
    b.extend((0..7).map(|i| 120.0 + 30.0 * i as f64));
    Histogram::new(b)
}

/// kube-proxy's metric families (`pkg/proxy/metrics/metrics.go`), as its nftables mode
/// registers them, with their names, types, labels, help texts (with component-base's
/// `[ALPHA] ` prefix) and buckets. Encoded by hand ([`Collector`]) so the help text is
/// kube-proxy's exactly (the registry would append a period).
#[derive(Debug, Clone)]
pub struct KubeProxyMetrics {
    /// `kubeproxy_sync_proxy_rules_duration_seconds{ip_family}`: time of one sync (the map
    /// writes of the changes, or a verification), observed for each family the node runs
    /// (ebpf-proxy syncs both at once; kube-proxy runs one proxier per family).
    pub sync_duration: HistogramFamily<IpFamilyLabel>,
    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family}`: Unix time of the last
    /// sync that left no Service port failed.
    pub last_sync: Family<IpFamilyLabel, Gauge<f64, AtomicU64>>,
    /// `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family}`: Unix time a
    /// change last asked for a sync.
    pub last_queued: Family<IpFamilyLabel, Gauge<f64, AtomicU64>>,
    /// `kubeproxy_network_programming_duration_seconds{ip_family}`: from an EndpointSlice's
    /// `endpoints.kubernetes.io/last-change-trigger-time` to the data path applying it; the
    /// family of the slice's `addressType`.
    pub network_programming: HistogramFamily<IpFamilyLabel>,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_pending`: EndpointSlice changes read
    /// but not yet programmed.
    pub endpoint_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_total`: EndpointSlice changes that read
    /// differently from before.
    pub endpoint_changes: Counter,
    /// `kubeproxy_sync_proxy_rules_service_changes_pending`: Service changes read but not
    /// yet programmed.
    pub service_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_service_changes_total`: Service changes that read
    /// differently from before.
    pub service_changes: Counter,
    /// `kubeproxy_proxy_healthz_total{code}`: `/healthz` answers by status code.
    pub healthz: Family<CodeLabel, Counter>,
    /// `kubeproxy_proxy_livez_total{code}`: `/livez` answers by status code.
    pub livez: Family<CodeLabel, Counter>,
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family, traffic_policy}`:
    /// Service ports with a Local policy (`internal`: `internalTrafficPolicy`, `external`:
    /// `externalTrafficPolicy` of a port with external frontends) and endpoints, none on
    /// this node.
    pub no_local_endpoints: Family<PolicyLabels, Gauge>,
    /// `kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family}`: syncs that left
    /// a Service port of that family failed (kube-proxy: a failed nft transaction).
    pub sync_failures: Family<IpFamilyLabel, Counter>,
    /// `kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total{ip_family}`: failures to
    /// release the state of removed endpoints (kube-proxy: stale chain cleanup).
    pub cleanup_failures: Family<IpFamilyLabel, Counter>,
    /// `kubeproxy_conntrack_reconciler_sync_duration_seconds{ip_family}`: per sync, the time
    /// spent forgetting the UDP flows (and marking the connected UDP sockets stale) of
    /// removed endpoints, ebpf-proxy's counterpart of kube-proxy's conntrack cleanup.
    pub conntrack_reconcile: HistogramFamily<IpFamilyLabel>,
    /// `kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family}`: UDP flows
    /// forgotten and connected UDP sockets marked stale.
    pub conntrack_deleted: Family<IpFamilyLabel, Counter>,
}

impl KubeProxyMetrics {
    fn new(families: &[ModelFamily]) -> Self {
        let m = KubeProxyMetrics {
            sync_duration: Family::new_with_constructor(sync_buckets),
            last_sync: Family::default(),
            last_queued: Family::default(),
            network_programming: Family::new_with_constructor(programming_buckets),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes: Counter::default(),
            healthz: Family::default(),
            livez: Family::default(),
            no_local_endpoints: Family::default(),
            sync_failures: Family::default(),
            cleanup_failures: Family::default(),
            conntrack_reconcile: Family::new_with_constructor(sync_buckets),
            conntrack_deleted: Family::default(),
        };
        // Every series of the node's families exists from the start (at zero), so
        // dashboards and alerts see them before the first event.
        for f in families {
            let l = [("ip_family", f.as_str())];
            let _ = m.sync_duration.get_or_create(&l);
            let _ = m.last_sync.get_or_create(&l);
            let _ = m.last_queued.get_or_create(&l);
            let _ = m.network_programming.get_or_create(&l);
            let _ = m.sync_failures.get_or_create(&l);
            let _ = m.cleanup_failures.get_or_create(&l);
            let _ = m.conntrack_reconcile.get_or_create(&l);
            let _ = m.conntrack_deleted.get_or_create(&l);
            for policy in ["internal", "external"] {
                let _ = m
                    .no_local_endpoints
                    .get_or_create(&[("ip_family", f.as_str()), ("traffic_policy", policy)]);
            }
        }
        m
    }
}

impl Collector for KubeProxyMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        fn one(
            encoder: &mut DescriptorEncoder,
            name: &str,
            help: &str,
            m: &impl EncodeMetric,
        ) -> Result<(), std::fmt::Error> {
            let e = encoder.encode_descriptor(name, help, None, m.metric_type())?;
            m.encode(e)
        }
        let e = &mut encoder;
        one(
            e,
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "[ALPHA] SyncProxyRules latency in seconds",
            &self.sync_duration,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "[ALPHA] The last time a sync of proxy rules was queued",
            &self.last_queued,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "[ALPHA] The last time proxy rules were successfully synced",
            &self.last_sync,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "[ALPHA] Pending proxy rules Endpoint changes",
            &self.endpoint_changes_pending,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "[ALPHA] Cumulative proxy rules Endpoint changes",
            &self.endpoint_changes,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "[ALPHA] Pending proxy rules Service changes",
            &self.service_changes_pending,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_service_changes",
            "[ALPHA] Cumulative proxy rules Service changes",
            &self.service_changes,
        )?;
        one(
            e,
            "kubeproxy_proxy_healthz",
            "[ALPHA] Cumulative proxy healthz HTTP status",
            &self.healthz,
        )?;
        one(
            e,
            "kubeproxy_proxy_livez",
            "[ALPHA] Cumulative proxy livez HTTP status",
            &self.livez,
        )?;
        one(
            e,
            "kubeproxy_network_programming_duration_seconds",
            "[ALPHA] In Cluster Network Programming Latency in seconds",
            &self.network_programming,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "[ALPHA] Number of services with a Local traffic policy and no endpoints",
            &self.no_local_endpoints,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "[ALPHA] Cumulative proxy nftables sync failures",
            &self.sync_failures,
        )?;
        one(
            e,
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
            "[ALPHA] Cumulative proxy nftables cleanup failures",
            &self.cleanup_failures,
        )?;
        one(
            e,
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "[ALPHA] ReconcileConntrackFlowsLatency latency in seconds",
            &self.conntrack_reconcile,
        )?;
        one(
            e,
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "[ALPHA] Cumulative conntrack flows deleted by conntrack reconciler",
            &self.conntrack_deleted,
        )?;
        Ok(())
    }
}

/// The agent's metrics. Cheap to update; encoded on each scrape of `/metrics`.
#[derive(Debug)]
pub struct Metrics {
    /// Registry holding everything below.
    pub registry: Registry,
    /// The IP families the node runs (the `ip_family` label values).
    pub families: Vec<ModelFamily>,
    /// kube-proxy's families.
    pub kube_proxy: KubeProxyMetrics,
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
    /// `ebpf_proxy_connections_closed_total`: TCP connections closed because their endpoint
    /// left the Service (`--close-connections-to-removed-endpoints`).
    pub connections_closed: Counter,
}

/// Reads the data path's per-CPU counters at scrape time (`ebpf_proxy_datapath_events_total`
/// with label `reason`, see `proxy_common::Counter`).
#[derive(Debug)]
struct DatapathCounters {
    view: PinnedView,
}

impl Collector for DatapathCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(values) = self.view.counters() else {
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
        if let Ok(values) = self.view.tc_counters() {
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
        {
            // One series per interface with the north-south programs: the XDP mode it runs in
            // (`none`: the tcx programs alone). The family is declared also without
            // interfaces, so dashboards and alerts find it on every node.
            let xdp = self.view.xdp_modes();
            let ifaces = self.view.tc_interfaces();
            let mut family = encoder.encode_descriptor(
                "ebpf_proxy_interface_xdp",
                "Interfaces with the north-south programs, by the XDP mode each runs in (native, generic, or none: the tcx programs alone); always 1",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            for i in &ifaces {
                let mode = xdp.get(i).map_or("none", |m| m.as_str());
                let labels = [("interface", i.as_str()), ("mode", mode)];
                let m = family.encode_family(&labels)?;
                prometheus_client::metrics::gauge::ConstGauge::new(1i64).encode(m)?;
            }
        }
        self.encode_monitor(&mut encoder)?;
        self.encode_per_service(&mut encoder)
    }
}

impl DatapathCounters {
    /// The event stream of `ebpf-proxy monitor` (`MONITOR_CPU`, summed over CPUs): events
    /// emitted, events lost by cause, the data path's time spent emitting, and whether a
    /// monitor holds the lease.
    fn encode_monitor(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(t) = self.view.monitor_totals() else {
            return Ok(());
        };
        {
            let mut family = encoder.encode_descriptor(
                "ebpf_proxy_monitor_events",
                "Monitor events by outcome: emitted to the ring buffer, or dropped (rate_limited: over the per-CPU rate; ring_full: the monitor read too slowly), summed over CPUs",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (outcome, v) in [
                ("emitted", t.emitted),
                ("rate_limited", t.rate_limited),
                ("ring_full", t.ring_full),
            ] {
                let labels = [("outcome", outcome)];
                let m = family.encode_family(&labels)?;
                ConstCounter::new(v).encode(m)?;
            }
        }
        {
            let family = encoder.encode_descriptor(
                "ebpf_proxy_monitor_emit_seconds",
                "Time the data path spent emitting monitor events (the monitor's cost on the data path), summed over CPUs",
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            ConstCounter::new(t.emit_ns as f64 / 1e9).encode(family)?;
        }
        let active = self.view.monitor_lease_held().unwrap_or(false);
        let family = encoder.encode_descriptor(
            "ebpf_proxy_monitor_active",
            "1 while an `ebpf-proxy monitor` holds the event stream's lease (events are emitted), else 0",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        prometheus_client::metrics::gauge::ConstGauge::new(active as i64).encode(family)
    }

    /// Per service id and per backend counters, labelled from `SERVICE_NAMES` and
    /// `BACKENDS`. One series per service id (Service port x protocol x family x scope) and
    /// per backend (address x port x protocol): bounded by the map sizes.
    fn encode_per_service(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use crate::datapath::ServiceMaps;
        let Ok(maps) = self.view.service_maps() else {
            return Ok(());
        };
        let (Ok(snap), Ok(svc), Ok(be)) = (
            maps.snapshot(),
            self.view.service_stats(),
            self.view.backend_stats(),
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
        let active = self.view.lc_counts().unwrap_or_default();
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
    /// `families` are the IP families the node runs ([`node_families`]).
    pub fn new(pin_dir: PathBuf, families: Vec<ModelFamily>) -> Self {
        let mut registry = Registry::default();
        let kube_proxy = KubeProxyMetrics::new(&families);
        registry.register_collector(Box::new(kube_proxy.clone()));
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
        let connections_closed = Counter::default();
        registry.register(
            "ebpf_proxy_connections_closed",
            "TCP connections closed because their endpoint left the Service (--close-connections-to-removed-endpoints)",
            connections_closed.clone(),
        );
        registry.register_collector(Box::new(DatapathCounters {
            view: PinnedView::new(&pin_dir),
        }));
        Self {
            registry,
            families,
            kube_proxy,
            sync_errors,
            skipped,
            map_entries,
            map_capacity,
            change_latency,
            service_ports,
            connections_closed,
        }
    }

    /// Records a sync (or verification) of `duration`: observed for every family;
    /// `fully_applied` (no Service port left failed) moves the last-sync timestamp.
    /// `entries` is the maps' fill (frontends with VIP markers, slots, backends, names).
    pub fn synced(
        &self,
        duration: Duration,
        fully_applied: bool,
        entries: (usize, usize, usize, usize),
        cap: Capacity,
    ) {
        let now = unix_now();
        for f in &self.families {
            let l = [("ip_family", f.as_str())];
            self.kube_proxy
                .sync_duration
                .get_or_create(&l)
                .observe(duration.as_secs_f64());
            if fully_applied {
                self.kube_proxy.last_sync.get_or_create(&l).set(now);
            }
        }
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

    /// A change arrived that needs a sync: the last-queued timestamp of every family.
    pub fn queued(&self) {
        let now = unix_now();
        for f in &self.families {
            self.kube_proxy
                .last_queued
                .get_or_create(&[("ip_family", f.as_str())])
                .set(now);
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

/// Seconds since the Unix epoch.
fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// The IP families this node runs, as kube-proxy decides which proxiers to start: IPv4,
/// and IPv6 when the kernel has it (`/proc/net/if_inet6` exists).
pub fn node_families() -> Vec<ModelFamily> {
    let mut f = vec![ModelFamily::V4];
    if std::path::Path::new("/proc/net/if_inet6").exists() {
        f.push(ModelFamily::V6);
    }
    f
}

/// Seconds from an EndpointSlice's `endpoints.kubernetes.io/last-change-trigger-time`
/// annotation (RFC 3339) to `now`; `None` when absent, unparseable or in the future.
pub fn programming_latency(annotation: Option<&str>, now: SystemTime) -> Option<f64> {
    let t = humantime::parse_rfc3339_weak(annotation?).ok()?;
    now.duration_since(t).ok().map(|d| d.as_secs_f64())
}

#[cfg(test)]
mod tests;
