//! The socket-level scenarios: a lab of [`Env`] (a client pod, backend pods `b0..` serving
//! their name, one agent per node on the lab's manifest directory), driven by the steps of
//! a scenario file. The commands are described in `tests/scenarios/README.md`.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use proxy_common::FRONTEND_F_VIP_MARKER;
use proxy_userspace::datapath::Snapshot;

use super::{Script, Step, duration, list, weights};
use crate::common::{Env, OtherNode, Probe, apply_on, errno};
use crate::sched;

/// Chi-square critical values at p = 0.001 for 1..=5 degrees of freedom: a correct
/// implementation fails a distribution check one run in a thousand at most.
const CHI2_P001: [f64; 5] = [10.828, 13.816, 16.266, 18.467, 20.515];

/// A running socket scenario.
struct Lab {
    env: Env,
    /// The nodes' names (`lab nodes=`); the first is `env`'s own agent. Empty: one node,
    /// without `--hostname-override`.
    nodes: Vec<String>,
    /// The agents of the other nodes, once started.
    others: Vec<OtherNode>,
    /// Map snapshots kept by `maps => save=NAME`.
    saved: BTreeMap<String, Snapshot>,
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

impl Lab {
    /// `lab backends=N [ipv6] [nodes=NAME,NAME...]`.
    fn new(script: &Script, step: &Step) -> Lab {
        let mut n = 0;
        let mut ipv6 = false;
        let mut nodes = Vec::new();
        for w in &step.words[1..] {
            match w.split_once('=') {
                Some(("backends", v)) => n = v.parse().expect("backends=N"),
                Some(("nodes", v)) => nodes = list(v),
                None if w == "ipv6" => ipv6 = true,
                _ => panic!("unknown lab option {w:?} (backends=N, ipv6, nodes=A,B)"),
            }
        }
        let mut env = Env::new(&format!("sc-{}", script.name), n, ipv6);
        if let Some(first) = nodes.first() {
            env.extra_agent_args = vec!["--hostname-override".into(), first.clone()];
        }
        Lab {
            env,
            nodes,
            others: Vec::new(),
            saved: BTreeMap::new(),
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
                args.extend(w[1..].iter().cloned());
                self.env.extra_agent_args = args;
            }
            "write" | "apply" => {
                step.only(&[]);
                let (section, name) = match &w[1..] {
                    [s] => (s.as_str(), s.as_str()),
                    [s, as_, n] if as_ == "as" => (s.as_str(), n.as_str()),
                    _ => panic!("usage: {} FILE [as NAME]", w[0]),
                };
                let text = script.file(section);
                if w[0] == "apply" && self.env.agent.is_some() {
                    let others: Vec<&OtherNode> = self.others.iter().collect();
                    apply_on(&self.env, &others, || self.env.write_manifest(name, &text));
                } else {
                    self.env.write_manifest(name, &text);
                }
            }
            "remove" => {
                step.only(&[]);
                self.env.remove_manifest(step.word(1, "a file name"));
            }
            "start" => {
                step.only(&[]);
                self.env.start_agent();
                for node in self.nodes.iter().skip(1 + self.others.len()) {
                    let other = self.env.add_node(node);
                    self.others.push(other);
                }
            }
            "stop" => {
                step.only(&[]);
                self.env.stop_agent();
            }
            "probe" => self.probe(step),
            "maps" => {
                let snap = self.env.snapshot();
                check_maps(step, &snap, &self.saved).unwrap_or_else(|e| panic!("{e}"));
                if let Some(name) = step.get("save") {
                    self.saved.insert(name.to_string(), snap);
                }
            }
            "wait" => match w.get(1).map(String::as_str) {
                Some("maps") => {
                    // Checked once for the expectation keys, then polled.
                    step.only(MAP_KEYS);
                    self.env.wait_maps(
                        |s| check_maps(step, s, &self.saved).is_ok(),
                        &format!("maps {:?}", step.expect),
                    );
                }
                Some("log") => {
                    step.only(&[]);
                    let needles = &w[2..];
                    assert!(!needles.is_empty(), "usage: wait log TEXT...");
                    self.env.wait_log(
                        |l| l.lines().any(|l| needles.iter().all(|n| l.contains(n))),
                        &format!("a log line with {needles:?}"),
                    );
                }
                _ => panic!("usage: wait maps => ... | wait log TEXT..."),
            },
            "log" => self.log(step),
            "healthz" => self.healthz(step),
            "cli" => self.cli(step),
            "timer" => {
                step.only(&[]);
                match &w[1..] {
                    [s] if s == "start" => self.timer = Some(Instant::now()),
                    [u, d] if u == "under" => {
                        let t = self.timer.expect("`timer start` first").elapsed();
                        assert!(t < duration(d), "took {t:?}, not under {d}");
                    }
                    _ => panic!("usage: timer start | timer under DURATION"),
                }
            }
            other => panic!("unknown command {other:?}"),
        }
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

