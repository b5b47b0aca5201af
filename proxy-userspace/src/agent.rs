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
//! Health as kube-proxy's healthz server reports it (`pkg/proxy/healthcheck`, see
//! [`crate::servers`]): healthy once a sync succeeded, unless an update (or a failed Service
//! port) has been pending for longer than twice `--sync-period`; `/healthz` also follows the
//! node's eligibility, which the model reads from the Node object. The health and metrics
//! servers bind in the background and are retried while the data path runs.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context, Result};
use proxy_common::Config;
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::{
    config::{AgentConfig, NodePortAddresses, SourceChoice},
    datapath::addr::ip_to_bytes,
    datapath::{
        Datapath, FlowCollection, ServiceMaps,
        healthcheck::HealthCheckServers,
        kernel::KernelDatapath,
        loader::{self, MapSizes},
        maps::PinnedMaps,
        tc::TcKernel,
    },
    metrics::{Metrics, node_families},
    model::{Delta, Model, NodeInfo, Protocol, Scope, ServicePortKey},
    reconcile::{NodeConfig, Outcome, Reconciler},
    servers::{self, Fatal},
    source::{Batch, KubeSource, ManifestSource, Source, SourceError, apiconfig},
};

pub use crate::status::Health;

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
        tc: config.tc.clone(),
    });
    for r in &results {
        // Only the option that needs it makes a missing SOCK_DESTROY worth a warning.
        if r.check == "socket destroy" && !config.close_connections_to_removed_endpoints {
            continue;
        }
        match r.status {
            // The conntrack table's size is said once at every start (a warning when large).
            crate::check::Status::Ok if r.check == "conntrack" => {
                info!("north-south conntrack table: {}", r.detail)
            }
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
        north_south_mode: config.north_south_mode,
        nodeport_addresses,
        nodeport_primary,
        name: config.node_name(),
    }
}

/// What start-up checked and decided before touching the data path.
struct Prepared {
    node: NodeInfo,
    dir: std::path::PathBuf,
    cgroup: std::path::PathBuf,
    sizes: MapSizes,
}

/// Checks every input before the data path is touched, so a mistake changes nothing: the
/// pin directory name, the source, the interfaces, the preflight, the cgroup.
fn prepare(config: &AgentConfig) -> Result<Prepared> {
    let node = node_info(config);
    let dir = config.pins.dir()?;
    match &config.source {
        SourceChoice::Manifests(m) => {
            std::fs::read_dir(m).with_context(|| {
                format!("--manifests {}: cannot read the directory", m.display())
            })?;
        }
        SourceChoice::Api(Some(k)) => {
            std::fs::metadata(k).with_context(|| apiconfig::kubeconfig_named(k))?;
        }
        SourceChoice::Api(None) => {}
    }
    crate::datapath::tc::check_interfaces(&config.tc.interfaces)?;
    preflight(config)?;
    // Before the first load: every load of the object sets the programs' log level.
    loader::set_kernel_log_level(config.kernel_log_level);
    let cgroup = match &config.cgroup_path {
        Some(p) => p.clone(),
        None => {
            let root = loader::cgroup2_root()?;
            // In a container's cgroup namespace (kube-proxy's own DaemonSet, on cgroup v2)
            // the mount root is the container's cgroup: the programs would see only the
            // agent itself and proxy nothing for the node.
            if crate::mounts::in_initial_cgroup_namespace() == Some(false) {
                anyhow::bail!(
                    "{} is the root of this container's cgroup namespace, not the node's cgroup v2 root, so the programs would proxy nothing for the node (remedy: mount the host's /sys/fs/cgroup with a hostPath volume and pass --cgroup-path at it, as the Helm chart's DaemonSet does with its cgroupRoot value)",
                    root.display()
                );
            }
            root
        }
    };
    let sizes = MapSizes {
        frontends: config.map_sizes.frontends,
        slots: config.map_sizes.slots,
        backends: config.map_sizes.backends,
        sockets: config.map_sizes.sockets,
        conntrack_flows: config.tc.conntrack_flows(),
    };
    Ok(Prepared {
        node,
        dir,
        cgroup,
        sizes,
    })
}

