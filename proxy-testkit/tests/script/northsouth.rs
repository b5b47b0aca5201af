//! The north-south scenarios: the two-node lab of `nslab` (an external client, node-a and
//! node-b with a pod each, an agent per node inside its namespace) driven by the steps of a
//! scenario file, once per variant of its `lab` step (`variants=tc,xdp`: the same steps in
//! a tc lab and in an XDP lab). The commands are described in `tests/scenarios/README.md`.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    process::Command,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use proxy_testkit::testbed::{ChildGuard, Netns, in_netns, output_in};
use proxy_userspace::datapath::{ServiceMaps, maps, tc};

use super::{Script, Step, duration, list, panic_text};
use crate::common::{MonitorRun, NETPROBE, agent_json, agent_path};
use crate::nslab::{self, Lab, T, Xdp, ip_of, set_int_opt, tcp_whoami, udp_whoami};

/// The nodes, by index.
const NODES: [&str; 2] = ["node-a", "node-b"];

/// The environment variable that runs every lab whose `lab` step names no XDP mode (`tc`,
/// `xdp`, `variants=`) with `--xdp native` when set to `native` (an opt-in run of every
/// scenario in XDP mode).
const LAB_XDP: &str = "EBPF_PROXY_LAB_XDP";

/// The lab of one run: the `lab` step's options and a variant's.
#[derive(Clone, Copy, Debug, Default)]
struct Opts {
    ipv6: bool,
    /// `Some(true)` for `xdp`, `Some(false)` for `tc`, None when not named.
    xdp: Option<bool>,
    dsr: bool,
}

impl Opts {
    /// Adds option `w` (`ipv6`, `tc`, `xdp`, `dsr`).
    fn add(&mut self, w: &str) {
        match w {
            "ipv6" => self.ipv6 = true,
            "tc" => self.xdp = Some(false),
            "xdp" => self.xdp = Some(true),
            "dsr" => self.dsr = true,
            _ => panic!("unknown lab option {w:?} (ipv6, tc, xdp, dsr, variants=A,B+C)"),
        }
    }

    /// Whether the step's condition (`xdp`, `!xdp`, `dsr`, `ipv6`, ...) holds.
    fn holds(&self, cond: &str) -> bool {
        let (neg, c) = match cond.strip_prefix('!') {
            Some(c) => (true, c),
            None => (false, cond),
        };
        let v = match c {
            "xdp" => self.xdp == Some(true),
            "dsr" => self.dsr,
            "ipv6" => self.ipv6,
            _ => panic!("unknown condition [{cond}] (xdp, dsr, ipv6, each with `!`)"),
        };
        v != neg
    }
}

/// `lab [ipv6] [tc|xdp] [dsr] [variants=V,...]`: the options and the variants (name and
/// options; one unnamed when none are given). A variant is options joined by `+`; `tc`
/// alone means none added.
fn lab_options(step: &Step) -> Vec<(String, Opts)> {
    assert_eq!(step.words[0], "lab", "the first step must be `lab`");
    step.only(&[]);
    let mut base = Opts::default();
    let mut variants = Vec::new();
    for w in &step.words[1..] {
        match w.strip_prefix("variants=") {
            Some(v) => variants = list(v),
            None => base.add(w),
        }
    }
    if variants.is_empty() {
        if base.xdp.is_none() && std::env::var(LAB_XDP).as_deref() == Ok("native") {
            base.xdp = Some(true);
        }
        return vec![(String::new(), base)];
    }
    variants
        .into_iter()
        .map(|v| {
            let mut o = base;
            o.xdp.get_or_insert(false);
            for w in v.split('+') {
                o.add(w);
            }
            (v, o)
        })
        .collect()
}

