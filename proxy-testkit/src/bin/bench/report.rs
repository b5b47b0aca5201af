//! Samples, statistics (median, min-max, p99), the markdown report and the PNG charts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;

/// A proxy (or the direct path) under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Case {
    Ebpf,
    /// ebpf-proxy's per-packet path: a client pod that bypasses socket-level translation
    /// (`ebpf-proxy.io/socket-lb: disabled`), translated by `pod_ingress`/`pod_egress` on
    /// its interface. Data path only (its control plane is `Ebpf`'s).
    Bypass,
    /// ebpf-proxy with `--xdp native` (north-south only: XDP serves traffic entering the
    /// node, not the socket path).
    Xdp,
    /// ebpf-proxy with `--north-south-mode dsr` on the entry node and on the backend's node
    /// (north-south only): a flow to a backend on another node goes there IPIP-encapsulated
    /// instead of source-NATed, and its replies leave that node straight to the client.
    Dsr,
    Iptables,
    Nftables,
    Direct,
}

impl Case {
    /// The cases of the cluster-IP part (every case but the north-south ones, [`Case::Xdp`]
    /// and [`Case::Dsr`]); the order gives the client pods their addresses (the bypassed
    /// pod's last, so the others keep theirs).
    pub const ALL: [Case; 5] = [
        Case::Ebpf,
        Case::Iptables,
        Case::Nftables,
        Case::Direct,
        Case::Bypass,
    ];

    pub fn parse(s: &str) -> Option<Case> {
        Some(match s {
            "ebpf" => Case::Ebpf,
            "bypass" => Case::Bypass,
            "xdp" => Case::Xdp,
            "dsr" => Case::Dsr,
            "iptables" => Case::Iptables,
            "nftables" => Case::Nftables,
            "direct" => Case::Direct,
            _ => return None,
        })
    }

    pub fn key(self) -> &'static str {
        match self {
            Case::Ebpf => "ebpf",
            Case::Bypass => "bypass",
            Case::Xdp => "xdp",
            Case::Dsr => "dsr",
            Case::Iptables => "iptables",
            Case::Nftables => "nftables",
            Case::Direct => "direct",
        }
    }

    /// Name of the case's client pod in the lab.
    pub fn pod(self) -> &'static str {
        match self {
            Case::Ebpf => "c-ebpf",
            Case::Bypass => "c-bypass",
            Case::Xdp => "c-xdp",
            Case::Dsr => "c-dsr",
            Case::Iptables => "c-ipt",
            Case::Nftables => "c-nft",
            Case::Direct => "c-direct",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Case::Ebpf => "ebpf-proxy",
            Case::Bypass => "ebpf-proxy per packet (bypassed pod)",
            Case::Xdp => "ebpf-proxy XDP",
            Case::Dsr => "ebpf-proxy DSR",
            Case::Iptables => "kube-proxy iptables rules",
            Case::Nftables => "kube-proxy nftables rules",
            Case::Direct => "direct to pod IP",
        }
    }

    fn color(self) -> RGBColor {
        match self {
            Case::Ebpf => RGBColor(0x1f, 0x77, 0xb4),
            Case::Bypass => RGBColor(0x94, 0x67, 0xbd),
            Case::Xdp => RGBColor(0x8c, 0x56, 0x4b),
            Case::Dsr => RGBColor(0x17, 0xbe, 0xcf),
            Case::Iptables => RGBColor(0xd6, 0x27, 0x28),
            Case::Nftables => RGBColor(0xff, 0x7f, 0x0e),
            Case::Direct => RGBColor(0x2c, 0xa0, 0x2c),
        }
    }
}

/// One measured value.
pub enum Sample {
    /// Cold programming time: agent sync, `iptables-restore`, `nft -f`.
    ColdMs(f64),
    /// ebpf-proxy: from starting the agent to its first `sync done`.
    ColdWallMs(f64),
    /// ebpf-proxy: the model's part of the first sync (`model_us`).
    ColdModelMs(f64),
    RuleLines(f64),
    /// One endpoint change until programmed (ebpf-proxy: file rename until the maps show it).
    ChangeMs(f64),
    /// ebpf-proxy: the agent's map writes of one change (`duration_us`).
    ChangeSyncMs(f64),
    /// ebpf-proxy: the agent's account of one change, from the watch event's receipt to
    /// the maps written (`latency_us`).
    ChangeLatencyMs(f64),
    /// ebpf-proxy: the model's part of one change (`model_us`).
    ChangeModelMs(f64),
    /// ebpf-proxy with the API source: from starting the agent to its first `sync done`.
    ApiColdWallMs(f64),
    /// ebpf-proxy with the API source: one EndpointSlice applied on the API server until
    /// the maps show it.
    ApiChangeMs(f64),
    /// ebpf-proxy with the API source: the agent's `latency_us` of one change.
    ApiChangeLatencyMs(f64),
    /// ebpf-proxy with the API source: mean of kube-proxy's network-programming latency
    /// over one run's changes.
    ApiProgrammingMeanMs(f64),
    /// A cold load that did not finish within this many seconds.
    TimedOutS(f64),
    Cps(f64),
    P50Us(f64),
    P99Us(f64),
    ConnErrors(f64),
    BackendsSeen(f64),
    RssMiB(f64),
    PeakRssMiB(f64),
    /// ebpf-proxy: RSS and peak RSS once its first periodic verification has run.
    RssVerifiedMiB(f64),
    PeakRssVerifiedMiB(f64),
    MapMiB(f64),
    ServiceMapMiB(f64),
    /// A named metric of one program (`<what>:<program>`), e.g. `ns_per_run:connect4`.
    Prog(String, f64),
    /// BPF time of every measured program together per connection, nanoseconds.
    BpfNsPerConn(f64),
    /// A north-south metric `<path>:<what>` (e.g. `tcp_remote:rate`), stored as
    /// `ns:<path>:<what>`.
    NorthSouth(String, f64),
}