/// `--init-only`: the privileged part of start-up (preflight, bpffs, loading, attaching and
/// pinning the data path, writing its configuration), then exit; a later `run` adopts it.
pub fn init_only(config: AgentConfig) -> Result<()> {
    let Prepared {
        dir, cgroup, sizes, ..
    } = prepare(&config)?;
    let fresh = !dir.exists();
    let _lock = loader::lock_pin_dir(&dir)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let done = rt.block_on(async {
        // Nobody reads kernel log lines here; the next run's agent does.
        drop(loader::load_and_attach(&dir, &cgroup, sizes)?);
        open_datapath(&dir, &cgroup, &config, sizes)?;
        anyhow::Ok(())
    });
    if let Err(e) = done {
        if fresh {
            let _ = loader::cleanup(&dir);
        }
        return Err(e);
    }
    info!(pin_dir = %dir.display(), cgroup = %cgroup.display(), "data path initialized (--init-only); a later run adopts it");
    Ok(())
}

/// `--oom-score-adj`: best effort, as kube-proxy. A failure is a warning that names the
/// missing capability: lowering the score needs CAP_SYS_RESOURCE, which a container gets
/// only when its securityContext adds it, and without it the kernel's OOM killer may pick
/// the agent before ordinary workloads.
fn apply_oom_score_adj(value: i32) {
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
            " (lowering it needs CAP_SYS_RESOURCE: add SYS_RESOURCE to the container's capabilities)"
        } else {
            ""
        };
        warn!(value, error = %e, "cannot set oom_score_adj{hint}");
    }
}

