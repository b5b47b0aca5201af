//! The real object's packet programs run through `BPF_PROG_TEST_RUN`: the object loaded
//! with its maps pinned in a private bpffs directory, maps seeded by the agent's own model
//! and reconciler ([`Harness::seed`]), packets built and checked byte by byte ([`Packet`],
//! [`step`]), programs run without lab namespaces, links or interfaces; nothing is
//! attached. Used by the packet-fixture tests (`tests/tc_fixtures.rs`, the packet scenario
//! files) and by the packet micro-benchmark (`ebpf-proxy-bench micro`, which times single
//! runs with [`Harness::run_timed`]).
//!
//! Each harness runs in a thread of its own moved into a fresh network namespace
//! ([`in_private_netns`]): `BPF_PROG_TEST_RUN` gives the program that namespace's loopback
//! device (ifindex 1) and FIB, so a FIB lookup finds no route and every result is the same
//! on every machine. The namespace dies with the thread; the pin directory is removed on
//! drop and a leftover of a crashed run is removed before use.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData},
    programs::{Program, SchedClassifier, TestRun, TestRunOptions, Xdp},
};
use proxy_common::{
    Backend, BackendSlot, BackendSlotKey, Config, Frontend, FrontendKey, MemberKey,
    nat::{CONNTRACK, CtEntry, CtKey, DsrKey, DsrTarget, IfaceAddr},
};
use proxy_userspace::{
    config::DEFAULT_UDP_FLOW_TIMEOUT,
    datapath::{
        Capacity, DatapathError, HealthServers, Interface, Interfaces, NodeMaps, NodeSnapshot,
        Released, ServiceMaps, Snapshot, SourceRangeKey,
        addr::ip_to_bytes,
        healthcheck::HealthCheckServers,
        kernel::KernelDatapath,
        loader::{self, MapSizes},
        maps::PinnedMaps,
        tc::{TcKernel, TcSettings},
    },
    model::{HealthCheck, Model, NodeInfo},
    reconcile::{NodeConfig, Reconciler},
    source::{ObjectSet, manifests::parse_documents},
};

mod packet;
pub use packet::*;

pub const BPFFS: &str = "/sys/fs/bpf";
/// tc return codes: `TCX_NEXT` (let through), `TC_ACT_SHOT`, `TC_ACT_REDIRECT`.
pub const PASS: i32 = -1;
pub const DROP: i32 = 2;
pub const REDIRECT: i32 = 7;
/// XDP return codes.
pub const XDP_DROP: i32 = 1;
pub const XDP_PASS: i32 = 2;
pub const XDP_TX: i32 = 3;
pub const XDP_REDIRECT: i32 = 4;
/// The XDP program of the external interfaces.
pub const XDP: &str = "xdp_ingress";
/// The ifindex `BPF_PROG_TEST_RUN` gives a tc program: the namespace's loopback device.
pub const TEST_IFINDEX: u32 = 1;
/// Name under which the fixture's data path reports the interface of [`TEST_IFINDEX`].
pub const TEST_IFNAME: &str = "fixture0";

/// Runs `f` in a new thread moved into a new network namespace of its own (`unshare`
/// affects the calling thread only); the namespace goes away with the thread. Panics of
/// `f` are propagated.
pub fn in_private_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        // SAFETY: unshare(2) on this thread only.
        let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            r,
            0,
            "unshare(CLONE_NEWNET): {} (the tc packet tests need root)",
            std::io::Error::last_os_error()
        );
        f()
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// Whether the calling thread is in the root network namespace (that of PID 1).
fn in_root_netns() -> bool {
    let ino = |p: &str| std::fs::metadata(p).map(|m| m.ino()).ok();
    ino("/proc/thread-self/ns/net") == ino("/proc/1/ns/net")
}