impl Sample {
    fn split(&self) -> (&str, f64) {
        match *self {
            Sample::Prog(ref m, v) | Sample::NorthSouth(ref m, v) => (m.as_str(), v),
            Sample::BpfNsPerConn(v) => ("bpf_ns_per_conn", v),
            Sample::ColdMs(v) => ("cold_ms", v),
            Sample::ColdWallMs(v) => ("cold_wall_ms", v),
            Sample::ColdModelMs(v) => ("cold_model_ms", v),
            Sample::RuleLines(v) => ("rule_lines", v),
            Sample::ChangeMs(v) => ("change_ms", v),
            Sample::ChangeSyncMs(v) => ("change_sync_ms", v),
            Sample::ChangeLatencyMs(v) => ("change_latency_ms", v),
            Sample::ChangeModelMs(v) => ("change_model_ms", v),
            Sample::ApiColdWallMs(v) => ("api_cold_wall_ms", v),
            Sample::ApiChangeMs(v) => ("api_change_ms", v),
            Sample::ApiChangeLatencyMs(v) => ("api_change_latency_ms", v),
            Sample::ApiProgrammingMeanMs(v) => ("api_programming_mean_ms", v),
            Sample::TimedOutS(v) => ("timed_out_s", v),
            Sample::Cps(v) => ("cps", v),
            Sample::P50Us(v) => ("p50_us", v),
            Sample::P99Us(v) => ("p99_us", v),
            Sample::ConnErrors(v) => ("conn_errors", v),
            Sample::BackendsSeen(v) => ("backends_seen", v),
            Sample::RssMiB(v) => ("rss_mib", v),
            Sample::PeakRssMiB(v) => ("peak_rss_mib", v),
            Sample::RssVerifiedMiB(v) => ("rss_verified_mib", v),
            Sample::PeakRssVerifiedMiB(v) => ("peak_rss_verified_mib", v),
            Sample::MapMiB(v) => ("map_mib", v),
            Sample::ServiceMapMiB(v) => ("service_map_mib", v),
        }
    }
}

/// The machine the numbers come from.
#[derive(serde::Serialize, Clone, Debug)]
pub struct Machine {
    pub kernel: String,
    pub cpu: String,
    pub cores: usize,
    pub mem_gib: f64,
    pub iptables: String,
    pub nft: String,
}

fn cmd_out(p: &str, a: &[&str]) -> String {
    std::process::Command::new(p)
        .args(a)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

impl Machine {
    pub fn detect() -> Self {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|l| l.trim_start_matches([' ', '\t', ':']).trim().to_string())
            .unwrap_or_default();
        let cores = cpuinfo
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count();
        let mem_kib: f64 = fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        Self {
            kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            cpu,
            cores,
            mem_gib: (mem_kib / 1048576.0 * 10.0).round() / 10.0,
            iptables: cmd_out("iptables-restore", &["--version"]),
            nft: cmd_out("nft", &["--version"]),
        }
    }

    pub fn line(&self) -> String {
        format!(
            "Linux {}, {} x {}, {} GiB RAM; {}; {}",
            self.kernel, self.cores, self.cpu, self.mem_gib, self.iptables, self.nft
        )
    }
}

/// Linear-interpolated percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let r = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (r.floor() as usize, r.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (r - lo as f64)
}

#[derive(Clone, Copy, Debug)]
pub struct Stat {
    pub med: f64,
    pub min: f64,
    pub max: f64,
    pub p99: f64,
    pub n: usize,
}

fn stat(v: &[f64]) -> Option<Stat> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Some(Stat {
        med: percentile(&s, 50.0),
        min: s[0],
        max: s[s.len() - 1],
        p99: percentile(&s, 99.0),
        n: s.len(),
    })
}

#[derive(serde::Serialize)]
pub struct Results {
    pub machine: Machine,
    pub services: Vec<usize>,
    pub runs: usize,
    pub change_at: Vec<usize>,
    pub changes: usize,
    pub total_s: f64,
    pub failures: Vec<String>,
    /// 1-min load average before each case (other work on the machine skews the numbers).
    pub load: Vec<f64>,
    /// Peers whose cold load timed out, with the N at which it did.
    pub timed_out: BTreeMap<String, usize>,
    /// North-south: the numbers of ClusterIP services loaded next to the node ports.
    pub north_south: Vec<usize>,
    /// `case/N/metric` -> samples (one per run; for changes, one per change).
    pub samples: BTreeMap<String, Vec<f64>>,
}

impl Results {
    pub fn new(
        machine: Machine,
        services: &[usize],
        runs: usize,
        change_at: &[usize],
        changes: usize,
    ) -> Self {
        Self {
            machine,
            services: services.to_vec(),
            runs,
            change_at: change_at.to_vec(),
            changes,
            total_s: 0.0,
            failures: Vec::new(),
            timed_out: BTreeMap::new(),
            north_south: Vec::new(),
            load: Vec::new(),
            samples: BTreeMap::new(),
        }
    }

    pub fn add(&mut self, case: Case, n: usize, _run: usize, s: Sample) {
        let prefix = if matches!(s, Sample::NorthSouth(..)) {
            "ns:"
        } else {
            ""
        };
        let (m, v) = s.split();
        let m = format!("{prefix}{m}");
        self.samples
            .entry(format!("{}/{n}/{m}", case.key()))
            .or_default()
            .push(v);
    }

    /// Records the current 1-min load average.
    pub fn note_load(&mut self) {
        if let Some(l) = fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
        {
            self.load.push(l);
        }
    }

    fn get(&self, case: Case, n: usize, m: &str) -> Option<Stat> {
        stat(self.samples.get(&format!("{}/{n}/{m}", case.key()))?)
    }

    pub fn log_change(&self, case: Case, n: usize, _run: usize) {
        if let Some(s) = self.get(case, n, "change_ms") {
            eprintln!(
                "  {case:?} one endpoint change at N={n}: median {:.2} ms, p99 {:.2} ms ({} so far)",
                s.med, s.p99, s.n
            );
        }
        for (m, what) in [
            ("change_latency_ms", "agent: event received → maps written"),
            ("change_model_ms", "agent: model"),
            ("change_sync_ms", "agent: map writes"),
        ] {
            if let Some(s) = self.get(case, n, m) {
                eprintln!("    ({what}: median {:.2} ms, p99 {:.2} ms)", s.med, s.p99);
            }
        }
    }

