//! The kernel side of the socket-level bypass (`proxy_common::bypass`, `model::bypass`):
//! for each pod of this node that bypasses socket-level translation, its network namespace
//! cookie goes into `BYPASS_NETNS` (the socket programs then leave its sockets alone) and
//! `pod_ingress`/`pod_egress` are attached (tcx) to the node side of its interface, where
//! its Service traffic is translated per packet. Only those interfaces get the programs:
//! other pods' packets pay nothing.
//!
//! From a Pod object to what the kernel checks, the way that works for a real kubelet and
//! in the namespace lab alike:
//! 1. the pod's cgroup: kubelet names it after the pod UID, `pod<uid>` (cgroupfs driver,
//!    e.g. `kubepods/burstable/pod<uid>`) or `kubepods-<qos>-pod<uid with _>.slice`
//!    (systemd driver); it is searched under the attach cgroup (`--cgroup-path`), at most
//!    five levels down;
//! 2. a process in it (the sandbox's pause process, or any container's) and its network
//!    namespace, `/proc/<pid>/ns/net`;
//! 3. inside that namespace (a short-lived thread that `setns`es into it): its cookie
//!    (`SO_NETNS_COOKIE`, Linux >= 5.14: the value `bpf_get_netns_cookie` returns) and the
//!    veth whose peer lives in another namespace (`eth0` preferred), whose `IFLA_LINK` is
//!    the ifindex of the node-side end in the agent's namespace.
//!
//! An alternative identity would be the pod's cgroup id (`bpf_get_current_cgroup_id` and
//! its ancestors in the socket programs): it needs no namespace entry, but a container's
//! cgroup sits one or two levels under the pod's (by QoS class), and it says nothing about
//! the interface, which the per-packet path needs anyway. The namespace cookie covers both.
//!
//! The pod's interface is looked up again when its object changes (a new sandbox has a new
//! namespace and veth) and at every verification (`--sync-period`). Links are pinned as
//! `link_pod_ingress_<if>` and `link_pod_egress_<if>`; an agent that starts adopts them and
//! removes those of pods no longer bypassed.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData},
    programs::{SchedClassifier, TcAttachType, links::PinnedLink},
};
use proxy_common::bypass::{
    BYPASS_CFG_HOST_ONLY, BYPASS_CFG_PODS, BYPASS_CONFIG, BYPASS_NETNS, BYPASS_POD, BypassConfig,
};
use tracing::info;

use crate::datapath::loader::OBJECT;

/// `--socket-lb-scope`: which network namespaces the socket programs translate.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SocketLbScope {
    /// Every socket of the attached cgroup (pods and the node's own processes).
    #[default]
    All,
    /// Only sockets of the node's own network namespace; every pod is translated per
    /// packet (Cilium's `socketLB.hostNamespaceOnly`).
    HostOnly,
}

impl SocketLbScope {
    /// The flag's value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SocketLbScope::All => "all",
            SocketLbScope::HostOnly => "host-only",
        }
    }
}

/// A pod of this node that bypasses socket-level translation.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct BypassedPod {
    /// `metadata.namespace`.
    pub(crate) namespace: String,
    /// `metadata.name`.
    pub(crate) name: String,
    /// `metadata.uid`: how the agent finds the pod's cgroup (kubelet names it after the
    /// UID) and from it the pod's network namespace and interface.
    pub(crate) uid: String,
    /// `status.podIPs`.
    pub(crate) ips: Vec<IpAddr>,
    /// Changes whenever the pod may have a new sandbox (network namespace): its
    /// `resourceVersion`, else its IPs; the agent resolves the pod again then.
    pub(crate) version: String,
    /// Why it is bypassed: `pod`, `namespace` or `host-only`.
    pub(crate) reason: &'static str,
}

/// The program on the ingress of a bypassed pod's node-side interface (packets leaving
/// the pod).
pub(crate) const POD_INGRESS_PROGRAM: &str = "pod_ingress";
/// The program on its egress (packets entering the pod).
pub(crate) const POD_EGRESS_PROGRAM: &str = "pod_egress";

/// `SO_NETNS_COOKIE` (`include/uapi/asm-generic/socket.h`, Linux >= 5.14).
const SO_NETNS_COOKIE: libc::c_int = 71;