/// Runs the agent until SIGTERM or Ctrl-C (see the module documentation), or until a server
/// fails with `--bind-address-hard-fail`.
pub fn run(config: AgentConfig) -> Result<()> {
    let Prepared {
        node,
        dir,
        cgroup,
        sizes,
    } = prepare(&config)?;
    apply_oom_score_adj(config.oom_score_adj);
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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let kube = rt.block_on(apiconfig::kube_config(
        &config.source,
        config.master.as_deref(),
    ))?;
    let fresh = !dir.exists();
    let _lock = loader::lock_pin_dir(&dir)?;

    rt.block_on(async move {
        // Start-up: on failure, a pin directory this run created is removed again (one that
        // was adopted keeps serving the node).
        // The maps first; the programs are verified and attached in the background while
        // the source is read into the model (the verifier takes about as long as reading
        // tens of thousands of manifests), and no sync runs before they are attached.
        let ebpf = match loader::load_pinned(&dir, sizes) {
            Ok(ebpf) => ebpf,
            Err(e) => {
                if fresh {
                    let _ = loader::cleanup(&dir);
                }
                return Err(e);
            }
        };
        let mut attach = Some(tokio::task::spawn_blocking({
            let (dir, cgroup) = (dir.clone(), cgroup.clone());
            move || {
                let r = loader::attach_programs(ebpf, &dir, &cgroup);
                // The loader and the verifier logs freed much on this thread.
                crate::give_back_heap();
                r
            }
        }));
        let started = async {
            let mut dp = open_datapath(&dir, &cgroup, &config, sizes)?;
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
            if !fresh {
                reconciler.services.sweep_counters(&mut dp);
            }
            let rx = start_source(&config.source, &node.name, kube)?;
            anyhow::Ok((dp, reconciler, rx))
        }
        .await;
        let (dp, mut reconciler, rx) = match started {
            Ok(v) => v,
            Err(e) => {
                // The attach thread cannot be stopped: its pins are removed once it is done.
                if let Some(a) = attach.take() {
                    let _ = a.await;
                }
                if fresh {
                    let _ = loader::cleanup(&dir);
                }
                return Err(e);
            }
        };
        let attached = {
            let attach = attach.take().expect("spawned above");
            let (pin_dir, cg, node_name) = (dir.clone(), cgroup.clone(), node.name.clone());
            let level = config.kernel_log_level;
            async move {
                let logs = attach.await.context("the program loader thread failed")??;
                if let Some(logs) = logs {
                    logs.spawn()?;
                    info!(
                        level = level.as_str(),
                        target = crate::kernel_log::TARGET,
                        "kernel log lines forwarded"
                    );
                }
                info!(pin_dir = %pin_dir.display(), cgroup = %cg.display(), node = %node_name, "data path attached");
                anyhow::Ok(())
            }
        };
        reconciler.services.set_maglev_size(config.maglev_table_size);
        let families = node_families();
        let health = Arc::new(Mutex::new(Health::new(
            config.sync_period.saturating_mul(2),
            families.clone(),
        )));
        let metrics = Arc::new(Metrics::new(dir.clone(), families));
        // The servers bind in the background and keep trying while the data path runs
        // (kube-proxy's serveHealthz/serveMetrics); with --bind-address-hard-fail the first
        // failure stops the agent.
        let fatal = Arc::new(Fatal::default());
        let hard_fail = config.bind_address_hard_fail.then(|| fatal.clone());
        let mut listeners = Vec::new();
        if let Some(addr) = config.healthz_bind_address {
            let state = servers::spawn(
                "health",
                addr,
                servers::health_app(health.clone(), metrics.clone()),
                servers::BIND_RETRY,
                hard_fail.clone(),
            );
            listeners.push(crate::status::Listener {
                name: "health",
                address: addr,
                state,
            });
        }
        if let Some(addr) = config.metrics_bind_address {
            let state = servers::spawn(
                "metrics",
                addr,
                servers::metrics_app(metrics.clone()),
                servers::BIND_RETRY,
                hard_fail.clone(),
            );
            listeners.push(crate::status::Listener {
                name: "metrics",
                address: addr,
                state,
            });
        }
        // The agent's own status server: readiness that kube-proxy cannot answer for.
        let north_south = Arc::new(Mutex::new(crate::status::NorthSouth::default()));
        if let Some(addr) = config.status_bind_address {
            servers::spawn(
                "status",
                addr,
                crate::status::app(crate::status::StatusSources {
                    node: node.name.clone(),
                    health: health.clone(),
                    north_south: north_south.clone(),
                    listeners,
                }),
                servers::BIND_RETRY,
                hard_fail,
            );
        }
        let source_label = match config.source {
            SourceChoice::Manifests(_) => "manifests",
            SourceChoice::Api(_) => "api",
        };
        let min_period = match config.source {
            SourceChoice::Manifests(_) => Duration::ZERO,
            SourceChoice::Api(_) => config.min_sync_period,
        };
        let mut model = Model::new(node);
        model.set_socket_lb_scope(config.socket_lb_scope);
        let mut agent = Agent::new(model, reconciler, dp, metrics, health, source_label, min_period)
            .with_fresh_maps(fresh)
            .with_north_south(north_south)
            .with_attaching(attached)
            .with_close_connections(
                config
                    .close_connections_to_removed_endpoints
                    .then(|| dir.clone()),
            );
        if config.close_connections_to_removed_endpoints {
            info!("TCP connections to endpoints that leave their Service are closed (--close-connections-to-removed-endpoints)");
        }
        agent.set_bypass(
            crate::datapath::bypass::BypassKernel::new(&dir, &cgroup, config.socket_lb_scope)
                .context("open the bypass maps")?,
        );
        if config.north_south_mode != crate::model::NorthSouthMode::Snat {
            if config.tc.masquerade_all {
                tracing::warn!(
                    mode = config.north_south_mode.name(),
                    "--masquerade-all source-NATs every north-south flow: this node starts no direct server return flow (it still accepts those of other nodes)"
                );
            } else {
                info!(
                    mode = config.north_south_mode.name(),
                    "north-south flows to backends on other nodes go by direct server return (every node must run the same mode)"
                );
            }
        }
        if config.socket_lb_scope != crate::model::bypass::SocketLbScope::All {
            info!(scope = config.socket_lb_scope.as_str(), "socket-level translation only for the node's own network namespace; pods are translated per packet");
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let failed = fatal.clone();
        let stop = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
                _ = failed.wait() => {}
            }
        };
        let ran = agent
            .run(
                rx,
                config.sync_period,
                crate::datapath::tc::lc_collect_interval(config.udp_flow_timeout),
                stop,
            )
            .await;
        if ran.is_err() && fresh && !agent.attached() {
            // The programs failed to attach: a pin directory this run created goes again.
            let _ = loader::cleanup(&dir);
        }
        ran?;
        if let Some(e) = fatal.error() {
            anyhow::bail!("{e} (--bind-address-hard-fail); the data path stays attached and pinned");
        }
        info!("stopping; the data path stays attached and pinned for the next agent (use `ebpf-proxy cleanup` to remove it)");
        Ok(())
    })
}

