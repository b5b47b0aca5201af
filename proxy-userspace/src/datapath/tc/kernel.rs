//! [`TcKernel`]: the tc programs of one pin directory (loaded on first use), their
//! attachment to interfaces, the collection of ended least-connections flows, and the tc
//! maps the agent writes.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::{Array, HashMap, LpmTrie, MapData},
    programs::{SchedClassifier, TcAttachType, TestRun, TestRunOptions, Xdp, links::FdLink},
};
use ipnet::IpNet;
use proxy_common::nat::{
    CONNTRACK, CtEntry, CtKey, DSR, DsrKey, DsrTarget, IFACE_ADDRS, IfaceAddr, LC_FLOWS,
    LOCAL_ENDPOINTS, SOURCE_RANGES, SourceRange, TC_CFG_CLUSTER_CIDR_V4, TC_CFG_CLUSTER_CIDR_V6,
    TC_CFG_MASQUERADE_ALL, TC_CONFIG, TcConfig, ct_alive, ct_closed, ct_timeout_ns,
};

use super::{
    EGRESS_PROGRAM, INGRESS_PROGRAM, LC_GC_PROGRAM, XDP_PROGRAM,
    attach::{
        XdpMode, attach_pinned, install_tail_calls, link_name, program_clock_or_warn,
        remove_link_pin, tc_interfaces, xdp_link_name,
    },
    maps::open,
    settings::{TcSettings, XdpSetting, tc_config},
};
use crate::datapath::{NodeSnapshot, clock::monotonic_ns, loader::OBJECT};

/// The tc programs of one pin directory (loaded on first use) and the tc maps the agent
/// writes.
pub struct TcKernel {
    dir: PathBuf,
    /// `--xdp`.
    xdp: XdpSetting,
    /// `--xdp-veth-peers-ready`.
    veth_peers_ready: bool,
    /// What was written to `TC_CONFIG` (timeouts for the collection of flows).
    config: TcConfig,
    ebpf: Option<Ebpf>,
    /// Interfaces whose tcx programs this load attached (a second attach of the same
    /// program to a hook fails with EEXIST: a retry after an XDP failure attaches XDP only).
    tc_attached: BTreeSet<String>,
    local: HashMap<MapData, [u8; 16], u32>,
    ranges: LpmTrie<MapData, SourceRange, u32>,
    addrs: HashMap<MapData, u32, IfaceAddr>,
    dsr: HashMap<MapData, DsrKey, DsrTarget>,
}

impl TcKernel {
    /// Opens the tc maps of the pin directory `dir` (loaded by `loader::load_and_attach`,
    /// which pins them) and writes the configuration. Nothing is attached.
    ///
    /// `cluster_cidrs` is `--cluster-cidr` (kube-proxy's meaning): its first prefix of each
    /// family is used for the clients of that family. `udp_timeout` (`--udp-flow-timeout`)
    /// is the idle timeout of unreplied UDP flows.
    pub fn new(
        dir: &Path,
        args: &TcSettings,
        cluster_cidrs: &[IpNet],
        udp_timeout: std::time::Duration,
    ) -> Result<Self> {
        let ns = |d: std::time::Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        let config = TcConfig {
            tcp_established_ns: ns(args.conntrack_tcp_timeout_established),
            udp_ns: ns(udp_timeout),
            udp_stream_ns: ns(args.conntrack_udp_timeout_stream),
            ..tc_config(args, cluster_cidrs)
        };
        let mut cfg: Array<MapData, TcConfig> = open(dir, TC_CONFIG)?;
        cfg.set(0, config, 0).context("write TC_CONFIG")?;
        Ok(Self {
            config,
            xdp: args.xdp,
            veth_peers_ready: args.xdp_veth_peers_ready,
            dir: dir.to_path_buf(),
            ebpf: None,
            tc_attached: BTreeSet::new(),
            local: open(dir, LOCAL_ENDPOINTS)?,
            ranges: open(dir, SOURCE_RANGES)?,
            addrs: open(dir, IFACE_ADDRS)?,
            dsr: open(dir, DSR)?,
        })
    }

