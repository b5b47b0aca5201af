//! The DaemonSet's pod as a cluster runs it: the Helm chart renders the manifests, podman
//! starts the pod template's init container and agent container the way a kubelet would
//! (`proxy_testkit::podrun`: the template's command, args, env, securityContext, volumes
//! and mount propagation), on a lab node, against the fake API server reached over HTTPS at
//! the chart's `apiServer.address` with the service account's token and CA.
//!
//! ```text
//!   outside: client 198.18.102.100, API server 198.18.102.50:6443 ──┐
//!                                                                   ├─ bridge (namespace "w")
//!   node 198.18.102.1 (eth0) ───────────────────────────────────────┘
//!        br0 198.18.3.1/24 ── pods b0 .10, b1 .11 (TCP 8080)
//! ```
//!
//! The lab's directories stand for the node's paths: a directory bind-mounted onto itself
//! as a shared mount for `/sys/fs/bpf` (empty: the init container must mount bpffs there,
//! and the mount must reach this mount namespace), and a child cgroup for the cgroup v2
//! root. Nothing is attached outside the lab.
//!
//! Skipped, with the reason printed, where the image was not built (`EBPF_PROXY_IMAGE`
//! unset: `cargo xtask test` builds it where podman and buildah work), podman cannot run
//! it, or helm is missing.

mod common;

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::NETPROBE;
use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};
use proxy_testkit::{
    fakeapi::{FakeApiServer, TlsOptions},
    podrun::{self, BPF_FS_MAGIC},
    testbed::{
        ChildGuard, KubeProxyHealth, Netns, TestCgroup, http_get_code, in_netns, is_root, output_in,
    },
};
use proxy_userspace::datapath::loader;

const NODE: &str = "198.18.102.1";
const CLIENT: &str = "198.18.102.100";
const API: &str = "198.18.102.50";
const API_PORT: u16 = 6443;
const POD_SIDE: &str = "198.18.3.1";
const VIP: &str = "198.19.2.30";
const NODE_PORT: u16 = 30080;
/// Container names start with this (a leftover of a crashed run is removed first).
const PREFIX: &str = "ebpf-proxy-podtest-";
/// The status server as the chart's probes name it.
const STATUS: &str = "127.0.0.1:10266";

fn skip(reason: &str) {
    eprintln!("SKIPPED (pod): {reason}");
}

fn pod_ip(i: usize) -> String {
    format!("198.18.3.{}", 10 + i)
}

/// The lab; field order is drop order: containers, the API server, servers, then the
/// data path's pins, the bpffs stand-in, the cgroup and the namespaces.
struct Lab {
    pod: Option<podrun::Pod>,
    api: Option<FakeApiServer>,
    servers: Vec<ChildGuard>,
    bpf: PathBuf,
    scratch: tempfile::TempDir,
    cg: TestCgroup,
    pods: Vec<Netns>,
    node: Netns,
    outside: Netns,
    _wire: Netns,
    rt: tokio::runtime::Runtime,
}

impl Drop for Lab {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Some(p) = &self.pod
        {
            eprintln!("--- agent container log ---\n{}", p.logs(0));
        }
        self.pod.take();
        if let Some(mut api) = self.api.take() {
            self.rt.block_on(api.stop());
        }
        let _ = loader::cleanup(&self.bpf.join("ebpf-proxy"));
        podrun::unshare_dir(&self.bpf);
    }
}

fn ns(what: &str) -> Netns {
    Netns::create(&format!("podt-{what}")).expect("netns")
}