    pub fn log_api_change(&self, n: usize) {
        for (m, what) in [
            ("api_change_ms", "API source: slice applied → maps show it"),
            (
                "api_change_latency_ms",
                "API source: agent, event received → maps written",
            ),
            (
                "api_programming_mean_ms",
                "API source: network-programming latency, mean",
            ),
        ] {
            if let Some(s) = self.get(Case::Ebpf, n, m) {
                eprintln!(
                    "  {what} at N={n}: median {:.2} ms, p99 {:.2} ms",
                    s.med, s.p99
                );
            }
        }
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        fs::write(
            dir.join("results.json"),
            serde_json::to_string_pretty(self)?,
        )?;
        fs::write(dir.join("results.md"), self.markdown())?;
        Ok(())
    }

    fn cell(&self, case: Case, n: usize, m: &str, digits: usize) -> String {
        match self.get(case, n, m) {
            Some(s) if s.n > 1 => {
                format!("{:.d$} ({:.d$}–{:.d$})", s.med, s.min, s.max, d = digits)
            }
            Some(s) => format!("{:.d$}", s.med, d = digits),
            None => match self.timed_out.get(case.key()) {
                Some(&t) if n >= t => match self.get(case, t, "timed_out_s") {
                    Some(s) if n == t && m == "cold_ms" => format!("> {:.0} s (timed out)", s.med),
                    _ => "not run".into(),
                },
                _ => "–".into(),
            },
        }
    }

    fn ratio(&self, case: Case, n: usize, m: &str) -> String {
        match (self.get(case, n, m), self.get(Case::Direct, n, m)) {
            (Some(a), Some(d)) if d.med > 0.0 => format!("{:.2}", a.med / d.med),
            _ => "–".into(),
        }
    }

