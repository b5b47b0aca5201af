//! `netprobe demo`: the end-to-end demo run by `cargo xtask demo`.

use std::collections::BTreeMap;
use std::fs;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use proxy_testkit::testbed::{self, ChildGuard, Lab, Pod, TestCgroup};
use serde_json::{Value, json};

const PREFIX: &str = "epdemo";
const CGROUP: &str = "ebpf-proxy-demo";
const PIN_DIR: &str = "ebpf-proxy-demo";
/// ClusterIP of `demo/web` in deploy/examples/demo.yaml (assigned to no interface).
const WEB_VIP: &str = "198.19.0.10";
/// ClusterIP of `demo/dns` in deploy/examples/dns.yaml.
const DNS_VIP: &str = "198.19.0.53";
const CLIENT: (&str, Ipv4Addr) = ("client", Ipv4Addr::new(198, 18, 0, 10));
/// The backends; their addresses are the endpoints of both example EndpointSlices.
const BACKENDS: [(&str, Ipv4Addr); 3] = [
    ("backend-a", Ipv4Addr::new(198, 18, 0, 11)),
    ("backend-b", Ipv4Addr::new(198, 18, 0, 12)),
    ("backend-c", Ipv4Addr::new(198, 18, 0, 13)),
];
const REQUESTS: usize = 30;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Ctrl-C / SIGTERM set a flag that every step checks, so the guards run on the way out.
fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

fn check_stop() -> Result<()> {
    if STOP.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    Ok(())
}

fn step(msg: &str) -> Result<()> {
    check_stop()?;
    println!("\n==> {msg}");
    Ok(())
}

/// The running agent: stopped, then `ebpf-proxy cleanup` on drop (also on failure).
struct Agent {
    child: Option<ChildGuard>,
    bin: PathBuf,
    cgroup: PathBuf,
    log: PathBuf,
    cleaned: bool,
}

impl Agent {
    fn cleanup_cmd(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.args(["cleanup", "--pin-dir", PIN_DIR, "--cgroup-path"])
            .arg(&self.cgroup);
        c
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.terminate(Duration::from_secs(5));
        }
    }

    fn log_tail(&self, lines: usize) -> String {
        let s = fs::read_to_string(&self.log).unwrap_or_default();
        let v: Vec<&str> = s.lines().collect();
        v[v.len().saturating_sub(lines)..].join("\n")
    }

    fn stop_and_cleanup(&mut self) -> Result<String> {
        self.stop();
        self.cleaned = true;
        let out = testbed::output_in(None, None, &mut self.cleanup_cmd(), Duration::from_secs(30))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(
            out.status.success(),
            "ebpf-proxy cleanup failed ({}): {text}",
            out.status
        );
        Ok(text)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
        if !self.cleaned {
            let _ =
                testbed::output_in(None, None, &mut self.cleanup_cmd(), Duration::from_secs(30));
        }
    }
}

fn abs(p: &Path) -> Result<PathBuf> {
    fs::canonicalize(p).with_context(|| format!("{} not found", p.display()))
}

/// A free port on 127.0.0.1 for the agent's health server.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn run_cmd(cmd: &mut Command, timeout: Duration) -> Result<std::process::Output> {
    testbed::output_in(None, None, cmd, timeout).with_context(|| format!("running {cmd:?}"))
}

