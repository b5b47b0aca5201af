//! Fixture of the privileged integration tests: a lab of pod namespaces on a bridge, a child
//! cgroup for the clients, a manifest directory, the real agent attached to that cgroup with
//! its own pin directory, and netprobe servers in the backend pods.
//!
//! Everything lives in namespaces, a cgroup and a pin directory created here, and is removed
//! on drop, also when the test panics. Names are per test, so a leftover of a crashed run is
//! replaced by the next run of the same test.

#![allow(dead_code)]

mod objects;

pub use objects::*;

use std::{
    collections::BTreeMap,
    ffi::OsStr,
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use proxy_testkit::testbed::{ChildGuard, Lab, Pod, TestCgroup, ensure_bpffs, is_root, spawn_in};
use proxy_userspace::datapath::{
    ServiceMaps, Snapshot, loader, maps::PinnedMaps, view::PinnedView,
};

/// The agent binary `ebpf-proxy`, for `Command::new(AGENT)`; resolved on first use by
/// [`agent_path`].
pub const AGENT: AgentBin = AgentBin;
pub const NETPROBE: &str = env!("CARGO_BIN_EXE_netprobe");
pub const BPFFS: &str = "/sys/fs/bpf";

/// Names the agent binary: a path-like value (`AsRef<OsStr>`) that [`agent_path`] resolves.
#[derive(Clone, Copy, Debug)]
pub struct AgentBin;

impl AsRef<OsStr> for AgentBin {
    fn as_ref(&self) -> &OsStr {
        agent_path().as_os_str()
    }
}

/// Where the agent binary is. It belongs to the `proxy-userspace` package, so cargo gives
/// these tests (of `proxy-testkit`) no `CARGO_BIN_EXE_ebpf-proxy`. It is `$EBPF_PROXY_BIN`
/// when set, else `ebpf-proxy` in the profile directory of this test executable
/// (`target/<profile>/deps/<test>-<hash>` -> `target/<profile>/ebpf-proxy`), where `cargo
/// xtask test` builds it before running the tests. Panics, naming the fix, when it is missing.
pub fn agent_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let (path, from) = match std::env::var_os("EBPF_PROXY_BIN") {
            Some(p) => (PathBuf::from(p), "$EBPF_PROXY_BIN"),
            None => {
                let exe = std::env::current_exe().expect("path of the test executable");
                let profile = exe
                    .parent()
                    .and_then(Path::parent)
                    .expect("test executable in target/<profile>/deps/");
                (
                    profile.join("ebpf-proxy"),
                    "the test executable's target directory",
                )
            }
        };
        assert!(
            path.is_file(),
            "agent binary {} (from {from}) not found: run the tests with `cargo xtask test`, \
             which builds it first, or build it with `cargo build --release -p proxy-userspace` \
             (same profile as the tests), or set EBPF_PROXY_BIN to its path",
            path.display()
        );
        path
    })
}

/// One line of netprobe output.
pub type Probe = serde_json::Value;

pub struct Env {
    pub name: String,
    pub pin_dir: String,
    pub manifests: tempfile::TempDir,
    pub agent: Option<ChildGuard>,
    pub agent_log: PathBuf,
    pub servers: Vec<ChildGuard>,
    pub client: Pod,
    pub backends: Vec<Pod>,
    pub extra_agent_args: Vec<String>,
    /// The network namespace the agent runs in; `None`: the test's own. The per-packet
    /// path of bypassed pods needs the node namespace, where their veths have their node
    /// side (its servers then listen there too, out of the test's reach).
    pub agent_netns: Option<PathBuf>,
    // Dropped after the processes above are gone: cgroup, then the lab.
    pub cg: TestCgroup,
    pub lab: Lab,
}

/// IPv4 address of backend `i` (0-based) in the lab.
pub fn backend_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, 10 + i as u8)
}

/// IPv6 address of backend `i`.
pub fn backend_v6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x198, 0x18, 0, 0, 0, 0, 0x10 + i as u16)
}