impl Lab {
    fn new() -> Lab {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let wire = ns("w");
        wire.add_bridge("wire0").unwrap();
        let node = ns("n");
        let outside = ns("o");
        wire.plug("p0", "wire0", &node, &[&format!("{NODE}/24")])
            .unwrap();
        let outside_addrs = [format!("{CLIENT}/24"), format!("{API}/24")];
        wire.plug(
            "p1",
            "wire0",
            &outside,
            &[&outside_addrs[0], &outside_addrs[1]],
        )
        .unwrap();
        node.add_bridge("br0").unwrap();
        node.ip(&["addr", "add", &format!("{POD_SIDE}/24"), "dev", "br0"])
            .unwrap();
        node.sysctl("net/ipv4/ip_forward", "1").unwrap();
        node.ip(&["route", "add", "default", "dev", "eth0"])
            .unwrap();
        outside
            .ip(&["route", "add", "198.18.3.0/24", "via", NODE])
            .unwrap();
        let cg = TestCgroup::create("ebpf-proxy-podtest").expect("cgroup");
        let scratch = tempfile::tempdir().unwrap();
        let bpf = scratch.path().join("sys-fs-bpf");
        std::fs::create_dir(&bpf).unwrap();
        let mut lab = Lab {
            pod: None,
            api: None,
            servers: Vec::new(),
            bpf,
            scratch,
            cg,
            pods: Vec::new(),
            node,
            outside,
            _wire: wire,
            rt,
        };
        podrun::share_dir(&lab.bpf).expect("the bpffs stand-in as a shared mount");
        for i in 0..2 {
            let name = format!("b{i}");
            let p = ns(&name);
            lab.node
                .add_bridge_port(&format!("v{name}"), "br0", &p)
                .unwrap();
            p.ip(&["addr", "add", &format!("{}/24", pod_ip(i)), "dev", "eth0"])
                .unwrap();
            p.ip(&["link", "set", "eth0", "up"]).unwrap();
            p.ip(&["route", "add", "default", "via", POD_SIDE]).unwrap();
            let server = p
                .spawn(
                    None,
                    Command::new(NETPROBE)
                        .args(["serve", "--name", &name, "--tcp", ":8080"])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null()),
                )
                .expect("server");
            lab.servers.push(server);
            lab.pods.push(p);
        }
        lab
    }

    /// The fake API server on the outside namespace's API address, over HTTPS, with the
    /// node, a NodePort Service and its endpoints; writes the service account directory.
    fn start_api(&mut self) -> PathBuf {
        let listener = in_netns(&self.outside.path(), || {
            std::net::TcpListener::bind((API, API_PORT))
        })
        .unwrap()
        .expect("bind the API server's address");
        let api = self
            .rt
            .block_on(FakeApiServer::start_tls_on(listener, TlsOptions::default()))
            .expect("fake API server");
        let sa = self.scratch.path().join("serviceaccount");
        api.write_service_account_dir(&sa).unwrap();
        fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
            serde_json::from_value(v).unwrap()
        }
        api.apply_node(obj(serde_json::json!({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
            "status": {"addresses": [{"type": "InternalIP", "address": NODE}]}
        })));
        api.apply_service(obj(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"type": "NodePort", "clusterIP": VIP, "clusterIPs": [VIP],
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                "nodePort": NODE_PORT, "protocol": "TCP"}]}
        })));
        api.apply_endpoint_slice(obj(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "web-1", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [pod_ip(0)], "nodeName": "node-a", "conditions": {"ready": true}},
                {"addresses": [pod_ip(1)], "nodeName": "node-a", "conditions": {"ready": true}}
            ]
        })));
        self.api = Some(api);
        sa
    }

    /// The kubelet's view of the node for the pod runner.
    fn node_for_pods(&self, sa: PathBuf, config_maps: BTreeMap<String, ConfigMap>) -> podrun::Node {
        podrun::Node {
            name: "node-a".into(),
            netns: self.node.path(),
            host_paths: [
                ("/sys/fs/bpf".to_string(), self.bpf.clone()),
                ("/sys/fs/cgroup".to_string(), self.cg.path().to_path_buf()),
            ]
            .into_iter()
            .collect(),
            config_maps,
            service_account: sa,
            // The kubernetes Service's ClusterIP, as the kubelet sets it: never dialed,
            // the chart's apiServer.address is.
            kubernetes_service: ("198.19.2.1".into(), 443),
            scratch: self.scratch.path().to_path_buf(),
        }
    }

    /// GET `path` on the status server from the node's namespace, as the kubelet probes.
    fn probe(&self, path: &str) -> Option<u16> {
        http_get_code(
            Some(&self.node.path()),
            STATUS.parse().unwrap(),
            path,
            Duration::from_secs(2),
        )
    }
}