    /// The whole report.
    pub fn markdown(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "# ebpf-proxy benchmarks\n");
        let _ = writeln!(o, "Machine: {}.\n", self.machine.line());
        let _ = writeln!(
            o,
            "N ClusterIP services x 10 endpoints (TCP). {} run(s); cells are median (min–max over runs). Total time {:.0} s.\n",
            self.runs, self.total_s
        );
        if let Some(l) = stat(&self.load) {
            let _ = writeln!(
                o,
                "1-min load average before each case: median {:.1} (min {:.1}, max {:.1}) on {} cores; a load above 1 means other work competed with the measurements.\n",
                l.med, l.min, l.max, self.machine.cores
            );
        }
        o.push_str(&self.headline());
        if !self.services.is_empty() {
            o.push_str(&self.cluster_ip_details());
        }
        let errs: Vec<String> = Case::ALL
            .iter()
            .flat_map(|&c| {
                self.services.iter().filter_map(move |&n| {
                    let s = self.get(c, n, "conn_errors")?;
                    (s.max > 0.0)
                        .then(|| format!("{} N={n}: up to {} failed connections", c.label(), s.max))
                })
            })
            .collect();
        if !errs.is_empty() || !self.failures.is_empty() {
            let _ = writeln!(o, "\n### Problems\n");
            for e in errs.iter().chain(&self.failures) {
                let _ = writeln!(o, "- {e}");
            }
        }
        o
    }

    /// The kernel's statistics of ebpf-proxy's programs during the data-path runs: time per
    /// invocation, invocations per connection, time per connection (median over runs).
    pub fn program_costs(&self) -> String {
        let mut o = String::new();
        let any = self
            .services
            .iter()
            .any(|&n| self.get(Case::Ebpf, n, "bpf_ns_per_conn").is_some());
        if !any {
            return o;
        }
        let _ = writeln!(
            o,
            "\n### Data path: BPF time per TCP connection (kernel program statistics)\n"
        );
        let _ = writeln!(
            o,
            "Per program: ns per invocation x invocations per connection = ns per connection (`BPF_ENABLE_STATS`, over the whole client run; programs that did not run are left out).\n"
        );
        let mut head = String::from("| program |");
        let mut rule = String::from("| --- |");
        for &n in &self.services {
            let _ = write!(head, " N = {n} |");
            rule.push_str(" ---: |");
        }
        let _ = writeln!(o, "{head}\n{rule}");
        for (prog, _) in super::progstats::PROGRAMS {
            let cells: Vec<String> = self
                .services
                .iter()
                .map(|&n| {
                    let g = |m: &str| self.get(Case::Ebpf, n, &format!("{m}:{prog}"));
                    match (g("ns_per_run"), g("runs_per_conn"), g("ns_per_conn")) {
                        (Some(a), Some(b), Some(c)) if b.med > 0.0 => {
                            format!("{:.0} x {:.2} = {:.0}", a.med, b.med, c.med)
                        }
                        _ => String::new(),
                    }
                })
                .collect();
            if cells.iter().all(|c| c.is_empty()) {
                continue;
            }
            let _ = writeln!(o, "| {prog} | {} |", cells.join(" | "));
        }
        let total: Vec<String> = self
            .services
            .iter()
            .map(|&n| self.cell(Case::Ebpf, n, "bpf_ns_per_conn", 0))
            .collect();
        let _ = writeln!(o, "| **all programs** | {} |", total.join(" | "));
        let floor = |m: &str| -> Vec<String> {
            self.services
                .iter()
                .map(|&n| match self.get(Case::Ebpf, n, m) {
                    Some(s) => format!("{:.0}", s.med),
                    None => "–".into(),
                })
                .collect()
        };
        if self
            .services
            .iter()
            .any(|&n| self.get(Case::Ebpf, n, "above_floor:all").is_some())
        {
            for (hook, what) in [
                ("connect4", "`sock_addr` hooks"),
                ("sock_release", "`sock_release`"),
            ] {
                let _ = writeln!(
                    o,
                    "| floor: a program that only returns, {what} (ns per invocation) | {} |",
                    floor(&format!("ns_per_run:floor:{hook}")).join(" | ")
                );
            }
            let _ = writeln!(
                o,
                "| **all programs above the floor** | {} |",
                floor("above_floor:all").join(" | ")
            );
            let _ = writeln!(
                o,
                "\nThe floor is what the statistics count for any program on the hook (their clock read and the call into the program; the hook's dispatch is outside every program's figures), measured by programs that only return, attached next to ebpf-proxy's for the same connections and run after them; \"above the floor\" is ebpf-proxy's own work (each program's time per invocation less its hook's floor, times its invocations per connection; the packet programs have no floor subtracted). Each row is its own median over the runs, so the rows need not subtract exactly."
            );
        }
        o
    }

    /// The control-plane targets of ebpf-proxy (agent with the manifest source, N services x
    /// 10 endpoints), each with what this run measured and whether it is met.
    pub fn targets(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "### Control-plane targets\n");
        let _ = writeln!(o, "| target | N | measured | limit | met |");
        let _ = writeln!(o, "| --- | ---: | ---: | ---: | --- |");
        for (what, m, n, statistic, limit, unit) in CONTROL_PLANE_TARGETS {
            let Some(s) = self.get(Case::Ebpf, n, m) else {
                continue;
            };
            let (v, shown) = match statistic {
                "p99" => (
                    s.p99,
                    format!("{:.2} (median {:.2}, {} changes)", s.p99, s.med, s.n),
                ),
                "med" => (
                    s.med,
                    format!("{:.2} (p99 {:.2}, {} changes)", s.med, s.p99, s.n),
                ),
                _ => (s.med, self.cell(Case::Ebpf, n, m, 0)),
            };
            let met = if v <= limit { "met" } else { "missed" };
            let _ = writeln!(
                o,
                "| {what} | {n} | {shown} {unit} | ≤ {limit} {unit} | {met} |"
            );
        }
        o.push('\n');
        o
    }

    /// The socket-path targets at every N measured: BPF time per TCP connection (all
    /// programs, statistics' floor included, median over runs) at most 500 ns, and new
    /// connections per second at least 0.98 of direct (ratio of the medians). A ratio below
    /// 0.98 whose min–max range overlaps direct's is "within the spread": the runs cannot
    /// tell it from direct.
    pub fn data_path_targets(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "### Socket-path targets\n");
        let _ = writeln!(o, "| target | N | measured | limit | met |");
        let _ = writeln!(o, "| --- | ---: | ---: | ---: | --- |");
        let mut any = false;
        for &n in &self.services {
            if let Some(s) = self.get(Case::Ebpf, n, "bpf_ns_per_conn") {
                any = true;
                let met = if s.med <= 500.0 { "met" } else { "missed" };
                let _ = writeln!(
                    o,
                    "| BPF time per TCP connection, all programs | {n} | {:.0} ({:.0}–{:.0}) ns | ≤ 500 ns | {met} |",
                    s.med, s.min, s.max
                );
            }
        }
        for &n in &self.services {
            if let (Some(e), Some(d)) = (
                self.get(Case::Ebpf, n, "cps"),
                self.get(Case::Direct, n, "cps"),
            ) && d.med > 0.0
            {
                any = true;
                let r = e.med / d.med;
                let met = if r >= 0.98 {
                    "met"
                } else if e.max >= d.min {
                    "within the spread"
                } else {
                    "missed"
                };
                let _ = writeln!(
                    o,
                    "| new connections per second, ratio to direct | {n} | {r:.2} ({:.0}–{:.0} vs {:.0}–{:.0}) | ≥ 0.98 | {met} |",
                    e.min, e.max, d.min, d.max
                );
            }
        }
        if !any {
            return String::new();
        }
        o.push('\n');
        o
    }

    /// The tables that go into the guide's benchmarks chapters (docs/src/benchmarks*.md).
    pub fn headline(&self) -> String {
        let mut o = String::new();
        if !self.services.is_empty() {
            o.push_str(&self.cluster_ip_tables());
        }
        o.push_str(&self.north_south_tables());
        o
    }

    /// The socket-path latency and the peers' rule-set sizes (results.md only).
    fn cluster_ip_details(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n### Data path latency (µs per connection: connect, request, reply, close)\n"
        );
        let _ = writeln!(
            o,
            "| N | direct p50 / p99 | ebpf-proxy p50 / p99 | ebpf-proxy per packet (bypassed pod) p50 / p99 | iptables p50 / p99 | nftables p50 / p99 |"
        );
        let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: |");
        for &n in &self.services {
            let c = |case| {
                format!(
                    "{} / {}",
                    self.cell(case, n, "p50_us", 0),
                    self.cell(case, n, "p99_us", 0)
                )
            };
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} |",
                c(Case::Direct),
                c(Case::Ebpf),
                c(Case::Bypass),
                c(Case::Iptables),
                c(Case::Nftables)
            );
        }
        let _ = writeln!(
            o,
            "\n### Rule-set size of the peers (lines of restore / nft input)\n"
        );
        let _ = writeln!(o, "| N | iptables-restore lines | nft -f lines |");
        let _ = writeln!(o, "| ---: | ---: | ---: |");
        for &n in &self.services {
            let _ = writeln!(
                o,
                "| {n} | {} | {} |",
                self.cell(Case::Iptables, n, "rule_lines", 0),
                self.cell(Case::Nftables, n, "rule_lines", 0)
            );
        }
        o
    }

    /// The control plane, socket data path and memory tables.
    fn cluster_ip_tables(&self) -> String {
        let mut o = String::new();
        o.push_str(&self.targets());
        o.push_str(&self.data_path_targets());
        o.push_str(&self.cold_table());
        o.push_str(&self.change_table());
        o.push_str(&self.connection_rate_table());
        o.push_str(&self.program_costs());
        o.push_str(&self.memory_table());
        o
    }

    /// Programming N services from cold: ebpf-proxy's start to its first sync (and the
    /// sync's parts) against the peers' whole restores.
    fn cold_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "### Control plane: programming N services from cold (ms)\n"
        );
        let _ = writeln!(
            o,
            "| N | ebpf-proxy start → synced | of which model commit | of which map writes | iptables-restore | nft -f |"
        );
        let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: |");
        for &n in &self.services {
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} |",
                self.cell(Case::Ebpf, n, "cold_wall_ms", 0),
                self.cell(Case::Ebpf, n, "cold_model_ms", 1),
                self.cell(Case::Ebpf, n, "cold_ms", 1),
                self.cell(Case::Iptables, n, "cold_ms", 0),
                self.cell(Case::Nftables, n, "cold_ms", 0)
            );
        }
        o
    }

    /// One endpoint change at every N of `change_at`: a row per row of [`CHANGE_ROWS`]
    /// that was measured or whose cold load timed out.
    fn change_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n### Control plane: one endpoint change (ms, over all changes of all runs)\n"
        );
        let _ = writeln!(o, "| N | proxy | median | p99 | changes | what is timed |");
        let _ = writeln!(o, "| ---: | --- | ---: | ---: | ---: | --- |");
        for &n in &self.change_at {
            for (label, case, m, what) in CHANGE_ROWS {
                let cell = match self.get(case, n, m) {
                    Some(s) => format!("{:.2} | {:.2} | {}", s.med, s.p99, s.n),
                    None if self.get(case, n, "timed_out_s").is_some()
                        || self.timed_out.get(case.key()).is_some_and(|&t| n >= t) =>
                    {
                        "not run (cold load timed out) | | ".to_string()
                    }
                    None => continue,
                };
                let _ = writeln!(o, "| {n} | {label} | {cell} | {what} |");
            }
        }
        o
    }

    /// New TCP connections per second to one ClusterIP, each proxy with its ratio to
    /// direct.
    fn connection_rate_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n### Data path: new TCP connections per second to one ClusterIP (ratio to direct)\n"
        );
        let _ = writeln!(
            o,
            "| N | direct | ebpf-proxy | ebpf-proxy per packet (bypassed pod) | iptables | nftables |"
        );
        let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: |");
        for &n in &self.services {
            let c = |case| {
                format!(
                    "{} ({})",
                    self.cell(case, n, "cps", 0),
                    self.ratio(case, n, "cps")
                )
            };
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} |",
                self.cell(Case::Direct, n, "cps", 0),
                c(Case::Ebpf),
                c(Case::Bypass),
                c(Case::Iptables),
                c(Case::Nftables)
            );
        }
        o
    }

    /// ebpf-proxy's memory: the agent's RSS (after the first sync and after the first
    /// verification, with their peaks) and the BPF maps' memlock.
    fn memory_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "\n### Memory of ebpf-proxy (MiB)\n");
        let _ = writeln!(
            o,
            "| N | agent RSS after the first sync | peak RSS by then | RSS after the first verification | peak RSS by then | BPF maps (all, memlock) | service maps |"
        );
        let _ = writeln!(o, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        for &n in &self.services {
            let _ = writeln!(
                o,
                "| {n} | {} | {} | {} | {} | {} | {} |",
                self.cell(Case::Ebpf, n, "rss_mib", 1),
                self.cell(Case::Ebpf, n, "peak_rss_mib", 1),
                self.cell(Case::Ebpf, n, "rss_verified_mib", 1),
                self.cell(Case::Ebpf, n, "peak_rss_verified_mib", 1),
                self.cell(Case::Ebpf, n, "map_mib", 1),
                self.cell(Case::Ebpf, n, "service_map_mib", 1)
            );
        }
        o
    }

    /// A north-south cell: median (min–max) of `ns:<path>:<what>`.
    fn ns_cell(&self, case: Case, n: usize, path: &str, what: &str, digits: usize) -> String {
        self.cell(case, n, &format!("ns:{path}:{what}"), digits)
    }

    /// The north-south tables: rates side by side with their ratio to plain routing, TCP
    /// latency, ebpf-proxy's tc program costs, and losses.
    pub fn north_south_tables(&self) -> String {
        let mut o = String::new();
        for &n in &self.north_south {
            o.push_str(&self.ns_rate_table(n));
            o.push_str(&self.ns_latency_table(n));
            o.push_str(&self.ns_program_table(n));
            o.push_str(&self.ns_problems(n));
        }
        o
    }

    /// North-south at `n` ClusterIP services: the section's heading and the rate of every
    /// path, each case with its ratio to plain routing.
    fn ns_rate_table(&self, n: usize) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n### North-south: NodePorts from a client outside the cluster (ratio to plain routing), {n} ClusterIP services loaded too\n"
        );
        let _ = writeln!(
            o,
            "TCP: new connections per second, each with a one-line request and reply; UDP: request/reply exchanges per second on one flow (32-byte datagrams, {} in flight).\n",
            32
        );
        let _ = writeln!(o, "| path | {} |", NS_CASES.map(ns_label).join(" | "));
        let _ = writeln!(o, "{}", ns_align());
        for (path, label) in NS_PATHS {
            let m = format!("ns:{path}:rate");
            let cells: Vec<String> = NS_CASES
                .iter()
                .map(|&c| {
                    let v = self.cell(c, n, &m, 0);
                    if c == Case::Direct || v == "–" {
                        v
                    } else {
                        format!("{v} ({})", self.ratio(c, n, &m))
                    }
                })
                .collect();
            let _ = writeln!(o, "| {label} | {} |", cells.join(" | "));
        }
        o
    }

    /// North-south at `n`: p50 / p99 latency of the TCP paths.
    fn ns_latency_table(&self, n: usize) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\nTCP latency per connection, p50 / p99 (µs):\n\n| path | {} |\n{}",
            NS_CASES.map(ns_label).join(" | "),
            ns_align()
        );
        for (path, label) in NS_PATHS.iter().filter(|(p, _)| p.starts_with("tcp")) {
            let cells: Vec<String> = NS_CASES
                .iter()
                .map(|&c| {
                    format!(
                        "{} / {}",
                        self.ns_cell(c, n, path, "p50_us", 0),
                        self.ns_cell(c, n, path, "p99_us", 0)
                    )
                })
                .collect();
            let _ = writeln!(o, "| {label} | {} |", cells.join(" | "));
        }
        o
    }

    /// North-south at `n`: the cost of ebpf-proxy's programs per path, a row per case and
    /// node whose programs were measured; empty when none were.
    fn ns_program_table(&self, n: usize) -> String {
        let mut o = String::new();
        // (case, node prefix of its metrics, row label): node-a's programs in every
        // ebpf-proxy case, node-b's too with DSR (they decapsulate and answer there).
        let bpf_rows: Vec<(Case, &str, String)> = [
            (Case::Xdp, "", ns_label(Case::Xdp).to_string()),
            (Case::Ebpf, "", ns_label(Case::Ebpf).to_string()),
            (Case::Dsr, "", format!("{}, node-a", ns_label(Case::Dsr))),
            (
                Case::Dsr,
                NODE_B_PREFIX,
                format!("{}, node-b", ns_label(Case::Dsr)),
            ),
        ]
        .into_iter()
        .filter(|(c, node, _)| {
            NS_PATHS.iter().any(|(p, _)| {
                self.get(*c, n, &format!("ns:{p}:{node}bpf_ns_per_flow"))
                    .is_some()
            })
        })
        .collect();
        if bpf_rows.is_empty() {
            return o;
        }
        let _ = writeln!(
            o,
            "\nebpf-proxy's programs (kernel program statistics): ns per packet x packets per TCP connection or UDP exchange, and BPF ns per connection or exchange (warm-up included). node-a's programs in every case; with DSR, node-b's too (plain routing in the other cases):\n"
        );
        let _ = writeln!(
            o,
            "| path | xdp_ingress | tc_ingress | tc_egress | BPF ns per connection / exchange |"
        );
        let _ = writeln!(o, "| --- | ---: | ---: | ---: | ---: |");
        for (c, node, row) in &bpf_rows {
            let c = *c;
            for (path, label) in NS_PATHS {
                // node-b has no part in flows to a0: no row where none of its
                // programs ran.
                if !node.is_empty()
                    && self
                        .get(c, n, &format!("ns:{path}:{node}bpf_ns_per_flow"))
                        .is_none_or(|s| s.max == 0.0)
                {
                    continue;
                }
                let prog = |name: &str| {
                    let g = |m: &str| self.get(c, n, &format!("ns:{path}:{m}:{node}{name}"));
                    match (g("ns_per_run"), g("runs_per_flow")) {
                        (Some(a), Some(b)) => format!("{:.0} x {:.2}", a.med, b.med),
                        _ => "–".into(),
                    }
                };
                let _ = writeln!(
                    o,
                    "| {row}: {label} | {} | {} | {} | {} |",
                    prog("xdp_ingress"),
                    prog("tc_ingress"),
                    prog("tc_egress"),
                    self.ns_cell(c, n, path, &format!("{node}bpf_ns_per_flow"), 0)
                );
            }
        }
        o
    }

    /// North-south at `n`: the failed connections and lost UDP requests of every case and
    /// path; empty when there were none.
    fn ns_problems(&self, n: usize) -> String {
        let mut o = String::new();
        let mut problems = Vec::new();
        for c in NS_CASES {
            for (path, label) in NS_PATHS {
                for (what, unit) in [("errors", "failed"), ("lost", "lost")] {
                    if let Some(s) = self.get(c, n, &format!("ns:{path}:{what}"))
                        && s.max > 0.0
                    {
                        problems.push(format!(
                            "{} — {label}: up to {} {unit} per run",
                            ns_label(c),
                            s.max
                        ));
                    }
                }
            }
        }
        if !problems.is_empty() {
            let _ = writeln!(o, "\nFailed connections and lost UDP requests:\n");
            for p in problems {
                let _ = writeln!(o, "- {p}");
            }
        }
        o
    }
}

