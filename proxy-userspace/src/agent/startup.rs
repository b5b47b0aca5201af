//! Start-up before the data path is touched (every input checked, the preflight), the
//! data path opened over its pins, and `--init-only`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use proxy_common::Config;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::{
    config::{AgentConfig, NodePortAddresses, SourceChoice},
    datapath::{
        ServiceMaps,
        healthcheck::HealthCheckServers,
        kernel::KernelDatapath,
        loader::{self, MapSizes},
        maps::PinnedMaps,
        tc::TcKernel,
    },
    model::NodeInfo,
    source::{Batch, KubeSource, ManifestSource, Source, apiconfig},
};

pub(super) fn start_source(
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
pub(super) struct Prepared {
    pub(super) node: NodeInfo,
    pub(super) dir: PathBuf,
    pub(super) cgroup: PathBuf,
    pub(super) sizes: MapSizes,
}

/// Checks every input before the data path is touched, so a mistake changes nothing: the
/// pin directory name, the source, the interfaces, the preflight, the cgroup.
pub(super) fn prepare(config: &AgentConfig) -> Result<Prepared> {
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
pub(super) fn apply_oom_score_adj(value: i32) {
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", value.to_string()) {
        let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
            " (lowering it needs CAP_SYS_RESOURCE: add SYS_RESOURCE to the container's capabilities)"
        } else {
            ""
        };
        warn!(value, error = %e, "cannot set oom_score_adj{hint}");
    }
}

/// Opens the pinned maps and the tc part, writes the configurations, warns about adopted
/// maps that keep another size.
pub(super) fn open_datapath(
    dir: &Path,
    cgroup: &Path,
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