    /// Some flows to local backends are source-NATed (`--masquerade-all`, or a cluster IP
    /// reached from outside `--cluster-cidr`): their SNAT stage and replies need the
    /// programs on the pod-facing interfaces too.
    pub fn snat_local(&self) -> bool {
        self.config.flags
            & (TC_CFG_MASQUERADE_ALL | TC_CFG_CLUSTER_CIDR_V4 | TC_CFG_CLUSTER_CIDR_V6)
            != 0
    }

    /// Loads the tc programs once (maps adopted from the pins).
    fn ebpf(&mut self) -> Result<&mut Ebpf> {
        if self.ebpf.is_none() {
            let mut loader = crate::datapath::loader::new_loader();
            for name in crate::datapath::loader::pinned_maps() {
                loader.map_pin_path(name, self.dir.join(name));
            }
            let mut ebpf = loader.load(OBJECT).context("load the tc programs")?;
            for prog in [INGRESS_PROGRAM, EGRESS_PROGRAM, LC_GC_PROGRAM] {
                let p: &mut SchedClassifier = ebpf
                    .program_mut(prog)
                    .with_context(|| format!("program {prog} missing from the object"))?
                    .try_into()?;
                p.load()
                    .map_err(|e| anyhow::anyhow!("verify: program {prog} was rejected: {e:#}"))?;
            }
            // Only when asked for: a kernel that rejects it still runs the tcx path.
            if self.xdp != XdpSetting::Disabled {
                let p: &mut Xdp = ebpf
                    .program_mut(XDP_PROGRAM)
                    .with_context(|| format!("program {XDP_PROGRAM} missing from the object"))?
                    .try_into()?;
                p.load().map_err(|e| {
                    anyhow::anyhow!("verify: program {XDP_PROGRAM} was rejected: {e:#}")
                })?;
            }
            install_tail_calls(&mut ebpf)?;
            // Before any program of this load is attached.
            program_clock_or_warn(&mut ebpf);
            self.ebpf = Some(ebpf);
        }
        Ok(self.ebpf.as_mut().expect("loaded above"))
    }