/// Opens the pinned maps and the tc part, writes the configurations, warns about adopted
/// maps that keep another size.
fn open_datapath(
    dir: &std::path::Path,
    cgroup: &std::path::Path,
    config: &AgentConfig,
    sizes: MapSizes,
) -> Result<KernelDatapath> {
    let mut maps = PinnedMaps::open(dir).context("open the pinned maps")?;
    maps.set_cgroup(cgroup);
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
    /// The maps were created empty by this run, so the first pass has nothing of an earlier
    /// agent's to remove and skips its verification.
    fresh_maps: bool,
    /// When the model must be programmed (changes are waiting).
    reconcile_at: Option<tokio::time::Instant>,
    /// The programs still being verified and attached (a start reads its source meanwhile):
    /// no sync runs before they are in place, and their failure ends [`Agent::run`].
    attaching: Option<Attaching>,
    last_sync: Option<tokio::time::Instant>,
    /// When the source saw the oldest change not yet programmed.
    first_received: Option<Instant>,
    source_errors: Vec<SourceError>,
    logged_node_errors: BTreeSet<String>,
    collect_failed: bool,
    pending_services: i64,
    pending_endpoints: i64,
    /// The kernel side of the socket-level bypass (`None`: not programmed, as with the
    /// in-memory data path).
    bypass: Option<crate::datapath::bypass::BypassKernel>,
    /// Bad `ebpf-proxy.io/socket-lb` values already logged.
    logged_bypass: BTreeSet<String>,
    /// `--close-connections-to-removed-endpoints`: the pin directory whose `REVNAT_SK`
    /// names the connections (`None`: off, kube-proxy's behaviour).
    close_connections: Option<std::path::PathBuf>,
    /// The north-south path as the status server reports it, updated after every sync.
    north_south: Option<Arc<Mutex<crate::status::NorthSouth>>>,
}

