//! The node agent (`ebpf-proxy run`): loads and attaches the data path, follows a source of
//! changes into the model, and has the reconciler program every change, in one typed event
//! loop.
//!
//! Events ([`Event`]):
//! - **Batch**: a source's changes. They are read into the model at once; the model is
//!   committed and the changes programmed when the source's view is complete and
//!   `--min-sync-period` allows (API source: an isolated change after a quiet period goes
//!   out at once, the next no sooner than the period after the last sync; manifests: at
//!   once). Batches that queued meanwhile are all read first, so a burst is one sync.
//! - **Verify** (every `--sync-period`): the reconciler compares the maps with what it
//!   applied and repairs them, re-evaluates interfaces and retries health-check ports.
//! - **Retry**: failed Service ports whose backoff expired.
//! - **Collect**: least-connections counts of tc flows that ended without a FIN or RST.
//! - **Stop** (SIGTERM, Ctrl-C): the data path stays attached and pinned for the next agent.
//!
//! Health as kube-proxy's healthz server reports it (`pkg/proxy/healthcheck`): healthy once
//! a sync succeeded, unless an update (or a failed Service port) has been pending for longer
//! than twice `--sync-period`.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use proxy_common::Config;
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::{
    config::{AgentConfig, NodePortAddresses, SourceChoice},
    datapath::{
        Datapath, FlowCollection, ServiceMaps,
        kernel::KernelDatapath,
        loader::{self, MapSizes},
        maps::PinnedMaps,
        tc::TcKernel,
    },
    healthcheck::HealthCheckServers,
    metrics::Metrics,
    model::{Delta, Model, NodeInfo},
    reconcile::{NodeConfig, Outcome, Reconciler},
    source::{Batch, KubeSource, ManifestSource, Source, SourceError},
};

/// What the loop reacts to.
#[derive(Debug)]
pub enum Event {
    /// A batch of changes from the source.
    Batch(Batch),
    /// The source stopped for good.
    SourceClosed,
    /// Time to program what the model holds.
    Reconcile,
    /// Time to verify and repair.
    Verify,
    /// Time to retry failed Service ports.
    Retry,
    /// Time to collect ended least-connections flows.
    Collect,
    /// SIGTERM or Ctrl-C.
    Stop,
}

/// What `/healthz` reports.
#[derive(Debug)]
pub struct Health {
    /// Time of the last successful sync; `None` until the first one.
    pub last_updated: Option<SystemTime>,
    /// When the oldest update not yet applied arrived; `None` when none is pending.
    pub queued: Option<SystemTime>,
    /// How long an update may stay pending before /healthz fails.
    pub timeout: Duration,
}

impl Health {
    /// Healthy at `now`?
    pub fn healthy(&self, now: SystemTime) -> bool {
        self.last_updated.is_some()
            && self
                .queued
                .is_none_or(|q| now.duration_since(q).unwrap_or_default() < self.timeout)
    }
}

async fn healthz(
    axum::extract::State(h): axum::extract::State<Arc<Mutex<Health>>>,
) -> (axum::http::StatusCode, axum::Json<serde_json::Value>) {
    let now = SystemTime::now();
    let (last, healthy) = {
        let h = h.lock().unwrap();
        (h.last_updated, h.healthy(now))
    };
    let fmt = |t: SystemTime| humantime::format_rfc3339_millis(t).to_string();
    let body = serde_json::json!({
        "lastUpdated": last.map(fmt).unwrap_or_default(),
        "currentTime": fmt(now),
    });
    let code = if healthy {
        axum::http::StatusCode::OK
    } else {
        axum::http::StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body))
}

async fn metrics_handler(
    axum::extract::State(m): axum::extract::State<Arc<Metrics>>,
) -> impl axum::response::IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
}

/// Serves `app` on a bound listener in the background; returns its address.
fn serve(
    what: &'static str,
    listener: std::net::TcpListener,
    app: axum::Router,
) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let local = listener.local_addr()?;
    info!(address = %local, "{what} server listening");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            error!(error = %e, "{what} server stopped");
        }
    });
    Ok(local)
}