/// Where a bypassed pod was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PodNet {
    /// Its network namespace cookie.
    pub(crate) netns_cookie: u64,
    /// The node-side end of its veth: ifindex in the agent's namespace.
    pub(crate) ifindex: u32,
    /// Its name.
    pub(crate) ifname: String,
}

/// A bypassed pod as programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Programmed {
    /// `namespace/name`.
    pub(crate) pod: String,
    /// [`BypassedPod::version`] when it was resolved.
    pub(crate) version: String,
    /// Where it was found.
    pub(crate) net: PodNet,
    /// [`BypassedPod::reason`].
    pub(crate) reason: &'static str,
}

/// The network namespace cookie of the calling thread's namespace.
pub(crate) fn netns_cookie() -> io::Result<u64> {
    // SAFETY: socket(2); the descriptor is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt(2) into a u64 we own, with its size.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    let err = io::Error::last_os_error();
    // SAFETY: our descriptor.
    unsafe { libc::close(fd) };
    if r != 0 {
        return Err(err);
    }
    Ok(cookie)
}

/// Interfaces of the calling thread's namespace whose veth peer lives in another namespace:
/// (name, peer ifindex there), from an `RTM_GETLINK` dump (`IFLA_LINK` with
/// `IFLA_LINK_NETNSID`).
pub(crate) fn veth_peers() -> io::Result<Vec<(String, u32)>> {
    const RTM_GETLINK: u16 = 18;
    const RTM_NEWLINK: u16 = 16;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    const IFLA_IFNAME: u16 = 3;
    const IFLA_LINK: u16 = 5;
    const IFLA_LINK_NETNSID: u16 = 37;
    // SAFETY: socket(2); closed by the guard below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    struct Close(i32);
    impl Drop for Close {
        fn drop(&mut self) {
            // SAFETY: our descriptor.
            unsafe { libc::close(self.0) };
        }
    }
    let _guard = Close(fd);
    // nlmsghdr (16 bytes) + ifinfomsg (16 bytes, AF_UNSPEC: every interface).
    let mut req = [0u8; 32];
    req[0..4].copy_from_slice(&32u32.to_ne_bytes());
    req[4..6].copy_from_slice(&RTM_GETLINK.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // SAFETY: send(2) of a buffer we own.
    if unsafe { libc::send(fd, req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: recv(2) into a buffer we own, with its length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        if n == 0 {
            return Ok(out);
        }
        let u16_at = |o: usize| u16::from_ne_bytes([buf[o], buf[o + 1]]);
        let u32_at = |o: usize| u32::from_ne_bytes([buf[o], buf[o + 1], buf[o + 2], buf[o + 3]]);
        let mut off = 0;
        while off + 16 <= n {
            let len = u32_at(off) as usize;
            let ty = u16_at(off + 4);
            if len < 16 || off + len > n {
                break;
            }
            match ty {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let errno = if len >= 20 {
                        u32_at(off + 16) as i32
                    } else {
                        0
                    };
                    return Err(io::Error::from_raw_os_error(-errno));
                }
                RTM_NEWLINK if len >= 32 => {
                    let (mut name, mut link, mut other_ns) = (String::new(), 0u32, false);
                    let mut a = off + 32;
                    while a + 4 <= off + len {
                        let alen = u16_at(a) as usize;
                        let aty = u16_at(a + 2) & 0x3fff;
                        if alen < 4 || a + alen > off + len {
                            break;
                        }
                        let data = &buf[a + 4..a + alen];
                        match aty {
                            IFLA_IFNAME => {
                                let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
                                name = String::from_utf8_lossy(&data[..end]).into_owned();
                            }
                            IFLA_LINK if data.len() >= 4 => link = u32_at(a + 4),
                            IFLA_LINK_NETNSID => other_ns = true,
                            _ => {}
                        }
                        a += (alen + 3) & !3;
                    }
                    if other_ns && link != 0 {
                        out.push((name, link));
                    }
                }
                _ => {}
            }
            off += (len + 3) & !3;
        }
    }
}

/// The cgroup kubelet made for the pod with UID `uid` under `root` (see the module
/// documentation), at most five levels down.
pub(crate) fn find_pod_cgroup(root: &Path, uid: &str) -> Option<PathBuf> {
    let under = uid.replace('-', "_");
    let plain = [format!("pod{uid}"), format!("pod{under}")];
    let slice = format!("-pod{under}.slice");
    let mut level = vec![root.to_path_buf()];
    for _ in 0..5 {
        let mut next = Vec::new();
        for dir in level {
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                if !e.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                let name = e.file_name();
                let name = name.to_string_lossy();
                if plain.iter().any(|p| *p == name) || name.ends_with(&slice) {
                    return Some(e.path());
                }
                next.push(e.path());
            }
        }
        level = next;
    }
    None
}