/// The column alignment row of the north-south tables: the path, then one right-aligned
/// column per case of [`NS_CASES`].
fn ns_align() -> String {
    format!("| --- |{}", " ---: |".repeat(NS_CASES.len()))
}

/// The rows of the one-endpoint-change table, in its order: (proxy label, case, metric,
/// what is timed).
const CHANGE_ROWS: [(&str, Case, &str, &str); 9] = [
    (
        "ebpf-proxy",
        Case::Ebpf,
        "change_ms",
        "manifest file renamed → new endpoint readable in the pinned maps (polled every 100 µs)",
    ),
    (
        "ebpf-proxy (agent)",
        Case::Ebpf,
        "change_latency_ms",
        "the agent's `latency_us`: watch event received → maps written",
    ),
    (
        "ebpf-proxy (model)",
        Case::Ebpf,
        "change_model_ms",
        "of which the model (`model_us`)",
    ),
    (
        "ebpf-proxy (map writes)",
        Case::Ebpf,
        "change_sync_ms",
        "of which the map writes (`duration_us`)",
    ),
    (
        "ebpf-proxy, API source",
        Case::Ebpf,
        "api_change_ms",
        "EndpointSlice applied on the (in-process) API server → new endpoint readable in the pinned maps",
    ),
    (
        "ebpf-proxy, API source (agent)",
        Case::Ebpf,
        "api_change_latency_ms",
        "the agent's `latency_us`: watch event received → maps written",
    ),
    (
        "ebpf-proxy, API source (metric)",
        Case::Ebpf,
        "api_programming_mean_ms",
        "`kubeproxy_network_programming_duration_seconds`, mean per run (its buckets start at 250 ms)",
    ),
    (
        "iptables",
        Case::Iptables,
        "change_ms",
        "`iptables-restore --noflush` of a partial sync",
    ),
    (
        "nftables",
        Case::Nftables,
        "change_ms",
        "`nft -f` of the changed chains",
    ),
];