impl Env {
    /// A lab `name` with a client pod and `n` backend pods `b0..`, each serving its name on
    /// TCP 8080 and 8081 and UDP 5353 (dual-stack sockets), plus a test cgroup.
    pub fn new(name: &str, n: usize, ipv6: bool) -> Env {
        assert!(
            is_root(),
            "the privileged integration tests need root (run `cargo xtask test` as root)"
        );
        assert!(
            !loader::OBJECT.is_empty(),
            "built without the eBPF object: run `cargo xtask test`"
        );
        ensure_bpffs().expect("bpffs");
        let pin_dir = format!("ebpf-proxy-test-{name}");
        // A leftover of a crashed run of this test.
        let _ = loader::cleanup(&Path::new(BPFFS).join(&pin_dir));
        let mut lab = Lab::new(&format!("ept-{name}"), ipv6).expect("lab");
        let client = lab
            .add_pod(
                "client",
                Ipv4Addr::new(198, 18, 0, 2),
                ipv6.then(|| Ipv6Addr::new(0xfd00, 0x198, 0x18, 0, 0, 0, 0, 2)),
            )
            .expect("client pod");
        let cg = TestCgroup::create(&format!("ebpf-proxy-test-{name}")).expect("cgroup");
        let manifests = tempfile::tempdir().expect("tempdir");
        let agent_log = manifests.path().with_extension("agent.log");
        let mut env = Env {
            name: name.into(),
            pin_dir,
            manifests,
            agent: None,
            agent_log,
            servers: Vec::new(),
            client,
            backends: Vec::new(),
            extra_agent_args: Vec::new(),
            agent_netns: None,
            cg,
            lab,
        };
        for i in 0..n {
            env.add_backend(i);
        }
        env
    }

