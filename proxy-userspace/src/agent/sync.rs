//! A sync and what follows it: committing the model, programming the data path (all of it
//! the first time), verifying, and the health, metrics and logs after each reconciler call.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant, SystemTime},
};

use tracing::{debug, error, info, warn};

use super::{Agent, clock};
use crate::{
    datapath::{Datapath, FlowCollection, ServiceMaps},
    model::{Delta, Protocol, Scope, ServicePortKey},
    reconcile::Outcome,
};

impl<D: Datapath + FlowCollection> Agent<D> {
    /// Programs the pods that bypass socket-level translation; `recheck` looks every pod
    /// up again (a verification).
    fn sync_bypass(&mut self, recheck: bool) {
        let errors: BTreeSet<String> = self.model.bypass().errors().into_iter().collect();
        for e in errors.difference(&self.logged_bypass) {
            warn!("{e}");
        }
        self.logged_bypass = errors;
        if let Some(b) = self.bypass.as_mut() {
            for e in b.sync(&self.model.bypassed(), recheck) {
                error!("{e}");
            }
        }
    }

    pub(super) fn update_skipped(&self) {
        self.metrics
            .skipped
            .set((self.model.error_count() + self.source_errors.len()) as i64);
    }

    /// Commits the model and programs what changed (everything, the first time).
    pub(super) fn reconcile(&mut self) {
        self.reconcile_at = None;
        let model_start = Instant::now();
        let delta = self.model.commit();
        let model_us = model_start.elapsed().as_micros() as u64;
        self.log_model_errors(&delta);
        let now = clock();
        // The TCP Service ports whose connections may have lost their endpoint, with their
        // ids taken before the sync (a removed port's id is gone after it). The first pass
        // looks at every port (endpoints may have left while no agent ran).
        let closing: Vec<(ServicePortKey, u32)> = match &self.close_connections {
            Some(_) if self.first_done => self.tcp_ports(delta.ports.iter()),
            _ => Vec::new(),
        };
        let first_pass = !self.first_done;
        let out = if self.first_done {
            self.reconciler
                .apply(&mut self.dp, &self.model, &delta, now)
        } else {
            self.first_pass(now)
        };
        self.report(&out);
        if self.close_connections.is_some() {
            let closing = if first_pass {
                self.tcp_ports(self.model.ports().keys())
            } else {
                closing
            };
            self.close_removed(closing);
        }
        let latency = self.record_sync(&delta);
        let (frontends, _, backends, _) = self.reconciler.services.entry_counts();
        info!(
            services = self.model.ports().len(),
            frontends,
            backends,
            writes = out.report.writes + out.repaired.writes,
            deletes = out.report.deletes + out.repaired.deletes,
            skipped = self.model.error_count() + self.source_errors.len(),
            failed = self.reconciler.failed().len(),
            duration_us = out.duration.as_micros() as u64,
            model_us,
            latency_us = latency.map(|l| l.as_micros() as u64).unwrap_or(0),
            "sync done"
        );
        self.after_sync(&out);
        self.sync_bypass(false);
    }