/// The Kubernetes API configuration (`--kubeconfig`, else `Config::infer`: KUBECONFIG,
/// ~/.kube/config, in-cluster); `None` with `--manifests`. Resolved before the data path is
/// touched, so a missing or broken configuration changes nothing.
async fn kube_config(source: &SourceChoice) -> Result<Option<kube::Config>> {
    let SourceChoice::Api(kubeconfig) = source else {
        return Ok(None);
    };
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| {
            anyhow::anyhow!(
                "no usable Kubernetes API configuration ({e}); pass --kubeconfig or --manifests, set KUBECONFIG, or run in a pod"
            )
        })?,
    };
    Ok(Some(config))
}

fn start_source(
    source: &SourceChoice,
    node: &str,
    config: Option<kube::Config>,
) -> Result<mpsc::Receiver<Batch>> {
    match (source, config) {
        (SourceChoice::Manifests(dir), _) => {
            info!(dir = %dir.display(), "source: manifests");
            ManifestSource::new(dir).start()
        }
        (SourceChoice::Api(_), Some(config)) => {
            info!(server = %config.cluster_url, "source: Kubernetes API");
            let client = kube::Client::try_from(config).context("create the Kubernetes client")?;
            KubeSource::new(client, node).start()
        }
        (SourceChoice::Api(_), None) => anyhow::bail!("no Kubernetes API configuration"),
    }
}

/// The preflight checks of `run` (without the program probes: the load that follows reports
/// its own failures with the step); a failure stops start-up with the message `check` prints.
fn preflight(config: &AgentConfig) -> Result<()> {
    let results = crate::check::run_checks(&crate::check::Options {
        bpffs: config.pins.bpffs.clone(),
        mount_bpffs: true,
        cgroup: config.cgroup_path.clone(),
        probe_programs: false,
    });
    for r in &results {
        match r.status {
            crate::check::Status::Ok => debug!(check = r.check, "preflight: {}", r.detail),
            crate::check::Status::Warn | crate::check::Status::Skip => {
                warn!("preflight: {}", r.message())
            }
            crate::check::Status::Fail => {}
        }
    }
    let failures: Vec<String> = results
        .iter()
        .filter(|r| r.status == crate::check::Status::Fail)
        .map(|r| r.message())
        .collect();
    if !failures.is_empty() {
        anyhow::bail!("preflight check failed: {}", failures.join("; "));
    }
    Ok(())
}

/// The model's node configuration from the agent's settings.
pub fn node_info(config: &AgentConfig) -> NodeInfo {
    let (nodeport_addresses, nodeport_primary) = match &config.nodeport_addresses {
        None => (Vec::new(), false),
        Some(NodePortAddresses::Primary) => (Vec::new(), true),
        Some(NodePortAddresses::Cidrs(c)) => (c.clone(), false),
    };
    NodeInfo {
        default_algorithm: config.lb_algorithm,
        nodeport_addresses,
        nodeport_primary,
        name: config.node_name(),
    }
}