    /// Adds backend pod `b<i>` and starts its server.
    pub fn add_backend(&mut self, i: usize) -> Pod {
        let v6 = self.lab.ipv6().then(|| backend_v6(i));
        let pod = self
            .lab
            .add_pod(&format!("b{i}"), backend_v4(i), v6)
            .expect("backend pod");
        let server = pod
            .spawn(
                None,
                Command::new(NETPROBE)
                    .args(["serve", "--name", &format!("b{i}")])
                    .args([
                        "--tcp",
                        "[::]:8080",
                        "--tcp",
                        "[::]:8081",
                        "--udp",
                        "[::]:5353",
                    ])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null()),
            )
            .expect("server");
        self.servers.push(server);
        self.backends.push(pod.clone());
        pod
    }

    pub fn pin_path(&self) -> PathBuf {
        Path::new(BPFFS).join(&self.pin_dir)
    }

    /// Writes (or replaces) a manifest file atomically (write + rename, as editors and
    /// ConfigMap volumes do).
    pub fn write_manifest(&self, file: &str, text: &str) {
        let tmp = self.manifests.path().join(format!(".{file}.tmp"));
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, self.manifests.path().join(file)).unwrap();
    }

    pub fn remove_manifest(&self, file: &str) {
        fs::remove_file(self.manifests.path().join(file)).unwrap();
    }

    /// Writes `web` as the manifest `web.yaml`.
    pub fn write_web(&self, web: &Web) {
        self.write_manifest("web.yaml", &web.yaml());
    }

    /// Starts the agent and waits (at most 20 s) until its first sync is done.
    pub fn start_agent(&mut self) {
        let source = vec![
            "--manifests".to_string(),
            self.manifests.path().display().to_string(),
        ];
        let n = self.syncs();
        self.start_agent_with(&source);
        self.wait_log(|l| syncs(l) > n, "first sync");
    }

    /// The agent's completed syncs so far (see [`syncs`]).
    pub fn syncs(&self) -> usize {
        syncs(&self.log())
    }

    /// `ebpf-proxy ARGS... --pin-dir <this agent's> -o json`, parsed (see [`agent_json`]).
    pub fn agent_json(&self, args: &[&str]) -> serde_json::Value {
        agent_json(&self.pin_dir, args)
    }

    /// Starts the agent with the given source arguments (e.g. `--kubeconfig F`), without
    /// waiting for a sync. The log is appended to, so earlier runs stay readable.
    pub fn start_agent_with(&mut self, source: &[String]) {
        assert!(self.agent.is_none());
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.agent_log)
            .unwrap();
        let mut cmd = Command::new(AGENT);
        cmd.arg("run")
            .args(source)
            .arg("--cgroup-path")
            .arg(self.cg.path())
            .args(["--pin-dir", &self.pin_dir])
            .args([
                "--healthz-bind-address",
                "127.0.0.1:0",
                "--metrics-bind-address",
                "127.0.0.1:0",
                "--status-bind-address",
                "127.0.0.1:0",
            ])
            .args(&self.extra_agent_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // spawn_in sets PR_SET_PDEATHSIG, so the agent dies with a killed test run.
        let child = ChildGuard::new(
            spawn_in(self.agent_netns.as_deref(), None, &mut cmd).expect("start agent"),
        );
        self.agent = Some(child);
    }

    /// Stops the agent with SIGTERM (its data path stays pinned and attached).
    pub fn stop_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            a.terminate(Duration::from_secs(5)).expect("stop agent");
        }
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.agent_log).unwrap_or_default()
    }

    /// Waits (at most 20 s) until the agent log satisfies `f`.
    pub fn wait_log(&self, f: impl Fn(&str) -> bool, what: &str) {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if f(&self.log()) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("timed out waiting for {what}; agent log:\n{}", self.log());
    }

    /// The health server address the agent logged.
    pub fn health_addr(&self) -> SocketAddr {
        self.logged_addr("health")
    }

    /// The address a server of the agent logged (`<what> server listening address=...`;
    /// the servers bind in the background, so this waits for the line, at most 20 s).
    pub fn logged_addr(&self, what: &str) -> SocketAddr {
        let needle = format!("{what} server listening");
        self.wait_log(|l| l.contains(&needle), &needle);
        let log = self.log();
        let line = log
            .lines()
            .find(|l| l.contains(&needle))
            .unwrap_or_else(|| panic!("no {needle:?} line"));
        let addr = line
            .split("address=")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap();
        addr.parse().unwrap()
    }

    /// Reads the pinned maps.
    pub fn snapshot(&self) -> Snapshot {
        PinnedMaps::open(&self.pin_path())
            .expect("pinned maps")
            .snapshot()
            .expect("snapshot")
    }

    /// Waits (at most 10 s) until the pinned maps satisfy `f`; returns how long it took.
    pub fn wait_maps(&self, f: impl Fn(&Snapshot) -> bool, what: &str) -> Duration {
        wait_pinned(&self.pin_path(), f, what, || self.log())
    }

    /// Runs netprobe in the client pod, inside the test cgroup; returns its JSON lines.
    pub fn probe(&self, args: &[&str]) -> Vec<Probe> {
        let out = self
            .client
            .output(
                Some(self.cg.path()),
                Command::new(NETPROBE).args(args),
                Duration::from_secs(60),
            )
            .expect("netprobe");
        let stdout = String::from_utf8_lossy(&out.stdout);
        stdout
            .lines()
            .map(|l| {
                serde_json::from_str(l).unwrap_or_else(|e| panic!("bad netprobe line {l:?}: {e}"))
            })
            .collect()
    }

    pub fn tcp(&self, to: &str, count: usize) -> Vec<Probe> {
        self.probe(&["tcp", "--to", to, "--count", &count.to_string()])
    }
}

/// A second "node" on the same lab: its own cgroup (its clients), pin directory and agent,
/// reading the same manifests under another node name. Socket-level load balancing only
/// depends on the client's cgroup, so two cgroups with two agents are two nodes.
pub struct OtherNode {
    pub node_name: String,
    pub pin_dir: String,
    pub agent: Option<ChildGuard>,
    pub log_path: PathBuf,
    pub cg: TestCgroup,
}

impl OtherNode {
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn pin_path(&self) -> PathBuf {
        Path::new(BPFFS).join(&self.pin_dir)
    }

    /// Waits (at most 10 s) until this node's pinned maps satisfy `f`.
    pub fn wait_maps(&self, f: impl Fn(&Snapshot) -> bool, what: &str) -> Duration {
        wait_pinned(&self.pin_path(), f, what, || self.log())
    }
}