/// The demo (`netprobe demo`): a lab of a client pod and three backends, the agent on
/// `manifests` (copied), HTTP and DNS-like rounds, an endpoint removal, then the agent
/// stopped and `ebpf-proxy cleanup`. Errors: not root, a step failed (the agent log's
/// last lines are printed), or interrupted; everything made is removed either way.
pub fn run(agent_bin: &Path, manifests: &Path) -> Result<()> {
    install_signal_handlers();
    ensure!(
        testbed::is_root(),
        "the demo needs root (namespaces, cgroups, BPF)"
    );
    let agent_bin = abs(agent_bin)?;
    let manifests = abs(manifests)?;
    let me = std::env::current_exe().context("locating netprobe")?;

    step("preparing: bpffs, temp manifests, test cgroup, lab namespaces")?;
    if testbed::ensure_bpffs()? {
        println!("mounted bpffs on {}", testbed::BPFFS_PATH);
    }
    // Removed on drop (also on failure and Ctrl-C, as the guards below unwind).
    let tmp = tempfile::Builder::new()
        .prefix("ebpf-proxy-demo-")
        .tempdir()?;
    let mdir = copy_manifests(&manifests, tmp.path())?;
    let demo_yaml = mdir.join("demo.yaml");

    let cg = TestCgroup::create(CGROUP)?;
    println!("cgroup {}", cg.path().display());
    // Leftover pins of a crashed run (tolerated if there are none).
    let _ = run_cmd(
        Command::new(&agent_bin)
            .args(["cleanup", "--pin-dir", PIN_DIR, "--cgroup-path"])
            .arg(cg.path()),
        Duration::from_secs(30),
    );

    let mut lab = Lab::new(PREFIX, false)?;
    let client = lab.add_pod(CLIENT.0, CLIENT.1, None)?;
    let (backends, servers) = start_backends(&mut lab, &me)?;
    println!(
        "pod {:<10} {}  netns {}  (in cgroup {CGROUP})",
        client.name, client.ipv4, client.netns
    );
    wait_servers_listening(&backends)?;

    step("starting the agent")?;
    let port = free_port()?;
    let mut agent = start_agent(&agent_bin, &mdir, cg.path(), tmp.path(), port)?;
    let result = (|| -> Result<()> {
        wait_healthy(&mut agent, port)?;
        println!("agent healthy (/healthz 200 on 127.0.0.1:{port})");
        rounds(&agent, &me, &client, cg.path(), &demo_yaml, tmp.path())
    })();
    if let Err(e) = result {
        eprintln!(
            "\ndemo failed: {e:#}\n--- last lines of the agent log ---\n{}",
            agent.log_tail(30)
        );
        return Err(e);
    }

    step("stopping the agent and running ebpf-proxy cleanup")?;
    cleanup_summary(&mut agent)?;
    drop(agent);
    drop(servers);
    drop(lab);
    drop(cg);
    println!(
        "\nremoved namespaces {PREFIX}-*, cgroup {CGROUP}, pins {}/{PIN_DIR}",
        testbed::BPFFS_PATH
    );
    println!("demo OK");
    Ok(())
}

/// Copies the YAML files of `manifests` to `<tmp>/manifests` and returns that directory.
/// Errors when a file cannot be copied, or demo.yaml is missing or lacks the Service
/// address or an endpoint the demo expects.
fn copy_manifests(manifests: &Path, tmp: &Path) -> Result<PathBuf> {
    let mdir = tmp.join("manifests");
    fs::create_dir_all(&mdir)?;
    for e in fs::read_dir(manifests)?.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            fs::copy(&p, mdir.join(e.file_name()))?;
        }
    }
    let demo_text =
        fs::read_to_string(mdir.join("demo.yaml")).context("demo.yaml missing in the manifests")?;
    ensure!(
        demo_text.contains(WEB_VIP),
        "demo.yaml does not mention {WEB_VIP}; the demo expects that ClusterIP"
    );
    for (_, ip) in BACKENDS {
        ensure!(
            demo_text.contains(&ip.to_string()),
            "demo.yaml has no endpoint {ip}"
        );
    }
    Ok(mdir)
}