    /// The TCP ports among `keys`, each with its service id (ports without one left out).
    fn tcp_ports<'a>(
        &self,
        keys: impl Iterator<Item = &'a ServicePortKey>,
    ) -> Vec<(ServicePortKey, u32)> {
        keys.filter(|k| k.protocol == Protocol::Tcp)
            .filter_map(|k| Some((k.clone(), self.reconciler.services.id_of(k)?)))
            .collect()
    }

    /// The first full pass: every Service port written, and (over adopted maps) the entries
    /// nothing claims removed.
    fn first_pass(&mut self, now: Instant) -> Outcome {
        let services = self.model.ports().len();
        if services == 0 && self.reconciler.services.bound() > 0 {
            warn!(
                services = self.reconciler.services.bound(),
                "the source holds no Services: removing every Service from the data path"
            );
        }
        let mut out = self.reconciler.apply_all(&mut self.dp, &self.model, now);
        // Entries nothing claims (left by an earlier agent) go now.
        if !self.fresh_maps {
            let v = self.reconciler.verify(&mut self.dp, &self.model, now);
            out.repaired.add(v.repaired);
            out.failed.extend(v.failed);
        }
        self.first_done = true;
        crate::give_back_heap();
        out
    }

    /// The sync's time, its latency from the oldest change it programmed (returned) and
    /// kube-proxy's change counts, in the metrics.
    fn record_sync(&mut self, delta: &Delta) -> Option<Duration> {
        let done = Instant::now();
        self.last_sync = Some(tokio::time::Instant::now());
        let latency = self
            .first_received
            .take()
            .map(|t| done.saturating_duration_since(t));
        if let Some(l) = latency {
            self.metrics
                .change_latency
                .get_or_create(&[("source", self.source_label)])
                .observe(l.as_secs_f64());
        }
        let now_sys = SystemTime::now();
        let kp = &self.metrics.kube_proxy;
        for (family, t) in &delta.trigger_times {
            if let Some(lat) = crate::metrics::programming_latency(Some(t), now_sys) {
                kp.network_programming
                    .get_or_create(&[("ip_family", family.as_str())])
                    .observe(lat);
            }
        }
        kp.service_changes.inc_by(delta.service_changes);
        kp.endpoint_changes.inc_by(delta.endpoint_changes);
        self.pending_services = 0;
        self.pending_endpoints = 0;
        kp.service_changes_pending.set(0);
        kp.endpoint_changes_pending.set(0);
        latency
    }

    /// Health and metrics after a reconciler call.
    pub(super) fn after_sync(&mut self, out: &Outcome) {
        {
            let mut h = self.health.lock().unwrap();
            if self.first_done {
                h.last_updated = Some(SystemTime::now());
            }
            // A failed Service port is an update not applied: it keeps /healthz's clock
            // running until it is.
            if self.reconciler.failed().is_empty() {
                h.queued = None;
            } else if h.queued.is_none() {
                h.queued = Some(SystemTime::now());
            }
        }
        let failed = self.reconciler.failed().len();
        self.metrics
            .service_ports
            .get_or_create(&[("status", "failed")])
            .set(failed as i64);
        self.metrics
            .service_ports
            .get_or_create(&[("status", "applied")])
            .set(self.model.ports().len().saturating_sub(failed) as i64);
        if !out.failed.is_empty() {
            self.metrics.sync_errors.inc();
        }
        self.kube_proxy_metrics(out);
        self.metrics.synced(
            out.duration,
            self.reconciler.failed().is_empty(),
            self.reconciler.services.entry_counts(),
            ServiceMaps::capacity(&self.dp),
        );
        self.update_skipped();
        let node_errors = self.reconciler.node.errors();
        for e in node_errors.difference(&self.logged_node_errors) {
            error!("{e}");
        }
        self.logged_node_errors = node_errors;
        if let Some(ns) = &self.north_south {
            *ns.lock().unwrap() = self.reconciler.node.north_south();
        }
    }

    /// kube-proxy's per-sync families after a reconciler call: sync and cleanup failures
    /// by family, the release of removed UDP backends (its conntrack reconciler), and the
    /// Local-policy Service ports without a local endpoint.
    fn kube_proxy_metrics(&self, out: &Outcome) {
        let kp = &self.metrics.kube_proxy;
        let failed_services: BTreeSet<&str> = out.failed.iter().map(|(s, _)| s.as_str()).collect();
        let failed_families: BTreeSet<crate::model::Family> = self
            .reconciler
            .failed()
            .keys()
            .filter(|k| failed_services.contains(format!("{}/{}", k.namespace, k.name).as_str()))
            .map(|k| k.family)
            .collect();
        for f in failed_families {
            kp.sync_failures
                .get_or_create(&[("ip_family", f.as_str())])
                .inc();
        }
        for f in &self.metrics.families {
            let l = [("ip_family", f.as_str())];
            let released = out.released_by_family.iter().find(|(rf, _, _)| rf == f);
            let took = released.map_or(0.0, |(_, _, d)| d.as_secs_f64());
            kp.conntrack_reconcile.get_or_create(&l).observe(took);
            match released {
                Some((_, Ok(r), _)) => {
                    kp.conntrack_deleted
                        .get_or_create(&l)
                        .inc_by((r.flows + r.sockets) as u64);
                }
                Some((_, Err(_), _)) => {
                    kp.cleanup_failures.get_or_create(&l).inc();
                }
                None => {}
            }
        }
        let mut none_local: std::collections::BTreeMap<(crate::model::Family, &str), i64> =
            std::collections::BTreeMap::new();
        for (k, d) in self.model.ports() {
            if !d.no_local_endpoints {
                continue;
            }
            let policy = match k.scope {
                Scope::Internal => "internal",
                Scope::Ingress => "external",
                Scope::External => continue,
            };
            *none_local.entry((k.family, policy)).or_default() += 1;
        }
        for f in &self.metrics.families {
            for policy in ["internal", "external"] {
                kp.no_local_endpoints
                    .get_or_create(&[("ip_family", f.as_str()), ("traffic_policy", policy)])
                    .set(none_local.get(&(*f, policy)).copied().unwrap_or(0));
            }
        }
    }

    fn log_model_errors(&mut self, delta: &Delta) {
        for e in &delta.errors_added {
            error!("{e}");
        }
        for e in &delta.errors_removed {
            debug!("no longer skipped: {e}");
        }
    }

    /// Logs what a reconciler call did that an operator needs to know.
    pub(super) fn report(&self, out: &Outcome) {
        for (service, e) in &out.failed {
            error!(service = %service, error = %e, "Service not applied; the data path keeps its previous state for it and retries");
        }
        for service in &out.recovered {
            info!(service = %service, "Service applied after an earlier failure");
        }
        if out.repaired.writes + out.repaired.deletes > 0 && self.first_done {
            warn!(
                writes = out.repaired.writes,
                deletes = out.repaired.deletes,
                "verification repaired map entries changed outside the agent"
            );
        }
        match &out.released {
            Some(Ok(r)) => info!(
                endpoints = out.report.released.len(),
                udp_flows = r.flows,
                connected_udp_sockets = r.sockets,
                "released UDP flows and sockets of removed endpoints"
            ),
            Some(Err(e)) => error!(error = %e, "releasing UDP flows of removed endpoints failed"),
            None => {}
        }
    }

    /// The periodic verification.
    pub(super) fn verify(&mut self) {
        if !self.first_done {
            return;
        }
        let out = self.reconciler.verify(&mut self.dp, &self.model, clock());
        crate::give_back_heap();
        self.report(&out);
        self.after_sync(&out);
        self.sync_bypass(true);
    }

    pub(super) fn collect(&mut self) {
        match self.dp.collect_lc_flows() {
            Ok(n) => {
                if n > 0 {
                    debug!(
                        flows = n,
                        "least-connections counts of ended tc flows given back"
                    );
                }
                self.collect_failed = false;
            }
            // Logged once while it lasts; the counts of ended flows stay until it works.
            Err(e) => {
                if !self.collect_failed {
                    error!(error = %format!("{e:#}"), "collecting ended least-connections tc flows failed");
                }
                self.collect_failed = true;
            }
        }
    }
}