impl Drop for OtherNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- agent log of {} ---\n{}", self.node_name, self.log());
        }
        self.agent.take();
        let _ = loader::cleanup(&self.pin_path());
        let _ = fs::remove_file(&self.log_path);
    }
}

impl Env {
    /// Starts a second node `node_name` (agent with `--hostname-override node_name`) on the
    /// same manifests and waits for its first sync. This Env's own agent should be started
    /// with `--hostname-override` too (`extra_agent_args`).
    pub fn add_node(&self, node_name: &str) -> OtherNode {
        let tag = format!("{}-{node_name}", self.name);
        let pin_dir = format!("ebpf-proxy-test-{tag}");
        let _ = loader::cleanup(&Path::new(BPFFS).join(&pin_dir));
        let cg = TestCgroup::create(&format!("ebpf-proxy-test-{tag}")).expect("cgroup");
        let log_path = self
            .manifests
            .path()
            .with_extension(format!("{node_name}.log"));
        let log = fs::File::create(&log_path).unwrap();
        let mut cmd = Command::new(AGENT);
        cmd.arg("run")
            .arg("--manifests")
            .arg(self.manifests.path())
            .arg("--cgroup-path")
            .arg(cg.path())
            .args(["--pin-dir", &pin_dir, "--hostname-override", node_name])
            .args([
                "--healthz-bind-address",
                "127.0.0.1:0",
                "--metrics-bind-address",
                "127.0.0.1:0",
                "--status-bind-address",
                "127.0.0.1:0",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let agent = ChildGuard::new(spawn_in(None, None, &mut cmd).expect("start agent"));
        let node = OtherNode {
            node_name: node_name.into(),
            pin_dir,
            agent: Some(agent),
            log_path,
            cg,
        };
        let start = Instant::now();
        while !node.log().contains("sync done") {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "node {node_name} did not sync:\n{}",
                node.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        node
    }

    /// A pod's sandbox as a kubelet lays it out for the agent to find: the cgroup
    /// `pod<uid>` under the test cgroup, holding a process of the pod's namespace (dropping
    /// the guard ends it; the cgroup goes with the test cgroup).
    pub fn sandbox(&self, pod: &Pod, uid: &str) -> ChildGuard {
        let cg = self.cg.path().join(format!("pod{uid}"));
        fs::create_dir(&cg).expect("pod cgroup");
        pod.spawn(Some(&cg), Command::new("sleep").arg("600"))
            .expect("pause process")
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- agent log of {} ---\n{}", self.name, self.log());
        }
        self.agent.take();
        self.servers.clear();
        let _ = loader::cleanup(&self.pin_path());
        let _ = fs::remove_file(&self.agent_log);
    }
}

/// Runs netprobe in network namespace `netns` (a file under `/run/netns`) inside cgroup
/// `cg`; its JSON lines.
pub fn probe_at(netns: &Path, cg: &Path, args: &[&str]) -> Vec<Probe> {
    let out = proxy_testkit::testbed::output_in(
        Some(netns),
        Some(cg),
        Command::new(NETPROBE).args(args),
        Duration::from_secs(60),
    )
    .expect("netprobe");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad netprobe line {l:?}: {e}")))
        .collect()
}

/// The syncs an agent completed, by its log: one `sync done` line each.
pub fn syncs(log: &str) -> usize {
    log.matches("sync done").count()
}

/// Makes a change of the manifests with `write` and waits (at most 20 s) until `env`'s
/// agent and every one of `others` synced after it.
pub fn apply_on(env: &Env, others: &[&OtherNode], write: impl FnOnce()) {
    let before: Vec<usize> = std::iter::once(env.syncs())
        .chain(others.iter().map(|o| syncs(&o.log())))
        .collect();
    write();
    let start = Instant::now();
    loop {
        let now: Vec<usize> = std::iter::once(env.syncs())
            .chain(others.iter().map(|o| syncs(&o.log())))
            .collect();
        if now.iter().zip(&before).all(|(n, b)| n > b) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no sync after the change:\n{}\n{}",
            env.log(),
            others
                .iter()
                .map(|o| o.log())
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `ebpf-proxy ARGS... --pin-dir PIN_DIR -o json` (PIN_DIR a directory name under
/// [`BPFFS`]), parsed; panics unless the command succeeds with JSON.
pub fn agent_json(pin_dir: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(AGENT)
        .args(args)
        .args(["--pin-dir", pin_dir, "-o", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}: {out:?}"))
}

/// Waits for a netprobe started with piped stdout to end and returns its JSON lines.
pub fn finish_probe(mut guard: ChildGuard) -> Vec<Probe> {
    use std::io::Read;
    let mut text = String::new();
    let child = guard.child_mut();
    child
        .stdout
        .take()
        .expect("stdout piped")
        .read_to_string(&mut text)
        .unwrap();
    let _ = child.wait();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad netprobe line {l:?}: {e}")))
        .collect()
}

/// Waits (at most 10 s) until the maps pinned at `pin_path` satisfy `f`; returns how long it
/// took. `log` gives the agent log for the failure message.
pub fn wait_pinned(
    pin_path: &Path,
    f: impl Fn(&Snapshot) -> bool,
    what: &str,
    log: impl Fn() -> String,
) -> Duration {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        // The maps may not exist yet while the agent starts.
        let snap = PinnedMaps::open(pin_path)
            .ok()
            .and_then(|m| m.snapshot().ok());
        if snap.is_some_and(|s| f(&s)) {
            return start.elapsed();
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!(
        "timed out waiting for the data path: {what}; agent log:\n{}",
        log()
    );
}

/// Counts of answering backends by name; panics on a failed probe.
pub fn by_name(probes: &[Probe]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for p in probes {
        assert_eq!(p["ok"], true, "probe failed: {p}");
        *m.entry(p["name"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    m
}

/// The errno of a failed probe.
pub fn errno(p: &Probe) -> Option<i64> {
    p["errno"].as_i64()
}

/// A Service manifest.
pub fn service(
    ns: &str,
    name: &str,
    cluster_ips: &[&str],
    ports: &[(&str, u32, u16, &str)],
) -> String {
    let ips: Vec<String> = cluster_ips.iter().map(|s| format!("\"{s}\"")).collect();
    let mut s = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  clusterIP: \"{}\"\n  clusterIPs: [{}]\n  ports:\n",
        cluster_ips[0],
        ips.join(", ")
    );
    for (pname, port, target, proto) in ports {
        s += &format!(
            "  - {{name: {pname}, port: {port}, targetPort: {target}, protocol: {proto}}}\n"
        );
    }
    s
}

/// An EndpointSlice manifest; `endpoints` are (address, ready).
pub fn slice(
    ns: &str,
    name: &str,
    service: &str,
    family: &str,
    ports: &[(&str, u16, &str)],
    endpoints: &[(IpAddr, bool)],
) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: {family}\nports:\n"
    );
    for (pname, port, proto) in ports {
        s += &format!("- {{name: {pname}, port: {port}, protocol: {proto}}}\n");
    }
    s += "endpoints:\n";
    for (ip, ready) in endpoints {
        s += &format!("- addresses: [\"{ip}\"]\n  conditions: {{ready: {ready}}}\n");
    }
    s
}

/// A running `ebpf-proxy monitor -o json` on a pin directory, its output going to a file;
/// killed on drop.
pub struct MonitorRun {
    child: ChildGuard,
    out: PathBuf,
    pin: PathBuf,
    _dir: tempfile::TempDir,
}

impl MonitorRun {
    /// Starts the monitor on `pin` (a directory under `BPFFS`) with `args`, and waits (at most
    /// 10 s) until it holds the event stream's lease, so no event of the test is missed.
    pub fn start(pin: &Path, args: &[&str]) -> MonitorRun {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("monitor.jsonl");
        let f = fs::File::create(&out).unwrap();
        let name = pin.file_name().unwrap().to_str().unwrap();
        let child = ChildGuard::spawn_in(
            None,
            None,
            Command::new(AGENT)
                .args(["monitor", "--pin-dir", name, "-o", "json"])
                .args(args)
                .stdout(f)
                .stderr(Stdio::inherit()),
        )
        .expect("monitor");
        let m = MonitorRun {
            child,
            out,
            pin: pin.to_path_buf(),
            _dir: dir,
        };
        let start = Instant::now();
        while !PinnedView::new(pin).monitor_lease_held().unwrap_or(false) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "the monitor did not take the lease"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    /// Stops the monitor as Ctrl-C does (SIGINT) and returns its JSON lines; checks that it
    /// exited cleanly and gave the lease back.
    pub fn stop(mut self) -> Vec<serde_json::Value> {
        // Events emitted just before are still being read.
        std::thread::sleep(Duration::from_millis(500));
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        self.finish()
    }

    /// Waits (at most 20 s) for the monitor to end on its own (--count, --duration); its
    /// JSON lines.
    pub fn finish(&mut self) -> Vec<serde_json::Value> {
        let status = self
            .child
            .wait_timeout(Duration::from_secs(20))
            .unwrap()
            .expect("the monitor did not stop");
        assert!(status.success(), "monitor: {status:?}");
        assert!(
            !PinnedView::new(&self.pin).monitor_lease_held().unwrap(),
            "the monitor left its lease set"
        );
        let lock = proxy_userspace::monitor::lock_path(&self.pin);
        assert!(!lock.exists(), "the monitor left {}", lock.display());
        fs::read_to_string(&self.out)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
            .collect()
    }
}

/// An established TCP connection held open by `netprobe tcp --interactive` in a pod: the
/// backend answers each line sent with its name and the line.
pub struct HeldTcp {
    /// The connect's JSON line (`ok`, `name` of the backend, `peer` from getpeername).
    pub first: Probe,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    guard: ChildGuard,
}

impl HeldTcp {
    /// Connects from `pod`, in cgroup `cg`, to `to` (`ip:port`); `extra` are more netprobe
    /// flags (e.g. `--timeout-ms`). Panics when netprobe cannot start or prints no line.
    pub fn open(pod: &Pod, cg: &Path, to: &str, extra: &[&str]) -> HeldTcp {
        use std::io::BufRead;
        let mut guard = pod
            .spawn(
                Some(cg),
                Command::new(NETPROBE)
                    .args(["tcp", "--to", to, "--interactive"])
                    .args(extra)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null()),
            )
            .expect("interactive netprobe");
        let child = guard.child_mut();
        let stdin = child.stdin.take();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let first: Probe =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("netprobe: {line:?}: {e}"));
        HeldTcp {
            first,
            stdin,
            stdout,
            guard,
        }
    }

    /// The backend's name from the connect's line (empty if it failed).
    pub fn backend(&self) -> &str {
        self.first["name"].as_str().unwrap_or("")
    }

    /// Sends `msg`; the probe's JSON answer (`ok` with `reply`, or the error and `errno`;
    /// `ok: false` once netprobe has exited).
    pub fn ask(&mut self, msg: &str) -> Probe {
        use std::io::{BufRead, Write};
        let exited = serde_json::json!({"ok": false, "error": "netprobe exited"});
        let Some(stdin) = self.stdin.as_mut() else {
            return exited;
        };
        if writeln!(stdin, "{msg}").is_err() {
            return exited;
        }
        let mut l = String::new();
        match self.stdout.read_line(&mut l) {
            Ok(n) if n > 0 => serde_json::from_str(&l).unwrap_or_else(|e| panic!("{l:?}: {e}")),
            _ => exited,
        }
    }

    /// Closes the connection: netprobe reads the end of its input and exits; waits for it.
    pub fn close(mut self) {
        self.stdin.take();
        let _ = self.guard.child_mut().wait();
    }
}

/// Creates and pins at `path` a map as another version of ebpf-proxy would have (`bpftool
/// map create`): BPF map type `kind` as bpftool names it (`hash`, `array`, `percpu_array`),
/// key and value sizes in bytes, `entries` and the map's `name`. Panics with bpftool's
/// error when it fails.
pub fn pin_old_map(path: &Path, kind: &str, key: usize, value: usize, entries: u32, name: &str) {
    let out = Command::new("bpftool")
        .args(["map", "create"])
        .arg(path)
        .args([
            "type",
            kind,
            "key",
            &key.to_string(),
            "value",
            &value.to_string(),
        ])
        .args(["entries", &entries.to_string(), "name", name])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "bpftool map create {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
