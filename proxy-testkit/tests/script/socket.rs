//! The socket-level scenarios: a lab of [`Env`] (a client pod, backend pods `b0..` serving
//! their name, one agent per node on the lab's manifest directory), driven by the steps of
//! a scenario file. The commands are described in `tests/scenarios/README.md`.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    process::Stdio,
    time::{Duration, Instant},
};

use aya::maps::{Map, MapData, RingBuf};
use proxy_common::{Counter, FRONTEND_F_LOCAL_ONLY, FRONTEND_F_VIP_MARKER};
use proxy_testkit::testbed::{ChildGuard, Pod};
use proxy_userspace::datapath::{
    Snapshot, bypass, loader,
    maps::{read_connection_counts, read_counters},
    tc,
    view::PinnedView,
};
use serde_json::Value;

use super::api::Api;
use super::query::{Cond, Vars, cond, conds, errno_value, field, glob, known, rows, select};
use super::{Script, Step, duration, list, weights};
use crate::common::{
    Env, HeldTcp, MonitorRun, NETPROBE, OtherNode, Probe, agent_json, apply_on, errno,
    finish_probe, probe_at, syncs,
};
use crate::sched;

/// Chi-square critical values at p = 0.001 for 1..=5 degrees of freedom: a correct
/// implementation fails a distribution check one run in a thousand at most.
const CHI2_P001: [f64; 5] = [10.828, 13.816, 16.266, 18.467, 20.515];

/// A running socket scenario.
struct Lab {
    // Dropped before `env`: processes in its pods and cgroups go first.
    /// The pause processes of the pods' sandboxes (`lab bypass`), by pod name.
    pause: BTreeMap<String, ChildGuard>,
    /// Connections held open by `hold NAME`.
    held: BTreeMap<String, HeldTcp>,
    /// netprobe runs started by `background NAME`.
    background: BTreeMap<String, ChildGuard>,
    /// CLI runs started by `background NAME cli ARGS...`.
    commands: BTreeMap<String, ChildGuard>,
    /// The monitor started by `monitor ARGS...`.
    monitor: Option<MonitorRun>,
    env: Env,
    /// The fake API server of `lab ... api`, the agent's source instead of the manifest
    /// directory.
    api: Option<Api>,
    /// The nodes' names (`lab nodes=`); the first is `env`'s own agent. Empty: one node,
    /// without `--hostname-override`.
    nodes: Vec<String>,
    /// The agents of the other nodes, once started.
    others: Vec<OtherNode>,
    /// The pods a step may name (`in POD`) besides `node`: `client`, and `other` in a
    /// bypass lab.
    pods: BTreeMap<String, Pod>,
    /// The sandbox UID of each pod with a sandbox.
    uids: BTreeMap<String, String>,
    /// Map snapshots kept by `maps => save=NAME`.
    saved: BTreeMap<String, Snapshot>,
    /// Counter values kept by `counters mark NAME`.
    marks: BTreeMap<String, BTreeMap<String, u64>>,
    /// The events of the last monitor, the last `json` output and the lines of the last
    /// `probe` or `join`, for `select`.
    events: Vec<Value>,
    json: Value,
    lines: Vec<Probe>,
    /// What probes kept: `save=NAME`, `collect=BAG`.
    kept: Kept,
    vars: Vars,
    timer: Option<Instant>,
}

/// Runs a socket scenario.
pub fn run(script: &Script) {
    let mut lab: Option<Lab> = None;
    for step in &script.steps {
        script.at(step, || {
            if step.words[0] == "lab" {
                assert!(lab.is_none(), "a second `lab`");
                lab = Some(Lab::new(script, step));
            } else {
                let lab = lab.as_mut().expect("the first step must be `lab`");
                lab.step(script, step);
            }
        });
    }
}

/// The address of the lab's extra pods by name (`other` is 198.18.0.3), and of the client.
fn pod_addrs(name: &str) -> (Ipv4Addr, Ipv6Addr) {
    let last = match name {
        "client" => 2,
        "other" => 3,
        n => panic!("no pod {n:?} in the lab (client, other)"),
    };
    (
        Ipv4Addr::new(198, 18, 0, last),
        Ipv6Addr::new(0xfd00, 0x198, 0x18, 0, 0, 0, 0, last as u16),
    )
}

/// The sandbox UID a bypass lab gives pod `name` at first.
fn first_uid(name: &str) -> String {
    format!("0000-{name}-uid")
}

impl Lab {
    /// `lab backends=N [ipv6] [nodes=NAME,NAME...] [bypass] [api]`.
    fn new(script: &Script, step: &Step) -> Lab {
        let mut n = 0;
        let mut ipv6 = false;
        let mut bypass = false;
        let mut api = false;
        let mut nodes = Vec::new();
        for w in &step.words[1..] {
            match w.split_once('=') {
                Some(("backends", v)) => n = v.parse().expect("backends=N"),
                Some(("nodes", v)) => nodes = list(v),
                None if w == "ipv6" => ipv6 = true,
                None if w == "bypass" => bypass = true,
                None if w == "api" => api = true,
                _ => panic!("unknown lab option {w:?} (backends=N, ipv6, nodes=A,B, bypass, api)"),
            }
        }
        if api {
            // The other nodes' agents read the manifest directory.
            assert!(nodes.len() <= 1, "`api`: one node");
            if nodes.is_empty() {
                nodes = vec!["node-a".into()];
            }
        }
        let mut env = Env::new(&format!("sc-{}", script.name), n, ipv6);
        let mut pods = BTreeMap::from([("client".to_string(), env.client.clone())]);
        let mut uids = BTreeMap::new();
        let mut pause = BTreeMap::new();
        if bypass {
            if nodes.is_empty() {
                nodes = vec!["node-a".into()];
            }
            let (v4, v6) = pod_addrs("other");
            let other = env
                .lab
                .add_pod("other", v4, ipv6.then_some(v6))
                .expect("pod other");
            pods.insert("other".into(), other);
            let node = env.lab.node();
            node.sysctl("net/ipv4/ip_forward", "1").expect("ip_forward");
            if ipv6 {
                node.sysctl("net/ipv6/conf/all/forwarding", "1")
                    .expect("IPv6 forwarding");
            }
            for (name, pod) in &pods {
                let uid = first_uid(name);
                pause.insert(name.clone(), env.sandbox(pod, &uid));
                uids.insert(name.clone(), uid);
            }
            env.agent_netns = Some(env.lab.node().path());
        }
        if let Some(first) = nodes.first() {
            env.extra_agent_args = vec!["--hostname-override".into(), first.clone()];
        }
        let mut vars = Vars::default();
        vars.set("MANIFESTS", env.manifests.path().display().to_string());
        vars.set("PIN", env.pin_dir.clone());
        vars.set("CGROUP", env.cg.path().display().to_string());
        let api = api.then(|| Api::start(env.manifests.path()));
        if let Some(api) = &api {
            vars.set("KUBECONFIG", api.kubeconfig.display().to_string());
        }
        Lab {
            pause,
            held: BTreeMap::new(),
            background: BTreeMap::new(),
            commands: BTreeMap::new(),
            monitor: None,
            env,
            api,
            nodes,
            others: Vec::new(),
            pods,
            uids,
            saved: BTreeMap::new(),
            marks: BTreeMap::new(),
            events: Vec::new(),
            json: Value::Null,
            lines: Vec::new(),
            kept: Kept::default(),
            vars,
            timer: None,
        }
    }

