//! `run`: the agent's start as a sequence of named steps, from the checks to the event loop.
//!
//! The maps are loaded first; the programs are verified and attached in the background while
//! the source is read into the model (the verifier takes about as long as reading tens of
//! thousands of manifests), and no sync runs before they are attached. On a failed start, a
//! pin directory this run created is removed again (one that was adopted keeps serving the
//! node).

use std::{
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use aya::Ebpf;
use tokio::{sync::mpsc, task::JoinHandle};
use tracing::info;

use super::{
    Agent, Health,
    shutdown::{abandon_start, finish, stop_signal},
    startup::{Prepared, apply_oom_score_adj, open_datapath, prepare, start_source},
};
use crate::{
    config::{AgentConfig, SourceChoice},
    datapath::{
        kernel::KernelDatapath,
        loader::{self, MapSizes},
    },
    kernel_log::KernelLogs,
    metrics::{Metrics, node_families},
    model::{Model, NodeInfo},
    reconcile::{NodeConfig, Reconciler},
    servers::{self, Fatal},
    source::{Batch, apiconfig},
};

/// Runs the agent until SIGTERM or Ctrl-C (see the module documentation), or until a server
/// fails with `--bind-address-hard-fail`.
pub fn run(config: AgentConfig) -> Result<()> {
    let prepared = prepare(&config)?;
    apply_oom_score_adj(config.oom_score_adj);
    log_cluster_settings(&config);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let kube = rt.block_on(apiconfig::kube_config(
        &config.source,
        config.master.as_deref(),
    ))?;
    let fresh = !prepared.dir.exists();
    let _lock = loader::lock_pin_dir(&prepared.dir)?;
    rt.block_on(serve(&config, prepared, kube, fresh))
}

/// `--cluster-cidr` and `--nodeport-addresses` as this start reads them.
fn log_cluster_settings(config: &AgentConfig) {
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
}

/// What the start-up steps share: the settings, the checked paths and sizes, and whether
/// this run created the pin directory (then a failed start removes it again).
struct Start<'a> {
    config: &'a AgentConfig,
    dir: &'a Path,
    cgroup: &'a Path,
    sizes: MapSizes,
    fresh: bool,
}

/// The program loader thread (verification and attachment), with the reader of the kernel
/// log ring it returns.
type AttachThread = JoinHandle<Result<Option<KernelLogs>>>;

/// The health, metrics and status state the servers read and the agent updates.
struct Served {
    health: Arc<Mutex<Health>>,
    metrics: Arc<Metrics>,
    north_south: Arc<Mutex<crate::status::NorthSouth>>,
    /// The first server failure under `--bind-address-hard-fail`.
    fatal: Arc<Fatal>,
}

/// The running agent, from the load of the maps to the stop.
async fn serve(
    config: &AgentConfig,
    prepared: Prepared,
    kube: Option<kube::Config>,
    fresh: bool,
) -> Result<()> {
    let Prepared {
        node,
        dir,
        cgroup,
        sizes,
    } = prepared;
    let start = Start {
        config,
        dir: &dir,
        cgroup: &cgroup,
        sizes,
        fresh,
    };
    let ebpf = start.load_maps()?;
    let attach = start.spawn_attach(ebpf);
    let (dp, mut reconciler, rx) = match start.adopt(&node.name, kube) {
        Ok(v) => v,
        Err(e) => return Err(abandon_start(attach, &dir, fresh, e).await),
    };
    let attached = start.attached(attach, &node.name);
    reconciler
        .services
        .set_maglev_size(config.maglev_table_size);
    let served = start.spawn_servers(&node.name);
    let mut agent = start.agent(node, reconciler, dp, &served, attached)?;
    log_translation_modes(config);
    let stop = stop_signal(served.fatal.clone())?;
    let ran = agent
        .run(
            rx,
            config.sync_period,
            crate::datapath::tc::lc_collect_interval(config.udp_flow_timeout),
            stop,
        )
        .await;
    finish(&agent, ran, &served.fatal, &dir, fresh)
}