/// A process in cgroup `dir` or in one of its descendants (containers), three levels down.
fn pid_in(dir: &Path, depth: u32) -> Option<u32> {
    let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    if let Some(pid) = procs.lines().find_map(|l| l.trim().parse().ok()) {
        return Some(pid);
    }
    if depth == 0 {
        return None;
    }
    fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .find_map(|e| pid_in(&e.path(), depth - 1))
}

/// Finds pod `uid` under cgroup `root`: its namespace cookie and the node side of its
/// interface (see the module documentation).
pub(crate) fn resolve_pod(root: &Path, uid: &str) -> Result<PodNet> {
    if uid.is_empty() {
        bail!("the Pod has no metadata.uid");
    }
    let cg = find_pod_cgroup(root, uid)
        .with_context(|| format!("no cgroup pod{uid} under {}", root.display()))?;
    let pid = pid_in(&cg, 3).with_context(|| format!("no process in {}", cg.display()))?;
    let ns = File::open(format!("/proc/{pid}/ns/net"))
        .with_context(|| format!("open the network namespace of pid {pid}"))?;
    let fd = ns.as_raw_fd();
    let (cookie, peers) = std::thread::scope(|s| {
        s.spawn(move || -> io::Result<(u64, Vec<(String, u32)>)> {
            // SAFETY: setns(2) of this short-lived thread only (network namespaces are
            // per thread).
            if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok((netns_cookie()?, veth_peers()?))
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
    })
    .with_context(|| format!("read the network namespace of pid {pid}"))?;
    let (_, ifindex) = peers
        .iter()
        .find(|(n, _)| n == "eth0")
        .or(peers.first())
        .with_context(|| format!("no veth to another namespace in the namespace of pid {pid}"))?;
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: if_indextoname(3) into a buffer of IF_NAMESIZE bytes.
    let p = unsafe { libc::if_indextoname(*ifindex, name.as_mut_ptr()) };
    if p.is_null() {
        bail!(
            "the peer of the pod's interface (ifindex {ifindex}) is not in the agent's network namespace"
        );
    }
    // SAFETY: NUL-terminated by if_indextoname.
    let ifname = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Ok(PodNet {
        netns_cookie: cookie,
        ifindex: *ifindex,
        ifname,
    })
}

fn link_name(prog: &str, ifname: &str) -> String {
    format!("link_{prog}_{ifname}")
}

fn open<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(
    dir: &Path,
    name: &str,
) -> Result<T> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).with_context(|| format!("open {}", path.display()))?;
    let map = aya::maps::Map::from_map_data(data)?;
    T::try_from(map).with_context(|| format!("open {name}"))
}

/// Interfaces with a pinned `pod_ingress` link in pin directory `dir`.
pub fn attached_pods(dir: &Path) -> BTreeSet<String> {
    super::tc::linked_interfaces(dir, POD_INGRESS_PROGRAM)
}

/// The bypass configuration and namespaces pinned under `dir`: (config, cookies).
pub fn read_pinned(dir: &Path) -> Result<(BypassConfig, Vec<u64>)> {
    let cfg: Array<MapData, BypassConfig> = open(dir, BYPASS_CONFIG)?;
    let ns: HashMap<MapData, u64, u32> = open(dir, BYPASS_NETNS)?;
    Ok((
        cfg.get(&0, 0).unwrap_or_default(),
        ns.keys().filter_map(|k| k.ok()).collect(),
    ))
}

/// The bypass of one pin directory: its maps, its programs (loaded on first use) and what
/// is programmed, per pod UID.
pub(crate) struct BypassKernel {
    dir: PathBuf,
    cgroup_root: PathBuf,
    scope: SocketLbScope,
    host_netns: u64,
    ebpf: Option<Ebpf>,
    config: Array<MapData, BypassConfig>,
    netns: HashMap<MapData, u64, u32>,
    programmed: BTreeMap<String, Programmed>,
    failures: BTreeMap<String, String>,
    adopted: bool,
}