    fn step(&mut self, script: &Script, step: &Step) {
        let w = &step.words;
        match w[0].as_str() {
            "agent" => {
                step.only(&[]);
                let mut args = match self.nodes.first() {
                    Some(n) => vec!["--hostname-override".to_string(), n.clone()],
                    None => Vec::new(),
                };
                args.extend(w[1..].iter().map(|a| self.vars.expand(a)));
                self.env.extra_agent_args = args;
            }
            "write" | "apply" => self.write(script, step),
            "remove" => {
                step.only(&[]);
                self.env.remove_manifest(step.word(1, "a file name"));
            }
            "start" => self.start(step),
            "stop" => {
                step.only(&[]);
                if let Some(mut agent) = self.env.agent.take() {
                    let status = agent.terminate(Duration::from_secs(5)).expect("stop agent");
                    assert!(
                        status.success(),
                        "SIGTERM is a clean stop, not {status:?}; agent log:\n{}",
                        self.env.log()
                    );
                }
            }
            "api" => {
                let api = self.api.as_mut().expect("`api` steps need a `lab ... api`");
                if let Some(json) = api.step(script, step, &self.vars) {
                    self.json = json;
                }
            }
            "metrics" => self.metrics(step),
            "probe" => self.probe(step),
            "background" => self.background(step),
            "join" => self.join(step),
            "hold" => self.hold(step),
            "ask" => self.ask(step),
            "close" => self.close(step),
            "maps" => {
                let snap = self.env.snapshot();
                check_maps(step, &snap, &self.saved).unwrap_or_else(|e| panic!("{e}"));
                if let Some(name) = step.get("save") {
                    self.saved.insert(name.to_string(), snap);
                }
            }
            "wait" => self.wait(step),
            "log" => self.log(step),
            "healthz" => self.healthz(step),
            "cli" | "cmd" => self.cli(step),
            "json" => self.json(step),
            "bpftool" => self.bpftool(step),
            "select" => self.select(step),
            "monitor" => self.monitor(step),
            "metric" => self.metric(step),
            "counters" => self.counters(step),
            "bypassed" => self.bypassed(step),
            "pod" => self.pod(step),
            "exec" => self.exec(step),
            "sleep" => {
                step.only(&[]);
                std::thread::sleep(duration(step.word(1, "a duration")));
            }
            "check" => self.check(step),
            "ring" => self.ring(step),
            "conn-counts" => self.conn_counts_step(step),
            "timer" => super::timer(&mut self.timer, step),
            "clock" => self.clock(step),
            "addresses" => self.addresses(step),
            "pins" => self.pins_step(step),
            "collected" => self.collected(step),
            other => panic!("unknown command {other:?}"),
        }
    }

    /// `write FILE [as NAME]` / `apply ...`: a section of the script as a manifest (`apply`
    /// waits for every running agent to sync it).
    fn write(&mut self, script: &Script, step: &Step) {
        let w = &step.words;
        step.only(&[]);
        let (section, name) = match &w[1..] {
            [s] => (self.vars.expand(s), self.vars.expand(s)),
            [s, as_, n] if as_ == "as" => (self.vars.expand(s), self.vars.expand(n)),
            _ => panic!("usage: {} FILE [as NAME]", w[0]),
        };
        let (section, name) = (section.as_str(), name.as_str());
        let text = script.file(section);
        if w[0] == "apply" && self.env.agent.is_some() {
            let others: Vec<&OtherNode> = self.others.iter().collect();
            apply_on(&self.env, &others, || self.env.write_manifest(name, &text));
        } else {
            self.env.write_manifest(name, &text);
        }
    }

    /// `start [--no-wait]`: the agent on the lab's source, by default until its first sync;
    /// then the other nodes' agents.
    fn start(&mut self, step: &Step) {
        let w = &step.words;
        step.only(&[]);
        let wait = match &w[1..] {
            [] => true,
            [a] if a == "--no-wait" => false,
            _ => panic!("usage: start [--no-wait]"),
        };
        let source = match &self.api {
            Some(api) => api.source(),
            None => vec![
                "--manifests".to_string(),
                self.env.manifests.path().display().to_string(),
            ],
        };
        let n = self.env.syncs();
        self.env.start_agent_with(&source);
        if wait {
            self.env.wait_log(|l| syncs(l) > n, "first sync");
        }
        for node in self.nodes.iter().skip(1 + self.others.len()) {
            let other = self.env.add_node(node);
            self.others.push(other);
        }
    }

    /// `clock NAME [rfc3339]`: the wall clock now into a variable (milliseconds since the
    /// epoch, or RFC 3339).
    fn clock(&mut self, step: &Step) {
        step.only(&[]);
        let now = std::time::SystemTime::now();
        let v = match step.words.get(2).map(String::as_str) {
            None => now
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis()
                .to_string(),
            Some("rfc3339") => humantime::format_rfc3339(now).to_string(),
            Some(f) => panic!("usage: clock NAME [rfc3339], not {f:?}"),
        };
        self.vars.set(step.word(1, "a variable name"), v);
    }

    /// `pins [PREFIX] => ...`: the pinned objects checked (see [`PIN_KEYS`]).
    fn pins_step(&mut self, step: &Step) {
        let c = conds(&step.after);
        known(&c, PIN_KEYS);
        let prefix = step.words.get(1).map_or("", String::as_str);
        let mut vars = std::mem::take(&mut self.vars);
        let r = self.pins(prefix, &c, &mut vars);
        self.vars = vars;
        r.unwrap_or_else(|e| panic!("{e}"));
    }

    /// `collected NAME => distinct=N`: the backends a `collect=NAME` probe gathered.
    fn collected(&mut self, step: &Step) {
        let name = step.word(1, "a bag's name");
        let c = conds(&step.after);
        known(&c, &["distinct"]);
        let bag = self
            .kept
            .bags
            .get(name)
            .unwrap_or_else(|| panic!("no bag {name:?}"));
        for c in &c {
            self.vars
                .check_number(c, bag.len() as u64)
                .unwrap_or_else(|e| panic!("{name}: {e}: {bag:?}"));
        }
    }

    /// `join NAME => ...`: waits for a `background` run to end; its lines checked as a
    /// probe's (a CLI run's output as `cli` checks it).
    fn join(&mut self, step: &Step) {
        let name = step.word(1, "a background run's name");
        if let Some(run) = self.commands.remove(name) {
            let out = run.into_inner().wait_with_output().expect("ebpf-proxy");
            self.check_cli(step, &out);
            return;
        }
        let run = self
            .background
            .remove(name)
            .unwrap_or_else(|| panic!("no background run {name:?}"));
        let lines = finish_probe(run);
        check_probe(step, &lines, Duration::ZERO, &mut self.vars, &mut self.kept);
        self.lines = lines;
    }

    /// `ask NAME MSG => CONDITIONS`: a line sent on a held connection; the conditions on the
    /// answer.
    fn ask(&mut self, step: &Step) {
        let name = step.word(1, "a held connection's name");
        let msg = step.word(2, "a message");
        let held = self
            .held
            .get_mut(name)
            .unwrap_or_else(|| panic!("no held connection {name:?}"));
        let answer = held.ask(msg);
        println!("{name}: {answer}");
        check_json(&answer, &conds(&step.after), &mut self.vars);
    }

    /// `close NAME`: closes a held connection.
    fn close(&mut self, step: &Step) {
        step.only(&[]);
        let name = step.word(1, "a held connection's name");
        self.held
            .remove(name)
            .unwrap_or_else(|| panic!("no held connection {name:?}"))
            .close();
    }