/// Runs the agent until SIGTERM or Ctrl-C (see the module documentation).
pub fn run(config: AgentConfig) -> Result<()> {
    let node = node_info(&config);
    // Check every input before touching the data path, so a mistake changes nothing.
    let dir = config.pins.dir()?;
    match &config.source {
        SourceChoice::Manifests(m) => {
            std::fs::read_dir(m).with_context(|| {
                format!("--manifests {}: cannot read the directory", m.display())
            })?;
        }
        SourceChoice::Api(Some(k)) => {
            std::fs::metadata(k).with_context(|| format!("--kubeconfig {}", k.display()))?;
        }
        SourceChoice::Api(None) => {}
    }
    crate::datapath::tc::check_interfaces(&config.tc.interfaces)?;
    preflight(&config)?;
    let cgroup = match &config.cgroup_path {
        Some(p) => p.clone(),
        None => loader::cgroup2_root()?,
    };
    if !config.cluster_cidrs.is_empty() {
        let shown: Vec<String> = config
            .cluster_cidrs
            .iter()
            .map(ToString::to_string)
            .collect();
        info!(cluster_cidr = %shown.join(","), "cluster CIDR");
    }
    if let Some(n) = &config.nodeport_addresses {
        info!(nodeport_addresses = %n, "NodePort addresses");
    }
    let bind = |what: &str, addr: SocketAddr| -> Result<std::net::TcpListener> {
        let l = std::net::TcpListener::bind(addr)
            .with_context(|| format!("bind the {what} server to {addr}"))?;
        l.set_nonblocking(true)?;
        Ok(l)
    };
    let health_listener = bind("health", config.healthz_bind_address)?;
    let metrics_listener = bind("metrics", config.metrics_bind_address)?;
    let sizes = MapSizes {
        frontends: config.map_sizes.frontends,
        slots: config.map_sizes.slots,
        backends: config.map_sizes.backends,
        sockets: config.map_sizes.sockets,
        conntrack_flows: config.tc.conntrack_flows(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let kube = rt.block_on(kube_config(&config.source))?;
    let fresh = !dir.exists();
    let _lock = loader::lock_pin_dir(&dir)?;

    rt.block_on(async move {
        // Start-up: on failure, a pin directory this run created is removed again (one that
        // was adopted keeps serving the node).
        let started = async {
            loader::load_and_attach(&dir, &cgroup, sizes)?;
            info!(pin_dir = %dir.display(), cgroup = %cgroup.display(), node = %node.name, "data path attached");
            let dp = open_datapath(&dir, &config, sizes)?;
            let reconciler = Reconciler::adopt(
                &dp,
                NodeConfig {
                    interfaces: config.tc.interfaces.clone(),
                    snat_local: dp.tc.snat_local(),
                },
                config.sync_period,
            )
            .context("read the pinned maps")?;
            info!(services = reconciler.services.bound(), "adopted state from pinned maps");
            let rx = start_source(&config.source, &node.name, kube)?;
            anyhow::Ok((dp, reconciler, rx))
        }
        .await;
        let (dp, mut reconciler, rx) = match started {
            Ok(v) => v,
            Err(e) => {
                if fresh {
                    let _ = loader::cleanup(&dir);
                }
                return Err(e);
            }
        };
        reconciler.services.set_maglev_size(config.maglev_table_size);
        let health = Arc::new(Mutex::new(Health {
            last_updated: None,
            queued: None,
            timeout: config.sync_period.saturating_mul(2),
        }));
        let metrics = Arc::new(Metrics::new(dir.clone()));
        let health_app = axum::Router::new()
            .route("/healthz", axum::routing::get(healthz))
            .route("/livez", axum::routing::get(healthz))
            .with_state(health.clone());
        serve("health", health_listener, health_app)?;
        let metrics_app = axum::Router::new()
            .route("/metrics", axum::routing::get(metrics_handler))
            .with_state(metrics.clone());
        serve("metrics", metrics_listener, metrics_app)?;
        let source_label = match config.source {
            SourceChoice::Manifests(_) => "manifests",
            SourceChoice::Api(_) => "api",
        };
        let min_period = match config.source {
            SourceChoice::Manifests(_) => Duration::ZERO,
            SourceChoice::Api(_) => config.min_sync_period,
        };
        let mut agent = Agent::new(Model::new(node), reconciler, dp, metrics, health, source_label, min_period);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let stop = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        agent
            .run(
                rx,
                config.sync_period,
                crate::datapath::tc::lc_collect_interval(config.udp_flow_timeout),
                stop,
            )
            .await?;
        info!("stopping; the data path stays attached and pinned for the next agent (use `ebpf-proxy cleanup` to remove it)");
        Ok(())
    })
}

/// Opens the pinned maps and the tc part, writes the configurations, warns about adopted
/// maps that keep another size.
fn open_datapath(
    dir: &std::path::Path,
    config: &AgentConfig,
    sizes: MapSizes,
) -> Result<KernelDatapath> {
    let maps = PinnedMaps::open(dir).context("open the pinned maps")?;
    maps.write_config(&Config {
        udp_flow_timeout_ns: config.udp_flow_timeout.as_nanos().min(u64::MAX as u128) as u64,
        _reserved: 0,
    })?;
    let cap = maps.capacity();
    if cap.frontends != sizes.frontends
        || cap.slots != sizes.slots
        || cap.backends != sizes.backends
    {
        warn!(
            ?cap,
            "adopted pinned maps keep the sizes they were created with; run `ebpf-proxy cleanup` to resize"
        );
    }
    if let Ok(ct) = aya::maps::MapInfo::from_pin(dir.join(proxy_common::nat::CONNTRACK))
        && ct.max_entries() != sizes.conntrack_entries()
    {
        warn!(
            pinned_entries = ct.max_entries(),
            wanted_entries = sizes.conntrack_entries(),
            "the adopted north-south conntrack keeps the size it was created with; run `ebpf-proxy cleanup` to resize"
        );
    }
    let tc = TcKernel::new(
        dir,
        &config.tc,
        &config.cluster_cidrs,
        config.udp_flow_timeout,
    )?;
    Ok(KernelDatapath {
        maps,
        tc,
        health: HealthCheckServers::default(),
    })
}

/// The running agent's state, over any data path (the kernel's, or the in-memory fake in
/// tests).
pub struct Agent<D> {
    /// The model.
    pub model: Model,
    /// The reconciler.
    pub reconciler: Reconciler,
    /// The data path.
    pub dp: D,
    metrics: Arc<Metrics>,
    health: Arc<Mutex<Health>>,
    source_label: &'static str,
    min_period: Duration,
    /// The source's view is complete.
    synced: bool,
    /// The first full pass ran.
    first_done: bool,
    /// When the model must be programmed (changes are waiting).
    reconcile_at: Option<tokio::time::Instant>,
    last_sync: Option<tokio::time::Instant>,
    /// When the source saw the oldest change not yet programmed.
    first_received: Option<Instant>,
    source_errors: Vec<SourceError>,
    logged_node_errors: BTreeSet<String>,
    collect_failed: bool,
    pending_services: i64,
    pending_endpoints: i64,
}

/// Now, on tokio's clock (paused in tests) as a std `Instant`, so the reconciler's retry
/// times and the loop's timers agree.
fn clock() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Returns the heap's free pages to the system (glibc's `malloc_trim`). The first sync and
/// every verification build and free large transient structures (the parsed objects, a
/// snapshot of every map entry and the one expected), and glibc keeps freed pages mapped:
/// at 30,000 Services x 10 endpoints this gives back about 55 MiB after the first sync.
/// Takes a few ms.
fn give_back_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory the allocator holds free.
    unsafe {
        libc::malloc_trim(0);
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
            reconcile_at: None,
            last_sync: None,
            first_received: None,
            source_errors: Vec::new(),
            logged_node_errors: BTreeSet::new(),
            collect_failed: false,
            pending_services: 0,
            pending_endpoints: 0,
        }
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
            let event = tokio::select! {
                b = rx.recv() => match b {
                    Some(b) => Event::Batch(b),
                    None => Event::SourceClosed,
                },
                _ = sleep_until_opt(self.reconcile_at) => Event::Reconcile,
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
                    if self
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
            .service_changes_pending
            .set(self.pending_services);
        self.metrics
            .endpoint_changes_pending
            .set(self.pending_endpoints);
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

    fn update_skipped(&self) {
        self.metrics
            .skipped
            .set((self.model.error_count() + self.source_errors.len()) as i64);
    }

    /// Commits the model and programs what changed (everything, the first time).
    fn reconcile(&mut self) {
        self.reconcile_at = None;
        let model_start = Instant::now();
        let delta = self.model.commit();
        let model_us = model_start.elapsed().as_micros() as u64;
        self.log_model_errors(&delta);
        let now = clock();
        let out = if self.first_done {
            self.reconciler
                .apply(&mut self.dp, &self.model, &delta, now)
        } else {
            let services = self.model.ports().len();
            if services == 0 && self.reconciler.services.bound() > 0 {
                warn!(
                    services = self.reconciler.services.bound(),
                    "the source holds no Services: removing every Service from the data path"
                );
            }
            let mut out = self.reconciler.apply_all(&mut self.dp, &self.model, now);
            // Entries nothing claims (left by an earlier agent) go now.
            let v = self.reconciler.verify(&mut self.dp, &self.model, now);
            out.repaired.add(v.repaired);
            out.failed.extend(v.failed);
            self.first_done = true;
            give_back_heap();
            out
        };
        self.report(&out);
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
        for t in &delta.trigger_times {
            if let Some(lat) = crate::metrics::programming_latency(Some(t), now_sys) {
                self.metrics.network_programming.observe(lat);
            }
        }
        self.metrics.service_changes.inc_by(delta.service_changes);
        self.metrics.endpoint_changes.inc_by(delta.endpoint_changes);
        self.pending_services = 0;
        self.pending_endpoints = 0;
        self.metrics.service_changes_pending.set(0);
        self.metrics.endpoint_changes_pending.set(0);
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
    }

    /// Health and metrics after a reconciler call.
    fn after_sync(&mut self, out: &Outcome) {
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
        self.metrics.synced(
            out.duration,
            self.reconciler.services.entry_counts(),
            ServiceMaps::capacity(&self.dp),
        );
        self.update_skipped();
        let node_errors = self.reconciler.node.errors();
        for e in node_errors.difference(&self.logged_node_errors) {
            error!("{e}");
        }
        self.logged_node_errors = node_errors;
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
    fn report(&self, out: &Outcome) {
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
    fn verify(&mut self) {
        if !self.first_done {
            return;
        }
        let out = self.reconciler.verify(&mut self.dp, &self.model, clock());
        give_back_heap();
        self.report(&out);
        self.after_sync(&out);
    }

    fn collect(&mut self) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::{Capacity, fake::FakeDatapath};
    use crate::source::{Change, manifests::parse_documents};

    fn agent(min_period: Duration) -> Agent<FakeDatapath> {
        let dp = FakeDatapath::new(Capacity {
            frontends: 100,
            slots: 100,
            backends: 100,
            services: 100,
        });
        let r = Reconciler::adopt(&dp, NodeConfig::default(), Duration::from_secs(30)).unwrap();
        let health = Arc::new(Mutex::new(Health {
            last_updated: None,
            queued: None,
            timeout: Duration::from_secs(60),
        }));
        Agent::new(
            Model::new(NodeInfo {
                name: "node-1".into(),
                ..Default::default()
            }),
            r,
            dp,
            Arc::new(Metrics::new(std::path::PathBuf::from("/nonexistent"))),
            health,
            "manifests",
            min_period,
        )
    }

    fn batch(yaml: &str, synced: bool) -> Batch {
        let (objs, errors) = parse_documents("t.yaml", yaml);
        assert!(errors.is_empty(), "{errors:?}");
        Batch {
            changes: objs.into_iter().map(Change::Apply).collect(),
            errors: None,
            synced,
            received: Instant::now(),
        }
    }

    fn svc(name: &str, ip: &str) -> String {
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n"
        )
    }

    fn real_frontends(a: &Agent<FakeDatapath>) -> usize {
        a.dp.state.frontends.keys().filter(|k| k.proto != 0).count()
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_programmed_before_the_source_is_complete() {
        let mut a = agent(Duration::ZERO);
        a.handle(Event::Batch(batch(&svc("a", "10.96.0.1"), false)));
        assert_eq!(a.reconcile_at(), None, "the view is not complete yet");
        a.handle(Event::Retry);
        a.handle(Event::Verify);
        assert!(a.dp.log.is_empty());
        assert!(a.health.lock().unwrap().last_updated.is_none());
        a.handle(Event::Batch(batch(&svc("b", "10.96.0.2"), true)));
        assert!(a.reconcile_at().is_some());
        a.handle(Event::Reconcile);
        assert_eq!(real_frontends(&a), 2);
        let h = a.health.lock().unwrap();
        assert!(h.healthy(SystemTime::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn min_sync_period_paces_syncs_and_an_isolated_change_goes_at_once() {
        let period = Duration::from_secs(1);
        let mut a = agent(period);
        a.handle(Event::Batch(batch(&svc("a", "10.96.0.1"), true)));
        a.handle(Event::Reconcile);
        let t0 = tokio::time::Instant::now();
        // A change right after a sync waits for the period.
        tokio::time::advance(Duration::from_millis(100)).await;
        a.handle(Event::Batch(batch(&svc("b", "10.96.0.2"), true)));
        assert_eq!(a.reconcile_at(), Some(t0 + period));
        tokio::time::advance(Duration::from_millis(900)).await;
        a.handle(Event::Reconcile);
        assert_eq!(real_frontends(&a), 2);
        // After a quiet period, a change goes out at once.
        tokio::time::advance(Duration::from_secs(5)).await;
        a.handle(Event::Batch(batch(&svc("c", "10.96.0.3"), true)));
        assert_eq!(a.reconcile_at(), Some(tokio::time::Instant::now()));
    }

    #[tokio::test(start_paused = true)]
    async fn the_loop_reads_bursts_as_one_sync_and_stops() {
        let mut a = agent(Duration::ZERO);
        let (tx, rx) = mpsc::channel(16);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        tx.send(batch(&svc("a", "10.96.0.1"), true)).await.unwrap();
        for i in 2..6 {
            tx.send(batch(&svc(&format!("s{i}"), &format!("10.96.0.{i}")), true))
                .await
                .unwrap();
        }
        let driver = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop_tx.send(()).unwrap();
        };
        let run = a.run(
            rx,
            Duration::from_secs(30),
            Duration::from_secs(10),
            async {
                let _ = stop_rx.await;
            },
        );
        let (r, ()) = tokio::join!(run, driver);
        r.unwrap();
        assert_eq!(real_frontends(&a), 5);
        // One pass wrote everything: every frontend once.
        let puts = a
            .dp
            .log
            .iter()
            .filter(|o| matches!(o, crate::datapath::fake::Op::PutFrontend(k, _) if k.proto != 0))
            .count();
        assert_eq!(puts, 5);
        assert!(a.dp.collections >= 1, "the collection ran");
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_due_now_is_programmed_without_waiting_for_a_timer_tick() {
        let mut a = agent(Duration::ZERO);
        let (tx, rx) = mpsc::channel(4);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let sent = std::cell::Cell::new(None);
        let driver = async {
            // The loop is waiting; the change comes off a millisecond boundary, where a
            // timer for "now" would fire only at the next tick.
            tokio::time::sleep(Duration::from_millis(10)).await;
            tokio::time::advance(Duration::from_micros(500)).await;
            sent.set(Some(tokio::time::Instant::now()));
            tx.send(batch(&svc("a", "10.96.0.1"), true)).await.unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop_tx.send(()).unwrap();
        };
        let run = a.run(
            rx,
            Duration::from_secs(30),
            Duration::from_secs(10),
            async {
                let _ = stop_rx.await;
            },
        );
        let (r, ()) = tokio::join!(run, driver);
        r.unwrap();
        assert_eq!(real_frontends(&a), 1);
        assert_eq!(a.last_sync, sent.get(), "programmed when it arrived");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_service_keeps_healthz_pending_until_it_is_applied() {
        let mut a = agent(Duration::ZERO);
        a.dp.cap.frontends = 2; // one cluster IP (frontend + VIP marker)
        a.handle(Event::Batch(batch(
            &(svc("a", "10.96.0.1") + &svc("b", "10.96.0.2")),
            true,
        )));
        a.handle(Event::Reconcile);
        assert_eq!(a.reconciler.failed().len(), 1);
        {
            let h = a.health.lock().unwrap();
            assert!(
                h.queued.is_some(),
                "a failed Service port is a pending update"
            );
            let later = SystemTime::now() + Duration::from_secs(61);
            assert!(!h.healthy(later));
        }
        a.dp.cap.frontends = 4;
        tokio::time::advance(Duration::from_secs(2)).await;
        a.handle(Event::Retry);
        assert!(a.reconciler.failed().is_empty());
        assert!(a.health.lock().unwrap().queued.is_none());
        assert_eq!(real_frontends(&a), 2);
    }
}
