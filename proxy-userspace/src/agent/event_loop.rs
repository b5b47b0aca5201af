//! The event loop: what wakes the agent (a batch, a timer, the attached programs, the stop)
//! and how a batch is read into the model and the next sync scheduled.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use anyhow::Result;
use tokio::sync::mpsc;
use tracing::error;

use super::{Agent, Attaching, Event, clock};
use crate::{
    datapath::{Datapath, FlowCollection},
    metrics::Metrics,
    model::Model,
    reconcile::Reconciler,
    source::Batch,
    status::Health,
};

/// Completes with `attaching` once it is done; never when there is nothing to wait for.
async fn wait_attaching(attaching: &mut Option<Attaching>) -> Result<()> {
    match attaching {
        Some(a) => a.await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl<D: Datapath + FlowCollection> Agent<D> {
    /// An agent over `dp`, starting from what `reconciler` adopted. `min_period` paces the
    /// syncs (`--min-sync-period` for the API source, 0 for manifests); `source_label`
    /// names the source in metrics.
    pub fn new(
        model: Model,
        reconciler: Reconciler,
        dp: D,
        metrics: Arc<Metrics>,
        health: Arc<Mutex<Health>>,
        source_label: &'static str,
        min_period: Duration,
    ) -> Self {
        Agent {
            model,
            reconciler,
            dp,
            metrics,
            health,
            source_label,
            min_period,
            synced: false,
            first_done: false,
            fresh_maps: false,
            reconcile_at: None,
            attaching: None,
            last_sync: None,
            first_received: None,
            source_errors: Vec::new(),
            logged_node_errors: BTreeSet::new(),
            collect_failed: false,
            pending_services: 0,
            pending_endpoints: 0,
            bypass: None,
            logged_bypass: BTreeSet::new(),
            close_connections: None,
            north_south: None,
        }
    }

    /// Programs the socket-level bypass through `bypass` from now on.
    pub fn set_bypass(&mut self, bypass: crate::datapath::bypass::BypassKernel) {
        self.bypass = Some(bypass);
    }

    /// `--close-connections-to-removed-endpoints`: after each sync, the TCP connections
    /// the socket programs translated to an endpoint that left its Service are closed (see
    /// [`Agent::close_removed`]); `dir` is the pin directory.
    pub fn with_close_connections(mut self, dir: Option<std::path::PathBuf>) -> Self {
        self.close_connections = dir;
        self
    }

    /// Waits for `attaching` (the programs' verification and attachment, run elsewhere)
    /// before the first sync; its error ends [`Agent::run`].
    pub fn with_attaching(
        mut self,
        attaching: impl std::future::Future<Output = Result<()>> + Send + 'static,
    ) -> Self {
        self.attaching = Some(Box::pin(attaching));
        self
    }

    /// Whether the programs are attached (nothing was waited for, or it succeeded; false
    /// after the failure that ended [`Agent::run`]).
    pub fn attached(&self) -> bool {
        self.attaching.is_none()
    }

    /// Tells the agent that this run created the pinned maps (they hold nothing of an
    /// earlier agent's), which spares the first pass its verification.
    pub fn with_fresh_maps(mut self, fresh: bool) -> Self {
        self.fresh_maps = fresh;
        self
    }

    /// Publishes the north-south path's state there after every sync (the status server
    /// reads it).
    pub fn with_north_south(mut self, ns: Arc<Mutex<crate::status::NorthSouth>>) -> Self {
        self.north_south = Some(ns);
        self
    }

    /// Runs the event loop until `stop` completes; verifies every `sync_period`, collects
    /// ended least-connections flows every `collect_every`.
    pub async fn run(
        &mut self,
        mut rx: mpsc::Receiver<Batch>,
        sync_period: Duration,
        collect_every: Duration,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<()> {
        let mut verify = tokio::time::interval(sync_period);
        verify.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        verify.tick().await;
        let mut collect = tokio::time::interval(collect_every);
        collect.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            let retry_at = self
                .reconciler
                .next_retry()
                .map(tokio::time::Instant::from_std);
            let ready = self.attaching.is_none();
            let event = tokio::select! {
                r = wait_attaching(&mut self.attaching) => {
                    // On failure it stays pending: the caller removes what it pinned.
                    r?;
                    self.attaching = None;
                    continue;
                }
                b = rx.recv() => match b {
                    Some(b) => Event::Batch(b),
                    None => Event::SourceClosed,
                },
                _ = sleep_until_opt(self.reconcile_at.filter(|_| ready)) => Event::Reconcile,
                _ = verify.tick() => Event::Verify,
                _ = sleep_until_opt(retry_at.filter(|_| self.first_done)) => Event::Retry,
                _ = collect.tick() => Event::Collect,
                _ = &mut stop => Event::Stop,
            };
            match event {
                Event::Batch(b) => {
                    self.read(b);
                    // Read every batch already queued: a burst becomes one sync.
                    while let Ok(b) = rx.try_recv() {
                        self.read(b);
                    }
                    self.schedule();
                    // A sync due now runs now: tokio's timers round a deadline up to the
                    // next millisecond tick, which would add up to 1 ms to every change.
                    if self.attaching.is_none()
                        && self
                            .reconcile_at
                            .is_some_and(|at| at <= tokio::time::Instant::now())
                    {
                        self.reconcile();
                    }
                }
                other => {
                    if let Some(end) = self.handle(other) {
                        return end;
                    }
                }
            }
        }
    }

    /// Handles one event other than a batch; `Some` ends the loop.
    pub fn handle(&mut self, event: Event) -> Option<Result<()>> {
        match event {
            Event::Batch(b) => {
                self.read(b);
                self.schedule();
            }
            Event::SourceClosed => return Some(Err(anyhow::anyhow!("the object source stopped"))),
            Event::Reconcile => self.reconcile(),
            Event::Verify => self.verify(),
            Event::Retry => {
                let out = self.reconciler.retry(&mut self.dp, &self.model, clock());
                self.report(&out);
                self.after_sync(&out);
            }
            Event::Collect => self.collect(),
            Event::Stop => return Some(Ok(())),
        }
        None
    }

    /// When the next sync is due (changes are waiting and the pacing allows it).
    #[cfg(test)]
    pub fn reconcile_at(&self) -> Option<tokio::time::Instant> {
        self.reconcile_at
    }

    /// Reads a batch into the model.
    fn read(&mut self, b: Batch) {
        if !b.changes.is_empty() {
            self.first_received = Some(
                self.first_received
                    .map_or(b.received, |t| t.min(b.received)),
            );
            self.health
                .lock()
                .unwrap()
                .queued
                .get_or_insert_with(SystemTime::now);
            self.metrics.queued();
        }
        for c in b.changes {
            match &c {
                crate::source::Change::Apply(crate::source::Object::Service(_))
                | crate::source::Change::Delete(crate::source::Kind::Service, _) => {
                    self.pending_services += 1
                }
                crate::source::Change::Apply(crate::source::Object::EndpointSlice(_))
                | crate::source::Change::Delete(crate::source::Kind::EndpointSlice, _) => {
                    self.pending_endpoints += 1
                }
                _ => {}
            }
            self.model.apply(c);
        }
        self.metrics
            .kube_proxy
            .service_changes_pending
            .set(self.pending_services);
        self.metrics
            .kube_proxy
            .endpoint_changes_pending
            .set(self.pending_endpoints);
        // The Node object is read at once: /healthz follows it without waiting for a sync.
        self.health.lock().unwrap().node_eligible = self.model.node().eligible();
        if let Some(errors) = b.errors {
            // Each skipped file or object is reported once while it stays bad.
            let old: BTreeSet<String> =
                self.source_errors.iter().map(ToString::to_string).collect();
            for e in &errors {
                if !old.contains(&e.to_string()) {
                    error!("{e}");
                }
            }
            self.source_errors = errors;
            self.update_skipped();
        }
        if b.synced && !self.synced {
            self.synced = true;
        }
        // A reconcile is due once the view is complete (the first one always).
        if self.synced && (self.first_received.is_some() || !self.first_done) {
            self.reconcile_at
                .get_or_insert_with(tokio::time::Instant::now);
        }
    }

    /// Delays the due reconcile to `--min-sync-period` after the last one.
    fn schedule(&mut self) {
        if let (Some(at), Some(last)) = (self.reconcile_at, self.last_sync) {
            self.reconcile_at = Some(at.max(last + self.min_period));
        }
    }
}