/// The chart rendered as users render it, with the API server's address and the image.
fn render(image: &str) -> Result<Vec<serde_yaml_ng::Value>, String> {
    let (repo, tag) = image.rsplit_once(':').ok_or("image without a tag")?;
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/ebpf-proxy");
    let out = Command::new("helm")
        .args(["template", "ebpf-proxy"])
        .arg(&chart)
        .args(["--namespace", "kube-system"])
        .args(["--set", &format!("apiServer.address={API}:{API_PORT}")])
        .args(["--set", &format!("image.repository={repo}")])
        .args(["--set", &format!("image.tag={tag}")])
        .output()
        .map_err(|e| format!("helm: {e} (installed by `cargo xtask setup`)"))?;
    if !out.status.success() {
        return Err(format!(
            "helm template: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    use serde::Deserialize;
    Ok(serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde_yaml_ng::Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect())
}

/// One TCP connection from the outside namespace: the backend's name.
fn tcp_name(outside: &Netns, to: &str) -> Result<String, String> {
    let to: SocketAddr = to.parse().unwrap();
    in_netns(&outside.path(), move || {
        let s =
            TcpStream::connect_timeout(&to, Duration::from_secs(3)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut name = String::new();
        BufReader::new(s)
            .read_line(&mut name)
            .map_err(|e| e.to_string())?;
        Ok(name.trim().to_string())
    })
    .unwrap()
}

/// Waits (at most `limit`) until `f` holds; the time it took.
fn wait_until(limit: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

// Longer than 120 lines: one pod's life (start, probes, serving, restart, cleanup), each step
// on the state the earlier ones left.
#[test]
fn the_daemonsets_pod_runs_under_podman_and_serves_the_node() {
    let Ok(image) = std::env::var("EBPF_PROXY_IMAGE") else {
        skip(
            "EBPF_PROXY_IMAGE is not set: `cargo xtask test` builds the image where podman and buildah can run, or build it with `cargo xtask image` and set the variable",
        );
        return;
    };
    assert!(is_root(), "the pod test needs root");
    if let Err(reason) = podrun::usable(&image) {
        skip(&reason);
        return;
    }
    let docs = match render(&image) {
        Ok(d) => d,
        Err(reason) => {
            skip(&reason);
            return;
        }
    };
    let ds: DaemonSet = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .map(|d| serde_yaml_ng::from_value(d.clone()).unwrap())
        .expect("a DaemonSet in the chart");
    let config_maps: BTreeMap<String, ConfigMap> = docs
        .iter()
        .filter(|d| d["kind"] == "ConfigMap")
        .map(|d| {
            let cm: ConfigMap = serde_yaml_ng::from_value(d.clone()).unwrap();
            (cm.metadata.name.clone().unwrap(), cm)
        })
        .collect();
    let spec = ds.spec.unwrap().template.spec.unwrap();

    let mut lab = Lab::new();
    let sa = lab.start_api();
    let node = lab.node_for_pods(sa, config_maps);
    assert_ne!(
        podrun::fs_magic(&lab.bpf),
        Some(BPF_FS_MAGIC),
        "no bpffs yet"
    );

    // Without the API server's address (the ConfigMap's key left empty), the agent stops at
    // start with an error naming the setting, before it touches the node.
    {
        let mut unset = node.clone();
        unset
            .config_maps
            .get_mut("ebpf-proxy-apiserver")
            .expect("the chart's ConfigMap of the address")
            .data
            .as_mut()
            .unwrap()
            .insert("address".into(), String::new());
        let mut agent = spec.containers[0].clone();
        agent.name = "no-address".into();
        let rs = podrun::translate(&spec, &agent, &unset, &image).unwrap();
        let mut args = vec!["run".to_string(), "--rm".to_string()];
        args.extend(rs.args.iter().cloned());
        args[3] = format!("{PREFIX}no-address");
        let out = podrun::podman_output(&args, Duration::from_secs(120)).unwrap();
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains("the Kubernetes API server's address is not set")
                && err.contains("apiServer.address"),
            "{err}"
        );
        assert!(!lab.bpf.join("ebpf-proxy").exists(), "nothing pinned");
    }

    // kube-proxy still runs on the node: it holds the health port and answers there.
    let held = in_netns(&lab.node.path(), || {
        std::net::TcpListener::bind("0.0.0.0:10256")
    })
    .unwrap()
    .expect("hold 10256 in the node's namespace");
    let kube_proxy = KubeProxyHealth::serve(held).unwrap();

    // The pod: the init container, then the agent.
    let started = Instant::now();
    let pod = podrun::Pod::start(&spec, &node, &image, PREFIX)
        .unwrap_or_else(|e| panic!("the pod did not start: {e:#}"));
    let (name, out) = &pod.inits[0];
    eprintln!("init container {name}:\n{}", text(&out.stdout));
    // The preflight mounted bpffs on the "host" (the mount propagated out of the container).
    assert_eq!(
        podrun::fs_magic(&lab.bpf),
        Some(BPF_FS_MAGIC),
        "the init container's bpffs did not reach the node"
    );
    let probes = pod.specs[0].probes.clone();
    lab.pod = Some(pod);
    for p in [&probes.startup, &probes.liveness, &probes.readiness] {
        let p = p.as_ref().expect("probe");
        assert_eq!((p.host.as_deref(), p.port), (Some("127.0.0.1"), 10266));
    }
    let readiness = probes.readiness.as_ref().unwrap().path.clone();
    let liveness = probes.liveness.as_ref().unwrap().path.clone();

    // The probes as the kubelet calls them: live once synced, never ready while kube-proxy
    // holds the health port.
    let mut ready_seen = false;
    wait_until(Duration::from_secs(120), "the agent's first sync", || {
        ready_seen |= lab.probe(&readiness) == Some(200);
        lab.probe(&liveness) == Some(200)
    });
    let live_at = started.elapsed();
    assert!(!ready_seen, "Ready before the first sync");
    let pod = lab.pod.as_ref().unwrap();
    // The wait of the guide's switching steps while kube-proxy runs: synced, from the agent
    // itself.
    let out = pod
        .exec(
            0,
            &[
                "ebpf-proxy",
                "status",
                "--require",
                "synced,north-south",
                "--wait",
                "30s",
            ],
            Duration::from_secs(60),
        )
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    for _ in 0..10 {
        assert_eq!(
            lab.probe(&readiness),
            Some(503),
            "Ready while kube-proxy holds 10256"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = pod
        .exec(
            0,
            &["ebpf-proxy", "status", "--require", "ready"],
            Duration::from_secs(30),
        )
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("kube-proxy's health server"),
        "{}",
        text(&out.stderr)
    );

    // The preflight passes inside the agent's container too.
    let out = pod
        .exec(
            0,
            &[
                "ebpf-proxy",
                "check",
                "--cgroup-path",
                "/run/ebpf-proxy/cgroup2",
            ],
            Duration::from_secs(120),
        )
        .unwrap();
    assert!(
        out.status.success(),
        "check in the container:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );

    // It serves the node: a ClusterIP from a process of the node, a NodePort from outside.
    let out = output_in(
        Some(&lab.node.path()),
        Some(lab.cg.path()),
        Command::new(NETPROBE).args(["tcp", "--to", &format!("{VIP}:80"), "--count", "6"]),
        Duration::from_secs(60),
    )
    .unwrap();
    let names: Vec<String> = text(&out.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["name"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(names.len(), 6, "{}", text(&out.stdout));
    assert!(
        names.iter().all(|n| n == "b0" || n == "b1"),
        "ClusterIP: {names:?}"
    );
    let np = format!("{NODE}:{NODE_PORT}");
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..12 {
        seen.insert(tcp_name(&lab.outside, &np).unwrap_or_else(|e| panic!("{np}: {e}")));
    }
    assert_eq!(seen.len(), 2, "NodePort: {seen:?}");

    // kube-proxy goes: the agent binds the port (retried every 5 s) and turns Ready.
    drop(kube_proxy);
    let ready_after = wait_until(Duration::from_secs(20), "Ready", || {
        lab.probe(&readiness) == Some(200)
    });
    eprintln!(
        "pod: live (first sync done) {} ms after its start, init container included; Ready {} ms after the health port was freed",
        live_at.as_millis(),
        ready_after.as_millis()
    );
    // The health port answers for the agent now (/healthz: kube-proxy's contract).
    assert_eq!(
        http_get_code(
            Some(&lab.node.path()),
            format!("{NODE}:10256").parse().unwrap(),
            "/healthz",
            Duration::from_secs(2)
        ),
        Some(200)
    );

    // A container restart keeps an established connection.
    let conn = in_netns(&lab.outside.path(), {
        let np = np.clone();
        move || TcpStream::connect_timeout(&np.parse().unwrap(), Duration::from_secs(3))
    })
    .unwrap()
    .expect("a NodePort connection");
    conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut w = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let backend = line.trim().to_string();
    let ask = |w: &mut TcpStream, r: &mut BufReader<TcpStream>| -> Result<String, String> {
        w.write_all(b"whoami\n").map_err(|e| e.to_string())?;
        let mut l = String::new();
        r.read_line(&mut l).map_err(|e| e.to_string())?;
        Ok(l)
    };
    assert!(ask(&mut w, &mut r).unwrap().starts_with(&backend));
    let restart = Instant::now();
    lab.pod.as_ref().unwrap().restart(0).unwrap();
    wait_until(Duration::from_secs(120), "Ready after the restart", || {
        lab.probe(&readiness) == Some(200)
    });
    eprintln!(
        "pod: Ready again {} ms after the container restart began",
        restart.elapsed().as_millis()
    );
    let after = ask(&mut w, &mut r)
        .unwrap_or_else(|e| panic!("the connection broke across the restart: {e}"));
    assert!(after.starts_with(&backend), "{after}");
    assert!(
        lab.pod
            .as_ref()
            .unwrap()
            .logs(0)
            .contains("adopted state from pinned maps")
    );

    // `ebpf-proxy cleanup` from the image, with the agent container's privileges and mounts.
    lab.pod.as_ref().unwrap().stop();
    let mut agent = spec.containers[0].clone();
    agent.args = Some(vec![
        "cleanup".into(),
        "--bpffs".into(),
        "/sys/fs/bpf".into(),
        "--pin-dir".into(),
        "ebpf-proxy".into(),
    ]);
    agent.name = format!("{PREFIX}cleanup");
    let mut rs = podrun::translate(&spec, &agent, &node, &image).unwrap();
    let mut args = vec!["run".to_string(), "--rm".to_string()];
    args.append(&mut rs.args);
    let out = podrun::podman_output(&args, Duration::from_secs(120)).unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(
        text(&out.stdout).contains("removed"),
        "{}",
        text(&out.stdout)
    );
    assert!(!lab.bpf.join("ebpf-proxy").exists(), "pins left");
    // No link of the lab's cgroup, no program on the node's interface.
    let cg_id = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(lab.cg.path()).unwrap().ino()
    };
    let links = Command::new("bpftool")
        .args(["-j", "link", "show"])
        .output()
        .unwrap();
    let links: Vec<serde_json::Value> = serde_json::from_slice(&links.stdout).unwrap_or_default();
    assert!(
        !links.iter().any(|l| l["cgroup_id"].as_u64() == Some(cg_id)),
        "a cgroup link of the lab is left"
    );
    let net = lab
        .node
        .exec("bpftool", &["-j", "net", "show", "dev", "eth0"])
        .unwrap();
    let shown = text(&net.stdout);
    assert!(
        !shown.contains("tc_ingress") && !shown.contains("tc_egress"),
        "{shown}"
    );
}