impl BypassKernel {
    /// Opens the bypass maps pinned under `dir`; pods are searched under cgroup
    /// `cgroup_root`. The node's own namespace is the calling thread's.
    pub(crate) fn new(dir: &Path, cgroup_root: &Path, scope: SocketLbScope) -> Result<Self> {
        Ok(Self {
            dir: dir.to_path_buf(),
            cgroup_root: cgroup_root.to_path_buf(),
            scope,
            host_netns: netns_cookie().context("read the node's network namespace cookie")?,
            ebpf: None,
            config: open(dir, BYPASS_CONFIG)?,
            netns: open(dir, BYPASS_NETNS)?,
            programmed: BTreeMap::new(),
            failures: BTreeMap::new(),
            adopted: false,
        })
    }

    fn ebpf(&mut self) -> Result<&mut Ebpf> {
        if self.ebpf.is_none() {
            let mut loader = crate::datapath::loader::new_loader();
            for name in crate::datapath::loader::pinned_maps() {
                loader.map_pin_path(name, self.dir.join(name));
            }
            let mut ebpf = loader.load(OBJECT).context("load the pod programs")?;
            for prog in [POD_INGRESS_PROGRAM, POD_EGRESS_PROGRAM] {
                let p: &mut SchedClassifier = ebpf
                    .program_mut(prog)
                    .with_context(|| format!("program {prog} missing from the object"))?
                    .try_into()?;
                p.load()
                    .map_err(|e| anyhow::anyhow!("verify: program {prog} was rejected: {e:#}"))?;
            }
            // `pod_ingress` rejects a first packet to a Service without endpoints through
            // the tail-call table of this load.
            crate::datapath::tc::install_tail_calls(&mut ebpf)?;
            // Before any program of this load is attached.
            crate::datapath::tc::program_clock_or_warn(&mut ebpf);
            self.ebpf = Some(ebpf);
        }
        Ok(self.ebpf.as_mut().expect("loaded above"))
    }

    /// Attaches the pod programs to `ifname`, egress first (no flow is started whose
    /// replies would enter the pod untranslated), replacing pinned links of an earlier
    /// agent once the new ones are pinned.
    fn attach(&mut self, ifname: &str) -> Result<()> {
        let dir = self.dir.clone();
        let ebpf = self.ebpf()?;
        crate::datapath::tc::attach_pinned(
            ebpf,
            &dir,
            ifname,
            [
                (POD_EGRESS_PROGRAM, TcAttachType::Egress),
                (POD_INGRESS_PROGRAM, TcAttachType::Ingress),
            ],
        )
    }

    /// Detaches the pod programs from `ifname` (ingress first: no new flow starts whose
    /// replies would find no program).
    fn detach(&self, ifname: &str) {
        for prog in [POD_INGRESS_PROGRAM, POD_EGRESS_PROGRAM] {
            let pin = self.dir.join(link_name(prog, ifname));
            if let Ok(l) = PinnedLink::from_pin(&pin) {
                drop(l.unpin());
            }
            let _ = fs::remove_file(&pin);
        }
    }

    fn attached(&self, ifname: &str) -> bool {
        [POD_INGRESS_PROGRAM, POD_EGRESS_PROGRAM]
            .iter()
            .all(|p| self.dir.join(link_name(p, ifname)).exists())
    }