/// Adds the backend pods to `lab`, each with `netprobe serve` (`me`) on HTTP :8080 and
/// TCP and UDP :5353. Returns the pods and their servers' guards (the servers stop when
/// the guards drop); errors when a pod or server cannot be made, or on a stop signal.
fn start_backends(lab: &mut Lab, me: &Path) -> Result<(Vec<Pod>, Vec<ChildGuard>)> {
    let mut backends: Vec<Pod> = Vec::new();
    let mut servers: Vec<ChildGuard> = Vec::new();
    for (name, ip) in BACKENDS {
        check_stop()?;
        let pod = lab.add_pod(name, ip, None)?;
        let mut cmd = Command::new(me);
        cmd.args([
            "serve", "--name", name, "--http", ":8080", "--tcp", ":5353", "--udp", ":5353",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // Servers run in their pod namespace only, outside the test cgroup.
        servers.push(pod.spawn(None, &mut cmd)?);
        println!(
            "pod {name:<10} {ip}  netns {}  (netprobe serve: http :8080, tcp+udp :5353)",
            pod.netns
        );
        backends.push(pod);
    }
    Ok((backends, servers))
}

/// Starts the agent on the manifests in `mdir`, in cgroup `cg`, with its health server
/// on 127.0.0.1:`port` and its log in `tmp`. Errors when it cannot be started.
fn start_agent(agent_bin: &Path, mdir: &Path, cg: &Path, tmp: &Path, port: u16) -> Result<Agent> {
    let log = tmp.join("agent.log");
    let mut cmd = Command::new(agent_bin);
    cmd.arg("run")
        .arg("--manifests")
        .arg(mdir)
        .arg("--cgroup-path")
        .arg(cg)
        .args([
            "--pin-dir",
            PIN_DIR,
            "--healthz-bind-address",
            &format!("127.0.0.1:{port}"),
            "--metrics-bind-address",
            "127.0.0.1:0",
            "--status-bind-address",
            "127.0.0.1:0",
        ])
        .stdin(Stdio::null());
    let f = fs::File::create(&log)?;
    cmd.stdout(f.try_clone()?).stderr(f);
    println!(
        "{} run --manifests {} --cgroup-path {} --pin-dir {PIN_DIR} --healthz-bind-address 127.0.0.1:{port} --metrics-bind-address 127.0.0.1:0",
        agent_bin.display(),
        mdir.display(),
        cg.display()
    );
    // The log lives in the demo's temporary directory, removed when the demo ends.
    println!(
        "agent log (while the demo runs; its last lines are shown if the demo fails): {}",
        log.display()
    );
    Ok(Agent {
        child: Some(ChildGuard::new(
            testbed::spawn_in(None, None, &mut cmd).context("starting the agent")?,
        )),
        bin: agent_bin.to_owned(),
        cgroup: cg.to_owned(),
        log,
        cleaned: false,
    })
}

/// The demo's steps with the agent healthy: HTTP requests from `client` (in cgroup
/// `cg`) spread over every backend, the DNS-like Service over TCP and UDP, `ebpf-proxy
/// services`, backend-c removed from `demo_yaml` (rewritten through `tmp`), then HTTP
/// again without it. Errors name the step's failed expectation.
fn rounds(
    agent: &Agent,
    me: &Path,
    client: &Pod,
    cg: &Path,
    demo_yaml: &Path,
    tmp: &Path,
) -> Result<()> {
    step(&format!(
        "{REQUESTS} HTTP requests from the client pod to http://{WEB_VIP}:80/ (Service demo/web)"
    ))?;
    let counts = http_round(client, cg)?;
    print_counts(&counts);
    for (name, _) in BACKENDS {
        ensure!(
            counts.get(name).copied().unwrap_or(0) > 0,
            "{name} got no request"
        );
    }
    ensure!(!counts.contains_key("(failed)"), "some requests failed");

    step(&format!(
        "DNS-like Service demo/dns: TCP and UDP port 53 on {DNS_VIP} (two frontends)"
    ))?;
    dns_round(me, client, cg)?;

    step("ebpf-proxy services")?;
    let out = run_cmd(
        Command::new(&agent.bin).args(["services", "--pin-dir", PIN_DIR]),
        Duration::from_secs(10),
    )?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    ensure!(
        out.status.success(),
        "ebpf-proxy services failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    step("removing backend-c (198.18.0.13) from the EndpointSlice of demo/web")?;
    let c_ip = BACKENDS[2].1.to_string();
    let listed_before = services_mentions(&agent.bin, &c_ip)?;
    remove_endpoint(demo_yaml, tmp, &c_ip)?;
    wait_removed(&agent.bin, &c_ip, listed_before)?;

    step(&format!("{REQUESTS} HTTP requests again"))?;
    let counts = http_round(client, cg)?;
    print_counts(&counts);
    ensure!(
        !counts.contains_key("backend-c"),
        "backend-c still got traffic after its removal"
    );
    ensure!(!counts.contains_key("(failed)"), "some requests failed");
    for name in ["backend-a", "backend-b"] {
        ensure!(
            counts.get(name).copied().unwrap_or(0) > 0,
            "{name} got no request"
        );
    }
    Ok(())
}

/// Stops the agent, runs `ebpf-proxy cleanup` and prints its summary. Errors when the
/// cleanup fails.
fn cleanup_summary(agent: &mut Agent) -> Result<()> {
    let out = agent.stop_and_cleanup()?;
    // One line per link and map is what `cleanup` prints for an operator; the demo
    // sums them up and shows anything else as is.
    let (mut links, mut pins) = (0, 0);
    for line in out.lines() {
        if line.starts_with("detached ") {
            links += 1;
        } else if line.starts_with("removed ") {
            pins += 1;
        } else {
            println!("{line}");
        }
    }
    println!("cleanup: detached {links} program links, removed {pins} pins");
    Ok(())
}

/// Waits (bounded) until every backend's HTTP port accepts connections.
fn wait_servers_listening(backends: &[Pod]) -> Result<()> {
    for pod in backends {
        let addr = SocketAddr::from((pod.ipv4, 8080));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            check_stop()?;
            let ok = testbed::in_netns(&pod.path(), move || {
                TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
            })?;
            if ok {
                break;
            }
            ensure!(
                Instant::now() < deadline,
                "netprobe serve in {} is not listening",
                pod.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

fn wait_healthy(agent: &mut Agent, port: u16) -> Result<()> {
    let url = format!("http://127.0.0.1:{port}/healthz");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        check_stop()?;
        if let Some(child) = agent.child.as_mut()
            && let Some(status) = child.try_wait()?
        {
            bail!("the agent exited ({status}) before it became healthy");
        }
        let out = run_cmd(
            Command::new("curl").args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-m",
                "1",
                &url,
            ]),
            Duration::from_secs(5),
        )?;
        if String::from_utf8_lossy(&out.stdout).trim() == "200" {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the agent was not healthy within 30 s ({url})"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `REQUESTS` curl runs from the client pod, inside the test cgroup; body -> count.
fn http_round(client: &Pod, cg: &Path) -> Result<BTreeMap<String, usize>> {
    let url = format!("http://{WEB_VIP}:80/");
    let mut counts = BTreeMap::new();
    for _ in 0..REQUESTS {
        check_stop()?;
        let out = client.output(
            Some(cg),
            Command::new("curl").args(["-s", "-m", "2", &url]),
            Duration::from_secs(5),
        )?;
        let body = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let key = if out.status.success() && !body.is_empty() {
            body
        } else {
            "(failed)".to_owned()
        };
        *counts.entry(key).or_insert(0) += 1;
    }
    Ok(counts)
}

fn print_counts(counts: &BTreeMap<String, usize>) {
    for (name, _) in BACKENDS {
        let n = counts.get(name).copied().unwrap_or(0);
        println!("  {name:<10} {n:>3}  {}", "#".repeat(n));
    }
    for (k, n) in counts {
        if !BACKENDS.iter().any(|(b, _)| b == k) {
            println!("  {k:<10} {n:>3}");
        }
    }
}

/// Runs a netprobe client in the client pod and counts the names in its JSON lines.
fn probe(
    me: &Path,
    client: &Pod,
    cg: &Path,
    args: &[&str],
    counts: &mut BTreeMap<String, usize>,
) -> Result<()> {
    check_stop()?;
    let out = client.output(
        Some(cg),
        Command::new(me).args(args),
        Duration::from_secs(30),
    )?;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: Value =
            serde_json::from_str(line).with_context(|| format!("netprobe printed {line:?}"))?;
        let key = match v["name"].as_str() {
            Some(n) if v["ok"] == json!(true) => n.to_owned(),
            _ => format!("(failed: {})", v["error"].as_str().unwrap_or("timeout")),
        };
        *counts.entry(key).or_insert(0) += 1;
    }
    Ok(())
}

fn dns_round(me: &Path, client: &Pod, cg: &Path) -> Result<()> {
    let to = format!("{DNS_VIP}:53");
    let mut tcp = BTreeMap::new();
    probe(
        me,
        client,
        cg,
        &["tcp", "--to", &to, "--count", "12", "--timeout-ms", "2000"],
        &mut tcp,
    )?;
    println!("TCP {to}, 12 connections:");
    print_counts(&tcp);
    let mut udp = BTreeMap::new();
    for _ in 0..6 {
        probe(
            me,
            client,
            cg,
            &["udp", "--to", &to, "--count", "3", "--timeout-ms", "1000"],
            &mut udp,
        )?;
    }
    println!(
        "UDP {to}, 6 sockets x 3 datagrams (unconnected sendto; a socket's flow sticks to one backend):"
    );
    print_counts(&udp);
    for (proto, counts) in [("TCP", &tcp), ("UDP", &udp)] {
        ensure!(
            counts.keys().all(|k| BACKENDS.iter().any(|(b, _)| b == k)),
            "some {proto} probes to {to} failed"
        );
    }
    Ok(())
}

/// Rewrites demo.yaml without the endpoint `ip` (parsed and written with serde_yaml_ng;
/// replaced atomically by a rename so the agent never reads a half-written file).
fn remove_endpoint(file: &Path, scratch: &Path, ip: &str) -> Result<()> {
    use serde::Deserialize;
    let text = fs::read_to_string(file)?;
    let mut docs = Vec::new();
    let mut removed = 0;
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let mut v = serde_yaml_ng::Value::deserialize(doc)?;
        if v.is_null() {
            continue;
        }
        if v["kind"].as_str() == Some("EndpointSlice")
            && let Some(eps) = v.get_mut("endpoints").and_then(|e| e.as_sequence_mut())
        {
            let before = eps.len();
            eps.retain(|ep| {
                !ep["addresses"]
                    .as_sequence()
                    .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(ip)))
            });
            removed += before - eps.len();
        }
        docs.push(serde_yaml_ng::to_string(&v)?);
    }
    ensure!(removed > 0, "no endpoint {ip} in {}", file.display());
    let tmp = scratch.join("demo.yaml.new");
    fs::write(&tmp, docs.join("---\n"))?;
    fs::rename(&tmp, file)?;
    println!("rewrote {} without {ip}", file.display());
    Ok(())
}

/// How often `ebpf-proxy services` mentions `ip`.
fn services_mentions(agent: &Path, ip: &str) -> Result<usize> {
    let out = run_cmd(
        Command::new(agent).args(["services", "--pin-dir", PIN_DIR]),
        Duration::from_secs(10),
    )?;
    Ok(String::from_utf8_lossy(&out.stdout).matches(ip).count())
}

/// Waits (at most 10 s) until `ebpf-proxy services` mentions `ip` less often than
/// `before` times (backend-c stays listed for demo/dns), then 1 s more.
fn wait_removed(agent: &Path, ip: &str, before: usize) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    // `before == 0`: `services` does not list backend addresses; only wait the 1 s.
    while before > 0 && services_mentions(agent, ip)? >= before {
        check_stop()?;
        if Instant::now() >= deadline {
            println!("warning: `ebpf-proxy services` still lists {ip} as often after 10 s");
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(1));
    Ok(())
}
