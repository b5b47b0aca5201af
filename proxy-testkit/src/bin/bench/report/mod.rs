//! Samples, statistics (median, min-max, p99), the markdown report and the PNG charts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;

mod charts;
mod cluster_ip;
mod north_south;
mod targets;

pub use charts::charts;
pub use north_south::NODE_B_PREFIX;

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
}