/// Runs a north-south scenario: each variant on a lab of its own.
pub fn run(script: &Script) {
    let first = script.steps.first().expect("an empty scenario");
    let variants = script.at(first, || lab_options(first));
    let mut failed = Vec::new();
    for (name, opts) in variants {
        let tag = if name.is_empty() {
            script.name.clone()
        } else {
            println!("  variant {name}");
            format!("{}-{}", script.name, name.replace('+', "-"))
        };
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| run_variant(script, &tag, opts))) {
            let msg = panic_text(&e);
            if name.is_empty() {
                panic!("{msg}");
            }
            println!("  variant {name}: FAILED\n{msg}");
            failed.push(format!("variant {name}: {msg}"));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

fn run_variant(script: &Script, tag: &str, opts: Opts) {
    let xdp = if opts.xdp == Some(true) {
        Xdp::Native
    } else {
        Xdp::Off
    };
    let mut lab = Lab::with_xdp(tag, xdp);
    if opts.ipv6 {
        lab.add_ipv6();
    }
    let mut run = Run {
        opts,
        flags: Default::default(),
        counters: Default::default(),
        monitors: Default::default(),
        events: Default::default(),
        captures: BTreeMap::new(),
        listeners: BTreeMap::new(),
        bags: BTreeMap::new(),
        stream: None,
        timer: None,
        held: Vec::new(),
        saved: BTreeMap::new(),
        pods: vec![("a0".into(), 0), ("b0".into(), 1)],
        lab,
    };
    for step in &script.steps[1..] {
        script.at(step, || {
            let conds = step
                .words
                .iter()
                .take_while(|w| w.starts_with('[') && w.ends_with(']'))
                .count();
            if step.words[..conds]
                .iter()
                .all(|c| opts.holds(&c[1..c.len() - 1]))
            {
                assert!(conds < step.words.len(), "a condition without a step");
                run.step(script, step, &step.words[conds..]);
            }
        });
    }
    if let Some(s) = run.stream.take() {
        s.join().expect("the stream survived");
    }
}

/// A running north-south scenario. Field order is drop order: the lab last.
struct Run {
    opts: Opts,
    /// The flags of each node's agent (`agent NODE FLAGS`), for its next start.
    flags: [Vec<String>; 2],
    /// Each node's counters as the last `counters` step read them.
    counters: [Option<BTreeMap<&'static str, u64>>; 2],
    monitors: [Option<MonitorRun>; 2],
    /// The events of each node's last stopped monitor.
    events: [Vec<serde_json::Value>; 2],
    /// Captures by name: running ones, then the lines of stopped ones.
    captures: BTreeMap<String, Capture>,
    /// Listeners held by `listen`, by "NS ADDR".
    listeners: BTreeMap<String, TcpListener>,
    /// Backend names collected by `collect=BAG`.
    bags: BTreeMap<String, BTreeSet<String>>,
    /// The `stream` running in the background.
    stream: Option<JoinHandle<usize>>,
    /// Set by `timer start`.
    timer: Option<Instant>,
    /// Connections held by `hold`, with the backend that answered each.
    held: Vec<(TcpStream, String)>,
    /// Backend names kept by `hold => save=NAME`.
    saved: BTreeMap<String, String>,
    /// The lab's pods, in the order of `Lab::pods`: name and node.
    pods: Vec<(String, usize)>,
    lab: Lab,
}

/// The node index of `node-a` or `node-b` (with or without `@`).
fn node(w: &str) -> usize {
    let n = w.strip_prefix('@').unwrap_or(w);
    NODES
        .iter()
        .position(|x| *x == n)
        .unwrap_or_else(|| panic!("no node {n:?} (node-a, node-b)"))
}

/// The word `@NAME` at `i` of `w`, without the `@`.
fn at(w: &[String], i: usize, what: &str) -> String {
    w.get(i)
        .and_then(|x| x.strip_prefix('@'))
        .unwrap_or_else(|| panic!("missing @{what}"))
        .to_string()
}

impl Run {
    /// Runs one step: `w` is its words without the conditions. The commands are described
    /// in `tests/scenarios/README.md`.
    fn step(&mut self, script: &Script, step: &Step, w: &[String]) {
        match w[0].as_str() {
            "agent" => {
                step.only(&[]);
                let i = node(w.get(1).expect("usage: agent NODE FLAGS..."));
                self.flags[i] = w[2..].to_vec();
                let flags = self.agent_flags(i);
                if let Some(a) = self.lab.agents.iter_mut().find(|a| a.node == i) {
                    a.extra = flags;
                }
            }
            "write" | "apply" => self.write(script, step, w),
            "start" => self.start(step, w),
            "restart" => {
                step.only(&[]);
                let i = node(w.get(1).expect("usage: restart NODE"));
                let a = self.agent_index(i);
                self.lab.agents[a].extra = self.agent_flags(i);
                self.lab.restart_agent(a);
            }
            "ip" => {
                step.only(&[]);
                let ns = at(w, 1, "NAMESPACE");
                let args: Vec<&str> = w[2..].iter().map(String::as_str).collect();
                self.netns(&ns)
                    .ip(&args)
                    .unwrap_or_else(|e| panic!("ip -n {ns} {args:?}: {e:#}"));
            }
            "listen" | "unlisten" => self.listen(step, w),
            "sleep" => {
                step.only(&[]);
                std::thread::sleep(duration(w.get(1).expect("usage: sleep DURATION")));
            }
            "timer" => super::timer(&mut self.timer, step),
            "tcp" | "udp" => self.exchange(step, w),
            "pod" => {
                step.only(&[]);
                let (name, i, addr) = match &w[1..] {
                    [n, at, a] if at.starts_with('@') => (n, node(at), a),
                    _ => panic!("usage: pod NAME @NODE ADDR"),
                };
                let gw = ["198.18.1.1", "198.18.2.1"][i];
                self.lab.add_pod(i, name, addr, gw);
                self.pods.push((name.clone(), i));
            }
            "hold" => self.hold(step, w),
            "release" => {
                step.only(&[]);
                match w.get(1).map(String::as_str) {
                    Some("all") => self.held.clear(),
                    Some(n) => self.held.retain(|(_, b)| b != n),
                    None => panic!("usage: release NAME | release all"),
                }
            }
            "backends" => {
                let i = node(&at(w, 1, "NODE"));
                let counts = self.active(i);
                check_active(step, &counts).unwrap_or_else(|e| panic!("{e}"));
            }
            "json" => self.json(step, w),
            "probe" => self.probe(step, w),
            "collected" => {
                step.only(&["has"]);
                let name = w.get(1).expect("usage: collected BAG => has=A,B");
                let bag = self.bags.get(name.as_str()).cloned().unwrap_or_default();
                for n in list(step.get("has").unwrap_or("")) {
                    assert!(bag.contains(&n), "{n} not in {name}: {bag:?}");
                }
            }
            "stream" => self.stream(step, w),
            "pmtu" => self.pmtu(step, w),
            "counters" => self.counters(step, w),
            "conntrack" => {
                let i = node(&at(w, 1, "NODE"));
                let n = tc::conntrack_entries(&self.agent(i).pin).unwrap() as u64;
                for (k, op, v) in comparisons(&step.after) {
                    assert_eq!(k, "entries", "conntrack @NODE => entries<=N");
                    assert!(op.holds(n, v), "{n} entries, not {op:?} {v}");
                }
            }
            "xdp" => self.xdp(step, w),
            "pins" => self.pins(step, w),
            "stats" => {
                step.only(&["traffic"]);
                assert!(
                    step.get("traffic").is_some(),
                    "usage: stats @NODE SUFFIX => traffic"
                );
                let i = node(&at(w, 1, "NODE"));
                let suffix = w.get(2).expect("usage: stats @NODE SUFFIX => traffic");
                self.stats(i, suffix);
            }
            "monitor" => self.monitor(step, w),
            "events" => {
                let i = node(&at(w, 1, "NODE"));
                check_events(step, &self.events[i], w.get(2).map(String::as_str));
            }
            "log" => self.log(step, w),
            "wait" => self.wait(step, w),
            "http" => self.http(step, &w[1..], false),
            "check" => self.check(step, w),
            "capture" => self.capture(step, w),
            other => panic!("unknown command {other:?}"),
        }
    }

    /// `json @NODE COMMAND... => has=T`: an `ebpf-proxy` command's JSON on that node's pins
    /// holds each text.
    fn json(&mut self, step: &Step, w: &[String]) {
        step.only(&["has"]);
        let i = node(&at(w, 1, "NODE"));
        let args: Vec<&str> = w[2..].iter().map(String::as_str).collect();
        assert!(!args.is_empty(), "usage: json @NODE COMMAND... => has=T");
        let dir = self.agent(i).pin.file_name().unwrap().to_str().unwrap();
        let text = agent_json(dir, &args).to_string();
        for h in step.all("has") {
            assert!(text.contains(h), "{h:?} not in {text}");
        }
    }

    /// `xdp @NODE => none | IFACE=native`: the XDP links of the node's agent.
    fn xdp(&mut self, step: &Step, w: &[String]) {
        let i = node(&at(w, 1, "NODE"));
        let modes = tc::xdp_modes(&self.agent(i).pin);
        for (k, v) in &step.expect {
            match (k.as_str(), v.as_str()) {
                ("none", "") => assert!(modes.is_empty(), "XDP links: {modes:?}"),
                (ifname, "native") => assert_eq!(
                    modes.get(ifname),
                    Some(&tc::XdpMode::Native),
                    "XDP links: {modes:?}"
                ),
                _ => panic!("xdp @NODE => none | IFACE=native"),
            }
        }
    }

    /// `pins @NODE PREFIX => count=N`: how many of the node's pins start with PREFIX.
    fn pins(&mut self, step: &Step, w: &[String]) {
        step.only(&["count"]);
        let i = node(&at(w, 1, "NODE"));
        let prefix = w.get(2).expect("usage: pins @NODE PREFIX => count=N");
        let n = std::fs::read_dir(&self.agent(i).pin)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(prefix.as_str()))
            .count();
        let want: usize = step.get("count").expect("count=N").parse().unwrap();
        assert_eq!(n, want, "pins starting with {prefix}");
    }

    /// `write FILE [as NAME]` / `apply FILE [as NAME]`: a manifest; `apply` waits until every
    /// running agent synced after it.
    fn write(&mut self, script: &Script, step: &Step, w: &[String]) {
        step.only(&[]);
        let (section, name) = match &w[1..] {
            [s] => (s.as_str(), s.as_str()),
            [s, as_, n] if as_ == "as" => (s.as_str(), n.as_str()),
            _ => panic!("usage: {} FILE [as NAME]", w[0]),
        };
        let text = script.file(section);
        let before: Vec<usize> = self.lab.agents.iter().map(|a| a.syncs()).collect();
        self.lab.write(name, &text);
        if w[0] == "apply" {
            for (a, n) in self.lab.agents.iter().zip(before) {
                a.wait_sync_after(n);
            }
        }
    }

    /// `start [--no-wait] NODE...`: the agents, each waited for (first sync, attached programs)
    /// unless `--no-wait`.
    fn start(&mut self, step: &Step, w: &[String]) {
        step.only(&[]);
        let no_wait = w.get(1).is_some_and(|x| x == "--no-wait");
        let nodes = &w[1 + no_wait as usize..];
        assert!(!nodes.is_empty(), "usage: start [--no-wait] NODE...");
        for n in nodes {
            let i = node(n);
            assert!(
                self.lab.agents.iter().all(|a| a.node != i),
                "{n} is already started"
            );
            let flags = self.agent_flags(i);
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            if no_wait {
                self.lab.spawn_node_agent(i, &flags);
            } else {
                self.lab.start_agent(i, &flags);
            }
        }
    }

    /// `listen @NS ADDR` / `unlisten @NS ADDR`: holds (frees) a TCP port in NS.
    fn listen(&mut self, step: &Step, w: &[String]) {
        step.only(&[]);
        let ns = at(w, 1, "NAMESPACE");
        let addr = w.get(2).expect("usage: listen @NS ADDR").clone();
        let key = format!("{ns} {addr}");
        if w[0] == "listen" {
            let path = self.netns(&ns).path();
            let l = in_netns(&path, || TcpListener::bind(&addr))
                .unwrap()
                .unwrap_or_else(|e| panic!("listen on {addr} in {ns}: {e}"));
            self.listeners.insert(key, l);
        } else {
            self.listeners
                .remove(&key)
                .unwrap_or_else(|| panic!("no listener {key}"));
        }
    }

    /// `counters @NODE [since] => NAME OP N...`: the tc counters, or their growth since the
    /// node's previous `counters` step.
    fn counters(&mut self, step: &Step, w: &[String]) {
        let i = node(&at(w, 1, "NODE"));
        let since = match w.get(2).map(String::as_str) {
            None => false,
            Some("since") => true,
            Some(x) => panic!("counters @NODE [since]: not {x:?}"),
        };
        let now = tc::counters(&self.agent(i).pin).unwrap();
        let prev = self.counters[i].replace(now.clone());
        for (k, op, v) in comparisons(&step.after) {
            let mut got = *now
                .get(k.as_str())
                .unwrap_or_else(|| panic!("no counter {k:?}: {now:?}"));
            if since {
                let before = prev.as_ref().expect("`counters @NODE` before `since`");
                got -= before[k.as_str()];
            }
            assert!(
                op.holds(got, v),
                "{k} {got}{} not {op:?} {v}: {now:?}",
                if since { " (growth)" } else { "" }
            );
        }
    }

    /// `monitor start @NODE ARGS...` / `monitor stop @NODE`.
    fn monitor(&mut self, step: &Step, w: &[String]) {
        step.only(&[]);
        let i = node(&at(w, 2, "NODE"));
        match w[1].as_str() {
            "start" => {
                let args: Vec<&str> = w[3..].iter().map(String::as_str).collect();
                let pin = self.agent(i).pin.clone();
                self.monitors[i] = Some(MonitorRun::start(&pin, &args));
            }
            "stop" => {
                let m = self.monitors[i].take().expect("no monitor running there");
                self.events[i] = m.stop();
            }
            _ => panic!("usage: monitor start @NODE ARGS... | monitor stop @NODE"),
        }
    }

    /// `log @NODE TEXT... => [count=N]`: the log holds every TEXT, or the one TEXT N times.
    fn log(&self, step: &Step, w: &[String]) {
        step.only(&["count"]);
        let i = node(&at(w, 1, "NODE"));
        let log = self.agent(i).log();
        let needles = &w[2..];
        assert!(!needles.is_empty(), "usage: log @NODE TEXT...");
        match step.get("count") {
            Some(c) => {
                assert_eq!(needles.len(), 1, "count=N goes with one TEXT");
                let n = log.matches(needles[0].as_str()).count();
                assert_eq!(n, c.parse::<usize>().unwrap(), "{:?} in\n{log}", needles[0]);
            }
            None => {
                for n in needles {
                    assert!(log.contains(n.as_str()), "{n:?} missing in\n{log}");
                }
            }
        }
    }

    /// `wait log @NODE TEXT...`, `wait http URL`, `wait backends @NODE`.
    fn wait(&self, step: &Step, w: &[String]) {
        match w.get(1).map(String::as_str) {
            Some("log") => {
                step.only(&["within"]);
                let i = node(&at(w, 2, "NODE"));
                let within = step.get("within").map_or(Duration::from_secs(20), duration);
                let needles = &w[3..];
                let start = Instant::now();
                loop {
                    let log = self.agent(i).log();
                    if needles.iter().all(|n| log.contains(n.as_str())) {
                        break;
                    }
                    assert!(start.elapsed() < within, "no {needles:?} in\n{log}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            Some("http") => self.http(step, &w[2..], true),
            Some("backends") => {
                let i = node(&at(w, 2, "NODE"));
                let within = step.get("within").map_or(Duration::from_secs(20), duration);
                let start = Instant::now();
                loop {
                    let counts = self.active(i);
                    match check_active(step, &counts) {
                        Ok(()) => break,
                        Err(e) => assert!(start.elapsed() < within, "within {within:?}: {e}"),
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            _ => panic!(
                "usage: wait log @NODE TEXT... | wait http URL => ... | wait backends @NODE => ..."
            ),
        }
    }

    /// `check @NODE CHECK => has=T`: the detail of a row of `ebpf-proxy check -o json` run in
    /// the node's namespace.
    fn check(&self, step: &Step, w: &[String]) {
        step.only(&["has"]);
        let i = node(&at(w, 1, "NODE"));
        let name = w.get(2).expect("usage: check @NODE CHECK => has=T");
        let out = self.lab.nodes[i]
            .exec_timeout(
                agent_path().to_str().unwrap(),
                &["check", "-o", "json"],
                Duration::from_secs(60),
            )
            .unwrap();
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        let row = rows
            .iter()
            .find(|r| r["check"] == name.as_str())
            .unwrap_or_else(|| panic!("no check {name}: {rows:?}"));
        let detail = row["detail"].as_str().unwrap();
        for h in step.all("has") {
            assert!(detail.contains(h), "{h:?} not in {row}");
        }
    }

    /// `capture start @NODE HOST as NAME` / `capture stop NAME => from.. to.. tcp-to..`.
    fn capture(&mut self, step: &Step, w: &[String]) {
        match w.get(1).map(String::as_str) {
            Some("start") => {
                step.only(&[]);
                let i = node(&at(w, 2, "NODE"));
                let (host, name) = match &w[3..] {
                    [h, as_, n] if as_ == "as" => (h, n),
                    _ => panic!("usage: capture start @NODE HOST as NAME"),
                };
                let c = Capture::start(&self.lab, i, host, name);
                self.captures.insert(name.clone(), c);
            }
            Some("stop") => {
                let name = w.get(2).expect("usage: capture stop NAME => ...");
                let c = self
                    .captures
                    .get_mut(name.as_str())
                    .unwrap_or_else(|| panic!("no capture {name}"));
                let lines = c.stop();
                let host = &c.host;
                for (k, op, v) in comparisons(&step.after) {
                    let n = match k.as_str() {
                        "from" => from_host(&lines, host),
                        "to" => to_host(&lines, host),
                        "tcp-to" => lines
                            .iter()
                            .filter(|l| l.contains(&format!("> {host}.")) && l.contains("Flags"))
                            .count(),
                        _ => panic!("capture stop: from, to or tcp-to, not {k:?}"),
                    };
                    assert!(op.holds(n as u64, v), "{k}: {n} packets: {lines:#?}");
                }
            }
            _ => panic!("usage: capture start @NODE HOST as NAME | capture stop NAME"),
        }
    }

    /// The lab's flags (`dsr`) and those of `agent NODE` for node `i`.
    fn agent_flags(&self, i: usize) -> Vec<String> {
        let mut f: Vec<String> = if self.opts.dsr {
            vec!["--north-south-mode".into(), "dsr".into()]
        } else {
            Vec::new()
        };
        f.extend(self.flags[i].iter().cloned());
        f
    }

    /// The position of node `i`'s agent in the lab's agents.
    fn agent_index(&self, i: usize) -> usize {
        self.lab
            .agents
            .iter()
            .position(|a| a.node == i)
            .unwrap_or_else(|| panic!("{} is not started", NODES[i]))
    }

    fn agent(&self, i: usize) -> &nslab::Agent {
        &self.lab.agents[self.agent_index(i)]
    }

    /// A namespace of the lab by name: `client`, `node-a`, `node-b` or a pod (`a0`, `b0`,
    /// those of `pod`).
    fn netns(&self, name: &str) -> &Netns {
        match name {
            "client" => &self.lab.client,
            "node-a" => &self.lab.nodes[0],
            "node-b" => &self.lab.nodes[1],
            _ => {
                let i = self
                    .pods
                    .iter()
                    .position(|(n, _)| n == name)
                    .unwrap_or_else(|| {
                        panic!("no namespace {name:?} (client, node-a, node-b, a0, b0)")
                    });
                &self.lab.pods[i]
            }
        }
    }

    /// `ebpf-proxy backends -o json` of node `i`'s agent: "address:port/PROTO" ->
    /// least-connections count (`active`).
    fn active(&self, i: usize) -> BTreeMap<String, u64> {
        let dir = self.agent(i).pin.file_name().unwrap().to_str().unwrap();
        let rows = agent_json(dir, &["backends"]);
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    format!(
                        "{}/{}",
                        r["backend"].as_str().unwrap(),
                        r["protocol"].as_str().unwrap()
                    ),
                    r["active"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// `hold --to ADDR [--count N] => ...`: TCP connections from the client held open (until
    /// `release`), each with the backend that answered (its first line); checked as `tcp`'s,
    /// and `save=NAME` keeps the (one) answer, `same=NAME` / `differs=NAME` compare with it.
    fn hold(&mut self, step: &Step, w: &[String]) {
        let (to, count) = match &w[1..] {
            [t, to] if t == "--to" => (to, 1),
            [t, to, c, n] if t == "--to" && c == "--count" => (to, n.parse().expect("--count N")),
            _ => panic!("usage: hold --to ADDR [--count N] => ..."),
        };
        let c = self.lab.client_path();
        let to: SocketAddr = to.parse().unwrap();
        let mut got = Vec::new();
        for _ in 0..count {
            let r = in_netns(&c, move || -> Result<(TcpStream, String), Failure> {
                let s = TcpStream::connect_timeout(&to, T)
                    .map_err(|e| Failure::from_text(e.to_string()))?;
                s.set_read_timeout(Some(T)).unwrap();
                let mut name = String::new();
                BufReader::new(&s)
                    .read_line(&mut name)
                    .map_err(|e| Failure::from_text(e.to_string()))?;
                Ok((s, name.trim().to_string()))
            })
            .unwrap();
            got.push(r.map(|(s, name)| {
                self.held.push((s, name.clone()));
                Answer {
                    name,
                    peer: String::new(),
                    echo: None,
                }
            }));
        }
        let mut plain = step.clone();
        plain
            .expect
            .retain(|(k, _)| !["save", "same", "differs"].contains(&k.as_str()));
        check_answers(&plain, &got, Duration::ZERO);
        let names: Vec<&str> = got.iter().flatten().map(|a| a.name.as_str()).collect();
        if let Some(n) = step.get("save") {
            assert_eq!(names.len(), 1, "save=NAME keeps one answer");
            self.saved.insert(n.to_string(), names[0].to_string());
        }
        for (k, v) in &step.expect {
            if k == "same" || k == "differs" {
                let saved = self
                    .saved
                    .get(v)
                    .unwrap_or_else(|| panic!("no answer saved as {v}"));
                for n in &names {
                    assert_eq!(n == saved, k == "same", "{n}, {k} {v} ({saved})");
                }
            }
        }
    }

    /// `tcp|udp --to ADDR [--count N] [--timeout D] [--until NAME:N] [--line N]
    /// [--no-checksum] [--hop-limit N] => ...`: exchanges from the client, each on a socket of
    /// its own, checked as the README says.
    fn exchange(&mut self, step: &Step, w: &[String]) {
        for (k, _) in &step.expect {
            assert!(
                EXCHANGE_KEYS.contains(&k.as_str()) || k.starts_with("source@"),
                "unknown expectation {k:?} (known here: {EXCHANGE_KEYS:?}, source@NAME)"
            );
        }
        let udp = w[0] == "udp";
        let mut to = None;
        let mut count = 1;
        let mut timeout = T;
        let mut until: Option<(String, usize)> = None;
        let mut line: Option<usize> = None;
        let mut no_checksum = false;
        let mut hop_limit: Option<i32> = None;
        let mut it = w[1..].iter();
        while let Some(o) = it.next() {
            let mut val = || {
                it.next()
                    .unwrap_or_else(|| panic!("{o} needs a value"))
                    .clone()
            };
            match o.as_str() {
                "--to" => to = Some(val()),
                "--count" => count = val().parse().expect("--count N"),
                "--timeout" => timeout = duration(&val()),
                "--until" => {
                    let v = val();
                    let (n, c) = v.split_once(':').expect("--until NAME:N");
                    until = Some((n.to_string(), c.parse().expect("--until NAME:N")));
                }
                "--line" if !udp => line = Some(val().parse().expect("--line BYTES")),
                "--no-checksum" if udp => no_checksum = true,
                "--hop-limit" if udp => hop_limit = Some(val().parse().expect("--hop-limit N")),
                _ => panic!("unknown {} option {o:?}", w[0]),
            }
        }
        let to = to.expect("--to ADDR");
        let c = self.lab.client_path();
        let start = Instant::now();
        let mut got: Vec<Result<Answer, Failure>> = Vec::new();
        for _ in 0..count {
            let r = if udp {
                udp_whoami(&c, &to, timeout, |s| {
                    if no_checksum {
                        set_int_opt(s, libc::SOL_SOCKET, libc::SO_NO_CHECK, 1);
                    }
                    if let Some(h) = hop_limit {
                        set_int_opt(s, libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, h);
                        set_int_opt(s, libc::IPPROTO_IPV6, libc::IPV6_RECVERR, 1);
                    }
                })
                .map(|(name, peer)| Answer {
                    name,
                    peer,
                    echo: None,
                })
                .map_err(|e| Failure {
                    errno: Some(e),
                    text: format!("errno {e}"),
                })
            } else if let Some(n) = line {
                let to: SocketAddr = to.parse().unwrap();
                large_line_echo(&c, to, n)
            } else {
                tcp_whoami(&c, &to, timeout)
                    .map(|(name, peer)| Answer {
                        name,
                        peer,
                        echo: None,
                    })
                    .map_err(Failure::from_text)
            };
            got.push(r);
            if let Some((n, c)) = &until {
                let seen = got
                    .iter()
                    .filter(|r| r.as_ref().is_ok_and(|a| &a.name == n))
                    .count();
                if seen >= *c {
                    break;
                }
            }
        }
        let took = start.elapsed();
        check_answers(step, &got, took);
        if let Some(bag) = step.get("collect") {
            let names = got.iter().flatten().map(|a| a.name.clone());
            self.bags.entry(bag.to_string()).or_default().extend(names);
        }
    }

    /// `probe @POD NETPROBE-ARGS... => [ok] [n=N] [collect=BAG]`: netprobe in pod POD, in
    /// the clients' cgroup of its node's agent (so the socket programs serve it).
    fn probe(&mut self, step: &Step, w: &[String]) {
        step.only(&["ok", "n", "collect"]);
        let pod = at(w, 1, "POD");
        let node = self
            .pods
            .iter()
            .find(|(n, _)| *n == pod)
            .unwrap_or_else(|| panic!("no pod {pod}"))
            .1;
        let cg = self.agent(node).cg.path().to_path_buf();
        let args: Vec<&str> = w[2..].iter().map(String::as_str).collect();
        let out = output_in(
            Some(&self.netns(&pod).path()),
            Some(&cg),
            Command::new(NETPROBE).args(&args),
            Duration::from_secs(20),
        )
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
            .collect();
        if step.get("ok").is_some() {
            for v in &lines {
                assert_eq!(v["ok"], true, "{text}");
            }
        }
        if let Some(n) = step.get("n") {
            assert_eq!(lines.len(), n.parse::<usize>().unwrap(), "{text}");
        }
        if let Some(bag) = step.get("collect") {
            let names = lines
                .iter()
                .filter_map(|v| v["name"].as_str().map(str::to_string));
            self.bags.entry(bag.to_string()).or_default().extend(names);
        }
    }

    /// `stream --to ADDR --rounds N`: starts the stream in the background;
    /// `stream wait => rounds=N`: waits for it, which must not have broken.
    fn stream(&mut self, step: &Step, w: &[String]) {
        match &w[1..] {
            [t, to, r, n] if t == "--to" && r == "--rounds" => {
                step.only(&[]);
                assert!(self.stream.is_none(), "a stream is running");
                let c = self.lab.client_path();
                self.stream = Some(echo_stream(&c, to.clone(), n.parse().unwrap()));
            }
            [x] if x == "wait" => {
                step.only(&["rounds"]);
                let s = self.stream.take().expect("no stream running");
                let rounds = s.join().expect("the stream survived");
                if let Some(n) = step.get("rounds") {
                    assert_eq!(rounds, n.parse::<usize>().unwrap());
                }
            }
            _ => panic!("usage: stream --to ADDR --rounds N | stream wait => rounds=N"),
        }
    }

    /// `pmtu --to ADDR --size N --then M => errno=E mtu=N then=NAME`: on one connected UDP
    /// socket with path MTU discovery on (`IP_PMTUDISC_DO`), a datagram of N bytes, then
    /// one of M; the first one's error, the route's MTU after it and the second's answer.
    fn pmtu(&mut self, step: &Step, w: &[String]) {
        step.only(&["errno", "mtu", "then"]);
        let (to, size, then) = match &w[1..] {
            [t, to, s, n, th, m] if t == "--to" && s == "--size" && th == "--then" => (
                to.parse::<SocketAddr>().unwrap(),
                n.parse::<usize>().unwrap(),
                m.parse::<usize>().unwrap(),
            ),
            _ => panic!("usage: pmtu --to ADDR --size N --then M"),
        };
        let c = self.lab.client_path();
        let (first, then, mtu) = in_netns(&c, move || {
            use std::os::fd::AsRawFd;
            let s = UdpSocket::bind("0.0.0.0:0").unwrap();
            set_int_opt(
                &s,
                libc::IPPROTO_IP,
                libc::IP_MTU_DISCOVER,
                libc::IP_PMTUDISC_DO,
            );
            s.connect(to).unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            s.send(&vec![b'x'; size]).unwrap();
            let mut buf = [0u8; 2048];
            let first = s.recv(&mut buf).map_err(|e| e.raw_os_error().unwrap_or(-1));
            // The route now knows the smaller MTU: a datagram that fits it gets its answer.
            let then = s
                .send(&vec![b'x'; then])
                .and_then(|_| s.recv(&mut buf))
                .map(|n| String::from_utf8_lossy(&buf[..n]).into_owned())
                .map_err(|e| e.raw_os_error().unwrap_or(-1));
            let mut mtu: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as u32;
            // SAFETY: getsockopt(IP_MTU) into an int on our connected socket.
            unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    libc::IPPROTO_IP,
                    libc::IP_MTU,
                    &mut mtu as *mut _ as *mut libc::c_void,
                    &mut len,
                )
            };
            (first.map(|_| ()), then, mtu)
        })
        .unwrap();
        if let Some(e) = step.get("errno") {
            assert_eq!(first, Err(errno_value(e) as i32), "the first datagram");
        }
        if let Some(m) = step.get("mtu") {
            assert_eq!(mtu, m.parse::<i32>().unwrap(), "the route's MTU");
        }
        if let Some(n) = step.get("then") {
            assert!(
                then.as_deref().is_ok_and(|t| t.starts_with(n)),
                "the second datagram: {then:?}"
            );
        }
    }

    /// `stats @NODE SUFFIX => traffic`: the per-Service counters of the sets whose name
    /// ends in SUFFIX: at least one set, and over them connections > 0, packets >=
    /// connections and bytes > 20 x packets.
    fn stats(&self, i: usize, suffix: &str) {
        let pin = &self.agent(i).pin;
        let per = maps::read_service_stats(pin).unwrap();
        let names = maps::PinnedMaps::open(pin)
            .and_then(|m| m.snapshot())
            .unwrap()
            .names;
        let sets: Vec<_> = per
            .iter()
            .filter(|(id, _)| names.get(id).is_some_and(|n| n.ends_with(suffix)))
            .map(|(_, s)| *s)
            .collect();
        assert!(!sets.is_empty(), "{per:?} {names:?}");
        let (c, p, b) = sets.iter().fold((0, 0, 0), |(c, p, b), s| {
            (c + s.connections, p + s.packets, b + s.bytes)
        });
        assert!(
            c > 0 && p >= c && b > p * 20,
            "connections {c}, packets {p}, bytes {b}"
        );
    }

    /// `[wait] http URL => code=N .PATH=V...`: curl from the client (bounded by `-m 3`); the
    /// status code and fields of the JSON body. `wait http` polls (every 200 ms, at most
    /// `within`, default 20 s) until the code is N, then checks the fields once.
    fn http(&self, step: &Step, w: &[String], wait: bool) {
        let url = w.first().expect("usage: http URL => code=N .PATH=V");
        let fetch = || -> (String, String) {
            let out = self
                .lab
                .client
                .exec(
                    "curl",
                    &["-s", "-g", "-m", "3", "-w", "\n%{http_code}", url],
                )
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
            (code.to_string(), body.to_string())
        };
        let want = step.get("code");
        let (code, body) = if wait {
            let want = want.expect("wait http needs code=N");
            let within = step.get("within").map_or(Duration::from_secs(20), duration);
            let start = Instant::now();
            loop {
                let (code, body) = fetch();
                if code == want {
                    break (code, body);
                }
                assert!(
                    start.elapsed() < within,
                    "{url}: code {code}, not {want}, within {within:?}"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        } else {
            fetch()
        };
        for (k, v) in &step.expect {
            if k == "code" {
                assert_eq!(&code, v, "{url}: {body}");
            } else if let Some(path) = k.strip_prefix('.') {
                let json: serde_json::Value = serde_json::from_str(&body)
                    .unwrap_or_else(|e| panic!("{url}: body not JSON ({e}): {body:?}"));
                let got = path.split('.').fold(&json, |j, p| &j[p]);
                assert!(
                    same_value(got, v),
                    "{url}: {path} is {got}, not {v}: {json}"
                );
            } else {
                assert!(
                    k == "within" && wait,
                    "unknown expectation {k:?} (code=N, .PATH=V, within=D)"
                );
            }
        }
    }
}

const EXCHANGE_KEYS: &[&str] = &[
    "names",
    "among",
    "distinct",
    "source",
    "at-least",
    "fails",
    "errno",
    "took-under",
    "collect",
    "echo",
    "even-per-cpu",
];

/// One answered exchange: the backend's name, the client address it saw (empty for
/// `--line`), the length of the echoed line (`--line`).
struct Answer {
    name: String,
    peer: String,
    echo: Option<usize>,
}

/// A failed exchange: its errno, when known, and the error.
#[derive(Debug)]
struct Failure {
    errno: Option<i32>,
    text: String,
}

impl Failure {
    /// From an I/O error's text: its errno from `(os error N)`.
    fn from_text(text: String) -> Failure {
        let errno = text
            .split("(os error ")
            .nth(1)
            .and_then(|r| r.split(')').next())
            .and_then(|n| n.parse().ok());
        Failure { errno, text }
    }

    /// Whether it failed with `e`; a timed-out connect() has no errno but says so.
    fn is(&self, e: i64) -> bool {
        self.errno.map(i64::from) == Some(e) || (e == 110 && self.text.contains("timed out"))
    }
}

/// An errno by name or number.
fn errno_value(s: &str) -> i64 {
    match s {
        "ECONNREFUSED" => libc::ECONNREFUSED.into(),
        "ETIMEDOUT" => libc::ETIMEDOUT.into(),
        "EHOSTUNREACH" => libc::EHOSTUNREACH.into(),
        "EMSGSIZE" => libc::EMSGSIZE.into(),
        n => n.parse().unwrap_or_else(|_| {
            panic!("errno {n:?}: a number or ECONNREFUSED, ETIMEDOUT, EHOSTUNREACH, EMSGSIZE")
        }),
    }
}

/// Checks the answers of a `tcp` or `udp` step (see the README).
fn check_answers(step: &Step, got: &[Result<Answer, Failure>], took: Duration) {
    let show = || {
        got.iter()
            .map(|r| match r {
                Ok(a) => format!("{} {} {:?}", a.name, a.peer, a.echo),
                Err(f) => format!("failed: {}", f.text),
            })
            .collect::<Vec<_>>()
    };
    let failing = step.get("fails").is_some() || step.get("errno").is_some();
    if failing {
        assert!(
            !got.is_empty() && got.iter().all(|r| r.is_err()),
            "every exchange should fail: {:?}",
            show()
        );
    } else {
        assert!(
            got.iter().all(|r| r.is_ok()),
            "every exchange should succeed: {:?}",
            show()
        );
    }
    let answers: Vec<&Answer> = got.iter().flatten().collect();
    let names: BTreeMap<&str, usize> = answers.iter().fold(BTreeMap::new(), |mut m, a| {
        *m.entry(a.name.as_str()).or_default() += 1;
        m
    });
    for (k, v) in &step.expect {
        match k.as_str() {
            "names" => {
                let want: BTreeSet<String> = list(v).into_iter().collect();
                let got: BTreeSet<String> = names.keys().map(|s| s.to_string()).collect();
                assert!(got == want, "answering backends {got:?}, not {want:?}");
            }
            "among" => {
                let allowed = list(v);
                for n in names.keys() {
                    assert!(allowed.iter().any(|a| a == n), "{n} answered: {:?}", show());
                }
            }
            "distinct" => assert_eq!(names.len(), v.parse::<usize>().unwrap(), "{:?}", show()),
            "at-least" => {
                let (n, c) = v.split_once(':').expect("at-least=NAME:N");
                let c: usize = c.parse().unwrap();
                let seen = names.get(n).copied().unwrap_or(0);
                assert!(seen >= c, "{seen} answers from {n}: {:?}", show());
            }
            "errno" => {
                let e = errno_value(v);
                for r in got {
                    if let Err(f) = r {
                        assert!(f.is(e), "want {v}: {f:?}");
                    }
                }
            }
            "took-under" => assert!(took < duration(v), "took {took:?}: {:?}", show()),
            "echo" => {
                let n: usize = v.parse().unwrap();
                for a in &answers {
                    assert_eq!(a.echo, Some(n), "the line came back whole");
                }
            }
            "source" => {
                for a in &answers {
                    assert_eq!(ip_of(&a.peer), *v, "source seen by {}", a.name);
                }
            }
            k if k.starts_with("source@") => {
                let b = &k["source@".len()..];
                for a in answers.iter().filter(|a| a.name == b) {
                    assert_eq!(ip_of(&a.peer), *v, "source seen by {b}");
                }
            }
            "even-per-cpu" => {
                // Per-CPU cursors: each backend's share is within one per CPU of an even
                // split.
                let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
                let even = answers.len() / names.len().max(1);
                assert!(
                    names.values().all(|c| c.abs_diff(even) <= cpus),
                    "{names:?}: not within {cpus} of {even} each"
                );
            }
            "fails" | "collect" => {}
            _ => unreachable!(),
        }
    }
}

/// Checks `backends @NODE` expectations on the least-connections counts: `ADDR:PORT/PROTO=N`
/// (that backend), `each=N` (every one), `each@SUFFIX=N` (every one whose key ends in
/// SUFFIX), `sum@SUFFIX=N` (their sum); `within` is `wait`'s.
fn check_active(step: &Step, counts: &BTreeMap<String, u64>) -> Result<(), String> {
    for (k, v) in &step.expect {
        if k == "within" {
            continue;
        }
        let want: u64 = v
            .parse()
            .unwrap_or_else(|_| panic!("{k}={v}: not a number"));
        let of = |suffix: &str| -> Vec<u64> {
            counts
                .iter()
                .filter(|(b, _)| b.ends_with(suffix))
                .map(|(_, c)| *c)
                .collect()
        };
        let ok = if k == "each" {
            counts.values().all(|c| *c == want)
        } else if let Some(suffix) = k.strip_prefix("each@") {
            of(suffix).iter().all(|c| *c == want)
        } else if let Some(suffix) = k.strip_prefix("sum@") {
            of(suffix).iter().sum::<u64>() == want
        } else {
            counts.get(k) == Some(&want)
        };
        if !ok {
            return Err(format!("{k}={v} does not hold: counts {counts:?}"));
        }
    }
    Ok(())
}

/// A comparison of an expectation: `NAME=N`, `NAME>N`, `NAME>=N`, `NAME<N`, `NAME<=N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Eq,
    Gt,
    Ge,
    Lt,
    Le,
}

impl Op {
    fn holds(self, got: u64, want: u64) -> bool {
        match self {
            Op::Eq => got == want,
            Op::Gt => got > want,
            Op::Ge => got >= want,
            Op::Lt => got < want,
            Op::Le => got <= want,
        }
    }
}

/// The comparisons of the words after `=>`.
fn comparisons(after: &[String]) -> Vec<(String, Op, u64)> {
    after
        .iter()
        .map(|w| {
            let at = w
                .find(['=', '<', '>'])
                .unwrap_or_else(|| panic!("{w:?} is not NAME=N, NAME>N, NAME>=N, NAME<=N"));
            let (name, rest) = w.split_at(at);
            let (op, n) = if let Some(n) = rest.strip_prefix(">=") {
                (Op::Ge, n)
            } else if let Some(n) = rest.strip_prefix("<=") {
                (Op::Le, n)
            } else if let Some(n) = rest.strip_prefix('>') {
                (Op::Gt, n)
            } else if let Some(n) = rest.strip_prefix('<') {
                (Op::Lt, n)
            } else {
                (Op::Eq, &rest[1..])
            };
            let n = n
                .parse()
                .unwrap_or_else(|_| panic!("{w:?}: {n:?} is not a number"));
            (name.to_string(), op, n)
        })
        .collect()
}

/// Whether JSON value `v` is `want` as written: `null`, a string or a number.
fn same_value(v: &serde_json::Value, want: &str) -> bool {
    match v {
        serde_json::Value::Null => want == "null",
        serde_json::Value::String(s) => s == want,
        // A number or a boolean, as JSON writes it.
        other => {
            let text = other.to_string();
            text == want
        }
    }
}

/// `events @NODE [TYPE] => ...`: the events of the node's last stopped monitor (of TYPE).
fn check_events(step: &Step, all: &[serde_json::Value], kind: Option<&str>) {
    let events: Vec<&serde_json::Value> = all
        .iter()
        .filter(|e| kind.is_none_or(|k| e["type"] == k))
        .collect();
    for w in &step.after {
        let (k, v) = w
            .split_once('=')
            .unwrap_or_else(|| panic!("{w:?}: events expectations are KEY=VALUE"));
        match k {
            "count" => assert_eq!(events.len(), v.parse::<usize>().unwrap(), "{all:#?}"),
            "count>" => assert!(events.len() >= v.parse::<usize>().unwrap(), "{all:#?}"),
            "only" => assert!(events.iter().all(|e| e["type"] == v), "{all:#?}"),
            "distinct" => {
                let values: BTreeSet<String> = events.iter().map(|e| e[v].to_string()).collect();
                assert_eq!(values.len(), events.len(), "{v} differs: {all:#?}");
            }
            _ => {
                let (fields, prefix) = match k.strip_suffix('^') {
                    Some(f) => (f, true),
                    None => (k, false),
                };
                for e in &events {
                    let ok = fields.split('|').any(|f| {
                        if prefix {
                            e[f].as_str().is_some_and(|s| s.starts_with(v))
                        } else {
                            same_value(&e[f], v)
                        }
                    });
                    assert!(ok, "{w}: {e}");
                }
            }
        }
    }
}

/// `tcpdump` on a node's `eth0`, one line per IP packet to or from a host, killed when
/// stopped or dropped.
struct Capture {
    host: String,
    child: Option<ChildGuard>,
    out: PathBuf,
    lines: Vec<String>,
}

impl Capture {
    /// Starts capturing on node `node`'s `eth0` the packets to or from `host` (`ip` or
    /// `ip6` by its family); returns once tcpdump listens (bounded).
    fn start(lab: &Lab, node: usize, host: &str, name: &str) -> Capture {
        let out = lab.manifests.path().with_extension(format!("{name}.cap"));
        let err = lab
            .manifests
            .path()
            .with_extension(format!("{name}.cap.err"));
        let family = if host.contains(':') { "ip6" } else { "ip" };
        let child = lab.nodes[node]
            .spawn(
                None,
                Command::new("tcpdump")
                    .args(["-i", "eth0", "-n", "-l", "--immediate-mode"])
                    .arg(format!("{family} host {host}"))
                    .stdout(std::fs::File::create(&out).unwrap())
                    .stderr(std::fs::File::create(&err).unwrap()),
            )
            .expect("tcpdump");
        let start = Instant::now();
        while !std::fs::read_to_string(&err)
            .unwrap_or_default()
            .contains("listening on")
        {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "tcpdump did not start: {}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Capture {
            host: host.to_string(),
            child: Some(child),
            out,
            lines: Vec::new(),
        }
    }

    /// Stops the capture (once): the lines it printed.
    fn stop(&mut self) -> Vec<String> {
        if let Some(mut c) = self.child.take() {
            std::thread::sleep(Duration::from_millis(300));
            c.kill();
            self.lines = std::fs::read_to_string(&self.out)
                .unwrap_or_default()
                .lines()
                .map(str::to_string)
                .collect();
        }
        self.lines.clone()
    }
}

/// Lines of a capture whose packet goes to `host` (tcpdump -n: `src.port > dst.port:`).
fn to_host(lines: &[String], host: &str) -> usize {
    lines
        .iter()
        .filter(|l| l.contains(&format!("> {host}.")))
        .count()
}

/// Lines of a capture whose packet comes from `host`.
fn from_host(lines: &[String], host: &str) -> usize {
    lines
        .iter()
        .filter(|l| l.contains(&format!(" {host}.")) && !l.contains(&format!("> {host}.")))
        .count()
}

/// Sends a `bytes`-byte line over one TCP connection from the client namespace to `to`:
/// the answer with the length of the line that came back (the backend's name, a space,
/// the line).
fn large_line_echo(client: &Path, to: SocketAddr, bytes: usize) -> Result<Answer, Failure> {
    in_netns(client, move || {
        let s =
            TcpStream::connect_timeout(&to, T).map_err(|e| Failure::from_text(e.to_string()))?;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        let mut name = String::new();
        r.read_line(&mut name)
            .map_err(|e| Failure::from_text(e.to_string()))?;
        let big = "x".repeat(bytes);
        w.write_all(format!("{big}\n").as_bytes())
            .map_err(|e| Failure::from_text(e.to_string()))?;
        let mut l = String::new();
        r.read_line(&mut l)
            .map_err(|e| Failure::from_text(e.to_string()))?;
        Ok(Answer {
            name: name.trim().to_string(),
            peer: String::new(),
            echo: Some(l.trim().len()),
        })
    })
    .unwrap()
}

/// One TCP connection from the client namespace to `to`, in a thread: `rounds` lines sent
/// 10 ms apart, each checked as the backend echoes it (its name, then the line). The
/// thread's result is the number of rounds; it panics when the stream breaks.
fn echo_stream(client: &Path, to: String, rounds: usize) -> JoinHandle<usize> {
    let to: SocketAddr = to.parse().unwrap();
    let client = client.to_path_buf();
    std::thread::spawn(move || {
        in_netns(&client, move || {
            let s = TcpStream::connect_timeout(&to, T).unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            let mut w = s.try_clone().unwrap();
            let mut r = BufReader::new(s);
            let mut name = String::new();
            r.read_line(&mut name).unwrap();
            let mut n = 0;
            for i in 0..rounds {
                w.write_all(format!("line-{i}\n").as_bytes()).unwrap();
                let mut l = String::new();
                r.read_line(&mut l).unwrap();
                assert_eq!(l.trim(), format!("{} line-{i}", name.trim()));
                n += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            n
        })
        .unwrap()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons_and_variants() {
        let words: Vec<String> = ["a>0", "b>=580", "c<=600", "d=0", "e<3"]
            .iter()
            .map(|w| w.to_string())
            .collect();
        let c: Vec<(String, Op, u64)> = comparisons(&words);
        assert_eq!(
            c,
            [
                ("a".to_string(), Op::Gt, 0),
                ("b".to_string(), Op::Ge, 580),
                ("c".to_string(), Op::Le, 600),
                ("d".to_string(), Op::Eq, 0),
                ("e".to_string(), Op::Lt, 3),
            ]
        );
        let s = Script::parse(Path::new("t.txtar"), "lab ipv6 variants=tc,xdp+dsr\n");
        let v = lab_options(&s.steps[0]);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].0, "tc");
        assert!(v[0].1.ipv6 && v[0].1.xdp == Some(false) && !v[0].1.dsr);
        assert!(v[1].1.ipv6 && v[1].1.xdp == Some(true) && v[1].1.dsr);
        assert!(v[1].1.holds("xdp") && v[1].1.holds("dsr") && !v[1].1.holds("!ipv6"));
        assert!(!v[0].1.holds("xdp") && v[0].1.holds("!dsr"));
    }
}