/// Now, on tokio's clock (paused in tests) as a std `Instant`, so the reconciler's retry
/// times and the loop's timers agree.
fn clock() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The programs' verification and attachment, awaited by the agent's loop.
type Attaching = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

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

    /// `--close-connections-to-removed-endpoints`: after each sync, the TCP connections
    /// the socket programs translated to an endpoint that left its Service are closed (see
    /// [`Agent::close_removed`]); `dir` is the pin directory.
    pub fn with_close_connections(mut self, dir: Option<std::path::PathBuf>) -> Self {
        self.close_connections = dir;
        self
    }

    /// Tells the agent that this run created the pinned maps (they hold nothing of an
    /// earlier agent's), which spares the first pass its verification.
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
        // The TCP Service ports whose connections may have lost their endpoint, with their
        // ids taken before the sync (a removed port's id is gone after it). The first pass
        // looks at every port (endpoints may have left while no agent ran).
        let closing: Vec<(ServicePortKey, u32)> = match &self.close_connections {
            Some(_) if self.first_done => delta
                .ports
                .iter()
                .filter(|k| k.protocol == Protocol::Tcp)
                .filter_map(|k| Some((k.clone(), self.reconciler.services.id_of(k)?)))
                .collect(),
            _ => Vec::new(),
        };
        let first_pass = !self.first_done;
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
            if !self.fresh_maps {
                let v = self.reconciler.verify(&mut self.dp, &self.model, now);
                out.repaired.add(v.repaired);
                out.failed.extend(v.failed);
            }
            self.first_done = true;
            crate::give_back_heap();
            out
        };
        self.report(&out);
        if self.close_connections.is_some() {
            let closing = if first_pass {
                self.model
                    .ports()
                    .keys()
                    .filter(|k| k.protocol == Protocol::Tcp)
                    .filter_map(|k| Some((k.clone(), self.reconciler.services.id_of(k)?)))
                    .collect()
            } else {
                closing
            };
            self.close_removed(closing);
        }
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

    /// `--close-connections-to-removed-endpoints`: closes the TCP connections the socket
    /// programs translated, for one of `ports` (Service port, its service id), to an
    /// endpoint that is no longer live there. Live means in one of the Service's
    /// EndpointSlices for that port and ready or serving, on any node: a terminating
    /// endpoint that still serves keeps its connections (kube-proxy never cuts them, and
    /// the endpoint is draining them), one that is gone or neither ready nor serving loses
    /// them; every endpoint of a removed Service port does. Narrowing by topology, traffic
    /// policy or weight 0 changes where new connections go, never closes one.
    ///
    /// Finds the sockets in the reverse-NAT entries of connected sockets (one pass, only
    /// when some TCP port changed), then
    /// closes them by cookie on a thread of its own (sock_diag in every network namespace,
    /// see [`crate::sockdiag`]), so the sync loop does not wait for it. Only connections of
    /// the socket path: flows the tc programs translate (from outside the node, or from
    /// pods that bypass the socket programs) are not closed.
    fn close_removed(&mut self, ports: Vec<(ServicePortKey, u32)>) {
        let Some(dir) = self.close_connections.clone() else {
            return;
        };
        if ports.is_empty() {
            return;
        }
        let mut live = crate::datapath::maps::LiveBackends::new();
        for (k, id) in ports {
            let set = live.entry(id).or_default();
            if !self.model.ports().contains_key(&k) {
                continue; // the port is gone: nothing is live
            }
            let eps =
                self.model
                    .endpoints_of(&k.namespace, &k.name, &k.port_name, k.protocol, k.family);
            set.extend(
                eps.iter()
                    .filter(|(_, e)| e.ready || e.serving)
                    .map(|(a, _)| (ip_to_bytes(a.ip()), a.port().to_be_bytes())),
            );
        }
        let cookies = match crate::datapath::maps::tcp_sockets_to_removed(&dir, &live) {
            Ok(c) => c,
            Err(e) => {
                error!(error = %e, "closing connections to removed endpoints: reading the connected sockets' reverse-NAT entries failed");
                return;
            }
        };
        if cookies.is_empty() {
            return;
        }
        let closed = self.metrics.connections_closed.clone();
        std::thread::spawn(move || {
            let r = crate::sockdiag::destroy(&cookies);
            closed.inc_by(r.closed as u64);
            info!(
                sockets = cookies.len(),
                closed = r.closed,
                not_found = r.not_found,
                namespaces = r.namespaces,
                "closed TCP connections to removed endpoints"
            );
            for e in r.errors.iter().take(5) {
                warn!(error = %e, "closing a connection to a removed endpoint failed");
            }
        });
    }

    /// The periodic verification.
    fn verify(&mut self) {
        if !self.first_done {
            return;
        }
        let out = self.reconciler.verify(&mut self.dp, &self.model, clock());
        crate::give_back_heap();
        self.report(&out);
        self.after_sync(&out);
        self.sync_bypass(true);
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

/// The kubeconfig path as errors name it, with where it can come from (the flag or the
/// configuration file).
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
        let health = Arc::new(Mutex::new(Health::new(
            Duration::from_secs(60),
            vec![crate::model::Family::V4],
        )));
        Agent::new(
            Model::new(NodeInfo {
                name: "node-1".into(),
                ..Default::default()
            }),
            r,
            dp,
            Arc::new(Metrics::new(
                std::path::PathBuf::from("/nonexistent"),
                vec![crate::model::Family::V4],
            )),
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
    async fn no_sync_runs_before_the_programs_are_attached_and_their_failure_ends_the_loop() {
        // Attached after 2 s: the source is read meanwhile, the sync waits for it.
        let (attach_tx, attach_rx) = tokio::sync::oneshot::channel::<Result<()>>();
        let mut a = agent(Duration::ZERO)
            .with_attaching(async move { attach_rx.await.unwrap_or_else(|_| Ok(())) });
        assert!(!a.attached());
        let (tx, rx) = mpsc::channel(16);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        tx.send(batch(&svc("a", "10.96.0.1"), true)).await.unwrap();
        let driver = async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            attach_tx.send(Ok(())).unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop_tx.send(()).unwrap();
        };
        let t0 = tokio::time::Instant::now();
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
        assert!(a.attached());
        assert_eq!(real_frontends(&a), 1);
        // The first sync ran once the programs were attached, not before.
        let synced_at = a.last_sync.expect("synced");
        assert!(
            synced_at >= t0 + Duration::from_secs(2),
            "{:?}",
            synced_at - t0
        );

        // A failed attach ends the loop with its error, before any sync.
        let mut a = agent(Duration::ZERO)
            .with_attaching(async { Err(anyhow::anyhow!("verify: rejected")) });
        let (tx, rx) = mpsc::channel(16);
        tx.send(batch(&svc("a", "10.96.0.1"), true)).await.unwrap();
        let e = a
            .run(
                rx,
                Duration::from_secs(30),
                Duration::from_secs(10),
                std::future::pending(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), "verify: rejected");
        assert!(!a.attached());
        assert_eq!(real_frontends(&a), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn the_node_object_drives_healthz_eligibility_at_once() {
        let mut a = agent(Duration::ZERO);
        let node = |extra: &str| {
            format!("---\napiVersion: v1\nkind: Node\nmetadata: {{name: node-1{extra}}}\n")
        };
        a.handle(Event::Batch(batch(&node(""), true)));
        assert!(a.health.lock().unwrap().node_eligible);
        // No sync needed: the next /healthz already answers 503.
        a.handle(Event::Batch(batch(
            &node(", deletionTimestamp: '2026-01-01T00:00:00Z'"),
            true,
        )));
        assert!(!a.health.lock().unwrap().node_eligible);
    }

    #[tokio::test(start_paused = true)]
    async fn kube_proxy_sync_families_follow_each_sync() {
        let mut a = agent(Duration::ZERO);
        a.dp.cap.frontends = 2; // one cluster IP (frontend + VIP marker)
        let local = "---\napiVersion: v1\nkind: Service\nmetadata: {name: loc, namespace: ns}\nspec: {clusterIP: 10.96.0.9, internalTrafficPolicy: Local, ports: [{port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: loc-1, namespace: ns, labels: {kubernetes.io/service-name: loc}}\naddressType: IPv4\nports: [{port: 80}]\nendpoints: [{addresses: [10.0.0.7], nodeName: node-2}]\n";
        a.handle(Event::Batch(batch(&(svc("a", "10.96.0.1") + local), true)));
        a.handle(Event::Reconcile);
        let text = a.metrics.encode();
        for line in [
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"} 1",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"external\"} 0",
            "kubeproxy_sync_proxy_rules_service_changes_total 2",
            "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1",
            "kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family=\"IPv4\"} 1",
            // A Service port is still failed: the last full sync has not happened.
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"} 0",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
        assert!(
            !text.contains(
                "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"} 0"
            ),
            "a change was queued"
        );
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