/// How the tc side of the agent is configured for a fixture.
#[derive(Clone, Debug, Default)]
pub struct TcOptions {
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--cluster-cidr`.
    pub cluster_cidrs: Vec<ipnet::IpNet>,
}

/// The data path the fixtures seed through the agent's reconciler: the agent's
/// [`KernelDatapath`] on the harness's pinned maps for everything the reconciler writes
/// (service maps, north-south maps; health-check servers, which the fixtures do not use),
/// and a stand-in for the network namespace's interfaces. The programs run through
/// `BPF_PROG_TEST_RUN` and see the packet arrive on [`TEST_IFINDEX`]; this data path
/// reports that index as the node's one external interface [`TEST_IFNAME`], carrying the
/// node's addresses, so the reconciler picks it and writes its SNAT addresses
/// (`TC_IFACE_ADDRS`) by its own rule. "Attaching" to it only records the name: a test run
/// needs no link. There are no routes, so no pod-facing interface is picked (as in the
/// fixture's empty namespace).
struct FixtureDatapath {
    kernel: KernelDatapath,
    /// The node's external interface, as [`Interfaces::interfaces`] reports it.
    iface: Interface,
    /// Interfaces the reconciler attached to (only ever [`TEST_IFNAME`]).
    attached: BTreeSet<String>,
}

impl ServiceMaps for FixtureDatapath {
    fn capacity(&self) -> Capacity {
        self.kernel.capacity()
    }
    fn snapshot(&self) -> Result<Snapshot, DatapathError> {
        self.kernel.snapshot()
    }
    fn put_frontend(&mut self, key: &FrontendKey, value: &Frontend) -> Result<(), DatapathError> {
        self.kernel.put_frontend(key, value)
    }
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), DatapathError> {
        self.kernel.delete_frontend(key)
    }
    fn put_slot(&mut self, key: &BackendSlotKey, value: &BackendSlot) -> Result<(), DatapathError> {
        self.kernel.put_slot(key, value)
    }
    fn delete_slot(&mut self, key: &BackendSlotKey) -> Result<(), DatapathError> {
        self.kernel.delete_slot(key)
    }
    fn put_backend(&mut self, id: u32, value: &Backend) -> Result<(), DatapathError> {
        self.kernel.put_backend(id, value)
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), DatapathError> {
        self.kernel.delete_backend(id)
    }
    fn put_name(&mut self, service_id: u32, name: &str) -> Result<(), DatapathError> {
        self.kernel.put_name(service_id, name)
    }
    fn delete_name(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.kernel.delete_name(service_id)
    }
    fn put_member(&mut self, key: &MemberKey, weight: u32) -> Result<(), DatapathError> {
        self.kernel.put_member(key, weight)
    }
    fn delete_member(&mut self, key: &MemberKey) -> Result<(), DatapathError> {
        self.kernel.delete_member(key)
    }
    fn get_maglev(&self, service_id: u32) -> Result<Option<Vec<u32>>, DatapathError> {
        self.kernel.get_maglev(service_id)
    }
    fn put_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<(), DatapathError> {
        self.kernel.put_maglev(service_id, table)
    }
    fn delete_maglev(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.kernel.delete_maglev(service_id)
    }
    fn release_stale(
        &mut self,
        released: &[(u32, u32, Backend)],
    ) -> Result<Released, DatapathError> {
        self.kernel.release_stale(released)
    }
}

impl NodeMaps for FixtureDatapath {
    fn node_snapshot(&self) -> Result<NodeSnapshot, DatapathError> {
        self.kernel.node_snapshot()
    }
    fn put_local_endpoint(&mut self, addr: &[u8; 16]) -> Result<(), DatapathError> {
        self.kernel.put_local_endpoint(addr)
    }
    fn delete_local_endpoint(&mut self, addr: &[u8; 16]) -> Result<(), DatapathError> {
        self.kernel.delete_local_endpoint(addr)
    }
    fn put_source_range(&mut self, key: &SourceRangeKey, value: u32) -> Result<(), DatapathError> {
        self.kernel.put_source_range(key, value)
    }
    fn delete_source_range(&mut self, key: &SourceRangeKey) -> Result<(), DatapathError> {
        self.kernel.delete_source_range(key)
    }
    fn put_iface_addr(&mut self, ifindex: u32, value: &IfaceAddr) -> Result<(), DatapathError> {
        self.kernel.put_iface_addr(ifindex, value)
    }
    fn delete_iface_addr(&mut self, ifindex: u32) -> Result<(), DatapathError> {
        self.kernel.delete_iface_addr(ifindex)
    }
    fn put_dsr(&mut self, key: &DsrKey, value: &DsrTarget) -> Result<(), DatapathError> {
        self.kernel.put_dsr(key, value)
    }
    fn delete_dsr(&mut self, key: &DsrKey) -> Result<(), DatapathError> {
        self.kernel.delete_dsr(key)
    }
}

impl Interfaces for FixtureDatapath {
    fn interfaces(&self) -> anyhow::Result<BTreeMap<String, Interface>> {
        Ok(BTreeMap::from([(
            TEST_IFNAME.to_string(),
            self.iface.clone(),
        )]))
    }
    fn route_device(&self, _ip: &IpAddr) -> Option<String> {
        None
    }
    fn attached(&self) -> BTreeSet<String> {
        self.attached.clone()
    }
    fn attach(
        &mut self,
        name: &str,
        _external: bool,
    ) -> anyhow::Result<Option<proxy_userspace::datapath::tc::XdpMode>> {
        anyhow::ensure!(name == TEST_IFNAME, "no interface {name:?} in the fixture");
        self.attached.insert(name.to_string());
        Ok(None)
    }
    fn detach(&mut self, name: &str) -> anyhow::Result<()> {
        self.attached.remove(name);
        Ok(())
    }
}

impl HealthServers for FixtureDatapath {
    fn serve_health(&mut self, port: u16, check: &HealthCheck) -> std::io::Result<()> {
        self.kernel.serve_health(port, check)
    }
    fn update_health(&mut self, port: u16, check: &HealthCheck) {
        self.kernel.update_health(port, check)
    }
    fn stop_health(&mut self, port: u16) {
        self.kernel.stop_health(port)
    }
}

/// The object with maps pinned under a private directory and the tc programs loaded.
pub struct Harness {
    pub dir: PathBuf,
    ebpf: Ebpf,
}

impl Harness {
    /// Loads the embedded object with small maps pinned under `/sys/fs/bpf/<name>` (a
    /// leftover of an earlier run removed first) and loads the tc programs and those of the
    /// bypassed pods' interfaces (`pod_ingress`, `pod_egress`) into the kernel.
    ///
    /// Must run in a private network namespace ([`in_private_netns`]), so the programs'
    /// FIB lookups see an empty namespace.
    pub fn new(name: &str) -> Harness {
        Harness::with_sizes(
            name,
            MapSizes {
                frontends: 1024,
                slots: 1024,
                backends: 1024,
                sockets: 1024,
                conntrack_flows: 1024,
            },
        )
    }

    /// [`Harness::new`] with the map sizes `sizes`.
    pub fn with_sizes(name: &str, sizes: MapSizes) -> Harness {
        assert!(
            !in_root_netns(),
            "the tc packet fixtures run in a private network namespace: call Harness::new inside in_private_netns"
        );
        assert!(
            !loader::OBJECT.is_empty(),
            "built without the eBPF object: run `cargo xtask build-ebpf` first"
        );
        loader::ensure_bpffs(Path::new(BPFFS)).expect("bpffs");
        let dir = Path::new(BPFFS).join(format!("ebpf-proxy-fixture-{name}"));
        let _ = loader::cleanup(&dir);
        // Until the harness owns the pins, a failed load (a panic below) removes them.
        let pins = PinsGuard(Some(dir));
        let dir = pins.0.as_deref().expect("set above");
        let mut ebpf = loader::load_pinned(dir, sizes).expect("load the object with pinned maps");
        for prog in [
            "tc_ingress",
            "tc_egress",
            "tc_lc_gc",
            "pod_ingress",
            "pod_egress",
        ] {
            let p: &mut SchedClassifier = ebpf
                .program_mut(prog)
                .expect("program in the object")
                .try_into()
                .expect("a tc program");
            p.load().unwrap_or_else(|e| panic!("load {prog}: {e:#}"));
        }
        let p: &mut Xdp = ebpf
            .program_mut(XDP)
            .expect("program in the object")
            .try_into()
            .expect("an XDP program");
        p.load().unwrap_or_else(|e| panic!("load {XDP}: {e:#}"));
        proxy_userspace::datapath::tc::install_tail_calls(&mut ebpf).expect("tail calls");
        // The agent's conntrack clock (jiffies): every fixture checks it calibrates here.
        proxy_userspace::datapath::tc::program_clock(&mut ebpf)
            .expect("conntrack clock")
            .expect("the jiffies fit a CONFIG_HZ");
        Harness {
            dir: pins.disarm(),
            ebpf,
        }
    }

    /// Seeds the maps as the agent does for the objects in `yaml` on node `node`: a
    /// [`Model`] fed every object and committed; the configurations written (`CONFIG`, and
    /// `TC_CONFIG` by [`TcKernel::new`] from `tc`); then the agent's first reconcile over
    /// the pinned maps: [`Reconciler::adopt`], [`Reconciler::apply_all`] (service maps,
    /// node-local endpoints, source ranges, interfaces and their SNAT addresses) and
    /// [`Reconciler::verify`]. Every map write goes through the agent's
    /// [`KernelDatapath`]; only the interfaces are the fixture's (`FixtureDatapath`).
    /// Returns the model.
    ///
    /// This is the one place that knows how the agent fills the maps: when the agent's
    /// reconciler API changes, only this function changes.
    pub fn seed(&self, yaml: &str, node: &str, tc: &TcOptions) -> Model {
        let (objs, errors) = parse_documents("fixture.yaml", yaml);
        assert!(errors.is_empty(), "fixture errors: {errors:?}");
        let mut objects = ObjectSet::default();
        for o in objs {
            objects.insert(o);
        }
        let node = NodeInfo {
            name: node.into(),
            ..Default::default()
        };
        let model = Model::from_objects(&objects, &node);
        assert!(
            model.errors().is_empty(),
            "model errors: {:?}",
            model.errors()
        );
        assert!(
            model.health_checks().is_empty(),
            "a healthCheckNodePort server needs a tokio runtime, which the fixtures do not run"
        );

        let maps = PinnedMaps::open(&self.dir).expect("open the pinned maps");
        maps.write_config(&Config {
            udp_flow_timeout_ns: DEFAULT_UDP_FLOW_TIMEOUT.as_nanos() as u64,
            _reserved: 0,
        })
        .expect("write CONFIG");
        let settings = TcSettings {
            masquerade_all: tc.masquerade_all,
            ..Default::default()
        };
        let tc_kernel = TcKernel::new(
            &self.dir,
            &settings,
            &tc.cluster_cidrs,
            DEFAULT_UDP_FLOW_TIMEOUT,
        )
        .expect("write TC_CONFIG, open the tc maps");
        let config = NodeConfig {
            interfaces: Vec::new(),
            snat_local: tc_kernel.snat_local(),
        };
        let mut dp = FixtureDatapath {
            kernel: KernelDatapath {
                maps,
                tc: tc_kernel,
                health: HealthCheckServers::default(),
            },
            iface: Interface {
                index: TEST_IFINDEX,
                addrs: model.node().addresses.iter().map(|a| a.ip).collect(),
            },
            attached: BTreeSet::new(),
        };
        let mut reconciler =
            Reconciler::adopt(&dp, config, Duration::from_secs(30)).expect("adopt the maps");
        let now = Instant::now();
        let out = reconciler.apply_all(&mut dp, &model, now);
        assert!(out.failed.is_empty(), "reconcile: {:?}", out.failed);
        let v = reconciler.verify(&mut dp, &model, now);
        assert!(v.failed.is_empty(), "verify: {:?}", v.failed);
        assert!(
            reconciler.node.errors().is_empty(),
            "reconcile: {:?}",
            reconciler.node.errors()
        );
        assert_eq!(
            reconciler.node.interfaces().collect::<Vec<_>>(),
            [TEST_IFNAME],
            "the reconciler picks the fixture's interface"
        );
        model
    }

    /// Opens a pinned map of the harness.
    pub fn map<T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>>(&self, name: &str) -> T {
        let data = MapData::from_pin(self.dir.join(name)).expect("pinned map");
        T::try_from(aya::maps::Map::from_map_data(data).expect("map")).expect("map type")
    }

    /// Runs program `prog` on `frame`: its return code and the frame it left. Panics when
    /// the kernel refuses to run it (see [`runnable`]).
    pub fn run(&self, prog: &str, frame: &[u8]) -> (i32, Vec<u8>) {
        self.try_run(prog, frame)
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {prog} on {} bytes: {e}", frame.len()))
    }

    /// [`Harness::run`], with the kernel's refusal as an error. `prog` is a tc program or
    /// [`XDP`] (which sees the frame arrive on [`TEST_IFINDEX`] too).
    pub fn try_run(&self, prog: &str, frame: &[u8]) -> std::io::Result<(i32, Vec<u8>)> {
        let mut out = Vec::new();
        let (v, _) = test_run(self.program(prog), frame, &mut out)?;
        Ok((v, out))
    }

    /// Runs program `prog` once on `frame` (as [`Harness::try_run`]) leaving the frame it
    /// left in `out` (its capacity reused): its return code and the run time the kernel
    /// reports (from a clock read before the program to one after it, so a few tens of
    /// nanoseconds of the clock's own cost are included).
    pub fn run_timed(
        &self,
        prog: &str,
        frame: &[u8],
        out: &mut Vec<u8>,
    ) -> std::io::Result<(i32, Duration)> {
        test_run(self.program(prog), frame, out)
    }

    /// Program `prog` of the object (loaded).
    pub fn program(&self, prog: &str) -> &Program {
        self.ebpf.program(prog).expect("program in the object")
    }

    /// The tc counters, by name.
    pub fn counters(&self) -> BTreeMap<&'static str, u64> {
        proxy_userspace::datapath::tc::counters(&self.dir).expect("counters")
    }

    /// Every conntrack entry.
    pub fn conntrack(&self) -> Vec<(CtKey, CtEntry)> {
        let m: HashMap<MapData, CtKey, CtEntry> = self.map(CONNTRACK);
        m.iter().filter_map(|r| r.ok()).collect()
    }

    /// Removes every conntrack entry: the flows this node knew are lost (as when the LRU
    /// table evicts them, or for a node that never saw them).
    pub fn forget_flows(&self) {
        let mut m: HashMap<MapData, CtKey, CtEntry> = self.map(CONNTRACK);
        let keys: Vec<CtKey> = m.keys().filter_map(|k| k.ok()).collect();
        for k in keys {
            m.remove(&k).expect("remove a conntrack entry");
        }
    }

    /// The SNAT source port of the flow from `client` to backend `backend` (its SNAT stage).
    pub fn snat_port(&self, client: SocketAddr, backend: SocketAddr, proto: u8) -> Option<u16> {
        let key = CtKey {
            saddr: ip_to_bytes(client.ip()),
            daddr: ip_to_bytes(backend.ip()),
            sport: client.port().to_be_bytes(),
            dport: backend.port().to_be_bytes(),
            proto,
            _pad: [0; 3],
        };
        let m: HashMap<MapData, CtKey, CtEntry> = self.map(CONNTRACK);
        m.get(&key, 0).ok().map(|e| u16::from_be_bytes(e.sport))
    }
}

/// Runs `program` (a tc or XDP program, loaded) once through `BPF_PROG_TEST_RUN` on
/// `frame`, leaving the frame it left in `out` (room for 256 more bytes than `frame`):
/// its return code and the kernel's run time. Repeats are never asked of the kernel: it
/// would run the program again on the frame the first run left.
pub fn test_run(
    program: &Program,
    frame: &[u8],
    out: &mut Vec<u8>,
) -> std::io::Result<(i32, Duration)> {
    out.clear();
    out.resize(frame.len() + 256, 0);
    let opts = TestRunOptions {
        data_in: Some(frame),
        data_out: Some(out.as_mut_slice()),
        ..TestRunOptions::new()
    };
    let r = match program {
        Program::Xdp(p) => p.test_run(opts),
        Program::SchedClassifier(p) => p.test_run(opts),
        _ => return Err(std::io::Error::other("not a tc or XDP program")),
    };
    let r = r.map_err(|e| match e {
        aya::programs::ProgramError::SyscallError(s) => s.io_error,
        e => std::io::Error::other(e.to_string()),
    })?;
    out.truncate(r.data_size_out as usize);
    Ok((r.return_value as i32, r.duration))
}

/// A pin directory removed on drop unless [`PinsGuard::disarm`]ed: the harness's pins
/// while it is being built.
struct PinsGuard(Option<PathBuf>);

impl PinsGuard {
    /// The directory, now the caller's to clean up.
    fn disarm(mut self) -> PathBuf {
        self.0.take().expect("armed")
    }
}

impl Drop for PinsGuard {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = loader::cleanup(&dir);
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = loader::cleanup(&self.dir);
    }
}