    /// Programs the bypass for `pods` (the model's `Model::bypassed`).
    /// A pod already programmed is looked up again when its version changed or with
    /// `recheck` (a verification). Order, so that a pod is never left without a path: the
    /// programs are attached before its namespace is listed (its sockets leave the socket
    /// path), and its namespace is unlisted before they are detached. Returns one line per
    /// pod that cannot be bypassed (the first time it fails that way), for the log; such a
    /// pod keeps socket-level translation, unless the scope is `host-only`.
    pub(crate) fn sync(&mut self, pods: &[BypassedPod], recheck: bool) -> Vec<String> {
        let mut errors = Vec::new();
        let wanted: BTreeMap<&str, &BypassedPod> =
            pods.iter().map(|p| (p.uid.as_str(), p)).collect();
        let gone: Vec<String> = self
            .programmed
            .keys()
            .filter(|u| !wanted.contains_key(u.as_str()))
            .cloned()
            .collect();
        for uid in gone {
            let p = self.programmed.remove(&uid).expect("listed above");
            self.failures.remove(&uid);
            let _ = self.netns.remove(&p.net.netns_cookie);
            if !self
                .programmed
                .values()
                .any(|o| o.net.ifname == p.net.ifname)
            {
                self.detach(&p.net.ifname);
            }
            info!(pod = %p.pod, interface = %p.net.ifname, "pod no longer bypasses socket-level translation");
        }
        self.failures.retain(|u, _| wanted.contains_key(u.as_str()));
        for pod in pods {
            let shown = format!("{}/{}", pod.namespace, pod.name);
            let old = self.programmed.get(&pod.uid).cloned();
            if let Some(o) = &old
                && !recheck
                && o.version == pod.version
            {
                continue;
            }
            match self.program(pod, old.as_ref()) {
                Ok(p) => {
                    self.failures.remove(&pod.uid);
                    if old.as_ref().map(|o| &o.net) != Some(&p.net) {
                        info!(pod = %shown, reason = p.reason, interface = %p.net.ifname, netns_cookie = p.net.netns_cookie, "pod bypasses socket-level translation: its Service traffic is translated per packet");
                    }
                    self.programmed.insert(pod.uid.clone(), p);
                }
                Err(e) => {
                    let msg = format!("pod {shown} cannot bypass socket-level translation: {e:#}");
                    if self.failures.insert(pod.uid.clone(), msg.clone()).as_ref() != Some(&msg) {
                        errors.push(msg);
                    }
                    // A pod whose sandbox is gone keeps nothing programmed.
                    if let Some(o) = self.programmed.remove(&pod.uid) {
                        let _ = self.netns.remove(&o.net.netns_cookie);
                        if !self
                            .programmed
                            .values()
                            .any(|x| x.net.ifname == o.net.ifname)
                        {
                            self.detach(&o.net.ifname);
                        }
                    }
                }
            }
        }
        if !self.adopted {
            // What an earlier agent programmed for pods no longer bypassed.
            self.adopted = true;
            let keep: BTreeSet<&str> = self
                .programmed
                .values()
                .map(|p| p.net.ifname.as_str())
                .collect();
            for ifname in attached_pods(&self.dir) {
                if !keep.contains(ifname.as_str()) {
                    self.detach(&ifname);
                }
            }
            let cookies: BTreeSet<u64> = self
                .programmed
                .values()
                .map(|p| p.net.netns_cookie)
                .collect();
            let stale: Vec<u64> = self
                .netns
                .keys()
                .filter_map(|k| k.ok())
                .filter(|k| !cookies.contains(k))
                .collect();
            for k in stale {
                let _ = self.netns.remove(&k);
            }
        }
        let mut flags = 0;
        if self.scope == SocketLbScope::HostOnly {
            flags |= BYPASS_CFG_HOST_ONLY;
        }
        if !self.programmed.is_empty() {
            flags |= BYPASS_CFG_PODS;
        }
        let cfg = BypassConfig {
            flags,
            _pad: 0,
            host_netns: self.host_netns,
        };
        if let Err(e) = self.config.set(0, cfg, 0) {
            errors.push(format!("write {BYPASS_CONFIG}: {e}"));
        }
        errors
    }

    /// Resolves and programs one pod (`old`: what was programmed for it).
    fn program(&mut self, pod: &BypassedPod, old: Option<&Programmed>) -> Result<Programmed> {
        let net = resolve_pod(&self.cgroup_root, &pod.uid)?;
        if old.map(|o| &o.net) != Some(&net) || !self.attached(&net.ifname) {
            self.attach(&net.ifname)?;
        }
        self.netns
            .insert(net.netns_cookie, BYPASS_POD, 0)
            .with_context(|| format!("write {BYPASS_NETNS}"))?;
        if let Some(o) = old {
            if o.net.netns_cookie != net.netns_cookie {
                let _ = self.netns.remove(&o.net.netns_cookie);
            }
            if o.net.ifname != net.ifname
                && !self
                    .programmed
                    .iter()
                    .any(|(u, x)| *u != pod.uid && x.net.ifname == o.net.ifname)
            {
                self.detach(&o.net.ifname);
            }
        }
        Ok(Programmed {
            pod: format!("{}/{}", pod.namespace, pod.name),
            version: pod.version.clone(),
            net,
            reason: pod.reason,
        })
    }
}