/// The control-plane targets of [`Results::targets`]: (what, metric, N, statistic, limit,
/// unit); statistic `p99` is over every change, `med` the median over every change, else
/// (`runs`) the median over runs (min–max shown).
const CONTROL_PLANE_TARGETS: [(&str, &str, usize, &str, f64, &str); 11] = [
    (
        "one endpoint change, watch event → maps written (agent), p99",
        "change_latency_ms",
        10000,
        "p99",
        5.0,
        "ms",
    ),
    (
        "one endpoint change, watch event → maps written (agent), p99",
        "change_latency_ms",
        30000,
        "p99",
        5.0,
        "ms",
    ),
    (
        "one endpoint change, file renamed → visible in the pinned maps, median",
        "change_ms",
        10000,
        "med",
        20.0,
        "ms",
    ),
    (
        "one endpoint change, API source: watch event → maps written (agent), p99",
        "api_change_latency_ms",
        10000,
        "p99",
        5.0,
        "ms",
    ),
    (
        "one endpoint change, API source: watch event → maps written (agent), p99",
        "api_change_latency_ms",
        30000,
        "p99",
        5.0,
        "ms",
    ),
    (
        "agent RSS after the first sync",
        "rss_mib",
        10000,
        "runs",
        100.0,
        "MiB",
    ),
    (
        "agent RSS after the first sync",
        "rss_mib",
        30000,
        "runs",
        250.0,
        "MiB",
    ),
    (
        "agent RSS after its first periodic verification",
        "rss_verified_mib",
        10000,
        "runs",
        100.0,
        "MiB",
    ),
    (
        "agent RSS after its first periodic verification",
        "rss_verified_mib",
        30000,
        "runs",
        250.0,
        "MiB",
    ),
    (
        "cold start, agent process start → first `sync done`",
        "cold_wall_ms",
        30000,
        "runs",
        2000.0,
        "ms",
    ),
    (
        "one endpoint change, file renamed → visible in the pinned maps, median",
        "change_ms",
        30000,
        "med",
        20.0,
        "ms",
    ),
];