    /// `wait maps => ...`, `wait log TEXT...`, `wait bypassed N`, `wait conn-counts => ...`,
    /// `wait pins PREFIX => count=N [within=DURATION]`.
    fn wait(&mut self, step: &Step) {
        let w = &step.words;
        match w.get(1).map(String::as_str) {
            Some("maps") => {
                // Checked once for the expectation keys, then polled.
                step.only(MAP_KEYS);
                let took = self.env.wait_maps(
                    |s| check_maps(step, s, &self.saved).is_ok(),
                    &format!("maps {:?}", step.expect),
                );
                println!("maps {:?} after {took:?}", step.after);
            }
            Some("log") => {
                let c = conds(&step.after);
                known(&c, &["count"]);
                let needles = &w[2..];
                assert!(!needles.is_empty(), "usage: wait log TEXT... [=> count=N]");
                let matching = |l: &str| {
                    l.lines()
                        .filter(|l| needles.iter().all(|n| l.contains(n)))
                        .count() as u64
                };
                self.env.wait_log(
                    |l| match c.is_empty() {
                        true => matching(l) > 0,
                        false => {
                            let mut vars = self.vars.trial();
                            c.iter().all(|c| vars.check_number(c, matching(l)).is_ok())
                        }
                    },
                    &format!("log lines with {needles:?} {:?}", step.after),
                );
            }
            Some("bypassed") => {
                step.only(&[]);
                let n: usize = step.word(2, "a number of pods").parse().expect("N");
                self.wait_bypassed(n);
            }
            Some("conn-counts") => {
                let c = conds(&step.after);
                known(&c, &["pairs", "carried"]);
                let start = Instant::now();
                while self.conn_counts(&c, &mut self.vars.trial()).is_err() {
                    assert!(
                        start.elapsed() < Duration::from_secs(20),
                        "{:?} after 20 s: {:?}\n{}",
                        step.after,
                        self.conn_counts(&c, &mut self.vars.trial()),
                        self.env.log()
                    );
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            Some("pins") => {
                let prefix = step.word(2, "a pin name prefix");
                let mut c = conds(&step.after);
                known(&c, &[PIN_KEYS, &["within"]].concat());
                let within = match c.iter().position(|c| c.key == "within") {
                    Some(i) => duration(&c.remove(i).value),
                    None => Duration::from_secs(20),
                };
                let start = Instant::now();
                while let Err(e) = self.pins(prefix, &c, &mut self.vars.trial()) {
                    assert!(start.elapsed() < within, "after {within:?}: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            _ => panic!(
                "usage: wait maps => ... | wait log TEXT... | wait bypassed N | \
                 wait conn-counts => ... | wait pins PREFIX => ..."
            ),
        }
    }

    /// `json ARGS...`: the CLI's JSON, kept for `select json`.
    fn json(&mut self, step: &Step) {
        let w = &step.words;
        step.only(&[]);
        let args: Vec<String> = w[1..].iter().map(|a| self.vars.expand(a)).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.json = agent_json(&self.env.pin_dir, &args);
        println!("{}", self.json);
    }

    /// `select events|lines|log|json|json.PATH [FILTER...] => ...`: see [`select`].
    fn select(&mut self, step: &Step) {
        let w = &step.words;
        let log: Vec<Value>;
        let source = step.word(1, "events, lines, log, json or json.PATH");
        let all = match source.split_once('.') {
            _ if source == "events" => self.events.iter().collect(),
            _ if source == "lines" => self.lines.iter().collect(),
            _ if source == "json" => rows(&self.json, ""),
            _ if source == "log" => {
                log = self.log_json();
                log.iter().collect()
            }
            Some(("json", path)) => rows(&self.json, path),
            _ => panic!("select events|lines|log|json|json.PATH, not {source:?}"),
        };
        let filters: Vec<String> = w[2..].to_vec();
        select(&all, &conds(&filters), &conds(&step.after), &mut self.vars);
    }

    /// The agent log's lines as JSON (`logging.format: json`); panics on a line that is
    /// not.
    fn log_json(&self) -> Vec<Value> {
        self.env
            .log()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
            .collect()
    }

    /// `bypassed => count=N interfaces=A,B`: the bypassed namespaces and the interfaces with
    /// the pod programs.
    fn bypassed(&mut self, step: &Step) {
        let c = conds(&step.after);
        known(&c, &["count", "interfaces"]);
        let pin = self.env.pin_path();
        let (_, cookies) = bypass::read_pinned(&pin).expect("bypass maps");
        let links = bypass::attached_pods(&pin);
        let links: Vec<String> = links.into_iter().collect();
        for c in &c {
            let r = match c.key.as_str() {
                "count" => self.vars.check_number(c, cookies.len() as u64),
                _ => self.vars.check(c, Some(&Value::from(links.join(",")))),
            };
            r.unwrap_or_else(|e| panic!("{c}: {e}"));
        }
    }

    /// `exec POD CMD ARGS...`: CMD in the pod's (or the node's) namespace; must succeed.
    fn exec(&mut self, step: &Step) {
        let w = &step.words;
        step.only(&[]);
        let netns = self.netns(step.word(1, "a pod or node"));
        let cmd = step.word(2, "a command");
        let args: Vec<String> = w[3..].iter().map(|a| self.vars.expand(a)).collect();
        let out = proxy_testkit::testbed::output_in(
            Some(&netns),
            None,
            std::process::Command::new(cmd).args(&args),
            Duration::from_secs(10),
        )
        .expect(cmd);
        assert!(
            out.status.success(),
            "{cmd}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `check A OP B`: two values compared.
    fn check(&mut self, step: &Step) {
        let w = &step.words;
        step.only(&[]);
        let [a, op, b] = &w[1..] else {
            panic!("usage: check A OP B");
        };
        // The key names the left side in a failure.
        let c = Cond {
            key: a.clone(),
            ..cond(&format!("x{op}{b}"))
        };
        let a = self.vars.expand(a);
        let got = a.parse::<f64>().map_or(Value::from(a.clone()), Value::from);
        self.vars
            .check(&c, Some(&got))
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// `ring drain` / `ring => records=N`: the records waiting in the kernel log ring.
    fn ring(&mut self, step: &Step) {
        let w = &step.words;
        let n = ring_records(&self.env.pin_path());
        if w.get(1).is_some_and(|a| a == "drain") {
            step.only(&[]);
        } else {
            let c = conds(&step.after);
            known(&c, &["records"]);
            for c in &c {
                self.vars
                    .check_number(c, n as u64)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }

    /// `pins [PREFIX] => count=N every-map every-link absent`: the pins of the lab's pin
    /// directory named PREFIX... (all of them without a PREFIX); `every-map`: every map of
    /// the socket path (`ALL_MAPS`) is pinned; `every-link`: every program's link
    /// (`loader::PROGRAMS`); `absent`: the pin directory does not exist.
    fn pins(&self, prefix: &str, c: &[Cond], vars: &mut Vars) -> Result<(), String> {
        let dir = self.env.pin_path();
        if c.iter().any(|c| c.key == "absent") {
            assert!(c.len() == 1, "`absent` goes alone");
            return match dir.exists() {
                true => Err(format!("{} exists", dir.display())),
                false => Ok(()),
            };
        }
        let names: Vec<String> = std::fs::read_dir(&dir)
            .map_err(|e| format!("the pin directory {}: {e}", dir.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(prefix))
            .collect();
        for c in c {
            let missing: Vec<String> = match c.key.as_str() {
                "every-map" => proxy_common::ALL_MAPS
                    .iter()
                    .filter(|m| !dir.join(m).exists())
                    .map(|m| m.to_string())
                    .collect(),
                "every-link" => loader::PROGRAMS
                    .iter()
                    .map(|p| loader::link_pin(&dir, p))
                    .filter(|p| !p.exists())
                    .map(|p| p.display().to_string())
                    .collect(),
                _ => {
                    vars.check_number(c, names.len() as u64)
                        .map_err(|e| format!("pins {prefix}...: {e}: {names:?}"))?;
                    continue;
                }
            };
            if !missing.is_empty() {
                return Err(format!("{}: not pinned: {missing:?}", c.key));
            }
        }
        Ok(())
    }

    /// `addresses POD FIRST-LAST`: every address of the range added to the pod's `eth0`
    /// (clients of many addresses, for `--bind FIRST-LAST`).
    fn addresses(&mut self, step: &Step) {
        step.only(&[]);
        let netns = self.netns(step.word(1, "a pod"));
        for ip in ip_range(&self.vars.expand(step.word(2, "FIRST-LAST"))) {
            let len = if ip.is_ipv4() { 32 } else { 128 };
            let out = proxy_testkit::testbed::output_in(
                Some(&netns),
                None,
                std::process::Command::new("ip").args([
                    "addr",
                    "add",
                    &format!("{ip}/{len}"),
                    "dev",
                    "eth0",
                ]),
                Duration::from_secs(10),
            )
            .expect("ip addr add");
            assert!(
                out.status.success(),
                "ip addr add {ip}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// `conn-counts => pairs=N carried=N`.
    fn conn_counts_step(&mut self, step: &Step) {
        let c = conds(&step.after);
        known(&c, &["pairs", "carried"]);
        let mut vars = std::mem::take(&mut self.vars);
        let r = self.conn_counts(&c, &mut vars);
        self.vars = vars;
        r.unwrap_or_else(|e| panic!("{e}"));
    }

    /// The cgroup of the clients of node `name` (`@name`), or of the first node.
    fn cgroup(&self, at: Option<&str>) -> std::path::PathBuf {
        let Some(name) = at else {
            return self.env.cg.path().to_path_buf();
        };
        let i = self
            .nodes
            .iter()
            .position(|n| n == name)
            .unwrap_or_else(|| panic!("no node {name:?} in {:?}", self.nodes));
        if i == 0 {
            self.env.cg.path().to_path_buf()
        } else {
            self.others
                .get(i - 1)
                .unwrap_or_else(|| panic!("node {name} is not started"))
                .cg
                .path()
                .to_path_buf()
        }
    }

    /// The pod `name` of the lab.
    fn pod_named(&self, name: &str) -> &Pod {
        self.pods
            .get(name)
            .unwrap_or_else(|| panic!("no pod {name:?} (have {:?})", self.pods.keys()))
    }

    /// The network namespace of pod `name`, or of the node for `node`.
    fn netns(&self, name: &str) -> PathBuf {
        match name {
            "node" => self.env.lab.node().path(),
            n => self.pod_named(n).path(),
        }
    }

    /// Splits `[@NODE] [in POD] ARGS...` into the cgroup, the pod (the client unless
    /// named; `node` for the node namespace) and the rest, its variables replaced and each
    /// `--bind FIRST-LAST` made one `--bind` per address of the range.
    fn place(&self, mut args: &[String]) -> (PathBuf, String, Vec<String>) {
        let mut at = None;
        if let Some(a) = args.first().and_then(|a| a.strip_prefix('@')) {
            at = Some(a);
            args = &args[1..];
        }
        let mut pod = "client".to_string();
        if args.first().is_some_and(|a| a == "in") {
            pod = args.get(1).expect("in POD").clone();
            args = &args[2..];
        }
        assert!(!args.is_empty(), "nothing to run");
        let mut out = Vec::new();
        let mut words = args.iter().map(|a| self.vars.expand(a));
        while let Some(a) = words.next() {
            if a == "--bind" {
                let v = words.next().expect("--bind ADDR");
                if v.contains('-') {
                    for ip in ip_range(&v) {
                        out.extend(["--bind".to_string(), ip.to_string()]);
                    }
                    continue;
                }
                out.extend([a, v]);
                continue;
            }
            out.push(a);
        }
        (self.cgroup(at), pod, out)
    }

    /// `probe [@NODE] [in POD] NETPROBE-ARGS... => EXPECTATIONS`: netprobe in the pod, in
    /// the clients' cgroup of the node, once or (`repeat=N union=...`) until the answering
    /// backends of all runs make up `union`.
    fn probe(&mut self, step: &Step) {
        step.only(PROBE_KEYS);
        let (cg, pod, args) = self.place(&step.words[1..]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let netns = self.netns(&pod);
        let repeat: usize = step
            .get("repeat")
            .map_or(1, |r| r.parse().expect("repeat=N"));
        let union: Option<BTreeSet<String>> =
            step.get("union").map(|u| list(u).into_iter().collect());
        assert!(
            (repeat > 1) == union.is_some(),
            "`repeat=N` and `union=NAMES` go together"
        );
        let mut seen = BTreeSet::new();
        for _ in 0..repeat {
            let t = Instant::now();
            let lines = probe_at(&netns, &cg, &args);
            let took = t.elapsed();
            check_probe(step, &lines, took, &mut self.vars, &mut self.kept);
            let done = union.as_ref().is_some_and(|u| {
                seen.extend(by_name(&lines).into_keys());
                seen.len() >= u.len()
            });
            self.lines = lines;
            if done {
                break;
            }
        }
        if let Some(u) = union {
            assert_eq!(seen, u, "backends answering over the runs");
        }
    }

    /// `background NAME [@NODE] [in POD] NETPROBE-ARGS...`: starts netprobe, to be checked
    /// by `join NAME => ...`; `background NAME cli ARGS...` starts `ebpf-proxy ARGS...` as
    /// `cli` runs it, `join` then checks it as `cli` does.
    fn background(&mut self, step: &Step) {
        step.only(&[]);
        let name = step.word(1, "a name").to_string();
        assert!(
            !self.background.contains_key(&name) && !self.commands.contains_key(&name),
            "{name} runs already"
        );
        if step.words.get(2).is_some_and(|w| w == "cli") {
            let mut cmd = self.cli_command(&step.words[3..], true);
            let run = ChildGuard::spawn_in(
                None,
                None,
                cmd.stdout(Stdio::piped()).stderr(Stdio::piped()),
            )
            .expect("ebpf-proxy");
            self.commands.insert(name, run);
            return;
        }
        let (cg, pod, args) = self.place(&step.words[2..]);
        let netns = self.netns(&pod);
        let run = ChildGuard::spawn_in(
            Some(&netns),
            Some(&cg),
            std::process::Command::new(NETPROBE)
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::null()),
        )
        .expect("netprobe");
        self.background.insert(name, run);
    }

    /// `hold NAME [in POD] ADDR [NETPROBE-FLAGS...] => CONDITIONS [tries=N]`: an
    /// established TCP connection held open (`netprobe tcp --interactive`); the conditions
    /// are on its connect line. With `tries=N`, connections are opened (and the others
    /// closed) until one meets them, at most N.
    fn hold(&mut self, step: &Step) {
        let name = step.word(1, "a name").to_string();
        let (cg, pod, args) = self.place(&step.words[2..]);
        let pod = self.pod_named(&pod).clone();
        let extra: Vec<&str> = args[1..].iter().map(String::as_str).collect();
        let mut c = conds(&step.after);
        let tries = match c.iter().position(|c| c.key == "tries") {
            Some(i) => c.remove(i).value.parse().expect("tries=N"),
            None => 1,
        };
        let mut last = None;
        for _ in 0..tries {
            let h = HeldTcp::open(&pod, &cg, &args[0], &extra);
            let mut scratch = self.vars.trial();
            if c.iter()
                .all(|c| scratch.check(c, field(&h.first, &c.key)).is_ok())
            {
                check_json(&h.first, &c, &mut self.vars);
                println!("{name}: {}", h.first);
                self.held.insert(name, h);
                return;
            }
            last = Some(h.first.clone());
        }
        panic!(
            "no connection meeting {:?} in {tries}: the last {last:?}",
            step.after
        );
    }

    /// `pod remove NAME` / `pod add NAME uid=UID`: a bypass lab's pod goes (its sandbox,
    /// cgroup, namespace and veth) or comes back under a new UID (the same name and
    /// address).
    fn pod(&mut self, step: &Step) {
        step.only(&[]);
        let name = step.word(2, "a pod name").to_string();
        match step.word(1, "add or remove") {
            "remove" => {
                drop(self.pause.remove(&name));
                let uid = self.uids.remove(&name).expect("a pod with a sandbox");
                let cg = self.env.cg.path().join(format!("pod{uid}"));
                let t = Instant::now();
                while let Err(e) = std::fs::remove_dir(&cg) {
                    assert!(t.elapsed() < Duration::from_secs(2), "rmdir {cg:?}: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                assert!(self.env.lab.remove_pod(&name), "no pod {name}");
            }
            "add" => {
                let uid = step
                    .word(3, "uid=UID")
                    .strip_prefix("uid=")
                    .expect("uid=UID")
                    .to_string();
                let (v4, v6) = pod_addrs(&name);
                let v6 = self.env.lab.ipv6().then_some(v6);
                let pod = self.env.lab.add_pod(&name, v4, v6).expect("pod");
                assert_eq!(&pod, self.pod_named(&name), "same name and address");
                let guard = self.env.sandbox(&pod, &uid);
                self.pause.insert(name.clone(), guard);
                self.uids.insert(name, uid);
            }
            other => panic!("pod add|remove, not {other:?}"),
        }
    }

    /// Waits (10 s) until `n` pods are bypassed: namespaces listed and interfaces attached.
    fn wait_bypassed(&self, n: usize) {
        let pin = self.env.pin_path();
        let start = Instant::now();
        loop {
            let (_, cookies) = bypass::read_pinned(&pin).expect("bypass maps");
            let links = bypass::attached_pods(&pin);
            if cookies.len() == n && links.len() == n {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "expected {n} bypassed pods, have {cookies:?} on {links:?}; agent log:\n{}",
                self.env.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The socket path's counters (`translated`, `bypassed`, ...) and the tc path's
    /// (`tc_new_flow`, ...) by name.
    fn counter_values(&self) -> BTreeMap<String, u64> {
        let pin = self.env.pin_path();
        let sock = read_counters(&pin).expect("counters");
        let mut out: BTreeMap<String, u64> = Counter::ALL
            .iter()
            .zip(sock)
            .map(|((_, name), v)| (name.to_string(), v))
            .collect();
        for (name, v) in tc::counters(&pin).expect("tc counters") {
            out.insert(name.to_string(), v);
        }
        out
    }

    /// `counters mark NAME` / `counters [since NAME] => NAME=N ...`: the data path's
    /// counters, or their growth since the mark.
    fn counters(&mut self, step: &Step) {
        let now = self.counter_values();
        match &step.words[1..] {
            [m, name] if m == "mark" => {
                step.only(&[]);
                self.marks.insert(name.clone(), now);
            }
            rest => {
                let base = match rest {
                    [] => BTreeMap::new(),
                    [s, name] if s == "since" => self
                        .marks
                        .get(name)
                        .unwrap_or_else(|| panic!("no mark {name:?}"))
                        .clone(),
                    _ => panic!("usage: counters mark NAME | counters [since NAME] => ..."),
                };
                for c in conds(&step.after) {
                    let v = now
                        .get(&c.key)
                        .unwrap_or_else(|| panic!("no counter {:?}: {now:?}", c.key));
                    let d = v - base.get(&c.key).copied().unwrap_or(0);
                    self.vars
                        .check_number(&c, d)
                        .unwrap_or_else(|e| panic!("{e}: {now:?}"));
                }
            }
        }
    }

    /// `monitor ARGS...` starts `ebpf-proxy monitor -o json ARGS...` (holding the lease);
    /// `monitor stop` (SIGINT) and `monitor wait` (it ends by itself) keep its events for
    /// `select events`; `monitor totals => emitted=N rate_limited=N ring_full=N` are the
    /// data path's monitor counters.
    fn monitor(&mut self, step: &Step) {
        match step.words.get(1).map(String::as_str) {
            Some("stop") | Some("wait") => {
                step.only(&[]);
                let mut m = self.monitor.take().expect("no monitor running");
                self.events = if step.words[1] == "stop" {
                    m.stop()
                } else {
                    m.finish()
                };
                println!("{} events", self.events.len());
            }
            Some("totals") => {
                let t = PinnedView::new(&self.env.pin_path())
                    .monitor_totals()
                    .expect("monitor totals");
                let v = serde_json::json!({
                    "emitted": t.emitted,
                    "rate_limited": t.rate_limited,
                    "ring_full": t.ring_full,
                });
                let c = conds(&step.after);
                known(&c, &["emitted", "rate_limited", "ring_full"]);
                check_json(&v, &c, &mut self.vars);
            }
            _ => {
                step.only(&[]);
                assert!(self.monitor.is_none(), "a monitor runs already");
                let args: Vec<&str> = step.words[1..].iter().map(String::as_str).collect();
                self.monitor = Some(MonitorRun::start(&self.env.pin_path(), &args));
            }
        }
    }

    /// `metric NAME [LABEL=VALUE...] => value=N | sum=N`: the agent's `/metrics`, parsed
    /// as Prometheus text; the first sample of NAME with those labels, or the sum of all.
    fn metric(&mut self, step: &Step) {
        let name = step.word(1, "a metric name");
        let text = self.scrape();
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
            .expect("valid Prometheus text");
        let samples: Vec<Value> = scrape
            .samples
            .iter()
            .filter(|s| s.metric == name)
            .map(|s| {
                let v = match s.value {
                    prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Untyped(v) => v,
                    ref other => panic!("{other:?}"),
                };
                let mut o: serde_json::Map<String, Value> = s
                    .labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), Value::from(v.to_string())))
                    .collect();
                o.insert("value".into(), Value::from(v));
                Value::Object(o)
            })
            .collect();
        let expect: Vec<Cond> = conds(&step.after)
            .into_iter()
            .map(|c| match c.key.as_str() {
                "value" => Cond {
                    key: "@0.value".into(),
                    ..c
                },
                "sum" => Cond {
                    key: "sum.value".into(),
                    ..c
                },
                k => panic!("metric expectations: value, sum; not {k:?}"),
            })
            .collect();
        let rows: Vec<&Value> = samples.iter().collect();
        select(&rows, &conds(&step.words[2..]), &expect, &mut self.vars);
    }

    /// The agent's `/metrics`, as Prometheus text.
    fn scrape(&self) -> String {
        let addr = self.env.logged_addr("metrics");
        let out = std::process::Command::new("curl")
            .args(["-sf", &format!("http://{addr}/metrics")])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// `metrics => has=T...`: the agent's `/metrics` text holds each T (a series with its
    /// labels, `name{label="v"}`).
    fn metrics(&mut self, step: &Step) {
        step.only(&["has"]);
        assert!(step.words.len() == 1, "usage: metrics => has=T...");
        let text = self.scrape();
        for h in step.all("has") {
            assert!(text.contains(h), "{h:?} not in /metrics:\n{text}");
        }
    }

    /// `conn-counts => pairs=N carried=N`: the connection counts pinned (pairs and carried
    /// keys in all, and the count carried to the Service's own key, the one without a
    /// backend).
    fn conn_counts(&self, c: &[Cond], vars: &mut Vars) -> Result<(), String> {
        let pairs = read_connection_counts(&self.env.pin_path()).expect("connection counts");
        let carried = pairs
            .iter()
            .find(|(k, _)| k.backend_id == 0)
            .map(|(_, n)| *n);
        for c in c {
            match c.key.as_str() {
                "pairs" => vars.check_number(c, pairs.len() as u64),
                _ => vars.check(c, carried.map(Value::from).as_ref()),
            }
            .map_err(|e| format!("{e}: {pairs:?}"))?;
        }
        Ok(())
    }

    /// `log TEXT... => count=N has=T last-has=T`: the agent log's lines holding every TEXT;
    /// at least one, or exactly `count`; the first of them holds each `has`, the last each
    /// `last-has`.
    fn log(&mut self, step: &Step) {
        let c = conds(&step.after);
        known(&c, &["count", "has", "last-has"]);
        let needles = &step.words[1..];
        assert!(!needles.is_empty(), "usage: log TEXT... => count=N has=T");
        let log = self.env.log();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .collect();
        let counts: Vec<&Cond> = c.iter().filter(|c| c.key == "count").collect();
        for c in &counts {
            self.vars
                .check_number(c, lines.len() as u64)
                .unwrap_or_else(|e| panic!("lines with {needles:?}: {e}: {lines:?}\n{log}"));
        }
        if counts.is_empty() {
            assert!(!lines.is_empty(), "no line with {needles:?}:\n{log}");
        }
        for (key, line) in [("has", lines.first()), ("last-has", lines.last())] {
            for h in step.all(key) {
                let h = self.vars.expand(h);
                assert!(
                    line.is_some_and(|l| l.contains(&h)),
                    "{key}: {h:?} not in {line:?} (of {lines:?})"
                );
            }
        }
    }

    /// `healthz [PATH] => code=N has=T`: the agent's `/healthz` (or PATH of its health
    /// server, `/livez`), as curl sees it.
    fn healthz(&self, step: &Step) {
        step.only(&["code", "has"]);
        let path = step.words.get(1).map_or("/healthz", String::as_str);
        let h = self.env.health_addr();
        let out = std::process::Command::new("curl")
            .args(["-s", "-w", "\n%{http_code}", &format!("http://{h}{path}")])
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        if let Some(c) = step.get("code") {
            assert!(text.ends_with(&format!("\n{c}")), "healthz: {text}");
        }
        for h in step.all("has") {
            assert!(text.contains(h), "{h:?} not in {text}");
        }
    }

    /// `ebpf-proxy ARGS... --pin-dir <the lab's>` (variables in ARGS replaced), for `cli`
    /// and `background NAME cli`; without the `--pin-dir` unless `pin_dir`.
    fn cli_command(&self, args: &[String], pin_dir: bool) -> std::process::Command {
        let mut cmd = std::process::Command::new(crate::common::AGENT);
        cmd.args(args.iter().map(|a| self.vars.expand(a)));
        if pin_dir {
            cmd.args(["--pin-dir", &self.env.pin_dir]);
        }
        cmd
    }

    /// `cli ARGS... => has=T json-len=N starts=T line=PREFIX line-has=T fails code=N
    /// stderr-has=T`: `ebpf-proxy ARGS... --pin-dir <the lab's>`, which must succeed
    /// (fail, with `fails`; exit with N, with `code`). `cmd ARGS... => ...`: the same
    /// without the `--pin-dir` (`check`, kube-proxy's command lines). An output that is JSON
    /// is kept for `select json`.
    fn cli(&mut self, step: &Step) {
        step.only(CLI_KEYS);
        let out = self
            .cli_command(&step.words[1..], step.words[0] == "cli")
            .output()
            .unwrap();
        self.check_cli(step, &out);
    }

    /// Checks a CLI run's output against the `cli` expectations of `step`; keeps an output
    /// that is JSON for `select json`.
    fn check_cli(&mut self, step: &Step, out: &std::process::Output) {
        step.only(CLI_KEYS);
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        println!("{text}");
        match step.get("code") {
            Some(c) => assert_eq!(
                out.status.code(),
                Some(c.parse().expect("code=N")),
                "{out:?}"
            ),
            None => assert_eq!(out.status.success(), step.get("fails").is_none(), "{out:?}"),
        }
        let expand = |key: &str| -> Vec<String> {
            step.all(key).iter().map(|h| self.vars.expand(h)).collect()
        };
        for h in expand("has") {
            assert!(text.contains(&h), "{h:?} not in:\n{text}");
        }
        for h in expand("stderr-has") {
            assert!(err.contains(&h), "{h:?} not in:\n{err}");
        }
        if let Some(s) = step.get("starts") {
            assert!(text.starts_with(s), "does not start with {s:?}:\n{text}");
        }
        if let Some(p) = step.get("line") {
            let line = text
                .lines()
                .find(|l| l.starts_with(p))
                .unwrap_or_else(|| panic!("no line starting with {p:?}:\n{text}"));
            for h in expand("line-has") {
                assert!(line.contains(&h), "{h:?} not in {line:?}");
            }
        }
        let json = serde_json::from_slice::<Value>(&out.stdout);
        if let Some(n) = step.get("json-len") {
            let v = json.as_ref().expect("JSON");
            assert_eq!(
                v.as_array().expect("a JSON array").len(),
                n.parse::<usize>().expect("json-len=N"),
                "{v}"
            );
        }
        if let Ok(v) = json {
            self.json = v;
        }
    }

    /// `bpftool ARGS...`: `bpftool -j ARGS...` (variables replaced) must succeed; its JSON
    /// (no output: `[]`) is kept for `select json`.
    fn bpftool(&mut self, step: &Step) {
        step.only(&[]);
        let args: Vec<String> = step.words[1..]
            .iter()
            .map(|a| self.vars.expand(a))
            .collect();
        let out = std::process::Command::new("bpftool")
            .arg("-j")
            .args(&args)
            .output()
            .expect("bpftool");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "bpftool {args:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.json = match text.trim() {
            "" => Value::Array(Vec::new()),
            t => serde_json::from_str(t).unwrap_or_else(|e| panic!("bpftool: {e}: {t}")),
        };
        println!("{}", self.json);
    }
}

const CLI_KEYS: &[&str] = &[
    "has",
    "code",
    "json-len",
    "starts",
    "line",
    "line-has",
    "fails",
    "stderr-has",
];

/// Checks conditions on the fields of one JSON object.
fn check_json(v: &Value, c: &[Cond], vars: &mut Vars) {
    for c in c {
        vars.check(c, field(v, &c.key))
            .unwrap_or_else(|e| panic!("{c} does not hold: {e} in {v}"));
    }
}

/// Records waiting in the pinned kernel log ring under `pin` (read and consumed).
fn ring_records(pin: &std::path::Path) -> usize {
    let m = MapData::from_pin(pin.join(proxy_common::KERNEL_LOGS)).expect("AYA_LOGS pinned");
    let mut ring = RingBuf::try_from(Map::RingBuf(m)).expect("ring buffer");
    let mut n = 0;
    while ring.next().is_some() {
        n += 1;
    }
    n
}

/// Checks the map expectations of `step` against `s`; `same=NAME` compares with `saved`
/// (`save=NAME` is the caller's).
fn check_maps(step: &Step, s: &Snapshot, saved: &BTreeMap<String, Snapshot>) -> Result<(), String> {
    step.only(MAP_KEYS);
    for (k, v) in &step.expect {
        let n = || -> usize { v.parse().unwrap_or_else(|_| panic!("{k}=N")) };
        let ok = match k.as_str() {
            "backends" => s.backends.len() == n(),
            "frontends" => s.frontends.len() == n(),
            "slots" => s.slots.len() == n(),
            "stale-slots" => s.stale_slots.len() == n(),
            "empty" => s.frontends.is_empty() && s.slots.is_empty() && s.backends.is_empty(),
            "service" => s.names.values().any(|x| x.starts_with(&format!("{v}:"))),
            "backend-count" => {
                let mut services = s
                    .frontends
                    .values()
                    .filter(|f| f.flags & FRONTEND_F_VIP_MARKER == 0)
                    .peekable();
                services.peek().is_some() && services.all(|f| f.backend_count as usize == n())
            }
            "markers" => s.frontends.keys().filter(|k| k.proto == 0).count() == n(),
            "backend-sum" => {
                s.frontends
                    .values()
                    .filter(|f| f.flags & FRONTEND_F_VIP_MARKER == 0)
                    .map(|f| f.backend_count as usize)
                    .sum::<usize>()
                    == n()
            }
            "vips" => {
                let vips: BTreeSet<String> = s
                    .frontends
                    .keys()
                    .filter(|k| k.proto != 0)
                    .map(|k| proxy_userspace::datapath::addr::bytes_to_ip(k.addr).to_string())
                    .collect();
                vips == list(v).into_iter().collect()
            }
            "local-only" => {
                s.frontends
                    .values()
                    .filter(|f| f.flags & FRONTEND_F_LOCAL_ONLY != 0)
                    .count()
                    == n()
            }
            "members" => {
                let mut w: Vec<u32> = s.members.values().copied().collect();
                w.sort();
                let want: Vec<u32> = list(v).iter().map(|x| x.parse().unwrap()).collect();
                w == want
            }
            "save" => true,
            "same" => {
                let saved = saved
                    .get(v)
                    .unwrap_or_else(|| panic!("no maps saved as {v:?}"));
                saved == s
            }
            _ => unreachable!(),
        };
        if !ok {
            return Err(format!("maps: {k}={v} does not hold: {s:?}"));
        }
    }
    Ok(())
}

const PIN_KEYS: &[&str] = &["count", "every-map", "every-link", "absent"];

const MAP_KEYS: &[&str] = &[
    "backends",
    "frontends",
    "slots",
    "stale-slots",
    "empty",
    "service",
    "backend-count",
    "backend-sum",
    "vips",
    "markers",
    "local-only",
    "members",
    "save",
    "same",
];

const PROBE_KEYS: &[&str] = &[
    "n",
    "ok",
    "fails",
    "names",
    "distinct",
    "without",
    "peer",
    "from",
    "from-cycle",
    "errno",
    "took-under",
    "chi2",
    "least-cost",
    "weights",
    "tally",
    "prefix",
    "prefix-sorted",
    "windows",
    "repeat",
    "union",
    "reconnects",
    "original-dst",
    "clients",
    "save",
    "moved",
    "since",
    "except",
    "collect",
];

/// Answers by backend name; panics on a failed probe (every name check implies `ok`).
fn by_name(lines: &[Probe]) -> BTreeMap<String, usize> {
    crate::common::by_name(lines)
}

/// The backends in line order; every probe must have succeeded.
fn sequence(lines: &[Probe]) -> Vec<String> {
    lines
        .iter()
        .map(|p| {
            assert_eq!(p["ok"], true, "probe failed: {p}");
            p["name"].as_str().unwrap().to_string()
        })
        .collect()
}

/// What probes kept for later ones and for other steps.
#[derive(Default)]
struct Kept {
    /// `save=NAME`: the backend of each client address.
    clients: BTreeMap<String, BTreeMap<String, String>>,
    /// `collect=BAG`: the backends that answered.
    bags: BTreeMap<String, BTreeSet<String>>,
}

/// The backend each client address (the line's `local` address) reached; every probe must
/// have succeeded.
fn client_backends(lines: &[Probe]) -> BTreeMap<String, String> {
    lines
        .iter()
        .map(|p| {
            assert_eq!(p["ok"], true, "probe failed: {p}");
            let local = p["local"].as_str().expect("a line with `local`");
            let ip = local
                .parse::<std::net::SocketAddr>()
                .map_or(local.to_string(), |a| a.ip().to_string());
            (ip, p["name"].as_str().unwrap().to_string())
        })
        .collect()
}

/// The addresses `FIRST-LAST` (both included, one family).
fn ip_range(s: &str) -> Vec<IpAddr> {
    let (a, b) = s
        .split_once('-')
        .unwrap_or_else(|| panic!("{s:?} is not FIRST-LAST"));
    let (a, b): (IpAddr, IpAddr) = (
        a.parse()
            .unwrap_or_else(|_| panic!("{a:?}: not an address")),
        b.parse()
            .unwrap_or_else(|_| panic!("{b:?}: not an address")),
    );
    let n = |ip: IpAddr| match ip {
        IpAddr::V4(v) => u128::from(u32::from(v)),
        IpAddr::V6(v) => u128::from(v),
    };
    assert!(
        a.is_ipv4() == b.is_ipv4() && n(a) <= n(b) && n(b) - n(a) < 4096,
        "{s:?}: a range of one family, FIRST <= LAST, at most 4096 addresses"
    );
    (n(a)..=n(b))
        .map(|x| match a {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(x as u32)),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(x)),
        })
        .collect()
}

/// Checks a probe's JSON lines against the step's expectations (see the README); `save`
/// and `collect` keep what the lines show in `kept`.
fn check_probe(step: &Step, lines: &[Probe], took: Duration, vars: &mut Vars, kept: &mut Kept) {
    for (k, v) in &step.expect {
        // Values may hold variables; `tally`, `moved` and `names` see to theirs.
        let v = &match k.as_str() {
            "tally" | "moved" | "names" => v.clone(),
            _ => vars.expand(v),
        };
        match k.as_str() {
            "n" => assert_eq!(lines.len(), v.parse::<usize>().unwrap(), "{lines:?}"),
            "ok" => assert!(lines.iter().all(|p| p["ok"] == true), "{lines:?}"),
            "fails" => assert!(
                !lines.is_empty() && lines.iter().all(|p| p["ok"] != true),
                "want every probe failed: {lines:?}"
            ),
            "names" => check_names(v, lines, vars),
            "clients" => {
                let got = client_backends(lines).len();
                assert_eq!(got, v.parse::<usize>().expect("clients=N"), "{lines:?}");
            }
            "moved" => check_moved(step, v, lines, vars, kept),
            "since" | "except" | "save" => {}
            "collect" => {
                kept.bags
                    .entry(v.clone())
                    .or_default()
                    .extend(by_name(lines).into_keys());
            }
            "distinct" => {
                let got = by_name(lines).len();
                match v.strip_prefix(">=") {
                    Some(min) => assert!(got >= min.parse().unwrap(), "{got} backends: {lines:?}"),
                    None => assert_eq!(got, v.parse::<usize>().unwrap(), "{lines:?}"),
                }
            }
            "without" => {
                let got = by_name(lines);
                for n in list(v) {
                    assert!(!got.contains_key(&n), "{n} answered: {got:?}");
                }
            }
            "peer" | "from" => {
                for p in lines {
                    assert_eq!(p[k.as_str()], v.as_str(), "{k}: {p}");
                }
            }
            "from-cycle" => {
                let want = list(v);
                for (i, p) in lines.iter().enumerate() {
                    assert_eq!(p["ok"], true, "{p}");
                    assert_eq!(
                        p["from"],
                        want[i % want.len()].as_str(),
                        "datagram {i}: {lines:?}"
                    );
                }
            }
            "errno" => {
                let e = errno_value(v).unwrap_or_else(|| panic!("errno {v:?}: a name or number"));
                assert!(
                    !lines.is_empty() && lines.iter().all(|p| errno(p) == Some(e)),
                    "want errno {v}: {lines:?}"
                );
            }
            "took-under" => {
                assert!(took < duration(v), "took {took:?}: {lines:?}");
            }
            "chi2" => check_chi2(v, lines),
            "least-cost" => check_least_cost(step, v, lines),
            "weights" => assert!(
                step.get("least-cost").is_some(),
                "weights= goes with least-cost="
            ),
            "tally" => check_tally(v, lines, vars),
            "reconnects" => {
                let n = lines
                    .iter()
                    .filter(|p| !p["reconnected_after"].is_null())
                    .count();
                assert_eq!(n, v.parse::<usize>().expect("reconnects=N"), "{lines:?}");
            }
            "original-dst" => {
                for p in lines {
                    let dst = p["original_dst"].as_str().unwrap_or("");
                    assert!(glob(v, dst), "original_dst {dst:?} is not {v}: {p}");
                }
            }
            "prefix" | "prefix-sorted" => {
                let seq = sequence(lines);
                let want = list(v);
                let mut got = seq[..want.len().min(seq.len())].to_vec();
                if k == "prefix-sorted" {
                    got.sort();
                }
                assert!(got == want, "{k} {got:?}, want {want:?}: {seq:?}");
            }
            "windows" => check_windows(v, lines),
            "repeat" | "union" => {}
            _ => unreachable!(),
        }
    }
    if let Some(name) = step.get("save") {
        kept.clients
            .insert(vars.expand(name), client_backends(lines));
    }
}

/// `names=A,B` (or `names=$VAR`, which binds the variable): the set of answering backends.
fn check_names(v: &str, lines: &[Probe], vars: &mut Vars) {
    let got: BTreeSet<String> = by_name(lines).into_keys().collect();
    if vars.unbound(v).is_some() {
        // Binds the variable to the answering backends.
        let all = got.iter().cloned().collect::<Vec<_>>().join(",");
        vars.check(&cond(&format!("names={v}")), Some(&Value::from(all)))
            .unwrap();
        return;
    }
    let want: BTreeSet<String> = list(&vars.expand(v)).into_iter().collect();
    assert!(
        got == want,
        "answering backends {got:?}, want {want:?}: {lines:?}"
    );
}

/// `moved=N` (or `<N`, `>N`) with `since=NAME`: how many clients of the probe saved as
/// NAME answer from another backend now (`except=` backends left out).
fn check_moved(step: &Step, v: &str, lines: &[Probe], vars: &mut Vars, kept: &Kept) {
    let since = step.get("since").expect("moved=N goes with since=NAME");
    let saved = kept
        .clients
        .get(since)
        .unwrap_or_else(|| panic!("no probe saved as {since:?}"));
    let except = list(step.get("except").unwrap_or(""));
    let now = client_backends(lines);
    let mut moved = Vec::new();
    for (client, was) in saved {
        if except.contains(was) {
            continue;
        }
        let is = now
            .get(client)
            .unwrap_or_else(|| panic!("client {client} of {since} did not connect"));
        if is != was {
            moved.push(format!("{client}: {was} -> {is}"));
        }
    }
    let c = match v.starts_with(['<', '>']) {
        true => cond(&format!("moved{v}")),
        false => cond(&format!("moved={v}")),
    };
    println!("{} clients moved since {since}: {moved:?}", moved.len());
    vars.check_number(&c, moved.len() as u64)
        .unwrap_or_else(|e| panic!("{e} (since {since}): {moved:?}"));
}

/// `tally=NAME:COUNT,...`: how many answers each backend gave, and no other backend.
fn check_tally(v: &str, lines: &[Probe], vars: &mut Vars) {
    let seq = sequence(lines);
    let got = sched::tally(&seq);
    let mut names = BTreeSet::new();
    for pair in list(v) {
        let (n, c) = pair
            .split_once(':')
            .unwrap_or_else(|| panic!("{pair:?} is not name:count"));
        names.insert(n.to_string());
        let have =
            *got.get(n)
                .unwrap_or_else(|| panic!("tally: {n} did not answer: {seq:?}")) as u64;
        vars.check_number(&cond(&format!("{n}={c}")), have)
            .unwrap_or_else(|e| panic!("tally: {e}: {seq:?}"));
    }
    let extra: Vec<&String> = got.keys().filter(|n| !names.contains(*n)).collect();
    assert!(extra.is_empty(), "tally: {extra:?} answered too: {seq:?}");
}

/// `chi2=NAME:WEIGHT,...`: the answers split as the weights, by a chi-square test at
/// p = 0.001 (degrees of freedom: names - 1).
fn check_chi2(v: &str, lines: &[Probe]) {
    let c = by_name(lines);
    let w = weights(v);
    let total: u64 = w.iter().map(|(_, x)| x).sum();
    let counts: Vec<usize> = w.iter().map(|(n, _)| *c.get(n).unwrap_or(&0)).collect();
    let n: usize = counts.iter().sum();
    let x2: f64 = counts
        .iter()
        .zip(&w)
        .map(|(c, (_, x))| {
            let e = n as f64 * *x as f64 / total as f64;
            (*c as f64 - e).powi(2) / e
        })
        .sum();
    let critical = CHI2_P001[w.len() - 2];
    println!("shares {counts:?} for {v}: chi2 = {x2:.2} (critical {critical})");
    assert!(x2 < critical, "{counts:?} against {v}: chi2 {x2}");
}

/// `least-cost=wlc|sed|nq` with `weights=`: every choice of the sequence went to a backend
/// of least IPVS cost given the choices before it (see `sched::assert_least_cost`).
fn check_least_cost(step: &Step, v: &str, lines: &[Probe]) {
    let seq = sequence(lines);
    let cost = match v {
        "wlc" => sched::wlc_cost,
        "sed" => sched::sed_cost,
        "nq" => sched::nq_cost,
        other => panic!("least-cost={other}: wlc, sed or nq"),
    };
    let w = weights(step.get("weights").expect("least-cost needs weights="));
    let w: Vec<(&str, u64)> = w.iter().map(|(n, x)| (n.as_str(), *x)).collect();
    println!("{v}: {seq:?}");
    sched::assert_least_cost(&seq, &w, cost);
}

/// `windows=SIZE:MIN`: at least MIN windows of SIZE successive backends hold SIZE different
/// ones.
fn check_windows(v: &str, lines: &[Probe]) {
    let (size, min) = v.split_once(':').expect("windows=SIZE:MIN");
    let (size, min): (usize, usize) = (size.parse().unwrap(), min.parse().unwrap());
    let seq = sequence(lines);
    let full = seq
        .windows(size)
        .filter(|w| w.iter().collect::<BTreeSet<_>>().len() == size)
        .count();
    println!("sequence {seq:?}: {full} windows of {size} hold {size} backends");
    assert!(full >= min, "{seq:?}");
}