impl Start<'_> {
    /// The maps, adopted from the pins or created: the first step that touches the data
    /// path.
    fn load_maps(&self) -> Result<Ebpf> {
        loader::load_pinned(self.dir, self.sizes).inspect_err(|_| {
            if self.fresh {
                let _ = loader::cleanup(self.dir);
            }
        })
    }

    /// Verifies and attaches the programs on a thread of their own while the source is read.
    fn spawn_attach(&self, ebpf: Ebpf) -> AttachThread {
        let (dir, cgroup) = (self.dir.to_path_buf(), self.cgroup.to_path_buf());
        tokio::task::spawn_blocking(move || {
            let r = loader::attach_programs(ebpf, &dir, &cgroup);
            // The loader and the verifier logs freed much on this thread.
            crate::give_back_heap();
            r
        })
    }

    /// Opens the data path, adopts what the pinned maps hold and starts the source.
    fn adopt(
        &self,
        node: &str,
        kube: Option<kube::Config>,
    ) -> Result<(KernelDatapath, Reconciler, mpsc::Receiver<Batch>)> {
        let config = self.config;
        let mut dp = open_datapath(self.dir, self.cgroup, config, self.sizes)?;
        let reconciler = Reconciler::adopt(
            &dp,
            NodeConfig {
                interfaces: config.tc.interfaces.clone(),
                snat_local: dp.tc.snat_local(),
            },
            config.sync_period,
        )
        .context("read the pinned maps")?;
        info!(
            services = reconciler.services.bound(),
            "adopted state from pinned maps"
        );
        if !self.fresh {
            reconciler.services.sweep_counters(&mut dp);
        }
        let rx = start_source(&config.source, node, kube)?;
        Ok((dp, reconciler, rx))
    }

    /// What the event loop awaits before its first sync: the loader thread's end, then the
    /// kernel log forwarding.
    fn attached(
        &self,
        attach: AttachThread,
        node: &str,
    ) -> impl std::future::Future<Output = Result<()>> + Send + 'static {
        let (pin_dir, cg, node_name) = (
            self.dir.to_path_buf(),
            self.cgroup.to_path_buf(),
            node.to_string(),
        );
        let level = self.config.kernel_log_level;
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
    }

    /// The health, metrics and status servers. They bind in the background and keep trying
    /// while the data path runs (kube-proxy's serveHealthz/serveMetrics); with
    /// --bind-address-hard-fail the first failure stops the agent.
    fn spawn_servers(&self, node: &str) -> Served {
        let config = self.config;
        let families = node_families();
        let health = Arc::new(Mutex::new(Health::new(
            config.sync_period.saturating_mul(2),
            families.clone(),
        )));
        let metrics = Arc::new(Metrics::new(self.dir.to_path_buf(), families));
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
                    node: node.to_string(),
                    health: health.clone(),
                    north_south: north_south.clone(),
                    listeners,
                }),
                servers::BIND_RETRY,
                hard_fail,
            );
        }
        Served {
            health,
            metrics,
            north_south,
            fatal,
        }
    }

    /// The agent over the kernel's data path, with the model of this node and the socket
    /// bypass's maps.
    fn agent(
        &self,
        node: NodeInfo,
        reconciler: Reconciler,
        dp: KernelDatapath,
        served: &Served,
        attached: impl std::future::Future<Output = Result<()>> + Send + 'static,
    ) -> Result<Agent<KernelDatapath>> {
        let config = self.config;
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
        let mut agent = Agent::new(
            model,
            reconciler,
            dp,
            served.metrics.clone(),
            served.health.clone(),
            source_label,
            min_period,
        )
        .with_fresh_maps(self.fresh)
        .with_north_south(served.north_south.clone())
        .with_attaching(attached)
        .with_close_connections(
            config
                .close_connections_to_removed_endpoints
                .then(|| self.dir.to_path_buf()),
        );
        if config.close_connections_to_removed_endpoints {
            info!(
                "TCP connections to endpoints that leave their Service are closed (--close-connections-to-removed-endpoints)"
            );
        }
        agent.set_bypass(
            crate::datapath::bypass::BypassKernel::new(
                self.dir,
                self.cgroup,
                config.socket_lb_scope,
            )
            .context("open the bypass maps")?,
        );
        Ok(agent)
    }
}

/// How north-south flows and pods' connections are translated, when not the default.
fn log_translation_modes(config: &AgentConfig) {
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
        info!(
            scope = config.socket_lb_scope.as_str(),
            "socket-level translation only for the node's own network namespace; pods are translated per packet"
        );
    }
}