/// The north-south cases, in the order of the tables' columns and the chart's bars.
const NS_CASES: [Case; 6] = [
    Case::Direct,
    Case::Xdp,
    Case::Ebpf,
    Case::Dsr,
    Case::Nftables,
    Case::Iptables,
];

/// The north-south paths: metric key and label.
const NS_PATHS: [(&str, &str); 4] = [
    ("tcp_local", "TCP conn/s, backend on the node"),
    (
        "tcp_remote",
        "TCP conn/s, backend on another node (SNAT; DSR case: DSR)",
    ),
    ("udp_local", "UDP exchanges/s, backend on the node"),
    (
        "udp_remote",
        "UDP exchanges/s, backend on another node (SNAT; DSR case: DSR)",
    ),
];

/// Prefix of the north-south program metrics of node-b's agent (the DSR case), before the
/// program name (`ns:<path>:ns_per_run:node-b/tc_ingress`) or the metric
/// (`ns:<path>:node-b/bpf_ns_per_flow`).
pub const NODE_B_PREFIX: &str = "node-b/";

/// A case's name in the north-south tables.
fn ns_label(c: Case) -> &'static str {
    match c {
        Case::Direct => "plain routing (floor)",
        Case::Ebpf => "ebpf-proxy (tc)",
        // Not a north-south case (see `northsouth::run`).
        Case::Bypass => "ebpf-proxy per packet (bypassed pod)",
        Case::Xdp => "ebpf-proxy (XDP)",
        Case::Dsr => "ebpf-proxy (DSR)",
        Case::Nftables => "kube-proxy nftables rules",
        Case::Iptables => "kube-proxy iptables rules",
    }
}

// ---------------------------------------------------------------------------------------
// charts
// ---------------------------------------------------------------------------------------

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

type Series = (String, RGBColor, Vec<(f64, Stat)>);

fn series(r: &Results, case: Case, m: &str, label: &str, color: RGBColor) -> Series {
    let pts = r
        .services
        .iter()
        .filter_map(|&n| Some((n as f64, r.get(case, n, m)?)))
        .collect();
    (label.to_string(), color, pts)
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    ylabel: &str,
    log_y: bool,
    data: &[Series],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let xs: Vec<f64> = data.iter().flat_map(|s| s.2.iter().map(|p| p.0)).collect();
    let ys: Vec<f64> = data
        .iter()
        .flat_map(|s| s.2.iter().flat_map(|p| [p.1.min, p.1.max]))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    if xs.is_empty() || ys.is_empty() {
        return Ok(());
    }
    let ns = &xs;
    let (x0, x1) = (
        xs.iter().cloned().fold(f64::MAX, f64::min) / 1.5,
        xs.iter().cloned().fold(0.0, f64::max) * 1.5,
    );
    let (y0, y1) = (
        ys.iter().cloned().fold(f64::MAX, f64::min),
        ys.iter().cloned().fold(0.0, f64::max),
    );
    let mut b = ChartBuilder::on(area);
    b.caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(80);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc("services (N), log scale")
                .y_desc(ylabel)
                .light_line_style(WHITE)
                .x_label_formatter(&|v: &f64| {
                    let r = v.round();
                    let mut p = 1.0;
                    while p < r {
                        p *= 10.0;
                    }
                    if (r - p).abs() < 0.5 || ns.iter().any(|n| (r - n).abs() < 0.5) {
                        format!("{r:.0}")
                    } else {
                        String::new()
                    }
                })
                .y_label_formatter(&|v: &f64| {
                    if v.abs() >= 10.0 {
                        format!("{v:.0}")
                    } else {
                        format!("{v:.1}")
                    }
                })
                .label_style(("sans-serif", 15))
                .axis_desc_style(("sans-serif", 16))
                .draw()?;
            for (label, color, pts) in data {
                let c = *color;
                chart
                    .draw_series(LineSeries::new(
                        pts.iter().map(|(x, s)| (*x, s.med)),
                        c.stroke_width(2),
                    ))?
                    .label(label.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                    });
                chart.draw_series(
                    pts.iter()
                        .map(|(x, s)| Circle::new((*x, s.med), 4, c.filled())),
                )?;
                chart.draw_series(pts.iter().map(|(x, s)| {
                    ErrorBar::new_vertical(
                        *x,
                        s.min.max(y0 * 0.9),
                        s.med,
                        s.max,
                        c.stroke_width(1),
                        8,
                    )
                }))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .label_font(("sans-serif", 15))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()?;
        }};
    }
    if log_y {
        draw!(b.build_cartesian_2d((x0..x1).log_scale(), (y0 / 2.0..y1 * 3.0).log_scale())?);
    } else {
        draw!(b.build_cartesian_2d((x0..x1).log_scale(), 0.0..y1 * 1.25)?);
    }
    Ok(())
}