    /// Gives back the least-connections counts of tc flows that ended without a FIN or RST
    /// seen by the data path: timed out (UDP, idle TCP) or evicted from the LRU conntrack.
    /// Every `TC_LC_FLOWS` key whose original-direction entry is missing, closed or idle
    /// beyond its timeout goes through `tc_lc_gc`, which checks again and releases the count
    /// atomically with the data path. Returns how many flows were released. Cheap when no
    /// least-connections Service has tc flows (the map is empty).
    pub(crate) fn collect_lc_flows(&mut self) -> Result<usize> {
        let flows: HashMap<MapData, CtKey, u32> = open(&self.dir, LC_FLOWS)?;
        let ct: HashMap<MapData, CtKey, CtEntry> = open(&self.dir, CONNTRACK)?;
        let now = monotonic_ns();
        let c = self.config;
        let dead: Vec<CtKey> = flows
            .keys()
            .filter_map(|k| k.ok())
            .filter(|k| match ct.get(k, 0) {
                Ok(e) => {
                    let timeout = ct_timeout_ns(
                        e.flags,
                        k.proto,
                        c.tcp_established_ns,
                        c.udp_ns,
                        c.udp_stream_ns,
                    );
                    ct_closed(e.flags) || !ct_alive(now, e.last_seen_ns, timeout)
                }
                Err(_) => true,
            })
            .collect();
        if dead.is_empty() {
            return Ok(0);
        }
        let ebpf = self.ebpf()?;
        let p: &mut SchedClassifier = ebpf
            .program_mut(LC_GC_PROGRAM)
            .with_context(|| format!("program {LC_GC_PROGRAM} missing from the object"))?
            .try_into()?;
        let mut released = 0;
        for k in dead {
            // 14 bytes standing for an Ethernet header (the kernel wants one), then the key.
            let mut data = [0u8; 14 + std::mem::size_of::<CtKey>()];
            // SAFETY: CtKey is plain old data (#[repr(C)], no padding holes left unset).
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    (&k as *const CtKey).cast::<u8>(),
                    std::mem::size_of::<CtKey>(),
                )
            };
            data[14..].copy_from_slice(bytes);
            let r = p
                .test_run(TestRunOptions {
                    data_in: Some(&data),
                    ..TestRunOptions::new()
                })
                .with_context(|| format!("run {LC_GC_PROGRAM}"))?;
            if r.return_value == 1 {
                released += 1;
            }
        }
        Ok(released)
    }

    /// Attaches the egress and ingress programs to `ifname` (replacing pinned links of an
    /// earlier agent only once the new ones are pinned). Egress first, so that no flow the
    /// ingress program translates has its replies leave untranslated. Then, for an
    /// `external` interface, the XDP program as `--xdp` says ([`TcKernel::attach_xdp`]).
    /// Returns the XDP mode the interface runs in (`None`: the tcx programs alone).
    ///
    /// Errors: a tcx attachment or pin failed; with `--xdp native`, the interface has no
    /// native XDP.
    pub(crate) fn attach(&mut self, ifname: &str, external: bool) -> Result<Option<XdpMode>> {
        if !self.tc_attached.contains(ifname) {
            self.attach_tc(ifname)?;
            self.tc_attached.insert(ifname.to_string());
        }
        self.attach_xdp(ifname, external)
    }

    fn attach_tc(&mut self, ifname: &str) -> Result<()> {
        let dir = self.dir.clone();
        let ebpf = self.ebpf()?;
        attach_pinned(
            ebpf,
            &dir,
            ifname,
            [
                (EGRESS_PROGRAM, TcAttachType::Egress),
                (INGRESS_PROGRAM, TcAttachType::Ingress),
            ],
        )
    }

    /// Attaches the XDP program to external interface `ifname` as `--xdp` says: native,
    /// else (best-effort) generic, else none. An XDP link of an earlier agent on the
    /// interface is removed first: an interface holds one XDP program, and the tcx programs
    /// (attached before this) serve it meanwhile. A pod-facing interface (`external` false)
    /// or `--xdp disabled` gets none (and loses an earlier agent's).
    ///
    /// A veth (kind and container-based nodes) gets no XDP unless `--xdp-veth-peers-ready`
    /// says its peer runs an XDP program: without one the frames the program forwards are
    /// lost ([`crate::datapath::veth`]). `--xdp native` refuses it with the remedies,
    /// `best-effort` leaves it to the tcx programs.
    pub(crate) fn attach_xdp(&mut self, ifname: &str, external: bool) -> Result<Option<XdpMode>> {
        self.detach_xdp(ifname)?;
        let unready_veth = external
            && self.xdp != XdpSetting::Disabled
            && !self.veth_peers_ready
            && crate::datapath::veth::is_veth(ifname);
        if unready_veth {
            if self.xdp == XdpSetting::Native {
                bail!("{}", crate::datapath::veth::native_refusal(ifname));
            }
            tracing::info!(interface = %ifname, "--xdp best-effort: a veth gets no XDP (frames it forwards need an XDP program on the peer; --xdp-veth-peers-ready when the peers have one): the tcx programs serve it");
            return Ok(None);
        }
        let modes: &[XdpMode] = match self.xdp {
            _ if !external => &[],
            XdpSetting::Disabled => &[],
            XdpSetting::Native => &[XdpMode::Native],
            XdpSetting::BestEffort => &[XdpMode::Native, XdpMode::Generic],
        };
        let setting = self.xdp;
        let dir = self.dir.clone();
        let mut errors = Vec::new();
        for &mode in modes {
            let ebpf = self.ebpf()?;
            let p: &mut Xdp = ebpf
                .program_mut(XDP_PROGRAM)
                .context("program missing")?
                .try_into()?;
            match p.attach(ifname, mode.aya()) {
                Ok(id) => {
                    let link: FdLink = p.take_link(id)?.try_into()?;
                    let pin = dir.join(xdp_link_name(mode, ifname));
                    link.pin(&pin)
                        .with_context(|| format!("pin {}", pin.display()))?;
                    return Ok(Some(mode));
                }
                Err(e) => errors.push(format!("{}: {e:#}", mode.as_str())),
            }
        }
        match setting {
            XdpSetting::Native => bail!(
                "--xdp native: {ifname}: cannot attach XDP in native mode (does its driver support XDP? `ebpf-proxy check` tells): {}",
                errors.join("; ")
            ),
            XdpSetting::BestEffort => {
                tracing::warn!(interface = %ifname, errors = %errors.join("; "), "--xdp best-effort: no XDP on this interface, the tcx programs serve it alone");
                Ok(None)
            }
            XdpSetting::Disabled => Ok(None),
        }
    }

    /// Removes the XDP link of `ifname` (any mode), if pinned.
    fn detach_xdp(&mut self, ifname: &str) -> Result<()> {
        for mode in [XdpMode::Native, XdpMode::Generic] {
            remove_link_pin(&self.dir.join(xdp_link_name(mode, ifname)))?;
        }
        Ok(())
    }

    /// Detaches the programs from `ifname` (removes its pinned links).
    pub(crate) fn detach(&mut self, ifname: &str) -> Result<()> {
        self.tc_attached.remove(ifname);
        self.detach_xdp(ifname)?;
        for prog in [INGRESS_PROGRAM, EGRESS_PROGRAM] {
            remove_link_pin(&self.dir.join(link_name(prog, ifname)))?;
        }
        Ok(())
    }

    /// Interfaces with a pinned ingress link in the pin directory.
    pub(crate) fn attached(&self) -> BTreeSet<String> {
        tc_interfaces(&self.dir)
    }

    /// Reads the tc maps the agent writes.
    pub(crate) fn snapshot(&self) -> Result<NodeSnapshot> {
        let mut s = NodeSnapshot::default();
        for k in self.local.keys() {
            s.local_endpoints
                .insert(k.context("iterate TC_LOCAL_ENDPOINTS")?);
        }
        for kv in self.ranges.iter() {
            let (k, v) = kv.context("iterate TC_SOURCE_RANGES")?;
            s.source_ranges.insert((k.prefix_len(), k.data()), v);
        }
        for kv in self.addrs.iter() {
            let (k, v) = kv.context("iterate TC_IFACE_ADDRS")?;
            s.iface_addrs.insert(k, v);
        }
        for kv in self.dsr.iter() {
            let (k, v) = kv.context("iterate TC_DSR")?;
            s.dsr.insert(k, v);
        }
        Ok(s)
    }

    /// `TC_DSR`.
    pub(crate) fn dsr(&mut self) -> &mut HashMap<MapData, DsrKey, DsrTarget> {
        &mut self.dsr
    }

    /// `TC_LOCAL_ENDPOINTS`.
    pub(crate) fn local_endpoints(&mut self) -> &mut HashMap<MapData, [u8; 16], u32> {
        &mut self.local
    }

    /// `TC_SOURCE_RANGES`.
    pub(crate) fn source_ranges(&mut self) -> &mut LpmTrie<MapData, SourceRange, u32> {
        &mut self.ranges
    }

    /// `TC_IFACE_ADDRS`.
    pub(crate) fn iface_addrs(&mut self) -> &mut HashMap<MapData, u32, IfaceAddr> {
        &mut self.addrs
    }
}