    /// `probe [@NODE] NETPROBE-ARGS... => EXPECTATIONS`: netprobe in the client pod, in the
    /// clients' cgroup of the node, once or (`repeat=N union=...`) until the answering
    /// backends of all runs make up `union`.
    fn probe(&self, step: &Step) {
        step.only(PROBE_KEYS);
        let mut args: Vec<&str> = step.words[1..].iter().map(String::as_str).collect();
        let at = args
            .first()
            .and_then(|a| a.strip_prefix('@'))
            .map(str::to_string);
        if at.is_some() {
            args.remove(0);
        }
        assert!(!args.is_empty(), "usage: probe [@NODE] NETPROBE-ARGS...");
        let cg = self.cgroup(at.as_deref());
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
            let lines = self.env.probe_in(&cg, &args);
            let took = t.elapsed();
            check_probe(step, &lines, took);
            if let Some(u) = &union {
                seen.extend(by_name(&lines).into_keys());
                if seen.len() >= u.len() {
                    break;
                }
            }
        }
        if let Some(u) = union {
            assert_eq!(seen, u, "backends answering over the runs");
        }
    }

    /// `log TEXT... => count=N has=T`: the agent log's lines holding every TEXT; at least
    /// one, or exactly `count`; the first of them holds each `has`.
    fn log(&self, step: &Step) {
        step.only(&["count", "has"]);
        let needles = &step.words[1..];
        assert!(!needles.is_empty(), "usage: log TEXT... => count=N has=T");
        let log = self.env.log();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .collect();
        match step.get("count") {
            Some(c) => assert_eq!(
                lines.len(),
                c.parse::<usize>().expect("count=N"),
                "lines with {needles:?}: {lines:?}\n{log}"
            ),
            None => assert!(!lines.is_empty(), "no line with {needles:?}:\n{log}"),
        }
        for h in step.all("has") {
            assert!(
                lines.first().is_some_and(|l| l.contains(h)),
                "{h:?} not in {lines:?}"
            );
        }
    }

    /// `healthz => code=N has=T`: the agent's `/healthz`, as curl sees it.
    fn healthz(&self, step: &Step) {
        step.only(&["code", "has"]);
        let h = self.env.health_addr();
        let out = std::process::Command::new("curl")
            .args(["-s", "-w", "\n%{http_code}", &format!("http://{h}/healthz")])
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

    /// `cli ARGS... => has=T json-len=N`: `ebpf-proxy ARGS... --pin-dir <the lab's>`,
    /// which must succeed.
    fn cli(&self, step: &Step) {
        step.only(&["has", "json-len"]);
        let out = std::process::Command::new(crate::common::AGENT)
            .args(&step.words[1..])
            .args(["--pin-dir", &self.env.pin_dir])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        println!("{text}");
        assert!(out.status.success(), "{out:?}");
        for h in step.all("has") {
            assert!(text.contains(h), "{h:?} not in:\n{text}");
        }
        if let Some(n) = step.get("json-len") {
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
            assert_eq!(
                v.as_array().expect("a JSON array").len(),
                n.parse::<usize>().expect("json-len=N"),
                "{v}"
            );
        }
    }
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

const MAP_KEYS: &[&str] = &[
    "backends",
    "frontends",
    "slots",
    "stale-slots",
    "empty",
    "service",
    "backend-count",
    "markers",
    "members",
    "save",
    "same",
];

const PROBE_KEYS: &[&str] = &[
    "n",
    "ok",
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

/// An errno by name or number.
fn errno_value(s: &str) -> i64 {
    match s {
        "EPERM" => 1,
        "ECONNREFUSED" => 111,
        "EHOSTUNREACH" => 113,
        "ETIMEDOUT" => 110,
        n => n.parse().unwrap_or_else(|_| {
            panic!("errno {n:?}: a number or EPERM, ECONNREFUSED, EHOSTUNREACH, ETIMEDOUT")
        }),
    }
}

/// Checks a probe's JSON lines against the step's expectations (see the README).
fn check_probe(step: &Step, lines: &[Probe], took: Duration) {
    for (k, v) in &step.expect {
        match k.as_str() {
            "n" => assert_eq!(lines.len(), v.parse::<usize>().unwrap(), "{lines:?}"),
            "ok" => assert!(lines.iter().all(|p| p["ok"] == true), "{lines:?}"),
            "names" => {
                let got: BTreeSet<String> = by_name(lines).into_keys().collect();
                let want: BTreeSet<String> = list(v).into_iter().collect();
                assert!(
                    got == want,
                    "answering backends {got:?}, want {want:?}: {lines:?}"
                );
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
                let e = errno_value(v);
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
            "tally" => {
                let want: BTreeMap<String, usize> = weights(v)
                    .into_iter()
                    .map(|(n, c)| (n, c as usize))
                    .collect();
                let seq = sequence(lines);
                let got = sched::tally(&seq);
                assert!(got == want, "tally {got:?}, want {want:?}: {seq:?}");
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