/// Writes `control_plane.png` and `data_path.png`.
pub fn charts(r: &Results, dir: &Path) -> Result<()> {
    let font = match fs::read(FONT) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("no charts: cannot read {FONT} ({e}); install fonts-dejavu-core");
            return Ok(());
        }
    };
    let font: &'static [u8] = Box::leak(font.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, font)
        .map_err(|_| anyhow::anyhow!("invalid font {FONT}"))?;

    if !r.services.is_empty() {
        cluster_ip_charts(r, dir)?;
    }
    if let Some(&n) = r.north_south.last() {
        north_south_chart(r, n, dir)?;
    }
    Ok(())
}

/// Writes `control_plane.png` and `data_path.png`.
fn cluster_ip_charts(r: &Results, dir: &Path) -> Result<()> {
    let cp = dir.join("control_plane.png");
    {
        let root = BitMapBackend::new(&cp, (1000, 620)).into_drawing_area();
        root.fill(&WHITE)?;
        panel(
            &root,
            &format!(
                "Programming N services x 10 endpoints from cold — {}",
                short_machine(r)
            ),
            "milliseconds (log scale)",
            true,
            &[
                series(
                    r,
                    Case::Ebpf,
                    "cold_ms",
                    "ebpf-proxy: sync (map writes)",
                    Case::Ebpf.color(),
                ),
                series(
                    r,
                    Case::Ebpf,
                    "cold_wall_ms",
                    "ebpf-proxy: agent start → synced",
                    RGBColor(0x9e, 0xc7, 0xe8),
                ),
                series(
                    r,
                    Case::Iptables,
                    "cold_ms",
                    "iptables-restore (kube-proxy iptables mode)",
                    Case::Iptables.color(),
                ),
                series(
                    r,
                    Case::Nftables,
                    "cold_ms",
                    "nft -f (kube-proxy nftables mode)",
                    Case::Nftables.color(),
                ),
            ],
        )?;
        root.present().context("write control_plane.png")?;
    }
    let dp = dir.join("data_path.png");
    {
        let root = BitMapBackend::new(&dp, (1000, 1100)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(550);
        let cases = [Case::Direct, Case::Ebpf, Case::Iptables, Case::Nftables];
        let s = |m: &str| -> Vec<Series> {
            cases
                .iter()
                .map(|&c| series(r, c, m, c.label(), c.color()))
                .collect()
        };
        panel(
            &top,
            "New TCP connections per second to one ClusterIP",
            "connections / s",
            false,
            &s("cps"),
        )?;
        panel(
            &bottom,
            "p99 latency per connection (connect + request + reply)",
            "µs (log scale)",
            true,
            &s("p99_us"),
        )?;
        root.present().context("write data_path.png")?;
    }
    Ok(())
}

/// Writes `north_south.png`: the north-south rates at N (bars: median, whiskers: min–max
/// over runs), TCP and UDP side by side, each with the local and the remote backend.
fn north_south_chart(r: &Results, n: usize, dir: &Path) -> Result<()> {
    const CASES: [Case; 6] = NS_CASES;
    let file = dir.join("north_south.png");
    let root = BitMapBackend::new(&file, (1200, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(40);
    title.draw(&Text::new(
        format!(
            "NodePorts from a client outside the cluster, {n} ClusterIP services loaded too — {}",
            short_machine(r)
        ),
        (20, 10),
        ("sans-serif", 20),
    ))?;
    let panels = body.split_evenly((1, 2));
    for (area, (proto, unit)) in panels.iter().zip([
        (
            "tcp",
            "new TCP connections / s (connect, request, reply, close)",
        ),
        (
            "udp",
            "UDP request/reply exchanges / s (one flow, 32 in flight)",
        ),
    ]) {
        let stats: Vec<Vec<Option<Stat>>> = ["local", "remote"]
            .iter()
            .map(|side| {
                CASES
                    .iter()
                    .map(|&c| r.get(c, n, &format!("ns:{proto}_{side}:rate")))
                    .collect()
            })
            .collect();
        let ymax = stats
            .iter()
            .flatten()
            .flatten()
            .map(|s| s.max)
            .fold(0.0, f64::max);
        if ymax <= 0.0 {
            continue;
        }
        let mut chart = ChartBuilder::on(area)
            .caption(proto.to_uppercase(), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            // Head room for the legend's six entries above the bars.
            .build_cartesian_2d(0.0..2.0, 0.0..ymax * 1.5)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            // Key points at 0, 0.5, .., 2: the groups' centres carry their names.
            .x_labels(5)
            .x_label_formatter(&|v: &f64| {
                if (v - 0.5).abs() < 0.01 {
                    "backend on the node".into()
                } else if (v - 1.5).abs() < 0.01 {
                    "backend on another node (SNAT / DSR)".into()
                } else {
                    String::new()
                }
            })
            .y_desc(unit)
            .y_label_formatter(&|v: &f64| format!("{v:.0}"))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 14))
            .draw()?;
        // Each group (one unit wide) holds one bar per case in its middle 0.8.
        let w = 0.8 / CASES.len() as f64;
        for (k, &case) in CASES.iter().enumerate() {
            let c = case.color();
            let bars: Vec<(f64, Stat)> = stats
                .iter()
                .enumerate()
                .filter_map(|(g, row)| Some((g as f64 + 0.1 + w * k as f64, row[k]?)))
                .collect();
            chart
                .draw_series(bars.iter().map(|(x, s)| {
                    Rectangle::new([(*x + 0.05 * w, 0.0), (*x + 0.95 * w, s.med)], c.filled())
                }))?
                .label(ns_label(case))
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
            chart.draw_series(bars.iter().map(|(x, s)| {
                ErrorBar::new_vertical(*x + w / 2.0, s.min, s.med, s.max, BLACK.stroke_width(1), 6)
            }))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present().context("write north_south.png")?;
    Ok(())
}

fn short_machine(r: &Results) -> String {
    format!("{} cores, Linux {}", r.machine.cores, r.machine.kernel)
}
